//! The model: Kubernetes objects turned into proxy concepts (service ports, endpoints). Pure.
//!
//! - [`service_ports`] turns one `Service` into the [`ServicePort`]s of one address family
//!   (one proxier instance per family; a dual-stack process runs two).
//! - [`endpoints`] merges every EndpointSlice of a service into the [`Endpoint`]s of one port.
//! - [`select_endpoints`] applies Kubernetes' endpoint rules: ready first, serving-terminating as
//!   a fall-back, `internalTrafficPolicy`/`externalTrafficPolicy: Local` (no local endpoint means no
//!   real server: traffic is dropped, never sent to remote endpoints), topology hints.
//!
//! Bad input (invalid IPs or CIDRs, ports 0 or > 65535, unknown protocols, duplicate ports,
//! absurd sizes) is rejected with an [`Invalid`] reason: a bad Service is skipped as a whole, a
//! bad EndpointSlice is skipped alone (the service's other slices still count). Nothing here
//! panics on any input. [`Rejections`] remembers reasons so each is logged once and counted.
//!
//! Size caps (documented limits, far above what the API server admits in practice):
//! [`MAX_PORTS_PER_SERVICE`], [`MAX_VIPS_PER_SERVICE`], [`MAX_SOURCE_RANGES`],
//! [`MAX_ENDPOINTS_PER_SLICE`] (the API's own limit), [`MAX_ENDPOINTS_PER_SERVICE_PORT`].

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::fmt;
use std::net::IpAddr;
use std::sync::Arc;

use ipnet::IpNet;
use ipvs_netlink::{Family, Protocol};
use k8s_openapi::api::core::v1::{Node, Service};
use k8s_openapi::api::discovery::v1::EndpointSlice;

use crate::objects::{AddressType, Slice, Svc};

/// Per-service annotation choosing the IPVS scheduler (overrides the global flag).
pub const SCHEDULER_ANNOTATION: &str = "kube-ipvs.io/scheduler";
/// Per-service annotation setting the IPVS scheduler flags (`ipvsadm -b`): a comma-separated
/// list of `sh-fallback`, `sh-port` (scheduler `sh`) and `mh-fallback`, `mh-port` (scheduler
/// `mh`); empty for none. Without it a service gets upstream's flags: `mh-port` with `mh`.
pub const SCHEDULER_FLAGS_ANNOTATION: &str = "kube-ipvs.io/scheduler-flags";

/// The scheduler flags of a service: the annotation's, checked against the scheduler, else
/// upstream's default (`mh` gets `FlagSourceHash`, i.e. `mh-port`: `syncProxyRules` in
/// pkg/proxy/ipvs/proxier.go, "Set the source hash flag needed for the distribution method
/// mh"; no flag for the other schedulers).
pub fn scheduler_flags(scheduler: &str, annotation: Option<&str>) -> Result<u32, Invalid> {
    use ipvs_netlink::ServiceFlags as F;
    let Some(list) = annotation else {
        return Ok(if scheduler == "mh" { F::MH_PORT } else { 0 });
    };
    let mut bits = 0;
    for word in list.split(',').map(str::trim).filter(|w| !w.is_empty()) {
        let (bit, needs) = match word {
            "sh-fallback" => (F::SH_FALLBACK, "sh"),
            "sh-port" => (F::SH_PORT, "sh"),
            "mh-fallback" => (F::MH_FALLBACK, "mh"),
            "mh-port" => (F::MH_PORT, "mh"),
            other => {
                return Err(Invalid::new(format!(
                    "unknown scheduler flag {other:?} in annotation {SCHEDULER_FLAGS_ANNOTATION} \
                     (sh-fallback, sh-port, mh-fallback, mh-port)"
                )))
            }
        };
        if scheduler != needs {
            return Err(Invalid::new(format!(
                "scheduler flag {word:?} in annotation {SCHEDULER_FLAGS_ANNOTATION} needs \
                 scheduler {needs:?}, not {scheduler:?}"
            )));
        }
        bits |= bit;
    }
    Ok(bits)
}
/// Label of an EndpointSlice naming its Service.
pub const SERVICE_NAME_LABEL: &str = "kubernetes.io/service-name";
/// Node label carrying the node's zone.
pub const ZONE_LABEL: &str = "topology.kubernetes.io/zone";
/// Default `sessionAffinityConfig.clientIP.timeoutSeconds` (3 hours).
pub const DEFAULT_AFFINITY_TIMEOUT: u32 = 10_800;
/// Largest affinity timeout the API admits (1 day).
pub const MAX_AFFINITY_TIMEOUT: u32 = 86_400;
/// Most ports one Service may have before it is rejected.
pub const MAX_PORTS_PER_SERVICE: usize = 1_000;
/// Most externalIPs + load-balancer ingress IPs one Service may have before it is rejected.
pub const MAX_VIPS_PER_SERVICE: usize = 256;
/// Most `loadBalancerSourceRanges` one Service may have before it is rejected.
pub const MAX_SOURCE_RANGES: usize = 1_000;
/// Most endpoints one EndpointSlice may have (the API's limit); a larger slice is rejected.
pub const MAX_ENDPOINTS_PER_SLICE: usize = 1_000;
/// Most endpoints of one service port after merging slices; slices (in name order) that would
/// push the count beyond it are rejected.
pub const MAX_ENDPOINTS_PER_SERVICE_PORT: usize = 20_000;
/// IPVS schedulers the kernel ships: the one table, shared with `ipvs.scheduler`.
pub use ipvs_netlink::SCHEDULERS;

