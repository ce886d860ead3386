//! The IPVS-mode proxier: keeps one address family of the node's kernel equal to the desired state.
//!
//! Two kinds of sync:
//! - **incremental**: only the services marked dirty since the last sync are re-derived; the
//!   [`Delta`] of those services is applied in the order written in [`desired::diff`]. No kernel
//!   read, no dump: work is proportional to the change.
//! - **full** (startup): one read of each subsystem (one IPVS dump, the family's kube-ipvs0
//!   addresses, a netlink LIST of each of the family's sets), a diff against the whole desired
//!   state, and only the differences are written: it adopts what a previous run (or kube-proxy)
//!   left behind without a flush. Every `syncPeriod` after that a full sync re-derives every
//!   node-dependent and rejected Service, restores the rules and starts a drift check that reads
//!   the addresses, then the sets, then IPVS a slice at a time over the syncs that follow it,
//!   changes programmed between its reads; it repairs drift and counts the repairs ([`check`]).
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

use conntrack::ConntrackFilter;
use ipset::{EntryChange, IpsetDiff, SetKind};
use ipvs_netlink::{Destination, Family, Op, ServiceKey};

use crate::kernel::{AddressAdds, Kernel, KernelError};
use crate::retry::{Backoff, RetryPolicy, Subsystem};
use desired::diff::{diff_ipvs, diff_set, IpvsOps, IpvsTable};
use desired::{owned_by_proxy, service_desired_except, Delta, Desired, IpsetEntry};
use model::store::{Changes, Store};
use model::{NodeInfo, ProxyConfig, Rejections, ServiceName};

mod apply;
mod check;
mod derive;
mod graceful;
mod ops;
mod refusal;
mod report;
mod rules;
mod sync;

use ops::*;

