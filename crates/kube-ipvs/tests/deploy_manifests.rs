//! Schema-level validation of `deploy/`: every manifest parses into its k8s-openapi type, and the
//! fields the daemon relies on agree with each other and with the code (the ConfigMap loads through
//! `kube_ipvs::config`, the container's command line parses with `kube_ipvs::cli`, probes hit the
//! healthz port the config binds, RBAC grants exactly what the proxy uses).

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use k8s_openapi::api::apps::v1::DaemonSet;
use k8s_openapi::api::core::v1::{ConfigMap, Container, PodSpec, ServiceAccount, Volume};
use k8s_openapi::api::rbac::v1::{ClusterRole, ClusterRoleBinding};
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use serde_json::Value;

fn deploy_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../deploy")
}

/// Every document of every `deploy/*.yaml` file except the kustomization, as (file, document).
fn documents() -> Vec<(String, Value)> {
    let mut out = Vec::new();
    let mut files: Vec<_> = std::fs::read_dir(deploy_dir())
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "yaml"))
        .collect();
    files.sort();
    for p in files {
        let name = p.file_name().unwrap().to_string_lossy().to_string();
        if name == "kustomization.yaml" {
            continue;
        }
        let text = std::fs::read_to_string(&p).unwrap();
        let docs: Vec<Value> =
            serde_saphyr::from_multiple(&text).unwrap_or_else(|e| panic!("{name}: not YAML: {e}"));
        for d in docs.into_iter().filter(|d| !d.is_null()) {
            out.push((name.clone(), d));
        }
    }
    out
}

/// The one document of `kind`, deserialized into its k8s-openapi type (which checks apiVersion
/// and kind and every field's type).
fn one<T: serde::de::DeserializeOwned>(kind: &str) -> T {
    let docs: Vec<_> = documents()
        .into_iter()
        .filter(|(_, d)| d["kind"] == kind)
        .collect();
    assert_eq!(docs.len(), 1, "expected one {kind} in deploy/");
    let (file, doc) = docs.into_iter().next().unwrap();
    serde_json::from_value(doc).unwrap_or_else(|e| panic!("{file}: {kind}: {e}"))
}

fn daemonset() -> DaemonSet {
    one("DaemonSet")
}

fn pod_spec() -> PodSpec {
    daemonset().spec.unwrap().template.spec.unwrap()
}

/// The pod volume the container mounts at `dir` (panics when there is none).
fn volume_mounted_at(dir: &str) -> Volume {
    let mount = container()
        .volume_mounts
        .unwrap_or_default()
        .into_iter()
        .find(|m| m.mount_path == dir)
        .unwrap_or_else(|| panic!("no volume mounted at {dir}"));
    pod_spec()
        .volumes
        .unwrap_or_default()
        .into_iter()
        .find(|v| v.name == mount.name)
        .unwrap_or_else(|| panic!("volume {} is not in the pod spec", mount.name))
}

fn container() -> Container {
    let spec = pod_spec();
    assert_eq!(spec.containers.len(), 1);
    spec.containers.into_iter().next().unwrap()
}

fn configmap() -> ConfigMap {
    one("ConfigMap")
}

/// The container's command line with `$(VAR)` references expanded from its `env` the way kubelet
/// does (only `fieldRef: spec.nodeName` is used; it becomes `node-a`).
fn command_line() -> Vec<String> {
    let c = container();
    let mut argv: Vec<String> = c.command.clone().unwrap_or_default();
    argv.extend(c.args.clone().unwrap_or_default());
    let env = c.env.unwrap_or_default();
    argv.iter()
        .map(|a| {
            let mut a = a.clone();
            for e in &env {
                let pattern = format!("$({})", e.name);
                if a.contains(&pattern) {
                    let field = e
                        .value_from
                        .as_ref()
                        .and_then(|v| v.field_ref.as_ref())
                        .map(|f| f.field_path.clone());
                    assert_eq!(field.as_deref(), Some("spec.nodeName"), "{}", e.name);
                    a = a.replace(&pattern, "node-a");
                }
            }
            assert!(!a.contains("$("), "unresolved variable in {a}");
            a
        })
        .collect()
}

