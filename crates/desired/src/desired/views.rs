//! What the proxier and `plan` read from the desired state: the IPVS table (whole, by keys, or
//! diffed against the kernel's), addresses, ipset members and state, iptables inputs, health
//! checks, counts and conflicts. Nothing here changes it.

use std::sync::Arc;

use super::*;

/// Views of the whole desired state.
impl Desired {
    /// The nat rules in-cluster traffic needs: each destination with its port's mark. When two
    /// ports claim one destination (a VIP conflict), the smaller mark is listed first and wins
    /// (the first matching rule in the chain marks the packet).
    pub fn in_cluster_marks(&self) -> Vec<InClusterMark> {
        let mut v: Vec<InClusterMark> = self.in_cluster.keys().copied().collect();
        v.sort_by_key(|m| (m.dest, m.mark));
        v
    }

    /// The full IPVS table (each key from its winning claimant).
    pub fn ipvs_table(&self) -> IpvsTable {
        self.claims
            .keys()
            .filter_map(|k| self.effective(k).map(|vs| (*k, vs.clone())))
            .collect()
    }

    /// [`crate::diff::diff_ipvs`] of [`Desired::ipvs_table`] against `actual`, without
    /// building the desired table (a full resync at 10,000 services would copy ~10 MB).
    pub fn diff_ipvs(&self, actual: &IpvsTable, owned: &dyn Fn(&ServiceKey) -> bool) -> IpvsOps {
        IpvsOps {
            apply: self.diff_ipvs_keys(&self.ipvs_keys(), actual),
            remove: self.diff_ipvs_undesired(actual, owned),
        }
    }

    /// The keys of [`Desired::ipvs_table`] in order, for [`Desired::diff_ipvs_keys`].
    pub fn ipvs_keys(&self) -> Vec<ServiceKey> {
        let mut keys: Vec<ServiceKey> = self
            .claims
            .keys()
            .filter(|k| self.effective(k).is_some())
            .copied()
            .collect();
        keys.sort_unstable();
        keys
    }

    /// The creates and updates of [`Desired::diff_ipvs`] for the desired virtual servers among
    /// `keys` only (pass consecutive slices of [`Desired::ipvs_keys`] to generate the whole
    /// program a few virtual servers at a time, in the order of [`Desired::diff_ipvs`]).
    pub fn diff_ipvs_keys(&self, keys: &[ServiceKey], actual: &IpvsTable) -> Vec<Op> {
        let mut out = IpvsOps::default();
        let entries = keys
            .iter()
            .filter_map(|k| self.effective(k).map(|vs| (k, vs)));
        crate::diff::diff_desired(entries, actual, &mut out);
        out.apply
    }

    /// The deletions of [`Desired::diff_ipvs`]: the owned virtual servers of `actual` that are
    /// not desired.
    pub fn diff_ipvs_undesired(
        &self,
        actual: &IpvsTable,
        owned: &dyn Fn(&ServiceKey) -> bool,
    ) -> Vec<Op> {
        let mut out = IpvsOps::default();
        crate::diff::diff_undesired(|k| self.effective(k), actual, owned, &mut out);
        out.remove
    }

    /// Virtual servers and real servers of [`Desired::ipvs_table`], counted without building
    /// it.
    pub fn ipvs_counts(&self) -> (usize, usize) {
        self.claims
            .keys()
            .filter_map(|k| self.effective(k))
            .fold((0, 0), |(s, r), vs| (s + 1, r + vs.real_servers.len()))
    }

    /// All addresses wanted on kube-ipvs0.
    pub fn addresses(&self) -> BTreeSet<IpAddr> {
        self.addresses.keys().copied().collect()
    }

    /// All ipset members.
    pub fn ipset_entries(&self) -> BTreeSet<IpsetEntry> {
        self.ipset_members().collect()
    }

