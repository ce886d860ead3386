//! Proxier tests against the in-memory kernel: incrementality (requests per change), startup
//! adoption without a flush, drift repair, and failure isolation.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod fixtures;

use std::collections::BTreeSet;
use std::net::IpAddr;

use fixtures::*;
use ipvs_netlink::{OpKind, Protocol, ServiceKey};
use model::event::{Kind, Object, SourceEvent};
use model::store::Store;
use proxier::ipvs_mode::{Proxier, RulesConfig, SyncKind};
use proxier::kernel::Kernel;
use testkit::fake_kernel::FakeKernel;

fn service_ev(i: usize) -> Object {
    let ip = format!("10.96.{}.{}", i / 250, i % 250 + 1);
    Object::from(
        svc("default", &format!("svc-{i}"), &ip)
            .port("http", 80, "TCP")
            .build(),
    )
}

fn slice_ev(i: usize, endpoints: usize, offset: usize) -> Object {
    Object::from(slice_obj(i, endpoints, offset))
}

fn slice_obj(
    i: usize,
    endpoints: usize,
    offset: usize,
) -> k8s_openapi::api::discovery::v1::EndpointSlice {
    let mut s =
        slice("default", &format!("svc-{i}"), &format!("svc-{i}-abc")).port("http", 8080, "TCP");
    for e in 0..endpoints {
        let n = i * 10 + e + offset;
        s = s.ep(
            &format!("10.244.{}.{}", n / 250, n % 250 + 1),
            "node-b",
            C::Ready,
        );
    }
    s.build()
}

fn vip(i: usize) -> IpAddr {
    ip(&format!("10.96.{}.{}", i / 250, i % 250 + 1))
}

fn key(i: usize) -> ServiceKey {
    ServiceKey::Inet {
        protocol: Protocol::Tcp,
        addr: vip(i),
        port: 80,
    }
}

/// A store holding `n` ClusterIP services with 10 endpoints each, synced.
fn store_with(n: usize) -> Store {
    let mut store = Store::new();
    store.apply(SourceEvent::Init(Kind::Service));
    for i in 0..n {
        store.apply(SourceEvent::InitApply(service_ev(i)));
    }
    store.apply(SourceEvent::InitDone(Kind::Service));
    store.apply(SourceEvent::Init(Kind::EndpointSlice));
    for i in 0..n {
        store.apply(SourceEvent::InitApply(slice_ev(i, 10, 0)));
    }
    store.apply(SourceEvent::InitDone(Kind::EndpointSlice));
    assert!(store.synced());
    store
}

fn node_addrs() -> BTreeSet<IpAddr> {
    [ip("192.168.0.10")].into_iter().collect()
}

fn programmed(n: usize) -> (Store, Proxier, FakeKernel) {
    let store = store_with(n);
    let mut p = Proxier::new(cfg4(), RulesConfig::default(), NODE);
    let mut k = FakeKernel::default();
    let r = p.sync(&store, &node_addrs(), &mut k);
    assert_eq!(r.kind, SyncKind::Full);
    assert!(r.ok(), "{:?}", r.errors);
    assert_eq!(k.ipvs.len(), n);
    assert!(k.ipvs.values().all(|vs| vs.real_servers.len() == 10));
    assert_eq!(k.addresses.len(), n);
    (store, p, k)
}

/// A dual-stack node's IPv6 proxier, whose drift check reads IPVS, asks for the real servers of
/// IPv6 virtual servers only: the IPv4 table (1,000 virtual servers x 10 here) costs it the one
/// services dump, not 1,000 destinations dumps (at 5,000 x 10 in the emulated VM that read took
/// 7.6 s for nothing, and changes waited behind it).
#[test]
fn a_full_sync_reads_the_real_servers_of_its_own_family_only() {
    let (store, _, mut k) = programmed(1000);
    let mut p6 = Proxier::new(cfg6(), RulesConfig::default(), NODE);
    let before = k.counters().ipvs_requests;
    let r = p6.sync(&store, &node_addrs(), &mut k);
    assert_eq!(r.kind, SyncKind::Full);
    assert!(r.ok(), "{:?}", r.errors);
    let after = k.counters().ipvs_requests;
    assert_eq!(
        after.get(OpKind::GetService) - before.get(OpKind::GetService),
        1
    );
    assert_eq!(after.get(OpKind::GetDest) - before.get(OpKind::GetDest), 0);
    // The IPv4 table is untouched.
    assert_eq!(k.ipvs.len(), 1000);
    assert!(k.ipvs.values().all(|vs| vs.real_servers.len() == 10));
}

#[test]
fn first_sync_programs_everything_from_one_read_per_subsystem() {
    let (_, _, k) = programmed(1000);
    let c = k.counters();
    assert_eq!(c.ipvs_reads, 1);
    assert_eq!(c.address_reads, 1);
    assert_eq!(c.ipvs_writes, 1000 * 11);
    assert_eq!(c.address_writes, 1000);
    // One read of the sets (a netlink LIST of each of the family's 17) and one restore that
    // creates them; the members (one ClusterIP and one KUBE-IPVS-IPS member per service) are
    // netlink requests.
    assert_eq!(c.ipset_processes, 1);
    assert_eq!(c.ipset_requests, 17 + 2 * 1000);
    let cluster = k.ipsets.get("KUBE-CLUSTER-IP").expect("set created");
    assert_eq!(cluster.entries.len(), 1000);
    assert!(k.iptables.contains_key("nat") && k.iptables.contains_key("filter"));
}

