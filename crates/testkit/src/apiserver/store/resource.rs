//! The resources the fake server serves, their object keys, and the API's error status.

use super::*;

/// The resources the fake server serves with list/watch semantics.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Resource {
    /// `v1/services` (namespaced).
    Services,
    /// `discovery.k8s.io/v1/endpointslices` (namespaced).
    EndpointSlices,
    /// `v1/nodes` (cluster-scoped).
    Nodes,
}

impl Resource {
    /// All served resources.
    pub const ALL: [Resource; 3] = [Self::Services, Self::EndpointSlices, Self::Nodes];

    /// The object kind, e.g. `Service`.
    pub fn kind(self) -> &'static str {
        match self {
            Self::Services => "Service",
            Self::EndpointSlices => "EndpointSlice",
            Self::Nodes => "Node",
        }
    }

    /// The apiVersion, e.g. `discovery.k8s.io/v1`.
    pub fn api_version(self) -> &'static str {
        match self {
            Self::Services | Self::Nodes => "v1",
            Self::EndpointSlices => "discovery.k8s.io/v1",
        }
    }

    /// The URL plural, e.g. `endpointslices`.
    pub fn plural(self) -> &'static str {
        match self {
            Self::Services => "services",
            Self::EndpointSlices => "endpointslices",
            Self::Nodes => "nodes",
        }
    }

    /// Whether objects live in a namespace.
    pub fn namespaced(self) -> bool {
        !matches!(self, Self::Nodes)
    }
}

/// Where an object lives: resource, namespace (empty for cluster-scoped) and name.
pub type Key = (Resource, String, String);

/// A failure the server reports as a `Status` object.
#[derive(Debug, Clone, PartialEq)]
pub struct StatusError {
    /// HTTP status code (also `Status.code`).
    pub code: u16,
    /// `Status.reason`, e.g. `NotFound`, `Expired`.
    pub reason: &'static str,
    /// Human-readable message.
    pub message: String,
}

impl StatusError {
    pub(crate) fn new(code: u16, reason: &'static str, message: impl Into<String>) -> Self {
        Self {
            code,
            reason,
            message: message.into(),
        }
    }

    pub(crate) fn bad_request(message: impl Into<String>) -> Self {
        Self::new(400, "BadRequest", message)
    }

    pub(crate) fn not_found(res: Resource, name: &str) -> Self {
        Self::new(
            404,
            "NotFound",
            format!("{} \"{name}\" not found", res.plural()),
        )
    }

    /// The `Status` object the real server sends.
    pub fn to_status(&self) -> Value {
        json!({
            "kind": "Status",
            "apiVersion": "v1",
            "metadata": {},
            "status": "Failure",
            "message": self.message,
            "reason": self.reason,
            "code": self.code,
        })
    }
}

impl std::fmt::Display for StatusError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} {}: {}", self.code, self.reason, self.message)
    }
}
