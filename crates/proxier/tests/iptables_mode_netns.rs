//! iptables proxy mode against the real kernel, in network namespaces (root, natively on the
//! host: this kernel has iptables but no IPVS). A "node" namespace routes between "pods" (each a
//! namespace with a server answering its own name) and a "client" namespace standing for
//! external traffic; the proxier applies into the node namespace with `ip netns exec`.
//!
//! Data path: ClusterIP, NodePort on the node address, externalIP, LoadBalancer IP with
//! `loadBalancerSourceRanges` (allowed source passes, another is dropped), spread over three
//! endpoints, ClientIP affinity, ETP=Local without local endpoints dropped, endpoint removal
//! within one sync. Cross-check: what `iptables-save` reads back equals what was rendered. Mode
//! handover: IPVS-mode chains and ipsets removed, then iptables-mode chains removed.
//!
//! Benchmark (not a test, run by hand): `cargo test -p controller --test iptables_mode_netns
//! -- --ignored bench_ --nocapture`.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod fixtures;

use std::collections::{BTreeMap, BTreeSet};
use std::io::{Read, Write};
use std::net::{IpAddr, Ipv4Addr, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use fixtures::*;
use iptables::{Iptables, Runner, Table};
use k8s_openapi::api::discovery::v1::EndpointSlice;
use model::event::{Object, SourceEvent};
use model::store::Store;
use proxier::iptables_mode::{cleanup_iptables_mode, cleanup_ipvs_mode_leftovers, IptablesProxier};
use proxier::ipvs_mode::{RulesConfig, SyncKind};
use proxier::sync_loop::Backend;
use testkit::netns::{veth_pair, Netns, Pod};

const NODE_IP: &str = "192.168.50.1";
const CLIENT_IP: Ipv4Addr = Ipv4Addr::new(192, 168, 50, 2);
const OTHER_CLIENT_IP: Ipv4Addr = Ipv4Addr::new(192, 168, 50, 3);

/// A TCP server in a namespace that writes `name` to every connection and closes it.
struct NameServer {
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl NameServer {
    fn start(ns: &Netns, port: u16, name: &str) -> NameServer {
        let l = ns
            .enter(move || {
                let l = TcpListener::bind(("0.0.0.0", port))?;
                l.set_nonblocking(true)?;
                Ok(l)
            })
            .unwrap();
        let stop = Arc::new(AtomicBool::new(false));
        let flag = stop.clone();
        let name = name.to_string();
        let thread = std::thread::spawn(move || {
            while !flag.load(Ordering::Relaxed) {
                match l.accept() {
                    Ok((mut c, _)) => {
                        let _ = c.set_nonblocking(false);
                        let _ = c.write_all(name.as_bytes());
                    }
                    Err(_) => std::thread::sleep(Duration::from_millis(2)),
                }
            }
        });
        NameServer {
            stop,
            thread: Some(thread),
        }
    }
}

impl Drop for NameServer {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// Outcome of `n` connections: answers by server name, and failures.
#[derive(Debug, Default)]
struct Tally {
    attempted: usize,
    by_name: BTreeMap<String, usize>,
    failed: usize,
}

impl Tally {
    fn ok(&self) -> usize {
        self.by_name.values().sum()
    }
}

/// `n` connections from `ns` (source: its default address) to `to`, each reading the
/// server's name.
fn connect_n(ns: &Netns, to: SocketAddr, n: usize, timeout: Duration) -> Tally {
    let t = ns
        .enter(move || {
            let mut t = Tally::default();
            for _ in 0..n {
                t.attempted += 1;
                let r = (|| -> std::io::Result<String> {
                    let mut s = TcpStream::connect_timeout(&to, timeout)?;
                    s.set_read_timeout(Some(Duration::from_secs(5)))?;
                    let mut out = String::new();
                    s.read_to_string(&mut out)?;
                    Ok(out)
                })();
                match r {
                    Ok(name) if !name.is_empty() => *t.by_name.entry(name).or_default() += 1,
                    _ => t.failed += 1,
                }
            }
            Ok(t)
        })
        .unwrap();
    println!(
        "{to}: attempted {} succeeded {} failed {} {:?}",
        t.attempted,
        t.ok(),
        t.failed,
        t.by_name
    );
    t
}

/// `n` connections from the client's second address (`src`): a source route for `to` picks
/// it, and bash's `/dev/tcp` reads the answer (std cannot bind before connecting).
fn connect_from(ns: &Netns, src: Ipv4Addr, to: SocketAddr, n: usize) -> Tally {
    // Make `src` the preferred source for `to` only for this call.
    let dst = format!("{}/32", to.ip());
    ns.ip(&[
        "route",
        "replace",
        &dst,
        "via",
        NODE_IP,
        "src",
        &src.to_string(),
    ])
    .unwrap();
    let mut t = Tally::default();
    for _ in 0..n {
        t.attempted += 1;
        let out = ns
            .command("timeout")
            .args([
                "2",
                "bash",
                "-c",
                &format!("exec 3<>/dev/tcp/{}/{}; cat <&3", to.ip(), to.port()),
            ])
            .output()
            .unwrap();
        let name = String::from_utf8_lossy(&out.stdout).to_string();
        if out.status.success() && !name.is_empty() {
            *t.by_name.entry(name).or_default() += 1;
        } else {
            t.failed += 1;
        }
    }
    ns.ip(&["route", "del", &dst]).unwrap();
    println!(
        "{to} from {src}: attempted {} succeeded {} failed {} {:?}",
        t.attempted,
        t.ok(),
        t.failed,
        t.by_name
    );
    t
}

struct Lab {
    node: Netns,
    client: Netns,
    _uplink: Netns,
    pods: Vec<Pod>,
    _servers: Vec<NameServer>,
}

fn lab(n_pods: usize) -> Lab {
    let node = Netns::new(&format!("ctl-iptm-node-{}", std::process::id())).unwrap();
    let uplink = Pod::uplink(&node).unwrap();
    let client = Netns::new(&format!("ctl-iptm-client-{}", std::process::id())).unwrap();
    veth_pair(&node, "cli0", &client, "eth0").unwrap();
    node.ip(&["addr", "add", &format!("{NODE_IP}/24"), "dev", "cli0"])
        .unwrap();
    client
        .ip(&["addr", "add", &format!("{CLIENT_IP}/24"), "dev", "eth0"])
        .unwrap();
    client
        .ip(&[
            "addr",
            "add",
            &format!("{OTHER_CLIENT_IP}/24"),
            "dev",
            "eth0",
        ])
        .unwrap();
    client
        .ip(&[
            "route",
            "add",
            "default",
            "via",
            NODE_IP,
            "src",
            &CLIENT_IP.to_string(),
        ])
        .unwrap();
    node.sysctl("net.ipv4.ip_forward", "1").unwrap();
    let mut pods = Vec::new();
    let mut servers = Vec::new();
    for i in 0..n_pods {
        let ip = Ipv4Addr::new(10, 244, 1, i as u8 + 1);
        let pod = Pod::new(Some(&node), ip).unwrap();
        servers.push(NameServer::start(&pod.ns, 8080, &format!("pod{}", i + 1)));
        pods.push(pod);
    }
    Lab {
        node,
        client,
        _uplink: uplink,
        pods,
        _servers: servers,
    }
}

fn slice_of(svc: &str, pods: &[usize], node: &str) -> EndpointSlice {
    let mut s = slice("default", svc, &format!("{svc}-1")).port("http", 8080, "TCP");
    for i in pods {
        s = s.ep(&format!("10.244.1.{}", i + 1), node, C::Ready);
    }
    s.build()
}

fn node_addrs() -> BTreeSet<IpAddr> {
    [ip(NODE_IP), ip("192.168.255.1")].into_iter().collect()
}

fn sock(s: &str, port: u16) -> SocketAddr {
    SocketAddr::new(ip(s), port)
}

/// `-A` lines of the chains the mode owns, per chain in order, normalised: quotes dropped and
/// `--probability X` turned into the kernel's fixed-point value (iptables-save prints it with
/// eleven decimals, we write ten like upstream).
fn owned_rules(text: &str) -> BTreeMap<(String, String), Vec<String>> {
    let mut out: BTreeMap<(String, String), Vec<String>> = BTreeMap::new();
    let mut table = String::new();
    for l in text.lines() {
        if let Some(t) = l.strip_prefix('*') {
            table = t.to_string();
            continue;
        }
        let Some(rest) = l.strip_prefix("-A ") else {
            continue;
        };
        let chain = rest
            .split_whitespace()
            .next()
            .unwrap_or_default()
            .to_string();
        let t = if table == "nat" {
            Table::Nat
        } else {
            Table::Filter
        };
        if !iptables::proxy_mode::owns_chain(t, &chain) {
            continue;
        }
        let mut words: Vec<String> = l.replace('"', "").split(' ').map(str::to_string).collect();
        for i in 1..words.len() {
            if words[i - 1] == "--probability" {
                let p: f64 = words[i].parse().unwrap();
                words[i] = format!("fixed:{}", (p * 2147483648.0).round() as u64);
            }
        }
        out.entry((table.clone(), chain))
            .or_default()
            .push(words.join(" "));
    }
    out
}

#[test]
#[ignore = "netns"]
fn netns_iptables_mode_data_path() {
    let lab = lab(4);
    let web = svc("default", "web", "10.96.0.10")
        .node_port("http", 80, "TCP", 30080)
        .external_ips(&["203.0.113.10"])
        .lb_ingress(&["198.51.100.10"])
        .source_ranges(&[&format!("{CLIENT_IP}/32")])
        .build();
    let sticky = svc("default", "sticky", "10.96.0.11")
        .port("http", 80, "TCP")
        .affinity(Some(600))
        .build();
    let local = svc("default", "local", "10.96.0.12")
        .node_port("http", 80, "TCP", 30081)
        .etp_local()
        .build();
    let mut store = synced_store(
        vec![web, sticky, local],
        vec![
            slice_of("web", &[0, 1, 2], "node-b"),
            slice_of("sticky", &[0, 1, 2], "node-b"),
            slice_of("local", &[3], "node-b"),
        ],
    );
    let ipt = Iptables::detect(iptables::Family::Inet, Runner::in_netns(lab.node.name())).unwrap();
    println!("backend {:?}", ipt.backend());
    let mut p = IptablesProxier::new(cfg4(), RulesConfig::default(), NODE, Box::new(ipt));
    let r = p.sync(&store, &node_addrs());
    assert!(r.ok(), "{:?}", r.errors);
    assert_eq!(r.kind, SyncKind::Full);
    assert!(r.iptables_restored);

    // What the kernel holds is what we rendered.
    let rendered = p.render_full(&store, &node_addrs()).unwrap();
    let saved = lab.node.run(&["iptables-save"]).unwrap();
    assert_eq!(owned_rules(&saved), owned_rules(&rendered));
    let jumps = saved
        .lines()
        .filter(|l| l.starts_with("-A PREROUTING") && l.contains("-j KUBE-SERVICES"))
        .count();
    assert_eq!(jumps, 1);

    // ClusterIP spreads over three endpoints.
    let t = connect_n(
        &lab.client,
        sock("10.96.0.10", 80),
        300,
        Duration::from_secs(3),
    );
    assert_eq!(t.failed, 0);
    assert_eq!(t.by_name.len(), 3, "{:?}", t.by_name);
    for (name, n) in &t.by_name {
        assert!(*n >= 45, "{name} got {n} of 300 (< 15%)");
    }
    // NodePort on the node address, externalIP, LB IP from the allowed source.
    for to in [
        sock(NODE_IP, 30080),
        sock("203.0.113.10", 80),
        sock("198.51.100.10", 80),
    ] {
        let t = connect_n(&lab.client, to, 12, Duration::from_secs(3));
        assert_eq!((t.ok(), t.failed), (12, 0), "{to}");
        assert!(t
            .by_name
            .keys()
            .all(|n| ["pod1", "pod2", "pod3"].contains(&n.as_str())));
    }
    // LB IP from a source outside loadBalancerSourceRanges: dropped. The same source still
    // reaches the NodePort (no source ranges there), so the drop is the firewall's.
    let denied = connect_from(&lab.client, OTHER_CLIENT_IP, sock("198.51.100.10", 80), 3);
    assert_eq!((denied.ok(), denied.failed), (0, 3));
    let np = connect_from(&lab.client, OTHER_CLIENT_IP, sock(NODE_IP, 30080), 3);
    assert_eq!((np.ok(), np.failed), (3, 0));

    // ClientIP affinity: one client stays on one endpoint.
    let t = connect_n(
        &lab.client,
        sock("10.96.0.11", 80),
        30,
        Duration::from_secs(3),
    );
    assert_eq!((t.ok(), t.failed), (30, 0));
    assert_eq!(t.by_name.len(), 1, "{:?}", t.by_name);

    // ETP=Local without a local endpoint: external traffic dropped, cluster traffic served.
    let t = connect_n(&lab.client, sock(NODE_IP, 30081), 3, Duration::from_secs(1));
    assert_eq!((t.ok(), t.failed), (0, 3));
    let t = connect_n(
        &lab.client,
        sock("10.96.0.12", 80),
        3,
        Duration::from_secs(3),
    );
    assert_eq!(t.by_name.get("pod4"), Some(&3));

    // Endpoint removal is reflected within one (partial) sync.
    let ch = store.apply(SourceEvent::Apply(Object::from(slice_of(
        "web",
        &[0, 1],
        "node-b",
    ))));
    p.note(&ch);
    let before = p.processes();
    let r = p.sync(&store, &node_addrs());
    assert!(r.ok(), "{:?}", r.errors);
    assert_eq!(r.kind, SyncKind::Incremental);
    assert_eq!(p.processes() - before, 1, "one iptables-restore");
    let t = connect_n(
        &lab.client,
        sock("10.96.0.10", 80),
        60,
        Duration::from_secs(3),
    );
    assert_eq!(t.failed, 0);
    assert!(!t.by_name.contains_key("pod3"), "{:?}", t.by_name);
    assert_eq!(t.by_name.len(), 2);

    // All endpoints gone: REJECT (fails fast, not a timeout).
    let ch = store.apply(SourceEvent::Apply(Object::from(slice_of(
        "web",
        &[],
        "node-b",
    ))));
    p.note(&ch);
    assert!(p.sync(&store, &node_addrs()).ok());
    let start = Instant::now();
    let t = connect_n(
        &lab.client,
        sock("10.96.0.10", 80),
        1,
        Duration::from_secs(5),
    );
    assert_eq!(t.failed, 1);
    let rejected_fast = start.elapsed() < Duration::from_secs(4);
    println!("rejected without waiting for the timeout: {rejected_fast}");

    // The kernel still matches the rendering after partial syncs; a full resync changes nothing.
    let rendered = p.render_full(&store, &node_addrs()).unwrap();
    let saved = lab.node.run(&["iptables-save"]).unwrap();
    assert_eq!(owned_rules(&saved), owned_rules(&rendered));
    p.request_full();
    let r = p.sync(&store, &node_addrs());
    assert!(r.ok() && r.drift.is_empty(), "{:?}", r);
    drop(lab.pods);
}

#[test]
#[ignore = "netns"]
fn netns_iptables_mode_handover_from_and_to_ipvs_mode() {
    let node = Netns::new(&format!("ctl-iptm-ho-{}", std::process::id())).unwrap();
    let fam = iptables::Family::Inet;
    // IPVS-mode leftovers: every KUBE-* set and the IPVS-mode rules referencing them.
    let ipset = ipset::Ipset::new(ipset::Runner::in_netns(node.name()));
    let want = ipset::IpsetState::kube(fam);
    ipset
        .apply(&ipset::diff(&want, &ipset::IpsetState::new()))
        .unwrap();
    let mut input = iptables::IpvsModeInput::new(fam);
    input.non_empty_sets = ipset::SetKind::ALL.into_iter().collect();
    let ipvs_rules = iptables::render_ipvs_mode(&input).unwrap();
    let mut ipt = Iptables::detect(fam, Runner::in_netns(node.name())).unwrap();
    ipt.apply(&ipvs_rules).unwrap();
    let sets_before = node.run(&["ipset", "list", "-n"]).unwrap();
    assert!(sets_before.lines().count() >= 17, "{sets_before}");

    let report = cleanup_ipvs_mode_leftovers(&cfg4(), &mut ipt, &ipset, None, None).unwrap();
    println!("{report:?}");
    assert!(report.chains.iter().any(|c| c == "filter KUBE-IPVS-FILTER"));
    assert_eq!(report.ipsets.len(), sets_before.lines().count());
    let sets_after = node.run(&["ipset", "list", "-n"]).unwrap();
    assert!(sets_after.trim().is_empty(), "{sets_after}");
    let saved = node.run(&["iptables-save"]).unwrap();
    for gone in [
        "KUBE-IPVS-FILTER",
        "KUBE-NODE-PORT ",
        "KUBE-LOAD-BALANCER",
        "match-set",
    ] {
        assert!(!saved.contains(gone), "{gone} left:\n{saved}");
    }
    assert!(
        cleanup_ipvs_mode_leftovers(&cfg4(), &mut ipt, &ipset, None, None)
            .unwrap()
            .is_empty()
    );

    // iptables mode runs, then hands over back to IPVS mode.
    let store = synced_store(
        vec![svc("default", "web", "10.96.0.10")
            .node_port("http", 80, "TCP", 30080)
            .build()],
        vec![slice_of("web", &[0, 1], "node-b")],
    );
    let ipt2 = Iptables::detect(fam, Runner::in_netns(node.name())).unwrap();
    let mut p = IptablesProxier::new(cfg4(), RulesConfig::default(), NODE, Box::new(ipt2));
    assert!(p.sync(&store, &node_addrs()).ok());
    let saved = node.run(&["iptables-save"]).unwrap();
    assert!(saved.contains(":KUBE-SVC-") && saved.contains(":KUBE-EXT-"));
    let report = cleanup_iptables_mode(&mut ipt, true).unwrap();
    println!("{report:?}");
    let saved = node.run(&["iptables-save"]).unwrap();
    for gone in [
        "KUBE-SVC-",
        "KUBE-SEP-",
        "KUBE-EXT-",
        "KUBE-NODEPORTS",
        "KUBE-EXTERNAL-SERVICES",
    ] {
        assert!(!saved.contains(gone), "{gone} left:\n{saved}");
    }
    assert!(
        saved.contains(":KUBE-POSTROUTING"),
        "shared chains stay for IPVS mode"
    );
    assert!(cleanup_iptables_mode(&mut ipt, true).unwrap().is_empty());
    // And `--cleanup` removes the rest.
    cleanup_iptables_mode(&mut ipt, false).unwrap();
    let saved = node.run(&["iptables-save"]).unwrap();
    assert!(
        !saved.contains("KUBE-SERVICES") && !saved.contains("KUBE-MARK-MASQ"),
        "{saved}"
    );
}

fn bench_store(n: usize) -> Store {
    let mut svcs = Vec::with_capacity(n);
    let mut slices = Vec::with_capacity(n);
    for i in 0..n {
        let name = format!("svc-{i}");
        svcs.push(
            svc(
                "default",
                &name,
                &format!("10.96.{}.{}", i / 250, i % 250 + 1),
            )
            .port("http", 80, "TCP")
            .build(),
        );
        slices.push(bench_slice(i, 0));
    }
    synced_store(svcs, slices)
}

fn bench_slice(i: usize, shift: usize) -> EndpointSlice {
    let name = format!("svc-{i}");
    let mut s = slice("default", &name, &format!("{name}-1")).port("http", 8080, "TCP");
    for e in 0..10 {
        let k = i * 10 + e + shift;
        s = s.ep(
            &format!("10.{}.{}.{}", 128 + k / 62500, (k / 250) % 250, k % 250 + 1),
            "node-b",
            C::Ready,
        );
    }
    s.build()
}

#[test]
#[ignore = "bench"]
fn bench_iptables_mode_sync() {
    for n in [1000, 5000] {
        let node = Netns::new(&format!("ctl-iptm-bench-{}", std::process::id())).unwrap();
        let mut store = bench_store(n);
        // `IPTM_BACKEND=legacy` measures iptables-legacy instead of the detected backend.
        let runner = Runner::in_netns(node.name());
        let ipt = match std::env::var("IPTM_BACKEND").as_deref() {
            Ok("legacy") => {
                Iptables::new(iptables::Backend::Legacy, iptables::Family::Inet, runner)
            }
            _ => Iptables::detect(iptables::Family::Inet, runner).unwrap(),
        };
        let backend = ipt.backend();
        let mut p = IptablesProxier::new(cfg4(), RulesConfig::default(), NODE, Box::new(ipt));
        let t = Instant::now();
        let r = p.sync(&store, &node_addrs());
        let first = t.elapsed();
        assert!(r.ok(), "{:?}", r.errors);
        let (_, _, bytes) = p.last_restore();
        // One endpoint change.
        let mut changes = Vec::new();
        for round in 0..5 {
            let ch = store.apply(SourceEvent::Apply(Object::from(bench_slice(
                round * 7 + 1,
                1 + round,
            ))));
            p.note(&ch);
            let t = Instant::now();
            let r = p.sync(&store, &node_addrs());
            changes.push(t.elapsed());
            assert!(r.ok() && r.kind == SyncKind::Incremental);
        }
        let (w, d, pbytes) = p.last_restore();
        p.request_full();
        let t = Instant::now();
        let r = p.sync(&store, &node_addrs());
        let resync = t.elapsed();
        assert!(r.ok());
        let save = match backend {
            iptables::Backend::Legacy => "iptables-legacy-save",
            iptables::Backend::Nft => "iptables-nft-save",
        };
        let saved = node.run(&[save, "-t", "nat"]).unwrap();
        let sep = saved
            .lines()
            .filter(|l| l.starts_with(":KUBE-SEP-"))
            .count();
        assert_eq!(sep, n * 10);
        changes.sort();
        println!(
            "iptables mode ({backend:?}), {n} services x 10 endpoints: first full sync {first:?} ({bytes} bytes), \
             one-endpoint change median {:?} (min {:?}, max {:?}; {w} chains written, {d} deleted, {pbytes} bytes), \
             periodic full sync {resync:?}",
            changes[changes.len() / 2],
            changes[0],
            changes[changes.len() - 1]
        );
    }
}

/// Issue #16: the other mode's leftovers are removed only after the running mode's first
/// successful sync (kube-ipvs's `handover` module). This proves that order works on a real
/// kernel: the iptables-mode sync succeeds with every IPVS-mode rule and set still in place,
/// and the IPVS-mode cleanup that follows leaves the iptables-mode rules exactly as synced (a
/// full sync afterwards finds no drift); the other way round, IPVS-mode rules written over
/// iptables-mode chains survive the iptables-mode cleanup unchanged.
#[test]
#[ignore = "netns"]
fn netns_handover_cleanup_after_the_new_mode_leaves_its_rules_intact() {
    let node = Netns::new(&format!("ctl-iptm-ho2-{}", std::process::id())).unwrap();
    let fam = iptables::Family::Inet;
    let ipset = ipset::Ipset::new(ipset::Runner::in_netns(node.name()));
    // What an IPVS-mode sync writes (a fresh applier each time, so nothing is skipped as
    // already applied).
    let ipvs_mode = || {
        let want = ipset::IpsetState::kube(fam);
        let have = ipset.read(&ipset::SetKind::all_names(fam)).unwrap();
        ipset.apply(&ipset::diff(&want, &have)).unwrap();
        let mut input = iptables::IpvsModeInput::new(fam);
        input.non_empty_sets = ipset::SetKind::ALL.into_iter().collect();
        let mut ipt = Iptables::detect(fam, Runner::in_netns(node.name())).unwrap();
        ipt.apply(&iptables::render_ipvs_mode(&input).unwrap())
            .unwrap();
    };
    let mut ipt = Iptables::detect(fam, Runner::in_netns(node.name())).unwrap();
    ipvs_mode();
    let sets = node.run(&["ipset", "list", "-n"]).unwrap().lines().count();
    assert!(sets >= 17, "{sets}");

    // 1. Fallback: iptables mode syncs first, with the IPVS-mode state still there.
    let store = synced_store(
        vec![svc("default", "web", "10.96.0.10")
            .node_port("http", 80, "TCP", 30080)
            .build()],
        vec![slice_of("web", &[0, 1], "node-b")],
    );
    let ipt2 = Iptables::detect(fam, Runner::in_netns(node.name())).unwrap();
    let mut p = IptablesProxier::new(cfg4(), RulesConfig::default(), NODE, Box::new(ipt2));
    let r = p.sync(&store, &node_addrs());
    assert!(r.ok(), "iptables mode over IPVS-mode leftovers: {r:?}");
    let synced = node.run(&["iptables-save", "-t", "nat"]).unwrap();
    assert!(synced.contains(":KUBE-SVC-") && synced.contains("match-set"));
    // Then the IPVS-mode leftovers go, and the iptables-mode rules stay as synced.
    let report = cleanup_ipvs_mode_leftovers(&cfg4(), &mut ipt, &ipset, None, None).unwrap();
    println!("after the first iptables-mode sync: {report:?}");
    assert_eq!(report.ipsets.len(), sets);
    let saved = node.run(&["iptables-save"]).unwrap();
    for gone in ["KUBE-IPVS-FILTER", "KUBE-LOAD-BALANCER", "match-set"] {
        assert!(!saved.contains(gone), "{gone} left:\n{saved}");
    }
    let svc_rules = |t: &str| -> Vec<String> {
        t.lines()
            .filter(|l| l.contains("KUBE-SVC-") || l.contains("KUBE-SEP-"))
            .map(str::to_string)
            .collect()
    };
    assert!(!svc_rules(&synced).is_empty());
    assert_eq!(
        svc_rules(&node.run(&["iptables-save", "-t", "nat"]).unwrap()),
        svc_rules(&synced),
        "the cleanup changed iptables-mode rules"
    );
    p.request_full();
    let r = p.sync(&store, &node_addrs());
    assert!(r.ok() && r.drift.is_empty(), "{r:?}");

    // 2. Back to IPVS mode: its rules are written over the iptables-mode chains first, then the
    // iptables-mode chains go, and every IPVS-mode rule stays.
    ipvs_mode();
    let ipvs_rules = |t: &str| -> BTreeSet<String> {
        t.lines()
            .filter(|l| {
                l.starts_with("-A ") && (l.contains("match-set") || l.contains("KUBE-IPVS"))
            })
            .map(str::to_string)
            .collect()
    };
    let before = ipvs_rules(&node.run(&["iptables-save"]).unwrap());
    assert!(!before.is_empty());
    let report = cleanup_iptables_mode(&mut ipt, true).unwrap();
    println!("after the first IPVS-mode sync: {report:?}");
    let saved = node.run(&["iptables-save"]).unwrap();
    for gone in ["KUBE-SVC-", "KUBE-SEP-", "KUBE-EXT-"] {
        assert!(!saved.contains(gone), "{gone} left:\n{saved}");
    }
    assert_eq!(
        ipvs_rules(&saved),
        before,
        "the cleanup changed IPVS-mode rules"
    );
}

/// Issue #16: a restart while a Service is invalid keeps its rules (its last valid version was
/// only in memory; the saved rules are adopted), traffic keeps flowing; fixed, it converges;
/// deleted, its rules go.
#[test]
#[ignore = "netns"]
fn netns_iptables_mode_restart_with_an_invalid_service_keeps_its_rules() {
    let lab = lab(2);
    let web = |valid: bool| {
        let mut s = svc("default", "web", "10.96.0.10")
            .node_port("http", 80, "TCP", 30080)
            .external_ips(&["203.0.113.10"]);
        if !valid {
            s = s.with(|spec| spec.session_affinity = Some("Sometimes".into()));
        }
        s.build()
    };
    let other = svc("default", "other", "10.96.0.13")
        .port("http", 80, "TCP")
        .build();
    let slices = || {
        vec![
            slice_of("web", &[0, 1], "node-b"),
            slice_of("other", &[0], "node-b"),
        ]
    };
    let iptables =
        || Iptables::detect(iptables::Family::Inet, Runner::in_netns(lab.node.name())).unwrap();
    let mut first =
        IptablesProxier::new(cfg4(), RulesConfig::default(), NODE, Box::new(iptables()));
    let valid = synced_store(vec![web(true), other.clone()], slices());
    let r = first.sync(&valid, &node_addrs());
    assert!(r.ok(), "{:?}", r.errors);
    let before = owned_rules(&lab.node.run(&["iptables-save"]).unwrap());
    assert!(before
        .values()
        .flatten()
        .any(|l| l.contains("default/web:http")));
    let node_port = sock(NODE_IP, 30080);
    let external = sock("203.0.113.10", 80);
    for to in [node_port, external] {
        assert_eq!(
            connect_n(&lab.client, to, 6, Duration::from_secs(2)).failed,
            0
        );
    }

    // Invalid now, and the daemon restarts: a new proxier over the same kernel.
    let mut store = synced_store(vec![web(false), other], slices());
    let mut p = IptablesProxier::new(cfg4(), RulesConfig::default(), NODE, Box::new(iptables()));
    let r = p.sync(&store, &node_addrs());
    assert!(r.ok(), "{:?}", r.errors);
    assert_eq!(r.kind, SyncKind::Full);
    let after = owned_rules(&lab.node.run(&["iptables-save"]).unwrap());
    assert_eq!(
        after, before,
        "the first sync after the restart kept web's rules"
    );
    for to in [node_port, external] {
        assert_eq!(
            connect_n(&lab.client, to, 6, Duration::from_secs(2)).failed,
            0
        );
    }
    // A drift check keeps them too.
    p.request_full();
    let r = p.sync(&store, &node_addrs());
    assert!(r.ok(), "{:?}", r.errors);
    assert_eq!(
        owned_rules(&lab.node.run(&["iptables-save"]).unwrap()),
        before
    );

    // Fixed, with one endpoint: converges to exactly what it renders.
    let ch = store.apply(SourceEvent::Apply(Object::from(web(true))));
    p.note(&ch);
    let ch = store.apply(SourceEvent::Apply(Object::from(slice_of(
        "web",
        &[1],
        "node-b",
    ))));
    p.note(&ch);
    let r = p.sync(&store, &node_addrs());
    assert!(r.ok(), "{:?}", r.errors);
    let rendered = p.render_full(&store, &node_addrs()).unwrap();
    assert_eq!(
        owned_rules(&lab.node.run(&["iptables-save"]).unwrap()),
        owned_rules(&rendered)
    );
    let t = connect_n(&lab.client, node_port, 6, Duration::from_secs(2));
    assert_eq!(t.failed, 0);
    assert_eq!(t.by_name.keys().collect::<Vec<_>>(), vec!["pod2"]);

    // Deleted: its rules go.
    let ch = store.apply(SourceEvent::Delete(Object::from(web(true))));
    p.note(&ch);
    let r = p.sync(&store, &node_addrs());
    assert!(r.ok(), "{:?}", r.errors);
    let gone = lab.node.run(&["iptables-save"]).unwrap();
    assert!(!gone.contains("default/web"), "{gone}");
    assert!(gone.contains("default/other"));
}

/// Issue #16: with `nodePortAddresses: [primary]`, a restart whose first sync runs without the
/// Node (its wait timed out) keeps the NodePort jumps of the node's primary address instead of
/// dropping them; the Node's arrival then takes over.
#[test]
#[ignore = "netns"]
fn netns_iptables_mode_first_sync_without_the_node_keeps_node_ports() {
    let lab = lab(1);
    let mut cfg = cfg4();
    cfg.node_port_primary = true;
    let np = svc("default", "np", "10.96.0.20")
        .node_port("http", 80, "TCP", 30090)
        .build();
    let node_ev =
        || SourceEvent::InitApply(Object::Node(Box::new(node_obj(NODE, "zone-a", NODE_IP))));
    let iptables =
        || Iptables::detect(iptables::Family::Inet, Runner::in_netns(lab.node.name())).unwrap();
    let mut with_node = synced_store(vec![np.clone()], vec![slice_of("np", &[0], "node-b")]);
    with_node.apply(SourceEvent::Init(model::event::Kind::Node));
    with_node.apply(node_ev());
    with_node.apply(SourceEvent::InitDone(model::event::Kind::Node));
    let mut first = IptablesProxier::new(
        cfg.clone(),
        RulesConfig::default(),
        NODE,
        Box::new(iptables()),
    );
    let r = first.sync(&with_node, &node_addrs());
    assert!(r.ok(), "{:?}", r.errors);
    let node_port = sock(NODE_IP, 30090);
    assert_eq!(
        connect_n(&lab.client, node_port, 4, Duration::from_secs(2)).failed,
        0
    );
    let jump = format!("-A KUBE-SERVICES -d {NODE_IP}/32");
    assert!(lab
        .node
        .run(&["iptables-save", "-t", "nat"])
        .unwrap()
        .contains(&jump));

    // Restart without the Node.
    let mut store = synced_store(vec![np], vec![slice_of("np", &[0], "node-b")]);
    let mut p = IptablesProxier::new(cfg, RulesConfig::default(), NODE, Box::new(iptables()));
    let r = p.sync(&store, &node_addrs());
    assert!(r.ok(), "{:?}", r.errors);
    assert_eq!(r.kind, SyncKind::Full);
    let saved = lab.node.run(&["iptables-save", "-t", "nat"]).unwrap();
    assert!(saved.contains(&jump), "{saved}");
    assert!(
        !saved.contains("-d 192.168.255.1/32"),
        "only the kept address: {saved}"
    );
    assert_eq!(
        connect_n(&lab.client, node_port, 4, Duration::from_secs(2)).failed,
        0
    );

    // The Node arrives: same jump, now computed from it.
    let ch = store.apply(SourceEvent::Apply(Object::Node(Box::new(node_obj(
        NODE, "zone-a", NODE_IP,
    )))));
    p.note(&ch);
    let r = p.sync(&store, &node_addrs());
    assert!(r.ok(), "{:?}", r.errors);
    let saved = lab.node.run(&["iptables-save", "-t", "nat"]).unwrap();
    assert_eq!(saved.matches(&jump).count(), 1, "{saved}");
    assert_eq!(
        connect_n(&lab.client, node_port, 4, Duration::from_secs(2)).failed,
        0
    );
}

/// With the kernel broken behind the proxier's back: `vip` does not answer; one periodic check
/// (an incremental sync) repairs it, counting one `drift` repair, and `vip` answers again.
fn check_repairs(lab: &Lab, p: &mut IptablesProxier, store: &Store, vip: SocketAddr, drift: &str) {
    assert_eq!(
        connect_n(&lab.client, vip, 2, Duration::from_secs(1)).ok(),
        0
    );
    p.periodic();
    let r = p.sync(store, &node_addrs());
    assert!(r.ok() && r.kind == SyncKind::Incremental, "{r:?}");
    assert_eq!(r.drift.get(drift), Some(&1), "{:?}", r.drift);
    assert_eq!(
        connect_n(&lab.client, vip, 4, Duration::from_secs(2)).failed,
        0
    );
}

/// The periodic check against the real iptables: with the kernel as rendered it writes nothing
/// and runs no `iptables-save`; `iptables -t nat -F KUBE-SERVICES` (the ClusterIP stops
/// answering) and a deleted `PREROUTING` jump are each repaired by one check, counted as
/// drift, with the per-service chains left as they are and the Service answering again; a
/// deleted chain (`KUBE-POSTROUTING`, after its jump) makes the check a full sync, which
/// recreates it.
#[test]
#[ignore = "netns"]
fn netns_iptables_mode_periodic_check_repairs_a_flushed_chain_and_a_deleted_jump() {
    let lab = lab(2);
    let web = svc("default", "web", "10.96.0.10")
        .port("http", 80, "TCP")
        .build();
    let store = synced_store(vec![web], vec![slice_of("web", &[0, 1], "node-b")]);
    let ipt = Iptables::detect(iptables::Family::Inet, Runner::in_netns(lab.node.name())).unwrap();
    let mut p = IptablesProxier::new(cfg4(), RulesConfig::default(), NODE, Box::new(ipt));
    let r = p.sync(&store, &node_addrs());
    assert!(r.ok() && r.kind == SyncKind::Full, "{:?}", r.errors);
    let vip = sock("10.96.0.10", 80);
    // The ClusterIP from the node itself (OUTPUT jump) and from the client (PREROUTING jump).
    assert_eq!(
        connect_n(&lab.client, vip, 4, Duration::from_secs(2)).failed,
        0
    );
    let rendered = owned_rules(&lab.node.run(&["iptables-save"]).unwrap());
    let svc_chains = |text: &str| -> Vec<String> {
        text.lines()
            .filter(|l| l.starts_with("-A KUBE-SVC-") || l.starts_with("-A KUBE-SEP-"))
            .map(str::to_string)
            .collect()
    };
    let per_service = svc_chains(&lab.node.run(&["iptables-save", "-t", "nat"]).unwrap());
    assert!(!per_service.is_empty());

    // As rendered: nothing written.
    p.periodic();
    let r = p.sync(&store, &node_addrs());
    assert!(
        r.ok() && r.kind == SyncKind::Incremental && r.drift.is_empty(),
        "{r:?}"
    );
    assert!(!r.iptables_restored, "nothing differs, nothing written");

    // A flushed KUBE-SERVICES: the ClusterIP stops answering; one check refills it.
    lab.node
        .run(&["iptables", "-t", "nat", "-F", "KUBE-SERVICES"])
        .unwrap();
    check_repairs(&lab, &mut p, &store, vip, "iptables rules");
    assert_eq!(
        owned_rules(&lab.node.run(&["iptables-save"]).unwrap()),
        rendered
    );
    let (written, deleted, _) = p.last_restore();
    assert_eq!((written, deleted), (0, 0), "no per-service chain rewritten");

    // A deleted PREROUTING jump: the client's traffic is no longer proxied; one check fixes it.
    lab.node
        .run(&[
            "iptables",
            "-t",
            "nat",
            "-D",
            "PREROUTING",
            "-m",
            "comment",
            "--comment",
            "kubernetes service portals",
            "-j",
            "KUBE-SERVICES",
        ])
        .unwrap();
    check_repairs(&lab, &mut p, &store, vip, "iptables jumps");

    // A deleted chain: the check cannot list it and runs a full sync, which recreates it.
    lab.node
        .run(&[
            "iptables",
            "-t",
            "nat",
            "-D",
            "POSTROUTING",
            "-m",
            "comment",
            "--comment",
            "kubernetes postrouting rules",
            "-j",
            "KUBE-POSTROUTING",
        ])
        .unwrap();
    lab.node
        .run(&["iptables", "-t", "nat", "-F", "KUBE-POSTROUTING"])
        .unwrap();
    lab.node
        .run(&["iptables", "-t", "nat", "-X", "KUBE-POSTROUTING"])
        .unwrap();
    p.periodic();
    let r = p.sync(&store, &node_addrs());
    assert!(r.ok() && r.kind == SyncKind::Full, "{r:?}");
    assert_eq!(
        owned_rules(&lab.node.run(&["iptables-save"]).unwrap()),
        rendered
    );
    assert_eq!(
        svc_chains(&lab.node.run(&["iptables-save", "-t", "nat"]).unwrap()),
        per_service
    );
    assert_eq!(
        connect_n(&lab.client, vip, 4, Duration::from_secs(2)).failed,
        0
    );
}
