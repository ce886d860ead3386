//! rtnetlink multicast tracker that keeps a [`NodeAddressSet`] current without re-listing, and
//! keeps the last known addresses through any failure of its subscription.

use std::time::Duration;

use futures::channel::mpsc::UnboundedReceiver;
use futures::stream::{StreamExt, TryStreamExt};
use netlink_packet_route::RouteNetlinkMessage;
use rtnetlink::packet_core::{NetlinkMessage, NetlinkPayload};
use rtnetlink::sys::SocketAddr;
use rtnetlink::{Handle, MulticastGroup};
use tokio::sync::watch;
use tokio::task::JoinHandle;

use crate::nodeaddr::{event_from_message, AddrEvent, NodeAddressSet};
use crate::{bounded, kernel, Error, REQUEST_TIMEOUT};

/// A message arriving within this time of the previous one joins its burst (one published
/// snapshot per burst: binding 10,000 ClusterIPs on kube-ipvs0 is 10,000 events, and each
/// published snapshot is a copy of every address on the node).
const BURST_QUIET: Duration = Duration::from_millis(10);

/// The longest a burst is held before its snapshot is published (the added latency of a node
/// address change is at most this).
const BURST_MAX: Duration = Duration::from_millis(100);

/// The longest error text kept in [`TrackerStatus::last_error`].
const MAX_ERROR_LEN: usize = 256;

/// The stream of rtnetlink messages of a subscription.
pub type EventStream = UnboundedReceiver<(NetlinkMessage<RouteNetlinkMessage>, SocketAddr)>;

/// The tracker's own state, published next to the addresses (see [`NodeAddresses::status`]).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TrackerStatus {
    /// The node's addresses are known: a dump succeeded at least once. Until then the set is
    /// empty and means "unknown", not "no addresses".
    pub known: bool,
    /// Changes are followed now: subscribed, dumped, and the event stream open. While false
    /// the last known addresses stay published.
    pub tracking: bool,
    /// Subscriptions made after the first attempt (each after a failure or the end of the
    /// stream, or after a failed first attempt).
    pub resubscriptions: u64,
    /// Why tracking last stopped or the last (re)subscription failed, at most 256 bytes.
    pub last_error: Option<String>,
}

/// How long the tracker waits for the kernel and between resubscriptions.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TrackerConfig {
    /// Each dump (links, addresses) waits at most this for the kernel.
    pub request_timeout: Duration,
    /// The first resubscription waits this long; each failed one doubles it, up to `retry_max`.
    pub retry_min: Duration,
    /// The longest wait between resubscriptions.
    pub retry_max: Duration,
}

impl Default for TrackerConfig {
    /// [`REQUEST_TIMEOUT`] per dump; resubscribe after 1 s, backing off to 30 s (the proxy's
    /// default syncPeriod: a node whose rtnetlink keeps failing retries twice a minute).
    fn default() -> Self {
        TrackerConfig {
            request_timeout: REQUEST_TIMEOUT,
            retry_min: Duration::from_secs(1),
            retry_max: Duration::from_secs(30),
        }
    }
}

impl TrackerConfig {
    /// The wait before the `n`th consecutive attempt after a failure (1 = the first).
    pub fn delay(&self, n: u32) -> Duration {
        let shift = n.saturating_sub(1).min(20);
        self.retry_min
            .saturating_mul(1u32 << shift)
            .min(self.retry_max.max(self.retry_min))
    }
}

/// An open rtnetlink subscription: its connection task, a handle for dumps and the events.
pub struct Subscription {
    conn: JoinHandle<()>,
    handle: Handle,
    events: EventStream,
}

impl std::fmt::Debug for Subscription {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Subscription").finish_non_exhaustive()
    }
}

impl Drop for Subscription {
    fn drop(&mut self) {
        self.conn.abort();
    }
}

impl Subscription {
    /// Subscribes to link and address events (RTNLGRP_LINK, RTNLGRP_IPV4_IFADDR,
    /// RTNLGRP_IPV6_IFADDR) in the calling thread's network namespace. Must be called inside a
    /// tokio runtime.
    pub fn multicast() -> Result<Subscription, Error> {
        let (conn, handle, events) = rtnetlink::new_multicast_connection(&[
            MulticastGroup::Link,
            MulticastGroup::Ipv4Ifaddr,
            MulticastGroup::Ipv6Ifaddr,
        ])
        .map_err(Error::Socket)?;
        Ok(Subscription {
            conn: tokio::spawn(conn),
            handle,
            events,
        })
    }

