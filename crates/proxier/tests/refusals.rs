//! Kernel-refused programming is isolated per Service (issue #32): a request the kernel answers
//! with a definite error (EINVAL, ENOENT, ...) for one Service is retried once like any failure
//! (a targeted repair re-reads the kernel); refused again, the Service is isolated: reported
//! once (a `Refusal` for its Event and metric), what the kernel holds for it kept, retried with
//! its own backoff, and the sync is healthy. Transient errors (ENOMEM, timeouts) keep failing
//! the subsystem. testkit's `FaultKernel` refuses chosen virtual servers and set members; time
//! is driven with explicit instants (`sync_at`), so nothing here sleeps.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod fixtures;

use std::collections::BTreeSet;
use std::net::IpAddr;
use std::time::{Duration, Instant};

use fixtures::*;
use ipvs_netlink::OpKind;
use ipvs_netlink::{Protocol, ServiceKey};
use model::event::{Object, SourceEvent};
use model::store::Store;
use model::ServiceName;
use proxier::ipvs_mode::{Proxier, RulesConfig, IPSET_REJECTED};
use proxier::retry::{RetryPolicy, Subsystem};
use testkit::fake_kernel::FakeKernel;
use testkit::faults::{FaultHandle, FaultKernel, EINVAL, ENOENT, ENOMEM};

const MIN: Duration = Duration::from_secs(1);
const MAX: Duration = Duration::from_secs(30);

fn policy() -> RetryPolicy {
    RetryPolicy::new(MIN, MAX)
}

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

fn failed(r: &proxier::ipvs_mode::SyncReport) -> Vec<Subsystem> {
    r.failed.keys().copied().collect()
}

/// `web` (10.96.0.10, one endpoint) programmed on a fault kernel.
fn programmed() -> (
    Store,
    Proxier,
    FaultKernel<FakeKernel>,
    FaultHandle,
    Instant,
) {
    let store = synced_store(
        vec![svc("default", "web", "10.96.0.10")
            .port("http", 80, "TCP")
            .build()],
        vec![slice("default", "web", "web-1")
            .port("http", 8080, "TCP")
            .ep("10.244.0.7", "node-b", C::Ready)
            .build()],
    );
    let mut p = Proxier::new(cfg4(), RulesConfig::default(), NODE).with_retry(policy());
    let (mut k, h) = FaultKernel::new(FakeKernel::default());
    let t0 = Instant::now();
    let r = p.sync_at(t0, &store, &node_addrs(), &mut k);
    assert!(r.healthy(), "{:?}", r.errors);
    (store, p, k, h, t0)
}

fn add_bad(store: &mut Store, p: &mut Proxier) {
    let ch = store.apply(SourceEvent::Apply(Object::from(
        svc("default", "bad", "10.96.0.70")
            .port("http", 80, "TCP")
            .build(),
    )));
    p.note(&ch);
    let ch = store.apply(SourceEvent::Apply(Object::from(
        slice("default", "bad", "bad-1")
            .port("http", 8080, "TCP")
            .ep("10.244.0.70", "node-b", C::Ready)
            .build(),
    )));
    p.note(&ch);
}

