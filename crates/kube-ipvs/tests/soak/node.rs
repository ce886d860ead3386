//! The soak's node: the node namespace with the stable pods (`api_lab::Lab`), a client pod and a
//! flood pod, the release daemon (restartable, its crashes recorded), the tool wrappers that
//! hang `ipset` and `iptables-*-restore` on demand, and `kube-ipvs plan --diff`.

use std::io::Write as _;
use std::net::Ipv4Addr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};

use testkit::netns::Pod;

use crate::api_lab::Lab;
use crate::objects::{self, NODE_NAME, NODE_PORT_ADDRESSES};

/// The guest's PATH (xtask's `GUEST_PATH`).
const PATH: &str = "/usr/local/sbin:/usr/sbin:/sbin:/usr/local/bin:/usr/bin:/bin";

/// The tools a fault can make hang, by fault: the wrapper of each name sleeps while
/// `DIR/hang-<fault>` exists.
pub const WRAPPED: &[(&str, &[&str])] = &[
    ("ipset", &["ipset"]),
    (
        "iptables",
        &[
            "iptables-restore",
            "ip6tables-restore",
            "iptables-legacy-restore",
            "ip6tables-legacy-restore",
            "iptables-nft-restore",
            "ip6tables-nft-restore",
        ],
    ),
];

/// The node and everything on it.
pub struct Node {
    /// The node namespace and the stable pods.
    pub lab: Lab,
    /// A pod that runs clients (pod → Service traffic).
    pub client_pod: Pod,
    /// A pod that floods the health port.
    pub flood_pod: Pod,
    /// The soak's scratch directory (config, kubeconfig, wrappers, logs).
    pub dir: PathBuf,
}

fn find(tool: &str) -> PathBuf {
    PATH.split(':')
        .map(|d| Path::new(d).join(tool))
        .find(|p| p.exists())
        .unwrap_or_else(|| panic!("{tool} is not in the VM's PATH"))
}

impl Node {
    /// Builds the node: namespaces, pods with echo servers, the storm link, the legacy iptables
    /// hint (so the daemon picks the backend that takes the xtables lock) and the wrappers.
    pub fn new() -> Node {
        let lab = Lab::new("soak", &objects::pod_ips());
        let client_pod = Pod::new(Some(&lab.node), Ipv4Addr::new(10, 244, 0, 30)).unwrap();
        let flood_pod = Pod::new(Some(&lab.node), Ipv4Addr::new(10, 244, 0, 31)).unwrap();
        lab.node
            .ip(&["link", "add", "storm0", "type", "dummy"])
            .unwrap();
        lab.node.ip(&["link", "set", "storm0", "up"]).unwrap();
        lab.node
            .run(&[
                "iptables-legacy",
                "-t",
                "mangle",
                "-N",
                "KUBE-IPTABLES-HINT",
            ])
            .unwrap();
        let dir = std::env::temp_dir().join(format!("kube-ipvs-soak-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(dir.join("bin")).unwrap();
        for (fault, tools) in WRAPPED {
            for tool in *tools {
                let real = find(tool);
                let path = dir.join("bin").join(tool);
                let d = dir.display();
                std::fs::write(
                    &path,
                    format!(
                        "#!/usr/bin/dash\nif [ -e {d}/hang-{fault} ]; then\n  \
                         echo \"$0 $*\" >> {d}/hung-{fault}.log\n  exec sleep 3600\nfi\n\
                         exec {} \"$@\"\n",
                        real.display()
                    ),
                )
                .unwrap();
                use std::os::unix::fs::PermissionsExt;
                std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).unwrap();
            }
        }
        // The shipped ConfigMap's KubeProxyConfiguration: the daemon runs as deployed.
        let cm = std::fs::read_to_string(
            Path::new(env!("CARGO_MANIFEST_DIR")).join("../../deploy/configmap.yaml"),
        )
        .unwrap();
        let cm: k8s_openapi::api::core::v1::ConfigMap = serde_saphyr::from_str(&cm).unwrap();
        std::fs::write(dir.join("config.conf"), &cm.data.unwrap()["config.conf"]).unwrap();
        Node {
            lab,
            client_pod,
            flood_pod,
            dir,
        }
    }

    /// The command line the daemon and `plan` share (after the binary).
    pub fn flags(&self) -> Vec<String> {
        vec![
            format!("--config={}", self.dir.join("config.conf").display()),
            format!("--kubeconfig={}", self.kubeconfig().display()),
            format!("--hostname-override={NODE_NAME}"),
            format!("--nodeport-addresses={NODE_PORT_ADDRESSES}"),
            // nf_conntrack_max is read-only in a test namespace (kind sets this too).
            "--conntrack-max-per-core=0".into(),
        ]
    }

    /// Where the kubeconfig of the fake API server is.
    pub fn kubeconfig(&self) -> PathBuf {
        self.dir.join("kubeconfig.yaml")
    }

    /// Starts (`on`) or ends a hang of the tools of `fault` (`ipset`, `iptables`).
    pub fn hang(&self, fault: &str, on: bool) {
        let flag = self.dir.join(format!("hang-{fault}"));
        if on {
            std::fs::write(flag, "").unwrap();
        } else {
            let _ = std::fs::remove_file(flag);
        }
    }

    /// How many calls of `fault`'s tools hung so far.
    pub fn hung_calls(&self, fault: &str) -> usize {
        std::fs::read_to_string(self.dir.join(format!("hung-{fault}.log")))
            .map(|t| t.lines().count())
            .unwrap_or(0)
    }

    /// `kube-ipvs plan --diff` with the daemon's flags (the real tools, no wrappers), run from
    /// the calling thread (inside the node namespace): the writes a full sync would make now.
    /// `Err` when it fails or does not finish within `limit` seconds.
    pub fn plan_diff(&self, bin: &str, limit: u64) -> Result<Vec<String>, String> {
        let out = Command::new("timeout")
            .args(["-s", "KILL", &limit.to_string(), bin, "plan", "--diff"])
            .args(self.flags())
            .env("PATH", PATH)
            .env_remove("RUST_LOG")
            .env_remove("KUBECONFIG")
            .output()
            .map_err(|e| format!("plan --diff: {e}"))?;
        if out.status.code().is_none() {
            return Err(format!("plan --diff did not finish within {limit} s"));
        }
        if !out.status.success() {
            return Err(format!(
                "plan --diff: {}: {}",
                out.status,
                tail(&String::from_utf8_lossy(&out.stderr), 5)
            ));
        }
        Ok(String::from_utf8_lossy(&out.stdout)
            .lines()
            .filter(|l| !l.trim().is_empty())
            .map(str::to_string)
            .collect())
    }
}

impl Drop for Node {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// The daemon under test: the release binary, restartable, its exits recorded.
pub struct Daemon {
    bin: String,
    flags: Vec<String>,
    path: String,
    log: PathBuf,
    child: Option<Child>,
    /// How many times it was started.
    pub starts: u32,
    /// Exits nobody asked for: (seconds since the start of the soak, status, log tail).
    pub crashes: Vec<(f64, String, String)>,
}

impl Daemon {
    /// A daemon of `bin` on `node` (not started).
    pub fn new(bin: &str, node: &Node) -> Daemon {
        Daemon {
            bin: bin.to_string(),
            flags: node.flags(),
            path: format!("{}:{PATH}", node.dir.join("bin").display()),
            log: node.dir.join("daemon.log"),
            child: None,
            starts: 0,
            crashes: Vec::new(),
        }
    }

