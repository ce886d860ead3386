//! Tests of the static directory source against real files, directories and inotify.

// Test helpers outside #[test] fns may unwrap/panic too.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use ::watch::static_dir::{self, StaticDirError, StaticDirSource};
use model::event::{Kind, Object, SourceEvent};
use tokio::sync::mpsc;

/// A temporary directory removed on drop.
struct TempDir(PathBuf);

impl TempDir {
    fn new(tag: &str) -> Self {
        static N: AtomicUsize = AtomicUsize::new(0);
        let p = std::env::temp_dir().join(format!(
            "controller-static-dir-{tag}-{}-{}",
            std::process::id(),
            N.fetch_add(1, Ordering::SeqCst)
        ));
        let _ = std::fs::remove_dir_all(&p);
        std::fs::create_dir_all(&p).unwrap();
        TempDir(p)
    }
    fn path(&self) -> &Path {
        &self.0
    }
    fn write(&self, name: &str, text: &str) {
        // Write to a hidden temp file and rename, like an editor or a ConfigMap update.
        let tmp = self.0.join(format!(".{name}.tmp"));
        std::fs::write(&tmp, text).unwrap();
        std::fs::rename(&tmp, self.0.join(name)).unwrap();
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn svc(name: &str, ip: &str) -> String {
    format!(
        "apiVersion: v1\nkind: Service\nmetadata:\n  name: {name}\nspec:\n  clusterIP: {ip}\n  ports:\n  - port: 80\n    protocol: TCP\n"
    )
}

fn names_of(snapshot: &static_dir::Snapshot) -> Vec<String> {
    snapshot
        .services
        .iter()
        .map(|s| format!("{}/{}", s.name.namespace, s.name.name))
        .collect()
}

const MIXED: &str = r#"
# a comment-only first part, then three documents and a List
apiVersion: v1
kind: Service
metadata: {name: a, namespace: ns1}
spec:
  clusterIP: 10.96.0.1
  ports: [{port: 443, protocol: TCP, targetPort: 6443}]
---
---
apiVersion: apps/v1
kind: Deployment
metadata: {name: ignored}
---
apiVersion: v1
kind: List
items:
- apiVersion: v1
  kind: Service
  metadata: {name: b}
  spec: {clusterIP: 10.96.0.2, ports: [{port: 53, protocol: UDP}]}
- apiVersion: discovery.k8s.io/v1
  kind: EndpointSlice
  metadata:
    name: b-1
    labels: {kubernetes.io/service-name: b}
  addressType: IPv4
  endpoints: [{addresses: [10.244.0.5], conditions: {ready: true}}]
  ports: [{port: 53, protocol: UDP}]
"#;

#[test]
fn parses_multi_document_and_list_files() {
    let objs = static_dir::parse_file(Path::new("mixed.yaml"), MIXED).unwrap();
    assert_eq!(objs.services.len(), 2);
    assert_eq!(&*objs.services[0].name.namespace, "ns1");
    // No namespace given: "default", like kubectl.
    assert_eq!(&*objs.services[1].name.namespace, "default");
    let spec = objs.services[0].spec.as_ref().unwrap();
    assert_eq!(spec.cluster_ip.as_deref(), Some("10.96.0.1"));
    let port = &spec.ports.as_ref().unwrap()[0];
    assert_eq!(port.port, 443);
    // targetPort is not kept: the proxy takes target ports from the endpoints.
    assert_eq!(port.protocol.as_deref(), Some("TCP"));
    assert_eq!(objs.endpoint_slices.len(), 1);
    assert_eq!(&*objs.endpoint_slices[0].namespace, "default");
    assert_eq!(
        objs.endpoint_slices[0].endpoints[0].ip.to_string(),
        "10.244.0.5"
    );
    // The Deployment is ignored with a warning naming the file and document.
    assert_eq!(objs.warnings.len(), 1, "{:?}", objs.warnings);
    assert!(
        objs.warnings[0].contains("mixed.yaml: document 2"),
        "{}",
        objs.warnings[0]
    );
    assert!(objs.warnings[0].contains("Deployment"));
}

#[test]
fn large_files_load_beyond_the_parser_default_budget() {
    // serde-saphyr stops at 1,024 documents per file by default; generated directories for
    // thousands of services must still load.
    let text: String = (0..1500)
        .map(|i| {
            svc(
                &format!("s{i}"),
                &format!("10.96.{}.{}", i / 250, i % 250 + 1),
            )
        })
        .collect::<Vec<_>>()
        .join("---\n");
    let objs = static_dir::parse_file(Path::new("big.yaml"), &text).unwrap();
    assert_eq!(objs.services.len(), 1500);
    assert_eq!(&*objs.services[1499].name.name, "s1499");
}

#[test]
fn bad_document_names_file_document_and_item() {
    let text = format!("{}---\n{}", svc("ok", "10.96.0.1"), "apiVersion: v1\nkind: Service\nmetadata: {name: bad}\nspec:\n  ports:\n  - port: notanumber\n");
    let err = static_dir::parse_file(Path::new("f.yaml"), &text).unwrap_err();
    let msg = err.to_string();
    assert!(
        matches!(
            err,
            StaticDirError::Document {
                document: 2,
                item: None,
                ..
            }
        ),
        "{msg}"
    );
    assert!(msg.starts_with("f.yaml: document 2: Service:"), "{msg}");

    let list = "kind: List\napiVersion: v1\nitems:\n- apiVersion: v1\n  kind: Service\n  metadata: {name: x}\n- apiVersion: discovery.k8s.io/v1beta1\n  kind: EndpointSlice\n  metadata: {name: y}\n";
    let err = static_dir::parse_file(Path::new("l.yaml"), list).unwrap_err();
    assert!(matches!(
        err,
        StaticDirError::Document {
            document: 1,
            item: Some(1),
            ..
        }
    ));
    assert!(
        err.to_string().contains("discovery.k8s.io/v1beta1"),
        "{err}"
    );

    let err = static_dir::parse_file(Path::new("s.yaml"), "a: [1, 2\n").unwrap_err();
    assert!(matches!(err, StaticDirError::Yaml { .. }), "{err}");

    let err = static_dir::parse_file(
        Path::new("n.yaml"),
        "apiVersion: v1\nkind: Service\nspec: {}\n",
    )
    .unwrap_err();
    assert!(
        err.to_string().contains("metadata.name is missing"),
        "{err}"
    );
}

#[test]
fn load_skips_bad_files_and_keeps_the_rest() {
    let dir = TempDir::new("skip");
    dir.write("a.yaml", &svc("a", "10.96.0.1"));
    dir.write(
        "b.yml",
        "kind: Service\napiVersion: v1\nmetadata: {name: b}\nspec: {ports: [{port: \"http\"}]}\n",
    );
    dir.write("c.json", r#"{"apiVersion":"v1","kind":"Service","metadata":{"name":"c"},"spec":{"clusterIP":"10.96.0.3"}}"#);
    dir.write("notes.txt", "not yaml: [");
    dir.write(".hidden.yaml", &svc("hidden", "10.96.0.9"));
    std::fs::create_dir(dir.path().join("sub.yaml")).unwrap();

    let res = static_dir::load(dir.path(), "host-a").unwrap();
    assert_eq!(names_of(&res.snapshot), vec!["default/a", "default/c"]);
    assert_eq!(res.errors.len(), 1);
    let msg = res.errors[0].to_string();
    assert!(msg.contains("b.yml: document 1"), "{msg}");
    assert_eq!(res.snapshot.files.len(), 2);

    let missing = static_dir::load(&dir.path().join("nope"), "h").unwrap_err();
    assert!(matches!(missing, StaticDirError::ReadDir { .. }));
}

#[test]
fn symlinked_files_are_read_like_configmap_volumes() {
    let dir = TempDir::new("symlink");
    let data = dir.path().join("..2026_01_01");
    std::fs::create_dir(&data).unwrap();
    std::fs::write(data.join("svc.yaml"), svc("linked", "10.96.0.7")).unwrap();
    std::os::unix::fs::symlink("..2026_01_01", dir.path().join("..data")).unwrap();
    std::os::unix::fs::symlink("..data/svc.yaml", dir.path().join("svc.yaml")).unwrap();
    let res = static_dir::load(dir.path(), "h").unwrap();
    assert_eq!(names_of(&res.snapshot), vec!["default/linked"]);
}

#[test]
fn node_selection_and_synthesis() {
    let node = |name: &str, zone: &str| {
        format!("apiVersion: v1\nkind: Node\nmetadata:\n  name: {name}\n  labels: {{topology.kubernetes.io/zone: {zone}}}\n")
    };
    let dir = TempDir::new("node");
    // No Node: synthesized, named after the host.
    let s = static_dir::load(dir.path(), "my-host").unwrap().snapshot;
    assert!(s.node_synthesized);
    assert_eq!(s.node_name(), "my-host");
    assert_eq!(
        s.node.metadata.labels.as_ref().unwrap()["kubernetes.io/hostname"],
        "my-host"
    );
    // Exactly one Node: used whatever its name.
    dir.write("n1.yaml", &node("node-1", "z1"));
    let s = static_dir::load(dir.path(), "my-host").unwrap().snapshot;
    assert!(!s.node_synthesized);
    assert_eq!(s.node_name(), "node-1");
    // Several: the one named like the host.
    dir.write("n2.yaml", &node("my-host", "z2"));
    let s = static_dir::load(dir.path(), "my-host").unwrap().snapshot;
    assert_eq!(s.node_name(), "my-host");
    assert_eq!(
        s.node.metadata.labels.as_ref().unwrap()["topology.kubernetes.io/zone"],
        "z2"
    );
    // Several and none matches: synthesized, with a warning.
    let s = static_dir::load(dir.path(), "other").unwrap().snapshot;
    assert!(s.node_synthesized);
    assert_eq!(s.node_name(), "other");
    assert!(s
        .warnings
        .iter()
        .any(|w| w.contains("none named \"other\"")));
}

#[test]
fn duplicates_later_file_wins() {
    let dir = TempDir::new("dup");
    dir.write("1.yaml", &svc("x", "10.96.0.1"));
    dir.write("2.yaml", &svc("x", "10.96.0.2"));
    let s = static_dir::load(dir.path(), "h").unwrap().snapshot;
    assert_eq!(s.services.len(), 1);
    assert_eq!(
        s.services[0].spec.as_ref().unwrap().cluster_ip.as_deref(),
        Some("10.96.0.2")
    );
    assert!(s
        .warnings
        .iter()
        .any(|w| w.contains("2.yaml: Service default/x redefined")));
}

#[test]
fn events_are_a_full_relist_per_kind() {
    let dir = TempDir::new("events");
    dir.write("f.yaml", MIXED);
    let s = static_dir::load(dir.path(), "h").unwrap().snapshot;
    let ev = s.events();
    let shape: Vec<String> = ev
        .iter()
        .map(|e| match e {
            SourceEvent::Init(k) => format!("Init({k:?})"),
            SourceEvent::InitDone(k) => format!("InitDone({k:?})"),
            SourceEvent::InitApply(Object::Service(s)) => {
                format!("Svc({})", s.name.name)
            }
            SourceEvent::InitApply(Object::EndpointSlice(s)) => {
                format!("Eps({})", s.name)
            }
            SourceEvent::InitApply(Object::Node(n)) => {
                format!("Node({})", n.metadata.name.as_deref().unwrap())
            }
            other => format!("{other:?}"),
        })
        .collect();
    assert_eq!(
        shape,
        vec![
            "Init(Node)",
            "Node(h)",
            "InitDone(Node)",
            "Init(Service)",
            "Svc(a)",
            "Svc(b)",
            "InitDone(Service)",
            "Init(EndpointSlice)",
            "Eps(b-1)",
            "InitDone(EndpointSlice)",
        ]
    );
}

/// Receives one full relist (until `InitDone(EndpointSlice)`), returning the service names.
/// The timeout only guards against a hang; it asserts nothing about speed.
async fn next_relist(rx: &mut mpsc::Receiver<SourceEvent>) -> Vec<String> {
    let mut names = Vec::new();
    loop {
        let ev = next_event(rx).await;
        match ev {
            SourceEvent::InitApply(Object::Service(s)) => names.push(s.name.name.to_string()),
            SourceEvent::InitDone(Kind::EndpointSlice) => return names,
            _ => {}
        }
    }
}

async fn next_event(rx: &mut mpsc::Receiver<SourceEvent>) -> SourceEvent {
    tokio::time::timeout(Duration::from_secs(30), rx.recv())
        .await
        .expect("no event from the static source within 30 s")
        .expect("source ended")
}

/// `Apply(Service x)` → "apply x", `Delete(Service x)` → "delete x" (slices: "apply-eps x").
fn shape(ev: &SourceEvent) -> String {
    match ev {
        SourceEvent::Apply(Object::Service(s)) => {
            format!("apply {}", s.name.name)
        }
        SourceEvent::Delete(Object::Service(s)) => {
            format!("delete {}", s.name.name)
        }
        SourceEvent::Apply(Object::EndpointSlice(s)) => {
            format!("apply-eps {}", s.name)
        }
        SourceEvent::Delete(Object::EndpointSlice(s)) => {
            format!("delete-eps {}", s.name)
        }
        other => format!("{other:?}"),
    }
}

/// After the initial list, every change is emitted like a watch: `Apply`/`Delete` for exactly
/// the objects it altered (no relist), and a file turning bad withdraws nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn watch_emits_watch_events_and_keeps_last_good_file() {
    let dir = TempDir::new("watch");
    dir.write("a.yaml", &svc("a", "10.96.0.1"));
    let (tx, mut rx) = mpsc::channel(64);
    let source = StaticDirSource::new(dir.path(), "h").with_debounce(Duration::from_millis(50));
    let stats = source.stats();
    let task = tokio::spawn(source.run(tx));

    assert_eq!(next_relist(&mut rx).await, vec!["a"]);
    let parsed = stats.files_parsed();
    assert_eq!(parsed, 1);

    // A new file appears: one Apply, one file parsed.
    dir.write("b.yaml", &svc("b", "10.96.0.2"));
    assert_eq!(shape(&next_event(&mut rx).await), "apply b");
    assert_eq!(stats.files_parsed(), parsed + 1);

    // A change that does not alter the objects (a non-manifest file) emits nothing: the next
    // event seen is the one for the real change after it.
    dir.write("README.txt", "hello");
    tokio::time::sleep(Duration::from_millis(500)).await;
    // A file turning bad keeps its last good objects (a half-saved edit withdraws nothing)...
    dir.write(
        "b.yaml",
        "apiVersion: v1\nkind: Service\nmetadata: {name: b}\nspec: [\n",
    );
    // ...so only this third file changes the objects.
    dir.write("c.yaml", &svc("c", "10.96.0.3"));
    assert_eq!(shape(&next_event(&mut rx).await), "apply c");

    // b becomes valid again with another address: an update of b.
    dir.write("b.yaml", &svc("b", "10.96.0.22"));
    match next_event(&mut rx).await {
        SourceEvent::Apply(Object::Service(s)) => assert_eq!(
            s.spec.as_ref().unwrap().cluster_ip.as_deref(),
            Some("10.96.0.22")
        ),
        other => panic!("expected the update of b, got {other:?}"),
    }

    // Deleting a file withdraws its objects.
    std::fs::remove_file(dir.path().join("a.yaml")).unwrap();
    assert_eq!(shape(&next_event(&mut rx).await), "delete a");
    assert!(rx.try_recv().is_err(), "one change, one event");

    // Dropping the receiver ends the source cleanly.
    drop(rx);
    let res = tokio::time::timeout(Duration::from_secs(30), task)
        .await
        .expect("source did not stop after the receiver was dropped")
        .unwrap();
    assert!(res.is_ok(), "{res:?}");
}

/// A write that completed (the file closed, or renamed into place) is read after a short
/// settle, not the whole debounce; a file still open for writing waits for its close (or the
/// debounce).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn completed_writes_settle_briefly_open_ones_wait() {
    use std::io::Write as _;
    let dir = TempDir::new("settle");
    dir.write("a.yaml", &svc("a", "10.96.0.1"));
    let (tx, mut rx) = mpsc::channel(64);
    let debounce = Duration::from_secs(4);
    let source = StaticDirSource::new(dir.path(), "h").with_debounce(debounce);
    let task = tokio::spawn(source.run(tx));
    assert_eq!(next_relist(&mut rx).await, vec!["a"]);

    // Written and closed (and, by `write`, renamed into place): well before the debounce.
    let t = std::time::Instant::now();
    dir.write("b.yaml", &svc("b", "10.96.0.2"));
    assert_eq!(shape(&next_event(&mut rx).await), "apply b");
    let took = t.elapsed();
    assert!(took < debounce / 2, "a completed write waited {took:?}");

    // Written in place but still open: nothing while the writer holds it...
    let mut f = std::fs::File::create(dir.path().join("c.yaml")).unwrap();
    f.write_all(svc("c", "10.96.0.3").as_bytes()).unwrap();
    f.flush().unwrap();
    let early = tokio::time::timeout(debounce / 2, rx.recv()).await;
    assert!(early.is_err(), "read while still open: {early:?}");
    // ...and soon after it closes.
    let t = std::time::Instant::now();
    drop(f);
    assert_eq!(shape(&next_event(&mut rx).await), "apply c");
    let took = t.elapsed();
    assert!(took < debounce / 2, "the close was followed {took:?} later");
    drop(rx);
    let _ = task.await;
}

/// One changed file among many is the only one parsed (and read) again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_file_change_parses_only_that_file() {
    let dir = TempDir::new("one-file");
    for i in 0..50 {
        dir.write(
            &format!("s{i:02}.yaml"),
            &svc(&format!("s{i}"), &format!("10.96.1.{}", i + 1)),
        );
    }
    let (tx, mut rx) = mpsc::channel(256);
    let source = StaticDirSource::new(dir.path(), "h").with_debounce(Duration::from_millis(50));
    let stats = source.stats();
    let task = tokio::spawn(source.run(tx));
    assert_eq!(next_relist(&mut rx).await.len(), 50);
    let (read, parsed) = (stats.files_read(), stats.files_parsed());
    assert_eq!((read, parsed), (50, 50));
    dir.write("s07.yaml", &svc("s7", "10.96.2.7"));
    assert_eq!(shape(&next_event(&mut rx).await), "apply s7");
    assert_eq!(stats.files_parsed(), parsed + 1);
    assert_eq!(stats.files_read(), read + 1);
    assert_eq!(stats.rescans(), 1, "only the start scanned the directory");
    drop(rx);
    let _ = task.await;
}

