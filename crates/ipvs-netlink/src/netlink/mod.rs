//! Netlink framing and a blocking socket, shared by every netlink family this workspace
//! speaks (IPVS over generic netlink here, ctnetlink in `controller`).
//!
//! - [`consts`]: `netlink.h` numbers.
//! - [`nla`]: attribute (TLV) writing and bounds-checked reading.
//! - [`message`]: `nlmsghdr` framing of requests, classification of received messages, and
//!   matching replies to requests by sequence number (pure, no IO).
//! - [`socket`]: the socket itself: send, receive, receive until a request's replies end.
//!
//! Family codecs write their own header and attributes with [`put_message`] and read replies
//! with [`messages_with`]; every error is this crate's [`crate::Error`].

pub mod consts;
pub mod message;
pub mod nla;
pub mod socket;

pub use message::{
    messages, messages_with, put_message, replies, Data, End, Header, Message, Messages, Pending,
    Sequenced,
};
pub use nla::{align4, Attr, AttrIter, AttrWriter};
pub use socket::{Socket, SocketProtocol, DEFAULT_RECV_TIMEOUT};

#[cfg(test)]
mod tests;
