//! Config loading: a real kubeadm KubeProxyConfiguration, flag precedence, warnings, and one
//! error per invalid field naming it.

// Test helpers outside #[test] fns may unwrap/panic too.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::net::SocketAddr;
use std::path::Path;
use std::time::Duration;

use kube_ipvs::cli;
use kube_ipvs::config::{self, DetectLocal, LogFormat, NodePortAddress, ProxyMode};
use kube_ipvs::Error;

/// The `config.conf` of the `kube-proxy` ConfigMap that `kubeadm init` (v1.30) writes with
/// `mode: ipvs`: almost every field present, zero values meaning "default".
const KUBEADM: &str = r#"apiVersion: kubeproxy.config.k8s.io/v1alpha1
bindAddress: 0.0.0.0
bindAddressHardFail: false
clientConnection:
  acceptContentTypes: ""
  burst: 0
  contentType: ""
  kubeconfig: /var/lib/kube-proxy/kubeconfig.conf
  qps: 0
clusterCIDR: 10.244.0.0/16
configSyncPeriod: 0s
conntrack:
  maxPerCore: null
  min: null
  tcpBeLiberal: false
  tcpCloseWaitTimeout: null
  tcpEstablishedTimeout: null
  udpStreamTimeout: 0s
  udpTimeout: 0s
detectLocal:
  bridgeInterface: ""
  interfaceNamePrefix: ""
detectLocalMode: ""
enableProfiling: false
healthzBindAddress: ""
hostnameOverride: ""
iptables:
  localhostNodePorts: null
  masqueradeAll: false
  masqueradeBit: null
  minSyncPeriod: 0s
  syncPeriod: 0s
ipvs:
  excludeCIDRs: null
  minSyncPeriod: 0s
  scheduler: ""
  strictARP: false
  syncPeriod: 0s
  tcpFinTimeout: 0s
  tcpTimeout: 0s
  udpTimeout: 0s
kind: KubeProxyConfiguration
logging:
  flushFrequency: 0
  options:
    json:
      infoBufferSize: "0"
    text:
      infoBufferSize: "0"
  verbosity: 0
metricsBindAddress: ""
mode: ipvs
nftables:
  masqueradeAll: false
  masqueradeBit: null
  minSyncPeriod: 0s
  syncPeriod: 0s
nodePortAddresses: null
oomScoreAdj: null
portRange: ""
showHiddenMetricsForVersion: ""
winkernel:
  enableDSR: false
  forwardHealthCheckVip: false
  networkName: ""
  rootHnsEndpointName: ""
  sourceVip: ""
"#;

fn host() -> Result<String, Error> {
    Ok("Node-A.example\n".into())
}

fn load(file: Option<&str>, argv: &[&str]) -> Result<config::Loaded, Error> {
    let mut full = vec!["kube-ipvs"];
    full.extend_from_slice(argv);
    let args = cli::parse(full).unwrap();
    config::from_sources(
        file.map(|t| (Path::new("kube-proxy.yaml"), t)),
        &args.flags,
        host,
    )
}

/// `KUBEADM` with `key: value` lines replaced or added (dotted keys: one nesting level).
fn kubeadm_with(field: &str, value: &str) -> String {
    let mut v: serde_json::Value = serde_saphyr::from_str(KUBEADM).unwrap();
    let parsed: serde_json::Value = serde_saphyr::from_str(value).unwrap();
    let mut cur = &mut v;
    let parts: Vec<&str> = field.split('.').collect();
    for p in &parts[..parts.len() - 1] {
        cur = cur
            .as_object_mut()
            .unwrap()
            .entry(*p)
            .or_insert(serde_json::json!({}));
    }
    cur[parts[parts.len() - 1]] = parsed;
    serde_json::to_string(&v).unwrap()
}

