//! The Kubernetes source: kube-runtime watchers for Services, EndpointSlices and this Node.
//!
//! Three watchers run side by side: Services and EndpointSlices with the proxy label selector
//! ([`proxy_label_selector`], like kube-proxy's informers), and this node's Node object by
//! `metadata.name`. Services are decoded one by one ([`crate::lenient`]): one the proxy cannot
//! decode is rejected alone instead of failing every list. Their events become [`SourceEvent`]s: a (re)list is `Init`, `InitApply`…,
//! `InitDone`; live changes are `Apply`/`Delete`. Every watcher error (410 Gone, a dropped
//! connection, the API server being away) is recoverable: it is logged, counted in
//! [`SourceHealth`], and the watcher retries with kube-runtime's default exponential backoff
//! (0.8 s doubling to 30 s), relisting when its resourceVersion is too old. The source never stops
//! on its own; it returns only when the event receiver is dropped.
//!
//! Consumers must not program anything until [`SourceHealth::synced`] (both Services and
//! EndpointSlices listed once); the `InitDone` events carry the same information in-band.

use crate::lenient::WatchedService;
use futures::stream::{BoxStream, SelectAll};
use futures::StreamExt;
use k8s_openapi::api::core::v1::{Node, Service};
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kube::runtime::{watcher, WatchStreamExt};
use kube::{Api, Client, Resource};
use model::event::{Kind, Object, SourceEvent};
use serde::de::DeserializeOwned;
use std::fmt::Debug;
use std::time::Instant;
use tokio::sync::{mpsc, watch};

/// The label selector kube-proxy uses for Services and EndpointSlices: skip objects owned by
/// another proxy and headless services (`!key` for each of
/// [`model::event::PROXY_EXCLUDING_LABELS`], which the static source applies too).
pub fn proxy_label_selector() -> String {
    model::event::PROXY_EXCLUDING_LABELS
        .iter()
        .map(|k| format!("!{k}"))
        .collect::<Vec<_>>()
        .join(",")
}

/// The annotation kubectl stores a full copy of the object in; dropped to save memory.
const LAST_APPLIED: &str = "kubectl.kubernetes.io/last-applied-configuration";

/// How the Kubernetes source watches.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KubeSourceConfig {
    /// This node's name (the Node watch selects `metadata.name=<node_name>`).
    pub node_name: String,
    /// Page size of the initial lists (`limit`; kube-runtime's default 500). None: unpaginated.
    pub page_size: Option<u32>,
    /// Use a streaming list (`sendInitialEvents=true`) instead of list+watch.
    pub streaming_list: bool,
    /// Server-side watch timeout in seconds (kube's default 290).
    pub watch_timeout_secs: Option<u32>,
}

impl KubeSourceConfig {
    /// Defaults for `node_name`: paginated list+watch with 500 items per page.
    pub fn new(node_name: impl Into<String>) -> Self {
        Self {
            node_name: node_name.into(),
            page_size: Some(500),
            streaming_list: false,
            watch_timeout_secs: None,
        }
    }

    fn watcher_config(&self) -> watcher::Config {
        let mut c = watcher::Config {
            page_size: self.page_size,
            ..watcher::Config::default()
        };
        if self.streaming_list {
            c = c.streaming_lists();
        }
        if let Some(t) = self.watch_timeout_secs {
            c = c.timeout(t);
        }
        c
    }
}

/// Health of one watched kind.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct KindHealth {
    /// A full list completed at least once (`InitDone` seen).
    pub synced: bool,
    /// How many (re)lists completed.
    pub lists: u64,
    /// When the last event of any sort (list item, change, list end) arrived.
    pub last_event: Option<Instant>,
    /// When the last (re)list completed.
    pub last_sync: Option<Instant>,
    /// When the last error happened, and what it was.
    pub last_error: Option<(Instant, String)>,
    /// Errors since the last event that came from the API server (0 when the watch is healthy;
    /// the `Init` that starts each retry does not count: it is sent before any request).
    pub consecutive_errors: u64,
    /// All errors since start.
    pub errors: u64,
}

impl KindHealth {
    /// Synced and no error since the last successful event.
    ///
    /// A quiet, healthy watch produces no events (bookmarks and reconnects are invisible), so
    /// staleness is judged by errors, not by the age of `last_event`.
    pub fn healthy(&self) -> bool {
        self.synced && self.consecutive_errors == 0
    }
}

/// Health of the Kubernetes source, published on a `tokio::sync::watch` channel.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SourceHealth {
    /// Services.
    pub services: KindHealth,
    /// EndpointSlices.
    pub endpoint_slices: KindHealth,
    /// This node's Node object.
    pub node: KindHealth,
}

impl SourceHealth {
    /// The health of one kind.
    pub fn kind(&self, kind: Kind) -> &KindHealth {
        match kind {
            Kind::Service => &self.services,
            Kind::EndpointSlice => &self.endpoint_slices,
            Kind::Node => &self.node,
        }
    }

    fn kind_mut(&mut self, kind: Kind) -> &mut KindHealth {
        match kind {
            Kind::Service => &mut self.services,
            Kind::EndpointSlice => &mut self.endpoint_slices,
            Kind::Node => &mut self.node,
        }
    }

    /// Services and EndpointSlices have both been listed once: programming may start.
    pub fn synced(&self) -> bool {
        self.services.synced && self.endpoint_slices.synced
    }

    /// Every kind is synced and currently error-free.
    pub fn healthy(&self) -> bool {
        self.services.healthy() && self.endpoint_slices.healthy() && self.node.healthy()
    }
}

