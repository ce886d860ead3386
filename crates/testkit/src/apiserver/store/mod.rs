//! The fake API server's state: objects, the resourceVersion history, open watches, logs.
//!
//! Everything is plain JSON (`serde_json::Value`) keyed by resource, namespace and name, the way
//! the real server keeps objects in etcd. Every write takes the next global resourceVersion and
//! appends a [`Change`] to the history; watches replay the history after their resourceVersion and
//! then receive live changes. Lists at an older resourceVersion (continue tokens) are answered by
//! rolling the history back, so paginated lists are consistent snapshots like the real server's.

use super::selector::{FieldSelector, LabelSelector};
use axum::body::Bytes;
use serde_json::{json, Map, Value};
use std::collections::{BTreeMap, VecDeque};
use tokio::sync::mpsc::UnboundedSender;

mod list;
mod resource;
mod watches;

pub(crate) use list::Filter;
#[cfg(test)]
use list::{decode_continue, encode_continue};
pub use resource::{Key, Resource, StatusError};
pub(crate) use watches::{event_line, WatchMsg, WatchReg};

/// What a change did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum ChangeKind {
    Added,
    Modified,
    Deleted,
}

/// One write, as kept in the history.
#[derive(Debug, Clone)]
pub(crate) struct Change {
    rv: u64,
    key: Key,
    kind: ChangeKind,
    /// The state before (None for Added).
    old: Option<Value>,
    /// The object as sent in the watch event (for Deleted: last state at the deletion rv).
    object: Value,
}

/// One served HTTP request, for assertions.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RequestRecord {
    /// HTTP method.
    pub method: String,
    /// URL path.
    pub path: String,
    /// Raw query string (may be empty).
    pub query: String,
    /// Response status code (200 for watches that started).
    pub status: u16,
    /// Whether this was a watch request.
    pub watch: bool,
}

/// Current time as the API server formats it.
fn now_rfc3339() -> String {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or_default();
    k8s_openapi::jiff::Timestamp::from_second(i64::try_from(secs).unwrap_or_default())
        .map(|t| t.strftime("%Y-%m-%dT%H:%M:%SZ").to_string())
        .unwrap_or_else(|_| "1970-01-01T00:00:00Z".to_string())
}

fn meta_mut(obj: &mut Value) -> Result<&mut Map<String, Value>, StatusError> {
    let map = obj
        .as_object_mut()
        .ok_or_else(|| StatusError::bad_request("object is not a JSON object"))?;
    let meta = map.entry("metadata").or_insert_with(|| json!({}));
    meta.as_object_mut()
        .ok_or_else(|| StatusError::bad_request("metadata is not an object"))
}

fn meta_str<'a>(obj: &'a Value, field: &str) -> Option<&'a str> {
    obj.get("metadata")
        .and_then(|m| m.get(field))
        .and_then(Value::as_str)
}

/// The server's state.
#[derive(Debug)]
pub(crate) struct Store {
    rv: u64,
    objects: BTreeMap<Key, Value>,
    history: VecDeque<Change>,
    /// Changes with rv <= compacted are gone: watches and snapshots older than this get 410.
    compacted: u64,
    history_limit: usize,
    watchers: Vec<WatchReg>,
    uid_counter: u64,
    pub(crate) events: Vec<Value>,
    pub(crate) requests: Vec<RequestRecord>,
}

impl Default for Store {
    fn default() -> Self {
        Self {
            rv: 1,
            objects: BTreeMap::new(),
            history: VecDeque::new(),
            compacted: 1,
            history_limit: 100_000,
            watchers: Vec::new(),
            uid_counter: 0,
            events: Vec::new(),
            requests: Vec::new(),
        }
    }
}

impl Store {
    /// The current global resourceVersion.
    pub(crate) fn resource_version(&self) -> u64 {
        self.rv
    }

    /// The oldest resourceVersion a watch may still start from.
    pub(crate) fn compacted(&self) -> u64 {
        self.compacted
    }

    pub(crate) fn set_history_limit(&mut self, limit: usize) {
        self.history_limit = limit.max(1);
        self.trim_history();
    }

