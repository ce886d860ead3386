//! Netlink and generic netlink message framing: request headers and reply classification.

use super::consts::*;
use super::nla::{align4, AttrIter, AttrWriter};
use crate::Error;

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
    let start = buf.len();
    buf.extend_from_slice(&[0; 4]); // nlmsg_len, patched below
    buf.extend_from_slice(&family.to_ne_bytes());
    buf.extend_from_slice(&flags.to_ne_bytes());
    buf.extend_from_slice(&seq.to_ne_bytes());
    buf.extend_from_slice(&0u32.to_ne_bytes());
    buf.extend_from_slice(&[cmd, version, 0, 0]);
    attrs(&mut AttrWriter::new(buf));
    let len = u32::try_from(buf.len() - start).unwrap_or(u32::MAX);
    buf[start..start + 4].copy_from_slice(&len.to_ne_bytes());
}

/// The fixed netlink header of a received message.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Header {
    /// `nlmsg_len`.
    pub len: u32,
    /// `nlmsg_type` (family id, or NLMSG_ERROR/DONE/...).
    pub ty: u16,
    /// `nlmsg_flags`.
    pub flags: u16,
    /// `nlmsg_seq`.
    pub seq: u32,
    /// `nlmsg_pid`.
    pub pid: u32,
}

fn read_header(b: &[u8]) -> Option<Header> {
    let h = b.get(..NLMSG_HDRLEN)?;
    Some(Header {
        len: u32::from_ne_bytes([h[0], h[1], h[2], h[3]]),
        ty: u16::from_ne_bytes([h[4], h[5]]),
        flags: u16::from_ne_bytes([h[6], h[7]]),
        seq: u32::from_ne_bytes([h[8], h[9], h[10], h[11]]),
        pid: u32::from_ne_bytes([h[12], h[13], h[14], h[15]]),
    })
}

/// A classified reply message.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reply<'a> {
    /// NLMSG_ERROR with error 0: the request with this sequence number succeeded.
    Ack {
        /// Sequence number of the acknowledged request.
        seq: u32,
    },
    /// NLMSG_ERROR with a non-zero error.
    Error {
        /// Sequence number of the failed request.
        seq: u32,
        /// Positive errno.
        errno: i32,
    },
    /// NLMSG_DONE: end of a dump (with the dump's error status, 0 on success).
    Done {
        /// Sequence number of the dump request.
        seq: u32,
        /// Positive errno, 0 when the dump completed.
        errno: i32,
    },
    /// A generic netlink data message (a dump part or a GET reply).
    Data {
        /// The netlink header.
        header: Header,
        /// Generic netlink command.
        cmd: u8,
        /// Generic netlink family version.
        version: u8,
        /// The top-level attributes (after the genl header).
        attrs: &'a [u8],
    },
    /// NLMSG_NOOP or NLMSG_OVERRUN; nothing to do.
    Other {
        /// The netlink header.
        header: Header,
    },
}

impl Reply<'_> {
    /// The sequence number the message belongs to.
    pub fn seq(&self) -> u32 {
        match self {
            Reply::Ack { seq } | Reply::Error { seq, .. } | Reply::Done { seq, .. } => *seq,
            Reply::Data { header, .. } | Reply::Other { header } => header.seq,
        }
    }

    /// Top-level attributes of a data message (empty for others).
    pub fn attr_iter(&self) -> AttrIter<'_> {
        match self {
            Reply::Data { attrs, .. } => AttrIter::new(attrs),
            _ => AttrIter::new(&[]),
        }
    }
}

/// Iterator over the netlink messages in one received datagram.
#[derive(Debug, Clone)]
pub struct Messages<'a> {
    rest: &'a [u8],
    failed: bool,
}

/// Split a received datagram into classified messages.
pub fn messages(buf: &[u8]) -> Messages<'_> {
    Messages {
        rest: buf,
        failed: false,
    }
}

impl<'a> Iterator for Messages<'a> {
    type Item = Result<Reply<'a>, Error>;

    fn next(&mut self) -> Option<Self::Item> {
        if self.failed || self.rest.is_empty() {
            return None;
        }
        let r = self.next_inner();
        if r.is_err() {
            self.failed = true;
        }
        Some(r)
    }
}

impl<'a> Messages<'a> {
    fn next_inner(&mut self) -> Result<Reply<'a>, Error> {
        let header = read_header(self.rest).ok_or(Error::Truncated("netlink header"))?;
        let len = usize::try_from(header.len).unwrap_or(usize::MAX);
        if len < NLMSG_HDRLEN {
            return Err(Error::Malformed(format!("netlink message length {len}")));
        }
        let msg = self
            .rest
            .get(..len)
            .ok_or(Error::Truncated("netlink message"))?;
        let advance = align4(len).min(self.rest.len());
        self.rest = &self.rest[advance..];
        let payload = &msg[NLMSG_HDRLEN..];
        match header.ty {
            NLMSG_ERROR => {
                let e = payload
                    .get(..4)
                    .ok_or(Error::Truncated("netlink error code"))?;
                let code = i32::from_ne_bytes([e[0], e[1], e[2], e[3]]);
                // The echoed request header tells which request this answers; the outer
                // header carries the same sequence number, prefer the echoed one if present.
                let seq = read_header(&payload[4..]).map_or(header.seq, |h| h.seq);
                if code == 0 {
                    Ok(Reply::Ack { seq })
                } else {
                    Ok(Reply::Error {
                        seq,
                        errno: code.checked_neg().unwrap_or(i32::MAX),
                    })
                }
            }
            NLMSG_DONE => {
                let errno = match payload.get(..4) {
                    Some(e) => i32::from_ne_bytes([e[0], e[1], e[2], e[3]])
                        .checked_neg()
                        .unwrap_or(i32::MAX),
                    None => 0,
                };
                Ok(Reply::Done {
                    seq: header.seq,
                    errno,
                })
            }
            NLMSG_NOOP | NLMSG_OVERRUN => Ok(Reply::Other { header }),
            _ => {
                let g = payload
                    .get(..GENL_HDRLEN)
                    .ok_or(Error::Truncated("generic netlink header"))?;
                Ok(Reply::Data {
                    header,
                    cmd: g[0],
                    version: g[1],
                    attrs: &payload[GENL_HDRLEN..],
                })
            }
        }
    }
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
            return a.as_u16();
        }
    }
    Err(Error::Malformed(
        "family reply without CTRL_ATTR_FAMILY_ID".into(),
    ))
}