/// The KubeProxyConfiguration of the ConfigMap, loaded by kube-ipvs's own loader with the
/// DaemonSet's flags.
fn loaded_config() -> kube_ipvs::config::Loaded {
    let argv = command_line();
    let args = kube_ipvs::cli::parse(&argv).unwrap_or_else(|e| panic!("{argv:?}: {e}"));
    let config_path = args.flag("config").expect("--config").to_string();
    let (dir, key) = config_path.rsplit_once('/').unwrap();
    // The file is the ConfigMap key mounted at the flag's directory.
    let vol = volume_mounted_at(dir);
    let cm = configmap();
    assert_eq!(
        vol.config_map.map(|c| c.name),
        cm.metadata.name,
        "--config must come from the kube-ipvs ConfigMap"
    );
    let data = cm.data.unwrap();
    let text = data
        .get(key)
        .unwrap_or_else(|| panic!("ConfigMap has no key {key}"));
    kube_ipvs::config::from_sources(Some((Path::new(&config_path), text)), &args.flags, || {
        Ok("unused".into())
    })
    .unwrap_or_else(|e| panic!("the ConfigMap's KubeProxyConfiguration: {e}"))
}

#[test]
fn every_manifest_parses_into_its_kubernetes_type() {
    let docs = documents();
    let (mut attempted, mut ok) = (0, 0);
    for (file, doc) in &docs {
        attempted += 1;
        let kind = doc["kind"].as_str().unwrap_or_default().to_string();
        let res = match kind.as_str() {
            "DaemonSet" => serde_json::from_value::<DaemonSet>(doc.clone()).map(|_| ()),
            "ConfigMap" => serde_json::from_value::<ConfigMap>(doc.clone()).map(|_| ()),
            "ServiceAccount" => serde_json::from_value::<ServiceAccount>(doc.clone()).map(|_| ()),
            "ClusterRole" => serde_json::from_value::<ClusterRole>(doc.clone()).map(|_| ()),
            "ClusterRoleBinding" => {
                serde_json::from_value::<ClusterRoleBinding>(doc.clone()).map(|_| ())
            }
            other => panic!("{file}: unexpected kind {other:?}"),
        };
        res.unwrap_or_else(|e| panic!("{file}: {kind}: {e}"));
        ok += 1;
        // Namespaced objects live in kube-system (the kustomization sets it too).
        if kind != "ClusterRole" && kind != "ClusterRoleBinding" {
            assert_eq!(doc["metadata"]["namespace"], "kube-system", "{file} {kind}");
        }
    }
    println!(
        "manifests: {attempted} attempted, {ok} succeeded, {} failed",
        attempted - ok
    );
    let kinds: BTreeSet<_> = docs
        .iter()
        .map(|(_, d)| d["kind"].as_str().unwrap().to_string())
        .collect();
    assert_eq!(
        kinds,
        [
            "ClusterRole",
            "ClusterRoleBinding",
            "ConfigMap",
            "DaemonSet",
            "ServiceAccount"
        ]
        .map(String::from)
        .into()
    );
}

#[test]
fn kustomization_lists_every_manifest_and_the_image() {
    let text = std::fs::read_to_string(deploy_dir().join("kustomization.yaml")).unwrap();
    let k: Value = serde_saphyr::from_str(&text).unwrap();
    assert_eq!(k["apiVersion"], "kustomize.config.k8s.io/v1beta1");
    assert_eq!(k["kind"], "Kustomization");
    assert_eq!(k["namespace"], "kube-system");
    let listed: BTreeSet<String> = k["resources"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_str().unwrap().to_string())
        .collect();
    let present: BTreeSet<String> = documents().into_iter().map(|(f, _)| f).collect();
    assert_eq!(listed, present, "kustomization resources vs deploy/*.yaml");
    // The images transformer targets the container's image name.
    let image = container().image.unwrap();
    let name = image.split(':').next().unwrap();
    assert!(
        k["images"]
            .as_array()
            .unwrap()
            .iter()
            .any(|i| i["name"] == name),
        "kustomization images[] does not name {name}"
    );
}

