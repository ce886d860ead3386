//! The sync engine's wiring: one backend (proxier + kernel) per address family,
//! sysctls, the node-address tracker, and the sync-loop thread that the daemon feeds.

use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;
use std::path::Path;
use std::sync::Arc;

use ipvs_netlink::{Family, Op};
use proxier::desired::HealthCheck;
use proxier::ipvs_mode::{DrainConfig, Proxier, RulesConfig, SyncReport};
use proxier::model::{ProxyConfig, ServiceName};
use proxier::retry::{RetryPolicy, Subsystem};
use proxier::source::SourceEvent;
use proxier::store::{Changes, Store};
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

/// Sets the sysctls IPVS mode needs under `root` (normally `/proc/sys`). Failures are logged:
/// the proxy still works without most of them.
///
/// The kernel version that decides `conn_reuse_mode` is the running kernel's, read from this
/// process's own `/proc/sys/kernel/osrelease` (the host kernel's in a container), not from under
/// `root`: the DaemonSet mounts only the host's `/proc/sys/net` there. Upstream reads the same
/// file (`utilkernel.GetVersion` in pkg/util/kernel, `/proc/sys/kernel/osrelease`), called from
/// the IPVS proxier's `NewProxier` for the conn_reuse_mode decision.
pub fn apply_sysctls(root: &Path, strict_arp: bool) {
    let kernel = match sysctl::running_kernel_version() {
        Ok(k) => {
            tracing::info!(
                kernel = %format!("{}.{}.{}", k.0, k.1, k.2),
                "kernel version for the IPVS sysctls (conn_reuse_mode)"
            );
            k
        }
        Err(e) => {
            tracing::warn!(error = %e, "cannot read the kernel version; conn_reuse_mode left alone");
            (9999, 0, 0)
        }
    };
    let desired = sysctl::desired_sysctls(kernel, strict_arp);
    if let Err(e) = sysctl::apply_sysctls(root, &desired) {
        tracing::error!(error = %e, "sysctls");
    }
}

/// kube-proxy's `conntrack.*` settings in the kernel's units. Durations count in whole seconds
/// (like upstream); one under a second leaves the kernel's value instead of writing 0.
pub fn conntrack_settings(config: &Config) -> sysctl::ConntrackSettings {
    let c = &config.conntrack;
    sysctl::ConntrackSettings {
        max_per_core: c.max_per_core,
        min: c.min,
        tcp_established_timeout: c.tcp_established_timeout.as_secs(),
        tcp_close_wait_timeout: c.tcp_close_wait_timeout.as_secs(),
        tcp_be_liberal: c.tcp_be_liberal,
        udp_timeout: c.udp_timeout.as_secs(),
        udp_stream_timeout: c.udp_stream_timeout.as_secs(),
    }
}

/// Applies the `conntrack.*` settings at startup, in either mode, like kube-proxy: a value that
/// must change and cannot is an error (kube-proxy exits too). Sysfs mounted read-only when the
/// hash size must grow is only a warning; its text is returned for a Node Event.
pub fn apply_conntrack(config: &Config) -> Result<Option<String>, crate::Error> {
    let settings = conntrack_settings(config);
    let cpus = sysctl::cpu_count(&config.sysfs_root);
    match sysctl::apply_conntrack(&config.sysctl_root, &config.sysfs_root, &settings, cpus) {
        Ok(report) => {
            tracing::debug!(
                nf_conntrack_max = report.max,
                cpus = report.cpus,
                changed = report.changes.len(),
                "conntrack settings applied"
            );
            Ok(report.read_only_sysfs.map(|f| {
                format!(
                    "/sys is read-only: cannot raise the conntrack hash size for nf_conntrack_max {} ({f}); \
                     the limit applies, with longer hash chains",
                    report.max
                )
            }))
        }
        Err(e) => Err(crate::Error::Conntrack(e.to_string())),
    }
}

/// How `ipset` is run: `--ipset-timeout` per process.
fn ipset_runner(config: &Config) -> ipset::Runner {
    ipset::Runner::new().with_timeout(config.ipset_timeout)
}

