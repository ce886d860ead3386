//! A restart keeps what the previous run programmed unless the object behind it is known gone:
//! an invalid Service keeps its kernel state (adopted), a first sync without the Node keeps the
//! NodePort virtual servers it cannot compute, and the loop's bounded input channel loses nothing
//! under a burst far larger than its capacity. All against the in-memory kernel.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod fixtures;

use std::collections::BTreeSet;
use std::net::IpAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use fixtures::*;
use ipvs_netlink::{Protocol, ServiceKey};
use k8s_openapi::api::core::v1::Service;
use model::event::{Kind, Object, SourceEvent};
use model::store::Store;
use model::{ProxyConfig, ServiceName};
use proxier::adopt::unresolved_node_ports;
use proxier::ipvs_mode::{Proxier, RulesConfig, SyncKind};
use proxier::sync_loop::{self, Backend, Exit, FamilyProxier, Input, LoopConfig, NoObserver};
use testkit::fake_kernel::{FakeKernel, SharedFakeKernel};

fn node_addrs() -> BTreeSet<IpAddr> {
    [ip("192.168.0.10"), ip("10.0.0.10")].into_iter().collect()
}

/// A LoadBalancer service with every kind of VIP, a NodePort, a health-check node port and a
/// local endpoint (hairpin entry): everything a restart could lose.
fn web(valid: bool) -> Service {
    let mut s = svc("default", "web", "10.96.0.10")
        .node_port("http", 80, "TCP", 30080)
        .external_ips(&["203.0.113.5"])
        .lb_ingress(&["198.51.100.7"])
        .source_ranges(&["192.168.0.0/16"])
        .etp_local()
        .hcnp(31000);
    if !valid {
        // Rejected by the model: an unknown sessionAffinity.
        s = s.with(|spec| spec.session_affinity = Some("Sometimes".into()));
    }
    s.build()
}

fn web_slice(eps: &[&str]) -> Object {
    let mut s = slice("default", "web", "web-1").port("http", 8080, "TCP");
    for e in eps {
        s = s.ep(e, NODE, C::Ready);
    }
    Object::from(s.build())
}

fn other() -> Service {
    svc("default", "other", "10.96.0.20")
        .port("http", 80, "TCP")
        .build()
}

fn other_slice() -> Object {
    Object::from(
        slice("default", "other", "other-1")
            .port("http", 8080, "TCP")
            .ep("10.244.2.1", "node-b", C::Ready)
            .build(),
    )
}

fn store_of(svcs: Vec<Service>, slices: Vec<Object>, node: bool) -> Store {
    let mut store = Store::new();
    if node {
        store.apply(SourceEvent::Init(Kind::Node));
        store.apply(SourceEvent::InitApply(Object::Node(Box::new(node_obj(
            NODE,
            "zone-a",
            "192.168.0.10",
        )))));
        store.apply(SourceEvent::InitDone(Kind::Node));
    }
    store.apply(SourceEvent::Init(Kind::Service));
    for s in svcs {
        store.apply(SourceEvent::InitApply(Object::from(s)));
    }
    store.apply(SourceEvent::InitDone(Kind::Service));
    store.apply(SourceEvent::Init(Kind::EndpointSlice));
    for s in slices {
        store.apply(SourceEvent::InitApply(s));
    }
    store.apply(SourceEvent::InitDone(Kind::EndpointSlice));
    assert!(store.synced());
    store
}

/// The parts of the kernel a restart must not change.
fn kernel_state(k: &FakeKernel) -> impl PartialEq + std::fmt::Debug {
    (
        k.ipvs.clone(),
        k.addresses.clone(),
        k.ipsets.clone(),
        k.iptables.clone(),
    )
}

fn mentions(k: &FakeKernel, vip: IpAddr) -> bool {
    k.ipvs
        .keys()
        .any(|key| matches!(key, ServiceKey::Inet { addr, .. } if *addr == vip))
        || k.addresses.contains(&vip)
        || k.ipsets.sets().any(|(_, st)| {
            st.entries.keys().any(|e| match e {
                ipset::Entry::Ip(ip)
                | ipset::Entry::IpPort { ip, .. }
                | ipset::Entry::IpPortIp { ip, .. }
                | ipset::Entry::IpPortNet { ip, .. } => *ip == vip,
                ipset::Entry::Port(_) => false,
            })
        })
}