#[test]
fn daemonset_has_what_a_node_proxy_needs() {
    let ds = daemonset();
    let spec = ds.spec.clone().unwrap();
    // Rolling update, one node at a time.
    let strategy = spec.update_strategy.unwrap();
    assert_eq!(strategy.type_.as_deref(), Some("RollingUpdate"));
    assert_eq!(
        strategy.rolling_update.unwrap().max_unavailable,
        Some(IntOrString::Int(1))
    );
    // The selector matches the template.
    let selector = spec.selector.match_labels.unwrap();
    let labels = spec.template.metadata.unwrap().labels.unwrap();
    for (k, v) in &selector {
        assert_eq!(
            labels.get(k),
            Some(v),
            "selector {k}={v} not on the template"
        );
    }
    let pod = pod_spec();
    assert_eq!(pod.host_network, Some(true));
    assert_eq!(
        pod.priority_class_name.as_deref(),
        Some("system-node-critical")
    );
    // Tolerates every taint: one toleration with operator Exists and no key or effect.
    let tolerations = pod.tolerations.clone().unwrap();
    assert!(
        tolerations
            .iter()
            .any(|t| t.operator.as_deref() == Some("Exists")
                && t.key.is_none()
                && t.effect.is_none()),
        "{tolerations:?}"
    );
    assert_eq!(pod.service_account_name.as_deref(), Some("kube-ipvs"));
    let sa: ServiceAccount = one("ServiceAccount");
    assert_eq!(sa.metadata.name.as_deref(), Some("kube-ipvs"));
}

#[test]
fn container_is_unprivileged_with_only_the_needed_capabilities() {
    let c = container();
    let sc = c.security_context.unwrap();
    assert_ne!(sc.privileged, Some(true), "must not be privileged");
    assert_eq!(sc.allow_privilege_escalation, Some(false));
    let caps = sc.capabilities.unwrap();
    assert_eq!(caps.drop, Some(vec!["ALL".to_string()]));
    let add: BTreeSet<String> = caps.add.unwrap().into_iter().collect();
    // NET_ADMIN: IPVS/ipset/rtnetlink/ctnetlink/iptables writes and net sysctls.
    // NET_RAW: iptables-legacy opens a raw socket. Nothing else.
    assert_eq!(
        add,
        ["NET_ADMIN", "NET_RAW"].map(String::from).into(),
        "capabilities beyond NET_ADMIN/NET_RAW need a justification in daemonset.yaml"
    );
    let text = std::fs::read_to_string(deploy_dir().join("daemonset.yaml")).unwrap();
    for why in ["CAP_NET_ADMIN", "CAP_NET_RAW", "not privileged"] {
        assert!(
            text.to_lowercase().contains(&why.to_lowercase()),
            "daemonset.yaml comment should explain {why}"
        );
    }
    // No host root; /lib/modules only for the load-modules init container, never for the
    // long-running one (it has no CAP_SYS_MODULE either).
    let pod = pod_spec();
    for v in pod.volumes.unwrap_or_default() {
        if let Some(hp) = v.host_path {
            assert!(
                ["/run/xtables.lock", "/proc/sys/net", "/lib/modules"].contains(&hp.path.as_str()),
                "unexpected hostPath {}",
                hp.path
            );
            if hp.path == "/lib/modules" {
                assert!(
                    !c.volume_mounts
                        .clone()
                        .unwrap_or_default()
                        .iter()
                        .any(|m| m.name == v.name),
                    "the daemon's container must not mount /lib/modules"
                );
            }
        }
    }
}

/// The one init container, `load-modules`.
fn init_container() -> Container {
    let inits = pod_spec().init_containers.unwrap_or_default();
    assert_eq!(inits.len(), 1, "one init container: load-modules");
    let c = inits.into_iter().next().unwrap();
    assert_eq!(c.name, "load-modules");
    c
}

