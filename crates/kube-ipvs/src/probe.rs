//! Can IPVS mode run on this node? Decided at start without ever tearing a working node down.
//!
//! - [`probe_with`] classifies the probe (upstream kube-proxy's `canUseIPVSProxier` in
//!   `pkg/proxy/ipvs/proxier.go`: create and delete a virtual server 198.51.100.0:20000/TCP with
//!   the configured scheduler) into [`ProbeError::Absent`] (the "IPVS" generic netlink family does
//!   not resolve and `modprobe -- ip_vs` does not make it resolve), [`ProbeError::SchedulerMissing`]
//!   (the kernel answers ENOENT for the scheduler and `modprobe -- ip_vs_SCHED` does not help) and
//!   [`ProbeError::Transient`] (everything else: EBUSY, EPERM from a seccomp profile, ENOMEM, a
//!   timeout, a malformed reply). Loading the modules with `modprobe` first is what upstream did
//!   before 1.26 (`LinuxKernelHandler.GetModules`: `modprobe -- MODULE` for each module IPVS mode
//!   needs, the scheduler's `ip_vs_SCHED` included); since then it relies on the kernel's
//!   autoload, which `modprobe` here only backs up.
//! - [`decide`]: absent or scheduler-less IPVS falls back to iptables mode (pre-1.26 upstream
//!   fell back when a module was missing; since 1.26 it exits, which `--ipvs-fallback=false`
//!   selects); a transient error is retried and never falls back; IPVS state already on the node
//!   (kube-ipvs0, owned virtual servers) is a strong signal to stay, like upstream's check that a
//!   virtual server with the configured scheduler exists ("most likely a kube-proxy re-start").
//! - [`select_mode`]: the daemon's loop around both: retries with jittered exponential backoff
//!   (1 s doubling to 30 s) for as long as it takes, a warning and
//!   `kube_ipvs_ipvs_probe_failures_total{kind}` per failed attempt, `/healthz` and `/livez` 503
//!   with the reason until the probe succeeds. Nothing is removed meanwhile.
//! - The test-only fault hook `KUBE_IPVS_FAULT_PROBE` ([`FaultPlan`]) makes the real binary's
//!   probe fail on purpose; inert unless set, logged loudly when set.

use std::collections::hash_map::RandomState;
use std::hash::{BuildHasher, Hasher};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use ipvs_netlink::error::libc_errno;
use ipvs_netlink::{Family, Op, Protocol, Service, ServiceKey};

use crate::config::{Config, ProxyMode};
use crate::error::{Error, FieldError};

/// The environment variable of the test-only probe fault hook.
pub const FAULT_ENV: &str = "KUBE_IPVS_FAULT_PROBE";
/// The address upstream kube-proxy probes IPVS with (TEST-NET-2, never a real service).
const PROBE_ADDR: std::net::IpAddr = std::net::IpAddr::V4(std::net::Ipv4Addr::new(198, 51, 100, 0));
/// The port of the probe virtual server.
const PROBE_PORT: u16 = 20000;
/// How long one `modprobe` may take before it is killed (and counts as failed).
pub const MODPROBE_TIMEOUT: Duration = Duration::from_secs(10);
/// First retry delay of a failed probe.
pub const BACKOFF_BASE: Duration = Duration::from_secs(1);
/// Longest retry delay of a failed probe.
pub const BACKOFF_MAX: Duration = Duration::from_secs(30);

/// What `modprobe -- MODULE` did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ModuleLoad {
    /// It exited 0.
    Loaded,
    /// There is no `modprobe` to run (not found, not executable).
    NoModprobe,
    /// It exited non-zero (the code; `None` when killed by a signal).
    Failed(Option<i32>),
    /// It ran longer than [`MODPROBE_TIMEOUT`] and was killed.
    TimedOut,
}

impl std::fmt::Display for ModuleLoad {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ModuleLoad::Loaded => f.write_str("modprobe succeeded"),
            ModuleLoad::NoModprobe => f.write_str("no modprobe to run"),
            ModuleLoad::Failed(Some(c)) => write!(f, "modprobe failed with exit code {c}"),
            ModuleLoad::Failed(None) => f.write_str("modprobe was killed by a signal"),
            ModuleLoad::TimedOut => write!(f, "modprobe timed out after {MODPROBE_TIMEOUT:?}"),
        }
    }
}

/// Runs `modprobe -- module` as a child process, killed after `timeout`.
pub fn modprobe(module: &str, timeout: Duration) -> ModuleLoad {
    run_tool("modprobe", module, timeout)
}

