//! The real servers of one virtual server: a vector sorted by (address, port) with the map
//! operations the diff, the proxier and the fake kernel use.
//!
//! Why not a `BTreeMap<(IpAddr, u16), Destination>`: at 10,000 services x 10 real servers the
//! B-tree's nodes (each sized for 11 entries, the 20-byte key stored beside every value) cost
//! ~940 bytes per virtual server against ~640 for the destinations alone (issue #18); lookups
//! are a binary search over at most a few hundred entries either way. The key is the
//! destination's own `addr` and `port`, so keys are returned by value.

use std::net::IpAddr;

use ipvs_netlink::Destination;
use model::sorted::sorted_last_wins;

/// A real server's key: its address and port.
pub type RealServerKey = (IpAddr, u16);

fn key_of(d: &Destination) -> RealServerKey {
    (d.addr, d.port)
}

/// Real servers by (address, port), in key order.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RealServers(Vec<Destination>);

impl RealServers {
    /// No real servers.
    pub fn new() -> RealServers {
        RealServers(Vec::new())
    }

    fn find(&self, k: &RealServerKey) -> Result<usize, usize> {
        self.0.binary_search_by(|d| key_of(d).cmp(k))
    }

    /// The real server at `k`.
    pub fn get(&self, k: &RealServerKey) -> Option<&Destination> {
        self.find(k).ok().map(|i| &self.0[i])
    }

    /// The real server at `k`, to change anything but its address and port.
    pub fn get_mut(&mut self, k: &RealServerKey) -> Option<&mut Destination> {
        self.find(k).ok().map(|i| &mut self.0[i])
    }

    /// True when there is a real server at `k`.
    pub fn contains_key(&self, k: &RealServerKey) -> bool {
        self.find(k).is_ok()
    }

    /// Stores `d` at `k` (which must be `d`'s address and port), returning the one it replaced.
    /// The key is taken from `d`; `k` is the map-like spelling callers already have.
    pub fn insert(&mut self, k: RealServerKey, d: Destination) -> Option<Destination> {
        debug_assert_eq!(k, key_of(&d), "a real server's key is its address and port");
        match self.find(&key_of(&d)) {
            Ok(i) => Some(std::mem::replace(&mut self.0[i], d)),
            Err(i) => {
                self.0.insert(i, d);
                None
            }
        }
    }

    /// Removes the real server at `k`.
    pub fn remove(&mut self, k: &RealServerKey) -> Option<Destination> {
        self.find(k).ok().map(|i| self.0.remove(i))
    }

    /// Keys in order.
    pub fn keys(&self) -> impl Iterator<Item = RealServerKey> + '_ {
        self.0.iter().map(key_of)
    }

    /// Real servers in key order.
    pub fn values(&self) -> std::slice::Iter<'_, Destination> {
        self.0.iter()
    }

    /// Real servers in key order, to change anything but their addresses and ports.
    pub fn values_mut(&mut self) -> std::slice::IterMut<'_, Destination> {
        self.0.iter_mut()
    }

    /// (key, real server) in key order.
    pub fn iter(&self) -> impl Iterator<Item = (RealServerKey, &Destination)> + '_ {
        self.0.iter().map(|d| (key_of(d), d))
    }

    /// The real servers, in key order.
    pub fn into_values(self) -> std::vec::IntoIter<Destination> {
        self.0.into_iter()
    }

    /// Number of real servers.
    pub fn len(&self) -> usize {
        self.0.len()
    }

    /// True when there are none.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

impl FromIterator<Destination> for RealServers {
    /// Keyed by address and port; of several with the same key the last one stays (like
    /// collecting into a map).
    fn from_iter<I: IntoIterator<Item = Destination>>(iter: I) -> RealServers {
        RealServers(sorted_last_wins(iter.into_iter().collect(), |a, b| {
            key_of(a).cmp(&key_of(b))
        }))
    }
}