/// Why an object was rejected.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Invalid {
    /// Human-readable reason, stable for identical input (so it can be logged once).
    pub reason: String,
}

impl Invalid {
    /// An `Invalid` with the given reason.
    pub fn new(reason: impl Into<String>) -> Invalid {
        Invalid {
            reason: reason.into(),
        }
    }
}

impl fmt::Display for Invalid {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.reason)
    }
}

/// A Service's identity: namespace/name. The strings are shared: the store, the desired
/// state and the VIP claims hold copies of every name, and a copy is a reference count.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ServiceName {
    /// Namespace.
    pub namespace: Arc<str>,
    /// Name.
    pub name: Arc<str>,
}

impl Default for ServiceName {
    fn default() -> Self {
        ServiceName::new("", "")
    }
}

impl ServiceName {
    /// `namespace/name`.
    pub fn new(namespace: impl AsRef<str>, name: impl AsRef<str>) -> ServiceName {
        ServiceName {
            namespace: Arc::from(namespace.as_ref()),
            name: Arc::from(name.as_ref()),
        }
    }

    /// The name of a Service object (`default` namespace when unset).
    pub fn of(svc: &Service) -> ServiceName {
        ServiceName::new(
            svc.metadata.namespace.as_deref().unwrap_or("default"),
            svc.metadata.name.as_deref().unwrap_or_default(),
        )
    }
}

impl fmt::Display for ServiceName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.namespace, self.name)
    }
}

/// One port of one Service: namespace, name, port name and protocol.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ServicePortName {
    /// Namespace of the Service.
    pub namespace: Arc<str>,
    /// Name of the Service.
    pub name: Arc<str>,
    /// Name of the port (empty when unnamed).
    pub port_name: String,
    /// Transport protocol.
    pub protocol: Protocol,
}

impl ServicePortName {
    /// The Service this port belongs to.
    pub fn service(&self) -> ServiceName {
        ServiceName::new(self.namespace.clone(), self.name.clone())
    }
}

impl fmt::Display for ServicePortName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}:{}", self.namespace, self.name, self.port_name)?;
        f.write_str(match self.protocol {
            Protocol::Tcp => "/TCP",
            Protocol::Udp => "/UDP",
            Protocol::Sctp => "/SCTP",
        })
    }
}

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
}

