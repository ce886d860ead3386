//! The desired node state the model implies, per subsystem, as plain data. Pure.
//!
//! [`service_desired`] derives one Service's [`ServiceDesired`]: its IPVS virtual servers (with
//! real servers), the addresses it needs on kube-ipvs0, the ipset entries per set, the iptables
//! features it uses, and its health-check node port. [`Desired`] is the node-wide union,
//! maintained incrementally: [`Desired::update_services`] swaps in the new state of the changed
//! services only and returns the [`Delta`] for them (never touching other services).
//!
//! Addresses and ipset entries are reference counted: two services may share an address (an
//! externalIP used by two services on different ports) or an entry (a hairpin entry of one pod
//! backing two services), and it goes away only with its last user. A virtual-server key
//! claimed by two services (two services listing the same externalIP and port) goes to the
//! claimant with the smallest `namespace/name`; when it leaves, the next claimant takes over
//! with `SetService`/`*Dest` operations, never a delete/re-create. See [`Desired::conflicts`].
//!
//! Node changes: NodePort virtual servers (node IPs × nodePort), SCTP node-port entries and
//! load-balancer "allow from node" entries depend on the node's addresses. When the node's
//! addresses change, the integrator re-derives the services listed by
//! [`Desired::node_dependent_services`] and passes them to `update_services`. When the node's
//! zone changes (rare), it re-derives every service. The order in which a [`Delta`] is applied
//! is the contract written in [`crate::diff`].

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::net::IpAddr;

use ipnet::IpNet;
use ipset::SetKind;
use ipvs_netlink::{Family, Op, ServiceKey};

use crate::diff::{diff_virtual_server, IpvsOps, IpvsTable, VirtualServer};
use crate::types::{
    is_in_cluster_mark, Features, HealthCheck, InClusterMark, IpsetEntry, IptablesInputs,
    ServiceDesired, IN_CLUSTER_MARK_BIT, IN_CLUSTER_MARK_IDS,
};
use model::sorted::SortedVec;
use model::{ProxyConfig, ServiceName, ServicePortName};

mod capacity;
mod counts;
mod views;

pub use capacity::SetGrowth;

use counts::EntryCounts;

/// Changes to apply for a batch of service updates. Apply in the order of [`crate::diff`]:
/// `ipset_add` (+ iptables if `iptables_changed`), `ipvs.apply`, `addresses_add`,
/// `addresses_del`, `ipvs.remove`, `ipset_del` (+ iptables).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Delta {
    /// IPVS operations.
    pub ipvs: IpvsOps,
    /// Addresses to bind on kube-ipvs0.
    pub addresses_add: Vec<IpAddr>,
    /// Addresses to unbind from kube-ipvs0.
    pub addresses_del: Vec<IpAddr>,
    /// ipset members to add (`KUBE-IPVS-IPS` members last).
    pub ipset_add: Vec<IpsetEntry>,
    /// ipset members to delete (`KUBE-IPVS-IPS` members first).
    pub ipset_del: Vec<IpsetEntry>,
    /// The iptables inputs changed (re-render the rules).
    pub iptables_changed: bool,
    /// Health-check node ports that appeared, changed or went away (`None`).
    pub health_checks: Vec<(ServiceName, Option<HealthCheck>)>,
}

impl Delta {
    /// True when nothing changes.
    pub fn is_empty(&self) -> bool {
        self.ipvs.is_empty()
            && self.addresses_add.is_empty()
            && self.addresses_del.is_empty()
            && self.ipset_add.is_empty()
            && self.ipset_del.is_empty()
            && !self.iptables_changed
            && self.health_checks.is_empty()
    }
}

/// The node-wide desired state: the union of every service's [`ServiceDesired`], maintained
/// incrementally with reference counts.
#[derive(Debug, Clone)]
pub struct Desired {
    family: Family,
    masquerade_all: bool,
    cluster_cidrs: Vec<IpNet>,
    /// Boxed: an empty hash-table slot then costs a pointer, not a whole ServiceDesired.
    services: HashMap<ServiceName, Box<ServiceDesired>>,
    /// Claimants of each key, the winner first (nearly always one).
    claims: HashMap<ServiceKey, SortedVec<ServiceName>>,
    addresses: HashMap<IpAddr, u32>,
    /// ipset members by the number of services holding them (compact keys: `counts`).
    entries: EntryCounts,
    features: [usize; Features::COUNT],
    /// In-cluster marks in use (one per externalTrafficPolicy=Local port with external
    /// destinations), by the number of ports holding them.
    marks_used: HashMap<u32, usize>,
    /// The nat rules of in-cluster traffic, reference counted.
    in_cluster: BTreeMap<InClusterMark, usize>,
}

