//! Localhost NodePorts in iptables mode: `net/ipv4/conf/all/route_localnet=1`.
//!
//! With `iptables.localhostNodePorts` (default true) and NodePorts on every address (or
//! `nodePortAddresses` containing 127.0.0.0/8), iptables mode DNATs connections to
//! `127.0.0.1:<nodePort>`; the kernel routes a packet with a 127/8 source to a pod only with
//! `route_localnet=1`. The rules side (the `! -d 127.0.0.0/8` exclusion and kubelet's
//! anti-martian `KUBE-FIREWALL` rule) is in `iptables::proxy_mode`. IPVS mode never serves
//! NodePorts on localhost, like upstream's IPVS mode.

use std::path::{Path, PathBuf};

use sysctl::{Sysctl, SysctlError};

/// The sysctl localhost NodePorts need (relative to the sysctl root).
pub const ROUTE_LOCALNET: &str = "net/ipv4/conf/all/route_localnet";

/// Setting `route_localnet` failed; like upstream's `NewProxier`, iptables mode does not start.
#[derive(Debug, thiserror::Error)]
#[error(
    "cannot set {path} to 1 for localhost NodePorts ({source}); set iptables.localhostNodePorts \
     to false (--iptables-localhost-nodeports=false) or leave 127.0.0.0/8 out of nodePortAddresses"
)]
pub struct RouteLocalnetError {
    /// The sysctl file.
    pub path: PathBuf,
    /// Why.
    #[source]
    pub source: SysctlError,
}

/// Sets `route_localnet=1` under `root` (normally `/proc/sys`), logging it like upstream's
/// iptables `NewProxier` (pkg/proxy/iptables/proxier.go, `EnsureSysctl(sysctlRouteLocalnet, 1)`
/// after "Setting route_localnet=1 to allow node-ports on localhost"). Only writes when the
/// value differs.
pub fn enable_route_localnet(root: &Path) -> Result<(), RouteLocalnetError> {
    tracing::info!(
        "Setting route_localnet=1 to allow node-ports on localhost; to change this either disable \
         iptables.localhostNodePorts (--iptables-localhost-nodeports) or set nodePortAddresses \
         (--nodeport-addresses) to filter loopback addresses"
    );
    let want = [Sysctl {
        path: ROUTE_LOCALNET,
        value: Some("1"),
        reason: "iptables mode: NodePorts on 127.0.0.1 (iptables.localhostNodePorts)".into(),
    }];
    sysctl::apply_sysctls(root, &want)
        .map(|_| ())
        .map_err(|source| RouteLocalnetError {
            path: root.join(ROUTE_LOCALNET),
            source,
        })
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::*;

    fn temp_dir(tag: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("kube-ipvs-lo-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        d
    }

    #[test]
    fn route_localnet_is_written_under_the_sysctl_root() {
        let dir = temp_dir("write");
        let f = dir.join(ROUTE_LOCALNET);
        std::fs::create_dir_all(f.parent().unwrap()).unwrap();
        std::fs::write(&f, "0\n").unwrap();
        enable_route_localnet(&dir).unwrap();
        assert_eq!(std::fs::read_to_string(&f).unwrap().trim(), "1");
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn a_missing_route_localnet_is_an_error_naming_the_setting() {
        let dir = temp_dir("missing");
        let e = enable_route_localnet(&dir).unwrap_err();
        let text = e.to_string();
        assert!(text.contains("route_localnet"), "{text}");
        assert!(text.contains("iptables.localhostNodePorts"), "{text}");
        let _ = std::fs::remove_dir_all(&dir);
    }
}
