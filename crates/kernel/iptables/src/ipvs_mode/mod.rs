//! The IPVS-mode rule set, mirroring upstream kube-proxy's IPVS proxier (chains, order, comments
//! and set matches), rendered from a pure input.

use std::collections::BTreeSet;
use std::net::IpAddr;

use ipnet::IpNet;
use ipset::{Family, IpsetState, Protocol, SetKind};

use crate::rules::{iface, quote, Jump, RuleSet, Table};
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

    /// Set `k`'s name in this input's family.
    fn set(&self, k: SetKind) -> String {
        k.name(self.family)
    }

    /// Whether set `k` has members: its rules are written only then.
    fn has(&self, k: SetKind) -> bool {
        self.non_empty_sets.contains(&k)
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

mod render;

pub use render::render_ipvs_mode;

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
