//! `cargo xtask soak [--minutes N] [--seed S] [--mem M]`: the release `kube-ipvs` in the VM
//! against the fake API server for N minutes (default 20) under churn and randomly timed faults
//! (issue #32). Builds the release binary and the driver (the ignored test `soak_*` in
//! `crates/kube-ipvs/tests/soak/`), runs the driver in one VM boot, and writes its report to
//! `target/soak/report.json` and `target/soak/report.md` (also printed). Exit code 0 only when
//! every check passed. Not part of `cargo xtask test` or CI.

use crate::error::{Context, Error, Result};
use crate::host;
use crate::vm::{self, shell_quote, VmConfig};
use serde_json::{json, Value};
use std::path::PathBuf;
use std::process::Stdio;
use std::time::{Duration, Instant};

const USAGE: &str =
    "usage: cargo xtask soak [--minutes N (default 20)] [--seed S] [--mem M (default 3G)] [--faults WORD,WORD (only faults whose names contain one)]";

/// The driver's test.
const DRIVER_TEST: &str = "soak_release_daemon_under_churn_and_faults";

/// Parsed command line.
#[derive(Debug, Clone, PartialEq)]
pub struct Opts {
    /// How long the soak runs (faults and checks after it ends add a little).
    pub minutes: f64,
    /// The seed (default: the driver picks one from the clock and prints it).
    pub seed: Option<u64>,
    /// Guest memory (MiB).
    pub mem_mb: u32,
    /// Only the faults whose names contain one of these words (comma-separated); all if unset.
    pub faults: Option<String>,
}

/// Parses the soak arguments.
pub fn parse_args(args: &[String]) -> Result<Opts> {
    let mut o = Opts {
        minutes: 20.0,
        seed: None,
        mem_mb: 3072,
        faults: None,
    };
    let bad =
        |what: &str, v: &str| Error::Usage(format!("{what} needs a number, got `{v}`\n{USAGE}"));
    let mut it = args.iter();
    while let Some(a) = it.next() {
        match a.as_str() {
            "--minutes" => {
                let v = crate::value(&mut it, a)?;
                o.minutes = v.parse().map_err(|_| bad(a, v))?;
                if o.minutes <= 0.0 {
                    return Err(bad(a, v));
                }
            }
            "--seed" => {
                let v = crate::value(&mut it, a)?;
                o.seed = Some(v.parse().map_err(|_| bad(a, v))?);
            }
            "--mem" => o.mem_mb = crate::parse_mem(crate::value(&mut it, a)?)?,
            "--faults" => o.faults = Some(crate::value(&mut it, a)?.to_string()),
            "-h" | "--help" => return Err(Error::Usage(USAGE.into())),
            other => {
                return Err(Error::Usage(format!(
                    "unknown soak option `{other}`\n{USAGE}"
                )))
            }
        }
    }
    Ok(o)
}

/// The driver's test executable and its package directory.
fn build_driver() -> Result<(PathBuf, PathBuf)> {
    let mut cmd = crate::host::cargo();
    cmd.current_dir(host::workspace_root()).args([
        "test",
        "-p",
        "kube-ipvs",
        "--test",
        "soak",
        "--no-run",
        "--message-format=json-render-diagnostics",
    ]);
    eprintln!("xtask: + {}", host::show(&cmd));
    let out = cmd
        .stderr(Stdio::inherit())
        .output()
        .ctx(|| "running cargo test --no-run")?;
    if !out.status.success() {
        return Err(Error::Command {
            cmd: host::show(&cmd),
            detail: format!("{}", out.status),
        });
    }
    let (tests, _) = crate::test::parse_artifacts(&String::from_utf8_lossy(&out.stdout));
    tests
        .into_iter()
        .find(|t| {
            t.path
                .file_name()
                .is_some_and(|n| n.to_string_lossy().starts_with("soak-"))
        })
        .map(|t| (t.path, t.manifest_dir))
        .ok_or_else(|| Error::Parse("cargo built no soak test executable".into()))
}

/// The report line the driver prints.
pub fn find_report(stdout: &str) -> Option<Value> {
    stdout
        .lines()
        .filter_map(|l| l.trim().strip_prefix("SOAK-REPORT "))
        .filter_map(|j| serde_json::from_str(j).ok())
        .next_back()
}

fn cell(v: &Value) -> String {
    let s = match v {
        Value::String(s) => s.clone(),
        Value::Null => "-".into(),
        other => other.to_string(),
    };
    s.replace('|', "\\|").replace('\n', " ")
}

