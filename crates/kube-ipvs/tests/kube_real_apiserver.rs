//! kube-ipvs against the real control plane: upstream etcd + kube-apiserver (built by
//! `cargo xtask kube`) started by `testkit::control_plane`, RBAC on.
//!
//! - `deploy/` passes `kubectl apply --dry-run=server` (the real admission chain and schema).
//! - The DaemonSet's ServiceAccount is allowed every verb kube-ipvs uses (`kubectl auth can-i`)
//!   and denied what it does not need; then the real binary runs with that ServiceAccount's token
//!   and the apiserver's audit log proves it never got a 403 (sufficient) and that every grant
//!   was used, except the ones listed in [`UNUSED_GRANTS`] with their reason (minimal).
//! - Services and endpoint churn arrive through the real watch, and a restart of the apiserver
//!   is survived (the watches reconnect).
//! - The lists arrive gzip-compressed (bytes counted on a relay between the daemon and the
//!   apiserver).
//!
//! These are `kube_*` tests (ignored by `cargo test`): `cargo xtask test` runs them in its kube
//! stage, as root, once the upstream binaries are cached. The host has no IPVS, so the daemon runs
//! in its iptables fallback mode inside a fresh network namespace (the control plane too: the
//! namespace has its own loopback).

// Test helpers outside #[test] fns may unwrap/panic too.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::collections::BTreeSet;
use std::io::{Read, Write};
use std::net::{Shutdown, SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use common::{free_port, get, Daemon};
use testkit::control_plane::ControlPlane;

const BIN: &str = env!("CARGO_BIN_EXE_kube-ipvs");
const SA: &str = "system:serviceaccount:kube-system:kube-ipvs";

/// Grants of the ClusterRole that a run of the daemon does not exercise, each with its reason.
/// (verb, apiGroup, resource).
const UNUSED_GRANTS: &[(&str, &str, &str, &str)] = &[(
    "patch",
    "events.k8s.io",
    "events",
    "a repeated Event (same object and reason) is a patch of the first; the daemon's limiter \
     allows one Event per object and reason per period, so a short run only creates",
)];

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn can_i(cp: &ControlPlane, verb: &str, resource: &str) -> bool {
    let out = cp
        .kubectl_as(
            cp.admin_kubeconfig(),
            &["auth", "can-i", verb, resource, "--as", SA],
        )
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout).trim().to_string();
    assert!(
        text == "yes" || text == "no",
        "can-i {verb} {resource}: {text:?} {}",
        String::from_utf8_lossy(&out.stderr)
    );
    text == "yes"
}

/// `deploy/` is valid for the real apiserver: every object passes a server-side dry run.
#[test]
#[ignore = "kube"]
fn kube_deploy_passes_server_side_dry_run() {
    let cp = ControlPlane::start().unwrap();
    let deploy = repo().join("deploy");
    let out = cp
        .kubectl(&["apply", "--dry-run=server", "-k", deploy.to_str().unwrap()])
        .unwrap();
    for obj in [
        "serviceaccount/kube-ipvs",
        "clusterrole.rbac.authorization.k8s.io/kube-ipvs",
        "clusterrolebinding.rbac.authorization.k8s.io/kube-ipvs",
        "configmap/kube-ipvs",
        "daemonset.apps/kube-ipvs",
    ] {
        assert!(
            out.contains(&format!("{obj} created (server dry run)")),
            "{obj} missing:\n{out}"
        );
    }
}

