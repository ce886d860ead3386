//! Invalid Services after a restart: the rules a previous run wrote for them are read back from
//! `iptables-save` and kept applied (their last-good state).

use super::*;

impl IptablesProxier {
    /// Adopts the saved rules of the invalid Services that have no last-good state (see
    /// [`adopt_saved_rules`]); waits for a full sync whose saves both succeeded.
    pub(super) fn adopt_saved(
        &mut self,
        store: &Store,
        saves: &[(Table, Result<String, KernelError>)],
    ) {
        if self.to_adopt.is_empty() {
            return;
        }
        let saved: BTreeMap<Table, &str> = saves
            .iter()
            .filter_map(|(t, r)| r.as_ref().ok().map(|s| (*t, s.as_str())))
            .collect();
        if saved.len() != saves.len() {
            return;
        }
        for name in std::mem::take(&mut self.to_adopt) {
            let Some(svc) = store.service(&name) else {
                continue;
            };
            let ports = adopt_saved_rules(svc, &self.cfg, &saved);
            if ports.is_empty() {
                continue;
            }
            tracing::warn!(service = %name, ports = ports.len(),
                chains = ports.iter().map(|p| p.rendered.chains.len()).sum::<usize>(),
                "invalid service has no last-good state: keeping its saved iptables rules");
            self.services.insert(name, ports);
        }
    }
}

/// The comment of an `iptables-save` line (`--comment "text"` or `--comment text`).
pub(super) fn saved_comment(line: &str) -> Option<&str> {
    let rest = &line[line.find("--comment ")? + "--comment ".len()..];
    match rest.strip_prefix('"') {
        Some(q) => q.split('"').next(),
        None => rest.split_whitespace().next(),
    }
}

/// The target chain of a `-j`/`-g` in a saved line.
pub(super) fn saved_target(line: &str) -> Option<&str> {
    let mut words = line.split_whitespace();
    while let Some(w) = words.next() {
        if w == "-j" || w == "-g" {
            return words.next();
        }
    }
    None
}

/// The rules a previous run wrote for an invalid Service's ports, read back from
/// `iptables-save` (`saved`: nat and filter), as port states to keep applied.
///
/// Same rule as IPVS mode (see [`crate::adopt`]): a Service that exists but is invalid keeps
/// its last-good state, and after a restart that state is what the kernel holds. A port is
/// identified by upstream's `namespace/name:port` string, which every rule of it carries in its
/// comment (`ServicePortName.String()`); its lines in the shared chains are those whose comment
/// names it, and its own chains are those reachable from them (`KUBE-SVC-`, `KUBE-SEP-`, ...),
/// with their saved rules. The ports' model inputs are only what the object still tells
/// (name, protocol, VIPs); endpoints are not known, so conntrack cleanup treats them as none.
pub(super) fn adopt_saved_rules(
    svc: &model::objects::Svc,
    cfg: &ProxyConfig,
    saved: &BTreeMap<Table, &str>,
) -> Vec<PortState> {
    let name = svc.name.clone();
    let claims = crate::adopt::claims(svc, cfg);
    let Some(spec) = svc.spec.as_deref() else {
        return Vec::new();
    };
    let base = proxy_mode::base_chains();
    let nat_rules: BTreeMap<&str, Vec<&str>> = {
        let mut m: BTreeMap<&str, Vec<&str>> = BTreeMap::new();
        let text = saved.get(&Table::Nat).copied().unwrap_or_default();
        for c in text.lines().filter_map(|l| l.strip_prefix(':')) {
            if let Some(c) = c.split_whitespace().next() {
                m.entry(c).or_default();
            }
        }
        for l in text.lines() {
            if let Some(c) = l
                .strip_prefix("-A ")
                .and_then(|r| r.split_whitespace().next())
            {
                m.entry(c).or_default().push(l);
            }
        }
        m
    };
    let own = |c: &str| {
        proxy_mode::SERVICE_CHAIN_PREFIXES
            .iter()
            .any(|p| c.starts_with(p))
    };
    let mut out = Vec::new();
    for p in spec.ports.iter().flatten() {
        let protocol = match p.protocol.as_deref() {
            None | Some("TCP") => Protocol::Tcp,
            Some("UDP") => Protocol::Udp,
            Some("SCTP") => Protocol::Sctp,
            Some(_) => continue,
        };
        let port_name = p.name.as_deref().unwrap_or_default().to_string();
        let id = if port_name.is_empty() {
            name.to_string()
        } else {
            format!("{name}:{port_name}")
        };
        let names_it =
            |c: &str| c == id || c.starts_with(&format!("{id} ")) || c.contains(&format!(" {id} "));
        let mut rendered = RenderedServicePort::default();
        let mut roots = Vec::new();
        for (table, text) in saved {
            for l in text.lines() {
                let Some(chain) = l
                    .strip_prefix("-A ")
                    .and_then(|r| r.split_whitespace().next())
                else {
                    continue;
                };
                let Some(&(_, shared)) = base.iter().find(|(t, c)| t == table && *c == chain)
                else {
                    continue;
                };
                if !saved_comment(l).is_some_and(names_it) {
                    continue;
                }
                rendered
                    .shared
                    .entry((*table, shared))
                    .or_default()
                    .push(l.to_string());
                if *table == Table::Nat {
                    roots.extend(saved_target(l).filter(|t| own(t)));
                }
            }
        }
        // Own chains reachable from the shared lines, with their saved rules.
        while let Some(c) = roots.pop() {
            if rendered.chains.contains_key(c) {
                continue;
            }
            let Some(rules) = nat_rules.get(c) else {
                continue;
            };
            roots.extend(
                rules
                    .iter()
                    .filter_map(|l| saved_target(l))
                    .filter(|t| own(t)),
            );
            rendered
                .chains
                .insert(c.to_string(), rules.iter().map(|l| l.to_string()).collect());
        }
        if rendered.shared.is_empty() && rendered.chains.is_empty() {
            continue;
        }
        let vip = claims.vips.iter().next().copied();
        out.push(PortState {
            rules: ServicePortRules {
                name: id,
                protocol,
                cluster_ip: vip.unwrap_or(match cfg.family {
                    Family::Inet => IpAddr::from([0u8; 4]),
                    Family::Inet6 => IpAddr::from([0u16; 8]),
                }),
                port: u16::try_from(p.port).unwrap_or(0),
                node_port: p.node_port.and_then(|n| u16::try_from(n).ok()),
                external_ips: Vec::new(),
                load_balancer_ips: Vec::new(),
                source_ranges: Vec::new(),
                firewall: false,
                allow_from_node: false,
                external_local: false,
                internal_local: false,
                affinity_timeout: None,
                health_check_node_port: None,
                cluster_endpoints: Vec::new(),
                local_endpoints: Vec::new(),
            },
            rendered,
            no_local: NoLocalEndpoints::default(),
            health_ips: Vec::new(),
        });
    }
    out
}
