//! VIP claims across Services: who may serve an external (IP, port, protocol).
//!
//! Any user who may create a Service may list any address in `spec.externalIPs` (and a
//! LoadBalancer controller may write any ingress IP), so two Services can claim the same
//! external IP, port and protocol — by mistake, or to intercept another Service's traffic
//! (CVE-2020-8554). kube-ipvs serves each such VIP for exactly one Service, chosen by a rule
//! that does not depend on the order in which objects arrive:
//!
//! 1. a **ClusterIP** claim always wins (ClusterIPs are allocated by the API server; an
//!    externalIP or load-balancer IP equal to another Service's ClusterIP and port never takes
//!    that ClusterIP's traffic);
//! 2. otherwise the **oldest** Service wins (`metadata.creationTimestamp`; a Service without
//!    one counts as newest);
//! 3. ties go to the smallest `namespace/name`.
//!
//! The losing Service keeps everything else (its ClusterIP, NodePorts, other external IPs);
//! only the lost (IP, port, protocol) claim is left out of its desired state: no virtual
//! server, no ipset entry, no kube-ipvs0 address from it. The loss is reported as a rejection
//! of the loser (key `vip ns/name`, reason starting with [`CONFLICT_PREFIX`]), which becomes a
//! `VIPConflict` Event on it, and counted in the `kube_ipvs_vip_conflicts` gauge. When the
//! winner goes away or drops the claim, the next claimant is re-derived and takes over.
//! ClusterIP-vs-ClusterIP conflicts are the API server's job (it never allocates one twice).
//!
//! External claims on this node's own addresses are settled first, by [`node`]: a NodePort, a
//! health-check node port or a protected node port keeps its address and port from every
//! external claimant (reported as a node-address conflict, not as a VIP conflict).

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::fmt;
use std::net::IpAddr;

use ipvs_netlink::Protocol;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;

use model::objects::Svc;
use model::sorted::SortedVec;
use model::{service_ports, Invalid, NodeInfo, ProxyConfig, ServiceName};

mod node;

pub use node::*;

/// Every VIP-conflict reason starts with this (the engine maps it to a `VIPConflict` Event).
pub const CONFLICT_PREFIX: &str = "VIP conflict:";

/// Most lost VIPs named in one reason (the rest are counted).
const REASON_MAX_VIPS: usize = 8;

/// An (IP, port, protocol) a Service is reachable on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Vip {
    /// The address.
    pub ip: IpAddr,
    /// The port.
    pub port: u16,
    /// The protocol.
    pub protocol: Protocol,
}

impl fmt::Display for Vip {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let p = self.protocol.api_name();
        match self.ip {
            IpAddr::V4(ip) => write!(f, "{ip}:{}/{p}", self.port),
            IpAddr::V6(ip) => write!(f, "[{ip}]:{}/{p}", self.port),
        }
    }
}

/// How strong one claim is: smaller wins (ClusterIP first, then oldest, then name).
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct Rank {
    /// False for a ClusterIP claim (sorts first).
    external: bool,
    /// No creation timestamp sorts after any timestamp.
    no_timestamp: bool,
    created: Option<Time>,
    /// The claimant.
    pub name: ServiceName,
}

/// One Service's claims: its VIPs with their ranks, and the node ports it has.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Claims {
    /// Every (VIP, rank) of its ClusterIPs, externalIPs and load-balancer IPs, sorted.
    pub vips: Vec<(Vip, Rank)>,
    /// Its NodePorts and health-check node ports, sorted.
    pub node_ports: Vec<NodePortKey>,
}

