//! The daemon and the one-shot commands: the seams where the sync engine plugs in.
//!
//! - [`run_daemon`]: selects the mode, starts `/healthz` + `/livez` and `/metrics`, runs the
//!   source (static directory or API server) and hands every event to [`Daemon::handle_event`].
//!   `--once` returns after the first full list; SIGTERM/SIGINT stop the source and the servers
//!   and return `Ok` (the kernel state is left in place).
//! - [`plan`]: reads the objects once and prints them.
//! - [`cleanup`]: removes what kube-ipvs programmed (`--cleanup`).
//!
//! `client` builds the API client and feeds the source's health; `host` holds the process's
//! signals, OOM score and node-address tracker; `commands` the one-shot commands.

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

mod client;
mod commands;
mod host;

pub use client::*;
pub use commands::*;
pub use host::*;

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