impl ProxyConfig {
    /// Defaults for a family: scheduler `rr`, no ranges, no timeouts.
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
    /// Node info from the Node object (zone label, primary IPs) and local interface addresses.
    /// Unparsable `status.addresses` entries are ignored (they are informational only).
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
                    if let Ok(ip) = a.address.parse::<IpAddr>() {
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
            if let Ok(n) = c.parse::<IpNet>() {
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

/// One service port of one family, with every virtual IP it is reachable on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ServicePort {
    /// Identity.
    pub name: ServicePortName,
    /// ClusterIP of this family.
    pub cluster_ip: IpAddr,
    /// Service port.
    pub port: u16,
    /// NodePort (NodePort and LoadBalancer services), if allocated.
    pub node_port: Option<u16>,
    /// `spec.externalIPs` of this family.
    pub external_ips: Vec<IpAddr>,
    /// `status.loadBalancer.ingress[].ip` of this family (LoadBalancer services).
    pub load_balancer_ips: Vec<IpAddr>,
    /// `spec.loadBalancerSourceRanges` of this family.
    pub source_ranges: Vec<IpNet>,
    /// True when the service has source ranges at all (in any family): with none in this
    /// family the firewall is on and admits nobody.
    pub firewall: bool,
    /// externalTrafficPolicy Local (NodePort / LoadBalancer services only).
    pub external_local: bool,
    /// internalTrafficPolicy Local.
    pub internal_local: bool,
    /// ClientIP session affinity timeout (seconds), if affinity is on.
    pub affinity_timeout: Option<u32>,
    /// IPVS scheduler.
    pub scheduler: String,
    /// IPVS scheduler flags (`ServiceFlags` bits: sh-fallback, sh-port, mh-fallback, mh-port).
    pub scheduler_flags: u32,
    /// Health-check node port (LoadBalancer + externalTrafficPolicy Local).
    pub health_check_node_port: Option<u16>,
}

impl ServicePort {
    /// Reachable from outside the cluster: a NodePort, externalIPs or load-balancer IPs.
    pub fn externally_accessible(&self) -> bool {
        self.external_local
            || self.node_port.is_some()
            || !self.external_ips.is_empty()
            || !self.load_balancer_ips.is_empty()
    }
}

/// Which Local traffic policies of a service port leave it without endpoints on this node while
/// it has endpoints it could otherwise reach (kube-proxy's
/// `sync_proxy_rules_no_local_endpoints_total{traffic_policy}`: such traffic is dropped; a port
/// with no reachable endpoint at all is rejected instead and not counted).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct NoLocalEndpoints {
    /// internalTrafficPolicy Local and no local endpoint.
    pub internal: bool,
    /// externalTrafficPolicy Local and no local endpoint.
    pub external: bool,
}

impl NoLocalEndpoints {
    /// For a port with these policies, given whether it has cluster-wide and local endpoints
    /// (each as selected before the traffic policies apply).
    pub fn of(
        internal_local: bool,
        external_local: bool,
        externally_accessible: bool,
        has_cluster: bool,
        has_local: bool,
    ) -> NoLocalEndpoints {
        let uses_cluster = !internal_local || (externally_accessible && !external_local);
        let uses_local = internal_local || external_local;
        let reachable = (uses_cluster && has_cluster) || (uses_local && has_local);
        let gap = reachable && !has_local;
        NoLocalEndpoints {
            internal: gap && internal_local,
            external: gap && external_local,
        }
    }
}

/// One endpoint (pod address and target port) of a service port.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Endpoint {
    /// Address.
    pub ip: IpAddr,
    /// Target port.
    pub port: u16,
    /// `nodeName`.
    pub node_name: Option<String>,
    /// `hints.forZones` (None when the endpoint carries no zone hints).
    pub zone_hints: Option<BTreeSet<String>>,
    /// `hints.forNodes` (None when the endpoint carries no node hints): set by the
    /// EndpointSlice controller for `trafficDistribution: PreferSameNode`.
    pub node_hints: Option<BTreeSet<String>>,
    /// `conditions.ready` (unset = true).
    pub ready: bool,
    /// `conditions.serving` (unset = ready).
    pub serving: bool,
    /// `conditions.terminating` (unset = false).
    pub terminating: bool,
    /// Runs on this node.
    pub is_local: bool,
}

fn parse_protocol(p: Option<&str>) -> Result<Protocol, Invalid> {
    match p {
        None | Some("TCP") => Ok(Protocol::Tcp),
        Some("UDP") => Ok(Protocol::Udp),
        Some("SCTP") => Ok(Protocol::Sctp),
        Some(other) => Err(Invalid::new(format!("unknown protocol {other:?}"))),
    }
}

fn parse_port(what: &str, p: i32) -> Result<u16, Invalid> {
    match u16::try_from(p) {
        Ok(v) if v != 0 => Ok(v),
        _ => Err(Invalid::new(format!("{what} {p} out of range 1..65535"))),
    }
}

fn parse_ip(what: &str, s: &str) -> Result<IpAddr, Invalid> {
    s.parse::<IpAddr>()
        .map_err(|_| Invalid::new(format!("invalid {what} {s:?}")))
}

fn parse_cidr(s: &str) -> Result<IpNet, Invalid> {
    let t = s.trim();
    if let Ok(n) = t.parse::<IpNet>() {
        return Ok(n.trunc());
    }
    // A bare address is accepted as a host route, as the API does.
    t.parse::<IpAddr>()
        .map(IpNet::from)
        .map_err(|_| Invalid::new(format!("invalid loadBalancerSourceRange {s:?}")))
}

