//! The sysctls IPVS mode needs and kube-proxy's `conntrack.*` settings, applied at startup.

use super::*;

/// Sets the sysctls IPVS mode needs under `root` (normally `/proc/sys`). Failures are logged:
/// the proxy still works without most of them.
///
/// The kernel version that decides `conn_reuse_mode` is the running kernel's, read from this
/// process's own `/proc/sys/kernel/osrelease` (the host kernel's in a container), not from under
/// `root`: the DaemonSet mounts only the host's `/proc/sys/net` there. Upstream reads the same
/// file (`utilkernel.GetVersion` in pkg/util/kernel, `/proc/sys/kernel/osrelease`), called from
/// the IPVS proxier's `NewProxier` for the conn_reuse_mode decision.
pub fn apply_sysctls(root: &Path, strict_arp: bool) {
    let kernel = match sysctl::running_kernel_version() {
        Ok(k) => {
            tracing::info!(
                kernel = %format!("{}.{}.{}", k.0, k.1, k.2),
                "kernel version for the IPVS sysctls (conn_reuse_mode)"
            );
            k
        }
        Err(e) => {
            tracing::warn!(error = %e, "cannot read the kernel version; conn_reuse_mode left alone");
            (9999, 0, 0)
        }
    };
    let desired = sysctl::desired_sysctls(kernel, strict_arp);
    if let Err(e) = sysctl::apply_sysctls(root, &desired) {
        tracing::error!(error = %e, "sysctls");
    }
}

/// kube-proxy's `conntrack.*` settings in the kernel's units. Durations count in whole seconds
/// (like upstream); one under a second leaves the kernel's value instead of writing 0.
pub fn conntrack_settings(config: &Config) -> sysctl::ConntrackSettings {
    let c = &config.conntrack;
    sysctl::ConntrackSettings {
        max_per_core: c.max_per_core,
        min: c.min,
        tcp_established_timeout: c.tcp_established_timeout.as_secs(),
        tcp_close_wait_timeout: c.tcp_close_wait_timeout.as_secs(),
        tcp_be_liberal: c.tcp_be_liberal,
        udp_timeout: c.udp_timeout.as_secs(),
        udp_stream_timeout: c.udp_stream_timeout.as_secs(),
    }
}

/// Applies the `conntrack.*` settings at startup, in either mode, like kube-proxy: a value that
/// must change and cannot is an error (kube-proxy exits too). Sysfs mounted read-only when the
/// hash size must grow is only a warning; its text is returned for a Node Event.
pub fn apply_conntrack(config: &Config) -> Result<Option<String>, crate::Error> {
    let settings = conntrack_settings(config);
    let cpus = sysctl::cpu_count(&config.sysfs_root);
    match sysctl::apply_conntrack(&config.sysctl_root, &config.sysfs_root, &settings, cpus) {
        Ok(report) => {
            tracing::debug!(
                nf_conntrack_max = report.max,
                cpus = report.cpus,
                changed = report.changes.len(),
                "conntrack settings applied"
            );
            Ok(report.read_only_sysfs.map(|f| {
                format!(
                    "/sys is read-only: cannot raise the conntrack hash size for nf_conntrack_max {} ({f}); \
                     the limit applies, with longer hash chains",
                    report.max
                )
            }))
        }
        Err(e) => Err(crate::Error::Conntrack(e.to_string())),
    }
}
