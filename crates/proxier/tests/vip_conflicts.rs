//! VIP conflicts (issue #16 item 7, the CVE-2020-8554 class) and rejection clearing (item 8),
//! through the proxier against the in-memory kernel: two Services claiming the same external
//! IP, port and protocol — the older one serves, whatever order the objects arrive in; the
//! loser is reported; a ClusterIP always beats an externalIP; EndpointSlice rejections go away
//! when the slice is fixed or deleted.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod fixtures;

use std::collections::BTreeSet;
use std::net::IpAddr;

use fixtures::*;
use ipvs_netlink::{Protocol, ServiceKey};
use k8s_openapi::api::core::v1::Service;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use model::event::{Object, SourceEvent};
use model::store::Store;
use proxier::ipvs_mode::{Proxier, RulesConfig, SyncKind, SyncReport};
use proxier::kernel::Kernel;
use testkit::fake_kernel::FakeKernel;

const VIP: &str = "203.0.113.10";

fn node_addrs() -> BTreeSet<IpAddr> {
    [ip("192.168.0.10")].into_iter().collect()
}

fn key(addr: &str, port: u16) -> ServiceKey {
    ServiceKey::Inet {
        protocol: Protocol::Tcp,
        addr: ip(addr),
        port,
    }
}

/// A ClusterIP service with `externalIPs: [ext]` on port 80, created at `created` (seconds).
fn ext_svc(ns: &str, name: &str, cluster_ip: &str, ext: &[&str], created: Option<i64>) -> Service {
    let mut s = svc(ns, name, cluster_ip)
        .port("http", 80, "TCP")
        .external_ips(ext)
        .build();
    s.metadata.creation_timestamp =
        created.map(|t| Time(k8s_openapi::jiff::Timestamp::from_second(t).unwrap()));
    s
}

fn ep_slice(ns: &str, svc: &str, pod: &str) -> k8s_openapi::api::discovery::v1::EndpointSlice {
    slice(ns, svc, &format!("{svc}-1"))
        .port("http", 8080, "TCP")
        .ep(pod, "node-b", C::Ready)
        .build()
}

/// Applies `objs` one at a time, syncing after each (an incremental sync per event, like the
/// daemon under a trickle of changes).
fn apply_one_by_one(objs: &[Object]) -> (Store, Proxier, FakeKernel, Vec<(String, String)>) {
    let mut store = synced_store(vec![], vec![]);
    let mut p = Proxier::new(cfg4(), RulesConfig::default(), NODE);
    let mut k = FakeKernel::default();
    let r = p.sync(&store, &node_addrs(), &mut k);
    assert!(r.ok(), "{:?}", r.errors);
    let mut rejected = Vec::new();
    for o in objs {
        let ch = store.apply(SourceEvent::Apply(o.clone()));
        p.note(&ch);
        let r = p.sync(&store, &node_addrs(), &mut k);
        assert!(r.ok(), "{:?}", r.errors);
        rejected.extend(
            p.take_rejections()
                .into_iter()
                .map(|(k, why)| (k, why.reason)),
        );
    }
    (store, p, k, rejected)
}

fn svc_obj(s: Service) -> Object {
    Object::from(s)
}

fn slice_obj(s: k8s_openapi::api::discovery::v1::EndpointSlice) -> Object {
    Object::from(s)
}

/// The real servers of one virtual server in the kernel that take new connections (a real
/// server that left is drained at weight 0 first).
fn reals(k: &FakeKernel, key: &ServiceKey) -> Vec<IpAddr> {
    k.ipvs
        .get(key)
        .map(|vs| {
            vs.real_servers
                .iter()
                .filter(|(_, d)| d.weight > 0)
                .map(|(a, _)| a.0)
                .collect()
        })
        .unwrap_or_default()
}

