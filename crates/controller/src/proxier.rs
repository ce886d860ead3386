//! The proxier: keeps one address family of the node's kernel equal to the desired state.
//!
//! Two kinds of sync:
//! - **incremental**: only the services marked dirty since the last sync are re-derived; the
//!   [`Delta`] of those services is applied in the order written in [`crate::diff`]. No kernel
//!   read, no dump: work is proportional to the change.
//! - **full** (startup and every `syncPeriod`): one read of each subsystem (one IPVS dump, the
//!   kube-ipvs0 addresses, one `ipset save`), a diff against the whole desired state, and only
//!   the differences are written. At startup this adopts what a previous run (or kube-proxy)
//!   left behind without a flush; later it repairs drift and counts the repairs.
//!
//! Failures are isolated: an IPVS operation that fails marks its virtual server for a targeted
//! re-check (read just that virtual server, diff, apply); a failed address change re-reads and
//! repairs kube-ipvs0; a failed ipset apply re-reads and repairs the sets; a failed
//! iptables-restore is retried (forced); failed conntrack deletions keep their filters. Every one of
//! these retries follows the one policy of [`crate::retry`] (backoff from minSyncPeriod to
//! syncPeriod, jittered, reset on success), one [`Backoff`] per subsystem. A full sync whose kernel
//! read failed is not done: it stays requested and is retried with backoff, and nothing is
//! deleted from a subsystem whose read failed. Each [`SyncReport`] names the subsystems that
//! failed ([`SyncReport::failed`]) and those still waiting for a retry
//! ([`SyncReport::retrying`]). A rejected ipset entry is reported with the service it came from.

use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;
use std::time::{Duration, Instant};

use ipset::{EntryChange, IpsetDiff, SetKind};
use ipvs_netlink::{Destination, Family, Op, ServiceKey};

use crate::conntrack::ConntrackFilter;
use crate::desired::{
    owned_by_proxy, service_desired_except, set_family, Delta, Desired, IpsetEntry,
};
use crate::diff::{diff_ipvs, diff_set, IpvsOps, IpvsTable};
use crate::kernel::{Kernel, KernelError};
use crate::model::{NodeInfo, ProxyConfig, Rejections, ServiceName};
use crate::retry::{Backoff, RetryPolicy, Subsystem};
use crate::store::{Changes, Store};

/// iptables settings that do not come from services.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RulesConfig {
    /// Bit of the masquerade mark (`masqueradeBit`, default 14).
    pub masquerade_bit: u32,
    /// Local-traffic detection.
    pub local_detect: iptables::LocalDetect,
    /// `--random-fully` on MASQUERADE.
    pub random_fully: bool,
    /// `detectLocalMode: NodeCIDR`: traffic from the Node object's `spec.podCIDRs` (of the
    /// proxy's family) is local, and `local_detect` is ignored. Upstream (`NewDetectLocalByCIDR`
    /// with the node's podCIDRs, cmd/kube-proxy/app/server.go) waits for them at start and
    /// restarts when they change; here the rules follow the Node object, and until it has
    /// podCIDRs no traffic counts as local (node-originated traffic to a VIP is masqueraded).
    pub node_cidr: bool,
}

impl RulesConfig {
    /// The local-traffic detection to render for one family: the Node's podCIDRs under
    /// NodeCIDR (none until it has some), the family's cluster CIDRs when no other detection is
    /// configured, else the configured one.
    pub fn local_detect_for(
        &self,
        cluster_cidrs: &[ipnet::IpNet],
        pod_cidrs: &[ipnet::IpNet],
    ) -> iptables::LocalDetect {
        match &self.local_detect {
            _ if self.node_cidr => {
                if pod_cidrs.is_empty() {
                    iptables::LocalDetect::None
                } else {
                    iptables::LocalDetect::Cidrs(pod_cidrs.to_vec())
                }
            }
            iptables::LocalDetect::None if !cluster_cidrs.is_empty() => {
                iptables::LocalDetect::Cidrs(cluster_cidrs.to_vec())
            }
            other => other.clone(),
        }
    }

    /// Under NodeCIDR, takes the Node's podCIDRs of `family` into `held`; true when they
    /// changed (the rules must be rendered again). Always false otherwise.
    pub fn refresh_pod_cidrs(
        &self,
        held: &mut Vec<ipnet::IpNet>,
        store: &Store,
        family: ipvs_netlink::Family,
    ) -> bool {
        if !self.node_cidr {
            return false;
        }
        let cidrs = NodeInfo::pod_cidrs_of(store.node(), family);
        if cidrs == *held {
            return false;
        }
        tracing::info!(?family, old = ?held, new = ?cidrs,
            "detectLocalMode NodeCIDR: the Node's podCIDRs changed; re-rendering the rules");
        *held = cidrs;
        true
    }
}

impl Default for RulesConfig {
    fn default() -> Self {
        RulesConfig {
            masquerade_bit: 14,
            local_detect: iptables::LocalDetect::None,
            random_fully: true,
            node_cidr: false,
        }
    }
}

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
    /// Subsystems with a retry outstanding after this sync (failed now or earlier, not yet
    /// repaired). A sync is healthy only when this is empty.
    pub retrying: BTreeSet<Subsystem>,
    /// Wall time.
    pub duration: Duration,
    /// External VIP claims lost to another Service after this sync (see [`crate::vip`]).
    pub vip_conflicts: usize,
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
            retrying: BTreeSet::new(),
            duration: Duration::ZERO,
            vip_conflicts: 0,
        }
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

/// One [`Backoff`] per subsystem of one proxier.
#[derive(Debug, Clone)]
struct Retries {
    /// The kernel reads of a full sync.
    full: Backoff,
    ipvs: Backoff,
    address: Backoff,
    ipset: Backoff,
    iptables: Backoff,
    conntrack: Backoff,
}

impl Retries {
    fn new(p: RetryPolicy) -> Retries {
        Retries {
            full: Backoff::new(p),
            ipvs: Backoff::new(p),
            address: Backoff::new(p),
            ipset: Backoff::new(p),
            iptables: Backoff::new(p),
            conntrack: Backoff::new(p),
        }
    }
}

/// IPVS operations sent per [`Kernel::apply_ipvs`] call (see `Proxier::apply_ipvs`).
pub const IPVS_APPLY_CHUNK: usize = 4096;

