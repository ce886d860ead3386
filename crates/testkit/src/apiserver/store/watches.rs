//! Watches: the messages a watch stream gets, a registration's filter, and the store's side
//! (replay then live changes, bookmarks, and the fault-injection closes and expiries).

use super::*;

/// A message to one open watch stream.
#[derive(Debug)]
pub(crate) enum WatchMsg {
    /// One JSON line (an event).
    Line(Bytes),
    /// Drop the connection without a clean end.
    Abort,
}

/// An open watch.
#[derive(Debug)]
pub(crate) struct WatchReg {
    pub(crate) resource: Resource,
    pub(crate) namespace: Option<String>,
    pub(crate) labels: LabelSelector,
    pub(crate) fields: FieldSelector,
    pub(crate) bookmarks: bool,
    pub(crate) tx: UnboundedSender<WatchMsg>,
}

impl WatchReg {
    pub(super) fn matches(&self, key: &Key, obj: &Value) -> bool {
        key.0 == self.resource
            && self.namespace.as_ref().is_none_or(|ns| *ns == key.1)
            && self.labels.matches(obj)
            && self.fields.matches(obj)
    }

    /// The watch event (type, object) this change produces for this watch, if any.
    pub(super) fn event_for<'a>(&self, c: &'a Change) -> Option<(&'static str, &'a Value)> {
        match c.kind {
            ChangeKind::Added => self
                .matches(&c.key, &c.object)
                .then_some(("ADDED", &c.object)),
            ChangeKind::Deleted => self
                .matches(&c.key, &c.object)
                .then_some(("DELETED", &c.object)),
            ChangeKind::Modified => {
                let was = c.old.as_ref().is_some_and(|o| self.matches(&c.key, o));
                let is = self.matches(&c.key, &c.object);
                match (was, is) {
                    (true, true) => Some(("MODIFIED", &c.object)),
                    (false, true) => Some(("ADDED", &c.object)),
                    (true, false) => Some(("DELETED", &c.object)),
                    (false, false) => None,
                }
            }
        }
    }
}

impl Store {
    /// Open a watch: queue the replay, then register for live changes. A too-old rv queues a
    /// 410 ERROR event and no registration (the stream then ends).
    pub(crate) fn watch(
        &mut self,
        reg: WatchReg,
        resource_version: Option<&str>,
        send_initial_events: bool,
    ) -> Result<(), StatusError> {
        let from =
            match resource_version.filter(|r| !r.is_empty()) {
                None => None,
                Some(r) => Some(r.parse::<u64>().map_err(|_| {
                    StatusError::bad_request(format!("invalid resourceVersion {r:?}"))
                })?),
            };
        let send = |line: Bytes| reg.tx.send(WatchMsg::Line(line)).is_ok();
        match from {
            // Unset or 0: synthetic ADDED events for the current state, then live changes.
            None | Some(0) => {
                for (k, v) in self.view(reg.resource, None, None) {
                    if reg.matches(k, v) && !send(event_line("ADDED", v)) {
                        return Ok(());
                    }
                }
                if send_initial_events {
                    let mut bm = bookmark(reg.resource, self.rv);
                    if let Some(m) = bm.get_mut("metadata").and_then(Value::as_object_mut) {
                        m.insert(
                            "annotations".into(),
                            json!({"k8s.io/initial-events-end": "true"}),
                        );
                    }
                    send(event_line("BOOKMARK", &bm));
                }
            }
            Some(rv) if rv < self.compacted => {
                let st = StatusError::new(
                    410,
                    "Expired",
                    format!("too old resource version: {rv} ({})", self.compacted),
                );
                send(event_line("ERROR", &st.to_status()));
                return Ok(());
            }
            Some(rv) => {
                if send_initial_events {
                    // Initial events at a specific rv: state at rv, then replay the rest.
                    for (k, v) in self.view(reg.resource, Some(rv.min(self.rv)), None) {
                        if reg.matches(k, v) {
                            send(event_line("ADDED", v));
                        }
                    }
                    let mut bm = bookmark(reg.resource, rv.min(self.rv));
                    if let Some(m) = bm.get_mut("metadata").and_then(Value::as_object_mut) {
                        m.insert(
                            "annotations".into(),
                            json!({"k8s.io/initial-events-end": "true"}),
                        );
                    }
                    send(event_line("BOOKMARK", &bm));
                }
                for c in self.history.iter().filter(|c| c.rv > rv) {
                    if let Some((ty, obj)) = reg.event_for(c) {
                        if !send(event_line(ty, obj)) {
                            return Ok(());
                        }
                    }
                }
            }
        }
        self.watchers.push(reg);
        Ok(())
    }

    /// Send a BOOKMARK at the current rv to every watch that allows them.
    pub(crate) fn send_bookmarks(&mut self) {
        let rv = self.rv;
        self.watchers.retain(|w| {
            !w.bookmarks
                || w.tx
                    .send(WatchMsg::Line(event_line(
                        "BOOKMARK",
                        &bookmark(w.resource, rv),
                    )))
                    .is_ok()
        });
        self.watchers.retain(|w| !w.tx.is_closed());
    }

    /// Number of open watch streams.
    pub(crate) fn open_watches(&mut self) -> usize {
        self.watchers.retain(|w| !w.tx.is_closed());
        self.watchers.len()
    }

    /// Drop every watch connection abruptly.
    pub(crate) fn drop_watches(&mut self) -> usize {
        let n = self.watchers.len();
        for w in self.watchers.drain(..) {
            let _ = w.tx.send(WatchMsg::Abort);
        }
        n
    }

    /// End every watch stream cleanly (like a server-side timeout).
    pub(crate) fn close_watches(&mut self) -> usize {
        let n = self.watchers.len();
        self.watchers.clear();
        n
    }

    /// Send a 410 Expired ERROR event to every watch, then end it (like a watch-cache overflow).
    pub(crate) fn expire_watches(&mut self) -> usize {
        let st = StatusError::new(
            410,
            "Expired",
            format!("too old resource version: {} ({})", self.compacted, self.rv),
        );
        let n = self.watchers.len();
        for w in self.watchers.drain(..) {
            let _ =
                w.tx.send(WatchMsg::Line(event_line("ERROR", &st.to_status())));
        }
        n
    }
}

/// A BOOKMARK object: only kind, apiVersion and metadata.resourceVersion.
pub(crate) fn bookmark(res: Resource, rv: u64) -> Value {
    json!({
        "kind": res.kind(),
        "apiVersion": res.api_version(),
        "metadata": {"resourceVersion": rv.to_string(), "creationTimestamp": null},
    })
}

/// One watch event as a JSON line.
pub(crate) fn event_line(ty: &str, obj: &Value) -> Bytes {
    let mut line = serde_json::to_vec(&json!({"type": ty, "object": obj})).unwrap_or_default();
    line.push(b'\n');
    Bytes::from(line)
}
