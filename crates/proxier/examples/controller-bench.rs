//! Benchmark driver for `cargo xtask bench` (and the `vm_bench_smoke` test): drives the real
//! controller (store → proxier → `NodeKernel`) against the kernel of a fresh network namespace
//! and compares it with `ipvsadm` / `ipset` on the identical table in the same boot.
//!
//! Usage (root, IPVS, `ip`, `ipvsadm`, `ipset`, `iptables` in PATH):
//!
//! ```text
//! controller-bench run SERVICES REALS      P1 full program, P2 one change (endpoint / add /
//!                                          delete service), P3 RSS, P4 drift check, iptables
//!                                          processes per sync; references: ipvsadm --restore
//!                                          and ipvsadm -Sn of the identical table
//! controller-bench ipset ENTRIES SAMPLE    P5: ENTRIES ipset members in one `ipset restore`
//!                                          vs one `ipset add` process per entry (SAMPLE of them
//!                                          timed, extrapolated to ENTRIES when smaller)
//! ```
//!
//! Each prints human lines and one `BENCH-JSON {...}` line. The table is kube-proxy-like:
//! SERVICES ClusterIP TCP services (10.96.x.y:80, one port) with REALS ready endpoints each
//! (10.244.x.y:8080). Ours runs in fresh namespace A; the reference restore runs in a fresh
//! namespace R after A is flushed and gone (the kernel keeps deleted real servers ~2 min per
//! namespace and scans that list on every add, and live rate estimators load the CPU).

use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use conntrack::ConntrackFilter;
use desired::diff::IpvsTable;
use ipset::{IpsetDiff, IpsetState};
use ipvs_netlink::{Family, Op, OpKind, Protocol, ServiceKey};
use k8s_openapi::api::core::v1::{Service, ServicePort, ServiceSpec};
use k8s_openapi::api::discovery::v1::{Endpoint, EndpointConditions, EndpointPort, EndpointSlice};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use model::event::{Kind, Object, SourceEvent};
use model::store::Store;
use model::ProxyConfig;
use proxier::ipvs_mode::{Proxier, RulesConfig, SyncKind, SyncReport};
use proxier::kernel::{Kernel, KernelCounters, KernelError, NodeKernel};
use serde_json::{json, Value};
use testkit::netns::Netns;

/// A benchmark failure: the message is printed and the driver exits non-zero.
type BenchError = Box<dyn std::error::Error + Send + Sync>;
type Res<T> = Result<T, BenchError>;

fn io<E: std::fmt::Display>(what: &str) -> impl FnOnce(E) -> BenchError + '_ {
    move |e| format!("{what}: {e}").into()
}

// ---------------------------------------------------------------------------------------------
// Generated objects

fn vip(i: usize) -> String {
    format!("10.{}.{}.{}", 96 + i / 65536, (i / 256) % 256, i % 256)
}

fn backend(n: usize) -> String {
    format!(
        "10.{}.{}.{}",
        244 + (n / 65536) % 8,
        (n / 256) % 256,
        n % 256
    )
}

fn meta(name: &str) -> ObjectMeta {
    ObjectMeta {
        namespace: Some("bench".into()),
        name: Some(name.into()),
        ..Default::default()
    }
}

fn service(i: usize) -> Object {
    let ip = vip(i);
    Object::from(Service {
        metadata: meta(&format!("svc-{i}")),
        spec: Some(ServiceSpec {
            cluster_ip: Some(ip.clone()),
            cluster_ips: Some(vec![ip]),
            type_: Some("ClusterIP".into()),
            ports: Some(vec![ServicePort {
                name: Some("http".into()),
                port: 80,
                protocol: Some("TCP".into()),
                ..Default::default()
            }]),
            ..Default::default()
        }),
        status: None,
    })
}

