//! The desired state's vocabulary: ipset members, health-check ports, iptables features and
//! inputs, in-cluster marks, and one Service's [`ServiceDesired`].

use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;

use ipnet::IpNet;
use ipset::{Entry, SetKind};
use ipvs_netlink::{Protocol, ServiceKey};

use crate::diff::VirtualServer;
use model::sorted::{SortedMap, SortedVec};
use model::{Invalid, ServicePortName};

/// One member of one of the kube-proxy sets.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct IpsetEntry {
    /// Which set.
    pub set: SetKind,
    /// The member.
    pub entry: Entry,
}

/// The health-check node port of an externalTrafficPolicy=Local LoadBalancer service.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct HealthCheck {
    /// `spec.healthCheckNodePort`.
    pub node_port: u16,
    /// Local ready endpoints of the service: distinct IPs over all its ports, so an endpoint
    /// serving two ports counts once (upstream's `LocalReadyEndpoints`); 0 answers 503.
    pub local_endpoints: usize,
}

impl HealthCheck {
    /// This check combined with another view of the same service's check (the other address
    /// family): the largest local endpoint count answers.
    pub fn merge(self, other: HealthCheck) -> HealthCheck {
        HealthCheck {
            node_port: self.node_port,
            local_endpoints: self.local_endpoints.max(other.local_endpoints),
        }
    }
}

/// iptables features a service uses (bit set; see the constants).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct Features(pub u16);

impl Features {
    /// TCP or UDP node ports.
    pub const NODE_PORTS: u16 = 1 << 0;
    /// SCTP node ports.
    pub const SCTP_NODE_PORTS: u16 = 1 << 1;
    /// Node ports with externalTrafficPolicy Local.
    pub const NODE_PORTS_LOCAL: u16 = 1 << 2;
    /// External IPs.
    pub const EXTERNAL_IPS: u16 = 1 << 3;
    /// External IPs with externalTrafficPolicy Local.
    pub const EXTERNAL_IPS_LOCAL: u16 = 1 << 4;
    /// Load-balancer ingress IPs.
    pub const LOAD_BALANCERS: u16 = 1 << 5;
    /// Load-balancer IPs with externalTrafficPolicy Local.
    pub const LOAD_BALANCERS_LOCAL: u16 = 1 << 6;
    /// loadBalancerSourceRanges.
    pub const LB_SOURCE_RANGES: u16 = 1 << 7;
    /// Health-check node ports.
    pub const HEALTH_CHECK_NODE_PORTS: u16 = 1 << 8;
    /// Hairpin (local endpoints: KUBE-LOOP-BACK).
    pub const LOOP_BACK: u16 = 1 << 9;
    /// Number of feature bits.
    pub const COUNT: usize = 10;

    /// True when `bit` is set.
    pub fn has(self, bit: u16) -> bool {
        self.0 & bit != 0
    }
}

/// What the iptables crate needs to render its rules: configuration plus the features in use.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct IptablesInputs {
    /// `--masquerade-all`.
    pub masquerade_all: bool,
    /// `--cluster-cidr` ranges of this family.
    pub cluster_cidrs: Vec<IpNet>,
    /// Any TCP/UDP node port.
    pub node_ports: bool,
    /// Any SCTP node port.
    pub sctp_node_ports: bool,
    /// Any node port with externalTrafficPolicy Local.
    pub node_ports_local: bool,
    /// Any external IP.
    pub external_ips: bool,
    /// Any external IP with externalTrafficPolicy Local.
    pub external_ips_local: bool,
    /// Any load-balancer IP.
    pub load_balancers: bool,
    /// Any load-balancer IP with externalTrafficPolicy Local.
    pub load_balancers_local: bool,
    /// Any loadBalancerSourceRanges.
    pub lb_source_ranges: bool,
    /// Any health-check node port.
    pub health_check_node_ports: bool,
    /// Any hairpin entry.
    pub loop_back: bool,
}

