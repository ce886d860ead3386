//! Cross-check of the desired ipset state against the real kernel: every entry the model
//! derives for every feature is accepted by `ipset restore` in a fresh network namespace and
//! reads back (`ipset save`) identical; then every service is deleted and added again one at a
//! time, as incremental syncs do, which goes over ipset netlink with no process. Needs root
//! (host: `--ignored netns_`).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // test helpers

mod fixtures;

use desired::Desired;
use fixtures::*;
use ipset::{Ipset, Runner, SetKind};
use k8s_openapi::api::core::v1::Service;
use k8s_openapi::api::discovery::v1::EndpointSlice;
use model::{ProxyConfig, ServiceName};
use testkit::netns::Netns;

fn services(v6: bool) -> Vec<(Service, Vec<EndpointSlice>)> {
    let (c, e1, e2, lb, ext, range, typ) = if v6 {
        (
            ["fd00:96::1", "fd00:96::2", "fd00:96::3"],
            "fd00:244::1",
            "fd00:244::2",
            "2001:db8::4",
            "2001:db8::8",
            "fd00::/8",
            "IPv6",
        )
    } else {
        (
            ["10.96.0.1", "10.96.0.2", "10.96.0.3"],
            "10.244.1.1",
            "10.244.1.2",
            "1.2.3.4",
            "5.6.7.8",
            "192.168.0.0/16",
            "IPv4",
        )
    };
    let sl = |svc: &str, proto: &str| {
        slice_typed("ns", svc, &format!("{svc}-1"), typ)
            .port("p", 8080, proto)
            .ep(e1, NODE, C::Ready)
            .ep(e2, "node-b", C::Ready)
            .build()
    };
    vec![
        (
            svc("ns", "lb", c[0])
                .node_port("p", 80, "TCP", 30080)
                .lb_ingress(&[lb])
                .source_ranges(&[range, "203.0.113.0/24", "2001:db8:1::/48"])
                .external_ips(&[ext])
                .etp_local()
                .hcnp(32000)
                .build(),
            vec![sl("lb", "TCP")],
        ),
        (
            svc("ns", "udp", c[1])
                .node_port("p", 53, "UDP", 30053)
                .external_ips(&[ext])
                .build(),
            vec![sl("udp", "UDP")],
        ),
        (
            svc("ns", "sctp", c[2])
                .node_port("p", 3868, "SCTP", 30868)
                .etp_local()
                .build(),
            vec![sl("sctp", "SCTP")],
        ),
    ]
}

fn check(cfg: ProxyConfig, v6: bool) {
    let ns = Netns::new(if v6 { "ipset6" } else { "ipset4" }).unwrap();
    let n = node();
    let mut d = Desired::new(&cfg);
    for (s, slices) in services(v6) {
        let refs: Vec<&EndpointSlice> = slices.iter().collect();
        let derived = service_desired(&s, &refs, &cfg, &n).unwrap();
        assert!(derived.rejected_slices.is_empty());
        d.update_service(ServiceName::of(&s), derived.desired);
    }
    let want = d.ipset_state();
    // Every one of the 17 sets gets members from this fixture except the ones it cannot use.
    let fam = cfg.family;
    let empty: Vec<SetKind> = SetKind::ALL
        .into_iter()
        .filter(|k| want.get(&k.name(fam)).unwrap().entries.is_empty())
        .collect();
    assert!(empty.len() <= 2, "unused sets: {empty:?}");

    let ipset = Ipset::new(Runner::in_netns(ns.name()));
    let names = SetKind::all_names(fam);
    let before = ipset.read(&names).unwrap();
    let report = ipset.apply(&ipset::diff(&want, &before)).unwrap();
    assert!(report.rejected.is_empty(), "{:?}", report.rejected);
    let after = ipset.read(&names).unwrap();
    let again = ipset::diff(&want, &after);
    assert!(again.is_empty(), "kernel differs: {again:?}");
    // Independent look with the ipset tool itself.
    let out = ns
        .command("ipset")
        .args(["list", &SetKind::ClusterIp.name(fam)])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    let cip = if v6 {
        "fd00:96::1,tcp:80"
    } else {
        "10.96.0.1,tcp:80"
    };
    assert!(text.contains(cip), "{text}");

    // Incremental: delete each service, then add it back, like the proxier's syncs after a
    // Service delete/add. Each is a small member-only diff: netlink, no process.
    let full = d.ipset_state();
    for (s, slices) in services(v6) {
        let name = ServiceName::of(&s);
        let mut current = ipset.read(&names).unwrap();
        d.update_service(name.clone(), None);
        let del = ipset::diff(&d.ipset_state(), &current);
        assert!(!del.dels.is_empty() && del.adds.is_empty(), "{del:?}");
        assert!(ipset.uses_netlink(&del));
        let (p0, r0) = (ipset.processes_spawned(), ipset.netlink_requests());
        let rep = ipset.apply(&del).unwrap();
        assert!(rep.rejected.is_empty(), "{:?}", rep.rejected);
        assert_eq!(ipset.processes_spawned(), p0, "{name}: no ipset process");
        assert!(ipset.netlink_requests() - r0 >= del.dels.len() as u64);
        assert_eq!(rep.requests, del.dels.len() as u64);
        current = ipset.read(&names).unwrap();
        assert!(ipset::diff(&d.ipset_state(), &current).is_empty(), "{name}");

        let refs: Vec<&EndpointSlice> = slices.iter().collect();
        let derived = service_desired(&s, &refs, &cfg, &n).unwrap();
        d.update_service(name.clone(), derived.desired);
        let add = ipset::diff(&d.ipset_state(), &current);
        assert_eq!(add.adds.len(), del.dels.len(), "{name}");
        let p0 = ipset.processes_spawned();
        let rep = ipset.apply(&add).unwrap();
        assert!(rep.rejected.is_empty(), "{:?}", rep.rejected);
        assert_eq!(ipset.processes_spawned(), p0, "{name}: no ipset process");
        assert_eq!(rep.requests, add.adds.len() as u64);
    }
    // Back where we started, as the ipset program sees it.
    assert!(ipset::diff(&full, &ipset.read(&names).unwrap()).is_empty());
}

#[test]
#[ignore = "netns"]
fn netns_desired_ipsets_accepted_by_kernel_v4() {
    check(cfg4(), false);
}

#[test]
#[ignore = "netns"]
fn netns_desired_ipsets_accepted_by_kernel_v6() {
    check(cfg6(), true);
}
