//! Netlink message framing, family-independent: the `nlmsghdr` of requests, splitting a
//! received datagram into messages classified by type (ACK, error, DONE, data), and the two
//! ways replies are matched to requests by sequence number (a reply stream ending in
//! ACK/error/DONE, and the ACKs of a window of pipelined requests). Pure: no IO.
//!
//! A family's own header (`genlmsghdr`, `nfgenmsg`) is the first bytes of a data message's
//! payload; the family codecs parse it (see [`messages_with`]).

use crate::consts::{NLMSG_DONE, NLMSG_ERROR, NLMSG_HDRLEN, NLMSG_NOOP, NLMSG_OVERRUN};
use crate::nla::{align4, AttrWriter};
use crate::Error;

/// Appends one request: `nlmsghdr` (type `ty`, port id 0, the kernel), the family header
/// `family_header`, then the attributes `attrs` writes; patches `nlmsg_len`.
pub fn put_message(
    buf: &mut Vec<u8>,
    ty: u16,
    flags: u16,
    seq: u32,
    family_header: &[u8],
    attrs: impl FnOnce(&mut AttrWriter<'_>),
) {
    let start = buf.len();
    buf.extend_from_slice(&[0; 4]); // nlmsg_len, patched below
    buf.extend_from_slice(&ty.to_ne_bytes());
    buf.extend_from_slice(&flags.to_ne_bytes());
    buf.extend_from_slice(&seq.to_ne_bytes());
    buf.extend_from_slice(&0u32.to_ne_bytes());
    buf.extend_from_slice(family_header);
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

/// One received message, classified by `nlmsg_type`. `T` is a data message: [`Data`] as
/// received, or a family codec's reading of it (its family header parsed).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Message<T> {
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
    /// A message of the socket's family (a dump part, a GET reply, ...).
    Data(T),
    /// NLMSG_NOOP or NLMSG_OVERRUN (or a message the family codec does not read); nothing to
    /// do.
    Other {
        /// The netlink header.
        header: Header,
    },
}

/// A data message as received: its header and everything after it (the family header,
/// then attributes).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Data<'a> {
    /// The netlink header.
    pub header: Header,
    /// Everything after the netlink header.
    pub payload: &'a [u8],
}

/// A data message (as received or as a family reads it) knows the request it answers.
pub trait Sequenced {
    /// The sequence number of the message.
    fn seq(&self) -> u32;
}

impl Sequenced for Data<'_> {
    fn seq(&self) -> u32 {
        self.header.seq
    }
}

impl<T: Sequenced> Message<T> {
    /// The sequence number the message belongs to.
    pub fn seq(&self) -> u32 {
        match self {
            Message::Ack { seq } | Message::Error { seq, .. } | Message::Done { seq, .. } => *seq,
            Message::Data(d) => d.seq(),
            Message::Other { header } => header.seq,
        }
    }
}

/// A kernel error code (negative errno in the message) as a positive errno.
fn errno_at(payload: &[u8], what: &'static str) -> Result<i32, Error> {
    let e = payload.get(..4).ok_or(Error::Truncated(what))?;
    let code = i32::from_ne_bytes([e[0], e[1], e[2], e[3]]);
    Ok(code.checked_neg().unwrap_or(i32::MAX))
}

/// Splits the first message off `rest` and classifies it.
fn next_message<'a>(rest: &mut &'a [u8]) -> Result<Message<Data<'a>>, Error> {
    let header = read_header(rest).ok_or(Error::Truncated("netlink header"))?;
    let len = usize::try_from(header.len).unwrap_or(usize::MAX);
    if len < NLMSG_HDRLEN {
        return Err(Error::Malformed(format!("netlink message length {len}")));
    }
    let msg = rest.get(..len).ok_or(Error::Truncated("netlink message"))?;
    *rest = &rest[align4(len).min(rest.len())..];
    let payload = &msg[NLMSG_HDRLEN..];
    match header.ty {
        NLMSG_ERROR => {
            let errno = errno_at(payload, "netlink error code")?;
            // The echoed request header tells which request this answers; the outer header
            // carries the same sequence number, prefer the echoed one if present.
            let seq = read_header(&payload[4..]).map_or(header.seq, |h| h.seq);
            Ok(if errno == 0 {
                Message::Ack { seq }
            } else {
                Message::Error { seq, errno }
            })
        }
        NLMSG_DONE => {
            // A DONE without an error code counts as success; a partial one is truncated.
            let errno = if payload.is_empty() {
                0
            } else {
                errno_at(payload, "netlink done code")?
            };
            Ok(Message::Done {
                seq: header.seq,
                errno,
            })
        }
        NLMSG_NOOP | NLMSG_OVERRUN => Ok(Message::Other { header }),
        _ => Ok(Message::Data(Data { header, payload })),
    }
}

/// Iterator over the messages of one received datagram, data messages read by a family's
/// `parse`. Yields an error (then stops) on truncation or a malformed message.
pub struct Messages<'a, T = Data<'a>, E = Error> {
    rest: &'a [u8],
    failed: bool,
    parse: fn(Data<'a>) -> Result<Message<T>, E>,
}

/// Splits a received datagram into classified messages.
pub fn messages(buf: &[u8]) -> Messages<'_> {
    messages_with(buf, |d| Ok(Message::Data(d)))
}

