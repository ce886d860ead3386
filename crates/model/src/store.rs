//! The store: the current Services, EndpointSlices (grouped by service) and this node's Node,
//! fed by [`SourceEvent`]s. Pure.
//!
//! Every event returns a [`Changes`]: the services whose desired state may have changed
//! ("dirty": the Service changed, or one of its slices did) and whether the node's zone or
//! addresses changed. An object re-announced unchanged (a relist, a resync) dirties nothing.
//! Relists follow [`crate::event`]'s contract: between `Init(kind)` and `InitDone(kind)`
//! every existing object is re-announced; those that are not are deleted at `InitDone`.

use std::collections::{BTreeSet, HashMap, HashSet};
use std::sync::Arc;

use k8s_openapi::api::core::v1::Node;

use crate::event::{Kind, Object, SourceEvent};
use crate::objects::{Interner, Slice, Svc};
use crate::sorted::SortedVec;
use crate::{ServiceName, ZONE_LABEL};

/// Namespace/name of a stored object.
type ObjKey = (Arc<str>, Arc<str>);

fn slice_key(s: &Slice) -> ObjKey {
    (s.namespace.clone(), s.name.clone())
}

/// What one event changed.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Changes {
    /// Services to re-derive.
    pub dirty: BTreeSet<ServiceName>,
    /// Of `dirty`: those whose Service object changed (kube-proxy's "service changes").
    pub services: BTreeSet<ServiceName>,
    /// Of `dirty`: those one of whose EndpointSlices changed (kube-proxy's "endpoint changes").
    pub endpoints: BTreeSet<ServiceName>,
    /// The node's zone label or addresses changed.
    pub node_changed: bool,
}

impl Changes {
    /// True when nothing changed.
    pub fn is_empty(&self) -> bool {
        self.dirty.is_empty() && !self.node_changed
    }

    /// Adds another event's changes.
    pub fn merge(&mut self, other: Changes) {
        self.dirty.extend(other.dirty);
        self.services.extend(other.services);
        self.endpoints.extend(other.endpoints);
        self.node_changed |= other.node_changed;
    }
}

/// Current objects, as the sources report them.
#[derive(Debug, Default, Clone)]
pub struct Store {
    // Behind a pointer: a hash table keeps about a third of its slots empty, and an empty
    // slot then costs a pointer instead of a whole object. Shared: the static source keeps
    // the same objects.
    services: HashMap<ServiceName, Arc<Svc>>,
    slices: HashMap<ObjKey, Arc<Slice>>,
    /// Node and zone names of the slices' endpoints.
    names: Interner,
    by_service: HashMap<ServiceName, SortedVec<ObjKey>>,
    node: Option<Node>,
    relisting: HashMap<Kind, HashSet<ObjKey>>,
    synced: HashSet<Kind>,
}

/// The node facts that matter to the model: zone label and status addresses.
fn node_facts(n: Option<&Node>) -> (Option<String>, Vec<(String, String)>) {
    let zone = n
        .and_then(|n| n.metadata.labels.as_ref())
        .and_then(|l| l.get(ZONE_LABEL))
        .cloned();
    let addrs = n
        .and_then(|n| n.status.as_ref())
        .and_then(|s| s.addresses.as_ref())
        .map(|v| {
            v.iter()
                .map(|a| (a.type_.clone(), a.address.clone()))
                .collect()
        })
        .unwrap_or_default();
    (zone, addrs)
}

impl Store {
    /// An empty store.
    pub fn new() -> Store {
        Store::default()
    }

    /// True once Services and EndpointSlices have each completed a first list: nothing may be
    /// programmed before.
    pub fn synced(&self) -> bool {
        self.synced.contains(&Kind::Service) && self.synced.contains(&Kind::EndpointSlice)
    }

    /// True once `kind` has completed a first list.
    pub fn kind_synced(&self, kind: Kind) -> bool {
        self.synced.contains(&kind)
    }

    /// A Service by name.
    pub fn service(&self, name: &ServiceName) -> Option<&Svc> {
        self.services.get(name).map(|s| &**s)
    }

    /// All service names.
    pub fn service_names(&self) -> impl Iterator<Item = &ServiceName> {
        self.services.keys()
    }

    /// Number of Services.
    pub fn service_count(&self) -> usize {
        self.services.len()
    }

    /// Distinct strings held by the interner: node and zone names, namespaces and the other
    /// interned values (bounded by those in use).
    pub fn interned_names(&self) -> usize {
        self.names.len()
    }

    /// Distinct endpoint placements (node name and hints) held by the interner (bounded
    /// likewise).
    pub fn interned_placements(&self) -> usize {
        self.names.placements()
    }

    /// Number of EndpointSlices.
    pub fn slice_count(&self) -> usize {
        self.slices.len()
    }

    /// The EndpointSlices of a service (label `kubernetes.io/service-name`, same namespace).
    pub fn slices_of(&self, name: &ServiceName) -> Vec<&Slice> {
        self.by_service
            .get(name)
            .map(|keys| {
                keys.iter()
                    .filter_map(|k| self.slices.get(k).map(|s| &**s))
                    .collect()
            })
            .unwrap_or_default()
    }

    /// This node's Node object, if seen.
    pub fn node(&self) -> Option<&Node> {
        self.node.as_ref()
    }

