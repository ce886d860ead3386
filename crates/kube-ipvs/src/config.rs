//! The validated configuration: KubeProxyConfiguration file + flags + defaults → [`Config`].
//!
//! Order, like upstream: defaults (from [`crate::settings::SETTINGS`]) < `--config` file <
//! command-line flags. In the file, `null` and (for fields upstream defaults that way) the zero
//! value mean "default", so the file `kubeadm` writes (full of `0s`, `""`, `null`) works.
//! Unknown fields and set-but-ignored fields give one warning each; invalid values are errors
//! naming the field path (or the flag), and all of them are reported together.

use std::collections::BTreeMap;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::path::{Path, PathBuf};
use std::time::Duration;

use ipnet::IpNet;
use serde_json::Value;

use crate::cli::Args;
use crate::error::{Error, FieldError, Result};
use crate::settings::{self, Setting, Support, SETTINGS};

/// The config file's apiVersion.
pub const API_VERSION: &str = "kubeproxy.config.k8s.io/v1alpha1";
/// The config file's kind.
pub const KIND: &str = "KubeProxyConfiguration";
/// IPVS schedulers accepted by `ipvs.scheduler`: the kernel's, the same table as the
/// `kube-ipvs.io/scheduler` annotation's (see [`ipvs_netlink::SCHEDULERS`] for why `fo` and
/// `ovf` are accepted too).
pub use ipvs_netlink::SCHEDULERS;
/// Default port of the healthz server.
pub const HEALTHZ_PORT: u16 = 10256;
/// Default port of the metrics server.
pub const METRICS_PORT: u16 = 10249;

/// The proxy mode asked for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ProxyMode {
    /// IPVS (the default, also for `mode: ""`).
    Ipvs,
    /// iptables (kube-ipvs's own iptables mode; also the fallback when IPVS is unusable).
    Iptables,
}

impl ProxyMode {
    /// The name used in configs and the `kube_ipvs_proxy_mode{mode}` metric.
    pub fn as_str(self) -> &'static str {
        match self {
            ProxyMode::Ipvs => "ipvs",
            ProxyMode::Iptables => "iptables",
        }
    }
}

/// Log output format.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LogFormat {
    /// Human-readable lines.
    Text,
    /// One JSON object per line.
    Json,
}

/// How traffic from local pods is recognised (`detectLocalMode`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DetectLocal {
    /// Source in `clusterCIDR` (no detection if that is empty).
    ClusterCidr,
    /// Source in the Node's `spec.podCIDRs`.
    NodeCidr,
    /// Arriving on this bridge.
    BridgeInterface(String),
    /// Arriving on an interface whose name starts with this prefix.
    InterfaceNamePrefix(String),
}

/// One `nodePortAddresses` entry.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum NodePortAddress {
    /// A CIDR; node IPs inside it serve NodePorts.
    Cidr(IpNet),
    /// `primary`: the Node object's primary IPv4 and/or IPv6 address.
    Primary,
}

/// How to reach the API server.
#[derive(Debug, Clone, PartialEq)]
pub struct KubeClientConfig {
    /// `--kubeconfig` / `clientConnection.kubeconfig`; `None`: in-cluster (or `$KUBECONFIG`).
    pub kubeconfig: Option<PathBuf>,
    /// `--master`: overrides the kubeconfig's server URL.
    pub master: Option<String>,
    /// Client-side QPS limit.
    pub qps: f64,
    /// Client-side burst.
    pub burst: u32,
    /// Time limit of connecting to the API server ([`crate::daemon::KUBE_CONNECT_TIMEOUT`]).
    pub connect_timeout: Duration,
    /// Time limit of writing one request ([`crate::daemon::KUBE_WRITE_TIMEOUT`]).
    pub write_timeout: Duration,
    /// Longest silence of the API server on a request in flight
    /// ([`crate::daemon::KUBE_READ_TIMEOUT`]; above the server-side watch timeout).
    pub read_timeout: Duration,
}

