//! The test-only probe fault hook (`KUBE_IPVS_FAULT_PROBE`).

use super::*;

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
