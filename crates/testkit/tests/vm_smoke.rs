//! VM tests proving the runner: a dummy `kube-ipvs0`, an IPVS service made with `ipvsadm`, every
//! IPVS scheduler loadable, and the IPVS NAT data path to a pod.

use std::net::{Ipv4Addr, SocketAddr};
use testkit::netns::{echo_roundtrip, EchoServer, Netns, Pod};

#[test]
#[ignore = "vm"]
fn vm_kube_ipvs0_dummy_and_ipvsadm_service() {
    let ns = Netns::new("smoke").unwrap();
    ns.ip(&["link", "add", "kube-ipvs0", "type", "dummy"])
        .unwrap();
    ns.ip(&["addr", "add", "10.96.0.10/32", "dev", "kube-ipvs0"])
        .unwrap();
    ns.run(&["ipvsadm", "-A", "-t", "10.96.0.10:80", "-s", "rr"])
        .unwrap();
    ns.run(&[
        "ipvsadm",
        "-a",
        "-t",
        "10.96.0.10:80",
        "-r",
        "10.244.0.5:8080",
        "-m",
        "-w",
        "3",
    ])
    .unwrap();

    let list = ns.run(&["ipvsadm", "-Ln"]).unwrap();
    let lines: Vec<Vec<&str>> = list
        .lines()
        .map(|l| l.split_whitespace().collect())
        .collect();
    assert!(
        lines.contains(&vec!["TCP", "10.96.0.10:80", "rr"]),
        "{list}"
    );
    assert!(
        lines.contains(&vec!["->", "10.244.0.5:8080", "Masq", "3", "0", "0"]),
        "{list}"
    );
    // Cross-check with the kernel's own table (hex addresses) in the same namespace.
    let proc = ns.run(&["cat", "/proc/net/ip_vs"]).unwrap();
    assert!(proc.contains("TCP  0A60000A:0050 rr"), "{proc}");
    let addr = ns.ip(&["-4", "addr", "show", "dev", "kube-ipvs0"]).unwrap();
    assert!(addr.contains("10.96.0.10/32"), "{addr}");
    // IPVS is per namespace: the VM's root namespace does not see the service.
    let root = std::process::Command::new("ipvsadm")
        .arg("-Ln")
        .output()
        .unwrap();
    assert!(!String::from_utf8_lossy(&root.stdout).contains("10.96.0.10:80"));
}

#[test]
#[ignore = "vm"]
fn vm_every_ipvs_scheduler_loads() {
    let ns = Netns::new("sched").unwrap();
    let scheds = [
        "rr", "wrr", "lc", "wlc", "lblc", "lblcr", "dh", "sh", "sed", "nq", "mh", "fo", "ovf",
    ];
    for (i, s) in scheds.iter().enumerate() {
        let vip = format!("10.96.1.{}:80", i + 1);
        ns.run(&["ipvsadm", "-A", "-t", &vip, "-s", s])
            .unwrap_or_else(|e| panic!("scheduler {s}: {e}"));
    }
    let list = ns.run(&["ipvsadm", "-Ln"]).unwrap();
    for (i, s) in scheds.iter().enumerate() {
        let want = vec![
            "TCP".to_string(),
            format!("10.96.1.{}:80", i + 1),
            s.to_string(),
        ];
        assert!(
            list.lines()
                .any(|l| l.split_whitespace().map(str::to_string).collect::<Vec<_>>() == want),
            "{s} missing:\n{list}"
        );
    }
}

/// A ClusterIP on kube-ipvs0 reaches a pod through IPVS NAT (the recipe from the test notes).
#[test]
#[ignore = "vm"]
fn vm_ipvs_nat_reaches_pod_echo_server() {
    let host = Netns::new("nat-host").unwrap();
    host.ip(&["link", "add", "node0", "type", "dummy"]).unwrap();
    host.ip(&["addr", "add", "192.168.0.10/24", "dev", "node0"])
        .unwrap();
    host.ip(&["link", "set", "node0", "up"]).unwrap();
    host.ip(&["route", "add", "default", "via", "192.168.0.1"])
        .unwrap();
    host.sysctl("net.ipv4.ip_forward", "1").unwrap();
    host.sysctl("net.ipv4.vs.conntrack", "1").unwrap();
    host.ip(&["link", "add", "kube-ipvs0", "type", "dummy"])
        .unwrap();
    host.ip(&["addr", "add", "10.96.0.20/32", "dev", "kube-ipvs0"])
        .unwrap();

    let pod = Pod::new(Some(&host), Ipv4Addr::new(10, 244, 0, 7)).unwrap();
    let server = EchoServer::start(&pod.ns, SocketAddr::from((pod.ip, 8080))).unwrap();
    host.run(&["ipvsadm", "-A", "-t", "10.96.0.20:80", "-s", "rr"])
        .unwrap();
    host.run(&[
        "ipvsadm",
        "-a",
        "-t",
        "10.96.0.20:80",
        "-r",
        "10.244.0.7:8080",
        "-m",
    ])
    .unwrap();

    let vip: SocketAddr = "10.96.0.20:80".parse().unwrap();
    let back = echo_roundtrip(&host, vip, b"through ipvs".to_vec()).unwrap();
    assert_eq!(back, b"through ipvs");
    drop(server);
    // Nothing listens on the ClusterIP itself, so only IPVS can have answered; its connection
    // table (entries linger in TIME_WAIT) names the client's connection to the real server.
    // (Byte/connection counters are folded in by the estimator every 2 s, so they are not used.)
    let conns = host.run(&["ipvsadm", "-Lnc"]).unwrap();
    assert!(
        conns
            .lines()
            .any(|l| l.contains("10.96.0.20:80") && l.contains("10.244.0.7:8080")),
        "{conns}"
    );
}