/// Runs `program -- arg`, killed after `timeout`.
fn run_tool(program: &str, arg: &str, timeout: Duration) -> ModuleLoad {
    let module = arg;
    let child = Command::new(program)
        .args(["--", arg])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn();
    let mut child = match child {
        Ok(c) => c,
        Err(e) => {
            tracing::debug!(module, error = %e, "cannot run {program}");
            return ModuleLoad::NoModprobe;
        }
    };
    let start = Instant::now();
    loop {
        match child.try_wait() {
            Ok(Some(status)) if status.success() => return ModuleLoad::Loaded,
            Ok(Some(status)) => return ModuleLoad::Failed(status.code()),
            Ok(None) if start.elapsed() >= timeout => {
                let _ = child.kill();
                let _ = child.wait();
                return ModuleLoad::TimedOut;
            }
            Ok(None) => std::thread::sleep(Duration::from_millis(20)),
            Err(_) => {
                let _ = child.kill();
                let _ = child.wait();
                return ModuleLoad::Failed(None);
            }
        }
    }
}

/// The probe step that failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ProbeStep {
    /// Opening the generic netlink socket and resolving the "IPVS" family.
    Open,
    /// Creating (and deleting) the probe virtual server.
    VirtualServer,
    /// Reading the node's IPVS state (kube-ipvs0, owned virtual servers).
    State,
}

impl std::fmt::Display for ProbeStep {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            ProbeStep::Open => "opening IPVS (generic netlink)",
            ProbeStep::VirtualServer => "creating the probe virtual server",
            ProbeStep::State => "reading the node's IPVS state",
        })
    }
}

/// A probe failure that says nothing about whether IPVS exists: retried, never a fallback.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{step}: {detail}")]
pub struct Transient {
    /// Where it failed.
    pub step: ProbeStep,
    /// The errno, when the kernel or a socket call gave one (`None`: a protocol-level failure
    /// such as a truncated, malformed or missing reply).
    pub errno: Option<i32>,
    /// The error's text, for the log.
    pub detail: String,
}

impl Transient {
    fn of(step: ProbeStep, e: &ipvs_netlink::Error) -> Transient {
        let errno = match e {
            ipvs_netlink::Error::Kernel { errno, .. } => Some(*errno),
            ipvs_netlink::Error::Io { source, .. } => source.raw_os_error(),
            _ => None,
        };
        Transient {
            step,
            errno,
            detail: e.to_string(),
        }
    }
}

/// Why the IPVS probe failed, classified.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ProbeError {
    /// IPVS is not in this kernel: the "IPVS" generic netlink family does not resolve, and
    /// `modprobe -- ip_vs` did not change that.
    #[error(
        "IPVS is absent: the \"IPVS\" generic netlink family does not resolve ({0} for ip_vs)"
    )]
    Absent(ModuleLoad),
    /// IPVS is there but has no scheduler of this name: creating a virtual server with it gives
    /// ENOENT, also after `modprobe -- ip_vs_SCHED`.
    #[error("IPVS has no scheduler {scheduler:?} (creating a virtual server with it: ENOENT; {module} for ip_vs_{scheduler})")]
    SchedulerMissing {
        /// The configured scheduler.
        scheduler: String,
        /// What `modprobe` of its module did.
        module: ModuleLoad,
    },
    /// Anything else; retried with backoff.
    #[error("transient IPVS probe failure: {0}")]
    Transient(Transient),
}

impl ProbeError {
    /// A bounded metric label: `absent`, `scheduler_missing`, an errno name from a fixed set
    /// (`ebusy`, `eperm`, `eacces`, `enomem`, `enobufs`, `etimedout`, `eagain`, `eintr`),
    /// `errno` for any other errno, `protocol` without one.
    pub fn kind(&self) -> &'static str {
        match self {
            ProbeError::Absent(_) => "absent",
            ProbeError::SchedulerMissing { .. } => "scheduler_missing",
            ProbeError::Transient(t) => match t.errno {
                None => "protocol",
                Some(e) => errno_name(e).unwrap_or("errno"),
            },
        }
    }
}

/// Errno names the probe reports (Linux numbers).
const ERRNOS: [(&str, i32); 8] = [
    ("eperm", 1),
    ("eintr", 4),
    ("eagain", 11),
    ("enomem", 12),
    ("eacces", 13),
    ("ebusy", 16),
    ("enobufs", 105),
    ("etimedout", 110),
];

/// Every value [`ProbeError::kind`] can take.
pub fn kinds() -> impl Iterator<Item = &'static str> {
    ["absent", "scheduler_missing", "errno", "protocol"]
        .into_iter()
        .chain(ERRNOS.iter().map(|(name, _)| *name))
}

fn errno_name(errno: i32) -> Option<&'static str> {
    ERRNOS.iter().find(|(_, n)| *n == errno).map(|(s, _)| *s)
}

