//! One Service's desired state ([`service_desired`]): its virtual servers with real servers,
//! VIPs, ipset entries, iptables features and health-check port, from the Service, its
//! EndpointSlices, the configuration and the node. Pure.

use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;

use ipset::{Entry, SetKind};
use ipvs_netlink::{Destination, Protocol, Service, ServiceFlags, ServiceKey};

use crate::diff::VirtualServer;
use crate::types::{
    Derived, Features, HealthCheck, InClusterDest, InClusterPort, IpsetEntry, ServiceDesired,
};
use crate::vip::Vip;
use model::objects::{Slice, Svc};
use model::{
    endpoints, port_virtual_servers, select_endpoints, service_ports, BudgetTally, Invalid,
    NodeInfo, ProxyConfig, SelectedEndpoints, ServicePort,
};

/// Derives one Service's desired state from the Service, all of its EndpointSlices, the
/// configuration and the node. `Err` means the Service itself is invalid (skip it).
pub fn service_desired(
    svc: &Svc,
    slices: &[&Slice],
    cfg: &ProxyConfig,
    node: &NodeInfo,
) -> Result<Derived, Invalid> {
    service_desired_except(svc, slices, cfg, node, &BTreeSet::new())
}

/// [`service_desired`] without the external VIPs in `lost` (externalIP or load-balancer
/// claims another Service wins, see [`crate::vip`]): no virtual server, ipset entry or
/// address comes from them.
///
/// Per service port, in this order (the first virtual server of a key wins, see
/// `Acc::finish`): the ClusterIP, the externalIPs, the load-balancer IPs, the NodePorts,
/// the in-cluster marks of external VIPs with a Local policy, the hairpin (KUBE-LOOP-BACK)
/// members and the health-check node port.
pub fn service_desired_except(
    svc: &Svc,
    slices: &[&Slice],
    cfg: &ProxyConfig,
    node: &NodeInfo,
    lost: &BTreeSet<Vip>,
) -> Result<Derived, Invalid> {
    let ports = service_ports(svc, cfg)?;
    if ports.is_empty() {
        return Ok(Derived::default());
    }
    let mut acc = Acc::default();
    let mut rejected: BTreeMap<String, Invalid> = BTreeMap::new();
    let node_ports = node.node_port_ips(cfg);
    let node_ips: BTreeSet<IpAddr> = node.ips_of(cfg.family).collect();
    // The Service's budget, checked before each port's virtual servers are built.
    let mut budget = BudgetTally::start(cfg.budget, &ports, node_ports.len())?;
    for sp in &ports {
        let merged = endpoints(slices, sp, &node.name);
        for (name, why) in merged.rejected {
            rejected.entry(name).or_insert(why);
        }
        let sel = select_endpoints(sp, &merged.endpoints, &node.name, node.zone.as_deref());
        let vs = port_virtual_servers(sp, node_ports.len());
        budget.port(vs, sel.cluster.len(), sel.external.len())?;
        acc.d.no_local_internal += u32::from(sel.no_local.internal);
        acc.d.no_local_external += u32::from(sel.no_local.external);
        let mut port = Port {
            sp,
            sel: &sel,
            lost,
            in_cluster: BTreeSet::new(),
        };
        port.cluster_ip(&mut acc);
        port.external_ips(&mut acc, node);
        port.load_balancer_ips(&mut acc, &node_ips);
        port.node_ports(&mut acc, &node_ports);
        port.in_cluster_marks(&mut acc, cfg);
        loop_back(&mut acc, &merged.endpoints, sp.name.protocol);
        port.health_check(&mut acc);
        budget.ipset_members(acc.entries.len() + acc.addresses.len())?;
    }
    Ok(Derived {
        desired: Some(acc.finish()),
        rejected_slices: rejected.into_iter().collect(),
    })
}

/// What a Service's ports add up to while they are derived.
#[derive(Default)]
struct Acc {
    d: ServiceDesired,
    /// The ipset members, collected here and stored once, exactly sized, by
    /// [`Acc::finish`] (inserted one at a time, the service's sorted set grew by one element
    /// per member: a reallocation each, whose freed blocks stayed as holes in the heap).
    entries: Vec<IpsetEntry>,
    vss: Vec<VirtualServer>,
    features: u16,
    addresses: BTreeSet<IpAddr>,
    health_check: Option<HealthCheck>,
    health_ips: BTreeSet<IpAddr>,
    node_dependent: bool,
}

impl Acc {
    /// Adds an ipset member (normalized).
    fn entry(&mut self, set: SetKind, entry: Entry) {
        self.entries.push(IpsetEntry {
            set,
            entry: entry.normalized(),
        });
    }

