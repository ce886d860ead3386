//! VM tests (a kernel with dummy links): kube-ipvs0 creation, address diff with request
//! counting, recreation after `ip link del kube-ipvs0`, and node-address tracking on a dummy
//! node link. Each test works in its own network namespace; cross-checked with `ip`.

// Test-only helpers outside #[test] fns may panic on failure.
#![allow(clippy::unwrap_used, clippy::panic)]

mod common;

use std::collections::BTreeSet;
use std::net::IpAddr;

use common::{apply_all, ips, unchanged_sends_nothing, wait_for, NetNs};
use netif::{diff_addresses, Netif, NodeAddresses, DUMMY_LINK};

#[test]
#[ignore = "vm"]
fn vm_dummy_link_created_diffed_and_recreated() {
    let ns = NetNs::new("vmdummy");
    ns.run(|ns| async move {
        let tracker = NodeAddresses::start().await.unwrap();
        let mut rx = tracker.subscribe();
        assert_eq!(tracker.current().dummy_index(), None);

        let n = Netif::new().await.unwrap();
        let st = n.ensure_dummy().await.unwrap();
        assert!(st.created);
        assert_eq!(st.index, ns.ifindex(DUMMY_LINK));
        let link = ns.ip(&["-d", "-o", "link", "show", "dev", DUMMY_LINK]);
        assert!(link.contains("dummy"), "{link}");
        // Left down, like kube-proxy.
        assert!(link.contains("state DOWN"), "{link}");
        assert!(!link.contains(",UP"), "{link}");
        let s = wait_for(&mut rx, "kube-ipvs0 created", |s| s.dummy_index().is_some()).await;
        assert_eq!(s.dummy_index(), Some(st.index));

        // Existing link: a lookup, no creation.
        let before = n.requests_sent();
        let again = n.ensure_dummy().await.unwrap();
        assert_eq!(
            again,
            netif::LinkState {
                index: st.index,
                created: false
            }
        );
        assert_eq!(n.requests_sent() - before, 1);

        let desired = ips(&["10.96.0.1", "10.96.0.10", "fd00:10:96::1"]);
        let want = ["10.96.0.1/32", "10.96.0.10/32", "fd00:10:96::1/128"];
        let current = n.addresses().await.unwrap();
        assert!(current.is_empty(), "{current:?}");
        apply_all(&n, &ns, &diff_addresses(&desired, &current), 3, &want).await;
        let v6 = ns.ip(&["-6", "addr", "show", "dev", DUMMY_LINK]);
        assert!(!v6.contains("tentative"), "{v6}");
        // The kernel treats the VIPs as local (what IPVS needs).
        let local = ns.ip(&["route", "show", "table", "local"]);
        assert!(local.contains("local 10.96.0.1 dev kube-ipvs0"), "{local}");
        assert!(local.contains("local 10.96.0.10 dev kube-ipvs0"), "{local}");
        let s = wait_for(&mut rx, "VIPs on kube-ipvs0", |s| {
            s.dummy_addresses() == desired
        })
        .await;
        assert!(s.node_ips().is_disjoint(&desired), "VIPs are not node IPs");

        // Unchanged: zero requests.
        unchanged_sends_nothing(&n, &desired).await;

        // Deleted behind our back: the tracker says so, the controller recreates and re-binds.
        ns.ip(&["link", "del", DUMMY_LINK]);
        let s = wait_for(&mut rx, "kube-ipvs0 deletion", |s| s.dummy_deletions() == 1).await;
        assert_eq!(s.dummy_index(), None);
        let st2 = n.ensure_dummy().await.unwrap();
        assert!(st2.created);
        assert_eq!(st2.index, ns.ifindex(DUMMY_LINK));
        let current = n.addresses().await.unwrap();
        assert!(current.is_empty());
        apply_all(&n, &ns, &diff_addresses(&desired, &current), 3, &want).await;
        let s = wait_for(&mut rx, "kube-ipvs0 back with VIPs", |s| {
            s.dummy_index() == Some(st2.index) && s.dummy_addresses() == desired
        })
        .await;
        assert_eq!(s.dummy_deletions(), 1);
        assert_eq!(s.full_dumps(), 1, "all through events");

        // Cleanup deletes it; a second cleanup finds nothing.
        assert!(n.delete_dummy().await.unwrap());
        assert!(ns.try_ip(&["link", "show", "dev", DUMMY_LINK]).is_err());
        assert!(!n.delete_dummy().await.unwrap());
        wait_for(&mut rx, "kube-ipvs0 deleted by cleanup", |s| {
            s.dummy_deletions() == 2
        })
        .await;
    });
}