/// How iptables programs are run: `--iptables-timeout` per process.
fn iptables_runner(config: &Config) -> iptables::Runner {
    iptables::Runner::new().with_timeout(config.iptables_timeout)
}

/// The iptables backend detected per family in this process: detection spawns up to seven
/// processes (three `*-save` per backend and `--version`), and the backend does not change while
/// kube-ipvs runs, so the IPVS/iptables backend and the handover cleanup share one detection.
fn detected() -> &'static std::sync::Mutex<BTreeMap<ipset::Family, iptables::Backend>> {
    static DETECTED: std::sync::OnceLock<
        std::sync::Mutex<BTreeMap<ipset::Family, iptables::Backend>>,
    > = std::sync::OnceLock::new();
    DETECTED.get_or_init(Default::default)
}

/// An iptables applier for `family`: detected once per family and process, then reused.
fn detect_iptables(config: &Config, family: ipset::Family) -> iptables::Result<iptables::Iptables> {
    let known = detected()
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .get(&family)
        .copied();
    if let Some(backend) = known {
        return Ok(iptables::Iptables::new(
            backend,
            family,
            iptables_runner(config),
        ));
    }
    let tables = iptables::Iptables::detect(family, iptables_runner(config))?;
    detected()
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .insert(family, tables.backend());
    Ok(tables)
}

/// Opens the node's kernel for one family in IPVS mode: IPVS, kube-ipvs0, ipset and iptables.
/// Returns it with whether iptables supports `--random-fully`.
pub async fn ipvs_kernel_parts(
    config: &Config,
    family: Family,
) -> crate::error::Result<(proxier::kernel::NodeKernel, bool)> {
    let ipvs = ipvs_netlink::Client::new().map_err(Error::Ipvs)?;
    let netif = netif::Netif::new().await.map_err(Error::Netif)?;
    let ipset = ipset::Ipset::new(ipset_runner(config));
    ipset.version().map_err(Error::IpsetTool)?;
    let mut tables =
        detect_iptables(config, family).map_err(|source| Error::Iptables { family, source })?;
    let random_fully = tables.supports_random_fully().unwrap_or(false);
    tracing::info!(family = ?family, backend = ?tables.backend(), random_fully, "iptables");
    let kernel = proxier::kernel::NodeKernel::new(
        ipvs,
        netif,
        ipset,
        tables,
        tokio::runtime::Handle::current(),
    );
    Ok((kernel, random_fully))
}

/// The node's kernel for one family (for `plan --diff`).
pub async fn ipvs_kernel(
    config: &Config,
    family: Family,
) -> crate::error::Result<proxier::kernel::NodeKernel> {
    Ok(ipvs_kernel_parts(config, family).await?.0)
}

/// Builds the IPVS-mode backend of one family.
pub async fn ipvs_backend(
    config: &Config,
    family: Family,
) -> crate::error::Result<Box<dyn Backend + Send>> {
    let (kernel, random_fully) = ipvs_kernel_parts(config, family).await?;
    let proxier = Proxier::new(
        proxy_config(config, family),
        rules_config(config, random_fully),
        config.node_name.clone(),
    )
    .with_drain(DrainConfig {
        cap: config.drain_timeout,
        ..DrainConfig::default()
    })
    .with_retry(retry_policy(config, ProxyMode::Ipvs));
    Ok(Box::new(FamilyProxier {
        proxier,
        kernel: Box::new(kernel),
    }))
}

/// The one retry policy of every subsystem: backoff from minSyncPeriod to syncPeriod.
pub fn retry_policy(config: &Config, mode: ProxyMode) -> RetryPolicy {
    RetryPolicy::new(config.min_sync_period(mode), config.sync_period(mode))
}

