//! Fault injection at the kernel boundary (testkit's `FaultKernel` / `FaultRunner`): every
//! subsystem's failure is retried with the one backoff policy (growing delays, reset after a
//! success), a full sync whose kernel read failed stays pending and deletes nothing, and the
//! report names the failed subsystem from a fixed set. Time is driven with explicit instants
//! (`sync_at`), so nothing here sleeps or depends on timing.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod fixtures;

use std::collections::BTreeSet;
use std::net::IpAddr;
use std::time::{Duration, Instant};

use fixtures::*;
use ipvs_netlink::{Protocol, Service, ServiceKey};
use model::event::{Object, SourceEvent};
use model::store::Store;
use proxier::iptables_mode::{IptablesProxier, RecordingRunner};
use proxier::ipvs_mode::{Proxier, RulesConfig, SyncReport};
use proxier::retry::{RetryPolicy, Subsystem};
use proxier::sync_loop::Backend;
use testkit::fake_kernel::FakeKernel;
use testkit::faults::{Calls, Fault, FaultHandle, FaultKernel, FaultRunner, KernelOp, EBUSY};

const MIN: Duration = Duration::from_secs(1);
const MAX: Duration = Duration::from_secs(30);

fn policy() -> RetryPolicy {
    RetryPolicy::new(MIN, MAX)
}

fn node_addrs() -> BTreeSet<IpAddr> {
    [ip("192.168.0.10")].into_iter().collect()
}

fn store() -> Store {
    synced_store(
        vec![
            svc("default", "web", "10.96.0.10")
                .port("http", 80, "TCP")
                .build(),
            svc("default", "dns", "10.96.0.53")
                .port("dns", 53, "UDP")
                .build(),
        ],
        vec![
            slice("default", "web", "web-1")
                .port("http", 8080, "TCP")
                .ep("10.244.0.7", "node-b", C::Ready)
                .build(),
            slice("default", "dns", "dns-1")
                .port("dns", 53, "UDP")
                .ep("10.244.0.8", "node-b", C::Ready)
                .ep("10.244.0.9", "node-b", C::Ready)
                .build(),
        ],
    )
}

fn web_key() -> ServiceKey {
    ServiceKey::Inet {
        protocol: Protocol::Tcp,
        addr: ip("10.96.0.10"),
        port: 80,
    }
}

fn proxier() -> Proxier {
    Proxier::new(cfg4(), RulesConfig::default(), NODE).with_retry(policy())
}

/// Asserts `due - at` is failure `n`'s nominal delay within the ±15 % jitter.
fn assert_delay(due: Option<Instant>, at: Instant, n: u32) -> Instant {
    let due = due.expect("a retry is scheduled");
    let d = due.duration_since(at).as_secs_f64();
    let nominal = policy().nominal(n).as_secs_f64();
    assert!(
        d >= nominal * 0.85 - 1e-6 && d <= nominal * 1.15 + 1e-6,
        "retry {n}: {d} s is not {nominal} s ±15 %"
    );
    due
}

fn failed(r: &SyncReport) -> Vec<Subsystem> {
    r.failed.keys().copied().collect()
}

/// A programmed proxier on a fault kernel with `store()`'s state.
fn programmed() -> (
    Store,
    Proxier,
    FaultKernel<FakeKernel>,
    FaultHandle,
    Instant,
) {
    let store = store();
    let mut p = proxier();
    let (mut k, h) = FaultKernel::new(FakeKernel::default());
    let t0 = Instant::now();
    let r = p.sync_at(t0, &store, &node_addrs(), &mut k);
    assert!(r.healthy(), "{:?}", r.errors);
    assert_eq!(k.inner.ipvs.len(), 2);
    (store, p, k, h, t0)
}