fn full_sync(p: &mut Proxier, store: &Store, k: &mut FakeKernel) {
    p.request_full();
    let r = p.sync(store, &node_addrs(), k);
    assert_eq!(r.kind, SyncKind::Full);
    assert!(r.ok(), "{:?}", r.errors);
}

#[test]
fn restart_with_an_invalid_service_keeps_its_state_until_it_is_deleted() {
    let eps = ["10.244.1.5", "10.244.1.6"];
    let valid = store_of(
        vec![web(true), other()],
        vec![web_slice(&eps), other_slice()],
        true,
    );
    let mut k = FakeKernel::default();
    let mut first = Proxier::new(cfg4(), RulesConfig::default(), NODE);
    full_sync(&mut first, &valid, &mut k);
    let before = kernel_state(&k);
    // Everything the test is about was programmed: VIPs, NodePort, hairpin, health check.
    for vip in ["10.96.0.10", "203.0.113.5", "198.51.100.7"] {
        assert!(mentions(&k, ip(vip)), "{vip} programmed");
    }
    let node_port = ServiceKey::Inet {
        protocol: Protocol::Tcp,
        addr: ip("192.168.0.10"),
        port: 30080,
    };
    assert_eq!(k.ipvs[&node_port].real_servers.len(), 2);
    assert!(k.ipsets.get("KUBE-LOOP-BACK").unwrap().entries.len() == 2);
    assert!(
        k.ipsets
            .get("KUBE-HEALTH-CHECK-NODE-PORT")
            .unwrap()
            .entries
            .len()
            == 1
    );

    // The Service becomes invalid, and the daemon restarts: a new proxier, the same kernel.
    let invalid = store_of(
        vec![web(false), other()],
        vec![web_slice(&eps), other_slice()],
        true,
    );
    let mut restarted = Proxier::new(cfg4(), RulesConfig::default(), NODE);
    full_sync(&mut restarted, &invalid, &mut k);
    assert_eq!(
        kernel_state(&k),
        before,
        "the first sync after the restart kept everything"
    );
    let web_name = ServiceName::new("default", "web");
    assert!(restarted.desired().service(&web_name).is_some());
    // Its health-check node port keeps answering, with its two local endpoints.
    assert_eq!(
        restarted.desired().health_checks().get(&web_name),
        first.desired().health_checks().get(&web_name)
    );
    assert_eq!(
        restarted.desired().health_checks()[&web_name].local_endpoints,
        2
    );
    // A drift check, and another invalid update of the Service: still kept.
    full_sync(&mut restarted, &invalid, &mut k);
    assert_eq!(kernel_state(&k), before);
    let mut store = invalid;
    let mut worse = web(false);
    worse.spec.as_mut().unwrap().type_ = Some("Bogus".into());
    let ch = store.apply(SourceEvent::Apply(Object::from(worse)));
    restarted.note(&ch);
    let r = restarted.sync(&store, &node_addrs(), &mut k);
    assert_eq!(r.kind, SyncKind::Incremental);
    assert_eq!(kernel_state(&k), before);

    // Fixed, with one endpoint replaced: converges to exactly what a fresh run programs.
    let ch = store.apply(SourceEvent::Apply(Object::from(web(true))));
    restarted.note(&ch);
    let ch = store.apply(SourceEvent::Apply(web_slice(&["10.244.1.5", "10.244.1.7"])));
    restarted.note(&ch);
    restarted.sync(&store, &node_addrs(), &mut k);
    full_sync(&mut restarted, &store, &mut k);
    let mut fresh_k = FakeKernel::default();
    let mut fresh = Proxier::new(cfg4(), RulesConfig::default(), NODE);
    full_sync(&mut fresh, &store, &mut fresh_k);
    // Draining leaves the replaced endpoint at weight 0 until its connections end; compare the
    // virtual servers and the wanted real servers.
    assert_eq!(
        k.ipvs.keys().collect::<Vec<_>>(),
        fresh_k.ipvs.keys().collect::<Vec<_>>()
    );
    for (key, vs) in &fresh_k.ipvs {
        for (rs, d) in &vs.real_servers {
            assert_eq!(k.ipvs[key].real_servers.get(&rs), Some(d), "{key:?} {rs:?}");
        }
    }
    assert_eq!(k.addresses, fresh_k.addresses);

    // Deleted: everything of it goes, the other service stays.
    let ch = store.apply(SourceEvent::Delete(Object::from(web(true))));
    restarted.note(&ch);
    restarted.sync(&store, &node_addrs(), &mut k);
    for vip in ["10.96.0.10", "203.0.113.5", "198.51.100.7"] {
        assert!(!mentions(&k, ip(vip)), "{vip} removed");
    }
    assert!(!k.ipvs.contains_key(&node_port));
    assert!(mentions(&k, ip("10.96.0.20")));
}

