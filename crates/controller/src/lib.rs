//! kube-ipvs controller: sources, desired state, diff, sync loop (the model is crate `model`).
//!
//! Data flows left to right: sources → store → model (pure) → desired (pure) → diff (pure) →
//! appliers. The order in which a diff is applied is documented in [`diff`].

pub mod adopt;
pub mod desired;
pub mod diff;
pub mod iptables_mode;
pub mod kernel;
pub mod plan;
pub mod proxier;
pub mod retry;
pub mod source;
pub mod sync_loop;
pub mod vip;

/// The model crate: service ports, endpoints, selection rules (at `controller::model::*`).
pub use ::model;
// The model crate's modules under their former paths (`controller::store::Store`, ...).
pub use ::model::{objects, sorted, store};