    /// All ipset members, in no particular order, without collecting them (a node of 10,000
    /// services has ~50,000; a `BTreeSet` of them was 4.3 MB of small allocations).
    pub fn ipset_members(&self) -> impl Iterator<Item = IpsetEntry> + '_ {
        self.entries.entries()
    }

    /// The full ipset state (all 17 sets of this family declared, members labelled with the
    /// first service, by name, that needs them).
    pub fn ipset_state(&self) -> ipset::IpsetState {
        let fam = self.family;
        let mut st = ipset::IpsetState::kube(fam);
        // Every set is declared above; their names are made once, not once per member.
        let set_names: Vec<(SetKind, String)> =
            SetKind::ALL.iter().map(|k| (*k, k.name(fam))).collect();
        let mut names: Vec<&ServiceName> = self.services.keys().collect();
        names.sort();
        for n in names {
            if let Some(sd) = self.services.get(n) {
                // One label per service, shared by its members and the changes made of them.
                let owner: Arc<str> = Arc::from(n.to_string());
                for e in &sd.ipset_entries {
                    let Some((_, set)) = set_names.iter().find(|(k, _)| *k == e.set) else {
                        continue;
                    };
                    // The first service by name labels a shared member. Entries are built per
                    // family from typed values; a misfit is a bug upstream of here and is
                    // skipped rather than aborting the view.
                    if !st
                        .get(set)
                        .is_some_and(|s| s.entries.contains_key(&e.entry))
                    {
                        let _ = st.insert_shared(set, e.entry.clone(), &owner);
                    }
                }
            }
        }
        st
    }

    /// The iptables inputs (configuration plus the features in use).
    pub fn iptables(&self) -> IptablesInputs {
        let on = |bit: u16| self.features[bit.trailing_zeros() as usize] > 0;
        IptablesInputs {
            masquerade_all: self.masquerade_all,
            cluster_cidrs: self.cluster_cidrs.clone(),
            node_ports: on(Features::NODE_PORTS),
            sctp_node_ports: on(Features::SCTP_NODE_PORTS),
            node_ports_local: on(Features::NODE_PORTS_LOCAL),
            external_ips: on(Features::EXTERNAL_IPS),
            external_ips_local: on(Features::EXTERNAL_IPS_LOCAL),
            load_balancers: on(Features::LOAD_BALANCERS),
            load_balancers_local: on(Features::LOAD_BALANCERS_LOCAL),
            lb_source_ranges: on(Features::LB_SOURCE_RANGES),
            health_check_node_ports: on(Features::HEALTH_CHECK_NODE_PORTS),
            loop_back: on(Features::LOOP_BACK),
        }
    }

    /// Service ports left without endpoints by a Local traffic policy: (internal, external).
    pub fn no_local_endpoints(&self) -> (usize, usize) {
        self.services.values().fold((0, 0), |(i, e), s| {
            (
                i + s.no_local_internal as usize,
                e + s.no_local_external as usize,
            )
        })
    }

    /// Health-check node ports by service.
    pub fn health_checks(&self) -> BTreeMap<ServiceName, HealthCheck> {
        self.services
            .iter()
            .filter_map(|(n, s)| s.health_check.map(|h| (n.clone(), h)))
            .collect()
    }

    /// Services whose desired state depends on the node's addresses (re-derive them when the
    /// node's addresses change).
    pub fn node_dependent_services(&self) -> BTreeSet<ServiceName> {
        self.services
            .iter()
            .filter(|(_, s)| s.node_dependent)
            .map(|(n, _)| n.clone())
            .collect()
    }

    /// Virtual-server keys claimed by more than one service, with the claimants (the first
    /// one wins).
    pub fn conflicts(&self) -> BTreeMap<ServiceKey, Vec<ServiceName>> {
        self.claims
            .iter()
            .filter(|(_, c)| c.len() > 1)
            .map(|(k, c)| (*k, c.iter().cloned().collect()))
            .collect()
    }
}

/// Lookups the proxier needs for failure isolation and node changes.
impl Desired {
    /// Names of the services with a desired state.
    pub fn service_names(&self) -> impl Iterator<Item = &ServiceName> {
        self.services.keys()
    }

    /// The service whose virtual server `key` is applied (the winning claimant).
    pub fn owner_of(&self, key: &ServiceKey) -> Option<&ServiceName> {
        self.claims.get(key)?.first()
    }

    /// The desired virtual servers for `keys` only (absent keys are not desired).
    pub fn ipvs_table_for(&self, keys: &BTreeSet<ServiceKey>) -> IpvsTable {
        keys.iter()
            .filter_map(|k| self.effective(k).map(|vs| (*k, vs.clone())))
            .collect()
    }
}
