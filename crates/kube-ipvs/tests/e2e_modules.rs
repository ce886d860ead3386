//! Issue #32, module loading, end to end in the VM: on a kernel that cannot autoload IPVS and
//! with the IPVS modules unloaded, the DaemonSet's `load-modules` init container loads them with
//! only the capabilities and mounts `deploy/daemonset.yaml` gives it, and the daemon's container
//! (its capabilities, its command line, the ConfigMap's configuration) then runs in IPVS mode.
//!
//! The test follows the manifest: it reads the init container's and the daemon container's
//! command lines, capabilities, `allowPrivilegeEscalation` and read-only mounts from
//! `deploy/daemonset.yaml` and the configuration from `deploy/configmap.yaml`, and runs them
//! with only those capabilities (`setpriv`: bounding set = the listed capabilities, which is
//! what a container running as UID 0 gets; `--no-new-privs` for
//! `allowPrivilegeEscalation: false`) and, for the init container, `/lib/modules` bind-mounted
//! read-only in a private mount namespace (`unshare -m`). Paths are mapped to the VM's: the
//! binary, the ConfigMap file, `--sysctl-root` (no host mount here), `$(NODE_NAME)`.
//!
//! "Cannot autoload": the kernel's module helper (`/proc/sys/kernel/modprobe`) is replaced, for
//! the test, by a script that refuses `ip_vs*` and the IPVS generic netlink family alias and
//! passes everything else on (ipset types and iptables extensions still autoload), which is a
//! kernel whose `ip_vs` has no autoload alias. Restored afterwards, with the modules loaded.
//!
//! Controls, so the test can fail: the init container's command without `SYS_MODULE` loads
//! nothing (and still exits 0); the daemon started before the init container falls back to
//! iptables mode, loudly (WARN line, `IPVSUnavailable` Node Event, metrics).

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod api_lab;
mod common;

use std::net::{Ipv4Addr, SocketAddr};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use api_lab::{echo_once, Lab};
use k8s_openapi::api::apps::v1::DaemonSet;
use k8s_openapi::api::core::v1::{ConfigMap, Container};
use testkit::apiserver::FakeApiServer;

const BIN: &str = env!("CARGO_BIN_EXE_kube-ipvs");
/// Only guards against a hang.
const DEADLINE: Duration = Duration::from_secs(120);
const CLUSTER_IP: &str = "10.96.0.30:80";

const OBJECTS: &str = r#"
apiVersion: v1
kind: Node
metadata: {name: node-1, labels: {kubernetes.io/hostname: node-1}}
status:
  addresses: [{type: InternalIP, address: 192.168.0.10}]
---
apiVersion: v1
kind: Service
metadata: {name: web, namespace: default}
spec:
  clusterIP: 10.96.0.30
  clusterIPs: [10.96.0.30]
  ports: [{name: http, port: 80, targetPort: 8080, protocol: TCP}]
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata:
  name: web-1
  namespace: default
  labels: {kubernetes.io/service-name: web}
addressType: IPv4
ports: [{name: http, port: 8080, protocol: TCP}]
endpoints:
- addresses: [10.244.0.7]
  conditions: {ready: true}
"#;

fn deploy(file: &str) -> String {
    std::fs::read_to_string(
        Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../../deploy")
            .join(file),
    )
    .unwrap()
}

/// One container as the manifest describes it.
#[derive(Debug, Clone)]
struct Spec {
    argv: Vec<String>,
    /// `capabilities.add`, lower case without `CAP_` (setpriv's spelling).
    caps: Vec<String>,
    no_new_privs: bool,
    read_only_mounts: Vec<String>,
}

impl Spec {
    fn of(c: &Container) -> Spec {
        let sc = c.security_context.clone().unwrap();
        let caps = sc.capabilities.unwrap();
        assert_eq!(caps.drop, Some(vec!["ALL".to_string()]), "{}", c.name);
        let mut argv = c.command.clone().unwrap_or_default();
        argv.extend(c.args.clone().unwrap_or_default());
        Spec {
            argv,
            caps: caps
                .add
                .unwrap_or_default()
                .iter()
                .map(|c| c.to_lowercase())
                .collect(),
            no_new_privs: sc.allow_privilege_escalation == Some(false),
            read_only_mounts: c
                .volume_mounts
                .clone()
                .unwrap_or_default()
                .into_iter()
                .filter(|m| m.read_only == Some(true))
                .map(|m| m.mount_path)
                .collect(),
        }
    }

