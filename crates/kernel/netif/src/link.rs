//! rtnetlink IO for the `kube-ipvs0` dummy link: ensure it exists, list and change its addresses.

use std::collections::{BTreeMap, BTreeSet};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::Duration;

use futures::stream::TryStreamExt;
use netlink_packet_route::address::{AddressHeaderFlags, AddressMessage};
use netlink_packet_route::link::{InfoKind, LinkAttribute, LinkInfo, LinkMessage};
use netlink_packet_route::AddressFamily;
use netlink_packet_route::RouteNetlinkMessage;
use rtnetlink::packet_core::{NetlinkMessage, NLM_F_ACK, NLM_F_CREATE, NLM_F_EXCL, NLM_F_REQUEST};
use rtnetlink::{AddressMessageBuilder, Handle, LinkDummy};
use tokio::task::JoinHandle;

use crate::batch::{Answer, BatchSocket};
use crate::diff::{host_prefix_len, AddrDiff};
use crate::{bounded, errno, errno_of, kernel, Error, DUMMY_LINK, REQUEST_TIMEOUT};

/// Address changes built and sent per round of [`Netif::apply`] (each round is pipelined into
/// datagrams as before; only its messages are in memory at once).
const APPLY_CHUNK: usize = 1024;

/// The dummy link as found or created by [`Netif::ensure_dummy`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LinkState {
    /// Interface index.
    pub index: u32,
    /// True when this call created the link.
    pub created: bool,
}

/// The rtnetlink connection (requests through `handle`, served by the task `conn`).
///
/// netlink-proto ends its connection task for good on any socket error (a failed send or
/// flush: `Connection::poll_send_messages` and `poll_flush` set `socket_closed`), after which
/// every request through the handle fails at once. One transient ENOBUFS would thus break
/// every later lookup and dump of kube-ipvs0 until a restart; [`Netif`] opens a new
/// connection instead when it finds the task ended.
struct Rtnl {
    handle: Handle,
    conn: JoinHandle<()>,
}

impl Rtnl {
    fn open() -> Result<Rtnl, Error> {
        let (conn, handle, _) = rtnetlink::new_connection().map_err(Error::Socket)?;
        Ok(Rtnl {
            handle,
            conn: tokio::spawn(conn),
        })
    }
}

/// Owner of the `kube-ipvs0` dummy link and its addresses.
pub struct Netif {
    rtnl: Mutex<Rtnl>,
    /// rtnetlink connections opened again after the previous one had ended.
    reopened: AtomicU64,
    name: String,
    /// Index learned by the last lookup or creation.
    index: Mutex<Option<u32>>,
    /// Prefix lengths seen by the last [`Netif::addresses`], needed to delete an address that
    /// someone bound with a prefix other than /32 or /128.
    prefixes: Mutex<BTreeMap<IpAddr, u8>>,
    requests: AtomicU64,
    batch: BatchSocket,
    /// Time limit of one request ([`REQUEST_TIMEOUT`] by default).
    timeout: Duration,
}

impl Drop for Netif {
    fn drop(&mut self) {
        match self.rtnl.get_mut() {
            Ok(r) => r.conn.abort(),
            Err(poisoned) => poisoned.into_inner().conn.abort(),
        }
    }
}

impl std::fmt::Debug for Netif {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Netif")
            .field("name", &self.name)
            .field("requests", &self.requests_sent())
            .finish()
    }
}

fn link_is_dummy(msg: &LinkMessage) -> bool {
    msg.attributes.iter().any(|a| match a {
        LinkAttribute::LinkInfo(infos) => infos
            .iter()
            .any(|i| matches!(i, LinkInfo::Kind(InfoKind::Dummy))),
        _ => false,
    })
}

impl Netif {
    /// Open an rtnetlink connection for `kube-ipvs0`. Must be called inside a tokio runtime;
    /// the socket belongs to the network namespace of the calling thread.
    pub async fn new() -> Result<Self, Error> {
        Self::with_link_name(DUMMY_LINK).await
    }

