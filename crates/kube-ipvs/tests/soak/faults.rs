//! The faults the soak draws from (a seeded shuffle of all of them, each once before any
//! repeats), how each is made against the real daemon and kernel, and what a fault may
//! legitimately do to `/healthz` while it lasts and until the node has converged after it.
//!
//! Netlink request failures are made in the release binary from outside, with `strace`'s
//! syscall fault injection attached to the running daemon (and the children it starts):
//! every second `sendto` fails with ENOBUFS. The daemon's netlink requests (IPVS, ipset,
//! rtnetlink) are `sendto` calls, its HTTP answers are `writev`, so the health port is not hit.
//! `drift` adds the kernel's own refusals: state deleted behind the daemon's back makes its next
//! requests on it fail (ENOENT, ESRCH) until the full sync repairs it.

use std::net::SocketAddr;
use std::os::unix::process::CommandExt;
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::objects::{self, Hostile, DRAIN_PODS, DRAIN_VIP, POD_PORT};
use crate::Soak;

/// The node's sync period (the shipped ConfigMap's `ipvs.syncPeriod`).
pub const SYNC_PERIOD: f64 = 30.0;
/// How long after a fault ends the kernel must equal `plan`: one full sync (the sync period
/// with its +15 % jitter) plus 20 s for the emulated VM to run it and `plan --diff`.
pub const CONVERGE: f64 = SYNC_PERIOD * 1.15 + 20.0;
/// Extra time after a hang: a call that started hanging just before the fault ended runs into
/// its own limit (`--ipset-timeout`, `--iptables-timeout`: 30 s) first.
pub const HUNG_CALL: f64 = 30.0;

/// A fault.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// The API server refuses connections for a while.
    ApiPause,
    /// Every watch gets a 410 ERROR event and history is compacted (relists hit 410 too).
    Api410,
    /// Every watch connection is aborted.
    ApiDropWatches,
    /// History forgotten, resourceVersion jumps, watches dropped.
    ApiResetHistory,
    /// `kill -9` of the daemon, started again 1-5 s later (like kubelet).
    Kill9,
    /// Another program holds `/run/xtables.lock`.
    XtablesLock,
    /// Every `ipset` process hangs.
    IpsetHang,
    /// Every `iptables-*-restore` process hangs.
    IptablesHang,
    /// Churned Services' virtual servers, real servers and VIPs deleted behind the daemon.
    Drift,
    /// Every second netlink request of the daemon fails (ENOBUFS on `sendto`, injected by
    /// `strace` attached to the running release binary) for 20-40 s.
    NetlinkFail,
    /// A real server drains (weight 0, a held connection) while its virtual server is repaired.
    DrainRepair,
    /// A pod floods the health port (:10256) with connections that never finish a request.
    HealthFlood,
    /// Thousands of addresses added and removed at once (the address tracker's socket
    /// overflows), then a real node address change must still be seen.
    AddressStorm,
    /// A hostile object appears (and stays).
    Hostile(Hostile),
}

impl Kind {
    /// Every fault.
    pub fn all() -> Vec<Kind> {
        let mut v = vec![
            Kind::ApiPause,
            Kind::Api410,
            Kind::ApiDropWatches,
            Kind::ApiResetHistory,
            Kind::Kill9,
            Kind::XtablesLock,
            Kind::IpsetHang,
            Kind::IptablesHang,
            Kind::Drift,
            Kind::NetlinkFail,
            Kind::DrainRepair,
            Kind::HealthFlood,
            Kind::AddressStorm,
        ];
        v.extend(Hostile::ALL.map(Kind::Hostile));
        v
    }

    /// Its name in the report.
    pub fn name(self) -> String {
        match self {
            Kind::ApiPause => "API server unreachable".into(),
            Kind::Api410 => "watches expired (410 Gone), history compacted".into(),
            Kind::ApiDropWatches => "watch connections dropped".into(),
            Kind::ApiResetHistory => "API history reset (410, resourceVersion jump)".into(),
            Kind::Kill9 => "kill -9 and restart".into(),
            Kind::XtablesLock => "xtables lock held".into(),
            Kind::IpsetHang => "ipset processes hang".into(),
            Kind::IptablesHang => "iptables-restore processes hang".into(),
            Kind::Drift => "kernel drift (state deleted behind the daemon)".into(),
            Kind::NetlinkFail => "netlink requests fail (every second sendto: ENOBUFS)".into(),
            Kind::DrainRepair => "repair of a virtual server with a draining real server".into(),
            Kind::HealthFlood => "connection flood on :10256 from one pod".into(),
            Kind::AddressStorm => {
                "address storm (tracker overflow), then a node address change".into()
            }
            Kind::Hostile(h) => format!("hostile object: {}", h.name()),
        }
    }