    /// The command line mapped to the VM: the binary, the ConfigMap's file, the sysctl root
    /// (the host mount does not exist here), `$(NODE_NAME)`.
    fn local_argv(&self, config: &Path) -> Vec<String> {
        self.argv
            .iter()
            .map(|a| {
                if a == "/usr/local/bin/kube-ipvs" {
                    BIN.to_string()
                } else if a.starts_with("--config=") {
                    format!("--config={}", config.display())
                } else if a.starts_with("--sysctl-root=") {
                    "--sysctl-root=/proc/sys".to_string()
                } else {
                    a.replace("$(NODE_NAME)", "node-1")
                }
            })
            .collect()
    }

    /// `setpriv` with exactly `caps` (bounding, permitted and effective for UID 0), no
    /// inheritable or ambient ones, and no_new_privs as the manifest says.
    fn setpriv(&self, caps: &[String]) -> Vec<String> {
        let mut set = "-all".to_string();
        for c in caps {
            set.push_str(&format!(",+{c}"));
        }
        let mut v: Vec<String> = [
            "setpriv",
            "--bounding-set",
            &set,
            "--inh-caps",
            "-all",
            "--ambient-caps",
            "-all",
        ]
        .map(String::from)
        .into();
        if self.no_new_privs {
            v.push("--no-new-privs".into());
        }
        v.push("--".into());
        v
    }
}

struct Manifest {
    init: Spec,
    main: Spec,
    config: PathBuf,
}

fn manifest() -> Manifest {
    let ds: DaemonSet = serde_saphyr::from_str(&deploy("daemonset.yaml")).unwrap();
    let pod = ds.spec.unwrap().template.spec.unwrap();
    let inits = pod.init_containers.unwrap_or_default();
    let init = inits
        .iter()
        .find(|c| c.name == "load-modules")
        .expect("an init container named load-modules");
    let main = &pod.containers[0];
    let cm: ConfigMap = serde_saphyr::from_str(&deploy("configmap.yaml")).unwrap();
    let text = cm.data.unwrap()["config.conf"].clone();
    let config =
        std::env::temp_dir().join(format!("e2e-modules-config-{}.conf", std::process::id()));
    std::fs::write(&config, text).unwrap();
    Manifest {
        init: Spec::of(init),
        main: Spec::of(main),
        config,
    }
}

/// The kernel's module helper replaced by one that refuses IPVS (restored on drop).
struct NoIpvsAutoload {
    previous: String,
    script: PathBuf,
}

impl NoIpvsAutoload {
    fn install() -> NoIpvsAutoload {
        let previous = std::fs::read_to_string("/proc/sys/kernel/modprobe")
            .unwrap()
            .trim()
            .to_string();
        let script = std::env::temp_dir().join("e2e-modules-no-ipvs-autoload");
        std::fs::write(
            &script,
            format!(
                "#!/usr/bin/dash\n# A kernel without IPVS autoload: refuse ip_vs* and the IPVS \
                 genetlink family alias.\nfor a in \"$@\"; do case \"$a\" in ip_vs*|*family-IPVS*) \
                 exit 1;; esac; done\nexec {previous} \"$@\"\n"
            ),
        )
        .unwrap();
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&script, std::fs::Permissions::from_mode(0o755)).unwrap();
        std::fs::write("/proc/sys/kernel/modprobe", script.to_str().unwrap()).unwrap();
        NoIpvsAutoload { previous, script }
    }
}

impl Drop for NoIpvsAutoload {
    fn drop(&mut self) {
        let _ = std::fs::write("/proc/sys/kernel/modprobe", &self.previous);
        let _ = std::fs::remove_file(&self.script);
        // Leave the VM as its init left it: the IPVS modules loaded.
        let _ = Command::new("modprobe")
            .args(["-a", "ip_vs", "ip_vs_rr", "ip_vs_wrr", "ip_vs_sh"])
            .status();
    }
}

/// Loaded modules (names from /proc/modules).
fn modules() -> Vec<String> {
    std::fs::read_to_string("/proc/modules")
        .unwrap()
        .lines()
        .filter_map(|l| l.split_whitespace().next().map(str::to_string))
        .collect()
}

fn loaded(m: &str) -> bool {
    modules().iter().any(|x| x == m)
}

