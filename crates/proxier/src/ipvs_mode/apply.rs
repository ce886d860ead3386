//! Writing to the kernel per subsystem (ipsets, iptables rules, IPVS in chunks, addresses),
//! each failure isolated and followed by a targeted re-read and repair with backoff.

use super::*;

/// One step's IPVS operations on their way to the kernel, chunk by chunk
/// ([`Proxier::send_ipvs`]).
#[derive(Debug, Default)]
pub(super) struct IpvsSender {
    /// A chunk was sent or skipped.
    sent: bool,
    /// A whole chunk failed: the rest is not sent.
    stopped: bool,
    /// Operations not sent.
    skipped: usize,
}

/// One rejected ipset line as an error text naming its set, line, message and owner.
fn rejected_text(r: &ipset::Rejected) -> String {
    let owner = if r.owner.is_empty() { "-" } else { &r.owner };
    format!(
        "{}: `{}` rejected by ipset: {} (owner {owner})",
        r.set, r.line, r.message
    )
}

impl Proxier {
    /// Re-reads the sets, and applies what differs (after a failed ipset apply).
    pub(super) fn repair_sets(&mut self, kernel: &mut dyn Kernel, report: &mut SyncReport) {
        let owned_sets = SetKind::all_names(self.cfg.family);
        let actual = match kernel.read_ipsets(&owned_sets) {
            Ok(s) => s,
            Err(e) => {
                report.fail(Subsystem::Ipset, e.to_string());
                self.retry.ipset.failed(self.now);
                return;
            }
        };
        self.recheck_sets = false;
        let (grow, shrink) = split_set_diff(ipset::diff(&self.desired.ipset_state(), &actual));
        // The sets were re-read: a member the kernel rejects now is refused (see `refusal`).
        let was = std::mem::replace(&mut self.repairing, true);
        self.apply_sets(&grow, kernel, report);
        self.apply_sets(&shrink, kernel, report);
        self.repairing = was;
        if !self.recheck_sets {
            self.retry.ipset.succeeded();
        }
    }

    pub(super) fn apply_delta(
        &mut self,
        delta: Delta,
        kernel: &mut dyn Kernel,
        report: &mut SyncReport,
    ) {
        if delta.is_empty() {
            return;
        }
        let before: BTreeSet<SetKind> = non_empty(&self.set_counts);
        for e in &delta.ipset_add {
            *self.set_counts.entry(e.set).or_default() += 1;
        }
        for e in &delta.ipset_del {
            if let Some(n) = self.set_counts.get_mut(&e.set) {
                *n = n.saturating_sub(1);
            }
        }
        let after: BTreeSet<SetKind> = non_empty(&self.set_counts);
        let fam = self.cfg.family;
        let grow = IpsetDiff {
            adds: entry_changes(&delta.ipset_add, fam),
            ..IpsetDiff::default()
        };
        let shrink = IpsetDiff {
            dels: entry_changes(&delta.ipset_del, fam),
            ..IpsetDiff::default()
        };
        let rules_change = delta.iptables_changed || before != after;
        self.apply_sets(&grow, kernel, report);
        if rules_change {
            // Rules for sets that gain members go in now; rules for sets that become empty
            // stay until their members are gone (step 6).
            self.apply_rules(kernel, false, Some(union_of(&before, &after)), report);
        }
        let ipvs = self.graceful(delta.ipvs, None);
        self.apply_ipvs(&ipvs.apply, kernel, report);
        self.apply_addrs(&delta.addresses_add, &[], kernel, report);
        self.apply_addrs(&[], &delta.addresses_del, kernel, report);
        self.apply_ipvs(&ipvs.remove, kernel, report);
        self.apply_sets(&shrink, kernel, report);
        // Only when a set became empty do the final rules differ from those of step 2; the same
        // rules again would only repeat a failed restore (another 5 s on a held xtables lock).
        if rules_change && union_of(&before, &after) != after {
            self.apply_rules(kernel, false, None, report);
        }
    }

