//! A targeted IPVS repair honours graceful termination on the real kernel (issue #32): in a
//! fresh network namespace of the VM, a client holds a TCP connection through a ClusterIP to
//! pod A; one update moves the Service from A to B and its IPVS batch fails (an injected EBUSY
//! through testkit's fault kernel around the real `NodeKernel`); the repair that follows must
//! drain A (weight 0) and keep the held connection working, not delete A under it.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod fixtures;

use std::collections::BTreeSet;
use std::io::{BufRead, BufReader, Write};
use std::net::{IpAddr, Ipv4Addr, SocketAddr, TcpStream};
use std::time::{Duration, Instant};

use fixtures::*;
use ipvs_netlink::{Protocol, ServiceKey};
use model::event::{Object, SourceEvent};
use proxier::ipvs_mode::{Proxier, RulesConfig};
use proxier::kernel::{Kernel, NodeKernel};
use proxier::retry::Subsystem;
use testkit::faults::{Calls, Fault, FaultKernel, KernelOp, EBUSY};
use testkit::netns::{EchoServer, Netns, Pod};

/// Sends a line on a held connection and reads it back (the connection is alive).
fn ping(conn: &mut BufReader<TcpStream>, msg: &str) -> std::io::Result<()> {
    conn.get_mut().write_all(format!("{msg}\n").as_bytes())?;
    let mut back = String::new();
    conn.read_line(&mut back)?;
    if back.trim() == msg {
        Ok(())
    } else {
        Err(std::io::Error::other(format!("echo mismatch: {back:?}")))
    }
}

#[test]
#[ignore = "vm"]
fn vm_repair_after_a_failed_request_keeps_a_held_connection_draining() {
    let node = Netns::new("vm-grace-repair").unwrap();
    // The node: an address and a default route (proxy ARP to the pods answers only then; the
    // address is also the one MASQUERADE picks), IPVS with conntrack, forwarding, and
    // expire_nodest_conn as the daemon sets it (a deleted real server's connections die).
    node.ip(&["link", "add", "node0", "type", "dummy"]).unwrap();
    node.ip(&["addr", "add", "192.168.0.10/24", "dev", "node0"])
        .unwrap();
    node.ip(&["link", "set", "node0", "up"]).unwrap();
    node.ip(&["route", "add", "default", "via", "192.168.0.1"])
        .unwrap();
    node.sysctl("net.ipv4.ip_forward", "1").unwrap();
    node.sysctl("net.ipv4.vs.conntrack", "1").unwrap();
    node.sysctl("net.ipv4.vs.expire_nodest_conn", "1").unwrap();
    let pod_a = Pod::new(Some(&node), Ipv4Addr::new(10, 244, 1, 1)).unwrap();
    let pod_b = Pod::new(Some(&node), Ipv4Addr::new(10, 244, 1, 2)).unwrap();
    let port = 8080;
    let _echo_a = EchoServer::start(&pod_a.ns, SocketAddr::from((pod_a.ip, port))).unwrap();
    let _echo_b = EchoServer::start(&pod_b.ns, SocketAddr::from((pod_b.ip, port))).unwrap();

    let outcome = node.enter(move || {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()?;
        let ipvs = ipvs_netlink::Client::new().unwrap();
        let netif = rt.block_on(netif::Netif::new()).unwrap();
        let ipset = ipset::Ipset::new(ipset::Runner::new());
        let tables =
            iptables::Iptables::detect(ipvs_netlink::Family::Inet, iptables::Runner::new())
                .unwrap();
        let real = NodeKernel::new(ipvs, netif, ipset, tables, rt.handle().clone());
        let (mut k, faults) = FaultKernel::new(real);
        let web = |ep: &str| {
            slice("default", "web", "web-1")
                .port("http", 8080, "TCP")
                .ep(ep, "node-b", C::Ready)
                .build()
        };
        let mut store = synced_store(
            vec![svc("default", "web", "10.96.0.10")
                .port("http", 80, "TCP")
                .build()],
            vec![web("10.244.1.1")],
        );
        let addrs: BTreeSet<IpAddr> = [ip("192.168.0.10")].into_iter().collect();
        let mut p = Proxier::new(cfg4(), RulesConfig::default(), NODE);
        let r = p.sync(&store, &addrs, &mut k);
        assert!(r.healthy(), "first sync: {:?}", r.errors);

        // A held connection through the ClusterIP, to pod A (its only endpoint).
        let vip = SocketAddr::from(([10, 96, 0, 10], 80));
        let conn = TcpStream::connect_timeout(&vip, Duration::from_secs(10))?;
        conn.set_read_timeout(Some(Duration::from_secs(10)))?;
        let mut conn = BufReader::new(conn);
        ping(&mut conn, "before")?;

        // One update moves the Service to pod B; its IPVS batch fails as a whole.
        faults.inject(Fault::errno(KernelOp::ApplyIpvs, EBUSY, Calls::Nth(1)));
        let ch = store.apply(SourceEvent::Apply(Object::from(web("10.244.1.2"))));
        p.note(&ch);
        let t0 = Instant::now();
        let r = p.sync_at(t0, &store, &addrs, &mut k);
        let first_failed: Vec<Subsystem> = r.failed.keys().copied().collect();
        // The repair, when its backoff is due.
        let due = p
            .retry_due_of(Subsystem::Ipvs)
            .expect("a repair is scheduled");
        let r = p.sync_at(due, &store, &addrs, &mut k);
        let repair_errors = r.errors.clone();
        let key = ServiceKey::Inet {
            protocol: Protocol::Tcp,
            addr: ip("10.96.0.10"),
            port: 80,
        };
        let table = k.read_ipvs_keys(&[key].into_iter().collect()).unwrap();
        let reals = table.get(&key).map(|vs| vs.real_servers.clone());
        let a = reals
            .as_ref()
            .and_then(|r| r.get(&(ip("10.244.1.1"), port)));
        let b = reals
            .as_ref()
            .and_then(|r| r.get(&(ip("10.244.1.2"), port)));
        let held = ping(&mut conn, "after the repair");
        // A new connection goes to B (A takes no new connections at weight 0).
        let fresh = TcpStream::connect_timeout(&vip, Duration::from_secs(10)).and_then(|s| {
            s.set_read_timeout(Some(Duration::from_secs(10)))?;
            let mut s = BufReader::new(s);
            ping(&mut s, "fresh")
        });
        Ok((
            first_failed,
            repair_errors,
            a.map(|d| (d.weight, d.active_conns)),
            b.map(|d| d.weight),
            held.map_err(|e| e.to_string()),
            fresh.map_err(|e| e.to_string()),
            p.draining(),
        ))
    });
    let (first_failed, repair_errors, a, b, held, fresh, draining) = outcome.unwrap();
    println!("first sync failed: {first_failed:?}; repair errors: {repair_errors:?}");
    println!("A (weight, active): {a:?}; B weight: {b:?}; draining: {draining}");
    assert_eq!(first_failed, [Subsystem::Ipvs]);
    assert!(repair_errors.is_empty(), "{repair_errors:?}");
    assert_eq!(
        a,
        Some((0, 1)),
        "pod A must drain at weight 0 with its live connection, not be deleted"
    );
    assert_eq!(b, Some(1));
    assert_eq!(draining, 1);
    held.expect("the held connection survives the repair");
    fresh.expect("a new connection reaches pod B");
}
