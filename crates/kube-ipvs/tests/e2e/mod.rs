//! End-to-end lab for the `vm_e2e_*` tests: a "node" network namespace where the real kube-ipvs
//! binary runs (`--source-dir`), "pods" joined to it by veth, and an external "client" namespace
//! on the node's LAN. Everything lives in namespaces this module creates and deletes.
//!
//! Layout (all addresses exist only inside these namespaces):
//!
//! ```text
//!  client ns                         node ns (daemon)                       pod ns (one per pod)
//!  eth0 192.168.0.20/24  ─ veth ─   eth0 192.168.0.10/24                  eth0 10.244.1.N/32
//!       192.168.0.21/24              fd00:192:168::10/64                       fd00:10:244:1::N/128
//!       fd00:192:168::20/64          default via 192.168.0.20       ─veth─ default via 169.254.1.1
//!  routes to 198.51.100.0/24,        kpN: proxy_arp, fe80::1,              default via fe80::1
//!  203.0.113.0/24 via the node       POD/32 + POD6/128 dev kpN
//! ```
//!
//! Each pod runs a name server on TCP and UDP port [`POD_PORT`] (both families): a TCP
//! connection first receives `"<pod name>\n"` and then has every line echoed back; a UDP
//! datagram is answered with the pod name. Manifests are written to the lab's source directory
//! ([`Lab::write`]) and the daemon re-reads them on change.

#![allow(dead_code, clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::fmt::Write as _;
use std::fs;
use std::io::{self, BufRead, BufReader, Read, Write};
use std::net::{
    IpAddr, Ipv4Addr, Ipv6Addr, Shutdown, SocketAddr, TcpListener, TcpStream, UdpSocket,
};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

pub use testkit::netns::Netns;

/// The kube-ipvs binary under test.
pub const BIN: &str = env!("CARGO_BIN_EXE_kube-ipvs");
/// This node's name (`--hostname-override` and the Node manifest).
pub const NODE_NAME: &str = "node-1";
/// The node's LAN address (NodePorts are served on it).
pub const NODE_IP: Ipv4Addr = Ipv4Addr::new(192, 168, 0, 10);
/// The node's IPv6 LAN address.
pub const NODE_IP6: Ipv6Addr = Ipv6Addr::new(0xfd00, 0x192, 0x168, 0, 0, 0, 0, 0x10);
/// The external client's first address.
pub const CLIENT_IP: Ipv4Addr = Ipv4Addr::new(192, 168, 0, 20);
/// The external client's second address (for "denied source" checks).
pub const CLIENT_IP2: Ipv4Addr = Ipv4Addr::new(192, 168, 0, 21);
/// The external client's IPv6 address.
pub const CLIENT_IP6: Ipv6Addr = Ipv6Addr::new(0xfd00, 0x192, 0x168, 0, 0, 0, 0, 0x20);
/// The port every pod's name server listens on (TCP and UDP, IPv4 and IPv6).
pub const POD_PORT: u16 = 8080;
/// Metrics address inside the node namespace (loopback is per namespace).
pub const METRICS: &str = "127.0.0.1:10249";
/// Healthz address inside the node namespace.
pub const HEALTHZ: &str = "127.0.0.1:10256";

static SEQ: AtomicU32 = AtomicU32::new(0);

/// `ip ARGS` in the current namespace, panicking with the tool's error.
fn must(r: io::Result<String>) -> String {
    r.unwrap_or_else(|e| panic!("{e}"))
}

/// The lab: node + client namespaces, pods, a manifest directory and (optionally) the daemon.
pub struct Lab {
    /// Where the daemon runs.
    pub node: Netns,
    /// External client on the node's LAN.
    pub client: Netns,
    /// Pods, in creation order.
    pub pods: Vec<LabPod>,
    /// The `--source-dir` directory.
    pub dir: PathBuf,
    /// The daemon's stderr log.
    pub log: PathBuf,
    daemon: std::sync::Mutex<Option<Child>>,
    next_if: u32,
}

