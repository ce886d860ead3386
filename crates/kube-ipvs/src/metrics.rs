//! Prometheus metrics: upstream kube-proxy's names (so dashboards keep working) plus kube-ipvs's.
//!
//! One [`Metrics`] value is created at start and shared as `Arc<Metrics>`; every field is a
//! cheap, thread-safe handle. Counters are registered without their `_total` suffix because the
//! OpenMetrics encoder appends it (`kubeproxy_sync_proxy_rules_endpoint_changes` is exposed as
//! `kubeproxy_sync_proxy_rules_endpoint_changes_total`, upstream's name).
//!
//! Like upstream since 1.33 (`pkg/proxy/metrics/metrics.go`), the per-family sync metrics carry
//! an `ip_family` label (`IPv4` or `IPv6`, a fixed set): the sync durations (all, full,
//! partial), the last synced and last queued timestamps, the network programming latency, the
//! iptables restore failures, the services without local endpoints and the conntrack
//! reconciler's duration and deletions.

use std::collections::BTreeMap;
use std::sync::atomic::AtomicU64;
use std::sync::Mutex;
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use proxier::ipvs_mode::SyncKind;
use proxier::retry::Subsystem;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::metrics::info::Info;
use prometheus_client::registry::Registry;

use crate::config::ProxyMode;
use ipvs_netlink::Family as AddressFamily;

/// The content type of [`Metrics::encode`]'s output.
pub const CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// `ip_family` and `traffic_policy` labels of
/// `kubeproxy_sync_proxy_rules_no_local_endpoints_total`.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct TrafficPolicyLabel {
    /// `IPv4` or `IPv6`.
    pub ip_family: String,
    /// `internal` or `external`.
    pub traffic_policy: String,
}

/// `ip_family` label of the per-family sync metrics (upstream's since 1.33).
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct IpFamilyLabel {
    /// `IPv4` or `IPv6`.
    pub ip_family: String,
}

impl IpFamilyLabel {
    /// The label of address family `family` (`IPv4` or `IPv6`, the API's names).
    pub fn of(family: AddressFamily) -> IpFamilyLabel {
        IpFamilyLabel {
            ip_family: family.api_name().to_string(),
        }
    }
}

/// A histogram family with fixed buckets, one series per label set.
pub type HistogramFamily<L> = Family<L, Histogram, fn() -> Histogram>;

/// Upstream's sync-duration buckets: exponential from 1 ms, 15 of them.
fn sync_histogram() -> Histogram {
    Histogram::new(exponential_buckets(0.001, 2.0, 15))
}

/// Upstream's network-programming buckets (see [`network_programming_buckets`]).
fn network_programming_histogram() -> Histogram {
    Histogram::new(network_programming_buckets())
}

/// `code` label of the healthz/livez request counters.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct CodeLabel {
    /// HTTP status code, e.g. `200`.
    pub code: String,
}

/// `mode` label of `kube_ipvs_proxy_mode`.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ModeLabel {
    /// `ipvs` or `iptables`.
    pub mode: String,
}

/// `kind` label of `kube_ipvs_ipvs_probe_failures_total` (a fixed set, see
/// [`crate::probe::ProbeError::kind`]).
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ProbeKindLabel {
    /// `absent`, `scheduler_missing`, an errno name, `errno` or `protocol`.
    pub kind: String,
}

/// `subsystem` label: one of [`Subsystem::ALL`] (ipvs, address, ipset, iptables, conntrack,
/// sysctl, source), a fixed set.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct SubsystemLabel {
    /// The subsystem.
    pub subsystem: String,
}

/// `kind` and `reason` labels of `kube_ipvs_invalid_objects_total`.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct InvalidObjectLabels {
    /// Object kind (Service, EndpointSlice, Node).
    pub kind: String,
    /// Short reason, e.g. `bad_cluster_ip`.
    pub reason: String,
}

/// `op` label of `kube_ipvs_ipvs_requests_total`.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct OpLabel {
    /// The netlink operation, e.g. `new_service`, `del_dest`.
    pub op: String,
}