    /// The Service's desired state: every VIP in KUBE-IPVS-IPS, the virtual servers by key.
    fn finish(mut self) -> ServiceDesired {
        let addresses = std::mem::take(&mut self.addresses);
        for a in &addresses {
            self.entry(SetKind::IpvsIps, Entry::Ip(*a));
        }
        self.d.addresses = addresses.into_iter().collect();
        self.d.ipset_entries = self.entries.into_iter().collect();
        for vs in self.vss {
            // A key listed twice within one service (e.g. an externalIP equal to an LB IP):
            // the first wins (ClusterIP, then externalIPs, LB IPs, NodePorts).
            self.d.virtual_servers.or_insert(vs.service.key, vs);
        }
        self.d.features = Features(self.features);
        let health_ips = self.health_ips.len();
        self.d.health_check = self.health_check.map(|h| HealthCheck {
            local_endpoints: health_ips,
            ..h
        });
        self.d.node_dependent = self.node_dependent;
        self.d
    }
}

/// One service port being derived: its inputs, its selected endpoints, and the external
/// destinations that in-cluster traffic must reach with the cluster policy.
struct Port<'a> {
    sp: &'a ServicePort,
    sel: &'a SelectedEndpoints,
    lost: &'a BTreeSet<Vip>,
    in_cluster: BTreeSet<InClusterDest>,
}