#[test]
fn a_syncs_report_says_where_its_time_went_phase_by_phase() {
    let store = store_with(50);
    let mut p = Proxier::new(cfg4(), RulesConfig::default(), NODE);
    let mut k = FakeKernel::default();
    let full = p.sync(&store, &node_addrs(), &mut k);
    let names: Vec<&str> = full.phases.iter().map(|(n, _)| *n).collect();
    assert_eq!(
        names,
        [
            "derive",
            "read",
            "diff",
            "ipset",
            "iptables",
            "ipvs",
            "addresses",
            "remove"
        ]
    );
    let summed: std::time::Duration = full.phases.iter().map(|(_, d)| *d).sum();
    assert!(summed <= full.duration, "{summed:?} > {:?}", full.duration);
    let text = full.phases_text();
    assert!(
        text.starts_with("derive=") && text.contains(" ipvs="),
        "{text}"
    );
    p.note(&store_with(0).apply(SourceEvent::Apply(slice_ev(7, 9, 0))));
    let inc = p.sync(&store, &node_addrs(), &mut k);
    assert_eq!(inc.kind, SyncKind::Incremental);
    let names: Vec<&str> = inc.phases.iter().map(|(n, _)| *n).collect();
    assert_eq!(names, ["derive", "apply"]);
}

#[test]
fn one_endpoint_change_is_a_few_requests_and_no_dump() {
    let (mut store, mut p, mut k) = programmed(1000);
    let before = k.counters();
    // Replace one endpoint of service 500 (offset shifts the last address).
    let mut changed = slice("default", "svc-500", "svc-500-abc").port("http", 8080, "TCP");
    for e in 0..9 {
        let n = 5000 + e;
        changed = changed.ep(
            &format!("10.244.{}.{}", n / 250, n % 250 + 1),
            "node-b",
            C::Ready,
        );
    }
    changed = changed.ep("10.250.0.1", "node-b", C::Ready);
    let ch = store.apply(SourceEvent::Apply(Object::from(changed.build())));
    p.note(&ch);
    let r = p.sync(&store, &node_addrs(), &mut k);
    assert_eq!(r.kind, SyncKind::Incremental);
    assert!(r.ok(), "{:?}", r.errors);
    let after = k.counters();
    let writes = after.ipvs_writes - before.ipvs_writes;
    assert!(
        writes <= 10,
        "{writes} IPVS requests for one endpoint change"
    );
    assert_eq!(writes, 2, "one NewDest and one DelDest");
    assert_eq!(after.ipvs_reads, before.ipvs_reads, "no dump");
    assert_eq!(after.address_writes, before.address_writes);
    assert_eq!(after.iptables_processes, before.iptables_processes);
    // No set member changes (the endpoints are on another node): no ipset work at all.
    assert_eq!(after.ipset_processes, before.ipset_processes);
    assert_eq!(after.ipset_requests, before.ipset_requests);
    assert_eq!(r.services_derived, 1);
    let vs = &k.ipvs[&key(500)];
    assert!(vs.real_servers.contains_key(&(ip("10.250.0.1"), 8080)));
    // The replaced endpoint drains at weight 0 instead of being deleted.
    assert_eq!(vs.real_servers.len(), 11);
    let gone = (ip("10.244.20.10"), 8080);
    assert_eq!(vs.real_servers.get(&gone).unwrap().weight, 0);
    assert_eq!(p.draining(), 1);
}

#[test]
fn draining_real_server_is_deleted_when_its_connections_end_and_restored_if_wanted_again() {
    use proxier::ipvs_mode::DrainConfig;
    use std::time::Duration;
    let store0 = store_with(3);
    let mut store = store0.clone();
    let drain = DrainConfig {
        enabled: true,
        cap: Duration::from_secs(3600),
        interval: Duration::from_millis(1),
    };
    let mut p = Proxier::new(cfg4(), RulesConfig::default(), NODE).with_drain(drain);
    let mut k = FakeKernel::default();
    assert!(p.sync(&store, &node_addrs(), &mut k).ok());
    // Service 1 loses its last two endpoints.
    let ch = store.apply(SourceEvent::Apply(slice_ev(1, 8, 0)));
    p.note(&ch);
    assert!(p.sync(&store, &node_addrs(), &mut k).ok());
    assert_eq!(p.draining(), 2);
    let a = (ip("10.244.0.19"), 8080);
    let b = (ip("10.244.0.20"), 8080);
    // a still carries an established connection, b none.
    let vs = k.ipvs.get_mut(&key(1)).unwrap();
    vs.real_servers.get_mut(&a).unwrap().active_conns = 1;
    vs.real_servers.get_mut(&b).unwrap().inactive_conns = 5; // TIME_WAIT leftovers
    std::thread::sleep(Duration::from_millis(5));
    assert!(p.pending(std::time::Instant::now()), "a drain check is due");
    let before = k.counters();
    let r = p.sync(&store, &node_addrs(), &mut k);
    assert!(r.ok(), "{:?}", r.errors);
    let after = k.counters();
    assert_eq!(
        after.ipvs_reads - before.ipvs_reads,
        1,
        "only the draining service is read"
    );
    assert!(!k.ipvs[&key(1)].real_servers.contains_key(&b));
    assert_eq!(k.ipvs[&key(1)].real_servers.get(&a).unwrap().weight, 0);
    assert_eq!(p.drain_stats().removed_drained, 1);
    // a comes back: weight restored in place, no delete/re-add.
    let ch = store.apply(SourceEvent::Apply(slice_ev(1, 9, 0)));
    p.note(&ch);
    let before = k.counters();
    assert!(p.sync(&store, &node_addrs(), &mut k).ok());
    assert_eq!(k.ipvs[&key(1)].real_servers.get(&a).unwrap().weight, 1);
    assert_eq!(
        k.ipvs[&key(1)].real_servers.get(&a).unwrap().active_conns,
        1,
        "same real server"
    );
    assert_eq!(k.counters().ipvs_writes - before.ipvs_writes, 1);
    assert_eq!(p.draining(), 0);
    assert_eq!(p.drain_stats().restored, 1);
}

