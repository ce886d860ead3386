//! The soak's objects: the stable Services (real pods, clients connect to them the whole run,
//! their endpoints never change), the churned ones (endpoint and Service changes every second or
//! two; their endpoints are addresses nobody serves, no traffic goes to them), and the hostile
//! ones of issue #32 (they appear at random times and stay).

use std::net::Ipv4Addr;

use k8s_openapi::api::core::v1::Service;
use k8s_openapi::api::discovery::v1::EndpointSlice;
use serde_json::{json, Value};
use testkit::apiserver::FakeApiServer;

use crate::rng::Rng;

/// This node.
pub const NODE_NAME: &str = "node-1";
/// The node's address (NodePorts are served on it: `nodePortAddresses` is its /24).
pub const NODE_IP: Ipv4Addr = Ipv4Addr::new(192, 168, 0, 10);
/// `nodePortAddresses`: only the node's LAN, so the address storm's addresses are not NodePort
/// addresses (they are still node addresses the tracker must follow).
pub const NODE_PORT_ADDRESSES: &str = "192.168.0.0/24";
/// The pods' port.
pub const POD_PORT: u16 = 8080;

/// A stable Service and the pods behind it.
#[derive(Debug, Clone)]
pub struct Stable {
    /// Its name.
    pub name: &'static str,
    /// Its pods (echo servers).
    pub pods: [Ipv4Addr; 2],
}

/// The stable Services. Every one has two ready pods that never change.
pub fn stable() -> Vec<Stable> {
    let p = |n| Ipv4Addr::new(10, 244, 0, n);
    vec![
        Stable {
            name: "s-cluster",
            pods: [p(10), p(11)],
        },
        Stable {
            name: "s-nodeport",
            pods: [p(12), p(13)],
        },
        Stable {
            name: "s-external",
            pods: [p(14), p(15)],
        },
        Stable {
            name: "s-lb",
            pods: [p(16), p(17)],
        },
    ]
}

/// The drain Service (the drain-repair fault): ClusterIP 10.96.1.9:80, pods A and B.
pub const DRAIN_VIP: &str = "10.96.1.9:80";
/// The drain Service's pods.
pub const DRAIN_PODS: [Ipv4Addr; 2] =
    [Ipv4Addr::new(10, 244, 0, 18), Ipv4Addr::new(10, 244, 0, 19)];
/// The pod that stays: the stable pods, the drain pods.
pub fn pod_ips() -> Vec<Ipv4Addr> {
    let mut v: Vec<Ipv4Addr> = stable().iter().flat_map(|s| s.pods).collect();
    v.extend(DRAIN_PODS);
    v
}

/// One Service port.
fn port(name: &str, port: u16, target: u16, node_port: Option<u16>) -> Value {
    let mut p = json!({"name": name, "port": port, "targetPort": target, "protocol": "TCP"});
    if let Some(np) = node_port {
        p["nodePort"] = json!(np);
    }
    p
}

/// A Service object.
fn service(name: &str, ty: &str, cluster_ip: &str, ports: Vec<Value>) -> Value {
    json!({
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": name, "namespace": "default"},
        "spec": {
            "type": ty,
            "clusterIP": cluster_ip,
            "clusterIPs": [cluster_ip],
            "ipFamilies": ["IPv4"],
            "ipFamilyPolicy": "SingleStack",
            "ports": ports,
        },
    })
}

/// An EndpointSlice of `svc` with ready `endpoints` on `ports` (name, port).
fn slice(svc: &str, n: u32, endpoints: &[String], ports: &[(&str, u16)]) -> Value {
    let eps: Vec<Value> = endpoints
        .iter()
        .map(|a| json!({"addresses": [a], "conditions": {"ready": true}, "nodeName": NODE_NAME}))
        .collect();
    let ports: Vec<Value> = ports
        .iter()
        .map(|(n, p)| json!({"name": n, "port": p, "protocol": "TCP"}))
        .collect();
    json!({
        "apiVersion": "discovery.k8s.io/v1",
        "kind": "EndpointSlice",
        "metadata": {
            "name": format!("{svc}-{n}"),
            "namespace": "default",
            "labels": {"kubernetes.io/service-name": svc},
        },
        "addressType": "IPv4",
        "endpoints": eps,
        "ports": ports,
    })
}

