//! ipset against the real kernel: natively in a fresh network namespace (`netns_*`, root) and in
//! the test VM (`vm_*`). Every check is cross-checked with the `ipset` program's own output.

// Helpers shared by the tests below are test code too.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::net::{IpAddr, Ipv4Addr};

use ipset::{diff, Entry, Family, Ipset, IpsetState, Protocol, Runner, SetKind, SetType};
use testkit::netns::Netns;

/// The ipset applier working inside `ns`.
fn ipset_in(ns: &Netns) -> Ipset {
    Ipset::new(Runner::in_netns(ns.name()))
}

/// `create NAME TYPE …` headers and sorted `add` lines as the ipset program prints them.
fn save_of(ns: &Netns, set: &str) -> (String, Vec<String>) {
    let text = ns.sh(&format!("ipset save {set}")).unwrap();
    let mut header = String::new();
    let mut adds = Vec::new();
    for l in text.lines() {
        if l.starts_with("create ") {
            header = l.to_string();
        } else if l.starts_with("add ") {
            adds.push(l.to_string());
        }
    }
    adds.sort();
    (header, adds)
}

fn ip4(n: u32) -> IpAddr {
    IpAddr::V4(Ipv4Addr::from(0x0a60_0000 + n))
}

// ---------------------------------------------------------------- shared bodies

fn all_17_sets_created(ns: &Netns) {
    let ipset = ipset_in(ns);
    for fam in [Family::V4, Family::V6] {
        let owned = SetKind::all_names(fam);
        let want = IpsetState::kube(fam);
        let d = diff(&want, &ipset.read(&owned).unwrap());
        assert_eq!(d.creates.len(), 17);
        let before = ipset.processes_spawned();
        let rep = ipset.apply(&d).unwrap();
        assert!(rep.rejected.is_empty(), "{:?}", rep.rejected);
        assert_eq!(ipset.processes_spawned() - before, 1);
        // a second round finds nothing to do and runs nothing
        let d2 = diff(&want, &ipset.read(&owned).unwrap());
        assert!(d2.is_empty(), "{d2:?}");
        let before = ipset.processes_spawned();
        ipset.apply(&d2).unwrap();
        assert_eq!(ipset.processes_spawned(), before);
    }
    // Cross-check names, types and families with `ipset list -t`.
    let list = ns.sh("ipset list -t").unwrap();
    let mut seen = 0;
    for block in list.split("Name: ").skip(1) {
        let name = block.lines().next().unwrap().trim();
        let ty = block
            .lines()
            .find_map(|l| l.strip_prefix("Type: "))
            .unwrap()
            .trim();
        let header = block
            .lines()
            .find_map(|l| l.strip_prefix("Header: "))
            .unwrap();
        let (kind, fam) = SetKind::from_name(name).unwrap();
        assert_eq!(ty, kind.set_type().as_str(), "{name}");
        assert!(header.contains("comment"), "{name}: {header}");
        if kind.set_type() == SetType::BitmapPort {
            assert!(header.contains("range 0-65535"), "{name}: {header}");
        } else {
            assert!(
                header.contains(&format!("family {} ", fam.as_str())),
                "{name}: {header}"
            );
        }
        seen += 1;
    }
    assert_eq!(seen, 34);
}

fn ten_thousand_entries_in_one_batch(ns: &Netns) {
    let ipset = ipset_in(ns);
    let owned = SetKind::all_names(Family::V4);
    let mut want = IpsetState::kube(Family::V4);
    for i in 0..10_000u32 {
        want.add(
            SetKind::ClusterIp,
            Family::V4,
            Entry::ip_port(ip4(i / 4), Protocol::Tcp, 80 + (i % 4) as u16),
            &format!("ns/svc-{}:p{}", i / 4, i % 4),
        )
        .unwrap();
    }
    let d = diff(&want, &ipset.read(&owned).unwrap());
    assert_eq!(d.adds.len(), 10_000);
    let before = ipset.processes_spawned();
    let rep = ipset.apply(&d).unwrap();
    assert!(rep.rejected.is_empty());
    assert_eq!(rep.processes, 1);
    assert_eq!(ipset.processes_spawned() - before, 1);

    let expect = |st: &IpsetState| {
        let mut v: Vec<String> = st
            .get("KUBE-CLUSTER-IP")
            .unwrap()
            .entries
            .keys()
            .map(|e| format!("add KUBE-CLUSTER-IP {e}"))
            .collect();
        v.sort();
        v
    };
    let (header, adds) = save_of(ns, "KUBE-CLUSTER-IP");
    assert!(header.starts_with("create KUBE-CLUSTER-IP hash:ip,port family inet"));
    assert_eq!(adds.len(), 10_000);
    assert_eq!(adds, expect(&want));

    // Change half of it: 5,000 removed, 5,000 new, still one process.
    let mut want2 = IpsetState::kube(Family::V4);
    for i in 5_000..15_000u32 {
        want2
            .add(
                SetKind::ClusterIp,
                Family::V4,
                Entry::ip_port(ip4(i / 4), Protocol::Tcp, 80 + (i % 4) as u16),
                "x",
            )
            .unwrap();
    }
    let d = diff(&want2, &ipset.read(&owned).unwrap());
    assert_eq!((d.adds.len(), d.dels.len()), (5_000, 5_000));
    let rep = ipset.apply(&d).unwrap();
    assert_eq!(rep.processes, 1);
    let (_, adds) = save_of(ns, "KUBE-CLUSTER-IP");
    assert_eq!(adds, expect(&want2));
    assert!(diff(&want2, &ipset.read(&owned).unwrap()).is_empty());
}

