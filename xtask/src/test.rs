//! `cargo xtask test` and `cargo xtask e2e`: every test stage with one summary line each.
//!
//! Stages: `fmt`, `clippy`, `deny` (cargo-deny, see [`crate::deny`]), `unit` (`cargo test --workspace`), `netns` (ignored `netns_*` tests,
//! natively as root), `kube` (ignored `kube_*` tests against a real etcd + kube-apiserver built by
//! [`crate::kube`], on the host) and `vm` (ignored `vm_*` tests, inside one VM boot). The last line is
//! `test: N passed, M failed`, the shape CI parses.

use crate::error::{Error, Result};
use crate::host::{self, Apt};
use crate::vm::{self, shell_quote, VmConfig};
use std::collections::BTreeSet;
use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// All stages in run order.
pub const STAGES: &[&str] = &["fmt", "clippy", "deny", "unit", "netns", "vm", "kube"];

/// Per-binary time limit inside the guest.
const PER_BINARY_TIMEOUT_SECS: u64 = 900;

/// Passed/failed/ignored counts summed over libtest `test result:` lines.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Counts {
    /// Tests that passed.
    pub passed: u64,
    /// Tests that failed.
    pub failed: u64,
    /// Tests that were ignored.
    pub ignored: u64,
}

impl Counts {
    fn add(&mut self, o: Counts) {
        self.passed += o.passed;
        self.failed += o.failed;
        self.ignored += o.ignored;
    }
}

/// Parse one libtest summary line, e.g.
/// `test result: ok. 3 passed; 0 failed; 1 ignored; 0 measured; 0 filtered out; finished in 0.01s`.
pub fn parse_result_line(line: &str) -> Option<Counts> {
    let rest = line.trim().strip_prefix("test result: ")?;
    let (_, fields) = rest.split_once(". ")?;
    let mut c = Counts::default();
    for f in fields.split(';') {
        let mut w = f.split_whitespace();
        let (Some(n), Some(what)) = (w.next(), w.next()) else {
            continue;
        };
        let Ok(n) = n.parse::<u64>() else { continue };
        match what {
            "passed" => c.passed = n,
            "failed" => c.failed = n,
            "ignored" => c.ignored = n,
            _ => {}
        }
    }
    Some(c)
}

/// Sum every summary line in `text`.
pub fn parse_results(text: &str) -> Counts {
    let mut c = Counts::default();
    for l in text.lines() {
        if let Some(x) = parse_result_line(l) {
            c.add(x);
        }
    }
    c
}

/// Names from `BIN --list --ignored` whose last path segment starts with `prefix` and that
/// contain `filter`.
pub fn select_tests(list: &str, prefix: &str, filter: &str) -> Vec<String> {
    list.lines()
        .filter_map(|l| l.strip_suffix(": test"))
        .filter(|name| {
            let last = name.rsplit("::").next().unwrap_or(name);
            last.starts_with(prefix) && name.contains(filter)
        })
        .map(str::to_string)
        .collect()
}

struct StageResult {
    name: &'static str,
    ok: bool,
    counts: Counts,
    line: String,
}

fn stage_line(name: &str, c: Counts, extra: &str) -> String {
    let mut s = format!("stage {name}: {} passed, {} failed", c.passed, c.failed);
    if !extra.is_empty() {
        s.push_str(&format!(" ({extra})"));
    }
    s
}

/// Run a command with inherited stdio; true on success.
fn run_ok(cmd: &mut Command) -> bool {
    eprintln!("xtask: + {}", host::show(cmd));
    cmd.status().map(|s| s.success()).unwrap_or(false)
}

/// Time limit for a host test command (unit, netns); a hung test is killed with its process tree.
const HOST_TEST_TIMEOUT: Duration = Duration::from_secs(30 * 60);

