//! The one table of every setting: KubeProxyConfiguration field, command-line flag, default.
//!
//! Everything else is derived from [`SETTINGS`]: the clap flags (`cli`), the defaults applied
//! when loading (`config`), unknown-field detection, and `kube-ipvs config print-defaults`.

use serde_json::Value;

use crate::error::ValueError;

/// The value type of a setting, used to convert flag text and defaults into values.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ty {
    /// `true`/`false` (flags: `--x`, `--x=true`, `--x=false`).
    Bool,
    /// An integer.
    Int,
    /// A floating-point number.
    Float,
    /// A string.
    Str,
    /// A Go duration string ("30s", "1m0s").
    Duration,
    /// A list of strings (flags: comma-separated).
    List,
    /// A map of string to bool (flags: `a=true,b=false`); `featureGates`.
    BoolMap,
    /// A free-form object kube-ipvs passes over (`logging.options`).
    Opaque,
}

/// Whether kube-ipvs acts on a setting.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Support {
    /// Used.
    Yes,
    /// Accepted for compatibility but ignored; setting it to a non-zero value gives one warning
    /// with this reason.
    Ignored(&'static str),
    /// Accepted and ignored without a warning (values kubeadm writes by default).
    Silent,
}

/// One setting.
#[derive(Debug, Clone, Copy)]
pub struct Setting {
    /// The KubeProxyConfiguration field path (`ipvs.syncPeriod`); `None` for kube-ipvs-only flags.
    pub field: Option<&'static str>,
    /// The command-line flag without dashes; `None` for file-only fields.
    pub flag: Option<&'static str>,
    /// Extra flag names accepted (aliases).
    pub aliases: &'static [&'static str],
    /// Value type.
    pub ty: Ty,
    /// The effective default, as it would be written on the command line ("" = empty).
    pub default: &'static str,
    /// Upstream defaulting treats the zero value ("", "0s", 0, false, []) like an unset field.
    pub zero_is_unset: bool,
    /// Whether kube-ipvs uses it.
    pub support: Support,
    /// One-line help.
    pub help: &'static str,
}

const fn s(
    field: Option<&'static str>,
    flag: Option<&'static str>,
    ty: Ty,
    default: &'static str,
    zero_is_unset: bool,
    support: Support,
    help: &'static str,
) -> Setting {
    Setting {
        field,
        flag,
        aliases: &[],
        ty,
        default,
        zero_is_unset,
        support,
        help,
    }
}

const WIN: Support = Support::Ignored("Windows (winkernel) settings have no effect on Linux");
const NFT: Support = Support::Ignored("kube-ipvs has no nftables mode");

