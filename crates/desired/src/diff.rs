//! Diff: desired IPVS state against applied (or kernel-read) state, as ordered operations. Pure.
//!
//! # Ordering contract (the integrator applies in exactly this order)
//!
//! A virtual IP must never attract traffic before IPVS and the netfilter side are ready for it,
//! and must stop attracting traffic before they are torn down. Per sync batch:
//!
//! 1. **ipset adds, then iptables rules** (masquerade, filter, firewall). Entries of
//!    `KUBE-IPVS-IPS` go last among the adds, after the service entries (`KUBE-CLUSTER-IP`, …),
//!    so the `KUBE-IPVS-FILTER` reject rule never sees a VIP whose service ports are not listed
//!    yet. Load-balancer source-range entries are in place before the LB IP is bound, so a
//!    firewalled service is never open. The masquerade rule is in place before the first real
//!    server can be reached (upstream wrote the SNAT rule last and broke new nodes, k/k#133773).
//! 2. **IPVS creates and updates** ([`IpvsOps::apply`]): `NewService` then that service's
//!    `NewDest`s; `SetService`/`SetDest`; for a changed real-server set `NewDest` before
//!    `DelDest` (a virtual server is never momentarily empty when it need not be).
//! 3. **Bind new addresses** on kube-ipvs0. IPVS takes packets in LOCAL_IN, i.e. only for
//!    local addresses: the virtual server exists before its VIP is local, so the first packet
//!    to a freshly bound VIP is already load-balanced (binding first would deliver it to the
//!    local stack: a connection refused).
//! 4. **Unbind addresses** no longer wanted: the VIP stops being local, so nothing new reaches
//!    the virtual servers that are about to go.
//! 5. **IPVS deletions** ([`IpvsOps::remove`]): `DelService` (which removes its real servers).
//! 6. **ipset deletions, then iptables rules** (`KUBE-IPVS-IPS` entries first).
//!
//! Real-server removal inside a surviving virtual server is a `DelDest` in step 2 (graceful
//! termination, if wanted, is the integrator's business: it may turn a TCP `DelDest` into a
//! weight-0 `SetDest` and delete later).

use std::collections::{BTreeMap, BTreeSet};

use ipvs_netlink::{Destination, Op, Service, ServiceFlags, ServiceKey};

pub use crate::real_servers::{RealServerKey, RealServerMut, RealServers, RealServersIter};

/// A virtual server with its real servers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VirtualServer {
    /// The IPVS service.
    pub service: Service,
    /// Real servers by (address, port).
    pub real_servers: RealServers,
}

impl VirtualServer {
    /// A virtual server with the given real servers.
    pub fn new(service: Service, dests: impl IntoIterator<Item = Destination>) -> VirtualServer {
        VirtualServer {
            service,
            real_servers: dests.into_iter().collect(),
        }
    }
}

/// IPVS state: virtual servers by key (desired, applied, or read from the kernel).
pub type IpvsTable = BTreeMap<ServiceKey, VirtualServer>;

/// Builds a table from a kernel dump (services with their destinations).
pub fn table_from_dump(dump: impl IntoIterator<Item = (Service, Vec<Destination>)>) -> IpvsTable {
    dump.into_iter()
        .map(|(s, d)| (s.key, VirtualServer::new(s, d)))
        .collect()
}

/// IPVS operations split by the phase they run in (see the module docs).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct IpvsOps {
    /// Step 2: creates and updates (NewService, NewDest, SetService, SetDest, DelDest).
    pub apply: Vec<Op>,
    /// Step 5: DelService, after the VIPs are unbound.
    pub remove: Vec<Op>,
}

impl IpvsOps {
    /// Number of operations (= IPVS netlink requests).
    pub fn len(&self) -> usize {
        self.apply.len() + self.remove.len()
    }

    /// True when there is nothing to do.
    pub fn is_empty(&self) -> bool {
        self.apply.is_empty() && self.remove.is_empty()
    }

    /// All operations in order (apply, then remove), for callers that do not bind addresses.
    pub fn into_vec(self) -> Vec<Op> {
        let mut v = self.apply;
        v.extend(self.remove);
        v
    }
}

/// True when two virtual servers' kernel-settable attributes agree (scheduler, flags without
/// the kernel's HASHED bit, persistence timeout and netmask when persistent, pe name).
pub fn same_service(a: &Service, b: &Service) -> bool {
    let mask = |f: ServiceFlags| f.0 & !ServiceFlags::HASHED;
    let persistent = mask(a.flags) & ServiceFlags::PERSISTENT != 0;
    a.key == b.key
        && a.scheduler == b.scheduler
        && mask(a.flags) == mask(b.flags)
        && (!persistent || (a.timeout == b.timeout && a.netmask == b.netmask))
        && a.pe_name == b.pe_name
}

