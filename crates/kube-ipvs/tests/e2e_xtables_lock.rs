//! Issue #16 (c), end to end in the VM: another program holds the xtables lock for 60 s.
//!
//! Lab (`api_lab`): a node namespace with two pods running echo servers, the fake API server,
//! a NodePort Service `web` (ClusterIP 10.96.0.20:80, NodePort 30080 on 192.168.0.10) and the
//! real daemon with `--ipvs-sync-period 10s` (health window 2 × 10 s = 20 s). A kubelet-style
//! `KUBE-IPTABLES-HINT` chain is seeded with `iptables-legacy` before the start, so backend
//! detection picks the legacy backend, the one that takes the xtables lock (the nft backend takes
//! none); the test asserts the pick from the log and from the kernel. Two clients echo through
//! the ClusterIP and the NodePort the whole time.
//!
//! The fault: `flock /run/xtables.lock sleep 60` (util-linux; `/run/xtables.lock` is one file
//! for every namespace, so this test lives in its own binary and always releases it). Right
//! after the lock is taken, a Service `ext` with an externalIP is added: its first external IP
//! makes the `KUBE-EXTERNAL-IP` set non-empty, so its `KUBE-SERVICES` rules need an
//! `iptables-restore`. Every restore (the change's, the retries', the periodic full syncs')
//! gives up after the 5 s lock wait (`-w 5`, upstream's). Asserted:
//!
//! - `/healthz` is 200 while the fault is younger than the window (samples before 15 s), and
//!   503 from 35 s on (2 × syncPeriod + one 5 s lock wait + 10 s slack for the emulated VM) until
//!   the release, the body naming `iptables` (or `pending`); an `iptables` reason carries the
//!   lock error;
//! - `kube_ipvs_sync_failures_total{subsystem="iptables"}` grows, and
//!   `kube_ipvs_last_successful_sync_age_seconds{subsystem="iptables"}` passes the window;
//! - IPVS is untouched by the lock: `ext`'s virtual server is programmed during the hold, and
//!   0 connections fail through the ClusterIP and the NodePort;
//! - after the release, within one backoff (≤ syncPeriod + 15 % jitter + a 5 s lock wait +
//!   margin = 30 s), the pending rules are in the kernel, `/healthz` is 200 again and `ext`
//!   serves through its external IP.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod api_lab;
mod common;

use std::net::{Ipv4Addr, SocketAddr};
use std::os::unix::process::CommandExt;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use api_lab::{sh, wait_ipvs, Daemon, EchoClient, Lab};
use testkit::apiserver::FakeApiServer;

const CLUSTER_IP: &str = "10.96.0.20:80";
const NODE_PORT: &str = "192.168.0.10:30080";
const EXTERNAL_IP: &str = "192.168.0.100:80";
/// The lock every iptables-legacy program of the (VM) host takes, whatever its namespace.
const XTABLES_LOCK: &str = "/run/xtables.lock";
const HOLD: Duration = Duration::from_secs(60);
/// 2 × syncPeriod (10 s).
const WINDOW: Duration = Duration::from_secs(20);
/// Only guards against a hang.
const DEADLINE: Duration = Duration::from_secs(120);

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
  ports: [{name: http, port: 80, targetPort: 8080, nodePort: 30080, protocol: TCP}]
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
"#;

/// The change made while the lock is held: the node's first externalIP.
const EXT: &str = r#"
apiVersion: v1
kind: Service
metadata: {name: ext, namespace: default}
spec:
  type: ClusterIP
  clusterIP: 10.96.0.30
  clusterIPs: [10.96.0.30]
  externalIPs: [192.168.0.100]
  ports: [{name: http, port: 80, targetPort: 8080, protocol: TCP}]
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata:
  name: ext-1
  namespace: default
  labels: {kubernetes.io/service-name: ext}
addressType: IPv4
ports: [{name: http, port: 8080, protocol: TCP}]
endpoints:
- addresses: [10.244.0.8]
  conditions: {ready: true}
"#;