#[test]
#[ignore = "vm"]
fn vm_tracker_sees_ip_addr_add_on_a_node_link() {
    let ns = NetNs::new("vmtrack");
    ns.ip(&["link", "add", "node0", "type", "dummy"]);
    ns.ip(&["link", "set", "node0", "up"]);
    ns.ip(&["addr", "add", "192.168.0.10/24", "dev", "node0"]);
    ns.ip(&["link", "add", DUMMY_LINK, "type", "dummy"]);
    ns.ip(&["addr", "add", "10.96.0.1/32", "dev", DUMMY_LINK]);
    ns.run(|ns| async move {
        let tracker = NodeAddresses::start().await.unwrap();
        let mut rx = tracker.subscribe();
        let s = tracker.current();
        assert_eq!(s.node_ips(), ips(&["192.168.0.10"]));
        assert!(s.is_local(&"192.168.0.10".parse().unwrap()));
        assert!(!s.is_local(&"10.96.0.1".parse().unwrap()));

        ns.ip(&["addr", "add", "192.168.0.11/24", "dev", "node0"]);
        let s = wait_for(&mut rx, "192.168.0.11 on node0", |s| {
            s.node_ips().contains(&"192.168.0.11".parse().unwrap())
        })
        .await;
        let f = netif::NodePortAddresses::from_config(&["192.168.0.11/32"], &[]).unwrap();
        assert_eq!(s.node_port_addresses(&f), ips(&["192.168.0.11"]));
        assert_eq!(s.full_dumps(), 1);
    });
}

#[test]
#[ignore = "vm"]
fn vm_ten_thousand_vips_all_acknowledged() {
    // With the default net.core.rmem_max of the VM, ACKs of an over-full datagram would be
    // dropped; every request must still get its answer.
    let ns = NetNs::new("vm10k");
    ns.run(|ns| async move {
        let n = Netif::new().await.unwrap();
        n.ensure_dummy().await.unwrap();
        let desired: BTreeSet<IpAddr> = (0..10_000u32)
            .map(|i| IpAddr::V4(std::net::Ipv4Addr::from(0x0a60_0000 + i + 1)))
            .collect();
        let res = n.apply(&diff_addresses(&desired, &BTreeSet::new())).await;
        assert_eq!(res.len(), 10_000);
        let failed: Vec<_> = res.iter().filter(|(_, r)| r.is_err()).take(3).collect();
        assert!(failed.is_empty(), "{failed:?}");
        assert_eq!(ns.addrs(DUMMY_LINK).len(), 10_000);
        assert_eq!(n.addresses().await.unwrap(), desired);
        let res = n.apply(&diff_addresses(&BTreeSet::new(), &desired)).await;
        assert!(res.iter().all(|(_, r)| r.is_ok()));
        assert!(ns.addrs(DUMMY_LINK).is_empty());
    });
}

/// One family's addresses: the read holds only that family, and the prefixes the other
/// family's read learnt are kept (a removal needs an address's own prefix: with a wrong one
/// the kernel answers "no such address" and the address stays bound).
#[test]
#[ignore = "vm"]
fn vm_addresses_of_one_family_keep_the_other_familys_prefixes() {
    let ns = NetNs::new("vmfamily");
    ns.run(|ns| async move {
        let n = Netif::new().await.unwrap();
        n.ensure_dummy().await.unwrap();
        for a in [
            "10.96.0.1/32",
            "10.96.0.2/24",
            "fd00:10:96::1/128",
            "fd00:10:96::2/64",
        ] {
            if a.contains(':') {
                ns.ip(&["addr", "add", a, "dev", DUMMY_LINK, "nodad"]);
            } else {
                ns.ip(&["addr", "add", a, "dev", DUMMY_LINK]);
            }
        }
        assert_eq!(
            n.addresses().await.unwrap(),
            ips(&["10.96.0.1", "10.96.0.2", "fd00:10:96::1", "fd00:10:96::2"])
        );
        assert_eq!(
            n.addresses_of(false).await.unwrap(),
            ips(&["10.96.0.1", "10.96.0.2"])
        );
        // The IPv6 read comes last: the IPv4 prefixes must survive it.
        assert_eq!(
            n.addresses_of(true).await.unwrap(),
            ips(&["fd00:10:96::1", "fd00:10:96::2"])
        );
        let diff = netif::AddrDiff {
            add: BTreeSet::new(),
            remove: ips(&["10.96.0.2", "fd00:10:96::2"]),
        };
        for (ip, r) in n.apply(&diff).await {
            assert!(r.is_ok(), "{ip}: {r:?}");
        }
        let left: BTreeSet<String> = ns.addrs(DUMMY_LINK).into_iter().collect();
        let want: BTreeSet<String> = ["10.96.0.1/32", "fd00:10:96::1/128"]
            .iter()
            .map(|s| s.to_string())
            .collect();
        assert_eq!(left, want);
        assert_eq!(n.addresses_of(false).await.unwrap(), ips(&["10.96.0.1"]));
        assert_eq!(n.addresses_of(true).await.unwrap(), ips(&["fd00:10:96::1"]));
        // A missing link is an error, not an empty family.
        ns.ip(&["link", "del", DUMMY_LINK]);
        assert!(matches!(
            n.addresses_of(true).await,
            Err(netif::Error::NoSuchLink(_))
        ));
    });
}