/// Without inotify the source polls, with the same watch-like events.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn polling_fallback_emits_the_same_events() {
    let dir = TempDir::new("poll");
    dir.write("a.yaml", &svc("a", "10.96.0.1"));
    let (tx, mut rx) = mpsc::channel(64);
    let source = StaticDirSource::new(dir.path(), "h").with_polling(Duration::from_millis(100));
    let stats = source.stats();
    let task = tokio::spawn(source.run(tx));
    assert_eq!(next_relist(&mut rx).await, vec!["a"]);
    dir.write("b.yaml", &svc("b", "10.96.0.2"));
    assert_eq!(shape(&next_event(&mut rx).await), "apply b");
    std::fs::remove_file(dir.path().join("a.yaml")).unwrap();
    assert_eq!(shape(&next_event(&mut rx).await), "delete a");
    // Unchanged files are not parsed again by the polling rounds.
    assert_eq!(stats.files_parsed(), 2);
    drop(rx);
    let _ = task.await;
}

fn shapes(batch: &static_dir::Batch) -> Vec<String> {
    batch.events.iter().map(shape).collect()
}

/// Per-file diffing on the directory state: added, changed, removed, renamed, moved between
/// files, invalid then valid again.
#[test]
fn per_file_diff_emits_only_what_changed() {
    let dir = TempDir::new("diff");
    let mut state = static_dir::DirState::new(dir.path(), "h");
    let stats = state.stats();
    dir.write("a.yaml", &svc("a", "10.96.0.1"));
    let b = state.scan(false).unwrap();
    // The first batch also announces the (synthesized) Node.
    assert_eq!(shapes(&b).len(), 2, "{:?}", shapes(&b));
    assert_eq!(shapes(&b)[1], "apply a");

    // Added.
    dir.write("b.yaml", &svc("b", "10.96.0.2"));
    assert_eq!(shapes(&state.scan(false).unwrap()), vec!["apply b"]);
    // Unchanged directory: nothing emitted, nothing parsed.
    let parsed = stats.files_parsed();
    assert!(shapes(&state.scan(false).unwrap()).is_empty());
    assert_eq!(stats.files_parsed(), parsed);
    // Changed.
    dir.write("b.yaml", &svc("b", "10.96.0.20"));
    assert_eq!(shapes(&state.scan(false).unwrap()), vec!["apply b"]);
    assert_eq!(stats.files_parsed(), parsed + 1);
    // Renamed: the same objects, nothing emitted.
    std::fs::rename(dir.path().join("b.yaml"), dir.path().join("b2.yaml")).unwrap();
    assert!(shapes(&state.scan(false).unwrap()).is_empty());
    // Moved between files unchanged: nothing; moved and changed: one Apply.
    dir.write("b2.yaml", &svc("a", "10.96.0.1"));
    std::fs::remove_file(dir.path().join("a.yaml")).unwrap();
    // b is gone (b2 now holds a), a is unchanged.
    assert_eq!(shapes(&state.scan(false).unwrap()), vec!["delete b"]);
    dir.write("c.yaml", &svc("a", "10.96.0.9"));
    std::fs::remove_file(dir.path().join("b2.yaml")).unwrap();
    assert_eq!(shapes(&state.scan(false).unwrap()), vec!["apply a"]);
    // Invalid: last good kept, error names the file; valid again: the change is applied.
    dir.write(
        "c.yaml",
        "apiVersion: v1\nkind: Service\nmetadata: {name: a}\nspec:\n  ports:\n  - port: notanumber\n",
    );
    let bad = state.scan(false).unwrap();
    assert!(shapes(&bad).is_empty());
    assert_eq!(bad.errors.len(), 1);
    let msg = bad.errors[0].to_string();
    assert!(
        msg.contains("c.yaml: document 1: Service: spec.ports"),
        "{msg}"
    );
    assert_eq!(state.snapshot().services.len(), 1);
    dir.write("c.yaml", &svc("a", "10.96.0.10"));
    assert_eq!(shapes(&state.scan(false).unwrap()), vec!["apply a"]);
    // Removed.
    std::fs::remove_file(dir.path().join("c.yaml")).unwrap();
    assert_eq!(shapes(&state.scan(false).unwrap()), vec!["delete a"]);
    assert!(state.snapshot().services.is_empty());
}

