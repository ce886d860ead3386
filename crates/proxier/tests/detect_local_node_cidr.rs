//! `detectLocalMode: NodeCIDR`: traffic from the Node object's `spec.podCIDRs` is local (no
//! masquerade for it), in both proxy modes, and the rules follow a change of the podCIDRs.
//!
//! Upstream builds its local detector from the Node's podCIDRs (`getLocalDetectors` /
//! `NewDetectLocalByCIDR`, cmd/kube-proxy/app/server_linux.go) and restarts when they change
//! (`NodePodCIDRHandler`); the rules it renders are what these tests expect.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod fixtures;

use std::collections::BTreeSet;
use std::net::IpAddr;

use fixtures::*;
use ipvs_netlink::Family;
use k8s_openapi::api::core::v1::{Node, NodeSpec};
use model::event::{Kind, Object, SourceEvent};
use model::store::Store;
use model::{NodeInfo, ProxyConfig};
use proxier::iptables_mode::{IptablesProxier, RecordingRunner};
use proxier::ipvs_mode::{Proxier, RulesConfig};
use testkit::fake_kernel::FakeKernel;

fn node_with(pod_cidrs: &[&str]) -> Node {
    let mut n = node_obj(NODE, "zone-a", "192.168.0.10");
    n.spec = Some(NodeSpec {
        pod_cidrs: Some(pod_cidrs.iter().map(|c| c.to_string()).collect()),
        pod_cidr: pod_cidrs.first().map(|c| c.to_string()),
        ..Default::default()
    });
    n
}

fn store(pod_cidrs: &[&str]) -> Store {
    let mut store = Store::new();
    store.apply(SourceEvent::Init(Kind::Node));
    store.apply(SourceEvent::InitApply(Object::Node(Box::new(node_with(
        pod_cidrs,
    )))));
    store.apply(SourceEvent::InitDone(Kind::Node));
    store.apply(SourceEvent::Init(Kind::Service));
    store.apply(SourceEvent::InitApply(Object::from(
        svc("default", "web", "10.96.0.10")
            .port("http", 80, "TCP")
            .build(),
    )));
    store.apply(SourceEvent::InitDone(Kind::Service));
    store.apply(SourceEvent::Init(Kind::EndpointSlice));
    store.apply(SourceEvent::InitApply(Object::from(
        slice("default", "web", "web-1")
            .port("http", 8080, "TCP")
            .ep("10.244.3.5", NODE, C::Ready)
            .build(),
    )));
    store.apply(SourceEvent::InitDone(Kind::EndpointSlice));
    store
}

fn node_addrs() -> BTreeSet<IpAddr> {
    [ip("192.168.0.10")].into_iter().collect()
}

fn rules_cfg() -> RulesConfig {
    RulesConfig {
        node_cidr: true,
        ..RulesConfig::default()
    }
}

#[test]
fn pod_cidrs_of_takes_the_family_and_skips_garbage() {
    let n = node_with(&["10.244.3.0/24", "fd00:3::/64", "not-a-cidr"]);
    assert_eq!(
        NodeInfo::pod_cidrs_of(Some(&n), Family::Inet),
        vec!["10.244.3.0/24".parse::<ipnet::IpNet>().unwrap()]
    );
    assert_eq!(
        NodeInfo::pod_cidrs_of(Some(&n), Family::Inet6),
        vec!["fd00:3::/64".parse::<ipnet::IpNet>().unwrap()]
    );
    assert!(NodeInfo::pod_cidrs_of(None, Family::Inet).is_empty());
}

#[test]
fn ipvs_mode_masquerades_traffic_from_outside_the_node_pod_cidr_and_follows_a_change() {
    let mut p = Proxier::new(ProxyConfig::new(Family::Inet), rules_cfg(), NODE);
    let mut k = FakeKernel::default();
    let first = store(&["10.244.3.0/24"]);
    p.request_full();
    assert!(p.sync(&first, &node_addrs(), &mut k).ok());
    let nat = k.iptables.get("nat").cloned().unwrap_or_default();
    assert!(
        nat.contains("-A KUBE-SERVICES ! -s 10.244.3.0/24 -m comment"),
        "{nat}"
    );
    // The Node's podCIDR changes: the next (incremental) sync re-renders the rules.
    let moved = store(&["10.244.7.0/24"]);
    assert!(p.sync(&moved, &node_addrs(), &mut k).ok());
    let nat = k.iptables.get("nat").cloned().unwrap_or_default();
    assert!(
        nat.contains("-A KUBE-SERVICES ! -s 10.244.7.0/24 -m comment"),
        "{nat}"
    );
    assert!(!nat.contains("10.244.3.0/24"), "{nat}");
}

#[test]
fn iptables_mode_uses_the_node_pod_cidr_for_local_traffic() {
    let mut p = IptablesProxier::new(
        ProxyConfig::new(Family::Inet),
        rules_cfg(),
        NODE,
        Box::new(RecordingRunner::default()),
    );
    let text = p
        .render_full(&store(&["10.244.3.0/24"]), &node_addrs())
        .unwrap();
    assert!(text.contains("! -s 10.244.3.0/24"), "{text}");
    let text = p
        .render_full(&store(&["10.244.9.0/24"]), &node_addrs())
        .unwrap();
    assert!(
        text.contains("! -s 10.244.9.0/24") && !text.contains("10.244.3.0/24"),
        "{text}"
    );
}
