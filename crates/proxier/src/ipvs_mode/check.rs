//! The periodic drift check, one kernel read per step.
//!
//! A periodic full sync (not the first: adoption reads the kernel whole, see `sync`) programs the
//! changes pending as an incremental sync would, restores the iptables rules, lists the family's
//! IPVS virtual servers (one services dump, no real servers) and starts a check. Each later sync
//! first programs the changes pending (an incremental sync), then does one step of the check when
//! one is due: read, diff and repair the family's addresses on kube-ipvs0 (one dump of that
//! family); then the family's ipsets (one netlink LIST of each of its 17 sets); then the queued
//! virtual servers, a slice at a time, for about [`CHECK_STEP_BUDGET`]. A change so waits for at
//! most one of those reads, instead of for all of them and a read of the whole IPVS table: at
//! 5,000 Services x 10 endpoints in the emulated benchmark VM a full sync's reads took 5 to 6 s
//! per family, during which every change waited (`docs/benchmarks.md`). Upstream's IPVS proxier
//! reads every subsystem at every sync (`syncProxyRules`: `GetVirtualServers`, then
//! `GetRealServers` per service, the ipset and address listings) and makes every change wait.
//!
//! A step comes at most once per `minSyncPeriod`, by the check's own timer: a sync that only
//! ran a step does not make the next change wait for the sync loop's `minSyncPeriod`.
//!
//! Each step is consistent: the changes before it are programmed, nothing writes between its
//! read and its repairs, so whatever differs is drift (counted). A step whose read fails stays
//! queued and is retried with backoff, its subsystem reported as retrying; nothing is deleted
//! on the strength of a failed read. A check still running when the next periodic full sync
//! comes goes on; the next check starts when it ended. The first full sync (adoption) and a
//! full sync that must adopt kernel state still read every subsystem whole.

use std::collections::{BTreeSet, VecDeque};
use std::time::{Duration, Instant};

use super::*;

/// Default time one sync spends on drift-check slices of IPVS: slices are read while it has
/// not passed, at least one (see [`Proxier::with_check_budget`]).
pub const CHECK_STEP_BUDGET: Duration = Duration::from_millis(200);

/// Virtual servers read per slice (two requests each: the service, its real servers).
pub const CHECK_SLICE: usize = 64;

/// What a drift check still has to read: the addresses, the sets, the virtual servers.
#[derive(Debug)]
pub(super) struct DriftCheck {
    addresses: bool,
    sets: bool,
    queue: VecDeque<ServiceKey>,
    budget: Duration,
    /// The next step is not due before this (a step every `minSyncPeriod`, on the check's own
    /// timer rather than the sync loop's wait: see [`Proxier::check_due`]).
    next: Option<Instant>,
}

impl Default for DriftCheck {
    fn default() -> Self {
        DriftCheck {
            addresses: false,
            sets: false,
            queue: VecDeque::new(),
            budget: CHECK_STEP_BUDGET,
            next: None,
        }
    }
}

impl DriftCheck {
    /// True while a check runs.
    pub(super) fn running(&self) -> bool {
        self.addresses || self.sets || !self.queue.is_empty()
    }

    /// Virtual servers left to read.
    pub(super) fn left(&self) -> usize {
        self.queue.len()
    }
}

impl Proxier {
    /// Sets the time one sync spends on drift-check slices of IPVS (zero: one slice per sync).
    pub fn with_check_budget(mut self, budget: Duration) -> Proxier {
        self.check.budget = budget;
        self
    }

    /// A full sync may leave the reads to a drift check: it is not the first (adoption reads
    /// the kernel whole) and nothing has to be adopted from the kernel.
    pub(super) fn check_sliced(&self, store: &Store) -> bool {
        self.applied_once
            && self.to_adopt.is_empty()
            && !(store.node().is_none() && self.cfg.node_port_primary)
    }