fn wrong_type_fixed_and_foreign_sets_untouched(ns: &Netns) {
    ns.sh(
        "ipset create KUBE-CLUSTER-IP hash:ip && ipset add KUBE-CLUSTER-IP 10.96.0.1 && \
         ipset create KUBE-NODE-PORT-TCP bitmap:port range 0-65535 && \
         ipset add KUBE-NODE-PORT-TCP 31000 && \
         ipset create SOMEONE-ELSE hash:ip && ipset add SOMEONE-ELSE 192.0.2.1",
    )
    .unwrap();
    let ipset = ipset_in(ns);
    let owned = SetKind::all_names(Family::V4);
    let mut want = IpsetState::kube(Family::V4);
    want.add(
        SetKind::ClusterIp,
        Family::V4,
        Entry::ip_port(ip4(1), Protocol::Tcp, 443),
        "default/kubernetes:https",
    )
    .unwrap();
    want.add(SetKind::NodePortTcp, Family::V4, Entry::Port(30080), "a")
        .unwrap();
    let current = ipset.read(&owned).unwrap();
    assert!(current.get("SOMEONE-ELSE").is_none());
    let d = diff(&want, &current);
    assert_eq!(d.recreates.len(), 1);
    assert_eq!(d.creates.len(), 15);
    let rep = ipset.apply(&d).unwrap();
    assert!(rep.rejected.is_empty(), "{:?}", rep.rejected);
    let (h, adds) = save_of(ns, "KUBE-CLUSTER-IP");
    assert!(h.contains(" hash:ip,port "), "{h}");
    assert_eq!(adds, vec!["add KUBE-CLUSTER-IP 10.96.0.1,tcp:443"]);
    let (_, adds) = save_of(ns, "KUBE-NODE-PORT-TCP");
    assert_eq!(adds, vec!["add KUBE-NODE-PORT-TCP 30080"]);
    let (h, adds) = save_of(ns, "SOMEONE-ELSE");
    assert!(h.contains("hash:ip"));
    assert_eq!(adds, vec!["add SOMEONE-ELSE 192.0.2.1"]);

    // Cleanup: diff against nothing, limited to owned sets.
    let d = diff(&IpsetState::new(), &ipset.read(&owned).unwrap());
    assert_eq!(d.destroys.len(), 17);
    ipset.apply(&d).unwrap();
    let names = ns.sh("ipset list -n").unwrap();
    assert_eq!(names.trim(), "SOMEONE-ELSE");
}

fn rejected_entry_reported_rest_applied(ns: &Netns) {
    let ipset = ipset_in(ns);
    let owned = SetKind::all_names(Family::V4);
    let mut want = IpsetState::kube(Family::V4);
    let lb = ip4(100);
    for (i, cidr) in ["10.0.0.0/8", "0.0.0.0/0", "192.168.0.0/16"]
        .iter()
        .enumerate()
    {
        want.add(
            SetKind::LoadBalancerSourceCidr,
            Family::V4,
            Entry::ip_port_net(lb, Protocol::Tcp, 80, cidr.parse().unwrap()),
            &format!("default/lb-{i}:http"),
        )
        .unwrap();
    }
    for p in [30001u16, 30002] {
        want.add(SetKind::NodePortTcp, Family::V4, Entry::Port(p), "n")
            .unwrap();
    }
    let rep = ipset
        .apply(&diff(&want, &ipset.read(&owned).unwrap()))
        .unwrap();
    assert_eq!(rep.rejected.len(), 1, "{:?}", rep.rejected);
    let r = &rep.rejected[0];
    assert_eq!(r.owner, "default/lb-1:http");
    assert_eq!(r.set, "KUBE-LOAD-BALANCER-SOURCE-CIDR");
    assert_eq!(
        r.line,
        "add KUBE-LOAD-BALANCER-SOURCE-CIDR 10.96.0.100,tcp:80,0.0.0.0/0"
    );
    assert!(r.message.contains("CIDR"), "{}", r.message);
    assert_eq!(rep.processes, 2);
    let (_, adds) = save_of(ns, "KUBE-LOAD-BALANCER-SOURCE-CIDR");
    assert_eq!(
        adds,
        vec![
            "add KUBE-LOAD-BALANCER-SOURCE-CIDR 10.96.0.100,tcp:80,10.0.0.0/8",
            "add KUBE-LOAD-BALANCER-SOURCE-CIDR 10.96.0.100,tcp:80,192.168.0.0/16",
        ]
    );
    let (_, adds) = save_of(ns, "KUBE-NODE-PORT-TCP");
    assert_eq!(adds.len(), 2);
}