/// True when two real servers' kernel-settable attributes agree (forwarding, weight,
/// thresholds, tunnel parameters); counters are ignored.
pub fn same_dest(a: &Destination, b: &Destination) -> bool {
    a.addr == b.addr
        && a.port == b.port
        && a.fwd == b.fwd
        && a.weight == b.weight
        && a.upper_threshold == b.upper_threshold
        && a.lower_threshold == b.lower_threshold
        && a.tun_type == b.tun_type
        && a.tun_port == b.tun_port
        && a.tun_flags == b.tun_flags
}

/// Operations turning virtual server `before` into `after` (either may be absent).
pub fn diff_virtual_server(
    before: Option<&VirtualServer>,
    after: Option<&VirtualServer>,
    out: &mut IpvsOps,
) {
    match (before, after) {
        (None, None) => {}
        (Some(b), None) => out.remove.push(Op::DelService(b.service.key)),
        (None, Some(a)) => {
            out.apply.push(Op::NewService(a.service.clone()));
            for d in a.real_servers.values() {
                out.apply.push(Op::NewDest(a.service.key, d));
            }
        }
        (Some(b), Some(a)) => {
            let key = a.service.key;
            if !same_service(&b.service, &a.service) {
                out.apply.push(Op::SetService(a.service.clone()));
            }
            for (k, d) in &a.real_servers {
                match b.real_servers.get(&k) {
                    None => out.apply.push(Op::NewDest(key, d)),
                    Some(old) if !same_dest(&old, &d) => {
                        out.apply.push(Op::SetDest(key, d));
                    }
                    Some(_) => {}
                }
            }
            for (addr, port) in b.real_servers.keys() {
                if !a.real_servers.contains_key(&(addr, port)) {
                    out.apply.push(Op::DelDest(key, addr, port));
                }
            }
        }
    }
}

/// Startup / drift diff: operations that make `actual` (read from the kernel) match `desired`.
///
/// What already matches is adopted (no operation): an identical virtual server or real server
/// costs nothing. Differing attributes give `SetService` / `SetDest` (e.g. a weight 0 left by a
/// previous run's graceful termination). Virtual servers not desired are deleted only when
/// `owned` says the proxy owns them (false for excludeCIDRs and for foreign families/fwmarks).
pub fn diff_ipvs(
    desired: &IpvsTable,
    actual: &IpvsTable,
    owned: &dyn Fn(&ServiceKey) -> bool,
) -> IpvsOps {
    diff_ipvs_by(desired, |k| desired.get(k), actual, owned)
}

/// [`diff_ipvs`] of a desired table given as its entries in key order and a lookup (so the
/// desired state need not be copied into an [`IpvsTable`]).
pub fn diff_ipvs_by<'a>(
    desired: impl IntoIterator<Item = (&'a ServiceKey, &'a VirtualServer)>,
    lookup: impl Fn(&ServiceKey) -> Option<&'a VirtualServer>,
    actual: &IpvsTable,
    owned: &dyn Fn(&ServiceKey) -> bool,
) -> IpvsOps {
    let mut out = IpvsOps::default();
    diff_desired(desired, actual, &mut out);
    diff_undesired(lookup, actual, owned, &mut out);
    out
}

/// The creates and updates of [`diff_ipvs_by`] (always [`IpvsOps::apply`]): what makes the
/// given desired virtual servers exist in `actual` as desired.
pub fn diff_desired<'a>(
    desired: impl IntoIterator<Item = (&'a ServiceKey, &'a VirtualServer)>,
    actual: &IpvsTable,
    out: &mut IpvsOps,
) {
    for (k, vs) in desired {
        diff_virtual_server(actual.get(k), Some(vs), out);
    }
}

/// The deletions of [`diff_ipvs_by`] (always [`IpvsOps::remove`]): the virtual servers of
/// `actual` that `lookup` does not desire and the proxy owns.
pub fn diff_undesired<'a>(
    lookup: impl Fn(&ServiceKey) -> Option<&'a VirtualServer>,
    actual: &IpvsTable,
    owned: &dyn Fn(&ServiceKey) -> bool,
    out: &mut IpvsOps,
) {
    for (k, vs) in actual {
        if lookup(k).is_none() && owned(k) {
            diff_virtual_server(Some(vs), None, out);
        }
    }
}

/// Adds and removes turning set `actual` into `desired`; members not desired are removed only
/// when `owned` (used for kube-ipvs0 addresses: addresses in excludeCIDRs stay).
pub fn diff_set<T: Ord + Clone>(
    desired: &BTreeSet<T>,
    actual: &BTreeSet<T>,
    owned: &dyn Fn(&T) -> bool,
) -> (Vec<T>, Vec<T>) {
    let add = desired.difference(actual).cloned().collect();
    let del = actual
        .difference(desired)
        .filter(|t| owned(t))
        .cloned()
        .collect();
    (add, del)
}
