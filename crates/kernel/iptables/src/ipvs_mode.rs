//! The IPVS-mode rule set, mirroring upstream kube-proxy's IPVS proxier (chains, order, comments
//! and set matches), rendered from a pure input.

use std::collections::BTreeSet;
use std::net::IpAddr;

use ipnet::IpNet;
use ipset::{Family, IpsetState, Protocol, SetKind};

use crate::rules::{quote, Jump, RuleSet, Table};
use crate::{Error, Result};

const SERVICES: &str = "KUBE-SERVICES";
const POSTROUTING: &str = "KUBE-POSTROUTING";
const NODE_PORT: &str = "KUBE-NODE-PORT";
const LOAD_BALANCER: &str = "KUBE-LOAD-BALANCER";
const MARK_MASQ: &str = "KUBE-MARK-MASQ";
const FORWARD: &str = "KUBE-FORWARD";
const PROXY_FIREWALL: &str = "KUBE-PROXY-FIREWALL";
const SOURCE_RANGES_FIREWALL: &str = "KUBE-SOURCE-RANGES-FIREWALL";
const IPVS_FILTER: &str = "KUBE-IPVS-FILTER";
const IPVS_OUT_FILTER: &str = "KUBE-IPVS-OUT-FILTER";
/// kube-ipvs's own: in-cluster traffic to externalTrafficPolicy=Local destinations.
const IN_CLUSTER: &str = "KUBE-IPVS-IN-CLUSTER";
/// kube-ipvs's own: the mark of each such destination's in-cluster virtual server.
const IN_CLUSTER_MARK: &str = "KUBE-IPVS-IN-CLUSTER-MARK";

/// The chains IPVS mode owns, per table, in upstream's order.
pub fn chains() -> Vec<(Table, &'static str)> {
    vec![
        (Table::Nat, SERVICES),
        (Table::Nat, POSTROUTING),
        (Table::Nat, NODE_PORT),
        (Table::Nat, LOAD_BALANCER),
        (Table::Nat, MARK_MASQ),
        (Table::Nat, IN_CLUSTER),
        (Table::Nat, IN_CLUSTER_MARK),
        (Table::Filter, FORWARD),
        (Table::Filter, NODE_PORT),
        (Table::Filter, PROXY_FIREWALL),
        (Table::Filter, SOURCE_RANGES_FIREWALL),
        (Table::Filter, IPVS_FILTER),
        (Table::Filter, IPVS_OUT_FILTER),
    ]
}

/// The jumps from built-in chains IPVS mode needs, with upstream's comments.
pub fn jumps() -> Vec<Jump> {
    vec![
        Jump::new(Table::Nat, "OUTPUT", SERVICES, "kubernetes service portals"),
        Jump::new(
            Table::Nat,
            "PREROUTING",
            SERVICES,
            "kubernetes service portals",
        ),
        Jump::new(
            Table::Nat,
            "POSTROUTING",
            POSTROUTING,
            "kubernetes postrouting rules",
        ),
        Jump::new(
            Table::Filter,
            "FORWARD",
            FORWARD,
            "kubernetes forwarding rules",
        ),
        Jump::new(
            Table::Filter,
            "INPUT",
            NODE_PORT,
            "kubernetes health check rules",
        ),
        Jump::new(
            Table::Filter,
            "INPUT",
            PROXY_FIREWALL,
            "kube-proxy firewall rules",
        ),
        Jump::new(
            Table::Filter,
            "FORWARD",
            PROXY_FIREWALL,
            "kube-proxy firewall rules",
        ),
        Jump::new(
            Table::Filter,
            "INPUT",
            IPVS_FILTER,
            "kubernetes ipvs access filter",
        ),
        Jump::new(
            Table::Filter,
            "OUTPUT",
            IPVS_OUT_FILTER,
            "kubernetes ipvs access filter",
        ),
    ]
}

/// How traffic from this node's pods is recognised (upstream's `--detect-local-mode`).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum LocalDetect {
    /// No detection: node-originated traffic with a VIP source is masqueraded instead.
    #[default]
    None,
    /// ClusterCIDR / NodeCIDR: traffic from these networks is local. Only CIDRs of the input's
    /// family are used; like upstream, one CIDR per family (the first) is matched.
    Cidrs(Vec<IpNet>),
    /// BridgeInterface: traffic entering through this bridge is local.
    BridgeInterface(String),
    /// InterfaceNamePrefix: traffic entering through interfaces with this prefix is local.
    InterfaceNamePrefix(String),
}

