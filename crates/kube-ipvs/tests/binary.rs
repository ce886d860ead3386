//! The kube-ipvs binary end to end: exit codes, messages, the daemon's HTTP servers, `--once`,
//! SIGTERM, JSON logs and mode fallback, all against the real kernel it runs on.

// Test helpers outside #[test] fns may unwrap/panic too.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::path::PathBuf;
use std::process::{Child, Command, Output, Stdio};
use std::time::Duration;

use common::{free_port, get, wait_for, Daemon};

const BIN: &str = env!("CARGO_BIN_EXE_kube-ipvs");

fn examples() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../examples")
}

fn run(args: &[&str]) -> Output {
    Command::new(BIN)
        .args(args)
        .env_remove("RUST_LOG")
        .output()
        .unwrap()
}

/// Leaves the kernel's conntrack settings alone. Every proxy run in this file uses it: the unit
/// tests run on the host, which a test must not retune, and in a test namespace nf_conntrack_max
/// is read-only, so a host with a smaller table than kube-proxy's default would fail the start
/// (kind sets `maxPerCore: 0` for the same reason). `tests/conntrack_settings.rs` tests the
/// settings themselves.
const CONNTRACK_AS_IS: [&str; 3] = [
    "--conntrack-max-per-core=0",
    "--conntrack-tcp-timeout-established=0s",
    "--conntrack-tcp-timeout-close-wait=0s",
];

/// [`run`] for the proxy itself, with [`CONNTRACK_AS_IS`].
fn run_proxy(args: &[&str]) -> Output {
    run(&[args, &CONNTRACK_AS_IS[..]].concat())
}

/// `--once` on the manifests in `source_dir`, health and metrics on ephemeral loopback ports,
/// plus `extra`.
fn run_once(source_dir: &str, extra: &[&str]) -> Output {
    let base = [
        "--once",
        "--source-dir",
        source_dir,
        "--healthz-bind-address",
        "127.0.0.1:0",
        "--metrics-bind-address",
        "127.0.0.1:0",
    ];
    run_proxy(&[&base[..], extra].concat())
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).to_string()
}

/// Whether this kernel has IPVS (what the daemon's probe looks at).
fn kernel_has_ipvs() -> bool {
    std::path::Path::new("/proc/net/ip_vs").exists()
}

#[test]
fn plan_renders_the_examples_without_a_cluster() {
    let ex = examples();
    let out = run(&["plan", "--source-dir", ex.to_str().unwrap()]);
    let stdout = text(&out.stdout);
    assert!(out.status.success(), "{out:?}");
    // Every section, in its tool's format.
    for header in [
        "# ipvs (Inet)",
        "# addresses (Inet)",
        "# ipsets (Inet)",
        "# iptables (Inet)",
    ] {
        assert!(stdout.contains(header), "{header} missing:\n{stdout}");
    }
    assert!(stdout.contains("-A -t 10.96.0.10:53 -s rr\n"), "{stdout}");
    assert!(
        stdout.contains("-a -u 10.96.0.10:53 -r 10.244.1.2:53 -m -w 1\n"),
        "{stdout}"
    );
    assert!(
        stdout.contains("-A --sctp-service 10.96.40.10:3868 -s rr"),
        "{stdout}"
    );
    assert!(
        stdout.contains("add KUBE-CLUSTER-IP 10.96.0.10,udp:53\n"),
        "{stdout}"
    );
    assert!(stdout.contains("*nat\n"), "{stdout}");

    // One section alone is what `ipvsadm --restore` takes: it parses as such.
    let out = run(&[
        "plan",
        "--section",
        "ipvs",
        "--source-dir",
        ex.to_str().unwrap(),
    ]);
    assert!(out.status.success(), "{out:?}");
    let ipvs = text(&out.stdout);
    let table = ipvs_netlink::savefmt::parse(&ipvs).expect("ipvsadm -S format");
    assert!(table.len() >= 10, "{ipvs}");
    assert!(!ipvs.contains('#'));
}