/// The ServiceAccount may do what kube-ipvs does and nothing else that matters.
#[test]
#[ignore = "kube"]
fn kube_rbac_allows_what_is_used_and_denies_the_rest() {
    let cp = ControlPlane::start().unwrap();
    let sa = std::fs::read_to_string(repo().join("deploy/serviceaccount.yaml")).unwrap();
    cp.apply(&sa).unwrap();
    for (verb, res) in [
        ("list", "services"),
        ("watch", "services"),
        ("list", "nodes"),
        ("watch", "nodes"),
        ("list", "endpointslices.discovery.k8s.io"),
        ("watch", "endpointslices.discovery.k8s.io"),
        ("create", "events.events.k8s.io"),
        ("patch", "events.events.k8s.io"),
    ] {
        assert!(can_i(&cp, verb, res), "{SA} cannot {verb} {res}");
    }
    for (verb, res) in [
        ("create", "events"),
        ("patch", "events"),
        ("get", "secrets"),
        ("list", "secrets"),
        ("watch", "secrets"),
        ("list", "pods"),
        ("list", "configmaps"),
        ("list", "endpoints"),
        ("create", "services"),
        ("update", "services"),
        ("patch", "services"),
        ("delete", "services"),
        ("update", "services/status"),
        ("create", "endpointslices.discovery.k8s.io"),
        ("delete", "endpointslices.discovery.k8s.io"),
        ("update", "nodes"),
        ("patch", "nodes"),
        ("delete", "nodes"),
        ("update", "events.events.k8s.io"),
        ("delete", "events.events.k8s.io"),
        ("list", "events.events.k8s.io"),
        ("list", "namespaces"),
        ("create", "serviceaccounts/token"),
        ("list", "leases.coordination.k8s.io"),
        ("create", "pods"),
        ("*", "*"),
    ] {
        assert!(!can_i(&cp, verb, res), "{SA} can {verb} {res}");
    }
}

/// The namespaces a YAML file's objects live in.
fn namespaces_of(yaml: &str) -> BTreeSet<String> {
    yaml.lines()
        .filter_map(|l| l.trim().strip_prefix("namespace:"))
        .map(|n| n.trim().to_string())
        .collect()
}

/// Applies every IPv4 example (the test apiserver has an IPv4 service range only).
fn apply_examples(cp: &ControlPlane) -> usize {
    let mut files: Vec<PathBuf> = std::fs::read_dir(repo().join("examples"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "yaml"))
        .filter(|p| !p.to_string_lossy().contains("ipv6"))
        .collect();
    files.sort();
    for f in &files {
        let text = std::fs::read_to_string(f).unwrap();
        for ns in namespaces_of(&text) {
            let _ = cp.kubectl(&["create", "namespace", &ns]);
        }
        cp.kubectl(&["apply", "-f", f.to_str().unwrap()])
            .unwrap_or_else(|e| panic!("{}: {e}", f.display()));
    }
    files.len()
}

