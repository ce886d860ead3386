//! The codec against requests ipset(8) 7.17 sent to a 6.18 kernel (captured with
//! `strace -e trace=sendto -xx ipset [-exist] add|del SET MEMBER` in a fresh namespace, the
//! `IPSET_ATTR_DATA` payloads pasted below as strace printed them), and reply parsing on
//! truncated and garbage input.

use super::*;
use ::netlink::consts::{NLMSG_ERROR, NLMSG_HDRLEN};

/// Bytes from strace's `\x0c\x00...` notation.
fn unx(s: &str) -> Vec<u8> {
    s.split("\\x")
        .filter(|p| !p.is_empty())
        .map(|p| u8::from_str_radix(p, 16).unwrap())
        .collect()
}

fn entry(ty: crate::SetType, s: &str) -> Entry {
    Entry::parse(ty, s).unwrap()
}

/// The whole request ipset(8) sent: `nlmsg_len`, then after the netlink header nfgenmsg,
/// PROTOCOL 7, SETNAME, and DATA with the captured payload.
fn captured(set: &str, data: &str) -> Vec<u8> {
    let data = unx(data);
    let mut p = vec![2, 0, 0, 0]; // nfgenmsg: AF_INET, NFNETLINK_V0, res_id 0
    p.extend([5, 0, 1, 0, 7, 0, 0, 0]); // IPSET_ATTR_PROTOCOL = 7
    let name_len = 4 + set.len() + 1;
    p.extend((name_len as u16).to_ne_bytes());
    p.extend(2u16.to_ne_bytes());
    p.extend(set.as_bytes());
    p.push(0);
    while p.len() % 4 != 0 {
        p.push(0);
    }
    p.extend(((4 + data.len()) as u16).to_ne_bytes());
    p.extend(0x8007u16.to_ne_bytes()); // NLA_F_NESTED | IPSET_ATTR_DATA
    p.extend(data);
    p
}

use crate::SetType::*;

