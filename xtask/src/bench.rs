//! `cargo xtask bench [NAME...] [--services N] [--reals M] [--json FILE]`: builds the release
//! benchmark driver (`crates/controller/examples/controller-bench.rs`), runs it in one VM boot
//! at every size of the scaling series and once for ipset (P5), prints one line per benchmark
//! (`name value reference ratio target PASS/MISS`), writes the JSON and renders the scaling plot
//! (SVG, hand-written) of time vs N.
//!
//! Names: `p1` full program, `p2` one change, `p3` memory, `p4` drift check, `p5` ipset and
//! iptables processes, `scaling` (P1/P2/P4 at 1,000, 5,000 and N), `daemon` (the release
//! `kube-ipvs` binary fed by the fake API server and by `--source-dir`, driven by
//! `crates/kube-ipvs/examples/daemon-bench.rs`, at every size of the series). No name: all of
//! them.

mod peers;
mod svg;

use crate::error::{Context, Error, Result};
use crate::host;
use crate::vm::{self, shell_quote, VmConfig};
use serde_json::{json, Value};
use std::path::PathBuf;
use std::time::{Duration, Instant};

const NAMES: [&str; 7] = ["p1", "p2", "p3", "p4", "p5", "scaling", "daemon"];

const USAGE: &str =
    "usage: cargo xtask bench [p1|p2|p3|p4|p5|scaling|daemon]... [--services N] [--reals M]
       [--sizes N1,N2,...] [--ipset-entries E] [--ipset-sample S] [--changes K] [--json FILE]
       [--svg FILE] [--mem M] [--timeout SECS]
       cargo xtask bench --plot-from JSON [--svg FILE]
       cargo xtask bench peers --help   (kube-ipvs against upstream kube-proxy, bench/peers.rs)";

/// Parsed command line.
#[derive(Debug, Clone, PartialEq)]
pub struct Opts {
    /// Selected benchmarks (all when empty).
    pub names: Vec<String>,
    /// N of the main run.
    pub services: usize,
    /// M.
    pub reals: usize,
    /// Scaling sizes (always include `services`).
    pub sizes: Vec<usize>,
    /// P5 entries.
    pub ipset_entries: usize,
    /// P5 per-entry processes actually timed (extrapolated to `ipset_entries`).
    pub ipset_sample: usize,
    /// One-endpoint changes per daemon run.
    pub changes: usize,
    /// JSON output.
    pub json: PathBuf,
    /// SVG plot output.
    pub svg: PathBuf,
    /// Guest memory (MiB).
    pub mem_mb: u32,
    /// VM time limit.
    pub timeout: Duration,
}

impl Opts {
    fn wants(&self, name: &str) -> bool {
        self.names.is_empty() || self.names.iter().any(|n| n == name)
    }

    /// Sizes to run (ascending, deduplicated).
    pub fn run_sizes(&self) -> Vec<usize> {
        let mut v = vec![self.services];
        if self.wants("scaling") {
            v.extend(self.sizes.iter().copied().filter(|&s| s <= self.services));
        }
        if !["p1", "p2", "p3", "p4", "scaling"]
            .iter()
            .any(|n| self.wants(n))
        {
            v.clear();
        }
        v.sort_unstable();
        v.dedup();
        v
    }

    /// Sizes of the daemon benchmark: the whole series (ascending), or none.
    pub fn daemon_sizes(&self) -> Vec<usize> {
        if !self.wants("daemon") {
            return Vec::new();
        }
        let mut v = vec![self.services];
        v.extend(self.sizes.iter().copied().filter(|&s| s <= self.services));
        v.sort_unstable();
        v.dedup();
        v
    }
}

fn num(s: &str, what: &str) -> Result<usize> {
    s.replace('_', "")
        .parse()
        .map_err(|_| Error::Usage(format!("{what} needs a number, got `{s}`\n{USAGE}")))
}