    pub(super) fn apply_sets(
        &mut self,
        diff: &IpsetDiff,
        kernel: &mut dyn Kernel,
        report: &mut SyncReport,
    ) {
        if diff.is_empty() {
            return;
        }
        report.ipset_changes += diff.len();
        match kernel.apply_ipsets(diff) {
            Ok(rejected) => {
                let mut failed = false;
                for r in rejected {
                    let text = rejected_text(&r);
                    // A member line names the Service it came from (when known): its refusal
                    // is that Service's, isolated; anything else is the subsystem's failure.
                    let owner = r
                        .owner
                        .split_once('/')
                        .map(|(ns, name)| ServiceName::new(ns, name))
                        .filter(|n| self.desired.service(n).is_some());
                    match (owner, r.entry) {
                        (Some(o), Some(member)) if self.isolates(&o) => self.isolate(
                            o,
                            refusal::Refused::Member(r.set, member),
                            Subsystem::Ipset,
                            IPSET_REJECTED,
                            text,
                            report,
                        ),
                        _ => {
                            tracing::warn!(error = %text, "ipset entry rejected");
                            report.fail(Subsystem::Ipset, text);
                            failed = true;
                        }
                    }
                }
                if failed {
                    self.set_recheck(self.now);
                }
            }
            Err(e) => {
                tracing::error!(error = %e, "ipset apply failed; re-reading the sets with backoff");
                report.fail(Subsystem::Ipset, e.to_string());
                self.set_recheck(self.now);
            }
        }
    }

    pub(super) fn set_recheck(&mut self, now: Instant) {
        // One backoff step per failed attempt, not per failed batch of one attempt.
        if !self.recheck_sets || self.retry.ipset.ready(now) {
            self.retry.ipset.failed(now);
        }
        self.recheck_sets = true;
    }

    /// The iptables rules for the current desired state; `sets` overrides which sets count
    /// as non-empty.
    pub fn rules(&self, sets: Option<BTreeSet<SetKind>>) -> iptables::Result<iptables::RuleSet> {
        let inputs = self.desired.iptables();
        let mut input = iptables::IpvsModeInput::new(self.cfg.family);
        input.masquerade_bit = self.rules.masquerade_bit;
        input.masquerade_all = inputs.masquerade_all;
        input.random_fully = self.rules.random_fully;
        input.local_detect = self
            .rules
            .local_detect_for(&inputs.cluster_cidrs, &self.pod_cidrs);
        input.non_empty_sets = sets.unwrap_or_else(|| non_empty(&self.set_counts));
        input.no_node_access = self.no_node_access();
        input.in_cluster = self
            .desired
            .in_cluster_marks()
            .into_iter()
            .map(|m| iptables::InClusterMark {
                ip: m.dest.ip,
                proto: m.dest.protocol,
                port: m.dest.port,
                mark: m.mark,
            })
            .collect();
        input.in_cluster_mask = desired::IN_CLUSTER_MARK_MASK;
        iptables::render_ipvs_mode(&input)
    }

    /// Load-balancer IPs whose source ranges do not admit this node: IPVS takes the node's own
    /// connections to them at LOCAL_OUT, before the INPUT firewall sees them, so they are
    /// dropped in OUTPUT instead (k/k#119656).
    pub(super) fn no_node_access(&self) -> Vec<iptables::NoNodeAccess> {
        let mut fw = BTreeSet::new();
        let mut allowed = BTreeSet::new();
        for e in self.desired.ipset_members() {
            match (e.set, e.entry) {
                (SetKind::LoadBalancerFw, ipset::Entry::IpPort { ip, proto, port }) => {
                    fw.insert((ip, proto, port));
                }
                (
                    SetKind::LoadBalancerSourceIp,
                    ipset::Entry::IpPortIp {
                        ip,
                        proto,
                        port,
                        ip2,
                    },
                ) if ip == ip2 => {
                    allowed.insert((ip, proto, port));
                }
                _ => {}
            }
        }
        fw.difference(&allowed)
            .map(|&(ip, proto, port)| iptables::NoNodeAccess { ip, proto, port })
            .collect()
    }

