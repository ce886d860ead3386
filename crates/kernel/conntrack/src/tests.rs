//! Byte-level tests of the ctnetlink codec (expected bytes written out from the UAPI layout:
//! `nlmsghdr`, `nfgenmsg`, nested `nlattr`s) and of filter matching.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use super::codec::*;
use super::{ConntrackError, ConntrackFilter, Protocol};

fn v4(a: u8, b: u8, c: u8, d: u8) -> IpAddr {
    IpAddr::V4(Ipv4Addr::new(a, b, c, d))
}

/// Little-endian helpers for writing expected bytes by hand (the tests run on x86_64; the
/// kernel uses host order for lengths, types and flag words).
fn le16(v: u16) -> [u8; 2] {
    v.to_le_bytes()
}
fn le32(v: u32) -> [u8; 4] {
    v.to_le_bytes()
}

fn cat(parts: &[&[u8]]) -> Vec<u8> {
    parts.iter().flat_map(|p| p.iter().copied()).collect()
}

/// An attribute header: len, type.
fn nla(len: u16, ty: u16) -> Vec<u8> {
    cat(&[&le16(len), &le16(ty)])
}

fn entry_v4() -> Entry {
    Entry {
        orig: Tuple {
            src: v4(10, 0, 0, 1),
            dst: v4(10, 96, 0, 10),
            proto: 17,
            src_port: Some(5353),
            dst_port: Some(53),
        },
        reply: Tuple {
            src: v4(10, 244, 1, 5),
            dst: v4(10, 0, 0, 1),
            proto: 17,
            src_port: Some(53),
            dst_port: Some(5353),
        },
        id: Some(0x1122_3344),
        zone: None,
    }
}

#[cfg(target_endian = "little")]
#[test]
fn delete_request_bytes_follow_the_uapi_layout() {
    let mut buf = Vec::new();
    put_delete(&mut buf, 7, &entry_v4());
    let expected = cat(&[
        // nlmsghdr: len 80, type (NFNL_SUBSYS_CTNETLINK << 8) | IPCTNL_MSG_CT_DELETE,
        // flags NLM_F_REQUEST | NLM_F_ACK, seq 7, pid 0
        &le32(80),
        &le16(0x0102),
        &le16(0x0005),
        &le32(7),
        &le32(0),
        // nfgenmsg: AF_INET, NFNETLINK_V0, res_id 0
        &[2, 0, 0, 0],
        // CTA_TUPLE_ORIG | NLA_F_NESTED, 52 bytes
        &nla(52, 0x8001),
        // CTA_TUPLE_IP | NESTED, 20 bytes: V4_SRC, V4_DST (network order)
        &nla(20, 0x8001),
        &nla(8, 1),
        &[10, 0, 0, 1],
        &nla(8, 2),
        &[10, 96, 0, 10],
        // CTA_TUPLE_PROTO | NESTED, 28 bytes: NUM (u8 + 3 pad), SRC_PORT, DST_PORT (be16 + pad)
        &nla(28, 0x8002),
        &nla(5, 1),
        &[17, 0, 0, 0],
        &nla(6, 2),
        &[0x14, 0xe9, 0, 0],
        &nla(6, 3),
        &[0, 53, 0, 0],
        // CTA_ID, be32 as dumped
        &nla(8, 12),
        &[0x11, 0x22, 0x33, 0x44],
    ]);
    assert_eq!(buf, expected);
}

#[cfg(target_endian = "little")]
#[test]
fn delete_request_carries_the_zone_when_the_entry_has_one() {
    let mut e = entry_v4();
    e.zone = Some(0x0102);
    e.id = None;
    let mut buf = Vec::new();
    put_delete(&mut buf, 1, &e);
    // 16 + 4 + 52 + CTA_ZONE (4 + 2 + 2 pad)
    assert_eq!(&buf[..4], &le32(80));
    assert_eq!(&buf[72..], &cat(&[&nla(6, 18), &[1, 2, 0, 0]])[..]);
}