fn conflict_objects() -> Vec<Object> {
    vec![
        // "older" was created first and is named after "newer" (so age decides, not name).
        svc_obj(ext_svc("zz", "older", "10.96.0.10", &[VIP], Some(1_000))),
        slice_obj(ep_slice("zz", "older", "10.244.1.1")),
        svc_obj(ext_svc("aa", "newer", "10.96.0.11", &[VIP], Some(2_000))),
        slice_obj(ep_slice("aa", "newer", "10.244.2.2")),
    ]
}

#[test]
fn the_older_service_serves_the_vip_whatever_the_order() {
    let objs = conflict_objects();
    let mut orders = vec![objs.clone()];
    let mut rev = objs.clone();
    rev.reverse();
    orders.push(rev);
    orders.push(vec![
        objs[2].clone(),
        objs[3].clone(),
        objs[0].clone(),
        objs[1].clone(),
    ]);
    for (i, order) in orders.iter().enumerate() {
        let (store, mut p, mut k, rejected) = apply_one_by_one(order);
        assert_eq!(
            reals(&k, &key(VIP, 80)),
            vec![ip("10.244.1.1")],
            "order {i}: the older Service serves the VIP"
        );
        // The loser keeps its ClusterIP.
        assert_eq!(reals(&k, &key("10.96.0.11", 80)), vec![ip("10.244.2.2")]);
        assert_eq!(p.vip_conflicts(), 1, "order {i}");
        let lost: Vec<&(String, String)> = rejected
            .iter()
            .filter(|(k, _)| k.starts_with("vip "))
            .collect();
        assert_eq!(lost.len(), 1, "order {i}: {rejected:?}");
        assert_eq!(lost[0].0, "vip aa/newer");
        assert!(
            lost[0].1.starts_with(desired::vip::CONFLICT_PREFIX)
                && lost[0]
                    .1
                    .contains("203.0.113.10:80/TCP is served by zz/older"),
            "{}",
            lost[0].1
        );
        // A full resync changes nothing.
        let before = k.counters();
        p.request_full();
        let r = p.sync(&store, &node_addrs(), &mut k);
        assert!(r.ok(), "{:?}", r.errors);
        assert_eq!(k.counters().ipvs_writes, before.ipvs_writes, "order {i}");
    }
}

#[test]
fn the_winner_is_not_touched_when_a_loser_appears_and_the_loser_takes_over_when_it_leaves() {
    let objs = conflict_objects();
    let (mut store, mut p, mut k, _) = apply_one_by_one(&objs[..2]);
    let served = k.ipvs.get(&key(VIP, 80)).cloned().unwrap();
    let before = k.counters();
    // The loser arrives: only its own ClusterIP virtual server is written.
    for o in &objs[2..] {
        let ch = store.apply(SourceEvent::Apply(o.clone()));
        p.note(&ch);
        assert!(p.sync(&store, &node_addrs(), &mut k).ok());
    }
    assert_eq!(k.ipvs.get(&key(VIP, 80)), Some(&served), "winner unchanged");
    assert_eq!(
        k.counters().ipvs_writes - before.ipvs_writes,
        2,
        "NewService + NewDest of the loser's ClusterIP only"
    );
    // The winner is deleted: the loser's claim is served now, and its rejection is gone.
    let ch = store.apply(SourceEvent::Delete(objs[0].clone()));
    p.note(&ch);
    assert!(p.sync(&store, &node_addrs(), &mut k).ok());
    assert_eq!(reals(&k, &key(VIP, 80)), vec![ip("10.244.2.2")]);
    assert_eq!(p.vip_conflicts(), 0);
    assert!(p.rejections().reason("vip aa/newer").is_none());
    assert!(k.addresses.contains(&ip(VIP)));
}