#[test]
fn restart_with_a_service_deleted_while_down_removes_its_state() {
    let valid = store_of(
        vec![web(true), other()],
        vec![web_slice(&["10.244.1.5"]), other_slice()],
        true,
    );
    let mut k = FakeKernel::default();
    full_sync(
        &mut Proxier::new(cfg4(), RulesConfig::default(), NODE),
        &valid,
        &mut k,
    );
    // Gone from a complete list: known gone, so its state is deleted.
    let gone = store_of(vec![other()], vec![other_slice()], true);
    full_sync(
        &mut Proxier::new(cfg4(), RulesConfig::default(), NODE),
        &gone,
        &mut k,
    );
    for vip in ["10.96.0.10", "203.0.113.5", "198.51.100.7"] {
        assert!(!mentions(&k, ip(vip)), "{vip} removed");
    }
    assert_eq!(k.ipvs.len(), 1);
}

#[test]
fn an_invalid_service_never_adopts_a_key_a_valid_service_derives() {
    // "a-bad" sorts before "z-good", so if it claimed the key it would win it.
    let vip = ip("10.96.0.30");
    let key = ServiceKey::Inet {
        protocol: Protocol::Tcp,
        addr: vip,
        port: 80,
    };
    let mut k = FakeKernel::default();
    // A previous run left the key with a real server that is no longer wanted.
    let stale = store_of(
        vec![svc("default", "z-good", "10.96.0.30")
            .port("http", 80, "TCP")
            .build()],
        vec![Object::from(
            slice("default", "z-good", "z-1")
                .port("http", 8080, "TCP")
                .ep("10.244.9.9", "node-b", C::Ready)
                .build(),
        )],
        true,
    );
    full_sync(
        &mut Proxier::new(cfg4(), RulesConfig::default(), NODE),
        &stale,
        &mut k,
    );
    let bad = svc("default", "a-bad", "10.96.0.31")
        .port("http", 80, "TCP")
        .external_ips(&["10.96.0.30"])
        .with(|s| s.session_affinity = Some("Sometimes".into()))
        .build();
    let store = store_of(
        vec![
            bad,
            svc("default", "z-good", "10.96.0.30")
                .port("http", 80, "TCP")
                .build(),
        ],
        vec![Object::from(
            slice("default", "z-good", "z-1")
                .port("http", 8080, "TCP")
                .ep("10.244.1.1", "node-b", C::Ready)
                .build(),
        )],
        true,
    );
    let mut p = Proxier::new(cfg4(), RulesConfig::default(), NODE);
    full_sync(&mut p, &store, &mut k);
    assert_eq!(
        p.desired().owner_of(&key),
        Some(&ServiceName::new("default", "z-good"))
    );
    let wanted = k.ipvs[&key]
        .real_servers
        .iter()
        .filter(|(_, d)| d.weight > 0)
        .map(|(a, _)| a.0)
        .collect::<Vec<_>>();
    assert_eq!(wanted, vec![ip("10.244.1.1")]);
}

fn primary_cfg() -> ProxyConfig {
    let mut c = cfg4();
    c.node_port_primary = true;
    c
}

fn node_port_key(addr: &str, port: u16) -> ServiceKey {
    ServiceKey::Inet {
        protocol: Protocol::Tcp,
        addr: ip(addr),
        port,
    }
}

