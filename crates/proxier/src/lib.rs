//! kube-ipvs proxier: applies the desired state to the kernel and keeps it there. The IPVS mode
//! ([`ipvs_mode`]) and the iptables mode ([`iptables_mode`]) each keep one address family of the
//! node equal to the desired state; [`sync_loop`] feeds them store changes and runs their syncs;
//! [`retry`] is the one backoff policy; [`kernel`] is the IO boundary. (The model and the desired
//! state are the crates `model` and `desired`, re-exported under their former paths.)
//!
//! Data flows left to right: sources → store → model (pure) → desired (pure) → diff (pure) →
//! appliers. The order in which a diff is applied is documented in [`diff`].

pub mod adopt;
pub mod iptables_mode;
pub mod ipvs_mode;
pub mod kernel;
pub mod plan;
pub mod retry;
pub mod source;
pub mod sync_loop;

/// The desired-state crate: `proxier::desired::Desired`, ...
pub use ::desired;
// The desired-state crate's modules under their former paths.
pub use ::desired::{diff, vip};
/// The model crate: service ports, endpoints, selection rules (at `proxier::model::*`).
pub use ::model;
// The model crate's modules under their former paths (`proxier::store::Store`, ...).
pub use ::model::{objects, sorted, store};
