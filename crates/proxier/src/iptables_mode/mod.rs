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
//! - **Full sync** (first sync, after a failure, node changes, every `syncPeriod`): every chain is
//!   written; one `iptables-save` per table finds stale per-service chains (left by a previous
//!   run) and missing or duplicate jumps from the built-in chains, repaired in the same restore.
//! - **UDP conntrack**: each sync records which UDP flows became stale
//!   ([`UdpConntrackCleanup`]); the conntrack cleaner shared with IPVS mode consumes them with
//!   [`IptablesProxier::take_conntrack_cleanups`].
//! - **Mode handover**: [`cleanup_ipvs_mode_leftovers`] (start of iptables mode) and
//!   [`cleanup_iptables_mode`] (start of IPVS mode, or `--cleanup`) remove the other mode's
//!   state; both are idempotent and report what they removed.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::net::IpAddr;
use std::time::Instant;

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
mod sync;

pub use cleanup::{cleanup_iptables_mode, cleanup_ipvs_mode_leftovers, CleanupReport};
/// Runs `iptables-save` / `iptables-restore` for the proxier (the real [`Iptables`] applier, or
/// a recorder in tests).
pub trait RestoreRunner {
    /// `iptables-save -t TABLE`.
    fn save(&mut self, table: Table) -> Result<String, KernelError>;
    /// One `iptables-restore --noflush` with a payload that may hold several tables.
    fn restore(&mut self, payload: &str) -> Result<(), KernelError>;
    /// Processes spawned so far.
    fn processes(&self) -> u64;
}

impl RestoreRunner for Iptables {
    fn save(&mut self, table: Table) -> Result<String, KernelError> {
        Ok(Iptables::save(self, table)?)
    }
    fn restore(&mut self, payload: &str) -> Result<(), KernelError> {
        Ok(self.apply_restore(Table::Nat, payload)?)
    }
    fn processes(&self) -> u64 {
        self.processes_spawned()
    }
}

/// A [`RestoreRunner`] that records payloads and answers saves with fixed text (for tests and
/// `plan`-style rendering).
#[derive(Debug, Default, Clone)]
pub struct RecordingRunner {
    /// Every restore payload, in order.
    pub restores: Vec<String>,
    /// What `save` returns, per table (empty when unset).
    pub saved: BTreeMap<Table, String>,
    /// Saves run.
    pub saves: u64,
    /// Fail the next restore with this message.
    pub fail_next: Option<String>,
}

impl RestoreRunner for RecordingRunner {
    fn save(&mut self, table: Table) -> Result<String, KernelError> {
        self.saves += 1;
        Ok(self.saved.get(&table).cloned().unwrap_or_default())
    }
    fn restore(&mut self, payload: &str) -> Result<(), KernelError> {
        self.restores.push(payload.to_string());
        match self.fail_next.take() {
            Some(m) => Err(KernelError::Injected(m)),
            None => Ok(()),
        }
    }
    fn processes(&self) -> u64 {
        self.saves + self.restores.len() as u64
    }
}

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
    /// Per-service chains as last applied.
    applied: HashMap<String, Vec<String>>,
    applied_once: bool,
    dirty: BTreeSet<ServiceName>,
    full_requested: bool,
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

/// `namespace/name:port`, or `namespace/name` for an unnamed port (upstream's
/// `ServicePortName.String()`, used in comments and chain hashes).
pub fn service_port_string(sp: &ServicePort) -> String {
    if sp.name.port_name.is_empty() {
        format!("{}/{}", sp.name.namespace, sp.name.name)
    } else {
        format!(
            "{}/{}:{}",
            sp.name.namespace, sp.name.name, sp.name.port_name
        )
    }
}

fn ep_rules(eps: &[Endpoint]) -> Vec<EndpointRule> {
    eps.iter()
        .map(|e| EndpointRule {
            ip: e.ip,
            port: e.port,
        })
        .collect()
}

/// The iptables-mode input of one service port, with what its derivation decided besides the
/// rules.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DerivedPort {
    /// The rules' input.
    pub rules: ServicePortRules,
    /// Local traffic policies that leave the port without endpoints.
    pub no_local: NoLocalEndpoints,
    /// The local ready endpoints a health-check node port counts.
    pub health_ips: Vec<IpAddr>,
}

/// The iptables-mode inputs of a Service's ports, and the EndpointSlices skipped as invalid
/// (slice name, reason).
pub type PortRules = (Vec<DerivedPort>, Vec<(String, Invalid)>);

