//! Issue #17 item 7, "metrics that never move", end to end in the VM with the real binary
//! (`--source-dir`): `vm_e2e_metrics_move` scrapes `/metrics`, makes one change (a Service
//! added with annotated slices, one edited, one deleted, an endpoint removed), scrapes again and
//! checks that each metric the issue names moved:
//!
//! - `kubeproxy_network_programming_duration_seconds{ip_family}`: one observation per annotated
//!   slice (`endpoints.kubernetes.io/last-change-trigger-time`), upstream's
//!   `NetworkProgrammingLatency`;
//! - `kube_ipvs_ipvs_services` / `kube_ipvs_ipvs_destinations`: equal to what `ipvsadm -Sn`
//!   shows, before and after;
//! - `kube_ipvs_ipvs_requests_total{op}`: every command the change needs (new/set/del service,
//!   new/set/del dest) and the reads (get_service, get_dest), not only writes;
//! - the `ip_family` label (upstream 1.33) on the sync metrics, and
//!   `kubeproxy_conntrack_reconciler_sync_duration_seconds{ip_family}` (a UDP endpoint removed).

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod e2e;

use std::net::{IpAddr, Ipv4Addr};
use std::time::{Duration, SystemTime};

use e2e::{metric_value, tail, wait_until, Ep, Lab, Port, Svc, Tally};

/// Bounds a wait for the daemon to converge (only against a hang; nothing is timed).
const CONVERGE: Duration = Duration::from_secs(90);

fn v4(a: u8, b: u8, c: u8, d: u8) -> IpAddr {
    IpAddr::V4(Ipv4Addr::new(a, b, c, d))
}

/// `yaml` (a [`Svc::yaml`]) with its EndpointSlice annotated as changed at `at`, the way the
/// EndpointSlice controller does (RFC 3339 with nanoseconds).
fn annotated(yaml: &str, at: SystemTime) -> String {
    let ts = k8s_openapi::jiff::Timestamp::try_from(at).unwrap();
    let from = "kind: EndpointSlice\nmetadata:\n";
    assert!(yaml.contains(from), "{yaml}");
    yaml.replacen(
        from,
        &format!(
            "{from}  annotations: {{endpoints.kubernetes.io/last-change-trigger-time: '{ts}'}}\n"
        ),
        1,
    )
}

/// Virtual servers and real servers in `ipvsadm -Sn` text.
fn ipvs_counts(save: &str) -> (f64, f64) {
    let n = |p: &str| save.lines().filter(|l| l.starts_with(p)).count() as f64;
    (n("-A "), n("-a "))
}

const V4: &str = "{ip_family=\"IPv4\"}";