#[cfg(target_endian = "little")]
#[test]
fn filtered_dump_request_v4_puts_addresses_ports_and_flags() {
    let f =
        ConntrackFilter::endpoint_removed(Protocol::Udp, v4(10, 96, 0, 10), 53, v4(10, 244, 1, 5));
    let mut buf = Vec::new();
    put_dump(&mut buf, 9, AF_INET, DumpScope::Filter(&f));
    let expected = cat(&[
        // GET | DUMP (REQUEST | ROOT | MATCH = 0x301)
        &le32(104),
        &le16(0x0101),
        &le16(0x0301),
        &le32(9),
        &le32(0),
        &[2, 0, 0, 0],
        // CTA_TUPLE_ORIG: IP{V4_DST}, PROTO{NUM, DST_PORT}
        &nla(36, 0x8001),
        &nla(12, 0x8001),
        &nla(8, 2),
        &[10, 96, 0, 10],
        &nla(20, 0x8002),
        &nla(5, 1),
        &[17, 0, 0, 0],
        &nla(6, 3),
        &[0, 53, 0, 0],
        // CTA_TUPLE_REPLY: IP{V4_SRC}, PROTO{NUM}
        &nla(28, 0x8002),
        &nla(12, 0x8001),
        &nla(8, 1),
        &[10, 244, 1, 5],
        &nla(12, 0x8002),
        &nla(5, 1),
        &[17, 0, 0, 0],
        // CTA_FILTER | NESTED: ORIG_FLAGS = IP_DST | PROTO_NUM | PROTO_DST_PORT (0x2a),
        // REPLY_FLAGS = IP_SRC | PROTO_NUM (0x09)
        &nla(20, 0x8000 | 25),
        &nla(8, 1),
        &le32(0x2a),
        &nla(8, 2),
        &le32(0x09),
    ]);
    assert_eq!(buf, expected);
}

#[cfg(target_endian = "little")]
#[test]
fn filtered_dump_request_v6_leaves_addresses_to_user_space() {
    let vip: IpAddr = "fd00::10".parse().unwrap();
    let ep: IpAddr = "fd00:1::5".parse().unwrap();
    let mut f = ConntrackFilter::endpoint_removed(Protocol::Udp, vip, 53, ep);
    f.reply_src_port = Some(5353);
    let mut buf = Vec::new();
    put_dump(&mut buf, 1, AF_INET6, DumpScope::Filter(&f));
    let expected = cat(&[
        &le32(88),
        &le16(0x0101),
        &le16(0x0301),
        &le32(1),
        &le32(0),
        &[10, 0, 0, 0],
        &nla(24, 0x8001),
        &nla(20, 0x8002),
        &nla(5, 1),
        &[17, 0, 0, 0],
        &nla(6, 3),
        &[0, 53, 0, 0],
        &nla(24, 0x8002),
        &nla(20, 0x8002),
        &nla(5, 1),
        &[17, 0, 0, 0],
        &nla(6, 2),
        &[0x14, 0xe9, 0, 0],
        // ORIG: PROTO_NUM | DST_PORT (0x28); REPLY: PROTO_NUM | SRC_PORT (0x18)
        &nla(20, 0x8000 | 25),
        &nla(8, 1),
        &le32(0x28),
        &nla(8, 2),
        &le32(0x18),
    ]);
    assert_eq!(buf, expected);
    assert!(!buf.windows(16).any(|w| w
        == match vip {
            IpAddr::V6(a) => a.octets(),
            IpAddr::V4(_) => unreachable!(),
        }));
}

#[cfg(target_endian = "little")]
#[test]
fn protocol_and_family_dump_requests() {
    let mut buf = Vec::new();
    put_dump(&mut buf, 3, AF_INET, DumpScope::Protocol(Protocol::Udp));
    let expected = cat(&[
        &le32(48),
        &le16(0x0101),
        &le16(0x0301),
        &le32(3),
        &le32(0),
        &[2, 0, 0, 0],
        &nla(16, 0x8001),
        &nla(12, 0x8002),
        &nla(5, 1),
        &[17, 0, 0, 0],
        &nla(12, 0x8000 | 25),
        &nla(8, 1),
        &le32(0x08),
    ]);
    assert_eq!(buf, expected);

    let mut buf = Vec::new();
    put_dump(&mut buf, 4, AF_INET6, DumpScope::Family);
    assert_eq!(
        buf,
        cat(&[
            &le32(20),
            &le16(0x0101),
            &le16(0x0301),
            &le32(4),
            &le32(0),
            &[10, 0, 0, 0]
        ])
    );
}

