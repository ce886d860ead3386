//! Shared helpers for kube-ipvs's integration tests: a raw HTTP/1.1 client, free ports, running a
//! tool with input on stdin.

#![allow(dead_code, clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::net::SocketAddr;

use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// A parsed HTTP response.
#[derive(Debug)]
pub struct Response {
    pub status: u16,
    pub headers: Vec<(String, String)>,
    pub body: String,
}

impl Response {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }
    pub fn json(&self) -> serde_json::Value {
        serde_json::from_str(&self.body).unwrap_or_else(|e| panic!("{e}: {:?}", self.body))
    }
}

/// One GET request over a fresh TCP connection (`Connection: close`).
pub async fn get(addr: SocketAddr, path: &str) -> std::io::Result<Response> {
    let mut s = tokio::net::TcpStream::connect(addr).await?;
    s.write_all(
        format!("GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n").as_bytes(),
    )
    .await?;
    let mut raw = Vec::new();
    s.read_to_end(&mut raw).await?;
    let text = String::from_utf8_lossy(&raw).to_string();
    let (head, body) = text.split_once("\r\n\r\n").unwrap_or((&text, ""));
    let mut lines = head.split("\r\n");
    let status_line = lines.next().unwrap_or_default();
    let status = status_line
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0);
    let headers = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(k, v)| (k.trim().to_string(), v.trim().to_string()))
        .collect();
    Ok(Response {
        status,
        headers,
        body: body.to_string(),
    })
}

/// A TCP port that was free a moment ago on 127.0.0.1.
pub fn free_port() -> u16 {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    l.local_addr().unwrap().port()
}

/// Runs an async test body inside a fresh network namespace (on a thread that entered it), so a
/// daemon the body starts programs that namespace, never the host's. The namespace is deleted
/// afterwards, with everything the daemon programmed in it.
#[allow(dead_code)]
pub fn in_netns<F, Fut>(tag: &str, body: F)
where
    F: FnOnce() -> Fut + Send + 'static,
    Fut: std::future::Future<Output = ()>,
{
    let ns = testkit::netns::Netns::new(tag).expect("create a network namespace (needs root)");
    run_in(&ns, body);
}

/// Runs an async test body on a thread inside `ns` (a two-worker tokio runtime; threads and
/// processes it starts inherit the namespace).
pub fn run_in<F, Fut>(ns: &testkit::netns::Netns, body: F)
where
    F: FnOnce() -> Fut + Send + 'static,
    Fut: std::future::Future<Output = ()>,
{
    ns.enter(move || {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()?;
        rt.block_on(body());
        Ok(())
    })
    .expect("the test body failed inside the namespace (see its panic above)");
}

/// `sh -c CMD` in the current thread's namespace; panics unless it exits 0; its stdout.
pub fn sh(cmd: &str) -> String {
    let out = std::process::Command::new("sh")
        .args(["-c", cmd])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{cmd}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Feeds `input` to `sh -c CMD` (e.g. `ipvsadm --restore`).
pub fn sh_stdin(cmd: &str, input: &str) {
    use std::io::Write as _;
    let mut child = std::process::Command::new("sh")
        .args(["-c", cmd])
        .stdin(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    child
        .stdin
        .take()
        .unwrap()
        .write_all(input.as_bytes())
        .unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "{cmd}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// A child process (the daemon) killed and reaped when the test ends, however it ends.
pub struct Daemon(pub std::process::Child);

impl Drop for Daemon {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Polls `addr` until the body at `path` contains `want` and returns the response; the limit
/// only guards against a hang.
pub async fn wait_for(addr: SocketAddr, path: &str, want: &str) -> Response {
    for _ in 0..600 {
        if let Ok(r) = get(addr, path).await {
            if r.body.contains(want) {
                return r;
            }
        }
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
    panic!("{addr}{path} never contained {want:?}");
}
