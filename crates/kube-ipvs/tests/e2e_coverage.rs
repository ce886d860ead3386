//! Issue #17 coverage, end to end in the VM with the real binary (`--source-dir`):
//!
//! - `vm_e2e_udp_delete_conntrack` (item 5): deleting a UDP Service leaves no conntrack entry
//!   for its ClusterIP, NodePort or externalIP, and fixed-port clients reach the re-created
//!   Service's new endpoint;
//! - `vm_e2e_large_churn` (item 13): 2,500 endpoints over 3 EndpointSlices, slices added, shrunk
//!   and removed while traffic flows, duplicate addresses across slices;
//! - `vm_e2e_ipv6_dual_stack` (item 14): NodePort and LoadBalancer over IPv6, and an IPv6 family
//!   added to a running IPv4 Service;
//! - `vm_e2e_sctp` (item 15): SCTP ClusterIP and NodePort data path.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod e2e;

use std::collections::BTreeSet;
use std::fmt::Write as _;
use std::io::{BufRead, BufReader, Write};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, TcpListener, TcpStream, UdpSocket};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use e2e::{
    tail, tcp_name, udp_name, wait_until, Ep, Lab, Netns, Outcome, Port, Svc, Tally, NODE_IP,
    NODE_IP6, POD_PORT,
};

const OK_WAIT: Duration = Duration::from_secs(10);
/// Bounds a wait for the daemon to converge (only against a hang; nothing is timed).
const CONVERGE: Duration = Duration::from_secs(60);

fn v4(a: u8, b: u8, c: u8, d: u8) -> IpAddr {
    IpAddr::V4(Ipv4Addr::new(a, b, c, d))
}

fn sa(ip: IpAddr, port: u16) -> SocketAddr {
    SocketAddr::new(ip, port)
}

/// The numbers of one `sync done` log line.
#[derive(Debug, Default, Clone)]
struct Sync {
    family: String,
    ipvs_ops: u64,
}

fn parse_syncs(log: &str) -> Vec<Sync> {
    log.lines()
        .filter(|l| l.contains("sync done"))
        .map(|l| {
            let mut s = Sync::default();
            for w in l.split_whitespace() {
                match w.split_once('=') {
                    Some(("family", v)) => s.family = v.trim_matches('"').to_string(),
                    Some(("ipvs_ops", v)) => s.ipvs_ops = v.parse().unwrap_or(u64::MAX),
                    _ => {}
                }
            }
            s
        })
        .collect()
}

// ---------------------------------------------------------------------------------------------
// Item 5: UDP Service deletion clears conntrack.
// ---------------------------------------------------------------------------------------------

/// A UDP socket bound to a fixed source port inside a namespace, connected to `to`: every
/// datagram it sends has the same 5-tuple, like a DNS resolver's.
fn fixed_port_udp(ns: &Netns, to: SocketAddr, port: u16) -> UdpSocket {
    ns.enter(move || {
        let s = UdpSocket::bind(SocketAddr::new(Ipv4Addr::UNSPECIFIED.into(), port))?;
        s.connect(to)?;
        s.set_read_timeout(Some(Duration::from_secs(3)))?;
        Ok(s)
    })
    .unwrap()
}

/// One datagram and its answer (the pod name), or what happened instead.
fn ask(s: &UdpSocket) -> Outcome {
    let mut buf = [0u8; 256];
    match s.send(b"who").and_then(|_| s.recv(&mut buf)) {
        Ok(n) => Outcome::Name(String::from_utf8_lossy(&buf[..n]).trim().to_string()),
        Err(e) if e.kind() == std::io::ErrorKind::ConnectionRefused => Outcome::Refused,
        Err(e)
            if e.kind() == std::io::ErrorKind::WouldBlock
                || e.kind() == std::io::ErrorKind::TimedOut =>
        {
            Outcome::Timeout
        }
        Err(e) => Outcome::Error(e.to_string()),
    }
}

/// `conntrack -L -p udp --orig-dst IP --orig-port-dst PORT` in the node namespace: the entries.
fn ct_entries(lab: &Lab, ip: IpAddr, port: u16) -> Vec<String> {
    let out = lab
        .node
        .run(&[
            "conntrack",
            "-L",
            "-p",
            "udp",
            "--orig-dst",
            &ip.to_string(),
            "--orig-port-dst",
            &port.to_string(),
        ])
        .unwrap_or_default();
    out.lines()
        .filter(|l| l.starts_with("udp"))
        .map(str::to_string)
        .collect()
}

