//! Pure ctnetlink (NETLINK_NETFILTER, subsystem CTNETLINK) encode/decode: filtered dump
//! requests, exact-tuple delete requests, reply classification and entry decoding. No IO.
//!
//! Constants are from the kernel UAPI (`linux/netlink.h`, `linux/netfilter/nfnetlink.h`,
//! `linux/netfilter/nfnetlink_conntrack.h`); the `CTA_FILTER_F_*` flag bits are defined in the
//! kernel's `net/netfilter/nf_internals.h` (stable since 5.8, not exported to UAPI headers).
//! Every length in a reply is checked: truncated or malformed input is an error, never a panic.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use super::{ConntrackError, ConntrackFilter, Protocol};

// linux/netlink.h
/// `NLMSG_ERROR` (an ACK when the error code is 0).
pub const NLMSG_ERROR: u16 = 2;
/// `NLMSG_DONE`, the end of a dump.
pub const NLMSG_DONE: u16 = 3;
/// `NLM_F_REQUEST`.
pub const NLM_F_REQUEST: u16 = 0x1;
/// `NLM_F_ACK`.
pub const NLM_F_ACK: u16 = 0x4;
/// `NLM_F_DUMP` (`NLM_F_ROOT | NLM_F_MATCH`).
pub const NLM_F_DUMP: u16 = 0x300;
/// `NLA_F_NESTED`: required on `CTA_FILTER` (parsed with strict `nla_parse_nested`).
pub const NLA_F_NESTED: u16 = 0x8000;
/// Attribute type without the NESTED / NET_BYTEORDER bits.
pub const NLA_TYPE_MASK: u16 = 0x3fff;
/// `sizeof(struct nlmsghdr)`.
pub const NLMSG_HDRLEN: usize = 16;
/// `NLA_HDRLEN`.
pub const NLA_HDRLEN: usize = 4;

// linux/netfilter/nfnetlink.h
/// `sizeof(struct nfgenmsg)` (family u8, version u8, res_id be16).
pub const NFGENMSG_LEN: usize = 4;
/// `NFNETLINK_V0`.
pub const NFNETLINK_V0: u8 = 0;
/// `NFNL_SUBSYS_CTNETLINK`.
pub const NFNL_SUBSYS_CTNETLINK: u16 = 1;

// linux/netfilter/nfnetlink_conntrack.h
/// `IPCTNL_MSG_CT_NEW` (also the type of every dumped entry).
pub const IPCTNL_MSG_CT_NEW: u16 = 0;
/// `IPCTNL_MSG_CT_GET`.
pub const IPCTNL_MSG_CT_GET: u16 = 1;
/// `IPCTNL_MSG_CT_DELETE`.
pub const IPCTNL_MSG_CT_DELETE: u16 = 2;
/// `CTA_TUPLE_ORIG`.
pub const CTA_TUPLE_ORIG: u16 = 1;
/// `CTA_TUPLE_REPLY`.
pub const CTA_TUPLE_REPLY: u16 = 2;
/// `CTA_ID` (be32).
pub const CTA_ID: u16 = 12;
/// `CTA_ZONE` (be16).
pub const CTA_ZONE: u16 = 18;
/// `CTA_FILTER` (nested: `CTA_FILTER_ORIG_FLAGS`, `CTA_FILTER_REPLY_FLAGS`).
pub const CTA_FILTER: u16 = 25;
/// `CTA_TUPLE_IP`.
pub const CTA_TUPLE_IP: u16 = 1;
/// `CTA_TUPLE_PROTO`.
pub const CTA_TUPLE_PROTO: u16 = 2;
/// `CTA_IP_V4_SRC`.
pub const CTA_IP_V4_SRC: u16 = 1;
/// `CTA_IP_V4_DST`.
pub const CTA_IP_V4_DST: u16 = 2;
/// `CTA_IP_V6_SRC`.
pub const CTA_IP_V6_SRC: u16 = 3;
/// `CTA_IP_V6_DST`.
pub const CTA_IP_V6_DST: u16 = 4;
/// `CTA_PROTO_NUM` (u8).
pub const CTA_PROTO_NUM: u16 = 1;
/// `CTA_PROTO_SRC_PORT` (be16).
pub const CTA_PROTO_SRC_PORT: u16 = 2;
/// `CTA_PROTO_DST_PORT` (be16).
pub const CTA_PROTO_DST_PORT: u16 = 3;
/// `CTA_FILTER_ORIG_FLAGS` (u32, host order).
pub const CTA_FILTER_ORIG_FLAGS: u16 = 1;
/// `CTA_FILTER_REPLY_FLAGS` (u32, host order).
pub const CTA_FILTER_REPLY_FLAGS: u16 = 2;

