//! Migration from real upstream kube-proxy (IPVS mode) to kube-ipvs on a live node, fed by the
//! real kube-apiserver.
//!
//! The host starts etcd + kube-apiserver and creates a node and two Services (a NodePort web
//! service with two pods, a ClusterIP one with one). One VM boot then runs this test binary's
//! guest half: pods in network namespaces with echo servers, upstream kube-proxy
//! `--proxy-mode ipvs` until it has synced, then clients through the ClusterIPs and the node
//! port, both long-lived connections and a new connection after another, while the node is
//! switched the way an operator does it: kube-proxy stopped with SIGTERM (no `--cleanup`), then
//! the kube-ipvs daemon started with the same flags. Every connection attempt and every round
//! trip on the open connections must succeed, and once kube-ipvs has synced twice the node
//! state (`ipvsadm -Sn`, kube-ipvs0 addresses, ipset members, iptables rules) must equal what
//! kube-proxy had programmed, but for the allowed differences of the differential test
//! (`tests/oracle/allowed-differences.txt`).

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;
mod oracle;

use std::io::{Read, Write};
use std::net::{Ipv4Addr, SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::sh;
use oracle::{allowed, differences, no_classes, parse_dump, DUMP_SH};
use testkit::control_plane::{run_with_timeout, ControlPlane};
use testkit::netns::{EchoServer, Pod};

/// The cluster: node-1 (the VM, 10.0.2.15) and the Services the clients use.
const OBJECTS: &str = r#"apiVersion: v1
kind: Node
metadata:
  name: node-1
  labels: {kubernetes.io/hostname: node-1}
spec:
  podCIDR: 10.244.1.0/24
  podCIDRs: [10.244.1.0/24]
---
apiVersion: v1
kind: Service
metadata: {name: web, namespace: default}
spec:
  type: NodePort
  clusterIP: 10.96.0.20
  ports: [{name: http, port: 80, protocol: TCP, targetPort: 8080, nodePort: 30080}]
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: web-1, namespace: default, labels: {kubernetes.io/service-name: web}}
addressType: IPv4
ports: [{name: http, port: 8080, protocol: TCP}]
endpoints:
- {addresses: [10.244.1.2], conditions: {ready: true}, nodeName: node-1}
- {addresses: [10.244.1.3], conditions: {ready: true}, nodeName: node-1}
---
apiVersion: v1
kind: Service
metadata: {name: db, namespace: default}
spec:
  clusterIP: 10.96.0.30
  sessionAffinity: ClientIP
  ports: [{name: tcp, port: 5432, protocol: TCP, targetPort: 5432}]
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: db-1, namespace: default, labels: {kubernetes.io/service-name: db}}
addressType: IPv4
ports: [{name: tcp, port: 5432, protocol: TCP}]
endpoints:
- {addresses: [10.244.1.4], conditions: {ready: true}, nodeName: node-1}
"#;

const NODE_STATUS: &str = "apiVersion: v1\nkind: Node\nmetadata: {name: node-1}\nstatus:\n  \
    addresses: [{type: InternalIP, address: 10.0.2.15}, {type: Hostname, address: node-1}]\n";

/// What the clients connect to: ClusterIPs and the node port on the node's address.
const TARGETS: [&str; 3] = ["10.96.0.20:80", "10.0.2.15:30080", "10.96.0.30:5432"];

