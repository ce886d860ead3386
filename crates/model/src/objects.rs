//! Compact objects: what the proxy keeps of a Service and an EndpointSlice. Pure.
//!
//! The sources convert API objects where they arrive ([`crate::event::Object`]'s `From`
//! impls: the watcher's map, the static parser) and the full `k8s-openapi` objects are
//! dropped at once. Only the fields the model reads are kept — those
//! upstream's `ServicePortInfo` and `EndpointInfo` keep (pkg/proxy/serviceport.go,
//! pkg/proxy/endpoint.go), plus the creation time that orders VIP claims — so a Service
//! costs a few hundred bytes and an endpoint 32 bytes instead of about 1.4 KB and
//! 350 bytes. Metadata the proxy never reads (managed fields, labels, most annotations,
//! resource versions, target references) is not kept, so an update that only touches it
//! changes nothing here and dirties no service.
//!
//! An EndpointSlice is validated once, at conversion ([`crate::validate_slice`]); an
//! invalid slice keeps its reason and no endpoints. Strings drawn from a small vocabulary are
//! interned where objects are stored (the store, the static source): node and zone names,
//! namespaces, Service types, traffic policies, port names and protocols each exist once
//! however many objects carry them, as does each endpoint [`Placement`] (node name and
//! hints) ([`Interner`], bounded: unused names are dropped).

use std::net::IpAddr;
use std::sync::Arc;
use std::time::SystemTime;

use k8s_openapi::api::core::v1::Service;
use k8s_openapi::api::discovery::v1::EndpointSlice;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;

use ipvs_netlink::Family;

pub use crate::interner::Interner;

use crate::names::IgnoredValues;
use crate::{
    bounded, endpoint_address, last_change_trigger_time, slice_service_name, validate_slice,
    Invalid, ServiceName, MAX_USER_TEXT, SCHEDULER_ANNOTATION, SCHEDULER_FLAGS_ANNOTATION,
};

/// A compact `v1/Service`: the fields the model reads, with the API's names and optionality
/// (so validation reports exactly what the object said).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Svc {
    /// `metadata.namespace`/`metadata.name`.
    pub name: ServiceName,
    /// `metadata.name` was set (a nameless Service is invalid).
    pub named: bool,
    /// `metadata.creationTimestamp` (orders VIP claims).
    pub created: Option<Time>,
    /// The [`SCHEDULER_ANNOTATION`] annotation.
    pub scheduler: Option<Box<str>>,
    /// The [`SCHEDULER_FLAGS_ANNOTATION`] annotation.
    pub scheduler_flags: Option<Box<str>>,
    /// `spec`, if any.
    pub spec: Option<Box<SvcSpec>>,
    /// The source could not decode the Service (the error, naming the field): it is invalid,
    /// and `spec` holds what could be read of it (see `watch::lenient`).
    pub undecodable: Option<Box<str>>,
}

/// The used fields of a `ServiceSpec` and of the Service's `status.loadBalancer`.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct SvcSpec {
    /// `spec.type` (interned, like every value drawn from a small vocabulary).
    pub type_: Option<Arc<str>>,
    /// `spec.clusterIP`.
    pub cluster_ip: Option<Box<str>>,
    /// `spec.clusterIPs`.
    pub cluster_ips: Option<Vec<Box<str>>>,
    /// `spec.ports`.
    pub ports: Option<Vec<SvcPort>>,
    /// `spec.externalIPs`.
    pub external_ips: Option<Vec<Box<str>>>,
    /// `spec.loadBalancerSourceRanges`.
    pub load_balancer_source_ranges: Option<Vec<Box<str>>>,
    /// `spec.externalTrafficPolicy`.
    pub external_traffic_policy: Option<Arc<str>>,
    /// `spec.internalTrafficPolicy`.
    pub internal_traffic_policy: Option<Arc<str>>,
    /// `spec.sessionAffinity`.
    pub session_affinity: Option<Arc<str>>,
    /// `spec.sessionAffinityConfig.clientIP.timeoutSeconds`.
    pub affinity_timeout: Option<i32>,
    /// `spec.healthCheckNodePort`.
    pub health_check_node_port: Option<i32>,
    /// `status.loadBalancer.ingress[]`: `(ip, ipMode)` of the entries with an IP.
    pub ingress: Vec<(Box<str>, Option<Box<str>>)>,
}