/// A pod: its namespace, addresses and name servers.
pub struct LabPod {
    /// Pod name (what its servers answer).
    pub name: String,
    /// Its namespace.
    pub ns: Netns,
    /// IPv4 address.
    pub ip: Ipv4Addr,
    /// IPv6 address, if dual-stack.
    pub ip6: Option<Ipv6Addr>,
    /// Node-side interface.
    pub host_if: String,
    servers: Servers,
}

impl LabPod {
    /// `ip:POD_PORT`.
    pub fn addr(&self) -> SocketAddr {
        SocketAddr::from((self.ip, POD_PORT))
    }
    /// Connections the TCP server has accepted so far.
    pub fn accepted(&self) -> u32 {
        self.servers.accepted.load(Ordering::Relaxed)
    }
}

impl Lab {
    /// Build the node and client namespaces and write the Node manifest.
    pub fn new(tag: &str) -> Lab {
        let node = Netns::new(&format!("{tag}-node")).expect("node netns (needs root)");
        let client = Netns::new(&format!("{tag}-cli")).expect("client netns");
        testkit::netns::veth_pair(&node, "eth0", &client, "eth0").unwrap();
        // IPv6 forwarding is not one of the daemon's sysctls; IPv4's is (checked by the tests).
        node.sysctl("net.ipv6.conf.all.forwarding", "1").unwrap();
        must(node.ip(&["addr", "add", "192.168.0.10/24", "dev", "eth0"]));
        must(node.ip(&["addr", "add", "fd00:192:168::10/64", "dev", "eth0", "nodad"]));
        must(node.ip(&["route", "add", "default", "via", "192.168.0.20"]));
        must(node.ip(&["-6", "route", "add", "default", "via", "fd00:192:168::20"]));
        must(client.ip(&["addr", "add", "192.168.0.20/24", "dev", "eth0"]));
        must(client.ip(&["addr", "add", "192.168.0.21/24", "dev", "eth0"]));
        must(client.ip(&["addr", "add", "fd00:192:168::20/64", "dev", "eth0", "nodad"]));
        for net in ["198.51.100.0/24", "203.0.113.0/24"] {
            must(client.ip(&["route", "add", net, "via", "192.168.0.10"]));
        }
        let dir = std::env::temp_dir().join(format!(
            "kube-ipvs-e2e-{tag}-{}-{}",
            std::process::id(),
            SEQ.fetch_add(1, Ordering::Relaxed)
        ));
        let _ = fs::remove_dir_all(&dir);
        fs::create_dir_all(dir.join("manifests")).unwrap();
        let log = dir.join("daemon.log");
        let lab = Lab {
            node,
            client,
            pods: Vec::new(),
            dir: dir.join("manifests"),
            log,
            daemon: std::sync::Mutex::new(None),
            next_if: 0,
        };
        lab.write("00-node", &node_yaml());
        lab
    }

    /// Add a pod named `name` with `10.244.1.<n>` (and `fd00:10:244:1::<n>` when `v6`), its
    /// servers started. Returns its index in [`Lab::pods`].
    pub fn add_pod(&mut self, name: &str, n: u8, v6: bool) -> usize {
        let ip = Ipv4Addr::new(10, 244, 1, n);
        let ip6 = v6.then(|| Ipv6Addr::new(0xfd00, 0x10, 0x244, 1, 0, 0, 0, n as u16));
        let ns = Netns::new("e2epod").expect("pod netns");
        let host_if = format!("kp{}", self.next_if);
        self.next_if += 1;
        testkit::netns::attach_pod(Some(&self.node), &ns, &host_if, ip)
            .unwrap_or_else(|e| panic!("{e}"));
        if let Some(ip6) = ip6 {
            must(
                self.node
                    .ip(&["addr", "add", "fe80::1/64", "dev", &host_if, "nodad"]),
            );
            must(
                self.node
                    .ip(&["-6", "route", "add", &format!("{ip6}/128"), "dev", &host_if]),
            );
            must(ns.ip(&["addr", "add", &format!("{ip6}/128"), "dev", "eth0", "nodad"]));
            must(ns.ip(&[
                "-6", "route", "add", "default", "via", "fe80::1", "dev", "eth0",
            ]));
        }
        let servers = Servers::start(&ns, name).unwrap();
        self.pods.push(LabPod {
            name: name.to_string(),
            ns,
            ip,
            ip6,
            host_if,
            servers,
        });
        self.pods.len() - 1
    }

