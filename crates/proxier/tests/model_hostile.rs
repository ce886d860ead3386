//! Hostile or unusual objects (issue #32): addresses the API server accepted before 1.33
//! (leading zeros, IPv4-mapped IPv6) read as upstream reads them, field by field; one bad
//! address dropping only that address (reported as a partial rejection); `/0` source ranges
//! admitting every source; each Service's budget of virtual servers, real servers and ipset
//! members (and the node-wide ipset `maxelem`) with its last good state kept; user text cut to
//! a bounded length. Model and desired-state level, then the IPVS proxier on the in-memory
//! kernel.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod fixtures;

use std::collections::BTreeSet;
use std::net::IpAddr;

use desired::ServiceDesired;
use fixtures::*;
use ipset::SetKind;
use ipvs_netlink::{Protocol, ServiceKey};
use k8s_openapi::api::core::v1::Service;
use k8s_openapi::api::discovery::v1::EndpointSlice;
use model::event::{Object, SourceEvent};
use model::objects::Svc as Compact;
use model::store::Store;
use model::{ignored_fields, ServiceBudget, CUT_MARKER, IGNORED_PREFIX, MAX_REASON_BYTES};
use proxier::ipvs_mode::{Proxier, RulesConfig};
use testkit::fake_kernel::FakeKernel;

fn sets(sd: &ServiceDesired) -> Vec<String> {
    sd.ipset_entries
        .iter()
        .map(|e| format!("{} {}", e.set.base_name(), e.entry))
        .collect()
}

fn vips(sd: &ServiceDesired) -> Vec<String> {
    sd.virtual_servers
        .keys()
        .map(|k| match k {
            ServiceKey::Inet { addr, port, .. } => format!("{addr}:{port}"),
            ServiceKey::Fwmark { mark, .. } => format!("fwmark {mark}"),
        })
        .collect()
}

fn derive(s: &Service, slices: &[&EndpointSlice]) -> ServiceDesired {
    service_desired(s, slices, &cfg4(), &node())
        .unwrap()
        .desired
        .unwrap()
}

fn ignored(s: &Service) -> Option<String> {
    ignored_fields(&Compact::from(s)).map(|i| i.reason)
}

// ---------------------------------------------------------------------------------------------
// (b) Addresses written before 1.33 validation, field by field (upstream: `ParseIPSloppy`,
// `ParseCIDRSloppy`; see `model::addr`).

#[test]
fn cluster_ip_with_leading_zeros_is_decimal() {
    let s = svc("ns", "old", "010.096.000.001")
        .port("p", 80, "TCP")
        .build();
    let ports = service_ports(&s, &cfg4()).unwrap();
    assert_eq!(ports[0].cluster_ip, ip("10.96.0.1"));
    // Dual-stack clusterIPs: the IPv4-mapped one is the IPv4 ClusterIP.
    let s = svc("ns", "mapped", "::ffff:10.96.0.2")
        .dual("fd00::2")
        .port("p", 80, "TCP")
        .build();
    assert_eq!(
        service_ports(&s, &cfg4()).unwrap()[0].cluster_ip,
        ip("10.96.0.2")
    );
    assert_eq!(
        service_ports(&s, &cfg6()).unwrap()[0].cluster_ip,
        ip("fd00::2")
    );
    // Garbage in clusterIP still rejects the Service: there is nothing to program.
    let bad = svc("ns", "bad", "10.96.0.300").port("p", 80, "TCP").build();
    assert!(service_ports(&bad, &cfg4())
        .unwrap_err()
        .reason
        .contains("invalid clusterIP \"10.96.0.300\""));
}

#[test]
fn external_ips_with_leading_zeros_or_ipv4_mapped_are_ipv4() {
    let s = svc("ns", "ext", "10.96.0.1")
        .port("p", 80, "TCP")
        .external_ips(&["010.0.0.7", "::ffff:1.2.3.4", "5.6.7.8"])
        .build();
    let sd = derive(&s, &[]);
    assert_eq!(
        vips(&sd),
        vec!["1.2.3.4:80", "5.6.7.8:80", "10.0.0.7:80", "10.96.0.1:80"]
    );
    // Not IPv6 VIPs: the IPv6 proxier has none of them.
    let v6 = service_ports(
        &svc("ns", "ext", "fd00::1")
            .port("p", 80, "TCP")
            .external_ips(&["::ffff:1.2.3.4"])
            .build(),
        &cfg6(),
    )
    .unwrap();
    assert!(v6[0].external_ips.is_empty());
    assert_eq!(ignored(&s), None, "sloppy forms are valid, nothing ignored");
}

#[test]
fn load_balancer_ips_and_source_ranges_read_sloppily() {
    let s = svc("ns", "lb", "10.96.0.1")
        .port("p", 80, "TCP")
        .lb_ingress(&["001.002.003.004", "::ffff:5.6.7.8"])
        .source_ranges(&[
            "010.000.000.000/08",
            " 192.168.001.0/24 ",
            "::ffff:172.16.0.0/112",
        ])
        .build();
    let p = &service_ports(&s, &cfg4()).unwrap()[0];
    assert_eq!(p.load_balancer_ips, vec![ip("1.2.3.4"), ip("5.6.7.8")]);
    let ranges: Vec<String> = p.source_ranges.iter().map(|n| n.to_string()).collect();
    assert_eq!(ranges, ["10.0.0.0/8", "192.168.1.0/24", "172.16.0.0/16"]);
    assert!(p.firewall);
    assert_eq!(ignored(&s), None);
}

