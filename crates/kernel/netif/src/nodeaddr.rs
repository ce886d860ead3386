//! The node's local addresses as plain data, the events that change them, and the
//! `nodePortAddresses` selection (pure; the rtnetlink IO lives in `monitor`).

use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;

use ipnet::IpNet;
use netlink_packet_route::address::{AddressAttribute, AddressMessage};
use netlink_packet_route::link::{LinkAttribute, LinkMessage};
use netlink_packet_route::RouteNetlinkMessage;

use crate::{Error, DUMMY_LINK};

/// One link and the addresses configured on it.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct LinkAddrs {
    /// Interface name (empty until a link message named it).
    pub name: String,
    /// Addresses with their prefix lengths.
    pub addrs: BTreeSet<IpNet>,
}

/// A change to the node's links or addresses, decoded from one rtnetlink message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum AddrEvent {
    /// A link appeared or changed (RTM_NEWLINK).
    NewLink {
        /// Interface index.
        index: u32,
        /// Interface name.
        name: String,
    },
    /// A link was deleted (RTM_DELLINK).
    DelLink {
        /// Interface index.
        index: u32,
        /// Interface name, when the message carried it.
        name: Option<String>,
    },
    /// An address was added (RTM_NEWADDR).
    NewAddr {
        /// Interface index.
        index: u32,
        /// The address and its prefix length.
        net: IpNet,
    },
    /// An address was removed (RTM_DELADDR).
    DelAddr {
        /// Interface index.
        index: u32,
        /// The address and its prefix length.
        net: IpNet,
    },
}

/// Which node IPs NodePort services listen on (kube-proxy's `nodePortAddresses`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub enum NodePortAddresses {
    /// Empty `nodePortAddresses`: every node IP.
    #[default]
    All,
    /// Node IPs inside any of these CIDRs.
    Cidrs(Vec<IpNet>),
    /// `primary`: the node's primary IPs (from `Node.status.addresses`, passed in by the
    /// controller), limited to those actually configured on the node.
    Primary(Vec<IpAddr>),
}

impl NodePortAddresses {
    /// Parse the configuration list: empty means all, `["primary"]` means the primary IPs
    /// given here, anything else must be CIDRs.
    pub fn from_config<S: AsRef<str>>(values: &[S], primary: &[IpAddr]) -> Result<Self, Error> {
        if values.is_empty() {
            return Ok(Self::All);
        }
        if values.iter().any(|v| v.as_ref().trim() == "primary") {
            if values.len() != 1 {
                return Err(Error::InvalidNodePortAddress(
                    "\"primary\" cannot be combined with CIDRs".to_string(),
                ));
            }
            return Ok(Self::Primary(primary.to_vec()));
        }
        values
            .iter()
            .map(|v| {
                let v = v.as_ref().trim();
                v.parse::<IpNet>()
                    .map(|n| n.trunc())
                    .map_err(|_| Error::InvalidNodePortAddress(v.to_string()))
            })
            .collect::<Result<Vec<_>, _>>()
            .map(Self::Cidrs)
    }
}

/// Snapshot of the node's links and addresses, as kept current by [`crate::NodeAddresses`].
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct NodeAddressSet {
    links: BTreeMap<u32, LinkAddrs>,
    dummy_deletions: u64,
    full_dumps: u64,
    published: u64,
}

/// Upstream kube-proxy leaves loopback and IPv6 link-local addresses out of the node IPs.
fn usable_node_ip(ip: &IpAddr) -> bool {
    if ip.is_loopback() {
        return false;
    }
    match ip {
        IpAddr::V4(_) => true,
        IpAddr::V6(v6) => (v6.segments()[0] & 0xffc0) != 0xfe80,
    }
}

