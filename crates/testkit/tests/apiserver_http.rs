//! Raw-HTTP tests of the fake API server: list, watch streams, bookmarks, 410, selectors,
//! pagination, REST writes, fault injection. A minimal HTTP/1.1 client decodes the chunked
//! encoding by hand, so the wire format itself is under test.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // test helpers

use k8s_openapi::api::core::v1::{Node, Service};
use serde_json::{json, Value};
use std::net::SocketAddr;
use testkit::apiserver::raw::{self, RawResponse, StreamEnd as End};
use testkit::apiserver::FakeApiServer;
use tokio::net::TcpStream;

async fn request(addr: SocketAddr, method: &str, path: &str, body: Option<&Value>) -> RawResponse {
    raw::request(addr, method, path, body).await.unwrap()
}

async fn get_json(addr: SocketAddr, path: &str) -> (u16, Value) {
    raw::get_json(addr, path).await.unwrap()
}

fn svc(ns: &str, name: &str, labels: Value) -> Value {
    json!({
        "apiVersion": "v1", "kind": "Service",
        "metadata": {"name": name, "namespace": ns, "labels": labels},
        "spec": {"clusterIP": "10.96.0.10", "ports": [{"port": 80, "protocol": "TCP"}]}
    })
}

fn rv_of(v: &Value) -> u64 {
    v["metadata"]["resourceVersion"]
        .as_str()
        .unwrap()
        .parse()
        .unwrap()
}

/// The names of a list page's items, in order.
fn item_names(page: &Value) -> Vec<String> {
    page["items"]
        .as_array()
        .unwrap()
        .iter()
        .map(|i| i["metadata"]["name"].as_str().unwrap().to_string())
        .collect()
}

async fn server() -> FakeApiServer {
    let s = FakeApiServer::start().await.unwrap();
    // Tests that want bookmarks ask for them explicitly.
    s.set_bookmark_interval(None);
    s
}

#[tokio::test]
async fn create_get_list_and_status_errors() {
    let s = server().await;
    let a = s.addr();
    let r = request(
        a,
        "POST",
        "/api/v1/namespaces/web/services",
        Some(&svc("ignored", "front", json!({}))),
    )
    .await;
    assert_eq!(r.status, 201);
    let created = r.json().await.unwrap();
    assert_eq!(
        created["metadata"]["namespace"], "web",
        "namespace comes from the path"
    );
    assert!(!created["metadata"]["uid"].as_str().unwrap().is_empty());
    assert!(created["metadata"]["creationTimestamp"]
        .as_str()
        .unwrap()
        .ends_with('Z'));
    let rv = rv_of(&created);
    assert_eq!(rv, s.resource_version());

    let (code, got) = get_json(a, "/api/v1/namespaces/web/services/front").await;
    assert_eq!(code, 200);
    assert_eq!(got, created);

    let (code, list) = get_json(a, "/api/v1/services").await;
    assert_eq!(code, 200);
    assert_eq!(list["kind"], "ServiceList");
    assert_eq!(list["metadata"]["resourceVersion"], rv.to_string());
    assert_eq!(list["items"].as_array().unwrap().len(), 1);
    assert!(
        list["items"][0].get("kind").is_none(),
        "list items carry no kind, like the real server"
    );

    // Duplicate create → 409 AlreadyExists Status.
    let r = request(
        a,
        "POST",
        "/api/v1/namespaces/web/services",
        Some(&svc("web", "front", json!({}))),
    )
    .await;
    assert_eq!(r.status, 409);
    let st = r.json().await.unwrap();
    assert_eq!(
        (
            st["kind"].as_str(),
            st["reason"].as_str(),
            st["code"].as_u64()
        ),
        (Some("Status"), Some("AlreadyExists"), Some(409))
    );

    // Missing object → 404 NotFound; unknown resource → 404; bad selector → 400.
    let (code, st) = get_json(a, "/api/v1/namespaces/web/services/nope").await;
    assert_eq!((code, st["reason"].as_str()), (404, Some("NotFound")));
    let (code, _) = get_json(a, "/api/v1/pods").await;
    assert_eq!(code, 404);
    let (code, st) = get_json(a, "/api/v1/services?labelSelector=a%20in%20(b").await;
    assert_eq!((code, st["reason"].as_str()), (400, Some("BadRequest")));

    // Stale update → 409 Conflict; fresh update bumps rv; delete returns last state.
    let mut stale = created.clone();
    stale["metadata"]["resourceVersion"] = json!("1");
    let r = request(
        a,
        "PUT",
        "/api/v1/namespaces/web/services/front",
        Some(&stale),
    )
    .await;
    assert_eq!(r.status, 409);
    let mut upd = created.clone();
    upd["spec"]["ports"][0]["port"] = json!(8080);
    let r = request(
        a,
        "PUT",
        "/api/v1/namespaces/web/services/front",
        Some(&upd),
    )
    .await;
    assert_eq!(r.status, 200);
    let updated = r.json().await.unwrap();
    assert!(rv_of(&updated) > rv);
    assert_eq!(updated["metadata"]["uid"], created["metadata"]["uid"]);
    let r = request(
        a,
        "PATCH",
        "/api/v1/namespaces/web/services/front",
        Some(&json!({"metadata": {"labels": {"x": "y"}}})),
    )
    .await;
    assert_eq!(r.status, 200);
    assert_eq!(r.json().await.unwrap()["metadata"]["labels"]["x"], "y");
    let r = request(a, "DELETE", "/api/v1/namespaces/web/services/front", None).await;
    assert_eq!(r.status, 200);
    let (code, _) = get_json(a, "/api/v1/namespaces/web/services/front").await;
    assert_eq!(code, 404);
    assert!(s.count_requests(|r| r.method == "DELETE" && r.status == 200) == 1);
}