#[test]
fn kubeadm_file_parses_with_upstream_defaults_and_no_warnings() {
    let l = load(Some(KUBEADM), &[]).unwrap();
    assert!(l.warnings.is_empty(), "{:?}", l.warnings);
    let c = l.config;
    assert_eq!(c.mode, ProxyMode::Ipvs);
    assert!(c.ipvs_fallback);
    assert_eq!(c.node_name, "node-a.example");
    assert_eq!(
        c.kube.kubeconfig.as_deref(),
        Some(Path::new("/var/lib/kube-proxy/kubeconfig.conf"))
    );
    assert_eq!(c.kube.qps, 5.0);
    assert_eq!(c.kube.burst, 10);
    assert_eq!(
        c.healthz_bind_address,
        "0.0.0.0:10256".parse::<SocketAddr>().unwrap()
    );
    assert_eq!(
        c.metrics_bind_address,
        "127.0.0.1:10249".parse::<SocketAddr>().unwrap()
    );
    assert_eq!(c.ipvs.sync_period, Duration::from_secs(30));
    assert_eq!(c.ipvs.min_sync_period, Duration::ZERO);
    assert_eq!(c.ipvs.scheduler, "rr");
    assert!(c.ipvs.exclude_cidrs.is_empty());
    assert_eq!(c.iptables.masquerade_bit, 14);
    assert!(c.iptables.localhost_node_ports);
    assert_eq!(c.iptables.sync_period, Duration::from_secs(30));
    assert_eq!(c.iptables.min_sync_period, Duration::from_secs(1));
    assert_eq!(c.cluster_cidrs, vec!["10.244.0.0/16".parse().unwrap()]);
    assert_eq!(c.detect_local, DetectLocal::ClusterCidr);
    assert!(c.node_port_addresses.is_empty());
    assert_eq!(c.oom_score_adj, -999);
    assert_eq!(c.conntrack.max_per_core, 32768);
    assert_eq!(c.conntrack.min, 131072);
    assert_eq!(
        c.conntrack.tcp_established_timeout,
        Duration::from_secs(86400)
    );
    assert_eq!(
        c.conntrack.tcp_close_wait_timeout,
        Duration::from_secs(3600)
    );
    assert_eq!(c.conntrack.udp_timeout, Duration::ZERO);
    assert_eq!(c.config_sync_period, Duration::from_secs(900));
    assert_eq!(c.verbosity, 0);
    assert_eq!(c.log_format, LogFormat::Text);
    assert_eq!(c.drain_timeout, Duration::from_secs(900));
    assert!(!c.once && !c.cleanup);
}

#[test]
fn no_file_gives_the_same_defaults_as_the_kubeadm_file() {
    let a = load(
        None,
        &[
            "--kubeconfig",
            "/var/lib/kube-proxy/kubeconfig.conf",
            "--cluster-cidr",
            "10.244.0.0/16",
        ],
    )
    .unwrap()
    .config;
    let b = load(Some(KUBEADM), &[]).unwrap().config;
    assert_eq!(a, b);
}

#[test]
fn flags_override_the_file() {
    let file = kubeadm_with(
        "ipvs",
        "{scheduler: wrr, strictARP: true, syncPeriod: 1m, excludeCIDRs: [10.0.0.0/8]}",
    );
    let c = load(Some(&file), &[]).unwrap().config;
    assert_eq!(c.ipvs.scheduler, "wrr");
    assert!(c.ipvs.strict_arp);
    assert_eq!(c.ipvs.sync_period, Duration::from_secs(60));
    assert_eq!(c.ipvs.exclude_cidrs, vec!["10.0.0.0/8".parse().unwrap()]);
    let c = load(
        Some(&file),
        &[
            "--ipvs-scheduler=lc",
            "--ipvs-strict-arp=false",
            "--ipvs-exclude-cidrs",
            "192.168.0.0/16,fd00::/8",
            "--hostname-override",
            " Worker-7 ",
            "--proxy-mode",
            "iptables",
            "--masquerade-all",
            "-v",
            "4",
            "--log-format=json",
            "--nodeport-addresses",
            "primary,192.168.0.0/24",
            "--healthz-bind-address",
            "127.0.0.1",
            "--metrics-bind-address",
            "[::1]:9999",
            "--once",
        ],
    )
    .unwrap()
    .config;
    assert_eq!(c.ipvs.scheduler, "lc");
    assert!(!c.ipvs.strict_arp);
    assert_eq!(
        c.ipvs.sync_period,
        Duration::from_secs(60),
        "file value kept"
    );
    assert_eq!(
        c.ipvs.exclude_cidrs,
        vec![
            "192.168.0.0/16".parse().unwrap(),
            "fd00::/8".parse().unwrap()
        ]
    );
    assert_eq!(c.node_name, "worker-7");
    assert_eq!(c.mode, ProxyMode::Iptables);
    assert!(c.iptables.masquerade_all);
    assert_eq!(c.verbosity, 4);
    assert_eq!(c.log_format, LogFormat::Json);
    assert_eq!(
        c.node_port_addresses,
        vec![
            NodePortAddress::Primary,
            NodePortAddress::Cidr("192.168.0.0/24".parse().unwrap())
        ]
    );
    assert_eq!(
        c.healthz_bind_address,
        "127.0.0.1:10256".parse::<SocketAddr>().unwrap()
    );
    assert_eq!(
        c.metrics_bind_address,
        "[::1]:9999".parse::<SocketAddr>().unwrap()
    );
    assert!(c.once);
}

