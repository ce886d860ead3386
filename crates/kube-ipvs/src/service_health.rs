//! Health-check node ports for `externalTrafficPolicy: Local` services.
//!
//! Each such service has a `spec.healthCheckNodePort`; load balancers probe it on every node and
//! send traffic only to nodes answering 200. Like upstream kube-proxy (`hcHandler.ServeHTTP` in
//! `pkg/proxy/healthcheck/service_health.go`, since KEP-3836), one HTTP listener per port (on
//! every listen address) answers any path with 200 when the node has local endpoints for the
//! service and the proxy's sync health is good ([`ProxyHealth::is_healthy`]: queued changes
//! applied within the health timeout, no kernel subsystem failing for it; never the API source,
//! so an API outage does not take every node out of every load balancer at once), else 503, and
//! this JSON body:
//! `{"service":{"namespace":"ns","name":"name"},"localEndpoints":N,"serviceProxyHealthy":true}`,
//! with `X-Content-Type-Options: nosniff` and `X-Load-Balancing-Endpoint-Weight: N`.
//!
//! [`ServiceHealthServer::sync_services`] takes the full wanted set (port → service, local
//! endpoint count): it opens new listeners, closes removed ones and updates counts in place.
//! A port that cannot be bound is reported and retried on the next sync.

use std::collections::BTreeMap;
use std::net::{IpAddr, SocketAddr};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use tokio::sync::Mutex;
use tokio::task::JoinHandle;

use crate::error::Error;
use crate::health::ProxyHealth;
use crate::metrics::Metrics;

/// A service's namespace and name.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct NamespacedName {
    /// Namespace.
    pub namespace: String,
    /// Name.
    pub name: String,
}

impl NamespacedName {
    /// `namespace/name`.
    pub fn new(namespace: impl Into<String>, name: impl Into<String>) -> Self {
        Self {
            namespace: namespace.into(),
            name: name.into(),
        }
    }
}

impl std::fmt::Display for NamespacedName {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{}", self.namespace, self.name)
    }
}

/// What one health-check node port should report.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HealthCheckService {
    /// The service.
    pub service: NamespacedName,
    /// Ready endpoints of the service on this node.
    pub local_endpoints: usize,
}

#[derive(Debug)]
struct Listener {
    service: NamespacedName,
    endpoints: Arc<AtomicUsize>,
    addrs: Vec<SocketAddr>,
    tasks: Vec<JoinHandle<()>>,
}

impl Listener {
    async fn close(self) {
        for t in &self.tasks {
            t.abort();
        }
        for t in self.tasks {
            // Wait until the task is gone so the port is free for a re-open.
            let _ = t.await;
        }
    }
}

/// The health-check node port listeners.
#[derive(Debug)]
pub struct ServiceHealthServer {
    listen_ips: Vec<IpAddr>,
    health: Arc<ProxyHealth>,
    metrics: Option<Arc<Metrics>>,
    listeners: Mutex<BTreeMap<u16, Listener>>,
}

