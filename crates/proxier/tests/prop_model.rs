//! Property tests (fuzzing) of Kubernetes object → model conversion: structured-random Services
//! and EndpointSlices (valid and invalid values mixed: bad IPs, ports 0 and > 65535, unknown
//! protocols and types, duplicates, huge slices) never panic, and what the model accepts is
//! consistent: every service port has this family's clusterIP, a port in range and a unique
//! (port, protocol) and name; merged endpoints are of the port's family, unique and sorted;
//! every slice skipped whole fails `validate_slice` (one used without some endpoints passes it);
//! `Rejections` reports each new rejection exactly once through `take_new`. Cases:
//! `PROPTEST_CASES` (default 256).

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::collections::BTreeSet;
use std::net::IpAddr;

mod fixtures;

use fixtures::{endpoints, service_ports};
use ipvs_netlink::Family;
use k8s_openapi::api::core::v1::Service;
use k8s_openapi::api::discovery::v1::EndpointSlice;
use model::{
    select_endpoints, validate_slice, Invalid, ProxyConfig, Rejections, IGNORED_PREFIX,
    MAX_ENDPOINTS_PER_SERVICE_PORT,
};
use proptest::prelude::*;
use serde_json::json;

fn ip_text() -> impl Strategy<Value = String> {
    prop_oneof![
        6 => (0u8..4, any::<u8>()).prop_map(|(a, b)| format!("10.96.{a}.{b}")),
        6 => (0u8..4, any::<u8>()).prop_map(|(a, b)| format!("10.244.{a}.{b}")),
        2 => (any::<u16>()).prop_map(|a| format!("fd00::{a:x}")),
        1 => Just(String::new()),
        1 => Just("None".to_string()),
        1 => Just("10.96.0.999".to_string()),
        1 => "[ -~]{0,10}",
    ]
}

/// Endpoint addresses: mostly valid IPv4 so slices pass validation.
fn ep_ip_text() -> impl Strategy<Value = String> {
    prop_oneof![
        20 => (0u8..4, any::<u8>()).prop_map(|(a, b)| format!("10.244.{a}.{b}")),
        1 => ip_text(),
    ]
}

fn port() -> impl Strategy<Value = i64> {
    prop_oneof![
        20 => 1i64..=65535,
        1 => Just(0i64),
        1 => Just(70_000i64),
        1 => Just(-1i64),
        1 => 80i64..83,
    ]
}

fn protocol() -> impl Strategy<Value = Option<String>> {
    prop_oneof![
        8 => Just(Some("TCP".to_string())),
        1 => Just(Some("UDP".to_string())),
        1 => Just(Some("SCTP".to_string())),
        1 => Just(None),
        1 => Just(Some("FOO".to_string())),
    ]
}

fn port_name() -> impl Strategy<Value = Option<String>> {
    prop_oneof![
        4 => Just(None),
        1 => Just(Some("http".to_string())),
        1 => Just(Some("dns".to_string()))
    ]
}

fn service() -> impl Strategy<Value = Service> {
    let svc_port = (
        port_name(),
        port(),
        protocol(),
        proptest::option::of(port()),
    )
        .prop_map(|(name, port, proto, node_port)| {
            json!({"name": name, "port": port, "protocol": proto,
                   "targetPort": 8080, "nodePort": node_port})
        });
    (
        prop_oneof![
            6 => Just("ClusterIP"),
            2 => Just("NodePort"),
            2 => Just("LoadBalancer"),
            1 => Just("ExternalName"),
            1 => Just("Weird")
        ],
        proptest::collection::vec(ip_text(), 1..3),
        proptest::collection::vec(svc_port, 1..5),
        proptest::collection::vec(ip_text(), 0..2),
        prop_oneof![
            Just(None),
            Just(Some("Local")),
            Just(Some("Cluster")),
            Just(Some("Bogus"))
        ],
        prop_oneof![
            Just(None),
            Just(Some("ClientIP")),
            Just(Some("None")),
            Just(Some("X"))
        ],
        prop_oneof![
            4 => Just(Vec::new()),
            2 => Just(vec!["10.0.0.0/8".to_string()]),
            1 => proptest::collection::vec("[0-9./a-z]{0,18}", 1..3)
        ],
    )
        .prop_map(|(ty, ips, ports, ext, etp, aff, ranges)| {
            let v = json!({
                "apiVersion": "v1", "kind": "Service",
                "metadata": {"name": "s", "namespace": "ns"},
                "spec": {
                    "type": ty,
                    "clusterIP": ips.first(),
                    "clusterIPs": ips,
                    "ports": ports,
                    "externalIPs": ext,
                    "externalTrafficPolicy": etp,
                    "sessionAffinity": aff,
                    "loadBalancerSourceRanges": ranges,
                }
            });
            serde_json::from_value(v).unwrap()
        })
}

