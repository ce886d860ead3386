//! Small sorted sets and maps on a vector: for the many collections that nearly always hold
//! one or two elements (the claimants of a VIP or of a virtual server, the slices of a
//! service, the virtual servers of a service), where a `BTreeSet`/`BTreeMap` would allocate a
//! whole eleven-slot node for each. Growth is exact: no spare capacity is kept. A set keeps
//! its one element inline (no allocation at all), which is the common case: at 10,000
//! services that is tens of thousands of allocations fewer.

use smallvec::SmallVec;

/// A set kept as a sorted, deduplicated vector; one element is stored inline.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SortedVec<T>(SmallVec<[T; 1]>);

impl<T> Default for SortedVec<T> {
    fn default() -> Self {
        SortedVec(SmallVec::new())
    }
}

impl<T: Ord> SortedVec<T> {
    /// Adds `v`; false when it was present.
    pub fn insert(&mut self, v: T) -> bool {
        match self.0.binary_search(&v) {
            Ok(_) => false,
            Err(i) => {
                self.0.reserve_exact(1);
                self.0.insert(i, v);
                true
            }
        }
    }

    /// Removes `v`; false when it was absent.
    pub fn remove(&mut self, v: &T) -> bool {
        match self.0.binary_search(v) {
            Ok(i) => {
                self.0.remove(i);
                true
            }
            Err(_) => false,
        }
    }

    /// Whether `v` is present.
    pub fn contains(&self, v: &T) -> bool {
        self.0.binary_search(v).is_ok()
    }

    /// The smallest element.
    pub fn first(&self) -> Option<&T> {
        self.0.first()
    }

    /// The largest element.
    pub fn last(&self) -> Option<&T> {
        self.0.last()
    }

    /// The elements in order.
    pub fn iter(&self) -> std::slice::Iter<'_, T> {
        self.0.iter()
    }

    /// Number of elements.
    pub fn len(&self) -> usize {
        self.0.len()
    }

    /// True when empty.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

impl<T: Ord> SortedVec<T> {
    /// Keeps the elements `f` accepts.
    pub fn retain(&mut self, mut f: impl FnMut(&T) -> bool) {
        self.0.retain(|v| f(v));
    }
}

impl<T: Ord> FromIterator<T> for SortedVec<T> {
    fn from_iter<I: IntoIterator<Item = T>>(iter: I) -> Self {
        let mut v: SmallVec<[T; 1]> = iter.into_iter().collect();
        v.sort();
        v.dedup();
        v.shrink_to_fit();
        SortedVec(v)
    }
}

impl<T: Ord> Extend<T> for SortedVec<T> {
    fn extend<I: IntoIterator<Item = T>>(&mut self, iter: I) {
        for v in iter {
            self.insert(v);
        }
    }
}

impl<T> IntoIterator for SortedVec<T> {
    type Item = T;
    type IntoIter = smallvec::IntoIter<[T; 1]>;
    fn into_iter(self) -> Self::IntoIter {
        self.0.into_iter()
    }
}

impl<'a, T> IntoIterator for &'a SortedVec<T> {
    type Item = &'a T;
    type IntoIter = std::slice::Iter<'a, T>;
    fn into_iter(self) -> Self::IntoIter {
        self.0.iter()
    }
}

/// A map kept as a vector of entries sorted by key (the subset of `BTreeMap`'s API the
/// controller uses).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SortedMap<K, V>(Vec<(K, V)>);

impl<K, V> Default for SortedMap<K, V> {
    fn default() -> Self {
        SortedMap(Vec::new())
    }
}

impl<K: Ord, V> SortedMap<K, V> {
    fn find(&self, k: &K) -> Result<usize, usize> {
        self.0.binary_search_by(|(e, _)| e.cmp(k))
    }

    /// The value of `k`.
    pub fn get(&self, k: &K) -> Option<&V> {
        self.find(k).ok().map(|i| &self.0[i].1)
    }

    /// The value of `k`, mutable.
    pub fn get_mut(&mut self, k: &K) -> Option<&mut V> {
        match self.find(k) {
            Ok(i) => Some(&mut self.0[i].1),
            Err(_) => None,
        }
    }

    /// Whether `k` has a value.
    pub fn contains_key(&self, k: &K) -> bool {
        self.find(k).is_ok()
    }

    /// Sets `k` to `v`; returns the previous value.
    pub fn insert(&mut self, k: K, v: V) -> Option<V> {
        match self.find(&k) {
            Ok(i) => Some(std::mem::replace(&mut self.0[i].1, v)),
            Err(i) => {
                self.0.reserve_exact(1);
                self.0.insert(i, (k, v));
                None
            }
        }
    }

    /// Sets `k` to `v` unless it has a value; returns the value.
    pub fn or_insert(&mut self, k: K, v: V) -> &mut V {
        let i = match self.find(&k) {
            Ok(i) => i,
            Err(i) => {
                self.0.reserve_exact(1);
                self.0.insert(i, (k, v));
                i
            }
        };
        &mut self.0[i].1
    }

    /// Removes `k`; returns its value.
    pub fn remove(&mut self, k: &K) -> Option<V> {
        self.find(k).ok().map(|i| self.0.remove(i).1)
    }

    /// Keeps the entries `f` accepts.
    pub fn retain(&mut self, mut f: impl FnMut(&K, &mut V) -> bool) {
        self.0.retain_mut(|(k, v)| f(k, v));
    }

    /// Adds every entry of `other` (replacing values of the same keys).
    pub fn extend(&mut self, other: impl IntoIterator<Item = (K, V)>) {
        for (k, v) in other {
            self.insert(k, v);
        }
    }
}