    /// The `/healthz` reasons (subsystems) this fault may cause while it lasts and until the
    /// node converged after it, and whether the health port may not answer (the daemon is
    /// restarting): a sync that cannot program iptables or read the ipsets is unhealthy after
    /// 2 × syncPeriod, rightly, and a restarting daemon is pending until its first sync. Every
    /// other fault must leave `/healthz` at 200: an unreachable API server, a hostile object or
    /// a connection flood is no reason to take the node out (issue #32).
    pub fn may_fail_health(self) -> (&'static [&'static str], bool) {
        match self {
            Kind::Kill9 => (&["pending"], true),
            Kind::XtablesLock | Kind::IptablesHang => (&["iptables", "pending"], false),
            Kind::IpsetHang => (&["ipset", "pending"], false),
            // At most 40 s of failing requests: shorter than the 2 x syncPeriod a subsystem
            // must fail before `/healthz` says so; allowed like the other kernel faults.
            Kind::NetlinkFail => (&["ipvs", "ipset", "pending"], false),
            _ => (&[], false),
        }
    }

    /// How long after its end the kernel must equal `plan`.
    pub fn deadline(self) -> f64 {
        match self {
            Kind::IpsetHang | Kind::IptablesHang => CONVERGE + HUNG_CALL,
            // One more iptables-restore lock wait (`-w 5`).
            Kind::XtablesLock => CONVERGE + 5.0,
            _ => CONVERGE,
        }
    }
}

/// What happened in one fault.
#[derive(Debug, Clone)]
pub struct Record {
    /// The fault.
    pub kind: Kind,
    /// What exactly was done.
    pub detail: String,
    /// Seconds since the start.
    pub start: f64,
    /// When the fault ended (the kernel must equal `plan` within [`Kind::deadline`] of it).
    pub end: f64,
    /// Seconds from `end` to the first `plan --diff` without writes; `None`: not within the
    /// deadline.
    pub converged_after: Option<f64>,
    /// The writes `plan --diff` still listed at the deadline (first lines), or its error.
    pub left: Vec<String>,
    /// Checks of the fault itself: (check, ok, detail).
    pub verdicts: Vec<(String, bool, String)>,
    /// A hostile object's removal after the check: seconds until the kernel equalled `plan`
    /// again (`None`: not within the deadline) and the writes left.
    pub removed: Option<(Option<f64>, Vec<String>)>,
}

fn sh(cmd: &str) -> (bool, String) {
    match Command::new("sh").args(["-c", cmd]).output() {
        Ok(o) => (
            o.status.success(),
            format!(
                "{}{}",
                String::from_utf8_lossy(&o.stdout),
                String::from_utf8_lossy(&o.stderr)
            ),
        ),
        Err(e) => (false, e.to_string()),
    }
}

async fn sleep_s(secs: u64) {
    tokio::time::sleep(Duration::from_secs(secs)).await;
}

