//! Health means "this node's kernel state is right", nothing else (issue #32, item 1): the real
//! daemon (iptables mode, in its own network namespace) against testkit's fake API server.
//!
//! - The API server goes away for far longer than the health window (2 × syncPeriod = 10 s):
//!   `/livez` stays 200, `/healthz` stays 200 and reports the source failing in its body, and the
//!   health-check node port of an `externalTrafficPolicy: Local` Service with a local endpoint
//!   answers 200. (Before, an outage longer than the window turned all three to 503 on every
//!   node at once.)
//! - A hung kernel call holds a sync: `iptables-restore` is a script (first on the daemon's
//!   `PATH`) that blocks while a flag file exists, with `--iptables-timeout` far above the
//!   liveness bound (60 s). `/healthz` turns 503 with `pending` once the window has passed,
//!   `/livez` turns 503 naming `sync-loop` once the bound has passed, and both are 200 again
//!   when the call returns.
//!
//! Every wait polls for a state, with a deadline that only prevents a hang.

// Test helpers outside #[test] fns may unwrap/panic too.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::{free_port, get, Daemon, Response};
use testkit::apiserver::FakeApiServer;

const BIN: &str = env!("CARGO_BIN_EXE_kube-ipvs");

/// The ingress Service of the examples: externalTrafficPolicy Local, one endpoint on node-1.
const HCNP: &str = "127.0.0.1:32000";

/// Deadline of every wait (a guard against a hang, not a measurement).
const DEADLINE: Duration = Duration::from_secs(240);

/// The restore programs the daemon may run (either backend, either family).
const RESTORES: [&str; 4] = [
    "iptables-legacy-restore",
    "iptables-nft-restore",
    "ip6tables-legacy-restore",
    "ip6tables-nft-restore",
];

/// A directory of `iptables-restore` stand-ins that block while `flag` exists, then run the real
/// program. Dropping it removes the flag (releasing a blocked call) and the directory.
struct HangingRestore {
    dir: PathBuf,
    flag: PathBuf,
}

