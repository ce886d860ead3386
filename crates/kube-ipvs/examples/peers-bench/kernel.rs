//! What the kernel holds, per proxy mode: the counts that say a proxy has programmed every
//! Service ("converged by count"), the check that one endpoint change has arrived, and the
//! wipe that gives the next proxy an empty node.
//!
//! Counted (every count must reach its target; the generated Services only):
//! - IPVS (`kube-ipvs`, `upstream-ipvs`): N virtual servers `ClusterIP:80/TCP` and N x M real
//!   servers with a weight (one netlink dump, like `ipvsadm -Ln`), N members `ClusterIP,tcp:80`
//!   of the `KUBE-CLUSTER-IP` ipset (`ipset list`; without them the KUBE-IPVS-FILTER rule
//!   rejects new connections to the VIP) and N ClusterIPs on `kube-ipvs0` (`ip -4 addr`).
//! - nftables (`upstream-nftables`): N elements `ClusterIP . tcp . 80 : goto service-…` of the
//!   `service-ips` map of table `ip kube-proxy` (`nft list map`), then N x M distinct endpoint
//!   addresses in the table (`nft list table`): kube-proxy 1.37 writes a Service's endpoints
//!   into its chain's `dnat ip to numgen random mod M map { 0 : IP . 8080, … }`; older
//!   releases jumped to one `endpoint-…__IP/8080` chain per endpoint (both are counted).
//! - iptables (`kube-ipvs-iptables`, `upstream-iptables`, both through iptables-nft): N
//!   `-d ClusterIP/32 … -j KUBE-SVC-…` rules in nat `KUBE-SERVICES` (`iptables -S`), then N x M
//!   `-j DNAT --to-destination POD:8080` rules in `KUBE-SEP-…` chains (`iptables-save -t nat`).
//!
//! The cheap count runs first; the expensive one only once the cheap one is complete.

use std::collections::HashMap;
use std::net::{IpAddr, Ipv4Addr};
use std::time::Duration;

use ipvs_netlink::{Protocol, ServiceKey};
use serde_json::{json, Value};

use crate::nft::{self, Nft};
use crate::objects::{self, PORT, TARGET_PORT};
use crate::Res;

/// How a proxy programs the kernel.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// IPVS virtual servers, ipsets, a few iptables rules.
    Ipvs,
    /// nf_tables table `ip kube-proxy`.
    Nftables,
    /// iptables chains (iptables-nft).
    Iptables,
}

/// Runs a shell command line under dash; its stdout ("" when it fails: absent objects).
pub fn sh_out(cmd: &str) -> String {
    std::process::Command::new("sh")
        .args(["-c", cmd])
        .stderr(std::process::Stdio::null())
        .output()
        .ok()
        .map(|o| String::from_utf8_lossy(&o.stdout).into_owned())
        .unwrap_or_default()
}

/// Empties the node: IPVS, kube-ipvs0, every nf_tables table (iptables-nft's too), legacy
/// iptables when loaded, ipsets, conntrack.
pub fn wipe() {
    let legacy = std::fs::read_to_string("/proc/net/ip_tables_names")
        .map(|s| !s.trim().is_empty())
        .unwrap_or(false);
    let mut script =
        String::from("ipvsadm -C\nip link del kube-ipvs0 2>/dev/null\nnft flush ruleset\n");
    if legacy {
        script.push_str(
            "for t in raw mangle nat filter; do iptables-legacy -t $t -F; iptables-legacy -t $t -X; done 2>/dev/null\n",
        );
    }
    script
        .push_str("ipset flush 2>/dev/null\nipset destroy 2>/dev/null\nconntrack -F 2>/dev/null\n");
    let _ = sh_out(&script);
}

/// What one count round found: (name, got, want) per count, in order, and whether all are
/// complete.
#[derive(Debug, Clone, Default)]
pub struct Progress {
    /// The counts made in this round.
    pub parts: Vec<(&'static str, usize, usize)>,
}

impl Progress {
    fn push(&mut self, name: &'static str, got: usize, want: usize) -> bool {
        self.parts.push((name, got, want));
        got >= want
    }

