//! Localhost NodePorts in iptables mode (`iptables.localhostNodePorts`), end to end: the
//! kube-ipvs binary (`--once --proxy-mode iptables --source-dir`) programs a "node" network
//! namespace with real iptables; a client on the node connects to `127.0.0.1:<nodePort>`.
//!
//! Upstream's behaviour is the spec (pkg/proxy/iptables/proxier.go): `NewProxier` sets
//! `net/ipv4/conf/all/route_localnet=1` when `localhostNodePorts` is on and the NodePort
//! addresses contain IPv4 loopback; `syncProxyRules` writes kubelet's anti-martian rule into
//! `KUBE-FIREWALL` (jumped from INPUT and OUTPUT), and with `localhostNodePorts: false` the
//! `KUBE-SERVICES` NodePort rule excludes `127.0.0.0/8`.
//!
//! Run as root: `cargo test -p kube-ipvs --test localhost_nodeports -- --ignored netns_`.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::net::{Ipv4Addr, SocketAddr};
use std::path::PathBuf;
use std::process::Output;

use testkit::netns::{echo_roundtrip, EchoServer, Netns, Pod};

/// The binary under test; `KUBE_IPVS_BIN` overrides it (a target directory shared by several
/// checkouts re-links `debug/kube-ipvs` from whichever built last).
fn bin() -> String {
    std::env::var("KUBE_IPVS_BIN").unwrap_or_else(|_| env!("CARGO_BIN_EXE_kube-ipvs").into())
}
const NODE_PORT: u16 = 30080;

const MANIFESTS: &str = "apiVersion: v1
kind: Node
metadata: {name: node-a}
---
apiVersion: v1
kind: Service
metadata: {name: web, namespace: default}
spec:
  type: NodePort
  clusterIP: 10.96.0.10
  ports: [{name: http, port: 80, protocol: TCP, targetPort: 8080, nodePort: 30080}]
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
";

/// The binary, once, in iptables mode inside `node`, with `extra` flags; conntrack sysctls are
/// left alone (read-only in a namespace).
fn run_once(node: &Netns, dir: &std::path::Path, extra: &[&str]) -> Output {
    node.command(bin())
        .args([
            "--once",
            "--proxy-mode",
            "iptables",
            "--hostname-override",
            "node-a",
            "--source-dir",
            dir.to_str().unwrap(),
            "--healthz-bind-address",
            "127.0.0.1:0",
            "--metrics-bind-address",
            "127.0.0.1:0",
            "--conntrack-max-per-core=0",
            "--conntrack-tcp-timeout-established=0s",
            "--conntrack-tcp-timeout-close-wait=0s",
        ])
        .args(extra)
        .env_remove("RUST_LOG")
        .output()
        .unwrap()
}

fn route_localnet(node: &Netns) -> String {
    node.run(&["cat", "/proc/sys/net/ipv4/conf/all/route_localnet"])
        .unwrap()
        .trim()
        .to_string()
}

/// Whether a connection from the node to `127.0.0.1:NODE_PORT` reaches the endpoint (the echo
/// server answers with what was sent).
fn localhost_reaches_endpoint(node: &Netns) -> bool {
    let to = SocketAddr::from((Ipv4Addr::LOCALHOST, NODE_PORT));
    let r = echo_roundtrip(node, to, b"hello".to_vec());
    println!("127.0.0.1:{NODE_PORT} -> {r:?}");
    matches!(r, Ok(b) if b == b"hello")
}

