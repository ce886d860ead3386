//! Kernel sysctls the proxy needs (IPVS conntrack, expire_nodest_conn, conn_reuse_mode, strict ARP)
//! and the ones kube-proxy's `conntrack.*` settings ask for (nf_conntrack_max, the conntrack hash
//! size, TCP and UDP timeouts, tcp_be_liberal).
//!
//! Pure part: [`parse_kernel_version`] and [`desired_sysctls`] decide what the node should have;
//! [`conntrack_max`], [`conntrack_hashsize`], [`parse_cpu_list`] and
//! [`desired_conntrack_sysctls`] do the same for conntrack.
//! IO part: [`apply_sysctls`] and [`apply_conntrack`] read each value under a sysctl root
//! (`/proc/sys`, or a temporary tree in tests) and a sysfs root (`/sys`), write only the ones
//! that must change, log each change, and keep going past failures so one missing subsystem does
//! not stop the rest.

use std::fmt;
use std::io::ErrorKind;
use std::path::{Path, PathBuf};

mod conntrack;

pub use conntrack::*;

/// The real sysctl root.
pub const PROC_SYS: &str = "/proc/sys";

/// Directory (relative to the sysctl root) that exists only when IPVS is available.
pub const IPVS_DIR: &str = "net/ipv4/vs";

/// A kernel version as (major, minor, patch).
pub type KernelVersion = (u32, u32, u32);

/// The first kernel with `conn_reuse_mode` (4.1).
const CONN_REUSE_MIN: KernelVersion = (4, 1, 0);
/// The kernel that fixed the 1-second SYN drop with `conn_reuse_mode=1` (5.9).
const CONN_REUSE_FIXED: KernelVersion = (5, 9, 0);

/// One sysctl the proxy cares about.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Sysctl {
    /// Path relative to the sysctl root, e.g. `net/ipv4/vs/conntrack`.
    pub path: &'static str,
    /// Value to set, or `None` to leave the kernel's value alone.
    pub value: Option<&'static str>,
    /// Why (logged with every change, and for values left alone).
    pub reason: String,
}

/// A value that was changed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Change {
    /// Full path of the sysctl file.
    pub path: PathBuf,
    /// Value before.
    pub old: String,
    /// Value written.
    pub new: String,
}

/// A sysctl that could not be read or set.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SysctlFailure {
    /// Full path of the sysctl file (or the missing directory).
    pub path: PathBuf,
    /// What went wrong, for operators.
    pub problem: String,
}

impl fmt::Display for SysctlFailure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.path.display(), self.problem)
    }
}

/// Errors of the sysctl module.
#[derive(Debug, thiserror::Error)]
pub enum SysctlError {
    /// Some sysctls could not be read or written; every other one was applied (listed in
    /// `applied`). A missing IPVS gives one failure naming the `net/ipv4/vs` directory.
    #[error("{} sysctl(s) not set: {}", failures.len(), failures.iter().map(ToString::to_string).collect::<Vec<_>>().join("; "))]
    Failed {
        /// The sysctls that failed.
        failures: Vec<SysctlFailure>,
        /// The changes made anyway.
        applied: Vec<Change>,
    },
    /// The running kernel's version could not be read or understood.
    #[error("cannot determine kernel version from {}: {detail}", path.display())]
    KernelVersion {
        /// The file read (`kernel/osrelease` under the sysctl root).
        path: PathBuf,
        /// What was wrong.
        detail: String,
    },
}

impl SysctlError {
    /// Whether IPVS itself is missing (its sysctl directory does not exist).
    pub fn ipvs_missing(&self) -> bool {
        match self {
            Self::Failed { failures, .. } => failures.iter().any(|f| f.path.ends_with(IPVS_DIR)),
            Self::KernelVersion { .. } => false,
        }
    }
}

/// Parse a kernel release string ("6.1.0-56-cloud-amd64", "5.4.0-1045-aws", "4.19.0+",
/// "5.10") into (major, minor, patch). Major and minor are required; a missing patch is 0.
pub fn parse_kernel_version(release: &str) -> Option<KernelVersion> {
    let mut parts = release.trim().splitn(3, '.');
    let mut num = |required: bool| -> Option<u32> {
        match parts.next() {
            Some(p) => {
                let digits: String = p.chars().take_while(char::is_ascii_digit).collect();
                if digits.is_empty() {
                    if required {
                        None
                    } else {
                        Some(0)
                    }
                } else {
                    digits.parse().ok()
                }
            }
            None if required => None,
            None => Some(0),
        }
    };
    let major = num(true)?;
    let minor = num(true)?;
    let patch = num(false)?;
    Some((major, minor, patch))
}

