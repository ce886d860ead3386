//! The real servers of one virtual server: a vector sorted by (address, port) with the map
//! operations the diff, the proxier and the fake kernel use.
//!
//! Why not a `BTreeMap<(IpAddr, u16), Destination>`: at 10,000 services x 10 real servers the
//! B-tree's nodes (each sized for 11 entries, the 20-byte key stored beside every value) cost
//! ~940 bytes per virtual server against ~640 for the destinations alone (issue #18); lookups
//! are a binary search over at most a few hundred entries either way.
//!
//! Why not a vector of [`Destination`]s: a `Destination` is 64 bytes (thresholds, tunnel
//! settings, the kernel's connection counts and a counter box), while the real servers the
//! proxy derives set only address, port, forwarding method and weight. Those are stored in 24
//! bytes; any other real server (one read from the kernel with connections, a tunnel, a
//! threshold) is stored whole in a box. At 10,000 x 10 that is ~2.4 MB instead of 6.4 MB of a
//! desired state (issue #18). Real servers are therefore handed out by value
//! ([`RealServers::get`], [`RealServers::values`]) and changed through a guard
//! ([`RealServers::get_mut`]) that stores the result back when dropped.

use std::net::IpAddr;
use std::ops::{Deref, DerefMut};

use ipvs_netlink::{Destination, ForwardMethod, TunnelType};
use model::sorted::sorted_last_wins;

/// A real server's key: its address and port.
pub type RealServerKey = (IpAddr, u16);

/// One stored real server: compact when only the attributes the proxy sets differ from
/// [`Destination::new`]'s, else the whole destination. Always the compact form when it can be
/// (so equal destinations are stored equally and the derived equality is the destinations').
#[derive(Debug, Clone, PartialEq, Eq)]
enum Stored {
    /// Address, port, forwarding method and weight; everything else as [`Destination::new`].
    Plain {
        addr: IpAddr,
        port: u16,
        fwd: ForwardMethod,
        weight: u32,
    },
    /// Any other real server.
    Full(Box<Destination>),
}

impl Stored {
    fn of(d: Destination) -> Stored {
        let plain = d.upper_threshold == 0
            && d.lower_threshold == 0
            && d.tun_type == TunnelType::default()
            && d.tun_port == 0
            && d.tun_flags == 0
            && d.active_conns == 0
            && d.inactive_conns == 0
            && d.persist_conns == 0
            && d.stats.is_none();
        if plain {
            Stored::Plain {
                addr: d.addr,
                port: d.port,
                fwd: d.fwd,
                weight: d.weight,
            }
        } else {
            Stored::Full(Box::new(d))
        }
    }

    fn key(&self) -> RealServerKey {
        match self {
            Stored::Plain { addr, port, .. } => (*addr, *port),
            Stored::Full(d) => (d.addr, d.port),
        }
    }

    fn load(&self) -> Destination {
        match self {
            Stored::Plain {
                addr,
                port,
                fwd,
                weight,
            } => {
                let mut d = Destination::new(*addr, *port);
                d.fwd = *fwd;
                d.weight = *weight;
                d
            }
            Stored::Full(d) => (**d).clone(),
        }
    }

    fn into_destination(self) -> Destination {
        match self {
            Stored::Full(d) => *d,
            plain => plain.load(),
        }
    }
}

/// Real servers by (address, port), in key order.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RealServers(Vec<Stored>);

/// A real server being changed: derefs to a copy of it, stored back (compacted again) when the
/// guard is dropped. Its address and port stay those it was found at (a change to them is
/// ignored: they are its key).
#[derive(Debug)]
pub struct RealServerMut<'a> {
    slot: &'a mut Stored,
    d: Destination,
}

impl<'a> RealServerMut<'a> {
    fn new(slot: &'a mut Stored) -> RealServerMut<'a> {
        let d = slot.load();
        RealServerMut { slot, d }
    }
}

impl Deref for RealServerMut<'_> {
    type Target = Destination;
    fn deref(&self) -> &Destination {
        &self.d
    }
}

impl DerefMut for RealServerMut<'_> {
    fn deref_mut(&mut self) -> &mut Destination {
        &mut self.d
    }
}

impl Drop for RealServerMut<'_> {
    fn drop(&mut self) {
        let (addr, port) = self.slot.key();
        let mut d = std::mem::replace(&mut self.d, Destination::new(addr, port));
        d.addr = addr;
        d.port = port;
        *self.slot = Stored::of(d);
    }
}

impl RealServers {
    /// No real servers.
    pub fn new() -> RealServers {
        RealServers(Vec::new())
    }

    fn find(&self, k: &RealServerKey) -> Result<usize, usize> {
        self.0.binary_search_by(|d| d.key().cmp(k))
    }

    /// The real server at `k`.
    pub fn get(&self, k: &RealServerKey) -> Option<Destination> {
        self.find(k).ok().map(|i| self.0[i].load())
    }

