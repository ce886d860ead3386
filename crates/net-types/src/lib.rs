//! The network vocabulary every kube-ipvs crate shares: one address [`Family`] and one
//! transport [`Protocol`] (IPVS, ipset, conntrack, the model and the proxier all use these,
//! each crate re-exporting them where its users look for them).

use std::fmt;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::str::FromStr;

/// An address family (the kernel's `AF_INET` / `AF_INET6`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Family {
    /// IPv4 (`AF_INET` = 2).
    Inet,
    /// IPv6 (`AF_INET6` = 10).
    Inet6,
}

impl Family {
    /// The kernel's numeric address family.
    pub fn to_af(self) -> u16 {
        match self {
            Family::Inet => 2,
            Family::Inet6 => 10,
        }
    }

    /// Family from the kernel's numeric address family.
    pub fn from_af(af: u16) -> Option<Family> {
        match af {
            2 => Some(Family::Inet),
            10 => Some(Family::Inet6),
            _ => None,
        }
    }

    /// The family of an address.
    pub fn of(addr: &IpAddr) -> Family {
        match addr {
            IpAddr::V4(_) => Family::Inet,
            IpAddr::V6(_) => Family::Inet6,
        }
    }

    /// The family's word in ipset's `family` option and nftables (`inet` / `inet6`).
    pub fn as_str(self) -> &'static str {
        match self {
            Family::Inet => "inet",
            Family::Inet6 => "inet6",
        }
    }

    /// The family's name in the Kubernetes API (`IPv4` / `IPv6`: `ipFamilies`, the
    /// `ip_family` metric label, the health server's `family`).
    pub fn api_name(self) -> &'static str {
        match self {
            Family::Inet => "IPv4",
            Family::Inet6 => "IPv6",
        }
    }

    /// The IP version (4 / 6).
    pub fn version(self) -> u8 {
        match self {
            Family::Inet => 4,
            Family::Inet6 => 6,
        }
    }

    /// The unspecified address of this family.
    pub fn unspecified(self) -> IpAddr {
        match self {
            Family::Inet => IpAddr::V4(Ipv4Addr::UNSPECIFIED),
            Family::Inet6 => IpAddr::V6(Ipv6Addr::UNSPECIFIED),
        }
    }
}

/// A transport protocol of a service port.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Protocol {
    /// TCP (`IPPROTO_TCP` = 6).
    Tcp,
    /// UDP (`IPPROTO_UDP` = 17).
    Udp,
    /// SCTP (`IPPROTO_SCTP` = 132).
    Sctp,
}

impl Protocol {
    /// The IP protocol number.
    pub fn number(self) -> u8 {
        match self {
            Protocol::Tcp => 6,
            Protocol::Udp => 17,
            Protocol::Sctp => 132,
        }
    }

    /// Protocol from an IP protocol number.
    pub fn from_number(n: u8) -> Option<Protocol> {
        match n {
            6 => Some(Protocol::Tcp),
            17 => Some(Protocol::Udp),
            132 => Some(Protocol::Sctp),
            _ => None,
        }
    }

    /// The name as the Kubernetes API spells it (`TCP`, `UDP`, `SCTP`).
    pub fn api_name(self) -> &'static str {
        match self {
            Protocol::Tcp => "TCP",
            Protocol::Udp => "UDP",
            Protocol::Sctp => "SCTP",
        }
    }

    /// Protocol from its Kubernetes API name (exactly `TCP`, `UDP` or `SCTP`, as the API
    /// admits them).
    pub fn from_api_name(name: &str) -> Option<Protocol> {
        [Protocol::Tcp, Protocol::Udp, Protocol::Sctp]
            .into_iter()
            .find(|p| p.api_name() == name)
    }

    /// The lower-case name (`tcp`, `udp`, `sctp`), as ipset and conntrack print it.
    pub fn as_str(self) -> &'static str {
        match self {
            Protocol::Tcp => "tcp",
            Protocol::Udp => "udp",
            Protocol::Sctp => "sctp",
        }
    }
}

impl fmt::Display for Protocol {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A protocol name that is none of `tcp`, `udp`, `sctp` (in any case).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown protocol {0:?}")]
pub struct UnknownProtocol(pub String);

impl FromStr for Protocol {
    type Err = UnknownProtocol;
    fn from_str(s: &str) -> Result<Protocol, UnknownProtocol> {
        match s.to_ascii_lowercase().as_str() {
            "tcp" => Ok(Protocol::Tcp),
            "udp" => Ok(Protocol::Udp),
            "sctp" => Ok(Protocol::Sctp),
            _ => Err(UnknownProtocol(s.to_string())),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn protocol_numbers_and_names_round_trip() {
        for p in [Protocol::Tcp, Protocol::Udp, Protocol::Sctp] {
            assert_eq!(Protocol::from_number(p.number()), Some(p));
            assert_eq!(p.as_str().parse::<Protocol>(), Ok(p));
            assert_eq!(p.as_str().to_uppercase().parse::<Protocol>(), Ok(p));
            assert_eq!(Protocol::from_api_name(p.api_name()), Some(p));
            assert_eq!(p.api_name(), p.as_str().to_uppercase());
        }
        assert_eq!(Protocol::from_number(1), None);
        assert_eq!(
            Protocol::from_api_name("tcp"),
            None,
            "the API spelling is upper case"
        );
        assert_eq!(
            "icmp".parse::<Protocol>().map_err(|e| e.to_string()),
            Err("unknown protocol \"icmp\"".to_string())
        );
    }

    #[test]
    fn family_numbers_round_trip() {
        for f in [Family::Inet, Family::Inet6] {
            assert_eq!(Family::from_af(f.to_af()), Some(f));
            assert_eq!(Family::of(&f.unspecified()), f);
        }
        assert_eq!(Family::from_af(0), None);
        assert_eq!(Family::Inet.as_str(), "inet");
        assert_eq!(Family::Inet6.as_str(), "inet6");
        assert_eq!(
            (Family::Inet.api_name(), Family::Inet6.api_name()),
            ("IPv4", "IPv6")
        );
        assert_eq!((Family::Inet.version(), Family::Inet6.version()), (4, 6));
    }
}
