//! The shared chains' static rules, the one `iptables-restore` payload for both tables, the
//! jump fixes, and the cleanup of another proxy's leftovers.

use super::*;

/// The rules of the shared chains that do not depend on services, per (table, chain), in order.
/// `KUBE-SERVICES`'s final NodePort jump is appended by [`restore_payload`].
pub fn static_rules(cfg: &ProxyModeConfig) -> Result<Vec<(Table, &'static str, String)>> {
    let mark = cfg.mark()?;
    let mut v = vec![
        (
            Table::Nat,
            POSTROUTING,
            format!("-A {POSTROUTING} -m mark ! --mark {mark} -j RETURN"),
        ),
        (
            Table::Nat,
            POSTROUTING,
            format!(
                "-A {POSTROUTING} -j MARK --set-xmark {}/0x0",
                mark.split('/').next().unwrap_or_default()
            ),
        ),
        (
            Table::Nat,
            POSTROUTING,
            format!(
                "-A {POSTROUTING} -m comment --comment {} -j MASQUERADE{}",
                quote("kubernetes service traffic requiring SNAT"),
                if cfg.random_fully {
                    " --random-fully"
                } else {
                    ""
                }
            ),
        ),
        (
            Table::Nat,
            MARK_MASQ,
            format!("-A {MARK_MASQ} -j MARK --set-xmark {mark}"),
        ),
        (
            Table::Filter,
            FORWARD,
            format!("-A {FORWARD} -m conntrack --ctstate INVALID -j DROP"),
        ),
        (
            Table::Filter,
            FORWARD,
            format!(
                "-A {FORWARD} -m comment --comment {} -m mark --mark {mark} -j ACCEPT",
                quote("kubernetes forwarding rules")
            ),
        ),
        (
            Table::Filter,
            FORWARD,
            format!(
                "-A {FORWARD} -m comment --comment {} -m conntrack --ctstate RELATED,ESTABLISHED -j ACCEPT",
                quote("kubernetes forwarding conntrack rule")
            ),
        ),
    ];
    if cfg.localhost_firewall() {
        // Upstream syncProxyRules: with route_localnet=1, drop packets to 127.0.0.0/8 from
        // elsewhere unless conntrack knows them (issue 90259). The same rule as kubelet's.
        v.push((
            Table::Filter,
            KUBELET_FIREWALL,
            format!(
                "-A {KUBELET_FIREWALL} ! -s 127.0.0.0/8 -d 127.0.0.0/8 -m comment --comment {} \
                 -m conntrack ! --ctstate RELATED,ESTABLISHED,DNAT -j DROP",
                quote("block incoming localnet connections")
            ),
        ));
    }
    let np = "kubernetes service nodeports; NOTE: this must be the last rule in this chain";
    match &cfg.node_port_ips {
        None => {
            // Upstream syncProxyRules: localhost NodePorts never work on IPv6, and on IPv4
            // only with route_localnet (localhostNodePorts), so exclude loopback otherwise.
            let not_lo = match cfg.family {
                Family::Inet6 => "! -d ::1/128 ",
                Family::Inet if !cfg.localhost_node_ports => "! -d 127.0.0.0/8 ",
                Family::Inet => "",
            };
            v.push((
                Table::Nat,
                SERVICES,
                format!(
                    "-A {SERVICES} {not_lo}-m comment --comment {} -m addrtype --dst-type LOCAL -j {NODEPORTS}",
                    quote(np)
                ),
            ))
        }
        Some(ips) => {
            // Loopback addresses only with localhost NodePorts (upstream skips them, with an
            // error log, for IPv6 or with localhostNodePorts false).
            for ip in ips
                .iter()
                .filter(|ip| Family::of(ip) == cfg.family)
                .filter(|ip| !ip.is_loopback() || cfg.localhost_firewall())
            {
                v.push((
                    Table::Nat,
                    SERVICES,
                    format!(
                        "-A {SERVICES} -d {ip}/{} -m comment --comment {} -j {NODEPORTS}",
                        cfg.host_len(),
                        quote(np)
                    ),
                ));
            }
        }
    }
    Ok(v)
}