/// Makes the fault `kind` and waits until it is over. Returns (detail, fault-specific
/// verdicts).
pub async fn run(s: &mut Soak, kind: Kind) -> (String, Vec<(String, bool, String)>) {
    let mut verdicts = Vec::new();
    let detail = match kind {
        Kind::ApiPause => {
            let secs = s.rng.range(30, 90);
            s.api.pause().await;
            sleep_s(secs).await;
            let r = s.api.resume();
            format!(
                "{secs} s{}",
                r.err()
                    .map(|e| format!(" (resume: {e})"))
                    .unwrap_or_default()
            )
        }
        Kind::Api410 => {
            let n = s.api.expire_watches();
            s.api.compact();
            format!("{n} watches expired, history compacted")
        }
        Kind::ApiDropWatches => format!("{} watches dropped", s.api.drop_watches()),
        Kind::ApiResetHistory => {
            s.api.reset_history(1000);
            "resourceVersion +1000, watches dropped".into()
        }
        Kind::Kill9 => {
            let down = s.rng.range(1, 5);
            tokio::task::block_in_place(|| {
                let mut d = s.daemon.lock().unwrap();
                d.kill9();
                *s.pid.lock().unwrap() = None;
            });
            sleep_s(down).await;
            s.start_daemon();
            format!("down {down} s")
        }
        Kind::XtablesLock => {
            let secs = s.rng.range(40, 80);
            let mut child = Command::new("flock")
                .args(["/run/xtables.lock", "sleep", &secs.to_string()])
                .process_group(0)
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .expect("flock (util-linux) in the VM image");
            // A rules change, so an iptables-restore is due while the lock is held.
            let toggled = s.toggle_rules();
            sleep_s(secs).await;
            // The group (flock and its sleep), should it still run; busybox `kill` takes a
            // negative pid without `--`.
            let _ = Command::new("kill")
                .args(["-KILL", &format!("-{}", child.id())])
                .stderr(Stdio::null())
                .status();
            let _ = child.wait();
            format!("{secs} s; {toggled}")
        }
        Kind::IpsetHang | Kind::IptablesHang => {
            let tool = if kind == Kind::IpsetHang {
                "ipset"
            } else {
                "iptables"
            };
            let before = s.node.hung_calls(tool);
            s.node.hang(tool, true);
            // iptables: a rules change, so an iptables-restore is due while it hangs. ipset: the
            // sets are read and their members written over netlink, so the program runs only
            // where a set must be created, recreated or destroyed (or netlink fails).
            let toggled = if tool == "iptables" {
                format!("; {}", s.toggle_rules())
            } else {
                String::new()
            };
            sleep_s(45).await;
            s.node.hang(tool, false);
            format!(
                "45 s, {} calls hung{toggled}",
                s.node.hung_calls(tool) - before
            )
        }
        Kind::Drift => drift(s),
        Kind::NetlinkFail => {
            let secs = s.rng.range(20, 40);
            let (detail, v) = netlink_fail(s, secs).await;
            verdicts.push(v);
            detail
        }
        Kind::DrainRepair => {
            let (detail, v) = tokio::task::block_in_place(|| drain_repair(s));
            verdicts.push(v);
            detail
        }
        Kind::HealthFlood => {
            let stop = Arc::new(AtomicBool::new(false));
            let to: SocketAddr = "192.168.0.10:10256".parse().unwrap();
            let flag = stop.clone();
            let h = s
                .node
                .flood_pod
                .ns
                .spawn(move || Ok(crate::observe::flood(to, 300, flag)))
                .unwrap();
            sleep_s(30).await;
            stop.store(true, Ordering::Relaxed);
            let (opened, closed) = h.join().unwrap().unwrap();
            format!(
                "30 s from {}: {opened} connections opened, {closed} closed by the server",
                s.node.flood_pod.ip
            )
        }
        Kind::AddressStorm => {
            let (detail, v) = address_storm(s).await;
            verdicts.push(v);
            detail
        }
        Kind::Hostile(h) => {
            s.hostile += 1;
            let services = h.create(&s.api, s.hostile);
            let n = services.len();
            if !h.stays() {
                s.hostile_present = services;
            }
            format!(
                "{n} Service(s) with their slices{}",
                if h.stays() { ", staying" } else { "" }
            )
        }
    };
    (detail, verdicts)
}

/// After the fault's check: a hostile object that does not stay is removed, and the kernel must
/// equal `plan` again within the deadline.
pub async fn after(s: &mut Soak, kind: Kind) -> Option<(Option<f64>, Vec<String>)> {
    if !matches!(kind, Kind::Hostile(_)) || s.hostile_present.is_empty() {
        return None;
    }
    for name in std::mem::take(&mut s.hostile_present) {
        objects::remove(&s.api, &name);
    }
    Some(s.converge(kind.deadline()).await)
}