    /// Write (atomically: temp file + rename) `<name>.yaml` into the source directory.
    pub fn write(&self, name: &str, yaml: &str) {
        let tmp = self.dir.join(format!(".{name}.tmp"));
        fs::write(&tmp, yaml).unwrap();
        fs::rename(&tmp, self.dir.join(format!("{name}.yaml"))).unwrap();
    }

    /// Remove `<name>.yaml` from the source directory.
    pub fn remove(&self, name: &str) {
        let _ = fs::remove_file(self.dir.join(format!("{name}.yaml")));
    }

    /// Start the daemon in the node namespace with the lab's defaults (`--source-dir`,
    /// `--hostname-override`, metrics/healthz on the namespace's loopback, `-v 2`) plus `extra`.
    /// Its stderr is appended to [`Lab::log`].
    pub fn start_daemon(&self, extra: &[&str]) {
        let mut slot = self.daemon.lock().unwrap();
        assert!(slot.is_none(), "daemon already running");
        let log = fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.log)
            .unwrap();
        let child = self
            .node
            .command(BIN)
            .args([
                "--source-dir",
                self.dir.to_str().unwrap(),
                "--hostname-override",
                NODE_NAME,
                "--metrics-bind-address",
                METRICS,
                "--healthz-bind-address",
                HEALTHZ,
                "--ipvs-fallback=false",
                // nf_conntrack_max is read-only in a test namespace (kind sets this too).
                "--conntrack-max-per-core=0",
                "-v",
                "2",
            ])
            .args(extra)
            .env_remove("RUST_LOG")
            .stdout(Stdio::null())
            .stderr(Stdio::from(log))
            .spawn()
            .unwrap();
        *slot = Some(child);
    }

    /// The daemon's pid.
    pub fn daemon_pid(&self) -> Option<u32> {
        self.daemon.lock().unwrap().as_ref().map(Child::id)
    }

    /// `kill -9` the daemon and reap it; its kernel state stays behind.
    pub fn kill9(&self) {
        if let Some(mut c) = self.daemon.lock().unwrap().take() {
            c.kill().unwrap();
            let st = c.wait().unwrap();
            println!("daemon killed with SIGKILL: {st}");
        }
    }

    /// SIGTERM the daemon and wait for it; returns its exit code.
    pub fn stop(&self) -> Option<i32> {
        let mut c = self.daemon.lock().unwrap().take()?;
        let _ = Command::new("kill")
            .args(["-TERM", &c.id().to_string()])
            .status();
        c.wait().ok().and_then(|s| s.code())
    }

    /// The daemon's log so far.
    pub fn log_text(&self) -> String {
        fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// `sync done` log lines so far, in order.
    pub fn sync_lines(&self) -> Vec<String> {
        self.log_text()
            .lines()
            .filter(|l| l.contains("sync done"))
            .map(str::to_string)
            .collect()
    }

    /// Waits (deadline only against a hang) until /metrics contains `needle`; returns the body.
    pub fn wait_metrics(&self, needle: &str, deadline: Duration) -> String {
        let mut last = String::new();
        let ok = wait_until(deadline, || {
            last = self.metrics();
            last.contains(needle)
        });
        assert!(
            ok,
            "/metrics never contained {needle:?}; last:\n{last}\nlog:\n{}",
            tail(&self.log_text(), 40)
        );
        last
    }

    /// The /metrics body ("" when it does not answer).
    pub fn metrics(&self) -> String {
        http_get_in(&self.node, METRICS.parse().unwrap(), "/metrics").unwrap_or_default()
    }

    /// One metric sample's value: `name` is the full series text before the value, e.g.
    /// `kube_ipvs_drift_repairs_total{subsystem="ipvs"}`. Missing: 0.
    pub fn metric(&self, series: &str) -> f64 {
        metric_value(&self.metrics(), series)
    }

    /// Waits until the daemon has completed a sync after the manifests now on disk (the number
    /// of `sync done` lines grows past `after`) — used after rewriting manifests.
    pub fn wait_syncs_past(&self, after: usize, deadline: Duration) {
        let ok = wait_until(deadline, || self.sync_lines().len() > after);
        assert!(
            ok,
            "no sync within {deadline:?}:\n{}",
            tail(&self.log_text(), 40)
        );
    }

    /// TCP from the client namespace with source `src` (one of its addresses), routed via the
    /// node; reads the pod name.
    pub fn client_tcp_from(&self, to: SocketAddr, src: Ipv4Addr, timeout: Duration) -> Outcome {
        tcp_name_from(
            &self.client,
            to,
            IpAddr::V4(NODE_IP),
            IpAddr::V4(src),
            timeout,
        )
    }

    /// Run `argv` in the node namespace (stdout; panics on failure).
    pub fn node_run(&self, argv: &[&str]) -> String {
        self.node
            .run(argv)
            .unwrap_or_else(|e| panic!("{argv:?}: {e}"))
    }

    /// `ipvsadm -Sn` in the node namespace.
    pub fn ipvs_save(&self) -> String {
        self.node_run(&["ipvsadm", "-Sn"])
    }

    /// Waits until `ipvsadm -Sn` contains every line of `want`.
    pub fn wait_ipvs(&self, want: &[&str], deadline: Duration) {
        let mut last = String::new();
        let ok = wait_until(deadline, || {
            last = self.ipvs_save();
            want.iter().all(|w| last.lines().any(|l| l == *w))
        });
        assert!(
            ok,
            "ipvs never had {want:?}:\n{last}\nlog:\n{}",
            tail(&self.log_text(), 40)
        );
    }
}