    pub(super) fn apply_rules(
        &mut self,
        kernel: &mut dyn Kernel,
        force: bool,
        sets: Option<BTreeSet<SetKind>>,
        report: &mut SyncReport,
    ) {
        let rules = match self.rules(sets) {
            Ok(r) => r,
            Err(e) => {
                report.fail(Subsystem::Iptables, format!("iptables: {e}"));
                return;
            }
        };
        let text = rules.render();
        match kernel.apply_iptables(&rules, force) {
            Ok(ran) => {
                report.iptables_restored |= ran;
                // A forced (drift-check) restore of the very rules applied last time means
                // someone changed them behind our back.
                if ran && force && self.applied_once && self.last_rules.as_deref() == Some(&text) {
                    tracing::warn!(subsystem = "iptables", "repairing drift");
                    *report.drift.entry("iptables").or_default() += 1;
                }
                self.last_rules = Some(text);
                // The whole rule set (forced) or the change went in: any earlier failure is
                // repaired once a forced restore succeeds.
                if force || !self.recheck_rules {
                    self.recheck_rules = false;
                    self.retry.iptables.succeeded();
                }
            }
            Err(e) => {
                let now = self.now;
                if !self.recheck_rules || self.retry.iptables.ready(now) {
                    let delay = self.retry.iptables.failed(now);
                    tracing::error!(error = %e, retry_in_ms = delay.as_millis() as u64,
                        "iptables-restore failed; retrying with backoff");
                }
                self.recheck_rules = true;
                report.iptables_restore_failed = true;
                report.fail(Subsystem::Iptables, e.to_string());
            }
        }
    }

    pub(super) fn apply_ipvs(
        &mut self,
        ops: &[Op],
        kernel: &mut dyn Kernel,
        report: &mut SyncReport,
    ) {
        if ops.is_empty() {
            return;
        }
        // In chunks: a full program is N x M operations, and one result per operation for all
        // of them at once (~120 bytes each) would be most of the sync's transient memory.
        let mut tx = IpvsSender::default();
        for chunk in ops.chunks(IPVS_APPLY_CHUNK) {
            self.send_ipvs(&mut tx, chunk, kernel, report);
        }
        self.finish_ipvs(tx, report);
    }

    /// Sends one chunk of a step's IPVS operations. The client pipelines inside the chunk; once
    /// a chunk failed as a whole (the kernel does not answer, the socket is gone) the rest of
    /// the step is not sent but marked for repair (one timeout, not one per chunk).
    pub(super) fn send_ipvs(
        &mut self,
        tx: &mut IpvsSender,
        chunk: &[Op],
        kernel: &mut dyn Kernel,
        report: &mut SyncReport,
    ) {
        if chunk.is_empty() {
            return;
        }
        tx.sent = true;
        report.ipvs_ops += chunk.len();
        if tx.stopped {
            tx.skipped += chunk.len();
            self.repair.extend(chunk.iter().filter_map(op_key));
            return;
        }
        let results = kernel.apply_ipvs(chunk);
        tx.stopped = results.iter().all(Result::is_err);
        self.apply_ipvs_results(chunk, results, report);
    }

    /// Ends a step's IPVS operations: reports what was not sent and schedules the repair.
    pub(super) fn finish_ipvs(&mut self, tx: IpvsSender, report: &mut SyncReport) {
        if !tx.sent {
            return;
        }
        if tx.skipped > 0 {
            report.ipvs_failures += tx.skipped;
            report.fail(
                Subsystem::Ipvs,
                format!(
                    "{} IPVS operations not sent: the previous {IPVS_APPLY_CHUNK} all failed",
                    tx.skipped
                ),
            );
        }
        if !self.repair.is_empty() && !self.retry.ipvs.failing() {
            self.retry.ipvs.failed(self.now);
        }
    }

