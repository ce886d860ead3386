//! ipset against the real kernel: natively in a fresh network namespace (`netns_*`, root) and in
//! the test VM (`vm_*`). Every check is cross-checked with the `ipset` program's own output.

// Helpers shared by the tests below are test code too.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::net::{IpAddr, Ipv4Addr};

use ipset::{
    diff, Entry, EntryChange, Family, Ipset, IpsetDiff, IpsetState, Protocol, Runner, SetKind,
    SetType,
};
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
    for fam in [Family::Inet, Family::Inet6] {
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

/// `ipset restore` (netlink off: the fallback path) takes 10,000 members in one process.
fn ten_thousand_entries_in_one_batch(ns: &Netns) {
    let ipset = ipset_in(ns).with_netlink_threshold(0);
    let owned = SetKind::all_names(Family::Inet);
    let mut want = IpsetState::kube(Family::Inet);
    for i in 0..10_000u32 {
        want.add(
            SetKind::ClusterIp,
            Family::Inet,
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
    let mut want2 = IpsetState::kube(Family::Inet);
    for i in 5_000..15_000u32 {
        want2
            .add(
                SetKind::ClusterIp,
                Family::Inet,
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

/// The default applier: a first load creates the sets with one `ipset restore` and sends its
/// 10,000 members as netlink requests; a change of half of them is requests only.
fn ten_thousand_members_over_netlink(ns: &Netns) {
    let ipset = ipset_in(ns);
    let owned = SetKind::all_names(Family::Inet);
    let fill = |from: u32, to: u32| {
        let mut st = IpsetState::kube(Family::Inet);
        for i in from..to {
            st.add(
                SetKind::ClusterIp,
                Family::Inet,
                Entry::ip_port(ip4(i / 4), Protocol::Tcp, 80 + (i % 4) as u16),
                "x",
            )
            .unwrap();
        }
        st
    };
    let want = fill(0, 10_000);
    let d = diff(&want, &ipset.read(&owned).unwrap());
    assert_eq!(d.adds.len(), 10_000);
    assert!(!d.creates.is_empty());
    let (p0, r0) = (ipset.processes_spawned(), ipset.netlink_requests());
    let rep = ipset.apply(&d).unwrap();
    assert!(rep.rejected.is_empty(), "{:?}", rep.rejected);
    assert_eq!((rep.processes, rep.requests), (1, 10_000));
    assert_eq!(
        ipset.processes_spawned() - p0,
        1,
        "one restore creates the sets"
    );
    assert!(ipset.netlink_requests() - r0 >= 10_000);
    assert_eq!(saved_members(ns, Family::Inet), expected_members(&want));

    let want2 = fill(5_000, 15_000);
    let d = diff(&want2, &ipset.read(&owned).unwrap());
    assert_eq!(
        (d.adds.len(), d.dels.len(), d.creates.len()),
        (5_000, 5_000, 0)
    );
    let rep = ipset.apply(&d).unwrap();
    assert!(rep.rejected.is_empty(), "{:?}", rep.rejected);
    assert_eq!((rep.processes, rep.requests), (0, 10_000));
    assert_eq!(saved_members(ns, Family::Inet), expected_members(&want2));
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
    let owned = SetKind::all_names(Family::Inet);
    let mut want = IpsetState::kube(Family::Inet);
    want.add(
        SetKind::ClusterIp,
        Family::Inet,
        Entry::ip_port(ip4(1), Protocol::Tcp, 443),
        "default/kubernetes:https",
    )
    .unwrap();
    want.add(SetKind::NodePortTcp, Family::Inet, Entry::Port(30080), "a")
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

/// A member the kernel refuses is reported with its owner and the rest lands: over netlink (the
/// sets' creation is the one process) and, with netlink off, by `ipset restore` (a second
/// process retries without the rejected line).
fn rejected_entry_reported_rest_applied(ns: &Netns) {
    rejected_entry_reported_rest_applied_by(ns, ipset_in(ns), 1);
    let off = Netns::new(&format!("{}r", ns.name())).unwrap();
    rejected_entry_reported_rest_applied_by(&off, ipset_in(&off).with_netlink_threshold(0), 2);
}

fn rejected_entry_reported_rest_applied_by(ns: &Netns, ipset: Ipset, processes: u64) {
    let owned = SetKind::all_names(Family::Inet);
    let mut want = IpsetState::kube(Family::Inet);
    let lb = ip4(100);
    for (i, cidr) in ["10.0.0.0/8", "0.0.0.0/0", "192.168.0.0/16"]
        .iter()
        .enumerate()
    {
        want.add(
            SetKind::LoadBalancerSourceCidr,
            Family::Inet,
            Entry::ip_port_net(lb, Protocol::Tcp, 80, cidr.parse().unwrap()),
            &format!("default/lb-{i}:http"),
        )
        .unwrap();
    }
    for p in [30001u16, 30002] {
        want.add(SetKind::NodePortTcp, Family::Inet, Entry::Port(p), "n")
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
    assert_eq!(rep.processes, processes);
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
        Family::Inet,
        Entry::ip_port(ip4(1), Protocol::Udp, 53),
        "kube-system/dns:dns",
    )
    .unwrap();
    want.add(SetKind::NodePortUdp, Family::Inet, Entry::Port(30053), "k")
        .unwrap();
    let owned = SetKind::all_names(Family::Inet);
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

/// The 17 sets of both families, created with one restore each.
fn create_all(ipset: &Ipset) {
    for fam in [Family::Inet, Family::Inet6] {
        let owned = SetKind::all_names(fam);
        let d = diff(&IpsetState::kube(fam), &ipset.read(&owned).unwrap());
        let rep = ipset.apply(&d).unwrap();
        assert!(rep.rejected.is_empty(), "{:?}", rep.rejected);
        assert_eq!(
            (rep.processes, rep.requests),
            (1, 0),
            "creates go through restore"
        );
    }
}

fn ip(s: &str) -> IpAddr {
    s.parse().unwrap()
}

/// Two members for every one of the 17 sets of `fam` (every set type, networks and hosts).
fn members(fam: Family) -> IpsetState {
    let mut st = IpsetState::kube(fam);
    let (a, b, c) = match fam {
        Family::Inet => (ip("10.96.0.1"), ip("10.244.1.5"), "10.1.2.3/8"),
        Family::Inet6 => (ip("fd00::1"), ip("fd00:244::5"), "fd00:1:2::3/48"),
    };
    for k in SetKind::ALL {
        let (e1, e2) = match k.set_type() {
            SetType::HashIp => (Entry::Ip(a), Entry::Ip(b)),
            SetType::HashIpPort => (
                Entry::ip_port(a, Protocol::Tcp, 80),
                Entry::ip_port(b, Protocol::Sctp, 9),
            ),
            SetType::HashIpPortIp => (
                Entry::ip_port_ip(b, Protocol::Tcp, 8080, b),
                Entry::ip_port_ip(b, Protocol::Udp, 53, a),
            ),
            SetType::HashIpPortNet => (
                Entry::ip_port_net(a, Protocol::Tcp, 80, c.parse().unwrap()),
                Entry::ip_port_net(a, Protocol::Udp, 80, ipnet::IpNet::from(b)),
            ),
            SetType::BitmapPort => (Entry::Port(30080), Entry::Port(80)),
        };
        st.add(k, fam, e1, &format!("{k:?}/1")).unwrap();
        st.add(k, fam, e2, &format!("{k:?}/2")).unwrap();
    }
    st
}

/// `add NAME MEMBER` lines of every owned set of `fam`, as `ipset save` prints them, sorted.
fn saved_members(ns: &Netns, fam: Family) -> Vec<String> {
    let mut v = Vec::new();
    for name in SetKind::all_names(fam) {
        v.extend(save_of(ns, &name).1);
    }
    v.sort();
    v
}

fn expected_members(st: &IpsetState) -> Vec<String> {
    let mut v: Vec<String> = st
        .sets()
        .flat_map(|(n, s)| s.entries.keys().map(move |e| format!("add {n} {e}")))
        .collect();
    v.sort();
    v
}

fn netlink_adds_and_deletes_every_type(ns: &Netns) {
    let ipset = ipset_in(ns);
    create_all(&ipset);
    for fam in [Family::Inet, Family::Inet6] {
        let owned = SetKind::all_names(fam);
        let want = members(fam);
        let d = diff(&want, &ipset.read(&owned).unwrap());
        assert_eq!((d.adds.len(), d.creates.len()), (34, 0));
        assert!(ipset.uses_netlink(&d));
        let (p0, r0) = (ipset.processes_spawned(), ipset.netlink_requests());
        let rep = ipset.apply(&d).unwrap();
        assert!(rep.rejected.is_empty(), "{fam:?}: {:?}", rep.rejected);
        assert_eq!((rep.processes, rep.requests), (0, 34), "{fam:?}");
        assert_eq!(
            ipset.processes_spawned(),
            p0,
            "no process on the netlink path"
        );
        assert!(ipset.netlink_requests() - r0 >= 34);
        // The ipset program sees exactly the desired members.
        assert_eq!(saved_members(ns, fam), expected_members(&want), "{fam:?}");
        assert!(diff(&want, &ipset.read(&owned).unwrap()).is_empty());

        // -exist semantics: adding present members and deleting absent ones succeed.
        let again = IpsetDiff {
            adds: d.adds.clone(),
            dels: vec![EntryChange {
                set: SetKind::IpvsIps.name(fam).into(),
                entry: Entry::Ip(match fam {
                    Family::Inet => ip("192.0.2.99"),
                    Family::Inet6 => ip("2001:db8::99"),
                }),
                owner: "gone".into(),
            }],
            ..IpsetDiff::default()
        };
        let rep = ipset.apply(&again).unwrap();
        assert!(rep.rejected.is_empty(), "{:?}", rep.rejected);
        assert_eq!((rep.processes, rep.requests), (0, 35));
        assert_eq!(saved_members(ns, fam), expected_members(&want));

        // Delete half of them (one member per set) over netlink.
        let mut half = IpsetState::kube(fam);
        for (name, set) in want.sets() {
            if let Some((e, o)) = set.entries.iter().next() {
                half.insert(name, e.clone(), o).unwrap();
            }
        }
        let d = diff(&half, &ipset.read(&owned).unwrap());
        assert_eq!((d.dels.len(), d.adds.len()), (17, 0));
        let rep = ipset.apply(&d).unwrap();
        assert!(rep.rejected.is_empty(), "{:?}", rep.rejected);
        assert_eq!((rep.processes, rep.requests), (0, 17));
        assert_eq!(saved_members(ns, fam), expected_members(&half), "{fam:?}");
        // ... and the rest.
        let d = diff(&IpsetState::kube(fam), &ipset.read(&owned).unwrap());
        let rep = ipset.apply(&d).unwrap();
        assert_eq!((rep.processes, rep.requests), (0, 17));
        assert!(saved_members(ns, fam).is_empty());
    }
    // The sets themselves are untouched: still 34, with their types.
    assert_eq!(ns.sh("ipset list -n").unwrap().lines().count(), 34);
}

fn netlink_rejects_one_member_rest_lands(ns: &Netns) {
    let ipset = ipset_in(ns);
    create_all(&ipset);
    let change = |set: &str, entry: Entry, owner: &str| EntryChange {
        set: set.into(),
        entry,
        owner: owner.into(),
    };
    let d = IpsetDiff {
        adds: vec![
            change(
                "KUBE-CLUSTER-IP",
                Entry::ip_port(ip("10.96.0.10"), Protocol::Udp, 53),
                "kube-system/dns:dns",
            ),
            // IPv6 member in the IPv4 set
            change(
                "KUBE-CLUSTER-IP",
                Entry::ip_port(ip("fd00::10"), Protocol::Tcp, 80),
                "default/v6:http",
            ),
            // a /0 source range: the kernel refuses CIDR 0
            change(
                "KUBE-LOAD-BALANCER-SOURCE-CIDR",
                Entry::ip_port_net(
                    ip("10.96.0.100"),
                    Protocol::Tcp,
                    80,
                    "0.0.0.0/0".parse().unwrap(),
                ),
                "default/lb:http",
            ),
            // a member of the wrong kind for the set
            change(
                "KUBE-NODE-PORT-TCP",
                Entry::Ip(ip("10.0.0.1")),
                "default/np:x",
            ),
            // a set that does not exist
            change("KUBE-NOPE", Entry::Ip(ip("10.0.0.2")), "default/nope:x"),
            change("KUBE-NODE-PORT-TCP", Entry::Port(30053), "default/np:y"),
            change("KUBE-6-IPVS-IPS", Entry::Ip(ip("fd00::1")), "default/v6ok"),
        ],
        ..IpsetDiff::default()
    };
    assert!(ipset.uses_netlink(&d));
    let p0 = ipset.processes_spawned();
    let rep = ipset.apply(&d).unwrap();
    assert_eq!(ipset.processes_spawned(), p0);
    assert_eq!(rep.processes, 0);
    for r in &rep.rejected {
        eprintln!("rejected: {} ({}): {}", r.line, r.owner, r.message);
    }
    let owners: Vec<&str> = rep.rejected.iter().map(|r| r.owner.as_str()).collect();
    assert_eq!(
        owners,
        vec![
            "default/v6:http",
            "default/lb:http",
            "default/np:x",
            "default/nope:x"
        ],
        "{:?}",
        rep.rejected
    );
    let r = &rep.rejected[0];
    assert_eq!(r.set, "KUBE-CLUSTER-IP");
    assert_eq!(r.line, "add KUBE-CLUSTER-IP fd00::10,tcp:80");
    assert_eq!(
        r.entry,
        Some(Entry::ip_port(ip("fd00::10"), Protocol::Tcp, 80))
    );
    assert!(
        rep.rejected[1].message.contains("CIDR"),
        "{}",
        rep.rejected[1].message
    );
    assert!(
        rep.rejected[3].message.contains("does not exist"),
        "{}",
        rep.rejected[3].message
    );
    for r in &rep.rejected {
        assert!(!r.message.is_empty() && r.skipped == 0, "{r:?}");
    }
    // Everything else landed.
    assert_eq!(
        save_of(ns, "KUBE-CLUSTER-IP").1,
        vec!["add KUBE-CLUSTER-IP 10.96.0.10,udp:53"]
    );
    assert_eq!(
        save_of(ns, "KUBE-NODE-PORT-TCP").1,
        vec!["add KUBE-NODE-PORT-TCP 30053"]
    );
    assert_eq!(
        save_of(ns, "KUBE-6-IPVS-IPS").1,
        vec!["add KUBE-6-IPVS-IPS fd00::1"]
    );
    assert!(save_of(ns, "KUBE-LOAD-BALANCER-SOURCE-CIDR").1.is_empty());
}

/// With a member threshold (256 here; the default has none): bigger diffs and diffs that destroy
/// a set are one `ipset restore`; a diff that creates a set is one restore for the set and
/// requests for the members.
fn large_or_structural_diffs_use_restore(ns: &Netns) {
    let ipset = ipset_in(ns).with_netlink_threshold(256);
    create_all(&ipset);
    let owned = SetKind::all_names(Family::Inet);
    let fill = |n: u32| {
        let mut st = IpsetState::kube(Family::Inet);
        for i in 0..n {
            st.add(SetKind::IpvsIps, Family::Inet, Entry::Ip(ip4(i)), "o")
                .unwrap();
        }
        st
    };
    // Over the threshold: one restore, no netlink request.
    let want = fill(257);
    let d = diff(&want, &ipset.read(&owned).unwrap());
    assert!(!ipset.uses_netlink(&d));
    let (p0, r0) = (ipset.processes_spawned(), ipset.netlink_requests());
    let rep = ipset.apply(&d).unwrap();
    assert_eq!((rep.processes, rep.requests), (1, 0));
    assert_eq!(
        (
            ipset.processes_spawned() - p0,
            ipset.netlink_requests() - r0
        ),
        (1, 0)
    );
    assert_eq!(saved_members(ns, Family::Inet), expected_members(&want));
    // At the threshold: netlink (here deleting 256 of the 257).
    let want = fill(1);
    let d = diff(&want, &ipset.read(&owned).unwrap());
    assert_eq!(d.dels.len(), 256);
    let rep = ipset.apply(&d).unwrap();
    assert_eq!((rep.processes, rep.requests), (0, 256));
    assert_eq!(saved_members(ns, Family::Inet), expected_members(&want));
    // A create in the diff: one restore creates the set, its member is a request.
    let mut want2 = want.clone();
    want2.ensure_set(ipset::SetSpec::new(
        "KUBE-EXTRA",
        SetType::HashIp,
        Family::Inet,
    ));
    want2.insert("KUBE-EXTRA", Entry::Ip(ip4(7)), "x").unwrap();
    let mut owned2 = owned.clone();
    owned2.push("KUBE-EXTRA".into());
    let d = diff(&want2, &ipset.read(&owned2).unwrap());
    assert_eq!((d.creates.len(), d.adds.len()), (1, 1));
    let rep = ipset.apply(&d).unwrap();
    assert_eq!((rep.processes, rep.requests), (1, 1));
    assert_eq!(
        save_of(ns, "KUBE-EXTRA").1,
        vec!["add KUBE-EXTRA 10.96.0.7"]
    );
    // A destroy in the diff: restore (with a member: still one process, no request).
    let mut want3 = want.clone();
    want3
        .add(SetKind::IpvsIps, Family::Inet, Entry::Ip(ip4(9)), "o")
        .unwrap();
    let d = diff(&want3, &ipset.read(&owned2).unwrap());
    assert_eq!(d.destroys, vec!["KUBE-EXTRA".to_string()]);
    assert_eq!(d.adds.len(), 1);
    let rep = ipset.apply(&d).unwrap();
    assert_eq!((rep.processes, rep.requests), (1, 0));
    assert_eq!(saved_members(ns, Family::Inet), expected_members(&want3));
    // Threshold 0 turns netlink off; a bigger one pipelines several windows.
    let off = ipset_in(ns).with_netlink_threshold(0);
    let d = diff(&fill(2), &off.read(&owned).unwrap());
    assert!(!d.adds.is_empty() || !d.dels.is_empty());
    let rep = off.apply(&d).unwrap();
    assert_eq!((rep.processes, rep.requests), (1, 0));
    let big = ipset_in(ns);
    let want = fill(3_000);
    let d = diff(&want, &big.read(&owned).unwrap());
    let rep = big.apply(&d).unwrap();
    assert!(rep.rejected.is_empty(), "{:?}", rep.rejected);
    assert_eq!((rep.processes, rep.requests), (0, 2_998));
    assert_eq!(saved_members(ns, Family::Inet), expected_members(&want));
}

// ---------------------------------------------------------------- native (netns)

#[test]
#[ignore = "netns"]
fn netns_netlink_adds_and_deletes_every_type() {
    netlink_adds_and_deletes_every_type(&Netns::new("nl").unwrap());
}

#[test]
#[ignore = "netns"]
fn netns_netlink_rejects_one_member_rest_lands() {
    netlink_rejects_one_member_rest_lands(&Netns::new("nlrej").unwrap());
}

#[test]
#[ignore = "netns"]
fn netns_large_or_structural_diffs_use_restore() {
    large_or_structural_diffs_use_restore(&Netns::new("nlbig").unwrap());
}

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
fn netns_ten_thousand_members_over_netlink() {
    ten_thousand_members_over_netlink(&Netns::new("10knl").unwrap());
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
        ..Runner::in_netns(ns.name())
    });
    let err = ipset.version().unwrap_err();
    assert!(matches!(err, ipset::Error::MissingBinary { .. }), "{err}");
    assert!(err.to_string().contains("/nonexistent/ipset"), "{err}");
}

// ---------------------------------------------------------------- VM (6.1 kernel, modules)

#[test]
#[ignore = "vm"]
fn vm_netlink_adds_and_deletes_every_type() {
    netlink_adds_and_deletes_every_type(&Netns::new("nl").unwrap());
}

#[test]
#[ignore = "vm"]
fn vm_netlink_rejects_one_member_rest_lands() {
    netlink_rejects_one_member_rest_lands(&Netns::new("nlrej").unwrap());
}

#[test]
#[ignore = "vm"]
fn vm_large_or_structural_diffs_use_restore() {
    large_or_structural_diffs_use_restore(&Netns::new("nlbig").unwrap());
}

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
fn vm_ten_thousand_members_over_netlink() {
    ten_thousand_members_over_netlink(&Netns::new("10knl").unwrap());
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

/// A read lists each owned set over netlink, one request per set and no process: absent sets
/// are missing from it, another family's sets are never read, and what it returns is exactly
/// what the `ipset` program's own `ipset save` gives (the read with netlink off) for every set
/// type, both families and a set whose members span several datagrams.
#[test]
#[ignore = "netns"]
fn netns_read_lists_owned_sets_over_netlink_and_runs_no_process() {
    let ns = Netns::new("nlread").unwrap();
    let ipset = ipset_in(&ns);
    let v4 = SetKind::all_names(Family::Inet);
    let v6 = SetKind::all_names(Family::Inet6);
    // No set yet: 17 requests, each answered "no such set", nothing run.
    let (p0, r0) = (ipset.processes_spawned(), ipset.netlink_requests());
    let none = ipset.read(&v4).unwrap();
    assert_eq!(none.sets().count(), 0, "{none:?}");
    assert_eq!(ipset.processes_spawned(), p0, "no process");
    assert!(ipset.netlink_requests() - r0 >= 17);
    // The IPv4 sets: every type's members, 3,000 of them in KUBE-IPVS-IPS; no IPv6 set.
    let mut want = members(Family::Inet);
    for n in 0..3_000 {
        want.add(SetKind::IpvsIps, Family::Inet, Entry::Ip(ip4(n)), "o")
            .unwrap();
    }
    ipset
        .apply(&diff(&want, &ipset.read(&v4).unwrap()))
        .unwrap();
    let p0 = ipset.processes_spawned();
    let six = ipset.read(&v6).unwrap();
    assert_eq!(six.sets().count(), 0, "{six:?}");
    let four = ipset.read(&v4).unwrap();
    assert_eq!(ipset.processes_spawned(), p0, "reads run no process");
    assert!(diff(&want, &four).is_empty());
    assert_eq!(four.entry_count(), want.entry_count());
    // The same sets read by the ipset program (netlink off): equal, specs included.
    let by_save = ipset_in(&ns).with_netlink_threshold(0);
    let p0 = by_save.processes_spawned();
    assert_eq!(by_save.read(&v4).unwrap(), four);
    assert_eq!(
        by_save.processes_spawned() - p0,
        2,
        "`ipset list -n`, `ipset save`"
    );
    // One IPv6 set exists: it is read (and no IPv4 one), as ipset save prints it.
    let mut want6 = IpsetState::new();
    want6
        .add(
            SetKind::IpvsIps,
            Family::Inet6,
            Entry::Ip("fd00::1".parse().unwrap()),
            "o",
        )
        .unwrap();
    ipset
        .apply(&diff(&want6, &ipset.read(&v6).unwrap()))
        .unwrap();
    let six = ipset.read(&v6).unwrap();
    assert!(diff(&want6, &six).is_empty(), "{six:?}");
    assert_eq!(six.entry_count(), 1);
    assert_eq!(by_save.read(&v6).unwrap(), six);
    // A set of another type under an owned name is read as foreign (so the diff recreates it).
    ns.sh("ipset destroy KUBE-6-IPVS-IPS && ipset create KUBE-6-IPVS-IPS hash:net family inet6")
        .unwrap();
    let six = ipset.read(&v6).unwrap();
    let set = six.get("KUBE-6-IPVS-IPS").unwrap();
    assert_eq!(set.foreign_type.as_deref(), Some("hash:net"));
    assert_eq!(diff(&want6, &six).recreates.len(), 1);
}