    /// Starts a check: the addresses, the sets, then the listed virtual servers (those of the
    /// family the proxy owns) and the desired ones.
    pub(super) fn start_check(&mut self, listed: BTreeSet<ServiceKey>) {
        let owned = owned_by_proxy(&self.cfg);
        let mut keys: BTreeSet<ServiceKey> = listed.into_iter().filter(|k| owned(k)).collect();
        keys.extend(self.desired.ipvs_keys());
        self.check.queue = keys.into_iter().collect();
        self.check.addresses = true;
        self.check.sets = true;
        self.check.next = None;
    }

    /// True when a step of the running check may run at `now`.
    ///
    /// Steps come at most once per `minSyncPeriod` by their own timer (`DriftCheck::next`), so
    /// the sync loop need not pace them: a step that ran alone does not restart the loop's
    /// `minSyncPeriod` wait, and a change right after it is programmed at once
    /// ([`crate::sync_loop::Backend::paced`]).
    pub(super) fn check_due(&self, now: Instant) -> bool {
        self.check.running()
            && self.retry.check.ready(now)
            && self.check.next.is_none_or(|t| now >= t)
    }

    /// When the next step of the running check is due by its own timer (None: no check
    /// running, or no step of it yet).
    pub(super) fn check_next(&self) -> Option<Instant> {
        self.check.next.filter(|_| self.check.running())
    }

    /// The periodic full sync of a proxier that adopted the kernel already: the changes
    /// pending (`delta`) programmed as an incremental sync would, the iptables rules restored,
    /// and a drift check started with one list of the family's virtual servers (unless one is
    /// running). Reads nothing else: the check's steps do, one per later sync at most every
    /// `minSyncPeriod`.
    pub(super) fn periodic_sync(
        &mut self,
        delta: Delta,
        kernel: &mut dyn Kernel,
        mut report: SyncReport,
        t: Instant,
    ) -> SyncReport {
        self.apply_delta(delta, kernel, &mut report);
        // The counts the rules are made from, from the desired state itself.
        self.set_counts = count_sets(&self.desired);
        let t = report.lap("apply", t);
        self.apply_rules(kernel, true, None, &mut report);
        let t = report.lap("iptables", t);
        if !self.check.running() {
            match kernel.list_ipvs(self.cfg.family) {
                Ok(keys) => {
                    self.full_failed.remove(&Subsystem::Ipvs);
                    self.start_check(keys);
                }
                Err(e) => {
                    report.fail(Subsystem::Ipvs, e.to_string());
                    self.full_failed.insert(Subsystem::Ipvs);
                    self.full_requested = true;
                    let delay = self.retry.full.failed(self.now);
                    tracing::warn!(error = %e, retry_in_ms = delay.as_millis() as u64,
                        "full sync: listing IPVS failed; retrying with backoff");
                    report.lap("read", t);
                    return report;
                }
            }
            report.lap("read", t);
        }
        self.full_requested = false;
        self.retry.full.succeeded();
        report
    }

    /// One step of the running check: the addresses, else the sets, else IPVS slices.
    pub(super) fn check_step(&mut self, kernel: &mut dyn Kernel, report: &mut SyncReport) {
        self.check.next = Some(self.now + self.retry.check.policy().min);
        if self.check.addresses {
            self.check_addresses(kernel, report);
        } else if self.check.sets {
            self.check_sets(kernel, report);
        } else {
            self.check_ipvs_step(kernel, report);
        }
    }

    /// A read of the check failed: its step stays queued, retried with backoff.
    fn check_read_failed(
        &mut self,
        subsystem: Subsystem,
        e: &KernelError,
        report: &mut SyncReport,
    ) {
        report.fail(subsystem, e.to_string());
        self.full_failed.insert(subsystem);
        // The backoff, not the step timer, says when the failed step runs again.
        self.check.next = None;
        let delay = self.retry.check.failed(self.now);
        tracing::warn!(error = %e, subsystem = subsystem.as_str(), retry_in_ms = delay.as_millis() as u64,
            "drift check: reading the kernel failed; retrying with backoff");
    }

    /// A read of the check succeeded.
    fn check_read(&mut self, subsystem: Subsystem) {
        self.full_failed.remove(&subsystem);
        self.retry.check.succeeded();
    }

