//! `cargo xtask bench peers`: kube-ipvs against upstream kube-proxy (IPVS, nftables and
//! iptables modes) on the same objects of a real kube-apiserver (issue #34).
//!
//! Per scale (N Services x M endpoints): the release `peers-bench host` starts testkit's
//! etcd + kube-apiserver on the host and loads the objects (timed on its own); one VM boot,
//! which reaches the apiserver through `--net-fwd`, then runs `peers-bench guest`: each proxy
//! in turn from an empty node (see `crates/kube-ipvs/examples/peers-bench/guest.rs` for what
//! is measured and how). The rows go to `target/bench/peers.json` (merged with the rows of
//! other scales already there), a table with the goals of the issue is printed, and the plots
//! are rendered into `docs/benchmarks/peers-*.svg`.

mod plot;

use crate::error::{Context, Error, Result};
use crate::host;
use crate::kube;
use crate::vm::{self, shell_quote, VmConfig};
use serde_json::{json, Value};
use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// The proxies, in run order (the names `cargo xtask conformance --proxy` uses).
pub const PROXIES: [&str; 5] = [
    "kube-ipvs",
    "kube-ipvs-iptables",
    "upstream-ipvs",
    "upstream-nftables",
    "upstream-iptables",
];

/// The documented series: 1,000 x 10, 5,000 x 10, 10,000 x 10 and 5,000 x 50 (the shape of
/// kubernetes/kubernetes#135639).
pub const SCALES: [(usize, usize); 4] = [(1_000, 10), (5_000, 10), (10_000, 10), (5_000, 50)];

const USAGE: &str = "usage: cargo xtask bench peers [--services N --endpoints M | --scales NxM,...]
       [--proxies kube-ipvs,kube-ipvs-iptables,upstream-ipvs,upstream-nftables,upstream-iptables]
       [--cap SECS] [--changes K] [--churn-rate PER_S] [--churn-secs S] [--mem M] [--json FILE]
       [--svg-dir DIR] [--no-skip] [--dev]
       cargo xtask bench peers --plot-from JSON [--svg-dir DIR]";

/// Parsed command line.
#[derive(Debug, Clone, PartialEq)]
pub struct Opts {
    /// (N, M) per run, in order.
    pub scales: Vec<(usize, usize)>,
    /// Proxies, in order.
    pub proxies: Vec<String>,
    /// Convergence cap per proxy.
    pub cap: Duration,
    /// One-at-a-time changes per proxy.
    pub changes: usize,
    /// Churn writes per second.
    pub churn_rate: usize,
    /// Churn duration (s).
    pub churn_secs: usize,
    /// Guest memory (MiB); None: sized from N x M.
    pub mem_mb: Option<u32>,
    /// The rows file.
    pub json: PathBuf,
    /// Where the plots go.
    pub svg_dir: PathBuf,
    /// Debug builds (faster to build, for working on the harness; figures not comparable).
    pub dev: bool,
    /// Run every proxy at every scale, even one that did not converge at a smaller scale.
    pub no_skip: bool,
}

fn num(s: &str, what: &str) -> Result<usize> {
    s.replace(['_', ','], "")
        .parse()
        .map_err(|_| Error::Usage(format!("{what} needs a number, got `{s}`\n{USAGE}")))
}

/// `1000x10` → (1000, 10).
pub fn parse_scale(s: &str) -> Result<(usize, usize)> {
    let (n, m) = s
        .split_once(['x', 'X'])
        .ok_or_else(|| Error::Usage(format!("a scale is NxM, got `{s}`\n{USAGE}")))?;
    Ok((num(n, "--scales")?, num(m, "--scales")?))
}