// net/netfilter/nf_internals.h
/// `CTA_FILTER_F_CTA_IP_SRC`.
pub const CTA_FILTER_F_IP_SRC: u32 = 1 << 0;
/// `CTA_FILTER_F_CTA_IP_DST`.
pub const CTA_FILTER_F_IP_DST: u32 = 1 << 1;
/// `CTA_FILTER_F_CTA_PROTO_NUM`.
pub const CTA_FILTER_F_PROTO_NUM: u32 = 1 << 3;
/// `CTA_FILTER_F_CTA_PROTO_SRC_PORT`.
pub const CTA_FILTER_F_PROTO_SRC_PORT: u32 = 1 << 4;
/// `CTA_FILTER_F_CTA_PROTO_DST_PORT`.
pub const CTA_FILTER_F_PROTO_DST_PORT: u32 = 1 << 5;

/// `AF_INET`.
pub const AF_INET: u8 = 2;
/// `AF_INET6`.
pub const AF_INET6: u8 = 10;

/// The nfnetlink message type of a ctnetlink operation.
pub fn msg_type(op: u16) -> u16 {
    (NFNL_SUBSYS_CTNETLINK << 8) | op
}

/// Address family byte (`nfgen_family`) of an address.
pub fn family_of(ip: &IpAddr) -> u8 {
    match ip {
        IpAddr::V4(_) => AF_INET,
        IpAddr::V6(_) => AF_INET6,
    }
}

/// One direction of a connection as the kernel reports it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Tuple {
    /// Source address.
    pub src: IpAddr,
    /// Destination address.
    pub dst: IpAddr,
    /// IP protocol number (17 = UDP).
    pub proto: u8,
    /// Source port (TCP/UDP/SCTP only).
    pub src_port: Option<u16>,
    /// Destination port (TCP/UDP/SCTP only).
    pub dst_port: Option<u16>,
}

/// A conntrack entry: both tuples plus what an exact delete needs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Entry {
    /// Original direction (client → service address).
    pub orig: Tuple,
    /// Reply direction (after DNAT its source is the endpoint).
    pub reply: Tuple,
    /// `CTA_ID`, raw (echoed back on delete so a recreated entry is not hit).
    pub id: Option<u32>,
    /// `CTA_ZONE` when the entry is not in the default zone.
    pub zone: Option<u16>,
}

/// Appends one attribute with a raw payload (padded to 4 bytes).
fn put_attr(buf: &mut Vec<u8>, ty: u16, payload: &[u8]) {
    let len = NLA_HDRLEN + payload.len();
    // Payloads here are at most 16 bytes, so the length always fits.
    buf.extend_from_slice(&u16::try_from(len).unwrap_or(u16::MAX).to_ne_bytes());
    buf.extend_from_slice(&ty.to_ne_bytes());
    buf.extend_from_slice(payload);
    pad(buf);
}

fn pad(buf: &mut Vec<u8>) {
    while buf.len() % 4 != 0 {
        buf.push(0);
    }
}

/// Appends a nested attribute (with `NLA_F_NESTED`) whose body `f` writes.
fn put_nested(buf: &mut Vec<u8>, ty: u16, f: impl FnOnce(&mut Vec<u8>)) {
    let start = buf.len();
    buf.extend_from_slice(&[0, 0]);
    buf.extend_from_slice(&(ty | NLA_F_NESTED).to_ne_bytes());
    f(buf);
    let len = u16::try_from(buf.len() - start).unwrap_or(u16::MAX);
    buf[start..start + 2].copy_from_slice(&len.to_ne_bytes());
}

