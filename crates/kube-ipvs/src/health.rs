//! Proxy health (`/healthz`, `/livez`) with upstream kube-proxy's semantics.
//!
//! The proxy is healthy unless, for some IP family, an update has been queued
//! ([`ProxyHealth::queued_update`]) and not applied ([`ProxyHealth::updated`]) for longer than
//! the health timeout (upstream: 2 × syncPeriod). A proxy that is starting up, or fully synced,
//! is healthy. `/healthz` is additionally unhealthy when this node is not eligible: its Node has a
//! deletionTimestamp or the cluster autoscaler's `ToBeDeletedByClusterAutoscaler` taint.
//! `/livez` ignores the Node. Both answer JSON with `lastUpdated` and `currentTime` (RFC 3339);
//! `lastUpdated` is the current time when healthy, like upstream.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use k8s_openapi::api::core::v1::Node;

use crate::metrics::{CodeLabel, Metrics};

/// The taint the cluster autoscaler puts on nodes it is about to delete.
pub const TO_BE_DELETED_TAINT: &str = "ToBeDeletedByClusterAutoscaler";

/// An IP family (kube-ipvs runs one proxier per family).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum IpFamily {
    /// IPv4.
    V4,
    /// IPv6.
    V6,
}

#[derive(Debug)]
struct State {
    last_updated: HashMap<IpFamily, SystemTime>,
    oldest_pending: HashMap<IpFamily, SystemTime>,
    node_eligible: bool,
    /// Why the proxy cannot start syncing yet (e.g. the IPVS probe keeps failing).
    blocked: Option<String>,
}

/// Shared proxy health state; cheap to query from HTTP handlers.
#[derive(Debug)]
pub struct ProxyHealth {
    timeout: Duration,
    state: Mutex<State>,
    metrics: Option<Arc<Metrics>>,
}

/// One health answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HealthStatus {
    /// Healthy (for `/healthz`: and the node is eligible).
    pub healthy: bool,
    /// Last successful update (the current time when healthy, `None` if never).
    pub last_updated: Option<SystemTime>,
    /// The time of the answer.
    pub current_time: SystemTime,
    /// The node is not being deleted.
    pub node_eligible: bool,
}