#[test]
fn ties_go_to_the_smaller_name_and_a_missing_timestamp_counts_as_newest() {
    // Same timestamp: namespace/name decides.
    let (_, _, k, rejected) = apply_one_by_one(&[
        svc_obj(ext_svc("b", "x", "10.96.0.20", &[VIP], Some(5))),
        slice_obj(ep_slice("b", "x", "10.244.2.2")),
        svc_obj(ext_svc("a", "x", "10.96.0.21", &[VIP], Some(5))),
        slice_obj(ep_slice("a", "x", "10.244.1.1")),
    ]);
    assert_eq!(reals(&k, &key(VIP, 80)), vec![ip("10.244.1.1")]);
    assert!(rejected.iter().any(|(k, _)| k == "vip b/x"), "{rejected:?}");
    // No timestamp loses to any timestamp, even with a smaller name.
    let (_, _, k, _) = apply_one_by_one(&[
        svc_obj(ext_svc("a", "x", "10.96.0.21", &[VIP], None)),
        slice_obj(ep_slice("a", "x", "10.244.1.1")),
        svc_obj(ext_svc("b", "x", "10.96.0.20", &[VIP], Some(9_999_999))),
        slice_obj(ep_slice("b", "x", "10.244.2.2")),
    ]);
    assert_eq!(reals(&k, &key(VIP, 80)), vec![ip("10.244.2.2")]);
}

#[test]
fn a_cluster_ip_always_beats_an_external_ip_claim() {
    // The attacker's Service is older and lists the victim's ClusterIP as an externalIP.
    let (_, p, k, rejected) = apply_one_by_one(&[
        svc_obj(ext_svc(
            "evil",
            "mitm",
            "10.96.0.50",
            &["10.96.0.60"],
            Some(1),
        )),
        slice_obj(ep_slice("evil", "mitm", "10.244.6.6")),
        svc_obj(ext_svc("prod", "api", "10.96.0.60", &[], Some(1_000))),
        slice_obj(ep_slice("prod", "api", "10.244.1.1")),
    ]);
    assert_eq!(reals(&k, &key("10.96.0.60", 80)), vec![ip("10.244.1.1")]);
    assert_eq!(p.vip_conflicts(), 1);
    assert!(
        rejected.iter().any(|(k, _)| k == "vip evil/mitm"),
        "{rejected:?}"
    );
    // Different port: no conflict, both served.
    let mut other = ext_svc("evil", "other", "10.96.0.51", &["10.96.0.60"], Some(1));
    other.spec.as_mut().unwrap().ports.as_mut().unwrap()[0].port = 81;
    let (_, p, k, _) = apply_one_by_one(&[
        svc_obj(other),
        slice_obj(ep_slice("evil", "other", "10.244.6.6")),
        svc_obj(ext_svc("prod", "api", "10.96.0.60", &[], Some(1_000))),
        slice_obj(ep_slice("prod", "api", "10.244.1.1")),
    ]);
    assert_eq!(p.vip_conflicts(), 0);
    assert_eq!(reals(&k, &key("10.96.0.60", 81)), vec![ip("10.244.6.6")]);
}

#[test]
fn a_losing_load_balancer_claim_adds_no_firewall_entries_to_the_winner() {
    let mut winner = svc("a", "lb", "10.96.0.70")
        .port("http", 80, "TCP")
        .lb_ingress(&[VIP])
        .build();
    winner.metadata.creation_timestamp =
        Some(Time(k8s_openapi::jiff::Timestamp::from_second(1).unwrap()));
    let mut loser = svc("b", "lb", "10.96.0.71")
        .port("http", 80, "TCP")
        .lb_ingress(&[VIP])
        .source_ranges(&["198.51.100.0/24"])
        .build();
    loser.metadata.creation_timestamp =
        Some(Time(k8s_openapi::jiff::Timestamp::from_second(2).unwrap()));
    let (_, _, k, _) = apply_one_by_one(&[
        svc_obj(winner),
        slice_obj(ep_slice("a", "lb", "10.244.1.1")),
        svc_obj(loser),
        slice_obj(ep_slice("b", "lb", "10.244.2.2")),
    ]);
    assert_eq!(reals(&k, &key(VIP, 80)), vec![ip("10.244.1.1")]);
    let fw = k.ipsets.get("KUBE-LOAD-BALANCER-FW").unwrap();
    assert!(fw.entries.is_empty(), "{:?}", fw.entries);
}