#[tokio::test]
async fn label_selectors_filter_lists() {
    let s = server().await;
    let a = s.addr();
    for (name, labels) in [
        ("plain", json!({"app": "a"})),
        ("headless", json!({"service.kubernetes.io/headless": ""})),
        (
            "other-proxy",
            json!({"service.kubernetes.io/service-proxy-name": "foo"}),
        ),
        ("tiered", json!({"tier": "db", "app": "b"})),
    ] {
        let r = request(
            a,
            "POST",
            "/api/v1/namespaces/default/services",
            Some(&svc("default", name, labels)),
        )
        .await;
        assert_eq!(r.status, 201);
    }
    let names = |v: &Value| -> Vec<String> {
        v["items"]
            .as_array()
            .unwrap()
            .iter()
            .map(|i| i["metadata"]["name"].as_str().unwrap().to_string())
            .collect()
    };
    let sel = "%21service.kubernetes.io%2Fservice-proxy-name%2C%21service.kubernetes.io%2Fheadless";
    let (_, l) = get_json(a, &format!("/api/v1/services?labelSelector={sel}")).await;
    assert_eq!(names(&l), ["plain", "tiered"]);
    let (_, l) = get_json(
        a,
        "/api/v1/services?labelSelector=app%20in%20(a%2Cb)%2Ctier%21%3Ddb",
    )
    .await;
    assert_eq!(names(&l), ["plain"]);
    let (_, l) = get_json(a, "/api/v1/namespaces/default/services?labelSelector=tier").await;
    assert_eq!(names(&l), ["tiered"]);
    let (_, l) = get_json(a, "/api/v1/namespaces/other/services").await;
    assert_eq!(names(&l), Vec::<String>::new());
    let (_, l) = get_json(a, "/api/v1/services?fieldSelector=metadata.name%3Dheadless").await;
    assert_eq!(names(&l), ["headless"]);
}

