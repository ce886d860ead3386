//! Running upstream's `e2e.test` against the cluster and reading its JUnit report.

use crate::error::{Context, Error, Result};
use std::fs;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// The default focus: upstream's Service tests and the Service part of the networking checks.
pub const DEFAULT_FOCUS: &str =
    r"\[sig-network\] Services |\[sig-network\] Networking Granular Checks: Services";

/// The default skip: `[Disruptive]` (restarts the proxy or the API server through SSH or as
/// static pods) and what the framework marks as opt-in (`[Feature:...]`, `[Flaky]`). The Service
/// tests that create `type: LoadBalancer` Services use only their ClusterIP and NodePorts (no
/// cloud load balancer), so they run. docs/conformance.md lists every test left out.
pub const DEFAULT_SKIP: &str = r"\[Disruptive\]|\[Feature:|\[Flaky\]";

/// One test case of the JUnit report.
#[derive(Debug, Clone, PartialEq)]
pub struct Case {
    /// The full spec text.
    pub name: String,
    /// passed, failed or skipped.
    pub status: Status,
    /// Seconds.
    pub secs: f64,
    /// The failure message (first line), if any.
    pub message: String,
}

/// A test's outcome.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Status {
    /// Passed.
    Passed,
    /// Failed (or errored).
    Failed,
    /// Skipped.
    Skipped,
}

impl Status {
    /// The word used in the summary and the docs table.
    pub fn word(self) -> &'static str {
        match self {
            Status::Passed => "passed",
            Status::Failed => "failed",
            Status::Skipped => "skipped",
        }
    }
}

fn unescape(s: &str) -> String {
    s.replace("&lt;", "<")
        .replace("&gt;", ">")
        .replace("&quot;", "\"")
        .replace("&#34;", "\"")
        .replace("&apos;", "'")
        .replace("&#39;", "'")
        .replace("&#xA;", "\n")
        .replace("&#10;", "\n")
        .replace("&amp;", "&")
}

fn attr(tag: &str, name: &str) -> Option<String> {
    let key = format!(" {name}=\"");
    let start = tag.find(&key)? + key.len();
    let end = tag[start..].find('"')? + start;
    Some(unescape(&tag[start..end]))
}

/// The test cases of a JUnit XML report (ginkgo's format: `<testcase name="[It] ..." time=>`
/// with a `<skipped>`, `<failure>` or `<error>` child, or none when it passed). The suite's own
/// `[SynchronizedBeforeSuite]`-style entries and the specs the focus did not select (ginkgo lists
/// the whole suite, those with `<skipped message="skipped">`) are dropped; a spec that skipped
/// itself at run time (`skipped - Need at least 2 nodes...`) stays, as skipped.
pub fn parse_junit(xml: &str) -> Vec<Case> {
    let mut out = Vec::new();
    let mut rest = xml;
    while let Some(i) = rest.find("<testcase ") {
        rest = &rest[i..];
        let Some(tag_end) = rest.find('>') else { break };
        let tag = &rest[..tag_end];
        let self_closing = tag.ends_with('/');
        let body_end = if self_closing {
            tag_end
        } else {
            rest.find("</testcase>").unwrap_or(rest.len())
        };
        let body = &rest[tag_end..body_end];
        let name = attr(tag, "name").unwrap_or_default();
        let secs = attr(tag, "time")
            .and_then(|t| t.parse().ok())
            .unwrap_or(0.0);
        let (status, message) = if let Some(k) = body.find("<skipped") {
            let t = &body[k..];
            let msg = attr(&t[..t.find('>').unwrap_or(t.len())], "message").unwrap_or_default();
            if msg == "skipped" {
                // Not selected by the focus/skip: ginkgo lists every spec of the suite.
                rest = &rest[body_end.min(rest.len())..];
                continue;
            }
            (
                Status::Skipped,
                msg.lines().next().unwrap_or_default().to_string(),
            )
        } else if let Some(f) = body.find("<failure").or_else(|| body.find("<error")) {
            let t = &body[f..];
            let msg = attr(&t[..t.find('>').unwrap_or(t.len())], "message").unwrap_or_default();
            (
                Status::Failed,
                msg.lines().next().unwrap_or_default().to_string(),
            )
        } else {
            (Status::Passed, String::new())
        };
        rest = &rest[body_end.min(rest.len())..];
        if rest.starts_with("</testcase>") || !self_closing {
            rest = rest.get(1..).unwrap_or_default();
        }
        let Some(name) = name.strip_prefix("[It] ").map(str::to_string) else {
            continue; // [SynchronizedBeforeSuite], [ReportAfterSuite], ...
        };
        out.push(Case {
            name,
            status,
            secs,
            message,
        });
    }
    out
}

/// `conformance PROXY: N passed, N failed, N skipped`.
pub fn summary_line(proxy: &str, cases: &[Case]) -> String {
    let count = |s| cases.iter().filter(|c| c.status == s).count();
    format!(
        "conformance {proxy}: {} passed, {} failed, {} skipped",
        count(Status::Passed),
        count(Status::Failed),
        count(Status::Skipped)
    )
}

