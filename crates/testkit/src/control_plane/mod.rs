//! A real control plane for tests: etcd and kube-apiserver (upstream binaries built by
//! `cargo xtask kube`) on loopback, with generated certificates, a service-account signing key,
//! a static token file for the admin, RBAC authorization and an audit log.
//!
//! [`ControlPlane::start`] hands out an admin kubeconfig (static token in `system:masters`), and
//! [`ControlPlane::service_account_kubeconfig`] one for any ServiceAccount (a bound token from
//! the TokenRequest API, so the apiserver authenticates it exactly as it would a pod's).
//! Every child process (openssl, kubectl) runs with a time limit; etcd and the apiserver are
//! stopped when the value is dropped, also when a test panics.
//!
//! The binaries are found in `$KUBE_IPVS_KUBE_BIN` (set by `cargo xtask test`'s kube stage), else
//! in the cache `cargo xtask kube` fills (`~/.cache/kube-ipvs/kube-vVERSION/bin`).

use std::io::Read;
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

mod certs;
mod process;

use certs::make_certs;
pub use process::run_with_timeout;
use process::{run_ok, stop};

/// The Kubernetes release `cargo xtask kube` builds (kept equal to xtask's constant).
pub const KUBERNETES_VERSION: &str = "1.37.2";

/// Binaries the control plane and the oracle need.
pub const UPSTREAM_BINARIES: &[&str] = &["etcd", "kube-apiserver", "kube-proxy", "kubectl"];

/// The admin's static bearer token (in the token file, group `system:masters`).
const ADMIN_TOKEN: &str = "kube-ipvs-test-admin-token";

/// How long kubectl and openssl may take.
const CMD_TIMEOUT: Duration = Duration::from_secs(60);

/// How long etcd plus the apiserver may take to become ready (two busy cores).
const READY_TIMEOUT: Duration = Duration::from_secs(180);

/// What can go wrong.
#[derive(Debug, thiserror::Error)]
pub enum ControlPlaneError {
    /// The upstream binaries are not built.
    #[error(
        "upstream binaries not found in {0} (run `cargo xtask kube`, or set KUBE_IPVS_KUBE_BIN)"
    )]
    NoBinaries(String),
    /// A file or process operation failed.
    #[error("{context}: {source}")]
    Io {
        /// What was being done.
        context: String,
        /// The error.
        source: std::io::Error,
    },
    /// A command exited unsuccessfully.
    #[error("`{cmd}` failed ({status}): {stderr}")]
    Command {
        /// The command line.
        cmd: String,
        /// Its exit status.
        status: String,
        /// Its standard error (or output).
        stderr: String,
    },
    /// A command or the start-up exceeded its time limit.
    #[error("timeout: {0}")]
    Timeout(String),
    /// etcd or the apiserver exited early.
    #[error("{name} exited during start-up ({status}); log tail:\n{log}")]
    Exited {
        /// Which program.
        name: &'static str,
        /// Its exit status.
        status: String,
        /// The end of its log.
        log: String,
    },
}

type Result<T> = std::result::Result<T, ControlPlaneError>;

fn io_ctx<T>(r: std::io::Result<T>, what: impl FnOnce() -> String) -> Result<T> {
    r.map_err(|source| ControlPlaneError::Io {
        context: what(),
        source,
    })
}

/// The directory holding the upstream binaries, if all are there.
pub fn upstream_bin_dir() -> Option<PathBuf> {
    let dir = match std::env::var_os("KUBE_IPVS_KUBE_BIN") {
        Some(d) => PathBuf::from(d),
        None => default_bin_dir()?,
    };
    UPSTREAM_BINARIES
        .iter()
        .all(|b| dir.join(b).is_file())
        .then_some(dir)
}

fn default_bin_dir() -> Option<PathBuf> {
    let base = std::env::var_os("XDG_CACHE_HOME")
        .map(PathBuf::from)
        .filter(|p| p.is_absolute())
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache")))?;
    Some(
        base.join("kube-ipvs")
            .join(format!("kube-v{KUBERNETES_VERSION}"))
            .join("bin"),
    )
}

/// The binary directory, or a panic that says how to build it (for `kube_*` tests, which the
/// kube stage runs only once the binaries exist).
pub fn require_upstream() -> PathBuf {
    match upstream_bin_dir() {
        Some(d) => d,
        None => panic!(
            "{}",
            ControlPlaneError::NoBinaries(
                default_bin_dir()
                    .map(|d| d.display().to_string())
                    .unwrap_or_else(|| "~/.cache/kube-ipvs".into())
            )
        ),
    }
}

