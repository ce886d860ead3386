//! The probe itself (create and delete a virtual server, as upstream) and the
//! classification of its failures.

use super::*;

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
    pub(super) fn of(step: ProbeStep, e: &ipvs_netlink::Error) -> Transient {
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
pub(super) const ERRNOS: [(&str, i32); 8] = [
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
