//! The iptables proxy mode's rules (kube-proxy `--proxy-mode=iptables` compatible), rendered from
//! a pure per-service-port input, plus the pieces a partial `iptables-restore --noflush` needs.
//!
//! Chain names follow upstream's hashing scheme so operators' tooling recognises them:
//! `KUBE-SVC-`/`KUBE-SVL-`/`KUBE-EXT-`/`KUBE-FW-` + the first 16 characters of
//! base32(sha256(service port name + lower-case protocol)), `KUBE-SEP-` + the same of
//! (service port name + protocol + `ip:port`). Rules are written in the order and form
//! `iptables-save` prints them (so the rendered text is what an operator sees), with two
//! exceptions the kernel stores identically: probabilities are written with ten decimals like
//! upstream (`iptables-save` prints the stored fixed-point value with eleven), and comments are
//! always quoted.
//!
//! A service port renders to its own chains (all in `nat`) and to lines in the shared chains
//! (`KUBE-SERVICES`, `KUBE-NODEPORTS`, the filter chains). [`restore_payload`] assembles one
//! restore for both tables that flushes and refills the shared chains, rewrites only the given
//! per-service chains and deletes stale ones.

use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;
use std::sync::OnceLock;

use ipnet::IpNet;
use ipset::{Family, Protocol};
use sha2::{Digest, Sha256};

use crate::ipvs_mode::LocalDetect;
use crate::rules::{quote, Table};
use crate::{Error, Result};

/// nat: entry chain from PREROUTING/OUTPUT (and filter: REJECT for VIPs without endpoints).
pub const SERVICES: &str = "KUBE-SERVICES";
/// nat: NodePorts (jumped to at the end of KUBE-SERVICES); filter: health-check node ports.
pub const NODEPORTS: &str = "KUBE-NODEPORTS";
/// filter: REJECT/DROP for external VIPs and NodePorts without (local) endpoints.
pub const EXTERNAL_SERVICES: &str = "KUBE-EXTERNAL-SERVICES";
/// nat: MASQUERADE of marked packets.
pub const POSTROUTING: &str = "KUBE-POSTROUTING";
/// nat: sets the masquerade mark.
pub const MARK_MASQ: &str = "KUBE-MARK-MASQ";
/// filter: accepts forwarded service traffic.
pub const FORWARD: &str = "KUBE-FORWARD";
/// filter: drops load-balancer traffic not admitted by `loadBalancerSourceRanges`.
pub const PROXY_FIREWALL: &str = "KUBE-PROXY-FIREWALL";
/// filter: kubelet's chain holding the anti-martian rule that makes localhost NodePorts
/// (`route_localnet=1`) safe. kubelet creates the same chain and rule; like upstream
/// (`kubeletFirewallChain` in pkg/proxy/iptables/proxier.go) this mode refills it while it
/// serves IPv4 localhost NodePorts and never deletes it (not in [`base_chains`], so no cleanup
/// removes it or its jumps).
pub const KUBELET_FIREWALL: &str = "KUBE-FIREWALL";

/// Prefixes of the per-service chains this mode owns (all in `nat`).
pub const SERVICE_CHAIN_PREFIXES: [&str; 5] = [
    "KUBE-SVC-",
    "KUBE-SVL-",
    "KUBE-EXT-",
    "KUBE-FW-",
    "KUBE-SEP-",
];

/// The shared chains this mode owns, per table, in the order they are declared.
pub fn base_chains() -> Vec<(Table, &'static str)> {
    vec![
        (Table::Nat, SERVICES),
        (Table::Nat, NODEPORTS),
        (Table::Nat, POSTROUTING),
        (Table::Nat, MARK_MASQ),
        (Table::Filter, SERVICES),
        (Table::Filter, EXTERNAL_SERVICES),
        (Table::Filter, NODEPORTS),
        (Table::Filter, FORWARD),
        (Table::Filter, PROXY_FIREWALL),
    ]
}

/// True when `chain` (in `table`) belongs to the iptables proxy mode.
pub fn owns_chain(table: Table, chain: &str) -> bool {
    base_chains()
        .iter()
        .any(|(t, c)| *t == table && *c == chain)
        || (table == Table::Nat && SERVICE_CHAIN_PREFIXES.iter().any(|p| chain.starts_with(p)))
}

/// A jump from a built-in chain into one of this mode's chains, kept exactly once (at the top).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ModeJump {
    /// Table.
    pub table: Table,
    /// Built-in chain.
    pub from: &'static str,
    /// Our chain.
    pub to: &'static str,
    /// Matches before the comment (e.g. `-m conntrack --ctstate NEW`), or empty.
    pub extra: &'static str,
    /// Upstream's comment.
    pub comment: &'static str,
}

impl ModeJump {
    /// The rule spec after the chain name, as `iptables-save` prints it.
    pub fn spec(&self) -> String {
        let extra = if self.extra.is_empty() {
            String::new()
        } else {
            format!("{} ", self.extra)
        };
        if self.comment.is_empty() {
            return format!("{extra}-j {}", self.to);
        }
        format!(
            "{extra}-m comment --comment {} -j {}",
            quote(self.comment),
            self.to
        )
    }

    /// `-A FROM spec`.
    pub fn save_line(&self) -> String {
        format!("-A {} {}", self.from, self.spec())
    }
}

const NEW: &str = "-m conntrack --ctstate NEW";

