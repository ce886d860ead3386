//! A small HTTP server wrapper: bind, serve an axum router, stop.
//!
//! Every server (`/healthz`, `/metrics`, the health-check node ports) runs its own accept loop
//! with [`Limits`] (axum's own `serve` has none): a request's headers must arrive within
//! `header_read_timeout` (hyper's timer also covers an idle keep-alive connection waiting for its
//! next request), no connection lives longer than `max_connection_age`, and open connections
//! are capped twice:
//!
//! - **per source address** (`max_per_source`): a connection from an address that already holds
//!   that many is closed at once and counted in
//!   `kube_ipvs_http_connections_refused_total{server,reason="per_source"}`. One pod that keeps
//!   opening connections (re-opening each one the server closes) holds at most this many, and
//!   the node's own probes (kubelet, load balancers) from other addresses are still answered.
//! - **in total** (`max_connections`): when the server is full, a connection from a source is
//!   admitted by closing the oldest connection of the source holding the most connections,
//!   provided that source holds more than the newcomer's (counted in
//!   `kube_ipvs_http_connections_evicted_total{server}`); otherwise it is closed at once
//!   (`reason="total"`). So many sources filling the server never lock out a new source: it
//!   takes a slot from the heaviest one, and the oldest connections go first (a probe's
//!   connection, answered in milliseconds, is the youngest). Only a source already holding as
//!   many connections as the heaviest one is refused.
//!
//! The table of sources holds only sources with an open connection, so it never has more than
//! `max_connections` entries. A slow or stuck client (half a header, an idle socket) holds a
//! slot for seconds, never forever.

use std::collections::{HashMap, VecDeque};
use std::future::Future;
use std::net::{IpAddr, SocketAddr};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use tokio::sync::oneshot;
use tokio::task::{AbortHandle, JoinHandle};

use crate::error::{Error, Result};
use crate::metrics::Metrics;

/// A running HTTP server.
#[derive(Debug)]
pub struct Server {
    /// What it serves (for logs and the `server` label): `healthz`, `metrics`.
    pub what: &'static str,
    /// The bound address (with the real port if 0 was asked for).
    pub addr: SocketAddr,
    stop: Option<oneshot::Sender<()>>,
    task: JoinHandle<()>,
}

