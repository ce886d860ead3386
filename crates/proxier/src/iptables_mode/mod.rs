//! iptables proxy mode: the fallback backend when the kernel has no IPVS.
//!
//! Same store, same model (`service_ports`, `endpoints`, `select_endpoints`), a different
//! backend: [`IptablesProxier`] renders each service port with [`iptables::proxy_mode`] and
//! applies one `iptables-restore --noflush` (both tables) per sync.
//!
//! - **Partial sync**: only the services marked dirty are re-derived; of their per-service chains
//!   (`KUBE-SVC-`, `KUBE-SVL-`, `KUBE-EXT-`, `KUBE-FW-`, `KUBE-SEP-`) only those whose rules
//!   changed are written, chains that went away are flushed and deleted (`-X`); the shared
//!   chains (`KUBE-SERVICES`, `KUBE-NODEPORTS`, the filter chains) are refilled each time. A sync
//!   with nothing changed runs no process at all.
//! - **Full sync** (first sync, after a failure or a failed check read, node changes, and at
//!   most hourly): every chain is written; one `iptables-save` per table finds stale per-service
//!   chains (left by a previous run) and missing or duplicate jumps from the built-in chains,
//!   repaired in the same restore. The periodic one comes every [`FULL_SYNC_PERIOD`] (an hour)
//!   and not at all on a node with more than [`LARGE_CLUSTER_ENDPOINTS`] endpoints, as
//!   upstream's `syncProxyRules` does (`doFullSync`: `proxyutil.FullSyncPeriod`, not in
//!   `largeClusterMode`; pkg/proxy/iptables/proxier.go, v1.37.2): a full restore of a large
//!   table takes seconds to minutes (2.1 s at 1,000 x 10 on the 2-core host, 153 s at
//!   5,000 x 10; over 40 s at 1,000 x 10 in the emulated VM) and every change waits for it.
//! - **Periodic check** (every `syncPeriod`, [`Backend::periodic`]): lists only the built-in
//!   chains the jumps start from and the shared chains (`iptables -S CHAIN`, one small process
//!   each: the nft backend fetches only that chain), repairs missing or duplicate jumps and
//!   refills a shared chain whose rule count differs from what is rendered (a flushed
//!   `KUBE-SERVICES`), all counted as drift; nothing is written when nothing differs. A chain
//!   that cannot be listed (deleted, or the table flushed) turns the sync into a full one.
//!   Upstream checks only for its canary chains every `syncPeriod` (`ipt.Monitor`).
//! - **Node addresses changed**: every Service is derived again and the shared chains are
//!   written; per-service chains only where their rules changed; no `iptables-save`.
//! - **UDP conntrack**: each sync records which UDP flows became stale
//!   ([`UdpConntrackCleanup`]); the conntrack cleaner shared with IPVS mode consumes them with
//!   [`IptablesProxier::take_conntrack_cleanups`].
//! - **Mode handover**: [`cleanup_ipvs_mode_leftovers`] (start of iptables mode) and
//!   [`cleanup_iptables_mode`] (start of IPVS mode, or `--cleanup`) remove the other mode's
//!   state; both are idempotent and report what they removed.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::net::IpAddr;
use std::time::{Duration, Instant};

use iptables::proxy_mode::{
    self, EndpointRule, PayloadInput, ProxyModeConfig, RenderedServicePort, ServicePortRules,
};
use iptables::{Iptables, Table};
use ipvs_netlink::{Family, Protocol};

use crate::ipvs_mode::{RulesConfig, SyncKind, SyncReport};
use crate::kernel::KernelError;
use crate::retry::{Backoff, RetryPolicy, Subsystem};
use crate::sync_loop::Backend;
use desired::HealthCheck;
use model::store::{Changes, Store};
use model::{
    endpoints, select_endpoints, service_ports, Endpoint, Invalid, NoLocalEndpoints, NodeInfo,
    ProxyConfig, Rejections, ServiceName, ServicePort,
};

