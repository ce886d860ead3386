//! `cargo xtask conformance`: upstream's own Service e2e tests on real nodes.
//!
//! A control plane on the host in a network namespace of the run's own ([`cluster`]), one or two
//! node VMs with containerd and the kubelet ([`node`]), images built here and imported under
//! the names the e2e framework asks for ([`images`]), CoreDNS, and the proxy under test running
//! as a pod: kube-ipvs from `deploy/` (`kubectl apply -k` of an overlay that sets only the
//! locally built image, plus `--proxy-mode=iptables` for the iptables run), or upstream
//! kube-proxy the way kubeadm runs it (DaemonSet + `kube-proxy` ConfigMap). Then `e2e.test`
//! ([`run`]) with the Service focus; its JUnit report lands in `target/conformance/<proxy>/`
//! and one summary line per proxy is printed.

pub mod build;
pub mod cluster;
pub mod images;
pub mod node;
pub mod run;

use crate::error::{Context, Error, Result};
use crate::host::{self, Apt};
use crate::kernel;
use cluster::{Cluster, API_PORT, CP_IP, DNS_IP, POD_SUBNET};
use std::fs;
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// The proxies a run can test.
pub const PROXIES: &[&str] = &[
    "kube-ipvs",
    "kube-ipvs-iptables",
    "upstream-ipvs",
    "upstream-nftables",
];

const USAGE: &str = "cargo xtask conformance [--proxy kube-ipvs|kube-ipvs-iptables|upstream-ipvs|upstream-nftables]... \
[--focus REGEX] [--skip REGEX] [--nodes 1|2] [--procs N] [--timeout MINUTES] [--hold SECS] [--list] [--build-only] [--table]";

/// The last `n` lines of `text`.
pub fn tail(text: &str, n: usize) -> String {
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(n)..].join("\n")
}

/// `s` cut to `n` characters.
pub fn clip(s: &str, n: usize) -> String {
    s.chars().take(n).collect()
}

