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

mod load;
mod sections;

pub use load::*;
use sections::*;

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
    /// iptables mode: period of the drift check (a full resync comes at most hourly).
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
    /// Nodes that write the Event about an invalid object (`--event-reporters`; 0: every node).
    pub event_reporters: usize,
    /// What one Service may cost this node (`--max-virtual-servers-per-service`,
    /// `--max-real-servers-per-service`, `--max-ipset-members-per-service`).
    pub service_budget: model::ServiceBudget,
    /// Root of the sysctl tree (`--sysctl-root`, default `/proc/sys`).
    pub sysctl_root: PathBuf,
    /// Root of sysfs (`--sysfs-root`, default `/sys`).
    pub sysfs_root: PathBuf,
    /// Ports of this node no externalIP or load-balancer IP on a node address may take
    /// (`--protected-node-ports`; the healthz and metrics ports are added by
    /// [`crate::engine::proxy_config`]).
    pub protected_node_ports: Vec<model::ProtectedPort>,
    /// `--refuse-node-address-vips`: no externalIP or load-balancer IP on a node address.
    pub refuse_node_address_vips: bool,
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