mod adopt;
mod cleanup;
mod derive;
mod runner;
mod sync;

pub use derive::{service_port_rules, service_port_string, DerivedPort};
pub use runner::{RecordingRunner, RestoreRunner, SharedRecording};

pub use cleanup::{cleanup_iptables_mode, cleanup_ipvs_mode_leftovers, CleanupReport};
/// Conntrack entries a sync made stale for one UDP service port (the hook for the conntrack
/// cleaner shared with IPVS mode).
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct UdpConntrackCleanup {
    /// `namespace/name:port`.
    pub service_port: String,
    /// Every (VIP, port) of the service port: ClusterIP, externalIPs, LB IPs.
    pub vips: Vec<(IpAddr, u16)>,
    /// The NodePort (entries to any local address on it).
    pub node_port: Option<u16>,
    /// `Some(ip)`: only entries DNATed to this removed endpoint. `None`: the service port went
    /// from no endpoints to some, so every entry to the VIPs (cached rejects) must go.
    pub endpoint: Option<IpAddr>,
}

/// How often the periodic full sync comes at most: upstream's `proxyutil.FullSyncPeriod`
/// (pkg/proxy/util/utils.go, v1.37.2).
pub const FULL_SYNC_PERIOD: Duration = Duration::from_secs(3600);

/// Above this many endpoint chains (`KUBE-SEP-`) the periodic full sync is skipped: upstream's
/// `largeClusterEndpointsThreshold` (pkg/proxy/iptables/proxier.go, v1.37.2).
pub const LARGE_CLUSTER_ENDPOINTS: usize = 1000;

/// One derived service port.
#[derive(Debug, Clone)]
struct PortState {
    rules: ServicePortRules,
    rendered: RenderedServicePort,
    /// Local traffic policies that leave this port without endpoints (for the metric).
    no_local: NoLocalEndpoints,
    /// What the health-check node port counts for this port (see
    /// [`model::SelectedEndpoints::health_check_ips`]).
    health_ips: Vec<IpAddr>,
}

/// The iptables-mode proxier of one address family.
pub struct IptablesProxier {
    cfg: ProxyConfig,
    rules: RulesConfig,
    node_name: String,
    runner: Box<dyn RestoreRunner + Send>,
    services: BTreeMap<ServiceName, Vec<PortState>>,
    /// Per-service chains as last applied: name → [`fingerprint`] of its rule lines (the
    /// lines themselves are in `services`; a second copy of every chain was about a third of
    /// the proxy's memory at 5,000 Services).
    applied: HashMap<String, u64>,
    applied_once: bool,
    dirty: BTreeSet<ServiceName>,
    full_requested: bool,
    /// The requested full sync programs a change (the Node's zone or addresses in the store):
    /// paced by `minSyncPeriod`, unlike the periodic one and a repair's ([`Backend::paced`]).
    full_for_change: bool,
    /// The periodic check is due ([`Backend::periodic`]).
    check_requested: bool,
    /// The node's addresses changed: every Service is derived again (`allow_from_node`, the
    /// NodePort budget) and the shared chains are written (the NodePort jumps), but only the
    /// per-service chains that changed are, with no `iptables-save`.
    rederive_requested: bool,
    /// When the last full sync succeeded.
    last_full: Option<Instant>,
    /// [`FULL_SYNC_PERIOD`] unless set ([`IptablesProxier::with_full_sync_period`]).
    full_sync_period: Duration,
    /// The Node's podCIDRs of the family (detectLocalMode NodeCIDR).
    pod_cidrs: Vec<ipnet::IpNet>,
    /// Retries of failed saves and restores ([`crate::retry`]'s one policy).
    retry: Backoff,
    rejections: Rejections,
    vips: desired::vip::VipClaims,
    conntrack: Vec<UdpConntrackCleanup>,
    last_payload_bytes: usize,
    chains_written: usize,
    chains_deleted: usize,
    /// Invalid Services in the store with no last-good state: their saved rules are adopted at
    /// the next full sync ([`adopt_saved_rules`]).
    to_adopt: BTreeSet<ServiceName>,
    /// NodePort addresses kept from the saved rules while the Node (its primary IPs) is unknown
    /// ([`IptablesProxier::keep_node_port_jumps`]).
    kept_node_port_ips: BTreeSet<IpAddr>,
}

