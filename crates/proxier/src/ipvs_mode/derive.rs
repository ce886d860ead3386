//! Deriving: the dirty services (and those whose VIP claims they affect) turned into their
//! desired state, for a sync or, without a kernel, for `plan`.

use super::*;

impl Proxier {
    /// Derives every service in `store` into the desired state without touching a kernel
    /// (for `plan`).
    pub fn derive_all(&mut self, store: &Store, node_addresses: &BTreeSet<IpAddr>) {
        self.refresh_pod_cidrs(store);
        let node = self.node_info(store, node_addresses);
        let mut report = SyncReport::new(SyncKind::Full);
        let mut names: BTreeSet<ServiceName> = store.service_names().cloned().collect();
        names.extend(self.desired_names());
        let changes = self.derive(store, &node, names, &mut report);
        self.desired.install_services(changes);
        self.set_counts = count_sets(&self.desired);
    }

    /// detectLocalMode NodeCIDR: takes the Node's podCIDRs; true when they changed.
    pub(super) fn refresh_pod_cidrs(&mut self, store: &Store) -> bool {
        self.rules
            .refresh_pod_cidrs(&mut self.pod_cidrs, store, self.cfg.family)
    }

    pub(super) fn node_info(&self, store: &Store, node_addresses: &BTreeSet<IpAddr>) -> NodeInfo {
        NodeInfo::from_node(&self.node_name, store.node(), node_addresses.clone())
    }

    /// External VIP claims lost to another Service (the `kube_ipvs_vip_conflicts` gauge).
    pub fn vip_conflicts(&self) -> usize {
        self.vips.conflicts()
    }

    /// External claims on this node's addresses the node keeps (the
    /// `kube_ipvs_node_address_conflicts` gauge).
    pub fn node_address_conflicts(&self) -> desired::vip::NodeConflicts {
        self.vips.node_conflicts()
    }

    /// Derives the given services (and those whose VIP claims they affect); invalid ones keep
    /// their last good state. A Service whose members would overfill an ipset
    /// ([`Desired::ipset_room`]) is rejected like an invalid one, unless only the hairpin set
    /// overflows: then it is taken in without its hairpin members
    /// ([`Desired::ipset_room_or_without_hairpin`]).
    pub(super) fn derive(
        &mut self,
        store: &Store,
        node: &NodeInfo,
        names: impl IntoIterator<Item = ServiceName>,
        report: &mut SyncReport,
    ) -> Vec<(ServiceName, Option<desired::ServiceDesired>)> {
        let mut changes = Vec::new();
        let mut room = desired::SetGrowth::default();
        let names = self.vips.update(store, &self.cfg, node, names);
        for name in names {
            report.services_derived += 1;
            let key = format!("service {name}");
            let vip_key = format!("vip {name}");
            let node_key = format!("nodeaddress {name}");
            let fields_key = format!("fields {name}");
            let hairpin_key = format!("hairpin {name}");
            let Some(svc) = store.service(&name) else {
                self.rejections.clear(&key);
                self.to_adopt.remove(&name);
                self.rejected.remove(&name);
                self.rejections.clear(&vip_key);
                self.rejections.clear(&node_key);
                self.rejections.clear(&fields_key);
                self.rejections.clear(&hairpin_key);
                self.rejections.clear_owned(&key);
                changes.push((name, None));
                continue;
            };
            let slices = store.slices_of(&name);
            let lost = self.vips.lost(&name);
            let node_lost = self.vips.node_lost(&name);
            let lost_vips: BTreeSet<desired::vip::Vip> =
                lost.keys().chain(node_lost.keys()).copied().collect();
            let mut hairpin_left_out = None;
            let derived = service_desired_except(svc, &slices, &self.cfg, node, &lost_vips)
                .and_then(|mut d| {
                    if let Some(sd) = d.desired.as_mut() {
                        hairpin_left_out = self.desired.ipset_room_or_without_hairpin(
                            &name,
                            sd,
                            ipset::MAX_ELEM as usize,
                            &mut room,
                        )?;
                    }
                    Ok(d)
                });
            match derived {
                Ok(d) => {
                    self.rejections.clear(&key);
                    self.to_adopt.remove(&name);
                    self.rejected.remove(&name);
                    match desired::vip::conflict_reason(&lost) {
                        Some(why) => {
                            self.rejections.reject(&vip_key, &why);
                        }
                        None => self.rejections.clear(&vip_key),
                    }
                    match desired::vip::node_conflict_reason(&node_lost) {
                        Some(why) => {
                            self.rejections.reject(&node_key, &why);
                        }
                        None => self.rejections.clear(&node_key),
                    }
                    // Values left out of a Service it programs (a partial rejection).
                    match d.desired.as_ref().and_then(|_| model::ignored_fields(svc)) {
                        Some(why) => {
                            self.rejections.reject(&fields_key, &why);
                        }
                        None => self.rejections.clear(&fields_key),
                    }
                    // Taken in without its hairpin members (no room in KUBE-LOOP-BACK): a partial
                    // rejection, derived again at every full sync until they fit.
                    match &hairpin_left_out {
                        Some(why) => {
                            self.rejections.reject(&hairpin_key, why);
                            self.rejected.insert(name.clone());
                        }
                        None => self.rejections.clear(&hairpin_key),
                    }
                    self.rejections
                        .replace_slices(&key, &name.namespace, &d.rejected_slices);
                    changes.push((name, d.desired));
                }
                Err(why) => {
                    // Logged once per reason by `reject`; the last good state stays applied,
                    // and with none (a restart) the kernel's state is adopted at a full sync.
                    self.rejections.reject(&key, &why);
                    if self.desired.service(&name).is_none() {
                        self.to_adopt.insert(name.clone());
                    }
                    self.rejected.insert(name);
                }
            }
        }
        changes
    }

    pub(super) fn dirty_names(&mut self, store: &Store, node: &NodeInfo) -> BTreeSet<ServiceName> {
        let mut names = std::mem::take(&mut self.dirty);
        if std::mem::take(&mut self.node_dirty) {
            // A rejected Service may fit its budget with the node's new addresses.
            names.extend(self.rejected.iter().cloned());
            if node.zone != self.zone {
                self.zone = node.zone.clone();
                names.extend(store.service_names().cloned());
                names.extend(self.desired_names());
            } else {
                names.extend(self.desired.node_dependent_services());
            }
        }
        names
    }

    pub(super) fn desired_names(&self) -> Vec<ServiceName> {
        self.desired.service_names().cloned().collect()
    }
}