/// Parses the bench arguments.
pub fn parse_args(args: &[String]) -> Result<Opts> {
    let root = host::workspace_root();
    let mut o = Opts {
        names: Vec::new(),
        services: 10_000,
        reals: 10,
        sizes: vec![1_000, 5_000],
        ipset_entries: 10_000,
        ipset_sample: 2_000,
        changes: 5,
        json: host::target_dir().join("bench.json"),
        svg: root.join("docs/benchmarks/scaling.svg"),
        mem_mb: 2048,
        timeout: Duration::from_secs(30 * 60),
    };
    let mut sizes_given = false;
    let mut it = args.iter();
    while let Some(a) = it.next() {
        match a.as_str() {
            "--services" => o.services = num(crate::value(&mut it, a)?, a)?,
            "--reals" => o.reals = num(crate::value(&mut it, a)?, a)?,
            "--sizes" => {
                sizes_given = true;
                o.sizes = crate::value(&mut it, a)?
                    .split(',')
                    .filter(|s| !s.is_empty())
                    .map(|s| num(s, "--sizes"))
                    .collect::<Result<_>>()?;
            }
            "--ipset-entries" => o.ipset_entries = num(crate::value(&mut it, a)?, a)?,
            "--ipset-sample" => o.ipset_sample = num(crate::value(&mut it, a)?, a)?,
            "--changes" => o.changes = num(crate::value(&mut it, a)?, a)?,
            "--json" => o.json = PathBuf::from(crate::value(&mut it, a)?),
            "--svg" => o.svg = PathBuf::from(crate::value(&mut it, a)?),
            "--mem" => o.mem_mb = crate::parse_mem(crate::value(&mut it, a)?)?,
            "--timeout" => {
                o.timeout = Duration::from_secs(num(crate::value(&mut it, a)?, a)? as u64)
            }
            "-h" | "--help" => return Err(Error::Usage(USAGE.into())),
            n if NAMES.contains(&n.to_ascii_lowercase().as_str()) => {
                o.names.push(n.to_ascii_lowercase())
            }
            other => {
                return Err(Error::Usage(format!(
                    "unknown bench argument `{other}`\n{USAGE}"
                )))
            }
        }
    }
    if o.services == 0 || o.reals == 0 {
        return Err(Error::Usage("--services and --reals must be >= 1".into()));
    }
    if !sizes_given && o.services < 10_000 {
        // Shrunk run: scale the series with it.
        o.sizes = vec![o.services / 10, o.services / 2];
    }
    o.sizes.retain(|&s| s > 0);
    Ok(o)
}

/// `cargo build --release -p PKG ARGS...`, then the built file `rel` under the target dir.
pub(crate) fn build_release(pkg: &str, args: &[&str], rel: &str) -> Result<PathBuf> {
    let mut cmd = crate::host::cargo();
    cmd.current_dir(host::workspace_root())
        .args(["build", "--release", "-p", pkg])
        .args(args);
    eprintln!("xtask: + {}", host::show(&cmd));
    let st = cmd.status().ctx(|| "running cargo build")?;
    if !st.success() {
        return Err(Error::Command {
            cmd: host::show(&cmd),
            detail: format!("{st}"),
        });
    }
    let exe = host::target_dir().join(rel);
    if !exe.exists() {
        return Err(Error::Parse(format!("{} was not built", exe.display())));
    }
    Ok(exe)
}

fn build_driver() -> Result<PathBuf> {
    build_release(
        "proxier",
        &["--example", "controller-bench"],
        "release/examples/controller-bench",
    )
}

/// The release daemon and its benchmark driver.
fn build_daemon() -> Result<(PathBuf, PathBuf)> {
    let bin = build_release(
        "kube-ipvs",
        &["--bin", "kube-ipvs", "--example", "daemon-bench"],
        "release/kube-ipvs",
    )?;
    let driver = host::target_dir().join("release/examples/daemon-bench");
    if !driver.exists() {
        return Err(Error::Parse(format!("{} was not built", driver.display())));
    }
    Ok((bin, driver))
}

/// Guest paths of the daemon benchmark's programs.
pub struct DaemonExes<'a> {
    /// The release `kube-ipvs`.
    pub bin: &'a str,
    /// `daemon-bench`.
    pub driver: &'a str,
}

/// The guest script: the kernel version, then one driver run per size, then P5, then the
/// daemon benchmark per size (prepare, reference restore, API source, directory source; a
/// failed step is reported and the next size still runs).
pub fn script(exe: &str, daemon: Option<&DaemonExes<'_>>, o: &Opts) -> String {
    let exe = shell_quote(exe);
    let mut s = String::from("set -e\necho \"@@kernel $(uname -r)\"\n");
    for n in o.run_sizes() {
        s.push_str(&format!("{exe} run {n} {}\n", o.reals));
    }
    if o.wants("p5") {
        s.push_str(&format!(
            "{exe} ipset {} {}\n",
            o.ipset_entries,
            o.ipset_sample.min(o.ipset_entries)
        ));
    }
    if let Some(d) = daemon {
        let (bin, drv) = (shell_quote(d.bin), shell_quote(d.driver));
        s.push_str("set +e\n");
        for n in o.daemon_sizes() {
            let dir = format!("/tmp/daemon-bench-{n}");
            s.push_str(&format!(
                "if {drv} prepare {dir} {n} {m} {bin}; then\n  \
                 {drv} restore {dir} || echo \"@@daemon-failed restore {n}\"\n  \
                 {drv} daemon api {dir} {bin} {k} || echo \"@@daemon-failed api {n}\"\n  \
                 {drv} daemon dir {dir} {bin} {k} || echo \"@@daemon-failed dir {n}\"\n\
                 else echo \"@@daemon-failed prepare {n}\"; fi\nrm -rf {dir}\n",
                m = o.reals,
                k = o.changes,
            ));
        }
    }
    s
}

