//! The sync engine's wiring: one backend (proxier + kernel) per address family,
//! sysctls, the node-address tracker, and the sync-loop thread that the daemon feeds.
//!
//! Its parts: `kernel` opens the node's kernel and builds each mode's backend (IPVS and
//! iptables, the handover cleanup); `sysctls` sets the sysctls and conntrack settings;
//! `observer` turns sync reports into metrics, health, health-check node ports and
//! rejection Events. This file wires them to the sync-loop thread.

mod kernel;
mod observer;
mod sysctls;

pub use kernel::{
    cleanup, iptables_backend, ipvs_backend, ipvs_kernel, ipvs_kernel_parts, retry_policy,
    set_ipvs_timeouts, IptablesBackend,
};
pub use observer::{reason_label, FamilySeen, Observer, Rejection, INVALID_REASON_LABELS};
pub use sysctls::{apply_conntrack, apply_sysctls, conntrack_settings};

use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;
use std::path::Path;
use std::sync::Arc;

use desired::HealthCheck;
use ipvs_netlink::{Family, Op};
use model::event::SourceEvent;
use model::store::{Changes, Store};
use model::{ProxyConfig, ServiceName};
use proxier::ipvs_mode::{DrainConfig, Proxier, RulesConfig, SyncReport};
use proxier::retry::{RetryPolicy, Subsystem};
use proxier::sync_loop::{self, Backend, Exit, FamilyProxier, Input, LoopConfig, SyncObserver};

use crate::config::{Config, DetectLocal, NodePortAddress, ProxyMode};
use crate::error::Error;
use crate::health::ProxyHealth;
use crate::metrics::Metrics;
use crate::service_health::{HealthCheckService, NamespacedName, ServiceHealthServer};

/// The families this node serves: IPv4 when the node has an IPv4 address, IPv6 when it has a
/// global IPv6 address, and any family of the cluster CIDRs (upstream: dual-stack when the
/// node has addresses of both families).
pub fn families(config: &Config, node_ips: &BTreeSet<IpAddr>) -> Vec<Family> {
    let mut v4 = node_ips.iter().any(IpAddr::is_ipv4);
    let mut v6 = node_ips.iter().any(IpAddr::is_ipv6);
    for c in &config.cluster_cidrs {
        match c.addr() {
            IpAddr::V4(_) => v4 = true,
            IpAddr::V6(_) => v6 = true,
        }
    }
    if !v4 && !v6 {
        v4 = true;
    }
    let mut out = Vec::new();
    if v4 {
        out.push(Family::Inet);
    }
    if v6 {
        out.push(Family::Inet6);
    }
    out
}

/// The model's configuration for one family.
pub fn proxy_config(config: &Config, family: Family) -> ProxyConfig {
    let mut p = ProxyConfig::new(family);
    p.scheduler = config.ipvs.scheduler.clone();
    p.exclude_cidrs = config.ipvs.exclude_cidrs.clone();
    p.masquerade_all = config.iptables.masquerade_all;
    p.cluster_cidrs = config.cluster_cidrs.clone();
    p.node_port_addresses = config
        .node_port_addresses
        .iter()
        .filter_map(|a| match a {
            NodePortAddress::Cidr(c) => Some(*c),
            NodePortAddress::Primary => None,
        })
        .collect();
    p.node_port_primary = config
        .node_port_addresses
        .contains(&NodePortAddress::Primary);
    p.bind_address = Some(config.bind_address).filter(|a| !a.is_unspecified());
    p.strict_arp = config.ipvs.strict_arp;
    p.iptables_localhost_node_ports = config.iptables.localhost_node_ports;
    p.tcp_timeout = config.ipvs.tcp_timeout.as_secs() as u32;
    p.tcp_fin_timeout = config.ipvs.tcp_fin_timeout.as_secs() as u32;
    p.udp_timeout = config.ipvs.udp_timeout.as_secs() as u32;
    p.budget = config.service_budget;
    p
}

/// The iptables settings of the IPVS-mode rules.
pub fn rules_config(config: &Config, random_fully: bool) -> RulesConfig {
    RulesConfig {
        masquerade_bit: u32::from(config.iptables.masquerade_bit),
        node_cidr: config.detect_local == DetectLocal::NodeCidr,
        local_detect: match &config.detect_local {
            // NodeCIDR: the Node's podCIDRs, filled in by the proxier from the Node object.
            DetectLocal::NodeCidr => iptables::LocalDetect::None,
            DetectLocal::ClusterCidr => {
                if config.cluster_cidrs.is_empty() {
                    iptables::LocalDetect::None
                } else {
                    iptables::LocalDetect::Cidrs(config.cluster_cidrs.clone())
                }
            }
            DetectLocal::BridgeInterface(b) => iptables::LocalDetect::BridgeInterface(b.clone()),
            DetectLocal::InterfaceNamePrefix(p) => {
                iptables::LocalDetect::InterfaceNamePrefix(p.clone())
            }
        },
        random_fully,
    }
}

