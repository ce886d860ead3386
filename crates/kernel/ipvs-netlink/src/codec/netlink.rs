//! Generic netlink (genl) framing on top of [`::netlink`]: requests with a
//! `genlmsghdr`, and replies whose data messages carry one.

use super::consts::*;
use crate::Error;
use ::netlink::message::{messages_with, put_message, Data, Message, Sequenced};
use ::netlink::nla::{AttrIter, AttrWriter};

pub use ::netlink::message::Header;

/// Appends one generic netlink request (`nlmsghdr` + `genlmsghdr` + attributes written by
/// `attrs`) to `buf`. The port id is 0 (the kernel), as for every request to the kernel.
pub fn put_request(
    buf: &mut Vec<u8>,
    family: u16,
    flags: u16,
    seq: u32,
    cmd: u8,
    version: u8,
    attrs: impl FnOnce(&mut AttrWriter<'_>),
) {
    put_message(buf, family, flags, seq, &[cmd, version, 0, 0], attrs);
}

/// A generic netlink data message (a dump part or a GET reply): its `genlmsghdr` read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Genl<'a> {
    /// The netlink header.
    pub header: Header,
    /// Generic netlink command.
    pub cmd: u8,
    /// Generic netlink family version.
    pub version: u8,
    /// The top-level attributes (after the genl header).
    pub attrs: &'a [u8],
}

impl<'a> Genl<'a> {
    /// Reads the `genlmsghdr` at the start of a data message.
    pub fn parse(data: Data<'a>) -> Result<Genl<'a>, Error> {
        let g = data
            .payload
            .get(..GENL_HDRLEN)
            .ok_or(Error::Truncated("generic netlink header"))?;
        Ok(Genl {
            header: data.header,
            cmd: g[0],
            version: g[1],
            attrs: &data.payload[GENL_HDRLEN..],
        })
    }

    /// The top-level attributes.
    pub fn attr_iter(&self) -> AttrIter<'a> {
        AttrIter::new(self.attrs)
    }
}

impl Sequenced for Genl<'_> {
    fn seq(&self) -> u32 {
        self.header.seq
    }
}

/// A classified reply message, data messages read as generic netlink.
pub type Reply<'a> = Message<Genl<'a>>;

/// The attributes of a [`Reply`] (a trait: [`Message`] is the `netlink` crate's type).
pub trait ReplyAttrs<'a> {
    /// Top-level attributes of a data message (empty for others).
    fn attr_iter(&self) -> AttrIter<'a>;
}

impl<'a> ReplyAttrs<'a> for Message<Genl<'a>> {
    fn attr_iter(&self) -> AttrIter<'a> {
        match self {
            Message::Data(g) => g.attr_iter(),
            _ => AttrIter::new(&[]),
        }
    }
}

/// Iterator over the generic netlink messages in one received datagram.
pub type Messages<'a> = ::netlink::message::Messages<'a, Genl<'a>, Error>;

/// Split a received datagram into classified messages.
pub fn messages(buf: &[u8]) -> Messages<'_> {
    messages_with(buf, |d| Genl::parse(d).map(Message::Data))
}

/// Appends a `CTRL_CMD_GETFAMILY` request for `name`.
pub fn put_get_family(buf: &mut Vec<u8>, seq: u32, name: &str) {
    put_request(
        buf,
        GENL_ID_CTRL,
        NLM_F_REQUEST | NLM_F_ACK,
        seq,
        CTRL_CMD_GETFAMILY,
        1,
        |w| w.string(CTRL_ATTR_FAMILY_NAME, name),
    );
}

/// The family id in a `CTRL_CMD_NEWFAMILY` reply's attributes.
pub fn decode_family_id(attrs: AttrIter<'_>) -> Result<u16, Error> {
    for a in attrs {
        let a = a?;
        if a.ty == CTRL_ATTR_FAMILY_ID {
            return Ok(a.as_u16()?);
        }
    }
    Err(Error::Malformed(
        "family reply without CTRL_ATTR_FAMILY_ID".into(),
    ))
}
