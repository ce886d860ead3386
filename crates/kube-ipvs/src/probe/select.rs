//! The daemon's loop around the probe: retries with jittered backoff, health and
//! metrics per attempt, until a mode is selected.

use super::*;

/// The delay before retry number `attempt` (1-based): `base` doubling up to `max`, then
/// jittered by up to ±20 % (`jitter` in 0.0..=1.0 maps to -20 %..+20 %), never above `max`.
pub fn backoff(attempt: u32, base: Duration, max: Duration, jitter: f64) -> Duration {
    let doublings = attempt.saturating_sub(1).min(30);
    let plain = base.saturating_mul(1u32 << doublings).min(max);
    let factor = 0.8 + 0.4 * jitter.clamp(0.0, 1.0);
    plain.mul_f64(factor).min(max)
}

/// A number in 0.0..=1.0 that differs between calls and processes (for jitter only).
pub(super) fn jitter() -> f64 {
    let mut h = RandomState::new().build_hasher();
    h.write_u128(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap_or_default()
            .as_nanos(),
    );
    (h.finish() % 10_001) as f64 / 10_000.0
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
    pub(super) fn take_fault(&mut self) -> Option<InjectedFault> {
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
                     iptables-mode sync; on a kernel that does not autoload ip_vs, the DaemonSet's \
                     load-modules init container loads it (see its log)"
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