/// The jumps from built-in chains, as upstream's iptables proxier installs them.
pub fn jumps() -> Vec<ModeJump> {
    let j = |table, from, to, extra, comment| ModeJump {
        table,
        from,
        to,
        extra,
        comment,
    };
    let ext = "kubernetes externally-visible service portals";
    let portals = "kubernetes service portals";
    let fw = "kubernetes load balancer firewall";
    vec![
        j(Table::Filter, "INPUT", EXTERNAL_SERVICES, NEW, ext),
        j(Table::Filter, "FORWARD", EXTERNAL_SERVICES, NEW, ext),
        j(
            Table::Filter,
            "INPUT",
            NODEPORTS,
            "",
            "kubernetes health check service ports",
        ),
        j(Table::Filter, "FORWARD", SERVICES, NEW, portals),
        j(Table::Filter, "OUTPUT", SERVICES, NEW, portals),
        j(
            Table::Filter,
            "FORWARD",
            FORWARD,
            "",
            "kubernetes forwarding rules",
        ),
        j(Table::Filter, "INPUT", PROXY_FIREWALL, NEW, fw),
        j(Table::Filter, "OUTPUT", PROXY_FIREWALL, NEW, fw),
        j(Table::Filter, "FORWARD", PROXY_FIREWALL, NEW, fw),
        j(Table::Nat, "OUTPUT", SERVICES, "", portals),
        j(Table::Nat, "PREROUTING", SERVICES, "", portals),
        j(
            Table::Nat,
            "POSTROUTING",
            POSTROUTING,
            "",
            "kubernetes postrouting rules",
        ),
    ]
}

/// The jumps into kubelet's [`KUBELET_FIREWALL`] chain (no comment), installed while the mode
/// serves IPv4 localhost NodePorts; upstream's `iptablesKubeletJumpChains`. Cleanup never
/// removes them (kubelet owns the chain).
pub fn kubelet_jumps() -> Vec<ModeJump> {
    ["INPUT", "OUTPUT"]
        .into_iter()
        .map(|from| ModeJump {
            table: Table::Filter,
            from,
            to: KUBELET_FIREWALL,
            extra: "",
            comment: "",
        })
        .collect()
}

/// The jumps a sync with `cfg` keeps in place: [`jumps`], plus [`kubelet_jumps`] while IPv4
/// localhost NodePorts are served.
pub fn jumps_for(cfg: &ProxyModeConfig) -> Vec<ModeJump> {
    let mut v = jumps();
    if cfg.localhost_firewall() {
        v.extend(kubelet_jumps());
    }
    v
}

fn hash16(input: &str) -> String {
    let digest = Sha256::digest(input.as_bytes());
    let enc = data_encoding::BASE32.encode(&digest);
    enc.chars().take(16).collect()
}

/// Upstream's `portProtoHash`: base32(sha256(name + protocol))[..16].
pub fn port_proto_hash(service_port_name: &str, protocol: Protocol) -> String {
    hash16(&format!("{service_port_name}{}", protocol.as_str()))
}

/// `KUBE-SVC-…` of a service port (`ns/name:port`, or `ns/name` when the port is unnamed).
pub fn svc_chain(service_port_name: &str, protocol: Protocol) -> String {
    format!("KUBE-SVC-{}", port_proto_hash(service_port_name, protocol))
}

/// `KUBE-SVL-…` (local endpoints only).
pub fn svl_chain(service_port_name: &str, protocol: Protocol) -> String {
    format!("KUBE-SVL-{}", port_proto_hash(service_port_name, protocol))
}

/// `KUBE-EXT-…` (external traffic).
pub fn ext_chain(service_port_name: &str, protocol: Protocol) -> String {
    format!("KUBE-EXT-{}", port_proto_hash(service_port_name, protocol))
}

/// `KUBE-FW-…` (load-balancer source ranges).
pub fn fw_chain(service_port_name: &str, protocol: Protocol) -> String {
    format!("KUBE-FW-{}", port_proto_hash(service_port_name, protocol))
}

/// `ip:port`, IPv6 in brackets.
pub fn endpoint_string(ip: IpAddr, port: u16) -> String {
    match ip {
        IpAddr::V4(a) => format!("{a}:{port}"),
        IpAddr::V6(a) => format!("[{a}]:{port}"),
    }
}

/// `KUBE-SEP-…` of one endpoint of a service port.
pub fn sep_chain(service_port_name: &str, protocol: Protocol, ip: IpAddr, port: u16) -> String {
    format!(
        "KUBE-SEP-{}",
        hash16(&format!(
            "{service_port_name}{}{}",
            protocol.as_str(),
            endpoint_string(ip, port)
        ))
    )
}

/// Number of precomputed probability strings (endpoints per service port beyond this are
/// formatted on demand).
const PRECOMPUTED: usize = 1000;

/// The `--probability` argument for picking one of `n` remaining endpoints, `%0.10f` of 1/n
/// like upstream; precomputed for n up to 1,000.
pub fn probability(n: usize) -> String {
    static TABLE: OnceLock<Vec<String>> = OnceLock::new();
    let table = TABLE.get_or_init(|| {
        (0..=PRECOMPUTED)
            .map(|i| format!("{:.10}", 1.0 / (i.max(1) as f64)))
            .collect()
    });
    match table.get(n) {
        Some(s) => s.clone(),
        None => format!("{:.10}", 1.0 / (n.max(1) as f64)),
    }
}