/// Parses the arguments after `peers`.
pub fn parse_args(args: &[String]) -> Result<Opts> {
    let mut o = Opts {
        scales: Vec::new(),
        proxies: PROXIES.iter().map(|p| p.to_string()).collect(),
        cap: Duration::from_secs(20 * 60),
        changes: 30,
        churn_rate: 20,
        churn_secs: 60,
        mem_mb: None,
        json: host::target_dir().join("bench/peers.json"),
        svg_dir: host::workspace_root().join("docs/benchmarks"),
        dev: false,
        no_skip: false,
    };
    let (mut services, mut endpoints) = (None, None);
    let mut it = args.iter();
    while let Some(a) = it.next() {
        match a.as_str() {
            "--services" => services = Some(num(crate::value(&mut it, a)?, a)?),
            "--endpoints" => endpoints = Some(num(crate::value(&mut it, a)?, a)?),
            "--scales" => {
                o.scales = crate::value(&mut it, a)?
                    .split(',')
                    .filter(|s| !s.is_empty())
                    .map(parse_scale)
                    .collect::<Result<_>>()?
            }
            "--proxies" => {
                o.proxies = crate::value(&mut it, a)?
                    .split(',')
                    .filter(|s| !s.is_empty())
                    .map(str::to_string)
                    .collect();
                if let Some(bad) = o.proxies.iter().find(|p| !PROXIES.contains(&p.as_str())) {
                    return Err(Error::Usage(format!("unknown proxy `{bad}`\n{USAGE}")));
                }
            }
            "--cap" => o.cap = Duration::from_secs(num(crate::value(&mut it, a)?, a)? as u64),
            "--changes" => o.changes = num(crate::value(&mut it, a)?, a)?,
            "--churn-rate" => o.churn_rate = num(crate::value(&mut it, a)?, a)?,
            "--churn-secs" => o.churn_secs = num(crate::value(&mut it, a)?, a)?,
            "--mem" => o.mem_mb = Some(crate::parse_mem(crate::value(&mut it, a)?)?),
            "--json" => o.json = PathBuf::from(crate::value(&mut it, a)?),
            "--svg-dir" => o.svg_dir = PathBuf::from(crate::value(&mut it, a)?),
            "--dev" => o.dev = true,
            "--no-skip" => o.no_skip = true,
            "-h" | "--help" => return Err(Error::Usage(USAGE.into())),
            other => {
                return Err(Error::Usage(format!(
                    "unknown bench peers argument `{other}`\n{USAGE}"
                )))
            }
        }
    }
    match (services, endpoints) {
        (None, None) => {}
        (Some(n), m) => o.scales = vec![(n, m.unwrap_or(10))],
        (None, Some(m)) => o.scales = vec![(1_000, m)],
    }
    if o.scales.is_empty() {
        o.scales = SCALES.to_vec();
    }
    if o.scales.iter().any(|&(n, m)| n == 0 || m == 0) || o.proxies.is_empty() {
        return Err(Error::Usage(format!(
            "scales and the proxy list must not be empty or zero\n{USAGE}"
        )));
    }
    Ok(o)
}

/// Guest memory for N x M: 2 GiB plus 24 KiB per endpoint (upstream's iptables and nftables
/// modes hold the whole ruleset in the process and in the restore/nft child at once; 8 GiB at
/// 250,000 endpoints).
pub fn default_mem(n: usize, m: usize) -> u32 {
    let extra = (n * m) as u64 * 24 / 1024;
    (2048 + extra).min(16 * 1024) as u32
}

/// The VM's time limit: per proxy the cap plus the changes, the churn, its grace and the
/// revert, plus boot and slack.
pub fn vm_timeout(o: &Opts) -> Duration {
    let per = o.cap.as_secs() + 2 * o.changes as u64 + o.churn_secs as u64 + 600;
    Duration::from_secs(600 + per * o.proxies.len() as u64)
}

/// The guest's command line.
pub fn guest_script(driver: &str, kubeconfig: &str, n: usize, m: usize, o: &Opts) -> String {
    format!(
        "exec {} guest {} {n} {m} {} cap={} changes={} churn-rate={} churn-secs={} \
         kube-proxy=/k/kube-proxy kube-ipvs=/k/kube-ipvs\n",
        shell_quote(driver),
        shell_quote(kubeconfig),
        o.proxies.join(","),
        o.cap.as_secs(),
        o.changes,
        o.churn_rate,
        o.churn_secs
    )
}

/// Why `proxy` is not run at N x M ("as far as each proxy gets within its cap", issue #34):
/// a row of `rows` for it at a scale no larger in either dimension (N' <= N and M' <= M, not
/// both equal) that did not converge within a cap at least `cap`, or was itself left out so.
/// Every proxy's work grows with both N and M, so it would not converge at the larger scale
/// within the same cap either; running it would only spend the cap.
pub fn skip_reason(
    rows: &[Value],
    proxy: &str,
    n: usize,
    m: usize,
    cap: Duration,
) -> Option<String> {
    rows.iter().find_map(|r| {
        let (rn, rm) = (
            r["services"].as_u64()? as usize,
            r["endpoints"].as_u64()? as usize,
        );
        let smaller = rn <= n && rm <= m && (rn, rm) != (n, m);
        let failed = r["converged"] == false && r["cap_s"].as_u64()? >= cap.as_secs();
        (r["proxy"] == proxy && smaller && failed).then(|| match r["skipped"].as_str() {
            Some(earlier) => earlier.to_string(),
            None => format!(
                "not converged at {} x {rm} within {} s ({})",
                group(rn as u64),
                r["cap_s"],
                r["date"].as_str().unwrap_or("an earlier run")
            ),
        })
    })
}

/// The row of `rows` that measured `proxy` at N x M (a left-out row measured nothing).
fn measured_row<'a>(rows: &'a [Value], proxy: &str, n: u64, m: u64) -> Option<&'a Value> {
    rows.iter().find(|r| {
        r["proxy"] == proxy
            && r.get("skipped").is_none()
            && r["services"].as_u64() == Some(n)
            && r["endpoints"].as_u64() == Some(m)
    })
}

