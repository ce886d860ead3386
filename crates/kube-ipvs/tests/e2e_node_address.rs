//! End-to-end test of issue #32's node-address item in the VM, with the real daemon and the
//! fake API server (`--kubeconfig`): an externalIP equal to the node's address never takes
//! another Service's NodePort nor a protected node port (kubelet's 10250).
//!
//! Lab: the node namespace of `api_lab` (node0 = 192.168.0.10), one pod with an echo server
//! (10.244.0.7, the NodePort owner's endpoint); the hijackers' endpoint 10.244.0.9 runs
//! nothing, so a connection it took would fail. `zz/np-owner` has NodePort 30080; `aa/hijack`
//! lists `externalIPs: [192.168.0.10]` on port 30080 and sorts first by name (a rule giving a
//! shared IPVS key to the smaller name, the behaviour before, hands it the NodePort);
//! `aa/kubelet` lists the same address on port 10250.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod api_lab;
mod common;

use std::net::{Ipv4Addr, SocketAddr};
use std::time::{Duration, Instant};

use api_lab::{sh, wait_ipvs, Daemon, Lab};
use k8s_openapi::api::core::v1::Service;
use serde_json::{json, Value};
use testkit::apiserver::FakeApiServer;

const NODE: &str = r#"{"apiVersion": "v1", "kind": "Node",
  "metadata": {"name": "node-1", "labels": {"kubernetes.io/hostname": "node-1"}},
  "status": {"addresses": [{"type": "InternalIP", "address": "192.168.0.10"}]}}"#;

fn service(ns: &str, name: &str, cluster_ip: &str, port: Value, external_ips: &[&str]) -> Value {
    let node_port = port.get("nodePort").is_some();
    json!({
        "apiVersion": "v1", "kind": "Service",
        "metadata": {"name": name, "namespace": ns},
        "spec": {"type": if node_port { "NodePort" } else { "ClusterIP" },
                 "clusterIP": cluster_ip, "clusterIPs": [cluster_ip],
                 "externalIPs": external_ips, "ports": [port]}
    })
}

fn slice(ns: &str, name: &str, service: &str, address: &str) -> Value {
    json!({
        "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
        "metadata": {"name": name, "namespace": ns,
                     "labels": {"kubernetes.io/service-name": service}},
        "addressType": "IPv4",
        "ports": [{"name": "http", "port": 8080, "protocol": "TCP"}],
        "endpoints": [{"addresses": [address], "conditions": {"ready": true}}]
    })
}

fn load(api: &FakeApiServer, objs: &[Value]) {
    let text = serde_json::to_string(&json!({"kind": "List", "items": objs})).unwrap();
    assert_eq!(api.load_str(&text).unwrap(), objs.len());
}

