//! Test kit: a fake Kubernetes API server, network-namespace helpers, fault injection for the
//! kernel boundary and fixtures shared by tests.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

pub mod apiserver;
pub mod bench;
pub mod control_plane;
pub mod fake_kernel;
pub mod faults;
pub mod netns;