#[test]
#[ignore = "netns"]
fn netns_localhost_node_ports_follow_iptables_localhost_nodeports() {
    let node = Netns::new("lonp-node").unwrap();
    let _uplink = Pod::uplink(&node).unwrap();
    node.sysctl("net.ipv4.ip_forward", "1").unwrap();
    let pod = Pod::new(Some(&node), Ipv4Addr::new(10, 244, 1, 1)).unwrap();
    let _server = EchoServer::start(&pod.ns, "0.0.0.0:8080".parse().unwrap()).unwrap();
    let dir: PathBuf = std::env::temp_dir().join(format!("kube-ipvs-lonp-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("objects.yaml"), MANIFESTS).unwrap();
    // A new namespace inherits the host's IPv4 settings (devconf_inherit_init_net=0), which may
    // have route_localnet on already: start from off, so the run below must be what sets it.
    node.sysctl("net.ipv4.conf.all.route_localnet", "0")
        .unwrap();
    assert_eq!(route_localnet(&node), "0");

    // Default (localhostNodePorts: true): route_localnet set, the anti-martian rule and its
    // jumps in place, and 127.0.0.1:<nodePort> reaches the endpoint.
    let out = run_once(&node, &dir, &[]);
    let err = String::from_utf8_lossy(&out.stderr).to_string();
    assert!(out.status.success(), "{err}");
    assert!(
        err.contains("Setting route_localnet=1 to allow node-ports on localhost"),
        "{err}"
    );
    assert_eq!(route_localnet(&node), "1");
    let filter = node.run(&["iptables-save", "-t", "filter"]).unwrap();
    assert!(
        filter.contains(
            "-A KUBE-FIREWALL ! -s 127.0.0.0/8 -d 127.0.0.0/8 -m comment --comment \"block incoming localnet connections\" -m conntrack ! --ctstate RELATED,ESTABLISHED,DNAT -j DROP"
        ),
        "{filter}"
    );
    for chain in ["INPUT", "OUTPUT"] {
        let jumps = filter
            .lines()
            .filter(|l| *l == format!("-A {chain} -j KUBE-FIREWALL"))
            .count();
        assert_eq!(jumps, 1, "{chain}:\n{filter}");
    }
    let nat = node.run(&["iptables-save", "-t", "nat"]).unwrap();
    assert!(!nat.contains("! -d 127.0.0.0/8"), "{nat}");
    assert!(
        localhost_reaches_endpoint(&node),
        "localhost NodePort refused"
    );
    // The node's own address serves the NodePort too.
    let own = SocketAddr::from((Ipv4Addr::new(192, 168, 255, 1), NODE_PORT));
    assert_eq!(
        echo_roundtrip(&node, own, b"x".to_vec()).unwrap(),
        b"x".to_vec()
    );

    // localhostNodePorts: false. route_localnet stays 1 (upstream never resets it), so only the
    // rule keeps 127.0.0.1 from being DNATed: the connection finds no listener and is refused,
    // while the node address still works.
    let out = run_once(&node, &dir, &["--iptables-localhost-nodeports=false"]);
    let err = String::from_utf8_lossy(&out.stderr).to_string();
    assert!(out.status.success(), "{err}");
    assert!(!err.contains("Setting route_localnet=1"), "{err}");
    let nat = node.run(&["iptables-save", "-t", "nat"]).unwrap();
    assert!(
        nat.contains(
            "-A KUBE-SERVICES ! -d 127.0.0.0/8 -m comment --comment \"kubernetes service nodeports; NOTE: this must be the last rule in this chain\" -m addrtype --dst-type LOCAL -j KUBE-NODEPORTS"
        ),
        "{nat}"
    );
    assert!(
        !localhost_reaches_endpoint(&node),
        "127.0.0.1 still DNATed with localhostNodePorts false"
    );
    assert_eq!(
        echo_roundtrip(&node, own, b"y".to_vec()).unwrap(),
        b"y".to_vec()
    );
    // kubelet's chain is never removed by kube-ipvs (cleanup leaves it and its jumps).
    let out = node.command(bin()).args(["--cleanup"]).output().unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let filter = node.run(&["iptables-save", "-t", "filter"]).unwrap();
    assert!(filter.contains(":KUBE-FIREWALL"), "{filter}");
    assert!(filter.contains("-A INPUT -j KUBE-FIREWALL"), "{filter}");
    let _ = std::fs::remove_dir_all(&dir);
}