impl Drop for Lab {
    fn drop(&mut self) {
        let child = self.daemon.get_mut().map(Option::take).unwrap_or(None);
        if let Some(mut c) = child {
            let _ = c.kill();
            let _ = c.wait();
        }
        if std::thread::panicking() {
            eprintln!(
                "--- daemon log tail ({}) ---\n{}",
                self.log.display(),
                tail(&self.log_text(), 60)
            );
        }
        if let Some(parent) = self.dir.parent() {
            let _ = fs::remove_dir_all(parent);
        }
    }
}

/// The last `n` lines of `s`.
pub fn tail(s: &str, n: usize) -> String {
    let lines: Vec<&str> = s.lines().collect();
    lines[lines.len().saturating_sub(n)..].join("\n")
}

/// Polls `f` every 50 ms until it returns true or `deadline` passes (the deadline only
/// prevents a hang; nothing asserts on how long it took).
pub fn wait_until(deadline: Duration, mut f: impl FnMut() -> bool) -> bool {
    let end = Instant::now() + deadline;
    loop {
        if f() {
            return true;
        }
        if Instant::now() > end {
            return false;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// The Node manifest: `node-1` with both LAN addresses.
pub fn node_yaml() -> String {
    format!(
        "apiVersion: v1\nkind: Node\nmetadata:\n  name: {NODE_NAME}\n  labels: {{kubernetes.io/hostname: {NODE_NAME}}}\n\
         spec:\n  podCIDRs: [10.244.1.0/24, 'fd00:10:244:1::/64']\nstatus:\n  addresses:\n\
         \x20 - {{type: InternalIP, address: {NODE_IP}}}\n  - {{type: InternalIP, address: '{NODE_IP6}'}}\n\
         \x20 - {{type: Hostname, address: {NODE_NAME}}}\n"
    )
}

/// One service port.
#[derive(Clone, Debug)]
pub struct Port {
    /// Port name.
    pub name: String,
    /// TCP, UDP or SCTP.
    pub proto: &'static str,
    /// Service port.
    pub port: u16,
    /// Endpoint port.
    pub target: u16,
    /// NodePort, if any.
    pub node_port: Option<u16>,
}

impl Port {
    /// `proto` port `port` → [`POD_PORT`], named `p<port>-<proto>`.
    pub fn new(proto: &'static str, port: u16) -> Port {
        Port {
            name: format!("p{port}-{}", proto.to_lowercase()),
            proto,
            port,
            target: POD_PORT,
            node_port: None,
        }
    }
    /// With a NodePort.
    pub fn node_port(mut self, np: u16) -> Port {
        self.node_port = Some(np);
        self
    }
}

/// An endpoint: address and node.
#[derive(Clone, Debug)]
pub struct Ep {
    /// Address.
    pub ip: IpAddr,
    /// Node name.
    pub node: String,
    /// Ready condition.
    pub ready: bool,
}

impl Ep {
    /// A ready endpoint on this node.
    pub fn local(ip: impl Into<IpAddr>) -> Ep {
        Ep {
            ip: ip.into(),
            node: NODE_NAME.to_string(),
            ready: true,
        }
    }
    /// A ready endpoint on another node.
    pub fn remote(ip: impl Into<IpAddr>) -> Ep {
        Ep {
            ip: ip.into(),
            node: "node-2".to_string(),
            ready: true,
        }
    }
}

/// A Service plus its EndpointSlice, rendered to YAML by [`Svc::yaml`].
#[derive(Clone, Debug)]
pub struct Svc {
    /// Name (namespace `default`).
    pub name: String,
    /// ClusterIP, IPv4 or IPv6 (the family of the service and its slice).
    pub cluster_ip: IpAddr,
    /// ClusterIP, NodePort or LoadBalancer.
    pub kind: &'static str,
    /// Ports.
    pub ports: Vec<Port>,
    /// spec.externalIPs.
    pub external_ips: Vec<IpAddr>,
    /// status.loadBalancer.ingress IP.
    pub lb_ip: Option<IpAddr>,
    /// spec.loadBalancerSourceRanges.
    pub source_ranges: Vec<String>,
    /// externalTrafficPolicy Local.
    pub etp_local: bool,
    /// internalTrafficPolicy Local.
    pub itp_local: bool,
    /// sessionAffinity ClientIP (timeout seconds).
    pub affinity: Option<u32>,
    /// Endpoints (one slice).
    pub endpoints: Vec<Ep>,
}

impl Svc {
    /// A ClusterIP service.
    pub fn new(name: &str, cluster_ip: impl Into<IpAddr>, ports: Vec<Port>) -> Svc {
        Svc {
            name: name.to_string(),
            cluster_ip: cluster_ip.into(),
            kind: "ClusterIP",
            ports,
            external_ips: Vec::new(),
            lb_ip: None,
            source_ranges: Vec::new(),
            etp_local: false,
            itp_local: false,
            affinity: None,
            endpoints: Vec::new(),
        }
    }
    /// With endpoints.
    pub fn eps(mut self, eps: Vec<Ep>) -> Svc {
        self.endpoints = eps;
        self
    }

    /// Service + EndpointSlice YAML (two documents).
    pub fn yaml(&self) -> String {
        let v6 = self.cluster_ip.is_ipv6();
        let fam = if v6 { "IPv6" } else { "IPv4" };
        let mut s = String::new();
        writeln!(
            s,
            "apiVersion: v1\nkind: Service\nmetadata: {{name: {}, namespace: default}}",
            self.name
        )
        .unwrap();
        writeln!(
            s,
            "spec:\n  type: {}\n  clusterIP: '{}'\n  clusterIPs: ['{}']",
            self.kind, self.cluster_ip, self.cluster_ip
        )
        .unwrap();
        writeln!(s, "  ipFamilies: [{fam}]\n  ipFamilyPolicy: SingleStack").unwrap();
        if self.kind != "ClusterIP" {
            let etp = if self.etp_local { "Local" } else { "Cluster" };
            writeln!(s, "  externalTrafficPolicy: {etp}").unwrap();
        }
        if self.itp_local {
            writeln!(s, "  internalTrafficPolicy: Local").unwrap();
        }
        if let Some(t) = self.affinity {
            writeln!(s, "  sessionAffinity: ClientIP\n  sessionAffinityConfig: {{clientIP: {{timeoutSeconds: {t}}}}}").unwrap();
        }
        if !self.external_ips.is_empty() {
            let ips: Vec<String> = self.external_ips.iter().map(|i| format!("'{i}'")).collect();
            writeln!(s, "  externalIPs: [{}]", ips.join(", ")).unwrap();
        }
        if !self.source_ranges.is_empty() {
            writeln!(
                s,
                "  loadBalancerSourceRanges: [{}]",
                self.source_ranges.join(", ")
            )
            .unwrap();
        }
        writeln!(s, "  ports:").unwrap();
        for p in &self.ports {
            write!(
                s,
                "  - {{name: {}, protocol: {}, port: {}, targetPort: {}",
                p.name, p.proto, p.port, p.target
            )
            .unwrap();
            if let Some(np) = p.node_port {
                write!(s, ", nodePort: {np}").unwrap();
            }
            writeln!(s, "}}").unwrap();
        }
        if let Some(ip) = self.lb_ip {
            writeln!(s, "status:\n  loadBalancer:\n    ingress: [{{ip: '{ip}'}}]").unwrap();
        }
        writeln!(
            s,
            "---\napiVersion: discovery.k8s.io/v1\nkind: EndpointSlice"
        )
        .unwrap();
        writeln!(s, "metadata:\n  name: {}-1\n  namespace: default\n  labels: {{kubernetes.io/service-name: {}}}", self.name, self.name).unwrap();
        writeln!(s, "addressType: {fam}").unwrap();
        if self.endpoints.is_empty() {
            writeln!(s, "endpoints: []").unwrap();
        } else {
            writeln!(s, "endpoints:").unwrap();
            for e in &self.endpoints {
                writeln!(s, "- addresses: ['{}']\n  conditions: {{ready: {}, serving: {}, terminating: false}}\n  nodeName: {}", e.ip, e.ready, e.ready, e.node).unwrap();
            }
        }
        writeln!(s, "ports:").unwrap();
        for p in &self.ports {
            writeln!(
                s,
                "- {{name: {}, protocol: {}, port: {}}}",
                p.name, p.proto, p.target
            )
            .unwrap();
        }
        s
    }
}

/// What a connection attempt got.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    /// The server answered with this pod name.
    Name(String),
    /// Connection refused / port unreachable (quickly rejected).
    Refused,
    /// No answer before the timeout (dropped).
    Timeout,
    /// Anything else.
    Error(String),
}

impl Outcome {
    fn from_err(e: &io::Error) -> Outcome {
        match e.kind() {
            io::ErrorKind::ConnectionRefused => Outcome::Refused,
            io::ErrorKind::TimedOut | io::ErrorKind::WouldBlock => Outcome::Timeout,
            _ => Outcome::Error(e.to_string()),
        }
    }
    /// The pod name, if any.
    pub fn name(&self) -> Option<&str> {
        match self {
            Outcome::Name(n) => Some(n),
            _ => None,
        }
    }
}

/// Connect over TCP from inside `ns` and read the pod name.
pub fn tcp_name(ns: &Netns, to: SocketAddr, timeout: Duration) -> Outcome {
    let r = ns.enter(move || {
        let mut s = TcpStream::connect_timeout(&to, timeout)?;
        s.set_read_timeout(Some(timeout))?;
        let mut line = String::new();
        BufReader::new(&mut s).read_line(&mut line)?;
        Ok(line)
    });
    match r {
        Ok(l) if !l.is_empty() => Outcome::Name(l.trim().to_string()),
        Ok(_) => Outcome::Error("closed without a name".into()),
        Err(e) => Outcome::from_err(&e),
    }
}

/// TCP from `ns` with source address `src`: std cannot bind a TCP client before connecting
/// (and busybox `nc` has no `-s`), so a host route to `to` through `via` with `src` as the
/// preferred source is installed in `ns` for the attempt and removed afterwards.
pub fn tcp_name_from(
    ns: &Netns,
    to: SocketAddr,
    via: IpAddr,
    src: IpAddr,
    timeout: Duration,
) -> Outcome {
    let dst = format!("{}/{}", to.ip(), if to.is_ipv4() { 32 } else { 128 });
    let (via, src) = (via.to_string(), src.to_string());
    must(ns.ip(&["route", "replace", &dst, "via", &via, "src", &src]));
    let o = tcp_name(ns, to, timeout);
    must(ns.ip(&["route", "del", &dst]));
    o
}

/// Send one UDP datagram from inside `ns` (bound to `src` or the wildcard) and read the reply.
pub fn udp_name(ns: &Netns, to: SocketAddr, src: Option<IpAddr>, timeout: Duration) -> Outcome {
    let r = ns.enter(move || {
        let bind: SocketAddr = match (src, to) {
            (Some(ip), _) => SocketAddr::new(ip, 0),
            (None, SocketAddr::V4(_)) => "0.0.0.0:0".parse().unwrap(),
            (None, SocketAddr::V6(_)) => "[::]:0".parse().unwrap(),
        };
        let s = UdpSocket::bind(bind)?;
        s.connect(to)?;
        s.set_read_timeout(Some(timeout))?;
        s.send(b"who")?;
        let mut buf = [0u8; 256];
        let n = s.recv(&mut buf)?;
        Ok(String::from_utf8_lossy(&buf[..n]).to_string())
    });
    match r {
        Ok(l) => Outcome::Name(l.trim().to_string()),
        Err(e) => Outcome::from_err(&e),
    }
}

/// A minimal HTTP GET inside `ns` (Connection: close); the body.
pub fn http_get_in(ns: &Netns, addr: SocketAddr, path: &str) -> io::Result<String> {
    let path = path.to_string();
    ns.enter(move || http_get(addr, &path))
}

/// A minimal HTTP GET in the current namespace; the body.
pub fn http_get(addr: SocketAddr, path: &str) -> io::Result<String> {
    let mut s = TcpStream::connect_timeout(&addr, Duration::from_secs(5))?;
    s.set_read_timeout(Some(Duration::from_secs(30)))?;
    write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n"
    )?;
    let mut raw = String::new();
    s.read_to_string(&mut raw)?;
    Ok(raw
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.to_string())
        .unwrap_or_default())
}

