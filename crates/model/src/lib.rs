//! kube-ipvs model: the objects the proxy keeps, the store that holds them, and the pure rules
//! that turn a Service and its EndpointSlices into service ports and selected endpoints.
//!
//! The first stage of a Service's journey after its source: a source ([`event`]'s vocabulary)
//! feeds the [`store::Store`]; the desired state (crate `desired`) asks the model for each
//! dirty service's ports and endpoints. Nothing here does IO.
//!
//! The model's types and functions are at the crate root ([`ServicePort`], [`endpoints`],
//! [`select_endpoints`], [`Invalid`], ...), defined in seven private modules (addresses,
//! budget, names and limits, configuration, service ports, endpoints, rejections); the objects' interner has
//! a module of its own, re-exported as [`objects::Interner`].
//!
//! ## The rules
//!
//! Kubernetes objects turned into proxy concepts (service ports, endpoints). Pure.
//!
//! - [`service_ports`] turns one `Service` into the [`ServicePort`]s of one address family
//!   (one proxier instance per family; a dual-stack process runs two).
//! - [`endpoints`] merges every EndpointSlice of a service into the [`Endpoint`]s of one port.
//! - [`select_endpoints`] applies Kubernetes' endpoint rules: ready first, serving-terminating as
//!   a fall-back, `internalTrafficPolicy`/`externalTrafficPolicy: Local` (no local endpoint means no
//!   real server: traffic is dropped, never sent to remote endpoints), topology hints.
//!
//! Bad input (an invalid clusterIP, ports 0 or > 65535, unknown protocols, duplicate ports,
//! absurd sizes) is rejected with an [`Invalid`] reason: a bad Service is skipped as a whole, a
//! bad EndpointSlice is skipped alone (the service's other slices still count). A bad value
//! that upstream skips alone is left out alone, and the rest is used: an invalid externalIP,
//! load-balancer IP or source range ([`ignored_fields`]), an endpoint with an invalid address
//! (`Slice::ignored`); each is reported as a partial rejection ([`IGNORED_PREFIX`]).
//! Addresses are read like upstream's ([`parse_ip_sloppy`]: `010.0.0.7` is 10.0.0.7,
//! `::ffff:1.2.3.4` is 1.2.3.4). User text is bounded: values over [`MAX_USER_TEXT`] are cut
//! at conversion, reasons over [`MAX_REASON_BYTES`] when made. Nothing here panics on any
//! input. [`Rejections`] remembers reasons so each is logged once and counted.
//!
//! Size caps (documented limits, far above what the API server admits in practice):
//! [`MAX_PORTS_PER_SERVICE`], [`MAX_VIPS_PER_SERVICE`], [`MAX_SOURCE_RANGES`],
//! [`MAX_ENDPOINTS_PER_SLICE`] (the API's own limit), [`MAX_ENDPOINTS_PER_SERVICE_PORT`]; and
//! their product, each Service's [`ServiceBudget`] of virtual servers, real servers and ipset
//! members ([`BudgetTally`]).

pub mod event;
pub mod objects;
pub mod sorted;
pub mod store;

mod addr;
mod budget;
mod config;
mod endpoints;
mod interner;
mod names;
mod rejections;
mod service;

pub use addr::*;
pub use budget::*;
pub use config::*;
pub use endpoints::*;
pub use names::*;
pub use rejections::*;
pub use service::*;
