//! Property tests (fuzzing) of the ctnetlink codec: arbitrary datagrams and mutated real
//! messages never panic or loop; a delete request's tuple decodes back to the entry it was
//! written for. Cases: `PROPTEST_CASES` (default 256).

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use conntrack::codec::{self, CtMessage, Reply, CTA_TUPLE_ORIG};
use conntrack::{Entry, Tuple};
use proptest::prelude::*;

fn decode_all(buf: &[u8]) -> usize {
    let mut n = 0;
    for m in codec::messages(buf) {
        n += 1;
        assert!(
            n <= buf.len() / 16 + 1,
            "more messages than the buffer can hold"
        );
        let Ok(reply) = m else { continue };
        let _ = reply.seq();
        if let Reply::Data(CtMessage { attrs, .. }) = reply {
            let _ = codec::decode_entry(attrs);
            for a in codec::attrs(attrs).flatten() {
                let _ = codec::decode_tuple(a.payload);
                for b in codec::attrs(a.payload).flatten() {
                    let _ = codec::decode_tuple(b.payload);
                }
            }
        }
    }
    n
}

fn tuple() -> impl Strategy<Value = Tuple> {
    let pair = prop_oneof![
        (any::<[u8; 4]>(), any::<[u8; 4]>())
            .prop_map(|(a, b)| (IpAddr::V4(Ipv4Addr::from(a)), IpAddr::V4(Ipv4Addr::from(b)))),
        (any::<[u8; 16]>(), any::<[u8; 16]>())
            .prop_map(|(a, b)| (IpAddr::V6(Ipv6Addr::from(a)), IpAddr::V6(Ipv6Addr::from(b)))),
    ];
    (
        pair,
        prop_oneof![Just(6u8), Just(17u8), Just(132u8)],
        any::<u16>(),
        any::<u16>(),
    )
        .prop_map(|((src, dst), proto, sp, dp)| Tuple {
            src,
            dst,
            proto,
            src_port: Some(sp),
            dst_port: Some(dp),
        })
}

fn entry() -> impl Strategy<Value = Entry> {
    (
        tuple(),
        tuple(),
        proptest::option::of(any::<u32>()),
        proptest::option::of(1..u16::MAX),
    )
        .prop_map(|(orig, reply, id, zone)| Entry {
            orig,
            reply,
            id,
            zone,
        })
}

proptest! {
    #[test]
    fn arbitrary_datagrams_never_panic(buf in proptest::collection::vec(any::<u8>(), 0..512)) {
        decode_all(&buf);
    }

    #[test]
    fn arbitrary_attributes_never_panic(buf in proptest::collection::vec(any::<u8>(), 0..256)) {
        let _ = codec::decode_entry(&buf);
        let _ = codec::decode_tuple(&buf);
    }

    #[test]
    fn delete_requests_carry_the_tuple_and_survive_mutation(
        e in entry(),
        flips in proptest::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 0..8),
        cut in any::<prop::sample::Index>(),
    ) {
        let mut buf = Vec::new();
        codec::put_delete(&mut buf, 42, &e);
        let mut seen = 0;
        for m in codec::messages(&buf) {
            let Reply::Data(CtMessage { seq, attrs, .. }) = m.unwrap() else {
                panic!("a delete request is a data message");
            };
            prop_assert_eq!(seq, 42);
            for a in codec::attrs(attrs) {
                let a = a.unwrap();
                if a.ty == CTA_TUPLE_ORIG {
                    prop_assert_eq!(codec::decode_tuple(a.payload).unwrap(), e.orig);
                    seen += 1;
                }
            }
        }
        prop_assert_eq!(seen, 1);
        let mut bad = buf.clone();
        for (i, b) in &flips {
            let at = i.index(bad.len());
            bad[at] ^= b;
        }
        decode_all(&bad);
        decode_all(&buf[..cut.index(buf.len())]);
    }
}
