//! External claims on this node's own addresses (issue #32, the CVE-2020-8554 class on node
//! addresses), through the proxier against the in-memory kernel: an externalIP or
//! load-balancer IP equal to a node address never takes a NodePort, a health-check node port
//! or a protected node port (kubelet's 10250, the proxy's own ports); the loser is reported;
//! the answer does not depend on event order; it is recomputed when the node's addresses
//! change; a dropped claim is served once what beat it goes; `refuse_node_address_vips` drops
//! every claim on a node address; iptables mode renders no rule for a dropped claim.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod fixtures;

use std::collections::BTreeSet;
use std::net::IpAddr;

use desired::vip::{NodeConflicts, NODE_CONFLICT_PREFIX};
use fixtures::*;
use ipvs_netlink::{Protocol, ServiceKey};
use k8s_openapi::api::core::v1::Service;
use k8s_openapi::api::discovery::v1::EndpointSlice;
use model::event::{Object, SourceEvent};
use model::store::Store;
use model::{ProtectedPort, ProxyConfig};
use proxier::ipvs_mode::{Proxier, RulesConfig};
use proxier::kernel::Kernel;
use testkit::fake_kernel::FakeKernel;

const NODE_IP: &str = "192.168.0.10";

fn node_addrs() -> BTreeSet<IpAddr> {
    [ip(NODE_IP), ip("10.0.0.10")].into_iter().collect()
}

fn key(addr: &str, port: u16, protocol: Protocol) -> ServiceKey {
    ServiceKey::Inet {
        protocol,
        addr: ip(addr),
        port,
    }
}

fn tcp(addr: &str, port: u16) -> ServiceKey {
    key(addr, port, Protocol::Tcp)
}

/// The NodePort owner: NodePort 30080 (TCP), endpoint 10.244.1.1. Named after the hijacker, so
/// a rule that gave a shared key to the smaller name would pick the hijacker.
fn owner() -> Service {
    svc("zz", "np-owner", "10.96.0.10")
        .node_port("http", 80, "TCP", 30080)
        .build()
}

/// A Service with `externalIPs: ext` on `port`/TCP.
fn ext(ns: &str, name: &str, cluster_ip: &str, port: i32, ips: &[&str]) -> Service {
    svc(ns, name, cluster_ip)
        .port("http", port, "TCP")
        .external_ips(ips)
        .build()
}

fn eps(ns: &str, svc: &str, pod: &str) -> EndpointSlice {
    slice(ns, svc, &format!("{svc}-1"))
        .port("http", 8080, "TCP")
        .ep(pod, "node-b", C::Ready)
        .build()
}

/// The hijacker: `externalIPs: [192.168.0.10]` on port 30080, endpoint 10.244.2.2.
fn hijack() -> Service {
    ext("aa", "hijack", "10.96.0.11", 30080, &[NODE_IP])
}

fn owner_objects() -> Vec<Object> {
    vec![
        Object::from(owner()),
        Object::from(eps("zz", "np-owner", "10.244.1.1")),
    ]
}

fn hijack_objects() -> Vec<Object> {
    vec![
        Object::from(hijack()),
        Object::from(eps("aa", "hijack", "10.244.2.2")),
    ]
}

struct Run {
    store: Store,
    p: Proxier,
    k: FakeKernel,
    addrs: BTreeSet<IpAddr>,
    rejected: Vec<(String, String)>,
}

impl Run {
    fn new(cfg: ProxyConfig) -> Run {
        let store = synced_store(vec![], vec![]);
        let mut p = Proxier::new(cfg, RulesConfig::default(), NODE);
        let mut k = FakeKernel::default();
        let addrs = node_addrs();
        let r = p.sync(&store, &addrs, &mut k);
        assert!(r.ok(), "{:?}", r.errors);
        Run {
            store,
            p,
            k,
            addrs,
            rejected: Vec::new(),
        }
    }

    fn sync(&mut self) {
        let r = self.p.sync(&self.store, &self.addrs, &mut self.k);
        assert!(r.ok(), "{:?}", r.errors);
        assert_eq!(r.node_address_conflicts, self.p.node_address_conflicts());
        self.rejected.extend(
            self.p
                .take_rejections()
                .into_iter()
                .map(|(k, why)| (k, why.reason)),
        );
    }

