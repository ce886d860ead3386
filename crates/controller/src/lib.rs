//! kube-ipvs controller: sources, model, desired state, diff, sync loop.
//!
//! Data flows left to right: sources → store → model (pure) → desired (pure) → diff (pure) →
//! appliers. The order in which a diff is applied is documented in [`diff`].

pub mod adopt;
pub mod desired;
pub mod diff;
pub mod iptables_mode;
pub mod kernel;
pub mod model;
pub mod objects;
pub mod plan;
pub mod proxier;
pub mod retry;
pub mod sorted;
pub mod source;
pub mod store;
pub mod sync_loop;
pub mod vip;
