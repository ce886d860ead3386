//! Benchmark driver for `cargo xtask bench daemon` (and the `vm_daemon_bench_smoke` test): runs
//! the real `kube-ipvs` binary against the kernel of a fresh network namespace, fed by the fake
//! API server or by `--source-dir`, and `ipvsadm --restore` of the identical table as the
//! reference.
//!
//! Usage (root, IPVS, `ip`, `ipvsadm`, `ipset`, `iptables` in PATH):
//!
//! ```text
//! daemon-bench prepare DIR SERVICES REALS KUBE_IPVS
//!     writes DIR/objects (one Node, SERVICES Service files and SERVICES EndpointSlice files with
//!     REALS ready endpoints each) and DIR/expected.txt (`kube-ipvs plan --section ipvs`)
//! daemon-bench restore DIR
//!     the reference: `ipvsadm --restore` of DIR/expected.txt in a fresh namespace (checked
//!     with `ipvsadm -Sn` afterwards, untimed)
//! daemon-bench daemon api|dir DIR KUBE_IPVS [CHANGES]
//!     the daemon in a fresh namespace, from the fake API server (loaded with DIR/objects) or
//!     from `--source-dir DIR/objects`: start → converged, CHANGES one-endpoint changes, RSS,
//!     processes spawned
//! ```
//!
//! Each command prints human lines and one `BENCH-JSON {...}` line.
//!
//! How things are measured:
//! - converged: `/metrics` polled every 50 ms until `kube_ipvs_ipvs_services` and
//!   `kube_ipvs_ipvs_destinations` reach the table's counts, then the kernel's table (one IPVS
//!   netlink dump, rendered like `ipvsadm -Sn`) must equal DIR/expected.txt line for line; if it
//!   does not yet, the dump is repeated until it does (the time is the first equal read).
//! - one change: one EndpointSlice's first endpoint replaced (an API update, or the slice's file
//!   rewritten: temp file + rename); detected by reading that virtual server's real servers over
//!   IPVS netlink every millisecond until the new one is there with a weight and the old one is
//!   gone or at weight 0. Its cost: the delta of `kube_ipvs_ipvs_requests_total` (after the
//!   sync's timestamp moved past the change) and the processes it spawned.
//! - processes: BSD process accounting (`acct(2)`, v3 records carry the parent pid) in a tmpfs
//!   file: every process whose parent chain leads to the daemon, named by its command (15
//!   characters). The start's count is taken once no process has ended for a second after
//!   convergence (so it includes the handover check after the first sync).
//! - RSS: `VmRSS` (steady, after the changes and a pause; split into `RssAnon`, the heap and
//!   stacks, and `RssFile` + `RssShmem`, the mapped pages of the binary and its libraries: in the VM
//!   they live in the initramfs, which is shared memory) and `VmHWM` (peak).

use std::collections::{BTreeMap, BTreeSet};
use std::io::{Read, Write};
use std::net::{IpAddr, Ipv4Addr, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitCode, Stdio};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use ipvs_netlink::{Protocol, ServiceKey};
use k8s_openapi::api::discovery::v1::EndpointSlice;
use serde_json::{json, Value};
use testkit::apiserver::FakeApiServer;
use testkit::bench::proc_status_kb as status_kb;