    /// Every count of the mode reached its target (the last stage was counted and complete).
    pub fn complete(&self, stages: usize) -> bool {
        self.parts.len() == stages && self.parts.iter().all(|(_, g, w)| g >= w)
    }

    /// As JSON: `{name: got}` plus `want`.
    pub fn json(&self) -> Value {
        let mut m = serde_json::Map::new();
        for (name, got, want) in &self.parts {
            m.insert((*name).into(), json!({"got": got, "want": want}));
        }
        Value::Object(m)
    }
}

fn service_key(i: usize) -> ServiceKey {
    ServiceKey::Inet {
        protocol: Protocol::Tcp,
        addr: IpAddr::V4(objects::cluster_ip(i)),
        port: PORT,
    }
}

/// The convergence counter of one mode.
pub struct Counter {
    mode: Mode,
    n: usize,
    m: usize,
    ipvs: Option<ipvs_netlink::Client>,
    /// nftables: the service chain of each generated Service (from the `service-ips` map).
    pub nft_chains: HashMap<usize, String>,
}

impl Counter {
    /// A counter for `n` Services of `m` endpoints.
    pub fn new(mode: Mode, n: usize, m: usize) -> Res<Counter> {
        let ipvs = match mode {
            Mode::Ipvs => Some(ipvs_netlink::Client::new()?),
            _ => None,
        };
        Ok(Counter {
            mode,
            n,
            m,
            ipvs,
            nft_chains: HashMap::new(),
        })
    }

    /// How many stages a complete round has.
    pub fn stages(&self) -> usize {
        match self.mode {
            Mode::Ipvs => 4,
            Mode::Nftables | Mode::Iptables => 2,
        }
    }

