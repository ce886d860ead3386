//! Rejected objects remembered so each reason is logged and counted once ([`Rejections`]).

use crate::names::{Invalid, IGNORED_PREFIX};
use std::collections::{BTreeSet, HashMap};

/// Remembers rejected objects so each reason is logged once and counted once.
///
/// Rejections of objects that belong to another one (EndpointSlices of a Service) are recorded
/// per owner with [`Rejections::replace_owned`], so a slice that is fixed or deleted is cleared
/// when its Service is next derived, and every slice of a deleted Service is cleared with it
/// ([`Rejections::clear_owned`]): the map holds only objects rejected now, so it is bounded by
/// the objects in the store, and each reason by [`crate::MAX_REASON_BYTES`].
#[derive(Debug, Default, Clone)]
pub struct Rejections {
    current: HashMap<String, Invalid>,
    total: u64,
    fresh: Vec<(String, Invalid)>,
    /// Owner key → keys it rejected last time it was derived.
    owned: HashMap<String, BTreeSet<String>>,
    /// Owned key → its owner (a slice relabelled to another Service changes owner).
    owner_of: HashMap<String, String>,
}

impl Rejections {
    /// Records that `key` (e.g. `service ns/name`, `slice ns/name`) is rejected for `why`.
    /// Returns true (and counts it) when this is new or the reason changed: log it then.
    pub fn reject(&mut self, key: &str, why: &Invalid) -> bool {
        if self.current.get(key) == Some(why) {
            return false;
        }
        self.current.insert(key.to_string(), why.clone());
        self.total += 1;
        self.fresh.push((key.to_string(), why.clone()));
        if why.reason.starts_with(IGNORED_PREFIX) {
            tracing::warn!(object = key, reason = %why, "using object without its invalid values");
        } else {
            tracing::warn!(object = key, reason = %why, "skipping invalid object");
        }
        true
    }

    /// Records that `key` is valid again (or deleted).
    pub fn clear(&mut self, key: &str) {
        self.current.remove(key);
    }

    /// Replaces the rejections owned by `owner` (e.g. `service ns/name`) with `rejected`
    /// (e.g. its EndpointSlices skipped by this derivation): keys it rejected before and not
    /// now are cleared (the slice was fixed, deleted, or moved to another Service), new ones
    /// are recorded like [`Rejections::reject`].
    pub fn replace_owned(&mut self, owner: &str, rejected: &[(String, Invalid)]) {
        let now: BTreeSet<String> = rejected.iter().map(|(k, _)| k.clone()).collect();
        let before = self.owned.remove(owner).unwrap_or_default();
        for k in before.difference(&now) {
            // Another owner may have taken the key over since (a relabelled slice).
            if self.owner_of.get(k).map(String::as_str) == Some(owner) {
                self.owner_of.remove(k);
                self.current.remove(k);
            }
        }
        for (k, why) in rejected {
            self.owner_of.insert(k.clone(), owner.to_string());
            self.reject(k, why);
        }
        if !now.is_empty() {
            self.owned.insert(owner.to_string(), now);
        }
    }

    /// [`Rejections::replace_owned`] for a Service's EndpointSlices skipped by a derivation,
    /// given by name: each is keyed `endpointslice NAMESPACE/NAME`, the form Events and logs
    /// name them by (both proxy modes record them this way).
    pub fn replace_slices(&mut self, owner: &str, namespace: &str, slices: &[(String, Invalid)]) {
        let keyed: Vec<(String, Invalid)> = slices
            .iter()
            .map(|(slice, why)| (format!("endpointslice {namespace}/{slice}"), why.clone()))
            .collect();
        // Slices fixed or deleted since the last derivation are cleared.
        self.replace_owned(owner, &keyed);
    }

    /// Clears every rejection owned by `owner` (the owner was deleted).
    pub fn clear_owned(&mut self, owner: &str) {
        self.replace_owned(owner, &[]);
    }

    /// Objects tracked as owned by another (memory bound checks).
    pub fn owned_len(&self) -> usize {
        self.owner_of.len()
    }

    /// Objects currently rejected.
    pub fn current(&self) -> usize {
        self.current.len()
    }

    /// Rejections counted since start (a metric).
    pub fn total(&self) -> u64 {
        self.total
    }

    /// The current reason for `key`, if rejected.
    pub fn reason(&self, key: &str) -> Option<&Invalid> {
        self.current.get(key)
    }

    /// The `(key, reason)` pairs newly rejected (logged) since the last call, oldest first: for
    /// metrics and Kubernetes Events, so each rejection is reported once.
    pub fn take_new(&mut self) -> Vec<(String, Invalid)> {
        std::mem::take(&mut self.fresh)
    }
}