impl Desired {
    /// An empty desired state for `cfg`'s family.
    pub fn new(cfg: &ProxyConfig) -> Desired {
        Desired {
            family: cfg.family,
            masquerade_all: cfg.masquerade_all,
            cluster_cidrs: cfg
                .cluster_cidrs
                .iter()
                .filter(|n| Family::of(&n.addr()) == cfg.family)
                .copied()
                .collect(),
            services: HashMap::new(),
            claims: HashMap::new(),
            addresses: HashMap::new(),
            entries: EntryCounts::default(),
            features: [0; Features::COUNT],
            marks_used: HashMap::new(),
            in_cluster: BTreeMap::new(),
        }
    }

    /// The address family.
    pub fn family(&self) -> Family {
        self.family
    }

    /// Number of services with a desired state.
    pub fn len(&self) -> usize {
        self.services.len()
    }

    /// True when no service has a desired state.
    pub fn is_empty(&self) -> bool {
        self.services.is_empty()
    }

    /// One service's desired state.
    pub fn service(&self, name: &ServiceName) -> Option<&ServiceDesired> {
        self.services.get(name).map(|s| &**s)
    }

    /// Replaces (`Some`) or removes (`None`) one service; returns the delta.
    pub fn update_service(&mut self, name: ServiceName, new: Option<ServiceDesired>) -> Delta {
        self.update_services([(name, new)])
    }

    /// Replaces or removes a batch of services; returns the net delta of the batch (an address
    /// one service drops and another takes stays bound, a key that changes hands is updated in
    /// place). Cost is proportional to the changed services only.
    pub fn update_services(
        &mut self,
        changes: impl IntoIterator<Item = (ServiceName, Option<ServiceDesired>)>,
    ) -> Delta {
        let batch = self.batch(changes);
        // What the batch touches.
        let mut keys = BTreeSet::new();
        let mut addrs = BTreeSet::new();
        let mut ents = BTreeSet::new();
        for (name, new) in &batch {
            for sd in [self.services.get(name).map(|s| &**s), new.as_ref()]
                .into_iter()
                .flatten()
            {
                keys.extend(sd.virtual_servers.keys().copied());
                addrs.extend(sd.addresses.iter().copied());
                ents.extend(sd.ipset_entries.iter().cloned());
            }
        }
        let before_vs: BTreeMap<ServiceKey, Option<VirtualServer>> = keys
            .iter()
            .map(|k| (*k, self.effective(k).cloned()))
            .collect();
        let before_addr: BTreeSet<IpAddr> = addrs
            .iter()
            .filter(|a| self.addresses.contains_key(*a))
            .copied()
            .collect();
        let before_ent: BTreeSet<IpsetEntry> = ents
            .iter()
            .filter(|e| self.entries.contains(e))
            .cloned()
            .collect();
        let before_ipt = self.iptables();
        let before_in_cluster: BTreeSet<InClusterMark> = batch
            .keys()
            .filter_map(|n| self.services.get(n))
            .flat_map(|s| in_cluster_marks(s))
            .collect();
        let before_hc: Vec<Option<HealthCheck>> = batch
            .keys()
            .map(|n| self.services.get(n).and_then(|s| s.health_check))
            .collect();

        let names: Vec<ServiceName> = batch.keys().cloned().collect();
        self.install(batch);

        let mut delta = Delta::default();
        for (k, before) in &before_vs {
            let after = self.effective(k);
            diff_virtual_server(before.as_ref(), after, &mut delta.ipvs);
        }
        for a in &addrs {
            match (before_addr.contains(a), self.addresses.contains_key(a)) {
                (false, true) => delta.addresses_add.push(*a),
                (true, false) => delta.addresses_del.push(*a),
                _ => {}
            }
        }
        for e in &ents {
            match (before_ent.contains(e), self.entries.contains(e)) {
                (false, true) => delta.ipset_add.push(e.clone()),
                (true, false) => delta.ipset_del.push(e.clone()),
                _ => {}
            }
        }
        delta
            .ipset_add
            .sort_by_key(|e| (e.set == SetKind::IpvsIps, e.clone()));
        delta
            .ipset_del
            .sort_by_key(|e| (e.set != SetKind::IpvsIps, e.clone()));
        let after_in_cluster: BTreeSet<InClusterMark> = names
            .iter()
            .filter_map(|n| self.services.get(n))
            .flat_map(|s| in_cluster_marks(s))
            .collect();
        delta.iptables_changed = before_ipt != self.iptables()
            || before_in_cluster
                .symmetric_difference(&after_in_cluster)
                .any(|m| before_in_cluster.contains(m) != self.in_cluster.contains_key(m));
        for (name, before) in names.iter().zip(before_hc) {
            let after = self.services.get(name).and_then(|s| s.health_check);
            if before != after {
                delta.health_checks.push((name.clone(), after));
            }
        }
        delta
    }