    /// Applies one event and syncs (an incremental sync per event).
    fn event(&mut self, ev: SourceEvent) {
        let ch = self.store.apply(ev);
        self.p.note(&ch);
        self.sync();
    }

    fn apply(&mut self, objs: &[Object]) {
        for o in objs {
            self.event(SourceEvent::Apply(o.clone()));
        }
    }

    fn delete(&mut self, o: Object) {
        self.event(SourceEvent::Delete(o));
    }

    /// The node's addresses change (the netif tracker), then a sync.
    fn set_addresses(&mut self, addrs: &[&str]) {
        self.addrs = addrs.iter().map(|a| ip(a)).collect();
        self.p.note_node_addresses();
        self.sync();
    }

    /// The real servers taking new connections at `key`.
    fn reals(&self, key: &ServiceKey) -> Vec<IpAddr> {
        self.k
            .ipvs
            .get(key)
            .map(|vs| {
                vs.real_servers
                    .iter()
                    .filter(|(_, d)| d.weight > 0)
                    .map(|(a, _)| a.0)
                    .collect()
            })
            .unwrap_or_default()
    }

    fn set_members(&self, set: &str) -> Vec<String> {
        self.k
            .ipsets
            .get(set)
            .map(|s| s.entries.keys().map(|e| e.to_string()).collect())
            .unwrap_or_default()
    }

    /// The current node-address rejection of `ns/name`, if any.
    fn node_reason(&self, name: &str) -> Option<String> {
        self.p
            .rejections()
            .reason(&format!("nodeaddress {name}"))
            .map(|r| r.reason.clone())
    }

    /// A full resync writes nothing (the incremental syncs left the kernel as desired).
    fn assert_full_sync_writes_nothing(&mut self) {
        let before = self.k.counters();
        self.p.request_full();
        self.sync();
        assert_eq!(self.k.counters().ipvs_writes, before.ipvs_writes);
    }
}

fn conflicts(node_port: usize, protected_port: usize, refused: usize) -> NodeConflicts {
    NodeConflicts {
        node_port,
        protected_port,
        refused,
    }
}

/// Every order of `objs` (`objs.len()!`).
fn permutations(objs: &[Object]) -> Vec<Vec<Object>> {
    if objs.len() <= 1 {
        return vec![objs.to_vec()];
    }
    let mut out = Vec::new();
    for i in 0..objs.len() {
        let mut rest = objs.to_vec();
        let first = rest.remove(i);
        for mut p in permutations(&rest) {
            p.insert(0, first.clone());
            out.push(p);
        }
    }
    out
}

#[test]
fn a_node_port_wins_over_an_external_ip_on_a_node_address_whatever_the_order() {
    let objs: Vec<Object> = owner_objects()
        .into_iter()
        .chain(hijack_objects())
        .collect();
    let mut tables = BTreeSet::new();
    for (i, order) in permutations(&objs).into_iter().enumerate() {
        let mut run = Run::new(cfg4());
        run.apply(&order);
        // The NodePort serves its node address:port with its own endpoint, on every address.
        assert_eq!(
            run.reals(&tcp(NODE_IP, 30080)),
            vec![ip("10.244.1.1")],
            "order {i}"
        );
        assert_eq!(run.reals(&tcp("10.0.0.10", 30080)), vec![ip("10.244.1.1")]);
        // The hijacker keeps its ClusterIP.
        assert_eq!(run.reals(&tcp("10.96.0.11", 30080)), vec![ip("10.244.2.2")]);
        // No ipset member from the dropped claim; node addresses are never bound.
        assert!(run.set_members("KUBE-EXTERNAL-IP").is_empty(), "order {i}");
        assert!(!run.k.addresses.contains(&ip(NODE_IP)));
        assert_eq!(run.p.node_address_conflicts(), conflicts(1, 0, 0));
        assert_eq!(run.p.vip_conflicts(), 0, "not a conflict between Services");
        let why = run.node_reason("aa/hijack").unwrap();
        assert!(why.starts_with(NODE_CONFLICT_PREFIX), "{why}");
        assert!(
            why.contains("192.168.0.10:30080/TCP is the NodePort of zz/np-owner"),
            "{why}"
        );
        assert!(run.node_reason("zz/np-owner").is_none());
        assert!(
            run.rejected
                .iter()
                .any(|(k, r)| k == "nodeaddress aa/hijack" && *r == why),
            "reported once as new: {:?}",
            run.rejected
        );
        run.assert_full_sync_writes_nothing();
        // What takes new connections (an order that served the claim before the NodePort
        // came leaves its real server draining at weight 0 on the NodePort's key).
        let serving: Vec<(ServiceKey, Vec<IpAddr>)> =
            run.k.ipvs.keys().map(|k| (*k, run.reals(k))).collect();
        tables.insert(format!("{serving:?}"));
    }
    assert_eq!(tables.len(), 1, "every order serves the same: {tables:#?}");
}