#[test]
#[ignore = "vm"]
fn vm_e2e_metrics_move() {
    let mut lab = Lab::new("e2e-metrics");
    let a = lab.add_pod("pod-a", 2, false);
    let b = lab.add_pod("pod-b", 3, false);
    let c = lab.add_pod("pod-c", 4, false);
    let (ip_a, ip_b, ip_c) = (lab.pods[a].ip, lab.pods[b].ip, lab.pods[c].ip);

    let web = |eps: Vec<Ep>, affinity: Option<u32>| {
        let mut s = Svc::new(
            "web",
            v4(10, 96, 70, 1),
            vec![Port::new("TCP", 80), Port::new("UDP", 53)],
        )
        .eps(eps);
        s.affinity = affinity;
        s
    };
    let gone =
        Svc::new("gone", v4(10, 96, 70, 2), vec![Port::new("TCP", 80)]).eps(vec![Ep::local(ip_c)]);
    let fresh = Svc::new(
        "fresh",
        v4(10, 96, 70, 3),
        vec![Port::new("TCP", 80), Port::new("UDP", 53)],
    )
    .eps(vec![Ep::local(ip_a), Ep::local(ip_b), Ep::local(ip_c)]);

    lab.write(
        "svc-web",
        &web(vec![Ep::local(ip_a), Ep::local(ip_b)], None).yaml(),
    );
    lab.write("svc-gone", &gone.yaml());
    lab.start_daemon(&[
        "--cluster-cidr",
        "10.244.0.0/16",
        "--ipvs-min-sync-period",
        "0s",
    ]);
    lab.wait_ipvs(
        &[
            "-A -t 10.96.70.1:80 -s rr",
            "-A -u 10.96.70.1:53 -s rr",
            "-A -t 10.96.70.2:80 -s rr",
        ],
        CONVERGE,
    );
    let mut t = Tally::new("item 7 (metrics that move)");

    // Before: the gauges show what is programmed (3 virtual servers, 5 real servers).
    let mut before = String::new();
    let settled = wait_until(CONVERGE, || {
        before = lab.metrics();
        let (s, d) = ipvs_counts(&lab.ipvs_save());
        metric_value(&before, "kube_ipvs_ipvs_services") == s
            && metric_value(&before, "kube_ipvs_ipvs_destinations") == d
            && before.contains("kubeproxy_sync_proxy_rules_last_timestamp_seconds{")
    });
    let save = lab.ipvs_save();
    let (s0, d0) = ipvs_counts(&save);
    t.check(
        "before: kube_ipvs_ipvs_services / _destinations = ipvsadm -Sn (3 / 5)",
        settled && (s0, d0) == (3.0, 5.0),
        format!(
            "gauges {} / {}, ipvsadm {s0} / {d0}:\n{save}",
            metric_value(&before, "kube_ipvs_ipvs_services"),
            metric_value(&before, "kube_ipvs_ipvs_destinations")
        ),
    );

    // The change, after the daemon started (earlier trigger times are not measured): `web`
    // loses pod-b (TCP: drained via weight 0, UDP: deleted with its conntrack entries) and
    // gains ClientIP affinity (an edit of its virtual servers), `fresh` is added, `gone`
    // deleted. Both slices written carry a trigger time.
    std::thread::sleep(Duration::from_millis(1100));
    let changed_at = SystemTime::now();
    lab.write(
        "svc-web",
        &annotated(&web(vec![Ep::local(ip_a)], Some(600)).yaml(), changed_at),
    );
    lab.write("svc-fresh", &annotated(&fresh.yaml(), changed_at));
    lab.remove("svc-gone");

    // Converged: pod-b drained out of web, fresh in, gone out; the gauges follow.
    let mut after = String::new();
    let mut save = String::new();
    let converged = wait_until(CONVERGE, || {
        save = lab.ipvs_save();
        after = lab.metrics();
        let (s, d) = ipvs_counts(&save);
        !save.contains("10.96.70.2:80")
            && save.contains("-A -t 10.96.70.3:80")
            && !save.contains(&format!("-a -t 10.96.70.1:80 -r {ip_b}:"))
            && !save.contains(&format!("-a -u 10.96.70.1:53 -r {ip_b}:"))
            && metric_value(&after, "kube_ipvs_ipvs_services") == s
            && metric_value(&after, "kube_ipvs_ipvs_destinations") == d
            && metric_value(
                &after,
                &format!("kubeproxy_network_programming_duration_seconds_count{V4}"),
            ) >= 2.0
    });
    let (s1, d1) = ipvs_counts(&save);
    println!("ipvsadm -Sn after the change:\n{save}");
    t.check(
        "after: kube_ipvs_ipvs_services / _destinations = ipvsadm -Sn (4 / 8) and moved",
        converged && (s1, d1) == (4.0, 8.0) && (s1, d1) != (s0, d0),
        format!(
            "gauges {} / {}, ipvsadm {s1} / {d1}; log:\n{}",
            metric_value(&after, "kube_ipvs_ipvs_services"),
            metric_value(&after, "kube_ipvs_ipvs_destinations"),
            tail(&lab.log_text(), 20)
        ),
    );

    // Network programming latency: one observation per annotated slice, none for the deletion.
    let np = |body: &str, what: &str| {
        metric_value(
            body,
            &format!("kubeproxy_network_programming_duration_seconds_{what}{V4}"),
        )
    };
    let (n0, n1) = (np(&before, "count"), np(&after, "count"));
    let sum = np(&after, "sum") - np(&before, "sum");
    println!(
        "network programming latency: {} observations, mean {:.3} s",
        n1 - n0,
        if n1 > n0 { sum / (n1 - n0) } else { 0.0 }
    );
    t.check(
        "kubeproxy_network_programming_duration_seconds{ip_family=IPv4}: 2 observations, mean under a minute",
        n1 - n0 == 2.0 && (0.0..120.0).contains(&sum),
        format!("count {n0} -> {n1}, sum of the new ones {sum}"),
    );

    // IPVS requests by command: each write kind the change needed, and the reads.
    let op = |body: &str, op: &str| {
        metric_value(
            body,
            &format!("kube_ipvs_ipvs_requests_total{{op=\"{op}\"}}"),
        )
    };
    for name in [
        "new_service",
        "set_service",
        "del_service",
        "new_dest",
        "set_dest",
        "del_dest",
    ] {
        let (x0, x1) = (op(&before, name), op(&after, name));
        t.check(
            &format!("kube_ipvs_ipvs_requests_total{{op={name}}} moved"),
            x1 > x0,
            format!("{x0} -> {x1}"),
        );
    }
    for name in ["get_service", "get_dest", "resolve_family"] {
        let x = op(&after, name);
        t.check(
            &format!("kube_ipvs_ipvs_requests_total{{op={name}}} counted"),
            x > 0.0,
            format!("{x}"),
        );
    }
    t.check(
        "no op=\"write\" series any more (every request has its command)",
        !after.contains("op=\"write\""),
        "",
    );

    // The sync metrics carry ip_family and moved with the change.
    for series in [
        "kubeproxy_sync_proxy_rules_duration_seconds_count",
        "kubeproxy_sync_partial_proxy_rules_duration_seconds_count",
        "kubeproxy_sync_proxy_rules_last_timestamp_seconds",
        "kubeproxy_sync_proxy_rules_last_queued_timestamp_seconds",
        "kubeproxy_conntrack_reconciler_sync_duration_seconds_count",
    ] {
        let s = format!("{series}{V4}");
        let (x0, x1) = (metric_value(&before, &s), metric_value(&after, &s));
        t.check(&format!("{s} moved"), x1 > x0, format!("{x0} -> {x1}"));
    }
    for series in [
        "kubeproxy_sync_full_proxy_rules_duration_seconds_count",
        "kubeproxy_sync_proxy_rules_iptables_restore_failures_total",
        "kubeproxy_conntrack_reconciler_deleted_entries_total",
    ] {
        t.check(
            &format!("{series} has ip_family"),
            after.contains(&format!("{series}{V4} ")),
            "",
        );
    }
    t.check(
        "kubeproxy_sync_proxy_rules_no_local_endpoints_total has ip_family",
        after.contains(
            "kubeproxy_sync_proxy_rules_no_local_endpoints_total{ip_family=\"IPv4\",traffic_policy=\"internal\"} 0",
        ),
        "",
    );
    let v6 = after.lines().any(|l| {
        l.starts_with("kubeproxy_sync_proxy_rules_duration_seconds_count{ip_family=\"IPv6\"}")
    });
    println!(
        "IPv6 family series present: {v6}; syncs (IPv4): {}",
        metric_value(
            &after,
            &format!("kubeproxy_sync_proxy_rules_duration_seconds_count{V4}")
        )
    );
    t.finish();
}
