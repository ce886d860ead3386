//! The sync loop's observer: sync reports become metrics, `/healthz` state, health-check node
//! ports and (rate-limited) Events about rejected objects; the loop's steps become `/livez`.

use super::*;

/// Feeds metrics, health and health-check node ports from the sync loop.
pub struct Observer {
    /// Metrics.
    pub metrics: Arc<Metrics>,
    /// `/healthz` state.
    pub health: Arc<ProxyHealth>,
    /// Health-check node ports.
    pub service_health: Arc<ServiceHealthServer>,
    /// Runtime for the listener updates.
    pub rt: tokio::runtime::Handle,
    /// Where newly rejected objects go to become Kubernetes Events, deduplicated and rate
    /// limited (None: log + metric only, e.g. with `--source-dir`).
    pub rejections: Option<crate::events::EventSink>,
    /// `(key, reason)` already reported, so dual-stack nodes report a rejection once.
    pub reported: std::sync::Mutex<std::collections::HashSet<(String, String)>>,
    /// What each family's last sync reported, for the node-wide values that sum or merge them.
    pub seen: std::sync::Mutex<BTreeMap<Family, FamilySeen>>,
    /// Told about every sync, so the other mode's leftovers go only after this mode's first
    /// successful sync (see [`crate::handover`]).
    pub first_sync: Option<Arc<crate::handover::FirstSync>>,
}

/// One family's last reported values (see [`Observer::seen`]).
#[derive(Debug, Default)]
pub struct FamilySeen {
    /// Drain totals already counted: (drained, cap) (the proxier keeps running totals).
    drained: (u64, u64),
    /// Ports without local endpoints: (internal, external).
    no_local: (usize, usize),
    /// Health-check node ports: a node port is served while either family wants it (a
    /// single-stack Service on a dual-stack node is in one family only).
    health: BTreeMap<ServiceName, HealthCheck>,
    /// External VIP claims lost to another Service.
    vip_conflicts: usize,
    /// External claims on node addresses the node keeps.
    node_address_conflicts: desired::vip::NodeConflicts,
    /// IPVS requests already counted (the kernel keeps running totals per command).
    ipvs_requests: ipvs_netlink::OpCounts,
    /// IPVS virtual servers and real servers programmed.
    ipvs_programmed: (usize, usize),
    /// Services isolated because the kernel refuses their programming.
    refused: usize,
}

/// The Event on a Service whose programming the kernel refuses: reason `KernelRefused`,
/// action `Program` (fixed words); the note names the subsystem and the kernel's answer
/// (sanitized and cut by the sink).
pub fn refusal_event(r: &Refusal) -> crate::events::EventRequest {
    crate::events::EventRequest {
        regarding: crate::events::Regarding {
            api_version: "v1",
            kind: "Service",
            namespace: Some(r.service.namespace.to_string()),
            name: r.service.name.to_string(),
        },
        reason: "KernelRefused",
        action: "Program",
        note: format!(
            "the kernel refuses this Service's {} programming ({}): {}; what the node holds \
             for it is kept and it is retried with backoff",
            r.subsystem.as_str(),
            r.reason,
            r.error
        ),
    }
}

/// An object skipped as invalid, to be reported as a Kubernetes Event.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rejection {
    /// `Service` or `EndpointSlice`.
    pub kind: String,
    /// Namespace.
    pub namespace: String,
    /// Name.
    pub name: String,
    /// Why it was skipped (the model's reason).
    pub reason: String,
}