#[test]
fn failed_kernel_read_keeps_the_full_sync_pending_deletes_nothing_and_backs_off() {
    let store = store();
    // A previous run left an owned virtual server that is no longer wanted, and its VIP.
    let stale = ServiceKey::Inet {
        protocol: Protocol::Tcp,
        addr: ip("10.96.9.9"),
        port: 80,
    };
    let mut fake = FakeKernel::default();
    fake.ipvs.insert(
        stale,
        desired::diff::VirtualServer::new(Service::new(stale, "rr"), Vec::new()),
    );
    fake.link = true;
    fake.addresses.insert(ip("10.96.9.9"));
    let (mut k, h) = FaultKernel::new(fake);
    h.inject(Fault::errno(KernelOp::ReadIpvs, EBUSY, Calls::Range(1, 2)));
    let mut p = proxier();
    let t0 = Instant::now();

    let r = p.sync_at(t0, &store, &node_addrs(), &mut k);
    assert_eq!(failed(&r), [Subsystem::Ipvs]);
    assert!(r.retrying.contains(&Subsystem::Ipvs));
    assert!(!r.healthy());
    assert!(
        k.inner.ipvs.contains_key(&stale),
        "deleted on a failed read"
    );
    assert!(
        p.full_pending(),
        "a full sync with a failed read is not done"
    );
    let due1 = assert_delay(p.retry_due(), t0, 1);
    assert!(!p.pending(t0), "retried before the backoff passed");
    assert!(p.pending(due1));

    // Second attempt fails too: the delay doubles.
    let r = p.sync_at(due1, &store, &node_addrs(), &mut k);
    assert_eq!(failed(&r), [Subsystem::Ipvs]);
    assert!(k.inner.ipvs.contains_key(&stale));
    let due2 = assert_delay(p.retry_due(), due1, 2);

    // The fault clears: the third attempt adopts, and only now is the stale service removed.
    let r = p.sync_at(due2, &store, &node_addrs(), &mut k);
    assert!(r.healthy(), "{:?}", r.errors);
    assert!(!k.inner.ipvs.contains_key(&stale));
    assert!(k.inner.ipvs.contains_key(&web_key()));
    assert!(!p.full_pending());
    assert_eq!(p.retry_due(), None);
    assert_eq!(h.injected(KernelOp::ReadIpvs), 2);
}

/// A periodic drift check reads IPVS a slice at a time after the full sync that listed it: a
/// slice whose read fails is kept, deletes nothing, is retried with backoff and then repairs.
#[test]
fn failed_drift_check_slice_read_deletes_nothing_and_is_retried_with_backoff() {
    let (store, mut p, mut k, h, t0) = programmed();
    // Drift behind the proxier's back: an owned virtual server nobody wants, and web's only
    // real server gone.
    let stale = ServiceKey::Inet {
        protocol: Protocol::Tcp,
        addr: ip("10.96.9.9"),
        port: 80,
    };
    k.inner.ipvs.insert(
        stale,
        desired::diff::VirtualServer::new(Service::new(stale, "rr"), Vec::new()),
    );
    let gone: Vec<_> = k.inner.ipvs[&web_key()].real_servers.keys().collect();
    for r in &gone {
        k.inner
            .ipvs
            .get_mut(&web_key())
            .unwrap()
            .real_servers
            .remove(r);
    }
    p.request_full();
    let r = p.sync_at(t0, &store, &node_addrs(), &mut k);
    assert!(r.healthy(), "{:?}", r.errors);
    assert!(k.inner.ipvs.contains_key(&stale), "only listed so far");
    // The check reads the addresses, then the sets, one step per minSyncPeriod (the first at
    // once), then IPVS.
    let min = policy().min;
    for t in [t0, t0 + min] {
        assert!(p.pending(t), "the check's next step is due");
        let r = p.sync_at(t, &store, &node_addrs(), &mut k);
        assert!(r.healthy(), "{:?}", r.errors);
        assert!(k.inner.ipvs.contains_key(&stale), "IPVS not read yet");
        assert!(!p.pending(t), "the next step waits minSyncPeriod");
    }
    let t1 = t0 + 2 * min;
    assert!(p.pending(t1), "the check's first slice is due");

    h.inject(Fault::errno(KernelOp::ReadIpvsKeys, EBUSY, Calls::Nth(1)));
    let r = p.sync_at(t1, &store, &node_addrs(), &mut k);
    assert_eq!(failed(&r), [Subsystem::Ipvs]);
    assert!(r.retrying.contains(&Subsystem::Ipvs));
    assert!(
        k.inner.ipvs.contains_key(&stale),
        "deleted on a failed read"
    );
    let due1 = assert_delay(p.retry_due(), t1, 1);
    assert!(!p.pending(t1), "retried before the backoff passed");
    assert!(p.pending(due1));

    let r = p.sync_at(due1, &store, &node_addrs(), &mut k);
    assert!(r.healthy(), "{:?}", r.errors);
    assert!(!r.retrying.contains(&Subsystem::Ipvs));
    assert!(!k.inner.ipvs.contains_key(&stale));
    assert_eq!(k.inner.ipvs[&web_key()].real_servers.len(), 1);
    // The stale virtual server, and web's real server: drift.
    assert_eq!(r.drift.get("ipvs"), Some(&2));
    assert_eq!(p.retry_due(), None);
    assert!(!p.pending(due1));
    assert_eq!(h.injected(KernelOp::ReadIpvsKeys), 1);
}