    /// Like [`Netif::new`] for a link with another name (tests).
    pub async fn with_link_name(name: &str) -> Result<Self, Error> {
        let rtnl = Rtnl::open()?;
        let batch = BatchSocket::new()?;
        Ok(Self {
            batch,
            rtnl: Mutex::new(rtnl),
            reopened: AtomicU64::new(0),
            name: name.to_string(),
            index: Mutex::new(None),
            prefixes: Mutex::new(BTreeMap::new()),
            requests: AtomicU64::new(0),
            timeout: REQUEST_TIMEOUT,
        })
    }

    /// Fault injection for tests: like [`Netif::with_link_name`], but the rtnetlink connection
    /// is never driven, so every request through it (lookups, dumps, link changes) waits for
    /// an answer that never comes, as with a kernel stuck on the RTNL lock. The pipelined
    /// address socket is real.
    #[doc(hidden)]
    pub async fn with_stalled_connection(name: &str) -> Result<Self, Error> {
        let (conn, handle, _) = rtnetlink::new_connection().map_err(Error::Socket)?;
        let batch = BatchSocket::new()?;
        // Kept alive (requests are queued, not refused) but never polled.
        let conn = tokio::spawn(async move {
            let _held = conn;
            std::future::pending::<()>().await
        });
        Ok(Self {
            batch,
            rtnl: Mutex::new(Rtnl { handle, conn }),
            reopened: AtomicU64::new(0),
            name: name.to_string(),
            index: Mutex::new(None),
            prefixes: Mutex::new(BTreeMap::new()),
            requests: AtomicU64::new(0),
            timeout: REQUEST_TIMEOUT,
        })
    }

    /// Changes how long one request may wait for the kernel's answer before it fails with
    /// [`Error::Timeout`] (default [`REQUEST_TIMEOUT`]).
    pub fn set_request_timeout(&mut self, timeout: Duration) {
        self.timeout = timeout;
    }

    /// How long one request may wait for the kernel's answer.
    pub fn request_timeout(&self) -> Duration {
        self.timeout
    }

    /// The link name this instance manages.
    pub fn link_name(&self) -> &str {
        &self.name
    }

    /// Netlink requests sent so far (lookups and dumps included); tests compare it before and
    /// after an operation.
    pub fn requests_sent(&self) -> u64 {
        self.requests.load(Ordering::Relaxed)
    }

    fn count(&self) {
        self.requests.fetch_add(1, Ordering::Relaxed);
    }

    /// The handle of a live rtnetlink connection: the current one, or a new one when its task
    /// has ended (see [`Rtnl`]).
    fn handle(&self) -> Result<Handle, Error> {
        let mut rtnl = self
            .rtnl
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if rtnl.conn.is_finished() {
            *rtnl = Rtnl::open()?;
            self.reopened.fetch_add(1, Ordering::Relaxed);
            tracing::warn!(
                link = %self.name,
                "the rtnetlink connection had ended (a socket error); opened a new one"
            );
        }
        Ok(rtnl.handle.clone())
    }

    /// rtnetlink connections opened again because the previous one had ended.
    pub fn connections_reopened(&self) -> u64 {
        self.reopened.load(Ordering::Relaxed)
    }

    /// Fault injection for tests: ends the rtnetlink connection's task, as netlink-proto does
    /// after a socket error, and waits (at most a second) until it has ended.
    #[doc(hidden)]
    pub async fn end_connection(&self) {
        let ended = {
            let rtnl = self
                .rtnl
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            rtnl.conn.abort();
            rtnl.conn.is_finished()
        };
        if ended {
            return;
        }
        for _ in 0..1000 {
            tokio::time::sleep(Duration::from_millis(1)).await;
            let ended = self
                .rtnl
                .lock()
                .map(|r| r.conn.is_finished())
                .unwrap_or(true);
            if ended {
                return;
            }
        }
    }