/// Stores `v` (a Service or an EndpointSlice), creating or replacing it.
pub fn put(api: &FakeApiServer, v: Value) {
    let what = format!("{} {}", v["kind"], v["metadata"]["name"]);
    let r = if v["kind"] == "Service" {
        let s: Service = serde_json::from_value(v).unwrap_or_else(|e| panic!("{what}: {e}"));
        api.apply(&s).map(|_| ())
    } else {
        let s: EndpointSlice = serde_json::from_value(v).unwrap_or_else(|e| panic!("{what}: {e}"));
        api.apply(&s).map(|_| ())
    };
    r.unwrap_or_else(|e| panic!("{what}: {e}"));
}

/// Deletes a Service and its slice `NAME-0` (missing ones are fine).
pub fn remove(api: &FakeApiServer, name: &str) {
    let _ = api.delete::<EndpointSlice>("default", &format!("{name}-0"));
    let _ = api.delete::<Service>("default", name);
}

/// The Node, the stable Services and the drain Service.
pub fn load_base(api: &FakeApiServer) {
    api.load_str(&format!(
        "apiVersion: v1\nkind: Node\nmetadata: {{name: {NODE_NAME}, labels: {{kubernetes.io/hostname: {NODE_NAME}}}}}\n\
         status:\n  addresses: [{{type: InternalIP, address: {NODE_IP}}}]\n"
    ))
    .unwrap();
    let http = [("http", POD_PORT)];
    for s in stable() {
        let eps: Vec<String> = s.pods.iter().map(Ipv4Addr::to_string).collect();
        let mut v = match s.name {
            "s-cluster" => service(
                s.name,
                "ClusterIP",
                "10.96.1.1",
                vec![port("http", 80, POD_PORT, None)],
            ),
            "s-nodeport" => service(
                s.name,
                "NodePort",
                "10.96.1.2",
                vec![port("http", 80, POD_PORT, Some(30080))],
            ),
            "s-external" => {
                let mut v = service(
                    s.name,
                    "ClusterIP",
                    "10.96.1.3",
                    vec![port("http", 80, POD_PORT, None)],
                );
                v["spec"]["externalIPs"] = json!(["192.168.0.100"]);
                v
            }
            _ => {
                let mut v = service(
                    s.name,
                    "LoadBalancer",
                    "10.96.1.4",
                    vec![port("http", 80, POD_PORT, Some(30081))],
                );
                v["status"] = json!({"loadBalancer": {"ingress": [{"ip": "192.168.0.200"}]}});
                v
            }
        };
        v["spec"]["externalTrafficPolicy"] = json!("Cluster");
        put(api, v);
        put(api, slice(s.name, 0, &eps, &http));
    }
    put(
        api,
        service(
            "drain",
            "ClusterIP",
            "10.96.1.9",
            vec![port("http", 80, POD_PORT, None)],
        ),
    );
    drain_endpoints(api, &DRAIN_PODS);
}

/// The drain Service's slice with `pods` as its endpoints.
pub fn drain_endpoints(api: &FakeApiServer, pods: &[Ipv4Addr]) {
    let eps: Vec<String> = pods.iter().map(Ipv4Addr::to_string).collect();
    put(api, slice("drain", 0, &eps, &[("http", POD_PORT)]));
}

/// How many churned Services there are.
pub const CHURN_SERVICES: u32 = 30;

/// The churned Services: their shape now.
#[derive(Debug)]
pub struct Churn {
    /// Per Service: present, endpoints (last octets in 10.244.100.0/24), two ports.
    services: Vec<(bool, Vec<u8>, bool)>,
    /// Changes made.
    pub ops: u64,
}