impl NodeAddressSet {
    /// Build a snapshot from a full dump (links, then addresses).
    pub fn from_events<'a>(events: impl IntoIterator<Item = &'a AddrEvent>) -> Self {
        let mut s = Self::default();
        for e in events {
            s.apply(e);
        }
        s
    }

    /// Replace the contents with a fresh dump, keeping the counters. A dummy link that was
    /// present before and is gone in the dump counts as a deletion.
    pub fn replace_with_dump(&mut self, dump: Self) -> bool {
        let before = self.clone();
        let had_dummy = self.dummy_index().is_some();
        self.links = dump.links;
        if had_dummy && self.dummy_index().is_none() {
            self.dummy_deletions += 1;
        }
        self.full_dumps += 1;
        before != *self
    }

    /// Apply one event; returns whether the snapshot changed.
    pub fn apply(&mut self, event: &AddrEvent) -> bool {
        match event {
            AddrEvent::NewLink { index, name } => {
                let l = self.links.entry(*index).or_default();
                if l.name == *name {
                    return false;
                }
                l.name.clone_from(name);
                true
            }
            AddrEvent::DelLink { index, name } => {
                let removed = self.links.remove(index);
                let was_dummy = removed.as_ref().is_some_and(|l| l.name == DUMMY_LINK)
                    || name.as_deref() == Some(DUMMY_LINK);
                if was_dummy {
                    self.dummy_deletions += 1;
                }
                removed.is_some() || was_dummy
            }
            AddrEvent::NewAddr { index, net } => {
                self.links.entry(*index).or_default().addrs.insert(*net)
            }
            AddrEvent::DelAddr { index, net } => self
                .links
                .get_mut(index)
                .is_some_and(|l| l.addrs.remove(net)),
        }
    }

    /// All links by index.
    pub fn links(&self) -> &BTreeMap<u32, LinkAddrs> {
        &self.links
    }

    /// Index of `kube-ipvs0`, if it exists.
    pub fn dummy_index(&self) -> Option<u32> {
        self.links
            .iter()
            .find(|(_, l)| l.name == DUMMY_LINK)
            .map(|(i, _)| *i)
    }

    /// Addresses currently on `kube-ipvs0`.
    pub fn dummy_addresses(&self) -> BTreeSet<IpAddr> {
        self.links
            .values()
            .filter(|l| l.name == DUMMY_LINK)
            .flat_map(|l| l.addrs.iter().map(IpNet::addr))
            .collect()
    }

    /// How many times `kube-ipvs0` disappeared since tracking started. When this grows the
    /// controller must recreate the link and bind its addresses again.
    pub fn dummy_deletions(&self) -> u64 {
        self.dummy_deletions
    }

    /// How many full dumps built this state (1 after start; more only after a socket overrun).
    pub fn full_dumps(&self) -> u64 {
        self.full_dumps
    }

    /// How many snapshots the tracker published since it started, this one included (one per
    /// burst of changes, not one per event).
    pub fn published(&self) -> u64 {
        self.published
    }

    /// Counts one more published snapshot (the tracker, right before publishing).
    pub(crate) fn note_published(&mut self) {
        self.published += 1;
    }

    fn other_links(&self) -> impl Iterator<Item = &LinkAddrs> {
        self.links.values().filter(|l| l.name != DUMMY_LINK)
    }

    /// The node IPs: addresses on any link except `kube-ipvs0`, without loopback and IPv6
    /// link-local addresses (kube-proxy's rule). An address also bound on `kube-ipvs0` still
    /// counts when another link carries it.
    pub fn node_ips(&self) -> BTreeSet<IpAddr> {
        self.other_links()
            .flat_map(|l| l.addrs.iter().map(IpNet::addr))
            .filter(usable_node_ip)
            .collect()
    }

    /// Whether `ip` is configured on any link other than `kube-ipvs0` (used to decide whether an
    /// externalIP must be bound on `kube-ipvs0`).
    pub fn is_local(&self, ip: &IpAddr) -> bool {
        self.other_links()
            .any(|l| l.addrs.iter().any(|n| n.addr() == *ip))
    }

    /// The node IPs NodePort services are created for, per `filter`.
    pub fn node_port_addresses(&self, filter: &NodePortAddresses) -> BTreeSet<IpAddr> {
        let mut ips = self.node_ips();
        match filter {
            NodePortAddresses::All => {}
            NodePortAddresses::Cidrs(cidrs) => {
                ips.retain(|ip| cidrs.iter().any(|c| c.contains(ip)))
            }
            NodePortAddresses::Primary(primary) => ips.retain(|ip| primary.contains(ip)),
        }
        ips
    }
}

