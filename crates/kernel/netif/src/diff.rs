//! Pure set difference between the desired and current addresses of `kube-ipvs0`.

use std::collections::BTreeSet;
use std::net::IpAddr;

/// Addresses to add to and remove from the dummy link. Both sets are disjoint and sorted.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct AddrDiff {
    /// Addresses desired but not on the link.
    pub add: BTreeSet<IpAddr>,
    /// Addresses on the link but not desired.
    pub remove: BTreeSet<IpAddr>,
}

impl AddrDiff {
    /// True when nothing needs to change.
    pub fn is_empty(&self) -> bool {
        self.add.is_empty() && self.remove.is_empty()
    }

    /// Number of netlink requests applying this diff takes (one per changed address).
    pub fn len(&self) -> usize {
        self.add.len() + self.remove.len()
    }
}

/// What to change so that the link carries exactly `desired`.
pub fn diff_addresses(desired: &BTreeSet<IpAddr>, current: &BTreeSet<IpAddr>) -> AddrDiff {
    AddrDiff {
        add: desired.difference(current).copied().collect(),
        remove: current.difference(desired).copied().collect(),
    }
}

/// The host prefix length VIPs are bound with: /32 for IPv4, /128 for IPv6.
pub fn host_prefix_len(ip: &IpAddr) -> u8 {
    match ip {
        IpAddr::V4(_) => 32,
        IpAddr::V6(_) => 128,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn set(items: &[&str]) -> BTreeSet<IpAddr> {
        items.iter().map(|s| s.parse().unwrap()).collect()
    }

    #[test]
    fn unchanged_sets_need_nothing() {
        let s = set(&["10.96.0.1", "10.96.0.10", "fd00::1"]);
        let d = diff_addresses(&s, &s);
        assert!(d.is_empty());
        assert_eq!(d.len(), 0);
    }

    #[test]
    fn adds_and_removes_only_the_difference() {
        let desired = set(&["10.96.0.1", "10.96.0.2", "fd00::2"]);
        let current = set(&["10.96.0.2", "10.96.0.3", "fd00::1"]);
        let d = diff_addresses(&desired, &current);
        assert_eq!(d.add, set(&["10.96.0.1", "fd00::2"]));
        assert_eq!(d.remove, set(&["10.96.0.3", "fd00::1"]));
        assert_eq!(d.len(), 4);
        // Applying the diff to `current` yields `desired`.
        let mut applied = current.clone();
        applied.retain(|a| !d.remove.contains(a));
        applied.extend(d.add.iter().copied());
        assert_eq!(applied, desired);
    }

    #[test]
    fn empty_desired_removes_everything() {
        let current = set(&["10.96.0.1", "::1"]);
        let d = diff_addresses(&BTreeSet::new(), &current);
        assert!(d.add.is_empty());
        assert_eq!(d.remove, current);
    }

    #[test]
    fn host_prefixes() {
        assert_eq!(host_prefix_len(&"1.2.3.4".parse().unwrap()), 32);
        assert_eq!(host_prefix_len(&"fd00::1".parse().unwrap()), 128);
    }
}