impl std::fmt::Debug for IptablesProxier {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IptablesProxier")
            .field("family", &self.cfg.family)
            .field("services", &self.services.len())
            .finish_non_exhaustive()
    }
}

impl IptablesProxier {
    /// A proxier for `cfg.family` on node `node_name`, applying through `runner`.
    pub fn new(
        cfg: ProxyConfig,
        rules: RulesConfig,
        node_name: impl Into<String>,
        runner: Box<dyn RestoreRunner + Send>,
    ) -> IptablesProxier {
        IptablesProxier {
            cfg,
            rules,
            node_name: node_name.into(),
            runner,
            services: BTreeMap::new(),
            applied: HashMap::new(),
            applied_once: false,
            dirty: BTreeSet::new(),
            full_requested: true,
            full_for_change: false,
            check_requested: false,
            rederive_requested: false,
            last_full: None,
            full_sync_period: FULL_SYNC_PERIOD,
            pod_cidrs: Vec::new(),
            retry: Backoff::new(RetryPolicy::default()),
            rejections: Rejections::default(),
            vips: desired::vip::VipClaims::default(),
            conntrack: Vec::new(),
            last_payload_bytes: 0,
            chains_written: 0,
            chains_deleted: 0,
            to_adopt: BTreeSet::new(),
            kept_node_port_ips: BTreeSet::new(),
        }
    }

    /// Sets the retry policy (minSyncPeriod to syncPeriod).
    pub fn with_retry(mut self, policy: RetryPolicy) -> IptablesProxier {
        self.retry = Backoff::new(policy);
        self
    }

    /// True when a sync has something to do (a full sync, the check, a re-derive, changes).
    fn work_requested(&self) -> bool {
        self.full_requested
            || self.check_requested
            || self.rederive_requested
            || !self.dirty.is_empty()
    }

    /// Sets how often the periodic full sync comes at most (default [`FULL_SYNC_PERIOD`]).
    pub fn with_full_sync_period(mut self, period: Duration) -> IptablesProxier {
        self.full_sync_period = period;
        self
    }

    /// Consecutive failed syncs (0 when in sync) and when the next retry is due.
    pub fn retry_state(&self) -> (u32, Option<Instant>) {
        (self.retry.failures(), self.retry.due())
    }

    /// The configuration.
    pub fn config(&self) -> &ProxyConfig {
        &self.cfg
    }

    /// Objects currently skipped as invalid.
    pub fn rejections(&self) -> &Rejections {
        &self.rejections
    }

    /// Processes spawned by the runner so far.
    pub fn processes(&self) -> u64 {
        self.runner.processes()
    }

    /// Per-service chains written and deleted by the last restore, and its size in bytes.
    pub fn last_restore(&self) -> (usize, usize, usize) {
        (
            self.chains_written,
            self.chains_deleted,
            self.last_payload_bytes,
        )
    }

    /// Per-service chains currently applied (for tests and `plan`).
    pub fn applied_chains(&self) -> BTreeSet<String> {
        self.applied.keys().cloned().collect()
    }

    /// UDP conntrack cleanups recorded since the last call (the conntrack cleaner's input).
    pub fn take_conntrack_cleanups(&mut self) -> Vec<UdpConntrackCleanup> {
        std::mem::take(&mut self.conntrack)
    }

