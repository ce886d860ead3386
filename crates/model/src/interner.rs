//! Interning for the compact objects: each distinct name, and each distinct endpoint
//! placement, is one allocation however many objects carry it. Bounded by what is in use.

use std::collections::HashSet;
use std::sync::Arc;

use crate::objects::Placement;

/// Interned strings (node and zone names): one allocation per distinct name however many
/// endpoints carry it. Bounded by what is in use: [`Interner::prune`] drops names nobody
/// holds any more, and the store calls it as the table grows.
#[derive(Debug, Default, Clone)]
pub struct Interner {
    names: HashSet<Arc<str>>,
    /// Size after the last prune.
    pruned_at: usize,
    /// Endpoint placements (their names are in `names`).
    placements: HashSet<Arc<Placement>>,
    /// Size of `placements` after its last prune.
    placements_pruned_at: usize,
}

impl Interner {
    /// Replaces `a` by the shared copy of its text; a text not held yet is held as `a` itself
    /// (no copy).
    pub fn share(&mut self, a: &mut Arc<str>) {
        match self.names.get(&**a) {
            Some(held) => *a = held.clone(),
            None => self.hold(a.clone()),
        }
    }

    /// [`Interner::share`] for an optional string.
    pub fn share_opt(&mut self, a: &mut Option<Arc<str>>) {
        if let Some(a) = a.as_mut() {
            self.share(a);
        }
    }

    /// The shared copy of `s`.
    pub fn intern(&mut self, s: &str) -> Arc<str> {
        if let Some(a) = self.names.get(s) {
            return a.clone();
        }
        let a: Arc<str> = Arc::from(s);
        self.hold(a.clone());
        a
    }

    /// Adds a text not held yet, pruning first when the table has doubled since the last prune.
    fn hold(&mut self, a: Arc<str>) {
        if self.names.len() >= 2 * self.pruned_at.max(512) {
            self.prune();
        }
        self.names.insert(a);
    }

    /// Drops the names and placements only the interner holds.
    pub fn prune(&mut self) {
        // Placements first: they hold names.
        self.placements.retain(|p| Arc::strong_count(p) > 1);
        self.placements_pruned_at = self.placements.len();
        self.names.retain(|a| Arc::strong_count(a) > 1);
        self.pruned_at = self.names.len();
    }

    /// The shared placement equal to `p` (whose names are already interned here).
    pub fn placement(&mut self, p: Placement) -> Arc<Placement> {
        if let Some(held) = self.placements.get(&p) {
            return held.clone();
        }
        let p = Arc::new(p);
        self.hold_placement(p.clone());
        p
    }

    /// Replaces `p` by the shared placement equal to it; one not held yet is held as `p` itself,
    /// its names replaced by their shared copies first.
    pub fn share_placement(&mut self, p: &mut Arc<Placement>) {
        if let Some(held) = self.placements.get(&**p) {
            *p = held.clone();
            return;
        }
        let inner = Arc::make_mut(p);
        self.share_opt(&mut inner.node_name);
        if let Some(h) = inner.hints.as_mut() {
            for n in h.zones.iter_mut().chain(h.nodes.iter_mut()).flatten() {
                self.share(n);
            }
        }
        self.hold_placement(p.clone());
    }

    /// Adds a placement not held yet, pruning first when the table has doubled since its last
    /// prune.
    fn hold_placement(&mut self, p: Arc<Placement>) {
        if self.placements.len() >= 2 * self.placements_pruned_at.max(512) {
            self.prune();
        }
        self.placements.insert(p);
    }

    /// Distinct names held.
    pub fn len(&self) -> usize {
        self.names.len()
    }

    /// Distinct endpoint placements held.
    pub fn placements(&self) -> usize {
        self.placements.len()
    }

    /// True when no name is held.
    pub fn is_empty(&self) -> bool {
        self.names.is_empty()
    }
}