#[test]
fn init_container_loads_modules_with_only_sys_module_and_read_only_lib_modules() {
    let init = init_container();
    let main = container();
    // The same image as the daemon (kustomize's images[] rewrites both).
    assert_eq!(init.image, main.image);
    // Its command is `kube-ipvs load-modules` with the daemon's --config (the scheduler's
    // module comes from the same ConfigMap).
    let mut argv = init.command.clone().unwrap_or_default();
    argv.extend(init.args.clone().unwrap_or_default());
    assert_eq!(
        argv[0],
        command_line()[0],
        "the binary the Containerfile installs"
    );
    let args = kube_ipvs::cli::parse(&argv).unwrap_or_else(|e| panic!("{argv:?}: {e}"));
    assert_eq!(args.action, kube_ipvs::cli::Action::LoadModules);
    let main_args = kube_ipvs::cli::parse(command_line()).unwrap();
    assert_eq!(args.flag("config"), main_args.flag("config"));
    // Least privilege: only CAP_SYS_MODULE, no privilege escalation, not privileged, read-only
    // root, the runtime's seccomp profile (which allows finit_module with CAP_SYS_MODULE).
    let sc = init.security_context.clone().unwrap();
    assert_ne!(sc.privileged, Some(true), "must not be privileged");
    assert_eq!(sc.allow_privilege_escalation, Some(false));
    assert_eq!(sc.read_only_root_filesystem, Some(true));
    assert_eq!(
        sc.run_as_user,
        Some(0),
        "added capabilities are effective for root only"
    );
    assert_eq!(
        sc.seccomp_profile.map(|p| p.type_).as_deref(),
        Some("RuntimeDefault")
    );
    let caps = sc.capabilities.unwrap();
    assert_eq!(caps.drop, Some(vec!["ALL".to_string()]));
    assert_eq!(
        caps.add,
        Some(vec!["SYS_MODULE".to_string()]),
        "only SYS_MODULE"
    );
    // Mounts: the host's /lib/modules and the config, both read-only, nothing else.
    let mounts = init.volume_mounts.clone().unwrap_or_default();
    let vols = pod_spec().volumes.unwrap_or_default();
    let mut paths = BTreeSet::new();
    for m in &mounts {
        assert_eq!(
            m.read_only,
            Some(true),
            "{} must be read-only",
            m.mount_path
        );
        paths.insert(m.mount_path.clone());
        let v = vols.iter().find(|v| v.name == m.name).unwrap();
        if m.mount_path == "/lib/modules" {
            assert_eq!(v.host_path.as_ref().unwrap().path, "/lib/modules");
        } else {
            assert!(v.config_map.is_some(), "{}: {v:?}", m.mount_path);
        }
    }
    let (dir, _) = args.flag("config").unwrap().rsplit_once('/').unwrap();
    assert_eq!(
        paths,
        ["/lib/modules".to_string(), dir.to_string()].into(),
        "init container mounts"
    );
    // A memory limit (modprobe and the config loader need little).
    assert!(init
        .resources
        .unwrap()
        .limits
        .unwrap()
        .contains_key("memory"));
    let text = std::fs::read_to_string(deploy_dir().join("daemonset.yaml")).unwrap();
    for why in ["CAP_SYS_MODULE", "load-modules", "falls back"] {
        assert!(
            text.contains(why),
            "daemonset.yaml comment should explain {why}"
        );
    }
}

#[test]
fn container_has_seccomp_a_memory_limit_and_a_pinned_image() {
    let c = container();
    let sc = c.security_context.clone().unwrap();
    assert_eq!(
        sc.seccomp_profile.map(|p| p.type_).as_deref(),
        Some("RuntimeDefault"),
        "seccompProfile RuntimeDefault"
    );
    assert_eq!(sc.read_only_root_filesystem, Some(true));
    // UID 0 only because added capabilities are effective for root only; said so.
    assert_eq!(sc.run_as_user, Some(0));
    let text = std::fs::read_to_string(deploy_dir().join("daemonset.yaml")).unwrap();
    assert!(
        text.contains("runAsUser 0 is required"),
        "daemonset.yaml should explain runAsUser 0"
    );
    // A memory limit at least the benchmarked peak RSS (docs/benchmarks.md, P3 peak at 10,000
    // Services) with headroom, and not below the request.
    let res = c.resources.unwrap();
    let mib = |q: &k8s_openapi::apimachinery::pkg::api::resource::Quantity| -> u64 {
        let s = q.0.as_str();
        if let Some(n) = s.strip_suffix("Gi") {
            n.parse::<u64>().unwrap() * 1024
        } else {
            s.strip_suffix("Mi").unwrap().parse().unwrap()
        }
    };
    let limit = mib(&res.limits.unwrap()["memory"]);
    let request = mib(&res.requests.unwrap()["memory"]);
    let bench = std::fs::read_to_string(deploy_dir().join("../docs/benchmarks.md")).unwrap();
    let peak_line = bench
        .lines()
        .find(|l| l.starts_with("| P3 peak RSS |"))
        .expect("docs/benchmarks.md has the P3 peak RSS row");
    let peak: f64 = peak_line
        .split('|')
        .nth(2)
        .unwrap()
        .trim()
        .trim_end_matches(" MiB")
        .parse()
        .unwrap();
    assert!(
        limit as f64 >= 1.5 * peak,
        "limit {limit} MiB vs peak {peak} MiB"
    );
    assert!(request <= limit && request >= 64);
    // The image is pinned to the crate's version (never :latest), here and in kustomize.
    let image = c.image.unwrap();
    assert_eq!(
        image,
        format!("kube-ipvs:{}", env!("CARGO_PKG_VERSION")),
        "pinned image tag"
    );
    let k = std::fs::read_to_string(deploy_dir().join("kustomization.yaml")).unwrap();
    assert!(
        k.contains(&format!("newTag: {}", env!("CARGO_PKG_VERSION"))),
        "{k}"
    );
    assert!(!text.contains(":latest") && !k.contains("latest"));
}