#[test]
fn invalid_values_exit_1_naming_the_field() {
    let out = run(&["plan", "--source-dir", "/x", "--ipvs-sync-period", "3x"]);
    assert_eq!(out.status.code(), Some(1), "{out:?}");
    let err = text(&out.stderr);
    assert!(
        err.contains("--ipvs-sync-period: invalid duration \"3x\""),
        "{err}"
    );

    let path = std::env::temp_dir().join(format!("kube-ipvs-bin-{}.yaml", std::process::id()));
    std::fs::write(
        &path,
        "apiVersion: kubeproxy.config.k8s.io/v1alpha1\nkind: KubeProxyConfiguration\nipvs:\n  scheduler: fastest\nmode: nftables\n",
    )
    .unwrap();
    let out = run(&["--config", path.to_str().unwrap()]);
    std::fs::remove_file(&path).unwrap();
    assert_eq!(out.status.code(), Some(1), "{out:?}");
    let err = text(&out.stderr);
    assert!(
        err.contains("ipvs.scheduler: unknown IPVS scheduler \"fastest\""),
        "{err}"
    );
    assert!(
        err.contains("mode: nftables mode is not supported"),
        "{err}"
    );

    // Usage errors are clap's exit code 2; --help succeeds.
    assert_eq!(run(&["--no-such-flag"]).status.code(), Some(2));
    let help = run(&["--help"]);
    assert!(help.status.success());
    assert!(text(&help.stdout).contains("--ipvs-scheduler"));
}

#[test]
fn print_defaults_lists_every_flag() {
    let out = run(&["config", "print-defaults"]);
    assert!(out.status.success(), "{out:?}");
    let table = text(&out.stdout);
    for st in kube_ipvs::settings::SETTINGS {
        if let Some(f) = st.flag {
            assert!(table.contains(&format!("--{f} ")), "--{f} missing");
        }
    }
    assert!(table.contains("ipvs.syncPeriod"));
}

fn daemon_args<'a>(ex: &'a str, hz: &'a str, m: &'a str) -> Vec<&'a str> {
    vec![
        "--source-dir",
        ex,
        "--healthz-bind-address",
        hz,
        "--metrics-bind-address",
        m,
        "--hostname-override",
        "node-1",
        CONNTRACK_AS_IS[0],
        CONNTRACK_AS_IS[1],
        CONNTRACK_AS_IS[2],
    ]
}

/// Runs the daemon, which programs the kernel: inside its own network namespace.
#[test]
#[ignore = "netns"]
fn netns_daemon_serves_health_and_metrics_and_exits_0_on_sigterm() {
    common::in_netns(
        "kipvs-bin",
        daemon_serves_health_and_metrics_and_exits_0_on_sigterm,
    );
}