/// The proxier of one address family.
#[derive(Debug)]
pub struct Proxier {
    cfg: ProxyConfig,
    rules: RulesConfig,
    node_name: String,
    desired: Desired,
    dirty: BTreeSet<ServiceName>,
    node_dirty: bool,
    /// The Node's podCIDRs of the family (detectLocalMode NodeCIDR).
    pod_cidrs: Vec<ipnet::IpNet>,
    zone: Option<String>,
    applied_once: bool,
    full_requested: bool,
    repair: BTreeSet<ServiceKey>,
    recheck_addresses: bool,
    set_counts: BTreeMap<SetKind, usize>,
    rejections: Rejections,
    vips: crate::vip::VipClaims,
    drain: DrainConfig,
    draining: BTreeMap<(ServiceKey, IpAddr, u16), Instant>,
    drain_due: Option<Instant>,
    drain_stats: DrainStats,
    conntrack: Vec<ConntrackFilter>,
    last_rules: Option<String>,
    /// Invalid Services in the store with no last-good state: their kernel state is adopted
    /// at the next full sync (see [`crate::adopt`]).
    to_adopt: BTreeSet<ServiceName>,
    retry: Retries,
    /// An ipset apply failed: re-read and repair the sets when the backoff allows.
    recheck_sets: bool,
    /// An iptables-restore failed: restore again (forced) when the backoff allows.
    recheck_rules: bool,
    /// Subsystems whose kernel read failed in the last full sync (the full sync is not done).
    full_failed: BTreeSet<Subsystem>,
    /// The time the current sync runs at (see [`Proxier::sync_at`]).
    now: Instant,
}

/// Graceful termination of real servers.
///
/// A TCP or SCTP real server that leaves its virtual server is not deleted at once: its weight
/// goes to 0 so no new connection picks it, and it is deleted as soon as the kernel reports no
/// active (established) connection on it, or when `cap` has passed. Closed connections linger
/// in IPVS's table as TIME_WAIT (counted in InActConn) for about two minutes; with
/// `expire_nodest_conn=1` deleting a real server that only has those is harmless, so only
/// ActiveConn is waited for. UDP real servers are deleted at once (UDP has no end of
/// connection to wait for; stale conntrack entries are cleaned instead).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DrainConfig {
    /// Drain instead of deleting (false: delete at once, like a plain diff).
    pub enabled: bool,
    /// Longest time a real server drains (`--drain-timeout`).
    pub cap: Duration,
    /// How often draining real servers are checked (only those are read).
    pub interval: Duration,
}

impl Default for DrainConfig {
    fn default() -> Self {
        DrainConfig {
            enabled: true,
            // IPVS's own idle timeout for an established TCP connection: a connection idle
            // that long is gone from IPVS's table anyway.
            cap: Duration::from_secs(15 * 60),
            interval: Duration::from_millis(500),
        }
    }
}

/// Counters of graceful termination.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct DrainStats {
    /// Real servers deleted after their last active connection ended.
    pub removed_drained: u64,
    /// Real servers deleted because the cap passed.
    pub removed_cap: u64,
    /// Real servers that came back while draining (weight restored).
    pub restored: u64,
}

impl Proxier {
    /// A proxier for `cfg.family` on node `node_name`.
    pub fn new(cfg: ProxyConfig, rules: RulesConfig, node_name: impl Into<String>) -> Proxier {
        let desired = Desired::new(&cfg);
        Proxier {
            cfg,
            rules,
            node_name: node_name.into(),
            desired,
            dirty: BTreeSet::new(),
            node_dirty: false,
            zone: None,
            applied_once: false,
            full_requested: true,
            repair: BTreeSet::new(),
            recheck_addresses: false,
            set_counts: BTreeMap::new(),
            rejections: Rejections::default(),
            vips: crate::vip::VipClaims::default(),
            drain: DrainConfig::default(),
            draining: BTreeMap::new(),
            drain_due: None,
            drain_stats: DrainStats::default(),
            conntrack: Vec::new(),
            last_rules: None,
            to_adopt: BTreeSet::new(),
            retry: Retries::new(RetryPolicy::default()),
            recheck_sets: false,
            recheck_rules: false,
            pod_cidrs: Vec::new(),
            full_failed: BTreeSet::new(),
            now: Instant::now(),
        }
    }

    /// Sets the retry policy of every subsystem (minSyncPeriod to syncPeriod).
    pub fn with_retry(mut self, policy: RetryPolicy) -> Proxier {
        self.retry = Retries::new(policy);
        self
    }

    /// Consecutive failures of a subsystem's retries (0 when it is in sync); `None` for a
    /// subsystem this proxier does not retry. `Source` and `Sysctl` are not the proxier's.
    pub fn retry_failures(&self, subsystem: Subsystem) -> Option<u32> {
        self.backoff(subsystem).map(Backoff::failures)
    }

    /// When a subsystem's next retry is due, if one is outstanding.
    pub fn retry_due_of(&self, subsystem: Subsystem) -> Option<Instant> {
        self.backoff(subsystem).and_then(Backoff::due)
    }

    /// A full sync is requested (or adoption has not completed).
    pub fn full_pending(&self) -> bool {
        self.full_requested || !self.applied_once
    }

    fn backoff(&self, subsystem: Subsystem) -> Option<&Backoff> {
        match subsystem {
            Subsystem::Ipvs => Some(&self.retry.ipvs),
            Subsystem::Address => Some(&self.retry.address),
            Subsystem::Ipset => Some(&self.retry.ipset),
            Subsystem::Iptables => Some(&self.retry.iptables),
            Subsystem::Conntrack => Some(&self.retry.conntrack),
            Subsystem::Sysctl | Subsystem::Source => None,
        }
    }

    /// Subsystems with a retry outstanding.
    fn retrying(&self) -> BTreeSet<Subsystem> {
        let mut out = BTreeSet::new();
        if !self.repair.is_empty() {
            out.insert(Subsystem::Ipvs);
        }
        if self.recheck_addresses {
            out.insert(Subsystem::Address);
        }
        if self.recheck_sets {
            out.insert(Subsystem::Ipset);
        }
        if self.recheck_rules {
            out.insert(Subsystem::Iptables);
        }
        if !self.conntrack.is_empty() && self.retry.conntrack.failing() {
            out.insert(Subsystem::Conntrack);
        }
        // While a full sync waits for the retry of a failed read, what it covers is not
        // known to be in sync.
        out.extend(self.full_failed.iter().copied());
        out
    }

    /// Sets how real servers are drained.
    pub fn with_drain(mut self, drain: DrainConfig) -> Proxier {
        self.drain = drain;
        self
    }

    /// Real servers draining now.
    pub fn draining(&self) -> usize {
        self.draining.len()
    }

    /// IPVS virtual servers and real servers this proxier has programmed: the desired table
    /// (each key from its winning claimant) plus the real servers draining at weight 0, which
    /// are still in the kernel (`kube_ipvs_ipvs_services`, `kube_ipvs_ipvs_destinations`).
    pub fn ipvs_programmed(&self) -> (usize, usize) {
        let (services, reals) = self.desired.ipvs_counts();
        (services, reals + self.draining.len())
    }

    /// Graceful-termination counters.
    pub fn drain_stats(&self) -> DrainStats {
        self.drain_stats
    }

    /// The configuration.
    pub fn config(&self) -> &ProxyConfig {
        &self.cfg
    }

    /// The address family.
    pub fn family(&self) -> Family {
        self.cfg.family
    }

    /// The desired state as of the last sync.
    pub fn desired(&self) -> &Desired {
        &self.desired
    }

    /// Objects currently skipped as invalid, and the total ever counted.
    pub fn rejections(&self) -> &Rejections {
        &self.rejections
    }