#[test]
fn a_service_the_kernel_refuses_is_isolated_reported_once_retried_and_the_node_stays_healthy() {
    let (mut store, mut p, mut k, h, t0) = programmed();
    let bad = key("10.96.0.70", 80);
    h.refuse_ipvs(bad, EINVAL);
    add_bad(&mut store, &mut p);

    // First failure: counted like any other, a targeted repair is scheduled.
    let r = p.sync_at(t0, &store, &node_addrs(), &mut k);
    assert_eq!(failed(&r), [Subsystem::Ipvs], "{:?}", r.errors);
    assert_eq!(p.refused_services(), 0);
    let due = p
        .retry_due_of(Subsystem::Ipvs)
        .expect("a repair is scheduled");

    // The repair re-reads the kernel and is refused again: isolated, not a failure.
    let r = p.sync_at(due, &store, &node_addrs(), &mut k);
    assert!(r.healthy(), "{:?} {:?}", r.errors, r.retrying);
    assert!(r.refused.get(&Subsystem::Ipvs).is_some_and(|n| *n > 0));
    assert_eq!(p.refused_services(), 1);
    let refusals = p.take_refusals();
    assert_eq!(refusals.len(), 1, "{refusals:?}");
    assert_eq!(refusals[0].service, ServiceName::new("default", "bad"));
    assert_eq!(refusals[0].subsystem, Subsystem::Ipvs);
    assert_eq!(refusals[0].reason, "einval");
    assert!(!k.inner.ipvs.contains_key(&bad));

    // Other Services are programmed meanwhile, in healthy syncs.
    let ch = store.apply(SourceEvent::Apply(Object::from(
        slice("default", "web", "web-1")
            .port("http", 8080, "TCP")
            .ep("10.244.0.7", "node-b", C::Ready)
            .ep("10.244.0.8", "node-b", C::Ready)
            .build(),
    )));
    p.note(&ch);
    let r = p.sync_at(due, &store, &node_addrs(), &mut k);
    assert!(r.healthy(), "{:?}", r.errors);
    assert_eq!(k.inner.ipvs[&key("10.96.0.10", 80)].real_servers.len(), 2);

    // Retried with a growing backoff, still refused: reported once, still healthy.
    let retry1 = p.retry_due().expect("the isolated Service is retried");
    assert!(retry1 > due, "no retry before its backoff");
    assert!(!p.pending(due));
    let r = p.sync_at(retry1, &store, &node_addrs(), &mut k);
    assert!(r.healthy(), "{:?}", r.errors);
    assert!(p.take_refusals().is_empty(), "reported once per isolation");
    let retry2 = p.retry_due().expect("retried again");
    assert!(
        retry2.duration_since(retry1) > retry1.duration_since(due),
        "the backoff grows"
    );

    // A full sync (drift check) diffs the whole table: the refused Service is still
    // isolated, not counted.
    p.request_full();
    let r = p.sync_at(retry2, &store, &node_addrs(), &mut k);
    assert!(r.healthy(), "{:?}", r.errors);
    assert!(r.drift.is_empty(), "a refusal is not drift: {:?}", r.drift);
    assert_eq!(p.refused_services(), 1);

    // The kernel accepts it again: the next retry programs it and ends the isolation.
    h.accept_ipvs(&bad);
    let retry3 = p.retry_due().expect("retried again");
    let r = p.sync_at(retry3, &store, &node_addrs(), &mut k);
    assert!(r.healthy(), "{:?}", r.errors);
    assert_eq!(p.refused_services(), 0);
    assert_eq!(k.inner.ipvs[&bad].real_servers.len(), 1);
    // The drift check that full sync started runs its steps (each due on its own timer) to
    // the end; then nothing is due any more: no retry is left.
    let mut at = retry3;
    for _ in 0..100 {
        let Some(due) = p.retry_due() else { break };
        at = at.max(due);
        let r = p.sync_at(at, &store, &node_addrs(), &mut k);
        assert!(r.healthy(), "{:?}", r.errors);
    }
    assert_eq!(p.retry_due(), None);
}

/// Last-good: a refused change of an existing Service leaves what the kernel holds for it.
#[test]
fn a_refused_change_keeps_the_last_good_virtual_server() {
    let (mut store, mut p, mut k, h, t0) = programmed();
    let web = key("10.96.0.10", 80);
    let before = k.inner.ipvs[&web].clone();
    // The Service asks for a scheduler whose module the node lacks (ENOENT from the kernel).
    h.refuse_ipvs(web, ENOENT);
    let ch = store.apply(SourceEvent::Apply(Object::from(
        svc("default", "web", "10.96.0.10")
            .port("http", 80, "TCP")
            .annotate("kube-ipvs.io/scheduler", "mh")
            .build(),
    )));
    p.note(&ch);
    let r = p.sync_at(t0, &store, &node_addrs(), &mut k);
    assert_eq!(failed(&r), [Subsystem::Ipvs], "{:?}", r.errors);
    let due = p.retry_due_of(Subsystem::Ipvs).unwrap();
    let r = p.sync_at(due, &store, &node_addrs(), &mut k);
    assert!(r.healthy(), "{:?}", r.errors);
    assert_eq!(p.refused_services(), 1);
    assert_eq!(p.take_refusals()[0].reason, "enoent");
    assert_eq!(
        k.inner.ipvs[&web], before,
        "the last-good virtual server is kept"
    );
}

