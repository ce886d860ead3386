//! `plan`: the desired node state rendered in the formats operators already read
//! (`ipvsadm -Sn`, `ip addr`, `ipset save`, `iptables-save`), and `plan --diff`: what a full sync
//! would change, computed by running the real full sync against a kernel that records writes
//! instead of making them. One desired state, one diff: the same code paths as the daemon.

use std::collections::BTreeSet;
use std::fmt::Write as _;
use std::net::IpAddr;

use ipset::{IpsetDiff, IpsetState};
use ipvs_netlink::savefmt::{dest_line, service_arg, service_line};
use ipvs_netlink::{Family, Op, ServiceKey};

use crate::ipvs_mode::Proxier;
use crate::kernel::{Kernel, KernelCounters, KernelError};
use desired::diff::IpvsTable;
use model::store::Store;

/// Sections of a plan.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Section {
    /// The IPVS table, exactly as `ipvsadm -Sn` prints it (usable with `ipvsadm --restore`).
    Ipvs,
    /// Addresses on kube-ipvs0, one per line.
    Addresses,
    /// The sets, as `ipset save` prints them (usable with `ipset restore`).
    Ipsets,
    /// The rules, as `iptables-restore --noflush` input.
    Iptables,
}

impl Section {
    /// Every section in output order.
    pub const ALL: [Section; 4] = [
        Section::Ipvs,
        Section::Addresses,
        Section::Ipsets,
        Section::Iptables,
    ];

    /// The section's name on the command line.
    pub fn name(self) -> &'static str {
        match self {
            Section::Ipvs => "ipvs",
            Section::Addresses => "addresses",
            Section::Ipsets => "ipsets",
            Section::Iptables => "iptables",
        }
    }
}

impl std::str::FromStr for Section {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Section::ALL
            .into_iter()
            .find(|x| x.name() == s)
            .ok_or_else(|| format!("unknown section {s:?} (ipvs, addresses, ipsets, iptables)"))
    }
}

/// One family's rendered plan.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Plan {
    /// The family.
    pub family: Family,
    /// `ipvsadm -Sn` text.
    pub ipvs: String,
    /// kube-ipvs0 addresses.
    pub addresses: Vec<IpAddr>,
    /// `ipset save` text.
    pub ipsets: String,
    /// `iptables-restore` text.
    pub iptables: String,
}

impl Plan {
    /// One section's text.
    pub fn section(&self, s: Section) -> String {
        match s {
            Section::Ipvs => self.ipvs.clone(),
            Section::Addresses => self.addresses.iter().map(|a| format!("{a}\n")).collect(),
            Section::Ipsets => self.ipsets.clone(),
            Section::Iptables => self.iptables.clone(),
        }
    }
}

/// Why a plan could not be rendered.
#[derive(Debug, thiserror::Error)]
pub enum PlanError {
    /// The iptables rules of the desired state could not be rendered.
    #[error(transparent)]
    Rules(#[from] iptables::Error),
    /// The iptables-mode sync that records the plan reported errors (shown joined by "; ").
    #[error("{}", .0.join("; "))]
    Sync(Vec<String>),
}

impl Proxier {
    /// Derives every service in `store` (no kernel involved) and renders the plan.
    pub fn plan(
        &mut self,
        store: &Store,
        node_addresses: &BTreeSet<IpAddr>,
    ) -> Result<Plan, PlanError> {
        self.derive_all(store, node_addresses);
        let table: Vec<_> = self
            .desired()
            .ipvs_table()
            .into_values()
            .map(|vs| (vs.service, vs.real_servers.into_values().collect()))
            .collect();
        let rules = self.rules(None)?;
        Ok(Plan {
            family: self.family(),
            ipvs: ipvs_netlink::savefmt::render(&table),
            addresses: self.desired().addresses().into_iter().collect(),
            ipsets: ipset::render_save(&self.desired().ipset_state()),
            iptables: rules.render(),
        })
    }
}

/// Renders plans: with one section, just that section's text (machine-usable); otherwise every
/// section under a `#` header per family.
pub fn render(plans: &[Plan], only: Option<Section>) -> String {
    let mut out = String::new();
    for p in plans {
        match only {
            Some(s) => out.push_str(&p.section(s)),
            None => {
                for s in Section::ALL {
                    let _ = writeln!(out, "# {} ({:?})", s.name(), p.family);
                    out.push_str(&p.section(s));
                }
            }
        }
    }
    out
}

/// A kernel that reads through to a real one and records the writes instead of making them,
/// as the commands an operator would type.
pub struct DryRun<'a> {
    inner: &'a mut dyn Kernel,
    /// The recorded writes, in the order a sync would make them.
    pub writes: Vec<String>,
}