impl Port<'_> {
    /// A virtual server of this port at `key` with `eps` as its real servers.
    fn virtual_server(&self, key: ServiceKey, eps: &[model::Endpoint]) -> VirtualServer {
        let sp = self.sp;
        let mut s = Service::new(key, sp.scheduler.clone());
        s.flags = s.flags.with(sp.scheduler_flags);
        if let Some(t) = sp.affinity_timeout {
            s.flags = s.flags.with(ServiceFlags::PERSISTENT);
            s.timeout = t;
        }
        VirtualServer::new(s, eps.iter().map(|e| Destination::new(e.ip, e.port)))
    }

    /// A virtual server of this port at `addr:port`.
    fn at(&self, addr: IpAddr, port: u16, eps: &[model::Endpoint]) -> VirtualServer {
        let key = ServiceKey::Inet {
            protocol: self.sp.name.protocol,
            addr,
            port,
        };
        self.virtual_server(key, eps)
    }

    /// Notes an external destination for the in-cluster marks (Local policy only).
    fn in_cluster_dest(&mut self, ip: IpAddr, port: u16) {
        if self.sp.external_local {
            self.in_cluster.insert(InClusterDest {
                ip,
                protocol: self.sp.name.protocol,
                port,
            });
        }
    }

    /// Whether this Service holds the claim on external VIP `ip` at this port.
    fn won(lost: &BTreeSet<Vip>, sp: &ServicePort, ip: &IpAddr) -> bool {
        !lost.contains(&Vip {
            ip: *ip,
            port: sp.port,
            protocol: sp.name.protocol,
        })
    }

    fn cluster_ip(&self, acc: &mut Acc) {
        let sp = self.sp;
        acc.vss
            .push(self.at(sp.cluster_ip, sp.port, &self.sel.cluster));
        acc.addresses.insert(sp.cluster_ip);
        acc.entry(
            SetKind::ClusterIp,
            Entry::ip_port(sp.cluster_ip, sp.name.protocol, sp.port),
        );
    }

    fn external_ips(&mut self, acc: &mut Acc, node: &NodeInfo) {
        let (sp, proto, lost) = (self.sp, self.sp.name.protocol, self.lost);
        for ip in sp.external_ips.iter().filter(|ip| Self::won(lost, sp, ip)) {
            acc.vss.push(self.at(*ip, sp.port, &self.sel.external));
            self.in_cluster_dest(*ip, sp.port);
            if !node.addresses.contains(ip) {
                acc.addresses.insert(*ip);
            }
            if sp.external_local {
                acc.entry(
                    SetKind::ExternalIpLocal,
                    Entry::ip_port(*ip, proto, sp.port),
                );
                acc.features |= Features::EXTERNAL_IPS_LOCAL;
            } else {
                acc.entry(SetKind::ExternalIp, Entry::ip_port(*ip, proto, sp.port));
            }
            acc.features |= Features::EXTERNAL_IPS;
        }
    }

    fn load_balancer_ips(&mut self, acc: &mut Acc, node_ips: &BTreeSet<IpAddr>) {
        let (sp, proto, lost) = (self.sp, self.sp.name.protocol, self.lost);
        for ip in sp
            .load_balancer_ips
            .iter()
            .filter(|ip| Self::won(lost, sp, ip))
        {
            acc.vss.push(self.at(*ip, sp.port, &self.sel.external));
            self.in_cluster_dest(*ip, sp.port);
            acc.addresses.insert(*ip);
            acc.entry(SetKind::LoadBalancer, Entry::ip_port(*ip, proto, sp.port));
            acc.features |= Features::LOAD_BALANCERS;
            if sp.external_local {
                acc.entry(
                    SetKind::LoadBalancerLocal,
                    Entry::ip_port(*ip, proto, sp.port),
                );
                acc.features |= Features::LOAD_BALANCERS_LOCAL;
            }
            if sp.firewall {
                acc.features |= Features::LB_SOURCE_RANGES;
                acc.node_dependent = true;
                acc.entry(SetKind::LoadBalancerFw, Entry::ip_port(*ip, proto, sp.port));
                for net in &sp.source_ranges {
                    acc.entry(
                        SetKind::LoadBalancerSourceCidr,
                        Entry::ip_port_net(*ip, proto, sp.port, *net),
                    );
                }
                // The node may reach the LB IP (bound locally, so the source is the LB IP)
                // when a source range admits one of its addresses.
                let from_node = sp
                    .source_ranges
                    .iter()
                    .any(|n| node_ips.iter().any(|ip| n.contains(ip)));
                if from_node {
                    acc.entry(
                        SetKind::LoadBalancerSourceIp,
                        Entry::ip_port_ip(*ip, proto, sp.port, *ip),
                    );
                }
            }
        }
    }

    fn node_ports(&mut self, acc: &mut Acc, node_ports: &BTreeSet<IpAddr>) {
        let (sp, proto) = (self.sp, self.sp.name.protocol);
        let Some(np) = sp.node_port else {
            return;
        };
        acc.node_dependent = true;
        for ip in node_ports {
            acc.vss.push(self.at(*ip, np, &self.sel.external));
            self.in_cluster_dest(*ip, np);
        }
        match proto {
            Protocol::Tcp | Protocol::Udp => {
                let (all, local) = if proto == Protocol::Tcp {
                    (SetKind::NodePortTcp, SetKind::NodePortLocalTcp)
                } else {
                    (SetKind::NodePortUdp, SetKind::NodePortLocalUdp)
                };
                acc.entry(all, Entry::Port(np));
                if sp.external_local {
                    acc.entry(local, Entry::Port(np));
                }
                acc.features |= Features::NODE_PORTS;
            }
            Protocol::Sctp => {
                for ip in node_ports {
                    acc.entry(SetKind::NodePortSctp, Entry::ip_port(*ip, proto, np));
                    if sp.external_local {
                        acc.entry(SetKind::NodePortLocalSctp, Entry::ip_port(*ip, proto, np));
                    }
                }
                acc.features |= Features::SCTP_NODE_PORTS;
            }
        }
        if sp.external_local {
            acc.features |= Features::NODE_PORTS_LOCAL;
        }
    }

    /// In-cluster traffic to this port's external VIPs (Local policy) follows the cluster
    /// policy: one fwmark template per port.
    fn in_cluster_marks(&mut self, acc: &mut Acc, cfg: &ProxyConfig) {
        if self.in_cluster.is_empty() {
            return;
        }
        let key = ServiceKey::Fwmark {
            family: cfg.family,
            mark: 0,
        };
        acc.d.in_cluster.push(InClusterPort {
            port: self.sp.name.clone(),
            template: self.virtual_server(key, &self.sel.cluster_policy),
            dests: std::mem::take(&mut self.in_cluster),
        });
    }

    fn health_check(&self, acc: &mut Acc) {
        let Some(hc) = self.sp.health_check_node_port else {
            return;
        };
        acc.entry(SetKind::HealthCheckNodePort, Entry::Port(hc));
        acc.features |= Features::HEALTH_CHECK_NODE_PORTS;
        acc.health_ips.extend(self.sel.health_check_ips());
        acc.health_check = Some(HealthCheck {
            node_port: acc.health_check.map_or(hc, |h| h.node_port),
            local_endpoints: 0,
        });
    }
}

/// Hairpin: a local endpoint reaching itself through a VIP must be masqueraded. Like upstream
/// (pkg/proxy/ipvs/proxier.go `syncProxyRules`, "Handle traffic that loops back to the
/// originator with SNAT": every local endpoint of the port, whatever its conditions and
/// hints), so the set is the same whichever endpoints are selected.
fn loop_back(acc: &mut Acc, endpoints: &[model::Endpoint], proto: Protocol) {
    for e in endpoints.iter().filter(|e| e.is_local) {
        acc.entry(
            SetKind::LoopBack,
            Entry::ip_port_ip(e.ip, proto, e.port, e.ip),
        );
        acc.features |= Features::LOOP_BACK;
    }
}