/// A load-balancer address that must not be reachable from the node itself through IPVS
/// (upstream's KUBE-IPVS-OUT-FILTER rule, k/k#119656; needs the xt_ipvs match).
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct NoNodeAccess {
    /// LB IP.
    pub ip: IpAddr,
    /// Protocol.
    pub proto: Protocol,
    /// Port.
    pub port: u16,
}

/// In-cluster traffic (from local pods or the node itself) to one externalTrafficPolicy=Local
/// destination gets `mark`, which selects the firewall-mark virtual server holding all of the
/// port's cluster-policy endpoints (Kubernetes' iptables/nftables behaviour, k/k#75262).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct InClusterMark {
    /// Destination address (LB IP, externalIP or node IP).
    pub ip: IpAddr,
    /// Protocol.
    pub proto: Protocol,
    /// Destination port (service port or nodePort).
    pub port: u16,
    /// The firewall mark.
    pub mark: u32,
}

/// Everything the IPVS-mode rules depend on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IpvsModeInput {
    /// Address family (selects `iptables` vs `ip6tables` and the set names).
    pub family: Family,
    /// Bit of the masquerade mark (default 14, i.e. 0x4000).
    pub masquerade_bit: u32,
    /// `--masquerade-all`.
    pub masquerade_all: bool,
    /// Local-traffic detection.
    pub local_detect: LocalDetect,
    /// Add `--random-fully` to MASQUERADE (iptables ≥ 1.6.2).
    pub random_fully: bool,
    /// Sets that currently have members; like upstream, rules matching an empty set are left out.
    pub non_empty_sets: BTreeSet<SetKind>,
    /// LB addresses the node itself must not reach.
    pub no_node_access: Vec<NoNodeAccess>,
    /// Marks of in-cluster traffic to externalTrafficPolicy=Local destinations.
    pub in_cluster: Vec<InClusterMark>,
    /// The mark bits [`InClusterMark::mark`] owns (set with `--set-xmark mark/mask`; other bits,
    /// the masquerade bit among them, are left alone). Its highest bit alone marks the
    /// node-originated traffic to masquerade.
    pub in_cluster_mask: u32,
}

impl IpvsModeInput {
    /// Defaults: bit 14, no masquerade-all, no local detection, `--random-fully`, all sets empty.
    pub fn new(family: Family) -> IpvsModeInput {
        IpvsModeInput {
            family,
            masquerade_bit: 14,
            masquerade_all: false,
            local_detect: LocalDetect::None,
            random_fully: true,
            non_empty_sets: BTreeSet::new(),
            no_node_access: Vec::new(),
            in_cluster: Vec::new(),
            in_cluster_mask: 0,
        }
    }

    /// Fill `non_empty_sets` from a desired ipset state of this family.
    pub fn set_non_empty_from(&mut self, state: &IpsetState) {
        self.non_empty_sets = SetKind::ALL
            .into_iter()
            .filter(|k| {
                state
                    .get(&k.name(self.family))
                    .is_some_and(|s| !s.entries.is_empty())
            })
            .collect();
    }

    fn mark(&self) -> Result<String> {
        if self.masquerade_bit > 31 {
            return Err(Error::InvalidInput(format!(
                "masquerade bit {} not in [0, 31]",
                self.masquerade_bit
            )));
        }
        Ok(format!("{:#x}", 1u64 << self.masquerade_bit))
    }

    /// `-s CIDR` / `-i IFACE` for "from a local pod", if detection is configured.
    fn if_local(&self) -> Result<Option<String>> {
        Ok(self
            .if_not_local()?
            .map(|s| s.trim_start_matches("! ").to_string()))
    }