/// The address an rtnetlink address message is about: IFA_LOCAL when present (IPv4, and
/// point-to-point peers), else IFA_ADDRESS.
fn address_of(msg: &AddressMessage) -> Result<IpNet, Error> {
    let mut local = None;
    let mut address = None;
    for a in &msg.attributes {
        match a {
            AddressAttribute::Local(ip) => local = Some(*ip),
            AddressAttribute::Address(ip) => address = Some(*ip),
            _ => {}
        }
    }
    let ip = local.or(address).ok_or_else(|| Error::Malformed {
        what: "address message",
        detail: format!(
            "interface {} has neither IFA_LOCAL nor IFA_ADDRESS",
            msg.header.index
        ),
    })?;
    IpNet::new(ip, msg.header.prefix_len).map_err(|_| Error::Malformed {
        what: "address message",
        detail: format!("prefix length {} for {ip}", msg.header.prefix_len),
    })
}

fn name_of(msg: &LinkMessage) -> Option<String> {
    msg.attributes.iter().find_map(|a| match a {
        LinkAttribute::IfName(n) => Some(n.clone()),
        _ => None,
    })
}

/// Decode one rtnetlink message into an event. Messages of other kinds give `Ok(None)`;
/// address or link messages missing what they must carry give an error.
pub fn event_from_message(msg: &RouteNetlinkMessage) -> Result<Option<AddrEvent>, Error> {
    Ok(Some(match msg {
        RouteNetlinkMessage::NewLink(l) => AddrEvent::NewLink {
            index: l.header.index,
            name: name_of(l).ok_or_else(|| Error::Malformed {
                what: "link message",
                detail: format!("interface {} has no IFLA_IFNAME", l.header.index),
            })?,
        },
        RouteNetlinkMessage::DelLink(l) => AddrEvent::DelLink {
            index: l.header.index,
            name: name_of(l),
        },
        RouteNetlinkMessage::NewAddress(a) => AddrEvent::NewAddr {
            index: a.header.index,
            net: address_of(a)?,
        },
        RouteNetlinkMessage::DelAddress(a) => AddrEvent::DelAddr {
            index: a.header.index,
            net: address_of(a)?,
        },
        _ => return Ok(None),
    }))
}