#[tokio::test]
async fn pagination_is_a_consistent_snapshot_and_expires_on_compaction() {
    let s = server().await;
    let a = s.addr();
    for i in 0..7 {
        s.create(
            &serde_json::from_value::<Service>(svc("default", &format!("s{i}"), json!({})))
                .unwrap(),
        )
        .unwrap();
    }
    let (code, p1) = get_json(a, "/api/v1/services?limit=3").await;
    assert_eq!(code, 200);
    assert_eq!(p1["items"].as_array().unwrap().len(), 3);
    assert_eq!(p1["metadata"]["remainingItemCount"], 4);
    let snapshot_rv = p1["metadata"]["resourceVersion"].clone();
    // Writes between pages do not show up in later pages: the list is a snapshot.
    s.create(&serde_json::from_value::<Service>(svc("default", "s9-late", json!({}))).unwrap())
        .unwrap();
    s.delete::<Service>("default", "s5").unwrap();
    let mut names: Vec<String> = p1["items"]
        .as_array()
        .unwrap()
        .iter()
        .map(|i| i["metadata"]["name"].as_str().unwrap().into())
        .collect();
    let mut token = p1["metadata"]["continue"].as_str().unwrap().to_string();
    loop {
        let (code, p) = get_json(a, &format!("/api/v1/services?limit=3&continue={token}")).await;
        assert_eq!(code, 200);
        assert_eq!(p["metadata"]["resourceVersion"], snapshot_rv);
        names.extend(item_names(&p));
        match p["metadata"]["continue"].as_str() {
            Some(t) => token = t.to_string(),
            None => break,
        }
    }
    assert_eq!(names, ["s0", "s1", "s2", "s3", "s4", "s5", "s6"]);
    // A fresh list sees the new state.
    let (_, now) = get_json(a, "/api/v1/services").await;
    assert_eq!(now["items"].as_array().unwrap().len(), 7);
    // After compaction the old continue token is 410 Expired.
    let (_, p1) = get_json(a, "/api/v1/services?limit=2").await;
    s.create(&serde_json::from_value::<Service>(svc("default", "s10", json!({}))).unwrap())
        .unwrap();
    s.compact();
    let token = p1["metadata"]["continue"].as_str().unwrap();
    let (code, st) = get_json(a, &format!("/api/v1/services?limit=2&continue={token}")).await;
    assert_eq!(
        (code, st["reason"].as_str(), st["code"].as_u64()),
        (410, Some("Expired"), Some(410))
    );
    // resourceVersion=0 is served from the "cache": limit ignored.
    let (_, all) = get_json(a, "/api/v1/services?limit=2&resourceVersion=0").await;
    assert_eq!(all["items"].as_array().unwrap().len(), 8);
}

/// With a label or field selector the real server cannot count what remains, and leaves
/// `remainingItemCount` out; the pages still cover exactly the matching objects.
#[tokio::test]
async fn selected_pages_have_no_remaining_count_and_cover_every_match() {
    let s = server().await;
    let a = s.addr();
    for i in 0..9 {
        let labels = if i % 3 == 0 {
            json!({"service.kubernetes.io/headless": ""})
        } else {
            json!({"app": format!("a{i}")})
        };
        s.create(
            &serde_json::from_value::<Service>(svc("default", &format!("s{i}"), labels)).unwrap(),
        )
        .unwrap();
    }
    let selector = "labelSelector=!service.kubernetes.io/headless";
    let mut names: Vec<String> = Vec::new();
    let mut path = format!("/api/v1/services?limit=2&{selector}");
    let mut pages = 0;
    loop {
        let (code, p) = get_json(a, &path).await;
        assert_eq!(code, 200, "{p}");
        pages += 1;
        assert!(
            p["metadata"].get("remainingItemCount").is_none(),
            "a count with a selector: {p}"
        );
        names.extend(item_names(&p));
        match p["metadata"]["continue"].as_str() {
            Some(t) => path = format!("/api/v1/services?limit=2&{selector}&continue={t}"),
            None => break,
        }
    }
    assert_eq!(names, ["s1", "s2", "s4", "s5", "s7", "s8"]);
    assert_eq!(pages, 3, "a last full page ends the list");
    // Without a selector the count is there.
    let (_, p) = get_json(a, "/api/v1/services?limit=2").await;
    assert_eq!(p["metadata"]["remainingItemCount"], 7);
}