impl<K, V> SortedMap<K, V> {
    /// The keys in order.
    pub fn keys(&self) -> impl Iterator<Item = &K> {
        self.0.iter().map(|(k, _)| k)
    }

    /// The values in key order.
    pub fn values(&self) -> impl Iterator<Item = &V> {
        self.0.iter().map(|(_, v)| v)
    }

    /// The entries in key order.
    pub fn iter(&self) -> impl Iterator<Item = (&K, &V)> {
        self.0.iter().map(|(k, v)| (k, v))
    }

    /// Number of entries.
    pub fn len(&self) -> usize {
        self.0.len()
    }

    /// True when empty.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

impl<K: Ord, V> FromIterator<(K, V)> for SortedMap<K, V> {
    fn from_iter<I: IntoIterator<Item = (K, V)>>(iter: I) -> Self {
        SortedMap(sorted_last_wins(iter.into_iter().collect(), |a, b| {
            a.0.cmp(&b.0)
        }))
    }
}

/// `v` sorted by `by` (which compares elements by their keys), one element per key: of
/// elements with equal keys the last one stays (like collecting into a `BTreeMap`); no spare
/// capacity. For map-like vectors whose key is part of the element.
pub fn sorted_last_wins<T>(mut v: Vec<T>, by: impl Fn(&T, &T) -> std::cmp::Ordering) -> Vec<T> {
    // Stable: equal keys keep their order, so the last one comes last.
    v.sort_by(&by);
    let mut out: Vec<T> = Vec::with_capacity(v.len());
    for e in v {
        match out.last_mut() {
            Some(last) if by(last, &e).is_eq() => *last = e,
            _ => out.push(e),
        }
    }
    out.shrink_to_fit();
    out
}

impl<K, V> IntoIterator for SortedMap<K, V> {
    type Item = (K, V);
    type IntoIter = std::vec::IntoIter<(K, V)>;
    fn into_iter(self) -> Self::IntoIter {
        self.0.into_iter()
    }
}

impl<'a, K, V> IntoIterator for &'a SortedMap<K, V> {
    type Item = (&'a K, &'a V);
    type IntoIter = std::iter::Map<std::slice::Iter<'a, (K, V)>, fn(&'a (K, V)) -> (&'a K, &'a V)>;
    fn into_iter(self) -> Self::IntoIter {
        self.0.iter().map(|(k, v)| (k, v))
    }
}

#[cfg(test)]
mod tests {
    use super::{SortedMap, SortedVec};

    #[test]
    fn map_behaves_like_a_btree_map() {
        use std::collections::BTreeMap;
        let ops: [(u8, i32); 8] = [
            (5, 1),
            (1, 2),
            (3, 3),
            (1, 4),
            (9, 5),
            (3, 6),
            (0, 7),
            (9, 8),
        ];
        let mut m = SortedMap::default();
        let mut b = BTreeMap::new();
        for (k, v) in ops {
            assert_eq!(m.insert(k, v), b.insert(k, v));
        }
        assert_eq!(m.iter().collect::<Vec<_>>(), b.iter().collect::<Vec<_>>());
        assert_eq!(m.remove(&3), b.remove(&3));
        assert_eq!(m.remove(&3), None);
        m.retain(|k, _| *k != 9);
        b.retain(|k, _| *k != 9);
        *m.or_insert(4, 0) += 10;
        *b.entry(4).or_insert(0) += 10;
        assert_eq!(m.keys().collect::<Vec<_>>(), b.keys().collect::<Vec<_>>());
        assert_eq!(
            m.values().collect::<Vec<_>>(),
            b.values().collect::<Vec<_>>()
        );
        assert_eq!(m.get(&1), b.get(&1));
        assert!(m.contains_key(&5) && !m.contains_key(&9));
        let c: SortedMap<u8, i32> = ops.into_iter().collect();
        let d: BTreeMap<u8, i32> = ops.into_iter().collect();
        assert_eq!(
            c.into_iter().collect::<Vec<_>>(),
            d.into_iter().collect::<Vec<_>>()
        );
    }

    #[test]
    fn stays_sorted_and_deduplicated() {
        let mut s = SortedVec::default();
        for v in [5, 1, 3, 1, 5, 2] {
            s.insert(v);
        }
        assert_eq!(s.iter().copied().collect::<Vec<_>>(), [1, 2, 3, 5]);
        assert!(!s.insert(3));
        assert!(s.remove(&1));
        assert!(!s.remove(&1));
        assert_eq!(s.first(), Some(&2));
        assert!(s.contains(&5) && !s.contains(&4));
        assert_eq!(s.len(), 3);
        for v in [2, 3, 5] {
            s.remove(&v);
        }
        assert!(s.is_empty());
    }

    #[test]
    fn one_element_is_inline_and_more_spill_exactly() {
        // smallvec's `union` layout: no tag beside the inline element and the capacity (a
        // `SortedVec` is a hash-table value in several large tables).
        assert_eq!(std::mem::size_of::<SortedVec<u64>>(), 24);
        assert_eq!(std::mem::size_of::<SortedVec<std::sync::Arc<str>>>(), 24);
        let mut s = SortedVec::default();
        s.insert(7u64);
        assert!(!s.0.spilled());
        s.insert(3);
        assert!(s.0.spilled());
        assert_eq!(s.0.capacity(), 2);
        assert_eq!(s.iter().copied().collect::<Vec<_>>(), [3, 7]);
        let c: SortedVec<u64> = [9, 9].into_iter().collect();
        assert!(!c.0.spilled());
        assert_eq!(c.into_iter().collect::<Vec<_>>(), [9]);
    }
}