/// What the guest printed.
#[derive(Debug, Default)]
pub struct Output {
    /// The guest kernel.
    pub kernel: String,
    /// controller-bench runs, one per size.
    pub runs: Vec<Value>,
    /// controller-bench's P5 run.
    pub ipset: Option<Value>,
    /// daemon-bench, one per size: `{services, reals, restore_s, api, dir}`.
    pub daemon: Vec<Value>,
    /// Daemon steps that failed (`restore 1000`, `api 5000`, ...).
    pub daemon_failed: Vec<String>,
}

/// Parses the guest's stdout.
pub fn parse_output(text: &str) -> Output {
    let mut o = Output::default();
    let mut daemon: std::collections::BTreeMap<u64, Value> = Default::default();
    for line in text.lines() {
        if let Some(k) = line.strip_prefix("@@kernel ") {
            o.kernel = k.trim().to_string();
        } else if let Some(f) = line.strip_prefix("@@daemon-failed ") {
            o.daemon_failed.push(f.trim().to_string());
        } else if let Some(j) = line.strip_prefix("BENCH-JSON ") {
            let Ok(v) = serde_json::from_str::<Value>(j) else {
                continue;
            };
            if let Some(kind) = v["kind"].as_str() {
                let n = v["services"].as_u64().unwrap_or(0);
                let e = daemon
                    .entry(n)
                    .or_insert_with(|| json!({"services": n, "reals": v["reals"]}));
                match kind {
                    "restore" => e["restore_s"] = v["restore_s"].clone(),
                    "prepare" => e["plan_s"] = v["plan_s"].clone(),
                    "daemon" => {
                        let src = v["source"].as_str().unwrap_or("?").to_string();
                        e[src] = v;
                    }
                    _ => {}
                }
            } else if v.get("entries").is_some() {
                o.ipset = Some(v);
            } else {
                o.runs.push(v);
            }
        }
    }
    o.daemon = daemon.into_values().collect();
    o
}

/// One output line.
#[derive(Debug, Clone, PartialEq)]
pub struct Row {
    /// Benchmark name.
    pub name: String,
    /// Our figure.
    pub value: f64,
    /// Unit of value and reference.
    pub unit: &'static str,
    /// What we compare with (None: informational).
    pub reference: Option<f64>,
    /// `<= target` (of the ratio when there is a reference, else of the value).
    pub target: Option<f64>,
}

impl Row {
    fn ratio(&self) -> Option<f64> {
        self.reference.filter(|r| *r > 0.0).map(|r| self.value / r)
    }

    fn status(&self) -> &'static str {
        let Some(t) = self.target else { return "-" };
        let x = self.ratio().unwrap_or(self.value);
        if x <= t {
            "PASS"
        } else {
            "MISS"
        }
    }

    fn json(&self) -> Value {
        json!({
            "name": self.name,
            "value": self.value,
            "unit": self.unit,
            "reference": self.reference,
            "ratio": self.ratio(),
            "target": self.target,
            "status": self.status(),
        })
    }
}

fn f(v: &Value) -> f64 {
    v.as_f64().unwrap_or(f64::NAN)
}

fn row(
    name: &str,
    value: f64,
    unit: &'static str,
    reference: Option<f64>,
    target: Option<f64>,
) -> Row {
    Row {
        name: name.to_string(),
        value,
        unit,
        reference,
        target,
    }
}