/// Where the running kernel's release is read from: this process's own procfs, never the
/// sysctl root (under the DaemonSet only the host's `/proc/sys/net` is mounted there, while
/// `/proc/sys/kernel/osrelease` of the container is the host kernel's: containers share it).
pub const RUNNING_OSRELEASE: &str = "/proc/sys/kernel/osrelease";

/// The running kernel's version, read from [`RUNNING_OSRELEASE`] (what `uname -r` prints),
/// whatever the sysctl root is.
pub fn running_kernel_version() -> Result<KernelVersion, SysctlError> {
    kernel_version_from(Path::new(RUNNING_OSRELEASE))
}

/// Read the running kernel's version from `kernel/osrelease` under `root`.
pub fn kernel_version(root: &Path) -> Result<KernelVersion, SysctlError> {
    kernel_version_from(&root.join("kernel/osrelease"))
}

/// Read a kernel version from an `osrelease` file.
fn kernel_version_from(path: &Path) -> Result<KernelVersion, SysctlError> {
    let path = path.to_path_buf();
    let text = std::fs::read_to_string(&path).map_err(|e| SysctlError::KernelVersion {
        path: path.clone(),
        detail: e.to_string(),
    })?;
    parse_kernel_version(&text).ok_or_else(|| SysctlError::KernelVersion {
        path,
        detail: format!("unrecognised release {:?}", text.trim()),
    })
}

fn fmt_version(v: KernelVersion) -> String {
    format!("{}.{}.{}", v.0, v.1, v.2)
}

/// The sysctls the proxy wants on a node running `kernel`, in the order they are applied.
pub fn desired_sysctls(kernel: KernelVersion, strict_arp: bool) -> Vec<Sysctl> {
    let mut v = vec![
        Sysctl {
            path: "net/ipv4/vs/conntrack",
            value: Some("1"),
            reason: "IPVS must keep conntrack entries so masquerade and the KUBE-* rules see its traffic"
                .into(),
        },
        Sysctl {
            path: "net/ipv4/vs/expire_nodest_conn",
            value: Some("1"),
            reason: "connections to a deleted real server are expired instead of black-holed".into(),
        },
        Sysctl {
            path: "net/ipv4/vs/expire_quiescent_template",
            value: Some("1"),
            reason: "session-affinity templates of a weight-0 real server expire so clients move on"
                .into(),
        },
    ];
    let conn_reuse = if kernel < CONN_REUSE_MIN {
        Sysctl {
            path: "net/ipv4/vs/conn_reuse_mode",
            value: None,
            reason: format!(
                "kernel {} is older than 4.1 and has no conn_reuse_mode",
                fmt_version(kernel)
            ),
        }
    } else if kernel < CONN_REUSE_FIXED {
        Sysctl {
            path: "net/ipv4/vs/conn_reuse_mode",
            value: Some("0"),
            reason: format!(
                "kernel {} (4.1 <= kernel < 5.9) stalls reused connections for 1 s with conn_reuse_mode=1",
                fmt_version(kernel)
            ),
        }
    } else {
        Sysctl {
            path: "net/ipv4/vs/conn_reuse_mode",
            value: None,
            reason: format!(
                "kernel {} >= 5.9 has the conn_reuse_mode fix; leaving the kernel default",
                fmt_version(kernel)
            ),
        }
    };
    v.push(conn_reuse);
    v.push(Sysctl {
        path: "net/ipv4/ip_forward",
        value: Some("1"),
        reason: "service traffic is forwarded to endpoints".into(),
    });
    if strict_arp {
        v.push(Sysctl {
            path: "net/ipv4/conf/all/arp_ignore",
            value: Some("1"),
            reason: "strictARP: answer ARP only for addresses on the receiving interface, not VIPs on kube-ipvs0"
                .into(),
        });
        v.push(Sysctl {
            path: "net/ipv4/conf/all/arp_announce",
            value: Some("2"),
            reason: "strictARP: never announce VIPs of kube-ipvs0 as ARP source".into(),
        });
    }
    v
}