/// The value of `series` (text before the value) in a Prometheus text body; 0 when missing.
pub fn metric_value(body: &str, series: &str) -> f64 {
    body.lines()
        .filter_map(|l| l.strip_prefix(series))
        .filter_map(|rest| rest.strip_prefix(' '))
        .find_map(|v| v.trim().parse().ok())
        .unwrap_or(0.0)
}

/// attempted / succeeded / failed counts of one scenario, printed as they go.
#[derive(Debug, Default)]
pub struct Tally {
    /// Scenario name.
    pub scenario: String,
    /// Checks attempted.
    pub attempted: u32,
    /// Checks that matched the expectation.
    pub succeeded: u32,
    /// Failed checks (descriptions).
    pub failures: Vec<String>,
}

impl Tally {
    /// A new tally.
    pub fn new(scenario: &str) -> Tally {
        Tally {
            scenario: scenario.to_string(),
            ..Tally::default()
        }
    }
    /// Record one check.
    pub fn check(&mut self, what: &str, ok: bool, detail: impl std::fmt::Display) {
        self.attempted += 1;
        if ok {
            self.succeeded += 1;
            println!("  ok    {what}: {detail}");
        } else {
            println!("  FAIL  {what}: {detail}");
            self.failures.push(format!("{what}: {detail}"));
        }
    }
    /// Print the summary line and panic if anything failed.
    pub fn finish(self) {
        println!(
            "{}: {} attempted, {} succeeded, {} failed",
            self.scenario,
            self.attempted,
            self.succeeded,
            self.failures.len()
        );
        assert!(
            self.failures.is_empty(),
            "{}: failures:\n{}",
            self.scenario,
            self.failures.join("\n")
        );
    }
}