/// Probes IPVS with injectable steps: `open` opens a client (resolving the family), `create`
/// creates and deletes the probe virtual server with the scheduler, `modprobe` loads a module.
/// When the family is missing, `modprobe ip_vs` runs and the family is resolved again; when the
/// kernel answers ENOENT for the virtual server (its answer for an unknown scheduler),
/// `modprobe ip_vs_SCHED` runs and the virtual server is tried again.
pub fn probe_with<C>(
    scheduler: &str,
    mut open: impl FnMut() -> Result<C, ipvs_netlink::Error>,
    mut create: impl FnMut(&mut C, &str) -> Result<(), ipvs_netlink::Error>,
    mut modprobe: impl FnMut(&str) -> ModuleLoad,
) -> Result<(), ProbeError> {
    let mut client = match open() {
        Ok(c) => c,
        Err(ipvs_netlink::Error::FamilyMissing) => {
            let module = modprobe("ip_vs");
            match open() {
                Ok(c) => c,
                Err(ipvs_netlink::Error::FamilyMissing) => return Err(ProbeError::Absent(module)),
                Err(e) => return Err(ProbeError::Transient(Transient::of(ProbeStep::Open, &e))),
            }
        }
        Err(e) => return Err(ProbeError::Transient(Transient::of(ProbeStep::Open, &e))),
    };
    let scheduler_missing = |e: &ipvs_netlink::Error| {
        e.errno() == Some(libc_errno::ENOENT) || matches!(e, ipvs_netlink::Error::Invalid(_))
    };
    match create(&mut client, scheduler) {
        Ok(()) => Ok(()),
        Err(e) if scheduler_missing(&e) => {
            let module = modprobe(&format!("ip_vs_{scheduler}"));
            match create(&mut client, scheduler) {
                Ok(()) => Ok(()),
                Err(e) if scheduler_missing(&e) => Err(ProbeError::SchedulerMissing {
                    scheduler: scheduler.to_string(),
                    module,
                }),
                Err(e) => Err(ProbeError::Transient(Transient::of(
                    ProbeStep::VirtualServer,
                    &e,
                ))),
            }
        }
        Err(e) => Err(ProbeError::Transient(Transient::of(
            ProbeStep::VirtualServer,
            &e,
        ))),
    }
}

/// Creates and deletes the probe virtual server (EEXIST: one left by a crash, deleted now).
fn create_probe_service(
    client: &mut ipvs_netlink::Client,
    scheduler: &str,
) -> Result<(), ipvs_netlink::Error> {
    let key = ServiceKey::Inet {
        protocol: Protocol::Tcp,
        addr: PROBE_ADDR,
        port: PROBE_PORT,
    };
    let svc = Service::new(key, scheduler);
    let mut results = client
        .apply(&[Op::NewService(svc), Op::DelService(key)])
        .into_iter();
    match results.next() {
        Some(Ok(())) | None => Ok(()),
        Some(Err(e)) if e.is_exists() => Ok(()),
        Some(Err(e)) => Err(e),
    }
}

/// The real probe against this kernel.
pub fn probe_kernel(scheduler: &str) -> Result<(), ProbeError> {
    probe_with(
        scheduler,
        ipvs_netlink::Client::new,
        create_probe_service,
        |m| modprobe(m, MODPROBE_TIMEOUT),
    )
}

/// IPVS-mode state found on the node (what a previous run left programmed).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct NodeIpvsState {
    /// kube-ipvs0 exists.
    pub dummy_link: bool,
    /// Virtual servers kube-ipvs would own (any family).
    pub owned_services: usize,
}

impl NodeIpvsState {
    /// Anything there at all.
    pub fn present(&self) -> bool {
        self.dummy_link || self.owned_services > 0
    }
}

/// What to do with a probe result.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Decision {
    /// Run in IPVS mode.
    Ipvs,
    /// Probe again after a backoff; nothing is torn down.
    Retry,
    /// Run in iptables mode (IPVS-mode leftovers go only after its first successful sync).
    Fallback,
    /// Exit with an error (`--ipvs-fallback=false`); nothing is torn down.
    Fail,
}