/// Upstream: `deleteStaleServiceConntrackEntries` / `conntrack.CleanStaleEntries`
/// (pkg/proxy/conntrack/cleanup.go) removes the entries of a deleted UDP Service's ClusterIP,
/// externalIPs, LoadBalancer IPs and NodePorts, so a client that keeps its source port is not
/// pinned to the old endpoint when the Service comes back.
#[test]
#[ignore = "vm"]
fn vm_e2e_udp_delete_conntrack() {
    let mut lab = Lab::new("e2e-udpdel");
    let old = lab.add_pod("pod-old", 2, false);
    let _new = lab.add_pod("pod-new", 3, false);
    let cli_pod = lab.add_pod("pod-cli", 4, false);
    let (old_ip, new_ip) = (lab.pods[old].ip, lab.pods[1].ip);

    let cip = v4(10, 96, 50, 1);
    let eip = v4(198, 51, 100, 50);
    let np = 30053;
    let svc = |ep: Ipv4Addr| {
        let mut s =
            Svc::new("dns", cip, vec![Port::new("UDP", 53).node_port(np)]).eps(vec![Ep::local(ep)]);
        s.kind = "NodePort";
        s.external_ips = vec![eip];
        s
    };
    lab.write("svc-dns", &svc(old_ip).yaml());
    lab.start_daemon(&[
        "--cluster-cidr",
        "10.244.0.0/16",
        "--ipvs-min-sync-period",
        "0s",
    ]);
    lab.wait_ipvs(
        &[
            "-A -u 10.96.50.1:53 -s rr",
            "-A -u 192.168.0.10:30053 -s rr",
            "-A -u 198.51.100.50:53 -s rr",
        ],
        CONVERGE,
    );

    let mut t = Tally::new("item 5 (UDP Service deletion clears conntrack)");
    // (what, conntrack's view of the destination, the client socket)
    let targets = [
        (
            "ClusterIP",
            cip,
            53,
            fixed_port_udp(&lab.pods[cli_pod].ns, sa(cip, 53), 40053),
        ),
        (
            "NodePort",
            IpAddr::V4(NODE_IP),
            np,
            fixed_port_udp(&lab.client, sa(IpAddr::V4(NODE_IP), np), 40054),
        ),
        (
            "externalIP",
            eip,
            53,
            fixed_port_udp(&lab.client, sa(eip, 53), 40055),
        ),
    ];
    for (what, ip, port, s) in &targets {
        for i in 0..3 {
            let o = ask(s);
            t.check(
                &format!("{what} before deletion #{i}: the old pod answers"),
                o.name() == Some("pod-old"),
                format!("{o:?}"),
            );
        }
        let ct = ct_entries(&lab, *ip, *port);
        t.check(
            &format!("{what}: a conntrack entry to {ip}:{port} exists before deletion"),
            !ct.is_empty(),
            format!("{} entries", ct.len()),
        );
    }

    // Delete the Service (and its slice).
    lab.remove("svc-dns");
    let gone = wait_until(CONVERGE, || {
        let s = lab.ipvs_save();
        !s.contains(":53 ") && !s.contains(":30053 ")
    });
    t.check(
        "the virtual servers are deleted",
        gone,
        tail(&lab.ipvs_save(), 5),
    );
    for (what, ip, port, _) in &targets {
        // Bounded wait: the cleanup follows the IPVS deletion in the same sync.
        let mut left = Vec::new();
        let clean = wait_until(CONVERGE, || {
            left = ct_entries(&lab, *ip, *port);
            left.is_empty()
        });
        t.check(
            &format!("{what}: no conntrack entry left to {ip}:{port} after deletion"),
            clean,
            format!("{left:?}"),
        );
    }
    // The clients keep sending while the Service is gone (a resolver retrying): no answer,
    // and whatever entries that leaves must not pin the re-created Service.
    for (what, _, _, s) in &targets {
        let o = ask(s);
        t.check(
            &format!("{what} while deleted: no pod answers"),
            o.name().is_none(),
            format!("{o:?}"),
        );
    }

    // Re-create it with a different endpoint: the same clients (same source ports) reach it.
    lab.write("svc-dns", &svc(new_ip).yaml());
    lab.wait_ipvs(
        &[
            "-a -u 10.96.50.1:53 -r 10.244.1.3:8080 -m -w 1",
            "-a -u 192.168.0.10:30053 -r 10.244.1.3:8080 -m -w 1",
            "-a -u 198.51.100.50:53 -r 10.244.1.3:8080 -m -w 1",
        ],
        CONVERGE,
    );
    for (what, _, _, s) in &targets {
        // The first datagram after re-creation may race the daemon's conntrack cleanup of the
        // entries the retries above left (it runs right after the IPVS writes): allow a
        // bounded number of attempts, and count them.
        let mut got = Vec::new();
        let ok = wait_until(CONVERGE, || {
            let o = ask(s);
            let done = o.name() == Some("pod-new");
            got.push(o);
            done
        });
        t.check(
            &format!("{what} after re-creation: the new pod answers the same client port"),
            ok && !got.iter().any(|o| o.name() == Some("pod-old")),
            format!("{} attempts: {:?}", got.len(), got),
        );
        for i in 0..3 {
            let o = ask(s);
            t.check(
                &format!("{what} after re-creation #{i}"),
                o.name() == Some("pod-new"),
                format!("{o:?}"),
            );
        }
    }
    drop(targets);
    t.finish();
}

// ---------------------------------------------------------------------------------------------
// Item 13: large Services churn.
// ---------------------------------------------------------------------------------------------

/// The bulk endpoints: 10.244.16.0/20 (4,096 addresses), all served by one pod namespace that
/// treats the whole range as local (AnyIP), so every programmed real server answers.
fn bulk_ip(i: u32) -> Ipv4Addr {
    Ipv4Addr::from(u32::from(Ipv4Addr::new(10, 244, 16, 0)) + i)
}

/// The port of the bulk pod's address server (the lab's name servers use [`POD_PORT`]).
const BULK_PORT: u16 = POD_PORT + 1;

/// One EndpointSlice of the `big` Service: (address index, ready).
fn slice_yaml(n: u32, eps: &[(u32, bool)]) -> String {
    let mut s = String::new();
    writeln!(
        s,
        "apiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata:\n  name: big-{n}\n  namespace: default\n  labels: {{kubernetes.io/service-name: big}}\naddressType: IPv4\nports:\n- {{name: http, protocol: TCP, port: {BULK_PORT}}}\nendpoints:"
    )
    .unwrap();
    for (i, ready) in eps {
        writeln!(
            s,
            "- {{addresses: ['{}'], conditions: {{ready: {ready}, serving: {ready}}}, nodeName: node-2}}",
            bulk_ip(*i)
        )
        .unwrap();
    }
    s
}