    /// Objects newly rejected since the last call (see [`Rejections::take_new`]).
    pub fn take_rejections(&mut self) -> Vec<(String, crate::model::Invalid)> {
        self.rejections.take_new()
    }

    /// Records changes from the store (services to re-derive, node changes).
    pub fn note(&mut self, changes: &Changes) {
        self.dirty.extend(changes.dirty.iter().cloned());
        self.node_dirty |= changes.node_changed;
    }

    /// Node addresses changed (from netif): NodePort-dependent services need re-deriving.
    pub fn note_node_addresses(&mut self) {
        self.node_dirty = true;
    }

    /// Asks for a full sync (drift check) at the next [`Proxier::sync`].
    pub fn request_full(&mut self) {
        self.full_requested = true;
    }

    /// True when a full sync may run at `now` (requested, and any failed read's backoff passed).
    fn full_due(&self, now: Instant) -> bool {
        self.full_pending() && self.retry.full.ready(now)
    }

    /// True when a sync has work to do now.
    pub fn pending(&self, now: Instant) -> bool {
        // Until the first full sync has read the kernel, nothing else runs.
        let adopted = self.applied_once;
        self.full_due(now)
            || (adopted && (!self.dirty.is_empty() || self.node_dirty))
            || (adopted && self.recheck_addresses && self.retry.address.ready(now))
            || (adopted && self.recheck_sets && self.retry.ipset.ready(now))
            || (adopted && self.recheck_rules && self.retry.iptables.ready(now))
            || (!self.repair.is_empty() && self.retry.ipvs.ready(now))
            || (!self.conntrack.is_empty() && self.retry.conntrack.ready(now))
            || self.drain_due.is_some_and(|t| now >= t)
    }

    /// When the next retry of failed operations (or a drain check) is due, if any.
    pub fn retry_due(&self) -> Option<Instant> {
        let waiting = [
            (self.full_pending(), &self.retry.full),
            (!self.repair.is_empty(), &self.retry.ipvs),
            (self.recheck_addresses, &self.retry.address),
            (self.recheck_sets, &self.retry.ipset),
            (self.recheck_rules, &self.retry.iptables),
            (!self.conntrack.is_empty(), &self.retry.conntrack),
        ];
        waiting
            .iter()
            .filter(|(on, _)| *on)
            .filter_map(|(_, b)| b.due())
            .chain(self.drain_due)
            .min()
    }

    /// Runs one sync: full when requested (and always the first time), else incremental.
    pub fn sync(
        &mut self,
        store: &Store,
        node_addresses: &BTreeSet<IpAddr>,
        kernel: &mut dyn Kernel,
    ) -> SyncReport {
        self.sync_at(Instant::now(), store, node_addresses, kernel)
    }

    /// [`Proxier::sync`] as if it ran at `now`: retries due by `now` run, and failures schedule
    /// their retries from `now` (tests drive the backoff with explicit instants).
    pub fn sync_at(
        &mut self,
        now: Instant,
        store: &Store,
        node_addresses: &BTreeSet<IpAddr>,
        kernel: &mut dyn Kernel,
    ) -> SyncReport {
        let start = Instant::now();
        self.now = now;
        if self.refresh_pod_cidrs(store) {
            self.recheck_rules = true;
        }
        let mut report = if self.full_due(now) {
            self.full_sync(store, node_addresses, kernel)
        } else if self.applied_once {
            let mut report = self.incremental_sync(store, node_addresses, kernel);
            let now = self.now;
            if self.recheck_addresses && self.retry.address.ready(now) {
                self.recheck_addresses = false;
                self.repair_addresses(kernel, &mut report);
            }
            if self.recheck_sets && self.retry.ipset.ready(now) {
                self.repair_sets(kernel, &mut report);
            }
            if self.recheck_rules && self.retry.iptables.ready(now) {
                self.apply_rules(kernel, true, None, &mut report);
            }
            report
        } else {
            // Waiting for the retry of the first full sync's failed read.
            SyncReport::new(SyncKind::Incremental)
        };
        if !self.repair.is_empty() && self.retry.ipvs.ready(self.now) {
            self.retry_repairs(kernel, &mut report);
        }
        if self.drain_due.is_some_and(|t| Instant::now() >= t) {
            self.check_drains(kernel, &mut report);
        }
        if self.retry.conntrack.ready(self.now) {
            self.flush_conntrack(kernel, &mut report);
        }
        report.vip_conflicts = self.vips.conflicts();
        report.retrying = self.retrying();
        report.duration = start.elapsed();
        report
    }

    /// Derives every service in `store` into the desired state without touching a kernel
    /// (for `plan`).
    pub fn derive_all(&mut self, store: &Store, node_addresses: &BTreeSet<IpAddr>) {
        self.refresh_pod_cidrs(store);
        let node = self.node_info(store, node_addresses);
        let mut report = SyncReport::new(SyncKind::Full);
        let mut names: BTreeSet<ServiceName> = store.service_names().cloned().collect();
        names.extend(self.desired_names());
        let changes = self.derive(store, &node, names, &mut report);
        let _ = self.desired.update_services(changes);
        self.set_counts = count_sets(&self.desired);
    }

    /// detectLocalMode NodeCIDR: takes the Node's podCIDRs; true when they changed.
    fn refresh_pod_cidrs(&mut self, store: &Store) -> bool {
        self.rules
            .refresh_pod_cidrs(&mut self.pod_cidrs, store, self.cfg.family)
    }

    fn node_info(&self, store: &Store, node_addresses: &BTreeSet<IpAddr>) -> NodeInfo {
        NodeInfo::from_node(&self.node_name, store.node(), node_addresses.clone())
    }

    /// External VIP claims lost to another Service (the `kube_ipvs_vip_conflicts` gauge).
    pub fn vip_conflicts(&self) -> usize {
        self.vips.conflicts()
    }

    /// Derives the given services (and those whose VIP claims they affect); invalid ones keep
    /// their last good state.
    fn derive(
        &mut self,
        store: &Store,
        node: &NodeInfo,
        names: impl IntoIterator<Item = ServiceName>,
        report: &mut SyncReport,
    ) -> Vec<(ServiceName, Option<crate::desired::ServiceDesired>)> {
        let mut changes = Vec::new();
        let names = self.vips.update(store, &self.cfg, names);
        for name in names {
            report.services_derived += 1;
            let key = format!("service {name}");
            let vip_key = format!("vip {name}");
            let Some(svc) = store.service(&name) else {
                self.rejections.clear(&key);
                self.to_adopt.remove(&name);
                self.rejections.clear(&vip_key);
                self.rejections.clear_owned(&key);
                changes.push((name, None));
                continue;
            };
            let slices = store.slices_of(&name);
            let lost = self.vips.lost(&name);
            let lost_vips: BTreeSet<crate::vip::Vip> = lost.keys().copied().collect();
            match service_desired_except(svc, &slices, &self.cfg, node, &lost_vips) {
                Ok(d) => {
                    self.rejections.clear(&key);
                    self.to_adopt.remove(&name);
                    match crate::vip::conflict_reason(&lost) {
                        Some(why) => {
                            self.rejections.reject(&vip_key, &why);
                        }
                        None => self.rejections.clear(&vip_key),
                    }
                    let slices: Vec<(String, crate::model::Invalid)> = d
                        .rejected_slices
                        .iter()
                        .map(|(slice, why)| {
                            (
                                format!("endpointslice {}/{slice}", name.namespace),
                                why.clone(),
                            )
                        })
                        .collect();
                    // Slices fixed or deleted since the last derivation are cleared.
                    self.rejections.replace_owned(&key, &slices);
                    changes.push((name, d.desired));
                }
                Err(why) => {
                    // Logged once per reason by `reject`; the last good state stays applied,
                    // and with none (a restart) the kernel's state is adopted at a full sync.
                    self.rejections.reject(&key, &why);
                    if self.desired.service(&name).is_none() {
                        self.to_adopt.insert(name);
                    }
                }
            }
        }
        changes
    }

