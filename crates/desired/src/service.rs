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
use model::{endpoints, select_endpoints, service_ports, Invalid, NodeInfo, ProxyConfig};

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
    let mut d = ServiceDesired::default();
    let mut rejected: BTreeMap<String, Invalid> = BTreeMap::new();
    let node_ports = node.node_port_ips(cfg);
    let node_ips: BTreeSet<IpAddr> = node.ips_of(cfg.family).collect();
    let mut entry = |set: SetKind, entry: Entry| {
        d.ipset_entries.insert(IpsetEntry {
            set,
            entry: entry.normalized(),
        });
    };
    let mut vss: Vec<VirtualServer> = Vec::new();
    let mut features = 0u16;
    let mut addresses = BTreeSet::new();
    let mut health_check: Option<HealthCheck> = None;
    let mut health_ips: BTreeSet<IpAddr> = BTreeSet::new();
    let mut node_dependent = false;

    for sp in &ports {
        let merged = endpoints(slices, sp, &node.name);
        for (name, why) in merged.rejected {
            rejected.entry(name).or_insert(why);
        }
        let sel = select_endpoints(sp, &merged.endpoints, &node.name, node.zone.as_deref());
        d.no_local_internal += u32::from(sel.no_local.internal);
        d.no_local_external += u32::from(sel.no_local.external);
        let proto = sp.name.protocol;
        let make_key = |key: ServiceKey, eps: &[model::Endpoint]| {
            let mut s = Service::new(key, sp.scheduler.clone());
            s.flags = s.flags.with(sp.scheduler_flags);
            if let Some(t) = sp.affinity_timeout {
                s.flags = s.flags.with(ServiceFlags::PERSISTENT);
                s.timeout = t;
            }
            VirtualServer::new(s, eps.iter().map(|e| Destination::new(e.ip, e.port)))
        };
        let make = |addr: IpAddr, port: u16, eps: &[model::Endpoint]| {
            let key = ServiceKey::Inet {
                protocol: proto,
                addr,
                port,
            };
            make_key(key, eps)
        };
        let mut in_cluster: BTreeSet<InClusterDest> = BTreeSet::new();
        let mut in_cluster_dest = |ip: IpAddr, port: u16| {
            if sp.external_local {
                in_cluster.insert(InClusterDest {
                    ip,
                    protocol: proto,
                    port,
                });
            }
        };

        // ClusterIP.
        vss.push(make(sp.cluster_ip, sp.port, &sel.cluster));
        addresses.insert(sp.cluster_ip);
        entry(
            SetKind::ClusterIp,
            Entry::ip_port(sp.cluster_ip, proto, sp.port),
        );

        let won = |ip: &IpAddr| {
            !lost.contains(&Vip {
                ip: *ip,
                port: sp.port,
                protocol: proto,
            })
        };

        // externalIPs.
        for ip in sp.external_ips.iter().filter(|ip| won(ip)) {
            vss.push(make(*ip, sp.port, &sel.external));
            in_cluster_dest(*ip, sp.port);
            if !node.addresses.contains(ip) {
                addresses.insert(*ip);
            }
            if sp.external_local {
                entry(
                    SetKind::ExternalIpLocal,
                    Entry::ip_port(*ip, proto, sp.port),
                );
                features |= Features::EXTERNAL_IPS_LOCAL;
            } else {
                entry(SetKind::ExternalIp, Entry::ip_port(*ip, proto, sp.port));
            }
            features |= Features::EXTERNAL_IPS;
        }

        // Load-balancer ingress IPs.
        for ip in sp.load_balancer_ips.iter().filter(|ip| won(ip)) {
            vss.push(make(*ip, sp.port, &sel.external));
            in_cluster_dest(*ip, sp.port);
            addresses.insert(*ip);
            entry(SetKind::LoadBalancer, Entry::ip_port(*ip, proto, sp.port));
            features |= Features::LOAD_BALANCERS;
            if sp.external_local {
                entry(
                    SetKind::LoadBalancerLocal,
                    Entry::ip_port(*ip, proto, sp.port),
                );
                features |= Features::LOAD_BALANCERS_LOCAL;
            }
            if sp.firewall {
                features |= Features::LB_SOURCE_RANGES;
                node_dependent = true;
                entry(SetKind::LoadBalancerFw, Entry::ip_port(*ip, proto, sp.port));
                for net in &sp.source_ranges {
                    entry(
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
                    entry(
                        SetKind::LoadBalancerSourceIp,
                        Entry::ip_port_ip(*ip, proto, sp.port, *ip),
                    );
                }
            }
        }

        // NodePorts.
        if let Some(np) = sp.node_port {
            node_dependent = true;
            for ip in &node_ports {
                vss.push(make(*ip, np, &sel.external));
                in_cluster_dest(*ip, np);
            }
            match proto {
                Protocol::Tcp | Protocol::Udp => {
                    let (all, local) = if proto == Protocol::Tcp {
                        (SetKind::NodePortTcp, SetKind::NodePortLocalTcp)
                    } else {
                        (SetKind::NodePortUdp, SetKind::NodePortLocalUdp)
                    };
                    entry(all, Entry::Port(np));
                    if sp.external_local {
                        entry(local, Entry::Port(np));
                    }
                    features |= Features::NODE_PORTS;
                }
                Protocol::Sctp => {
                    for ip in &node_ports {
                        entry(SetKind::NodePortSctp, Entry::ip_port(*ip, proto, np));
                        if sp.external_local {
                            entry(SetKind::NodePortLocalSctp, Entry::ip_port(*ip, proto, np));
                        }
                    }
                    features |= Features::SCTP_NODE_PORTS;
                }
            }
            if sp.external_local {
                features |= Features::NODE_PORTS_LOCAL;
            }
        }

        if !in_cluster.is_empty() {
            let key = ServiceKey::Fwmark {
                family: cfg.family,
                mark: 0,
            };
            d.in_cluster.push(InClusterPort {
                port: sp.name.clone(),
                template: make_key(key, &sel.cluster_policy),
                dests: in_cluster,
            });
        }

        // Hairpin: a local endpoint reaching itself through a VIP must be masqueraded. Like
        // upstream (pkg/proxy/ipvs/proxier.go `syncProxyRules`, "Handle traffic that loops
        // back to the originator with SNAT": every local endpoint of the port, whatever its
        // conditions and hints), so the set is the same whichever endpoints are selected.
        for e in &merged.endpoints {
            if e.is_local {
                entry(
                    SetKind::LoopBack,
                    Entry::ip_port_ip(e.ip, proto, e.port, e.ip),
                );
                features |= Features::LOOP_BACK;
            }
        }

        if let Some(hc) = sp.health_check_node_port {
            entry(SetKind::HealthCheckNodePort, Entry::Port(hc));
            features |= Features::HEALTH_CHECK_NODE_PORTS;
            health_ips.extend(sel.health_check_ips());
            health_check = Some(HealthCheck {
                node_port: health_check.map_or(hc, |h| h.node_port),
                local_endpoints: 0,
            });
        }
    }
    for a in &addresses {
        entry(SetKind::IpvsIps, Entry::Ip(*a));
    }
    for vs in vss {
        // A key listed twice within one service (e.g. an externalIP equal to an LB IP):
        // the first wins (ClusterIP, then externalIPs, LB IPs, NodePorts).
        d.virtual_servers.or_insert(vs.service.key, vs);
    }
    d.addresses = addresses.into_iter().collect();
    d.features = Features(features);
    d.health_check = health_check.map(|h| HealthCheck {
        local_endpoints: health_ips.len(),
        ..h
    });
    d.node_dependent = node_dependent;
    Ok(Derived {
        desired: Some(d),
        rejected_slices: rejected.into_iter().collect(),
    })
}