    /// Fault injection for tests: real dumps, but the events come from `events` (the test
    /// ends the stream by dropping its sender).
    #[doc(hidden)]
    pub fn with_events(events: EventStream) -> Result<Subscription, Error> {
        let (conn, handle, _) = rtnetlink::new_connection().map_err(Error::Socket)?;
        Ok(Subscription {
            conn: tokio::spawn(conn),
            handle,
            events,
        })
    }

    /// Fault injection for tests: a connection that is never driven, so every dump waits for
    /// an answer that never comes (a kernel stuck on the RTNL lock), and no event arrives.
    #[doc(hidden)]
    pub fn stalled() -> Result<Subscription, Error> {
        let (conn, handle, events) = rtnetlink::new_connection().map_err(Error::Socket)?;
        let conn = tokio::spawn(async move {
            let _held = conn;
            std::future::pending::<()>().await
        });
        Ok(Subscription {
            conn,
            handle,
            events,
        })
    }
}

/// Opens a subscription (the real one is [`Subscription::multicast`]; tests inject others).
pub type Subscriber = Box<dyn FnMut() -> Result<Subscription, Error> + Send>;

/// Tracks the node's links and addresses from rtnetlink events (RTNLGRP_LINK,
/// RTNLGRP_IPV4_IFADDR, RTNLGRP_IPV6_IFADDR) after one initial dump, and publishes each change
/// through a watch channel, one snapshot per burst of events (a burst ends after 10 ms
/// without events, or 100 ms after it began). A socket overrun (events lost) triggers a fresh
/// dump.
///
/// Nothing the subscription does can empty the published set: when the event stream ends, a
/// re-listing fails or a dump times out, the last known addresses stay published, the failure
/// is reported in [`NodeAddresses::status`] (and logged), and the tracker subscribes again with
/// backoff ([`TrackerConfig`]), replacing the set with the fresh dump once one succeeds. A first
/// subscription that fails leaves the set unknown ([`TrackerStatus::known`] false) and is
/// retried the same way. Dropping the tracker stops its task.
pub struct NodeAddresses {
    rx: watch::Receiver<NodeAddressSet>,
    status: watch::Receiver<TrackerStatus>,
    task: JoinHandle<()>,
}

impl Drop for NodeAddresses {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl std::fmt::Debug for NodeAddresses {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NodeAddresses")
            .field("current", &*self.rx.borrow())
            .field("status", &*self.status.borrow())
            .finish()
    }
}

/// Dump all links and addresses into a fresh snapshot; each of the two dumps waits at most
/// `timeout` for the kernel.
async fn dump(handle: &Handle, timeout: Duration) -> Result<NodeAddressSet, Error> {
    let mut events = Vec::new();
    let links = handle.link().get().execute().try_collect::<Vec<_>>();
    let links = bounded("dump", "links", timeout, async {
        links.await.map_err(|e| kernel("dump", "links", e))
    })
    .await?;
    for l in links {
        if let Some(ev) = event_from_message(&RouteNetlinkMessage::NewLink(l))? {
            events.push(ev);
        }
    }
    let addrs = handle.address().get().execute().try_collect::<Vec<_>>();
    let addrs = bounded("dump", "addresses", timeout, async {
        addrs.await.map_err(|e| kernel("dump", "addresses", e))
    })
    .await?;
    for a in addrs {
        match event_from_message(&RouteNetlinkMessage::NewAddress(a)) {
            Ok(Some(ev)) => events.push(ev),
            Ok(None) => {}
            Err(e) => tracing::warn!(error = %e, "skipping address in dump"),
        }
    }
    Ok(NodeAddressSet::from_events(&events))
}

/// Outcome of handling one message.
enum Step {
    Changed,
    Unchanged,
    Resync,
}

