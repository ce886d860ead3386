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
pub use observer::{
    endpoint_nodes, reason_label, refusal_event, FamilySeen, Observer, Rejection,
    INVALID_REASON_LABELS,
};
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
use proxier::ipvs_mode::{DrainConfig, Proxier, Refusal, RulesConfig, SyncReport};
use proxier::retry::{RetryPolicy, Subsystem};
use proxier::sync_loop::{self, Backend, Exit, FamilyProxier, Input, LoopConfig, SyncObserver};

use crate::config::{Config, DetectLocal, NodePortAddress, ProxyMode};
use crate::error::Error;
use crate::health::ProxyHealth;
use crate::metrics::Metrics;
use crate::service_health::{HealthCheckService, NamespacedName, ServiceHealthServer};

/// What this node's Node object says about its families (read once at start; empty with
/// `--source-dir` or when the Node could not be read in time).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct NodeFacts {
    /// Its InternalIP and ExternalIP addresses, in that order (`status.addresses`).
    pub addresses: Vec<IpAddr>,
    /// Its `spec.podCIDRs` (else `spec.podCIDR`).
    pub pod_cidrs: Vec<ipnet::IpNet>,
}

impl NodeFacts {
    /// The facts of a Node object.
    pub fn of(node: &k8s_openapi::api::core::v1::Node) -> NodeFacts {
        let addresses = model::NodeInfo::from_node("", Some(node), BTreeSet::new()).primary_ips;
        let pod_cidrs = [Family::Inet, Family::Inet6]
            .into_iter()
            .flat_map(|f| model::NodeInfo::pod_cidrs_of(Some(node), f))
            .collect();
        NodeFacts {
            addresses,
            pod_cidrs,
        }
    }
}

/// What decided the primary family (the log's `from`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PrimaryFrom {
    /// `bindAddress` is set.
    BindAddress,
    /// The Node object's first InternalIP/ExternalIP.
    NodeObject,
    /// The first `clusterCIDR`.
    ClusterCidr,
    /// The node's interface addresses (IPv4 when it has one).
    NodeAddresses,
    /// Nothing told: IPv4.
    Default,
}

impl PrimaryFrom {
    /// A fixed word for the log.
    pub fn as_str(self) -> &'static str {
        match self {
            PrimaryFrom::BindAddress => "bindAddress",
            PrimaryFrom::NodeObject => "Node object",
            PrimaryFrom::ClusterCidr => "clusterCIDR",
            PrimaryFrom::NodeAddresses => "node addresses",
            PrimaryFrom::Default => "default",
        }
    }
}

/// The primary family: like upstream's `detectNodeIPs` (cmd/kube-proxy/app/server.go), the
/// family of `bindAddress` when it is set, else of the Node object's first InternalIP or
/// ExternalIP; where upstream then assumes IPv4, kube-ipvs looks at the first `clusterCIDR`
/// and then the node's interface addresses first. A failure to serve the primary family is an
/// error at start, like upstream's "no support for primary IP family".
pub fn primary_family(
    config: &Config,
    node: &NodeFacts,
    node_ips: &BTreeSet<IpAddr>,
) -> (Family, PrimaryFrom) {
    if !config.bind_address.is_unspecified() {
        return (Family::of(&config.bind_address), PrimaryFrom::BindAddress);
    }
    if let Some(ip) = node.addresses.first() {
        return (Family::of(ip), PrimaryFrom::NodeObject);
    }
    if let Some(c) = config.cluster_cidrs.first() {
        return (Family::of(&c.addr()), PrimaryFrom::ClusterCidr);
    }
    if node_ips.iter().any(IpAddr::is_ipv4) {
        (Family::Inet, PrimaryFrom::NodeAddresses)
    } else if node_ips.iter().any(IpAddr::is_ipv6) {
        (Family::Inet6, PrimaryFrom::NodeAddresses)
    } else {
        (Family::Inet, PrimaryFrom::Default)
    }
}

/// The other family.
pub fn other_family(family: Family) -> Family {
    match family {
        Family::Inet => Family::Inet6,
        Family::Inet6 => Family::Inet,
    }
}

/// Whether the node shows it uses `family`: an interface address of it (IPv6 link-local ones
/// are not node addresses), a `clusterCIDR` of it, or an address or podCIDR of it on its Node
/// object. The secondary family is served when it is signalled this way and the node supports
/// it; a signal that appears later (an IPv6 address configured after the start, e.g. by SLAAC)
/// adds it while the daemon runs.
pub fn family_signalled(
    config: &Config,
    node: &NodeFacts,
    node_ips: &BTreeSet<IpAddr>,
    family: Family,
) -> bool {
    node_ips.iter().any(|ip| Family::of(ip) == family)
        || config
            .cluster_cidrs
            .iter()
            .chain(&node.pod_cidrs)
            .any(|c| Family::of(&c.addr()) == family)
        || node.addresses.iter().any(|ip| Family::of(ip) == family)
}