    /// The real server at `k`, to change anything but its address and port.
    pub fn get_mut(&mut self, k: &RealServerKey) -> Option<RealServerMut<'_>> {
        let i = self.find(k).ok()?;
        self.0.get_mut(i).map(RealServerMut::new)
    }

    /// True when there is a real server at `k`.
    pub fn contains_key(&self, k: &RealServerKey) -> bool {
        self.find(k).is_ok()
    }

    /// Stores `d` at `k` (which must be `d`'s address and port), returning the one it replaced.
    /// The key is taken from `d`; `k` is the map-like spelling callers already have.
    pub fn insert(&mut self, k: RealServerKey, d: Destination) -> Option<Destination> {
        debug_assert_eq!(
            k,
            (d.addr, d.port),
            "a real server's key is its address and port"
        );
        match self.find(&(d.addr, d.port)) {
            Ok(i) => Some(std::mem::replace(&mut self.0[i], Stored::of(d)).into_destination()),
            Err(i) => {
                self.0.insert(i, Stored::of(d));
                None
            }
        }
    }

    /// Removes the real server at `k`.
    pub fn remove(&mut self, k: &RealServerKey) -> Option<Destination> {
        self.find(k)
            .ok()
            .map(|i| self.0.remove(i).into_destination())
    }

    /// Keys in order.
    pub fn keys(&self) -> impl Iterator<Item = RealServerKey> + '_ {
        self.0.iter().map(Stored::key)
    }

    /// Real servers in key order.
    pub fn values(&self) -> impl ExactSizeIterator<Item = Destination> + '_ {
        self.0.iter().map(Stored::load)
    }

    /// Real servers in key order, to change anything but their addresses and ports.
    pub fn values_mut(&mut self) -> impl ExactSizeIterator<Item = RealServerMut<'_>> + '_ {
        self.0.iter_mut().map(RealServerMut::new)
    }

    /// (key, real server) in key order.
    pub fn iter(&self) -> RealServersIter<'_> {
        RealServersIter(self.0.iter())
    }

    /// The real servers, in key order.
    pub fn into_values(self) -> impl ExactSizeIterator<Item = Destination> {
        self.0.into_iter().map(Stored::into_destination)
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
        let stored = iter.into_iter().map(Stored::of).collect();
        RealServers(sorted_last_wins(stored, |a, b| a.key().cmp(&b.key())))
    }
}

impl FromIterator<(RealServerKey, Destination)> for RealServers {
    fn from_iter<I: IntoIterator<Item = (RealServerKey, Destination)>>(iter: I) -> RealServers {
        iter.into_iter().map(|(_, d)| d).collect()
    }
}

impl<'a> IntoIterator for &'a RealServers {
    type Item = (RealServerKey, Destination);
    type IntoIter = RealServersIter<'a>;

    fn into_iter(self) -> RealServersIter<'a> {
        RealServersIter(self.0.iter())
    }
}

/// (key, real server) of a [`RealServers`] in key order.
#[derive(Debug, Clone)]
pub struct RealServersIter<'a>(std::slice::Iter<'a, Stored>);

impl Iterator for RealServersIter<'_> {
    type Item = (RealServerKey, Destination);

    fn next(&mut self) -> Option<Self::Item> {
        self.0.next().map(key_and_value)
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        self.0.size_hint()
    }
}

impl ExactSizeIterator for RealServersIter<'_> {}

fn key_and_value(d: &Stored) -> (RealServerKey, Destination) {
    (d.key(), d.load())
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
        assert_eq!(rs.get(&want[1]).map(|d| d.port), Some(81));
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
        if let Some(mut x) = rs.get_mut(&want[1]) {
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

    #[test]
    fn stores_derived_real_servers_compactly_and_others_whole() {
        // The proxy's own real servers (any weight or forwarding method) take 24-32 bytes
        // instead of a 64-byte Destination; anything else round-trips whole.
        assert!(std::mem::size_of::<Stored>() <= 32);
        assert!(std::mem::size_of::<Stored>() < std::mem::size_of::<Destination>());
        let plain = d("10.0.0.1", 80, 0);
        let mut tunnel = d("10.0.0.2", 80, 1);
        tunnel.fwd = ForwardMethod::Tunnel;
        tunnel.tun_type = TunnelType::Gue;
        tunnel.tun_port = 6080;
        let mut busy = d("10.0.0.3", 80, 1);
        busy.active_conns = 4;
        busy.stats = Some(Box::default());
        let rs: RealServers = [plain.clone(), tunnel.clone(), busy.clone()]
            .into_iter()
            .collect();
        assert!(matches!(rs.0[0], Stored::Plain { weight: 0, .. }));
        assert!(matches!(rs.0[1], Stored::Full(_)));
        assert!(matches!(rs.0[2], Stored::Full(_)));
        assert_eq!(rs.values().collect::<Vec<_>>(), vec![plain, tunnel, busy]);
    }

    #[test]
    fn a_change_through_the_guard_is_stored_back_compacted() {
        let k: RealServerKey = ("10.0.0.3".parse().unwrap(), 80);
        let mut busy = d("10.0.0.3", 80, 1);
        busy.active_conns = 4;
        let mut rs: RealServers = [busy].into_iter().collect();
        if let Some(mut g) = rs.get_mut(&k) {
            assert_eq!(g.active_conns, 4);
            g.active_conns = 0;
            g.weight = 0;
            g.port = 81; // the key: ignored
        }
        assert_eq!(rs.keys().collect::<Vec<_>>(), vec![k]);
        assert_eq!(rs.get(&k), Some(d("10.0.0.3", 80, 0)));
        assert!(matches!(rs.0[0], Stored::Plain { weight: 0, .. }));
        // Equal destinations are stored equally, whichever way they came in.
        let same: RealServers = [d("10.0.0.3", 80, 0)].into_iter().collect();
        assert_eq!(rs, same);
        for mut g in rs.values_mut() {
            g.upper_threshold = 10;
        }
        assert!(matches!(rs.0[0], Stored::Full(_)));
        assert_eq!(rs.get(&k).map(|d| d.upper_threshold), Some(10));
        assert_eq!(rs.remove(&k).map(|d| d.upper_threshold), Some(10));
        assert!(rs.is_empty());
    }
}
