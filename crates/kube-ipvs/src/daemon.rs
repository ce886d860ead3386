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

use controller::source::static_dir::{self, StaticDirSource};
use controller::source::{Kind, Object, SourceEvent};
use tokio::sync::mpsc;

use crate::config::{Config, KubeClientConfig, ProxyMode};
use crate::error::{Error, Result};
use crate::health::{IpFamily, ProxyHealth};
use crate::http::{self, Server};
use crate::metrics::Metrics;
use crate::service_health::ServiceHealthServer;

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
                        self.health.updated(IpFamily::V4);
                        self.health.updated(IpFamily::V6);
                        self.metrics.record_sync(0.0);
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
                tracing::debug!(op, namespace = ?s.metadata.namespace, name = ?s.metadata.name, "Service");
            }
            Object::EndpointSlice(s) => {
                self.metrics.endpoint_changes_total.inc();
                tracing::debug!(op, namespace = ?s.metadata.namespace, name = ?s.metadata.name, "EndpointSlice");
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

/// Builds a Kubernetes client: `--kubeconfig` file, else in-cluster / `$KUBECONFIG` inference;
/// `--master` overrides the server URL.
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
    kube::Client::try_from(config).map_err(|e| kerr(&e))
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

/// Runs kube-ipvs until SIGTERM/SIGINT (or, with `--once`, until the first full list).
pub async fn run_daemon(config: Config) -> Result<()> {
    let mode = crate::mode::select(&config, crate::mode::probe_ipvs)?;
    tracing::info!(
        mode = mode.as_str(),
        node = %config.node_name,
        source = config.source_dir.as_ref().map(|d| d.display().to_string()).unwrap_or_else(|| "kubernetes".into()),
        "starting kube-ipvs {}",
        env!("CARGO_PKG_VERSION")
    );
    apply_oom_score_adj(config.oom_score_adj);
    let mut daemon = Daemon::start(config, mode).await?;
    let (tx, mut rx) = mpsc::channel::<SourceEvent>(1024);
    let source = match &daemon.config.source_dir {
        Some(dir) => {
            let src = StaticDirSource::new(dir.clone(), daemon.config.node_name.clone());
            tokio::spawn(async move { src.run(tx).await.map_err(Error::from) })
        }
        None => {
            let client = kube_client(&daemon.config.kube).await?;
            let node = daemon.config.node_name.clone();
            let (health_tx, _health_rx) =
                tokio::sync::watch::channel(controller::source::kube::SourceHealth::default());
            tokio::spawn(async move {
                controller::source::kube::run(client, node, tx, health_tx).await;
                Ok(())
            })
        }
    };
    let mut signal = Box::pin(shutdown_signal());
    let result = loop {
        tokio::select! {
            sig = &mut signal => {
                tracing::info!("{sig}: stopping (IPVS, addresses and rules stay in place)");
                break Ok(());
            }
            ev = rx.recv() => match ev {
                Some(ev) => {
                    daemon.handle_event(&ev);
                    if daemon.config.once && daemon.synced() {
                        tracing::info!("--once: first sync done, exiting");
                        break Ok(());
                    }
                }
                None => break Err(Error::Unsupported("the source stopped".into())),
            }
        }
    };
    drop(rx);
    let source_result = match source.await {
        Ok(r) => r,
        Err(e) => Err(Error::Unsupported(format!("source task failed: {e}"))),
    };
    daemon.stop().await;
    match (result, source_result) {
        (Err(_), Err(source_err)) => Err(source_err),
        (r, _) => r,
    }
}

/// Prints what the node should have. Reads the objects once from `--source-dir`.
pub fn plan(config: &Config, diff: bool, out: &mut dyn Write) -> Result<()> {
    if diff {
        return Err(Error::Unsupported(
            "plan --diff needs the sync engine, which this build does not include".into(),
        ));
    }
    let Some(dir) = &config.source_dir else {
        return Err(Error::Unsupported(
            "plan reads objects from --source-dir DIR (reading from the API server is not available in plan)".into(),
        ));
    };
    let loaded = StaticDirSource::new(dir.clone(), config.node_name.clone()).load()?;
    let snap = &loaded.snapshot;
    writeln!(
        out,
        "# kube-ipvs plan: {} Services, {} EndpointSlices from {} ({} files, {} skipped); node {}{}",
        snap.services.len(),
        snap.endpoint_slices.len(),
        dir.display(),
        snap.files.len(),
        loaded.errors.len(),
        snap.node_name(),
        if snap.node_synthesized { " (synthesized)" } else { "" }
    )?;
    write_objects(snap, out)?;
    Ok(())
}

fn write_objects(snap: &static_dir::Snapshot, out: &mut dyn Write) -> Result<()> {
    for s in &snap.services {
        let spec = s.spec.clone().unwrap_or_default();
        let ports: Vec<String> = spec
            .ports
            .unwrap_or_default()
            .iter()
            .map(|p| {
                let node_port = p.node_port.map(|n| format!(":{n}")).unwrap_or_default();
                format!(
                    "{}/{}{node_port}",
                    p.port,
                    p.protocol.as_deref().unwrap_or("TCP")
                )
            })
            .collect();
        writeln!(
            out,
            "service {}/{} type={} clusterIPs={} ports={}",
            s.metadata.namespace.as_deref().unwrap_or_default(),
            s.metadata.name.as_deref().unwrap_or_default(),
            spec.type_.as_deref().unwrap_or("ClusterIP"),
            spec.cluster_ips
                .or(spec.cluster_ip.map(|c| vec![c]))
                .unwrap_or_default()
                .join(","),
            ports.join(",")
        )?;
    }
    for e in &snap.endpoint_slices {
        let addrs: Vec<String> = e
            .endpoints
            .iter()
            .flat_map(|ep| ep.addresses.clone())
            .collect();
        writeln!(
            out,
            "endpointslice {}/{} service={} addresses={}",
            e.metadata.namespace.as_deref().unwrap_or_default(),
            e.metadata.name.as_deref().unwrap_or_default(),
            e.metadata
                .labels
                .as_ref()
                .and_then(|l| l.get("kubernetes.io/service-name"))
                .map(String::as_str)
                .unwrap_or("-"),
            addrs.join(",")
        )?;
    }
    Ok(())
}

/// `--cleanup`: removes what kube-ipvs owns. Needs the appliers, which this build does not wire.
pub async fn cleanup(_config: &Config) -> Result<()> {
    Err(Error::Unsupported(
        "--cleanup needs the appliers, which this build does not wire yet".into(),
    ))
}