impl Rejection {
    /// The Event reporting this rejection (`InvalidObject`, action `Skip`; the note is
    /// sanitized by the sink). A VIP conflict is reported as `VIPConflict`, a claim on a node
    /// address the node keeps as `NodeAddressConflict`.
    pub fn event(&self) -> crate::events::EventRequest {
        let (api_version, kind) = match self.kind.as_str() {
            "EndpointSlice" => ("discovery.k8s.io/v1", "EndpointSlice"),
            _ => ("v1", "Service"),
        };
        let conflict = self.reason.starts_with(desired::vip::CONFLICT_PREFIX);
        let node_conflict = self.reason.starts_with(desired::vip::NODE_CONFLICT_PREFIX);
        let partial = self.reason.starts_with(model::IGNORED_PREFIX);
        let (reason, action, note) = if conflict {
            ("VIPConflict", "Skip", "kube-ipvs skipped this object")
        } else if node_conflict {
            (
                "NodeAddressConflict",
                "Skip",
                "kube-ipvs skipped this object",
            )
        } else if partial {
            // The object is programmed without the values the reason names.
            (
                "InvalidField",
                "Ignore",
                "kube-ipvs programs this object without some values",
            )
        } else {
            ("InvalidObject", "Skip", "kube-ipvs skipped this object")
        };
        crate::events::EventRequest {
            regarding: crate::events::Regarding {
                api_version,
                kind,
                namespace: Some(self.namespace.clone()),
                name: self.name.clone(),
            },
            reason,
            action,
            note: format!("{note}: {}", self.reason),
        }
    }

    /// Splits a rejection key (`service ns/name`, `vip ns/name`, `fields ns/name`,
    /// `endpointslice ns/name`) and a reason.
    pub fn from_key(key: &str, reason: &str) -> Option<Rejection> {
        let (kind, rest) = key.split_once(' ')?;
        let kind = match kind {
            "service" | "vip" | "nodeaddress" | "fields" | "hairpin" => "Service",
            "endpointslice" => "EndpointSlice",
            _ => return None,
        };
        let (namespace, name) = rest.split_once('/')?;
        Some(Rejection {
            kind: kind.to_string(),
            namespace: namespace.to_string(),
            name: name.to_string(),
            reason: reason.to_string(),
        })
    }
}

/// The fixed set of `reason` labels of `kube_ipvs_invalid_objects_total`: the model's reasons
/// with their values removed (see [`reason_label`]). Anything else is `other`, so user text can
/// never create a new series.
pub const INVALID_REASON_LABELS: &[&str] = &[
    "affinity_timeout_out_of_range",
    "cannot_be_decoded",
    "clusterips",
    "duplicate_endpoint_port",
    "duplicate_nodeport",
    "duplicate_port",
    "duplicate_port_name",
    "endpoint_port_out_of_range",
    "endpoint_with_addresses",
    "hairpin_members_left_out",
    "healthchecknodeport_out_of_range",
    "ignored_endpoint_address_of_another_family",
    "ignored_endpoint_with_invalid_address",
    "ignored_endpoint_without_addresses",
    "ignored_invalid_externalip",
    "ignored_invalid_loadbalancer_ingress_ip",
    "ignored_invalid_loadbalancersourcerange",
    "invalid_clusterip",
    "node_address_conflict",
    "nodeport_out_of_range",
    "over_the_ipsetmember_budget",
    "over_the_realserver_budget",
    "over_the_virtualserver_budget",
    "port_out_of_range",
    "ports",
    "service_port_would_exceed_endpoints",
    "service_without_a_name",
    "too_many_endpoints",
    "too_many_external_and_loadbalancer_ips",
    "too_many_loadbalancersourceranges",
    "too_many_ports",
    "unknown_addresstype",
    "unknown_externaltrafficpolicy",
    "unknown_internaltrafficpolicy",
    "unknown_protocol",
    "unknown_scheduler_in_annotation",
    "unknown_service_type",
    "unknown_sessionaffinity",
    "vip_conflict",
    "would_overfill_an_ipset",
    "other",
];