/// `flock /run/xtables.lock sleep SECS` in its own process group: killed with its group on drop
/// (also when the test fails), so the lock never outlives the test.
struct LockHolder {
    child: Child,
}

impl LockHolder {
    fn take(secs: u64) -> LockHolder {
        let child = Command::new("flock")
            .args([XTABLES_LOCK, "sleep", &secs.to_string()])
            .process_group(0)
            .stdout(Stdio::null())
            .stderr(Stdio::inherit())
            .spawn()
            .unwrap_or_else(|e| panic!("flock (util-linux) must be in the VM image: {e}"));
        LockHolder { child }
    }

    fn exited(&mut self) -> bool {
        self.child.try_wait().unwrap().is_some()
    }
}

impl Drop for LockHolder {
    fn drop(&mut self) {
        // The whole group (flock and its `sleep`); gone already after a normal exit. busybox
        // `kill` takes a negative pid (the group) without `--`.
        let pgid = format!("-{}", self.child.id());
        let _ = Command::new("kill")
            .args(["-KILL", &pgid])
            .stderr(Stdio::null())
            .status();
        let _ = self.child.wait();
    }
}

/// Whether some other process holds the xtables lock now (`flock -n` fails to take it).
fn lock_is_held() -> bool {
    !Command::new("flock")
        .args(["-n", XTABLES_LOCK, "true"])
        .status()
        .unwrap()
        .success()
}

/// One round of observations while the lock is held.
struct Sample {
    /// Since the lock was taken.
    at: Duration,
    /// `/healthz`: "code body".
    health: String,
    failures: Option<f64>,
    age: Option<f64>,
}

impl Sample {
    fn line(&self) -> String {
        format!(
            "t+{:>4.1}s failures {:?} age {:?} /healthz {}",
            self.at.as_secs_f64(),
            self.failures,
            self.age,
            self.health
        )
    }
}

async fn healthz(d: &Daemon) -> String {
    match common::get(d.healthz, "/healthz").await {
        Ok(r) => format!("{} {}", r.status, r.body),
        Err(e) => format!("error {e}"),
    }
}

/// The value of one metric series (`name{labels}` exactly), if present.
async fn metric(d: &Daemon, series: &str) -> Option<f64> {
    let m = common::get(d.metrics, "/metrics").await.unwrap().body;
    m.lines()
        .find_map(|l| l.strip_prefix(series)?.strip_prefix(' '))
        .and_then(|v| v.trim().parse().ok())
}

const FAILURES: &str = r#"kube_ipvs_sync_failures_total{subsystem="iptables"}"#;
const AGE: &str = r#"kube_ipvs_last_successful_sync_age_seconds{subsystem="iptables"}"#;

/// The legacy `nat` table (bounded: `iptables-legacy-save` takes no lock, but never hang here).
fn legacy_nat() -> String {
    sh("timeout 20 iptables-legacy-save -t nat")
}

fn has_external_ip_rules(nat: &str) -> bool {
    nat.lines()
        .any(|l| l.starts_with("-A KUBE-SERVICES") && l.contains("--match-set KUBE-EXTERNAL-IP "))
}

#[test]
#[ignore = "vm"]
fn vm_e2e_xtables_lock_held_60s_healthz_503_traffic_flows_then_recovers() {
    let lab = Lab::new(
        "e2e-xtlock",
        &[Ipv4Addr::new(10, 244, 0, 7), Ipv4Addr::new(10, 244, 0, 8)],
    );
    lab.run(xtables_lock);
}

