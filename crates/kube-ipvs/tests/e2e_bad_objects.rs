//! End-to-end scenario 5 (issue #9), in the VM: malformed Services and EndpointSlices mixed
//! with good ones, served by the fake API server to the real daemon (`--kubeconfig`).
//!
//! Bad objects: a clusterIP that is not an IP, a port out of range, an unknown protocol, duplicate
//! ports, an EndpointSlice with 10,000 endpoints (the API allows 1,000), an EndpointSlice with a
//! port out of range; and two used without their invalid values: an EndpointSlice whose only
//! endpoint has an invalid address, a Service with one garbage externalIP (its ClusterIP and its
//! other externalIP carry traffic). Every good Service carries traffic (echo through IPVS NAT to
//! the pods), each bad object is logged once with its name and reason, counted in
//! `kube_ipvs_invalid_objects_total{kind,reason}`, and reported as one `events.k8s.io/v1`
//! Warning Event (reason `InvalidObject`, or `InvalidField` for the partial ones) that the fake
//! API server records. The daemon keeps running and exits 0 on SIGTERM.
//!
//! A ClusterIP outside the cluster's service CIDR (172.30.5.5 here, vs 10.96.0.0/12): kube-ipvs
//! has no service-CIDR setting (kube-proxy has none either; the API server validates it), so it is
//! a valid address and is programmed like any other: the test proves it carries traffic.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod api_lab;
mod common;

use std::net::{Ipv4Addr, SocketAddr};
use std::time::{Duration, Instant};

use api_lab::{wait_ipvs, Daemon, Lab};
use serde_json::{json, Value};
use testkit::apiserver::FakeApiServer;

fn service(name: &str, cluster_ip: &str, ports: Value) -> Value {
    json!({
        "apiVersion": "v1", "kind": "Service",
        "metadata": {"name": name, "namespace": "default"},
        "spec": {"type": "ClusterIP", "clusterIP": cluster_ip, "clusterIPs": [cluster_ip],
                 "ports": ports}
    })
}

fn slice(name: &str, service: &str, port: i64, addresses: &[String]) -> Value {
    let endpoints: Vec<Value> = addresses
        .iter()
        .map(|a| json!({"addresses": [a], "conditions": {"ready": true}}))
        .collect();
    json!({
        "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
        "metadata": {"name": name, "namespace": "default",
                     "labels": {"kubernetes.io/service-name": service}},
        "addressType": "IPv4",
        "ports": [{"name": "http", "port": port, "protocol": "TCP"}],
        "endpoints": endpoints
    })
}

fn tcp(port: i64) -> Value {
    json!([{"name": "http", "port": port, "targetPort": 8080, "protocol": "TCP"}])
}

/// (kind, name, a piece of the reason the model gives) of every bad object skipped whole
/// (Event `InvalidObject`, log `skipping invalid object`) or, for [`PARTIAL`], used without its
/// invalid values (Event `InvalidField`, log `using object without its invalid values`).
const BAD: &[(&str, &str, &str)] = &[
    ("Service", "bad-cluster-ip", "invalid clusterIP"),
    ("Service", "bad-port", "out of range"),
    ("Service", "bad-protocol", "unknown protocol"),
    ("Service", "dup-ports", "duplicate port"),
    ("EndpointSlice", "huge-1", "10000 endpoints"),
    (
        "EndpointSlice",
        "bad-addr-1",
        "ignored endpoint with invalid address \"10.244.0.300\"",
    ),
    ("EndpointSlice", "bad-slice-port-1", "out of range"),
    (
        "Service",
        "partial-ext",
        "ignored invalid externalIP \"bogus\"",
    ),
];

/// The objects of [`BAD`] used without their invalid values.
const PARTIAL: &[&str] = &["bad-addr-1", "partial-ext"];

/// Good services: (name, VIP) — each reaches the pods. `partial-ext` has one garbage
/// externalIP: its ClusterIP and its other externalIP are served all the same.
const GOOD: &[(&str, &str)] = &[
    ("good-a", "10.96.0.30:80"),
    ("good-b", "10.96.0.31:81"),
    ("outside-cidr", "172.30.5.5:80"),
    ("good-c", "10.96.0.32:80"),
    ("partial-ext", "10.96.0.33:80"),
    ("partial-ext", "203.0.113.33:80"),
];