/// The ServicePorts of one Service for `cfg.family`.
///
/// Returns `Ok(vec![])` for services the proxy does not handle: headless (`clusterIP: None`),
/// `ExternalName`, no ClusterIP of this family, or no ports. Returns `Err` for bad input; the
/// whole Service is then skipped.
pub fn service_ports(svc: &Svc, cfg: &ProxyConfig) -> Result<Vec<ServicePort>, Invalid> {
    let Some(spec) = svc.spec.as_deref() else {
        return Ok(Vec::new());
    };
    let svc_name = &svc.name;
    if !svc.named {
        return Err(Invalid::new("service without a name"));
    }
    let type_ = spec.type_.as_deref().unwrap_or("ClusterIP");
    match type_ {
        "ExternalName" => return Ok(Vec::new()),
        "ClusterIP" | "NodePort" | "LoadBalancer" => {}
        other => return Err(Invalid::new(format!("unknown service type {other:?}"))),
    }
    // Cluster IPs: clusterIPs (dual-stack) or clusterIP.
    let mut ips: Vec<&str> = spec
        .cluster_ips
        .as_ref()
        .map(|v| v.iter().map(|s| &**s).collect())
        .unwrap_or_default();
    if ips.is_empty() {
        if let Some(ip) = spec.cluster_ip.as_deref() {
            ips.push(ip);
        }
    }
    if ips.contains(&"None") || ips.iter().all(|ip| ip.is_empty()) {
        return Ok(Vec::new());
    }
    if ips.len() > 2 {
        return Err(Invalid::new(format!("{} clusterIPs", ips.len())));
    }
    let mut cluster_ip = None;
    for s in &ips {
        let ip = parse_ip("clusterIP", s)?;
        if Family::of(&ip) == cfg.family && cluster_ip.is_none() {
            cluster_ip = Some(ip);
        }
    }
    let Some(cluster_ip) = cluster_ip else {
        return Ok(Vec::new());
    };

    let ports = spec.ports.as_deref().unwrap_or_default();
    if ports.len() > MAX_PORTS_PER_SERVICE {
        return Err(Invalid::new(format!(
            "{} ports (max {MAX_PORTS_PER_SERVICE})",
            ports.len()
        )));
    }

    let ext = spec.external_ips.as_deref().unwrap_or_default();
    let ingress: Vec<&str> = if type_ == "LoadBalancer" {
        spec.ingress
            .iter()
            .filter(|(_, mode)| is_vip_mode(mode.as_deref()))
            .map(|(ip, _)| &**ip)
            .collect()
    } else {
        Vec::new()
    };
    if ext.len() + ingress.len() > MAX_VIPS_PER_SERVICE {
        return Err(Invalid::new(format!(
            "{} external and load-balancer IPs (max {MAX_VIPS_PER_SERVICE})",
            ext.len() + ingress.len()
        )));
    }
    let mut external_ips = Vec::new();
    for s in ext {
        let ip = parse_ip("externalIP", s)?;
        if Family::of(&ip) == cfg.family && !external_ips.contains(&ip) {
            external_ips.push(ip);
        }
    }
    let mut load_balancer_ips = Vec::new();
    for s in ingress {
        let ip = parse_ip("load-balancer ingress IP", s)?;
        if Family::of(&ip) == cfg.family && !load_balancer_ips.contains(&ip) {
            load_balancer_ips.push(ip);
        }
    }
    let ranges = if type_ == "LoadBalancer" {
        spec.load_balancer_source_ranges
            .as_deref()
            .unwrap_or_default()
    } else {
        &[]
    };
    if ranges.len() > MAX_SOURCE_RANGES {
        return Err(Invalid::new(format!(
            "{} loadBalancerSourceRanges (max {MAX_SOURCE_RANGES})",
            ranges.len()
        )));
    }
    let mut source_ranges = Vec::new();
    for s in ranges {
        let n = parse_cidr(s)?;
        let fam = Family::of(&n.addr());
        if fam == cfg.family && !source_ranges.contains(&n) {
            source_ranges.push(n);
        }
    }
    let firewall = !ranges.is_empty();

    let externally = type_ == "NodePort" || type_ == "LoadBalancer";
    let external_local = externally
        && match spec.external_traffic_policy.as_deref() {
            None | Some("Cluster") => false,
            Some("Local") => true,
            Some(o) => return Err(Invalid::new(format!("unknown externalTrafficPolicy {o:?}"))),
        };
    let internal_local = match spec.internal_traffic_policy.as_deref() {
        None | Some("Cluster") => false,
        Some("Local") => true,
        Some(o) => return Err(Invalid::new(format!("unknown internalTrafficPolicy {o:?}"))),
    };
    let affinity_timeout = match spec.session_affinity.as_deref() {
        None | Some("None") => None,
        Some("ClientIP") => match spec.affinity_timeout {
            None => Some(DEFAULT_AFFINITY_TIMEOUT),
            Some(t) => match u32::try_from(t) {
                Ok(t) if (1..=MAX_AFFINITY_TIMEOUT).contains(&t) => Some(t),
                _ => return Err(Invalid::new(format!("affinity timeout {t} out of range"))),
            },
        },
        Some(o) => return Err(Invalid::new(format!("unknown sessionAffinity {o:?}"))),
    };
    let scheduler = match svc.scheduler.as_deref() {
        Some(s) if SCHEDULERS.contains(&s) => s.to_string(),
        Some(s) => {
            return Err(Invalid::new(format!(
                "unknown scheduler {s:?} in annotation {SCHEDULER_ANNOTATION}"
            )))
        }
        None => cfg.scheduler.clone(),
    };
    let scheduler_flags = scheduler_flags(&scheduler, svc.scheduler_flags.as_deref())?;
    let health_check_node_port = match spec.health_check_node_port {
        Some(p) if type_ == "LoadBalancer" && external_local => {
            Some(parse_port("healthCheckNodePort", p)?)
        }
        _ => None,
    };

    let mut out = Vec::with_capacity(ports.len());
    let mut seen_port = BTreeSet::new();
    let mut seen_name = BTreeSet::new();
    let mut seen_node_port = BTreeSet::new();
    for p in ports {
        let protocol = parse_protocol(p.protocol.as_deref())?;
        let port = parse_port("port", p.port)?;
        let port_name = p.name.as_deref().unwrap_or_default().to_string();
        if !seen_port.insert((port, protocol)) {
            return Err(Invalid::new(format!("duplicate port {port}/{protocol:?}")));
        }
        if !seen_name.insert(port_name.clone()) {
            return Err(Invalid::new(format!("duplicate port name {port_name:?}")));
        }
        let node_port = match (externally, p.node_port) {
            (true, Some(np)) => {
                let np = parse_port("nodePort", np)?;
                if !seen_node_port.insert((np, protocol)) {
                    return Err(Invalid::new(format!(
                        "duplicate nodePort {np}/{protocol:?}"
                    )));
                }
                Some(np)
            }
            _ => None,
        };
        out.push(ServicePort {
            name: ServicePortName {
                namespace: svc_name.namespace.clone(),
                name: svc_name.name.clone(),
                port_name,
                protocol,
            },
            cluster_ip,
            port,
            node_port,
            external_ips: external_ips.clone(),
            load_balancer_ips: load_balancer_ips.clone(),
            source_ranges: source_ranges.clone(),
            firewall,
            external_local,
            internal_local,
            affinity_timeout,
            scheduler: scheduler.clone(),
            scheduler_flags,
            health_check_node_port,
        });
    }
    Ok(out)
}