#[test]
fn endpointslice_rejections_clear_when_fixed_or_deleted_and_stay_bounded() {
    let mut store = synced_store(vec![], vec![]);
    let mut p = Proxier::new(cfg4(), RulesConfig::default(), NODE);
    let mut k = FakeKernel::default();
    let mut apply = |store: &mut Store, p: &mut Proxier, ev: SourceEvent| {
        let ch = store.apply(ev);
        p.note(&ch);
        assert!(p.sync(store, &node_addrs(), &mut k).ok());
    };
    let good = svc("default", "web", "10.96.0.80")
        .port("http", 80, "TCP")
        .build();
    apply(
        &mut store,
        &mut p,
        SourceEvent::Apply(svc_obj(good.clone())),
    );
    let bad = |name: &str| {
        slice("default", "web", name)
            .port("http", 8080, "TCP")
            .ep("10.244.0.300", "node-b", C::Ready)
            .build()
    };
    let fixed = |name: &str| {
        slice("default", "web", name)
            .port("http", 8080, "TCP")
            .ep("10.244.0.3", "node-b", C::Ready)
            .build()
    };
    // Churn: 1,000 distinct invalid slices, each fixed or deleted afterwards.
    for i in 0..1000 {
        let name = format!("web-{i}");
        apply(
            &mut store,
            &mut p,
            SourceEvent::Apply(slice_obj(bad(&name))),
        );
        assert_eq!(
            p.rejections().current(),
            1,
            "slice {i} rejected, the earlier ones cleared"
        );
        let ev = if i % 2 == 0 {
            SourceEvent::Apply(slice_obj(fixed(&name)))
        } else {
            SourceEvent::Delete(slice_obj(fixed(&name)))
        };
        apply(&mut store, &mut p, ev);
        assert_eq!(p.rejections().current(), 0, "slice {i}");
    }
    assert_eq!(p.rejections().total(), 1000);
    assert_eq!(p.rejections().owned_len(), 0);
    // A bad slice whose Service is deleted is cleared with it.
    apply(
        &mut store,
        &mut p,
        SourceEvent::Apply(slice_obj(bad("web-x"))),
    );
    assert_eq!(p.rejections().current(), 1);
    apply(&mut store, &mut p, SourceEvent::Delete(svc_obj(good)));
    assert_eq!(p.rejections().current(), 0);
    assert_eq!(p.rejections().owned_len(), 0);
}

#[test]
fn iptables_mode_renders_only_the_winners_external_ip_rule() {
    use proxier::iptables_mode::IptablesProxier;
    use proxier::sync_loop::Backend;
    let rec = proxier::iptables_mode::SharedRecording::default();
    let mut p = IptablesProxier::new(cfg4(), RulesConfig::default(), NODE, Box::new(rec.clone()));
    let mut store = synced_store(vec![], vec![]);
    assert!(p.sync(&store, &node_addrs()).ok());
    // The loser arrives first, then the older winner.
    let mut objs = conflict_objects();
    objs.reverse();
    let mut rejected = Vec::new();
    let mut last = SyncReport::new(SyncKind::Full);
    for o in objs {
        let ch = store.apply(SourceEvent::Apply(o));
        p.note(&ch);
        last = p.sync(&store, &node_addrs());
        assert!(last.ok(), "{:?}", last.errors);
        rejected.extend(p.take_rejections());
    }
    assert_eq!(last.vip_conflicts, 1);
    assert!(
        rejected.iter().any(|(k, _)| k == "vip aa/newer"),
        "{rejected:?}"
    );
    p.request_full();
    assert!(p.sync(&store, &node_addrs()).ok());
    let payload = rec.get().restores.last().cloned().unwrap();
    assert!(
        payload.contains("zz/older:http external IP"),
        "winner's rule missing:\n{payload}"
    );
    assert!(
        !payload.contains("aa/newer:http external IP"),
        "loser's rule rendered:\n{payload}"
    );
}