/// Two files defining the same object: the later file (name order) wins; removing it falls
/// back to the earlier definition (an update, not a delete).
#[test]
fn per_file_diff_duplicates_fall_back_to_the_earlier_file() {
    let dir = TempDir::new("diff-dup");
    let mut state = static_dir::DirState::new(dir.path(), "h");
    dir.write("1.yaml", &svc("x", "10.96.0.1"));
    dir.write("2.yaml", &svc("x", "10.96.0.2"));
    state.scan(false).unwrap();
    let ip = |st: &static_dir::DirState| {
        st.snapshot().services[0]
            .spec
            .as_ref()
            .unwrap()
            .cluster_ip
            .clone()
    };
    assert_eq!(ip(&state).as_deref(), Some("10.96.0.2"));
    std::fs::remove_file(dir.path().join("2.yaml")).unwrap();
    assert_eq!(shapes(&state.scan(false).unwrap()), vec!["apply x"]);
    assert_eq!(ip(&state).as_deref(), Some("10.96.0.1"));
}

/// A large multi-document file (indexed by key, unlike the one-object files, which are
/// scanned): its last definition of a repeated object wins, a change emits only the changed
/// object, and dropping the later definition falls back to the earlier one in the same file.
#[test]
fn large_multi_document_file_last_definition_wins() {
    let dir = TempDir::new("diff-large");
    let mut state = static_dir::DirState::new(dir.path(), "h");
    let docs = |changed: Option<&str>, with_repeat: bool| {
        let mut d: Vec<String> = (0..12)
            .map(|i| {
                let ip = match changed {
                    Some(ip) if i == 7 => ip.to_string(),
                    _ => format!("10.96.1.{i}"),
                };
                svc(&format!("s{i}"), &ip)
            })
            .collect();
        if with_repeat {
            d.push(svc("s3", "10.96.9.3"));
        }
        d.join("---\n")
    };
    let ip_of = |st: &static_dir::DirState, name: &str| {
        st.snapshot()
            .services
            .iter()
            .find(|s| &*s.name.name == name)
            .and_then(|s| s.spec.as_ref())
            .and_then(|s| s.cluster_ip.clone())
    };
    dir.write("all.yaml", &docs(None, true));
    state.scan(false).unwrap();
    assert_eq!(state.snapshot().services.len(), 12);
    assert_eq!(ip_of(&state, "s3").as_deref(), Some("10.96.9.3"));
    dir.write("all.yaml", &docs(Some("10.96.8.7"), true));
    assert_eq!(shapes(&state.scan(false).unwrap()), vec!["apply s7"]);
    assert_eq!(ip_of(&state, "s7").as_deref(), Some("10.96.8.7"));
    dir.write("all.yaml", &docs(Some("10.96.8.7"), false));
    assert_eq!(shapes(&state.scan(false).unwrap()), vec!["apply s3"]);
    assert_eq!(ip_of(&state, "s3").as_deref(), Some("10.96.1.3"));
}

