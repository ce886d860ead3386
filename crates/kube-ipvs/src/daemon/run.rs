//! [`run_daemon`], step by step: start in the selected mode, build one backend per family,
//! connect the events and the sync engine, run the source, serve until a signal, stop.

use std::future::Future;
use std::pin::Pin;

use ::watch::static_dir::StaticDirSource;
use model::event::SourceEvent;
use proxier::sync_loop::Backend;
use tokio::sync::mpsc;
use tokio::task::JoinHandle;

use super::{forward_source_health, kube_client, shutdown_signal};
use super::{Daemon, NODE_WAIT};
use crate::config::{Config, ProxyMode};
use crate::error::{Error, Result};
use crate::probe::ProbeError;

/// The source's task (it ends only on an error).
type SourceTask = JoinHandle<Result<()>>;

/// The shutdown signal, pinned so every step can wait on it.
type Signal = Pin<Box<dyn Future<Output = &'static str>>>;

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
    super::apply_oom_score_adj(config.oom_score_adj);
    // kube-proxy's conntrack settings, in both modes, before anything is programmed: a value
    // that must change and cannot stops the start like upstream.
    let conntrack_warning =
        tokio::task::block_in_place(|| crate::engine::apply_conntrack(&config))?;
    let mut signal: Signal = Box::pin(shutdown_signal());
    let Some((mut daemon, fallback_reason)) =
        start_in_selected_mode(config, prober, &mut signal).await?
    else {
        return Ok(());
    };
    let mode = daemon.mode;
    tracing::info!(mode = mode.as_str(), "proxy mode selected");
    let config = daemon.config.clone();

    // Never fails: without a first dump the addresses are unknown (the loop then uses the
    // Node object's) and the tracker keeps trying with backoff.
    let tracker = netif::NodeAddresses::spawn().await;
    let node_ips = tracker.current().node_ips();
    // The Kubernetes client (none with --source-dir): the source, and Events for invalid objects.
    let client = match &config.source_dir {
        Some(_) => None,
        None => Some(kube_client(&config.kube).await?),
    };
    let node = match &client {
        Some(c) => super::read_node_facts(c, &config.node_name).await,
        None => crate::engine::NodeFacts::default(),
    };

    // The families: the primary one must work (an error otherwise, like upstream's "no support
    // for primary IP family" in cmd/kube-proxy/app/server.go); the other is served when the
    // node uses it and supports it (upstream: when its tools work, `platformCheckSupported` in
    // server_linux.go), else later, when both hold; never an exit for it.
    let (primary, from) = crate::engine::primary_family(&config, &node, &node_ips);
    let secondary = crate::engine::other_family(primary);
    let mut backends = match backends(&config, mode, &[primary]).await {
        Ok(b) => b,
        Err(e) => {
            daemon.stop().await;
            return Err(e);
        }
    };
    let mut families = vec![primary];
    if crate::engine::family_signalled(&config, &node, &node_ips, secondary) {
        match family_backend(&config, mode, secondary).await {
            Ok(b) => {
                backends.push(b);
                families.push(secondary);
            }
            Err(why) => tracing::warn!(
                family = ?secondary,
                reason = %why,
                "no support for the secondary IP family: serving it later, once the node \
                 supports it (retried with backoff)"
            ),
        }
    }
    if families.len() == 2 {
        tracing::info!(primary = ?primary, from = from.as_str(), "kube-ipvs running in dual-stack mode");
    } else {
        tracing::info!(family = ?primary, from = from.as_str(), "kube-ipvs running in single-stack mode");
    }
    for f in [primary, secondary] {
        daemon.metrics.set_family_served(f, families.contains(&f));
    }
    // The other mode's leftovers go after this mode's first successful sync, never before
    // (see crate::handover).
    let first_sync = crate::handover::FirstSync::new(&families);
    daemon.metrics.init_families(&families);
    let handover = crate::handover::spawn_cleanup(
        config.clone(),
        families.clone(),
        mode,
        netif::Netif::new().await.ok(),
        first_sync.clone(),
    );
    if let Some(c) = &client {
        publish_start_events(c, &config, fallback_reason.as_ref(), conntrack_warning);
    }
    // Events for invalid objects: written by a few nodes per object, deduplicated, rate limited,
    // through a bounded queue.
    let (rejections_tx, rejections_rx) =
        crate::events::EventSink::new(Some(daemon.metrics.clone()));
    let rejections_tx = rejections_tx.with_reporters(crate::events::Reporters::new(
        &config.node_name,
        config.event_reporters,
    ));
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
        rt: tokio::runtime::Handle::current(),
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
    let forwarder = Some(crate::engine::forward_node_addresses(
        &tracker,
        engine.sender(),
        daemon.metrics.clone(),
    ));
    // The secondary family, once the node uses and supports it.
    let later = (!families.contains(&secondary)).then(|| {
        tokio::spawn(add_family_later(
            config.clone(),
            mode,
            secondary,
            node.clone(),
            tracker.subscribe(),
            engine.sender(),
        ))
    });

    let (tx, rx) = mpsc::channel::<SourceEvent>(1024);
    let (source, source_health_task) = start_source(&config, client, &daemon, tx)?;
    let result = serve(&mut daemon, &engine, rx, &mut signal, Box::pin(restart)).await;
    source.abort();
    for task in [source_health_task, publisher, forwarder, later]
        .into_iter()
        .flatten()
    {
        task.abort();
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

/// Starts the servers in the configured mode and, in IPVS mode (`prober` given), probes until
/// a mode is decided, restarting the servers when it falls back (they restart with the mode's
/// health window and metrics). Returns the running daemon with the probe error of a fallback,
/// or `None` when a signal came while probing (the servers are stopped then).
async fn start_in_selected_mode(
    config: Config,
    prober: Option<crate::probe::Prober>,
    signal: &mut Signal,
) -> Result<Option<(Daemon, Option<ProbeError>)>> {
    let requested = config.mode;
    let mut daemon = Daemon::start(config, requested).await?;
    let Some(prober) = prober else {
        return Ok(Some((daemon, None)));
    };
    let selected = crate::probe::select_mode(
        &daemon.config,
        prober,
        &daemon.health,
        &daemon.metrics,
        signal,
    )
    .await;
    match selected {
        Ok(crate::probe::Selected::Mode(mode, reason)) => {
            if mode != daemon.mode {
                let config = daemon.config.clone();
                daemon.stop().await;
                daemon = Daemon::start(config, mode).await?;
                if let Some(e) = &reason {
                    daemon.metrics.record_probe_failure(e.kind());
                }
            }
            Ok(Some((daemon, reason)))
        }
        Ok(crate::probe::Selected::Stopped) => {
            daemon.stop().await;
            Ok(None)
        }
        Err(e) => {
            daemon.stop().await;
            Err(e)
        }
    }
}

/// One backend per family; in IPVS mode the IPVS sysctls and timeouts are set first.
async fn backends(
    config: &Config,
    mode: ProxyMode,
    families: &[ipvs_netlink::Family],
) -> Result<Vec<Box<dyn Backend + Send>>> {
    if mode == ProxyMode::Ipvs {
        tokio::task::block_in_place(|| {
            crate::engine::apply_sysctls(&config.sysctl_root, config.ipvs.strict_arp);
            crate::engine::set_ipvs_timeouts(config);
        });
    }
    let mut backends = Vec::new();
    for &family in families {
        backends.push(match mode {
            ProxyMode::Ipvs => crate::engine::ipvs_backend(config, family).await?,
            ProxyMode::Iptables => crate::engine::iptables_backend(config, family)?,
        });
    }
    Ok(backends)
}

/// The backend of one more family (the primary one's sysctls and IPVS timeouts are set
/// already): an error text when the kernel lacks the family or its tools fail (e.g. no
/// `ip6tables`).
async fn family_backend(
    config: &Config,
    mode: ProxyMode,
    family: ipvs_netlink::Family,
) -> std::result::Result<Box<dyn Backend + Send>, String> {
    if let Some(why) = crate::engine::family_unsupported(config, family) {
        return Err(why);
    }
    let built = match mode {
        ProxyMode::Ipvs => crate::engine::ipvs_backend(config, family).await,
        ProxyMode::Iptables => crate::engine::iptables_backend(config, family),
    };
    built.map_err(|e| e.to_string())
}

/// Adds `family` to the running loop once the node uses it ([`crate::engine::family_signalled`]:
/// checked again whenever the node's addresses change) and supports it (retried with the one
/// backoff policy, minSyncPeriod to syncPeriod, while it is used and not supported).
async fn add_family_later(
    config: Config,
    mode: ProxyMode,
    family: ipvs_netlink::Family,
    node: crate::engine::NodeFacts,
    mut addresses: tokio::sync::watch::Receiver<netif::NodeAddressSet>,
    tx: proxier::sync_loop::InputSender,
) {
    let mut backoff = proxier::retry::Backoff::new(crate::engine::retry_policy(&config, mode));
    let mut tracked = true;
    loop {
        let used = {
            let ips = addresses.borrow_and_update().node_ips();
            crate::engine::family_signalled(&config, &node, &ips, family)
        };
        let now = std::time::Instant::now();
        if used && backoff.ready(now) {
            match family_backend(&config, mode, family).await {
                Ok(b) => {
                    tracing::info!(family = ?family,
                        "the node now uses and supports this IP family: kube-ipvs running in \
                         dual-stack mode");
                    let _ = tx
                        .send(proxier::sync_loop::Input::AddBackend(
                            proxier::sync_loop::NewBackend(b),
                        ))
                        .await;
                    return;
                }
                Err(why) => {
                    let delay = backoff.failed(now);
                    // Loud the first time and then every tenth attempt (the metric says it
                    // all along: kube_ipvs_ip_family_served 0).
                    if backoff.failures() % 10 == 1 {
                        tracing::warn!(family = ?family, reason = %why,
                            retry_in_ms = delay.as_millis() as u64,
                            "no support for the secondary IP family yet: running single-stack");
                    }
                }
            }
        }
        let wait = match (used, backoff.due()) {
            (true, Some(due)) => due.saturating_duration_since(std::time::Instant::now()),
            _ => std::time::Duration::from_secs(3600),
        };
        if tracked {
            tokio::select! {
                changed = addresses.changed() => tracked = changed.is_ok(),
                _ = tokio::time::sleep(wait) => {}
            }
        } else if used {
            tokio::time::sleep(wait).await;
        } else {
            // Nothing can signal the family any more (the tracker is gone).
            return;
        }
    }
}

/// The start's Events on the Node: the fallback to iptables mode (loud, in three places: the
/// log in `probe::select_mode`, the metric, and this Event) and conntrack limits that could not
/// be set (upstream's reason, so existing alerts keep matching).
fn publish_start_events(
    client: &kube::Client,
    config: &Config,
    fallback: Option<&ProbeError>,
    conntrack_warning: Option<String>,
) {
    if let Some(reason) = fallback {
        tokio::spawn(crate::events::publish_node_event(
            client.clone(),
            config.node_name.clone(),
            "IPVSUnavailable",
            "SelectProxyMode",
            format!("kube-ipvs runs in iptables mode: {reason}"),
        ));
    }
    if let Some(note) = conntrack_warning {
        tokio::spawn(crate::events::publish_node_event(
            client.clone(),
            config.node_name.clone(),
            "readOnlySysFS",
            "SetConntrackLimits",
            note,
        ));
    }
}

/// Runs the source: the static directory, or the API watchers with their health forwarded to
/// `/healthz` and the metrics. Returns the source task and the health forwarder.
fn start_source(
    config: &Config,
    client: Option<kube::Client>,
    daemon: &Daemon,
    tx: mpsc::Sender<SourceEvent>,
) -> Result<(SourceTask, Option<JoinHandle<()>>)> {
    match (&config.source_dir, client) {
        (None, None) => Err(Error::Unsupported("no source".into())),
        (Some(dir), _) => {
            let src = StaticDirSource::new(dir.clone(), config.node_name.clone());
            let task = tokio::spawn(async move { src.run(tx).await.map_err(Error::from) });
            Ok((task, None))
        }
        (None, Some(client)) => {
            let node = config.node_name.clone();
            let (health_tx, health_rx) =
                tokio::sync::watch::channel(::watch::kube::SourceHealth::default());
            let health = tokio::spawn(forward_source_health(
                health_rx,
                daemon.health.clone(),
                daemon.metrics.clone(),
            ));
            let task = tokio::spawn(async move {
                ::watch::kube::run(client, node, tx, health_tx).await;
                Ok(())
            });
            Ok((task, Some(health)))
        }
    }
}

/// Hands every source event to the daemon and the engine until a signal, a requested restart
/// (a changed configuration file), the engine's end (`--once`) or the source's end (an error).
async fn serve(
    daemon: &mut Daemon,
    engine: &crate::engine::Engine,
    mut rx: mpsc::Receiver<SourceEvent>,
    signal: &mut Signal,
    mut restart: Pin<Box<impl Future<Output = crate::config_watch::Restart>>>,
) -> Result<()> {
    let mut tick = tokio::time::interval(std::time::Duration::from_millis(50));
    loop {
        tokio::select! {
            sig = &mut *signal => {
                tracing::info!("{sig}: stopping (IPVS, addresses and rules stay in place)");
                return Ok(());
            }
            why = &mut restart => {
                tracing::info!(
                    reason = %why,
                    "restart requested: stopping with exit 0 so the DaemonSet starts kube-ipvs \
                     with the new configuration (IPVS, addresses and rules stay in place)"
                );
                return Ok(());
            }
            _ = tick.tick() => {
                if engine.finished() {
                    return Ok(());
                }
            }
            ev = rx.recv() => match ev {
                Some(ev) => {
                    daemon.handle_event(&ev);
                    if !engine.send(ev).await {
                        return Ok(());
                    }
                }
                None => return Err(Error::Unsupported("the source stopped".into())),
            }
        }
    }
}