/// The families to serve, primary first, without asking whether the node supports the
/// secondary one (`plan`, `--cleanup`): the primary, and the other when it is signalled
/// ([`family_signalled`]).
pub fn families(config: &Config, node_ips: &BTreeSet<IpAddr>) -> Vec<Family> {
    let node = NodeFacts::default();
    let (primary, _) = primary_family(config, &node, node_ips);
    let mut out = vec![primary];
    let other = other_family(primary);
    if family_signalled(config, &node, node_ips, other) {
        out.push(other);
    }
    out
}

/// Why the node cannot serve `family` beyond what building its backend finds: IPv6 disabled in
/// the kernel (no `net/ipv6` under the sysctl root, as with `ipv6.disable=1`).
pub fn family_unsupported(config: &Config, family: Family) -> Option<String> {
    match family {
        Family::Inet => None,
        Family::Inet6 => {
            let dir = config.sysctl_root.join("net/ipv6");
            (!dir.exists()).then(|| {
                format!(
                    "the kernel has no IPv6 ({} is missing: IPv6 disabled)",
                    dir.display()
                )
            })
        }
    }
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
    p.protected_node_ports = protected_node_ports(config);
    p.refuse_node_address_vips = config.refuse_node_address_vips;
    p.budget = config.service_budget;
    p
}

/// `--protected-node-ports` with the proxy's own healthz and metrics ports (TCP), sorted.
pub fn protected_node_ports(config: &Config) -> Vec<model::ProtectedPort> {
    let own = [config.healthz_bind_address, config.metrics_bind_address]
        .into_iter()
        .filter(|a| a.port() != 0)
        .map(|a| model::ProtectedPort {
            port: a.port(),
            protocol: Some(ipvs_netlink::Protocol::Tcp),
        });
    let mut out: Vec<model::ProtectedPort> = config
        .protected_node_ports
        .iter()
        .copied()
        .chain(own)
        .collect();
    out.sort();
    out.dedup();
    out
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
    /// The loop's thread only; a family joins with [`SyncObserver::family_added`].
    families: std::sync::Mutex<Vec<Family>>,
}

impl SyncObserver for LoopObserver {
    fn queued(&self, changes: &Changes) {
        if !changes.dirty.is_empty() || changes.node_changed {
            let families = self.families.lock().unwrap_or_else(|p| p.into_inner());
            for f in families.iter() {
                self.inner.metrics.record_queued(*f);
                self.inner.health.queued_update(*f);
            }
        }
    }
    fn synced(&self, family: Family, report: &SyncReport, backend: &dyn Backend) {
        self.inner.synced(family, report, backend);
    }
    fn rejected(&self, family: Family, rejected: &[(String, String)], store: &Store) {
        self.inner.rejected(family, rejected, store);
    }
    fn refused(&self, family: Family, refused: &[Refusal]) {
        self.inner.refused(family, refused);
    }
    fn family_added(&self, family: Family) {
        let mut families = self.families.lock().unwrap_or_else(|p| p.into_inner());
        if !families.contains(&family) {
            families.push(family);
        }
        self.inner.metrics.init_families(&[family]);
        self.inner.metrics.set_family_served(family, true);
    }
    fn network_programmed(&self, family: Family, triggers: &[std::time::SystemTime]) {
        self.inner.network_programmed(family, triggers);
    }
    fn waiting(&self, until: std::time::Instant) {
        self.inner.waiting(until);
    }
    fn working(&self) {
        self.inner.working();
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
            families: std::sync::Mutex::new(backends.iter().map(|b| b.family()).collect()),
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

/// Forwards node-address changes (and kube-ipvs0 deletions) from netif's tracker to the loop,
/// and the tracker's own state to the metrics. While the tracker does not know the addresses
/// (its first dump failed) the loop is told so and uses the Node object's addresses; when the
/// tracker stops following changes the loop keeps the last addresses it was sent (the tracker
/// keeps them too, and subscribes again with backoff).
pub fn forward_node_addresses(
    tracker: &netif::NodeAddresses,
    tx: sync_loop::InputSender,
    metrics: Arc<Metrics>,
) -> tokio::task::JoinHandle<()> {
    let mut rx = tracker.subscribe();
    let mut status = tracker.status();
    tokio::spawn(async move {
        let mut deletions = rx.borrow().dummy_deletions();
        let mut seen = status.borrow_and_update().clone();
        metrics.record_node_address_tracker(&seen, 0);
        if !seen.known && !tx.send(Input::NodeAddressesUnknown).await {
            return;
        }
        loop {
            tokio::select! {
                changed = rx.changed() => {
                    if changed.is_err() {
                        return;
                    }
                    let (ips, del) = {
                        let s = rx.borrow_and_update();
                        (s.node_ips(), s.dummy_deletions())
                    };
                    // The loop ignores unchanged node IPs (one check, there); the tracker sends
                    // at most one snapshot per burst of kube-ipvs0 binds.
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
                changed = status.changed() => {
                    if changed.is_err() {
                        return;
                    }
                    let now = status.borrow_and_update().clone();
                    let more = now.resubscriptions.saturating_sub(seen.resubscriptions);
                    metrics.record_node_address_tracker(&now, more);
                    seen = now;
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
