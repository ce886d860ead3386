//! The node's kernel per family and each mode's backend: tool runners with their time limits,
//! iptables backend detection (once per family and process), the IPVS-mode and iptables-mode
//! backends, the IPVS timeouts, and the other mode's cleanup.

use super::*;

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
    fn periodic(&mut self) {
        self.inner.periodic();
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
    fn health_checks(&self) -> BTreeMap<model::ServiceName, desired::HealthCheck> {
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
