//! Desired state and diff: incremental deltas with reference counts, op counts at scale
//! (1,000 services), startup adoption and drift, ordering within a batch.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // test helpers

mod fixtures;

use std::collections::BTreeSet;

use desired::diff::{diff_ipvs, diff_set, IpvsTable};
use desired::{owned_by_proxy, Delta, Desired, IpsetEntry, ServiceDesired};
use fixtures::*;
use ipset::SetKind;
use ipvs_netlink::{Family, Op, Protocol, Service, ServiceFlags, ServiceKey, Stats};
use k8s_openapi::api::core::v1::Service as KubeService;
use k8s_openapi::api::discovery::v1::EndpointSlice;
use model::{NodeInfo, ProxyConfig, ServiceName};

const N: usize = 1_000;
const EPS: usize = 10;

fn cluster_ip(i: usize) -> String {
    format!("10.96.{}.{}", i / 250, i % 250 + 1)
}

fn ep_ip(i: usize, j: usize) -> String {
    format!("10.{}.{}.{}", 100 + i / 250, i % 250, j + 1)
}

/// Service i: ClusterIP + NodePort (2 node IPs) → 3 virtual servers, 10 endpoints each.
fn kube_service(i: usize) -> (KubeService, EndpointSlice) {
    let name = format!("svc-{i:04}");
    let s = svc("ns", &name, &cluster_ip(i))
        .node_port("http", 80, "TCP", 30000 + i as i32)
        .build();
    let sl = (0..EPS).fold(
        slice("ns", &name, &format!("{name}-1")).port("http", 8080, "TCP"),
        |b, j| b.ep(&ep_ip(i, j), "node-b", C::Ready),
    );
    (s, sl.build())
}

fn derive(
    s: &KubeService,
    sl: &[&EndpointSlice],
    cfg: &ProxyConfig,
    n: &NodeInfo,
) -> ServiceDesired {
    service_desired(s, sl, cfg, n).unwrap().desired.unwrap()
}

fn name(i: usize) -> ServiceName {
    ServiceName::new("ns", format!("svc-{i:04}"))
}

fn big() -> (Desired, ProxyConfig, NodeInfo) {
    let cfg = cfg4();
    let n = node();
    let mut d = Desired::new(&cfg);
    let all: Vec<(ServiceName, Option<ServiceDesired>)> = (0..N)
        .map(|i| {
            let (s, sl) = kube_service(i);
            (name(i), Some(derive(&s, &[&sl], &cfg, &n)))
        })
        .collect();
    let delta = d.update_services(all);
    // 3 virtual servers + 30 real servers per service.
    assert_eq!(delta.ipvs.apply.len(), N * (3 + 3 * EPS));
    assert_eq!(delta.addresses_add.len(), N);
    (d, cfg, n)
}

fn key_addr(k: &ServiceKey) -> std::net::IpAddr {
    match k {
        ServiceKey::Inet { addr, .. } => *addr,
        ServiceKey::Fwmark { .. } => panic!("fwmark"),
    }
}

fn op_key(op: &Op) -> ServiceKey {
    match op {
        Op::NewService(s) | Op::SetService(s) => s.key,
        Op::DelService(k) | Op::NewDest(k, _) | Op::SetDest(k, _) | Op::DelDest(k, _, _) => *k,
        other => panic!("unexpected op {other:?}"),
    }
}