#[test]
fn requests_share_one_buffer_back_to_back() {
    let mut buf = Vec::new();
    put_delete(&mut buf, 1, &entry_v4());
    let one = buf.len();
    put_delete(&mut buf, 2, &entry_v4());
    assert_eq!(buf.len(), 2 * one);
    // The request parser used for replies splits them again (type is a ctnetlink message).
    let seqs: Vec<u32> = messages(&buf).map(|m| m.unwrap().seq()).collect();
    assert_eq!(seqs, vec![1, 2]);
}

/// A kernel-style `IPCTNL_MSG_CT_NEW` dump message for an entry, built independently of the
/// request encoder: tuples as the kernel writes them (nested flag bit clear, extra attributes
/// the decoder must skip).
fn kernel_entry_msg(seq: u32, e: &Entry, extra: bool) -> Vec<u8> {
    fn ipattrs(t: &Tuple) -> Vec<u8> {
        match (t.src, t.dst) {
            (IpAddr::V4(s), IpAddr::V4(d)) => {
                cat(&[&nla(8, 1), &s.octets(), &nla(8, 2), &d.octets()])
            }
            (IpAddr::V6(s), IpAddr::V6(d)) => {
                cat(&[&nla(20, 3), &s.octets(), &nla(20, 4), &d.octets()])
            }
            _ => unreachable!(),
        }
    }
    fn tuple(ty: u16, t: &Tuple) -> Vec<u8> {
        let ip = ipattrs(t);
        let mut proto = cat(&[&nla(5, 1), &[t.proto, 0, 0, 0]]);
        if let Some(p) = t.src_port {
            proto.extend(cat(&[&nla(6, 2), &p.to_be_bytes(), &[0, 0]]));
        }
        if let Some(p) = t.dst_port {
            proto.extend(cat(&[&nla(6, 3), &p.to_be_bytes(), &[0, 0]]));
        }
        let ipn = cat(&[&nla(4 + ip.len() as u16, 1), &ip]);
        let pn = cat(&[&nla(4 + proto.len() as u16, 2), &proto]);
        cat(&[&nla(4 + (ipn.len() + pn.len()) as u16, ty), &ipn, &pn])
    }
    let mut body = cat(&[&tuple(1, &e.orig), &tuple(2, &e.reply)]);
    if extra {
        // CTA_STATUS, CTA_TIMEOUT, CTA_MARK, CTA_USE, and an unknown nested attribute
        body.extend(cat(&[&nla(8, 3), &[0, 0, 0, 0x8e]]));
        body.extend(cat(&[&nla(8, 7), &[0, 0, 0, 30]]));
        body.extend(cat(&[&nla(8, 8), &[0, 0, 0, 0]]));
        body.extend(cat(&[&nla(8, 11), &[0, 0, 0, 1]]));
        body.extend(cat(&[&nla(12, 0x8000 | 60), &nla(8, 1), &[1, 2, 3, 4]]));
    }
    if let Some(id) = e.id {
        body.extend(cat(&[&nla(8, 12), &id.to_be_bytes()]));
    }
    if let Some(z) = e.zone {
        body.extend(cat(&[&nla(6, 18), &z.to_be_bytes(), &[0, 0]]));
    }
    let fam = family_of(&e.orig.src);
    let len = 16 + 4 + body.len();
    cat(&[
        &(len as u32).to_ne_bytes(),
        &0x0100u16.to_ne_bytes(),
        &0x0002u16.to_ne_bytes(), // NLM_F_MULTI
        &seq.to_ne_bytes(),
        &1234u32.to_ne_bytes(),
        &[fam, 0, 0, 0],
        &body,
    ])
}

fn done(seq: u32) -> Vec<u8> {
    cat(&[
        &20u32.to_ne_bytes(),
        &3u16.to_ne_bytes(),
        &2u16.to_ne_bytes(),
        &seq.to_ne_bytes(),
        &0u32.to_ne_bytes(),
        &0i32.to_ne_bytes(),
    ])
}

