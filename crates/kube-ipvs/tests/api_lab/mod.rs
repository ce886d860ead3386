//! The lab of the API-server end-to-end tests (`e2e_faults`, `e2e_bad_objects`): a node
//! namespace with pods running echo servers, and the real daemon started with `--kubeconfig`
//! against the in-process fake API server.
#![allow(dead_code, clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::io::{Read, Write};
use std::net::{Ipv4Addr, SocketAddr};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use testkit::netns::{EchoServer, Netns, Pod};

use crate::common;

const BIN: &str = env!("CARGO_BIN_EXE_kube-ipvs");

/// The node namespace and its pods with echo servers (all removed on drop).
pub struct Lab {
    pub node: Netns,
    _pods: Vec<(Pod, EchoServer)>,
}

impl Lab {
    pub fn new(tag: &str, pod_ips: &[Ipv4Addr]) -> Lab {
        let node = Netns::new(tag).unwrap();
        node.ip(&["link", "add", "node0", "type", "dummy"]).unwrap();
        node.ip(&["addr", "add", "192.168.0.10/24", "dev", "node0"])
            .unwrap();
        node.ip(&["link", "set", "node0", "up"]).unwrap();
        node.ip(&["route", "add", "default", "via", "192.168.0.1"])
            .unwrap();
        node.sysctl("net.ipv4.ip_forward", "1").unwrap();
        let pods = pod_ips
            .iter()
            .map(|ip| {
                let pod = Pod::new(Some(&node), *ip).unwrap();
                let srv = EchoServer::start(&pod.ns, SocketAddr::from((*ip, 8080))).unwrap();
                (pod, srv)
            })
            .collect();
        Lab { node, _pods: pods }
    }

    /// Runs an async body on a thread inside the node namespace (threads and processes it
    /// starts inherit the namespace).
    pub fn run<F, Fut>(&self, body: F)
    where
        F: FnOnce() -> Fut + Send + 'static,
        Fut: std::future::Future<Output = ()>,
    {
        common::run_in(&self.node, body);
    }
}

/// The daemon, killed on drop; stderr goes to a file (a pipe could fill up and block it).
pub struct Daemon {
    pub child: Child,
    pub log: PathBuf,
    pub healthz: SocketAddr,
    pub metrics: SocketAddr,
}

impl Daemon {
    pub fn start(kubeconfig: &str, extra: &[&str]) -> Daemon {
        let (hp, mp) = (common::free_port(), common::free_port());
        let healthz: SocketAddr = format!("127.0.0.1:{hp}").parse().unwrap();
        let metrics: SocketAddr = format!("127.0.0.1:{mp}").parse().unwrap();
        let log = std::env::temp_dir().join(format!("e2e-api-{}-{hp}.log", std::process::id()));
        let file = std::fs::File::create(&log).unwrap();
        let child = Command::new(BIN)
            .args(["--kubeconfig", kubeconfig, "--hostname-override", "node-1"])
            .args(["--healthz-bind-address", &healthz.to_string()])
            .args(["--metrics-bind-address", &metrics.to_string()])
            .args(["--ipvs-fallback=false"])
            // nf_conntrack_max is read-only in a test namespace (kind sets this too).
            .args(["--conntrack-max-per-core=0"])
            .args(extra)
            .env_remove("RUST_LOG")
            .env_remove("KUBECONFIG")
            .stdout(Stdio::null())
            .stderr(Stdio::from(file))
            .spawn()
            .unwrap();
        Daemon {
            child,
            log,
            healthz,
            metrics,
        }
    }

    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    pub fn alive(&mut self) -> bool {
        self.child.try_wait().unwrap().is_none()
    }

    /// SIGTERM; returns the exit code and the log.
    pub fn stop(mut self) -> (Option<i32>, String) {
        let pid = self.child.id().to_string();
        Command::new("kill").args(["-TERM", &pid]).status().unwrap();
        let status = self.child.wait().unwrap();
        (status.code(), self.log())
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_file(&self.log);
    }
}

pub fn sh(cmd: &str) -> String {
    let out = Command::new("sh").args(["-c", cmd]).output().unwrap();
    String::from_utf8_lossy(&out.stdout).to_string()
}

