//! Graceful termination: real servers of TCP and SCTP services drain (weight 0) until their
//! connections end or the drain times out; UDP real servers go at once with their conntrack
//! entries flushed.

use super::*;

impl Proxier {
    /// Turns real-server deletions into drains and re-additions of draining real servers
    /// into weight restores. `actual` is the kernel's table when known (full sync).
    pub(super) fn graceful(&mut self, mut ops: IpvsOps, actual: Option<&IpvsTable>) -> IpvsOps {
        self.graceful_apply(&mut ops.apply, actual);
        self.graceful_remove(&ops.remove);
        ops
    }

    /// [`Proxier::graceful`] of step 2's operations (creates, updates, real-server deletions),
    /// in place: a full program is ~N x M operations, and a second vector of them would double
    /// the sync's peak memory. Each operation is decided on its own, so a program may pass
    /// through here in consecutive parts.
    pub(super) fn graceful_apply(&mut self, ops: &mut Vec<Op>, actual: Option<&IpvsTable>) {
        let now = Instant::now();
        let enabled = self.drain.enabled;
        let draining = &mut self.draining;
        let stats = &mut self.drain_stats;
        ops.retain_mut(|op| match op {
            Op::DelDest(k, a, p) if enabled && drains(k) => {
                let key = (*k, *a, *p);
                let weight = actual
                    .and_then(|t| t.get(&key.0))
                    .and_then(|vs| vs.real_servers.get(&(key.1, key.2)))
                    .map(|d| d.weight);
                match draining.entry(key) {
                    // Already draining: the drain check deletes it. Unless the kernel shows it
                    // still taking new connections (the weight-0 request failed, or someone
                    // reset it): then the weight goes to 0 again, never a delete.
                    std::collections::btree_map::Entry::Occupied(_) => {
                        if weight.is_none_or(|w| w == 0) {
                            return false;
                        }
                    }
                    std::collections::btree_map::Entry::Vacant(v) => {
                        v.insert(now);
                        if weight == Some(0) {
                            return false;
                        }
                    }
                }
                let mut d = Destination::new(key.1, key.2);
                d.weight = 0;
                *op = Op::SetDest(key.0, d);
                true
            }
            Op::NewDest(k, d) => {
                if draining.remove(&(*k, d.addr, d.port)).is_some() {
                    stats.restored += 1;
                    if let Op::NewDest(k, d) = std::mem::replace(op, Op::Flush) {
                        *op = Op::SetDest(k, d);
                    }
                }
                true
            }
            Op::SetDest(k, d) => {
                // Wanted again (e.g. a weight 0 left by a previous run): no longer draining.
                if draining.remove(&(*k, d.addr, d.port)).is_some() {
                    stats.restored += 1;
                }
                true
            }
            _ => true,
        });
        self.schedule_drain_check(now);
    }

    /// [`Proxier::graceful`] of step 5's deletions: a deleted virtual server's real servers
    /// are no longer draining.
    pub(super) fn graceful_remove(&mut self, ops: &[Op]) {
        for op in ops {
            if let Op::DelService(k) = op {
                self.draining.retain(|(dk, _, _), _| dk != k);
            }
        }
        self.schedule_drain_check(Instant::now());
    }

    /// The next drain check is due an interval after the first real server started draining.
    fn schedule_drain_check(&mut self, now: Instant) {
        if self.draining.is_empty() {
            self.drain_due = None;
        } else if self.drain_due.is_none() {
            self.drain_due = Some(now + self.drain.interval);
        }
    }

    /// Reads only the virtual servers with draining real servers and deletes those whose
    /// connections are gone (or whose cap passed).
    pub(super) fn check_drains(&mut self, kernel: &mut dyn Kernel, report: &mut SyncReport) {
        let now = Instant::now();
        let keys: BTreeSet<ServiceKey> = self.draining.keys().map(|(k, _, _)| *k).collect();
        let actual = match kernel.read_ipvs_keys(&keys) {
            Ok(t) => t,
            Err(e) => {
                report.fail(Subsystem::Ipvs, e.to_string());
                self.drain_due = Some(now + self.drain.interval);
                return;
            }
        };
        let mut ops = Vec::new();
        let mut done = Vec::new();
        for (&(k, a, p), &since) in &self.draining {
            let Some(d) = actual.get(&k).and_then(|vs| vs.real_servers.get(&(a, p))) else {
                done.push((k, a, p)); // gone already (deleted behind our back, or its service)
                continue;
            };
            if d.active_conns == 0 {
                self.drain_stats.removed_drained += 1;
            } else if now.duration_since(since) >= self.drain.cap {
                self.drain_stats.removed_cap += 1;
                tracing::info!(real_server = %format!("{a}:{p}"), active = d.active_conns,
                    "drain cap reached; deleting real server with live connections");
            } else {
                continue;
            }
            ops.push(Op::DelDest(k, a, p));
            done.push((k, a, p));
        }
        for d in done {
            self.draining.remove(&d);
        }
        report.drained += ops.len();
        self.apply_ipvs(&ops, kernel, report);
        self.drain_due = if self.draining.is_empty() {
            None
        } else {
            Some(now + self.drain.interval)
        };
    }

    /// UDP virtual servers of `names` and whether each has real servers.
    pub(super) fn udp_with_reals<'a>(
        &self,
        names: impl Iterator<Item = &'a ServiceName>,
    ) -> BTreeMap<ServiceKey, bool> {
        let mut out = BTreeMap::new();
        for n in names {
            if let Some(sd) = self.desired.service(n) {
                for (k, vs) in &sd.virtual_servers {
                    if !drains(k) {
                        out.insert(*k, !vs.real_servers.is_empty());
                    }
                }
            }
        }
        out
    }

    /// Deletes the stale UDP conntrack entries this sync's changes (and earlier failed
    /// cleanups) left behind (the caller runs it only when there are some). On failure the
    /// filters are kept and retried with backoff.
    pub(super) fn flush_conntrack(&mut self, kernel: &mut dyn Kernel, report: &mut SyncReport) {
        let mut filters = std::mem::take(&mut self.conntrack);
        let mut seen = std::collections::HashSet::new();
        filters.retain(|f| seen.insert(*f));
        let started = Instant::now();
        let result = kernel.delete_conntrack(&filters);
        report.conntrack_duration = Some(started.elapsed());
        match result {
            Ok(n) => {
                report.conntrack_deleted += n;
                self.retry.conntrack.succeeded();
            }
            Err(e) => {
                let delay = self.retry.conntrack.failed(self.now);
                tracing::warn!(error = %e, filters = filters.len(),
                    retry_in_ms = delay.as_millis() as u64,
                    "conntrack cleanup failed; keeping the filters and retrying with backoff");
                report.fail(Subsystem::Conntrack, e.to_string());
                // Bounded: one filter per (VIP, port[, endpoint]) the proxier programs.
                self.conntrack = filters;
            }
        }
    }
}
