//! A Service turned into the service ports of one family ([`service_ports`]), with every
//! field checked.

use std::collections::BTreeSet;
use std::net::IpAddr;

use ipnet::IpNet;
use ipvs_netlink::{Family, Protocol};

use crate::addr::{is_zero_cidr, parse_cidr_sloppy, parse_ip_sloppy, special_vip};
use crate::config::ProxyConfig;
use crate::endpoints::is_vip_mode;
use crate::names::{
    quoted, scheduler_flags, IgnoredValues, Invalid, ServicePortName, DEFAULT_AFFINITY_TIMEOUT,
    MAX_AFFINITY_TIMEOUT, MAX_PORTS_PER_SERVICE, MAX_SOURCE_RANGES, MAX_VIPS_PER_SERVICE,
    SCHEDULERS, SCHEDULER_ANNOTATION,
};
use crate::objects::Svc;

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
    /// `spec.loadBalancerSourceRanges` of this family (empty when one of them is `/0`).
    pub source_ranges: Vec<IpNet>,
    /// True when the service has source ranges at all (in any family, valid or not): with none
    /// in this family the firewall is on and admits nobody. False in a family one of whose
    /// ranges is `/0`, which admits every source (see [`service_ports`]).
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

pub(crate) fn parse_protocol(p: Option<&str>) -> Result<Protocol, Invalid> {
    match p {
        None => Ok(Protocol::Tcp),
        Some(name) => Protocol::from_api_name(name)
            .ok_or_else(|| Invalid::new(format!("unknown protocol {}", quoted(name)))),
    }
}

pub(crate) fn parse_port(what: &str, p: i32) -> Result<u16, Invalid> {
    match u16::try_from(p) {
        Ok(v) if v != 0 => Ok(v),
        _ => Err(Invalid::new(format!("{what} {p} out of range 1..65535"))),
    }
}

/// An address read like upstream's `netutils.ParseIPSloppy` ([`crate::addr`]).
pub(crate) fn parse_ip(what: &str, s: &str) -> Result<IpAddr, Invalid> {
    parse_ip_sloppy(s).ok_or_else(|| Invalid::new(format!("invalid {what} {}", quoted(s))))
}

/// A source range read like upstream's `MapCIDRsByIPFamily` (trimmed, `ParseCIDRSloppy`); a
/// bare address (which the static source may hold) is a host route.
pub(crate) fn parse_cidr(s: &str) -> Option<IpNet> {
    let t = s.trim();
    parse_cidr_sloppy(t).or_else(|| parse_ip_sloppy(t).map(IpNet::from))
}

/// `s` as an externalIP or load-balancer IP: the address, or why it is left out (`None`: no
/// address at all; `Some(why)`: a special address, see [`special_vip`]).
fn read_vip(s: &str) -> Result<IpAddr, Option<&'static str>> {
    let ip = parse_ip_sloppy(s).ok_or(None)?;
    special_vip(&ip).map_or(Ok(ip), |why| Err(Some(why)))
}

/// The values of `svc` that [`service_ports`] leaves out as invalid while it programs the
/// rest, as one partial rejection ([`crate::IGNORED_PREFIX`]), or `None`: externalIPs,
/// load-balancer ingress IPs and `loadBalancerSourceRanges` that are no address or range.
///
/// Upstream skips them the same way, with a log line (`MapIPsByIPFamily`,
/// `MapCIDRsByIPFamily` in pkg/proxy/util, `newBaseServiceInfo` in pkg/proxy/serviceport.go);
/// empty values are skipped silently, as there ("ExternalIPs may not be validated by the API
/// server"). One bad value never costs the Service its ClusterIP or its other addresses.
pub fn ignored_fields(svc: &Svc) -> Option<Invalid> {
    let spec = svc.spec.as_deref()?;
    let lb = spec.type_.as_deref() == Some("LoadBalancer");
    let mut ignored = IgnoredValues::default();
    let mut note_vip = |what: &str, s: &str| {
        if let Err(why) = read_vip(s) {
            let why = why.map(|w| format!(" ({w})")).unwrap_or_default();
            ignored.note(|| format!("invalid {what} {}{why}", quoted(s)));
        }
    };
    for s in spec.external_ips.iter().flatten() {
        if !s.trim().is_empty() {
            note_vip("externalIP", s);
        }
    }
    if lb {
        for (s, mode) in &spec.ingress {
            if is_vip_mode(mode.as_deref()) && !s.is_empty() {
                note_vip("load-balancer ingress IP", s);
            }
        }
        for s in spec.load_balancer_source_ranges.iter().flatten() {
            if !s.trim().is_empty() && parse_cidr(s).is_none() {
                ignored.note(|| format!("invalid loadBalancerSourceRange {}", quoted(s)));
            }
        }
    }
    ignored.into_invalid()
}

