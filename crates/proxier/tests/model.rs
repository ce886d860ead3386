//! Table-driven tests of the model and per-service desired state: every Kubernetes feature the
//! proxy implements, rendered as readable lines (virtual servers, addresses, ipset entries).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // test helpers

mod fixtures;

use desired::ServiceDesired;
use fixtures::*;
use ipvs_netlink::{Protocol, ServiceFlags, ServiceKey};
use k8s_openapi::api::core::v1::Service;
use k8s_openapi::api::discovery::v1::EndpointSlice;
use model::{NodeInfo, ProxyConfig, Rejections, MAX_ENDPOINTS_PER_SLICE};

fn proto(p: Protocol) -> &'static str {
    match p {
        Protocol::Tcp => "tcp",
        Protocol::Udp => "udp",
        Protocol::Sctp => "sctp",
    }
}

fn hostport(ip: std::net::IpAddr, port: u16) -> String {
    match ip {
        std::net::IpAddr::V4(v) => format!("{v}:{port}"),
        std::net::IpAddr::V6(v) => format!("[{v}]:{port}"),
    }
}

/// Virtual servers as `tcp 10.96.0.1:80 rr [persistent 10800] -> a:p b:p`.
fn render_vs(sd: &ServiceDesired) -> Vec<String> {
    sd.virtual_servers
        .values()
        .map(|vs| {
            let ServiceKey::Inet {
                protocol,
                addr,
                port,
            } = vs.service.key
            else {
                panic!("fwmark service")
            };
            let mut s = format!(
                "{} {} {}",
                proto(protocol),
                hostport(addr, port),
                vs.service.scheduler
            );
            if vs.service.flags.contains(ServiceFlags::PERSISTENT) {
                s += &format!(" persistent {}", vs.service.timeout);
            }
            s += " ->";
            for d in vs.real_servers.values() {
                s += &format!(" {}", hostport(d.addr, d.port));
            }
            s
        })
        .collect()
}

fn render_sets(sd: &ServiceDesired) -> Vec<String> {
    sd.ipset_entries
        .iter()
        .map(|e| format!("{} {}", e.set.base_name(), e.entry))
        .collect()
}

fn render_addrs(sd: &ServiceDesired) -> Vec<String> {
    sd.addresses.iter().map(|a| a.to_string()).collect()
}

struct Case {
    name: &'static str,
    svc: Service,
    slices: Vec<EndpointSlice>,
    cfg: ProxyConfig,
    node: NodeInfo,
    vs: &'static [&'static str],
    addrs: &'static [&'static str],
    /// ipset entries; `None` = not checked in this case.
    sets: Option<&'static [&'static str]>,
}

fn case(name: &'static str, svc: Service, slices: Vec<EndpointSlice>) -> Case {
    Case {
        name,
        svc,
        slices,
        cfg: cfg4(),
        node: node(),
        vs: &[],
        addrs: &[],
        sets: None,
    }
}

fn eps2(ns: &str, svc: &str, port: &str, proto: &str) -> EndpointSlice {
    slice(ns, svc, &format!("{svc}-1"))
        .port(port, 8080, proto)
        .ep("10.244.1.1", "node-b", C::Ready)
        .ep("10.244.1.2", NODE, C::Ready)
        .build()
}

