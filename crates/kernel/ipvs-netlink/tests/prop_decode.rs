//! Property tests (fuzzing) of the IPVS generic-netlink reply decoding: arbitrary bytes and
//! mutated real messages never panic and never loop; requests the codec writes decode back to
//! what was written. Cases: `PROPTEST_CASES` (default 256 per property; see docs/testing.md).

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use ipvs_netlink::codec::{self, AttrIter, Genl, Reply};
use ipvs_netlink::{Destination, Family, Op, Protocol, Service, ServiceKey};
use proptest::prelude::*;

const FAMILY_ID: u16 = 0x22;

/// Walks every message and decodes every data message every way the client does; returns the
/// number of messages seen. Must not panic on any input.
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
        if let Reply::Data(Genl { attrs, .. }) = reply {
            let _ = codec::decode_service(AttrIter::new(attrs));
            let _ = codec::ipvs::decode_dest(AttrIter::new(attrs), Family::Inet);
            let _ = codec::ipvs::decode_dest(AttrIter::new(attrs), Family::Inet6);
            let _ = codec::ipvs::decode_info(AttrIter::new(attrs));
            let _ = codec::ipvs::decode_timeouts(AttrIter::new(attrs));
            let _ = codec::netlink::decode_family_id(AttrIter::new(attrs));
            for a in AttrIter::new(attrs).flatten() {
                let _ = codec::ipvs::decode_service_nest(a.nested());
                let _ = codec::ipvs::decode_dest_nest(a.nested(), Family::Inet);
                let _ = codec::ipvs::decode_stats(a.nested());
            }
        }
    }
    n
}

fn ip() -> impl Strategy<Value = IpAddr> {
    prop_oneof![
        any::<[u8; 4]>().prop_map(|b| IpAddr::V4(Ipv4Addr::from(b))),
        any::<[u8; 16]>().prop_map(|b| IpAddr::V6(Ipv6Addr::from(b))),
    ]
}

fn key() -> impl Strategy<Value = ServiceKey> {
    let proto = prop_oneof![
        Just(Protocol::Tcp),
        Just(Protocol::Udp),
        Just(Protocol::Sctp)
    ];
    prop_oneof![
        (proto, ip(), any::<u16>()).prop_map(|(protocol, addr, port)| ServiceKey::Inet {
            protocol,
            addr,
            port
        }),
        (
            prop_oneof![Just(Family::Inet), Just(Family::Inet6)],
            1..u32::MAX
        )
            .prop_map(|(family, mark)| ServiceKey::Fwmark { family, mark }),
    ]
}

fn service() -> impl Strategy<Value = Service> {
    (
        key(),
        prop_oneof![Just("rr"), Just("wrr"), Just("sh"), Just("mh"), Just("lc")],
    )
        .prop_map(|(k, s)| Service::new(k, s))
}

/// A request the codec writes for `op` (the same attribute layout as the kernel's replies).
fn encoded(op: &Op) -> Vec<u8> {
    let mut buf = Vec::new();
    codec::put_op(&mut buf, FAMILY_ID, 7, op).unwrap();
    buf
}

fn data_attrs(buf: &[u8]) -> &[u8] {
    match codec::messages(buf).next() {
        Some(Ok(Reply::Data(Genl { attrs, .. }))) => attrs,
        other => panic!("not a data message: {other:?}"),
    }
}

proptest! {
    #[test]
    fn arbitrary_bytes_never_panic(buf in proptest::collection::vec(any::<u8>(), 0..512)) {
        decode_all(&buf);
    }

    #[test]
    fn arbitrary_attributes_after_a_valid_header_never_panic(
        attrs in proptest::collection::vec(any::<u8>(), 0..512),
        cmd in any::<u8>(),
    ) {
        // A well-formed netlink + genl header whose payload is random attributes.
        let len = 16 + 4 + attrs.len();
        let mut buf = Vec::with_capacity(len);
        buf.extend_from_slice(&(len as u32).to_ne_bytes());
        buf.extend_from_slice(&FAMILY_ID.to_ne_bytes());
        buf.extend_from_slice(&2u16.to_ne_bytes()); // NLM_F_MULTI
        buf.extend_from_slice(&1u32.to_ne_bytes());
        buf.extend_from_slice(&0u32.to_ne_bytes());
        buf.extend_from_slice(&[cmd, 1, 0, 0]);
        buf.extend_from_slice(&attrs);
        prop_assert_eq!(decode_all(&buf), 1);
    }

    #[test]
    fn services_roundtrip_and_survive_mutation(
        svc in service(),
        flips in proptest::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 0..8),
        cut in any::<prop::sample::Index>(),
    ) {
        let buf = encoded(&Op::NewService(svc.clone()));
        let back = codec::decode_service(AttrIter::new(data_attrs(&buf))).unwrap();
        prop_assert_eq!(back.key, svc.key);
        prop_assert_eq!(&back.scheduler, &svc.scheduler);
        prop_assert_eq!(back.flags, svc.flags);
        prop_assert_eq!(back.timeout, svc.timeout);
        prop_assert_eq!(back.netmask, svc.netmask);
        // Flipped bytes and truncation: errors, never panics.
        let mut bad = buf.clone();
        for (i, b) in &flips {
            let at = i.index(bad.len());
            bad[at] ^= b;
        }
        decode_all(&bad);
        decode_all(&bad[..cut.index(bad.len() + 1).min(bad.len())]);
    }

    #[test]
    fn destinations_roundtrip_and_survive_mutation(
        k in key(),
        addr in ip(),
        port in any::<u16>(),
        weight in 0..i32::MAX as u32,
        flips in proptest::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 0..8),
    ) {
        let mut d = Destination::new(addr, port);
        d.weight = weight;
        let Ok(buf) = ({
            let mut buf = Vec::new();
            codec::put_op(&mut buf, FAMILY_ID, 9, &Op::NewDest(k, d.clone())).map(|()| buf)
        }) else {
            // The codec refuses some combinations (e.g. a family mismatch without tunnelling).
            return Ok(());
        };
        let back = codec::ipvs::decode_dest(AttrIter::new(data_attrs(&buf)), k.family()).unwrap();
        prop_assert_eq!(back.addr, d.addr);
        prop_assert_eq!(back.port, d.port);
        prop_assert_eq!(back.weight, d.weight);
        prop_assert_eq!(back.fwd, d.fwd);
        let mut bad = buf.clone();
        for (i, b) in &flips {
            let at = i.index(bad.len());
            bad[at] ^= b;
        }
        decode_all(&bad);
    }
}