async fn xtables_lock() {
    assert!(
        !lock_is_held(),
        "the xtables lock is held before the test starts"
    );
    // kubelet's hint chain in the legacy tables: backend detection must pick legacy.
    let seeded = Command::new("iptables-legacy")
        .args(["-t", "mangle", "-N", "KUBE-IPTABLES-HINT"])
        .status()
        .unwrap();
    assert!(seeded.success());

    let api = FakeApiServer::start().await.unwrap();
    assert_eq!(api.load_str(OBJECTS).unwrap(), 3);
    let kc = std::env::temp_dir().join(format!("e2e-xtlock-kc-{}.yaml", std::process::id()));
    api.write_kubeconfig(&kc).unwrap();
    let mut d = Daemon::start(
        kc.to_str().unwrap(),
        &["--ipvs-sync-period", "10s", "--ipvs-min-sync-period", "0s"],
    );
    wait_ipvs(&d, "web programmed", DEADLINE, |t| {
        t.contains("-a -t 10.96.0.20:80 -r 10.244.0.7:8080 -m")
            && t.contains("-a -t 192.168.0.10:30080 -r 10.244.0.7:8080 -m")
    })
    .await;
    let start = Instant::now();
    while !legacy_nat().contains(":KUBE-SERVICES ") {
        assert!(
            start.elapsed() < DEADLINE,
            "no legacy KUBE-SERVICES:\n{}",
            d.log()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let log = d.log();
    let picked = log
        .lines()
        .find(|l| l.contains("iptables backend selected"))
        .unwrap_or_else(|| panic!("no backend line in the log:\n{log}"))
        .to_string();
    println!("backend: {picked}");
    assert!(picked.contains("Legacy"), "{picked}");
    let nft = sh("iptables-nft-save -t nat");
    assert!(!nft.contains(":KUBE-"), "kube chains in nft too:\n{nft}");
    assert!(!has_external_ip_rules(&legacy_nat()));

    let cluster = EchoClient::start(CLUSTER_IP);
    let node_port = EchoClient::start(NODE_PORT);
    cluster.wait_answers(5, DEADLINE).await;
    node_port.wait_answers(5, DEADLINE).await;
    let h = healthz(&d).await;
    assert!(h.starts_with("200"), "{h}");
    let failures_before = metric(&d, FAILURES).await;
    println!("before: /healthz {h}; {FAILURES} {failures_before:?}");
    assert_eq!(failures_before, Some(0.0));

    // The lock is taken by another program; then the change that needs a restore.
    let mut holder = LockHolder::take(HOLD.as_secs());
    let held = Instant::now();
    while !lock_is_held() {
        assert!(!holder.exited(), "flock exited without holding the lock");
        assert!(held.elapsed() < DEADLINE, "flock never took the lock");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let held = Instant::now();
    assert_eq!(api.load_str(EXT).unwrap(), 2);

    // Sample /healthz and the metrics every 2 s until flock lets go.
    let mut samples: Vec<Sample> = Vec::new();
    let mut ext_vs_at = None;
    while !holder.exited() {
        assert!(held.elapsed() < HOLD + DEADLINE, "flock never exited");
        assert!(d.alive(), "the daemon exited:\n{}", d.log());
        let at = held.elapsed();
        let health = healthz(&d).await;
        let failures = metric(&d, FAILURES).await;
        let age = metric(&d, AGE).await;
        if ext_vs_at.is_none()
            && sh("ipvsadm -Sn").contains("-a -t 192.168.0.100:80 -r 10.244.0.8:8080 -m")
        {
            ext_vs_at = Some(at);
        }
        // Nothing of the change reached iptables while the lock was held (read, then checked
        // that the lock was still held after the read).
        let nat = legacy_nat();
        if !holder.exited() {
            assert!(
                !has_external_ip_rules(&nat),
                "rules restored while the lock was held:\n{nat}"
            );
            samples.push(Sample {
                at,
                health,
                failures,
                age,
            });
        }
        tokio::time::sleep(Duration::from_secs(2)).await;
    }
    let released = Instant::now();
    let hold = released.duration_since(held);
    let lines: Vec<String> = samples.iter().map(Sample::line).collect();
    println!(
        "xtables lock held {:.1} s; samples:\n  {}",
        hold.as_secs_f64(),
        lines.join("\n  ")
    );
    assert!(hold >= HOLD - Duration::from_secs(2), "{hold:?}");
    println!("during the hold: {}; {}", cluster.line(), node_port.line());

    // IPVS kept working: ext's virtual server came in while the lock was held.
    let ext_vs_at = ext_vs_at.expect("ext's virtual server was not programmed during the hold");
    println!(
        "ext's virtual server programmed {:.1} s into the hold",
        ext_vs_at.as_secs_f64()
    );

    // Health: quiet inside the window, 503 with the reason after it (window + one lock wait +
    // slack for the emulated VM).
    let early: Vec<_> = samples
        .iter()
        .filter(|s| s.at < Duration::from_secs(15))
        .collect();
    let late: Vec<_> = samples
        .iter()
        .filter(|s| s.at >= WINDOW + Duration::from_secs(15))
        .collect();
    assert!(!early.is_empty() && late.len() >= 5, "{lines:#?}");
    for s in early {
        assert!(s.health.starts_with("200"), "{}", s.line());
    }
    for s in &late {
        assert!(s.health.starts_with("503"), "{}", s.line());
        assert!(
            s.health.contains(r#""subsystem":"iptables""#)
                || s.health.contains(r#""subsystem":"pending""#),
            "{}",
            s.line()
        );
    }
    let first_503 = samples
        .iter()
        .find(|s| s.health.starts_with("503"))
        .map(|s| s.at)
        .unwrap();
    println!(
        "/healthz 503 from {:.1} s into the hold (window {} s)",
        first_503.as_secs_f64(),
        WINDOW.as_secs()
    );
    let iptables_reason = samples
        .iter()
        .find(|s| s.health.contains(r#""subsystem":"iptables""#))
        .map(|s| s.health.clone())
        .expect("no 503 named the iptables subsystem");
    assert!(
        iptables_reason.contains("xtables lock is held by another program"),
        "{iptables_reason}"
    );

    // The metrics of the last round while the lock was held.
    let last = samples.last().unwrap();
    println!("at the end of the hold: {}", last.line());
    assert!(last.failures.unwrap_or(0.0) >= 2.0, "{}", last.line());
    assert!(
        last.age.unwrap_or(0.0) >= WINDOW.as_secs_f64(),
        "{}",
        last.line()
    );

    // Release: within one backoff the pending rules go in and /healthz is 200 again.
    let mut rules_at = None;
    let mut healthy_at = None;
    while rules_at.is_none() || healthy_at.is_none() {
        if rules_at.is_none() && has_external_ip_rules(&legacy_nat()) {
            rules_at = Some(released.elapsed());
        }
        if healthy_at.is_none() && healthz(&d).await.starts_with("200") {
            healthy_at = Some(released.elapsed());
        }
        assert!(
            released.elapsed() < DEADLINE,
            "no recovery after the release: rules {rules_at:?}, healthy {healthy_at:?}\n{}\n{}",
            healthz(&d).await,
            d.log()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let (rules_at, healthy_at) = (rules_at.unwrap(), healthy_at.unwrap());
    println!(
        "after the release: rules in {:.1} s, /healthz 200 in {:.1} s",
        rules_at.as_secs_f64(),
        healthy_at.as_secs_f64()
    );
    // One backoff at most: syncPeriod + 15 % jitter, a restore that may still be waiting on
    // the lock (5 s), and slack for the emulated VM.
    let one_backoff = Duration::from_secs(30);
    assert!(rules_at <= one_backoff, "{rules_at:?}");
    assert!(healthy_at <= one_backoff, "{healthy_at:?}");
    let failures_after = metric(&d, FAILURES).await.unwrap();
    println!("{FAILURES} {failures_after} after the release");

    // The pending Service serves through its external IP.
    let ext: SocketAddr = EXTERNAL_IP.parse().unwrap();
    for n in 0..5 {
        api_lab::echo_once(ext, n).unwrap();
    }

    cluster.finish();
    node_port.finish();
    drop(holder);
    let (code, log) = d.stop();
    let lock_errors = log
        .lines()
        .filter(|l| l.contains("xtables lock is held by another program"))
        .count();
    println!(
        "daemon log: {} lines, {lock_errors} lock errors:\n{log}",
        log.lines().count()
    );
    assert!(lock_errors >= 1, "{log}");
    assert_eq!(code, Some(0), "{log}");
    assert!(!log.contains("panicked"), "{log}");
    let _ = std::fs::remove_file(&kc);
}