/// Binds `addr` and serves `router` with the default [`Limits`] until [`Server::stop`]; refused
/// and evicted connections are counted in `metrics`.
pub async fn serve(
    what: &'static str,
    addr: SocketAddr,
    router: axum::Router,
    metrics: Option<Arc<Metrics>>,
) -> Result<Server> {
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
        serve_limited(what, listener, router, Limits::default(), metrics, async {
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
    /// Open connections at most (see the module documentation for what happens when full).
    pub max_connections: usize,
    /// Open connections from one source address at most; more are closed right after accept.
    pub max_per_source: usize,
    /// Time to receive a request's headers (and to wait for the next request on a kept-alive
    /// connection).
    pub header_read_timeout: Duration,
    /// Longest a connection may stay open.
    pub max_connection_age: Duration,
}

impl Default for Limits {
    /// 128 connections, 8 per source, 5 s for headers (and idle keep-alive), 30 s per
    /// connection: a probe (kubelet, a load balancer, Prometheus) sends its request at once and
    /// needs one or two connections per address.
    fn default() -> Self {
        Limits {
            max_connections: 128,
            max_per_source: 8,
            header_read_timeout: Duration::from_secs(5),
            max_connection_age: Duration::from_secs(30),
        }
    }
}

/// The source a connection is counted under: its address, IPv4-mapped IPv6 as IPv4.
fn source_of(peer: SocketAddr) -> IpAddr {
    match peer.ip() {
        IpAddr::V6(v6) => v6.to_ipv4_mapped().map_or(IpAddr::V6(v6), IpAddr::V4),
        v4 => v4,
    }
}

/// What [`Table::admit`] decided.
#[derive(Debug, PartialEq, Eq)]
enum Admit {
    /// Admitted as this connection id.
    Yes(u64),
    /// Admitted as this id after closing another source's oldest connection.
    Evicted(u64),
    /// The source holds `max_per_source` already.
    PerSource,
    /// The server is full and no source holds more than this one.
    Total,
}

/// The open connections by source (only sources with an open connection: at most
/// `max_connections` entries).
#[derive(Debug, Default)]
struct Table {
    next_id: u64,
    total: usize,
    /// Per source, its connections oldest first: (id, how to close it).
    by_source: HashMap<IpAddr, VecDeque<(u64, Option<AbortHandle>)>>,
}

impl Table {
    fn count(&self, source: &IpAddr) -> usize {
        self.by_source.get(source).map_or(0, VecDeque::len)
    }

    /// Decides on a new connection from `source` (and records it when admitted, without its
    /// abort handle yet: [`Self::set_handle`]).
    fn admit(&mut self, source: IpAddr, limits: &Limits) -> Admit {
        let mine = self.count(&source);
        if mine >= limits.max_per_source.max(1) {
            return Admit::PerSource;
        }
        let mut evicted = false;
        if self.total >= limits.max_connections.max(1) {
            // The heaviest source; among equals, the one with the oldest connection.
            let victim = self
                .by_source
                .iter()
                .filter(|(_, c)| !c.is_empty())
                .max_by(|(_, a), (_, b)| {
                    a.len()
                        .cmp(&b.len())
                        .then_with(|| b.front().map(|x| x.0).cmp(&a.front().map(|x| x.0)))
                })
                .filter(|(_, c)| c.len() > mine)
                .map(|(s, _)| *s);
            let Some(victim) = victim else {
                return Admit::Total;
            };
            if let Some((_, handle)) = self.remove_oldest(&victim) {
                if let Some(h) = handle {
                    h.abort();
                }
                evicted = true;
            }
        }
        let id = self.next_id;
        self.next_id += 1;
        self.by_source
            .entry(source)
            .or_default()
            .push_back((id, None));
        self.total += 1;
        if evicted {
            Admit::Evicted(id)
        } else {
            Admit::Yes(id)
        }
    }

    fn remove_oldest(&mut self, source: &IpAddr) -> Option<(u64, Option<AbortHandle>)> {
        let conns = self.by_source.get_mut(source)?;
        let oldest = conns.pop_front();
        if conns.is_empty() {
            self.by_source.remove(source);
        }
        if oldest.is_some() {
            self.total -= 1;
        }
        oldest
    }

    fn set_handle(&mut self, source: &IpAddr, id: u64, handle: AbortHandle) {
        if let Some(c) = self
            .by_source
            .get_mut(source)
            .and_then(|c| c.iter_mut().find(|(i, _)| *i == id))
        {
            c.1 = Some(handle);
        }
    }

    /// Forgets a closed connection (a no-op when it was evicted).
    fn remove(&mut self, source: &IpAddr, id: u64) {
        let Some(conns) = self.by_source.get_mut(source) else {
            return;
        };
        let before = conns.len();
        conns.retain(|(i, _)| *i != id);
        let removed = before - conns.len();
        if conns.is_empty() {
            self.by_source.remove(source);
        }
        self.total -= removed;
    }
}

/// Removes its connection from the table when the connection's task ends (also when aborted).
struct Slot {
    table: Arc<Mutex<Table>>,
    source: IpAddr,
    id: u64,
}

impl Drop for Slot {
    fn drop(&mut self) {
        self.table
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .remove(&self.source, self.id);
    }
}

/// Serves `router` on `listener` within `limits` until `stop` completes; refused and evicted
/// connections are counted in `metrics` under `what`. Connections already accepted finish on
/// their own (bounded by the limits).
pub async fn serve_limited(
    what: &'static str,
    listener: tokio::net::TcpListener,
    router: axum::Router,
    limits: Limits,
    metrics: Option<Arc<Metrics>>,
    stop: impl Future<Output = ()>,
) {
    let table = Arc::new(Mutex::new(Table::default()));
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
        let source = source_of(peer);
        let mut t = table.lock().unwrap_or_else(PoisonError::into_inner);
        let id = match t.admit(source, &limits) {
            Admit::Yes(id) => id,
            Admit::Evicted(id) => {
                tracing::debug!(server = what, %peer, "server full: closed the heaviest source's oldest connection");
                if let Some(m) = &metrics {
                    m.record_http_evicted(what);
                }
                id
            }
            refused => {
                drop(t);
                let reason = if refused == Admit::PerSource {
                    "per_source"
                } else {
                    "total"
                };
                tracing::debug!(server = what, %peer, reason, "connection cap reached: closing");
                if let Some(m) = &metrics {
                    m.record_http_refused(what, reason);
                }
                drop(stream);
                continue;
            }
        };
        let slot = Slot {
            table: table.clone(),
            source,
            id,
        };
        let service = hyper_util::service::TowerToHyperService::new(router.clone());
        // Spawned while the table is locked: the task's slot cannot be removed before its
        // abort handle is recorded.
        let task = tokio::spawn(async move {
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
            drop(slot);
        });
        t.set_handle(&source, id, task.abort_handle());
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
    use super::*;

    fn ip(last: u8) -> IpAddr {
        IpAddr::from([127, 0, 0, last])
    }

    fn limits(total: usize, per_source: usize) -> Limits {
        Limits {
            max_connections: total,
            max_per_source: per_source,
            ..Limits::default()
        }
    }

    #[test]
    fn per_source_cap_then_eviction_from_the_heaviest_source() {
        let l = limits(6, 4);
        let mut t = Table::default();
        // One source takes its 4, the fifth is refused.
        for _ in 0..4 {
            assert!(matches!(t.admit(ip(1), &l), Admit::Yes(_)));
        }
        assert_eq!(t.admit(ip(1), &l), Admit::PerSource);
        // Two more sources fill the server.
        assert!(matches!(t.admit(ip(2), &l), Admit::Yes(_)));
        assert!(matches!(t.admit(ip(3), &l), Admit::Yes(_)));
        assert_eq!(t.total, 6);
        // A new source gets in: the heaviest (ip 1, 4 connections) loses its oldest (id 0).
        assert_eq!(t.admit(ip(4), &l), Admit::Evicted(6));
        assert_eq!((t.total, t.count(&ip(1))), (6, 3));
        assert_eq!(t.by_source[&ip(1)].front().map(|c| c.0), Some(1));
        // The evicted connection's task ending later changes nothing.
        t.remove(&ip(1), 0);
        assert_eq!(t.total, 6);
        // ip 1 (3) may still take from nobody heavier than itself: refused.
        assert_eq!(t.admit(ip(1), &l), Admit::Total);
        // ip 2 (1 connection) takes from ip 1 (3).
        assert!(matches!(t.admit(ip(2), &l), Admit::Evicted(_)));
        assert_eq!((t.count(&ip(1)), t.count(&ip(2))), (2, 2));
        // Closing connections frees slots and forgets empty sources.
        for id in 0..20 {
            for s in 1..=4 {
                t.remove(&ip(s), id);
            }
        }
        assert_eq!(t.total, 0);
        assert!(t.by_source.is_empty());
    }

    #[test]
    fn equal_sources_evict_the_oldest_connection_and_the_table_stays_bounded() {
        let l = limits(4, 8);
        let mut t = Table::default();
        for s in 1..=4 {
            assert!(matches!(t.admit(ip(s), &l), Admit::Yes(_)));
        }
        // Every source holds one; a new one takes the oldest (ip 1's).
        assert!(matches!(t.admit(ip(5), &l), Admit::Evicted(_)));
        assert_eq!(t.count(&ip(1)), 0);
        assert!(!t.by_source.contains_key(&ip(1)));
        // 10,000 distinct sources later, the table holds at most the cap.
        for i in 0..10_000u32 {
            let src = IpAddr::from(std::net::Ipv4Addr::from(0x0a00_0000 + i));
            t.admit(src, &l);
            assert!(t.total <= 4 && t.by_source.len() <= 4);
        }
    }

    #[test]
    fn ipv4_mapped_sources_count_as_ipv4() {
        let v4: SocketAddr = "10.0.0.1:5".parse().unwrap();
        let mapped: SocketAddr = "[::ffff:10.0.0.1]:6".parse().unwrap();
        assert_eq!(source_of(v4), source_of(mapped));
        let v6: SocketAddr = "[2001:db8::1]:7".parse().unwrap();
        assert_eq!(source_of(v6), v6.ip());
    }
}