#[test]
fn ipv6_bind_address_moves_the_default_server_addresses() {
    let c = load(None, &["--bind-address", "::"]).unwrap().config;
    assert_eq!(
        c.healthz_bind_address,
        "[::]:10256".parse::<SocketAddr>().unwrap()
    );
    assert_eq!(
        c.metrics_bind_address,
        "[::1]:10249".parse::<SocketAddr>().unwrap()
    );
}

#[test]
fn unknown_and_ignored_fields_warn_once_each() {
    let file = kubeadm_with("ipvs.bogus", "1");
    let mut v: serde_json::Value = serde_saphyr::from_str(&file).unwrap();
    v["udpIdleTimeout"] = serde_json::json!("250ms");
    v["enableProfiling"] = serde_json::json!(true);
    v["winkernel"]["enableDSR"] = serde_json::json!(true);
    v["featureGates"] = serde_json::json!({"SomeGate": true});
    let text = serde_json::to_string(&v).unwrap();
    let l = load(Some(&text), &["--profiling"]).unwrap();
    let w = &l.warnings;
    let count = |s: &str| w.iter().filter(|x| x.contains(s)).count();
    assert_eq!(count("unknown field ipvs.bogus"), 1, "{w:?}");
    assert_eq!(count("unknown field udpIdleTimeout"), 1, "{w:?}");
    assert_eq!(count("field enableProfiling is ignored"), 1, "{w:?}");
    assert_eq!(count("field winkernel.enableDSR is ignored"), 1, "{w:?}");
    assert_eq!(count("field featureGates is ignored"), 1, "{w:?}");
    assert_eq!(count("--profiling is ignored"), 1, "{w:?}");
    assert_eq!(w.len(), 6, "{w:?}");
}