    fn trim_history(&mut self) {
        while self.history.len() > self.history_limit {
            if let Some(c) = self.history.pop_front() {
                self.compacted = c.rv;
            }
        }
    }

    /// Forget all history: watches and continue tokens from before now get 410 Gone.
    pub(crate) fn compact(&mut self) {
        self.history.clear();
        self.compacted = self.rv;
    }

    /// Forget history and move the resourceVersion far ahead, like a restore from backup.
    pub(crate) fn reset_history(&mut self, jump: u64) {
        self.rv += jump;
        self.compact();
    }

    pub(crate) fn next_uid(&mut self) -> String {
        self.uid_counter += 1;
        format!(
            "{:08x}-fa4e-4a91-8000-{:012x}",
            std::process::id(),
            self.uid_counter
        )
    }

    pub(crate) fn next_rv(&mut self) -> u64 {
        self.rv += 1;
        self.rv
    }

    pub(crate) fn get(&self, key: &Key) -> Option<&Value> {
        self.objects.get(key)
    }

    fn record(&mut self, key: Key, kind: ChangeKind, old: Option<Value>, object: Value) {
        let change = Change {
            rv: self.rv,
            key,
            kind,
            old,
            object,
        };
        self.watchers.retain(|w| match w.event_for(&change) {
            Some((ty, obj)) => w.tx.send(WatchMsg::Line(event_line(ty, obj))).is_ok(),
            None => !w.tx.is_closed(),
        });
        self.history.push_back(change);
        self.trim_history();
    }

    /// Create an object; fills uid, creationTimestamp, resourceVersion, generation.
    pub(crate) fn create(&mut self, res: Resource, mut obj: Value) -> Result<Value, StatusError> {
        set_type_meta(res, &mut obj)?;
        let uid = self.next_uid();
        let meta = meta_mut(&mut obj)?;
        let name = match meta.get("name").and_then(Value::as_str) {
            Some(n) if !n.is_empty() => n.to_string(),
            _ => match meta.get("generateName").and_then(Value::as_str) {
                Some(prefix) => format!("{prefix}{:05x}", self.uid_counter),
                None => {
                    return Err(StatusError::new(
                        422,
                        "Invalid",
                        "metadata.name: Required value",
                    ))
                }
            },
        };
        let ns = if res.namespaced() {
            match meta.get("namespace").and_then(Value::as_str) {
                Some(ns) if !ns.is_empty() => ns.to_string(),
                _ => "default".to_string(),
            }
        } else {
            String::new()
        };
        let key = (res, ns.clone(), name.clone());
        if self.objects.contains_key(&key) {
            return Err(StatusError::new(
                409,
                "AlreadyExists",
                format!("{} \"{name}\" already exists", res.plural()),
            ));
        }
        let rv = self.next_rv();
        let meta = meta_mut(&mut obj)?;
        meta.insert("name".into(), json!(name));
        if res.namespaced() {
            meta.insert("namespace".into(), json!(ns));
        } else {
            meta.remove("namespace");
        }
        meta.insert("uid".into(), json!(uid));
        meta.insert("resourceVersion".into(), json!(rv.to_string()));
        meta.insert("creationTimestamp".into(), json!(now_rfc3339()));
        meta.insert("generation".into(), json!(1));
        meta.remove("deletionTimestamp");
        self.objects.insert(key.clone(), obj.clone());
        self.record(key, ChangeKind::Added, None, obj.clone());
        Ok(obj)
    }