/// Checks an EndpointSlice as a whole: address type, sizes, addresses, ports, protocols.
/// `FQDN` slices are not an error (they are ignored by the proxy).
pub fn validate_slice(slice: &EndpointSlice) -> Result<(), Invalid> {
    let fam = match slice.address_type.as_str() {
        "IPv4" => Family::Inet,
        "IPv6" => Family::Inet6,
        "FQDN" => return Ok(()),
        o => return Err(Invalid::new(format!("unknown addressType {o:?}"))),
    };
    if slice.endpoints.len() > MAX_ENDPOINTS_PER_SLICE {
        return Err(Invalid::new(format!(
            "{} endpoints (max {MAX_ENDPOINTS_PER_SLICE})",
            slice.endpoints.len()
        )));
    }
    let ports = slice.ports.as_deref().unwrap_or_default();
    if ports.len() > MAX_PORTS_PER_SERVICE {
        return Err(Invalid::new(format!("{} ports", ports.len())));
    }
    let mut seen = BTreeSet::new();
    for p in ports {
        let proto = parse_protocol(p.protocol.as_deref())?;
        if let Some(n) = p.port {
            parse_port("endpoint port", n)?;
        }
        let name = p.name.clone().unwrap_or_default();
        if !seen.insert((name.clone(), proto)) {
            return Err(Invalid::new(format!("duplicate endpoint port {name:?}")));
        }
    }
    for ep in &slice.endpoints {
        if ep.addresses.len() > 100 {
            return Err(Invalid::new(format!(
                "endpoint with {} addresses",
                ep.addresses.len()
            )));
        }
        for a in &ep.addresses {
            let ip = parse_ip("endpoint address", a)?;
            if Family::of(&ip) != fam {
                return Err(Invalid::new(format!(
                    "endpoint address {a} does not match addressType {}",
                    slice.address_type
                )));
            }
        }
    }
    Ok(())
}

/// The annotation the EndpointSlice controller sets to when the change that produced this
/// version of the slice happened (a Pod or Service change): upstream's
/// `v1.EndpointsLastChangeTriggerTime`.
pub const LAST_CHANGE_TRIGGER_TIME_ANNOTATION: &str =
    "endpoints.kubernetes.io/last-change-trigger-time";

/// The slice's [`LAST_CHANGE_TRIGGER_TIME_ANNOTATION`] as a time: `None` when absent or not
/// RFC 3339. Like upstream's `getLastChangeTriggerTime`
/// (`pkg/proxy/endpointschangetracker.go`), an unparsable value is ignored. The endpoint
/// controllers derive it from the Pod's and the Service's change times (a new Service's
/// creation time), so it is where `kubeproxy_network_programming_duration_seconds` starts.
pub fn last_change_trigger_time(slice: &EndpointSlice) -> Option<std::time::SystemTime> {
    let value = slice
        .metadata
        .annotations
        .as_ref()?
        .get(LAST_CHANGE_TRIGGER_TIME_ANNOTATION)?;
    let ts: k8s_openapi::jiff::Timestamp = value.trim().parse().ok()?;
    Some(std::time::SystemTime::from(ts))
}