    /// Replaces or removes a batch of services like [`Desired::update_services`] without
    /// computing the delta, for callers that diff against the kernel anyway and do not count
    /// drift (the first full sync, `plan`): at 10,000 services x 10 endpoints the unused delta
    /// would be 110,000 IPVS operations (~12.6 MB) at the sync's peak.
    pub fn install_services(
        &mut self,
        changes: impl IntoIterator<Item = (ServiceName, Option<ServiceDesired>)>,
    ) {
        let batch = self.batch(changes);
        self.install(batch);
    }

    /// Collects a batch (the last change of a name wins) and allocates its marks.
    fn batch(
        &mut self,
        changes: impl IntoIterator<Item = (ServiceName, Option<ServiceDesired>)>,
    ) -> BTreeMap<ServiceName, Option<ServiceDesired>> {
        let mut batch: BTreeMap<ServiceName, Option<ServiceDesired>> = BTreeMap::new();
        for (n, d) in changes {
            batch.insert(n, d);
        }
        self.allocate_marks(&mut batch);
        batch
    }

    /// Swaps the batch's services in: releases what the old states held, acquires the new.
    fn install(&mut self, batch: BTreeMap<ServiceName, Option<ServiceDesired>>) {
        for (name, new) in batch {
            if let Some(old) = self.services.remove(&name) {
                self.release(&name, &old);
            }
            if let Some(new) = new {
                self.acquire(&name, &new);
                self.services.insert(name, Box::new(new));
            }
        }
    }

    /// Gives every in-cluster port of the batch its firewall mark and virtual server: the mark
    /// the port held before when it had one, else the first free id from a hash of the port's
    /// name (so a restart with the same Services finds the same marks), probing upwards.
    fn allocate_marks(&mut self, batch: &mut BTreeMap<ServiceName, Option<ServiceDesired>>) {
        let mut taken: BTreeSet<u32> = BTreeSet::new();
        for (name, new) in batch.iter_mut() {
            let Some(new) = new else { continue };
            if new.in_cluster.is_empty() {
                continue;
            }
            // Firewall-mark virtual servers come only from here (an adopted one is re-keyed).
            new.virtual_servers
                .retain(|k, _| !matches!(k, ServiceKey::Fwmark { .. }));
            let old = self.services.get(name).map(|o| &o.fwmarks);
            let mut marks = BTreeMap::new();
            for ic in &new.in_cluster {
                // The mark the port held, else one it brings (adopted from the kernel).
                let held = old.and_then(|o| o.get(&ic.port)).copied();
                let brought = new
                    .fwmarks
                    .get(&ic.port)
                    .copied()
                    .filter(|m| !self.marks_used.contains_key(m));
                let mark = match held.or(brought) {
                    Some(m) if !taken.contains(&m) => Some(m),
                    _ => mark_candidates(&ic.port)
                        .find(|m| !taken.contains(m) && !self.marks_used.contains_key(m)),
                };
                let Some(mark) = mark else {
                    tracing::warn!(port = %ic.port, "no free in-cluster firewall mark; in-cluster \
                        traffic to this port's external destinations uses its local endpoints");
                    continue;
                };
                taken.insert(mark);
                marks.insert(ic.port.clone(), mark);
                let mut vs = ic.template.clone();
                vs.service.key = ServiceKey::Fwmark {
                    family: self.family,
                    mark,
                };
                new.virtual_servers.insert(vs.service.key, vs);
            }
            new.fwmarks = marks;
        }
    }