/// What the proxy must program for the slices now written: every address that is ready in at
/// least one slice, once. Upstream: `EndpointSliceCache.addEndpoints`
/// (pkg/proxy/endpointslicecache.go) keeps one endpoint per address and lets a ready copy
/// replace a not-ready one.
fn expected(slices: &[&[(u32, bool)]]) -> BTreeSet<Ipv4Addr> {
    slices
        .iter()
        .flat_map(|s| s.iter())
        .filter(|(_, ready)| *ready)
        .map(|(i, _)| bulk_ip(*i))
        .collect()
}

/// The real servers of `vip:80` in `ipvsadm -Sn`: (serving, draining). A removed endpoint
/// with connections left stays as a weight-0 real server until they close (graceful
/// termination, upstream's `GracefulTerminationManager`), and takes no new connection.
fn reals(save: &str, vip: &str) -> (BTreeSet<Ipv4Addr>, BTreeSet<Ipv4Addr>) {
    let prefix = format!("-a -t {vip}:80 -r ");
    let (mut serving, mut draining) = (BTreeSet::new(), BTreeSet::new());
    for r in save.lines().filter_map(|l| l.strip_prefix(&prefix)) {
        let Some(ip) = r.split(':').next().and_then(|ip| ip.parse().ok()) else {
            continue;
        };
        if r.ends_with(" -w 0") {
            draining.insert(ip);
        } else {
            serving.insert(ip);
        }
    }
    (serving, draining)
}

/// A TCP server answering every connection with its local address (the endpoint the
/// connection was sent to), on `0.0.0.0:BULK_PORT` inside `ns`.
fn start_addr_server(ns: &Netns, stop: Arc<AtomicBool>) -> std::thread::JoinHandle<()> {
    let l = ns
        .enter(|| {
            let l = TcpListener::bind(("0.0.0.0", BULK_PORT))?;
            l.set_nonblocking(true)?;
            Ok(l)
        })
        .unwrap();
    std::thread::spawn(move || {
        while !stop.load(Ordering::Relaxed) {
            match l.accept() {
                Ok((mut c, _)) => {
                    let me = c
                        .local_addr()
                        .map(|a| a.ip().to_string())
                        .unwrap_or_default();
                    let _ = c.write_all(format!("{me}\n").as_bytes());
                }
                Err(_) => std::thread::sleep(Duration::from_millis(2)),
            }
        }
    })
}

/// Endpoint-level checks of the churn: what each connection reached.
#[derive(Default)]
struct Traffic {
    attempted: usize,
    failures: Vec<String>,
    /// Addresses that answered.
    reached: BTreeSet<Ipv4Addr>,
}