    fn cached_index(&self) -> Option<u32> {
        self.index.lock().map(|g| *g).unwrap_or(None)
    }

    fn set_index(&self, index: Option<u32>) {
        if let Ok(mut g) = self.index.lock() {
            *g = index;
        }
    }

    /// Look the link up by name: `Ok(None)` when it does not exist.
    pub async fn lookup(&self) -> Result<Option<LinkMessage>, Error> {
        self.count();
        let mut req = self
            .handle()?
            .link()
            .get()
            .match_name(self.name.clone())
            .execute();
        let answer = bounded("look up link", self.name.clone(), self.timeout, async {
            Ok(req.try_next().await)
        })
        .await?;
        match answer {
            Ok(Some(msg)) => {
                self.set_index(Some(msg.header.index));
                Ok(Some(msg))
            }
            Ok(None) => Err(Error::Malformed {
                what: "link reply",
                detail: format!("empty answer to a lookup of {}", self.name),
            }),
            Err(e) if errno_of(&e) == Some(errno::ENODEV) => {
                self.set_index(None);
                Ok(None)
            }
            Err(e) => Err(kernel("look up link", self.name.clone(), e)),
        }
    }

    /// Make sure the link exists, creating a dummy link (left down, like kube-proxy) when it
    /// does not. A kernel without the dummy link type gives [`Error::MissingFeature`].
    pub async fn ensure_dummy(&self) -> Result<LinkState, Error> {
        if let Some(msg) = self.lookup().await? {
            if !link_is_dummy(&msg) {
                tracing::warn!(link = %self.name, "link exists but is not a dummy link; using it as is");
            }
            return Ok(LinkState {
                index: msg.header.index,
                created: false,
            });
        }
        self.count();
        let msg = LinkDummy::new(&self.name).build();
        let request = self.handle()?.link().add(msg).execute();
        let answer = bounded(
            "create dummy link",
            self.name.clone(),
            self.timeout,
            async { Ok(request.await) },
        )
        .await?;
        let created = match answer {
            Ok(()) => true,
            // Created concurrently by someone else: fine, it exists now.
            Err(e) if errno_of(&e) == Some(errno::EEXIST) => false,
            Err(e) if errno_of(&e) == Some(errno::EOPNOTSUPP) => {
                return Err(Error::MissingFeature {
                    feature: "dummy network device (CONFIG_DUMMY, kernel module `dummy`)",
                    detail: format!("creating {} of type dummy: {e}", self.name),
                })
            }
            Err(e) => return Err(kernel("create dummy link", self.name.clone(), e)),
        };
        match self.lookup().await? {
            Some(msg) => {
                if created {
                    tracing::info!(link = %self.name, index = msg.header.index, "created dummy link");
                }
                Ok(LinkState {
                    index: msg.header.index,
                    created,
                })
            }
            None => Err(Error::NoSuchLink(self.name.clone())),
        }
    }

    /// The addresses on the link, of every family. Looks the link up by name first, so a link
    /// recreated under another index is followed; a missing link is [`Error::NoSuchLink`].
    pub async fn addresses(&self) -> Result<BTreeSet<IpAddr>, Error> {
        self.read_addresses(None).await
    }

    /// The addresses of one family on the link (`ipv6`: IPv6, else IPv4), as
    /// [`Netif::addresses`]. The kernel dumps only that family (`ifa_family` of the request),
    /// so a family with nothing bound costs one empty dump however many the other has.
    pub async fn addresses_of(&self, ipv6: bool) -> Result<BTreeSet<IpAddr>, Error> {
        self.read_addresses(Some(ipv6)).await
    }

