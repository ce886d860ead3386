//! Pure encode/decode of IPVS generic netlink messages (no IO).
//!
//! Requests are appended to a caller-owned `Vec<u8>` so many can share one `send`; replies are
//! parsed in place from the received datagram with every length checked.

pub mod consts;
pub mod ipvs;
pub mod netlink;
/// Attributes are framed the same in every netlink family: see [`::netlink::nla`].
pub use ::netlink::nla;

pub use ipvs::{
    decode_dest, decode_info, decode_service, decode_stats, decode_timeouts, put_dump_dests,
    put_dump_services, put_get_config, put_get_info, put_get_service, put_op,
};
pub use netlink::{messages, put_get_family, put_request, Genl, Header, Reply, ReplyAttrs};
pub use nla::{Attr, AttrIter, AttrWriter};

#[cfg(test)]
mod tests;
