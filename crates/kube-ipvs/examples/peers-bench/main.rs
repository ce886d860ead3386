//! Driver of `cargo xtask bench peers` (issue #34): kube-ipvs against upstream kube-proxy on the
//! same objects of a real kube-apiserver, each proxy started from an empty node in one VM.
//!
//! ```text
//! peers-bench host SERVICES ENDPOINTS
//!     (on the host) starts etcd + kube-apiserver (testkit's control plane), creates the
//!     namespace, the node and SERVICES Services with one EndpointSlice of ENDPOINTS endpoints
//!     each (in parallel, timed), writes a kubeconfig naming the VM's forwarded address, prints
//!     one `PEERS-READY {...}` line and keeps the control plane until its stdin closes
//! peers-bench guest KUBECONFIG SERVICES ENDPOINTS PROXIES [OPTION=VALUE...]
//!     (in the VM, root) for each proxy of the comma-separated PROXIES, one after the other:
//!     empties the node, starts the proxy, measures, stops it and puts the touched
//!     EndpointSlices back; prints one `BENCH-JSON {...}` line per proxy.
//!     Options: cap=SECS (1200) changes=K (30) churn-rate=PER_S (20) churn-secs=S (60)
//!     kube-proxy=PATH (/k/kube-proxy) kube-ipvs=PATH (/k/kube-ipvs) min-sync-ms=MS (1000)
//! ```
//!
//! What each figure means and how it is observed is in `docs/benchmarks.md` ("Against the
//! peers"); [`guest`] has the sequence, [`kernel`] the per-mode counting and change checks.

mod guest;
mod host;
mod kernel;
mod nft;
mod objects;

use std::process::ExitCode;

/// What can go wrong; every error ends the run (a proxy's own failure is a result, not an
/// error: its row says `converged: false`).
#[derive(Debug, thiserror::Error)]
pub enum BenchError {
    #[error("usage: {0}")]
    Usage(String),
    #[error("{what}: {source}")]
    Io {
        what: String,
        source: std::io::Error,
    },
    #[error(transparent)]
    Run(#[from] testkit::bench::CommandError),
    #[error("control plane: {0}")]
    ControlPlane(#[from] testkit::control_plane::ControlPlaneError),
    #[error("API: {0}")]
    Api(String),
    #[error("IPVS: {0}")]
    Ipvs(#[from] ipvs_netlink::Error),
    #[error("netlink: {0}")]
    Netlink(#[from] netlink::Error),
    #[error("system call: {0}")]
    Sys(#[from] nix::Error),
    #[error("{0}")]
    Check(String),
}

pub type Res<T> = Result<T, BenchError>;

/// Maps an IO error with what was being done.
pub fn io<E: Into<std::io::Error>>(what: impl Into<String>) -> impl FnOnce(E) -> BenchError {
    let what = what.into();
    move |e| BenchError::Io {
        what,
        source: e.into(),
    }
}

/// A kube error as [`BenchError::Api`].
pub fn api(what: &str) -> impl FnOnce(kube::Error) -> BenchError + '_ {
    move |e| BenchError::Api(format!("{what}: {e}"))
}

/// A client for the kubeconfig at `path`.
pub async fn client(path: &str) -> Res<kube::Client> {
    let kc = kube::config::Kubeconfig::read_from(path)
        .map_err(|e| BenchError::Api(format!("reading {path}: {e}")))?;
    let cfg = kube::Config::from_custom_kubeconfig(kc, &kube::config::KubeConfigOptions::default())
        .await
        .map_err(|e| BenchError::Api(format!("kubeconfig {path}: {e}")))?;
    kube::Client::try_from(cfg).map_err(api("client"))
}

fn num(s: &str) -> Res<usize> {
    s.replace('_', "")
        .parse()
        .map_err(|_| BenchError::Usage(format!("not a number: {s}")))
}

fn usage() -> BenchError {
    BenchError::Usage(
        "peers-bench host SERVICES ENDPOINTS | guest KUBECONFIG SERVICES ENDPOINTS PROXIES [OPTION=VALUE...]"
            .into(),
    )
}

fn dispatch(args: &[String]) -> Res<()> {
    let a: Vec<&str> = args.iter().map(String::as_str).collect();
    let sizes = |n: &str, m: &str| -> Res<(usize, usize)> {
        let (n, m) = (num(n)?, num(m)?);
        if n == 0 || m == 0 || n * m > objects::MAX_ENDPOINTS || n > 200_000 {
            return Err(BenchError::Usage(format!(
                "SERVICES >= 1, ENDPOINTS >= 1, SERVICES x ENDPOINTS <= {}",
                objects::MAX_ENDPOINTS
            )));
        }
        Ok((n, m))
    };
    match a.as_slice() {
        ["host", n, m] => {
            let (n, m) = sizes(n, m)?;
            host::run(n, m)
        }
        ["guest", kc, n, m, proxies, opts @ ..] => {
            let (n, m) = sizes(n, m)?;
            let mut o = guest::Options::new(kc, n, m);
            for p in proxies.split(',').filter(|p| !p.is_empty()) {
                o.proxies.push(guest::Proxy::parse(p)?);
            }
            for kv in opts {
                let (k, v) = kv.split_once('=').ok_or_else(usage)?;
                match k {
                    "cap" => o.cap = std::time::Duration::from_secs(num(v)? as u64),
                    "changes" => o.changes = num(v)?,
                    "churn-rate" => o.churn_rate = num(v)?,
                    "churn-secs" => o.churn_secs = num(v)?,
                    "kube-proxy" => o.kube_proxy = v.to_string(),
                    "kube-ipvs" => o.kube_ipvs = v.to_string(),
                    "min-sync-ms" => o.min_sync = std::time::Duration::from_millis(num(v)? as u64),
                    _ => return Err(usage()),
                }
            }
            guest::run(&o)
        }
        _ => Err(usage()),
    }
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    match dispatch(&args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("peers-bench: {e}");
            ExitCode::FAILURE
        }
    }
}
