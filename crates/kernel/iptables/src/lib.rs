//! kube-proxy iptables rules: render, diff and iptables-restore.
//!
//! Shape: [`render_ipvs_mode`] turns a pure [`IpvsModeInput`] into a [`RuleSet`] (one
//! `iptables-restore` payload per table plus the jumps from built-in chains it needs); the IO
//! type [`Iptables`] applies a rule set with one `iptables-restore --noflush -w 5 -W 100000` per table
//! whose text changed, on the backend (nft or legacy) the node already uses.

mod backend;
mod io;
mod ipvs_mode;
pub mod proxy_mode;
mod rules;

pub use backend::{parse_version, pick_backend, random_fully_supported, Backend};
pub use io::{
    ApplyOutcome, Iptables, Runner, DEFAULT_TIMEOUT, XTABLES_WAIT_INTERVAL_MICROS,
    XTABLES_WAIT_SECONDS,
};
pub use ipset::Family;
pub use ipvs_mode::{
    chains as ipvs_chains, jumps as ipvs_jumps, render_ipvs_mode, InClusterMark, IpvsModeInput,
    LocalDetect, NoNodeAccess,
};
pub use rules::{Jump, RuleSet, Table};

/// Errors of the iptables crate.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A required program is not installed (or not executable).
    #[error("required program {binary:?} not found: install iptables ({source})")]
    MissingBinary {
        /// The program that could not be started.
        binary: String,
        /// The spawn error.
        source: std::io::Error,
    },
    /// Running a program failed for another reason.
    #[error("running {command}: {source}")]
    Io {
        /// The command line.
        command: String,
        /// The underlying error.
        source: std::io::Error,
    },
    /// `iptables-restore` rejected the input.
    #[error("{command} failed for table {table}{}: {stderr}", line.as_ref().map(|(n, l)| format!(" at line {n} ({l})")).unwrap_or_default())]
    RestoreFailed {
        /// The command line.
        command: String,
        /// The table being restored.
        table: Table,
        /// Failing line number and text, when iptables-restore named one.
        line: Option<(usize, String)>,
        /// Its standard error.
        stderr: String,
    },
    /// Another command failed.
    #[error("{command} failed: {stderr}")]
    CommandFailed {
        /// The command line.
        command: String,
        /// Its standard error.
        stderr: String,
    },
    /// The kernel lacks a feature the rules need (a table, match or target).
    #[error("kernel support missing: {0}")]
    KernelSupport(String),
    /// Invalid input to the renderer.
    #[error("invalid input: {0}")]
    InvalidInput(String),
    /// Output of an iptables program could not be understood.
    #[error("cannot parse: {0}")]
    Parse(String),
    /// `iptables-restore` gave up waiting for the xtables lock another program holds (after
    /// [`XTABLES_WAIT_SECONDS`], like upstream's `--wait 5`). Nothing was changed.
    #[error(
        "{command}: the xtables lock is held by another program (waited {}s): {stderr}",
        XTABLES_WAIT_SECONDS
    )]
    LockTimeout {
        /// The command line.
        command: String,
        /// Its standard error.
        stderr: String,
    },
    /// An iptables program did not finish within its time limit ([`Runner::timeout`]); it was
    /// killed.
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