/// Polls `ipvsadm -Sn` until `pred` holds; the deadline only prevents a hang.
pub async fn wait_ipvs(
    d: &Daemon,
    what: &str,
    deadline: Duration,
    pred: impl Fn(&str) -> bool,
) -> String {
    let start = Instant::now();
    loop {
        let t = sh("ipvsadm -Sn");
        if pred(&t) {
            return t;
        }
        assert!(
            start.elapsed() < deadline,
            "never saw {what}:\n{t}\ndaemon log:\n{}",
            d.log()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// One request to the echo server behind `to`: send a line, half-close, read it all back.
pub fn echo_once(to: SocketAddr, n: u64) -> std::io::Result<()> {
    let payload = format!("request {n}\n").into_bytes();
    let mut s = std::net::TcpStream::connect_timeout(&to, Duration::from_secs(5))?;
    s.set_read_timeout(Some(Duration::from_secs(10)))?;
    s.write_all(&payload)?;
    s.shutdown(std::net::Shutdown::Write)?;
    let mut back = Vec::new();
    s.read_to_end(&mut back)?;
    if back == payload {
        Ok(())
    } else {
        Err(std::io::Error::other(format!("echo mismatch: {back:?}")))
    }
}

/// A client echoing through one address every 100 ms on its own thread (inheriting the
/// starting thread's namespace), counting answers and failures (with when each failed
/// connection was tried).
pub struct EchoClient {
    pub to: SocketAddr,
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
    succeeded: std::sync::Arc<std::sync::atomic::AtomicU64>,
    failed: std::sync::Arc<std::sync::atomic::AtomicU64>,
    errors: std::sync::Arc<std::sync::Mutex<Vec<String>>>,
    failed_at: std::sync::Arc<std::sync::Mutex<Vec<(Instant, Instant)>>>,
    thread: std::thread::JoinHandle<()>,
}

impl EchoClient {
    pub fn start(to: &str) -> EchoClient {
        use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
        use std::sync::{Arc, Mutex};
        let to: SocketAddr = to.parse().unwrap();
        let stop = Arc::new(AtomicBool::new(false));
        let succeeded = Arc::new(AtomicU64::new(0));
        let failed = Arc::new(AtomicU64::new(0));
        let errors = Arc::new(Mutex::new(Vec::new()));
        let failed_at = Arc::new(Mutex::new(Vec::new()));
        let (s, ok, bad, errs, at) = (
            stop.clone(),
            succeeded.clone(),
            failed.clone(),
            errors.clone(),
            failed_at.clone(),
        );
        let thread = std::thread::spawn(move || {
            let mut n = 0;
            while !s.load(Ordering::SeqCst) {
                n += 1;
                let started = Instant::now();
                match echo_once(to, n) {
                    Ok(()) => {
                        ok.fetch_add(1, Ordering::SeqCst);
                    }
                    Err(e) => {
                        bad.fetch_add(1, Ordering::SeqCst);
                        errs.lock().unwrap().push(format!("#{n}: {e}"));
                        at.lock().unwrap().push((started, Instant::now()));
                    }
                }
                std::thread::sleep(Duration::from_millis(100));
            }
        });
        EchoClient {
            to,
            stop,
            succeeded,
            failed,
            errors,
            failed_at,
            thread,
        }
    }

    /// Answers so far.
    pub fn ok(&self) -> u64 {
        self.succeeded.load(std::sync::atomic::Ordering::SeqCst)
    }

    /// Failed connections so far.
    pub fn failed(&self) -> u64 {
        self.failed.load(std::sync::atomic::Ordering::SeqCst)
    }

    /// The failures so far (`#N: error`).
    pub fn errors(&self) -> Vec<String> {
        self.errors.lock().unwrap().clone()
    }

    /// `ADDR: N succeeded, M failed`.
    pub fn line(&self) -> String {
        format!(
            "{}: {} succeeded, {} failed",
            self.to,
            self.ok(),
            self.failed.load(std::sync::atomic::Ordering::SeqCst)
        )
    }

    /// Waits until `n` more answers came; `deadline` only guards against a hang.
    pub async fn wait_answers(&self, n: u64, deadline: Duration) {
        let start = Instant::now();
        let base = self.ok();
        while self.ok() < base + n {
            assert!(start.elapsed() < deadline, "no answers through {}", self.to);
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// Stops it; returns (succeeded, failed, errors).
    pub fn stop(self) -> (u64, u64, Vec<String>) {
        use std::sync::atomic::Ordering;
        self.stop.store(true, Ordering::SeqCst);
        self.thread.join().unwrap();
        (
            self.succeeded.load(Ordering::SeqCst),
            self.failed.load(Ordering::SeqCst),
            self.errors.lock().unwrap().clone(),
        )
    }

    /// Stops it, prints its counts and asserts that no connection failed.
    pub fn finish(self) {
        let to = self.to;
        let (ok, failed, errors) = self.stop();
        println!("client {to}: {ok} succeeded, {failed} failed");
        assert_eq!(failed, 0, "failed connections through {to}: {errors:?}");
    }

    /// Stops it and asserts that no connection failed, except ones in flight during `cut` (a
    /// moment between two samples, e.g. when a virtual server was deleted).
    pub fn finish_except(self, cut: Option<(Instant, Instant)>) {
        let allowed = self
            .failed_at
            .lock()
            .unwrap()
            .iter()
            .filter(|(s, e)| cut.is_some_and(|(from, to)| *s <= to && *e >= from))
            .count();
        if allowed > 0 {
            println!(
                "client {}: {allowed} connection(s) in flight while the virtual server was deleted failed",
                self.to
            );
        }
        self.failed
            .fetch_sub(allowed as u64, std::sync::atomic::Ordering::SeqCst);
        self.finish();
    }
}
