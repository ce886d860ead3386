//! The daemon against testkit's fake API server: `--kubeconfig` and `--master` both reach it,
//! objects arrive as changes, and a Node being deleted turns `/healthz` to 503.

// Test helpers outside #[test] fns may unwrap/panic too.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::Duration;

use common::{free_port, get, wait_for, Daemon};
use k8s_openapi::api::core::v1::Node;
use testkit::apiserver::FakeApiServer;

const BIN: &str = env!("CARGO_BIN_EXE_kube-ipvs");

fn start(extra: &[&str]) -> (Daemon, SocketAddr, SocketAddr) {
    let (hp, mp) = (free_port(), free_port());
    let hz: SocketAddr = format!("127.0.0.1:{hp}").parse().unwrap();
    let m: SocketAddr = format!("127.0.0.1:{mp}").parse().unwrap();
    let child = Command::new(BIN)
        .args(extra)
        .args([
            "--healthz-bind-address",
            &hz.to_string(),
            "--metrics-bind-address",
            &m.to_string(),
            "--hostname-override",
            "node-1",
            // nf_conntrack_max is read-only in a test namespace (kind sets this too).
            "--conntrack-max-per-core=0",
        ])
        .env_remove("RUST_LOG")
        .env_remove("KUBECONFIG")
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    (Daemon(child), hz, m)
}

fn stop(mut d: Daemon) -> String {
    use std::io::Read;
    let pid = d.0.id().to_string();
    assert!(Command::new("kill")
        .args(["-TERM", &pid])
        .status()
        .unwrap()
        .success());
    let mut err = String::new();
    d.0.stderr.take().unwrap().read_to_string(&mut err).unwrap();
    let status = d.0.wait().unwrap();
    assert_eq!(status.code(), Some(0), "{err}");
    err
}

/// Runs the daemon, which programs the kernel: inside its own network namespace.
#[test]
#[ignore = "netns"]
fn netns_daemon_watches_the_api_server_via_kubeconfig_and_master() {
    common::in_netns(
        "kipvs-api",
        daemon_watches_the_api_server_via_kubeconfig_and_master,
    );
}

async fn daemon_watches_the_api_server_via_kubeconfig_and_master() {
    let api = FakeApiServer::start().await.unwrap();
    let examples = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../examples");
    let loaded = api.load_dir(&examples).unwrap();
    assert!(loaded >= 19, "{loaded}");
    let kc = std::env::temp_dir().join(format!("kube-ipvs-kc-{}.yaml", std::process::id()));
    api.write_kubeconfig(&kc).unwrap();

    // --kubeconfig: every Service and EndpointSlice arrives.
    let (d, hz, m) = start(&["--kubeconfig", kc.to_str().unwrap()]);
    wait_for(
        m,
        "/metrics",
        "kubeproxy_sync_proxy_rules_service_changes_total 9",
    )
    .await;
    wait_for(
        m,
        "/metrics",
        "kubeproxy_sync_proxy_rules_endpoint_changes_total 10",
    )
    .await;
    // Healthy once the first sync has programmed the namespace.
    let mut r = get(hz, "/healthz").await.unwrap();
    for _ in 0..600 {
        if r.status == 200 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
        r = get(hz, "/healthz").await.unwrap();
    }
    assert_eq!(r.status, 200, "{r:?}");
    if !std::path::Path::new("/proc/net/ip_vs").exists() {
        // No IPVS here: the fallback to iptables mode is announced with an Event on the Node.
        let mut found = false;
        for _ in 0..300 {
            found = api.events().iter().any(|e| {
                e["reason"] == "IPVSUnavailable"
                    && e["regarding"]["kind"] == "Node"
                    && e["regarding"]["name"] == "node-1"
            });
            if found {
                break;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        assert!(found, "no IPVSUnavailable Event: {:?}", api.events());
    }

    // This Node is deleted while a finalizer holds it, so it gets a deletionTimestamp (set by
    // the server, as in a real cluster): /healthz fails, /livez stays up.
    let mut node: Node = api.get("", "node-1").unwrap();
    node.metadata.finalizers = Some(vec!["example.com/hold".into()]);
    api.update(&node).unwrap();
    let held: Node = api.delete("", "node-1").unwrap();
    assert!(held.metadata.deletion_timestamp.is_some());
    let r = wait_for(hz, "/healthz", "\"nodeEligible\":false").await;
    assert_eq!(r.status, 503);
    assert_eq!(get(hz, "/livez").await.unwrap().status, 200);
    let err = stop(d);
    assert!(err.contains("SIGTERM: stopping"), "{err}");
    std::fs::remove_file(&kc).unwrap();

    // --master alone (no kubeconfig) reaches the same server.
    let (d, _hz, m) = start(&["--master", &api.url()]);
    wait_for(
        m,
        "/metrics",
        "kubeproxy_sync_proxy_rules_service_changes_total 9",
    )
    .await;
    stop(d);
}
