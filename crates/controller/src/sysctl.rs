//! Kernel sysctls the proxy needs (IPVS conntrack, expire_nodest_conn, conn_reuse_mode, strict ARP).
//!
//! Pure part: [`parse_kernel_version`] and [`desired_sysctls`] decide what the node should have.
//! IO part: [`apply_sysctls`] reads each value under a sysctl root (`/proc/sys`, or a temporary
//! tree in tests), writes only the ones that differ, logs each change, and keeps going past
//! failures so one missing subsystem does not stop the rest.

use std::fmt;
use std::io::ErrorKind;
use std::path::{Path, PathBuf};

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

/// Read the running kernel's version from `kernel/osrelease` under `root`.
pub fn kernel_version(root: &Path) -> Result<KernelVersion, SysctlError> {
    let path = root.join("kernel/osrelease");
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
        let old = match std::fs::read_to_string(&path) {
            Ok(t) => t.trim().to_string(),
            Err(e) => {
                let problem = if e.kind() == ErrorKind::NotFound {
                    "does not exist in this kernel".to_string()
                } else {
                    format!("read: {e}")
                };
                failures.push(SysctlFailure { path, problem });
                continue;
            }
        };
        if old == want {
            continue;
        }
        if let Err(e) = std::fs::write(&path, want) {
            failures.push(SysctlFailure {
                path,
                problem: format!("write {want}: {e}"),
            });
            continue;
        }
        tracing::info!(sysctl = %path.display(), old = %old, new = want, reason = %s.reason, "set sysctl");
        applied.push(Change {
            path,
            old,
            new: want.to_string(),
        });
    }
    if failures.is_empty() {
        Ok(applied)
    } else {
        Err(SysctlError::Failed { failures, applied })
    }
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
}
