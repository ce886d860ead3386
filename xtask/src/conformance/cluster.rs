//! The control plane on the host, inside a network namespace of the run's own.
//!
//! The namespace holds a bridge `br0` ([`CP_IP`]/24) with one tap per node VM (QEMU runs inside
//! the namespace and attaches to its tap), so the API server reaches each kubelet at its node IP
//! (exec, logs, port-forward) and the nodes reach the API server, with no address outside the
//! namespace involved. etcd, kube-apiserver, kube-controller-manager and kube-scheduler run there
//! as host processes; every client (nodes, controllers, e2e.test) authenticates with a static
//! token in `system:masters`, pods with their ServiceAccount tokens.

use crate::error::{Context, Error, Result};
use crate::host;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// The control plane's address on the namespace's bridge (the `kubernetes` Service endpoint).
pub const CP_IP: &str = "192.168.200.1";
/// The API server's port.
pub const API_PORT: u16 = 6443;
/// The Service CIDR.
pub const SERVICE_CIDR: &str = "10.96.0.0/12";
/// The cluster DNS Service's ClusterIP.
pub const DNS_IP: &str = "10.96.0.10";
/// The static token every control-plane client uses (group `system:masters`).
const ADMIN_TOKEN: &str = "kube-ipvs-conformance-admin";

/// Node `n`'s (1-based) address on the bridge.
pub fn node_ip(n: u32) -> String {
    format!("192.168.200.{}", 10 + n)
}

/// Node `n`'s pod CIDR.
pub fn pod_cidr(n: u32) -> String {
    format!("10.244.{n}.0/24")
}

/// Node `n`'s name.
pub fn node_name(n: u32) -> String {
    format!("node-{n}")
}