fn metric(text: &str, prefix: &str) -> Option<f64> {
    text.lines()
        .find(|l| l.starts_with(prefix))
        .and_then(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
}

/// Polls `/metrics` until `pred` holds; the deadline only prevents a hang.
async fn wait_metrics(d: &Daemon, what: &str, pred: impl Fn(&str) -> bool) -> String {
    let start = Instant::now();
    loop {
        let m = common::get(d.metrics, "/metrics").await.unwrap().body;
        if pred(&m) {
            return m;
        }
        assert!(
            start.elapsed() < Duration::from_secs(180),
            "never saw {what}:\n{m}\n{}",
            d.log()
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

/// The first Event on `ns/name`; the deadline only prevents a hang.
async fn wait_event(api: &FakeApiServer, d: &Daemon, ns: &str, name: &str) -> Value {
    let start = Instant::now();
    loop {
        let found = api
            .events()
            .into_iter()
            .find(|e| e["regarding"]["name"] == name && e["regarding"]["namespace"] == ns);
        if let Some(e) = found {
            return e;
        }
        assert!(
            start.elapsed() < Duration::from_secs(60),
            "no Event on {ns}/{name}:\n{}",
            d.log()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

const NODE_PORT: &str = r#"-A -t 192.168.0.10:30080"#;

#[test]
#[ignore = "vm"]
fn vm_e2e_node_address_external_ip_never_takes_a_node_port_or_kubelets_port() {
    // 10.244.0.7 runs an echo server; 10.244.0.9 (the hijackers' endpoint) runs nothing.
    let lab = Lab::new("e2e-nodeaddr", &[Ipv4Addr::new(10, 244, 0, 7)]);
    lab.run(node_address);
}

async fn node_address() {
    let api = FakeApiServer::start().await.unwrap();
    let http =
        |port: i64| json!({"name": "http", "port": port, "targetPort": 8080, "protocol": "TCP"});
    let mut np = http(80);
    np["nodePort"] = json!(30080);
    load(
        &api,
        &[
            serde_json::from_str(NODE).unwrap(),
            service("zz", "np-owner", "10.96.0.40", np, &[]),
            slice("zz", "np-owner-1", "np-owner", "10.244.0.7"),
            service("aa", "hijack", "10.96.0.41", http(30080), &["192.168.0.10"]),
            slice("aa", "hijack-1", "hijack", "10.244.0.9"),
            service(
                "aa",
                "kubelet",
                "10.96.0.42",
                http(10250),
                &["192.168.0.10"],
            ),
            slice("aa", "kubelet-1", "kubelet", "10.244.0.9"),
        ],
    );
    let kc = std::env::temp_dir().join(format!("e2e-nodeaddr-kc-{}.yaml", std::process::id()));
    api.write_kubeconfig(&kc).unwrap();
    let mut d = Daemon::start(kc.to_str().unwrap(), &["--ipvs-sync-period", "10s"]);
    // Every Service programmed: the NodePort with its endpoint, the hijackers' ClusterIPs.
    let table = wait_ipvs(
        &d,
        "the NodePort and both ClusterIPs",
        Duration::from_secs(120),
        |t| {
            t.contains("-a -t 192.168.0.10:30080 -r 10.244.0.7:8080 -m")
                && t.contains("-a -t 10.96.0.41:30080 -r 10.244.0.9:8080 -m")
                && t.contains("-a -t 10.96.0.42:10250 -r 10.244.0.9:8080 -m")
        },
    )
    .await;
    println!("{table}");
    assert!(table.contains(NODE_PORT), "{table}");
    assert!(
        !table.contains("-a -t 192.168.0.10:30080 -r 10.244.0.9:8080"),
        "the hijacker's endpoint is behind the NodePort:\n{table}"
    );
    assert!(
        !table.contains("192.168.0.10:10250"),
        "a virtual server on kubelet's port:\n{table}"
    );
    let ext = sh("ipset list KUBE-EXTERNAL-IP");
    assert!(!ext.contains("192.168.0.10"), "{ext}");
    // Live traffic to the node's address and NodePort reaches the owner's pod (the hijacker's
    // endpoint has no server: a connection it took would fail).
    let to: SocketAddr = "192.168.0.10:30080".parse().unwrap();
    let (mut ok, mut failed) = (0, 0);
    for n in 0..20 {
        match api_lab::echo_once(to, n) {
            Ok(()) => ok += 1,
            Err(e) => {
                failed += 1;
                println!("{to}: {e}");
            }
        }
    }
    println!("NodePort {to}: {ok} ok, {failed} failed");
    assert_eq!(failed, 0);

    // Each hijacker gets a NodeAddressConflict Event naming what the node keeps; none on the
    // owner; the gauge counts one of each.
    for (name, says) in [
        (
            "hijack",
            "192.168.0.10:30080/TCP is the NodePort of zz/np-owner",
        ),
        ("kubelet", "192.168.0.10:10250/TCP is a protected node port"),
    ] {
        let ev = wait_event(&api, &d, "aa", name).await;
        println!("event on aa/{name}: {} {}", ev["reason"], ev["note"]);
        assert_eq!(ev["type"], "Warning");
        assert_eq!(ev["reason"], "NodeAddressConflict");
        let note = ev["note"].as_str().unwrap();
        assert!(note.contains(says), "{note}");
    }
    assert!(
        !api.events()
            .iter()
            .any(|e| e["regarding"]["name"] == "np-owner"),
        "no Event on the owner"
    );
    let m = wait_metrics(&d, "the node-address conflicts", |m| {
        metric(m, "kube_ipvs_node_address_conflicts{reason=\"node_port\"}") == Some(1.0)
            && metric(
                m,
                "kube_ipvs_node_address_conflicts{reason=\"protected_port\"}",
            ) == Some(1.0)
    })
    .await;
    assert_eq!(metric(&m, "kube_ipvs_vip_conflicts "), Some(0.0), "{m}");
    assert_eq!(
        metric(&m, "kube_ipvs_node_address_conflicts{reason=\"refused\"}"),
        Some(0.0),
        "{m}"
    );

    // The NodePort's Service goes: the hijacker's claim is served now (its endpoint behind
    // the node address), kubelet's port stays untouched.
    api.delete::<Service>("zz", "np-owner").unwrap();
    let table = wait_ipvs(&d, "the claim taking over", Duration::from_secs(60), |t| {
        t.contains("-a -t 192.168.0.10:30080 -r 10.244.0.9:8080 -m")
            && !t.contains("-a -t 192.168.0.10:30080 -r 10.244.0.7:8080")
    })
    .await;
    assert!(!table.contains("192.168.0.10:10250"), "{table}");
    let m = wait_metrics(&d, "only the protected port left", |m| {
        metric(m, "kube_ipvs_node_address_conflicts{reason=\"node_port\"}") == Some(0.0)
    })
    .await;
    assert_eq!(
        metric(
            &m,
            "kube_ipvs_node_address_conflicts{reason=\"protected_port\"}"
        ),
        Some(1.0),
        "{m}"
    );
    assert!(d.alive(), "{}", d.log());
    let (code, log) = d.stop();
    assert_eq!(code, Some(0), "{log}");
    let _ = std::fs::remove_file(&kc);
}