#[test]
fn each_invalid_field_is_an_error_naming_it() {
    // (field path, YAML value, expected error field, expected message fragment)
    let cases: &[(&str, &str, &str, &str)] = &[
        (
            "ipvs.syncPeriod",
            "3x",
            "ipvs.syncPeriod",
            "invalid duration \"3x\"",
        ),
        (
            "ipvs.minSyncPeriod",
            "1m",
            "ipvs.minSyncPeriod",
            "less than or equal to ipvs.syncPeriod",
        ),
        (
            "ipvs.scheduler",
            "fastest",
            "ipvs.scheduler",
            "unknown IPVS scheduler",
        ),
        (
            "ipvs.excludeCIDRs",
            "[10.0.0.0/8, nope]",
            "ipvs.excludeCIDRs[1]",
            "invalid CIDR \"nope\"",
        ),
        ("ipvs.tcpTimeout", "-5s", "ipvs.tcpTimeout", "negative"),
        (
            "ipvs.strictARP",
            "\"yes\"",
            "ipvs.strictARP",
            "expected true or false",
        ),
        (
            "iptables.masqueradeBit",
            "32",
            "iptables.masqueradeBit",
            "out of range 0..=31",
        ),
        (
            "iptables.syncPeriod",
            "5",
            "iptables.syncPeriod",
            "expected a duration string",
        ),
        (
            "iptables.minSyncPeriod",
            "2m",
            "iptables.minSyncPeriod",
            "less than or equal",
        ),
        ("mode", "nftables", "mode", "nftables mode is not supported"),
        ("mode", "userspace", "mode", "unknown proxy mode"),
        (
            "clusterCIDR",
            "10.0.0.0/8,10.1.0.0/16",
            "clusterCIDR",
            "dual-stack pair",
        ),
        ("clusterCIDR", "10.0.0/8", "clusterCIDR", "invalid CIDR"),
        (
            "nodePortAddresses",
            "[nope]",
            "nodePortAddresses[0]",
            "invalid CIDR",
        ),
        ("bindAddress", "x.y", "bindAddress", "invalid IP address"),
        (
            "healthzBindAddress",
            "1.2.3.4:99999",
            "healthzBindAddress",
            "invalid address",
        ),
        (
            "metricsBindAddress",
            "localhost:10249",
            "metricsBindAddress",
            "invalid address",
        ),
        (
            "oomScoreAdj",
            "2000",
            "oomScoreAdj",
            "out of range -1000..=1000",
        ),
        (
            "conntrack.maxPerCore",
            "-1",
            "conntrack.maxPerCore",
            "out of range",
        ),
        (
            "conntrack.tcpCloseWaitTimeout",
            "1y",
            "conntrack.tcpCloseWaitTimeout",
            "unknown unit",
        ),
        (
            "configSyncPeriod",
            "abc",
            "configSyncPeriod",
            "invalid duration",
        ),
        ("detectLocalMode", "Foo", "detectLocalMode", "unknown mode"),
        (
            "detectLocalMode",
            "BridgeInterface",
            "detectLocal.bridgeInterface",
            "required",
        ),
        (
            "detectLocalMode",
            "InterfaceNamePrefix",
            "detectLocal.interfaceNamePrefix",
            "required",
        ),
        (
            "logging.format",
            "xml",
            "logging.format",
            "unknown log format",
        ),
        (
            "logging.verbosity",
            "\"high\"",
            "logging.verbosity",
            "expected an integer",
        ),
        ("clientConnection.qps", "-1", "clientConnection.qps", ">= 0"),
        (
            "clientConnection.kubeconfig",
            "[a]",
            "clientConnection.kubeconfig",
            "expected a string",
        ),
        (
            "featureGates",
            "{SomeGate: \"yes\"}",
            "featureGates.SomeGate",
            "expected true or false",
        ),
        (
            "nftables.syncPeriod",
            "zz",
            "nftables.syncPeriod",
            "invalid duration",
        ),
    ];
    for (field, value, expect_field, expect_msg) in cases {
        let file = kubeadm_with(field, value);
        match load(Some(&file), &[]) {
            Err(Error::InvalidConfig(errs)) => {
                assert_eq!(errs.len(), 1, "{field}={value}: {errs:?}");
                assert_eq!(errs[0].field, *expect_field, "{field}={value}: {errs:?}");
                assert!(
                    errs[0].message.contains(expect_msg),
                    "{field}={value}: {:?} lacks {expect_msg:?}",
                    errs[0].message
                );
            }
            other => panic!("{field}={value}: expected an invalid-config error, got {other:?}"),
        }
    }
}

#[test]
fn flag_errors_name_the_flag_and_all_errors_come_together() {
    let err = load(
        Some(KUBEADM),
        &[
            "--ipvs-sync-period",
            "3x",
            "--iptables-masquerade-bit=40",
            "--kube-api-burst",
            "many",
        ],
    )
    .unwrap_err();
    let msg = err.to_string();
    assert!(
        msg.contains("--ipvs-sync-period: invalid duration \"3x\""),
        "{msg}"
    );
    assert!(
        msg.contains("--iptables-masquerade-bit: 40 is out of range 0..=31"),
        "{msg}"
    );
    assert!(
        msg.contains("--kube-api-burst: invalid integer \"many\""),
        "{msg}"
    );
    let Error::InvalidConfig(errs) = err else {
        unreachable!()
    };
    assert_eq!(errs.len(), 3, "{errs:?}");
}

#[test]
fn wrong_kind_or_broken_yaml_is_a_file_error() {
    let wrong = KUBEADM.replace("kind: KubeProxyConfiguration", "kind: KubeletConfiguration");
    let err = load(Some(&wrong), &[]).unwrap_err();
    assert!(matches!(err, Error::ConfigParse { .. }), "{err}");
    assert!(err.to_string().contains("KubeletConfiguration"), "{err}");
    let err = load(Some("apiVersion: [\n"), &[]).unwrap_err();
    assert!(matches!(err, Error::ConfigParse { .. }), "{err}");
    let err = load(Some("- a\n- b\n"), &[]).unwrap_err();
    assert!(
        err.to_string()
            .contains("expected a KubeProxyConfiguration mapping"),
        "{err}"
    );
}

