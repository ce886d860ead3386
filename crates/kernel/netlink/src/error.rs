//! The netlink layer's error: socket calls keep their `std::io::Error` (and so the errno),
//! a receive that waited its whole time limit is a timeout, and kernel bytes that cannot be
//! read are truncated or malformed. Kernel answers to requests (ACK or errno) are not errors
//! of this layer: they are per-request results ([`crate::Answer`], [`crate::End`]).

use std::time::Duration;

/// `ENOBUFS`: a netlink receive buffer overflowed and the kernel dropped messages.
pub const ENOBUFS: i32 = 105;

/// Errors of the netlink framing, the socket and the pipelined exchange.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A socket call (connect, setsockopt, send, recv) failed; `source` carries the errno
    /// ([`Error::errno`]).
    #[error("netlink socket {what}: {source}")]
    Io {
        /// Which call failed.
        what: &'static str,
        /// The underlying error, with its errno.
        #[source]
        source: std::io::Error,
    },
    /// The kernel did not answer in time: a blocking receive waited its whole time limit
    /// (`SO_RCVTIMEO`, see [`crate::Socket::set_recv_timeout`]) for a datagram.
    #[error("netlink socket {what}: no answer from the kernel within {after:?}")]
    Timeout {
        /// Which call timed out.
        what: &'static str,
        /// The time limit.
        after: Duration,
    },
    /// A kernel message ended before a header or attribute it announced.
    #[error("truncated netlink data: {0}")]
    Truncated(&'static str),
    /// A kernel message was structurally valid but had wrong contents (a length, a string).
    #[error("malformed netlink data: {0}")]
    Malformed(String),
}

impl Error {
    /// The errno of a failed socket call.
    pub fn errno(&self) -> Option<i32> {
        match self {
            Error::Io { source, .. } => source.raw_os_error(),
            _ => None,
        }
    }

    /// True when a blocking receive gave up waiting for the kernel ([`Error::Timeout`]).
    pub fn is_timeout(&self) -> bool {
        matches!(self, Error::Timeout { .. })
    }

    /// True when a receive failed with ENOBUFS: the socket's receive buffer overflowed and
    /// the kernel dropped replies (the ones that fit are still queued).
    pub fn is_overrun(&self) -> bool {
        self.errno() == Some(ENOBUFS)
    }

    /// True when a non-blocking receive found nothing queued (`EAGAIN`).
    pub fn is_would_block(&self) -> bool {
        matches!(self, Error::Io { source, .. } if source.kind() == std::io::ErrorKind::WouldBlock)
    }
}