/// Drop what the proxy never reads and that can be large.
fn slim<K: Resource>(mut obj: K) -> K {
    obj.meta_mut().managed_fields = None;
    if let Some(a) = obj.meta_mut().annotations.as_mut() {
        a.remove(LAST_APPLIED);
        if a.is_empty() {
            obj.meta_mut().annotations = None;
        }
    }
    obj
}

/// The object of a watched Service: an undecodable one is logged and becomes an invalid
/// Service with what could be read of it (its name, its spec when that decoded).
pub fn service_object(w: WatchedService) -> Object {
    match w.0 {
        Ok(s) => Object::from(s),
        Err(u) => {
            tracing::warn!(
                service = %format!(
                    "{}/{}",
                    u.meta.namespace.as_deref().unwrap_or_default(),
                    u.meta.name.as_deref().unwrap_or_default()
                ),
                error = %u.error,
                "a Service cannot be decoded: it is rejected as invalid and keeps its last good state"
            );
            let u = *u;
            let readable = Service {
                metadata: u.meta,
                spec: u.spec,
                status: None,
            };
            Object::Service(std::sync::Arc::new(model::objects::Svc::undecodable(
                &readable, &u.error,
            )))
        }
    }
}

/// Map a kube-runtime watcher event to a [`SourceEvent`].
pub fn to_source_event<K: Resource>(
    kind: Kind,
    wrap: fn(K) -> Object,
    event: watcher::Event<K>,
) -> SourceEvent {
    match event {
        watcher::Event::Init => SourceEvent::Init(kind),
        watcher::Event::InitApply(o) => SourceEvent::InitApply(wrap(slim(o))),
        watcher::Event::InitDone => SourceEvent::InitDone(kind),
        watcher::Event::Apply(o) => SourceEvent::Apply(wrap(slim(o))),
        watcher::Event::Delete(o) => SourceEvent::Delete(wrap(slim(o))),
    }
}

type Item = (Kind, Result<SourceEvent, watcher::Error>);

fn kind_stream<K>(
    api: Api<K>,
    config: watcher::Config,
    kind: Kind,
    wrap: fn(K) -> Object,
) -> BoxStream<'static, Item>
where
    K: Resource + Clone + DeserializeOwned + Debug + Send + 'static,
{
    watcher(api, config)
        .default_backoff()
        .map(move |r| (kind, r.map(|ev| to_source_event(kind, wrap, ev))))
        .boxed()
}

/// Run the Kubernetes source with default settings for `node_name`. See [`run_with`].
pub async fn run(
    client: Client,
    node_name: String,
    tx: mpsc::Sender<SourceEvent>,
    health: watch::Sender<SourceHealth>,
) {
    run_with(client, KubeSourceConfig::new(node_name), tx, health).await;
}

/// Run the three watchers and forward their events to `tx` until `tx`'s receiver is dropped.
/// Errors never end it: they are logged, counted in `health`, and retried with backoff.
pub async fn run_with(
    client: Client,
    config: KubeSourceConfig,
    tx: mpsc::Sender<SourceEvent>,
    health: watch::Sender<SourceHealth>,
) {
    let base = config.watcher_config();
    let selected = base.clone().labels(&proxy_label_selector());
    let node = base.fields(&format!("metadata.name={}", config.node_name));
    let mut streams: SelectAll<BoxStream<'static, Item>> = SelectAll::new();
    // Services one by one: one the proxy cannot decode is rejected alone (see `lenient`).
    streams.push(kind_stream(
        Api::<WatchedService>::all(client.clone()),
        selected.clone(),
        Kind::Service,
        service_object,
    ));
    streams.push(kind_stream(
        Api::<EndpointSlice>::all(client.clone()),
        selected,
        Kind::EndpointSlice,
        Object::from,
    ));
    streams.push(kind_stream(
        Api::<Node>::all(client),
        node,
        Kind::Node,
        Object::from,
    ));

    loop {
        let next = tokio::select! {
            () = tx.closed() => return,
            next = streams.next() => next,
        };
        // The watchers are endless; if the set ever ends there is nothing left to do.
        let Some((kind, result)) = next else { return };
        let now = Instant::now();
        match result {
            // kube-runtime emits `Init` when it is about to list, before any request: after an
            // error it starts every retry with one. It proves nothing about the API server, so
            // it must not end a failure (an outage read as recovered at every retry).
            Ok(event @ SourceEvent::Init(_)) => {
                if tx.send(event).await.is_err() {
                    return;
                }
            }
            Ok(event) => {
                let done = matches!(event, SourceEvent::InitDone(_));
                health.send_if_modified(|h| {
                    let k = h.kind_mut(kind);
                    let was = (k.synced, k.consecutive_errors);
                    k.last_event = Some(now);
                    k.consecutive_errors = 0;
                    if done {
                        k.synced = true;
                        k.lists += 1;
                        k.last_sync = Some(now);
                    }
                    // Only notify on state changes, not on every event's timestamp.
                    done || was != (k.synced, k.consecutive_errors)
                });
                if done {
                    tracing::info!(?kind, "watch list complete");
                }
                if tx.send(event).await.is_err() {
                    return;
                }
            }
            Err(err) => {
                tracing::warn!(?kind, error = %err, "watch error; retrying with backoff");
                health.send_modify(|h| {
                    let k = h.kind_mut(kind);
                    k.errors += 1;
                    k.consecutive_errors += 1;
                    k.last_error = Some((now, err.to_string()));
                });
            }
        }
    }
}