/// IPVS settings (`ipvs.*`).
#[derive(Debug, Clone, PartialEq)]
pub struct IpvsConfig {
    /// Full resync period (> 0).
    pub sync_period: Duration,
    /// Minimum time between syncs (≤ `sync_period`).
    pub min_sync_period: Duration,
    /// Scheduler name, one of [`SCHEDULERS`].
    pub scheduler: String,
    /// Services in these ranges are never deleted.
    pub exclude_cidrs: Vec<IpNet>,
    /// arp_ignore=1 / arp_announce=2.
    pub strict_arp: bool,
    /// `ipvsadm --set` TCP timeout; zero: leave.
    pub tcp_timeout: Duration,
    /// TCP FIN timeout; zero: leave.
    pub tcp_fin_timeout: Duration,
    /// UDP timeout; zero: leave.
    pub udp_timeout: Duration,
}

/// iptables settings (`iptables.*`); masquerade settings apply to IPVS mode too.
#[derive(Debug, Clone, PartialEq)]
pub struct IptablesConfig {
    /// Masquerade everything sent to service IPs.
    pub masquerade_all: bool,
    /// fwmark bit (0..=31) of the masquerade mark.
    pub masquerade_bit: u8,
    /// iptables mode: NodePorts on 127.0.0.1.
    pub localhost_node_ports: bool,
    /// iptables mode: full resync period.
    pub sync_period: Duration,
    /// iptables mode: minimum time between syncs.
    pub min_sync_period: Duration,
}

/// conntrack settings (`conntrack.*`), applied at startup in both modes
/// ([`crate::engine::apply_conntrack`]); zero / `false`: leave the kernel's value.
#[derive(Debug, Clone, PartialEq)]
pub struct ConntrackConfig {
    /// nf_conntrack_max per CPU (0: leave as is and ignore `min`).
    pub max_per_core: u32,
    /// Minimum nf_conntrack_max.
    pub min: u32,
    /// TCP established timeout; zero: leave.
    pub tcp_established_timeout: Duration,
    /// TCP CLOSE_WAIT timeout; zero: leave.
    pub tcp_close_wait_timeout: Duration,
    /// nf_conntrack_tcp_be_liberal=1.
    pub tcp_be_liberal: bool,
    /// UDP unreplied timeout; zero: leave.
    pub udp_timeout: Duration,
    /// UDP assured timeout; zero: leave.
    pub udp_stream_timeout: Duration,
}

/// Everything kube-ipvs needs to run, validated.
#[derive(Debug, Clone, PartialEq)]
pub struct Config {
    /// The `--config` file, if any.
    pub config_file: Option<PathBuf>,
    /// Mode asked for (see [`crate::mode::select`] for the mode actually used).
    pub mode: ProxyMode,
    /// If IPVS is unusable: fall back to iptables mode (true) or exit (false).
    pub ipvs_fallback: bool,
    /// This node's name (`hostnameOverride` or the host name, lower-cased).
    pub node_name: String,
    /// API server connection.
    pub kube: KubeClientConfig,
    /// `--source-dir`: read objects from this directory instead of the API server.
    pub source_dir: Option<PathBuf>,
    /// `--once`: sync once and exit.
    pub once: bool,
    /// `--cleanup`: remove what kube-ipvs programmed and exit.
    pub cleanup: bool,
    /// Longest time a removed TCP real server is drained.
    pub drain_timeout: Duration,
    /// Time limit of one `ipset` process (`--ipset-timeout`).
    pub ipset_timeout: Duration,
    /// Time limit of one `iptables-save` / `iptables-restore` (`--iptables-timeout`).
    pub iptables_timeout: Duration,
    /// Root of the sysctl tree (`--sysctl-root`, default `/proc/sys`).
    pub sysctl_root: PathBuf,
    /// Root of sysfs (`--sysfs-root`, default `/sys`).
    pub sysfs_root: PathBuf,
    /// This node's primary IP override (`bindAddress`; unspecified if unset).
    pub bind_address: IpAddr,
    /// `/healthz` + `/livez` server address.
    pub healthz_bind_address: SocketAddr,
    /// `/metrics` server address.
    pub metrics_bind_address: SocketAddr,
    /// Exit if a server cannot bind.
    pub bind_address_hard_fail: bool,
    /// IPVS settings.
    pub ipvs: IpvsConfig,
    /// iptables settings.
    pub iptables: IptablesConfig,
    /// Pod network CIDRs (0, 1 or a dual-stack pair).
    pub cluster_cidrs: Vec<IpNet>,
    /// Local traffic detection.
    pub detect_local: DetectLocal,
    /// NodePort addresses; empty: every node IP.
    pub node_port_addresses: Vec<NodePortAddress>,
    /// oom_score_adj for the process.
    pub oom_score_adj: i32,
    /// conntrack settings.
    pub conntrack: ConntrackConfig,
    /// Informer resync period.
    pub config_sync_period: Duration,
    /// Feature gates as given (kube-ipvs has none; kept for logging).
    pub feature_gates: BTreeMap<String, bool>,
    /// klog-style verbosity.
    pub verbosity: u8,
    /// Log format.
    pub log_format: LogFormat,
}

