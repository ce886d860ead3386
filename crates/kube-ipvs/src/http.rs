//! A small HTTP server wrapper: bind, serve an axum router, stop.
//!
//! Every server (`/healthz`, `/metrics`, the health-check node ports) runs its own accept loop
//! with [`Limits`]: at most `max_connections` open connections (more are closed at once), a
//! request's headers must arrive within `header_read_timeout` (hyper's timer also covers an
//! idle keep-alive connection waiting for its next request), and no connection lives longer
//! than `max_connection_age`. A slow or stuck client (half a header, an idle socket) can hold a
//! connection slot for seconds, never forever, and never more than the cap (axum's own `serve`
//! has none of these limits).

use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::oneshot;
use tokio::task::JoinHandle;

use crate::error::{Error, Result};

/// A running HTTP server.
#[derive(Debug)]
pub struct Server {
    /// What it serves (for logs): `healthz`, `metrics`.
    pub what: &'static str,
    /// The bound address (with the real port if 0 was asked for).
    pub addr: SocketAddr,
    stop: Option<oneshot::Sender<()>>,
    task: JoinHandle<()>,
}

/// Binds `addr` and serves `router` until [`Server::stop`].
pub async fn serve(what: &'static str, addr: SocketAddr, router: axum::Router) -> Result<Server> {
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .map_err(|source| Error::Bind {
            what: what.to_string(),
            addr,
            source,
        })?;
    let addr = listener.local_addr().map_err(|source| Error::Serve {
        what: what.to_string(),
        source,
    })?;
    let (tx, rx) = oneshot::channel::<()>();
    let task = tokio::spawn(async move {
        serve_limited(what, listener, router, Limits::default(), async {
            let _ = rx.await;
        })
        .await;
    });
    tracing::info!(server = what, %addr, "serving HTTP");
    Ok(Server {
        what,
        addr,
        stop: Some(tx),
        task,
    })
}

impl Server {
    /// Stops accepting and waits for the server task to end.
    pub async fn stop(mut self) {
        if let Some(tx) = self.stop.take() {
            let _ = tx.send(());
        }
        let _ = self.task.await;
    }
}

/// Limits of one HTTP server (see the module documentation).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// Open connections at most; more are closed right after accept.
    pub max_connections: usize,
    /// Time to receive a request's headers (and to wait for the next request on a kept-alive
    /// connection).
    pub header_read_timeout: Duration,
    /// Longest a connection may stay open.
    pub max_connection_age: Duration,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            max_connections: 128,
            header_read_timeout: Duration::from_secs(10),
            max_connection_age: Duration::from_secs(60),
        }
    }
}

/// Serves `router` on `listener` within `limits` until `stop` completes. Connections already
/// accepted finish on their own (bounded by the limits).
pub async fn serve_limited(
    what: &'static str,
    listener: tokio::net::TcpListener,
    router: axum::Router,
    limits: Limits,
    stop: impl Future<Output = ()>,
) {
    let slots = Arc::new(tokio::sync::Semaphore::new(limits.max_connections.max(1)));
    let mut stop = std::pin::pin!(stop);
    loop {
        let accepted = tokio::select! {
            _ = &mut stop => return,
            a = listener.accept() => a,
        };
        let (stream, peer) = match accepted {
            Ok(a) => a,
            Err(e) => {
                // EMFILE and the like: back off a little instead of spinning.
                tracing::warn!(server = what, "accept failed: {e}");
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        let Ok(permit) = slots.clone().try_acquire_owned() else {
            tracing::debug!(server = what, %peer, "connection cap reached: closing");
            drop(stream);
            continue;
        };
        let service = hyper_util::service::TowerToHyperService::new(router.clone());
        tokio::spawn(async move {
            let io = hyper_util::rt::TokioIo::new(stream);
            let conn = hyper::server::conn::http1::Builder::new()
                .timer(hyper_util::rt::TokioTimer::new())
                .header_read_timeout(limits.header_read_timeout)
                .serve_connection(io, service);
            match tokio::time::timeout(limits.max_connection_age, conn).await {
                Ok(Ok(())) => {}
                Ok(Err(e)) => tracing::debug!(server = what, %peer, "connection: {e}"),
                Err(_) => tracing::debug!(server = what, %peer, "connection too old: closed"),
            }
            drop(permit);
        });
    }
}