#[test]
#[ignore = "vm"]
fn vm_e2e_large_churn() {
    let mut lab = Lab::new("e2e-churn");
    let bulk = lab.add_pod("bulk", 2, false);
    let cli = lab.add_pod("cli", 3, false);
    // The whole /20 is local in the bulk pod and routed to it from the node.
    let host_if = lab.pods[bulk].host_if.clone();
    lab.pods[bulk]
        .ns
        .ip(&["route", "add", "local", "10.244.16.0/20", "dev", "lo"])
        .unwrap();
    lab.node_run(&["ip", "route", "add", "10.244.16.0/20", "dev", &host_if]);

    let stop = Arc::new(AtomicBool::new(false));
    let server = start_addr_server(&lab.pods[bulk].ns, stop.clone());

    let svc = "apiVersion: v1\nkind: Service\nmetadata: {name: big, namespace: default}\nspec:\n  type: ClusterIP\n  clusterIP: 10.96.70.1\n  clusterIPs: [10.96.70.1]\n  ipFamilies: [IPv4]\n  ipFamilyPolicy: SingleStack\n  ports:\n  - {name: http, protocol: TCP, port: 80, targetPort: 8081}\n";
    lab.write("svc-big", svc);
    // Slices 1 and 2: 1,000 each. Slice 3 (added later): 500 of its own, plus 50 addresses of
    // slice 1 not ready (ready in slice 1: ready wins) and 50 of slice 2 ready (counted once).
    let s1: Vec<(u32, bool)> = (0..1000).map(|i| (i, true)).collect();
    let s2: Vec<(u32, bool)> = (1000..2000).map(|i| (i, true)).collect();
    let mut s3: Vec<(u32, bool)> = (2000..2500).map(|i| (i, true)).collect();
    s3.extend((900..950).map(|i| (i, false)));
    s3.extend((1000..1050).map(|i| (i, true)));
    lab.write("eps-big-1", &slice_yaml(1, &s1));
    lab.write("eps-big-2", &slice_yaml(2, &s2));
    lab.start_daemon(&[
        "--cluster-cidr",
        "10.244.0.0/16",
        "--ipvs-min-sync-period",
        "0s",
    ]);

    let mut t = Tally::new("item 13 (large Service churn)");
    let vip = "10.96.70.1";
    // After a change: wait for the daemon's next sync (from its log), then compare the
    // programmed set, re-reading it (bounded) while a sync is still under way.
    // The serving real servers must equal the expected set; weight-0 ones (draining) may only
    // be endpoints this step removed.
    let check_set = |t: &mut Tally,
                     step: &str,
                     syncs: usize,
                     want: &BTreeSet<Ipv4Addr>,
                     removed: &BTreeSet<Ipv4Addr>| {
        lab.wait_syncs_past(syncs, CONVERGE * 2);
        let (mut got, mut draining) = (BTreeSet::new(), BTreeSet::new());
        let ok = wait_until(CONVERGE * 2, || {
            (got, draining) = reals(&lab.ipvs_save(), vip);
            &got == want && draining.is_subset(removed)
        });
        let missing = want.difference(&got).count();
        let extra = got.difference(want).count();
        t.check(
            &format!("{step}: IPVS real servers == expected"),
            ok,
            format!(
                "expected {}, serving {}, missing {missing}, extra {extra}, draining {} (all removed ones: {})",
                want.len(),
                got.len(),
                draining.len(),
                draining.is_subset(removed)
            ),
        );
    };

    let want0 = expected(&[&s1, &s2]);
    check_set(&mut t, "slices 1+2 (2,000)", 0, &want0, &BTreeSet::new());

    // Traffic from a pod to the ClusterIP for the rest of the test; every answer names the
    // endpoint address that was reached.
    let allowed: Arc<Mutex<BTreeSet<Ipv4Addr>>> = Arc::new(Mutex::new(want0.clone()));
    let traffic: Arc<Mutex<Traffic>> = Arc::default();
    let conns = Arc::new(AtomicUsize::new(0));
    std::thread::scope(|sc| {
        let cli_ns = &lab.pods[cli].ns;
        let client = {
            let (stop, allowed, traffic, conns) = (
                stop.clone(),
                allowed.clone(),
                traffic.clone(),
                conns.clone(),
            );
            sc.spawn(move || {
                let to = sa(v4(10, 96, 70, 1), 80);
                while !stop.load(Ordering::Relaxed) {
                    let r = cli_ns.enter(move || {
                        let mut s = TcpStream::connect_timeout(&to, OK_WAIT)?;
                        s.set_read_timeout(Some(OK_WAIT))?;
                        let mut line = String::new();
                        BufReader::new(&mut s).read_line(&mut line)?;
                        Ok(line)
                    });
                    let mut tr = traffic.lock().unwrap();
                    tr.attempted += 1;
                    conns.fetch_add(1, Ordering::Relaxed);
                    match r.map(|l| (l.trim().parse::<Ipv4Addr>(), l)) {
                        Ok((Ok(ip), _)) => {
                            if !allowed.lock().unwrap().contains(&ip) {
                                tr.failures
                                    .push(format!("reached {ip}, not a current endpoint"));
                            }
                            tr.reached.insert(ip);
                        }
                        Ok((Err(e), l)) => tr.failures.push(format!("bad answer {l:?}: {e}")),
                        Err(e) => tr.failures.push(format!("connect/read: {e}")),
                    }
                    drop(tr);
                    std::thread::sleep(Duration::from_millis(100));
                }
            })
        };
        // A step changes the slices: the traffic may reach the union of the sets before and after
        // while the daemon converges, then only the new set.
        let step = |t: &mut Tally,
                    what: &str,
                    before: &BTreeSet<Ipv4Addr>,
                    after: &BTreeSet<Ipv4Addr>,
                    change: &dyn Fn()| {
            *allowed.lock().unwrap() = before.union(after).copied().collect();
            let syncs = lab.sync_lines().len();
            let started = std::time::Instant::now();
            change();
            let removed = before.difference(after).copied().collect();
            check_set(t, what, syncs, after, &removed);
            println!(
                "  ({what}: converged and checked after {:?})",
                started.elapsed()
            );
            *allowed.lock().unwrap() = after.clone();
            // Some traffic against the converged set before the next step.
            let n = conns.load(Ordering::Relaxed);
            wait_until(CONVERGE, || conns.load(Ordering::Relaxed) >= n + 5);
        };

        let want1 = expected(&[&s1, &s2, &s3]);
        t.check(
            "expected after adding slice 3: 2,500 addresses (duplicates once)",
            want1.len() == 2500,
            want1.len(),
        );
        step(&mut t, "slice 3 added (2,500)", &want0, &want1, &|| {
            lab.write("eps-big-3", &slice_yaml(3, &s3))
        });

        // Shrink slice 1 to its first 400: 900..950 are now only not-ready copies in slice 3.
        let s1b: Vec<(u32, bool)> = s1[..400].to_vec();
        let want2 = expected(&[&s1b, &s2, &s3]);
        t.check(
            "expected after shrinking slice 1: 1,900 (not-ready duplicates dropped)",
            want2.len() == 1900 && !want2.contains(&bulk_ip(920)),
            want2.len(),
        );
        step(&mut t, "slice 1 shrunk to 400", &want1, &want2, &|| {
            lab.write("eps-big-1", &slice_yaml(1, &s1b))
        });

        // Remove slice 2: 1000..1050 stay (ready duplicates in slice 3).
        let want3 = expected(&[&s1b, &s3]);
        t.check(
            "expected after removing slice 2: 950 (slice 3's ready duplicates stay)",
            want3.len() == 950 && want3.contains(&bulk_ip(1010)),
            want3.len(),
        );
        step(&mut t, "slice 2 removed", &want2, &want3, &|| {
            lab.remove("eps-big-2")
        });

        // Slice 3's not-ready duplicates become ready: they come back.
        let mut s3b = s3.clone();
        for e in s3b.iter_mut() {
            e.1 = true;
        }
        let want4 = expected(&[&s1b, &s3b]);
        t.check(
            "expected after slice 3's duplicates become ready: 1,000",
            want4.len() == 1000,
            want4.len(),
        );
        step(
            &mut t,
            "slice 3 not-ready duplicates ready",
            &want3,
            &want4,
            &|| lab.write("eps-big-3", &slice_yaml(3, &s3b)),
        );

        stop.store(true, Ordering::Relaxed);
        client.join().unwrap();
    });
    server.join().unwrap();
    let tr = traffic.lock().unwrap();
    println!(
        "traffic: {} connections, {} distinct endpoints reached, {} failed",
        tr.attempted,
        tr.reached.len(),
        tr.failures.len()
    );
    t.check(
        "traffic during churn: connections made",
        tr.attempted >= 20,
        tr.attempted,
    );
    t.check(
        "traffic during churn: 0 failures (every answer from a current endpoint)",
        tr.failures.is_empty(),
        format!("{:?}", tr.failures.iter().take(10).collect::<Vec<_>>()),
    );
    t.check(
        "traffic spread over many endpoints",
        tr.reached.len() >= 20,
        tr.reached.len(),
    );
    drop(tr);
    t.finish();
}