#[test]
fn a_load_balancer_ip_on_a_node_address_loses_to_the_node_port_and_adds_no_firewall_entry() {
    let lb = svc("aa", "lb", "10.96.0.12")
        .port("http", 30080, "TCP")
        .lb_ingress(&[NODE_IP])
        .source_ranges(&["198.51.100.0/24"])
        .build();
    let mut run = Run::new(cfg4());
    run.apply(&[
        Object::from(lb),
        Object::from(eps("aa", "lb", "10.244.2.2")),
    ]);
    // Alone, it is served (upstream-compatible: a load-balancer IP may be a node address).
    assert_eq!(run.reals(&tcp(NODE_IP, 30080)), vec![ip("10.244.2.2")]);
    assert!(!run.set_members("KUBE-LOAD-BALANCER-FW").is_empty());
    run.apply(&owner_objects());
    assert_eq!(run.reals(&tcp(NODE_IP, 30080)), vec![ip("10.244.1.1")]);
    for set in [
        "KUBE-LOAD-BALANCER",
        "KUBE-LOAD-BALANCER-FW",
        "KUBE-LOAD-BALANCER-SOURCE-CIDR",
    ] {
        assert!(
            run.set_members(set).is_empty(),
            "{set}: {:?}",
            run.set_members(set)
        );
    }
    assert!(!run.k.addresses.contains(&ip(NODE_IP)), "LB IP unbound");
    assert_eq!(run.p.node_address_conflicts(), conflicts(1, 0, 0));
    assert!(run.node_reason("aa/lb").is_some());
}

#[test]
fn the_loser_takes_over_when_the_node_port_goes_or_moves() {
    let mut run = Run::new(cfg4());
    run.apply(&owner_objects());
    run.apply(&hijack_objects());
    assert_eq!(run.reals(&tcp(NODE_IP, 30080)), vec![ip("10.244.1.1")]);
    // The owner moves to another NodePort: the claim on 30080 is served now.
    let moved = svc("zz", "np-owner", "10.96.0.10")
        .node_port("http", 80, "TCP", 30081)
        .build();
    run.apply(&[Object::from(moved)]);
    assert_eq!(run.reals(&tcp(NODE_IP, 30080)), vec![ip("10.244.2.2")]);
    assert_eq!(run.reals(&tcp(NODE_IP, 30081)), vec![ip("10.244.1.1")]);
    assert!(run
        .set_members("KUBE-EXTERNAL-IP")
        .contains(&"192.168.0.10,tcp:30080".to_string()));
    assert_eq!(run.p.node_address_conflicts(), conflicts(0, 0, 0));
    assert!(run.node_reason("aa/hijack").is_none(), "rejection cleared");
    // Back on 30080: the NodePort wins again; deleted: the claim is served again.
    run.apply(&owner_objects());
    assert_eq!(run.reals(&tcp(NODE_IP, 30080)), vec![ip("10.244.1.1")]);
    assert!(run.node_reason("aa/hijack").is_some());
    run.delete(Object::from(owner()));
    assert_eq!(run.reals(&tcp(NODE_IP, 30080)), vec![ip("10.244.2.2")]);
    assert_eq!(run.p.node_address_conflicts(), conflicts(0, 0, 0));
    assert!(run.node_reason("aa/hijack").is_none());
    run.assert_full_sync_writes_nothing();
    // The loser's deletion clears everything it had.
    run.delete(Object::from(hijack()));
    assert!(!run.k.ipvs.contains_key(&tcp(NODE_IP, 30080)));
    assert!(run.p.rejections().current() == 0);
}