async fn daemon_serves_health_and_metrics_and_exits_0_on_sigterm() {
    let ex = examples();
    let (hp, mp) = (free_port(), free_port());
    let hz = format!("127.0.0.1:{hp}");
    let m = format!("127.0.0.1:{mp}");
    let child = Command::new(BIN)
        .args(daemon_args(ex.to_str().unwrap(), &hz, &m))
        .env_remove("RUST_LOG")
        .env_remove(kube_ipvs::allocator::VAR)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut d = Daemon(child);

    // All 9 Services and 10 EndpointSlices of the examples arrive as changes.
    let metrics = wait_for(
        m.parse().unwrap(),
        "/metrics",
        "kubeproxy_sync_proxy_rules_service_changes_total 9",
    )
    .await;
    assert!(metrics
        .body
        .contains("kubeproxy_sync_proxy_rules_endpoint_changes_total 10"));
    let mode = if kernel_has_ipvs() {
        "ipvs"
    } else {
        "iptables"
    };
    assert!(
        metrics
            .body
            .contains(&format!("kube_ipvs_proxy_mode{{mode=\"{mode}\"}} 1")),
        "{}",
        metrics.body
    );
    // Healthy once the first sync has programmed the namespace.
    let mut r = get(hz.parse().unwrap(), "/healthz").await.unwrap();
    for _ in 0..600 {
        if r.status == 200 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
        r = get(hz.parse().unwrap(), "/healthz").await.unwrap();
    }
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(r.json()["nodeEligible"], true);
    assert_eq!(
        get(hz.parse().unwrap(), "/livez").await.unwrap().status,
        200
    );
    // The ETP=Local LoadBalancer of the examples has its health-check node port served, in
    // whichever mode the kernel allows (iptables mode on a host without IPVS): one of its two
    // endpoints is on this node.
    let hc = wait_for(
        "127.0.0.1:32000".parse().unwrap(),
        "/",
        "\"localEndpoints\"",
    )
    .await;
    assert_eq!(hc.status, 200, "{}", hc.body);
    assert_eq!(hc.json()["localEndpoints"], 1, "{}", hc.body);
    assert_eq!(hc.json()["service"]["name"], "ingress", "{}", hc.body);

    let pid = d.0.id().to_string();
    // The process re-executed itself in place (same pid, still serving) with glibc's malloc
    // tunables (glibc 2.36 shows the variable up to its first ':' once it has parsed it).
    let environ = std::fs::read(format!("/proc/{pid}/environ")).unwrap();
    let tunables = environ
        .split(|b| *b == 0)
        .find(|v| v.starts_with(b"GLIBC_TUNABLES="))
        .map(|v| String::from_utf8_lossy(v).into_owned())
        .unwrap_or_default();
    let full = format!("GLIBC_TUNABLES={}", kube_ipvs::allocator::TUNABLES);
    assert!(
        tunables.starts_with("GLIBC_TUNABLES=glibc.malloc.arena_max=1")
            && full.starts_with(&tunables),
        "{tunables:?}"
    );
    // oomScoreAdj's default, like kube-proxy; where the kernel refuses it (some sandboxes
    // refuse negative values even to root) the daemon says so and goes on.
    let oom = std::fs::read_to_string(format!("/proc/{pid}/oom_score_adj")).unwrap();
    let kill = Command::new("kill").args(["-TERM", &pid]).status().unwrap();
    assert!(kill.success());
    let out = d.0.wait_with_output_ref();
    assert_eq!(out.0.code(), Some(0), "stderr:\n{}", out.1);
    assert!(out.1.contains("SIGTERM: stopping"), "{}", out.1);
    assert!(
        oom.trim() == "-999" || out.1.contains("cannot set oom_score_adj"),
        "oom_score_adj {oom:?}, stderr:\n{}",
        out.1
    );
    if !kernel_has_ipvs() {
        assert!(out.1.contains("FALLING BACK TO IPTABLES MODE"), "{}", out.1);
    }
    // The servers are gone.
    assert!(get(hz.parse().unwrap(), "/healthz").await.is_err());
}

trait WaitRef {
    fn wait_with_output_ref(&mut self) -> (std::process::ExitStatus, String);
}

impl WaitRef for Child {
    fn wait_with_output_ref(&mut self) -> (std::process::ExitStatus, String) {
        use std::io::Read;
        let mut err = String::new();
        if let Some(mut s) = self.stderr.take() {
            s.read_to_string(&mut err).unwrap();
        }
        (self.wait().unwrap(), err)
    }
}

/// Runs the daemon, which programs the kernel: inside its own network namespace.
#[test]
#[ignore = "netns"]
fn netns_once_exits_after_the_first_sync_with_json_logs() {
    common::in_netns("kipvs-once", || async {
        once_exits_after_the_first_sync_with_json_logs()
    });
}

fn once_exits_after_the_first_sync_with_json_logs() {
    let ex = examples();
    let out = run_once(ex.to_str().unwrap(), &["--log-format=json", "-v", "2"]);
    let err = text(&out.stderr);
    assert!(out.status.success(), "{err}");
    let mut lines = 0;
    for line in err.lines() {
        let v: serde_json::Value =
            serde_json::from_str(line).unwrap_or_else(|e| panic!("not JSON ({e}): {line}"));
        assert!(v["level"].is_string(), "{line}");
        lines += 1;
    }
    assert!(err.contains("sync done"), "{err}");
    // -v 2 enables debug lines of kube-ipvs's crates.
    assert!(err.contains("\"level\":\"DEBUG\""), "{err}");
    assert!(lines > 3);
}