/// One Service's claims in `cfg`'s family: every (VIP, rank) of its ClusterIPs, externalIPs and
/// load-balancer IPs, and its node ports. `Err` when the Service is invalid (its last claims
/// stay).
pub fn claims_of(svc: &Svc, cfg: &ProxyConfig) -> Result<Claims, Invalid> {
    let name = svc.name.clone();
    let created = svc.created.clone();
    let rank = |external: bool| Rank {
        external,
        no_timestamp: created.is_none(),
        created: created.clone(),
        name: name.clone(),
    };
    let mut out = Vec::new();
    let ports = service_ports(svc, cfg)?;
    // A Service over its virtual-server budget even without node addresses is rejected when
    // it is derived: it claims nothing either (one claim per VIP and port is ~200 bytes
    // while held; the soak's 550-port x 121-address Service added 17 MiB of RSS before).
    model::BudgetTally::start(cfg.budget, &ports, 0)?;
    for sp in &ports {
        let vip = |ip: IpAddr| Vip {
            ip,
            port: sp.port,
            protocol: sp.name.protocol,
        };
        out.push((vip(sp.cluster_ip), rank(false)));
        for ip in sp.external_ips.iter().chain(sp.load_balancer_ips.iter()) {
            out.push((vip(*ip), rank(true)));
        }
    }
    out.sort();
    out.dedup();
    out.shrink_to_fit();
    Ok(Claims {
        vips: out,
        node_ports: node_ports_of(&ports),
    })
}

/// One Service's claims as [`VipClaims`] keeps them: the VIPs with whether each is external,
/// and the creation time once (every rank of one Service shares it and the name, so a claim
/// is 22 bytes here instead of an 88-byte (VIP, rank) pair; issue #18).
#[derive(Debug, Clone)]
struct Held {
    created: Option<Time>,
    vips: Box<[(Vip, bool)]>,
    /// Its node ports (see [`node`]).
    node_ports: Box<[NodePortKey]>,
}

impl Held {
    fn of(claims: &[(Vip, Rank)], node_ports: &[NodePortKey]) -> Held {
        Held {
            created: claims.first().and_then(|(_, r)| r.created.clone()),
            vips: claims.iter().map(|(v, r)| (*v, r.external)).collect(),
            node_ports: node_ports.into(),
        }
    }

    /// The claims again, with `name`'s ranks.
    fn claims(&self, name: &ServiceName) -> Vec<(Vip, Rank)> {
        let rank = |external: bool| Rank {
            external,
            no_timestamp: self.created.is_none(),
            created: self.created.clone(),
            name: name.clone(),
        };
        self.vips.iter().map(|(v, e)| (*v, rank(*e))).collect()
    }
}

/// The claims of every Service of one family, indexed by VIP, with the node ports and this
/// node's addresses that settle external claims on node addresses (see [`node`]).
#[derive(Debug, Default, Clone)]
pub struct VipClaims {
    /// Strongest first (nearly always one claimant).
    by_vip: HashMap<Vip, SortedVec<Rank>>,
    by_service: HashMap<ServiceName, Held>,
    /// The Services having each node port (one, unless the API server's uniqueness is broken).
    node_ports: HashMap<NodePortKey, SortedVec<ServiceName>>,
    /// This node's addresses and the policy for claims on them.
    node: NodeView,
}

impl VipClaims {
    /// Replaces `name`'s claims (empty: the Service is gone). Returns the other Services whose
    /// lost VIPs may have changed (re-derive them). `claims` are [`claims_of`] the Service: all
    /// ranked under `name` with its one creation time (what is kept of them relies on it).
    pub fn set(&mut self, name: &ServiceName, claims: Claims) -> BTreeSet<ServiceName> {
        let Claims {
            vips: claims,
            node_ports,
        } = claims;
        debug_assert!(
            claims.iter().all(|(_, r)| r.name == *name
                && claims.first().is_some_and(|(_, f)| f.created == r.created)),
            "one Service's claims share its name and creation time"
        );
        let held = self.by_service.remove(name);
        let old = held.as_ref().map(|h| h.claims(name)).unwrap_or_default();
        let old_ports = held.map(|h| h.node_ports).unwrap_or_default();
        let keep = !claims.is_empty() || !node_ports.is_empty();
        if old == claims && *old_ports == *node_ports {
            if keep {
                self.by_service
                    .insert(name.clone(), Held::of(&claims, &node_ports));
            }
            return BTreeSet::new();
        }
        let mut affected = self.set_node_ports(name, &old_ports, &node_ports);
        let touched: BTreeSet<Vip> = old.iter().chain(claims.iter()).map(|(v, _)| *v).collect();
        let winners_before: BTreeMap<Vip, Option<ServiceName>> =
            touched.iter().map(|v| (*v, self.winner(v))).collect();
        for (vip, rank) in &old {
            if let Some(set) = self.by_vip.get_mut(vip) {
                set.remove(rank);
                if set.is_empty() {
                    self.by_vip.remove(vip);
                }
            }
        }
        for (vip, rank) in &claims {
            self.by_vip.entry(*vip).or_default().insert(rank.clone());
        }
        if keep {
            self.by_service
                .insert(name.clone(), Held::of(&claims, &node_ports));
        }
        for (vip, before) in winners_before {
            if self.winner(&vip) == before {
                continue;
            }
            if let Some(set) = self.by_vip.get(&vip) {
                affected.extend(set.iter().map(|r| r.name.clone()).filter(|n| n != name));
            }
            affected.extend(before.filter(|n| n != name));
        }
        affected
    }