#[test]
fn udp_real_servers_are_deleted_at_once() {
    let mut store = Store::new();
    store.apply(SourceEvent::Init(Kind::Service));
    store.apply(SourceEvent::InitApply(Object::from(
        svc("kube-system", "dns", "10.96.0.10")
            .port("dns", 53, "UDP")
            .build(),
    )));
    store.apply(SourceEvent::InitDone(Kind::Service));
    let sl = |eps: &[&str]| {
        let mut s = slice("kube-system", "dns", "dns-1").port("dns", 53, "UDP");
        for e in eps {
            s = s.ep(e, "node-b", C::Ready);
        }
        Object::from(s.build())
    };
    store.apply(SourceEvent::Init(Kind::EndpointSlice));
    store.apply(SourceEvent::InitApply(sl(&["10.244.1.1", "10.244.1.2"])));
    store.apply(SourceEvent::InitDone(Kind::EndpointSlice));
    let mut p = Proxier::new(cfg4(), RulesConfig::default(), NODE);
    let mut k = FakeKernel::default();
    let first = p.sync(&store, &node_addrs(), &mut k);
    assert!(first.ok());
    assert_eq!(first.phases.last().map(|(n, _)| *n), Some("remove"));
    let ch = store.apply(SourceEvent::Apply(sl(&["10.244.1.2"])));
    p.note(&ch);
    let removed = p.sync(&store, &node_addrs(), &mut k);
    assert!(removed.ok());
    // The conntrack cleanup is timed as a phase of its own.
    let names: Vec<&str> = removed.phases.iter().map(|(n, _)| *n).collect();
    assert_eq!(names, ["derive", "apply", "conntrack"]);
    let udp = ServiceKey::Inet {
        protocol: Protocol::Udp,
        addr: ip("10.96.0.10"),
        port: 53,
    };
    assert_eq!(k.ipvs[&udp].real_servers.len(), 1);
    assert_eq!(p.draining(), 0);
    use conntrack::{ConntrackFilter, Protocol as Ct};
    // Stale flows to the removed endpoint are deleted, and only those.
    assert_eq!(
        k.conntrack,
        vec![ConntrackFilter::endpoint_removed(
            Ct::Udp,
            ip("10.96.0.10"),
            53,
            ip("10.244.1.1")
        )]
    );
    // 1 → 0 → 1 endpoints: the flows created while there was none are deleted.
    let ch = store.apply(SourceEvent::Apply(sl(&[])));
    p.note(&ch);
    assert!(p.sync(&store, &node_addrs(), &mut k).ok());
    assert_eq!(k.conntrack.len(), 2);
    let ch = store.apply(SourceEvent::Apply(sl(&["10.244.1.3"])));
    p.note(&ch);
    assert!(p.sync(&store, &node_addrs(), &mut k).ok());
    assert_eq!(
        k.conntrack.last(),
        Some(&ConntrackFilter::unanswered(Ct::Udp, ip("10.96.0.10"), 53))
    );
    assert_eq!(k.conntrack.len(), 3);
}

#[test]
fn adding_and_deleting_a_service_touches_only_that_service() {
    let (mut store, mut p, mut k) = programmed(1000);
    let before = k.counters();
    let mut ch = store.apply(SourceEvent::Apply(service_ev(1000)));
    ch.merge(store.apply(SourceEvent::Apply(slice_ev(1000, 10, 0))));
    p.note(&ch);
    let r = p.sync(&store, &node_addrs(), &mut k);
    assert!(r.ok(), "{:?}", r.errors);
    let mid = k.counters();
    assert_eq!(
        mid.ipvs_writes - before.ipvs_writes,
        11,
        "NewService + 10 NewDest"
    );
    assert_eq!(mid.address_writes - before.address_writes, 1);
    assert_eq!(mid.ipvs_reads, before.ipvs_reads);
    assert!(k.addresses.contains(&vip(1000)));
    // The new ClusterIP goes into KUBE-CLUSTER-IP and KUBE-IPVS-IPS over netlink: two
    // requests and no ipset process.
    assert_eq!(
        mid.ipset_processes, before.ipset_processes,
        "no ipset process"
    );
    assert_eq!(mid.ipset_requests - before.ipset_requests, 2);
    let member = ipset::Entry::ip_port(vip(1000), ipset::Protocol::Tcp, 80);
    assert!(k
        .ipsets
        .get("KUBE-CLUSTER-IP")
        .unwrap()
        .entries
        .contains_key(&member));
    assert!(k
        .ipsets
        .get("KUBE-IPVS-IPS")
        .unwrap()
        .entries
        .contains_key(&ipset::Entry::Ip(vip(1000))));

    let ch = store.apply(SourceEvent::Delete(service_ev(7)));
    p.note(&ch);
    let r = p.sync(&store, &node_addrs(), &mut k);
    assert!(r.ok(), "{:?}", r.errors);
    let after = k.counters();
    assert_eq!(after.ipvs_writes - mid.ipvs_writes, 1, "one DelService");
    assert_eq!(after.address_writes - mid.address_writes, 1);
    assert_eq!(
        after.ipset_processes, mid.ipset_processes,
        "no ipset process"
    );
    assert_eq!(after.ipset_requests - mid.ipset_requests, 2);
    assert!(!k.ipvs.contains_key(&key(7)));
    assert!(!k.addresses.contains(&vip(7)));
    assert!(k.ipvs.contains_key(&key(8)));
}