#[test]
fn a_node_address_change_recomputes_the_claims() {
    // 192.168.0.20 is not a node address yet: the externalIP is served and bound.
    let mut run = Run::new(cfg4());
    let ext20 = ext("aa", "hijack", "10.96.0.11", 30080, &["192.168.0.20"]);
    run.apply(&owner_objects());
    run.apply(&[
        Object::from(ext20.clone()),
        Object::from(eps("aa", "hijack", "10.244.2.2")),
    ]);
    assert_eq!(
        run.reals(&tcp("192.168.0.20", 30080)),
        vec![ip("10.244.2.2")]
    );
    assert!(run.k.addresses.contains(&ip("192.168.0.20")));
    // The address comes up on a node interface: the NodePort takes it, the claim is dropped.
    run.set_addresses(&[NODE_IP, "10.0.0.10", "192.168.0.20"]);
    assert_eq!(
        run.reals(&tcp("192.168.0.20", 30080)),
        vec![ip("10.244.1.1")]
    );
    assert!(!run.k.addresses.contains(&ip("192.168.0.20")));
    assert!(run.set_members("KUBE-EXTERNAL-IP").is_empty());
    assert_eq!(run.p.node_address_conflicts(), conflicts(1, 0, 0));
    assert!(run.node_reason("aa/hijack").is_some());
    run.assert_full_sync_writes_nothing();
    // It goes away again: the claim is served again.
    run.set_addresses(&[NODE_IP, "10.0.0.10"]);
    assert_eq!(
        run.reals(&tcp("192.168.0.20", 30080)),
        vec![ip("10.244.2.2")]
    );
    assert!(run.k.addresses.contains(&ip("192.168.0.20")));
    assert_eq!(run.p.node_address_conflicts(), conflicts(0, 0, 0));
    assert!(run.node_reason("aa/hijack").is_none());
    run.assert_full_sync_writes_nothing();
}

#[test]
fn a_node_port_keeps_only_the_node_port_addresses() {
    // NodePorts on 10.0.0.0/8 only: 192.168.0.10:30080 is no NodePort here, the claim on it
    // takes nothing and is served; the one on 10.0.0.10 is dropped.
    let mut cfg = cfg4();
    cfg.node_port_addresses = vec!["10.0.0.0/8".parse().unwrap()];
    let mut run = Run::new(cfg);
    run.apply(&owner_objects());
    let both = ext("aa", "hijack", "10.96.0.11", 30080, &[NODE_IP, "10.0.0.10"]);
    run.apply(&[
        Object::from(both),
        Object::from(eps("aa", "hijack", "10.244.2.2")),
    ]);
    assert_eq!(run.reals(&tcp(NODE_IP, 30080)), vec![ip("10.244.2.2")]);
    assert_eq!(run.reals(&tcp("10.0.0.10", 30080)), vec![ip("10.244.1.1")]);
    assert_eq!(run.p.node_address_conflicts(), conflicts(1, 0, 0));
}