#[test]
fn first_sync_without_the_node_keeps_node_ports_until_the_node_arrives() {
    let np = || {
        svc("default", "np", "10.96.0.40")
            .node_port("http", 80, "TCP", 30090)
            .build()
    };
    let slices = || {
        vec![Object::from(
            slice("default", "np", "np-1")
                .port("http", 8080, "TCP")
                .ep("10.244.3.1", "node-b", C::Ready)
                .build(),
        )]
    };
    let gone_np = svc("default", "gone", "10.96.0.41")
        .node_port("http", 80, "TCP", 30091)
        .build();
    let mut k = FakeKernel::default();
    full_sync(
        &mut Proxier::new(primary_cfg(), RulesConfig::default(), NODE),
        &store_of(vec![np(), gone_np], slices(), true),
        &mut k,
    );
    // With `primary`, NodePorts live on the Node's InternalIP only.
    assert!(k.ipvs.contains_key(&node_port_key("192.168.0.10", 30090)));
    assert!(k.ipvs.contains_key(&node_port_key("192.168.0.10", 30091)));
    assert!(!k.ipvs.contains_key(&node_port_key("10.0.0.10", 30090)));
    let programmed = k.ipvs[&node_port_key("192.168.0.10", 30090)].clone();

    // Restart without the Node (the wait timed out); "gone" was deleted while down.
    let mut store = store_of(vec![np()], slices(), false);
    let mut p = Proxier::new(primary_cfg(), RulesConfig::default(), NODE);
    full_sync(&mut p, &store, &mut k);
    assert_eq!(
        k.ipvs.get(&node_port_key("192.168.0.10", 30090)),
        Some(&programmed),
        "kept, not deleted"
    );
    assert!(
        !k.ipvs.contains_key(&node_port_key("192.168.0.10", 30091)),
        "the NodePort of a Service known gone is deleted"
    );
    assert!(p.desired().service(&unresolved_node_ports()).is_some());
    // A drift check while the Node is still missing keeps it too.
    full_sync(&mut p, &store, &mut k);
    assert!(k.ipvs.contains_key(&node_port_key("192.168.0.10", 30090)));

    // The Node arrives: the Service's own derivation takes over in place.
    let ch = store.apply(SourceEvent::Apply(Object::Node(Box::new(node_obj(
        NODE,
        "zone-a",
        "192.168.0.10",
    )))));
    p.note(&ch);
    let before = k.counters;
    let r = p.sync(&store, &node_addrs(), &mut k);
    assert!(r.ok(), "{:?}", r.errors);
    assert!(p.desired().service(&unresolved_node_ports()).is_none());
    assert_eq!(
        k.ipvs.get(&node_port_key("192.168.0.10", 30090)),
        Some(&programmed)
    );
    assert_eq!(
        p.desired().owner_of(&node_port_key("192.168.0.10", 30090)),
        Some(&ServiceName::new("default", "np"))
    );
    assert_eq!(k.counters.ipvs_writes, before.ipvs_writes, "no re-create");
}

/// A loop over one family whose kernel already holds a NodePort virtual server (on the Node's
/// primary IP) with a real server the Service no longer has.
fn loop_with_stale_node_port(
    node_wait: Duration,
) -> (
    Vec<Box<dyn Backend + Send>>,
    Arc<Mutex<FakeKernel>>,
    LoopConfig,
) {
    let mut k = FakeKernel::default();
    let old = store_of(
        vec![svc("default", "np", "10.96.0.40")
            .node_port("http", 80, "TCP", 30090)
            .build()],
        vec![Object::from(
            slice("default", "np", "np-1")
                .port("http", 8080, "TCP")
                .ep("10.244.9.9", "node-b", C::Ready)
                .build(),
        )],
        true,
    );
    full_sync(
        &mut Proxier::new(primary_cfg(), RulesConfig::default(), NODE),
        &old,
        &mut k,
    );
    assert!(k.ipvs.contains_key(&node_port_key("192.168.0.10", 30090)));
    let shared = Arc::new(Mutex::new(k));
    let families: Vec<Box<dyn Backend + Send>> = vec![Box::new(FamilyProxier {
        proxier: Proxier::new(primary_cfg(), RulesConfig::default(), NODE),
        kernel: Box::new(SharedFakeKernel(shared.clone())),
    })];
    let cfg = LoopConfig {
        min_sync_period: Duration::from_millis(10),
        sync_period: Duration::from_secs(30),
        once: true,
        node_wait,
    };
    (families, shared, cfg)
}

fn lists_without_node(tx: &std::sync::mpsc::Sender<Input>) {
    let np = svc("default", "np", "10.96.0.40")
        .node_port("http", 80, "TCP", 30090)
        .build();
    let s = slice("default", "np", "np-1")
        .port("http", 8080, "TCP")
        .ep("10.244.3.1", "node-b", C::Ready)
        .build();
    for ev in [
        SourceEvent::Init(Kind::Service),
        SourceEvent::InitApply(Object::from(np)),
        SourceEvent::InitDone(Kind::Service),
        SourceEvent::Init(Kind::EndpointSlice),
        SourceEvent::InitApply(Object::from(s)),
        SourceEvent::InitDone(Kind::EndpointSlice),
    ] {
        tx.send(Input::Source(ev)).unwrap();
    }
}

