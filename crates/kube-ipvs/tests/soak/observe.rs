//! What the soak watches while it runs, each on its own thread: clients connecting to the stable
//! Services every 100 ms and held connections echoing every second (every failure with its time),
//! a kubelet-like prober of `/healthz` and `/livez` every second (every non-200 with its body),
//! and the daemon's `VmRSS` every 5 s.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{IpAddr, Ipv4Addr, SocketAddr, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use serde_json::{json, Value};

/// Seconds since the soak started.
#[derive(Debug, Clone, Copy)]
pub struct Clock(pub Instant);

impl Clock {
    /// Now, in seconds since the start.
    pub fn now(&self) -> f64 {
        self.0.elapsed().as_secs_f64()
    }
}

/// One failed connection or ping.
#[derive(Debug, Clone)]
pub struct Failure {
    /// When (seconds since the start).
    pub at: f64,
    /// Which client (`from → target`).
    pub client: String,
    /// What went wrong.
    pub error: String,
}

/// Counts of the clients.
#[derive(Debug, Default)]
pub struct Traffic {
    /// New connections attempted.
    pub attempted: u64,
    /// New connections that failed.
    pub failed: Vec<Failure>,
    /// Pings over held connections.
    pub pings: u64,
    /// Held connections that broke (a ping failed; reconnected afterwards).
    pub held_failed: Vec<Failure>,
}

/// The threads' shared stop flag.
pub type Stop = Arc<AtomicBool>;

/// A client connecting to `to` every 100 ms from the calling thread's namespace (one echo
/// round trip per connection), until `stop`.
pub fn connector(
    label: String,
    to: SocketAddr,
    clock: Clock,
    traffic: Arc<Mutex<Traffic>>,
    stop: Stop,
) -> JoinHandle<()> {
    std::thread::spawn(move || {
        let mut n = 0u64;
        while !stop.load(Ordering::Relaxed) {
            n += 1;
            let r = crate::api_lab::echo_once(to, n);
            let mut t = traffic.lock().unwrap();
            t.attempted += 1;
            if let Err(e) = r {
                t.failed.push(Failure {
                    at: clock.now(),
                    client: label.clone(),
                    error: e.to_string(),
                });
            }
            drop(t);
            std::thread::sleep(Duration::from_millis(100));
        }
    })
}

/// A held connection to `to` from the fixed client port `port` (outside the ephemeral range, so
/// no new connection of the same namespace can take its 4-tuple to the same pod through another
/// Service: see docs/troubleshooting.md), echoing a line every second; a broken one is recorded
/// and opened again.
pub fn holder(
    label: String,
    to: SocketAddr,
    port: u16,
    clock: Clock,
    traffic: Arc<Mutex<Traffic>>,
    stop: Stop,
) -> JoinHandle<()> {
    std::thread::spawn(move || {
        let mut conn: Option<BufReader<TcpStream>> = None;
        let mut n = 0u64;
        while !stop.load(Ordering::Relaxed) {
            if conn.is_none() {
                match open_from(to, port) {
                    Ok(s) => conn = Some(BufReader::new(s)),
                    Err(e) => {
                        traffic.lock().unwrap().held_failed.push(Failure {
                            at: clock.now(),
                            client: label.clone(),
                            error: format!("connect: {e}"),
                        });
                        std::thread::sleep(Duration::from_secs(1));
                        continue;
                    }
                }
            }
            n += 1;
            let r = conn.as_mut().map(|c| ping(c, n));
            let mut t = traffic.lock().unwrap();
            t.pings += 1;
            if let Some(Err(e)) = r {
                t.held_failed.push(Failure {
                    at: clock.now(),
                    client: label.clone(),
                    error: e.to_string(),
                });
                conn = None;
            }
            drop(t);
            std::thread::sleep(Duration::from_secs(1));
        }
    })
}

pub fn open_from(to: SocketAddr, port: u16) -> std::io::Result<TcpStream> {
    use socket2::{Domain, Socket, Type};
    let sock = Socket::new(Domain::for_address(to), Type::STREAM, None)?;
    sock.set_reuse_address(true)?;
    sock.bind(&SocketAddr::new(IpAddr::V4(Ipv4Addr::UNSPECIFIED), port).into())?;
    sock.connect_timeout(&to.into(), Duration::from_secs(5))?;
    let s = TcpStream::from(sock);
    s.set_read_timeout(Some(Duration::from_secs(10)))?;
    Ok(s)
}

pub fn ping(c: &mut BufReader<TcpStream>, n: u64) -> std::io::Result<()> {
    let msg = format!("ping {n}\n");
    c.get_mut().write_all(msg.as_bytes())?;
    let mut back = String::new();
    c.read_line(&mut back)?;
    if back == msg {
        Ok(())
    } else {
        Err(std::io::Error::other(format!("echo mismatch: {back:?}")))
    }
}

/// One answer of the health server that was not 200 (or no answer).
#[derive(Debug, Clone)]
pub struct Unhealthy {
    /// When.
    pub at: f64,
    /// `/healthz` or `/livez`.
    pub path: &'static str,
    /// The status (0: no answer).
    pub status: u16,
    /// Why: the reasons' subsystems (`iptables`, `source`, ...), or the probe's reason, or
    /// the connection error.
    pub cause: String,
}

