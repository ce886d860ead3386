//! A minimal HTTP/1.1 client for driving and inspecting an API server byte by byte.
//!
//! It decodes the chunked transfer encoding itself, so tests see exactly what went over the
//! wire: each watch event, and whether a stream ended cleanly (terminating chunk) or was cut.
//! Useful where kube-rs would hide those details, and for driving the `fake-apiserver` binary
//! (REST writes, control API) from tests without a Kubernetes client.

use serde_json::Value;
use std::io;
use std::net::SocketAddr;
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::TcpStream;

/// How a streamed body ended, or why reading it failed.
#[derive(Debug, PartialEq, Eq)]
pub enum StreamEnd {
    /// Terminating zero-length chunk: the server ended the stream cleanly.
    Clean,
    /// The connection closed (or broke) mid-body.
    Aborted,
    /// A line was not valid JSON.
    BadJson(String),
}

/// A response whose body is still on the wire.
#[derive(Debug)]
pub struct RawResponse {
    /// HTTP status code.
    pub status: u16,
    /// Headers, names lower-cased.
    pub headers: Vec<(String, String)>,
    reader: BufReader<TcpStream>,
    buf: Vec<u8>,
    done: bool,
}

fn bad(msg: impl Into<String>) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, msg.into())
}

/// Send one request (`Connection: close`) and read the status line and headers.
pub async fn request(
    addr: SocketAddr,
    method: &str,
    path: &str,
    body: Option<&Value>,
) -> io::Result<RawResponse> {
    let mut stream = TcpStream::connect(addr).await?;
    let body = match body {
        Some(b) => serde_json::to_vec(b).map_err(|e| bad(e.to_string()))?,
        None => Vec::new(),
    };
    let head = format!(
        "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n",
        body.len()
    );
    stream.write_all(head.as_bytes()).await?;
    stream.write_all(&body).await?;
    let mut reader = BufReader::new(stream);
    let mut line = String::new();
    reader.read_line(&mut line).await?;
    let status = line
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| bad(format!("bad status line {line:?}")))?;
    let mut headers = Vec::new();
    loop {
        line.clear();
        if reader.read_line(&mut line).await? == 0 {
            return Err(bad("connection closed inside headers"));
        }
        let l = line.trim_end();
        if l.is_empty() {
            break;
        }
        let (k, v) = l
            .split_once(':')
            .ok_or_else(|| bad(format!("bad header {l:?}")))?;
        headers.push((k.trim().to_ascii_lowercase(), v.trim().to_string()));
    }
    Ok(RawResponse {
        status,
        headers,
        reader,
        buf: Vec::new(),
        done: false,
    })
}

/// GET `path` and parse the whole body as JSON.
pub async fn get_json(addr: SocketAddr, path: &str) -> io::Result<(u16, Value)> {
    let r = request(addr, "GET", path, None).await?;
    let status = r.status;
    Ok((status, r.json().await?))
}

impl RawResponse {
    /// A header's value.
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(h, _)| h == name)
            .map(|(_, v)| v.as_str())
    }

    fn chunked(&self) -> bool {
        self.header("transfer-encoding") == Some("chunked")
    }

    /// Read one chunk into the buffer; Ok(false) at the terminating chunk.
    async fn read_chunk(&mut self) -> Result<bool, StreamEnd> {
        let mut size = String::new();
        match self.reader.read_line(&mut size).await {
            Ok(0) | Err(_) => return Err(StreamEnd::Aborted),
            Ok(_) => {}
        }
        let n = usize::from_str_radix(size.trim(), 16).map_err(|_| StreamEnd::Aborted)?;
        if n == 0 {
            return Ok(false);
        }
        let mut data = vec![0u8; n + 2];
        self.reader
            .read_exact(&mut data)
            .await
            .map_err(|_| StreamEnd::Aborted)?;
        data.truncate(n);
        self.buf.extend_from_slice(&data);
        Ok(true)
    }

    /// The next JSON line of a chunked (watch) body.
    pub async fn next_event(&mut self) -> Result<Value, StreamEnd> {
        loop {
            if let Some(pos) = self.buf.iter().position(|b| *b == b'\n') {
                let line: Vec<u8> = self.buf.drain(..=pos).collect();
                return serde_json::from_slice(&line).map_err(|e| {
                    StreamEnd::BadJson(format!("{e}: {}", String::from_utf8_lossy(&line)))
                });
            }
            if self.done {
                return Err(StreamEnd::Clean);
            }
            if !self.read_chunk().await? {
                self.done = true;
            }
        }
    }

    /// The next event that is not a BOOKMARK.
    pub async fn next_change(&mut self) -> Result<Value, StreamEnd> {
        loop {
            let ev = self.next_event().await?;
            if ev["type"] != "BOOKMARK" {
                return Ok(ev);
            }
        }
    }

    /// The whole body as JSON (chunked or with Content-Length).
    pub async fn json(mut self) -> io::Result<Value> {
        let body = if self.chunked() {
            while self
                .read_chunk()
                .await
                .map_err(|e| bad(format!("body: {e:?}")))?
            {}
            std::mem::take(&mut self.buf)
        } else if let Some(n) = self.header("content-length") {
            let n: usize = n.parse().map_err(|_| bad("bad content-length"))?;
            let mut data = vec![0u8; n];
            self.reader.read_exact(&mut data).await?;
            data
        } else {
            let mut data = Vec::new();
            self.reader.read_to_end(&mut data).await?;
            data
        };
        serde_json::from_slice(&body).map_err(|e| bad(e.to_string()))
    }
}