/// The decision for one probe result. `state` is the node's IPVS-mode state, `None` when it
/// could not be read (it is read only for [`ProbeError::Absent`] and
/// [`ProbeError::SchedulerMissing`]).
///
/// - A transient error is retried, whatever the state and `--ipvs-fallback` say.
/// - Absent IPVS with owned virtual servers cannot be (listing them needs the family the probe
///   did not find): the contradiction is retried. Absent IPVS with only kube-ipvs0 left (the
///   module was removed, which removed every virtual server) routes nothing, so it does not
///   hold the fallback back: staying would leave the node's Services down for good.
/// - A missing scheduler with IPVS state on the node is retried: the node was serving in IPVS
///   mode (e.g. `ipvs.scheduler` was changed to one this kernel lacks), and falling back would
///   replace a working data path. Without state it falls back.
/// - State that could not be read is treated as present.
pub fn decide(
    result: &Result<(), ProbeError>,
    state: Option<NodeIpvsState>,
    fallback: bool,
) -> Decision {
    let give_up = if fallback {
        Decision::Fallback
    } else {
        Decision::Fail
    };
    match result {
        Ok(()) => Decision::Ipvs,
        Err(ProbeError::Transient(_)) => Decision::Retry,
        Err(ProbeError::Absent(_)) => match state {
            Some(s) if s.owned_services == 0 => give_up,
            _ => Decision::Retry,
        },
        Err(ProbeError::SchedulerMissing { .. }) => match state {
            Some(s) if !s.present() => give_up,
            _ => Decision::Retry,
        },
    }
}

/// The delay before retry number `attempt` (1-based): `base` doubling up to `max`, then
/// jittered by up to ±20 % (`jitter` in 0.0..=1.0 maps to -20 %..+20 %), never above `max`.
pub fn backoff(attempt: u32, base: Duration, max: Duration, jitter: f64) -> Duration {
    let doublings = attempt.saturating_sub(1).min(30);
    let plain = base.saturating_mul(1u32 << doublings).min(max);
    let factor = 0.8 + 0.4 * jitter.clamp(0.0, 1.0);
    plain.mul_f64(factor).min(max)
}

/// A number in 0.0..=1.0 that differs between calls and processes (for jitter only).
fn jitter() -> f64 {
    let mut h = RandomState::new().build_hasher();
    h.write_u128(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap_or_default()
            .as_nanos(),
    );
    (h.finish() % 10_001) as f64 / 10_000.0
}

/// A fault the test hook injects instead of probing.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum InjectedFault {
    /// A transient failure with this errno (opening IPVS).
    Errno(i32),
    /// IPVS absent (the family does not resolve and the module cannot be loaded); the node's
    /// state is then read as a kernel without IPVS would show it (no virtual servers).
    Absent,
    /// The scheduler is missing.
    SchedulerMissing,
}

/// The test-only probe fault hook, from `KUBE_IPVS_FAULT_PROBE=KIND[:N]`: KIND is an errno
/// name (`ebusy`, `eperm`, `eacces`, `enomem`, `enobufs`, `etimedout`, `eagain`, `eintr`),
/// `absent` or `scheduler`; the first N probes fail that way (every probe without `:N`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FaultPlan {
    /// What is injected.
    pub fault: InjectedFault,
    /// How many more probes fail (`None`: all).
    pub remaining: Option<u32>,
}

impl std::str::FromStr for FaultPlan {
    type Err = FieldError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let bad = |message: String| FieldError {
            field: FAULT_ENV.to_string(),
            message,
        };
        let (kind, count) = match s.split_once(':') {
            Some((k, n)) => (
                k,
                Some(
                    n.parse::<u32>()
                        .map_err(|e| bad(format!("count {n:?}: {e}")))?,
                ),
            ),
            None => (s, None),
        };
        let fault = match kind {
            "absent" => InjectedFault::Absent,
            "scheduler" => InjectedFault::SchedulerMissing,
            k => match ERRNOS.iter().find(|(name, _)| *name == k) {
                Some((_, errno)) => InjectedFault::Errno(*errno),
                None => {
                    return Err(bad(format!(
                        "unknown fault {k:?} (absent, scheduler, or one of {})",
                        ERRNOS.map(|(n, _)| n).join(", ")
                    )))
                }
            },
        };
        Ok(FaultPlan {
            fault,
            remaining: count,
        })
    }
}

/// The probe as the daemon runs it: the kernel probe, or the hook's fault while it lasts.
#[derive(Debug)]
pub struct Prober {
    scheduler: String,
    fault: Option<FaultPlan>,
}

impl Prober {
    /// A prober for `scheduler`, with the fault hook from the environment (an invalid value is
    /// a configuration error).
    pub fn from_env(scheduler: &str) -> Result<Prober, Error> {
        let fault = match std::env::var(FAULT_ENV) {
            Ok(v) => {
                let plan: FaultPlan = v.parse().map_err(|e| Error::InvalidConfig(vec![e]))?;
                tracing::warn!(
                    "TEST HOOK ACTIVE: {FAULT_ENV}={v}: IPVS probes fail on purpose ({plan:?}); \
                     never set this outside tests"
                );
                Some(plan)
            }
            Err(_) => None,
        };
        Ok(Prober::new(scheduler, fault))
    }

