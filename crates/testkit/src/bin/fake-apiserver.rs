//! `fake-apiserver`: the testkit fake Kubernetes API server as a standalone process.
//!
//! Serves the Kubernetes REST paths on `--listen` (objects from `--fixtures` directories, or
//! empty; change them with POST/PUT/PATCH/DELETE on the normal paths) and a small control API on
//! `--control` for fault injection (the control port keeps working while the API is paused):
//!
//! | request                         | effect                                              |
//! |---------------------------------|-----------------------------------------------------|
//! | `POST /drop-watches`            | abort every open watch connection                   |
//! | `POST /close-watches`           | end every watch stream cleanly                      |
//! | `POST /expire-watches`          | send every watch a 410 ERROR event and end it       |
//! | `POST /compact`                 | forget history (older resourceVersions → 410)       |
//! | `POST /reset-history?jump=N`    | forget history, jump resourceVersion, drop watches  |
//! | `POST /pause[?seconds=N]`       | refuse connections (for N seconds, then resume)     |
//! | `POST /resume`                  | accept connections again                            |
//! | `POST /bookmarks`               | send a BOOKMARK to every watch now                  |
//! | `GET /state`                    | resourceVersion, compacted, open watches, paused     |
//! | `GET /requests`, `GET /events`  | request log, recorded Events                        |
//!
//! On start it prints `api http://ADDR` and `control http://ADDR` lines on stdout.

use axum::extract::{Query, State};
use axum::routing::{get, post};
use axum::{Json, Router};
use clap::Parser;
use serde_json::{json, Value};
use std::collections::HashMap;
use std::io::Write;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;
use testkit::apiserver::{ApiServerError, FakeApiServer};

/// A fake Kubernetes API server for tests.
#[derive(Debug, Parser)]
#[command(name = "fake-apiserver")]
struct Args {
    /// Address for the Kubernetes API (port 0 picks one).
    #[arg(long, default_value = "127.0.0.1:6443")]
    listen: SocketAddr,
    /// Address for the control API (port 0 picks one).
    #[arg(long, default_value = "127.0.0.1:0")]
    control: SocketAddr,
    /// Directory of YAML/JSON fixtures to load at start (repeatable).
    #[arg(long)]
    fixtures: Vec<PathBuf>,
    /// Write a kubeconfig pointing at the API here.
    #[arg(long)]
    kubeconfig: Option<PathBuf>,
    /// Interval between BOOKMARK events in milliseconds (0: never).
    #[arg(long, default_value_t = 1000)]
    bookmark_interval_ms: u64,
    /// Keep at most this many changes of history (older resourceVersions get 410 Gone).
    #[arg(long)]
    history_limit: Option<usize>,
}

type Srv = Arc<FakeApiServer>;

async fn drop_watches(State(s): State<Srv>) -> Json<Value> {
    Json(json!({"dropped": s.drop_watches()}))
}
async fn close_watches(State(s): State<Srv>) -> Json<Value> {
    Json(json!({"closed": s.close_watches()}))
}
async fn expire_watches(State(s): State<Srv>) -> Json<Value> {
    Json(json!({"expired": s.expire_watches()}))
}
async fn compact(State(s): State<Srv>) -> Json<Value> {
    s.compact();
    Json(json!({"compacted": s.compacted_resource_version()}))
}
async fn reset_history(State(s): State<Srv>, Query(q): Query<HashMap<String, u64>>) -> Json<Value> {
    s.reset_history(q.get("jump").copied().unwrap_or(1000));
    Json(json!({"resourceVersion": s.resource_version()}))
}
async fn pause(State(s): State<Srv>, Query(q): Query<HashMap<String, u64>>) -> Json<Value> {
    s.pause().await;
    if let Some(secs) = q.get("seconds").copied() {
        let s = s.clone();
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_secs(secs)).await;
            if let Err(e) = s.resume() {
                eprintln!("fake-apiserver: resume failed: {e}");
            }
        });
    }
    Json(json!({"paused": true}))
}
async fn resume(State(s): State<Srv>) -> Json<Value> {
    match s.resume() {
        Ok(()) => Json(json!({"paused": false})),
        Err(e) => Json(json!({"paused": true, "error": e.to_string()})),
    }
}
async fn bookmarks(State(s): State<Srv>) -> Json<Value> {
    s.send_bookmarks();
    Json(json!({}))
}
async fn state(State(s): State<Srv>) -> Json<Value> {
    Json(json!({
        "resourceVersion": s.resource_version(),
        "compacted": s.compacted_resource_version(),
        "openWatches": s.open_watches(),
        "paused": s.is_paused(),
    }))
}
async fn requests(State(s): State<Srv>) -> Json<Value> {
    let reqs: Vec<Value> = s
        .requests()
        .into_iter()
        .map(|r| json!({"method": r.method, "path": r.path, "query": r.query, "status": r.status, "watch": r.watch}))
        .collect();
    Json(Value::Array(reqs))
}
async fn events(State(s): State<Srv>) -> Json<Value> {
    Json(Value::Array(s.events()))
}

/// Why the fake API server could not start or stopped serving.
#[derive(Debug, thiserror::Error)]
enum RunError {
    /// Starting the server, loading a fixture directory or writing the kubeconfig failed.
    #[error(transparent)]
    Server(#[from] ApiServerError),
    /// The control API's address could not be bound.
    #[error("binding control {addr}: {source}")]
    BindControl {
        /// The `--control` address.
        addr: SocketAddr,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// Reading the control listener's address, installing the SIGTERM handler or serving the
    /// control API failed.
    #[error(transparent)]
    Io(#[from] std::io::Error),
}

async fn run(args: Args) -> Result<(), RunError> {
    let server = FakeApiServer::start_on(args.listen).await?;
    server.set_bookmark_interval(
        (args.bookmark_interval_ms > 0).then(|| Duration::from_millis(args.bookmark_interval_ms)),
    );
    if let Some(n) = args.history_limit {
        server.set_history_limit(n);
    }
    for dir in &args.fixtures {
        server.load_dir(dir)?;
    }
    if let Some(path) = &args.kubeconfig {
        server.write_kubeconfig(path)?;
    }
    let server: Srv = Arc::new(server);
    let control = tokio::net::TcpListener::bind(args.control)
        .await
        .map_err(|source| RunError::BindControl {
            addr: args.control,
            source,
        })?;
    let control_addr = control.local_addr()?;
    let app = Router::new()
        .route("/drop-watches", post(drop_watches))
        .route("/close-watches", post(close_watches))
        .route("/expire-watches", post(expire_watches))
        .route("/compact", post(compact))
        .route("/reset-history", post(reset_history))
        .route("/pause", post(pause))
        .route("/resume", post(resume))
        .route("/bookmarks", post(bookmarks))
        .route("/state", get(state))
        .route("/requests", get(requests))
        .route("/events", get(events))
        .with_state(server.clone());
    {
        let mut out = std::io::stdout().lock();
        let _ = writeln!(out, "api {}", server.url());
        let _ = writeln!(out, "control http://{control_addr}");
        let _ = out.flush();
    }
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
    tokio::select! {
        r = axum::serve(control, app) => r?,
        _ = tokio::signal::ctrl_c() => {}
        _ = term.recv() => {}
    }
    Ok(())
}

#[tokio::main]
async fn main() -> std::process::ExitCode {
    match run(Args::parse()).await {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("fake-apiserver: {e}");
            std::process::ExitCode::FAILURE
        }
    }
}