#[test]
fn resync_without_drift_reads_once_and_writes_nothing() {
    let (store, mut p, mut k) = programmed(1000);
    let before = k.counters();
    p.request_full();
    let r = p.sync(&store, &node_addrs(), &mut k);
    assert_eq!(r.kind, SyncKind::Full);
    assert!(r.ok(), "{:?}", r.errors);
    assert!(r.drift.is_empty(), "{:?}", r.drift);
    let after = k.counters();
    assert_eq!(after.ipvs_reads - before.ipvs_reads, 1, "one dump");
    assert_eq!(after.ipvs_writes, before.ipvs_writes, "no IPVS writes");
    assert_eq!(after.address_writes, before.address_writes);
}

#[test]
fn drift_is_repaired_and_counted() {
    let (store, mut p, mut k) = programmed(100);
    // Behind the proxier's back: flush IPVS, drop an address, flush the nat rules.
    k.ipvs.clear();
    k.addresses.remove(&vip(3));
    k.iptables.insert("nat".into(), String::new());
    let before = k.counters();
    p.request_full();
    let r = p.sync(&store, &node_addrs(), &mut k);
    assert_eq!(r.kind, SyncKind::Full);
    assert!(r.ok(), "{:?}", r.errors);
    // The full sync restored the rules; the addresses and IPVS were not read yet.
    assert_eq!(r.drift.get("iptables"), Some(&1));
    assert!(k.iptables["nat"].contains("KUBE-SERVICES"));
    assert_eq!(r.drift.get("address"), None);
    assert_eq!(r.drift.get("ipvs"), None);
    assert!(k.ipvs.is_empty());
    assert!(!k.addresses.contains(&vip(3)));
    // The check's steps in the syncs that follow find and repair the rest: the addresses,
    // the sets, then IPVS a slice at a time.
    let drift = check_to_the_end(&store, &mut p, &mut k);
    assert_eq!(drift.get("address"), Some(&1), "{drift:?}");
    assert_eq!(drift.get("ipset"), None, "{drift:?}");
    assert_eq!(drift.get("ipvs"), Some(&1100), "{drift:?}");
    assert!(k.addresses.contains(&vip(3)));
    assert_eq!(k.ipvs.len(), 100);
    assert!(k.ipvs.values().all(|vs| vs.real_servers.len() == 10));
    assert_eq!(k.counters().ipvs_writes - before.ipvs_writes, 1100);
}

/// Runs the syncs a running drift check asks for until it ended; returns the drift they
/// counted, by subsystem.
fn check_to_the_end(
    store: &Store,
    p: &mut Proxier,
    k: &mut FakeKernel,
) -> std::collections::BTreeMap<&'static str, usize> {
    let mut drift = std::collections::BTreeMap::new();
    for _ in 0..1000 {
        if !p.pending(std::time::Instant::now()) {
            return drift;
        }
        let r = p.sync(store, &node_addrs(), k);
        assert_eq!(r.kind, SyncKind::Incremental);
        assert!(r.ok(), "{:?}", r.errors);
        for (s, n) in r.drift {
            *drift.entry(s).or_default() += n;
        }
    }
    panic!("the drift check did not end in 1000 syncs");
}

