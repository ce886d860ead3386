//! VM test: the proxy's sysctls applied to the real /proc/sys and read back (also through
//! busybox `sysctl`), with the conn_reuse_mode rule checked against the running kernel.

// Test-only helpers outside #[test] fns may panic on failure.
#![allow(clippy::unwrap_used)]

use std::path::Path;
use std::process::Command;

use sysctl::{apply_sysctls, desired_sysctls, kernel_version, PROC_SYS};

fn read(p: &str) -> String {
    std::fs::read_to_string(Path::new(PROC_SYS).join(p))
        .unwrap()
        .trim()
        .to_string()
}

fn write(p: &str, v: &str) {
    std::fs::write(Path::new(PROC_SYS).join(p), v).unwrap();
}

/// Read through a separate program, so the check does not only trust our own file IO.
fn sysctl_tool(p: &str) -> String {
    let key = p.replace('/', ".");
    let out = Command::new("busybox")
        .args(["sysctl", "-n", &key])
        .output();
    match out {
        Ok(o) if o.status.success() => String::from_utf8_lossy(&o.stdout).trim().to_string(),
        _ => {
            let o = Command::new("sysctl").args(["-n", &key]).output().unwrap();
            assert!(o.status.success(), "sysctl -n {key}");
            String::from_utf8_lossy(&o.stdout).trim().to_string()
        }
    }
}

/// Puts the strict-ARP values back so later tests in the same VM see the defaults.
struct Restore(Vec<(&'static str, String)>);
impl Drop for Restore {
    fn drop(&mut self) {
        for (p, v) in &self.0 {
            let _ = std::fs::write(Path::new(PROC_SYS).join(p), v);
        }
    }
}

#[test]
#[ignore = "vm"]
fn vm_sysctls_applied_and_read_back() {
    let root = Path::new(PROC_SYS);
    assert!(
        root.join("net/ipv4/vs").is_dir(),
        "ip_vs must be loaded in the VM"
    );
    let kernel = kernel_version(root).unwrap();
    let release = read("kernel/osrelease");
    assert!(
        release.starts_with(&format!("{}.{}", kernel.0, kernel.1)),
        "{release} vs {kernel:?}"
    );

    let _restore = Restore(vec![
        (
            "net/ipv4/conf/all/arp_ignore",
            read("net/ipv4/conf/all/arp_ignore"),
        ),
        (
            "net/ipv4/conf/all/arp_announce",
            read("net/ipv4/conf/all/arp_announce"),
        ),
    ]);
    // Start from values the proxy must change.
    write("net/ipv4/vs/conntrack", "0");
    write("net/ipv4/vs/expire_nodest_conn", "0");
    write("net/ipv4/vs/expire_quiescent_template", "0");
    write("net/ipv4/ip_forward", "0");
    write("net/ipv4/vs/conn_reuse_mode", "1");
    write("net/ipv4/conf/all/arp_ignore", "0");
    write("net/ipv4/conf/all/arp_announce", "0");

    let changes = apply_sysctls(root, &desired_sysctls(kernel, true)).unwrap();
    let changed: Vec<String> = changes
        .iter()
        .map(|c| c.path.strip_prefix(root).unwrap().display().to_string())
        .collect();

    for (p, v) in [
        ("net/ipv4/vs/conntrack", "1"),
        ("net/ipv4/vs/expire_nodest_conn", "1"),
        ("net/ipv4/vs/expire_quiescent_template", "1"),
        ("net/ipv4/ip_forward", "1"),
        ("net/ipv4/conf/all/arp_ignore", "1"),
        ("net/ipv4/conf/all/arp_announce", "2"),
    ] {
        assert_eq!(read(p), v, "{p}");
        assert_eq!(sysctl_tool(p), v, "{p} via sysctl");
        assert!(
            changed.iter().any(|c| c == p),
            "{p} not reported as changed: {changed:?}"
        );
    }
    // conn_reuse_mode: 0 only for 4.1 <= kernel < 5.9; the VM's 6.1 keeps the kernel value.
    let old_kernel = ((4, 1, 0)..(5, 9, 0)).contains(&kernel);
    let want_reuse = if old_kernel { "0" } else { "1" };
    assert_eq!(
        read("net/ipv4/vs/conn_reuse_mode"),
        want_reuse,
        "kernel {release}"
    );
    assert_eq!(
        changed.iter().any(|c| c.ends_with("conn_reuse_mode")),
        old_kernel,
        "{changed:?}"
    );

    // Applying again changes nothing.
    assert!(apply_sysctls(root, &desired_sysctls(kernel, true))
        .unwrap()
        .is_empty());
}

/// Puts global conntrack values back (nf_conntrack_max under /proc/sys, the hash size under /sys).
struct RestoreFiles(Vec<(std::path::PathBuf, String)>);
impl Drop for RestoreFiles {
    fn drop(&mut self) {
        for (p, v) in &self.0 {
            let _ = std::fs::write(p, v);
        }
    }
}

/// The initial network namespace, where nf_conntrack_max and the hash size are writable: both
/// are raised to what the settings ask for, a second run writes nothing, and a smaller request
/// lowers neither.
#[test]
#[ignore = "vm"]
fn vm_conntrack_max_and_hash_size_raised_in_the_initial_namespace() {
    use sysctl::{apply_conntrack, ConntrackSettings, CONNTRACK_HASHSIZE, CONNTRACK_MAX, SYS};
    let (proc_sys, sys) = (Path::new(PROC_SYS), Path::new(SYS));
    let max_file = proc_sys.join(CONNTRACK_MAX);
    let hash_file = sys.join(CONNTRACK_HASHSIZE);
    assert!(max_file.exists(), "nf_conntrack must be loaded in the VM");
    let old_max: u64 = read(CONNTRACK_MAX).parse().unwrap();
    let old_hash: u64 = std::fs::read_to_string(&hash_file)
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    let _restore = RestoreFiles(vec![
        (max_file.clone(), old_max.to_string()),
        (hash_file.clone(), old_hash.to_string()),
    ]);

    // Ask for twice the current table and more than 4 entries per current bucket.
    let want = (old_max * 2).max(old_hash * 8);
    let settings = ConntrackSettings {
        max_per_core: 1,
        min: u32::try_from(want).unwrap(),
        ..ConntrackSettings::default()
    };
    let r = apply_conntrack(proc_sys, sys, &settings, 1).unwrap();
    assert_eq!(r.max, want);
    assert_eq!(r.changes.len(), 2, "{:?}", r.changes);
    assert_eq!(sysctl_tool(CONNTRACK_MAX), want.to_string());
    let hash: u64 = std::fs::read_to_string(&hash_file)
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    assert_eq!(hash, want / 4);
    // The kernel reports the new bucket count too.
    assert_eq!(
        read("net/netfilter/nf_conntrack_buckets"),
        (want / 4).to_string()
    );

    // Again: nothing to write. Asking for less lowers nothing.
    assert!(apply_conntrack(proc_sys, sys, &settings, 1)
        .unwrap()
        .changes
        .is_empty());
    let smaller = ConntrackSettings {
        min: u32::try_from(old_max).unwrap(),
        ..settings
    };
    assert!(apply_conntrack(proc_sys, sys, &smaller, 1)
        .unwrap()
        .changes
        .is_empty());
    assert_eq!(read(CONNTRACK_MAX), want.to_string());
}
