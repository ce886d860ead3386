//! Encodes 110,000 IPVS NEW_DEST requests (P1's IPVS writes at 10,000 x 10) and reads 110,000
//! ACKs with this crate's framing and with neli 0.7.5's types (neli's best case: every request
//! serialized into one shared buffer, no socket), on the host, no privileges; the two encodings
//! are checked byte-identical. The figures are in `docs/architecture.md` ("Why hand-written
//! netlink framing"). Run: `cargo run --release -p netlink --example neli-compare`.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
use std::io::Cursor;
use std::time::Instant;

use neli::consts::genl::Index;
use neli::consts::nl::{NlTypeWrapper, NlmF};
use neli::genl::{AttrTypeBuilder, Genlmsghdr, GenlmsghdrBuilder, Nlattr, NlattrBuilder};
use neli::nl::{NlPayload, Nlmsghdr, NlmsghdrBuilder};
use neli::types::{Buffer, GenlBuffer, NlBuffer};
use neli::{FromBytesWithInput, ToBytes};

const N: u32 = 110_000;
const FAMILY: u16 = 0x23;

fn handwritten(buf: &mut Vec<u8>, seq: u32) {
    netlink::put_message(buf, FAMILY, 0x5, seq, &[5, 1, 0, 0], |w| {
        // neli marks nested attributes NLA_F_NESTED (IPVS accepts both).
        w.nested(1 | netlink::consts::NLA_F_NESTED, |w| {
            w.u16(1, 2);
            w.u16(2, 6);
            w.bytes(
                3,
                &[
                    10,
                    96,
                    (seq >> 8) as u8,
                    seq as u8,
                    0,
                    0,
                    0,
                    0,
                    0,
                    0,
                    0,
                    0,
                    0,
                    0,
                    0,
                    0,
                ],
            );
            w.be16(4, 80);
        });
        w.nested(2 | netlink::consts::NLA_F_NESTED, |w| {
            w.u16(11, 2);
            w.bytes(
                1,
                &[
                    10,
                    244,
                    (seq >> 8) as u8,
                    seq as u8,
                    0,
                    0,
                    0,
                    0,
                    0,
                    0,
                    0,
                    0,
                    0,
                    0,
                    0,
                    0,
                ],
            );
            w.be16(2, 8080);
            w.u32(3, 0);
            w.u32(4, 1);
            w.u8(12, 0);
            w.be16(13, 0);
            w.u16(14, 0);
            w.u32(5, 0);
            w.u32(6, 0);
        });
    });
}

fn attr<P: neli::Size + ToBytes>(ty: u16, p: P) -> Nlattr<Index, Buffer> {
    NlattrBuilder::default()
        .nla_type(
            AttrTypeBuilder::default()
                .nla_type(Index::from(ty))
                .build()
                .unwrap(),
        )
        .nla_payload(p)
        .build()
        .unwrap()
}

fn nested(ty: u16, inner: Vec<Nlattr<Index, Buffer>>) -> Nlattr<Index, Buffer> {
    let mut a = NlattrBuilder::default()
        .nla_type(
            AttrTypeBuilder::default()
                .nla_type(Index::from(ty))
                .build()
                .unwrap(),
        )
        .nla_payload(Vec::<u8>::new())
        .build()
        .unwrap();
    for i in &inner {
        a = a.nest(i).unwrap();
    }
    a
}

fn neli_msg(seq: u32) -> Nlmsghdr<u16, Genlmsghdr<u8, Index>> {
    let svc = vec![
        attr(1, 2u16),
        attr(2, 6u16),
        attr(
            3,
            Buffer::from(vec![
                10,
                96,
                (seq >> 8) as u8,
                seq as u8,
                0,
                0,
                0,
                0,
                0,
                0,
                0,
                0,
                0,
                0,
                0,
                0,
            ]),
        ),
        attr(4, 80u16.to_be()),
    ];
    let dest = vec![
        attr(11, 2u16),
        attr(
            1,
            Buffer::from(vec![
                10,
                244,
                (seq >> 8) as u8,
                seq as u8,
                0,
                0,
                0,
                0,
                0,
                0,
                0,
                0,
                0,
                0,
                0,
                0,
            ]),
        ),
        attr(2, 8080u16.to_be()),
        attr(3, 0u32),
        attr(4, 1u32),
        attr(12, 0u8),
        attr(13, 0u16),
        attr(14, 0u16),
        attr(5, 0u32),
        attr(6, 0u32),
    ];
    let attrs: GenlBuffer<Index, Buffer> =
        vec![nested(1, svc), nested(2, dest)].into_iter().collect();
    let genl = GenlmsghdrBuilder::default()
        .cmd(5u8)
        .version(1)
        .attrs(attrs)
        .build()
        .unwrap();
    NlmsghdrBuilder::default()
        .nl_type(FAMILY)
        .nl_flags(NlmF::REQUEST | NlmF::ACK)
        .nl_seq(seq)
        .nl_payload(NlPayload::Payload(genl))
        .build()
        .unwrap()
}