/// A change that arrives while a drift check runs is programmed by the next sync, before the
/// check's next slice, and is not counted as drift; the check then goes on where it was.
#[test]
fn a_change_during_a_drift_check_is_programmed_at_the_next_sync() {
    let (mut store, p, mut k) = programmed(2000);
    // One slice (64 virtual servers) per sync: the test counts reads.
    let mut p = p.with_check_budget(std::time::Duration::ZERO);
    p.request_full();
    let r = p.sync(&store, &node_addrs(), &mut k);
    assert_eq!(r.kind, SyncKind::Full);
    assert!(r.ok(), "{:?}", r.errors);
    assert!(p.pending(std::time::Instant::now()), "the check runs");
    // Its first two steps read the addresses, then the sets.
    for _ in 0..2 {
        let before = k.counters();
        let r = p.sync(&store, &node_addrs(), &mut k);
        assert!(r.ok() && r.drift.is_empty(), "{:?} {:?}", r.errors, r.drift);
        let reads = k.counters().ipvs_requests.get(OpKind::GetDest)
            - before.ipvs_requests.get(OpKind::GetDest);
        assert_eq!(reads, 0, "IPVS is the check's last step");
    }
    // Drift behind the proxier's back, on the last virtual server the check reads.
    let last = *k.ipvs.keys().next_back().unwrap();
    let reals: Vec<_> = k.ipvs[&last].real_servers.keys().collect();
    for r in &reals {
        k.ipvs.get_mut(&last).unwrap().real_servers.remove(r);
    }
    // One endpoint more for service 7.
    let ch = store.apply(SourceEvent::Apply(slice_ev(7, 11, 0)));
    assert!(!ch.is_empty());
    p.note(&ch);
    let before = k.counters();
    let r = p.sync(&store, &node_addrs(), &mut k);
    assert_eq!(r.kind, SyncKind::Incremental);
    assert!(r.ok(), "{:?}", r.errors);
    let reals = &k.ipvs[&key(7)].real_servers;
    assert_eq!(reals.len(), 11, "the change is programmed");
    assert!(reals.contains_key(&(ip("10.244.0.81"), 8080)));
    // This sync read one slice of the check, not the whole table.
    let reads =
        k.counters().ipvs_requests.get(OpKind::GetDest) - before.ipvs_requests.get(OpKind::GetDest);
    assert_eq!(reads, 64);
    let rest = check_to_the_end(&store, &mut p, &mut k);
    assert_eq!(rest.keys().collect::<Vec<_>>(), [&"ipvs"], "{rest:?}");
    let drift = r.drift.get("ipvs").copied().unwrap_or(0) + rest["ipvs"];
    // Only the drift made behind the proxier's back is counted, not the change.
    assert_eq!(drift, 10);
    assert_eq!(k.ipvs[&last].real_servers.len(), 10);
}

/// The periodic full sync and the drift check's steps (at most one per `minSyncPeriod`) run on
/// timers of their own and are not work the sync loop paces: a sync that only ran them does
/// not make the next change wait for `minSyncPeriod` (in the peers benchmark at 1,000 x 10,
/// three to five of 30 changes that came during a periodic full sync and its check waited
/// 0.4-1.2 s).
#[test]
fn drift_check_steps_have_their_own_timer_and_do_not_pace_changes() {
    use std::time::{Duration, Instant};
    let (mut store, p, mut k) = programmed(200);
    let min = Duration::from_secs(1);
    let mut p = p.with_retry(proxier::retry::RetryPolicy::new(
        min,
        Duration::from_secs(30),
    ));
    let t0 = Instant::now();
    p.request_full();
    assert!(p.pending(t0), "the periodic full sync is due");
    assert!(!p.paced_pending(t0), "on its own timer, not paced work");
    let r = p.sync_at(t0, &store, &node_addrs(), &mut k);
    assert_eq!(r.kind, SyncKind::Full);
    assert!(r.ok(), "{:?}", r.errors);
    // The check's first step is due; it is not paced work.
    let t1 = t0 + 2 * min;
    assert!(p.pending(t1), "the check's first step is due");
    assert!(!p.paced_pending(t1), "a check step alone is not paced work");
    let r = p.sync_at(t1, &store, &node_addrs(), &mut k);
    assert!(r.ok() && r.drift.is_empty(), "{:?} {:?}", r.errors, r.drift);
    // The next step waits for the check's own timer, and the loop is told when it is due.
    assert!(
        !p.pending(t1 + min / 2),
        "the next step waits minSyncPeriod"
    );
    assert_eq!(p.retry_due(), Some(t1 + min));
    assert!(p.pending(t1 + min) && !p.paced_pending(t1 + min));
    // A change meanwhile is paced work, due at once.
    let ch = store.apply(SourceEvent::Apply(slice_ev(7, 11, 0)));
    assert!(!ch.is_empty());
    p.note(&ch);
    assert!(p.paced_pending(t1 + min / 2), "the change is due");
    let r = p.sync_at(t1 + min / 2, &store, &node_addrs(), &mut k);
    assert!(r.ok(), "{:?}", r.errors);
    assert_eq!(
        k.ipvs[&key(7)].real_servers.len(),
        11,
        "the change is programmed"
    );
    // That sync ran no step of the check (not due yet): the next step is still at t1 + min.
    assert!(!p.pending(t1 + min / 2 + Duration::from_millis(1)));
    assert!(p.pending(t1 + min));
}

#[test]
fn startup_adopts_matching_state_and_removes_only_stale_owned_services() {
    let store = store_with(50);
    // A kernel as a previous run left it: the same table, plus a stale service, plus a
    // service in an excluded range, plus a real server left at weight 0.
    let (_, _, mut k) = programmed(50);
    let stale = ServiceKey::Inet {
        protocol: Protocol::Tcp,
        addr: ip("10.96.200.1"),
        port: 80,
    };
    let excluded = ServiceKey::Inet {
        protocol: Protocol::Tcp,
        addr: ip("172.30.0.1"),
        port: 80,
    };
    let template = k.ipvs[&key(0)].clone();
    for kk in [stale, excluded] {
        let mut vs = template.clone();
        vs.service.key = kk;
        k.ipvs.insert(kk, vs);
    }
    let (dk, d) = k.ipvs[&key(1)]
        .real_servers
        .iter()
        .next()
        .map(|(a, b)| (a, b.clone()))
        .unwrap();
    let mut zero = d.clone();
    zero.weight = 0;
    k.ipvs
        .get_mut(&key(1))
        .unwrap()
        .real_servers
        .insert(dk, zero);
    k.counters = Default::default();

    let mut cfg = cfg4();
    cfg.exclude_cidrs = vec!["172.30.0.0/16".parse().unwrap()];
    let mut p = Proxier::new(cfg, RulesConfig::default(), NODE);
    let r = p.sync(&store, &node_addrs(), &mut k);
    assert!(r.ok(), "{:?}", r.errors);
    let c = k.counters();
    // Exactly: DelService(stale) + SetDest(weight back to 1); nothing re-created.
    assert_eq!(c.ipvs_writes, 2);
    assert_eq!(c.address_writes, 0);
    assert!(!k.ipvs.contains_key(&stale));
    assert!(
        k.ipvs.contains_key(&excluded),
        "excludeCIDRs are never deleted"
    );
    assert_eq!(k.ipvs[&key(1)].real_servers.get(&dk).unwrap().weight, 1);
}

