//! Property tests (fuzzing) of rtnetlink event decoding: arbitrary datagrams parsed with
//! netlink-packet-route then handed to `event_from_message` never panic, and well-formed
//! RTM_NEWADDR/RTM_DELADDR/RTM_NEWLINK messages (random attributes included) decode to the
//! index, address, prefix and name they carry. Cases: `PROPTEST_CASES` (default 256).

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use netif::{event_from_message, AddrEvent};
use proptest::prelude::*;
use rtnetlink::packet_core::{NetlinkMessage, NetlinkPayload};
use rtnetlink::packet_route::RouteNetlinkMessage;

const RTM_NEWLINK: u16 = 16;
const RTM_DELLINK: u16 = 17;
const RTM_NEWADDR: u16 = 20;
const RTM_DELADDR: u16 = 21;
const IFA_ADDRESS: u16 = 1;
const IFA_LOCAL: u16 = 2;
const IFLA_IFNAME: u16 = 3;

fn attr(ty: u16, payload: &[u8]) -> Vec<u8> {
    let mut v = Vec::new();
    v.extend_from_slice(&((4 + payload.len()) as u16).to_ne_bytes());
    v.extend_from_slice(&ty.to_ne_bytes());
    v.extend_from_slice(payload);
    while v.len() % 4 != 0 {
        v.push(0);
    }
    v
}

fn message(ty: u16, body: &[u8]) -> Vec<u8> {
    let len = 16 + body.len();
    let mut v = Vec::with_capacity(len);
    v.extend_from_slice(&(len as u32).to_ne_bytes());
    v.extend_from_slice(&ty.to_ne_bytes());
    v.extend_from_slice(&0u16.to_ne_bytes());
    v.extend_from_slice(&1u32.to_ne_bytes());
    v.extend_from_slice(&0u32.to_ne_bytes());
    v.extend_from_slice(body);
    v
}

/// Parses like the tracker does and decodes; `None` when netlink-packet-route rejects it.
fn decode(buf: &[u8]) -> Option<Result<Option<AddrEvent>, netif::Error>> {
    let msg = NetlinkMessage::<RouteNetlinkMessage>::deserialize(buf).ok()?;
    match msg.payload {
        NetlinkPayload::InnerMessage(m) => Some(event_from_message(&m)),
        _ => None,
    }
}

fn ip() -> impl Strategy<Value = IpAddr> {
    prop_oneof![
        any::<[u8; 4]>().prop_map(|b| IpAddr::V4(Ipv4Addr::from(b))),
        any::<[u8; 16]>().prop_map(|b| IpAddr::V6(Ipv6Addr::from(b))),
    ]
}

fn octets(ip: &IpAddr) -> Vec<u8> {
    match ip {
        IpAddr::V4(a) => a.octets().to_vec(),
        IpAddr::V6(a) => a.octets().to_vec(),
    }
}

/// Random extra attributes (types other than the ones under test, well framed).
fn noise() -> impl Strategy<Value = Vec<u8>> {
    proptest::collection::vec(
        (4u16..64, proptest::collection::vec(any::<u8>(), 0..24)),
        0..4,
    )
    .prop_map(|attrs| {
        attrs
            .into_iter()
            .filter(|(t, _)| ![IFA_ADDRESS, IFA_LOCAL, IFLA_IFNAME].contains(t))
            .flat_map(|(t, p)| attr(t, &p))
            .collect()
    })
}

