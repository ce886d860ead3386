//! The event vocabulary every source speaks: the watched kinds, the compact objects, and
//! [`SourceEvent`].
//!
//! Every source emits the same [`SourceEvent`] stream, modelled on kube-runtime's watcher events,
//! so everything downstream (the store, the model) is identical whichever source feeds it. A
//! relist (after a 410 Gone, a reconnect, or a re-read of the static directory) is
//! `Init(kind)`, then `InitApply` for every object that exists now, then `InitDone(kind)`:
//! objects of that kind not re-announced between `Init` and `InitDone` are gone.

use std::sync::Arc;

use k8s_openapi::api::core::v1::{Node, Service};
use k8s_openapi::api::discovery::v1::EndpointSlice;

use crate::objects::{Slice, Svc};

/// The labels that take a Service or EndpointSlice away from this proxy: one naming another
/// service proxy, and the one the EndpointSlice controller and API put on headless Services and
/// their slices. kube-proxy's informers select `!L` for each (`newServiceInformer`/
/// `NewInformerFactoryWithOptions` with `labelSelector` in cmd/kube-proxy/app/server.go). The
/// Kubernetes source sends them as a label selector (`watch::kube::
/// proxy_label_selector`); the static source applies [`handled_by_proxy`]: one list, two uses.
pub const PROXY_EXCLUDING_LABELS: [&str; 2] = [
    "service.kubernetes.io/service-proxy-name",
    "service.kubernetes.io/headless",
];

/// Whether an object with these labels is handled by this proxy: none of
/// [`PROXY_EXCLUDING_LABELS`] is present (whatever its value, like the `!key` selector).
pub fn handled_by_proxy(labels: Option<&std::collections::BTreeMap<String, String>>) -> bool {
    labels.is_none_or(|l| PROXY_EXCLUDING_LABELS.iter().all(|k| !l.contains_key(*k)))
}

/// The label that excludes an object from this proxy, if any (for messages).
pub fn excluding_label(
    labels: Option<&std::collections::BTreeMap<String, String>>,
) -> Option<&'static str> {
    let l = labels?;
    PROXY_EXCLUDING_LABELS
        .iter()
        .copied()
        .find(|k| l.contains_key(*k))
}

/// The kinds of object the proxy watches.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Kind {
    /// `v1/Service`.
    Service,
    /// `discovery.k8s.io/v1/EndpointSlice`.
    EndpointSlice,
    /// `v1/Node` (only this node's object).
    Node,
}

/// One watched object, in the compact form the proxy keeps ([`crate::objects`]): sources
/// convert API objects as they arrive, so no full `k8s-openapi` object outlives its event.
/// Services and EndpointSlices are shared (`Arc`): a source that keeps its objects (the
/// static directory) hands the store the same allocation instead of a copy.
#[derive(Debug, Clone, PartialEq)]
pub enum Object {
    /// A Service.
    Service(Arc<Svc>),
    /// An EndpointSlice.
    EndpointSlice(Arc<Slice>),
    /// This node's Node object (one object; kept whole).
    Node(Box<Node>),
}

impl From<&Service> for Object {
    fn from(s: &Service) -> Object {
        Object::Service(Arc::new(Svc::from_service(s)))
    }
}

impl From<Service> for Object {
    fn from(s: Service) -> Object {
        Object::from(&s)
    }
}

impl From<&EndpointSlice> for Object {
    fn from(s: &EndpointSlice) -> Object {
        Object::EndpointSlice(Arc::new(Slice::of(s)))
    }
}

impl From<EndpointSlice> for Object {
    fn from(s: EndpointSlice) -> Object {
        Object::from(&s)
    }
}

impl From<Node> for Object {
    fn from(n: Node) -> Object {
        Object::Node(Box::new(n))
    }
}

/// A change reported by a source.
#[derive(Debug, Clone, PartialEq)]
pub enum SourceEvent {
    /// A (re)list of `Kind` starts.
    Init(Kind),
    /// An object that exists as of the current (re)list.
    InitApply(Object),
    /// The (re)list of `Kind` is complete; unannounced objects of that kind are deleted.
    InitDone(Kind),
    /// An object was added or modified.
    Apply(Object),
    /// An object was deleted.
    Delete(Object),
}