/// Removes every IPVS module (schedulers and helpers first, then ip_vs). Namespaces of earlier
/// tests may still be on their way out (their virtual servers hold the modules), hence the
/// retries; the deadline only guards against a hang.
fn unload_ipvs() {
    let start = Instant::now();
    while loaded("ip_vs") {
        let ipvs: Vec<String> = modules()
            .into_iter()
            .filter(|m| m.starts_with("ip_vs") || m == "xt_ipvs")
            .collect();
        for m in ipvs.iter().filter(|m| *m != "ip_vs") {
            let _ = Command::new("rmmod").arg(m).stderr(Stdio::null()).status();
        }
        let _ = Command::new("rmmod")
            .arg("ip_vs")
            .stderr(Stdio::null())
            .status();
        if loaded("ip_vs") {
            assert!(
                start.elapsed() < DEADLINE,
                "cannot unload ip_vs: {}",
                std::fs::read_to_string("/proc/modules").unwrap()
            );
            std::thread::sleep(Duration::from_millis(500));
        }
    }
}

/// Runs the init container's command as the manifest describes it, with `caps`: in a private
/// mount namespace where the manifest's read-only mounts are bind-mounted read-only (checked),
/// under `setpriv`. Returns (exit code, stdout + stderr).
fn run_init(m: &Manifest, caps: &[String]) -> (Option<i32>, String) {
    let mut script = String::from("set -e\n");
    for dir in &m.init.read_only_mounts {
        // The ConfigMap's directory is not at its in-container path here (mapped below).
        if !Path::new(dir).exists() {
            continue;
        }
        script.push_str(&format!(
            "mount --bind -o ro {dir} {dir}\n\
             if touch {dir}/.e2e-rw-check 2>/dev/null; then echo '{dir} is writable'; exit 99; fi\n"
        ));
    }
    script.push_str("exec \"$@\"\n");
    let mut cmd = Command::new("unshare");
    cmd.args([
        "--mount",
        "--propagation",
        "private",
        "dash",
        "-c",
        &script,
        "init",
    ])
    .args(m.init.setpriv(caps))
    .args(m.init.local_argv(&m.config))
    .env_remove("RUST_LOG");
    println!("init container: {cmd:?}");
    let out = cmd.output().unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.code(), text)
}

/// The daemon container as the manifest describes it (its capabilities, its command line with
/// the ConfigMap), pointed at the fake API server and at free loopback ports; stderr to a file.
fn start_daemon(main: &Spec, config: &Path, kubeconfig: &str, tag: &str) -> api_lab::Daemon {
    let (hp, mp) = (common::free_port(), common::free_port());
    let healthz: SocketAddr = format!("127.0.0.1:{hp}").parse().unwrap();
    let metrics: SocketAddr = format!("127.0.0.1:{mp}").parse().unwrap();
    let log = std::env::temp_dir().join(format!("e2e-modules-{tag}-{}.log", std::process::id()));
    let file = std::fs::File::create(&log).unwrap();
    let mut argv = main.setpriv(&main.caps);
    argv.extend(main.local_argv(config));
    argv.extend([
        format!("--kubeconfig={kubeconfig}"),
        format!("--healthz-bind-address={healthz}"),
        format!("--metrics-bind-address={metrics}"),
        // nf_conntrack_max is read-only in a test namespace (kind sets this too).
        "--conntrack-max-per-core=0".into(),
    ]);
    println!("daemon container: {argv:?}");
    let child = Command::new(&argv[0])
        .args(&argv[1..])
        .env_remove("RUST_LOG")
        .env_remove("KUBECONFIG")
        .stdout(Stdio::null())
        .stderr(Stdio::from(file))
        .spawn()
        .unwrap();
    api_lab::Daemon {
        child,
        log,
        healthz,
        metrics,
    }
}