impl ProxyHealth {
    /// Health state with `timeout` (use 2 × syncPeriod like upstream).
    pub fn new(timeout: Duration, metrics: Option<Arc<Metrics>>) -> Self {
        Self {
            timeout,
            state: Mutex::new(State {
                last_updated: HashMap::new(),
                oldest_pending: HashMap::new(),
                // Eligible until a Node event says otherwise.
                node_eligible: true,
                blocked: None,
            }),
            metrics,
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// A change for `family` was received and not yet applied.
    pub fn queued_update(&self, family: IpFamily) {
        self.queued_update_at(family, SystemTime::now());
    }

    /// [`Self::queued_update`] with an explicit time (keeps the oldest pending time).
    pub fn queued_update_at(&self, family: IpFamily, at: SystemTime) {
        self.lock().oldest_pending.entry(family).or_insert(at);
    }

    /// `family`'s proxier applied everything queued.
    pub fn updated(&self, family: IpFamily) {
        self.updated_at(family, SystemTime::now());
    }

    /// [`Self::updated`] with an explicit time.
    pub fn updated_at(&self, family: IpFamily, at: SystemTime) {
        let mut s = self.lock();
        s.oldest_pending.remove(&family);
        s.last_updated.insert(family, at);
    }

    /// Updates node eligibility from this node's Node object.
    pub fn sync_node(&self, node: &Node) {
        let deleting = node.metadata.deletion_timestamp.is_some();
        let tainted = node
            .spec
            .as_ref()
            .and_then(|s| s.taints.as_ref())
            .is_some_and(|t| t.iter().any(|t| t.key == TO_BE_DELETED_TAINT));
        self.lock().node_eligible = !(deleting || tainted);
    }

    /// Marks the proxy unhealthy (`/healthz` and `/livez` 503, the reason in the body) until
    /// called with `None`: while it cannot start syncing at all (the IPVS probe at start keeps
    /// failing and is retried).
    pub fn set_blocked(&self, reason: Option<String>) {
        self.lock().blocked = reason;
    }

    /// Why the proxy is blocked, if it is (see [`Self::set_blocked`]).
    pub fn blocked(&self) -> Option<String> {
        self.lock().blocked.clone()
    }

    /// The node is eligible (not being deleted).
    pub fn node_eligible(&self) -> bool {
        self.lock().node_eligible
    }

    /// Proxy health ignoring the Node (what `/livez` and service health checks use).
    pub fn is_healthy(&self) -> bool {
        self.status_at(SystemTime::now(), false).healthy
    }

    /// Health at `now`; with `with_node`, an ineligible node is unhealthy (`/healthz`).
    pub fn status_at(&self, now: SystemTime, with_node: bool) -> HealthStatus {
        let s = self.lock();
        let mut healthy = true;
        let mut last: Option<SystemTime> = None;
        for (family, updated) in &s.last_updated {
            if last.is_none_or(|l| *updated > l) {
                last = Some(*updated);
            }
            if let Some(pending) = s.oldest_pending.get(family) {
                let age = now.duration_since(*pending).unwrap_or(Duration::ZERO);
                if age >= self.timeout {
                    healthy = false;
                    last = Some(*updated);
                    break;
                }
            }
        }
        // A family queued but never updated is judged on its pending age too.
        if healthy {
            for (family, pending) in &s.oldest_pending {
                if s.last_updated.contains_key(family) {
                    continue;
                }
                let age = now.duration_since(*pending).unwrap_or(Duration::ZERO);
                if age >= self.timeout {
                    healthy = false;
                }
            }
        }
        if s.blocked.is_some() {
            healthy = false;
        }
        let node_eligible = s.node_eligible;
        if with_node {
            healthy = healthy && node_eligible;
        }
        HealthStatus {
            healthy,
            last_updated: if healthy { Some(now) } else { last },
            current_time: now,
            node_eligible,
        }
    }

    fn count(&self, livez: bool, code: StatusCode) {
        if let Some(m) = &self.metrics {
            let label = CodeLabel {
                code: code.as_u16().to_string(),
            };
            let family = if livez {
                &m.proxy_livez_total
            } else {
                &m.proxy_healthz_total
            };
            family.get_or_create(&label).inc();
        }
    }
}

/// RFC 3339 UTC text of a time (`0001-01-01T00:00:00Z` for `None`, Go's zero time).
pub fn rfc3339(t: Option<SystemTime>) -> String {
    let Some(t) = t else {
        return "0001-01-01T00:00:00Z".into();
    };
    let d = t.duration_since(UNIX_EPOCH).unwrap_or(Duration::ZERO);
    let secs = d.as_secs() as i64;
    let days = secs.div_euclid(86_400);
    let rem = secs.rem_euclid(86_400);
    // Civil date from days since 1970-01-01 (Howard Hinnant's algorithm).
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!(
        "{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}.{:09}Z",
        rem / 3600,
        (rem % 3600) / 60,
        rem % 60,
        d.subsec_nanos()
    )
}

fn json_response(code: StatusCode, body: String) -> Response {
    let mut r = (code, body).into_response();
    let h = r.headers_mut();
    h.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    h.insert(
        header::X_CONTENT_TYPE_OPTIONS,
        HeaderValue::from_static("nosniff"),
    );
    r
}

fn answer(health: &ProxyHealth, livez: bool) -> Response {
    let st = health.status_at(SystemTime::now(), !livez);
    let code = if st.healthy {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    health.count(livez, code);
    let mut body = serde_json::json!({
        "lastUpdated": rfc3339(st.last_updated),
        "currentTime": rfc3339(Some(st.current_time)),
    });
    if !livez {
        body["nodeEligible"] = serde_json::Value::Bool(st.node_eligible);
    }
    if let Some(reason) = health.blocked() {
        body["reason"] = serde_json::Value::String(reason);
    }
    json_response(code, body.to_string())
}

/// The `/healthz` + `/livez` router.
pub fn router(health: Arc<ProxyHealth>) -> axum::Router {
    let h2 = health.clone();
    axum::Router::new()
        .route(
            "/healthz",
            axum::routing::get(move || {
                let h = health.clone();
                async move { answer(&h, false) }
            }),
        )
        .route(
            "/livez",
            axum::routing::get(move || {
                let h = h2.clone();
                async move { answer(&h, true) }
            }),
        )
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::core::v1::{NodeSpec, Taint};
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;

    fn t(secs: u64) -> SystemTime {
        UNIX_EPOCH + Duration::from_secs(secs)
    }

    #[test]
    fn upstream_freshness_semantics() {
        let h = ProxyHealth::new(Duration::from_secs(60), None);
        // Starting up: healthy, never updated.
        let st = h.status_at(t(1000), true);
        assert!(st.healthy);
        // Queued, not yet late.
        h.queued_update_at(IpFamily::V4, t(1000));
        assert!(h.status_at(t(1059), true).healthy);
        // Late: unhealthy, lastUpdated is the real last update (none yet).
        let st = h.status_at(t(1060), true);
        assert!(!st.healthy);
        // A second queue does not reset the oldest pending time.
        h.queued_update_at(IpFamily::V4, t(1050));
        assert!(!h.status_at(t(1061), true).healthy);
        // Applied: healthy again; lastUpdated reported as "now".
        h.updated_at(IpFamily::V4, t(1070));
        let st = h.status_at(t(5000), true);
        assert!(st.healthy);
        assert_eq!(st.last_updated, Some(t(5000)));
        // One late family makes the whole proxy unhealthy; lastUpdated is that family's.
        h.updated_at(IpFamily::V6, t(1080));
        h.queued_update_at(IpFamily::V6, t(2000));
        let st = h.status_at(t(2060), true);
        assert!(!st.healthy);
        assert_eq!(st.last_updated, Some(t(1080)));
    }

    #[test]
    fn blocked_is_unhealthy_for_healthz_and_livez_with_the_reason() {
        let h = Arc::new(ProxyHealth::new(Duration::from_secs(60), None));
        assert!(h.status_at(t(10), true).healthy);
        h.set_blocked(Some("IPVS probe failing".into()));
        assert!(!h.status_at(t(10), true).healthy);
        assert!(!h.status_at(t(10), false).healthy);
        assert!(!h.is_healthy());
        for livez in [false, true] {
            let r = answer(&h, livez);
            assert_eq!(r.status(), StatusCode::SERVICE_UNAVAILABLE);
        }
        assert_eq!(h.blocked().as_deref(), Some("IPVS probe failing"));
        h.set_blocked(None);
        assert!(h.status_at(t(10), true).healthy);
        assert_eq!(answer(&h, false).status(), StatusCode::OK);
    }

    #[test]
    fn node_eligibility_only_affects_healthz() {
        let h = ProxyHealth::new(Duration::from_secs(60), None);
        let mut node = Node::default();
        node.metadata.deletion_timestamp = Some(Time(Default::default()));
        h.sync_node(&node);
        assert!(!h.status_at(t(10), true).healthy);
        assert!(h.status_at(t(10), false).healthy);
        let tainted = Node {
            spec: Some(NodeSpec {
                taints: Some(vec![Taint {
                    key: TO_BE_DELETED_TAINT.into(),
                    effect: "NoSchedule".into(),
                    ..Taint::default()
                }]),
                ..NodeSpec::default()
            }),
            ..Node::default()
        };
        h.sync_node(&tainted);
        assert!(!h.node_eligible());
        h.sync_node(&Node::default());
        assert!(h.status_at(t(10), true).healthy);
    }

    #[test]
    fn rfc3339_formatting() {
        assert_eq!(rfc3339(None), "0001-01-01T00:00:00Z");
        assert_eq!(rfc3339(Some(t(0))), "1970-01-01T00:00:00.000000000Z");
        // 2024-02-29T12:34:56Z (a leap day).
        assert_eq!(
            rfc3339(Some(t(1_709_210_096))),
            "2024-02-29T12:34:56.000000000Z"
        );
    }
}
