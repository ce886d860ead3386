//! Rendering the IPVS mode's rules from an [`IpvsModeInput`], step by step in upstream's order
//! (`syncProxyRules` / `writeIptablesRules` of kube-proxy's IPVS proxier): the localhost return,
//! the in-cluster marks of externalTrafficPolicy=Local destinations, the set-driven jumps, the
//! ClusterIP and external IP masquerade rules, the fixed and filter rules, then POSTROUTING.
//! Each step appends to the one [`RuleSet`] in the order the whole function did.

use super::*;

/// (set, table, from chain, target, match directions, protocol) of a set-driven rule.
pub(super) type SetRule = (
    SetKind,
    Table,
    &'static str,
    &'static str,
    &'static str,
    Option<&'static str>,
);

/// Render the IPVS-mode rules (nat and filter tables, plus the jumps into them).
/// Render the IPVS-mode rules (nat and filter tables, plus the jumps into them).
pub fn render_ipvs_mode(input: &IpvsModeInput) -> Result<RuleSet> {
    let fam = input.family;
    let mark = input.mark()?;
    let mut rs = RuleSet::default();
    for (t, c) in chains() {
        rs.chain(t, c);
    }
    rs.jumps = jumps();

    // Connections to localhost leave KUBE-SERVICES early.
    let lo = match fam {
        Family::Inet => "127.0.0.0/8",
        Family::Inet6 => "::1/128",
    };
    nat(&mut rs, format!("-A {SERVICES} -s {lo} -j RETURN"));
    let in_cluster_bit = match input.in_cluster_mask {
        0 => 0,
        m => 1u32 << (31 - m.leading_zeros()),
    };
    in_cluster_marks(&mut rs, input, in_cluster_bit)?;
    set_jumps(&mut rs, input);
    cluster_ip_masquerade(&mut rs, input)?;
    external_ips(&mut rs, input);
    fixed_and_filter(&mut rs, input, &mark);
    postrouting(&mut rs, input, &mark, in_cluster_bit);
    Ok(rs)
}

fn nat(rs: &mut RuleSet, l: String) {
    rs.rule(Table::Nat, l)
}

fn filter(rs: &mut RuleSet, l: String) {
    rs.rule(Table::Filter, l)
}

/// `-m comment` naming set `k`'s purpose.
fn cmt(k: SetKind) -> String {
    format!("-m comment --comment {}", quote(k.comment()))
}

/// In-cluster traffic to externalTrafficPolicy=Local destinations: marked for the firewall-mark
/// virtual server with all endpoints (only for destinations in the Local sets, so other traffic
/// never walks the per-destination rules).
fn in_cluster_marks(rs: &mut RuleSet, input: &IpvsModeInput, in_cluster_bit: u32) -> Result<()> {
    let fam = input.family;
    if !input.in_cluster.is_empty() && in_cluster_bit != 0 {
        let c = quote("in-cluster traffic to externalTrafficPolicy=Local destinations");
        for (k, p, matcher) in [
            (SetKind::LoadBalancerLocal, "", "dst,dst"),
            (SetKind::ExternalIpLocal, "", "dst,dst"),
            (SetKind::NodePortLocalTcp, " -p tcp", "dst"),
            (SetKind::NodePortLocalUdp, " -p udp", "dst"),
            (SetKind::NodePortLocalSctp, " -p sctp", "dst,dst"),
        ] {
            if input.has(k) {
                nat(
                    rs,
                    format!(
                        "-A {SERVICES}{p} -m comment --comment {c} -m set --match-set {} {matcher} -j {IN_CLUSTER}",
                        input.set(k)
                    ),
                );
            }
        }
        if let Some(local) = input.if_local()? {
            nat(
                rs,
                format!(
                    "-A {IN_CLUSTER} {local} -m comment --comment {} -j {IN_CLUSTER_MARK}",
                    quote("pod traffic for external destinations")
                ),
            );
        }
        nat(
            rs,
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
                rs,
                format!(
                    "-A {IN_CLUSTER_MARK} -d {}/{host} -p {p} -m {p} --dport {} -j MARK --set-xmark {:#x}/{:#x}",
                    m.ip, m.port, m.mark, input.in_cluster_mask
                ),
            );
        }
    }
    Ok(())
}

/// Set-driven jumps (upstream's ipsetWithIptablesChain, same order).
fn set_jumps(rs: &mut RuleSet, input: &IpvsModeInput) {
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
        if !input.has(k) {
            continue;
        }
        let p = proto.map(|p| format!(" -p {p}")).unwrap_or_default();
        rs.rule(
            table,
            format!(
                "-A {from}{p} {} -m set --match-set {} {matcher} -j {to}",
                cmt(k),
                input.set(k)
            ),
        );
    }
}