    /// One round of counts, stopping at the first incomplete one: cheapest first, and in IPVS
    /// mode the counts that take no IPVS lock before the IPVS dumps.
    pub fn check(&mut self) -> Res<Progress> {
        let (n, nm) = (self.n, self.n * self.m);
        let mut p = Progress::default();
        match self.mode {
            Mode::Ipvs => {
                // kube-ipvs0 (rtnetlink) and the ClusterIP set (ipset) first: the IPVS dumps
                // take the kernel's IPVS mutex, which every IPVS write of the proxy takes too,
                // so they wait until the rest of the table is in place.
                let addrs = sh_out("ip -4 -o addr show dev kube-ipvs0")
                    .lines()
                    .filter_map(|l| {
                        let a = l.split_whitespace().skip_while(|w| *w != "inet").nth(1)?;
                        let ip: Ipv4Addr = a.split('/').next()?.parse().ok()?;
                        objects::service_of(ip, n)
                    })
                    .count();
                if !p.push("kube_ipvs0_addresses", addrs, n) {
                    return Ok(p);
                }
                let set = ipset_members(&sh_out("ipset list KUBE-CLUSTER-IP"), n);
                if !p.push("ipset_cluster_ip", set, n) {
                    return Ok(p);
                }
                let Some(c) = self.ipvs.as_mut() else {
                    return Ok(p);
                };
                let vs = c
                    .services()?
                    .iter()
                    .filter(|s| bench_service(&s.key, n).is_some())
                    .count();
                if !p.push("virtual_servers", vs, n) {
                    return Ok(p);
                }
                let rs: usize = c
                    .dump()?
                    .iter()
                    .filter(|(s, _)| bench_service(&s.key, n).is_some())
                    .map(|(_, d)| d.iter().filter(|d| d.weight > 0).count())
                    .sum();
                p.push("real_servers", rs, nm);
            }
            Mode::Nftables => {
                let map = sh_out("nft list map ip kube-proxy service-ips");
                self.nft_chains = service_map_chains(&map, n);
                if !p.push("service_ips_elements", self.nft_chains.len(), n) {
                    return Ok(p);
                }
                let table = sh_out("nft list table ip kube-proxy");
                p.push("endpoint_addresses", nft_endpoints(&table), nm);
            }
            Mode::Iptables => {
                let services = sh_out("iptables -t nat -S KUBE-SERVICES");
                if !p.push("kube_services_rules", service_rules(&services, n), n) {
                    return Ok(p);
                }
                let nat = sh_out("iptables-save -t nat");
                p.push("dnat_rules", dnat_rules(&nat), nm);
            }
        }
        Ok(p)
    }
}

fn bench_service(key: &ServiceKey, n: usize) -> Option<usize> {
    match key {
        ServiceKey::Inet {
            protocol: Protocol::Tcp,
            addr: IpAddr::V4(a),
            port,
        } if *port == PORT => objects::service_of(*a, n),
        _ => None,
    }
}

/// Members `ClusterIP,tcp:80` of the generated Services in `ipset list` output.
pub fn ipset_members(text: &str, n: usize) -> usize {
    text.lines()
        .filter_map(|l| {
            let (ip, rest) = l.trim().split_once(',')?;
            let ip: Ipv4Addr = ip.parse().ok()?;
            (rest.starts_with("tcp:80")).then_some(())?;
            objects::service_of(ip, n)
        })
        .count()
}

/// The service chain of each generated Service in `nft list map … service-ips` output
/// (`10.100.0.5 . tcp . 80 : goto service-HASH-bench/svc-5/tcp/http`, several per line).
pub fn service_map_chains(text: &str, n: usize) -> HashMap<usize, String> {
    let mut out = HashMap::new();
    for part in text.split([',', '{', '}', '\n']) {
        let Some((key, verdict)) = part.split_once(':') else {
            continue;
        };
        let mut k = key.split_whitespace();
        let (Some(ip), Some("."), Some("tcp"), Some("."), Some(port)) =
            (k.next(), k.next(), k.next(), k.next(), k.next())
        else {
            continue;
        };
        let (Ok(ip), Ok(port)) = (ip.parse::<Ipv4Addr>(), port.parse::<u16>()) else {
            continue;
        };
        let mut v = verdict.split_whitespace();
        if let (Some("goto"), Some(chain), Some(i), true) =
            (v.next(), v.next(), objects::service_of(ip, n), port == PORT)
        {
            out.insert(i, chain.to_string());
        }
    }
    out
}

/// Distinct benchmark pod addresses a `nft list table` output sends traffic to: `IP . 8080`
/// (an element of a dnat map) or `__IP/8080` (an endpoint chain's name).
pub fn nft_endpoints(text: &str) -> usize {
    let port = TARGET_PORT.to_string();
    let mut seen = std::collections::HashSet::new();
    let words: Vec<&str> = text
        .split(|c: char| c.is_whitespace() || c == ',' || c == '{' || c == '}')
        .filter(|w| !w.is_empty())
        .collect();
    for (k, w) in words.iter().enumerate() {
        let ip = if let Some((_, rest)) = w.rsplit_once("__") {
            rest.split_once('/')
                .filter(|(_, p)| *p == port)
                .and_then(|(ip, _)| ip.parse::<Ipv4Addr>().ok())
        } else if words.get(k + 1) == Some(&".") && words.get(k + 2) == Some(&port.as_str()) {
            w.parse::<Ipv4Addr>().ok()
        } else {
            None
        };
        if let Some(ip) = ip.filter(|ip| objects::is_pod(*ip)) {
            seen.insert(ip);
        }
    }
    seen.len()
}

/// `-A KUBE-SERVICES -d CLUSTERIP/32 … -j KUBE-SVC-…` rules of the generated Services.
pub fn service_rules(text: &str, n: usize) -> usize {
    text.lines()
        .filter(|l| l.starts_with("-A KUBE-SERVICES ") && l.contains("-j KUBE-SVC-"))
        .filter_map(|l| {
            let mut w = l.split_whitespace().skip_while(|w| *w != "-d");
            let ip: Ipv4Addr = w.nth(1)?.split('/').next()?.parse().ok()?;
            objects::service_of(ip, n)
        })
        .count()
}

/// `-A KUBE-SEP-… -j DNAT --to-destination POD:8080` rules (benchmark pods only).
pub fn dnat_rules(text: &str) -> usize {
    text.lines()
        .filter(|l| l.starts_with("-A KUBE-SEP-") && l.contains("-j DNAT"))
        .filter_map(|l| {
            let mut w = l
                .split_whitespace()
                .skip_while(|w| *w != "--to-destination");
            let (ip, port) = w.nth(1)?.split_once(':')?;
            let ip: Ipv4Addr = ip.parse().ok()?;
            (objects::is_pod(ip) && port == TARGET_PORT.to_string()).then_some(())
        })
        .count()
}

/// Whether one endpoint change (endpoint `old` of Service `i` replaced by `new`) has reached
/// the kernel. One per observer thread (its own sockets).
pub struct Watcher {
    mode: Mode,
    ipvs: Option<ipvs_netlink::Client>,
    nft: Option<Nft>,
    nft_chains: HashMap<usize, String>,
    /// Checks made.
    pub checks: u64,
}

impl Watcher {
    /// A watcher; `nft_chains` are the nftables service chains (empty for other modes).
    pub fn new(mode: Mode, nft_chains: HashMap<usize, String>) -> Res<Watcher> {
        let (ipvs, nft) = match mode {
            Mode::Ipvs => (Some(ipvs_netlink::Client::new()?), None),
            Mode::Nftables | Mode::Iptables => (None, Some(Nft::new()?)),
        };
        Ok(Watcher {
            mode,
            ipvs,
            nft,
            nft_chains,
            checks: 0,
        })
    }

