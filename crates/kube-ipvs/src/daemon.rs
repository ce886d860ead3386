//! The daemon and the one-shot commands: the seams where the sync engine plugs in.
//!
//! - [`run_daemon`]: selects the mode, starts `/healthz` + `/livez` and `/metrics`, runs the
//!   source (static directory or API server) and hands every event to [`Daemon::handle_event`].
//!   `--once` returns after the first full list; SIGTERM/SIGINT stop the source and the servers
//!   and return `Ok` (the kernel state is left in place).
//! - [`plan`]: reads the objects once and prints them.
//! - [`cleanup`]: removes what kube-ipvs programmed (`--cleanup`).

use std::io::Write;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::sync::Arc;
use std::time::Duration;

use ::watch::static_dir::StaticDirSource;
use model::event::{Kind, Object, SourceEvent};
use tokio::sync::mpsc;

use crate::config::{Config, KubeClientConfig, ProxyMode};
use crate::error::{Error, Result};
use crate::health::ProxyHealth;
use crate::http::{self, Server};
use crate::metrics::Metrics;
use crate::service_health::ServiceHealthServer;

/// Longest wait for this node's Node object before the first sync (upstream kube-proxy waits
/// about as long for its Node at startup); see `proxier::sync_loop::NodeGate`.
const NODE_WAIT: std::time::Duration = std::time::Duration::from_secs(30);

/// Everything the running daemon shares.
#[derive(Debug)]
pub struct Daemon {
    /// The configuration.
    pub config: Config,
    /// The mode in use.
    pub mode: ProxyMode,
    /// Metrics.
    pub metrics: Arc<Metrics>,
    /// Proxy health (`/healthz`, `/livez`).
    pub health: Arc<ProxyHealth>,
    /// Health-check node ports.
    pub service_health: Arc<ServiceHealthServer>,
    /// The HTTP servers that started.
    pub servers: Vec<Server>,
    /// Kinds whose first list has completed.
    listed: Vec<Kind>,
}

impl Daemon {
    /// Creates the shared state and starts the healthz and metrics servers. A server that cannot
    /// bind is an error with `bindAddressHardFail`, else it is logged and skipped.
    pub async fn start(config: Config, mode: ProxyMode) -> Result<Self> {
        let metrics = Arc::new(Metrics::new());
        metrics.set_proxy_mode(mode);
        let health = Arc::new(ProxyHealth::new(
            config.sync_period(mode) * 2,
            Some(metrics.clone()),
        ));
        let listen_ips = if config.bind_address.is_ipv6() {
            vec![IpAddr::V6(Ipv6Addr::UNSPECIFIED)]
        } else {
            vec![IpAddr::V4(Ipv4Addr::UNSPECIFIED)]
        };
        let service_health = Arc::new(ServiceHealthServer::new(
            listen_ips,
            health.clone(),
            Some(metrics.clone()),
        ));
        let mut servers = Vec::new();
        let wanted = [
            (
                "healthz",
                config.healthz_bind_address,
                crate::health::router(health.clone()),
            ),
            (
                "metrics",
                config.metrics_bind_address,
                crate::metrics::router(metrics.clone()),
            ),
        ];
        for (what, addr, router) in wanted {
            match http::serve(what, addr, router).await {
                Ok(s) => servers.push(s),
                Err(e) if config.bind_address_hard_fail => {
                    for s in servers {
                        s.stop().await;
                    }
                    return Err(e);
                }
                Err(e) => tracing::error!("{e} (continuing; set bindAddressHardFail to exit)"),
            }
        }
        Ok(Self {
            config,
            mode,
            metrics,
            health,
            service_health,
            servers,
            listed: Vec::new(),
        })
    }

    /// The bound address of a server (`healthz` or `metrics`).
    pub fn server_addr(&self, what: &str) -> Option<std::net::SocketAddr> {
        self.servers.iter().find(|s| s.what == what).map(|s| s.addr)
    }

    /// True once Node, Service and EndpointSlice have each been listed once.
    pub fn synced(&self) -> bool {
        [Kind::Node, Kind::Service, Kind::EndpointSlice]
            .iter()
            .all(|k| self.listed.contains(k))
    }

