//! rtnetlink multicast tracker that keeps a [`NodeAddressSet`] current without re-listing.

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

/// Pause before retrying a failed resynchronisation dump.
const RESYNC_RETRY: Duration = Duration::from_secs(1);

/// A message arriving within this time of the previous one joins its burst (one published
/// snapshot per burst: binding 10,000 ClusterIPs on kube-ipvs0 is 10,000 events, and each
/// published snapshot is a copy of every address on the node).
const BURST_QUIET: Duration = Duration::from_millis(10);

/// The longest a burst is held before its snapshot is published (the added latency of a node
/// address change is at most this).
const BURST_MAX: Duration = Duration::from_millis(100);

type Messages = UnboundedReceiver<(NetlinkMessage<RouteNetlinkMessage>, SocketAddr)>;

/// Tracks the node's links and addresses from rtnetlink events (RTNLGRP_LINK,
/// RTNLGRP_IPV4_IFADDR, RTNLGRP_IPV6_IFADDR) after one initial dump, and publishes each change
/// through a watch channel, one snapshot per burst of events (a burst ends after 10 ms
/// without events, or 100 ms after it began). A socket overrun (events lost) triggers a fresh
/// dump. Dropping it stops the tracking task.
pub struct NodeAddresses {
    rx: watch::Receiver<NodeAddressSet>,
    task: JoinHandle<()>,
    conn: JoinHandle<()>,
}

impl Drop for NodeAddresses {
    fn drop(&mut self) {
        self.task.abort();
        self.conn.abort();
    }
}

impl std::fmt::Debug for NodeAddresses {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NodeAddresses")
            .field("current", &*self.rx.borrow())
            .finish()
    }
}

/// Dump all links and addresses into a fresh snapshot; each of the two dumps waits at most
/// [`REQUEST_TIMEOUT`] for the kernel.
async fn dump(handle: &Handle) -> Result<NodeAddressSet, Error> {
    let mut events = Vec::new();
    let links = handle.link().get().execute().try_collect::<Vec<_>>();
    let links = bounded("dump", "links", REQUEST_TIMEOUT, async {
        links.await.map_err(|e| kernel("dump", "links", e))
    })
    .await?;
    for l in links {
        if let Some(ev) = event_from_message(&RouteNetlinkMessage::NewLink(l))? {
            events.push(ev);
        }
    }
    let addrs = handle.address().get().execute().try_collect::<Vec<_>>();
    let addrs = bounded("dump", "addresses", REQUEST_TIMEOUT, async {
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

async fn run(handle: Handle, mut messages: Messages, tx: watch::Sender<NodeAddressSet>) {
    let mut state = tx.borrow().clone();
    loop {
        let Some((first, _)) = messages.next().await else {
            tracing::error!("rtnetlink event stream ended; node addresses are no longer tracked");
            return;
        };
        let mut changed = false;
        let mut resync = false;
        let mut step = handle_message(&mut state, first);
        // A burst gives one notification: what is queued is drained, and while messages keep
        // coming within BURST_QUIET of each other they join it, for at most BURST_MAX.
        let deadline = tokio::time::Instant::now() + BURST_MAX;
        loop {
            match step {
                Step::Changed => changed = true,
                Step::Resync => resync = true,
                Step::Unchanged => {}
            }
            if let Ok((m, _)) = messages.try_recv() {
                step = handle_message(&mut state, m);
                continue;
            }
            let now = tokio::time::Instant::now();
            if now >= deadline {
                break;
            }
            let wait = BURST_QUIET.min(deadline - now);
            match tokio::time::timeout(wait, messages.next()).await {
                Ok(Some((m, _))) => step = handle_message(&mut state, m),
                // Quiet (or the stream ended: the next round reports that).
                _ => break,
            }
        }
        if resync {
            loop {
                match dump(&handle).await {
                    Ok(fresh) => {
                        changed |= state.replace_with_dump(fresh);
                        break;
                    }
                    Err(e) => {
                        tracing::warn!(error = %e, "re-listing addresses failed; retrying");
                        tokio::time::sleep(RESYNC_RETRY).await;
                    }
                }
            }
        }
        if changed {
            state.note_published();
            tx.send_replace(state.clone());
        }
    }
}

impl NodeAddresses {
    /// Subscribe to link and address events, dump the current state once, and start tracking.
    /// Must be called inside a tokio runtime; the socket belongs to the calling thread's
    /// network namespace.
    pub async fn start() -> Result<Self, Error> {
        let (conn, handle, messages) = rtnetlink::new_multicast_connection(&[
            MulticastGroup::Link,
            MulticastGroup::Ipv4Ifaddr,
            MulticastGroup::Ipv6Ifaddr,
        ])
        .map_err(Error::Socket)?;
        let conn = tokio::spawn(conn);
        // Subscribed before dumping: every change after the dump arrives as an event, and
        // events older than the dump are replayed in order, which converges to the same state.
        let mut initial = NodeAddressSet::default();
        match dump(&handle).await {
            Ok(d) => {
                initial.replace_with_dump(d);
            }
            Err(e) => {
                conn.abort();
                return Err(e);
            }
        }
        let (tx, rx) = watch::channel(initial);
        let task = tokio::spawn(run(handle, messages, tx));
        Ok(Self { rx, task, conn })
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

    /// Whether the tracking task is still running.
    pub fn is_running(&self) -> bool {
        !self.task.is_finished()
    }
}