/// Apply `desired` under `root` (normally [`PROC_SYS`]): read each value, write only when it
/// differs, log each change (and each value deliberately left alone) once per call. Failures
/// do not stop the remaining sysctls; they are returned together, with the changes that were
/// made. A missing `net/ipv4/vs` directory is reported once as IPVS being unavailable.
pub fn apply_sysctls(root: &Path, desired: &[Sysctl]) -> Result<Vec<Change>, SysctlError> {
    let mut applied = Vec::new();
    let mut failures: Vec<SysctlFailure> = Vec::new();
    let ipvs_dir = root.join(IPVS_DIR);
    let ipvs_present = ipvs_dir.is_dir();
    for s in desired {
        let path = root.join(s.path);
        if s.path.starts_with(IPVS_DIR) && !ipvs_present {
            if !failures.iter().any(|f| f.path == ipvs_dir) {
                failures.push(SysctlFailure {
                    path: ipvs_dir.clone(),
                    problem: "directory missing: IPVS is not available (load the ip_vs kernel module; CONFIG_IP_VS)"
                        .into(),
                });
            }
            continue;
        }
        let Some(want) = s.value else {
            tracing::info!(sysctl = %path.display(), reason = %s.reason, "leaving sysctl untouched");
            continue;
        };
        match write_if_different(&path, want, &s.reason) {
            Ok(Some(change)) => applied.push(change),
            Ok(None) => {}
            Err(f) => failures.push(f),
        }
    }
    if failures.is_empty() {
        Ok(applied)
    } else {
        Err(SysctlError::Failed { failures, applied })
    }
}

/// Reads `path`; writes `want` when the value (trimmed) differs and logs the change.
fn write_if_different(
    path: &Path,
    want: &str,
    reason: &str,
) -> Result<Option<Change>, SysctlFailure> {
    let old = read_value(path)?;
    if old == want {
        return Ok(None);
    }
    write_value(path, &old, want, reason).map(Some)
}

/// The trimmed contents of a sysctl (or sysfs) file.
fn read_value(path: &Path) -> Result<String, SysctlFailure> {
    match std::fs::read_to_string(path) {
        Ok(t) => Ok(t.trim().to_string()),
        Err(e) => Err(SysctlFailure {
            path: path.to_path_buf(),
            problem: if e.kind() == ErrorKind::NotFound {
                "does not exist in this kernel".to_string()
            } else {
                format!("read: {e}")
            },
        }),
    }
}

