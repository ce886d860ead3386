//! End-to-end tests of issue #16 items 6–8 in the VM, with the real daemon and the fake API
//! server (`--kubeconfig`):
//!
//! - (e) 1,000 invalid objects: the Events the fake API server receives stay within the cap
//!   (30 a minute), the rest is counted as dropped, every invalid object is still counted in
//!   `kube_ipvs_invalid_objects_total`, a good Service keeps carrying traffic, and the daemon's
//!   RSS stays flat when the 1,000 are replaced by 1,000 others twice (rejections are cleared
//!   when their objects go).
//! - (f) two Services claim one externalIP:port: the older one serves it (traffic to the
//!   external IP reaches its pod; the loser's endpoint has no server, so traffic sent there
//!   would fail), the loser gets a `VIPConflict` Event, `kube_ipvs_vip_conflicts` is 1, and
//!   the loser takes over when the winner is deleted.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod api_lab;
mod common;

use std::net::{Ipv4Addr, SocketAddr};
use std::time::{Duration, Instant};

use api_lab::{wait_ipvs, Daemon, Lab};
use k8s_openapi::api::core::v1::Service;
use k8s_openapi::api::discovery::v1::EndpointSlice;
use serde_json::{json, Value};
use testkit::apiserver::FakeApiServer;

const NODE: &str = r#"{"apiVersion": "v1", "kind": "Node",
  "metadata": {"name": "node-1", "labels": {"kubernetes.io/hostname": "node-1"}},
  "status": {"addresses": [{"type": "InternalIP", "address": "192.168.0.10"}]}}"#;

fn service(ns: &str, name: &str, cluster_ip: &str, port: i64, external_ips: &[&str]) -> Value {
    json!({
        "apiVersion": "v1", "kind": "Service",
        "metadata": {"name": name, "namespace": ns},
        "spec": {"type": "ClusterIP", "clusterIP": cluster_ip, "clusterIPs": [cluster_ip],
                 "externalIPs": external_ips,
                 "ports": [{"name": "http", "port": port, "targetPort": 8080, "protocol": "TCP"}]}
    })
}

fn slice(ns: &str, name: &str, service: &str, addresses: &[&str]) -> Value {
    let endpoints: Vec<Value> = addresses
        .iter()
        .map(|a| json!({"addresses": [a], "conditions": {"ready": true}}))
        .collect();
    json!({
        "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
        "metadata": {"name": name, "namespace": ns,
                     "labels": {"kubernetes.io/service-name": service}},
        "addressType": "IPv4",
        "ports": [{"name": "http", "port": 8080, "protocol": "TCP"}],
        "endpoints": endpoints
    })
}

fn load(api: &FakeApiServer, objs: &[Value]) {
    let text = serde_json::to_string(&json!({"kind": "List", "items": objs})).unwrap();
    assert_eq!(api.load_str(&text).unwrap(), objs.len());
}

fn event_writes(api: &FakeApiServer) -> usize {
    api.count_requests(|r| {
        r.path.starts_with("/apis/events.k8s.io/") && (r.method == "POST" || r.method == "PATCH")
    })
}

fn vm_rss_kib(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse().ok())
        .unwrap()
}

