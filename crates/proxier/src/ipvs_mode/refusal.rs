//! Kernel-refused programming, isolated per Service.
//!
//! The kernel refuses a request when it answers a definite error for it (EINVAL, ERANGE,
//! EEXIST, ENOENT, ...: the request is wrong for this kernel, e.g. a scheduler whose module
//! the node lacks), as opposed to a transient failure (a timeout, ENOBUFS, EAGAIN, ENOMEM,
//! EBUSY, a socket error) or a node-wide one (EPERM). A refusal of a request that belongs to
//! one Service is isolated once it is confirmed: the first failure is retried like any other
//! (a targeted repair re-reads the kernel, which resolves a stale view such as an EEXIST); when
//! that repair is refused again, the Service is **isolated**: what the kernel holds for it stays
//! as it is (the last-good state: nothing is deleted to make room), it is reported (a log line,
//! [`Refusal`]s for the Event and the metrics, [`SyncReport::refused`]), retried with its own
//! backoff, and it is **not** a subsystem failure: it never makes the node unhealthy. Other
//! Services' programming is not held up by it. Upstream kube-proxy logs a failed IPVS request
//! and retries the whole sync (`syncProxyRules` → `syncRunner.RetryAfter`), so one refused
//! Service keeps its health failing; kube-ipvs does better here.
//!
//! An ipset line rejected by the kernel is a refusal when it is a member line whose owner is a
//! Service (set creation problems are node-wide). Until a Service's refusal clears, later syncs
//! refused for the same Service count as isolated at once.

use super::*;

/// The IPVS errnos that are a definite answer about the request itself.
const REFUSAL_ERRNOS: [(i32, &str); 8] = [
    (2, "enoent"), // no such destination, or the scheduler's module is missing
    (3, "esrch"),  // no such service
    (7, "e2big"),
    (17, "eexist"),
    (22, "einval"),
    (34, "erange"),
    (75, "eoverflow"),
    (90, "emsgsize"),
];

/// The fixed label of a refused IPVS request's errno, if the error is a refusal.
pub fn refusal_label(e: &KernelError) -> Option<&'static str> {
    let KernelError::Ipvs(ipvs_netlink::Error::Kernel { errno, .. }) = e else {
        return None;
    };
    REFUSAL_ERRNOS
        .iter()
        .find(|(n, _)| n == errno)
        .map(|(_, label)| *label)
}

/// The fixed `reason` label of an ipset member the kernel rejected.
pub const IPSET_REJECTED: &str = "ipset_rejected";

/// Every `(subsystem, reason)` a [`Refusal`] can carry (a fixed set: metric labels).
pub fn refusal_labels() -> impl Iterator<Item = (Subsystem, &'static str)> {
    REFUSAL_ERRNOS
        .iter()
        .map(|(_, label)| (Subsystem::Ipvs, *label))
        .chain(std::iter::once((Subsystem::Ipset, IPSET_REJECTED)))
}

/// A Service whose programming the kernel refused, newly isolated (for its Event and log).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Refusal {
    /// The Service.
    pub service: ServiceName,
    /// The subsystem that refused.
    pub subsystem: Subsystem,
    /// A fixed word for the answer (`einval`, `enoent`, ..., `ipset_rejected`).
    pub reason: &'static str,
    /// The kernel's answer and the request, at most [`MAX_ERROR_LEN`] bytes.
    pub error: String,
}

/// What of a Service a refusal concerns.
#[derive(Debug, Clone)]
pub(super) enum Refused {
    /// A request for this virtual server.
    Key(ServiceKey),
    /// A member of its sets: `(set, member)`.
    Member(String, ipset::Entry),
}

/// The most newly isolated Services kept for [`Proxier::take_refusals`] between two calls
/// (the sync loop takes them after every sync); later ones are still isolated and logged.
const MAX_NEW_REFUSALS: usize = 1024;

/// What is isolated of one Service.
#[derive(Debug, Clone, Default)]
pub(super) struct Isolated {
    /// Its virtual servers whose requests were refused.
    pub keys: BTreeSet<ServiceKey>,
    /// Members of its sets that were refused: `(set, member)`.
    pub members: BTreeSet<(String, ipset::Entry)>,
}

impl Proxier {
    /// Services isolated now because the kernel refuses their programming.
    pub fn refused_services(&self) -> usize {
        self.refused.len()
    }

    /// The isolated Services, by name.
    pub fn refused(&self) -> impl Iterator<Item = &ServiceName> {
        self.refused.keys()
    }