/// The row of a proxy left out at N x M (see [`skip_reason`]): not converged, with the cap it
/// would have had and why; no figures.
pub fn skipped_row(proxy: &str, n: usize, m: usize, cap: Duration, why: &str) -> Value {
    json!({
        "proxy": proxy,
        "services": n,
        "endpoints": m,
        "converged": false,
        "cap_s": cap.as_secs(),
        "skipped": why,
        "date": super::today(),
    })
}

/// The `BENCH-JSON` lines of the guest: the environment line and the rows.
pub fn parse_guest(text: &str) -> (Value, Vec<Value>) {
    let mut env = Value::Null;
    let mut rows = Vec::new();
    for line in text.lines() {
        let Some(j) = line.strip_prefix("BENCH-JSON ") else {
            continue;
        };
        let Ok(v) = serde_json::from_str::<Value>(j) else {
            continue;
        };
        if v["kind"] == "env" {
            env = v;
        } else if v.get("proxy").is_some() {
            rows.push(v);
        }
    }
    (env, rows)
}

/// The rows of `old` that `new` does not replace (same proxy, N and M), then `new`; sorted
/// by scale (endpoints in total, then N) and proxy order.
pub fn merge_rows(old: &[Value], new: &[Value]) -> Vec<Value> {
    let key = |r: &Value| {
        (
            r["proxy"].as_str().unwrap_or("").to_string(),
            r["services"].as_u64().unwrap_or(0),
            r["endpoints"].as_u64().unwrap_or(0),
        )
    };
    let mut out: Vec<Value> = old
        .iter()
        .filter(|r| !new.iter().any(|n| key(n) == key(r)))
        .cloned()
        .collect();
    out.extend(new.iter().cloned());
    let order = |r: &Value| {
        let n = r["services"].as_u64().unwrap_or(0);
        let m = r["endpoints"].as_u64().unwrap_or(0);
        let p = PROXIES
            .iter()
            .position(|p| Some(*p) == r["proxy"].as_str())
            .unwrap_or(PROXIES.len());
        (n * m, n, p)
    };
    out.sort_by_key(order);
    out
}

fn f(v: &Value) -> f64 {
    v.as_f64().unwrap_or(f64::NAN)
}

fn cell(x: f64, digits: usize) -> String {
    if x.is_finite() {
        format!("{x:.digits$}")
    } else {
        "-".into()
    }
}

/// Converge time as shown: seconds, or `> CAP s (counts)` for a proxy that did not converge;
/// with the end of its first sync when that came more than a second after (`settled_s`).
fn converge_cell(r: &Value) -> String {
    if let Some(why) = r["skipped"].as_str() {
        format!("not run: {why}")
    } else if r["converged"] == true {
        let (c, s) = (f(&r["converge_s"]), f(&r["settled_s"]));
        if s > c + 1.0 {
            format!("{} (first sync ended {})", cell(c, 1), cell(s, 1))
        } else if r["settled"] == false {
            format!("{} (first sync not ended by the cap)", cell(c, 1))
        } else {
            cell(c, 1)
        }
    } else {
        format!("> {} (not converged)", r["cap_s"].as_u64().unwrap_or(0))
    }
}

/// The markdown table of `rows` (one line per proxy and scale).
pub fn markdown_table(rows: &[Value]) -> String {
    let mut s = String::from(
        "| N x M | proxy | converged after (s) | CPU (s) | RSS steady / peak (MiB) | one change p50 / p99 (ms) | churn p99 (ms) | churn CPU (s) |\n\
         |---|---|---:|---:|---:|---:|---:|---:|\n",
    );
    for r in rows {
        s.push_str(&format!(
            "| {} x {} | {} | {} | {} | {} / {} | {} / {} | {} | {} |\n",
            group(r["services"].as_u64().unwrap_or(0)),
            r["endpoints"].as_u64().unwrap_or(0),
            r["proxy"].as_str().unwrap_or("?"),
            converge_cell(r),
            cell(f(&r["cpu_s"]), 1),
            cell(f(&r["rss_steady_mib"]), 1),
            cell(f(&r["rss_peak_mib"]), 1),
            cell(f(&r["change_p50_ms"]), 1),
            cell(f(&r["change_p99_ms"]), 1),
            cell(f(&r["churn_p99_ms"]), 1),
            cell(f(&r["churn_cpu_s"]), 1),
        ));
    }
    s
}

/// `10000` → `10,000`.
pub fn group(n: u64) -> String {
    let s = n.to_string();
    let mut out = String::new();
    for (i, c) in s.chars().enumerate() {
        if i > 0 && (s.len() - i) % 3 == 0 {
            out.push(',');
        }
        out.push(c);
    }
    out
}

/// One goal of the issue at one scale: (scale, what, ours, theirs, ratio, target, pass).
#[derive(Debug, Clone, PartialEq)]
pub struct Goal {
    /// `N x M`.
    pub scale: String,
    /// What is compared.
    pub what: String,
    /// kube-ipvs's figure.
    pub ours: f64,
    /// The peer's figure (for a peer that did not converge: its cap, a lower bound).
    pub theirs: f64,
    /// ours / theirs.
    pub ratio: f64,
    /// `ratio <= target` passes.
    pub target: f64,
}