    /// A prober with an explicit fault plan.
    pub fn new(scheduler: &str, fault: Option<FaultPlan>) -> Prober {
        Prober {
            scheduler: scheduler.to_string(),
            fault,
        }
    }

    /// The injected fault of the next probe, consuming one.
    fn take_fault(&mut self) -> Option<InjectedFault> {
        let plan = self.fault.as_mut()?;
        match &mut plan.remaining {
            Some(0) => None,
            Some(n) => {
                *n -= 1;
                Some(plan.fault)
            }
            None => Some(plan.fault),
        }
    }

    /// One probe: blocking (netlink, `modprobe`). The flag is true when the hook injected
    /// [`InjectedFault::Absent`] (the node's state is then read as without IPVS).
    pub fn probe(&mut self) -> (Result<(), ProbeError>, bool) {
        match self.take_fault() {
            Some(InjectedFault::Errno(errno)) => (
                Err(ProbeError::Transient(Transient {
                    step: ProbeStep::Open,
                    errno: Some(errno),
                    detail: format!(
                        "{} (injected by {FAULT_ENV})",
                        std::io::Error::from_raw_os_error(errno)
                    ),
                })),
                false,
            ),
            Some(InjectedFault::Absent) => (Err(ProbeError::Absent(ModuleLoad::NoModprobe)), true),
            Some(InjectedFault::SchedulerMissing) => (
                Err(ProbeError::SchedulerMissing {
                    scheduler: self.scheduler.clone(),
                    module: ModuleLoad::NoModprobe,
                }),
                false,
            ),
            None => (probe_kernel(&self.scheduler), false),
        }
    }
}

/// Reads the node's IPVS-mode state: kube-ipvs0 and the virtual servers kube-ipvs owns (of
/// both families, minus `ipvs.excludeCIDRs`). `ipvs_absent` reads it as a kernel without IPVS
/// shows it (the fault hook's `absent`). An error reading either is a transient failure.
pub async fn read_state(config: &Config, ipvs_absent: bool) -> Result<NodeIpvsState, Transient> {
    let transient = |detail: String| Transient {
        step: ProbeStep::State,
        errno: None,
        detail,
    };
    let netif = netif::Netif::new()
        .await
        .map_err(|e| transient(format!("kube-ipvs0: {e}")))?;
    let dummy_link = netif
        .lookup()
        .await
        .map_err(|e| transient(format!("kube-ipvs0: {e}")))?
        .is_some();
    if ipvs_absent {
        return Ok(NodeIpvsState {
            dummy_link,
            owned_services: 0,
        });
    }
    let services = tokio::task::block_in_place(|| {
        let mut client = match ipvs_netlink::Client::new() {
            Ok(c) => c,
            Err(ipvs_netlink::Error::FamilyMissing) => return Ok(Vec::new()),
            Err(e) => return Err(Transient::of(ProbeStep::State, &e)),
        };
        client
            .services()
            .map_err(|e| Transient::of(ProbeStep::State, &e))
    })?;
    let cfgs = [Family::Inet, Family::Inet6].map(|f| crate::engine::proxy_config(config, f));
    let owned_services = services
        .iter()
        .filter(|s| cfgs.iter().any(|c| desired::owned_by_proxy(c)(&s.key)))
        .count();
    Ok(NodeIpvsState {
        dummy_link,
        owned_services,
    })
}

/// The mode selection's outcome.
#[derive(Debug)]
pub enum Selected {
    /// Run in this mode; with the probe error that caused a fallback.
    Mode(ProxyMode, Option<ProbeError>),
    /// A shutdown signal came while probing.
    Stopped,
}