/// One `spec.ports[]` entry.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct SvcPort {
    /// `name` (interned).
    pub name: Option<Arc<str>>,
    /// `protocol` (interned).
    pub protocol: Option<Arc<str>>,
    /// `port`.
    pub port: i32,
    /// `nodePort`.
    pub node_port: Option<i32>,
}

/// User text as stored: at most [`MAX_USER_TEXT`] bytes, a longer value cut with
/// [`crate::CUT_MARKER`] (which makes it invalid wherever it is read, so it is rejected, not
/// read as a shorter value). A 200 KiB annotation thus costs the store 1 KiB, not 200.
fn text(s: &str) -> Box<str> {
    Box::from(bounded(s, MAX_USER_TEXT).as_ref())
}

fn boxed(s: &Option<String>) -> Option<Box<str>> {
    s.as_deref().map(text)
}

fn boxed_all(v: &Option<Vec<String>>) -> Option<Vec<Box<str>>> {
    v.as_ref().map(|v| v.iter().map(|s| text(s)).collect())
}

impl Svc {
    /// The compact form of `svc`, with strings of its own.
    pub fn from_service(svc: &Service) -> Svc {
        Svc::build(svc, &mut |s| Arc::from(s))
    }

    /// The compact form of `svc` with the namespace and the values drawn from a small
    /// vocabulary taken from `names` (what [`Svc::intern`] shares): converted where it is
    /// stored, the object never holds private copies that are freed again at once (at 10,000
    /// Services such short-lived strings, freed between long-lived objects, left ~1 MB of
    /// holes in the heap).
    pub fn from_service_in(svc: &Service, names: &mut Interner) -> Svc {
        Svc::build(svc, &mut |s| names.intern(s))
    }

    /// A Service the source could not decode whole: `readable` holds what it could read of
    /// it (metadata, and the spec when that decoded), `error` why not the rest. The Service is
    /// invalid ([`crate::service::service_ports`] rejects it), so its last good state is kept.
    pub fn undecodable(readable: &Service, error: &str) -> Svc {
        let mut s = Svc::from_service(readable);
        s.undecodable = Some(text(error));
        s
    }

    fn build(svc: &Service, share: &mut dyn FnMut(&str) -> Arc<str>) -> Svc {
        let annotation = |k: &str| {
            svc.metadata
                .annotations
                .as_ref()
                .and_then(|a| a.get(k))
                .map(|v| text(v))
        };
        let mut shared = |s: &Option<String>| s.as_deref().map(&mut *share);
        let spec = svc.spec.as_ref().map(|s| {
            let ingress = svc
                .status
                .as_ref()
                .and_then(|s| s.load_balancer.as_ref())
                .and_then(|lb| lb.ingress.as_ref())
                .into_iter()
                .flatten()
                .filter_map(|i| {
                    let ip = i.ip.as_deref()?;
                    Some((text(ip), boxed(&i.ip_mode)))
                })
                .collect();
            Box::new(SvcSpec {
                type_: shared(&s.type_),
                cluster_ip: boxed(&s.cluster_ip),
                cluster_ips: boxed_all(&s.cluster_ips),
                ports: s.ports.as_ref().map(|ports| {
                    ports
                        .iter()
                        .map(|p| SvcPort {
                            name: shared(&p.name),
                            protocol: shared(&p.protocol),
                            port: p.port,
                            node_port: p.node_port,
                        })
                        .collect()
                }),
                external_ips: boxed_all(&s.external_ips),
                load_balancer_source_ranges: boxed_all(&s.load_balancer_source_ranges),
                external_traffic_policy: shared(&s.external_traffic_policy),
                internal_traffic_policy: shared(&s.internal_traffic_policy),
                session_affinity: shared(&s.session_affinity),
                affinity_timeout: s
                    .session_affinity_config
                    .as_ref()
                    .and_then(|c| c.client_ip.as_ref())
                    .and_then(|c| c.timeout_seconds),
                health_check_node_port: s.health_check_node_port,
                ingress,
            })
        });
        let name = ServiceName {
            namespace: share(svc.metadata.namespace.as_deref().unwrap_or("default")),
            name: Arc::from(svc.metadata.name.as_deref().unwrap_or_default()),
        };
        Svc {
            name,
            named: svc.metadata.name.as_deref().is_some_and(|n| !n.is_empty()),
            created: svc.metadata.creation_timestamp.clone(),
            scheduler: annotation(SCHEDULER_ANNOTATION),
            scheduler_flags: annotation(SCHEDULER_FLAGS_ANNOTATION),
            spec,
            undecodable: None,
        }
    }
}