/// The benchmark lines of the main run (`run` at N) and of P5.
pub fn rows(o: &Opts, run: Option<&Value>, ipset: Option<&Value>) -> Vec<Row> {
    let mut v = Vec::new();
    if let Some(r) = run {
        let restore = f(&r["ipvsadm_restore_s"]);
        let save = f(&r["p4"]["ipvsadm_save_s"]);
        let full = f(&r["p4"]["total_s"]);
        let m = r["reals"].as_f64().unwrap_or(o.reals as f64);
        if o.wants("p1") {
            v.push(row(
                "P1.full-program.total",
                f(&r["p1"]["total_s"]),
                "s",
                Some(restore),
                Some(0.5),
            ));
            v.push(row(
                "P1.full-program.ipvs",
                f(&r["p1"]["ipvs_s"]),
                "s",
                Some(restore),
                Some(0.5),
            ));
        }
        if o.wants("p2") {
            // add: 1 NewService + M NewDest + 1 address + 2 ipset members (KUBE-CLUSTER-IP,
            // KUBE-IPVS-IPS), which are netlink requests since ipset netlink replaced the
            // `ipset restore` process of small syncs.
            for (name, reqs) in [
                ("endpoint", 10.0),
                ("add-service", m + 4.0),
                ("delete-service", 10.0),
            ] {
                let c = &r["p2"][name];
                v.push(row(
                    &format!("P2.{name}.time"),
                    f(&c["wall_s"]),
                    "s",
                    Some(full),
                    Some(0.01),
                ));
                v.push(row(
                    &format!("P2.{name}.requests"),
                    f(&c["netlink_requests"]),
                    "req",
                    None,
                    Some(reqs),
                ));
            }
        }
        if o.wants("p3") {
            v.push(row(
                "P3.rss-peak",
                f(&r["p3"]["rss_peak_kb"]) / 1024.0,
                "MiB",
                None,
                None,
            ));
            v.push(row(
                "P3.rss-steady",
                f(&r["p3"]["rss_steady_kb"]) / 1024.0,
                "MiB",
                None,
                None,
            ));
            v.push(row(
                "P3.bytes-per-service",
                f(&r["p3"]["bytes_per_service"]),
                "B",
                None,
                None,
            ));
        }
        if o.wants("p4") {
            v.push(row(
                "P4.drift-check.total",
                full,
                "s",
                Some(save),
                Some(1.5),
            ));
            v.push(row(
                "P4.drift-check.ipvs",
                f(&r["p4"]["ipvs_s"]),
                "s",
                Some(save),
                Some(1.5),
            ));
        }
        if o.wants("p5") {
            let tables = r["p1"]["iptables_tables"].as_f64().unwrap_or(1.0).max(1.0);
            v.push(row(
                "P5.iptables.first-sync-per-table",
                f(&r["p1"]["iptables_processes"]) / tables,
                "proc",
                None,
                Some(1.0),
            ));
            v.push(row(
                "P5.iptables.unchanged-sync",
                f(&r["p2"]["endpoint"]["requests"]["iptables_processes"]),
                "proc",
                None,
                Some(0.0),
            ));
            v.push(row(
                "P5.iptables.full-resync-per-table",
                f(&r["p4"]["requests"]["iptables_processes"]) / tables,
                "proc",
                None,
                Some(1.0),
            ));
        }
    }
    if let (true, Some(i)) = (o.wants("p5"), ipset) {
        v.push(row(
            "P5.ipset",
            f(&i["ours_s"]),
            "s",
            Some(f(&i["per_entry_s"])),
            None,
        ));
    }
    v
}

/// The daemon benchmark's lines at one size (issue #18's targets: start to converged <= 0.5x
/// `ipvsadm --restore`, one change <= 0.01x the converge time with O(1) (<= 10) requests,
/// RSS <= 55 MiB steady and <= 80 MiB peak at 10,000 services).
pub fn daemon_rows(d: &Value) -> Vec<Row> {
    let mut v = Vec::new();
    let restore = d["restore_s"].as_f64();
    for src in ["api", "dir"] {
        let r = &d[src];
        if r.is_null() {
            continue;
        }
        let converge = f(&r["converge_s"]);
        v.push(row(
            &format!("D.{src}.start-to-converged"),
            converge,
            "s",
            restore,
            Some(0.5),
        ));
        v.push(row(
            &format!("D.{src}.one-endpoint.median"),
            f(&r["change_median_s"]),
            "s",
            Some(converge),
            Some(0.01),
        ));
        v.push(row(
            &format!("D.{src}.one-endpoint.requests"),
            f(&r["change_requests_median"]),
            "req",
            None,
            Some(10.0),
        ));
        v.push(row(
            &format!("D.{src}.rss-steady"),
            f(&r["rss_steady_kb"]) / 1024.0,
            "MiB",
            None,
            Some(55.0),
        ));
        v.push(row(
            &format!("D.{src}.rss-peak"),
            f(&r["rss_peak_kb"]) / 1024.0,
            "MiB",
            None,
            Some(80.0),
        ));
        v.push(row(
            &format!("D.{src}.bytes-per-service"),
            f(&r["bytes_per_service"]),
            "B",
            None,
            None,
        ));
        v.push(row(
            &format!("D.{src}.processes.start"),
            f(&r["start_processes"]),
            "proc",
            None,
            None,
        ));
        v.push(row(
            &format!("D.{src}.processes.one-endpoint"),
            f(&r["change_processes"])
                / r["changes"].as_array().map_or(1, |c| c.len().max(1)) as f64,
            "proc",
            None,
            Some(0.0),
        ));
    }
    v
}

fn fmt_num(x: f64) -> String {
    if !x.is_finite() {
        "-".into()
    } else if x == x.trunc() && x.abs() < 1e9 {
        format!("{x:.0}")
    } else if x.abs() >= 100.0 {
        format!("{x:.1}")
    } else if x.abs() >= 0.01 {
        format!("{x:.3}")
    } else {
        format!("{x:.5}")
    }
}

/// The printed line of a row.
pub fn render_row(r: &Row) -> String {
    let opt = |x: Option<f64>| x.map(fmt_num).unwrap_or_else(|| "-".into());
    let target = r
        .target
        .map(|t| format!("<={}", fmt_num(t)))
        .unwrap_or_else(|| "-".into());
    format!(
        "{:<36} {:>12} {:<4} {:>12} {:>9} {:>7} {}",
        r.name,
        fmt_num(r.value),
        r.unit,
        opt(r.reference),
        opt(r.ratio()),
        target,
        r.status()
    )
}

