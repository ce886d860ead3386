//! Names and limits: the annotations and labels the model reads, its size caps, why an
//! object is rejected ([`Invalid`]), and the identities of a Service and of one of its ports.

use std::borrow::Cow;
use std::fmt;
use std::sync::Arc;

use ipvs_netlink::Protocol;
use k8s_openapi::api::core::v1::Service;

/// Per-service annotation choosing the IPVS scheduler (overrides the global flag).
pub const SCHEDULER_ANNOTATION: &str = "kube-ipvs.io/scheduler";
/// Per-service annotation setting the IPVS scheduler flags (`ipvsadm -b`): a comma-separated
/// list of `sh-fallback`, `sh-port` (scheduler `sh`) and `mh-fallback`, `mh-port` (scheduler
/// `mh`); empty for none. Without it a service gets upstream's flags: `mh-port` with `mh`.
pub const SCHEDULER_FLAGS_ANNOTATION: &str = "kube-ipvs.io/scheduler-flags";

/// The scheduler flags of a service: the annotation's, checked against the scheduler, else
/// upstream's default (`mh` gets `FlagSourceHash`, i.e. `mh-port`: `syncProxyRules` in
/// pkg/proxy/ipvs/proxier.go, "Set the source hash flag needed for the distribution method
/// mh"; no flag for the other schedulers).
pub fn scheduler_flags(scheduler: &str, annotation: Option<&str>) -> Result<u32, Invalid> {
    use ipvs_netlink::ServiceFlags as F;
    let Some(list) = annotation else {
        return Ok(if scheduler == "mh" { F::MH_PORT } else { 0 });
    };
    let mut bits = 0;
    for word in list.split(',').map(str::trim).filter(|w| !w.is_empty()) {
        let (bit, needs) = match word {
            "sh-fallback" => (F::SH_FALLBACK, "sh"),
            "sh-port" => (F::SH_PORT, "sh"),
            "mh-fallback" => (F::MH_FALLBACK, "mh"),
            "mh-port" => (F::MH_PORT, "mh"),
            other => {
                return Err(Invalid::new(format!(
                    "unknown scheduler flag {} in annotation {SCHEDULER_FLAGS_ANNOTATION} \
                     (sh-fallback, sh-port, mh-fallback, mh-port)",
                    quoted(other)
                )))
            }
        };
        if scheduler != needs {
            return Err(Invalid::new(format!(
                "scheduler flag {word:?} in annotation {SCHEDULER_FLAGS_ANNOTATION} needs \
                 scheduler {needs:?}, not {}",
                quoted(scheduler)
            )));
        }
        bits |= bit;
    }
    Ok(bits)
}
/// Label of an EndpointSlice naming its Service.
pub const SERVICE_NAME_LABEL: &str = "kubernetes.io/service-name";
/// Node label carrying the node's zone.
pub const ZONE_LABEL: &str = "topology.kubernetes.io/zone";
/// Default `sessionAffinityConfig.clientIP.timeoutSeconds` (3 hours).
pub const DEFAULT_AFFINITY_TIMEOUT: u32 = 10_800;
/// Largest affinity timeout the API admits (1 day).
pub const MAX_AFFINITY_TIMEOUT: u32 = 86_400;
/// Most ports one Service may have before it is rejected.
pub const MAX_PORTS_PER_SERVICE: usize = 1_000;
/// Most externalIPs + load-balancer ingress IPs one Service may have before it is rejected.
pub const MAX_VIPS_PER_SERVICE: usize = 256;
/// Most `loadBalancerSourceRanges` one Service may have before it is rejected.
pub const MAX_SOURCE_RANGES: usize = 1_000;
/// Most endpoints one EndpointSlice may have (the API's limit); a larger slice is rejected.
pub const MAX_ENDPOINTS_PER_SLICE: usize = 1_000;
/// Most endpoints of one service port after merging slices; slices (in name order) that would
/// push the count beyond it are rejected.
pub const MAX_ENDPOINTS_PER_SERVICE_PORT: usize = 20_000;
/// IPVS schedulers the kernel ships: the one table, shared with `ipvs.scheduler`.
pub use ipvs_netlink::SCHEDULERS;

/// Most bytes of user text (an annotation value, a field value) the model keeps: a longer value
/// is cut at conversion and ends with [`CUT_MARKER`] (never valid anywhere, so a cut value is
/// rejected, not read as a shorter one).
pub const MAX_USER_TEXT: usize = 1024;
/// Most bytes of a rejection reason ([`Invalid`]): what is stored, logged and put in Events.
pub const MAX_REASON_BYTES: usize = 1024;
/// Most bytes of one value quoted in a reason ([`quoted`]), so a reason can name a few.
pub const MAX_QUOTED: usize = 128;
/// What ends a cut text.
pub const CUT_MARKER: &str = "…[cut]";

