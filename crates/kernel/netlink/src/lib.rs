//! Netlink for the kernel families this workspace speaks with its own codecs: IPVS (generic
//! netlink, `ipvs-netlink`), ipset and ctnetlink (nfnetlink, `ipset` and `controller`'s
//! conntrack cleaner). Links and addresses are not here: `netif` uses rtnetlink.
//!
//! Hand-written, not neli: the framing is a few hundred lines that write requests straight
//! into one shared send buffer (many requests per `send`) and read replies in place from one
//! receive buffer (attributes are borrowed slices, nothing is allocated per message), and the
//! pipelined exchange needs to put requests into a window and match ACKs by sequence number,
//! which neli's socket API (one request, then its replies) does not offer. The measured
//! figures that keep it are in `docs/architecture.md` ("Why hand-written netlink framing").
//!
//! - [`consts`]: `netlink.h` numbers.
//! - [`nla`]: attribute (TLV) writing and bounds-checked reading.
//! - [`message`]: `nlmsghdr` framing of requests, classification of received messages, and
//!   matching replies to requests by sequence number (pure, no IO).
//! - [`socket`]: the blocking socket: send, receive, receive until a request's replies end.
//! - [`pipeline`]: the one pipelined request/ACK exchange ([`Socket::exchange`]) the IPVS,
//!   ipset and conntrack clients share: windows, sequence matching, ENOBUFS.
//! - [`error`]: this crate's [`Error`]; socket errors keep their errno.
//!
//! Family codecs write their own header and attributes with [`put_message`] and read replies
//! with [`messages_with`]; their error types take this crate's [`Error`] with `From`.

pub mod consts;
pub mod error;
pub mod message;
pub mod nla;
pub mod pipeline;
pub mod socket;

pub use error::Error;
pub use message::{
    messages, messages_with, put_message, replies, Data, End, Header, Message, Messages, Pending,
    Sequenced,
};
pub use nla::{align4, Attr, AttrIter, AttrWriter};
pub use pipeline::{Answer, Window};
pub use socket::{Socket, SocketProtocol, DEFAULT_RECV_TIMEOUT};

#[cfg(test)]
mod tests;