fn handle_message(state: &mut NodeAddressSet, msg: NetlinkMessage<RouteNetlinkMessage>) -> Step {
    match msg.payload {
        NetlinkPayload::InnerMessage(m) => match event_from_message(&m) {
            Ok(Some(ev)) => {
                if let AddrEvent::DelLink { name: Some(n), .. } = &ev {
                    if n == crate::DUMMY_LINK {
                        tracing::warn!("{} was deleted", crate::DUMMY_LINK);
                    }
                }
                if state.apply(&ev) {
                    Step::Changed
                } else {
                    Step::Unchanged
                }
            }
            Ok(None) => Step::Unchanged,
            Err(e) => {
                tracing::warn!(error = %e, "undecodable rtnetlink event; re-listing addresses");
                Step::Resync
            }
        },
        NetlinkPayload::Overrun(_) => {
            tracing::warn!("rtnetlink event socket overran; re-listing addresses");
            Step::Resync
        }
        _ => Step::Unchanged,
    }
}

fn cut(e: &impl std::fmt::Display) -> String {
    let mut s = e.to_string();
    if s.len() > MAX_ERROR_LEN {
        let mut end = MAX_ERROR_LEN;
        while !s.is_char_boundary(end) {
            end -= 1;
        }
        s.truncate(end);
    }
    s
}

/// Publishes `state` (one more snapshot).
fn publish(state: &mut NodeAddressSet, tx: &watch::Sender<NodeAddressSet>) {
    state.note_published();
    tx.send_replace(state.clone());
}

/// Follows one subscription's events until its stream ends or a re-listing fails; returns why.
async fn follow(
    sub: &mut Subscription,
    state: &mut NodeAddressSet,
    tx: &watch::Sender<NodeAddressSet>,
    timeout: Duration,
) -> Error {
    loop {
        let Some((first, _)) = sub.events.next().await else {
            return Error::Closed;
        };
        let mut changed = false;
        let mut resync = false;
        let mut step = handle_message(state, first);
        // A burst gives one notification: what is queued is drained, and while messages keep
        // coming within BURST_QUIET of each other they join it, for at most BURST_MAX.
        let deadline = tokio::time::Instant::now() + BURST_MAX;
        loop {
            match step {
                Step::Changed => changed = true,
                Step::Resync => resync = true,
                Step::Unchanged => {}
            }
            if let Ok((m, _)) = sub.events.try_recv() {
                step = handle_message(state, m);
                continue;
            }
            let now = tokio::time::Instant::now();
            if now >= deadline {
                break;
            }
            let wait = BURST_QUIET.min(deadline - now);
            match tokio::time::timeout(wait, sub.events.next()).await {
                Ok(Some((m, _))) => step = handle_message(state, m),
                // Quiet (or the stream ended: the next round reports that).
                _ => break,
            }
        }
        if resync {
            match dump(&sub.handle, timeout).await {
                Ok(fresh) => changed |= state.replace_with_dump(fresh),
                Err(e) => {
                    // What the burst changed is still published; the rest comes with the
                    // dump of the next subscription.
                    if changed {
                        publish(state, tx);
                    }
                    return e;
                }
            }
        }
        if changed {
            publish(state, tx);
        }
    }
}

/// Opens a subscription and dumps the current state through it (subscribed before dumping:
/// every change after the dump arrives as an event, and events older than the dump are
/// replayed in order, which converges to the same state).
async fn attempt(
    subscribe: &mut Subscriber,
    timeout: Duration,
) -> Result<(Subscription, NodeAddressSet), Error> {
    let sub = subscribe()?;
    let fresh = dump(&sub.handle, timeout).await?;
    Ok((sub, fresh))
}

