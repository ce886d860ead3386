//! Targeted conntrack cleanup for UDP (and optionally TCP/SCTP) services over ctnetlink.
//!
//! When a UDP service loses an endpoint, clients that keep their source port (DNS resolvers)
//! keep hitting the dead endpoint for as long as their conntrack entry lives; when a UDP
//! service goes from 0 to N endpoints, entries created while it had none keep pointing
//! nowhere. Both are fixed by deleting exactly those entries (k/k#48370, #125467).
//!
//! One [`ConntrackFilter`] describes one target:
//! - endpoint removed: `orig_dst` = service IP (ClusterIP, external/LB IP, or node IP for a
//!   NodePort), `orig_dst_port` = service port / NodePort, `reply_src` = the endpoint IP
//!   ([`ConntrackFilter::endpoint_removed`]);
//! - 0 → N endpoints: same, with `reply_src` = `orig_dst` ([`ConntrackFilter::unanswered`]):
//!   an entry whose reply comes from the address the client sent to was never DNATed (no IPVS
//!   real server, no DNAT rule), which is what a UDP packet to a VIP without endpoints leaves
//!   behind (checked against the real kernel in `tests/conntrack.rs`).
//!
//! [`Conntrack::delete`] finds the entries with kernel-filtered dumps (`CTA_FILTER`, kernel ≥ 5.8):
//! for a single filter one dump restricted to its protocol, VIP, port and endpoint; for more
//! filters of a (family, protocol) one dump restricted to the protocol (each filtered dump walks
//! the whole hash table, see [`io::DEFAULT_PER_FILTER_DUMPS`] for the figures). Older kernels
//! ignore `CTA_FILTER` and return the family's table; a kernel that rejects it switches the
//! client to family-only dumps. Every returned entry is re-checked with
//! [`ConntrackFilter::matches`], so the result is the same on every kernel. Each match is then
//! deleted by its exact original tuple and id (a newer entry with the same tuple is left
//! alone), many delete requests per datagram (pipelined like the IPVS client). The kernel
//! cannot delete by filter: a flush with `CTA_FILTER` is `EOPNOTSUPP`.
//!
//! Observed with IPVS on the 6.1 VM kernel (`tests/conntrack.rs`, `vm_` test): a virtual server
//! with no real server leaves no entry (IPVS drops the packet before conntrack confirms it), but
//! a bound service IP without a virtual server does, and that un-NATed entry blackholes the
//! fixed-port client once the virtual server exists, until `unanswered` cleanup. A removed real
//! server's entries are also dropped by IPVS itself (expire_nodest_conn, kernel ≥ 5.9);
//! `endpoint_removed` is what the iptables mode and older kernels need.
//!
//! - [`codec`]: pure encode/decode (byte-level tests), on the framing of the `netlink` crate.
//! - [`io`]: the requests and their replies ([`Conntrack`]), over that crate's socket and its
//!   pipelined exchange (the one the IPVS and ipset clients use).

pub mod codec;
pub mod io;

use std::net::IpAddr;

pub use codec::{Entry, Tuple};
pub use io::Conntrack;

/// Errors of the conntrack cleaner.
#[derive(Debug, thiserror::Error)]
pub enum ConntrackError {
    /// A socket operation failed.
    #[error("conntrack netlink {what}: {source}")]
    Io {
        /// The operation (connect, send, recv, ...).
        what: &'static str,
        /// The underlying error (with its errno).
        #[source]
        source: std::io::Error,
    },
    /// The kernel rejected a request.
    #[error("conntrack {op}: kernel error {errno} ({})", std::io::Error::from_raw_os_error(*errno))]
    Kernel {
        /// The request (dump, delete).
        op: &'static str,
        /// Positive errno.
        errno: i32,
    },
    /// The kernel did not answer within the socket's receive time limit.
    #[error("conntrack netlink {what}: no answer from the kernel within {after:?}")]
    Timeout {
        /// The operation (recv).
        what: &'static str,
        /// The time limit.
        after: std::time::Duration,
    },
    /// A reply ended before a structure it announced.
    #[error("truncated netlink reply: {0}")]
    Truncated(&'static str),
    /// A reply was well-framed but not what ctnetlink sends.
    #[error("malformed netlink reply: {0}")]
    Malformed(String),
    /// A filter is inconsistent (e.g. an IPv4 service with an IPv6 endpoint).
    #[error("invalid conntrack filter: {0}")]
    InvalidFilter(String),
}

impl From<netlink::Error> for ConntrackError {
    /// The netlink framing and socket (the `netlink` crate) raise only socket, timeout,
    /// truncation and malformed-data errors; they keep their variant here (and a socket
    /// error its `std::io::Error`, so its errno).
    fn from(e: netlink::Error) -> Self {
        match e {
            netlink::Error::Io { what, source } => ConntrackError::Io { what, source },
            netlink::Error::Timeout { what, after } => ConntrackError::Timeout { what, after },
            netlink::Error::Truncated(what) => ConntrackError::Truncated(what),
            netlink::Error::Malformed(m) => ConntrackError::Malformed(m),
        }
    }
}

/// Transport protocol of a service port (crate `net-types`).
pub use net_types::Protocol;

/// Which conntrack entries to delete. Every `Some` field must match; the address family is
/// that of `orig_dst`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct ConntrackFilter {
    /// Transport protocol.
    pub proto: Protocol,
    /// Original destination: the service IP the client sent to (or a node IP for NodePorts).
    pub orig_dst: IpAddr,
    /// Original destination port: the service port or NodePort.
    pub orig_dst_port: Option<u16>,
    /// Reply source: the endpoint IP the entry was DNATed to (`orig_dst` itself for entries
    /// that were never DNATed).
    pub reply_src: Option<IpAddr>,
    /// Reply source port: the endpoint's target port.
    pub reply_src_port: Option<u16>,
}

