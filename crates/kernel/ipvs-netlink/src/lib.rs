//! IPVS generic netlink codec and client, on the family-independent framing, socket and
//! pipelined exchange of the `netlink` crate (which the ipset and conntrack clients use too).
//!
//! - [`codec`]: pure encode/decode of every IPVS command (no IO).
//! - [`Client`]: a blocking client with pipelined batches ([`Client::apply`]) and dumps.
//! - [`savefmt`]: parser and renderer of the `ipvsadm -S` text format.

pub mod client;
pub mod codec;
pub mod error;
pub mod savefmt;
pub mod types;

pub use client::Client;
pub use error::{Error, OpKind, ParseError};
pub use types::{
    tunnel_flags, Counters, Destination, Family, ForwardMethod, Info, Op, OpCounts, Protocol,
    Service, ServiceFlags, ServiceKey, Stats, Timeouts, TunnelType, SCHEDULERS,
};