// ---------------------------------------------------------------------------------------------
// Item 14: IPv6 and dual-stack.
// ---------------------------------------------------------------------------------------------

/// The IPv6 LoadBalancer ingress IP (routed to the node by the client namespace).
const LB6: Ipv6Addr = Ipv6Addr::new(0xfd00, 0x198, 0x51, 0x100, 0, 0, 0, 0x30);

/// A Service that starts IPv4 SingleStack (`dual: false`) and becomes PreferDualStack with an
/// IPv6 ClusterIP (`dual: true`), with one slice per family.
fn fam_yaml(dual: bool, v4eps: &[Ipv4Addr], v6eps: &[Ipv6Addr]) -> String {
    let mut s = String::from("apiVersion: v1\nkind: Service\nmetadata: {name: fam, namespace: default}\nspec:\n  type: ClusterIP\n  clusterIP: 10.96.60.1\n");
    if dual {
        s.push_str("  clusterIPs: [10.96.60.1, 'fd00:10:96::60']\n  ipFamilies: [IPv4, IPv6]\n  ipFamilyPolicy: PreferDualStack\n");
    } else {
        s.push_str(
            "  clusterIPs: [10.96.60.1]\n  ipFamilies: [IPv4]\n  ipFamilyPolicy: SingleStack\n",
        );
    }
    s.push_str("  ports:\n  - {name: http, protocol: TCP, port: 80, targetPort: 8080}\n");
    let slice = |n: &str, fam: &str, ips: Vec<String>| {
        let mut y = format!("---\napiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata:\n  name: fam-{n}\n  namespace: default\n  labels: {{kubernetes.io/service-name: fam}}\naddressType: {fam}\nports:\n- {{name: http, protocol: TCP, port: 8080}}\nendpoints:\n");
        for ip in ips {
            writeln!(y, "- addresses: ['{ip}']\n  conditions: {{ready: true, serving: true, terminating: false}}\n  nodeName: node-1").unwrap();
        }
        y
    };
    s.push_str(&slice(
        "v4",
        "IPv4",
        v4eps.iter().map(|i| i.to_string()).collect(),
    ));
    if dual {
        s.push_str(&slice(
            "v6",
            "IPv6",
            v6eps.iter().map(|i| i.to_string()).collect(),
        ));
    }
    s
}