#[test]
fn command_line_parses_and_sysctls_go_to_the_host_mount() {
    let argv = command_line();
    // The binary path is where the Containerfile installs it.
    let containerfile = std::fs::read_to_string(
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../Containerfile"),
    )
    .unwrap();
    assert!(
        containerfile.contains(&argv[0]),
        "Containerfile does not install {}",
        argv[0]
    );
    let loaded = loaded_config();
    let cfg = &loaded.config;
    assert_eq!(cfg.node_name, "node-a", "--hostname-override=$(NODE_NAME)");
    // /proc/sys is read-only in an unprivileged container: sysctls are written under the host's
    // /proc/sys/net, mounted read-write at <sysctl-root>/net.
    let root = cfg.sysctl_root.to_string_lossy().to_string();
    assert_ne!(root, "/proc/sys");
    let c = container();
    let mounts = c.volume_mounts.unwrap_or_default();
    let net = mounts
        .iter()
        .find(|m| m.mount_path == format!("{root}/net"))
        .unwrap_or_else(|| panic!("nothing mounted at {root}/net"));
    assert_ne!(net.read_only, Some(true));
    let vols = pod_spec().volumes.unwrap_or_default();
    let hp = vols
        .iter()
        .find(|v| v.name == net.name)
        .and_then(|v| v.host_path.clone())
        .unwrap();
    assert_eq!(hp.path, "/proc/sys/net");
    // The xtables lock is the host's.
    let lock = mounts
        .iter()
        .find(|m| m.mount_path == "/run/xtables.lock")
        .unwrap();
    let hp = vols
        .iter()
        .find(|v| v.name == lock.name)
        .and_then(|v| v.host_path.clone())
        .unwrap();
    assert_eq!(hp.path, "/run/xtables.lock");
    assert_eq!(hp.type_.as_deref(), Some("FileOrCreate"));
}

#[test]
fn configmap_loads_without_errors_or_warnings() {
    let loaded = loaded_config();
    println!("config warnings: {:?}", loaded.warnings);
    assert!(
        loaded.warnings.is_empty(),
        "the shipped config should not warn: {:?}",
        loaded.warnings
    );
    let cfg = loaded.config;
    assert_eq!(cfg.mode, kube_ipvs::config::ProxyMode::Ipvs);
    // The kubeconfig is kubeadm's kubeconfig.conf, mounted from the kube-proxy ConfigMap.
    let kc = cfg
        .kube
        .kubeconfig
        .clone()
        .expect("clientConnection.kubeconfig: in-cluster config would need the ClusterIP");
    let (dir, key) = kc.to_str().unwrap().rsplit_once('/').unwrap();
    let vol = volume_mounted_at(dir);
    let cm = vol.config_map.unwrap();
    assert_eq!(cm.name, "kube-proxy", "kubeadm's ConfigMap");
    assert!(cm
        .items
        .unwrap_or_default()
        .iter()
        .any(|i| i.key == "kubeconfig.conf" && i.path == key));
    // The oom score does not need CAP_SYS_RESOURCE (kubelet already set -997).
    assert!(cfg.oom_score_adj >= -997, "{}", cfg.oom_score_adj);
}

