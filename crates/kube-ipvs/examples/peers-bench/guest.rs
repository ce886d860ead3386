//! The guest half: each proxy in turn on an empty node, fed by the real apiserver.
//!
//! Per proxy:
//! 1. The node is wiped ([`kernel::wipe`]) and the proxy started with the same
//!    KubeProxyConfiguration file as every other (kubeadm-like: kubeconfig, hostname, cluster
//!    CIDR, `conntrack.maxPerCore: 0`, the mode; the same sync periods in every mode's
//!    section: 30 s full resync, at most one sync per second, kube-proxy's iptables default).
//! 2. Converged: the kernel counts of [`kernel::Counter`] polled from process start until all
//!    reach their targets (the time is the end of the first complete round, so it includes
//!    that round's own duration, `check_s`), or the cap passes (`converged: false`, with the
//!    counts reached). `cpu_s` is the proxy's user + system time then, its waited-for children
//!    (ipset, iptables-restore, nft processes) included.
//!    Then settled: the proxy's first IPv4 sync has ended by its own `/metrics` (sync count
//!    at least one; `settled_s` from process start, within the same cap), so that no proxy's
//!    changes are timed against the rest of its first sync.
//! 3. One change at a time, `changes` times: one EndpointSlice's first endpoint replaced by a
//!    merge patch from here (an API write through the forwarded port), timed from just before
//!    the write until [`kernel::Watcher::visible`] sees the kernel hold it (checked every
//!    millisecond by the observer thread); 1.5 s apart at least. Then `rss_steady_mib`.
//! 4. Churn: `churn-rate` such writes per second for `churn-secs` s (each on another
//!    Service), each timed the same way; `churn_cpu_s` is the proxy's CPU time from the first
//!    write until the last write is seen (at most 120 s after the last write).
//! 5. `rss_peak_mib` (VmHWM), the proxy's sync metrics, SIGTERM; the touched slices are put
//!    back (untimed) so the next proxy starts from the same objects.

use std::collections::BTreeMap;
use std::net::Ipv4Addr;
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use k8s_openapi::api::discovery::v1::EndpointSlice;
use kube::api::{Api, Patch, PatchParams};
use serde_json::{json, Value};
use testkit::bench::{proc_cpu_seconds, proc_status_kb};

use crate::kernel::{self, Counter, Mode, Watcher};
use crate::objects::{self, NAMESPACE};
use crate::{api, io, BenchError, Res};

/// The proxies, by the names `cargo xtask conformance --proxy` uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Proxy {
    /// kube-ipvs, IPVS mode.
    KubeIpvs,
    /// kube-ipvs, iptables mode.
    KubeIpvsIptables,
    /// Upstream kube-proxy, IPVS mode.
    UpstreamIpvs,
    /// Upstream kube-proxy, nftables mode.
    UpstreamNftables,
    /// Upstream kube-proxy, iptables mode.
    UpstreamIptables,
}

impl Proxy {
    /// Every proxy, in the default order.
    pub const ALL: [Proxy; 5] = [
        Proxy::KubeIpvs,
        Proxy::KubeIpvsIptables,
        Proxy::UpstreamIpvs,
        Proxy::UpstreamNftables,
        Proxy::UpstreamIptables,
    ];

    /// Its name.
    pub fn name(self) -> &'static str {
        match self {
            Proxy::KubeIpvs => "kube-ipvs",
            Proxy::KubeIpvsIptables => "kube-ipvs-iptables",
            Proxy::UpstreamIpvs => "upstream-ipvs",
            Proxy::UpstreamNftables => "upstream-nftables",
            Proxy::UpstreamIptables => "upstream-iptables",
        }
    }

    /// Parses a name.
    pub fn parse(s: &str) -> Res<Proxy> {
        Proxy::ALL
            .into_iter()
            .find(|p| p.name() == s)
            .ok_or_else(|| BenchError::Usage(format!("unknown proxy {s}")))
    }

    fn mode(self) -> Mode {
        match self {
            Proxy::KubeIpvs | Proxy::UpstreamIpvs => Mode::Ipvs,
            Proxy::UpstreamNftables => Mode::Nftables,
            Proxy::KubeIpvsIptables | Proxy::UpstreamIptables => Mode::Iptables,
        }
    }

    fn config_mode(self) -> &'static str {
        match self.mode() {
            Mode::Ipvs => "ipvs",
            Mode::Nftables => "nftables",
            Mode::Iptables => "iptables",
        }
    }

    fn upstream(self) -> bool {
        matches!(
            self,
            Proxy::UpstreamIpvs | Proxy::UpstreamNftables | Proxy::UpstreamIptables
        )
    }
}

