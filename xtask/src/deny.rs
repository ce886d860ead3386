//! The `deny` stage of `cargo xtask test`: cargo-deny's `licenses`, `bans` (duplicate
//! versions, wildcards) and `sources` checks against `deny.toml`, and `advisories` when the
//! RustSec advisory database can be fetched (it is a git repository on GitHub).
//!
//! cargo-deny is installed on first use with `cargo install cargo-deny@VERSION --locked`
//! into `target/xtask-cache` (a one-time cost, reported with its duration), or taken from
//! `PATH` when the same version is there. Without the advisory database the stage says so on
//! its summary line (`advisories unavailable: …`) instead of pretending the check ran.

use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use crate::error::{Error, Result};
use crate::host;

/// The cargo-deny release the stage installs and runs.
pub const CARGO_DENY_VERSION: &str = "0.20.2";

/// Longest wait for the advisory database fetch.
const FETCH_TIMEOUT: Duration = Duration::from_secs(90);

/// The outcome: checks passed and failed, and a note for the summary line.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DenyOutcome {
    /// Checks that passed.
    pub passed: u64,
    /// Checks that failed (or could not run because cargo-deny is missing).
    pub failed: u64,
    /// What the summary line adds.
    pub note: String,
}

/// Where cargo-deny is installed: the user's cache directory (`$XDG_CACHE_HOME`, else
/// `~/.cache`), outside the checkout, so a fresh clone on the same machine (CI) does not build
/// it again; the target directory when neither is known.
fn cache_root() -> PathBuf {
    let base = std::env::var_os("XDG_CACHE_HOME")
        .map(PathBuf::from)
        .filter(|p| p.is_absolute())
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache")));
    match base {
        Some(b) => b
            .join("kube-ipvs")
            .join(format!("cargo-deny-{CARGO_DENY_VERSION}")),
        None => host::target_dir().join("xtask-cache"),
    }
}

fn version_of(bin: &std::path::Path) -> Option<String> {
    let out = Command::new(bin).arg("--version").output().ok()?;
    out.status
        .success()
        .then(|| String::from_utf8_lossy(&out.stdout).trim().to_string())
}

/// The cargo-deny binary, installing it when needed; the note says how long that took.
fn ensure_cargo_deny() -> Result<(PathBuf, String)> {
    let cached = cache_root().join("bin").join("cargo-deny");
    for candidate in [cached.clone(), PathBuf::from("cargo-deny")] {
        if version_of(&candidate).is_some_and(|v| v.contains(CARGO_DENY_VERSION)) {
            return Ok((candidate, String::new()));
        }
    }
    let started = Instant::now();
    let mut cmd = crate::host::cargo();
    cmd.args([
        "install",
        &format!("cargo-deny@{CARGO_DENY_VERSION}"),
        "--locked",
        "--root",
    ])
    .arg(cache_root());
    eprintln!("xtask: + {}", host::show(&cmd));
    let ok = cmd.status().map(|s| s.success()).unwrap_or(false);
    if !ok || version_of(&cached).is_none() {
        return Err(Error::Command {
            cmd: host::show(&cmd),
            detail: format!("installing cargo-deny@{CARGO_DENY_VERSION} failed"),
        });
    }
    Ok((
        cached,
        format!(
            "cargo-deny installed in {:.0} s",
            started.elapsed().as_secs_f64()
        ),
    ))
}

fn deny(bin: &std::path::Path) -> Command {
    let mut c = Command::new(bin);
    c.current_dir(host::workspace_root());
    c
}

/// Runs `cmd`, killing it after `limit`; true on success.
fn run_limited(cmd: &mut Command, limit: Duration) -> bool {
    eprintln!("xtask: + {}", host::show(cmd));
    let Ok(mut child) = cmd.stdin(Stdio::null()).spawn() else {
        return false;
    };
    let start = Instant::now();
    loop {
        match child.try_wait() {
            Ok(Some(s)) => return s.success(),
            Ok(None) if start.elapsed() > limit => {
                let _ = child.kill();
                let _ = child.wait();
                eprintln!("xtask: killed after {} s", limit.as_secs());
                return false;
            }
            Ok(None) => std::thread::sleep(Duration::from_millis(200)),
            Err(_) => return false,
        }
    }
}

/// Runs the stage.
pub fn deny_stage() -> DenyOutcome {
    let (bin, install_note) = match ensure_cargo_deny() {
        Ok(b) => b,
        Err(e) => {
            return DenyOutcome {
                passed: 0,
                failed: 1,
                note: e.to_string(),
            }
        }
    };
    let mut notes: Vec<String> = Vec::new();
    if !install_note.is_empty() {
        notes.push(install_note);
    }
    let (mut passed, mut failed) = (0, 0);
    // The offline checks: the dependency graph and deny.toml only (crates.io is reachable
    // for `cargo metadata`; the advisory database is not needed).
    for check in ["licenses", "bans", "sources"] {
        let ok = run_limited(
            deny(&bin).args(["--locked", "check", check]),
            Duration::from_secs(600),
        );
        if ok {
            passed += 1;
        } else {
            failed += 1;
            notes.push(format!("{check} FAILED"));
        }
    }
    // Advisories need the RustSec database: fetch it (bounded), else say it is unavailable.
    let fetched = run_limited(
        deny(&bin).args(["fetch", "db"]).stdout(Stdio::null()),
        FETCH_TIMEOUT,
    );
    if fetched {
        if run_limited(
            deny(&bin).args(["--locked", "--offline", "check", "advisories"]),
            Duration::from_secs(600),
        ) {
            passed += 1;
        } else {
            failed += 1;
            notes.push("advisories FAILED".into());
        }
    } else {
        notes.push(
            "advisories unavailable: the RustSec advisory database (github.com/rustsec/advisory-db) \
             could not be fetched from here; run `cargo deny check advisories` where GitHub is \
             reachable"
                .into(),
        );
    }
    DenyOutcome {
        passed,
        failed,
        note: notes.join("; "),
    }
}