#[test]
fn a_failing_service_does_not_block_others_and_is_retried() {
    let store = store_with(20);
    let mut k = FakeKernel::default();
    k.fail_keys.insert(key(5));
    let mut p = Proxier::new(cfg4(), RulesConfig::default(), NODE);
    let r = p.sync(&store, &node_addrs(), &mut k);
    assert!(!r.ok());
    assert!(
        r.errors.iter().any(|e| e.contains("default/svc-5")),
        "{:?}",
        r.errors
    );
    assert_eq!(k.ipvs.len(), 19, "every other service is programmed");
    assert!(p.retry_due().is_some());
    // The fault goes away; the retry re-checks just that virtual server.
    k.fail_keys.clear();
    let before = k.counters();
    // The first retry is due after 1 s ± 15 % (RetryPolicy's jitter): wait past the latest.
    std::thread::sleep(std::time::Duration::from_millis(1200));
    assert!(p.pending(std::time::Instant::now()));
    let r = p.sync(&store, &node_addrs(), &mut k);
    assert!(r.ok(), "{:?}", r.errors);
    assert_eq!(k.ipvs.len(), 20);
    assert_eq!(k.ipvs[&key(5)].real_servers.len(), 10);
    let after = k.counters();
    assert_eq!(after.ipvs_writes - before.ipvs_writes, 11);
}

/// One IPv4 family on a fake kernel, and a loop configuration that returns after the first sync.
fn once_loop() -> (
    Vec<Box<dyn proxier::sync_loop::Backend + Send>>,
    proxier::sync_loop::LoopConfig,
) {
    use proxier::sync_loop::{FamilyProxier, LoopConfig};
    use std::time::Duration;
    let families: Vec<Box<dyn proxier::sync_loop::Backend + Send>> =
        vec![Box::new(FamilyProxier {
            proxier: Proxier::new(cfg4(), RulesConfig::default(), NODE),
            kernel: Box::new(testkit::fake_kernel::SharedFakeKernel::default()),
        })];
    let cfg = LoopConfig {
        min_sync_period: Duration::from_millis(10),
        sync_period: Duration::from_secs(30),
        once: true,
        node_wait: Duration::ZERO,
    };
    (families, cfg)
}

#[test]
fn loop_waits_for_both_lists_then_syncs_once() {
    use proxier::sync_loop::{run, Exit, Input, NoObserver};
    use std::time::Duration;
    let (tx, rx) = std::sync::mpsc::channel();
    // Services listed, slices not yet: nothing may be programmed.
    tx.send(Input::Source(SourceEvent::Init(Kind::Service)))
        .unwrap();
    tx.send(Input::Source(SourceEvent::InitApply(service_ev(1))))
        .unwrap();
    tx.send(Input::Source(SourceEvent::InitDone(Kind::Service)))
        .unwrap();
    let (mut families, cfg) = once_loop();
    let sender = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(200));
        tx.send(Input::Source(SourceEvent::Init(Kind::EndpointSlice)))
            .unwrap();
        tx.send(Input::Source(SourceEvent::InitApply(slice_ev(1, 3, 0))))
            .unwrap();
        tx.send(Input::Source(SourceEvent::InitDone(Kind::EndpointSlice)))
            .unwrap();
        tx
    });
    let mut store = Store::new();
    let exit = run(
        &rx,
        &mut store,
        &mut families,
        node_addrs(),
        cfg,
        &NoObserver,
    );
    assert_eq!(exit, Exit::Once { ok: true });
    let _tx = sender.join().unwrap();
    assert_eq!(families[0].draining(), 0);
    drop(families);
    // The loop programmed exactly what the store holds once both kinds were listed.
    let mut check = Proxier::new(cfg4(), RulesConfig::default(), NODE);
    let plan = check.plan(&store, &node_addrs()).unwrap();
    assert_eq!(
        plan.ipvs.lines().filter(|l| l.starts_with("-a ")).count(),
        3
    );
}