/// The prober's counts.
#[derive(Debug, Default)]
pub struct Health {
    /// Requests made.
    pub polls: u64,
    /// Answers that were not 200, and failed requests.
    pub unhealthy: Vec<Unhealthy>,
}

/// The subsystems a 503 body names (`reasons[].subsystem`), or its `reason` text.
pub fn cause_of(body: &str) -> String {
    let Ok(v) = serde_json::from_str::<Value>(body) else {
        return format!(
            "unparsable body {:?}",
            body.chars().take(80).collect::<String>()
        );
    };
    let mut subs: Vec<String> = v["reasons"]
        .as_array()
        .map(|rs| {
            rs.iter()
                .filter_map(|r| r["subsystem"].as_str().map(str::to_string))
                .collect()
        })
        .unwrap_or_default();
    subs.sort();
    subs.dedup();
    if subs.is_empty() {
        v["reason"]
            .as_str()
            .map(|r| r.chars().take(80).collect())
            .unwrap_or_else(|| "503 without a reason".into())
    } else {
        subs.join("+")
    }
}

/// Probes `addr`'s `/healthz` and `/livez` every second like kubelet (a fresh connection each,
/// 5 s to connect, 10 s to answer).
pub fn prober(
    addr: SocketAddr,
    clock: Clock,
    health: Arc<Mutex<Health>>,
    stop: Stop,
) -> JoinHandle<()> {
    std::thread::spawn(move || {
        while !stop.load(Ordering::Relaxed) {
            for path in ["/healthz", "/livez"] {
                let r = get(addr, path);
                let mut h = health.lock().unwrap();
                h.polls += 1;
                let bad = match r {
                    Ok((200, _)) => None,
                    Ok((status, body)) => Some((status, cause_of(&body))),
                    Err(e) => Some((0, format!("no answer: {e}"))),
                };
                if let Some((status, cause)) = bad {
                    h.unhealthy.push(Unhealthy {
                        at: clock.now(),
                        path,
                        status,
                        cause,
                    });
                }
            }
            std::thread::sleep(Duration::from_secs(1));
        }
    })
}

fn get(addr: SocketAddr, path: &str) -> std::io::Result<(u16, String)> {
    let mut s = TcpStream::connect_timeout(&addr, Duration::from_secs(5))?;
    s.set_read_timeout(Some(Duration::from_secs(10)))?;
    write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n"
    )?;
    let mut raw = String::new();
    s.read_to_string(&mut raw)?;
    let (head, body) = raw.split_once("\r\n\r\n").unwrap_or((&raw, ""));
    let status = head
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .ok_or_else(|| std::io::Error::other(format!("no status line: {head:?}")))?;
    Ok((status, body.to_string()))
}

/// RSS samples: (seconds, pid, KiB).
pub type Rss = Arc<Mutex<Vec<(f64, u32, u64)>>>;

/// Samples the daemon's RSS every 5 s (the pid as `pid` says now).
pub fn rss_sampler(
    pid: Arc<Mutex<Option<u32>>>,
    clock: Clock,
    rss: Rss,
    stop: Stop,
) -> JoinHandle<()> {
    std::thread::spawn(move || {
        while !stop.load(Ordering::Relaxed) {
            let p = *pid.lock().unwrap();
            if let Some(p) = p {
                if let Some(kb) = crate::node::rss_kb(p) {
                    rss.lock().unwrap().push((clock.now(), p, kb));
                }
            }
            std::thread::sleep(Duration::from_secs(5));
        }
    })
}

/// Connections to the health port from one source that never finish their request (half a
/// header each), `count` at a time, re-opened when the server closes them, until `stop`.
/// Returns (connections opened, closed by the server).
pub fn flood(to: SocketAddr, count: usize, stop: Stop) -> (u64, u64) {
    let mut open: Vec<TcpStream> = Vec::new();
    let (mut opened, mut closed) = (0u64, 0u64);
    while !stop.load(Ordering::Relaxed) {
        while open.len() < count {
            match TcpStream::connect_timeout(&to, Duration::from_secs(2)) {
                Ok(mut s) => {
                    let _ = s.write_all(b"GET /healthz HTTP/1.1\r\nHost: x\r\n");
                    let _ = s.set_nonblocking(true);
                    open.push(s);
                    opened += 1;
                }
                Err(_) => break,
            }
        }
        // Drop the ones the server closed (read returns 0 or an error other than WouldBlock).
        let before = open.len();
        open.retain_mut(|s| {
            let mut b = [0u8; 256];
            match s.read(&mut b) {
                Ok(0) => false,
                Ok(_) => true,
                Err(e) => e.kind() == std::io::ErrorKind::WouldBlock,
            }
        });
        closed += (before - open.len()) as u64;
        std::thread::sleep(Duration::from_millis(200));
    }
    (opened, closed)
}

/// Summary of a failure list for the report: count, and the first few with their times.
pub fn failures_json(list: &[Failure]) -> Value {
    json!({
        "count": list.len(),
        "first": list.iter().take(20).map(|f| json!({"at_s": (f.at * 10.0).round() / 10.0, "client": f.client, "error": f.error})).collect::<Vec<_>>(),
    })
}