#[test]
fn model_desired_1000_services_change_one_endpoint() {
    let (mut d, cfg, n) = big();
    let i = 500;
    let (s, mut sl) = kube_service(i);
    sl.endpoints[3].addresses = vec!["10.200.0.1".to_string()];
    let before_table = d.ipvs_table();
    let delta = d.update_service(name(i), Some(derive(&s, &[&sl], &cfg, &n)));
    // One real server replaced in 3 virtual servers: 3 NewDest + 3 DelDest.
    assert!(delta.ipvs.len() <= 10, "{} ops", delta.ipvs.len());
    assert_eq!(delta.ipvs.len(), 6);
    let keys: BTreeSet<ServiceKey> = derive(&s, &[&sl], &cfg, &n)
        .virtual_servers
        .keys()
        .copied()
        .collect();
    for op in &delta.ipvs.apply {
        assert!(keys.contains(&op_key(op)), "op outside the service: {op:?}");
        assert!(matches!(op, Op::NewDest(..) | Op::DelDest(..)), "{op:?}");
    }
    // New before delete: the virtual server never loses more than it must.
    let first_del = delta
        .ipvs
        .apply
        .iter()
        .position(|o| matches!(o, Op::DelDest(..)))
        .unwrap();
    assert!(delta.ipvs.apply[..first_del]
        .iter()
        .all(|o| matches!(o, Op::NewDest(..))));
    assert!(delta.addresses_add.is_empty() && delta.addresses_del.is_empty());
    assert!(delta.ipset_add.is_empty() && delta.ipset_del.is_empty());
    assert!(!delta.iptables_changed);
    // Applying the delta to the previous table gives the new table.
    let mut t = before_table;
    apply_ops(&mut t, &delta.ipvs.clone().into_vec());
    assert_eq!(t, d.ipvs_table());
}

/// Executes ops on an in-memory table (a model of the kernel) to check deltas compose.
fn apply_ops(t: &mut IpvsTable, ops: &[Op]) {
    use desired::diff::VirtualServer;
    for op in ops {
        match op {
            Op::NewService(s) => {
                assert!(
                    !t.contains_key(&s.key),
                    "NewService on existing {:?}",
                    s.key
                );
                t.insert(s.key, VirtualServer::new(s.clone(), []));
            }
            Op::SetService(s) => t.get_mut(&s.key).unwrap().service = s.clone(),
            Op::DelService(k) => {
                t.remove(k).unwrap();
            }
            Op::NewDest(k, dst) => {
                let vs = t.get_mut(k).unwrap();
                assert!(vs
                    .real_servers
                    .insert((dst.addr, dst.port), dst.clone())
                    .is_none());
            }
            Op::SetDest(k, dst) => {
                let vs = t.get_mut(k).unwrap();
                assert!(vs
                    .real_servers
                    .insert((dst.addr, dst.port), dst.clone())
                    .is_some());
            }
            Op::DelDest(k, a, p) => {
                t.get_mut(k)
                    .unwrap()
                    .real_servers
                    .remove(&(*a, *p))
                    .unwrap();
            }
            other => panic!("unexpected {other:?}"),
        }
    }
}

#[test]
fn model_desired_1000_services_add_one() {
    let (mut d, cfg, n) = big();
    let (s, sl) = kube_service(N);
    let sd = derive(&s, &[&sl], &cfg, &n);
    let delta = d.update_service(name(N), Some(sd.clone()));
    // Exactly that service's requests: 3 NewService + 30 NewDest.
    assert_eq!(delta.ipvs.len(), 3 + 3 * EPS);
    assert!(delta.ipvs.remove.is_empty());
    let mut seen_new = BTreeSet::new();
    for op in &delta.ipvs.apply {
        let k = op_key(op);
        assert!(sd.virtual_servers.contains_key(&k));
        match op {
            Op::NewService(_) => {
                seen_new.insert(k);
            }
            Op::NewDest(..) => assert!(seen_new.contains(&k), "NewDest before its NewService"),
            other => panic!("{other:?}"),
        }
    }
    assert_eq!(delta.addresses_add, vec![ip(&cluster_ip(N))]);
    let want: Vec<IpsetEntry> = sd.ipset_entries.iter().cloned().collect();
    assert_eq!(
        delta.ipset_add.iter().cloned().collect::<BTreeSet<_>>(),
        want.into_iter().collect()
    );
    assert_eq!(
        delta.ipset_add.last().map(|e| e.set),
        Some(SetKind::IpvsIps),
        "KUBE-IPVS-IPS entries come last"
    );
    assert!(!delta.iptables_changed, "node ports were already in use");
}

/// What a kernel read returns for a table: counters, HASHED flag, connection counts.
fn as_read_from_kernel(t: &IpvsTable) -> IpvsTable {
    let mut t = t.clone();
    for vs in t.values_mut() {
        vs.service.flags = vs.service.flags.with(ServiceFlags::HASHED);
        vs.service.stats = Some(Box::new(Stats {
            conns: 7,
            ..Default::default()
        }));
        for mut d in vs.real_servers.values_mut() {
            d.active_conns = 3;
            d.inactive_conns = 1;
            d.stats = Some(Box::default());
        }
    }
    t
}