#[test]
fn probes_hit_livez_and_healthz_on_the_configured_port() {
    let cfg = loaded_config().config;
    let port = cfg.healthz_bind_address.port();
    // hostNetwork: the kubelet probes the node's address, so the server must not be loopback-only.
    assert!(
        !cfg.healthz_bind_address.ip().is_loopback(),
        "{}",
        cfg.healthz_bind_address
    );
    let c = container();
    for (probe, path) in [
        (c.liveness_probe.clone().unwrap(), "/livez"),
        (c.readiness_probe.clone().unwrap(), "/healthz"),
    ] {
        let get = probe.http_get.unwrap();
        assert_eq!(get.path.as_deref(), Some(path));
        let p = match get.port {
            IntOrString::Int(p) => p,
            IntOrString::String(name) => {
                c.ports
                    .clone()
                    .unwrap_or_default()
                    .iter()
                    .find(|p| p.name.as_deref() == Some(name.as_str()))
                    .unwrap()
                    .container_port
            }
        };
        assert_eq!(p, i32::from(port), "{path} probe port");
    }
}

/// The kubelet's default probe timeout (1 s) restarted a healthy kube-ipvs on the conformance
/// run's CPU-starved node (its /livez answered, late): the probes wait 5 s, and the liveness
/// probe gives a minute of failures before a restart.
#[test]
fn probes_tolerate_a_slow_node() {
    let c = container();
    for (name, probe) in [
        ("liveness", c.liveness_probe.clone().unwrap()),
        ("readiness", c.readiness_probe.clone().unwrap()),
    ] {
        assert!(
            probe.timeout_seconds.unwrap_or(1) >= 5,
            "{name} probe timeoutSeconds {:?}",
            probe.timeout_seconds
        );
    }
    let l = c.liveness_probe.unwrap();
    assert!(
        l.failure_threshold.unwrap_or(3) * l.period_seconds.unwrap_or(10) >= 60,
        "{l:?}"
    );
}

#[test]
fn cluster_role_grants_exactly_what_the_proxy_uses() {
    let role: ClusterRole = one("ClusterRole");
    let mut granted = BTreeSet::new();
    for r in role.rules.unwrap() {
        assert!(r.resource_names.is_none() && r.non_resource_urls.is_none());
        for g in r.api_groups.clone().unwrap_or_default() {
            for res in r.resources.clone().unwrap_or_default() {
                for v in &r.verbs {
                    granted.insert(format!("{g}/{res}:{v}"));
                }
            }
        }
    }
    let want: BTreeSet<String> = [
        "/services:list",
        "/services:watch",
        "/nodes:list",
        "/nodes:watch",
        "discovery.k8s.io/endpointslices:list",
        "discovery.k8s.io/endpointslices:watch",
        "events.k8s.io/events:create",
        "events.k8s.io/events:patch",
    ]
    .map(String::from)
    .into();
    assert_eq!(granted, want);
    let binding: ClusterRoleBinding = one("ClusterRoleBinding");
    assert_eq!(binding.role_ref.kind, "ClusterRole");
    assert_eq!(Some(binding.role_ref.name.clone()), role.metadata.name);
    let subjects = binding.subjects.unwrap();
    assert_eq!(subjects.len(), 1);
    assert_eq!(subjects[0].kind, "ServiceAccount");
    assert_eq!(subjects[0].name, "kube-ipvs");
    assert_eq!(subjects[0].namespace.as_deref(), Some("kube-system"));
}

#[test]
fn containerfile_is_multi_stage_with_the_inspection_tools() {
    let text = std::fs::read_to_string(
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../Containerfile"),
    )
    .unwrap();
    let froms: Vec<&str> = text.lines().filter(|l| l.starts_with("FROM ")).collect();
    assert_eq!(froms.len(), 2, "build stage + runtime stage: {froms:?}");
    assert!(froms[0].contains(" AS build"), "{froms:?}");
    assert!(text.contains("cargo build --release --locked -p kube-ipvs"));
    // The runtime stage installs the tools kube-ipvs runs and operators inspect with, and the
    // build fails if a backend is missing.
    let runtime = &text[text.find(froms[1]).unwrap()..];
    for tool in ["ipvsadm", "ipset", "iptables", "conntrack", "kmod"] {
        assert!(
            runtime.contains(&format!(" {tool} ")),
            "{tool} not installed"
        );
    }
    for check in [
        "iptables-nft --version",
        "iptables-legacy --version",
        "modprobe --version",
    ] {
        assert!(runtime.contains(check), "{check}");
    }
    assert!(runtime.contains("COPY --from=build /out/kube-ipvs /usr/local/bin/kube-ipvs"));
}