    fn dirty_names(&mut self, store: &Store, node: &NodeInfo) -> BTreeSet<ServiceName> {
        let mut names = std::mem::take(&mut self.dirty);
        if std::mem::take(&mut self.node_dirty) {
            if node.zone != self.zone {
                self.zone = node.zone.clone();
                names.extend(store.service_names().cloned());
                names.extend(self.desired_names());
            } else {
                names.extend(self.desired.node_dependent_services());
            }
        }
        names
    }

    fn desired_names(&self) -> Vec<ServiceName> {
        self.desired.service_names().cloned().collect()
    }

    fn incremental_sync(
        &mut self,
        store: &Store,
        node_addresses: &BTreeSet<IpAddr>,
        kernel: &mut dyn Kernel,
    ) -> SyncReport {
        let mut report = SyncReport::new(SyncKind::Incremental);
        let node = self.node_info(store, node_addresses);
        let names = self.dirty_names(store, &node);
        let udp_before = self.udp_with_reals(names.iter());
        let changes = self.derive(store, &node, names.iter().cloned(), &mut report);
        let delta = self.desired.update_services(changes);
        // UDP virtual servers that now have real servers and had none: entries created while
        // they had none point nowhere (k/k#125467).
        for (k, has) in self.udp_with_reals(names.iter()) {
            if has && !udp_before.get(&k).copied().unwrap_or(false) {
                if let ServiceKey::Inet { addr, port, .. } = k {
                    self.conntrack.push(ConntrackFilter::unanswered(
                        crate::conntrack::Protocol::Udp,
                        addr,
                        port,
                    ));
                }
            }
        }
        self.apply_delta(delta, kernel, &mut report);
        report
    }

    fn full_sync(
        &mut self,
        store: &Store,
        node_addresses: &BTreeSet<IpAddr>,
        kernel: &mut dyn Kernel,
    ) -> SyncReport {
        let mut report = SyncReport::new(SyncKind::Full);
        let node = self.node_info(store, node_addresses);
        self.zone = node.zone.clone();
        let mut names = std::mem::take(&mut self.dirty);
        self.node_dirty = false;
        if !self.applied_once {
            names.extend(store.service_names().cloned());
        } else {
            names.extend(self.desired.node_dependent_services());
        }
        let changes = self.derive(store, &node, names, &mut report);
        // What the changes pending since the last sync explain: the full diff below contains it
        // too, and it is not drift (nobody changed the kernel behind our back).
        let expected = self.desired.update_services(changes);
        self.set_counts = count_sets(&self.desired);
        let drift_counted = self.applied_once;

        // One read per subsystem. A subsystem whose read fails is neither diffed nor cleaned
        // (nothing is deleted on the strength of a failed read) and the full sync stays
        // requested, retried with backoff.
        let mut read_failed: BTreeSet<Subsystem> = BTreeSet::new();
        if let Err(e) = kernel.ensure_link() {
            report.fail(Subsystem::Address, e.to_string());
            read_failed.insert(Subsystem::Address);
        }
        let owned_sets: Vec<String> = SetKind::ALL
            .iter()
            .map(|k| k.name(set_family(self.cfg.family)))
            .collect();
        let actual_sets = match kernel.read_ipsets(&owned_sets) {
            Ok(s) => Some(s),
            Err(e) => {
                tracing::warn!(error = %e, "full sync: reading the ipsets failed; will retry");
                report.fail(Subsystem::Ipset, e.to_string());
                read_failed.insert(Subsystem::Ipset);
                None
            }
        };
        let actual_ipvs = match kernel.read_ipvs() {
            Ok(t) => Some(t),
            Err(e) => {
                tracing::warn!(error = %e, "full sync: reading IPVS failed; will retry");
                report.fail(Subsystem::Ipvs, e.to_string());
                read_failed.insert(Subsystem::Ipvs);
                None
            }
        };
        let actual_addrs = if read_failed.contains(&Subsystem::Address) {
            None
        } else {
            match kernel.read_addresses() {
                Ok(a) => Some(a),
                Err(e) => {
                    tracing::warn!(error = %e, "full sync: reading kube-ipvs0 failed; will retry");
                    report.fail(Subsystem::Address, e.to_string());
                    read_failed.insert(Subsystem::Address);
                    None
                }
            }
        };

        self.adopt_kept_state(
            store,
            &node,
            crate::adopt::KernelView {
                ipvs: actual_ipvs.as_ref(),
                addresses: actual_addrs.as_ref(),
                sets: actual_sets.as_ref(),
            },
        );

        // Compute the differences.
        let set_diff = actual_sets
            .as_ref()
            .map(|actual| ipset::diff(&self.desired.ipset_state(), actual));
        let ipvs_ops = actual_ipvs.as_ref().map(|actual| {
            let owned = owned_by_proxy(&self.cfg);
            self.desired.diff_ipvs(actual, &owned)
        });
        let ipvs_ops = ipvs_ops.map(|ops| self.graceful(ops, actual_ipvs.as_ref()));
        let (addr_add, addr_del) = match &actual_addrs {
            Some(actual) => {
                let fam = self.cfg.family;
                let mine: BTreeSet<IpAddr> = actual
                    .iter()
                    .filter(|a| Family::of(a) == fam)
                    .copied()
                    .collect();
                let cfg = &self.cfg;
                diff_set(&self.desired.addresses(), &mine, &|a: &IpAddr| {
                    !cfg.excluded(a)
                })
            }
            None => (Vec::new(), Vec::new()),
        };
        if drift_counted {
            let fam = set_family(self.cfg.family);
            let (n_ipvs, n_sets, n_addr) = unexplained(
                &expected,
                fam,
                ipvs_ops.as_ref(),
                set_diff.as_ref(),
                (&addr_add, &addr_del),
            );
            for (k, n) in [("ipvs", n_ipvs), ("ipset", n_sets), ("address", n_addr)] {
                if n > 0 {
                    tracing::warn!(subsystem = k, differences = n, "repairing drift");
                    report.drift.insert(k, n);
                }
            }
        }

        // Apply in the order of the contract in `crate::diff`.
        let (set_grow, set_shrink) = match set_diff {
            Some(d) => split_set_diff(d),
            None => (IpsetDiff::default(), IpsetDiff::default()),
        };
        self.apply_sets(&set_grow, kernel, &mut report);
        self.apply_rules(kernel, true, None, &mut report);
        let ops = ipvs_ops.unwrap_or_default();
        self.apply_ipvs(&ops.apply, kernel, &mut report);
        self.apply_addrs(&addr_add, &[], kernel, &mut report);
        self.apply_addrs(&[], &addr_del, kernel, &mut report);
        self.apply_ipvs(&ops.remove, kernel, &mut report);
        self.apply_sets(&set_shrink, kernel, &mut report);
        let now = self.now;
        if read_failed.is_empty() {
            self.applied_once = true;
            self.full_requested = false;
            self.retry.full.succeeded();
            // Every subsystem was read and diffed: what was waiting for a targeted repair has
            // been repaired by this sync unless it failed again just now.
            if !report.failed.contains_key(&Subsystem::Address) {
                self.recheck_addresses = false;
                self.retry.address.succeeded();
            }
            if !report.failed.contains_key(&Subsystem::Ipset) {
                self.recheck_sets = false;
                self.retry.ipset.succeeded();
            }
        } else {
            // Not done: adoption / the drift check stays pending, retried with backoff.
            self.full_requested = true;
            let delay = self.retry.full.failed(now);
            tracing::warn!(
                failed = ?read_failed.iter().map(|s| s.as_str()).collect::<Vec<_>>(),
                retry_in_ms = delay.as_millis() as u64,
                "full sync incomplete: a kernel read failed; retrying with backoff"
            );
        }
        self.full_failed = read_failed;
        report
    }