/// What one restore writes.
#[derive(Debug, Clone, Copy)]
pub struct PayloadInput<'a> {
    /// Configuration.
    pub cfg: &'a ProxyModeConfig,
    /// Every service port's rendered rules (shared-chain lines come from all of them), in the
    /// order their lines should appear.
    pub ports: &'a [&'a RenderedServicePort],
    /// Per-service chains to (re)write: name → rules (borrowed from the rendered ports: a
    /// full sync at 5,000 Services x 10 endpoints writes 55,000 chains, not copied again).
    pub write: &'a BTreeMap<&'a str, &'a [String]>,
    /// Per-service chains to delete (flushed, then `-X` after every reference is gone).
    pub delete: &'a BTreeSet<String>,
    /// Jump lines to add or remove in built-in chains (`-I …` / `-D …`), per table.
    pub jump_fixes: &'a BTreeMap<Table, Vec<String>>,
}

/// Assembles one `iptables-restore --noflush` payload for both tables: the shared chains
/// flushed and refilled, the given per-service chains rewritten, stale ones deleted.
pub fn restore_payload(input: &PayloadInput<'_>) -> Result<String> {
    let statics = static_rules(input.cfg)?;
    let mut out =
        String::with_capacity(256 + input.write.values().map(|r| r.len() * 160).sum::<usize>());
    for table in [Table::Nat, Table::Filter] {
        out.push_str(&format!("*{table}\n"));
        let chains: Vec<&str> = input
            .cfg
            .chains()
            .into_iter()
            .filter(|(t, _)| *t == table)
            .map(|(_, c)| c)
            .collect();
        for c in &chains {
            out.push_str(&format!(":{c} - [0:0]\n"));
        }
        if table == Table::Nat {
            for c in input
                .write
                .keys()
                .copied()
                .chain(input.delete.iter().map(String::as_str))
            {
                out.push_str(&format!(":{c} - [0:0]\n"));
            }
        }
        for c in &chains {
            if table == Table::Nat && *c == SERVICES {
                // Service lines first; the NodePort jump must be last.
                for p in input.ports {
                    for l in p.shared.get(&(table, *c)).into_iter().flatten() {
                        out.push_str(l);
                        out.push('\n');
                    }
                }
                for (_, _, l) in statics.iter().filter(|(t, ch, _)| *t == table && ch == c) {
                    out.push_str(l);
                    out.push('\n');
                }
                continue;
            }
            for (_, _, l) in statics.iter().filter(|(t, ch, _)| *t == table && ch == c) {
                out.push_str(l);
                out.push('\n');
            }
            for p in input.ports {
                for l in p.shared.get(&(table, *c)).into_iter().flatten() {
                    out.push_str(l);
                    out.push('\n');
                }
            }
        }
        if table == Table::Nat {
            for rules in input.write.values() {
                for l in rules.iter() {
                    out.push_str(l);
                    out.push('\n');
                }
            }
            for c in input.delete {
                out.push_str(&format!("-X {c}\n"));
            }
        }
        for l in input.jump_fixes.get(&table).into_iter().flatten() {
            out.push_str(l);
            out.push('\n');
        }
        out.push_str("COMMIT\n");
    }
    Ok(out)
}

/// From an `iptables-save -t TABLE` output: the jump lines to insert (missing) and delete
/// (duplicates) so each of [`jumps`] is present exactly once.
pub fn jump_fixes(table: Table, saved: &str) -> Vec<String> {
    jump_fixes_of(&jumps(), table, saved)
}

/// [`jump_fixes`] for the jumps a sync with `cfg` keeps ([`jumps_for`]).
pub fn jump_fixes_for(cfg: &ProxyModeConfig, table: Table, saved: &str) -> Vec<String> {
    jump_fixes_of(&jumps_for(cfg), table, saved)
}

