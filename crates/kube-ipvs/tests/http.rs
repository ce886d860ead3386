//! The HTTP servers answered over real TCP connections: /healthz, /livez, /metrics and the
//! health-check node ports.

// Test helpers outside #[test] fns may unwrap/panic too.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::collections::BTreeMap;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use common::{free_port, get};
use ipvs_netlink::Family;
use k8s_openapi::api::core::v1::Node;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use kube_ipvs::config::ProxyMode;
use kube_ipvs::health::{self, ProxyHealth};
use kube_ipvs::http;
use kube_ipvs::metrics::{self, Metrics};
use kube_ipvs::service_health::{HealthCheckService, NamespacedName, ServiceHealthServer};

const LOCALHOST: IpAddr = IpAddr::V4(Ipv4Addr::LOCALHOST);

fn any_port() -> SocketAddr {
    SocketAddr::new(LOCALHOST, 0)
}

#[tokio::test]
async fn healthz_and_livez_follow_upstream_semantics() {
    let m = Arc::new(Metrics::new());
    let h = Arc::new(ProxyHealth::new(Duration::from_secs(60), Some(m.clone())));
    let srv = http::serve("healthz", any_port(), health::router(h.clone()), None)
        .await
        .unwrap();

    // Starting up: healthy, with upstream's headers and JSON fields.
    let r = get(srv.addr, "/healthz").await.unwrap();
    assert_eq!(r.status, 200, "{r:?}");
    assert_eq!(r.header("content-type"), Some("application/json"));
    assert_eq!(r.header("x-content-type-options"), Some("nosniff"));
    let j = r.json();
    assert_eq!(j["nodeEligible"], true);
    assert!(j["lastUpdated"].as_str().unwrap().ends_with('Z'));
    assert_eq!(
        j["lastUpdated"], j["currentTime"],
        "healthy: lastUpdated is now"
    );
    let r = get(srv.addr, "/livez").await.unwrap();
    assert_eq!(r.status, 200);
    assert!(r.json().get("nodeEligible").is_none());

    // An update queued two minutes ago and never applied: /healthz is stale (upstream). /livez
    // is not: it fails only for a wedged sync loop (issue #32; upstream's /livez answers the
    // same freshness, which restarts a proxy that cannot fix what holds its syncs back).
    h.updated_at(Family::Inet, SystemTime::now() - Duration::from_secs(300));
    h.queued_update_at(Family::Inet, SystemTime::now() - Duration::from_secs(120));
    let r = get(srv.addr, "/healthz").await.unwrap();
    assert_eq!(r.status, 503, "{r:?}");
    assert_ne!(r.json()["lastUpdated"], r.json()["currentTime"]);
    assert_eq!(get(srv.addr, "/livez").await.unwrap().status, 200);
    // A sync loop step that started two minutes ago and never ended (bound: 60 s): wedged.
    h.loop_working_at(
        Instant::now()
            .checked_sub(Duration::from_secs(120))
            .unwrap(),
    );
    let r = get(srv.addr, "/livez").await.unwrap();
    assert_eq!(r.status, 503, "{r:?}");
    assert_eq!(r.json()["reasons"][0]["subsystem"], "sync-loop", "{r:?}");
    h.loop_waiting(Instant::now() + Duration::from_secs(1));

    // Applied: healthy again.
    h.updated(Family::Inet);
    assert_eq!(get(srv.addr, "/healthz").await.unwrap().status, 200);

    // The Node is being deleted: /healthz fails, /livez does not.
    let mut node = Node::default();
    node.metadata.deletion_timestamp = Some(Time(Default::default()));
    h.sync_node(&node);
    let r = get(srv.addr, "/healthz").await.unwrap();
    assert_eq!(r.status, 503);
    assert_eq!(r.json()["nodeEligible"], false);
    assert_eq!(get(srv.addr, "/livez").await.unwrap().status, 200);

    // Unknown paths are 404.
    assert_eq!(get(srv.addr, "/nope").await.unwrap().status, 404);

    // The request counters saw all of it.
    let text = m.encode().unwrap();
    assert!(
        text.contains("kubeproxy_proxy_healthz_total{code=\"200\"} 2"),
        "{text}"
    );
    assert!(
        text.contains("kubeproxy_proxy_healthz_total{code=\"503\"} 2"),
        "{text}"
    );
    assert!(
        text.contains("kubeproxy_proxy_livez_total{code=\"200\"} 3"),
        "{text}"
    );
    assert!(
        text.contains("kubeproxy_proxy_livez_total{code=\"503\"} 1"),
        "{text}"
    );
    srv.stop().await;
}