/// A free loopback TCP port (bound and released: a small race, acceptable in tests).
fn free_port() -> Result<u16> {
    let l = io_ctx(TcpListener::bind("127.0.0.1:0"), || "binding a port".into())?;
    Ok(io_ctx(l.local_addr(), || "local_addr".into())?.port())
}

/// A kubeconfig for `server` trusting `ca`, authenticating with `token`.
pub fn kubeconfig(server: &str, ca: &Path, user: &str, token: &str) -> String {
    format!(
        "apiVersion: v1\nkind: Config\nclusters:\n- name: test\n  cluster:\n    server: {server}\n    \
         certificate-authority: {ca}\nusers:\n- name: {user}\n  user:\n    token: {token}\n\
         contexts:\n- name: {user}@test\n  context:\n    cluster: test\n    user: {user}\n\
         current-context: {user}@test\n",
        ca = ca.display()
    )
}

/// Options for [`ControlPlane::start_with`].
#[derive(Debug, Clone, Default)]
pub struct Options {
    /// Extra kube-apiserver flags (`--name=value`), appended last.
    pub apiserver_args: Vec<String>,
}

/// A running etcd + kube-apiserver.
#[derive(Debug)]
pub struct ControlPlane {
    dir: PathBuf,
    bin: PathBuf,
    etcd: Option<Child>,
    apiserver: Option<Child>,
    apiserver_argv: Vec<String>,
    /// The apiserver's secure port on 127.0.0.1.
    pub port: u16,
    /// etcd's client URL.
    pub etcd_url: String,
    admin: PathBuf,
}

static SEQ: AtomicU32 = AtomicU32::new(0);

impl ControlPlane {
    /// Starts with default options.
    pub fn start() -> Result<Self> {
        Self::start_with(Options::default())
    }

    /// Starts etcd and the apiserver and waits until `/readyz` answers `ok`.
    pub fn start_with(opts: Options) -> Result<Self> {
        let bin = upstream_bin_dir().ok_or_else(|| {
            ControlPlaneError::NoBinaries(
                default_bin_dir()
                    .map(|d| d.display().to_string())
                    .unwrap_or_default(),
            )
        })?;
        let dir = std::env::temp_dir().join(format!(
            "testkit-cp-{}-{}",
            std::process::id(),
            SEQ.fetch_add(1, Ordering::Relaxed)
        ));
        let _ = std::fs::remove_dir_all(&dir);
        io_ctx(std::fs::create_dir_all(dir.join("etcd")), || {
            format!("creating {}", dir.display())
        })?;
        make_certs(&dir)?;
        io_ctx(
            std::fs::write(
                dir.join("tokens.csv"),
                format!("{ADMIN_TOKEN},admin,admin-uid,\"system:masters\"\n"),
            ),
            || "writing tokens.csv".into(),
        )?;
        io_ctx(
            std::fs::write(
                dir.join("audit-policy.yaml"),
                "apiVersion: audit.k8s.io/v1\nkind: Policy\nomitStages: [RequestReceived]\n\
                 rules:\n- level: Metadata\n",
            ),
            || "writing audit-policy.yaml".into(),
        )?;
        let (client, peer, port) = (free_port()?, free_port()?, free_port()?);
        let etcd_url = format!("http://127.0.0.1:{client}");
        let mut cp = ControlPlane {
            dir: dir.clone(),
            bin: bin.clone(),
            etcd: None,
            apiserver: None,
            apiserver_argv: Vec::new(),
            port,
            etcd_url: etcd_url.clone(),
            admin: dir.join("admin.kubeconfig"),
        };
        let peer_url = format!("http://127.0.0.1:{peer}");
        let etcd_args = vec![
            "--name=default".to_string(),
            format!("--data-dir={}", dir.join("etcd").display()),
            format!("--listen-client-urls={etcd_url}"),
            format!("--advertise-client-urls={etcd_url}"),
            format!("--listen-peer-urls={peer_url}"),
            format!("--initial-advertise-peer-urls={peer_url}"),
            format!("--initial-cluster=default={peer_url}"),
            "--unsafe-no-fsync=true".into(),
            "--log-level=warn".into(),
        ];
        cp.etcd = Some(cp.spawn("etcd", &etcd_args)?);
        let d = |f: &str| dir.join(f).display().to_string();
        let mut args = vec![
            format!("--etcd-servers={etcd_url}"),
            "--bind-address=127.0.0.1".into(),
            // The `kubernetes` Service's endpoint: loopback is refused, and 10.0.2.100 is where
            // the test VM reaches this apiserver (QEMU's guestfwd to the same port).
            "--advertise-address=10.0.2.100".into(),
            format!("--secure-port={port}"),
            format!("--cert-dir={}", d("certs")),
            format!("--tls-cert-file={}", d("server.crt")),
            format!("--tls-private-key-file={}", d("server.key")),
            format!("--token-auth-file={}", d("tokens.csv")),
            "--authorization-mode=RBAC".into(),
            "--anonymous-auth=false".into(),
            "--service-account-issuer=https://kubernetes.default.svc".into(),
            format!("--service-account-key-file={}", d("sa.pub")),
            format!("--service-account-signing-key-file={}", d("sa.key")),
            "--service-cluster-ip-range=10.96.0.0/12".into(),
            format!("--audit-policy-file={}", d("audit-policy.yaml")),
            format!("--audit-log-path={}", d("audit.log")),
            "--audit-log-mode=blocking".into(),
            "--profiling=false".into(),
        ];
        args.extend(opts.apiserver_args);
        cp.apiserver_argv = args.clone();
        cp.apiserver = Some(cp.spawn("kube-apiserver", &args)?);
        io_ctx(
            std::fs::write(
                &cp.admin,
                kubeconfig(&cp.server_url(), &dir.join("ca.crt"), "admin", ADMIN_TOKEN),
            ),
            || "writing admin.kubeconfig".into(),
        )?;
        cp.wait_ready()?;
        Ok(cp)
    }