#[test]
fn endpoint_addresses_read_sloppily_and_only_the_first_counts() {
    let s = svc("ns", "web", "10.96.0.1")
        .port("http", 80, "TCP")
        .build();
    let mut sl = slice("ns", "web", "web-1")
        .port("http", 8080, "TCP")
        .ep("010.244.001.001", "node-b", C::Ready)
        .ep("::ffff:10.244.1.2", "node-b", C::Ready)
        .build();
    // A second address is never read (the API's rule; upstream reads `Addresses[0]`).
    sl.endpoints[1].addresses.push("garbage".to_string());
    let d = service_desired(&s, &[&sl], &cfg4(), &node()).unwrap();
    assert!(d.rejected_slices.is_empty(), "{:?}", d.rejected_slices);
    let sd = d.desired.unwrap();
    let reals: Vec<String> = sd
        .virtual_servers
        .values()
        .flat_map(|vs| vs.real_servers.keys().map(|(a, p)| format!("{a}:{p}")))
        .collect();
    assert_eq!(reals, ["10.244.1.1:8080", "10.244.1.2:8080"]);
}

#[test]
fn node_primary_ips_read_sloppily() {
    let n = node_obj("node-a", "zone-a", "192.168.000.010");
    let info = model::NodeInfo::from_node("node-a", Some(&n), BTreeSet::new());
    assert_eq!(info.primary_ips, vec![ip("192.168.0.10")]);
}

// ---------------------------------------------------------------------------------------------
// (b) One bad value drops only that value, reported as a partial rejection.

#[test]
fn a_bad_address_drops_only_that_address_external_ips() {
    let s = svc("ns", "ext", "10.96.0.1")
        .port("p", 80, "TCP")
        .external_ips(&["garbage", "5.6.7.8", "", "1.2.3"])
        .build();
    let sd = derive(&s, &[]);
    assert_eq!(vips(&sd), ["5.6.7.8:80", "10.96.0.1:80"]);
    assert!(sets(&sd).contains(&"KUBE-EXTERNAL-IP 5.6.7.8,tcp:80".to_string()));
    // Reported: the first one named, the others counted; the empty string silently skipped
    // like upstream.
    assert_eq!(
        ignored(&s).as_deref(),
        Some("ignored invalid externalIP \"garbage\" (and 1 more)")
    );
}

/// Special addresses the API server's `ValidateNonSpecialIP` refuses (and multicast,
/// broadcast) never become a VIP: bound on kube-ipvs0 they would take the node's loopback and
/// link-local traffic (the soak's "bad externalIPs" object cut the node's health port and its
/// clients off before this). Each is dropped alone; the Service keeps its good addresses.
#[test]
fn special_addresses_are_never_vips() {
    let special = [
        "0.0.0.0",
        "127.0.0.1",
        "127.9.9.9",
        "169.254.169.254",
        "224.0.0.1",
        "239.1.2.3",
        "255.255.255.255",
        "0127.0.0.1",
    ];
    let mut ext = vec!["5.6.7.8"];
    ext.extend(special);
    let s = svc("ns", "ext", "10.96.0.1")
        .port("p", 80, "TCP")
        .external_ips(&ext)
        .build();
    let sd = derive(&s, &[]);
    assert_eq!(vips(&sd), ["5.6.7.8:80", "10.96.0.1:80"]);
    assert_eq!(
        ignored(&s).as_deref(),
        Some("ignored invalid externalIP \"0.0.0.0\" (unspecified) (and 7 more)")
    );
    let lb = svc("ns", "lb", "10.96.0.1")
        .port("p", 80, "TCP")
        .lb_ingress(&["1.2.3.4", "169.254.169.254"])
        .build();
    assert_eq!(vips(&derive(&lb, &[])), ["1.2.3.4:80", "10.96.0.1:80"]);
    assert_eq!(
        ignored(&lb).as_deref(),
        Some("ignored invalid load-balancer ingress IP \"169.254.169.254\" (link-local)")
    );
    for (ip, why) in [
        ("::", "unspecified"),
        ("::1", "loopback"),
        ("fe80::1", "link-local"),
        ("ff02::1", "multicast"),
        ("127.0.0.2", "loopback"),
        ("169.254.1.1", "link-local"),
        ("255.255.255.255", "broadcast"),
    ] {
        let parsed: std::net::IpAddr = ip.parse().unwrap();
        assert_eq!(model::special_vip(&parsed), Some(why), "{ip}");
    }
    for ip in [
        "1.2.3.4",
        "10.0.0.1",
        "fd00::1",
        "2001:db8::1",
        "192.168.0.10",
    ] {
        let parsed: std::net::IpAddr = ip.parse().unwrap();
        assert_eq!(model::special_vip(&parsed), None, "{ip}");
    }
}