/// A bounded-cardinality metric label for a rejection reason: its words without values
/// (quoted strings, numbers, addresses), e.g. `port 70000 out of range 1..65535` →
/// `port_out_of_range`, `invalid clusterIP "1.2.3"` → `invalid_clusterip`,
/// `10000 endpoints (max 1000)` → `too_many_endpoints`; always one of
/// [`INVALID_REASON_LABELS`] (`other` for anything unknown, e.g. a quoted value with spaces).
pub fn reason_label(reason: &str) -> &'static str {
    if reason.starts_with(desired::vip::CONFLICT_PREFIX) {
        return "vip_conflict";
    }
    if reason.starts_with(desired::vip::NODE_CONFLICT_PREFIX) {
        return "node_address_conflict";
    }
    // `cannot be decoded: <field path>: <serde error>` (`watch::lenient`): the rest is input.
    if reason.starts_with(model::UNDECODABLE_PREFIX) {
        return "cannot_be_decoded";
    }
    let words: Vec<String> = reason
        .split_whitespace()
        .take_while(|w| !w.starts_with('('))
        .filter(|w| !w.contains('"') && !w.chars().any(|c| c.is_ascii_digit()))
        .map(|w| {
            w.chars()
                .filter(|c| c.is_ascii_alphanumeric())
                .collect::<String>()
                .to_ascii_lowercase()
        })
        .filter(|w| !w.is_empty())
        .take(6)
        .collect();
    let mut label = words.join("_");
    if reason.contains("(max ") {
        label = format!("too_many_{label}");
    }
    if label.starts_with("unknown_scheduler_in_annotation") {
        return "unknown_scheduler_in_annotation";
    }
    INVALID_REASON_LABELS
        .iter()
        .find(|l| **l == label)
        .copied()
        .unwrap_or("other")
}

/// The node names of the endpoints of every Service's EndpointSlices: the nodes that may write
/// Events about objects (see [`crate::events`]). The same on every node with the same store.
pub fn endpoint_nodes(store: &Store) -> crate::events::Candidates {
    let mut names: std::collections::HashSet<&str> = std::collections::HashSet::new();
    for service in store.service_names() {
        for slice in store.slices_of(service) {
            names.extend(
                slice
                    .endpoints
                    .iter()
                    .filter_map(|e| e.node_name())
                    .map(|n| &**n),
            );
        }
    }
    crate::events::Candidates::new(names)
}

impl std::fmt::Debug for Observer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Observer").finish_non_exhaustive()
    }
}

impl SyncObserver for Observer {
    fn queued(&self, changes: &Changes) {
        if !changes.dirty.is_empty() || changes.node_changed {
            self.metrics.record_queued(Family::Inet);
            self.metrics.record_queued(Family::Inet6);
            self.health.queued_update(Family::Inet);
            self.health.queued_update(Family::Inet6);
        }
    }

    fn pending(&self, services: usize, endpoints: usize) {
        self.metrics.service_changes_pending.set(services as i64);
        self.metrics.endpoint_changes_pending.set(endpoints as i64);
    }

