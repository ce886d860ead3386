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

use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::info::Info;
use prometheus_client::registry::Registry;

use crate::config::ProxyMode;
use ipvs_netlink::Family as AddressFamily;

mod labels;
mod register;

pub use labels::*;

/// The content type of [`Metrics::encode`]'s output.
pub const CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

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
    /// `kube_ipvs_events_dropped_total{reason}`: Kubernetes Events held back (`delegated`,
    /// `duplicate`, `rate_limited`, `queue_full`, `closed`; see [`crate::events`]).
    pub events_dropped_total: Family<ReasonLabel, Counter>,
    /// `kube_ipvs_events_published_total{result}`: Events sent to the API server (`ok`,
    /// `error`).
    pub events_published_total: Family<ResultLabel, Counter>,
    /// `kube_ipvs_vip_conflicts`: external/load-balancer VIP claims lost to an older Service
    /// (see `proxier::vip`).
    pub vip_conflicts: Gauge,
    /// `kube_ipvs_node_address_conflicts{reason}`: externalIP / load-balancer IP claims on this
    /// node's addresses not served because the node keeps the address and port: `node_port`
    /// (a NodePort or health-check node port), `protected_port`, `refused`
    /// (see `desired::vip::node`).
    pub node_address_conflicts: Family<ReasonLabel, Gauge>,
    /// `kube_ipvs_http_connections_refused_total{server,reason}`: connections closed at once by
    /// the per-source cap (`per_source`) or a full server (`total`), see [`crate::http`].
    pub http_connections_refused_total: Family<HttpRefusedLabels, Counter>,
    /// `kube_ipvs_http_connections_evicted_total{server}`: connections closed to admit one from
    /// a source holding fewer (a full server), see [`crate::http`].
    pub http_connections_evicted_total: Family<ServerLabel, Counter>,
    /// `kube_ipvs_kernel_refusals_total{subsystem,reason}`: Services isolated because the
    /// kernel refused their programming (counted once per isolation; see
    /// `proxier::ipvs_mode::refusal`).
    pub kernel_refusals_total: Family<RefusalLabels, Counter>,
    /// `kube_ipvs_refused_services`: Services isolated now (both families summed).
    pub refused_services: Gauge,
    /// `kube_ipvs_node_address_tracking`: 1 while the node-address tracker follows changes,
    /// 0 while it does not (the last known addresses, or the Node object's, are used).
    pub node_address_tracking: Gauge,
    /// `kube_ipvs_node_address_resubscriptions_total`: the tracker's subscriptions after a
    /// failure or the end of its event stream.
    pub node_address_resubscriptions_total: Counter,
    /// `kube_ipvs_ip_family_served{ip_family}`: 1 for each family served, 0 for the other
    /// (not supported by the node, or not used by it yet).
    pub ip_family_served: Family<IpFamilyLabel, Gauge>,
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    /// Sets whether `family` is served.
    pub fn set_family_served(&self, family: AddressFamily, served: bool) {
        self.ip_family_served
            .get_or_create(&IpFamilyLabel::of(family))
            .set(i64::from(served));
    }

    /// Records the node-address tracker's state and `resubscriptions` more subscriptions.
    pub fn record_node_address_tracker(&self, status: &netif::TrackerStatus, resubscriptions: u64) {
        self.node_address_tracking
            .set(i64::from(status.known && status.tracking));
        self.node_address_resubscriptions_total
            .inc_by(resubscriptions);
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

    /// Counts one HTTP connection refused by `server` (one of [`HTTP_SERVERS`], else `other`)
    /// for `reason` (one of [`HTTP_REFUSE_REASONS`], else `total`).
    pub fn record_http_refused(&self, server: &str, reason: &str) {
        let reason = HTTP_REFUSE_REASONS
            .iter()
            .find(|r| **r == reason)
            .copied()
            .unwrap_or("total");
        self.http_connections_refused_total
            .get_or_create(&HttpRefusedLabels {
                server: http_server_label(server).to_string(),
                reason: reason.to_string(),
            })
            .inc();
    }

    /// Counts one HTTP connection evicted by `server` (see [`Self::record_http_refused`]).
    pub fn record_http_evicted(&self, server: &str) {
        self.http_connections_evicted_total
            .get_or_create(&ServerLabel {
                server: http_server_label(server).to_string(),
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

/// `server` as one of [`HTTP_SERVERS`] (`other` for anything else).
fn http_server_label(server: &str) -> &'static str {
    HTTP_SERVERS
        .iter()
        .find(|s| **s == server)
        .copied()
        .unwrap_or("other")
}