/// kube-proxy's `*_changes_pending` gauges: changed services accumulate (a Service and a slice
/// of another service count apart) until a sync takes them, then read 0.
#[test]
fn loop_reports_pending_changes_until_the_sync() {
    use proxier::sync_loop::{run, Exit, Input, SyncObserver};
    use std::sync::Mutex;
    #[derive(Default)]
    struct Pending(Mutex<Vec<(usize, usize)>>);
    impl SyncObserver for Pending {
        fn pending(&self, services: usize, endpoints: usize) {
            self.0.lock().unwrap().push((services, endpoints));
        }
    }
    let (tx, rx) = std::sync::mpsc::channel();
    for ev in [
        SourceEvent::Init(Kind::Service),
        SourceEvent::InitApply(service_ev(1)),
        SourceEvent::InitApply(service_ev(2)),
        SourceEvent::InitDone(Kind::Service),
        SourceEvent::Init(Kind::EndpointSlice),
        SourceEvent::InitApply(slice_ev(1, 3, 0)),
        SourceEvent::InitDone(Kind::EndpointSlice),
    ] {
        tx.send(Input::Source(ev)).unwrap();
    }
    let (mut families, cfg) = once_loop();
    let observer = Pending::default();
    let mut store = Store::new();
    let exit = run(&rx, &mut store, &mut families, node_addrs(), cfg, &observer);
    assert_eq!(exit, Exit::Once { ok: true });
    assert_eq!(
        *observer.0.lock().unwrap(),
        vec![(1, 0), (2, 0), (2, 1), (0, 0)]
    );
}

/// `kubeproxy_network_programming_duration_seconds`, `kube_ipvs_ipvs_services` /
/// `_destinations` and `kube_ipvs_ipvs_requests_total{op}` are fed from what the loop tells its
/// observer: the trigger time of a slice changed after the loop started (not one from before,
/// not one without the annotation), and the backend's programmed counts and IPVS requests by
/// command after the sync.
#[test]
fn loop_reports_network_programming_triggers_and_ipvs_counts() {
    use ipvs_netlink::{Family, OpCounts, OpKind};
    use model::LAST_CHANGE_TRIGGER_TIME_ANNOTATION;
    use proxier::sync_loop::{run, Backend, Exit, Input, SyncObserver};
    use std::sync::Mutex;
    use std::time::{Duration, SystemTime};
    #[derive(Default)]
    struct Seen {
        programmed: Mutex<Vec<(Family, Vec<SystemTime>)>>,
        counts: Mutex<Vec<((usize, usize), OpCounts)>>,
    }
    impl SyncObserver for Seen {
        fn synced(&self, _f: Family, _r: &proxier::ipvs_mode::SyncReport, b: &dyn Backend) {
            self.counts
                .lock()
                .unwrap()
                .push((b.ipvs_programmed(), b.ipvs_requests()));
        }
        fn network_programmed(&self, family: Family, triggers: &[SystemTime]) {
            self.programmed
                .lock()
                .unwrap()
                .push((family, triggers.to_vec()));
        }
    }
    fn annotated(i: usize, at: Option<SystemTime>) -> Object {
        let mut s = slice_obj(i, 3, 0);
        if let Some(at) = at {
            let ts = k8s_openapi::jiff::Timestamp::try_from(at).unwrap();
            s.metadata.annotations = Some(
                [(
                    LAST_CHANGE_TRIGGER_TIME_ANNOTATION.to_string(),
                    ts.to_string(),
                )]
                .into(),
            );
        }
        Object::from(s)
    }
    let (tx, rx) = std::sync::mpsc::channel();
    tx.send(Input::Source(SourceEvent::Init(Kind::Service)))
        .unwrap();
    for i in 1..=3 {
        tx.send(Input::Source(SourceEvent::InitApply(service_ev(i))))
            .unwrap();
    }
    tx.send(Input::Source(SourceEvent::InitDone(Kind::Service)))
        .unwrap();
    let sender = std::thread::spawn(move || {
        // After the loop started: only changes triggered since count.
        std::thread::sleep(Duration::from_millis(100));
        let fresh = SystemTime::now();
        for ev in [
            SourceEvent::Init(Kind::EndpointSlice),
            SourceEvent::InitApply(annotated(1, Some(fresh))),
            SourceEvent::InitApply(annotated(2, Some(fresh - Duration::from_secs(3600)))),
            SourceEvent::InitApply(annotated(3, None)),
            SourceEvent::InitDone(Kind::EndpointSlice),
        ] {
            tx.send(Input::Source(ev)).unwrap();
        }
        (tx, fresh)
    });
    let (mut families, cfg) = once_loop();
    let observer = Seen::default();
    let mut store = Store::new();
    let exit = run(&rx, &mut store, &mut families, node_addrs(), cfg, &observer);
    assert_eq!(exit, Exit::Once { ok: true });
    let (_tx, fresh) = sender.join().unwrap();
    let programmed = observer.programmed.lock().unwrap().clone();
    assert_eq!(programmed.len(), 1, "{programmed:?}");
    assert_eq!(programmed[0].0, Family::Inet);
    assert_eq!(programmed[0].1.len(), 1, "{programmed:?}");
    let skew = programmed[0].1[0]
        .duration_since(fresh)
        .unwrap_or_else(|e| e.duration());
    assert!(skew < Duration::from_millis(1), "{skew:?}");
    let counts = observer.counts.lock().unwrap().clone();
    assert_eq!(counts.len(), 1);
    let (programmed, requests) = counts[0];
    assert_eq!(
        programmed,
        (3, 9),
        "three virtual servers, three real servers each"
    );
    assert_eq!(requests.get(OpKind::NewService), 3);
    assert_eq!(requests.get(OpKind::NewDest), 9);
    assert!(requests.get(OpKind::GetService) >= 1, "{requests:?}");
}

