//! kube-proxy ipsets: desired state, diff and batched apply.
//!
//! Shape: [`IpsetState`] (pure desired/current state of the 17 kube-proxy sets, see
//! [`SetKind`]), [`diff`] (pure), [`render_restore`] / [`render_save`] (pure text), and the IO
//! module [`Ipset`] that reads the kernel with one `ipset save` and applies a diff with one
//! `ipset restore -exist` process per sync, or, for a small diff of members only, over the
//! kernel's ipset netlink protocol ([`netlink`], pure codec) with no process. The `exec` crate
//! starts the tool.

mod entry;
mod io;
pub mod netlink;
mod set;
mod state;

pub use entry::{Entry, Protocol};
pub use io::{
    netlink_eligible, ApplyReport, Ipset, Rejected, Runner, DEFAULT_TIMEOUT, NETLINK_MAX_MEMBERS,
};
pub use set::{Family, SetKind, SetSpec, SetType, MAX_ELEM, MAX_NAME_LEN};
pub use state::{
    diff, parse_save, render_restore, render_save, restore_lines, EntryChange, IpsetDiff,
    IpsetState, LineOrigin, SetState,
};

/// Errors of the ipset crate.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A required program is not installed (or not executable).
    #[error("required program {binary:?} not found: install the ipset package ({source})")]
    MissingBinary {
        /// The program that could not be started.
        binary: String,
        /// The spawn error.
        source: std::io::Error,
    },
    /// The kernel lacks ipset support (module ip_set / the set type missing).
    #[error("kernel support missing: {0}")]
    KernelSupport(String),
    /// Running a program failed for another reason.
    #[error("running {command}: {source}")]
    Io {
        /// The command line.
        command: String,
        /// The underlying error.
        source: std::io::Error,
    },
    /// A command exited with failure in a way not attributable to a single line.
    #[error("{command} failed: {stderr}")]
    CommandFailed {
        /// The command line.
        command: String,
        /// Its standard error.
        stderr: String,
    },
    /// Text from ipset could not be parsed.
    #[error("cannot parse ipset output: {0}")]
    Parse(String),
    /// An entry does not fit its set (type or family mismatch).
    #[error("invalid entry: {0}")]
    InvalidEntry(String),
    /// An entry was added to a set that was not declared.
    #[error("unknown set {0:?}")]
    UnknownSet(String),
    /// The ipset netlink path could not be used for a reason of its own (the namespace could
    /// not be entered, a line that is not a member).
    #[error("ipset netlink: {0}")]
    Netlink(String),
    /// The ipset netlink socket failed (the errno is kept in the source), or a kernel
    /// message could not be read.
    #[error("ipset netlink: {0}")]
    Socket(#[from] ::netlink::Error),
    /// The kernel's answer to the protocol probe could not be read.
    #[error("ipset netlink: ipset protocol reply: {0}")]
    ProtocolReply(#[source] ::netlink::Error),
    /// `ipset` did not finish within its time limit ([`Runner::with_timeout`]); it was killed.
    #[error("{command} did not finish within {limit:?}; killed")]
    Timeout {
        /// The command line.
        command: String,
        /// The time limit it exceeded.
        limit: std::time::Duration,
    },
}

impl From<exec::Error> for Error {
    fn from(e: exec::Error) -> Self {
        match e {
            exec::Error::MissingBinary(binary, source) => Error::MissingBinary { binary, source },
            exec::Error::Io(command, source) => Error::Io { command, source },
            exec::Error::Timeout { command, limit } => Error::Timeout { command, limit },
        }
    }
}

/// Result alias.
pub type Result<T, E = Error> = std::result::Result<T, E>;
