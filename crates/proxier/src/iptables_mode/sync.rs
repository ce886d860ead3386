//! One iptables-mode sync: full (every chain rendered and restored) or partial (only the
//! changed services' chains), with the node-port jumps kept and failures retried.

use super::adopt::saved_target;
use super::*;

impl IptablesProxier {
    /// Runs one sync (full when requested or first, else partial).
    pub fn sync(&mut self, store: &Store, node_addresses: &BTreeSet<IpAddr>) -> SyncReport {
        self.sync_at(Instant::now(), store, node_addresses)
    }

    /// [`IptablesProxier::sync`] as if it ran at `now` (a failure schedules its retry from
    /// `now`; tests drive the backoff with explicit instants).
    pub fn sync_at(
        &mut self,
        now: Instant,
        store: &Store,
        node_addresses: &BTreeSet<IpAddr>,
    ) -> SyncReport {
        let start = Instant::now();
        if self.refresh_pod_cidrs(store) {
            // Every service's chains carry the local-traffic match: a change is a full sync.
            self.full_requested = true;
        }
        let mut full = self.full_requested || !self.applied_once;
        let node = self.node_info(store, node_addresses);
        let mut mode = self.mode_config(&node);
        // The periodic check's reads: the jumps' built-in chains and the shared chains.
        let mut listed: BTreeMap<(Table, &'static str), String> = BTreeMap::new();
        let check = !full && self.check_requested;
        if check {
            match self.list_checked_chains(&mode) {
                Ok(l) => listed = l,
                Err(e) => {
                    // A chain that cannot be listed is gone (or the table was flushed) or the
                    // tool failed: the full sync reads and repairs everything.
                    tracing::warn!(error = %e, "periodic iptables check: a chain could not be listed; running a full sync");
                    full = true;
                }
            }
            self.check_requested = false;
        }
        let mut report = empty_report(if full {
            SyncKind::Full
        } else {
            SyncKind::Incremental
        });
        let mut names = std::mem::take(&mut self.dirty);
        let rederive = std::mem::take(&mut self.rederive_requested);
        if full || rederive {
            names.extend(store.service_names().cloned());
            names.extend(self.services.keys().cloned());
        }
        let changed = self.derive(store, &node, &mode, names, &mut report);
        for (name, old) in &changed {
            self.record_conntrack(name, old.as_ref());
        }

        // Chains to write and delete.
        let mut write: BTreeMap<&str, &[String]> = BTreeMap::new();
        let mut delete: BTreeSet<String> = BTreeSet::new();
        let mut jump_fixes: BTreeMap<Table, Vec<String>> = BTreeMap::new();
        let mut shared_changed = false;
        let mut save_failed = false;
        if full {
            let saves: Vec<(Table, Result<String, KernelError>)> = [Table::Nat, Table::Filter]
                .into_iter()
                .map(|t| (t, self.runner.save(t)))
                .collect();
            self.adopt_saved(store, &saves);
            self.keep_node_port_jumps(store, &node, &saves);
            mode = self.mode_config(&node);
            write = self.all_chains();
            for (table, saved) in saves {
                match saved {
                    Ok(saved) => {
                        let fixes = proxy_mode::jump_fixes_for(&mode, table, &saved);
                        if !fixes.is_empty() && self.applied_once {
                            report.drift.insert("iptables jumps", fixes.len());
                        }
                        jump_fixes.insert(table, fixes);
                        if table == Table::Nat {
                            for c in proxy_mode::saved_chains(&saved) {
                                let ours = proxy_mode::SERVICE_CHAIN_PREFIXES
                                    .iter()
                                    .any(|p| c.starts_with(p));
                                if ours && !write.contains_key(c.as_str()) {
                                    delete.insert(c);
                                }
                            }
                        }
                    }
                    Err(e) => {
                        // Without the saved table, stale chains and jumps are unknown: the full
                        // sync is not done (retried with backoff), and nothing is deleted on the
                        // strength of the failed read.
                        save_failed = true;
                        report.fail(
                            Subsystem::Iptables,
                            format!("iptables-save -t {table}: {e}"),
                        );
                    }
                }
            }
            for c in self.applied.keys() {
                if !write.contains_key(c.as_str()) {
                    delete.insert(c.clone());
                }
            }
            if self.applied_once && !delete.is_empty() {
                report.drift.insert("iptables chains", delete.len());
            }
        } else {
            for (name, old) in &changed {
                let new_chains: BTreeMap<&String, &Vec<String>> = self
                    .services
                    .get(name)
                    .into_iter()
                    .flatten()
                    .flat_map(|p| p.rendered.chains.iter())
                    .collect();
                for (c, r) in &new_chains {
                    if self.applied.get(*c) != Some(&fingerprint(r)) {
                        write.insert(c.as_str(), r.as_slice());
                    }
                }
                let old_ports = old.iter().flatten();
                for p in old_ports.clone() {
                    for c in p.rendered.chains.keys() {
                        if !new_chains.contains_key(c) {
                            delete.insert(c.clone());
                        }
                    }
                }
                let old_shared: Vec<_> = old_ports.map(|p| &p.rendered.shared).collect();
                let new_shared: Vec<_> = self
                    .services
                    .get(name)
                    .into_iter()
                    .flatten()
                    .map(|p| &p.rendered.shared)
                    .collect();
                shared_changed |= old_shared != new_shared;
            }
        }

        // The node's addresses changed: the shared chains carry the NodePort jumps.
        shared_changed |= rederive;
        let ports: Vec<&RenderedServicePort> = self.ports().collect();
        if check && !full {
            for table in [Table::Nat, Table::Filter] {
                let text: String = listed
                    .iter()
                    .filter(|((t, _), _)| *t == table)
                    .map(|(_, l)| l.as_str())
                    .collect();
                let fixes = proxy_mode::jump_fixes_for(&mode, table, &text);
                if !fixes.is_empty() {
                    report.drift.insert("iptables jumps", fixes.len());
                    jump_fixes.insert(table, fixes);
                }
            }
            if !shared_changed {
                let differing = shared_chains_differing(&mode, &ports, &listed);
                if differing > 0 {
                    report.drift.insert("iptables rules", differing);
                    shared_changed = true;
                }
            }
        }
        if !full
            && write.is_empty()
            && delete.is_empty()
            && !shared_changed
            && jump_fixes.values().all(Vec::is_empty)
        {
            report.duration = start.elapsed();
            return report;
        }
        let payload = match proxy_mode::restore_payload(&PayloadInput {
            cfg: &mode,
            ports: &ports,
            write: &write,
            delete: &delete,
            jump_fixes: &jump_fixes,
        }) {
            Ok(p) => p,
            Err(e) => {
                report.fail(Subsystem::Iptables, format!("iptables: {e}"));
                self.retry.failed(now);
                report.retrying.insert(Subsystem::Iptables);
                report.duration = start.elapsed();
                return report;
            }
        };
        // What is remembered of the written chains once the restore succeeds (`write` borrows
        // the rendered rules, so it is not kept past here).
        let written: Vec<(String, u64)> = write
            .iter()
            .map(|(c, r)| ((*c).to_owned(), fingerprint(r)))
            .collect();
        self.last_payload_bytes = payload.len();
        self.chains_written = written.len();
        self.chains_deleted = delete.len();
        match self.runner.restore(&payload) {
            Ok(()) => {
                report.iptables_restored = true;
                for c in &delete {
                    self.applied.remove(c);
                }
                self.applied.extend(written);
                if save_failed {
                    self.full_requested = true;
                    let delay = self.retry.failed(now);
                    tracing::warn!(
                        retry_in_ms = delay.as_millis() as u64,
                        "full sync incomplete: iptables-save failed; retrying with backoff"
                    );
                    report.retrying.insert(Subsystem::Iptables);
                } else {
                    self.applied_once = true;
                    if full {
                        self.full_requested = false;
                        self.full_for_change = false;
                        self.check_requested = false;
                        self.last_full = Some(now);
                    }
                    self.retry.succeeded();
                }
            }
            Err(e) => {
                let delay = self.retry.failed(now);
                tracing::error!(error = %e, retry_in_ms = delay.as_millis() as u64,
                    "iptables-restore failed; next sync is full, retried with backoff");
                report.iptables_restore_failed = true;
                report.fail(Subsystem::Iptables, e.to_string());
                report.retrying.insert(Subsystem::Iptables);
                // What the kernel holds is unknown now: rewrite everything next time.
                self.full_requested = true;
                self.applied.clear();
            }
        }
        report.duration = start.elapsed();
        report
    }
}

impl IptablesProxier {
    /// The periodic check's reads: each built-in chain a jump of `mode` starts from and each
    /// shared chain, one `iptables -S` each.
    fn list_checked_chains(
        &mut self,
        mode: &ProxyModeConfig,
    ) -> Result<BTreeMap<(Table, &'static str), String>, KernelError> {
        let mut chains: BTreeSet<(Table, &'static str)> = mode.chains().into_iter().collect();
        chains.extend(
            proxy_mode::jumps_for(mode)
                .iter()
                .map(|j| (j.table, j.from)),
        );
        let mut out = BTreeMap::new();
        for (table, chain) in chains {
            let text = self.runner.list_chain(table, chain)?;
            out.insert((table, chain), text);
        }
        Ok(out)
    }

    /// With `nodePortAddresses: [primary]` and no Node known (its wait timed out), the NodePort
    /// jumps a previous run wrote for node addresses are kept (read from the saved
    /// `KUBE-SERVICES`) instead of dropped, until the Node tells the primary IPs; the same rule
    /// as IPVS mode's (see [`crate::adopt`]).
    pub(super) fn keep_node_port_jumps(
        &mut self,
        store: &Store,
        node: &NodeInfo,
        saves: &[(Table, Result<String, KernelError>)],
    ) {
        if store.node().is_some() || !self.cfg.node_port_primary {
            self.kept_node_port_ips.clear();
            return;
        }
        let Some(Ok(nat)) = saves.iter().find(|(t, _)| *t == Table::Nat).map(|(_, r)| r) else {
            return;
        };
        let prefix = format!("-A {} -d ", proxy_mode::SERVICES);
        let kept: BTreeSet<IpAddr> = nat
            .lines()
            .filter(|l| saved_target(l) == Some(proxy_mode::NODEPORTS))
            .filter_map(|l| l.strip_prefix(prefix.as_str()))
            .filter_map(|r| r.split(['/', ' ']).next())
            .filter_map(|a| a.parse::<IpAddr>().ok())
            .filter(|a| Family::of(a) == self.cfg.family && node.addresses.contains(a))
            .collect();
        if !kept.is_empty() && kept != self.kept_node_port_ips {
            tracing::warn!(addresses = ?kept,
                "the Node is not known: keeping the NodePort addresses of the saved rules until it is");
        }
        self.kept_node_port_ips = kept;
    }
}

/// How many shared chains hold a different number of rules than the payload renders for them
/// (a flushed `KUBE-SERVICES`, a rule added or deleted by hand). Counting, not comparing text:
/// `iptables -S` prints matches in its own order and format, and a count is what a flush or an
/// insertion changes.
fn shared_chains_differing(
    mode: &ProxyModeConfig,
    ports: &[&RenderedServicePort],
    listed: &BTreeMap<(Table, &'static str), String>,
) -> usize {
    let empty_write = BTreeMap::new();
    let empty_delete = BTreeSet::new();
    let no_fixes = BTreeMap::new();
    let Ok(payload) = proxy_mode::restore_payload(&PayloadInput {
        cfg: mode,
        ports,
        write: &empty_write,
        delete: &empty_delete,
        jump_fixes: &no_fixes,
    }) else {
        return 0;
    };
    // Rules per (table, chain) in the payload (`*nat` ... `COMMIT`, then `*filter` ...).
    let mut want: BTreeMap<(&str, &str), usize> = BTreeMap::new();
    let mut table = "";
    for line in payload.lines() {
        if let Some(t) = line.strip_prefix('*') {
            table = t.trim();
        } else if let Some(rest) = line.strip_prefix("-A ") {
            let chain = rest.split(' ').next().unwrap_or_default();
            *want.entry((table, chain)).or_default() += 1;
        }
    }
    let rules = |text: &str, chain: &str| {
        let prefix = format!("-A {chain} ");
        text.lines().filter(|l| l.starts_with(&prefix)).count()
    };
    mode.chains()
        .into_iter()
        .filter(|(table, chain)| {
            let want = want.get(&(table.as_str(), *chain)).copied().unwrap_or(0);
            let got = listed.get(&(*table, *chain)).map_or(0, |t| rules(t, chain));
            want != got
        })
        .count()
}