impl Goal {
    /// Whether it is met.
    pub fn pass(&self) -> bool {
        self.ratio.is_finite() && self.ratio <= self.target
    }

    /// `PASS`, `MISS`, or `no peer figure` when the peer has none to compare with (upstream's
    /// IPVS mode whose first change never reached the kernel: neither met nor missed).
    pub fn status(&self) -> &'static str {
        if self.pass() {
            "PASS"
        } else if !self.theirs.is_finite() && self.ours.is_finite() {
            "no peer figure"
        } else {
            "MISS"
        }
    }
}

/// A peer's figure; for a peer that did not converge, its time is its cap (a lower bound, as
/// are the CPU seconds and peak RSS it had reached when stopped).
fn figure(r: &Value, key: &str) -> f64 {
    if key == "converge_s" && r["converged"] != true {
        // A lower bound: the peer had not converged at its cap.
        return r["cap_s"].as_f64().unwrap_or(f64::NAN);
    }
    f(&r[key])
}

/// The goals of issue #34 for the scales in `rows`: against upstream nftables mode at 5,000 x
/// 10 and above, converge <= 1/10 of its time, CPU and steady RSS <= 1/4, one change's p99 no
/// worse than its p50; against upstream IPVS mode, better on every figure.
pub fn goals(rows: &[Value]) -> Vec<Goal> {
    let mut out = Vec::new();
    let mut scales: Vec<(u64, u64)> = rows
        .iter()
        .filter_map(|r| Some((r["services"].as_u64()?, r["endpoints"].as_u64()?)))
        .collect();
    scales.dedup();
    for (n, m) in scales {
        let get = |p: &str| measured_row(rows, p, n, m);
        let Some(ours) = get("kube-ipvs").filter(|r| r["converged"] == true) else {
            continue;
        };
        let scale = format!("{} x {m}", group(n));
        let mut push = |what: &str, a: f64, b: f64, target: f64| {
            out.push(Goal {
                scale: scale.clone(),
                what: what.to_string(),
                ours: a,
                theirs: b,
                ratio: a / b,
                target,
            })
        };
        if let Some(nft) = get("upstream-nftables").filter(|_| n * m >= 50_000) {
            for (key, target) in [
                ("converge_s", 0.1),
                ("cpu_s", 0.25),
                ("rss_steady_mib", 0.25),
            ] {
                push(
                    &format!("{key} vs upstream-nftables"),
                    f(&ours[key]),
                    figure(nft, key),
                    target,
                );
            }
            if nft["converged"] == true {
                push(
                    "change_p99_ms vs upstream-nftables change_p50_ms",
                    f(&ours["change_p99_ms"]),
                    f(&nft["change_p50_ms"]),
                    1.0,
                );
            }
        }
        if let Some(ipvs) = get("upstream-ipvs") {
            let keys: &[&str] = if ipvs["converged"] == true {
                &[
                    "converge_s",
                    "cpu_s",
                    "rss_steady_mib",
                    "rss_peak_mib",
                    "change_p50_ms",
                    "change_p99_ms",
                    "churn_p99_ms",
                    "churn_cpu_s",
                ]
            } else {
                // Stopped at the cap: its time, CPU and peak RSS so far are lower bounds.
                &["converge_s", "cpu_s", "rss_peak_mib"]
            };
            for key in keys {
                push(
                    &format!("{key} vs upstream-ipvs"),
                    f(&ours[*key]),
                    figure(ipvs, key),
                    1.0,
                );
            }
        }
    }
    out
}

/// The goal lines.
pub fn goal_lines(goals: &[Goal]) -> Vec<String> {
    goals
        .iter()
        .map(|g| {
            format!(
                "{:<12} {:<52} {:>10} {:>10} {:>8} <= {:<5} {}",
                g.scale,
                g.what,
                cell(g.ours, 2),
                cell(g.theirs, 2),
                cell(g.ratio, 3),
                g.target,
                g.status()
            )
        })
        .collect()
}

/// `cargo build [--release] -p kube-ipvs --bin kube-ipvs --example peers-bench`; the binary
/// and the driver.
fn build(dev: bool) -> Result<(PathBuf, PathBuf)> {
    let mut cmd = crate::host::cargo();
    cmd.current_dir(host::workspace_root()).args([
        "build",
        "-p",
        "kube-ipvs",
        "--bin",
        "kube-ipvs",
        "--example",
        "peers-bench",
    ]);
    if !dev {
        cmd.arg("--release");
    }
    eprintln!("xtask: + {}", host::show(&cmd));
    let st = cmd.status().ctx(|| "running cargo build")?;
    if !st.success() {
        return Err(Error::Command {
            cmd: host::show(&cmd),
            detail: st.to_string(),
        });
    }
    let dir = host::target_dir().join(if dev { "debug" } else { "release" });
    let (bin, driver) = (dir.join("kube-ipvs"), dir.join("examples/peers-bench"));
    for p in [&bin, &driver] {
        if !p.exists() {
            return Err(Error::Parse(format!("{} was not built", p.display())));
        }
    }
    Ok((bin, driver))
}