/// Attaches `strace` to the daemon (every thread, and the children it starts meanwhile) for
/// `secs` seconds, failing every second `sendto` with ENOBUFS; counts the calls it failed.
async fn netlink_fail(s: &mut Soak, secs: u64) -> (String, (String, bool, String)) {
    let name = "netlink requests failed by injection".to_string();
    let Some(pid) = *s.pid.lock().unwrap() else {
        let why = "the daemon was not running".to_string();
        return (why.clone(), (name, false, why));
    };
    let out = format!("/tmp/strace-{pid}.out");
    let child = Command::new("strace")
        .args([
            "-f",
            "-qq",
            "-o",
            &out,
            "-e",
            "trace=sendto",
            "-e",
            "inject=sendto:error=ENOBUFS:when=2+2",
            "-p",
            &pid.to_string(),
        ])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn();
    let mut child = match child {
        Ok(c) => c,
        Err(e) => {
            let why = format!("strace: {e}");
            return (why.clone(), (name, false, why));
        }
    };
    sleep_s(secs).await;
    // SIGINT: strace detaches from every tracee and exits.
    let _ = Command::new("kill")
        .args(["-INT", &child.id().to_string()])
        .status();
    let _ = tokio::task::block_in_place(|| child.wait());
    let trace = std::fs::read_to_string(&out).unwrap_or_default();
    let _ = std::fs::remove_file(&out);
    let injected = trace.lines().filter(|l| l.contains("(INJECTED)")).count();
    let passed = trace
        .lines()
        .filter(|l| l.contains("sendto(") && !l.contains("(INJECTED)"))
        .count();
    let detail = format!("{secs} s: {injected} sendto calls failed, {passed} passed");
    (detail.clone(), (name, injected > 0, detail))
}

/// Deletes state of three churned Services behind the daemon: a virtual server, a real server,
/// a VIP on kube-ipvs0.
fn drift(s: &mut Soak) -> String {
    let present = s.churn.lock().unwrap().present();
    if present.len() < 3 {
        return "skipped: fewer than 3 churned Services".into();
    }
    let pick = |s: &mut Soak| present[s.rng.below(present.len() as u64) as usize].clone();
    let (a, b, c) = (pick(s), pick(s), pick(s));
    let mut done = Vec::new();
    let (ok, _) = sh(&format!("ipvsadm -D -t {}", a.1));
    done.push(format!("ipvsadm -D {} ({}): {ok}", a.1, a.0));
    if let Some(ep) = b.2.first() {
        let (ok, _) = sh(&format!("ipvsadm -d -t {} -r {ep}", b.1));
        done.push(format!("ipvsadm -d {} -r {ep}: {ok}", b.1));
    }
    let vip = c.1.split(':').next().unwrap_or_default().to_string();
    let (ok, _) = sh(&format!("ip addr del {vip}/32 dev kube-ipvs0"));
    done.push(format!("ip addr del {vip}: {ok}"));
    done.join("; ")
}

/// The real servers of the drain Service: (address:port, weight).
fn drain_reals() -> Vec<(String, u32)> {
    let (_, out) = sh("ipvsadm -Sn");
    out.lines()
        .filter(|l| l.starts_with(&format!("-a -t {DRAIN_VIP} ")))
        .filter_map(|l| {
            let w: Vec<&str> = l.split_whitespace().collect();
            let r = w
                .iter()
                .position(|x| *x == "-r")
                .map(|i| w[i + 1].to_string())?;
            let weight = w
                .iter()
                .position(|x| *x == "-w")
                .and_then(|i| w[i + 1].parse().ok())
                .unwrap_or(1);
            Some((r, weight))
        })
        .collect()
}

fn wait_for(deadline: f64, mut f: impl FnMut() -> bool) -> bool {
    let start = Instant::now();
    while start.elapsed().as_secs_f64() < deadline {
        if f() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(500));
    }
    false
}