/// What can go wrong; every error ends the run.
#[derive(Debug, thiserror::Error)]
enum BenchError {
    #[error("usage: {0}")]
    Usage(String),
    #[error("{what}: {source}")]
    Io {
        what: String,
        source: std::io::Error,
    },
    #[error(transparent)]
    Run(#[from] testkit::bench::CommandError),
    #[error("IPVS: {0}")]
    Ipvs(#[from] ipvs_netlink::Error),
    #[error("fake API server: {0}")]
    Api(String),
    #[error("{0}")]
    Check(String),
    #[error("system call: {0}")]
    Sys(#[from] nix::Error),
}

type Res<T> = Result<T, BenchError>;

fn io<E: Into<std::io::Error>>(what: impl Into<String>) -> impl FnOnce(E) -> BenchError {
    let what = what.into();
    move |e| BenchError::Io {
        what,
        source: e.into(),
    }
}

const NODE: &str = "node-1";
const METRICS_PORT: u16 = 10249;
/// Longest wait for convergence or one change (only against a hang; nothing is judged).
const DEADLINE: Duration = Duration::from_secs(1200);

// ---------------------------------------------------------------------------------------------
// Generated objects

/// `10.96.x.y` for service `i`.
fn cluster_ip(i: usize) -> Ipv4Addr {
    Ipv4Addr::new(
        10,
        96 + (i / 65536) as u8,
        ((i / 256) % 256) as u8,
        (i % 256) as u8,
    )
}

fn endpoint(n: usize) -> Ipv4Addr {
    Ipv4Addr::new(
        10,
        244 + ((n / 65536) % 8) as u8,
        ((n / 256) % 256) as u8,
        (n % 256) as u8,
    )
}

/// The address change `k` puts in place of an endpoint (outside the generated range).
fn replacement(k: usize) -> Ipv4Addr {
    Ipv4Addr::new(10, 253, ((k / 256) % 256) as u8, (k % 256) as u8)
}

fn node_yaml() -> String {
    format!(
        "apiVersion: v1\nkind: Node\nmetadata:\n  name: {NODE}\n  labels:\n    kubernetes.io/hostname: {NODE}\nstatus:\n  addresses:\n  - type: InternalIP\n    address: 192.168.0.10\n  - type: Hostname\n    address: {NODE}\n"
    )
}

fn service_yaml(i: usize) -> String {
    format!(
        "apiVersion: v1\nkind: Service\nmetadata:\n  name: svc-{i}\n  namespace: bench\nspec:\n  type: ClusterIP\n  clusterIP: {ip}\n  clusterIPs:\n  - {ip}\n  selector:\n    app: svc-{i}\n  ports:\n  - name: http\n    port: 80\n    protocol: TCP\n    targetPort: 8080\n",
        ip = cluster_ip(i)
    )
}

fn slice_yaml(i: usize, addrs: &[Ipv4Addr]) -> String {
    let mut s = format!(
        "apiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata:\n  name: svc-{i}-abcde\n  namespace: bench\n  labels:\n    kubernetes.io/service-name: svc-{i}\n    endpointslice.kubernetes.io/managed-by: endpointslice-controller.k8s.io\naddressType: IPv4\nports:\n- name: http\n  port: 8080\n  protocol: TCP\nendpoints:\n"
    );
    for (r, a) in addrs.iter().enumerate() {
        s.push_str(&format!(
            "- addresses:\n  - {a}\n  conditions:\n    ready: true\n    serving: true\n    terminating: false\n  nodeName: node-{}\n  targetRef:\n    kind: Pod\n    name: svc-{i}-pod-{r}\n    namespace: bench\n",
            r % 3
        ));
    }
    s
}

fn endpoints_of(i: usize, m: usize) -> Vec<Ipv4Addr> {
    (0..m).map(|r| endpoint(i * m + r)).collect()
}

fn write_atomic(dir: &Path, name: &str, text: &str) -> Res<()> {
    let tmp = dir.join(format!(".{name}.tmp"));
    std::fs::write(&tmp, text).map_err(io(format!("writing {}", tmp.display())))?;
    std::fs::rename(&tmp, dir.join(name)).map_err(io(format!("renaming {}", tmp.display())))
}

fn slice_file(i: usize) -> String {
    format!("svc-{i:05}-slice.yaml")
}

// ---------------------------------------------------------------------------------------------
// Environment

/// Moves this process (still single-threaded) into a new network namespace with `lo` up and a
/// node address with a default route (what a node has; the kernel needs a route for proxy ARP
/// and MASQUERADE). Children inherit it; it goes away with the last of them.
fn fresh_netns() -> Res<()> {
    nix::sched::unshare(nix::sched::CloneFlags::CLONE_NEWNET)?;
    for args in [
        &["link", "set", "lo", "up"][..],
        &["link", "add", "node0", "type", "dummy"],
        &["addr", "add", "192.168.0.10/24", "dev", "node0"],
        &["link", "set", "node0", "up"],
        &["route", "add", "default", "via", "192.168.0.1"],
    ] {
        run_cmd("ip", args, None)?;
    }
    Ok(())
}

/// Runs a command, optionally feeding stdin; returns (elapsed, stdout).
fn run_cmd(prog: &str, args: &[&str], stdin: Option<&str>) -> Res<(Duration, String)> {
    Ok(testkit::bench::run_cmd(prog, args, stdin)?)
}

fn secs(d: Duration) -> f64 {
    d.as_secs_f64()
}

fn unix_now() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs_f64())
        .unwrap_or(0.0)
}

fn ipvs_dump_text(client: &mut ipvs_netlink::Client) -> Res<String> {
    Ok(ipvs_netlink::savefmt::render(&client.dump()?))
}

// ---------------------------------------------------------------------------------------------
// Process accounting

/// BSD process accounting into a tmpfs file (the kernel suspends accounting on a file system
/// that reports no free blocks, like the initramfs root).
struct Acct {
    path: PathBuf,
}

/// One `struct acct_v3` record.
#[derive(Debug, Clone)]
struct AcctRecord {
    pid: u32,
    ppid: u32,
    comm: String,
}

impl Acct {
    fn start() -> Res<Acct> {
        let path = PathBuf::from(format!("/run/daemon-bench-acct-{}", std::process::id()));
        std::fs::write(&path, b"").map_err(io(format!("creating {}", path.display())))?;
        nix::unistd::acct::enable(&path)?;
        Ok(Acct { path })
    }

