//! Fault injection for the controller's kernel boundary.
//!
//! [`FaultKernel`] wraps any [`proxier::kernel::Kernel`] (the in-memory [`crate::fake_kernel::FakeKernel`], or a
//! real `NodeKernel`) and [`FaultRunner`] wraps any iptables-mode
//! [`proxier::iptables_mode::RestoreRunner`]. A shared [`FaultHandle`] says which operation
//! (or every operation of a subsystem) misbehaves, how, and on which calls:
//!
//! - [`Action::Errno`]: fail at once with that errno, as the subsystem's own error type;
//! - [`Action::Hang`]: block for a while, then do the real operation (a slow kernel, a held lock);
//! - [`Action::Timeout`]: block for a while, then fail with `ETIMEDOUT` (what a call that timed
//!   out reports);
//!
//! on the Nth call, every call from the Nth, calls N..=M, or every call ([`Calls`]). A fault counts
//! the calls of its operation (or subsystem) made after it was injected, from 1. The handle is
//! cloned into the test, so faults can be added and cleared while the code under test runs.
//!
//! A kernel that refuses one object's programming while accepting the rest is set up with
//! [`FaultHandle::refuse_ipvs`] (every IPVS request for one virtual server fails with an errno,
//! the others go through) and [`FaultHandle::reject_ipset_entry`] (that member's line is
//! rejected, the rest of the diff is applied), like a kernel that answers one request with
//! EINVAL or rejects one `ipset restore` line.

use std::collections::HashMap;
use std::io;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use conntrack::{ConntrackError, ConntrackFilter};
use desired::diff::IpvsTable;
use ipset::{IpsetDiff, IpsetState};
use ipvs_netlink::{Family, Op, OpKind, ServiceKey};
use proxier::iptables_mode::RestoreRunner;
use proxier::kernel::{Kernel, KernelCounters, KernelError};
use proxier::retry::Subsystem;

/// The virtual server an IPVS operation is about.
fn op_key(op: &Op) -> Option<ServiceKey> {
    match op {
        Op::NewService(s) | Op::SetService(s) => Some(s.key),
        Op::DelService(k) | Op::NewDest(k, _) | Op::SetDest(k, _) | Op::DelDest(k, ..) => Some(*k),
        Op::Flush | Op::SetTimeouts(_) => None,
    }
}
use std::collections::BTreeSet;
use std::net::IpAddr;

/// `ETIMEDOUT` on Linux.
pub const ETIMEDOUT: i32 = 110;
/// `EBUSY` on Linux.
pub const EBUSY: i32 = 16;
/// `ENOMEM` on Linux.
pub const ENOMEM: i32 = 12;
/// `EPERM` on Linux.
pub const EPERM: i32 = 1;
/// `ENOENT` on Linux (IPVS: no such destination, or the scheduler's module is missing).
pub const ENOENT: i32 = 2;
/// `EINVAL` on Linux.
pub const EINVAL: i32 = 22;

/// One operation of the kernel boundary.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum KernelOp {
    /// `Kernel::read_ipvs` (the full dump).
    ReadIpvs,
    /// `Kernel::read_ipvs_keys` (targeted reads: repairs, drain checks).
    ReadIpvsKeys,
    /// `Kernel::apply_ipvs` (every operation of the batch fails).
    ApplyIpvs,
    /// `Kernel::ensure_link`.
    EnsureLink,
    /// `Kernel::read_addresses`.
    ReadAddresses,
    /// `Kernel::apply_addresses` (every address of the call fails).
    ApplyAddresses,
    /// `Kernel::read_ipsets`.
    ReadIpsets,
    /// `Kernel::apply_ipsets`.
    ApplyIpsets,
    /// `Kernel::apply_iptables`, `RestoreRunner::restore`.
    ApplyIptables,
    /// `RestoreRunner::save` (iptables mode).
    SaveIptables,
    /// `Kernel::delete_conntrack`.
    DeleteConntrack,
}

impl KernelOp {
    /// The subsystem the operation belongs to.
    pub fn subsystem(self) -> Subsystem {
        match self {
            KernelOp::ReadIpvs | KernelOp::ReadIpvsKeys | KernelOp::ApplyIpvs => Subsystem::Ipvs,
            KernelOp::EnsureLink | KernelOp::ReadAddresses | KernelOp::ApplyAddresses => {
                Subsystem::Address
            }
            KernelOp::ReadIpsets | KernelOp::ApplyIpsets => Subsystem::Ipset,
            KernelOp::ApplyIptables | KernelOp::SaveIptables => Subsystem::Iptables,
            KernelOp::DeleteConntrack => Subsystem::Conntrack,
        }
    }
}