/// Appends `nlmsghdr` + `nfgenmsg` and the attributes `attrs` writes; patches the length.
fn put_msg(
    buf: &mut Vec<u8>,
    op: u16,
    flags: u16,
    seq: u32,
    family: u8,
    attrs: impl FnOnce(&mut Vec<u8>),
) {
    let start = buf.len();
    buf.extend_from_slice(&[0; 4]);
    buf.extend_from_slice(&msg_type(op).to_ne_bytes());
    buf.extend_from_slice(&flags.to_ne_bytes());
    buf.extend_from_slice(&seq.to_ne_bytes());
    buf.extend_from_slice(&0u32.to_ne_bytes());
    buf.extend_from_slice(&[family, NFNETLINK_V0, 0, 0]);
    attrs(buf);
    let len = u32::try_from(buf.len() - start).unwrap_or(u32::MAX);
    buf[start..start + 4].copy_from_slice(&len.to_ne_bytes());
}

fn put_ip(buf: &mut Vec<u8>, v4: u16, v6: u16, ip: &IpAddr) {
    match ip {
        IpAddr::V4(a) => put_attr(buf, v4, &a.octets()),
        IpAddr::V6(a) => put_attr(buf, v6, &a.octets()),
    }
}

/// How a dump request restricts the entries the kernel returns.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DumpScope<'a> {
    /// Kernel-side `CTA_FILTER` for one filter: protocol, ports, and (IPv4 only) addresses.
    Filter(&'a ConntrackFilter),
    /// Kernel-side `CTA_FILTER` on the protocol alone (one dump serving many filters).
    Protocol(Protocol),
    /// Only the address family (`nfgen_family`); works on every kernel.
    Family,
}

/// Appends an `IPCTNL_MSG_CT_GET` dump request for `family` restricted by `scope`.
///
/// IPv6 addresses are never put in the kernel filter: kernels up to at least 6.1 compare
/// them with `!ipv6_addr_cmp()`, i.e. inverted, so a v6 address filter would drop exactly the
/// entries wanted. Addresses are always re-checked in user space ([`ConntrackFilter::matches`]).
pub fn put_dump(buf: &mut Vec<u8>, seq: u32, family: u8, scope: DumpScope<'_>) {
    put_msg(
        buf,
        IPCTNL_MSG_CT_GET,
        NLM_F_REQUEST | NLM_F_DUMP,
        seq,
        family,
        |b| match scope {
            DumpScope::Family => {}
            DumpScope::Protocol(p) => {
                put_nested(b, CTA_TUPLE_ORIG, |b| {
                    put_nested(b, CTA_TUPLE_PROTO, |b| {
                        put_attr(b, CTA_PROTO_NUM, &[p.number()]);
                    });
                });
                put_nested(b, CTA_FILTER, |b| {
                    put_attr(
                        b,
                        CTA_FILTER_ORIG_FLAGS,
                        &CTA_FILTER_F_PROTO_NUM.to_ne_bytes(),
                    );
                });
            }
            DumpScope::Filter(f) => put_filter(b, family, f),
        },
    );
}

fn put_filter(b: &mut Vec<u8>, family: u8, f: &ConntrackFilter) {
    let ips = family == AF_INET;
    let mut orig_flags = CTA_FILTER_F_PROTO_NUM;
    put_nested(b, CTA_TUPLE_ORIG, |b| {
        if ips {
            orig_flags |= CTA_FILTER_F_IP_DST;
            put_nested(b, CTA_TUPLE_IP, |b| {
                put_ip(b, CTA_IP_V4_DST, CTA_IP_V6_DST, &f.orig_dst);
            });
        }
        put_nested(b, CTA_TUPLE_PROTO, |b| {
            put_attr(b, CTA_PROTO_NUM, &[f.proto.number()]);
            if let Some(p) = f.orig_dst_port {
                orig_flags |= CTA_FILTER_F_PROTO_DST_PORT;
                put_attr(b, CTA_PROTO_DST_PORT, &p.to_be_bytes());
            }
        });
    });
    let mut reply_flags = 0u32;
    let reply_ip = f.reply_src.filter(|_| ips);
    if reply_ip.is_some() || f.reply_src_port.is_some() {
        put_nested(b, CTA_TUPLE_REPLY, |b| {
            if let Some(ip) = reply_ip {
                reply_flags |= CTA_FILTER_F_IP_SRC;
                put_nested(b, CTA_TUPLE_IP, |b| {
                    put_ip(b, CTA_IP_V4_SRC, CTA_IP_V6_SRC, &ip);
                });
            }
            // Port flags are only accepted together with the protocol number.
            reply_flags |= CTA_FILTER_F_PROTO_NUM;
            put_nested(b, CTA_TUPLE_PROTO, |b| {
                put_attr(b, CTA_PROTO_NUM, &[f.proto.number()]);
                if let Some(p) = f.reply_src_port {
                    reply_flags |= CTA_FILTER_F_PROTO_SRC_PORT;
                    put_attr(b, CTA_PROTO_SRC_PORT, &p.to_be_bytes());
                }
            });
        });
    }
    put_nested(b, CTA_FILTER, |b| {
        put_attr(b, CTA_FILTER_ORIG_FLAGS, &orig_flags.to_ne_bytes());
        if reply_flags != 0 {
            put_attr(b, CTA_FILTER_REPLY_FLAGS, &reply_flags.to_ne_bytes());
        }
    });
}

