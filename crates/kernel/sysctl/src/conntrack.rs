//! kube-proxy's `conntrack.*` settings: nf_conntrack_max from the CPUs, the hash size, the TCP
//! and UDP timeouts and tcp_be_liberal; only raised where upstream only raises.

use super::*;

/// The real sysfs root.
pub const SYS: &str = "/sys";

/// nf_conntrack_max, relative to the sysctl root. One value for the whole kernel: the file is
/// read-only (mode 0444) in every network namespace but the initial one.
pub const CONNTRACK_MAX: &str = "net/netfilter/nf_conntrack_max";

/// The conntrack hash table size (a module parameter of nf_conntrack), relative to the sysfs
/// root. Global too; the kernel refuses to change it from any network namespace but the initial
/// one (EOPNOTSUPP).
pub const CONNTRACK_HASHSIZE: &str = "module/nf_conntrack/parameters/hashsize";

/// The online CPUs as a list of ranges (`0-3,6`), relative to the sysfs root.
pub const CPUS_ONLINE: &str = "devices/system/cpu/online";

/// kube-proxy's `conntrack.*` settings in the kernel's units (seconds). A zero (or `false`)
/// leaves the kernel's value alone.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ConntrackSettings {
    /// nf_conntrack_max per CPU. 0 leaves nf_conntrack_max and the hash size alone and ignores
    /// `min`.
    pub max_per_core: u32,
    /// The smallest nf_conntrack_max to ask for, whatever the CPU count.
    pub min: u32,
    /// `nf_conntrack_tcp_timeout_established`, seconds.
    pub tcp_established_timeout: u64,
    /// `nf_conntrack_tcp_timeout_close_wait`, seconds.
    pub tcp_close_wait_timeout: u64,
    /// `nf_conntrack_tcp_be_liberal=1`.
    pub tcp_be_liberal: bool,
    /// `nf_conntrack_udp_timeout` (unreplied UDP flows), seconds.
    pub udp_timeout: u64,
    /// `nf_conntrack_udp_timeout_stream` (assured UDP flows), seconds.
    pub udp_stream_timeout: u64,
}

/// The nf_conntrack_max kube-proxy asks for: `max(max_per_core × cpus, min)`, or 0 (leave the
/// kernel's value and the hash size alone) when `max_per_core` is 0.
pub fn conntrack_max(max_per_core: u32, min: u32, cpus: u32) -> u64 {
    if max_per_core == 0 {
        return 0;
    }
    (u64::from(max_per_core) * u64::from(cpus)).max(u64::from(min))
}

/// The hash table size that suits `max` entries: four entries per bucket, like kube-proxy.
pub fn conntrack_hashsize(max: u64) -> u64 {
    max / 4
}

/// Counts the CPUs in a kernel CPU list (`0-3,6,8-9` → 7). `None` for anything else.
pub fn parse_cpu_list(text: &str) -> Option<u32> {
    let text = text.trim();
    if text.is_empty() {
        return None;
    }
    let mut n: u32 = 0;
    for part in text.split(',') {
        let (lo, hi) = match part.split_once('-') {
            Some((a, b)) => (a.trim().parse::<u32>().ok()?, b.trim().parse::<u32>().ok()?),
            None => {
                let c = part.trim().parse::<u32>().ok()?;
                (c, c)
            }
        };
        if hi < lo {
            return None;
        }
        n = n.checked_add(hi - lo + 1)?;
    }
    Some(n)
}

/// The node's CPU count for sizing nf_conntrack_max: the online CPUs from `<sys_root>/devices/
/// system/cpu/online` (the whole node, not the CPUs this process may run on, like upstream),
/// else what the process can use. Never 0.
pub fn cpu_count(sys_root: &Path) -> u32 {
    let path = sys_root.join(CPUS_ONLINE);
    match std::fs::read_to_string(&path)
        .ok()
        .and_then(|t| parse_cpu_list(&t))
    {
        Some(n) if n > 0 => n,
        _ => {
            let n = std::thread::available_parallelism()
                .map(|n| u32::try_from(n.get()).unwrap_or(u32::MAX))
                .unwrap_or(1);
            tracing::debug!(file = %path.display(), cpus = n, "no online CPU list; using the CPUs this process can use");
            n
        }
    }
}