/// (set, type, member, nlmsg_len strace showed, DATA payload strace showed).
const CAPTURES: &[(&str, crate::SetType, &str, usize, &str)] = &[
    (
        "T1",
        HashIpPort,
        "10.96.0.1,tcp:80",
        76,
        r"\x0c\x00\x01\x80\x08\x00\x01\x40\x0a\x60\x00\x01\x06\x00\x04\x40\x00\x50\x00\x00\x05\x00\x07\x00\x06\x00\x00\x00\x08\x00\x09\x40\x00\x00\x00\x00",
    ),
    (
        "T1",
        HashIpPort,
        "10.96.0.1,udp:53",
        76,
        r"\x0c\x00\x01\x80\x08\x00\x01\x40\x0a\x60\x00\x01\x06\x00\x04\x40\x00\x35\x00\x00\x05\x00\x07\x00\x11\x00\x00\x00\x08\x00\x09\x40\x00\x00\x00\x00",
    ),
    (
        "T1",
        HashIpPort,
        "10.96.0.2,sctp:9",
        76,
        r"\x0c\x00\x01\x80\x08\x00\x01\x40\x0a\x60\x00\x02\x06\x00\x04\x40\x00\x09\x00\x00\x05\x00\x07\x00\x84\x00\x00\x00\x08\x00\x09\x40\x00\x00\x00\x00",
    ),
    (
        "I4",
        HashIp,
        "10.0.0.1",
        60,
        r"\x0c\x00\x01\x80\x08\x00\x01\x40\x0a\x00\x00\x01\x08\x00\x09\x40\x00\x00\x00\x00",
    ),
    (
        "I6",
        HashIp,
        "fd00::1",
        72,
        r"\x18\x00\x01\x80\x14\x00\x02\x40\xfd\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x01\x08\x00\x09\x40\x00\x00\x00\x00",
    ),
    (
        "P6",
        HashIpPort,
        "fd00::2,tcp:443",
        88,
        r"\x18\x00\x01\x80\x14\x00\x02\x40\xfd\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x02\x06\x00\x04\x40\x01\xbb\x00\x00\x05\x00\x07\x00\x06\x00\x00\x00\x08\x00\x09\x40\x00\x00\x00\x00",
    ),
    (
        "PI4",
        HashIpPortIp,
        "10.244.1.5,tcp:8080,10.244.1.5",
        88,
        r"\x0c\x00\x01\x80\x08\x00\x01\x40\x0a\xf4\x01\x05\x06\x00\x04\x40\x1f\x90\x00\x00\x05\x00\x07\x00\x06\x00\x00\x00\x0c\x00\x14\x80\x08\x00\x01\x40\x0a\xf4\x01\x05\x08\x00\x09\x40\x00\x00\x00\x00",
    ),
    (
        "PI6",
        HashIpPortIp,
        "fd00::5,udp:53,fd00::6",
        112,
        r"\x18\x00\x01\x80\x14\x00\x02\x40\xfd\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x05\x06\x00\x04\x40\x00\x35\x00\x00\x05\x00\x07\x00\x11\x00\x00\x00\x18\x00\x14\x80\x14\x00\x02\x40\xfd\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x06\x08\x00\x09\x40\x00\x00\x00\x00",
    ),
    (
        "PN4",
        HashIpPortNet,
        "1.2.3.4,tcp:80,10.0.0.0/8",
        96,
        r"\x0c\x00\x01\x80\x08\x00\x01\x40\x01\x02\x03\x04\x06\x00\x04\x40\x00\x50\x00\x00\x05\x00\x07\x00\x06\x00\x00\x00\x0c\x00\x14\x80\x08\x00\x01\x40\x0a\x00\x00\x00\x05\x00\x15\x00\x08\x00\x00\x00\x08\x00\x09\x40\x00\x00\x00\x00",
    ),
    (
        "PN4",
        HashIpPortNet,
        "1.2.3.4,tcp:80,10.1.2.3",
        88,
        r"\x0c\x00\x01\x80\x08\x00\x01\x40\x01\x02\x03\x04\x06\x00\x04\x40\x00\x50\x00\x00\x05\x00\x07\x00\x06\x00\x00\x00\x0c\x00\x14\x80\x08\x00\x01\x40\x0a\x01\x02\x03\x08\x00\x09\x40\x00\x00\x00\x00",
    ),
    (
        "T6",
        HashIpPortNet,
        "fd00::9,tcp:80,fd00:1::/64",
        120,
        r"\x18\x00\x01\x80\x14\x00\x02\x40\xfd\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x09\x06\x00\x04\x40\x00\x50\x00\x00\x05\x00\x07\x00\x06\x00\x00\x00\x18\x00\x14\x80\x14\x00\x02\x40\xfd\x00\x00\x01\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x05\x00\x15\x00\x40\x00\x00\x00\x08\x00\x09\x40\x00\x00\x00\x00",
    ),
    (
        "B1",
        BitmapPort,
        "30080",
        56,
        r"\x06\x00\x04\x40\x75\x80\x00\x00\x08\x00\x09\x40\x00\x00\x00\x00",
    ),
];

#[test]
fn add_and_del_match_ipset_byte_for_byte() {
    for &(set, ty, member, len, data) in CAPTURES {
        for (adt, cmd) in [(Adt::Add, 9u16), (Adt::Del, 10u16)] {
            let mut buf = Vec::new();
            put_adt(&mut buf, adt, 0x1234_5678, 7, set, &entry(ty, member)).unwrap();
            assert_eq!(buf.len(), len, "{set} {member}: nlmsg_len");
            assert_eq!(&buf[..4], &(len as u32).to_ne_bytes(), "{set} {member}");
            // nlmsg_type NFNL_SUBSYS_IPSET << 8 | cmd, flags REQUEST|ACK (as `-exist` sends)
            assert_eq!(&buf[4..6], &(0x600 | cmd).to_ne_bytes(), "{set} {member}");
            assert_eq!(&buf[6..8], &0x5u16.to_ne_bytes(), "{set} {member}: flags");
            assert_eq!(&buf[8..12], &0x1234_5678u32.to_ne_bytes());
            assert_eq!(&buf[12..16], &[0, 0, 0, 0], "pid");
            assert_eq!(
                buf[NLMSG_HDRLEN..],
                captured(set, data)[..],
                "{set} {member}"
            );
        }
    }
}

