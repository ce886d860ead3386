//! Issue #32 (d), the real daemon: 500 Services each carrying a 200 KiB invalid annotation
//! (`kube-ipvs.io/scheduler-flags`, a value the rejection reason quotes) leave the daemon's
//! resident memory within a small margin of the same 500 Services without it, whether they
//! come from the API server (testkit's fake one, `--kubeconfig`) or from `--source-dir`.
//! The value is cut to 1 KiB where the object is converted (`model::objects`), and every
//! reason is cut to 1 KiB, so neither the store, the static source's last good objects, the
//! rejection table nor the Event notes hold 100 MB of it.
//!
//! The host has no IPVS: the daemon runs in iptables mode, inside a fresh network namespace
//! (the fake API server too, on the namespace's loopback). A `netns_` test: root, `cargo test
//! -p kube-ipvs --test hostile_rss -- --ignored netns_`.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::net::SocketAddr;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Duration;

use common::{free_port, get, Daemon};
use serde_json::{json, Value};
use testkit::apiserver::FakeApiServer;

const BIN: &str = env!("CARGO_BIN_EXE_kube-ipvs");
const SERVICES: usize = 500;
const ANNOTATION_BYTES: usize = 200 * 1024;
/// The stated margin: 8 MiB. Measured on the 2-core host: 35-39 MiB resident for the 500
/// Services without the annotation, +0.5 MiB with it; with the values kept whole the store
/// alone holds ~100 MiB more (+101 MiB measured).
const MARGIN_KIB: u64 = 8 * 1024;

fn service(i: usize, annotation: Option<&str>) -> Value {
    let mut meta = json!({"name": format!("svc-{i}"), "namespace": "default"});
    if let Some(a) = annotation {
        meta["annotations"] = json!({"kube-ipvs.io/scheduler-flags": a});
    }
    json!({
        "apiVersion": "v1", "kind": "Service",
        "metadata": meta,
        "spec": {"type": "ClusterIP", "clusterIP": format!("10.96.{}.{}", i / 250, 1 + i % 250),
                 "clusterIPs": [format!("10.96.{}.{}", i / 250, 1 + i % 250)],
                 "ports": [{"name": "http", "port": 80, "targetPort": 8080, "protocol": "TCP"}]}
    })
}

fn node() -> Value {
    json!({"apiVersion": "v1", "kind": "Node",
           "metadata": {"name": "node-1"},
           "status": {"addresses": [{"type": "InternalIP", "address": "192.168.0.10"}]}})
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

/// Runs the daemon with `source` until it has taken in every Service (programmed, or counted
/// as invalid) and a few syncs more, and returns its resident memory then (KiB).
async fn steady_rss(source: &[&str], invalid: bool, log: &Path) -> u64 {
    let (hp, mp) = (free_port(), free_port());
    let hz = format!("127.0.0.1:{hp}");
    let m: SocketAddr = format!("127.0.0.1:{mp}").parse().unwrap();
    let child = Command::new(BIN)
        .args(source)
        .args([
            "--proxy-mode",
            "iptables",
            "--healthz-bind-address",
            &hz,
            "--metrics-bind-address",
            &m.to_string(),
            "--hostname-override",
            "node-1",
            "--iptables-sync-period",
            "2s",
            "--conntrack-max-per-core=0",
            "--conntrack-tcp-timeout-established=0s",
            "--conntrack-tcp-timeout-close-wait=0s",
        ])
        .env_remove("KUBECONFIG")
        .env_remove("RUST_LOG")
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(log).unwrap())
        .spawn()
        .unwrap();
    let d = Daemon(child);
    let pid = d.0.id();
    let mut last = String::new();
    let mut done = false;
    for _ in 0..1200 {
        if let Ok(r) = get(m, "/metrics").await {
            last = r.body;
            let taken = if invalid {
                metric(&last, "kube_ipvs_invalid_objects_total{") >= SERVICES as f64
            } else {
                metric(&last, "kubeproxy_sync_proxy_rules_service_changes_total") >= SERVICES as f64
                    && metric(&last, "kubeproxy_sync_proxy_rules_last_timestamp_seconds") > 0.0
            };
            if taken {
                done = true;
                break;
            }
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(
        done,
        "the daemon never took the Services in:\n{last}\n{}",
        std::fs::read_to_string(log).unwrap_or_default()
    );
    // A few full syncs (2 s apart) so transient buffers are gone; not a timed assertion.
    tokio::time::sleep(Duration::from_secs(8)).await;
    let rss = vm_rss_kib(pid);
    let m = get(m, "/metrics").await.unwrap().body;
    if invalid {
        assert_eq!(
            metric(&m, "kube_ipvs_invalid_objects_total{"),
            SERVICES as f64,
            "each invalid Service counted once"
        );
    }
    rss
}

async fn from_api(annotation: Option<&str>, tag: &str) -> u64 {
    let api = FakeApiServer::start().await.unwrap();
    let mut items = vec![node()];
    items.extend((0..SERVICES).map(|i| service(i, annotation)));
    // In lists of 50 (the loader bounds the text it takes at once).
    for chunk in items.chunks(50) {
        let text = serde_json::to_string(&json!({"kind": "List", "items": chunk})).unwrap();
        assert_eq!(api.load_str(&text).unwrap(), chunk.len());
    }
    let dir = std::env::temp_dir().join(format!("hostile-rss-{tag}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let kc = dir.join("kubeconfig");
    api.write_kubeconfig(&kc).unwrap();
    let rss = steady_rss(
        &["--kubeconfig", kc.to_str().unwrap()],
        annotation.is_some(),
        &dir.join("daemon.log"),
    )
    .await;
    let _ = std::fs::remove_dir_all(&dir);
    rss
}

async fn from_dir(annotation: Option<&str>, tag: &str) -> u64 {
    let dir = std::env::temp_dir().join(format!("hostile-rss-{tag}-{}", std::process::id()));
    let objs = dir.join("objects");
    std::fs::create_dir_all(&objs).unwrap();
    std::fs::write(objs.join("node.json"), node().to_string()).unwrap();
    for i in 0..SERVICES {
        let text = serde_json::to_string(&service(i, annotation)).unwrap();
        std::fs::write(objs.join(format!("svc-{i}.json")), text).unwrap();
    }
    let rss = steady_rss(
        &["--source-dir", objs.to_str().unwrap()],
        annotation.is_some(),
        &dir.join("daemon.log"),
    )
    .await;
    let _ = std::fs::remove_dir_all(&dir);
    rss
}

#[test]
#[ignore = "netns"]
fn netns_huge_invalid_annotations_leave_daemon_rss_within_margin() {
    common::in_netns("kipvs-rss", || async {
        let huge = "z".repeat(ANNOTATION_BYTES);
        let mut lines = Vec::new();
        for (source, plain, big) in [
            (
                "API server",
                from_api(None, "api-plain").await,
                from_api(Some(&huge), "api-big").await,
            ),
            (
                "--source-dir",
                from_dir(None, "dir-plain").await,
                from_dir(Some(&huge), "dir-big").await,
            ),
        ] {
            let line = format!(
                "{source}: VmRSS {plain} KiB for {SERVICES} Services, {big} KiB with a \
                 {ANNOTATION_BYTES}-byte invalid annotation each ({:+} KiB; margin {MARGIN_KIB})",
                big as i64 - plain as i64
            );
            println!("{line}");
            lines.push((line, plain, big));
        }
        for (line, plain, big) in lines {
            assert!(big <= plain + MARGIN_KIB, "{line}");
        }
    });
}