fn wrong_type_set_in_use_is_reported(ns: &Netns) {
    ns.sh("ipset create KUBE-CLUSTER-IP hash:ip && \
         iptables -w -A INPUT -m set --match-set KUBE-CLUSTER-IP dst -j ACCEPT")
        .unwrap();
    let ipset = ipset_in(ns);
    let mut want = IpsetState::new();
    want.add(
        SetKind::ClusterIp,
        Family::V4,
        Entry::ip_port(ip4(1), Protocol::Udp, 53),
        "kube-system/dns:dns",
    )
    .unwrap();
    want.add(SetKind::NodePortUdp, Family::V4, Entry::Port(30053), "k")
        .unwrap();
    let owned = SetKind::all_names(Family::V4);
    let rep = ipset
        .apply(&diff(&want, &ipset.read(&owned).unwrap()))
        .unwrap();
    assert_eq!(rep.rejected.len(), 1, "{:?}", rep.rejected);
    let r = &rep.rejected[0];
    assert_eq!(r.set, "KUBE-CLUSTER-IP");
    assert_eq!(r.line, "destroy KUBE-CLUSTER-IP");
    assert!(r.message.contains("in use"), "{}", r.message);
    assert_eq!(r.skipped, 2, "create + add of the set were dropped too");
    // the other set went in; the referenced set kept its type
    assert_eq!(save_of(ns, "KUBE-NODE-PORT-UDP").1.len(), 1);
    assert!(save_of(ns, "KUBE-CLUSTER-IP").0.contains(" hash:ip "));
}

// ---------------------------------------------------------------- native (netns)

#[test]
#[ignore = "netns"]
fn netns_all_17_sets_created_with_right_types() {
    all_17_sets_created(&Netns::new("types").unwrap());
}

#[test]
#[ignore = "netns"]
fn netns_ten_thousand_entries_in_one_batch() {
    ten_thousand_entries_in_one_batch(&Netns::new("10k").unwrap());
}

#[test]
#[ignore = "netns"]
fn netns_wrong_type_fixed_and_foreign_sets_untouched() {
    wrong_type_fixed_and_foreign_sets_untouched(&Netns::new("fix").unwrap());
}

#[test]
#[ignore = "netns"]
fn netns_rejected_entry_reported_rest_applied() {
    rejected_entry_reported_rest_applied(&Netns::new("reject").unwrap());
}

#[test]
#[ignore = "netns"]
fn netns_wrong_type_set_in_use_is_reported() {
    wrong_type_set_in_use_is_reported(&Netns::new("inuse").unwrap());
}

#[test]
#[ignore = "netns"]
fn netns_missing_binary_inside_namespace_is_a_clear_error() {
    let ns = Netns::new("nobin").unwrap();
    let ipset = Ipset::new(Runner {
        ipset: "/nonexistent/ipset".into(),
        netns: Some(ns.name().to_string()),
    });
    let err = ipset.read(&[]).unwrap_err();
    assert!(matches!(err, ipset::Error::MissingBinary { .. }), "{err}");
    assert!(err.to_string().contains("/nonexistent/ipset"), "{err}");
}

// ---------------------------------------------------------------- VM (6.1 kernel, modules)

#[test]
#[ignore = "vm"]
fn vm_all_17_sets_created_with_right_types() {
    all_17_sets_created(&Netns::new("types").unwrap());
}

#[test]
#[ignore = "vm"]
fn vm_ten_thousand_entries_in_one_batch() {
    ten_thousand_entries_in_one_batch(&Netns::new("10k").unwrap());
}

#[test]
#[ignore = "vm"]
fn vm_wrong_type_fixed_and_foreign_sets_untouched() {
    wrong_type_fixed_and_foreign_sets_untouched(&Netns::new("fix").unwrap());
}

#[test]
#[ignore = "vm"]
fn vm_rejected_entry_reported_rest_applied() {
    rejected_entry_reported_rest_applied(&Netns::new("reject").unwrap());
}
