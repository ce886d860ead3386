//! Smoke test of the daemon benchmark (`examples/daemon-bench.rs`, used by
//! `cargo xtask bench daemon`): at N = 100 services x 10 endpoints the real `kube-ipvs` binary,
//! fed once by the fake API server and once by `--source-dir`, must bring the kernel to exactly
//! the planned table (the driver compares the IPVS dump with `kube-ipvs plan --section ipvs`
//! line for line, and `ipvsadm --restore` of the plan must give the same table), carry one
//! endpoint change in two IPVS requests without spawning anything, and start with few
//! processes (issue #18 item 4). Checks counts and content, never timings.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::collections::BTreeMap;
use std::path::Path;

use serde_json::Value;
use testkit::bench::{count as u, secs};

const BIN: &str = env!("CARGO_BIN_EXE_kube-ipvs");

fn run(args: &[&str]) -> Value {
    testkit::bench::run("daemon-bench", "kube-ipvs", args)
}

/// Processes by command name (the kernel's accounting keeps 15 characters of it).
fn by_name(v: &Value) -> BTreeMap<String, u64> {
    serde_json::from_value(v["start_processes_by_name"].clone()).unwrap()
}

fn check_daemon(v: &Value, source: &str, n: u64, m: u64, checks: &mut Vec<(String, bool)>) {
    let mut c = |what: &str, ok: bool| checks.push((format!("{source}: {what}"), ok));
    c("source", v["source"] == source);
    // The driver fails unless the kernel's table equals the plan; here: it was the full one.
    c(
        "converged to the full table",
        u(v, "/verified_lines") == n * (m + 1),
    );
    let changes = v["changes"].as_array().cloned().unwrap_or_default();
    c("2 changes measured", changes.len() == 2);
    for ch in &changes {
        // One endpoint replaced: one NewDest and one SetDest (the old one drains at weight 0).
        // The same sync may also delete the previous change's drained real server (one
        // GetService + GetDest of that virtual server and a DelDest): O(1) all the same.
        c("change: 1 new_dest", u(ch, "/ipvs_by_op/new_dest") == 1);
        c("change: 1 set_dest", u(ch, "/ipvs_by_op/set_dest") == 1);
        let by_op = ch["ipvs_by_op"].as_object().cloned().unwrap_or_default();
        c(
            "change: no other write than new/set/del_dest",
            by_op.keys().all(|k| {
                [
                    "new_dest",
                    "set_dest",
                    "del_dest",
                    "get_service",
                    "get_dest",
                ]
                .contains(&k.as_str())
            }),
        );
        c(
            "change: at most 10 IPVS requests",
            u(ch, "/ipvs_requests") <= 10,
        );
        c(
            "change: no full dump",
            !ch["during_full_resync"].as_bool().unwrap_or(true),
        );
        c("change: no process", u(ch, "/processes") == 0);
    }
    // Start: iptables detection (one save per backend + `iptables --version`), one restore per
    // table, the handover check (one read per table), ipset version/save/restore; a module
    // load may add one modprobe. Before issue #18 item 4 it was 17.
    let start = u(v, "/start_processes");
    c("start: at most 11 processes", (1..=11).contains(&start));
    let names = by_name(v);
    let legacy_saves = names.get("iptables-legacy").copied().unwrap_or(0)
        + names.get("ip6tables-legac").copied().unwrap_or(0);
    c("start: one legacy save (detection)", legacy_saves == 1);
    c(
        "start: no second `--version` of the chosen backend",
        names.get("iptables-nft").copied().unwrap_or(0)
            + names.get("iptables").copied().unwrap_or(0)
            <= 1,
    );
    let (steady, peak) = (u(v, "/rss_steady_kb"), u(v, "/rss_peak_kb"));
    c("rss measured, peak >= steady", steady > 0 && peak >= steady);
    for p in ["/converge_s", "/change_median_s"] {
        c(p, secs(v, p) > 0.0);
    }
}

#[test]
#[ignore = "vm"]
fn vm_daemon_bench_smoke() {
    let (n, m) = (100u64, 10u64);
    let dir = std::env::temp_dir().join(format!("daemon-bench-smoke-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let d = dir.to_str().unwrap();
    let mut checks: Vec<(String, bool)> = Vec::new();

    let p = run(&["prepare", d, "100", "10", BIN]);
    checks.push(("plan lines".into(), u(&p, "/lines") == n * (m + 1)));
    let files = std::fs::read_dir(Path::new(d).join("objects"))
        .unwrap()
        .count() as u64;
    checks.push(("2N + 1 object files".into(), files == 2 * n + 1));
    // The reference restores the plan and reads it back equal (else the driver fails).
    let r = run(&["restore", d]);
    checks.push(("restore timed".into(), secs(&r, "/restore_s") > 0.0));

    for source in ["api", "dir"] {
        let v = run(&["daemon", source, d, BIN, "2"]);
        check_daemon(&v, source, n, m, &mut checks);
    }
    let _ = std::fs::remove_dir_all(&dir);

    let failed: Vec<&str> = checks
        .iter()
        .filter(|c| !c.1)
        .map(|c| c.0.as_str())
        .collect();
    println!(
        "daemon bench smoke: {} attempted, {} succeeded, {} failed",
        checks.len(),
        checks.len() - failed.len(),
        failed.len()
    );
    assert!(failed.is_empty(), "failed checks: {failed:?}");
}