/// Every metric kube-ipvs exports.
#[derive(Debug)]
pub struct Metrics {
    registry: Registry,
    /// `kubeproxy_sync_proxy_rules_duration_seconds{ip_family}`: one sync's duration
    /// (upstream's `SyncProxyRulesLatency`).
    pub sync_proxy_rules_duration_seconds: HistogramFamily<IpFamilyLabel>,
    /// `kubeproxy_sync_full_proxy_rules_duration_seconds{ip_family}`: a full sync's duration
    /// (upstream's `SyncFullProxyRulesLatency`; here: full read, diff and repair).
    pub sync_full_proxy_rules_duration_seconds: HistogramFamily<IpFamilyLabel>,
    /// `kubeproxy_sync_partial_proxy_rules_duration_seconds{ip_family}`: an incremental sync's
    /// duration (upstream's `SyncPartialProxyRulesLatency`).
    pub sync_partial_proxy_rules_duration_seconds: HistogramFamily<IpFamilyLabel>,
    /// `kubeproxy_network_programming_duration_seconds{ip_family}`: EndpointSlice change (its
    /// `endpoints.kubernetes.io/last-change-trigger-time`) → programmed, once per change
    /// programmed by a sync without error (upstream's `NetworkProgrammingLatency`).
    pub network_programming_duration_seconds: HistogramFamily<IpFamilyLabel>,
    /// `kubeproxy_sync_proxy_rules_last_timestamp_seconds{ip_family}`: last successful sync
    /// (unix time).
    pub sync_proxy_rules_last_timestamp_seconds: Family<IpFamilyLabel, Gauge<f64, AtomicU64>>,
    /// `kubeproxy_sync_proxy_rules_last_queued_timestamp_seconds{ip_family}`: last change
    /// queued.
    pub sync_proxy_rules_last_queued_timestamp_seconds:
        Family<IpFamilyLabel, Gauge<f64, AtomicU64>>,
    /// `kubeproxy_sync_proxy_rules_endpoint_changes_pending`.
    pub endpoint_changes_pending: Gauge,
    /// `kubeproxy_sync_proxy_rules_endpoint_changes_total`.
    pub endpoint_changes_total: Counter,
    /// `kubeproxy_sync_proxy_rules_service_changes_pending`.
    pub service_changes_pending: Gauge,
    /// `kubeproxy_sync_proxy_rules_service_changes_total`.
    pub service_changes_total: Counter,
    /// `kubeproxy_sync_proxy_rules_iptables_restore_failures_total{ip_family}`.
    pub iptables_restore_failures_total: Family<IpFamilyLabel, Counter>,
    /// `kubeproxy_sync_proxy_rules_iptables_total{table}` is not exported; this is
    /// `kubeproxy_sync_proxy_rules_no_local_endpoints_total{ip_family,traffic_policy}` (a
    /// gauge, like upstream): services with a Local policy and no local endpoint.
    pub no_local_endpoints_total: Family<TrafficPolicyLabel, Gauge>,
    /// `kubeproxy_proxy_healthz_total{code}`.
    pub proxy_healthz_total: Family<CodeLabel, Counter>,
    /// `kubeproxy_proxy_livez_total{code}`.
    pub proxy_livez_total: Family<CodeLabel, Counter>,
    /// `kube_ipvs_proxy_mode{mode}`: 1 for the mode in use.
    pub proxy_mode: Family<ModeLabel, Gauge>,
    /// `kube_ipvs_ipvs_probe_failures_total{kind}`: failed IPVS probes at start (retried, or
    /// followed by a fallback).
    pub ipvs_probe_failures_total: Family<ProbeKindLabel, Counter>,
    /// `kube_ipvs_drift_repairs_total{subsystem}`: kernel state found changed behind our back.
    pub drift_repairs_total: Family<SubsystemLabel, Counter>,
    /// `kube_ipvs_sync_errors_total{subsystem}`: failed operations (retried).
    pub sync_errors_total: Family<SubsystemLabel, Counter>,
    /// `kube_ipvs_sync_failures_total{subsystem}`: syncs in which the subsystem failed.
    pub sync_failures_total: Family<SubsystemLabel, Counter>,
    /// `kube_ipvs_last_successful_sync_age_seconds{subsystem}`: seconds since the subsystem was
    /// last known in sync (worst family), computed at scrape time.
    pub last_successful_sync_age_seconds: Family<SubsystemLabel, Gauge<f64, AtomicU64>>,
    /// Last time each (IP version, subsystem) was in sync; the source's, and the start-time
    /// placeholders, under version 0.
    last_success: Mutex<BTreeMap<(u8, Subsystem), Instant>>,
    /// The API source is healthy now (its age is then 0).
    source_ok: Mutex<bool>,
    /// `kube_ipvs_invalid_objects_total{kind,reason}`: objects skipped as invalid.
    pub invalid_objects_total: Family<InvalidObjectLabels, Counter>,
    /// `kube_ipvs_ipvs_requests_total{op}`: IPVS netlink requests sent, by command (one of
    /// [`ipvs_netlink::OpKind::ALL`]: reads and writes).
    pub ipvs_requests_total: Family<OpLabel, Counter>,
    /// `kube_ipvs_draining_destinations`: real servers at weight 0 waiting for connections to end.
    pub draining_destinations: Gauge,
    /// `kube_ipvs_ipvs_services`: virtual servers programmed.
    pub ipvs_services: Gauge,
    /// `kube_ipvs_ipvs_destinations`: real servers programmed.
    pub ipvs_destinations: Gauge,
    /// `kube_ipvs_health_check_node_ports`: health-check node port listeners open.
    pub health_check_node_ports: Gauge,
    /// `kubeproxy_conntrack_reconciler_deleted_entries_total{ip_family}`: stale UDP conntrack
    /// entries deleted (upstream's `ReconcileConntrackFlowsDeletedEntriesTotal`).
    pub conntrack_deleted_entries_total: Family<IpFamilyLabel, Counter>,
    /// `kubeproxy_conntrack_reconciler_sync_duration_seconds{ip_family}`: one conntrack
    /// cleanup's duration (upstream's `ReconcileConntrackFlowsLatency`, observed by
    /// `pkg/proxy/conntrack.CleanStaleEntries`); observed for syncs that had stale flows to
    /// delete (upstream's reconciler runs every sync).
    pub conntrack_reconciler_sync_duration_seconds: HistogramFamily<IpFamilyLabel>,
    /// `kube_ipvs_drained_destinations_total{reason}`: drained real servers deleted, because
    /// their last connection ended (`drained`) or the drain cap passed (`cap`).
    pub drained_destinations_total: Family<ReasonLabel, Counter>,
    /// `kube_ipvs_events_dropped_total{reason}`: Kubernetes Events held back (`duplicate`,
    /// `rate_limited`, `queue_full`, `closed`; see [`crate::events`]).
    pub events_dropped_total: Family<ReasonLabel, Counter>,
    /// `kube_ipvs_events_published_total{result}`: Events sent to the API server (`ok`,
    /// `error`).
    pub events_published_total: Family<ResultLabel, Counter>,
    /// `kube_ipvs_vip_conflicts`: external/load-balancer VIP claims lost to an older Service
    /// (see `proxier::vip`).
    pub vip_conflicts: Gauge,
}