/// The slice of service `i` with the given backend indices.
fn slice(i: usize, backends: impl IntoIterator<Item = usize>) -> Object {
    let mut m = meta(&format!("svc-{i}-abc"));
    m.labels = Some(BTreeMap::from([(
        "kubernetes.io/service-name".to_string(),
        format!("svc-{i}"),
    )]));
    let endpoints = backends
        .into_iter()
        .map(|n| Endpoint {
            addresses: vec![backend(n)],
            conditions: Some(EndpointConditions {
                ready: Some(true),
                serving: Some(true),
                terminating: Some(false),
            }),
            node_name: Some("node-b".into()),
            ..Default::default()
        })
        .collect();
    Object::from(EndpointSlice {
        address_type: "IPv4".into(),
        endpoints,
        metadata: m,
        ports: Some(vec![EndpointPort {
            name: Some("http".into()),
            port: Some(8080),
            protocol: Some("TCP".into()),
            app_protocol: None,
        }]),
    })
}

fn store_with(n: usize, m: usize) -> Res<Store> {
    let mut store = Store::new();
    store.apply(SourceEvent::Init(Kind::Service));
    for i in 0..n {
        store.apply(SourceEvent::InitApply(service(i)));
    }
    store.apply(SourceEvent::InitDone(Kind::Service));
    store.apply(SourceEvent::Init(Kind::EndpointSlice));
    for i in 0..n {
        store.apply(SourceEvent::InitApply(slice(i, i * m..(i + 1) * m)));
    }
    store.apply(SourceEvent::InitDone(Kind::EndpointSlice));
    if !store.synced() {
        return Err("store not synced after the initial lists".into());
    }
    Ok(store)
}

fn key(i: usize) -> Res<ServiceKey> {
    Ok(ServiceKey::Inet {
        protocol: Protocol::Tcp,
        addr: vip(i).parse().map_err(io("vip"))?,
        port: 80,
    })
}

// ---------------------------------------------------------------------------------------------
// A kernel that times each subsystem

#[derive(Default, Clone, Copy)]
struct Spent {
    ipvs: Duration,
    addresses: Duration,
    ipset: Duration,
    iptables: Duration,
}

struct Timed<K> {
    inner: K,
    spent: Spent,
}

fn timed<T>(acc: &mut Duration, f: impl FnOnce() -> T) -> T {
    let t = Instant::now();
    let r = f();
    *acc += t.elapsed();
    r
}

impl<K: Kernel> Kernel for Timed<K> {
    fn read_ipvs(&mut self, family: Family) -> Result<IpvsTable, KernelError> {
        timed(&mut self.spent.ipvs, || self.inner.read_ipvs(family))
    }
    fn list_ipvs(&mut self, family: Family) -> Result<BTreeSet<ServiceKey>, KernelError> {
        timed(&mut self.spent.ipvs, || self.inner.list_ipvs(family))
    }
    fn read_ipvs_keys(&mut self, keys: &BTreeSet<ServiceKey>) -> Result<IpvsTable, KernelError> {
        timed(&mut self.spent.ipvs, || self.inner.read_ipvs_keys(keys))
    }
    fn apply_ipvs(&mut self, ops: &[Op]) -> Vec<Result<(), KernelError>> {
        timed(&mut self.spent.ipvs, || self.inner.apply_ipvs(ops))
    }
    fn ensure_link(&mut self) -> Result<bool, KernelError> {
        timed(&mut self.spent.addresses, || self.inner.ensure_link())
    }
    fn read_addresses(&mut self, family: Family) -> Result<BTreeSet<IpAddr>, KernelError> {
        timed(&mut self.spent.addresses, || {
            self.inner.read_addresses(family)
        })
    }
    fn apply_addresses(
        &mut self,
        add: &[IpAddr],
        del: &[IpAddr],
    ) -> Vec<(IpAddr, Result<(), KernelError>)> {
        timed(&mut self.spent.addresses, || {
            self.inner.apply_addresses(add, del)
        })
    }
    fn read_ipsets(&mut self, owned: &[String]) -> Result<IpsetState, KernelError> {
        timed(&mut self.spent.ipset, || self.inner.read_ipsets(owned))
    }
    fn apply_ipsets(&mut self, diff: &IpsetDiff) -> Result<Vec<ipset::Rejected>, KernelError> {
        timed(&mut self.spent.ipset, || self.inner.apply_ipsets(diff))
    }
    fn apply_iptables(
        &mut self,
        rules: &iptables::RuleSet,
        force: bool,
    ) -> Result<bool, KernelError> {
        timed(&mut self.spent.iptables, || {
            self.inner.apply_iptables(rules, force)
        })
    }
    fn delete_conntrack(&mut self, filters: &[ConntrackFilter]) -> Result<u64, KernelError> {
        self.inner.delete_conntrack(filters)
    }
    fn counters(&self) -> KernelCounters {
        self.inner.counters()
    }
}