/// The host half, running until dropped (its stdin closes, it stops the control plane).
struct HostHalf {
    child: std::process::Child,
    ready: Value,
}

impl HostHalf {
    fn start(driver: &Path, bin: &Path, n: usize, m: usize) -> Result<HostHalf> {
        let mut cmd = Command::new(driver);
        cmd.args(["host", &n.to_string(), &m.to_string()])
            .env("KUBE_IPVS_KUBE_BIN", bin)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit());
        let mut child = cmd
            .spawn()
            .ctx(|| format!("starting {}", driver.display()))?;
        let out = child
            .stdout
            .take()
            .ok_or_else(|| Error::Parse("no stdout of the host half".into()))?;
        for line in BufReader::new(out).lines() {
            let line = line.ctx(|| "reading the host half")?;
            if let Some(j) = line.strip_prefix("PEERS-READY ") {
                let ready: Value = serde_json::from_str(j)
                    .map_err(|e| Error::Parse(format!("PEERS-READY: {e}")))?;
                return Ok(HostHalf { child, ready });
            }
            eprintln!("{line}");
        }
        let st = child.wait().ctx(|| "waiting for the host half")?;
        Err(Error::Command {
            cmd: format!("{} host {n} {m}", driver.display()),
            detail: format!("{st} before the objects were loaded"),
        })
    }
}

impl Drop for HostHalf {
    fn drop(&mut self) {
        drop(self.child.stdin.take());
        let _ = self.child.wait();
    }
}

/// Host facts for the rows: CPU model and count, load average.
fn machine() -> Value {
    let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let model = cpuinfo
        .lines()
        .find_map(|l| l.strip_prefix("model name"))
        .map(|v| v.trim_start_matches([' ', '\t', ':']).trim().to_string())
        .unwrap_or_default();
    json!({
        "cpu": model,
        "cores": std::thread::available_parallelism().map(|n| n.get()).unwrap_or(0),
        "kvm": false,
    })
}

fn run_scale(o: &Opts, n: usize, m: usize, bin: &Path, driver: &Path) -> Result<Vec<Value>> {
    let kbin = kube::bin_dir()?;
    let host_half = HostHalf::start(driver, &kbin, n, m)?;
    let ready = &host_half.ready;
    let port = ready["port"]
        .as_u64()
        .and_then(|p| u16::try_from(p).ok())
        .ok_or_else(|| Error::Parse("PEERS-READY without a port".into()))?;
    let kc = ready["kubeconfig"].as_str().unwrap_or_default().to_string();
    let ca = ready["ca"].as_str().unwrap_or_default().to_string();
    let drv = driver.to_string_lossy().into_owned();
    let mem = o.mem_mb.unwrap_or_else(|| default_mem(n, m));
    let cfg = VmConfig {
        mem_mb: mem,
        cpus: 2,
        timeout: vm_timeout(o),
        files: vec![
            (kbin.join("kube-proxy"), "/k/kube-proxy".into()),
            (bin.to_path_buf(), "/k/kube-ipvs".into()),
            (driver.to_path_buf(), drv.clone()),
            (PathBuf::from(&kc), kc.clone()),
            (PathBuf::from(&ca), ca.clone()),
        ],
        net_fwd: Some(port),
        env: vec![("RUST_BACKTRACE".into(), "1".into())],
        cwd: None,
        script: guest_script(&drv, &kc, n, m, o),
        echo: true,
    };
    eprintln!(
        "xtask bench peers: {n} x {m}: loaded in {:.1} s; one VM boot ({mem} MiB, 2 vCPUs) for {}",
        f(&ready["load_s"]),
        o.proxies.join(", ")
    );
    let load_before = super::loadavg();
    let out = vm::run(&cfg)?;
    let load_after = super::loadavg();
    let (env, mut rows) = parse_guest(&String::from_utf8_lossy(&out.stdout));
    let ready = host_half.ready.clone();
    drop(host_half);
    for r in &mut rows {
        r["load_s"] = ready["load_s"].clone();
        r["date"] = json!(super::today());
        r["machine"] = machine();
        r["guest"] = env.clone();
        r["vm_mem_mb"] = json!(mem);
        r["host_loadavg"] = json!({"before": load_before, "after": load_after});
        r["dev_build"] = json!(o.dev);
    }
    if out.code != 0 || rows.len() != o.proxies.len() {
        eprintln!(
            "xtask bench peers: {n} x {m}: the guest exited {} with {} of {} rows",
            out.code,
            rows.len(),
            o.proxies.len()
        );
    }
    Ok(rows)
}