#[test]
fn ipvs_fallback_false_fails_without_ipvs() {
    let ex = examples();
    let out = run_once(ex.to_str().unwrap(), &["--ipvs-fallback=false"]);
    let err = text(&out.stderr);
    if kernel_has_ipvs() {
        assert!(out.status.success(), "{err}");
        assert!(
            err.contains("mode=\"ipvs\"") || err.contains("mode=ipvs"),
            "{err}"
        );
    } else {
        assert_eq!(out.status.code(), Some(1), "{err}");
        assert!(
            err.contains("--ipvs-fallback=false forbids falling back"),
            "{err}"
        );
    }
}

#[test]
fn missing_source_dir_is_an_error() {
    let out = run_once("/nonexistent/kube-ipvs-dir", &[]);
    assert_eq!(out.status.code(), Some(1), "{out:?}");
    assert!(text(&out.stderr).contains("/nonexistent/kube-ipvs-dir"));
}

/// `sh -c CMD` inside the current (test thread's) namespace; its stdout.
fn sh(cmd: &str) -> String {
    let out = Command::new("sh").args(["-c", cmd]).output().unwrap();
    text(&out.stdout)
}

#[test]
#[ignore = "vm"]
fn vm_daemon_selects_ipvs_mode_programs_and_cleans_up() {
    assert!(kernel_has_ipvs(), "the VM kernel should have IPVS loaded");
    common::in_netns("kipvs-vm-once", || async {
        let ex = std::env::temp_dir().join(format!("kube-ipvs-vm-{}", std::process::id()));
        std::fs::create_dir_all(&ex).unwrap();
        std::fs::write(
            ex.join("svc.yaml"),
            "apiVersion: v1\nkind: Service\nmetadata: {name: web}\nspec:\n  clusterIP: 10.96.0.20\n  ports: [{port: 80, protocol: TCP}]\n---\napiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata: {name: web-1, labels: {kubernetes.io/service-name: web}}\naddressType: IPv4\nports: [{port: 8080, protocol: TCP}]\nendpoints:\n- addresses: [10.244.1.5]\n  conditions: {ready: true}\n",
        )
        .unwrap();
        let out = run_once(ex.to_str().unwrap(), &["--ipvs-fallback=false"]);
        let err = text(&out.stderr);
        assert!(out.status.success(), "{err}");
        assert!(
            err.contains("mode=\"ipvs\"") || err.contains("mode=ipvs"),
            "{err}"
        );
        assert!(!err.contains("FALLING BACK"), "{err}");
        // Programmed: the virtual server, its real server, the VIP, the set, the chains.
        let table = sh("ipvsadm -Sn");
        assert!(table.contains("-A -t 10.96.0.20:80 -s rr\n"), "{table}");
        assert!(
            table.contains("-a -t 10.96.0.20:80 -r 10.244.1.5:8080 -m -w 1\n"),
            "{table}"
        );
        assert!(sh("ip -o addr show dev kube-ipvs0").contains("10.96.0.20/32"));
        assert!(sh("ipset list KUBE-CLUSTER-IP").contains("10.96.0.20,tcp:80"));
        assert!(sh("iptables-save -t nat").contains(":KUBE-SERVICES"));
        // --cleanup removes it all, and again is a no-op.
        for _ in 0..2 {
            let out = run(&["--cleanup"]);
            assert!(out.status.success(), "{}", text(&out.stderr));
            assert!(!sh("ipvsadm -Sn").contains("10.96.0.20"));
            assert!(sh("ip link show kube-ipvs0 2>&1").contains("does not exist"));
            assert!(
                !sh("iptables-save").contains("KUBE-"),
                "{}",
                sh("iptables-save")
            );
            assert!(
                !sh("ipset list -n").contains("KUBE-"),
                "{}",
                sh("ipset list -n")
            );
        }
        let _ = std::fs::remove_dir_all(&ex);
    });
}

