//! The two kinds of sync: incremental (the dirty services' delta, no kernel read) and full
//! (one read per subsystem, a diff against the whole desired state, drift counted), and the
//! kept state of invalid Services.

use super::apply::IpvsSender;
use super::*;

impl Proxier {
    pub(super) fn incremental_sync(
        &mut self,
        store: &Store,
        node_addresses: &BTreeSet<IpAddr>,
        kernel: &mut dyn Kernel,
    ) -> SyncReport {
        let mut report = SyncReport::new(SyncKind::Incremental);
        let t = Instant::now();
        let node = self.node_info(store, node_addresses);
        let names = self.dirty_names(store, &node);
        let udp_before = self.udp_with_reals(names.iter());
        let changes = self.derive(store, &node, names.iter().cloned(), &mut report);
        let delta = self.desired.update_services(changes);
        // UDP virtual servers that now have real servers and had none: entries created while
        // they had none point nowhere (k/k#125467).
        for (k, has) in self.udp_with_reals(names.iter()) {
            if has && !udp_before.get(&k).copied().unwrap_or(false) {
                if let ServiceKey::Inet { addr, port, .. } = k {
                    self.conntrack.push(ConntrackFilter::unanswered(
                        conntrack::Protocol::Udp,
                        addr,
                        port,
                    ));
                }
            }
        }
        let t = report.lap("derive", t);
        self.apply_delta(delta, kernel, &mut report);
        report.lap("apply", t);
        report
    }