fn read_rows(path: &Path) -> Vec<Value> {
    std::fs::read_to_string(path)
        .ok()
        .and_then(|t| serde_json::from_str::<Value>(&t).ok())
        .and_then(|v| v.as_array().cloned())
        .unwrap_or_default()
}

fn write_outputs(o: &Opts, rows: &[Value]) -> Result<()> {
    if let Some(dir) = o.json.parent() {
        std::fs::create_dir_all(dir).ctx(|| format!("creating {}", dir.display()))?;
    }
    let text = serde_json::to_string_pretty(&Value::Array(rows.to_vec())).unwrap_or_default();
    std::fs::write(&o.json, text + "\n").ctx(|| format!("writing {}", o.json.display()))?;
    println!("json: {}", o.json.display());
    std::fs::create_dir_all(&o.svg_dir).ctx(|| format!("creating {}", o.svg_dir.display()))?;
    for (name, svg) in plot::plots(rows) {
        let path = o.svg_dir.join(name);
        std::fs::write(&path, svg).ctx(|| format!("writing {}", path.display()))?;
        println!("plot: {}", path.display());
    }
    Ok(())
}

fn report(rows: &[Value]) {
    println!();
    print!("{}", markdown_table(rows));
    let g = goals(rows);
    if !g.is_empty() {
        println!();
        println!(
            "{:<12} {:<52} {:>10} {:>10} {:>8}    {:<5} status",
            "N x M", "goal (kube-ipvs vs peer)", "ours", "theirs", "ratio", "target"
        );
        for l in goal_lines(&g) {
            println!("{l}");
        }
    }
}

