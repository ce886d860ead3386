//! The kube-ipvs binary's error type.

use std::path::PathBuf;

/// One invalid configuration value, named by its field path (and the flag, if it came from one).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FieldError {
    /// Where the value came from, e.g. `ipvs.syncPeriod` or `--ipvs-sync-period (ipvs.syncPeriod)`.
    pub field: String,
    /// What is wrong with it.
    pub message: String,
}

impl std::fmt::Display for FieldError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}: {}", self.field, self.message)
    }
}

/// Errors of the kube-ipvs binary.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The command line could not be parsed (includes `--help` and `--version` output).
    #[error(transparent)]
    Cli(#[from] clap::Error),
    /// The `--config` file could not be read.
    #[error("reading config file {}: {source}", path.display())]
    ConfigRead {
        /// The file.
        path: PathBuf,
        /// The IO error.
        source: std::io::Error,
    },
    /// The `--config` file is not valid YAML or not a KubeProxyConfiguration.
    #[error("config file {}: {message}", path.display())]
    ConfigParse {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        message: String,
    },
    /// One or more configuration values are invalid; each names its field.
    #[error("invalid configuration:\n  {}", .0.iter().map(ToString::to_string).collect::<Vec<_>>().join("\n  "))]
    InvalidConfig(Vec<FieldError>),
    /// The node name could not be determined.
    #[error("cannot determine the node name: {0} (use --hostname-override)")]
    NodeName(String),
    /// IPVS cannot be used and `--ipvs-fallback=false` forbids falling back to iptables mode.
    #[error("IPVS proxy mode is not usable on this node ({reason}) and --ipvs-fallback=false forbids falling back to iptables mode")]
    IpvsUnavailable {
        /// Why IPVS is not usable.
        reason: String,
    },
    /// An HTTP server could not bind its address.
    #[error("binding {what} server to {addr}: {source}")]
    Bind {
        /// Which server (healthz, metrics, health check node port).
        what: String,
        /// The address.
        addr: std::net::SocketAddr,
        /// The IO error.
        source: std::io::Error,
    },
    /// An HTTP server failed while serving.
    #[error("{what} server: {source}")]
    Serve {
        /// Which server.
        what: String,
        /// The IO error.
        source: std::io::Error,
    },
    /// The static directory source failed.
    #[error(transparent)]
    StaticDir(#[from] controller::source::static_dir::StaticDirError),
    /// The Kubernetes client could not be configured.
    #[error("kubernetes client: {0}")]
    Kube(String),
    /// Logging could not be initialised.
    #[error("logging: {0}")]
    Logging(String),
    /// The requested operation is not available in this build.
    #[error("{0}")]
    Unsupported(String),
    /// A `conntrack.*` setting had to change the kernel's value and could not (kube-proxy exits
    /// in the same case).
    #[error("could not set conntrack parameters from the configuration: {0}")]
    Conntrack(String),
    /// The sync engine could not start or finished with errors (IPVS, kube-ipvs0, ipset,
    /// iptables, or a `--once` sync that failed).
    #[error("{0}")]
    Engine(String),
    /// Writing output (plan, defaults) failed.
    #[error("writing output: {0}")]
    Output(#[from] std::io::Error),
}

/// Result with the crate's [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;