/// Sets the IPVS connection timeouts (`ipvsadm --set`) when any is configured.
pub fn set_ipvs_timeouts(config: &Config) {
    let t = ipvs_netlink::Timeouts {
        tcp: config.ipvs.tcp_timeout.as_secs() as u32,
        tcp_fin: config.ipvs.tcp_fin_timeout.as_secs() as u32,
        udp: config.ipvs.udp_timeout.as_secs() as u32,
    };
    if t.tcp == 0 && t.tcp_fin == 0 && t.udp == 0 {
        return;
    }
    match ipvs_netlink::Client::new() {
        Ok(mut c) => {
            for r in c.apply(&[Op::SetTimeouts(t)]) {
                if let Err(e) = r {
                    tracing::error!(error = %e, "setting IPVS timeouts");
                }
            }
        }
        Err(e) => tracing::error!(error = %e, "setting IPVS timeouts"),
    }
}

/// Feeds metrics, health and health-check node ports from the sync loop.
pub struct Observer {
    /// Metrics.
    pub metrics: Arc<Metrics>,
    /// `/healthz` state.
    pub health: Arc<ProxyHealth>,
    /// Health-check node ports.
    pub service_health: Arc<ServiceHealthServer>,
    /// Runtime for the listener updates.
    pub rt: tokio::runtime::Handle,
    /// Where newly rejected objects go to become Kubernetes Events, deduplicated and rate
    /// limited (None: log + metric only, e.g. with `--source-dir`).
    pub rejections: Option<crate::events::EventSink>,
    /// `(key, reason)` already reported, so dual-stack nodes report a rejection once.
    pub reported: std::sync::Mutex<std::collections::HashSet<(String, String)>>,
    /// What each family's last sync reported, for the node-wide values that sum or merge them.
    pub seen: std::sync::Mutex<BTreeMap<Family, FamilySeen>>,
    /// Told about every sync, so the other mode's leftovers go only after this mode's first
    /// successful sync (see [`crate::handover`]).
    pub first_sync: Option<Arc<crate::handover::FirstSync>>,
}

/// One family's last reported values (see [`Observer::seen`]).
#[derive(Debug, Default)]
pub struct FamilySeen {
    /// Drain totals already counted: (drained, cap) (the proxier keeps running totals).
    drained: (u64, u64),
    /// Ports without local endpoints: (internal, external).
    no_local: (usize, usize),
    /// Health-check node ports: a node port is served while either family wants it (a
    /// single-stack Service on a dual-stack node is in one family only).
    health: BTreeMap<ServiceName, HealthCheck>,
    /// External VIP claims lost to another Service.
    vip_conflicts: usize,
    /// IPVS requests already counted (the kernel keeps running totals per command).
    ipvs_requests: ipvs_netlink::OpCounts,
    /// IPVS virtual servers and real servers programmed.
    ipvs_programmed: (usize, usize),
}

/// An object skipped as invalid, to be reported as a Kubernetes Event.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rejection {
    /// `Service` or `EndpointSlice`.
    pub kind: String,
    /// Namespace.
    pub namespace: String,
    /// Name.
    pub name: String,
    /// Why it was skipped (the model's reason).
    pub reason: String,
}

impl Rejection {
    /// The Event reporting this rejection (`InvalidObject`, action `Skip`; the note is
    /// sanitized by the sink). A VIP conflict is reported as `VIPConflict`.
    pub fn event(&self) -> crate::events::EventRequest {
        let (api_version, kind) = match self.kind.as_str() {
            "EndpointSlice" => ("discovery.k8s.io/v1", "EndpointSlice"),
            _ => ("v1", "Service"),
        };
        let conflict = self.reason.starts_with(proxier::vip::CONFLICT_PREFIX);
        crate::events::EventRequest {
            regarding: crate::events::Regarding {
                api_version,
                kind,
                namespace: Some(self.namespace.clone()),
                name: self.name.clone(),
            },
            reason: if conflict {
                "VIPConflict"
            } else {
                "InvalidObject"
            },
            action: "Skip",
            note: format!("kube-ipvs skipped this object: {}", self.reason),
        }
    }