/// Configuration of the mode (node-wide).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProxyModeConfig {
    /// Address family.
    pub family: Family,
    /// Bit of the masquerade mark (default 14, i.e. 0x4000).
    pub masquerade_bit: u32,
    /// `--masquerade-all`.
    pub masquerade_all: bool,
    /// Local-traffic detection (pod CIDR / interface).
    pub local_detect: LocalDetect,
    /// `--random-fully` on MASQUERADE.
    pub random_fully: bool,
    /// NodePort addresses when `--nodeport-addresses` is set; `None`: every local address
    /// (`-m addrtype --dst-type LOCAL`).
    pub node_port_ips: Option<Vec<IpAddr>>,
    /// NodePorts answer on 127.0.0.0/8 (`iptables.localhostNodePorts` in effect: IPv4, and the
    /// NodePort addresses include IPv4 loopback). Ignored for IPv6, where localhost NodePorts
    /// never work (upstream's IPv6 proxier always gets `false`).
    pub localhost_node_ports: bool,
}

impl ProxyModeConfig {
    /// Defaults: bit 14, no masquerade-all, no local detection, `--random-fully`, NodePorts on
    /// every local address.
    pub fn new(family: Family) -> ProxyModeConfig {
        ProxyModeConfig {
            family,
            masquerade_bit: 14,
            masquerade_all: false,
            local_detect: LocalDetect::None,
            random_fully: true,
            node_port_ips: None,
            localhost_node_ports: false,
        }
    }

    /// True when the anti-martian rule in [`KUBELET_FIREWALL`] is written: IPv4 with localhost
    /// NodePorts (upstream: `!isIPv6 && proxier.localhostNodePorts` in syncProxyRules).
    pub fn localhost_firewall(&self) -> bool {
        self.family == Family::Inet && self.localhost_node_ports
    }

    /// The filter/nat chains a restore with this configuration declares (flushes and refills):
    /// [`base_chains`], plus [`KUBELET_FIREWALL`] while [`Self::localhost_firewall`].
    pub fn chains(&self) -> Vec<(Table, &'static str)> {
        let mut v = base_chains();
        if self.localhost_firewall() {
            v.push((Table::Filter, KUBELET_FIREWALL));
        }
        v
    }

    fn mark(&self) -> Result<String> {
        if self.masquerade_bit > 31 {
            return Err(Error::InvalidInput(format!(
                "masquerade bit {} not in [0, 31]",
                self.masquerade_bit
            )));
        }
        let m = 1u64 << self.masquerade_bit;
        Ok(format!("{m:#x}/{m:#x}"))
    }

    fn host_len(&self) -> u8 {
        match self.family {
            Family::Inet => 32,
            Family::Inet6 => 128,
        }
    }

    fn reject(&self) -> &'static str {
        match self.family {
            Family::Inet => "REJECT --reject-with icmp-port-unreachable",
            Family::Inet6 => "REJECT --reject-with icmp6-port-unreachable",
        }
    }

    fn recent_mask(&self) -> &'static str {
        match self.family {
            Family::Inet => "255.255.255.255",
            Family::Inet6 => "ffff:ffff:ffff:ffff:ffff:ffff:ffff:ffff",
        }
    }

    /// `(source/interface part, negated)` selecting local pod traffic, if detection is set.
    fn local_match(&self, negate: bool) -> Result<Option<Part>> {
        let bang = if negate { "! " } else { "" };
        Ok(match &self.local_detect {
            LocalDetect::None => None,
            LocalDetect::Cidrs(cidrs) => cidrs
                .iter()
                .find(|c| Family::of(&c.addr()) == self.family)
                .map(|c| Part::Src(format!("{bang}-s {}", c.trunc()))),
            LocalDetect::BridgeInterface(i) => Some(Part::In(format!("{bang}-i {}", iface(i)?))),
            LocalDetect::InterfaceNamePrefix(p) => {
                Some(Part::In(format!("{bang}-i {}+", iface(p)?)))
            }
        })
    }
}