/// Upstream: the IPVS proxier runs one proxier per family (`NewDualStackProxier`,
/// pkg/proxy/ipvs/proxier.go) and serves NodePorts on the node's IPv6 addresses and IPv6
/// LoadBalancer ingress IPs like IPv4 ones; a Service gaining a family adds that family's
/// virtual servers and leaves the other family's alone.
#[test]
#[ignore = "vm"]
fn vm_e2e_ipv6_dual_stack() {
    let mut lab = Lab::new("e2e-v6");
    let a = lab.add_pod("pod-a", 2, true);
    let b = lab.add_pod("pod-b", 3, true);
    let (a4, b4) = (lab.pods[a].ip, lab.pods[b].ip);
    let (a6, b6) = (lab.pods[a].ip6.unwrap(), lab.pods[b].ip6.unwrap());
    lab.client
        .ip(&[
            "-6",
            "route",
            "add",
            "fd00:198:51:100::/64",
            "via",
            "fd00:192:168::10",
        ])
        .unwrap();

    let mut lb = Svc::new(
        "lb6",
        "fd00:10:96::50".parse::<IpAddr>().unwrap(),
        vec![
            Port::new("TCP", 80).node_port(30090),
            Port::new("UDP", 80).node_port(30090),
        ],
    )
    .eps(vec![Ep::local(a6), Ep::local(b6)]);
    lb.kind = "LoadBalancer";
    lb.lb_ip = Some(IpAddr::V6(LB6));
    lab.write("svc-lb6", &lb.yaml());
    lab.write("svc-fam", &fam_yaml(false, &[a4, b4], &[a6, b6]));
    lab.start_daemon(&[
        "--cluster-cidr",
        "10.244.0.0/16,fd00:10:244::/48",
        "--ipvs-min-sync-period",
        "0s",
    ]);
    lab.wait_ipvs(
        &[
            "-A -t [fd00:192:168::10]:30090 -s rr",
            "-A -u [fd00:192:168::10]:30090 -s rr",
            "-A -t [fd00:198:51:100::30]:80 -s rr",
            "-A -t 10.96.60.1:80 -s rr",
        ],
        CONVERGE,
    );
    let mut t = Tally::new("item 14 (IPv6 and dual-stack)");
    let ab = ["pod-a", "pod-b"];
    let cli = &lab.client;

    // IPv6 NodePort and LoadBalancer from the external client, TCP and UDP.
    for (what, to) in [
        ("[node-v6]:nodePort", sa(IpAddr::V6(NODE_IP6), 30090)),
        ("[lb-v6]:port", sa(IpAddr::V6(LB6), 80)),
    ] {
        let mut seen = BTreeSet::new();
        for i in 0..4 {
            let o = tcp_name(cli, to, OK_WAIT);
            t.check(
                &format!("TCP {what} #{i}"),
                o.name().is_some_and(|n| ab.contains(&n)),
                format!("{o:?}"),
            );
            seen.extend(o.name().map(str::to_string));
        }
        t.check(
            &format!("TCP {what} spreads over both endpoints"),
            seen.len() == 2,
            format!("{seen:?}"),
        );
        let o = udp_name(cli, to, None, OK_WAIT);
        t.check(
            &format!("UDP {what}"),
            o.name().is_some_and(|n| ab.contains(&n)),
            format!("{o:?}"),
        );
    }

    // A family added at run time: SingleStack IPv4 → PreferDualStack with an IPv6 ClusterIP.
    let v4_lines = |s: &str| -> Vec<String> {
        s.lines()
            .filter(|l| l.contains("10.96.60.1:80"))
            .map(str::to_string)
            .collect()
    };
    let before = v4_lines(&lab.ipvs_save());
    let pc = &lab.pods[a].ns;
    let o = tcp_name(pc, sa(v4(10, 96, 60, 1), 80), OK_WAIT);
    t.check(
        "IPv4 ClusterIP before the family is added",
        o.name().is_some_and(|n| ab.contains(&n)),
        format!("{o:?}"),
    );
    let syncs_before = parse_syncs(&lab.log_text()).len();
    lab.write("svc-fam", &fam_yaml(true, &[a4, b4], &[a6, b6]));
    lab.wait_ipvs(
        &[
            "-A -t [fd00:10:96::60]:80 -s rr",
            "-a -t [fd00:10:96::60]:80 -r [fd00:10:244:1::2]:8080 -m -w 1",
            "-a -t [fd00:10:96::60]:80 -r [fd00:10:244:1::3]:8080 -m -w 1",
        ],
        CONVERGE,
    );
    let after = v4_lines(&lab.ipvs_save());
    t.check(
        "the IPv4 virtual server and real servers are unchanged",
        before == after && before.len() == 3,
        format!("before {before:?}, after {after:?}"),
    );
    let syncs: Vec<Sync> = parse_syncs(&lab.log_text())
        .into_iter()
        .skip(syncs_before)
        .collect();
    let v4_ops: u64 = syncs
        .iter()
        .filter(|s| s.family == "Inet")
        .map(|s| s.ipvs_ops)
        .sum();
    let v6_ops: u64 = syncs
        .iter()
        .filter(|s| s.family == "Inet6")
        .map(|s| s.ipvs_ops)
        .sum();
    t.check(
        "no IPv4 IPVS writes for the added family (sync log)",
        v4_ops == 0,
        format!(
            "IPv4 ipvs_ops {v4_ops} over {} syncs: {syncs:?}",
            syncs.len()
        ),
    );
    t.check(
        "IPv6 IPVS writes for the added family (sync log)",
        v6_ops >= 3,
        format!("IPv6 ipvs_ops {v6_ops}"),
    );
    let mut seen = BTreeSet::new();
    for i in 0..4 {
        let o = tcp_name(pc, sa("fd00:10:96::60".parse().unwrap(), 80), OK_WAIT);
        t.check(
            &format!("IPv6 ClusterIP of the added family #{i}"),
            o.name().is_some_and(|n| ab.contains(&n)),
            format!("{o:?}"),
        );
        seen.extend(o.name().map(str::to_string));
    }
    t.check(
        "IPv6 ClusterIP spreads over both endpoints",
        seen.len() == 2,
        format!("{seen:?}"),
    );
    let o = tcp_name(pc, sa(v4(10, 96, 60, 1), 80), OK_WAIT);
    t.check(
        "IPv4 ClusterIP after the family is added",
        o.name().is_some_and(|n| ab.contains(&n)),
        format!("{o:?}"),
    );
    t.finish();
}

// ---------------------------------------------------------------------------------------------
// Item 15: SCTP.
// ---------------------------------------------------------------------------------------------

const IPPROTO_SCTP: i32 = 132;

/// An SCTP one-to-one (`SOCK_STREAM`) socket, like TCP's API.
fn sctp_socket(v6: bool) -> std::io::Result<socket2::Socket> {
    use socket2::{Domain, Protocol, Socket, Type};
    let d = if v6 { Domain::IPV6 } else { Domain::IPV4 };
    Socket::new(d, Type::STREAM, Some(Protocol::from(IPPROTO_SCTP)))
}

/// An SCTP server in `ns` on `0.0.0.0:POD_PORT` answering each association with `name`.
fn start_sctp_server(ns: &Netns, name: &str, stop: Arc<AtomicBool>) -> std::thread::JoinHandle<()> {
    let l = ns
        .enter(|| {
            let s = sctp_socket(false)?;
            s.set_reuse_address(true)?;
            s.bind(&SocketAddr::from((Ipv4Addr::UNSPECIFIED, POD_PORT)).into())?;
            s.listen(16)?;
            s.set_nonblocking(true)?;
            Ok(s)
        })
        .unwrap();
    let name = name.to_string();
    std::thread::spawn(move || {
        while !stop.load(Ordering::Relaxed) {
            match l.accept() {
                Ok((c, _)) => {
                    let _ = c.set_nonblocking(false);
                    let mut c = TcpStream::from(c);
                    let _ = c.write_all(format!("{name}\n").as_bytes());
                    // Let the client read before the association closes.
                    let mut buf = [0u8; 16];
                    let _ = c.set_read_timeout(Some(Duration::from_secs(2)));
                    let _ = std::io::Read::read(&mut c, &mut buf);
                }
                Err(_) => std::thread::sleep(Duration::from_millis(5)),
            }
        }
    })
}