impl std::fmt::Debug for DryRun<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DryRun")
            .field("writes", &self.writes.len())
            .finish_non_exhaustive()
    }
}

impl<'a> DryRun<'a> {
    /// Wraps `inner`.
    pub fn new(inner: &'a mut dyn Kernel) -> DryRun<'a> {
        DryRun {
            inner,
            writes: Vec::new(),
        }
    }
}

/// An IPVS operation as the `ipvsadm` command that would make it.
pub fn op_command(op: &Op) -> String {
    let dest_target = |k: &ServiceKey, a: &IpAddr, p: u16| {
        let addr = match a {
            IpAddr::V4(v4) => format!("{v4}:{p}"),
            IpAddr::V6(v6) => format!("[{v6}]:{p}"),
        };
        format!("{} -r {addr}", service_arg(k))
    };
    match op {
        Op::NewService(s) => format!("ipvsadm {}", service_line(s)),
        Op::SetService(s) => format!("ipvsadm -E{}", &service_line(s)[2..]),
        Op::DelService(k) => format!("ipvsadm -D {}", service_arg(k)),
        Op::NewDest(k, d) => format!("ipvsadm {}", dest_line(k, d)),
        Op::SetDest(k, d) => format!("ipvsadm -e{}", &dest_line(k, d)[2..]),
        Op::DelDest(k, a, p) => format!("ipvsadm -d {}", dest_target(k, a, *p)),
        Op::Flush => "ipvsadm -C".to_string(),
        Op::SetTimeouts(t) => format!("ipvsadm --set {} {} {}", t.tcp, t.tcp_fin, t.udp),
    }
}

impl Kernel for DryRun<'_> {
    fn read_ipvs(&mut self, family: Family) -> Result<IpvsTable, KernelError> {
        self.inner.read_ipvs(family)
    }
    fn list_ipvs(&mut self, family: Family) -> Result<BTreeSet<ServiceKey>, KernelError> {
        self.inner.list_ipvs(family)
    }

    fn read_ipvs_keys(&mut self, keys: &BTreeSet<ServiceKey>) -> Result<IpvsTable, KernelError> {
        self.inner.read_ipvs_keys(keys)
    }

    fn apply_ipvs(&mut self, ops: &[Op]) -> Vec<Result<(), KernelError>> {
        ops.iter()
            .map(|op| {
                self.writes.push(op_command(op));
                Ok(())
            })
            .collect()
    }

    fn ensure_link(&mut self) -> Result<bool, KernelError> {
        Ok(false)
    }

    fn read_addresses(&mut self, family: Family) -> Result<BTreeSet<IpAddr>, KernelError> {
        // A missing kube-ipvs0 reads as no addresses.
        Ok(self.inner.read_addresses(family).unwrap_or_default())
    }

    fn apply_addresses(
        &mut self,
        add: &[IpAddr],
        del: &[IpAddr],
    ) -> Vec<(IpAddr, Result<(), KernelError>)> {
        let mut out = Vec::new();
        for a in add {
            self.writes.push(format!(
                "ip addr add {a}/{} dev kube-ipvs0",
                netif::host_prefix_len(a)
            ));
            out.push((*a, Ok(())));
        }
        for a in del {
            self.writes.push(format!(
                "ip addr del {a}/{} dev kube-ipvs0",
                netif::host_prefix_len(a)
            ));
            out.push((*a, Ok(())));
        }
        out
    }