#[tokio::test]
async fn watch_streams_changes_with_label_transitions_and_bookmarks() {
    let s = server().await;
    let a = s.addr();
    s.create(&serde_json::from_value::<Service>(svc("default", "before", json!({}))).unwrap())
        .unwrap();
    let (_, list) = get_json(a, "/api/v1/services").await;
    let rv = list["metadata"]["resourceVersion"]
        .as_str()
        .unwrap()
        .to_string();
    let sel = "%21service.kubernetes.io%2Fheadless";
    let mut w = request(a, "GET", &format!("/api/v1/services?watch=1&allowWatchBookmarks=true&labelSelector={sel}&resourceVersion={rv}"), None).await;
    assert_eq!(w.status, 200);
    assert_eq!(w.header("transfer-encoding"), Some("chunked"));

    let created = s
        .create(&serde_json::from_value::<Service>(svc("default", "x", json!({}))).unwrap())
        .unwrap();
    let ev = w.next_change().await.unwrap();
    assert_eq!(
        (
            ev["type"].as_str(),
            ev["object"]["metadata"]["name"].as_str()
        ),
        (Some("ADDED"), Some("x"))
    );
    assert_eq!(ev["object"]["kind"], "Service");
    let rv1 = rv_of(&ev["object"]);

    let mut m = created.clone();
    m.spec.as_mut().unwrap().ports.as_mut().unwrap()[0].port = 81;
    s.update(&m).unwrap();
    let ev = w.next_change().await.unwrap();
    assert_eq!(ev["type"], "MODIFIED");
    assert!(rv_of(&ev["object"]) > rv1);

    // Becoming headless leaves the selector: DELETED; losing the label again: ADDED.
    let mut h = s.get::<Service>("default", "x").unwrap();
    h.metadata.labels =
        Some([("service.kubernetes.io/headless".to_string(), String::new())].into());
    let h = s.update(&h).unwrap();
    assert_eq!(w.next_change().await.unwrap()["type"], "DELETED");
    let mut back = h.clone();
    back.metadata.labels = None;
    s.update(&back).unwrap();
    assert_eq!(w.next_change().await.unwrap()["type"], "ADDED");

    // A bookmark carries kind, apiVersion and the current resourceVersion only.
    s.send_bookmarks();
    let bm = w.next_event().await.unwrap();
    assert_eq!(bm["type"], "BOOKMARK");
    assert_eq!(bm["object"]["kind"], "Service");
    assert_eq!(bm["object"]["apiVersion"], "v1");
    assert_eq!(rv_of(&bm["object"]), s.resource_version());
    assert!(bm["object"].get("spec").is_none());

    s.delete::<Service>("default", "x").unwrap();
    let ev = w.next_change().await.unwrap();
    assert_eq!(ev["type"], "DELETED");
    assert_eq!(
        rv_of(&ev["object"]),
        s.resource_version(),
        "DELETED carries the deletion rv"
    );
    assert_eq!(s.open_watches(), 1);
    assert_eq!(s.close_watches(), 1);
    assert_eq!(w.next_event().await, Err(End::Clean));
}

#[tokio::test]
async fn watch_without_bookmarks_gets_none() {
    let s = server().await;
    let mut w = request(
        s.addr(),
        "GET",
        "/api/v1/services?watch=true&resourceVersion=1",
        None,
    )
    .await;
    s.send_bookmarks();
    s.create(&serde_json::from_value::<Service>(svc("default", "y", json!({}))).unwrap())
        .unwrap();
    assert_eq!(w.next_event().await.unwrap()["type"], "ADDED");
}

#[tokio::test]
async fn watch_replays_history_and_410s_when_compacted() {
    let s = server().await;
    let a = s.addr();
    let start = s.resource_version();
    s.create(&serde_json::from_value::<Service>(svc("default", "a", json!({}))).unwrap())
        .unwrap();
    s.delete::<Service>("default", "a").unwrap();
    // Resume from before the changes: both are replayed in order.
    let mut w = request(
        a,
        "GET",
        &format!("/api/v1/services?watch=1&resourceVersion={start}"),
        None,
    )
    .await;
    assert_eq!(w.next_event().await.unwrap()["type"], "ADDED");
    assert_eq!(w.next_event().await.unwrap()["type"], "DELETED");
    drop(w);

    s.compact();
    let mut w = request(
        a,
        "GET",
        &format!("/api/v1/services?watch=1&resourceVersion={start}"),
        None,
    )
    .await;
    assert_eq!(
        w.status, 200,
        "like the real server, the 410 arrives as a watch event"
    );
    let ev = w.next_event().await.unwrap();
    assert_eq!(ev["type"], "ERROR");
    assert_eq!(ev["object"]["kind"], "Status");
    assert_eq!(ev["object"]["code"], 410);
    assert_eq!(ev["object"]["reason"], "Expired");
    assert!(ev["object"]["message"]
        .as_str()
        .unwrap()
        .starts_with("too old resource version"));
    assert_eq!(w.next_event().await, Err(End::Clean));

    // Resuming from the compaction point itself is fine.
    let now = s.resource_version();
    let mut w = request(
        a,
        "GET",
        &format!("/api/v1/services?watch=1&resourceVersion={now}"),
        None,
    )
    .await;
    s.create(&serde_json::from_value::<Service>(svc("default", "b", json!({}))).unwrap())
        .unwrap();
    assert_eq!(w.next_event().await.unwrap()["type"], "ADDED");

    // expire_watches sends a 410 ERROR to open watches.
    assert_eq!(s.expire_watches(), 1);
    assert_eq!(w.next_event().await.unwrap()["object"]["code"], 410);
    assert_eq!(w.next_event().await, Err(End::Clean));
}