/// The service a slice belongs to (namespace + `kubernetes.io/service-name` label).
pub fn slice_service(slice: &EndpointSlice) -> Option<ServiceName> {
    let name = slice.metadata.labels.as_ref()?.get(SERVICE_NAME_LABEL)?;
    if name.is_empty() {
        return None;
    }
    Some(ServiceName::new(
        slice
            .metadata
            .namespace
            .clone()
            .unwrap_or_else(|| "default".to_string()),
        name.clone(),
    ))
}

/// Endpoints of one service port merged from all slices of its service.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct MergedEndpoints {
    /// Endpoints, deduplicated by (ip, port), sorted.
    pub endpoints: Vec<Endpoint>,
    /// Slices skipped, by slice name, with the reason.
    pub rejected: Vec<(String, Invalid)>,
}

/// Merges the endpoints of `port` from every slice of its service (`slices` in any order).
///
/// Only slices of `port`'s family are used. A slice port matches by name and protocol. An
/// endpoint present in several slices counts once; the "best" copy wins (ready over serving
/// over neither), so a slice mid-update never hides a ready endpoint.
pub fn endpoints(slices: &[&Slice], port: &ServicePort, node_name: &str) -> MergedEndpoints {
    let want = match Family::of(&port.cluster_ip) {
        Family::Inet => AddressType::V4,
        Family::Inet6 => AddressType::V6,
    };
    let mut sorted: Vec<&Slice> = slices.to_vec();
    sorted.sort_by(|a, b| a.name.cmp(&b.name));
    let mut merged: BTreeMap<(IpAddr, u16), Endpoint> = BTreeMap::new();
    let mut rejected = Vec::new();
    for slice in sorted {
        if slice.address_type != want {
            continue;
        }
        let slice_name = slice.name.to_string();
        if let Some(e) = &slice.invalid {
            rejected.push((slice_name, e.clone()));
            continue;
        }
        let target = slice.ports.iter().find(|p| {
            *p.name == port.name.port_name
                && parse_protocol(p.protocol.as_deref()).ok() == Some(port.name.protocol)
        });
        let Some(target) = target.and_then(|p| p.port) else {
            continue;
        };
        let Ok(tport) = u16::try_from(target) else {
            continue;
        };
        let mut new = Vec::new();
        for ep in &slice.endpoints {
            let ready = ep.ready.unwrap_or(true);
            let serving = ep.serving.unwrap_or(ready);
            let terminating = ep.terminating.unwrap_or(false);
            let hints = ep.hints.as_deref();
            let zone_hints = hints
                .and_then(|h| h.zones.as_ref())
                .map(|z| z.iter().map(|z| z.to_string()).collect::<BTreeSet<_>>());
            let node_hints = hints
                .and_then(|h| h.nodes.as_ref())
                .map(|n| n.iter().map(|n| n.to_string()).collect::<BTreeSet<_>>());
            new.push(Endpoint {
                ip: ep.ip,
                port: tport,
                node_name: ep.node_name.as_deref().map(str::to_string),
                zone_hints,
                node_hints,
                ready,
                serving,
                terminating,
                is_local: ep.node_name.as_deref() == Some(node_name) && !node_name.is_empty(),
            });
        }
        let added = new
            .iter()
            .filter(|e| !merged.contains_key(&(e.ip, e.port)))
            .count();
        if merged.len() + added > MAX_ENDPOINTS_PER_SERVICE_PORT {
            rejected.push((
                slice_name,
                Invalid::new(format!(
                    "service port would exceed {MAX_ENDPOINTS_PER_SERVICE_PORT} endpoints"
                )),
            ));
            continue;
        }
        for e in new {
            let rank = |e: &Endpoint| (e.ready, e.serving);
            match merged.get(&(e.ip, e.port)) {
                Some(old) if rank(old) >= rank(&e) => {}
                _ => {
                    merged.insert((e.ip, e.port), e);
                }
            }
        }
    }
    MergedEndpoints {
        endpoints: merged.into_values().collect(),
        rejected,
    }
}