#[test]
fn config_file_is_read_from_disk() {
    let path = std::env::temp_dir().join(format!("kube-ipvs-config-{}.yaml", std::process::id()));
    std::fs::write(&path, kubeadm_with("ipvs.scheduler", "sh")).unwrap();
    let args = cli::parse(["kube-ipvs", "--config", path.to_str().unwrap()]).unwrap();
    let c = config::load(&args);
    std::fs::remove_file(&path).unwrap();
    let c = c.unwrap().config;
    assert_eq!(c.ipvs.scheduler, "sh");
    assert_eq!(c.config_file.as_deref(), Some(path.as_path()));
    let args = cli::parse(["kube-ipvs", "--config", "/nonexistent/kp.yaml"]).unwrap();
    assert!(matches!(config::load(&args), Err(Error::ConfigRead { .. })));
}

#[test]
fn node_name_comes_from_the_host_unless_overridden() {
    let args = cli::parse(["kube-ipvs"]).unwrap();
    let c = config::from_sources(None, &args.flags, || Ok("  MyHost \n".into())).unwrap();
    assert_eq!(c.config.node_name, "myhost");
    let err = config::from_sources(None, &args.flags, || {
        Err(Error::HostnameRead(std::io::Error::other("no hostname")))
    })
    .unwrap_err();
    assert!(matches!(err, Error::NodeName(_)), "{err}");
    // The real kernel host name works too.
    let real = config::system_hostname().unwrap();
    let c = config::from_sources(None, &args.flags, config::system_hostname).unwrap();
    assert_eq!(c.config.node_name, real.trim().to_lowercase());
}

#[test]
fn mode_selection_and_fallback() {
    use kube_ipvs::mode::select;
    use kube_ipvs::probe::{ModuleLoad, NodeIpvsState, ProbeError, ProbeStep, Transient};
    // A node without IPVS-mode state.
    let clean = Some(NodeIpvsState::default());
    let absent = || Err(ProbeError::Absent(ModuleLoad::Failed(Some(1))));
    let c = load(None, &[]).unwrap().config;
    assert_eq!(select(&c, clean, || Ok(())).unwrap(), Some(ProxyMode::Ipvs));
    assert_eq!(
        select(&c, clean, absent).unwrap(),
        Some(ProxyMode::Iptables)
    );
    let strict = load(None, &["--ipvs-fallback=false"]).unwrap().config;
    let err = select(&strict, clean, absent).unwrap_err();
    assert!(err.to_string().contains("--ipvs-fallback=false"), "{err}");
    assert!(err.to_string().contains("IPVS is absent"), "{err}");
    let ipt = load(None, &["--proxy-mode=iptables", "--ipvs-fallback=false"])
        .unwrap()
        .config;
    assert_eq!(
        select(&ipt, clean, || panic!("no probe in iptables mode")).unwrap(),
        Some(ProxyMode::Iptables)
    );
    // A transient failure is retried (None), with fallback on or off: never iptables mode.
    let busy = || {
        Err(ProbeError::Transient(Transient {
            step: ProbeStep::Open,
            errno: Some(16),
            detail: "EBUSY".into(),
        }))
    };
    assert_eq!(select(&c, clean, busy).unwrap(), None);
    assert_eq!(select(&strict, clean, busy).unwrap(), None);
    // A missing scheduler on a node with IPVS state is retried, not a fallback.
    let sched = || {
        Err(ProbeError::SchedulerMissing {
            scheduler: "mh".into(),
            module: ModuleLoad::NoModprobe,
        })
    };
    let serving = Some(NodeIpvsState {
        dummy_link: true,
        owned_services: 3,
    });
    assert_eq!(select(&c, serving, sched).unwrap(), None);
    assert_eq!(select(&c, clean, sched).unwrap(), Some(ProxyMode::Iptables));
}