/// A periodic drift check reads the family's addresses, then its sets, one per sync, before
/// IPVS: a read that fails deletes nothing, keeps its step (IPVS waits behind it), is retried
/// with backoff, and then repairs and counts the drift.
#[test]
fn failed_drift_check_address_and_set_reads_delete_nothing_and_are_retried_with_backoff() {
    let (store, mut p, mut k, h, t0) = programmed();
    // Behind the proxier's back: web's VIP unbound, a stray VIP bound, the ClusterIP set
    // destroyed, a stale virtual server.
    let stray = ip("10.96.9.9");
    k.inner.addresses.remove(&ip("10.96.0.10"));
    k.inner.addresses.insert(stray);
    let cluster_ip = k.inner.ipsets.get("KUBE-CLUSTER-IP").cloned();
    assert!(cluster_ip.is_some());
    k.inner.ipsets.remove_set("KUBE-CLUSTER-IP");
    let stale = ServiceKey::Inet {
        protocol: Protocol::Tcp,
        addr: stray,
        port: 80,
    };
    k.inner.ipvs.insert(
        stale,
        desired::diff::VirtualServer::new(Service::new(stale, "rr"), Vec::new()),
    );
    p.request_full();
    let r = p.sync_at(t0, &store, &node_addrs(), &mut k);
    assert_eq!(r.kind, proxier::ipvs_mode::SyncKind::Full);
    assert!(r.healthy(), "{:?}", r.errors);
    assert_eq!(
        h.calls(KernelOp::ReadAddresses),
        1,
        "only the first sync read them"
    );
    assert_eq!(
        h.calls(KernelOp::ReadIpsets),
        1,
        "only the first sync read them"
    );

    // The address step's read fails: nothing is unbound, IPVS is not read past it.
    h.inject(Fault::errno(KernelOp::ReadAddresses, EBUSY, Calls::Nth(1)));
    let r = p.sync_at(t0, &store, &node_addrs(), &mut k);
    assert_eq!(failed(&r), [Subsystem::Address]);
    assert!(r.retrying.contains(&Subsystem::Address));
    assert!(
        k.inner.addresses.contains(&stray),
        "unbound on a failed read"
    );
    assert_eq!(h.calls(KernelOp::ReadIpvsKeys), 0);
    let due1 = assert_delay(p.retry_due(), t0, 1);
    assert!(!p.pending(t0), "retried before the backoff passed");

    // Retried: both addresses repaired, counted as drift.
    let r = p.sync_at(due1, &store, &node_addrs(), &mut k);
    assert!(r.healthy(), "{:?}", r.errors);
    assert!(!r.retrying.contains(&Subsystem::Address));
    assert_eq!(r.drift.get("address"), Some(&2), "{:?}", r.drift);
    assert!(!k.inner.addresses.contains(&stray));
    assert!(k.inner.addresses.contains(&ip("10.96.0.10")));
    assert!(
        k.inner.ipsets.get("KUBE-CLUSTER-IP").is_none(),
        "one read per sync"
    );

    // The set step comes minSyncPeriod later. Its read fails: nothing changes; then it
    // repairs.
    let min = policy().min;
    assert!(!p.pending(due1), "the next step waits minSyncPeriod");
    let t2 = due1 + min;
    h.inject(Fault::errno(KernelOp::ReadIpsets, EBUSY, Calls::Nth(1)));
    let r = p.sync_at(t2, &store, &node_addrs(), &mut k);
    assert_eq!(failed(&r), [Subsystem::Ipset]);
    assert!(r.retrying.contains(&Subsystem::Ipset));
    assert!(k.inner.ipsets.get("KUBE-CLUSTER-IP").is_none());
    assert_eq!(h.calls(KernelOp::ReadIpvsKeys), 0);
    let due2 = assert_delay(p.retry_due(), t2, 1);
    let r = p.sync_at(due2, &store, &node_addrs(), &mut k);
    assert!(r.healthy(), "{:?}", r.errors);
    assert!(
        r.drift.get("ipset").is_some_and(|n| *n > 0),
        "{:?}",
        r.drift
    );
    assert_eq!(k.inner.ipsets.get("KUBE-CLUSTER-IP"), cluster_ip.as_ref());
    assert!(k.inner.ipvs.contains_key(&stale), "IPVS is the next step");

    // Then IPVS, a slice, minSyncPeriod later: the stale virtual server goes; the check ends.
    let t3 = due2 + min;
    let r = p.sync_at(t3, &store, &node_addrs(), &mut k);
    assert!(r.healthy(), "{:?}", r.errors);
    assert_eq!(r.drift.get("ipvs"), Some(&1), "{:?}", r.drift);
    assert!(!k.inner.ipvs.contains_key(&stale));
    assert!(!p.pending(t3));
    assert_eq!(p.retry_due(), None);
    assert_eq!(h.calls(KernelOp::ReadAddresses), 3);
    assert_eq!(h.calls(KernelOp::ReadIpsets), 3);
}