#[cfg(test)]
mod tests {
    use super::*;
    use netlink_packet_route::address::AddressHeader;
    use netlink_packet_route::AddressFamily;

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap()
    }
    fn net(s: &str) -> IpNet {
        s.parse().unwrap()
    }
    fn ips(items: &[&str]) -> BTreeSet<IpAddr> {
        items.iter().map(|s| ip(s)).collect()
    }

    fn node() -> NodeAddressSet {
        let evs = vec![
            AddrEvent::NewLink {
                index: 1,
                name: "lo".into(),
            },
            AddrEvent::NewLink {
                index: 2,
                name: "eth0".into(),
            },
            AddrEvent::NewLink {
                index: 3,
                name: DUMMY_LINK.into(),
            },
            AddrEvent::NewLink {
                index: 4,
                name: "eth1".into(),
            },
            AddrEvent::NewAddr {
                index: 1,
                net: net("127.0.0.1/8"),
            },
            AddrEvent::NewAddr {
                index: 1,
                net: net("::1/128"),
            },
            AddrEvent::NewAddr {
                index: 2,
                net: net("192.168.0.10/24"),
            },
            AddrEvent::NewAddr {
                index: 2,
                net: net("fe80::1/64"),
            },
            AddrEvent::NewAddr {
                index: 2,
                net: net("2001:db8::10/64"),
            },
            AddrEvent::NewAddr {
                index: 3,
                net: net("10.96.0.1/32"),
            },
            AddrEvent::NewAddr {
                index: 3,
                net: net("192.168.1.5/32"),
            },
            AddrEvent::NewAddr {
                index: 4,
                net: net("192.168.1.5/24"),
            },
            AddrEvent::NewAddr {
                index: 4,
                net: net("169.254.3.3/16"),
            },
        ];
        NodeAddressSet::from_events(&evs)
    }

    #[test]
    fn node_ips_skip_dummy_loopback_and_v6_link_local() {
        let n = node();
        assert_eq!(
            n.node_ips(),
            ips(&["192.168.0.10", "2001:db8::10", "192.168.1.5", "169.254.3.3"])
        );
        assert_eq!(n.dummy_index(), Some(3));
        assert_eq!(n.dummy_addresses(), ips(&["10.96.0.1", "192.168.1.5"]));
    }

    #[test]
    fn is_local_ignores_the_dummy_link() {
        let n = node();
        assert!(n.is_local(&ip("192.168.0.10")));
        assert!(n.is_local(&ip("127.0.0.1")));
        assert!(!n.is_local(&ip("10.96.0.1")), "only on kube-ipvs0");
        assert!(n.is_local(&ip("192.168.1.5")), "also on eth1");
        assert!(!n.is_local(&ip("192.168.0.11")));
    }

    #[test]
    fn node_port_filters() {
        let n = node();
        assert_eq!(n.node_port_addresses(&NodePortAddresses::All), n.node_ips());
        let cidrs =
            NodePortAddresses::from_config(&["192.168.0.0/24", "2001:db8::/32"], &[]).unwrap();
        assert_eq!(
            n.node_port_addresses(&cidrs),
            ips(&["192.168.0.10", "2001:db8::10"])
        );
        // Loopback stays out even when a CIDR covers it (kube-proxy IPVS rule).
        let lo = NodePortAddresses::from_config(&["127.0.0.0/8"], &[]).unwrap();
        assert!(n.node_port_addresses(&lo).is_empty());
        let primary =
            NodePortAddresses::from_config(&["primary"], &[ip("192.168.1.5"), ip("203.0.113.9")])
                .unwrap();
        assert_eq!(n.node_port_addresses(&primary), ips(&["192.168.1.5"]));
        assert_eq!(
            NodePortAddresses::from_config::<&str>(&[], &[]).unwrap(),
            NodePortAddresses::All
        );
    }

    #[test]
    fn bad_node_port_config_is_an_error() {
        assert!(matches!(
            NodePortAddresses::from_config(&["10.0.0.0/33"], &[]),
            Err(Error::InvalidNodePortAddress(s)) if s == "10.0.0.0/33"
        ));
        assert!(NodePortAddresses::from_config(&["eth0"], &[]).is_err());
        assert!(NodePortAddresses::from_config(&["primary", "10.0.0.0/8"], &[]).is_err());
        // Host bits are cleared like Go's ParseCIDR.
        assert_eq!(
            NodePortAddresses::from_config(&["10.1.2.3/8"], &[]).unwrap(),
            NodePortAddresses::Cidrs(vec![net("10.0.0.0/8")])
        );
    }

    #[test]
    fn events_report_changes_only_once() {
        let mut n = node();
        let add = AddrEvent::NewAddr {
            index: 2,
            net: net("192.168.0.11/24"),
        };
        assert!(n.apply(&add));
        assert!(!n.apply(&add), "repeated NEWADDR is not a change");
        assert!(n.node_ips().contains(&ip("192.168.0.11")));
        let del = AddrEvent::DelAddr {
            index: 2,
            net: net("192.168.0.11/24"),
        };
        assert!(n.apply(&del));
        assert!(!n.apply(&del));
        assert!(!n.apply(&AddrEvent::NewLink {
            index: 2,
            name: "eth0".into()
        }));
        assert!(n.apply(&AddrEvent::NewLink {
            index: 2,
            name: "uplink".into()
        }));
        assert_eq!(n.links()[&2].name, "uplink");
    }

    #[test]
    fn dummy_deletion_is_counted_and_drops_its_addresses() {
        let mut n = node();
        assert!(n.apply(&AddrEvent::DelLink {
            index: 3,
            name: Some(DUMMY_LINK.into())
        }));
        assert_eq!(n.dummy_deletions(), 1);
        assert_eq!(n.dummy_index(), None);
        assert!(n.dummy_addresses().is_empty());
        // Deleting another link does not count.
        assert!(n.apply(&AddrEvent::DelLink {
            index: 4,
            name: None
        }));
        assert_eq!(n.dummy_deletions(), 1);
        assert!(!n.node_ips().contains(&ip("192.168.1.5")));
    }

    #[test]
    fn resync_counts_a_dummy_that_vanished() {
        let mut n = node();
        let mut dump = node();
        dump.apply(&AddrEvent::DelLink {
            index: 3,
            name: None,
        });
        assert!(n.replace_with_dump(dump));
        assert_eq!(n.dummy_deletions(), 1);
        assert_eq!(n.full_dumps(), 1);
    }

    fn addr_msg(index: u32, prefix: u8, attrs: Vec<AddressAttribute>) -> AddressMessage {
        let mut m = AddressMessage::default();
        m.header = AddressHeader {
            family: AddressFamily::Inet,
            prefix_len: prefix,
            index,
            ..Default::default()
        };
        m.attributes = attrs;
        m
    }

    #[test]
    fn decode_prefers_local_over_peer_address() {
        let m = addr_msg(
            7,
            32,
            vec![
                AddressAttribute::Address(ip("10.0.0.2")),
                AddressAttribute::Local(ip("10.0.0.1")),
            ],
        );
        assert_eq!(
            event_from_message(&RouteNetlinkMessage::NewAddress(m)).unwrap(),
            Some(AddrEvent::NewAddr {
                index: 7,
                net: net("10.0.0.1/32")
            })
        );
        let v6 = addr_msg(7, 64, vec![AddressAttribute::Address(ip("2001:db8::1"))]);
        assert_eq!(
            event_from_message(&RouteNetlinkMessage::DelAddress(v6)).unwrap(),
            Some(AddrEvent::DelAddr {
                index: 7,
                net: net("2001:db8::1/64")
            })
        );
    }

    #[test]
    fn decode_rejects_malformed_messages() {
        let no_addr = addr_msg(7, 32, vec![AddressAttribute::Label("eth0".into())]);
        assert!(matches!(
            event_from_message(&RouteNetlinkMessage::NewAddress(no_addr)),
            Err(Error::Malformed { .. })
        ));
        let bad_prefix = addr_msg(7, 40, vec![AddressAttribute::Local(ip("10.0.0.1"))]);
        assert!(matches!(
            event_from_message(&RouteNetlinkMessage::NewAddress(bad_prefix)),
            Err(Error::Malformed { .. })
        ));
        let nameless = LinkMessage::default();
        assert!(matches!(
            event_from_message(&RouteNetlinkMessage::NewLink(nameless.clone())),
            Err(Error::Malformed { .. })
        ));
        // DELLINK without a name is fine: the index identifies it.
        assert!(event_from_message(&RouteNetlinkMessage::DelLink(nameless))
            .unwrap()
            .is_some());
    }

    #[test]
    fn decode_from_kernel_bytes() {
        use rtnetlink::packet_core::{Emitable, ParseableParametrized};
        const RTM_NEWLINK: u16 = 16;
        const RTM_NEWADDR: u16 = 20;
        // A real RTM_NEWADDR payload layout: ifaddrmsg + IFA_ADDRESS + IFA_LOCAL (IPv4).
        let bytes: Vec<u8> = vec![
            2, 24, 0, 0, 5, 0, 0, 0, // family AF_INET, /24, flags, scope, ifindex 5
            8, 0, 1, 0, 192, 168, 7, 1, // IFA_ADDRESS
            8, 0, 2, 0, 192, 168, 7, 1, // IFA_LOCAL
        ];
        let msg = RouteNetlinkMessage::parse_with_param(&bytes[..], RTM_NEWADDR).unwrap();
        assert_eq!(
            event_from_message(&msg).unwrap(),
            Some(AddrEvent::NewAddr {
                index: 5,
                net: net("192.168.7.1/24")
            })
        );
        // Truncated input: the codec refuses it instead of panicking.
        for cut in [2usize, 12, 20] {
            let truncated = &bytes[..bytes.len() - cut];
            assert!(
                RouteNetlinkMessage::parse_with_param(truncated, RTM_NEWADDR).is_err(),
                "cut {cut}"
            );
        }
        // Link message round trip through the codec.
        let mut l = LinkMessage::default();
        l.header.index = 9;
        l.attributes
            .push(LinkAttribute::IfName("kube-ipvs0".into()));
        let mut buf = vec![0u8; l.buffer_len()];
        l.emit(&mut buf);
        let back = RouteNetlinkMessage::parse_with_param(&buf[..], RTM_NEWLINK).unwrap();
        assert_eq!(
            event_from_message(&back).unwrap(),
            Some(AddrEvent::NewLink {
                index: 9,
                name: DUMMY_LINK.into()
            })
        );
    }
}