/// One per-namespace conntrack sysctl to set.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConntrackSysctl {
    /// Path relative to the sysctl root, e.g. `net/netfilter/nf_conntrack_udp_timeout`.
    pub path: &'static str,
    /// Value to write.
    pub value: String,
    /// The setting that asks for it (logged with the change).
    pub reason: &'static str,
}

/// The conntrack sysctls other than nf_conntrack_max that `s` asks for, in the order they are
/// applied: each only when its setting is non-zero (`tcp_be_liberal` only when true).
pub fn desired_conntrack_sysctls(s: &ConntrackSettings) -> Vec<ConntrackSysctl> {
    let mut v = Vec::new();
    let mut add = |path: &'static str, value: u64, reason: &'static str| {
        if value > 0 {
            v.push(ConntrackSysctl {
                path,
                value: value.to_string(),
                reason,
            });
        }
    };
    add(
        "net/netfilter/nf_conntrack_tcp_timeout_established",
        s.tcp_established_timeout,
        "conntrack.tcpEstablishedTimeout",
    );
    add(
        "net/netfilter/nf_conntrack_tcp_timeout_close_wait",
        s.tcp_close_wait_timeout,
        "conntrack.tcpCloseWaitTimeout",
    );
    add(
        "net/netfilter/nf_conntrack_tcp_be_liberal",
        u64::from(s.tcp_be_liberal),
        "conntrack.tcpBeLiberal",
    );
    add(
        "net/netfilter/nf_conntrack_udp_timeout",
        s.udp_timeout,
        "conntrack.udpTimeout",
    );
    add(
        "net/netfilter/nf_conntrack_udp_timeout_stream",
        s.udp_stream_timeout,
        "conntrack.udpStreamTimeout",
    );
    v
}

/// What [`apply_conntrack`] did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ConntrackReport {
    /// The nf_conntrack_max asked for (0: `max_per_core` is 0, left alone).
    pub max: u64,
    /// The CPU count it was computed with.
    pub cpus: u32,
    /// The values changed, in order.
    pub changes: Vec<Change>,
    /// The hash size had to be raised but sysfs is mounted read-only: kube-proxy's
    /// `readOnlySysFS` case, a warning (the table still holds nf_conntrack_max entries, in
    /// longer hash chains) rather than an error.
    pub read_only_sysfs: Option<SysctlFailure>,
}

/// Applies kube-proxy's `conntrack.*` settings like kube-proxy does at startup:
///
/// - nf_conntrack_max = [`conntrack_max`]`(max_per_core, min, cpus)` when that is non-zero, written
///   only when the kernel's value is smaller (a bigger table set by the administrator stays; the
///   file is read-only outside the initial network namespace, so this is also what lets the
///   proxy start in a namespace whose table is already big enough); then the hash size
///   (`<sys_root>/module/nf_conntrack/parameters/hashsize`) is raised to `max / 4` when it is
///   smaller, never lowered.
/// - the timeouts and `tcp_be_liberal` of [`desired_conntrack_sysctls`], per network namespace,
///   written when they differ.
///
/// Everything is read first and written only when it must change. A value that must change
/// and cannot is a failure (returned together with the changes made); sysfs mounted read-only
/// when the hash size must grow is only reported in [`ConntrackReport::read_only_sysfs`].
pub fn apply_conntrack(
    sysctl_root: &Path,
    sys_root: &Path,
    settings: &ConntrackSettings,
    cpus: u32,
) -> Result<ConntrackReport, SysctlError> {
    let mut report = ConntrackReport {
        max: conntrack_max(settings.max_per_core, settings.min, cpus),
        cpus,
        ..ConntrackReport::default()
    };
    let mut failures = Vec::new();
    if report.max > 0 {
        let reason = format!(
            "conntrack.maxPerCore {} x {cpus} CPUs, at least conntrack.min {}",
            settings.max_per_core, settings.min
        );
        match raise_conntrack_max(sysctl_root, report.max, &reason) {
            Ok(Some(c)) => report.changes.push(c),
            Ok(None) => {}
            Err(f) => failures.push(f),
        }
        match raise_hashsize(sys_root, conntrack_hashsize(report.max), &reason) {
            Ok(Some(c)) => report.changes.push(c),
            Ok(None) => {}
            Err(HashsizeError::ReadOnly(f)) => {
                tracing::warn!(
                    file = %f.path.display(),
                    problem = %f.problem,
                    "sysfs is read-only: cannot raise the conntrack hash size (nf_conntrack_max still applies; lookups use longer hash chains)"
                );
                report.read_only_sysfs = Some(f);
            }
            Err(HashsizeError::Failed(f)) => failures.push(f),
        }
    }
    for s in desired_conntrack_sysctls(settings) {
        let path = sysctl_root.join(s.path);
        match write_if_different(&path, &s.value, s.reason) {
            Ok(Some(c)) => report.changes.push(c),
            Ok(None) => {}
            Err(mut f) => {
                if f.problem.starts_with("does not exist") {
                    f.problem.push_str(" (is the nf_conntrack module loaded?)");
                }
                failures.push(f);
            }
        }
    }
    if failures.is_empty() {
        Ok(report)
    } else {
        Err(SysctlError::Failed {
            failures,
            applied: report.changes,
        })
    }
}