    /// Adopts the kernel state the model cannot derive but that must not be deleted (see
    /// [`crate::adopt`]): that of invalid Services without a last-good state, and the NodePort
    /// virtual servers on addresses that depend on a Node not known yet. Runs at a full sync,
    /// after the reads and before the diff.
    fn adopt_kept_state(
        &mut self,
        store: &Store,
        node: &NodeInfo,
        kernel: crate::adopt::KernelView<'_>,
    ) {
        let node_ips: BTreeSet<IpAddr> = node
            .addresses
            .iter()
            .chain(node.primary_ips.iter())
            .filter(|ip| Family::of(ip) == self.cfg.family)
            .copied()
            .collect();
        let mut changed = false;
        for name in std::mem::take(&mut self.to_adopt) {
            let Some(svc) = store.service(&name) else {
                continue;
            };
            let claims = crate::adopt::claims(svc, &self.cfg);
            let desired = &self.desired;
            let free = |k: &ServiceKey| desired.owner_of(k).is_none_or(|o| *o == name);
            let adopted = crate::adopt::adopt_service(&claims, kernel, &self.cfg, &node_ips, free);
            if let Some(mut d) = adopted {
                // A partial read adopts what it saw; a later full sync completes it.
                if let Some(old) = self.desired.service(&name) {
                    d.virtual_servers.extend(old.virtual_servers.clone());
                    d.addresses.extend(old.addresses.iter().copied());
                    d.ipset_entries.extend(old.ipset_entries.iter().cloned());
                    d.features = crate::desired::Features(d.features.0 | old.features.0);
                    if d.in_cluster.is_empty() {
                        d.in_cluster = old.in_cluster.clone();
                        d.fwmarks = old.fwmarks.clone();
                    }
                }
                tracing::warn!(service = %name, virtual_servers = d.virtual_servers.len(),
                    addresses = d.addresses.len(), ipset_entries = d.ipset_entries.len(),
                    "invalid service has no last-good state: keeping what the kernel holds for it");
                let _ = self.desired.update_service(name.clone(), Some(d));
                changed = true;
            }
            if !kernel.complete() {
                self.to_adopt.insert(name);
            }
        }
        let pseudo = crate::adopt::unresolved_node_ports();
        if store.node().is_none() && self.cfg.node_port_primary {
            let node_ports: BTreeSet<(ipvs_netlink::Protocol, u16)> = store
                .service_names()
                .filter_map(|n| store.service(n))
                .flat_map(|s| crate::adopt::claims(s, &self.cfg).node_ports)
                .collect();
            let desired = &self.desired;
            let free = |k: &ServiceKey| desired.owner_of(k).is_none_or(|o| *o == pseudo);
            let adopted =
                crate::adopt::adopt_node_ports(&node_ports, kernel, &self.cfg, &node_ips, free);
            if let Some(d) = adopted {
                tracing::warn!(virtual_servers = d.virtual_servers.len(),
                    "the Node is not known: keeping the NodePort virtual servers on its addresses until it is");
                let _ = self.desired.update_service(pseudo, Some(d));
                changed = true;
            }
        }
        if changed {
            self.set_counts = count_sets(&self.desired);
        }
    }

    /// Re-reads the sets, and applies what differs (after a failed ipset apply).
    fn repair_sets(&mut self, kernel: &mut dyn Kernel, report: &mut SyncReport) {
        let owned_sets: Vec<String> = SetKind::ALL
            .iter()
            .map(|k| k.name(set_family(self.cfg.family)))
            .collect();
        let actual = match kernel.read_ipsets(&owned_sets) {
            Ok(s) => s,
            Err(e) => {
                report.fail(Subsystem::Ipset, e.to_string());
                self.retry.ipset.failed(self.now);
                return;
            }
        };
        self.recheck_sets = false;
        let (grow, shrink) = split_set_diff(ipset::diff(&self.desired.ipset_state(), &actual));
        self.apply_sets(&grow, kernel, report);
        self.apply_sets(&shrink, kernel, report);
        if !self.recheck_sets {
            self.retry.ipset.succeeded();
        }
    }

    fn apply_delta(&mut self, delta: Delta, kernel: &mut dyn Kernel, report: &mut SyncReport) {
        if delta.is_empty() {
            return;
        }
        let before: BTreeSet<SetKind> = non_empty(&self.set_counts);
        for e in &delta.ipset_add {
            *self.set_counts.entry(e.set).or_default() += 1;
        }
        for e in &delta.ipset_del {
            if let Some(n) = self.set_counts.get_mut(&e.set) {
                *n = n.saturating_sub(1);
            }
        }
        let after: BTreeSet<SetKind> = non_empty(&self.set_counts);
        let fam = set_family(self.cfg.family);
        let grow = IpsetDiff {
            adds: entry_changes(&delta.ipset_add, fam),
            ..IpsetDiff::default()
        };
        let shrink = IpsetDiff {
            dels: entry_changes(&delta.ipset_del, fam),
            ..IpsetDiff::default()
        };
        let rules_change = delta.iptables_changed || before != after;
        self.apply_sets(&grow, kernel, report);
        if rules_change {
            // Rules for sets that gain members go in now; rules for sets that become empty
            // stay until their members are gone (step 6).
            self.apply_rules(kernel, false, Some(union_of(&before, &after)), report);
        }
        let ipvs = self.graceful(delta.ipvs, None);
        self.apply_ipvs(&ipvs.apply, kernel, report);
        self.apply_addrs(&delta.addresses_add, &[], kernel, report);
        self.apply_addrs(&[], &delta.addresses_del, kernel, report);
        self.apply_ipvs(&ipvs.remove, kernel, report);
        self.apply_sets(&shrink, kernel, report);
        // Only when a set became empty do the final rules differ from those of step 2; the same
        // rules again would only repeat a failed restore (another 5 s on a held xtables lock).
        if rules_change && union_of(&before, &after) != after {
            self.apply_rules(kernel, false, None, report);
        }
    }