fn objects() -> Vec<Value> {
    let pods = vec!["10.244.0.7".to_string(), "10.244.0.8".to_string()];
    let mut v = vec![json!({
        "apiVersion": "v1", "kind": "Node",
        "metadata": {"name": "node-1", "labels": {"kubernetes.io/hostname": "node-1"}},
        "status": {"addresses": [{"type": "InternalIP", "address": "192.168.0.10"}]}
    })];
    // Good ones, interleaved with the bad ones below.
    v.push(service("good-a", "10.96.0.30", tcp(80)));
    v.push(slice("good-a-1", "good-a", 8080, &pods));
    v.push(service("bad-cluster-ip", "10.96.0.999", tcp(80)));
    v.push(slice("bad-cluster-ip-1", "bad-cluster-ip", 8080, &pods));
    v.push(service("good-b", "10.96.0.31", tcp(81)));
    v.push(slice("good-b-1", "good-b", 8080, &pods[1..]));
    v.push(service("bad-port", "10.96.0.40", tcp(70000)));
    v.push(service(
        "bad-protocol",
        "10.96.0.41",
        json!([{"name": "http", "port": 80, "targetPort": 8080, "protocol": "FOO"}]),
    ));
    v.push(service(
        "dup-ports",
        "10.96.0.42",
        json!([{"name": "a", "port": 80, "targetPort": 8080, "protocol": "TCP"},
               {"name": "b", "port": 80, "targetPort": 8081, "protocol": "TCP"}]),
    ));
    v.push(slice("dup-ports-1", "dup-ports", 8080, &pods));
    v.push(service("outside-cidr", "172.30.5.5", tcp(80)));
    v.push(slice("outside-cidr-1", "outside-cidr", 8080, &pods[..1]));
    // good-c has one good slice and three bad ones: it works with the good slice alone.
    v.push(service("good-c", "10.96.0.32", tcp(80)));
    v.push(slice("good-c-1", "good-c", 8080, &pods[..1]));
    let huge: Vec<String> = (0..10_000)
        .map(|i| format!("10.245.{}.{}", i / 250, 1 + i % 250))
        .collect();
    v.push(slice("huge-1", "good-c", 8080, &huge));
    v.push(slice(
        "bad-addr-1",
        "good-c",
        8080,
        &["10.244.0.300".to_string()],
    ));
    v.push(slice("bad-slice-port-1", "good-c", 99_999, &pods));
    let mut partial = service("partial-ext", "10.96.0.33", tcp(80));
    partial["spec"]["externalIPs"] = json!(["bogus", "203.0.113.33"]);
    v.push(partial);
    v.push(slice("partial-ext-1", "partial-ext", 8080, &pods[..1]));
    v
}

#[test]
#[ignore = "vm"]
fn vm_e2e_bad_objects_are_skipped_logged_counted_and_reported() {
    let lab = Lab::new(
        "e2e-bad",
        &[Ipv4Addr::new(10, 244, 0, 7), Ipv4Addr::new(10, 244, 0, 8)],
    );
    lab.run(bad_objects);
}

