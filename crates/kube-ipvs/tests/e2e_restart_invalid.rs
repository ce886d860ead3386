//! Issue #16 (b), end to end in the VM: the daemon restarts while a Service that serves traffic
//! is invalid, with `nodePortAddresses: [primary]`.
//!
//! Lab: the node namespace of `api_lab` (node0 = 192.168.0.10, two pods with echo servers), the
//! in-process fake API server with the Node (InternalIP 192.168.0.10), a NodePort Service `web`
//! and a NodePort Service `np`, and the real binary with `--nodeport-addresses primary` (so the
//! NodePort virtual servers exist only on the Node's InternalIP, which only the Node object
//! tells). Clients echo through web's ClusterIP and NodePort and np's NodePort the whole time.
//!
//! 1. `web` becomes invalid (an unknown scheduler in its annotation: an API server accepts any
//!    annotation) and gains an endpoint meanwhile, which the daemon cannot apply.
//! 2. The daemon is stopped (SIGTERM) and started again. Its first sync must keep web's virtual
//!    servers as they were (its last valid version is gone with the old process: the kernel's
//!    state is adopted) and np's NodePort (it waits for the Node before its first sync).
//! 3. `web` is fixed: the daemon converges (the endpoint added meanwhile appears).
//! 4. `web` is deleted: its virtual servers go; np's stays.
//!
//! Throughout 1–3, 0 failed connections on every client.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod api_lab;
mod common;

use std::net::Ipv4Addr;
use std::time::{Duration, Instant};

use api_lab::{sh, wait_ipvs, Daemon, EchoClient, Lab};
use k8s_openapi::api::core::v1::Service;
use k8s_openapi::api::discovery::v1::EndpointSlice;
use testkit::apiserver::FakeApiServer;

const OBJECTS: &str = r#"
apiVersion: v1
kind: Node
metadata: {name: node-1, labels: {kubernetes.io/hostname: node-1}}
status:
  addresses: [{type: InternalIP, address: 192.168.0.10}]
---
apiVersion: v1
kind: Service
metadata: {name: web, namespace: default}
spec:
  type: NodePort
  clusterIP: 10.96.0.20
  clusterIPs: [10.96.0.20]
  ports: [{name: http, port: 80, targetPort: 8080, protocol: TCP, nodePort: 30080}]
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata:
  name: web-1
  namespace: default
  labels: {kubernetes.io/service-name: web}
addressType: IPv4
ports: [{name: http, port: 8080, protocol: TCP}]
endpoints:
- addresses: [10.244.0.7]
  conditions: {ready: true}
---
apiVersion: v1
kind: Service
metadata: {name: np, namespace: default}
spec:
  type: NodePort
  clusterIP: 10.96.0.21
  clusterIPs: [10.96.0.21]
  ports: [{name: http, port: 80, targetPort: 8080, protocol: TCP, nodePort: 30081}]
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata:
  name: np-1
  namespace: default
  labels: {kubernetes.io/service-name: np}
addressType: IPv4
ports: [{name: http, port: 8080, protocol: TCP}]
endpoints:
- addresses: [10.244.0.8]
  conditions: {ready: true}
"#;

const WEB_CLUSTER: &str = "10.96.0.20:80";
const WEB_NODE_PORT: &str = "192.168.0.10:30080";
const NP_NODE_PORT: &str = "192.168.0.10:30081";

