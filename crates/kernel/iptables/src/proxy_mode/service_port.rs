//! One service port's rules: its inputs, its rendered chains and shared-chain lines, and the
//! `iptables-save`-ordered line builder.

use super::*;

/// One endpoint of a service port.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct EndpointRule {
    /// Pod address.
    pub ip: IpAddr,
    /// Target port.
    pub port: u16,
}

/// Everything the rules of one service port depend on (Kubernetes-agnostic).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ServicePortRules {
    /// `namespace/name:port` (`namespace/name` for an unnamed port): comments and hashes.
    pub name: String,
    /// Protocol.
    pub protocol: Protocol,
    /// ClusterIP.
    pub cluster_ip: IpAddr,
    /// Service port.
    pub port: u16,
    /// NodePort, if any.
    pub node_port: Option<u16>,
    /// externalIPs.
    pub external_ips: Vec<IpAddr>,
    /// Load-balancer ingress IPs.
    pub load_balancer_ips: Vec<IpAddr>,
    /// loadBalancerSourceRanges of this family.
    pub source_ranges: Vec<IpNet>,
    /// Source ranges are set (in any family): the firewall is on.
    pub firewall: bool,
    /// The node's own addresses may reach the LB IP (a source range covers one of them).
    pub allow_from_node: bool,
    /// externalTrafficPolicy Local.
    pub external_local: bool,
    /// internalTrafficPolicy Local.
    pub internal_local: bool,
    /// ClientIP affinity timeout in seconds.
    pub affinity_timeout: Option<u32>,
    /// Health-check node port.
    pub health_check_node_port: Option<u16>,
    /// Cluster-wide endpoints (ready / topology / terminating fallback), no traffic policy.
    pub cluster_endpoints: Vec<EndpointRule>,
    /// Node-local endpoints.
    pub local_endpoints: Vec<EndpointRule>,
}

impl ServicePortRules {
    /// The endpoints under the local (node-local) or cluster traffic policy.
    pub(super) fn policy_endpoints(&self, local: bool) -> &[EndpointRule] {
        if local {
            &self.local_endpoints
        } else {
            &self.cluster_endpoints
        }
    }

    pub(super) fn externally_accessible(&self) -> bool {
        self.node_port.is_some()
            || !self.external_ips.is_empty()
            || !self.load_balancer_ips.is_empty()
    }
}

/// The rules of one service port: its own chains and its lines in the shared chains.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RenderedServicePort {
    /// Its own `nat` chains (name → rules), each rewritten as a whole.
    pub chains: BTreeMap<String, Vec<String>>,
    /// Lines in shared chains, per (table, chain).
    pub shared: BTreeMap<(Table, &'static str), Vec<String>>,
}

/// Parts of a rule in `iptables-save` order.
pub(super) enum Part {
    Src(String),
    In(String),
}

/// Builds one `-A` line in `iptables-save` order: `-s`, `-d`, `-i`, `-p`, matches, target.
pub(super) struct Line {
    pub(super) chain: String,
    pub(super) src: Option<String>,
    pub(super) dst: Option<String>,
    pub(super) iface: Option<String>,
    pub(super) proto: Option<&'static str>,
    pub(super) matches: Vec<String>,
}

impl Line {
    pub(super) fn new(chain: &str) -> Line {
        Line {
            chain: chain.to_string(),
            src: None,
            dst: None,
            iface: None,
            proto: None,
            matches: Vec::new(),
        }
    }
    pub(super) fn part(mut self, p: Option<Part>) -> Line {
        match p {
            Some(Part::Src(s)) => self.src = Some(s),
            Some(Part::In(s)) => self.iface = Some(s),
            None => {}
        }
        self
    }
    pub(super) fn src(mut self, s: String) -> Line {
        self.src = Some(format!("-s {s}"));
        self
    }
    pub(super) fn dst(mut self, d: String) -> Line {
        self.dst = Some(format!("-d {d}"));
        self
    }
    pub(super) fn proto(mut self, p: Protocol) -> Line {
        self.proto = Some(p.as_str());
        self
    }
    pub(super) fn comment(mut self, c: &str) -> Line {
        self.matches
            .push(format!("-m comment --comment {}", quote(c)));
        self
    }
    pub(super) fn m(mut self, m: impl Into<String>) -> Line {
        self.matches.push(m.into());
        self
    }
    pub(super) fn dport(self, p: Protocol, port: u16) -> Line {
        let s = p.as_str();
        self.m(format!("-m {s} --dport {port}"))
    }
    pub(super) fn j(self, target: &str) -> String {
        let mut s = format!("-A {}", self.chain);
        for x in [&self.src, &self.dst, &self.iface].into_iter().flatten() {
            s.push(' ');
            s.push_str(x);
        }
        if let Some(p) = self.proto {
            s.push_str(" -p ");
            s.push_str(p);
        }
        for m in &self.matches {
            s.push(' ');
            s.push_str(m);
        }
        s.push_str(" -j ");
        s.push_str(target);
        s
    }
}

/// Renders the rules of one service port: its entry lines in the shared chains (ClusterIP,
/// external IPs, load-balancer IPs, NodePort, health-check port), then its own chains
/// (`KUBE-EXT`, `KUBE-FW`, `KUBE-SVC` / `KUBE-SVL` and the endpoint chains).
pub fn render_service_port(
    cfg: &ProxyModeConfig,
    sp: &ServicePortRules,
) -> Result<RenderedServicePort> {
    check_families(cfg, sp)?;
    let plan = PortPlan::new(cfg, sp);
    let mut out = RenderedServicePort::default();
    plan.cluster_ip_rules(&mut out);
    plan.external_ip_rules(&mut out);
    plan.load_balancer_rules(&mut out);
    plan.node_port_rules(&mut out);
    if plan.uses_ext {
        let rules = plan.ext_chain_rules()?;
        out.chains.insert(plan.ext.clone(), rules);
    }
    if plan.uses_fw {
        out.chains.insert(plan.fw.clone(), plan.fw_chain_rules());
    }
    if plan.has_svc {
        plan.policy_chain(&plan.svc, &sp.cluster_endpoints, &mut out)?;
    }
    if plan.has_svl {
        plan.policy_chain(&plan.svl, &sp.local_endpoints, &mut out)?;
    }
    Ok(out)
}

/// Every address of the service port is of the configuration's family.
pub(super) fn check_families(cfg: &ProxyModeConfig, sp: &ServicePortRules) -> Result<()> {
    for ip in [&sp.cluster_ip]
        .into_iter()
        .chain(&sp.external_ips)
        .chain(&sp.load_balancer_ips)
        .chain(sp.cluster_endpoints.iter().map(|e| &e.ip))
        .chain(sp.local_endpoints.iter().map(|e| &e.ip))
    {
        if Family::of(ip) != cfg.family {
            return Err(Error::InvalidInput(format!(
                "{}: address {ip} is not of family {:?}",
                sp.name, cfg.family
            )));
        }
    }
    Ok(())
}

impl RenderedServicePort {
    pub(super) fn push_shared(&mut self, table: Table, chain: &'static str, line: String) {
        self.shared.entry((table, chain)).or_default().push(line);
    }
}