    /// Takes one source event: counts it, tracks node eligibility, and logs it.
    pub fn handle_event(&mut self, ev: &SourceEvent) {
        let object = match ev {
            SourceEvent::Init(kind) => {
                tracing::debug!(?kind, "list started");
                None
            }
            SourceEvent::InitDone(kind) => {
                tracing::debug!(?kind, "list complete");
                if !self.listed.contains(kind) {
                    self.listed.push(*kind);
                    if self.synced() {
                        tracing::info!("Services, EndpointSlices and the Node are listed");
                    }
                }
                None
            }
            SourceEvent::InitApply(o) | SourceEvent::Apply(o) => Some((o, "apply")),
            SourceEvent::Delete(o) => Some((o, "delete")),
        };
        let Some((object, op)) = object else { return };
        match object {
            Object::Service(s) => {
                self.metrics.service_changes_total.inc();
                tracing::debug!(op, namespace = %s.name.namespace, name = %s.name.name, "Service");
            }
            Object::EndpointSlice(s) => {
                self.metrics.endpoint_changes_total.inc();
                tracing::debug!(op, namespace = %s.namespace, name = %s.name, "EndpointSlice");
            }
            Object::Node(n) => {
                if op == "apply" {
                    self.health.sync_node(n);
                }
                tracing::debug!(op, name = ?n.metadata.name, "Node");
            }
        }
    }

    /// Stops the HTTP servers and health-check node ports.
    pub async fn stop(self) {
        self.service_health.shutdown().await;
        for s in self.servers {
            s.stop().await;
        }
    }
}

/// Time limit of connecting to the API server (TCP and TLS): kube-rs's default, and the
/// dialer timeout client-go (upstream kube-proxy's client) uses.
pub const KUBE_CONNECT_TIMEOUT: Duration = Duration::from_secs(30);

/// Time limit of writing one request to the API server (kube-rs's default is 295 s; a request
/// is a few kilobytes, so a write that stalls this long is a dead connection).
pub const KUBE_WRITE_TIMEOUT: Duration = Duration::from_secs(30);

/// Longest time without any byte from the API server on a connection with a request in flight
/// (counted from the request's write: `reset_reader_on_write`, as kube-rs recommends with a
/// read timeout).
///
/// It must exceed the server-side watch timeout (kube-runtime's default 290 s, which
/// kube-ipvs keeps): a quiet watch legitimately sends nothing until the server closes it, and
/// kube-runtime's own watch idle timeout (290 s + 5 s) must fire first, so a watch reconnects
/// cleanly. So 300 s: it is the backstop for everything else (the initial lists, Event posts)
/// against an API server that accepted a request and never answers it.
pub const KUBE_READ_TIMEOUT: Duration = Duration::from_secs(300);

/// Builds a Kubernetes client: `--kubeconfig` file, else in-cluster / `$KUBECONFIG` inference;
/// `--master` overrides the server URL. Connections get the configured connect, write and read
/// timeouts (by default [`KUBE_CONNECT_TIMEOUT`], [`KUBE_WRITE_TIMEOUT`], [`KUBE_READ_TIMEOUT`]).
pub async fn kube_client(cfg: &KubeClientConfig) -> Result<kube::Client> {
    let kerr = |e: &dyn std::fmt::Display| Error::Kube(e.to_string());
    let mut config = match (&cfg.kubeconfig, &cfg.master) {
        (Some(path), _) => {
            let kc = kube::config::Kubeconfig::read_from(path).map_err(|e| kerr(&e))?;
            kube::Config::from_custom_kubeconfig(kc, &kube::config::KubeConfigOptions::default())
                .await
                .map_err(|e| kerr(&e))?
        }
        (None, Some(master)) => kube::Config::new(master.parse().map_err(|e| kerr(&e))?),
        (None, None) => kube::Config::infer().await.map_err(|e| kerr(&e))?,
    };
    if let Some(master) = &cfg.master {
        config.cluster_url = master
            .parse()
            .map_err(|e| Error::Kube(format!("--master {master:?}: {e}")))?;
    }
    config.connect_timeout = Some(cfg.connect_timeout);
    config.write_timeout = Some(cfg.write_timeout);
    config.read_timeout = Some(cfg.read_timeout);
    config.reset_reader_on_write = true;
    if config.cluster_url.scheme_str() == Some("http") && config.root_cert.is_none() {
        // Plain HTTP never uses TLS: an empty root set keeps the client from loading the
        // system trust store, which minimal images (and the test VM) do not have.
        config.root_cert = Some(Vec::new());
    }
    // clientConnection.qps/burst, like client-go's token bucket (see `client_limit`).
    let builder = kube::client::ClientBuilder::try_from(config).map_err(|e| kerr(&e))?;
    Ok(builder
        .with_layer(&crate::client_limit::QpsLayer::new(cfg.qps, cfg.burst))
        .build())
}