#[test]
fn a_bad_address_drops_only_that_address_load_balancer_ips() {
    let s = svc("ns", "lb", "10.96.0.1")
        .port("p", 80, "TCP")
        .lb_ingress(&["1.2.3.4", "not-an-ip"])
        .build();
    let sd = derive(&s, &[]);
    assert_eq!(vips(&sd), ["1.2.3.4:80", "10.96.0.1:80"]);
    assert_eq!(
        ignored(&s).as_deref(),
        Some("ignored invalid load-balancer ingress IP \"not-an-ip\"")
    );
    // A ClusterIP Service's ingress is never read, so never reported.
    let c = svc("ns", "c", "10.96.0.1")
        .port("p", 80, "TCP")
        .lb_ingress(&["not-an-ip"])
        .type_("ClusterIP")
        .build();
    assert_eq!(ignored(&c), None);
}

#[test]
fn a_bad_address_drops_only_that_address_source_ranges_and_the_firewall_stays_on() {
    let s = svc("ns", "lb", "10.96.0.1")
        .port("p", 80, "TCP")
        .lb_ingress(&["1.2.3.4"])
        .source_ranges(&["10.0.0.0/33", "203.0.113.0/24"])
        .build();
    let sd = derive(&s, &[]);
    let got = sets(&sd);
    assert!(got.contains(&"KUBE-LOAD-BALANCER-FW 1.2.3.4,tcp:80".to_string()));
    assert!(
        got.contains(&"KUBE-LOAD-BALANCER-SOURCE-CIDR 1.2.3.4,tcp:80,203.0.113.0/24".to_string())
    );
    assert_eq!(
        ignored(&s).as_deref(),
        Some("ignored invalid loadBalancerSourceRange \"10.0.0.0/33\"")
    );
    // Every range invalid: the firewall stays on and admits nobody (upstream would drop the
    // ranges and open the load balancer to everyone).
    let s = svc("ns", "lb", "10.96.0.1")
        .port("p", 80, "TCP")
        .lb_ingress(&["1.2.3.4"])
        .source_ranges(&["garbage"])
        .build();
    let got = sets(&derive(&s, &[]));
    assert!(got.contains(&"KUBE-LOAD-BALANCER-FW 1.2.3.4,tcp:80".to_string()));
    assert!(
        !got.iter()
            .any(|e| e.starts_with("KUBE-LOAD-BALANCER-SOURCE")),
        "{got:?}"
    );
}

#[test]
fn a_bad_endpoint_drops_only_that_endpoint() {
    let s = svc("ns", "web", "10.96.0.1")
        .port("http", 80, "TCP")
        .build();
    let mut sl = slice("ns", "web", "web-1")
        .port("http", 8080, "TCP")
        .ep("10.244.1.1", "node-b", C::Ready)
        .ep("10.244.1.999", "node-b", C::Ready)
        .ep("fd00::5", "node-b", C::Ready)
        .ep("10.244.1.2", "node-b", C::Ready)
        .build();
    sl.endpoints.push(sl.endpoints[0].clone());
    sl.endpoints[4].addresses.clear();
    let d = service_desired(&s, &[&sl], &cfg4(), &node()).unwrap();
    let sd = d.desired.unwrap();
    let vs = sd.virtual_servers.values().next().unwrap();
    let reals: Vec<String> = vs
        .real_servers
        .keys()
        .map(|(a, p)| format!("{a}:{p}"))
        .collect();
    assert_eq!(reals, ["10.244.1.1:8080", "10.244.1.2:8080"]);
    assert_eq!(
        d.rejected_slices,
        vec![(
            "web-1".to_string(),
            model::Invalid::new(
                "ignored endpoint with invalid address \"10.244.1.999\" (and 2 more)"
            )
        )]
    );
    assert!(d.rejected_slices[0].1.reason.starts_with(IGNORED_PREFIX));
}