/// Entry point for `cargo xtask bench peers ARGS...`.
pub fn peers(args: &[String]) -> Result<u8> {
    if let [flag, json, rest @ ..] = args {
        if flag == "--plot-from" {
            let mut o = parse_args(rest)?;
            o.json = PathBuf::from(json);
            let rows = read_rows(&o.json);
            report(&rows);
            for (name, svg) in plot::plots(&rows) {
                let path = o.svg_dir.join(name);
                std::fs::write(&path, svg).ctx(|| format!("writing {}", path.display()))?;
                println!("plot: {}", path.display());
            }
            return Ok(0);
        }
    }
    let o = parse_args(args)?;
    if !kube::is_cached() {
        return Err(Error::Usage(format!(
            "the upstream binaries are not built in {} (run `cargo xtask kube`)",
            kube::bin_dir()?.display()
        )));
    }
    let started = Instant::now();
    let (bin, driver) = build(o.dev)?;
    let mut failed = false;
    for &(n, m) in &o.scales {
        let earlier = read_rows(&o.json);
        let mut run = o.clone();
        let mut left_out = Vec::new();
        run.proxies.retain(|p| {
            let why = (!o.no_skip)
                .then(|| skip_reason(&earlier, p, n, m, o.cap))
                .flatten();
            if let Some(why) = &why {
                eprintln!("xtask bench peers: {n} x {m}: {p} not run: {why} (--no-skip runs it)");
                // A measured row of that proxy at this scale (an earlier --no-skip) is kept.
                if measured_row(&earlier, p, n as u64, m as u64).is_none() {
                    left_out.push(skipped_row(p, n, m, o.cap, why));
                }
            }
            why.is_none()
        });
        let mut rows = if run.proxies.is_empty() {
            Vec::new()
        } else {
            match run_scale(&run, n, m, &bin, &driver) {
                Ok(r) => r,
                Err(e) => {
                    eprintln!("xtask bench peers: {n} x {m}: {e}");
                    failed = true;
                    continue;
                }
            }
        };
        failed |= rows.len() != run.proxies.len();
        rows.extend(left_out);
        let all = merge_rows(&earlier, &rows);
        write_outputs(&o, &all)?;
    }
    let all = read_rows(&o.json);
    report(&all);
    let _ = std::io::stdout().flush();
    println!(
        "bench peers: {} scale(s) x {} proxies in {:.0} s (rows of every scale run so far: {})",
        o.scales.len(),
        o.proxies.len(),
        started.elapsed().as_secs_f64(),
        o.json.display()
    );
    Ok(u8::from(failed))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(s: &str) -> Vec<String> {
        s.split_whitespace().map(str::to_string).collect()
    }

    #[test]
    fn a_proxy_not_converged_at_a_smaller_scale_is_left_out() {
        let cap = Duration::from_secs(1200);
        let rows = vec![
            json!({"proxy": "upstream-iptables", "services": 5000, "endpoints": 10, "converged": false, "cap_s": 1200, "date": "2026-12-02"}),
            json!({"proxy": "kube-ipvs-iptables", "services": 5000, "endpoints": 10, "converged": false, "cap_s": 600}),
            json!({"proxy": "upstream-nftables", "services": 10000, "endpoints": 10, "converged": false, "cap_s": 1200}),
            json!({"proxy": "upstream-ipvs", "services": 5000, "endpoints": 10, "converged": true, "cap_s": 1200}),
        ];
        let why = skip_reason(&rows, "upstream-iptables", 10_000, 10, cap).unwrap();
        assert_eq!(
            why,
            "not converged at 5,000 x 10 within 1200 s (2026-12-02)"
        );
        assert!(skip_reason(&rows, "upstream-iptables", 5_000, 50, cap).is_some());
        // The same scale again, a smaller one, another proxy: run.
        assert_eq!(
            skip_reason(&rows, "upstream-iptables", 5_000, 10, cap),
            None
        );
        assert_eq!(
            skip_reason(&rows, "upstream-iptables", 1_000, 10, cap),
            None
        );
        assert_eq!(skip_reason(&rows, "kube-ipvs", 10_000, 10, cap), None);
        // A shorter cap than this run's proves nothing; a converged row neither.
        assert_eq!(
            skip_reason(&rows, "kube-ipvs-iptables", 10_000, 10, cap),
            None
        );
        assert!(skip_reason(
            &rows,
            "kube-ipvs-iptables",
            10_000,
            10,
            Duration::from_secs(600)
        )
        .is_some());
        assert_eq!(skip_reason(&rows, "upstream-ipvs", 10_000, 10, cap), None);
        // 10,000 x 10 is not below 5,000 x 50 in N: nftables runs there.
        assert_eq!(
            skip_reason(&rows, "upstream-nftables", 5_000, 50, cap),
            None
        );
        // A left-out row carries its reason on to the next scale, and shows it in the table
        // instead of figures; it is no peer figure for the goals.
        let left = skipped_row("upstream-iptables", 10_000, 10, cap, &why);
        let mut more = rows.clone();
        more.push(left.clone());
        assert_eq!(
            skip_reason(&more, "upstream-iptables", 20_000, 10, cap).as_deref(),
            Some(why.as_str())
        );
        let t = markdown_table(std::slice::from_ref(&left));
        assert!(
            t.contains("| 10,000 x 10 | upstream-iptables | not run: not converged at 5,000 x 10"),
            "{t}"
        );
        let ours = json!({"proxy": "kube-ipvs", "services": 10000, "endpoints": 10, "converged": true,
            "converge_s": 50.0, "cpu_s": 50.0, "rss_steady_mib": 60.0, "rss_peak_mib": 61.0});
        let ipvs_left = skipped_row("upstream-ipvs", 10_000, 10, cap, "x");
        assert!(goals(&[ours, ipvs_left]).is_empty());
    }

    #[test]
    fn arguments() {
        let o = parse_args(&[]).unwrap();
        assert_eq!(o.scales, SCALES.to_vec());
        assert_eq!(o.proxies.len(), 5);
        assert_eq!(o.cap, Duration::from_secs(1200));
        let o = parse_args(&args(
            "--services 200 --endpoints 5 --proxies kube-ipvs,upstream-nftables --cap 60",
        ))
        .unwrap();
        assert_eq!(o.scales, vec![(200, 5)]);
        assert_eq!(o.proxies, ["kube-ipvs", "upstream-nftables"]);
        assert_eq!(o.cap, Duration::from_secs(60));
        let o = parse_args(&args("--scales 1000x10,5_000x50")).unwrap();
        assert_eq!(o.scales, vec![(1000, 10), (5000, 50)]);
        assert!(parse_args(&args("--proxies kube-proxy")).is_err());
        assert!(parse_args(&args("--scales 10")).is_err());
        assert!(parse_args(&args("--services 0")).is_err());
        let s = guest_script(
            "/d/peers-bench",
            "/c/kc",
            200,
            5,
            &parse_args(&args("--proxies kube-ipvs")).unwrap(),
        );
        assert!(s.starts_with("exec /d/peers-bench guest /c/kc 200 5 kube-ipvs cap=1200 changes=30 churn-rate=20 churn-secs=60"), "{s}");
        assert_eq!(default_mem(5_000, 50), 2048 + 5_859);
        assert_eq!(default_mem(1_000, 10), 2048 + 234);
    }

    fn row(p: &str, n: u64, m: u64, extra: Value) -> Value {
        let mut r = json!({"proxy": p, "services": n, "endpoints": m, "converged": true});
        for (k, v) in extra.as_object().unwrap() {
            r[k] = v.clone();
        }
        r
    }

    #[test]
    fn rows_merge_and_parse() {
        let text = "noise\nBENCH-JSON {\"kind\":\"env\",\"kernel\":\"6.1\"}\n\
                    BENCH-JSON {\"proxy\":\"kube-ipvs\",\"services\":5,\"endpoints\":2}\n";
        let (env, rows) = parse_guest(text);
        assert_eq!(env["kernel"], "6.1");
        assert_eq!(rows.len(), 1);
        let old = vec![
            row("upstream-ipvs", 5, 2, json!({"converge_s": 9.0})),
            row("kube-ipvs", 5, 2, json!({"converge_s": 9.0})),
            row("kube-ipvs", 1, 2, json!({})),
        ];
        let new = vec![row("kube-ipvs", 5, 2, json!({"converge_s": 1.0}))];
        let all = merge_rows(&old, &new);
        assert_eq!(all.len(), 3);
        assert_eq!(all[0]["services"], 1);
        assert_eq!(all[1]["proxy"], "kube-ipvs");
        assert_eq!(all[1]["converge_s"], 1.0);
        assert_eq!(all[2]["proxy"], "upstream-ipvs");
    }

    #[test]
    fn goals_and_table() {
        let rows = vec![
            row(
                "kube-ipvs",
                5000,
                10,
                json!({"converge_s": 5.0, "cpu_s": 4.0, "rss_steady_mib": 30.0,
                "rss_peak_mib": 40.0, "change_p50_ms": 10.0, "change_p99_ms": 30.0, "churn_p99_ms": 50.0, "churn_cpu_s": 1.0}),
            ),
            row(
                "upstream-ipvs",
                5000,
                10,
                json!({"converge_s": 500.0, "cpu_s": 400.0, "rss_steady_mib": 150.0,
                "rss_peak_mib": 200.0, "change_p50_ms": 900.0, "change_p99_ms": 20.0, "churn_p99_ms": 5000.0, "churn_cpu_s": 60.0}),
            ),
            json!({"proxy": "upstream-nftables", "services": 5000, "endpoints": 10, "converged": false, "cap_s": 1200,
                "cpu_s": 900.0, "rss_steady_mib": null}),
        ];
        let g = goals(&rows);
        let get = |w: &str| g.iter().find(|x| x.what == w).unwrap();
        // Not converged: the cap is a lower bound of its time.
        assert_eq!(get("converge_s vs upstream-nftables").theirs, 1200.0);
        assert!(get("converge_s vs upstream-nftables").pass());
        assert!(get("cpu_s vs upstream-nftables").pass());
        assert!(!get("rss_steady_mib vs upstream-nftables").pass());
        assert!(g
            .iter()
            .all(|x| x.what != "change_p99_ms vs upstream-nftables change_p50_ms"));
        assert!(get("converge_s vs upstream-ipvs").pass());
        // A peer stopped at the cap: its time, CPU and peak RSS are lower bounds, compared too.
        let stopped = vec![
            rows[0].clone(),
            json!({"proxy": "upstream-ipvs", "services": 5000, "endpoints": 10, "converged": false,
                "cap_s": 600, "cpu_s": 637.0, "rss_peak_mib": 87.0}),
        ];
        let s = goals(&stopped);
        assert_eq!(
            s.iter().map(|g| g.what.as_str()).collect::<Vec<_>>(),
            [
                "converge_s vs upstream-ipvs",
                "cpu_s vs upstream-ipvs",
                "rss_peak_mib vs upstream-ipvs"
            ]
        );
        assert!(s.iter().all(Goal::pass));
        assert!(!get("change_p99_ms vs upstream-ipvs").pass());
        assert_eq!(get("change_p99_ms vs upstream-ipvs").status(), "MISS");
        assert_eq!(get("converge_s vs upstream-ipvs").status(), "PASS");
        // Converged, but its first change never reached the kernel: no figure to compare.
        let mut no_change = rows[1].clone();
        no_change["change_p50_ms"] = Value::Null;
        let n = goals(&[rows[0].clone(), no_change]);
        let p50 = n
            .iter()
            .find(|x| x.what == "change_p50_ms vs upstream-ipvs")
            .unwrap();
        assert_eq!(p50.status(), "no peer figure");
        assert!(goal_lines(&n)
            .iter()
            .any(|l| l.contains("change_p50_ms") && l.ends_with("no peer figure")));
        assert_eq!(
            g.iter()
                .filter(|x| x.what.ends_with("upstream-ipvs"))
                .count(),
            8
        );
        let t = markdown_table(&rows);
        assert!(
            t.contains(
                "| 5,000 x 10 | kube-ipvs | 5.0 | 4.0 | 30.0 / 40.0 | 10.0 / 30.0 | 50.0 | 1.0 |"
            ),
            "{t}"
        );
        assert!(t.contains("> 1200 (not converged)"), "{t}");
        // A proxy whose counted state was complete before its first sync ended.
        let mut late = rows[1].clone();
        late["settled"] = json!(true);
        late["settled_s"] = json!(731.34);
        let t = markdown_table(&[late.clone(), rows[0].clone()]);
        assert!(
            t.contains("| upstream-ipvs | 500.0 (first sync ended 731.3) |"),
            "{t}"
        );
        assert!(t.contains("| kube-ipvs | 5.0 |"), "{t}");
        late["settled"] = json!(false);
        late["settled_s"] = Value::Null;
        let t = markdown_table(&[late]);
        assert!(
            t.contains("| 500.0 (first sync not ended by the cap) |"),
            "{t}"
        );
        assert_eq!(goal_lines(&g).len(), g.len());
        assert_eq!(group(250000), "250,000");
        assert_eq!(group(999), "999");
    }
}