fn metric(text: &str, prefix: &str) -> f64 {
    text.lines()
        .filter(|l| l.starts_with(prefix))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
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

/// One wave of invalid objects: 500 Services with a port out of range and 500 EndpointSlices
/// of the good Service with an invalid address (each used without it: a partial rejection,
/// counted and reported like the others).
fn invalid_wave(wave: usize) -> Vec<Value> {
    let mut v = Vec::new();
    for i in 0..500 {
        v.push(service(
            "bad",
            &format!("w{wave}-svc-{i}"),
            &format!("10.97.{}.{}", i / 250, 1 + i % 250),
            70_000,
            &[],
        ));
        v.push(slice(
            "default",
            &format!("w{wave}-slice-{i}"),
            "good",
            &["10.244.0.300"],
        ));
    }
    v
}

fn delete_wave(api: &FakeApiServer, wave: usize) {
    for i in 0..500 {
        api.delete::<Service>("bad", &format!("w{wave}-svc-{i}"))
            .unwrap();
        api.delete::<EndpointSlice>("default", &format!("w{wave}-slice-{i}"))
            .unwrap();
    }
}

#[test]
#[ignore = "vm"]
fn vm_e2e_invalid_object_flood_events_capped_memory_flat() {
    let lab = Lab::new("e2e-flood", &[Ipv4Addr::new(10, 244, 0, 7)]);
    lab.run(flood);
}

async fn flood() {
    let api = FakeApiServer::start().await.unwrap();
    let node: Value = serde_json::from_str(NODE).unwrap();
    let mut objs = vec![
        node,
        service("default", "good", "10.96.0.30", 80, &[]),
        slice("default", "good-1", "good", &["10.244.0.7"]),
    ];
    objs.extend(invalid_wave(0));
    load(&api, &objs);
    let kc = std::env::temp_dir().join(format!("e2e-flood-kc-{}.yaml", std::process::id()));
    api.write_kubeconfig(&kc).unwrap();
    let started = Instant::now();
    let mut d = Daemon::start(kc.to_str().unwrap(), &["--ipvs-sync-period", "10s"]);
    let pid = d.child.id();
    wait_ipvs(&d, "the good service", Duration::from_secs(120), |t| {
        t.contains("-a -t 10.96.0.30:80 -r 10.244.0.7:8080 -m")
    })
    .await;
    // Every invalid object is counted once, whatever happens to its Event.
    let m = wait_metrics(&d, "1,000 invalid objects counted", |m| {
        metric(m, "kube_ipvs_invalid_objects_total{") >= 1000.0
    })
    .await;
    assert_eq!(
        metric(&m, "kube_ipvs_invalid_objects_total{"),
        1000.0,
        "{m}"
    );
    let (mut ok, mut failed) = (0, 0);
    for n in 0..20 {
        match api_lab::echo_once("10.96.0.30:80".parse::<SocketAddr>().unwrap(), n) {
            Ok(()) => ok += 1,
            Err(e) => {
                failed += 1;
                println!("good service: {e}");
            }
        }
    }
    println!("good service during the flood: {ok} ok, {failed} failed");
    assert_eq!(failed, 0);

    // Events: the cap holds (30 per started minute), and the rest is counted as dropped.
    let m = wait_metrics(&d, "rate-limited Events", |m| {
        metric(m, "kube_ipvs_events_dropped_total{reason=\"rate_limited\"}")
            + metric(m, "kube_ipvs_events_dropped_total{reason=\"queue_full\"}")
            > 0.0
    })
    .await;
    tokio::time::sleep(Duration::from_secs(5)).await;
    let writes = event_writes(&api);
    let minutes = started.elapsed().as_secs() / 60 + 1;
    println!(
        "events: {writes} written to the API server in {} s (cap {}), dropped: {} rate_limited, {} queue_full",
        started.elapsed().as_secs(),
        30 * minutes,
        metric(&m, "kube_ipvs_events_dropped_total{reason=\"rate_limited\"}"),
        metric(&m, "kube_ipvs_events_dropped_total{reason=\"queue_full\"}"),
    );
    assert!(writes >= 1, "some Events are sent");
    assert!(
        writes as u64 <= 30 * minutes,
        "{writes} Events in {minutes} started minutes"
    );
    for e in api.events() {
        assert!(
            e["note"].as_str().unwrap_or_default().len() <= 1024,
            "{e:#}"
        );
        // The Services are skipped; the slices are used without their invalid endpoint.
        let want = match e["regarding"]["kind"].as_str() {
            Some("EndpointSlice") => "InvalidField",
            _ => "InvalidObject",
        };
        assert_eq!(e["reason"], want, "{e:#}");
    }

    // Memory: replace the 1,000 invalid objects by 1,000 others, twice; RSS stays flat.
    let settle = |d: &Daemon, want: f64| {
        let d_metrics = d.metrics;
        async move {
            let start = Instant::now();
            loop {
                let m = common::get(d_metrics, "/metrics").await.unwrap().body;
                if metric(&m, "kube_ipvs_invalid_objects_total{") >= want {
                    break;
                }
                assert!(start.elapsed() < Duration::from_secs(180), "{m}");
                tokio::time::sleep(Duration::from_millis(500)).await;
            }
            // A couple of full syncs so the rejections of deleted objects are gone too.
            tokio::time::sleep(Duration::from_secs(25)).await;
        }
    };
    let rss0 = vm_rss_kib(pid);
    let mut rss = vec![rss0];
    for wave in 1..=2 {
        delete_wave(&api, wave - 1);
        load(&api, &invalid_wave(wave));
        settle(&d, 1000.0 * (wave as f64 + 1.0)).await;
        rss.push(vm_rss_kib(pid));
    }
    println!("VmRSS after waves 0, 1, 2: {rss:?} KiB");
    let growth = rss[2].saturating_sub(rss[1]);
    assert!(
        growth <= 4096.max(rss[1] / 10),
        "RSS grew by {growth} KiB between the second and third wave: {rss:?}"
    );
    let log = d.log();
    assert!(d.alive(), "{log}");
    // The good service still works.
    for n in 0..10 {
        api_lab::echo_once("10.96.0.30:80".parse().unwrap(), n).unwrap();
    }
    let (code, log) = d.stop();
    assert_eq!(code, Some(0), "{log}");
    let _ = std::fs::remove_file(&kc);
}

#[test]
#[ignore = "vm"]
fn vm_e2e_vip_conflict_older_service_serves_loser_gets_event() {
    // 10.244.0.7 runs an echo server; 10.244.0.9 (the loser's endpoint) runs nothing.
    let lab = Lab::new("e2e-vip", &[Ipv4Addr::new(10, 244, 0, 7)]);
    lab.run(vip_conflict);
}

async fn vip_conflict() {
    const VIP: &str = "203.0.113.10";
    let api = FakeApiServer::start().await.unwrap();
    load(&api, &[serde_json::from_str(NODE).unwrap()]);
    // The winner is created first; the loser a second later (creationTimestamp has second
    // resolution) and sorts first by name, so a name-only rule would pick the loser.
    load(
        &api,
        &[
            service("zz", "older", "10.96.0.40", 80, &[VIP]),
            slice("zz", "older-1", "older", &["10.244.0.7"]),
        ],
    );
    tokio::time::sleep(Duration::from_millis(1100)).await;
    load(
        &api,
        &[
            service("aa", "newer", "10.96.0.41", 80, &[VIP]),
            slice("aa", "newer-1", "newer", &["10.244.0.9"]),
        ],
    );
    let kc = std::env::temp_dir().join(format!("e2e-vip-kc-{}.yaml", std::process::id()));
    api.write_kubeconfig(&kc).unwrap();
    let mut d = Daemon::start(kc.to_str().unwrap(), &["--ipvs-sync-period", "10s"]);
    let table = wait_ipvs(&d, "both services", Duration::from_secs(120), |t| {
        t.contains("-a -t 203.0.113.10:80 -r 10.244.0.7:8080 -m")
            && t.contains("-a -t 10.96.0.41:80 -r 10.244.0.9:8080 -m")
    })
    .await;
    assert!(
        !table.contains("-a -t 203.0.113.10:80 -r 10.244.0.9:8080"),
        "the loser's endpoint is behind the VIP:\n{table}"
    );
    // Traffic to the external IP reaches the winner's pod (the loser's has no server).
    let to: SocketAddr = format!("{VIP}:80").parse().unwrap();
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
    println!("external IP {to}: {ok} ok, {failed} failed");
    assert_eq!(failed, 0);
    // The loser gets a VIPConflict Event naming the VIP and the winner; the metric says 1.
    let start = Instant::now();
    let ev = loop {
        let found = api
            .events()
            .into_iter()
            .find(|e| e["regarding"]["name"] == "newer" && e["regarding"]["namespace"] == "aa");
        if let Some(e) = found {
            break e;
        }
        assert!(start.elapsed() < Duration::from_secs(60), "{}", d.log());
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    println!("event: {} {}", ev["reason"], ev["note"]);
    assert_eq!(ev["type"], "Warning");
    assert_eq!(ev["reason"], "VIPConflict");
    let note = ev["note"].as_str().unwrap();
    assert!(
        note.contains("203.0.113.10:80/TCP is served by zz/older"),
        "{note}"
    );
    assert!(
        !api.events()
            .iter()
            .any(|e| e["regarding"]["name"] == "older"),
        "no Event on the winner"
    );
    let m = common::get(d.metrics, "/metrics").await.unwrap().body;
    assert_eq!(metric(&m, "kube_ipvs_vip_conflicts "), 1.0, "{m}");

    // The winner goes: the loser's claim is served now, and the winner's ClusterIP virtual
    // server is gone. Both are waited for: within one sync the loser's real server is added
    // (IPVS creates) before the winner's virtual server is deleted (after its VIP is unbound;
    // desired::diff's ordering contract), so a read in between sees the first without the
    // second.
    api.delete::<Service>("zz", "older").unwrap();
    let table = wait_ipvs(
        &d,
        "the loser taking over and the winner's ClusterIP gone",
        Duration::from_secs(60),
        |t| {
            t.contains("-a -t 203.0.113.10:80 -r 10.244.0.9:8080 -m")
                && !t.contains("-A -t 10.96.0.40:80")
        },
    )
    .await;
    assert!(!table.contains("-A -t 10.96.0.40:80"), "{table}");
    let m = wait_metrics(&d, "no conflict left", |m| {
        metric(m, "kube_ipvs_vip_conflicts ") == 0.0
    })
    .await;
    assert!(m.contains("kube_ipvs_vip_conflicts 0"), "{m}");
    assert!(d.alive(), "{}", d.log());
    let (code, log) = d.stop();
    assert_eq!(code, Some(0), "{log}");
    let _ = std::fs::remove_file(&kc);
}