async fn shutdown_signal() -> &'static str {
    use tokio::signal::unix::{signal, SignalKind};
    let term = signal(SignalKind::terminate());
    let int = signal(SignalKind::interrupt());
    match (term, int) {
        (Ok(mut term), Ok(mut int)) => tokio::select! {
            _ = term.recv() => "SIGTERM",
            _ = int.recv() => "SIGINT",
        },
        _ => {
            // Without signal handlers, wait for Ctrl-C the portable way.
            let _ = tokio::signal::ctrl_c().await;
            "SIGINT"
        }
    }
}

/// Writes `/proc/self/oom_score_adj` like upstream (a failure, e.g. without
/// CAP_SYS_RESOURCE, is only logged).
pub fn apply_oom_score_adj(value: i32) {
    match std::fs::write("/proc/self/oom_score_adj", value.to_string()) {
        Ok(()) => tracing::debug!(value, "set oom_score_adj"),
        Err(e) => tracing::warn!(value, "cannot set oom_score_adj: {e}"),
    }
}

/// The node's interface addresses (not kube-ipvs0's), from one rtnetlink dump via the tracker.
async fn node_address_tracker() -> Option<netif::NodeAddresses> {
    match netif::NodeAddresses::start().await {
        Ok(t) => Some(t),
        Err(e) => {
            tracing::warn!(error = %e, "cannot track node addresses; NodePorts use the Node's addresses");
            None
        }
    }
}

/// How long a watch error keeps the source failing without a newer one. kube-runtime's default
/// backoff retries at most every 30 s plus up to as much jitter, so an unreachable API server
/// produces a newer error within this; a watch that reconnects silently (no change to report)
/// stops producing errors and counts as recovered after it.
pub const SOURCE_ERROR_FRESH: std::time::Duration = std::time::Duration::from_secs(65);

/// Feeds the API source's health (watch errors) into `/healthz` and the source's age metric: the
/// source is failing from its first watch error while errors keep coming (each within
/// [`SOURCE_ERROR_FRESH`] of the last) or a kind has never been listed; a successful event of
/// every failing kind (a relist, a change) ends it at once.
pub async fn forward_source_health(
    mut rx: tokio::sync::watch::Receiver<::watch::kube::SourceHealth>,
    health: Arc<ProxyHealth>,
    metrics: Arc<Metrics>,
) {
    let mut failing = false;
    loop {
        let (errors, last_error, synced) = {
            let h = rx.borrow_and_update();
            let kinds = [&h.services, &h.endpoint_slices, &h.node];
            let failing_kind = |k: &::watch::kube::KindHealth| {
                k.consecutive_errors > 0
                    && (!k.synced
                        || k.last_error
                            .as_ref()
                            .is_some_and(|(at, _)| at.elapsed() < SOURCE_ERROR_FRESH))
            };
            let errors = kinds.iter().any(|k| failing_kind(k));
            let last_error = kinds
                .iter()
                .filter(|k| failing_kind(k))
                .filter_map(|k| k.last_error.clone())
                .max_by_key(|(at, _)| *at)
                .map(|(_, e)| e)
                .unwrap_or_default();
            (errors, last_error, h.synced())
        };
        if errors {
            if !failing {
                tracing::warn!(error = %last_error, "API source failing; serving the last known state");
            }
            failing = true;
            health.source_failing_at(std::time::SystemTime::now(), &last_error);
            metrics.set_source_ok(false);
        } else {
            if failing {
                tracing::info!("API source healthy again");
            }
            failing = false;
            health.source_ok();
            metrics.set_source_ok(synced);
        }
        // Re-evaluated on every change, and every few seconds (errors age out).
        tokio::select! {
            changed = rx.changed() => {
                if changed.is_err() {
                    return;
                }
            }
            () = tokio::time::sleep(std::time::Duration::from_secs(5)) => {}
        }
    }
}

