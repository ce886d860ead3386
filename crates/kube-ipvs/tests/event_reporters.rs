//! Events about invalid objects are written by a few nodes only (issue #32, item 3), through
//! the engine's observer as the daemon wires it: every node counts the rejection in
//! `kube_ipvs_invalid_objects_total`, only the object's reporters (chosen among the node names
//! of the store's EndpointSlices) queue an Event, the others count it as `delegated`.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::sync::Arc;

use ipvs_netlink::Family;
use kube_ipvs::engine::{endpoint_nodes, Observer};
use kube_ipvs::events::{EventSink, Reporters};
use kube_ipvs::health::ProxyHealth;
use kube_ipvs::metrics::Metrics;
use kube_ipvs::service_health::ServiceHealthServer;
use model::event::{Kind, Object, SourceEvent};
use model::store::Store;
use proxier::sync_loop::SyncObserver;

const NODES: [&str; 6] = ["node-a", "node-b", "node-c", "node-d", "node-e", "node-f"];

/// A Service whose slice has an endpoint on each of the first five nodes (node-f hosts none).
fn store() -> Store {
    let svc: k8s_openapi::api::core::v1::Service = serde_json::from_value(serde_json::json!({
        "metadata": {"name": "web", "namespace": "shop"},
        "spec": {"type": "ClusterIP", "clusterIP": "10.96.0.20", "clusterIPs": ["10.96.0.20"],
                 "ports": [{"name": "http", "port": 80, "targetPort": 8080, "protocol": "TCP"}]}
    }))
    .unwrap();
    let endpoints: Vec<serde_json::Value> = NODES[..5]
        .iter()
        .enumerate()
        .map(|(i, n)| {
            serde_json::json!({"addresses": [format!("10.244.0.{}", i + 2)],
                               "conditions": {"ready": true}, "nodeName": n})
        })
        .collect();
    let slice: k8s_openapi::api::discovery::v1::EndpointSlice =
        serde_json::from_value(serde_json::json!({
            "metadata": {"name": "web-a", "namespace": "shop",
                         "labels": {"kubernetes.io/service-name": "web"}},
            "addressType": "IPv4",
            "ports": [{"name": "http", "port": 8080, "protocol": "TCP"}],
            "endpoints": endpoints
        }))
        .unwrap();
    let mut store = Store::new();
    for (kind, o) in [
        (Kind::Service, Object::from(svc)),
        (Kind::EndpointSlice, Object::from(slice)),
    ] {
        store.apply(SourceEvent::Init(kind));
        store.apply(SourceEvent::InitApply(o));
        store.apply(SourceEvent::InitDone(kind));
    }
    store
}

#[test]
fn each_rejection_is_counted_on_every_node_and_written_by_three() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let _guard = rt.enter();
    let store = store();
    let candidates = endpoint_nodes(&store);
    assert_eq!(candidates.len(), 5, "node-f hosts no endpoint");
    let rejected: Vec<(String, String)> = (0..20)
        .map(|i| {
            (
                format!("service tenant/bad-{i}"),
                "port 70000 out of range 1..65535".to_string(),
            )
        })
        .collect();
    let mut writers = vec![0usize; rejected.len()];
    for node in NODES {
        let metrics = Arc::new(Metrics::new());
        let health = Arc::new(ProxyHealth::new(std::time::Duration::from_secs(60), None));
        let (sink, mut rx) = EventSink::new(Some(metrics.clone()));
        let observer = Observer {
            metrics: metrics.clone(),
            health: health.clone(),
            service_health: Arc::new(ServiceHealthServer::new(
                vec!["127.0.0.1".parse().unwrap()],
                health,
                None,
            )),
            rt: rt.handle().clone(),
            rejections: Some(sink.with_reporters(Reporters::new(node, 3))),
            reported: std::sync::Mutex::default(),
            seen: std::sync::Mutex::default(),
            first_sync: None,
        };
        observer.rejected(Family::Inet, &rejected, &store);
        // Every node counts every rejection.
        let text = metrics.encode().unwrap();
        let line =
            r#"kube_ipvs_invalid_objects_total{kind="Service",reason="port_out_of_range"} 20"#;
        assert!(text.contains(line), "{node}: {line} missing:\n{text}");
        // Only the reporters queue an Event.
        while let Ok(ev) = rx.try_recv() {
            let i: usize = ev.regarding.name["bad-".len()..].parse().unwrap();
            writers[i] += 1;
        }
        if node == "node-f" {
            let line = r#"kube_ipvs_events_dropped_total{reason="delegated"} 20"#;
            assert!(text.contains(line), "{node} hosts no endpoint:\n{text}");
        }
    }
    assert!(writers.iter().all(|w| *w == 3), "{writers:?}");
}