/// Every descendant of `pid` (from /proc), deepest last.
fn descendants(pid: u32) -> Vec<u32> {
    let mut parent_of: Vec<(u32, u32)> = Vec::new();
    if let Ok(rd) = std::fs::read_dir("/proc") {
        for e in rd.flatten() {
            let Ok(p) = e.file_name().to_string_lossy().parse::<u32>() else {
                continue;
            };
            let Ok(stat) = std::fs::read_to_string(e.path().join("stat")) else {
                continue;
            };
            // pid (comm) state ppid ...: comm may contain spaces, so split after the last ')'.
            let ppid = stat
                .rsplit_once(')')
                .and_then(|(_, rest)| rest.split_whitespace().nth(1))
                .and_then(|v| v.parse::<u32>().ok());
            if let Some(pp) = ppid {
                parent_of.push((p, pp));
            }
        }
    }
    let mut out = vec![pid];
    let mut i = 0;
    while i < out.len() {
        let cur = out[i];
        out.extend(
            parent_of
                .iter()
                .filter(|(_, pp)| *pp == cur)
                .map(|(p, _)| *p),
        );
        i += 1;
    }
    out.remove(0);
    out
}

/// Run a command, echoing its stdout live and returning (success, stdout text). After
/// [`HOST_TEST_TIMEOUT`] the command and all its descendants are killed.
fn run_tee(cmd: &mut Command) -> (bool, String) {
    eprintln!("xtask: + {}", host::show(cmd));
    let Ok(mut child) = cmd.stdout(Stdio::piped()).spawn() else {
        eprintln!("xtask: cannot start {}", host::show(cmd));
        return (false, String::new());
    };
    let pid = child.id();
    let done = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let flag = done.clone();
    let watchdog = std::thread::spawn(move || {
        let start = Instant::now();
        while !flag.load(std::sync::atomic::Ordering::Relaxed) {
            if start.elapsed() > HOST_TEST_TIMEOUT {
                let mut victims = descendants(pid);
                victims.push(pid);
                eprintln!(
                    "xtask: timeout after {} s: killing {victims:?}",
                    HOST_TEST_TIMEOUT.as_secs()
                );
                let _ = Command::new("kill")
                    .arg("-KILL")
                    .args(victims.iter().map(u32::to_string))
                    .status();
                return true;
            }
            std::thread::sleep(Duration::from_millis(250));
        }
        false
    });
    let mut text = String::new();
    if let Some(out) = child.stdout.take() {
        let mut so = std::io::stdout();
        for line in BufReader::new(out).lines().map_while(|l| l.ok()) {
            let _ = writeln!(so, "{line}");
            text.push_str(&line);
            text.push('\n');
        }
    }
    let ok = child.wait().map(|s| s.success()).unwrap_or(false);
    done.store(true, std::sync::atomic::Ordering::Relaxed);
    if watchdog.join().unwrap_or(false) {
        text.push_str("xtask: killed after the host test timeout\n");
    }
    (ok, text)
}

/// A test executable from cargo's JSON messages.
#[derive(Debug, Clone)]
pub struct TestExe {
    /// Path of the binary.
    pub path: PathBuf,
    /// Directory of the package's Cargo.toml.
    pub manifest_dir: PathBuf,
}

/// Parse `--message-format=json` output: (test executables, other executables).
pub fn parse_artifacts(json: &str) -> (Vec<TestExe>, Vec<PathBuf>) {
    let mut tests = Vec::new();
    let mut others = Vec::new();
    for line in json.lines() {
        let Ok(v) = serde_json::from_str::<serde_json::Value>(line) else {
            continue;
        };
        if v["reason"] != "compiler-artifact" {
            continue;
        }
        let Some(exe) = v["executable"].as_str() else {
            continue;
        };
        if v["target"]["name"] == "xtask" {
            continue;
        }
        if v["profile"]["test"] == true {
            let manifest_dir = v["manifest_path"]
                .as_str()
                .and_then(|m| Path::new(m).parent())
                .map(Path::to_path_buf)
                .unwrap_or_else(host::workspace_root);
            tests.push(TestExe {
                path: PathBuf::from(exe),
                manifest_dir,
            });
        } else {
            others.push(PathBuf::from(exe));
        }
    }
    (tests, others)
}