async fn wait_until(what: &str, deadline: Duration, mut pred: impl FnMut() -> bool) {
    let start = Instant::now();
    while !pred() {
        assert!(start.elapsed() < deadline, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// The `ipvsadm -Sn` lines of one virtual server (its `-A` line and its `-a` lines).
fn lines_of(table: &str, vs: &str) -> Vec<String> {
    let mut v: Vec<String> = table
        .lines()
        .filter(|l| l.contains(&format!(" {vs} ")))
        .map(str::to_string)
        .collect();
    v.sort();
    v
}

fn sync_lines(log: &str) -> usize {
    log.lines().filter(|l| l.contains("sync done")).count()
}

#[test]
#[ignore = "vm"]
fn vm_e2e_restart_while_invalid_keeps_virtual_servers() {
    let lab = Lab::new(
        "e2e-restart-invalid",
        &[Ipv4Addr::new(10, 244, 0, 7), Ipv4Addr::new(10, 244, 0, 8)],
    );
    lab.run(scenario);
}

async fn scenario() {
    let api = FakeApiServer::start().await.unwrap();
    assert_eq!(api.load_str(OBJECTS).unwrap(), 5);
    let kc = std::env::temp_dir().join(format!("e2e-restart-inv-kc-{}.yaml", std::process::id()));
    api.write_kubeconfig(&kc).unwrap();
    let args = [
        "--nodeport-addresses",
        "primary",
        "--ipvs-sync-period",
        "10s",
        "--ipvs-min-sync-period",
        "0s",
    ];
    let deadline = Duration::from_secs(120);
    let d = Daemon::start(kc.to_str().unwrap(), &args);
    let before = wait_ipvs(&d, "web and np programmed", deadline, |t| {
        t.contains(&format!("-a -t {WEB_CLUSTER} -r 10.244.0.7:8080 -m"))
            && t.contains(&format!("-a -t {WEB_NODE_PORT} -r 10.244.0.7:8080 -m"))
            && t.contains(&format!("-a -t {NP_NODE_PORT} -r 10.244.0.8:8080 -m"))
    })
    .await;
    let clients: Vec<EchoClient> = [WEB_CLUSTER, WEB_NODE_PORT, NP_NODE_PORT]
        .iter()
        .map(|to| EchoClient::start(to))
        .collect();
    wait_until("first answers on every client", deadline, || {
        clients.iter().all(|c| c.ok() >= 3)
    })
    .await;

    // 1. web becomes invalid, and an endpoint is added that the daemon cannot apply.
    let mut web: Service = api.get("default", "web").unwrap();
    web.metadata.annotations = Some(
        [(
            "kube-ipvs.io/scheduler".to_string(),
            "no-such-scheduler".to_string(),
        )]
        .into_iter()
        .collect(),
    );
    api.apply(&web).unwrap();
    let mut slice: EndpointSlice = api.get("default", "web-1").unwrap();
    slice.endpoints.push(
        serde_json::from_value(serde_json::json!({
            "addresses": ["10.244.0.8"], "conditions": {"ready": true}
        }))
        .unwrap(),
    );
    api.apply(&slice).unwrap();
    wait_until("the daemon rejects web", deadline, || {
        d.log().contains("skipping invalid object")
    })
    .await;
    let invalid = sh("ipvsadm -Sn");
    for vs in [WEB_CLUSTER, WEB_NODE_PORT, NP_NODE_PORT] {
        assert_eq!(lines_of(&invalid, vs), lines_of(&before, vs), "{vs}");
    }

    // 2. Restart: SIGTERM, then a new daemon.
    let (code, log) = d.stop();
    assert_eq!(code, Some(0), "{log}");
    let d = Daemon::start(kc.to_str().unwrap(), &args);
    wait_until("the restarted daemon's first sync", deadline, || {
        sync_lines(&d.log()) >= 1
    })
    .await;
    // And one drift check (full sync) more.
    wait_until("a second sync", Duration::from_secs(60), || {
        sync_lines(&d.log()) >= 2
    })
    .await;
    let after = sh("ipvsadm -Sn");
    let log = d.log();
    for vs in [WEB_CLUSTER, WEB_NODE_PORT, NP_NODE_PORT] {
        assert_eq!(
            lines_of(&after, vs),
            lines_of(&before, vs),
            "{vs} after the restart:\n{after}\nlog:\n{log}"
        );
    }
    assert!(
        log.contains("keeping what the kernel holds"),
        "adoption logged:\n{log}"
    );
    assert!(sh("ip -o addr show dev kube-ipvs0").contains("10.96.0.20/32"));
    for c in &clients {
        assert_eq!(
            c.failed(),
            0,
            "{} after the restart: {:?}",
            c.to,
            c.errors()
        );
    }
    println!(
        "after the restart: {} ok answers so far",
        clients.iter().map(EchoClient::ok).sum::<u64>()
    );

    // 3. Fixed: converges, with the endpoint added while it was invalid.
    let mut web: Service = api.get("default", "web").unwrap();
    web.metadata.annotations = None;
    api.apply(&web).unwrap();
    wait_ipvs(&d, "web converged", deadline, |t| {
        t.contains(&format!("-a -t {WEB_CLUSTER} -r 10.244.0.8:8080 -m"))
            && t.contains(&format!("-a -t {WEB_NODE_PORT} -r 10.244.0.8:8080 -m"))
    })
    .await;
    let start: Vec<u64> = clients.iter().map(EchoClient::ok).collect();
    wait_until("traffic after convergence", deadline, || {
        clients.iter().zip(&start).all(|(c, s)| c.ok() >= s + 5)
    })
    .await;
    let mut results = Vec::new();
    for c in clients {
        let to = c.to;
        results.push((to, c.stop()));
    }
    for (to, (ok, failed, errors)) in &results {
        println!("client {to}: {ok} succeeded, {failed} failed");
        assert_eq!(*failed, 0, "{to}: {errors:?}");
    }

    // 4. Deleted: web's virtual servers and VIP go, np's NodePort stays.
    api.delete::<Service>("default", "web").unwrap();
    let t = wait_ipvs(&d, "web removed", deadline, |t| {
        lines_of(t, WEB_CLUSTER).is_empty() && lines_of(t, WEB_NODE_PORT).is_empty()
    })
    .await;
    assert_eq!(lines_of(&t, NP_NODE_PORT), lines_of(&before, NP_NODE_PORT));
    wait_until("10.96.0.20 unbound", deadline, || {
        !sh("ip -o addr show dev kube-ipvs0").contains("10.96.0.20/32")
    })
    .await;
    let (code, log) = d.stop();
    assert_eq!(code, Some(0), "{log}");
    assert!(!log.contains("panicked"), "{log}");
    let _ = std::fs::remove_file(&kc);
}