impl Churn {
    /// Creates them all with two endpoints each.
    pub fn create(api: &FakeApiServer) -> Churn {
        let mut c = Churn {
            services: Vec::new(),
            ops: 0,
        };
        for i in 0..CHURN_SERVICES {
            let eps = vec![(i * 2 + 1) as u8, (i * 2 + 2) as u8];
            c.services.push((true, eps, false));
            c.write(api, i as usize);
        }
        c
    }

    fn name(i: usize) -> String {
        format!("c-{i}")
    }

    fn write(&self, api: &FakeApiServer, i: usize) {
        let (present, eps, two_ports) = &self.services[i];
        let name = Churn::name(i);
        if !present {
            remove(api, &name);
            return;
        }
        let node_port = (i % 3 == 0).then_some(31000 + i as u16 * 2);
        let mut ports = vec![port("http", 80, POD_PORT, node_port)];
        let mut sports = vec![("http", POD_PORT)];
        if *two_ports {
            ports.push(port("alt", 81, 9090, node_port.map(|p| p + 1)));
            sports.push(("alt", 9090));
        }
        let ty = if node_port.is_some() {
            "NodePort"
        } else {
            "ClusterIP"
        };
        let ip = format!("10.96.2.{}", i + 1);
        put(api, service(&name, ty, &ip, ports));
        let addrs: Vec<String> = eps.iter().map(|o| format!("10.244.100.{o}")).collect();
        put(api, slice(&name, 0, &addrs, &sports));
    }

    /// One random change: an endpoint replaced, added or removed, a port added or removed, a
    /// Service deleted or re-created. Returns what it did.
    pub fn step(&mut self, api: &FakeApiServer, rng: &mut Rng) -> String {
        let i = rng.below(self.services.len() as u64) as usize;
        let what;
        {
            let (present, eps, two_ports) = &mut self.services[i];
            if !*present {
                *present = true;
                what = "re-created";
            } else {
                match rng.below(10) {
                    0 => {
                        *present = false;
                        what = "deleted";
                    }
                    1 => {
                        *two_ports = !*two_ports;
                        what = "port toggled";
                    }
                    2 | 3 if eps.len() < 6 => {
                        eps.push(rng.range(1, 250) as u8);
                        eps.sort_unstable();
                        eps.dedup();
                        what = "endpoint added";
                    }
                    4 | 5 if eps.len() > 1 => {
                        let k = rng.below(eps.len() as u64) as usize;
                        eps.remove(k);
                        what = "endpoint removed";
                    }
                    _ => {
                        let k = rng.below(eps.len() as u64) as usize;
                        eps[k] = rng.range(1, 250) as u8;
                        eps.sort_unstable();
                        eps.dedup();
                        what = "endpoint replaced";
                    }
                }
            }
        }
        self.write(api, i);
        self.ops += 1;
        format!("{} {what}", Churn::name(i))
    }

    /// The ClusterIPs of present churned Services (drift targets).
    pub fn present(&self) -> Vec<(String, String, Vec<String>)> {
        self.services
            .iter()
            .enumerate()
            .filter(|(_, (p, _, _))| *p)
            .map(|(i, (_, eps, _))| {
                (
                    Churn::name(i),
                    format!("10.96.2.{}:80", i + 1),
                    eps.iter()
                        .map(|o| format!("10.244.100.{o}:{POD_PORT}"))
                        .collect(),
                )
            })
            .collect()
    }
}

/// The hostile objects of issue #32.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Hostile {
    /// Leading zeros in the ClusterIP, an externalIP and an endpoint address.
    LeadingZeros,
    /// externalIPs that are not addresses or not usable ones (CIDR, text, unspecified,
    /// multicast, loopback, broadcast, link-local).
    BadExternalIps,
    /// An externalIP equal to the node's address on the port of a stable NodePort.
    NodeIpExternalIp,
    /// An externalIP and port a stable Service already serves.
    ClaimsStableVip,
    /// A load balancer open to 0.0.0.0/0 through loadBalancerSourceRanges.
    LbAnySource,
    /// A 200 KiB annotation on a Service and on its slice.
    HugeAnnotation,
    /// One Service over the per-Service virtual-server budget (550 ports × 121 VIPs).
    OverBudget,
    /// 200 invalid Services at once (an Event flood).
    InvalidFlood,
}