#[test]
fn failed_ipset_apply_is_retried_with_growing_delay_and_reset_after_success() {
    let (mut store, mut p, mut k, h, t0) = programmed();
    h.inject(Fault::errno(KernelOp::ApplyIpsets, EBUSY, Calls::From(1)));
    // A new NodePort service needs set members.
    let ch = store.apply(SourceEvent::Apply(Object::from(
        svc("default", "np", "10.96.0.30")
            .node_port("http", 80, "TCP", 30080)
            .build(),
    )));
    p.note(&ch);
    let t1 = t0 + Duration::from_secs(1);
    let r = p.sync_at(t1, &store, &node_addrs(), &mut k);
    assert!(failed(&r).contains(&Subsystem::Ipset), "{:?}", r.errors);
    assert!(r.retrying.contains(&Subsystem::Ipset));
    let mut due = assert_delay(p.retry_due_of(Subsystem::Ipset), t1, 1);
    assert!(!p.pending(t1));
    for n in 2..=4 {
        let r = p.sync_at(due, &store, &node_addrs(), &mut k);
        assert_eq!(failed(&r), [Subsystem::Ipset], "{:?}", r.errors);
        let next = assert_delay(p.retry_due_of(Subsystem::Ipset), due, n);
        due = next;
    }
    assert_eq!(p.retry_failures(Subsystem::Ipset), Some(4));
    // Not a full resync every minSyncPeriod: one read of the sets per retry, no IPVS dump.
    assert_eq!(h.calls(KernelOp::ReadIpvs), 1);
    h.clear();
    let r = p.sync_at(due, &store, &node_addrs(), &mut k);
    assert!(r.healthy(), "{:?}", r.errors);
    assert_eq!(p.retry_failures(Subsystem::Ipset), Some(0));
    let np = k
        .inner
        .ipsets
        .get("KUBE-NODE-PORT-TCP")
        .expect("set exists");
    assert_eq!(np.entries.len(), 1);
    // Reset: the next failure starts again at the first delay.
    h.inject(Fault::errno(KernelOp::ApplyIpsets, EBUSY, Calls::Always));
    let ch = store.apply(SourceEvent::Delete(Object::from(
        svc("default", "np", "10.96.0.30")
            .node_port("http", 80, "TCP", 30080)
            .build(),
    )));
    p.note(&ch);
    let r = p.sync_at(due, &store, &node_addrs(), &mut k);
    assert!(failed(&r).contains(&Subsystem::Ipset));
    assert_delay(p.retry_due_of(Subsystem::Ipset), due, 1);
}

