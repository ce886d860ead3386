//! The soak (issue #32): the release daemon in the VM against the fake API server for N minutes,
//! with steady Service and endpoint churn and randomly timed faults, while clients connect
//! continuously to Services whose endpoints stay ready. Run by `cargo xtask soak` (see
//! docs/testing.md), which builds the release binary, boots the VM and renders the report; this
//! test is its driver inside the VM (`#[ignore = "soak"]`: no test stage selects it).
//!
//! Environment: `KUBE_IPVS_SOAK_MINUTES` (required), `KUBE_IPVS_SOAK_SEED` (default: from the
//! clock; printed, so a run replays), `KUBE_IPVS_SOAK_BIN` (the daemon; default this build's).
//!
//! - The node: `node` (namespaces, pods, the daemon, tool wrappers, `plan --diff`).
//! - The objects: `objects` (stable, churned, hostile).
//! - The faults: `faults` (a seeded shuffle of every kind, each once before repeats).
//! - Watching: `observe` (clients, held connections, health prober, RSS).
//! - The verdict: `report` (checks, JSON printed as one `SOAK-REPORT {...}` line).
//!
//! After every fault the churn pauses and `kube-ipvs plan --diff` (the daemon's flags, the same
//! API objects, the real kernel) is run until it lists no writes, within the fault's deadline.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

#[path = "../api_lab/mod.rs"]
mod api_lab;
#[path = "../common/mod.rs"]
mod common;
mod faults;
mod node;
mod objects;
mod observe;
mod report;
mod rng;

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use testkit::apiserver::FakeApiServer;

use observe::{Clock, Health, Stop, Traffic};

/// Everything a fault acts on.
pub struct Soak {
    /// The node.
    pub node: Arc<node::Node>,
    /// The fake API server.
    pub api: Arc<FakeApiServer>,
    /// The daemon.
    pub daemon: Arc<Mutex<node::Daemon>>,
    /// Its pid now (the RSS sampler reads it).
    pub pid: Arc<Mutex<Option<u32>>>,
    /// The churned Services.
    pub churn: Arc<Mutex<objects::Churn>>,
    /// The faults' randomness.
    pub rng: rng::Rng,
    /// The hostile Services present now (removed after the check that follows them).
    pub hostile_present: Vec<String>,
    /// Whether the rules-toggle Service exists now.
    pub toggle: bool,
    /// Hostile objects created so far (names stay unique).
    pub hostile: u32,
    /// The daemon binary.
    pub bin: String,
    /// The soak's clock.
    pub clock: Clock,
    churn_paused: Arc<AtomicBool>,
    churn_idle: Arc<AtomicBool>,
    /// RSS right after each successful convergence check.
    quiet: Vec<(f64, u32, u64)>,
}

impl Soak {
    /// Starts the daemon (from a thread inside the node namespace).
    pub fn start_daemon(&self) {
        let mut d = self.daemon.lock().unwrap();
        d.start();
        *self.pid.lock().unwrap() = d.pid();
    }

    /// Creates the rules-toggle Service if it is absent, deletes it otherwise (an IPVS-mode
    /// iptables rules change); says which.
    pub fn toggle_rules(&mut self) -> String {
        self.toggle = !self.toggle;
        objects::rules_toggle(&self.api, self.toggle);
        format!(
            "rules changed (rules-toggle {})",
            if self.toggle { "created" } else { "deleted" }
        )
    }