    pub(super) fn apply_ipvs_results(
        &mut self,
        ops: &[Op],
        results: Vec<Result<(), KernelError>>,
        report: &mut SyncReport,
    ) {
        // A virtual server with a transient failure in this batch is not refused: its other
        // requests' definite errors (ESRCH after a NewService that hit ENOMEM) follow from it.
        let transient: BTreeSet<ServiceKey> = ops
            .iter()
            .zip(&results)
            .filter(|(_, r)| r.as_ref().is_err_and(|e| refusal_label(e).is_none()))
            .filter_map(|(op, _)| op_key(op))
            .collect();
        for (op, res) in ops.iter().zip(results) {
            if let (
                Ok(()),
                Op::DelDest(
                    ServiceKey::Inet {
                        protocol: ipvs_netlink::Protocol::Udp,
                        addr,
                        port,
                    },
                    endpoint,
                    _,
                ),
            ) = (&res, op)
            {
                self.conntrack.push(ConntrackFilter::endpoint_removed(
                    conntrack::Protocol::Udp,
                    *addr,
                    *port,
                    *endpoint,
                ));
            }
            if let Err(e) = res {
                let key = op_key(op);
                let service = key.and_then(|k| self.desired.owner_of(&k).cloned());
                if let (Some(k), Some(o), Some(label)) = (key, &service, refusal_label(&e)) {
                    if self.isolates(o) && !transient.contains(&k) {
                        let text = format!("{o}: {op:?}: {e}");
                        self.isolate(
                            o.clone(),
                            refusal::Refused::Key(k),
                            Subsystem::Ipvs,
                            label,
                            text,
                            report,
                        );
                        continue;
                    }
                }
                report.ipvs_failures += 1;
                let owner = service.map_or_else(|| "-".to_string(), |n| n.to_string());
                tracing::warn!(service = %owner, op = ?op, error = %e, "IPVS operation failed; will re-check");
                report.fail(Subsystem::Ipvs, format!("{owner}: {e}"));
                if let Some(k) = key {
                    self.repair.insert(k);
                }
            }
        }
    }

    pub(super) fn apply_addrs(
        &mut self,
        add: &[IpAddr],
        del: &[IpAddr],
        kernel: &mut dyn Kernel,
        report: &mut SyncReport,
    ) {
        if add.is_empty() && del.is_empty() {
            return;
        }
        report.address_ops += add.len() + del.len();
        let results = kernel.apply_addresses(add, del);
        self.address_results(results, report);
    }

    /// Starts binding `add` while the caller goes on (see [`Kernel::start_address_adds`]);
    /// [`Proxier::finish_addrs`] collects the results.
    pub(super) fn start_addrs(
        &mut self,
        add: &[IpAddr],
        kernel: &mut dyn Kernel,
        report: &mut SyncReport,
    ) -> Option<AddressAdds> {
        if add.is_empty() {
            return None;
        }
        report.address_ops += add.len();
        Some(kernel.start_address_adds(add))
    }

    /// Waits for the binds [`Proxier::start_addrs`] started and handles their results as
    /// [`Proxier::apply_addrs`] does.
    pub(super) fn finish_addrs(
        &mut self,
        adds: Option<AddressAdds>,
        kernel: &mut dyn Kernel,
        report: &mut SyncReport,
    ) {
        if let Some(adds) = adds {
            let results = kernel.finish_address_adds(adds);
            self.address_results(results, report);
        }
    }