pub use check::{CHECK_SLICE, CHECK_STEP_BUDGET};
pub use refusal::{refusal_label, refusal_labels, Refusal, IPSET_REJECTED};
pub use report::{truncate_text, SubsystemFailure, SyncKind, SyncReport, MAX_ERROR_LEN};
pub use rules::RulesConfig;

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
    /// Retries of the Services isolated because the kernel refuses their programming.
    refused: Backoff,
    /// The reads of a sliced drift check (see [`check`]).
    check: Backoff,
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
            refused: Backoff::new(p),
            check: Backoff::new(p),
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
    vips: desired::vip::VipClaims,
    drain: DrainConfig,
    draining: BTreeMap<(ServiceKey, IpAddr, u16), Instant>,
    drain_due: Option<Instant>,
    drain_stats: DrainStats,
    conntrack: Vec<ConntrackFilter>,
    last_rules: Option<String>,
    /// Invalid Services in the store with no last-good state: their kernel state is adopted
    /// at the next full sync (see [`crate::adopt`]).
    to_adopt: BTreeSet<ServiceName>,
    /// Services rejected now (invalid, over their budget, or overfilling an ipset) or taken in
    /// without their hairpin members: derived again at every full sync and node change, so one
    /// that fits again (room in a set, fewer node addresses) is taken in whole without waiting
    /// for a change of its own.
    rejected: BTreeSet<ServiceName>,
    retry: Retries,
    /// An ipset apply failed: re-read and repair the sets when the backoff allows.
    recheck_sets: bool,
    /// An iptables-restore failed: restore again (forced) when the backoff allows.
    recheck_rules: bool,
    /// Subsystems whose kernel read failed in the last full sync (the full sync is not done).
    full_failed: BTreeSet<Subsystem>,
    /// The time the current sync runs at (see [`Proxier::sync_at`]).
    now: Instant,
    /// Services isolated because the kernel refuses their programming (see [`refusal`]).
    refused: BTreeMap<ServiceName, refusal::Isolated>,
    /// During a retry of the isolated Services: those isolated before it.
    refused_before: BTreeMap<ServiceName, refusal::Isolated>,
    /// Newly isolated Services not yet taken by [`Proxier::take_refusals`].
    new_refusals: Vec<Refusal>,
    /// A repair (which re-read the kernel first) is applying: a definite error is a refusal.
    repairing: bool,
    /// The running drift check (see [`check`]).
    check: check::DriftCheck,
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
            vips: desired::vip::VipClaims::default(),
            drain: DrainConfig::default(),
            draining: BTreeMap::new(),
            drain_due: None,
            drain_stats: DrainStats::default(),
            conntrack: Vec::new(),
            last_rules: None,
            to_adopt: BTreeSet::new(),
            rejected: BTreeSet::new(),
            retry: Retries::new(RetryPolicy::default()),
            recheck_sets: false,
            recheck_rules: false,
            pod_cidrs: Vec::new(),
            full_failed: BTreeSet::new(),
            now: Instant::now(),
            refused: BTreeMap::new(),
            refused_before: BTreeMap::new(),
            new_refusals: Vec::new(),
            repairing: false,
            check: check::DriftCheck::default(),
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
    pub fn take_rejections(&mut self) -> Vec<(String, model::Invalid)> {
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
    pub fn full_due(&self, now: Instant) -> bool {
        self.full_pending() && self.retry.full.ready(now)
    }

    /// True when a sync has work to do now.
    pub fn pending(&self, now: Instant) -> bool {
        // Until the first full sync has read the kernel, nothing else runs.
        let adopted = self.applied_once;
        self.paced_pending(now)
            || self.full_due(now)
            || (adopted && self.recheck_addresses && self.retry.address.ready(now))
            || (adopted && self.recheck_sets && self.retry.ipset.ready(now))
            || (adopted && self.recheck_rules && self.retry.iptables.ready(now))
            || (!self.repair.is_empty() && self.retry.ipvs.ready(now))
            || (!self.conntrack.is_empty() && self.retry.conntrack.ready(now))
            || (adopted && !self.refused.is_empty() && self.retry.refused.ready(now))
            || (adopted && self.check_due(now))
            || self.drain_due.is_some_and(|t| now >= t)
    }

    /// True when changes are due (the store's, the node's addresses, and the first full sync):
    /// the only work `minSyncPeriod` paces. Everything else [`Proxier::pending`] counts has a
    /// timer of its own: the periodic full sync (`syncPeriod`), retries (backoff from
    /// `minSyncPeriod`), the drift check's steps (at most one per `minSyncPeriod`), drain checks
    /// (the drain interval). See [`crate::sync_loop::Backend::paced`].
    pub fn paced_pending(&self, now: Instant) -> bool {
        if !self.applied_once {
            return self.full_due(now);
        }
        !self.dirty.is_empty() || self.node_dirty
    }

    /// When the next retry of failed operations (or a drain check, or a step of the running
    /// drift check) is due, if any.
    pub fn retry_due(&self) -> Option<Instant> {
        let waiting = [
            (self.full_pending(), &self.retry.full),
            (!self.repair.is_empty(), &self.retry.ipvs),
            (self.recheck_addresses, &self.retry.address),
            (self.recheck_sets, &self.retry.ipset),
            (self.recheck_rules, &self.retry.iptables),
            (!self.conntrack.is_empty(), &self.retry.conntrack),
            (!self.refused.is_empty(), &self.retry.refused),
            (self.check.running(), &self.retry.check),
        ];
        waiting
            .iter()
            .filter(|(on, _)| *on)
            .filter_map(|(_, b)| b.due())
            .chain(self.drain_due)
            .chain(self.check_next())
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
        let full = self.full_due(now);
        let incremental = !full && self.applied_once;
        let mut report = if full {
            self.full_sync(store, node_addresses, kernel)
        } else if incremental {
            self.incremental_sync(store, node_addresses, kernel)
        } else {
            // Waiting for the retry of the first full sync's failed read.
            SyncReport::new(SyncKind::Incremental)
        };
        // The follow-up steps, each timed as a phase of its own when it runs.
        let t = Instant::now();
        let mut repaired = false;
        if incremental {
            if self.recheck_addresses && self.retry.address.ready(now) {
                self.recheck_addresses = false;
                self.repair_addresses(kernel, &mut report);
                repaired = true;
            }
            if self.recheck_sets && self.retry.ipset.ready(now) {
                self.repair_sets(kernel, &mut report);
                repaired = true;
            }
            if self.recheck_rules && self.retry.iptables.ready(now) {
                self.apply_rules(kernel, true, None, &mut report);
                repaired = true;
            }
        }
        if !self.repair.is_empty() && self.retry.ipvs.ready(self.now) {
            self.retry_repairs(kernel, &mut report);
            repaired = true;
        }
        if self.applied_once && !self.refused.is_empty() && self.retry.refused.ready(self.now) {
            self.retry_refused(kernel, &mut report);
            repaired = true;
        }
        let t = if repaired { report.lap("repair", t) } else { t };
        // A slice of the running drift check, after the changes were programmed above.
        let t = if incremental && self.check_due(now) {
            self.check_step(kernel, &mut report);
            report.lap("check", t)
        } else {
            t
        };
        let t = if self.drain_due.is_some_and(|t| Instant::now() >= t) {
            self.check_drains(kernel, &mut report);
            report.lap("drain", t)
        } else {
            t
        };
        if !self.conntrack.is_empty() && self.retry.conntrack.ready(self.now) {
            self.flush_conntrack(kernel, &mut report);
            report.lap("conntrack", t);
        }
        report.vip_conflicts = self.vips.conflicts();
        report.node_address_conflicts = self.vips.node_conflicts();
        report.retrying = self.retrying();
        report.duration = start.elapsed();
        report
    }
}

/// A kernel error, for callers outside this module.
pub type Error = KernelError;