/// The endpoints each kind of virtual server of a service port uses.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SelectedEndpoints {
    /// Real servers of the ClusterIP virtual server (internalTrafficPolicy applied).
    pub cluster: Vec<Endpoint>,
    /// Real servers of the external virtual servers: externalIPs, load-balancer IPs, NodePorts
    /// (externalTrafficPolicy applied).
    pub external: Vec<Endpoint>,
    /// Local endpoints (for the health-check node port and hairpin entries).
    pub local: Vec<Endpoint>,
    /// The cluster-policy endpoints whatever the traffic policies say: what in-cluster traffic
    /// to an externalTrafficPolicy=Local service's external destinations uses (upstream's
    /// `clusterPolicyChain`, which the iptables proxier's `syncProxyRules` sends pod and
    /// node-originated traffic for external destinations to). Filled only for ports with
    /// externalTrafficPolicy Local (other ports do not need it).
    pub cluster_policy: Vec<Endpoint>,
    /// Local policies that leave the port without endpoints (for the metric).
    pub no_local: NoLocalEndpoints,
}

impl SelectedEndpoints {
    /// The endpoints a health-check node port counts for this port: local and ready, never
    /// serving-terminating ones (those may still carry traffic, but a node with only
    /// terminating endpoints must fail the load balancer's check). Upstream:
    /// `EndpointsMap.LocalReadyEndpoints` / `getLocalReadyEndpointIPs` (pkg/proxy/endpoints.go).
    pub fn health_check_ips(&self) -> impl Iterator<Item = IpAddr> + '_ {
        self.local.iter().filter(|e| e.ready).map(|e| e.ip)
    }
}

/// Whether a load-balancer ingress IP is programmed on the node (KEP-1860, GA in 1.32): `VIP`
/// (or no `ipMode`, the default) makes it a virtual IP like an externalIP; `Proxy` means the
/// load balancer delivers traffic to the node itself, so the IP gets no virtual server, no
/// kube-ipvs0 address and no ipset entry. Upstream: `proxyutil.IsVIPMode`, applied in
/// `newBaseServiceInfo` (pkg/proxy/serviceport.go), which skips non-VIP ingress IPs.
fn is_vip_mode(ip_mode: Option<&str>) -> bool {
    ip_mode.is_none_or(|m| m == "VIP")
}

/// Which endpoint hints restrict the cluster endpoints of a service port on this node.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TopologyMode {
    /// No restriction: every ready endpoint.
    None,
    /// `trafficDistribution: PreferSameNode` (hints.forNodes): endpoints hinted for this node.
    SameNode,
    /// Zone hints (topology-aware routing, `PreferSameZone`/`PreferClose`): endpoints hinted for
    /// this node's zone.
    SameZone,
}

/// The topology mode the hints allow, with upstream's fallbacks (`topologyModeFromHints`,
/// pkg/proxy/topology.go, PreferSameTrafficDistribution GA in 1.35): node hints win when every
/// ready endpoint has one and at least one names this node; otherwise zone hints when every ready
/// endpoint has one and at least one names this node's zone; otherwise none.
pub fn topology_mode(eps: &[Endpoint], node_name: &str, zone: Option<&str>) -> TopologyMode {
    let (mut all_node, mut for_node) = (true, false);
    let (mut all_zone, mut for_zone) = (true, false);
    for e in eps.iter().filter(|e| e.ready) {
        match &e.node_hints {
            None => all_node = false,
            Some(n) => for_node |= n.contains(node_name),
        }
        match &e.zone_hints {
            None => all_zone = false,
            Some(z) => for_zone |= zone.is_some_and(|zn| z.contains(zn)),
        }
    }
    if all_node && for_node {
        TopologyMode::SameNode
    } else if all_zone && for_zone {
        TopologyMode::SameZone
    } else {
        TopologyMode::None
    }
}

impl TopologyMode {
    /// Whether `e` may serve this node under this mode (upstream `availableForTopology`).
    fn admits(self, e: &Endpoint, node_name: &str, zone: Option<&str>) -> bool {
        match self {
            TopologyMode::None => true,
            TopologyMode::SameNode => e.node_hints.as_ref().is_some_and(|n| n.contains(node_name)),
            TopologyMode::SameZone => e
                .zone_hints
                .as_ref()
                .is_some_and(|z| zone.is_some_and(|zn| z.contains(zn))),
        }
    }
}