/// The end-to-end path of a partial rejection: a Service with one garbage externalIP programs
/// its ClusterIP and its other externalIP in the kernel, and the bad one is reported once
/// (`fields ns/name`, the key the Event publisher maps to an `InvalidField` Event on the
/// Service); fixing it clears the report.
#[test]
fn proxier_programs_the_good_addresses_and_reports_the_bad_one() {
    let good = || svc("ns", "ext", "10.96.0.1").port("http", 80, "TCP");
    let slices = vec![slice("ns", "ext", "ext-1")
        .port("http", 8080, "TCP")
        .ep("10.244.1.1", "node-b", C::Ready)
        .build()];
    let store = synced_store(
        vec![good().external_ips(&["bogus!", "5.6.7.8"]).build()],
        slices,
    );
    let mut p = Proxier::new(cfg4(), RulesConfig::default(), NODE);
    let mut k = FakeKernel::default();
    let addrs: BTreeSet<IpAddr> = [ip("192.168.0.10")].into_iter().collect();
    let r = p.sync(&store, &addrs, &mut k);
    assert!(r.ok(), "{:?}", r.errors);
    let keys: Vec<String> = k
        .ipvs
        .keys()
        .map(|k| match k {
            ServiceKey::Inet { addr, port, .. } => format!("{addr}:{port}"),
            ServiceKey::Fwmark { .. } => "fwmark".into(),
        })
        .collect();
    assert_eq!(keys, ["5.6.7.8:80", "10.96.0.1:80"]);
    assert!(k.ipvs.values().all(|vs| vs.real_servers.len() == 1));
    assert_eq!(
        k.addresses,
        [ip("5.6.7.8"), ip("10.96.0.1")].into_iter().collect()
    );
    let reported = p.take_rejections();
    assert_eq!(reported.len(), 1, "{reported:?}");
    assert_eq!(reported[0].0, "fields ns/ext");
    assert_eq!(
        reported[0].1.reason,
        "ignored invalid externalIP \"bogus!\""
    );
    // Not the Service itself: it is not counted as skipped, and a second sync reports nothing.
    assert!(p.rejections().reason("service ns/ext").is_none());
    let mut store = store;
    store.apply(SourceEvent::Apply(Object::from(
        good().external_ips(&["bogus!", "5.6.7.8"]).build(),
    )));
    p.sync(&store, &addrs, &mut k);
    assert!(p.take_rejections().is_empty());
    // Fixed: the report goes.
    let fixed = good().external_ips(&["5.6.7.8"]).build();
    let changes = store.apply(SourceEvent::Apply(Object::from(fixed)));
    p.note(&changes);
    p.sync(&store, &addrs, &mut k);
    assert!(p.rejections().reason("fields ns/ext").is_none());
}

// ---------------------------------------------------------------------------------------------
// (a) `/0` source ranges admit every source (upstream `newBaseServiceInfo`, k/k#132722).

#[test]
fn a_zero_source_range_turns_the_firewall_off_in_its_family() {
    for ranges in [
        &["0.0.0.0/0"][..],
        &["10.0.0.0/8", "0.0.0.0/0", "203.0.113.0/24"][..],
        &["1.2.3.4/0"][..],
        &["000.0.0.0/00"][..],
    ] {
        let s = svc("ns", "lb", "10.96.0.1")
            .port("p", 80, "TCP")
            .lb_ingress(&["1.2.3.4"])
            .source_ranges(ranges)
            .build();
        let p = &service_ports(&s, &cfg4()).unwrap()[0];
        assert!(!p.firewall, "{ranges:?}");
        assert!(p.source_ranges.is_empty(), "{ranges:?}");
        let got = sets(&derive(&s, &[]));
        assert!(
            !got.iter().any(|e| e.contains("LOAD-BALANCER-FW")
                || e.contains("SOURCE-CIDR")
                || e.contains("SOURCE-IP")),
            "{ranges:?}: {got:?}"
        );
        assert!(got.contains(&"KUBE-LOAD-BALANCER 1.2.3.4,tcp:80".to_string()));
    }
    // `::/0` opens the IPv6 family only; the IPv4 ranges still filter IPv4.
    let s = svc("ns", "lb", "10.96.0.1")
        .dual("fd00::1")
        .port("p", 80, "TCP")
        .lb_ingress(&["1.2.3.4", "2001:db8::4"])
        .source_ranges(&["::/0", "203.0.113.0/24"])
        .build();
    let v6 = &service_ports(&s, &cfg6()).unwrap()[0];
    assert!(!v6.firewall && v6.source_ranges.is_empty());
    let v4 = &service_ports(&s, &cfg4()).unwrap()[0];
    assert!(v4.firewall);
    assert_eq!(v4.source_ranges, vec!["203.0.113.0/24".parse().unwrap()]);
}

// ---------------------------------------------------------------------------------------------
// (c) Each Service's budget.

fn many_ports(name: &str, cip: &str, ports: i32, node_ports: bool) -> fixtures::Svc {
    (0..ports).fold(svc("ns", name, cip), |b, i| {
        if node_ports {
            b.node_port(&format!("p{i}"), 1000 + i, "TCP", 30000 + i)
        } else {
            b.port(&format!("p{i}"), 1000 + i, "TCP")
        }
    })
}

fn endpoints_slice(name: &str, port: &str, n: usize) -> Vec<EndpointSlice> {
    (0..n.div_ceil(1000))
        .map(|s| {
            (0..1000.min(n - s * 1000)).fold(
                slice("ns", name, &format!("{name}-{s}")).port(port, 8080, "TCP"),
                |b, i| {
                    let k = s * 1000 + i;
                    b.ep(
                        &format!("10.{}.{}.{}", 100 + k / 65536, (k / 256) % 256, k % 256),
                        "node-b",
                        C::Ready,
                    )
                },
            )
        })
        .map(|s| s.build())
        .collect()
}