    /// Pauses the churn, then runs `plan --diff` until it lists no writes or `deadline` seconds
    /// passed: (seconds until it did, the writes left otherwise). A daemon that exited on its
    /// own meanwhile is recorded and started again.
    pub async fn converge(&mut self, deadline: f64) -> (Option<f64>, Vec<String>) {
        self.churn_paused.store(true, Ordering::SeqCst);
        while !self.churn_idle.load(Ordering::SeqCst) {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        let start = Instant::now();
        let result = loop {
            let at = self.clock.now();
            tokio::task::block_in_place(|| {
                let mut d = self.daemon.lock().unwrap();
                if d.restart_if_exited(at) {
                    println!("[{at:.0} s] THE DAEMON EXITED ON ITS OWN; started again");
                    *self.pid.lock().unwrap() = d.pid();
                }
            });
            // plan --diff itself may run at most until the deadline (at least 20 s).
            let limit = (deadline - start.elapsed().as_secs_f64()).max(20.0).ceil() as u64;
            let r = tokio::task::block_in_place(|| self.node.plan_diff(&self.bin, limit));
            let took = start.elapsed().as_secs_f64();
            let left = match r {
                Ok(w) if w.is_empty() => break (Some(took), Vec::new()),
                Ok(w) => w.into_iter().take(10).collect(),
                Err(e) => vec![e],
            };
            if took > deadline {
                break (None, left);
            }
            tokio::time::sleep(Duration::from_secs(1)).await;
        };
        if result.0.is_some() {
            let pid = *self.pid.lock().unwrap();
            if let Some(kb) = pid.and_then(node::rss_kb) {
                self.quiet.push((self.clock.now(), pid.unwrap_or(0), kb));
            }
        }
        self.churn_paused.store(false, Ordering::SeqCst);
        result
    }
}

fn env_or<T: std::str::FromStr>(name: &str) -> Option<T> {
    std::env::var(name).ok().and_then(|v| v.parse().ok())
}

#[test]
#[ignore = "soak"]
fn soak_release_daemon_under_churn_and_faults() {
    let Some(minutes) = env_or::<f64>("KUBE_IPVS_SOAK_MINUTES") else {
        panic!("KUBE_IPVS_SOAK_MINUTES is not set: run `cargo xtask soak [--minutes N]`");
    };
    let seed = env_or::<u64>("KUBE_IPVS_SOAK_SEED").unwrap_or_else(|| {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_secs())
            .unwrap_or(1)
    });
    let bin = std::env::var("KUBE_IPVS_SOAK_BIN")
        .unwrap_or_else(|_| env!("CARGO_BIN_EXE_kube-ipvs").to_string());
    println!("soak: {minutes} minutes, seed {seed}, daemon {bin}");
    let node = Arc::new(node::Node::new());
    let inner = node.clone();
    let report = node
        .lab
        .node
        .enter(move || {
            let rt = tokio::runtime::Builder::new_multi_thread()
                .worker_threads(2)
                .enable_all()
                .build()?;
            Ok(rt.block_on(soak(inner, minutes, seed, bin)))
        })
        .unwrap();
    println!("SOAK-REPORT {}", serde_json::to_string(&report).unwrap());
    let failed = report["failed_checks"].as_u64().unwrap_or(1);
    assert_eq!(failed, 0, "{failed} soak checks failed (see the report)");
}