/// `--workspace`, or `-p PKG...` when the user limited the run to some packages.
fn scope(pkgs: &[String]) -> Vec<String> {
    if pkgs.is_empty() {
        return vec!["--workspace".into()];
    }
    pkgs.iter()
        .flat_map(|p| ["-p".to_string(), p.clone()])
        .collect()
}

fn cargo() -> Command {
    let mut c = crate::host::cargo();
    c.current_dir(host::workspace_root());
    c
}

/// Build the test binaries and the workspace bins/examples; return them.
fn build_all(pkgs: &[String]) -> Option<(Vec<TestExe>, Vec<PathBuf>)> {
    let fmt = "--message-format=json-render-diagnostics";
    let (ok, json) = run_quiet_json(
        cargo()
            .arg("test")
            .args(scope(pkgs))
            .args(["--no-run", fmt]),
    );
    if !ok {
        return None;
    }
    let (tests, mut bins) = parse_artifacts(&json);
    let (ok, json) =
        run_quiet_json(
            cargo()
                .arg("build")
                .args(scope(pkgs))
                .args(["--bins", "--examples", fmt]),
        );
    if !ok {
        return None;
    }
    bins.extend(parse_artifacts(&json).1);
    let uniq: BTreeSet<PathBuf> = bins.into_iter().collect();
    Some((tests, uniq.into_iter().collect()))
}

fn run_quiet_json(cmd: &mut Command) -> (bool, String) {
    eprintln!("xtask: + {}", host::show(cmd));
    match cmd.stderr(Stdio::inherit()).output() {
        Ok(o) => (
            o.status.success(),
            String::from_utf8_lossy(&o.stdout).into_owned(),
        ),
        Err(e) => {
            eprintln!("xtask: cannot run cargo: {e}");
            (false, String::new())
        }
    }
}

/// (exe, selected test names) for every exe that has ignored tests matching.
fn select(exes: &[TestExe], prefix: &str, filter: &str) -> Vec<(TestExe, Vec<String>)> {
    let mut v = Vec::new();
    for exe in exes {
        let out = Command::new(&exe.path)
            .args(["--list", "--ignored"])
            .current_dir(&exe.manifest_dir)
            .output();
        let Ok(out) = out else { continue };
        let names = select_tests(&String::from_utf8_lossy(&out.stdout), prefix, filter);
        if !names.is_empty() {
            v.push((exe.clone(), names));
        }
    }
    v
}

fn netns_stage(exes: &[TestExe]) -> StageResult {
    if !host::is_root() {
        let line = "stage netns: skipped (needs root for network namespaces)".to_string();
        return StageResult {
            name: "netns",
            ok: true,
            counts: Counts::default(),
            line,
        };
    }
    let mut total = Counts::default();
    let mut ok = true;
    let mut crashed = 0;
    let sel = select(exes, "netns_", "");
    for (exe, names) in &sel {
        let mut cmd = Command::new(&exe.path);
        cmd.args(["--ignored", "--exact"])
            .args(names)
            .current_dir(&exe.manifest_dir)
            .env("CARGO_MANIFEST_DIR", &exe.manifest_dir);
        let (success, text) = run_tee(&mut cmd);
        let c = parse_results(&text);
        if !success {
            ok = false;
            if c.failed == 0 {
                crashed += 1;
                total.failed += 1;
            }
        }
        total.add(c);
    }
    let extra = format!(
        "{} binaries{}",
        sel.len(),
        if crashed > 0 {
            format!(", {crashed} crashed")
        } else {
            String::new()
        }
    );
    StageResult {
        name: "netns",
        ok: ok && total.failed == 0,
        counts: total,
        line: stage_line("netns", total, &extra),
    }
}