    fn effective(&self, key: &ServiceKey) -> Option<&VirtualServer> {
        let owner = self.claims.get(key)?.first()?;
        self.services.get(owner)?.virtual_servers.get(key)
    }

    fn acquire(&mut self, name: &ServiceName, sd: &ServiceDesired) {
        for k in sd.virtual_servers.keys() {
            self.claims.entry(*k).or_default().insert(name.clone());
        }
        for a in &sd.addresses {
            let c = self.addresses.entry(*a).or_insert(0);
            *c = c.saturating_add(1);
        }
        for e in &sd.ipset_entries {
            self.entries.acquire(e);
        }
        for (i, c) in self.features.iter_mut().enumerate() {
            if sd.features.has(1 << i) {
                *c += 1;
            }
        }
        for m in sd.fwmarks.values() {
            *self.marks_used.entry(*m).or_insert(0) += 1;
        }
        for m in in_cluster_marks(sd) {
            *self.in_cluster.entry(m).or_insert(0) += 1;
        }
    }

    fn release(&mut self, name: &ServiceName, sd: &ServiceDesired) {
        for k in sd.virtual_servers.keys() {
            if let Some(c) = self.claims.get_mut(k) {
                c.remove(name);
                if c.is_empty() {
                    self.claims.remove(k);
                }
            }
        }
        for a in &sd.addresses {
            if let Some(c) = self.addresses.get_mut(a) {
                *c = c.saturating_sub(1);
                if *c == 0 {
                    self.addresses.remove(a);
                }
            }
        }
        for e in &sd.ipset_entries {
            self.entries.release(e);
        }
        for (i, c) in self.features.iter_mut().enumerate() {
            if sd.features.has(1 << i) {
                *c = c.saturating_sub(1);
            }
        }
        for m in sd.fwmarks.values() {
            if let Some(c) = self.marks_used.get_mut(m) {
                *c = c.saturating_sub(1);
                if *c == 0 {
                    self.marks_used.remove(m);
                }
            }
        }
        for m in in_cluster_marks(sd) {
            if let Some(c) = self.in_cluster.get_mut(&m) {
                *c = c.saturating_sub(1);
                if *c == 0 {
                    self.in_cluster.remove(&m);
                }
            }
        }
    }
}

/// The ownership rule for startup/drift/cleanup: a virtual server belongs to the proxy when it
/// is address-based, of the proxy's family, and outside excludeCIDRs.
pub fn owned_by_proxy(cfg: &ProxyConfig) -> impl Fn(&ServiceKey) -> bool + '_ {
    move |k: &ServiceKey| match k {
        ServiceKey::Inet { addr, .. } => Family::of(addr) == cfg.family && !cfg.excluded(addr),
        ServiceKey::Fwmark { family, mark } => *family == cfg.family && is_in_cluster_mark(*mark),
    }
}

/// The (destination, mark) pairs of one service's in-cluster ports with allocated marks.
fn in_cluster_marks(sd: &ServiceDesired) -> impl Iterator<Item = InClusterMark> + '_ {
    sd.in_cluster.iter().flat_map(move |ic| {
        let mark = sd.fwmarks.get(&ic.port).copied();
        ic.dests
            .iter()
            .filter_map(move |d| mark.map(|mark| InClusterMark { dest: *d, mark }))
    })
}

/// The marks a service port may get, in the order they are tried: from a hash of its name,
/// upwards through all 16,383 ids.
pub fn mark_candidates(p: &ServicePortName) -> impl Iterator<Item = u32> {
    let start = fnv1a(p) % IN_CLUSTER_MARK_IDS;
    (0..IN_CLUSTER_MARK_IDS)
        .map(move |i| IN_CLUSTER_MARK_BIT | ((start + i) % IN_CLUSTER_MARK_IDS + 1))
}

/// FNV-1a over a service port's name: a stable hash (the same in every build and process), so
/// marks do not move across restarts.
fn fnv1a(p: &ServicePortName) -> u32 {
    let mut h: u32 = 0x811c_9dc5;
    for part in [
        &p.namespace,
        &p.name,
        p.port_name.as_str(),
        p.protocol.api_name(),
    ] {
        for b in part.bytes().chain(std::iter::once(0)) {
            h ^= u32::from(b);
            h = h.wrapping_mul(0x0100_0193);
        }
    }
    h
}