#[test]
fn failed_iptables_restore_is_retried_within_min_sync_period_not_a_whole_sync_period() {
    let (mut store, mut p, mut k, h, t0) = programmed();
    h.inject(Fault::errno(KernelOp::ApplyIptables, EBUSY, Calls::Always));
    // An externalIP service changes the rules.
    let ch = store.apply(SourceEvent::Apply(Object::from(
        svc("default", "ext", "10.96.0.40")
            .port("http", 80, "TCP")
            .external_ips(&["203.0.113.5"])
            .build(),
    )));
    p.note(&ch);
    let r = p.sync_at(t0, &store, &node_addrs(), &mut k);
    assert!(r.iptables_restore_failed);
    assert!(failed(&r).contains(&Subsystem::Iptables));
    let due = assert_delay(p.retry_due_of(Subsystem::Iptables), t0, 1);
    assert!(due < t0 + MAX);
    let r = p.sync_at(due, &store, &node_addrs(), &mut k);
    assert_eq!(failed(&r), [Subsystem::Iptables]);
    let due2 = assert_delay(p.retry_due_of(Subsystem::Iptables), due, 2);
    h.clear();
    let r = p.sync_at(due2, &store, &node_addrs(), &mut k);
    assert!(r.healthy(), "{:?}", r.errors);
    assert!(r.iptables_restored);
    assert_eq!(p.retry_failures(Subsystem::Iptables), Some(0));
    assert!(k.inner.iptables["nat"].contains("KUBE-EXTERNAL-IP"));
}

#[test]
fn failed_ipvs_operation_and_failed_repair_read_back_off_then_repair() {
    let (mut store, mut p, mut k, h, t0) = programmed();
    h.inject(Fault::errno(KernelOp::ApplyIpvs, EBUSY, Calls::Nth(1)));
    h.inject(Fault::errno(KernelOp::ReadIpvsKeys, EBUSY, Calls::Nth(1)));
    let ch = store.apply(SourceEvent::Apply(Object::from(
        slice("default", "web", "web-1")
            .port("http", 8080, "TCP")
            .ep("10.244.0.7", "node-b", C::Ready)
            .ep("10.244.0.17", "node-b", C::Ready)
            .build(),
    )));
    p.note(&ch);
    let r = p.sync_at(t0, &store, &node_addrs(), &mut k);
    assert_eq!(failed(&r), [Subsystem::Ipvs]);
    let due1 = assert_delay(p.retry_due_of(Subsystem::Ipvs), t0, 1);
    // The repair's read fails: the delay grows.
    let r = p.sync_at(due1, &store, &node_addrs(), &mut k);
    assert_eq!(failed(&r), [Subsystem::Ipvs]);
    let due2 = assert_delay(p.retry_due_of(Subsystem::Ipvs), due1, 2);
    let r = p.sync_at(due2, &store, &node_addrs(), &mut k);
    assert!(r.healthy(), "{:?}", r.errors);
    assert_eq!(k.inner.ipvs[&web_key()].real_servers.len(), 2);
    assert_eq!(p.retry_failures(Subsystem::Ipvs), Some(0));
}

#[test]
fn failed_conntrack_cleanup_keeps_its_filters_and_retries() {
    let (mut store, mut p, mut k, h, t0) = programmed();
    h.inject(Fault::errno(
        KernelOp::DeleteConntrack,
        EBUSY,
        Calls::Nth(1),
    ));
    // One UDP endpoint goes away: its flows must be cleaned.
    let ch = store.apply(SourceEvent::Apply(Object::from(
        slice("default", "dns", "dns-1")
            .port("dns", 53, "UDP")
            .ep("10.244.0.8", "node-b", C::Ready)
            .build(),
    )));
    p.note(&ch);
    let r = p.sync_at(t0, &store, &node_addrs(), &mut k);
    assert_eq!(failed(&r), [Subsystem::Conntrack]);
    assert!(r.retrying.contains(&Subsystem::Conntrack));
    assert!(k.inner.conntrack.is_empty());
    let due = assert_delay(p.retry_due_of(Subsystem::Conntrack), t0, 1);
    assert!(!p.pending(t0));
    assert!(p.pending(due));
    let r = p.sync_at(due, &store, &node_addrs(), &mut k);
    assert!(r.healthy(), "{:?}", r.errors);
    assert_eq!(k.inner.conntrack.len(), 1, "the kept filter was delivered");
    assert_eq!(k.inner.conntrack[0].orig_dst, ip("10.96.0.53"));
}