fn nlerr(seq: u32, code: i32) -> Vec<u8> {
    // error code + the echoed request header (capped)
    cat(&[
        &36u32.to_ne_bytes(),
        &2u16.to_ne_bytes(),
        &0x100u16.to_ne_bytes(),
        &seq.to_ne_bytes(),
        &0u32.to_ne_bytes(),
        &code.to_ne_bytes(),
        &80u32.to_ne_bytes(),
        &0x0102u16.to_ne_bytes(),
        &5u16.to_ne_bytes(),
        &seq.to_ne_bytes(),
        &0u32.to_ne_bytes(),
    ])
}

#[test]
fn decodes_dumped_entries_v4_and_v6_and_skips_unknown_attributes() {
    let mut e6 = entry_v4();
    e6.orig.src = "fd00::1".parse().unwrap();
    e6.orig.dst = "fd00:96::a".parse().unwrap();
    e6.reply.src = "fd00:244::5".parse().unwrap();
    e6.reply.dst = "fd00::1".parse().unwrap();
    e6.zone = Some(7);
    let dgram = cat(&[
        &kernel_entry_msg(5, &entry_v4(), true),
        &kernel_entry_msg(5, &e6, false),
        &done(5),
    ]);
    let msgs: Vec<Reply<'_>> = messages(&dgram).map(|m| m.unwrap()).collect();
    assert_eq!(msgs.len(), 3);
    let Reply::Data(CtMessage {
        seq: 5,
        ty: 0x0100,
        family: 2,
        attrs,
    }) = msgs[0]
    else {
        panic!("{:?}", msgs[0])
    };
    assert_eq!(decode_entry(attrs).unwrap(), entry_v4());
    let Reply::Data(CtMessage {
        family: 10, attrs, ..
    }) = msgs[1]
    else {
        panic!("{:?}", msgs[1])
    };
    assert_eq!(decode_entry(attrs).unwrap(), e6);
    assert_eq!(msgs[2], Reply::Done { seq: 5, errno: 0 });
}

#[test]
fn classifies_acks_errors_and_done_with_error() {
    let dgram = cat(&[&nlerr(10, 0), &nlerr(11, -2), &nlerr(12, -1)]);
    let msgs: Vec<Reply<'_>> = messages(&dgram).map(|m| m.unwrap()).collect();
    assert_eq!(
        msgs,
        vec![
            Reply::Ack { seq: 10 },
            Reply::Error { seq: 11, errno: 2 },
            Reply::Error { seq: 12, errno: 1 }
        ]
    );
    let mut d = done(3);
    d[16..20].copy_from_slice(&(-95i32).to_ne_bytes());
    assert_eq!(
        messages(&d).next().unwrap().unwrap(),
        Reply::Done { seq: 3, errno: 95 }
    );
}

#[test]
fn every_truncation_of_a_reply_is_an_error_not_a_panic() {
    let dgram = cat(&[&kernel_entry_msg(1, &entry_v4(), true), &done(1)]);
    let first_len = dgram.len() - 20;
    for cut in 1..dgram.len() {
        let part = &dgram[..cut];
        let res: Vec<_> = messages(part).collect();
        if cut < first_len {
            // The first message is cut: the iterator reports exactly one error.
            assert_eq!(res.len(), 1, "cut {cut}");
            assert!(res[0].is_err(), "cut {cut}");
        } else {
            assert!(res[0].is_ok(), "cut {cut}");
        }
    }
    // Truncating inside the attributes is also an error (no id: the reply tuple is last, so
    // every cut loses part of a tuple).
    let mut e = entry_v4();
    e.id = None;
    let msg = kernel_entry_msg(1, &e, false);
    assert_eq!(decode_entry(&msg[20..]).unwrap(), e);
    for cut in 20..msg.len() {
        let body = &msg[20..cut];
        if let Ok(e) = decode_entry(body) {
            panic!("cut {cut} decoded {e:?}");
        }
    }
}