/// Which operations a fault hits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Target {
    /// One operation (its calls are counted on their own).
    Op(KernelOp),
    /// Every operation of a subsystem (calls counted over the whole subsystem).
    Subsystem(Subsystem),
}

/// What happens to a hit call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Action {
    /// Fail at once with this (positive) errno.
    Errno(i32),
    /// Sleep, then run the operation normally.
    Hang(Duration),
    /// Sleep, then fail with `ETIMEDOUT`.
    Timeout(Duration),
}

/// Which calls (1-based) are hit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Calls {
    /// Only the Nth.
    Nth(u64),
    /// The Nth and every later one.
    From(u64),
    /// The Nth to the Mth, inclusive.
    Range(u64, u64),
    /// Every call.
    Always,
}

impl Calls {
    fn hits(self, n: u64) -> bool {
        match self {
            Calls::Nth(k) => n == k,
            Calls::From(k) => n >= k,
            Calls::Range(a, b) => (a..=b).contains(&n),
            Calls::Always => true,
        }
    }
}

/// One fault.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Fault {
    /// Which operations.
    pub target: Target,
    /// What happens.
    pub action: Action,
    /// On which calls.
    pub calls: Calls,
}

impl Fault {
    /// `op` fails with `errno` on `calls`.
    pub fn errno(op: KernelOp, errno: i32, calls: Calls) -> Fault {
        Fault {
            target: Target::Op(op),
            action: Action::Errno(errno),
            calls,
        }
    }
}

#[derive(Debug, Default)]
struct State {
    /// Each fault with the call count of its target when it was injected.
    faults: Vec<(Fault, u64)>,
    op_calls: HashMap<KernelOp, u64>,
    subsystem_calls: HashMap<Subsystem, u64>,
    injected: HashMap<KernelOp, u64>,
    /// Virtual servers whose requests (of one kind, or all: `None`) fail with an errno.
    refuse_ipvs: HashMap<(ServiceKey, Option<OpKind>), i32>,
    /// Set members whose lines are rejected.
    reject_ipset: BTreeSet<ipset::Entry>,
}

/// The shared, run-time configuration of a [`FaultKernel`] / [`FaultRunner`].
#[derive(Debug, Clone, Default)]
pub struct FaultHandle(Arc<Mutex<State>>);