/// The first bit of the firewall marks of the in-cluster virtual servers (see [`InClusterPort`]).
/// A mark is this bit plus a 14-bit id (1..=0x3fff); the bits between leave upstream's masquerade
/// (0x4000) and drop (0x8000) marks alone.
pub const IN_CLUSTER_MARK_BIT: u32 = 0x0400_0000;
/// The bits an in-cluster mark owns: [`IN_CLUSTER_MARK_BIT`] and the 14-bit id.
pub const IN_CLUSTER_MARK_MASK: u32 = IN_CLUSTER_MARK_BIT | IN_CLUSTER_MARK_IDS;
/// The id part of an in-cluster mark.
pub(crate) const IN_CLUSTER_MARK_IDS: u32 = 0x3fff;

/// True when `mark` is one of the proxy's in-cluster marks (its IPVS services are owned).
pub fn is_in_cluster_mark(mark: u32) -> bool {
    mark & !IN_CLUSTER_MARK_MASK == 0
        && mark & IN_CLUSTER_MARK_BIT != 0
        && mark & IN_CLUSTER_MARK_IDS != 0
}

/// An external destination (address, protocol, port) of an externalTrafficPolicy=Local port:
/// a load-balancer IP, an externalIP, or a node IP with the nodePort.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct InClusterDest {
    /// Destination address.
    pub ip: IpAddr,
    /// Transport protocol.
    pub protocol: Protocol,
    /// Destination port.
    pub port: u16,
}

/// One externalTrafficPolicy=Local service port's path for in-cluster traffic.
///
/// Kubernetes' iptables and nftables proxiers restrict only traffic from outside the cluster to
/// local endpoints: traffic from pods (local-traffic detection) and from the node itself to the
/// external destinations goes to all cluster-policy endpoints, node-originated traffic
/// masqueraded (upstream `syncProxyRules`, pkg/proxy/iptables/proxier.go: "pod traffic for ...
/// external destinations", "masquerade LOCAL traffic", "route LOCAL traffic"). Upstream's IPVS
/// mode never did (k/k#75262). Here such traffic is marked in the nat table and taken by a
/// firewall-mark virtual server with the cluster-policy endpoints, which IPVS looks up before
/// the address virtual servers (`ip_vs_service_find`); everything else keeps the address virtual
/// server with the local endpoints.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InClusterPort {
    /// The service port (its mark is allocated per port).
    pub port: ServicePortName,
    /// The virtual server, keyed by a placeholder mark until [`crate::Desired`] allocates one.
    pub template: VirtualServer,
    /// The destinations whose in-cluster traffic it takes.
    pub dests: BTreeSet<InClusterDest>,
}

/// A destination and the mark its in-cluster traffic gets (one nat rule each).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct InClusterMark {
    /// The destination.
    pub dest: InClusterDest,
    /// The firewall mark of its in-cluster virtual server.
    pub mark: u32,
}

/// Everything one Service needs on this node (one family).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct ServiceDesired {
    /// Virtual servers with their real servers.
    pub virtual_servers: SortedMap<ServiceKey, VirtualServer>,
    /// Addresses to bind on kube-ipvs0 (ClusterIPs, LB IPs, externalIPs not already local).
    pub addresses: SortedVec<IpAddr>,
    /// ipset members.
    pub ipset_entries: SortedVec<IpsetEntry>,
    /// iptables features used.
    pub features: Features,
    /// Health-check node port, if any.
    pub health_check: Option<HealthCheck>,
    /// Depends on the node's addresses (NodePorts, LB source ranges).
    pub node_dependent: bool,
    /// Ports whose internalTrafficPolicy Local leaves them without endpoints here.
    pub no_local_internal: u32,
    /// Ports whose externalTrafficPolicy Local leaves them without endpoints here.
    pub no_local_external: u32,
    /// In-cluster paths of externalTrafficPolicy=Local ports (as derived, before marks).
    pub in_cluster: Vec<InClusterPort>,
    /// The marks [`crate::Desired`] allocated to those ports (their firewall-mark virtual servers are
    /// in `virtual_servers`).
    pub fwmarks: BTreeMap<ServicePortName, u32>,
}

/// Result of deriving one service.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Derived {
    /// The service's desired state; `None` when the proxy has nothing to do for it here
    /// (headless, ExternalName, no ClusterIP of this family).
    pub desired: Option<ServiceDesired>,
    /// EndpointSlices skipped as invalid (slice name, reason); the rest were used.
    pub rejected_slices: Vec<(String, Invalid)>,
}