proptest! {
    #[test]
    fn arbitrary_datagrams_never_panic(
        ty in prop_oneof![Just(RTM_NEWLINK), Just(RTM_DELLINK), Just(RTM_NEWADDR),
                          Just(RTM_DELADDR), any::<u16>()],
        body in proptest::collection::vec(any::<u8>(), 0..256),
        raw in proptest::collection::vec(any::<u8>(), 0..128),
    ) {
        let _ = decode(&message(ty, &body));
        let _ = decode(&raw);
    }

    #[test]
    fn address_messages_decode_to_what_they_carry(
        new in any::<bool>(),
        addr in ip(),
        local in proptest::option::of(ip()),
        prefix in 0u8..=128,
        index in any::<u32>(),
        extra in noise(),
    ) {
        let family: u8 = if addr.is_ipv4() { 2 } else { 10 };
        let mut body = vec![family, prefix, 0, 0];
        body.extend_from_slice(&index.to_ne_bytes());
        body.extend(attr(IFA_ADDRESS, &octets(&addr)));
        if let Some(l) = &local {
            body.extend(attr(IFA_LOCAL, &octets(l)));
        }
        body.extend(extra);
        let ty = if new { RTM_NEWADDR } else { RTM_DELADDR };
        let Some(result) = decode(&message(ty, &body)) else {
            return Ok(()); // netlink-packet-route refused it (e.g. a mismatched IFA_LOCAL)
        };
        let want = local.unwrap_or(addr);
        let max = if want.is_ipv4() { 32 } else { 128 };
        match result {
            Ok(Some(AddrEvent::NewAddr { index: i, net })) if new => {
                prop_assert_eq!(i, index);
                prop_assert_eq!(net.addr(), want);
                prop_assert_eq!(net.prefix_len(), prefix);
            }
            Ok(Some(AddrEvent::DelAddr { index: i, net })) if !new => {
                prop_assert_eq!(i, index);
                prop_assert_eq!(net.addr(), want);
                prop_assert_eq!(net.prefix_len(), prefix);
            }
            Err(_) => prop_assert!(prefix > max, "refused a valid address message"),
            other => prop_assert!(false, "unexpected {:?}", other),
        }
    }

    #[test]
    fn link_messages_decode_their_name(
        new in any::<bool>(),
        name in "[a-z][a-z0-9.-]{0,14}",
        index in any::<u32>(),
        extra in noise(),
    ) {
        let mut body = vec![0u8, 0, 0, 0];
        body.extend_from_slice(&index.to_ne_bytes());
        body.extend_from_slice(&[0; 8]); // flags, change
        let mut n = name.clone().into_bytes();
        n.push(0);
        body.extend(attr(IFLA_IFNAME, &n));
        body.extend(extra);
        let ty = if new { RTM_NEWLINK } else { RTM_DELLINK };
        let Some(result) = decode(&message(ty, &body)) else {
            return Ok(());
        };
        match result.unwrap() {
            Some(AddrEvent::NewLink { index: i, name: got }) if new => {
                prop_assert_eq!(i, index);
                prop_assert_eq!(got, name);
            }
            Some(AddrEvent::DelLink { index: i, name: got }) if !new => {
                prop_assert_eq!(i, index);
                prop_assert_eq!(got, Some(name));
            }
            other => prop_assert!(false, "unexpected {:?}", other),
        }
    }
}

/// The message builder above produces what netlink-packet-route accepts (so the properties are
/// not vacuous).
#[test]
fn the_builder_makes_decodable_messages() {
    let mut body = vec![2u8, 24, 0, 0];
    body.extend_from_slice(&7u32.to_ne_bytes());
    body.extend(attr(IFA_ADDRESS, &[192, 168, 0, 10]));
    body.extend(attr(IFA_LOCAL, &[192, 168, 0, 10]));
    let ev = decode(&message(RTM_NEWADDR, &body)).unwrap().unwrap();
    assert_eq!(
        ev,
        Some(AddrEvent::NewAddr {
            index: 7,
            net: "192.168.0.10/24".parse().unwrap()
        })
    );
    let mut body = vec![0u8, 0, 0, 0];
    body.extend_from_slice(&3u32.to_ne_bytes());
    body.extend_from_slice(&[0; 8]);
    body.extend(attr(IFLA_IFNAME, b"eth0\0"));
    let ev = decode(&message(RTM_NEWLINK, &body)).unwrap().unwrap();
    assert_eq!(
        ev,
        Some(AddrEvent::NewLink {
            index: 3,
            name: "eth0".into()
        })
    );
}
