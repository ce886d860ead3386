//! The xtask error type: every failure the runner reports, with a clear message.

use std::fmt;
use std::io;

/// Everything that can go wrong in `cargo xtask`.
#[derive(Debug)]
pub enum Error {
    /// The command line could not be understood.
    Usage(String),
    /// A host program could not be started or exited unsuccessfully.
    Command {
        /// The command line that failed.
        cmd: String,
        /// What went wrong (exit status and the tail of its stderr).
        detail: String,
    },
    /// The operation needs root (installing packages, network namespaces).
    NotRoot(String),
    /// apt/dpkg is missing or an apt operation failed.
    Apt(String),
    /// No usable Debian cloud kernel package could be found or unpacked.
    Kernel(String),
    /// A filesystem or process operation failed.
    Io {
        /// What was being done.
        context: String,
        /// The underlying error.
        source: io::Error,
    },
    /// QEMU failed to start or exited without running the command.
    Qemu(String),
    /// The guest kernel panicked; the message carries the console tail.
    GuestPanic(String),
    /// The VM did not finish within its time limit.
    Timeout(String),
    /// Output of cargo or a test binary could not be parsed.
    Parse(String),
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Error::Usage(m) => write!(f, "usage: {m}"),
            Error::Command { cmd, detail } => write!(f, "command `{cmd}` failed: {detail}"),
            Error::NotRoot(m) => write!(f, "must run as root: {m}"),
            Error::Apt(m) => write!(f, "apt: {m}"),
            Error::Kernel(m) => write!(f, "kernel: {m}"),
            Error::Io { context, source } => write!(f, "{context}: {source}"),
            Error::Qemu(m) => write!(f, "qemu: {m}"),
            Error::GuestPanic(m) => write!(f, "guest kernel panic:\n{m}"),
            Error::Timeout(m) => write!(f, "timeout: {m}"),
            Error::Parse(m) => write!(f, "parse: {m}"),
        }
    }
}

impl std::error::Error for Error {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            Error::Io { source, .. } => Some(source),
            _ => None,
        }
    }
}

/// Shorthand result type.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Attach a human context to io errors.
pub trait Context<T> {
    /// Wrap the error with `what` (evaluated lazily).
    fn ctx<S: Into<String>>(self, what: impl FnOnce() -> S) -> Result<T>;
}

impl<T> Context<T> for io::Result<T> {
    fn ctx<S: Into<String>>(self, what: impl FnOnce() -> S) -> Result<T> {
        self.map_err(|source| Error::Io {
            context: what().into(),
            source,
        })
    }
}
