//! The 17 kube-proxy ipsets: names, types, families and comments as upstream creates them.

use std::fmt;

/// Address family of a hash set (`family inet` / `family inet6`): the one [`net_types::Family`].
pub use net_types::Family;

/// ipset set types used by kube-proxy.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum SetType {
    /// `hash:ip`
    HashIp,
    /// `hash:ip,port`
    HashIpPort,
    /// `hash:ip,port,ip`
    HashIpPortIp,
    /// `hash:ip,port,net`
    HashIpPortNet,
    /// `bitmap:port`
    BitmapPort,
}

impl SetType {
    /// The type name as `ipset create` takes it and `ipset save` prints it.
    pub fn as_str(self) -> &'static str {
        match self {
            SetType::HashIp => "hash:ip",
            SetType::HashIpPort => "hash:ip,port",
            SetType::HashIpPortIp => "hash:ip,port,ip",
            SetType::HashIpPortNet => "hash:ip,port,net",
            SetType::BitmapPort => "bitmap:port",
        }
    }

    /// Parse a type name; `None` for types kube-proxy does not use.
    pub fn parse(s: &str) -> Option<SetType> {
        Some(match s {
            "hash:ip" => SetType::HashIp,
            "hash:ip,port" => SetType::HashIpPort,
            "hash:ip,port,ip" => SetType::HashIpPortIp,
            "hash:ip,port,net" => SetType::HashIpPortNet,
            "bitmap:port" => SetType::BitmapPort,
            _ => return None,
        })
    }

    /// Whether the type is a hash type (has a family).
    pub fn is_hash(self) -> bool {
        !matches!(self, SetType::BitmapPort)
    }
}

impl fmt::Display for SetType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// One of the 17 sets kube-proxy's IPVS mode maintains.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum SetKind {
    /// `KUBE-LOOP-BACK` (hash:ip,port,ip): endpoint ip,proto:port,endpoint ip for hairpin masquerade.
    LoopBack,
    /// `KUBE-CLUSTER-IP` (hash:ip,port): cluster IP + port.
    ClusterIp,
    /// `KUBE-EXTERNAL-IP` (hash:ip,port): external IP + port.
    ExternalIp,
    /// `KUBE-EXTERNAL-IP-LOCAL` (hash:ip,port): external IP + port with externalTrafficPolicy=Local.
    ExternalIpLocal,
    /// `KUBE-LOAD-BALANCER` (hash:ip,port): load-balancer ingress IP + port.
    LoadBalancer,
    /// `KUBE-LOAD-BALANCER-LOCAL` (hash:ip,port): LB IP + port with externalTrafficPolicy=Local.
    LoadBalancerLocal,
    /// `KUBE-LOAD-BALANCER-FW` (hash:ip,port): LB IP + port with loadBalancerSourceRanges.
    LoadBalancerFw,
    /// `KUBE-LOAD-BALANCER-SOURCE-IP` (hash:ip,port,ip): LB IP + port + allowed source IP.
    LoadBalancerSourceIp,
    /// `KUBE-LOAD-BALANCER-SOURCE-CIDR` (hash:ip,port,net): LB IP + port + allowed source CIDR.
    LoadBalancerSourceCidr,
    /// `KUBE-NODE-PORT-TCP` (bitmap:port).
    NodePortTcp,
    /// `KUBE-NODE-PORT-LOCAL-TCP` (bitmap:port).
    NodePortLocalTcp,
    /// `KUBE-NODE-PORT-UDP` (bitmap:port).
    NodePortUdp,
    /// `KUBE-NODE-PORT-LOCAL-UDP` (bitmap:port).
    NodePortLocalUdp,
    /// `KUBE-NODE-PORT-SCTP-HASH` (hash:ip,port): node IP + SCTP node port.
    NodePortSctp,
    /// `KUBE-NODE-PORT-LOCAL-SCTP-HASH` (hash:ip,port): node IP + SCTP node port, ETP=Local.
    NodePortLocalSctp,
    /// `KUBE-HEALTH-CHECK-NODE-PORT` (bitmap:port).
    HealthCheckNodePort,
    /// `KUBE-IPVS-IPS` (hash:ip): every address on kube-ipvs0.
    IpvsIps,
}

/// Maximum length of an ipset name (`IPSET_MAXNAMELEN - 1`).
pub const MAX_NAME_LEN: usize = 31;

