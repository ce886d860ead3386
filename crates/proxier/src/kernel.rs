//! The kernel as the proxier sees it: read and apply per subsystem, behind one trait.
//!
//! [`Kernel`] is the IO boundary of the proxier. [`NodeKernel`] is the real node (IPVS over
//! generic netlink, kube-ipvs0 over rtnetlink, ipset over netlink for small member changes and
//! `ipset restore` otherwise, `iptables-restore`);
//! The in-memory kernel for tests (`FakeKernel`, counting the requests each subsystem received
//! so tests can prove that work is proportional to what changed) lives in the `testkit` crate.

use std::collections::BTreeSet;
use std::net::IpAddr;

use conntrack::ConntrackFilter;
use ipset::{IpsetDiff, IpsetState};
use ipvs_netlink::{Family, Op, OpCounts, ServiceKey};

use desired::diff::{table_from_dump, IpvsTable, VirtualServer};

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
    Conntrack(#[from] conntrack::ConntrackError),
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
    /// The virtual servers of `family` with their real servers (one services dump, then the
    /// real servers of that family's virtual servers only).
    fn read_ipvs(&mut self, family: Family) -> Result<IpvsTable, KernelError>;
    /// The keys of the virtual servers of `family`, without their real servers (one services
    /// dump).
    fn list_ipvs(&mut self, family: Family) -> Result<BTreeSet<ServiceKey>, KernelError>;
    /// Only the given virtual servers (absent ones are missing from the result).
    fn read_ipvs_keys(&mut self, keys: &BTreeSet<ServiceKey>) -> Result<IpvsTable, KernelError>;
    /// Applies IPVS operations (pipelined); one result per operation, in order.
    fn apply_ipvs(&mut self, ops: &[Op]) -> Vec<Result<(), KernelError>>;
    /// Ensures kube-ipvs0 exists; true when it had to be created.
    fn ensure_link(&mut self) -> Result<bool, KernelError>;
    /// Addresses of `family` bound to kube-ipvs0.
    fn read_addresses(&mut self, family: Family) -> Result<BTreeSet<IpAddr>, KernelError>;
    /// Binds and unbinds addresses on kube-ipvs0; one result per address.
    fn apply_addresses(
        &mut self,
        add: &[IpAddr],
        del: &[IpAddr],
    ) -> Vec<(IpAddr, Result<(), KernelError>)>;
    /// Starts binding `add` on kube-ipvs0 and returns at once when the kernel can bind them
    /// while the caller goes on (the real node: a task on its runtime, on the address socket,
    /// so a full sync programs IPVS meanwhile); [`Kernel::finish_address_adds`] returns the
    /// results. By default nothing starts before `finish_address_adds`, which binds them as
    /// [`Kernel::apply_addresses`] does.
    fn start_address_adds(&mut self, add: &[IpAddr]) -> AddressAdds {
        AddressAdds::deferred(add)
    }
    /// The results of [`Kernel::start_address_adds`], one per address, waiting for them.
    fn finish_address_adds(&mut self, adds: AddressAdds) -> Vec<(IpAddr, Result<(), KernelError>)> {
        match adds.0 {
            Adds::Deferred(add) => self.apply_addresses(&add, &[]),
            Adds::Running { add, rt, task } => join_address_adds(&add, &rt, task),
        }
    }
    /// The sets the proxy owns (by name), as the kernel has them.
    fn read_ipsets(&mut self, owned: &[String]) -> Result<IpsetState, KernelError>;
    /// Applies an ipset diff in one batch; returns the lines the kernel rejected, each with
    /// its owner (the rest of the batch is applied).
    fn apply_ipsets(&mut self, diff: &IpsetDiff) -> Result<Vec<ipset::Rejected>, KernelError>;
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

/// Address binds started by [`Kernel::start_address_adds`].
#[derive(Debug)]
pub struct AddressAdds(Adds);

#[derive(Debug)]
enum Adds {
    /// Not started yet.
    Deferred(Vec<IpAddr>),
    /// Running as a task on `rt`.
    Running {
        add: Vec<IpAddr>,
        rt: tokio::runtime::Handle,
        task: tokio::task::JoinHandle<Vec<(IpAddr, Result<(), netif::Error>)>>,
    },
}

impl AddressAdds {
    /// Binds that start only when finished (the default of [`Kernel::start_address_adds`]).
    pub fn deferred(add: &[IpAddr]) -> Self {
        Self(Adds::Deferred(add.to_vec()))
    }
}

/// Waits for an address task. A task that ended without its results (a panic, or the
/// runtime shutting down) leaves every address's state unknown: each is reported as a
/// transport failure, which schedules the address recheck like any failed bind.
fn join_address_adds(
    add: &[IpAddr],
    rt: &tokio::runtime::Handle,
    task: tokio::task::JoinHandle<Vec<(IpAddr, Result<(), netif::Error>)>>,
) -> Vec<(IpAddr, Result<(), KernelError>)> {
    match rt.block_on(task) {
        Ok(results) => results
            .into_iter()
            .map(|(ip, r)| (ip, r.map_err(KernelError::from)))
            .collect(),
        Err(e) => add
            .iter()
            .map(|ip| {
                let e = netif::Error::Transport {
                    object: format!("{ip} on {}", netif::DUMMY_LINK),
                    detail: format!("the address task ended without results: {e}"),
                };
                (*ip, Err(KernelError::from(e)))
            })
            .collect(),
    }
}

/// The real node: IPVS, kube-ipvs0, ipsets and iptables of one address family.
pub struct NodeKernel {
    ipvs: ipvs_netlink::Client,
    netif: std::sync::Arc<netif::Netif>,
    ipset: ipset::Ipset,
    iptables: iptables::Iptables,
    rt: tokio::runtime::Handle,
    conntrack: Option<conntrack::Conntrack>,
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
    /// a dedicated thread). The IPVS client's reads leave out traffic counters: the proxy
    /// compares tables and never uses them.
    pub fn new(
        mut ipvs: ipvs_netlink::Client,
        netif: netif::Netif,
        ipset: ipset::Ipset,
        iptables: iptables::Iptables,
        rt: tokio::runtime::Handle,
    ) -> NodeKernel {
        ipvs.set_stats(false);
        if !ipset.prepare_netlink() {
            tracing::info!("ipset over netlink unavailable: every ipset change uses ipset restore");
        }
        NodeKernel {
            ipvs,
            netif: std::sync::Arc::new(netif),
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
    fn read_ipvs(&mut self, family: Family) -> Result<IpvsTable, KernelError> {
        self.ipvs_reads += 1;
        Ok(table_from_dump(self.ipvs.dump_family(family)?))
    }

    fn list_ipvs(&mut self, family: Family) -> Result<BTreeSet<ServiceKey>, KernelError> {
        self.ipvs_reads += 1;
        Ok(self
            .ipvs
            .services()?
            .into_iter()
            .map(|s| s.key)
            .filter(|k| k.family() == family)
            .collect())
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

    fn read_addresses(&mut self, family: Family) -> Result<BTreeSet<IpAddr>, KernelError> {
        self.address_reads += 1;
        let ipv6 = family == Family::Inet6;
        Ok(self.rt.block_on(self.netif.addresses_of(ipv6))?)
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

    fn start_address_adds(&mut self, add: &[IpAddr]) -> AddressAdds {
        // A current-thread runtime runs tasks only inside its own block_on: nothing to gain.
        if add.is_empty() || self.rt.runtime_flavor() != tokio::runtime::RuntimeFlavor::MultiThread
        {
            return AddressAdds::deferred(add);
        }
        let netif = std::sync::Arc::clone(&self.netif);
        let diff = netif::AddrDiff {
            add: add.iter().copied().collect(),
            remove: BTreeSet::new(),
        };
        let task = self.rt.spawn(async move { netif.apply(&diff).await });
        AddressAdds(Adds::Running {
            add: add.to_vec(),
            rt: self.rt.clone(),
            task,
        })
    }

    fn read_ipsets(&mut self, owned: &[String]) -> Result<IpsetState, KernelError> {
        Ok(self.ipset.read(owned)?)
    }

    fn apply_ipsets(&mut self, diff: &IpsetDiff) -> Result<Vec<ipset::Rejected>, KernelError> {
        Ok(self.ipset.apply(diff)?.rejected)
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
            // Counted by command: a single GET_SERVICE (a targeted repair, a drift-check slice)
            // is a read, not a write.
            ipvs_writes: c.by_op.writes(),
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
            None => self.conntrack.insert(conntrack::Conntrack::new()?),
        };
        let report = ct.delete(filters)?;
        self.conntrack_deleted += report.deleted;
        Ok(report.deleted)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn runtime() -> tokio::runtime::Runtime {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .build()
            .unwrap()
    }

    fn ips() -> Vec<IpAddr> {
        ["10.96.0.1", "10.96.0.2"]
            .iter()
            .filter_map(|s| s.parse().ok())
            .collect()
    }

    /// An address task that dies (here: panics) leaves its addresses unknown: each one is a
    /// transport failure naming it, so the sync reports it and rechecks the addresses.
    #[test]
    fn an_address_task_without_results_fails_every_address() {
        let rt = runtime();
        let task = rt.spawn(async {
            if true {
                panic!("injected: the address task dies");
            }
            Vec::new()
        });
        let results = join_address_adds(&ips(), rt.handle(), task);
        assert_eq!(results.len(), 2);
        for ((ip, r), want) in results.iter().zip(ips()) {
            assert_eq!(*ip, want);
            let e = r
                .as_ref()
                .err()
                .map(ToString::to_string)
                .unwrap_or_default();
            assert!(
                e.contains(&format!("{want} on kube-ipvs0")) && e.contains("without results"),
                "{e}"
            );
        }
    }

    /// Its results, when it has them, are the addresses' own.
    #[test]
    fn an_address_task_reports_each_address() {
        let rt = runtime();
        let done: Vec<(IpAddr, Result<(), netif::Error>)> = vec![
            (ips()[0], Ok(())),
            (ips()[1], Err(netif::Error::NoSuchLink("kube-ipvs0".into()))),
        ];
        let task = rt.spawn(async move { done });
        let results = join_address_adds(&ips(), rt.handle(), task);
        assert!(results[0].1.is_ok());
        assert!(matches!(
            results[1].1,
            Err(KernelError::Netif(netif::Error::NoSuchLink(_)))
        ));
    }
}