    /// detectLocalMode NodeCIDR: takes the Node's podCIDRs; true when they changed.
    fn refresh_pod_cidrs(&mut self, store: &Store) -> bool {
        self.rules
            .refresh_pod_cidrs(&mut self.pod_cidrs, store, self.cfg.family)
    }

    /// The mode's configuration for the renderer.
    pub fn mode_config(&self, node: &NodeInfo) -> ProxyModeConfig {
        let mut c = ProxyModeConfig::new(self.cfg.family);
        c.masquerade_bit = self.rules.masquerade_bit;
        c.masquerade_all = self.cfg.masquerade_all;
        c.random_fully = self.rules.random_fully;
        let cidrs: Vec<ipnet::IpNet> = self
            .cfg
            .cluster_cidrs
            .iter()
            .filter(|n| Family::of(&n.addr()) == self.cfg.family)
            .copied()
            .collect();
        c.local_detect = self.rules.local_detect_for(&cidrs, &self.pod_cidrs);
        c.localhost_node_ports = self.cfg.localhost_node_ports();
        c.node_port_ips = if !self.cfg.node_ports_restricted() {
            None
        } else {
            let mut ips = node.node_port_ips(&self.cfg);
            if node.primary_ips.is_empty() {
                ips.extend(self.kept_node_port_ips.iter().copied());
            }
            let lo = IpAddr::V4(std::net::Ipv4Addr::LOCALHOST);
            if c.localhost_node_ports
                && self.cfg.node_port_addresses.iter().any(|n| n.contains(&lo))
            {
                // nodePortAddresses containing 127.0.0.1: lo's address serves NodePorts too
                // (upstream GetNodeIPs keeps it; the address tracker leaves loopback out).
                ips.insert(lo);
            }
            Some(ips.into_iter().collect())
        };
        c
    }

    fn node_info(&self, store: &Store, node_addresses: &BTreeSet<IpAddr>) -> NodeInfo {
        NodeInfo::from_node(&self.node_name, store.node(), node_addresses.clone())
    }

    /// Renders the whole rule set (every chain) for the store as it is, without applying:
    /// the restore payload a full sync writes (without jump repairs). For `plan` and golden
    /// tests.
    pub fn render_full(
        &mut self,
        store: &Store,
        node_addresses: &BTreeSet<IpAddr>,
    ) -> iptables::Result<String> {
        self.refresh_pod_cidrs(store);
        let node = self.node_info(store, node_addresses);
        let mode = self.mode_config(&node);
        let mut names: BTreeSet<ServiceName> = store.service_names().cloned().collect();
        names.extend(self.services.keys().cloned());
        let mut report = empty_report(SyncKind::Full);
        let _ = self.derive(store, &node, &mode, names, &mut report);
        let ports: Vec<&RenderedServicePort> = self.ports().collect();
        let write = self.all_chains();
        proxy_mode::restore_payload(&PayloadInput {
            cfg: &mode,
            ports: &ports,
            write: &write,
            delete: &BTreeSet::new(),
            jump_fixes: &BTreeMap::new(),
        })
    }

    fn ports(&self) -> impl Iterator<Item = &RenderedServicePort> {
        self.services
            .values()
            .flat_map(|v| v.iter().map(|p| &p.rendered))
    }

    fn all_chains(&self) -> BTreeMap<&str, &[String]> {
        let mut m = BTreeMap::new();
        for p in self.ports() {
            for (c, r) in &p.chains {
                m.insert(c.as_str(), r.as_slice());
            }
        }
        m
    }
}

/// What [`IptablesProxier`] remembers of an applied chain: a 64-bit hash of its rule lines.
/// A partial sync rewrites a chain whose fingerprint changed; two different rule lists with
/// the same fingerprint (odds about 2^-64 per comparison) would leave the old rules until the
/// next full sync, which rewrites every chain regardless (at most `syncPeriod`).
fn fingerprint(rules: &[String]) -> u64 {
    use std::hash::{Hash, Hasher};
    let mut h = std::collections::hash_map::DefaultHasher::new();
    rules.hash(&mut h);
    h.finish()
}

