//! External claims on this node's own addresses: what an externalIP or load-balancer IP equal
//! to a node address may not take (the CVE-2020-8554 class on the node's addresses).
//!
//! An external claim (IP, port, protocol) whose IP is one of this node's addresses (its
//! interfaces' addresses other than kube-ipvs0, and the Node object's primary IPs) is not
//! served, whichever Service makes it, when:
//!
//! 1. a Service's **NodePort** derives the same (node IP, port, protocol) virtual server (the
//!    IP is one of the NodePort addresses): NodePorts are allocated uniquely by the API server
//!    and always win, also against the claimant's own NodePort;
//! 2. the port is a Service's **health-check node port** (TCP, any node address: the
//!    health-check server listens on every address);
//! 3. the port is a **protected node port** (`--protected-node-ports`, which defaults to what a
//!    node serves by default, plus the proxy's own healthz and metrics ports): kubelet's 10250,
//!    the API server's 6443, SSH, ...;
//! 4. `--refuse-node-address-vips` is set: no external claim on a node address is served.
//!
//! Upstream kube-proxy's IPVS mode (`syncService` in pkg/proxy/ipvs/proxier.go) programs such
//! a claim like any other: the externalIP's virtual server then takes the node's own
//! address:port, and a key shared with a NodePort gets the real servers of whichever Service
//! its sync loop (which walks a Go map) writes last. Here the dropped claim gives no
//! virtual server, ipset entry or kube-ipvs0 address (an externalIP on a node address is never
//! bound to kube-ipvs0 anyway, like upstream); the claimant gets a `NodeAddressConflict`
//! Event (reason starting with [`NODE_CONFLICT_PREFIX`]) and the loss is counted in
//! `kube_ipvs_node_address_conflicts{reason}`. The answer depends only on the node's addresses,
//! the configuration and the Services, never on the order events arrive in; it is recomputed
//! when the node's addresses change, and a dropped claim is served again once the NodePort
//! that beat it goes (or the address leaves the node).

use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;

use ipvs_netlink::Protocol;

use super::{Vip, VipClaims};
use model::{Invalid, NodeInfo, ProtectedPort, ProxyConfig, ServiceName};

/// Every node-address conflict reason starts with this (the engine maps it to a
/// `NodeAddressConflict` Event).
pub const NODE_CONFLICT_PREFIX: &str = "node address conflict:";

/// Most lost claims named in one reason (the rest are counted).
const REASON_MAX: usize = 8;

/// A port this node serves for a Service on its own addresses.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct NodePortKey {
    /// The port.
    pub port: u16,
    /// The protocol (TCP for a health-check node port).
    pub protocol: Protocol,
    /// A health-check node port (every node address) rather than a NodePort (the NodePort
    /// addresses).
    pub health_check: bool,
}

/// Why an external claim on one of this node's addresses is not served.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub enum NodeLoss {
    /// The node serves this address and port for a Service: its NodePort, or (with
    /// `health_check`) its health-check node port.
    NodePort {
        /// The Service (the smallest name when, against the API server's rules, several have
        /// the port).
        owner: ServiceName,
        /// A health-check node port.
        health_check: bool,
    },
    /// A protected node port (`--protected-node-ports`, the proxy's own ports).
    Protected,
    /// `--refuse-node-address-vips`.
    Refused,
}

/// External claims on node addresses not served, node-wide, by why (the
/// `kube_ipvs_node_address_conflicts{reason}` gauge).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct NodeConflicts {
    /// Lost to a NodePort or health-check node port (`reason="node_port"`).
    pub node_port: usize,
    /// On a protected node port (`reason="protected_port"`).
    pub protected_port: usize,
    /// Refused by `--refuse-node-address-vips` (`reason="refused"`).
    pub refused: usize,
}

