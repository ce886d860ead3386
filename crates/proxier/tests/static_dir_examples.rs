//! The bundled `examples/` manifests load cleanly and cover the features they claim to.

// Test helpers outside #[test] fns may unwrap/panic too.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::collections::BTreeSet;
use std::path::PathBuf;

use ::watch::static_dir;

fn examples_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../examples")
}

#[test]
fn examples_load_without_errors_or_warnings() {
    let res = static_dir::load(&examples_dir(), "some-host").unwrap();
    assert!(res.errors.is_empty(), "{:?}", res.errors);
    assert!(
        res.snapshot.warnings.is_empty(),
        "{:?}",
        res.snapshot.warnings
    );
    let s = res.snapshot;
    // The one Node in the directory is used for any host.
    assert_eq!(s.node_name(), "node-1");
    assert!(!s.node_synthesized);
    let labels = s.node.metadata.labels.as_ref().unwrap();
    assert_eq!(labels["topology.kubernetes.io/zone"], "eu-west-1a");
    let addrs = s.node.status.as_ref().unwrap().addresses.as_ref().unwrap();
    assert!(addrs
        .iter()
        .any(|a| a.type_ == "InternalIP" && a.address == "192.168.0.10"));

    // Every EndpointSlice belongs to a Service in the directory.
    let services: BTreeSet<(String, String)> = s
        .services
        .iter()
        .map(|x| (x.name.namespace.to_string(), x.name.name.to_string()))
        .collect();
    for eps in &s.endpoint_slices {
        // The kubernetes.io/service-name label, with the slice's namespace.
        let owner = eps.service.as_ref().unwrap();
        assert_eq!(owner.namespace, eps.namespace);
        assert!(
            services.contains(&(owner.namespace.to_string(), owner.name.to_string())),
            "EndpointSlice {:?} points at missing service {owner}",
            eps.name
        );
    }
}

#[test]
fn examples_cover_the_documented_features() {
    let s = static_dir::load(&examples_dir(), "node-1")
        .unwrap()
        .snapshot;
    let specs: Vec<_> = s.services.iter().map(|x| x.spec.clone().unwrap()).collect();
    let types: BTreeSet<String> = specs
        .iter()
        .filter_map(|x| x.type_.as_deref().map(String::from))
        .collect();
    for t in ["ClusterIP", "NodePort", "LoadBalancer"] {
        assert!(types.contains(t), "no {t} service");
    }
    let protocols: BTreeSet<String> = specs
        .iter()
        .flat_map(|x| x.ports.clone().unwrap_or_default())
        .filter_map(|p| p.protocol.as_deref().map(String::from))
        .collect();
    for p in ["TCP", "UDP", "SCTP"] {
        assert!(protocols.contains(p), "no {p} port");
    }
    assert!(specs.iter().any(|x| x
        .load_balancer_source_ranges
        .as_ref()
        .is_some_and(|r| !r.is_empty())));
    assert!(specs
        .iter()
        .any(|x| x.external_ips.as_ref().is_some_and(|r| !r.is_empty())));
    assert!(specs
        .iter()
        .any(|x| x.session_affinity.as_deref() == Some("ClientIP")));
    assert!(specs.iter().any(|x| {
        x.external_traffic_policy.as_deref() == Some("Local") && x.health_check_node_port.is_some()
    }));
    assert!(specs
        .iter()
        .any(|x| x.internal_traffic_policy.as_deref() == Some("Local")));
    // An IPv6 service (its cluster IPs hold an IPv6 address) with IPv6 endpoints.
    assert!(specs.iter().any(|x| x
        .cluster_ips
        .as_ref()
        .is_some_and(|f| f.iter().any(|ip| ip.parse::<std::net::Ipv6Addr>().is_ok()))));
    assert!(s
        .endpoint_slices
        .iter()
        .any(|e| e.address_type == model::objects::AddressType::V6));
    assert!(s
        .endpoint_slices
        .iter()
        .any(|e| e.endpoints.iter().any(|ep| ep.terminating == Some(true))));
    // Addresses stay in the documented fixture ranges.
    for x in &specs {
        for ip in x.cluster_ips.clone().unwrap_or_default() {
            assert!(
                ip.starts_with("10.96.") || ip.starts_with("fd00:10:96:"),
                "{ip}"
            );
        }
    }
    for e in &s.endpoint_slices {
        for ep in &e.endpoints {
            let a = ep.ip.to_string();
            assert!(
                a.starts_with("10.244.") || a.starts_with("fd00:10:244:"),
                "{a}"
            );
        }
    }
}