    fn apply_sets(&mut self, diff: &IpsetDiff, kernel: &mut dyn Kernel, report: &mut SyncReport) {
        if diff.is_empty() {
            return;
        }
        report.ipset_changes += diff.len();
        match kernel.apply_ipsets(diff) {
            Ok(rejected) => {
                if rejected.is_empty() {
                    return;
                }
                for r in rejected {
                    tracing::warn!(error = %r, "ipset entry rejected");
                    report.fail(Subsystem::Ipset, r);
                }
                self.set_recheck(self.now);
            }
            Err(e) => {
                tracing::error!(error = %e, "ipset apply failed; re-reading the sets with backoff");
                report.fail(Subsystem::Ipset, e.to_string());
                self.set_recheck(self.now);
            }
        }
    }

    fn set_recheck(&mut self, now: Instant) {
        // One backoff step per failed attempt, not per failed batch of one attempt.
        if !self.recheck_sets || self.retry.ipset.ready(now) {
            self.retry.ipset.failed(now);
        }
        self.recheck_sets = true;
    }

    /// The iptables rules for the current desired state; `sets` overrides which sets count
    /// as non-empty.
    pub fn rules(&self, sets: Option<BTreeSet<SetKind>>) -> iptables::Result<iptables::RuleSet> {
        let inputs = self.desired.iptables();
        let mut input = iptables::IpvsModeInput::new(set_family(self.cfg.family));
        input.masquerade_bit = self.rules.masquerade_bit;
        input.masquerade_all = inputs.masquerade_all;
        input.random_fully = self.rules.random_fully;
        input.local_detect = self
            .rules
            .local_detect_for(&inputs.cluster_cidrs, &self.pod_cidrs);
        input.non_empty_sets = sets.unwrap_or_else(|| non_empty(&self.set_counts));
        input.no_node_access = self.no_node_access();
        input.in_cluster = self
            .desired
            .in_cluster_marks()
            .into_iter()
            .map(|m| iptables::InClusterMark {
                ip: m.dest.ip,
                proto: crate::desired::set_proto(m.dest.protocol),
                port: m.dest.port,
                mark: m.mark,
            })
            .collect();
        input.in_cluster_mask = crate::desired::IN_CLUSTER_MARK_MASK;
        iptables::render_ipvs_mode(&input)
    }

    /// Load-balancer IPs whose source ranges do not admit this node: IPVS takes the node's own
    /// connections to them at LOCAL_OUT, before the INPUT firewall sees them, so they are
    /// dropped in OUTPUT instead (k/k#119656).
    fn no_node_access(&self) -> Vec<iptables::NoNodeAccess> {
        let mut fw = BTreeSet::new();
        let mut allowed = BTreeSet::new();
        for e in self.desired.ipset_entries() {
            match (e.set, e.entry) {
                (SetKind::LoadBalancerFw, ipset::Entry::IpPort { ip, proto, port }) => {
                    fw.insert((ip, proto, port));
                }
                (
                    SetKind::LoadBalancerSourceIp,
                    ipset::Entry::IpPortIp {
                        ip,
                        proto,
                        port,
                        ip2,
                    },
                ) if ip == ip2 => {
                    allowed.insert((ip, proto, port));
                }
                _ => {}
            }
        }
        fw.difference(&allowed)
            .map(|&(ip, proto, port)| iptables::NoNodeAccess { ip, proto, port })
            .collect()
    }

    fn apply_rules(
        &mut self,
        kernel: &mut dyn Kernel,
        force: bool,
        sets: Option<BTreeSet<SetKind>>,
        report: &mut SyncReport,
    ) {
        let rules = match self.rules(sets) {
            Ok(r) => r,
            Err(e) => {
                report.fail(Subsystem::Iptables, format!("iptables: {e}"));
                return;
            }
        };
        let text = rules.render();
        match kernel.apply_iptables(&rules, force) {
            Ok(ran) => {
                report.iptables_restored |= ran;
                // A forced (drift-check) restore of the very rules applied last time means
                // someone changed them behind our back.
                if ran && force && self.applied_once && self.last_rules.as_deref() == Some(&text) {
                    tracing::warn!(subsystem = "iptables", "repairing drift");
                    *report.drift.entry("iptables").or_default() += 1;
                }
                self.last_rules = Some(text);
                // The whole rule set (forced) or the change went in: any earlier failure is
                // repaired once a forced restore succeeds.
                if force || !self.recheck_rules {
                    self.recheck_rules = false;
                    self.retry.iptables.succeeded();
                }
            }
            Err(e) => {
                let now = self.now;
                if !self.recheck_rules || self.retry.iptables.ready(now) {
                    let delay = self.retry.iptables.failed(now);
                    tracing::error!(error = %e, retry_in_ms = delay.as_millis() as u64,
                        "iptables-restore failed; retrying with backoff");
                }
                self.recheck_rules = true;
                report.iptables_restore_failed = true;
                report.fail(Subsystem::Iptables, e.to_string());
            }
        }
    }

    fn apply_ipvs(&mut self, ops: &[Op], kernel: &mut dyn Kernel, report: &mut SyncReport) {
        if ops.is_empty() {
            return;
        }
        report.ipvs_ops += ops.len();
        // In chunks: a full program is N x M operations, and one result per operation for all
        // of them at once (~120 bytes each) would be most of the sync's transient memory. The
        // client pipelines inside each chunk; a chunk that fails as a whole (the kernel does
        // not answer, the socket is gone) stops the rest, which are repaired later.
        let mut chunks = ops.chunks(IPVS_APPLY_CHUNK);
        for chunk in chunks.by_ref() {
            let results = kernel.apply_ipvs(chunk);
            let all_failed = results.iter().all(Result::is_err);
            self.apply_ipvs_results(chunk, results, report);
            if all_failed {
                break;
            }
        }
        let skipped: Vec<&Op> = chunks.flatten().collect();
        if !skipped.is_empty() {
            report.ipvs_failures += skipped.len();
            report.fail(
                Subsystem::Ipvs,
                format!(
                    "{} IPVS operations not sent: the previous {IPVS_APPLY_CHUNK} all failed",
                    skipped.len()
                ),
            );
            self.repair.extend(skipped.into_iter().filter_map(op_key));
        }
        if !self.repair.is_empty() && !self.retry.ipvs.failing() {
            self.retry.ipvs.failed(self.now);
        }
    }