/// The defaults never reject a Service upstream would program in a realistic cluster:
/// 1,000 ports on a LoadBalancer with 4 IPs and NodePorts; one port with 20,000 endpoints on
/// 4 load-balancer IPs and NodePorts (20,000 x 7 = 140,000 real servers).
#[test]
fn default_budget_admits_realistic_extremes() {
    let lb4 = ["1.2.3.4", "1.2.3.5", "1.2.3.6", "1.2.3.7"];
    let wide = many_ports("wide", "10.96.0.1", 1000, true)
        .lb_ingress(&lb4)
        .source_ranges(&["10.0.0.0/8", "192.168.0.0/16"])
        .build();
    let sd = derive(&wide, &[]);
    // ClusterIP + 4 LB IPs + 2 node addresses per port.
    assert_eq!(sd.virtual_servers.len(), 7000);
    // Per port: ClusterIP, 4 LB, 4 firewall, 8 source-range and 4 from-node members, the
    // NodePort; and the 5 VIPs of KUBE-IPVS-IPS.
    assert_eq!(sd.ipset_entries.len(), 22 * 1000 + 5);
    let deep = svc("ns", "deep", "10.96.0.2")
        .node_port("http", 80, "TCP", 30080)
        .lb_ingress(&lb4)
        .build();
    let slices = endpoints_slice("deep", "http", 20_000);
    let refs: Vec<&EndpointSlice> = slices.iter().collect();
    let sd = derive(&deep, &refs);
    let reals: usize = sd
        .virtual_servers
        .values()
        .map(|v| v.real_servers.len())
        .sum();
    assert_eq!(reals, 7 * 20_000);
}

#[test]
fn a_service_over_its_virtual_server_budget_is_rejected_with_the_figure() {
    // 1,000 ports x 256 externalIPs: 257,000 virtual servers from one object.
    let ext: Vec<String> = (0..256)
        .map(|i| format!("5.6.{}.{}", i / 250, i % 250))
        .collect();
    let ext: Vec<&str> = ext.iter().map(String::as_str).collect();
    let s = many_ports("huge", "10.96.0.1", 1000, false)
        .external_ips(&ext)
        .build();
    let e = service_desired(&s, &[], &cfg4(), &node()).unwrap_err();
    assert_eq!(
        e.reason,
        "over the virtual-server budget (257000 virtual servers: 1000 ports with up to 257 \
         addresses each (clusterIP, externalIPs, load-balancer IPs, 2 node addresses for \
         nodePorts), max 65536: --max-virtual-servers-per-service)"
    );
}

/// A Service over its virtual-server budget claims no VIP either: its claims (one per VIP and
/// port) were held before it was rejected, 17 MiB of RSS for the soak's 550 x 121 Service.
#[test]
fn a_service_over_its_virtual_server_budget_claims_nothing() {
    let ext: Vec<String> = (0..120).map(|i| format!("198.18.0.{}", i + 1)).collect();
    let ext: Vec<&str> = ext.iter().map(String::as_str).collect();
    let huge = many_ports("huge", "10.96.0.1", 550, false)
        .external_ips(&ext)
        .build();
    let e = desired::vip::claims_of(&Compact::from(&huge), &cfg4()).unwrap_err();
    assert!(
        e.reason
            .starts_with("over the virtual-server budget (66550 "),
        "{}",
        e.reason
    );
    // Within the budget: every (VIP, port) is claimed.
    let fits = many_ports("fits", "10.96.0.2", 10, false)
        .external_ips(&ext[..3])
        .build();
    let c = desired::vip::claims_of(&Compact::from(&fits), &cfg4()).unwrap();
    assert_eq!(c.vips.len(), 10 * 4);
}

#[test]
fn a_service_over_its_real_server_or_ipset_budget_is_rejected() {
    let mut cfg = cfg4();
    cfg.budget = ServiceBudget {
        virtual_servers: 100,
        real_servers: 2500,
        ipset_members: 50,
    };
    let s = svc("ns", "deep", "10.96.0.2")
        .port("http", 80, "TCP")
        .external_ips(&["5.6.7.8", "5.6.7.9"])
        .build();
    let slices = endpoints_slice("deep", "http", 1000);
    let refs: Vec<&EndpointSlice> = slices.iter().collect();
    let compact: Vec<model::objects::Slice> =
        refs.iter().map(|s| model::objects::Slice::of(s)).collect();
    let crefs: Vec<&model::objects::Slice> = compact.iter().collect();
    let e = desired::service_desired(&Compact::from(&s), &crefs, &cfg, &node()).unwrap_err();
    assert_eq!(
        e.reason,
        "over the real-server budget (3000 real servers in its first 1 of 1 ports, max 2500: \
         --max-real-servers-per-service)"
    );
    // ipset members: 40 ports x (ClusterIP + externalIP member) = 80 members, over 50.
    let s = many_ports("wide", "10.96.0.1", 40, false)
        .external_ips(&["5.6.7.8"])
        .build();
    let e = desired::service_desired(&Compact::from(&s), &[], &cfg, &node()).unwrap_err();
    assert!(
        e.reason.starts_with("over the ipset-member budget (")
            && e.reason
                .ends_with("max 50: --max-ipset-members-per-service)"),
        "{}",
        e.reason
    );
}

fn sync_store(svcs: Vec<Service>) -> Store {
    synced_store(svcs, Vec::new())
}