fn respond(service: &NamespacedName, count: usize, proxy_healthy: bool) -> Response {
    let code = if count > 0 && proxy_healthy {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    let body = serde_json::json!({
        "service": {"namespace": service.namespace, "name": service.name},
        "localEndpoints": count,
        "serviceProxyHealthy": proxy_healthy,
    });
    let mut r = (code, body.to_string()).into_response();
    let h = r.headers_mut();
    h.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    h.insert(
        header::X_CONTENT_TYPE_OPTIONS,
        HeaderValue::from_static("nosniff"),
    );
    h.insert("X-Load-Balancing-Endpoint-Weight", HeaderValue::from(count));
    r
}

impl ServiceHealthServer {
    /// Listeners will bind every port on each of `listen_ips` (e.g. `0.0.0.0` and `::`, or the
    /// node IPs selected by nodePortAddresses).
    pub fn new(
        listen_ips: Vec<IpAddr>,
        health: Arc<ProxyHealth>,
        metrics: Option<Arc<Metrics>>,
    ) -> Self {
        Self {
            listen_ips,
            health,
            metrics,
            listeners: Mutex::new(BTreeMap::new()),
        }
    }

    async fn open(&self, port: u16, svc: &HealthCheckService) -> Result<Listener, Error> {
        let endpoints = Arc::new(AtomicUsize::new(svc.local_endpoints));
        let mut listener = Listener {
            service: svc.service.clone(),
            endpoints: endpoints.clone(),
            addrs: Vec::new(),
            tasks: Vec::new(),
        };
        for ip in &self.listen_ips {
            let addr = SocketAddr::new(*ip, port);
            let tcp = match tokio::net::TcpListener::bind(addr).await {
                Ok(t) => t,
                Err(source) => {
                    listener.close().await;
                    return Err(Error::Bind {
                        what: format!("health check node port of {}", svc.service),
                        addr,
                        source,
                    });
                }
            };
            listener.addrs.push(tcp.local_addr().unwrap_or(addr));
            let (service, endpoints, health) =
                (svc.service.clone(), endpoints.clone(), self.health.clone());
            let app = axum::Router::new().fallback(move || {
                let (service, endpoints, health) =
                    (service.clone(), endpoints.clone(), health.clone());
                async move {
                    respond(
                        &service,
                        endpoints.load(Ordering::Relaxed),
                        health.is_healthy(),
                    )
                }
            });
            let name = svc.service.clone();
            let metrics = self.metrics.clone();
            listener.tasks.push(tokio::spawn(async move {
                tracing::debug!(service = %name, %addr, "serving health check node port");
                // Header-read timeout, connection caps (per source and in total) and age limit
                // (see `crate::http`); closing the port aborts this task.
                crate::http::serve_limited(
                    "health-check-node-port",
                    tcp,
                    app,
                    crate::http::Limits::default(),
                    metrics,
                    std::future::pending(),
                )
                .await;
            }));
        }
        Ok(listener)
    }

    /// Makes the open listeners match `wanted` (port → service and local endpoint count).
    /// Returns the ports that could not be opened (they are retried on the next call).
    pub async fn sync_services(&self, wanted: &BTreeMap<u16, HealthCheckService>) -> Vec<Error> {
        let mut listeners = self.listeners.lock().await;
        // Close removed ports and ports that now belong to another service.
        let stale: Vec<u16> = listeners
            .iter()
            .filter(|(port, l)| wanted.get(port).is_none_or(|w| w.service != l.service))
            .map(|(port, _)| *port)
            .collect();
        for port in stale {
            if let Some(l) = listeners.remove(&port) {
                tracing::info!(service = %l.service, port, "closing health check node port");
                l.close().await;
            }
        }
        let mut errors = Vec::new();
        for (port, svc) in wanted {
            if let Some(l) = listeners.get(port) {
                l.endpoints.store(svc.local_endpoints, Ordering::Relaxed);
                continue;
            }
            match self.open(*port, svc).await {
                Ok(l) => {
                    tracing::info!(service = %svc.service, port, "opened health check node port");
                    listeners.insert(*port, l);
                }
                Err(e) => {
                    tracing::error!("{e}");
                    errors.push(e);
                }
            }
        }
        if let Some(m) = &self.metrics {
            m.health_check_node_ports
                .set(i64::try_from(listeners.len()).unwrap_or(i64::MAX));
        }
        errors
    }

    /// The addresses currently listened on, per port.
    pub async fn bound(&self) -> BTreeMap<u16, Vec<SocketAddr>> {
        self.listeners
            .lock()
            .await
            .iter()
            .map(|(p, l)| (*p, l.addrs.clone()))
            .collect()
    }

    /// Closes every listener.
    pub async fn shutdown(&self) {
        let mut listeners = self.listeners.lock().await;
        while let Some((_, l)) = listeners.pop_first() {
            l.close().await;
        }
    }
}
