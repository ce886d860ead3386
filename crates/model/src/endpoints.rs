//! EndpointSlices turned into the endpoints of a service port ([`endpoints`]) and
//! Kubernetes' endpoint selection ([`select_endpoints`]): readiness, traffic policies,
//! topology hints.

use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;
use std::sync::Arc;

use ipvs_netlink::Family;
use k8s_openapi::api::discovery::v1::EndpointSlice;

use crate::addr::parse_ip_sloppy;
use crate::names::{
    quoted, Invalid, MAX_ENDPOINTS_PER_SERVICE_PORT, MAX_ENDPOINTS_PER_SLICE,
    MAX_PORTS_PER_SERVICE, SERVICE_NAME_LABEL,
};
use crate::objects::{AddressType, Hints, Placement, Slice};
use crate::service::{parse_port, parse_protocol, NoLocalEndpoints, ServicePort};

/// One endpoint (pod address and target port) of a service port.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Endpoint {
    /// Address.
    pub ip: IpAddr,
    /// Target port.
    pub port: u16,
    /// `nodeName`, `hints.forZones` and `hints.forNodes` (the latter set by the EndpointSlice
    /// controller for `trafficDistribution: PreferSameNode`), shared with the slice's
    /// endpoint: deriving a service allocates nothing per endpoint. See
    /// [`Endpoint::node_name`], [`Endpoint::zone_hints`] and [`Endpoint::node_hints`].
    pub placement: Option<Arc<Placement>>,
    /// `conditions.ready` (unset = true).
    pub ready: bool,
    /// `conditions.serving` (unset = ready).
    pub serving: bool,
    /// `conditions.terminating` (unset = false).
    pub terminating: bool,
    /// Runs on this node.
    pub is_local: bool,
}

impl Endpoint {
    /// `nodeName`.
    pub fn node_name(&self) -> Option<&Arc<str>> {
        self.placement.as_deref()?.node_name.as_ref()
    }

    fn hints(&self) -> Option<&Hints> {
        self.placement.as_deref()?.hints.as_ref()
    }

    /// `hints.forZones[].name` (None when the endpoint carries no zone hints).
    pub fn zone_hints(&self) -> Option<&[Arc<str>]> {
        self.hints()?.zones.as_deref()
    }

    /// `hints.forNodes[].name` (None when the endpoint carries no node hints).
    pub fn node_hints(&self) -> Option<&[Arc<str>]> {
        self.hints()?.nodes.as_deref()
    }
}

/// True when `names` holds `name`.
fn names_contain(names: &[Arc<str>], name: &str) -> bool {
    names.iter().any(|n| &**n == name)
}

/// Checks an EndpointSlice as a whole: address type, sizes, ports, protocols.
/// `FQDN` slices are not an error (they are ignored by the proxy). Endpoint addresses are
/// checked one endpoint at a time where the slice is converted
/// ([`crate::objects::Slice::from_slice_in`]): an endpoint whose address is invalid is left
/// out alone, like upstream.
pub fn validate_slice(slice: &EndpointSlice) -> Result<(), Invalid> {
    match slice.address_type.as_str() {
        "IPv4" | "IPv6" => {}
        "FQDN" => return Ok(()),
        o => return Err(Invalid::new(format!("unknown addressType {}", quoted(o)))),
    }
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
            return Err(Invalid::new(format!(
                "duplicate endpoint port {}",
                quoted(&name)
            )));
        }
    }
    for ep in &slice.endpoints {
        if ep.addresses.len() > 100 {
            return Err(Invalid::new(format!(
                "endpoint with {} addresses",
                ep.addresses.len()
            )));
        }
    }
    Ok(())
}

/// The address of one endpoint as the proxy uses it: its first address (the only one that
/// counts, the API's rule), read like upstream's `addEndpoints`
/// (pkg/proxy/endpointslicecache.go: `netutils.ParseIPSloppy(endpoint.Addresses[0])`), of the
/// slice's family. `Err` describes why the endpoint is left out (an endpoint without
/// addresses, an invalid address, an address of the other family).
pub fn endpoint_address(addresses: &[String], family: Family) -> Result<IpAddr, String> {
    let Some(first) = addresses.first() else {
        return Err("endpoint without addresses".to_string());
    };
    let Some(ip) = parse_ip_sloppy(first) else {
        return Err(format!("endpoint with invalid address {}", quoted(first)));
    };
    if Family::of(&ip) != family {
        return Err(format!(
            "endpoint address of another family {}",
            quoted(first)
        ));
    }
    Ok(ip)
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

/// The name of the Service `slice` belongs to (its non-empty [`SERVICE_NAME_LABEL`]); the
/// namespace is the slice's.
pub fn slice_service_name(slice: &EndpointSlice) -> Option<&str> {
    let name = slice.metadata.labels.as_ref()?.get(SERVICE_NAME_LABEL)?;
    (!name.is_empty()).then_some(name.as_str())
}

/// Endpoints of one service port merged from all slices of its service.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct MergedEndpoints {
    /// Endpoints, deduplicated by (ip, port), sorted.
    pub endpoints: Vec<Endpoint>,
    /// Slices skipped, by slice name, with the reason; and slices used without some of their
    /// endpoints (reasons starting with [`crate::IGNORED_PREFIX`]).
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
        if let Some(e) = &slice.invalid {
            rejected.push((slice.name.to_string(), e.clone()));
            continue;
        }
        if let Some(e) = &slice.ignored {
            // Used without the endpoints it names (a partial rejection).
            rejected.push((slice.name.to_string(), (**e).clone()));
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
            new.push(Endpoint {
                ip: ep.ip,
                port: tport,
                placement: ep.placement.clone(),
                ready,
                serving,
                terminating,
                is_local: ep.node_name().map(|n| &**n) == Some(node_name) && !node_name.is_empty(),
            });
        }
        let added = new
            .iter()
            .filter(|e| !merged.contains_key(&(e.ip, e.port)))
            .count();
        if merged.len() + added > MAX_ENDPOINTS_PER_SERVICE_PORT {
            rejected.push((
                slice.name.to_string(),
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
pub(crate) fn is_vip_mode(ip_mode: Option<&str>) -> bool {
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
        match e.node_hints() {
            None => all_node = false,
            Some(n) => for_node |= names_contain(n, node_name),
        }
        match e.zone_hints() {
            None => all_zone = false,
            Some(z) => for_zone |= zone.is_some_and(|zn| names_contain(z, zn)),
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
            TopologyMode::SameNode => e.node_hints().is_some_and(|n| names_contain(n, node_name)),
            TopologyMode::SameZone => e
                .zone_hints()
                .is_some_and(|z| zone.is_some_and(|zn| names_contain(z, zn))),
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
