//! The label sets of the metrics (each a fixed, small set of values) and the histogram
//! buckets (upstream's).

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};

use ipvs_netlink::Family as AddressFamily;

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
pub(super) fn sync_histogram() -> Histogram {
    Histogram::new(exponential_buckets(0.001, 2.0, 15))
}

/// Upstream's network-programming buckets (see [`network_programming_buckets`]).
pub(super) fn network_programming_histogram() -> Histogram {
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

/// `subsystem` label: one of [`proxier::retry::Subsystem::ALL`] (ipvs, address, ipset, iptables, conntrack,
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

/// `subsystem` and `reason` labels of `kube_ipvs_kernel_refusals_total`: a subsystem of
/// [`proxier::retry::Subsystem::ALL`] and a fixed word (an errno name of
/// `proxier::ipvs_mode::refusal_label`, or `ipset_rejected`).
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RefusalLabels {
    /// The subsystem that refused.
    pub subsystem: String,
    /// The fixed word of its answer.
    pub reason: String,
}

/// `result` label of `kube_ipvs_events_published_total`.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ResultLabel {
    /// `ok` or `error`.
    pub result: String,
}

/// The fixed `reason` values of `kube_ipvs_events_dropped_total`.
pub const EVENT_DROP_REASONS: &[&str] = &[
    "delegated",
    "duplicate",
    "rate_limited",
    "queue_full",
    "closed",
];

/// The fixed `server` values of the HTTP connection metrics (anything else is `other`).
pub const HTTP_SERVERS: &[&str] = &["healthz", "metrics", "health-check-node-port", "other"];

/// The fixed `reason` values of `kube_ipvs_http_connections_refused_total`.
pub const HTTP_REFUSE_REASONS: &[&str] = &["per_source", "total"];

/// `server` and `reason` labels of `kube_ipvs_http_connections_refused_total`.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct HttpRefusedLabels {
    /// One of [`HTTP_SERVERS`].
    pub server: String,
    /// One of [`HTTP_REFUSE_REASONS`].
    pub reason: String,
}

/// `server` label of `kube_ipvs_http_connections_evicted_total`.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ServerLabel {
    /// One of [`HTTP_SERVERS`].
    pub server: String,
}

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