fn iface(s: &str) -> Result<&str> {
    if s.is_empty()
        || s.len() > 15
        || !s
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
    {
        return Err(Error::InvalidInput(format!("bad interface name {s:?}")));
    }
    Ok(s)
}

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
    fn policy_endpoints(&self, local: bool) -> &[EndpointRule] {
        if local {
            &self.local_endpoints
        } else {
            &self.cluster_endpoints
        }
    }

    fn externally_accessible(&self) -> bool {
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
enum Part {
    Src(String),
    In(String),
}

/// Builds one `-A` line in `iptables-save` order: `-s`, `-d`, `-i`, `-p`, matches, target.
struct Line {
    chain: String,
    src: Option<String>,
    dst: Option<String>,
    iface: Option<String>,
    proto: Option<&'static str>,
    matches: Vec<String>,
}

impl Line {
    fn new(chain: &str) -> Line {
        Line {
            chain: chain.to_string(),
            src: None,
            dst: None,
            iface: None,
            proto: None,
            matches: Vec::new(),
        }
    }
    fn part(mut self, p: Option<Part>) -> Line {
        match p {
            Some(Part::Src(s)) => self.src = Some(s),
            Some(Part::In(s)) => self.iface = Some(s),
            None => {}
        }
        self
    }
    fn src(mut self, s: String) -> Line {
        self.src = Some(format!("-s {s}"));
        self
    }
    fn dst(mut self, d: String) -> Line {
        self.dst = Some(format!("-d {d}"));
        self
    }
    fn proto(mut self, p: Protocol) -> Line {
        self.proto = Some(p.as_str());
        self
    }
    fn comment(mut self, c: &str) -> Line {
        self.matches
            .push(format!("-m comment --comment {}", quote(c)));
        self
    }
    fn m(mut self, m: impl Into<String>) -> Line {
        self.matches.push(m.into());
        self
    }
    fn dport(self, p: Protocol, port: u16) -> Line {
        let s = p.as_str();
        self.m(format!("-m {s} --dport {port}"))
    }
    fn j(self, target: &str) -> String {
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
fn check_families(cfg: &ProxyModeConfig, sp: &ServicePortRules) -> Result<()> {
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

/// What the rules of one service port hinge on, worked out once from its inputs (upstream's
/// `syncProxyRules` per-port prelude: which policy chains exist and which ones each entry
/// point uses).
struct PortPlan<'a> {
    cfg: &'a ProxyModeConfig,
    sp: &'a ServicePortRules,
    svc: String,
    svl: String,
    ext: String,
    fw: String,
    /// The cluster policy chain is written (used and has endpoints).
    has_svc: bool,
    /// The local policy chain is written.
    has_svl: bool,
    /// In-cluster traffic has endpoints under its policy.
    has_internal: bool,
    /// External traffic has endpoints under its policy.
    has_external: bool,
    /// The external entry points jump to `KUBE-EXT`.
    uses_ext: bool,
    /// Load-balancer traffic goes through the `KUBE-FW` firewall chain.
    uses_fw: bool,
}

impl<'a> PortPlan<'a> {
    fn new(cfg: &'a ProxyModeConfig, sp: &'a ServicePortRules) -> PortPlan<'a> {
        let (name, proto) = (sp.name.as_str(), sp.protocol);
        let externally = sp.externally_accessible();
        let uses_cluster = !sp.internal_local || externally;
        let uses_local = sp.internal_local || (sp.external_local && externally);
        let has_internal = !sp.policy_endpoints(sp.internal_local).is_empty();
        let has_external = !sp.policy_endpoints(sp.external_local).is_empty();
        PortPlan {
            cfg,
            sp,
            svc: svc_chain(name, proto),
            svl: svl_chain(name, proto),
            ext: ext_chain(name, proto),
            fw: fw_chain(name, proto),
            has_svc: uses_cluster && !sp.cluster_endpoints.is_empty(),
            has_svl: uses_local && !sp.local_endpoints.is_empty(),
            has_internal,
            has_external,
            uses_ext: externally && has_external,
            uses_fw: sp.firewall && !sp.load_balancer_ips.is_empty() && has_external,
        }
    }

    fn name(&self) -> &str {
        &self.sp.name
    }

    /// The policy chain for local (`KUBE-SVL`) or cluster (`KUBE-SVC`) traffic policy.
    fn policy_chain_name(&self, local: bool) -> &str {
        if local {
            &self.svl
        } else {
            &self.svc
        }
    }

    fn host(&self, ip: &IpAddr) -> String {
        format!("{ip}/{}", self.cfg.host_len())
    }

    /// A filter line's comment and target when a policy has no endpoints: DROP when only
    /// local ones are missing, the configured reject otherwise.
    fn no_endpoints(&self, local_policy: bool) -> (String, &'static str) {
        let name = self.name();
        if local_policy && !self.sp.cluster_endpoints.is_empty() {
            (format!("{name} has no local endpoints"), "DROP")
        } else {
            (format!("{name} has no endpoints"), self.cfg.reject())
        }
    }

    /// A `-d ADDR -p PROTO ... --dport PORT` line of a shared chain.
    fn to_port(&self, chain: &str, ip: &IpAddr, comment: &str, target: &str) -> String {
        let proto = self.sp.protocol;
        Line::new(chain)
            .dst(self.host(ip))
            .proto(proto)
            .comment(comment)
            .dport(proto, self.sp.port)
            .j(target)
    }

    /// The "no endpoints" filter line of an external entry point.
    fn no_external_endpoints(&self, chain: &str, ip: &IpAddr) -> String {
        let (c, target) = self.no_endpoints(self.sp.external_local);
        self.to_port(chain, ip, &c, target)
    }

    fn cluster_ip_rules(&self, out: &mut RenderedServicePort) {
        let sp = self.sp;
        if self.has_internal {
            let line = self.to_port(
                SERVICES,
                &sp.cluster_ip,
                &format!("{} cluster IP", self.name()),
                self.policy_chain_name(sp.internal_local),
            );
            out.push_shared(Table::Nat, SERVICES, line);
        } else {
            let (c, target) = self.no_endpoints(sp.internal_local);
            let line = self.to_port(SERVICES, &sp.cluster_ip, &c, target);
            out.push_shared(Table::Filter, SERVICES, line);
        }
    }

    fn external_ip_rules(&self, out: &mut RenderedServicePort) {
        for ip in &self.sp.external_ips {
            if self.uses_ext {
                let c = format!("{} external IP", self.name());
                let line = self.to_port(SERVICES, ip, &c, &self.ext);
                out.push_shared(Table::Nat, SERVICES, line);
            } else {
                let line = self.no_external_endpoints(EXTERNAL_SERVICES, ip);
                out.push_shared(Table::Filter, EXTERNAL_SERVICES, line);
            }
        }
    }

    fn load_balancer_rules(&self, out: &mut RenderedServicePort) {
        let name = self.name();
        for ip in &self.sp.load_balancer_ips {
            if self.uses_ext {
                let target = if self.uses_fw { &self.fw } else { &self.ext };
                let line = self.to_port(SERVICES, ip, &format!("{name} loadbalancer IP"), target);
                out.push_shared(Table::Nat, SERVICES, line);
            }
            if self.uses_fw {
                let c = format!("{name} traffic not accepted by {}", self.fw);
                let line = self.to_port(PROXY_FIREWALL, ip, &c, "DROP");
                out.push_shared(Table::Filter, PROXY_FIREWALL, line);
            }
            if !self.has_external {
                let line = self.no_external_endpoints(EXTERNAL_SERVICES, ip);
                out.push_shared(Table::Filter, EXTERNAL_SERVICES, line);
            }
        }
    }

    /// The NodePort and the health-check node port.
    fn node_port_rules(&self, out: &mut RenderedServicePort) {
        let (sp, name, proto) = (self.sp, self.name(), self.sp.protocol);
        if let Some(np) = sp.node_port {
            if self.uses_ext {
                let line = Line::new(NODEPORTS)
                    .proto(proto)
                    .comment(name)
                    .dport(proto, np)
                    .j(&self.ext);
                out.push_shared(Table::Nat, NODEPORTS, line);
            } else {
                let (c, target) = self.no_endpoints(sp.external_local);
                let line = Line::new(EXTERNAL_SERVICES)
                    .proto(proto)
                    .comment(&c)
                    .m("-m addrtype --dst-type LOCAL")
                    .dport(proto, np)
                    .j(target);
                out.push_shared(Table::Filter, EXTERNAL_SERVICES, line);
            }
        }
        if let Some(hc) = sp.health_check_node_port {
            let line = Line::new(NODEPORTS)
                .proto(Protocol::Tcp)
                .comment(&format!("{name} health check node port"))
                .dport(Protocol::Tcp, hc)
                .j("ACCEPT");
            out.push_shared(Table::Filter, NODEPORTS, line);
        }
    }

    /// `KUBE-EXT`: masquerade (cluster policy) or keep local pod and host traffic on the
    /// cluster chain (local policy), then the external policy chain.
    fn ext_chain_rules(&self) -> Result<Vec<String>> {
        let (name, ext, svc) = (self.name(), &self.ext, &self.svc);
        let mut rules = Vec::new();
        if !self.sp.external_local {
            rules.push(
                Line::new(ext)
                    .comment(&format!(
                        "masquerade traffic for {name} external destinations"
                    ))
                    .j(MARK_MASQ),
            );
        } else if self.has_svc {
            if let Some(local) = self.cfg.local_match(false)? {
                rules.push(
                    Line::new(ext)
                        .part(Some(local))
                        .comment(&format!("pod traffic for {name} external destinations"))
                        .j(svc),
                );
            }
            rules.push(
                Line::new(ext)
                    .comment(&format!(
                        "masquerade LOCAL traffic for {name} external destinations"
                    ))
                    .m("-m addrtype --src-type LOCAL")
                    .j(MARK_MASQ),
            );
            rules.push(
                Line::new(ext)
                    .comment(&format!(
                        "route LOCAL traffic for {name} external destinations"
                    ))
                    .m("-m addrtype --src-type LOCAL")
                    .j(svc),
            );
        }
        rules.push(Line::new(ext).j(self.policy_chain_name(self.sp.external_local)));
        Ok(rules)
    }

    /// `KUBE-FW`: the source ranges (and the node's own LB IPs when allowed) go on to
    /// `KUBE-EXT`; the rest falls through to the DROP in `KUBE-PROXY-FIREWALL`.
    fn fw_chain_rules(&self) -> Vec<String> {
        let (sp, fw) = (self.sp, &self.fw);
        let c = format!("{} loadbalancer IP", self.name());
        let mut rules = Vec::new();
        for r in &sp.source_ranges {
            rules.push(
                Line::new(fw)
                    .src(r.trunc().to_string())
                    .comment(&c)
                    .j(&self.ext),
            );
        }
        if sp.allow_from_node {
            for ip in &sp.load_balancer_ips {
                rules.push(Line::new(fw).src(self.host(ip)).comment(&c).j(&self.ext));
            }
        }
        rules
    }

    /// The masquerade line of the in-cluster policy chain for ClusterIP traffic from outside
    /// the cluster (or all of it with `masqueradeAll`).
    fn masquerade_cluster_ip(&self, chain: &str) -> Result<Option<String>> {
        let (sp, proto) = (self.sp, self.sp.protocol);
        let base = |part: Option<Part>| {
            Line::new(chain)
                .part(part)
                .dst(self.host(&sp.cluster_ip))
                .proto(proto)
                .comment(&format!("{} cluster IP", self.name()))
                .dport(proto, sp.port)
                .j(MARK_MASQ)
        };
        if self.cfg.masquerade_all {
            Ok(Some(base(None)))
        } else {
            Ok(self.cfg.local_match(true)?.map(|p| base(Some(p))))
        }
    }

    /// A policy chain (`KUBE-SVC` / `KUBE-SVL`): affinity checks, then the random split over
    /// the endpoints; and the endpoints' own `KUBE-SEP` chains.
    fn policy_chain(
        &self,
        chain: &str,
        eps: &[EndpointRule],
        out: &mut RenderedServicePort,
    ) -> Result<()> {
        let (name, proto) = (self.name(), self.sp.protocol);
        let mut rules = Vec::new();
        if chain == self.policy_chain_name(self.sp.internal_local) {
            if let Some(l) = self.masquerade_cluster_ip(chain)? {
                rules.push(l);
            }
        }
        let seps: Vec<(String, &EndpointRule)> = eps
            .iter()
            .map(|e| (sep_chain(name, proto, e.ip, e.port), e))
            .collect();
        if let Some(t) = self.sp.affinity_timeout {
            for (sep, e) in &seps {
                rules.push(
                    Line::new(chain)
                        .comment(&format!("{name} -> {}", endpoint_string(e.ip, e.port)))
                        .m(format!(
                            "-m recent --rcheck --seconds {t} --reap --name {sep} --mask {} --rsource",
                            self.cfg.recent_mask()
                        ))
                        .j(sep),
                );
            }
        }
        let n = seps.len();
        for (i, (sep, e)) in seps.iter().enumerate() {
            let mut l =
                Line::new(chain).comment(&format!("{name} -> {}", endpoint_string(e.ip, e.port)));
            if i + 1 < n {
                l = l.m(format!(
                    "-m statistic --mode random --probability {}",
                    probability(n - i)
                ));
            }
            rules.push(l.j(sep));
        }
        out.chains.insert(chain.to_string(), rules);
        for (sep, e) in seps {
            if let std::collections::btree_map::Entry::Vacant(v) = out.chains.entry(sep) {
                let rules = self.endpoint_chain_rules(v.key(), e);
                v.insert(rules);
            }
        }
        Ok(())
    }

    /// A `KUBE-SEP` chain: hairpin masquerade, then the DNAT (recording the client for
    /// affinity).
    fn endpoint_chain_rules(&self, sep: &str, e: &EndpointRule) -> Vec<String> {
        let (name, proto) = (self.name(), self.sp.protocol);
        let mut dnat = Line::new(sep).proto(proto).comment(name);
        if self.sp.affinity_timeout.is_some() {
            dnat = dnat.m(format!(
                "-m recent --set --name {sep} --mask {} --rsource",
                self.cfg.recent_mask()
            ));
        }
        vec![
            Line::new(sep)
                .src(self.host(&e.ip))
                .comment(name)
                .j(MARK_MASQ),
            dnat.m(format!("-m {}", proto.as_str())).j(&format!(
                "DNAT --to-destination {}",
                endpoint_string(e.ip, e.port)
            )),
        ]
    }
}

impl RenderedServicePort {
    fn push_shared(&mut self, table: Table, chain: &'static str, line: String) {
        self.shared.entry((table, chain)).or_default().push(line);
    }
}

/// The rules of the shared chains that do not depend on services, per (table, chain), in order.
/// `KUBE-SERVICES`'s final NodePort jump is appended by [`restore_payload`].
pub fn static_rules(cfg: &ProxyModeConfig) -> Result<Vec<(Table, &'static str, String)>> {
    let mark = cfg.mark()?;
    let mut v = vec![
        (
            Table::Nat,
            POSTROUTING,
            format!("-A {POSTROUTING} -m mark ! --mark {mark} -j RETURN"),
        ),
        (
            Table::Nat,
            POSTROUTING,
            format!(
                "-A {POSTROUTING} -j MARK --set-xmark {}/0x0",
                mark.split('/').next().unwrap_or_default()
            ),
        ),
        (
            Table::Nat,
            POSTROUTING,
            format!(
                "-A {POSTROUTING} -m comment --comment {} -j MASQUERADE{}",
                quote("kubernetes service traffic requiring SNAT"),
                if cfg.random_fully {
                    " --random-fully"
                } else {
                    ""
                }
            ),
        ),
        (
            Table::Nat,
            MARK_MASQ,
            format!("-A {MARK_MASQ} -j MARK --set-xmark {mark}"),
        ),
        (
            Table::Filter,
            FORWARD,
            format!("-A {FORWARD} -m conntrack --ctstate INVALID -j DROP"),
        ),
        (
            Table::Filter,
            FORWARD,
            format!(
                "-A {FORWARD} -m comment --comment {} -m mark --mark {mark} -j ACCEPT",
                quote("kubernetes forwarding rules")
            ),
        ),
        (
            Table::Filter,
            FORWARD,
            format!(
                "-A {FORWARD} -m comment --comment {} -m conntrack --ctstate RELATED,ESTABLISHED -j ACCEPT",
                quote("kubernetes forwarding conntrack rule")
            ),
        ),
    ];
    if cfg.localhost_firewall() {
        // Upstream syncProxyRules: with route_localnet=1, drop packets to 127.0.0.0/8 from
        // elsewhere unless conntrack knows them (issue 90259). The same rule as kubelet's.
        v.push((
            Table::Filter,
            KUBELET_FIREWALL,
            format!(
                "-A {KUBELET_FIREWALL} ! -s 127.0.0.0/8 -d 127.0.0.0/8 -m comment --comment {} \
                 -m conntrack ! --ctstate RELATED,ESTABLISHED,DNAT -j DROP",
                quote("block incoming localnet connections")
            ),
        ));
    }
    let np = "kubernetes service nodeports; NOTE: this must be the last rule in this chain";
    match &cfg.node_port_ips {
        None => {
            // Upstream syncProxyRules: localhost NodePorts never work on IPv6, and on IPv4
            // only with route_localnet (localhostNodePorts), so exclude loopback otherwise.
            let not_lo = match cfg.family {
                Family::Inet6 => "! -d ::1/128 ",
                Family::Inet if !cfg.localhost_node_ports => "! -d 127.0.0.0/8 ",
                Family::Inet => "",
            };
            v.push((
                Table::Nat,
                SERVICES,
                format!(
                    "-A {SERVICES} {not_lo}-m comment --comment {} -m addrtype --dst-type LOCAL -j {NODEPORTS}",
                    quote(np)
                ),
            ))
        }
        Some(ips) => {
            // Loopback addresses only with localhost NodePorts (upstream skips them, with an
            // error log, for IPv6 or with localhostNodePorts false).
            for ip in ips
                .iter()
                .filter(|ip| Family::of(ip) == cfg.family)
                .filter(|ip| !ip.is_loopback() || cfg.localhost_firewall())
            {
                v.push((
                    Table::Nat,
                    SERVICES,
                    format!(
                        "-A {SERVICES} -d {ip}/{} -m comment --comment {} -j {NODEPORTS}",
                        cfg.host_len(),
                        quote(np)
                    ),
                ));
            }
        }
    }
    Ok(v)
}

/// What one restore writes.
#[derive(Debug, Clone, Copy)]
pub struct PayloadInput<'a> {
    /// Configuration.
    pub cfg: &'a ProxyModeConfig,
    /// Every service port's rendered rules (shared-chain lines come from all of them), in the
    /// order their lines should appear.
    pub ports: &'a [&'a RenderedServicePort],
    /// Per-service chains to (re)write: name → rules.
    pub write: &'a BTreeMap<String, Vec<String>>,
    /// Per-service chains to delete (flushed, then `-X` after every reference is gone).
    pub delete: &'a BTreeSet<String>,
    /// Jump lines to add or remove in built-in chains (`-I …` / `-D …`), per table.
    pub jump_fixes: &'a BTreeMap<Table, Vec<String>>,
}