/// Environment of the guest half: the kubeconfig (set by the host half).
const KUBECONFIG_ENV: &str = "KUBE_IPVS_MIGRATION_KUBECONFIG";

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// The host half: control plane, objects, one VM boot running the guest half.
#[test]
#[ignore = "kube"]
fn kube_migration_from_upstream_kube_proxy_drops_no_connection_and_converges() {
    let bin = testkit::control_plane::require_upstream();
    let cp = ControlPlane::start().unwrap();
    cp.kubectl_stdin(&["create", "-f", "-"], OBJECTS).unwrap();
    cp.kubectl_stdin(
        &[
            "apply",
            "--server-side",
            "--subresource=status",
            "--field-manager=test",
            "-f",
            "-",
        ],
        NODE_STATUS,
    )
    .unwrap();
    let dir = cp.dir().join("migration");
    std::fs::create_dir_all(&dir).unwrap();
    let admin = std::fs::read_to_string(cp.admin_kubeconfig()).unwrap();
    let kc = dir.join("guest.kubeconfig");
    std::fs::write(
        &kc,
        admin.replace(&cp.server_url(), &format!("https://10.0.2.100:{}", cp.port)),
    )
    .unwrap();
    let me = std::env::current_exe().unwrap();
    let manifest = env!("CARGO_MANIFEST_DIR");
    let allowed_file = PathBuf::from(manifest).join("tests/oracle/allowed-differences.txt");
    let script = dir.join("guest.sh");
    std::fs::write(
        &script,
        format!(
            "cd {manifest}\n{KUBECONFIG_ENV}={kc} RUST_BACKTRACE=1 {me} --ignored --exact \
             --nocapture --test-threads=1 guest_half_migration_from_kube_proxy\n",
            kc = kc.display(),
            me = me.display()
        ),
    )
    .unwrap();
    let files = [
        (cp.ca_file(), cp.ca_file().display().to_string()),
        (kc.clone(), kc.display().to_string()),
        (me.clone(), me.display().to_string()),
        (allowed_file.clone(), allowed_file.display().to_string()),
        (bin.join("kube-proxy"), "/k/kube-proxy".to_string()),
        (
            PathBuf::from(env!("CARGO_BIN_EXE_kube-ipvs")),
            "/k/kube-ipvs".to_string(),
        ),
        (script.clone(), script.display().to_string()),
    ];
    let mut cmd = Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()));
    cmd.current_dir(repo())
        .args([
            "xtask",
            "vm",
            "--mem",
            "2G",
            "--timeout",
            "1500",
            "--net-fwd",
        ])
        .arg(cp.port.to_string());
    for (src, dest) in &files {
        cmd.arg("--file").arg(format!("{}:{dest}", src.display()));
    }
    cmd.args(["--", "sh"]).arg(&script);
    let out = run_with_timeout(&mut cmd, None, Duration::from_secs(1800)).unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    println!("{stdout}");
    assert!(
        out.status.success() && stdout.contains("test result: ok. 1 passed"),
        "guest half failed: {}\n{stdout}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// The node state in the differential test's dump format.
fn dump(phase: &str) -> String {
    sh(&format!("{DUMP_SH}dump {phase}"))
}

/// One plain HTTP GET on loopback; the body, or None.
fn http_get(port: u16, path: &str) -> Option<String> {
    let mut s = TcpStream::connect_timeout(
        &SocketAddr::from(([127, 0, 0, 1], port)),
        Duration::from_secs(5),
    )
    .ok()?;
    s.set_read_timeout(Some(Duration::from_secs(10))).ok()?;
    write!(
        s,
        "GET {path} HTTP/1.0\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n"
    )
    .ok()?;
    let mut body = String::new();
    s.read_to_string(&mut body).ok()?;
    Some(body)
}

/// kube-proxy's sync counter (its IPv4 and IPv6 proxiers both move it), from its /metrics.
fn kube_proxy_syncs() -> Option<u64> {
    let text = http_get(10249, "/metrics")?;
    let counts: Vec<u64> = text
        .lines()
        .filter(|l| l.starts_with("kubeproxy_sync_proxy_rules_duration_seconds_count"))
        .filter_map(|l| l.split_whitespace().last()?.parse::<f64>().ok())
        .map(|v| v as u64)
        .collect();
    (!counts.is_empty()).then(|| counts.iter().sum())
}

/// The node state as sorted lines (to see whether a sync changed it).
fn state() -> Vec<String> {
    let mut v: Vec<String> = dump("x")
        .lines()
        .filter(|l| !l.starts_with("@@phase"))
        .map(str::to_string)
        .collect();
    v.sort();
    v
}

fn flags(kc: &str) -> Vec<String> {
    [
        "--kubeconfig",
        kc,
        "--proxy-mode",
        "ipvs",
        "--hostname-override",
        "node-1",
        "--cluster-cidr",
        "10.244.0.0/16",
        "--conntrack-max-per-core",
        "0",
        "--ipvs-sync-period",
        "10s",
    ]
    .map(String::from)
    .to_vec()
}

fn spawn(program: &str, args: &[String], log: &Path) -> Child {
    let f = std::fs::File::create(log).unwrap();
    Command::new(program)
        .args(args)
        .env_remove("RUST_LOG")
        .stdin(Stdio::null())
        .stdout(f.try_clone().unwrap())
        .stderr(f)
        .spawn()
        .unwrap_or_else(|e| panic!("starting {program}: {e}"))
}

fn tail(log: &Path) -> String {
    let t = std::fs::read_to_string(log).unwrap_or_default();
    let lines: Vec<&str> = t.lines().collect();
    lines[lines.len().saturating_sub(40)..].join("\n")
}

/// Waits (bounded) until `done` holds, checking `child` is alive; panics with the log tail.
fn wait_for(what: &str, child: &mut Child, log: &Path, mut done: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(900);
    while !done() {
        if let Ok(Some(st)) = child.try_wait() {
            panic!("{what}: the proxy exited ({st}):\n{}", tail(log));
        }
        assert!(
            Instant::now() < deadline,
            "{what}: not within 900 s:\n{}",
            tail(log)
        );
        std::thread::sleep(Duration::from_millis(500));
    }
}

/// Counters shared by the client threads.
#[derive(Default)]
struct Tally {
    attempts: AtomicU64,
    failures: AtomicU64,
}

/// One echo round trip on `s`; true when the bytes came back.
fn roundtrip(s: &mut TcpStream, n: u64) -> bool {
    let msg = format!("ping {n}\n");
    if s.write_all(msg.as_bytes()).is_err() {
        return false;
    }
    let mut back = vec![0u8; msg.len()];
    s.read_exact(&mut back).is_ok() && back == msg.as_bytes()
}

fn connect(to: SocketAddr) -> std::io::Result<TcpStream> {
    let s = TcpStream::connect_timeout(&to, Duration::from_secs(10))?;
    // Guards against a hang only.
    s.set_read_timeout(Some(Duration::from_secs(20)))?;
    Ok(s)
}

/// Clients until `stop`: per target one long-lived connection (a round trip each time round)
/// and a new connection each time round; every failure is counted and printed.
fn clients(stop: Arc<AtomicBool>, tally: Arc<Tally>) -> Vec<std::thread::JoinHandle<()>> {
    TARGETS
        .iter()
        .map(|t| {
            let to: SocketAddr = t.parse().unwrap();
            let (stop, tally) = (stop.clone(), tally.clone());
            std::thread::spawn(move || {
                let mut long = connect(to).unwrap_or_else(|e| panic!("connect {to}: {e}"));
                let mut n = 0u64;
                while !stop.load(Ordering::Relaxed) {
                    n += 1;
                    tally.attempts.fetch_add(2, Ordering::Relaxed);
                    if !roundtrip(&mut long, n) {
                        tally.failures.fetch_add(1, Ordering::Relaxed);
                        eprintln!("long-lived connection to {to}: round trip {n} failed");
                    }
                    let fresh = connect(to).map(|mut s| roundtrip(&mut s, n));
                    if !matches!(fresh, Ok(true)) {
                        tally.failures.fetch_add(1, Ordering::Relaxed);
                        eprintln!("new connection {n} to {to} failed: {fresh:?}");
                    }
                    std::thread::sleep(Duration::from_millis(50));
                }
            })
        })
        .collect()
}

/// Waits until the clients made `n` more attempts (so traffic ran through a phase).
fn let_traffic_run(tally: &Tally, n: u64) {
    let start = tally.attempts.load(Ordering::Relaxed);
    let deadline = Instant::now() + Duration::from_secs(600);
    while tally.attempts.load(Ordering::Relaxed) < start + n {
        assert!(Instant::now() < deadline, "the clients stalled");
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// Counts `sync done` lines of the IPv4 family with kind Full in kube-ipvs's log.
fn kube_ipvs_full_syncs(log: &Path) -> usize {
    std::fs::read_to_string(log)
        .unwrap_or_default()
        .lines()
        .filter(|l| l.contains("sync done") && l.contains("Inet") && l.contains("Full"))
        .count()
}

/// The guest half (run inside the VM by the host half; needs its kubeconfig).
#[test]
#[ignore = "guest half of kube_migration_from_upstream_kube_proxy_drops_no_connection_and_converges"]
fn guest_half_migration_from_kube_proxy() {
    let kc = std::env::var(KUBECONFIG_ENV).expect("runs inside the VM of the kube_ test");
    let mut pods = Vec::new();
    let mut servers = Vec::new();
    for (ip, port) in [
        ([10, 244, 1, 2], 8080),
        ([10, 244, 1, 3], 8080),
        ([10, 244, 1, 4], 5432),
    ] {
        let pod = Pod::new(None, Ipv4Addr::from(ip)).unwrap();
        servers.push(EchoServer::start(&pod.ns, SocketAddr::from((pod.ip, port))).unwrap());
        pods.push(pod);
    }
    let flags = flags(&kc);

    // 1. Upstream kube-proxy programs the node.
    let kp_log = PathBuf::from("/tmp/kube-proxy.log");
    let mut kp = spawn("/k/kube-proxy", &flags, &kp_log);
    // Both families synced: the counter moved twice in a row without changing the node (its
    // IPv6 proxier's first sync can outlast IPv4 syncs).
    let (mut last, mut prev, mut unchanged) = (0, Vec::new(), 0);
    wait_for("kube-proxy's syncs", &mut kp, &kp_log, || {
        let Some(c) = kube_proxy_syncs().filter(|c| *c > last) else {
            return false;
        };
        last = c;
        let now = state();
        unchanged = if now == prev { unchanged + 1 } else { 0 };
        prev = now;
        unchanged >= 2 && sh("ipvsadm -Sn").contains("10.0.2.15:30080")
    });
    let t0 = Instant::now();

    // 2. Traffic through it.
    let (stop, tally) = (Arc::new(AtomicBool::new(false)), Arc::new(Tally::default()));
    let threads = clients(stop.clone(), tally.clone());
    let_traffic_run(&tally, 30);
    let upstream = dump("kube-proxy");
    let before = tally.attempts.load(Ordering::Relaxed);

    // 3. The switch: kube-proxy stops without cleanup, kube-ipvs starts with the same flags.
    sh(&format!("kill -TERM {}", kp.id()));
    let st = kp.wait().unwrap();
    println!(
        "kube-proxy stopped ({st}) after {:.1} s of traffic",
        t0.elapsed().as_secs_f64()
    );
    let_traffic_run(&tally, 6);
    let ki_log = PathBuf::from("/tmp/kube-ipvs.log");
    let mut ki = spawn("/k/kube-ipvs", &flags, &ki_log);
    wait_for("kube-ipvs's two full syncs", &mut ki, &ki_log, || {
        kube_ipvs_full_syncs(&ki_log) >= 2
    });
    let_traffic_run(&tally, 30);
    stop.store(true, Ordering::Relaxed);
    for t in threads {
        t.join().unwrap();
    }
    let ours = dump("kube-ipvs");
    sh(&format!("kill -TERM {}", ki.id()));
    let st = ki.wait().unwrap();
    let (attempts, failures) = (
        tally.attempts.load(Ordering::Relaxed),
        tally.failures.load(Ordering::Relaxed),
    );
    println!(
        "kube-ipvs stopped ({st}); {attempts} connection attempts and round trips ({} after the \
         switch began), {failures} failed; kube-ipvs log:\n{}",
        attempts - before,
        tail(&ki_log)
    );
    assert!(st.success(), "kube-ipvs exited with {st}");
    assert_eq!(failures, 0, "connections failed during the switch");
    // kube-ipvs adopted upstream's IPv4 state as it was: no IPVS or address write at all.
    let log = std::fs::read_to_string(&ki_log).unwrap();
    let v4: Vec<&str> = log
        .lines()
        .filter(|l| l.contains("sync done") && l.contains("family=Inet "))
        .collect();
    assert!(!v4.is_empty(), "{log}");
    for l in &v4 {
        assert!(
            l.contains(" ipvs_ops=0 ") && l.contains(" address_ops=0 ") && l.contains(" errors=0 "),
            "kube-ipvs rewrote upstream's state: {l}"
        );
    }

    // 4. The table converged to what upstream had, modulo the allowed differences.
    let up = parse_dump(&upstream);
    let after = parse_dump(&ours);
    let (diffs, used) = differences(
        &up["kube-proxy"],
        &after["kube-ipvs"],
        &allowed(),
        &no_classes,
    );
    println!(
        "state after the switch: {} differences, {} allowed-difference rules used\n{upstream}",
        diffs.len(),
        used.len()
    );
    assert!(
        !up["kube-proxy"]["ipvs"].is_empty(),
        "kube-proxy programmed nothing"
    );
    assert!(
        diffs.is_empty(),
        "state after the switch differs from kube-proxy's:\n{diffs:#?}\nkube-ipvs:\n{ours}"
    );
    drop(servers);
    drop(pods);
}
