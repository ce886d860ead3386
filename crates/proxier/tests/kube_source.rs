//! The real kube-rs watch stack (`source::kube::run`) against the testkit fake API server,
//! reached through a kubeconfig: adds/updates/deletes arrive, dropped watches resume, 410 Gone
//! relists, and the replayed events always converge to the server's objects.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // test helpers

use ::watch::kube::{proxy_label_selector, run, run_with, KubeSourceConfig, SourceHealth};
use k8s_openapi::api::core::v1::{Node, Service};
use k8s_openapi::api::discovery::v1::EndpointSlice;
use model::event::{Kind, Object, SourceEvent};
use serde_json::json;
use std::collections::BTreeMap;
use std::time::Duration;
use testkit::apiserver::{FakeApiServer, LabelSelector};
use tokio::sync::{mpsc, watch};

type Key = (Kind, String, String);

/// The SourceEvent stream replayed into a map, the way a store would.
#[derive(Default)]
struct Replay {
    objects: BTreeMap<Key, Object>,
    /// Objects seen between Init and InitDone, per kind.
    pending: BTreeMap<Kind, BTreeMap<Key, Object>>,
    inits: BTreeMap<Kind, usize>,
    applies: usize,
    deletes: usize,
}

fn key_of(o: &Object) -> Key {
    match o {
        Object::Service(s) => (
            Kind::Service,
            s.name.namespace.to_string(),
            s.name.name.to_string(),
        ),
        Object::EndpointSlice(s) => (
            Kind::EndpointSlice,
            s.namespace.to_string(),
            s.name.to_string(),
        ),
        Object::Node(n) => (
            Kind::Node,
            String::new(),
            n.metadata.name.clone().unwrap_or_default(),
        ),
    }
}

impl Replay {
    fn apply(&mut self, ev: SourceEvent) {
        match ev {
            SourceEvent::Init(k) => {
                *self.inits.entry(k).or_default() += 1;
                self.pending.insert(k, BTreeMap::new());
            }
            SourceEvent::InitApply(o) => {
                let key = key_of(&o);
                self.pending
                    .get_mut(&key.0)
                    .expect("InitApply outside Init")
                    .insert(key, o);
            }
            SourceEvent::InitDone(k) => {
                let fresh = self.pending.remove(&k).expect("InitDone without Init");
                self.objects.retain(|key, _| key.0 != k);
                self.objects.extend(fresh);
            }
            SourceEvent::Apply(o) => {
                self.applies += 1;
                self.objects.insert(key_of(&o), o);
            }
            SourceEvent::Delete(o) => {
                self.deletes += 1;
                self.objects.remove(&key_of(&o));
            }
        }
    }

    fn inits(&self, k: Kind) -> usize {
        self.inits.get(&k).copied().unwrap_or(0)
    }
}

/// What the source should hold: the server's objects through the same selectors.
fn expected(s: &FakeApiServer, node: &str) -> BTreeMap<Key, Object> {
    let sel = LabelSelector::parse(&proxy_label_selector()).unwrap();
    let labels_ok = |m: &k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta| {
        sel.matches(&json!({"metadata": {"labels": m.labels}}))
    };
    let mut out = BTreeMap::new();
    for svc in s.list::<Service>() {
        if labels_ok(&svc.metadata) {
            let o = Object::from(svc);
            out.insert(key_of(&o), o);
        }
    }
    for es in s.list::<EndpointSlice>() {
        if labels_ok(&es.metadata) {
            let o = Object::from(es);
            out.insert(key_of(&o), o);
        }
    }
    if let Some(n) = s.get::<Node>("", node) {
        let o = Object::Node(Box::new(n));
        out.insert(key_of(&o), o);
    }
    out
}

struct Harness {
    server: FakeApiServer,
    rx: mpsc::Receiver<SourceEvent>,
    health: watch::Receiver<SourceHealth>,
    replay: Replay,
    node: String,
    _dir: TempDir,
}

struct TempDir(std::path::PathBuf);
impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