    async fn read_addresses(&self, ipv6: Option<bool>) -> Result<BTreeSet<IpAddr>, Error> {
        let index = match self.lookup().await? {
            Some(m) => m.header.index,
            None => return Err(Error::NoSuchLink(self.name.clone())),
        };
        self.count();
        let mut request = self.handle()?.address().get().set_link_index_filter(index);
        if let Some(v6) = ipv6 {
            request.message_mut().header.family = if v6 {
                AddressFamily::Inet6
            } else {
                AddressFamily::Inet
            };
        }
        let dump = request.execute().try_collect::<Vec<AddressMessage>>();
        let msgs = bounded(
            "list addresses of",
            self.name.clone(),
            self.timeout,
            async {
                dump.await
                    .map_err(|e| kernel("list addresses of", self.name.clone(), e))
            },
        )
        .await?;
        let mut prefixes = BTreeMap::new();
        for m in &msgs {
            let ev = crate::nodeaddr::event_from_message(
                &netlink_packet_route::RouteNetlinkMessage::NewAddress(m.clone()),
            )?;
            if let Some(crate::AddrEvent::NewAddr { net, .. }) = ev {
                // A kernel without per-family dumps answers with every family.
                if ipv6.is_none_or(|v6| net.addr().is_ipv6() == v6) {
                    prefixes.insert(net.addr(), net.prefix_len());
                }
            }
        }
        let set = prefixes.keys().copied().collect();
        // The prefix of each address read (removals use it): one family's read replaces only
        // that family's entries.
        if let Ok(mut g) = self.prefixes.lock() {
            match ipv6 {
                None => *g = prefixes,
                Some(v6) => {
                    g.retain(|ip, _| ip.is_ipv6() != v6);
                    g.extend(prefixes);
                }
            }
        }
        Ok(set)
    }

    fn address_message(&self, index: u32, ip: IpAddr, prefix: u8) -> AddressMessage {
        match ip {
            IpAddr::V4(v4) => AddressMessageBuilder::<Ipv4Addr>::new()
                .index(index)
                .address(v4, prefix)
                .build(),
            IpAddr::V6(v6) => {
                let mut m = AddressMessageBuilder::<Ipv6Addr>::new()
                    .index(index)
                    .address(v6, prefix)
                    .build();
                // No duplicate address detection: a VIP must be usable at once.
                m.header.flags |= AddressHeaderFlags::Nodad;
                m
            }
        }
    }

    /// The request adding (`add`) or removing `ip/prefix` on the link `index`.
    fn address_request(
        &self,
        index: u32,
        ip: IpAddr,
        add: bool,
        prefix: u8,
    ) -> NetlinkMessage<RouteNetlinkMessage> {
        let m = self.address_message(index, ip, prefix);
        let mut nl = if add {
            NetlinkMessage::from(RouteNetlinkMessage::NewAddress(m))
        } else {
            NetlinkMessage::from(RouteNetlinkMessage::DelAddress(m))
        };
        nl.header.flags = if add {
            NLM_F_REQUEST | NLM_F_ACK | NLM_F_CREATE | NLM_F_EXCL
        } else {
            NLM_F_REQUEST | NLM_F_ACK
        };
        nl
    }

    /// The result of adding (`add`) or removing `ip/prefix` from the kernel's answer (the
    /// error's wording is made only for an error).
    fn outcome(&self, ip: IpAddr, add: bool, prefix: u8, answer: Answer) -> Result<(), Error> {
        let op = if add { "add address" } else { "remove address" };
        let object = || {
            if add {
                format!("{ip}/{prefix} on {}", self.name)
            } else {
                format!("{ip}/{prefix} from {}", self.name)
            }
        };
        // Already there / already gone: the desired state holds.
        let benign = if add {
            errno::EEXIST
        } else {
            errno::EADDRNOTAVAIL
        };
        match answer {
            Answer::Ok => Ok(()),
            Answer::Nack(e) if errno_of(&e) == Some(benign) => Ok(()),
            Answer::Nack(e) => Err(kernel(op, object(), e)),
            Answer::Failed(detail) => Err(Error::Transport {
                object: object(),
                detail,
            }),
            Answer::TimedOut(after) => Err(Error::Timeout {
                op,
                object: object(),
                after,
            }),
        }
    }