    fn address_results(
        &mut self,
        results: Vec<(IpAddr, Result<(), KernelError>)>,
        report: &mut SyncReport,
    ) {
        for (ip, res) in results {
            if let Err(e) = res {
                tracing::warn!(address = %ip, error = %e, "kube-ipvs0 address change failed");
                report.fail(Subsystem::Address, format!("kube-ipvs0 {ip}: {e}"));
                self.address_recheck(self.now);
            }
        }
    }

    pub(super) fn address_recheck(&mut self, now: Instant) {
        if !self.recheck_addresses || self.retry.address.ready(now) {
            self.retry.address.failed(now);
        }
        self.recheck_addresses = true;
    }

    pub(super) fn repair_addresses(&mut self, kernel: &mut dyn Kernel, report: &mut SyncReport) {
        let now = self.now;
        if let Err(e) = kernel.ensure_link() {
            report.fail(Subsystem::Address, e.to_string());
            self.address_recheck(now);
            return;
        }
        match kernel.read_addresses(self.cfg.family) {
            Ok(actual) => {
                let (add, del) = self.address_diff(&actual);
                self.apply_addrs(&add, &del, kernel, report);
                if !self.recheck_addresses {
                    self.retry.address.succeeded();
                }
            }
            Err(e) => {
                report.fail(Subsystem::Address, e.to_string());
                self.address_recheck(now);
            }
        }
    }

    /// The binds and unbinds that make the family's addresses on kube-ipvs0 (`actual`, as
    /// read) the desired ones; addresses in excluded ranges are left alone. Used by the
    /// adoption, the drift check and the targeted repair.
    pub(super) fn address_diff(&self, actual: &BTreeSet<IpAddr>) -> (Vec<IpAddr>, Vec<IpAddr>) {
        let fam = self.cfg.family;
        let mine: BTreeSet<IpAddr> = actual
            .iter()
            .filter(|a| Family::of(a) == fam)
            .copied()
            .collect();
        let cfg = &self.cfg;
        diff_set(&self.desired.addresses(), &mine, &|a: &IpAddr| {
            !cfg.excluded(a)
        })
    }

    /// What makes the virtual servers `keys` (as just read into `actual`) what they should be:
    /// the diff of those keys alone (owned ones only are deleted), with graceful termination.
    /// Used by the targeted repairs and the drift check's slices.
    pub(super) fn ops_for_keys(
        &mut self,
        keys: &BTreeSet<ServiceKey>,
        actual: &IpvsTable,
    ) -> IpvsOps {
        let desired = self.desired.ipvs_table_for(keys);
        let ops = {
            let owned = owned_by_proxy(&self.cfg);
            let only_keys = |k: &ServiceKey| keys.contains(k) && owned(k);
            diff_ipvs(&desired, actual, &only_keys)
        };
        self.graceful(ops, Some(actual))
    }

    /// Re-reads the virtual servers whose operations failed and applies what still differs.
    pub(super) fn retry_repairs(&mut self, kernel: &mut dyn Kernel, report: &mut SyncReport) {
        let keys = std::mem::take(&mut self.repair);
        let actual = match kernel.read_ipvs_keys(&keys) {
            Ok(t) => t,
            Err(e) => {
                report.fail(Subsystem::Ipvs, e.to_string());
                self.repair = keys;
                self.retry.ipvs.failed(self.now);
                return;
            }
        };
        // A repair honours graceful termination exactly as a sync does: a real server that
        // left drains at weight 0 (its weight set to 0 again when the failed request was that
        // one), never deleted with live connections.
        let ops = self.ops_for_keys(&keys, &actual);
        let failures_before = report.ipvs_failures;
        // The kernel was re-read: a definite error now is a refusal (see `refusal`).
        self.repairing = true;
        self.apply_ipvs(&ops.apply, kernel, report);
        self.apply_ipvs(&ops.remove, kernel, report);
        self.repairing = false;
        if report.ipvs_failures > failures_before {
            self.retry.ipvs.failed(self.now);
        } else if self.repair.is_empty() {
            self.retry.ipvs.succeeded();
        }
    }
}