/// Cluster IPs: masquerade what needs it.
fn cluster_ip_masquerade(rs: &mut RuleSet, input: &IpvsModeInput) -> Result<()> {
    if input.has(SetKind::ClusterIp) {
        // (`! -s`/`! -i` go first, where iptables-save prints them.)
        let rest = format!(
            "{} -m set --match-set {}",
            cmt(SetKind::ClusterIp),
            input.set(SetKind::ClusterIp)
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
        nat(rs, line);
    }
    Ok(())
}

/// External IPs: masquerade, and accept what is not forwarded from a bridge or is local.
fn external_ips(rs: &mut RuleSet, input: &IpvsModeInput) {
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
    if input.has(SetKind::ExternalIp) {
        let args = format!(
            "-A {SERVICES} {} -m set --match-set {} dst,dst",
            cmt(SetKind::ExternalIp),
            input.set(SetKind::ExternalIp)
        );
        nat(rs, format!("{args} -j {MARK_MASQ}"));
        external_accepts(rs, &args);
    }
    if input.has(SetKind::ExternalIpLocal) {
        let args = format!(
            "-A {SERVICES} {} -m set --match-set {} dst,dst",
            cmt(SetKind::ExternalIpLocal),
            input.set(SetKind::ExternalIpLocal)
        );
        external_accepts(rs, &args);
    }
}

/// The fixed rules (NodePorts, load balancers, source ranges), the IPVS output filter of
/// services without node access, the VIP accepts, KUBE-FORWARD, the health-check accept and the
/// reject of non-service ports on VIPs.
fn fixed_and_filter(rs: &mut RuleSet, input: &IpvsModeInput, mark: &str) {
    let fam = input.family;
    nat(
        rs,
        format!("-A {SERVICES} -m addrtype --dst-type LOCAL -j {NODE_PORT}"),
    );
    nat(rs, format!("-A {LOAD_BALANCER} -j {MARK_MASQ}"));
    filter(rs, format!("-A {SOURCE_RANGES_FIREWALL} -j DROP"));

    for n in &input.no_node_access {
        if Family::of(&n.ip) != fam {
            continue;
        }
        filter(
            rs,
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
        if input.has(k) {
            nat(
                rs,
                format!(
                    "-A {SERVICES} -m set --match-set {} dst,dst -j ACCEPT",
                    input.set(k)
                ),
            );
        }
    }

    filter(
        rs,
        format!(
            "-A {FORWARD} -m comment --comment \"kubernetes forwarding rules\" -m mark --mark {mark}/{mark} -j ACCEPT"
        ),
    );
    filter(
        rs,
        format!(
            "-A {FORWARD} -m comment --comment \"kubernetes forwarding conntrack rule\" -m conntrack --ctstate RELATED,ESTABLISHED -j ACCEPT"
        ),
    );
    filter(
        rs,
        format!(
            "-A {NODE_PORT} {} -m set --match-set {} dst -j ACCEPT",
            cmt(SetKind::HealthCheckNodePort),
            input.set(SetKind::HealthCheckNodePort)
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
            rs,
            format!(
                "-A {IPVS_FILTER} -m set --match-set {} {m} -j RETURN",
                input.set(k)
            ),
        );
    }
    filter(
        rs,
        format!(
            "-A {IPVS_FILTER} -m conntrack --ctstate NEW -m set --match-set {} dst -j REJECT --reject-with {}",
            input.set(SetKind::IpvsIps),
            // Spelled out the way iptables-save prints the default, so a drift check can
            // compare the kernel's rules with ours line by line.
            match fam {
                Family::Inet => "icmp-port-unreachable",
                Family::Inet6 => "icmp6-port-unreachable",
            }
        ),
    );
}

/// POSTROUTING: node-originated in-cluster traffic to Local destinations, then the masquerade
/// of marked packets (once, clearing the mark), and KUBE-MARK-MASQ itself.
fn postrouting(rs: &mut RuleSet, input: &IpvsModeInput, mark: &str, in_cluster_bit: u32) {
    let rf = if input.random_fully {
        " --random-fully"
    } else {
        ""
    };
    // Node-originated in-cluster traffic to a Local destination leaves with a local source
    // (the LB IP itself, or the node IP) and may go to another node: masquerade it, like
    // upstream's iptables proxier ("masquerade LOCAL traffic for ... external destinations").
    if !input.in_cluster.is_empty() && in_cluster_bit != 0 {
        nat(
            rs,
            format!(
                "-A {POSTROUTING} -m comment --comment {} -m mark --mark {in_cluster_bit:#x}/{in_cluster_bit:#x} -m addrtype --src-type LOCAL -j MASQUERADE{rf}",
                quote("node-originated traffic to externalTrafficPolicy=Local destinations")
            ),
        );
    }

    // Masquerade marked packets once, clearing the mark.
    nat(
        rs,
        format!("-A {POSTROUTING} -m mark ! --mark {mark}/{mark} -j RETURN"),
    );
    nat(
        rs,
        // `--xor-mark M`, in iptables-save's spelling.
        format!("-A {POSTROUTING} -j MARK --set-xmark {mark}/0x0"),
    );
    nat(
        rs,
        format!(
            "-A {POSTROUTING} -m comment --comment \"kubernetes service traffic requiring SNAT\" -j MASQUERADE{rf}"
        ),
    );
    // `--or-mark M`, in iptables-save's spelling.
    nat(
        rs,
        format!("-A {MARK_MASQ} -j MARK --set-xmark {mark}/{mark}"),
    );
}
