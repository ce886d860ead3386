//! Applying a batch of file updates: the objects whose effective version changed become
//! watch-like events; and the directory's whole content as a snapshot.

use std::collections::{BTreeMap, HashMap};
use std::path::PathBuf;
use std::sync::Arc;

use k8s_openapi::api::core::v1::Node;

use super::state::{
    file_mut, relist_events, service_key, slice_key, synthesize_node, Batch, DirState, FileKey,
    ObjKey, Snapshot, Update,
};
use model::event::{Object, SourceEvent};
use model::objects::{Slice, Svc};
use model::sorted::SortedVec;

impl DirState {
    /// Applies a batch of file updates and returns the events of the objects whose effective
    /// version changed: `Apply` for new or changed ones, `Delete` for those no file defines
    /// any more. An object moving between files, or a file renamed, emits nothing unless the
    /// effective object changed.
    pub(super) fn apply(&mut self, updates: Vec<(PathBuf, Update)>) -> Batch {
        let mut batch = Batch::default();
        // The objects the batch may change, with their effective version before it.
        let mut services: BTreeMap<ObjKey, Option<Arc<Svc>>> = BTreeMap::new();
        let mut slices: BTreeMap<ObjKey, Option<Arc<Slice>>> = BTreeMap::new();
        let mut note = |this: &DirState, svcs: &[Arc<Svc>], slcs: &[Arc<Slice>]| {
            for s in svcs {
                let k = service_key(s);
                if let std::collections::btree_map::Entry::Vacant(v) = services.entry(k) {
                    let before = this.service(v.key()).cloned();
                    v.insert(before);
                }
            }
            for s in slcs {
                let k = slice_key(s);
                if let std::collections::btree_map::Entry::Vacant(v) = slices.entry(k) {
                    let before = this.slice(v.key()).cloned();
                    v.insert(before);
                }
            }
        };
        for (path, u) in &updates {
            if let Some(e) = self.files.get(path.as_os_str()) {
                note(self, e.services(), e.endpoint_slices());
            }
            if let Update::Read {
                parsed: Some(Ok(objs)),
                ..
            } = u
            {
                note(self, &objs.services, &objs.endpoint_slices);
            }
        }
        for (path, u) in updates {
            match u {
                Update::Gone => {
                    self.unindex(&path);
                    self.files.remove(path.as_os_str());
                }
                Update::Unreadable(e) => {
                    if self.files.contains_key(path.as_os_str()) {
                        batch.warnings.push(format!(
                            "{}: keeping the objects of its last good version",
                            path.display()
                        ));
                    }
                    batch.errors.push(e);
                }
                Update::Read {
                    hash,
                    stamp,
                    parsed: None,
                } => {
                    let e = file_mut(&mut self.files, &path);
                    e.hash = Some(hash);
                    e.stamp = stamp.map(|s| s.digest());
                }
                Update::Read {
                    hash,
                    stamp,
                    parsed: Some(Err(err)),
                } => {
                    let e = file_mut(&mut self.files, &path);
                    e.hash = Some(hash);
                    e.stamp = stamp.map(|s| s.digest());
                    e.bad = true;
                    if e.has_good {
                        batch.warnings.push(format!(
                            "{}: keeping the objects of its last good version",
                            path.display()
                        ));
                    }
                    batch.errors.push(err);
                }
                Update::Read {
                    hash,
                    stamp,
                    parsed: Some(Ok(objs)),
                } => {
                    self.unindex(&path);
                    batch.warnings.extend(objs.warnings.iter().cloned());
                    let e = file_mut(&mut self.files, &path);
                    e.hash = Some(hash);
                    e.stamp = stamp.map(|s| s.digest());
                    e.bad = false;
                    e.has_good = true;
                    e.set_objects(objs);
                    self.index(&path);
                }
            }
        }
        // Node first, then Services before their slices; deletions last.
        let node = self.choose_node(&mut batch.warnings);
        if self.node.as_ref() != Some(&node) {
            batch
                .events
                .push(SourceEvent::Apply(Object::Node(Box::new(node.clone()))));
            self.node = Some(node);
        }
        let mut service_deletes = Vec::new();
        let mut slice_deletes = Vec::new();
        for (k, before) in services {
            let after = self.service(&k);
            if self.service_defs.get(&k).is_some_and(|d| d.len() > 1) {
                batch.warnings.push(format!(
                    "Service {}/{} is defined in several files; the last one wins: {}",
                    k.0,
                    k.1,
                    self.defined_in(&self.service_defs, &k)
                ));
            }
            match (before, after) {
                (before, Some(after)) if before.as_ref() != Some(after) => batch
                    .events
                    .push(SourceEvent::Apply(Object::Service(after.clone()))),
                (Some(before), None) => {
                    service_deletes.push(SourceEvent::Delete(Object::Service(before)))
                }
                _ => {}
            }
        }
        for (k, before) in slices {
            let after = self.slice(&k);
            if self.slice_defs.get(&k).is_some_and(|d| d.len() > 1) {
                batch.warnings.push(format!(
                    "EndpointSlice {}/{} is defined in several files; the last one wins: {}",
                    k.0,
                    k.1,
                    self.defined_in(&self.slice_defs, &k)
                ));
            }
            match (before, after) {
                (before, Some(after)) if before.as_ref() != Some(after) => batch
                    .events
                    .push(SourceEvent::Apply(Object::EndpointSlice(after.clone()))),
                (Some(before), None) => {
                    slice_deletes.push(SourceEvent::Delete(Object::EndpointSlice(before)))
                }
                _ => {}
            }
        }
        batch.events.extend(slice_deletes);
        batch.events.extend(service_deletes);
        batch
    }