    /// Replace an object (PUT). A stale metadata.resourceVersion is a 409 Conflict.
    pub(crate) fn update(&mut self, res: Resource, mut obj: Value) -> Result<Value, StatusError> {
        set_type_meta(res, &mut obj)?;
        let name = meta_str(&obj, "name").unwrap_or_default().to_string();
        let ns = if res.namespaced() {
            meta_str(&obj, "namespace").unwrap_or("default").to_string()
        } else {
            String::new()
        };
        let key = (res, ns, name.clone());
        let old = self
            .objects
            .get(&key)
            .cloned()
            .ok_or_else(|| StatusError::not_found(res, &name))?;
        let old_rv = meta_str(&old, "resourceVersion")
            .unwrap_or_default()
            .to_string();
        if let Some(sent) = meta_str(&obj, "resourceVersion").filter(|s| !s.is_empty()) {
            if sent != old_rv {
                return Err(StatusError::new(
                    409,
                    "Conflict",
                    format!(
                        "Operation cannot be fulfilled on {} \"{name}\": the object has been modified; please apply your changes to the latest version and try again",
                        res.plural()
                    ),
                ));
            }
        }
        // Server-owned fields survive a replace.
        {
            let meta = meta_mut(&mut obj)?;
            for f in [
                "uid",
                "creationTimestamp",
                "deletionTimestamp",
                "deletionGracePeriodSeconds",
            ] {
                match old.get("metadata").and_then(|m| m.get(f)) {
                    Some(v) => meta.insert(f.into(), v.clone()),
                    None => meta.remove(f),
                };
            }
            if !res.namespaced() {
                meta.remove("namespace");
            } else {
                meta.insert("namespace".into(), json!(key.1));
            }
            meta.insert("resourceVersion".into(), json!(old_rv));
            let spec_changed = old.get("spec") != obj.get("spec");
            let generation = old
                .pointer("/metadata/generation")
                .and_then(Value::as_i64)
                .unwrap_or(1);
            let meta = meta_mut(&mut obj)?;
            meta.insert(
                "generation".into(),
                json!(if spec_changed {
                    generation + 1
                } else {
                    generation
                }),
            );
        }
        let terminating = old.pointer("/metadata/deletionTimestamp").is_some();
        let no_finalizers = obj
            .pointer("/metadata/finalizers")
            .and_then(Value::as_array)
            .is_none_or(|f| f.is_empty());
        if terminating && no_finalizers {
            return self.remove(key, obj);
        }
        if obj == old {
            // A no-op write does not touch storage: same resourceVersion, no event.
            return Ok(old);
        }
        let rv = self.next_rv();
        meta_mut(&mut obj)?.insert("resourceVersion".into(), json!(rv.to_string()));
        self.objects.insert(key.clone(), obj.clone());
        self.record(key, ChangeKind::Modified, Some(old), obj.clone());
        Ok(obj)
    }

    fn remove(&mut self, key: Key, mut last: Value) -> Result<Value, StatusError> {
        let old = self.objects.remove(&key);
        let rv = self.next_rv();
        meta_mut(&mut last)?.insert("resourceVersion".into(), json!(rv.to_string()));
        self.record(key, ChangeKind::Deleted, old, last.clone());
        Ok(last)
    }

    /// Delete an object; with finalizers it only gets a deletionTimestamp.
    pub(crate) fn delete(&mut self, key: Key) -> Result<Value, StatusError> {
        let old = self
            .objects
            .get(&key)
            .cloned()
            .ok_or_else(|| StatusError::not_found(key.0, &key.2))?;
        let has_finalizers = old
            .pointer("/metadata/finalizers")
            .and_then(Value::as_array)
            .is_some_and(|f| !f.is_empty());
        if !has_finalizers {
            return self.remove(key, old);
        }
        if old.pointer("/metadata/deletionTimestamp").is_some() {
            return Ok(old);
        }
        let mut obj = old.clone();
        let rv = self.next_rv();
        let meta = meta_mut(&mut obj)?;
        meta.insert("deletionTimestamp".into(), json!(now_rfc3339()));
        meta.insert("deletionGracePeriodSeconds".into(), json!(0));
        meta.insert("resourceVersion".into(), json!(rv.to_string()));
        self.objects.insert(key.clone(), obj.clone());
        self.record(key, ChangeKind::Modified, Some(old), obj.clone());
        Ok(obj)
    }