/// Writes `want` (the file held `old`) and logs the change.
fn write_value(path: &Path, old: &str, want: &str, reason: &str) -> Result<Change, SysctlFailure> {
    if let Err(e) = std::fs::write(path, want) {
        return Err(SysctlFailure {
            path: path.to_path_buf(),
            problem: format!("write {want}: {e}"),
        });
    }
    tracing::info!(sysctl = %path.display(), old = %old, new = %want, reason = %reason, "set sysctl");
    Ok(Change {
        path: path.to_path_buf(),
        old: old.to_string(),
        new: want.to_string(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::fs;

    #[test]
    fn kernel_versions() {
        assert_eq!(
            parse_kernel_version("6.1.0-56-cloud-amd64"),
            Some((6, 1, 0))
        );
        assert_eq!(parse_kernel_version("5.4.0-1045-aws\n"), Some((5, 4, 0)));
        assert_eq!(parse_kernel_version("4.19.0+"), Some((4, 19, 0)));
        assert_eq!(parse_kernel_version("5.10"), Some((5, 10, 0)));
        assert_eq!(parse_kernel_version("6.8.0-rc3"), Some((6, 8, 0)));
        assert_eq!(
            parse_kernel_version("4.1.12-124.48.6.el7uek.x86_64"),
            Some((4, 1, 12))
        );
        assert_eq!(parse_kernel_version("6.12.7+deb13-amd64"), Some((6, 12, 7)));
        assert_eq!(parse_kernel_version(""), None);
        assert_eq!(parse_kernel_version("6"), None);
        assert_eq!(parse_kernel_version("linux"), None);
        assert_eq!(parse_kernel_version("6.x"), None);
        assert_eq!(parse_kernel_version("99999999999.1"), None);
    }

    fn value_of(v: &[Sysctl], path: &str) -> Option<Option<&'static str>> {
        v.iter().find(|s| s.path == path).map(|s| s.value)
    }

    #[test]
    fn conn_reuse_mode_rule() {
        let reuse = "net/ipv4/vs/conn_reuse_mode";
        assert_eq!(
            value_of(&desired_sysctls((4, 0, 9), false), reuse),
            Some(None)
        );
        assert_eq!(
            value_of(&desired_sysctls((4, 1, 0), false), reuse),
            Some(Some("0"))
        );
        assert_eq!(
            value_of(&desired_sysctls((5, 4, 0), false), reuse),
            Some(Some("0"))
        );
        assert_eq!(
            value_of(&desired_sysctls((5, 8, 99), false), reuse),
            Some(Some("0"))
        );
        assert_eq!(
            value_of(&desired_sysctls((5, 9, 0), false), reuse),
            Some(None)
        );
        assert_eq!(
            value_of(&desired_sysctls((6, 1, 0), false), reuse),
            Some(None)
        );
        let why = desired_sysctls((6, 1, 0), false)
            .into_iter()
            .find(|s| s.path == reuse)
            .unwrap()
            .reason;
        assert!(why.contains("6.1.0") && why.contains("5.9"), "{why}");
    }

    #[test]
    fn always_and_strict_arp_sysctls() {
        let plain = desired_sysctls((6, 1, 0), false);
        for (p, v) in [
            ("net/ipv4/vs/conntrack", "1"),
            ("net/ipv4/vs/expire_nodest_conn", "1"),
            ("net/ipv4/vs/expire_quiescent_template", "1"),
            ("net/ipv4/ip_forward", "1"),
        ] {
            assert_eq!(value_of(&plain, p), Some(Some(v)), "{p}");
        }
        assert_eq!(value_of(&plain, "net/ipv4/conf/all/arp_ignore"), None);
        assert_eq!(value_of(&plain, "net/ipv4/conf/all/arp_announce"), None);
        let strict = desired_sysctls((6, 1, 0), true);
        assert_eq!(
            value_of(&strict, "net/ipv4/conf/all/arp_ignore"),
            Some(Some("1"))
        );
        assert_eq!(
            value_of(&strict, "net/ipv4/conf/all/arp_announce"),
            Some(Some("2"))
        );
    }

    /// A fake sysctl tree in a fresh temporary directory, removed on drop.
    struct Tree(PathBuf);
    impl Tree {
        fn new(tag: &str, with_ipvs: bool) -> Self {
            let dir =
                std::env::temp_dir().join(format!("kube-ipvs-sysctl-{}-{tag}", std::process::id()));
            let _ = fs::remove_dir_all(&dir);
            let mut files = vec![
                ("net/ipv4/ip_forward", "0\n"),
                ("net/ipv4/conf/all/arp_ignore", "0\n"),
                ("net/ipv4/conf/all/arp_announce", "0\n"),
                ("kernel/osrelease", "5.4.0-1045-aws\n"),
            ];
            if with_ipvs {
                files.extend([
                    ("net/ipv4/vs/conntrack", "0\n"),
                    ("net/ipv4/vs/expire_nodest_conn", "0\n"),
                    ("net/ipv4/vs/expire_quiescent_template", "1\n"),
                    ("net/ipv4/vs/conn_reuse_mode", "1\n"),
                ]);
            }
            for (p, v) in files {
                let f = dir.join(p);
                fs::create_dir_all(f.parent().unwrap()).unwrap();
                fs::write(f, v).unwrap();
            }
            Tree(dir)
        }
        fn empty(tag: &str) -> Self {
            let dir =
                std::env::temp_dir().join(format!("kube-ipvs-sysctl-{}-{tag}", std::process::id()));
            let _ = fs::remove_dir_all(&dir);
            fs::create_dir_all(&dir).unwrap();
            Tree(dir)
        }
        fn put(&self, p: &str, v: &str) {
            let f = self.0.join(p);
            fs::create_dir_all(f.parent().unwrap()).unwrap();
            fs::write(f, v).unwrap();
        }
        fn read(&self, p: &str) -> String {
            fs::read_to_string(self.0.join(p))
                .unwrap()
                .trim()
                .to_string()
        }
    }
    impl Drop for Tree {
        fn drop(&mut self) {
            let _ = fs::remove_dir_all(&self.0);
        }
    }

    #[test]
    fn apply_writes_only_what_differs_and_is_idempotent() {
        let t = Tree::new("idem", true);
        let kernel = kernel_version(&t.0).unwrap();
        assert_eq!(kernel, (5, 4, 0));
        let want = desired_sysctls(kernel, true);

        let changes = apply_sysctls(&t.0, &want).unwrap();
        let changed: Vec<String> = changes
            .iter()
            .map(|c| c.path.strip_prefix(&t.0).unwrap().display().to_string())
            .collect();
        assert_eq!(
            changed,
            vec![
                "net/ipv4/vs/conntrack",
                "net/ipv4/vs/expire_nodest_conn",
                "net/ipv4/vs/conn_reuse_mode",
                "net/ipv4/ip_forward",
                "net/ipv4/conf/all/arp_ignore",
                "net/ipv4/conf/all/arp_announce",
            ]
        );
        assert_eq!(changes[2].old, "1");
        assert_eq!(changes[2].new, "0");
        assert_eq!(t.read("net/ipv4/vs/conntrack"), "1");
        assert_eq!(t.read("net/ipv4/vs/conn_reuse_mode"), "0");
        assert_eq!(t.read("net/ipv4/conf/all/arp_announce"), "2");
        // Read before write: the already-correct value was not rewritten (we write without a
        // trailing newline, the fixture has one).
        let raw = fs::read_to_string(t.0.join("net/ipv4/vs/expire_quiescent_template")).unwrap();
        assert_eq!(raw, "1\n");
        assert_eq!(
            fs::read_to_string(t.0.join("net/ipv4/ip_forward")).unwrap(),
            "1"
        );
        // Second run: nothing to change.
        assert!(apply_sysctls(&t.0, &want).unwrap().is_empty());
    }

    #[test]
    fn new_kernels_keep_conn_reuse_mode() {
        let t = Tree::new("new", true);
        let changes = apply_sysctls(&t.0, &desired_sysctls((6, 1, 0), false)).unwrap();
        assert!(changes.iter().all(|c| !c.path.ends_with("conn_reuse_mode")));
        assert_eq!(t.read("net/ipv4/vs/conn_reuse_mode"), "1");
        assert_eq!(t.read("net/ipv4/conf/all/arp_ignore"), "0", "no strictARP");
    }

    #[test]
    fn missing_ipvs_is_one_clear_error_and_the_rest_is_applied() {
        let t = Tree::new("noipvs", false);
        let err = apply_sysctls(&t.0, &desired_sysctls((5, 4, 0), true)).unwrap_err();
        assert!(err.ipvs_missing());
        match &err {
            SysctlError::Failed { failures, applied } => {
                assert_eq!(failures.len(), 1, "{failures:?}");
                assert_eq!(failures[0].path, t.0.join("net/ipv4/vs"));
                assert!(failures[0].problem.contains("ip_vs"));
                assert_eq!(applied.len(), 3, "{applied:?}");
            }
            other => panic!("{other:?}"),
        }
        assert!(err.to_string().contains("net/ipv4/vs"), "{err}");
        assert_eq!(t.read("net/ipv4/ip_forward"), "1");
        assert_eq!(t.read("net/ipv4/conf/all/arp_ignore"), "1");
    }

    #[test]
    fn a_missing_single_sysctl_names_its_path() {
        let t = Tree::new("one", true);
        fs::remove_file(t.0.join("net/ipv4/vs/expire_nodest_conn")).unwrap();
        let err = apply_sysctls(&t.0, &desired_sysctls((6, 1, 0), false)).unwrap_err();
        assert!(!err.ipvs_missing());
        let SysctlError::Failed { failures, applied } = err else {
            panic!()
        };
        assert_eq!(failures.len(), 1);
        assert!(failures[0].path.ends_with("net/ipv4/vs/expire_nodest_conn"));
        assert_eq!(applied.len(), 2, "conntrack and ip_forward still set");
    }

    #[test]
    fn unreadable_kernel_version_is_an_error() {
        let t = Tree::new("osrel", true);
        fs::write(t.0.join("kernel/osrelease"), "garbage\n").unwrap();
        assert!(matches!(
            kernel_version(&t.0),
            Err(SysctlError::KernelVersion { .. })
        ));
        fs::remove_file(t.0.join("kernel/osrelease")).unwrap();
        assert!(matches!(
            kernel_version(&t.0),
            Err(SysctlError::KernelVersion { .. })
        ));
    }

    // ---- conntrack ----

    #[test]
    fn conntrack_max_table() {
        // (maxPerCore, min, cpus) -> nf_conntrack_max asked for.
        for (per_core, min, cpus, want) in [
            (32768, 131072, 2, 131072), // upstream defaults on 2 CPUs: the minimum wins
            (32768, 131072, 4, 131072), // 4 x 32768 = 131072: equal
            (32768, 131072, 8, 262144), // scaled wins
            (32768, 131072, 64, 2_097_152),
            (32768, 0, 4, 131072),                           // no minimum
            (1, 0, 3, 3),                                    // tiny but non-zero
            (10, 100, 0, 100),                               // no CPU count: the minimum
            (0, 131072, 8, 0),                               // maxPerCore 0: leave it, min ignored
            (0, 0, 8, 0),                                    // all zero: leave it
            (u32::MAX, 0, 4096, u64::from(u32::MAX) * 4096), // no overflow
        ] {
            assert_eq!(
                conntrack_max(per_core, min, cpus),
                want,
                "maxPerCore {per_core} min {min} cpus {cpus}"
            );
        }
        assert_eq!(conntrack_hashsize(131072), 32768);
        assert_eq!(conntrack_hashsize(262144), 65536);
        assert_eq!(conntrack_hashsize(3), 0);
        assert_eq!(conntrack_hashsize(0), 0);
    }

    #[test]
    fn cpu_lists() {
        assert_eq!(parse_cpu_list("0\n"), Some(1));
        assert_eq!(parse_cpu_list("0-3"), Some(4));
        assert_eq!(parse_cpu_list("0-3,6,8-9\n"), Some(7));
        assert_eq!(parse_cpu_list("0-63"), Some(64));
        assert_eq!(parse_cpu_list(""), None);
        assert_eq!(parse_cpu_list("3-1"), None);
        assert_eq!(parse_cpu_list("0-"), None);
        assert_eq!(parse_cpu_list("a"), None);
        assert_eq!(parse_cpu_list("0,,1"), None);
    }

    /// A fake /proc/sys + /sys pair with nf_conntrack loaded (values of a small host), removed
    /// on drop.
    struct CtTree {
        proc_sys: Tree,
        sys: Tree,
    }
    impl CtTree {
        fn new(tag: &str, max: u64, hashsize: u64) -> Self {
            let proc_sys = Tree::empty(&format!("{tag}-proc"));
            let max = max.to_string();
            for (p, v) in [
                (CONNTRACK_MAX, max.as_str()),
                (
                    "net/netfilter/nf_conntrack_tcp_timeout_established",
                    "432000",
                ),
                ("net/netfilter/nf_conntrack_tcp_timeout_close_wait", "60"),
                ("net/netfilter/nf_conntrack_tcp_be_liberal", "0"),
                ("net/netfilter/nf_conntrack_udp_timeout", "30"),
                ("net/netfilter/nf_conntrack_udp_timeout_stream", "120"),
            ] {
                proc_sys.put(p, &format!("{v}\n"));
            }
            let sys = Tree::empty(&format!("{tag}-sys"));
            sys.put(CONNTRACK_HASHSIZE, &format!("{hashsize}\n"));
            sys.put(CPUS_ONLINE, "0-7\n");
            CtTree { proc_sys, sys }
        }
        fn apply(&self, s: &ConntrackSettings, cpus: u32) -> Result<ConntrackReport, SysctlError> {
            apply_conntrack(&self.proc_sys.0, &self.sys.0, s, cpus)
        }
        fn changed(&self, r: &ConntrackReport) -> Vec<String> {
            r.changes
                .iter()
                .map(|c| {
                    let rel = c
                        .path
                        .strip_prefix(&self.proc_sys.0)
                        .or_else(|_| c.path.strip_prefix(&self.sys.0))
                        .unwrap();
                    format!("{}={}", rel.file_name().unwrap().to_string_lossy(), c.new)
                })
                .collect()
        }
    }

    /// kube-proxy's defaults.
    fn upstream_defaults() -> ConntrackSettings {
        ConntrackSettings {
            max_per_core: 32768,
            min: 131072,
            tcp_established_timeout: 24 * 3600,
            tcp_close_wait_timeout: 3600,
            ..ConntrackSettings::default()
        }
    }

    #[test]
    fn conntrack_defaults_raise_max_and_hashsize_and_set_tcp_timeouts_once() {
        let t = CtTree::new("ct-defaults", 65536, 16384);
        let r = t.apply(&upstream_defaults(), 2).unwrap();
        assert_eq!((r.max, r.cpus), (131072, 2));
        assert_eq!(
            t.changed(&r),
            vec![
                "nf_conntrack_max=131072",
                "hashsize=32768",
                "nf_conntrack_tcp_timeout_established=86400",
                "nf_conntrack_tcp_timeout_close_wait=3600",
            ]
        );
        assert_eq!(r.changes[0].old, "65536");
        assert_eq!(r.read_only_sysfs, None);
        assert_eq!(t.proc_sys.read(CONNTRACK_MAX), "131072");
        assert_eq!(t.sys.read(CONNTRACK_HASHSIZE), "32768");
        // Zero / false settings are not touched.
        assert_eq!(
            t.proc_sys.read("net/netfilter/nf_conntrack_tcp_be_liberal"),
            "0"
        );
        assert_eq!(
            t.proc_sys.read("net/netfilter/nf_conntrack_udp_timeout"),
            "30"
        );
        assert_eq!(
            t.proc_sys
                .read("net/netfilter/nf_conntrack_udp_timeout_stream"),
            "120"
        );
        // Read before write: a second run changes nothing.
        let again = t.apply(&upstream_defaults(), 2).unwrap();
        assert!(again.changes.is_empty(), "{:?}", again.changes);
    }

    #[test]
    fn conntrack_max_and_hashsize_are_never_lowered() {
        // An administrator's bigger table stays (and so does its hash size).
        let t = CtTree::new("ct-bigger", 1_048_576, 262144);
        let r = t.apply(&upstream_defaults(), 8).unwrap();
        assert_eq!(r.max, 262144);
        assert_eq!(
            t.changed(&r),
            vec![
                "nf_conntrack_tcp_timeout_established=86400",
                "nf_conntrack_tcp_timeout_close_wait=3600",
            ]
        );
        assert_eq!(t.proc_sys.read(CONNTRACK_MAX), "1048576");
        assert_eq!(t.sys.read(CONNTRACK_HASHSIZE), "262144");

        // max raised, hash size already big enough for it: only max changes.
        let t = CtTree::new("ct-hash-big", 65536, 131072);
        let r = t.apply(&upstream_defaults(), 8).unwrap();
        assert_eq!(t.changed(&r)[0], "nf_conntrack_max=262144");
        assert!(!t.changed(&r).iter().any(|c| c.starts_with("hashsize")));
        assert_eq!(t.sys.read(CONNTRACK_HASHSIZE), "131072");

        // max already big enough, hash size too small for it: only the hash size is raised.
        let t = CtTree::new("ct-hash-small", 1_048_576, 1024);
        let r = t.apply(&upstream_defaults(), 8).unwrap();
        assert_eq!(t.changed(&r)[0], "hashsize=65536");
        assert_eq!(t.proc_sys.read(CONNTRACK_MAX), "1048576");
    }

    #[test]
    fn conntrack_zero_settings_leave_everything_alone() {
        // maxPerCore 0: nf_conntrack_max and the hash size stay, min is ignored.
        let t = CtTree::new("ct-zero-max", 1024, 256);
        let s = ConntrackSettings {
            max_per_core: 0,
            min: 131072,
            ..upstream_defaults()
        };
        let r = t.apply(&s, 8).unwrap();
        assert_eq!(r.max, 0);
        assert_eq!(
            t.changed(&r),
            vec![
                "nf_conntrack_tcp_timeout_established=86400",
                "nf_conntrack_tcp_timeout_close_wait=3600",
            ]
        );
        assert_eq!(t.proc_sys.read(CONNTRACK_MAX), "1024");
        assert_eq!(t.sys.read(CONNTRACK_HASHSIZE), "256");

        // Everything zero: nothing is even read, so a kernel without nf_conntrack is fine.
        let empty_proc = Tree::empty("ct-none-proc");
        let empty_sys = Tree::empty("ct-none-sys");
        let r = apply_conntrack(
            &empty_proc.0,
            &empty_sys.0,
            &ConntrackSettings::default(),
            8,
        )
        .unwrap();
        assert_eq!(
            r,
            ConntrackReport {
                cpus: 8,
                ..ConntrackReport::default()
            }
        );
    }

    #[test]
    fn conntrack_liberal_and_udp_timeouts() {
        let t = CtTree::new("ct-udp", 262144, 65536);
        let s = ConntrackSettings {
            max_per_core: 0,
            tcp_be_liberal: true,
            udp_timeout: 41,
            udp_stream_timeout: 133,
            ..ConntrackSettings::default()
        };
        let r = t.apply(&s, 2).unwrap();
        assert_eq!(
            t.changed(&r),
            vec![
                "nf_conntrack_tcp_be_liberal=1",
                "nf_conntrack_udp_timeout=41",
                "nf_conntrack_udp_timeout_stream=133",
            ]
        );
        assert_eq!(
            t.proc_sys
                .read("net/netfilter/nf_conntrack_udp_timeout_stream"),
            "133"
        );
        assert_eq!(
            desired_conntrack_sysctls(&s)
                .iter()
                .map(|d| d.reason)
                .collect::<Vec<_>>(),
            vec![
                "conntrack.tcpBeLiberal",
                "conntrack.udpTimeout",
                "conntrack.udpStreamTimeout"
            ]
        );
    }

    #[test]
    fn conntrack_without_nf_conntrack_is_one_error_per_value_and_names_the_module() {
        let empty_proc = Tree::empty("ct-missing-proc");
        let empty_sys = Tree::empty("ct-missing-sys");
        let err =
            apply_conntrack(&empty_proc.0, &empty_sys.0, &upstream_defaults(), 2).unwrap_err();
        let SysctlError::Failed { failures, applied } = &err else {
            panic!("{err:?}")
        };
        assert!(applied.is_empty());
        let names: Vec<String> = failures
            .iter()
            .map(|f| f.path.file_name().unwrap().to_string_lossy().to_string())
            .collect();
        assert_eq!(
            names,
            vec![
                "nf_conntrack_max",
                "hashsize",
                "nf_conntrack_tcp_timeout_established",
                "nf_conntrack_tcp_timeout_close_wait",
            ]
        );
        assert!(
            failures
                .iter()
                .all(|f| f.problem.contains("nf_conntrack module")),
            "{err}"
        );
        assert!(!err.ipvs_missing());
    }

    #[test]
    fn conntrack_failures_do_not_stop_the_rest() {
        let t = CtTree::new("ct-partial", 65536, 16384);
        fs::write(t.sys.0.join(CONNTRACK_HASHSIZE), "garbage\n").unwrap();
        let err = t.apply(&upstream_defaults(), 2).unwrap_err();
        let SysctlError::Failed { failures, applied } = err else {
            panic!()
        };
        assert_eq!(failures.len(), 1);
        assert!(failures[0].path.ends_with(CONNTRACK_HASHSIZE));
        assert!(failures[0].problem.contains("garbage"), "{:?}", failures[0]);
        assert_eq!(applied.len(), 3, "max and both TCP timeouts: {applied:?}");
    }

    #[test]
    fn cpu_count_reads_the_online_list_under_the_sys_root() {
        let t = CtTree::new("ct-cpus", 1, 1);
        assert_eq!(cpu_count(&t.sys.0), 8);
        fs::write(t.sys.0.join(CPUS_ONLINE), "0-1,4-5\n").unwrap();
        assert_eq!(cpu_count(&t.sys.0), 4);
        // No list: what this process can use, at least 1.
        fs::remove_file(t.sys.0.join(CPUS_ONLINE)).unwrap();
        assert!(cpu_count(&t.sys.0) >= 1);
    }
}