#[tokio::test]
async fn run_fails_on_a_missing_directory() {
    let dir = TempDir::new("missing");
    let (tx, _rx) = mpsc::channel(4);
    let res = StaticDirSource::new(dir.path().join("absent"), "h")
        .run(tx)
        .await;
    assert!(matches!(res, Err(StaticDirError::Watch { .. })), "{res:?}");
}

/// Objects labelled for another service proxy, and headless Services with their slices, are not
/// this proxy's, whichever source reads them: the static source drops them like the Kubernetes
/// source's label selector does (kube-proxy's informers: `!service.kubernetes.io/service-proxy-name`,
/// `!service.kubernetes.io/headless`, cmd/kube-proxy/app/server.go).
#[test]
fn static_source_skips_other_proxies_and_headless_objects_like_the_kube_source() {
    let text = r#"
apiVersion: v1
kind: Service
metadata: {name: mine}
spec: {clusterIP: 10.96.0.1, ports: [{port: 80, protocol: TCP}]}
---
apiVersion: v1
kind: Service
metadata:
  name: theirs
  labels: {service.kubernetes.io/service-proxy-name: other-proxy}
spec: {clusterIP: 10.96.0.2, ports: [{port: 80, protocol: TCP}]}
---
apiVersion: v1
kind: Service
metadata:
  name: headless
  labels: {service.kubernetes.io/headless: ""}
spec: {clusterIP: None, ports: [{port: 80, protocol: TCP}]}
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata:
  name: headless-1
  labels: {kubernetes.io/service-name: headless, service.kubernetes.io/headless: ""}
addressType: IPv4
endpoints: [{addresses: [10.244.0.5], conditions: {ready: true}}]
ports: [{port: 80, protocol: TCP}]
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata:
  name: mine-1
  labels: {kubernetes.io/service-name: mine}
addressType: IPv4
endpoints: [{addresses: [10.244.0.6], conditions: {ready: true}}]
ports: [{port: 80, protocol: TCP}]
"#;
    let objs = static_dir::parse_file(Path::new("proxies.yaml"), text).unwrap();
    let svcs: Vec<_> = objs
        .services
        .iter()
        .map(|s| s.name.name.to_string())
        .collect();
    assert_eq!(svcs, vec!["mine"]);
    let slices: Vec<_> = objs
        .endpoint_slices
        .iter()
        .map(|s| s.name.to_string())
        .collect();
    assert_eq!(slices, vec!["mine-1"]);
    assert!(objs.warnings.is_empty(), "{:?}", objs.warnings);
}