    pub(super) fn full_sync(
        &mut self,
        store: &Store,
        node_addresses: &BTreeSet<IpAddr>,
        kernel: &mut dyn Kernel,
    ) -> SyncReport {
        let mut report = SyncReport::new(SyncKind::Full);
        let t = Instant::now();
        let node = self.node_info(store, node_addresses);
        self.zone = node.zone.clone();
        let mut names = std::mem::take(&mut self.dirty);
        self.node_dirty = false;
        if !self.applied_once {
            names.extend(store.service_names().cloned());
        } else {
            names.extend(self.desired.node_dependent_services());
            names.extend(self.rejected.iter().cloned());
        }
        let changes = self.derive(store, &node, names, &mut report);
        // A proxier that adopted the kernel already leaves the reads to a drift check, one
        // read per later sync (see `check`).
        if self.check_sliced(store) {
            let delta = self.desired.update_services(changes);
            let t = report.lap("derive", t);
            return self.periodic_sync(delta, kernel, report, t);
        }
        let drift_counted = self.applied_once;
        // What the changes pending since the last sync explain: the full diff below contains it
        // too, and it is not drift (nobody changed the kernel behind our back). Before the first
        // successful full sync nothing is counted as drift, and that delta would be the whole
        // table: it is not computed.
        let expected = if drift_counted {
            Some(self.desired.update_services(changes))
        } else {
            self.desired.install_services(changes);
            None
        };
        self.set_counts = count_sets(&self.desired);
        let t = report.lap("derive", t);

        // One read per subsystem. A subsystem whose read fails is neither diffed nor cleaned
        // (nothing is deleted on the strength of a failed read) and the full sync stays
        // requested, retried with backoff.
        let mut read_failed: BTreeSet<Subsystem> = BTreeSet::new();
        if let Err(e) = kernel.ensure_link() {
            report.fail(Subsystem::Address, e.to_string());
            read_failed.insert(Subsystem::Address);
        }
        let owned_sets = SetKind::all_names(self.cfg.family);
        let actual_sets = match kernel.read_ipsets(&owned_sets) {
            Ok(s) => Some(s),
            Err(e) => {
                tracing::warn!(error = %e, "full sync: reading the ipsets failed; will retry");
                report.fail(Subsystem::Ipset, e.to_string());
                read_failed.insert(Subsystem::Ipset);
                None
            }
        };
        let actual_ipvs = match kernel.read_ipvs(self.cfg.family) {
            Ok(t) => Some(t),
            Err(e) => {
                tracing::warn!(error = %e, "full sync: reading IPVS failed; will retry");
                report.fail(Subsystem::Ipvs, e.to_string());
                read_failed.insert(Subsystem::Ipvs);
                None
            }
        };
        let actual_addrs = if read_failed.contains(&Subsystem::Address) {
            None
        } else {
            match kernel.read_addresses(self.cfg.family) {
                Ok(a) => Some(a),
                Err(e) => {
                    tracing::warn!(error = %e, "full sync: reading kube-ipvs0 failed; will retry");
                    report.fail(Subsystem::Address, e.to_string());
                    read_failed.insert(Subsystem::Address);
                    None
                }
            }
        };

        let t = report.lap("read", t);
        self.adopt_kept_state(
            store,
            &node,
            crate::adopt::KernelView {
                ipvs: actual_ipvs.as_ref(),
                addresses: actual_addrs.as_ref(),
                sets: actual_sets.as_ref(),
            },
        );

        // Compute the differences.
        let set_diff = actual_sets
            .as_ref()
            .map(|actual| ipset::diff(&self.desired.ipset_state(), actual));
        // A first sync's creates and updates are the whole program: they are generated while
        // they are sent (step 2, below). Its deletions, and a drift check's whole diff (which
        // is counted), are computed here.
        let ipvs_ops = actual_ipvs.as_ref().map(|actual| {
            let owned = owned_by_proxy(&self.cfg);
            if drift_counted {
                self.desired.diff_ipvs(actual, &owned)
            } else {
                IpvsOps {
                    apply: Vec::new(),
                    remove: self.desired.diff_ipvs_undesired(actual, &owned),
                }
            }
        });
        let ipvs_ops = ipvs_ops.map(|ops| self.graceful(ops, actual_ipvs.as_ref()));
        let (addr_add, addr_del) = match &actual_addrs {
            Some(actual) => self.address_diff(actual),
            None => (Vec::new(), Vec::new()),
        };
        if let Some(expected) = expected {
            let fam = self.cfg.family;
            let (n_ipvs, n_sets, n_addr) = unexplained(
                &expected,
                fam,
                ipvs_ops.as_ref(),
                set_diff.as_ref(),
                (&addr_add, &addr_del),
                &self.isolated(),
            );
            for (k, n) in [("ipvs", n_ipvs), ("ipset", n_sets), ("address", n_addr)] {
                if n > 0 {
                    tracing::warn!(subsystem = k, differences = n, "repairing drift");
                    report.drift.insert(k, n);
                }
            }
        }

        // Apply in the order of the contract in `desired::diff`.
        let (set_grow, set_shrink) = match set_diff {
            Some(d) => split_set_diff(d),
            None => (IpsetDiff::default(), IpsetDiff::default()),
        };
        let t = report.lap("diff", t);
        // The new ClusterIPs are bound while the sets, rules and IPVS are programmed (the real
        // node binds them on its own socket and thread: at 10,000 services the binds and IPVS
        // take seconds each). A VIP may so be bound a moment before its virtual server exists,
        // during this sync only, as upstream binds each one before its real servers exist
        // (`syncService`, then `syncEndpoint`).
        let adds = self.start_addrs(&addr_add, kernel, &mut report);
        self.apply_sets(&set_grow, kernel, &mut report);
        let t = report.lap("ipset", t);
        self.apply_rules(kernel, true, None, &mut report);
        let t = report.lap("iptables", t);
        let ops = ipvs_ops.unwrap_or_default();
        match &actual_ipvs {
            Some(actual) if !drift_counted => self.apply_ipvs_program(actual, kernel, &mut report),
            _ => self.apply_ipvs(&ops.apply, kernel, &mut report),
        }
        let t = report.lap("ipvs", t);
        self.finish_addrs(adds, kernel, &mut report);
        self.apply_addrs(&[], &addr_del, kernel, &mut report);
        let t = report.lap("addresses", t);
        self.apply_ipvs(&ops.remove, kernel, &mut report);
        self.apply_sets(&set_shrink, kernel, &mut report);
        report.lap("remove", t);
        let now = self.now;
        if read_failed.is_empty() {
            self.applied_once = true;
            self.full_requested = false;
            self.retry.full.succeeded();
            // Every subsystem was read and diffed: what was waiting for a targeted repair has
            // been repaired by this sync unless it failed again just now.
            if !report.failed.contains_key(&Subsystem::Address) {
                self.recheck_addresses = false;
                self.retry.address.succeeded();
            }
            if !report.failed.contains_key(&Subsystem::Ipset) {
                self.recheck_sets = false;
                self.retry.ipset.succeeded();
            }
        } else {
            // Not done: adoption / the drift check stays pending, retried with backoff.
            self.full_requested = true;
            let delay = self.retry.full.failed(now);
            tracing::warn!(
                failed = ?read_failed.iter().map(|s| s.as_str()).collect::<Vec<_>>(),
                retry_in_ms = delay.as_millis() as u64,
                "full sync incomplete: a kernel read failed; retrying with backoff"
            );
        }
        self.full_failed = read_failed;
        report
    }

