//! The mode's node-wide configuration.

use super::*;
use crate::rules::iface;

/// Configuration of the mode (node-wide).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProxyModeConfig {
    /// Address family.
    pub family: Family,
    /// Bit of the masquerade mark (default 14, i.e. 0x4000).
    pub masquerade_bit: u32,
    /// `--masquerade-all`.
    pub masquerade_all: bool,
    /// Local-traffic detection (pod CIDR / interface).
    pub local_detect: LocalDetect,
    /// `--random-fully` on MASQUERADE.
    pub random_fully: bool,
    /// NodePort addresses when `--nodeport-addresses` is set; `None`: every local address
    /// (`-m addrtype --dst-type LOCAL`).
    pub node_port_ips: Option<Vec<IpAddr>>,
    /// NodePorts answer on 127.0.0.0/8 (`iptables.localhostNodePorts` in effect: IPv4, and the
    /// NodePort addresses include IPv4 loopback). Ignored for IPv6, where localhost NodePorts
    /// never work (upstream's IPv6 proxier always gets `false`).
    pub localhost_node_ports: bool,
}

impl ProxyModeConfig {
    /// Defaults: bit 14, no masquerade-all, no local detection, `--random-fully`, NodePorts on
    /// every local address.
    pub fn new(family: Family) -> ProxyModeConfig {
        ProxyModeConfig {
            family,
            masquerade_bit: 14,
            masquerade_all: false,
            local_detect: LocalDetect::None,
            random_fully: true,
            node_port_ips: None,
            localhost_node_ports: false,
        }
    }

    /// True when the anti-martian rule in [`KUBELET_FIREWALL`] is written: IPv4 with localhost
    /// NodePorts (upstream: `!isIPv6 && proxier.localhostNodePorts` in syncProxyRules).
    pub fn localhost_firewall(&self) -> bool {
        self.family == Family::Inet && self.localhost_node_ports
    }

    /// The filter/nat chains a restore with this configuration declares (flushes and refills):
    /// [`base_chains`], plus [`KUBELET_FIREWALL`] while [`Self::localhost_firewall`].
    pub fn chains(&self) -> Vec<(Table, &'static str)> {
        let mut v = base_chains();
        if self.localhost_firewall() {
            v.push((Table::Filter, KUBELET_FIREWALL));
        }
        v
    }

    pub(super) fn mark(&self) -> Result<String> {
        if self.masquerade_bit > 31 {
            return Err(Error::InvalidInput(format!(
                "masquerade bit {} not in [0, 31]",
                self.masquerade_bit
            )));
        }
        let m = 1u64 << self.masquerade_bit;
        Ok(format!("{m:#x}/{m:#x}"))
    }

    pub(super) fn host_len(&self) -> u8 {
        match self.family {
            Family::Inet => 32,
            Family::Inet6 => 128,
        }
    }

    pub(super) fn reject(&self) -> &'static str {
        match self.family {
            Family::Inet => "REJECT --reject-with icmp-port-unreachable",
            Family::Inet6 => "REJECT --reject-with icmp6-port-unreachable",
        }
    }

    pub(super) fn recent_mask(&self) -> &'static str {
        match self.family {
            Family::Inet => "255.255.255.255",
            Family::Inet6 => "ffff:ffff:ffff:ffff:ffff:ffff:ffff:ffff",
        }
    }

    /// `(source/interface part, negated)` selecting local pod traffic, if detection is set.
    pub(super) fn local_match(&self, negate: bool) -> Result<Option<Part>> {
        let bang = if negate { "! " } else { "" };
        Ok(match &self.local_detect {
            LocalDetect::None => None,
            LocalDetect::Cidrs(cidrs) => cidrs
                .iter()
                .find(|c| Family::of(&c.addr()) == self.family)
                .map(|c| Part::Src(format!("{bang}-s {}", c.trunc()))),
            LocalDetect::BridgeInterface(i) => Some(Part::In(format!("{bang}-i {}", iface(i)?))),
            LocalDetect::InterfaceNamePrefix(p) => {
                Some(Part::In(format!("{bang}-i {}+", iface(p)?)))
            }
        })
    }
}
