//! Adopting kernel state that the model cannot derive, so that a restart never deletes it.
//!
//! Two cases, both met at a full sync right after the kernel was read:
//!
//! - **A Service that exists but is invalid, with no last-good state** (the daemon restarted
//!   after it became invalid, so its last valid version was lost with the process). The model
//!   rejects it, so it derives nothing; without adoption the full sync's diff would delete its
//!   virtual servers, kube-ipvs0 addresses and ipset members as orphans. Instead its *claims* are
//!   read leniently from the object — every parseable clusterIP, externalIP and load-balancer
//!   ingress IP of the family, every parseable (protocol, port) and nodePort — and what the
//!   kernel already holds for them becomes the Service's desired state ([`adopt_service`]): the
//!   virtual servers with their real servers as read, the VIPs bound on kube-ipvs0, the ipset
//!   members naming those VIPs and ports, the iptables features those members need, and its
//!   health-check node port (local endpoints counted from its hairpin members). The
//!   following syncs keep it like any last-good state: an invalid update keeps it, a valid one
//!   replaces it, deleting the Service removes it.
//!
//! - **NodePort virtual servers on addresses that depend on the Node object** (with
//!   `nodePortAddresses: [primary]`, the node's primary IPs come from its Node). When the Node
//!   is not known (the wait for it timed out, see [`crate::sync_loop`]), the model computes no
//!   NodePort addresses from it. The kernel's NodePort virtual servers on a node address for a
//!   nodePort some Service in the store declares are kept under a pseudo-service
//!   ([`UNRESOLVED_NODE_PORTS`], [`adopt_node_ports`]) that is marked node-dependent: the first
//!   re-derivation after the Node arrives drops it (it is in no store), and the Services'
//!   own derivations take over the same keys in place.
//!
//! Only keys nobody else claims are adopted, so a valid Service always wins over adopted state.
//! This is stricter than upstream, whose IPVS proxier deletes every virtual server that is not
//! in its current service map at its first sync (`pkg/proxy/ipvs/proxier.go`,
//! `cleanLegacyService`): an operator must never lose a working Service to a restart.

use std::collections::BTreeSet;
use std::net::IpAddr;

use ipset::{Entry, IpsetState, SetKind};
use ipvs_netlink::{Family, Protocol, ServiceKey};
use model::objects::Svc;

use desired::diff::IpvsTable;
use desired::{Features, HealthCheck, InClusterDest, InClusterPort, IpsetEntry, ServiceDesired};
use model::{ProxyConfig, ServiceName, ServicePortName};

/// The pseudo-service holding NodePort virtual servers kept while the Node is unknown. Its
/// namespace is not a valid Kubernetes namespace (no real Service can collide with it) and sorts
/// after every valid one (a real claimant of the same key wins).
pub const UNRESOLVED_NODE_PORTS: (&str, &str) = ("~kube-ipvs", "unresolved-node-ports");

/// The pseudo-service's name.
pub fn unresolved_node_ports() -> ServiceName {
    ServiceName::new(UNRESOLVED_NODE_PORTS.0, UNRESOLVED_NODE_PORTS.1)
}

/// What the kernel held at a full sync (each `None` when that read failed).
#[derive(Debug, Clone, Copy)]
pub struct KernelView<'a> {
    /// The IPVS table.
    pub ipvs: Option<&'a IpvsTable>,
    /// kube-ipvs0's addresses.
    pub addresses: Option<&'a BTreeSet<IpAddr>>,
    /// The owned sets.
    pub sets: Option<&'a IpsetState>,
}

impl KernelView<'_> {
    /// True when every subsystem was read.
    pub fn complete(&self) -> bool {
        self.ipvs.is_some() && self.addresses.is_some() && self.sets.is_some()
    }
}

/// The keys a Service object claims, read leniently: whatever parses is claimed, whatever does
/// not is skipped (the object as a whole may be invalid).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Claims {
    /// ClusterIPs, externalIPs and load-balancer ingress IPs of the family.
    pub vips: BTreeSet<IpAddr>,
    /// (protocol, port) of each port.
    pub ports: BTreeSet<(Protocol, u16)>,
    /// (protocol, nodePort) of each port that has one.
    pub node_ports: BTreeSet<(Protocol, u16)>,
    /// `spec.healthCheckNodePort`.
    pub health_check_node_port: Option<u16>,
    /// Each parseable port by name, with its port and nodePort: finds the in-cluster
    /// firewall-mark virtual server of an externalTrafficPolicy=Local port (its mark is
    /// allocated from the port's name, see [`desired::mark_candidates`]).
    pub named_ports: Vec<(ServicePortName, u16, Option<u16>)>,
}