impl NodeConflicts {
    /// The counts with their fixed `reason` labels.
    pub fn by_reason(&self) -> [(&'static str, usize); 3] {
        [
            ("node_port", self.node_port),
            ("protected_port", self.protected_port),
            ("refused", self.refused),
        ]
    }

    /// The sum of two families' counts.
    pub fn plus(self, o: NodeConflicts) -> NodeConflicts {
        NodeConflicts {
            node_port: self.node_port + o.node_port,
            protected_port: self.protected_port + o.protected_port,
            refused: self.refused + o.refused,
        }
    }

    fn count(&mut self, loss: &NodeLoss, n: usize) {
        match loss {
            NodeLoss::NodePort { .. } => self.node_port += n,
            NodeLoss::Protected => self.protected_port += n,
            NodeLoss::Refused => self.refused += n,
        }
    }
}

/// This node as the claims see it: its addresses of the family and the policy.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(super) struct NodeView {
    /// Every address of the family: the interfaces' (not kube-ipvs0's) and the primary IPs.
    ips: BTreeSet<IpAddr>,
    /// Those that serve NodePorts.
    node_port_ips: BTreeSet<IpAddr>,
    protected: Vec<ProtectedPort>,
    refuse: bool,
}

impl NodeView {
    fn of(node: &NodeInfo, cfg: &ProxyConfig) -> NodeView {
        NodeView {
            ips: node.ips_of(cfg.family).collect(),
            node_port_ips: node.node_port_ips(cfg),
            protected: cfg.protected_node_ports.clone(),
            refuse: cfg.refuse_node_address_vips,
        }
    }

    /// The node addresses a Service's node port is served on, as claims.
    fn covered(&self, k: &NodePortKey) -> impl Iterator<Item = Vip> + '_ {
        let ips = if k.health_check {
            &self.ips
        } else {
            &self.node_port_ips
        };
        let (port, protocol) = (k.port, k.protocol);
        ips.iter().map(move |ip| Vip {
            ip: *ip,
            port,
            protocol,
        })
    }
}

impl VipClaims {
    /// Takes this node's addresses (and the policy) for the claims; returns the Services with
    /// external claims on an address that joined or left the node: their losses may have
    /// changed (re-derive them).
    pub fn set_node(&mut self, node: &NodeInfo, cfg: &ProxyConfig) -> BTreeSet<ServiceName> {
        let view = NodeView::of(node, cfg);
        if view == self.node {
            return BTreeSet::new();
        }
        let old = std::mem::replace(&mut self.node, view);
        let new = &self.node;
        let changed: BTreeSet<IpAddr> =
            if old.protected != new.protected || old.refuse != new.refuse {
                old.ips.union(&new.ips).copied().collect()
            } else {
                (old.ips.symmetric_difference(&new.ips))
                    .chain(old.node_port_ips.symmetric_difference(&new.node_port_ips))
                    .copied()
                    .collect()
            };
        if changed.is_empty() {
            return BTreeSet::new();
        }
        self.by_vip
            .iter()
            .filter(|(v, _)| changed.contains(&v.ip))
            .flat_map(|(_, set)| set.iter().filter(|r| r.external).map(|r| r.name.clone()))
            .collect()
    }

    /// Replaces `name`'s node ports; returns the Services (other than `name`) with external
    /// claims on the node addresses and ports that changed owner.
    pub(super) fn set_node_ports(
        &mut self,
        name: &ServiceName,
        old: &[NodePortKey],
        new: &[NodePortKey],
    ) -> BTreeSet<ServiceName> {
        let mut changed = Vec::new();
        for k in old.iter().filter(|k| !new.contains(k)) {
            if let Some(set) = self.node_ports.get_mut(k) {
                set.remove(name);
                if set.is_empty() {
                    self.node_ports.remove(k);
                }
            }
            changed.push(*k);
        }
        for k in new.iter().filter(|k| !old.contains(k)) {
            self.node_ports.entry(*k).or_default().insert(name.clone());
            changed.push(*k);
        }
        let mut affected = BTreeSet::new();
        for k in &changed {
            for vip in self.node.covered(k) {
                if let Some(set) = self.by_vip.get(&vip) {
                    affected.extend(
                        set.iter()
                            .filter(|r| r.external && r.name != *name)
                            .map(|r| r.name.clone()),
                    );
                }
            }
        }
        affected
    }