#[tokio::test]
async fn watch_initial_events_and_streaming_list() {
    let s = server().await;
    let a = s.addr();
    for n in ["a", "b"] {
        s.create(&serde_json::from_value::<Service>(svc("default", n, json!({}))).unwrap())
            .unwrap();
    }
    // No resourceVersion: synthetic ADDED for the current state.
    let mut w = request(a, "GET", "/api/v1/services?watch=1", None).await;
    assert_eq!(
        w.next_event().await.unwrap()["object"]["metadata"]["name"],
        "a"
    );
    assert_eq!(
        w.next_event().await.unwrap()["object"]["metadata"]["name"],
        "b"
    );
    // Streaming list: ADDED..., then a bookmark annotated initial-events-end.
    let mut w = request(a, "GET", "/api/v1/services?watch=true&sendInitialEvents=true&allowWatchBookmarks=true&resourceVersionMatch=NotOlderThan&resourceVersion=0", None).await;
    assert_eq!(w.next_event().await.unwrap()["type"], "ADDED");
    assert_eq!(w.next_event().await.unwrap()["type"], "ADDED");
    let bm = w.next_event().await.unwrap();
    assert_eq!(bm["type"], "BOOKMARK");
    assert_eq!(
        bm["object"]["metadata"]["annotations"]["k8s.io/initial-events-end"],
        "true"
    );
    assert_eq!(rv_of(&bm["object"]), s.resource_version());
    // sendInitialEvents without bookmarks is invalid.
    let r = request(
        a,
        "GET",
        "/api/v1/services?watch=true&sendInitialEvents=true",
        None,
    )
    .await;
    assert_eq!(r.status, 422);
}

#[tokio::test]
async fn drop_close_and_timeout_end_watches_differently() {
    let s = server().await;
    let a = s.addr();
    let mut w1 = request(a, "GET", "/api/v1/services?watch=1&resourceVersion=1", None).await;
    let mut w2 = request(
        a,
        "GET",
        "/apis/discovery.k8s.io/v1/endpointslices?watch=1&resourceVersion=1",
        None,
    )
    .await;
    let mut w3 = request(
        a,
        "GET",
        "/api/v1/nodes?watch=1&resourceVersion=1&timeoutSeconds=1",
        None,
    )
    .await;
    while s.open_watches() < 3 {
        tokio::task::yield_now().await;
    }
    // Dropping aborts the connections mid-body (no terminating chunk).
    assert_eq!(s.drop_watches(), 3);
    assert_eq!(w1.next_event().await, Err(End::Aborted));
    assert_eq!(w2.next_event().await, Err(End::Aborted));
    assert_eq!(w3.next_event().await, Err(End::Aborted));
    // timeoutSeconds ends the stream cleanly.
    let mut w4 = request(
        a,
        "GET",
        "/api/v1/nodes?watch=1&resourceVersion=1&timeoutSeconds=1",
        None,
    )
    .await;
    assert_eq!(w4.next_event().await, Err(End::Clean));
    assert_eq!(s.open_watches(), 0);
}

