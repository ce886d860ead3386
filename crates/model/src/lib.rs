//! kube-ipvs model: the objects the proxy keeps, the store that holds them, and the pure rules
//! that turn a Service and its EndpointSlices into service ports and selected endpoints.
//!
//! The first stage of a Service's journey after its source: a source ([`event`]'s vocabulary)
//! feeds the [`store::Store`]; the desired state (crate `controller`) asks the model for each
//! dirty service's ports and endpoints. Nothing here does IO.
//!
//! The model's types and functions are at the crate root ([`ServicePort`], [`endpoints`],
//! [`select_endpoints`], [`Invalid`], ...).

pub mod event;
mod model;
pub mod objects;
pub mod sorted;
pub mod store;

pub use model::*;
