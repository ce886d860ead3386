//! kube-ipvs0 dummy link and node address tracking over rtnetlink.
//!
//! Two halves, both kernel-facing through rtnetlink and nothing else:
//!
//! - [`Netif`] owns the `kube-ipvs0` dummy link: create it when missing (left down, like
//!   kube-proxy), list its addresses, and apply an [`AddrDiff`] computed by the pure
//!   [`diff_addresses`] — one netlink request per changed address, none for unchanged ones.
//! - [`NodeAddresses`] keeps the node's local addresses current from rtnetlink multicast events
//!   (address and link groups) after one initial dump, and publishes them as a
//!   [`NodeAddressSet`] through a `tokio::sync::watch` channel. The set answers "which IPs serve
//!   NodePorts" ([`NodePortAddresses`]), "is this IP local", and notices when `kube-ipvs0` is
//!   deleted behind our back. A failed or ended subscription never empties the set: the last
//!   known addresses stay, the failure is reported ([`TrackerStatus`]) and the tracker
//!   subscribes again with backoff.

mod batch;
mod diff;
mod link;
mod monitor;
mod nodeaddr;

pub use diff::{diff_addresses, host_prefix_len, AddrDiff};
pub use link::{LinkState, Netif};
pub use monitor::{
    EventStream, NodeAddresses, Subscriber, Subscription, TrackerConfig, TrackerStatus,
};
pub use nodeaddr::{event_from_message, AddrEvent, LinkAddrs, NodeAddressSet, NodePortAddresses};

/// Name of the dummy link every service VIP is bound to (same as kube-proxy).
pub const DUMMY_LINK: &str = "kube-ipvs0";

/// Errors of the netif crate.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// Opening or binding the rtnetlink socket failed.
    #[error("opening rtnetlink socket: {0}")]
    Socket(#[source] std::io::Error),
    /// The kernel rejected a request; `object` names what the request was about.
    #[error("{op} {object}: {source}")]
    Kernel {
        /// What was attempted, e.g. "add address".
        op: &'static str,
        /// The object of the request, e.g. "10.96.0.1/32 on kube-ipvs0".
        object: String,
        /// Positive errno the kernel answered with, when it sent one.
        errno: Option<i32>,
        /// The underlying rtnetlink error.
        #[source]
        source: rtnetlink::Error,
    },
    /// A kernel feature the proxy needs is not available.
    #[error("kernel feature missing: {feature} ({detail})")]
    MissingFeature {
        /// The missing feature, named so an operator knows what to enable or load.
        feature: &'static str,
        /// What the kernel answered.
        detail: String,
    },
    /// The link does not exist (for `kube-ipvs0`: call [`Netif::ensure_dummy`] first).
    #[error("link {0} does not exist")]
    NoSuchLink(String),
    /// The link could not be found or looked up, so no address on it could be changed.
    #[error("link {link} unavailable: {reason}")]
    LinkUnavailable {
        /// The link name.
        link: String,
        /// Why it is unavailable.
        reason: String,
    },
    /// A pipelined request got no usable answer (socket error or malformed reply).
    #[error("{object}: no answer from the kernel: {detail}")]
    Transport {
        /// The object of the request.
        object: String,
        /// What went wrong.
        detail: String,
    },
    /// A kernel reply or event lacked data it must carry or carried impossible values.
    #[error("malformed rtnetlink {what}: {detail}")]
    Malformed {
        /// Which message kind was malformed.
        what: &'static str,
        /// What was wrong with it.
        detail: String,
    },
    /// A `nodePortAddresses` entry is neither a CIDR nor the word `primary`.
    #[error("invalid nodePortAddresses entry {0:?}: expected a CIDR or \"primary\"")]
    InvalidNodePortAddress(String),
    /// A datagram of replies to pipelined requests could not be decoded.
    #[error("malformed netlink reply: {0}")]
    MalformedReply(#[source] rtnetlink::packet_core::DecodeError),
    /// A reply in a datagram of replies to pipelined requests claims a length shorter than a
    /// netlink header or longer than what is left of the datagram.
    #[error("netlink reply length {0} out of bounds")]
    ReplyLength(usize),
    /// The rtnetlink connection task ended, so no request can be answered.
    #[error("rtnetlink connection closed")]
    Closed,
    /// The kernel did not answer a request within its time limit ([`REQUEST_TIMEOUT`] unless
    /// changed with [`Netif::set_request_timeout`]).
    #[error("{op} {object}: no answer from the kernel within {after:?}")]
    Timeout {
        /// What was attempted, e.g. "look up link".
        op: &'static str,
        /// The object of the request.
        object: String,
        /// The time limit.
        after: std::time::Duration,
    },
}

/// How long one rtnetlink request (a lookup, a dump, a link change, one datagram of pipelined
/// address changes) may wait for the kernel's answer by default.
///
/// Why 10 s: the kernel answers rtnetlink requests synchronously under the RTNL lock, in
/// micro- to milliseconds even with thousands of addresses; a request unanswered for ten
/// seconds means the RTNL lock is stuck or replies were lost, and failing the sync (to be
/// retried) beats blocking it. The same limit as the blocking netlink socket's receive
/// (`netlink::DEFAULT_RECV_TIMEOUT`).
pub const REQUEST_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(10);

/// Runs one request future for at most `after`: [`Error::Timeout`] naming `op` and `object`
/// when the kernel has not answered by then.
pub(crate) async fn bounded<T>(
    op: &'static str,
    object: impl Into<String>,
    after: std::time::Duration,
    request: impl std::future::Future<Output = Result<T, Error>>,
) -> Result<T, Error> {
    match tokio::time::timeout(after, request).await {
        Ok(r) => r,
        Err(_) => Err(Error::Timeout {
            op,
            object: object.into(),
            after,
        }),
    }
}

/// Errno values this crate reacts to (Linux, all architectures).
pub(crate) mod errno {
    /// No such device.
    pub const ENODEV: i32 = 19;
    /// File exists.
    pub const EEXIST: i32 = 17;
    /// Operation not supported (unknown link kind).
    pub const EOPNOTSUPP: i32 = 95;
    /// Cannot assign requested address (deleting an address that is not there).
    pub const EADDRNOTAVAIL: i32 = 99;
}

/// The positive errno inside an rtnetlink error, if the kernel sent one.
pub(crate) fn errno_of(e: &rtnetlink::Error) -> Option<i32> {
    match e {
        rtnetlink::Error::NetlinkError(m) => m.code.map(|c| c.get().abs()),
        _ => None,
    }
}

/// Wrap an rtnetlink error as [`Error::Kernel`].
pub(crate) fn kernel(
    op: &'static str,
    object: impl Into<String>,
    source: rtnetlink::Error,
) -> Error {
    Error::Kernel {
        op,
        object: object.into(),
        errno: errno_of(&source),
        source,
    }
}
