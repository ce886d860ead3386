//! The crate's error type (codec and client): kernel errors keep the errno and the operation;
//! the netlink layer's errors ([`netlink::Error`]) arrive through `From`, variant for variant,
//! so a socket error keeps its `std::io::Error` and errno.

use std::fmt;

/// The IPVS operation an error belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum OpKind {
    /// Generic netlink family lookup (`CTRL_CMD_GETFAMILY`).
    ResolveFamily,
    /// `IPVS_CMD_NEW_SERVICE`.
    NewService,
    /// `IPVS_CMD_SET_SERVICE`.
    SetService,
    /// `IPVS_CMD_DEL_SERVICE`.
    DelService,
    /// `IPVS_CMD_GET_SERVICE` (single or dump).
    GetService,
    /// `IPVS_CMD_NEW_DEST`.
    NewDest,
    /// `IPVS_CMD_SET_DEST`.
    SetDest,
    /// `IPVS_CMD_DEL_DEST`.
    DelDest,
    /// `IPVS_CMD_GET_DEST` (dump).
    GetDest,
    /// `IPVS_CMD_SET_CONFIG`.
    SetConfig,
    /// `IPVS_CMD_GET_CONFIG`.
    GetConfig,
    /// `IPVS_CMD_GET_INFO`.
    GetInfo,
    /// `IPVS_CMD_FLUSH`.
    Flush,
}

impl OpKind {
    /// Every operation, in a fixed order (the index of [`OpKind::index`]).
    pub const ALL: [OpKind; 13] = [
        OpKind::ResolveFamily,
        OpKind::NewService,
        OpKind::SetService,
        OpKind::DelService,
        OpKind::GetService,
        OpKind::NewDest,
        OpKind::SetDest,
        OpKind::DelDest,
        OpKind::GetDest,
        OpKind::SetConfig,
        OpKind::GetConfig,
        OpKind::GetInfo,
        OpKind::Flush,
    ];

    /// Position in [`OpKind::ALL`].
    pub fn index(self) -> usize {
        self as usize
    }

    /// True for a command that changes the kernel's table or settings (not a read, not the
    /// family lookup).
    pub fn is_write(self) -> bool {
        matches!(
            self,
            OpKind::NewService
                | OpKind::SetService
                | OpKind::DelService
                | OpKind::NewDest
                | OpKind::SetDest
                | OpKind::DelDest
                | OpKind::SetConfig
                | OpKind::Flush
        )
    }

    /// A short snake_case name (a fixed set: metric label values), e.g. `new_service`.
    pub fn as_str(self) -> &'static str {
        match self {
            OpKind::ResolveFamily => "resolve_family",
            OpKind::NewService => "new_service",
            OpKind::SetService => "set_service",
            OpKind::DelService => "del_service",
            OpKind::GetService => "get_service",
            OpKind::NewDest => "new_dest",
            OpKind::SetDest => "set_dest",
            OpKind::DelDest => "del_dest",
            OpKind::GetDest => "get_dest",
            OpKind::SetConfig => "set_config",
            OpKind::GetConfig => "get_config",
            OpKind::GetInfo => "get_info",
            OpKind::Flush => "flush",
        }
    }
}

impl fmt::Display for OpKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let s = match self {
            OpKind::ResolveFamily => "resolve IPVS family",
            OpKind::NewService => "add service",
            OpKind::SetService => "edit service",
            OpKind::DelService => "delete service",
            OpKind::GetService => "get service",
            OpKind::NewDest => "add destination",
            OpKind::SetDest => "edit destination",
            OpKind::DelDest => "delete destination",
            OpKind::GetDest => "get destinations",
            OpKind::SetConfig => "set timeouts",
            OpKind::GetConfig => "get timeouts",
            OpKind::GetInfo => "get info",
            OpKind::Flush => "flush",
        };
        f.write_str(s)
    }
}

/// A line of `ipvsadm -S` text that could not be parsed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ParseError {
    /// 1-based line number.
    pub line: usize,
    /// What is wrong.
    pub message: String,
}

impl fmt::Display for ParseError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "line {}: {}", self.line, self.message)
    }
}

impl std::error::Error for ParseError {}

