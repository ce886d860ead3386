//! Creating and registering every metric, under upstream's names and help texts.

use super::labels::{network_programming_histogram, sync_histogram};
use super::*;

impl Metrics {
    /// Creates and registers every metric.
    pub fn new() -> Self {
        let mut r = Registry::default();
        let m = Metrics {
            sync_proxy_rules_duration_seconds: Family::new_with_constructor(sync_histogram),
            sync_full_proxy_rules_duration_seconds: Family::new_with_constructor(sync_histogram),
            sync_partial_proxy_rules_duration_seconds: Family::new_with_constructor(sync_histogram),
            network_programming_duration_seconds: Family::new_with_constructor(
                network_programming_histogram,
            ),
            sync_proxy_rules_last_timestamp_seconds: Family::default(),
            sync_proxy_rules_last_queued_timestamp_seconds: Family::default(),
            endpoint_changes_pending: Gauge::default(),
            endpoint_changes_total: Counter::default(),
            service_changes_pending: Gauge::default(),
            service_changes_total: Counter::default(),
            iptables_restore_failures_total: Family::default(),
            no_local_endpoints_total: Family::default(),
            proxy_healthz_total: Family::default(),
            proxy_livez_total: Family::default(),
            proxy_mode: Family::default(),
            ipvs_probe_failures_total: Family::default(),
            drift_repairs_total: Family::default(),
            sync_errors_total: Family::default(),
            sync_failures_total: Family::default(),
            last_successful_sync_age_seconds: Family::default(),
            last_success: Mutex::new(BTreeMap::new()),
            source_ok: Mutex::new(false),
            invalid_objects_total: Family::default(),
            ipvs_requests_total: Family::default(),
            draining_destinations: Gauge::default(),
            ipvs_services: Gauge::default(),
            ipvs_destinations: Gauge::default(),
            health_check_node_ports: Gauge::default(),
            conntrack_deleted_entries_total: Family::default(),
            conntrack_reconciler_sync_duration_seconds: Family::new_with_constructor(
                sync_histogram,
            ),
            drained_destinations_total: Family::default(),
            events_dropped_total: Family::default(),
            events_published_total: Family::default(),
            vip_conflicts: Gauge::default(),
            node_address_conflicts: Family::default(),
            http_connections_refused_total: Family::default(),
            http_connections_evicted_total: Family::default(),
            kernel_refusals_total: Family::default(),
            refused_services: Gauge::default(),
            node_address_tracking: Gauge::default(),
            node_address_resubscriptions_total: Counter::default(),
            ip_family_served: Family::default(),
            registry: Registry::default(),
        };
        let k = "kubeproxy_";
        r.register(
            format!("{k}sync_proxy_rules_duration_seconds"),
            "SyncProxyRules latency in seconds",
            m.sync_proxy_rules_duration_seconds.clone(),
        );
        r.register(
            format!("{k}sync_full_proxy_rules_duration_seconds"),
            "SyncProxyRules latency in seconds for full resyncs",
            m.sync_full_proxy_rules_duration_seconds.clone(),
        );
        r.register(
            format!("{k}sync_partial_proxy_rules_duration_seconds"),
            "SyncProxyRules latency in seconds for partial resyncs",
            m.sync_partial_proxy_rules_duration_seconds.clone(),
        );
        r.register(
            format!("{k}network_programming_duration_seconds"),
            "In Cluster Network Programming Latency in seconds",
            m.network_programming_duration_seconds.clone(),
        );
        r.register(
            format!("{k}sync_proxy_rules_last_timestamp_seconds"),
            "The last time proxy rules were successfully synced",
            m.sync_proxy_rules_last_timestamp_seconds.clone(),
        );
        r.register(
            format!("{k}sync_proxy_rules_last_queued_timestamp_seconds"),
            "The last time a sync of proxy rules was queued",
            m.sync_proxy_rules_last_queued_timestamp_seconds.clone(),
        );
        r.register(
            format!("{k}sync_proxy_rules_endpoint_changes_pending"),
            "Pending proxy rules Endpoint changes",
            m.endpoint_changes_pending.clone(),
        );
        r.register(
            format!("{k}sync_proxy_rules_endpoint_changes"),
            "Cumulative proxy rules Endpoint changes",
            m.endpoint_changes_total.clone(),
        );
        r.register(
            format!("{k}sync_proxy_rules_service_changes_pending"),
            "Pending proxy rules Service changes",
            m.service_changes_pending.clone(),
        );
        r.register(
            format!("{k}sync_proxy_rules_service_changes"),
            "Cumulative proxy rules Service changes",
            m.service_changes_total.clone(),
        );
        r.register(
            format!("{k}sync_proxy_rules_iptables_restore_failures"),
            "Cumulative proxy iptables restore failures",
            m.iptables_restore_failures_total.clone(),
        );
        r.register(
            format!("{k}sync_proxy_rules_no_local_endpoints_total"),
            "Number of services with a Local traffic policy and no endpoints",
            m.no_local_endpoints_total.clone(),
        );
        r.register(
            format!("{k}proxy_healthz"),
            "Cumulative proxy healthz HTTP status",
            m.proxy_healthz_total.clone(),
        );
        r.register(
            format!("{k}proxy_livez"),
            "Cumulative proxy livez HTTP status",
            m.proxy_livez_total.clone(),
        );
        r.register(
            format!("{k}conntrack_reconciler_deleted_entries"),
            "Stale conntrack entries deleted (UDP flows to removed endpoints or to services that had none)",
            m.conntrack_deleted_entries_total.clone(),
        );
        r.register(
            format!("{k}conntrack_reconciler_sync_duration_seconds"),
            "ReconcileConntrackFlowsLatency latency in seconds",
            m.conntrack_reconciler_sync_duration_seconds.clone(),
        );
        let o = "kube_ipvs_";
        for reason in ["drained", "cap"] {
            // Both series exist from the start (0), so rate() and alerts see them.
            m.drained_destinations_total
                .get_or_create(&ReasonLabel {
                    reason: reason.to_string(),
                })
                .inc_by(0);
        }
        r.register(
            format!("{o}drained_destinations"),
            "Draining real servers deleted, by reason: last connection ended (drained) or drain cap passed (cap)",
            m.drained_destinations_total.clone(),
        );
        for kind in crate::probe::kinds() {
            // Every series exists from the start (0), so increase() and alerts see the first.
            m.ipvs_probe_failures_total
                .get_or_create(&ProbeKindLabel {
                    kind: kind.to_string(),
                })
                .inc_by(0);
        }
        r.register(
            format!("{o}ipvs_probe_failures"),
            "Failed IPVS probes at start, by kind (transient ones are retried with backoff)",
            m.ipvs_probe_failures_total.clone(),
        );
        r.register(
            format!("{o}proxy_mode"),
            "Proxy mode in use (1 for the active mode)",
            m.proxy_mode.clone(),
        );
        r.register(
            format!("{o}drift_repairs"),
            "Kernel state found changed by someone else and repaired",
            m.drift_repairs_total.clone(),
        );
        r.register(
            format!("{o}sync_errors"),
            "Failed apply operations (the affected services are retried)",
            m.sync_errors_total.clone(),
        );
        r.register(
            format!("{o}sync_failures"),
            "Syncs in which a subsystem failed (retried with backoff), by subsystem",
            m.sync_failures_total.clone(),
        );
        r.register(
            format!("{o}last_successful_sync_age_seconds"),
            "Seconds since the subsystem was last in sync (worst address family); grows while it fails",
            m.last_successful_sync_age_seconds.clone(),
        );
        let start = Instant::now();
        if let Ok(mut last) = m.last_success.lock() {
            for sub in Subsystem::ALL {
                // Every series exists from the start (0), so rate() and alerts see them.
                let label = SubsystemLabel {
                    subsystem: sub.as_str().to_string(),
                };
                m.sync_failures_total.get_or_create(&label).inc_by(0);
                m.sync_errors_total.get_or_create(&label).inc_by(0);
                if sub != Subsystem::Sysctl {
                    // Ages count from the start until the first success.
                    last.insert((0, sub), start);
                }
            }
        }
        r.register(
            format!("{o}invalid_objects"),
            "Objects skipped because they are invalid",
            m.invalid_objects_total.clone(),
        );
        r.register(
            format!("{o}ipvs_requests"),
            "IPVS netlink requests sent",
            m.ipvs_requests_total.clone(),
        );
        r.register(
            format!("{o}draining_destinations"),
            "Real servers at weight 0 waiting for their connections to end",
            m.draining_destinations.clone(),
        );
        r.register(
            format!("{o}ipvs_services"),
            "IPVS virtual servers programmed",
            m.ipvs_services.clone(),
        );
        r.register(
            format!("{o}ipvs_destinations"),
            "IPVS real servers programmed",
            m.ipvs_destinations.clone(),
        );
        r.register(
            format!("{o}health_check_node_ports"),
            "Health check node port listeners open",
            m.health_check_node_ports.clone(),
        );
        for reason in EVENT_DROP_REASONS {
            m.events_dropped_total
                .get_or_create(&ReasonLabel {
                    reason: reason.to_string(),
                })
                .inc_by(0);
        }
        r.register(
            format!("{o}events_dropped"),
            "Kubernetes Events held back: delegated (another node reports it), duplicate, rate_limited, queue_full, closed",
            m.events_dropped_total.clone(),
        );
        for result in ["ok", "error"] {
            m.events_published_total
                .get_or_create(&ResultLabel {
                    result: result.to_string(),
                })
                .inc_by(0);
        }
        r.register(
            format!("{o}events_published"),
            "Kubernetes Events sent to the API server, by result",
            m.events_published_total.clone(),
        );
        for server in HTTP_SERVERS.iter().filter(|s| **s != "other") {
            for reason in HTTP_REFUSE_REASONS {
                m.http_connections_refused_total
                    .get_or_create(&HttpRefusedLabels {
                        server: server.to_string(),
                        reason: reason.to_string(),
                    })
                    .inc_by(0);
            }
            m.http_connections_evicted_total
                .get_or_create(&ServerLabel {
                    server: server.to_string(),
                })
                .inc_by(0);
        }
        r.register(
            format!("{o}http_connections_refused"),
            "HTTP connections closed at once: per_source (the source's cap) or total (server full)",
            m.http_connections_refused_total.clone(),
        );
        r.register(
            format!("{o}http_connections_evicted"),
            "HTTP connections closed to admit one from a source holding fewer (server full)",
            m.http_connections_evicted_total.clone(),
        );
        r.register(
            format!("{o}vip_conflicts"),
            "externalIP / load-balancer IP claims (IP, port, protocol) lost to an older Service or a ClusterIP",
            m.vip_conflicts.clone(),
        );
        for reason in ["node_port", "protected_port", "refused"] {
            // Every series exists from the start (0), so alerts see them.
            m.node_address_conflicts
                .get_or_create(&ReasonLabel {
                    reason: reason.to_string(),
                })
                .set(0);
        }
        r.register(
            format!("{o}node_address_conflicts"),
            "externalIP / load-balancer IP claims on this node's addresses not served: the node keeps the address and port (node_port, protected_port) or refuses node addresses (refused)",
            m.node_address_conflicts.clone(),
        );
        for (subsystem, reason) in proxier::ipvs_mode::refusal_labels() {
            // Every series exists from the start (0), so rate() and alerts see them.
            m.kernel_refusals_total
                .get_or_create(&RefusalLabels {
                    subsystem: subsystem.as_str().to_string(),
                    reason: reason.to_string(),
                })
                .inc_by(0);
        }
        r.register(
            format!("{o}kernel_refusals"),
            "Services isolated because the kernel refused their programming (what it holds for them is kept; retried with backoff), by subsystem and answer",
            m.kernel_refusals_total.clone(),
        );
        r.register(
            format!("{o}refused_services"),
            "Services isolated now because the kernel refuses their programming (both families)",
            m.refused_services.clone(),
        );
        r.register(
            format!("{o}node_address_tracking"),
            "1 while the node-address tracker follows rtnetlink changes; 0 while it does not (the last known addresses, or the Node object's, are used)",
            m.node_address_tracking.clone(),
        );
        r.register(
            format!("{o}node_address_resubscriptions"),
            "Subscriptions of the node-address tracker after a failure or the end of its event stream",
            m.node_address_resubscriptions_total.clone(),
        );
        for family in [AddressFamily::Inet, AddressFamily::Inet6] {
            m.set_family_served(family, false);
        }
        r.register(
            format!("{o}ip_family_served"),
            "1 for each IP family served; 0 for a family the node does not support or use (yet)",
            m.ip_family_served.clone(),
        );
        r.register(
            format!("{o}build"),
            "kube-ipvs build information",
            Info::new(vec![(
                "version".to_string(),
                env!("CARGO_PKG_VERSION").to_string(),
            )]),
        );
        for op in ipvs_netlink::OpKind::ALL {
            // Every series exists from the start (0), so rate() and alerts see them.
            m.ipvs_requests_total
                .get_or_create(&OpLabel {
                    op: op.as_str().to_string(),
                })
                .inc_by(0);
        }
        Metrics { registry: r, ..m }
    }
}
