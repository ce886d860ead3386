//! Proxy health (`/healthz`, `/livez`, and the sync health the health-check node ports use).
//!
//! Health means "this node's kernel state is right", nothing else. Three answers, from one
//! state:
//!
//! - **Sync health** ([`ProxyHealth::is_healthy`], upstream's `ProxyHealthServer.IsHealthy` in
//!   `pkg/proxy/healthcheck/proxy_health.go`, which the health-check node ports use since
//!   KEP-3836, `hcHandler.ServeHTTP` in `service_health.go`): unhealthy when, for some IP family,
//!   an update has been queued ([`ProxyHealth::queued_update`]) and not applied
//!   ([`ProxyHealth::updated`]) for longer than the health timeout (upstream: 2 × syncPeriod);
//!   beyond upstream, also when a kernel subsystem keeps failing for the timeout (only a sync
//!   with no failure and no retry outstanding counts as an update; a failed one records which
//!   subsystem failed, since when, and its last error: [`ProxyHealth::sync_failed_at`]), and
//!   while the IPVS probe at start keeps failing ([`ProxyHealth::set_blocked`]). A proxy that is
//!   starting up, or fully synced, is healthy.
//! - **`/healthz`** (upstream's `healthzHandler`): sync health, and this node is eligible (its
//!   Node has no deletionTimestamp and no `ToBeDeletedByClusterAutoscaler` taint).
//! - **`/livez`**: fails only for a wedged process: the sync loop has been inside one step
//!   (applying changes and syncing) for longer than the liveness bound, or has not woken up for
//!   the liveness bound after its wake-up was due ([`ProxyHealth::liveness_at`]). The bound is
//!   2 × syncPeriod, at least [`MIN_LIVENESS_BOUND`]. A step waiting on a program that keeps
//!   computing (a large `iptables-restore`, run window by window while busy: `exec`'s
//!   `Runner::while_busy`) counts from the program's last busy sample. Upstream's
//!   `livezHandler` answers the sync health; here a kernel subsystem that keeps failing
//!   (another program holding the xtables lock) is a `/healthz` matter: a restart would not
//!   fix it.
//!
//! The API source (watch errors, an unreachable or throttling API server, 410 storms, an object
//! that cannot be decoded) is never a health failure: no change is queued while it fails, so the
//! node's kernel state is as right as the last known objects make it, and upstream stays
//! healthy too. Its failure is reported in `/healthz`'s body (`source`), in the log and in
//! `kube_ipvs_last_successful_sync_age_seconds{subsystem="source"}`
//! ([`ProxyHealth::source_failing_at`]).
//!
//! Bodies are JSON with `lastUpdated` and `currentTime` (RFC 3339); `lastUpdated` is the current
//! time when healthy, like upstream. An unhealthy `/healthz` adds `reasons`, one per subsystem
//! (`ipvs`, `address`, `ipset`, `iptables`, `conntrack`, or `pending` for changes not applied
//! without a reported failure, e.g. a hung sync), with `family`, `since` and `lastError` (at most
//! 512 bytes); a wedged `/livez` adds `reasons` with subsystem `sync-loop`.

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use ipvs_netlink::Family;
use k8s_openapi::api::core::v1::Node;

use crate::metrics::{CodeLabel, Metrics};

/// The taint the cluster autoscaler puts on nodes it is about to delete.
pub const TO_BE_DELETED_TAINT: &str = "ToBeDeletedByClusterAutoscaler";

/// The shortest liveness bound: a sync loop step may run this long before `/livez` fails, even
/// with a short syncPeriod. A first sync of a large cluster, or one program running into its own
/// time limit (`--iptables-timeout`, `--ipset-timeout`: 30 s), is slow, not wedged; so is a
/// step waiting on a program that is still busy (see [`ProxyHealth::liveness_at`]).
pub const MIN_LIVENESS_BOUND: Duration = Duration::from_secs(60);

/// The subsystem a wedged `/livez` names.
pub const SYNC_LOOP: &str = "sync-loop";

/// A failure that has lasted since `since`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Failing {
    /// Failing since.
    pub since: SystemTime,
    /// The last error (at most 512 bytes).
    pub last_error: String,
}

/// What the sync loop is doing (see [`ProxyHealth::loop_working_at`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum LoopState {
    /// Inside a step (applying changes, syncing) since.
    Working(Instant),
    /// Waiting for input, due to wake up at the latest at.
    Waiting(Instant),
}

