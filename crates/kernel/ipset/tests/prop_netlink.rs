//! Property tests (fuzzing) of the ipset netlink codec: arbitrary datagrams never panic the
//! reply readers; every entry the crate models encodes to a well-formed request (one message,
//! attributes and nested attributes walk to their end, every address and port carries the
//! kernel's byte order flag). Cases: `PROPTEST_CASES` (default 256).

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use ipnet::IpNet;
use ipset::netlink::{parse_protocol_reply, protocol_answer, put_adt, Adt};
use ipset::{Entry, Protocol};
use netlink::{messages, AttrIter, Message, Pending};
use proptest::prelude::*;

fn ip(v6: bool) -> impl Strategy<Value = IpAddr> {
    prop_oneof![
        any::<[u8; 4]>().prop_map(|b| IpAddr::V4(Ipv4Addr::from(b))),
        any::<[u8; 16]>().prop_map(|b| IpAddr::V6(Ipv6Addr::from(b))),
    ]
    .prop_filter("family", move |a| a.is_ipv6() == v6)
}

fn proto() -> impl Strategy<Value = Protocol> {
    prop_oneof![
        Just(Protocol::Tcp),
        Just(Protocol::Udp),
        Just(Protocol::Sctp)
    ]
}

fn entry() -> impl Strategy<Value = Entry> {
    any::<bool>().prop_flat_map(|v6| {
        let max = if v6 { 128u8 } else { 32 };
        prop_oneof![
            ip(v6).prop_map(Entry::Ip),
            (ip(v6), proto(), any::<u16>()).prop_map(|(a, p, n)| Entry::ip_port(a, p, n)),
            (ip(v6), proto(), any::<u16>(), ip(v6))
                .prop_map(|(a, p, n, b)| Entry::ip_port_ip(a, p, n, b)),
            (ip(v6), proto(), any::<u16>(), ip(v6), 0..=max).prop_map(|(a, p, n, b, l)| {
                Entry::ip_port_net(a, p, n, IpNet::new(b, l).unwrap())
            }),
            any::<u16>().prop_map(Entry::Port),
        ]
    })
}

proptest! {
    #[test]
    fn arbitrary_datagrams_never_panic(d in proptest::collection::vec(any::<u8>(), 0..200), seq in 0u32..4) {
        let _ = protocol_answer(&d, seq);
        let _ = parse_protocol_reply(&d);
        let mut p = Pending::new(0, 4);
        let _ = p.take(&d, |i, _| assert!(i < 4));
    }

    #[test]
    fn every_entry_encodes_to_a_well_formed_request(e in entry(), del in any::<bool>(), seq in any::<u32>()) {
        let adt = if del { Adt::Del } else { Adt::Add };
        let mut buf = Vec::new();
        put_adt(&mut buf, adt, seq, 7, "KUBE-LOAD-BALANCER-SOURCE-CIDR", &e).unwrap();
        prop_assert_eq!(buf.len() % 4, 0);
        let msgs: Vec<_> = messages(&buf).collect::<Result<_, _>>().unwrap();
        prop_assert_eq!(msgs.len(), 1);
        let Message::Data(d) = msgs[0] else { panic!("not a data message") };
        prop_assert_eq!(d.header.ty, if del { 0x60a } else { 0x609 });
        prop_assert_eq!(d.header.seq, seq);
        let mut data = None;
        for a in AttrIter::new(&d.payload[4..]) {
            let a = a.unwrap();
            if a.ty == 7 {
                data = Some(a);
            }
        }
        let data = data.expect("IPSET_ATTR_DATA");
        // Raw walk of DATA: flags as the kernel checks them.
        let mut rest = data.payload;
        let mut n = 0;
        while rest.len() >= 4 {
            let len = u16::from_ne_bytes([rest[0], rest[1]]) as usize;
            let ty = u16::from_ne_bytes([rest[2], rest[3]]);
            prop_assert!(len >= 4 && len <= rest.len());
            match ty & 0x3fff {
                1 | 20 => {
                    prop_assert_eq!(ty & 0x8000, 0x8000, "address not nested");
                    for inner in AttrIter::new(&rest[4..len]) {
                        let inner = inner.unwrap();
                        prop_assert!(inner.payload.len() == 4 || inner.payload.len() == 16);
                    }
                    let inner_ty = u16::from_ne_bytes([rest[6], rest[7]]);
                    prop_assert_eq!(inner_ty & 0x4000, 0x4000, "address not in net byte order");
                }
                4 | 9 => prop_assert_eq!(ty & 0x4000, 0x4000, "port/lineno not in net byte order"),
                7 | 21 => prop_assert_eq!(len, 5),
                other => prop_assert!(false, "unexpected attribute {}", other),
            }
            n += 1;
            rest = &rest[((len + 3) & !3).min(rest.len())..];
        }
        prop_assert!(rest.is_empty() && n >= 2);
    }
}