    /// Step 2 of a first full sync: the creates and updates that make `actual` hold the
    /// desired table, generated a few virtual servers at a time while they are sent. The
    /// operations, their order and their chunks are those of `diff_ipvs` + `graceful` +
    /// `apply_ipvs`; only one chunk of them exists at a time (the whole program at 10,000
    /// services x 10 endpoints is 110,000 operations, ~12.6 MB at the sync's peak).
    fn apply_ipvs_program(
        &mut self,
        actual: &IpvsTable,
        kernel: &mut dyn Kernel,
        report: &mut SyncReport,
    ) {
        /// Virtual servers diffed per step of the generator.
        const KEYS_PER_STEP: usize = 64;
        let keys = self.desired.ipvs_keys();
        let mut tx = IpvsSender::default();
        let mut buf: Vec<Op> = Vec::new();
        let mut next = 0;
        loop {
            while buf.len() < IPVS_APPLY_CHUNK && next < keys.len() {
                let end = (next + KEYS_PER_STEP).min(keys.len());
                let mut ops = self.desired.diff_ipvs_keys(&keys[next..end], actual);
                self.graceful_apply(&mut ops, Some(actual));
                buf.append(&mut ops);
                next = end;
            }
            if buf.is_empty() {
                break;
            }
            let n = buf.len().min(IPVS_APPLY_CHUNK);
            self.send_ipvs(&mut tx, &buf[..n], kernel, report);
            buf.drain(..n);
        }
        self.finish_ipvs(tx, report);
    }

    /// Adopts the kernel state the model cannot derive but that must not be deleted (see
    /// [`crate::adopt`]): that of invalid Services without a last-good state, and the NodePort
    /// virtual servers on addresses that depend on a Node not known yet. Runs at a full sync,
    /// after the reads and before the diff.
    pub(super) fn adopt_kept_state(
        &mut self,
        store: &Store,
        node: &NodeInfo,
        kernel: crate::adopt::KernelView<'_>,
    ) {
        let node_ips: BTreeSet<IpAddr> = node
            .addresses
            .iter()
            .chain(node.primary_ips.iter())
            .filter(|ip| Family::of(ip) == self.cfg.family)
            .copied()
            .collect();
        let mut changed = false;
        for name in std::mem::take(&mut self.to_adopt) {
            let Some(svc) = store.service(&name) else {
                continue;
            };
            let claims = crate::adopt::claims(svc, &self.cfg);
            let desired = &self.desired;
            let free = |k: &ServiceKey| desired.owner_of(k).is_none_or(|o| *o == name);
            let adopted = crate::adopt::adopt_service(&claims, kernel, &self.cfg, &node_ips, free);
            if let Some(mut d) = adopted {
                // A partial read adopts what it saw; a later full sync completes it.
                if let Some(old) = self.desired.service(&name) {
                    d.virtual_servers.extend(old.virtual_servers.clone());
                    d.addresses.extend(old.addresses.iter().copied());
                    d.ipset_entries.extend(old.ipset_entries.iter().cloned());
                    d.features = desired::Features(d.features.0 | old.features.0);
                    if d.in_cluster.is_empty() {
                        d.in_cluster = old.in_cluster.clone();
                        d.fwmarks = old.fwmarks.clone();
                    }
                }
                tracing::warn!(service = %name, virtual_servers = d.virtual_servers.len(),
                    addresses = d.addresses.len(), ipset_entries = d.ipset_entries.len(),
                    "invalid service has no last-good state: keeping what the kernel holds for it");
                let _ = self.desired.update_service(name.clone(), Some(d));
                changed = true;
            }
            if !kernel.complete() {
                self.to_adopt.insert(name);
            }
        }
        let pseudo = crate::adopt::unresolved_node_ports();
        if store.node().is_none() && self.cfg.node_port_primary {
            let node_ports: BTreeSet<(ipvs_netlink::Protocol, u16)> = store
                .service_names()
                .filter_map(|n| store.service(n))
                .flat_map(|s| crate::adopt::claims(s, &self.cfg).node_ports)
                .collect();
            let desired = &self.desired;
            let free = |k: &ServiceKey| desired.owner_of(k).is_none_or(|o| *o == pseudo);
            let adopted =
                crate::adopt::adopt_node_ports(&node_ports, kernel, &self.cfg, &node_ips, free);
            if let Some(d) = adopted {
                tracing::warn!(virtual_servers = d.virtual_servers.len(),
                    "the Node is not known: keeping the NodePort virtual servers on its addresses until it is");
                let _ = self.desired.update_service(pseudo, Some(d));
                changed = true;
            }
        }
        if changed {
            self.set_counts = count_sets(&self.desired);
        }
    }
}
