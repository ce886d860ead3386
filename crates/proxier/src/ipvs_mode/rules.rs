//! The iptables settings of the IPVS mode that do not come from Services: local-traffic
//! detection and the node's pod CIDRs.

use super::*;

/// iptables settings that do not come from services.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RulesConfig {
    /// Bit of the masquerade mark (`masqueradeBit`, default 14).
    pub masquerade_bit: u32,
    /// Local-traffic detection.
    pub local_detect: iptables::LocalDetect,
    /// `--random-fully` on MASQUERADE.
    pub random_fully: bool,
    /// `detectLocalMode: NodeCIDR`: traffic from the Node object's `spec.podCIDRs` (of the
    /// proxy's family) is local, and `local_detect` is ignored. Upstream (`NewDetectLocalByCIDR`
    /// with the node's podCIDRs, cmd/kube-proxy/app/server.go) waits for them at start and
    /// restarts when they change; here the rules follow the Node object, and until it has
    /// podCIDRs no traffic counts as local (node-originated traffic to a VIP is masqueraded).
    pub node_cidr: bool,
}

impl RulesConfig {
    /// The local-traffic detection to render for one family: the Node's podCIDRs under
    /// NodeCIDR (none until it has some), the family's cluster CIDRs when no other detection is
    /// configured, else the configured one.
    pub fn local_detect_for(
        &self,
        cluster_cidrs: &[ipnet::IpNet],
        pod_cidrs: &[ipnet::IpNet],
    ) -> iptables::LocalDetect {
        match &self.local_detect {
            _ if self.node_cidr => {
                if pod_cidrs.is_empty() {
                    iptables::LocalDetect::None
                } else {
                    iptables::LocalDetect::Cidrs(pod_cidrs.to_vec())
                }
            }
            iptables::LocalDetect::None if !cluster_cidrs.is_empty() => {
                iptables::LocalDetect::Cidrs(cluster_cidrs.to_vec())
            }
            other => other.clone(),
        }
    }

    /// Under NodeCIDR, takes the Node's podCIDRs of `family` into `held`; true when they
    /// changed (the rules must be rendered again). Always false otherwise.
    pub fn refresh_pod_cidrs(
        &self,
        held: &mut Vec<ipnet::IpNet>,
        store: &Store,
        family: ipvs_netlink::Family,
    ) -> bool {
        if !self.node_cidr {
            return false;
        }
        let cidrs = NodeInfo::pod_cidrs_of(store.node(), family);
        if cidrs == *held {
            return false;
        }
        tracing::info!(?family, old = ?held, new = ?cidrs,
            "detectLocalMode NodeCIDR: the Node's podCIDRs changed; re-rendering the rules");
        *held = cidrs;
        true
    }
}

impl Default for RulesConfig {
    fn default() -> Self {
        RulesConfig {
            masquerade_bit: 14,
            local_detect: iptables::LocalDetect::None,
            random_fully: true,
            node_cidr: false,
        }
    }
}