fn protocol(p: Option<&str>) -> Option<Protocol> {
    match p {
        None | Some("TCP") => Some(Protocol::Tcp),
        Some("UDP") => Some(Protocol::Udp),
        Some("SCTP") => Some(Protocol::Sctp),
        Some(_) => None,
    }
}

fn port(p: i32) -> Option<u16> {
    u16::try_from(p).ok().filter(|p| *p != 0)
}

/// The claims of `svc` for `cfg`'s family (see [`Claims`]).
pub fn claims(svc: &Svc, cfg: &ProxyConfig) -> Claims {
    let mut c = Claims::default();
    let Some(spec) = svc.spec.as_deref() else {
        return c;
    };
    let ingress = spec.ingress.iter().map(|(ip, _)| &**ip);
    let ips = spec
        .cluster_ips
        .iter()
        .flatten()
        .map(|s| &**s)
        .chain(spec.cluster_ip.as_deref())
        .chain(spec.external_ips.iter().flatten().map(|s| &**s))
        .chain(ingress);
    c.vips = ips
        .filter_map(|s| s.parse::<IpAddr>().ok())
        .filter(|ip| Family::of(ip) == cfg.family && !ip.is_unspecified())
        .collect();
    for p in spec.ports.iter().flatten() {
        let Some(proto) = protocol(p.protocol.as_deref()) else {
            continue;
        };
        if let Some(n) = port(p.port) {
            c.ports.insert((proto, n));
        }
        if let Some(n) = p.node_port.and_then(port) {
            c.node_ports.insert((proto, n));
        }
        if let Some(n) = port(p.port) {
            let name = ServicePortName {
                namespace: svc.name.namespace.clone(),
                name: svc.name.name.clone(),
                port_name: p.name.as_deref().unwrap_or_default().to_string(),
                protocol: proto,
            };
            c.named_ports.push((name, n, p.node_port.and_then(port)));
        }
    }
    c.health_check_node_port = spec.health_check_node_port.and_then(port);
    c
}

fn feature_of(kind: SetKind) -> u16 {
    match kind {
        SetKind::NodePortTcp | SetKind::NodePortUdp => Features::NODE_PORTS,
        SetKind::NodePortLocalTcp | SetKind::NodePortLocalUdp => {
            Features::NODE_PORTS | Features::NODE_PORTS_LOCAL
        }
        SetKind::NodePortSctp => Features::SCTP_NODE_PORTS,
        SetKind::NodePortLocalSctp => Features::SCTP_NODE_PORTS | Features::NODE_PORTS_LOCAL,
        SetKind::ExternalIp => Features::EXTERNAL_IPS,
        SetKind::ExternalIpLocal => Features::EXTERNAL_IPS | Features::EXTERNAL_IPS_LOCAL,
        SetKind::LoadBalancer => Features::LOAD_BALANCERS,
        SetKind::LoadBalancerLocal => Features::LOAD_BALANCERS | Features::LOAD_BALANCERS_LOCAL,
        SetKind::LoadBalancerFw
        | SetKind::LoadBalancerSourceIp
        | SetKind::LoadBalancerSourceCidr => Features::LB_SOURCE_RANGES,
        SetKind::HealthCheckNodePort => Features::HEALTH_CHECK_NODE_PORTS,
        SetKind::LoopBack => Features::LOOP_BACK,
        SetKind::ClusterIp | SetKind::IpvsIps => 0,
    }
}

/// The members of the kernel's sets (of `cfg`'s family) that `keep` selects.
fn members(
    sets: &IpsetState,
    cfg: &ProxyConfig,
    keep: impl Fn(SetKind, &Entry) -> bool,
) -> BTreeSet<IpsetEntry> {
    let fam = cfg.family;
    let mut out = BTreeSet::new();
    for (name, st) in sets.sets() {
        let Some((kind, f)) = SetKind::from_name(name) else {
            continue;
        };
        if f != fam {
            continue;
        }
        for e in st.entries.keys() {
            if keep(kind, e) {
                out.insert(IpsetEntry {
                    set: kind,
                    entry: e.clone(),
                });
            }
        }
    }
    out
}