/// The iptables-mode input of every port of one Service (`Ok(vec![])` when the proxy does not
/// handle it), with the EndpointSlices skipped as invalid.
pub fn service_port_rules(
    svc: &model::objects::Svc,
    slices: &[&model::objects::Slice],
    cfg: &ProxyConfig,
    node: &NodeInfo,
) -> Result<PortRules, Invalid> {
    let ports = service_ports(svc, cfg)?;
    let node_ips: Vec<IpAddr> = node.ips_of(cfg.family).collect();
    let mut out = Vec::with_capacity(ports.len());
    let mut rejected = Vec::new();
    for sp in &ports {
        let merged = endpoints(slices, sp, &node.name);
        for r in merged.rejected {
            if !rejected.contains(&r) {
                rejected.push(r);
            }
        }
        // Cluster-wide and local selections, before traffic policies pick between them.
        let mut both = sp.clone();
        both.internal_local = false;
        both.external_local = false;
        let sel = select_endpoints(&both, &merged.endpoints, &node.name, node.zone.as_deref());
        let no_local = NoLocalEndpoints::of(
            sp.internal_local,
            sp.external_local,
            sp.externally_accessible(),
            !sel.cluster.is_empty(),
            !sel.local.is_empty(),
        );
        let rules = ServicePortRules {
            name: service_port_string(sp),
            protocol: sp.name.protocol,
            cluster_ip: sp.cluster_ip,
            port: sp.port,
            node_port: sp.node_port,
            external_ips: sp.external_ips.clone(),
            load_balancer_ips: sp.load_balancer_ips.clone(),
            source_ranges: sp.source_ranges.clone(),
            firewall: sp.firewall,
            allow_from_node: sp
                .source_ranges
                .iter()
                .any(|n| node_ips.iter().any(|ip| n.contains(ip))),
            external_local: sp.external_local,
            internal_local: sp.internal_local,
            affinity_timeout: sp.affinity_timeout,
            health_check_node_port: sp.health_check_node_port,
            cluster_endpoints: ep_rules(&sel.cluster),
            local_endpoints: ep_rules(&sel.local),
        };
        out.push(DerivedPort {
            rules,
            no_local,
            health_ips: sel.health_check_ips().collect(),
        });
    }
    Ok((out, rejected))
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

    /// Derives and renders `names`; returns the services whose state changed (old value).
    fn derive(
        &mut self,
        store: &Store,
        node: &NodeInfo,
        mode: &ProxyModeConfig,
        names: BTreeSet<ServiceName>,
        report: &mut SyncReport,
    ) -> BTreeMap<ServiceName, Option<Vec<PortState>>> {
        let mut changed = BTreeMap::new();
        // Services whose external VIP claims change hands are derived too (see `desired::vip`).
        let names = self.vips.update(store, &self.cfg, names);
        report.vip_conflicts = self.vips.conflicts();
        for name in names {
            report.services_derived += 1;
            let key = format!("service {name}");
            let vip_key = format!("vip {name}");
            let new = match store.service(&name) {
                None => {
                    self.rejections.clear(&key);
                    self.to_adopt.remove(&name);
                    self.rejections.clear(&vip_key);
                    self.rejections.clear_owned(&key);
                    None
                }
                Some(svc) => {
                    let slices = store.slices_of(&name);
                    let lost = self.vips.lost(&name);
                    match service_port_rules(svc, &slices, &self.cfg, node) {
                        Ok((mut ports, rejected)) => {
                            // Claims another Service wins are not rendered.
                            for p in ports.iter_mut().map(|d| &mut d.rules) {
                                let won = |ip: &IpAddr| {
                                    !lost.contains_key(&desired::vip::Vip {
                                        ip: *ip,
                                        port: p.port,
                                        protocol: p.protocol,
                                    })
                                };
                                let (ext, lb): (Vec<IpAddr>, Vec<IpAddr>) = (
                                    p.external_ips.iter().copied().filter(won).collect(),
                                    p.load_balancer_ips.iter().copied().filter(won).collect(),
                                );
                                p.external_ips = ext;
                                p.load_balancer_ips = lb;
                            }
                            match desired::vip::conflict_reason(&lost) {
                                Some(why) => {
                                    self.rejections.reject(&vip_key, &why);
                                }
                                None => self.rejections.clear(&vip_key),
                            }
                            let rejected: Vec<(String, Invalid)> = rejected
                                .iter()
                                .map(|(slice, why)| {
                                    (
                                        format!("endpointslice {}/{slice}", name.namespace),
                                        why.clone(),
                                    )
                                })
                                .collect();
                            // Slices fixed or deleted since the last derivation are cleared.
                            self.rejections.replace_owned(&key, &rejected);
                            let mut states = Vec::with_capacity(ports.len());
                            let mut bad = None;
                            for p in ports {
                                match proxy_mode::render_service_port(mode, &p.rules) {
                                    Ok(r) => states.push(PortState {
                                        rules: p.rules,
                                        rendered: r,
                                        no_local: p.no_local,
                                        health_ips: p.health_ips,
                                    }),
                                    Err(e) => bad = Some(Invalid::new(e.to_string())),
                                }
                            }
                            match bad {
                                Some(why) => {
                                    self.rejections.reject(&key, &why);
                                    if !self.services.contains_key(&name) {
                                        self.to_adopt.insert(name);
                                    }
                                    continue;
                                }
                                None => {
                                    self.rejections.clear(&key);
                                    self.to_adopt.remove(&name);
                                    if states.is_empty() {
                                        None
                                    } else {
                                        Some(states)
                                    }
                                }
                            }
                        }
                        Err(why) => {
                            // The last good state stays applied; with none (a restart), the
                            // saved rules are adopted at a full sync.
                            self.rejections.reject(&key, &why);
                            if !self.services.contains_key(&name) {
                                self.to_adopt.insert(name);
                            }
                            continue;
                        }
                    }
                }
            };
            let old = match new {
                Some(states) => self.services.insert(name.clone(), states),
                None => self.services.remove(&name),
            };
            changed.insert(name, old);
        }
        changed
    }

    fn record_conntrack(&mut self, name: &ServiceName, old: Option<&Vec<PortState>>) {
        let new = self.services.get(name);
        let udp = |v: Option<&Vec<PortState>>| -> Vec<ServicePortRules> {
            v.into_iter()
                .flatten()
                .filter(|p| p.rules.protocol == ipset::Protocol::Udp)
                .map(|p| p.rules.clone())
                .collect()
        };
        let olds = udp(old);
        let news = udp(new);
        let all_eps = |r: &ServicePortRules| -> BTreeSet<IpAddr> {
            r.cluster_endpoints
                .iter()
                .chain(r.local_endpoints.iter())
                .map(|e| e.ip)
                .collect()
        };
        let vips = |r: &ServicePortRules| -> Vec<(IpAddr, u16)> {
            std::iter::once(r.cluster_ip)
                .chain(r.external_ips.iter().copied())
                .chain(r.load_balancer_ips.iter().copied())
                .map(|ip| (ip, r.port))
                .collect()
        };
        for o in &olds {
            let now = news.iter().find(|n| n.name == o.name);
            let still: BTreeSet<IpAddr> = now.map(all_eps).unwrap_or_default();
            for ip in all_eps(o).difference(&still) {
                self.conntrack.push(UdpConntrackCleanup {
                    service_port: o.name.clone(),
                    vips: vips(o),
                    node_port: o.node_port,
                    endpoint: Some(*ip),
                });
            }
        }
        for n in &news {
            let before = olds
                .iter()
                .find(|o| o.name == n.name)
                .map(|o| !o.cluster_endpoints.is_empty())
                .unwrap_or(false);
            if !before && !n.cluster_endpoints.is_empty() {
                self.conntrack.push(UdpConntrackCleanup {
                    service_port: n.name.clone(),
                    vips: vips(n),
                    node_port: n.node_port,
                    endpoint: None,
                });
            }
        }
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

    fn all_chains(&self) -> BTreeMap<String, Vec<String>> {
        let mut m = BTreeMap::new();
        for p in self.ports() {
            for (c, r) in &p.chains {
                m.insert(c.clone(), r.clone());
            }
        }
        m
    }
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
        }
    }
    fn note_node_addresses(&mut self) {
        // NodePort addresses, allow-from-node and the static NodePort jump depend on them.
        self.full_requested = true;
    }
    fn request_full(&mut self) {
        self.full_requested = true;
    }
    fn pending(&self, now: Instant) -> bool {
        (self.full_requested || !self.dirty.is_empty()) && self.retry.ready(now)
    }
    fn retry_due(&self) -> Option<Instant> {
        if self.full_requested || !self.dirty.is_empty() {
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
