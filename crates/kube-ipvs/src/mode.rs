//! Proxy mode selection: IPVS if asked for and usable, else iptables (or an error). The probe,
//! its classification and the retry loop the daemon runs are in [`crate::probe`].

use crate::config::{Config, ProxyMode};
use crate::error::{Error, Result};
use crate::probe::{decide, Decision, NodeIpvsState, ProbeError};

/// One probe attempt's outcome for `config`, on a node whose IPVS-mode state is `state`
/// (`None`: unknown): `Some(mode)` to run in, `None` to probe again after a backoff (a
/// transient failure, or IPVS state on the node that a fallback would replace), or the error
/// when IPVS is unusable and `--ipvs-fallback=false`. `probe` is called only when IPVS mode is
/// asked for. See [`decide`] for the rules.
pub fn select(
    config: &Config,
    state: Option<NodeIpvsState>,
    probe: impl FnOnce() -> std::result::Result<(), ProbeError>,
) -> Result<Option<ProxyMode>> {
    if config.mode == ProxyMode::Iptables {
        return Ok(Some(ProxyMode::Iptables));
    }
    let result = probe();
    match (decide(&result, state, config.ipvs_fallback), result) {
        (Decision::Ipvs, _) => Ok(Some(ProxyMode::Ipvs)),
        (Decision::Retry, _) => Ok(None),
        (Decision::Fallback, _) => Ok(Some(ProxyMode::Iptables)),
        (Decision::Fail, Err(e)) => Err(Error::IpvsUnavailable {
            reason: e.to_string(),
        }),
        (Decision::Fail, Ok(())) => Ok(Some(ProxyMode::Ipvs)),
    }
}
