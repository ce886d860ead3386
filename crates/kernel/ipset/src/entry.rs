//! Typed set entries that render to (and parse from) ipset's canonical `ipset save` text.

use std::fmt;
use std::net::IpAddr;
use std::str::FromStr;

use ipnet::IpNet;

use crate::set::{Family, SetType};
use crate::Error;

/// Transport protocol of a `,proto:port` element (crate `net-types`).
pub use net_types::Protocol;

/// One member of a set. `Display` gives exactly what `ipset save` prints, so a state read back
/// from the kernel compares equal to the desired one. Build entries with the constructors (or
/// call [`Entry::normalized`]) so that networks are truncated the way the kernel stores them.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Entry {
    /// `hash:ip` member: `10.96.0.1`.
    Ip(IpAddr),
    /// `hash:ip,port` member: `10.96.0.1,tcp:80`.
    IpPort {
        /// Address.
        ip: IpAddr,
        /// Protocol.
        proto: Protocol,
        /// Port.
        port: u16,
    },
    /// `hash:ip,port,ip` member: `10.244.1.5,tcp:8080,10.244.1.5`.
    IpPortIp {
        /// Address.
        ip: IpAddr,
        /// Protocol.
        proto: Protocol,
        /// Port.
        port: u16,
        /// Second address.
        ip2: IpAddr,
    },
    /// `hash:ip,port,net` member: `1.2.3.4,tcp:80,10.0.0.0/8` (a host network prints without
    /// prefix length, like ipset does).
    IpPortNet {
        /// Address.
        ip: IpAddr,
        /// Protocol.
        proto: Protocol,
        /// Port.
        port: u16,
        /// Network (host bits cleared).
        net: IpNet,
    },
    /// `bitmap:port` member: `30080`.
    Port(u16),
}

impl Entry {
    /// `hash:ip,port` entry.
    pub fn ip_port(ip: IpAddr, proto: Protocol, port: u16) -> Entry {
        Entry::IpPort { ip, proto, port }
    }

    /// `hash:ip,port,ip` entry.
    pub fn ip_port_ip(ip: IpAddr, proto: Protocol, port: u16, ip2: IpAddr) -> Entry {
        Entry::IpPortIp {
            ip,
            proto,
            port,
            ip2,
        }
    }

    /// `hash:ip,port,net` entry (network truncated to its prefix).
    pub fn ip_port_net(ip: IpAddr, proto: Protocol, port: u16, net: IpNet) -> Entry {
        Entry::IpPortNet {
            ip,
            proto,
            port,
            net: net.trunc(),
        }
    }

    /// The same entry in the kernel's canonical form (network host bits cleared).
    pub fn normalized(self) -> Entry {
        match self {
            Entry::IpPortNet {
                ip,
                proto,
                port,
                net,
            } => Entry::ip_port_net(ip, proto, port, net),
            e => e,
        }
    }

    /// The set type this entry belongs in.
    pub fn set_type(&self) -> SetType {
        match self {
            Entry::Ip(_) => SetType::HashIp,
            Entry::IpPort { .. } => SetType::HashIpPort,
            Entry::IpPortIp { .. } => SetType::HashIpPortIp,
            Entry::IpPortNet { .. } => SetType::HashIpPortNet,
            Entry::Port(_) => SetType::BitmapPort,
        }
    }

    /// The address family of the entry (`None` for a bare port), or an error if its addresses mix
    /// families.
    pub fn family(&self) -> Result<Option<Family>, Error> {
        let (a, b) = match self {
            Entry::Ip(ip) | Entry::IpPort { ip, .. } => (*ip, None),
            Entry::IpPortIp { ip, ip2, .. } => (*ip, Some(*ip2)),
            Entry::IpPortNet { ip, net, .. } => (*ip, Some(net.addr())),
            Entry::Port(_) => return Ok(None),
        };
        let fa = Family::of(&a);
        match b {
            Some(b) if Family::of(&b) != fa => {
                Err(Error::InvalidEntry(format!("{self}: mixes IPv4 and IPv6")))
            }
            _ => Ok(Some(fa)),
        }
    }

    /// Parse an entry as `ipset save` prints it for a set of type `set_type`.
    pub fn parse(set_type: SetType, s: &str) -> Result<Entry, Error> {
        let bad = |why: &str| Error::Parse(format!("{set_type} entry {s:?}: {why}"));
        let parts: Vec<&str> = s.split(',').collect();
        let ip = |t: &str| IpAddr::from_str(t).map_err(|_| bad("bad address"));
        let proto_port = |t: &str| -> Result<(Protocol, u16), Error> {
            let (p, n) = t.split_once(':').ok_or_else(|| bad("missing proto:port"))?;
            let proto = p.parse::<Protocol>().map_err(|_| bad("unknown protocol"))?;
            let port = n.parse::<u16>().map_err(|_| bad("bad port"))?;
            Ok((proto, port))
        };
        let e = match (set_type, parts.as_slice()) {
            (SetType::HashIp, [a]) => Entry::Ip(ip(a)?),
            (SetType::HashIpPort, [a, pp]) => {
                let (proto, port) = proto_port(pp)?;
                Entry::ip_port(ip(a)?, proto, port)
            }
            (SetType::HashIpPortIp, [a, pp, b]) => {
                let (proto, port) = proto_port(pp)?;
                Entry::ip_port_ip(ip(a)?, proto, port, ip(b)?)
            }
            (SetType::HashIpPortNet, [a, pp, n]) => {
                let (proto, port) = proto_port(pp)?;
                let net = if n.contains('/') {
                    IpNet::from_str(n).map_err(|_| bad("bad network"))?
                } else {
                    IpNet::from(ip(n)?)
                };
                Entry::ip_port_net(ip(a)?, proto, port, net)
            }
            (SetType::BitmapPort, [p]) => {
                // Older ipset versions print `tcp:80` for bitmap:port members.
                let n = p.rsplit(':').next().unwrap_or(p);
                Entry::Port(n.parse::<u16>().map_err(|_| bad("bad port"))?)
            }
            _ => return Err(bad("wrong number of fields")),
        };
        Ok(e)
    }
}

