//! IPVS generic netlink codec and client.

pub mod types;

pub use types::{
    tunnel_flags, Counters, Destination, Family, ForwardMethod, Info, Op, Protocol, Service,
    ServiceFlags, ServiceKey, Stats, Timeouts, TunnelType,
};