    /// Record a core/v1 or events.k8s.io/v1 Event.
    pub(crate) fn record_event(&mut self, mut ev: Value) -> Result<Value, StatusError> {
        // The real API's validation of events.k8s.io/v1 Events (ValidateEventCreate): a note
        // of at most 1 KiB (bytes), reason and action of at most 128 characters.
        if ev.get("apiVersion").and_then(Value::as_str) == Some("events.k8s.io/v1") {
            let len = |f: &str| ev.get(f).and_then(Value::as_str).map_or(0, str::len);
            for (field, max) in [("note", 1024), ("reason", 128), ("action", 128)] {
                if len(field) > max {
                    return Err(StatusError::new(
                        422,
                        "Invalid",
                        format!(
                            "Event is invalid: {field}: Too long: may not be more than {max} bytes"
                        ),
                    ));
                }
            }
        }
        let uid = self.next_uid();
        let rv = self.next_rv();
        let meta = meta_mut(&mut ev)?;
        let unnamed = meta
            .get("name")
            .and_then(Value::as_str)
            .is_none_or(str::is_empty);
        if unnamed {
            let prefix = meta
                .get("generateName")
                .and_then(Value::as_str)
                .unwrap_or("event.")
                .to_string();
            meta.insert("name".into(), json!(format!("{prefix}{rv:x}")));
        }
        meta.entry("uid").or_insert(json!(uid));
        meta.insert("resourceVersion".into(), json!(rv.to_string()));
        meta.entry("creationTimestamp")
            .or_insert(json!(now_rfc3339()));
        let name = meta.get("name").cloned();
        let ns = meta.get("namespace").cloned();
        if let Some(existing) = self.events.iter_mut().find(|e| {
            e.pointer("/metadata/name") == name.as_ref()
                && e.pointer("/metadata/namespace") == ns.as_ref()
        }) {
            *existing = ev.clone();
        } else {
            self.events.push(ev.clone());
        }
        Ok(ev)
    }

    pub(crate) fn find_event(&self, ns: &str, name: &str) -> Option<Value> {
        self.events
            .iter()
            .find(|e| {
                e.pointer("/metadata/name").and_then(Value::as_str) == Some(name)
                    && e.pointer("/metadata/namespace").and_then(Value::as_str) == Some(ns)
            })
            .cloned()
    }
}

fn set_type_meta(res: Resource, obj: &mut Value) -> Result<(), StatusError> {
    let map = obj
        .as_object_mut()
        .ok_or_else(|| StatusError::bad_request("object is not a JSON object"))?;
    if let Some(kind) = map.get("kind").and_then(Value::as_str) {
        if kind != res.kind() {
            return Err(StatusError::bad_request(format!(
                "kind {kind} does not match {}",
                res.kind()
            )));
        }
    }
    map.insert("kind".into(), json!(res.kind()));
    map.insert("apiVersion".into(), json!(res.api_version()));
    Ok(())
}