fn slice(i: usize) -> impl Strategy<Value = EndpointSlice> {
    let ep = (
        proptest::collection::vec(ep_ip_text(), 1..3),
        proptest::option::of(any::<bool>()),
        proptest::option::of(any::<bool>()),
        proptest::option::of(any::<bool>()),
        prop_oneof![Just(None), Just(Some("node-1")), Just(Some("node-2"))],
    )
        .prop_map(|(addrs, ready, serving, term, node)| {
            json!({"addresses": addrs, "nodeName": node,
                   "conditions": {"ready": ready, "serving": serving, "terminating": term}})
        });
    let slice_port = (port_name(), port(), protocol())
        .prop_map(|(name, port, proto)| json!({"name": name, "port": port, "protocol": proto}));
    (
        prop_oneof![8 => Just("IPv4"), 1 => Just("IPv6"), 1 => Just("FQDN"), 1 => Just("X")],
        proptest::collection::vec(slice_port, 1..4),
        proptest::collection::vec(ep, 0..8),
        prop_oneof![20 => Just(0usize), 1 => Just(1_001usize)],
    )
        .prop_map(move |(at, ports, mut eps, pad)| {
            // Occasionally more endpoints than the API allows in one slice.
            for k in 0..pad {
                eps.push(json!({"addresses": [format!("10.245.{}.{}", k / 250, k % 250)]}));
            }
            let v = json!({
                "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
                "metadata": {"name": format!("s-{i}"), "namespace": "ns",
                             "labels": {"kubernetes.io/service-name": "s"}},
                "addressType": at, "ports": ports, "endpoints": eps
            });
            serde_json::from_value(v).unwrap()
        })
}

fn family_of(ip: &IpAddr) -> Family {
    if ip.is_ipv4() {
        Family::Inet
    } else {
        Family::Inet6
    }
}

proptest! {
    #[test]
    fn services_and_slices_convert_consistently(
        svc in service(),
        s0 in slice(0),
        s1 in slice(1),
        s2 in slice(2),
        v6 in any::<bool>(),
    ) {
        let fam = if v6 { Family::Inet6 } else { Family::Inet };
        let cfg = ProxyConfig::new(fam);
        let slices = [&s0, &s1, &s2];
        let Ok(ports) = service_ports(&svc, &cfg) else {
            return Ok(());
        };
        let mut keys = BTreeSet::new();
        let mut names = BTreeSet::new();
        for p in &ports {
            prop_assert_eq!(family_of(&p.cluster_ip), fam);
            prop_assert!(p.port != 0);
            prop_assert!(keys.insert((p.port, p.name.protocol)), "duplicate port {:?}", p);
            prop_assert!(names.insert((p.name.port_name.clone(), p.name.protocol)));
            for ip in p.external_ips.iter().chain(&p.load_balancer_ips) {
                prop_assert_eq!(family_of(ip), fam);
            }
            let merged = endpoints(&slices, p, "node-1");
            prop_assert!(merged.endpoints.len() <= MAX_ENDPOINTS_PER_SERVICE_PORT);
            let mut prev = None;
            for e in &merged.endpoints {
                prop_assert_eq!(family_of(&e.ip), fam);
                prop_assert!(e.port != 0);
                prop_assert_eq!(e.is_local, e.node_name().map(|n| &**n) == Some("node-1"));
                let key = (e.ip, e.port);
                prop_assert!(prev < Some(key), "not sorted/unique: {:?}", merged.endpoints);
                prev = Some(key);
            }
            for (name, why) in &merged.rejected {
                let s = slices
                    .iter()
                    .find(|s| s.metadata.name.as_deref() == Some(name.as_str()))
                    .unwrap();
                // Skipped whole, or used without some endpoints (a partial rejection).
                if why.reason.starts_with(IGNORED_PREFIX) {
                    prop_assert!(validate_slice(s).is_ok(), "{why}");
                } else {
                    prop_assert!(validate_slice(s).is_err(), "{why}");
                }
            }
            let sel = select_endpoints(p, &merged.endpoints, "node-a", None);
            for e in sel.cluster.iter().chain(&sel.local).chain(&sel.external) {
                prop_assert!(merged.endpoints.contains(e));
            }
            for e in &sel.local {
                prop_assert!(e.is_local);
            }
        }
    }

    #[test]
    fn rejections_report_each_new_rejection_once(
        ops in proptest::collection::vec((0usize..4, 0usize..3, any::<bool>()), 0..40),
    ) {
        let mut r = Rejections::default();
        let mut logged = Vec::new();
        let mut taken = Vec::new();
        for (k, why, clear) in ops {
            let key = format!("service ns/s{k}");
            if clear {
                r.clear(&key);
            } else {
                let why = Invalid::new(format!("reason {why}"));
                if r.reject(&key, &why) {
                    logged.push((key, why));
                }
            }
            if k == 0 {
                taken.extend(r.take_new());
            }
        }
        taken.extend(r.take_new());
        prop_assert_eq!(&taken, &logged);
        prop_assert!(r.take_new().is_empty());
        prop_assert_eq!(r.total(), logged.len() as u64);
    }
}

/// The generators reach the accepting paths (the properties above are not vacuous): among 300
/// deterministic samples some services are accepted and some ports get endpoints.
#[test]
fn generators_reach_accepted_services_with_endpoints() {
    use proptest::strategy::ValueTree;
    use proptest::test_runner::TestRunner;
    let mut runner = TestRunner::deterministic();
    let strat = (service(), slice(0), slice(1));
    let (mut accepted, mut with_endpoints, mut rejected_slices, mut nports) = (0, 0, 0, 0);
    for _ in 0..300 {
        let (svc, a, b) = strat.new_tree(&mut runner).unwrap().current();
        let Ok(ports) = service_ports(&svc, &ProxyConfig::new(Family::Inet)) else {
            continue;
        };
        accepted += 1;
        nports += ports.len();
        for p in &ports {
            let m = endpoints(&[&a, &b], p, "node-1");
            if !m.endpoints.is_empty() {
                with_endpoints += 1;
            }
            rejected_slices += m.rejected.len();
        }
    }
    println!(
        "300 samples: {accepted} services accepted, {nports} ports, {with_endpoints} ports with \
         endpoints, {rejected_slices} slices rejected"
    );
    assert!(accepted > 0 && with_endpoints > 0 && rejected_slices > 0);
}
