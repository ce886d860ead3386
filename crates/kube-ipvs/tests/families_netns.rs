//! IP families, end to end on the host (issue #32): the real binary in iptables mode in a
//! "node" network namespace with IPv4 and a global IPv6 address, where `ip6tables` is made
//! unavailable (failing stand-ins first on `PATH`). Upstream (cmd/kube-proxy/app/server.go,
//! `platformCheckSupported` in server_linux.go) takes the primary family from the node IP and
//! runs single-stack when the other family's tools do not work; so does kube-ipvs, which then
//! picks the family up while it runs once the tools work (here: the stand-ins removed).
//!
//! Run as root: `cargo test -p kube-ipvs --test families_netns -- --ignored netns_`.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::os::unix::fs::PermissionsExt as _;
use std::path::{Path, PathBuf};
use std::process::{Child, Stdio};
use std::time::{Duration, Instant};

use testkit::netns::{Netns, Pod};

fn bin() -> String {
    std::env::var("KUBE_IPVS_BIN").unwrap_or_else(|_| env!("CARGO_BIN_EXE_kube-ipvs").into())
}

const METRICS: &str = "127.0.0.1:10249";

const MANIFESTS: &str = "apiVersion: v1
kind: Node
metadata: {name: node-a}
status:
  addresses:
  - {type: InternalIP, address: 192.168.255.1}
---
apiVersion: v1
kind: Service
metadata: {name: web, namespace: default}
spec:
  type: ClusterIP
  clusterIP: 10.96.0.10
  ports: [{name: http, port: 80, protocol: TCP, targetPort: 8080}]
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: web-1, namespace: default, labels: {kubernetes.io/service-name: web}}
addressType: IPv4
ports: [{name: http, port: 8080, protocol: TCP}]
endpoints:
- addresses: [10.244.1.1]
  nodeName: node-b
  conditions: {ready: true}
---
apiVersion: v1
kind: Service
metadata: {name: web6, namespace: default}
spec:
  type: ClusterIP
  clusterIP: fd00:10:96::a
  clusterIPs: [\"fd00:10:96::a\"]
  ipFamilies: [IPv6]
  ports: [{name: http, port: 80, protocol: TCP, targetPort: 8080}]
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: web6-1, namespace: default, labels: {kubernetes.io/service-name: web6}}
addressType: IPv6
ports: [{name: http, port: 8080, protocol: TCP}]
endpoints:
- addresses: [\"fd00:10:244:1::1\"]
  nodeName: node-b
  conditions: {ready: true}
";

/// The `ip6tables` programs kube-ipvs runs (backend detection, saves, restores).
const IP6TABLES: &[&str] = &[
    "ip6tables",
    "ip6tables-legacy",
    "ip6tables-legacy-save",
    "ip6tables-legacy-restore",
    "ip6tables-nft",
    "ip6tables-nft-save",
    "ip6tables-nft-restore",
    "ip6tables-save",
    "ip6tables-restore",
];

/// A directory of failing stand-ins for every `ip6tables` program.
fn no_ip6tables(dir: &Path) {
    std::fs::create_dir_all(dir).unwrap();
    for name in IP6TABLES {
        let p = dir.join(name);
        std::fs::write(&p, "#!/bin/sh\necho \"$0: not available\" >&2\nexit 1\n").unwrap();
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o755)).unwrap();
    }
}

fn metrics(node: &Netns) -> String {
    let addr: SocketAddr = METRICS.parse().unwrap();
    node.enter(move || {
        let mut s = TcpStream::connect_timeout(&addr, Duration::from_secs(5))?;
        s.set_read_timeout(Some(Duration::from_secs(10)))?;
        write!(
            s,
            "GET /metrics HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n"
        )?;
        let mut raw = String::new();
        s.read_to_string(&mut raw)?;
        Ok(raw)
    })
    .unwrap_or_default()
}