#[tokio::test]
async fn metrics_endpoint_exposes_upstream_and_own_names() {
    let m = Arc::new(Metrics::new());
    m.set_proxy_mode(ProxyMode::Ipvs);
    m.init_families(&[ipvs_netlink::Family::Inet]);
    m.record_sync(
        ipvs_netlink::Family::Inet,
        proxier::ipvs_mode::SyncKind::Incremental,
        0.004,
    );
    m.record_queued(ipvs_netlink::Family::Inet);
    // A change triggered 2 s ago, programmed now.
    m.record_network_programmed(
        ipvs_netlink::Family::Inet,
        &[SystemTime::now() - Duration::from_secs(2)],
    );
    m.endpoint_changes_total.inc_by(3);
    m.drift_repairs_total
        .get_or_create(&metrics::SubsystemLabel {
            subsystem: "ipvs".into(),
        })
        .inc();
    m.invalid_objects_total
        .get_or_create(&metrics::InvalidObjectLabels {
            kind: "Service".into(),
            reason: "bad_cluster_ip".into(),
        })
        .inc();
    m.ipvs_requests_total
        .get_or_create(&metrics::OpLabel {
            op: "new_service".into(),
        })
        .inc_by(2);
    let srv = http::serve("metrics", any_port(), metrics::router(m.clone()), None)
        .await
        .unwrap();
    let r = get(srv.addr, "/metrics").await.unwrap();
    assert_eq!(r.status, 200);
    assert_eq!(r.header("content-type"), Some(metrics::CONTENT_TYPE));
    let body = r.body;
    for name in [
        "# TYPE kubeproxy_sync_proxy_rules_duration_seconds histogram",
        "# TYPE kubeproxy_network_programming_duration_seconds histogram",
        "# TYPE kubeproxy_sync_proxy_rules_last_timestamp_seconds gauge",
        "# TYPE kubeproxy_sync_proxy_rules_last_queued_timestamp_seconds gauge",
        "kubeproxy_sync_proxy_rules_endpoint_changes_pending 0",
        "kubeproxy_sync_proxy_rules_endpoint_changes_total 3",
        "kubeproxy_sync_proxy_rules_service_changes_pending 0",
        "kubeproxy_sync_proxy_rules_service_changes_total 0",
        "kubeproxy_sync_proxy_rules_iptables_restore_failures_total{ip_family=\"IPv4\"} 0",
        "# TYPE kubeproxy_sync_partial_proxy_rules_duration_seconds histogram",
        "kubeproxy_conntrack_reconciler_deleted_entries_total{ip_family=\"IPv4\"} 0",
        "# TYPE kubeproxy_sync_proxy_rules_no_local_endpoints_total gauge",
        "kube_ipvs_proxy_mode{mode=\"ipvs\"} 1",
        "kube_ipvs_proxy_mode{mode=\"iptables\"} 0",
        "kube_ipvs_drift_repairs_total{subsystem=\"ipvs\"} 1",
        "kube_ipvs_invalid_objects_total{kind=\"Service\",reason=\"bad_cluster_ip\"} 1",
        "kube_ipvs_ipvs_requests_total{op=\"new_service\"} 2",
        "kubeproxy_sync_proxy_rules_no_local_endpoints_total{ip_family=\"IPv4\",traffic_policy=\"internal\"} 0",
        "kube_ipvs_ipvs_requests_total{op=\"get_dest\"} 0",
        "kube_ipvs_draining_destinations 0",
        "# EOF",
    ] {
        assert!(body.contains(name), "missing {name:?} in\n{body}");
    }
    // Upstream's buckets: exponential from 1 ms (15 buckets), the 4 ms sync lands in le=0.004.
    // Every per-family series carries upstream's ip_family label (1.33).
    for line in [
        "kubeproxy_sync_proxy_rules_duration_seconds_bucket{le=\"0.001\",ip_family=\"IPv4\"} 0",
        "kubeproxy_sync_proxy_rules_duration_seconds_bucket{le=\"0.004\",ip_family=\"IPv4\"} 1",
        "kubeproxy_sync_proxy_rules_duration_seconds_bucket{le=\"16.384\",ip_family=\"IPv4\"} 1",
        "kubeproxy_sync_proxy_rules_duration_seconds_count{ip_family=\"IPv4\"} 1",
        "kubeproxy_sync_partial_proxy_rules_duration_seconds_count{ip_family=\"IPv4\"} 1",
        "kubeproxy_network_programming_duration_seconds_bucket{le=\"0.25\",ip_family=\"IPv4\"} 0",
        "kubeproxy_network_programming_duration_seconds_bucket{le=\"115.0\",ip_family=\"IPv4\"} 1",
        "kubeproxy_network_programming_duration_seconds_bucket{le=\"300.0\",ip_family=\"IPv4\"} 1",
        "kubeproxy_network_programming_duration_seconds_count{ip_family=\"IPv4\"} 1",
    ] {
        assert!(body.contains(line), "missing {line:?} in\n{body}");
    }
    assert!(!body.contains("kubeproxy_sync_full_proxy_rules_duration_seconds_count"));
    // The timestamp is a recent unix time.
    let ts: f64 = body
        .lines()
        .find_map(|l| {
            l.strip_prefix("kubeproxy_sync_proxy_rules_last_timestamp_seconds{ip_family=\"IPv4\"} ")
        })
        .unwrap()
        .parse()
        .unwrap();
    assert!(ts > 1.6e9, "{ts}");

    // Cross-check with a real HTTP client if the host has one.
    // (tokio's process API, so the server keeps running on this single-threaded runtime).
    if let Ok(out) = tokio::process::Command::new("curl")
        .args(["-sf", "-m", "60", &format!("http://{}/metrics", srv.addr)])
        .output()
        .await
    {
        assert!(out.status.success(), "{out:?}");
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(text.contains("kubeproxy_sync_proxy_rules_endpoint_changes_total 3"));
    }
    srv.stop().await;
}