    /// Splits a rejection key (`service ns/name`, `endpointslice ns/name`) and a reason.
    pub fn from_key(key: &str, reason: &str) -> Option<Rejection> {
        let (kind, rest) = key.split_once(' ')?;
        let kind = match kind {
            "service" | "vip" => "Service",
            "endpointslice" => "EndpointSlice",
            _ => return None,
        };
        let (namespace, name) = rest.split_once('/')?;
        Some(Rejection {
            kind: kind.to_string(),
            namespace: namespace.to_string(),
            name: name.to_string(),
            reason: reason.to_string(),
        })
    }
}

/// The fixed set of `reason` labels of `kube_ipvs_invalid_objects_total`: the model's reasons
/// with their values removed (see [`reason_label`]). Anything else is `other`, so user text can
/// never create a new series.
pub const INVALID_REASON_LABELS: &[&str] = &[
    "affinity_timeout_out_of_range",
    "clusterips",
    "duplicate_endpoint_port",
    "duplicate_nodeport",
    "duplicate_port",
    "duplicate_port_name",
    "endpoint_address_does_not_match_addresstype",
    "endpoint_port_out_of_range",
    "endpoint_with_addresses",
    "healthchecknodeport_out_of_range",
    "invalid_clusterip",
    "invalid_endpoint_address",
    "invalid_externalip",
    "invalid_loadbalancer_ingress_ip",
    "invalid_loadbalancersourcerange",
    "nodeport_out_of_range",
    "port_out_of_range",
    "ports",
    "service_port_would_exceed_endpoints",
    "service_without_a_name",
    "too_many_endpoints",
    "too_many_external_and_loadbalancer_ips",
    "too_many_loadbalancersourceranges",
    "too_many_ports",
    "unknown_addresstype",
    "unknown_externaltrafficpolicy",
    "unknown_internaltrafficpolicy",
    "unknown_protocol",
    "unknown_scheduler_in_annotation",
    "unknown_service_type",
    "unknown_sessionaffinity",
    "vip_conflict",
    "other",
];

/// A bounded-cardinality metric label for a rejection reason: its words without values
/// (quoted strings, numbers, addresses), e.g. `port 70000 out of range 1..65535` →
/// `port_out_of_range`, `invalid clusterIP "1.2.3"` → `invalid_clusterip`,
/// `10000 endpoints (max 1000)` → `too_many_endpoints`; always one of
/// [`INVALID_REASON_LABELS`] (`other` for anything unknown, e.g. a quoted value with spaces).
pub fn reason_label(reason: &str) -> &'static str {
    if reason.starts_with(proxier::vip::CONFLICT_PREFIX) {
        return "vip_conflict";
    }
    let words: Vec<String> = reason
        .split_whitespace()
        .take_while(|w| !w.starts_with('('))
        .filter(|w| !w.contains('"') && !w.chars().any(|c| c.is_ascii_digit()))
        .map(|w| {
            w.chars()
                .filter(|c| c.is_ascii_alphanumeric())
                .collect::<String>()
                .to_ascii_lowercase()
        })
        .filter(|w| !w.is_empty())
        .take(6)
        .collect();
    let mut label = words.join("_");
    if reason.contains("(max ") {
        label = format!("too_many_{label}");
    }
    if label.starts_with("unknown_scheduler_in_annotation") {
        return "unknown_scheduler_in_annotation";
    }
    INVALID_REASON_LABELS
        .iter()
        .find(|l| **l == label)
        .copied()
        .unwrap_or("other")
}

impl std::fmt::Debug for Observer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Observer").finish_non_exhaustive()
    }
}

impl SyncObserver for Observer {
    fn queued(&self, changes: &Changes) {
        if !changes.dirty.is_empty() || changes.node_changed {
            self.metrics.record_queued(Family::Inet);
            self.metrics.record_queued(Family::Inet6);
            self.health.queued_update(Family::Inet);
            self.health.queued_update(Family::Inet6);
        }
    }

