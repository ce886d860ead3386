//! What the model depends on besides the objects: the proxy configuration of one address
//! family ([`ProxyConfig`]) and this node ([`NodeInfo`]).

use std::collections::BTreeSet;
use std::net::IpAddr;

use crate::budget::ServiceBudget;
use crate::names::ZONE_LABEL;
use ipnet::IpNet;
use ipvs_netlink::{Family, Protocol};
use k8s_openapi::api::core::v1::Node;

/// Proxy configuration the model depends on (one instance per address family).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProxyConfig {
    /// The address family this proxier instance handles.
    pub family: Family,
    /// Default IPVS scheduler (`--ipvs-scheduler`, default `rr`).
    pub scheduler: String,
    /// Virtual servers in these ranges are never deleted by the proxy (`--ipvs-exclude-cidrs`).
    pub exclude_cidrs: Vec<IpNet>,
    /// Masquerade all service traffic (`--masquerade-all`).
    pub masquerade_all: bool,
    /// Pod network ranges (`--cluster-cidr`); traffic from outside is masqueraded.
    pub cluster_cidrs: Vec<IpNet>,
    /// NodePort addresses (`--nodeport-addresses` CIDRs); empty, and `node_port_primary` false:
    /// every node address.
    pub node_port_addresses: Vec<IpNet>,
    /// `--nodeport-addresses` includes `primary`: the node's primary IPs (its Node object's
    /// InternalIP, then ExternalIP addresses) serve NodePorts too.
    pub node_port_primary: bool,
    /// `bindAddress` when it names an address (not `0.0.0.0`/`::`): this node's primary IP of
    /// its family, overriding the Node object's (upstream `detectNodeIPs`,
    /// cmd/kube-proxy/app/server.go). Used by `nodePortAddresses: [primary]`.
    pub bind_address: Option<IpAddr>,
    /// `--ipvs-strict-arp`.
    pub strict_arp: bool,
    /// `iptables.localhostNodePorts` (`--iptables-localhost-nodeports`, default true): iptables
    /// mode serves IPv4 NodePorts on 127.0.0.0/8 (see [`ProxyConfig::localhost_node_ports`]).
    /// IPVS mode never does (neither does upstream's IPVS mode).
    pub iptables_localhost_node_ports: bool,
    /// `--ipvs-tcp-timeout` seconds (0 = leave).
    pub tcp_timeout: u32,
    /// `--ipvs-tcpfin-timeout` seconds (0 = leave).
    pub tcp_fin_timeout: u32,
    /// `--ipvs-udp-timeout` seconds (0 = leave).
    pub udp_timeout: u32,
    /// Ports of this node no externalIP or load-balancer IP equal to a node address may take
    /// (`--protected-node-ports`, plus the proxy's own healthz and metrics ports; see
    /// `desired::vip`). Default [`DEFAULT_PROTECTED_NODE_PORTS`].
    pub protected_node_ports: Vec<ProtectedPort>,
    /// `--refuse-node-address-vips`: never serve an externalIP or load-balancer IP equal to
    /// one of this node's addresses.
    pub refuse_node_address_vips: bool,
    /// What one Service may cost this node (`--max-*-per-service`, see [`ServiceBudget`]).
    pub budget: ServiceBudget,
}

/// One protected node port: a port, on one protocol or (`None`) on every protocol.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ProtectedPort {
    /// The port.
    pub port: u16,
    /// The protocol; `None`: TCP, UDP and SCTP.
    pub protocol: Option<Protocol>,
}

impl ProtectedPort {
    /// True when this entry protects `port` on `protocol`.
    pub fn covers(&self, port: u16, protocol: Protocol) -> bool {
        self.port == port && self.protocol.is_none_or(|p| p == protocol)
    }
}

/// The ports protected by default on every protocol: what a Kubernetes node serves on its
/// own addresses by default (the "Ports and Protocols" page of the Kubernetes docs): SSH (22),
/// etcd (2379, 2380), the API server (6443), kubelet's healthz (10248), API (10250) and
/// read-only port (10255), kube-proxy's metrics (10249) and healthz (10256), the
/// controller-manager (10257) and the scheduler (10259).
pub const DEFAULT_PROTECTED_NODE_PORTS: &[u16] = &[
    22, 2379, 2380, 6443, 10248, 10249, 10250, 10255, 10256, 10257, 10259,
];

impl ProxyConfig {
    /// Defaults for a family: scheduler `rr`, no ranges, no timeouts, the default protected
    /// node ports.
    pub fn new(family: Family) -> ProxyConfig {
        ProxyConfig {
            family,
            scheduler: "rr".to_string(),
            exclude_cidrs: Vec::new(),
            masquerade_all: false,
            cluster_cidrs: Vec::new(),
            node_port_addresses: Vec::new(),
            node_port_primary: false,
            bind_address: None,
            strict_arp: false,
            iptables_localhost_node_ports: true,
            tcp_timeout: 0,
            tcp_fin_timeout: 0,
            udp_timeout: 0,
            protected_node_ports: DEFAULT_PROTECTED_NODE_PORTS
                .iter()
                .map(|&port| ProtectedPort {
                    port,
                    protocol: None,
                })
                .collect(),
            refuse_node_address_vips: false,
            budget: ServiceBudget::default(),
        }
    }

    /// True when `addr` lies in one of the excludeCIDRs (never deleted by the proxy).
    pub fn excluded(&self, addr: &IpAddr) -> bool {
        self.exclude_cidrs.iter().any(|n| n.contains(addr))
    }