#[tokio::test]
async fn bind_failure_is_an_error_naming_the_address() {
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = taken.local_addr().unwrap();
    let h = Arc::new(ProxyHealth::new(Duration::from_secs(60), None));
    let err = http::serve("healthz", addr, health::router(h), None)
        .await
        .unwrap_err();
    let msg = err.to_string();
    assert!(
        msg.contains("healthz") && msg.contains(&addr.to_string()),
        "{msg}"
    );
}

fn svc(ns: &str, name: &str, n: usize) -> HealthCheckService {
    HealthCheckService {
        service: NamespacedName::new(ns, name),
        local_endpoints: n,
    }
}

#[tokio::test]
async fn health_check_node_ports_open_answer_and_close() {
    let h = Arc::new(ProxyHealth::new(Duration::from_secs(60), None));
    let m = Arc::new(Metrics::new());
    let server = ServiceHealthServer::new(vec![LOCALHOST], h.clone(), Some(m.clone()));
    let (p1, p2) = (free_port(), free_port());
    let at = |p: u16| SocketAddr::new(LOCALHOST, p);

    let mut wanted = BTreeMap::from([
        (p1, svc("shop", "web", 2)),
        (p2, svc("ingress", "nginx", 0)),
    ]);
    assert!(server.sync_services(&wanted).await.is_empty());
    assert_eq!(server.bound().await.len(), 2);
    assert!(m
        .encode()
        .unwrap()
        .contains("kube_ipvs_health_check_node_ports 2"));

    // Local endpoints and a healthy proxy: 200 on any path, upstream's body and headers.
    let r = get(at(p1), "/").await.unwrap();
    assert_eq!(r.status, 200, "{r:?}");
    assert_eq!(r.header("content-type"), Some("application/json"));
    assert_eq!(r.header("x-content-type-options"), Some("nosniff"));
    assert_eq!(r.header("x-load-balancing-endpoint-weight"), Some("2"));
    assert_eq!(
        r.json(),
        serde_json::json!({"service": {"namespace": "shop", "name": "web"}, "localEndpoints": 2, "serviceProxyHealthy": true})
    );
    assert_eq!(get(at(p1), "/healthz?x=1").await.unwrap().status, 200);
    // No local endpoints: 503.
    let r = get(at(p2), "/").await.unwrap();
    assert_eq!(r.status, 503);
    assert_eq!(r.json()["localEndpoints"], 0);
    assert_eq!(r.header("x-load-balancing-endpoint-weight"), Some("0"));

    // Counts update in place.
    wanted.insert(p1, svc("shop", "web", 0));
    wanted.insert(p2, svc("ingress", "nginx", 5));
    assert!(server.sync_services(&wanted).await.is_empty());
    assert_eq!(get(at(p1), "/").await.unwrap().status, 503);
    let r = get(at(p2), "/").await.unwrap();
    assert_eq!(r.status, 200);
    assert_eq!(r.json()["localEndpoints"], 5);

    // A stale proxy makes every health check fail, even with endpoints.
    h.queued_update_at(Family::Inet, SystemTime::now() - Duration::from_secs(600));
    let r = get(at(p2), "/").await.unwrap();
    assert_eq!(r.status, 503);
    assert_eq!(r.json()["serviceProxyHealthy"], false);
    h.updated(Family::Inet);

    // A port handed to another service is reopened for it; a removed port is closed.
    wanted.remove(&p1);
    wanted.insert(p2, svc("other", "svc", 1));
    assert!(server.sync_services(&wanted).await.is_empty());
    assert!(get(at(p1), "/").await.is_err(), "closed port still answers");
    let r = get(at(p2), "/").await.unwrap();
    assert_eq!(r.json()["service"]["namespace"], "other");
    // And the closed port can be opened again at once.
    wanted.insert(p1, svc("shop", "web", 1));
    assert!(server.sync_services(&wanted).await.is_empty());
    assert_eq!(get(at(p1), "/").await.unwrap().status, 200);

    server.shutdown().await;
    assert!(get(at(p1), "/").await.is_err());
    assert!(get(at(p2), "/").await.is_err());
}

#[tokio::test]
async fn health_check_port_in_use_is_reported_and_retried() {
    let h = Arc::new(ProxyHealth::new(Duration::from_secs(60), None));
    let server = ServiceHealthServer::new(vec![LOCALHOST], h, None);
    let blocker = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let busy = blocker.local_addr().unwrap().port();
    let ok = free_port();
    let wanted = BTreeMap::from([(busy, svc("a", "busy", 1)), (ok, svc("a", "fine", 1))]);
    let errs = server.sync_services(&wanted).await;
    assert_eq!(errs.len(), 1, "{errs:?}");
    assert!(errs[0].to_string().contains("a/busy"), "{}", errs[0]);
    assert_eq!(
        get(SocketAddr::new(LOCALHOST, ok), "/")
            .await
            .unwrap()
            .status,
        200
    );
    // Once the port is free, the next sync opens it.
    drop(blocker);
    assert!(server.sync_services(&wanted).await.is_empty());
    let r = get(SocketAddr::new(LOCALHOST, busy), "/").await.unwrap();
    assert_eq!(r.json()["service"]["name"], "busy");
    server.shutdown().await;
}