/// Connect over SCTP from inside `ns` and read the pod name.
fn sctp_name(ns: &Netns, to: SocketAddr) -> Outcome {
    let r = ns.enter(move || {
        let s = sctp_socket(to.is_ipv6())?;
        s.connect_timeout(&to.into(), OK_WAIT)?;
        let s = TcpStream::from(s);
        s.set_read_timeout(Some(OK_WAIT))?;
        let mut line = String::new();
        BufReader::new(&s).read_line(&mut line)?;
        Ok(line)
    });
    match r {
        Ok(l) if !l.is_empty() => Outcome::Name(l.trim().to_string()),
        Ok(_) => Outcome::Error("closed without a name".into()),
        Err(e) => Outcome::Error(e.to_string()),
    }
}

/// Upstream: the IPVS proxier programs SCTP virtual servers like TCP ones
/// (`syncService`, pkg/proxy/ipvs/proxier.go, protocol SCTP) and NodePorts get the
/// `KUBE-NODE-PORT-SCTP-HASH` set.
#[test]
#[ignore = "vm"]
fn vm_e2e_sctp() {
    // The VM image ships sctp.ko from the same kernel build (xtask/src/image.rs); a kernel
    // without it cannot carry SCTP sockets at all.
    if let Err(e) = Netns::new("e2e-sctp-probe").and_then(|n| n.run(&["modprobe", "sctp"])) {
        println!("item 15 (SCTP): SKIPPED: the VM kernel cannot load sctp ({e})");
        return;
    }
    let mut lab = Lab::new("e2e-sctp");
    let a = lab.add_pod("pod-a", 2, false);
    let b = lab.add_pod("pod-b", 3, false);
    let c = lab.add_pod("pod-c", 4, false);
    let stop = Arc::new(AtomicBool::new(false));
    let servers = [
        start_sctp_server(&lab.pods[a].ns, "pod-a", stop.clone()),
        start_sctp_server(&lab.pods[b].ns, "pod-b", stop.clone()),
    ];
    let (a_ip, b_ip) = (lab.pods[a].ip, lab.pods[b].ip);
    let mut svc = Svc::new(
        "sctp",
        v4(10, 96, 80, 1),
        vec![Port::new("SCTP", 80).node_port(30132)],
    )
    .eps(vec![Ep::local(a_ip), Ep::local(b_ip)]);
    svc.kind = "NodePort";
    lab.write("svc-sctp", &svc.yaml());
    lab.start_daemon(&[
        "--cluster-cidr",
        "10.244.0.0/16",
        "--ipvs-min-sync-period",
        "0s",
    ]);
    lab.wait_ipvs(
        &[
            "-A --sctp-service 10.96.80.1:80 -s rr",
            "-A --sctp-service 192.168.0.10:30132 -s rr",
        ],
        CONVERGE,
    );
    let mut t = Tally::new("item 15 (SCTP)");
    let ab = ["pod-a", "pod-b"];
    for (what, ns, to) in [
        (
            "ClusterIP from a pod",
            &lab.pods[c].ns,
            sa(v4(10, 96, 80, 1), 80),
        ),
        (
            "NodePort from the client",
            &lab.client,
            sa(IpAddr::V4(NODE_IP), 30132),
        ),
    ] {
        let mut seen = BTreeSet::new();
        for i in 0..4 {
            let o = sctp_name(ns, to);
            t.check(
                &format!("SCTP {what} #{i}"),
                o.name().is_some_and(|n| ab.contains(&n)),
                format!("{o:?}"),
            );
            seen.extend(o.name().map(str::to_string));
        }
        t.check(
            &format!("SCTP {what} spreads over both endpoints"),
            seen.len() == 2,
            format!("{seen:?}"),
        );
    }
    stop.store(true, Ordering::Relaxed);
    for s in servers {
        s.join().unwrap();
    }
    t.finish();
}

// ---------------------------------------------------------------------------------------------
// Item 1: externalTrafficPolicy=Local and in-cluster traffic.
// ---------------------------------------------------------------------------------------------

