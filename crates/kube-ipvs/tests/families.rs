//! Which IP families a node serves (issue #32), as decided before any kernel is touched: the
//! primary family like upstream's `detectNodeIPs` (cmd/kube-proxy/app/server.go: bindAddress,
//! else the Node object's first address), then the clusterCIDR and the node's addresses, then
//! IPv4; the secondary family when the node uses it (an address, a clusterCIDR, or its Node's
//! addresses or podCIDRs). Whether the node supports the secondary family is checked by the
//! daemon (never fatal: see `families_netns.rs`).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::collections::BTreeSet;
use std::net::IpAddr;
use std::path::Path;

use ipvs_netlink::Family::{Inet, Inet6};
use kube_ipvs::engine::{
    families, family_signalled, family_unsupported, primary_family, NodeFacts, PrimaryFrom,
};
use kube_ipvs::{cli, config};

fn cfg(argv: &[&str]) -> config::Config {
    let mut full = vec!["kube-ipvs", "--hostname-override", "node-a"];
    full.extend_from_slice(argv);
    let args = cli::parse(full).unwrap();
    config::from_sources(None, &args.flags, || Ok("node-a".into()))
        .unwrap()
        .config
}

fn ips(list: &[&str]) -> BTreeSet<IpAddr> {
    list.iter().map(|s| s.parse().unwrap()).collect()
}

fn node(addresses: &[&str], pod_cidrs: &[&str]) -> NodeFacts {
    NodeFacts {
        addresses: addresses.iter().map(|s| s.parse().unwrap()).collect(),
        pod_cidrs: pod_cidrs.iter().map(|s| s.parse().unwrap()).collect(),
    }
}

#[test]
fn the_primary_family_follows_bind_address_then_the_node_object_then_cidrs_then_addresses() {
    let dual = ips(&["192.168.0.10", "fd00::10"]);
    let none = NodeFacts::default();
    // bindAddress wins.
    let c = cfg(&["--bind-address", "fd00::10"]);
    assert_eq!(
        primary_family(&c, &node(&["192.168.0.10"], &[]), &dual),
        (Inet6, PrimaryFrom::BindAddress)
    );
    // Then the Node object's first address (InternalIP before ExternalIP).
    let c = cfg(&["--cluster-cidr", "10.244.0.0/16"]);
    assert_eq!(
        primary_family(&c, &node(&["fd00::10", "192.168.0.10"], &[]), &dual),
        (Inet6, PrimaryFrom::NodeObject)
    );
    // Then the first clusterCIDR.
    let c = cfg(&["--cluster-cidr", "fd00:10:244::/56,10.244.0.0/16"]);
    assert_eq!(
        primary_family(&c, &none, &dual),
        (Inet6, PrimaryFrom::ClusterCidr)
    );
    // Then the node's addresses: IPv4 when it has one, whenever its IPv6 address appeared.
    let c = cfg(&[]);
    assert_eq!(
        primary_family(&c, &none, &dual),
        (Inet, PrimaryFrom::NodeAddresses)
    );
    assert_eq!(
        primary_family(&c, &none, &ips(&["192.168.0.10"])),
        (Inet, PrimaryFrom::NodeAddresses)
    );
    assert_eq!(
        primary_family(&c, &none, &ips(&["fd00::10"])),
        (Inet6, PrimaryFrom::NodeAddresses)
    );
    assert_eq!(
        primary_family(&c, &none, &BTreeSet::new()),
        (Inet, PrimaryFrom::Default)
    );
}

#[test]
fn the_secondary_family_is_signalled_by_addresses_cidrs_or_the_node_object() {
    let c = cfg(&[]);
    let none = NodeFacts::default();
    let v4 = ips(&["192.168.0.10"]);
    assert!(!family_signalled(&c, &none, &v4, Inet6));
    // An IPv6 address (SLAAC's, arriving a moment later) signals IPv6.
    assert!(family_signalled(
        &c,
        &none,
        &ips(&["192.168.0.10", "fd00::10"]),
        Inet6
    ));
    // A clusterCIDR of the family.
    let dual = cfg(&["--cluster-cidr", "10.244.0.0/16,fd00:10:244::/56"]);
    assert!(family_signalled(&dual, &none, &v4, Inet6));
    // The Node object's addresses or podCIDRs.
    assert!(family_signalled(
        &c,
        &node(&["192.168.0.10", "fd00::10"], &[]),
        &v4,
        Inet6
    ));
    assert!(family_signalled(
        &c,
        &node(&["192.168.0.10"], &["10.244.1.0/24", "fd00:10:244:1::/64"]),
        &v4,
        Inet6
    ));
    // `plan` and `--cleanup` take the primary, then the signalled other family.
    assert_eq!(families(&c, &v4), [Inet]);
    assert_eq!(
        families(&c, &ips(&["192.168.0.10", "fd00::10"])),
        [Inet, Inet6]
    );
    assert_eq!(families(&dual, &BTreeSet::new()), [Inet, Inet6]);
    assert_eq!(families(&c, &ips(&["fd00::10"])), [Inet6]);
}

#[test]
fn a_kernel_without_ipv6_does_not_support_the_family() {
    let dir = std::env::temp_dir().join(format!("kube-ipvs-fam-{}", std::process::id()));
    std::fs::create_dir_all(dir.join("net/ipv4")).unwrap();
    let c = cfg(&["--sysctl-root", dir.to_str().unwrap()]);
    let why = family_unsupported(&c, Inet6).expect("IPv6 disabled");
    assert!(why.contains("net/ipv6"), "{why}");
    assert_eq!(family_unsupported(&c, Inet), None);
    std::fs::create_dir_all(dir.join("net/ipv6")).unwrap();
    assert_eq!(family_unsupported(&c, Inet6), None);
    let _ = std::fs::remove_dir_all(&dir);
    assert!(Path::new("/proc/sys/net").exists());
}