/// Runs kube-ipvs until SIGTERM/SIGINT (or, with `--once`, until the first sync is done).
///
/// In IPVS mode the health and metrics servers start first, then the IPVS probe runs until it
/// decides (see [`crate::probe::select_mode`]: transient failures are retried with backoff while
/// `/healthz` answers 503; nothing is removed meanwhile). The other mode's leftovers are removed
/// only after this mode's first successful sync (see [`crate::handover`]).
pub async fn run_daemon(config: Config) -> Result<()> {
    let prober = match config.mode {
        ProxyMode::Ipvs => Some(crate::probe::Prober::from_env(&config.ipvs.scheduler)?),
        ProxyMode::Iptables => None,
    };
    tracing::info!(
        mode = config.mode.as_str(),
        node = %config.node_name,
        source = config.source_dir.as_ref().map(|d| d.display().to_string()).unwrap_or_else(|| "kubernetes".into()),
        "starting kube-ipvs {}",
        env!("CARGO_PKG_VERSION")
    );
    // The configuration as started with: a later change of the file restarts the daemon.
    let config_bytes = config
        .config_file
        .as_ref()
        .and_then(|f| std::fs::read(f).ok());
    let restart = crate::config_watch::restart_requested(config.config_file.clone(), config_bytes);
    apply_oom_score_adj(config.oom_score_adj);
    // kube-proxy's conntrack settings, in both modes, before anything is programmed: a value
    // that must change and cannot stops the start like upstream.
    let conntrack_warning =
        tokio::task::block_in_place(|| crate::engine::apply_conntrack(&config))?;
    let requested = config.mode;
    let mut daemon = Daemon::start(config, requested).await?;
    let mut signal = Box::pin(shutdown_signal());
    let mut fallback_reason = None;
    if let Some(prober) = prober {
        let selected = crate::probe::select_mode(
            &daemon.config,
            prober,
            &daemon.health,
            &daemon.metrics,
            &mut signal,
        )
        .await;
        match selected {
            Ok(crate::probe::Selected::Mode(mode, reason)) => {
                fallback_reason = reason;
                if mode != daemon.mode {
                    // The servers restart with the mode's health window and metrics.
                    let config = daemon.config.clone();
                    daemon.stop().await;
                    daemon = Daemon::start(config, mode).await?;
                    if let Some(e) = &fallback_reason {
                        daemon.metrics.record_probe_failure(e.kind());
                    }
                }
            }
            Ok(crate::probe::Selected::Stopped) => {
                daemon.stop().await;
                return Ok(());
            }
            Err(e) => {
                daemon.stop().await;
                return Err(e);
            }
        }
    }
    let mode = daemon.mode;
    tracing::info!(mode = mode.as_str(), "proxy mode selected");
    let config = daemon.config.clone();
    let rt = tokio::runtime::Handle::current();

    // The node, its families, and the other mode's leftovers (removed after the first
    // successful sync of this mode, never before: see crate::handover).
    let tracker = node_address_tracker().await;
    let node_ips = tracker
        .as_ref()
        .map(|t| t.current().node_ips())
        .unwrap_or_default();
    let families = crate::engine::families(&config, &node_ips);
    let first_sync = crate::handover::FirstSync::new(&families);
    daemon.metrics.init_families(&families);
    let handover = crate::handover::spawn_cleanup(
        config.clone(),
        families.clone(),
        mode,
        netif::Netif::new().await.ok(),
        first_sync.clone(),
    );

    // One backend per family.
    let mut backends = Vec::new();
    if mode == ProxyMode::Ipvs {
        tokio::task::block_in_place(|| {
            crate::engine::apply_sysctls(&config.sysctl_root, config.ipvs.strict_arp);
            crate::engine::set_ipvs_timeouts(&config);
        });
    }
    for &family in &families {
        let backend = match mode {
            ProxyMode::Ipvs => crate::engine::ipvs_backend(&config, family).await,
            ProxyMode::Iptables => crate::engine::iptables_backend(&config, family),
        };
        match backend {
            Ok(b) => backends.push(b),
            Err(e) => {
                daemon.stop().await;
                return Err(e);
            }
        }
    }
    // The Kubernetes client (none with --source-dir): the source, and Events for invalid objects.
    let client = match &config.source_dir {
        Some(_) => None,
        None => Some(kube_client(&config.kube).await?),
    };
    if let (Some(c), Some(reason)) = (&client, &fallback_reason) {
        // Loud, in three places: the log (probe::select_mode), the metric, and an Event on the Node.
        tokio::spawn(crate::events::publish_node_event(
            c.clone(),
            config.node_name.clone(),
            "IPVSUnavailable",
            "SelectProxyMode",
            format!("kube-ipvs runs in iptables mode: {reason}"),
        ));
    }
    if let (Some(note), Some(c)) = (conntrack_warning, &client) {
        // Upstream's reason for the same case, so existing alerts keep matching.
        tokio::spawn(crate::events::publish_node_event(
            c.clone(),
            config.node_name.clone(),
            "readOnlySysFS",
            "SetConntrackLimits",
            note,
        ));
    }
    // Events for invalid objects: deduplicated, rate limited, through a bounded queue.
    let (rejections_tx, rejections_rx) =
        crate::events::EventSink::new(Some(daemon.metrics.clone()));
    let publisher = client.clone().map(|c| {
        tokio::spawn(crate::events::publish_events(
            c,
            config.node_name.clone(),
            rejections_rx,
            Some(daemon.metrics.clone()),
        ))
    });
    let observer = crate::engine::Observer {
        metrics: daemon.metrics.clone(),
        health: daemon.health.clone(),
        service_health: daemon.service_health.clone(),
        rt: rt.clone(),
        rejections: publisher.as_ref().map(|_| rejections_tx),
        reported: std::sync::Mutex::default(),
        seen: std::sync::Mutex::default(),
        first_sync: Some(first_sync),
    };
    let engine = crate::engine::Engine::start(
        backends,
        node_ips,
        proxier::sync_loop::LoopConfig {
            min_sync_period: config.min_sync_period(mode),
            sync_period: config.sync_period(mode),
            once: config.once,
            node_wait: NODE_WAIT,
        },
        observer,
    );
    let forwarder = tracker
        .as_ref()
        .map(|t| crate::engine::forward_node_addresses(t, engine.sender()));

    let (tx, mut rx) = mpsc::channel::<SourceEvent>(1024);
    let mut source_health_task = None;
    let source = match (&config.source_dir, client) {
        (None, None) => return Err(Error::Unsupported("no source".into())),
        (Some(dir), _) => {
            let src = StaticDirSource::new(dir.clone(), config.node_name.clone());
            tokio::spawn(async move { src.run(tx).await.map_err(Error::from) })
        }
        (None, Some(client)) => {
            let node = config.node_name.clone();
            let (health_tx, health_rx) =
                tokio::sync::watch::channel(::watch::kube::SourceHealth::default());
            source_health_task = Some(tokio::spawn(forward_source_health(
                health_rx,
                daemon.health.clone(),
                daemon.metrics.clone(),
            )));
            tokio::spawn(async move {
                ::watch::kube::run(client, node, tx, health_tx).await;
                Ok(())
            })
        }
    };
    let mut tick = tokio::time::interval(std::time::Duration::from_millis(50));
    let mut restart = Box::pin(restart);
    let result = loop {
        tokio::select! {
            sig = &mut signal => {
                tracing::info!("{sig}: stopping (IPVS, addresses and rules stay in place)");
                break Ok(());
            }
            why = &mut restart => {
                tracing::info!(
                    reason = %why,
                    "restart requested: stopping with exit 0 so the DaemonSet starts kube-ipvs \
                     with the new configuration (IPVS, addresses and rules stay in place)"
                );
                break Ok(());
            }
            _ = tick.tick() => {
                if engine.finished() {
                    break Ok(());
                }
            }
            ev = rx.recv() => match ev {
                Some(ev) => {
                    daemon.handle_event(&ev);
                    if !engine.send(ev).await {
                        break Ok(());
                    }
                }
                None => break Err(Error::Unsupported("the source stopped".into())),
            }
        }
    };
    drop(rx);
    source.abort();
    if let Some(t) = source_health_task {
        t.abort();
    }
    if let Some(p) = publisher {
        p.abort();
    }
    if let Some(f) = forwarder {
        f.abort();
    }
    let exit = tokio::task::block_in_place(|| engine.stop());
    handover.finish().await;
    daemon.stop().await;
    result?;
    match exit {
        proxier::sync_loop::Exit::Once { ok: false } => Err(Error::Engine(
            "--once: the sync had errors (see the log)".into(),
        )),
        _ => Ok(()),
    }
}