/// The static source's predicate and the Kubernetes source's label selector (evaluated by the
/// fake API server's selector, which follows the API server's rules) agree on every combination
/// of the excluding labels, with any value, beside unrelated labels.
#[test]
fn handled_by_proxy_agrees_with_the_kube_label_selector() {
    use model::event::handled_by_proxy;
    use std::collections::BTreeMap;
    use watch::kube::proxy_label_selector;
    let sel = testkit::apiserver::LabelSelector::parse(&proxy_label_selector()).unwrap();
    let keys = [
        "service.kubernetes.io/service-proxy-name",
        "service.kubernetes.io/headless",
        "app",
    ];
    for mask in 0..(1u8 << keys.len()) {
        for value in ["", "x"] {
            let labels: BTreeMap<String, String> = keys
                .iter()
                .enumerate()
                .filter(|(i, _)| mask & (1 << i) != 0)
                .map(|(_, k)| (k.to_string(), value.to_string()))
                .collect();
            let obj = serde_json::json!({"metadata": {"labels": labels}});
            assert_eq!(
                handled_by_proxy(Some(&labels)),
                sel.matches(&obj),
                "{labels:?}"
            );
        }
    }
    assert!(handled_by_proxy(None));
}

/// The store keeps the very objects the directory source holds (one allocation per Service
/// and EndpointSlice, not a copy each), also after a file changes.
#[test]
fn the_store_shares_the_sources_objects() {
    let dir = TempDir::new("share");
    dir.write("a.yaml", &svc("a", "10.96.0.1"));
    dir.write(
        "a-slice.yaml",
        "apiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata:\n  name: a-1\n  labels:\n    kubernetes.io/service-name: a\naddressType: IPv4\nendpoints:\n- addresses: [10.244.1.2]\n  nodeName: n1\nports:\n- port: 8080\n",
    );
    let mut state = static_dir::DirState::new(dir.path(), "h");
    let mut store = model::store::Store::default();
    for ev in state.scan(false).unwrap().events {
        store.apply(ev);
    }
    let name = model::ServiceName::new("default", "a");
    let shared = |state: &static_dir::DirState, store: &model::store::Store| {
        let snap = state.snapshot();
        let svc = store.service(&name).unwrap();
        let slices = store.slices_of(&name);
        assert_eq!(slices.len(), 1);
        std::ptr::eq(svc, &*snap.services[0]) && std::ptr::eq(slices[0], &*snap.endpoint_slices[0])
    };
    assert!(shared(&state, &store));
    dir.write("a.yaml", &svc("a", "10.96.0.2"));
    for ev in state.scan(false).unwrap().events {
        store.apply(ev);
    }
    assert_eq!(
        store
            .service(&name)
            .unwrap()
            .spec
            .as_ref()
            .unwrap()
            .cluster_ip
            .as_deref(),
        Some("10.96.0.2")
    );
    assert!(shared(&state, &store));
}