impl Config {
    /// The sync period of the selected mode.
    pub fn sync_period(&self, mode: ProxyMode) -> Duration {
        match mode {
            ProxyMode::Ipvs => self.ipvs.sync_period,
            ProxyMode::Iptables => self.iptables.sync_period,
        }
    }

    /// The minimum sync period of the selected mode.
    pub fn min_sync_period(&self, mode: ProxyMode) -> Duration {
        match mode {
            ProxyMode::Ipvs => self.ipvs.min_sync_period,
            ProxyMode::Iptables => self.iptables.min_sync_period,
        }
    }
}

/// A validated config plus the warnings (unknown / ignored fields) to log once.
#[derive(Debug, Clone)]
pub struct Loaded {
    /// The configuration.
    pub config: Config,
    /// One line per unknown or ignored field.
    pub warnings: Vec<String>,
}

/// Where a value came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Origin {
    Default,
    File,
    Flag(&'static str),
}

fn key(st: &Setting) -> &'static str {
    st.field.or(st.flag).unwrap_or_default()
}

/// The host name, from the kernel.
pub fn system_hostname() -> Result<String> {
    std::fs::read_to_string("/proc/sys/kernel/hostname").map_err(Error::HostnameRead)
}

/// Loads the config for a parsed command line: reads `--config` if given, uses the kernel's
/// host name unless overridden.
pub fn load(args: &Args) -> Result<Loaded> {
    let file = match args.flag("config").filter(|p| !p.is_empty()) {
        Some(p) => {
            let path = PathBuf::from(p);
            let text = std::fs::read_to_string(&path).map_err(|source| Error::ConfigRead {
                path: path.clone(),
                source,
            })?;
            Some((path, text))
        }
        None => None,
    };
    from_sources(
        file.as_ref().map(|(p, t)| (p.as_path(), t.as_str())),
        &args.flags,
        system_hostname,
    )
}