#[test]
fn failed_address_change_is_repaired_with_backoff() {
    let (mut store, mut p, mut k, h, t0) = programmed();
    h.inject(Fault::errno(
        KernelOp::ApplyAddresses,
        EBUSY,
        Calls::Range(1, 2),
    ));
    let ch = store.apply(SourceEvent::Apply(Object::from(
        svc("default", "new", "10.96.0.60")
            .port("http", 80, "TCP")
            .build(),
    )));
    p.note(&ch);
    let r = p.sync_at(t0, &store, &node_addrs(), &mut k);
    assert_eq!(failed(&r), [Subsystem::Address]);
    let due = assert_delay(p.retry_due_of(Subsystem::Address), t0, 1);
    let r = p.sync_at(due, &store, &node_addrs(), &mut k);
    assert_eq!(failed(&r), [Subsystem::Address]);
    let due2 = assert_delay(p.retry_due_of(Subsystem::Address), due, 2);
    let r = p.sync_at(due2, &store, &node_addrs(), &mut k);
    assert!(r.healthy(), "{:?}", r.errors);
    assert!(k.inner.addresses.contains(&ip("10.96.0.60")));
}

#[test]
fn iptables_mode_failed_save_keeps_the_full_sync_pending_and_restores_back_off() {
    let store = store();
    let (runner, h) = FaultRunner::new(RecordingRunner::default());
    let mut p = IptablesProxier::new(cfg4(), RulesConfig::default(), NODE, Box::new(runner))
        .with_retry(policy());
    h.inject(Fault::errno(KernelOp::SaveIptables, EBUSY, Calls::Nth(1)));
    let t0 = Instant::now();
    let r = p.sync_at(t0, &store, &node_addrs());
    assert_eq!(failed(&r), [Subsystem::Iptables]);
    assert!(r.retrying.contains(&Subsystem::Iptables));
    let (n, due) = p.retry_state();
    assert_eq!(n, 1);
    let due = assert_delay(due, t0, 1);
    assert!(!Backend::pending(&p, t0));
    assert!(Backend::pending(&p, due), "the full sync stays requested");
    // Restores fail twice: the delay grows; then success resets it.
    h.inject(Fault::errno(
        KernelOp::ApplyIptables,
        EBUSY,
        Calls::Range(1, 2),
    ));
    let r = p.sync_at(due, &store, &node_addrs());
    assert!(r.iptables_restore_failed, "{:?}", r.errors);
    let due2 = assert_delay(p.retry_state().1, due, 2);
    let r = p.sync_at(due2, &store, &node_addrs());
    assert!(r.iptables_restore_failed);
    let due3 = assert_delay(p.retry_state().1, due2, 3);
    let r = p.sync_at(due3, &store, &node_addrs());
    assert!(r.healthy(), "{:?}", r.errors);
    assert_eq!(p.retry_state(), (0, None));
    assert!(!Backend::pending(&p, due3));
}

