//! The kube-ipvs binary end to end: exit codes, messages, the daemon's HTTP servers, `--once`,
//! SIGTERM, JSON logs and mode fallback, all against the real kernel it runs on.

// Test helpers outside #[test] fns may unwrap/panic too.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::{Child, Command, Output, Stdio};
use std::time::Duration;

use common::{free_port, get};

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

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).to_string()
}

/// Whether this kernel has IPVS (what the daemon's probe looks at).
fn kernel_has_ipvs() -> bool {
    std::path::Path::new("/proc/net/ip_vs").exists()
}

/// Kills the child on drop so a failing test leaves no daemon behind.
struct Daemon(Child);

impl Drop for Daemon {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[test]
fn plan_loads_the_examples_without_a_cluster() {
    let ex = examples();
    let out = run(&["plan", "--source-dir", ex.to_str().unwrap()]);
    let stdout = text(&out.stdout);
    assert!(out.status.success(), "{out:?}");
    assert!(stdout.contains("9 Services, 10 EndpointSlices"), "{stdout}");
    assert!(stdout.contains("0 skipped"), "{stdout}");
    assert!(stdout.contains("node node-1"), "{stdout}");
    assert!(stdout.contains("service kube-system/kube-dns type=ClusterIP clusterIPs=10.96.0.10"));
    assert!(stdout.contains("3868/SCTP"), "{stdout}");
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
    ]
}

/// Polls `addr` until it answers; the limit only guards against a hang.
async fn wait_for(addr: SocketAddr, path: &str, want: &str) -> common::Response {
    for _ in 0..600 {
        if let Ok(r) = get(addr, path).await {
            if r.body.contains(want) {
                return r;
            }
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    panic!("{addr}{path} never contained {want:?}");
}

#[tokio::test]
async fn daemon_serves_health_and_metrics_and_exits_0_on_sigterm() {
    let ex = examples();
    let (hp, mp) = (free_port(), free_port());
    let hz = format!("127.0.0.1:{hp}");
    let m = format!("127.0.0.1:{mp}");
    let child = Command::new(BIN)
        .args(daemon_args(ex.to_str().unwrap(), &hz, &m))
        .env_remove("RUST_LOG")
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
    let r = get(hz.parse().unwrap(), "/healthz").await.unwrap();
    assert_eq!(r.status, 200);
    assert_eq!(r.json()["nodeEligible"], true);
    assert_eq!(
        get(hz.parse().unwrap(), "/livez").await.unwrap().status,
        200
    );

    let pid = d.0.id().to_string();
    let kill = Command::new("kill").args(["-TERM", &pid]).status().unwrap();
    assert!(kill.success());
    let out = d.0.wait_with_output_ref();
    assert_eq!(out.0.code(), Some(0), "stderr:\n{}", out.1);
    assert!(out.1.contains("SIGTERM: stopping"), "{}", out.1);
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

#[test]
fn once_exits_after_the_first_sync_with_json_logs() {
    let ex = examples();
    let out = run(&[
        "--once",
        "--log-format=json",
        "-v",
        "2",
        "--source-dir",
        ex.to_str().unwrap(),
        "--healthz-bind-address",
        "127.0.0.1:0",
        "--metrics-bind-address",
        "127.0.0.1:0",
    ]);
    let err = text(&out.stderr);
    assert!(out.status.success(), "{err}");
    let mut lines = 0;
    for line in err.lines() {
        let v: serde_json::Value =
            serde_json::from_str(line).unwrap_or_else(|e| panic!("not JSON ({e}): {line}"));
        assert!(v["level"].is_string(), "{line}");
        lines += 1;
    }
    assert!(err.contains("--once: first sync done"), "{err}");
    // -v 2 enables debug lines of kube-ipvs's crates.
    assert!(err.contains("\"level\":\"DEBUG\""), "{err}");
    assert!(lines > 3);
}

#[test]
fn ipvs_fallback_false_fails_without_ipvs() {
    let ex = examples();
    let out = run(&[
        "--once",
        "--ipvs-fallback=false",
        "--source-dir",
        ex.to_str().unwrap(),
        "--healthz-bind-address",
        "127.0.0.1:0",
        "--metrics-bind-address",
        "127.0.0.1:0",
    ]);
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
    let out = run(&[
        "--once",
        "--source-dir",
        "/nonexistent/kube-ipvs-dir",
        "--healthz-bind-address",
        "127.0.0.1:0",
        "--metrics-bind-address",
        "127.0.0.1:0",
    ]);
    assert_eq!(out.status.code(), Some(1), "{out:?}");
    assert!(text(&out.stderr).contains("/nonexistent/kube-ipvs-dir"));
}

#[test]
#[ignore = "vm"]
fn vm_daemon_selects_ipvs_mode_when_the_kernel_has_it() {
    assert!(kernel_has_ipvs(), "the VM kernel should have IPVS loaded");
    // The VM has the test binaries only, not the repository: write a small source dir.
    let ex = std::env::temp_dir().join(format!("kube-ipvs-vm-{}", std::process::id()));
    std::fs::create_dir_all(&ex).unwrap();
    std::fs::write(
        ex.join("svc.yaml"),
        "apiVersion: v1\nkind: Service\nmetadata: {name: web}\nspec:\n  clusterIP: 10.96.0.20\n  ports: [{port: 80, protocol: TCP}]\n",
    )
    .unwrap();
    let out = run(&[
        "--once",
        "--ipvs-fallback=false",
        "--source-dir",
        ex.to_str().unwrap(),
        "--healthz-bind-address",
        "127.0.0.1:0",
        "--metrics-bind-address",
        "127.0.0.1:0",
    ]);
    let _ = std::fs::remove_dir_all(&ex);
    let err = text(&out.stderr);
    assert!(out.status.success(), "{err}");
    assert!(
        err.contains("mode=\"ipvs\"") || err.contains("mode=ipvs"),
        "{err}"
    );
    assert!(!err.contains("FALLING BACK"), "{err}");
}