    fn defined_in(&self, defs: &HashMap<ObjKey, SortedVec<FileKey>>, k: &ObjKey) -> String {
        defs.get(k)
            .map(|d| {
                d.iter()
                    .map(|p| p.display().to_string())
                    .collect::<Vec<_>>()
                    .join(", ")
            })
            .unwrap_or_default()
    }

    /// This node's Node: the one named like the host; else the only Node; else a bare one.
    pub(super) fn choose_node(&self, warnings: &mut Vec<String>) -> Node {
        let mut nodes: BTreeMap<&str, &Node> = BTreeMap::new();
        for e in self.files.values() {
            for n in e.nodes() {
                nodes.insert(n.metadata.name.as_deref().unwrap_or_default(), n);
            }
        }
        if let Some(n) = nodes.get(self.node_name.as_str()) {
            return (*n).clone();
        }
        if nodes.len() == 1 {
            if let Some(n) = nodes.values().next() {
                return (*n).clone();
            }
        }
        if !nodes.is_empty() {
            warnings.push(format!(
                "{} Nodes in the directory and none named {:?}; using a bare Node",
                nodes.len(),
                self.node_name
            ));
        }
        synthesize_node(&self.node_name)
    }

    /// The objects as a full relist, exactly [`Snapshot::events`] of [`DirState::snapshot`]
    /// (each object where its effective definition is, in file name then document order),
    /// made without the snapshot's maps and copies: the daemon's first list of a directory of
    /// 10,000 services otherwise allocated ~2 MB of small map nodes for it (issue #18).
    pub fn relist(&self) -> Vec<SourceEvent> {
        let good = || self.files.values().filter(|e| e.has_good);
        let services = good().flat_map(|e| e.services()).filter(|s| {
            self.service(&service_key(s))
                .is_some_and(|w| Arc::ptr_eq(w, s))
        });
        let slices = good()
            .flat_map(|e| e.endpoint_slices())
            .filter(|s| self.slice(&slice_key(s)).is_some_and(|w| Arc::ptr_eq(w, s)));
        relist_events(
            self.choose_node(&mut Vec::new()),
            services.cloned(),
            slices.cloned(),
        )
    }

    /// Everything the state holds, in file name then document order.
    pub fn snapshot(&self) -> Snapshot {
        let mut warnings = Vec::new();
        let mut services: BTreeMap<ObjKey, (usize, Arc<Svc>)> = BTreeMap::new();
        let mut slices: BTreeMap<ObjKey, (usize, Arc<Slice>)> = BTreeMap::new();
        let mut nodes: BTreeMap<String, Node> = BTreeMap::new();
        let mut seq = 0usize;
        let mut files = Vec::new();
        for (path, e) in &self.files {
            if !e.has_good {
                continue;
            }
            if e.bad {
                warnings.push(format!(
                    "{}: keeping the objects of its last good version",
                    path.display()
                ));
            }
            files.push(path.clone());
            warnings.extend(e.warnings().iter().cloned());
            for s in e.services() {
                seq += 1;
                let k = service_key(s);
                if services.insert(k.clone(), (seq, s.clone())).is_some() {
                    warnings.push(format!(
                        "{}: Service {}/{} redefined; this later definition wins",
                        path.display(),
                        k.0,
                        k.1
                    ));
                }
            }
            for s in e.endpoint_slices() {
                seq += 1;
                let k = slice_key(s);
                if slices.insert(k.clone(), (seq, s.clone())).is_some() {
                    warnings.push(format!(
                        "{}: EndpointSlice {}/{} redefined; this later definition wins",
                        path.display(),
                        k.0,
                        k.1
                    ));
                }
            }
            for n in e.nodes() {
                let name = n.metadata.name.clone().unwrap_or_default();
                if nodes.insert(name.clone(), n.clone()).is_some() {
                    warnings.push(format!(
                        "{}: Node {name} redefined; this later definition wins",
                        path.display()
                    ));
                }
            }
        }
        // Keep file/document order (the order a human wrote them in), not name order.
        let mut services: Vec<_> = services.into_values().collect();
        services.sort_by_key(|(seq, _)| *seq);
        let mut slices: Vec<_> = slices.into_values().collect();
        slices.sort_by_key(|(seq, _)| *seq);
        let node = self.choose_node(&mut warnings);
        let node_synthesized = !nodes.contains_key(self.node_name.as_str()) && nodes.len() != 1;
        Snapshot {
            services: services.into_iter().map(|(_, s)| s).collect(),
            endpoint_slices: slices.into_iter().map(|(_, s)| s).collect(),
            node,
            node_synthesized,
            files,
            warnings,
        }
    }
}
