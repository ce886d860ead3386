//! kube-ipvs proxier: applies the desired state to the kernel and keeps it there. The IPVS mode
//! ([`ipvs_mode`]) and the iptables mode ([`iptables_mode`]) each keep one address family of the
//! node equal to the desired state; [`sync_loop`] feeds them store changes and runs their syncs;
//! [`retry`] is the one backoff policy; [`kernel`] is the IO boundary.
//!
//! Data flows left to right: sources (crate `watch`) → store (crate `model`) → desired state
//! (crate `desired`, pure) → diff (pure) → the appliers here. The order in which a diff is
//! applied is documented in [`desired::diff`].

pub mod adopt;
pub mod iptables_mode;
pub mod ipvs_mode;
pub mod kernel;
pub mod plan;
pub mod retry;
pub mod sync_loop;