impl HangingRestore {
    fn new() -> HangingRestore {
        use std::os::unix::fs::PermissionsExt;
        let dir = std::env::temp_dir().join(format!("kipvs-hang-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let flag = dir.join("hang");
        for name in RESTORES {
            let real = common::sh(&format!("command -v {name} || true"));
            let real = real.trim();
            if real.is_empty() {
                continue;
            }
            let script = dir.join(name);
            std::fs::write(
                &script,
                format!(
                    "#!/bin/sh\nwhile [ -e '{}' ]; do sleep 0.2; done\nexec '{real}' \"$@\"\n",
                    flag.display()
                ),
            )
            .unwrap();
            std::fs::set_permissions(&script, std::fs::Permissions::from_mode(0o755)).unwrap();
        }
        HangingRestore { dir, flag }
    }

    fn path(&self) -> String {
        format!(
            "{}:{}",
            self.dir.display(),
            std::env::var("PATH").unwrap_or_default()
        )
    }

    fn hang(&self) {
        std::fs::write(&self.flag, b"").unwrap();
    }

    fn release(&self) {
        let _ = std::fs::remove_file(&self.flag);
    }
}

impl Drop for HangingRestore {
    fn drop(&mut self) {
        self.release();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn start(kubeconfig: &Path, hz: SocketAddr, m: SocketAddr, path: &str) -> Daemon {
    let child = Command::new(BIN)
        .args([
            "--kubeconfig",
            kubeconfig.to_str().unwrap(),
            "--proxy-mode",
            "iptables",
            // Health window 2 × 5 s; the liveness bound is its minimum, 60 s.
            "--iptables-sync-period",
            "5s",
            "--iptables-min-sync-period",
            "0s",
            // A hung iptables-restore is not killed before the liveness bound.
            "--iptables-timeout",
            "600s",
            "--healthz-bind-address",
            &hz.to_string(),
            "--metrics-bind-address",
            &m.to_string(),
            "--hostname-override",
            "node-1",
            // The namespace's conntrack settings stay as they are (see binary.rs).
            "--conntrack-max-per-core=0",
            "--conntrack-tcp-timeout-established=0s",
            "--conntrack-tcp-timeout-close-wait=0s",
        ])
        .env("PATH", path)
        .env_remove("RUST_LOG")
        .env_remove("KUBECONFIG")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    Daemon(child)
}

/// Polls `addr` `path` until `ok` holds for the answer; returns it.
async fn until(
    addr: SocketAddr,
    path: &str,
    what: &str,
    ok: impl Fn(&Response) -> bool,
) -> Response {
    let start = Instant::now();
    loop {
        if let Ok(r) = get(addr, path).await {
            if ok(&r) {
                return r;
            }
            assert!(
                start.elapsed() < DEADLINE,
                "{what}: still {} {}",
                r.status,
                r.body
            );
        } else {
            assert!(start.elapsed() < DEADLINE, "{what}: {addr} does not answer");
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

#[test]
#[ignore = "netns"]
fn netns_api_outage_never_fails_health_and_a_hung_sync_fails_livez() {
    common::in_netns("kipvs-hlth", api_outage_and_hung_sync);
}

async fn api_outage_and_hung_sync() {
    let api = FakeApiServer::start().await.unwrap();
    let examples = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../examples");
    api.load_dir(&examples).unwrap();
    let kc = std::env::temp_dir().join(format!("kipvs-hlth-kc-{}.yaml", std::process::id()));
    api.write_kubeconfig(&kc).unwrap();
    let hang = HangingRestore::new();
    let (hz, m): (SocketAddr, SocketAddr) = (
        format!("127.0.0.1:{}", free_port()).parse().unwrap(),
        format!("127.0.0.1:{}", free_port()).parse().unwrap(),
    );
    let hcnp: SocketAddr = HCNP.parse().unwrap();
    let mut d = start(&kc, hz, m, &hang.path());

    // Synced: the health-check node port answers 200 with its local endpoint.
    until(hcnp, "/", "the health-check node port", |r| r.status == 200).await;
    until(hz, "/healthz", "/healthz", |r| r.status == 200).await;
    let window = Duration::from_secs(10);

    // 1. The API server goes away, for far longer than the window: /healthz is 200 all along,
    // and reports the source failing once the watchers have seen it.
    api.pause().await;
    until(
        hz,
        "/healthz",
        "/healthz reporting the source failing",
        |r| {
            assert_eq!(r.status, 200, "/healthz during the outage: {}", r.body);
            r.json()["source"]["healthy"] == false
        },
    )
    .await;
    let seen = Instant::now();
    let r = until(hz, "/healthz", "three windows of the outage", |r| {
        assert_eq!(r.status, 200, "/healthz during the outage: {}", r.body);
        assert_eq!(r.json()["source"]["healthy"], false, "{}", r.body);
        seen.elapsed() >= 3 * window
    })
    .await;
    println!("/healthz, API away for 3 windows: {}", r.body);
    assert!(
        r.json()["source"]["lastError"]
            .as_str()
            .is_some_and(|e| !e.is_empty()),
        "{}",
        r.body
    );
    let live = get(hz, "/livez").await.unwrap();
    assert_eq!(live.status, 200, "/livez during the outage: {}", live.body);
    let hc = get(hcnp, "/").await.unwrap();
    assert_eq!(
        hc.status, 200,
        "health-check node port during the outage: {}",
        hc.body
    );
    assert_eq!(hc.json()["localEndpoints"], 1, "{}", hc.body);
    assert_eq!(hc.json()["serviceProxyHealthy"], true, "{}", hc.body);
    assert!(d.0.try_wait().unwrap().is_none(), "the daemon exited");

    // The server returns: the source is reported healthy again.
    api.resume().unwrap();
    until(hz, "/healthz", "the source healthy again", |r| {
        r.status == 200 && r.json()["source"]["healthy"] == true
    })
    .await;

    // 2. A hung kernel call: the next iptables-restore blocks. A new Service needs one.
    hang.hang();
    api.load_str(
        "apiVersion: v1\nkind: Service\nmetadata: {name: late, namespace: default}\n\
         spec:\n  type: ClusterIP\n  clusterIP: 10.96.99.99\n  clusterIPs: [10.96.99.99]\n\
         \x20 ports: [{name: http, port: 80, targetPort: 8080, protocol: TCP}]\n",
    )
    .unwrap();
    let r = until(hz, "/healthz", "/healthz 503 (changes pending)", |r| {
        r.status == 503
    })
    .await;
    println!("/healthz, sync hung: {}", r.body);
    assert!(r.body.contains("\"pending\""), "{}", r.body);
    let r = until(hz, "/livez", "/livez 503 (wedged sync loop)", |r| {
        r.status == 503
    })
    .await;
    println!("/livez, sync hung past the bound: {}", r.body);
    assert_eq!(
        r.json()["reasons"][0]["subsystem"],
        "sync-loop",
        "{}",
        r.body
    );
    // The hung call returns: the loop goes on, both are 200 again.
    hang.release();
    until(hz, "/livez", "/livez 200 after the call returned", |r| {
        r.status == 200
    })
    .await;
    until(
        hz,
        "/healthz",
        "/healthz 200 after the call returned",
        |r| r.status == 200,
    )
    .await;
    assert!(d.0.try_wait().unwrap().is_none(), "the daemon exited");
    let _ = d.0.kill();
    let _ = std::fs::remove_file(&kc);
}