/// Whether the kube stage may build the upstream binaries it does not find cached: yes unless
/// `XTASK_KUBE=skip` (then the stage is skipped with its reason). A cold build takes about 20
/// minutes on two busy cores, which keeps a fresh machine's `cargo xtask test` within CI's budget
/// (see docs/testing.md).
fn kube_build_allowed() -> bool {
    std::env::var("XTASK_KUBE").as_deref() != Ok("skip")
}

/// `XTASK_KUBE=1`: the kube stage was asked for, so a failed build fails it. Otherwise a build
/// that cannot run (no Go module proxy, a compile error) skips the stage with the error.
fn kube_required() -> bool {
    std::env::var("XTASK_KUBE").as_deref() == Ok("1")
}

/// Elapsed time of the test run after which a cold build of the upstream binaries (about 9
/// minutes of two cores, then ~6 minutes of tests) would push the run past CI's 45-minute budget:
/// then the stage is skipped unless asked for. `XTASK_KUBE_BUDGET_S` overrides (seconds).
fn kube_build_deadline() -> Duration {
    let s = std::env::var("XTASK_KUBE_BUDGET_S")
        .ok()
        .and_then(|v| v.parse::<u64>().ok())
        .unwrap_or(20 * 60);
    Duration::from_secs(s)
}

fn kube_skip(reason: String) -> StageResult {
    StageResult {
        name: "kube",
        ok: true,
        counts: Counts::default(),
        line: format!("stage kube: skipped ({reason})"),
    }
}

/// The kube stage: `kube_*` tests, on the host, against the real control plane.
fn kube_stage(exes: &[TestExe], elapsed: Duration) -> StageResult {
    let fail = |why: String| {
        let c = Counts {
            failed: 1,
            ..Counts::default()
        };
        StageResult {
            name: "kube",
            ok: false,
            counts: c,
            line: stage_line("kube", c, &why),
        }
    };
    if !host::is_root() {
        return kube_skip("needs root: the daemon tests run in network namespaces".into());
    }
    let mut note = String::new();
    if !crate::kube::is_cached() {
        if !kube_build_allowed() {
            return kube_skip(
                "XTASK_KUBE=skip and the upstream binaries are not cached; \
                 `cargo xtask kube` builds them"
                    .into(),
            );
        }
        if !kube_required() && elapsed > kube_build_deadline() {
            return kube_skip(format!(
                "the upstream binaries are not cached and this run has taken {:.0} s: a cold \
                 build would exceed the CI budget; `cargo xtask kube` builds them, XTASK_KUBE=1 \
                 forces the stage",
                elapsed.as_secs_f64()
            ));
        }
        match crate::kube::ensure() {
            Ok(b) => {
                if let Some(t) = b.took {
                    note = format!(", upstream binaries built in {:.0} s", t.as_secs_f64());
                }
            }
            Err(e) if !kube_required() => {
                return kube_skip(format!(
                    "NOT RUN: cargo xtask kube failed: {}; XTASK_KUBE=1 makes this a failure",
                    first_line(&e)
                ))
            }
            Err(e) => return fail(format!("cargo xtask kube failed: {}", first_line(&e))),
        }
    }
    let bin = match crate::kube::bin_dir() {
        Ok(b) => b,
        Err(e) => return fail(first_line(&e)),
    };
    let mut total = Counts::default();
    let mut ok = true;
    let sel = select(exes, "kube_", "");
    for (exe, names) in &sel {
        let mut cmd = Command::new(&exe.path);
        cmd.args(["--ignored", "--exact", "--test-threads=1"])
            .args(names)
            .current_dir(&exe.manifest_dir)
            .env("CARGO_MANIFEST_DIR", &exe.manifest_dir)
            // The differential test's scenario count and first seed are its own defaults
            // unless KUBE_IPVS_ORACLE_SCENARIOS / KUBE_IPVS_ORACLE_SEED are set (inherited).
            .env("KUBE_IPVS_KUBE_BIN", &bin);
        let (success, text) = run_tee(&mut cmd);
        let c = parse_results(&text);
        if !success {
            ok = false;
            if c.failed == 0 {
                total.failed += 1;
            }
        }
        total.add(c);
    }
    let extra = format!(
        "{} binaries, kubernetes v{}{note}",
        sel.len(),
        crate::kube::KUBERNETES_VERSION
    );
    StageResult {
        name: "kube",
        ok: ok && total.failed == 0,
        counts: total,
        line: stage_line("kube", total, &extra),
    }
}