// ---------------------------------------------------------------------------------------------
// Measurements

fn secs(d: Duration) -> f64 {
    d.as_secs_f64()
}

fn status_kb(field: &str) -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .unwrap_or_default()
        .lines()
        .find_map(|l| l.strip_prefix(field))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap_or(0)
}

/// Resets VmHWM to the current RSS (Linux >= 4.0), so the peak counts only what follows.
fn reset_peak() {
    let _ = std::fs::write("/proc/self/clear_refs", "5");
}

/// (netlink requests, processes) between two counter snapshots.
fn requests(a: KernelCounters, b: KernelCounters) -> (u64, u64, Value) {
    let d = |x: u64, y: u64| y.saturating_sub(x);
    let v = json!({
        "ipvs_writes": d(a.ipvs_writes, b.ipvs_writes),
        "ipvs_reads": d(a.ipvs_reads, b.ipvs_reads),
        "address_writes": d(a.address_writes, b.address_writes),
        "address_reads": d(a.address_reads, b.address_reads),
        "ipset_processes": d(a.ipset_processes, b.ipset_processes),
        "ipset_requests": d(a.ipset_requests, b.ipset_requests),
        "iptables_processes": d(a.iptables_processes, b.iptables_processes),
    });
    let netlink = d(a.ipvs_writes, b.ipvs_writes)
        + d(a.ipvs_reads, b.ipvs_reads)
        + d(a.address_writes, b.address_writes)
        + d(a.address_reads, b.address_reads)
        + d(a.ipset_requests, b.ipset_requests);
    let procs =
        d(a.ipset_processes, b.ipset_processes) + d(a.iptables_processes, b.iptables_processes);
    (netlink, procs, v)
}

/// Runs the syncs of the drift check a full sync started until it ended, checking each;
/// returns their total duration.
fn finish_check<K: Kernel>(
    p: &mut Proxier,
    store: &Store,
    addrs: &BTreeSet<IpAddr>,
    k: &mut K,
    what: &str,
) -> Res<Duration> {
    let mut total = Duration::ZERO;
    while p.pending(Instant::now()) {
        let r = p.sync(store, addrs, k);
        check(&r, SyncKind::Incremental, what)?;
        if !r.drift.is_empty() {
            return Err(format!("{what}: the drift check found drift: {:?}", r.drift).into());
        }
        total += r.duration;
    }
    Ok(total)
}

fn check(r: &SyncReport, kind: SyncKind, what: &str) -> Res<()> {
    if r.kind != kind {
        return Err(format!("{what}: expected a {kind:?} sync, got {:?}", r.kind).into());
    }
    if !r.ok() {
        return Err(format!("{what}: sync errors: {:?}", r.errors).into());
    }
    Ok(())
}

/// Runs a command (in the calling thread's namespace), optionally feeding stdin; returns
/// (elapsed, stdout).
fn run_cmd(prog: &str, args: &[&str], stdin: Option<&str>) -> Res<(Duration, String)> {
    Ok(testkit::bench::run_cmd(prog, args, stdin)?)
}

struct OneChange {
    name: &'static str,
    wall: Duration,
    netlink: u64,
    procs: u64,
    detail: Value,
}

/// Applies `events` (the change becomes visible to the controller), syncs, and measures until
/// the sync returned (the kernel holds the change).
fn one_change(
    name: &'static str,
    store: &mut Store,
    p: &mut Proxier,
    k: &mut Timed<NodeKernel>,
    events: Vec<SourceEvent>,
    addrs: &BTreeSet<IpAddr>,
) -> Res<OneChange> {
    let before = k.counters();
    let start = Instant::now();
    for ev in events {
        let ch = store.apply(ev);
        p.note(&ch);
    }
    let r = p.sync(store, addrs, k);
    let wall = start.elapsed();
    check(&r, SyncKind::Incremental, name)?;
    let (netlink, procs, detail) = requests(before, k.counters());
    Ok(OneChange {
        name,
        wall,
        netlink,
        procs,
        detail,
    })
}