    fn pending(&self, services: usize, endpoints: usize) {
        self.metrics.service_changes_pending.set(services as i64);
        self.metrics.endpoint_changes_pending.set(endpoints as i64);
    }

    fn synced(&self, family: Family, report: &SyncReport, backend: &dyn Backend) {
        if let Some(first) = &self.first_sync {
            first.record(family, report.healthy());
        }
        // Labels come from the report's fixed subsystem set, never from error text.
        for (subsystem, f) in &report.failed {
            let label = crate::metrics::SubsystemLabel {
                subsystem: subsystem.as_str().to_string(),
            };
            self.metrics
                .sync_errors_total
                .get_or_create(&label)
                .inc_by(f.count as u64);
            self.metrics.sync_failures_total.get_or_create(&label).inc();
        }
        let mut failing = report.retrying.clone();
        failing.extend(report.failed.keys().copied());
        self.metrics.record_sync_outcome(
            family,
            report.kind,
            report.duration.as_secs_f64(),
            &failing,
        );
        if report.healthy() {
            self.health.updated(family);
        } else {
            // A failed sync is not an update: /healthz turns 503 if this lasts for the
            // health timeout, naming the subsystems.
            let failed: Vec<(&'static str, String)> = report
                .failed
                .iter()
                .map(|(s, f)| (s.as_str(), f.last_error.clone()))
                .collect();
            let retrying: Vec<&'static str> = failing.iter().map(|s| s.as_str()).collect();
            self.health
                .sync_failed_at(family, &failed, &retrying, std::time::SystemTime::now());
        }
        for (subsystem, n) in &report.drift {
            self.metrics
                .drift_repairs_total
                .get_or_create(&crate::metrics::SubsystemLabel {
                    subsystem: (*subsystem).to_string(),
                })
                .inc_by(*n as u64);
        }
        if report.iptables_restore_failed {
            self.metrics
                .iptables_restore_failures_total
                .get_or_create(&crate::metrics::IpFamilyLabel::of(family))
                .inc();
        }
        self.metrics
            .draining_destinations
            .set(backend.draining() as i64);
        self.metrics.record_conntrack(
            family,
            report.conntrack_duration.map(|d| d.as_secs_f64()),
            report.conntrack_deleted,
        );
        // The values are plain counters and maps: a panic elsewhere cannot leave them torn.
        let mut seen = self.seen.lock().unwrap_or_else(|p| p.into_inner());
        let this = seen.entry(family).or_default();
        // Every IPVS request of this family's kernel since the last sync (the sync's reads and
        // writes, and the drain checks' reads), by command.
        let requests = backend.ipvs_requests();
        for (op, now) in requests.iter() {
            let was = this.ipvs_requests.get(op);
            if now > was {
                self.metrics.record_ipvs_requests(op, now - was);
            }
        }
        this.ipvs_requests = requests;
        this.ipvs_programmed = backend.ipvs_programmed();
        let (services, destinations) = seen.values().fold((0, 0), |(s, d), f| {
            (s + f.ipvs_programmed.0, d + f.ipvs_programmed.1)
        });
        self.metrics
            .ipvs_services
            .set(i64::try_from(services).unwrap_or(i64::MAX));
        self.metrics
            .ipvs_destinations
            .set(i64::try_from(destinations).unwrap_or(i64::MAX));
        let this = seen.entry(family).or_default();
        let (drained, cap) = backend.drained();
        let before = std::mem::replace(&mut this.drained, (drained, cap));
        for (reason, now, was) in [("drained", drained, before.0), ("cap", cap, before.1)] {
            if now > was {
                self.metrics
                    .drained_destinations_total
                    .get_or_create(&crate::metrics::ReasonLabel {
                        reason: reason.to_string(),
                    })
                    .inc_by(now - was);
            }
        }
        this.no_local = backend.no_local_endpoints();
        this.health = backend.health_checks();
        this.vip_conflicts = report.vip_conflicts;
        let conflicts: usize = seen.values().map(|f| f.vip_conflicts).sum();
        self.metrics
            .vip_conflicts
            .set(i64::try_from(conflicts).unwrap_or(i64::MAX));
        for (f, v) in seen.iter() {
            self.metrics
                .set_no_local_endpoints(*f, v.no_local.0, v.no_local.1);
        }
        let mut merged: BTreeMap<ServiceName, HealthCheck> = BTreeMap::new();
        for (name, hc) in seen.values().flat_map(|f| &f.health) {
            merged
                .entry(name.clone())
                .and_modify(|h| *h = h.merge(*hc))
                .or_insert(*hc);
        }
        drop(seen);
        let wanted: BTreeMap<u16, HealthCheckService> = merged
            .into_iter()
            .map(|(name, hc)| {
                (
                    hc.node_port,
                    HealthCheckService {
                        service: NamespacedName::new(&*name.namespace, &*name.name),
                        local_endpoints: hc.local_endpoints,
                    },
                )
            })
            .collect();
        self.metrics
            .health_check_node_ports
            .set(wanted.len() as i64);
        let sh = self.service_health.clone();
        self.rt.spawn(async move {
            for e in sh.sync_services(&wanted).await {
                tracing::warn!(error = %e, "health-check node port");
            }
        });
    }

    fn network_programmed(&self, family: Family, triggers: &[std::time::SystemTime]) {
        self.metrics.record_network_programmed(family, triggers);
    }

    fn rejected(&self, _family: Family, rejected: &[(String, String)]) {
        let mut reported = match self.reported.lock() {
            Ok(g) => g,
            Err(p) => p.into_inner(),
        };
        for (key, reason) in rejected {
            // Both families see the same objects; report each (object, reason) once. The set
            // is bounded: past 10,000 entries it starts over (a repeat is reported again).
            if reported.len() >= 10_000 {
                reported.clear();
            }
            if !reported.insert((key.clone(), reason.clone())) {
                continue;
            }
            let Some(r) = Rejection::from_key(key, reason) else {
                continue;
            };
            self.metrics
                .invalid_objects_total
                .get_or_create(&crate::metrics::InvalidObjectLabels {
                    kind: r.kind.clone(),
                    reason: reason_label(reason).to_string(),
                })
                .inc();
            if let Some(sink) = &self.rejections {
                sink.submit(r.event());
            }
        }
    }
}

/// Longest time publishing one Event may take (the API call, its retries included) before it
/// is given up and logged: an API server that does not answer must not hold up the Events
/// after it, nor (for the Node Event) the start of the proxy.
pub const EVENT_PUBLISH_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(10);

/// Why an Event was not published.
#[derive(Debug, thiserror::Error)]
pub enum PublishError {
    /// The API server refused it or could not be reached.
    #[error(transparent)]
    Api(#[from] kube::Error),
    /// No answer within [`EVENT_PUBLISH_TIMEOUT`].
    #[error("no answer from the API server within {0:?}")]
    Timeout(std::time::Duration),
}

/// Publishes `ev` regarding `reference`, for at most `limit`.
pub async fn publish_bounded(
    recorder: &kube::runtime::events::Recorder,
    ev: &kube::runtime::events::Event,
    reference: &k8s_openapi::api::core::v1::ObjectReference,
    limit: std::time::Duration,
) -> Result<(), PublishError> {
    match tokio::time::timeout(limit, recorder.publish(ev, reference)).await {
        Ok(r) => Ok(r?),
        Err(_) => Err(PublishError::Timeout(limit)),
    }
}

/// Publishes one Warning Event regarding this node's Node object (e.g. the IPVS fallback).
pub async fn publish_node_event(
    client: kube::Client,
    node_name: String,
    reason: &'static str,
    action: &'static str,
    note: String,
) {
    use kube::runtime::events::{Event, EventType, Recorder, Reporter};
    let recorder = Recorder::new(
        client,
        Reporter {
            controller: "kube-ipvs".into(),
            instance: Some(node_name.clone()),
        },
    );
    let reference = k8s_openapi::api::core::v1::ObjectReference {
        api_version: Some("v1".into()),
        kind: Some("Node".into()),
        name: Some(node_name),
        ..Default::default()
    };
    let ev = Event {
        type_: EventType::Warning,
        reason: reason.into(),
        note: Some(crate::events::sanitize(
            &note,
            crate::events::NOTE_MAX_BYTES,
        )),
        action: action.into(),
        secondary: None,
    };
    if let Err(e) = publish_bounded(&recorder, &ev, &reference, EVENT_PUBLISH_TIMEOUT).await {
        tracing::warn!(error = %e, reason, "could not emit an Event on the Node");
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

/// The iptables-mode backend of one family, with UDP conntrack cleanup after each sync.
pub struct IptablesBackend {
    inner: proxier::iptables_mode::IptablesProxier,
    conntrack: Option<conntrack::Conntrack>,
    /// Filters of failed cleanups, retried with backoff (bounded by the services' VIPs).
    conntrack_pending: Vec<conntrack::ConntrackFilter>,
    conntrack_retry: proxier::retry::Backoff,
}

impl std::fmt::Debug for IptablesBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IptablesBackend").finish_non_exhaustive()
    }
}

/// Builds the iptables-mode backend of one family.
pub fn iptables_backend(
    config: &Config,
    family: Family,
) -> crate::error::Result<Box<dyn Backend + Send>> {
    let mut tables =
        detect_iptables(config, family).map_err(|source| Error::Iptables { family, source })?;
    let random_fully = tables.supports_random_fully().unwrap_or(false);
    tracing::info!(family = ?family, backend = ?tables.backend(), random_fully, "iptables");
    if proxy_config(config, family).localhost_node_ports() {
        crate::localhost::enable_route_localnet(&config.sysctl_root)?;
    }
    let policy = retry_policy(config, ProxyMode::Iptables);
    let inner = proxier::iptables_mode::IptablesProxier::new(
        proxy_config(config, family),
        rules_config(config, random_fully),
        config.node_name.clone(),
        Box::new(tables),
    )
    .with_retry(policy);
    Ok(Box::new(IptablesBackend {
        inner,
        conntrack: None,
        conntrack_pending: Vec::new(),
        conntrack_retry: proxier::retry::Backoff::new(policy),
    }))
}

impl IptablesBackend {
    fn cleanup_conntrack(&mut self, node_addresses: &BTreeSet<IpAddr>, report: &mut SyncReport) {
        use conntrack::{ConntrackFilter, Protocol as Ct};
        let family = self.inner.family();
        let mut filters = Vec::new();
        for c in self.inner.take_conntrack_cleanups() {
            let mut targets: Vec<(IpAddr, u16)> = c.vips.clone();
            if let Some(np) = c.node_port {
                targets.extend(
                    node_addresses
                        .iter()
                        .filter(|a| Family::of(a) == family)
                        .map(|a| (*a, np)),
                );
            }
            for (ip, port) in targets {
                filters.push(match c.endpoint {
                    Some(ep) => ConntrackFilter::endpoint_removed(Ct::Udp, ip, port, ep),
                    None => ConntrackFilter::unanswered(Ct::Udp, ip, port),
                });
            }
        }
        // Earlier failed cleanups go again with this one once their backoff has passed.
        let now = std::time::Instant::now();
        if !self.conntrack_pending.is_empty() && self.conntrack_retry.ready(now) {
            filters.append(&mut self.conntrack_pending);
        }
        if filters.is_empty() {
            if !self.conntrack_pending.is_empty() {
                report.retrying.insert(Subsystem::Conntrack);
            }
            return;
        }
        let mut seen = std::collections::HashSet::new();
        filters.retain(|f| seen.insert(*f));
        let started = std::time::Instant::now();
        let result = match &mut self.conntrack {
            Some(ct) => ct.delete(&filters),
            None => match conntrack::Conntrack::new() {
                Ok(ct) => self.conntrack.insert(ct).delete(&filters),
                Err(e) => Err(e),
            },
        };
        report.conntrack_duration = Some(started.elapsed());
        match result {
            Ok(r) => {
                report.conntrack_deleted += r.deleted;
                if self.conntrack_pending.is_empty() {
                    self.conntrack_retry.succeeded();
                }
            }
            Err(e) => {
                let delay = self.conntrack_retry.failed(now);
                tracing::warn!(error = %e, filters = filters.len(),
                    retry_in_ms = delay.as_millis() as u64,
                    "conntrack cleanup failed; keeping the filters and retrying with backoff");
                report.fail(Subsystem::Conntrack, format!("conntrack: {e}"));
                self.conntrack_pending.extend(filters);
            }
        }
        if !self.conntrack_pending.is_empty() {
            report.retrying.insert(Subsystem::Conntrack);
        }
    }
}

impl Backend for IptablesBackend {
    fn family(&self) -> Family {
        self.inner.family()
    }
    fn note(&mut self, changes: &Changes) {
        self.inner.note(changes);
    }
    fn note_node_addresses(&mut self) {
        self.inner.note_node_addresses();
    }
    fn request_full(&mut self) {
        self.inner.request_full();
    }
    fn pending(&self, now: std::time::Instant) -> bool {
        self.inner.pending(now)
            || (!self.conntrack_pending.is_empty() && self.conntrack_retry.ready(now))
    }
    fn retry_due(&self) -> Option<std::time::Instant> {
        let ct = if self.conntrack_pending.is_empty() {
            None
        } else {
            self.conntrack_retry.due()
        };
        self.inner.retry_due().into_iter().chain(ct).min()
    }
    fn sync(&mut self, store: &Store, node_addresses: &BTreeSet<IpAddr>) -> SyncReport {
        let mut report = self.inner.sync(store, node_addresses);
        self.cleanup_conntrack(node_addresses, &mut report);
        report
    }
    fn invalid_objects(&self) -> (usize, u64) {
        self.inner.invalid_objects()
    }
    fn take_rejections(&mut self) -> Vec<(String, String)> {
        self.inner.take_rejections()
    }
    fn health_checks(
        &self,
    ) -> BTreeMap<proxier::model::ServiceName, proxier::desired::HealthCheck> {
        self.inner.health_checks()
    }
}

/// Removes what the other mode left behind before `mode` starts (and, with `everything`, what
/// either mode programmed: `--cleanup`). Must run outside the async context (blocking calls).
pub fn cleanup(
    config: &Config,
    families: &[Family],
    mode: Option<ProxyMode>,
    netif: Option<&netif::Netif>,
    rt: &tokio::runtime::Handle,
) -> Vec<String> {
    let mut done = Vec::new();
    let mut ipvs = ipvs_netlink::Client::new().ok();
    for &family in families {
        let mut tables = match detect_iptables(config, family) {
            Ok(t) => t,
            Err(e) => {
                tracing::warn!(family = ?family, error = %e, "cleanup: iptables unavailable");
                continue;
            }
        };
        if mode != Some(ProxyMode::Iptables) {
            // iptables-mode chains (a handover keeps the chains both modes share).
            match proxier::iptables_mode::cleanup_iptables_mode(&mut tables, mode.is_some()) {
                Ok(r) => done.push(format!("{family:?} iptables mode: {r:?}")),
                Err(e) => tracing::warn!(error = %e, "cleanup of iptables-mode chains"),
            }
        }
        if mode != Some(ProxyMode::Ipvs) {
            let ipset = ipset::Ipset::new(ipset_runner(config));
            let link = if family == families[0] {
                netif.map(|n| (n, rt))
            } else {
                None
            };
            match proxier::iptables_mode::cleanup_ipvs_mode_leftovers(
                &proxy_config(config, family),
                &mut tables,
                &ipset,
                link,
                ipvs.as_mut(),
            ) {
                Ok(r) => done.push(format!("{family:?} IPVS mode: {r:?}")),
                Err(e) => tracing::warn!(error = %e, "cleanup of IPVS-mode state"),
            }
        }
    }
    done
}