fn cases() -> Vec<Case> {
    let mut v = Vec::new();

    let mut c = case(
        "clusterip",
        svc("ns", "web", "10.96.0.1")
            .port("http", 80, "TCP")
            .build(),
        vec![eps2("ns", "web", "http", "TCP")],
    );
    c.vs = &["tcp 10.96.0.1:80 rr -> 10.244.1.1:8080 10.244.1.2:8080"];
    c.addrs = &["10.96.0.1"];
    c.sets = Some(&[
        "KUBE-LOOP-BACK 10.244.1.2,tcp:8080,10.244.1.2",
        "KUBE-CLUSTER-IP 10.96.0.1,tcp:80",
        "KUBE-IPVS-IPS 10.96.0.1",
    ]);
    v.push(c);

    let mut c = case(
        "clusterip, no endpoints: virtual server without real servers",
        svc("ns", "web", "10.96.0.1")
            .port("http", 80, "TCP")
            .build(),
        vec![],
    );
    c.vs = &["tcp 10.96.0.1:80 rr ->"];
    c.addrs = &["10.96.0.1"];
    c.sets = Some(&[
        "KUBE-CLUSTER-IP 10.96.0.1,tcp:80",
        "KUBE-IPVS-IPS 10.96.0.1",
    ]);
    v.push(c);

    let mut c = case(
        "udp, unnamed port, slice port named differently is not used",
        svc("ns", "dns", "10.96.0.10").port("", 53, "UDP").build(),
        vec![
            slice("ns", "dns", "dns-1")
                .port("", 5353, "UDP")
                .ep("10.244.2.1", "node-b", C::Ready)
                .build(),
            slice("ns", "dns", "dns-2")
                .port("other", 9999, "UDP")
                .ep("10.244.2.2", "node-b", C::Ready)
                .build(),
        ],
    );
    c.vs = &["udp 10.96.0.10:53 rr -> 10.244.2.1:5353"];
    c.addrs = &["10.96.0.10"];
    v.push(c);

    let mut c = case(
        "nodeport on every node address except loopback and link-local",
        svc("ns", "web", "10.96.0.1")
            .node_port("http", 80, "TCP", 30080)
            .build(),
        vec![eps2("ns", "web", "http", "TCP")],
    );
    c.vs = &[
        "tcp 10.0.0.10:30080 rr -> 10.244.1.1:8080 10.244.1.2:8080",
        "tcp 10.96.0.1:80 rr -> 10.244.1.1:8080 10.244.1.2:8080",
        "tcp 192.168.0.10:30080 rr -> 10.244.1.1:8080 10.244.1.2:8080",
    ];
    c.addrs = &["10.96.0.1"];
    c.sets = Some(&[
        "KUBE-LOOP-BACK 10.244.1.2,tcp:8080,10.244.1.2",
        "KUBE-CLUSTER-IP 10.96.0.1,tcp:80",
        "KUBE-NODE-PORT-TCP 30080",
        "KUBE-IPVS-IPS 10.96.0.1",
    ]);
    v.push(c);

    let mut c = case(
        "nodeport restricted by nodePortAddresses",
        svc("ns", "web", "10.96.0.1")
            .node_port("http", 80, "UDP", 30053)
            .build(),
        vec![eps2("ns", "web", "http", "UDP")],
    );
    c.cfg.node_port_addresses = vec!["192.168.0.0/24".parse().unwrap()];
    c.vs = &[
        "udp 10.96.0.1:80 rr -> 10.244.1.1:8080 10.244.1.2:8080",
        "udp 192.168.0.10:30053 rr -> 10.244.1.1:8080 10.244.1.2:8080",
    ];
    c.addrs = &["10.96.0.1"];
    c.sets = Some(&[
        "KUBE-LOOP-BACK 10.244.1.2,udp:8080,10.244.1.2",
        "KUBE-CLUSTER-IP 10.96.0.1,udp:80",
        "KUBE-NODE-PORT-UDP 30053",
        "KUBE-IPVS-IPS 10.96.0.1",
    ]);
    v.push(c);

    let mut c = case(
        "sctp nodeport uses hash entries per node IP",
        svc("ns", "sig", "10.96.0.5")
            .node_port("s", 3868, "SCTP", 30868)
            .build(),
        vec![slice("ns", "sig", "sig-1")
            .port("s", 3868, "SCTP")
            .ep("10.244.3.1", "node-b", C::Ready)
            .build()],
    );
    c.vs = &[
        "sctp 10.0.0.10:30868 rr -> 10.244.3.1:3868",
        "sctp 10.96.0.5:3868 rr -> 10.244.3.1:3868",
        "sctp 192.168.0.10:30868 rr -> 10.244.3.1:3868",
    ];
    c.addrs = &["10.96.0.5"];
    c.sets = Some(&[
        "KUBE-CLUSTER-IP 10.96.0.5,sctp:3868",
        "KUBE-NODE-PORT-SCTP-HASH 10.0.0.10,sctp:30868",
        "KUBE-NODE-PORT-SCTP-HASH 192.168.0.10,sctp:30868",
        "KUBE-IPVS-IPS 10.96.0.5",
    ]);
    v.push(c);

    let mut c = case(
        "loadbalancer with source ranges admitting the node",
        svc("ns", "lb", "10.96.0.2")
            .node_port("http", 80, "TCP", 30080)
            .lb_ingress(&["1.2.3.4", "2001:db8::4"])
            .source_ranges(&["192.168.0.0/16", "203.0.113.7/24", "2001:db8::/32"])
            .build(),
        vec![slice("ns", "lb", "lb-1")
            .port("http", 8080, "TCP")
            .ep("10.244.1.1", "node-b", C::Ready)
            .build()],
    );
    c.cfg.node_port_addresses = vec!["192.168.0.0/24".parse().unwrap()];
    c.vs = &[
        "tcp 1.2.3.4:80 rr -> 10.244.1.1:8080",
        "tcp 10.96.0.2:80 rr -> 10.244.1.1:8080",
        "tcp 192.168.0.10:30080 rr -> 10.244.1.1:8080",
    ];
    c.addrs = &["1.2.3.4", "10.96.0.2"];
    c.sets = Some(&[
        "KUBE-CLUSTER-IP 10.96.0.2,tcp:80",
        "KUBE-LOAD-BALANCER 1.2.3.4,tcp:80",
        "KUBE-LOAD-BALANCER-FW 1.2.3.4,tcp:80",
        "KUBE-LOAD-BALANCER-SOURCE-IP 1.2.3.4,tcp:80,1.2.3.4",
        "KUBE-LOAD-BALANCER-SOURCE-CIDR 1.2.3.4,tcp:80,192.168.0.0/16",
        "KUBE-LOAD-BALANCER-SOURCE-CIDR 1.2.3.4,tcp:80,203.0.113.0/24",
        "KUBE-NODE-PORT-TCP 30080",
        "KUBE-IPVS-IPS 1.2.3.4",
        "KUBE-IPVS-IPS 10.96.0.2",
    ]);
    v.push(c);

    let mut c = case(
        "loadbalancer with a source range not admitting the node",
        svc("ns", "lb", "10.96.0.2")
            .port("http", 80, "TCP")
            .lb_ingress(&["1.2.3.4"])
            .source_ranges(&["203.0.113.0/24"])
            .build(),
        vec![],
    );
    c.vs = &["tcp 1.2.3.4:80 rr ->", "tcp 10.96.0.2:80 rr ->"];
    c.addrs = &["1.2.3.4", "10.96.0.2"];
    c.sets = Some(&[
        "KUBE-CLUSTER-IP 10.96.0.2,tcp:80",
        "KUBE-LOAD-BALANCER 1.2.3.4,tcp:80",
        "KUBE-LOAD-BALANCER-FW 1.2.3.4,tcp:80",
        "KUBE-LOAD-BALANCER-SOURCE-CIDR 1.2.3.4,tcp:80,203.0.113.0/24",
        "KUBE-IPVS-IPS 1.2.3.4",
        "KUBE-IPVS-IPS 10.96.0.2",
    ]);
    v.push(c);

    let mut c = case(
        "loadbalancer with only other-family source ranges: firewall on, nobody admitted",
        svc("ns", "lb", "10.96.0.2")
            .port("http", 80, "TCP")
            .lb_ingress(&["1.2.3.4"])
            .source_ranges(&["2001:db8::/32"])
            .build(),
        vec![],
    );
    c.vs = &["tcp 1.2.3.4:80 rr ->", "tcp 10.96.0.2:80 rr ->"];
    c.addrs = &["1.2.3.4", "10.96.0.2"];
    c.sets = Some(&[
        "KUBE-CLUSTER-IP 10.96.0.2,tcp:80",
        "KUBE-LOAD-BALANCER 1.2.3.4,tcp:80",
        "KUBE-LOAD-BALANCER-FW 1.2.3.4,tcp:80",
        "KUBE-IPVS-IPS 1.2.3.4",
        "KUBE-IPVS-IPS 10.96.0.2",
    ]);
    v.push(c);

    let mut c = case(
        "externalIPs: a node address is not bound again",
        svc("ns", "ext", "10.96.0.3")
            .port("http", 80, "TCP")
            .external_ips(&["5.6.7.8", "192.168.0.10", "2001:db8::8"])
            .build(),
        vec![slice("ns", "ext", "ext-1")
            .port("http", 8080, "TCP")
            .ep("10.244.1.1", "node-b", C::Ready)
            .build()],
    );
    c.vs = &[
        "tcp 10.96.0.3:80 rr -> 10.244.1.1:8080",
        "tcp 192.168.0.10:80 rr -> 10.244.1.1:8080",
        "tcp 5.6.7.8:80 rr -> 10.244.1.1:8080",
    ];
    c.addrs = &["10.96.0.3", "5.6.7.8"];
    c.sets = Some(&[
        "KUBE-CLUSTER-IP 10.96.0.3,tcp:80",
        "KUBE-EXTERNAL-IP 192.168.0.10,tcp:80",
        "KUBE-EXTERNAL-IP 5.6.7.8,tcp:80",
        "KUBE-IPVS-IPS 10.96.0.3",
        "KUBE-IPVS-IPS 5.6.7.8",
    ]);
    v.push(c);

    let mut c = case(
        "session affinity ClientIP, default timeout",
        svc("ns", "aff", "10.96.0.4")
            .port("http", 80, "TCP")
            .affinity(None)
            .build(),
        vec![],
    );
    c.vs = &["tcp 10.96.0.4:80 rr persistent 10800 ->"];
    c.addrs = &["10.96.0.4"];
    v.push(c);

    let mut c = case(
        "session affinity ClientIP, 60 s, scheduler annotation",
        svc("ns", "aff", "10.96.0.4")
            .port("http", 80, "TCP")
            .affinity(Some(60))
            .annotate("kube-ipvs.io/scheduler", "sh")
            .build(),
        vec![],
    );
    c.vs = &["tcp 10.96.0.4:80 sh persistent 60 ->"];
    c.addrs = &["10.96.0.4"];
    v.push(c);

    let mut c = case(
        "global scheduler flag",
        svc("ns", "s", "10.96.0.4").port("http", 80, "TCP").build(),
        vec![],
    );
    c.cfg.scheduler = "lc".into();
    c.vs = &["tcp 10.96.0.4:80 lc ->"];
    c.addrs = &["10.96.0.4"];
    v.push(c);

    let mut c = case(
        "ETP=Local with a local endpoint: external VIPs use it only, health check node port",
        svc("ns", "loc", "10.96.0.6")
            .node_port("http", 80, "TCP", 30080)
            .lb_ingress(&["1.2.3.6"])
            .external_ips(&["5.6.7.9"])
            .etp_local()
            .hcnp(32000)
            .build(),
        vec![eps2("ns", "loc", "http", "TCP")],
    );
    c.cfg.node_port_addresses = vec!["192.168.0.0/24".parse().unwrap()];
    c.vs = &[
        "tcp 1.2.3.6:80 rr -> 10.244.1.2:8080",
        "tcp 10.96.0.6:80 rr -> 10.244.1.1:8080 10.244.1.2:8080",
        "tcp 192.168.0.10:30080 rr -> 10.244.1.2:8080",
        "tcp 5.6.7.9:80 rr -> 10.244.1.2:8080",
    ];
    c.addrs = &["1.2.3.6", "10.96.0.6", "5.6.7.9"];
    c.sets = Some(&[
        "KUBE-LOOP-BACK 10.244.1.2,tcp:8080,10.244.1.2",
        "KUBE-CLUSTER-IP 10.96.0.6,tcp:80",
        "KUBE-EXTERNAL-IP-LOCAL 5.6.7.9,tcp:80",
        "KUBE-LOAD-BALANCER 1.2.3.6,tcp:80",
        "KUBE-LOAD-BALANCER-LOCAL 1.2.3.6,tcp:80",
        "KUBE-NODE-PORT-TCP 30080",
        "KUBE-NODE-PORT-LOCAL-TCP 30080",
        "KUBE-HEALTH-CHECK-NODE-PORT 32000",
        "KUBE-IPVS-IPS 1.2.3.6",
        "KUBE-IPVS-IPS 10.96.0.6",
        "KUBE-IPVS-IPS 5.6.7.9",
    ]);
    v.push(c);

    let mut c = case(
        "ETP=Local without local endpoints: external VIPs get NO real servers (no fall-back)",
        svc("ns", "loc", "10.96.0.6")
            .node_port("http", 80, "TCP", 30080)
            .etp_local()
            .build(),
        vec![slice("ns", "loc", "loc-1")
            .port("http", 8080, "TCP")
            .ep("10.244.1.1", "node-b", C::Ready)
            .build()],
    );
    c.cfg.node_port_addresses = vec!["192.168.0.0/24".parse().unwrap()];
    c.vs = &[
        "tcp 10.96.0.6:80 rr -> 10.244.1.1:8080",
        "tcp 192.168.0.10:30080 rr ->",
    ];
    c.addrs = &["10.96.0.6"];
    v.push(c);

    let mut c = case(
        "ETP=Local ignored for ClusterIP services",
        svc("ns", "c", "10.96.0.6")
            .port("http", 80, "TCP")
            .external_ips(&["5.6.7.9"])
            .etp_local()
            .build(),
        vec![slice("ns", "c", "c-1")
            .port("http", 8080, "TCP")
            .ep("10.244.1.1", "node-b", C::Ready)
            .build()],
    );
    c.vs = &[
        "tcp 10.96.0.6:80 rr -> 10.244.1.1:8080",
        "tcp 5.6.7.9:80 rr -> 10.244.1.1:8080",
    ];
    c.addrs = &["10.96.0.6", "5.6.7.9"];
    v.push(c);

    let mut c = case(
        "ITP=Local: ClusterIP uses local endpoints only, NodePort all",
        svc("ns", "itp", "10.96.0.7")
            .node_port("http", 80, "TCP", 30080)
            .itp_local()
            .build(),
        vec![eps2("ns", "itp", "http", "TCP")],
    );
    c.cfg.node_port_addresses = vec!["192.168.0.0/24".parse().unwrap()];
    c.vs = &[
        "tcp 10.96.0.7:80 rr -> 10.244.1.2:8080",
        "tcp 192.168.0.10:30080 rr -> 10.244.1.1:8080 10.244.1.2:8080",
    ];
    c.addrs = &["10.96.0.7"];
    v.push(c);

    let mut c = case(
        "ITP=Local without local endpoints: no real servers",
        svc("ns", "itp", "10.96.0.7")
            .port("http", 80, "TCP")
            .itp_local()
            .build(),
        vec![slice("ns", "itp", "itp-1")
            .port("http", 8080, "TCP")
            .ep("10.244.1.1", "node-b", C::Ready)
            .build()],
    );
    c.vs = &["tcp 10.96.0.7:80 rr ->"];
    c.addrs = &["10.96.0.7"];
    c.sets = Some(&[
        "KUBE-CLUSTER-IP 10.96.0.7,tcp:80",
        "KUBE-IPVS-IPS 10.96.0.7",
    ]);
    v.push(c);

    let mut c = case(
        "ready endpoints win over serving-terminating ones",
        svc("ns", "t", "10.96.0.8").port("http", 80, "TCP").build(),
        vec![slice("ns", "t", "t-1")
            .port("http", 8080, "TCP")
            .ep("10.244.1.1", "node-b", C::Ready)
            .ep("10.244.1.2", "node-b", C::Term)
            .ep("10.244.1.3", "node-b", C::NotReady)
            .build()],
    );
    c.vs = &["tcp 10.96.0.8:80 rr -> 10.244.1.1:8080"];
    c.addrs = &["10.96.0.8"];
    v.push(c);

    let mut c = case(
        "no ready endpoint: fall back to serving-terminating (not to non-serving)",
        svc("ns", "t", "10.96.0.8").port("http", 80, "TCP").build(),
        vec![slice("ns", "t", "t-1")
            .port("http", 8080, "TCP")
            .ep("10.244.1.2", "node-b", C::Term)
            .ep("10.244.1.3", "node-b", C::Dead)
            .ep("10.244.1.4", "node-b", C::NotReady)
            .ep("10.244.1.5", "node-b", C::Term)
            .build()],
    );
    c.vs = &["tcp 10.96.0.8:80 rr -> 10.244.1.2:8080 10.244.1.5:8080"];
    c.addrs = &["10.96.0.8"];
    v.push(c);

    let mut c = case(
        "ETP=Local falls back to local serving-terminating endpoints",
        svc("ns", "t", "10.96.0.8")
            .node_port("http", 80, "TCP", 30080)
            .etp_local()
            .build(),
        vec![slice("ns", "t", "t-1")
            .port("http", 8080, "TCP")
            .ep("10.244.1.1", "node-b", C::Ready)
            .ep("10.244.1.2", NODE, C::Term)
            .build()],
    );
    c.cfg.node_port_addresses = vec!["192.168.0.0/24".parse().unwrap()];
    c.vs = &[
        "tcp 10.96.0.8:80 rr -> 10.244.1.1:8080",
        "tcp 192.168.0.10:30080 rr -> 10.244.1.2:8080",
    ];
    c.addrs = &["10.96.0.8"];
    v.push(c);

    let mut c = case(
        "topology: every endpoint hinted, this zone's only",
        svc("ns", "topo", "10.96.0.9")
            .port("http", 80, "TCP")
            .build(),
        vec![slice("ns", "topo", "topo-1")
            .port("http", 8080, "TCP")
            .ep("10.244.1.1", "node-b", C::Ready)
            .hints(&["zone-a"])
            .ep("10.244.1.2", "node-c", C::Ready)
            .hints(&["zone-b"])
            .ep("10.244.1.3", "node-d", C::Ready)
            .hints(&["zone-a", "zone-c"])
            .build()],
    );
    c.vs = &["tcp 10.96.0.9:80 rr -> 10.244.1.1:8080 10.244.1.3:8080"];
    c.addrs = &["10.96.0.9"];
    v.push(c);

    let mut c = case(
        "topology: one ready endpoint without hints disables hints",
        svc("ns", "topo", "10.96.0.9")
            .port("http", 80, "TCP")
            .build(),
        vec![slice("ns", "topo", "topo-1")
            .port("http", 8080, "TCP")
            .ep("10.244.1.1", "node-b", C::Ready)
            .hints(&["zone-a"])
            .ep("10.244.1.2", "node-c", C::Ready)
            .build()],
    );
    c.vs = &["tcp 10.96.0.9:80 rr -> 10.244.1.1:8080 10.244.1.2:8080"];
    c.addrs = &["10.96.0.9"];
    v.push(c);

    let mut c = case(
        "topology: no endpoint hinted for this zone uses all",
        svc("ns", "topo", "10.96.0.9")
            .port("http", 80, "TCP")
            .build(),
        vec![slice("ns", "topo", "topo-1")
            .port("http", 8080, "TCP")
            .ep("10.244.1.1", "node-b", C::Ready)
            .hints(&["zone-b"])
            .ep("10.244.1.2", "node-c", C::Ready)
            .hints(&["zone-c"])
            .build()],
    );
    c.vs = &["tcp 10.96.0.9:80 rr -> 10.244.1.1:8080 10.244.1.2:8080"];
    c.addrs = &["10.96.0.9"];
    v.push(c);

    let mut c = case(
        "topology: node without zone label ignores hints",
        svc("ns", "topo", "10.96.0.9")
            .port("http", 80, "TCP")
            .build(),
        vec![slice("ns", "topo", "topo-1")
            .port("http", 8080, "TCP")
            .ep("10.244.1.1", "node-b", C::Ready)
            .hints(&["zone-a"])
            .ep("10.244.1.2", "node-c", C::Ready)
            .hints(&["zone-b"])
            .build()],
    );
    c.node.zone = None;
    c.vs = &["tcp 10.96.0.9:80 rr -> 10.244.1.1:8080 10.244.1.2:8080"];
    c.addrs = &["10.96.0.9"];
    v.push(c);

    // trafficDistribution: PreferSameNode (hints.forNodes), upstream `topologyModeFromHints`.
    let mut c = case(
        "topology: every endpoint node-hinted, this node's only",
        svc("ns", "topo", "10.96.0.9")
            .port("http", 80, "TCP")
            .build(),
        vec![slice("ns", "topo", "topo-1")
            .port("http", 8080, "TCP")
            .ep("10.244.1.1", NODE, C::Ready)
            .node_hints(&[NODE])
            .hints(&["zone-a"])
            .ep("10.244.1.2", "node-b", C::Ready)
            .node_hints(&["node-b"])
            .hints(&["zone-a"])
            .build()],
    );
    c.vs = &["tcp 10.96.0.9:80 rr -> 10.244.1.1:8080"];
    c.addrs = &["10.96.0.9"];
    v.push(c);

    let mut c = case(
        "topology: no endpoint hinted for this node falls back to zone hints",
        svc("ns", "topo", "10.96.0.9")
            .port("http", 80, "TCP")
            .build(),
        vec![slice("ns", "topo", "topo-1")
            .port("http", 8080, "TCP")
            .ep("10.244.1.1", "node-b", C::Ready)
            .hints(&["zone-a"])
            .node_hints(&["node-b"])
            .ep("10.244.1.2", "node-c", C::Ready)
            .hints(&["zone-b"])
            .node_hints(&["node-c"])
            .build()],
    );
    c.vs = &["tcp 10.96.0.9:80 rr -> 10.244.1.1:8080"];
    c.addrs = &["10.96.0.9"];
    v.push(c);

    let mut c = case(
        "topology: a ready endpoint without a node hint disables node hints (zone hints apply)",
        svc("ns", "topo", "10.96.0.9")
            .port("http", 80, "TCP")
            .build(),
        vec![slice("ns", "topo", "topo-1")
            .port("http", 8080, "TCP")
            .ep("10.244.1.1", NODE, C::Ready)
            .hints(&["zone-b"])
            .node_hints(&[NODE])
            .ep("10.244.1.2", "node-c", C::Ready)
            .hints(&["zone-a"])
            .build()],
    );
    c.vs = &["tcp 10.96.0.9:80 rr -> 10.244.1.2:8080"];
    c.addrs = &["10.96.0.9"];
    v.push(c);

    let mut c = case(
        "topology: node hints only, none for this node, uses all",
        svc("ns", "topo", "10.96.0.9")
            .port("http", 80, "TCP")
            .build(),
        vec![slice("ns", "topo", "topo-1")
            .port("http", 8080, "TCP")
            .ep("10.244.1.1", "node-b", C::Ready)
            .node_hints(&["node-b"])
            .ep("10.244.1.2", "node-c", C::Ready)
            .node_hints(&["node-c"])
            .build()],
    );
    c.vs = &["tcp 10.96.0.9:80 rr -> 10.244.1.1:8080 10.244.1.2:8080"];
    c.addrs = &["10.96.0.9"];
    v.push(c);

    let mut c = case(
        "topology: a not-ready endpoint's missing node hint does not count",
        svc("ns", "topo", "10.96.0.9")
            .port("http", 80, "TCP")
            .build(),
        vec![slice("ns", "topo", "topo-1")
            .port("http", 8080, "TCP")
            .ep("10.244.1.1", NODE, C::Ready)
            .node_hints(&[NODE])
            .ep("10.244.1.2", "node-c", C::Ready)
            .node_hints(&["node-c"])
            .ep("10.244.1.3", "node-d", C::NotReady)
            .build()],
    );
    c.vs = &["tcp 10.96.0.9:80 rr -> 10.244.1.1:8080"];
    c.addrs = &["10.96.0.9"];
    v.push(c);

    let dual = || {
        svc("ns", "dual", "10.96.0.11")
            .dual("fd00:96::11")
            .node_port("http", 80, "TCP", 30080)
            .build()
    };
    let dual_slices = || {
        vec![
            slice("ns", "dual", "dual-v4")
                .port("http", 8080, "TCP")
                .ep("10.244.1.1", "node-b", C::Ready)
                .build(),
            slice_typed("ns", "dual", "dual-v6", "IPv6")
                .port("http", 8080, "TCP")
                .ep("fd00:244::1", NODE, C::Ready)
                .build(),
        ]
    };
    let mut c = case("dual-stack service, IPv4 proxier", dual(), dual_slices());
    c.cfg.node_port_addresses = vec!["192.168.0.0/24".parse().unwrap()];
    c.vs = &[
        "tcp 10.96.0.11:80 rr -> 10.244.1.1:8080",
        "tcp 192.168.0.10:30080 rr -> 10.244.1.1:8080",
    ];
    c.addrs = &["10.96.0.11"];
    v.push(c);

    let mut c = case("dual-stack service, IPv6 proxier", dual(), dual_slices());
    c.cfg = cfg6();
    c.vs = &[
        "tcp [fd00:96::11]:80 rr -> [fd00:244::1]:8080",
        "tcp [fd00::10]:30080 rr -> [fd00:244::1]:8080",
    ];
    c.addrs = &["fd00:96::11"];
    c.sets = Some(&[
        "KUBE-LOOP-BACK fd00:244::1,tcp:8080,fd00:244::1",
        "KUBE-CLUSTER-IP fd00:96::11,tcp:80",
        "KUBE-NODE-PORT-TCP 30080",
        "KUBE-IPVS-IPS fd00:96::11",
    ]);
    v.push(c);

    let mut c = case(
        "IPv6 affinity",
        svc("ns", "v6", "fd00:96::12")
            .port("http", 80, "TCP")
            .affinity(Some(30))
            .build(),
        vec![],
    );
    c.cfg = cfg6();
    c.vs = &["tcp [fd00:96::12]:80 rr persistent 30 ->"];
    c.addrs = &["fd00:96::12"];
    v.push(c);

    let mut c = case(
        "several slices merged, duplicates counted once (ready copy wins)",
        svc("ns", "m", "10.96.0.12").port("http", 80, "TCP").build(),
        vec![
            slice("ns", "m", "m-1")
                .port("http", 8080, "TCP")
                .ep("10.244.1.1", "node-b", C::Ready)
                .ep("10.244.1.2", "node-b", C::NotReady)
                .build(),
            slice("ns", "m", "m-2")
                .port("http", 8080, "TCP")
                .ep("10.244.1.2", "node-b", C::Ready)
                .ep("10.244.1.3", "node-b", C::Ready)
                .build(),
        ],
    );
    c.vs = &["tcp 10.96.0.12:80 rr -> 10.244.1.1:8080 10.244.1.2:8080 10.244.1.3:8080"];
    c.addrs = &["10.96.0.12"];
    v.push(c);

    let mut c = case(
        "multi-port service: each port its own virtual server and target port",
        svc("ns", "mp", "10.96.0.13")
            .port("http", 80, "TCP")
            .port("dns", 53, "UDP")
            .build(),
        vec![slice("ns", "mp", "mp-1")
            .port("http", 8080, "TCP")
            .port("dns", 5353, "UDP")
            .ep("10.244.1.1", "node-b", C::Ready)
            .build()],
    );
    c.vs = &[
        "tcp 10.96.0.13:80 rr -> 10.244.1.1:8080",
        "udp 10.96.0.13:53 rr -> 10.244.1.1:5353",
    ];
    c.addrs = &["10.96.0.13"];
    v.push(c);

    v
}