/// Found by `e2e_xtables_lock` (VM): with the xtables lock held, an incremental sync that only
/// grows sets restored the same rules twice (before IPVS and again at the end), so it waited
/// 2 × 5 s on the lock and programmed IPVS late. The same rules are tried once per sync; a
/// change that empties a set still gets its second, different restore.
#[test]
fn failed_restore_is_tried_once_per_sync_unless_a_set_became_empty() {
    let (mut store, mut p, mut k, h, t0) = programmed();
    h.inject(Fault::errno(KernelOp::ApplyIptables, EBUSY, Calls::Always));
    let ext = |ips: &[&str]| {
        Object::from(
            svc("default", "ext", "10.96.0.40")
                .port("http", 80, "TCP")
                .external_ips(ips)
                .build(),
        )
    };
    let before = h.calls(KernelOp::ApplyIptables);
    let ch = store.apply(SourceEvent::Apply(ext(&["203.0.113.5"])));
    p.note(&ch);
    let r = p.sync_at(t0, &store, &node_addrs(), &mut k);
    assert!(r.iptables_restore_failed);
    assert_eq!(h.calls(KernelOp::ApplyIptables) - before, 1);
    // IPVS was programmed all the same.
    assert!(k.inner.ipvs.keys().any(|key| matches!(key,
        ServiceKey::Inet { addr, .. } if *addr == "203.0.113.5".parse::<IpAddr>().unwrap())));

    // Succeeds; then the external IP goes: KUBE-EXTERNAL-IP empties, two different rule sets.
    h.clear();
    let due = p.retry_due_of(Subsystem::Iptables).unwrap();
    let r = p.sync_at(due, &store, &node_addrs(), &mut k);
    assert!(r.healthy(), "{:?}", r.errors);
    assert!(k.inner.iptables["nat"].contains("KUBE-EXTERNAL-IP"));
    let before = h.calls(KernelOp::ApplyIptables);
    let ch = store.apply(SourceEvent::Apply(ext(&[])));
    p.note(&ch);
    let r = p.sync_at(due + MAX, &store, &node_addrs(), &mut k);
    assert!(r.healthy(), "{:?}", r.errors);
    assert_eq!(h.calls(KernelOp::ApplyIptables) - before, 2);
    assert!(!k.inner.iptables["nat"].contains("KUBE-EXTERNAL-IP"));
}

/// A full program larger than one chunk of IPVS operations on a kernel that answers nothing:
/// the first chunk fails as a whole, the rest is not sent (one call, not one per chunk, so a
/// kernel that times out costs one timeout), every virtual server is marked for repair, and
/// the retry programs everything once the kernel answers again.
#[test]
fn failed_ipvs_chunk_stops_the_rest_and_everything_is_repaired() {
    use proxier::ipvs_mode::IPVS_APPLY_CHUNK;
    const N: usize = 500; // 500 services x 10 endpoints: 5,500 operations, two chunks
    let store = two_chunk_store(N);
    let mut p = proxier();
    let (mut k, h) = FaultKernel::new(FakeKernel::default());
    h.inject(Fault::errno(KernelOp::ApplyIpvs, EBUSY, Calls::Nth(1)));
    let t0 = Instant::now();
    let r = p.sync_at(t0, &store, &node_addrs(), &mut k);
    const { assert!(N * 11 > IPVS_APPLY_CHUNK, "the program spans two chunks") };
    assert_eq!(failed(&r), [Subsystem::Ipvs]);
    assert_eq!(
        h.calls(KernelOp::ApplyIpvs),
        1,
        "the second chunk was not sent"
    );
    assert_eq!(r.ipvs_failures, N * 11, "every operation counted as failed");
    assert!(k.inner.ipvs.is_empty());
    let due = assert_delay(p.retry_due_of(Subsystem::Ipvs), t0, 1);
    let r = p.sync_at(due, &store, &node_addrs(), &mut k);
    assert!(r.healthy(), "{:?}", r.errors);
    assert_eq!(k.inner.ipvs.len(), N);
    assert!(k.inner.ipvs.values().all(|vs| vs.real_servers.len() == 10));
}

/// The first sync's program, generated while it is sent, arrives whole in full chunks: on a
/// kernel that already holds part of it (a restart) and drifted, exactly the missing and
/// differing operations are sent, in chunks of `IPVS_APPLY_CHUNK`, and the kernel ends equal
/// to the desired table.
#[test]
fn first_program_spanning_chunks_arrives_whole() {
    use proxier::ipvs_mode::IPVS_APPLY_CHUNK;
    const N: usize = 500;
    let store = two_chunk_store(N);
    // The table of a previous run: every fifth virtual server, one with drifted weights.
    let mut reference = proxier();
    let mut full = FakeKernel::default();
    assert!(reference.sync(&store, &node_addrs(), &mut full).healthy());
    let desired = reference.desired().ipvs_table();
    let mut kept = FakeKernel::default();
    for (k, vs) in desired.iter().step_by(5) {
        kept.ipvs.insert(*k, vs.clone());
    }
    let drifted = kept
        .ipvs
        .values_mut()
        .next()
        .expect("a kept virtual server");
    drifted
        .real_servers
        .values_mut()
        .for_each(|mut d| d.weight = 3);
    let kept_n = kept.ipvs.len();
    let (mut k, h) = FaultKernel::new(kept);
    let mut p = proxier();
    let r = p.sync(&store, &node_addrs(), &mut k);
    assert!(r.healthy(), "{:?}", r.errors);
    let want_ops = (N - kept_n) * 11 + 10; // the missing servers, and 10 SetDest
    assert_eq!(r.ipvs_ops, want_ops);
    assert!(want_ops > IPVS_APPLY_CHUNK, "the program spans two chunks");
    assert_eq!(
        h.calls(KernelOp::ApplyIpvs) as usize,
        want_ops.div_ceil(IPVS_APPLY_CHUNK)
    );
    assert_eq!(k.inner.ipvs, desired);
    assert_eq!(p.desired().ipvs_table(), desired);
}