    /// Starts it from the calling thread (inside the node namespace); stderr is appended to
    /// the log.
    pub fn start(&mut self) {
        assert!(self.child.is_none(), "daemon already running");
        let mut log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.log)
            .unwrap();
        let _ = writeln!(log, "=== soak: daemon start #{}", self.starts + 1);
        let child = Command::new(&self.bin)
            .args(&self.flags)
            .env("PATH", &self.path)
            .env_remove("RUST_LOG")
            .env_remove("KUBECONFIG")
            .stdout(Stdio::null())
            .stderr(Stdio::from(log))
            .spawn()
            .unwrap();
        self.child = Some(child);
        self.starts += 1;
    }

    /// `kill -9`, reaped.
    pub fn kill9(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// SIGTERM and wait; the exit code.
    pub fn stop(&mut self) -> Option<i32> {
        let mut c = self.child.take()?;
        let _ = Command::new("kill")
            .args(["-TERM", &c.id().to_string()])
            .status();
        c.wait().ok().and_then(|s| s.code())
    }

    /// Its pid while it runs.
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    /// If it exited on its own: records the crash and starts it again. True when it had.
    pub fn restart_if_exited(&mut self, at: f64) -> bool {
        let exited = match self.child.as_mut().map(Child::try_wait) {
            Some(Ok(Some(st))) => Some(st.to_string()),
            Some(Err(e)) => Some(e.to_string()),
            _ => None,
        };
        let Some(status) = exited else { return false };
        self.child = None;
        let log = std::fs::read_to_string(&self.log).unwrap_or_default();
        self.crashes.push((at, status, tail(&log, 20)));
        self.start();
        true
    }

    /// The log so far.
    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        self.kill9();
    }
}

/// `VmRSS` of `pid` in KiB.
pub fn rss_kb(pid: u32) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse().ok())
}

/// The last `n` lines of `s`.
pub fn tail(s: &str, n: usize) -> String {
    let lines: Vec<&str> = s.lines().collect();
    lines[lines.len().saturating_sub(n)..].join("\n")
}