/// Column titles of the daemon table.
fn daemon_table_header() -> String {
    format!(
        "{:>7} {:<4} {:>10} {:>10} {:>7} {:>11} {:>5} {:>9} {:>9} {:>7} {:>7}",
        "N",
        "src",
        "converged",
        "ipvsadm -R",
        "ratio",
        "1 endpoint",
        "req",
        "RSS",
        "peak",
        "B/svc",
        "procs"
    )
}

/// One line per source of a daemon entry.
fn daemon_table_lines(d: &Value) -> Vec<String> {
    let restore = f(&d["restore_s"]);
    ["api", "dir"]
        .iter()
        .filter(|s| !d[**s].is_null())
        .map(|src| {
            let r = &d[*src];
            let c = f(&r["converge_s"]);
            format!(
                "{:>7} {:<4} {:>10.3} {:>10.3} {:>7.3} {:>11.5} {:>5} {:>9.1} {:>9.1} {:>7} {:>7}",
                d["services"].as_u64().unwrap_or(0),
                src,
                c,
                restore,
                c / restore,
                f(&r["change_median_s"]),
                fmt_num(f(&r["change_requests_median"])),
                f(&r["rss_steady_kb"]) / 1024.0,
                f(&r["rss_peak_kb"]) / 1024.0,
                fmt_num(f(&r["bytes_per_service"])),
                fmt_num(f(&r["start_processes"])),
            )
        })
        .collect()
}

/// The daemon plots' paths beside the time plot: `daemon-time.svg`, `daemon-rss.svg`.
pub fn daemon_svg_paths(svg: &std::path::Path) -> (PathBuf, PathBuf) {
    (
        svg.with_file_name("daemon-time.svg"),
        svg.with_file_name("daemon-rss.svg"),
    )
}

/// Writes the controller's time plot (with more than one run) and, with daemon entries, the
/// daemon's time and RSS plots beside it (they come from other driver runs, so each plot
/// shows one boot's figures only).
fn write_plots(
    svg: &std::path::Path,
    runs: &[Value],
    daemon: &[Value],
    reals: usize,
    kernel: &str,
    date: &str,
) -> Result<()> {
    if let Some(dir) = svg.parent() {
        std::fs::create_dir_all(dir).ctx(|| format!("creating {}", dir.display()))?;
    }
    let mut out: Vec<(PathBuf, String)> = Vec::new();
    if runs.len() > 1 {
        out.push((
            svg.to_path_buf(),
            svg::scaling_plot(runs, &[], reals, kernel, date),
        ));
    }
    if !daemon.is_empty() {
        let (time, rss) = daemon_svg_paths(svg);
        out.push((time, svg::scaling_plot(&[], daemon, reals, kernel, date)));
        out.push((rss, svg::rss_plot(&[], daemon, reals, kernel, date)));
    }
    for (path, text) in out {
        std::fs::write(&path, text).ctx(|| format!("writing {}", path.display()))?;
        println!("plot: {}", path.display());
    }
    Ok(())
}

/// `bench --plot-from JSON [--svg FILE]`: re-render the plots of an earlier run (the time plot
/// of its controller runs, the daemon plots of its daemon entries).
fn plot_from(json: &str, rest: &[String]) -> Result<u8> {
    let o = parse_args(rest)?;
    let text = std::fs::read_to_string(json).ctx(|| format!("reading {json}"))?;
    let v: Value = serde_json::from_str(&text).map_err(|e| Error::Parse(format!("{json}: {e}")))?;
    let runs = v["runs"].as_array().cloned().unwrap_or_default();
    let daemon = v["daemon"].as_array().cloned().unwrap_or_default();
    write_plots(
        &o.svg,
        &runs,
        &daemon,
        v["reals"].as_u64().unwrap_or(0) as usize,
        v["kernel"].as_str().unwrap_or("?"),
        v["date"].as_str().unwrap_or("?"),
    )?;
    Ok(0)
}

/// The host's 1-minute load average (TCG timings depend on it: other work on the host slows
/// the guest unevenly).
pub(crate) fn loadavg() -> f64 {
    std::fs::read_to_string("/proc/loadavg")
        .ok()
        .and_then(|s| s.split_whitespace().next().and_then(|x| x.parse().ok()))
        .unwrap_or(f64::NAN)
}

/// Today's date (UTC) as YYYY-MM-DD.
pub(crate) fn today() -> String {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    civil(secs / 86_400)
}

/// Days since 1970-01-01 to YYYY-MM-DD (Howard Hinnant's algorithm).
pub fn civil(days: u64) -> String {
    let z = days as i64 + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    format!("{y:04}-{m:02}-{d:02}")
}

