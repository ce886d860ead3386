//! Pure ctnetlink (NETLINK_NETFILTER, subsystem CTNETLINK) encode/decode: filtered dump
//! requests, exact-tuple delete requests, reply classification and entry decoding. No IO.
//!
//! Constants are from the kernel UAPI (`linux/netlink.h`, `linux/netfilter/nfnetlink.h`,
//! `linux/netfilter/nfnetlink_conntrack.h`); the `CTA_FILTER_F_*` flag bits are defined in the
//! kernel's `net/netfilter/nf_internals.h` (stable since 5.8, not exported to UAPI headers).
//! Every length in a reply is checked: truncated or malformed input is an error, never a panic.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use netlink::{put_message, AttrIter, AttrWriter, Data, Message, Sequenced};

use super::{ConntrackError, ConntrackFilter, Protocol};

// linux/netlink.h: the shared netlink layer's constants (NLA_F_NESTED is required on
// CTA_FILTER, which the kernel parses with strict `nla_parse_nested`).
pub use netlink::consts::{
    NLA_F_NESTED, NLA_HDRLEN, NLA_TYPE_MASK, NLMSG_DONE, NLMSG_ERROR, NLMSG_HDRLEN, NLM_F_ACK,
    NLM_F_DUMP, NLM_F_REQUEST,
};

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

/// Appends a nested attribute with `NLA_F_NESTED` whose body `f` writes.
fn put_nested(w: &mut AttrWriter<'_>, ty: u16, f: impl FnOnce(&mut AttrWriter<'_>)) {
    w.nested(ty | NLA_F_NESTED, f);
}

/// Appends `nlmsghdr` + `nfgenmsg` and the attributes `attrs` writes.
fn put_msg(
    buf: &mut Vec<u8>,
    op: u16,
    flags: u16,
    seq: u32,
    family: u8,
    attrs: impl FnOnce(&mut AttrWriter<'_>),
) {
    put_message(
        buf,
        msg_type(op),
        flags,
        seq,
        &[family, NFNETLINK_V0, 0, 0],
        attrs,
    );
}

fn put_ip(w: &mut AttrWriter<'_>, v4: u16, v6: u16, ip: &IpAddr) {
    match ip {
        IpAddr::V4(a) => w.bytes(v4, &a.octets()),
        IpAddr::V6(a) => w.bytes(v6, &a.octets()),
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
                        b.bytes(CTA_PROTO_NUM, &[p.number()]);
                    });
                });
                put_nested(b, CTA_FILTER, |b| {
                    b.bytes(CTA_FILTER_ORIG_FLAGS, &CTA_FILTER_F_PROTO_NUM.to_ne_bytes());
                });
            }
            DumpScope::Filter(f) => put_filter(b, family, f),
        },
    );
}

fn put_filter(b: &mut AttrWriter<'_>, family: u8, f: &ConntrackFilter) {
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
            b.bytes(CTA_PROTO_NUM, &[f.proto.number()]);
            if let Some(p) = f.orig_dst_port {
                orig_flags |= CTA_FILTER_F_PROTO_DST_PORT;
                b.bytes(CTA_PROTO_DST_PORT, &p.to_be_bytes());
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
                b.bytes(CTA_PROTO_NUM, &[f.proto.number()]);
                if let Some(p) = f.reply_src_port {
                    reply_flags |= CTA_FILTER_F_PROTO_SRC_PORT;
                    b.bytes(CTA_PROTO_SRC_PORT, &p.to_be_bytes());
                }
            });
        });
    }
    put_nested(b, CTA_FILTER, |b| {
        b.bytes(CTA_FILTER_ORIG_FLAGS, &orig_flags.to_ne_bytes());
        if reply_flags != 0 {
            b.bytes(CTA_FILTER_REPLY_FLAGS, &reply_flags.to_ne_bytes());
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
                    b.bytes(CTA_PROTO_NUM, &[t.proto]);
                    if let Some(p) = t.src_port {
                        b.bytes(CTA_PROTO_SRC_PORT, &p.to_be_bytes());
                    }
                    if let Some(p) = t.dst_port {
                        b.bytes(CTA_PROTO_DST_PORT, &p.to_be_bytes());
                    }
                });
            });
            if let Some(z) = entry.zone {
                b.bytes(CTA_ZONE, &z.to_be_bytes());
            }
            if let Some(id) = entry.id {
                b.bytes(CTA_ID, &id.to_be_bytes());
            }
        },
    );
}

/// A ctnetlink data message (`IPCTNL_MSG_CT_NEW` for dumped entries): its `nfgenmsg` read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CtMessage<'a> {
    /// Sequence number.
    pub seq: u32,
    /// `nlmsg_type`.
    pub ty: u16,
    /// `nfgen_family`.
    pub family: u8,
    /// Top-level attributes after the `nfgenmsg` header.
    pub attrs: &'a [u8],
}

impl Sequenced for CtMessage<'_> {
    fn seq(&self) -> u32 {
        self.seq
    }
}

/// A classified netlink message from the kernel; NOOP, OVERRUN and data messages of other
/// nfnetlink subsystems are [`Message::Other`].
pub type Reply<'a> = Message<CtMessage<'a>>;

/// Reads a data message as ctnetlink: its `nfgenmsg`, or [`Message::Other`] when the message
/// is not ctnetlink's.
pub fn read(data: Data<'_>) -> Result<Reply<'_>, ConntrackError> {
    let Data { header, payload } = data;
    if header.ty >> 8 != NFNL_SUBSYS_CTNETLINK {
        return Ok(Message::Other { header });
    }
    let h = payload
        .get(..NFGENMSG_LEN)
        .ok_or(ConntrackError::Truncated("nfgenmsg header"))?;
    Ok(Message::Data(CtMessage {
        seq: header.seq,
        ty: header.ty,
        family: h[0],
        attrs: &payload[NFGENMSG_LEN..],
    }))
}

/// Iterator over the netlink messages of one datagram; yields one error and stops on
/// truncation.
pub type Messages<'a> = netlink::Messages<'a, CtMessage<'a>, ConntrackError>;

/// Splits a received datagram into classified messages.
pub fn messages(buf: &[u8]) -> Messages<'_> {
    netlink::messages_with(buf, read)
}

/// One attribute: type (flag bits masked off) and payload.
pub use netlink::Attr;

/// Bounds-checked iterator over a run of attributes (the shared one, with this module's
/// error type).
pub type Attrs<'a> = std::iter::Map<
    AttrIter<'a>,
    fn(Result<Attr<'a>, netlink::Error>) -> Result<Attr<'a>, ConntrackError>,
>;

/// Iterates the attributes in `buf`.
pub fn attrs(buf: &[u8]) -> Attrs<'_> {
    AttrIter::new(buf).map(|a| a.map_err(ConntrackError::from))
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