    fn synced(&self, family: Family, report: &SyncReport, backend: &dyn Backend) {
        if let Some(first) = &self.first_sync {
            first.record(family, report.healthy());
        }
        // Labels come from the report's fixed subsystem set, never from error text.
        for (subsystem, f) in &report.failed {
            let label = crate::metrics::SubsystemLabel {
                subsystem: subsystem.as_str().to_string(),
            };
            self.metrics
                .sync_errors_total
                .get_or_create(&label)
                .inc_by(f.count as u64);
            self.metrics.sync_failures_total.get_or_create(&label).inc();
        }
        let mut failing = report.retrying.clone();
        failing.extend(report.failed.keys().copied());
        self.metrics.record_sync_outcome(
            family,
            report.kind,
            report.duration.as_secs_f64(),
            &failing,
        );
        if report.healthy() {
            self.health.updated(family);
        } else {
            // A failed sync is not an update: /healthz and the health-check node ports turn
            // 503 if this lasts for the health timeout, naming the subsystems (/livez does not:
            // the loop is making progress).
            let failed: Vec<(&'static str, String)> = report
                .failed
                .iter()
                .map(|(s, f)| (s.as_str(), f.last_error.clone()))
                .collect();
            let retrying: Vec<&'static str> = failing.iter().map(|s| s.as_str()).collect();
            self.health
                .sync_failed_at(family, &failed, &retrying, std::time::SystemTime::now());
        }
        for (subsystem, n) in &report.drift {
            self.metrics
                .drift_repairs_total
                .get_or_create(&crate::metrics::SubsystemLabel {
                    subsystem: (*subsystem).to_string(),
                })
                .inc_by(*n as u64);
        }
        if report.iptables_restore_failed {
            self.metrics
                .iptables_restore_failures_total
                .get_or_create(&crate::metrics::IpFamilyLabel::of(family))
                .inc();
        }
        self.metrics
            .draining_destinations
            .set(backend.draining() as i64);
        self.metrics.record_conntrack(
            family,
            report.conntrack_duration.map(|d| d.as_secs_f64()),
            report.conntrack_deleted,
        );
        // The values are plain counters and maps: a panic elsewhere cannot leave them torn.
        let mut seen = self.seen.lock().unwrap_or_else(|p| p.into_inner());
        let this = seen.entry(family).or_default();
        // Every IPVS request of this family's kernel since the last sync (the sync's reads and
        // writes, and the drain checks' reads), by command.
        let requests = backend.ipvs_requests();
        for (op, now) in requests.iter() {
            let was = this.ipvs_requests.get(op);
            if now > was {
                self.metrics.record_ipvs_requests(op, now - was);
            }
        }
        this.ipvs_requests = requests;
        this.ipvs_programmed = backend.ipvs_programmed();
        this.refused = backend.refused_services();
        let refused: usize = seen.values().map(|f| f.refused).sum();
        self.metrics
            .refused_services
            .set(i64::try_from(refused).unwrap_or(i64::MAX));
        let (services, destinations) = seen.values().fold((0, 0), |(s, d), f| {
            (s + f.ipvs_programmed.0, d + f.ipvs_programmed.1)
        });
        self.metrics
            .ipvs_services
            .set(i64::try_from(services).unwrap_or(i64::MAX));
        self.metrics
            .ipvs_destinations
            .set(i64::try_from(destinations).unwrap_or(i64::MAX));
        let this = seen.entry(family).or_default();
        let (drained, cap) = backend.drained();
        let before = std::mem::replace(&mut this.drained, (drained, cap));
        for (reason, now, was) in [("drained", drained, before.0), ("cap", cap, before.1)] {
            if now > was {
                self.metrics
                    .drained_destinations_total
                    .get_or_create(&crate::metrics::ReasonLabel {
                        reason: reason.to_string(),
                    })
                    .inc_by(now - was);
            }
        }
        this.no_local = backend.no_local_endpoints();
        this.health = backend.health_checks();
        this.vip_conflicts = report.vip_conflicts;
        let conflicts: usize = seen.values().map(|f| f.vip_conflicts).sum();
        self.metrics
            .vip_conflicts
            .set(i64::try_from(conflicts).unwrap_or(i64::MAX));
        this_node_address_conflicts(&mut seen, family, report, &self.metrics);
        for (f, v) in seen.iter() {
            self.metrics
                .set_no_local_endpoints(*f, v.no_local.0, v.no_local.1);
        }
        let mut merged: BTreeMap<ServiceName, HealthCheck> = BTreeMap::new();
        for (name, hc) in seen.values().flat_map(|f| &f.health) {
            merged
                .entry(name.clone())
                .and_modify(|h| *h = h.merge(*hc))
                .or_insert(*hc);
        }
        drop(seen);
        let wanted: BTreeMap<u16, HealthCheckService> = merged
            .into_iter()
            .map(|(name, hc)| {
                (
                    hc.node_port,
                    HealthCheckService {
                        service: NamespacedName::new(&*name.namespace, &*name.name),
                        local_endpoints: hc.local_endpoints,
                    },
                )
            })
            .collect();
        self.metrics
            .health_check_node_ports
            .set(wanted.len() as i64);
        let sh = self.service_health.clone();
        self.rt.spawn(async move {
            for e in sh.sync_services(&wanted).await {
                tracing::warn!(error = %e, "health-check node port");
            }
        });
    }

    fn network_programmed(&self, family: Family, triggers: &[std::time::SystemTime]) {
        self.metrics.record_network_programmed(family, triggers);
    }

    fn waiting(&self, until: std::time::Instant) {
        self.health.loop_waiting(until);
    }

    fn working(&self) {
        self.health.loop_working_at(std::time::Instant::now());
    }

    fn refused(&self, _family: Family, refused: &[Refusal]) {
        for r in refused {
            self.metrics
                .kernel_refusals_total
                .get_or_create(&crate::metrics::RefusalLabels {
                    subsystem: r.subsystem.as_str().to_string(),
                    reason: r.reason.to_string(),
                })
                .inc();
            if let Some(sink) = &self.rejections {
                sink.submit(refusal_event(r));
            }
        }
    }

    fn rejected(&self, _family: Family, rejected: &[(String, String)], store: &Store) {
        let mut reported = match self.reported.lock() {
            Ok(g) => g,
            Err(p) => p.into_inner(),
        };
        // The nodes that may write Events (built once, when a new rejection needs one).
        let mut candidates: Option<crate::events::Candidates> = None;
        for (key, reason) in rejected {
            // Both families see the same objects; report each (object, reason) once. The set
            // is bounded: past 10,000 entries it starts over (a repeat is reported again).
            if reported.len() >= 10_000 {
                reported.clear();
            }
            if !reported.insert((key.clone(), reason.clone())) {
                continue;
            }
            let Some(r) = Rejection::from_key(key, reason) else {
                continue;
            };
            self.metrics
                .invalid_objects_total
                .get_or_create(&crate::metrics::InvalidObjectLabels {
                    kind: r.kind.clone(),
                    reason: reason_label(reason).to_string(),
                })
                .inc();
            if let Some(sink) = &self.rejections {
                let c = candidates.get_or_insert_with(|| endpoint_nodes(store));
                sink.submit_among(r.event(), c);
            }
        }
    }
}

/// Records one family's node-address conflicts and sets the node-wide gauge (both families
/// summed), one series per fixed reason.
fn this_node_address_conflicts(
    seen: &mut BTreeMap<Family, FamilySeen>,
    family: Family,
    report: &SyncReport,
    metrics: &Metrics,
) {
    seen.entry(family).or_default().node_address_conflicts = report.node_address_conflicts;
    let sum = seen
        .values()
        .fold(desired::vip::NodeConflicts::default(), |a, f| {
            a.plus(f.node_address_conflicts)
        });
    for (reason, n) in sum.by_reason() {
        metrics
            .node_address_conflicts
            .get_or_create(&crate::metrics::ReasonLabel {
                reason: reason.to_string(),
            })
            .set(i64::try_from(n).unwrap_or(i64::MAX));
    }
}

#[cfg(test)]
mod node_address_tests {
    use super::*;