/// Appends an `IPCTNL_MSG_CT_DELETE` for exactly `entry`: its original tuple, its id (the
/// kernel answers ENOENT if the tuple now belongs to a different, newer entry) and its zone.
pub fn put_delete(buf: &mut Vec<u8>, seq: u32, entry: &Entry) {
    let t = &entry.orig;
    put_msg(
        buf,
        IPCTNL_MSG_CT_DELETE,
        NLM_F_REQUEST | NLM_F_ACK,
        seq,
        family_of(&t.src),
        |b| {
            put_nested(b, CTA_TUPLE_ORIG, |b| {
                put_nested(b, CTA_TUPLE_IP, |b| {
                    put_ip(b, CTA_IP_V4_SRC, CTA_IP_V6_SRC, &t.src);
                    put_ip(b, CTA_IP_V4_DST, CTA_IP_V6_DST, &t.dst);
                });
                put_nested(b, CTA_TUPLE_PROTO, |b| {
                    put_attr(b, CTA_PROTO_NUM, &[t.proto]);
                    if let Some(p) = t.src_port {
                        put_attr(b, CTA_PROTO_SRC_PORT, &p.to_be_bytes());
                    }
                    if let Some(p) = t.dst_port {
                        put_attr(b, CTA_PROTO_DST_PORT, &p.to_be_bytes());
                    }
                });
            });
            if let Some(z) = entry.zone {
                put_attr(b, CTA_ZONE, &z.to_be_bytes());
            }
            if let Some(id) = entry.id {
                put_attr(b, CTA_ID, &id.to_be_bytes());
            }
        },
    );
}

/// A classified netlink message from the kernel.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reply<'a> {
    /// `NLMSG_ERROR` with code 0.
    Ack {
        /// Sequence number of the acknowledged request.
        seq: u32,
    },
    /// `NLMSG_ERROR` with a non-zero code.
    Error {
        /// Sequence number of the failed request.
        seq: u32,
        /// Positive errno.
        errno: i32,
    },
    /// `NLMSG_DONE`: the dump with this sequence number is complete.
    Done {
        /// Sequence number of the dump.
        seq: u32,
        /// Positive errno carried by DONE (0 on success).
        errno: i32,
    },
    /// A ctnetlink data message (`IPCTNL_MSG_CT_NEW` for dumped entries).
    Data {
        /// Sequence number.
        seq: u32,
        /// `nlmsg_type`.
        ty: u16,
        /// `nfgen_family`.
        family: u8,
        /// Top-level attributes after the `nfgenmsg` header.
        attrs: &'a [u8],
    },
    /// NOOP / OVERRUN / anything else.
    Other {
        /// Sequence number.
        seq: u32,
    },
}

impl Reply<'_> {
    /// The sequence number this message answers.
    pub fn seq(&self) -> u32 {
        match self {
            Reply::Ack { seq }
            | Reply::Error { seq, .. }
            | Reply::Done { seq, .. }
            | Reply::Data { seq, .. }
            | Reply::Other { seq } => *seq,
        }
    }
}