/// Over budget because the node gained addresses: the Service is rejected and keeps its last
/// good state; when the addresses go, it is derived again (rejected Services are re-derived
/// at every node change) and accepted.
#[test]
fn node_addresses_push_a_service_over_budget_it_keeps_its_last_good_state() {
    let mut cfg = cfg4();
    // 10 NodePorts: 10 x (ClusterIP + node addresses) virtual servers.
    cfg.budget.virtual_servers = 40;
    let s = many_ports("np", "10.96.0.1", 10, true).build();
    let store = sync_store(vec![s]);
    let mut p = Proxier::new(cfg, RulesConfig::default(), NODE);
    let mut k = FakeKernel::default();
    let two: BTreeSet<IpAddr> = [ip("192.168.0.10"), ip("10.0.0.10")].into_iter().collect();
    assert!(p.sync(&store, &two, &mut k).ok());
    assert_eq!(k.ipvs.len(), 30);
    let before = k.ipvs.clone();
    // Two more node addresses: 10 x 5 = 50 > 40.
    let four: BTreeSet<IpAddr> = two
        .iter()
        .copied()
        .chain([ip("192.168.1.10"), ip("192.168.2.10")])
        .collect();
    p.note_node_addresses();
    p.sync(&store, &four, &mut k);
    assert_eq!(k.ipvs, before, "last good state kept");
    let why = p.rejections().reason("service ns/np").unwrap();
    assert!(
        why.reason
            .starts_with("over the virtual-server budget (50 virtual servers"),
        "{why}"
    );
    // Back to two addresses: accepted again without a change of its own.
    p.note_node_addresses();
    p.sync(&store, &two, &mut k);
    assert!(p.rejections().reason("service ns/np").is_none());
    assert_eq!(k.ipvs.len(), 30);
}

/// A new Service over budget with no last good state programs nothing, and the other
/// Services' syncs succeed.
#[test]
fn a_service_over_budget_never_fails_the_sync_of_the_others() {
    let ext: Vec<String> = (0..256)
        .map(|i| format!("5.6.{}.{}", i / 250, i % 250))
        .collect();
    let ext: Vec<&str> = ext.iter().map(String::as_str).collect();
    let huge = many_ports("huge", "10.96.0.1", 1000, false)
        .external_ips(&ext)
        .build();
    let ok = svc("ns", "ok", "10.96.0.2").port("p", 80, "TCP").build();
    let store = sync_store(vec![huge, ok]);
    let mut p = Proxier::new(cfg4(), RulesConfig::default(), NODE);
    let mut k = FakeKernel::default();
    let addrs: BTreeSet<IpAddr> = [ip("192.168.0.10")].into_iter().collect();
    let r = p.sync(&store, &addrs, &mut k);
    assert!(r.ok(), "{:?}", r.errors);
    assert_eq!(k.ipvs.len(), 1);
    assert!(k.ipvs.contains_key(&ServiceKey::Inet {
        protocol: Protocol::Tcp,
        addr: ip("10.96.0.2"),
        port: 80
    }));
    assert!(p.rejections().reason("service ns/huge").is_some());
}

/// ipset `maxelem`, node-wide: two Services of 40,000 source-range members each (1 port x
/// 40 load-balancer IPs x 1,000 ranges, each within its own budget) do not both fit in
/// KUBE-LOAD-BALANCER-SOURCE-CIDR (maxelem 65536). The one taken in first keeps its members,
/// the other is rejected with the set named, and the sync succeeds; when the first goes, the
/// second is taken in at the next full sync. (The kernel's refusal this prevents:
/// `hostile_netns.rs`.)
#[test]
fn a_service_that_would_overfill_an_ipset_is_rejected_alone() {
    let lb = |name: &str, cip: &str, third: u8| {
        let ips: Vec<String> = (0..40).map(|i| format!("1.{third}.0.{i}")).collect();
        let ips: Vec<&str> = ips.iter().map(String::as_str).collect();
        let ranges: Vec<String> = (0..1000)
            .map(|i| format!("10.{}.{}.0/24", i / 256, i % 256))
            .collect();
        let ranges: Vec<&str> = ranges.iter().map(String::as_str).collect();
        svc("ns", name, cip)
            .port("p", 80, "TCP")
            .lb_ingress(&ips)
            .source_ranges(&ranges)
            .build()
    };
    let mut store = sync_store(vec![lb("a", "10.96.0.1", 1), lb("b", "10.96.0.2", 2)]);
    let mut p = Proxier::new(cfg4(), RulesConfig::default(), NODE);
    let mut k = FakeKernel::default();
    let addrs: BTreeSet<IpAddr> = [ip("192.168.0.10")].into_iter().collect();
    let r = p.sync(&store, &addrs, &mut k);
    assert!(r.ok(), "{:?}", r.errors);
    let cidr = SetKind::LoadBalancerSourceCidr.name(ipvs_netlink::Family::Inet);
    assert_eq!(k.ipsets.get(&cidr).unwrap().entries.len(), 40_000);
    assert_eq!(
        p.rejections().reason("service ns/b").unwrap().reason,
        "would overfill an ipset (KUBE-LOAD-BALANCER-SOURCE-CIDR would hold 80000 members, \
         maxelem 65536)"
    );
    assert!(p.rejections().reason("service ns/a").is_none());
    assert_eq!(
        p.desired().set_size(SetKind::LoadBalancerSourceCidr),
        40_000
    );
    // The first goes: the second fits and is taken in at the next full sync.
    let changes = store.apply(SourceEvent::Delete(Object::from(lb("a", "10.96.0.1", 1))));
    p.note(&changes);
    p.sync(&store, &addrs, &mut k);
    p.request_full();
    let r = p.sync(&store, &addrs, &mut k);
    assert!(r.ok(), "{:?}", r.errors);
    assert!(p.rejections().reason("service ns/b").is_none());
    let members = &k.ipsets.get(&cidr).unwrap().entries;
    assert_eq!(members.len(), 40_000);
    assert!(members.keys().all(|e| e.to_string().starts_with("1.2.0.")));
}