fn real_servers(k: &Arc<Mutex<FakeKernel>>, key: &ServiceKey) -> Vec<IpAddr> {
    let k = k.lock().unwrap();
    let vs = k.ipvs.get(key).expect("NodePort virtual server kept");
    vs.real_servers
        .iter()
        .filter(|(_, d)| d.weight > 0)
        .map(|(a, _)| a.0)
        .collect()
}

#[test]
fn loop_waits_for_a_late_node_then_programs_node_ports_from_it() {
    let (mut families, kernel, cfg) = loop_with_stale_node_port(Duration::from_secs(60));
    let (tx, rx) = std::sync::mpsc::channel();
    lists_without_node(&tx);
    let sender = std::thread::spawn(move || {
        // Both lists are in; the Node comes later.
        std::thread::sleep(Duration::from_millis(300));
        for ev in [
            SourceEvent::Init(Kind::Node),
            SourceEvent::InitApply(Object::Node(Box::new(node_obj(
                NODE,
                "zone-a",
                "192.168.0.10",
            )))),
            SourceEvent::InitDone(Kind::Node),
        ] {
            tx.send(Input::Source(ev)).unwrap();
        }
        tx
    });
    let mut store = Store::new();
    let exit = sync_loop::run(
        &rx,
        &mut store,
        &mut families,
        node_addrs(),
        cfg,
        &NoObserver,
    );
    assert_eq!(exit, Exit::Once { ok: true });
    let _tx = sender.join().unwrap();
    // The one sync ran with the Node: the NodePort has the Service's current endpoint (an
    // early sync would have kept the stale one, adopted).
    assert_eq!(
        real_servers(&kernel, &node_port_key("192.168.0.10", 30090)),
        vec![ip("10.244.3.1")]
    );
}

#[test]
fn loop_gives_up_on_a_missing_node_after_the_bound_and_keeps_node_ports() {
    let (mut families, kernel, cfg) = loop_with_stale_node_port(Duration::from_millis(200));
    let (tx, rx) = std::sync::mpsc::channel();
    lists_without_node(&tx);
    let mut store = Store::new();
    let exit = sync_loop::run(
        &rx,
        &mut store,
        &mut families,
        node_addrs(),
        cfg,
        &NoObserver,
    );
    assert_eq!(exit, Exit::Once { ok: true });
    drop(tx);
    assert!(store.node().is_none());
    // Not computable without the Node: kept as the previous run left it, not deleted.
    assert_eq!(
        real_servers(&kernel, &node_port_key("192.168.0.10", 30090)),
        vec![ip("10.244.9.9")]
    );
}