/// A running control plane; dropped: processes stopped, namespace deleted.
pub struct Cluster {
    /// The network namespace.
    pub ns: String,
    /// Working directory (certificates, kubeconfigs, logs).
    pub dir: PathBuf,
    /// The admin kubeconfig.
    pub admin: PathBuf,
    kubectl: PathBuf,
    procs: Vec<(&'static str, Child)>,
}

fn openssl(dir: &Path, args: &[&str]) -> Result<()> {
    host::output(Command::new("openssl").args(args).current_dir(dir)).map(|_| ())
}

/// CA, API server serving certificate, the API server's client certificate for kubelets, and
/// the ServiceAccount signing key pair.
fn make_certs(dir: &Path) -> Result<()> {
    let ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1"];
    let mut ca = vec!["req", "-x509", "-nodes", "-days", "3"];
    ca.extend(ec);
    ca.extend([
        "-keyout",
        "ca.key",
        "-out",
        "ca.crt",
        "-subj",
        "/CN=kube-ipvs-conformance-ca",
    ]);
    openssl(dir, &ca)?;
    let sign = |name: &str, subj: &str, ext: &str| -> Result<()> {
        let mut csr = vec!["req", "-new", "-nodes"];
        csr.extend(ec);
        let (key, req) = (format!("{name}.key"), format!("{name}.csr"));
        csr.extend(["-keyout", &key, "-out", &req, "-subj", subj]);
        openssl(dir, &csr)?;
        let extf = format!("{name}.ext");
        fs::write(dir.join(&extf), ext).ctx(|| format!("writing {extf}"))?;
        let crt = format!("{name}.crt");
        openssl(
            dir,
            &[
                "x509",
                "-req",
                "-in",
                &req,
                "-CA",
                "ca.crt",
                "-CAkey",
                "ca.key",
                "-CAcreateserial",
                "-days",
                "3",
                "-out",
                &crt,
                "-extfile",
                &extf,
            ],
        )
    };
    sign(
        "apiserver",
        "/CN=kube-apiserver",
        &format!(
            "subjectAltName=IP:{CP_IP},IP:10.96.0.1,IP:127.0.0.1,DNS:localhost,DNS:kubernetes,\
             DNS:kubernetes.default,DNS:kubernetes.default.svc,\
             DNS:kubernetes.default.svc.cluster.local\n\
             extendedKeyUsage=serverAuth\nkeyUsage=critical,digitalSignature,keyEncipherment\n\
             basicConstraints=critical,CA:FALSE\n"
        ),
    )?;
    sign(
        "kubelet-client",
        "/O=system:masters/CN=kube-apiserver-kubelet-client",
        "extendedKeyUsage=clientAuth\nkeyUsage=critical,digitalSignature,keyEncipherment\n\
         basicConstraints=critical,CA:FALSE\n",
    )?;
    openssl(
        dir,
        &[
            "ecparam",
            "-name",
            "prime256v1",
            "-genkey",
            "-noout",
            "-out",
            "sa.key",
        ],
    )?;
    openssl(dir, &["ec", "-in", "sa.key", "-pubout", "-out", "sa.pub"])
}

/// A kubeconfig for the API server with the CA embedded (it is copied into the node VMs).
pub fn kubeconfig(ca_pem: &str) -> String {
    let ca64 = base64(ca_pem.as_bytes());
    format!(
        "apiVersion: v1\nkind: Config\nclusters:\n- name: conformance\n  cluster:\n    server: \
         https://{CP_IP}:{API_PORT}\n    certificate-authority-data: {ca64}\nusers:\n- name: admin\n  \
         user:\n    token: {ADMIN_TOKEN}\ncontexts:\n- name: admin@conformance\n  context:\n    \
         cluster: conformance\n    user: admin\ncurrent-context: admin@conformance\n"
    )
}

/// Standard base64 (RFC 4648, padded).
pub fn base64(data: &[u8]) -> String {
    const T: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut s = String::with_capacity(data.len().div_ceil(3) * 4);
    for c in data.chunks(3) {
        let n = (u32::from(c[0]) << 16)
            | (u32::from(*c.get(1).unwrap_or(&0)) << 8)
            | u32::from(*c.get(2).unwrap_or(&0));
        for i in 0..4 {
            if i <= c.len() {
                s.push(char::from(T[((n >> (18 - 6 * i)) & 63) as usize]));
            } else {
                s.push('=');
            }
        }
    }
    s
}

impl Cluster {
    /// Creates the namespace with `nodes` taps (`tap1`..), then starts and waits for the control
    /// plane. `kube_bin`: etcd, kube-apiserver, kubectl; `bin`: controller-manager, scheduler.
    pub fn start(dir: &Path, kube_bin: &Path, bin: &Path, nodes: u32) -> Result<Self> {
        remove_stale_namespaces();
        let ns = format!("kipvs-conf-{}", std::process::id());
        let _ = fs::remove_dir_all(dir);
        fs::create_dir_all(dir.join("etcd")).ctx(|| format!("creating {}", dir.display()))?;
        let ip = |args: &[&str]| host::output(Command::new("ip").args(args)).map(|_| ());
        ip(&["netns", "add", &ns])?;
        let mut c = Cluster {
            ns: ns.clone(),
            dir: dir.to_path_buf(),
            admin: dir.join("admin.kubeconfig"),
            kubectl: kube_bin.join("kubectl"),
            procs: Vec::new(),
        };
        ip(&["-n", &ns, "link", "set", "lo", "up"])?;
        ip(&["-n", &ns, "link", "add", "br0", "type", "bridge"])?;
        ip(&[
            "-n",
            &ns,
            "addr",
            "add",
            &format!("{CP_IP}/24"),
            "dev",
            "br0",
        ])?;
        ip(&["-n", &ns, "link", "set", "br0", "up"])?;
        for n in 1..=nodes {
            let tap = format!("tap{n}");
            ip(&["-n", &ns, "tuntap", "add", &tap, "mode", "tap"])?;
            ip(&["-n", &ns, "link", "set", &tap, "master", "br0", "up"])?;
            ip(&["-n", &ns, "route", "add", &pod_cidr(n), "via", &node_ip(n)])?;
        }
        make_certs(dir)?;
        fs::write(
            dir.join("tokens.csv"),
            format!("{ADMIN_TOKEN},admin,admin-uid,\"system:masters\"\n"),
        )
        .ctx(|| "writing tokens.csv")?;
        let ca = fs::read_to_string(dir.join("ca.crt")).ctx(|| "reading ca.crt")?;
        fs::write(&c.admin, kubeconfig(&ca)).ctx(|| "writing admin.kubeconfig")?;
        let d = |f: &str| dir.join(f).display().to_string();
        c.spawn(
            "etcd",
            &kube_bin.join("etcd"),
            &[
                "--name=default".into(),
                format!("--data-dir={}", d("etcd")),
                "--listen-client-urls=http://127.0.0.1:2379".into(),
                "--advertise-client-urls=http://127.0.0.1:2379".into(),
                "--listen-peer-urls=http://127.0.0.1:2380".into(),
                "--initial-advertise-peer-urls=http://127.0.0.1:2380".into(),
                "--initial-cluster=default=http://127.0.0.1:2380".into(),
                "--unsafe-no-fsync=true".into(),
                "--log-level=warn".into(),
            ],
        )?;
        c.spawn(
            "kube-apiserver",
            &kube_bin.join("kube-apiserver"),
            &[
                "--etcd-servers=http://127.0.0.1:2379".into(),
                "--bind-address=0.0.0.0".into(),
                format!("--advertise-address={CP_IP}"),
                format!("--secure-port={API_PORT}"),
                format!("--cert-dir={}", d("certs")),
                format!("--tls-cert-file={}", d("apiserver.crt")),
                format!("--tls-private-key-file={}", d("apiserver.key")),
                format!("--client-ca-file={}", d("ca.crt")),
                format!("--token-auth-file={}", d("tokens.csv")),
                format!("--kubelet-client-certificate={}", d("kubelet-client.crt")),
                format!("--kubelet-client-key={}", d("kubelet-client.key")),
                "--kubelet-preferred-address-types=InternalIP".into(),
                "--authorization-mode=RBAC".into(),
                "--allow-privileged=true".into(),
                "--service-account-issuer=https://kubernetes.default.svc.cluster.local".into(),
                format!("--service-account-key-file={}", d("sa.pub")),
                format!("--service-account-signing-key-file={}", d("sa.key")),
                format!("--service-cluster-ip-range={SERVICE_CIDR}"),
                "--profiling=false".into(),
            ],
        )?;
        c.wait_ready()?;
        let admin = c.admin.display().to_string();
        if !bin.join("kube-controller-manager").is_file() {
            eprintln!("xtask: conformance: no kube-controller-manager/kube-scheduler yet: API server only");
            return Ok(c);
        }
        c.spawn(
            "kube-controller-manager",
            &bin.join("kube-controller-manager"),
            &[
                format!("--kubeconfig={admin}"),
                format!("--authentication-kubeconfig={admin}"),
                format!("--authorization-kubeconfig={admin}"),
                format!("--service-account-private-key-file={}", d("sa.key")),
                format!("--root-ca-file={}", d("ca.crt")),
                format!("--service-cluster-ip-range={SERVICE_CIDR}"),
                "--leader-elect=false".into(),
                "--use-service-account-credentials=false".into(),
                "--bind-address=127.0.0.1".into(),
                "--profiling=false".into(),
            ],
        )?;
        c.spawn(
            "kube-scheduler",
            &bin.join("kube-scheduler"),
            &[
                format!("--kubeconfig={admin}"),
                format!("--authentication-kubeconfig={admin}"),
                format!("--authorization-kubeconfig={admin}"),
                "--leader-elect=false".into(),
                "--bind-address=127.0.0.1".into(),
                "--profiling=false".into(),
            ],
        )?;
        Ok(c)
    }

