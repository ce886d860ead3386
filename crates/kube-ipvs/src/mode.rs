//! Proxy mode selection: IPVS if asked for and usable, else iptables (or an error).

use crate::config::{Config, ProxyMode};
use crate::error::{Error, Result};

/// A cheap check that the kernel has IPVS: `/proc/net/ip_vs` exists once `ip_vs` is loaded
/// (built in or as a module). A stricter probe can replace it via [`select`]'s argument.
pub fn probe_ipvs() -> std::result::Result<(), String> {
    if std::path::Path::new("/proc/net/ip_vs").exists() {
        Ok(())
    } else {
        Err("the kernel has no IPVS (no /proc/net/ip_vs; is the ip_vs module loaded?)".into())
    }
}

/// The mode to run in. `probe` is called only when IPVS mode is asked for. If it fails,
/// kube-ipvs falls back to iptables mode with a loud warning, unless `--ipvs-fallback=false`.
pub fn select(
    config: &Config,
    probe: impl FnOnce() -> std::result::Result<(), String>,
) -> Result<ProxyMode> {
    match config.mode {
        ProxyMode::Iptables => Ok(ProxyMode::Iptables),
        ProxyMode::Ipvs => match probe() {
            Ok(()) => Ok(ProxyMode::Ipvs),
            Err(reason) if config.ipvs_fallback => {
                tracing::warn!(
                    reason = %reason,
                    "IPVS IS NOT USABLE: FALLING BACK TO IPTABLES MODE (set --ipvs-fallback=false to fail instead)"
                );
                Ok(ProxyMode::Iptables)
            }
            Err(reason) => Err(Error::IpvsUnavailable { reason }),
        },
    }
}