#[test]
fn conntrack_settings_in_kernel_units() {
    use sysctl::ConntrackSettings;
    // The kubeadm file (all conntrack fields null): upstream's defaults.
    let c = load(Some(KUBEADM), &[]).unwrap().config;
    assert_eq!(
        kube_ipvs::engine::conntrack_settings(&c),
        ConntrackSettings {
            max_per_core: 32768,
            min: 131072,
            tcp_established_timeout: 86400,
            tcp_close_wait_timeout: 3600,
            tcp_be_liberal: false,
            udp_timeout: 0,
            udp_stream_timeout: 0,
        }
    );
    assert_eq!(c.sysfs_root, Path::new("/sys"));
    assert_eq!(c.sysctl_root, Path::new("/proc/sys"));
    // Every field from the file; explicit zeros mean "leave the kernel's value".
    let file = kubeadm_with(
        "conntrack",
        "{maxPerCore: 0, min: 7, tcpEstablishedTimeout: 0s, tcpCloseWaitTimeout: 90s, \
         tcpBeLiberal: true, udpTimeout: 45s, udpStreamTimeout: 3m}",
    );
    let c = load(Some(&file), &[]).unwrap().config;
    assert_eq!(
        kube_ipvs::engine::conntrack_settings(&c),
        ConntrackSettings {
            max_per_core: 0,
            min: 7,
            tcp_established_timeout: 0,
            tcp_close_wait_timeout: 90,
            tcp_be_liberal: true,
            udp_timeout: 45,
            udp_stream_timeout: 180,
        }
    );
    // Flags override the file; durations count whole seconds (under one second: leave).
    let c = load(
        Some(&file),
        &[
            "--conntrack-max-per-core=100",
            "--conntrack-min=0",
            "--conntrack-tcp-timeout-established=2h0m1.9s",
            "--conntrack-tcp-timeout-close-wait=500ms",
            "--conntrack-tcp-be-liberal=false",
            "--conntrack-udp-timeout=0s",
            "--conntrack-udp-timeout-stream=61s",
            "--sysfs-root=/host/sys",
        ],
    )
    .unwrap()
    .config;
    assert_eq!(
        kube_ipvs::engine::conntrack_settings(&c),
        ConntrackSettings {
            max_per_core: 100,
            min: 0,
            tcp_established_timeout: 7201,
            tcp_close_wait_timeout: 0,
            tcp_be_liberal: false,
            udp_timeout: 0,
            udp_stream_timeout: 61,
        }
    );
    assert_eq!(c.sysfs_root, Path::new("/host/sys"));
}

#[test]
fn process_timeouts_default_to_the_libraries_and_reject_zero() {
    let c = load(None, &[]).unwrap().config;
    assert_eq!(c.ipset_timeout, ipset::DEFAULT_TIMEOUT);
    assert_eq!(c.iptables_timeout, iptables::DEFAULT_TIMEOUT);
    let c = load(None, &["--ipset-timeout", "1m", "--iptables-timeout=45s"])
        .unwrap()
        .config;
    assert_eq!(c.ipset_timeout, Duration::from_secs(60));
    assert_eq!(c.iptables_timeout, Duration::from_secs(45));
    for flag in ["--ipset-timeout=0s", "--iptables-timeout=0s"] {
        let err = load(None, &[flag]).unwrap_err();
        assert!(
            err.to_string().contains("must be greater than 0"),
            "{flag}: {err}"
        );
    }
}

/// Issue #32 (c): each Service's budget defaults to the model's defaults, flags change it, it
/// reaches the model's configuration of both families, and 0 is refused.
#[test]
fn service_budget_flags_default_reach_the_model_and_reject_zero() {
    let c = load(None, &[]).unwrap().config;
    assert_eq!(c.service_budget, model::ServiceBudget::default());
    let c = load(
        None,
        &[
            "--max-virtual-servers-per-service=100",
            "--max-real-servers-per-service",
            "2000",
            "--max-ipset-members-per-service=300",
        ],
    )
    .unwrap()
    .config;
    let want = model::ServiceBudget {
        virtual_servers: 100,
        real_servers: 2000,
        ipset_members: 300,
    };
    assert_eq!(c.service_budget, want);
    for fam in [ipvs_netlink::Family::Inet, ipvs_netlink::Family::Inet6] {
        assert_eq!(kube_ipvs::engine::proxy_config(&c, fam).budget, want);
    }
    for flag in [
        "--max-virtual-servers-per-service=0",
        "--max-real-servers-per-service=0",
        "--max-ipset-members-per-service=0",
    ] {
        let err = load(None, &[flag]).unwrap_err();
        assert!(
            err.to_string().contains("out of range 1..="),
            "{flag}: {err}"
        );
    }
}