/// The report as markdown: the command, the checks, the faults, the health answers.
pub fn markdown(r: &Value) -> String {
    let mut m = String::new();
    let run = &r["run"];
    m.push_str(&format!(
        "Command: `{}` ({}; {} min run, {:.0} s with build and boot; seed {}; VM: {} vCPU {}, {} MiB; host load {:.1} → {:.1} on {} cores)\n\n",
        cell(&run["command"]),
        cell(&run["date"]),
        cell(&r["minutes"]),
        run["total_s"].as_f64().unwrap_or(0.0),
        cell(&r["seed"]),
        cell(&run["vm_cpus"]),
        cell(&run["accel"]),
        cell(&run["vm_mem_mb"]),
        run["load_before"].as_f64().unwrap_or(f64::NAN),
        run["load_after"].as_f64().unwrap_or(f64::NAN),
        cell(&run["cores"]),
    ));
    m.push_str("| check | result | detail |\n|---|---|---|\n");
    for c in r["checks"].as_array().into_iter().flatten() {
        m.push_str(&format!(
            "| {} | {} | {} |\n",
            cell(&c["check"]),
            cell(&c["result"]),
            cell(&c["detail"])
        ));
    }
    m.push_str(&format!(
        "\nFaults ({}; churn: {} changes):\n\n| at (s) | fault | detail | kernel = plan after (s) | deadline (s) |\n|---|---|---|---|---|\n",
        r["faults"].as_array().map(Vec::len).unwrap_or(0),
        cell(&r["churn_ops"]),
    ));
    for f in r["faults"].as_array().into_iter().flatten() {
        m.push_str(&format!(
            "| {} | {} | {} | {} | {} |\n",
            cell(&f["start_s"]),
            cell(&f["kind"]),
            cell(&f["detail"]),
            match f["converged_after_s"] {
                Value::Null => "**not**".to_string(),
                ref v => cell(v),
            },
            cell(&f["deadline_s"]),
        ));
    }
    let not200 = r["health"]["not_200"]
        .as_array()
        .cloned()
        .unwrap_or_default();
    m.push_str(&format!(
        "\nHealth answers other than 200 ({} probes; status 0 = no answer):\n\n",
        cell(&r["health"]["polls"])
    ));
    if not200.is_empty() {
        m.push_str("none\n");
    } else {
        m.push_str("| path | status | cause | context | count | first-last (s) | explained |\n|---|---|---|---|---|---|---|\n");
        for u in &not200 {
            m.push_str(&format!(
                "| {} | {} | {} | {} | {} | {}-{} | {} |\n",
                cell(&u["path"]),
                cell(&u["status"]),
                cell(&u["cause"]),
                cell(&u["context"]),
                cell(&u["count"]),
                cell(&u["first_s"]),
                cell(&u["last_s"]),
                cell(&u["explained"]),
            ));
        }
    }
    let warns = r["daemon_log"].as_array().cloned().unwrap_or_default();
    if !warns.is_empty() {
        m.push_str(
            "\nThe daemon's most frequent WARN/ERROR lines:\n\n| count | line |\n|---|---|\n",
        );
        for w in &warns {
            m.push_str(&format!(
                "| {} | {} |\n",
                cell(&w["count"]),
                cell(&w["line"])
            ));
        }
    }
    m
}