    /// A node-address conflict (rejection key `nodeaddress ns/name`) is an Event on the
    /// Service with its own fixed reason word and a fixed metric label, not a VIP conflict.
    #[test]
    fn a_node_address_conflict_is_its_own_event_reason_and_label() {
        let lost = std::collections::BTreeMap::from([(
            desired::vip::Vip {
                ip: std::net::Ipv4Addr::new(192, 168, 0, 10).into(),
                port: 10250,
                protocol: ipvs_netlink::Protocol::Tcp,
            },
            desired::vip::NodeLoss::Protected,
        )]);
        let why = desired::vip::node_conflict_reason(&lost).map(|i| i.reason);
        let why = why.as_deref().unwrap_or_default();
        let r = Rejection::from_key("nodeaddress aa/kubelet", why);
        let ev = r.as_ref().map(|r| r.event());
        assert_eq!(ev.as_ref().map(|e| e.reason), Some("NodeAddressConflict"));
        assert_eq!(
            ev.as_ref().map(|e| e.regarding.kind),
            Some("Service"),
            "{ev:?}"
        );
        assert!(
            ev.is_some_and(|e| e
                .note
                .contains("192.168.0.10:10250/TCP is a protected node port")),
            "{why}"
        );
        assert_eq!(reason_label(why), "node_address_conflict");
        assert!(INVALID_REASON_LABELS.contains(&"node_address_conflict"));
    }