/// Transient errors are not refusals: the subsystem keeps failing (and `/healthz` follows).
#[test]
fn transient_errors_are_not_isolated() {
    let (mut store, mut p, mut k, h, t0) = programmed();
    let bad = key("10.96.0.70", 80);
    h.refuse_ipvs(bad, ENOMEM);
    add_bad(&mut store, &mut p);
    let r = p.sync_at(t0, &store, &node_addrs(), &mut k);
    assert_eq!(failed(&r), [Subsystem::Ipvs]);
    let mut at = t0;
    for _ in 0..3 {
        at = p.retry_due_of(Subsystem::Ipvs).unwrap();
        let r = p.sync_at(at, &store, &node_addrs(), &mut k);
        assert_eq!(failed(&r), [Subsystem::Ipvs], "{:?}", r.errors);
        assert!(!r.healthy());
        assert!(r.refused.is_empty());
    }
    assert_eq!(p.refused_services(), 0);
    assert!(p.take_refusals().is_empty());
    h.clear();
    let at = p.retry_due_of(Subsystem::Ipvs).map_or(at, |d| d);
    let r = p.sync_at(at, &store, &node_addrs(), &mut k);
    assert!(r.healthy(), "{:?}", r.errors);
    assert!(k.inner.ipvs.contains_key(&bad));
}

/// An ipset member the kernel rejects for one Service: the sets' repair names its owner, the
/// Service is isolated and the other members are programmed.
#[test]
fn a_rejected_set_member_isolates_its_service() {
    let (mut store, mut p, mut k, h, t0) = programmed();
    let rejected = ipset::Entry::ip_port(ip("10.96.0.80"), ipset::Protocol::Tcp, 80);
    h.reject_ipset_entry(rejected.clone());
    for (name, vip) in [("bad", "10.96.0.80"), ("good", "10.96.0.81")] {
        let ch = store.apply(SourceEvent::Apply(Object::from(
            svc("default", name, vip).port("http", 80, "TCP").build(),
        )));
        p.note(&ch);
    }
    let r = p.sync_at(t0, &store, &node_addrs(), &mut k);
    assert_eq!(failed(&r), [Subsystem::Ipset], "{:?}", r.errors);
    let due = p.retry_due_of(Subsystem::Ipset).unwrap();
    let r = p.sync_at(due, &store, &node_addrs(), &mut k);
    assert!(r.healthy(), "{:?} {:?}", r.errors, r.retrying);
    assert_eq!(p.refused_services(), 1);
    let refusals = p.take_refusals();
    assert_eq!(refusals[0].service, ServiceName::new("default", "bad"));
    assert_eq!(refusals[0].subsystem, Subsystem::Ipset);
    assert_eq!(refusals[0].reason, IPSET_REJECTED);
    let members = &k.inner.ipsets.get("KUBE-CLUSTER-IP").unwrap().entries;
    assert!(members.contains_key(&ipset::Entry::ip_port(
        ip("10.96.0.81"),
        ipset::Protocol::Tcp,
        80
    )));
    assert!(!members.contains_key(&rejected));
    // A full sync's set diff names the owner: isolated, not counted.
    p.request_full();
    let at = due + MAX;
    let r = p.sync_at(at, &store, &node_addrs(), &mut k);
    assert!(r.healthy(), "{:?}", r.errors);
    assert!(r.drift.is_empty(), "a refusal is not drift: {:?}", r.drift);
    // Accepted again: the retry adds the member and ends the isolation.
    h.clear();
    let at = p.retry_due().unwrap().max(at);
    let r = p.sync_at(at, &store, &node_addrs(), &mut k);
    assert!(r.healthy(), "{:?}", r.errors);
    assert_eq!(p.refused_services(), 0);
    let members = &k.inner.ipsets.get("KUBE-CLUSTER-IP").unwrap().entries;
    assert!(members.contains_key(&rejected));
}

/// A definite error that follows from a transient one in the same batch (NewDest ESRCH after
/// its NewService hit ENOMEM) is not a refusal: the virtual server keeps failing the subsystem
/// and nothing is reported as refused.
#[test]
fn definite_errors_caused_by_a_transient_one_are_not_isolated() {
    let (mut store, mut p, mut k, h, t0) = programmed();
    let bad = key("10.96.0.70", 80);
    h.refuse_ipvs_op(bad, OpKind::NewService, ENOMEM);
    h.refuse_ipvs_op(bad, OpKind::NewDest, 3); // ESRCH: no such service
    add_bad(&mut store, &mut p);
    let r = p.sync_at(t0, &store, &node_addrs(), &mut k);
    assert_eq!(failed(&r), [Subsystem::Ipvs]);
    let due = p.retry_due_of(Subsystem::Ipvs).unwrap();
    let r = p.sync_at(due, &store, &node_addrs(), &mut k);
    assert_eq!(failed(&r), [Subsystem::Ipvs], "{:?}", r.errors);
    assert!(r.refused.is_empty(), "{:?}", r.refused);
    assert_eq!(p.refused_services(), 0);
    assert!(p.take_refusals().is_empty());
}
