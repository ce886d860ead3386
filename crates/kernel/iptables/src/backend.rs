//! iptables backends (nft vs legacy): program names, version parsing and detection (pure).

use ipset::Family;

/// Which iptables backend the node uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Backend {
    /// iptables-nft (nf_tables kernel API).
    Nft,
    /// iptables-legacy (x_tables kernel API).
    Legacy,
}

impl Backend {
    fn suffix(self) -> &'static str {
        match self {
            Backend::Nft => "nft",
            Backend::Legacy => "legacy",
        }
    }

    fn prefix(family: Family) -> &'static str {
        match family {
            Family::Inet => "iptables",
            Family::Inet6 => "ip6tables",
        }
    }

    /// `iptables-nft-restore`, `ip6tables-legacy-restore`, …
    pub fn restore_program(self, family: Family) -> String {
        format!("{}-{}-restore", Backend::prefix(family), self.suffix())
    }

    /// `iptables-nft-save`, …
    pub fn save_program(self, family: Family) -> String {
        format!("{}-{}-save", Backend::prefix(family), self.suffix())
    }

    /// `iptables-nft`, … (for `--version`).
    pub fn program(self, family: Family) -> String {
        format!("{}-{}", Backend::prefix(family), self.suffix())
    }
}

/// Parse `iptables --version` output, e.g. `iptables v1.8.9 (nf_tables)`: the version and, if
/// printed, the backend.
pub fn parse_version(s: &str) -> Option<((u32, u32, u32), Option<Backend>)> {
    let v = s.split_whitespace().find_map(|w| w.strip_prefix('v'))?;
    let mut parts = v.split('.').map(|p| p.parse::<u32>().ok());
    let major = parts.next()??;
    let minor = parts.next().flatten().unwrap_or(0);
    let patch = parts.next().flatten().unwrap_or(0);
    let backend = if s.contains("(nf_tables)") {
        Some(Backend::Nft)
    } else if s.contains("(legacy)") {
        Some(Backend::Legacy)
    } else {
        None
    };
    Some(((major, minor, patch), backend))
}

/// `--random-fully` needs iptables ≥ 1.6.2 (as upstream checks).
pub fn random_fully_supported(version: (u32, u32, u32)) -> bool {
    version >= (1, 6, 2)
}

/// How strongly a save output shows that Kubernetes components use this backend: kubelet's hint
/// and canary chains count most, then any KUBE- chain.
fn kube_score(save: &str) -> usize {
    let mut score = 0;
    for l in save.lines() {
        if l.starts_with(":KUBE-IPTABLES-HINT") || l.starts_with(":KUBE-KUBELET-CANARY") {
            score += 1000;
        } else if l.starts_with(":KUBE-") {
            score += 1;
        }
    }
    score
}

/// Choose the backend like kubelet's iptables wrapper: the one whose rules already carry
/// Kubernetes chains; otherwise what `iptables --version` says; otherwise nft.
pub fn pick_backend(
    legacy_save: Option<&str>,
    nft_save: Option<&str>,
    default_version_backend: Option<Backend>,
) -> Backend {
    let l = legacy_save.map(kube_score).unwrap_or(0);
    let n = nft_save.map(kube_score).unwrap_or(0);
    if l > n {
        Backend::Legacy
    } else if n > l {
        Backend::Nft
    } else {
        default_version_backend.unwrap_or(Backend::Nft)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_versions() {
        assert_eq!(
            parse_version("iptables v1.8.9 (nf_tables)\n"),
            Some(((1, 8, 9), Some(Backend::Nft)))
        );
        assert_eq!(
            parse_version("iptables v1.8.7 (legacy)"),
            Some(((1, 8, 7), Some(Backend::Legacy)))
        );
        assert_eq!(parse_version("iptables v1.6.1"), Some(((1, 6, 1), None)));
        assert_eq!(parse_version("garbage"), None);
        assert!(random_fully_supported((1, 6, 2)));
        assert!(random_fully_supported((1, 8, 0)));
        assert!(!random_fully_supported((1, 6, 1)));
        assert!(!random_fully_supported((1, 4, 21)));
    }

    #[test]
    fn picks_backend_with_kube_chains() {
        let kubelet = "*mangle\n:KUBE-IPTABLES-HINT - [0:0]\nCOMMIT\n";
        let some = "*nat\n:KUBE-SERVICES - [0:0]\n:KUBE-POSTROUTING - [0:0]\nCOMMIT\n";
        let empty = "*nat\n:PREROUTING ACCEPT [0:0]\nCOMMIT\n";
        assert_eq!(
            pick_backend(Some(kubelet), Some(some), Some(Backend::Nft)),
            Backend::Legacy
        );
        assert_eq!(
            pick_backend(Some(empty), Some(some), Some(Backend::Legacy)),
            Backend::Nft
        );
        assert_eq!(
            pick_backend(Some(empty), Some(empty), Some(Backend::Legacy)),
            Backend::Legacy
        );
        assert_eq!(pick_backend(None, None, None), Backend::Nft);
        assert_eq!(
            Backend::Legacy.restore_program(Family::Inet6),
            "ip6tables-legacy-restore"
        );
        assert_eq!(Backend::Nft.save_program(Family::Inet), "iptables-nft-save");
    }
}