#[test]
fn model_desired_resync_without_drift_is_silent() {
    let (d, cfg, _) = big();
    let desired = d.ipvs_table();
    let actual = as_read_from_kernel(&desired);
    let owned = owned_by_proxy(&cfg);
    let ops = diff_ipvs(&desired, &actual, &owned);
    assert!(ops.is_empty(), "{} ops", ops.len());
    assert!(d.diff_ipvs(&actual, &owned).is_empty());
    let (add, del) = diff_set(&d.addresses(), &d.addresses(), &|_| true);
    assert!(add.is_empty() && del.is_empty());
}

#[test]
fn model_desired_startup_adopts_and_repairs_drift() {
    let cfg = {
        let mut c = cfg4();
        c.exclude_cidrs = vec!["10.250.0.0/16".parse().unwrap()];
        c
    };
    let n = node();
    let mut d = Desired::new(&cfg);
    let mut sds = Vec::new();
    for i in 0..5 {
        let (s, sl) = kube_service(i);
        sds.push((name(i), Some(derive(&s, &[&sl], &cfg, &n))));
    }
    d.update_services(sds);
    let desired = d.ipvs_table();
    let mut actual = as_read_from_kernel(&desired);
    let keys: Vec<ServiceKey> = desired.keys().copied().collect();
    // 1. weight 0 left by a previous run's graceful termination → SetDest.
    let d0 = actual.get_mut(&keys[0]).unwrap();
    let first = d0.real_servers.keys().next().unwrap();
    d0.real_servers.get_mut(&first).unwrap().weight = 0;
    // 2. a scheduler changed → SetService.
    actual.get_mut(&keys[1]).unwrap().service.scheduler = "wrr".into();
    // 3. a missing virtual server → NewService + NewDests.
    let missing = actual.remove(&keys[2]).unwrap();
    // 4. a stale real server → DelDest; 5. a missing one → NewDest.
    let d3 = actual.get_mut(&keys[3]).unwrap();
    let gone = d3.real_servers.keys().next().unwrap();
    d3.real_servers.remove(&gone);
    let mut stale = ipvs_netlink::Destination::new(ip("10.99.0.1"), 8080);
    stale.active_conns = 5;
    d3.real_servers.insert((stale.addr, stale.port), stale);
    // 6. stale owned virtual server → DelService; excluded one and fwmark one stay.
    let stale_key = ServiceKey::Inet {
        protocol: Protocol::Tcp,
        addr: ip("10.96.9.9"),
        port: 80,
    };
    let excluded_key = ServiceKey::Inet {
        protocol: Protocol::Tcp,
        addr: ip("10.250.0.1"),
        port: 80,
    };
    let fwmark_key = ServiceKey::Fwmark {
        family: Family::Inet,
        mark: 7,
    };
    let v6_key = ServiceKey::Inet {
        protocol: Protocol::Udp,
        addr: ip("fd00::99"),
        port: 53,
    };
    for k in [stale_key, excluded_key, fwmark_key, v6_key] {
        actual.insert(
            k,
            desired::diff::VirtualServer::new(Service::new(k, "rr"), []),
        );
    }
    let owned = owned_by_proxy(&cfg);
    let ops = diff_ipvs(&desired, &actual, &owned);
    // The proxier's form, which does not build the desired table, gives the same operations.
    assert_eq!(d.diff_ipvs(&actual, &owned), ops);
    // So does the first sync's form, generated a few virtual servers at a time.
    let all = d.ipvs_keys();
    assert_eq!(all, desired.keys().copied().collect::<Vec<_>>());
    for per_part in [1, 2, 3, all.len()] {
        let apply: Vec<Op> = all
            .chunks(per_part)
            .flat_map(|part| d.diff_ipvs_keys(part, &actual))
            .collect();
        assert_eq!(apply, ops.apply, "{per_part} virtual servers per part");
    }
    assert_eq!(d.diff_ipvs_undesired(&actual, &owned), ops.remove);
    let mut want_apply = vec![
        Op::SetDest(keys[0], desired[&keys[0]].real_servers.get(&first).unwrap()),
        Op::SetService(desired[&keys[1]].service.clone()),
        Op::NewService(missing.service.clone()),
    ];
    let mut m = missing.service.clone();
    m.flags = ServiceFlags::default();
    for dst in desired[&keys[2]].real_servers.values() {
        want_apply.push(Op::NewDest(keys[2], dst));
    }
    want_apply.push(Op::NewDest(
        keys[3],
        desired[&keys[3]].real_servers.get(&gone).unwrap(),
    ));
    want_apply.push(Op::DelDest(keys[3], ip("10.99.0.1"), 8080));
    // NewService carries the desired service (no kernel-only flags).
    want_apply[2] = Op::NewService(desired[&keys[2]].service.clone());
    assert_eq!(ops.apply, want_apply);
    assert_eq!(ops.remove, vec![Op::DelService(stale_key)]);

    // After applying, the table matches and a second diff is empty.
    let mut t = actual.clone();
    apply_ops(&mut t, &ops.clone().into_vec());
    assert!(diff_ipvs(&desired, &t, &owned).is_empty());

    // Addresses: adopt, add missing, remove only owned.
    let want: BTreeSet<_> = [ip("10.96.0.1"), ip("10.96.0.2")].into();
    let have: BTreeSet<_> = [ip("10.96.0.2"), ip("10.96.7.7"), ip("10.250.0.1")].into();
    let (add, del) = diff_set(&want, &have, &|a| !cfg.excluded(a));
    assert_eq!(add, vec![ip("10.96.0.1")]);
    assert_eq!(del, vec![ip("10.96.7.7")]);
}

