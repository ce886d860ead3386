//! Deriving a service's ports into rendered iptables rules (model → `iptables::proxy_mode`),
//! and the UDP conntrack entries a change made stale.

use super::*;

/// `namespace/name:port`, or `namespace/name` for an unnamed port (upstream's
/// `ServicePortName.String()`, used in comments and chain hashes).
pub fn service_port_string(sp: &ServicePort) -> String {
    if sp.name.port_name.is_empty() {
        format!("{}/{}", sp.name.namespace, sp.name.name)
    } else {
        format!(
            "{}/{}:{}",
            sp.name.namespace, sp.name.name, sp.name.port_name
        )
    }
}

fn ep_rules(eps: &[Endpoint]) -> Vec<EndpointRule> {
    eps.iter()
        .map(|e| EndpointRule {
            ip: e.ip,
            port: e.port,
        })
        .collect()
}

/// The iptables-mode input of one service port, with what its derivation decided besides the
/// rules.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DerivedPort {
    /// The rules' input.
    pub rules: ServicePortRules,
    /// Local traffic policies that leave the port without endpoints.
    pub no_local: NoLocalEndpoints,
    /// The local ready endpoints a health-check node port counts.
    pub health_ips: Vec<IpAddr>,
}

/// The iptables-mode inputs of a Service's ports, and the EndpointSlices skipped as invalid
/// (slice name, reason).
pub type PortRules = (Vec<DerivedPort>, Vec<(String, Invalid)>);

/// The iptables-mode input of every port of one Service (`Ok(vec![])` when the proxy does not
/// handle it), with the EndpointSlices skipped as invalid.
pub fn service_port_rules(
    svc: &model::objects::Svc,
    slices: &[&model::objects::Slice],
    cfg: &ProxyConfig,
    node: &NodeInfo,
) -> Result<PortRules, Invalid> {
    let ports = service_ports(svc, cfg)?;
    let node_ips: Vec<IpAddr> = node.ips_of(cfg.family).collect();
    // The Service's budget, counted as in IPVS mode (see `model::BudgetTally`).
    let node_port_ips = node.node_port_ips(cfg).len();
    let mut budget = model::BudgetTally::start(cfg.budget, &ports, node_port_ips)?;
    let mut out = Vec::with_capacity(ports.len());
    let mut rejected = Vec::new();
    for sp in &ports {
        let merged = endpoints(slices, sp, &node.name);
        for r in merged.rejected {
            if !rejected.contains(&r) {
                rejected.push(r);
            }
        }
        // Cluster-wide and local selections, before traffic policies pick between them.
        let mut both = sp.clone();
        both.internal_local = false;
        both.external_local = false;
        let sel = select_endpoints(&both, &merged.endpoints, &node.name, node.zone.as_deref());
        let policy = |local: bool| {
            if local {
                sel.local.len()
            } else {
                sel.cluster.len()
            }
        };
        budget.port(
            model::port_virtual_servers(sp, node_port_ips),
            policy(sp.internal_local),
            policy(sp.external_local),
        )?;
        let no_local = NoLocalEndpoints::of(
            sp.internal_local,
            sp.external_local,
            sp.externally_accessible(),
            !sel.cluster.is_empty(),
            !sel.local.is_empty(),
        );
        let rules = ServicePortRules {
            name: service_port_string(sp),
            protocol: sp.name.protocol,
            cluster_ip: sp.cluster_ip,
            port: sp.port,
            node_port: sp.node_port,
            external_ips: sp.external_ips.clone(),
            load_balancer_ips: sp.load_balancer_ips.clone(),
            source_ranges: sp.source_ranges.clone(),
            firewall: sp.firewall,
            allow_from_node: sp
                .source_ranges
                .iter()
                .any(|n| node_ips.iter().any(|ip| n.contains(ip))),
            external_local: sp.external_local,
            internal_local: sp.internal_local,
            affinity_timeout: sp.affinity_timeout,
            health_check_node_port: sp.health_check_node_port,
            cluster_endpoints: ep_rules(&sel.cluster),
            local_endpoints: ep_rules(&sel.local),
        };
        out.push(DerivedPort {
            rules,
            no_local,
            health_ips: sel.health_check_ips().collect(),
        });
    }
    Ok((out, rejected))
}