    /// Services newly isolated since the last call (each reported once per isolation).
    pub fn take_refusals(&mut self) -> Vec<Refusal> {
        std::mem::take(&mut self.new_refusals)
    }

    /// True when a definite refusal of a request of `owner` is isolated rather than counted
    /// as a failure: a repair made the request (the kernel was re-read first), or the Service
    /// is isolated already.
    pub(super) fn isolates(&self, owner: &ServiceName) -> bool {
        self.repairing || self.refused.contains_key(owner)
    }

    /// What the isolated Services' refused requests touch: their virtual servers and set
    /// members (a full sync finds them different every time; that is not drift).
    pub(super) fn isolated(&self) -> (BTreeSet<ServiceKey>, BTreeSet<(String, ipset::Entry)>) {
        let keys = self.refused.values().flat_map(|i| i.keys.iter().copied());
        let members = self
            .refused
            .values()
            .flat_map(|i| i.members.iter().cloned());
        (keys.collect(), members.collect())
    }

    /// Isolates `owner` for a refused request; logs and queues a [`Refusal`] the first time.
    pub(super) fn isolate(
        &mut self,
        owner: ServiceName,
        what: Refused,
        subsystem: Subsystem,
        reason: &'static str,
        error: String,
        report: &mut SyncReport,
    ) {
        *report.refused.entry(subsystem).or_default() += 1;
        let newly = !self.refused.contains_key(&owner) && !self.refused_before.contains_key(&owner);
        let entry = self.refused.entry(owner.clone()).or_default();
        match what {
            Refused::Key(k) => {
                entry.keys.insert(k);
            }
            Refused::Member(set, member) => {
                entry.members.insert((set, member));
            }
        }
        // The first isolation schedules the retry; while retries run they set it.
        if !self.retry.refused.failing() {
            self.retry.refused.failed(self.now);
        }
        if newly {
            tracing::warn!(service = %owner, subsystem = subsystem.as_str(), reason, error = %error,
                "the kernel refuses this Service's programming: isolated (what the kernel holds \
                 for it stays), retried with backoff; the node stays healthy");
            if self.new_refusals.len() < MAX_NEW_REFUSALS {
                self.new_refusals.push(Refusal {
                    service: owner,
                    subsystem,
                    reason,
                    error: truncate_text(&error, MAX_ERROR_LEN),
                });
            }
        }
    }

    /// Retries the isolated Services: their virtual servers re-read and re-applied, and the
    /// sets re-read and repaired when members were refused. A Service none of whose requests
    /// is refused any more leaves isolation.
    pub(super) fn retry_refused(&mut self, kernel: &mut dyn Kernel, report: &mut SyncReport) {
        let before = std::mem::take(&mut self.refused);
        let keys: BTreeSet<ServiceKey> = before.values().flat_map(|i| i.keys.clone()).collect();
        let sets = before.values().any(|i| !i.members.is_empty());
        self.refused_before = before;
        self.repairing = true;
        if !keys.is_empty() {
            match kernel.read_ipvs_keys(&keys) {
                Ok(actual) => {
                    let desired: IpvsTable =
                        self.desired.ipvs_table_for(&keys).into_iter().collect();
                    let ops = {
                        let owned = owned_by_proxy(&self.cfg);
                        let only_keys = |k: &ServiceKey| keys.contains(k) && owned(k);
                        diff_ipvs(&desired, &actual, &only_keys)
                    };
                    let ops = self.graceful(ops, Some(&actual));
                    self.apply_ipvs(&ops.apply, kernel, report);
                    self.apply_ipvs(&ops.remove, kernel, report);
                }
                Err(e) => {
                    // Not known: the isolation stays as it was.
                    report.fail(Subsystem::Ipvs, e.to_string());
                    for (name, i) in &self.refused_before {
                        let entry = self.refused.entry(name.clone()).or_default();
                        entry.keys.extend(i.keys.iter().copied());
                    }
                }
            }
        }
        if sets {
            self.repair_sets(kernel, report);
            if report.failed.contains_key(&Subsystem::Ipset) {
                for (name, i) in &self.refused_before {
                    if !i.members.is_empty() {
                        let entry = self.refused.entry(name.clone()).or_default();
                        entry.members.extend(i.members.iter().cloned());
                    }
                }
            }
        }
        self.repairing = false;
        for name in self.refused_before.keys() {
            if !self.refused.contains_key(name) {
                tracing::info!(service = %name, "the kernel accepts this Service's programming again");
            }
        }
        self.refused_before.clear();
        if self.refused.is_empty() {
            self.retry.refused.succeeded();
        } else {
            self.retry.refused.failed(self.now);
        }
    }
}