    /// Apply a diff: one netlink request per changed address, none for unchanged ones. The
    /// requests are pipelined (many per datagram, ACKs collected afterwards). Every address gets its own result, in the order removals then adds, so
    /// one rejected address does not stop the rest. Uses the index of the last lookup or
    /// creation, looking the link up once if there was none.
    pub async fn apply(&self, diff: &AddrDiff) -> Vec<(IpAddr, Result<(), Error>)> {
        if diff.is_empty() {
            return Vec::new();
        }
        let index = match self.cached_index() {
            Some(i) => Ok(i),
            None => match self.lookup().await {
                Ok(Some(m)) => Ok(m.header.index),
                Ok(None) => Err(Error::NoSuchLink(self.name.clone())),
                Err(e) => Err(e),
            },
        };
        let index = match index {
            Ok(i) => i,
            Err(e) => {
                let reason = e.to_string();
                return diff
                    .remove
                    .iter()
                    .chain(diff.add.iter())
                    .map(|ip| {
                        let e = Error::LinkUnavailable {
                            link: self.name.clone(),
                            reason: reason.clone(),
                        };
                        (*ip, Err(e))
                    })
                    .collect();
            }
        };
        let prefixes = self.prefixes.lock().map(|g| g.clone()).unwrap_or_default();
        let ops: Vec<(IpAddr, bool, u8)> = diff
            .remove
            .iter()
            .map(|ip| {
                let prefix = prefixes
                    .get(ip)
                    .copied()
                    .unwrap_or_else(|| host_prefix_len(ip));
                (*ip, false, prefix)
            })
            .chain(diff.add.iter().map(|ip| (*ip, true, host_prefix_len(ip))))
            .collect();
        self.requests.fetch_add(ops.len() as u64, Ordering::Relaxed);
        let mut results: Vec<(IpAddr, Result<(), Error>)> = Vec::with_capacity(ops.len());
        // One chunk's messages at a time: at a first sync of 10,000 services every address
        // message used to be built before the first was sent (~2.9 MB of small allocations at
        // the daemon's peak, issue #18); one more round trip per chunk is nothing beside that.
        for chunk in ops.chunks(APPLY_CHUNK) {
            let msgs = chunk
                .iter()
                .map(|&(ip, add, prefix)| self.address_request(index, ip, add, prefix))
                .collect();
            let answers = self.batch.run(msgs, self.timeout).await;
            results.extend(
                (chunk.iter().zip(answers)).map(|(&(ip, add, prefix), answer)| {
                    (ip, self.outcome(ip, add, prefix, answer))
                }),
            );
        }
        if let Ok(mut g) = self.prefixes.lock() {
            for (ip, r) in &results {
                if r.is_ok() {
                    if diff.add.contains(ip) {
                        g.insert(*ip, host_prefix_len(ip));
                    } else {
                        g.remove(ip);
                    }
                }
            }
        }
        results
    }

    /// Delete the link (for `--cleanup`). Returns whether it existed.
    pub async fn delete_dummy(&self) -> Result<bool, Error> {
        let Some(msg) = self.lookup().await? else {
            return Ok(false);
        };
        self.count();
        let request = self.handle()?.link().del(msg.header.index).execute();
        let answer = bounded("delete link", self.name.clone(), self.timeout, async {
            Ok(request.await)
        })
        .await?;
        match answer {
            Ok(()) => {
                self.set_index(None);
                tracing::info!(link = %self.name, "deleted dummy link");
                Ok(true)
            }
            Err(e) if errno_of(&e) == Some(errno::ENODEV) => Ok(false),
            Err(e) => Err(kernel("delete link", self.name.clone(), e)),
        }
    }
}
