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

mod config;
mod names;
mod payload;
mod port_plan;
mod service_port;
#[cfg(test)]
mod tests;

pub use config::*;
pub use names::*;
pub use payload::*;
use port_plan::*;
pub use service_port::*;

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