    fn apply_ipvs_results(
        &mut self,
        ops: &[Op],
        results: Vec<Result<(), KernelError>>,
        report: &mut SyncReport,
    ) {
        for (op, res) in ops.iter().zip(results) {
            if let (
                Ok(()),
                Op::DelDest(
                    ServiceKey::Inet {
                        protocol: ipvs_netlink::Protocol::Udp,
                        addr,
                        port,
                    },
                    endpoint,
                    _,
                ),
            ) = (&res, op)
            {
                self.conntrack.push(ConntrackFilter::endpoint_removed(
                    crate::conntrack::Protocol::Udp,
                    *addr,
                    *port,
                    *endpoint,
                ));
            }
            if let Err(e) = res {
                let key = op_key(op);
                report.ipvs_failures += 1;
                let owner = key
                    .map(|k| self.desired.owner_of(&k).map(|n| n.to_string()))
                    .unwrap_or_default()
                    .unwrap_or_else(|| "-".to_string());
                tracing::warn!(service = %owner, op = ?op, error = %e, "IPVS operation failed; will re-check");
                report.fail(Subsystem::Ipvs, format!("{owner}: {e}"));
                if let Some(k) = key {
                    self.repair.insert(k);
                }
            }
        }
    }

    fn apply_addrs(
        &mut self,
        add: &[IpAddr],
        del: &[IpAddr],
        kernel: &mut dyn Kernel,
        report: &mut SyncReport,
    ) {
        if add.is_empty() && del.is_empty() {
            return;
        }
        report.address_ops += add.len() + del.len();
        for (ip, res) in kernel.apply_addresses(add, del) {
            if let Err(e) = res {
                tracing::warn!(address = %ip, error = %e, "kube-ipvs0 address change failed");
                report.fail(Subsystem::Address, format!("kube-ipvs0 {ip}: {e}"));
                self.address_recheck(self.now);
            }
        }
    }

    fn address_recheck(&mut self, now: Instant) {
        if !self.recheck_addresses || self.retry.address.ready(now) {
            self.retry.address.failed(now);
        }
        self.recheck_addresses = true;
    }

    fn repair_addresses(&mut self, kernel: &mut dyn Kernel, report: &mut SyncReport) {
        let now = self.now;
        if let Err(e) = kernel.ensure_link() {
            report.fail(Subsystem::Address, e.to_string());
            self.address_recheck(now);
            return;
        }
        match kernel.read_addresses() {
            Ok(actual) => {
                let fam = self.cfg.family;
                let mine: BTreeSet<IpAddr> = actual
                    .into_iter()
                    .filter(|a| Family::of(a) == fam)
                    .collect();
                let cfg = self.cfg.clone();
                let (add, del) = diff_set(&self.desired.addresses(), &mine, &|a: &IpAddr| {
                    !cfg.excluded(a)
                });
                self.apply_addrs(&add, &del, kernel, report);
                if !self.recheck_addresses {
                    self.retry.address.succeeded();
                }
            }
            Err(e) => {
                report.fail(Subsystem::Address, e.to_string());
                self.address_recheck(now);
            }
        }
    }

    /// Turns real-server deletions into drains and re-additions of draining real servers
    /// into weight restores. `actual` is the kernel's table when known (full sync).
    fn graceful(&mut self, mut ops: IpvsOps, actual: Option<&IpvsTable>) -> IpvsOps {
        let now = Instant::now();
        let enabled = self.drain.enabled;
        let draining = &mut self.draining;
        let stats = &mut self.drain_stats;
        // In place: a full program is ~N x M operations, and a second vector of them would
        // double the sync's peak memory.
        ops.apply.retain_mut(|op| match op {
            Op::DelDest(k, a, p) if enabled && drains(k) => {
                let key = (*k, *a, *p);
                if draining.contains_key(&key) {
                    return false; // already draining: the drain check deletes it
                }
                draining.insert(key, now);
                let already_zero = actual
                    .and_then(|t| t.get(&key.0))
                    .and_then(|vs| vs.real_servers.get(&(key.1, key.2)))
                    .is_some_and(|d| d.weight == 0);
                if already_zero {
                    return false;
                }
                let mut d = Destination::new(key.1, key.2);
                d.weight = 0;
                *op = Op::SetDest(key.0, d);
                true
            }
            Op::NewDest(k, d) => {
                if draining.remove(&(*k, d.addr, d.port)).is_some() {
                    stats.restored += 1;
                    if let Op::NewDest(k, d) = std::mem::replace(op, Op::Flush) {
                        *op = Op::SetDest(k, d);
                    }
                }
                true
            }
            Op::SetDest(k, d) => {
                // Wanted again (e.g. a weight 0 left by a previous run): no longer draining.
                if draining.remove(&(*k, d.addr, d.port)).is_some() {
                    stats.restored += 1;
                }
                true
            }
            _ => true,
        });
        for op in &ops.remove {
            if let Op::DelService(k) = op {
                self.draining.retain(|(dk, _, _), _| dk != k);
            }
        }
        if self.draining.is_empty() {
            self.drain_due = None;
        } else if self.drain_due.is_none() {
            self.drain_due = Some(now + self.drain.interval);
        }
        ops
    }

    /// Reads only the virtual servers with draining real servers and deletes those whose
    /// connections are gone (or whose cap passed).
    fn check_drains(&mut self, kernel: &mut dyn Kernel, report: &mut SyncReport) {
        let now = Instant::now();
        let keys: BTreeSet<ServiceKey> = self.draining.keys().map(|(k, _, _)| *k).collect();
        let actual = match kernel.read_ipvs_keys(&keys) {
            Ok(t) => t,
            Err(e) => {
                report.fail(Subsystem::Ipvs, e.to_string());
                self.drain_due = Some(now + self.drain.interval);
                return;
            }
        };
        let mut ops = Vec::new();
        let mut done = Vec::new();
        for (&(k, a, p), &since) in &self.draining {
            let Some(d) = actual.get(&k).and_then(|vs| vs.real_servers.get(&(a, p))) else {
                done.push((k, a, p)); // gone already (deleted behind our back, or its service)
                continue;
            };
            if d.active_conns == 0 {
                self.drain_stats.removed_drained += 1;
            } else if now.duration_since(since) >= self.drain.cap {
                self.drain_stats.removed_cap += 1;
                tracing::info!(real_server = %format!("{a}:{p}"), active = d.active_conns,
                    "drain cap reached; deleting real server with live connections");
            } else {
                continue;
            }
            ops.push(Op::DelDest(k, a, p));
            done.push((k, a, p));
        }
        for d in done {
            self.draining.remove(&d);
        }
        report.drained += ops.len();
        self.apply_ipvs(&ops, kernel, report);
        self.drain_due = if self.draining.is_empty() {
            None
        } else {
            Some(now + self.drain.interval)
        };
    }