/// Objects read from different files of a directory share their namespace, port name and
/// protocol strings, and their endpoints share one placement per node: the directory's workers
/// convert with its interner (no private copies to replace afterwards).
#[test]
fn a_directory_read_shares_strings_across_files() {
    let dir = TempDir::new("shared-strings");
    let svc = |name: &str| {
        format!(
            "apiVersion: v1\nkind: Service\nmetadata:\n  name: {name}\n  namespace: shop\nspec:\n  \
             clusterIP: 10.96.0.1\n  ports:\n  - name: http\n    port: 80\n    protocol: TCP\n"
        )
    };
    let slice = |name: &str| {
        format!(
            "apiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata:\n  name: {name}-1\n  \
             namespace: shop\n  labels:\n    kubernetes.io/service-name: {name}\naddressType: IPv4\n\
             endpoints:\n- addresses: [10.244.1.2]\n  nodeName: node-a\nports:\n- name: http\n  \
             port: 8080\n  protocol: TCP\n"
        )
    };
    for n in ["a", "b"] {
        dir.write(&format!("{n}-svc.yaml"), &svc(n));
        dir.write(&format!("{n}-slice.yaml"), &slice(n));
    }
    let mut state = static_dir::DirState::new(dir.path(), "node-a");
    state.scan(false).unwrap();
    let (mut services, mut slices) = (Vec::new(), Vec::new());
    for e in state.relist() {
        match e {
            SourceEvent::InitApply(Object::Service(s)) => services.push(s),
            SourceEvent::InitApply(Object::EndpointSlice(s)) => slices.push(s),
            _ => {}
        }
    }
    assert_eq!((services.len(), slices.len()), (2, 2));
    let port =
        |s: &model::objects::Svc| s.spec.as_ref().unwrap().ports.as_ref().unwrap()[0].clone();
    let (pa, pb) = (port(&services[0]), port(&services[1]));
    assert!(Arc::ptr_eq(
        &services[0].name.namespace,
        &services[1].name.namespace
    ));
    assert!(Arc::ptr_eq(
        pa.protocol.as_ref().unwrap(),
        pb.protocol.as_ref().unwrap()
    ));
    assert!(Arc::ptr_eq(
        &slices[0].namespace,
        &services[0].name.namespace
    ));
    assert!(Arc::ptr_eq(
        &slices[0].ports[0].name,
        pa.name.as_ref().unwrap()
    ));
    assert!(Arc::ptr_eq(
        slices[0].ports[0].protocol.as_ref().unwrap(),
        slices[1].ports[0].protocol.as_ref().unwrap()
    ));
    assert!(Arc::ptr_eq(
        slices[0].endpoints[0].placement.as_ref().unwrap(),
        slices[1].endpoints[0].placement.as_ref().unwrap()
    ));
}