async fn client_for(server: &FakeApiServer, tag: &str) -> (kube::Client, TempDir) {
    let dir = std::env::temp_dir().join(format!(
        "controller-kube-source-{tag}-{}",
        std::process::id()
    ));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("kubeconfig");
    server.write_kubeconfig(&path).unwrap();
    let kc = kube::config::Kubeconfig::read_from(&path).unwrap();
    let config =
        kube::Config::from_custom_kubeconfig(kc, &kube::config::KubeConfigOptions::default())
            .await
            .unwrap();
    (kube::Client::try_from(config).unwrap(), TempDir(dir))
}

impl Harness {
    async fn start(tag: &str, server: FakeApiServer, config: Option<KubeSourceConfig>) -> Self {
        let (client, dir) = client_for(&server, tag).await;
        let (tx, rx) = mpsc::channel(1024);
        let (htx, hrx) = watch::channel(SourceHealth::default());
        let node = "node-a".to_string();
        match config {
            Some(c) => drop(tokio::spawn(run_with(client, c, tx, htx))),
            None => drop(tokio::spawn(run(client, node.clone(), tx, htx))),
        }
        Self {
            server,
            rx,
            health: hrx,
            replay: Replay::default(),
            node,
            _dir: dir,
        }
    }

    /// Process events until the replayed state equals the server's (through the selectors) and
    /// `extra` holds. The deadline only guards against a hang; nothing here measures speed.
    async fn converge(&mut self, what: &str, extra: impl Fn(&Replay) -> bool) {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(90);
        loop {
            let synced = self.health.borrow().synced() && self.replay.pending.is_empty();
            if synced
                && self.replay.objects == expected(&self.server, &self.node)
                && extra(&self.replay)
            {
                return;
            }
            match tokio::time::timeout_at(deadline, self.rx.recv()).await {
                Ok(Some(ev)) => self.replay.apply(ev),
                Ok(None) => panic!("{what}: source ended"),
                Err(_) => panic!(
                    "{what}: did not converge; have {:?}, want {:?}",
                    self.replay.objects.keys().collect::<Vec<_>>(),
                    expected(&self.server, &self.node)
                        .keys()
                        .collect::<Vec<_>>()
                ),
            }
        }
    }
}

fn service(ns: &str, name: &str, labels: serde_json::Value, port: i32) -> Service {
    serde_json::from_value(json!({
        "metadata": {"name": name, "namespace": ns, "labels": labels},
        "spec": {"type": "ClusterIP", "clusterIP": "10.96.0.20", "ports": [{"name": "http", "port": port, "protocol": "TCP"}]}
    }))
    .unwrap()
}

fn slice(ns: &str, name: &str, svc: &str, ip: &str) -> EndpointSlice {
    serde_json::from_value(json!({
        "metadata": {"name": name, "namespace": ns, "labels": {"kubernetes.io/service-name": svc}},
        "addressType": "IPv4",
        "endpoints": [{"addresses": [ip], "conditions": {"ready": true}}],
        "ports": [{"name": "http", "port": 8080, "protocol": "TCP"}]
    }))
    .unwrap()
}

fn node(name: &str, zone: &str) -> Node {
    serde_json::from_value(
        json!({"metadata": {"name": name, "labels": {"topology.kubernetes.io/zone": zone}}}),
    )
    .unwrap()
}

async fn seeded() -> FakeApiServer {
    let s = FakeApiServer::start().await.unwrap();
    s.create(&service("default", "web", json!({"app": "web"}), 80))
        .unwrap();
    s.create(&service(
        "default",
        "headless",
        json!({"service.kubernetes.io/headless": ""}),
        80,
    ))
    .unwrap();
    s.create(&service(
        "default",
        "other",
        json!({"service.kubernetes.io/service-proxy-name": "x"}),
        80,
    ))
    .unwrap();
    s.create(&slice("default", "web-1", "web", "10.244.0.5"))
        .unwrap();
    s.create(&node("node-a", "z1")).unwrap();
    s.create(&node("node-b", "z1")).unwrap();
    s
}