    /// Takes `node`'s addresses, then updates the claims of `names` from `store` (a deleted
    /// Service drops its claims, an invalid one keeps its last ones) and returns `names` with
    /// every other Service whose lost VIPs changed as a result: derive all of them.
    pub fn update(
        &mut self,
        store: &model::store::Store,
        cfg: &ProxyConfig,
        node: &NodeInfo,
        names: impl IntoIterator<Item = ServiceName>,
    ) -> BTreeSet<ServiceName> {
        let names: BTreeSet<ServiceName> = names.into_iter().collect();
        let mut affected = self.set_node(node, cfg);
        for name in &names {
            let claims = match store.service(name) {
                None => Claims::default(),
                Some(svc) => match claims_of(svc, cfg) {
                    Ok(c) => c,
                    Err(_) => continue,
                },
            };
            affected.extend(self.set(name, claims));
        }
        affected.extend(names);
        affected
    }

    /// The Service that serves `vip`, if anyone claims it.
    pub fn winner(&self, vip: &Vip) -> Option<ServiceName> {
        self.by_vip.get(vip)?.first().map(|r| r.name.clone())
    }

    /// The external VIPs `name` claims and does not serve, each with the Service that does
    /// (claims on node addresses the node keeps are [`VipClaims::node_lost`]'s).
    pub fn lost(&self, name: &ServiceName) -> BTreeMap<Vip, ServiceName> {
        let mut out = BTreeMap::new();
        let held = self.by_service.get(name).map(|h| &h.vips[..]);
        for (vip, external) in held.into_iter().flatten() {
            if !external || self.node_loss(vip).is_some() {
                continue;
            }
            match self.winner(vip) {
                Some(w) if w != *name => {
                    out.insert(*vip, w);
                }
                _ => {}
            }
        }
        out
    }

    /// External claims lost to another Service node-wide (the `kube_ipvs_vip_conflicts`
    /// gauge; those the node keeps are [`VipClaims::node_conflicts`]).
    pub fn conflicts(&self) -> usize {
        self.by_vip
            .iter()
            .filter(|(vip, _)| self.node_loss(vip).is_none())
            .map(|(_, set)| {
                let winner = set.first().map(|r| &r.name);
                set.iter()
                    .filter(|r| r.external && Some(&r.name) != winner)
                    .count()
            })
            .sum()
    }

    /// Services with claims.
    pub fn len(&self) -> usize {
        self.by_service.len()
    }

    /// True when no Service has claims.
    pub fn is_empty(&self) -> bool {
        self.by_service.is_empty()
    }
}

/// The rejection reason for a Service that lost `lost` (None when it lost nothing).
pub fn conflict_reason(lost: &BTreeMap<Vip, ServiceName>) -> Option<Invalid> {
    if lost.is_empty() {
        return None;
    }
    let mut parts: Vec<String> = lost
        .iter()
        .take(REASON_MAX_VIPS)
        .map(|(vip, winner)| format!("{vip} is served by {winner}"))
        .collect();
    if lost.len() > REASON_MAX_VIPS {
        parts.push(format!("and {} more", lost.len() - REASON_MAX_VIPS));
    }
    Some(Invalid::new(format!(
        "{CONFLICT_PREFIX} {} (a ClusterIP, then the oldest Service, keeps a VIP; this \
         Service's claim is not served)",
        parts.join(", ")
    )))
}