#[test]
fn malformed_attributes_are_errors() {
    // Attribute length below the header size.
    assert!(matches!(
        attrs(&[2, 0, 1, 0]).next(),
        Some(Err(ConntrackError::Malformed(_)))
    ));
    // An IPv4 address of 3 bytes.
    let bad = cat(&[
        &nla(4 + 4 + 7, 1),
        &nla(4 + 7, 1),
        &nla(7, 1),
        &[1, 2, 3, 0],
    ]);
    assert!(decode_tuple(&bad[4..]).is_err());
    // A tuple without a protocol.
    let noproto = cat(&[
        &nla(20, 1),
        &nla(8, 1),
        &[1, 2, 3, 4],
        &nla(8, 2),
        &[5, 6, 7, 8],
    ]);
    assert!(matches!(
        decode_tuple(&noproto),
        Err(ConntrackError::Malformed(_))
    ));
    // An entry without a reply tuple.
    let e = kernel_entry_msg(1, &entry_v4(), false);
    let orig_len = usize::from(u16::from_ne_bytes([e[20], e[21]]));
    assert!(decode_entry(&e[20..20 + orig_len]).is_err());
    // A message length below the header size.
    let mut m = done(1);
    m[..4].copy_from_slice(&8u32.to_ne_bytes());
    assert!(messages(&m).next().unwrap().is_err());
}

#[test]
fn mutated_replies_never_panic() {
    let base = cat(&[&kernel_entry_msg(1, &entry_v4(), true), &done(1)]);
    // Deterministic xorshift so a failure is reproducible.
    let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
    for _ in 0..20_000 {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        let mut m = base.clone();
        let i = (x as usize) % m.len();
        m[i] = (x >> 32) as u8;
        if x & 1 == 0 {
            let j = ((x >> 8) as usize) % m.len();
            m[j] = (x >> 40) as u8;
        }
        for r in messages(&m) {
            if let Ok(Reply::Data(CtMessage { attrs, .. })) = r {
                let _ = decode_entry(attrs);
            }
        }
    }
}

#[test]
fn filter_matching_semantics() {
    let e = entry_v4();
    let vip = v4(10, 96, 0, 10);
    let ep = v4(10, 244, 1, 5);
    assert!(ConntrackFilter::endpoint_removed(Protocol::Udp, vip, 53, ep).matches(&e));
    // Other endpoint, other port, other protocol, other VIP: no.
    assert!(
        !ConntrackFilter::endpoint_removed(Protocol::Udp, vip, 53, v4(10, 244, 1, 6)).matches(&e)
    );
    assert!(!ConntrackFilter::endpoint_removed(Protocol::Udp, vip, 54, ep).matches(&e));
    assert!(!ConntrackFilter::endpoint_removed(Protocol::Tcp, vip, 53, ep).matches(&e));
    assert!(
        !ConntrackFilter::endpoint_removed(Protocol::Udp, v4(10, 96, 0, 11), 53, ep).matches(&e)
    );
    // Reply port must match when given.
    let mut f = ConntrackFilter::endpoint_removed(Protocol::Udp, vip, 53, ep);
    f.reply_src_port = Some(53);
    assert!(f.matches(&e));
    f.reply_src_port = Some(5353);
    assert!(!f.matches(&e));
    // A DNATed entry does not "point nowhere"; an un-NATed one does.
    let un = ConntrackFilter::unanswered(Protocol::Udp, vip, 53);
    assert!(!un.matches(&e));
    let mut nowhere = e;
    nowhere.reply.src = vip;
    assert!(un.matches(&nowhere));
    // Port-less filter: any destination port.
    let mut any = un;
    any.orig_dst_port = None;
    nowhere.orig.dst_port = Some(9999);
    assert!(any.matches(&nowhere));
}

#[test]
fn mixed_family_filters_are_rejected() {
    let f = ConntrackFilter::endpoint_removed(
        Protocol::Udp,
        v4(10, 96, 0, 10),
        53,
        IpAddr::V6(Ipv6Addr::LOCALHOST),
    );
    assert!(matches!(
        f.validate(),
        Err(ConntrackError::InvalidFilter(_))
    ));
    assert!(
        ConntrackFilter::unanswered(Protocol::Udp, v4(1, 2, 3, 4), 1)
            .validate()
            .is_ok()
    );
}

#[test]
fn a_socket_timeout_stays_a_timeout() {
    let after = std::time::Duration::from_secs(10);
    let e = ConntrackError::from(netlink::Error::Timeout {
        what: "recv",
        after,
    });
    assert!(
        matches!(e, ConntrackError::Timeout { what: "recv", after: a } if a == after),
        "{e:?}"
    );
    assert!(
        e.to_string()
            .contains("no answer from the kernel within 10s"),
        "{e}"
    );
}