/// Every setting, in the order of upstream's KubeProxyConfiguration (then kube-ipvs's own).
#[rustfmt::skip]
pub const SETTINGS: &[Setting] = &[
    s(Some("apiVersion"), None, Ty::Str, "kubeproxy.config.k8s.io/v1alpha1", true, Support::Yes,
      "Config file API version; only kubeproxy.config.k8s.io/v1alpha1 is accepted"),
    s(Some("kind"), None, Ty::Str, "KubeProxyConfiguration", true, Support::Yes,
      "Config file kind; must be KubeProxyConfiguration"),
    s(Some("featureGates"), Some("feature-gates"), Ty::BoolMap, "", true,
      Support::Ignored("kube-ipvs has no feature gates"),
      "Feature gates (A=true,B=false)"),
    s(Some("clientConnection.kubeconfig"), Some("kubeconfig"), Ty::Str, "", false, Support::Yes,
      "Path to a kubeconfig file; empty: in-cluster config"),
    s(Some("clientConnection.acceptContentTypes"), None, Ty::Str, "", true,
      Support::Ignored("kube-ipvs always talks JSON to the API server"),
      "Accept header sent to the API server"),
    s(Some("clientConnection.contentType"), Some("kube-api-content-type"), Ty::Str,
      "application/vnd.kubernetes.protobuf", true,
      Support::Ignored("kube-ipvs always talks JSON to the API server"),
      "Content type of requests sent to the API server"),
    s(Some("clientConnection.qps"), Some("kube-api-qps"), Ty::Float, "5", true, Support::Yes,
      "QPS to use while talking with the API server"),
    s(Some("clientConnection.burst"), Some("kube-api-burst"), Ty::Int, "10", true, Support::Yes,
      "Burst to use while talking with the API server"),
    Setting { aliases: &["logging-format"], ..s(Some("logging.format"), Some("log-format"), Ty::Str, "text", true, Support::Yes,
      "Log format: text or json") },
    s(Some("logging.flushFrequency"), None, Ty::Opaque, "", true, Support::Silent,
      "Log flush frequency (logs are written unbuffered)"),
    s(Some("logging.verbosity"), Some("v"), Ty::Int, "0", true, Support::Yes,
      "Log verbosity like klog's -v: 0-1 info, 2-3 debug, 4+ trace"),
    s(Some("logging.vmodule"), Some("vmodule"), Ty::Opaque, "", true,
      Support::Ignored("per-module verbosity is set with RUST_LOG instead"),
      "Per-file verbosity (klog)"),
    s(Some("logging.options"), None, Ty::Opaque, "", true, Support::Silent,
      "Format options (klog)"),
    s(Some("hostnameOverride"), Some("hostname-override"), Ty::Str, "", false, Support::Yes,
      "Name of this Node; empty: the host name"),
    s(Some("bindAddress"), Some("bind-address"), Ty::Str, "0.0.0.0", true, Support::Yes,
      "When set to an address: this node's primary IP of its family, overriding the Node object's (used by `nodePortAddresses: [primary]`; upstream `detectNodeIPs`); its family is the primary IP family (see operations, IP families) and picks the family the health-check node ports listen on"),
    s(Some("healthzBindAddress"), Some("healthz-bind-address"), Ty::Str, "0.0.0.0:10256", true,
      Support::Yes, "Address (IP:port, or IP) of the /healthz and /livez server"),
    s(Some("metricsBindAddress"), Some("metrics-bind-address"), Ty::Str, "127.0.0.1:10249", true,
      Support::Yes, "Address (IP:port, or IP) of the /metrics server"),
    s(Some("bindAddressHardFail"), Some("bind-address-hard-fail"), Ty::Bool, "false", false,
      Support::Yes, "Exit if the healthz or metrics server cannot bind"),
    s(Some("enableProfiling"), Some("profiling"), Ty::Bool, "false", false,
      Support::Ignored("there is no /debug/pprof in kube-ipvs"), "Profiling handlers"),
    s(Some("showHiddenMetricsForVersion"), Some("show-hidden-metrics-for-version"), Ty::Str, "",
      false, Support::Ignored("kube-ipvs has no hidden metrics"), "Show hidden metrics"),
    s(Some("mode"), Some("proxy-mode"), Ty::Str, "ipvs", true, Support::Yes,
      "Proxy mode: ipvs (default; also for \"\") or iptables; nftables is not supported"),
    s(Some("iptables.masqueradeBit"), Some("iptables-masquerade-bit"), Ty::Int, "14", false,
      Support::Yes, "fwmark bit (0-31) marking packets to masquerade"),
    s(Some("iptables.masqueradeAll"), Some("masquerade-all"), Ty::Bool, "false", false,
      Support::Yes, "Masquerade all traffic sent to service IPs"),
    s(Some("iptables.localhostNodePorts"), Some("iptables-localhost-nodeports"), Ty::Bool, "true",
      false, Support::Yes, "iptables mode: serve IPv4 NodePorts on 127.0.0.0/8 (sets net/ipv4/conf/all/route_localnet=1 and kubelet's anti-martian KUBE-FIREWALL rule; only while nodePortAddresses include 127.0.0.1). Never on IPv6, never in IPVS mode (like upstream)"),
    s(Some("iptables.snatNodeInternalIP"), None, Ty::Bool, "false", false,
      Support::Ignored("SNAT to the node's InternalIP is not implemented"),
      "SNAT service traffic to the node's InternalIP"),
    s(Some("iptables.syncPeriod"), Some("iptables-sync-period"), Ty::Duration, "30s", true,
      Support::Yes, "iptables mode: period of the drift check (the jumps' built-in chains and the shared chains, `iptables -S` each; repaired when they differ); a full resync comes at most hourly and not above 1,000 endpoints, as upstream's `syncProxyRules`"),
    s(Some("iptables.minSyncPeriod"), Some("iptables-min-sync-period"), Ty::Duration, "1s", true,
      Support::Yes, "iptables mode: minimum time between syncs"),
    s(Some("ipvs.syncPeriod"), Some("ipvs-sync-period"), Ty::Duration, "30s", true, Support::Yes,
      "IPVS mode: full resync period (> 0)"),
    s(Some("ipvs.minSyncPeriod"), Some("ipvs-min-sync-period"), Ty::Duration, "0s", false,
      Support::Yes, "IPVS mode: minimum time between syncs (0: sync every change at once)"),
    s(Some("ipvs.scheduler"), Some("ipvs-scheduler"), Ty::Str, "rr", true, Support::Yes,
      "IPVS scheduler: rr wrr lc wlc lblc lblcr sh dh sed nq mh fo ovf"),
    s(Some("ipvs.excludeCIDRs"), Some("ipvs-exclude-cidrs"), Ty::List, "", false, Support::Yes,
      "CIDRs whose IPVS services kube-ipvs never deletes"),
    s(Some("ipvs.strictARP"), Some("ipvs-strict-arp"), Ty::Bool, "false", false, Support::Yes,
      "Set arp_ignore=1 and arp_announce=2"),
    s(Some("ipvs.tcpTimeout"), Some("ipvs-tcp-timeout"), Ty::Duration, "0s", false, Support::Yes,
      "IPVS idle TCP session timeout (0: leave the kernel's)"),
    s(Some("ipvs.tcpFinTimeout"), Some("ipvs-tcpfin-timeout"), Ty::Duration, "0s", false,
      Support::Yes, "IPVS TCP FIN_WAIT timeout (0: leave the kernel's)"),
    s(Some("ipvs.udpTimeout"), Some("ipvs-udp-timeout"), Ty::Duration, "0s", false, Support::Yes,
      "IPVS UDP timeout (0: leave the kernel's)"),
    s(Some("nftables.masqueradeBit"), None, Ty::Int, "", true, NFT, "nftables mode fwmark bit"),
    s(Some("nftables.masqueradeAll"), None, Ty::Bool, "false", false, NFT,
      "nftables mode masquerade all"),
    s(Some("nftables.syncPeriod"), None, Ty::Duration, "", true, NFT, "nftables sync period"),
    s(Some("nftables.minSyncPeriod"), None, Ty::Duration, "", true, NFT,
      "nftables minimum sync period"),
    s(Some("winkernel.networkName"), None, Ty::Str, "", false, WIN, "HNS network name"),
    s(Some("winkernel.sourceVip"), None, Ty::Str, "", false, WIN, "HNS source VIP"),
    s(Some("winkernel.enableDSR"), None, Ty::Bool, "false", false, WIN, "HNS DSR"),
    s(Some("winkernel.rootHnsEndpointName"), None, Ty::Str, "", false, WIN, "HNS root endpoint"),
    s(Some("winkernel.forwardHealthCheckVip"), None, Ty::Bool, "false", false, WIN,
      "HNS health check VIP"),
    s(Some("detectLocalMode"), Some("detect-local-mode"), Ty::Str, "ClusterCIDR", true,
      Support::Yes, "Local traffic detection: ClusterCIDR, NodeCIDR (the Node object's spec.podCIDRs, followed when they change), BridgeInterface, InterfaceNamePrefix"),
    s(Some("detectLocal.bridgeInterface"), Some("pod-bridge-interface"), Ty::Str, "", false,
      Support::Yes, "Bridge for detectLocalMode=BridgeInterface"),
    s(Some("detectLocal.interfaceNamePrefix"), Some("pod-interface-name-prefix"), Ty::Str, "",
      false, Support::Yes, "Interface prefix for detectLocalMode=InterfaceNamePrefix"),
    s(Some("clusterCIDR"), Some("cluster-cidr"), Ty::Str, "", false, Support::Yes,
      "Pod CIDR(s), comma-separated dual-stack pair allowed"),
    s(Some("nodePortAddresses"), Some("nodeport-addresses"), Ty::List, "", false, Support::Yes,
      "CIDRs (or \"primary\") of node IPs that serve NodePorts; empty: all"),
    s(Some("oomScoreAdj"), Some("oom-score-adj"), Ty::Int, "-999", false, Support::Yes,
      "oom_score_adj of the process, -1000..1000"),
    s(Some("conntrack.maxPerCore"), Some("conntrack-max-per-core"), Ty::Int, "32768", false,
      Support::Yes, "nf_conntrack_max per CPU, at least conntrack.min; only raised, never lowered (0: leave it and the hash size as is)"),
    s(Some("conntrack.min"), Some("conntrack-min"), Ty::Int, "131072", false, Support::Yes,
      "Minimum nf_conntrack_max (ignored when conntrack.maxPerCore is 0)"),
    s(Some("conntrack.tcpEstablishedTimeout"), Some("conntrack-tcp-timeout-established"),
      Ty::Duration, "24h0m0s", false, Support::Yes, "nf_conntrack_tcp_timeout_established, whole seconds (0: leave)"),
    s(Some("conntrack.tcpCloseWaitTimeout"), Some("conntrack-tcp-timeout-close-wait"),
      Ty::Duration, "1h0m0s", false, Support::Yes, "nf_conntrack_tcp_timeout_close_wait, whole seconds (0: leave)"),
    s(Some("conntrack.tcpBeLiberal"), Some("conntrack-tcp-be-liberal"), Ty::Bool, "false", false,
      Support::Yes, "nf_conntrack_tcp_be_liberal=1 (false: leave)"),
    s(Some("conntrack.udpTimeout"), Some("conntrack-udp-timeout"), Ty::Duration, "0s", false,
      Support::Yes, "nf_conntrack_udp_timeout (unreplied), whole seconds (0: leave)"),
    s(Some("conntrack.udpStreamTimeout"), Some("conntrack-udp-timeout-stream"), Ty::Duration, "0s",
      false, Support::Yes, "nf_conntrack_udp_timeout_stream (assured), whole seconds (0: leave)"),
    s(Some("configSyncPeriod"), Some("config-sync-period"), Ty::Duration, "15m0s", true,
      Support::Ignored("not applicable: kube-ipvs has no informer resync (upstream's resync only replays the informer cache to its handlers; kube-ipvs re-derives every rule from its cache every ipvs.syncPeriod / iptables.syncPeriod, and relists after a watch error)"),
      "Informer resync period (> 0)"),
    s(Some("portRange"), None, Ty::Str, "", false,
      Support::Ignored("portRange only configured the removed userspace proxy"), "Unused"),
    s(Some("windowsRunAsService"), None, Ty::Bool, "false", false, WIN, "Windows service"),
    // kube-ipvs's own, command line only.
    s(None, Some("config"), Ty::Str, "", false, Support::Yes,
      "KubeProxyConfiguration (kubeproxy.config.k8s.io/v1alpha1) YAML file; flags override it"),
    s(None, Some("master"), Ty::Str, "", false, Support::Yes,
      "API server URL (overrides the kubeconfig's)"),
    s(None, Some("cleanup"), Ty::Bool, "false", false, Support::Yes,
      "Remove everything kube-ipvs programmed (IPVS services, kube-ipvs0, chains, ipsets) and exit"),
    s(None, Some("ipvs-fallback"), Ty::Bool, "true", false, Support::Yes,
      "If IPVS is unusable, run in iptables mode (false: exit with an error)"),
    s(None, Some("source-dir"), Ty::Str, "", false, Support::Yes,
      "Read Services, EndpointSlices and Nodes from YAML files in DIR instead of the API server"),
    s(None, Some("once"), Ty::Bool, "false", false, Support::Yes, "Sync once and exit"),
    s(None, Some("drain-timeout"), Ty::Duration, "15m0s", false, Support::Yes,
      "Longest time a removed TCP real server stays at weight 0 while it has active connections"),
    s(None, Some("sysctl-root"), Ty::Str, "/proc/sys", false, Support::Yes,
      "Where the kernel's sysctls are (a container without privileges mounts the host's /proc/sys/net elsewhere)"),
    s(None, Some("sysfs-root"), Ty::Str, "/sys", false, Support::Yes,
      "Where sysfs is (the conntrack hash size and the online CPU list are read, and the hash size written, under it)"),
    s(None, Some("ipset-timeout"), Ty::Duration, "30s", false, Support::Yes,
      "Longest time one ipset process may run before it is killed and its sync fails (> 0)"),
    s(None, Some("max-virtual-servers-per-service"), Ty::Int, "65536", false, Support::Yes,
      "Most virtual servers one Service may cost this node (ports x its ClusterIP, external and load-balancer IPs and, with nodePorts, node addresses); a Service over it is rejected and keeps its last good state (>= 1)"),
    s(None, Some("max-real-servers-per-service"), Ty::Int, "1000000", false, Support::Yes,
      "Most real servers one Service may cost this node, summed over its virtual servers; a Service over it is rejected and keeps its last good state (>= 1)"),
    s(None, Some("max-ipset-members-per-service"), Ty::Int, "65536", false, Support::Yes,
      "Most ipset members one Service may add (IPVS mode), summed over the sets; a Service over it is rejected and keeps its last good state (>= 1)"),
    s(None, Some("iptables-timeout"), Ty::Duration, "30s", false, Support::Yes,
      "Longest time one iptables-save/iptables-restore may run (its xtables lock wait is 5s, like upstream) before it is killed and its sync fails (> 0)"),
    s(None, Some("protected-node-ports"), Ty::List, "22,2379,2380,6443,10248,10249,10250,10255,10256,10257,10259",
      false, Support::Yes,
      "Ports (PORT on every protocol, or PORT/TCP, PORT/UDP, PORT/SCTP) no externalIP or load-balancer IP equal to one of this node's addresses may take (the node's own services: SSH, etcd, API server, kubelet, kube-proxy, controller-manager, scheduler); the healthz and metrics ports are always added; empty: only those"),
    s(None, Some("refuse-node-address-vips"), Ty::Bool, "false", false, Support::Yes,
      "Never serve an externalIP or load-balancer IP equal to one of this node's addresses (upstream serves them; NodePorts and protected ports are kept from them either way)"),
    s(None, Some("event-reporters"), Ty::Int, "3", false, Support::Yes,
      "Nodes that write the Event about an invalid object (chosen per object by hashing over the nodes hosting endpoints; 0: every node); every node still logs and counts it"),
];