/// Writes nf_conntrack_max = `max` unless the kernel's value is already at least that.
fn raise_conntrack_max(
    root: &Path,
    max: u64,
    reason: &str,
) -> Result<Option<Change>, SysctlFailure> {
    let path = root.join(CONNTRACK_MAX);
    let old = match read_value(&path) {
        Ok(v) => v,
        Err(mut f) => {
            if f.problem.starts_with("does not exist") {
                f.problem.push_str(" (is the nf_conntrack module loaded?)");
            }
            return Err(f);
        }
    };
    if let Ok(cur) = old.parse::<u64>() {
        if cur >= max {
            tracing::info!(sysctl = %path.display(), current = cur, wanted = max, "nf_conntrack_max is already large enough; leaving it");
            return Ok(None);
        }
    }
    let want = max.to_string();
    match std::fs::write(&path, &want) {
        Ok(()) => {
            tracing::info!(sysctl = %path.display(), old = %old, new = %want, reason = %reason, "set sysctl");
            Ok(Some(Change {
                path,
                old,
                new: want,
            }))
        }
        Err(e) => {
            let hint = if e.kind() == ErrorKind::PermissionDenied {
                " (nf_conntrack_max is one value for the whole kernel, writable only from the \
                 host's network namespace: raise it on the host, or set conntrack.maxPerCore: 0 \
                 / --conntrack-max-per-core=0 to leave it alone)"
            } else {
                ""
            };
            Err(SysctlFailure {
                path,
                problem: format!("write {want}: {e}{hint}"),
            })
        }
    }
}

enum HashsizeError {
    /// sysfs is mounted read-only.
    ReadOnly(SysctlFailure),
    /// Anything else.
    Failed(SysctlFailure),
}

/// Raises the conntrack hash size to `want` when it is smaller; never lowers it.
fn raise_hashsize(
    sys_root: &Path,
    want: u64,
    reason: &str,
) -> Result<Option<Change>, HashsizeError> {
    let path = sys_root.join(CONNTRACK_HASHSIZE);
    let old = read_value(&path).map_err(|mut f| {
        if f.problem.starts_with("does not exist") {
            f.problem.push_str(" (is the nf_conntrack module loaded?)");
        }
        HashsizeError::Failed(f)
    })?;
    let cur = old.parse::<u64>().map_err(|_| {
        HashsizeError::Failed(SysctlFailure {
            path: path.clone(),
            problem: format!("not a number: {old:?}"),
        })
    })?;
    if cur >= want {
        return Ok(None);
    }
    let reason = format!("{reason}: 4 entries per hash bucket");
    match std::fs::write(&path, want.to_string()) {
        Ok(()) => {
            tracing::info!(file = %path.display(), old = cur, new = want, reason = %reason, "set conntrack hash size");
            Ok(Some(Change {
                path,
                old,
                new: want.to_string(),
            }))
        }
        Err(e) if e.kind() == ErrorKind::ReadOnlyFilesystem => {
            Err(HashsizeError::ReadOnly(SysctlFailure {
                path,
                problem: format!("write {want}: {e}"),
            }))
        }
        Err(e) => {
            let hint = if e.raw_os_error() == Some(EOPNOTSUPP) {
                " (the hash size can only be changed from the host's network namespace; \
                 set conntrack.maxPerCore: 0 / --conntrack-max-per-core=0 to leave the table alone)"
            } else {
                ""
            };
            Err(HashsizeError::Failed(SysctlFailure {
                path,
                problem: format!("write {want}: {e}{hint}"),
            }))
        }
    }
}

/// `EOPNOTSUPP` on Linux: what the kernel answers to a hash size change from another network
/// namespace than the initial one.
const EOPNOTSUPP: i32 = 95;