impl IptablesProxier {
    /// Derives and renders `names`; returns the services whose state changed (old value).
    pub(super) fn derive(
        &mut self,
        store: &Store,
        node: &NodeInfo,
        mode: &ProxyModeConfig,
        names: BTreeSet<ServiceName>,
        report: &mut SyncReport,
    ) -> BTreeMap<ServiceName, Option<Vec<PortState>>> {
        let mut changed = BTreeMap::new();
        // Services whose external VIP claims change hands are derived too (see `desired::vip`).
        let names = self.vips.update(store, &self.cfg, node, names);
        report.vip_conflicts = self.vips.conflicts();
        report.node_address_conflicts = self.vips.node_conflicts();
        for name in names {
            report.services_derived += 1;
            let key = format!("service {name}");
            let vip_key = format!("vip {name}");
            let node_key = format!("nodeaddress {name}");
            let fields_key = format!("fields {name}");
            let new = match store.service(&name) {
                None => {
                    self.rejections.clear(&key);
                    self.to_adopt.remove(&name);
                    self.rejections.clear(&vip_key);
                    self.rejections.clear(&node_key);
                    self.rejections.clear(&fields_key);
                    self.rejections.clear_owned(&key);
                    None
                }
                Some(svc) => {
                    let slices = store.slices_of(&name);
                    let lost = self.vips.lost(&name);
                    let node_lost = self.vips.node_lost(&name);
                    match service_port_rules(svc, &slices, &self.cfg, node) {
                        Ok((mut ports, rejected)) => {
                            // Claims another Service wins, or the node keeps, are not rendered.
                            for p in ports.iter_mut().map(|d| &mut d.rules) {
                                let won = |ip: &IpAddr| {
                                    let vip = desired::vip::Vip {
                                        ip: *ip,
                                        port: p.port,
                                        protocol: p.protocol,
                                    };
                                    !lost.contains_key(&vip) && !node_lost.contains_key(&vip)
                                };
                                let (ext, lb): (Vec<IpAddr>, Vec<IpAddr>) = (
                                    p.external_ips.iter().copied().filter(won).collect(),
                                    p.load_balancer_ips.iter().copied().filter(won).collect(),
                                );
                                p.external_ips = ext;
                                p.load_balancer_ips = lb;
                            }
                            match desired::vip::conflict_reason(&lost) {
                                Some(why) => {
                                    self.rejections.reject(&vip_key, &why);
                                }
                                None => self.rejections.clear(&vip_key),
                            }
                            match desired::vip::node_conflict_reason(&node_lost) {
                                Some(why) => {
                                    self.rejections.reject(&node_key, &why);
                                }
                                None => self.rejections.clear(&node_key),
                            }
                            self.rejections
                                .replace_slices(&key, &name.namespace, &rejected);
                            let mut states = Vec::with_capacity(ports.len());
                            let mut bad = None;
                            for p in ports {
                                match proxy_mode::render_service_port(mode, &p.rules) {
                                    Ok(r) => states.push(PortState {
                                        rules: p.rules,
                                        rendered: r,
                                        no_local: p.no_local,
                                        health_ips: p.health_ips,
                                    }),
                                    Err(e) => bad = Some(Invalid::new(e.to_string())),
                                }
                            }
                            match bad {
                                Some(why) => {
                                    self.rejections.reject(&key, &why);
                                    if !self.services.contains_key(&name) {
                                        self.to_adopt.insert(name);
                                    }
                                    continue;
                                }
                                None => {
                                    self.rejections.clear(&key);
                                    self.to_adopt.remove(&name);
                                    // Values left out of a Service it programs.
                                    match (!states.is_empty())
                                        .then(|| model::ignored_fields(svc))
                                        .flatten()
                                    {
                                        Some(why) => {
                                            self.rejections.reject(&fields_key, &why);
                                        }
                                        None => self.rejections.clear(&fields_key),
                                    }
                                    if states.is_empty() {
                                        None
                                    } else {
                                        Some(states)
                                    }
                                }
                            }
                        }
                        Err(why) => {
                            // The last good state stays applied; with none (a restart), the
                            // saved rules are adopted at a full sync.
                            self.rejections.reject(&key, &why);
                            if !self.services.contains_key(&name) {
                                self.to_adopt.insert(name);
                            }
                            continue;
                        }
                    }
                }
            };
            let old = match new {
                Some(states) => self.services.insert(name.clone(), states),
                None => self.services.remove(&name),
            };
            changed.insert(name, old);
        }
        changed
    }

    pub(super) fn record_conntrack(&mut self, name: &ServiceName, old: Option<&Vec<PortState>>) {
        let new = self.services.get(name);
        let udp = |v: Option<&Vec<PortState>>| -> Vec<ServicePortRules> {
            v.into_iter()
                .flatten()
                .filter(|p| p.rules.protocol == ipset::Protocol::Udp)
                .map(|p| p.rules.clone())
                .collect()
        };
        let olds = udp(old);
        let news = udp(new);
        let all_eps = |r: &ServicePortRules| -> BTreeSet<IpAddr> {
            r.cluster_endpoints
                .iter()
                .chain(r.local_endpoints.iter())
                .map(|e| e.ip)
                .collect()
        };
        let vips = |r: &ServicePortRules| -> Vec<(IpAddr, u16)> {
            std::iter::once(r.cluster_ip)
                .chain(r.external_ips.iter().copied())
                .chain(r.load_balancer_ips.iter().copied())
                .map(|ip| (ip, r.port))
                .collect()
        };
        for o in &olds {
            let now = news.iter().find(|n| n.name == o.name);
            let still: BTreeSet<IpAddr> = now.map(all_eps).unwrap_or_default();
            for ip in all_eps(o).difference(&still) {
                self.conntrack.push(UdpConntrackCleanup {
                    service_port: o.name.clone(),
                    vips: vips(o),
                    node_port: o.node_port,
                    endpoint: Some(*ip),
                });
            }
        }
        for n in &news {
            let before = olds
                .iter()
                .find(|o| o.name == n.name)
                .map(|o| !o.cluster_endpoints.is_empty())
                .unwrap_or(false);
            if !before && !n.cluster_endpoints.is_empty() {
                self.conntrack.push(UdpConntrackCleanup {
                    service_port: n.name.clone(),
                    vips: vips(n),
                    node_port: n.node_port,
                    endpoint: None,
                });
            }
        }
    }
}