/// What to run.
pub struct E2e<'a> {
    /// `e2e.test`.
    pub exe: &'a Path,
    /// `kubectl` (tests exec into pods through it).
    pub kubectl: &'a Path,
    /// The admin kubeconfig.
    pub kubeconfig: &'a Path,
    /// Where the JUnit report and the log go.
    pub report_dir: &'a Path,
    /// Ginkgo focus regex.
    pub focus: &'a str,
    /// Ginkgo skip regex.
    pub skip: &'a str,
    /// Node count.
    pub nodes: u32,
    /// Only list the selected tests (`--ginkgo.dry-run`).
    pub dry_run: bool,
    /// Parallel processes (more than 1: through the `ginkgo` CLI).
    pub procs: u32,
    /// The `ginkgo` CLI.
    pub ginkgo: &'a Path,
}

/// Runs `e2e.test` inside `ns`; its output goes to `report_dir/e2e.log` (progress lines echoed).
/// Returns the cases of its JUnit report.
pub fn run_e2e(ns: &str, e: &E2e<'_>, limit: Duration) -> Result<Vec<Case>> {
    fs::create_dir_all(e.report_dir).ctx(|| format!("creating {}", e.report_dir.display()))?;
    let log_path = e.report_dir.join("e2e.log");
    let log = fs::File::create(&log_path).ctx(|| format!("creating {}", log_path.display()))?;
    let log2 = log.try_clone().ctx(|| "dup log")?;
    let framework = [
        format!("--kubeconfig={}", e.kubeconfig.display()),
        format!("--kubectl-path={}", e.kubectl.display()),
        format!("--report-dir={}", e.report_dir.display()),
        "--provider=skeleton".into(),
        format!("--num-nodes={}", e.nodes),
        "--dump-logs-on-failure=false".into(),
    ];
    let ginkgo = [
        "no-color".to_string(),
        "v".into(),
        "timeout=6h".into(),
        format!("focus={}", e.focus),
        format!("skip={}", e.skip),
    ];
    let dry = if e.dry_run {
        vec!["dry-run".to_string()]
    } else {
        Vec::new()
    };
    let mut cmd = Command::new("ip");
    cmd.args(["netns", "exec", ns]);
    if e.procs > 1 {
        // The ginkgo CLI runs e2e.test in `procs` processes; the framework merges the report.
        cmd.arg(e.ginkgo)
            .arg(format!("--procs={}", e.procs))
            .args(ginkgo.iter().chain(&dry).map(|g| format!("--{g}")))
            .arg(e.exe)
            .arg("--")
            .args(&framework);
    } else {
        cmd.arg(e.exe)
            .args(&framework)
            .args(ginkgo.iter().chain(&dry).map(|g| format!("--ginkgo.{g}")));
    }
    cmd.env("KUBECONFIG", e.kubeconfig)
        .env("HOME", e.report_dir)
        .stdin(Stdio::null())
        .stdout(log)
        .stderr(log2);
    eprintln!("xtask: + {}", crate::host::show(&cmd));
    let started = Instant::now();
    let mut child = cmd.spawn().map_err(|err| Error::Command {
        cmd: "e2e.test".into(),
        detail: format!("cannot start: {err}"),
    })?;
    let mut shown = 0usize;
    let status = loop {
        if let Some(st) = child.try_wait().ctx(|| "waiting for e2e.test")? {
            break st;
        }
        // Echo ginkgo's one-line results as they come.
        let text = fs::read_to_string(&log_path).unwrap_or_default();
        for l in text.lines().skip(shown) {
            let t = l.trim_start();
            if t.starts_with('•')
                || t.starts_with("S [")
                || t.starts_with("[FAIL]")
                || t.starts_with("Ran ")
            {
                eprintln!("e2e: {}", super::clip(t, 200));
            }
        }
        shown = text.lines().count();
        if started.elapsed() > limit {
            let _ = child.kill();
            let _ = child.wait();
            return Err(Error::Timeout(format!(
                "e2e.test killed after {} s (log: {})",
                limit.as_secs(),
                log_path.display()
            )));
        }
        std::thread::sleep(Duration::from_secs(2));
    };
    eprintln!(
        "xtask: e2e.test exited ({status}) after {:.0} s",
        started.elapsed().as_secs_f64()
    );
    if e.dry_run {
        return Ok(Vec::new());
    }
    let junit = e.report_dir.join("junit_01.xml");
    let xml = fs::read_to_string(&junit).map_err(|err| Error::Command {
        cmd: "e2e.test".into(),
        detail: format!(
            "{status}, no report at {} ({err}); log tail:\n{}",
            junit.display(),
            super::tail(&fs::read_to_string(&log_path).unwrap_or_default(), 30)
        ),
    })?;
    Ok(parse_junit(&xml))
}