/// The start of the reason of a Service the source could not decode (`Svc::undecodable`).
pub const UNDECODABLE_PREFIX: &str = "cannot be decoded: ";

/// The ServicePorts of one Service for `cfg.family`.
///
/// Returns `Ok(vec![])` for services the proxy does not handle: headless (`clusterIP: None`),
/// `ExternalName`, no ClusterIP of this family, or no ports. Returns `Err` for bad input; the
/// whole Service is then skipped. An invalid externalIP, load-balancer IP or source range is
/// left out alone ([`ignored_fields`] names it).
///
/// A `/0` source range of this family (`0.0.0.0/0`, `::/0`) admits every source: the family's
/// ranges are dropped and its firewall is off, like upstream's `newBaseServiceInfo` since
/// k/k#132722 ("zero-masked cidr means allow any, which same as the empty
/// loadBalancerSourceRanges"). The kernel refuses a `/0` member of a `hash:net` set, so without
/// this the allow rule never matched and the load-balancer IP dropped everything.
pub fn service_ports(svc: &Svc, cfg: &ProxyConfig) -> Result<Vec<ServicePort>, Invalid> {
    if let Some(e) = &svc.undecodable {
        return Err(Invalid::new(format!("{UNDECODABLE_PREFIX}{e}")));
    }
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
        other => {
            return Err(Invalid::new(format!(
                "unknown service type {}",
                quoted(other)
            )))
        }
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
    // Invalid values are left out (reported by `ignored_fields`).
    let mut external_ips = Vec::new();
    for ip in ext.iter().filter_map(|s| read_vip(s).ok()) {
        if Family::of(&ip) == cfg.family && !external_ips.contains(&ip) {
            external_ips.push(ip);
        }
    }
    let mut load_balancer_ips = Vec::new();
    for ip in ingress.iter().filter_map(|s| read_vip(s).ok()) {
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
    let mut admits_all = false;
    for n in ranges.iter().filter_map(|s| parse_cidr(s)) {
        if Family::of(&n.addr()) != cfg.family {
            continue;
        }
        if is_zero_cidr(&n) {
            admits_all = true;
        } else if !source_ranges.contains(&n) {
            source_ranges.push(n);
        }
    }
    if admits_all {
        source_ranges.clear();
    }
    let firewall = !ranges.is_empty() && !admits_all;

    let externally = type_ == "NodePort" || type_ == "LoadBalancer";
    let external_local = externally
        && match spec.external_traffic_policy.as_deref() {
            None | Some("Cluster") => false,
            Some("Local") => true,
            Some(o) => {
                return Err(Invalid::new(format!(
                    "unknown externalTrafficPolicy {}",
                    quoted(o)
                )))
            }
        };
    let internal_local = match spec.internal_traffic_policy.as_deref() {
        None | Some("Cluster") => false,
        Some("Local") => true,
        Some(o) => {
            return Err(Invalid::new(format!(
                "unknown internalTrafficPolicy {}",
                quoted(o)
            )))
        }
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
        Some(o) => {
            return Err(Invalid::new(format!(
                "unknown sessionAffinity {}",
                quoted(o)
            )))
        }
    };
    let scheduler = match svc.scheduler.as_deref() {
        Some(s) if SCHEDULERS.contains(&s) => s.to_string(),
        Some(s) => {
            return Err(Invalid::new(format!(
                "unknown scheduler {} in annotation {SCHEDULER_ANNOTATION}",
                quoted(s)
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
            return Err(Invalid::new(format!(
                "duplicate port name {}",
                quoted(&port_name)
            )));
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