#[test]
#[ignore = "vm"]
fn vm_plan_ipvs_section_equals_what_once_programs() {
    common::in_netns("kipvs-vm-plan", || async {
        let ex = examples();
        let ex = ex.to_str().unwrap();
        let out = run(&["plan", "--section", "ipvs", "--source-dir", ex]);
        assert!(out.status.success(), "{}", text(&out.stderr));
        let planned = text(&out.stdout);
        assert!(planned.lines().count() > 20, "{planned}");
        let out = run_once(ex, &["--ipvs-fallback=false"]);
        assert!(out.status.success(), "{}", text(&out.stderr));
        let programmed = sh("ipvsadm -Sn");
        // The plan, restored by ipvsadm itself, gives the identical table.
        let path = std::env::temp_dir().join(format!("plan-{}.txt", std::process::id()));
        std::fs::write(&path, &planned).unwrap();
        sh("ipvsadm -C");
        let restore = Command::new("sh")
            .args(["-c", &format!("ipvsadm --restore < {}", path.display())])
            .output()
            .unwrap();
        assert!(restore.status.success(), "{}", text(&restore.stderr));
        let restored = sh("ipvsadm -Sn");
        let _ = std::fs::remove_file(&path);
        assert_eq!(programmed, restored);
        assert!(
            programmed.contains("-A -u 10.96.0.10:53 -s rr"),
            "{programmed}"
        );
    });
}

/// `plan` follows `--proxy-mode`: in iptables mode it prints that mode's `iptables-restore`
/// input (and nothing for IPVS, kube-ipvs0 or ipsets), and the real `iptables-restore` takes it
/// as is in a fresh namespace.
#[test]
#[ignore = "netns"]
fn netns_iptables_mode_plan_is_what_iptables_restore_takes() {
    common::in_netns("kipvs-plan", || async {
        let ex = examples();
        let ex = ex.to_str().unwrap();
        let all = run(&["plan", "--proxy-mode", "iptables", "--source-dir", ex]);
        assert!(all.status.success(), "{all:?}");
        let all = text(&all.stdout);
        assert!(
            all.contains("# ipvs (Inet)\n# addresses (Inet)\n# ipsets (Inet)\n# iptables (Inet)\n"),
            "{all}"
        );
        let out = run(&[
            "plan",
            "--proxy-mode",
            "iptables",
            "--section",
            "iptables",
            "--source-dir",
            ex,
        ]);
        assert!(out.status.success(), "{out:?}");
        let payload = text(&out.stdout);
        let svc_chains: Vec<&str> = payload
            .lines()
            .filter(|l| l.starts_with(":KUBE-SVC-"))
            .collect();
        assert!(svc_chains.len() >= 10, "{payload}");
        assert!(payload.contains("-A KUBE-SERVICES"), "{payload}");

        common::sh_stdin("iptables-restore --noflush", &payload);
        let saved = Command::new("iptables-save")
            .args(["-t", "nat"])
            .output()
            .unwrap();
        let saved = text(&saved.stdout);
        for c in &svc_chains {
            let name = c.trim_start_matches(':').split(' ').next().unwrap();
            assert!(
                saved.contains(&format!(":{name} ")),
                "{name} not in iptables-save:\n{saved}"
            );
        }
    });
}