fn ne_u16(b: &[u8], at: usize) -> Option<u16> {
    Some(u16::from_ne_bytes(b.get(at..at + 2)?.try_into().ok()?))
}

fn ne_u32(b: &[u8], at: usize) -> Option<u32> {
    Some(u32::from_ne_bytes(b.get(at..at + 4)?.try_into().ok()?))
}

/// Iterator over the netlink messages of one datagram; yields one error and stops on
/// truncation.
#[derive(Debug, Clone)]
pub struct Messages<'a> {
    rest: &'a [u8],
    failed: bool,
}

/// Splits a received datagram into classified messages.
pub fn messages(buf: &[u8]) -> Messages<'_> {
    Messages {
        rest: buf,
        failed: false,
    }
}

impl<'a> Iterator for Messages<'a> {
    type Item = Result<Reply<'a>, ConntrackError>;

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
    fn next_inner(&mut self) -> Result<Reply<'a>, ConntrackError> {
        let b = self.rest;
        let (Some(len), Some(ty), Some(seq)) = (ne_u32(b, 0), ne_u16(b, 4), ne_u32(b, 8)) else {
            return Err(ConntrackError::Truncated("netlink header"));
        };
        if b.len() < NLMSG_HDRLEN {
            return Err(ConntrackError::Truncated("netlink header"));
        }
        let len = usize::try_from(len).unwrap_or(usize::MAX);
        if len < NLMSG_HDRLEN {
            return Err(ConntrackError::Malformed(format!(
                "netlink message length {len}"
            )));
        }
        let msg = b
            .get(..len)
            .ok_or(ConntrackError::Truncated("netlink message"))?;
        self.rest = &b[align4(len).min(b.len())..];
        let payload = &msg[NLMSG_HDRLEN..];
        let code = |what| {
            let c = ne_u32(payload, 0).ok_or(ConntrackError::Truncated(what))?;
            // The kernel sends a negative errno.
            let c = i32::from_ne_bytes(c.to_ne_bytes());
            Ok::<i32, ConntrackError>(c.checked_neg().unwrap_or(i32::MAX))
        };
        match ty {
            NLMSG_ERROR => {
                let errno = code("netlink error code")?;
                // The echoed request header carries the request's sequence number.
                let seq = ne_u32(payload, 4 + 8).unwrap_or(seq);
                Ok(if errno == 0 {
                    Reply::Ack { seq }
                } else {
                    Reply::Error { seq, errno }
                })
            }
            NLMSG_DONE => {
                let errno = if payload.is_empty() {
                    0
                } else {
                    code("netlink done code")?
                };
                Ok(Reply::Done { seq, errno })
            }
            t if t >> 8 == NFNL_SUBSYS_CTNETLINK => {
                let h = payload
                    .get(..NFGENMSG_LEN)
                    .ok_or(ConntrackError::Truncated("nfgenmsg header"))?;
                Ok(Reply::Data {
                    seq,
                    ty: t,
                    family: h[0],
                    attrs: &payload[NFGENMSG_LEN..],
                })
            }
            _ => Ok(Reply::Other { seq }),
        }
    }
}

fn align4(n: usize) -> usize {
    n.saturating_add(3) & !3
}

/// One attribute: type (flag bits masked off) and payload.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Attr<'a> {
    /// Attribute type.
    pub ty: u16,
    /// Payload without padding.
    pub payload: &'a [u8],
}

/// Bounds-checked iterator over a run of attributes.
#[derive(Debug, Clone)]
pub struct Attrs<'a> {
    rest: &'a [u8],
    failed: bool,
}

/// Iterates the attributes in `buf`.
pub fn attrs(buf: &[u8]) -> Attrs<'_> {
    Attrs {
        rest: buf,
        failed: false,
    }
}

impl<'a> Iterator for Attrs<'a> {
    type Item = Result<Attr<'a>, ConntrackError>;