fn empty_report(kind: SyncKind) -> SyncReport {
    SyncReport::new(kind)
}

impl Backend for IptablesProxier {
    fn family(&self) -> Family {
        self.cfg.family
    }
    fn note(&mut self, changes: &Changes) {
        self.dirty.extend(changes.dirty.iter().cloned());
        if changes.node_changed {
            self.full_requested = true;
            self.full_for_change = true;
        }
    }
    fn note_node_addresses(&mut self) {
        // NodePort addresses, allow-from-node and the static NodePort jump depend on them; none
        // of that needs a read of the tables (upstream's syncProxyRules takes the node IPs at
        // each sync, partial ones included). A full sync here was a second full restore right
        // after the first at every start (the address tracker's first dump arrives during it):
        // 60 s at 1,000 x 10 in the emulated VM, which the first change waited for.
        self.rederive_requested = true;
    }
    fn request_full(&mut self) {
        self.full_requested = true;
    }
    fn periodic(&mut self) {
        let endpoints = self
            .applied
            .keys()
            .filter(|c| c.starts_with("KUBE-SEP-"))
            .count();
        let due = self
            .last_full
            .is_none_or(|t| t.elapsed() >= self.full_sync_period);
        if due && endpoints <= LARGE_CLUSTER_ENDPOINTS {
            self.full_requested = true;
        } else {
            self.check_requested = true;
        }
    }
    fn pending(&self, now: Instant) -> bool {
        self.work_requested() && self.retry.ready(now)
    }
    /// Changes (the store's, the node's addresses, a Node change's full sync) and the first
    /// sync are paced; the periodic check and periodic full sync (every `syncPeriod`, their own
    /// timer) and a repair's full sync are not, so a change written just after one is not held
    /// for a whole `minSyncPeriod`, as in IPVS mode
    /// ([`crate::ipvs_mode::Proxier::paced_pending`]). Upstream's iptables `syncRunner` paces
    /// every sync, periodic ones too.
    fn paced(&self, now: Instant) -> bool {
        self.pending(now)
            && (!self.applied_once
                || !self.dirty.is_empty()
                || self.rederive_requested
                || (self.full_requested && self.full_for_change))
    }
    fn retry_due(&self) -> Option<Instant> {
        if self.work_requested() {
            self.retry.due()
        } else {
            None
        }
    }
    fn sync(&mut self, store: &Store, node_addresses: &BTreeSet<IpAddr>) -> SyncReport {
        IptablesProxier::sync(self, store, node_addresses)
    }
    fn invalid_objects(&self) -> (usize, u64) {
        (self.rejections.current(), self.rejections.total())
    }
    fn no_local_endpoints(&self) -> (usize, usize) {
        self.services.values().flatten().fold((0, 0), |(i, e), p| {
            (
                i + usize::from(p.no_local.internal),
                e + usize::from(p.no_local.external),
            )
        })
    }
    fn health_checks(&self) -> BTreeMap<ServiceName, HealthCheck> {
        let mut out: BTreeMap<ServiceName, HealthCheck> = BTreeMap::new();
        for (name, ports) in &self.services {
            let mut node_port = None;
            let mut ips: BTreeSet<IpAddr> = BTreeSet::new();
            for p in ports {
                if let Some(np) = p.rules.health_check_node_port {
                    node_port.get_or_insert(np);
                    ips.extend(p.health_ips.iter().copied());
                }
            }
            if let Some(node_port) = node_port {
                out.insert(
                    name.clone(),
                    HealthCheck {
                        node_port,
                        local_endpoints: ips.len(),
                    },
                );
            }
        }
        out
    }
    fn take_rejections(&mut self) -> Vec<(String, String)> {
        self.rejections
            .take_new()
            .into_iter()
            .map(|(k, why)| (k, why.to_string()))
            .collect()
    }
}