#[test]
fn model_desired_cleanup_is_diff_against_empty() {
    let (d, cfg, _) = big();
    let actual = d.ipvs_table();
    let owned = owned_by_proxy(&cfg);
    let ops = diff_ipvs(&IpvsTable::new(), &actual, &owned);
    assert!(ops.apply.is_empty());
    assert_eq!(ops.remove.len(), 3 * N);
}

#[test]
fn model_desired_remove_service_phases() {
    let (mut d, _, _) = big();
    let delta = d.update_service(name(7), None);
    assert!(delta.ipvs.apply.is_empty());
    assert_eq!(delta.ipvs.remove.len(), 3);
    assert!(delta
        .ipvs
        .remove
        .iter()
        .all(|o| matches!(o, Op::DelService(_))));
    assert_eq!(delta.addresses_del, vec![ip(&cluster_ip(7))]);
    assert_eq!(
        delta.ipset_del.first().map(|e| e.set),
        Some(SetKind::IpvsIps),
        "KUBE-IPVS-IPS entries go first"
    );
    assert_eq!(d.len(), N - 1);
}

fn ext_service(name: &str, cip: &str, port: i32, ext: &str, ep: &str) -> ServiceDesired {
    let s = svc("ns", name, cip)
        .port("http", port, "TCP")
        .external_ips(&[ext])
        .build();
    let sl = slice("ns", name, &format!("{name}-1"))
        .port("http", 8080, "TCP")
        .ep(ep, "node-b", C::Ready)
        .build();
    derive(&s, &[&sl], &cfg4(), &node())
}

#[test]
fn model_desired_shared_address_is_reference_counted() {
    let mut d = Desired::new(&cfg4());
    let a = ext_service("a", "10.96.0.1", 80, "5.6.7.8", "10.244.0.1");
    let b = ext_service("b", "10.96.0.2", 443, "5.6.7.8", "10.244.0.2");
    let da = d.update_service(ServiceName::new("ns", "a"), Some(a));
    assert_eq!(da.addresses_add, vec![ip("5.6.7.8"), ip("10.96.0.1")]);
    let db = d.update_service(ServiceName::new("ns", "b"), Some(b));
    assert_eq!(
        db.addresses_add,
        vec![ip("10.96.0.2")],
        "5.6.7.8 already bound"
    );
    let gone = d.update_service(ServiceName::new("ns", "a"), None);
    assert_eq!(
        gone.addresses_del,
        vec![ip("10.96.0.1")],
        "5.6.7.8 still used by b"
    );
    assert!(!gone
        .ipset_del
        .iter()
        .any(|e| e.set == SetKind::IpvsIps && e.entry == ipset::Entry::Ip(ip("5.6.7.8"))));
    assert_eq!(gone.ipvs.remove.len(), 2, "a's ClusterIP and externalIP:80");
    let last = d.update_service(ServiceName::new("ns", "b"), None);
    assert!(last.addresses_del.contains(&ip("5.6.7.8")));
    assert!(d.addresses().is_empty() && d.ipset_entries().is_empty());
    assert!(d.ipvs_table().is_empty());
}

