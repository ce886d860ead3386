//! Host-privileged tests (root + network namespaces) of the netns helpers: a TCP byte stream
//! over a veth pair, pods behind proxy ARP, and namespace clean-up.

use std::net::{Ipv4Addr, SocketAddr};
use testkit::netns::{echo_roundtrip, veth_pair, EchoServer, Netns, Pod};

/// Deterministic pseudo-random bytes (xorshift), so corruption cannot go unnoticed.
fn payload(len: usize, mut seed: u64) -> Vec<u8> {
    (0..len)
        .map(|_| {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            (seed >> 24) as u8
        })
        .collect()
}

#[test]
#[ignore = "netns"]
fn netns_veth_tcp_byte_stream() {
    let a = Netns::new("veth-a").unwrap();
    let b = Netns::new("veth-b").unwrap();
    veth_pair(&a, "va", &b, "vb").unwrap();
    a.ip(&["addr", "add", "10.250.0.1/30", "dev", "va"])
        .unwrap();
    b.ip(&["addr", "add", "10.250.0.2/30", "dev", "vb"])
        .unwrap();

    let server = EchoServer::start(&a, "10.250.0.1:0".parse().unwrap()).unwrap();
    let (rx0, tx0) = b.link_stats("vb").unwrap();
    let data = payload(4 << 20, 0x9e37_79b9_7f4a_7c15);
    let back = echo_roundtrip(&b, server.addr, data.clone()).unwrap();
    assert_eq!(back.len(), data.len());
    assert!(back == data, "echoed stream differs from what was sent");

    // The bytes really crossed the veth: both directions carried at least the payload.
    let (rx1, tx1) = b.link_stats("vb").unwrap();
    assert!(tx1 - tx0 >= data.len() as u64, "tx grew by {}", tx1 - tx0);
    assert!(rx1 - rx0 >= data.len() as u64, "rx grew by {}", rx1 - rx0);
    // And the server is invisible from the root namespace's point of view: the address lives in `a`.
    let addrs = a.ip(&["-4", "addr", "show", "dev", "va"]).unwrap();
    assert!(addrs.contains("10.250.0.1/30"), "{addrs}");
}

#[test]
#[ignore = "netns"]
fn netns_without_link_cannot_connect() {
    let a = Netns::new("nolink-a").unwrap();
    let b = Netns::new("nolink-b").unwrap();
    a.ip(&["addr", "add", "10.250.1.1/32", "dev", "lo"])
        .unwrap();
    let server = EchoServer::start(&a, "10.250.1.1:0".parse().unwrap()).unwrap();
    let err = echo_roundtrip(&b, server.addr, b"hello".to_vec()).unwrap_err();
    assert_eq!(err.kind(), std::io::ErrorKind::NetworkUnreachable, "{err}");
    // Inside `a` the same server answers.
    assert_eq!(
        echo_roundtrip(&a, server.addr, b"hello".to_vec()).unwrap(),
        b"hello"
    );
}

#[test]
#[ignore = "netns"]
fn netns_dropped_namespace_is_deleted() {
    let ns = Netns::new("drop").unwrap();
    let name = ns.name().to_string();
    assert!(ns.path().exists());
    let listed = testkit::netns::ip(&["netns", "list"]).unwrap();
    assert!(listed.contains(&name), "{listed}");
    drop(ns);
    let listed = testkit::netns::ip(&["netns", "list"]).unwrap();
    assert!(!listed.contains(&name), "{name} still listed: {listed}");
    assert!(!std::path::Path::new("/run/netns").join(&name).exists());
}

#[test]
#[ignore = "netns"]
fn netns_pods_talk_through_host_with_proxy_arp() {
    let host = Netns::new("podhost").unwrap();
    let _uplink = Pod::uplink(&host).unwrap();
    host.sysctl("net.ipv4.ip_forward", "1").unwrap();
    let p1 = Pod::new(Some(&host), Ipv4Addr::new(10, 244, 1, 2)).unwrap();
    let p2 = Pod::new(Some(&host), Ipv4Addr::new(10, 244, 1, 3)).unwrap();
    let server = EchoServer::start(&p2.ns, SocketAddr::from((p2.ip, 0))).unwrap();
    let (_, host_tx0) = host.link_stats(&p2.host_if).unwrap();
    let data = payload(256 << 10, 7);
    let back = echo_roundtrip(&p1.ns, server.addr, data.clone()).unwrap();
    assert!(back == data, "echo differs");
    let (_, host_tx1) = host.link_stats(&p2.host_if).unwrap();
    assert!(
        host_tx1 - host_tx0 >= data.len() as u64,
        "traffic did not go via the host"
    );
    let routes = p1.ns.ip(&["route", "show", "default"]).unwrap();
    assert!(routes.contains("via 169.254.1.1"), "{routes}");
}