/// The guest's options.
#[derive(Debug, Clone)]
pub struct Options {
    /// Kubeconfig for the proxies and the writes.
    pub kubeconfig: String,
    /// N.
    pub n: usize,
    /// M.
    pub m: usize,
    /// Proxies, in order.
    pub proxies: Vec<Proxy>,
    /// Longest wait for convergence.
    pub cap: Duration,
    /// One-at-a-time changes.
    pub changes: usize,
    /// Churn writes per second.
    pub churn_rate: usize,
    /// Churn duration.
    pub churn_secs: usize,
    /// Upstream kube-proxy.
    pub kube_proxy: String,
    /// kube-ipvs.
    pub kube_ipvs: String,
    /// `minSyncPeriod` of every mode.
    pub min_sync: Duration,
}

impl Options {
    /// Defaults for `n` x `m` (no proxies yet).
    pub fn new(kubeconfig: &str, n: usize, m: usize) -> Options {
        Options {
            kubeconfig: kubeconfig.to_string(),
            n,
            m,
            proxies: Vec::new(),
            cap: Duration::from_secs(1200),
            changes: 30,
            churn_rate: 20,
            churn_secs: 60,
            kube_proxy: "/k/kube-proxy".into(),
            kube_ipvs: "/k/kube-ipvs".into(),
            min_sync: Duration::from_secs(1),
        }
    }
}

fn mib(kb: u64) -> f64 {
    kb as f64 / 1024.0
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

/// Nearest-rank percentile (`p` in 0..=100) of `v`; NaN when empty.
pub fn percentile(v: &[f64], p: f64) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    let rank = ((p / 100.0) * s.len() as f64).ceil().max(1.0) as usize;
    s[rank.min(s.len()) - 1]
}

/// The KubeProxyConfiguration every proxy gets (only `mode` differs): kubeadm's (kubeconfig,
/// cluster CIDR; the node name it passes as a flag) with `conntrack.maxPerCore: 0` (the VM
/// has no conntrack table to size) and the same sync periods written into every mode's
/// section: 30 s between full resyncs, at most one sync per `min_sync` (kube-proxy's iptables
/// default, 1 s).
fn config(o: &Options, p: Proxy) -> String {
    let periods = format!(
        "  syncPeriod: 30s\n  minSyncPeriod: {}ms\n",
        o.min_sync.as_millis()
    );
    format!(
        "apiVersion: kubeproxy.config.k8s.io/v1alpha1\nkind: KubeProxyConfiguration\n\
         clientConnection:\n  kubeconfig: {kc}\nhostnameOverride: {node}\nclusterCIDR: {cidr}\n\
         mode: {mode}\nconntrack:\n  maxPerCore: 0\niptables:\n{periods}ipvs:\n{periods}\
         nftables:\n{periods}",
        kc = o.kubeconfig,
        node = objects::NODE,
        cidr = objects::CLUSTER_CIDR,
        mode = p.config_mode(),
    )
}

/// The proxy under test, killed on drop.
struct Running {
    child: Child,
    log: String,
}

impl Running {
    fn pid(&self) -> u32 {
        self.child.id()
    }

    fn exited(&mut self) -> Option<String> {
        match self.child.try_wait() {
            Ok(Some(st)) => Some(st.to_string()),
            _ => None,
        }
    }

    fn log_tail(&self, lines: usize) -> String {
        let text = std::fs::read_to_string(&self.log).unwrap_or_default();
        let all: Vec<&str> = text.lines().collect();
        all[all.len().saturating_sub(lines)..].join("\n")
    }

    fn log_head(&self, lines: usize) -> String {
        let text = std::fs::read_to_string(&self.log).unwrap_or_default();
        text.lines().take(lines).collect::<Vec<_>>().join("\n")
    }

