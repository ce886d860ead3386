//! kube-ipvs desired state: what the node should hold, derived from the model (pure), and the
//! diff that turns one IPVS table into another.
//!
//! The second stage of a Service's journey: the store and the model (crate `model`) give each
//! dirty service's ports and endpoints; [`service_desired`] turns them into its virtual
//! servers, VIPs, ipset entries and iptables features; [`Desired`] keeps the node-wide union
//! and returns the [`Delta`] of a change. [`vip`] settles external VIPs claimed by several
//! Services. [`diff`] lives here, not with the proxier that applies it, because the desired
//! state computes its deltas with it. Nothing here does IO.
//!
//! The desired state's types and functions are at the crate root.

mod desired;
pub mod diff;
mod real_servers;
mod service;
mod types;
pub mod vip;

pub use desired::*;
pub use service::*;
pub use types::*;