    /// Reads, diffs and repairs the family's addresses on kube-ipvs0 (recreating the link if
    /// it is gone).
    fn check_addresses(&mut self, kernel: &mut dyn Kernel, report: &mut SyncReport) {
        let fam = self.cfg.family;
        let actual = match kernel
            .ensure_link()
            .and_then(|_| kernel.read_addresses(fam))
        {
            Ok(a) => a,
            Err(e) => return self.check_read_failed(Subsystem::Address, &e, report),
        };
        self.check_read(Subsystem::Address);
        self.check.addresses = false;
        let (add, del) = self.address_diff(&actual);
        drifted(report, "address", add.len() + del.len());
        self.apply_addrs(&add, &del, kernel, report);
        // Every address was read and diffed: a targeted repair waiting is done unless this
        // one failed again.
        if !report.failed.contains_key(&Subsystem::Address) {
            self.recheck_addresses = false;
            self.retry.address.succeeded();
        }
    }

    /// Reads, diffs and repairs the family's ipsets.
    fn check_sets(&mut self, kernel: &mut dyn Kernel, report: &mut SyncReport) {
        let owned_sets = SetKind::all_names(self.cfg.family);
        let actual = match kernel.read_ipsets(&owned_sets) {
            Ok(s) => s,
            Err(e) => return self.check_read_failed(Subsystem::Ipset, &e, report),
        };
        self.check_read(Subsystem::Ipset);
        self.check.sets = false;
        let diff = ipset::diff(&self.desired.ipset_state(), &actual);
        // What the kernel refuses for isolated Services differs every time: not drift.
        let (_, n, _) = unexplained(
            &Delta::default(),
            self.cfg.family,
            None,
            Some(&diff),
            (&[], &[]),
            &self.isolated(),
        );
        drifted(report, "ipset", n);
        let (grow, shrink) = split_set_diff(diff);
        self.apply_sets(&grow, kernel, report);
        self.apply_sets(&shrink, kernel, report);
        if !report.failed.contains_key(&Subsystem::Ipset) {
            self.recheck_sets = false;
            self.retry.ipset.succeeded();
        }
        // Rules that failed for want of a set just recreated go in now.
        if self.recheck_rules && !report.failed.contains_key(&Subsystem::Ipset) {
            self.apply_rules(kernel, true, None, report);
        }
    }

    /// Reads, diffs and repairs slices of the running check's virtual servers while its budget
    /// has not passed, at least one; what differs is drift (the changes pending were
    /// programmed before), counted like a full sync's.
    fn check_ipvs_step(&mut self, kernel: &mut dyn Kernel, report: &mut SyncReport) {
        let start = Instant::now();
        let isolated = self.isolated().0;
        let mut drift = 0;
        while self.check.running() {
            let n = CHECK_SLICE.min(self.check.queue.len());
            let keys: BTreeSet<ServiceKey> = self.check.queue.drain(..n).collect();
            let actual = match kernel.read_ipvs_keys(&keys) {
                Ok(t) => t,
                Err(e) => {
                    for k in keys.into_iter().rev() {
                        self.check.queue.push_front(k);
                    }
                    tracing::debug!(left = self.check.left(), "drift check: IPVS slice unread");
                    self.check_read_failed(Subsystem::Ipvs, &e, report);
                    break;
                }
            };
            self.check_read(Subsystem::Ipvs);
            let ops = self.ops_for_keys(&keys, &actual);
            drift += ops
                .apply
                .iter()
                .chain(&ops.remove)
                .filter(|op| op_key(op).is_none_or(|k| !isolated.contains(&k)))
                .count();
            self.apply_ipvs(&ops.apply, kernel, report);
            self.apply_ipvs(&ops.remove, kernel, report);
            if start.elapsed() >= self.check.budget {
                break;
            }
        }
        drifted(report, "ipvs", drift);
    }
}

/// Counts `n` differences of `subsystem` found by a check as drift.
fn drifted(report: &mut SyncReport, subsystem: &'static str, n: usize) {
    if n > 0 {
        tracing::warn!(subsystem, differences = n, "repairing drift");
        *report.drift.entry(subsystem).or_default() += n;
    }
}