#[test]
fn kube_set_names_fit_and_bad_requests_append_nothing() {
    let e = entry(HashIp, "10.0.0.1");
    let mut buf = Vec::new();
    put_adt(
        &mut buf,
        Adt::Add,
        1,
        7,
        "KUBE-6-LOAD-BALANCER-SOURCE-CID",
        &e,
    )
    .unwrap();
    assert_eq!(buf.len() % 4, 0);
    let mut buf = Vec::new();
    assert!(put_adt(&mut buf, Adt::Add, 1, 7, "", &e).is_err());
    assert!(put_adt(&mut buf, Adt::Add, 1, 7, &"X".repeat(32), &e).is_err());
    assert!(put_adt(&mut buf, Adt::Add, 1, 7, "A\0B", &e).is_err());
    let mixed = Entry::ip_port_ip(
        "10.0.0.1".parse().unwrap(),
        Protocol::Tcp,
        1,
        "fd00::1".parse().unwrap(),
    );
    assert!(put_adt(&mut buf, Adt::Del, 1, 7, "S", &mixed).is_err());
    assert!(buf.is_empty());
}

#[test]
fn protocol_probe_matches_ipset_and_reply_is_read() {
    // ipset(8): sendto [{nlmsg_len=28, NFNL_SUBSYS_IPSET<<8|IPSET_CMD_PROTOCOL, NLM_F_REQUEST},
    // {AF_INET, NFNETLINK_V0, 0}, [{nla_len=5, nla_type=0x1}, "\x07"]]
    let mut buf = Vec::new();
    put_protocol(&mut buf, 42);
    let mut want = Vec::new();
    want.extend(28u32.to_ne_bytes());
    want.extend(0x601u16.to_ne_bytes());
    want.extend(1u16.to_ne_bytes());
    want.extend(42u32.to_ne_bytes());
    want.extend(0u32.to_ne_bytes());
    want.extend([2, 0, 0, 0, 5, 0, 1, 0, 7, 0, 0, 0]);
    assert_eq!(buf, want);
    // The 6.18 kernel's reply: PROTOCOL 7, PROTOCOL_MIN 6 (nlmsg_len 36, pid 9170).
    let mut reply = Vec::new();
    reply.extend(36u32.to_ne_bytes());
    reply.extend(0x601u16.to_ne_bytes());
    reply.extend(0u16.to_ne_bytes());
    reply.extend(42u32.to_ne_bytes());
    reply.extend(9170u32.to_ne_bytes());
    reply.extend([2, 0, 0, 0, 5, 0, 1, 0, 7, 0, 0, 0, 5, 0, 10, 0, 6, 0, 0, 0]);
    assert_eq!(protocol_answer(&reply, 42).unwrap(), Some(Ok((7, 6))));
    assert_eq!(protocol_answer(&reply, 43).unwrap(), None);
    assert_eq!(negotiate((7, 6)), Some(7));
    assert_eq!(negotiate((6, 6)), Some(6));
    assert_eq!(negotiate((8, 7)), Some(7));
    assert_eq!(negotiate((9, 8)), None);
    assert_eq!(negotiate((5, 5)), None);
    // Every truncation into the reply (the last attribute's padding aside) is an error or "no
    // answer", never a panic or a version.
    for n in 0..reply.len() - 3 {
        let mut t = reply[..n].to_vec();
        if n >= 4 {
            t[..4].copy_from_slice(&(n as u32).to_ne_bytes());
        }
        let r = protocol_answer(&t, 42);
        assert!(
            !matches!(r, Ok(Some(Ok((7, 6))))),
            "truncated to {n}: {r:?}"
        );
    }
}