fn table_text(t: &IpvsTable) -> String {
    let v: Vec<_> = t
        .values()
        .map(|vs| {
            (
                vs.service.clone(),
                vs.real_servers.values().collect::<Vec<_>>(),
            )
        })
        .collect();
    ipvs_netlink::savefmt::render(&v)
}

/// Everything measured in namespace A (ours). Returns the JSON and the `ipvsadm -Sn` text.
fn ours(n: usize, m: usize) -> Res<(Value, String)> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .map_err(io("tokio"))?;
    let rss_base = status_kb("VmRSS:");
    reset_peak();
    let t = Instant::now();
    let mut store = store_with(n, m)?;
    let store_build = t.elapsed();

    let ipvs = ipvs_netlink::Client::new().map_err(io("IPVS"))?;
    let netif = rt.block_on(netif::Netif::new()).map_err(io("kube-ipvs0"))?;
    let ipset = ipset::Ipset::default();
    let tables = iptables::Iptables::detect(Family::Inet, iptables::Runner::new())
        .map_err(io("iptables"))?;
    let mut k = Timed {
        inner: NodeKernel::new(ipvs, netif, ipset, tables, rt.handle().clone()),
        spent: Spent::default(),
    };
    let mut p = Proxier::new(
        ProxyConfig::new(Family::Inet),
        RulesConfig::default(),
        "node-a",
    );
    let addrs: BTreeSet<IpAddr> = BTreeSet::new();

    // P1: full program from an empty kernel.
    let c0 = k.counters();
    let r = p.sync(&store, &addrs, &mut k);
    check(&r, SyncKind::Full, "first sync")?;
    let p1_spent = k.spent;
    let (p1_netlink, p1_procs, p1_detail) = requests(c0, k.counters());
    let p1_iptables = p1_detail["iptables_processes"].as_u64().unwrap_or(0);
    let iptables_tables = p.rules(None).map(|rs| rs.tables.len()).unwrap_or(0);
    let p1_total = r.duration;
    let rss_after_program = status_kb("VmRSS:");

    // The kernel holds exactly the desired table (and this is the reference's input).
    let (save_time, save_text) = run_cmd("ipvsadm", &["-Sn"], None)?;
    let desired_text = table_text(&p.desired().ipvs_table());
    let lines = save_text.lines().count();
    if save_text != desired_text {
        return Err("ipvsadm -Sn after the first sync differs from the desired table".into());
    }
    if lines != n * (m + 1) {
        return Err(format!("expected {} ipvsadm -Sn lines, got {lines}", n * (m + 1)).into());
    }

    // P4: periodic resync with no drift.
    let spent0 = k.spent;
    let c0 = k.counters();
    p.request_full();
    let r = p.sync(&store, &addrs, &mut k);
    check(&r, SyncKind::Full, "resync")?;
    if !r.drift.is_empty() {
        return Err(format!("resync found drift: {:?}", r.drift).into());
    }
    // The full sync listed IPVS; the syncs after it read it a slice at a time: all of them
    // together are the drift check.
    let p4_total = r.duration + finish_check(&mut p, &store, &addrs, &mut k, "resync")?;
    let p4_ipvs = k.spent.ipvs - spent0.ipvs;
    let (p4_netlink, p4_procs, p4_detail) = requests(c0, k.counters());
    let dests_read =
        k.counters().ipvs_requests.get(OpKind::GetDest) - c0.ipvs_requests.get(OpKind::GetDest);
    if p4_detail["ipvs_writes"] != 0 || dests_read != n as u64 {
        return Err(format!(
            "resync without drift did not read each virtual server once ({dests_read} \
             destination reads) / write nothing: {p4_detail}"
        )
        .into());
    }

    // P2: one endpoint change (service n/2: its last backend replaced by a new one).
    let mut changes = Vec::new();
    let s = n / 2;
    let mut backends: Vec<usize> = (s * m..(s + 1) * m).collect();
    let gone = backends.pop().ok_or("REALS must be >= 1")?;
    let fresh = n * m + 1000;
    backends.push(fresh);
    let c = one_change(
        "endpoint",
        &mut store,
        &mut p,
        &mut k,
        vec![SourceEvent::Apply(slice(s, backends))],
        &addrs,
    )?;
    let vs = k
        .inner
        .read_ipvs_keys(&BTreeSet::from([key(s)?]))
        .map_err(io("read"))?;
    let want: IpAddr = backend(fresh).parse().map_err(io("ip"))?;
    let old: IpAddr = backend(gone).parse().map_err(io("ip"))?;
    let held = vs.values().next().ok_or("changed service missing")?;
    if !held.real_servers.contains_key(&(want, 8080)) {
        return Err("the new endpoint is not in the kernel after the sync".into());
    }
    // Graceful termination: the replaced TCP real server drains at weight 0.
    if held
        .real_servers
        .get(&(old, 8080))
        .is_some_and(|d| d.weight != 0)
    {
        return Err("the replaced endpoint still has weight".into());
    }
    changes.push(c);

    // P2: add one service (Service + EndpointSlice arrive before the sync).
    let c = one_change(
        "add-service",
        &mut store,
        &mut p,
        &mut k,
        vec![
            SourceEvent::Apply(service(n)),
            SourceEvent::Apply(slice(n, n * m + 2000..n * m + 2000 + m)),
        ],
        &addrs,
    )?;
    let vs = k
        .inner
        .read_ipvs_keys(&BTreeSet::from([key(n)?]))
        .map_err(io("read"))?;
    if vs.values().next().map(|v| v.real_servers.len()) != Some(m) {
        return Err("the added service is not in the kernel with all its reals".into());
    }
    // Its set member went in (over ipset netlink): `ipset test` fails when it is missing.
    run_cmd(
        "ipset",
        &["test", "KUBE-CLUSTER-IP", &format!("{},tcp:80", vip(n))],
        None,
    )?;
    changes.push(c);

    // P2: delete one service.
    let c = one_change(
        "delete-service",
        &mut store,
        &mut p,
        &mut k,
        vec![SourceEvent::Delete(service(7 % n.max(1)))],
        &addrs,
    )?;
    let vs = k
        .inner
        .read_ipvs_keys(&BTreeSet::from([key(7 % n.max(1))?]))
        .map_err(io("read"))?;
    if !vs.is_empty() {
        return Err("the deleted service is still in the kernel".into());
    }
    let member = format!("{},tcp:80", vip(7 % n.max(1)));
    if run_cmd("ipset", &["test", "KUBE-CLUSTER-IP", &member], None).is_ok() {
        return Err("the deleted service is still in KUBE-CLUSTER-IP".into());
    }
    changes.push(c);

    // iptables: a sync that changes nothing spawns no process.
    let c0 = k.counters();
    p.request_full();
    let r = p.sync(&store, &addrs, &mut k);
    check(&r, SyncKind::Full, "second resync")?;
    finish_check(&mut p, &store, &addrs, &mut k, "second resync")?;
    let (_, _, unchanged) = requests(c0, k.counters());

    let rss_steady = status_kb("VmRSS:");
    let rss_peak = status_kb("VmHWM:");

    // Flush so this table's estimators stop before the reference runs.
    run_cmd("ipvsadm", &["-C"], None)?;

    let v = json!({
        "services": n,
        "reals": m,
        "store_build_s": secs(store_build),
        "p1": {
            "total_s": secs(p1_total),
            "ipvs_s": secs(p1_spent.ipvs),
            "addresses_s": secs(p1_spent.addresses),
            "ipset_s": secs(p1_spent.ipset),
            "iptables_s": secs(p1_spent.iptables),
            "netlink_requests": p1_netlink,
            "processes": p1_procs,
            "requests": p1_detail,
            "iptables_tables": iptables_tables,
            "iptables_processes": p1_iptables,
        },
        "p4": {
            "total_s": secs(p4_total),
            "ipvs_s": secs(p4_ipvs),
            "netlink_requests": p4_netlink,
            "processes": p4_procs,
            "requests": p4_detail,
            "ipvsadm_save_s": secs(save_time),
        },
        "p2": changes.iter().map(|c| (c.name.to_string(), json!({
            "wall_s": secs(c.wall),
            "netlink_requests": c.netlink,
            "processes": c.procs,
            "requests": c.detail,
        }))).collect::<serde_json::Map<_, _>>(),
        "unchanged_resync": unchanged,
        "p3": {
            "rss_base_kb": rss_base,
            "rss_after_program_kb": rss_after_program,
            "rss_steady_kb": rss_steady,
            "rss_peak_kb": rss_peak,
            "bytes_per_service": (rss_steady.saturating_sub(rss_base) * 1024) / (n.max(1) as u64),
        },
        "ipvsadm_sn_lines": lines,
    });
    Ok((v, save_text))
}