/// Repository files small enough to copy into the guest so tests find their fixtures.
fn repo_files() -> Vec<PathBuf> {
    let root = host::workspace_root();
    let out = Command::new("git")
        .arg("ls-files")
        .current_dir(&root)
        .output();
    let Ok(out) = out else { return Vec::new() };
    let mut budget: u64 = 32 << 20;
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|l| root.join(l))
        .filter(|p| match std::fs::metadata(p) {
            Ok(m) if m.is_file() && m.len() <= 4 << 20 && m.len() <= budget => {
                budget -= m.len();
                true
            }
            _ => false,
        })
        .collect()
}

/// The vm stage: run `vm_*` tests (containing `filter`) of every test binary in one VM boot.
fn vm_stage(
    name: &'static str,
    exes: &[TestExe],
    bins: &[PathBuf],
    filter: &str,
    timeout: Duration,
) -> StageResult {
    let sel = select(exes, "vm_", filter);
    if sel.is_empty() {
        let line = format!("stage {name}: 0 passed, 0 failed (no vm_ tests matched)");
        return StageResult {
            name,
            ok: true,
            counts: Counts::default(),
            line,
        };
    }
    let mut files: Vec<(PathBuf, String)> = Vec::new();
    let mut script = String::from("set +e\n");
    for (exe, names) in &sel {
        let dir = exe.manifest_dir.to_string_lossy().into_owned();
        let p = exe.path.to_string_lossy().into_owned();
        files.push((exe.path.clone(), p.clone()));
        let quoted: Vec<String> = names.iter().map(|n| shell_quote(n)).collect();
        script.push_str(&format!(
            "cd {d}\necho '@@xtask-run {p}'\nCARGO_MANIFEST_DIR={d} timeout -s KILL {t} {p} --ignored --exact --test-threads=1 {n}\necho \"@@xtask-rc $?\"\n",
            d = shell_quote(&dir),
            p = shell_quote(&p),
            t = PER_BINARY_TIMEOUT_SECS,
            n = quoted.join(" "),
        ));
    }
    for b in bins {
        files.push((b.clone(), b.to_string_lossy().into_owned()));
    }
    for f in repo_files() {
        files.push((f.clone(), f.to_string_lossy().into_owned()));
    }
    let cfg = VmConfig {
        mem_mb: 2048,
        cpus: 2,
        timeout,
        files,
        net_fwd: None,
        env: vec![("RUST_BACKTRACE".into(), "1".into())],
        cwd: None,
        script,
        echo: true,
    };
    let started = Instant::now();
    let out = match vm::run(&cfg) {
        Ok(o) => o,
        Err(e) => {
            eprintln!("xtask: vm stage: {e}");
            let c = Counts {
                failed: 1,
                ..Counts::default()
            };
            return StageResult {
                name,
                ok: false,
                counts: c,
                line: stage_line(name, c, &format!("VM failed: {}", first_line(&e))),
            };
        }
    };
    let text = String::from_utf8_lossy(&out.stdout);
    let (total, crashed, binaries) = parse_vm_output(&text);
    let extra = format!(
        "{binaries} binaries, 1 boot, initrd {:.0} MB, boot {:.1} s, {:.0} s{}",
        out.initrd_bytes as f64 / 1e6,
        out.boot.as_secs_f64(),
        started.elapsed().as_secs_f64(),
        if crashed.is_empty() {
            String::new()
        } else {
            format!(", crashed: {}", crashed.join(" "))
        }
    );
    StageResult {
        name,
        ok: total.failed == 0 && out.code == 0 && binaries == sel.len(),
        counts: total,
        line: stage_line(name, total, &extra),
    }
}