impl FaultHandle {
    /// A handle without faults.
    pub fn new() -> FaultHandle {
        FaultHandle::default()
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.0.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Adds a fault; its calls are counted from now (the next call is call 1).
    pub fn inject(&self, fault: Fault) {
        let mut s = self.lock();
        let base = match fault.target {
            Target::Op(op) => s.op_calls.get(&op).copied().unwrap_or(0),
            Target::Subsystem(x) => s.subsystem_calls.get(&x).copied().unwrap_or(0),
        };
        s.faults.push((fault, base));
    }

    /// Removes every fault (refusals and rejections included).
    pub fn clear(&self) {
        let mut s = self.lock();
        s.faults.clear();
        s.refuse_ipvs.clear();
        s.reject_ipset.clear();
    }

    /// Every IPVS request for `key` fails with `errno` (the kernel refuses it); the requests
    /// for other virtual servers in the same batch are applied.
    pub fn refuse_ipvs(&self, key: ServiceKey, errno: i32) {
        self.lock().refuse_ipvs.insert((key, None), errno);
    }

    /// Requests of kind `op` for `key` fail with `errno` (the others for `key` go through,
    /// unless [`FaultHandle::refuse_ipvs`] says otherwise).
    pub fn refuse_ipvs_op(&self, key: ServiceKey, op: OpKind, errno: i32) {
        self.lock().refuse_ipvs.insert((key, Some(op)), errno);
    }

    /// Stops refusing the requests for `key` (of every kind).
    pub fn accept_ipvs(&self, key: &ServiceKey) {
        self.lock().refuse_ipvs.retain(|(k, _), _| k != key);
    }

    /// A line adding `entry` (to any set) is rejected, as `ipset restore` reports a line the
    /// kernel refused; the rest of the diff is applied.
    pub fn reject_ipset_entry(&self, entry: ipset::Entry) {
        self.lock().reject_ipset.insert(entry);
    }

    fn refused_errno(&self, op: &Op) -> Option<i32> {
        let s = self.lock();
        let k = op_key(op)?;
        s.refuse_ipvs
            .get(&(k, Some(op.kind())))
            .or_else(|| s.refuse_ipvs.get(&(k, None)))
            .copied()
    }

    fn rejected(&self, entry: &ipset::Entry) -> bool {
        self.lock().reject_ipset.contains(entry)
    }

    /// Calls of `op` so far (hit or not).
    pub fn calls(&self, op: KernelOp) -> u64 {
        self.lock().op_calls.get(&op).copied().unwrap_or(0)
    }

    /// Calls of `op` a fault was injected into.
    pub fn injected(&self, op: KernelOp) -> u64 {
        self.lock().injected.get(&op).copied().unwrap_or(0)
    }

    /// Counts a call of `op` and returns the action of the first fault that hits it.
    fn on_call(&self, op: KernelOp) -> Option<Action> {
        let mut s = self.lock();
        let sub = op.subsystem();
        let n_op = {
            let c = s.op_calls.entry(op).or_default();
            *c += 1;
            *c
        };
        let n_sub = {
            let c = s.subsystem_calls.entry(sub).or_default();
            *c += 1;
            *c
        };
        let action = s.faults.iter().find_map(|(f, base)| {
            let hit = match f.target {
                Target::Op(o) => o == op && f.calls.hits(n_op - base),
                Target::Subsystem(x) => x == sub && f.calls.hits(n_sub - base),
            };
            hit.then_some(f.action)
        });
        if action.is_some() {
            *s.injected.entry(op).or_default() += 1;
        }
        action
    }

    /// Runs the action for `op` (outside the lock): `Some(errno)` when the call must fail.
    fn decide(&self, op: KernelOp) -> Option<i32> {
        match self.on_call(op)? {
            Action::Errno(e) => Some(e),
            Action::Hang(d) => {
                std::thread::sleep(d);
                None
            }
            Action::Timeout(d) => {
                std::thread::sleep(d);
                Some(ETIMEDOUT)
            }
        }
    }
}

fn os(errno: i32) -> io::Error {
    io::Error::from_raw_os_error(errno)
}

/// The error `op` reports for `errno`, as its subsystem's own error type.
pub fn error_for(op: KernelOp, errno: i32) -> KernelError {
    match op {
        KernelOp::ReadIpvs | KernelOp::ReadIpvsKeys => KernelError::Ipvs(ipvs_netlink::Error::Io {
            what: "recv (injected fault)",
            source: os(errno),
        }),
        KernelOp::ApplyIpvs => KernelError::Ipvs(ipvs_netlink::Error::Kernel {
            op: OpKind::NewService,
            errno,
        }),
        KernelOp::EnsureLink | KernelOp::ReadAddresses | KernelOp::ApplyAddresses => {
            KernelError::Netif(netif::Error::Transport {
                object: "kube-ipvs0 (injected fault)".into(),
                detail: os(errno).to_string(),
            })
        }
        KernelOp::ReadIpsets | KernelOp::ApplyIpsets => KernelError::Ipset(ipset::Error::Io {
            command: "ipset (injected fault)".into(),
            source: os(errno),
        }),
        KernelOp::ApplyIptables | KernelOp::SaveIptables => {
            KernelError::Iptables(iptables::Error::Io {
                command: "iptables-restore (injected fault)".into(),
                source: os(errno),
            })
        }
        KernelOp::DeleteConntrack => KernelError::Conntrack(ConntrackError::Kernel {
            op: "delete (injected fault)",
            errno,
        }),
    }
}

/// A kernel whose operations fail, hang or time out as its [`FaultHandle`] says.
#[derive(Debug)]
pub struct FaultKernel<K> {
    /// The wrapped kernel (does the real work of calls that are not failed).
    pub inner: K,
    handle: FaultHandle,
}

impl<K: Kernel> FaultKernel<K> {
    /// Wraps `inner`; returns the kernel and a handle to configure it.
    pub fn new(inner: K) -> (FaultKernel<K>, FaultHandle) {
        let handle = FaultHandle::new();
        (
            FaultKernel {
                inner,
                handle: handle.clone(),
            },
            handle,
        )
    }
}

impl<K: Kernel> Kernel for FaultKernel<K> {
    fn read_ipvs(&mut self, family: Family) -> Result<IpvsTable, KernelError> {
        match self.handle.decide(KernelOp::ReadIpvs) {
            Some(e) => Err(error_for(KernelOp::ReadIpvs, e)),
            None => self.inner.read_ipvs(family),
        }
    }
    fn list_ipvs(&mut self, family: Family) -> Result<BTreeSet<ServiceKey>, KernelError> {
        // The listing is the first half of a whole-table read: the same faults apply.
        match self.handle.decide(KernelOp::ReadIpvs) {
            Some(e) => Err(error_for(KernelOp::ReadIpvs, e)),
            None => self.inner.list_ipvs(family),
        }
    }
    fn read_ipvs_keys(&mut self, keys: &BTreeSet<ServiceKey>) -> Result<IpvsTable, KernelError> {
        match self.handle.decide(KernelOp::ReadIpvsKeys) {
            Some(e) => Err(error_for(KernelOp::ReadIpvsKeys, e)),
            None => self.inner.read_ipvs_keys(keys),
        }
    }
    fn apply_ipvs(&mut self, ops: &[Op]) -> Vec<Result<(), KernelError>> {
        match self.handle.decide(KernelOp::ApplyIpvs) {
            Some(errno) => ops
                .iter()
                .map(|op| {
                    Err(KernelError::Ipvs(ipvs_netlink::Error::Kernel {
                        op: op.kind(),
                        errno,
                    }))
                })
                .collect(),
            None => {
                let refused: Vec<Option<i32>> =
                    ops.iter().map(|op| self.handle.refused_errno(op)).collect();
                if refused.iter().all(Option::is_none) {
                    return self.inner.apply_ipvs(ops);
                }
                let accepted: Vec<Op> = ops
                    .iter()
                    .zip(&refused)
                    .filter(|(_, r)| r.is_none())
                    .map(|(op, _)| op.clone())
                    .collect();
                let mut results = self.inner.apply_ipvs(&accepted).into_iter();
                ops.iter()
                    .zip(refused)
                    .map(|(op, r)| match r {
                        Some(errno) => Err(KernelError::Ipvs(ipvs_netlink::Error::Kernel {
                            op: op.kind(),
                            errno,
                        })),
                        None => results.next().unwrap_or(Ok(())),
                    })
                    .collect()
            }
        }
    }
    fn ensure_link(&mut self) -> Result<bool, KernelError> {
        match self.handle.decide(KernelOp::EnsureLink) {
            Some(e) => Err(error_for(KernelOp::EnsureLink, e)),
            None => self.inner.ensure_link(),
        }
    }
    fn read_addresses(&mut self, family: Family) -> Result<BTreeSet<IpAddr>, KernelError> {
        match self.handle.decide(KernelOp::ReadAddresses) {
            Some(e) => Err(error_for(KernelOp::ReadAddresses, e)),
            None => self.inner.read_addresses(family),
        }
    }
    fn apply_addresses(
        &mut self,
        add: &[IpAddr],
        del: &[IpAddr],
    ) -> Vec<(IpAddr, Result<(), KernelError>)> {
        match self.handle.decide(KernelOp::ApplyAddresses) {
            Some(e) => add
                .iter()
                .chain(del)
                .map(|ip| (*ip, Err(error_for(KernelOp::ApplyAddresses, e))))
                .collect(),
            None => self.inner.apply_addresses(add, del),
        }
    }
    fn read_ipsets(&mut self, owned: &[String]) -> Result<IpsetState, KernelError> {
        match self.handle.decide(KernelOp::ReadIpsets) {
            Some(e) => Err(error_for(KernelOp::ReadIpsets, e)),
            None => self.inner.read_ipsets(owned),
        }
    }
    fn apply_ipsets(&mut self, diff: &IpsetDiff) -> Result<Vec<ipset::Rejected>, KernelError> {
        match self.handle.decide(KernelOp::ApplyIpsets) {
            Some(e) => Err(error_for(KernelOp::ApplyIpsets, e)),
            None => {
                let (refused, adds): (Vec<_>, Vec<_>) = diff
                    .adds
                    .iter()
                    .cloned()
                    .partition(|c| self.handle.rejected(&c.entry));
                let accepted = IpsetDiff {
                    adds,
                    ..diff.clone()
                };
                let mut out = self.inner.apply_ipsets(&accepted)?;
                out.extend(refused.into_iter().map(|c| ipset::Rejected {
                    line: format!("add {} {}", c.set, c.entry),
                    set: c.set.to_string(),
                    entry: Some(c.entry),
                    owner: c.owner.to_string(),
                    message: "Kernel error received: hash is full, cannot add more elements                               (injected)"
                        .to_string(),
                    skipped: 0,
                }));
                Ok(out)
            }
        }
    }
    fn apply_iptables(
        &mut self,
        rules: &iptables::RuleSet,
        force: bool,
    ) -> Result<bool, KernelError> {
        match self.handle.decide(KernelOp::ApplyIptables) {
            Some(e) => Err(error_for(KernelOp::ApplyIptables, e)),
            None => self.inner.apply_iptables(rules, force),
        }
    }
    fn delete_conntrack(&mut self, filters: &[ConntrackFilter]) -> Result<u64, KernelError> {
        match self.handle.decide(KernelOp::DeleteConntrack) {
            Some(e) => Err(error_for(KernelOp::DeleteConntrack, e)),
            None => self.inner.delete_conntrack(filters),
        }
    }
    fn counters(&self) -> KernelCounters {
        self.inner.counters()
    }
}

/// An iptables-mode restore runner whose saves, chain listings and restores fail, hang or time
/// out as its [`FaultHandle`] says ([`KernelOp::SaveIptables`] for both reads,
/// [`KernelOp::ApplyIptables`]).
#[derive(Debug)]
pub struct FaultRunner<R> {
    /// The wrapped runner.
    pub inner: R,
    handle: FaultHandle,
}

impl<R: RestoreRunner> FaultRunner<R> {
    /// Wraps `inner`; returns the runner and a handle to configure it.
    pub fn new(inner: R) -> (FaultRunner<R>, FaultHandle) {
        let handle = FaultHandle::new();
        (
            FaultRunner {
                inner,
                handle: handle.clone(),
            },
            handle,
        )
    }
}

impl<R: RestoreRunner> RestoreRunner for FaultRunner<R> {
    fn save(&mut self, table: iptables::Table) -> Result<String, KernelError> {
        match self.handle.decide(KernelOp::SaveIptables) {
            Some(e) => Err(error_for(KernelOp::SaveIptables, e)),
            None => self.inner.save(table),
        }
    }
    /// A read of the rules like `save`: faulted as [`KernelOp::SaveIptables`].
    fn list_chain(&mut self, table: iptables::Table, chain: &str) -> Result<String, KernelError> {
        match self.handle.decide(KernelOp::SaveIptables) {
            Some(e) => Err(error_for(KernelOp::SaveIptables, e)),
            None => self.inner.list_chain(table, chain),
        }
    }
    fn restore(&mut self, payload: &str) -> Result<(), KernelError> {
        match self.handle.decide(KernelOp::ApplyIptables) {
            Some(e) => Err(error_for(KernelOp::ApplyIptables, e)),
            None => self.inner.restore(payload),
        }
    }
    fn processes(&self) -> u64 {
        self.inner.processes()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fake_kernel::FakeKernel;

    #[test]
    fn nth_from_range_and_clear() {
        let (mut k, h) = FaultKernel::new(FakeKernel::default());
        h.inject(Fault::errno(KernelOp::ReadIpvs, EBUSY, Calls::Nth(2)));
        assert!(k.read_ipvs(Family::Inet).is_ok());
        let e = k.read_ipvs(Family::Inet).unwrap_err();
        assert!(e.to_string().contains("busy"), "{e}");
        assert!(k.read_ipvs(Family::Inet).is_ok());
        h.inject(Fault::errno(
            KernelOp::ReadAddresses,
            ENOMEM,
            Calls::Range(2, 3),
        ));
        let r: Vec<bool> = (0..4)
            .map(|_| k.read_addresses(Family::Inet).is_ok())
            .collect();
        assert_eq!(r, [true, false, false, true]);
        h.inject(Fault {
            target: Target::Subsystem(Subsystem::Ipset),
            action: Action::Errno(EPERM),
            calls: Calls::From(1),
        });
        assert!(k.read_ipsets(&[]).is_err());
        assert!(k.apply_ipsets(&IpsetDiff::default()).is_err());
        h.clear();
        assert!(k.read_ipsets(&[]).is_ok());
        assert_eq!(h.calls(KernelOp::ReadIpsets), 2);
        assert_eq!(h.injected(KernelOp::ReadIpsets), 1);
        assert_eq!(h.injected(KernelOp::ReadIpvs), 1);
    }

    #[test]
    fn errors_are_the_subsystems_own_types() {
        assert!(matches!(
            error_for(KernelOp::ApplyIptables, EBUSY),
            KernelError::Iptables(_)
        ));
        assert!(matches!(
            error_for(KernelOp::DeleteConntrack, EPERM),
            KernelError::Conntrack(ConntrackError::Kernel { errno: 1, .. })
        ));
        assert!(matches!(
            error_for(KernelOp::ApplyAddresses, EPERM),
            KernelError::Netif(_)
        ));
        let (mut k, h) = FaultKernel::new(FakeKernel::default());
        h.inject(Fault {
            target: Target::Op(KernelOp::ApplyIptables),
            action: Action::Timeout(Duration::from_millis(1)),
            calls: Calls::Always,
        });
        let e = k
            .apply_iptables(&iptables::RuleSet::default(), false)
            .unwrap_err();
        assert!(e.to_string().contains("timed out"), "{e}");
    }
}