fn run(n: usize, m: usize) -> Res<Value> {
    if n == 0 || m == 0 {
        return Err("SERVICES and REALS must be >= 1".into());
    }
    let a = Netns::new("bench-ours").map_err(io("netns"))?;
    let (mut v, text) = a
        .enter(move || ours(n, m).map_err(std::io::Error::other))
        .map_err(io("ours"))?;
    drop(a);
    let r = Netns::new("bench-ref").map_err(io("netns"))?;
    let (restore, check_text) = r
        .enter(move || {
            let (t, _) =
                run_cmd("ipvsadm", &["--restore"], Some(&text)).map_err(std::io::Error::other)?;
            let (_, again) = run_cmd("ipvsadm", &["-Sn"], None).map_err(std::io::Error::other)?;
            let same = again == text;
            run_cmd("ipvsadm", &["-C"], None).map_err(std::io::Error::other)?;
            Ok((t, same))
        })
        .map_err(io("reference"))?;
    if !check_text {
        return Err("ipvsadm --restore produced a different table than ours".into());
    }
    v["ipvsadm_restore_s"] = json!(secs(restore));
    Ok(v)
}

/// P5: `entries` ipset members added by the ipset crate (netlink requests into a set that
/// exists; `ipset restore` before 2026-11-27) vs one `ipset add` process per entry.
fn ipset_bench(entries: u32, sample: u32) -> Res<Value> {
    use ipset::{diff, Entry, SetKind};
    let ns = Netns::new("bench-ipset").map_err(io("netns"))?;
    ns.enter(move || {
        let inner = || -> Res<Value> {
            let set = SetKind::ClusterIp.name(ipset::Family::Inet);
            let entry = |i: u32| {
                Entry::ip_port(
                    IpAddr::V4(std::net::Ipv4Addr::from(0x0a60_0000 + i / 4)),
                    ipset::Protocol::Tcp,
                    80 + (i % 4) as u16,
                )
            };
            let ipset = ipset::Ipset::default();
            let mut empty = IpsetState::new();
            empty.ensure_set(SetKind::ClusterIp.spec(ipset::Family::Inet));
            ipset
                .apply(&diff(&empty, &IpsetState::new()))
                .map_err(io("ipset"))?;
            let mut want = empty.clone();
            for i in 0..entries {
                want.insert(&set, entry(i), "bench").map_err(io("insert"))?;
            }
            let before = ipset.processes_spawned();
            let d = diff(
                &want,
                &ipset.read(std::slice::from_ref(&set)).map_err(io("read"))?,
            );
            let t = Instant::now();
            ipset.apply(&d).map_err(io("apply"))?;
            let ours = t.elapsed();
            let ours_procs = ipset.processes_spawned() - before;
            let got = ipset.read(std::slice::from_ref(&set)).map_err(io("read"))?;
            if !diff(&want, &got).is_empty() {
                return Err("the ipset crate did not produce the desired set".into());
            }
            run_cmd(
                "ipset",
                &["create", "BENCH-PER-ENTRY", "hash:ip,port"],
                None,
            )?;
            let sample = sample.clamp(1, entries.max(1));
            let t = Instant::now();
            for i in 0..sample {
                let e = entry(i).to_string();
                run_cmd("ipset", &["add", "BENCH-PER-ENTRY", &e, "-exist"], None)?;
            }
            let per = t.elapsed().as_secs_f64() / f64::from(sample);
            let (_, listed) = run_cmd("ipset", &["list", "BENCH-PER-ENTRY"], None)?;
            let members = listed
                .lines()
                .skip_while(|l| !l.starts_with("Members:"))
                .skip(1)
                .filter(|l| !l.trim().is_empty())
                .count();
            if members != sample as usize {
                return Err(format!("per-entry set has {members} members, want {sample}").into());
            }
            run_cmd("ipset", &["destroy"], None)?;
            Ok(json!({
                "entries": entries,
                "ours_s": secs(ours),
                "ours_processes": ours_procs,
                "per_entry_sample": sample,
                "per_entry_s_each": per,
                "per_entry_s": per * f64::from(entries),
                "per_entry_extrapolated": sample < entries,
            }))
        };
        inner().map_err(std::io::Error::other)
    })
    .map_err(io("ipset bench"))
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let num = |i: usize, d: usize| -> Option<usize> {
        match args.get(i) {
            Some(s) => s.parse().ok(),
            None => Some(d),
        }
    };
    let result = match args.first().map(String::as_str) {
        Some("run") => match (num(1, 10_000), num(2, 10)) {
            (Some(n), Some(m)) => run(n, m),
            _ => Err("SERVICES and REALS must be numbers".into()),
        },
        Some("ipset") => match (num(1, 10_000), num(2, 1_000)) {
            (Some(e), Some(s)) => match (u32::try_from(e), u32::try_from(s)) {
                (Ok(e), Ok(s)) => ipset_bench(e, s),
                _ => Err("too large".into()),
            },
            _ => Err("ENTRIES and SAMPLE must be numbers".into()),
        },
        _ => Err("usage: controller-bench run SERVICES REALS | ipset ENTRIES SAMPLE".into()),
    };
    match result {
        Ok(v) => {
            print_human(&v);
            println!("BENCH-JSON {v}");
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("controller-bench: {e}");
            ExitCode::FAILURE
        }
    }
}

