//! Mode handover: removing what the other mode (IPVS mode, or iptables mode) left behind.

use super::*;

/// What a mode-handover cleanup removed.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CleanupReport {
    /// Chains removed (or flushed, marked so), per table.
    pub chains: Vec<String>,
    /// Rules deleted from chains we do not own (jumps from built-in chains, references).
    pub rules_deleted: usize,
    /// ipsets destroyed.
    pub ipsets: Vec<String>,
    /// kube-ipvs0 was deleted.
    pub link_deleted: bool,
    /// IPVS virtual servers deleted.
    pub ipvs_services: usize,
}

impl CleanupReport {
    /// True when nothing was there to remove.
    pub fn is_empty(&self) -> bool {
        self.chains.is_empty()
            && self.rules_deleted == 0
            && self.ipsets.is_empty()
            && !self.link_deleted
            && self.ipvs_services == 0
    }
}

/// Chains both modes use (never deleted on handover; flushed when they hold the other mode's
/// rules, and refilled by the next sync of the mode that starts).
fn shared_chain(table: Table, chain: &str) -> bool {
    match table {
        Table::Nat => matches!(
            chain,
            "KUBE-SERVICES" | "KUBE-POSTROUTING" | "KUBE-MARK-MASQ"
        ),
        Table::Filter => matches!(chain, "KUBE-FORWARD" | "KUBE-PROXY-FIREWALL"),
        _ => false,
    }
}

/// Removes IPVS-mode leftovers when iptables mode starts: the IPVS-mode chains and their jumps
/// (shared chains holding ipset matches are flushed), then the `KUBE-*` ipsets of `cfg`'s family
/// (after the rules that referenced them), then kube-ipvs0 (when `link` is given), then the IPVS
/// virtual servers the proxy owns (when an IPVS client is given; without IPVS there are none).
/// Idempotent: a second call removes nothing.
pub fn cleanup_ipvs_mode_leftovers(
    cfg: &ProxyConfig,
    iptables: &mut dyn RestoreRunner,
    ipset: &ipset::Ipset,
    link: Option<(&netif::Netif, &tokio::runtime::Handle)>,
    ipvs: Option<&mut ipvs_netlink::Client>,
) -> Result<CleanupReport, KernelError> {
    let mut report = CleanupReport::default();
    let ipvs_chains = iptables::ipvs_chains();
    for table in [Table::Nat, Table::Filter] {
        let owns = |c: &str| ipvs_chains.iter().any(|(t, n)| *t == table && *n == c);
        let shared = |c: &str| shared_chain(table, c);
        let owned_rule = |spec: &str| spec.contains("--match-set KUBE-");
        let own = proxy_mode::Ownership {
            owns: &owns,
            shared: &shared,
            owned_rule: &owned_rule,
        };
        let saved = iptables.save(table)?;
        if let Some((text, removed, deleted)) = proxy_mode::leftover_cleanup(table, &saved, &own) {
            iptables.restore(&text)?;
            report
                .chains
                .extend(removed.into_iter().map(|c| format!("{table} {c}")));
            report.rules_deleted += deleted;
        }
    }
    let fam = cfg.family;
    let names = ipset::SetKind::all_names(fam);
    let current = ipset.read(&names)?;
    let diff = ipset::diff(&ipset::IpsetState::new(), &current);
    if !diff.is_empty() {
        report.ipsets = diff.destroys.clone();
        ipset.apply(&diff)?;
    }
    if let Some((netif, rt)) = link {
        report.link_deleted = rt.block_on(netif.delete_dummy())?;
    }
    if let Some(client) = ipvs {
        let owned = desired::owned_by_proxy(cfg);
        let ops: Vec<ipvs_netlink::Op> = client
            .dump()?
            .into_iter()
            .filter(|(s, _)| owned(&s.key))
            .map(|(s, _)| ipvs_netlink::Op::DelService(s.key))
            .collect();
        for r in client.apply(&ops) {
            r?;
            report.ipvs_services += 1;
        }
    }
    if !report.is_empty() {
        tracing::info!(?report, "removed IPVS-mode leftovers");
    }
    Ok(report)
}

/// Removes the iptables mode's chains and their jumps. `handover` (IPVS mode starting) keeps
/// the chains IPVS mode shares (flushing them only when they reference our chains); without it
/// (`--cleanup`) every chain of the mode is deleted. Idempotent.
pub fn cleanup_iptables_mode(
    iptables: &mut dyn RestoreRunner,
    handover: bool,
) -> Result<CleanupReport, KernelError> {
    let mut report = CleanupReport::default();
    for table in [Table::Nat, Table::Filter] {
        let owns = |c: &str| proxy_mode::owns_chain(table, c);
        let shared = |c: &str| handover && shared_chain(table, c);
        let owned_rule = |_: &str| false;
        let own = proxy_mode::Ownership {
            owns: &owns,
            shared: &shared,
            owned_rule: &owned_rule,
        };
        let saved = iptables.save(table)?;
        if let Some((text, removed, deleted)) = proxy_mode::leftover_cleanup(table, &saved, &own) {
            iptables.restore(&text)?;
            report
                .chains
                .extend(removed.into_iter().map(|c| format!("{table} {c}")));
            report.rules_deleted += deleted;
        }
    }
    if !report.is_empty() {
        tracing::info!(?report, "removed iptables-mode rules");
    }
    Ok(report)
}