    /// True when `--nodeport-addresses` restricts NodePorts to some node addresses.
    pub fn node_ports_restricted(&self) -> bool {
        !self.node_port_addresses.is_empty() || self.node_port_primary
    }

    /// True when iptables mode serves NodePorts on IPv4 loopback for this family: IPv4,
    /// `iptables.localhostNodePorts`, and NodePorts on every address or `nodePortAddresses`
    /// containing 127.0.0.0. Upstream's iptables `NewProxier` (`ContainsIPv4Loopback`; the
    /// IPv6 proxier always gets `false`).
    pub fn localhost_node_ports(&self) -> bool {
        let lo = IpAddr::V4(std::net::Ipv4Addr::new(127, 0, 0, 0));
        self.family == Family::Inet
            && self.iptables_localhost_node_ports
            && (!self.node_ports_restricted()
                || self.node_port_addresses.iter().any(|n| n.contains(&lo)))
    }
}

/// What the model needs to know about this node.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct NodeInfo {
    /// The node's name (`--hostname-override` or the hostname); endpoints with this
    /// `nodeName` are local.
    pub name: String,
    /// `topology.kubernetes.io/zone` label, if any.
    pub zone: Option<String>,
    /// Addresses of the node's interfaces other than kube-ipvs0 (supplied by netif), any family.
    pub addresses: BTreeSet<IpAddr>,
    /// The node's primary IPs (`status.addresses` InternalIP, then ExternalIP), any family.
    pub primary_ips: Vec<IpAddr>,
}

impl NodeInfo {
    /// The node's addresses of `family`: its local interface addresses, then its primary IPs
    /// (a primary IP that is also local comes twice; callers collect into what they need).
    pub fn ips_of(&self, family: Family) -> impl Iterator<Item = IpAddr> + '_ {
        self.addresses
            .iter()
            .chain(self.primary_ips.iter())
            .filter(move |ip| Family::of(ip) == family)
            .copied()
    }

    /// Node info from the Node object (zone label, primary IPs) and local interface addresses.
    /// Unparsable `status.addresses` entries are ignored (they are informational only);
    /// addresses are read like upstream's (`netutils.ParseIPSloppy`, see [`crate::addr`]).
    pub fn from_node(name: &str, node: Option<&Node>, addresses: BTreeSet<IpAddr>) -> NodeInfo {
        let zone = node
            .and_then(|n| n.metadata.labels.as_ref())
            .and_then(|l| l.get(ZONE_LABEL))
            .filter(|z| !z.is_empty())
            .cloned();
        let mut primary_ips = Vec::new();
        if let Some(addrs) = node
            .and_then(|n| n.status.as_ref())
            .and_then(|s| s.addresses.as_ref())
        {
            for kind in ["InternalIP", "ExternalIP"] {
                for a in addrs.iter().filter(|a| a.type_ == kind) {
                    if let Some(ip) = crate::addr::parse_ip_sloppy(&a.address) {
                        if !primary_ips.contains(&ip) {
                            primary_ips.push(ip);
                        }
                    }
                }
            }
        }
        NodeInfo {
            name: name.to_string(),
            zone,
            addresses,
            primary_ips,
        }
    }

    /// The Node object's `spec.podCIDRs` (else `spec.podCIDR`) of `family`, in order;
    /// unparsable entries are skipped (detectLocalMode NodeCIDR).
    pub fn pod_cidrs_of(node: Option<&Node>, family: Family) -> Vec<IpNet> {
        let Some(spec) = node.and_then(|n| n.spec.as_ref()) else {
            return Vec::new();
        };
        let listed = spec.pod_cidrs.iter().flatten();
        let single = spec.pod_cidr.iter();
        let mut out: Vec<IpNet> = Vec::new();
        for c in listed.chain(single) {
            if let Some(n) = crate::addr::parse_cidr_sloppy(c) {
                if Family::of(&n.addr()) == family && !out.contains(&n) {
                    out.push(n);
                }
            }
        }
        out
    }

    /// The addresses NodePorts are served on for `cfg`'s family: the node's addresses (not
    /// kube-ipvs0's), restricted to `nodePortAddresses` when set (its CIDRs, and the primary
    /// IPs for `primary`); loopback and IPv6 link-local addresses are never used.
    pub fn node_port_ips(&self, cfg: &ProxyConfig) -> BTreeSet<IpAddr> {
        self.addresses
            .iter()
            .filter(|ip| Family::of(ip) == cfg.family)
            .filter(|ip| !ip.is_loopback() && !is_v6_link_local(ip) && !ip.is_unspecified())
            .filter(|ip| {
                !cfg.node_ports_restricted()
                    || cfg.node_port_addresses.iter().any(|n| n.contains(*ip))
                    || (cfg.node_port_primary && self.is_primary(ip, cfg))
            })
            .copied()
            .collect()
    }

    /// True when `ip` is this node's primary IP of its family: `bindAddress` when it is set to
    /// an address of that family, else one of the Node object's addresses (upstream
    /// `detectNodeIPs`: a bindAddress overrides the node IP of its family).
    pub fn is_primary(&self, ip: &IpAddr, cfg: &ProxyConfig) -> bool {
        match cfg.bind_address {
            Some(b) if Family::of(&b) == Family::of(ip) => b == *ip,
            _ => self.primary_ips.contains(ip),
        }
    }
}

fn is_v6_link_local(ip: &IpAddr) -> bool {
    match ip {
        IpAddr::V6(v6) => (v6.segments()[0] & 0xffc0) == 0xfe80,
        IpAddr::V4(_) => false,
    }
}