#[test]
fn protected_node_ports_are_never_taken_on_node_addresses() {
    let mut run = Run::new(cfg4());
    // kubelet's port on a node address, the API server's on another, the proxy's healthz
    // through a load-balancer IP equal to a node address; and 10250 on a foreign address.
    let kubelet = ext(
        "aa",
        "kubelet",
        "10.96.0.20",
        10250,
        &[NODE_IP, "203.0.113.10"],
    );
    let api = ext("aa", "api", "10.96.0.21", 6443, &["10.0.0.10"]);
    let healthz = svc("aa", "healthz", "10.96.0.22")
        .port("http", 10256, "TCP")
        .lb_ingress(&[NODE_IP])
        .build();
    run.apply(&[
        Object::from(kubelet),
        Object::from(eps("aa", "kubelet", "10.244.2.2")),
        Object::from(api),
        Object::from(eps("aa", "api", "10.244.2.3")),
        Object::from(healthz),
        Object::from(eps("aa", "healthz", "10.244.2.4")),
    ]);
    for k in [
        tcp(NODE_IP, 10250),
        tcp("10.0.0.10", 6443),
        tcp(NODE_IP, 10256),
    ] {
        assert!(
            !run.k.ipvs.contains_key(&k),
            "{k:?}: {:?}",
            run.k.ipvs.get(&k)
        );
    }
    assert_eq!(
        run.reals(&tcp("203.0.113.10", 10250)),
        vec![ip("10.244.2.2")]
    );
    assert_eq!(
        run.set_members("KUBE-EXTERNAL-IP"),
        vec!["203.0.113.10,tcp:10250".to_string()]
    );
    assert!(run.set_members("KUBE-LOAD-BALANCER").is_empty());
    assert!(!run.k.addresses.contains(&ip(NODE_IP)));
    assert_eq!(run.p.node_address_conflicts(), conflicts(0, 3, 0));
    let why = run.node_reason("aa/kubelet").unwrap();
    assert!(
        why.contains("192.168.0.10:10250/TCP is a protected node port"),
        "{why}"
    );
    run.assert_full_sync_writes_nothing();
}

#[test]
fn the_protected_list_is_configurable_per_protocol() {
    // Only 8443/UDP protected: TCP 8443 on the node address is served, UDP is not; 10250 is
    // no longer protected.
    let mut cfg = cfg4();
    cfg.protected_node_ports = vec![ProtectedPort {
        port: 8443,
        protocol: Some(Protocol::Udp),
    }];
    let mut run = Run::new(cfg);
    let both = svc("aa", "both", "10.96.0.30")
        .port("tcp", 8443, "TCP")
        .port("udp", 8443, "UDP")
        .external_ips(&[NODE_IP])
        .build();
    let s = slice("aa", "both", "both-1")
        .port("tcp", 8443, "TCP")
        .port("udp", 8443, "UDP")
        .ep("10.244.2.2", "node-b", C::Ready)
        .build();
    let kubelet = ext("aa", "kubelet", "10.96.0.31", 10250, &[NODE_IP]);
    run.apply(&[
        Object::from(both),
        Object::from(s),
        Object::from(kubelet),
        Object::from(eps("aa", "kubelet", "10.244.2.3")),
    ]);
    assert_eq!(run.reals(&tcp(NODE_IP, 8443)), vec![ip("10.244.2.2")]);
    assert!(!run.k.ipvs.contains_key(&key(NODE_IP, 8443, Protocol::Udp)));
    assert_eq!(run.reals(&tcp(NODE_IP, 10250)), vec![ip("10.244.2.3")]);
    assert_eq!(run.p.node_address_conflicts(), conflicts(0, 1, 0));
}

#[test]
fn a_health_check_node_port_is_kept_on_every_node_address() {
    // ETP=Local load balancer with health-check node port 32000; a claim on a node address
    // and 32000/TCP would take the load balancer's health checks.
    let lb = svc("zz", "lb", "10.96.0.40")
        .node_port("http", 80, "TCP", 30090)
        .lb_ingress(&["203.0.113.50"])
        .etp_local()
        .hcnp(32000)
        .build();
    let mut cfg = cfg4();
    // Not a NodePort address: the health-check server listens on every address all the same.
    cfg.node_port_addresses = vec!["10.0.0.0/8".parse().unwrap()];
    let mut run = Run::new(cfg);
    run.apply(&[
        Object::from(lb.clone()),
        Object::from(eps("zz", "lb", "10.244.1.1")),
    ]);
    run.apply(&[
        Object::from(ext("aa", "hc", "10.96.0.41", 32000, &[NODE_IP])),
        Object::from(eps("aa", "hc", "10.244.2.2")),
    ]);
    assert!(!run.k.ipvs.contains_key(&tcp(NODE_IP, 32000)));
    let why = run.node_reason("aa/hc").unwrap();
    assert!(
        why.contains("192.168.0.10:32000/TCP is the health-check node port of zz/lb"),
        "{why}"
    );
    assert_eq!(run.p.node_address_conflicts(), conflicts(1, 0, 0));
    // The load balancer goes: the claim is served.
    run.delete(Object::from(lb));
    assert_eq!(run.reals(&tcp(NODE_IP, 32000)), vec![ip("10.244.2.2")]);
    assert!(run.node_reason("aa/hc").is_none());
}