fn print_human(v: &Value) {
    let f = |x: &Value| x.as_f64().unwrap_or(f64::NAN);
    if v.get("p1").is_some() {
        println!(
            "table: {} services x {} reals ({} ipvsadm -Sn lines)",
            v["services"], v["reals"], v["ipvsadm_sn_lines"]
        );
        println!(
            "P1 full program: total {:.3} s (ipvs {:.3} s, addresses {:.3} s, ipset {:.3} s, iptables {:.3} s); ipvsadm --restore {:.3} s",
            f(&v["p1"]["total_s"]),
            f(&v["p1"]["ipvs_s"]),
            f(&v["p1"]["addresses_s"]),
            f(&v["p1"]["ipset_s"]),
            f(&v["p1"]["iptables_s"]),
            f(&v["ipvsadm_restore_s"])
        );
        if let Some(p2) = v["p2"].as_object() {
            for (name, c) in p2 {
                println!(
                    "P2 {name}: {:.4} s, {} netlink requests, {} processes",
                    f(&c["wall_s"]),
                    c["netlink_requests"],
                    c["processes"]
                );
            }
        }
        println!(
            "P3 rss: base {} kB, after program {} kB, steady {} kB, peak {} kB, {} bytes/service",
            v["p3"]["rss_base_kb"],
            v["p3"]["rss_after_program_kb"],
            v["p3"]["rss_steady_kb"],
            v["p3"]["rss_peak_kb"],
            v["p3"]["bytes_per_service"]
        );
        println!(
            "P4 resync without drift: total {:.3} s (ipvs dump {:.3} s); ipvsadm -Sn {:.3} s",
            f(&v["p4"]["total_s"]),
            f(&v["p4"]["ipvs_s"]),
            f(&v["p4"]["ipvsadm_save_s"])
        );
        println!(
            "iptables processes: first sync {} ({} tables), unchanged resync {}",
            v["p1"]["iptables_processes"],
            v["p1"]["iptables_tables"],
            v["unchanged_resync"]["iptables_processes"]
        );
    } else {
        println!(
            "P5 ipset {} entries: ours {:.3} s ({} processes), per-entry {:.3} s ({} timed{})",
            v["entries"],
            f(&v["ours_s"]),
            v["ours_processes"],
            f(&v["per_entry_s"]),
            v["per_entry_sample"],
            if v["per_entry_extrapolated"] == true {
                ", extrapolated"
            } else {
                ""
            }
        );
    }
}