/// A pod's name servers (TCP + UDP on `[::]:POD_PORT`); stopped when dropped.
struct Servers {
    stop: Arc<AtomicBool>,
    accepted: Arc<AtomicU32>,
    threads: Vec<JoinHandle<io::Result<()>>>,
}

impl Servers {
    fn start(ns: &Netns, name: &str) -> io::Result<Servers> {
        let (tcp, udp) = ns.enter(|| {
            let t = TcpListener::bind("[::]:8080")?;
            t.set_nonblocking(true)?;
            let u = UdpSocket::bind("[::]:8080")?;
            u.set_read_timeout(Some(Duration::from_millis(200)))?;
            Ok((t, u))
        })?;
        let stop = Arc::new(AtomicBool::new(false));
        let accepted = Arc::new(AtomicU32::new(0));
        let mut threads = Vec::new();
        let (flag, count, n) = (stop.clone(), accepted.clone(), name.to_string());
        threads.push(std::thread::spawn(move || -> io::Result<()> {
            while !flag.load(Ordering::Relaxed) {
                match tcp.accept() {
                    Ok((conn, _)) => {
                        count.fetch_add(1, Ordering::Relaxed);
                        let n = n.clone();
                        std::thread::spawn(move || serve_tcp(conn, &n));
                    }
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                        std::thread::sleep(Duration::from_millis(5));
                    }
                    Err(e) => return Err(e),
                }
            }
            Ok(())
        }));
        let (flag, n) = (stop.clone(), name.to_string());
        threads.push(std::thread::spawn(move || -> io::Result<()> {
            let mut buf = [0u8; 2048];
            while !flag.load(Ordering::Relaxed) {
                match udp.recv_from(&mut buf) {
                    Ok((_, from)) => {
                        udp.send_to(n.as_bytes(), from)?;
                    }
                    Err(e)
                        if e.kind() == io::ErrorKind::WouldBlock
                            || e.kind() == io::ErrorKind::TimedOut => {}
                    Err(e) => return Err(e),
                }
            }
            Ok(())
        }));
        Ok(Servers {
            stop,
            accepted,
            threads,
        })
    }
}