#[test]
fn plan_renders_ipvsadm_format_and_dry_run_records_only_differences() {
    use proxier::plan::{render, DryRun, Section};
    let store = store_with(2);
    let mut p = Proxier::new(cfg4(), RulesConfig::default(), NODE);
    let plan = p.plan(&store, &node_addrs()).unwrap();
    let ipvs = render(std::slice::from_ref(&plan), Some(Section::Ipvs));
    // Round trip through the ipvsadm -S parser: two services, ten real servers each.
    let parsed = ipvs_netlink::savefmt::parse(&ipvs).unwrap();
    assert_eq!(parsed.len(), 2);
    assert!(parsed.iter().all(|(_, d)| d.len() == 10));
    assert!(ipvs.starts_with("-A -t 10.96.0.1:80 -s rr\n"), "{ipvs}");
    assert!(ipvs.contains("-a -t 10.96.0.1:80 -r 10.244.0.1:8080 -m -w 1\n"));
    assert_eq!(plan.addresses, vec![vip(0), vip(1)]);
    assert!(
        plan.ipsets.contains("add KUBE-CLUSTER-IP 10.96.0.1,tcp:80"),
        "{}",
        plan.ipsets
    );
    assert!(plan.iptables.contains("*nat"));

    // A kernel with one service too many and one real server missing.
    let (_, _, mut k) = programmed(2);
    let mut extra = k.ipvs[&key(0)].clone();
    extra.service.key = key(9);
    k.ipvs.insert(key(9), extra);
    let rs = k.ipvs[&key(1)].real_servers.keys().next().unwrap();
    k.ipvs.get_mut(&key(1)).unwrap().real_servers.remove(&rs);
    let before = k.clone();
    let mut dry = DryRun::new(&mut k);
    let mut p = Proxier::new(cfg4(), RulesConfig::default(), NODE);
    let r = p.sync(&store, &node_addrs(), &mut dry);
    assert!(r.ok(), "{:?}", r.errors);
    let writes = dry.writes.clone();
    assert_eq!(
        writes,
        vec![
            format!("ipvsadm -a -t 10.96.0.2:80 -r {}:{} -m -w 1", rs.0, rs.1),
            "ipvsadm -D -t 10.96.0.10:80".to_string(),
        ]
    );
    assert_eq!(k.ipvs, before.ipvs, "a dry run changes nothing");
}

/// A periodic full sync that also carries changes received since the last sync applies them,
/// but does not report them as drift: drift is only what the kernel holds that neither the
/// applied state nor the pending changes explain. A real drift in the same sync still counts.
#[test]
fn pending_changes_in_a_full_sync_are_not_drift() {
    let (mut store, mut p, mut k) = programmed(100);
    // Pending: one endpoint replaced, a new Service (VIP, ipset member, virtual server), and a
    // Service deleted.
    let mut changed = slice("default", "svc-50", "svc-50-abc").port("http", 8080, "TCP");
    for e in 0..9 {
        let n = 500 + e;
        changed = changed.ep(
            &format!("10.244.{}.{}", n / 250, n % 250 + 1),
            "node-b",
            C::Ready,
        );
    }
    changed = changed.ep("10.250.0.1", "node-b", C::Ready);
    for ev in [
        SourceEvent::Apply(Object::from(changed.build())),
        SourceEvent::Apply(service_ev(100)),
        SourceEvent::Apply(slice_ev(100, 10, 0)),
        SourceEvent::Delete(service_ev(7)),
    ] {
        let ch = store.apply(ev);
        p.note(&ch);
    }
    p.request_full();
    let r = p.sync(&store, &node_addrs(), &mut k);
    assert_eq!(r.kind, SyncKind::Full);
    assert!(r.ok(), "{:?}", r.errors);
    assert!(
        r.drift.is_empty(),
        "pending changes reported as drift: {:?}",
        r.drift
    );
    assert!(k.ipvs.contains_key(&key(100)));
    assert!(!k.ipvs.contains_key(&key(7)));
    assert!(k.ipvs[&key(50)]
        .real_servers
        .contains_key(&(ip("10.250.0.1"), 8080)));
    assert!(k.addresses.contains(&vip(100)) && !k.addresses.contains(&vip(7)));
    let drift = check_to_the_end(&store, &mut p, &mut k);
    assert!(
        drift.is_empty(),
        "pending changes found as drift: {drift:?}"
    );

    // The same again with a real drift beside a pending change: only the drift counts.
    let mut changed = slice("default", "svc-60", "svc-60-abc").port("http", 8080, "TCP");
    changed = changed.ep("10.250.0.2", "node-b", C::Ready);
    let ch = store.apply(SourceEvent::Apply(Object::from(changed.build())));
    p.note(&ch);
    k.addresses.remove(&vip(3));
    p.request_full();
    let r = p.sync(&store, &node_addrs(), &mut k);
    assert!(r.ok(), "{:?}", r.errors);
    assert!(r.drift.is_empty(), "{:?}", r.drift);
    assert!(k.ipvs[&key(60)]
        .real_servers
        .contains_key(&(ip("10.250.0.2"), 8080)));
    let drift = check_to_the_end(&store, &mut p, &mut k);
    assert_eq!(drift.get("address"), Some(&1), "{drift:?}");
    assert_eq!(drift.len(), 1, "{drift:?}");
    assert!(k.addresses.contains(&vip(3)));
}