/// The DaemonSet mounts only the host's `/proc/sys/net` at `/host/proc/sys/net` and passes
/// `--sysctl-root=/host/proc/sys` (deploy/daemonset.yaml). The kernel version that decides
/// `net/ipv4/vs/conn_reuse_mode` must still be the running kernel's: upstream reads
/// `/proc/sys/kernel/osrelease` (`utilkernel.GetVersion`, pkg/util/kernel) from its own procfs,
/// not from the mounted tree. Here the same mount is made with a bind mount, the IPVS sysctls are
/// reset first, and the run must set them through the mount and take the conn_reuse_mode
/// decision for this kernel (issue #17, item 2).
#[test]
#[ignore = "vm"]
fn vm_daemonset_mounts_decide_conn_reuse_mode_from_the_running_kernel() {
    assert!(kernel_has_ipvs(), "the VM kernel should have IPVS loaded");
    common::in_netns("kipvs-vm-sysroot", || async {
        let base = std::env::temp_dir().join(format!("kube-ipvs-sysroot-{}", std::process::id()));
        let net = base.join("host/proc/sys/net");
        std::fs::create_dir_all(&net).unwrap();
        let mounted = Command::new("mount")
            .args(["-o", "bind", "/proc/sys/net", net.to_str().unwrap()])
            .status()
            .unwrap();
        assert!(mounted.success(), "bind mount of /proc/sys/net");
        // Values kube-ipvs must change (conntrack) and the one it decides on (conn_reuse_mode).
        std::fs::write("/proc/sys/net/ipv4/vs/conntrack", "0").unwrap();
        std::fs::write("/proc/sys/net/ipv4/vs/conn_reuse_mode", "1").unwrap();
        let sysctl_root = base.join("host/proc/sys");
        let ex = examples();
        let out = run_once(
            ex.to_str().unwrap(),
            &[
                "--ipvs-fallback=false",
                &format!("--sysctl-root={}", sysctl_root.display()),
            ],
        );
        let err = text(&out.stderr);
        let conntrack = std::fs::read_to_string("/proc/sys/net/ipv4/vs/conntrack").unwrap();
        let reuse = std::fs::read_to_string("/proc/sys/net/ipv4/vs/conn_reuse_mode").unwrap();
        let _ = Command::new("umount").arg(&net).status();
        let _ = std::fs::remove_dir_all(&base);
        assert!(out.status.success(), "{err}");
        // Written through the DaemonSet's mount.
        assert_eq!(conntrack.trim(), "1", "{err}");
        // The decision was taken with the running kernel's version, never skipped.
        assert!(!err.contains("cannot read the kernel version"), "{err}");
        let release = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap();
        let mut parts = release.trim().split(|c: char| !c.is_ascii_digit());
        let (major, minor): (u32, u32) = (
            parts.next().unwrap().parse().unwrap(),
            parts.next().unwrap().parse().unwrap(),
        );
        assert!(
            err.contains(&format!("kernel={major}.{minor}.")),
            "no kernel version decision logged for {release}: {err}"
        );
        if (major, minor) >= (5, 9) {
            // Upstream leaves the kernel default on kernels with the fix.
            assert!(err.contains("has the conn_reuse_mode fix"), "{err}");
            assert_eq!(reuse.trim(), "1", "{err}");
        } else {
            assert_eq!(reuse.trim(), "0", "{err}");
        }
        println!(
            "kernel {}: conn_reuse_mode={}",
            release.trim(),
            reuse.trim()
        );
    });
}