/// The running engine: the sync-loop thread and its input channel.
///
/// The channel is bounded ([`sync_loop::input_channel`], [`sync_loop::INPUT_CAPACITY`]): when
/// the loop is busy (a long sync) and the channel fills, [`Engine::send`] waits without
/// blocking a runtime worker, which back-pressures the source's own bounded channel and the
/// watchers; nothing is dropped, and the loop coalesces whatever queued into one sync.
#[derive(Debug)]
pub struct Engine {
    tx: sync_loop::InputSender,
    thread: Option<std::thread::JoinHandle<Exit>>,
}

/// The observer as the sync loop sees it: queued changes are tracked for `/healthz` only in the
/// families that have a backend (like upstream, where each family's proxier reports its own), so
/// a single-stack node does not wait forever for an IPv6 sync that never comes.
struct LoopObserver {
    inner: Observer,
    families: Vec<Family>,
}

impl SyncObserver for LoopObserver {
    fn queued(&self, changes: &Changes) {
        if !changes.dirty.is_empty() || changes.node_changed {
            for f in &self.families {
                self.inner.metrics.record_queued(*f);
                self.inner.health.queued_update(*f);
            }
        }
    }
    fn synced(&self, family: Family, report: &SyncReport, backend: &dyn Backend) {
        self.inner.synced(family, report, backend);
    }
    fn rejected(&self, family: Family, rejected: &[(String, String)]) {
        self.inner.rejected(family, rejected);
    }
    fn network_programmed(&self, family: Family, triggers: &[std::time::SystemTime]) {
        self.inner.network_programmed(family, triggers);
    }
}

impl Engine {
    /// Starts the sync loop on its own thread.
    pub fn start(
        mut backends: Vec<Box<dyn Backend + Send>>,
        node_addresses: BTreeSet<IpAddr>,
        cfg: LoopConfig,
        observer: Observer,
    ) -> Engine {
        let observer = LoopObserver {
            families: backends.iter().map(|b| b.family()).collect(),
            inner: observer,
        };
        let (tx, rx) = sync_loop::input_channel(sync_loop::INPUT_CAPACITY);
        let thread = std::thread::Builder::new()
            .name("sync-loop".into())
            .spawn(move || {
                let mut store = Store::new();
                sync_loop::run(
                    &rx,
                    &mut store,
                    &mut backends,
                    node_addresses,
                    cfg,
                    &observer,
                )
            });
        let thread = match thread {
            Ok(t) => Some(t),
            Err(e) => {
                tracing::error!(error = %e, "cannot start the sync loop thread");
                None
            }
        };
        Engine { tx, thread }
    }

    /// A sender for inputs (sources, the node-address tracker).
    pub fn sender(&self) -> sync_loop::InputSender {
        self.tx.clone()
    }

    /// Hands a source event to the loop, waiting while its channel is full; false when the
    /// loop has ended.
    pub async fn send(&self, ev: SourceEvent) -> bool {
        self.tx.send(Input::Source(ev)).await
    }

    /// True when the loop thread has returned (e.g. `--once` done).
    pub fn finished(&self) -> bool {
        self.thread.as_ref().is_none_or(|t| t.is_finished())
    }

    /// Stops the loop (if running) and returns how it ended.
    pub fn stop(mut self) -> Exit {
        let _ = self.tx.send_blocking(Input::Shutdown);
        match self.thread.take().map(|t| t.join()) {
            Some(Ok(exit)) => exit,
            _ => Exit::Shutdown,
        }
    }
}

/// Forwards node-address changes (and kube-ipvs0 deletions) from netif's tracker to the loop.
pub fn forward_node_addresses(
    tracker: &netif::NodeAddresses,
    tx: sync_loop::InputSender,
) -> tokio::task::JoinHandle<()> {
    let mut rx = tracker.subscribe();
    tokio::spawn(async move {
        let mut deletions = rx.borrow().dummy_deletions();
        while rx.changed().await.is_ok() {
            let (ips, del) = {
                let s = rx.borrow();
                (s.node_ips(), s.dummy_deletions())
            };
            // The loop ignores unchanged node IPs (one check, there); the tracker sends at most
            // one snapshot per burst of kube-ipvs0 binds.
            if !tx.send(Input::NodeAddresses(ips)).await {
                return;
            }
            if del != deletions {
                deletions = del;
                if !tx.send(Input::LinkDeleted).await {
                    return;
                }
            }
        }
    })
}

/// Which mode to clean up before starting `mode` (the other one).
pub fn other_mode(mode: ProxyMode) -> ProxyMode {
    match mode {
        ProxyMode::Ipvs => ProxyMode::Iptables,
        ProxyMode::Iptables => ProxyMode::Ipvs,
    }
}