impl SetKind {
    /// All 17 sets, in upstream's creation order.
    pub const ALL: [SetKind; 17] = [
        SetKind::LoopBack,
        SetKind::ClusterIp,
        SetKind::ExternalIp,
        SetKind::ExternalIpLocal,
        SetKind::LoadBalancer,
        SetKind::LoadBalancerFw,
        SetKind::LoadBalancerLocal,
        SetKind::LoadBalancerSourceIp,
        SetKind::LoadBalancerSourceCidr,
        SetKind::NodePortTcp,
        SetKind::NodePortLocalTcp,
        SetKind::NodePortUdp,
        SetKind::NodePortLocalUdp,
        SetKind::NodePortSctp,
        SetKind::NodePortLocalSctp,
        SetKind::HealthCheckNodePort,
        SetKind::IpvsIps,
    ];

    /// The IPv4 name (`KUBE-…`).
    pub fn base_name(self) -> &'static str {
        match self {
            SetKind::LoopBack => "KUBE-LOOP-BACK",
            SetKind::ClusterIp => "KUBE-CLUSTER-IP",
            SetKind::ExternalIp => "KUBE-EXTERNAL-IP",
            SetKind::ExternalIpLocal => "KUBE-EXTERNAL-IP-LOCAL",
            SetKind::LoadBalancer => "KUBE-LOAD-BALANCER",
            SetKind::LoadBalancerLocal => "KUBE-LOAD-BALANCER-LOCAL",
            SetKind::LoadBalancerFw => "KUBE-LOAD-BALANCER-FW",
            SetKind::LoadBalancerSourceIp => "KUBE-LOAD-BALANCER-SOURCE-IP",
            SetKind::LoadBalancerSourceCidr => "KUBE-LOAD-BALANCER-SOURCE-CIDR",
            SetKind::NodePortTcp => "KUBE-NODE-PORT-TCP",
            SetKind::NodePortLocalTcp => "KUBE-NODE-PORT-LOCAL-TCP",
            SetKind::NodePortUdp => "KUBE-NODE-PORT-UDP",
            SetKind::NodePortLocalUdp => "KUBE-NODE-PORT-LOCAL-UDP",
            SetKind::NodePortSctp => "KUBE-NODE-PORT-SCTP-HASH",
            SetKind::NodePortLocalSctp => "KUBE-NODE-PORT-LOCAL-SCTP-HASH",
            SetKind::HealthCheckNodePort => "KUBE-HEALTH-CHECK-NODE-PORT",
            SetKind::IpvsIps => "KUBE-IPVS-IPS",
        }
    }

    /// The set name for a family: IPv6 sets replace the `KUBE-` prefix with `KUBE-6-` and are
    /// truncated to 31 characters like upstream (`KUBE-6-LOAD-BALANCER-SOURCE-CID`).
    pub fn name(self, family: Family) -> String {
        match family {
            Family::Inet => self.base_name().to_string(),
            Family::Inet6 => {
                let rest = self.base_name().trim_start_matches("KUBE-");
                let mut n = format!("KUBE-6-{rest}");
                n.truncate(MAX_NAME_LEN);
                n
            }
        }
    }

    /// The set's type.
    pub fn set_type(self) -> SetType {
        match self {
            SetKind::LoopBack | SetKind::LoadBalancerSourceIp => SetType::HashIpPortIp,
            SetKind::LoadBalancerSourceCidr => SetType::HashIpPortNet,
            SetKind::NodePortTcp
            | SetKind::NodePortLocalTcp
            | SetKind::NodePortUdp
            | SetKind::NodePortLocalUdp
            | SetKind::HealthCheckNodePort => SetType::BitmapPort,
            SetKind::IpvsIps => SetType::HashIp,
            SetKind::ClusterIp
            | SetKind::ExternalIp
            | SetKind::ExternalIpLocal
            | SetKind::LoadBalancer
            | SetKind::LoadBalancerLocal
            | SetKind::LoadBalancerFw
            | SetKind::NodePortSctp
            | SetKind::NodePortLocalSctp => SetType::HashIpPort,
        }
    }

    /// Upstream's comment for the set (used in iptables `-m comment` of rules matching it).
    pub fn comment(self) -> &'static str {
        match self {
            SetKind::LoopBack => {
                "Kubernetes endpoints dst ip:port, source ip for solving hairpin purpose"
            }
            SetKind::ClusterIp => "Kubernetes service cluster ip + port for masquerade purpose",
            SetKind::ExternalIp => {
                "Kubernetes service external ip + port for masquerade and filter purpose"
            }
            SetKind::ExternalIpLocal => {
                "Kubernetes service external ip + port with externalTrafficPolicy=local"
            }
            SetKind::LoadBalancer => "Kubernetes service lb portal",
            SetKind::LoadBalancerLocal => {
                "Kubernetes service load balancer ip + port with externalTrafficPolicy=local"
            }
            SetKind::LoadBalancerFw => {
                "Kubernetes service load balancer ip + port for load balancer with sourceRange"
            }
            SetKind::LoadBalancerSourceIp => {
                "Kubernetes service load balancer ip + port + source IP for packet filter purpose"
            }
            SetKind::LoadBalancerSourceCidr => {
                "Kubernetes service load balancer ip + port + source cidr for packet filter purpose"
            }
            SetKind::NodePortTcp => "Kubernetes nodeport TCP port for masquerade purpose",
            SetKind::NodePortLocalTcp => {
                "Kubernetes nodeport TCP port with externalTrafficPolicy=local"
            }
            SetKind::NodePortUdp => "Kubernetes nodeport UDP port for masquerade purpose",
            SetKind::NodePortLocalUdp => {
                "Kubernetes nodeport UDP port with externalTrafficPolicy=local"
            }
            SetKind::NodePortSctp => {
                "Kubernetes nodeport SCTP port for masquerade purpose with type 'hash ip:port'"
            }
            SetKind::NodePortLocalSctp => {
                "Kubernetes nodeport SCTP port with externalTrafficPolicy=local with type 'hash ip:port'"
            }
            SetKind::HealthCheckNodePort => "Kubernetes health check node port",
            SetKind::IpvsIps => "Addresses on the ipvs interface",
        }
    }

    /// The creation parameters for this set in a family.
    pub fn spec(self, family: Family) -> SetSpec {
        SetSpec::new(self.name(family), self.set_type(), family)
    }

    /// Which set (and family) a name belongs to.
    pub fn from_name(name: &str) -> Option<(SetKind, Family)> {
        for fam in [Family::Inet, Family::Inet6] {
            for k in SetKind::ALL {
                if k.name(fam) == name {
                    return Some((k, fam));
                }
            }
        }
        None
    }

    /// All 17 set names of a family (the "owned" list for [`crate::Ipset::read`]).
    pub fn all_names(family: Family) -> Vec<String> {
        SetKind::ALL.iter().map(|k| k.name(family)).collect()
    }
}