    /// UDP virtual servers of `names` and whether each has real servers.
    fn udp_with_reals<'a>(
        &self,
        names: impl Iterator<Item = &'a ServiceName>,
    ) -> BTreeMap<ServiceKey, bool> {
        let mut out = BTreeMap::new();
        for n in names {
            if let Some(sd) = self.desired.service(n) {
                for (k, vs) in &sd.virtual_servers {
                    if !drains(k) {
                        out.insert(*k, !vs.real_servers.is_empty());
                    }
                }
            }
        }
        out
    }

    /// Deletes the stale UDP conntrack entries this sync's changes (and earlier failed
    /// cleanups) left behind. On failure the filters are kept and retried with backoff.
    fn flush_conntrack(&mut self, kernel: &mut dyn Kernel, report: &mut SyncReport) {
        if self.conntrack.is_empty() {
            return;
        }
        let mut filters = std::mem::take(&mut self.conntrack);
        let mut seen = std::collections::HashSet::new();
        filters.retain(|f| seen.insert(*f));
        let started = Instant::now();
        let result = kernel.delete_conntrack(&filters);
        report.conntrack_duration = Some(started.elapsed());
        match result {
            Ok(n) => {
                report.conntrack_deleted += n;
                self.retry.conntrack.succeeded();
            }
            Err(e) => {
                let delay = self.retry.conntrack.failed(self.now);
                tracing::warn!(error = %e, filters = filters.len(),
                    retry_in_ms = delay.as_millis() as u64,
                    "conntrack cleanup failed; keeping the filters and retrying with backoff");
                report.fail(Subsystem::Conntrack, e.to_string());
                // Bounded: one filter per (VIP, port[, endpoint]) the proxier programs.
                self.conntrack = filters;
            }
        }
    }

    /// Re-reads the virtual servers whose operations failed and applies what still differs.
    fn retry_repairs(&mut self, kernel: &mut dyn Kernel, report: &mut SyncReport) {
        let keys = std::mem::take(&mut self.repair);
        let actual = match kernel.read_ipvs_keys(&keys) {
            Ok(t) => t,
            Err(e) => {
                report.fail(Subsystem::Ipvs, e.to_string());
                self.repair = keys;
                self.retry.ipvs.failed(self.now);
                return;
            }
        };
        let desired: IpvsTable = self.desired.ipvs_table_for(&keys).into_iter().collect();
        let ops = {
            let owned = owned_by_proxy(&self.cfg);
            let only_keys = |k: &ServiceKey| keys.contains(k) && owned(k);
            diff_ipvs(&desired, &actual, &only_keys)
        };
        let failures_before = report.ipvs_failures;
        self.apply_ipvs(&ops.apply, kernel, report);
        self.apply_ipvs(&ops.remove, kernel, report);
        if report.ipvs_failures > failures_before {
            self.retry.ipvs.failed(self.now);
        } else if self.repair.is_empty() {
            self.retry.ipvs.succeeded();
        }
    }
}

/// The differences a full sync found that the pending changes do not explain (drift), per
/// subsystem: IPVS operations on virtual servers the changes did not touch, ipset members and
/// set (re)creations or destructions the changes did not ask for, addresses the changes did not
/// bind or unbind.
fn unexplained(
    expected: &Delta,
    fam: ipset::Family,
    ipvs: Option<&IpvsOps>,
    sets: Option<&IpsetDiff>,
    (addr_add, addr_del): (&[IpAddr], &[IpAddr]),
) -> (usize, usize, usize) {
    let keys: BTreeSet<ServiceKey> = expected
        .ipvs
        .apply
        .iter()
        .chain(&expected.ipvs.remove)
        .filter_map(op_key)
        .collect();
    let n_ipvs = ipvs.map_or(0, |ops| {
        ops.apply
            .iter()
            .chain(&ops.remove)
            .filter(|op| op_key(op).is_none_or(|k| !keys.contains(&k)))
            .count()
    });
    let members: BTreeSet<(String, ipset::Entry)> = expected
        .ipset_add
        .iter()
        .chain(&expected.ipset_del)
        .map(|e| (e.set.name(fam), e.entry.clone()))
        .collect();
    let n_sets = sets.map_or(0, |d| {
        let changed = d
            .adds
            .iter()
            .chain(&d.dels)
            .filter(|c| !members.contains(&(c.set.clone(), c.entry.clone())))
            .count();
        d.len() - d.adds.len() - d.dels.len() + changed
    });
    let addrs: BTreeSet<IpAddr> = expected
        .addresses_add
        .iter()
        .chain(&expected.addresses_del)
        .copied()
        .collect();
    let n_addr = addr_add
        .iter()
        .chain(addr_del)
        .filter(|a| !addrs.contains(a))
        .count();
    (n_ipvs, n_sets, n_addr)
}

fn count_sets(desired: &Desired) -> BTreeMap<SetKind, usize> {
    let mut counts = BTreeMap::new();
    for e in desired.ipset_entries() {
        *counts.entry(e.set).or_default() += 1;
    }
    counts
}

/// The set kinds non-empty before or after a change.
fn union_of(before: &BTreeSet<SetKind>, after: &BTreeSet<SetKind>) -> BTreeSet<SetKind> {
    before.union(after).copied().collect()
}

fn non_empty(counts: &BTreeMap<SetKind, usize>) -> BTreeSet<SetKind> {
    counts
        .iter()
        .filter(|(_, n)| **n > 0)
        .map(|(k, _)| *k)
        .collect()
}

fn entry_changes(entries: &[IpsetEntry], fam: ipset::Family) -> Vec<EntryChange> {
    entries
        .iter()
        .map(|e| EntryChange {
            set: e.set.name(fam),
            entry: e.entry.clone(),
            owner: String::new(),
        })
        .collect()
}

/// Splits a full ipset diff into what must happen before a VIP is bound (creates, adds) and
/// after it is unbound (deletes, destroys).
fn split_set_diff(d: IpsetDiff) -> (IpsetDiff, IpsetDiff) {
    let grow = IpsetDiff {
        creates: d.creates,
        recreates: d.recreates,
        adds: d.adds,
        ..IpsetDiff::default()
    };
    let shrink = IpsetDiff {
        dels: d.dels,
        destroys: d.destroys,
        ..IpsetDiff::default()
    };
    (grow, shrink)
}

/// Real servers of TCP and SCTP virtual servers drain; UDP ones are deleted at once.
fn drains(k: &ServiceKey) -> bool {
    !matches!(
        k,
        ServiceKey::Inet {
            protocol: ipvs_netlink::Protocol::Udp,
            ..
        }
    )
}

fn op_key(op: &Op) -> Option<ServiceKey> {
    match op {
        Op::NewService(s) | Op::SetService(s) => Some(s.key),
        Op::DelService(k) | Op::NewDest(k, _) | Op::SetDest(k, _) | Op::DelDest(k, ..) => Some(*k),
        Op::Flush | Op::SetTimeouts(_) => None,
    }
}

/// A kernel error, for callers outside this module.
pub type Error = KernelError;