/// Issue 17 item 6: no setting is accepted and silently ignored. `detectLocalMode: NodeCIDR`
/// is applied (the Node's spec.podCIDRs, see controller's detect_local_node_cidr tests) from the
/// file and the flag alike; `configSyncPeriod` (an informer resync, which kube-ipvs has no
/// equivalent of) warns when set.
#[test]
fn accepted_but_unapplied_settings_are_refused_or_warned() {
    for (file, argv) in [
        (Some(kubeadm_with("detectLocalMode", "NodeCIDR")), vec![]),
        (None, vec!["--detect-local-mode", "NodeCIDR"]),
    ] {
        let l = load(file.as_deref(), &argv).unwrap();
        assert_eq!(l.config.detect_local, DetectLocal::NodeCidr);
        let rules = kube_ipvs::engine::rules_config(&l.config, true);
        assert!(rules.node_cidr);
        assert_eq!(rules.local_detect, iptables::LocalDetect::None);
    }
    let l = load(Some(&kubeadm_with("configSyncPeriod", "30m")), &[]).unwrap();
    assert!(
        l.warnings
            .iter()
            .any(|w| w.contains("field configSyncPeriod is ignored") && w.contains("resync")),
        "{:?}",
        l.warnings
    );
    // kubeadm's `configSyncPeriod: 0s` (unset) stays silent.
    let l = load(Some(KUBEADM), &[]).unwrap();
    assert!(
        !l.warnings.iter().any(|w| w.contains("configSyncPeriod")),
        "{:?}",
        l.warnings
    );
}

/// `iptables.localhostNodePorts` reaches the iptables-mode configuration, with upstream's
/// rules (pkg/proxy/iptables/proxier.go `NewProxier`): IPv4 only, and only while the NodePort
/// addresses contain 127.0.0.0 (all addresses, or a CIDR holding it).
#[test]
fn localhost_node_ports_follow_the_setting_and_node_port_addresses() {
    use ipvs_netlink::Family;
    use kube_ipvs::engine::proxy_config;
    let on = |argv: &[&str], family| {
        let l = load(Some(KUBEADM), argv).unwrap();
        proxy_config(&l.config, family).localhost_node_ports()
    };
    assert!(on(&[], Family::Inet), "default true");
    assert!(!on(&[], Family::Inet6), "never on IPv6");
    assert!(!on(&["--iptables-localhost-nodeports=false"], Family::Inet));
    assert!(!on(&["--nodeport-addresses", "10.0.0.0/8"], Family::Inet));
    assert!(on(
        &["--nodeport-addresses", "10.0.0.0/8,127.0.0.0/8"],
        Family::Inet
    ));
    let l = load(
        Some(&kubeadm_with("iptables.localhostNodePorts", "false")),
        &[],
    )
    .unwrap();
    assert!(!l.config.iptables.localhost_node_ports);
}

