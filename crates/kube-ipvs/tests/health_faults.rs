//! The engine's observer under injected kernel faults (testkit's `FaultKernel`): a failing
//! subsystem makes `/healthz` 503 once the health window has passed, with the subsystem named,
//! and 200 again after the retry succeeds; the failure metrics carry only the fixed subsystem
//! labels, never object names from error text. Health is judged at explicit instants
//! (`status_at`), so nothing depends on timing.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::collections::BTreeSet;
use std::net::IpAddr;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use ipvs_netlink::Family;
use kube_ipvs::engine::Observer;
use kube_ipvs::health::ProxyHealth;
use kube_ipvs::metrics::Metrics;
use kube_ipvs::service_health::ServiceHealthServer;
use model::event::{Kind, Object, SourceEvent};
use model::store::Store;
use model::ProxyConfig;
use proxier::ipvs_mode::{Proxier, RulesConfig};
use proxier::retry::RetryPolicy;
use proxier::sync_loop::{FamilyProxier, SyncObserver};
use testkit::fake_kernel::FakeKernel;
use testkit::faults::{Calls, Fault, FaultKernel, KernelOp, EBUSY};

const WINDOW: Duration = Duration::from_secs(60);

fn store() -> Store {
    let objects: Vec<Object> = objects();
    let mut store = Store::new();
    for kind in [Kind::Service, Kind::EndpointSlice] {
        store.apply(SourceEvent::Init(kind));
        for o in &objects {
            let k = match o {
                Object::Service(_) => Kind::Service,
                Object::EndpointSlice(_) => Kind::EndpointSlice,
                Object::Node(_) => Kind::Node,
            };
            if k == kind {
                store.apply(SourceEvent::InitApply(o.clone()));
            }
        }
        store.apply(SourceEvent::InitDone(kind));
    }
    assert!(store.synced());
    store
}

fn objects() -> Vec<Object> {
    let svc: k8s_openapi::api::core::v1::Service = serde_json::from_value(serde_json::json!({
        "metadata": {"name": "secret-name-1234", "namespace": "tenant-xyz"},
        "spec": {"type": "ClusterIP", "clusterIP": "10.96.0.20", "clusterIPs": ["10.96.0.20"],
                 "ports": [{"name": "http", "port": 80, "targetPort": 8080, "protocol": "TCP"}]}
    }))
    .unwrap();
    let slice: k8s_openapi::api::discovery::v1::EndpointSlice =
        serde_json::from_value(serde_json::json!({
            "metadata": {"name": "secret-name-1234-a", "namespace": "tenant-xyz",
                         "labels": {"kubernetes.io/service-name": "secret-name-1234"}},
            "addressType": "IPv4",
            "ports": [{"name": "http", "port": 8080, "protocol": "TCP"}],
            "endpoints": [{"addresses": ["10.244.0.7"], "conditions": {"ready": true}}]
        }))
        .unwrap();
    vec![Object::from(svc), Object::from(slice)]
}

fn node_addrs() -> BTreeSet<IpAddr> {
    ["192.168.0.10".parse().unwrap()].into_iter().collect()
}

#[test]
fn failing_ipvs_turns_healthz_503_after_the_window_with_reason_then_200_and_fixed_labels() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let metrics = Arc::new(Metrics::new());
    let health = Arc::new(ProxyHealth::new(WINDOW, Some(metrics.clone())));
    let observer = Observer {
        metrics: metrics.clone(),
        health: health.clone(),
        service_health: Arc::new(ServiceHealthServer::new(
            vec!["127.0.0.1".parse().unwrap()],
            health.clone(),
            None,
        )),
        rt: rt.handle().clone(),
        rejections: None,
        reported: std::sync::Mutex::default(),
        seen: std::sync::Mutex::default(),
        first_sync: None,
    };
    let (kernel, faults) = FaultKernel::new(FakeKernel::default());
    faults.inject(Fault::errno(KernelOp::ApplyIpvs, EBUSY, Calls::From(1)));
    let proxier = Proxier::new(
        ProxyConfig::new(Family::Inet),
        RulesConfig::default(),
        "node-1",
    )
    .with_retry(RetryPolicy::new(
        Duration::from_secs(1),
        Duration::from_secs(30),
    ));
    let mut backend = FamilyProxier {
        proxier,
        kernel: Box::new(kernel),
    };
    let store = store();

    let t0 = Instant::now();
    let wall0 = SystemTime::now();
    let r = backend
        .proxier
        .sync_at(t0, &store, &node_addrs(), backend.kernel.as_mut());
    assert!(!r.healthy());
    observer.synced(Family::Inet, &r, &backend);
    // Inside the window: still healthy (a transient fault is not an outage).
    assert!(
        health
            .status_at(wall0 + Duration::from_secs(30), true)
            .healthy
    );
    // Retries keep failing.
    let mut at = t0;
    for _ in 0..3 {
        at = backend.proxier.retry_due().unwrap();
        let r = backend
            .proxier
            .sync_at(at, &store, &node_addrs(), backend.kernel.as_mut());
        assert!(!r.healthy());
        observer.synced(Family::Inet, &r, &backend);
    }
    let st = health.status_at(wall0 + WINDOW + Duration::from_secs(1), true);
    assert!(!st.healthy, "{st:?}");
    assert_eq!(st.reasons.len(), 1, "{:?}", st.reasons);
    assert_eq!(st.reasons[0].subsystem, "ipvs");
    assert!(
        st.reasons[0].last_error.contains("busy"),
        "{}",
        st.reasons[0].last_error
    );
    let last_updated_while_failing = st.last_updated;
    assert_eq!(last_updated_while_failing, None, "no sync ever succeeded");

    // The fault clears; the next retry succeeds and health is 200 again.
    faults.clear();
    let at = backend.proxier.retry_due().unwrap().max(at);
    let r = backend
        .proxier
        .sync_at(at, &store, &node_addrs(), backend.kernel.as_mut());
    assert!(r.healthy(), "{:?}", r.errors);
    observer.synced(Family::Inet, &r, &backend);
    let st = health.status_at(SystemTime::now() + WINDOW * 2, true);
    assert!(st.healthy, "{st:?}");

    // Metrics: the fixed subsystem set only; the object's name never becomes a label.
    let text = metrics.encode().unwrap();
    let fixed = [
        "ipvs",
        "address",
        "ipset",
        "iptables",
        "conntrack",
        "sysctl",
        "source",
    ];
    for line in text.lines().filter(|l| {
        l.starts_with("kube_ipvs_sync_errors_total")
            || l.starts_with("kube_ipvs_sync_failures_total")
            || l.starts_with("kube_ipvs_last_successful_sync_age_seconds")
    }) {
        let label = line
            .split("subsystem=\"")
            .nth(1)
            .and_then(|r| r.split('"').next())
            .unwrap_or_else(|| panic!("no subsystem label: {line}"));
        assert!(fixed.contains(&label), "unbounded label in {line}");
    }
    assert!(!text.contains("secret-name-1234"), "{text}");
    assert!(!text.contains("tenant-xyz"), "{text}");
    assert!(
        text.contains("kube_ipvs_sync_failures_total{subsystem=\"ipvs\"} 4"),
        "{text}"
    );
    assert!(
        text.contains("kube_ipvs_sync_failures_total{subsystem=\"iptables\"} 0"),
        "{text}"
    );
    assert!(
        text.lines().any(
            |l| l.starts_with("kube_ipvs_last_successful_sync_age_seconds{subsystem=\"ipvs\"}")
        ),
        "{text}"
    );
}