    fn next(&mut self) -> Option<Self::Item> {
        if self.failed || self.rest.is_empty() {
            return None;
        }
        let (Some(len), Some(ty)) = (ne_u16(self.rest, 0), ne_u16(self.rest, 2)) else {
            self.failed = true;
            return Some(Err(ConntrackError::Truncated("attribute header")));
        };
        let len = usize::from(len);
        let ty = ty & NLA_TYPE_MASK;
        if len < NLA_HDRLEN {
            self.failed = true;
            return Some(Err(ConntrackError::Malformed(format!(
                "attribute {ty} with length {len}"
            ))));
        }
        let Some(payload) = self.rest.get(NLA_HDRLEN..len) else {
            self.failed = true;
            return Some(Err(ConntrackError::Truncated("attribute payload")));
        };
        self.rest = &self.rest[align4(len).min(self.rest.len())..];
        Some(Ok(Attr { ty, payload }))
    }
}

fn exact<const N: usize>(a: &Attr<'_>, what: &str) -> Result<[u8; N], ConntrackError> {
    a.payload.try_into().map_err(|_| {
        ConntrackError::Malformed(format!(
            "{what} has length {}, expected {N}",
            a.payload.len()
        ))
    })
}

/// Decodes a `CTA_TUPLE_ORIG` / `CTA_TUPLE_REPLY` body.
pub fn decode_tuple(buf: &[u8]) -> Result<Tuple, ConntrackError> {
    let (mut src, mut dst, mut proto, mut sport, mut dport) = (None, None, None, None, None);
    for a in attrs(buf) {
        let a = a?;
        match a.ty {
            CTA_TUPLE_IP => {
                for ip in attrs(a.payload) {
                    let ip = ip?;
                    match ip.ty {
                        CTA_IP_V4_SRC => {
                            src = Some(Ipv4Addr::from(exact::<4>(&ip, "v4 src")?).into())
                        }
                        CTA_IP_V4_DST => {
                            dst = Some(Ipv4Addr::from(exact::<4>(&ip, "v4 dst")?).into())
                        }
                        CTA_IP_V6_SRC => {
                            src = Some(Ipv6Addr::from(exact::<16>(&ip, "v6 src")?).into())
                        }
                        CTA_IP_V6_DST => {
                            dst = Some(Ipv6Addr::from(exact::<16>(&ip, "v6 dst")?).into())
                        }
                        _ => {}
                    }
                }
            }
            CTA_TUPLE_PROTO => {
                for p in attrs(a.payload) {
                    let p = p?;
                    match p.ty {
                        CTA_PROTO_NUM => proto = Some(exact::<1>(&p, "protocol number")?[0]),
                        CTA_PROTO_SRC_PORT => {
                            sport = Some(u16::from_be_bytes(exact::<2>(&p, "source port")?));
                        }
                        CTA_PROTO_DST_PORT => {
                            dport = Some(u16::from_be_bytes(exact::<2>(&p, "destination port")?));
                        }
                        _ => {}
                    }
                }
            }
            _ => {}
        }
    }
    match (src, dst, proto) {
        (Some(src), Some(dst), Some(proto)) => Ok(Tuple {
            src,
            dst,
            proto,
            src_port: sport,
            dst_port: dport,
        }),
        _ => Err(ConntrackError::Malformed(
            "tuple without source, destination or protocol".into(),
        )),
    }
}

/// Decodes the top-level attributes of a dumped `IPCTNL_MSG_CT_NEW` message.
pub fn decode_entry(buf: &[u8]) -> Result<Entry, ConntrackError> {
    let (mut orig, mut reply, mut id, mut zone) = (None, None, None, None);
    for a in attrs(buf) {
        let a = a?;
        match a.ty {
            CTA_TUPLE_ORIG => orig = Some(decode_tuple(a.payload)?),
            CTA_TUPLE_REPLY => reply = Some(decode_tuple(a.payload)?),
            CTA_ID => id = Some(u32::from_be_bytes(exact::<4>(&a, "CTA_ID")?)),
            CTA_ZONE => zone = Some(u16::from_be_bytes(exact::<2>(&a, "CTA_ZONE")?)),
            _ => {}
        }
    }
    match (orig, reply) {
        (Some(orig), Some(reply)) => Ok(Entry {
            orig,
            reply,
            id,
            zone,
        }),
        _ => Err(ConntrackError::Malformed(
            "conntrack entry without both tuples".into(),
        )),
    }
}