/// Waits (the deadline guards against a hang only) until `f` holds.
fn wait_until(what: &str, log: &Path, mut f: impl FnMut() -> bool) {
    let end = Instant::now() + Duration::from_secs(60);
    while Instant::now() < end {
        if f() {
            return;
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    panic!(
        "never: {what}\nlog:\n{}",
        std::fs::read_to_string(log).unwrap_or_default()
    );
}

struct Daemon(Child);

impl Drop for Daemon {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[test]
#[ignore = "netns"]
fn netns_without_ip6tables_runs_single_stack_then_picks_up_ipv6_without_a_restart() {
    let node = Netns::new("fam-node").unwrap();
    let _uplink = Pod::uplink(&node).unwrap();
    node.ip(&["addr", "add", "fd00:255::1/64", "dev", "uplink0", "nodad"])
        .unwrap();
    let base: PathBuf =
        std::env::temp_dir().join(format!("kube-ipvs-families-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&base);
    let dir = base.join("manifests");
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("objects.yaml"), MANIFESTS).unwrap();
    let fake = base.join("bin");
    no_ip6tables(&fake);
    let log = base.join("daemon.log");
    let path = format!("{}:{}", fake.display(), std::env::var("PATH").unwrap());
    let child = node
        .command(bin())
        .args([
            "--proxy-mode",
            "iptables",
            "--hostname-override",
            "node-a",
            "--source-dir",
            dir.to_str().unwrap(),
            "--healthz-bind-address",
            "127.0.0.1:10256",
            "--metrics-bind-address",
            METRICS,
            "--iptables-sync-period",
            "2s",
            "--iptables-min-sync-period",
            "0s",
            "--conntrack-max-per-core=0",
            "--conntrack-tcp-timeout-established=0s",
            "--conntrack-tcp-timeout-close-wait=0s",
        ])
        .env("PATH", &path)
        .env_remove("RUST_LOG")
        .stdout(Stdio::null())
        .stderr(Stdio::from(std::fs::File::create(&log).unwrap()))
        .spawn()
        .unwrap();
    let mut daemon = Daemon(child);

    // IPv4 (the primary family: the node has an IPv4 address) is programmed; the daemon runs.
    wait_until("the IPv4 Service's rules", &log, || {
        if let Some(st) = daemon.0.try_wait().unwrap() {
            panic!(
                "the daemon exited ({st}):\n{}",
                std::fs::read_to_string(&log).unwrap_or_default()
            );
        }
        node.run(&["iptables-save", "-t", "nat"])
            .is_ok_and(|t| t.contains("10.96.0.10/32"))
    });
    assert!(
        daemon.0.try_wait().unwrap().is_none(),
        "the daemon exited without ip6tables:\n{}",
        std::fs::read_to_string(&log).unwrap_or_default()
    );
    let m = metrics(&node);
    assert!(
        m.contains("kube_ipvs_ip_family_served{ip_family=\"IPv4\"} 1"),
        "{m}"
    );
    assert!(
        m.contains("kube_ipvs_ip_family_served{ip_family=\"IPv6\"} 0"),
        "{m}"
    );
    let text = std::fs::read_to_string(&log).unwrap();
    assert!(text.contains("single-stack"), "{text}");
    assert!(
        text.contains("no support for the secondary IP family"),
        "{text}"
    );
    // The real ip6tables (not on the daemon's PATH first) shows nothing of kube-ipvs.
    let v6 = node.run(&["ip6tables-save", "-t", "nat"]).unwrap();
    assert!(!v6.contains("KUBE-SERVICES"), "{v6}");

    // ip6tables works from now on: IPv6 is picked up without a restart.
    std::fs::remove_dir_all(&fake).unwrap();
    wait_until("the IPv6 Service's rules", &log, || {
        node.run(&["ip6tables-save", "-t", "nat"])
            .is_ok_and(|t| t.contains("fd00:10:96::a/128"))
    });
    assert!(daemon.0.try_wait().unwrap().is_none());
    let m = metrics(&node);
    assert!(
        m.contains("kube_ipvs_ip_family_served{ip_family=\"IPv6\"} 1"),
        "{m}"
    );
    let text = std::fs::read_to_string(&log).unwrap();
    assert!(text.contains("dual-stack"), "{text}");
    drop(daemon);
    let _ = std::fs::remove_dir_all(&base);
}