impl ConntrackFilter {
    /// Entries from clients of `service_ip:port` that were sent to `endpoint`.
    pub fn endpoint_removed(
        proto: Protocol,
        service_ip: IpAddr,
        port: u16,
        endpoint: IpAddr,
    ) -> Self {
        ConntrackFilter {
            proto,
            orig_dst: service_ip,
            orig_dst_port: Some(port),
            reply_src: Some(endpoint),
            reply_src_port: None,
        }
    }

    /// Entries to `service_ip:port` that were never DNATed (created while the service had no
    /// endpoint): their reply source is the service IP itself.
    pub fn unanswered(proto: Protocol, service_ip: IpAddr, port: u16) -> Self {
        ConntrackFilter {
            proto,
            orig_dst: service_ip,
            orig_dst_port: Some(port),
            reply_src: Some(service_ip),
            reply_src_port: None,
        }
    }

    /// `nfgen_family` of this filter.
    pub fn family(&self) -> u8 {
        codec::family_of(&self.orig_dst)
    }

    /// Checks that every address has the same family.
    pub fn validate(&self) -> Result<(), ConntrackError> {
        match self.reply_src {
            Some(r) if r.is_ipv4() != self.orig_dst.is_ipv4() => {
                Err(ConntrackError::InvalidFilter(format!(
                    "orig_dst {} and reply_src {r} differ in family",
                    self.orig_dst
                )))
            }
            _ => Ok(()),
        }
    }

    /// Whether `entry` is one this filter targets.
    pub fn matches(&self, entry: &Entry) -> bool {
        let (o, r) = (&entry.orig, &entry.reply);
        o.proto == self.proto.number()
            && o.dst == self.orig_dst
            && self.orig_dst_port.is_none_or(|p| o.dst_port == Some(p))
            && self.reply_src.is_none_or(|ip| r.src == ip)
            && self.reply_src_port.is_none_or(|p| r.src_port == Some(p))
    }
}

/// Outcome of one [`Conntrack::delete`] call.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct DeleteReport {
    /// Distinct entries that matched at least one filter.
    pub matched: u64,
    /// Entries the kernel deleted (ACKed).
    pub deleted: u64,
    /// Entries already gone when the delete arrived (ENOENT: expired, or replaced by a newer
    /// entry with the same tuple, which is left alone).
    pub not_found: u64,
    /// Deletes the kernel refused with another error.
    pub failed: u64,
    /// Entries the kernel returned in dumps (> `matched` when it could not filter).
    pub dumped: u64,
    /// Dump requests sent.
    pub dumps: u64,
    /// Netlink requests sent (dumps + deletes).
    pub requests: u64,
}

/// Cumulative counters since the [`Conntrack`] was created (for metrics:
/// `kubeproxy_conntrack_reconciler_deleted_entries_total` is `deleted`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ConntrackCounters {
    /// Entries deleted.
    pub deleted: u64,
    /// Entries that matched a filter.
    pub matched: u64,
    /// Entries already gone at delete time.
    pub not_found: u64,
    /// Deletes refused by the kernel (other than ENOENT).
    pub failed: u64,
    /// Entries received in dumps.
    pub dumped: u64,
    /// Dumps run.
    pub dumps: u64,
    /// Netlink requests sent (dumps + deletes).
    pub requests: u64,
    /// Datagrams sent.
    pub sends: u64,
}

impl ConntrackCounters {
    fn add(&mut self, r: &DeleteReport) {
        self.deleted += r.deleted;
        self.matched += r.matched;
        self.not_found += r.not_found;
        self.failed += r.failed;
        self.dumped += r.dumped;
        self.dumps += r.dumps;
    }
}

#[cfg(test)]
mod tests;