/// `results.tsv`: status, seconds, name, message per line (the docs table is built from it).
pub fn write_results(dir: &Path, cases: &[Case]) -> Result<()> {
    let mut s = String::new();
    for c in cases {
        s.push_str(&format!(
            "{}\t{:.1}\t{}\t{}\n",
            c.status.word(),
            c.secs,
            c.name.replace('\t', " "),
            c.message.replace(['\t', '\n'], " ")
        ));
    }
    let p = dir.join("results.tsv");
    fs::write(&p, s).ctx(|| format!("writing {}", p.display()))
}

/// Reads a `results.tsv` back.
pub fn read_results(dir: &Path) -> Vec<Case> {
    fs::read_to_string(dir.join("results.tsv"))
        .unwrap_or_default()
        .lines()
        .filter_map(|l| {
            let mut f = l.splitn(4, '\t');
            let status = match f.next()? {
                "passed" => Status::Passed,
                "failed" => Status::Failed,
                _ => Status::Skipped,
            };
            let secs = f.next()?.parse().ok()?;
            let name = f.next()?.to_string();
            Some(Case {
                name,
                status,
                secs,
                message: f.next().unwrap_or_default().to_string(),
            })
        })
        .collect()
}

/// A markdown table: one row per test, one column per proxy (`passed 12.3 s`).
pub fn table(proxies: &[(&str, Vec<Case>)]) -> String {
    let mut names: Vec<&str> = proxies
        .iter()
        .flat_map(|(_, cs)| cs.iter().map(|c| c.name.as_str()))
        .collect();
    names.sort_unstable();
    names.dedup();
    let mut s = String::from("| test |");
    for (p, _) in proxies {
        s.push_str(&format!(" {p} |"));
    }
    s.push_str("\n|---|");
    for _ in proxies {
        s.push_str("---|");
    }
    s.push('\n');
    for n in names {
        s.push_str(&format!("| {} |", n.replace('|', "\\|")));
        for (_, cs) in proxies {
            match cs.iter().find(|c| c.name == n) {
                Some(c) if c.status == Status::Skipped => s.push_str(" skipped |"),
                Some(c) => s.push_str(&format!(" {} {:.0} s |", c.status.word(), c.secs)),
                None => s.push_str(" — |"),
            }
        }
        s.push('\n');
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    const XML: &str = r#"<?xml version="1.0" encoding="UTF-8"?>
<testsuites tests="4" disabled="0" errors="0" failures="1" time="100">
  <testsuite name="Kubernetes e2e suite" package="/x" tests="4" failures="1" time="100">
    <testcase name="[SynchronizedBeforeSuite]" classname="Kubernetes e2e suite" status="passed" time="3.1"></testcase>
    <testcase name="[It] [sig-network] Services should serve a basic endpoint from pods  [Conformance]" classname="Kubernetes e2e suite" status="passed" time="21.5">
      <system-err>log &amp; more</system-err>
    </testcase>
    <testcase name="[It] [sig-network] Services should be rejected when no endpoints exist" classname="Kubernetes e2e suite" status="failed" time="40.25">
      <failure message="Expected &#34;REFUSED&#34;&#xA;second line" type="failed">[FAILED] details</failure>
    </testcase>
    <testcase name="[It] [sig-network] Services should preserve source pod IP for traffic thru service cluster IP [LinuxOnly]" classname="Kubernetes e2e suite" status="skipped" time="1.5">
      <skipped message="skipped - Need at least 2 nodes"></skipped>
    </testcase>
    <testcase name="[It] [sig-apps] Deployment should do something" classname="Kubernetes e2e suite" status="skipped" time="0">
      <skipped message="skipped"></skipped>
    </testcase>
  </testsuite>
</testsuites>"#;

    #[test]
    fn junit_cases_statuses_and_durations() {
        let cs = parse_junit(XML);
        assert_eq!(cs.len(), 3, "{cs:?}");
        assert_eq!(cs[0].status, Status::Passed);
        assert_eq!(cs[0].secs, 21.5);
        assert_eq!(cs[1].status, Status::Failed);
        assert_eq!(cs[1].message, "Expected \"REFUSED\"");
        assert_eq!(cs[2].status, Status::Skipped);
        assert_eq!(cs[2].message, "skipped - Need at least 2 nodes");
        assert!(cs[0]
            .name
            .starts_with("[sig-network] Services should serve"));
        assert_eq!(
            summary_line("kube-ipvs", &cs),
            "conformance kube-ipvs: 1 passed, 1 failed, 1 skipped"
        );
    }

    #[test]
    fn results_round_trip_and_table() {
        let dir = std::env::temp_dir().join(format!("conf-results-{}", std::process::id()));
        fs::create_dir_all(&dir).unwrap();
        let cs = parse_junit(XML);
        write_results(&dir, &cs).unwrap();
        let back = read_results(&dir);
        assert_eq!(back.len(), 3);
        assert_eq!(back[1].name, cs[1].name);
        let t = table(&[
            ("kube-ipvs", back.clone()),
            ("upstream-ipvs", back[..1].to_vec()),
        ]);
        assert!(t.contains("| passed 22 s | passed 22 s |"), "{t}");
        assert!(t.contains("| failed 40 s | — |"), "{t}");
        let _ = fs::remove_dir_all(&dir);
    }
}