/// An NLMSG_ERROR answering request `seq` with `-errno`, echoing a 16-byte header.
fn error_msg(seq: u32, errno: i32) -> Vec<u8> {
    let mut m = Vec::new();
    m.extend(36u32.to_ne_bytes());
    m.extend(NLMSG_ERROR.to_ne_bytes());
    m.extend(0x100u16.to_ne_bytes()); // NLM_F_CAPPED
    m.extend(seq.to_ne_bytes());
    m.extend(1u32.to_ne_bytes());
    m.extend((-errno).to_ne_bytes());
    m.extend(76u32.to_ne_bytes());
    m.extend(0x609u16.to_ne_bytes());
    m.extend(0x5u16.to_ne_bytes());
    m.extend(seq.to_ne_bytes());
    m.extend(0u32.to_ne_bytes());
    m
}

#[test]
fn answers_of_a_window_keep_exist_semantics() {
    let mut d = error_msg(10, 0);
    d.extend(error_msg(11, IPSET_ERR_EXIST));
    d.extend(error_msg(12, IPSET_ERR_PROTOCOL));
    d.extend(error_msg(13, ENOENT));
    let mut p = ::netlink::Pending::new(10, 4);
    let mut got = Vec::new();
    p.take(&d, |i, r| got.push((i, answer_ok(r), r))).unwrap();
    assert_eq!(
        got,
        vec![
            (0, true, Ok(())),
            (1, true, Err(IPSET_ERR_EXIST)),
            (2, false, Err(IPSET_ERR_PROTOCOL)),
            (3, false, Err(ENOENT)),
        ]
    );
    assert!(error_message(Adt::Add, ENOENT).contains("does not exist"));
    assert!(error_message(Adt::Del, IPSET_ERR_EXIST).contains("not added"));
    assert!(error_message(Adt::Add, 4999).contains("4999"));
    assert!(error_message(Adt::Add, 12).contains("Kernel error"));
    // Truncated and garbage datagrams: errors or nothing, never a panic.
    for n in 0..d.len() {
        let mut p = ::netlink::Pending::new(10, 4);
        let _ = p.take(&d[..n], |_, _| {});
        let _ = protocol_answer(&d[..n], 10);
    }
    let mut x: u32 = 0x9e37_79b9;
    for _ in 0..2000 {
        let len = (x % 97) as usize;
        let g: Vec<u8> = (0..len)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 17;
                x ^= x << 5;
                x as u8
            })
            .collect();
        let mut p = ::netlink::Pending::new(10, 4);
        let _ = p.take(&g, |_, _| {});
        let _ = protocol_answer(&g, 10);
        let _ = parse_protocol_reply(&g);
    }
}

/// The LIST request: what `strace -xx ipset list KUBE-CLUSTER-IP` showed ipset(8) 7.17 send
/// (`nlmsg_len=48`, `NLM_F_REQUEST|NLM_F_ACK|0x300`, PROTOCOL 7, SETNAME).
#[test]
fn list_request_matches_ipset() {
    let mut buf = Vec::new();
    put_list(&mut buf, 9, 7, "KUBE-CLUSTER-IP").unwrap();
    assert_eq!(buf.len(), 48);
    assert_eq!(u16::from_ne_bytes([buf[4], buf[5]]), (6 << 8) | 7);
    assert_eq!(u16::from_ne_bytes([buf[6], buf[7]]), 0x1 | 0x4 | 0x300);
    let mut want = vec![2, 0, 0, 0, 5, 0, 1, 0, 7, 0, 0, 0, 20, 0, 2, 0];
    want.extend(b"KUBE-CLUSTER-IP\0");
    assert_eq!(&buf[NLMSG_HDRLEN..], &want[..]);
    assert!(put_list(&mut buf, 10, 7, "").is_err());
    assert!(put_list(&mut buf, 10, 7, &"X".repeat(32)).is_err());
}