/// `s`, or its first `max` bytes (on a character boundary) followed by [`CUT_MARKER`].
pub fn bounded(s: &str, max: usize) -> Cow<'_, str> {
    if s.len() <= max {
        return Cow::Borrowed(s);
    }
    let mut end = max;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    Cow::Owned(format!("{}{CUT_MARKER}", &s[..end]))
}

/// `s` quoted and escaped for a reason (`"..."`, like `{:?}`), cut to [`MAX_QUOTED`] bytes.
pub fn quoted(s: &str) -> String {
    if s.len() <= MAX_QUOTED {
        return format!("{s:?}");
    }
    let mut end = MAX_QUOTED;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    format!("{:?}{CUT_MARKER}", &s[..end])
}

/// Why an object was rejected.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Invalid {
    /// Human-readable reason, stable for identical input (so it can be logged once); at most
    /// [`MAX_REASON_BYTES`] (plus the [`CUT_MARKER`]).
    pub reason: String,
}

impl Invalid {
    /// An `Invalid` with the given reason, cut to [`MAX_REASON_BYTES`]: the reason may carry
    /// user text, and it is stored per object, logged and sent in Events.
    pub fn new(reason: impl Into<String>) -> Invalid {
        let reason = reason.into();
        let reason = match bounded(&reason, MAX_REASON_BYTES) {
            Cow::Borrowed(_) => reason,
            Cow::Owned(cut) => cut,
        };
        Invalid { reason }
    }
}

/// What starts the reason of a partial rejection: the object is used without the values it
/// names (an invalid externalIP, load-balancer IP or source range of a Service; invalid
/// endpoints of an EndpointSlice), like upstream, which skips them with a log line. Reported
/// with its own Event reason (`InvalidField`), never as the whole object being skipped.
pub const IGNORED_PREFIX: &str = "ignored ";

/// Values left out of an object: the first one described, and how many there are.
#[derive(Debug, Default)]
pub(crate) struct IgnoredValues {
    first: Option<String>,
    count: usize,
}

impl IgnoredValues {
    /// One more value left out; `what` describes it (only the first is described).
    pub(crate) fn note(&mut self, what: impl FnOnce() -> String) {
        if self.first.is_none() {
            self.first = Some(what());
        }
        self.count += 1;
    }

    /// The partial rejection naming them: `ignored <first> (and N more)`.
    pub(crate) fn into_invalid(self) -> Option<Invalid> {
        let first = self.first?;
        Some(Invalid::new(match self.count {
            0 | 1 => format!("{IGNORED_PREFIX}{first}"),
            n => format!("{IGNORED_PREFIX}{first} (and {} more)", n - 1),
        }))
    }
}

impl fmt::Display for Invalid {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.reason)
    }
}

/// A Service's identity: namespace/name. The strings are shared: the store, the desired
/// state and the VIP claims hold copies of every name, and a copy is a reference count.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ServiceName {
    /// Namespace.
    pub namespace: Arc<str>,
    /// Name.
    pub name: Arc<str>,
}

impl Default for ServiceName {
    fn default() -> Self {
        ServiceName::new("", "")
    }
}

impl ServiceName {
    /// `namespace/name`.
    pub fn new(namespace: impl AsRef<str>, name: impl AsRef<str>) -> ServiceName {
        ServiceName {
            namespace: Arc::from(namespace.as_ref()),
            name: Arc::from(name.as_ref()),
        }
    }

    /// The name of a Service object (`default` namespace when unset).
    pub fn of(svc: &Service) -> ServiceName {
        ServiceName::new(
            svc.metadata.namespace.as_deref().unwrap_or("default"),
            svc.metadata.name.as_deref().unwrap_or_default(),
        )
    }
}

impl fmt::Display for ServiceName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.namespace, self.name)
    }
}

/// One port of one Service: namespace, name, port name and protocol.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ServicePortName {
    /// Namespace of the Service.
    pub namespace: Arc<str>,
    /// Name of the Service.
    pub name: Arc<str>,
    /// Name of the port (empty when unnamed).
    pub port_name: String,
    /// Transport protocol.
    pub protocol: Protocol,
}

impl ServicePortName {
    /// The Service this port belongs to.
    pub fn service(&self) -> ServiceName {
        ServiceName::new(self.namespace.clone(), self.name.clone())
    }
}

impl fmt::Display for ServicePortName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{}/{}:{}/{}",
            self.namespace,
            self.name,
            self.port_name,
            self.protocol.api_name()
        )
    }
}