    /// IPVS: the virtual server's real servers have `new` with a weight and not `old` with
    /// one (a drained real server stays at weight 0). nftables: the anonymous maps of the
    /// service chain's rules hold `new` and not `old` (kube-proxy 1.37: the addresses of its
    /// `dnat … map`; older: the names of the endpoint chains of its verdict map). iptables:
    /// the `KUBE-SVC-` chain jumps to `new`'s `KUBE-SEP-` chain and not to `old`'s.
    pub fn visible(&mut self, i: usize, old: Ipv4Addr, new: Ipv4Addr) -> Res<bool> {
        self.checks += 1;
        match self.mode {
            Mode::Ipvs => {
                let Some(c) = self.ipvs.as_mut() else {
                    return Ok(false);
                };
                let dests = c.destinations(&service_key(i))?;
                let live = |a: Ipv4Addr| {
                    dests
                        .iter()
                        .any(|d| d.addr == IpAddr::V4(a) && d.weight > 0)
                };
                Ok(live(new) && !live(old))
            }
            Mode::Nftables => {
                let (Some(nft), Some(chain)) = (self.nft.as_mut(), self.nft_chains.get(&i)) else {
                    return Ok(false);
                };
                let rules = nft.rules("kube-proxy", chain)?;
                let mut has_new = false;
                for set in rules
                    .iter()
                    .flat_map(|r| nft::strings_with_prefix(r, b"__map"))
                {
                    for e in nft.set_elements("kube-proxy", &set)? {
                        if nft::holds_ip(&e, old) {
                            return Ok(false);
                        }
                        has_new |= nft::holds_ip(&e, new);
                    }
                }
                Ok(has_new)
            }
            Mode::Iptables => {
                let Some(nft) = self.nft.as_mut() else {
                    return Ok(false);
                };
                let spn = objects::service_port_name(i);
                let proto = ipset::Protocol::Tcp;
                let svc = iptables::proxy_mode::svc_chain(&spn, proto);
                let sep = |a: Ipv4Addr| {
                    iptables::proxy_mode::sep_chain(&spn, proto, IpAddr::V4(a), TARGET_PORT)
                };
                let (sep_old, sep_new) = (sep(old), sep(new));
                let rules = nft.rules("nat", &svc)?;
                let any = |name: &str| rules.iter().any(|r| nft::contains(r, name.as_bytes()));
                Ok(any(&sep_new) && !any(&sep_old))
            }
        }
    }
}

/// Sleeps so that a round that took `spent` is followed by a pause at least as long (the
/// observer takes at most half of one CPU), at least `min`.
pub fn pause(spent: Duration, min: Duration) {
    std::thread::sleep(spent.max(min));
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parsers_count_only_the_generated_services() {
        let map = "table ip kube-proxy {\n\tmap service-ips {\n\t\ttype ipv4_addr . inet_proto . inet_service : verdict\n\
                   \t\telements = { 10.96.0.1 . tcp . 443 : goto service-2QRHZV4L-default/kubernetes/tcp/https,\n\
                   \t\t\t     10.100.0.1 . tcp . 80 : goto service-ABCDEFGH-bench/svc-1/tcp/http, 10.100.0.0 . tcp . 80 : goto service-ZZZZZZZZ-bench/svc-0/tcp/http }\n\t}\n}\n";
        let chains = service_map_chains(map, 2);
        assert_eq!(chains.len(), 2);
        assert_eq!(chains[&1], "service-ABCDEFGH-bench/svc-1/tcp/http");
        assert_eq!(service_map_chains(map, 1).len(), 1);
        let table = "table ip kube-proxy {\n\tchain service-X-bench/svc-1/tcp/http {\n\
                     \t\tmeta l4proto tcp dnat ip to numgen random mod 2 map { 0 : 10.240.0.2 . 8080, 1 : 10.240.0.3 . 8080 }\n\t}\n\
                     \tchain service-Y-default/kubernetes/tcp/https {\n\t\tmeta l4proto tcp dnat ip to numgen random mod 1 map { 0 : 10.0.2.100 . 6443 }\n\t}\n\
                     \tchain endpoint-AAAA-bench/svc-2/tcp/http__10.240.0.4/8080 {\n\t\tmeta l4proto tcp dnat to 10.240.0.4:8080\n\t}\n\
                     \tchain service-Z-bench/svc-2/tcp/http {\n\t\tnumgen random mod 1 vmap { 0 : goto endpoint-AAAA-bench/svc-2/tcp/http__10.240.0.4/8080 }\n\t}\n}\n";
        assert_eq!(nft_endpoints(table), 3);
        let svc = "-N KUBE-SERVICES\n-A KUBE-SERVICES -d 10.96.0.1/32 -p tcp -m comment --comment \"default/kubernetes:https cluster IP\" -m tcp --dport 443 -j KUBE-SVC-NPX46M4PTMTKRN6Y\n\
                   -A KUBE-SERVICES -d 10.100.0.3/32 -p tcp -m tcp --dport 80 -j KUBE-SVC-AAAAAAAAAAAAAAAA\n\
                   -A KUBE-SERVICES -m addrtype --dst-type LOCAL -j KUBE-NODEPORTS\n";
        assert_eq!(service_rules(svc, 4), 1);
        assert_eq!(service_rules(svc, 3), 0);
        let nat = "-A KUBE-SEP-A -s 10.240.0.2/32 -j KUBE-MARK-MASQ\n-A KUBE-SEP-A -p tcp -m tcp -j DNAT --to-destination 10.240.0.2:8080\n\
                   -A KUBE-SEP-B -p tcp -m tcp -j DNAT --to-destination 10.0.2.100:6443\n-A KUBE-SEP-C -p tcp -j DNAT --to-destination 10.253.0.1:8080\n";
        assert_eq!(dnat_rules(nat), 2);
        let ipset = "Name: KUBE-CLUSTER-IP\nType: hash:ip,port\nMembers:\n10.96.0.1,tcp:443\n10.100.0.0,tcp:80\n10.100.0.1,tcp:80\n10.100.0.9,tcp:80\n";
        assert_eq!(ipset_members(ipset, 2), 2);
        let mut p = Progress::default();
        assert!(p.push("a", 2, 2));
        assert!(!p.complete(2));
        assert!(!p.push("b", 1, 2));
        assert!(!p.complete(2));
        assert_eq!(p.json()["b"]["got"], 1);
    }

    fn in_ns<T: Send + 'static>(
        ns: &testkit::netns::Netns,
        f: impl FnOnce() -> T + Send + 'static,
    ) -> T {
        ns.enter(move || Ok(f())).unwrap()
    }