/// Assembles one `iptables-restore --noflush` payload for both tables: the shared chains
/// flushed and refilled, the given per-service chains rewritten, stale ones deleted.
pub fn restore_payload(input: &PayloadInput<'_>) -> Result<String> {
    let statics = static_rules(input.cfg)?;
    let mut out =
        String::with_capacity(256 + input.write.values().map(|r| r.len() * 160).sum::<usize>());
    for table in [Table::Nat, Table::Filter] {
        out.push_str(&format!("*{table}\n"));
        let chains: Vec<&str> = input
            .cfg
            .chains()
            .into_iter()
            .filter(|(t, _)| *t == table)
            .map(|(_, c)| c)
            .collect();
        for c in &chains {
            out.push_str(&format!(":{c} - [0:0]\n"));
        }
        if table == Table::Nat {
            for c in input.write.keys().chain(input.delete.iter()) {
                out.push_str(&format!(":{c} - [0:0]\n"));
            }
        }
        for c in &chains {
            if table == Table::Nat && *c == SERVICES {
                // Service lines first; the NodePort jump must be last.
                for p in input.ports {
                    for l in p.shared.get(&(table, *c)).into_iter().flatten() {
                        out.push_str(l);
                        out.push('\n');
                    }
                }
                for (_, _, l) in statics.iter().filter(|(t, ch, _)| *t == table && ch == c) {
                    out.push_str(l);
                    out.push('\n');
                }
                continue;
            }
            for (_, _, l) in statics.iter().filter(|(t, ch, _)| *t == table && ch == c) {
                out.push_str(l);
                out.push('\n');
            }
            for p in input.ports {
                for l in p.shared.get(&(table, *c)).into_iter().flatten() {
                    out.push_str(l);
                    out.push('\n');
                }
            }
        }
        if table == Table::Nat {
            for rules in input.write.values() {
                for l in rules {
                    out.push_str(l);
                    out.push('\n');
                }
            }
            for c in input.delete {
                out.push_str(&format!("-X {c}\n"));
            }
        }
        for l in input.jump_fixes.get(&table).into_iter().flatten() {
            out.push_str(l);
            out.push('\n');
        }
        out.push_str("COMMIT\n");
    }
    Ok(out)
}