    /// Every record written so far.
    fn records(&self) -> Vec<AcctRecord> {
        let bytes = std::fs::read(&self.path).unwrap_or_default();
        bytes
            .chunks_exact(64)
            .filter(|r| r[1] & 0x0f == 3)
            .map(|r| {
                let u = |o: usize| u32::from_le_bytes([r[o], r[o + 1], r[o + 2], r[o + 3]]);
                let comm = &r[48..64];
                let end = comm.iter().position(|&b| b == 0).unwrap_or(comm.len());
                AcctRecord {
                    pid: u(16),
                    ppid: u(20),
                    comm: String::from_utf8_lossy(&comm[..end]).into_owned(),
                }
            })
            .collect()
    }
}

impl Drop for Acct {
    fn drop(&mut self) {
        let _ = nix::unistd::acct::disable();
        let _ = std::fs::remove_file(&self.path);
    }
}

/// The records (from index `from` on) of processes descending from `root`, counted by command.
fn descendants(records: &[AcctRecord], from: usize, root: u32) -> (u64, BTreeMap<String, u64>) {
    let mut family: BTreeSet<u32> = BTreeSet::from([root]);
    // Children exit before their parents are recorded, so walk until nothing changes.
    loop {
        let before = family.len();
        for r in records {
            if family.contains(&r.ppid) {
                family.insert(r.pid);
            }
        }
        if family.len() == before {
            break;
        }
    }
    let mut by_name = BTreeMap::new();
    let mut total = 0;
    for r in records.iter().skip(from) {
        if r.pid != root && family.contains(&r.ppid) {
            total += 1;
            *by_name.entry(r.comm.clone()).or_insert(0) += 1;
        }
    }
    (total, by_name)
}

// ---------------------------------------------------------------------------------------------
// Metrics

fn http_get(port: u16, path: &str) -> Option<String> {
    let mut s = TcpStream::connect((Ipv4Addr::LOCALHOST, port)).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(30))).ok()?;
    s.write_all(format!("GET {path} HTTP/1.0\r\nHost: localhost\r\n\r\n").as_bytes())
        .ok()?;
    let mut buf = String::new();
    s.read_to_string(&mut buf).ok()?;
    let (head, body) = buf.split_once("\r\n\r\n")?;
    head.starts_with("HTTP/1.")
        .then_some(())
        .filter(|()| head.contains(" 200 "))?;
    Some(body.to_string())
}