impl Hostile {
    /// All of them.
    pub const ALL: [Hostile; 8] = [
        Hostile::LeadingZeros,
        Hostile::BadExternalIps,
        Hostile::NodeIpExternalIp,
        Hostile::ClaimsStableVip,
        Hostile::LbAnySource,
        Hostile::HugeAnnotation,
        Hostile::OverBudget,
        Hostile::InvalidFlood,
    ];

    /// Its name in the report.
    pub fn name(self) -> &'static str {
        match self {
            Hostile::LeadingZeros => "leading-zero addresses",
            Hostile::BadExternalIps => "bad externalIPs",
            Hostile::NodeIpExternalIp => "externalIP = node address on a NodePort's port",
            Hostile::ClaimsStableVip => "externalIP:port of a stable Service",
            Hostile::LbAnySource => "loadBalancerSourceRanges 0.0.0.0/0",
            Hostile::HugeAnnotation => "200 KiB annotations",
            Hostile::OverBudget => "over the per-Service budget (66,550 virtual servers)",
            Hostile::InvalidFlood => "200 invalid Services at once",
        }
    }

    /// Whether its objects stay for the rest of the run: only the invalid flood (rejected by
    /// any version, one Event each: Events per object over time). The others are removed after
    /// the check that follows them, so each is judged on its own.
    pub fn stays(self) -> bool {
        self == Hostile::InvalidFlood
    }

    /// Creates its objects (the `n`th of its kind, so names do not collide). Returns the
    /// Services written (their slices are `NAME-0`).
    pub fn create(self, api: &FakeApiServer, n: u32) -> Vec<String> {
        let name = |k: &str| format!("h-{k}-{n}");
        let third = 3 + (n % 200) as u8;
        let fake_eps = [format!("10.244.101.{third}")];
        let http = [("http", POD_PORT)];
        let mut objects = Vec::new();
        match self {
            Hostile::LeadingZeros => {
                let nm = name("zeros");
                let mut v = service(
                    &nm,
                    "ClusterIP",
                    &format!("010.096.003.{third:03}"),
                    vec![port("http", 80, POD_PORT, None)],
                );
                v["spec"]["externalIPs"] = json!(["010.000.000.001", "192.168.000.150"]);
                objects.push(v);
                objects.push(slice(&nm, 0, &[format!("010.244.000.{third:03}")], &http));
            }
            Hostile::BadExternalIps => {
                let nm = name("badext");
                let mut v = service(
                    &nm,
                    "ClusterIP",
                    &format!("10.96.3.{third}"),
                    vec![port("http", 80, POD_PORT, None)],
                );
                v["spec"]["externalIPs"] = json!([
                    "1.2.3.4/32",
                    "not-an-ip",
                    "0.0.0.0",
                    "::",
                    "224.0.0.1",
                    "127.0.0.1",
                    "255.255.255.255",
                    "169.254.1.1",
                    "fe80::1",
                    ""
                ]);
                objects.push(v);
                objects.push(slice(&nm, 0, &fake_eps, &http));
            }
            Hostile::NodeIpExternalIp => {
                let nm = name("nodeip");
                let mut v = service(
                    &nm,
                    "ClusterIP",
                    &format!("10.96.4.{third}"),
                    vec![port("http", 30080, POD_PORT, None)],
                );
                v["spec"]["externalIPs"] = json!([NODE_IP.to_string()]);
                objects.push(v);
                objects.push(slice(&nm, 0, &fake_eps, &http));
            }
            Hostile::ClaimsStableVip => {
                let nm = name("claim");
                let mut v = service(
                    &nm,
                    "ClusterIP",
                    &format!("10.96.5.{third}"),
                    vec![port("http", 80, POD_PORT, None)],
                );
                v["spec"]["externalIPs"] = json!(["192.168.0.100"]);
                objects.push(v);
                objects.push(slice(&nm, 0, &fake_eps, &http));
            }
            Hostile::LbAnySource => {
                let nm = name("anysrc");
                let mut v = service(
                    &nm,
                    "LoadBalancer",
                    &format!("10.96.6.{third}"),
                    vec![port("http", 80, POD_PORT, Some(30100 + (n % 400) as u16))],
                );
                v["spec"]["loadBalancerSourceRanges"] = json!(["0.0.0.0/0"]);
                v["status"] = json!({"loadBalancer": {"ingress": [{"ip": format!("192.168.0.{}", 201 + n % 50)}]}});
                objects.push(v);
                objects.push(slice(&nm, 0, &fake_eps, &http));
            }
            Hostile::HugeAnnotation => {
                let nm = name("huge");
                let big = "x".repeat(200 * 1024);
                let mut v = service(
                    &nm,
                    "ClusterIP",
                    &format!("10.96.7.{third}"),
                    vec![port("http", 80, POD_PORT, None)],
                );
                v["metadata"]["annotations"] = json!({"example.com/huge": big});
                objects.push(v);
                let mut s = slice(&nm, 0, &fake_eps, &http);
                s["metadata"]["annotations"] = json!({"example.com/huge": big});
                objects.push(s);
            }
            Hostile::OverBudget => {
                let nm = name("budget");
                let ports: Vec<Value> = (0..550u16)
                    .map(|k| port(&format!("p{k}"), 2000 + k, POD_PORT, None))
                    .collect();
                let mut v = service(&nm, "ClusterIP", &format!("10.96.8.{third}"), ports);
                let ips: Vec<String> = (0..120u32)
                    .map(|k| format!("198.18.{}.{}", n % 250, k + 1))
                    .collect();
                v["spec"]["externalIPs"] = json!(ips);
                objects.push(v);
            }
            Hostile::InvalidFlood => {
                for k in 0..200u32 {
                    let nm = format!("h-flood-{n}-{k}");
                    let mut v = service(
                        &nm,
                        "ClusterIP",
                        &format!("10.96.{}.{}", 10 + k / 250, k % 250 + 1),
                        vec![port("http", 80, POD_PORT, None)],
                    );
                    // An unknown protocol: invalid, one Event (and log line) per object.
                    v["spec"]["ports"][0]["protocol"] = json!("XTP");
                    objects.push(v);
                }
            }
        }
        let mut services = Vec::new();
        for o in objects {
            if o["kind"] == "Service" {
                services.push(
                    o["metadata"]["name"]
                        .as_str()
                        .unwrap_or_default()
                        .to_string(),
                );
            }
            put(api, o);
        }
        services
    }
}

/// A Service whose presence changes the IPVS-mode iptables rules (a NodePort and an externalIP
/// with externalTrafficPolicy Local fill KUBE-NODE-PORT-LOCAL-TCP and KUBE-EXTERNAL-IP-LOCAL,
/// whose match rules exist only while those sets are not empty): toggled at the start of the
/// iptables faults so that an iptables-restore is due while they last.
pub fn rules_toggle(api: &FakeApiServer, present: bool) {
    let name = "rules-toggle";
    if !present {
        remove(api, name);
        return;
    }
    let mut v = service(
        name,
        "NodePort",
        "10.96.1.20",
        vec![port("http", 80, POD_PORT, Some(30200))],
    );
    v["spec"]["externalTrafficPolicy"] = json!("Local");
    v["spec"]["externalIPs"] = json!(["192.168.0.150"]);
    put(api, v);
    put(
        api,
        slice(
            name,
            0,
            &["10.244.101.250".to_string()],
            &[("http", POD_PORT)],
        ),
    );
}