    fn spawn(&mut self, name: &'static str, exe: &Path, args: &[String]) -> Result<()> {
        let log = self.dir.join(format!("{name}.log"));
        let f = fs::File::create(&log).ctx(|| format!("creating {}", log.display()))?;
        let f2 = f.try_clone().ctx(|| "dup log")?;
        let child = Command::new("ip")
            .args(["netns", "exec", &self.ns])
            .arg(exe)
            .args(args)
            .stdin(Stdio::null())
            .stdout(f)
            .stderr(f2)
            .spawn()
            .map_err(|e| Error::Command {
                cmd: name.into(),
                detail: format!("cannot start: {e}"),
            })?;
        self.procs.push((name, child));
        Ok(())
    }

    /// Fails with the log tail of a control-plane process that exited.
    pub fn check_alive(&mut self) -> Result<()> {
        for (name, child) in &mut self.procs {
            if let Ok(Some(st)) = child.try_wait() {
                let log =
                    fs::read_to_string(self.dir.join(format!("{name}.log"))).unwrap_or_default();
                return Err(Error::Command {
                    cmd: (*name).into(),
                    detail: format!("exited ({st}):\n{}", super::tail(&log, 30)),
                });
            }
        }
        Ok(())
    }

    fn wait_ready(&mut self) -> Result<()> {
        let start = Instant::now();
        loop {
            self.check_alive()?;
            if self
                .kubectl(&["get", "--raw", "/readyz"])
                .is_ok_and(|o| o.trim() == "ok")
            {
                return Ok(());
            }
            if start.elapsed() > Duration::from_secs(180) {
                return Err(Error::Timeout(
                    "kube-apiserver not ready after 180 s".into(),
                ));
            }
            std::thread::sleep(Duration::from_millis(500));
        }
    }

