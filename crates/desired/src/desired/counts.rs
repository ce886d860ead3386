//! Reference counts of the node's ipset members, keyed compactly.
//!
//! At 10,000 services x 10 endpoints the node holds ~53,000 members; in a
//! `HashMap<IpsetEntry, usize>` each took a 56-byte slot (a 42-byte entry, built for the widest
//! member type, and a count), 3.7 MB in all (issue #18). Nearly every member is an address
//! (`hash:ip`), an address with a port (`hash:ip,port`) or a hairpin member (`hash:ip,port,ip`
//! with both addresses equal): those are keyed by a 22-byte [`Short`] (28-byte slots), the
//! rest by the whole entry.

use std::collections::HashMap;
use std::net::IpAddr;

use ipset::{Entry, Protocol, SetKind};

use crate::types::IpsetEntry;

/// Which of the common member shapes a [`Short`] is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
enum Shape {
    /// `Entry::Ip(ip)` (protocol and port unused).
    Ip,
    /// `Entry::IpPort { ip, proto, port }`.
    IpPort,
    /// `Entry::IpPortIp { ip, proto, port, ip2: ip }`.
    Hairpin,
}

/// A member of one of the common shapes, in 22 bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
struct Short {
    set: SetKind,
    shape: Shape,
    ip: IpAddr,
    proto: Protocol,
    port: u16,
}

impl Short {
    /// The short form of `e`, if it has one (converting back gives `e` exactly).
    fn of(e: &IpsetEntry) -> Option<Short> {
        let (shape, ip, proto, port) = match e.entry {
            Entry::Ip(ip) => (Shape::Ip, ip, Protocol::Tcp, 0),
            Entry::IpPort { ip, proto, port } => (Shape::IpPort, ip, proto, port),
            Entry::IpPortIp {
                ip,
                proto,
                port,
                ip2,
            } if ip2 == ip => (Shape::Hairpin, ip, proto, port),
            _ => return None,
        };
        Some(Short {
            set: e.set,
            shape,
            ip,
            proto,
            port,
        })
    }

    fn entry(&self) -> IpsetEntry {
        let entry = match self.shape {
            Shape::Ip => Entry::Ip(self.ip),
            Shape::IpPort => Entry::ip_port(self.ip, self.proto, self.port),
            Shape::Hairpin => Entry::ip_port_ip(self.ip, self.proto, self.port, self.ip),
        };
        IpsetEntry {
            set: self.set,
            entry,
        }
    }
}

/// How many services hold each ipset member, and how many members each set has.
#[derive(Debug, Clone, Default)]
pub(super) struct EntryCounts {
    short: HashMap<Short, u32>,
    other: HashMap<IpsetEntry, u32>,
    /// Members per set, by `SetKind as usize`.
    sizes: [usize; SetKind::ALL.len()],
}

impl EntryCounts {
    /// True when some service holds `e`.
    pub(super) fn contains(&self, e: &IpsetEntry) -> bool {
        self.holders(e) > 0
    }

    /// How many services hold `e`.
    pub(super) fn holders(&self, e: &IpsetEntry) -> u32 {
        match Short::of(e) {
            Some(s) => self.short.get(&s).copied(),
            None => self.other.get(e).copied(),
        }
        .unwrap_or(0)
    }

    /// Members of `set`.
    pub(super) fn size(&self, set: SetKind) -> usize {
        self.sizes[set as usize]
    }

    /// One more holder of `e`.
    pub(super) fn acquire(&mut self, e: &IpsetEntry) {
        let c = match Short::of(e) {
            Some(s) => self.short.entry(s).or_insert(0),
            None => self.other.entry(e.clone()).or_insert(0),
        };
        if *c == 0 {
            self.sizes[e.set as usize] += 1;
        }
        *c = c.saturating_add(1);
    }

    /// One holder of `e` fewer (the member goes with its last holder).
    pub(super) fn release(&mut self, e: &IpsetEntry) {
        let gone = match Short::of(e) {
            Some(s) => release(&mut self.short, &s),
            None => release(&mut self.other, e),
        };
        if gone {
            let n = &mut self.sizes[e.set as usize];
            *n = n.saturating_sub(1);
        }
    }

    /// Every member held, in no particular order.
    pub(super) fn entries(&self) -> impl Iterator<Item = IpsetEntry> + '_ {
        (self.short.keys().map(Short::entry)).chain(self.other.keys().cloned())
    }
}

/// One holder of `k` fewer; true when that was its last holder (it is gone).
fn release<K: std::hash::Hash + Eq>(counts: &mut HashMap<K, u32>, k: &K) -> bool {
    if let Some(c) = counts.get_mut(k) {
        *c = c.saturating_sub(1);
        if *c == 0 {
            counts.remove(k);
            return true;
        }
    }
    false
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap()
    }

    fn members() -> Vec<IpsetEntry> {
        let (a, b) = (ip("10.0.0.1"), ip("fd00::2"));
        let net = "10.1.0.0/16".parse().unwrap();
        [
            (SetKind::IpvsIps, Entry::Ip(a)),
            (SetKind::IpvsIps, Entry::Ip(b)),
            (SetKind::ClusterIp, Entry::ip_port(a, Protocol::Tcp, 80)),
            (SetKind::ExternalIp, Entry::ip_port(a, Protocol::Tcp, 80)),
            (SetKind::ClusterIp, Entry::ip_port(b, Protocol::Sctp, 0)),
            (
                SetKind::LoopBack,
                Entry::ip_port_ip(a, Protocol::Udp, 53, a),
            ),
            // Not short: different second address, a network, a bare port.
            (
                SetKind::LoopBack,
                Entry::ip_port_ip(a, Protocol::Udp, 53, b),
            ),
            (
                SetKind::LoadBalancerSourceCidr,
                Entry::ip_port_net(a, Protocol::Tcp, 80, net),
            ),
            (SetKind::NodePortTcp, Entry::Port(30080)),
        ]
        .into_iter()
        .map(|(set, entry)| IpsetEntry { set, entry })
        .collect()
    }

    #[test]
    fn short_members_round_trip_and_others_are_kept_whole() {
        assert!(std::mem::size_of::<(Short, u32)>() <= 28);
        for e in members() {
            if let Some(s) = Short::of(&e) {
                assert_eq!(s.entry(), e);
            }
        }
        let short = members().iter().filter_map(Short::of).count();
        assert_eq!(short, 6);
    }

    #[test]
    fn counts_each_member_until_its_last_holder_releases_it() {
        let mut c = EntryCounts::default();
        let all = members();
        for e in all.iter().chain(all.iter()) {
            c.acquire(e);
        }
        assert_eq!(c.size(SetKind::LoopBack), 2, "each member once");
        assert_eq!(c.size(SetKind::IpvsIps), 2);
        assert_eq!(c.holders(&all[0]), 2);
        let mut held: Vec<IpsetEntry> = c.entries().collect();
        held.sort();
        let mut want = all.clone();
        want.sort();
        assert_eq!(held, want);
        for e in &all {
            c.release(e);
            assert!(c.contains(e), "{e:?} has a second holder");
        }
        for e in &all {
            c.release(e);
            assert!(!c.contains(e), "{e:?} released by both holders");
            c.release(e); // releasing an absent member is harmless
        }
        assert_eq!(c.entries().count(), 0);
        assert!(SetKind::ALL.iter().all(|k| c.size(*k) == 0));
    }
}