/// The setting for a config field path.
pub fn by_field(field: &str) -> Option<&'static Setting> {
    SETTINGS.iter().find(|s| s.field == Some(field))
}

/// The setting for a flag name (without dashes; aliases included).
pub fn by_flag(flag: &str) -> Option<&'static Setting> {
    SETTINGS
        .iter()
        .find(|s| s.flag == Some(flag) || s.aliases.contains(&flag))
}

/// Converts command-line text (or a default) into a value of type `ty`.
pub fn parse_text(ty: Ty, text: &str) -> Result<Value, ValueError> {
    match ty {
        Ty::Bool => match text {
            "true" | "t" | "T" | "TRUE" | "True" | "1" => Ok(Value::Bool(true)),
            "false" | "f" | "F" | "FALSE" | "False" | "0" => Ok(Value::Bool(false)),
            _ => Err(ValueError::Bool(text.into())),
        },
        Ty::Int => {
            if text.is_empty() {
                return Ok(Value::Null);
            }
            text.trim()
                .parse::<i64>()
                .map(Value::from)
                .map_err(|source| ValueError::Int {
                    text: text.into(),
                    source,
                })
        }
        Ty::Float => {
            let f: f64 = text.trim().parse().map_err(|source| ValueError::Number {
                text: text.into(),
                source: Some(source),
            })?;
            serde_json::Number::from_f64(f)
                .map(Value::Number)
                .ok_or_else(|| ValueError::Number {
                    text: text.into(),
                    source: None,
                })
        }
        Ty::Duration if text.is_empty() => Ok(Value::Null),
        Ty::Str | Ty::Duration | Ty::Opaque => Ok(Value::String(text.to_string())),
        Ty::List => Ok(Value::Array(
            text.split(',')
                .map(str::trim)
                .filter(|x| !x.is_empty())
                .map(|x| Value::String(x.to_string()))
                .collect(),
        )),
        Ty::BoolMap => {
            let mut map = serde_json::Map::new();
            for pair in text.split(',').map(str::trim).filter(|x| !x.is_empty()) {
                let (k, v) = pair
                    .split_once('=')
                    .ok_or_else(|| ValueError::BoolPair(pair.into()))?;
                let b = parse_text(Ty::Bool, v.trim())?;
                map.insert(k.trim().to_string(), b);
            }
            Ok(Value::Object(map))
        }
    }
}