fn first_line(e: &Error) -> String {
    e.to_string().lines().next().unwrap_or_default().to_string()
}

/// Parse the guest script's output: (counts, binaries that died without a failing test, runs).
pub fn parse_vm_output(text: &str) -> (Counts, Vec<String>, usize) {
    let mut total = Counts::default();
    let mut crashed = Vec::new();
    let mut runs = 0;
    let mut current: Option<(String, Counts)> = None;
    for line in text.lines() {
        if let Some(bin) = line.strip_prefix("@@xtask-run ") {
            current = Some((bin.to_string(), Counts::default()));
        } else if let Some(rc) = line.strip_prefix("@@xtask-rc ") {
            if let Some((bin, c)) = current.take() {
                runs += 1;
                total.add(c);
                if rc.trim() != "0" && c.failed == 0 {
                    total.failed += 1;
                    let short = bin.rsplit('/').next().unwrap_or(&bin).to_string();
                    crashed.push(format!("{short}(rc {})", rc.trim()));
                }
            }
        } else if let Some(c) = parse_result_line(line) {
            if let Some((_, acc)) = current.as_mut() {
                acc.add(c);
            }
        }
    }
    if let Some((bin, c)) = current {
        total.add(c);
        total.failed += 1;
        crashed.push(format!("{bin}(no exit status)"));
    }
    (total, crashed, runs)
}

fn simple_stage(name: &'static str, cmd: &mut Command) -> StageResult {
    let ok = run_ok(cmd);
    let line = if ok {
        format!("stage {name}: ok")
    } else {
        format!("stage {name}: FAILED")
    };
    let counts = Counts {
        failed: u64::from(!ok),
        ..Counts::default()
    };
    StageResult {
        name,
        ok,
        counts: if ok { Counts::default() } else { counts },
        line,
    }
}

fn unit_stage(pkgs: &[String]) -> StageResult {
    let (ok, text) = run_tee(cargo().arg("test").args(scope(pkgs)));
    let mut c = parse_results(&text);
    let mut extra = format!("{} ignored", c.ignored);
    if !ok && c.failed == 0 {
        c.failed += 1;
        extra.push_str(", cargo test failed to build or crashed");
    }
    StageResult {
        name: "unit",
        ok,
        counts: c,
        line: stage_line("unit", c, &extra),
    }
}

fn parse_timeout(it: &mut std::slice::Iter<'_, String>, a: &str) -> Result<Duration> {
    let s = crate::value(it, a)?;
    s.parse::<u64>()
        .map(Duration::from_secs)
        .map_err(|_| Error::Usage(format!("{a} SECS")))
}

/// `cargo xtask test [--stage NAME]... [-p PKG]... [--timeout SECS]`.
pub fn test_cmd(args: &[String]) -> Result<u8> {
    let mut stages: Vec<&'static str> = Vec::new();
    // The vm stage's one boot runs every VM test (about 20 minutes of guest time under TCG
    // with the fault and outage scenarios); the limit only guards against a hang.
    let mut timeout = Duration::from_secs(40 * 60);
    let mut pkgs: Vec<String> = Vec::new();
    let mut it = args.iter();
    while let Some(a) = it.next() {
        match a.as_str() {
            "--stage" => {
                let s = crate::value(&mut it, a)?;
                let st = STAGES.iter().find(|x| **x == s.as_str()).ok_or_else(|| {
                    Error::Usage(format!("unknown stage `{s}` (one of {STAGES:?})"))
                })?;
                stages.push(st);
            }
            "--timeout" => timeout = parse_timeout(&mut it, a)?,
            "-p" | "--package" => pkgs.push(crate::value(&mut it, a)?.clone()),
            other => return Err(Error::Usage(format!("unknown test option `{other}`"))),
        }
    }
    if stages.is_empty() {
        stages = STAGES.to_vec();
    }
    run_stages(&stages, &pkgs, "", timeout)
}