    /// The nftables and iptables-nft checks against the kernel: rules shaped like upstream's
    /// (nftables: a service chain with an anonymous verdict map to endpoint chains, as before
    /// 1.37, and one with a `dnat … map` of addresses, as 1.37 writes it; iptables: a KUBE-SVC
    /// chain jumping to KUBE-SEP chains), counted, then one endpoint replaced in two steps
    /// (the new one added, then the old one dropped): visible only after the second.
    #[test]
    #[ignore = "netns"]
    fn netns_change_checks_read_nftables_and_iptables_nft() {
        let ns = testkit::netns::Netns::new("peers").unwrap();
        let ep = |a: &str, h: &str| format!("endpoint-{h}-bench/svc-0/tcp/http__{a}/8080");
        let svc = "service-SSSSSSSS-bench/svc-0/tcp/http";
        let svc1 = "service-TTTTTTTT-bench/svc-1/tcp/http";
        let (e0, e1, e2) = (
            ep("10.240.0.0", "EEEEEEE0"),
            ep("10.240.0.1", "EEEEEEE1"),
            ep("10.253.0.0", "EEEEEEE2"),
        );
        ns.sh(&format!(
            "nft -f - <<'EOF'\ntable ip kube-proxy {{\n\
             chain {e0} {{\nmeta l4proto tcp dnat to 10.240.0.0:8080\n}}\n\
             chain {e1} {{\nmeta l4proto tcp dnat to 10.240.0.1:8080\n}}\n\
             chain {svc} {{\nnumgen random mod 2 vmap {{ 0 : goto {e0}, 1 : goto {e1} }}\n}}\n\
             chain {svc1} {{\nmeta l4proto tcp dnat ip to numgen random mod 2 map {{ 0 : 10.240.0.2 . 8080, 1 : 10.240.0.3 . 8080 }}\n}}\n\
             map service-ips {{\ntype ipv4_addr . inet_proto . inet_service : verdict\n\
             elements = {{ 10.100.0.0 . tcp . 80 : goto {svc}, 10.100.0.1 . tcp . 80 : goto {svc1} }}\n}}\n\
             }}\nEOF\n"
        ))
        .unwrap();
        let (old, new) = (Ipv4Addr::new(10, 240, 0, 0), Ipv4Addr::new(10, 253, 0, 0));
        let chains = in_ns(&ns, || {
            let mut c = Counter::new(Mode::Nftables, 2, 2).unwrap();
            let p = c.check().unwrap();
            assert!(p.complete(c.stages()), "{:?}", p.parts);
            c.nft_chains
        });
        assert_eq!(chains[&0], svc);
        assert_eq!(chains[&1], svc1);
        let check_of = |i: usize, old: Ipv4Addr, new: Ipv4Addr, chains: HashMap<usize, String>| {
            in_ns(&ns, move || {
                Watcher::new(Mode::Nftables, chains)
                    .unwrap()
                    .visible(i, old, new)
                    .unwrap()
            })
        };
        // 1.37's shape: the addresses are the map's data.
        let (old1, new1) = (Ipv4Addr::new(10, 240, 0, 2), Ipv4Addr::new(10, 253, 0, 1));
        assert!(!check_of(1, old1, new1, chains.clone()));
        ns.sh(&format!(
            "nft flush chain ip kube-proxy {svc1} && nft add rule ip kube-proxy {svc1} meta l4proto tcp \
             dnat ip to numgen random mod 3 map {{ 0 : 10.240.0.2 . 8080, 1 : 10.240.0.3 . 8080, 2 : 10.253.0.1 . 8080 }}"
        ))
        .unwrap();
        assert!(
            !check_of(1, old1, new1, chains.clone()),
            "the old endpoint is still there"
        );
        ns.sh(&format!(
            "nft flush chain ip kube-proxy {svc1} && nft add rule ip kube-proxy {svc1} meta l4proto tcp \
             dnat ip to numgen random mod 2 map {{ 0 : 10.253.0.1 . 8080, 1 : 10.240.0.3 . 8080 }}"
        ))
        .unwrap();
        assert!(check_of(1, old1, new1, chains.clone()));
        // The older shape: endpoint chains named with their address.
        let check = |chains: HashMap<usize, String>| check_of(0, old, new, chains);
        assert!(!check(chains.clone()));
        ns.sh(&format!(
            "nft add chain ip kube-proxy {e2} && nft add rule ip kube-proxy {e2} meta l4proto tcp dnat to 10.253.0.0:8080 && \
             nft flush chain ip kube-proxy {svc} && \
             nft add rule ip kube-proxy {svc} numgen random mod 3 vmap {{ 0 : goto {e0}, 1 : goto {e1}, 2 : goto {e2} }}"
        ))
        .unwrap();
        assert!(!check(chains.clone()), "the old endpoint is still there");
        ns.sh(&format!(
            "nft flush chain ip kube-proxy {svc} && \
             nft add rule ip kube-proxy {svc} numgen random mod 2 vmap {{ 0 : goto {e2}, 1 : goto {e1} }}"
        ))
        .unwrap();
        assert!(check(chains));

        // iptables-nft, names hashed like upstream's.
        let spn = objects::service_port_name(0);
        let tcp = ipset::Protocol::Tcp;
        let svc = iptables::proxy_mode::svc_chain(&spn, tcp);
        let sep = |a: Ipv4Addr| iptables::proxy_mode::sep_chain(&spn, tcp, IpAddr::V4(a), 8080);
        let mid = Ipv4Addr::new(10, 240, 0, 1);
        let (s0, s1, s2) = (sep(old), sep(mid), sep(new));
        let restore = |body: &str| {
            ns.sh(&format!(
                "iptables-nft-restore --noflush <<'EOF'\n*nat\n{body}COMMIT\nEOF\n"
            ))
            .unwrap()
        };
        restore(&format!(
            ":KUBE-SERVICES - [0:0]\n:{svc} - [0:0]\n:{s0} - [0:0]\n:{s1} - [0:0]\n\
             -A KUBE-SERVICES -d 10.100.0.0/32 -p tcp -m tcp --dport 80 -j {svc}\n\
             -A {svc} -m statistic --mode random --probability 0.5000000000 -j {s0}\n-A {svc} -j {s1}\n\
             -A {s0} -s 10.240.0.0/32 -j MARK --set-xmark 0x4000/0x4000\n\
             -A {s0} -p tcp -m tcp -j DNAT --to-destination 10.240.0.0:8080\n\
             -A {s1} -p tcp -m tcp -j DNAT --to-destination 10.240.0.1:8080\n"
        ));
        let p = in_ns(&ns, || {
            Counter::new(Mode::Iptables, 1, 2).unwrap().check().unwrap()
        });
        assert!(p.complete(2), "{:?}", p.parts);
        let check = || {
            in_ns(&ns, move || {
                Watcher::new(Mode::Iptables, HashMap::new())
                    .unwrap()
                    .visible(0, old, new)
                    .unwrap()
            })
        };
        assert!(!check());
        restore(&format!(
            ":{svc} - [0:0]\n:{s2} - [0:0]\n\
             -A {svc} -m statistic --mode random --probability 0.5000000000 -j {s2}\n-A {svc} -j {s1}\n\
             -A {s2} -p tcp -m tcp -j DNAT --to-destination 10.253.0.0:8080\n"
        ));
        assert!(check());
    }
}