#[derive(Debug)]
struct State {
    last_updated: HashMap<Family, SystemTime>,
    oldest_pending: HashMap<Family, SystemTime>,
    /// Failing subsystems per family (a bounded set: families × subsystems).
    failing: BTreeMap<(Family, &'static str), Failing>,
    /// The API source failing since (reported, never a health failure).
    source: Option<Failing>,
    node_eligible: bool,
    /// Why the proxy cannot start syncing yet (e.g. the IPVS probe keeps failing).
    blocked: Option<String>,
    /// The sync loop's state (None until it runs).
    sync_loop: Option<LoopState>,
}

/// Why the proxy is unhealthy (one per failing subsystem and family).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Reason {
    /// `ipvs`, `address`, `ipset`, `iptables`, `conntrack`, `pending` (`/healthz`), or
    /// `sync-loop` (`/livez`).
    pub subsystem: &'static str,
    /// The family (none for `sync-loop`).
    pub family: Option<Family>,
    /// Failing (or pending) since.
    pub since: SystemTime,
    /// The last error (empty for `pending`).
    pub last_error: String,
}

/// The longest error text health keeps.
const MAX_ERROR: usize = 512;

/// Shared proxy health state; cheap to query from HTTP handlers.
#[derive(Debug)]
pub struct ProxyHealth {
    timeout: Duration,
    liveness_bound: Duration,
    state: Mutex<State>,
    metrics: Option<Arc<Metrics>>,
    /// `/livez` last answered wedged (to log the transitions once).
    wedged: AtomicBool,
}

/// One sync-health answer (`/healthz`, or the health-check node ports without the node).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HealthStatus {
    /// Healthy (for `/healthz`: and the node is eligible).
    pub healthy: bool,
    /// Last successful update (the current time when healthy, `None` if never).
    pub last_updated: Option<SystemTime>,
    /// The time of the answer.
    pub current_time: SystemTime,
    /// The node is not being deleted.
    pub node_eligible: bool,
    /// Why the proxy is unhealthy (empty when healthy, or when only the node is ineligible).
    pub reasons: Vec<Reason>,
    /// The API source failing since, with its last error (reported only: never unhealthy).
    pub source: Option<Failing>,
}

/// One `/livez` answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Liveness {
    /// Not wedged.
    pub live: bool,
    /// When wedged: how long the loop has been stuck (in a step, or past its wake-up).
    pub stuck_for: Option<Duration>,
}

impl ProxyHealth {
    /// Health state with `timeout` (use 2 × syncPeriod like upstream); the liveness bound is
    /// `timeout`, at least [`MIN_LIVENESS_BOUND`].
    pub fn new(timeout: Duration, metrics: Option<Arc<Metrics>>) -> Self {
        Self {
            timeout,
            liveness_bound: timeout.max(MIN_LIVENESS_BOUND),
            state: Mutex::new(State {
                last_updated: HashMap::new(),
                oldest_pending: HashMap::new(),
                failing: BTreeMap::new(),
                source: None,
                // Eligible until a Node event says otherwise.
                node_eligible: true,
                blocked: None,
                sync_loop: None,
            }),
            metrics,
            wedged: AtomicBool::new(false),
        }
    }

    /// The same health state with another liveness bound (tests).
    pub fn with_liveness_bound(mut self, bound: Duration) -> Self {
        self.liveness_bound = bound;
        self
    }