#[test]
fn refusing_node_address_vips_drops_every_claim_on_a_node_address() {
    let objs = || {
        vec![
            Object::from(ext(
                "aa",
                "web",
                "10.96.0.50",
                80,
                &[NODE_IP, "203.0.113.10"],
            )),
            Object::from(eps("aa", "web", "10.244.2.2")),
            Object::from(
                svc("aa", "lb", "10.96.0.51")
                    .port("http", 443, "TCP")
                    .lb_ingress(&["10.0.0.10"])
                    .build(),
            ),
            Object::from(eps("aa", "lb", "10.244.2.3")),
        ]
    };
    // Default: served, like upstream.
    let mut run = Run::new(cfg4());
    run.apply(&objs());
    assert_eq!(run.reals(&tcp(NODE_IP, 80)), vec![ip("10.244.2.2")]);
    assert_eq!(run.reals(&tcp("10.0.0.10", 443)), vec![ip("10.244.2.3")]);
    assert_eq!(run.p.node_address_conflicts(), conflicts(0, 0, 0));
    // Refused: only the foreign address is served.
    let mut cfg = cfg4();
    cfg.refuse_node_address_vips = true;
    let mut run = Run::new(cfg);
    run.apply(&objs());
    assert!(!run.k.ipvs.contains_key(&tcp(NODE_IP, 80)));
    assert!(!run.k.ipvs.contains_key(&tcp("10.0.0.10", 443)));
    assert_eq!(run.reals(&tcp("203.0.113.10", 80)), vec![ip("10.244.2.2")]);
    assert_eq!(
        run.set_members("KUBE-EXTERNAL-IP"),
        vec!["203.0.113.10,tcp:80".to_string()]
    );
    assert!(run.set_members("KUBE-LOAD-BALANCER").is_empty());
    assert!(!run.k.addresses.contains(&ip("10.0.0.10")));
    assert_eq!(run.p.node_address_conflicts(), conflicts(0, 0, 2));
    let why = run.node_reason("aa/lb").unwrap();
    assert!(
        why.contains("10.0.0.10:443/TCP is on a node address"),
        "{why}"
    );
    run.assert_full_sync_writes_nothing();
}

#[test]
fn iptables_mode_renders_no_rule_for_a_claim_the_node_keeps() {
    use proxier::iptables_mode::IptablesProxier;
    use proxier::sync_loop::Backend;
    let rec = proxier::iptables_mode::SharedRecording::default();
    let mut p = IptablesProxier::new(cfg4(), RulesConfig::default(), NODE, Box::new(rec.clone()));
    let mut store = synced_store(vec![], vec![]);
    assert!(p.sync(&store, &node_addrs()).ok());
    let mut objs = hijack_objects();
    objs.extend(owner_objects());
    let mut rejected = Vec::new();
    let mut last = None;
    for o in objs {
        let ch = store.apply(SourceEvent::Apply(o));
        p.note(&ch);
        let r = p.sync(&store, &node_addrs());
        assert!(r.ok(), "{:?}", r.errors);
        rejected.extend(p.take_rejections());
        last = Some(r);
    }
    assert_eq!(last.unwrap().node_address_conflicts, conflicts(1, 0, 0));
    assert!(
        rejected.iter().any(|(k, _)| k == "nodeaddress aa/hijack"),
        "{rejected:?}"
    );
    p.request_full();
    assert!(p.sync(&store, &node_addrs()).ok());
    let payload = rec.get().restores.last().cloned().unwrap();
    assert!(
        !payload.contains("aa/hijack:http external IP"),
        "the dropped claim's rule is rendered:\n{payload}"
    );
    assert!(payload.contains("zz/np-owner:http"), "{payload}");
}