/// Splits a received datagram into classified messages, each data message read with
/// `parse` (typically its family header; a message the family does not read can become
/// [`Message::Other`]).
pub fn messages_with<'a, T, E>(
    buf: &'a [u8],
    parse: fn(Data<'a>) -> Result<Message<T>, E>,
) -> Messages<'a, T, E> {
    Messages {
        rest: buf,
        failed: false,
        parse,
    }
}

impl<'a, T, E: From<Error>> Iterator for Messages<'a, T, E> {
    type Item = Result<Message<T>, E>;

    fn next(&mut self) -> Option<Self::Item> {
        if self.failed || self.rest.is_empty() {
            return None;
        }
        let r = match next_message(&mut self.rest) {
            Err(e) => Err(E::from(e)),
            Ok(Message::Data(d)) => (self.parse)(d),
            Ok(Message::Ack { seq }) => Ok(Message::Ack { seq }),
            Ok(Message::Error { seq, errno }) => Ok(Message::Error { seq, errno }),
            Ok(Message::Done { seq, errno }) => Ok(Message::Done { seq, errno }),
            Ok(Message::Other { header }) => Ok(Message::Other { header }),
        };
        if r.is_err() {
            self.failed = true;
        }
        Some(r)
    }
}

impl<T, E> Clone for Messages<'_, T, E> {
    fn clone(&self) -> Self {
        Messages {
            rest: self.rest,
            failed: self.failed,
            parse: self.parse,
        }
    }
}

impl<T, E> std::fmt::Debug for Messages<'_, T, E> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Messages")
            .field("rest", &self.rest.len())
            .field("failed", &self.failed)
            .finish()
    }
}

/// How the kernel ended its replies to one request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum End {
    /// An ACK (NLMSG_ERROR with error 0).
    Ack,
    /// NLMSG_DONE, with the dump's errno (0: complete).
    Done {
        /// Positive errno, 0 when the dump completed.
        errno: i32,
    },
    /// NLMSG_ERROR with a non-zero error.
    Error {
        /// Positive errno.
        errno: i32,
    },
}

impl End {
    /// The errno when the request failed (an error, or a DONE carrying one).
    pub fn errno(&self) -> Option<i32> {
        match *self {
            End::Ack | End::Done { errno: 0 } => None,
            End::Done { errno } | End::Error { errno } => Some(errno),
        }
    }
}

/// Walks one datagram for the replies to request `seq`: its data messages go to `each`,
/// messages of other requests are skipped. Returns the end of the
/// replies when this datagram holds it, `None` when more datagrams follow. A malformed
/// message or an error from `each` stops the walk and is returned.
pub fn replies<E: From<Error>>(
    datagram: &[u8],
    seq: u32,
    each: &mut impl FnMut(Data<'_>) -> Result<(), E>,
) -> Result<Option<End>, E> {
    for m in messages(datagram) {
        let m = m?;
        if m.seq() != seq {
            continue;
        }
        match m {
            Message::Data(d) => each(d)?,
            Message::Ack { .. } => return Ok(Some(End::Ack)),
            Message::Done { errno, .. } => return Ok(Some(End::Done { errno })),
            Message::Error { errno, .. } => return Ok(Some(End::Error { errno })),
            Message::Other { .. } => {}
        }
    }
    Ok(None)
}

/// The answers still awaited for a window of pipelined requests numbered `base`, `base + 1`,
/// ... (each sent with `NLM_F_ACK`, so each gets exactly one ACK or error).
#[derive(Debug, Clone)]
pub struct Pending {
    base: u32,
    answered: Vec<bool>,
    left: usize,
}

impl Pending {
    /// `count` unanswered requests, the first numbered `base`.
    pub fn new(base: u32, count: usize) -> Pending {
        Pending {
            base,
            answered: vec![false; count],
            left: count,
        }
    }

    /// How many requests are still unanswered.
    pub fn left(&self) -> usize {
        self.left
    }

    /// The positions (`i` of request `base + i`) of the requests still unanswered, in order.
    pub fn unanswered(&self) -> impl Iterator<Item = usize> + '_ {
        self.answered
            .iter()
            .enumerate()
            .filter(|(_, answered)| !**answered)
            .map(|(i, _)| i)
    }

    /// Takes the ACKs and errors in one datagram: calls `answer(i, result)` once for request
    /// `base + i` (`Err` holds the positive errno). Repeated answers, data messages and other
    /// sequence numbers are skipped. A malformed message stops the walk and is returned (the
    /// answers before it count).
    pub fn take(
        &mut self,
        datagram: &[u8],
        mut answer: impl FnMut(usize, Result<(), i32>),
    ) -> Result<(), Error> {
        for m in messages(datagram) {
            let (seq, result) = match m? {
                Message::Ack { seq } => (seq, Ok(())),
                Message::Error { seq, errno } => (seq, Err(errno)),
                _ => continue,
            };
            let i = usize::try_from(seq.wrapping_sub(self.base)).unwrap_or(usize::MAX);
            let Some(slot) = self.answered.get_mut(i) else {
                continue;
            };
            if *slot {
                continue;
            }
            *slot = true;
            self.left -= 1;
            answer(i, result);
        }
        Ok(())
    }
}