/// Runs `cmd` (stdin fed from `stdin`), killed after `limit`; stdout on success.
pub fn run_limited(cmd: &mut Command, stdin: Option<&str>, limit: Duration) -> Result<String> {
    let shown = host::show(cmd);
    let mut child = cmd
        .stdin(if stdin.is_some() {
            Stdio::piped()
        } else {
            Stdio::null()
        })
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| Error::Command {
            cmd: shown.clone(),
            detail: format!("cannot start: {e}"),
        })?;
    if let (Some(text), Some(mut w)) = (stdin, child.stdin.take()) {
        let text = text.to_string();
        std::thread::spawn(move || {
            let _ = w.write_all(text.as_bytes());
        });
    }
    let mut out_r = child.stdout.take();
    let mut err_r = child.stderr.take();
    let out_t = std::thread::spawn(move || {
        let mut s = String::new();
        if let Some(r) = out_r.as_mut() {
            let _ = r.read_to_string(&mut s);
        }
        s
    });
    let err_t = std::thread::spawn(move || {
        let mut s = String::new();
        if let Some(r) = err_r.as_mut() {
            let _ = r.read_to_string(&mut s);
        }
        s
    });
    let start = Instant::now();
    let status = loop {
        if let Some(st) = child.try_wait().ctx(|| format!("waiting for {shown}"))? {
            break st;
        }
        if start.elapsed() > limit {
            let _ = child.kill();
            let _ = child.wait();
            return Err(Error::Timeout(format!(
                "`{shown}` killed after {} s",
                limit.as_secs()
            )));
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let out = out_t.join().unwrap_or_default();
    let err = err_t.join().unwrap_or_default();
    if status.success() {
        Ok(out)
    } else {
        Err(Error::Command {
            cmd: shown,
            detail: format!("{status}\n{}", tail(&err, 15)),
        })
    }
}

/// Options of one invocation.
#[derive(Debug, Clone)]
pub struct Options {
    /// Proxies to test, in order.
    pub proxies: Vec<String>,
    /// Ginkgo focus.
    pub focus: String,
    /// Ginkgo skip.
    pub skip: String,
    /// Node count.
    pub nodes: u32,
    /// Only list the selected tests.
    pub list: bool,
    /// Parallel e2e processes.
    pub procs: u32,
    /// Ginkgo's suite timeout: when it expires, ginkgo interrupts the running specs, skips
    /// the rest and still writes its report (what ran is kept).
    pub timeout: Duration,
    /// Keep the cluster up this long before running e2e.test (for inspection).
    pub hold: Duration,
    /// Only build binaries and images.
    pub build_only: bool,
    /// Only print the markdown table of the last results.
    pub table: bool,
    /// Only bring the control plane and the nodes up (with the binaries and the pause image
    /// at hand, nothing built), wait for the nodes to be Ready, hold, stop.
    pub up_only: bool,
}

/// Parses the command line.
pub fn parse_args(args: &[String]) -> Result<Options> {
    let mut o = Options {
        proxies: Vec::new(),
        focus: run::DEFAULT_FOCUS.into(),
        skip: run::DEFAULT_SKIP.into(),
        nodes: 1,
        list: false,
        procs: 1,
        timeout: Duration::from_secs(6 * 3600),
        hold: Duration::ZERO,
        build_only: false,
        table: false,
        up_only: false,
    };
    let mut it = args.iter();
    while let Some(a) = it.next() {
        match a.as_str() {
            "--proxy" => {
                let p = crate::value(&mut it, a)?;
                if !PROXIES.contains(&p.as_str()) {
                    return Err(Error::Usage(format!("unknown proxy `{p}`\n{USAGE}")));
                }
                o.proxies.push(p.clone());
            }
            "--focus" => o.focus = crate::value(&mut it, a)?.clone(),
            "--skip" => o.skip = crate::value(&mut it, a)?.clone(),
            "--nodes" => {
                o.nodes = match crate::value(&mut it, a)?.as_str() {
                    "1" => 1,
                    "2" => 2,
                    v => return Err(Error::Usage(format!("--nodes 1|2, not `{v}`"))),
                }
            }
            "--list" => o.list = true,
            "--hold" => {
                o.hold = Duration::from_secs(
                    crate::value(&mut it, a)?
                        .parse()
                        .map_err(|_| Error::Usage("--hold SECS".into()))?,
                )
            }
            "--procs" => {
                o.procs = crate::value(&mut it, a)?
                    .parse()
                    .ok()
                    .filter(|p| (1..=8).contains(p))
                    .ok_or_else(|| Error::Usage("--procs 1..8".into()))?
            }
            "--timeout" => {
                o.timeout = crate::value(&mut it, a)?
                    .parse::<u64>()
                    .ok()
                    .filter(|m| (1..=360).contains(m))
                    .map(|m| Duration::from_secs(m * 60))
                    .ok_or_else(|| Error::Usage("--timeout MINUTES (1..360)".into()))?
            }
            "--build-only" => o.build_only = true,
            "--table" => o.table = true,
            "--up-only" => o.up_only = true,
            _ => return Err(Error::Usage(format!("unknown option `{a}`\n{USAGE}"))),
        }
    }
    if o.proxies.is_empty() {
        o.proxies = vec![
            "kube-ipvs".into(),
            "kube-ipvs-iptables".into(),
            "upstream-ipvs".into(),
        ];
    }
    Ok(o)
}

/// `target/conformance`.
pub fn out_root() -> PathBuf {
    host::target_dir().join("conformance")
}

/// `cargo xtask conformance ...`.
pub fn conformance_cmd(args: &[String]) -> Result<u8> {
    let o = parse_args(args)?;
    let root = out_root();
    if o.table {
        let results: Vec<(&str, Vec<run::Case>)> = o
            .proxies
            .iter()
            .map(|p| (p.as_str(), run::read_results(&root.join(p))))
            .collect();
        print!("{}", run::table(&results));
        return Ok(0);
    }
    if !host::is_root() {
        return Err(Error::NotRoot(
            "the cluster runs in a network namespace".into(),
        ));
    }
    let t0 = Instant::now();
    let mut apt = Apt::default();
    apt.ensure_host_packages()?;
    let missing: Vec<&str> = [
        ("runc", "/usr/sbin/runc"),
        ("containernetworking-plugins", "/usr/lib/cni/bridge"),
        ("netcat-openbsd", "/usr/bin/nc.openbsd"),
        ("dnsutils", "/usr/bin/dig"),
        ("socat", "/usr/bin/socat"),
        ("curl", "/usr/bin/curl"),
        ("wget", "/usr/bin/wget"),
        ("openssl", "/usr/bin/openssl"),
    ]
    .iter()
    .filter(|(_, f)| !Path::new(f).exists())
    .map(|(p, _)| *p)
    .collect();
    if !missing.is_empty() {
        apt.install(&missing)?;
    }
    if o.up_only {
        let (bin, kube_bin) = (build::bin_dir()?, build::control_plane_bin()?);
        let imgs = images::build_pause_only(&root.join("images"), &bin)?;
        let kern = kernel::ensure(&host::cache_dir()?, &mut apt)?;
        let proxy = o.proxies[0].clone();
        return up(
            &proxy,
            &o,
            &root.join(&proxy),
            &bin,
            &kube_bin,
            &imgs,
            &kern,
        )
        .map(|_| 0);
    }
    let (bin, kube_bin) = build::ensure()?;
    let release = build_release()?;
    let images = images::build_all(&root.join("images"), &bin, &kube_bin, &release, &mut apt)?;
    eprintln!(
        "xtask: conformance: binaries and images ready after {:.0} s",
        t0.elapsed().as_secs_f64()
    );
    if o.build_only {
        return Ok(0);
    }
    let cache = host::cache_dir()?;
    let kern = kernel::ensure(&cache, &mut apt)?;
    let mut lines = Vec::new();
    let mut failed = false;
    for proxy in &o.proxies {
        let dir = root.join(proxy);
        let t = Instant::now();
        match run_proxy(proxy, &o, &dir, &bin, &kube_bin, &images, &kern) {
            Ok(cases) => {
                run::write_results(&dir, &cases)?;
                let line = run::summary_line(proxy, &cases);
                eprintln!("xtask: {line} ({:.0} s)", t.elapsed().as_secs_f64());
                failed |= cases.iter().any(|c| c.status == run::Status::Failed);
                lines.push(line);
            }
            Err(e) => {
                eprintln!("xtask: conformance {proxy}: ERROR {e}");
                lines.push(format!(
                    "conformance {proxy}: error: {}",
                    clip(&e.to_string(), 300)
                ));
                failed = true;
            }
        }
    }
    for l in &lines {
        println!("{l}");
    }
    Ok(u8::from(failed))
}

/// `cargo build --release -p kube-ipvs`; the binary's path. `XTASK_KUBE_IPVS_BIN` names another
/// binary instead (a debug build, for a quicker iteration; the image is then not the release's).
fn build_release() -> Result<PathBuf> {
    if let Some(p) = std::env::var_os("XTASK_KUBE_IPVS_BIN") {
        eprintln!(
            "xtask: conformance: kube-ipvs binary from XTASK_KUBE_IPVS_BIN, not the release build"
        );
        return Ok(PathBuf::from(p));
    }
    host::status(
        crate::host::cargo()
            .args([
                "build",
                "--release",
                "--locked",
                "-p",
                "kube-ipvs",
                "--bin",
                "kube-ipvs",
            ])
            .current_dir(host::workspace_root()),
    )?;
    Ok(host::target_dir().join("release/kube-ipvs"))
}

/// Polls `check` every 2 s until it is true; fails after `limit`, or when a node VM ended or a
/// control-plane process exited.
fn wait_for(
    what: &str,
    limit: Duration,
    cluster: &mut Cluster,
    nodes: &[node::Node],
    mut check: impl FnMut(&Cluster) -> bool,
) -> Result<()> {
    let start = Instant::now();
    loop {
        cluster.check_alive()?;
        if let Some(n) = nodes.iter().find(|n| n.ended()) {
            return Err(Error::Command {
                cmd: format!("node-{}", n.n),
                detail: format!(
                    "VM ended while waiting for {what}{}; guest progress:\n{}\n(logs: {})",
                    n.failure().map(|e| format!(" ({e})")).unwrap_or_default(),
                    tail(&n.progress(), 20),
                    n.dir.display()
                ),
            });
        }
        if check(cluster) {
            eprintln!(
                "xtask: conformance: {what} after {:.0} s",
                start.elapsed().as_secs_f64()
            );
            return Ok(());
        }
        if start.elapsed() > limit {
            return Err(Error::Timeout(format!(
                "{what}: not within {} s",
                limit.as_secs()
            )));
        }
        std::thread::sleep(Duration::from_secs(2));
    }
}

/// The `kube-proxy` ConfigMap's `kubeconfig.conf`, as kubeadm writes it: the API server's real
/// address and the pod's ServiceAccount token.
fn kubeadm_proxy_kubeconfig() -> String {
    format!(
        "apiVersion: v1\nkind: Config\nclusters:\n- cluster:\n    certificate-authority: \
         /var/run/secrets/kubernetes.io/serviceaccount/ca.crt\n    server: https://{CP_IP}:{API_PORT}\n  \
         name: default\ncontexts:\n- context:\n    cluster: default\n    namespace: default\n    \
         user: default\n  name: default\ncurrent-context: default\nusers:\n- name: default\n  user:\n    \
         tokenFile: /var/run/secrets/kubernetes.io/serviceaccount/token\n"
    )
}

fn indent(text: &str, n: usize) -> String {
    let pad = " ".repeat(n);
    text.lines().map(|l| format!("{pad}{l}\n")).collect()
}

/// kubeadm's `kube-proxy` ConfigMap (with `mode`), ServiceAccount and binding; with
/// `daemonset`, kubeadm's kube-proxy DaemonSet too. Its `config.conf` is what upstream
/// kube-proxy reads (kube-ipvs reads its own `kube-ipvs` ConfigMap from `deploy/` and takes only
/// `kubeconfig.conf` from this one). `clusterCIDR` is the pod subnet, as kubeadm writes it:
/// kubeadm's `kubeProxyConfig.Default` (cmd/kubeadm/app/componentconfigs/kubeproxy.go) copies
/// `networking.podSubnet` into an empty `clusterCIDR`.
fn kube_proxy_manifests(mode: &str, daemonset: bool) -> String {
    let config = format!(
        "apiVersion: kubeproxy.config.k8s.io/v1alpha1\nkind: KubeProxyConfiguration\nmode: {mode}\n\
         bindAddress: 0.0.0.0\nhealthzBindAddress: 0.0.0.0:10256\nmetricsBindAddress: 127.0.0.1:10249\n\
         clientConnection:\n  kubeconfig: /var/lib/kube-proxy/kubeconfig.conf\nclusterCIDR: {POD_SUBNET}\n\
         ipvs:\n  scheduler: rr\n  syncPeriod: 30s\n  minSyncPeriod: 1s\n\
         iptables:\n  masqueradeBit: 14\n  minSyncPeriod: 1s\n  syncPeriod: 30s\n"
    );
    let mut s = format!(
        "apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: kube-proxy\n  namespace: kube-system\n\
         data:\n  config.conf: |\n{}  kubeconfig.conf: |\n{}---\n\
         apiVersion: v1\nkind: ServiceAccount\nmetadata:\n  name: kube-proxy\n  namespace: kube-system\n---\n\
         apiVersion: rbac.authorization.k8s.io/v1\nkind: ClusterRoleBinding\nmetadata:\n  name: kubeadm:node-proxier\n\
         roleRef:\n  apiGroup: rbac.authorization.k8s.io\n  kind: ClusterRole\n  name: system:node-proxier\n\
         subjects:\n- kind: ServiceAccount\n  name: kube-proxy\n  namespace: kube-system\n",
        indent(&config, 4),
        indent(&kubeadm_proxy_kubeconfig(), 4)
    );
    if daemonset {
        s.push_str(&format!(
            r#"---
apiVersion: apps/v1
kind: DaemonSet
metadata:
  name: kube-proxy
  namespace: kube-system
  labels:
    k8s-app: kube-proxy
spec:
  selector:
    matchLabels:
      k8s-app: kube-proxy
  template:
    metadata:
      labels:
        k8s-app: kube-proxy
    spec:
      serviceAccountName: kube-proxy
      priorityClassName: system-node-critical
      hostNetwork: true
      nodeSelector:
        kubernetes.io/os: linux
      tolerations:
      - operator: Exists
      containers:
      - name: kube-proxy
        image: {image}
        imagePullPolicy: IfNotPresent
        command:
        - /usr/local/bin/kube-proxy
        - --config=/var/lib/kube-proxy/config.conf
        - --hostname-override=$(NODE_NAME)
        env:
        - name: NODE_NAME
          valueFrom:
            fieldRef:
              fieldPath: spec.nodeName
        securityContext:
          privileged: true
        volumeMounts:
        - mountPath: /var/lib/kube-proxy
          name: kube-proxy
        - mountPath: /run/xtables.lock
          name: xtables-lock
        - mountPath: /lib/modules
          name: lib-modules
          readOnly: true
      volumes:
      - name: kube-proxy
        configMap:
          name: kube-proxy
      - name: xtables-lock
        hostPath:
          path: /run/xtables.lock
          type: FileOrCreate
      - name: lib-modules
        hostPath:
          path: /lib/modules
"#,
            image = images::KUBE_PROXY
        ));
    }
    s
}

/// CoreDNS as kubeadm deploys it (one replica), answering only for the cluster domain. The
/// liveness probe is kubeadm's (cmd/kubeadm/app/phases/addons/dns/manifests.go: 5 s timeout,
/// 5 failures): with the kubelet's default 1 s timeout a loaded TCG node fails it, the kubelet
/// kills CoreDNS, and every test that resolves a Service name fails with "Temporary failure in
/// name resolution", whatever the proxy.
fn coredns_manifests() -> String {
    format!(
        r#"apiVersion: v1
kind: ServiceAccount
metadata:
  name: coredns
  namespace: kube-system
---
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRole
metadata:
  name: system:coredns
rules:
- apiGroups: [""]
  resources: [endpoints, services, pods, namespaces]
  verbs: [list, watch]
- apiGroups: [discovery.k8s.io]
  resources: [endpointslices]
  verbs: [list, watch]
---
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRoleBinding
metadata:
  name: system:coredns
roleRef:
  apiGroup: rbac.authorization.k8s.io
  kind: ClusterRole
  name: system:coredns
subjects:
- kind: ServiceAccount
  name: coredns
  namespace: kube-system
---
apiVersion: v1
kind: ConfigMap
metadata:
  name: coredns
  namespace: kube-system
data:
  Corefile: |
    .:53 {{
        errors
        health {{
           lameduck 5s
        }}
        ready
        kubernetes cluster.local in-addr.arpa ip6.arpa {{
           pods insecure
           fallthrough in-addr.arpa ip6.arpa
           ttl 30
        }}
        cache 30
    }}
---
apiVersion: apps/v1
kind: Deployment
metadata:
  name: coredns
  namespace: kube-system
  labels:
    k8s-app: kube-dns
spec:
  replicas: 1
  selector:
    matchLabels:
      k8s-app: kube-dns
  template:
    metadata:
      labels:
        k8s-app: kube-dns
    spec:
      serviceAccountName: coredns
      priorityClassName: system-cluster-critical
      dnsPolicy: Default
      tolerations:
      - operator: Exists
      containers:
      - name: coredns
        image: {image}
        imagePullPolicy: IfNotPresent
        args: ["-conf", "/etc/coredns/Corefile"]
        ports:
        - {{containerPort: 53, name: dns, protocol: UDP}}
        - {{containerPort: 53, name: dns-tcp, protocol: TCP}}
        readinessProbe:
          httpGet: {{path: /ready, port: 8181}}
        livenessProbe:
          httpGet: {{path: /health, port: 8080}}
          initialDelaySeconds: 60
          timeoutSeconds: 5
          successThreshold: 1
          failureThreshold: 5
        securityContext:
          allowPrivilegeEscalation: false
          capabilities:
            add: [NET_BIND_SERVICE]
            drop: [ALL]
          readOnlyRootFilesystem: true
        volumeMounts:
        - name: config-volume
          mountPath: /etc/coredns
          readOnly: true
      volumes:
      - name: config-volume
        configMap:
          name: coredns
---
apiVersion: v1
kind: Service
metadata:
  name: kube-dns
  namespace: kube-system
  labels:
    k8s-app: kube-dns
spec:
  selector:
    k8s-app: kube-dns
  clusterIP: {DNS_IP}
  ports:
  - {{name: dns, port: 53, protocol: UDP}}
  - {{name: dns-tcp, port: 53, protocol: TCP}}
"#,
        image = images::COREDNS
    )
}

/// The overlay over `deploy/`: the locally built image, and for `iptables` the mode flag.
pub fn kube_ipvs_overlay(deploy_rel: &str, iptables: bool) -> String {
    let (name, tag) = images::KUBE_IPVS
        .rsplit_once(':')
        .unwrap_or((images::KUBE_IPVS, "latest"));
    let mut s = format!(
        "apiVersion: kustomize.config.k8s.io/v1beta1\nkind: Kustomization\nresources:\n  - {deploy_rel}\n\
         images:\n  - name: kube-ipvs\n    newName: {name}\n    newTag: {tag}\n"
    );
    if iptables {
        s.push_str(
            "patches:\n  - target:\n      kind: DaemonSet\n      name: kube-ipvs\n    patch: |-\n      \
             - op: add\n        path: /spec/template/spec/containers/0/command/-\n        \
             value: --proxy-mode=iptables\n",
        );
    }
    s
}

/// The control plane and the nodes, up and Ready (with `--up-only`: held, then stopped).
fn up(
    proxy: &str,
    o: &Options,
    dir: &Path,
    bin: &Path,
    kube_bin: &Path,
    imgs: &images::Images,
    kern: &kernel::Kernel,
) -> Result<(Cluster, Vec<node::Node>, Instant)> {
    let t0 = Instant::now();
    let _ = fs::remove_dir_all(dir);
    fs::create_dir_all(dir).ctx(|| format!("creating {}", dir.display()))?;
    let mut cluster = Cluster::start(&dir.join("cluster"), kube_bin, bin, o.nodes)?;
    eprintln!(
        "xtask: conformance {proxy}: control plane ready after {:.0} s (namespace {})",
        t0.elapsed().as_secs_f64(),
        cluster.ns
    );
    let ca = fs::read_to_string(cluster.dir.join("ca.crt")).ctx(|| "reading ca.crt")?;
    let mut inputs = node::NodeInputs {
        bin,
        images: &imgs.archive,
        ca_pem: &ca,
        kernel_modules: &kern.modules,
        release: &kern.release,
        nodes: o.nodes,
        golden: None,
    };
    let golden = if o.up_only {
        None
    } else {
        Some(node::golden_state(&inputs)?)
    };
    inputs.golden = golden.as_deref();
    crate::vm::prepare()?;
    let mut nodes = Vec::new();
    for n in 1..=o.nodes {
        nodes.push(node::Node::start(
            n,
            &dir.join(format!("node-{n}")),
            &cluster.ns,
            &inputs,
        )?);
    }
    let want = o.nodes.to_string();
    wait_for(
        "nodes Ready",
        Duration::from_secs(900),
        &mut cluster,
        &nodes,
        |c| {
            c.kubectl(&[
            "get",
            "nodes",
            "-o",
            "jsonpath={range .items[*]}{.status.conditions[?(@.type==\"Ready\")].status}{\"\\n\"}{end}",
        ])
        .is_ok_and(|s| s.lines().filter(|l| l.trim() == "True").count().to_string() == want)
        },
    )?;
    eprintln!(
        "xtask: conformance {proxy}: {} node(s) Ready after {:.0} s",
        o.nodes,
        t0.elapsed().as_secs_f64()
    );
    Ok((cluster, nodes, t0))
}

/// Keeps the cluster up for `--hold` seconds, printing how to reach it.
fn hold(proxy: &str, o: &Options, cluster: &mut Cluster, nodes: &[node::Node]) -> Result<()> {
    if o.hold.is_zero() {
        return Ok(());
    }
    eprintln!(
        "xtask: conformance {proxy}: holding the cluster for {} s: ip netns exec {} {} --kubeconfig {} get pods -A",
        o.hold.as_secs(),
        cluster.ns,
        cluster.kubectl_path().display(),
        cluster.admin.display()
    );
    let until = Instant::now() + o.hold;
    wait_for(
        "the hold",
        o.hold + Duration::from_secs(10),
        cluster,
        nodes,
        |_| Instant::now() >= until,
    )
}

/// One proxy: control plane, nodes, proxy, DNS, e2e.test; the JUnit cases.
fn run_proxy(
    proxy: &str,
    o: &Options,
    dir: &Path,
    bin: &Path,
    kube_bin: &Path,
    imgs: &images::Images,
    kern: &kernel::Kernel,
) -> Result<Vec<run::Case>> {
    let (mut cluster, nodes, t0) = up(proxy, o, dir, bin, kube_bin, imgs, kern)?;
    let want = o.nodes.to_string();
    // The proxy.
    let (ds, mode) = match proxy {
        "upstream-ipvs" => ("kube-proxy", "ipvs"),
        "upstream-nftables" => ("kube-proxy", "nftables"),
        _ => ("kube-ipvs", "ipvs"),
    };
    cluster.kubectl_stdin(
        &["apply", "-f", "-"],
        Some(&kube_proxy_manifests(mode, ds == "kube-proxy")),
    )?;
    if ds == "kube-ipvs" {
        let overlay = dir.join("overlay");
        fs::create_dir_all(&overlay).ctx(|| "creating the overlay")?;
        let deploy = host::workspace_root().join("deploy");
        let rel = relative(&overlay, &deploy);
        fs::write(
            overlay.join("kustomization.yaml"),
            kube_ipvs_overlay(&rel, proxy == "kube-ipvs-iptables"),
        )
        .ctx(|| "writing the overlay")?;
        cluster.kubectl(&["apply", "-k", &overlay.display().to_string()])?;
    }
    cluster.kubectl_stdin(&["apply", "-f", "-"], Some(&coredns_manifests()))?;
    wait_for(
        &format!("{ds} ready"),
        Duration::from_secs(600),
        &mut cluster,
        &nodes,
        |c| {
            c.kubectl(&[
                "-n",
                "kube-system",
                "get",
                "ds",
                ds,
                "-o",
                "jsonpath={.status.numberReady}",
            ])
            .is_ok_and(|s| s.trim() == want)
        },
    )?;
    wait_for(
        "CoreDNS ready",
        Duration::from_secs(600),
        &mut cluster,
        &nodes,
        |c| {
            c.kubectl(&[
                "-n",
                "kube-system",
                "get",
                "deploy",
                "coredns",
                "-o",
                "jsonpath={.status.readyReplicas}",
            ])
            .is_ok_and(|s| s.trim() == "1")
        },
    )?;
    eprintln!(
        "xtask: conformance {proxy}: {ds} and CoreDNS ready after {:.0} s",
        t0.elapsed().as_secs_f64()
    );
    hold(proxy, o, &mut cluster, &nodes)?;
    let skip = run::skip_for_nodes(&o.skip, o.nodes);
    let e = run::E2e {
        exe: &bin.join("e2e.test"),
        kubectl: cluster.kubectl_path(),
        kubeconfig: &cluster.admin,
        report_dir: dir,
        focus: &o.focus,
        skip: &skip,
        nodes: o.nodes,
        dry_run: o.list,
        procs: o.procs,
        timeout: o.timeout,
        ginkgo: &bin.join("ginkgo"),
    };
    let result = run::run_e2e(&cluster.ns, &e, o.timeout + Duration::from_secs(600));
    save_proxy_logs(&cluster, ds, dir);
    for n in nodes {
        let _ = n.stop();
    }
    drop(cluster);
    if o.list {
        let log = fs::read_to_string(dir.join("e2e.log")).unwrap_or_default();
        for l in log.lines().filter(|l| l.contains("[sig-network]")) {
            println!("{}", l.trim());
        }
    }
    result
}

/// The proxy's logs, for the record: one file per node, `<ds>-<node>.log`, and
/// `<ds>-<node>.previous.log` for a pod whose container restarted (its log before the restart,
/// which is where a crash or a failed probe shows).
fn save_proxy_logs(cluster: &Cluster, ds: &str, dir: &Path) {
    let Ok(pods) = cluster.kubectl(&[
        "-n",
        "kube-system",
        "get",
        "pods",
        "-l",
        &format!("k8s-app={ds}"),
        "-o",
        "jsonpath={range .items[*]}{.metadata.name} {.spec.nodeName} {.status.containerStatuses[0].restartCount}{\"\\n\"}{end}",
    ]) else {
        eprintln!("xtask: conformance: could not list the {ds} pods for their logs");
        return;
    };
    for (pod, node, restarts) in proxy_pods(&pods) {
        let save = |previous: bool, name: String| {
            let mut args = vec!["-n", "kube-system", "logs", pod, "--tail=-1"];
            if previous {
                args.push("--previous");
            }
            if let Ok(logs) = cluster.kubectl(&args) {
                let _ = fs::write(dir.join(name), logs);
            }
        };
        save(false, format!("{ds}-{node}.log"));
        if restarts > 0 {
            save(true, format!("{ds}-{node}.previous.log"));
        }
    }
}

/// `name node restarts` lines (the jsonpath in [`save_proxy_logs`]) → (pod, node, restarts);
/// a pod not yet scheduled or without a container status counts no restart.
fn proxy_pods(list: &str) -> Vec<(&str, &str, u32)> {
    list.lines()
        .filter_map(|l| {
            let mut f = l.split_whitespace();
            let pod = f.next()?;
            let node = f.next().unwrap_or("unscheduled");
            let restarts = f.next().and_then(|r| r.parse().ok()).unwrap_or(0);
            Some((pod, node, restarts))
        })
        .collect()
}

/// `to` relative to `from` (both absolute), for kustomize (which wants relative paths).
pub fn relative(from: &Path, to: &Path) -> String {
    let f: Vec<_> = from.components().collect();
    let t: Vec<_> = to.components().collect();
    let common = f.iter().zip(&t).take_while(|(a, b)| a == b).count();
    let mut parts: Vec<String> = vec!["..".into(); f.len() - common];
    parts.extend(
        t[common..]
            .iter()
            .map(|c| c.as_os_str().to_string_lossy().into_owned()),
    );
    parts.join("/")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn proxy_pods_from_the_listing() {
        let list = "kube-ipvs-7xk2p node-1 0\nkube-ipvs-q9zrd node-2 2\nkube-ipvs-pending\n\n";
        assert_eq!(
            proxy_pods(list),
            vec![
                ("kube-ipvs-7xk2p", "node-1", 0),
                ("kube-ipvs-q9zrd", "node-2", 2),
                ("kube-ipvs-pending", "unscheduled", 0),
            ]
        );
    }

    #[test]
    fn relative_paths_for_kustomize() {
        assert_eq!(
            relative(
                Path::new("/w/target/conformance/kube-ipvs/overlay"),
                Path::new("/w/deploy")
            ),
            "../../../../deploy"
        );
    }

    #[test]
    fn overlay_sets_only_the_image_unless_iptables() {
        let o = kube_ipvs_overlay("../deploy", false);
        assert!(
            o.contains("newName: localhost/kube-ipvs\n    newTag: conformance\n"),
            "{o}"
        );
        assert!(!o.contains("patches"), "{o}");
        assert!(kube_ipvs_overlay("../deploy", true).contains("--proxy-mode=iptables"));
    }

    #[test]
    fn upstream_kube_proxy_gets_the_pod_subnet_as_kubeadm_writes_it() {
        let m = kube_proxy_manifests("ipvs", true);
        assert!(m.contains("    clusterCIDR: 10.244.0.0/16\n"), "{m}");
        assert!(m.contains("    mode: ipvs\n"), "{m}");
        assert!(!m.contains("clusterCIDR: \"\""), "{m}");
    }

    #[test]
    fn coredns_liveness_probe_is_kubeadms() {
        let m = coredns_manifests();
        let probe = &m[m.find("livenessProbe:").unwrap()..m.find("securityContext:").unwrap()];
        assert!(probe.contains("timeoutSeconds: 5\n"), "{probe}");
        assert!(probe.contains("failureThreshold: 5\n"), "{probe}");
        assert!(probe.contains("initialDelaySeconds: 60\n"), "{probe}");
    }

    #[test]
    fn args_default_to_the_three_proxies() {
        let o = parse_args(&[]).unwrap();
        assert_eq!(
            o.proxies,
            ["kube-ipvs", "kube-ipvs-iptables", "upstream-ipvs"]
        );
        assert!(parse_args(&["--proxy".into(), "nope".into()]).is_err());
        assert!(parse_args(&["--nodes".into(), "3".into()]).is_err());
        assert_eq!(o.timeout, Duration::from_secs(6 * 3600));
        let t = parse_args(&["--timeout".into(), "75".into()]).unwrap();
        assert_eq!(t.timeout, Duration::from_secs(75 * 60));
        assert!(parse_args(&["--timeout".into(), "0".into()]).is_err());
    }
}
