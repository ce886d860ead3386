//! HTTP server limits on loopback (issue #16 item 8): a client that sends half a header is
//! disconnected, idle connections beyond the cap are refused, a freed slot serves again, and a
//! health-check node port applies the same limits.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::{Duration, Instant};

use kube_ipvs::http::{serve_limited, Limits};

fn router() -> axum::Router {
    axum::Router::new().route("/ok", axum::routing::get(|| async { "ok" }))
}

async fn start(limits: Limits) -> (SocketAddr, tokio::sync::oneshot::Sender<()>) {
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
    tokio::spawn(serve_limited("test", l, router(), limits, async {
        let _ = rx.await;
    }));
    (addr, tx)
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