/// Errors of the IPVS codec and client. The netlink framing and socket (the `netlink` crate)
/// raise [`Error::Io`], [`Error::Timeout`], [`Error::Truncated`] and [`Error::Malformed`]
/// (see `From<netlink::Error>`).
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The "IPVS" generic netlink family is not registered: IPVS is not available in this kernel.
    #[error("IPVS is not available: generic netlink family \"IPVS\" not found")]
    FamilyMissing,
    /// The kernel rejected an operation; `errno` is the positive error number (EEXIST, ENOENT, ...).
    #[error("{op}: {}", std::io::Error::from_raw_os_error(*errno))]
    Kernel {
        /// The operation that failed.
        op: OpKind,
        /// Positive errno reported by the kernel.
        errno: i32,
    },
    /// A socket call failed.
    #[error("netlink socket {what}: {source}")]
    Io {
        /// Which call failed.
        what: &'static str,
        /// The underlying error.
        #[source]
        source: std::io::Error,
    },
    /// The kernel did not answer in time: a blocking receive waited its whole time limit
    /// (`SO_RCVTIMEO`, see [`netlink::Socket::set_recv_timeout`]) for a datagram.
    #[error("netlink socket {what}: no answer from the kernel within {after:?}")]
    Timeout {
        /// Which call timed out.
        what: &'static str,
        /// The time limit.
        after: std::time::Duration,
    },
    /// A kernel reply ended before a header or attribute it announced.
    #[error("truncated netlink data: {0}")]
    Truncated(&'static str),
    /// A kernel reply was structurally valid but had wrong contents (length, missing attribute, value).
    #[error("malformed netlink data: {0}")]
    Malformed(String),
    /// A request could not be encoded (e.g. a scheduler name longer than the kernel allows).
    #[error("invalid request: {0}")]
    Invalid(String),
    /// The kernel did not answer a request (the reply stream ended without an ACK for it).
    #[error("{op}: no reply from the kernel")]
    NoReply {
        /// The operation left unanswered.
        op: OpKind,
    },
    /// `ipvsadm -S` text could not be parsed.
    #[error("{0}")]
    Parse(#[from] ParseError),
}

impl From<netlink::Error> for Error {
    /// The netlink layer's errors keep their variant (and an `Io` error its errno).
    fn from(e: netlink::Error) -> Self {
        match e {
            netlink::Error::Io { what, source } => Error::Io { what, source },
            netlink::Error::Timeout { what, after } => Error::Timeout { what, after },
            netlink::Error::Truncated(what) => Error::Truncated(what),
            netlink::Error::Malformed(m) => Error::Malformed(m),
        }
    }
}

impl Error {
    /// The kernel errno, if this is a kernel error.
    pub fn errno(&self) -> Option<i32> {
        match self {
            Error::Kernel { errno, .. } => Some(*errno),
            _ => None,
        }
    }

    /// The operation, if known.
    pub fn op(&self) -> Option<OpKind> {
        match self {
            Error::Kernel { op, .. } | Error::NoReply { op } => Some(*op),
            _ => None,
        }
    }

    /// True for EEXIST (the service or destination already exists).
    pub fn is_exists(&self) -> bool {
        self.errno() == Some(libc_errno::EEXIST)
    }

    /// True for ENOENT or ESRCH (the service, destination or scheduler does not exist).
    pub fn is_not_found(&self) -> bool {
        matches!(
            self.errno(),
            Some(libc_errno::ENOENT) | Some(libc_errno::ESRCH)
        )
    }

    /// True for EPERM (missing CAP_NET_ADMIN).
    pub fn is_permission(&self) -> bool {
        self.errno() == Some(libc_errno::EPERM)
    }

    /// True for EINVAL.
    pub fn is_invalid(&self) -> bool {
        self.errno() == Some(libc_errno::EINVAL)
    }

    /// True when a blocking receive gave up waiting for the kernel ([`Error::Timeout`]).
    pub fn is_timeout(&self) -> bool {
        matches!(self, Error::Timeout { .. })
    }

    /// True when a receive failed with ENOBUFS: the socket's receive buffer overflowed and
    /// the kernel dropped replies (the ones that fit are still queued).
    pub fn is_overrun(&self) -> bool {
        matches!(self, Error::Io { source, .. } if source.raw_os_error() == Some(libc_errno::ENOBUFS))
    }
}

/// Linux errno values used by the error helpers.
pub mod libc_errno {
    /// Operation not permitted.
    pub const EPERM: i32 = 1;
    /// No such file or directory.
    pub const ENOENT: i32 = 2;
    /// No such process (IPVS: no such service).
    pub const ESRCH: i32 = 3;
    /// File exists.
    pub const EEXIST: i32 = 17;
    /// Invalid argument.
    pub const EINVAL: i32 = 22;
    /// Address family not supported.
    pub const EAFNOSUPPORT: i32 = 97;
    /// Out of memory.
    pub const ENOMEM: i32 = 12;
    /// No buffer space available (a netlink receive buffer overflowed).
    pub const ENOBUFS: i32 = 105;
}

#[cfg(test)]
mod op_kind_tests {
    use super::OpKind;
    use crate::OpCounts;

    /// Reads (single or dump) and the family lookup are not writes: the proxy's
    /// `ipvs_writes` counted every non-dump request until a drift-check slice's single
    /// GET_SERVICE requests showed up as 100 "writes" in the controller benchmark.
    #[test]
    fn only_commands_that_change_the_kernel_are_writes() {
        let mut c = OpCounts::default();
        for op in [
            OpKind::ResolveFamily,
            OpKind::GetService,
            OpKind::GetService,
            OpKind::GetDest,
            OpKind::GetInfo,
            OpKind::GetConfig,
            OpKind::NewDest,
            OpKind::SetService,
            OpKind::Flush,
        ] {
            c.inc(op);
        }
        assert_eq!(c.writes(), 3);
        assert_eq!(c.total(), 9);
        assert_eq!(OpKind::ALL.iter().filter(|o| o.is_write()).count(), 8);
    }

    #[test]
    fn all_is_indexed_in_order_with_distinct_labels() {
        let mut labels = std::collections::BTreeSet::new();
        for (i, op) in OpKind::ALL.iter().enumerate() {
            assert_eq!(op.index(), i, "{op:?}");
            assert!(
                labels.insert(op.as_str()),
                "duplicate label {}",
                op.as_str()
            );
        }
    }

    #[test]
    fn op_counts_count_each_kind() {
        let mut c = OpCounts::default();
        c.inc(OpKind::NewService);
        c.inc(OpKind::NewService);
        c.inc(OpKind::GetDest);
        assert_eq!(c.get(OpKind::NewService), 2);
        assert_eq!(c.get(OpKind::GetDest), 1);
        assert_eq!(c.get(OpKind::Flush), 0);
        assert_eq!(c.total(), 3);
        assert_eq!(c.iter().count(), OpKind::ALL.len());
    }
}