fn serve_tcp(conn: TcpStream, name: &str) -> io::Result<()> {
    conn.set_nonblocking(false)?;
    let mut w = conn.try_clone()?;
    w.write_all(format!("{name}\n").as_bytes())?;
    let mut r = BufReader::new(conn);
    let mut line = String::new();
    loop {
        line.clear();
        if r.read_line(&mut line)? == 0 {
            return w.shutdown(Shutdown::Write);
        }
        w.write_all(line.as_bytes())?;
    }
}

impl Drop for Servers {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

/// A persistent TCP connection that was opened from some namespace; `ping` sends a line and
/// expects it echoed (proves the connection survived, not reset).
pub struct Persistent {
    stream: BufReader<TcpStream>,
    /// The pod that answered.
    pub pod: String,
    /// The client's end of the connection.
    pub local: SocketAddr,
}

impl Persistent {
    /// Open from inside `ns` to `to` and read the pod name.
    pub fn open(ns: &Netns, to: SocketAddr, timeout: Duration) -> io::Result<Persistent> {
        let s = ns.enter(move || TcpStream::connect_timeout(&to, timeout))?;
        Persistent::greeted(s, timeout)
    }

    /// Like [`Persistent::open`], from the client port `port` (bound before connecting).
    pub fn open_from_port(
        ns: &Netns,
        to: SocketAddr,
        port: u16,
        timeout: Duration,
    ) -> io::Result<Persistent> {
        let s = ns.enter(move || {
            use socket2::{Domain, Socket, Type};
            let sock = Socket::new(Domain::for_address(to), Type::STREAM, None)?;
            let any: IpAddr = match to {
                SocketAddr::V4(_) => Ipv4Addr::UNSPECIFIED.into(),
                SocketAddr::V6(_) => Ipv6Addr::UNSPECIFIED.into(),
            };
            sock.bind(&SocketAddr::new(any, port).into())?;
            sock.connect_timeout(&to.into(), timeout)?;
            Ok(TcpStream::from(sock))
        })?;
        Persistent::greeted(s, timeout)
    }

    /// Reads the pod's greeting (its name) on a fresh connection.
    fn greeted(s: TcpStream, timeout: Duration) -> io::Result<Persistent> {
        s.set_read_timeout(Some(timeout))?;
        let local = s.local_addr()?;
        let mut stream = BufReader::new(s);
        let mut pod = String::new();
        stream.read_line(&mut pod)?;
        if pod.is_empty() {
            return Err(io::Error::other("closed before the name"));
        }
        Ok(Persistent {
            stream,
            pod: pod.trim().to_string(),
            local,
        })
    }

    /// Send `msg` and read it back.
    pub fn ping(&mut self, msg: &str) -> io::Result<()> {
        self.stream
            .get_mut()
            .write_all(format!("{msg}\n").as_bytes())?;
        let mut back = String::new();
        self.stream.read_line(&mut back)?;
        if back.trim() == msg {
            Ok(())
        } else {
            Err(io::Error::other(format!("echo mismatch: {back:?}")))
        }
    }
}
