//! HTTP server limits on loopback (issue #16 item 8, issue #32 item 2): a client that sends half a
//! header is disconnected, idle connections beyond the cap are refused, a freed slot serves
//! again; one source holding many connections, or many sources filling the server, never lock
//! out `/healthz` from another address (127.0.0.0/8 is all local, so 127.0.0.2, 127.0.0.3, … are
//! distinct sources).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::io::{Read, Write};
use std::net::{IpAddr, Ipv4Addr, SocketAddr, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use kube_ipvs::http::{serve_limited, Limits};
use kube_ipvs::metrics::Metrics;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

fn router() -> axum::Router {
    axum::Router::new()
        .route("/ok", axum::routing::get(|| async { "ok" }))
        .route("/healthz", axum::routing::get(|| async { "healthy" }))
}

async fn start(limits: Limits) -> (SocketAddr, tokio::sync::oneshot::Sender<()>) {
    start_counted(limits, None).await
}

async fn start_counted(
    limits: Limits,
    metrics: Option<Arc<Metrics>>,
) -> (SocketAddr, tokio::sync::oneshot::Sender<()>) {
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = l.local_addr().unwrap().port();
    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
    tokio::spawn(serve_limited(
        "healthz",
        l,
        router(),
        limits,
        metrics,
        async {
            let _ = rx.await;
        },
    ));
    (SocketAddr::new(IpAddr::V4(Ipv4Addr::LOCALHOST), port), tx)
}

/// Reads until EOF or error; `Ok(bytes)` on EOF. The read timeout only prevents a hang.
fn read_to_close(s: &mut TcpStream) -> std::io::Result<Vec<u8>> {
    s.set_read_timeout(Some(Duration::from_secs(30)))?;
    let mut buf = Vec::new();
    s.read_to_end(&mut buf)?;
    Ok(buf)
}

/// `GET /ok`; an answer other than 200 is an error carrying the answer.
fn get_ok(addr: SocketAddr) -> std::io::Result<String> {
    let mut s = TcpStream::connect(addr)?;
    s.write_all(b"GET /ok HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")?;
    let body = read_to_close(&mut s)?;
    let text = String::from_utf8_lossy(&body).to_string();
    if text.starts_with("HTTP/1.1 200") {
        Ok(text)
    } else {
        Err(std::io::Error::other(format!(
            "unexpected answer: {text:?}"
        )))
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn half_a_header_is_disconnected() {
    let limits = Limits {
        header_read_timeout: Duration::from_millis(300),
        ..Limits::default()
    };
    let (addr, _stop) = start(limits).await;
    let r = tokio::task::spawn_blocking(move || {
        let mut s = TcpStream::connect(addr).unwrap();
        s.write_all(b"GET /ok HTTP/1.1\r\nHost: x\r\nX-Slow: ")
            .unwrap();
        read_to_close(&mut s)
    })
    .await
    .unwrap();
    // The server closed the connection (EOF, or a reset), instead of the client's own
    // 30-second read timeout firing.
    match r {
        Ok(bytes) => assert!(
            !String::from_utf8_lossy(&bytes).contains("200 OK"),
            "{bytes:?}"
        ),
        Err(e) => assert!(
            !matches!(
                e.kind(),
                std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
            ),
            "the server never closed the connection: {e}"
        ),
    }
    // A well-behaved client is still served.
    let addr2 = addr;
    tokio::task::spawn_blocking(move || get_ok(addr2))
        .await
        .unwrap()
        .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connections_beyond_the_cap_are_closed_and_a_freed_slot_serves_again() {
    let limits = Limits {
        max_connections: 2,
        max_per_source: 8,
        header_read_timeout: Duration::from_secs(120),
        max_connection_age: Duration::from_secs(120),
    };
    let (addr, _stop) = start(limits).await;
    tokio::task::spawn_blocking(move || {
        // Two idle connections take both slots (each proven accepted by a kept-alive request).
        let mut held = Vec::new();
        for _ in 0..2 {
            let mut s = TcpStream::connect(addr).unwrap();
            s.write_all(b"GET /ok HTTP/1.1\r\nHost: x\r\n\r\n").unwrap();
            let mut buf = [0u8; 256];
            s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
            let n = s.read(&mut buf).unwrap();
            assert!(buf[..n].starts_with(b"HTTP/1.1 200"), "{:?}", &buf[..n]);
            held.push(s);
        }
        // A third one is closed without an answer.
        let err = get_ok(addr).unwrap_err();
        assert!(!err.to_string().contains("200"), "{err}");
        // Free one slot: a new client is served (the server notices the close
        // asynchronously, so poll; the deadline only prevents a hang).
        drop(held.pop());
        let start = Instant::now();
        loop {
            match get_ok(addr) {
                Ok(_) => break,
                Err(e) => assert!(
                    start.elapsed() < Duration::from_secs(30),
                    "no slot freed: {e}"
                ),
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        drop(held);
    })
    .await
    .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serving_stops_when_asked() {
    let (addr, stop) = start(Limits::default()).await;
    tokio::task::spawn_blocking(move || get_ok(addr))
        .await
        .unwrap()
        .unwrap();
    stop.send(()).unwrap();
    let start = Instant::now();
    while TcpStream::connect(addr).is_ok() {
        assert!(start.elapsed() < Duration::from_secs(30), "still listening");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// 127.0.0.`last`.
fn local(last: u8) -> IpAddr {
    IpAddr::V4(Ipv4Addr::new(127, 0, 0, last))
}

/// Connects to `to` from `from` (any port).
async fn connect_from(from: IpAddr, to: SocketAddr) -> std::io::Result<tokio::net::TcpStream> {
    let sock = tokio::net::TcpSocket::new_v4()?;
    sock.bind(SocketAddr::new(from, 0))?;
    sock.connect(to).await
}

/// A client at `from` that keeps one connection open, sending nothing, and opens a new one each
/// time the server closes it, until `stop`. Returns how many connections it opened.
fn hog(from: IpAddr, to: SocketAddr, stop: Arc<AtomicBool>) -> tokio::task::JoinHandle<u64> {
    tokio::spawn(async move {
        let mut opened = 0;
        while !stop.load(Ordering::Relaxed) {
            if let Ok(mut s) = connect_from(from, to).await {
                opened += 1;
                let mut buf = [0u8; 64];
                // Held until the server closes it (or the test ends).
                loop {
                    tokio::select! {
                        r = s.read(&mut buf) => if matches!(r, Ok(0) | Err(_)) { break },
                        () = tokio::time::sleep(Duration::from_millis(200)) => {
                            if stop.load(Ordering::Relaxed) { break }
                        }
                    }
                }
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        opened
    })
}

/// `GET /healthz` from `from`; the status line and body, or the error.
async fn healthz_from(from: IpAddr, to: SocketAddr) -> std::io::Result<String> {
    let mut s = connect_from(from, to).await?;
    s.write_all(b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        .await?;
    let mut out = Vec::new();
    tokio::time::timeout(Duration::from_secs(30), s.read_to_end(&mut out))
        .await
        .map_err(|_| std::io::Error::other("no answer"))??;
    Ok(String::from_utf8_lossy(&out).into_owned())
}

fn counter(m: &Metrics, prefix: &str) -> u64 {
    let text = m.encode().unwrap();
    text.lines()
        .find_map(|l| l.strip_prefix(prefix))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or_else(|| panic!("{prefix} missing:\n{text}"))
}

/// Waits until the counters named by `prefixes` sum to `at_least` (the deadline only prevents a
/// hang).
async fn wait_counters(m: &Metrics, prefixes: &[&str], at_least: u64) {
    let start = Instant::now();
    while prefixes.iter().map(|p| counter(m, p)).sum::<u64>() < at_least {
        assert!(
            start.elapsed() < Duration::from_secs(60),
            "{prefixes:?} stayed below {at_least}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

const REFUSED_PER_SOURCE: &str =
    r#"kube_ipvs_http_connections_refused_total{server="healthz",reason="per_source"} "#;
const REFUSED_TOTAL: &str =
    r#"kube_ipvs_http_connections_refused_total{server="healthz",reason="total"} "#;
const EVICTED: &str = r#"kube_ipvs_http_connections_evicted_total{server="healthz"} "#;

/// The default limits, except that idle connections are never timed out during the test (so
/// the hogs' connections stay, and a slot is freed only by the caps).
fn held() -> Limits {
    Limits {
        header_read_timeout: Duration::from_secs(600),
        max_connection_age: Duration::from_secs(600),
        ..Limits::default()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_source_holding_200_connections_does_not_lock_out_healthz_from_another() {
    let limits = held();
    assert!(limits.max_per_source < 200 && limits.max_connections < 200);
    let m = Arc::new(Metrics::new());
    let (addr, _stop) = start_counted(limits, Some(m.clone())).await;
    let stop = Arc::new(AtomicBool::new(false));
    // 200 connections kept open from 127.0.0.3, each re-opened when the server closes it.
    let hogs: Vec<_> = (0..200)
        .map(|_| hog(local(3), addr, stop.clone()))
        .collect();
    // The server has turned the hogs away 400 times (whichever cap did it).
    wait_counters(&m, &[REFUSED_PER_SOURCE, REFUSED_TOTAL], 400).await;
    // The node's own probe from another address is answered.
    let r = healthz_from(local(2), addr).await;
    stop.store(true, Ordering::Relaxed);
    let answer = r.unwrap();
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    assert!(answer.ends_with("healthy"), "{answer}");
    assert!(
        counter(&m, REFUSED_PER_SOURCE) >= 200,
        "the per-source cap did it"
    );
    let mut opened = 0;
    for h in hogs {
        opened += h.await.unwrap();
    }
    assert!(
        opened > 200,
        "the hogs re-opened closed connections: {opened}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn many_sources_filling_the_server_do_not_lock_out_a_new_source() {
    let limits = held();
    let m = Arc::new(Metrics::new());
    let (addr, _stop) = start_counted(limits, Some(m.clone())).await;
    let stop = Arc::new(AtomicBool::new(false));
    // 20 sources × 8 connections each: more than the server's 128.
    let sources: Vec<IpAddr> = (10..30).map(local).collect();
    assert!(sources.len() * limits.max_per_source > limits.max_connections);
    let hogs: Vec<_> = sources
        .iter()
        .flat_map(|s| (0..limits.max_per_source).map(|_| hog(*s, addr, stop.clone())))
        .collect();
    // The server is full: connections have been evicted or refused 50 times.
    wait_counters(&m, &[EVICTED, REFUSED_TOTAL], 50).await;
    let r = healthz_from(local(2), addr).await;
    stop.store(true, Ordering::Relaxed);
    let answer = r.unwrap();
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    for h in hogs {
        h.await.unwrap();
    }
}