async fn wait_metric(d: &api_lab::Daemon, line: &str) -> String {
    let start = Instant::now();
    loop {
        let body = common::get(d.metrics, "/metrics")
            .await
            .map(|r| r.body)
            .unwrap_or_default();
        if body.lines().any(|l| l == line) {
            return body;
        }
        assert!(
            start.elapsed() < DEADLINE,
            "/metrics never had {line:?}:\n{body}\nlog:\n{}",
            d.log()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

async fn api_with_objects(tag: &str) -> (FakeApiServer, String) {
    let api = FakeApiServer::start().await.unwrap();
    assert_eq!(api.load_str(OBJECTS).unwrap(), 3);
    let kc = std::env::temp_dir().join(format!("e2e-modules-{tag}-{}.yaml", std::process::id()));
    api.write_kubeconfig(&kc).unwrap();
    (api, kc.to_str().unwrap().to_string())
}

#[test]
#[ignore = "vm"]
fn vm_e2e_init_container_loads_ipvs_on_a_kernel_without_autoload() {
    let m = manifest();
    assert_eq!(
        m.init.caps,
        ["sys_module"],
        "the init container's capabilities"
    );
    assert!(m.init.read_only_mounts.iter().any(|p| p == "/lib/modules"));
    let cfg =
        kube_ipvs::config::load(&kube_ipvs::cli::parse(m.init.local_argv(&m.config)).unwrap())
            .unwrap()
            .config;
    let want: Vec<String> = kube_ipvs::probe::required_modules(&cfg.ipvs.scheduler);
    println!("modules the ConfigMap's configuration needs: {want:?}");

    let lab = Lab::new("e2e-mod", &[Ipv4Addr::new(10, 244, 0, 7)]);
    let _autoload = NoIpvsAutoload::install();
    unload_ipvs();
    assert!(!loaded("ip_vs"));

    // Control 1: the init container's command without SYS_MODULE (the daemon container's
    // capabilities) loads nothing, and still exits 0.
    let (code, out) = run_init(&m, &m.main.caps);
    println!("init without SYS_MODULE: exit {code:?}\n{out}");
    assert_eq!(code, Some(0), "load-modules must never fail the pod: {out}");
    assert!(out.contains("CANNOT LOAD MODULE"), "{out}");
    assert!(!loaded("ip_vs"), "loaded without CAP_SYS_MODULE?");

    // Control 2: the daemon before the init container: IPVS cannot be loaded from its container,
    // so it falls back to iptables mode, loudly.
    let main = m.main.clone();
    let config = m.config.clone();
    lab.run(move || async move {
        let (api, kc) = api_with_objects("fallback").await;
        let d = start_daemon(&main, &config, &kc, "fallback");
        let metrics = wait_metric(&d, "kube_ipvs_proxy_mode{mode=\"iptables\"} 1").await;
        assert!(
            metrics
                .lines()
                .any(|l| l == "kube_ipvs_ipvs_probe_failures_total{kind=\"absent\"} 1"),
            "{metrics}"
        );
        let start = Instant::now();
        while !api
            .events()
            .iter()
            .any(|e| e["reason"] == "IPVSUnavailable")
        {
            assert!(
                start.elapsed() < DEADLINE,
                "no IPVSUnavailable Event: {:?}",
                api.events()
            );
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        let (code, log) = d.stop();
        let loud: Vec<&str> = log
            .lines()
            .filter(|l| l.contains("WARN") && l.contains("FALLING BACK TO IPTABLES MODE"))
            .collect();
        println!("fallback without the init container: {loud:?}; Event IPVSUnavailable; metrics");
        assert_eq!(loud.len(), 1, "{log}");
        assert_eq!(code, Some(0), "{log}");
    });
    assert!(!loaded("ip_vs"), "the daemon's container loaded ip_vs?");

    // The init container as the manifest describes it: only SYS_MODULE, /lib/modules read-only.
    let (code, out) = run_init(&m, &m.init.caps);
    println!("init container: exit {code:?}\n{out}");
    assert_eq!(code, Some(0), "{out}");
    let missing: Vec<&String> = want.iter().filter(|x| !loaded(x)).collect();
    assert!(missing.is_empty(), "not loaded: {missing:?}\n{out}");
    assert!(!out.contains("CANNOT LOAD MODULE"), "{out}");

    // The daemon's container now runs in IPVS mode and serves the Service.
    let main = m.main.clone();
    let config = m.config.clone();
    lab.run(move || async move {
        let (_api, kc) = api_with_objects("ipvs").await;
        let d = start_daemon(&main, &config, &kc, "ipvs");
        wait_metric(&d, "kube_ipvs_proxy_mode{mode=\"ipvs\"} 1").await;
        api_lab::wait_ipvs(&d, "the Service's virtual server", DEADLINE, |t| {
            t.contains("-a -t 10.96.0.30:80 -r 10.244.0.7:8080 -m")
        })
        .await;
        echo_once(CLUSTER_IP.parse().unwrap(), 1).unwrap();
        let (code, log) = d.stop();
        assert!(!log.contains("FALLING BACK"), "{log}");
        assert_eq!(code, Some(0), "{log}");
        println!("after the init container: IPVS mode, {CLUSTER_IP} answers");
    });
    let _ = std::fs::remove_file(&m.config);
}