/// The hairpin set is the exception: two Services of 40 ports x 1,000 endpoints on this node
/// (40,000 KUBE-LOOP-BACK members each, within their budgets) do not both fit its maxelem.
/// The second is taken in without its hairpin members (its ClusterIP, virtual servers and
/// other set members programmed, a partial rejection naming the set) instead of being
/// rejected whole; a Service without local endpoints is untouched; when the first goes, the
/// second gets its hairpin members at the next full sync.
#[test]
fn a_service_that_overfills_only_the_hairpin_set_keeps_its_clusterip() {
    let many = |name: &str, cip: &str, third: u8| {
        let mut s = svc("ns", name, cip);
        let mut sl = slice("ns", name, &format!("{name}-1"));
        for p in 0..40 {
            s = s.port(&format!("p{p}"), 80 + p, "TCP");
            sl = sl.port(&format!("p{p}"), 8080 + p, "TCP");
        }
        for e in 0..1000u32 {
            sl = sl.ep(
                &format!("10.{third}.{}.{}", e / 250, e % 250),
                NODE,
                C::Ready,
            );
        }
        (s.build(), sl.build())
    };
    let (a, a_eps) = many("a", "10.96.0.1", 1);
    let (b, b_eps) = many("b", "10.96.0.2", 2);
    let c = svc("ns", "c", "10.96.0.3").port("p", 80, "TCP").build();
    let c_eps = slice("ns", "c", "c-1")
        .port("p", 8080, "TCP")
        .ep("10.3.0.1", "node-b", C::Ready)
        .build();
    let mut store = synced_store(vec![a.clone(), b, c], vec![a_eps.clone(), b_eps, c_eps]);
    let mut p = Proxier::new(cfg4(), RulesConfig::default(), NODE);
    let mut k = FakeKernel::default();
    let addrs: BTreeSet<IpAddr> = [ip("192.168.0.10")].into_iter().collect();
    let r = p.sync(&store, &addrs, &mut k);
    assert!(r.ok(), "{:?}", r.errors);
    let hairpin = SetKind::LoopBack.name(ipvs_netlink::Family::Inet);
    assert_eq!(k.ipsets.get(&hairpin).unwrap().entries.len(), 40_000);
    // b is programmed: 40 virtual servers of 1,000 real servers, its ClusterIP members.
    let b_vs: Vec<_> = k
        .ipvs
        .iter()
        .filter(|(key, _)| matches!(key, ServiceKey::Inet { addr, .. } if *addr == ip("10.96.0.2")))
        .collect();
    assert_eq!(b_vs.len(), 40);
    assert!(b_vs.iter().all(|(_, vs)| vs.real_servers.len() == 1000));
    assert!(k.addresses.contains(&ip("10.96.0.2")));
    let cluster = SetKind::ClusterIp.name(ipvs_netlink::Family::Inet);
    assert_eq!(k.ipsets.get(&cluster).unwrap().entries.len(), 81);
    assert!(p.rejections().reason("service ns/b").is_none());
    let why = &p.rejections().reason("hairpin ns/b").unwrap().reason;
    assert!(
        why.starts_with("hairpin members left out (40000 members would overfill KUBE-LOOP-BACK"),
        "{why}"
    );
    assert!(p.rejections().reason("hairpin ns/a").is_none());
    assert!(p.rejections().reason("hairpin ns/c").is_none());
    // a goes: b gets its hairpin members at the next full sync.
    let changes = store.apply(SourceEvent::Delete(Object::from(a)));
    p.note(&changes);
    let changes = store.apply(SourceEvent::Delete(Object::from(a_eps)));
    p.note(&changes);
    p.sync(&store, &addrs, &mut k);
    p.request_full();
    let r = p.sync(&store, &addrs, &mut k);
    assert!(r.ok(), "{:?}", r.errors);
    assert!(p.rejections().reason("hairpin ns/b").is_none());
    let members = &k.ipsets.get(&hairpin).unwrap().entries;
    assert_eq!(members.len(), 40_000);
    assert!(members.keys().all(|e| e.to_string().starts_with("10.2.")));
}

// ---------------------------------------------------------------------------------------------
// (d) User text is bounded.

