//! A fake Kubernetes API server with faithful list/watch semantics.
//!
//! Serves Services, EndpointSlices (`discovery.k8s.io/v1`) and Nodes over plain HTTP on
//! 127.0.0.1 with the real server's list/watch contract: a global resourceVersion, consistent
//! paginated lists (`limit`/`continue`), `?watch=1` chunked JSON events (ADDED, MODIFIED, DELETED,
//! BOOKMARK, ERROR), `allowWatchBookmarks`, `sendInitialEvents`, label and field selectors,
//! `timeoutSeconds`, and 410 Gone (`Status` reason `Expired`) for compacted resourceVersions.
//! Tests drive it in-process ([`FakeApiServer::create`] and friends) or over REST
//! (POST/PUT/PATCH/DELETE), and inject faults: [`FakeApiServer::drop_watches`],
//! [`FakeApiServer::compact`], [`FakeApiServer::pause`]. kube-rs talks to it unchanged through
//! the kubeconfig from [`FakeApiServer::write_kubeconfig`].

mod http;
pub mod raw;
mod selector;
mod store;

pub use selector::{FieldSelector, LabelSelector, SelectorError};
pub use store::{RequestRecord, Resource, StatusError};

use axum::Router;
use hyper_util::rt::TokioIo;
use hyper_util::service::TowerToHyperService;
use k8s_openapi::api::core::v1::{Node, Service};
use k8s_openapi::api::discovery::v1::EndpointSlice;
use serde::de::DeserializeOwned;
use serde::Serialize;
use serde_json::Value;
use std::net::SocketAddr;
use std::path::Path;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;
use store::Store;
use tokio::task::{JoinHandle, JoinSet};