/// The kernel replies of `list-replies.txt`, by set: the datagrams under each `= SET` line.
fn captured_listings() -> Vec<(String, Vec<Vec<u8>>)> {
    let mut out: Vec<(String, Vec<Vec<u8>>)> = Vec::new();
    for line in include_str!("list-replies.txt").lines() {
        if let Some(name) = line.strip_prefix("= ") {
            out.push((name.to_string(), Vec::new()));
        } else if !line.starts_with('#') && !line.is_empty() {
            let bytes = (0..line.len())
                .step_by(2)
                .map(|i| u8::from_str_radix(&line[i..i + 2], 16).unwrap())
                .collect();
            out.last_mut().unwrap().1.push(bytes);
        }
    }
    out
}

/// A listing replayed from captured datagrams: the set (or `Err(errno)` when the kernel
/// refused), as the IO path reads it (`replies` of the request's sequence number).
fn replay(name: &str, datagrams: &[Vec<u8>]) -> Result<Option<crate::SetState>, i32> {
    let mut listing = Listing::new(name);
    for d in datagrams {
        let seq = ::netlink::messages(d).next().unwrap().unwrap().seq();
        let end =
            ::netlink::replies::<Error>(d, seq, &mut |m| listing.take(m.header.ty, m.payload))
                .unwrap();
        match end.map(|e| e.errno()) {
            None => continue,
            Some(None) => return Ok(listing.finish()),
            Some(Some(errno)) => return Err(errno),
        }
    }
    panic!("{name}: the replies did not end");
}

fn members(set: &crate::SetState) -> Vec<String> {
    set.entries.keys().map(ToString::to_string).collect()
}