impl Svc {
    /// Replaces the namespace and the values drawn from a small vocabulary (type, traffic
    /// policies, session affinity, port names and protocols) by their copies in `names`: ten
    /// thousand Services in a few namespaces then hold a few dozen such strings, not ~60,000.
    pub fn intern(&mut self, names: &mut Interner) {
        names.share(&mut self.name.namespace);
        let Some(spec) = self.spec.as_deref_mut() else {
            return;
        };
        for v in [
            &mut spec.type_,
            &mut spec.external_traffic_policy,
            &mut spec.internal_traffic_policy,
            &mut spec.session_affinity,
        ] {
            names.share_opt(v);
        }
        for p in spec.ports.iter_mut().flatten() {
            names.share_opt(&mut p.name);
            names.share_opt(&mut p.protocol);
        }
    }
}

impl From<&Service> for Svc {
    fn from(svc: &Service) -> Svc {
        Svc::from_service(svc)
    }
}

/// A slice's `addressType`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AddressType {
    /// `IPv4`.
    V4,
    /// `IPv6`.
    V6,
    /// `FQDN` or anything else (ignored by the proxy; an unknown type makes the slice invalid).
    Other,
}

/// One `ports[]` entry of a slice.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SlicePort {
    /// `name` (empty when unset; interned).
    pub name: Arc<str>,
    /// `protocol` (raw; matched against the service port's; interned).
    pub protocol: Option<Arc<str>>,
    /// `port`.
    pub port: Option<i32>,
}

/// Topology hints of one endpoint.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Default)]
pub struct Hints {
    /// `hints.forZones[].name` (None when absent or empty).
    pub zones: Option<Vec<Arc<str>>>,
    /// `hints.forNodes[].name` (None when absent or empty).
    pub nodes: Option<Vec<Arc<str>>>,
}

/// Where an endpoint runs: its node and topology hints. Interned: every endpoint on one node
/// with the same hints (or none) shares one, so an endpoint holds one pointer for both.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Default)]
pub struct Placement {
    /// `nodeName`.
    pub node_name: Option<Arc<str>>,
    /// `hints`, when the endpoint carries any.
    pub hints: Option<Hints>,
}

impl Placement {
    /// The placement of an endpoint with this node name and hints (`None` for neither).
    pub fn of(node_name: Option<Arc<str>>, hints: Hints) -> Option<Placement> {
        let hints = (hints != Hints::default()).then_some(hints);
        (node_name.is_some() || hints.is_some()).then_some(Placement { node_name, hints })
    }
}

/// One endpoint of a slice: its first address (the only one that counts), node, hints and
/// conditions as the API gave them (unset stays unset). 32 bytes (issue #18: 100,000 of them
/// at 10,000 services x 10 endpoints).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SliceEndpoint {
    /// The first address, parsed (a slice whose addresses do not parse is invalid as a whole).
    pub ip: IpAddr,
    /// `nodeName` and `hints` (interned; shared with the endpoints derived from it).
    pub placement: Option<Arc<Placement>>,
    /// `conditions.ready`.
    pub ready: Option<bool>,
    /// `conditions.serving`.
    pub serving: Option<bool>,
    /// `conditions.terminating`.
    pub terminating: Option<bool>,
}

impl SliceEndpoint {
    /// `nodeName`.
    pub fn node_name(&self) -> Option<&Arc<str>> {
        self.placement.as_deref()?.node_name.as_ref()
    }

    /// `hints`, when the endpoint carries any.
    pub fn hints(&self) -> Option<&Hints> {
        self.placement.as_deref()?.hints.as_ref()
    }
}

/// A compact `discovery.k8s.io/v1/EndpointSlice`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Slice {
    /// `metadata.namespace` (`default` when unset).
    pub namespace: Arc<str>,
    /// `metadata.name` (empty when unset; the store's and the source's keys share it).
    pub name: Arc<str>,
    /// The Service it belongs to (namespace + `kubernetes.io/service-name` label).
    pub service: Option<ServiceName>,
    /// `addressType`.
    pub address_type: AddressType,
    /// `ports`.
    pub ports: Vec<SlicePort>,
    /// `endpoints` (empty when the slice is invalid; without the endpoints left out).
    pub endpoints: Vec<SliceEndpoint>,
    /// Why the slice is invalid ([`validate_slice`]), if it is.
    pub invalid: Option<Invalid>,
    /// The endpoints left out of a valid slice ([`endpoint_address`]: no address, an invalid
    /// one, one of the other family), as a partial rejection ([`crate::IGNORED_PREFIX`]).
    pub ignored: Option<Box<Invalid>>,
    /// The last-change-trigger-time annotation, parsed.
    pub trigger_time: Option<SystemTime>,
}