/// `result` label of `kube_ipvs_events_published_total`.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ResultLabel {
    /// `ok` or `error`.
    pub result: String,
}

/// The fixed `reason` values of `kube_ipvs_events_dropped_total`.
pub const EVENT_DROP_REASONS: &[&str] = &["duplicate", "rate_limited", "queue_full", "closed"];

/// `reason` label of `kube_ipvs_drained_destinations_total`.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ReasonLabel {
    /// `drained` or `cap`.
    pub reason: String,
}

/// Upstream's network programming buckets: 0, 0.25 s, 0.5 s, 1..59 s, 60..115 s by 5, 2..5 min
/// by 30 s.
fn network_programming_buckets() -> Vec<f64> {
    let mut b = vec![0.0, 0.25, 0.5];
    b.extend((1..=59).map(f64::from));
    b.extend((0..12).map(|i| 60.0 + 5.0 * f64::from(i)));
    b.extend((0..7).map(|i| 120.0 + 30.0 * f64::from(i)));
    b
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

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
            "Kubernetes Events held back: duplicate, rate_limited, queue_full, closed",
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
        r.register(
            format!("{o}vip_conflicts"),
            "externalIP / load-balancer IP claims (IP, port, protocol) lost to an older Service or a ClusterIP",
            m.vip_conflicts.clone(),
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

    /// Creates the per-family series of `families` at 0, so they are visible
    /// before the first sync (upstream sets the no-local-endpoints gauges every sync).
    pub fn init_families(&self, families: &[AddressFamily]) {
        for family in families {
            let label = IpFamilyLabel::of(*family);
            for policy in ["internal", "external"] {
                self.no_local_endpoints_total
                    .get_or_create(&TrafficPolicyLabel {
                        ip_family: label.ip_family.clone(),
                        traffic_policy: policy.to_string(),
                    })
                    .set(0);
            }
            self.iptables_restore_failures_total
                .get_or_create(&label)
                .inc_by(0);
            self.conntrack_deleted_entries_total
                .get_or_create(&label)
                .inc_by(0);
        }
    }

    /// Counts IPVS requests of `op` (a label from [`ipvs_netlink::OpKind::as_str`]).
    pub fn record_ipvs_requests(&self, op: ipvs_netlink::OpKind, n: u64) {
        self.ipvs_requests_total
            .get_or_create(&OpLabel {
                op: op.as_str().to_string(),
            })
            .inc_by(n);
    }

    /// Records a conntrack cleanup of `family` that took `seconds` and deleted `deleted`
    /// entries (upstream's `CleanStaleEntries` observations).
    pub fn record_conntrack(&self, family: AddressFamily, seconds: Option<f64>, deleted: u64) {
        let label = IpFamilyLabel::of(family);
        if let Some(s) = seconds {
            self.conntrack_reconciler_sync_duration_seconds
                .get_or_create(&label)
                .observe(s);
        }
        self.conntrack_deleted_entries_total
            .get_or_create(&label)
            .inc_by(deleted);
    }

    /// Observes the network programming latency of changes of `family` triggered at
    /// `triggers` and programmed now (upstream: `NetworkProgrammingLatency.Observe(
    /// SinceInSeconds(lastChangeTriggerTime))` in `syncProxyRules`). A trigger time in the
    /// future (clock skew between the control plane and this node) counts as 0.
    pub fn record_network_programmed(&self, family: AddressFamily, triggers: &[SystemTime]) {
        let now = SystemTime::now();
        let h = self
            .network_programming_duration_seconds
            .get_or_create(&IpFamilyLabel::of(family));
        for t in triggers {
            let latency = now.duration_since(*t).map_or(0.0, |d| d.as_secs_f64());
            h.observe(latency);
        }
    }

    /// Sets `kubeproxy_sync_proxy_rules_no_local_endpoints_total` of `family`.
    pub fn set_no_local_endpoints(&self, family: AddressFamily, internal: usize, external: usize) {
        let ip_family = IpFamilyLabel::of(family).ip_family;
        for (policy, n) in [("internal", internal), ("external", external)] {
            self.no_local_endpoints_total
                .get_or_create(&TrafficPolicyLabel {
                    ip_family: ip_family.clone(),
                    traffic_policy: policy.to_string(),
                })
                .set(i64::try_from(n).unwrap_or(i64::MAX));
        }
    }

    /// Sets `kube_ipvs_proxy_mode{mode}` to 1 for `mode` and 0 for the other.
    pub fn set_proxy_mode(&self, mode: ProxyMode) {
        for other in [ProxyMode::Ipvs, ProxyMode::Iptables] {
            let label = ModeLabel {
                mode: other.as_str().to_string(),
            };
            self.proxy_mode
                .get_or_create(&label)
                .set(i64::from(other == mode));
        }
    }

    /// Counts one failed IPVS probe of `kind` (a [`crate::probe::ProbeError::kind`]).
    pub fn record_probe_failure(&self, kind: &'static str) {
        self.ipvs_probe_failures_total
            .get_or_create(&ProbeKindLabel {
                kind: kind.to_string(),
            })
            .inc();
    }

    /// Observes a sync of `family` and `kind` that took `seconds`: the duration of
    /// all syncs and of full or partial ones.
    pub fn observe_sync(&self, family: AddressFamily, kind: SyncKind, seconds: f64) {
        let label = IpFamilyLabel::of(family);
        self.sync_proxy_rules_duration_seconds
            .get_or_create(&label)
            .observe(seconds);
        let by_kind = match kind {
            SyncKind::Full => &self.sync_full_proxy_rules_duration_seconds,
            SyncKind::Incremental => &self.sync_partial_proxy_rules_duration_seconds,
        };
        by_kind.get_or_create(&label).observe(seconds);
    }

    /// Records a successful sync of `family` and `kind` that took `seconds`, now.
    pub fn record_sync(&self, family: AddressFamily, kind: SyncKind, seconds: f64) {
        self.observe_sync(family, kind, seconds);
        self.sync_proxy_rules_last_timestamp_seconds
            .get_or_create(&IpFamilyLabel::of(family))
            .set(unix_now());
    }

    /// Counts one Event held back; `reason` must be one of [`EVENT_DROP_REASONS`] (anything
    /// else is counted as `closed`, keeping the label set fixed).
    pub fn record_event_dropped(&self, reason: &str) {
        let reason = EVENT_DROP_REASONS
            .iter()
            .find(|r| **r == reason)
            .copied()
            .unwrap_or("closed");
        self.events_dropped_total
            .get_or_create(&ReasonLabel {
                reason: reason.to_string(),
            })
            .inc();
    }

    /// Counts one Event sent (`ok`) or failed.
    pub fn record_event_published(&self, ok: bool) {
        self.events_published_total
            .get_or_create(&ResultLabel {
                result: if ok { "ok" } else { "error" }.to_string(),
            })
            .inc();
    }

    /// Records a sync of `family` and `kind` that took `seconds` and left `failing`
    /// subsystems failing: the others are in sync as of now. The last-sync timestamp moves
    /// only when nothing is failing (upstream sets it only after a successful sync).
    pub fn record_sync_outcome(
        &self,
        family: AddressFamily,
        kind: SyncKind,
        seconds: f64,
        failing: &std::collections::BTreeSet<Subsystem>,
    ) {
        if failing.is_empty() {
            self.record_sync(family, kind, seconds);
        } else {
            self.observe_sync(family, kind, seconds);
        }
        let now = Instant::now();
        let mut last = self.last_success.lock().unwrap_or_else(|p| p.into_inner());
        // A family's first report replaces the start-time placeholder of family 0.
        for sub in [
            Subsystem::Ipvs,
            Subsystem::Address,
            Subsystem::Ipset,
            Subsystem::Iptables,
            Subsystem::Conntrack,
        ] {
            let placeholder = last.remove(&(0, sub));
            if failing.contains(&sub) {
                let since = placeholder.unwrap_or(now);
                last.entry((family.version(), sub)).or_insert(since);
            } else {
                last.insert((family.version(), sub), now);
            }
        }
    }

    /// Records whether the API source is healthy now.
    pub fn set_source_ok(&self, ok: bool) {
        *self.source_ok.lock().unwrap_or_else(|p| p.into_inner()) = ok;
        if ok {
            let mut last = self.last_success.lock().unwrap_or_else(|p| p.into_inner());
            last.insert((0, Subsystem::Source), Instant::now());
        }
    }

    fn update_ages(&self) {
        let now = Instant::now();
        let source_ok = *self.source_ok.lock().unwrap_or_else(|p| p.into_inner());
        let last = self.last_success.lock().unwrap_or_else(|p| p.into_inner());
        let mut ages: BTreeMap<Subsystem, f64> = BTreeMap::new();
        for ((_, sub), at) in last.iter() {
            let age = if *sub == Subsystem::Source && source_ok {
                0.0
            } else {
                now.duration_since(*at).as_secs_f64()
            };
            let e = ages.entry(*sub).or_insert(0.0);
            *e = e.max(age);
        }
        drop(last);
        for (sub, age) in ages {
            self.last_successful_sync_age_seconds
                .get_or_create(&SubsystemLabel {
                    subsystem: sub.as_str().to_string(),
                })
                .set(age);
        }
    }

    /// Records that a sync of `family` was queued, now.
    pub fn record_queued(&self, family: AddressFamily) {
        self.sync_proxy_rules_last_queued_timestamp_seconds
            .get_or_create(&IpFamilyLabel::of(family))
            .set(unix_now());
    }

    /// The OpenMetrics text exposition of every metric.
    pub fn encode(&self) -> Result<String, std::fmt::Error> {
        self.update_ages();
        let mut out = String::new();
        prometheus_client::encoding::text::encode(&mut out, &self.registry)?;
        Ok(out)
    }
}

/// Seconds since the Unix epoch, as a float.
pub fn unix_now() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs_f64())
        .unwrap_or(0.0)
}

/// The `/metrics` router.
pub fn router(metrics: std::sync::Arc<Metrics>) -> axum::Router {
    use axum::http::{header, StatusCode};
    use axum::response::IntoResponse;
    axum::Router::new().route(
        "/metrics",
        axum::routing::get(move || {
            let metrics = metrics.clone();
            async move {
                match metrics.encode() {
                    Ok(body) => ([(header::CONTENT_TYPE, CONTENT_TYPE)], body).into_response(),
                    Err(_) => (StatusCode::INTERNAL_SERVER_ERROR, "encoding metrics failed")
                        .into_response(),
                }
            }
        }),
    )
}