#[test]
fn model_desired_conflicting_key_changes_hands_in_place() {
    let mut d = Desired::new(&cfg4());
    let a = ext_service("a", "10.96.0.1", 80, "5.6.7.8", "10.244.0.1");
    let b = ext_service("b", "10.96.0.2", 80, "5.6.7.8", "10.244.0.2");
    d.update_service(ServiceName::new("ns", "b"), Some(b));
    // a sorts first: it takes over 5.6.7.8:80 with dest changes, not a delete/re-create.
    let delta = d.update_service(ServiceName::new("ns", "a"), Some(a));
    let ext = ServiceKey::Inet {
        protocol: Protocol::Tcp,
        addr: ip("5.6.7.8"),
        port: 80,
    };
    let on_ext: Vec<&Op> = delta
        .ipvs
        .apply
        .iter()
        .filter(|o| op_key(o) == ext)
        .collect();
    assert_eq!(
        on_ext,
        vec![
            &Op::NewDest(ext, ipvs_netlink::Destination::new(ip("10.244.0.1"), 8080)),
            &Op::DelDest(ext, ip("10.244.0.2"), 8080),
        ]
    );
    assert!(delta.ipvs.remove.is_empty());
    assert_eq!(
        d.conflicts().get(&ext).map(|v| v.len()),
        Some(2),
        "conflict reported"
    );
    // a leaves: b gets it back.
    let delta = d.update_service(ServiceName::new("ns", "a"), None);
    assert!(!delta.ipvs.remove.contains(&Op::DelService(ext)));
    assert!(delta.ipvs.apply.contains(&Op::NewDest(
        ext,
        ipvs_netlink::Destination::new(ip("10.244.0.2"), 8080)
    )));
    assert!(d.conflicts().is_empty());
}

#[test]
fn model_desired_batch_is_net() {
    // Within one batch, a drops 5.6.7.8 and b takes it: it stays bound, no unbind/rebind.
    let mut d = Desired::new(&cfg4());
    let a = ext_service("a", "10.96.0.1", 80, "5.6.7.8", "10.244.0.1");
    d.update_service(ServiceName::new("ns", "a"), Some(a));
    let a2 = ext_service("a", "10.96.0.1", 80, "5.6.7.9", "10.244.0.1");
    let b = ext_service("b", "10.96.0.2", 81, "5.6.7.8", "10.244.0.2");
    let delta = d.update_services([
        (ServiceName::new("ns", "a"), Some(a2)),
        (ServiceName::new("ns", "b"), Some(b)),
    ]);
    assert!(!delta.addresses_del.contains(&ip("5.6.7.8")));
    assert!(!delta.addresses_add.contains(&ip("5.6.7.8")));
    assert_eq!(delta.addresses_add, vec![ip("5.6.7.9"), ip("10.96.0.2")]);
}