/// Builds the config from an optional file `(path, text)`, the command-line flags, and a host
/// name lookup (called only if no `hostnameOverride` is given; its error becomes
/// [`Error::NodeName`]).
pub fn from_sources(
    file: Option<(&Path, &str)>,
    flags: &[(&'static Setting, String)],
    hostname: impl FnOnce() -> Result<String>,
) -> Result<Loaded> {
    let mut values: BTreeMap<&'static str, (Value, Origin)> = BTreeMap::new();
    let mut warnings = Vec::new();
    let mut errors = Vec::new();
    for st in SETTINGS {
        let v = settings::parse_text(st.ty, st.default).unwrap_or(Value::Null);
        values.insert(key(st), (v, Origin::Default));
    }

    if let Some((path, text)) = file {
        let doc: Value = serde_saphyr::from_str(text).map_err(|e| Error::ConfigParse {
            path: path.to_path_buf(),
            message: e.to_string(),
        })?;
        let Value::Object(map) = doc else {
            return Err(Error::ConfigParse {
                path: path.to_path_buf(),
                message: format!("expected a {KIND} mapping"),
            });
        };
        let api = map
            .get("apiVersion")
            .and_then(Value::as_str)
            .unwrap_or_default();
        let kind = map.get("kind").and_then(Value::as_str).unwrap_or_default();
        if api != API_VERSION || kind != KIND {
            return Err(Error::ConfigParse {
                path: path.to_path_buf(),
                message: format!(
                    "expected apiVersion {API_VERSION:?} and kind {KIND:?}, got {api:?} and {kind:?}"
                ),
            });
        }
        walk_file("", &map, &mut values, &mut warnings);
    }

    for (st, text) in flags {
        let Some(flag) = st.flag else { continue };
        match settings::parse_text(st.ty, text) {
            Ok(v) => {
                if let Support::Ignored(why) = st.support {
                    if !settings::is_zero(&v) {
                        warnings.push(format!("--{flag} is ignored: {why}"));
                    }
                }
                values.insert(key(st), (v, Origin::Flag(flag)));
            }
            Err(e) => errors.push(FieldError {
                field: format!("--{flag}"),
                message: e.to_string(),
            }),
        }
    }

    let mut cx = Ctx { values, errors };
    let config = build(&mut cx, hostname);
    if !cx.errors.is_empty() {
        return Err(Error::InvalidConfig(cx.errors));
    }
    let config = config?;
    Ok(Loaded { config, warnings })
}

fn walk_file(
    prefix: &str,
    map: &serde_json::Map<String, Value>,
    values: &mut BTreeMap<&'static str, (Value, Origin)>,
    warnings: &mut Vec<String>,
) {
    for (k, v) in map {
        let path = if prefix.is_empty() {
            k.clone()
        } else {
            format!("{prefix}.{k}")
        };
        if let Some(st) = settings::by_field(&path) {
            if v.is_null() || (st.zero_is_unset && settings::is_zero(v)) {
                continue;
            }
            if let Support::Ignored(why) = st.support {
                if !settings::is_zero(v) {
                    warnings.push(format!("field {path} is ignored: {why}"));
                }
            }
            values.insert(key(st), (v.clone(), Origin::File));
        } else if settings::is_parent(&path) {
            match v {
                Value::Object(m) => walk_file(&path, m, values, warnings),
                Value::Null => {}
                _ => warnings.push(format!("field {path} should be a mapping; ignored")),
            }
        } else {
            warnings.push(format!("unknown field {path} (ignored)"));
        }
    }
}

struct Ctx {
    values: BTreeMap<&'static str, (Value, Origin)>,
    errors: Vec<FieldError>,
}

impl Ctx {
    fn name(&self, key: &str) -> String {
        match self.values.get(key) {
            Some((_, Origin::Flag(f))) => format!("--{f}"),
            Some((_, Origin::Default)) => format!("{key} (default)"),
            _ => key.to_string(),
        }
    }

    fn has_error(&self, key: &str) -> bool {
        let name = self.name(key);
        self.errors.iter().any(|e| e.field == name)
    }

    fn origin(&self, key: &str) -> Origin {
        self.values
            .get(key)
            .map(|(_, o)| *o)
            .unwrap_or(Origin::Default)
    }

    fn err(&mut self, key: &str, message: impl Into<String>) {
        self.errors.push(FieldError {
            field: self.name(key),
            message: message.into(),
        });
    }

    fn value(&self, key: &str) -> Value {
        self.values
            .get(key)
            .map(|(v, _)| v.clone())
            .unwrap_or(Value::Null)
    }

    fn boolean(&mut self, key: &str) -> bool {
        match self.value(key) {
            Value::Bool(b) => b,
            Value::Null => false,
            other => {
                self.err(key, format!("expected true or false, got {other}"));
                false
            }
        }
    }

    fn int(&mut self, key: &str, min: i64, max: i64) -> i64 {
        match self.value(key) {
            Value::Number(n) => match n.as_i64() {
                Some(i) if (min..=max).contains(&i) => i,
                Some(i) => {
                    self.err(key, format!("{i} is out of range {min}..={max}"));
                    min.max(0).min(max)
                }
                None => {
                    self.err(key, format!("expected an integer, got {n}"));
                    min.max(0).min(max)
                }
            },
            Value::Null => min.max(0).min(max),
            other => {
                self.err(key, format!("expected an integer, got {other}"));
                min.max(0).min(max)
            }
        }
    }

    fn float(&mut self, key: &str) -> f64 {
        match self.value(key) {
            Value::Number(n) => match n.as_f64() {
                Some(f) if f >= 0.0 => f,
                _ => {
                    self.err(key, format!("must be a number >= 0, got {n}"));
                    0.0
                }
            },
            Value::Null => 0.0,
            other => {
                self.err(key, format!("expected a number, got {other}"));
                0.0
            }
        }
    }

    fn string(&mut self, key: &str) -> String {
        match self.value(key) {
            Value::String(s) => s,
            Value::Null => String::new(),
            other => {
                self.err(key, format!("expected a string, got {other}"));
                String::new()
            }
        }
    }

    fn duration(&mut self, key: &str) -> Duration {
        match self.value(key) {
            Value::String(s) => match crate::duration::parse(&s) {
                Ok(d) => d,
                Err(e) => {
                    self.err(key, e.to_string());
                    Duration::ZERO
                }
            },
            Value::Null => Duration::ZERO,
            other => {
                self.err(
                    key,
                    format!("expected a duration string like \"30s\", got {other}"),
                );
                Duration::ZERO
            }
        }
    }

    fn list(&mut self, key: &str) -> Vec<String> {
        match self.value(key) {
            Value::Array(a) => {
                let mut out = Vec::new();
                for (i, v) in a.into_iter().enumerate() {
                    match v {
                        Value::String(s) => out.push(s),
                        other => self.err(
                            &format!("{key}[{i}]"),
                            format!("expected a string, got {other}"),
                        ),
                    }
                }
                out
            }
            Value::Null => Vec::new(),
            other => {
                self.err(key, format!("expected a list of strings, got {other}"));
                Vec::new()
            }
        }
    }

    fn cidr(&mut self, key: &str, index: Option<usize>, s: &str) -> Option<IpNet> {
        match s.trim().parse::<IpNet>() {
            Ok(n) => Some(n.trunc()),
            Err(_) => {
                let field = match index {
                    Some(i) => format!("{}[{i}]", self.name(key)),
                    None => self.name(key),
                };
                self.errors.push(FieldError {
                    field,
                    message: format!("invalid CIDR {s:?}"),
                });
                None
            }
        }
    }

    fn bind(&mut self, key: &str, default_port: u16, default_ip: IpAddr) -> SocketAddr {
        let s = self.string(key);
        if self.origin(key) == Origin::Default {
            return SocketAddr::new(default_ip, default_port);
        }
        if let Ok(a) = s.parse::<SocketAddr>() {
            return a;
        }
        let bare = s.trim_start_matches('[').trim_end_matches(']');
        if let Ok(ip) = bare.parse::<IpAddr>() {
            return SocketAddr::new(ip, default_port);
        }
        self.err(
            key,
            format!("invalid address {s:?}: expected IP:port or IP"),
        );
        SocketAddr::new(default_ip, default_port)
    }
}

/// The whole configuration, read section by section in a fixed order (errors are reported in
/// that order).
fn build(cx: &mut Ctx, hostname: impl FnOnce() -> Result<String>) -> Result<Config> {
    let mode = proxy_mode(cx);
    let (bind_address, healthz_bind_address, metrics_bind_address) = addresses(cx);
    let bind_address_hard_fail = cx.boolean("bindAddressHardFail");
    let ipvs = ipvs_config(cx);
    let iptables = iptables_config(cx);
    // Typed checks of ignored fields, so a typo there is still caught.
    for f in ["nftables.syncPeriod", "nftables.minSyncPeriod"] {
        cx.duration(f);
    }
    cx.int("nftables.masqueradeBit", 0, 31);
    let cluster_cidrs = cluster_cidrs(cx);
    let detect_local = detect_local(cx);
    let node_port_addresses = node_port_addresses(cx);
    let conntrack = ConntrackConfig {
        max_per_core: cx.int("conntrack.maxPerCore", 0, i64::from(i32::MAX)) as u32,
        min: cx.int("conntrack.min", 0, i64::from(i32::MAX)) as u32,
        tcp_established_timeout: cx.duration("conntrack.tcpEstablishedTimeout"),
        tcp_close_wait_timeout: cx.duration("conntrack.tcpCloseWaitTimeout"),
        tcp_be_liberal: cx.boolean("conntrack.tcpBeLiberal"),
        udp_timeout: cx.duration("conntrack.udpTimeout"),
        udp_stream_timeout: cx.duration("conntrack.udpStreamTimeout"),
    };
    let config_sync_period = cx.duration("configSyncPeriod");
    if config_sync_period.is_zero() && !cx.has_error("configSyncPeriod") {
        cx.err("configSyncPeriod", "must be greater than 0");
    }
    let oom_score_adj = cx.int("oomScoreAdj", -1000, 1000) as i32;
    let kube = kube_client(cx);
    let verbosity = cx.int("logging.verbosity", 0, 255) as u8;
    let log_format = log_format(cx);
    let feature_gates = feature_gates(cx);

    // kube-ipvs's own.
    let source_dir = cx.string("source-dir");
    let drain_timeout = cx.duration("drain-timeout");
    let ipset_timeout = positive(cx, "ipset-timeout");
    let iptables_timeout = positive(cx, "iptables-timeout");
    let sysctl_root = cx.string("sysctl-root");
    let sysfs_root = cx.string("sysfs-root");
    let config_file = cx.string("config");
    let once = cx.boolean("once");
    let cleanup = cx.boolean("cleanup");
    let ipvs_fallback = cx.boolean("ipvs-fallback");
    // Remaining typed checks of ignored fields.
    cx.boolean("enableProfiling");
    cx.string("showHiddenMetricsForVersion");
    let node_name = node_name(cx, hostname)?;

    let path_or = |s: String, default: &str| PathBuf::from(if s.is_empty() { default } else { &s });
    Ok(Config {
        config_file: (!config_file.is_empty()).then(|| PathBuf::from(config_file)),
        mode,
        ipvs_fallback,
        node_name,
        kube,
        source_dir: (!source_dir.is_empty()).then(|| PathBuf::from(source_dir)),
        once,
        cleanup,
        drain_timeout,
        ipset_timeout,
        iptables_timeout,
        sysctl_root: path_or(sysctl_root, "/proc/sys"),
        sysfs_root: path_or(sysfs_root, sysctl::SYS),
        bind_address,
        healthz_bind_address,
        metrics_bind_address,
        bind_address_hard_fail,
        ipvs,
        iptables,
        cluster_cidrs,
        detect_local,
        node_port_addresses,
        oom_score_adj,
        conntrack,
        config_sync_period,
        feature_gates,
        verbosity,
        log_format,
    })
}

/// `mode`: ipvs (the default) or iptables.
fn proxy_mode(cx: &mut Ctx) -> ProxyMode {
    let mode_text = cx.string("mode");
    match mode_text.as_str() {
        "" | "ipvs" => ProxyMode::Ipvs,
        "iptables" => ProxyMode::Iptables,
        "nftables" => {
            cx.err(
                "mode",
                "nftables mode is not supported by kube-ipvs (use ipvs or iptables)",
            );
            ProxyMode::Ipvs
        }
        other => {
            cx.err(
                "mode",
                format!("unknown proxy mode {other:?} (use ipvs or iptables)"),
            );
            ProxyMode::Ipvs
        }
    }
}

/// `bindAddress`, and the health and metrics servers' addresses (their default IPs follow
/// `bindAddress`'s family).
fn addresses(cx: &mut Ctx) -> (IpAddr, SocketAddr, SocketAddr) {
    let bind_text = cx.string("bindAddress");
    let bind_address = match bind_text.parse::<IpAddr>() {
        Ok(ip) => ip,
        Err(_) => {
            cx.err("bindAddress", format!("invalid IP address {bind_text:?}"));
            IpAddr::V4(Ipv4Addr::UNSPECIFIED)
        }
    };
    let (hz_ip, m_ip) = if bind_address.is_ipv6() {
        (
            IpAddr::V6(Ipv6Addr::UNSPECIFIED),
            IpAddr::V6(Ipv6Addr::LOCALHOST),
        )
    } else {
        (
            IpAddr::V4(Ipv4Addr::UNSPECIFIED),
            IpAddr::V4(Ipv4Addr::LOCALHOST),
        )
    };
    let healthz = cx.bind("healthzBindAddress", HEALTHZ_PORT, hz_ip);
    let metrics = cx.bind("metricsBindAddress", METRICS_PORT, m_ip);
    (bind_address, healthz, metrics)
}

/// `SECTION.syncPeriod` (> 0) and `SECTION.minSyncPeriod` (<= syncPeriod).
fn sync_periods(cx: &mut Ctx, section: &str) -> (Duration, Duration) {
    let (sync_key, min_key) = (
        format!("{section}.syncPeriod"),
        format!("{section}.minSyncPeriod"),
    );
    let sync = cx.duration(&sync_key);
    if sync.is_zero() && !cx.has_error(&sync_key) {
        cx.err(&sync_key, "must be greater than 0");
    }
    let min = cx.duration(&min_key);
    if !sync.is_zero() && min > sync {
        cx.err(
            &min_key,
            format!(
                "{} must be less than or equal to {sync_key} {}",
                crate::duration::format(min),
                crate::duration::format(sync)
            ),
        );
    }
    (sync, min)
}

/// The `ipvs` section.
fn ipvs_config(cx: &mut Ctx) -> IpvsConfig {
    let (sync_period, min_sync_period) = sync_periods(cx, "ipvs");
    let scheduler = cx.string("ipvs.scheduler");
    let scheduler = if scheduler.is_empty() {
        "rr".to_string()
    } else {
        scheduler
    };
    if !SCHEDULERS.contains(&scheduler.as_str()) {
        cx.err(
            "ipvs.scheduler",
            format!(
                "unknown IPVS scheduler {scheduler:?} (one of {})",
                SCHEDULERS.join(", ")
            ),
        );
    }
    let exclude = cx.list("ipvs.excludeCIDRs");
    let exclude_cidrs = exclude
        .iter()
        .enumerate()
        .filter_map(|(i, s)| cx.cidr("ipvs.excludeCIDRs", Some(i), s))
        .collect();
    IpvsConfig {
        sync_period,
        min_sync_period,
        scheduler,
        exclude_cidrs,
        strict_arp: cx.boolean("ipvs.strictARP"),
        tcp_timeout: cx.duration("ipvs.tcpTimeout"),
        tcp_fin_timeout: cx.duration("ipvs.tcpFinTimeout"),
        udp_timeout: cx.duration("ipvs.udpTimeout"),
    }
}

/// The `iptables` section.
fn iptables_config(cx: &mut Ctx) -> IptablesConfig {
    let (sync_period, min_sync_period) = sync_periods(cx, "iptables");
    IptablesConfig {
        masquerade_all: cx.boolean("iptables.masqueradeAll"),
        masquerade_bit: cx.int("iptables.masqueradeBit", 0, 31) as u8,
        localhost_node_ports: cx.boolean("iptables.localhostNodePorts"),
        sync_period,
        min_sync_period,
    }
}

/// `clusterCIDR`: at most one CIDR per family, comma-separated.
fn cluster_cidrs(cx: &mut Ctx) -> Vec<IpNet> {
    let cc = cx.string("clusterCIDR");
    let mut cluster_cidrs: Vec<IpNet> = Vec::new();
    for part in cc.split(',').map(str::trim).filter(|p| !p.is_empty()) {
        if let Some(n) = cx.cidr("clusterCIDR", None, part) {
            cluster_cidrs.push(n);
        }
    }
    if cluster_cidrs.len() > 2
        || (cluster_cidrs.len() == 2
            && matches!(cluster_cidrs[0], IpNet::V4(_)) == matches!(cluster_cidrs[1], IpNet::V4(_)))
    {
        cx.err(
            "clusterCIDR",
            format!("{cc:?}: at most one IPv4 and one IPv6 CIDR (a dual-stack pair)"),
        );
    }
    cluster_cidrs
}

/// `detectLocalMode` with its `detectLocal` parameters.
fn detect_local(cx: &mut Ctx) -> DetectLocal {
    let mode_name = cx.string("detectLocalMode");
    let bridge = cx.string("detectLocal.bridgeInterface");
    let prefix = cx.string("detectLocal.interfaceNamePrefix");
    match mode_name.as_str() {
        "" | "ClusterCIDR" => DetectLocal::ClusterCidr,
        // The Node's spec.podCIDRs (see `proxier::ipvs_mode::RulesConfig::node_cidr`).
        "NodeCIDR" => DetectLocal::NodeCidr,
        "BridgeInterface" => {
            if bridge.is_empty() {
                cx.err(
                    "detectLocal.bridgeInterface",
                    "required when detectLocalMode is BridgeInterface",
                );
            }
            DetectLocal::BridgeInterface(bridge)
        }
        "InterfaceNamePrefix" => {
            if prefix.is_empty() {
                cx.err(
                    "detectLocal.interfaceNamePrefix",
                    "required when detectLocalMode is InterfaceNamePrefix",
                );
            }
            DetectLocal::InterfaceNamePrefix(prefix)
        }
        other => {
            cx.err(
                "detectLocalMode",
                format!(
                    "unknown mode {other:?} (ClusterCIDR, NodeCIDR, BridgeInterface, InterfaceNamePrefix)"
                ),
            );
            DetectLocal::ClusterCidr
        }
    }
}

/// `nodePortAddresses`: CIDRs, `primary`, or `all` (both families' default routes).
fn node_port_addresses(cx: &mut Ctx) -> Vec<NodePortAddress> {
    let npa = cx.list("nodePortAddresses");
    let mut node_port_addresses = Vec::new();
    for (i, s) in npa.iter().enumerate() {
        match s.as_str() {
            "primary" => node_port_addresses.push(NodePortAddress::Primary),
            "all" => {
                node_port_addresses
                    .push(NodePortAddress::Cidr(IpNet::V4(ipnet::Ipv4Net::default())));
                node_port_addresses
                    .push(NodePortAddress::Cidr(IpNet::V6(ipnet::Ipv6Net::default())));
            }
            _ => {
                if let Some(n) = cx.cidr("nodePortAddresses", Some(i), s) {
                    node_port_addresses.push(NodePortAddress::Cidr(n));
                }
            }
        }
    }
    node_port_addresses
}

/// `clientConnection` and `master`, with the daemon's API time limits.
fn kube_client(cx: &mut Ctx) -> KubeClientConfig {
    let kubeconfig = cx.string("clientConnection.kubeconfig");
    let master = cx.string("master");
    let qps = cx.float("clientConnection.qps");
    let burst = cx.int("clientConnection.burst", 0, i64::from(u32::MAX)) as u32;
    KubeClientConfig {
        kubeconfig: (!kubeconfig.is_empty()).then(|| PathBuf::from(kubeconfig)),
        master: (!master.is_empty()).then_some(master),
        qps,
        burst,
        connect_timeout: crate::daemon::KUBE_CONNECT_TIMEOUT,
        write_timeout: crate::daemon::KUBE_WRITE_TIMEOUT,
        read_timeout: crate::daemon::KUBE_READ_TIMEOUT,
    }
}

/// `logging.format`: text or json.
fn log_format(cx: &mut Ctx) -> LogFormat {
    match cx.string("logging.format").as_str() {
        "" | "text" => LogFormat::Text,
        "json" => LogFormat::Json,
        other => {
            cx.err(
                "logging.format",
                format!("unknown log format {other:?} (text or json)"),
            );
            LogFormat::Text
        }
    }
}

/// `featureGates`: a map of name to bool.
fn feature_gates(cx: &mut Ctx) -> BTreeMap<String, bool> {
    match cx.value("featureGates") {
        Value::Object(m) => {
            let mut out = BTreeMap::new();
            for (k, v) in m {
                match v {
                    Value::Bool(b) => {
                        out.insert(k, b);
                    }
                    other => cx.err(
                        &format!("featureGates.{k}"),
                        format!("expected true or false, got {other}"),
                    ),
                }
            }
            out
        }
        Value::Null => BTreeMap::new(),
        other => {
            cx.err(
                "featureGates",
                format!("expected a map of name: bool, got {other}"),
            );
            BTreeMap::new()
        }
    }
}

/// A duration that must be greater than 0.
fn positive(cx: &mut Ctx, key: &str) -> Duration {
    let d = cx.duration(key);
    if d.is_zero() {
        cx.err(key, "must be greater than 0");
    }
    d
}

/// The node's name: `hostnameOverride`, else the host name; trimmed and lower-cased.
fn node_name(cx: &mut Ctx, hostname: impl FnOnce() -> Result<String>) -> Result<String> {
    let host_override = cx.string("hostnameOverride");
    let raw_name = if host_override.trim().is_empty() {
        hostname().map_err(|e| Error::NodeName(Box::new(e)))?
    } else {
        host_override
    };
    let node_name = raw_name.trim().to_lowercase();
    if node_name.is_empty() {
        return Err(Error::NodeName(Box::new(Error::HostnameEmpty)));
    }
    Ok(node_name)
}