async fn bad_objects() {
    let api = FakeApiServer::start().await.unwrap();
    let objs = objects();
    let text = serde_json::to_string(&json!({"kind": "List", "items": objs})).unwrap();
    assert_eq!(api.load_str(&text).unwrap(), objs.len());
    let kc = std::env::temp_dir().join(format!("e2e-bad-kc-{}.yaml", std::process::id()));
    api.write_kubeconfig(&kc).unwrap();
    let mut d = Daemon::start(kc.to_str().unwrap(), &["--ipvs-sync-period", "5s"]);
    let deadline = Duration::from_secs(90);

    // Every good service is programmed with its real servers.
    let table = wait_ipvs(&d, "the good services", deadline, |t| {
        t.contains("-a -t 10.96.0.30:80 -r 10.244.0.7:8080 -m")
            && t.contains("-a -t 10.96.0.30:80 -r 10.244.0.8:8080 -m")
            && t.contains("-a -t 10.96.0.31:81 -r 10.244.0.8:8080 -m")
            && t.contains("-a -t 172.30.5.5:80 -r 10.244.0.7:8080 -m")
            && t.contains("-a -t 10.96.0.32:80 -r 10.244.0.7:8080 -m")
            && t.contains("-a -t 10.96.0.33:80 -r 10.244.0.7:8080 -m")
            && t.contains("-a -t 203.0.113.33:80 -r 10.244.0.7:8080 -m")
    })
    .await;
    // Nothing of the bad services, and none of the bad slices' endpoints.
    for bad in [
        "10.96.0.40",
        "10.96.0.41",
        "10.96.0.42",
        "10.245.",
        "10.244.0.300",
    ] {
        assert!(!table.contains(bad), "{bad} programmed:\n{table}");
    }
    let good_c_servers = table
        .lines()
        .filter(|l| l.starts_with("-a -t 10.96.0.32:80 "))
        .count();
    assert_eq!(good_c_servers, 1, "{table}");
    println!(
        "ipvs: {} virtual servers, {} real servers",
        table.lines().filter(|l| l.starts_with("-A")).count(),
        table.lines().filter(|l| l.starts_with("-a")).count()
    );

    // Traffic to every good service.
    let (mut attempted, mut succeeded, mut failed) = (0, 0, 0);
    for (name, vip) in GOOD {
        let to: SocketAddr = vip.parse().unwrap();
        for n in 0..10 {
            attempted += 1;
            match api_lab::echo_once(to, n) {
                Ok(()) => succeeded += 1,
                Err(e) => {
                    failed += 1;
                    println!("{name} {vip}: {e}");
                }
            }
        }
    }
    println!("good services: {attempted} attempted, {succeeded} succeeded, {failed} failed");
    assert_eq!(failed, 0);

    // One Event per bad object (the publisher is asynchronous: wait for all of them).
    let start = Instant::now();
    let events = loop {
        let ev = api.events();
        if ev.len() >= BAD.len() {
            break ev;
        }
        assert!(
            start.elapsed() < deadline,
            "{} events of {}: {ev:#?}\n{}",
            ev.len(),
            BAD.len(),
            d.log()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    // A few full syncs later nothing is reported again.
    tokio::time::sleep(Duration::from_secs(12)).await;
    let events_later = api.events();
    assert_eq!(events_later.len(), events.len(), "{events_later:#?}");
    let mut event_hits = 0;
    for (kind, name, why) in BAD {
        let matching: Vec<&Value> = events
            .iter()
            .filter(|e| {
                let r = e.get("regarding").or_else(|| e.get("involvedObject"));
                r.and_then(|r| r.get("name")).and_then(Value::as_str) == Some(*name)
                    && r.and_then(|r| r.get("kind")).and_then(Value::as_str) == Some(*kind)
            })
            .collect();
        assert_eq!(matching.len(), 1, "{kind} {name}: {events:#?}");
        let e = matching[0];
        assert_eq!(e["type"], "Warning", "{e:#}");
        let (reason, action) = if PARTIAL.contains(name) {
            ("InvalidField", "Ignore")
        } else {
            ("InvalidObject", "Skip")
        };
        assert_eq!(e["reason"], reason, "{e:#}");
        assert_eq!(e["action"], action, "{e:#}");
        let note = e["note"]
            .as_str()
            .or(e["message"].as_str())
            .unwrap_or_default();
        assert!(note.contains(why), "{kind} {name}: {note:?} lacks {why:?}");
        event_hits += 1;
    }
    println!(
        "events: {} bad objects, {} events recorded, {event_hits} matched",
        BAD.len(),
        events.len()
    );
    assert_eq!(events.len(), BAD.len(), "{events:#?}");

    // The metric counts each bad object once, by kind.
    let m = common::get(d.metrics, "/metrics").await.unwrap().body;
    let lines: Vec<&str> = m
        .lines()
        .filter(|l| l.starts_with("kube_ipvs_invalid_objects_total{"))
        .collect();
    for l in &lines {
        println!("metric: {l}");
    }
    let sum = |kind: &str| -> f64 {
        lines
            .iter()
            .filter(|l| l.contains(&format!("kind=\"{kind}\"")))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum()
    };
    let want = |kind: &str| BAD.iter().filter(|(k, _, _)| *k == kind).count() as f64;
    assert_eq!(sum("Service"), want("Service"), "{m}");
    assert_eq!(sum("EndpointSlice"), want("EndpointSlice"), "{m}");
    assert!(
        m.contains("reason=\"too_many_endpoints\"") && m.contains("reason=\"unknown_protocol\""),
        "{m}"
    );

    // The daemon is alive, and each bad object was logged exactly once with name and reason.
    assert!(d.alive(), "{}", d.log());
    let h = common::get(d.healthz, "/healthz").await.unwrap();
    assert_eq!(h.status, 200, "{h:?}");
    let (code, log) = d.stop();
    assert_eq!(code, Some(0), "{log}");
    assert!(!log.contains("panicked"), "{log}");
    let skipped: Vec<&str> = log
        .lines()
        .filter(|l| {
            l.contains("skipping invalid object")
                || l.contains("using object without its invalid values")
        })
        .collect();
    let mut logged_once = 0;
    for (kind, name, why) in BAD {
        let key = match *kind {
            "Service" if PARTIAL.contains(name) => format!("fields default/{name}"),
            "Service" => format!("service default/{name}"),
            _ => format!("endpointslice default/{name}"),
        };
        let n = skipped
            .iter()
            .filter(|l| l.contains(&format!("{key} ")) || l.contains(&format!("{key}\"")))
            .filter(|l| l.contains(why))
            .count();
        assert_eq!(n, 1, "{key}: logged {n} times:\n{}", skipped.join("\n"));
        logged_once += 1;
    }
    println!(
        "log: {} rejection lines, {logged_once} of {} bad objects logged exactly once",
        skipped.len(),
        BAD.len()
    );
    assert_eq!(skipped.len(), BAD.len(), "{}", skipped.join("\n"));
    let _ = std::fs::remove_file(&kc);
}