/// Follows the current subscription, and after any failure keeps the last known addresses,
/// reports it and subscribes again with backoff.
async fn supervise(
    mut subscribe: Subscriber,
    cfg: TrackerConfig,
    mut current: Option<Subscription>,
    tx: watch::Sender<NodeAddressSet>,
    status: watch::Sender<TrackerStatus>,
) {
    let mut state = tx.borrow().clone();
    // Consecutive failed attempts (the first attempt at start counts).
    let mut failures: u32 = u32::from(current.is_none());
    loop {
        let mut sub = match current.take() {
            Some(s) => s,
            None => {
                tokio::time::sleep(cfg.delay(failures)).await;
                match attempt(&mut subscribe, cfg.request_timeout).await {
                    Ok((sub, fresh)) => {
                        let known = status.borrow().known;
                        if state.replace_with_dump(fresh) || !known {
                            publish(&mut state, &tx);
                        }
                        status.send_modify(|s| {
                            s.known = true;
                            s.tracking = true;
                            s.resubscriptions += 1;
                        });
                        tracing::info!(after_failures = failures, "node-address tracking resumed");
                        sub
                    }
                    Err(e) => {
                        failures = failures.saturating_add(1);
                        let retry = cfg.delay(failures);
                        tracing::warn!(error = %e, retry_in_ms = retry.as_millis() as u64,
                            "subscribing to node-address changes failed; keeping the last known \
                             addresses and retrying with backoff");
                        status.send_modify(|s| {
                            s.resubscriptions += 1;
                            s.last_error = Some(cut(&e));
                        });
                        continue;
                    }
                }
            }
        };
        let why = follow(&mut sub, &mut state, &tx, cfg.request_timeout).await;
        drop(sub);
        failures = 1;
        tracing::error!(error = %why, retry_in_ms = cfg.delay(failures).as_millis() as u64,
            "node-address tracking stopped; keeping the last known addresses and subscribing \
             again with backoff");
        status.send_modify(|s| {
            s.tracking = false;
            s.last_error = Some(cut(&why));
        });
    }
}

impl NodeAddresses {
    /// Subscribe to link and address events, dump the current state once, and start tracking.
    /// Fails when the first subscription or dump fails (see [`NodeAddresses::spawn`] for a
    /// tracker that keeps trying). Must be called inside a tokio runtime; the socket belongs
    /// to the calling thread's network namespace.
    pub async fn start() -> Result<Self, Error> {
        let subscribe: Subscriber = Box::new(Subscription::multicast);
        let (tracker, first) = Self::start_with(subscribe, TrackerConfig::default()).await;
        first.map(|()| tracker)
    }

    /// Like [`NodeAddresses::start`], but a failed first subscription is not an error: the
    /// tracker starts with unknown addresses ([`TrackerStatus::known`] false) and keeps trying
    /// with backoff.
    pub async fn spawn() -> Self {
        let subscribe: Subscriber = Box::new(Subscription::multicast);
        let (tracker, first) = Self::start_with(subscribe, TrackerConfig::default()).await;
        if let Err(e) = first {
            tracing::warn!(error = %e, "cannot track node addresses yet; retrying with backoff");
        }
        tracker
    }

    /// A tracker whose subscriptions come from `subscribe`, with `cfg`'s time limits; returns
    /// it with the outcome of its first attempt (made before returning).
    pub async fn start_with(
        mut subscribe: Subscriber,
        cfg: TrackerConfig,
    ) -> (Self, Result<(), Error>) {
        let (current, initial, first) = match attempt(&mut subscribe, cfg.request_timeout).await {
            Ok((sub, fresh)) => {
                let mut initial = NodeAddressSet::default();
                initial.replace_with_dump(fresh);
                let status = TrackerStatus {
                    known: true,
                    tracking: true,
                    ..TrackerStatus::default()
                };
                (Some(sub), (initial, status), Ok(()))
            }
            Err(e) => {
                let status = TrackerStatus {
                    last_error: Some(cut(&e)),
                    ..TrackerStatus::default()
                };
                (None, (NodeAddressSet::default(), status), Err(e))
            }
        };
        let (tx, rx) = watch::channel(initial.0);
        let (status_tx, status) = watch::channel(initial.1);
        let task = tokio::spawn(supervise(subscribe, cfg, current, tx, status_tx));
        (Self { rx, status, task }, first)
    }

    /// A receiver that is notified on every change; `borrow()` reads the current set without
    /// any syscall.
    pub fn subscribe(&self) -> watch::Receiver<NodeAddressSet> {
        self.rx.clone()
    }

    /// A copy of the current set.
    pub fn current(&self) -> NodeAddressSet {
        self.rx.borrow().clone()
    }

    /// The tracker's own state, notified when it changes.
    pub fn status(&self) -> watch::Receiver<TrackerStatus> {
        self.status.clone()
    }

    /// Whether the tracking task is still running.
    pub fn is_running(&self) -> bool {
        !self.task.is_finished()
    }
}