/// Entry point for `cargo xtask bench ARGS...`. Returns the process exit code.
pub fn bench(args: &[String]) -> Result<u8> {
    if let Some(("peers", rest)) = args.split_first().map(|(a, r)| (a.as_str(), r)) {
        return peers::peers(rest);
    }
    if let [flag, json, rest @ ..] = args {
        if flag == "--plot-from" {
            return plot_from(json, rest);
        }
    }
    let o = parse_args(args)?;
    let started = Instant::now();
    let controller = !o.run_sizes().is_empty() || o.wants("p5");
    let exe = if controller {
        Some(build_driver()?)
    } else {
        None
    };
    let daemon_exes = if o.daemon_sizes().is_empty() {
        None
    } else {
        Some(build_daemon()?)
    };
    let mut files = Vec::new();
    let exe_s = exe
        .as_ref()
        .map(|e| e.to_string_lossy().into_owned())
        .unwrap_or_else(|| "true".into());
    if let Some(e) = &exe {
        files.push((e.clone(), exe_s.clone()));
    }
    let daemon_paths = daemon_exes.as_ref().map(|(b, d)| {
        (
            b.to_string_lossy().into_owned(),
            d.to_string_lossy().into_owned(),
        )
    });
    if let (Some((b, d)), Some((bs, ds))) = (&daemon_exes, &daemon_paths) {
        files.push((b.clone(), bs.clone()));
        files.push((d.clone(), ds.clone()));
    }
    let dx = daemon_paths
        .as_ref()
        .map(|(b, d)| DaemonExes { bin: b, driver: d });
    let cfg = VmConfig {
        mem_mb: o.mem_mb,
        cpus: 2,
        timeout: o.timeout,
        files,
        net_fwd: None,
        env: Vec::new(),
        cwd: None,
        script: script(&exe_s, dx.as_ref(), &o),
        echo: true,
    };
    eprintln!(
        "xtask bench: sizes {:?} x {} reals{}{}; one VM boot",
        o.run_sizes(),
        o.reals,
        if o.wants("p5") {
            format!(
                ", ipset {} entries ({} timed per-entry)",
                o.ipset_entries,
                o.ipset_sample.min(o.ipset_entries)
            )
        } else {
            String::new()
        },
        if o.daemon_sizes().is_empty() {
            String::new()
        } else {
            format!(
                ", daemon at {:?} ({} changes each)",
                o.daemon_sizes(),
                o.changes
            )
        }
    );
    let load_before = loadavg();
    let out = vm::run(&cfg)?;
    let load_after = loadavg();
    let text = String::from_utf8_lossy(&out.stdout);
    let parsed = parse_output(&text);
    let (kernel, runs, ipset) = (&parsed.kernel, &parsed.runs, &parsed.ipset);
    let main = runs
        .iter()
        .find(|r| r["services"].as_u64() == Some(o.services as u64));
    let mut rows = rows(&o, main, ipset.as_ref());
    let daemon_main = parsed
        .daemon
        .iter()
        .find(|d| d["services"].as_u64() == Some(o.services as u64));
    if let Some(d) = daemon_main {
        rows.extend(daemon_rows(d));
    }
    println!();
    println!(
        "{:<36} {:>12} {:<4} {:>12} {:>9} {:>7} status",
        "benchmark", "value", "unit", "reference", "ratio", "target"
    );
    for r in &rows {
        println!("{}", render_row(r));
    }
    if runs.len() > 1 {
        println!();
        println!("scaling (seconds):");
        println!(
            "{:>8} {:>10} {:>10} {:>12} {:>10} {:>12} {:>12}",
            "N", "P1 total", "P1 ipvs", "ipvsadm -R", "P4 total", "ipvsadm -Sn", "P2 endpoint"
        );
        for r in runs {
            println!(
                "{:>8} {:>10.3} {:>10.3} {:>12.3} {:>10.3} {:>12.3} {:>12.5}",
                r["services"].as_u64().unwrap_or(0),
                f(&r["p1"]["total_s"]),
                f(&r["p1"]["ipvs_s"]),
                f(&r["ipvsadm_restore_s"]),
                f(&r["p4"]["total_s"]),
                f(&r["p4"]["ipvsadm_save_s"]),
                f(&r["p2"]["endpoint"]["wall_s"]),
            );
        }
    }
    if !parsed.daemon.is_empty() {
        println!();
        println!("daemon (seconds, MiB):");
        println!("{}", daemon_table_header());
        for d in &parsed.daemon {
            for line in daemon_table_lines(d) {
                println!("{line}");
            }
        }
    }
    let report = json!({
        "date": today(),
        "kernel": kernel,
        "services": o.services,
        "reals": o.reals,
        "sizes": o.run_sizes(),
        "host_loadavg": {"before": load_before, "after": load_after, "cores": std::thread::available_parallelism().map(|n| n.get()).unwrap_or(0)},
        "vm": {"mem_mb": o.mem_mb, "cpus": 2, "boot_s": out.boot.as_secs_f64(), "total_s": out.total.as_secs_f64()},
        "rows": rows.iter().map(Row::json).collect::<Vec<_>>(),
        "runs": runs,
        "ipset": ipset,
        "daemon": parsed.daemon,
        "daemon_failed": parsed.daemon_failed,
        "changes": o.changes,
    });
    if let Some(dir) = o.json.parent() {
        std::fs::create_dir_all(dir).ctx(|| format!("creating {}", dir.display()))?;
    }
    let pretty = serde_json::to_string_pretty(&report).unwrap_or_default();
    std::fs::write(&o.json, pretty + "\n").ctx(|| format!("writing {}", o.json.display()))?;
    println!();
    println!("json: {}", o.json.display());
    write_plots(&o.svg, runs, &parsed.daemon, o.reals, kernel, &today())?;
    let missing = o.run_sizes().len() - runs.len().min(o.run_sizes().len());
    println!(
        "host load average: {load_before:.1} before, {load_after:.1} after (TCG timings are only comparable within one run)"
    );
    println!(
        "bench: {} benchmarks, {} PASS, {} MISS, {} informational; {} of {} runs completed; kernel {kernel}; {:.0} s",
        rows.len(),
        rows.iter().filter(|r| r.status() == "PASS").count(),
        rows.iter().filter(|r| r.status() == "MISS").count(),
        rows.iter().filter(|r| r.status() == "-").count(),
        runs.len(),
        o.run_sizes().len(),
        started.elapsed().as_secs_f64()
    );
    let daemon_missing = o.daemon_sizes().len().saturating_sub(
        parsed
            .daemon
            .iter()
            .filter(|d| !d["api"].is_null() && !d["dir"].is_null() && !d["restore_s"].is_null())
            .count(),
    );
    if !parsed.daemon_failed.is_empty() {
        println!("daemon steps failed: {}", parsed.daemon_failed.join(", "));
    }
    if out.code != 0 || missing > 0 || daemon_missing > 0 || (o.wants("p5") && ipset.is_none()) {
        eprintln!(
            "xtask bench: the driver failed in the VM (exit {})",
            out.code
        );
        return Ok(1);
    }
    Ok(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(s: &str) -> Vec<String> {
        s.split_whitespace().map(str::to_string).collect()
    }

    #[test]
    fn defaults_run_the_scaling_series_and_p5() {
        let o = parse_args(&[]).unwrap();
        assert_eq!(o.run_sizes(), vec![1_000, 5_000, 10_000]);
        let s = script("/x/controller-bench", None, &o);
        assert!(s.contains("/x/controller-bench run 1000 10\n"), "{s}");
        assert!(s.contains("/x/controller-bench run 10000 10\n"), "{s}");
        assert!(s.contains("/x/controller-bench ipset 10000 2000\n"), "{s}");
    }

    #[test]
    fn shrunk_and_filtered_runs() {
        let o = parse_args(&args("p1 --services 2000 --reals 4")).unwrap();
        assert_eq!(o.run_sizes(), vec![2_000]);
        assert!(!script("/b", None, &o).contains("ipset"));
        let o = parse_args(&args("scaling --services 2_000")).unwrap();
        assert_eq!(o.run_sizes(), vec![200, 1_000, 2_000]);
        let o = parse_args(&args("p5")).unwrap();
        assert!(o.run_sizes().is_empty());
        assert!(parse_args(&args("p9")).is_err());
        assert!(parse_args(&args("--services 0")).is_err());
    }

    #[test]
    fn rows_compute_ratios_and_verdicts() {
        let o = parse_args(&args("--services 100")).unwrap();
        let run: Value = serde_json::from_str(
            r#"{"services":100,"reals":10,"ipvsadm_restore_s":4.0,
                "p1":{"total_s":1.0,"ipvs_s":0.5,"iptables_processes":4,"iptables_tables":2},
                "p2":{"endpoint":{"wall_s":0.01,"netlink_requests":2,"requests":{"iptables_processes":0}},
                      "add-service":{"wall_s":0.02,"netlink_requests":12},
                      "delete-service":{"wall_s":0.02,"netlink_requests":2}},
                "p3":{"rss_peak_kb":2048,"rss_steady_kb":1024,"bytes_per_service":100},
                "p4":{"total_s":0.5,"ipvs_s":0.1,"ipvsadm_save_s":0.2,"requests":{"iptables_processes":4}}}"#,
        )
        .unwrap();
        let ipset: Value =
            serde_json::from_str(r#"{"entries":10,"ours_s":0.1,"per_entry_s":10.0}"#).unwrap();
        let rows = rows(&o, Some(&run), Some(&ipset));
        let get = |n: &str| rows.iter().find(|r| r.name == n).unwrap();
        assert_eq!(get("P1.full-program.total").ratio(), Some(0.25));
        assert_eq!(get("P1.full-program.total").status(), "PASS");
        // 0.5 s drift check vs 0.2 s ipvsadm -Sn = 2.5x > 1.5x.
        assert_eq!(get("P4.drift-check.total").status(), "MISS");
        assert_eq!(get("P2.endpoint.time").ratio(), Some(0.02));
        assert_eq!(get("P2.endpoint.time").status(), "MISS");
        assert_eq!(get("P2.add-service.requests").status(), "PASS");
        assert_eq!(get("P5.iptables.first-sync-per-table").value, 2.0);
        assert_eq!(get("P5.iptables.unchanged-sync").status(), "PASS");
        assert_eq!(get("P3.rss-peak").status(), "-");
        assert_eq!(get("P5.ipset").ratio(), Some(0.01));
        let line = render_row(get("P1.full-program.total"));
        assert!(line.contains("0.250") && line.ends_with("PASS"), "{line}");
    }

    #[test]
    fn output_is_parsed() {
        let text = "@@kernel 6.1.0-40-cloud-amd64\nnoise\nBENCH-JSON {\"services\":5}\nBENCH-JSON {\"entries\":3}\n";
        let o = parse_output(text);
        assert_eq!(o.kernel, "6.1.0-40-cloud-amd64");
        assert_eq!(o.runs.len(), 1);
        assert_eq!(o.ipset.unwrap()["entries"], 3);
        assert!(o.daemon.is_empty());
    }

    #[test]
    fn daemon_sizes_script_and_output() {
        let o = parse_args(&args("daemon --services 2000 --changes 3")).unwrap();
        assert!(o.run_sizes().is_empty());
        assert_eq!(o.daemon_sizes(), vec![200, 1_000, 2_000]);
        let d = DaemonExes {
            bin: "/r/kube-ipvs",
            driver: "/r/daemon-bench",
        };
        let s = script("true", Some(&d), &o);
        assert!(
            s.contains("/r/daemon-bench prepare /tmp/daemon-bench-1000 1000 10 /r/kube-ipvs"),
            "{s}"
        );
        assert!(
            s.contains("daemon api /tmp/daemon-bench-2000 /r/kube-ipvs 3"),
            "{s}"
        );
        assert!(
            s.contains("daemon dir /tmp/daemon-bench-200 /r/kube-ipvs 3"),
            "{s}"
        );
        // Everything by default.
        assert_eq!(
            parse_args(&[]).unwrap().daemon_sizes(),
            vec![1_000, 5_000, 10_000]
        );
        // Not asked for.
        assert!(parse_args(&args("p1")).unwrap().daemon_sizes().is_empty());

        let text =
            "BENCH-JSON {\"kind\":\"prepare\",\"services\":100,\"reals\":10,\"plan_s\":0.1}\n\
            BENCH-JSON {\"kind\":\"restore\",\"services\":100,\"reals\":10,\"restore_s\":2.0}\n\
            BENCH-JSON {\"kind\":\"daemon\",\"source\":\"api\",\"services\":100,\"reals\":10,\
              \"converge_s\":0.5,\"change_median_s\":0.01,\"change_requests_median\":2,\
              \"rss_steady_kb\":20480,\"rss_peak_kb\":30720,\"bytes_per_service\":209715,\
              \"start_processes\":12,\"change_processes\":0,\"changes\":[{},{}]}\n\
            @@daemon-failed dir 100\n";
        let out = parse_output(text);
        assert!(out.runs.is_empty());
        assert_eq!(out.daemon.len(), 1);
        assert_eq!(out.daemon_failed, ["dir 100"]);
        let rows = daemon_rows(&out.daemon[0]);
        let get = |n: &str| rows.iter().find(|r| r.name == n).unwrap();
        assert_eq!(get("D.api.start-to-converged").ratio(), Some(0.25));
        assert_eq!(get("D.api.start-to-converged").status(), "PASS");
        // 10 ms of a 0.5 s converge = 0.02 > 0.01.
        assert_eq!(get("D.api.one-endpoint.median").status(), "MISS");
        assert_eq!(get("D.api.one-endpoint.requests").status(), "PASS");
        assert_eq!(get("D.api.rss-steady").value, 20.0);
        assert_eq!(get("D.api.rss-peak").status(), "PASS");
        assert_eq!(get("D.api.processes.one-endpoint").status(), "PASS");
        assert!(rows.iter().all(|r| !r.name.starts_with("D.dir")));
        assert_eq!(daemon_table_lines(&out.daemon[0]).len(), 1);
        assert_eq!(
            daemon_svg_paths(std::path::Path::new("docs/benchmarks/scaling.svg")).1,
            PathBuf::from("docs/benchmarks/daemon-rss.svg")
        );
    }

    #[test]
    fn civil_dates() {
        assert_eq!(civil(0), "1970-01-01");
        assert_eq!(civil(20_779), "2026-11-22");
        assert_eq!(civil(11_016), "2000-02-29");
    }
}