/// Selects the mode for a daemon asked to run in IPVS mode: probes until [`decide`] says IPVS,
/// fallback or fail, retrying with [`backoff`] meanwhile. Every failed attempt logs a warning
/// and counts in `kube_ipvs_ipvs_probe_failures_total{kind}`; while it retries, the health
/// server answers 503 with the reason. `stop` ends it early (a shutdown signal).
pub async fn select_mode(
    config: &Config,
    mut prober: Prober,
    health: &crate::health::ProxyHealth,
    metrics: &crate::metrics::Metrics,
    stop: &mut (impl std::future::Future<Output = &'static str> + Unpin),
) -> Result<Selected, Error> {
    let mut attempt: u32 = 0;
    let since = std::time::SystemTime::now();
    loop {
        attempt += 1;
        let (result, absent_injected) = tokio::task::block_in_place(|| prober.probe());
        let state = match &result {
            Ok(()) | Err(ProbeError::Transient(_)) => None,
            Err(_) => match read_state(config, absent_injected).await {
                Ok(s) => Some(s),
                Err(e) => {
                    tracing::warn!(error = %e, "cannot read the node's IPVS state; treating it as present");
                    None
                }
            },
        };
        let decision = decide(&result, state, config.ipvs_fallback);
        match (decision, result) {
            (Decision::Ipvs, _) => {
                if attempt > 1 {
                    tracing::info!(attempt, "IPVS probe succeeded; running in IPVS mode");
                }
                health.set_blocked(None);
                return Ok(Selected::Mode(ProxyMode::Ipvs, None));
            }
            (Decision::Fallback, Err(e)) => {
                // Counted by the caller, in the metrics of the iptables-mode daemon.
                tracing::warn!(
                    reason = %e,
                    state = ?state,
                    "IPVS IS NOT USABLE: FALLING BACK TO IPTABLES MODE (set --ipvs-fallback=false \
                     to fail instead); IPVS-mode state is removed only after the first successful \
                     iptables-mode sync"
                );
                health.set_blocked(None);
                return Ok(Selected::Mode(ProxyMode::Iptables, Some(e)));
            }
            (Decision::Fail, Err(e)) => {
                metrics.record_probe_failure(e.kind());
                health.set_blocked(None);
                return Err(Error::IpvsUnavailable {
                    reason: e.to_string(),
                });
            }
            (Decision::Retry, Err(e)) => {
                metrics.record_probe_failure(e.kind());
                let delay = backoff(attempt, BACKOFF_BASE, BACKOFF_MAX, jitter());
                let reason = format!(
                    "IPVS probe failing since {} (attempt {attempt}): {e}",
                    crate::health::rfc3339(Some(since))
                );
                health.set_blocked(Some(reason));
                tracing::warn!(
                    attempt,
                    kind = e.kind(),
                    error = %e,
                    state = ?state,
                    retry_in = ?delay,
                    "IPVS PROBE FAILED: retrying; nothing is removed and no fallback happens \
                     meanwhile (/healthz answers 503)"
                );
                tokio::select! {
                    _ = tokio::time::sleep(delay) => {}
                    sig = &mut *stop => {
                        tracing::info!("{sig}: stopping while the IPVS probe was failing (nothing was changed)");
                        return Ok(Selected::Stopped);
                    }
                }
            }
            (d, Ok(())) => {
                // decide() answers Ipvs for every Ok; this arm only keeps the match total.
                tracing::debug!(decision = ?d, "probe succeeded");
                health.set_blocked(None);
                return Ok(Selected::Mode(ProxyMode::Ipvs, None));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn kernel(errno: i32) -> ipvs_netlink::Error {
        ipvs_netlink::Error::Kernel {
            op: ipvs_netlink::error::OpKind::NewService,
            errno,
        }
    }

    /// Runs [`probe_with`] over scripted answers; returns the result and the modules loaded.
    fn run(
        opens: Vec<Result<(), ipvs_netlink::Error>>,
        creates: Vec<Result<(), ipvs_netlink::Error>>,
        module: ModuleLoad,
    ) -> (Result<(), ProbeError>, Vec<String>) {
        let mut opens = opens.into_iter();
        let mut creates = creates.into_iter();
        let mut loaded = Vec::new();
        let r = probe_with(
            "rr",
            || opens.next().expect("an unexpected open"),
            |_: &mut (), s| {
                assert_eq!(s, "rr");
                creates.next().expect("an unexpected create")
            },
            |m| {
                loaded.push(m.to_string());
                module
            },
        );
        (r, loaded)
    }

    #[test]
    fn absent_only_when_the_family_stays_missing_after_modprobe() {
        use ipvs_netlink::Error::FamilyMissing;
        // Missing, modprobe fails, still missing: absent.
        let (r, loaded) = run(
            vec![Err(FamilyMissing), Err(FamilyMissing)],
            vec![],
            ModuleLoad::Failed(Some(1)),
        );
        assert_eq!(r, Err(ProbeError::Absent(ModuleLoad::Failed(Some(1)))));
        assert_eq!(loaded, ["ip_vs"]);
        // No modprobe binary counts as "cannot be loaded" too.
        let (r, _) = run(
            vec![Err(FamilyMissing), Err(FamilyMissing)],
            vec![],
            ModuleLoad::NoModprobe,
        );
        assert_eq!(r.unwrap_err().kind(), "absent");
        // modprobe loads it: the family resolves and the probe goes on.
        let (r, loaded) = run(
            vec![Err(FamilyMissing), Ok(())],
            vec![Ok(())],
            ModuleLoad::Loaded,
        );
        assert_eq!(r, Ok(()));
        assert_eq!(loaded, ["ip_vs"]);
        // The re-resolve fails otherwise: transient, not absent.
        let (r, _) = run(
            vec![Err(FamilyMissing), Err(kernel(16))],
            vec![],
            ModuleLoad::Loaded,
        );
        assert_eq!(r.unwrap_err().kind(), "ebusy");
    }

    #[test]
    fn every_other_open_error_is_transient() {
        for (errno, kind) in [
            (16, "ebusy"),
            (1, "eperm"),
            (12, "enomem"),
            (110, "etimedout"),
        ] {
            let (r, loaded) = run(vec![Err(kernel(errno))], vec![], ModuleLoad::Loaded);
            let e = r.unwrap_err();
            assert!(matches!(e, ProbeError::Transient(_)), "{e:?}");
            assert_eq!(e.kind(), kind);
            assert!(loaded.is_empty(), "no modprobe for a transient error");
        }
        // A socket error (EPERM from a seccomp profile at socket()) keeps its errno.
        let io = ipvs_netlink::Error::Io {
            what: "connect",
            source: std::io::Error::from_raw_os_error(1),
        };
        let (r, _) = run(vec![Err(io)], vec![], ModuleLoad::Loaded);
        assert_eq!(r.unwrap_err().kind(), "eperm");
        // A reply that never came: transient, without an errno.
        let no_reply = ipvs_netlink::Error::NoReply {
            op: ipvs_netlink::error::OpKind::ResolveFamily,
        };
        let (r, _) = run(vec![Err(no_reply)], vec![], ModuleLoad::Loaded);
        assert_eq!(r.unwrap_err().kind(), "protocol");
        // An unknown errno gets the catch-all label (bounded cardinality).
        let (r, _) = run(vec![Err(kernel(99))], vec![], ModuleLoad::Loaded);
        assert_eq!(r.unwrap_err().kind(), "errno");
    }

    #[test]
    fn scheduler_missing_only_after_modprobe_of_its_module() {
        let (r, loaded) = run(
            vec![Ok(())],
            vec![Err(kernel(2)), Err(kernel(2))],
            ModuleLoad::Failed(Some(1)),
        );
        assert_eq!(
            r,
            Err(ProbeError::SchedulerMissing {
                scheduler: "rr".into(),
                module: ModuleLoad::Failed(Some(1)),
            })
        );
        assert_eq!(loaded, ["ip_vs_rr"]);
        // The module loads: IPVS is usable.
        let (r, _) = run(
            vec![Ok(())],
            vec![Err(kernel(2)), Ok(())],
            ModuleLoad::Loaded,
        );
        assert_eq!(r, Ok(()));
        // Other virtual-server errors are transient (EBUSY, ENOMEM).
        for errno in [16, 12] {
            let (r, loaded) = run(vec![Ok(())], vec![Err(kernel(errno))], ModuleLoad::Loaded);
            assert!(matches!(r, Err(ProbeError::Transient(_))), "{r:?}");
            assert!(loaded.is_empty());
        }
    }

    #[test]
    fn every_kind_is_in_the_fixed_label_set() {
        let all: Vec<&str> = kinds().collect();
        let mut errors: Vec<ProbeError> = (0..200)
            .map(|errno| {
                ProbeError::Transient(Transient {
                    step: ProbeStep::Open,
                    errno: Some(errno),
                    detail: String::new(),
                })
            })
            .collect();
        errors.push(ProbeError::Absent(ModuleLoad::TimedOut));
        errors.push(ProbeError::SchedulerMissing {
            scheduler: "x".into(),
            module: ModuleLoad::Loaded,
        });
        errors.push(ProbeError::Transient(Transient {
            step: ProbeStep::State,
            errno: None,
            detail: String::new(),
        }));
        for e in &errors {
            assert!(all.contains(&e.kind()), "{e:?} -> {}", e.kind());
        }
        assert_eq!(all.len(), 12);
    }

    #[test]
    fn decisions() {
        let transient = Err(ProbeError::Transient(Transient {
            step: ProbeStep::Open,
            errno: Some(16),
            detail: String::new(),
        }));
        let absent = Err(ProbeError::Absent(ModuleLoad::NoModprobe));
        let sched = Err(ProbeError::SchedulerMissing {
            scheduler: "mh".into(),
            module: ModuleLoad::NoModprobe,
        });
        let clean = Some(NodeIpvsState::default());
        let link_only = Some(NodeIpvsState {
            dummy_link: true,
            owned_services: 0,
        });
        let serving = Some(NodeIpvsState {
            dummy_link: true,
            owned_services: 12,
        });
        for fallback in [true, false] {
            let give_up = if fallback {
                Decision::Fallback
            } else {
                Decision::Fail
            };
            for state in [None, clean, link_only, serving] {
                assert_eq!(decide(&Ok(()), state, fallback), Decision::Ipvs);
                // Transient: always retried, never a fallback, whatever the state.
                assert_eq!(decide(&transient, state, fallback), Decision::Retry);
            }
            // Absent: falls back (or fails) unless virtual servers were seen, which IPVS
            // being absent rules out (so the contradiction is retried), or the state is unknown.
            assert_eq!(decide(&absent, clean, fallback), give_up);
            assert_eq!(decide(&absent, link_only, fallback), give_up);
            assert_eq!(decide(&absent, serving, fallback), Decision::Retry);
            assert_eq!(decide(&absent, None, fallback), Decision::Retry);
            // Scheduler missing: any IPVS state on the node holds the fallback back.
            assert_eq!(decide(&sched, clean, fallback), give_up);
            assert_eq!(decide(&sched, link_only, fallback), Decision::Retry);
            assert_eq!(decide(&sched, serving, fallback), Decision::Retry);
            assert_eq!(decide(&sched, None, fallback), Decision::Retry);
        }
    }

    #[test]
    fn backoff_doubles_from_one_second_to_thirty_with_bounded_jitter() {
        let d = |attempt, jitter| backoff(attempt, BACKOFF_BASE, BACKOFF_MAX, jitter);
        let mid: Vec<u64> = (1..=8).map(|a| d(a, 0.5).as_secs()).collect();
        assert_eq!(mid, [1, 2, 4, 8, 16, 30, 30, 30]);
        // Jitter stays within ±20 % and never exceeds the cap.
        assert_eq!(d(1, 0.0), Duration::from_millis(800));
        assert_eq!(d(1, 1.0), Duration::from_millis(1200));
        assert_eq!(d(3, 0.0), Duration::from_millis(3200));
        for attempt in [6, 7, 100, u32::MAX] {
            assert_eq!(d(attempt, 1.0), BACKOFF_MAX);
            assert_eq!(d(attempt, 0.0), Duration::from_secs(24));
        }
        for _ in 0..100 {
            let j = jitter();
            assert!((0.0..=1.0).contains(&j), "{j}");
        }
    }

    #[test]
    fn fault_hook_values() {
        let p: FaultPlan = "ebusy:3".parse().unwrap();
        assert_eq!(
            p,
            FaultPlan {
                fault: InjectedFault::Errno(16),
                remaining: Some(3)
            }
        );
        let p: FaultPlan = "absent".parse().unwrap();
        assert_eq!(p.fault, InjectedFault::Absent);
        assert_eq!(p.remaining, None);
        assert_eq!(
            "scheduler:1".parse::<FaultPlan>().unwrap().fault,
            InjectedFault::SchedulerMissing
        );
        for bad in ["", "ebusy:", "ebusy:x", "enoent", "EBUSY", "ebusy:-1"] {
            let e = bad.parse::<FaultPlan>().unwrap_err();
            assert_eq!(e.field, FAULT_ENV, "{bad}");
        }
    }

    #[test]
    fn prober_injects_the_first_n_probes_then_probes_for_real() {
        let mut p = Prober::new(
            "rr",
            Some(FaultPlan {
                fault: InjectedFault::Errno(16),
                remaining: Some(2),
            }),
        );
        assert_eq!(p.take_fault(), Some(InjectedFault::Errno(16)));
        let (r, absent) = p.probe();
        assert_eq!(r.unwrap_err().kind(), "ebusy");
        assert!(!absent);
        assert_eq!(p.take_fault(), None, "the fault is spent");
        let mut always = Prober::new(
            "rr",
            Some(FaultPlan {
                fault: InjectedFault::Absent,
                remaining: None,
            }),
        );
        for _ in 0..3 {
            let (r, absent) = always.probe();
            assert_eq!(r.unwrap_err().kind(), "absent");
            assert!(absent);
        }
        assert_eq!(Prober::new("rr", None).take_fault(), None);
    }

    #[test]
    fn modprobe_outcomes_of_a_real_child() {
        // No such module: modprobe runs and fails (or is not installed here).
        let r = modprobe("kube_ipvs_no_such_module", MODPROBE_TIMEOUT);
        assert!(
            matches!(r, ModuleLoad::Failed(Some(c)) if c != 0) || r == ModuleLoad::NoModprobe,
            "{r:?}"
        );
        // A child that hangs is killed at the timeout; a missing binary is NoModprobe.
        assert_eq!(
            run_tool("sleep", "30", Duration::from_millis(100)),
            ModuleLoad::TimedOut
        );
        assert_eq!(run_tool("true", "x", MODPROBE_TIMEOUT), ModuleLoad::Loaded);
        assert_eq!(
            run_tool("/nonexistent/modprobe", "ip_vs", MODPROBE_TIMEOUT),
            ModuleLoad::NoModprobe
        );
    }
}