#[test]
fn a_huge_annotation_is_cut_at_conversion_and_in_the_reason() {
    let huge = "x".repeat(200 * 1024);
    let s = svc("ns", "big", "10.96.0.1")
        .port("p", 80, "TCP")
        .annotate("kube-ipvs.io/scheduler-flags", &huge)
        .annotate("kube-ipvs.io/scheduler", &huge)
        .build();
    let c = Compact::from(&s);
    for v in [&c.scheduler, &c.scheduler_flags] {
        let v = v.as_deref().unwrap();
        assert_eq!(v.len(), 1024 + CUT_MARKER.len());
        assert!(v.ends_with(CUT_MARKER));
    }
    let e = service_desired(&s, &[], &cfg4(), &node()).unwrap_err();
    assert!(
        e.reason.len() <= MAX_REASON_BYTES + CUT_MARKER.len(),
        "{}",
        e.reason.len()
    );
    assert!(e.reason.starts_with("unknown scheduler \"xxx"));
    // Flags alone: the annotation's value cut in the reason too.
    let s = svc("ns", "big", "10.96.0.1")
        .port("p", 80, "TCP")
        .annotate("kube-ipvs.io/scheduler-flags", &huge)
        .build();
    let e = service_desired(&s, &[], &cfg4(), &node()).unwrap_err();
    assert!(e.reason.len() < 400, "{}", e.reason);
    assert!(
        e.reason.starts_with("unknown scheduler flag \"xxx"),
        "{}",
        e.reason
    );
    // A value just under the limit is kept whole (and still rejected on its merits).
    let s = svc("ns", "ok", "10.96.0.1")
        .port("p", 80, "TCP")
        .annotate("kube-ipvs.io/scheduler-flags", &"sh-port,".repeat(100))
        .annotate("kube-ipvs.io/scheduler", "sh")
        .build();
    assert!(service_desired(&s, &[], &cfg4(), &node()).is_ok());
}

#[test]
fn every_reason_is_bounded() {
    let long = "y".repeat(10_000);
    let i = model::Invalid::new(format!("{long}{long}"));
    assert_eq!(i.reason.len(), MAX_REASON_BYTES + CUT_MARKER.len());
    // Multi-byte text is never cut inside a character.
    let i = model::Invalid::new("é".repeat(2000));
    assert!(i.reason.ends_with(CUT_MARKER));
    assert!(i.reason.len() <= MAX_REASON_BYTES + CUT_MARKER.len());
    // A huge slice or port name in a reason is cut to a short quote.
    let s = svc("ns", "dup", "10.96.0.1")
        .port(&long, 80, "TCP")
        .port(&long, 81, "TCP")
        .build();
    let e = service_ports(&s, &cfg4()).unwrap_err();
    assert!(e.reason.len() < 200, "{}", e.reason);
    assert!(e.reason.contains(CUT_MARKER));
}

/// A Service the source could not decode whole (`watch::lenient`: its metadata and spec read,
/// the rest not) is rejected alone with the decode error naming the field, keeps its last good
/// state, and the other Services' changes are programmed in the same sync.
#[test]
fn an_undecodable_service_is_rejected_alone_and_keeps_its_last_good_state() {
    let web = svc("ns", "web", "10.96.0.1").port("p", 80, "TCP").build();
    let mut store = sync_store(vec![web.clone()]);
    let mut p = Proxier::new(cfg4(), RulesConfig::default(), NODE);
    let mut k = FakeKernel::default();
    let addrs: BTreeSet<IpAddr> = [ip("192.168.0.10")].into_iter().collect();
    assert!(p.sync(&store, &addrs, &mut k).ok());
    let before = k.ipvs.clone();
    assert_eq!(before.len(), 1);

    // Its next version cannot be decoded (and would have moved it to port 81), while another
    // Service arrives.
    let mut readable = svc("ns", "web", "10.96.0.1").port("p", 81, "TCP").build();
    readable.status = None;
    let odd = Compact::undecodable(
        &readable,
        "status.loadBalancer.ingress: invalid type: string \"x\", expected a sequence",
    );
    let other = svc("ns", "other", "10.96.0.2").port("p", 80, "TCP").build();
    for ev in [
        SourceEvent::Apply(Object::Service(std::sync::Arc::new(odd))),
        SourceEvent::Apply(Object::from(other)),
    ] {
        let ch = store.apply(ev);
        p.note(&ch);
    }
    let r = p.sync(&store, &addrs, &mut k);
    assert!(r.ok(), "{:?}", r.errors);
    let why = p.rejections().reason("service ns/web").unwrap();
    assert!(
        why.reason
            .starts_with("cannot be decoded: status.loadBalancer.ingress: invalid type"),
        "{why}"
    );
    let web_key = ServiceKey::Inet {
        protocol: Protocol::Tcp,
        addr: ip("10.96.0.1"),
        port: 80,
    };
    assert_eq!(k.ipvs[&web_key], before[&web_key], "last good state kept");
    assert_eq!(k.ipvs.len(), 2, "the other Service is programmed");

    // Decodable again: taken in.
    let ch = store.apply(SourceEvent::Apply(Object::from(
        svc("ns", "web", "10.96.0.1").port("p", 81, "TCP").build(),
    )));
    p.note(&ch);
    assert!(p.sync(&store, &addrs, &mut k).ok());
    assert!(p.rejections().reason("service ns/web").is_none());
    assert!(!k.ipvs.contains_key(&web_key));
    assert_eq!(k.ipvs.len(), 2);
}