impl FromIterator<(RealServerKey, Destination)> for RealServers {
    fn from_iter<I: IntoIterator<Item = (RealServerKey, Destination)>>(iter: I) -> RealServers {
        iter.into_iter().map(|(_, d)| d).collect()
    }
}

impl<'a> IntoIterator for &'a RealServers {
    type Item = (RealServerKey, &'a Destination);
    type IntoIter = std::iter::Map<std::slice::Iter<'a, Destination>, KeyAndValue>;

    fn into_iter(self) -> Self::IntoIter {
        self.0.iter().map(key_and_value)
    }
}

/// The function `&RealServers`'s iterator maps with.
type KeyAndValue = for<'d> fn(&'d Destination) -> (RealServerKey, &'d Destination);

fn key_and_value(d: &Destination) -> (RealServerKey, &Destination) {
    (key_of(d), d)
}

/// Indexing like a map's, for tests and tools: the daemon uses [`RealServers::get`].
impl std::ops::Index<&RealServerKey> for RealServers {
    type Output = Destination;

    /// # Panics
    /// When there is no real server at `k` (like `BTreeMap`'s index).
    #[allow(clippy::panic)]
    fn index(&self, k: &RealServerKey) -> &Destination {
        match self.get(k) {
            Some(d) => d,
            None => panic!("no real server at that address and port"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn d(ip: &str, port: u16, weight: u32) -> Destination {
        let mut d = Destination::new(ip.parse().unwrap(), port);
        d.weight = weight;
        d
    }

    #[test]
    fn behaves_like_a_map_keyed_by_address_and_port() {
        let mut rs: RealServers = [
            d("10.0.0.2", 80, 1),
            d("10.0.0.1", 81, 1),
            d("10.0.0.1", 80, 1),
        ]
        .into_iter()
        .collect();
        let keys: Vec<RealServerKey> = rs.keys().collect();
        let want: Vec<RealServerKey> = vec![
            ("10.0.0.1".parse().unwrap(), 80),
            ("10.0.0.1".parse().unwrap(), 81),
            ("10.0.0.2".parse().unwrap(), 80),
        ];
        assert_eq!(keys, want);
        assert_eq!(rs[&want[1]].port, 81);
        assert!(rs.contains_key(&want[2]));
        assert!(!rs.contains_key(&("10.0.0.3".parse().unwrap(), 80)));

        let old = rs.insert(want[0], d("10.0.0.1", 80, 0));
        assert_eq!(old.map(|o| o.weight), Some(1));
        assert_eq!(rs.get(&want[0]).map(|d| d.weight), Some(0));
        assert_eq!(rs.len(), 3);

        assert!(rs
            .insert(("10.0.0.0".parse().unwrap(), 1), d("10.0.0.0", 1, 1))
            .is_none());
        assert_eq!(rs.keys().next(), Some(("10.0.0.0".parse().unwrap(), 1)));
        assert_eq!(rs.remove(&want[2]).map(|d| d.port), Some(80));
        assert!(rs.remove(&want[2]).is_none());
        assert_eq!(rs.len(), 3);
        if let Some(x) = rs.get_mut(&want[1]) {
            x.weight = 7;
        }
        let pairs: Vec<(RealServerKey, u32)> =
            (&rs).into_iter().map(|(k, d)| (k, d.weight)).collect();
        assert_eq!(
            pairs,
            vec![
                (("10.0.0.0".parse().unwrap(), 1), 1),
                (want[0], 0),
                (want[1], 7)
            ]
        );
    }

    #[test]
    fn collecting_keeps_the_last_of_equal_keys() {
        let rs: RealServers = [d("10.0.0.1", 80, 1), d("10.0.0.1", 80, 5)]
            .into_iter()
            .collect();
        assert_eq!(rs.len(), 1);
        assert_eq!(rs.values().next().map(|d| d.weight), Some(5));
        let same: RealServers = [(("10.0.0.1".parse().unwrap(), 80), d("10.0.0.1", 80, 5))]
            .into_iter()
            .collect();
        assert_eq!(rs, same);
    }
}