/// From an `iptables-save -t TABLE` output: the jump lines to insert (missing) and delete
/// (duplicates) so each of [`jumps`] is present exactly once.
pub fn jump_fixes(table: Table, saved: &str) -> Vec<String> {
    jump_fixes_of(&jumps(), table, saved)
}

/// [`jump_fixes`] for the jumps a sync with `cfg` keeps ([`jumps_for`]).
pub fn jump_fixes_for(cfg: &ProxyModeConfig, table: Table, saved: &str) -> Vec<String> {
    jump_fixes_of(&jumps_for(cfg), table, saved)
}

fn jump_fixes_of(jumps: &[ModeJump], table: Table, saved: &str) -> Vec<String> {
    let mut fixes = Vec::new();
    for j in jumps.iter().filter(|j| j.table == table) {
        let want = j.save_line();
        let n = saved.lines().filter(|l| l.trim_end() == want).count();
        if n == 0 {
            fixes.push(format!("-I {} {}", j.from, j.spec()));
        }
        for _ in 1..n {
            fixes.push(format!("-D {} {}", j.from, j.spec()));
        }
    }
    fixes
}

/// Chains declared in an `iptables-save` output (`:NAME POLICY [..]` lines).
pub fn saved_chains(saved: &str) -> BTreeSet<String> {
    saved
        .lines()
        .filter_map(|l| l.strip_prefix(':'))
        .filter_map(|l| l.split_whitespace().next())
        .map(str::to_string)
        .collect()
}