    /// A command that runs `exe` inside the namespace.
    pub fn in_ns(&self, exe: &Path) -> Command {
        let mut c = Command::new("ip");
        c.args(["netns", "exec", &self.ns]).arg(exe);
        c
    }

    /// `kubectl --kubeconfig ADMIN ARGS` in the namespace, with a time limit; stdout.
    pub fn kubectl(&self, args: &[&str]) -> Result<String> {
        self.kubectl_stdin(args, None)
    }

    /// As [`Self::kubectl`], feeding `stdin`.
    pub fn kubectl_stdin(&self, args: &[&str], stdin: Option<&str>) -> Result<String> {
        let mut c = self.in_ns(&self.kubectl);
        c.arg("--kubeconfig")
            .arg(&self.admin)
            .arg("--request-timeout=30s")
            .args(args);
        super::run_limited(&mut c, stdin, Duration::from_secs(90))
    }

    /// The kubectl binary.
    pub fn kubectl_path(&self) -> &Path {
        &self.kubectl
    }
}

/// Namespaces (and their processes) left by runs whose xtask process is gone (killed by a
/// signal, which skips [`Cluster`]'s drop).
fn remove_stale_namespaces() {
    let Ok(list) = host::output(Command::new("ip").args(["netns", "list"])) else {
        return;
    };
    for ns in list.lines().filter_map(|l| l.split_whitespace().next()) {
        let Some(pid) = ns.strip_prefix("kipvs-conf-") else {
            continue;
        };
        if Path::new("/proc").join(pid).exists() {
            continue;
        }
        let pids = host::output(Command::new("ip").args(["netns", "pids", ns])).unwrap_or_default();
        for p in pids.split_whitespace() {
            let _ = Command::new("kill").args(["-9", p]).status();
        }
        let _ = Command::new("ip").args(["netns", "del", ns]).status();
        eprintln!("xtask: conformance: removed the stale namespace {ns}");
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        for (_, c) in self.procs.iter_mut().rev() {
            let _ = c.kill();
            let _ = c.wait();
        }
        let _ = Command::new("ip").args(["netns", "del", &self.ns]).status();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn base64_matches_rfc4648_vectors() {
        for (i, o) in [
            ("", ""),
            ("f", "Zg=="),
            ("fo", "Zm8="),
            ("foo", "Zm9v"),
            ("foob", "Zm9vYg=="),
            ("fooba", "Zm9vYmE="),
            ("foobar", "Zm9vYmFy"),
        ] {
            assert_eq!(base64(i.as_bytes()), o);
        }
    }
}