/// True if `v` is the zero value of its type (what upstream defaulting treats as unset).
pub fn is_zero(v: &Value) -> bool {
    match v {
        Value::Null => true,
        Value::Bool(b) => !b,
        Value::Number(n) => n.as_f64() == Some(0.0),
        Value::String(s) => s.is_empty() || crate::duration::parse(s).is_ok_and(|d| d.is_zero()),
        Value::Array(a) => a.is_empty(),
        Value::Object(o) => o.is_empty(),
    }
}

/// True if `path` is a parent object of some setting's field (e.g. `ipvs`, `clientConnection`).
pub fn is_parent(path: &str) -> bool {
    SETTINGS
        .iter()
        .filter_map(|s| s.field)
        .any(|f| f.len() > path.len() && f.starts_with(path) && f.as_bytes()[path.len()] == b'.')
}

/// Renders the table for `kube-ipvs config print-defaults`.
pub fn render_defaults() -> String {
    let mut rows: Vec<[String; 4]> = vec![[
        "FIELD".into(),
        "FLAG".into(),
        "DEFAULT".into(),
        "NOTES".into(),
    ]];
    for st in SETTINGS {
        let default = if st.default.is_empty() {
            "\"\"".to_string()
        } else {
            st.default.to_string()
        };
        let note = match st.support {
            Support::Yes => st.help.to_string(),
            Support::Ignored(why) => format!("ignored: {why}"),
            Support::Silent => format!("ignored: {}", st.help),
        };
        rows.push([
            st.field.unwrap_or("-").to_string(),
            st.flag
                .map(|f| format!("--{f}"))
                .unwrap_or_else(|| "-".into()),
            default,
            note,
        ]);
    }
    let w: Vec<usize> = (0..3)
        .map(|i| rows.iter().map(|r| r[i].chars().count()).max().unwrap_or(0))
        .collect();
    let mut out = String::new();
    for r in rows {
        out.push_str(&format!(
            "{:w0$}  {:w1$}  {:w2$}  {}\n",
            r[0],
            r[1],
            r[2],
            r[3],
            w0 = w[0],
            w1 = w[1],
            w2 = w[2]
        ));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The `--ipvs-scheduler` help names exactly the accepted schedulers.
    #[test]
    fn scheduler_help_lists_the_scheduler_table() {
        let st = by_flag("ipvs-scheduler").unwrap();
        let listed: Vec<&str> = st
            .help
            .strip_prefix("IPVS scheduler: ")
            .unwrap()
            .split(' ')
            .collect();
        assert_eq!(listed, ipvs_netlink::SCHEDULERS);
    }

    #[test]
    fn table_is_consistent() {
        let mut fields = std::collections::BTreeSet::new();
        let mut flags = std::collections::BTreeSet::new();
        for st in SETTINGS {
            assert!(st.field.is_some() || st.flag.is_some(), "{st:?}");
            if let Some(f) = st.field {
                assert!(fields.insert(f), "duplicate field {f}");
            }
            for f in st.flag.iter().chain(st.aliases) {
                assert!(flags.insert(*f), "duplicate flag {f}");
            }
            // Every default parses as its own type.
            parse_text(st.ty, st.default).unwrap();
            if st.ty == Ty::Duration && !st.default.is_empty() {
                crate::duration::parse(st.default).unwrap();
            }
        }
    }

    #[test]
    fn flag_text_conversion() {
        assert_eq!(parse_text(Ty::Bool, "true"), Ok(Value::Bool(true)));
        assert!(parse_text(Ty::Bool, "yes").is_err());
        assert_eq!(parse_text(Ty::Int, "-999"), Ok(Value::from(-999)));
        assert_eq!(
            parse_text(Ty::List, "10.0.0.0/8, 192.168.0.0/16,"),
            Ok(serde_json::json!(["10.0.0.0/8", "192.168.0.0/16"]))
        );
        assert_eq!(
            parse_text(Ty::BoolMap, "A=true,B=false"),
            Ok(serde_json::json!({"A": true, "B": false}))
        );
        assert!(parse_text(Ty::BoolMap, "A").is_err());
    }

    #[test]
    fn parents() {
        assert!(is_parent("ipvs"));
        assert!(is_parent("clientConnection"));
        assert!(!is_parent("ipv"));
        assert!(!is_parent("ipvs.syncPeriod"));
    }
}
