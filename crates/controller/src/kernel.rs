//! The kernel as the proxier sees it: read and apply per subsystem, behind one trait.
//!
//! [`Kernel`] is the IO boundary of the controller. [`NodeKernel`] is the real node (IPVS over
//! generic netlink, kube-ipvs0 over rtnetlink, ipset over netlink for small member changes and
//! `ipset restore` otherwise, `iptables-restore`);
//! [`FakeKernel`] is an in-memory kernel for tests that counts the requests each subsystem
//! received, so tests can prove that work is proportional to what changed.

use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;

use ipset::{IpsetDiff, IpsetState};
use ipvs_netlink::{Op, OpCounts, OpKind, ServiceKey};

use crate::conntrack::ConntrackFilter;
use crate::diff::{table_from_dump, IpvsTable, VirtualServer};

/// A failure of one kernel subsystem.
#[derive(Debug, thiserror::Error)]
pub enum KernelError {
    /// IPVS (generic netlink) failed.
    #[error("ipvs: {0}")]
    Ipvs(#[from] ipvs_netlink::Error),
    /// kube-ipvs0 or address handling (rtnetlink) failed.
    #[error("kube-ipvs0: {0}")]
    Netif(#[from] netif::Error),
    /// An ipset command failed.
    #[error("ipset: {0}")]
    Ipset(#[from] ipset::Error),
    /// iptables-restore or iptables-save failed.
    #[error("iptables: {0}")]
    Iptables(#[from] iptables::Error),
    /// conntrack cleanup (ctnetlink) failed.
    #[error("conntrack: {0}")]
    Conntrack(#[from] crate::conntrack::ConntrackError),
    /// A fake kernel was told to fail (tests).
    #[error("injected failure: {0}")]
    Injected(String),
}

/// Requests each subsystem received, for metrics and for tests of incrementality.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct KernelCounters {
    /// IPVS write requests (one per operation).
    pub ipvs_writes: u64,
    /// IPVS table reads (one per full dump or targeted read).
    pub ipvs_reads: u64,
    /// kube-ipvs0 address requests (one per added or removed address).
    pub address_writes: u64,
    /// kube-ipvs0 address reads.
    pub address_reads: u64,
    /// ipset processes (reads and restores).
    pub ipset_processes: u64,
    /// ipset netlink requests: one per member added or deleted without a process (small
    /// member-only diffs, see [`ipset::netlink_eligible`]), plus the real applier's one-time
    /// protocol probe.
    pub ipset_requests: u64,
    /// iptables processes (saves and restores).
    pub iptables_processes: u64,
    /// conntrack entries deleted.
    pub conntrack_deleted: u64,
    /// IPVS netlink requests by command (reads and writes; `kube_ipvs_ipvs_requests_total`).
    pub ipvs_requests: OpCounts,
}

/// The node's kernel, one subsystem per method group. All methods are blocking.
pub trait Kernel {
    /// The whole IPVS table (one dump).
    fn read_ipvs(&mut self) -> Result<IpvsTable, KernelError>;
    /// Only the given virtual servers (absent ones are missing from the result).
    fn read_ipvs_keys(&mut self, keys: &BTreeSet<ServiceKey>) -> Result<IpvsTable, KernelError>;
    /// Applies IPVS operations (pipelined); one result per operation, in order.
    fn apply_ipvs(&mut self, ops: &[Op]) -> Vec<Result<(), KernelError>>;
    /// Ensures kube-ipvs0 exists; true when it had to be created.
    fn ensure_link(&mut self) -> Result<bool, KernelError>;
    /// Addresses bound to kube-ipvs0.
    fn read_addresses(&mut self) -> Result<BTreeSet<IpAddr>, KernelError>;
    /// Binds and unbinds addresses on kube-ipvs0; one result per address.
    fn apply_addresses(
        &mut self,
        add: &[IpAddr],
        del: &[IpAddr],
    ) -> Vec<(IpAddr, Result<(), KernelError>)>;
    /// The sets the proxy owns (by name), as the kernel has them.
    fn read_ipsets(&mut self, owned: &[String]) -> Result<IpsetState, KernelError>;
    /// Applies an ipset diff in one batch; returns the rejected lines as messages naming their
    /// owner (the rest of the batch is applied).
    fn apply_ipsets(&mut self, diff: &IpsetDiff) -> Result<Vec<String>, KernelError>;
    /// Applies the iptables rules; only tables whose text changed are restored unless `force`.
    /// Returns true when a restore ran.
    fn apply_iptables(
        &mut self,
        rules: &iptables::RuleSet,
        force: bool,
    ) -> Result<bool, KernelError>;
    /// Deletes the conntrack entries matching `filters` (stale UDP flows); returns how many.
    fn delete_conntrack(&mut self, filters: &[ConntrackFilter]) -> Result<u64, KernelError>;
    /// Requests so far.
    fn counters(&self) -> KernelCounters;
}

/// The real node: IPVS, kube-ipvs0, ipsets and iptables of one address family.
pub struct NodeKernel {
    ipvs: ipvs_netlink::Client,
    netif: netif::Netif,
    ipset: ipset::Ipset,
    iptables: iptables::Iptables,
    rt: tokio::runtime::Handle,
    conntrack: Option<crate::conntrack::Conntrack>,
    conntrack_deleted: u64,
    ipvs_reads: u64,
    address_reads: u64,
}

impl std::fmt::Debug for NodeKernel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NodeKernel").finish_non_exhaustive()
    }
}

impl NodeKernel {
    /// Opens every subsystem (the ipset netlink socket too, with its one protocol request, so
    /// the first small sync does not pay for it). `rt` runs the rtnetlink futures; the
    /// kernel's methods must be called from a thread outside that runtime's async context (e.g.
    /// a dedicated thread).
    pub fn new(
        ipvs: ipvs_netlink::Client,
        netif: netif::Netif,
        ipset: ipset::Ipset,
        iptables: iptables::Iptables,
        rt: tokio::runtime::Handle,
    ) -> NodeKernel {
        if !ipset.prepare_netlink() {
            tracing::info!("ipset over netlink unavailable: every ipset change uses ipset restore");
        }
        NodeKernel {
            ipvs,
            netif,
            ipset,
            iptables,
            rt,
            conntrack: None,
            conntrack_deleted: 0,
            ipvs_reads: 0,
            address_reads: 0,
        }
    }

    /// The IPVS client (for the graceful-termination reads and the mode probe).
    pub fn ipvs(&mut self) -> &mut ipvs_netlink::Client {
        &mut self.ipvs
    }
}

impl Kernel for NodeKernel {
    fn read_ipvs(&mut self) -> Result<IpvsTable, KernelError> {
        self.ipvs_reads += 1;
        Ok(table_from_dump(self.ipvs.dump()?))
    }

    fn read_ipvs_keys(&mut self, keys: &BTreeSet<ServiceKey>) -> Result<IpvsTable, KernelError> {
        self.ipvs_reads += 1;
        let mut out = IpvsTable::new();
        for k in keys {
            if let Some(svc) = self.ipvs.service(k)? {
                let dests = self.ipvs.destinations(k)?;
                out.insert(*k, VirtualServer::new(svc, dests));
            }
        }
        Ok(out)
    }

    fn apply_ipvs(&mut self, ops: &[Op]) -> Vec<Result<(), KernelError>> {
        self.ipvs
            .apply(ops)
            .into_iter()
            .map(|r| r.map_err(KernelError::from))
            .collect()
    }

    fn ensure_link(&mut self) -> Result<bool, KernelError> {
        let st = self.rt.block_on(self.netif.ensure_dummy())?;
        Ok(st.created)
    }

    fn read_addresses(&mut self) -> Result<BTreeSet<IpAddr>, KernelError> {
        self.address_reads += 1;
        Ok(self.rt.block_on(self.netif.addresses())?)
    }

    fn apply_addresses(
        &mut self,
        add: &[IpAddr],
        del: &[IpAddr],
    ) -> Vec<(IpAddr, Result<(), KernelError>)> {
        let diff = netif::AddrDiff {
            add: add.iter().copied().collect(),
            remove: del.iter().copied().collect(),
        };
        self.rt
            .block_on(self.netif.apply(&diff))
            .into_iter()
            .map(|(ip, r)| (ip, r.map_err(KernelError::from)))
            .collect()
    }

    fn read_ipsets(&mut self, owned: &[String]) -> Result<IpsetState, KernelError> {
        Ok(self.ipset.read(owned)?)
    }

    fn apply_ipsets(&mut self, diff: &IpsetDiff) -> Result<Vec<String>, KernelError> {
        let report = self.ipset.apply(diff)?;
        Ok(report
            .rejected
            .iter()
            .map(|r| {
                format!(
                    "{}: `{}` rejected by ipset: {} (owner {})",
                    r.set,
                    r.line,
                    r.message,
                    if r.owner.is_empty() { "-" } else { &r.owner }
                )
            })
            .collect())
    }

    fn apply_iptables(
        &mut self,
        rules: &iptables::RuleSet,
        force: bool,
    ) -> Result<bool, KernelError> {
        if force {
            self.iptables.force_resync();
        }
        let out = self.iptables.apply(rules)?;
        Ok(!out.restored.is_empty())
    }

    fn counters(&self) -> KernelCounters {
        let c = self.ipvs.counters();
        KernelCounters {
            ipvs_writes: c.requests.saturating_sub(c.dumps),
            ipvs_reads: self.ipvs_reads,
            address_writes: self.netif.requests_sent(),
            address_reads: self.address_reads,
            ipset_processes: self.ipset.processes_spawned(),
            ipset_requests: self.ipset.netlink_requests(),
            iptables_processes: self.iptables.processes_spawned(),
            conntrack_deleted: self.conntrack_deleted,
            ipvs_requests: c.by_op,
        }
    }

    fn delete_conntrack(&mut self, filters: &[ConntrackFilter]) -> Result<u64, KernelError> {
        if filters.is_empty() {
            return Ok(0);
        }
        let ct = match &mut self.conntrack {
            Some(ct) => ct,
            None => self.conntrack.insert(crate::conntrack::Conntrack::new()?),
        };
        let report = ct.delete(filters)?;
        self.conntrack_deleted += report.deleted;
        Ok(report.deleted)
    }
}

/// An in-memory kernel for tests: applies operations like the kernel would (EEXIST/ENOENT
/// semantics included) and counts every request.
#[derive(Debug, Default, Clone)]
pub struct FakeKernel {
    /// The IPVS table.
    pub ipvs: IpvsTable,
    /// kube-ipvs0 exists.
    pub link: bool,
    /// Addresses on kube-ipvs0.
    pub addresses: BTreeSet<IpAddr>,
    /// The sets.
    pub ipsets: IpsetState,
    /// Last restored iptables text per table.
    pub iptables: BTreeMap<String, String>,
    /// Request counters.
    pub counters: KernelCounters,
    /// Virtual servers whose creation fails (tests of failure isolation).
    pub fail_keys: BTreeSet<ServiceKey>,
    /// conntrack cleanups asked for, in order.
    pub conntrack: Vec<ConntrackFilter>,
}

impl FakeKernel {
    fn errno(op: &Op, errno: i32) -> KernelError {
        KernelError::Ipvs(ipvs_netlink::Error::Kernel {
            op: op.kind(),
            errno,
        })
    }

    fn apply_op(&mut self, op: &Op) -> Result<(), KernelError> {
        const EEXIST: i32 = 17;
        const ESRCH: i32 = 3;
        const ENOENT: i32 = 2;
        match op {
            Op::NewService(s) => {
                if self.fail_keys.contains(&s.key) {
                    return Err(KernelError::Injected(format!("{:?}", s.key)));
                }
                if self.ipvs.contains_key(&s.key) {
                    return Err(Self::errno(op, EEXIST));
                }
                self.ipvs
                    .insert(s.key, VirtualServer::new(s.clone(), Vec::new()));
            }
            Op::SetService(s) => match self.ipvs.get_mut(&s.key) {
                Some(vs) => vs.service = s.clone(),
                None => return Err(Self::errno(op, ESRCH)),
            },
            Op::DelService(k) => {
                if self.ipvs.remove(k).is_none() {
                    return Err(Self::errno(op, ESRCH));
                }
            }
            Op::NewDest(k, d) => {
                let vs = self.ipvs.get_mut(k).ok_or_else(|| Self::errno(op, ESRCH))?;
                if vs.real_servers.contains_key(&(d.addr, d.port)) {
                    return Err(Self::errno(op, EEXIST));
                }
                vs.real_servers.insert((d.addr, d.port), d.clone());
            }
            Op::SetDest(k, d) => {
                let vs = self.ipvs.get_mut(k).ok_or_else(|| Self::errno(op, ESRCH))?;
                match vs.real_servers.get_mut(&(d.addr, d.port)) {
                    // Like the kernel: settable attributes change, connections stay.
                    Some(old) => {
                        let (a, i, p, st) = (
                            old.active_conns,
                            old.inactive_conns,
                            old.persist_conns,
                            old.stats.take(),
                        );
                        *old = d.clone();
                        old.active_conns = a;
                        old.inactive_conns = i;
                        old.persist_conns = p;
                        old.stats = st;
                    }
                    None => return Err(Self::errno(op, ENOENT)),
                }
            }
            Op::DelDest(k, a, p) => {
                let vs = self.ipvs.get_mut(k).ok_or_else(|| Self::errno(op, ESRCH))?;
                if vs.real_servers.remove(&(*a, *p)).is_none() {
                    return Err(Self::errno(op, ENOENT));
                }
            }
            Op::Flush => self.ipvs.clear(),
            Op::SetTimeouts(_) => {}
        }
        Ok(())
    }
}

impl Kernel for FakeKernel {
    fn read_ipvs(&mut self) -> Result<IpvsTable, KernelError> {
        self.counters.ipvs_reads += 1;
        // Like the real client: one services dump, then one destinations dump per service.
        self.counters.ipvs_requests.inc(OpKind::GetService);
        for _ in 0..self.ipvs.len() {
            self.counters.ipvs_requests.inc(OpKind::GetDest);
        }
        Ok(self.ipvs.clone())
    }

    fn read_ipvs_keys(&mut self, keys: &BTreeSet<ServiceKey>) -> Result<IpvsTable, KernelError> {
        self.counters.ipvs_reads += 1;
        for k in keys {
            self.counters.ipvs_requests.inc(OpKind::GetService);
            if self.ipvs.contains_key(k) {
                self.counters.ipvs_requests.inc(OpKind::GetDest);
            }
        }
        Ok(keys
            .iter()
            .filter_map(|k| self.ipvs.get(k).map(|v| (*k, v.clone())))
            .collect())
    }

    fn apply_ipvs(&mut self, ops: &[Op]) -> Vec<Result<(), KernelError>> {
        self.counters.ipvs_writes += ops.len() as u64;
        for op in ops {
            self.counters.ipvs_requests.inc(op.kind());
        }
        ops.iter().map(|op| self.apply_op(op)).collect()
    }

    fn ensure_link(&mut self) -> Result<bool, KernelError> {
        let created = !self.link;
        self.link = true;
        Ok(created)
    }

    fn read_addresses(&mut self) -> Result<BTreeSet<IpAddr>, KernelError> {
        self.counters.address_reads += 1;
        Ok(self.addresses.clone())
    }

    fn apply_addresses(
        &mut self,
        add: &[IpAddr],
        del: &[IpAddr],
    ) -> Vec<(IpAddr, Result<(), KernelError>)> {
        self.counters.address_writes += (add.len() + del.len()) as u64;
        let mut out = Vec::new();
        for ip in add {
            self.addresses.insert(*ip);
            out.push((*ip, Ok(())));
        }
        for ip in del {
            self.addresses.remove(ip);
            out.push((*ip, Ok(())));
        }
        out
    }

    fn read_ipsets(&mut self, owned: &[String]) -> Result<IpsetState, KernelError> {
        self.counters.ipset_processes += 1;
        let mut st = IpsetState::new();
        for (name, set) in self.ipsets.sets() {
            if owned.contains(name) {
                st.ensure_set(set.spec.clone());
                for e in set.entries.keys() {
                    let _ = st.insert(name, e.clone(), "");
                }
            }
        }
        Ok(st)
    }

    fn apply_ipsets(&mut self, diff: &IpsetDiff) -> Result<Vec<String>, KernelError> {
        if diff.is_empty() {
            return Ok(Vec::new());
        }
        // Like the real applier: small member-only diffs are one netlink request per member,
        // anything else one `ipset restore`.
        if ipset::netlink_eligible(diff, ipset::NETLINK_MAX_MEMBERS) {
            self.counters.ipset_requests += (diff.adds.len() + diff.dels.len()) as u64;
        } else {
            self.counters.ipset_processes += 1;
        }
        for spec in diff.creates.iter().chain(diff.recreates.iter()) {
            self.ipsets.remove_set(&spec.name);
            self.ipsets.ensure_set(spec.clone());
        }
        for d in &diff.dels {
            if let Some(mut set) = self.ipsets.remove_set(&d.set) {
                set.entries.remove(&d.entry);
                self.ipsets.ensure_set(set.spec.clone());
                for (e, owner) in set.entries {
                    let _ = self.ipsets.insert(&d.set, e, &owner);
                }
            }
        }
        for a in &diff.adds {
            let _ = self.ipsets.insert(&a.set, a.entry.clone(), &a.owner);
        }
        for name in &diff.destroys {
            self.ipsets.remove_set(name);
        }
        Ok(Vec::new())
    }

    fn apply_iptables(
        &mut self,
        rules: &iptables::RuleSet,
        force: bool,
    ) -> Result<bool, KernelError> {
        let mut ran = false;
        for &table in rules.tables.keys() {
            let Some(text) = rules.restore_text(table) else {
                continue;
            };
            let name = table.as_str().to_string();
            // Like the real applier: a forced resync reads the table (one process) and
            // restores only when it differs.
            if force {
                self.counters.iptables_processes += 1;
            }
            if self.iptables.get(&name) != Some(&text) {
                self.counters.iptables_processes += 1;
                self.iptables.insert(name, text);
                ran = true;
            }
        }
        Ok(ran)
    }

    fn delete_conntrack(&mut self, filters: &[ConntrackFilter]) -> Result<u64, KernelError> {
        self.conntrack.extend_from_slice(filters);
        Ok(0)
    }

    fn counters(&self) -> KernelCounters {
        self.counters
    }
}

/// A [`FakeKernel`] shared between a test and the proxier that owns it (the sync loop takes
/// its kernel by value).
#[derive(Debug, Default, Clone)]
pub struct SharedFakeKernel(pub std::sync::Arc<std::sync::Mutex<FakeKernel>>);

impl SharedFakeKernel {
    fn with<T>(&self, f: impl FnOnce(&mut FakeKernel) -> T) -> T {
        let mut guard = match self.0.lock() {
            Ok(g) => g,
            Err(poisoned) => poisoned.into_inner(),
        };
        f(&mut guard)
    }

    /// A copy of the fake kernel's current state.
    pub fn snapshot(&self) -> FakeKernel {
        self.with(|k| k.clone())
    }
}

impl Kernel for SharedFakeKernel {
    fn read_ipvs(&mut self) -> Result<IpvsTable, KernelError> {
        self.with(|k| k.read_ipvs())
    }
    fn read_ipvs_keys(&mut self, keys: &BTreeSet<ServiceKey>) -> Result<IpvsTable, KernelError> {
        self.with(|k| k.read_ipvs_keys(keys))
    }
    fn apply_ipvs(&mut self, ops: &[Op]) -> Vec<Result<(), KernelError>> {
        self.with(|k| k.apply_ipvs(ops))
    }
    fn ensure_link(&mut self) -> Result<bool, KernelError> {
        self.with(|k| k.ensure_link())
    }
    fn read_addresses(&mut self) -> Result<BTreeSet<IpAddr>, KernelError> {
        self.with(|k| k.read_addresses())
    }
    fn apply_addresses(
        &mut self,
        add: &[IpAddr],
        del: &[IpAddr],
    ) -> Vec<(IpAddr, Result<(), KernelError>)> {
        self.with(|k| k.apply_addresses(add, del))
    }
    fn read_ipsets(&mut self, owned: &[String]) -> Result<IpsetState, KernelError> {
        self.with(|k| k.read_ipsets(owned))
    }
    fn apply_ipsets(&mut self, diff: &IpsetDiff) -> Result<Vec<String>, KernelError> {
        self.with(|k| k.apply_ipsets(diff))
    }
    fn apply_iptables(
        &mut self,
        rules: &iptables::RuleSet,
        force: bool,
    ) -> Result<bool, KernelError> {
        self.with(|k| k.apply_iptables(rules, force))
    }
    fn delete_conntrack(&mut self, filters: &[ConntrackFilter]) -> Result<u64, KernelError> {
        self.with(|k| k.delete_conntrack(filters))
    }
    fn counters(&self) -> KernelCounters {
        self.with(|k| k.counters())
    }
}