    fn spawn(&self, name: &'static str, args: &[String]) -> Result<Child> {
        let log = self.dir.join(format!("{name}.log"));
        let f = io_ctx(
            std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(&log),
            || format!("opening {}", log.display()),
        )?;
        let f2 = io_ctx(f.try_clone(), || "dup log".into())?;
        io_ctx(
            Command::new(self.bin.join(name))
                .args(args)
                .stdin(Stdio::null())
                .stdout(f)
                .stderr(f2)
                .spawn(),
            || format!("starting {name}"),
        )
    }

    fn log_tail(&self, name: &str) -> String {
        let text =
            std::fs::read_to_string(self.dir.join(format!("{name}.log"))).unwrap_or_default();
        let lines: Vec<&str> = text.lines().rev().take(30).collect();
        lines.into_iter().rev().collect::<Vec<_>>().join("\n")
    }

    fn check_alive(&mut self) -> Result<()> {
        let mut dead = None;
        if let Some(c) = self.etcd.as_mut() {
            if let Ok(Some(st)) = c.try_wait() {
                dead = Some(("etcd", st.to_string()));
                self.etcd = None;
            }
        }
        if dead.is_none() {
            if let Some(c) = self.apiserver.as_mut() {
                if let Ok(Some(st)) = c.try_wait() {
                    dead = Some(("kube-apiserver", st.to_string()));
                    self.apiserver = None;
                }
            }
        }
        match dead {
            Some((name, status)) => Err(ControlPlaneError::Exited {
                name,
                status,
                log: self.log_tail(name),
            }),
            None => Ok(()),
        }
    }

    /// Polls `/readyz` until it answers `ok`.
    pub fn wait_ready(&mut self) -> Result<()> {
        let start = Instant::now();
        loop {
            self.check_alive()?;
            let out = run_with_timeout(
                self.kubectl_cmd().args(["get", "--raw", "/readyz"]),
                None,
                Duration::from_secs(15),
            );
            if let Ok(o) = out {
                if o.status.success() && String::from_utf8_lossy(&o.stdout).trim() == "ok" {
                    return Ok(());
                }
            }
            if start.elapsed() > READY_TIMEOUT {
                return Err(ControlPlaneError::Timeout(format!(
                    "apiserver not ready after {} s; log tail:\n{}",
                    READY_TIMEOUT.as_secs(),
                    self.log_tail("kube-apiserver")
                )));
            }
            std::thread::sleep(Duration::from_millis(500));
        }
    }

    /// `https://127.0.0.1:PORT`.
    pub fn server_url(&self) -> String {
        format!("https://127.0.0.1:{}", self.port)
    }

    /// The CA certificate clients must trust.
    pub fn ca_file(&self) -> PathBuf {
        self.dir.join("ca.crt")
    }

    /// The working directory (certificates, logs, kubeconfigs).
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Where the upstream binaries are.
    pub fn bin_dir(&self) -> &Path {
        &self.bin
    }

    /// The admin kubeconfig (static token, `system:masters`).
    pub fn admin_kubeconfig(&self) -> &Path {
        &self.admin
    }

    /// `kubectl --kubeconfig ADMIN` (not yet run).
    pub fn kubectl_cmd(&self) -> Command {
        let mut c = Command::new(self.bin.join("kubectl"));
        c.arg("--kubeconfig").arg(&self.admin);
        c
    }