    fn read_ipsets(&mut self, owned: &[String]) -> Result<IpsetState, KernelError> {
        self.inner.read_ipsets(owned)
    }

    fn apply_ipsets(&mut self, diff: &IpsetDiff) -> Result<Vec<ipset::Rejected>, KernelError> {
        for line in ipset::render_restore(diff).lines() {
            self.writes.push(format!("ipset {line}"));
        }
        Ok(Vec::new())
    }

    fn apply_iptables(
        &mut self,
        _rules: &iptables::RuleSet,
        _force: bool,
    ) -> Result<bool, KernelError> {
        // Rules are rewritten as a whole by iptables-restore; the plan shows them in full.
        Ok(false)
    }

    fn delete_conntrack(
        &mut self,
        filters: &[conntrack::ConntrackFilter],
    ) -> Result<u64, KernelError> {
        for f in filters {
            self.writes
                .push(format!("conntrack -D {}", conntrack_args(f)));
        }
        Ok(0)
    }

    fn counters(&self) -> KernelCounters {
        self.inner.counters()
    }
}

fn conntrack_args(f: &conntrack::ConntrackFilter) -> String {
    let proto = f.proto.as_str();
    let mut s = format!("-p {proto} --orig-dst {}", f.orig_dst);
    if let Some(p) = f.orig_dst_port {
        s.push_str(&format!(" --orig-port-dst {p}"));
    }
    if let Some(r) = f.reply_src {
        s.push_str(&format!(" --reply-src {r}"));
    }
    s
}

/// Records `iptables-restore` payloads instead of running them, reading every table as empty:
/// iptables proxy mode's plan is the payload of its first full sync on a clean node.
#[derive(Debug, Clone, Default)]
struct RecordedRestores(std::sync::Arc<std::sync::Mutex<Vec<String>>>);

impl crate::iptables_mode::RestoreRunner for RecordedRestores {
    fn save(&mut self, _table: iptables::Table) -> Result<String, KernelError> {
        Ok(String::new())
    }
    fn list_chain(&mut self, _table: iptables::Table, _chain: &str) -> Result<String, KernelError> {
        Ok(String::new())
    }
    fn restore(&mut self, payload: &str) -> Result<(), KernelError> {
        match self.0.lock() {
            Ok(mut r) => r.push(payload.to_string()),
            Err(p) => p.into_inner().push(payload.to_string()),
        }
        Ok(())
    }
    fn processes(&self) -> u64 {
        0
    }
}

/// The plan of iptables proxy mode for `cfg.family`: only its `iptables` section (that mode
/// programs no IPVS, kube-ipvs0 address or ipset), as the `iptables-restore` input its first
/// sync on a clean node would run. `Err` lists the sync's errors.
pub fn iptables_mode_plan(
    cfg: model::ProxyConfig,
    rules: crate::ipvs_mode::RulesConfig,
    node_name: &str,
    store: &Store,
    node_addresses: &BTreeSet<IpAddr>,
) -> Result<Plan, PlanError> {
    let family = cfg.family;
    let recorded = RecordedRestores::default();
    let mut p = crate::iptables_mode::IptablesProxier::new(
        cfg,
        rules,
        node_name,
        Box::new(recorded.clone()),
    );
    let report = p.sync(store, node_addresses);
    if !report.ok() {
        return Err(PlanError::Sync(report.errors));
    }
    let iptables = match recorded.0.lock() {
        Ok(r) => r.concat(),
        Err(poisoned) => poisoned.into_inner().concat(),
    };
    Ok(Plan {
        family,
        ipvs: String::new(),
        addresses: Vec::new(),
        ipsets: String::new(),
        iptables,
    })
}