/// The accepted `ipvs.scheduler` / `--ipvs-scheduler` values are exactly the kernel's
/// schedulers ([`ipvs_netlink::SCHEDULERS`], the table the `kube-ipvs.io/scheduler` annotation
/// is checked against too): upstream accepts any name since Kubernetes 1.27
/// (kubernetes/kubernetes#114878 removed `validateIPVSSchedulerMethod`), so `mh`, `fo` and `ovf`
/// are accepted; a name the kernel does not ship is rejected with the list; empty means `rr`.
#[test]
fn ipvs_scheduler_accepts_exactly_the_kernel_schedulers() {
    const KERNEL: [&str; 13] = [
        "rr", "wrr", "lc", "wlc", "lblc", "lblcr", "sh", "dh", "sed", "nq", "mh", "fo", "ovf",
    ];
    assert_eq!(config::SCHEDULERS, KERNEL);
    for s in KERNEL {
        let flag = format!("--ipvs-scheduler={s}");
        let c = load(Some(KUBEADM), &[&flag]).unwrap().config;
        assert_eq!(c.ipvs.scheduler, s, "{flag}");
        let c = load(Some(&kubeadm_with("ipvs.scheduler", s)), &[])
            .unwrap()
            .config;
        assert_eq!(c.ipvs.scheduler, s, "ipvs.scheduler: {s}");
    }
    let c = load(Some(KUBEADM), &["--ipvs-scheduler="]).unwrap().config;
    assert_eq!(c.ipvs.scheduler, "rr");
    for bad in ["fastest", "RR", "ip_vs_rr", "twos"] {
        let flag = format!("--ipvs-scheduler={bad}");
        let err = load(Some(KUBEADM), &[&flag]).unwrap_err().to_string();
        assert!(
            err.contains(&format!(
                "unknown IPVS scheduler {bad:?} (one of rr, wrr, lc, wlc, lblc, lblcr, sh, dh, \
                 sed, nq, mh, fo, ovf)"
            )),
            "{err}"
        );
    }
}

/// `--protected-node-ports` (issue #32): defaults to `model::DEFAULT_PROTECTED_NODE_PORTS` on
/// every protocol, takes `PORT` and `PORT/PROTOCOL` entries, rejects anything else naming the
/// entry; the model's configuration always adds the healthz and metrics ports (TCP).
/// `--refuse-node-address-vips` defaults to off (upstream serves such claims).
#[test]
fn protected_node_ports_and_refusal_flags() {
    use ipvs_netlink::{Family, Protocol};
    use kube_ipvs::engine::proxy_config;
    use model::ProtectedPort;
    let any = |port| ProtectedPort {
        port,
        protocol: None,
    };
    let on = |port, p| ProtectedPort {
        port,
        protocol: Some(p),
    };
    let l = load(Some(KUBEADM), &[]).unwrap();
    let want: Vec<ProtectedPort> = model::DEFAULT_PROTECTED_NODE_PORTS
        .iter()
        .map(|p| any(*p))
        .collect();
    assert_eq!(l.config.protected_node_ports, want);
    assert!(!l.config.refuse_node_address_vips);
    // The library's default (tests, `plan` without flags) is the flag's default.
    assert_eq!(
        model::ProxyConfig::new(Family::Inet).protected_node_ports,
        want
    );
    let p = proxy_config(&l.config, Family::Inet);
    assert!(!p.refuse_node_address_vips);
    for port in [22, 6443, 10249, 10250, 10256] {
        assert!(
            p.protected_node_ports
                .iter()
                .any(|e| e.covers(port, Protocol::Udp)),
            "{port}"
        );
    }
    let l = load(
        None,
        &[
            "--protected-node-ports",
            "8443/udp, 9000,7000/SCTP",
            "--healthz-bind-address=0.0.0.0:12256",
            "--metrics-bind-address=127.0.0.1:12249",
            "--refuse-node-address-vips",
        ],
    )
    .unwrap();
    assert_eq!(
        l.config.protected_node_ports,
        vec![on(7000, Protocol::Sctp), on(8443, Protocol::Udp), any(9000)]
    );
    let p = proxy_config(&l.config, Family::Inet6);
    assert!(p.refuse_node_address_vips);
    assert_eq!(
        p.protected_node_ports,
        vec![
            on(7000, Protocol::Sctp),
            on(8443, Protocol::Udp),
            any(9000),
            on(12249, Protocol::Tcp),
            on(12256, Protocol::Tcp),
        ]
    );
    // Empty: only the proxy's own ports.
    let l = load(None, &["--protected-node-ports="]).unwrap();
    assert!(l.config.protected_node_ports.is_empty());
    let p = proxy_config(&l.config, Family::Inet);
    assert_eq!(
        p.protected_node_ports,
        vec![on(10249, Protocol::Tcp), on(10256, Protocol::Tcp)]
    );
    for bad in ["0", "65536", "http", "80/icmp", "80/"] {
        let err = load(None, &["--protected-node-ports", bad]).unwrap_err();
        let text = err.to_string();
        assert!(
            text.contains("--protected-node-ports[0]") && text.contains("invalid protected port"),
            "{bad}: {text}"
        );
    }
}