/// What the kernel holds for an invalid Service's claims, as its desired state; `None` when it
/// holds nothing. `free` tells whether a virtual-server key may be adopted (no other Service
/// claims it); `node_ips` are the node's own addresses (NodePort virtual servers live on them).
pub fn adopt_service(
    claims: &Claims,
    kernel: KernelView<'_>,
    cfg: &ProxyConfig,
    node_ips: &BTreeSet<IpAddr>,
    free: impl Fn(&ServiceKey) -> bool,
) -> Option<ServiceDesired> {
    let owned = desired::owned_by_proxy(cfg);
    let mut d = ServiceDesired::default();
    if let Some(table) = kernel.ipvs {
        for (k, vs) in table {
            let ServiceKey::Inet {
                protocol,
                addr,
                port,
            } = *k
            else {
                continue;
            };
            let vip = claims.vips.contains(&addr) && claims.ports.contains(&(protocol, port));
            let node_port =
                node_ips.contains(&addr) && claims.node_ports.contains(&(protocol, port));
            if (vip || node_port) && owned(k) && free(k) {
                d.virtual_servers.insert(*k, vs.clone());
            }
        }
    }
    if let Some(addrs) = kernel.addresses {
        d.addresses = addrs
            .iter()
            .filter(|a| claims.vips.contains(a) && !cfg.excluded(a))
            .copied()
            .collect();
    }
    if let Some(sets) = kernel.sets {
        let vip_port = |ip: &IpAddr, proto: ipset::Protocol, port: u16| {
            claims.vips.contains(ip) && claims.ports.iter().any(|(p, n)| *p == proto && *n == port)
        };
        let node_port = |proto: ipset::Protocol, port: u16| {
            claims
                .node_ports
                .iter()
                .any(|(p, n)| *p == proto && *n == port)
        };
        let reals: BTreeSet<(IpAddr, u16)> = d
            .virtual_servers
            .values()
            .flat_map(|vs| vs.real_servers.keys())
            .collect();
        d.ipset_entries = members(sets, cfg, |kind, e| match (kind, e) {
            (SetKind::IpvsIps, Entry::Ip(ip)) => claims.vips.contains(ip),
            (
                SetKind::NodePortSctp | SetKind::NodePortLocalSctp,
                Entry::IpPort { ip, proto, port },
            ) => node_ips.contains(ip) && node_port(*proto, *port),
            (_, Entry::IpPort { ip, proto, port }) => vip_port(ip, *proto, *port),
            (SetKind::LoopBack, Entry::IpPortIp { ip, port, ip2, .. }) => {
                ip == ip2 && reals.contains(&(*ip, *port))
            }
            (
                _,
                Entry::IpPortIp {
                    ip, proto, port, ..
                },
            )
            | (
                _,
                Entry::IpPortNet {
                    ip, proto, port, ..
                },
            ) => vip_port(ip, *proto, *port),
            (SetKind::NodePortTcp | SetKind::NodePortLocalTcp, Entry::Port(p)) => {
                node_port(ipset::Protocol::Tcp, *p)
            }
            (SetKind::NodePortUdp | SetKind::NodePortLocalUdp, Entry::Port(p)) => {
                node_port(ipset::Protocol::Udp, *p)
            }
            (SetKind::HealthCheckNodePort, Entry::Port(p)) => {
                claims.health_check_node_port == Some(*p)
            }
            _ => false,
        })
        .into_iter()
        .collect();
    }
    if let Some(table) = kernel.ipvs {
        adopt_in_cluster(claims, table, cfg, node_ips, &free, &mut d);
    }
    if d.virtual_servers.is_empty() && d.addresses.is_empty() && d.ipset_entries.is_empty() {
        return None;
    }
    d.features = Features(
        d.ipset_entries
            .iter()
            .fold(0, |acc, e| acc | feature_of(e.set)),
    );
    // The health-check node port keeps answering: with its local endpoint count taken from the
    // hairpin members (one per local endpoint in use), 200 while the node has local endpoints.
    d.health_check = claims.health_check_node_port.and_then(|node_port| {
        let programmed = d.ipset_entries.contains(&IpsetEntry {
            set: SetKind::HealthCheckNodePort,
            entry: Entry::Port(node_port),
        });
        programmed.then(|| HealthCheck {
            node_port,
            local_endpoints: d
                .ipset_entries
                .iter()
                .filter(|e| e.set == SetKind::LoopBack)
                .count(),
        })
    });
    Some(d)
}