    /// `! -s CIDR` / `! -i IFACE` for "not from a local pod", if detection is configured.
    fn if_not_local(&self) -> Result<Option<String>> {
        Ok(match &self.local_detect {
            LocalDetect::None => None,
            LocalDetect::Cidrs(cidrs) => {
                let mine: Vec<&IpNet> = cidrs
                    .iter()
                    .filter(|c| Family::of(&c.addr()) == self.family)
                    .collect();
                match mine.first() {
                    Some(c) => {
                        if mine.len() > 1 {
                            tracing::warn!(used = %c, ignored = mine.len() - 1,
                                "several cluster CIDRs of one family; only the first is matched");
                        }
                        Some(format!("! -s {}", c.trunc()))
                    }
                    None => None,
                }
            }
            LocalDetect::BridgeInterface(i) => Some(format!("! -i {}", iface(i)?)),
            LocalDetect::InterfaceNamePrefix(p) => Some(format!("! -i {}+", iface(p)?)),
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

/// (set, table, from chain, target, match directions, protocol) of a set-driven rule.
type SetRule = (
    SetKind,
    Table,
    &'static str,
    &'static str,
    &'static str,
    Option<&'static str>,
);

/// Render the IPVS-mode rules (nat and filter tables, plus the jumps into them).
pub fn render_ipvs_mode(input: &IpvsModeInput) -> Result<RuleSet> {
    let fam = input.family;
    let mark = input.mark()?;
    let set = |k: SetKind| k.name(fam);
    let has = |k: SetKind| input.non_empty_sets.contains(&k);
    let cmt = |k: SetKind| format!("-m comment --comment {}", quote(k.comment()));

    let mut rs = RuleSet::default();
    for (t, c) in chains() {
        rs.chain(t, c);
    }
    rs.jumps = jumps();
    let nat = |rs: &mut RuleSet, l: String| rs.rule(Table::Nat, l);
    let filter = |rs: &mut RuleSet, l: String| rs.rule(Table::Filter, l);

    // Connections to localhost leave KUBE-SERVICES early.
    let lo = match fam {
        Family::Inet => "127.0.0.0/8",
        Family::Inet6 => "::1/128",
    };
    nat(&mut rs, format!("-A {SERVICES} -s {lo} -j RETURN"));

    // In-cluster traffic to externalTrafficPolicy=Local destinations: marked for the
    // firewall-mark virtual server with all endpoints (only for destinations in the Local sets,
    // so other traffic never walks the per-destination rules).
    let in_cluster_bit = match input.in_cluster_mask {
        0 => 0,
        m => 1u32 << (31 - m.leading_zeros()),
    };
    if !input.in_cluster.is_empty() && in_cluster_bit != 0 {
        let c = quote("in-cluster traffic to externalTrafficPolicy=Local destinations");
        for (k, p, matcher) in [
            (SetKind::LoadBalancerLocal, "", "dst,dst"),
            (SetKind::ExternalIpLocal, "", "dst,dst"),
            (SetKind::NodePortLocalTcp, " -p tcp", "dst"),
            (SetKind::NodePortLocalUdp, " -p udp", "dst"),
            (SetKind::NodePortLocalSctp, " -p sctp", "dst,dst"),
        ] {
            if has(k) {
                nat(
                    &mut rs,
                    format!(
                        "-A {SERVICES}{p} -m comment --comment {c} -m set --match-set {} {matcher} -j {IN_CLUSTER}",
                        set(k)
                    ),
                );
            }
        }
        if let Some(local) = input.if_local()? {
            nat(
                &mut rs,
                format!(
                    "-A {IN_CLUSTER} {local} -m comment --comment {} -j {IN_CLUSTER_MARK}",
                    quote("pod traffic for external destinations")
                ),
            );
        }
        nat(
            &mut rs,
            format!(
                "-A {IN_CLUSTER} -m comment --comment {} -m addrtype --src-type LOCAL -j {IN_CLUSTER_MARK}",
                quote("node-originated traffic for external destinations")
            ),
        );
        let host = match fam {
            Family::Inet => 32,
            Family::Inet6 => 128,
        };
        for m in &input.in_cluster {
            if Family::of(&m.ip) != fam {
                continue;
            }
            let p = m.proto.as_str();
            nat(
                &mut rs,
                format!(
                    "-A {IN_CLUSTER_MARK} -d {}/{host} -p {p} -m {p} --dport {} -j MARK --set-xmark {:#x}/{:#x}",
                    m.ip, m.port, m.mark, input.in_cluster_mask
                ),
            );
        }
    }

    // Set-driven jumps (upstream's ipsetWithIptablesChain, same order).
    let set_rules: [SetRule; 12] = [
        (
            SetKind::LoopBack,
            Table::Nat,
            POSTROUTING,
            "MASQUERADE",
            "dst,dst,src",
            None,
        ),
        (
            SetKind::LoadBalancer,
            Table::Nat,
            SERVICES,
            LOAD_BALANCER,
            "dst,dst",
            None,
        ),
        (
            SetKind::LoadBalancerLocal,
            Table::Nat,
            LOAD_BALANCER,
            "RETURN",
            "dst,dst",
            None,
        ),
        (
            SetKind::NodePortLocalTcp,
            Table::Nat,
            NODE_PORT,
            "RETURN",
            "dst",
            Some("tcp"),
        ),
        (
            SetKind::NodePortTcp,
            Table::Nat,
            NODE_PORT,
            MARK_MASQ,
            "dst",
            Some("tcp"),
        ),
        (
            SetKind::NodePortLocalUdp,
            Table::Nat,
            NODE_PORT,
            "RETURN",
            "dst",
            Some("udp"),
        ),
        (
            SetKind::NodePortUdp,
            Table::Nat,
            NODE_PORT,
            MARK_MASQ,
            "dst",
            Some("udp"),
        ),
        (
            SetKind::NodePortLocalSctp,
            Table::Nat,
            NODE_PORT,
            "RETURN",
            "dst,dst",
            Some("sctp"),
        ),
        (
            SetKind::NodePortSctp,
            Table::Nat,
            NODE_PORT,
            MARK_MASQ,
            "dst,dst",
            Some("sctp"),
        ),
        (
            SetKind::LoadBalancerFw,
            Table::Filter,
            PROXY_FIREWALL,
            SOURCE_RANGES_FIREWALL,
            "dst,dst",
            None,
        ),
        (
            SetKind::LoadBalancerSourceCidr,
            Table::Filter,
            SOURCE_RANGES_FIREWALL,
            "RETURN",
            "dst,dst,src",
            None,
        ),
        (
            SetKind::LoadBalancerSourceIp,
            Table::Filter,
            SOURCE_RANGES_FIREWALL,
            "RETURN",
            "dst,dst,src",
            None,
        ),
    ];
    for (k, table, from, to, matcher, proto) in set_rules {
        if !has(k) {
            continue;
        }
        let p = proto.map(|p| format!(" -p {p}")).unwrap_or_default();
        rs.rule(
            table,
            format!(
                "-A {from}{p} {} -m set --match-set {} {matcher} -j {to}",
                cmt(k),
                set(k)
            ),
        );
    }

    // Cluster IPs: masquerade what needs it.
    if has(SetKind::ClusterIp) {
        // (`! -s`/`! -i` go first, where iptables-save prints them.)
        let rest = format!(
            "{} -m set --match-set {}",
            cmt(SetKind::ClusterIp),
            set(SetKind::ClusterIp)
        );
        let base = format!("-A {SERVICES} {rest}");
        let line = if input.masquerade_all {
            format!("{base} dst,dst -j {MARK_MASQ}")
        } else if let Some(not_local) = input.if_not_local()? {
            format!("-A {SERVICES} {not_local} {rest} dst,dst -j {MARK_MASQ}")
        } else {
            // No way to tell pod traffic apart: masquerade node-originated traffic whose source
            // is a VIP (the kernel picks a kube-ipvs0 address as source to reach a VIP).
            format!("{base} src,dst -j {MARK_MASQ}")
        };
        nat(&mut rs, line);
    }

    // External IPs.
    let external_accepts = |rs: &mut RuleSet, args: &str| {
        rs.rule(
            Table::Nat,
            format!("{args} -m physdev ! --physdev-is-in -m addrtype ! --src-type LOCAL -j ACCEPT"),
        );
        rs.rule(
            Table::Nat,
            format!("{args} -m addrtype --dst-type LOCAL -j ACCEPT"),
        );
    };
    if has(SetKind::ExternalIp) {
        let args = format!(
            "-A {SERVICES} {} -m set --match-set {} dst,dst",
            cmt(SetKind::ExternalIp),
            set(SetKind::ExternalIp)
        );
        nat(&mut rs, format!("{args} -j {MARK_MASQ}"));
        external_accepts(&mut rs, &args);
    }
    if has(SetKind::ExternalIpLocal) {
        let args = format!(
            "-A {SERVICES} {} -m set --match-set {} dst,dst",
            cmt(SetKind::ExternalIpLocal),
            set(SetKind::ExternalIpLocal)
        );
        external_accepts(&mut rs, &args);
    }

    nat(
        &mut rs,
        format!("-A {SERVICES} -m addrtype --dst-type LOCAL -j {NODE_PORT}"),
    );
    nat(&mut rs, format!("-A {LOAD_BALANCER} -j {MARK_MASQ}"));
    filter(&mut rs, format!("-A {SOURCE_RANGES_FIREWALL} -j DROP"));

    for n in &input.no_node_access {
        if Family::of(&n.ip) != fam {
            continue;
        }
        filter(
            &mut rs,
            format!(
                "-A {IPVS_OUT_FILTER} -s {ip} -m ipvs --vaddr {ip} --vproto {} --vport {} -j DROP",
                n.proto.as_str(),
                n.port,
                ip = n.ip
            ),
        );
    }

    // Accept everything for IPVS VIPs at the end of KUBE-SERVICES.
    for k in [SetKind::ClusterIp, SetKind::LoadBalancer] {
        if has(k) {
            nat(
                &mut rs,
                format!(
                    "-A {SERVICES} -m set --match-set {} dst,dst -j ACCEPT",
                    set(k)
                ),
            );
        }
    }

    filter(
        &mut rs,
        format!(
            "-A {FORWARD} -m comment --comment \"kubernetes forwarding rules\" -m mark --mark {mark}/{mark} -j ACCEPT"
        ),
    );
    filter(
        &mut rs,
        format!(
            "-A {FORWARD} -m comment --comment \"kubernetes forwarding conntrack rule\" -m conntrack --ctstate RELATED,ESTABLISHED -j ACCEPT"
        ),
    );
    filter(
        &mut rs,
        format!(
            "-A {NODE_PORT} {} -m set --match-set {} dst -j ACCEPT",
            cmt(SetKind::HealthCheckNodePort),
            set(SetKind::HealthCheckNodePort)
        ),
    );

    // Reject new connections to VIPs on ports that are not service ports (k/k#72236).
    for (k, m) in [
        (SetKind::LoadBalancer, "dst,dst"),
        (SetKind::ClusterIp, "dst,dst"),
        (SetKind::ExternalIp, "dst,dst"),
        (SetKind::ExternalIpLocal, "dst,dst"),
        (SetKind::HealthCheckNodePort, "dst"),
    ] {
        filter(
            &mut rs,
            format!(
                "-A {IPVS_FILTER} -m set --match-set {} {m} -j RETURN",
                set(k)
            ),
        );
    }
    filter(
        &mut rs,
        format!(
            "-A {IPVS_FILTER} -m conntrack --ctstate NEW -m set --match-set {} dst -j REJECT --reject-with {}",
            set(SetKind::IpvsIps),
            // Spelled out the way iptables-save prints the default, so a drift check can
            // compare the kernel's rules with ours line by line.
            match fam {
                Family::Inet => "icmp-port-unreachable",
                Family::Inet6 => "icmp6-port-unreachable",
            }
        ),
    );

    // Node-originated in-cluster traffic to a Local destination leaves with a local source
    // (the LB IP itself, or the node IP) and may go to another node: masquerade it, like
    // upstream's iptables proxier ("masquerade LOCAL traffic for ... external destinations").
    if !input.in_cluster.is_empty() && in_cluster_bit != 0 {
        let rf = if input.random_fully {
            " --random-fully"
        } else {
            ""
        };
        nat(
            &mut rs,
            format!(
                "-A {POSTROUTING} -m comment --comment {} -m mark --mark {in_cluster_bit:#x}/{in_cluster_bit:#x} -m addrtype --src-type LOCAL -j MASQUERADE{rf}",
                quote("node-originated traffic to externalTrafficPolicy=Local destinations")
            ),
        );
    }

    // Masquerade marked packets once, clearing the mark.
    nat(
        &mut rs,
        format!("-A {POSTROUTING} -m mark ! --mark {mark}/{mark} -j RETURN"),
    );
    nat(
        &mut rs,
        // `--xor-mark M`, in iptables-save's spelling.
        format!("-A {POSTROUTING} -j MARK --set-xmark {mark}/0x0"),
    );
    let rf = if input.random_fully {
        " --random-fully"
    } else {
        ""
    };
    nat(
        &mut rs,
        format!(
            "-A {POSTROUTING} -m comment --comment \"kubernetes service traffic requiring SNAT\" -j MASQUERADE{rf}"
        ),
    );
    // `--or-mark M`, in iptables-save's spelling.
    nat(
        &mut rs,
        format!("-A {MARK_MASQ} -j MARK --set-xmark {mark}/{mark}"),
    );
    Ok(rs)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lines(s: &str) -> Vec<&str> {
        s.lines().collect()
    }

    #[test]
    fn empty_sets_give_the_base_rules() {
        let rs = render_ipvs_mode(&IpvsModeInput::new(Family::Inet)).unwrap();
        let nat = rs.nat();
        assert_eq!(
            lines(&nat),
            vec![
                "*nat",
                ":KUBE-SERVICES - [0:0]",
                ":KUBE-POSTROUTING - [0:0]",
                ":KUBE-NODE-PORT - [0:0]",
                ":KUBE-LOAD-BALANCER - [0:0]",
                ":KUBE-MARK-MASQ - [0:0]",
                ":KUBE-IPVS-IN-CLUSTER - [0:0]",
                ":KUBE-IPVS-IN-CLUSTER-MARK - [0:0]",
                "-A KUBE-SERVICES -s 127.0.0.0/8 -j RETURN",
                "-A KUBE-SERVICES -m addrtype --dst-type LOCAL -j KUBE-NODE-PORT",
                "-A KUBE-LOAD-BALANCER -j KUBE-MARK-MASQ",
                "-A KUBE-POSTROUTING -m mark ! --mark 0x4000/0x4000 -j RETURN",
                "-A KUBE-POSTROUTING -j MARK --set-xmark 0x4000/0x0",
                "-A KUBE-POSTROUTING -m comment --comment \"kubernetes service traffic requiring SNAT\" -j MASQUERADE --random-fully",
                "-A KUBE-MARK-MASQ -j MARK --set-xmark 0x4000/0x4000",
                "COMMIT",
            ]
        );
        let filter = rs.filter();
        assert!(filter.starts_with("*filter\n:KUBE-FORWARD - [0:0]\n:KUBE-NODE-PORT - [0:0]\n"));
        for chain in [
            "KUBE-PROXY-FIREWALL",
            "KUBE-SOURCE-RANGES-FIREWALL",
            "KUBE-IPVS-FILTER",
            "KUBE-IPVS-OUT-FILTER",
        ] {
            assert!(filter.contains(&format!(":{chain} - [0:0]\n")), "{chain}");
        }
        assert!(filter.contains(
            "-A KUBE-IPVS-FILTER -m conntrack --ctstate NEW -m set --match-set KUBE-IPVS-IPS dst -j REJECT --reject-with icmp-port-unreachable\n"
        ));
        assert!(filter.contains("-A KUBE-FORWARD -m comment --comment \"kubernetes forwarding rules\" -m mark --mark 0x4000/0x4000 -j ACCEPT\n"));
        assert!(filter.contains("-A KUBE-NODE-PORT -m comment --comment \"Kubernetes health check node port\" -m set --match-set KUBE-HEALTH-CHECK-NODE-PORT dst -j ACCEPT\n"));
        assert!(filter.ends_with("COMMIT\n"));
        assert!(!nat.contains("KUBE-CLUSTER-IP"));
        assert_eq!(rs.jumps.len(), 9);
        assert!(rs.jumps.contains(&Jump::new(
            Table::Nat,
            "PREROUTING",
            "KUBE-SERVICES",
            "kubernetes service portals"
        )));
    }

    #[test]
    fn masquerade_decision_follows_upstream() {
        let mut input = IpvsModeInput::new(Family::Inet);
        input.non_empty_sets.insert(SetKind::ClusterIp);
        let m = "-m comment --comment \"Kubernetes service cluster ip + port for masquerade purpose\" -m set --match-set KUBE-CLUSTER-IP";
        let c = format!("-A KUBE-SERVICES {m}");
        let nat = render_ipvs_mode(&input).unwrap().nat();
        assert!(
            nat.contains(&format!("{c} src,dst -j KUBE-MARK-MASQ\n")),
            "{nat}"
        );
        assert!(
            nat.contains("-A KUBE-SERVICES -m set --match-set KUBE-CLUSTER-IP dst,dst -j ACCEPT\n")
        );

        input.local_detect = LocalDetect::Cidrs(vec![
            "fd00::/48".parse().unwrap(),
            "10.244.7.0/16".parse().unwrap(),
        ]);
        let nat = render_ipvs_mode(&input).unwrap().nat();
        assert!(
            nat.contains(&format!(
                "-A KUBE-SERVICES ! -s 10.244.0.0/16 {m} dst,dst -j KUBE-MARK-MASQ\n"
            )),
            "{nat}"
        );

        input.local_detect = LocalDetect::InterfaceNamePrefix("veth".into());
        let nat = render_ipvs_mode(&input).unwrap().nat();
        assert!(
            nat.contains(&format!(
                "-A KUBE-SERVICES ! -i veth+ {m} dst,dst -j KUBE-MARK-MASQ\n"
            )),
            "{nat}"
        );

        input.masquerade_all = true;
        let nat = render_ipvs_mode(&input).unwrap().nat();
        assert!(
            nat.contains(&format!("{c} dst,dst -j KUBE-MARK-MASQ\n")),
            "{nat}"
        );
    }

    /// In-cluster traffic to externalTrafficPolicy=Local destinations (k/k#75262): the jumps
    /// only for destinations in the Local sets, pod traffic (detect-local) and node traffic
    /// marked per destination, node traffic masqueraded. Upstream's iptables proxier does the
    /// same routing in `syncProxyRules` ("pod traffic for ... external destinations", "masquerade
    /// LOCAL traffic", "route LOCAL traffic").
    #[test]
    fn in_cluster_traffic_to_local_destinations_is_marked() {
        let mut input = IpvsModeInput::new(Family::Inet);
        input.non_empty_sets = [SetKind::LoadBalancerLocal, SetKind::NodePortLocalTcp].into();
        let none = render_ipvs_mode(&input).unwrap().nat();
        assert!(!none.contains("-j KUBE-IPVS-IN-CLUSTER"), "{none}");
        input.in_cluster_mask = 0x0400_3fff;
        input.in_cluster = vec![
            InClusterMark {
                ip: "203.0.113.7".parse().unwrap(),
                proto: Protocol::Tcp,
                port: 80,
                mark: 0x0400_0123,
            },
            InClusterMark {
                ip: "192.168.0.10".parse().unwrap(),
                proto: Protocol::Udp,
                port: 30080,
                mark: 0x0400_0124,
            },
            InClusterMark {
                ip: "fd00::7".parse().unwrap(),
                proto: Protocol::Tcp,
                port: 80,
                mark: 0x0400_0125,
            },
        ];
        input.local_detect = LocalDetect::Cidrs(vec!["10.244.0.0/16".parse().unwrap()]);
        let nat = render_ipvs_mode(&input).unwrap().nat();
        let c = "-m comment --comment \"in-cluster traffic to externalTrafficPolicy=Local destinations\"";
        for want in [
            format!("-A KUBE-SERVICES {c} -m set --match-set KUBE-LOAD-BALANCER-LOCAL dst,dst -j KUBE-IPVS-IN-CLUSTER"),
            format!("-A KUBE-SERVICES -p tcp {c} -m set --match-set KUBE-NODE-PORT-LOCAL-TCP dst -j KUBE-IPVS-IN-CLUSTER"),
            "-A KUBE-IPVS-IN-CLUSTER -s 10.244.0.0/16 -m comment --comment \"pod traffic for external destinations\" -j KUBE-IPVS-IN-CLUSTER-MARK".to_string(),
            "-A KUBE-IPVS-IN-CLUSTER -m comment --comment \"node-originated traffic for external destinations\" -m addrtype --src-type LOCAL -j KUBE-IPVS-IN-CLUSTER-MARK".to_string(),
            "-A KUBE-IPVS-IN-CLUSTER-MARK -d 203.0.113.7/32 -p tcp -m tcp --dport 80 -j MARK --set-xmark 0x4000123/0x4003fff".to_string(),
            "-A KUBE-IPVS-IN-CLUSTER-MARK -d 192.168.0.10/32 -p udp -m udp --dport 30080 -j MARK --set-xmark 0x4000124/0x4003fff".to_string(),
            "-A KUBE-POSTROUTING -m comment --comment \"node-originated traffic to externalTrafficPolicy=Local destinations\" -m mark --mark 0x4000000/0x4000000 -m addrtype --src-type LOCAL -j MASQUERADE --random-fully".to_string(),
        ] {
            assert!(nat.lines().any(|l| l == want), "missing {want}\n{nat}");
        }
        assert!(
            !nat.contains("fd00::7"),
            "other family's destinations are left out"
        );
        assert!(
            !nat.contains("KUBE-EXTERNAL-IP-LOCAL"),
            "empty sets get no jump"
        );
        // The jumps come right after the localhost RETURN, before anything can ACCEPT the
        // packet; the node masquerade comes before the 0x4000 RETURN.
        let pos = |needle: &str| nat.find(needle).unwrap();
        assert!(pos("-j KUBE-IPVS-IN-CLUSTER\n") < pos("--dst-type LOCAL -j KUBE-NODE-PORT\n"));
        assert!(
            pos("-m addrtype --src-type LOCAL -j MASQUERADE")
                < pos("! --mark 0x4000/0x4000 -j RETURN")
        );
        // No detection: only node-originated traffic is rerouted.
        input.local_detect = LocalDetect::None;
        let nat = render_ipvs_mode(&input).unwrap().nat();
        assert!(
            !nat.contains("pod traffic for external destinations"),
            "{nat}"
        );
        assert!(nat.contains("node-originated traffic for external destinations"));
    }

    #[test]
    fn mark_bit_and_random_fully() {
        let mut input = IpvsModeInput::new(Family::Inet);
        input.masquerade_bit = 0;
        input.random_fully = false;
        let nat = render_ipvs_mode(&input).unwrap().nat();
        assert!(nat.contains("-A KUBE-MARK-MASQ -j MARK --set-xmark 0x1/0x1\n"));
        assert!(nat.contains("-j MASQUERADE\n"));
        assert!(!nat.contains("random-fully"));
        input.masquerade_bit = 31;
        assert!(render_ipvs_mode(&input)
            .unwrap()
            .nat()
            .contains("--set-xmark 0x80000000/0x80000000\n"));
        input.masquerade_bit = 32;
        assert!(render_ipvs_mode(&input).is_err());
        input.masquerade_bit = 14;
        input.local_detect = LocalDetect::BridgeInterface("bad name!".into());
        input.non_empty_sets.insert(SetKind::ClusterIp);
        assert!(render_ipvs_mode(&input).is_err());
    }

    #[test]
    fn set_rules_appear_only_for_non_empty_sets_in_upstream_order() {
        let mut input = IpvsModeInput::new(Family::Inet6);
        input.non_empty_sets = SetKind::ALL.into_iter().collect();
        input.no_node_access.push(NoNodeAccess {
            ip: "fd00::5".parse().unwrap(),
            proto: Protocol::Tcp,
            port: 443,
        });
        input.no_node_access.push(NoNodeAccess {
            ip: "192.0.2.5".parse().unwrap(),
            proto: Protocol::Tcp,
            port: 443,
        });
        let rs = render_ipvs_mode(&input).unwrap();
        let nat = rs.nat();
        let filter = rs.filter();
        assert!(nat.contains("-A KUBE-SERVICES -s ::1/128 -j RETURN\n"));
        let pos = |hay: &str, needle: &str| {
            hay.find(needle)
                .unwrap_or_else(|| panic!("{needle} missing in\n{hay}"))
        };
        // ETP=Local node ports return before the masquerade rule
        assert!(
            pos(&nat, "-A KUBE-NODE-PORT -p tcp -m comment --comment \"Kubernetes nodeport TCP port with externalTrafficPolicy=local\" -m set --match-set KUBE-6-NODE-PORT-LOCAL-TCP dst -j RETURN")
                < pos(&nat, "-A KUBE-NODE-PORT -p tcp -m comment --comment \"Kubernetes nodeport TCP port for masquerade purpose\" -m set --match-set KUBE-6-NODE-PORT-TCP dst -j KUBE-MARK-MASQ")
        );
        pos(&nat, "-A KUBE-NODE-PORT -p sctp -m comment --comment \"Kubernetes nodeport SCTP port for masquerade purpose with type 'hash ip:port'\" -m set --match-set KUBE-6-NODE-PORT-SCTP-HASH dst,dst -j KUBE-MARK-MASQ");
        // hairpin masquerade comes before the RETURN of unmarked packets
        assert!(
            pos(&nat, "-A KUBE-POSTROUTING -m comment --comment \"Kubernetes endpoints dst ip:port, source ip for solving hairpin purpose\" -m set --match-set KUBE-6-LOOP-BACK dst,dst,src -j MASQUERADE")
                < pos(&nat, "-A KUBE-POSTROUTING -m mark ! --mark")
        );
        pos(&nat, "-m set --match-set KUBE-6-EXTERNAL-IP dst,dst -m physdev ! --physdev-is-in -m addrtype ! --src-type LOCAL -j ACCEPT");
        pos(&filter, "-A KUBE-PROXY-FIREWALL -m comment --comment \"Kubernetes service load balancer ip + port for load balancer with sourceRange\" -m set --match-set KUBE-6-LOAD-BALANCER-FW dst,dst -j KUBE-SOURCE-RANGES-FIREWALL");
        assert!(
            pos(
                &filter,
                "--match-set KUBE-6-LOAD-BALANCER-SOURCE-CID dst,dst,src -j RETURN"
            ) < pos(&filter, "-A KUBE-SOURCE-RANGES-FIREWALL -j DROP")
        );
        pos(&filter, "-A KUBE-IPVS-OUT-FILTER -s fd00::5 -m ipvs --vaddr fd00::5 --vproto tcp --vport 443 -j DROP");
        assert!(!filter.contains("192.0.2.5"), "other family is left out");
    }

    #[test]
    fn non_empty_sets_come_from_ipset_state() {
        let mut st = IpsetState::kube(Family::Inet);
        st.add(
            SetKind::NodePortUdp,
            Family::Inet,
            ipset::Entry::Port(30053),
            "x",
        )
        .unwrap();
        let mut input = IpvsModeInput::new(Family::Inet);
        input.set_non_empty_from(&st);
        assert_eq!(
            input.non_empty_sets,
            [SetKind::NodePortUdp].into_iter().collect()
        );
    }
}
