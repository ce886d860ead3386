//! Lists: filters, pages and continue tokens, answered from a view of the objects as they were
//! at a resourceVersion (the history rolled back over the current objects), so paginated lists
//! are consistent snapshots like the real server's.

use super::*;

/// A parsed list/watch filter.
#[derive(Debug, Clone, Default)]
pub(crate) struct Filter {
    pub(crate) namespace: Option<String>,
    pub(crate) labels: LabelSelector,
    pub(crate) fields: FieldSelector,
}

/// A page of a list.
#[derive(Debug)]
pub(crate) struct ListPage {
    pub(crate) rv: u64,
    pub(crate) items: Vec<Value>,
    pub(crate) continue_token: Option<String>,
    pub(crate) remaining: Option<usize>,
}

/// Encode a continue token (opaque to clients): hex of `rv/namespace/name`.
pub(super) fn encode_continue(rv: u64, key: &Key) -> String {
    format!("{rv}/{}/{}", key.1, key.2)
        .bytes()
        .map(|b| format!("{b:02x}"))
        .collect()
}

pub(super) fn decode_continue(token: &str) -> Result<(u64, String, String), StatusError> {
    let bad = || StatusError::bad_request(format!("invalid continue token {token:?}"));
    if token.len() % 2 != 0 {
        return Err(bad());
    }
    let bytes = (0..token.len())
        .step_by(2)
        .map(|i| {
            token
                .get(i..i + 2)
                .and_then(|h| u8::from_str_radix(h, 16).ok())
        })
        .collect::<Option<Vec<u8>>>()
        .ok_or_else(bad)?;
    let text = String::from_utf8(bytes).map_err(|_| bad())?;
    let mut parts = text.splitn(3, '/');
    let rv = parts.next().and_then(|r| r.parse().ok()).ok_or_else(bad)?;
    let ns = parts.next().ok_or_else(bad)?.to_string();
    let name = parts.next().ok_or_else(bad)?.to_string();
    Ok((rv, ns, name))
}

impl Store {
    /// Objects of one resource as they were at `at` (current if None), after `after` in key
    /// order, by reference: the history after `at` is rolled back over the current objects.
    pub(super) fn view(
        &self,
        res: Resource,
        at: Option<u64>,
        after: Option<&Key>,
    ) -> Vec<(&Key, &Value)> {
        use std::ops::Bound;
        let first = (res, String::new(), String::new());
        let lower = after.map_or(Bound::Included(&first), Bound::Excluded);
        let in_range = |k: &Key| k.0 == res && after.is_none_or(|a| k > a);
        // Rolled-back state of every key changed after `at` (None: did not exist then).
        let mut overrides: BTreeMap<&Key, Option<&Value>> = BTreeMap::new();
        if let Some(at) = at {
            for c in self.history.iter().rev().take_while(|c| c.rv > at) {
                if in_range(&c.key) {
                    let then = match c.kind {
                        ChangeKind::Added => None,
                        ChangeKind::Modified | ChangeKind::Deleted => c.old.as_ref(),
                    };
                    overrides.insert(&c.key, then);
                }
            }
        }
        let current = self
            .objects
            .range::<Key, _>((lower, Bound::Unbounded))
            .take_while(|(k, _)| k.0 == res)
            .filter(|(k, _)| !overrides.contains_key(k));
        let mut out: Vec<(&Key, &Value)> = current.collect();
        if !overrides.is_empty() {
            out.extend(overrides.into_iter().filter_map(|(k, v)| v.map(|v| (k, v))));
            out.sort_by(|a, b| a.0.cmp(b.0));
        }
        out
    }

    /// Objects of one resource as they were at `at` (current if None), cloned.
    #[cfg(test)]
    pub(super) fn snapshot(&self, res: Resource, at: Option<u64>) -> BTreeMap<Key, Value> {
        self.view(res, at, None)
            .into_iter()
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect()
    }

    /// A list (page): `rv` parameter semantics follow the real server.
    pub(crate) fn list(
        &self,
        res: Resource,
        filter: &Filter,
        limit: Option<usize>,
        continue_token: Option<&str>,
        resource_version: Option<&str>,
        exact: bool,
    ) -> Result<ListPage, StatusError> {
        let (at, start_after) = if let Some(token) = continue_token.filter(|t| !t.is_empty()) {
            let (rv, ns, name) = decode_continue(token)?;
            if rv < self.compacted {
                return Err(StatusError::new(
                    410,
                    "Expired",
                    "The provided continue parameter is too old to display a consistent list result. You can start a new list without the continue parameter, or use the continue value from the response to start a new list.",
                ));
            }
            (rv, Some((res, ns, name)))
        } else {
            match resource_version.filter(|r| !r.is_empty()) {
                None => (self.rv, None),
                Some(r) => {
                    let want: u64 = r.parse().map_err(|_| {
                        StatusError::bad_request(format!("invalid resourceVersion {r:?}"))
                    })?;
                    if exact && want != 0 {
                        if want < self.compacted {
                            return Err(StatusError::new(
                                410,
                                "Expired",
                                format!("too old resource version: {want} ({})", self.compacted),
                            ));
                        }
                        if want > self.rv {
                            return Err(StatusError::new(
                                504,
                                "Timeout",
                                format!("Too large resource version: {want}, current: {}", self.rv),
                            ));
                        }
                        (want, None)
                    } else {
                        (self.rv, None)
                    }
                }
            }
        };
        // resourceVersion=0 (no continue) is served from the cache: pagination is ignored.
        let limit = if continue_token.is_none() && resource_version == Some("0") {
            None
        } else {
            limit.filter(|l| *l > 0)
        };
        let state = self.view(res, (at != self.rv).then_some(at), start_after.as_ref());
        let matching = state.into_iter().filter(|(k, v)| {
            filter.namespace.as_ref().is_none_or(|ns| *ns == k.1)
                && filter.labels.matches(v)
                && filter.fields.matches(v)
        });
        // With a label or field selector the real server cannot know how many items remain
        // and leaves remainingItemCount out: one more match is enough to know a page follows.
        let selective = !filter.labels.is_empty() || !filter.fields.is_empty();
        let mut items = Vec::new();
        let mut last: Option<&Key> = None;
        let mut remaining = 0usize;
        for (k, v) in matching {
            if limit.is_some_and(|l| items.len() >= l) {
                remaining += 1;
                if selective {
                    break;
                }
                continue;
            }
            let mut item = (*v).clone();
            if let Some(m) = item.as_object_mut() {
                // Items in a list carry no kind/apiVersion, like the real server's.
                m.remove("kind");
                m.remove("apiVersion");
            }
            items.push(item);
            last = Some(k);
        }
        let continue_token = match (remaining, last) {
            (r, Some(k)) if r > 0 => Some(encode_continue(at, k)),
            _ => None,
        };
        Ok(ListPage {
            rv: at,
            items,
            continue_token,
            remaining: (remaining > 0 && !selective).then_some(remaining),
        })
    }
}