/// `cargo xtask e2e [--filter S] [--timeout SECS]`: the vm stage, only `vm_*` tests containing S
/// (default `e2e`).
pub fn e2e_cmd(args: &[String]) -> Result<u8> {
    let mut filter = "e2e".to_string();
    let mut timeout = Duration::from_secs(30 * 60);
    let mut pkgs: Vec<String> = Vec::new();
    let mut it = args.iter();
    while let Some(a) = it.next() {
        match a.as_str() {
            "--filter" => filter = crate::value(&mut it, a)?.clone(),
            "--timeout" => timeout = parse_timeout(&mut it, a)?,
            "-p" | "--package" => pkgs.push(crate::value(&mut it, a)?.clone()),
            other => return Err(Error::Usage(format!("unknown e2e option `{other}`"))),
        }
    }
    run_stages(&["vm"], &pkgs, &filter, timeout)
}

fn run_stages(
    stages: &[&'static str],
    pkgs: &[String],
    filter: &str,
    timeout: Duration,
) -> Result<u8> {
    let started = Instant::now();
    if host::is_root() && stages.iter().any(|s| matches!(*s, "vm" | "unit" | "kube")) {
        Apt::default().ensure_host_packages()?;
    }
    let mut results: Vec<StageResult> = Vec::new();
    let mut built: Option<Option<(Vec<TestExe>, Vec<PathBuf>)>> = None;
    for &stage in stages {
        eprintln!("xtask: ===== stage {stage} =====");
        let t = Instant::now();
        let r = match stage {
            "fmt" => simple_stage("fmt", cargo().args(["fmt", "--all", "--", "--check"])),
            "clippy" => simple_stage(
                "clippy",
                cargo().arg("clippy").args(scope(pkgs)).args([
                    "--all-targets",
                    "--",
                    "-D",
                    "warnings",
                ]),
            ),
            "deny" => {
                let o = crate::deny::deny_stage();
                let c = Counts {
                    passed: o.passed,
                    failed: o.failed,
                    ignored: 0,
                };
                StageResult {
                    name: "deny",
                    ok: o.failed == 0,
                    counts: c,
                    line: stage_line("deny", c, &o.note),
                }
            }
            "unit" => unit_stage(pkgs),
            "netns" | "kube" | "vm" => {
                let b = built.get_or_insert_with(|| build_all(pkgs));
                match b {
                    None => {
                        let c = Counts {
                            failed: 1,
                            ..Counts::default()
                        };
                        StageResult {
                            name: stage,
                            ok: false,
                            counts: c,
                            line: stage_line(stage, c, "build failed"),
                        }
                    }
                    Some((tests, _)) if stage == "netns" => netns_stage(tests),
                    Some((tests, _)) if stage == "kube" => kube_stage(tests, started.elapsed()),
                    Some((tests, bins)) => vm_stage("vm", tests, bins, filter, timeout),
                }
            }
            _ => continue,
        };
        eprintln!("xtask: {} [{:.0} s]", r.line, t.elapsed().as_secs_f64());
        results.push(r);
    }
    let mut total = Counts::default();
    println!();
    for r in &results {
        println!("{}", r.line);
        total.add(r.counts);
    }
    let all_ok = results.iter().all(|r| r.ok);
    println!("time: {:.0} s", started.elapsed().as_secs_f64());
    println!("test: {} passed, {} failed", total.passed, total.failed);
    if !all_ok {
        let failed: Vec<&str> = results.iter().filter(|r| !r.ok).map(|r| r.name).collect();
        eprintln!("xtask: failed stages: {}", failed.join(", "));
    }
    Ok(if all_ok { 0 } else { 1 })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The process-tree walk finds a real grandchild.
    #[test]
    fn descendants_include_grandchildren() {
        let mut child = Command::new("sh")
            .args(["-c", "sleep 30 & sleep 30 & wait"])
            .spawn()
            .unwrap();
        let pid = child.id();
        let mut found = Vec::new();
        for _ in 0..200 {
            found = descendants(pid);
            if found.len() == 2 {
                break;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        assert_eq!(found.len(), 2, "{found:?}");
        let _ = Command::new("kill")
            .args(found.iter().map(u32::to_string))
            .status();
        child.wait().unwrap();
    }

    #[test]
    fn result_lines() {
        let l = "test result: FAILED. 3 passed; 2 failed; 1 ignored; 0 measured; 5 filtered out; finished in 0.01s";
        assert_eq!(
            parse_result_line(l),
            Some(Counts {
                passed: 3,
                failed: 2,
                ignored: 1
            })
        );
        assert_eq!(parse_result_line("running 3 tests"), None);
        let text = format!("{l}\nfoo\n{}\n", l.replace("3 passed", "4 passed"));
        assert_eq!(
            parse_results(&text),
            Counts {
                passed: 7,
                failed: 4,
                ignored: 2
            }
        );
    }

    /// Parse what a real libtest binary prints: this very binary's `--list --ignored` output
    /// comes from the same format, so check the selector on representative text.
    #[test]
    fn selects_by_last_segment_prefix() {
        let list = "a::vm_one: test\nvm_two: test\nb::netns_vm_x: test\nc::vm_e2e_sync: test\n3 tests, 0 benchmarks\n";
        assert_eq!(
            select_tests(list, "vm_", ""),
            ["a::vm_one", "vm_two", "c::vm_e2e_sync"]
        );
        assert_eq!(select_tests(list, "vm_", "e2e"), ["c::vm_e2e_sync"]);
        assert_eq!(select_tests(list, "netns_", ""), ["b::netns_vm_x"]);
    }

    #[test]
    fn vm_output_counts_crashes() {
        let text = "@@xtask-run /t/a\ntest result: ok. 2 passed; 0 failed; 0 ignored; 0 measured; 0 filtered out; finished in 1s\n@@xtask-rc 0\n\
                    @@xtask-run /t/b\n@@xtask-rc 137\n\
                    @@xtask-run /t/c\ntest result: FAILED. 1 passed; 1 failed; 0 ignored; 0 measured; 0 filtered out; finished in 1s\n@@xtask-rc 101\n";
        let (c, crashed, runs) = parse_vm_output(text);
        assert_eq!(
            c,
            Counts {
                passed: 3,
                failed: 2,
                ignored: 0
            }
        );
        assert_eq!(crashed, ["b(rc 137)"]);
        assert_eq!(runs, 3);
    }

    #[test]
    fn artifacts_from_cargo_json() {
        let json = r#"{"reason":"compiler-artifact","target":{"name":"testkit","kind":["lib"]},"profile":{"test":true},"manifest_path":"/w/crates/testkit/Cargo.toml","executable":"/w/target/debug/deps/testkit-1"}
{"reason":"compiler-artifact","target":{"name":"kube-ipvs","kind":["bin"]},"profile":{"test":false},"manifest_path":"/w/crates/kube-ipvs/Cargo.toml","executable":"/w/target/debug/kube-ipvs"}
{"reason":"compiler-artifact","target":{"name":"serde","kind":["lib"]},"profile":{"test":false},"manifest_path":"/r/serde/Cargo.toml","executable":null}
{"reason":"build-finished","success":true}"#;
        let (tests, bins) = parse_artifacts(json);
        assert_eq!(tests.len(), 1);
        assert_eq!(tests[0].manifest_dir, Path::new("/w/crates/testkit"));
        assert_eq!(bins, [PathBuf::from("/w/target/debug/kube-ipvs")]);
    }
}