#[tokio::test]
async fn nodes_by_name_and_field_selector_watch() {
    let s = server().await;
    let a = s.addr();
    for n in ["node-a", "node-b"] {
        s.create(
            &serde_json::from_value::<Node>(
                json!({"metadata": {"name": n, "labels": {"topology.kubernetes.io/zone": "z1"}}}),
            )
            .unwrap(),
        )
        .unwrap();
    }
    let (code, n) = get_json(a, "/api/v1/nodes/node-a").await;
    assert_eq!(code, 200);
    assert!(n["metadata"].get("namespace").is_none());
    let (code, _) = get_json(a, "/api/v1/namespaces/default/nodes/node-a").await;
    assert_eq!(code, 404);
    let (_, l) = get_json(a, "/api/v1/nodes?fieldSelector=metadata.name%3Dnode-b").await;
    assert_eq!(l["items"].as_array().unwrap().len(), 1);
    let rv = l["metadata"]["resourceVersion"]
        .as_str()
        .unwrap()
        .to_string();
    let mut w = request(
        a,
        "GET",
        &format!("/api/v1/nodes?watch=1&fieldSelector=metadata.name%3Dnode-b&resourceVersion={rv}"),
        None,
    )
    .await;
    let mut na = s.get::<Node>("", "node-a").unwrap();
    na.metadata.labels = None;
    s.update(&na).unwrap();
    let mut nb = s.get::<Node>("", "node-b").unwrap();
    nb.metadata.labels =
        Some([("topology.kubernetes.io/zone".to_string(), "z2".to_string())].into());
    s.update(&nb).unwrap();
    let ev = w.next_event().await.unwrap();
    assert_eq!(
        (
            ev["type"].as_str(),
            ev["object"]["metadata"]["name"].as_str()
        ),
        (Some("MODIFIED"), Some("node-b"))
    );
    // Deletion with a finalizer: MODIFIED with deletionTimestamp, then DELETED when cleared.
    nb = s.get::<Node>("", "node-b").unwrap();
    nb.metadata.finalizers = Some(vec!["test/keep".into()]);
    s.update(&nb).unwrap();
    assert_eq!(w.next_event().await.unwrap()["type"], "MODIFIED");
    s.delete::<Node>("", "node-b").unwrap();
    let ev = w.next_event().await.unwrap();
    assert_eq!(ev["type"], "MODIFIED");
    assert!(ev["object"]["metadata"]["deletionTimestamp"].is_string());
    let mut nb = s.get::<Node>("", "node-b").unwrap();
    nb.metadata.finalizers = None;
    s.update(&nb).unwrap();
    assert_eq!(w.next_event().await.unwrap()["type"], "DELETED");
    assert!(s.get::<Node>("", "node-b").is_none());
}

#[tokio::test]
async fn pause_refuses_connections_until_resume() {
    let s = server().await;
    let a = s.addr();
    let mut w = request(a, "GET", "/api/v1/services?watch=1&resourceVersion=1", None).await;
    s.pause().await;
    assert!(s.is_paused());
    assert!(w.next_event().await.is_err());
    let err = TcpStream::connect(a).await.unwrap_err();
    assert_eq!(err.kind(), std::io::ErrorKind::ConnectionRefused);
    s.create(
        &serde_json::from_value::<Service>(svc("default", "during-pause", json!({}))).unwrap(),
    )
    .unwrap();
    s.resume().unwrap();
    let (code, l) = get_json(a, "/api/v1/services").await;
    assert_eq!(code, 200);
    assert_eq!(l["items"][0]["metadata"]["name"], "during-pause");
}

/// A paused server keeps its port: another socket cannot be bound to it meanwhile (a server
/// another test starts would otherwise be given it, and this server's clients reach that one),
/// and the server listens on it again when resumed.
#[tokio::test]
async fn pause_keeps_the_port() {
    let s = server().await;
    let a = s.addr();
    s.pause().await;
    // No connection was ever made, so no TIME_WAIT holds the port: only the reservation does.
    let probe = tokio::net::TcpSocket::new_v4().unwrap();
    let err = probe.bind(a).unwrap_err();
    assert_eq!(err.kind(), std::io::ErrorKind::AddrInUse);
    drop(probe);
    s.resume().unwrap();
    let (code, _) = get_json(a, "/api/v1/services").await;
    assert_eq!(code, 200);
}