/// Sum of the samples of `name` (any labels) in a Prometheus text body.
fn metric(body: &str, name: &str) -> f64 {
    body.lines()
        .filter(|l| {
            l.strip_prefix(name)
                .is_some_and(|r| r.starts_with(' ') || r.starts_with('{'))
        })
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// `kube_ipvs_ipvs_requests_total` by `op`.
fn ipvs_requests(body: &str) -> BTreeMap<String, f64> {
    let mut m = BTreeMap::new();
    for l in body.lines() {
        let Some(rest) = l.strip_prefix("kube_ipvs_ipvs_requests_total{op=\"") else {
            continue;
        };
        let Some((op, tail)) = rest.split_once('"') else {
            continue;
        };
        if let Some(v) = tail.rsplit(' ').next().and_then(|v| v.parse::<f64>().ok()) {
            m.insert(op.to_string(), v);
        }
    }
    m
}

fn requests_delta(a: &BTreeMap<String, f64>, b: &BTreeMap<String, f64>) -> (u64, Value) {
    let mut total = 0.0;
    let mut by = serde_json::Map::new();
    for (op, v) in b {
        let d = v - a.get(op).copied().unwrap_or(0.0);
        if d > 0.0 {
            total += d;
            by.insert(op.clone(), json!(d as u64));
        }
    }
    (total as u64, Value::Object(by))
}

// ---------------------------------------------------------------------------------------------
// Commands

fn read_counts(dir: &Path) -> Res<(usize, usize)> {
    let text = std::fs::read_to_string(dir.join("size")).map_err(io("reading size"))?;
    let mut it = text.split_whitespace().map(str::parse::<usize>);
    match (it.next(), it.next()) {
        (Some(Ok(n)), Some(Ok(m))) => Ok((n, m)),
        _ => Err(BenchError::Check(format!("bad size file: {text:?}"))),
    }
}

fn prepare(dir: &Path, n: usize, m: usize, bin: &str) -> Res<Value> {
    fresh_netns()?;
    let objects = dir.join("objects");
    let _ = std::fs::remove_dir_all(&objects);
    std::fs::create_dir_all(&objects).map_err(io("creating the objects directory"))?;
    write_atomic(&objects, "00-node.yaml", &node_yaml())?;
    for i in 0..n {
        write_atomic(&objects, &format!("svc-{i:05}.yaml"), &service_yaml(i))?;
        write_atomic(
            &objects,
            &slice_file(i),
            &slice_yaml(i, &endpoints_of(i, m)),
        )?;
    }
    std::fs::write(dir.join("size"), format!("{n} {m}\n")).map_err(io("writing size"))?;
    let obj = objects.to_string_lossy().into_owned();
    let (t, plan) = run_cmd(
        bin,
        &[
            "--source-dir",
            &obj,
            "--hostname-override",
            NODE,
            "plan",
            "--section",
            "ipvs",
        ],
        None,
    )?;
    let lines = plan.lines().count();
    if lines != n * (m + 1) {
        return Err(BenchError::Check(format!(
            "plan has {lines} lines, expected {} (N x (M + 1))",
            n * (m + 1)
        )));
    }
    std::fs::write(dir.join("expected.txt"), &plan).map_err(io("writing expected.txt"))?;
    println!(
        "prepared {n} services x {m} endpoints: {} files; plan {lines} lines in {:.2} s",
        2 * n + 1,
        secs(t)
    );
    Ok(json!({"kind": "prepare", "services": n, "reals": m, "plan_s": secs(t), "lines": lines}))
}

fn restore(dir: &Path) -> Res<Value> {
    let (n, m) = read_counts(dir)?;
    let expected =
        std::fs::read_to_string(dir.join("expected.txt")).map_err(io("reading expected.txt"))?;
    fresh_netns()?;
    let (t, _) = run_cmd("ipvsadm", &["--restore"], Some(&expected))?;
    let (_, again) = run_cmd("ipvsadm", &["-Sn"], None)?;
    let same = again == expected;
    run_cmd("ipvsadm", &["-C"], None)?;
    if !same {
        return Err(BenchError::Check(
            "ipvsadm -Sn after ipvsadm --restore differs from the plan".into(),
        ));
    }
    println!(
        "ipvsadm --restore of {n} x {m} ({} lines): {:.3} s",
        expected.lines().count(),
        secs(t)
    );
    Ok(json!({"kind": "restore", "services": n, "reals": m, "restore_s": secs(t)}))
}

/// The daemon under test, killed on drop.
struct Daemon {
    child: Child,
    log: PathBuf,
}

impl Daemon {
    fn pid(&self) -> u32 {
        self.child.id()
    }

    fn log_tail(&self) -> String {
        let text = std::fs::read_to_string(&self.log).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(30)..].join("\n")
    }

    fn alive(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(None))
    }

    fn stop(&mut self) -> Res<()> {
        let pid = nix::unistd::Pid::from_raw(self.child.id() as i32);
        nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM)?;
        self.child.wait().map_err(io("waiting for the daemon"))?;
        Ok(())
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn service_key(i: usize) -> ServiceKey {
    ServiceKey::Inet {
        protocol: Protocol::Tcp,
        addr: IpAddr::V4(cluster_ip(i)),
        port: 80,
    }
}

