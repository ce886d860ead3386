//! The configuration read section by section from the merged values, in a fixed order (errors
//! are reported in that order), each value checked and named by its field path or flag.

use super::*;

/// The whole configuration, read section by section in a fixed order (errors are reported in
/// that order).
pub(super) fn build(cx: &mut Ctx, hostname: impl FnOnce() -> Result<String>) -> Result<Config> {
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
    let event_reporters = cx.int("event-reporters", 0, 1000) as usize;
    let service_budget = model::ServiceBudget {
        virtual_servers: cx.int("max-virtual-servers-per-service", 1, i64::from(u32::MAX)) as usize,
        real_servers: cx.int("max-real-servers-per-service", 1, i64::from(u32::MAX)) as usize,
        ipset_members: cx.int("max-ipset-members-per-service", 1, i64::from(u32::MAX)) as usize,
    };
    let sysctl_root = cx.string("sysctl-root");
    let sysfs_root = cx.string("sysfs-root");
    let protected_node_ports = protected_node_ports(cx);
    let refuse_node_address_vips = cx.boolean("refuse-node-address-vips");
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
        event_reporters,
        service_budget,
        sysctl_root: path_or(sysctl_root, "/proc/sys"),
        sysfs_root: path_or(sysfs_root, sysctl::SYS),
        protected_node_ports,
        refuse_node_address_vips,
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
pub(super) fn proxy_mode(cx: &mut Ctx) -> ProxyMode {
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
pub(super) fn addresses(cx: &mut Ctx) -> (IpAddr, SocketAddr, SocketAddr) {
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
pub(super) fn sync_periods(cx: &mut Ctx, section: &str) -> (Duration, Duration) {
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
pub(super) fn ipvs_config(cx: &mut Ctx) -> IpvsConfig {
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
pub(super) fn iptables_config(cx: &mut Ctx) -> IptablesConfig {
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
pub(super) fn cluster_cidrs(cx: &mut Ctx) -> Vec<IpNet> {
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
pub(super) fn detect_local(cx: &mut Ctx) -> DetectLocal {
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
pub(super) fn node_port_addresses(cx: &mut Ctx) -> Vec<NodePortAddress> {
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

/// `--protected-node-ports`: `PORT` (every protocol) or `PORT/PROTOCOL` entries, sorted.
pub(super) fn protected_node_ports(cx: &mut Ctx) -> Vec<model::ProtectedPort> {
    let key = "protected-node-ports";
    let mut out = Vec::new();
    for (i, entry) in cx.list(key).iter().enumerate() {
        let (port, proto) = match entry.split_once('/') {
            Some((p, proto)) => (p, Some(proto)),
            None => (entry.as_str(), None),
        };
        let port = port.trim().parse::<u16>().ok().filter(|p| *p > 0);
        let protocol =
            proto.map(|p| ipvs_netlink::Protocol::from_api_name(&p.trim().to_ascii_uppercase()));
        match (port, protocol) {
            (Some(port), None) => out.push(model::ProtectedPort {
                port,
                protocol: None,
            }),
            (Some(port), Some(Some(p))) => out.push(model::ProtectedPort {
                port,
                protocol: Some(p),
            }),
            _ => {
                let field = format!("{}[{i}]", cx.name(key));
                cx.errors.push(FieldError {
                    field,
                    message: format!(
                        "invalid protected port {entry:?} (PORT 1-65535, or PORT/TCP, PORT/UDP, PORT/SCTP)"
                    ),
                });
            }
        }
    }
    out.sort();
    out.dedup();
    out
}

/// `clientConnection` and `master`, with the daemon's API time limits.
pub(super) fn kube_client(cx: &mut Ctx) -> KubeClientConfig {
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
pub(super) fn log_format(cx: &mut Ctx) -> LogFormat {
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
pub(super) fn feature_gates(cx: &mut Ctx) -> BTreeMap<String, bool> {
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
pub(super) fn positive(cx: &mut Ctx, key: &str) -> Duration {
    let d = cx.duration(key);
    if d.is_zero() {
        cx.err(key, "must be greater than 0");
    }
    d
}

/// The node's name: `hostnameOverride`, else the host name; trimmed and lower-cased.
pub(super) fn node_name(cx: &mut Ctx, hostname: impl FnOnce() -> Result<String>) -> Result<String> {
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