/// A held connection lands on pod B; B leaves the slice and drains (weight 0); the other real
/// server is deleted behind the daemon, so the full sync repairs the virtual server: B must
/// still be there at weight 0 and the held connection must still echo.
fn drain_repair(s: &mut Soak) -> (String, (String, bool, String)) {
    let name = "draining real server kept at weight 0 through a repair".to_string();
    let vip: SocketAddr = DRAIN_VIP.parse().unwrap();
    let fail = |why: String| (why.clone(), (name.clone(), false, why));
    let conn = match crate::observe::open_from(vip, 20100) {
        Ok(c) => c,
        Err(e) => return fail(format!("cannot open the held connection: {e}")),
    };
    let mut conn = std::io::BufReader::new(conn);
    let (_, table) = sh("ipvsadm -Lnc");
    let Some(b) = table
        .lines()
        .find(|l| l.contains(":20100 ") && l.contains(DRAIN_VIP))
        .and_then(|l| l.split_whitespace().last().map(str::to_string))
    else {
        return fail(format!(
            "the held connection is not in ipvsadm -Lnc:\n{table}"
        ));
    };
    let Some(a) = DRAIN_PODS
        .iter()
        .map(|p| format!("{p}:{POD_PORT}"))
        .find(|p| *p != b)
    else {
        return fail(format!("unknown real server {b}"));
    };
    let keep: Vec<_> = DRAIN_PODS
        .iter()
        .copied()
        .filter(|p| format!("{p}:{POD_PORT}") == a)
        .collect();
    objects::drain_endpoints(&s.api, &keep);
    if !wait_for(CONVERGE, || {
        let r = drain_reals();
        r.contains(&(b.clone(), 0)) && r.contains(&(a.clone(), 1))
    }) {
        objects::drain_endpoints(&s.api, &DRAIN_PODS);
        return fail(format!("{b} never drained (weight 0): {:?}", drain_reals()));
    }
    let (ok, out) = sh(&format!("ipvsadm -d -t {DRAIN_VIP} -r {a}"));
    let repaired = ok && wait_for(CONVERGE, || drain_reals().iter().any(|(r, _)| *r == a));
    let after = drain_reals();
    let pinged =
        crate::observe::ping(&mut conn, 1).and_then(|_| crate::observe::ping(&mut conn, 2));
    drop(conn);
    objects::drain_endpoints(&s.api, &DRAIN_PODS);
    let detail = format!(
        "held connection on {b}, {b} drained, {a} deleted behind the daemon ({}), repaired: \
         {repaired}; real servers after: {after:?}; held connection: {}",
        if ok {
            "ok".to_string()
        } else {
            out.trim().to_string()
        },
        match &pinged {
            Ok(()) => "echoes".to_string(),
            Err(e) => format!("broken ({e})"),
        }
    );
    let good = repaired && after.contains(&(b.clone(), 0)) && pinged.is_ok();
    (detail.clone(), (name, good, detail))
}

/// 4,000 addresses added to `storm0` and removed, each in one `ip -batch`; then 192.168.0.11
/// is added to the node's LAN link: its NodePorts must appear (checked with `plan --diff`,
/// which reads the node's addresses itself), and go when it is removed.
async fn address_storm(s: &mut Soak) -> (String, (String, bool, String)) {
    let name = "a node address added after an address storm is served".to_string();
    let batch = |op: &str| -> String {
        let mut t = String::new();
        for i in 0..4000u32 {
            t.push_str(&format!(
                "addr {op} 198.18.{}.{}/32 dev storm0\n",
                200 + i / 250,
                i % 250 + 1
            ));
        }
        t
    };
    let file = s.node.dir.join("storm.batch");
    let mut out = Vec::new();
    for op in ["add", "del"] {
        std::fs::write(&file, batch(op)).unwrap();
        let (ok, o) = sh(&format!("ip -force -batch {}", file.display()));
        out.push(format!(
            "{op}: {}",
            if ok {
                "ok".into()
            } else {
                o.lines().next().unwrap_or_default().to_string()
            }
        ));
    }
    let (ok, o) = sh("ip addr add 192.168.0.11/24 dev node0");
    if !ok {
        return (format!("cannot add 192.168.0.11: {o}"), (name, false, o));
    }
    let seen = s.converge(Kind::AddressStorm.deadline()).await;
    let (_, ipvs) = sh("ipvsadm -Sn");
    let served = ipvs.contains("-A -t 192.168.0.11:30080 ");
    let _ = sh("ip addr del 192.168.0.11/24 dev node0");
    let detail = format!(
        "4,000 addresses {}; 192.168.0.11 added: kernel = plan after {}, NodePort 30080 on it: {served}",
        out.join(", "),
        match seen.0 {
            Some(t) => format!("{t:.1} s"),
            None => format!("never ({:?})", seen.1.first()),
        }
    );
    let ok = seen.0.is_some() && served;
    (detail.clone(), (name, ok, detail))
}
