//! Each Service's budget: the most virtual servers, real servers and ipset members one Service
//! may cost this node ([`ServiceBudget`]), checked while it is derived ([`BudgetTally`]). Pure.
//!
//! The per-dimension caps ([`crate::MAX_PORTS_PER_SERVICE`], [`crate::MAX_VIPS_PER_SERVICE`],
//! [`crate::MAX_ENDPOINTS_PER_SERVICE_PORT`]) multiply: 1,000 ports × 256 VIPs (plus the node's
//! addresses for NodePorts) is over 256,000 virtual servers from one object, each with up to
//! 20,000 real servers. The budget bounds the product. A Service over it is rejected like any
//! invalid Service (it keeps its last good state; the reason names the figure and the flag),
//! and the check runs before the virtual servers are built, so an absurd Service never costs
//! the memory it asks for.
//!
//! What is counted, the same in both proxy modes (so one Service is accepted or rejected alike):
//!
//! - **virtual servers**: per port, its ClusterIP, every externalIP and load-balancer IP of the
//!   family the Service lists (claims lost to another Service included: the figure does not
//!   depend on other objects), and, with a nodePort, every node address NodePorts are served
//!   on ([`crate::NodeInfo::node_port_ips`]);
//! - **real servers**: per virtual server, its endpoints as selected (the ClusterIP's by the
//!   internal policy, the others' by the external policy);
//! - **ipset members** (IPVS mode): the members the Service adds to kube-proxy's sets.
//!
//! Node addresses: the figures use the node's addresses when the Service is derived. A Service
//! that goes over its budget because the node gained addresses is rejected then and keeps its
//! last good state; rejected Services are derived again at every full sync and node change, so
//! it comes back when the addresses go.

use crate::names::Invalid;

/// Default of [`ServiceBudget::virtual_servers`] (`--max-virtual-servers-per-service`): as many
/// as one of kube-proxy's ipsets holds (`maxelem` 65536). E.g. 1,000 ports × (ClusterIP,
/// 8 external or load-balancer IPs and 55 node addresses).
pub const DEFAULT_MAX_VIRTUAL_SERVERS: usize = 65_536;
/// Default of [`ServiceBudget::real_servers`] (`--max-real-servers-per-service`). E.g. a port
/// with 20,000 endpoints (the per-port cap) on 50 virtual servers, or 1,000 ports × 100
/// endpoints × 10 virtual servers.
pub const DEFAULT_MAX_REAL_SERVERS: usize = 1_000_000;
/// Default of [`ServiceBudget::ipset_members`] (`--max-ipset-members-per-service`): as many as
/// one set holds. E.g. 1,000 ports × 4 load-balancer IPs × 10 source ranges, or 1,000 ports ×
/// 60 local endpoints (hairpin members).
pub const DEFAULT_MAX_IPSET_MEMBERS: usize = 65_536;

/// The most one Service may cost this node.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ServiceBudget {
    /// Virtual servers (`--max-virtual-servers-per-service`).
    pub virtual_servers: usize,
    /// Real servers, summed over its virtual servers (`--max-real-servers-per-service`).
    pub real_servers: usize,
    /// ipset members, summed over the sets (`--max-ipset-members-per-service`; IPVS mode).
    pub ipset_members: usize,
}

impl Default for ServiceBudget {
    fn default() -> Self {
        ServiceBudget {
            virtual_servers: DEFAULT_MAX_VIRTUAL_SERVERS,
            real_servers: DEFAULT_MAX_REAL_SERVERS,
            ipset_members: DEFAULT_MAX_IPSET_MEMBERS,
        }
    }
}

/// One Service's running figures against its [`ServiceBudget`], port by port.
#[derive(Debug)]
pub struct BudgetTally {
    budget: ServiceBudget,
    ports: usize,
    seen: usize,
    real_servers: usize,
}

/// The virtual servers of one port: its ClusterIP, its external and load-balancer IPs, and the
/// node's NodePort addresses when it has a nodePort.
pub fn port_virtual_servers(port: &crate::ServicePort, node_port_ips: usize) -> usize {
    let node = if port.node_port.is_some() {
        node_port_ips
    } else {
        0
    };
    1 + port.external_ips.len() + port.load_balancer_ips.len() + node
}

impl BudgetTally {
    /// Starts the tally of a Service with these `ports`, checking its virtual servers (known
    /// from the ports and the node's `node_port_ips` alone).
    pub fn start(
        budget: ServiceBudget,
        ports: &[crate::ServicePort],
        node_port_ips: usize,
    ) -> Result<BudgetTally, Invalid> {
        let total: usize = ports
            .iter()
            .map(|p| port_virtual_servers(p, node_port_ips))
            .sum();
        if total > budget.virtual_servers {
            let most = ports
                .iter()
                .map(|p| port_virtual_servers(p, node_port_ips))
                .max()
                .unwrap_or(0);
            return Err(Invalid::new(format!(
                "over the virtual-server budget ({total} virtual servers: {} ports with up to \
                 {most} addresses each (clusterIP, externalIPs, load-balancer IPs, {node_port_ips} \
                 node addresses for nodePorts), max {}: --max-virtual-servers-per-service)",
                ports.len(),
                budget.virtual_servers
            )));
        }
        Ok(BudgetTally {
            budget,
            ports: ports.len(),
            seen: 0,
            real_servers: 0,
        })
    }

    /// Adds the next port's real servers before its virtual servers are built:
    /// `cluster_endpoints` on its ClusterIP, `external_endpoints` on each of its other
    /// `virtual_servers - 1`.
    pub fn port(
        &mut self,
        virtual_servers: usize,
        cluster_endpoints: usize,
        external_endpoints: usize,
    ) -> Result<(), Invalid> {
        self.seen += 1;
        let port = cluster_endpoints.saturating_add(
            virtual_servers
                .saturating_sub(1)
                .saturating_mul(external_endpoints),
        );
        self.real_servers = self.real_servers.saturating_add(port);
        if self.real_servers > self.budget.real_servers {
            return Err(Invalid::new(format!(
                "over the real-server budget ({} real servers in its first {} of {} ports, \
                 max {}: --max-real-servers-per-service)",
                self.real_servers, self.seen, self.ports, self.budget.real_servers
            )));
        }
        Ok(())
    }

    /// Checks the ipset members the Service has added so far (`members`, after the ports
    /// seen).
    pub fn ipset_members(&self, members: usize) -> Result<(), Invalid> {
        if members > self.budget.ipset_members {
            return Err(Invalid::new(format!(
                "over the ipset-member budget ({members} ipset members in its first {} of {} \
                 ports, max {}: --max-ipset-members-per-service)",
                self.seen, self.ports, self.budget.ipset_members
            )));
        }
        Ok(())
    }
}