    /// Why an external claim on `vip` is not served on this node, if it is not (the same for
    /// every claimant).
    pub fn node_loss(&self, vip: &Vip) -> Option<NodeLoss> {
        let n = &self.node;
        if !n.ips.contains(&vip.ip) {
            return None;
        }
        let owner = |port, protocol, health_check| {
            let k = NodePortKey {
                port,
                protocol,
                health_check,
            };
            let owner = self.node_ports.get(&k)?.first()?.clone();
            Some(NodeLoss::NodePort {
                owner,
                health_check,
            })
        };
        let node_port = n
            .node_port_ips
            .contains(&vip.ip)
            .then(|| owner(vip.port, vip.protocol, false))
            .flatten();
        let health_check = (vip.protocol == Protocol::Tcp)
            .then(|| owner(vip.port, Protocol::Tcp, true))
            .flatten();
        node_port.or(health_check).or_else(|| {
            if n.protected.iter().any(|p| p.covers(vip.port, vip.protocol)) {
                Some(NodeLoss::Protected)
            } else if n.refuse {
                Some(NodeLoss::Refused)
            } else {
                None
            }
        })
    }

    /// The external claims of `name` on this node's addresses that are not served, and why.
    pub fn node_lost(&self, name: &ServiceName) -> BTreeMap<Vip, NodeLoss> {
        let held = self.by_service.get(name).map(|h| &h.vips[..]);
        held.into_iter()
            .flatten()
            .filter(|(_, external)| *external)
            .filter_map(|(vip, _)| Some((*vip, self.node_loss(vip)?)))
            .collect()
    }

    /// External claims on node addresses not served, node-wide, by why.
    pub fn node_conflicts(&self) -> NodeConflicts {
        let mut out = NodeConflicts::default();
        for (vip, set) in self
            .by_vip
            .iter()
            .filter(|(v, _)| self.node.ips.contains(&v.ip))
        {
            if let Some(loss) = self.node_loss(vip) {
                out.count(&loss, set.iter().filter(|r| r.external).count());
            }
        }
        out
    }
}

/// The rejection reason for a Service whose claims on node addresses in `lost` are not served
/// (None when there are none).
pub fn node_conflict_reason(lost: &BTreeMap<Vip, NodeLoss>) -> Option<Invalid> {
    if lost.is_empty() {
        return None;
    }
    let mut parts: Vec<String> = lost
        .iter()
        .take(REASON_MAX)
        .map(|(vip, why)| match why {
            NodeLoss::NodePort {
                owner,
                health_check: false,
            } => format!("{vip} is the NodePort of {owner}"),
            NodeLoss::NodePort {
                owner,
                health_check: true,
            } => format!("{vip} is the health-check node port of {owner}"),
            NodeLoss::Protected => {
                format!("{vip} is a protected node port (--protected-node-ports)")
            }
            NodeLoss::Refused => {
                format!("{vip} is on a node address (--refuse-node-address-vips)")
            }
        })
        .collect();
    if lost.len() > REASON_MAX {
        parts.push(format!("and {} more", lost.len() - REASON_MAX));
    }
    Some(Invalid::new(format!(
        "{NODE_CONFLICT_PREFIX} {} (an externalIP or load-balancer IP on this node's address \
         never takes a NodePort, a health-check node port or a protected node port; this \
         Service's claim is not served on this node)",
        parts.join(", ")
    )))
}

/// The node ports one Service's ports have (NodePorts and health-check node ports), sorted.
pub(super) fn node_ports_of(ports: &[model::ServicePort]) -> Vec<NodePortKey> {
    let mut out = Vec::new();
    for sp in ports {
        if let Some(port) = sp.node_port {
            out.push(NodePortKey {
                port,
                protocol: sp.name.protocol,
                health_check: false,
            });
        }
        if let Some(port) = sp.health_check_node_port {
            out.push(NodePortKey {
                port,
                protocol: Protocol::Tcp,
                health_check: true,
            });
        }
    }
    out.sort();
    out.dedup();
    out
}