async fn soak(node: Arc<node::Node>, minutes: f64, seed: u64, bin: String) -> serde_json::Value {
    let duration = minutes * 60.0;
    let api = Arc::new(FakeApiServer::start().await.unwrap());
    api.write_kubeconfig(node.kubeconfig()).unwrap();
    objects::load_base(&api);
    let churn = Arc::new(Mutex::new(objects::Churn::create(&api)));
    let daemon = Arc::new(Mutex::new(node::Daemon::new(&bin, &node)));
    let mut s = Soak {
        node: node.clone(),
        api: api.clone(),
        daemon,
        pid: Arc::new(Mutex::new(None)),
        churn: churn.clone(),
        rng: rng::Rng::new(seed),
        hostile_present: Vec::new(),
        toggle: false,
        hostile: 0,
        bin,
        clock: Clock(Instant::now()),
        churn_paused: Arc::new(AtomicBool::new(true)),
        churn_idle: Arc::new(AtomicBool::new(true)),
        quiet: Vec::new(),
    };
    s.start_daemon();
    let (first, left) = s.converge(120.0).await;
    assert!(
        first.is_some(),
        "the daemon never converged at the start: {left:?}\n{}",
        node::tail(&s.daemon.lock().unwrap().log_text(), 40)
    );
    // The clock starts once the node is programmed.
    let clock = Clock(Instant::now());
    s.clock = clock;
    s.quiet.clear();
    println!(
        "soak: programmed after {:.1} s; clients, prober, churn start",
        first.unwrap_or(0.0)
    );

    let stop: Stop = Arc::new(AtomicBool::new(false));
    let traffic = Arc::new(Mutex::new(Traffic::default()));
    let health = Arc::new(Mutex::new(Health::default()));
    let rss: observe::Rss = Arc::default();
    let mut threads = Vec::new();
    // New connections from the node (one target per backend set from each source: see
    // observe::holder) and from a pod; held connections from the node on fixed ports.
    let node_targets = [
        "10.96.1.1:80",
        "192.168.0.10:30080",
        "192.168.0.100:80",
        "192.168.0.200:80",
    ];
    for (k, to) in node_targets.iter().enumerate() {
        let addr: SocketAddr = to.parse().unwrap();
        threads.push(observe::connector(
            format!("node → {to}"),
            addr,
            clock,
            traffic.clone(),
            stop.clone(),
        ));
        threads.push(observe::holder(
            format!("node (held) → {to}"),
            addr,
            20001 + k as u16,
            clock,
            traffic.clone(),
            stop.clone(),
        ));
    }
    for to in ["10.96.1.1:80", "10.96.1.2:80", "192.168.0.10:30081"] {
        let addr: SocketAddr = to.parse().unwrap();
        let (t, st) = (traffic.clone(), stop.clone());
        let label = format!("pod {} → {to}", node.client_pod.ip);
        let h = node
            .client_pod
            .ns
            .spawn(move || {
                observe::connector(label, addr, clock, t, st).join().ok();
                Ok(())
            })
            .unwrap();
        threads.push(std::thread::spawn(move || {
            let _ = h.join();
        }));
    }
    threads.push(observe::prober(
        "127.0.0.1:10256".parse().unwrap(),
        clock,
        health.clone(),
        stop.clone(),
    ));
    threads.push(observe::rss_sampler(
        s.pid.clone(),
        clock,
        rss.clone(),
        stop.clone(),
    ));
    {
        let (api, churn, stop) = (api.clone(), churn.clone(), stop.clone());
        let (paused, idle) = (s.churn_paused.clone(), s.churn_idle.clone());
        let mut rng = rng::Rng::new(seed ^ 0x5eed_c4a2);
        threads.push(std::thread::spawn(move || {
            while !stop.load(Ordering::Relaxed) {
                if paused.load(Ordering::SeqCst) {
                    idle.store(true, Ordering::SeqCst);
                    std::thread::sleep(Duration::from_millis(50));
                    continue;
                }
                idle.store(false, Ordering::SeqCst);
                churn.lock().unwrap().step(&api, &mut rng);
                std::thread::sleep(Duration::from_millis(rng.range(500, 2000)));
            }
            idle.store(true, Ordering::SeqCst);
        }));
    }
    s.churn_paused.store(false, Ordering::SeqCst);

    let warmup = (duration / 2.0).min(300.0);
    let first_fault = (duration / 6.0).min(60.0);
    tokio::time::sleep(Duration::from_secs_f64(first_fault)).await;
    let mut records: Vec<faults::Record> = Vec::new();
    let mut bag: Vec<faults::Kind> = Vec::new();
    while clock.now() < duration - 30.0 {
        if bag.is_empty() {
            bag = faults::Kind::all();
            s.rng.shuffle(&mut bag);
        }
        let kind = bag.pop().unwrap_or(faults::Kind::Kill9);
        let start = clock.now();
        println!("[{start:.0} s] fault: {}", kind.name());
        let (detail, verdicts) = faults::run(&mut s, kind).await;
        let end = clock.now();
        let (converged_after, left) = s.converge(kind.deadline()).await;
        println!(
            "[{:.0} s]   {detail}; kernel = plan {}",
            clock.now(),
            match converged_after {
                Some(t) => format!("{t:.1} s after it ended"),
                None => format!("NOT within {:.0} s: {:?}", kind.deadline(), left.first()),
            }
        );
        for (name, ok, d) in &verdicts {
            println!(
                "[{:.0} s]   {}: {name}: {d}",
                clock.now(),
                if *ok { "ok" } else { "FAIL" }
            );
        }
        let removed = faults::after(&mut s, kind).await;
        if let Some((after, left)) = &removed {
            println!(
                "[{:.0} s]   removed: kernel = plan {}",
                clock.now(),
                match after {
                    Some(t) => format!("after {t:.1} s"),
                    None => format!("NOT within {:.0} s: {:?}", kind.deadline(), left.first()),
                }
            );
        }
        records.push(faults::Record {
            removed,
            kind,
            detail,
            start,
            end,
            converged_after,
            left,
            verdicts,
        });
        let gap = s.rng.range(5, 20) as f64;
        if clock.now() + gap < duration - 30.0 {
            tokio::time::sleep(Duration::from_secs_f64(gap)).await;
        }
    }
    let rest = duration - clock.now();
    if rest > 0.0 {
        tokio::time::sleep(Duration::from_secs_f64(rest)).await;
    }
    let (final_after, final_left) = s.converge(faults::CONVERGE).await;
    println!(
        "[{:.0} s] end: kernel = plan {}",
        clock.now(),
        final_after
            .map(|t| format!("after {t:.1} s"))
            .unwrap_or_else(|| format!("NOT: {final_left:?}"))
    );
    stop.store(true, Ordering::Relaxed);
    for t in threads {
        let _ = t.join();
    }
    let elapsed = clock.now();
    let (starts, crashes, log) = {
        let mut d = s.daemon.lock().unwrap();
        let code = d.stop();
        println!("soak: daemon stopped with {code:?}");
        (d.starts, d.crashes.clone(), d.log_text())
    };
    println!("--- daemon log tail ---\n{}\n---", node::tail(&log, 40));
    let events = api.events();
    let event_writes = api.count_requests(|r| {
        (r.method == "POST" || r.method == "PATCH") && r.path.contains("/events")
    });
    let traffic = std::mem::take(&mut *traffic.lock().unwrap());
    let health = std::mem::take(&mut *health.lock().unwrap());
    let rss = rss.lock().unwrap().clone();
    let churn_ops = churn.lock().unwrap().ops;
    let mut report = report::build(&report::Inputs {
        seed,
        elapsed,
        warmup,
        faults: &records,
        traffic: &traffic,
        health: &health,
        rss: &rss,
        quiet: &s.quiet,
        events: &events,
        event_writes,
        starts,
        crashes: &crashes,
        churn_ops,
    });
    report["minutes"] = serde_json::json!(minutes);
    report["daemon_log"] = warnings(&log);
    report["final_converged_after_s"] = serde_json::json!(final_after);
    report["final_left"] = serde_json::json!(final_left);
    if final_after.is_none() {
        report["checks"].as_array_mut().unwrap().push(serde_json::json!({
            "check": "kernel = plan at the end",
            "result": "FAIL",
            "detail": format!("churn stopped, not within {:.0} s: {final_left:?}", faults::CONVERGE),
        }));
        report["failed_checks"] =
            serde_json::json!(report["failed_checks"].as_u64().unwrap_or(0) + 1);
    }
    report
}

/// The daemon's WARN and ERROR lines grouped by message (timestamps and fields cut): the most
/// frequent 15 with their counts.
fn warnings(log: &str) -> serde_json::Value {
    let mut by: std::collections::BTreeMap<String, usize> = std::collections::BTreeMap::new();
    for l in log.lines() {
        let Some(pos) = l.find(" WARN ").or_else(|| l.find(" ERROR ")) else {
            continue;
        };
        let msg: String = l[pos..].trim().chars().take(120).collect();
        *by.entry(msg).or_default() += 1;
    }
    let mut v: Vec<(String, usize)> = by.into_iter().collect();
    v.sort_by_key(|e| std::cmp::Reverse(e.1));
    serde_json::json!(v
        .into_iter()
        .take(15)
        .map(|(m, n)| serde_json::json!({"count": n, "line": m}))
        .collect::<Vec<_>>())
}
