//! The standalone `fake-apiserver` binary: fixtures, REST writes, the control API (drop, compact,
//! pause/resume), and a kubeconfig that works.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // test helpers

use serde_json::{json, Value};
use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::process::{Child, Command, Stdio};
use testkit::apiserver::raw::{self, StreamEnd};

/// The running binary; killed on drop.
struct Proc {
    child: Child,
    api: SocketAddr,
    control: SocketAddr,
    dir: std::path::PathBuf,
}

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn addr_of(line: &str, prefix: &str) -> SocketAddr {
    line.trim()
        .strip_prefix(prefix)
        .and_then(|u| u.strip_prefix("http://"))
        .unwrap_or_else(|| panic!("unexpected line {line:?}"))
        .parse()
        .unwrap()
}

fn start(tag: &str) -> Proc {
    let dir = std::env::temp_dir().join(format!(
        "testkit-apiserver-bin-{tag}-{}",
        std::process::id()
    ));
    let fixtures = dir.join("fixtures");
    std::fs::create_dir_all(&fixtures).unwrap();
    std::fs::write(
        fixtures.join("a.yaml"),
        "apiVersion: v1\nkind: List\nitems:\n- apiVersion: v1\n  kind: Service\n  metadata: {name: dns, namespace: kube-system}\n  spec: {clusterIP: 10.96.0.10, ports: [{name: dns, port: 53, protocol: UDP}]}\n- apiVersion: v1\n  kind: Node\n  metadata: {name: node-a}\n",
    )
    .unwrap();
    std::fs::write(
        fixtures.join("b.json"),
        r#"{"apiVersion":"discovery.k8s.io/v1","kind":"EndpointSlice","metadata":{"name":"dns-1","namespace":"kube-system","labels":{"kubernetes.io/service-name":"dns"}},"addressType":"IPv4","endpoints":[{"addresses":["10.244.0.2"]}]}"#,
    )
    .unwrap();
    let mut child = Command::new(env!("CARGO_BIN_EXE_fake-apiserver"))
        .args([
            "--listen",
            "127.0.0.1:0",
            "--control",
            "127.0.0.1:0",
            "--bookmark-interval-ms",
            "0",
        ])
        .arg("--fixtures")
        .arg(&fixtures)
        .arg("--kubeconfig")
        .arg(dir.join("kubeconfig"))
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut out = BufReader::new(child.stdout.take().unwrap());
    let (mut l1, mut l2) = (String::new(), String::new());
    out.read_line(&mut l1).unwrap();
    out.read_line(&mut l2).unwrap();
    Proc {
        child,
        api: addr_of(&l1, "api "),
        control: addr_of(&l2, "control "),
        dir,
    }
}

async fn post(addr: SocketAddr, path: &str, body: Option<&Value>) -> (u16, Value) {
    let r = raw::request(addr, "POST", path, body).await.unwrap();
    let s = r.status;
    (s, r.json().await.unwrap())
}

#[tokio::test]
async fn serves_fixtures_rest_writes_and_control() {
    scenario("host").await;
}

/// The same scenario inside the test VM (its initramfs and loopback), where e2e tests run the
/// binary.
#[test]
#[ignore = "vm"]
fn vm_fake_apiserver_binary_serves_fixtures_and_control() {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
        .block_on(scenario("vm"));
}

async fn scenario(tag: &str) {
    let p = start(tag);
    let (code, l) = raw::get_json(p.api, "/api/v1/services").await.unwrap();
    assert_eq!(code, 200);
    assert_eq!(l["items"][0]["metadata"]["name"], "dns");
    let (_, l) = raw::get_json(
        p.api,
        "/apis/discovery.k8s.io/v1/namespaces/kube-system/endpointslices",
    )
    .await
    .unwrap();
    assert_eq!(l["items"][0]["endpoints"][0]["addresses"][0], "10.244.0.2");
    let (code, _) = raw::get_json(p.api, "/api/v1/nodes/node-a").await.unwrap();
    assert_eq!(code, 200);
    let kubeconfig = std::fs::read_to_string(p.dir.join("kubeconfig")).unwrap();
    assert!(kubeconfig.contains(&format!("server: http://{}", p.api)));

    // Watch from the current rv, then write over REST: the watch sees it.
    let rv = l["metadata"]["resourceVersion"]
        .as_str()
        .unwrap()
        .to_string();
    let mut w = raw::request(
        p.api,
        "GET",
        &format!("/api/v1/services?watch=1&resourceVersion={rv}"),
        None,
    )
    .await
    .unwrap();
    let svc = json!({"apiVersion": "v1", "kind": "Service", "metadata": {"name": "web"}, "spec": {"ports": [{"port": 80}]}});
    let (code, created) = post(p.api, "/api/v1/namespaces/default/services", Some(&svc)).await;
    assert_eq!(code, 201);
    let ev = w.next_event().await.unwrap();
    assert_eq!(
        (
            ev["type"].as_str(),
            ev["object"]["metadata"]["uid"].as_str()
        ),
        (Some("ADDED"), created["metadata"]["uid"].as_str())
    );

    // Control: drop the watch (connection cut mid-stream).
    let (code, r) = post(p.control, "/drop-watches", None).await;
    assert_eq!((code, r["dropped"].as_u64()), (200, Some(1)));
    assert_eq!(w.next_event().await, Err(StreamEnd::Aborted));

    // Control: compact → a watch from the old rv gets a 410 ERROR event.
    let (_, st) = post(p.control, "/compact", None).await;
    assert!(st["compacted"].as_u64().unwrap() > rv.parse::<u64>().unwrap());
    let mut w = raw::request(
        p.api,
        "GET",
        &format!("/api/v1/services?watch=1&resourceVersion={rv}"),
        None,
    )
    .await
    .unwrap();
    let ev = w.next_event().await.unwrap();
    assert_eq!(
        (ev["type"].as_str(), ev["object"]["code"].as_u64()),
        (Some("ERROR"), Some(410))
    );

    // Control: pause refuses connections, resume accepts again; state reports it.
    post(p.control, "/pause", None).await;
    assert_eq!(
        tokio::net::TcpStream::connect(p.api)
            .await
            .unwrap_err()
            .kind(),
        std::io::ErrorKind::ConnectionRefused
    );
    let (_, state) = raw::get_json(p.control, "/state").await.unwrap();
    assert_eq!(state["paused"], true);
    post(p.control, "/resume", None).await;
    let (code, _) = raw::get_json(p.api, "/api/v1/services/").await.unwrap();
    assert_eq!(code, 200);

    // Reset history: rv jumps.
    let (_, before) = raw::get_json(p.control, "/state").await.unwrap();
    let (_, after) = post(p.control, "/reset-history?jump=5000", None).await;
    assert_eq!(
        after["resourceVersion"].as_u64().unwrap(),
        before["resourceVersion"].as_u64().unwrap() + 5000
    );

    let (_, reqs) = raw::get_json(p.control, "/requests").await.unwrap();
    assert!(reqs
        .as_array()
        .unwrap()
        .iter()
        .any(|r| r["method"] == "POST" && r["status"] == 201));
}