#[test]
fn model_table() {
    let mut failures = Vec::new();
    for c in cases() {
        let slices: Vec<&EndpointSlice> = c.slices.iter().collect();
        let d = match service_desired(&c.svc, &slices, &c.cfg, &c.node) {
            Ok(d) => d,
            Err(e) => {
                failures.push(format!("{}: rejected: {e}", c.name));
                continue;
            }
        };
        assert!(d.rejected_slices.is_empty(), "{}", c.name);
        let sd = d.desired.unwrap_or_default();
        let mut want_vs: Vec<String> = c.vs.iter().map(|s| s.to_string()).collect();
        want_vs.sort();
        let mut got_vs = render_vs(&sd);
        got_vs.sort();
        if got_vs != want_vs {
            failures.push(format!(
                "{}: virtual servers\n  got  {got_vs:#?}\n  want {want_vs:#?}",
                c.name
            ));
        }
        let want_addrs: Vec<String> = {
            let mut v: Vec<String> = c.addrs.iter().map(|s| s.to_string()).collect();
            v.sort();
            v
        };
        let mut got_addrs = render_addrs(&sd);
        got_addrs.sort();
        if got_addrs != want_addrs {
            failures.push(format!(
                "{}: addresses got {got_addrs:?} want {want_addrs:?}",
                c.name
            ));
        }
        if let Some(sets) = c.sets {
            let mut want: Vec<String> = sets.iter().map(|s| s.to_string()).collect();
            want.sort();
            let mut got = render_sets(&sd);
            got.sort();
            if got != want {
                failures.push(format!(
                    "{}: ipsets\n  got  {got:#?}\n  want {want:#?}",
                    c.name
                ));
            }
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

#[test]
fn model_health_check_counts_local_endpoints() {
    let s = svc("ns", "hc", "10.96.0.6")
        .node_port("http", 80, "TCP", 30080)
        .lb_ingress(&["1.2.3.6"])
        .etp_local()
        .hcnp(32000)
        .build();
    let with = slice("ns", "hc", "hc-1")
        .port("http", 8080, "TCP")
        .ep("10.244.1.1", NODE, C::Ready)
        .ep("10.244.1.2", NODE, C::Ready)
        .ep("10.244.1.3", "node-b", C::Ready)
        .build();
    let d = service_desired(&s, &[&with], &cfg4(), &node()).unwrap();
    let hc = d.desired.unwrap().health_check.unwrap();
    assert_eq!((hc.node_port, hc.local_endpoints), (32000, 2));

    let without = slice("ns", "hc", "hc-1")
        .port("http", 8080, "TCP")
        .ep("10.244.1.3", "node-b", C::Ready)
        .build();
    let d = service_desired(&s, &[&without], &cfg4(), &node()).unwrap();
    let hc = d.desired.unwrap().health_check.unwrap();
    assert_eq!((hc.node_port, hc.local_endpoints), (32000, 0));

    // ETP=Cluster: no health check node port even if the field is set.
    let cluster = svc("ns", "hc", "10.96.0.6")
        .node_port("http", 80, "TCP", 30080)
        .lb_ingress(&["1.2.3.6"])
        .hcnp(32000)
        .build();
    let d = service_desired(&cluster, &[&with], &cfg4(), &node()).unwrap();
    assert_eq!(d.desired.unwrap().health_check, None);
}

#[test]
fn model_skipped_services() {
    let headless = svc("ns", "h", "None").port("http", 80, "TCP").build();
    let extname = svc("ns", "x", "")
        .type_("ExternalName")
        .with(|s| s.external_name = Some("example.org".into()))
        .build();
    let v6only = svc("ns", "six", "fd00:96::1")
        .port("http", 80, "TCP")
        .build();
    let noports = svc("ns", "np", "10.96.0.1").build();
    for (what, s) in [
        ("headless", headless),
        ("ExternalName", extname),
        ("IPv6-only in IPv4 proxier", v6only),
        ("no ports", noports),
    ] {
        let d = service_desired(&s, &[], &cfg4(), &node()).unwrap();
        assert_eq!(d.desired, None, "{what}");
        assert!(service_ports(&s, &cfg4()).unwrap().is_empty(), "{what}");
    }
}

#[test]
fn model_bad_services_rejected_with_reason() {
    let base = || svc("ns", "bad", "10.96.0.1");
    let cases: Vec<(&str, Service, &str)> = vec![
        (
            "invalid cluster IP",
            svc("ns", "bad", "10.96.0.300").port("p", 80, "TCP").build(),
            "invalid clusterIP",
        ),
        (
            "port 0",
            base().port("p", 0, "TCP").build(),
            "port 0 out of range",
        ),
        (
            "port > 65535",
            base().port("p", 70000, "TCP").build(),
            "port 70000 out of range",
        ),
        (
            "negative port",
            base().port("p", -1, "TCP").build(),
            "out of range",
        ),
        (
            "unknown protocol",
            base().port("p", 80, "ICMP").build(),
            "unknown protocol \"ICMP\"",
        ),
        (
            "duplicate ports",
            base().port("a", 80, "TCP").port("b", 80, "TCP").build(),
            "duplicate port 80",
        ),
        (
            "duplicate port names",
            base().port("a", 80, "TCP").port("a", 81, "TCP").build(),
            "duplicate port name",
        ),
        (
            "nodePort 0",
            base().node_port("a", 80, "TCP", 0).build(),
            "nodePort 0 out of range",
        ),
        (
            "nodePort 65536",
            base().node_port("a", 80, "TCP", 65536).build(),
            "nodePort 65536",
        ),
        // An invalid externalIP, load-balancer IP or source range is left out alone
        // (`model_hostile.rs`: `a_bad_address_drops_only_that_address_*`).
        (
            "absurd number of external IPs",
            base()
                .port("a", 80, "TCP")
                .external_ips(
                    &(0..300)
                        .map(|i| format!("5.6.{}.{}", i / 250, i % 250))
                        .collect::<Vec<_>>()
                        .iter()
                        .map(String::as_str)
                        .collect::<Vec<_>>(),
                )
                .build(),
            "external and load-balancer IPs (max 256)",
        ),
        (
            "absurd number of ports",
            (1..=1001)
                .fold(base(), |b, i| b.port(&format!("p{i}"), i, "TCP"))
                .build(),
            "1001 ports",
        ),
        (
            "unknown scheduler annotation",
            base()
                .port("a", 80, "TCP")
                .annotate("kube-ipvs.io/scheduler", "fastest")
                .build(),
            "unknown scheduler \"fastest\"",
        ),
        (
            "affinity timeout out of range",
            base().port("a", 80, "TCP").affinity(Some(0)).build(),
            "affinity timeout 0",
        ),
        (
            "unknown traffic policy",
            base()
                .port("a", 80, "TCP")
                .with(|s| s.internal_traffic_policy = Some("Nearby".into()))
                .build(),
            "unknown internalTrafficPolicy",
        ),
        (
            "unknown type",
            base().port("a", 80, "TCP").type_("Magic").build(),
            "unknown service type",
        ),
    ];
    for (what, s, want) in cases {
        match service_desired(&s, &[], &cfg4(), &node()) {
            Ok(d) => panic!("{what}: accepted: {d:?}"),
            Err(e) => assert!(
                e.reason.contains(want),
                "{what}: reason {:?} lacks {want:?}",
                e.reason
            ),
        }
    }
}

#[test]
fn model_bad_slices_skipped_alone() {
    let s = svc("ns", "web", "10.96.0.1")
        .port("http", 80, "TCP")
        .build();
    let good = slice("ns", "web", "a-good")
        .port("http", 8080, "TCP")
        .ep("10.244.1.1", "node-b", C::Ready)
        .build();
    let big = (0..=MAX_ENDPOINTS_PER_SLICE).fold(
        slice("ns", "web", "b-big").port("http", 8080, "TCP"),
        |b, i| {
            b.ep(
                &format!("10.245.{}.{}", i / 250, i % 250),
                "node-b",
                C::Ready,
            )
        },
    );
    let bad: Vec<(EndpointSlice, &str)> = vec![
        (
            slice("ns", "web", "b-addr")
                .port("http", 8080, "TCP")
                .ep("10.244.1.999", "node-b", C::Ready)
                .build(),
            // Used without that endpoint (its only one): a partial rejection.
            "ignored endpoint with invalid address \"10.244.1.999\"",
        ),
        (
            slice("ns", "web", "b-fam")
                .port("http", 8080, "TCP")
                .ep("fd00::1", "node-b", C::Ready)
                .build(),
            "ignored endpoint address of another family \"fd00::1\"",
        ),
        (
            slice("ns", "web", "b-port0")
                .port("http", 0, "TCP")
                .ep("10.244.1.5", "node-b", C::Ready)
                .build(),
            "endpoint port 0 out of range",
        ),
        (
            slice("ns", "web", "b-port-big")
                .port("http", 99999, "TCP")
                .ep("10.244.1.5", "node-b", C::Ready)
                .build(),
            "endpoint port 99999",
        ),
        (
            slice("ns", "web", "b-proto")
                .port("http", 8080, "QUIC")
                .ep("10.244.1.5", "node-b", C::Ready)
                .build(),
            "unknown protocol",
        ),
        (
            slice("ns", "web", "b-dup")
                .port("http", 8080, "TCP")
                .port("http", 8081, "TCP")
                .ep("10.244.1.5", "node-b", C::Ready)
                .build(),
            "duplicate endpoint port",
        ),
        (big.build(), "1001 endpoints (max 1000)"),
    ];
    for (b, want) in &bad {
        let d = service_desired(&s, &[&good, b], &cfg4(), &node()).unwrap();
        assert_eq!(d.rejected_slices.len(), 1, "{want}");
        assert!(
            d.rejected_slices[0].1.reason.contains(want),
            "{:?} lacks {want:?}",
            d.rejected_slices[0]
        );
        let sd = d.desired.unwrap();
        assert_eq!(
            render_vs(&sd),
            vec!["tcp 10.96.0.1:80 rr -> 10.244.1.1:8080"],
            "{want}: the good slice still counts"
        );
    }
    // A slice of an unknown address type is rejected; an FQDN slice is ignored silently.
    let fqdn = slice_typed("ns", "web", "f", "FQDN")
        .port("http", 8080, "TCP")
        .ep("example.org", "", C::Ready)
        .build();
    let port = &service_ports(&s, &cfg4()).unwrap()[0];
    let m = endpoints(&[&good, &fqdn], port, NODE);
    assert_eq!(m.endpoints.len(), 1);
    assert!(m.rejected.is_empty());
}

#[test]
fn model_rejections_logged_once_and_counted() {
    let mut r = Rejections::default();
    let why = model::Invalid::new("port 0 out of range");
    assert!(r.reject("service ns/a", &why));
    assert!(!r.reject("service ns/a", &why), "same reason: not again");
    assert!(r.reject("service ns/b", &why));
    let other = model::Invalid::new("duplicate port 80/Tcp");
    assert!(r.reject("service ns/a", &other), "new reason: logged");
    assert_eq!((r.current(), r.total()), (2, 3));
    r.clear("service ns/a");
    assert_eq!(r.current(), 1);
    assert_eq!(r.reason("service ns/b"), Some(&why));
}

#[test]
fn model_node_port_ips_and_node_info() {
    let n = node();
    let got: Vec<String> = n
        .node_port_ips(&cfg4())
        .iter()
        .map(|a| a.to_string())
        .collect();
    assert_eq!(got, vec!["10.0.0.10", "192.168.0.10"]);
    let got: Vec<String> = n
        .node_port_ips(&cfg6())
        .iter()
        .map(|a| a.to_string())
        .collect();
    assert_eq!(got, vec!["fd00::10"]);

    let obj = node_obj(NODE, "zone-x", "192.168.0.10");
    let info = NodeInfo::from_node(NODE, Some(&obj), n.addresses.clone());
    assert_eq!(info.zone.as_deref(), Some("zone-x"));
    assert_eq!(info.primary_ips, vec![ip("192.168.0.10")]);
}

/// kube-proxy's `sync_proxy_rules_no_local_endpoints_total{traffic_policy}`: a port counts when
/// a Local policy leaves it without endpoints while it has endpoints it could otherwise reach; a
/// port with nothing reachable at all is rejected instead and not counted.
#[test]
fn model_no_local_endpoints_follow_upstream_counting() {
    let local = ("10.244.1.1", NODE);
    let remote = ("10.244.1.3", "node-b");
    // (case, itp local, etp local, NodePort service, endpoints, want (internal, external))
    type Case<'a> = (
        &'a str,
        bool,
        bool,
        bool,
        &'a [(&'a str, &'a str)],
        (u32, u32),
    );
    let cases: [Case<'_>; 9] = [
        ("cluster policies", false, false, true, &[remote], (0, 0)),
        (
            "itp local, only remote",
            true,
            false,
            false,
            &[remote],
            (0, 0),
        ),
        (
            "itp local + nodeport, only remote",
            true,
            false,
            true,
            &[remote],
            (1, 0),
        ),
        (
            "itp local, local present",
            true,
            false,
            true,
            &[local, remote],
            (0, 0),
        ),
        (
            "etp local, only remote",
            false,
            true,
            true,
            &[remote],
            (0, 1),
        ),
        (
            "etp local, local present",
            false,
            true,
            true,
            &[local],
            (0, 0),
        ),
        (
            "both local, only remote",
            true,
            true,
            true,
            &[remote],
            (0, 0),
        ),
        (
            "etp local, no endpoints at all",
            false,
            true,
            true,
            &[],
            (0, 0),
        ),
        (
            "itp local + nodeport, no endpoints",
            true,
            false,
            true,
            &[],
            (0, 0),
        ),
    ];
    let mut failures = Vec::new();
    for (name, itp, etp, np, eps, want) in cases {
        let mut b = svc("ns", "nl", "10.96.0.9");
        b = if np {
            b.node_port("http", 80, "TCP", 30090)
        } else {
            b.port("http", 80, "TCP")
        };
        if itp {
            b = b.itp_local();
        }
        if etp {
            b = b.etp_local();
        }
        let s = b.build();
        let mut sl = slice("ns", "nl", "nl-1").port("http", 8080, "TCP");
        for (ip, node) in eps {
            sl = sl.ep(ip, node, C::Ready);
        }
        let sl = sl.build();
        let d = service_desired(&s, &[&sl], &cfg4(), &node())
            .unwrap()
            .desired
            .unwrap();
        let got = (d.no_local_internal, d.no_local_external);
        if got != want {
            failures.push(format!("{name}: got {got:?} want {want:?}"));
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// `nodePortAddresses`: CIDRs, `primary` (the Node object's InternalIP/ExternalIP), both, or
/// neither (every node address but loopback and link-local), per family.
#[test]
fn model_node_port_addresses_cidrs_and_primary() {
    let n = node();
    let ips = |cfg: &ProxyConfig| -> Vec<String> {
        n.node_port_ips(cfg).iter().map(|i| i.to_string()).collect()
    };
    let mut all = cfg4();
    assert_eq!(ips(&all), ["10.0.0.10", "192.168.0.10"]);
    all.node_port_primary = true;
    assert_eq!(ips(&all), ["192.168.0.10"]);
    all.node_port_addresses = vec!["10.0.0.0/8".parse().unwrap()];
    assert_eq!(ips(&all), ["10.0.0.10", "192.168.0.10"]);
    all.node_port_primary = false;
    assert_eq!(ips(&all), ["10.0.0.10"]);
    let mut v6 = cfg6();
    v6.node_port_primary = true;
    assert_eq!(ips(&v6), ["fd00::10"]);

    // bindAddress names this node's primary IP of its family, overriding the Node object's
    // (upstream `detectNodeIPs`); `0.0.0.0` (unset) leaves the Node's, and an address of the
    // other family leaves this family's.
    let mut bound = cfg4();
    bound.node_port_primary = true;
    bound.bind_address = Some(ip("10.0.0.10"));
    assert_eq!(ips(&bound), ["10.0.0.10"]);
    bound.bind_address = Some(ip("fd00::10"));
    assert_eq!(ips(&bound), ["192.168.0.10"]);
    v6.bind_address = Some(ip("fd00::10"));
    assert_eq!(ips(&v6), ["fd00::10"]);

    // The NodePort virtual servers follow.
    let s = svc("ns", "np", "10.96.0.30")
        .node_port("http", 80, "TCP", 30030)
        .build();
    let sl = slice("ns", "np", "np-1")
        .port("http", 8080, "TCP")
        .ep("10.244.1.1", NODE, C::Ready)
        .build();
    let mut cfg = cfg4();
    cfg.node_port_primary = true;
    let d = service_desired(&s, &[&sl], &cfg, &n)
        .unwrap()
        .desired
        .unwrap();
    let node_port_vips: Vec<String> = d
        .virtual_servers
        .keys()
        .filter_map(|k| match k {
            ServiceKey::Inet {
                addr, port: 30030, ..
            } => Some(addr.to_string()),
            _ => None,
        })
        .collect();
    assert_eq!(node_port_vips, ["192.168.0.10"]);
}

/// Upstream's health-check count (`EndpointsMap.LocalReadyEndpoints` via
/// `getLocalReadyEndpointIPs`, pkg/proxy/endpoints.go): local endpoints that are *ready*,
/// squashed by IP over all ports of the Service. Serving-terminating endpoints are not counted
/// (a node whose only endpoints are terminating fails the load balancer's check, so it stops
/// sending new traffic), even though they still receive traffic as the fallback.
#[test]
fn model_health_check_counts_ready_local_endpoint_ips_like_upstream() {
    let (s, slices) = hc_two_ports();
    let refs: Vec<&EndpointSlice> = slices.iter().collect();
    let d = service_desired(&s, &refs, &cfg4(), &node()).unwrap();
    let hc = d.desired.unwrap().health_check.unwrap();
    // 10.244.1.1 (both ports), 10.244.1.6 and 10.244.1.2: three IPs.
    assert_eq!((hc.node_port, hc.local_endpoints), (32001, 3));

    // Only a serving-terminating local endpoint left: it still gets traffic, the check fails.
    let term_only = slice("ns", "hc2", "hc2-http")
        .port("http", 8080, "TCP")
        .ep("10.244.1.4", NODE, C::Term)
        .ep("10.244.1.3", "node-b", C::Ready)
        .build();
    let d = service_desired(&s, &[&term_only], &cfg4(), &node()).unwrap();
    let sd = d.desired.unwrap();
    assert_eq!(sd.health_check.map(|h| h.local_endpoints), Some(0));
    let reals: Vec<String> = sd
        .virtual_servers
        .values()
        .flat_map(|vs| vs.real_servers.keys().map(|(ip, _)| ip.to_string()))
        .collect();
    assert!(reals.iter().any(|r| r == "10.244.1.4"), "{reals:?}");
}

/// KEP-1860 (`status.loadBalancer.ingress[].ipMode`, GA 1.32): a `Proxy` ingress IP is not a
/// virtual IP on the node — no virtual server, no kube-ipvs0 address, no ipset entry — while
/// `VIP` and an unset mode (the default) are programmed as before. Upstream:
/// `proxyutil.IsVIPMode`, used by `newBaseServiceInfo` (pkg/proxy/serviceport.go).
#[test]
fn model_lb_ingress_ip_mode_proxy_is_not_programmed() {
    let s = svc("ns", "lbm", "10.96.0.9")
        .node_port("http", 80, "TCP", 30090)
        .lb_ingress_modes(&[
            ("1.2.3.8", Some("VIP")),
            ("1.2.3.9", Some("Proxy")),
            ("1.2.3.10", None),
        ])
        .build();
    let eps = slice("ns", "lbm", "lbm-1")
        .port("http", 8080, "TCP")
        .ep("10.244.1.1", NODE, C::Ready)
        .build();
    let sd = service_desired(&s, &[&eps], &cfg4(), &node())
        .unwrap()
        .desired
        .unwrap();
    let vs = render_vs(&sd).join("\n");
    assert!(vs.contains("tcp 1.2.3.8:80 "), "{vs}");
    assert!(vs.contains("tcp 1.2.3.10:80 "), "{vs}");
    assert!(!vs.contains("1.2.3.9"), "{vs}");
    let addrs = render_addrs(&sd);
    assert!(addrs.contains(&"1.2.3.8".to_string()), "{addrs:?}");
    assert!(!addrs.contains(&"1.2.3.9".to_string()), "{addrs:?}");
    let sets = render_sets(&sd).join("\n");
    assert!(sets.contains("1.2.3.8"), "{sets}");
    assert!(!sets.contains("1.2.3.9"), "{sets}");
    // All Proxy: the Service still has its ClusterIP and NodePort, and no load-balancer VIP.
    let proxy_only = svc("ns", "lbm", "10.96.0.9")
        .node_port("http", 80, "TCP", 30090)
        .lb_ingress_modes(&[("1.2.3.9", Some("Proxy"))])
        .build();
    let sd = service_desired(&proxy_only, &[&eps], &cfg4(), &node())
        .unwrap()
        .desired
        .unwrap();
    let vs = render_vs(&sd).join("\n");
    assert!(vs.contains("tcp 10.96.0.9:80 "), "{vs}");
    assert!(!vs.contains("1.2.3.9"), "{vs}");
    assert!(!render_sets(&sd).iter().any(|e| e.contains("1.2.3.9")));
}

/// The `kube-ipvs.io/scheduler` annotation accepts exactly the kernel's schedulers
/// ([`ipvs_netlink::SCHEDULERS`], the table `ipvs.scheduler` is checked against too; upstream
/// has no such annotation); any other name makes the Service invalid, naming the annotation.
#[test]
fn model_scheduler_annotation_accepts_exactly_the_kernel_schedulers() {
    use model::SCHEDULER_ANNOTATION;
    const KERNEL: [&str; 13] = [
        "rr", "wrr", "lc", "wlc", "lblc", "lblcr", "sh", "dh", "sed", "nq", "mh", "fo", "ovf",
    ];
    assert_eq!(ipvs_netlink::SCHEDULERS, KERNEL);
    assert_eq!(model::SCHEDULERS, KERNEL);
    let scheduler_of = |sched: &str| {
        let svc = svc("ns", "sched", "10.96.0.12")
            .port("http", 80, "TCP")
            .annotate(SCHEDULER_ANNOTATION, sched)
            .build();
        let eps = slice("ns", "sched", "sched-1")
            .port("http", 8080, "TCP")
            .ep("10.244.1.1", NODE, C::Ready)
            .build();
        service_desired(&svc, &[&eps], &cfg4(), &node())
            .map(|d| {
                let sd = d.desired.unwrap();
                let vs = sd.virtual_servers.values().next().unwrap();
                vs.service.scheduler.clone()
            })
            .map_err(|e| e.reason)
    };
    for s in KERNEL {
        assert_eq!(scheduler_of(s), Ok(s.to_string()), "{s}");
    }
    for bad in ["fastest", "RR", "ip_vs_rr", ""] {
        let err = scheduler_of(bad).unwrap_err();
        assert_eq!(
            err,
            format!("unknown scheduler {bad:?} in annotation {SCHEDULER_ANNOTATION}")
        );
    }
}

/// IPVS scheduler flags: upstream sets `mh-port` (`FlagSourceHash`) whenever the scheduler is
/// `mh` (`syncProxyRules`, pkg/proxy/ipvs/proxier.go) and nothing for other schedulers; the
/// `kube-ipvs.io/scheduler-flags` annotation chooses the flags per Service, checked against its
/// scheduler.
#[test]
fn model_scheduler_flags_default_like_upstream_and_follow_the_annotation() {
    use ipvs_netlink::ServiceFlags as F;
    use model::{scheduler_flags, SCHEDULER_ANNOTATION, SCHEDULER_FLAGS_ANNOTATION};
    let flags_of = |sched: Option<&str>, flags: Option<&str>| {
        let mut b = svc("ns", "sched", "10.96.0.12").port("http", 80, "TCP");
        if let Some(s) = sched {
            b = b.annotate(SCHEDULER_ANNOTATION, s);
        }
        if let Some(f) = flags {
            b = b.annotate(SCHEDULER_FLAGS_ANNOTATION, f);
        }
        let eps = slice("ns", "sched", "sched-1")
            .port("http", 8080, "TCP")
            .ep("10.244.1.1", NODE, C::Ready)
            .build();
        service_desired(&b.build(), &[&eps], &cfg4(), &node())
            .map(|d| {
                let sd = d.desired.unwrap();
                let vs = sd.virtual_servers.values().next().unwrap();
                (vs.service.scheduler.clone(), vs.service.flags.0)
            })
            .map_err(|e| e.reason)
    };
    assert_eq!(flags_of(None, None), Ok(("rr".into(), 0)));
    assert_eq!(flags_of(Some("mh"), None), Ok(("mh".into(), F::MH_PORT)));
    assert_eq!(flags_of(Some("sh"), None), Ok(("sh".into(), 0)));
    assert_eq!(
        flags_of(Some("sh"), Some("sh-fallback, sh-port")),
        Ok(("sh".into(), F::SH_FALLBACK | F::SH_PORT))
    );
    assert_eq!(
        flags_of(Some("mh"), Some("mh-fallback")),
        Ok(("mh".into(), F::MH_FALLBACK))
    );
    assert_eq!(flags_of(Some("mh"), Some("")), Ok(("mh".into(), 0)));
    let err = flags_of(Some("rr"), Some("sh-port")).unwrap_err();
    assert!(err.contains("needs scheduler \"sh\""), "{err}");
    let err = flags_of(Some("mh"), Some("mh-sideways")).unwrap_err();
    assert!(err.contains(SCHEDULER_FLAGS_ANNOTATION), "{err}");
    // The global scheduler gets the same default.
    assert_eq!(scheduler_flags("mh", None), Ok(F::MH_PORT));
}