/// Whether the kernel shows the change: `new` with a weight, `old` gone or at weight 0.
fn change_visible(
    client: &mut ipvs_netlink::Client,
    key: &ServiceKey,
    old: Ipv4Addr,
    new: Ipv4Addr,
) -> Res<bool> {
    let dests = client.destinations(key)?;
    let has_new = dests
        .iter()
        .any(|d| d.addr == IpAddr::V4(new) && d.weight > 0);
    let old_live = dests
        .iter()
        .any(|d| d.addr == IpAddr::V4(old) && d.weight > 0);
    Ok(has_new && !old_live)
}

fn median(mut v: Vec<f64>) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn daemon_run(source: &str, dir: &Path, bin: &str, changes: usize) -> Res<Value> {
    let (n, m) = read_counts(dir)?;
    let expected =
        std::fs::read_to_string(dir.join("expected.txt")).map_err(io("reading expected.txt"))?;
    let objects = dir.join("objects");
    fresh_netns()?;
    // Threads from here on (the fake API server's runtime) inherit the namespace.
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .map_err(io("tokio runtime"))?;
    let api = match source {
        "api" => {
            let api = rt
                .block_on(FakeApiServer::start())
                .map_err(|e| BenchError::Api(e.to_string()))?;
            let loaded = api
                .load_dir(&objects)
                .map_err(|e| BenchError::Api(e.to_string()))?;
            if loaded != 2 * n + 1 {
                return Err(BenchError::Check(format!(
                    "the fake API server loaded {loaded} objects, expected {}",
                    2 * n + 1
                )));
            }
            api.write_kubeconfig(dir.join("kubeconfig"))
                .map_err(|e| BenchError::Api(e.to_string()))?;
            Some(api)
        }
        "dir" => None,
        other => return Err(BenchError::Usage(format!("unknown source {other}"))),
    };
    let mut client = ipvs_netlink::Client::new()?;
    let acct = Acct::start()?;
    let log = dir.join(format!("daemon-{source}.log"));
    let log_file = std::fs::File::create(&log).map_err(io("creating the daemon log"))?;
    let mut cmd = Command::new(bin);
    match source {
        "api" => cmd.arg("--kubeconfig").arg(dir.join("kubeconfig")),
        _ => cmd.arg("--source-dir").arg(&objects),
    };
    cmd.args(["--hostname-override", NODE])
        .args([
            "--metrics-bind-address",
            &format!("127.0.0.1:{METRICS_PORT}"),
        ])
        .args(["--healthz-bind-address", "127.0.0.1:10256"])
        .arg("--ipvs-fallback=false")
        // nf_conntrack_max is read-only in a namespace (kind sets this too).
        .arg("--conntrack-max-per-core=0")
        .env_remove("RUST_LOG")
        .env_remove("KUBECONFIG")
        .stdout(Stdio::null())
        .stderr(Stdio::from(log_file));
    let start_unix = unix_now();
    let start = Instant::now();
    let child = cmd.spawn().map_err(io(format!("starting {bin}")))?;
    let mut daemon = Daemon { child, log };
    let pid = daemon.pid();

    // Start → the metrics show the full table → the kernel's table equals the plan.
    let want_dests = (n * m) as f64;
    let counted = loop {
        if !daemon.alive() {
            return Err(BenchError::Check(format!(
                "the daemon exited:\n{}",
                daemon.log_tail()
            )));
        }
        if start.elapsed() > DEADLINE {
            return Err(BenchError::Check(format!(
                "not converged after {DEADLINE:?}:\n{}",
                daemon.log_tail()
            )));
        }
        if let Some(body) = http_get(METRICS_PORT, "/metrics") {
            if metric(&body, "kube_ipvs_ipvs_services") >= n as f64
                && metric(&body, "kube_ipvs_ipvs_destinations") >= want_dests
            {
                break start.elapsed();
            }
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let mut dumps = 0;
    let converged = loop {
        dumps += 1;
        let at = start.elapsed();
        let text = ipvs_dump_text(&mut client)?;
        if text == expected {
            break at;
        }
        if start.elapsed() > DEADLINE {
            let diff: Vec<String> = text
                .lines()
                .filter(|l| !expected.contains(l))
                .take(5)
                .map(str::to_string)
                .collect();
            return Err(BenchError::Check(format!(
                "the kernel never held the planned table ({} lines vs {}; e.g. {diff:?})",
                text.lines().count(),
                expected.lines().count()
            )));
        }
        std::thread::sleep(Duration::from_millis(200));
    };
    // The first sync's own end (its timestamp metric), then let it settle.
    let mut body = String::new();
    while start.elapsed() < DEADLINE {
        body = http_get(METRICS_PORT, "/metrics").unwrap_or_default();
        if metric(&body, "kubeproxy_sync_proxy_rules_last_timestamp_seconds") > 0.0 {
            break;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let first_sync_done = metric(&body, "kubeproxy_sync_proxy_rules_last_timestamp_seconds");
    // The start's processes include the handover check after the first sync: wait until no
    // process has ended for a second (at most 30 s).
    let quiet_from = Instant::now();
    let mut seen = acct.records().len();
    let mut quiet = Instant::now();
    while quiet.elapsed() < Duration::from_secs(1) && quiet_from.elapsed() < Duration::from_secs(30)
    {
        std::thread::sleep(Duration::from_millis(250));
        let now = acct.records().len();
        if now != seen {
            seen = now;
            quiet = Instant::now();
        }
    }
    let rss_converged = status_kb(pid, "VmRSS");
    let records = acct.records();
    let (start_procs, start_by_name) = descendants(&records, 0, pid);
    println!(
        "{source}: {n} x {m}: converged after {:.3} s (metrics {:.3} s, {dumps} dump(s)); first sync done at {:.3} s; {start_procs} processes {start_by_name:?}",
        secs(converged),
        secs(counted),
        first_sync_done - start_unix
    );

    // One endpoint change at a time.
    let mut rows = Vec::new();
    for k in 0..changes {
        // Spread over the table; the sync loop's minimum interval has passed (1.5 s apart).
        let i = (k * 7919 + n / 2) % n;
        let mut addrs = endpoints_of(i, m);
        let old = addrs[0];
        let new = replacement(k);
        addrs[0] = new;
        let key = service_key(i);
        let before_body = http_get(METRICS_PORT, "/metrics").unwrap_or_default();
        let before_req = ipvs_requests(&before_body);
        let before_records = acct.records().len();
        let t0_unix = unix_now();
        let t0 = Instant::now();
        match &api {
            Some(api) => {
                let name = format!("svc-{i}-abcde");
                let mut s: EndpointSlice = api
                    .get("bench", &name)
                    .ok_or_else(|| BenchError::Api(format!("no slice {name}")))?;
                if let Some(ep) = s.endpoints.first_mut() {
                    ep.addresses = vec![new.to_string()];
                }
                api.update(&s).map_err(|e| BenchError::Api(e.to_string()))?;
            }
            None => write_atomic(&objects, &slice_file(i), &slice_yaml(i, &addrs))?,
        }
        let mut polls = 0u64;
        let wall = loop {
            polls += 1;
            if change_visible(&mut client, &key, old, new)? {
                break t0.elapsed();
            }
            if t0.elapsed() > DEADLINE {
                return Err(BenchError::Check(format!(
                    "change {k} never reached the kernel:\n{}",
                    daemon.log_tail()
                )));
            }
            std::thread::sleep(Duration::from_millis(1));
        };
        // The sync that carried it has ended once its timestamp passed the change.
        let mut after_body = String::new();
        while t0.elapsed() < DEADLINE {
            after_body = http_get(METRICS_PORT, "/metrics").unwrap_or_default();
            if metric(
                &after_body,
                "kubeproxy_sync_proxy_rules_last_timestamp_seconds",
            ) >= t0_unix
            {
                break;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        std::thread::sleep(Duration::from_millis(300));
        let after_body = http_get(METRICS_PORT, "/metrics").unwrap_or(after_body);
        let (reqs, by_op) = requests_delta(&before_req, &ipvs_requests(&after_body));
        let (procs, procs_by) = descendants(&acct.records(), before_records, pid);
        println!(
            "{source}: change {k} (service {i}): {:.1} ms to the kernel ({polls} reads), {reqs} IPVS requests {by_op}, {procs} processes {procs_by:?}",
            wall.as_secs_f64() * 1000.0
        );
        // A sync that also read a slice of the periodic drift check (real servers of up to 64
        // virtual servers each) carried more than the change's requests; such changes are
        // marked.
        let during_resync = by_op["get_dest"].as_u64().unwrap_or(0) > 2;
        rows.push(json!({
            "service": i, "wall_s": secs(wall), "ipvs_requests": reqs, "ipvs_by_op": by_op,
            "processes": procs, "processes_by_name": procs_by, "during_full_resync": during_resync,
        }));
        let spent = t0.elapsed();
        if spent < Duration::from_millis(1500) {
            std::thread::sleep(Duration::from_millis(1500) - spent);
        }
    }
    std::thread::sleep(Duration::from_secs(2));
    let rss_steady = status_kb(pid, "VmRSS");
    let rss_peak = status_kb(pid, "VmHWM");
    // Where the steady RSS is: heap and stacks (anonymous) or the binary's and libraries' pages.
    let rss_anon = status_kb(pid, "RssAnon");
    let rss_file = status_kb(pid, "RssFile") + status_kb(pid, "RssShmem");
    let walls: Vec<f64> = rows.iter().filter_map(|r| r["wall_s"].as_f64()).collect();
    let reqs: Vec<f64> = rows
        .iter()
        .filter_map(|r| r["ipvs_requests"].as_f64())
        .collect();
    let change_procs: u64 = rows.iter().filter_map(|r| r["processes"].as_u64()).sum();
    daemon.stop()?;
    // The daemon's own account of its start (what took the time), for the reader.
    for l in std::fs::read_to_string(&daemon.log)
        .unwrap_or_default()
        .lines()
        .take(40)
    {
        println!("{source} log: {l}");
    }
    let final_records = acct.records();
    drop(acct);
    client.flush()?;
    println!(
        "{source}: RSS steady {:.1} MiB (anonymous {:.1}, file {:.1}), peak {:.1} MiB ({} bytes/service)",
        rss_steady as f64 / 1024.0,
        rss_anon as f64 / 1024.0,
        rss_file as f64 / 1024.0,
        rss_peak as f64 / 1024.0,
        rss_steady * 1024 / n.max(1) as u64
    );
    let (all_procs, _) = descendants(&final_records, 0, pid);
    Ok(json!({
        "kind": "daemon",
        "source": source,
        "services": n,
        "reals": m,
        "converge_s": secs(converged),
        "metrics_converge_s": secs(counted),
        "first_sync_done_s": first_sync_done - start_unix,
        "verify_dumps": dumps,
        "verified_lines": expected.lines().count(),
        "start_processes": start_procs,
        "start_processes_by_name": start_by_name,
        "changes": rows,
        "change_median_s": median(walls.clone()),
        "change_min_s": walls.iter().copied().fold(f64::INFINITY, f64::min),
        "change_max_s": walls.iter().copied().fold(0.0, f64::max),
        "change_requests_median": median(reqs.clone()),
        "change_requests_max": reqs.iter().copied().fold(0.0, f64::max),
        "change_processes": change_procs,
        "rss_converged_kb": rss_converged,
        "rss_steady_kb": rss_steady,
        "rss_peak_kb": rss_peak,
        "rss_steady_anon_kb": rss_anon,
        "rss_steady_file_kb": rss_file,
        "bytes_per_service": rss_steady * 1024 / n.max(1) as u64,
        "processes_total": all_procs,
    }))
}

fn usage() -> BenchError {
    BenchError::Usage(
        "daemon-bench prepare DIR SERVICES REALS KUBE_IPVS | restore DIR | daemon api|dir DIR KUBE_IPVS [CHANGES]"
            .into(),
    )
}

fn num(s: &str) -> Res<usize> {
    s.replace('_', "")
        .parse()
        .map_err(|_| BenchError::Usage(format!("not a number: {s}")))
}

fn dispatch(args: &[String]) -> Res<Value> {
    let a: Vec<&str> = args.iter().map(String::as_str).collect();
    match a.as_slice() {
        ["prepare", dir, n, m, bin] => {
            let (n, m) = (num(n)?, num(m)?);
            if n == 0 || m == 0 || n > 60_000 {
                return Err(BenchError::Usage(
                    "SERVICES in 1..=60000, REALS >= 1".into(),
                ));
            }
            prepare(Path::new(dir), n, m, bin)
        }
        ["restore", dir] => restore(Path::new(dir)),
        ["daemon", source, dir, bin] => daemon_run(source, Path::new(dir), bin, 5),
        ["daemon", source, dir, bin, k] => daemon_run(source, Path::new(dir), bin, num(k)?),
        _ => Err(usage()),
    }
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    match dispatch(&args) {
        Ok(v) => {
            println!("BENCH-JSON {v}");
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("daemon-bench: {e}");
            ExitCode::FAILURE
        }
    }
}
