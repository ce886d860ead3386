//! Smoke test of the benchmark driver (`examples/controller-bench.rs`, used by
//! `cargo xtask bench`): at N = 100 services x 10 reals it programs a real kernel in the VM,
//! checks the kernel against `ipvsadm --restore` of the identical table, and reports sane
//! figures. Checks counts and consistency, never timings.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use serde_json::Value;
use testkit::bench::{count as u, secs};

fn run(args: &[&str]) -> Value {
    testkit::bench::run("controller-bench", "controller", args)
}

#[test]
#[ignore = "vm"]
fn vm_bench_smoke() {
    let (n, m) = (100u64, 10u64);
    let v = run(&["run", "100", "10"]);
    let mut checks: Vec<(&str, bool)> = Vec::with_capacity(32);
    // P1: every virtual server and real server written once, from one read of the table; the
    // driver itself already checked ipvsadm -Sn == the desired table == ipvsadm --restore.
    checks.push((
        "p1 ipvs writes = N*(M+1)",
        u(&v, "/p1/requests/ipvs_writes") == n * (m + 1),
    ));
    checks.push(("p1 one ipvs dump", u(&v, "/p1/requests/ipvs_reads") == 1));
    checks.push((
        "p1 one address per VIP",
        u(&v, "/p1/requests/address_writes") >= n,
    ));
    checks.push((
        "ipvsadm -Sn lines",
        u(&v, "/ipvsadm_sn_lines") == n * (m + 1),
    ));
    // P2: one endpoint = one NewDest + one SetDest(weight 0, draining); add = 1 + M; delete = 1.
    checks.push((
        "p2 endpoint: 2 ipvs writes",
        u(&v, "/p2/endpoint/requests/ipvs_writes") == 2,
    ));
    checks.push((
        "p2 endpoint: no dump",
        u(&v, "/p2/endpoint/requests/ipvs_reads") == 0,
    ));
    checks.push((
        "p2 endpoint: <= 10 requests",
        u(&v, "/p2/endpoint/netlink_requests") <= 10,
    ));
    checks.push((
        "p2 endpoint: no iptables",
        u(&v, "/p2/endpoint/requests/iptables_processes") == 0,
    ));
    checks.push((
        "p2 add: 1+M ipvs writes",
        u(&v, "/p2/add-service/requests/ipvs_writes") == 1 + m,
    ));
    checks.push((
        "p2 delete: 1 ipvs write",
        u(&v, "/p2/delete-service/requests/ipvs_writes") == 1,
    ));
    // The ClusterIP's set members (KUBE-CLUSTER-IP, KUBE-IPVS-IPS) go over ipset netlink: one
    // request each, no ipset process (the one-time protocol probe ran when NodeKernel opened).
    for c in ["add-service", "delete-service"] {
        checks.push((
            "p2 add/delete: no ipset process",
            u(&v, &format!("/p2/{c}/requests/ipset_processes")) == 0,
        ));
        checks.push((
            "p2 add/delete: 2 ipset requests",
            u(&v, &format!("/p2/{c}/requests/ipset_requests")) == 2,
        ));
    }
    // P4: the drift check is one services list at the full sync, then one read per slice of
    // `CHECK_SLICE` virtual servers (the driver checks each virtual server's real servers were
    // read exactly once), and no write.
    let slices = n.div_ceil(proxier::ipvs_mode::CHECK_SLICE as u64);
    checks.push((
        "p4 one list and one read per slice",
        u(&v, "/p4/requests/ipvs_reads") == 1 + slices,
    ));
    checks.push(("p4 no writes", u(&v, "/p4/requests/ipvs_writes") == 0));
    // P3: figures from /proc are present and ordered.
    let (peak, steady, base) = (
        u(&v, "/p3/rss_peak_kb"),
        u(&v, "/p3/rss_steady_kb"),
        u(&v, "/p3/rss_base_kb"),
    );
    checks.push(("p3 rss base > 0", base > 0));
    checks.push((
        "p3 peak >= steady >= base",
        peak >= steady && steady >= base,
    ));
    // Times are measured (positive), not judged.
    for p in [
        "/p1/total_s",
        "/p1/ipvs_s",
        "/p4/total_s",
        "/ipvsadm_restore_s",
        "/p4/ipvsadm_save_s",
    ] {
        checks.push((p, secs(&v, p) > 0.0));
    }

    // P5 at a small size: one restore (plus one read) versus one process per entry.
    let i = run(&["ipset", "500", "20"]);
    checks.push(("p5 entries", u(&i, "/entries") == 500));
    checks.push(("p5 ours <= 2 processes", u(&i, "/ours_processes") <= 2));
    checks.push(("p5 per-entry sample", u(&i, "/per_entry_sample") == 20));
    checks.push((
        "p5 times",
        secs(&i, "/ours_s") > 0.0 && secs(&i, "/per_entry_s") > 0.0,
    ));

    let failed: Vec<&str> = checks.iter().filter(|c| !c.1).map(|c| c.0).collect();
    println!(
        "bench smoke: {} attempted, {} succeeded, {} failed",
        checks.len(),
        checks.len() - failed.len(),
        failed.len()
    );
    assert!(failed.is_empty(), "failed checks: {failed:?}\n{v}\n{i}");
}