/// Entry point for `cargo xtask soak ARGS...`. Returns the process exit code.
pub fn soak_cmd(args: &[String]) -> Result<u8> {
    let o = parse_args(args)?;
    let started = Instant::now();
    let bin =
        crate::bench::build_release("kube-ipvs", &["--bin", "kube-ipvs"], "release/kube-ipvs")?;
    let (driver, crate_dir) = build_driver()?;
    let root = host::workspace_root();
    let bin_s = bin.to_string_lossy().into_owned();
    let driver_s = driver.to_string_lossy().into_owned();
    let configmap = root.join("deploy/configmap.yaml");
    let files = vec![
        (bin.clone(), bin_s.clone()),
        (driver.clone(), driver_s.clone()),
        (configmap.clone(), configmap.to_string_lossy().into_owned()),
    ];
    let mut env = vec![
        ("KUBE_IPVS_SOAK_MINUTES".to_string(), o.minutes.to_string()),
        ("KUBE_IPVS_SOAK_BIN".to_string(), bin_s),
        ("RUST_BACKTRACE".to_string(), "1".to_string()),
    ];
    if let Some(seed) = o.seed {
        env.push(("KUBE_IPVS_SOAK_SEED".to_string(), seed.to_string()));
    }
    if let Some(faults) = &o.faults {
        env.push(("KUBE_IPVS_SOAK_FAULTS".to_string(), faults.clone()));
    }
    let dir = crate_dir.to_string_lossy().into_owned();
    // The package directory is the working directory (xtask vm creates it in the guest): the
    // driver finds deploy/ through it.
    let script = format!(
        "CARGO_MANIFEST_DIR={d} {p} --ignored --exact --test-threads=1 --nocapture {DRIVER_TEST}\n",
        d = shell_quote(&dir),
        p = shell_quote(&driver_s),
    );
    // The run, the faults that overrun it, the checks after each, setup: an hour of slack
    // only against a hang.
    let timeout = Duration::from_secs((o.minutes * 60.0) as u64 + 3600);
    let cfg = VmConfig {
        mem_mb: o.mem_mb,
        cpus: 2,
        timeout,
        files,
        net_fwd: None,
        env,
        cwd: Some(dir),
        script,
        echo: true,
    };
    eprintln!(
        "xtask soak: {} minutes{}; one VM boot ({} MiB)",
        o.minutes,
        o.seed.map(|s| format!(", seed {s}")).unwrap_or_default(),
        o.mem_mb
    );
    let load_before = crate::bench::loadavg();
    let out = vm::run(&cfg)?;
    let load_after = crate::bench::loadavg();
    let text = String::from_utf8_lossy(&out.stdout);
    let Some(mut report) = find_report(&text) else {
        return Err(Error::Parse(format!(
            "the soak driver printed no SOAK-REPORT line (exit {}); see its output above",
            out.code
        )));
    };
    let mut command = format!("cargo xtask soak --minutes {}", o.minutes);
    if let Some(seed) = report["seed"].as_u64() {
        command.push_str(&format!(" --seed {seed}"));
    }
    if let Some(faults) = &o.faults {
        command.push_str(&format!(" --faults '{faults}'"));
    }
    let hw = std::fs::read_to_string("/proc/cpuinfo")
        .unwrap_or_default()
        .lines()
        .any(|l| l.starts_with("flags") && (l.contains(" vmx") || l.contains(" svm")));
    report["run"] = json!({
        "command": command,
        "date": crate::bench::today(),
        "total_s": started.elapsed().as_secs_f64().round(),
        "boot_s": out.boot.as_secs_f64(),
        "vm_mem_mb": o.mem_mb,
        "vm_cpus": 2,
        "accel": if hw { "KVM" } else { "TCG" },
        "load_before": load_before,
        "load_after": load_after,
        "cores": std::thread::available_parallelism().map(|n| n.get()).unwrap_or(0),
    });
    let dir = host::target_dir().join("soak");
    std::fs::create_dir_all(&dir).ctx(|| format!("creating {}", dir.display()))?;
    let json_path = dir.join("report.json");
    let md_path = dir.join("report.md");
    std::fs::write(
        &json_path,
        serde_json::to_string_pretty(&report).unwrap_or_default() + "\n",
    )
    .ctx(|| format!("writing {}", json_path.display()))?;
    let md = markdown(&report);
    std::fs::write(&md_path, &md).ctx(|| format!("writing {}", md_path.display()))?;
    println!("\n{md}");
    let failed = report["failed_checks"].as_u64().unwrap_or(1);
    println!(
        "soak: {} checks, {failed} failed; {} and {}; {:.0} s",
        report["checks"].as_array().map(Vec::len).unwrap_or(0),
        json_path.display(),
        md_path.display(),
        started.elapsed().as_secs_f64()
    );
    Ok(if failed == 0 && out.code == 0 { 0 } else { 1 })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn s(v: &[&str]) -> Vec<String> {
        v.iter().map(|x| x.to_string()).collect()
    }

    #[test]
    fn options_default_to_twenty_minutes() {
        let o = parse_args(&[]).unwrap();
        assert_eq!((o.minutes, o.seed, o.mem_mb), (20.0, None, 3072));
        let o = parse_args(&s(&["--minutes", "3", "--seed", "42", "--mem", "4G"])).unwrap();
        assert_eq!((o.minutes, o.seed, o.mem_mb), (3.0, Some(42), 4096));
        let o = parse_args(&s(&["--faults", "netlink,kill"])).unwrap();
        assert_eq!(o.faults.as_deref(), Some("netlink,kill"));
        assert!(parse_args(&s(&["--minutes", "0"])).is_err());
        assert!(parse_args(&s(&["--minutes", "x"])).is_err());
        assert!(parse_args(&s(&["--bogus"])).is_err());
    }

    #[test]
    fn the_report_line_is_found_and_rendered() {
        let r = json!({
            "seed": 7, "minutes": 3.0, "churn_ops": 12, "failed_checks": 1,
            "run": {"command": "cargo xtask soak --minutes 3 --seed 7", "date": "2025-01-01", "total_s": 600.0,
                    "vm_cpus": 2, "accel": "TCG", "vm_mem_mb": 3072, "load_before": 1.0, "load_after": 2.0, "cores": 2},
            "checks": [{"check": "connections to stable endpoints", "result": "FAIL", "detail": "10 attempted, 1 failed: a|b"}],
            "faults": [{"start_s": 60.0, "kind": "kill -9 and restart", "detail": "down 2 s", "converged_after_s": null, "deadline_s": 54.5}],
            "health": {"polls": 100, "not_200": [{"path": "/healthz", "status": 503, "cause": "source", "context": "no fault", "count": 3, "first_s": 1.0, "last_s": 3.0, "explained": false}]},
        });
        let out = format!("noise\nSOAK-REPORT {}\nmore\n", r);
        assert_eq!(find_report(&out).unwrap(), r);
        assert!(find_report("nothing here").is_none());
        let md = markdown(&r);
        assert!(
            md.starts_with("Command: `cargo xtask soak --minutes 3 --seed 7`"),
            "{md}"
        );
        assert!(
            md.contains(
                "| connections to stable endpoints | FAIL | 10 attempted, 1 failed: a\\|b |"
            ),
            "{md}"
        );
        assert!(
            md.contains("| 60.0 | kill -9 and restart | down 2 s | **not** | 54.5 |"),
            "{md}"
        );
        assert!(
            md.contains("| /healthz | 503 | source | no fault | 3 | 1.0-3.0 | false |"),
            "{md}"
        );
    }
}