/// Upstream kube-proxy stops when its `--config` file changes so the DaemonSet restarts it with
/// the new file (`ProxyServer.Run`'s fsnotify watcher, cmd/kube-proxy/app/server.go). kube-ipvs
/// does the same with exit 0 (issue #17, item 12), after a ConfigMap-style atomic swap of the
/// file's content; SIGHUP asks for the same restart explicitly.
#[test]
#[ignore = "netns"]
fn netns_config_change_and_sighup_stop_the_daemon_with_exit_0() {
    common::in_netns("kipvs-cfgchg", || async {
        let dir = std::env::temp_dir().join(format!("kube-ipvs-cfgchg-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("config.conf");
        let conf = |bit: u32| {
            format!(
                "apiVersion: kubeproxy.config.k8s.io/v1alpha1\nkind: KubeProxyConfiguration\n\
                 iptables:\n  masqueradeBit: {bit}\n"
            )
        };
        std::fs::write(&file, conf(14)).unwrap();
        let ex = examples();
        for trigger in ["config", "sighup"] {
            let hz = format!("127.0.0.1:{}", free_port());
            let m = format!("127.0.0.1:{}", free_port());
            let config_arg = format!("--config={}", file.display());
            let mut args = daemon_args(ex.to_str().unwrap(), &hz, &m);
            args.push(&config_arg);
            let child = Command::new(BIN)
                .args(&args)
                .env_remove("RUST_LOG")
                .stdout(Stdio::null())
                .stderr(Stdio::piped())
                .spawn()
                .unwrap();
            let mut d = Daemon(child);
            wait_for(
                m.parse().unwrap(),
                "/metrics",
                // Served from the start (the per-family sync series appear with the first sync).
                "kube_ipvs_build_info",
            )
            .await;
            if trigger == "config" {
                // Same content rewritten: nothing happens; new content: restart.
                std::fs::write(dir.join(".tmp"), conf(14)).unwrap();
                std::fs::rename(dir.join(".tmp"), &file).unwrap();
                tokio::time::sleep(Duration::from_secs(2)).await;
                assert!(
                    d.0.try_wait().unwrap().is_none(),
                    "identical content stopped the daemon"
                );
                std::fs::write(dir.join(".tmp"), conf(15)).unwrap();
                std::fs::rename(dir.join(".tmp"), &file).unwrap();
            } else {
                let pid = d.0.id().to_string();
                assert!(Command::new("kill")
                    .args(["-HUP", &pid])
                    .status()
                    .unwrap()
                    .success());
            }
            let out = d.0.wait_with_output_ref();
            assert_eq!(out.0.code(), Some(0), "{trigger}: stderr:\n{}", out.1);
            assert!(out.1.contains("restart requested"), "{trigger}: {}", out.1);
            let reason = if trigger == "config" {
                "changed"
            } else {
                "SIGHUP"
            };
            assert!(out.1.contains(reason), "{trigger}: {}", out.1);
            std::fs::write(&file, conf(14)).unwrap();
        }
        let _ = std::fs::remove_dir_all(&dir);
    });
}

/// Scheduler flags reach the kernel as `ipvsadm` shows them: upstream's `mh-port` for `mh`
/// (`FlagSourceHash`, pkg/proxy/ipvs/proxier.go) and the `kube-ipvs.io/scheduler-flags`
/// annotation's for `sh` (issue #17, item 10).
#[test]
#[ignore = "vm"]
fn vm_scheduler_flags_reach_the_kernel() {
    assert!(kernel_has_ipvs(), "the VM kernel should have IPVS loaded");
    common::in_netns("kipvs-vm-sched", || async {
        let ex = std::env::temp_dir().join(format!("kube-ipvs-sched-{}", std::process::id()));
        std::fs::create_dir_all(&ex).unwrap();
        let svc = |name: &str, ip: &str, annotations: &str| {
            format!(
                "apiVersion: v1\nkind: Service\nmetadata:\n  name: {name}\n  annotations: {{{annotations}}}\n\
                 spec:\n  clusterIP: {ip}\n  ports: [{{port: 80, protocol: TCP}}]\n---\n\
                 apiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata: {{name: {name}-1, labels: {{kubernetes.io/service-name: {name}}}}}\n\
                 addressType: IPv4\nports: [{{port: 8080, protocol: TCP}}]\nendpoints:\n- addresses: [10.244.1.5]\n  conditions: {{ready: true}}\n---\n"
            )
        };
        let yaml = [
            svc("maglev", "10.96.0.31", "kube-ipvs.io/scheduler: mh"),
            svc(
                "hashed",
                "10.96.0.32",
                "kube-ipvs.io/scheduler: sh, kube-ipvs.io/scheduler-flags: \"sh-fallback,sh-port\"",
            ),
            svc("plain", "10.96.0.33", ""),
        ]
        .concat();
        std::fs::write(ex.join("svc.yaml"), yaml).unwrap();
        let out = run_once(ex.to_str().unwrap(), &["--ipvs-fallback=false"]);
        let _ = std::fs::remove_dir_all(&ex);
        assert!(out.status.success(), "{}", text(&out.stderr));
        let table = sh("ipvsadm -Sn");
        for want in [
            "-A -t 10.96.0.31:80 -s mh -b mh-port\n",
            "-A -t 10.96.0.32:80 -s sh -b sh-fallback,sh-port\n",
            "-A -t 10.96.0.33:80 -s rr\n",
        ] {
            assert!(table.contains(want), "{want:?} missing:\n{table}");
        }
    });
}