/// The in-cluster paths of an adopted Service's externalTrafficPolicy=Local ports: for each
/// port whose Local-set members were adopted, the kernel's firewall-mark virtual server found
/// along the port's mark candidates (the first unclaimed one that exists), with the adopted
/// external destinations of that port. The marks are kept by [`desired::Desired`], so the
/// nat rules that feed the virtual server are rendered again and nothing is deleted.
fn adopt_in_cluster(
    claims: &Claims,
    table: &IpvsTable,
    cfg: &ProxyConfig,
    node_ips: &BTreeSet<IpAddr>,
    free: &impl Fn(&ServiceKey) -> bool,
    d: &mut ServiceDesired,
) {
    let owned = desired::owned_by_proxy(cfg);
    for (name, port, node_port) in &claims.named_ports {
        let proto = name.protocol;
        let sp = proto;
        let mut dests = BTreeSet::new();
        for e in &d.ipset_entries {
            match (e.set, &e.entry) {
                (
                    SetKind::LoadBalancerLocal | SetKind::ExternalIpLocal,
                    Entry::IpPort {
                        ip,
                        proto: p,
                        port: n,
                    },
                ) if *p == sp && n == port => {
                    dests.insert((*ip, *port));
                }
                (
                    SetKind::NodePortLocalSctp,
                    Entry::IpPort {
                        ip,
                        proto: p,
                        port: n,
                    },
                ) if *p == sp && Some(*n) == *node_port => {
                    dests.insert((*ip, *n));
                }
                (SetKind::NodePortLocalTcp | SetKind::NodePortLocalUdp, Entry::Port(n))
                    if Some(*n) == *node_port
                        && (e.set == SetKind::NodePortLocalTcp) == (proto == Protocol::Tcp) =>
                {
                    for k in d.virtual_servers.keys() {
                        if let ServiceKey::Inet {
                            protocol,
                            addr,
                            port: p,
                        } = k
                        {
                            if *protocol == proto && *p == *n && node_ips.contains(addr) {
                                dests.insert((*addr, *n));
                            }
                        }
                    }
                }
                _ => {}
            }
        }
        if dests.is_empty() {
            continue;
        }
        let found = desired::mark_candidates(name)
            .take(64)
            .map(|mark| ServiceKey::Fwmark {
                family: cfg.family,
                mark,
            })
            .find(|k| table.contains_key(k) && owned(k) && free(k));
        let Some(key) = found else { continue };
        let (Some(vs), ServiceKey::Fwmark { mark, .. }) = (table.get(&key), key) else {
            continue;
        };
        d.virtual_servers.insert(key, vs.clone());
        d.fwmarks.insert(name.clone(), mark);
        d.in_cluster.push(InClusterPort {
            port: name.clone(),
            template: vs.clone(),
            dests: dests
                .into_iter()
                .map(|(ip, port)| InClusterDest {
                    ip,
                    protocol: proto,
                    port,
                })
                .collect(),
        });
    }
}

/// The kernel's NodePort virtual servers (and SCTP node-port members) on `node_ips` for the
/// nodePorts of `claims` (every Service in the store), among the keys `free` allows: the state
/// of the [`UNRESOLVED_NODE_PORTS`] pseudo-service; `None` when there are none.
pub fn adopt_node_ports(
    node_ports: &BTreeSet<(Protocol, u16)>,
    kernel: KernelView<'_>,
    cfg: &ProxyConfig,
    node_ips: &BTreeSet<IpAddr>,
    free: impl Fn(&ServiceKey) -> bool,
) -> Option<ServiceDesired> {
    let claims = Claims {
        node_ports: node_ports.clone(),
        ..Claims::default()
    };
    // Only the virtual servers and the SCTP per-address members: the TCP/UDP node-port members
    // do not depend on node addresses and are derived from the Services already.
    let view = KernelView {
        addresses: None,
        ..kernel
    };
    let mut d = adopt_service(&claims, view, cfg, node_ips, free)?;
    d.ipset_entries
        .retain(|e| matches!(e.set, SetKind::NodePortSctp | SetKind::NodePortLocalSctp));
    d.features = Features(
        d.ipset_entries
            .iter()
            .fold(0, |acc, e| acc | feature_of(e.set)),
    );
    d.node_dependent = true;
    if d.virtual_servers.is_empty() && d.ipset_entries.is_empty() {
        return None;
    }
    Some(d)
}
