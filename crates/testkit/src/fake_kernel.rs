//! An in-memory [`Kernel`] for tests: it applies operations like the kernel would (EEXIST,
//! ENOENT and ESRCH semantics included) and counts the requests each subsystem received, so
//! tests can prove that work is proportional to what changed.

use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;

use conntrack::ConntrackFilter;
use desired::diff::{IpvsTable, VirtualServer};
use ipset::{IpsetDiff, IpsetState};
use ipvs_netlink::{Family, Op, OpKind, ServiceKey};
use proxier::kernel::{Kernel, KernelCounters, KernelError};

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
                    Some(mut old) => {
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
    fn read_ipvs(&mut self, family: Family) -> Result<IpvsTable, KernelError> {
        self.counters.ipvs_reads += 1;
        // Like the real client: one services dump, then one destinations dump per service of
        // the family.
        self.counters.ipvs_requests.inc(OpKind::GetService);
        let table: IpvsTable = self
            .ipvs
            .iter()
            .filter(|(k, _)| k.family() == family)
            .map(|(k, vs)| (*k, vs.clone()))
            .collect();
        for _ in 0..table.len() {
            self.counters.ipvs_requests.inc(OpKind::GetDest);
        }
        Ok(table)
    }

    fn list_ipvs(&mut self, family: Family) -> Result<BTreeSet<ServiceKey>, KernelError> {
        self.counters.ipvs_reads += 1;
        // Like the real client: one services dump.
        self.counters.ipvs_requests.inc(OpKind::GetService);
        Ok(self
            .ipvs
            .keys()
            .filter(|k| k.family() == family)
            .copied()
            .collect())
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

    fn read_addresses(&mut self, family: Family) -> Result<BTreeSet<IpAddr>, KernelError> {
        self.counters.address_reads += 1;
        Ok(self
            .addresses
            .iter()
            .filter(|a| a.is_ipv6() == (family == Family::Inet6))
            .copied()
            .collect())
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
        // Like the real reader: one netlink LIST request per owned set, no process.
        self.counters.ipset_requests += owned.len() as u64;
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

    fn apply_ipsets(&mut self, diff: &IpsetDiff) -> Result<Vec<ipset::Rejected>, KernelError> {
        if diff.is_empty() {
            return Ok(Vec::new());
        }
        // Like the real applier: members are one netlink request each, after one
        // `ipset restore` that creates or recreates sets (if any); a diff that destroys a set
        // is one `ipset restore`, members included.
        if ipset::netlink_eligible(diff, ipset::NETLINK_MAX_MEMBERS) {
            self.counters.ipset_requests += (diff.adds.len() + diff.dels.len()) as u64;
            if !diff.creates.is_empty() || !diff.recreates.is_empty() {
                self.counters.ipset_processes += 1;
            }
        } else {
            self.counters.ipset_processes += 1;
        }
        for spec in diff.creates.iter().chain(diff.recreates.iter()) {
            self.ipsets.remove_set(&spec.name);
            self.ipsets.ensure_set(spec.clone());
        }
        // Each set rebuilt once per apply, not once per deleted member (a Service of 40,000
        // members going away would otherwise cost 40,000 rebuilds of a 40,000-member set).
        let mut dels: BTreeMap<&str, Vec<&ipset::Entry>> = BTreeMap::new();
        for d in &diff.dels {
            dels.entry(&d.set).or_default().push(&d.entry);
        }
        for (name, gone) in dels {
            if let Some(mut set) = self.ipsets.remove_set(name) {
                for e in gone {
                    set.entries.remove(e);
                }
                self.ipsets.ensure_set(set.spec.clone());
                for (e, owner) in set.entries {
                    let _ = self.ipsets.insert_shared(name, e, &owner);
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
    fn read_ipvs(&mut self, family: Family) -> Result<IpvsTable, KernelError> {
        self.with(|k| k.read_ipvs(family))
    }
    fn list_ipvs(&mut self, family: Family) -> Result<BTreeSet<ServiceKey>, KernelError> {
        self.with(|k| k.list_ipvs(family))
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
    fn read_addresses(&mut self, family: Family) -> Result<BTreeSet<IpAddr>, KernelError> {
        self.with(|k| k.read_addresses(family))
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
    fn apply_ipsets(&mut self, diff: &IpsetDiff) -> Result<Vec<ipset::Rejected>, KernelError> {
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