impl Slice {
    /// The compact form of `slice` with every string [`Slice::intern`] shares (node and zone
    /// names, placements, namespaces, port names and protocols) taken from `names`: converted
    /// where it is stored, the slice never holds private copies that are freed again at once.
    pub fn from_slice_in(slice: &EndpointSlice, names: &mut Interner) -> Slice {
        let address_type = match slice.address_type.as_str() {
            "IPv4" => AddressType::V4,
            "IPv6" => AddressType::V6,
            _ => AddressType::Other,
        };
        let invalid = validate_slice(slice).err();
        let mut ignored = IgnoredValues::default();
        let family = match address_type {
            AddressType::V4 => Some(Family::Inet),
            AddressType::V6 => Some(Family::Inet6),
            AddressType::Other => None,
        };
        let endpoints = match family {
            Some(family) if invalid.is_none() => {
                let mut eps = Vec::with_capacity(slice.endpoints.len());
                eps.extend(slice.endpoints.iter().filter_map(|ep| {
                    // Only the first address counts (the API's rule for EndpointSlices).
                    let ip = match endpoint_address(&ep.addresses, family) {
                        Ok(ip) => ip,
                        Err(why) => {
                            ignored.note(|| why);
                            return None;
                        }
                    };
                    let cond = ep.conditions.as_ref();
                    let mut hints = Hints::default();
                    if let Some(h) = ep.hints.as_ref() {
                        hints.zones = h
                            .for_zones
                            .as_ref()
                            .filter(|z| !z.is_empty())
                            .map(|z| z.iter().map(|z| names.intern(&z.name)).collect());
                        hints.nodes = h
                            .for_nodes
                            .as_ref()
                            .filter(|n| !n.is_empty())
                            .map(|n| n.iter().map(|n| names.intern(&n.name)).collect());
                    }
                    let node_name = ep.node_name.as_deref().map(|n| names.intern(n));
                    Some(SliceEndpoint {
                        ip,
                        placement: Placement::of(node_name, hints).map(|p| names.placement(p)),
                        ready: cond.and_then(|c| c.ready),
                        serving: cond.and_then(|c| c.serving),
                        terminating: cond.and_then(|c| c.terminating),
                    })
                }));
                eps
            }
            _ => Vec::new(),
        };
        let namespace = names.intern(slice.metadata.namespace.as_deref().unwrap_or("default"));
        Slice {
            service: slice_service_name(slice).map(|name| ServiceName {
                namespace: namespace.clone(),
                name: Arc::from(name),
            }),
            namespace,
            name: Arc::from(slice.metadata.name.as_deref().unwrap_or_default()),
            address_type,
            ports: slice
                .ports
                .as_deref()
                .unwrap_or_default()
                .iter()
                .map(|p| SlicePort {
                    name: names.intern(p.name.as_deref().unwrap_or_default()),
                    protocol: p.protocol.as_deref().map(|s| names.intern(s)),
                    port: p.port,
                })
                .collect(),
            endpoints,
            invalid,
            ignored: ignored.into_invalid().map(Box::new),
            trigger_time: last_change_trigger_time(slice),
        }
    }

    /// The compact form of `slice` with a private interner (sources, tests).
    pub fn of(slice: &EndpointSlice) -> Slice {
        Slice::from_slice_in(slice, &mut Interner::default())
    }

    /// The IP family of its endpoints (`None` for FQDN and unknown address types).
    pub fn family(&self) -> Option<Family> {
        match self.address_type {
            AddressType::V4 => Some(Family::Inet),
            AddressType::V6 => Some(Family::Inet6),
            AddressType::Other => None,
        }
    }

    /// Replaces every node and zone name, the namespace, and the port names and protocols by
    /// their copies in `names`, so that a slice converted by a source shares one allocation per
    /// name with the rest of the store.
    pub fn intern(&mut self, names: &mut Interner) {
        names.share(&mut self.namespace);
        if let Some(s) = self.service.as_mut() {
            names.share(&mut s.namespace);
        }
        for p in &mut self.ports {
            names.share(&mut p.name);
            names.share_opt(&mut p.protocol);
        }
        for ep in &mut self.endpoints {
            if let Some(p) = ep.placement.as_mut() {
                names.share_placement(p);
            }
        }
    }
}