pub(super) fn jump_fixes_of(jumps: &[ModeJump], table: Table, saved: &str) -> Vec<String> {
    let mut fixes = Vec::new();
    for j in jumps.iter().filter(|j| j.table == table) {
        let want = j.save_line();
        let n = saved.lines().filter(|l| l.trim_end() == want).count();
        if n == 0 {
            fixes.push(format!("-I {} {}", j.from, j.spec()));
        }
        for _ in 1..n {
            fixes.push(format!("-D {} {}", j.from, j.spec()));
        }
    }
    fixes
}

/// Chains declared in an `iptables-save` output (`:NAME POLICY [..]` lines).
pub fn saved_chains(saved: &str) -> BTreeSet<String> {
    saved
        .lines()
        .filter_map(|l| l.strip_prefix(':'))
        .filter_map(|l| l.split_whitespace().next())
        .map(str::to_string)
        .collect()
}

/// Which chains of an `iptables-save -t TABLE` output a mode owns and which rules in other
/// chains must go with them.
pub struct Ownership<'a> {
    /// True for chains the mode owns (removed: flushed, then deleted).
    pub owns: &'a dyn Fn(&str) -> bool,
    /// True for chains the mode shares with the other mode (flushed only when they hold a
    /// rule that matches `owned_rule`, never deleted).
    pub shared: &'a dyn Fn(&str) -> bool,
    /// True for a rule (the part after `-A CHAIN `) that belongs to the mode even in a chain it
    /// does not own (e.g. matches one of its ipsets).
    pub owned_rule: &'a dyn Fn(&str) -> bool,
}

/// The restore payload that removes a mode's leftovers from one table, given its current
/// `iptables-save -t TABLE` text: rules in other chains that jump to an owned chain (or are owned
/// rules) are deleted one by one, owned chains are flushed and deleted. Returns `None` when
/// nothing is there, plus what it removes (chain names and the count of deleted rules).
pub fn leftover_cleanup(
    table: Table,
    saved: &str,
    own: &Ownership<'_>,
) -> Option<(String, Vec<String>, usize)> {
    let present = saved_chains(saved);
    let owned: Vec<&String> = present
        .iter()
        .filter(|c| (own.owns)(c) && !(own.shared)(c))
        .collect();
    let mut text = format!("*{table}\n");
    for c in &owned {
        text.push_str(&format!(":{c} - [0:0]\n"));
    }
    let mut deleted = 0;
    let mut flushed_shared = Vec::new();
    for l in saved.lines() {
        let Some(rest) = l.strip_prefix("-A ") else {
            continue;
        };
        let Some((chain, spec)) = rest.split_once(' ') else {
            continue;
        };
        if owned.iter().any(|c| c.as_str() == chain) {
            continue; // flushed with the chain
        }
        let target = spec
            .split_whitespace()
            .skip_while(|w| *w != "-j" && *w != "-g")
            .nth(1)
            .unwrap_or_default();
        let to_owned = owned.iter().any(|c| c.as_str() == target);
        if (own.shared)(chain) && (to_owned || (own.owned_rule)(spec)) {
            if !flushed_shared.iter().any(|c| c == chain) {
                flushed_shared.push(chain.to_string());
            }
            continue;
        }
        if to_owned || (own.owned_rule)(spec) {
            text.push_str(&format!("-D {chain} {spec}\n"));
            deleted += 1;
        }
    }
    for c in &flushed_shared {
        text.push_str(&format!("-F {c}\n"));
    }
    for c in &owned {
        text.push_str(&format!("-X {c}\n"));
    }
    text.push_str("COMMIT\n");
    if owned.is_empty() && deleted == 0 && flushed_shared.is_empty() {
        return None;
    }
    let mut removed: Vec<String> = owned.iter().map(|c| c.to_string()).collect();
    removed.extend(flushed_shared.iter().map(|c| format!("{c} (flushed)")));
    Some((text, removed, deleted))
}