    /// Runs kubectl as admin; stdout on success.
    pub fn kubectl(&self, args: &[&str]) -> Result<String> {
        run_ok(self.kubectl_cmd().args(args), None)
    }

    /// Runs kubectl as admin with `stdin`; stdout on success.
    pub fn kubectl_stdin(&self, args: &[&str], stdin: &str) -> Result<String> {
        run_ok(self.kubectl_cmd().args(args), Some(stdin.as_bytes()))
    }

    /// Runs kubectl with `kubeconfig`, returning the whole output whatever the exit status.
    pub fn kubectl_as(&self, kubeconfig: &Path, args: &[&str]) -> Result<Output> {
        run_with_timeout(
            Command::new(self.bin.join("kubectl"))
                .arg("--kubeconfig")
                .arg(kubeconfig)
                .args(args),
            None,
            CMD_TIMEOUT,
        )
    }

    /// `kubectl apply -f -` of `yaml` as admin.
    pub fn apply(&self, yaml: &str) -> Result<String> {
        self.kubectl_stdin(&["apply", "-f", "-"], yaml)
    }

    /// A kubeconfig authenticating as ServiceAccount `namespace/name` (which must exist), with a
    /// bound token from the TokenRequest API.
    pub fn service_account_kubeconfig(&self, namespace: &str, name: &str) -> Result<PathBuf> {
        let token = self.kubectl(&["create", "token", name, "-n", namespace, "--duration=6h"])?;
        let path = self.dir.join(format!("sa-{namespace}-{name}.kubeconfig"));
        io_ctx(
            std::fs::write(
                &path,
                kubeconfig(&self.server_url(), &self.ca_file(), name, token.trim()),
            ),
            || format!("writing {}", path.display()),
        )?;
        Ok(path)
    }

    /// The audit log's events (JSON lines), oldest first.
    pub fn audit_events(&self) -> Vec<serde_json::Value> {
        std::fs::read_to_string(self.dir.join("audit.log"))
            .unwrap_or_default()
            .lines()
            .filter_map(|l| serde_json::from_str(l).ok())
            .collect()
    }

    /// Stops the apiserver (SIGTERM, then SIGKILL after 20 s) and starts it again with the same
    /// flags and port; waits until ready.
    pub fn restart_apiserver(&mut self) -> Result<()> {
        self.stop_apiserver();
        let args = self.apiserver_argv.clone();
        self.apiserver = Some(self.spawn("kube-apiserver", &args)?);
        self.wait_ready()
    }

    /// Stops the apiserver (clients see connection refused until [`Self::restart_apiserver`]).
    pub fn stop_apiserver(&mut self) {
        if let Some(c) = self.apiserver.take() {
            stop(c);
        }
    }
}

impl Drop for ControlPlane {
    fn drop(&mut self) {
        self.stop_apiserver();
        if let Some(c) = self.etcd.take() {
            stop(c);
        }
        if std::env::var_os("TESTKIT_KEEP_CONTROL_PLANE").is_none() {
            let _ = std::fs::remove_dir_all(&self.dir);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kubeconfig_names_server_ca_and_token() {
        let k = kubeconfig("https://127.0.0.1:1", Path::new("/x/ca.crt"), "me", "tok");
        assert!(k.contains("server: https://127.0.0.1:1"));
        assert!(k.contains("certificate-authority: /x/ca.crt"));
        assert!(k.contains("token: tok"));
        assert!(k.contains("current-context: me@test"));
    }

    #[test]
    fn timeout_kills_a_hung_command() {
        let e = run_with_timeout(
            Command::new("sleep").arg("30"),
            None,
            Duration::from_millis(200),
        )
        .unwrap_err();
        assert!(matches!(e, ControlPlaneError::Timeout(_)), "{e}");
    }

    #[test]
    fn certificates_are_generated() {
        let dir = std::env::temp_dir().join(format!("testkit-certs-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        make_certs(&dir).unwrap();
        let text = run_ok(
            Command::new("openssl")
                .args(["x509", "-noout", "-text", "-in"])
                .arg(dir.join("server.crt")),
            None,
        )
        .unwrap();
        assert!(text.contains("IP Address:127.0.0.1"), "{text}");
        assert!(text.contains("IP Address:10.0.2.100"), "{text}");
        run_ok(
            Command::new("openssl")
                .args(["verify", "-CAfile"])
                .arg(dir.join("ca.crt"))
                .arg(dir.join("server.crt")),
            None,
        )
        .unwrap();
        assert!(dir.join("sa.pub").is_file());
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