/// `maxelem` of every hash set kube-ipvs creates (upstream's default): the kernel refuses a
/// member beyond it.
pub const MAX_ELEM: u32 = 65536;

/// How a set is (to be) created.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SetSpec {
    /// Set name.
    pub name: String,
    /// Set type.
    pub set_type: SetType,
    /// Family (ignored for bitmap:port, which has none).
    pub family: Family,
    /// `hashsize` for hash types (upstream: 1024).
    pub hash_size: u32,
    /// `maxelem` for hash types (upstream: 65536).
    pub max_elem: u32,
}

impl SetSpec {
    /// A spec with upstream's defaults (hashsize 1024, maxelem 65536).
    pub fn new(name: impl Into<String>, set_type: SetType, family: Family) -> SetSpec {
        SetSpec {
            name: name.into(),
            set_type,
            family,
            hash_size: 1024,
            max_elem: MAX_ELEM,
        }
    }

    /// Whether an existing set with spec `other` can be kept (same type, and same family for
    /// hash types). Size parameters are not compared: the kernel grows hash sets itself.
    pub fn compatible_with(&self, other: &SetSpec) -> bool {
        self.set_type == other.set_type && (!self.set_type.is_hash() || self.family == other.family)
    }

    /// The `create` arguments after the name, as upstream passes them:
    /// `hash:ip,port family inet hashsize 1024 maxelem 65536 comment` or
    /// `bitmap:port range 0-65535 comment`.
    pub fn create_args(&self) -> String {
        if self.set_type.is_hash() {
            format!(
                "{} family {} hashsize {} maxelem {} comment",
                self.set_type,
                self.family.as_str(),
                self.hash_size,
                self.max_elem
            )
        } else {
            format!("{} range 0-65535 comment", self.set_type)
        }
    }
}