#[test]
fn a_burst_far_beyond_the_channel_capacity_loses_nothing() {
    const CAPACITY: usize = 8;
    const SERVICES: usize = 2_000;
    const ROUNDS: usize = 3;
    let (tx, rx) = sync_loop::input_channel(CAPACITY);
    let kernel = Arc::new(Mutex::new(FakeKernel::default()));
    let mut families: Vec<Box<dyn Backend + Send>> = vec![Box::new(FamilyProxier {
        proxier: Proxier::new(cfg4(), RulesConfig::default(), NODE),
        kernel: Box::new(SharedFakeKernel(kernel.clone())),
    })];
    let cfg = LoopConfig {
        min_sync_period: Duration::from_millis(5),
        sync_period: Duration::from_secs(30),
        once: false,
        node_wait: Duration::ZERO,
    };
    let service = |i: usize, round: usize| {
        svc(
            "default",
            &format!("s-{i}"),
            &format!("10.96.{}.{}", i / 250, i % 250 + 1),
        )
        .port("http", 80 + round as i32, "TCP")
        .build()
    };
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let producer = rt.spawn(async move {
        let mut sent = 0usize;
        let mut send = |ev| {
            sent += 1;
            let tx = tx.clone();
            async move { assert!(tx.send(Input::Source(ev)).await) }
        };
        send(SourceEvent::Init(Kind::EndpointSlice)).await;
        send(SourceEvent::InitDone(Kind::EndpointSlice)).await;
        send(SourceEvent::Init(Kind::Service)).await;
        for i in 0..SERVICES {
            send(SourceEvent::InitApply(Object::from(service(i, 0)))).await;
        }
        send(SourceEvent::InitDone(Kind::Service)).await;
        // Every object updated again and again: the last version must win.
        for round in 1..ROUNDS {
            for i in 0..SERVICES {
                send(SourceEvent::Apply(Object::from(service(i, round)))).await;
            }
        }
        // Every tenth deleted.
        for i in (0..SERVICES).step_by(10) {
            send(SourceEvent::Delete(Object::from(service(i, ROUNDS - 1)))).await;
        }
        let n = sent;
        assert!(tx.send(Input::Shutdown).await);
        n
    });
    let mut store = Store::new();
    let exit = sync_loop::run(
        &rx,
        &mut store,
        &mut families,
        BTreeSet::new(),
        cfg,
        &NoObserver,
    );
    assert_eq!(exit, Exit::Shutdown);
    let sent = rt.block_on(producer).unwrap();
    assert!(
        sent > 100 * CAPACITY,
        "the burst is far beyond the capacity"
    );
    assert_eq!(store.service_count(), SERVICES - SERVICES / 10);
    for i in 0..SERVICES {
        let got = store.service(&ServiceName::new("default", format!("s-{i}")));
        if i % 10 == 0 {
            assert!(got.is_none(), "s-{i} deleted");
        } else {
            assert_eq!(
                got,
                Some(&model::objects::Svc::from(&service(i, ROUNDS - 1))),
                "s-{i} latest version"
            );
        }
    }
    // Syncs ran while the burst was going on (back-pressure, not a stall).
    assert!(kernel.lock().unwrap().counters.ipvs_writes > 0);
}

/// Issue #32: the node-address tracker could not dump the node's addresses at start
/// (`Input::NodeAddressesUnknown`): the syncs use the Node object's InternalIP instead of an
/// empty set (which would program no NodePort, and delete those a previous run left); once the
/// tracker has the addresses, they replace the Node's.
#[test]
fn unknown_node_addresses_use_the_node_objects_until_the_tracker_has_them() {
    let kernel = Arc::new(Mutex::new(FakeKernel::default()));
    let mut families: Vec<Box<dyn Backend + Send>> = vec![Box::new(FamilyProxier {
        proxier: Proxier::new(cfg4(), RulesConfig::default(), NODE),
        kernel: Box::new(SharedFakeKernel(kernel.clone())),
    })];
    let cfg = LoopConfig {
        min_sync_period: Duration::ZERO,
        sync_period: Duration::from_secs(30),
        once: true,
        node_wait: Duration::ZERO,
    };
    let (tx, rx) = std::sync::mpsc::channel();
    tx.send(Input::NodeAddressesUnknown).unwrap();
    lists_without_node(&tx);
    for ev in [
        SourceEvent::Init(Kind::Node),
        SourceEvent::InitApply(Object::Node(Box::new(node_obj(
            NODE,
            "zone-a",
            "192.168.0.77",
        )))),
        SourceEvent::InitDone(Kind::Node),
    ] {
        tx.send(Input::Source(ev)).unwrap();
    }
    let mut store = Store::new();
    let exit = sync_loop::run(
        &rx,
        &mut store,
        &mut families,
        BTreeSet::new(),
        cfg,
        &NoObserver,
    );
    assert_eq!(exit, Exit::Once { ok: true });
    assert_eq!(
        real_servers(&kernel, &node_port_key("192.168.0.77", 30090)),
        vec![ip("10.244.3.1")],
        "the Node object's address serves the NodePort"
    );

    // The tracker has the node's addresses now: they replace the Node's.
    let (tx, rx) = std::sync::mpsc::channel();
    tx.send(Input::NodeAddresses(node_addrs())).unwrap();
    let exit = sync_loop::run(
        &rx,
        &mut store,
        &mut families,
        BTreeSet::new(),
        cfg,
        &NoObserver,
    );
    assert_eq!(exit, Exit::Once { ok: true });
    let k = kernel.lock().unwrap();
    assert!(k.ipvs.contains_key(&node_port_key("192.168.0.10", 30090)));
    assert!(!k.ipvs.contains_key(&node_port_key("192.168.0.77", 30090)));
}