/// Issue #32: a Service whose programming the kernel refuses (EINVAL for its virtual server,
/// every time) is isolated: `/healthz` stays 200 well past the health window, one
/// `KernelRefused` Event regards the Service, and the refusal is counted under fixed labels.
#[test]
fn a_service_the_kernel_refuses_never_makes_healthz_fail_and_is_reported_once() {
    use proxier::sync_loop::Backend as _;
    let rt = tokio::runtime::Runtime::new().unwrap();
    let metrics = Arc::new(Metrics::new());
    let health = Arc::new(ProxyHealth::new(WINDOW, Some(metrics.clone())));
    let (sink, mut events) = kube_ipvs::events::EventSink::new(Some(metrics.clone()));
    let observer = Observer {
        metrics: metrics.clone(),
        health: health.clone(),
        service_health: Arc::new(ServiceHealthServer::new(
            vec!["127.0.0.1".parse().unwrap()],
            health.clone(),
            None,
        )),
        rt: rt.handle().clone(),
        rejections: Some(sink),
        reported: std::sync::Mutex::default(),
        seen: std::sync::Mutex::default(),
        first_sync: None,
    };
    let (kernel, faults) = FaultKernel::new(FakeKernel::default());
    faults.refuse_ipvs(
        ipvs_netlink::ServiceKey::Inet {
            protocol: ipvs_netlink::Protocol::Tcp,
            addr: "10.96.0.20".parse().unwrap(),
            port: 80,
        },
        testkit::faults::EINVAL,
    );
    let proxier = Proxier::new(
        ProxyConfig::new(Family::Inet),
        RulesConfig::default(),
        "node-1",
    )
    .with_retry(RetryPolicy::new(
        Duration::from_secs(1),
        Duration::from_secs(30),
    ));
    let mut backend = FamilyProxier {
        proxier,
        kernel: Box::new(kernel),
    };
    let store = store();
    let wall0 = SystemTime::now();
    let mut at = Instant::now();
    // The first sync fails like any (retried), then every retry is refused: isolated.
    for _ in 0..6 {
        let r = backend
            .proxier
            .sync_at(at, &store, &node_addrs(), backend.kernel.as_mut());
        observer.synced(Family::Inet, &r, &backend);
        let refused = backend.take_refusals();
        if !refused.is_empty() {
            observer.refused(Family::Inet, &refused);
        }
        at = backend.proxier.retry_due().expect("retried with backoff");
    }
    assert_eq!(backend.refused_services(), 1);
    let st = health.status_at(wall0 + WINDOW * 3, true);
    assert!(st.healthy, "{st:?}");
    let ev = events.try_recv().expect("one KernelRefused Event");
    assert_eq!(ev.reason, "KernelRefused");
    assert_eq!(ev.regarding.kind, "Service");
    assert_eq!(ev.regarding.namespace.as_deref(), Some("tenant-xyz"));
    assert_eq!(ev.regarding.name, "secret-name-1234");
    assert!(ev.note.contains("ipvs"), "{}", ev.note);
    assert!(events.try_recv().is_err(), "reported once");
    let text = metrics.encode().unwrap();
    assert!(
        text.contains("kube_ipvs_kernel_refusals_total{subsystem=\"ipvs\",reason=\"einval\"} 1"),
        "{text}"
    );
    assert!(text.contains("kube_ipvs_refused_services 1"), "{text}");
    // The error text (which names the Service) never becomes a label.
    assert!(
        !text
            .lines()
            .any(|l| !l.starts_with('#') && l.contains("secret-name-1234")),
        "{text}"
    );
}