/// Reads every object once: from `--source-dir`, or a full list from the API server.
async fn load_store(config: &Config) -> Result<model::store::Store> {
    let mut store = model::store::Store::new();
    match &config.source_dir {
        Some(dir) => {
            let loaded = StaticDirSource::new(dir.clone(), config.node_name.clone()).load()?;
            for e in &loaded.errors {
                tracing::warn!("{e}");
            }
            for ev in loaded.snapshot.events() {
                store.apply(ev);
            }
        }
        None => {
            let client = kube_client(&config.kube).await?;
            let (tx, mut rx) = mpsc::channel::<SourceEvent>(1024);
            let (health_tx, _health_rx) =
                tokio::sync::watch::channel(::watch::kube::SourceHealth::default());
            let node = config.node_name.clone();
            let task = tokio::spawn(async move {
                ::watch::kube::run(client, node, tx, health_tx).await;
            });
            let mut node_listed = false;
            while let Some(ev) = rx.recv().await {
                if ev == SourceEvent::InitDone(Kind::Node) {
                    node_listed = true;
                }
                store.apply(ev);
                if store.synced() && node_listed {
                    break;
                }
            }
            task.abort();
        }
    }
    Ok(store)
}

/// Prints what the node should have (`plan`), or what a sync would change (`plan --diff`).
pub async fn plan(
    config: &Config,
    diff: bool,
    section: Option<&str>,
    out: &mut dyn Write,
) -> Result<()> {
    use proxier::plan::Section;
    let section: Option<Section> = match section {
        Some(s) => Some(s.parse().map_err(Error::Unsupported)?),
        None => None,
    };
    let store = load_store(config).await?;
    let tracker = node_address_tracker().await;
    let node_ips = tracker
        .as_ref()
        .map(|t| t.current().node_ips())
        .unwrap_or_default();
    let families = crate::engine::families(config, &node_ips);
    if config.mode == ProxyMode::Iptables {
        if diff {
            return Err(Error::Unsupported(
                "plan --diff compares IPVS-mode state with the kernel; in iptables mode use \
                 plan --section iptables"
                    .into(),
            ));
        }
        let mut plans = Vec::new();
        for &family in &families {
            plans.push(proxier::plan::iptables_mode_plan(
                crate::engine::proxy_config(config, family),
                crate::engine::rules_config(config, true),
                &config.node_name,
                &store,
                &node_ips,
            )?);
        }
        out.write_all(proxier::plan::render(&plans, section).as_bytes())?;
        return Ok(());
    }
    if diff {
        let mut writes = Vec::new();
        for &family in &families {
            let mut backend = crate::engine::ipvs_kernel(config, family).await?;
            let mut p = proxier::ipvs_mode::Proxier::new(
                crate::engine::proxy_config(config, family),
                crate::engine::rules_config(config, true),
                config.node_name.clone(),
            );
            let w = tokio::task::block_in_place(|| {
                let mut dry = proxier::plan::DryRun::new(&mut backend);
                let report = p.sync(&store, &node_ips, &mut dry);
                for e in &report.errors {
                    tracing::warn!("{e}");
                }
                dry.writes
            });
            writes.extend(w);
        }
        for w in writes {
            writeln!(out, "{w}")?;
        }
        return Ok(());
    }
    let mut plans = Vec::new();
    for &family in &families {
        let mut p = proxier::ipvs_mode::Proxier::new(
            crate::engine::proxy_config(config, family),
            crate::engine::rules_config(config, true),
            config.node_name.clone(),
        );
        plans.push(p.plan(&store, &node_ips)?);
        let (bad, _) = (p.rejections().current(), ());
        if bad > 0 {
            tracing::warn!(
                objects = bad,
                "some objects were skipped as invalid (see above)"
            );
        }
    }
    out.write_all(proxier::plan::render(&plans, section).as_bytes())?;
    Ok(())
}

/// `--cleanup`: removes what kube-ipvs programmed in either mode (IPVS services it owns,
/// kube-ipvs0, its chains and ipsets). Idempotent.
pub async fn cleanup(config: &Config) -> Result<()> {
    let tracker = node_address_tracker().await;
    let node_ips = tracker
        .as_ref()
        .map(|t| t.current().node_ips())
        .unwrap_or_default();
    let mut families = crate::engine::families(config, &node_ips);
    if !families.contains(&ipvs_netlink::Family::Inet6) {
        families.push(ipvs_netlink::Family::Inet6);
    }
    let netif_handle = netif::Netif::new().await.ok();
    let rt = tokio::runtime::Handle::current();
    let done = tokio::task::block_in_place(|| {
        crate::engine::cleanup(config, &families, None, netif_handle.as_ref(), &rt)
    });
    for d in done {
        tracing::info!("cleanup: {d}");
    }
    Ok(())
}
