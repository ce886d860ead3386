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
pub fn echo_once(to: SocketAddr, n: u64) -> Result<(), String> {
    let payload = format!("request {n}\n").into_bytes();
    let mut s = std::net::TcpStream::connect_timeout(&to, Duration::from_secs(5))
        .map_err(|e| e.to_string())?;
    s.set_read_timeout(Some(Duration::from_secs(10)))
        .map_err(|e| e.to_string())?;
    s.write_all(&payload).map_err(|e| e.to_string())?;
    s.shutdown(std::net::Shutdown::Write)
        .map_err(|e| e.to_string())?;
    let mut back = Vec::new();
    s.read_to_end(&mut back).map_err(|e| e.to_string())?;
    if back == payload {
        Ok(())
    } else {
        Err(format!("echo mismatch: {back:?}"))
    }
}