/// Which chains of an `iptables-save -t TABLE` output a mode owns and which rules in other
/// chains must go with them.
pub struct Ownership<'a> {
    /// True for chains the mode owns (removed: flushed, then deleted).
    pub owns: &'a dyn Fn(&str) -> bool,
    /// True for chains the mode shares with the other mode (flushed only when they hold a
    /// rule that matches `owned_rule`, never deleted).
    pub shared: &'a dyn Fn(&str) -> bool,
    /// True for a rule (the part after `-A CHAIN `) that belongs to the mode even in a chain it
    /// does not own (e.g. matches one of its ipsets).
    pub owned_rule: &'a dyn Fn(&str) -> bool,
}

/// The restore payload that removes a mode's leftovers from one table, given its current
/// `iptables-save -t TABLE` text: rules in other chains that jump to an owned chain (or are owned
/// rules) are deleted one by one, owned chains are flushed and deleted. Returns `None` when
/// nothing is there, plus what it removes (chain names and the count of deleted rules).
pub fn leftover_cleanup(
    table: Table,
    saved: &str,
    own: &Ownership<'_>,
) -> Option<(String, Vec<String>, usize)> {
    let present = saved_chains(saved);
    let owned: Vec<&String> = present
        .iter()
        .filter(|c| (own.owns)(c) && !(own.shared)(c))
        .collect();
    let mut text = format!("*{table}\n");
    for c in &owned {
        text.push_str(&format!(":{c} - [0:0]\n"));
    }
    let mut deleted = 0;
    let mut flushed_shared = Vec::new();
    for l in saved.lines() {
        let Some(rest) = l.strip_prefix("-A ") else {
            continue;
        };
        let Some((chain, spec)) = rest.split_once(' ') else {
            continue;
        };
        if owned.iter().any(|c| c.as_str() == chain) {
            continue; // flushed with the chain
        }
        let target = spec
            .split_whitespace()
            .skip_while(|w| *w != "-j" && *w != "-g")
            .nth(1)
            .unwrap_or_default();
        let to_owned = owned.iter().any(|c| c.as_str() == target);
        if (own.shared)(chain) && (to_owned || (own.owned_rule)(spec)) {
            if !flushed_shared.iter().any(|c| c == chain) {
                flushed_shared.push(chain.to_string());
            }
            continue;
        }
        if to_owned || (own.owned_rule)(spec) {
            text.push_str(&format!("-D {chain} {spec}\n"));
            deleted += 1;
        }
    }
    for c in &flushed_shared {
        text.push_str(&format!("-F {c}\n"));
    }
    for c in &owned {
        text.push_str(&format!("-X {c}\n"));
    }
    text.push_str("COMMIT\n");
    if owned.is_empty() && deleted == 0 && flushed_shared.is_empty() {
        return None;
    }
    let mut removed: Vec<String> = owned.iter().map(|c| c.to_string()).collect();
    removed.extend(flushed_shared.iter().map(|c| format!("{c} (flushed)")));
    Some((text, removed, deleted))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chain_names_match_upstream_hashes() {
        // Chain names seen on every kubeadm cluster (kube-proxy iptables mode).
        assert_eq!(
            svc_chain("default/kubernetes:https", Protocol::Tcp),
            "KUBE-SVC-NPX46M4PTMTKRN6Y"
        );
        assert_eq!(
            svc_chain("kube-system/kube-dns:dns", Protocol::Udp),
            "KUBE-SVC-TCOU7JCQXEZGVUNU"
        );
        assert_eq!(
            svc_chain("kube-system/kube-dns:dns-tcp", Protocol::Tcp),
            "KUBE-SVC-ERIFXISQEP7F7OF4"
        );
        assert_eq!(
            svc_chain("kube-system/kube-dns:metrics", Protocol::Tcp),
            "KUBE-SVC-JD5MR3NA4I4DYORP"
        );
        let sep = sep_chain(
            "default/kubernetes:https",
            Protocol::Tcp,
            "192.168.0.10".parse().unwrap_or(IpAddr::from([0, 0, 0, 0])),
            6443,
        );
        assert!(sep.starts_with("KUBE-SEP-") && sep.len() == 25, "{sep}");
    }

    #[test]
    fn probabilities_are_upstreams_strings() {
        assert_eq!(probability(2), "0.5000000000");
        assert_eq!(probability(3), "0.3333333333");
        assert_eq!(probability(1000), "0.0010000000");
        assert_eq!(probability(1001), "0.0009990010");
    }

    #[test]
    fn leftover_cleanup_deletes_references_then_chains() {
        let saved =
            "*nat\n:PREROUTING ACCEPT [0:0]\n:KUBE-SERVICES - [0:0]\n:KUBE-NODE-PORT - [0:0]\n\
-A PREROUTING -m comment --comment \"kubernetes service portals\" -j KUBE-SERVICES\n\
-A PREROUTING -j KUBE-NODE-PORT\n\
-A KUBE-SERVICES -m set --match-set KUBE-CLUSTER-IP dst,dst -j ACCEPT\n\
-A KUBE-SERVICES -m addrtype --dst-type LOCAL -j KUBE-NODE-PORT\nCOMMIT\n";
        let owns = |c: &str| c == "KUBE-NODE-PORT" || c == "KUBE-SERVICES";
        let shared = |c: &str| c == "KUBE-SERVICES";
        let owned_rule = |s: &str| s.contains("--match-set KUBE-");
        let (text, removed, deleted) = leftover_cleanup(
            Table::Nat,
            saved,
            &Ownership {
                owns: &owns,
                shared: &shared,
                owned_rule: &owned_rule,
            },
        )
        .unwrap_or_default();
        assert_eq!(
            text,
            "*nat\n:KUBE-NODE-PORT - [0:0]\n-D PREROUTING -j KUBE-NODE-PORT\n-F KUBE-SERVICES\n-X KUBE-NODE-PORT\nCOMMIT\n"
        );
        assert_eq!(removed, vec!["KUBE-NODE-PORT", "KUBE-SERVICES (flushed)"]);
        assert_eq!(deleted, 1);
        let clean = "*nat\n:PREROUTING ACCEPT [0:0]\nCOMMIT\n";
        assert!(leftover_cleanup(
            Table::Nat,
            clean,
            &Ownership {
                owns: &owns,
                shared: &shared,
                owned_rule: &owned_rule
            }
        )
        .is_none());
    }
}
