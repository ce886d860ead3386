//! What the probe's result means for this node: the IPVS state already on it and the
//! mode decision.

use super::*;

/// IPVS-mode state found on the node (what a previous run left programmed).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct NodeIpvsState {
    /// kube-ipvs0 exists.
    pub dummy_link: bool,
    /// Virtual servers kube-ipvs would own (any family).
    pub owned_services: usize,
}

impl NodeIpvsState {
    /// Anything there at all.
    pub fn present(&self) -> bool {
        self.dummy_link || self.owned_services > 0
    }
}

/// What to do with a probe result.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Decision {
    /// Run in IPVS mode.
    Ipvs,
    /// Probe again after a backoff; nothing is torn down.
    Retry,
    /// Run in iptables mode (IPVS-mode leftovers go only after its first successful sync).
    Fallback,
    /// Exit with an error (`--ipvs-fallback=false`); nothing is torn down.
    Fail,
}

/// The decision for one probe result. `state` is the node's IPVS-mode state, `None` when it
/// could not be read (it is read only for [`ProbeError::Absent`] and
/// [`ProbeError::SchedulerMissing`]).
///
/// - A transient error is retried, whatever the state and `--ipvs-fallback` say.
/// - Absent IPVS with owned virtual servers cannot be (listing them needs the family the probe
///   did not find): the contradiction is retried. Absent IPVS with only kube-ipvs0 left (the
///   module was removed, which removed every virtual server) routes nothing, so it does not
///   hold the fallback back: staying would leave the node's Services down for good.
/// - A missing scheduler with IPVS state on the node is retried: the node was serving in IPVS
///   mode (e.g. `ipvs.scheduler` was changed to one this kernel lacks), and falling back would
///   replace a working data path. Without state it falls back.
/// - State that could not be read is treated as present.
pub fn decide(
    result: &Result<(), ProbeError>,
    state: Option<NodeIpvsState>,
    fallback: bool,
) -> Decision {
    let give_up = if fallback {
        Decision::Fallback
    } else {
        Decision::Fail
    };
    match result {
        Ok(()) => Decision::Ipvs,
        Err(ProbeError::Transient(_)) => Decision::Retry,
        Err(ProbeError::Absent(_)) => match state {
            Some(s) if s.owned_services == 0 => give_up,
            _ => Decision::Retry,
        },
        Err(ProbeError::SchedulerMissing { .. }) => match state {
            Some(s) if !s.present() => give_up,
            _ => Decision::Retry,
        },
    }
}

/// Reads the node's IPVS-mode state: kube-ipvs0 and the virtual servers kube-ipvs owns (of
/// both families, minus `ipvs.excludeCIDRs`). `ipvs_absent` reads it as a kernel without IPVS
/// shows it (the fault hook's `absent`). An error reading either is a transient failure.
pub async fn read_state(config: &Config, ipvs_absent: bool) -> Result<NodeIpvsState, Transient> {
    let transient = |detail: String| Transient {
        step: ProbeStep::State,
        errno: None,
        detail,
    };
    let netif = netif::Netif::new()
        .await
        .map_err(|e| transient(format!("kube-ipvs0: {e}")))?;
    let dummy_link = netif
        .lookup()
        .await
        .map_err(|e| transient(format!("kube-ipvs0: {e}")))?
        .is_some();
    if ipvs_absent {
        return Ok(NodeIpvsState {
            dummy_link,
            owned_services: 0,
        });
    }
    let services = tokio::task::block_in_place(|| {
        let mut client = match ipvs_netlink::Client::new() {
            Ok(c) => c,
            Err(ipvs_netlink::Error::FamilyMissing) => return Ok(Vec::new()),
            Err(e) => return Err(Transient::of(ProbeStep::State, &e)),
        };
        client
            .services()
            .map_err(|e| Transient::of(ProbeStep::State, &e))
    })?;
    let cfgs = [Family::Inet, Family::Inet6].map(|f| crate::engine::proxy_config(config, f));
    let owned_services = services
        .iter()
        .filter(|s| cfgs.iter().any(|c| desired::owned_by_proxy(c)(&s.key)))
        .count();
    Ok(NodeIpvsState {
        dummy_link,
        owned_services,
    })
}