    /// A Service the source could not decode gets one fixed label, whatever the error says.
    #[test]
    fn an_undecodable_service_has_one_reason_label() {
        for why in [
            "cannot be decoded: status.loadBalancer.ingress: invalid type: string \"x\"",
            "cannot be decoded: spec.ports[0].port: invalid value: integer `-1`, expected i32",
        ] {
            assert_eq!(reason_label(why), "cannot_be_decoded", "{why}");
        }
        assert!(INVALID_REASON_LABELS.contains(&"cannot_be_decoded"));
    }

    /// The gauge sums the families and keeps one series per fixed reason.
    #[test]
    fn node_address_conflicts_are_summed_over_families() {
        let metrics = Metrics::new();
        let mut seen = BTreeMap::new();
        let mut report = SyncReport::new(proxier::ipvs_mode::SyncKind::Full);
        report.node_address_conflicts = desired::vip::NodeConflicts {
            node_port: 2,
            protected_port: 1,
            refused: 0,
        };
        this_node_address_conflicts(&mut seen, Family::Inet, &report, &metrics);
        report.node_address_conflicts.node_port = 1;
        this_node_address_conflicts(&mut seen, Family::Inet6, &report, &metrics);
        let text = metrics.encode().unwrap_or_default();
        for line in [
            "kube_ipvs_node_address_conflicts{reason=\"node_port\"} 3",
            "kube_ipvs_node_address_conflicts{reason=\"protected_port\"} 2",
            "kube_ipvs_node_address_conflicts{reason=\"refused\"} 0",
        ] {
            assert!(text.contains(line), "{line}:\n{text}");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn event(key: &str, reason: &str) -> crate::events::EventRequest {
        Rejection::from_key(key, reason).unwrap().event()
    }

    #[test]
    fn each_kind_of_rejection_gets_its_event() {
        let e = event("service ns/a", "port 0 out of range 1..65535");
        assert_eq!(
            (e.reason, e.action, e.regarding.kind),
            ("InvalidObject", "Skip", "Service")
        );
        // A partial rejection: the object is programmed without the values named.
        let e = event("fields ns/a", "ignored invalid externalIP \"x\"");
        assert_eq!(
            (
                e.reason,
                e.action,
                e.regarding.kind,
                e.regarding.name.as_str()
            ),
            ("InvalidField", "Ignore", "Service", "a")
        );
        assert!(
            e.note.ends_with(": ignored invalid externalIP \"x\""),
            "{}",
            e.note
        );
        let e = event(
            "endpointslice ns/s",
            "ignored endpoint with invalid address \"y\"",
        );
        assert_eq!(
            (e.reason, e.regarding.kind),
            ("InvalidField", "EndpointSlice")
        );
        let e = event("vip ns/a", "VIP conflict: 1.2.3.4:80/TCP is served by ns/b");
        assert_eq!((e.reason, e.regarding.kind), ("VIPConflict", "Service"));
        let e = event(
            "service ns/a",
            "over the virtual-server budget (70000 virtual servers)",
        );
        assert_eq!(e.reason, "InvalidObject");
        assert!(Rejection::from_key("other ns/a", "x").is_none());
    }
}
