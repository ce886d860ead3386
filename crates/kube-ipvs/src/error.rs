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

/// Why a text value (a flag's text, a Go duration) could not be read. Its text is the
/// [`FieldError::message`] of the field that held the value.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ValueError {
    /// Not a Go duration (empty, a number without digits, or garbage).
    #[error("invalid duration {0:?}")]
    Duration(String),
    /// A Go duration with a number and no unit.
    #[error("invalid duration {0:?}: missing unit")]
    DurationMissingUnit(String),
    /// A Go duration with a unit other than ns, us (µs, μs), ms, s, m and h.
    #[error("invalid duration {text:?}: unknown unit {unit:?}")]
    DurationUnknownUnit {
        /// The whole text.
        text: String,
        /// The unit.
        unit: String,
    },
    /// A Go duration beyond what a `Duration` of nanoseconds holds.
    #[error("invalid duration {0:?}: out of range")]
    DurationOutOfRange(String),
    /// A negative Go duration (only "-0" forms are allowed).
    #[error("invalid duration {0:?}: must not be negative")]
    NegativeDuration(String),
    /// Not one of Go's `strconv.ParseBool` words.
    #[error("invalid boolean {0:?}")]
    Bool(String),
    /// Not a 64-bit integer.
    #[error("invalid integer {text:?}")]
    Int {
        /// The text.
        text: String,
        /// The parse error.
        #[source]
        source: std::num::ParseIntError,
    },
    /// Not a finite number.
    #[error("invalid number {text:?}")]
    Number {
        /// The text.
        text: String,
        /// The parse error; `None` when it parsed but is not finite (JSON has no NaN or
        /// infinity).
        #[source]
        source: Option<std::num::ParseFloatError>,
    },
    /// An entry of a `key=bool,...` map without `=`.
    #[error("invalid key=bool pair {0:?}")]
    BoolPair(String),
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
    /// The node name could not be determined ([`Error::HostnameRead`], [`Error::HostnameEmpty`]
    /// or what the host name lookup given to [`crate::config::from_sources`] failed with).
    #[error("cannot determine the node name: {0} (use --hostname-override)")]
    NodeName(#[source] Box<Error>),
    /// The kernel's host name could not be read.
    #[error("reading /proc/sys/kernel/hostname: {0}")]
    HostnameRead(#[source] std::io::Error),
    /// The host name (or `hostnameOverride`) is empty.
    #[error("the host name is empty")]
    HostnameEmpty,
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
    StaticDir(#[from] ::watch::static_dir::StaticDirError),
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
    /// The IPVS generic netlink socket could not be opened.
    #[error("IPVS: {0}")]
    Ipvs(#[source] ipvs_netlink::Error),
    /// The rtnetlink socket for `kube-ipvs0` could not be opened.
    #[error("kube-ipvs0: {0}")]
    Netif(#[source] netif::Error),
    /// The `ipset` tool is missing or does not work.
    #[error("ipset: {0} (kube-ipvs needs the ipset tool)")]
    IpsetTool(#[source] ipset::Error),
    /// No working iptables backend was found for a family.
    #[error("iptables ({family:?}): {source}")]
    Iptables {
        /// The family.
        family: ipvs_netlink::Family,
        /// What detection failed with.
        #[source]
        source: iptables::Error,
    },
    /// `route_localnet` could not be enabled for localhost node ports.
    #[error(transparent)]
    RouteLocalnet(#[from] crate::localhost::RouteLocalnetError),
    /// `plan` could not render a family's plan.
    #[error(transparent)]
    Plan(#[from] proxier::plan::PlanError),
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