    /// The liveness bound (see [`Self::liveness_at`]).
    pub fn liveness_bound(&self) -> Duration {
        self.liveness_bound
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// A change for `family` was received and not yet applied.
    pub fn queued_update(&self, family: Family) {
        self.queued_update_at(family, SystemTime::now());
    }

    /// [`Self::queued_update`] with an explicit time (keeps the oldest pending time).
    pub fn queued_update_at(&self, family: Family, at: SystemTime) {
        self.lock().oldest_pending.entry(family).or_insert(at);
    }

    /// `family`'s proxier applied everything queued.
    pub fn updated(&self, family: Family) {
        self.updated_at(family, SystemTime::now());
    }

    /// [`Self::updated`] with an explicit time: clears the family's pending changes and
    /// failures.
    pub fn updated_at(&self, family: Family, at: SystemTime) {
        let mut s = self.lock();
        s.oldest_pending.remove(&family);
        s.last_updated.insert(family, at);
        s.failing.retain(|(f, _), _| *f != family);
    }

    /// A sync of `family` did not succeed: `failed` are the subsystems that failed in it (with
    /// their last error), `retrying` those with a retry outstanding (failed now or earlier).
    /// `lastUpdated` is not touched; a subsystem keeps the time it started failing; subsystems
    /// no longer failing are forgotten.
    pub fn sync_failed_at(
        &self,
        family: Family,
        failed: &[(&'static str, String)],
        retrying: &[&'static str],
        at: SystemTime,
    ) {
        let mut s = self.lock();
        s.failing.retain(|(f, sub), _| {
            *f != family || retrying.contains(sub) || failed.iter().any(|(x, _)| x == sub)
        });
        for (sub, err) in failed {
            let e = s.failing.entry((family, *sub)).or_insert_with(|| Failing {
                since: at,
                last_error: String::new(),
            });
            e.last_error = proxier::ipvs_mode::truncate_text(err, MAX_ERROR);
        }
        for sub in retrying {
            s.failing.entry((family, *sub)).or_insert_with(|| Failing {
                since: at,
                last_error: String::new(),
            });
        }
    }

    /// The API source (a watch) has been failing since `since` with `error`; the earliest
    /// `since` of an ongoing failure is kept. Reported in `/healthz`'s body, never unhealthy.
    pub fn source_failing_at(&self, since: SystemTime, error: &str) {
        let mut s = self.lock();
        let since = s.source.as_ref().map_or(since, |f| f.since.min(since));
        s.source = Some(Failing {
            since,
            last_error: proxier::ipvs_mode::truncate_text(error, MAX_ERROR),
        });
    }

    /// The API source is healthy again.
    pub fn source_ok(&self) {
        self.lock().source = None;
    }

    /// The sync loop woke up at `at` and works (applies changes, syncs) until its next
    /// [`Self::loop_waiting`]; a step already running keeps its start.
    pub fn loop_working_at(&self, at: Instant) {
        let mut s = self.lock();
        if !matches!(s.sync_loop, Some(LoopState::Working(_))) {
            s.sync_loop = Some(LoopState::Working(at));
        }
    }

    /// The sync loop waits for input and wakes up at the latest at `due`.
    pub fn loop_waiting(&self, due: Instant) {
        self.lock().sync_loop = Some(LoopState::Waiting(due));
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

    /// Marks the sync health unhealthy (`/healthz` and the health-check node ports 503, the
    /// reason in `/healthz`'s body) until called with `None`: while the proxy cannot start
    /// syncing at all (the IPVS probe at start keeps failing and is retried). `/livez` stays 200:
    /// the process is retrying, and a restart would probe the same kernel again.
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

    /// Sync health ignoring the Node: what the health-check node ports answer with (upstream's
    /// `ProxyHealthServer.IsHealthy`).
    pub fn is_healthy(&self) -> bool {
        self.status_at(SystemTime::now(), false).healthy
    }

    /// Liveness at `now`: wedged when the sync loop has been inside one step for the liveness
    /// bound or longer, or has been due to wake up for the liveness bound or longer. Live before
    /// the loop runs (starting up, or the IPVS probe retrying). A step's time counts from the
    /// last moment a program it runs proved busy ([`exec::last_busy`]), if later than its start:
    /// slow, not wedged.
    pub fn liveness_at(&self, now: Instant) -> Liveness {
        let stuck = match self.lock().sync_loop {
            Some(LoopState::Working(since)) => {
                let since = exec::last_busy().map_or(since, |busy| busy.max(since));
                now.saturating_duration_since(since)
            }
            Some(LoopState::Waiting(due)) => now.saturating_duration_since(due),
            None => {
                return Liveness {
                    live: true,
                    stuck_for: None,
                }
            }
        };
        let live = stuck < self.liveness_bound;
        Liveness {
            live,
            stuck_for: (!live).then_some(stuck),
        }
    }

    /// Sync health at `now`; with `with_node`, an ineligible node is unhealthy (`/healthz`).
    pub fn status_at(&self, now: SystemTime, with_node: bool) -> HealthStatus {
        let s = self.lock();
        let late =
            |since: SystemTime| now.duration_since(since).unwrap_or(Duration::ZERO) >= self.timeout;
        let mut reasons = Vec::new();
        for ((f, sub), failing) in &s.failing {
            if late(failing.since) {
                reasons.push(Reason {
                    subsystem: sub,
                    family: Some(*f),
                    since: failing.since,
                    last_error: failing.last_error.clone(),
                });
            }
        }
        for (family, pending) in &s.oldest_pending {
            let failing_too = reasons.iter().any(|r| r.family == Some(*family));
            if late(*pending) && !failing_too {
                reasons.push(Reason {
                    subsystem: "pending",
                    family: Some(*family),
                    since: *pending,
                    last_error: String::new(),
                });
            }
        }
        let mut healthy = reasons.is_empty();
        let mut last: Option<SystemTime> = None;
        let mut upstream_healthy = true;
        for (family, updated) in &s.last_updated {
            if last.is_none_or(|l| *updated > l) {
                last = Some(*updated);
            }
            if let Some(pending) = s.oldest_pending.get(family) {
                let age = now.duration_since(*pending).unwrap_or(Duration::ZERO);
                if age >= self.timeout {
                    upstream_healthy = false;
                    last = Some(*updated);
                    break;
                }
            }
        }
        // A family queued but never updated is judged on its pending age too.
        if upstream_healthy {
            for (family, pending) in &s.oldest_pending {
                if s.last_updated.contains_key(family) {
                    continue;
                }
                let age = now.duration_since(*pending).unwrap_or(Duration::ZERO);
                if age >= self.timeout {
                    upstream_healthy = false;
                }
            }
        }
        if s.blocked.is_some() {
            healthy = false;
        }
        healthy &= upstream_healthy;
        if !healthy && upstream_healthy && !reasons.is_empty() {
            // Failing (not only late): lastUpdated is the failing families' last real success.
            last = reasons
                .iter()
                .filter_map(|r| r.family)
                .filter_map(|f| s.last_updated.get(&f).copied())
                .min();
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
            reasons,
            source: s.source.clone(),
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

    /// Logs a change of liveness once per transition.
    fn log_liveness(&self, l: Liveness) {
        let was = self.wedged.swap(!l.live, Ordering::Relaxed);
        match (was, l.stuck_for) {
            (false, Some(stuck)) => tracing::error!(
                stuck_s = stuck.as_secs(),
                bound_s = self.liveness_bound.as_secs(),
                "SYNC LOOP WEDGED: no progress within the liveness bound; /livez answers 503"
            ),
            (true, None) => tracing::info!("sync loop making progress again; /livez answers 200"),
            _ => {}
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

fn reasons_json(reasons: &[Reason]) -> serde_json::Value {
    serde_json::Value::Array(
        reasons
            .iter()
            .map(|r| {
                let mut o = serde_json::json!({
                    "subsystem": r.subsystem,
                    "since": rfc3339(Some(r.since)),
                    "lastError": r.last_error,
                });
                if let Some(f) = r.family {
                    o["family"] = serde_json::Value::String(f.api_name().into());
                }
                o
            })
            .collect(),
    )
}

/// `/healthz`: sync health and node eligibility; the API source's state is reported in the body
/// (`source`), never as a failure.
fn answer_healthz(health: &ProxyHealth) -> Response {
    let st = health.status_at(SystemTime::now(), true);
    let code = if st.healthy {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    health.count(false, code);
    let mut body = serde_json::json!({
        "lastUpdated": rfc3339(st.last_updated),
        "currentTime": rfc3339(Some(st.current_time)),
        "nodeEligible": st.node_eligible,
        "source": match &st.source {
            None => serde_json::json!({"healthy": true}),
            Some(f) => serde_json::json!({
                "healthy": false,
                "since": rfc3339(Some(f.since)),
                "lastError": f.last_error,
            }),
        },
    });
    if let Some(reason) = health.blocked() {
        body["reason"] = serde_json::Value::String(reason);
    }
    if !st.reasons.is_empty() {
        body["reasons"] = reasons_json(&st.reasons);
    }
    json_response(code, body.to_string())
}

/// `/livez`: 503 only for a wedged sync loop (see [`ProxyHealth::liveness_at`]).
fn answer_livez(health: &ProxyHealth) -> Response {
    let now = SystemTime::now();
    let l = health.liveness_at(Instant::now());
    health.log_liveness(l);
    let code = if l.live {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    health.count(true, code);
    let last_updated = if l.live {
        Some(now)
    } else {
        health.lock().last_updated.values().max().copied()
    };
    let mut body = serde_json::json!({
        "lastUpdated": rfc3339(last_updated),
        "currentTime": rfc3339(Some(now)),
    });
    if let Some(stuck) = l.stuck_for {
        let since = now.checked_sub(stuck).unwrap_or(UNIX_EPOCH);
        body["reasons"] = reasons_json(&[Reason {
            subsystem: SYNC_LOOP,
            family: None,
            since,
            last_error: format!(
                "no progress for {}s (liveness bound {}s): a sync or kernel call is hung",
                stuck.as_secs(),
                health.liveness_bound.as_secs()
            ),
        }]);
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
                async move { answer_healthz(&h) }
            }),
        )
        .route(
            "/livez",
            axum::routing::get(move || {
                let h = h2.clone();
                async move { answer_livez(&h) }
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
        h.queued_update_at(Family::Inet, t(1000));
        assert!(h.status_at(t(1059), true).healthy);
        // Late: unhealthy, lastUpdated is the real last update (none yet).
        let st = h.status_at(t(1060), true);
        assert!(!st.healthy);
        // A second queue does not reset the oldest pending time.
        h.queued_update_at(Family::Inet, t(1050));
        assert!(!h.status_at(t(1061), true).healthy);
        // Applied: healthy again; lastUpdated reported as "now".
        h.updated_at(Family::Inet, t(1070));
        let st = h.status_at(t(5000), true);
        assert!(st.healthy);
        assert_eq!(st.last_updated, Some(t(5000)));
        // One late family makes the whole proxy unhealthy; lastUpdated is that family's.
        h.updated_at(Family::Inet6, t(1080));
        h.queued_update_at(Family::Inet6, t(2000));
        let st = h.status_at(t(2060), true);
        assert!(!st.healthy);
        assert_eq!(st.last_updated, Some(t(1080)));
    }

    #[test]
    fn blocked_is_unhealthy_for_healthz_not_livez_with_the_reason() {
        let h = Arc::new(ProxyHealth::new(Duration::from_secs(60), None));
        assert!(h.status_at(t(10), true).healthy);
        h.set_blocked(Some("IPVS probe failing".into()));
        assert!(!h.status_at(t(10), true).healthy);
        assert!(!h.status_at(t(10), false).healthy);
        assert!(!h.is_healthy());
        let r = answer_healthz(&h);
        assert_eq!(r.status(), StatusCode::SERVICE_UNAVAILABLE);
        // The process is retrying the probe: not wedged, a restart would not help.
        assert_eq!(answer_livez(&h).status(), StatusCode::OK);
        assert_eq!(h.blocked().as_deref(), Some("IPVS probe failing"));
        h.set_blocked(None);
        assert!(h.status_at(t(10), true).healthy);
        assert_eq!(answer_healthz(&h).status(), StatusCode::OK);
    }

    #[test]
    fn failing_syncs_are_unhealthy_after_the_window_with_reasons_and_recover() {
        let h = ProxyHealth::new(Duration::from_secs(60), None);
        h.updated_at(Family::Inet, t(1000));
        // Failing from t=1100 (iptables), while nothing is queued.
        h.sync_failed_at(
            Family::Inet,
            &[("iptables", "iptables-restore: resource busy".into())],
            &["iptables"],
            t(1100),
        );
        assert!(h.status_at(t(1159), true).healthy, "inside the window");
        // Still failing later: the start time is kept, the error updated.
        h.sync_failed_at(
            Family::Inet,
            &[("iptables", "iptables-restore: lock held".into())],
            &["iptables"],
            t(1130),
        );
        let st = h.status_at(t(1160), true);
        assert!(!st.healthy);
        assert_eq!(st.last_updated, Some(t(1000)), "the last real success");
        assert_eq!(st.reasons.len(), 1);
        let r = &st.reasons[0];
        assert_eq!(
            (r.subsystem, r.family, r.since, r.last_error.as_str()),
            (
                "iptables",
                Some(Family::Inet),
                t(1100),
                "iptables-restore: lock held"
            )
        );
        // The health-check node ports too: it is the proxy's sync health, not the node's.
        assert!(!h.status_at(t(1160), false).healthy);
        // A retry still outstanding (no new failure) keeps it unhealthy.
        h.sync_failed_at(Family::Inet, &[], &["iptables"], t(1170));
        assert!(!h.status_at(t(1171), true).healthy);
        // Another subsystem recovering does not hide it; recovery does.
        h.updated_at(Family::Inet, t(1180));
        let st = h.status_at(t(1181), true);
        assert!(st.healthy && st.reasons.is_empty());
        // A failed sync never counts as an update: lastUpdated stays at the success.
        h.sync_failed_at(
            Family::Inet,
            &[("ipvs", "EBUSY".into())],
            &["ipvs"],
            t(1200),
        );
        h.queued_update_at(Family::Inet, t(1200));
        let st = h.status_at(t(1261), true);
        assert!(!st.healthy);
        assert_eq!(st.last_updated, Some(t(1180)));
        assert_eq!(
            st.reasons.len(),
            1,
            "pending is explained by the failure: {:?}",
            st.reasons
        );
    }

    #[test]
    fn source_failing_is_reported_and_never_unhealthy() {
        let h = ProxyHealth::new(Duration::from_secs(20), None);
        h.updated_at(Family::Inet, t(90));
        // The API server goes away: reported at once, with the first time and the last error.
        h.source_failing_at(t(100), "connection refused");
        h.source_failing_at(t(110), "connection refused again");
        // Far beyond the window: /healthz and the health-check node ports stay healthy (no
        // change is queued while the source fails), the body carries the failure.
        for with_node in [true, false] {
            let st = h.status_at(t(100_000), with_node);
            assert!(st.healthy, "{st:?}");
            assert!(st.reasons.is_empty(), "{st:?}");
            let src = st.source.unwrap();
            assert_eq!(src.since, t(100));
            assert_eq!(src.last_error, "connection refused again");
        }
        assert!(h.liveness_at(Instant::now()).live);
        h.source_ok();
        assert_eq!(h.status_at(t(100_001), true).source, None);
    }

    #[test]
    fn livez_fails_only_for_a_wedged_sync_loop() {
        let bound = Duration::from_secs(60);
        let h = ProxyHealth::new(Duration::from_secs(20), None);
        assert_eq!(h.liveness_bound(), bound, "2 x 10 s, at least the minimum");
        let h = h.with_liveness_bound(bound);
        let i0 = Instant::now();
        let at = |s: u64| i0 + Duration::from_secs(s);
        // Before the loop runs (starting up, probing): live.
        assert!(h.liveness_at(at(10_000)).live);
        // Sync failures, stale changes and an API outage, all far beyond the windows: /healthz
        // fails for the kernel's sake, /livez does not.
        h.queued_update_at(Family::Inet, t(0));
        h.sync_failed_at(
            Family::Inet,
            &[("iptables", "lock".into())],
            &["iptables"],
            t(0),
        );
        h.source_failing_at(t(0), "connection refused");
        assert!(!h.status_at(t(10_000), true).healthy);
        h.loop_waiting(at(5));
        assert!(h.liveness_at(at(4)).live);
        assert!(h.liveness_at(at(64)).live, "woke up late, inside the bound");
        // A step (a sync) that starts and does not finish: live until the bound has passed.
        h.loop_working_at(at(100));
        assert!(h.liveness_at(at(159)).live);
        // Working again (a second call within the same step) keeps the step's start.
        h.loop_working_at(at(150));
        let l = h.liveness_at(at(160));
        assert!(!l.live);
        assert_eq!(l.stuck_for, Some(bound));
        // The step ends: live again.
        h.loop_waiting(at(170));
        assert!(h.liveness_at(at(165)).live);
        // The loop never wakes up after its due time: wedged after the bound.
        assert!(h.liveness_at(at(229)).live);
        assert!(!h.liveness_at(at(230)).live);
        h.loop_working_at(at(231));
        assert!(h.liveness_at(at(231)).live);
        // The HTTP answer (at the real time: a zero bound is passed at once).
        let h = ProxyHealth::new(Duration::from_secs(20), None).with_liveness_bound(Duration::ZERO);
        assert_eq!(answer_livez(&h).status(), StatusCode::OK, "no loop yet");
        h.loop_working_at(Instant::now());
        assert_eq!(answer_livez(&h).status(), StatusCode::SERVICE_UNAVAILABLE);
    }

    #[test]
    fn hung_sync_with_pending_changes_reports_pending_and_long_errors_are_cut() {
        let h = ProxyHealth::new(Duration::from_secs(20), None);
        h.queued_update_at(Family::Inet6, t(10));
        let st = h.status_at(t(30), true);
        assert!(!st.healthy);
        assert_eq!(st.reasons[0].subsystem, "pending");
        assert_eq!(st.reasons[0].family, Some(Family::Inet6));
        let long = "x".repeat(10_000);
        h.source_failing_at(t(0), &long);
        let st = h.status_at(t(30), true);
        let src = st.source.unwrap();
        assert!(src.last_error.len() <= 512, "{}", src.last_error.len());
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
