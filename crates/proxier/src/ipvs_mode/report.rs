//! What a sync reports: its kind, the subsystems that failed or wait for a retry, and the
//! (bounded) error texts.

use super::*;

/// Which kind of sync ran.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SyncKind {
    /// Only changed services.
    Incremental,
    /// Full read, diff and repair.
    Full,
}

/// What one sync did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SyncReport {
    /// Incremental or full.
    pub kind: SyncKind,
    /// Services re-derived.
    pub services_derived: usize,
    /// IPVS operations sent (including `drained`).
    pub ipvs_ops: usize,
    /// Of `ipvs_ops`: draining real servers deleted by the drain check that ran at the end of
    /// this sync (their connections ended, or the cap passed).
    pub drained: usize,
    /// IPVS operations that failed.
    pub ipvs_failures: usize,
    /// Addresses bound or unbound.
    pub address_ops: usize,
    /// ipset members added or deleted (plus sets created).
    pub ipset_changes: usize,
    /// An iptables-restore ran.
    pub iptables_restored: bool,
    /// An iptables-restore failed (`kubeproxy_sync_proxy_rules_iptables_restore_failures_total`).
    pub iptables_restore_failed: bool,
    /// Stale UDP conntrack entries deleted.
    pub conntrack_deleted: u64,
    /// How long this sync's conntrack cleanup took, when one ran (upstream's
    /// `kubeproxy_conntrack_reconciler_sync_duration_seconds`); `None` when there was nothing
    /// stale to delete.
    pub conntrack_duration: Option<Duration>,
    /// Full sync after the first: differences found between the kernel and the applied
    /// state (drift), per subsystem.
    pub drift: BTreeMap<&'static str, usize>,
    /// Errors (one line each, naming the object or subsystem).
    pub errors: Vec<String>,
    /// Subsystems that failed in this sync (a fixed set: metric labels, health reasons).
    pub failed: BTreeMap<Subsystem, SubsystemFailure>,
    /// Requests the kernel refused for Services isolated by it, per subsystem (see
    /// [`super::refusal`]): not failures, the node stays healthy.
    pub refused: BTreeMap<Subsystem, usize>,
    /// Subsystems with a retry outstanding after this sync (failed now or earlier, not yet
    /// repaired). A sync is healthy only when this is empty.
    pub retrying: BTreeSet<Subsystem>,
    /// Wall time.
    pub duration: Duration,
    /// External VIP claims lost to another Service after this sync (see [`desired::vip`]).
    pub vip_conflicts: usize,
    /// External claims on this node's addresses the node keeps (see `desired::vip::node`).
    pub node_address_conflicts: desired::vip::NodeConflicts,
    /// Where the wall time went, phase by phase in the order they ran (for the log: which
    /// part of a slow sync was slow).
    pub phases: Vec<(&'static str, Duration)>,
}

/// How one subsystem failed in one sync.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct SubsystemFailure {
    /// Failed operations.
    pub count: usize,
    /// The last error's text, at most [`MAX_ERROR_LEN`] bytes.
    pub last_error: String,
}

/// The longest error text a [`SubsystemFailure`] keeps.
pub const MAX_ERROR_LEN: usize = 512;

/// `s` cut to at most `max` bytes on a character boundary (with `…` when cut).
pub fn truncate_text(s: &str, max: usize) -> String {
    if s.len() <= max {
        return s.to_string();
    }
    let mut end = max.saturating_sub(3);
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}…", &s[..end])
}

impl SyncReport {
    /// An empty report of `kind`.
    pub fn new(kind: SyncKind) -> SyncReport {
        SyncReport {
            kind,
            services_derived: 0,
            ipvs_ops: 0,
            drained: 0,
            ipvs_failures: 0,
            address_ops: 0,
            ipset_changes: 0,
            iptables_restored: false,
            iptables_restore_failed: false,
            conntrack_deleted: 0,
            conntrack_duration: None,
            drift: BTreeMap::new(),
            errors: Vec::new(),
            failed: BTreeMap::new(),
            refused: BTreeMap::new(),
            retrying: BTreeSet::new(),
            duration: Duration::ZERO,
            vip_conflicts: 0,
            node_address_conflicts: desired::vip::NodeConflicts::default(),
            phases: Vec::new(),
        }
    }

    /// Records that `phase` ran from `since` until now; returns now (the next phase's start).
    pub fn lap(&mut self, phase: &'static str, since: Instant) -> Instant {
        let now = Instant::now();
        self.phases
            .push((phase, now.saturating_duration_since(since)));
        now
    }

    /// The phases as `name=seconds` pairs, e.g. `derive=0.012 ipvs=1.204`.
    pub fn phases_text(&self) -> String {
        let parts: Vec<String> = self
            .phases
            .iter()
            .map(|(name, d)| format!("{name}={:.3}", d.as_secs_f64()))
            .collect();
        parts.join(" ")
    }

    /// True when the sync had no error.
    pub fn ok(&self) -> bool {
        self.errors.is_empty() && self.failed.is_empty()
    }

    /// True when nothing failed and no retry is outstanding: the family is in sync (what
    /// `/healthz` counts as an update).
    pub fn healthy(&self) -> bool {
        self.ok() && self.retrying.is_empty()
    }

    /// Records a failure of `subsystem` (also as an error line).
    pub fn fail(&mut self, subsystem: Subsystem, error: impl Into<String>) {
        let error = error.into();
        let f = self.failed.entry(subsystem).or_default();
        f.count += 1;
        f.last_error = truncate_text(&error, MAX_ERROR_LEN);
        self.errors.push(error);
    }
}
