//! The IPVS part of a periodic drift check, read a slice of virtual servers at a time.
//!
//! A periodic full sync reads every subsystem but IPVS whole, lists the family's virtual
//! servers (one services dump, no real servers) and queues their keys with the desired ones.
//! Each later sync first programs the changes pending (an incremental sync), then reads, diffs
//! and repairs the next virtual servers of the queue for about [`CHECK_STEP_BUDGET`]. A change
//! so waits for at most one slice, instead of for a read of the whole table: 8.5 s for 5,000
//! virtual servers x 10 real servers in the emulated benchmark VM, during which every change
//! waited (`docs/benchmarks.md`). Upstream's IPVS proxier reads the whole table at every sync
//! (`syncProxyRules`: `GetVirtualServers`, then `GetRealServers` per service) and makes every
//! change wait for it.
//!
//! Each slice is consistent: the changes before it are programmed, nothing writes between its
//! read and its repairs. A slice whose read fails stays queued and is retried with backoff;
//! nothing is deleted on the strength of a failed read. A check still running when the next
//! periodic full sync comes goes on; the next check starts when it ended. The first full sync
//! (adoption) and a full sync that must adopt kernel state still read the table whole.

use std::collections::{BTreeSet, VecDeque};
use std::time::{Duration, Instant};

use super::*;

/// Default time one sync spends on drift-check slices: slices are read while it has not
/// passed, at least one (see [`Proxier::with_check_budget`]).
pub const CHECK_STEP_BUDGET: Duration = Duration::from_millis(200);

/// Virtual servers read per slice (two requests each: the service, its real servers).
pub const CHECK_SLICE: usize = 64;

/// The virtual servers a drift check still has to read.
#[derive(Debug)]
pub(super) struct IpvsCheck {
    queue: VecDeque<ServiceKey>,
    budget: Duration,
}

impl Default for IpvsCheck {
    fn default() -> Self {
        IpvsCheck {
            queue: VecDeque::new(),
            budget: CHECK_STEP_BUDGET,
        }
    }
}

impl IpvsCheck {
    /// True while a check runs.
    pub(super) fn running(&self) -> bool {
        !self.queue.is_empty()
    }

    /// Virtual servers left to read.
    pub(super) fn left(&self) -> usize {
        self.queue.len()
    }
}

impl Proxier {
    /// Sets the time one sync spends on drift-check slices (zero: one slice per sync).
    pub fn with_check_budget(mut self, budget: Duration) -> Proxier {
        self.ipvs_check.budget = budget;
        self
    }

    /// A full sync may leave IPVS to sliced drift checks: it is not the first (adoption reads
    /// the table whole) and nothing has to be adopted from the kernel.
    pub(super) fn ipvs_check_sliced(&self, store: &Store) -> bool {
        self.applied_once
            && self.to_adopt.is_empty()
            && !(store.node().is_none() && self.cfg.node_port_primary)
    }

    /// Starts a check of the listed virtual servers (those of the family the proxy owns) and
    /// the desired ones.
    pub(super) fn start_ipvs_check(&mut self, listed: BTreeSet<ServiceKey>) {
        let owned = owned_by_proxy(&self.cfg);
        let mut keys: BTreeSet<ServiceKey> = listed.into_iter().filter(|k| owned(k)).collect();
        keys.extend(self.desired.ipvs_keys());
        self.ipvs_check.queue = keys.into_iter().collect();
    }

    /// True when a slice of the running check may be read at `now`.
    pub(super) fn ipvs_check_due(&self, now: Instant) -> bool {
        self.ipvs_check.running() && self.retry.check.ready(now)
    }

    /// Reads, diffs and repairs slices of the running check while its budget has not passed,
    /// at least one; what differs is drift (the changes pending were programmed
    /// before), counted like a full sync's.
    pub(super) fn check_ipvs_step(&mut self, kernel: &mut dyn Kernel, report: &mut SyncReport) {
        let start = Instant::now();
        let isolated = self.isolated().0;
        let mut drift = 0;
        while self.ipvs_check.running() {
            let n = CHECK_SLICE.min(self.ipvs_check.queue.len());
            let keys: BTreeSet<ServiceKey> = self.ipvs_check.queue.drain(..n).collect();
            let actual = match kernel.read_ipvs_keys(&keys) {
                Ok(t) => t,
                Err(e) => {
                    for k in keys.into_iter().rev() {
                        self.ipvs_check.queue.push_front(k);
                    }
                    report.fail(Subsystem::Ipvs, e.to_string());
                    self.full_failed.insert(Subsystem::Ipvs);
                    let delay = self.retry.check.failed(self.now);
                    tracing::warn!(error = %e, left = self.ipvs_check.left(),
                        retry_in_ms = delay.as_millis() as u64,
                        "drift check: reading IPVS failed; retrying with backoff");
                    break;
                }
            };
            self.full_failed.remove(&Subsystem::Ipvs);
            self.retry.check.succeeded();
            let ops = self.ops_for_keys(&keys, &actual);
            drift += ops
                .apply
                .iter()
                .chain(&ops.remove)
                .filter(|op| op_key(op).is_none_or(|k| !isolated.contains(&k)))
                .count();
            self.apply_ipvs(&ops.apply, kernel, report);
            self.apply_ipvs(&ops.remove, kernel, report);
            if start.elapsed() >= self.ipvs_check.budget {
                break;
            }
        }
        if drift > 0 {
            tracing::warn!(subsystem = "ipvs", differences = drift, "repairing drift");
            *report.drift.entry("ipvs").or_default() += drift;
        }
    }
}
