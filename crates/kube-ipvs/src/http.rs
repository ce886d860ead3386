//! A small HTTP server wrapper: bind, serve an axum router, stop.

use std::net::SocketAddr;

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
        let res = axum::serve(listener, router)
            .with_graceful_shutdown(async {
                let _ = rx.await;
            })
            .await;
        if let Err(e) = res {
            tracing::error!(server = what, "HTTP server failed: {e}");
        }
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
