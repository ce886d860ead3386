//! The daemon and the one-shot commands: the seams where the sync engine plugs in.
//!
//! - [`run_daemon`]: selects the mode, starts `/healthz` + `/livez` and `/metrics`, runs the
//!   source (static directory or API server) and hands every event to [`Daemon::handle_event`].
//!   `--once` returns after the first full list; SIGTERM/SIGINT stop the source and the servers
//!   and return `Ok` (the kernel state is left in place).
//! - [`plan`]: reads the objects once and prints them.
//! - [`cleanup`]: removes what kube-ipvs programmed (`--cleanup`).
//!
//! `run` is [`run_daemon`]'s steps; `client` builds the API client and feeds the source's
//! health; `host` holds the process's signals, OOM score and node-address tracker; `commands`
//! the one-shot commands.

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
mod run;

pub use client::*;
pub use commands::*;
pub use host::*;
pub use run::run_daemon;

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
            match http::serve(what, addr, router, Some(metrics.clone())).await {
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