/// Kubernetes' endpoint selection for one service port.
///
/// - Cluster endpoints: ready ones (restricted to those hinted for this node or this zone when
///   [`topology_mode`] says so); if none, serving-and-terminating ones (upstream
///   `CategorizeEndpoints`, pkg/proxy/topology.go).
/// - Local endpoints: ready local ones; if none, serving-and-terminating local ones.
/// - ClusterIP uses local endpoints with internalTrafficPolicy Local, else cluster endpoints.
///   External VIPs use local endpoints with externalTrafficPolicy Local, else cluster endpoints.
///   An empty local set stays empty (traffic is dropped), unlike upstream IPVS (k/k#97081).
pub fn select_endpoints(
    port: &ServicePort,
    eps: &[Endpoint],
    node_name: &str,
    zone: Option<&str>,
) -> SelectedEndpoints {
    let topo = topology_mode(eps, node_name, zone);
    let mut cluster: Vec<Endpoint> = eps
        .iter()
        .filter(|e| e.ready && topo.admits(e, node_name, zone))
        .cloned()
        .collect();
    if cluster.is_empty() {
        cluster = eps
            .iter()
            .filter(|e| e.serving && e.terminating)
            .cloned()
            .collect();
    }
    let mut local: Vec<Endpoint> = eps
        .iter()
        .filter(|e| e.is_local && e.ready)
        .cloned()
        .collect();
    if local.is_empty() {
        local = eps
            .iter()
            .filter(|e| e.is_local && e.serving && e.terminating)
            .cloned()
            .collect();
    }
    let no_local = NoLocalEndpoints::of(
        port.internal_local,
        port.external_local,
        port.externally_accessible(),
        !cluster.is_empty(),
        !local.is_empty(),
    );
    SelectedEndpoints {
        no_local,
        cluster: if port.internal_local {
            local.clone()
        } else {
            cluster.clone()
        },
        cluster_policy: if port.external_local {
            cluster.clone()
        } else {
            Vec::new()
        },
        external: if port.external_local {
            local.clone()
        } else {
            cluster
        },
        local,
    }
}

/// Remembers rejected objects so each reason is logged once and counted once.
///
/// Rejections of objects that belong to another one (EndpointSlices of a Service) are recorded
/// per owner with [`Rejections::replace_owned`], so a slice that is fixed or deleted is cleared
/// when its Service is next derived, and every slice of a deleted Service is cleared with it
/// ([`Rejections::clear_owned`]): the map holds only objects rejected now.
#[derive(Debug, Default, Clone)]
pub struct Rejections {
    current: HashMap<String, Invalid>,
    total: u64,
    fresh: Vec<(String, Invalid)>,
    /// Owner key → keys it rejected last time it was derived.
    owned: HashMap<String, BTreeSet<String>>,
    /// Owned key → its owner (a slice relabelled to another Service changes owner).
    owner_of: HashMap<String, String>,
}

impl Rejections {
    /// Records that `key` (e.g. `service ns/name`, `slice ns/name`) is rejected for `why`.
    /// Returns true (and counts it) when this is new or the reason changed: log it then.
    pub fn reject(&mut self, key: &str, why: &Invalid) -> bool {
        if self.current.get(key) == Some(why) {
            return false;
        }
        self.current.insert(key.to_string(), why.clone());
        self.total += 1;
        self.fresh.push((key.to_string(), why.clone()));
        tracing::warn!(object = key, reason = %why, "skipping invalid object");
        true
    }

    /// Records that `key` is valid again (or deleted).
    pub fn clear(&mut self, key: &str) {
        self.current.remove(key);
    }

    /// Replaces the rejections owned by `owner` (e.g. `service ns/name`) with `rejected`
    /// (e.g. its EndpointSlices skipped by this derivation): keys it rejected before and not
    /// now are cleared (the slice was fixed, deleted, or moved to another Service), new ones
    /// are recorded like [`Rejections::reject`].
    pub fn replace_owned(&mut self, owner: &str, rejected: &[(String, Invalid)]) {
        let now: BTreeSet<String> = rejected.iter().map(|(k, _)| k.clone()).collect();
        let before = self.owned.remove(owner).unwrap_or_default();
        for k in before.difference(&now) {
            // Another owner may have taken the key over since (a relabelled slice).
            if self.owner_of.get(k).map(String::as_str) == Some(owner) {
                self.owner_of.remove(k);
                self.current.remove(k);
            }
        }
        for (k, why) in rejected {
            self.owner_of.insert(k.clone(), owner.to_string());
            self.reject(k, why);
        }
        if !now.is_empty() {
            self.owned.insert(owner.to_string(), now);
        }
    }

    /// Clears every rejection owned by `owner` (the owner was deleted).
    pub fn clear_owned(&mut self, owner: &str) {
        self.replace_owned(owner, &[]);
    }

    /// Objects tracked as owned by another (memory bound checks).
    pub fn owned_len(&self) -> usize {
        self.owner_of.len()
    }

    /// Objects currently rejected.
    pub fn current(&self) -> usize {
        self.current.len()
    }

    /// Rejections counted since start (a metric).
    pub fn total(&self) -> u64 {
        self.total
    }

    /// The current reason for `key`, if rejected.
    pub fn reason(&self, key: &str) -> Option<&Invalid> {
        self.current.get(key)
    }

    /// The `(key, reason)` pairs newly rejected (logged) since the last call, oldest first: for
    /// metrics and Kubernetes Events, so each rejection is reported once.
    pub fn take_new(&mut self) -> Vec<(String, Invalid)> {
        std::mem::take(&mut self.fresh)
    }
}
