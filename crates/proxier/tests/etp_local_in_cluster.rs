//! externalTrafficPolicy=Local and in-cluster traffic: the firewall-mark virtual server with all
//! cluster-policy endpoints beside the address virtual servers with the local ones, the marks
//! and the nat rules that route pod and node traffic to it.
//!
//! Upstream's iptables proxier (`syncProxyRules`, pkg/proxy/iptables/proxier.go) sends traffic
//! from local pods ("pod traffic for ... external destinations") and from the node ("route LOCAL
//! traffic ...", masqueraded) to the cluster-policy chain, and only outside traffic to the local
//! endpoints; upstream's IPVS proxier does not (k/k#75262) and drops it on nodes without a local
//! endpoint. These tests pin the former.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // test helpers

mod fixtures;

use std::collections::BTreeSet;

use desired::{is_in_cluster_mark, Desired, InClusterDest, ServiceDesired, IN_CLUSTER_MARK_MASK};
use fixtures::*;
use ipvs_netlink::{Family, Protocol, ServiceKey};
use model::{ProxyConfig, ServiceName};

fn lb_local(name: &str, cluster_ip: &str, lb: &str, node_port: i32) -> ServiceDesired {
    let s = svc("ns", name, cluster_ip)
        .node_port("http", 80, "TCP", node_port)
        .type_("LoadBalancer")
        .lb_ingress(&[lb])
        .external_ips(&["172.16.0.9"])
        .etp_local()
        .build();
    // One endpoint elsewhere, none here: the node upstream's IPVS mode blackholes.
    let sl = slice("ns", name, &format!("{name}-1"))
        .port("http", 8080, "TCP")
        .ep("10.244.9.1", "node-b", C::Ready)
        .ep("10.244.9.2", "node-b", C::Ready)
        .build();
    service_desired(&s, &[&sl], &ProxyConfig::new(Family::Inet), &node())
        .unwrap()
        .desired
        .unwrap()
}

fn fwmark_servers(d: &Desired) -> Vec<(u32, usize)> {
    d.ipvs_table()
        .iter()
        .filter_map(|(k, vs)| match k {
            ServiceKey::Fwmark { mark, .. } => Some((*mark, vs.real_servers.len())),
            ServiceKey::Inet { .. } => None,
        })
        .collect()
}

#[test]
fn local_policy_without_local_endpoint_keeps_an_all_endpoints_path_for_in_cluster_traffic() {
    let cfg = ProxyConfig::new(Family::Inet);
    let mut d = Desired::new(&cfg);
    let sd = lb_local("web", "10.96.0.10", "203.0.113.7", 30080);
    // Derived, before marks: one in-cluster port with every external destination.
    assert_eq!(sd.in_cluster.len(), 1);
    let want: BTreeSet<InClusterDest> = ["203.0.113.7", "172.16.0.9"]
        .iter()
        .map(|a| (ip(a), 80))
        .chain(node().node_port_ips(&cfg).into_iter().map(|a| (a, 30080)))
        .map(|(ip, port)| InClusterDest {
            ip,
            protocol: Protocol::Tcp,
            port,
        })
        .collect();
    assert_eq!(sd.in_cluster[0].dests, want);

    let delta = d.update_service(ServiceName::new("ns", "web"), Some(sd));
    assert!(delta.iptables_changed, "the in-cluster rules are new");
    // The address virtual servers of the external destinations stay local-only (empty here);
    // the firewall-mark one has both remote endpoints.
    let table = d.ipvs_table();
    let lb = ServiceKey::Inet {
        protocol: Protocol::Tcp,
        addr: ip("203.0.113.7"),
        port: 80,
    };
    assert!(table[&lb].real_servers.is_empty());
    let fw = fwmark_servers(&d);
    assert_eq!(fw.len(), 1, "{fw:?}");
    let (mark, n) = fw[0];
    assert_eq!(n, 2);
    assert!(is_in_cluster_mark(mark), "{mark:#x}");
    assert_eq!(mark & !IN_CLUSTER_MARK_MASK, 0);
    assert_ne!(mark & 0x4000, 0x4000, "never the masquerade bit");
    // One nat rule per destination, all with the port's mark.
    let marks = d.in_cluster_marks();
    assert_eq!(marks.len(), want.len());
    assert!(marks.iter().all(|m| m.mark == mark));
    // Owned by the proxy (cleaned up at start/handover like the address ones).
    let owned = desired::owned_by_proxy(&cfg);
    assert!(owned(&ServiceKey::Fwmark {
        family: Family::Inet,
        mark
    }));
    assert!(!owned(&ServiceKey::Fwmark {
        family: Family::Inet,
        mark: 7
    }));

    // Re-derived unchanged: same mark, nothing to do.
    let again = d.update_service(
        ServiceName::new("ns", "web"),
        Some(lb_local("web", "10.96.0.10", "203.0.113.7", 30080)),
    );
    assert!(again.is_empty(), "{again:?}");
    assert_eq!(fwmark_servers(&d), fw);

    // Gone: the firewall-mark virtual server and the rules go with it.
    let gone = d.update_service(ServiceName::new("ns", "web"), None);
    assert!(gone.iptables_changed);
    assert!(fwmark_servers(&d).is_empty());
    assert!(d.in_cluster_marks().is_empty());
}

#[test]
fn marks_are_distinct_per_port_and_stable_across_a_restart() {
    let cfg = ProxyConfig::new(Family::Inet);
    let all = |d: &mut Desired| {
        let batch: Vec<_> = (0..300)
            .map(|i| {
                let n = format!("web-{i}");
                (
                    ServiceName::new("ns", n.clone()),
                    Some(lb_local(
                        &n,
                        &format!("10.96.{}.{}", i / 200, i % 200 + 1),
                        &format!("203.0.{}.{}", i / 200, i % 200 + 1),
                        30000 + i,
                    )),
                )
            })
            .collect();
        d.update_services(batch);
    };
    let mut first = Desired::new(&cfg);
    all(&mut first);
    let marks: BTreeSet<u32> = fwmark_servers(&first).iter().map(|(m, _)| *m).collect();
    assert_eq!(marks.len(), 300, "one distinct mark per port");
    let mut restarted = Desired::new(&cfg);
    all(&mut restarted);
    assert_eq!(fwmark_servers(&restarted), fwmark_servers(&first));
}

#[test]
fn cluster_policy_ignores_internal_traffic_policy_like_upstreams_cluster_chain() {
    // internalTrafficPolicy Local restricts the ClusterIP; in-cluster traffic to the external
    // destinations still uses the cluster-policy endpoints (upstream's clusterPolicyChain).
    let s = svc("ns", "both", "10.96.0.11")
        .node_port("http", 80, "TCP", 30081)
        .etp_local()
        .itp_local()
        .build();
    let sl = slice("ns", "both", "both-1")
        .port("http", 8080, "TCP")
        .ep("10.244.9.1", "node-b", C::Ready)
        .build();
    let cfg = ProxyConfig::new(Family::Inet);
    let sd = service_desired(&s, &[&sl], &cfg, &node())
        .unwrap()
        .desired
        .unwrap();
    assert_eq!(sd.in_cluster.len(), 1);
    assert_eq!(sd.in_cluster[0].template.real_servers.len(), 1);
    // A Cluster-policy service has no in-cluster path (its external servers have everything).
    let s = svc("ns", "plain", "10.96.0.12")
        .node_port("http", 80, "TCP", 30082)
        .build();
    let sd = service_desired(&s, &[&sl], &cfg, &node())
        .unwrap()
        .desired
        .unwrap();
    assert!(sd.in_cluster.is_empty());
}