    /// Applies one event.
    pub fn apply(&mut self, ev: SourceEvent) -> Changes {
        match ev {
            SourceEvent::Init(kind) => {
                self.relisting.insert(kind, HashSet::new());
                Changes::default()
            }
            SourceEvent::InitApply(obj) => {
                let kind = kind_of(&obj);
                let key = key_of(&obj);
                if let Some(seen) = self.relisting.get_mut(&kind) {
                    seen.insert(key);
                }
                self.upsert(obj)
            }
            SourceEvent::Apply(obj) => self.upsert(obj),
            SourceEvent::Delete(obj) => {
                let key = key_of(&obj);
                self.remove(kind_of(&obj), &key)
            }
            SourceEvent::InitDone(kind) => {
                let seen = self.relisting.remove(&kind);
                let mut ch = Changes::default();
                if let Some(seen) = seen {
                    let gone: Vec<ObjKey> = match kind {
                        Kind::Service => self
                            .services
                            .keys()
                            .map(|n| (n.namespace.clone(), n.name.clone()))
                            .filter(|k| !seen.contains(k))
                            .collect(),
                        Kind::EndpointSlice => self
                            .slices
                            .keys()
                            .filter(|k| !seen.contains(*k))
                            .cloned()
                            .collect(),
                        Kind::Node => {
                            if seen.is_empty() && self.node.is_some() {
                                vec![(Arc::from(""), Arc::from(""))]
                            } else {
                                Vec::new()
                            }
                        }
                    };
                    for k in gone {
                        ch.merge(self.remove(kind, &k));
                    }
                }
                self.synced.insert(kind);
                ch
            }
        }
    }

    fn upsert(&mut self, obj: Object) -> Changes {
        let mut ch = Changes::default();
        match obj {
            Object::Service(mut svc) => {
                // Like slices below: a Service only this event holds shares its namespace and
                // vocabulary strings with the store's (before its name is copied into keys).
                if let Some(s) = Arc::get_mut(&mut svc) {
                    s.intern(&mut self.names);
                }
                let name = svc.name.clone();
                if self.services.get(&name).map(|s| &**s) != Some(&svc) {
                    self.services.insert(name.clone(), svc);
                    ch.services.insert(name.clone());
                    ch.dirty.insert(name);
                }
            }
            Object::EndpointSlice(mut slice) => {
                // A slice only this event holds shares its names with the store's (before they
                // are copied into keys); one a source still holds was interned by that source.
                if let Some(s) = Arc::get_mut(&mut slice) {
                    s.intern(&mut self.names);
                }
                let key = slice_key(&slice);
                let old = self.slices.get(&key).map(|s| &**s);
                if old == Some(&*slice) {
                    return ch;
                }
                let old_svc = old.and_then(|o| o.service.clone());
                let new_svc = slice.service.clone();
                if let Some(o) = &old_svc {
                    if Some(o) != new_svc.as_ref() {
                        self.unlink(o, &key);
                    }
                    ch.endpoints.insert(o.clone());
                    ch.dirty.insert(o.clone());
                }
                if let Some(n) = &new_svc {
                    self.by_service
                        .entry(n.clone())
                        .or_default()
                        .insert(key.clone());
                    ch.endpoints.insert(n.clone());
                    ch.dirty.insert(n.clone());
                }
                self.slices.insert(key, slice);
            }
            Object::Node(node) => {
                let before = node_facts(self.node.as_ref());
                let after = node_facts(Some(&node));
                self.node = Some(*node);
                ch.node_changed = before != after;
            }
        }
        ch
    }

    fn unlink(&mut self, svc: &ServiceName, key: &ObjKey) {
        if let Some(set) = self.by_service.get_mut(svc) {
            set.remove(key);
            if set.is_empty() {
                self.by_service.remove(svc);
            }
        }
    }

    fn remove(&mut self, kind: Kind, key: &ObjKey) -> Changes {
        let mut ch = Changes::default();
        match kind {
            Kind::Service => {
                let name = ServiceName::new(key.0.clone(), key.1.clone());
                if self.services.remove(&name).is_some() {
                    ch.services.insert(name.clone());
                    ch.dirty.insert(name);
                }
            }
            Kind::EndpointSlice => {
                if let Some(old) = self.slices.remove(key) {
                    if let Some(svc) = old.service.clone() {
                        self.unlink(&svc, key);
                        ch.endpoints.insert(svc.clone());
                        ch.dirty.insert(svc);
                    }
                }
            }
            Kind::Node => {
                let before = node_facts(self.node.as_ref());
                self.node = None;
                ch.node_changed = before != node_facts(None);
            }
        }
        ch
    }
}

fn kind_of(obj: &Object) -> Kind {
    match obj {
        Object::Service(_) => Kind::Service,
        Object::EndpointSlice(_) => Kind::EndpointSlice,
        Object::Node(_) => Kind::Node,
    }
}

fn key_of(obj: &Object) -> ObjKey {
    match obj {
        Object::Service(s) => (s.name.namespace.clone(), s.name.name.clone()),
        Object::EndpointSlice(s) => slice_key(s),
        // One node only: its key is fixed.
        Object::Node(_) => (Arc::from(""), Arc::from("")),
    }
}
