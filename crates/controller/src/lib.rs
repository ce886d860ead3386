//! kube-ipvs controller: sources, model, desired state, diff, sync loop, sysctls.
//!
//! Data flows left to right: sources → model (pure) → desired (pure) → diff (pure) → appliers.

pub mod desired;
pub mod model;
pub mod source;
pub mod sysctl;