/// RFC 7386 JSON merge patch.
pub(crate) fn merge_patch(target: &mut Value, patch: &Value) {
    match patch {
        Value::Object(p) => {
            if !target.is_object() {
                *target = json!({});
            }
            if let Some(t) = target.as_object_mut() {
                for (k, v) in p {
                    if v.is_null() {
                        t.remove(k);
                    } else {
                        merge_patch(t.entry(k.clone()).or_insert(Value::Null), v);
                    }
                }
            }
        }
        other => *target = other.clone(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn svc(name: &str, labels: Value) -> Value {
        json!({"metadata": {"name": name, "namespace": "ns", "labels": labels}, "spec": {"ports": [{"port": 80}]}})
    }

    #[test]
    fn continue_token_roundtrip() {
        let key = (Resource::Services, "ns".to_string(), "a/b".to_string());
        let t = encode_continue(42, &key);
        assert_eq!(
            decode_continue(&t).unwrap(),
            (42, "ns".into(), "a/b".into())
        );
        assert!(decode_continue("zz").is_err());
        assert!(decode_continue("abc").is_err());
    }

    #[test]
    fn snapshot_rolls_back_history() {
        let mut s = Store::default();
        s.create(Resource::Services, svc("a", json!({}))).unwrap();
        let rv1 = s.resource_version();
        let mut b = s.create(Resource::Services, svc("b", json!({}))).unwrap();
        b["spec"]["ports"][0]["port"] = json!(81);
        s.update(Resource::Services, b).unwrap();
        s.delete((Resource::Services, "ns".into(), "a".into()))
            .unwrap();
        let now = s.snapshot(Resource::Services, None);
        assert_eq!(now.len(), 1);
        let then = s.snapshot(Resource::Services, Some(rv1));
        assert_eq!(then.len(), 1);
        assert!(then.contains_key(&(Resource::Services, "ns".into(), "a".into())));
        let page = s
            .list(
                Resource::Services,
                &Filter::default(),
                None,
                None,
                Some(&rv1.to_string()),
                true,
            )
            .unwrap();
        assert_eq!(page.rv, rv1);
        assert_eq!(page.items.len(), 1);
        s.compact();
        let err = s
            .list(
                Resource::Services,
                &Filter::default(),
                None,
                None,
                Some(&rv1.to_string()),
                true,
            )
            .unwrap_err();
        assert_eq!(err.code, 410);
    }

    #[test]
    fn view_after_key_with_repeated_changes() {
        let mut s = Store::default();
        for n in ["a", "b", "c", "d"] {
            s.create(Resource::Services, svc(n, json!({}))).unwrap();
        }
        // Another resource's objects never leak into the view.
        s.create(Resource::Nodes, json!({"metadata": {"name": "n"}}))
            .unwrap();
        let at = s.resource_version();
        for port in [1, 2, 3] {
            let mut c = s
                .get(&(Resource::Services, "ns".into(), "c".into()))
                .unwrap()
                .clone();
            c["spec"]["ports"][0]["port"] = json!(port);
            c["metadata"]["resourceVersion"] = json!(null);
            s.update(Resource::Services, c).unwrap();
        }
        s.delete((Resource::Services, "ns".into(), "b".into()))
            .unwrap();
        s.create(Resource::Services, svc("bb", json!({}))).unwrap();
        let after = (Resource::Services, "ns".to_string(), "a".to_string());
        let then: Vec<(String, Value)> = s
            .view(Resource::Services, Some(at), Some(&after))
            .into_iter()
            .map(|(k, v)| (k.2.clone(), v["spec"]["ports"][0]["port"].clone()))
            .collect();
        assert_eq!(
            then,
            [
                ("b".into(), json!(80)),
                ("c".into(), json!(80)),
                ("d".into(), json!(80))
            ]
        );
        let now: Vec<String> = s
            .view(Resource::Services, None, Some(&after))
            .into_iter()
            .map(|(k, _)| k.2.clone())
            .collect();
        assert_eq!(now, ["bb", "c", "d"]);
    }

    #[test]
    fn noop_update_keeps_rv_and_conflict_on_stale() {
        let mut s = Store::default();
        let a = s.create(Resource::Services, svc("a", json!({}))).unwrap();
        let rv = s.resource_version();
        let same = s.update(Resource::Services, a.clone()).unwrap();
        assert_eq!(s.resource_version(), rv);
        assert_eq!(same, a);
        let mut changed = a.clone();
        changed["spec"]["ports"][0]["port"] = json!(99);
        s.update(Resource::Services, changed.clone()).unwrap();
        assert_eq!(s.resource_version(), rv + 1);
        let err = s.update(Resource::Services, changed).unwrap_err();
        assert_eq!(err.code, 409);
    }

    #[test]
    fn finalizers_delay_deletion() {
        let mut s = Store::default();
        let mut o = svc("f", json!({}));
        o["metadata"]["finalizers"] = json!(["x"]);
        s.create(Resource::Services, o).unwrap();
        let key = (Resource::Services, "ns".to_string(), "f".to_string());
        let d = s.delete(key.clone()).unwrap();
        assert!(d.pointer("/metadata/deletionTimestamp").is_some());
        assert!(s.get(&key).is_some());
        let mut cur = s.get(&key).unwrap().clone();
        cur["metadata"]["finalizers"] = json!([]);
        s.update(Resource::Services, cur).unwrap();
        assert!(s.get(&key).is_none());
    }

    #[test]
    fn merge_patch_rfc7386() {
        let mut t = json!({"a": {"b": 1, "c": 2}, "d": [1]});
        merge_patch(&mut t, &json!({"a": {"b": null, "e": 3}, "d": [2]}));
        assert_eq!(t, json!({"a": {"c": 2, "e": 3}, "d": [2]}));
    }
}