/// Item 1: a LoadBalancer Service with `externalTrafficPolicy: Local` (LB IP, externalIP and
/// NodePort) whose only endpoint is on another node. Traffic from outside the cluster gets the
/// local endpoints only (none: dropped), as upstream; traffic from a pod (inside
/// `--cluster-cidr`) and from the node itself reaches every endpoint, as Kubernetes' iptables
/// and nftables proxiers do (`syncProxyRules`, pkg/proxy/iptables/proxier.go: "pod traffic for
/// ... external destinations", "route LOCAL traffic ..."). Upstream's IPVS proxier drops it
/// (k/k#75262), which is what this test fails on without the in-cluster path. With a local
/// endpoint added, outside traffic goes to it only while in-cluster traffic spreads over both.
#[test]
#[ignore = "vm"]
fn vm_e2e_etp_local_in_cluster() {
    let mut lab = Lab::new("e2e-etpin");
    let remote = lab.add_pod("pod-remote", 2, false);
    let local = lab.add_pod("pod-local", 3, false);
    let cli_pod = lab.add_pod("pod-cli", 4, false);
    let (remote_ip, local_ip) = (lab.pods[remote].ip, lab.pods[local].ip);
    let cip = v4(10, 96, 60, 1);
    let lb = v4(203, 0, 113, 60);
    let eip = v4(198, 51, 100, 60);
    let np = 30060;
    let svc = |eps: Vec<Ep>, etp_local: bool| {
        let mut s = Svc::new("web", cip, vec![Port::new("TCP", 80).node_port(np)]).eps(eps);
        s.kind = "LoadBalancer";
        s.lb_ip = Some(lb);
        s.external_ips = vec![eip];
        s.etp_local = etp_local;
        s
    };
    lab.write("svc-web", &svc(vec![Ep::remote(remote_ip)], true).yaml());
    lab.start_daemon(&["--cluster-cidr", "10.244.0.0/16"]);
    lab.wait_ipvs(
        &[
            "-A -t 203.0.113.60:80 -s rr",
            "-A -t 192.168.0.10:30060 -s rr",
            "-a -t 10.96.60.1:80 -r 10.244.1.2:8080 -m -w 1",
        ],
        CONVERGE,
    );
    let save = lab.ipvs_save();
    let mut t = Tally::new("item 1 (externalTrafficPolicy=Local, in-cluster traffic)");
    let fw: Vec<&str> = save.lines().filter(|l| l.starts_with("-A -f ")).collect();
    t.check(
        "one firewall-mark virtual server for the Local port",
        fw.len() == 1,
        &save,
    );
    t.check(
        "its real server is the remote endpoint",
        save.lines()
            .any(|l| l.starts_with("-a -f ") && l.contains("-r 10.244.1.2:8080")),
        &save,
    );
    t.check(
        "the address virtual servers keep only local endpoints (none)",
        !save.lines().any(|l| {
            l.starts_with("-a -t ")
                && l.contains("10.244.1.2:8080")
                && !l.contains(&format!("-t {cip}:"))
        }),
        &save,
    );
    let nat = lab.node_run(&["iptables-save", "-t", "nat"]);
    t.check(
        "a mark rule per external destination",
        [
            "-d 203.0.113.60/32",
            "-d 198.51.100.60/32",
            "-d 192.168.0.10/32",
        ]
        .iter()
        .all(|d| {
            nat.lines()
                .any(|l| l.starts_with("-A KUBE-IPVS-IN-CLUSTER-MARK ") && l.contains(d))
        }),
        tail(&nat, 30),
    );

    let dests = [
        ("LB IP", sa(lb, 80)),
        ("externalIP", sa(eip, 80)),
        ("NodePort", sa(IpAddr::V4(NODE_IP), np)),
    ];
    for (what, to) in dests {
        let o = tcp_name(&lab.pods[cli_pod].ns, to, OK_WAIT);
        t.check(
            &format!("{what} from a pod: the remote endpoint answers"),
            o.name() == Some("pod-remote"),
            format!("{o:?}"),
        );
        let o = tcp_name(&lab.node, to, OK_WAIT);
        t.check(
            &format!("{what} from the node itself: the remote endpoint answers"),
            o.name() == Some("pod-remote"),
            format!("{o:?}"),
        );
        let o = tcp_name(&lab.client, to, Duration::from_secs(2));
        t.check(
            &format!("{what} from outside the cluster: no local endpoint, no answer"),
            o.name().is_none(),
            format!("{o:?}"),
        );
    }

    // A local endpoint appears: outside traffic goes to it only, in-cluster traffic to both.
    lab.write(
        "svc-web",
        &svc(vec![Ep::remote(remote_ip), Ep::local(local_ip)], true).yaml(),
    );
    lab.wait_ipvs(
        &["-a -t 203.0.113.60:80 -r 10.244.1.3:8080 -m -w 1"],
        CONVERGE,
    );
    for (what, to) in dests {
        let outside: Vec<Outcome> = (0..4).map(|_| tcp_name(&lab.client, to, OK_WAIT)).collect();
        t.check(
            &format!("{what} from outside: only the local endpoint"),
            outside.iter().all(|o| o.name() == Some("pod-local")),
            format!("{outside:?}"),
        );
        let inside: BTreeSet<String> = (0..4)
            .filter_map(|_| {
                tcp_name(&lab.pods[cli_pod].ns, to, OK_WAIT)
                    .name()
                    .map(str::to_string)
            })
            .collect();
        t.check(
            &format!("{what} from a pod: both endpoints (round robin)"),
            inside == BTreeSet::from(["pod-local".to_string(), "pod-remote".to_string()]),
            format!("{inside:?}"),
        );
    }

    // Cluster policy: the in-cluster path and its rules go away.
    lab.write(
        "svc-web",
        &svc(vec![Ep::remote(remote_ip), Ep::local(local_ip)], false).yaml(),
    );
    let gone = wait_until(CONVERGE, || !lab.ipvs_save().contains("-A -f "));
    t.check(
        "policy Cluster: the firewall-mark virtual server is removed",
        gone,
        lab.ipvs_save(),
    );
    let nat = lab.node_run(&["iptables-save", "-t", "nat"]);
    t.check(
        "policy Cluster: no mark rules left",
        !nat.contains("-A KUBE-IPVS-IN-CLUSTER-MARK "),
        tail(&nat, 30),
    );
    let o = tcp_name(&lab.client, sa(lb, 80), OK_WAIT);
    t.check(
        "policy Cluster: outside traffic reaches an endpoint",
        o.name().is_some(),
        format!("{o:?}"),
    );
    t.finish();
}