#[tokio::test]
async fn events_are_recorded() {
    let s = server().await;
    let a = s.addr();
    let ev = json!({"apiVersion": "events.k8s.io/v1", "kind": "Event", "metadata": {"name": "e1"}, "reason": "Synced", "note": "hello", "eventTime": "2024-01-01T00:00:00.000000Z"});
    let r = request(
        a,
        "POST",
        "/apis/events.k8s.io/v1/namespaces/default/events",
        Some(&ev),
    )
    .await;
    assert_eq!(r.status, 201);
    let r = request(
        a,
        "PATCH",
        "/apis/events.k8s.io/v1/namespaces/default/events/e1",
        Some(&json!({"series": {"count": 2}})),
    )
    .await;
    assert_eq!(r.status, 200);
    let r = request(
        a,
        "POST",
        "/api/v1/namespaces/kube-system/events",
        Some(&json!({"metadata": {"name": "e2"}, "reason": "Old"})),
    )
    .await;
    assert_eq!(r.status, 201);
    let evs = s.events();
    assert_eq!(evs.len(), 2);
    assert_eq!(evs[0]["series"]["count"], 2);
    assert_eq!(evs[0]["note"], "hello");
    assert_eq!(evs[1]["metadata"]["namespace"], "kube-system");
}

#[tokio::test]
async fn events_v1_over_the_apis_limits_are_rejected_like_the_real_api() {
    let s = server().await;
    let a = s.addr();
    let path = "/apis/events.k8s.io/v1/namespaces/default/events";
    let ev = |name: &str, note: String, reason: String| {
        json!({"apiVersion": "events.k8s.io/v1", "kind": "Event", "metadata": {"name": name},
               "reason": reason, "action": "Skip", "note": note})
    };
    // 1 KiB note and 128-character reason: accepted.
    let r = request(
        a,
        "POST",
        path,
        Some(&ev("ok", "n".repeat(1024), "r".repeat(128))),
    )
    .await;
    assert_eq!(r.status, 201);
    // One byte more: 422 Invalid, nothing stored.
    let r = request(
        a,
        "POST",
        path,
        Some(&ev("long-note", "n".repeat(1025), "R".into())),
    )
    .await;
    assert_eq!(r.status, 422);
    let r = request(
        a,
        "POST",
        path,
        Some(&ev("long-reason", "n".into(), "r".repeat(129))),
    )
    .await;
    assert_eq!(r.status, 422);
    // A patch cannot grow the note past the limit either.
    let r = request(
        a,
        "PATCH",
        "/apis/events.k8s.io/v1/namespaces/default/events/ok",
        Some(&json!({"note": "x".repeat(2000)})),
    )
    .await;
    assert_eq!(r.status, 422);
    let evs = s.events();
    assert_eq!(evs.len(), 1, "{evs:#?}");
    assert_eq!(evs[0]["note"].as_str().unwrap().len(), 1024);
}

#[tokio::test]
async fn typed_api_and_fixtures() {
    let s = server().await;
    let dir =
        std::env::temp_dir().join(format!("testkit-apiserver-fixtures-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(
        dir.join("objs.yaml"),
        "apiVersion: v1\nkind: Service\nmetadata: {name: s1, namespace: ns1}\nspec: {clusterIP: 10.96.0.1, ports: [{port: 53, protocol: UDP}]}\n---\napiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata: {name: s1-abc, namespace: ns1, labels: {kubernetes.io/service-name: s1}}\naddressType: IPv4\nendpoints: [{addresses: [10.244.0.5]}]\n---\napiVersion: v1\nkind: Node\nmetadata: {name: n1}\n",
    )
    .unwrap();
    assert_eq!(s.load_dir(&dir).unwrap(), 3);
    std::fs::remove_dir_all(&dir).unwrap();
    let slices = s.list::<k8s_openapi::api::discovery::v1::EndpointSlice>();
    assert_eq!(slices.len(), 1);
    assert_eq!(slices[0].endpoints[0].addresses, ["10.244.0.5"]);
    let svc = s.get::<Service>("ns1", "s1").unwrap();
    assert_eq!(svc.spec.unwrap().ports.unwrap()[0].port, 53);
    assert!(s.get::<Node>("ignored", "n1").is_some());
    let kc = s.kubeconfig();
    assert!(kc.contains(&format!("server: {}", s.url())));
}
