//! kube-ipvs controller: sources, proxier, sync loop (the model and the desired state are the
//! crates `model` and `desired`, re-exported under their former paths).
//!
//! Data flows left to right: sources → store → model (pure) → desired (pure) → diff (pure) →
//! appliers. The order in which a diff is applied is documented in [`diff`].

pub mod adopt;
pub mod iptables_mode;
pub mod kernel;
pub mod plan;
pub mod proxier;
pub mod retry;
pub mod source;
pub mod sync_loop;

/// The desired-state crate: `controller::desired::Desired`, ...
pub use ::desired;
// The desired-state crate's modules under their former paths.
pub use ::desired::{diff, vip};
/// The model crate: service ports, endpoints, selection rules (at `controller::model::*`).
pub use ::model;
// The model crate's modules under their former paths (`controller::store::Store`, ...).
pub use ::model::{objects, sorted, store};