    /// SIGTERM, then SIGKILL after 20 s.
    fn stop(&mut self) {
        let pid = nix::unistd::Pid::from_raw(self.child.id() as i32);
        let _ = nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM);
        let t = Instant::now();
        while t.elapsed() < Duration::from_secs(20) {
            if let Ok(Some(_)) = self.child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn start(o: &Options, p: Proxy) -> Res<Running> {
    let cfg = format!("/tmp/peers-{}.yaml", p.name());
    std::fs::write(&cfg, config(o, p)).map_err(io("writing the proxy config"))?;
    let log = format!("/tmp/peers-{}.log", p.name());
    let f = std::fs::File::create(&log).map_err(io("creating the proxy log"))?;
    let f2 = f.try_clone().map_err(io("dup log"))?;
    let prog = if p.upstream() {
        &o.kube_proxy
    } else {
        &o.kube_ipvs
    };
    let mut cmd = Command::new(prog);
    cmd.args(["--config", &cfg]);
    // kube-ipvs runs as shipped: its `--iptables-timeout` (30 s) bounds each window in which a
    // restore does not compute, and a restore that keeps computing runs on (up to 20 min), so
    // the emulated VM's slow first restore is not killed.
    let child = cmd
        .env_remove("RUST_LOG")
        .env_remove("KUBECONFIG")
        .stdin(Stdio::null())
        .stdout(f)
        .stderr(f2)
        .spawn()
        .map_err(io(format!("starting {prog}")))?;
    Ok(Running { child, log })
}

/// The proxy's CPU seconds (user + system, waited-for children included).
fn cpu(pid: u32) -> f64 {
    proc_cpu_seconds(pid).unwrap_or(f64::NAN)
}

// ---------------------------------------------------------------------------------------------
// Changes and their observer

/// One endpoint change in flight.
struct Change {
    id: usize,
    service: usize,
    old: Ipv4Addr,
    new: Ipv4Addr,
    t0: Instant,
}

enum ToObserver {
    Watch(Change),
    /// Report what is still unseen at this instant, then end.
    Finish(Instant),
}

#[derive(Debug, Clone, Copy)]
enum Seen {
    After(Duration),
    /// Another change of the same Service was written before this one was seen.
    Superseded,
    Never,
}

/// The observer thread: checks every pending change (all of them, then a pause as long as
/// the round, at least 1 ms) and reports each when the kernel holds it.
fn observer(
    mut w: Watcher,
    rx: mpsc::Receiver<ToObserver>,
    tx: mpsc::Sender<(usize, Seen)>,
) -> std::thread::JoinHandle<(u64, Option<String>)> {
    std::thread::spawn(move || {
        let mut pending: Vec<Change> = Vec::new();
        let mut finish: Option<Instant> = None;
        loop {
            let next = if pending.is_empty() && finish.is_none() {
                rx.recv_timeout(Duration::from_millis(100)).ok()
            } else {
                rx.try_recv().ok()
            };
            if let Some(msg) = next {
                match msg {
                    ToObserver::Watch(c) => {
                        if let Some(at) = pending.iter().position(|p| p.service == c.service) {
                            let old = pending.remove(at);
                            let _ = tx.send((old.id, Seen::Superseded));
                        }
                        pending.push(c);
                    }
                    ToObserver::Finish(at) => finish = Some(at),
                }
                continue;
            }
            let round = Instant::now();
            let mut k = 0;
            while k < pending.len() {
                let c = &pending[k];
                match w.visible(c.service, c.old, c.new) {
                    Ok(true) => {
                        let c = pending.remove(k);
                        let _ = tx.send((c.id, Seen::After(c.t0.elapsed())));
                    }
                    Ok(false) => k += 1,
                    Err(e) => return (w.checks, Some(e.to_string())),
                }
            }
            if let Some(at) = finish {
                if pending.is_empty() || Instant::now() >= at {
                    for c in pending.drain(..) {
                        let _ = tx.send((c.id, Seen::Never));
                    }
                    return (w.checks, None);
                }
            }
            if !pending.is_empty() {
                kernel::pause(round.elapsed(), Duration::from_millis(1));
            }
        }
    })
}

/// Which endpoint of which Service each change replaces, and the current addresses.
struct Plan {
    n: usize,
    m: usize,
    next: usize,
    current: BTreeMap<usize, Vec<Ipv4Addr>>,
}

impl Plan {
    fn new(n: usize, m: usize) -> Plan {
        Plan {
            n,
            m,
            next: 0,
            current: BTreeMap::new(),
        }
    }

    /// Change number `next` on Service `i`: its first endpoint gets a fresh address.
    fn change(&mut self, i: usize) -> (usize, Ipv4Addr, Ipv4Addr, Vec<Ipv4Addr>) {
        let addrs = self
            .current
            .entry(i)
            .or_insert_with(|| objects::addresses(i, self.m));
        let old = addrs[0];
        let new = objects::replacement(self.next);
        addrs[0] = new;
        let id = self.next;
        self.next += 1;
        (id, old, new, addrs.clone())
    }

    /// The Service of one-at-a-time change `k` (spread over the table).
    fn single(&self, k: usize) -> usize {
        (k * 7919 + self.n / 2) % self.n
    }

    /// The Service of churn write `j` (another stride, so consecutive writes hit other
    /// Services; with N below the number of writes, Services repeat).
    fn churn(&self, j: usize) -> usize {
        (self.n / 3 + j * 104_729) % self.n
    }
}

async fn patch(slices: &Api<EndpointSlice>, i: usize, addrs: &[Ipv4Addr]) -> Res<()> {
    slices
        .patch(
            &objects::slice_name(i),
            &PatchParams::default(),
            &Patch::Merge(objects::endpoints_patch(i, addrs)),
        )
        .await
        .map(|_| ())
        .map_err(api("patching a slice"))
}

/// One change at a time: write, wait until seen (at most `limit`), keep 1.5 s between writes.
fn single_changes(
    rt: &tokio::runtime::Runtime,
    slices: &Api<EndpointSlice>,
    plan: &mut Plan,
    k: usize,
    tx: &mpsc::Sender<ToObserver>,
    rx: &mpsc::Receiver<(usize, Seen)>,
    limit: Duration,
) -> Res<(Vec<f64>, usize)> {
    let mut lat = Vec::new();
    let mut missed = 0;
    for c in 0..k {
        let i = plan.single(c);
        let (id, old, new, addrs) = plan.change(i);
        let t0 = Instant::now();
        let _ = tx.send(ToObserver::Watch(Change {
            id,
            service: i,
            old,
            new,
            t0,
        }));
        rt.block_on(patch(slices, i, &addrs))?;
        let seen = loop {
            match rx.recv_timeout(limit) {
                Ok((got, s)) if got == id => break Some(s),
                Ok(_) => continue,
                Err(_) => break None,
            }
        };
        match seen {
            Some(Seen::After(d)) => lat.push(ms(d)),
            _ => {
                missed += 1;
                eprintln!("peers-bench: change {c} (service {i}) not seen within {limit:?}");
                break;
            }
        }
        let spent = t0.elapsed();
        if spent < Duration::from_millis(1500) {
            std::thread::sleep(Duration::from_millis(1500) - spent);
        }
    }
    Ok((lat, missed))
}

/// Churn: `rate` writes per second for `secs` s, each timed to the kernel.
fn churn(
    rt: &tokio::runtime::Runtime,
    slices: &Api<EndpointSlice>,
    plan: &mut Plan,
    rate: usize,
    secs: usize,
    tx: &mpsc::Sender<ToObserver>,
) -> Res<(usize, usize, Duration)> {
    let writes = rate * secs;
    let period = Duration::from_secs_f64(1.0 / rate.max(1) as f64);
    let mut jobs = Vec::with_capacity(writes);
    for j in 0..writes {
        let i = plan.churn(j);
        let (id, old, new, addrs) = plan.change(i);
        jobs.push((j, id, i, old, new, addrs));
    }
    let start = Instant::now();
    let errors = rt.block_on(async {
        let sem = std::sync::Arc::new(tokio::sync::Semaphore::new(64));
        let mut tasks = tokio::task::JoinSet::new();
        for (j, id, i, old, new, addrs) in jobs {
            tokio::time::sleep_until(tokio::time::Instant::from_std(start + period * j as u32))
                .await;
            let permit = sem.clone().acquire_owned().await;
            let _ = tx.send(ToObserver::Watch(Change {
                id,
                service: i,
                old,
                new,
                t0: Instant::now(),
            }));
            let slices = slices.clone();
            tasks.spawn(async move {
                let r = patch(&slices, i, &addrs).await;
                drop(permit);
                r.is_err()
            });
        }
        let mut errors = 0;
        while let Some(r) = tasks.join_next().await {
            if r.unwrap_or(true) {
                errors += 1;
            }
        }
        errors
    });
    Ok((writes, errors, start.elapsed()))
}

/// Puts every touched slice back to its generated endpoints (no proxy runs).
fn revert(rt: &tokio::runtime::Runtime, slices: &Api<EndpointSlice>, plan: &Plan) -> Res<()> {
    use futures::{StreamExt, TryStreamExt};
    let m = plan.m;
    rt.block_on(
        futures::stream::iter(plan.current.keys().copied())
            .map(|i| async move { patch(slices, i, &objects::addresses(i, m)).await })
            .buffer_unordered(32)
            .try_for_each(|()| async { Ok(()) }),
    )
}

/// The sync-duration histogram both proxies export.
const SYNC_HISTOGRAM: &str = "kubeproxy_sync_proxy_rules_duration_seconds";

/// The proxy's /metrics text (empty when it does not answer within 10 s).
fn metrics_text() -> String {
    kernel::sh_out("timeout 10 wget -q -O - http://127.0.0.1:10249/metrics")
}

/// The sum of the samples of metric `name` in `metrics` (every label set, or only those whose
/// labels contain `label`).
fn metric_sum(metrics: &str, name: &str, label: Option<&str>) -> f64 {
    metrics
        .lines()
        .filter_map(|l| {
            let rest = l.strip_prefix(name)?;
            let labels = match rest.strip_prefix('{') {
                Some(r) => r.split('}').next()?,
                None if rest.starts_with(' ') => "",
                None => return None,
            };
            if !label.is_none_or(|want| labels.contains(want)) {
                return None;
            }
            l.rsplit(' ').next()?.parse::<f64>().ok()
        })
        // Not `sum()`: an f64 sum of nothing is -0.0, which the row would show.
        .fold(0.0, |a, b| a + b)
}

/// The proxy's sync counter and total sync seconds from its /metrics, every family.
fn sync_metrics() -> Value {
    let body = metrics_text();
    json!({
        "syncs": metric_sum(&body, &format!("{SYNC_HISTOGRAM}_count"), None),
        "sync_seconds": metric_sum(&body, &format!("{SYNC_HISTOGRAM}_sum"), None),
    })
}

/// The number of IPv4 syncs ended in `metrics`: the bench's Services are IPv4, and both
/// kube-ipvs and upstream (its dual-stack metaproxier) run and count an IPv6 family too
/// (`ip_family` label), whose first sync of nothing may end before the IPv4 one.
fn ipv4_sync_count(metrics: &str) -> f64 {
    metric_sum(
        metrics,
        &format!("{SYNC_HISTOGRAM}_count"),
        Some("ip_family=\"IPv4\""),
    )
}

/// Waits until the proxy reports its first IPv4 sync ended (polled once a second) or `cap` has
/// passed since `t0` or the proxy exited; the time from `t0`, or `None`.
fn settle(proxy: &mut Running, t0: Instant, cap: Duration) -> Option<Duration> {
    loop {
        if ipv4_sync_count(&metrics_text()) >= 1.0 {
            return Some(t0.elapsed());
        }
        if t0.elapsed() > cap || proxy.exited().is_some() {
            return None;
        }
        std::thread::sleep(Duration::from_secs(1));
    }
}

fn run_proxy(
    o: &Options,
    p: Proxy,
    rt: &tokio::runtime::Runtime,
    slices: &Api<EndpointSlice>,
) -> Res<Value> {
    let (n, m) = (o.n, o.m);
    kernel::wipe();
    let mut counter = Counter::new(p.mode(), n, m)?;
    let empty = counter.check()?;
    if empty.parts.iter().any(|(_, got, _)| *got > 0) {
        return Err(BenchError::Check(format!(
            "the node is not empty before {}: {}",
            p.name(),
            empty.json()
        )));
    }
    let mut row = json!({"proxy": p.name(), "services": n, "endpoints": m});
    eprintln!("peers-bench: {} at {n} x {m}: starting", p.name());
    let t0 = Instant::now();
    let mut proxy = start(o, p)?;
    let pid = proxy.pid();
    let mut progress = empty;
    let mut rounds = 0u64;
    let mut last_report = Instant::now();
    let (converged, check_s) = loop {
        if let Some(st) = proxy.exited() {
            row["exited"] = json!(st);
            break (None, 0.0);
        }
        if t0.elapsed() > o.cap {
            break (None, 0.0);
        }
        let round = Instant::now();
        progress = counter.check()?;
        rounds += 1;
        if progress.complete(counter.stages()) {
            break (Some(t0.elapsed()), round.elapsed().as_secs_f64());
        }
        if last_report.elapsed() > Duration::from_secs(60) {
            eprintln!(
                "peers-bench: {} after {:.0} s: {}; its log: {}",
                p.name(),
                t0.elapsed().as_secs_f64(),
                progress.json(),
                proxy.log_tail(1)
            );
            last_report = Instant::now();
        }
        kernel::pause(round.elapsed(), Duration::from_millis(100));
    };
    row["progress"] = progress.json();
    row["check_rounds"] = json!(rounds);
    let Some(converge) = converged else {
        row["converged"] = json!(false);
        row["cap_s"] = json!(o.cap.as_secs());
        row["cpu_s"] = json!(cpu(pid));
        row["rss_peak_mib"] = json!(mib(proc_status_kb(pid, "VmHWM")));
        row["log_tail"] = json!(proxy.log_tail(20));
        eprintln!(
            "peers-bench: {} did not converge within {} s: {}",
            p.name(),
            o.cap.as_secs(),
            progress.json()
        );
        proxy.stop();
        return Ok(row);
    };
    row["converged"] = json!(true);
    row["converge_s"] = json!(converge.as_secs_f64());
    row["check_s"] = json!(check_s);
    row["cpu_s"] = json!(cpu(pid));
    row["rss_converged_mib"] = json!(mib(proc_status_kb(pid, "VmRSS")));
    eprintln!(
        "peers-bench: {} converged after {:.2} s (last count round {:.2} s), {:.2} CPU s",
        p.name(),
        converge.as_secs_f64(),
        check_s,
        row["cpu_s"].as_f64().unwrap_or(f64::NAN)
    );
    // Settled: the proxy's first IPv4 sync has ended (its `/metrics` count at least one).
    // Upstream's IPVS mode completes the counted state long before its first sync ends (it
    // still adds hairpin ipset members, one `ipset` process each); every proxy's changes are
    // timed from a finished first sync on, so none is timed against its own start.
    let settled = settle(&mut proxy, t0, o.cap);
    row["settled"] = json!(settled.is_some());
    row["settled_s"] = json!(settled.map(|d| d.as_secs_f64()));
    eprintln!(
        "peers-bench: {}: first sync ended {}",
        p.name(),
        settled.map_or_else(
            || format!(
                "not within the {} s cap; changes timed anyway",
                o.cap.as_secs()
            ),
            |d| format!("after {:.2} s", d.as_secs_f64())
        )
    );
    std::thread::sleep(Duration::from_secs(2));

    // The observer.
    let watcher = Watcher::new(p.mode(), std::mem::take(&mut counter.nft_chains))?;
    let (to_obs, obs_rx) = mpsc::channel();
    let (seen_tx, seen) = mpsc::channel();
    let obs = observer(watcher, obs_rx, seen_tx);
    let mut plan = Plan::new(n, m);

    let limit = Duration::from_secs(120);
    let (lat, missed) = single_changes(rt, slices, &mut plan, o.changes, &to_obs, &seen, limit)?;
    row["changes"] = json!(lat.len());
    row["changes_missed"] = json!(missed);
    row["change_p50_ms"] = json!(percentile(&lat, 50.0));
    row["change_p99_ms"] = json!(percentile(&lat, 99.0));
    row["change_max_ms"] = json!(lat.iter().copied().fold(0.0, f64::max));
    row["change_ms"] = json!(lat);
    std::thread::sleep(Duration::from_secs(2));
    row["rss_steady_mib"] = json!(mib(proc_status_kb(pid, "VmRSS")));
    row["rss_steady_anon_mib"] = json!(mib(proc_status_kb(pid, "RssAnon")));
    eprintln!(
        "peers-bench: {}: one change p50 {:.1} ms p99 {:.1} ms ({} seen); RSS {:.1} MiB",
        p.name(),
        percentile(&lat, 50.0),
        percentile(&lat, 99.0),
        lat.len(),
        row["rss_steady_mib"].as_f64().unwrap_or(f64::NAN)
    );

    // Churn.
    if o.churn_secs > 0 && o.churn_rate > 0 && missed == 0 {
        let first = plan.next;
        let cpu0 = cpu(pid);
        let c0 = Instant::now();
        let (writes, errors, wrote) =
            churn(rt, slices, &mut plan, o.churn_rate, o.churn_secs, &to_obs)?;
        let _ = to_obs.send(ToObserver::Finish(Instant::now() + limit));
        let mut lat = Vec::new();
        let (mut superseded, mut never) = (0, 0);
        while let Ok((id, s)) = seen.recv_timeout(limit + Duration::from_secs(30)) {
            if id < first {
                continue;
            }
            match s {
                Seen::After(d) => lat.push(ms(d)),
                Seen::Superseded => superseded += 1,
                Seen::Never => never += 1,
            }
            if lat.len() + superseded + never >= writes {
                break;
            }
        }
        let window = c0.elapsed();
        row["churn_cpu_s"] = json!(cpu(pid) - cpu0);
        row["churn_window_s"] = json!(window.as_secs_f64());
        row["churn_write_s"] = json!(wrote.as_secs_f64());
        row["churn_writes"] = json!(writes);
        row["churn_write_errors"] = json!(errors);
        row["churn_seen"] = json!(lat.len());
        row["churn_superseded"] = json!(superseded);
        row["churn_unseen"] = json!(never);
        row["churn_p50_ms"] = json!(percentile(&lat, 50.0));
        row["churn_p99_ms"] = json!(percentile(&lat, 99.0));
        row["churn_max_ms"] = json!(lat.iter().copied().fold(0.0, f64::max));
        eprintln!(
            "peers-bench: {}: churn {writes} writes in {:.1} s: p50 {:.1} ms p99 {:.1} ms, {} seen, {superseded} superseded, {never} unseen, {:.2} CPU s",
            p.name(),
            wrote.as_secs_f64(),
            percentile(&lat, 50.0),
            percentile(&lat, 99.0),
            lat.len(),
            row["churn_cpu_s"].as_f64().unwrap_or(f64::NAN)
        );
    } else {
        let _ = to_obs.send(ToObserver::Finish(Instant::now()));
    }
    let (checks, obs_err) = obs.join().unwrap_or((0, Some("observer panicked".into())));
    row["observer_checks"] = json!(checks);
    if let Some(e) = obs_err {
        row["observer_error"] = json!(e);
    }
    row["rss_peak_mib"] = json!(mib(proc_status_kb(pid, "VmHWM")));
    row["cpu_total_s"] = json!(cpu(pid));
    row["metrics"] = sync_metrics();
    if let Some(st) = proxy.exited() {
        row["exited"] = json!(st);
    }
    // What the proxy said last (kube-ipvs logs each sync's phases): the why of the figures.
    row["log_tail"] = json!(proxy.log_tail(40));
    // And first (the start: what the converge time went on).
    row["log_head"] = json!(proxy.log_head(40));
    proxy.stop();
    revert(rt, slices, &plan)?;
    Ok(row)
}

/// Runs every proxy; prints one `BENCH-JSON` line each.
pub fn run(o: &Options) -> Res<()> {
    let env = json!({
        "kind": "env",
        "kernel": kernel::sh_out("uname -r").trim(),
        "iptables": kernel::sh_out("iptables --version").trim(),
        "nft": kernel::sh_out("nft --version").trim(),
        "kube_proxy": kernel::sh_out(&format!("{} --version", o.kube_proxy)).trim(),
        "cpus": std::thread::available_parallelism().map(|n| n.get()).unwrap_or(0),
        "mem_total_kb": proc_status_kb_meminfo("MemTotal"),
    });
    println!("BENCH-JSON {env}");
    if !env["iptables"]
        .as_str()
        .is_some_and(|v| v.contains("nf_tables"))
    {
        return Err(BenchError::Check(format!(
            "`iptables` is not iptables-nft in the guest: {}",
            env["iptables"]
        )));
    }
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(io("tokio runtime"))?;
    let client = rt.block_on(crate::client(&o.kubeconfig))?;
    let slices = Api::<EndpointSlice>::namespaced(client, NAMESPACE);
    for &p in &o.proxies {
        let row = run_proxy(o, p, &rt, &slices)?;
        println!("BENCH-JSON {row}");
    }
    kernel::wipe();
    Ok(())
}

fn proc_status_kb_meminfo(field: &str) -> u64 {
    std::fs::read_to_string("/proc/meminfo")
        .unwrap_or_default()
        .lines()
        .find_map(|l| l.strip_prefix(field))
        .and_then(|v| v.trim_start_matches(':').split_whitespace().next())
        .and_then(|v| v.parse().ok())
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_ipv4_sync_count_leaves_the_other_family_and_metrics_out() {
        let body = "# TYPE kubeproxy_sync_proxy_rules_duration_seconds histogram\n\
            kubeproxy_sync_proxy_rules_duration_seconds_bucket{ip_family=\"IPv4\",le=\"+Inf\"} 3\n\
            kubeproxy_sync_proxy_rules_duration_seconds_sum{ip_family=\"IPv4\"} 2.5\n\
            kubeproxy_sync_proxy_rules_duration_seconds_count{ip_family=\"IPv4\"} 3\n\
            kubeproxy_sync_proxy_rules_duration_seconds_count{ip_family=\"IPv6\"} 7\n\
            kubeproxy_sync_proxy_rules_last_timestamp_seconds{ip_family=\"IPv4\"} 1.7e9\n";
        assert_eq!(ipv4_sync_count(body), 3.0);
        // Every family, as the row's totals count them; a longer name is another metric.
        let count = format!("{SYNC_HISTOGRAM}_count");
        assert_eq!(metric_sum(body, &count, None), 10.0);
        assert_eq!(
            metric_sum(body, &format!("{SYNC_HISTOGRAM}_sum"), None),
            2.5
        );
        assert_eq!(
            metric_sum(
                "kubeproxy_sync_proxy_rules_duration_seconds_count 4\n",
                &count,
                None
            ),
            4.0
        );
        assert_eq!(metric_sum(body, "kubeproxy_sync_proxy_rules", None), 0.0);
        let v6_only = "kubeproxy_sync_proxy_rules_duration_seconds_count{ip_family=\"IPv6\"} 1\n";
        assert_eq!(ipv4_sync_count(v6_only), 0.0);
        let none = ipv4_sync_count("");
        assert!(none == 0.0 && none.is_sign_positive(), "{none}");
    }

    #[test]
    fn percentiles_and_plans() {
        let v: Vec<f64> = (1..=30).map(f64::from).collect();
        assert_eq!(percentile(&v, 50.0), 15.0);
        assert_eq!(percentile(&v, 99.0), 30.0);
        assert!(percentile(&[], 50.0).is_nan());
        let mut plan = Plan::new(1000, 10);
        let singles: std::collections::BTreeSet<usize> = (0..30).map(|k| plan.single(k)).collect();
        assert_eq!(singles.len(), 30);
        let churn: std::collections::BTreeSet<usize> = (0..1000).map(|j| plan.churn(j)).collect();
        assert_eq!(churn.len(), 1000);
        let (id, old, new, addrs) = plan.change(7);
        assert_eq!(
            (id, old, new),
            (0, objects::endpoint(7, 10, 0), objects::replacement(0))
        );
        assert_eq!(addrs.len(), 10);
        let (_, old2, _, _) = plan.change(7);
        assert_eq!(old2, new);
        assert_eq!(
            Proxy::parse("upstream-nftables").unwrap().mode(),
            Mode::Nftables
        );
        assert!(Proxy::parse("kube-proxy").is_err());
        let cfg = config(&Options::new("/k/kc", 1, 1), Proxy::UpstreamIpvs);
        assert!(
            cfg.contains("mode: ipvs\n") && cfg.contains("kubeconfig: /k/kc\n"),
            "{cfg}"
        );
    }
}