#[test]
fn model_desired_iptables_features_and_health_checks() {
    let cfg = cfg4();
    let n = node();
    let mut d = Desired::new(&cfg);
    let plain = svc("ns", "p", "10.96.0.1").port("http", 80, "TCP").build();
    let delta = d.update_service(
        ServiceName::new("ns", "p"),
        Some(derive(&plain, &[], &cfg, &n)),
    );
    assert!(!delta.iptables_changed);
    let lb = svc("ns", "lb", "10.96.0.2")
        .node_port("http", 80, "TCP", 30080)
        .lb_ingress(&["1.2.3.4"])
        .source_ranges(&["10.0.0.0/8"])
        .etp_local()
        .hcnp(32000)
        .build();
    let sl = slice("ns", "lb", "lb-1")
        .port("http", 8080, "TCP")
        .ep("10.244.0.1", NODE, C::Ready)
        .build();
    let delta = d.update_service(
        ServiceName::new("ns", "lb"),
        Some(derive(&lb, &[&sl], &cfg, &n)),
    );
    assert!(delta.iptables_changed);
    let ipt = d.iptables();
    assert!(ipt.node_ports && ipt.load_balancers && ipt.lb_source_ranges);
    assert!(ipt.health_check_node_ports && ipt.node_ports_local && ipt.loop_back);
    assert!(!ipt.external_ips && !ipt.sctp_node_ports);
    assert_eq!(delta.health_checks.len(), 1);
    assert_eq!(delta.health_checks[0].1.map(|h| h.local_endpoints), Some(1));
    assert_eq!(
        d.node_dependent_services(),
        [ServiceName::new("ns", "lb")].into()
    );
    // Local endpoint goes away: health check count changes, the hairpin feature goes off.
    let delta = d.update_service(
        ServiceName::new("ns", "lb"),
        Some(derive(&lb, &[], &cfg, &n)),
    );
    assert!(delta.iptables_changed);
    assert!(!d.iptables().loop_back && d.iptables().lb_source_ranges);
    assert_eq!(delta.health_checks[0].1.map(|h| h.local_endpoints), Some(0));
    let delta = d.update_service(ServiceName::new("ns", "lb"), None);
    assert!(delta.iptables_changed);
    assert_eq!(
        delta.health_checks,
        vec![(ServiceName::new("ns", "lb"), None)]
    );
    assert!(d.health_checks().is_empty());
}

#[test]
fn model_desired_node_address_change_touches_node_ports_only() {
    let (mut d, cfg, mut n) = big();
    // A ClusterIP-only service is not node dependent.
    let plain = svc("ns", "zz-plain", "10.97.0.1")
        .port("http", 80, "TCP")
        .build();
    d.update_service(
        ServiceName::new("ns", "zz-plain"),
        Some(derive(&plain, &[], &cfg, &n)),
    );
    let dep = d.node_dependent_services();
    assert_eq!(dep.len(), N);
    n.addresses.insert(ip("192.168.1.20"));
    let changes: Vec<(ServiceName, Option<ServiceDesired>)> = (0..N)
        .map(|i| {
            let (s, sl) = kube_service(i);
            (name(i), Some(derive(&s, &[&sl], &cfg, &n)))
        })
        .collect();
    let delta: Delta = d.update_services(changes);
    // One new NodePort virtual server per service, with its 10 real servers.
    assert_eq!(delta.ipvs.len(), N * (1 + EPS));
    assert!(delta.ipvs.apply.iter().all(|o| match o {
        Op::NewService(s) => key_addr(&s.key) == ip("192.168.1.20"),
        Op::NewDest(k, _) => key_addr(k) == ip("192.168.1.20"),
        _ => false,
    }));
    assert!(delta.addresses_add.is_empty());
}

#[test]
fn model_desired_ipset_state_view() {
    let (d, _, _) = big();
    let st = d.ipset_state();
    // 1,000 cluster-IP entries, 1,000 node ports, 1,000 KUBE-IPVS-IPS members.
    assert_eq!(st.entry_count(), 3 * N);
    assert_eq!(st.entry_count(), d.ipset_entries().len());
    let cip = st.get("KUBE-CLUSTER-IP").unwrap();
    assert_eq!(cip.entries.len(), N);
    assert_eq!(
        cip.entries
            .get(&ipset::Entry::ip_port(
                ip("10.96.0.1"),
                ipset::Protocol::Tcp,
                80
            ))
            .map(|o| &**o),
        Some("ns/svc-0000")
    );
}

#[test]
fn model_desired_identical_update_is_empty() {
    let (mut d, cfg, n) = big();
    let (s, sl) = kube_service(3);
    let delta = d.update_service(name(3), Some(derive(&s, &[&sl], &cfg, &n)));
    assert!(delta.is_empty(), "{delta:?}");
}