/// A kernel ACK datagram for requests `from..to` (nlmsgerr 0 + echoed header, capped).
fn acks(from: u32, to: u32) -> Vec<u8> {
    let mut v = Vec::new();
    for seq in from..to {
        v.extend_from_slice(&36u32.to_ne_bytes());
        v.extend_from_slice(&2u16.to_ne_bytes());
        v.extend_from_slice(&0x100u16.to_ne_bytes());
        v.extend_from_slice(&seq.to_ne_bytes());
        v.extend_from_slice(&0u32.to_ne_bytes());
        v.extend_from_slice(&0i32.to_ne_bytes());
        v.extend_from_slice(&100u32.to_ne_bytes());
        v.extend_from_slice(&FAMILY.to_ne_bytes());
        v.extend_from_slice(&5u16.to_ne_bytes());
        v.extend_from_slice(&seq.to_ne_bytes());
        v.extend_from_slice(&0u32.to_ne_bytes());
    }
    v
}

fn main() {
    let rounds = 5;
    let window = 138u32;
    let datagrams: Vec<(u32, Vec<u8>)> = (0..N)
        .step_by(window as usize)
        .map(|b| (b, acks(b, (b + window).min(N))))
        .collect();
    let mut same = None;
    for round in 0..rounds {
        // Hand-written: encode into one buffer (cleared at 64 KiB like a send).
        let t = Instant::now();
        let mut buf = Vec::with_capacity(64 * 1024);
        let mut bytes = 0usize;
        for seq in 0..N {
            handwritten(&mut buf, seq);
            if buf.len() >= 64 * 1024 {
                bytes += buf.len();
                buf.clear();
            }
        }
        bytes += buf.len();
        let hw_enc = t.elapsed();
        // neli: build the message with its types, serialize into one shared buffer.
        let t = Instant::now();
        let mut cur = Cursor::new(Vec::with_capacity(64 * 1024));
        let mut nbytes = 0usize;
        for seq in 0..N {
            neli_msg(seq).to_bytes(&mut cur).unwrap();
            if cur.get_ref().len() >= 64 * 1024 {
                nbytes += cur.get_ref().len();
                cur = Cursor::new(Vec::with_capacity(64 * 1024));
            }
        }
        nbytes += cur.get_ref().len();
        let neli_enc = t.elapsed();
        if round == 0 {
            let mut a = Vec::new();
            handwritten(&mut a, 7);
            let mut c = Cursor::new(Vec::new());
            neli_msg(7).to_bytes(&mut c).unwrap();
            same = Some(a == *c.get_ref());
            assert_eq!(a, *c.get_ref(), "the two encodings differ");
        }
        // ACKs: hand-written Pending::take vs neli NlBuffer parse.
        let t = Instant::now();
        let mut acked = 0u64;
        for (base, d) in &datagrams {
            let mut p = netlink::Pending::new(*base, window as usize);
            p.take(d, |_, r| {
                if r.is_ok() {
                    acked += 1
                }
            })
            .unwrap();
        }
        let hw_ack = t.elapsed();
        let t = Instant::now();
        let mut nacked = 0u64;
        for (_, d) in &datagrams {
            let msgs = NlBuffer::<NlTypeWrapper, Buffer>::from_bytes_with_input(
                &mut Cursor::new(&d[..]),
                d.len(),
            )
            .unwrap();
            for m in msgs.iter() {
                if let NlPayload::Ack(_) = m.nl_payload() {
                    let _ = m.nl_seq();
                    nacked += 1;
                }
            }
        }
        let neli_ack = t.elapsed();
        println!(
            "round {round}: encode {N}: hand-written {:.1} ms ({bytes} B), neli {:.1} ms ({nbytes} B); \
             ACKs: hand-written {:.1} ms ({acked}), neli {:.1} ms ({nacked}); same bytes: {:?}",
            hw_enc.as_secs_f64() * 1e3,
            neli_enc.as_secs_f64() * 1e3,
            hw_ack.as_secs_f64() * 1e3,
            neli_ack.as_secs_f64() * 1e3,
            same
        );
    }
}