#[tokio::test]
async fn sees_adds_updates_deletes_through_selectors() {
    let mut h = Harness::start("crud", seeded().await, None).await;
    h.converge("initial sync", |_| true).await;
    assert!(h
        .replay
        .objects
        .contains_key(&(Kind::Service, "default".into(), "web".into())));
    assert!(!h
        .replay
        .objects
        .contains_key(&(Kind::Service, "default".into(), "headless".into())));
    assert!(!h
        .replay
        .objects
        .contains_key(&(Kind::Service, "default".into(), "other".into())));
    assert!(!h
        .replay
        .objects
        .contains_key(&(Kind::Node, String::new(), "node-b".into())));
    assert!(h.health.borrow().synced());
    // The watches use the proxy selector and the node field selector.
    while h.server.open_watches() < 3 {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let reqs = h.server.requests();
    assert!(reqs.iter().any(|r| r.watch
        && r.path == "/api/v1/services"
        && r.query.contains("labelSelector=%21service.kubernetes.io")));
    assert!(reqs.iter().any(|r| r.watch
        && r.path == "/api/v1/nodes"
        && r.query.contains("fieldSelector=metadata.name%3Dnode-a")));

    let s = &h.server;
    s.create(&service("ns2", "api", json!({}), 443)).unwrap();
    s.create(&slice("ns2", "api-1", "api", "10.244.1.7"))
        .unwrap();
    let mut web = s.get::<Service>("default", "web").unwrap();
    web.spec.as_mut().unwrap().ports.as_mut().unwrap()[0].port = 8081;
    s.update(&web).unwrap();
    s.delete::<EndpointSlice>("default", "web-1").unwrap();
    let mut me = s.get::<Node>("", "node-a").unwrap();
    me.metadata.labels =
        Some([("topology.kubernetes.io/zone".to_string(), "z2".to_string())].into());
    s.update(&me).unwrap();
    s.update(&{
        let mut other = s.get::<Node>("", "node-b").unwrap();
        other.metadata.labels = None;
        other
    })
    .unwrap();
    // A service that becomes headless leaves the watch (a DELETED event for it).
    let mut api = s.get::<Service>("ns2", "api").unwrap();
    api.metadata.labels =
        Some([("service.kubernetes.io/headless".to_string(), String::new())].into());
    s.update(&api).unwrap();
    h.converge("after changes", |r| r.deletes >= 2).await;
    assert_eq!(
        h.replay.inits(Kind::Service),
        1,
        "live changes need no relist"
    );
    assert!(h.replay.applies >= 4);
    match h
        .replay
        .objects
        .get(&(Kind::Node, String::new(), "node-a".into()))
    {
        Some(Object::Node(n)) => assert_eq!(
            n.metadata.labels.as_ref().unwrap()["topology.kubernetes.io/zone"],
            "z2"
        ),
        other => panic!("node missing: {other:?}"),
    }

    // This node's deletion arrives as a Delete.
    let deletes = h.replay.deletes;
    h.server.delete::<Node>("", "node-a").unwrap();
    h.converge("node deleted", |r| r.deletes > deletes).await;
    assert!(!h
        .replay
        .objects
        .contains_key(&(Kind::Node, String::new(), "node-a".into())));
}

#[tokio::test]
async fn survives_dropped_watches_without_relisting() {
    let mut h = Harness::start("drop", seeded().await, None).await;
    h.converge("initial sync", |_| true).await;
    while h.server.open_watches() < 3 {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let watches_before = h.server.count_requests(|r| r.watch);
    for round in 0..3 {
        assert!(h.server.drop_watches() > 0);
        // Changes made while the client reconnects are replayed from its resourceVersion.
        h.server
            .create(&service("default", &format!("svc-{round}"), json!({}), 80))
            .unwrap();
        h.server
            .delete::<Service>("default", if round == 0 { "web" } else { "svc-0" })
            .ok();
        h.converge("after drop", |_| true).await;
        while h.server.open_watches() < 3 {
            h.converge("reconnect", |_| true).await;
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
    assert!(h.server.count_requests(|r| r.watch) >= watches_before + 9);
    assert_eq!(
        h.replay.inits(Kind::Service),
        1,
        "a dropped watch resumes from its resourceVersion"
    );
    assert!(h
        .server
        .requests()
        .iter()
        .filter(|r| r.watch)
        .all(|r| r.status == 200));
}

#[tokio::test]
async fn relists_after_410_and_converges() {
    let mut h = Harness::start("gone", seeded().await, None).await;
    h.converge("initial sync", |_| true).await;
    while h.server.open_watches() < 3 {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // The server goes away; meanwhile objects change and history is compacted, so the
    // client's resourceVersion is too old when it comes back: 410 Gone, relist.
    h.server.pause().await;
    h.server
        .create(&service("default", "new", json!({}), 80))
        .unwrap();
    h.server.delete::<Service>("default", "web").unwrap();
    h.server
        .delete::<EndpointSlice>("default", "web-1")
        .unwrap();
    h.server
        .create(&slice("default", "new-1", "new", "10.244.0.9"))
        .unwrap();
    h.server.compact();
    // Let the client notice the outage (errors recorded) before the server comes back.
    let mut health = h.health.clone();
    health
        .wait_for(|hl| {
            hl.services.consecutive_errors > 0 || hl.endpoint_slices.consecutive_errors > 0
        })
        .await
        .unwrap();
    h.server.resume().unwrap();
    h.converge("after 410", |r| {
        r.inits(Kind::Service) >= 2 && r.inits(Kind::EndpointSlice) >= 2
    })
    .await;
    let hl = h.health.borrow().clone();
    assert!(hl.services.errors > 0);
    assert!(hl
        .services
        .last_error
        .as_ref()
        .is_some_and(|(_, e)| !e.is_empty()));
    assert!(hl.services.lists >= 2);
    // Deleted-while-away objects disappeared through the relist (InitDone), not a Delete event.
    assert_eq!(h.replay.deletes, 0);

    // A 410 on a live watch (watch cache overflow) relists too.
    while h.server.open_watches() < 3 {
        h.converge("reconnect", |_| true).await;
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let inits = h.replay.inits(Kind::Service);
    h.server.expire_watches();
    h.server
        .create(&service("default", "after-expire", json!({}), 80))
        .unwrap();
    h.converge("after expire", |r| r.inits(Kind::Service) > inits)
        .await;

    // A restored control plane: rv jumps, history gone, watches dropped.
    let inits = h.replay.inits(Kind::Service);
    h.server.pause().await;
    h.server.reset_history(10_000);
    h.server
        .create(&service("default", "after-reset", json!({}), 80))
        .unwrap();
    h.server.resume().unwrap();
    h.converge("after reset", |r| r.inits(Kind::Service) > inits)
        .await;
    assert!(h.health.borrow().synced());
}

/// An outage stays an outage: every retry starts with kube-runtime's `Init` (sent before any
/// request), and that must not read as a successful event. Every health state the source
/// publishes while the server is away is checked: once the Service watch has failed it never
/// shows zero consecutive errors, and after four errors it counts four (a retry's `Init` reset
/// the count to zero before, so it never passed one). When the server is back, the list
/// completes and the watches are healthy.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_outage_never_reads_as_recovered_between_retries() {
    // Started while the server is away, as a daemon after a node reboot: the initial list
    // fails and is retried from the start (an established watch resumes without an `Init`).
    let server = seeded().await;
    server.pause().await;
    let mut h = Harness::start("outage", server, None).await;
    let mut health = h.health.clone();
    // kube-runtime's default backoff: 0.8 s, 1.6 s, 3.2 s, ... (with jitter): four errors take
    // about 6 s. The few `Init` events forwarded meanwhile fit in the event channel.
    let mut seen = Vec::new();
    loop {
        let state = health.borrow_and_update().services.clone();
        let errors = state.errors;
        seen.push((state.consecutive_errors, errors));
        if errors > 0 {
            assert_eq!(
                state.consecutive_errors, errors,
                "the Service watch read as (partly) recovered while the server was away; \
                 (consecutive, errors since the outage) seen: {seen:?}"
            );
        }
        if errors >= 4 {
            break;
        }
        tokio::time::timeout(Duration::from_secs(60), health.changed())
            .await
            .expect("no health change within 60 s of the outage")
            .unwrap();
    }
    assert!(!health.borrow().synced());
    h.server.resume().unwrap();
    h.converge("after the outage", |_| true).await;
    let hl = h.health.borrow().clone();
    assert!(
        hl.services.healthy() && hl.endpoint_slices.healthy(),
        "{hl:?}"
    );
}

#[tokio::test]
async fn paginated_initial_list_with_kube_rs() {
    let s = FakeApiServer::start().await.unwrap();
    for i in 0..120 {
        s.create(&service("bulk", &format!("s{i:03}"), json!({}), 80))
            .unwrap();
        s.create(&slice(
            "bulk",
            &format!("s{i:03}-a"),
            &format!("s{i:03}"),
            "10.244.2.1",
        ))
        .unwrap();
    }
    let mut cfg = KubeSourceConfig::new("node-a");
    cfg.page_size = Some(50);
    let mut h = Harness::start("pages", s, Some(cfg)).await;
    // Writes during the paginated list must not tear it.
    h.server
        .create(&service("bulk", "late", json!({}), 80))
        .unwrap();
    h.converge("paginated sync", |_| true).await;
    let continues = h
        .server
        .count_requests(|r| r.path == "/api/v1/services" && r.query.contains("continue="));
    assert!(
        continues >= 2,
        "kube-rs paginated with continue tokens ({continues})"
    );
    assert_eq!(
        h.replay
            .objects
            .keys()
            .filter(|k| k.0 == Kind::Service)
            .count(),
        121
    );
}

#[tokio::test]
async fn streaming_list_mode_syncs() {
    let mut cfg = KubeSourceConfig::new("node-a");
    cfg.streaming_list = true;
    let mut h = Harness::start("stream", seeded().await, Some(cfg)).await;
    h.converge("streaming sync", |_| true).await;
    assert!(h
        .server
        .requests()
        .iter()
        .any(|r| r.query.contains("sendInitialEvents=true")));
    h.server
        .create(&service("default", "more", json!({}), 80))
        .unwrap();
    h.converge("streaming change", |r| r.applies >= 1).await;
}

#[tokio::test]
async fn stops_when_receiver_dropped() {
    let s = seeded().await;
    let (client, _dir) = client_for(&s, "stop").await;
    let (tx, rx) = mpsc::channel(1);
    let (htx, _hrx) = watch::channel(SourceHealth::default());
    let task = tokio::spawn(run(client, "node-a".into(), tx, htx));
    drop(rx);
    tokio::time::timeout(Duration::from_secs(30), task)
        .await
        .expect("source did not stop")
        .unwrap();
}

#[tokio::test]
async fn kube_rs_event_recorder_reaches_the_server() {
    use kube::runtime::events::{Event, EventType, Recorder, Reporter};
    let s = seeded().await;
    let (client, _dir) = client_for(&s, "events").await;
    let recorder = Recorder::new(client, Reporter::from("kube-ipvs"));
    let node = s.get::<Node>("", "node-a").unwrap();
    let reference = k8s_openapi::api::core::v1::ObjectReference {
        kind: Some("Node".into()),
        name: node.metadata.name.clone(),
        uid: node.metadata.uid.clone(),
        ..Default::default()
    };
    let ev = Event {
        type_: EventType::Warning,
        reason: "SyncFailed".into(),
        note: Some("ipset restore failed".into()),
        action: "Sync".into(),
        secondary: None,
    };
    recorder.publish(&ev, &reference).await.unwrap();
    recorder.publish(&ev, &reference).await.unwrap();
    let events = s.events();
    assert_eq!(
        events.len(),
        1,
        "the repeat is a PATCH of the same event: {events:#?}"
    );
    assert_eq!(events[0]["reason"], "SyncFailed");
    assert_eq!(events[0]["series"]["count"], 2);
    assert_eq!(events[0]["regarding"]["name"], "node-a");
    assert_eq!(
        s.count_requests(|r| r.method == "PATCH"
            && r.path
                .starts_with("/apis/events.k8s.io/v1/namespaces/default/events/")),
        1
    );
}