impl fmt::Display for Entry {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Entry::Ip(ip) => write!(f, "{ip}"),
            Entry::IpPort { ip, proto, port } => write!(f, "{ip},{}:{port}", proto.as_str()),
            Entry::IpPortIp {
                ip,
                proto,
                port,
                ip2,
            } => write!(f, "{ip},{}:{port},{ip2}", proto.as_str()),
            Entry::IpPortNet {
                ip,
                proto,
                port,
                net,
            } => {
                let net = net.trunc();
                if net.prefix_len() == net.max_prefix_len() {
                    write!(f, "{ip},{}:{port},{}", proto.as_str(), net.addr())
                } else {
                    write!(f, "{ip},{}:{port},{net}", proto.as_str())
                }
            }
            Entry::Port(p) => write!(f, "{p}"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap()
    }

    #[test]
    fn renders_canonical_text() {
        assert_eq!(
            Entry::ip_port(ip("10.96.0.1"), Protocol::Tcp, 80).to_string(),
            "10.96.0.1,tcp:80"
        );
        assert_eq!(
            Entry::ip_port_ip(ip("10.244.1.5"), Protocol::Tcp, 8080, ip("10.244.1.5")).to_string(),
            "10.244.1.5,tcp:8080,10.244.1.5"
        );
        assert_eq!(Entry::Port(30080).to_string(), "30080");
        assert_eq!(
            Entry::ip_port_net(
                ip("1.2.3.4"),
                Protocol::Tcp,
                80,
                "10.1.2.3/8".parse().unwrap()
            )
            .to_string(),
            "1.2.3.4,tcp:80,10.0.0.0/8"
        );
        // host networks print as a bare address, as `ipset save` does
        assert_eq!(
            Entry::ip_port_net(
                ip("1.2.3.4"),
                Protocol::Sctp,
                80,
                "10.1.2.3/32".parse().unwrap()
            )
            .to_string(),
            "1.2.3.4,sctp:80,10.1.2.3"
        );
        // IPv6 is printed compressed
        assert_eq!(
            Entry::ip_port_ip(ip("fd00:0::0001"), Protocol::Udp, 53, ip("fd00::1")).to_string(),
            "fd00::1,udp:53,fd00::1"
        );
    }

    #[test]
    fn parse_round_trips() {
        for (t, s) in [
            (SetType::HashIp, "10.0.0.1"),
            (SetType::HashIpPort, "10.96.0.1,tcp:80"),
            (SetType::HashIpPort, "fd00::1,sctp:80"),
            (SetType::HashIpPortIp, "10.244.1.5,tcp:8080,10.244.1.5"),
            (SetType::HashIpPortNet, "1.2.3.4,tcp:80,10.0.0.0/8"),
            (SetType::HashIpPortNet, "1.2.3.4,udp:80,10.1.2.3"),
            (SetType::BitmapPort, "30080"),
        ] {
            assert_eq!(Entry::parse(t, s).unwrap().to_string(), s);
        }
        assert_eq!(
            Entry::parse(SetType::BitmapPort, "tcp:80").unwrap(),
            Entry::Port(80)
        );
    }

    #[test]
    fn parse_rejects_malformed() {
        for (t, s) in [
            (SetType::HashIp, "10.0.0.300"),
            (SetType::HashIp, ""),
            (SetType::HashIpPort, "10.96.0.1"),
            (SetType::HashIpPort, "10.96.0.1,icmp:8"),
            (SetType::HashIpPort, "10.96.0.1,tcp:70000"),
            (SetType::HashIpPortIp, "10.96.0.1,tcp:80"),
            (SetType::HashIpPortNet, "1.2.3.4,tcp:80,10.0.0.0/40"),
            (SetType::BitmapPort, "x"),
        ] {
            assert!(Entry::parse(t, s).is_err(), "{t} {s}");
        }
    }

    #[test]
    fn family_checks_mixing() {
        let e = Entry::ip_port_ip(ip("10.0.0.1"), Protocol::Tcp, 1, ip("fd00::1"));
        assert!(e.family().is_err());
        assert_eq!(Entry::Port(1).family().unwrap(), None);
        assert_eq!(
            Entry::Ip(ip("fd00::1")).family().unwrap(),
            Some(Family::Inet6)
        );
    }
}