fn iptables_save() -> String {
    let out = Command::new("iptables-save").output().unwrap();
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Polls `iptables-save` (this namespace's) until `pred` holds.
async fn wait_rules(what: &str, pred: impl Fn(&str) -> bool) -> String {
    let mut last = String::new();
    for _ in 0..1200 {
        last = iptables_save();
        if pred(&last) {
            return last;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    panic!("never saw {what} in iptables-save:\n{last}");
}

fn start_daemon(kubeconfig: &Path) -> (Daemon, SocketAddr, SocketAddr) {
    let (hp, mp) = (free_port(), free_port());
    let hz: SocketAddr = format!("127.0.0.1:{hp}").parse().unwrap();
    let m: SocketAddr = format!("127.0.0.1:{mp}").parse().unwrap();
    let log = kubeconfig.with_extension("daemon.log");
    let child = Command::new(BIN)
        .args(["--kubeconfig", kubeconfig.to_str().unwrap()])
        .args([
            "--healthz-bind-address",
            &hz.to_string(),
            "--metrics-bind-address",
            &m.to_string(),
            "--hostname-override",
            "node-1",
            "--conntrack-max-per-core=0",
        ])
        .env_remove("KUBECONFIG")
        .env("RUST_LOG", "info")
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(log).unwrap())
        .spawn()
        .unwrap();
    (Daemon(child), hz, m)
}

/// Polls `/healthz` until it answers 200 (60 s at most).
async fn wait_healthy(hz: SocketAddr, kubeconfig: &Path) {
    for _ in 0..600 {
        if get(hz, "/healthz").await.is_ok_and(|r| r.status == 200) {
            return;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    panic!("never healthy:\n{}", daemon_log(kubeconfig));
}

fn daemon_log(kubeconfig: &Path) -> String {
    std::fs::read_to_string(kubeconfig.with_extension("daemon.log")).unwrap_or_default()
}

/// (verb, apiGroup, resource) of every request `user` made, and the ones answered 403.
/// 403s inside `startup` (audit event indices while a restarted apiserver was not yet ready: its
/// RBAC authorizer's caches are still empty, and clients retry) are not counted as denials.
fn audit_use(
    cp: &ControlPlane,
    user: &str,
    startup: std::ops::Range<usize>,
) -> (BTreeSet<(String, String, String)>, Vec<String>) {
    let mut used = BTreeSet::new();
    let mut denied = Vec::new();
    for (i, e) in cp.audit_events().into_iter().enumerate() {
        if e["user"]["username"] != user {
            continue;
        }
        let o = &e["objectRef"];
        let Some(res) = o["resource"].as_str() else {
            continue;
        };
        let res = match o["subresource"].as_str() {
            Some(s) => format!("{res}/{s}"),
            None => res.to_string(),
        };
        let group = o["apiGroup"].as_str().unwrap_or("").to_string();
        let verb = e["verb"].as_str().unwrap_or("").to_string();
        if e["responseStatus"]["code"] == 403 && !startup.contains(&i) {
            denied.push(format!("{verb} {group}/{res}: {}", e["requestURI"]));
        }
        used.insert((verb, group, res));
    }
    (used, denied)
}

/// The ClusterRole's grants as (verb, apiGroup, resource).
fn granted(cp: &ControlPlane) -> BTreeSet<(String, String, String)> {
    let role: serde_json::Value = serde_json::from_str(
        &cp.kubectl(&["get", "clusterrole", "kube-ipvs", "-o", "json"])
            .unwrap(),
    )
    .unwrap();
    let mut out = BTreeSet::new();
    for rule in role["rules"].as_array().unwrap() {
        for g in rule["apiGroups"].as_array().unwrap() {
            for r in rule["resources"].as_array().unwrap() {
                for v in rule["verbs"].as_array().unwrap() {
                    out.insert((
                        v.as_str().unwrap().to_string(),
                        g.as_str().unwrap().to_string(),
                        r.as_str().unwrap().to_string(),
                    ));
                }
            }
        }
    }
    out
}

/// The real binary, with the DaemonSet's ServiceAccount token, against the real apiserver:
/// every example Service is programmed, endpoint churn arrives, an apiserver restart is survived,
/// and the audit log proves the RBAC sufficient and minimal.
#[test]
#[ignore = "kube"]
fn kube_daemon_with_service_account_programs_services_and_survives_apiserver_restart() {
    common::in_netns("kipvs-real", || async {
        let mut cp = ControlPlane::start().unwrap();
        let sa = std::fs::read_to_string(repo().join("deploy/serviceaccount.yaml")).unwrap();
        cp.apply(&sa).unwrap();
        let kc = cp
            .service_account_kubeconfig("kube-system", "kube-ipvs")
            .unwrap();
        let n = apply_examples(&cp);
        assert!(n >= 5, "{n}");
        let (d, hz, _m) = start_daemon(&kc);

        // Every IPv4 ClusterIP of the examples shows up in the fallback mode's rules.
        for ip in [
            "10.96.0.10",
            "10.96.10.20",
            "10.96.10.30",
            "10.96.20.10",
            "10.96.30.10",
        ] {
            wait_rules(ip, |t| t.contains(&format!("{ip}/32"))).await;
        }
        wait_healthy(hz, &kc).await;

        // Endpoint churn: a new Service with one endpoint, then a second endpoint, then none.
        cp.kubectl(&["create", "namespace", "churn"]).unwrap();
        let svc = "apiVersion: v1\nkind: Service\nmetadata: {name: c, namespace: churn}\n\
                   spec: {clusterIP: 10.96.77.7, ports: [{name: p, port: 8080, protocol: TCP}]}\n";
        cp.apply(svc).unwrap();
        cp.apply(&churn_slice(&["10.244.7.1"])).unwrap();
        wait_rules("10.244.7.1", |t| {
            t.contains("10.96.77.7/32") && t.contains("10.244.7.1:8080")
        })
        .await;
        cp.apply(&churn_slice(&["10.244.7.1", "10.244.7.2"]))
            .unwrap();
        wait_rules("10.244.7.2", |t| t.contains("10.244.7.2:8080")).await;

        // The apiserver restarts: the watches reconnect and later changes still arrive.
        let restart_from = cp.audit_events().len();
        cp.restart_apiserver().unwrap();
        let ready_at = cp.audit_events().len();
        cp.apply(&churn_slice(&["10.244.7.3"])).unwrap();
        wait_rules("10.244.7.3 replacing .1 and .2", |t| {
            t.contains("10.244.7.3:8080")
                && !t.contains("10.244.7.1:8080")
                && !t.contains("10.244.7.2:8080")
        })
        .await;
        cp.kubectl(&["delete", "service", "c", "-n", "churn"])
            .unwrap();
        wait_rules("10.96.77.7 gone", |t| !t.contains("10.96.77.7/32")).await;

        // RBAC: sufficient (no request of the daemon was denied) and minimal (every grant used,
        // but the listed ones).
        let (used, denied) = audit_use(&cp, SA, restart_from..ready_at);
        assert!(denied.is_empty(), "denied requests: {denied:#?}");
        let granted = granted(&cp);
        let outside: Vec<_> = used.difference(&granted).collect();
        assert!(outside.is_empty(), "used without a grant: {outside:?}");
        let unused: BTreeSet<(String, String, String)> =
            granted.difference(&used).cloned().collect();
        let allowed: BTreeSet<(String, String, String)> = UNUSED_GRANTS
            .iter()
            .map(|(v, g, r, _)| (v.to_string(), g.to_string(), r.to_string()))
            .collect();
        assert_eq!(
            unused, allowed,
            "grants never used by the daemon (used: {used:?}); either remove them from \
             deploy/serviceaccount.yaml or list them in UNUSED_GRANTS with the reason"
        );
        drop(d);
    });
}

fn churn_slice(ips: &[&str]) -> String {
    let eps: Vec<String> = ips
        .iter()
        .map(|ip| format!("  - addresses: [\"{ip}\"]\n    conditions: {{ready: true}}\n"))
        .collect();
    format!(
        "apiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata:\n  name: c-1\n  \
         namespace: churn\n  labels: {{kubernetes.io/service-name: c}}\naddressType: IPv4\n\
         ports: [{{name: p, port: 8080, protocol: TCP}}]\nendpoints:\n{}",
        eps.concat()
    )
}

/// 410 Gone: the daemon is frozen (SIGSTOP) at resourceVersion R, the slice changes, the
/// apiserver restarts and etcd is compacted past R (proven by an exact-version list answering
/// 410). Resumed, the daemon's watch from R is refused as too old: it relists and converges.
#[test]
#[ignore = "kube"]
fn kube_daemon_relists_after_410_gone_from_compaction() {
    common::in_netns("kipvs-gone", || async {
        let mut cp = ControlPlane::start_with(testkit::control_plane::Options {
            apiserver_args: vec!["--etcd-compaction-interval=2s".into()],
        })
        .unwrap();
        let sa = std::fs::read_to_string(repo().join("deploy/serviceaccount.yaml")).unwrap();
        cp.apply(&sa).unwrap();
        cp.apply("apiVersion: v1\nkind: Node\nmetadata: {name: node-1}\n")
            .unwrap();
        let kc = cp
            .service_account_kubeconfig("kube-system", "kube-ipvs")
            .unwrap();
        cp.kubectl(&["create", "namespace", "churn"]).unwrap();
        cp.apply(
            "apiVersion: v1\nkind: Service\nmetadata: {name: c, namespace: churn}\n\
             spec: {clusterIP: 10.96.77.7, ports: [{name: p, port: 8080, protocol: TCP}]}\n",
        )
        .unwrap();
        cp.apply(&churn_slice(&["10.244.7.1"])).unwrap();
        let (d, _hz, _m) = start_daemon(&kc);
        wait_rules("10.244.7.1", |t| t.contains("10.244.7.1:8080")).await;

        let pid = d.0.id().to_string();
        let signal = |sig: &str| {
            assert!(Command::new("kill")
                .args([sig, &pid])
                .status()
                .unwrap()
                .success())
        };
        signal("-STOP");
        cp.apply(&churn_slice(&["10.244.7.2"])).unwrap();
        // A version written after the daemon stopped: newer than any the daemon's watches hold
        // (their list versions are global and may be newer than the slice's version before
        // the stop), so once etcd is compacted past it the daemon's resume must get 410.
        let old_rv = cp
            .kubectl(&[
                "get",
                "endpointslice",
                "c-1",
                "-n",
                "churn",
                "-o",
                "jsonpath={.metadata.resourceVersion}",
            ])
            .unwrap();
        cp.restart_apiserver().unwrap();
        // Wait until etcd is compacted past the daemon's resourceVersion.
        let uri = format!(
            "/apis/discovery.k8s.io/v1/namespaces/churn/endpointslices?resourceVersion={old_rv}&resourceVersionMatch=Exact"
        );
        let mut compacted = String::new();
        for i in 0..300 {
            cp.kubectl(&["create", "configmap", &format!("bump-{i}"), "-n", "churn"])
                .unwrap();
            let out = cp
                .kubectl_as(cp.admin_kubeconfig(), &["get", "--raw", &uri])
                .unwrap();
            let err = String::from_utf8_lossy(&out.stderr).into_owned();
            if !out.status.success() && (err.contains("410") || err.contains("too old")) {
                compacted = err;
                break;
            }
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
        assert!(!compacted.is_empty(), "etcd never compacted past {old_rv}");
        signal("-CONT");

        wait_rules("10.244.7.2 replacing .1", |t| {
            t.contains("10.244.7.2:8080") && !t.contains("10.244.7.1:8080")
        })
        .await;
        let log = daemon_log(&kc);
        assert!(
            log.lines().any(|l| l.contains("watch error")
                && (l.contains("410") || l.contains("too old") || l.contains("Expired"))),
            "no 410 watch error in the daemon log:\n{log}"
        );
        drop(d);
    });
}

/// One Service whose status the proxy's types cannot hold must not stop the Service watch of
/// every node: `Services should complete a service status lifecycle` patches a condition with
/// `lastTransitionTime: null` (a Go client's zero time), the API server stores it, and
/// k8s-openapi refuses it. Before `watch::lenient` every list and watch of Services failed from
/// then on (`watch error; retrying with backoff`, `ApiError` with an empty status), so a
/// Service created afterwards was never programmed while that object stayed.
#[test]
#[ignore = "kube"]
fn kube_a_service_status_the_proxy_cannot_type_stops_no_watch() {
    common::in_netns("kipvs-odd", || async {
        let cp = ControlPlane::start().unwrap();
        let kc = cp.admin_kubeconfig().to_path_buf();
        cp.kubectl(&["create", "namespace", "odd"]).unwrap();
        let svc = |name: &str, ip: &str| {
            format!(
                "apiVersion: v1\nkind: Service\nmetadata: {{name: {name}, namespace: odd}}\n\
                 spec: {{clusterIP: {ip}, ports: [{{name: p, port: 80, protocol: TCP}}]}}\n"
            )
        };
        cp.apply(&svc("odd", "10.96.88.8")).unwrap();
        let (d, hz, _m) = start_daemon(&kc);
        wait_rules("10.96.88.8", |t| t.contains("10.96.88.8/32")).await;

        cp.kubectl(&[
            "patch",
            "service",
            "odd",
            "-n",
            "odd",
            "--subresource=status",
            "--type=merge",
            "-p",
            r#"{"status":{"conditions":[{"type":"StatusUpdate","status":"True","lastTransitionTime":null,"reason":"E2E","message":"Set from e2e test"}]}}"#,
        ])
        .unwrap();
        let stored = cp
            .kubectl(&["get", "service", "odd", "-n", "odd", "-o", "json"])
            .unwrap();
        assert!(
            stored.contains(r#""lastTransitionTime": null"#),
            "the API server did not store the null time:\n{stored}"
        );

        // A Service created afterwards is programmed (the watch goes on), and the odd one
        // keeps its rules.
        cp.apply(&svc("later", "10.96.88.9")).unwrap();
        let rules = wait_rules("10.96.88.9", |t| t.contains("10.96.88.9/32")).await;
        assert!(rules.contains("10.96.88.8/32"), "{rules}");
        let log = daemon_log(&kc);
        assert!(
            !log.contains("watch error"),
            "the Service watch failed:\n{log}"
        );
        wait_healthy(hz, &kc).await;
        drop(d);
    });
}

/// A TCP relay to `upstream` that counts the bytes it carries from the server to the client
/// (TLS passes through untouched: the client still talks to the API server's certificate).
fn counting_relay(upstream: SocketAddr) -> (SocketAddr, Arc<AtomicU64>) {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let down = Arc::new(AtomicU64::new(0));
    let counter = down.clone();
    std::thread::spawn(move || {
        for conn in listener.incoming() {
            let Ok(client) = conn else { continue };
            let Ok(server) = TcpStream::connect(upstream) else {
                continue;
            };
            let (mut from_client, mut to_server) =
                (client.try_clone().unwrap(), server.try_clone().unwrap());
            std::thread::spawn(move || {
                let _ = std::io::copy(&mut from_client, &mut to_server);
                let _ = to_server.shutdown(Shutdown::Write);
            });
            let counter = counter.clone();
            std::thread::spawn(move || {
                let (mut from_server, mut to_client) = (server, client);
                let mut buf = vec![0u8; 64 * 1024];
                loop {
                    match from_server.read(&mut buf) {
                        Ok(0) | Err(_) => break,
                        Ok(n) => {
                            counter.fetch_add(n as u64, Ordering::Relaxed);
                            if to_client.write_all(&buf[..n]).is_err() {
                                break;
                            }
                        }
                    }
                }
                let _ = to_client.shutdown(Shutdown::Write);
            });
        }
    });
    (addr, down)
}

/// Every node lists every Service and EndpointSlice at start and after each expired watch, so
/// after an API outage a fleet relists at once: the daemon asks for gzip (client-go's default,
/// upstream kube-proxy's too), and the real API server compresses its lists (responses over
/// 128 KiB), a tenth of the bytes per node on the wire. Counted on a relay between the daemon
/// and the API server: fails when the client does not ask (the lists' full JSON crosses it).
#[test]
#[ignore = "kube"]
fn kube_daemon_lists_arrive_gzip_compressed() {
    const N: usize = 800;
    common::in_netns("kipvs-gzip", || async {
        let cp = ControlPlane::start().unwrap();
        cp.kubectl(&["create", "namespace", "gz"]).unwrap();
        let mut list = String::from("apiVersion: v1\nkind: List\nitems:\n");
        for i in 0..N {
            list += &format!(
                "- apiVersion: v1\n  kind: Service\n  metadata: {{name: svc-{i}, namespace: gz}}\n  \
                 spec: {{ports: [{{name: http, port: 80, targetPort: 8080}}], selector: {{app: svc-{i}}}}}\n"
            );
        }
        cp.kubectl_stdin(&["create", "-f", "-"], &list).unwrap();
        // What the lists weigh uncompressed (kubectl's transport decompresses what it gets).
        let raw = cp
            .kubectl(&["get", "--raw", "/api/v1/services"])
            .unwrap()
            .len() as u64;

        let upstream: SocketAddr = format!("127.0.0.1:{}", cp.port).parse().unwrap();
        let (relay, down) = counting_relay(upstream);
        let admin = std::fs::read_to_string(cp.admin_kubeconfig()).unwrap();
        let through_relay = admin.replace(&cp.server_url(), &format!("https://{relay}"));
        assert_ne!(
            admin, through_relay,
            "the admin kubeconfig names no server URL"
        );
        let kc = cp.dir().join("relay.kubeconfig");
        std::fs::write(&kc, through_relay).unwrap();

        let (d, hz, _m) = start_daemon(&kc);
        wait_healthy(hz, &kc).await;
        // Every Service of the list was decoded and programmed (rules naming gz/svc-I).
        let rules = wait_rules("every gz Service", |t| {
            (0..N).all(|i| t.contains(&format!("\"gz/svc-{i}:http")))
        })
        .await;
        assert!(rules.contains("gz/svc-0:http"));
        let got = down.load(Ordering::Relaxed);
        eprintln!("lists: {raw} bytes uncompressed; {got} bytes from the API server to the daemon");
        assert!(
            got * 3 < raw,
            "the daemon received {got} bytes for lists of {raw} bytes uncompressed: not gzip"
        );
        drop(d);
    });
}