/// Every captured set reads back as `ipset save` printed it in the same namespace: type,
/// family, hashsize/maxelem, members of every kube-proxy set type (IPv4 and IPv6, a network
/// and a host in `hash:ip,port,net`, a bitmap port), an empty set, a set whose members span
/// two datagrams, a set of a type this crate does not model, and a missing set (ENOENT).
#[test]
fn list_replies_read_back_as_ipset_save_printed_them() {
    use crate::Family::{Inet, Inet6};
    let want: &[(&str, crate::SetType, crate::Family, &[&str])] = &[
        (
            "KUBE-LOOP-BACK",
            HashIpPortIp,
            Inet,
            &["10.244.1.5,tcp:8080,10.244.1.5"],
        ),
        (
            "KUBE-LOAD-BALANCER-SOURCE-CIDR",
            HashIpPortNet,
            Inet,
            &["1.2.3.4,tcp:80,10.0.0.0/8", "1.2.3.4,tcp:80,10.1.2.3"],
        ),
        ("KUBE-NODE-PORT-TCP", BitmapPort, Inet, &["30080"]),
        ("KUBE-IPVS-IPS", HashIp, Inet, &["10.96.0.1"]),
        ("KUBE-6-CLUSTER-IP", HashIpPort, Inet6, &["fd00::1,sctp:80"]),
        ("KUBE-EXTERNAL-IP", HashIpPort, Inet, &[]),
        (
            "KUBE-CLUSTER-IP",
            HashIpPort,
            Inet,
            &["10.96.0.1,tcp:443", "10.96.0.10,udp:53"],
        ),
    ];
    let captured = captured_listings();
    for &(name, ty, family, entries) in want {
        let (_, datagrams) = captured.iter().find(|(n, _)| n == name).unwrap();
        let set = replay(name, datagrams).unwrap().unwrap();
        assert_eq!(set.spec.name, name);
        assert_eq!((set.spec.set_type, set.spec.family), (ty, family), "{name}");
        if ty.is_hash() {
            assert_eq!(
                (set.spec.hash_size, set.spec.max_elem),
                (1024, 65536),
                "{name}"
            );
        }
        assert_eq!(set.foreign_type, None);
        let mut entries: Vec<String> = entries.iter().map(ToString::to_string).collect();
        entries.sort();
        let mut got = members(&set);
        got.sort();
        assert_eq!(got, entries, "{name}");
        // Each member is what the text parser makes of the line `ipset save` printed.
        for e in set.entries.keys() {
            assert_eq!(&Entry::parse(ty, &e.to_string()).unwrap(), e);
        }
    }
    // 200 members in two LIST messages (the second carries only the name and members).
    let (_, two) = captured
        .iter()
        .find(|(n, _)| n == "KUBE-CLUSTER-IP 200")
        .unwrap();
    assert_eq!(two.len(), 3, "two data datagrams and DONE");
    let set = replay("KUBE-CLUSTER-IP", two).unwrap().unwrap();
    let mut want200: Vec<Entry> = (0..200)
        .map(|i| entry(HashIpPort, &format!("10.97.0.{i},tcp:80")))
        .collect();
    want200.sort();
    assert_eq!(set.entries.keys().cloned().collect::<Vec<_>>(), want200);
    // A type this crate does not model: kept as foreign (the diff recreates it), no members.
    let (_, foreign) = captured.iter().find(|(n, _)| n == "KUBE-FOREIGN").unwrap();
    let set = replay("KUBE-FOREIGN", foreign).unwrap().unwrap();
    assert_eq!(set.foreign_type.as_deref(), Some("hash:net"));
    assert!(set.entries.is_empty());
    // No such set: the kernel refuses the dump with ENOENT.
    let (_, none) = captured.iter().find(|(n, _)| n == "KUBE-NONE").unwrap();
    assert_eq!(replay("KUBE-NONE", none).unwrap_err(), ENOENT);
}

/// A reply naming another set, members before any header, and truncated or garbage
/// datagrams are errors (or nothing), never a panic or a wrong member.
#[test]
fn list_replies_that_do_not_fit_are_errors() {
    let captured = captured_listings();
    let (_, dgs) = captured.iter().find(|(n, _)| n == "KUBE-IPVS-IPS").unwrap();
    let first = &dgs[0];
    let payload = &first[NLMSG_HDRLEN..];
    let ty = msg_type(IPSET_CMD_LIST);
    let err = Listing::new("KUBE-OTHER").take(ty, payload).unwrap_err();
    assert!(err.to_string().contains("KUBE-OTHER"), "{err}");
    // The continuation of the 200-member dump without its first message.
    let (_, two) = captured
        .iter()
        .find(|(n, _)| n == "KUBE-CLUSTER-IP 200")
        .unwrap();
    let err = Listing::new("KUBE-CLUSTER-IP")
        .take(ty, &two[1][NLMSG_HDRLEN..])
        .unwrap_err();
    assert!(err.to_string().contains("before the set's header"), "{err}");
    // Other message types are not read.
    let mut l = Listing::new("KUBE-IPVS-IPS");
    l.take(msg_type(IPSET_CMD_PROTOCOL), payload).unwrap();
    assert!(l.finish().is_none());
    // Every truncation of every captured message, and flipped bytes: no panic.
    for (name, dgs) in &captured {
        let name = name.split(' ').next().unwrap();
        for d in dgs {
            let p = &d[NLMSG_HDRLEN.min(d.len())..];
            for n in 0..p.len() {
                let _ = Listing::new(name).take(ty, &p[..n]);
            }
            for i in 0..p.len() {
                let mut q = p.to_vec();
                q[i] ^= 0xff;
                let _ = Listing::new(name).take(ty, &q);
            }
        }
    }
}