/// `n` services with 10 ready endpoints each (`n` x 11 IPVS operations to program).
fn two_chunk_store(n: usize) -> model::store::Store {
    let svcs = (0..n)
        .map(|i| {
            svc(
                "default",
                &format!("s{i}"),
                &format!("10.96.{}.{}", i / 250, i % 250 + 1),
            )
            .port("http", 80, "TCP")
            .build()
        })
        .collect();
    let slices = (0..n)
        .map(|i| {
            let mut b =
                slice("default", &format!("s{i}"), &format!("s{i}-1")).port("http", 8080, "TCP");
            for e in 0..10 {
                b = b.ep(
                    &format!("10.244.{}.{}", i / 25, (i % 25) * 10 + e + 1),
                    "node-b",
                    C::Ready,
                );
            }
            b.build()
        })
        .collect();
    synced_store(svcs, slices)
}

/// Issue #32: a targeted IPVS repair applies its diff through graceful termination exactly as a
/// sync does. One update of `web` moves its endpoint from .7 (a live connection) to .17; the
/// batch fails (EBUSY), so the kernel still has .7 at weight 1. The repair's re-read shows .7
/// as unwanted: before the fix the repair deleted it (the held connection was cut); now its
/// weight goes to 0 and it drains like any leaving real server.
#[test]
fn repair_after_a_failed_request_drains_the_leaving_real_server_instead_of_deleting_it() {
    let (mut store, mut p, mut k, h, t0) = programmed();
    let old = (ip("10.244.0.7"), 8080);
    let new = (ip("10.244.0.17"), 8080);
    // A held connection on the endpoint about to leave.
    {
        let vs = k.inner.ipvs.get_mut(&web_key()).expect("web programmed");
        let mut d = vs
            .real_servers
            .get_mut(&old)
            .expect("endpoint .7 programmed");
        d.active_conns = 1;
    }
    h.inject(Fault::errno(KernelOp::ApplyIpvs, EBUSY, Calls::Nth(1)));
    let ch = store.apply(SourceEvent::Apply(Object::from(
        slice("default", "web", "web-1")
            .port("http", 8080, "TCP")
            .ep("10.244.0.17", "node-b", C::Ready)
            .build(),
    )));
    p.note(&ch);
    let r = p.sync_at(t0, &store, &node_addrs(), &mut k);
    assert_eq!(failed(&r), [Subsystem::Ipvs], "{:?}", r.errors);
    let reals = &k.inner.ipvs[&web_key()].real_servers;
    assert_eq!(
        reals.get(&old).map(|d| d.weight),
        Some(1),
        "the batch failed"
    );
    assert!(reals.get(&new).is_none());

    let due = assert_delay(p.retry_due_of(Subsystem::Ipvs), t0, 1);
    let r = p.sync_at(due, &store, &node_addrs(), &mut k);
    assert!(r.healthy(), "{:?}", r.errors);
    let reals = &k.inner.ipvs[&web_key()].real_servers;
    let drained = reals
        .get(&old)
        .expect("the repair deleted a real server with a live connection");
    assert_eq!(drained.weight, 0, "it drains: no new connection picks it");
    assert_eq!(drained.active_conns, 1);
    assert_eq!(reals.get(&new).map(|d| d.weight), Some(1));
    assert_eq!(p.draining(), 1);
}
