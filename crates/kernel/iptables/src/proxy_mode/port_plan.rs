//! What one service port's rules hinge on (upstream's per-port prelude of `syncProxyRules`)
//! and the renderers of its entry lines and chains.

use super::*;

/// What the rules of one service port hinge on, worked out once from its inputs (upstream's
/// `syncProxyRules` per-port prelude: which policy chains exist and which ones each entry
/// point uses).
pub(super) struct PortPlan<'a> {
    pub(super) cfg: &'a ProxyModeConfig,
    pub(super) sp: &'a ServicePortRules,
    pub(super) svc: String,
    pub(super) svl: String,
    pub(super) ext: String,
    pub(super) fw: String,
    /// The cluster policy chain is written (used and has endpoints).
    pub(super) has_svc: bool,
    /// The local policy chain is written.
    pub(super) has_svl: bool,
    /// In-cluster traffic has endpoints under its policy.
    pub(super) has_internal: bool,
    /// External traffic has endpoints under its policy.
    pub(super) has_external: bool,
    /// The external entry points jump to `KUBE-EXT`.
    pub(super) uses_ext: bool,
    /// Load-balancer traffic goes through the `KUBE-FW` firewall chain.
    pub(super) uses_fw: bool,
}

impl<'a> PortPlan<'a> {
    pub(super) fn new(cfg: &'a ProxyModeConfig, sp: &'a ServicePortRules) -> PortPlan<'a> {
        let (name, proto) = (sp.name.as_str(), sp.protocol);
        let externally = sp.externally_accessible();
        let uses_cluster = !sp.internal_local || externally;
        let uses_local = sp.internal_local || (sp.external_local && externally);
        let has_internal = !sp.policy_endpoints(sp.internal_local).is_empty();
        let has_external = !sp.policy_endpoints(sp.external_local).is_empty();
        PortPlan {
            cfg,
            sp,
            svc: svc_chain(name, proto),
            svl: svl_chain(name, proto),
            ext: ext_chain(name, proto),
            fw: fw_chain(name, proto),
            has_svc: uses_cluster && !sp.cluster_endpoints.is_empty(),
            has_svl: uses_local && !sp.local_endpoints.is_empty(),
            has_internal,
            has_external,
            uses_ext: externally && has_external,
            uses_fw: sp.firewall && !sp.load_balancer_ips.is_empty() && has_external,
        }
    }

    pub(super) fn name(&self) -> &str {
        &self.sp.name
    }

    /// The policy chain for local (`KUBE-SVL`) or cluster (`KUBE-SVC`) traffic policy.
    pub(super) fn policy_chain_name(&self, local: bool) -> &str {
        if local {
            &self.svl
        } else {
            &self.svc
        }
    }

    pub(super) fn host(&self, ip: &IpAddr) -> String {
        format!("{ip}/{}", self.cfg.host_len())
    }

    /// A filter line's comment and target when a policy has no endpoints: DROP when only
    /// local ones are missing, the configured reject otherwise.
    pub(super) fn no_endpoints(&self, local_policy: bool) -> (String, &'static str) {
        let name = self.name();
        if local_policy && !self.sp.cluster_endpoints.is_empty() {
            (format!("{name} has no local endpoints"), "DROP")
        } else {
            (format!("{name} has no endpoints"), self.cfg.reject())
        }
    }

    /// A `-d ADDR -p PROTO ... --dport PORT` line of a shared chain.
    pub(super) fn to_port(&self, chain: &str, ip: &IpAddr, comment: &str, target: &str) -> String {
        let proto = self.sp.protocol;
        Line::new(chain)
            .dst(self.host(ip))
            .proto(proto)
            .comment(comment)
            .dport(proto, self.sp.port)
            .j(target)
    }

    /// The "no endpoints" filter line of an external entry point.
    pub(super) fn no_external_endpoints(&self, chain: &str, ip: &IpAddr) -> String {
        let (c, target) = self.no_endpoints(self.sp.external_local);
        self.to_port(chain, ip, &c, target)
    }

    pub(super) fn cluster_ip_rules(&self, out: &mut RenderedServicePort) {
        let sp = self.sp;
        if self.has_internal {
            let line = self.to_port(
                SERVICES,
                &sp.cluster_ip,
                &format!("{} cluster IP", self.name()),
                self.policy_chain_name(sp.internal_local),
            );
            out.push_shared(Table::Nat, SERVICES, line);
        } else {
            let (c, target) = self.no_endpoints(sp.internal_local);
            let line = self.to_port(SERVICES, &sp.cluster_ip, &c, target);
            out.push_shared(Table::Filter, SERVICES, line);
        }
    }

    pub(super) fn external_ip_rules(&self, out: &mut RenderedServicePort) {
        for ip in &self.sp.external_ips {
            if self.uses_ext {
                let c = format!("{} external IP", self.name());
                let line = self.to_port(SERVICES, ip, &c, &self.ext);
                out.push_shared(Table::Nat, SERVICES, line);
            } else {
                let line = self.no_external_endpoints(EXTERNAL_SERVICES, ip);
                out.push_shared(Table::Filter, EXTERNAL_SERVICES, line);
            }
        }
    }

    pub(super) fn load_balancer_rules(&self, out: &mut RenderedServicePort) {
        let name = self.name();
        for ip in &self.sp.load_balancer_ips {
            if self.uses_ext {
                let target = if self.uses_fw { &self.fw } else { &self.ext };
                let line = self.to_port(SERVICES, ip, &format!("{name} loadbalancer IP"), target);
                out.push_shared(Table::Nat, SERVICES, line);
            }
            if self.uses_fw {
                let c = format!("{name} traffic not accepted by {}", self.fw);
                let line = self.to_port(PROXY_FIREWALL, ip, &c, "DROP");
                out.push_shared(Table::Filter, PROXY_FIREWALL, line);
            }
            if !self.has_external {
                let line = self.no_external_endpoints(EXTERNAL_SERVICES, ip);
                out.push_shared(Table::Filter, EXTERNAL_SERVICES, line);
            }
        }
    }

    /// The NodePort and the health-check node port.
    pub(super) fn node_port_rules(&self, out: &mut RenderedServicePort) {
        let (sp, name, proto) = (self.sp, self.name(), self.sp.protocol);
        if let Some(np) = sp.node_port {
            if self.uses_ext {
                let line = Line::new(NODEPORTS)
                    .proto(proto)
                    .comment(name)
                    .dport(proto, np)
                    .j(&self.ext);
                out.push_shared(Table::Nat, NODEPORTS, line);
            } else {
                let (c, target) = self.no_endpoints(sp.external_local);
                let line = Line::new(EXTERNAL_SERVICES)
                    .proto(proto)
                    .comment(&c)
                    .m("-m addrtype --dst-type LOCAL")
                    .dport(proto, np)
                    .j(target);
                out.push_shared(Table::Filter, EXTERNAL_SERVICES, line);
            }
        }
        if let Some(hc) = sp.health_check_node_port {
            let line = Line::new(NODEPORTS)
                .proto(Protocol::Tcp)
                .comment(&format!("{name} health check node port"))
                .dport(Protocol::Tcp, hc)
                .j("ACCEPT");
            out.push_shared(Table::Filter, NODEPORTS, line);
        }
    }

    /// `KUBE-EXT`: masquerade (cluster policy) or keep local pod and host traffic on the
    /// cluster chain (local policy), then the external policy chain.
    pub(super) fn ext_chain_rules(&self) -> Result<Vec<String>> {
        let (name, ext, svc) = (self.name(), &self.ext, &self.svc);
        let mut rules = Vec::new();
        if !self.sp.external_local {
            rules.push(
                Line::new(ext)
                    .comment(&format!(
                        "masquerade traffic for {name} external destinations"
                    ))
                    .j(MARK_MASQ),
            );
        } else if self.has_svc {
            if let Some(local) = self.cfg.local_match(false)? {
                rules.push(
                    Line::new(ext)
                        .part(Some(local))
                        .comment(&format!("pod traffic for {name} external destinations"))
                        .j(svc),
                );
            }
            rules.push(
                Line::new(ext)
                    .comment(&format!(
                        "masquerade LOCAL traffic for {name} external destinations"
                    ))
                    .m("-m addrtype --src-type LOCAL")
                    .j(MARK_MASQ),
            );
            rules.push(
                Line::new(ext)
                    .comment(&format!(
                        "route LOCAL traffic for {name} external destinations"
                    ))
                    .m("-m addrtype --src-type LOCAL")
                    .j(svc),
            );
        }
        rules.push(Line::new(ext).j(self.policy_chain_name(self.sp.external_local)));
        Ok(rules)
    }

    /// `KUBE-FW`: the source ranges (and the node's own LB IPs when allowed) go on to
    /// `KUBE-EXT`; the rest falls through to the DROP in `KUBE-PROXY-FIREWALL`.
    pub(super) fn fw_chain_rules(&self) -> Vec<String> {
        let (sp, fw) = (self.sp, &self.fw);
        let c = format!("{} loadbalancer IP", self.name());
        let mut rules = Vec::new();
        for r in &sp.source_ranges {
            rules.push(
                Line::new(fw)
                    .src(r.trunc().to_string())
                    .comment(&c)
                    .j(&self.ext),
            );
        }
        if sp.allow_from_node {
            for ip in &sp.load_balancer_ips {
                rules.push(Line::new(fw).src(self.host(ip)).comment(&c).j(&self.ext));
            }
        }
        rules
    }

    /// The masquerade line of the in-cluster policy chain for ClusterIP traffic from outside
    /// the cluster (or all of it with `masqueradeAll`).
    pub(super) fn masquerade_cluster_ip(&self, chain: &str) -> Result<Option<String>> {
        let (sp, proto) = (self.sp, self.sp.protocol);
        let base = |part: Option<Part>| {
            Line::new(chain)
                .part(part)
                .dst(self.host(&sp.cluster_ip))
                .proto(proto)
                .comment(&format!("{} cluster IP", self.name()))
                .dport(proto, sp.port)
                .j(MARK_MASQ)
        };
        if self.cfg.masquerade_all {
            Ok(Some(base(None)))
        } else {
            Ok(self.cfg.local_match(true)?.map(|p| base(Some(p))))
        }
    }

    /// A policy chain (`KUBE-SVC` / `KUBE-SVL`): affinity checks, then the random split over
    /// the endpoints; and the endpoints' own `KUBE-SEP` chains.
    pub(super) fn policy_chain(
        &self,
        chain: &str,
        eps: &[EndpointRule],
        out: &mut RenderedServicePort,
    ) -> Result<()> {
        let (name, proto) = (self.name(), self.sp.protocol);
        let mut rules = Vec::new();
        if chain == self.policy_chain_name(self.sp.internal_local) {
            if let Some(l) = self.masquerade_cluster_ip(chain)? {
                rules.push(l);
            }
        }
        let seps: Vec<(String, &EndpointRule)> = eps
            .iter()
            .map(|e| (sep_chain(name, proto, e.ip, e.port), e))
            .collect();
        if let Some(t) = self.sp.affinity_timeout {
            for (sep, e) in &seps {
                rules.push(
                    Line::new(chain)
                        .comment(&format!("{name} -> {}", endpoint_string(e.ip, e.port)))
                        .m(format!(
                            "-m recent --rcheck --seconds {t} --reap --name {sep} --mask {} --rsource",
                            self.cfg.recent_mask()
                        ))
                        .j(sep),
                );
            }
        }
        let n = seps.len();
        for (i, (sep, e)) in seps.iter().enumerate() {
            let mut l =
                Line::new(chain).comment(&format!("{name} -> {}", endpoint_string(e.ip, e.port)));
            if i + 1 < n {
                l = l.m(format!(
                    "-m statistic --mode random --probability {}",
                    probability(n - i)
                ));
            }
            rules.push(l.j(sep));
        }
        out.chains.insert(chain.to_string(), rules);
        for (sep, e) in seps {
            if let std::collections::btree_map::Entry::Vacant(v) = out.chains.entry(sep) {
                let rules = self.endpoint_chain_rules(v.key(), e);
                v.insert(rules);
            }
        }
        Ok(())
    }

    /// A `KUBE-SEP` chain: hairpin masquerade, then the DNAT (recording the client for
    /// affinity).
    pub(super) fn endpoint_chain_rules(&self, sep: &str, e: &EndpointRule) -> Vec<String> {
        let (name, proto) = (self.name(), self.sp.protocol);
        let mut dnat = Line::new(sep).proto(proto).comment(name);
        if self.sp.affinity_timeout.is_some() {
            dnat = dnat.m(format!(
                "-m recent --set --name {sep} --mask {} --rsource",
                self.cfg.recent_mask()
            ));
        }
        vec![
            Line::new(sep)
                .src(self.host(&e.ip))
                .comment(name)
                .j(MARK_MASQ),
            dnat.m(format!("-m {}", proto.as_str())).j(&format!(
                "DNAT --to-destination {}",
                endpoint_string(e.ip, e.port)
            )),
        ]
    }
}