/// Errors of the fake API server.
#[derive(Debug, thiserror::Error)]
pub enum ApiServerError {
    /// Binding or re-binding the listening socket failed.
    #[error("binding {addr}: {source}")]
    Bind {
        /// The address.
        addr: SocketAddr,
        /// The cause.
        source: std::io::Error,
    },
    /// The server refused a request, with the Status it would send.
    #[error("{0}")]
    Status(StatusError),
    /// An object could not be converted to or from JSON.
    #[error("object (de)serialisation: {0}")]
    Json(#[from] serde_json::Error),
    /// Writing the kubeconfig or reading fixtures failed.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: String,
        /// The cause.
        source: std::io::Error,
    },
    /// A fixture file is not valid YAML/JSON or not a served kind.
    #[error("fixture {path}: {source}")]
    Fixture {
        /// The file.
        path: String,
        /// What is wrong ([`ApiServerError::Parse`], [`ApiServerError::UnsupportedKind`] or
        /// the [`ApiServerError::Status`] the store refused an object with).
        #[source]
        source: Box<ApiServerError>,
    },
    /// A text of objects is not valid YAML or JSON.
    #[error("{0}")]
    Parse(#[source] serde_saphyr::Error),
    /// An object's kind is not one the server serves.
    #[error("unsupported kind {0:?}")]
    UnsupportedKind(String),
    /// No tokio runtime is running (the server needs one).
    #[error("no tokio runtime: {0}")]
    NoRuntime(#[from] tokio::runtime::TryCurrentError),
}

impl From<StatusError> for ApiServerError {
    fn from(e: StatusError) -> Self {
        Self::Status(e)
    }
}

/// A typed object the fake server stores.
pub trait FakeObject: Serialize + DeserializeOwned + Clone {
    /// Which resource it is.
    const RESOURCE: Resource;
}

impl FakeObject for Service {
    const RESOURCE: Resource = Resource::Services;
}
impl FakeObject for EndpointSlice {
    const RESOURCE: Resource = Resource::EndpointSlices;
}
impl FakeObject for Node {
    const RESOURCE: Resource = Resource::Nodes;
}

/// State shared between the handle and the HTTP handlers.
#[derive(Debug, Default)]
pub(crate) struct Shared {
    store: Mutex<Store>,
}

impl Shared {
    /// Lock the store (a poisoned lock is still usable: the store has no invariants a panic
    /// mid-write could break that matter to tests).
    pub(crate) fn lock(&self) -> MutexGuard<'_, Store> {
        self.store.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// A running fake API server. Dropping it stops it.
#[derive(Debug)]
pub struct FakeApiServer {
    shared: Arc<Shared>,
    addr: SocketAddr,
    runtime: tokio::runtime::Handle,
    accept: Mutex<Option<JoinHandle<()>>>,
    /// While paused: a socket bound to the address but not listening. Connections are refused
    /// as when nothing is there, and the port stays this server's: without it a server another
    /// test starts meanwhile could be given the freed port, and this server's clients would
    /// reach that one (a flake seen in `an_outage_never_reads_as_recovered_between_retries`).
    reserved: Mutex<Option<tokio::net::TcpSocket>>,
    bookmarks: Mutex<Option<JoinHandle<()>>>,
}

async fn accept_loop(listener: tokio::net::TcpListener, router: Router) {
    let mut conns = JoinSet::new();
    loop {
        tokio::select! {
            accepted = listener.accept() => {
                let Ok((stream, _)) = accepted else { continue };
                let svc = TowerToHyperService::new(router.clone());
                conns.spawn(async move {
                    let _ = hyper::server::conn::http1::Builder::new()
                        .serve_connection(TokioIo::new(stream), svc)
                        .await;
                });
            }
            Some(_) = conns.join_next(), if !conns.is_empty() => {}
        }
    }
}

/// A socket bound to `addr` without listening (see `FakeApiServer::reserved`); `None` if the
/// address cannot be bound again (the pause then only refuses connections, as before).
fn reserve(addr: SocketAddr) -> Option<tokio::net::TcpSocket> {
    let socket = match addr {
        SocketAddr::V4(_) => tokio::net::TcpSocket::new_v4(),
        SocketAddr::V6(_) => tokio::net::TcpSocket::new_v6(),
    }
    .ok()?;
    // The closed connections' TIME_WAIT entries must not stop the bind.
    socket.set_reuseaddr(true).ok()?;
    socket.bind(addr).ok()?;
    Some(socket)
}

impl FakeApiServer {
    /// Start on 127.0.0.1 with an ephemeral port, inside the current tokio runtime.
    pub async fn start() -> Result<Self, ApiServerError> {
        Self::start_on(SocketAddr::from(([127, 0, 0, 1], 0))).await
    }

    /// Start on a given address (port 0 picks one).
    pub async fn start_on(addr: SocketAddr) -> Result<Self, ApiServerError> {
        let runtime = tokio::runtime::Handle::try_current()?;
        let listener = std::net::TcpListener::bind(addr)
            .map_err(|source| ApiServerError::Bind { addr, source })?;
        let addr = listener
            .local_addr()
            .map_err(|source| ApiServerError::Bind { addr, source })?;
        let server = Self {
            shared: Arc::new(Shared::default()),
            addr,
            runtime,
            accept: Mutex::new(None),
            reserved: Mutex::new(None),
            bookmarks: Mutex::new(None),
        };
        server.serve(listener)?;
        server.set_bookmark_interval(Some(Duration::from_secs(1)));
        Ok(server)
    }

    fn serve(&self, listener: std::net::TcpListener) -> Result<(), ApiServerError> {
        let addr = self.addr;
        listener
            .set_nonblocking(true)
            .map_err(|source| ApiServerError::Bind { addr, source })?;
        let _guard = self.runtime.enter();
        let listener = tokio::net::TcpListener::from_std(listener)
            .map_err(|source| ApiServerError::Bind { addr, source })?;
        let router = Router::new()
            .fallback(http::handle)
            .with_state(self.shared.clone());
        let task = self.runtime.spawn(accept_loop(listener, router));
        if let Some(old) = lock(&self.accept).replace(task) {
            old.abort();
        }
        Ok(())
    }

    /// The listening address.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// `http://127.0.0.1:PORT`.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// A kubeconfig (YAML) pointing at this server, no authentication.
    pub fn kubeconfig(&self) -> String {
        kubeconfig_for(&self.url())
    }

    /// Write [`Self::kubeconfig`] to `path`.
    pub fn write_kubeconfig(&self, path: impl AsRef<Path>) -> Result<(), ApiServerError> {
        let path = path.as_ref();
        std::fs::write(path, self.kubeconfig()).map_err(|source| ApiServerError::Io {
            path: path.display().to_string(),
            source,
        })
    }

    /// Send BOOKMARK events to watches that allow them every `interval` (None: never; the real
    /// server sends one about every minute). Default: every second.
    pub fn set_bookmark_interval(&self, interval: Option<Duration>) {
        let task = interval.map(|every| {
            let shared = self.shared.clone();
            self.runtime.spawn(async move {
                let mut tick = tokio::time::interval(every);
                tick.tick().await;
                loop {
                    tick.tick().await;
                    shared.lock().send_bookmarks();
                }
            })
        });
        if let Some(old) = std::mem::replace(&mut *lock(&self.bookmarks), task) {
            old.abort();
        }
    }

    /// Send a BOOKMARK at the current resourceVersion to every watch that allows them, now.
    pub fn send_bookmarks(&self) {
        self.shared.lock().send_bookmarks();
    }

    /// The current (latest) resourceVersion.
    pub fn resource_version(&self) -> u64 {
        self.shared.lock().resource_version()
    }

    /// The oldest resourceVersion a watch may resume from without 410 Gone.
    pub fn compacted_resource_version(&self) -> u64 {
        self.shared.lock().compacted()
    }

    /// Create an object (uid, creationTimestamp, resourceVersion set); returns what was stored.
    pub fn create<K: FakeObject>(&self, obj: &K) -> Result<K, ApiServerError> {
        let v = serde_json::to_value(obj)?;
        let stored = self.shared.lock().create(K::RESOURCE, v)?;
        Ok(serde_json::from_value(stored)?)
    }

    /// Replace an object. A set, stale `metadata.resourceVersion` is a 409 Conflict; an unset
    /// one replaces unconditionally. A no-op replace keeps the resourceVersion and sends no event.
    pub fn update<K: FakeObject>(&self, obj: &K) -> Result<K, ApiServerError> {
        let v = serde_json::to_value(obj)?;
        let stored = self.shared.lock().update(K::RESOURCE, v)?;
        Ok(serde_json::from_value(stored)?)
    }

    /// Create, or replace unconditionally if it exists.
    pub fn apply<K: FakeObject>(&self, obj: &K) -> Result<K, ApiServerError> {
        let mut v = serde_json::to_value(obj)?;
        if let Some(m) = v.get_mut("metadata").and_then(Value::as_object_mut) {
            m.remove("resourceVersion");
        }
        let mut store = self.shared.lock();
        let key = key_of(K::RESOURCE, &v);
        let stored = if store.get(&key).is_some() {
            store.update(K::RESOURCE, v)?
        } else {
            store.create(K::RESOURCE, v)?
        };
        Ok(serde_json::from_value(stored)?)
    }

    /// Delete an object (`namespace` is ignored for Nodes). With finalizers it only gets a
    /// deletionTimestamp; it goes away when an update clears them. Returns the last state.
    pub fn delete<K: FakeObject>(&self, namespace: &str, name: &str) -> Result<K, ApiServerError> {
        let ns = if K::RESOURCE.namespaced() {
            namespace
        } else {
            ""
        };
        let last = self
            .shared
            .lock()
            .delete((K::RESOURCE, ns.to_string(), name.to_string()))?;
        Ok(serde_json::from_value(last)?)
    }

    /// Get an object.
    pub fn get<K: FakeObject>(&self, namespace: &str, name: &str) -> Option<K> {
        let ns = if K::RESOURCE.namespaced() {
            namespace
        } else {
            ""
        };
        let store = self.shared.lock();
        let v = store.get(&(K::RESOURCE, ns.to_string(), name.to_string()))?;
        serde_json::from_value(v.clone()).ok()
    }

    /// All objects of a kind, in key order.
    pub fn list<K: FakeObject>(&self) -> Vec<K> {
        let store = self.shared.lock();
        store
            .list(
                K::RESOURCE,
                &store::Filter::default(),
                None,
                None,
                None,
                false,
            )
            .map(|p| {
                p.items
                    .into_iter()
                    .filter_map(|v| serde_json::from_value(v).ok())
                    .collect()
            })
            .unwrap_or_default()
    }

    /// Abruptly drop every open watch connection (no terminating chunk). Returns how many.
    pub fn drop_watches(&self) -> usize {
        self.shared.lock().drop_watches()
    }

    /// End every open watch stream cleanly, as when `timeoutSeconds` expires. Returns how many.
    pub fn close_watches(&self) -> usize {
        self.shared.lock().close_watches()
    }

    /// Send every open watch a 410 Expired ERROR event and end it. Returns how many.
    pub fn expire_watches(&self) -> usize {
        self.shared.lock().expire_watches()
    }

    /// Forget all history up to now: watches resuming from an older resourceVersion get a 410
    /// ERROR event, continue tokens from older lists get 410 Gone.
    pub fn compact(&self) {
        self.shared.lock().compact();
    }

    /// Keep at most `n` changes of history (like the watch cache's capacity); older ones are
    /// compacted away.
    pub fn set_history_limit(&self, n: usize) {
        self.shared.lock().set_history_limit(n);
    }

    /// Simulate a restored/restarted control plane: the resourceVersion jumps ahead by `jump`,
    /// all history is forgotten and every watch is dropped, so clients must relist (410 Gone).
    pub fn reset_history(&self, jump: u64) {
        let mut store = self.shared.lock();
        store.reset_history(jump);
        store.drop_watches();
    }

    /// Simulate the server going away: close the listening socket (new connections are refused)
    /// and drop every open connection. Objects can still be changed in-process meanwhile.
    /// Returns once the socket is closed.
    pub async fn pause(&self) {
        let task = lock(&self.accept).take();
        self.shared.lock().close_watches();
        if let Some(task) = task {
            task.abort();
            // The listener (and every connection) is dropped when the aborted task finishes.
            let _ = task.await;
        }
        *lock(&self.reserved) = reserve(self.addr);
    }

    /// Whether the server is paused.
    pub fn is_paused(&self) -> bool {
        lock(&self.accept).is_none()
    }

    /// Listen again on the same address after [`Self::pause`].
    pub fn resume(&self) -> Result<(), ApiServerError> {
        if !self.is_paused() {
            return Ok(());
        }
        drop(lock(&self.reserved).take());
        let listener =
            std::net::TcpListener::bind(self.addr).map_err(|source| ApiServerError::Bind {
                addr: self.addr,
                source,
            })?;
        self.serve(listener)
    }

    /// Number of watch streams open now.
    pub fn open_watches(&self) -> usize {
        self.shared.lock().open_watches()
    }

    /// Every request served so far.
    pub fn requests(&self) -> Vec<RequestRecord> {
        self.shared.lock().requests.clone()
    }

    /// How many requests match a predicate.
    pub fn count_requests(&self, pred: impl Fn(&RequestRecord) -> bool) -> usize {
        self.shared
            .lock()
            .requests
            .iter()
            .filter(|r| pred(r))
            .count()
    }

    /// Events (core/v1 and events.k8s.io/v1) posted to the server, latest state of each.
    pub fn events(&self) -> Vec<Value> {
        self.shared.lock().events.clone()
    }

    /// Load every `*.yaml`/`*.yml`/`*.json` file in `dir` (multi-document YAML allowed, and
    /// `List` objects) and create the Services, EndpointSlices and Nodes in it. Returns how many.
    pub fn load_dir(&self, dir: impl AsRef<Path>) -> Result<usize, ApiServerError> {
        let dir = dir.as_ref();
        let io = |source| ApiServerError::Io {
            path: dir.display().to_string(),
            source,
        };
        let mut files: Vec<_> = std::fs::read_dir(dir)
            .map_err(io)?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| {
                p.extension()
                    .and_then(|e| e.to_str())
                    .is_some_and(|e| matches!(e, "yaml" | "yml" | "json"))
            })
            .collect();
        files.sort();
        let mut n = 0;
        for path in files {
            let text = std::fs::read_to_string(&path).map_err(|source| ApiServerError::Io {
                path: path.display().to_string(),
                source,
            })?;
            n += self.load_str(&text).map_err(|e| ApiServerError::Fixture {
                path: path.display().to_string(),
                source: Box::new(e),
            })?;
        }
        Ok(n)
    }

    /// Create every object in a YAML (multi-document) or JSON text. Returns how many.
    pub fn load_str(&self, text: &str) -> Result<usize, ApiServerError> {
        let docs: Vec<Value> = serde_saphyr::from_multiple(text).map_err(ApiServerError::Parse)?;
        let mut n = 0;
        for doc in docs {
            let items = match doc.get("items").and_then(Value::as_array) {
                Some(items)
                    if doc
                        .get("kind")
                        .and_then(Value::as_str)
                        .is_some_and(|k| k.ends_with("List")) =>
                {
                    items.clone()
                }
                _ => vec![doc],
            };
            for item in items {
                if item.is_null() {
                    continue;
                }
                let kind = item.get("kind").and_then(Value::as_str).unwrap_or_default();
                let res = Resource::ALL
                    .into_iter()
                    .find(|r| r.kind() == kind)
                    .ok_or_else(|| ApiServerError::UnsupportedKind(kind.to_string()))?;
                let mut store = self.shared.lock();
                let key = key_of(res, &item);
                if store.get(&key).is_some() {
                    store.update(res, item)?;
                } else {
                    store.create(res, item)?;
                }
                n += 1;
            }
        }
        Ok(n)
    }
}

impl Drop for FakeApiServer {
    fn drop(&mut self) {
        if let Some(t) = lock(&self.accept).take() {
            t.abort();
        }
        if let Some(t) = lock(&self.bookmarks).take() {
            t.abort();
        }
        self.shared.lock().close_watches();
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

fn key_of(res: Resource, v: &Value) -> store::Key {
    let name = v
        .pointer("/metadata/name")
        .and_then(Value::as_str)
        .unwrap_or_default()
        .to_string();
    let ns = if res.namespaced() {
        v.pointer("/metadata/namespace")
            .and_then(Value::as_str)
            .filter(|s| !s.is_empty())
            .unwrap_or("default")
            .to_string()
    } else {
        String::new()
    };
    (res, ns, name)
}

/// A kubeconfig for an unauthenticated plain-HTTP server at `url`.
pub fn kubeconfig_for(url: &str) -> String {
    format!(
        "apiVersion: v1
kind: Config
clusters:
- name: fake
  cluster:
    server: {url}
contexts:
- name: fake
  context:
    cluster: fake
    user: fake
    namespace: default
current-context: fake
users:
- name: fake
  user: {{}}
"
    )
}
