//! Byte-level tests of the family-independent framing: request headers, message
//! classification, matching replies to requests (a reply stream, a pipelined window), and the
//! pipelined exchange over replayed kernel bytes (ACKs, errnos, ENOBUFS, a failed send).
//! Expected bytes follow `struct nlmsghdr` / `struct nlmsgerr`, little-endian (x86-64).
#![cfg(target_endian = "little")]

use super::*;
use crate::error::ENOBUFS;
use crate::Error;

/// `struct nlmsghdr` (flags 0, pid 0) + payload.
fn msg(ty: u16, seq: u32, payload: &[u8]) -> Vec<u8> {
    let mut v = Vec::new();
    v.extend_from_slice(&(16 + payload.len() as u32).to_le_bytes());
    v.extend_from_slice(&ty.to_le_bytes());
    v.extend_from_slice(&[0, 0]);
    v.extend_from_slice(&seq.to_le_bytes());
    v.extend_from_slice(&[0; 4]);
    v.extend_from_slice(payload);
    v
}

/// `struct nlmsgerr`: the error code and the echoed request header (with `echo_seq`).
fn err(seq: u32, echo_seq: u32, code: i32) -> Vec<u8> {
    let mut p = code.to_le_bytes().to_vec();
    p.extend(msg(0x22, echo_seq, &[])[..16].iter());
    msg(2, seq, &p)
}

fn done(seq: u32, code: i32) -> Vec<u8> {
    msg(3, seq, &code.to_le_bytes())
}

#[test]
fn put_message_writes_header_family_header_and_attributes() {
    let mut buf = vec![0xee; 4]; // appends after the (aligned) messages the buffer holds
    put_message(&mut buf, 0x0102, 0x0005, 7, &[2, 0, 0, 0], |w| w.u8(1, 17));
    let mut want = vec![0xee; 4];
    want.extend_from_slice(&28u32.to_le_bytes());
    want.extend_from_slice(&[0x02, 0x01, 0x05, 0, 7, 0, 0, 0, 0, 0, 0, 0]);
    want.extend_from_slice(&[2, 0, 0, 0]);
    want.extend_from_slice(&[5, 0, 1, 0, 17, 0, 0, 0]);
    assert_eq!(buf, want);
}

#[test]
fn classifies_every_message_type() {
    let mut d = err(1, 1, 0);
    d.extend(err(9, 2, -17)); // the echoed header's sequence number wins
    d.extend(done(3, 0));
    d.extend(done(4, -16));
    d.extend(msg(3, 5, &[])); // DONE without an error code
    d.extend(msg(1, 6, &[])); // NOOP
    d.extend(msg(0x22, 7, &[1, 2, 3, 4, 5]));
    d.extend([0, 0, 0]); // padding of the last message
    let got: Vec<Message<Data<'_>>> = messages(&d).map(|m| m.unwrap()).collect();
    assert_eq!(got.len(), 7);
    assert_eq!(got[0], Message::Ack { seq: 1 });
    assert_eq!(got[1], Message::Error { seq: 2, errno: 17 });
    assert_eq!(got[2], Message::Done { seq: 3, errno: 0 });
    assert_eq!(got[3], Message::Done { seq: 4, errno: 16 });
    assert_eq!(got[4], Message::Done { seq: 5, errno: 0 });
    assert!(matches!(got[5], Message::Other { header } if header.seq == 6));
    let Message::Data(Data { header, payload }) = got[6] else {
        panic!("{:?}", got[6]);
    };
    assert_eq!((header.ty, header.seq, header.len), (0x22, 7, 21));
    assert_eq!(payload, &[1, 2, 3, 4, 5]);
}

#[test]
fn malformed_messages_end_the_walk_with_one_error() {
    let header = msg(0x22, 1, &[]);
    let got: Vec<_> = messages(&header[..15]).collect();
    assert!(matches!(got[..], [Err(Error::Truncated("netlink header"))]));
    for (bytes, what) in [
        (msg(2, 1, &[0, 0]), "netlink error code"),
        (msg(3, 1, &[0, 0]), "netlink done code"),
    ] {
        let mut d = bytes;
        d.extend([0; 2]);
        d.extend(done(2, 0));
        let got: Vec<_> = messages(&d).collect();
        assert_eq!(got.len(), 1, "{what}");
        assert!(
            matches!(got[0], Err(Error::Truncated(w)) if w == what),
            "{what}"
        );
    }
    let mut short = done(1, 0);
    short[..4].copy_from_slice(&8u32.to_le_bytes());
    assert!(matches!(
        messages(&short).next(),
        Some(Err(Error::Malformed(_)))
    ));
}

#[test]
fn replies_collects_one_requests_data_until_its_end() {
    let mut d = msg(0x22, 4, &[1]);
    d.extend([0; 3]);
    d.extend(msg(0x22, 5, &[2])); // another request's reply
    d.extend([0; 3]);
    d.extend(err(5, 5, -2));
    let mut seen = Vec::new();
    let mut each = |d: Data<'_>| {
        seen.push((d.header.seq, d.payload.to_vec()));
        Ok::<(), Error>(())
    };
    assert_eq!(replies(&d, 4, &mut each).unwrap(), None);
    d.extend(done(4, 0));
    assert_eq!(
        replies(&d, 4, &mut each).unwrap(),
        Some(End::Done { errno: 0 })
    );
    assert_eq!(seen, vec![(4, vec![1]), (4, vec![1])]);
    assert_eq!(
        replies(&d, 5, &mut |_| Ok::<(), Error>(())).unwrap(),
        Some(End::Error { errno: 2 })
    );
    // An error from `each` stops the walk.
    let r = replies(&d, 4, &mut |_| Err(Error::Malformed("x".into())));
    assert!(matches!(r, Err(Error::Malformed(_))));
    assert_eq!(End::Ack.errno(), None);
    assert_eq!(End::Done { errno: 0 }.errno(), None);
    assert_eq!(End::Done { errno: 4 }.errno(), Some(4));
    assert_eq!(End::Error { errno: 1 }.errno(), Some(1));
}

#[test]
fn pending_answers_each_request_of_a_window_once() {
    let base = u32::MAX - 1; // the window's numbers wrap
    let mut p = Pending::new(base, 3);
    let mut got = Vec::new();
    let mut d = err(base, base, 0);
    d.extend(err(base, base, -17)); // repeated: ignored
    d.extend(err(7, 7, 0)); // not in the window
    d.extend(msg(0x22, base.wrapping_add(1), &[])); // data: ignored
    d.extend(err(base.wrapping_add(2), base.wrapping_add(2), -2));
    p.take(&d, |i, r| got.push((i, r))).unwrap();
    assert_eq!(got, vec![(0, Ok(())), (2, Err(2))]);
    assert_eq!(p.left(), 1);
    // A malformed message stops the datagram; the answers before it count.
    let mut d = err(base.wrapping_add(1), base.wrapping_add(1), -1);
    d.extend(msg(2, 9, &[0]));
    assert!(p.take(&d, |i, r| got.push((i, r))).is_err());
    assert_eq!(got.last(), Some(&(1, Err(1))));
    assert_eq!(p.left(), 0);
}

/// A [`pipeline::Transport`] replaying kernel bytes: what each receive returns, in order
/// (`Err(errno)` fails that receive), then "nothing queued" (EAGAIN).
#[derive(Default)]
struct Replay {
    seq: u32,
    buf: Vec<u8>,
    sent: Vec<Vec<u8>>,
    /// The send with this index (0-based) fails with this errno.
    fail_send: Option<(usize, i32)>,
    queue: std::collections::VecDeque<Result<Vec<u8>, i32>>,
    current: Vec<u8>,
    overruns: u64,
}

impl pipeline::Transport for Replay {
    fn seq(&self) -> u32 {
        self.seq
    }
    fn next_seq(&mut self) -> u32 {
        self.seq = self.seq.wrapping_add(1);
        self.seq
    }
    fn buf(&mut self) -> &mut Vec<u8> {
        &mut self.buf
    }
    fn send(&mut self) -> Result<(), Error> {
        let datagram = std::mem::take(&mut self.buf);
        match self.fail_send {
            Some((n, errno)) if n == self.sent.len() => Err(Error::Io {
                what: "send",
                source: std::io::Error::from_raw_os_error(errno),
            }),
            _ => {
                self.sent.push(datagram);
                Ok(())
            }
        }
    }
    fn try_recv(&mut self) -> Result<&[u8], Error> {
        let next = self.queue.pop_front().unwrap_or(Err(11)); // EAGAIN
        match next {
            Ok(d) => {
                self.current = d;
                Ok(&self.current)
            }
            Err(errno) => Err(Error::Io {
                what: "recv",
                source: std::io::Error::from_raw_os_error(errno),
            }),
        }
    }
    fn count_overrun(&mut self) {
        self.overruns += 1;
    }
}

/// Puts request `i` as an empty message of type 0x22 (`"bad"` for the indices in `bad`).
fn put_or_fail(
    bad: &[usize],
) -> impl FnMut(&mut Vec<u8>, u32, usize) -> Result<(), &'static str> + '_ {
    move |buf, seq, i| {
        put_message(buf, 0x22, 0x5, seq, &[], |_| {});
        if bad.contains(&i) {
            Err("bad")
        } else {
            Ok(())
        }
    }
}

#[test]
fn exchange_matches_acks_errnos_and_overruns_by_sequence_number() {
    let mut t = Replay {
        seq: 100,
        ..Replay::default()
    };
    // Requests 0, 1, 3, 4 go out as 101..104 (2 fails to encode and uses no number).
    let mut first = err(101, 101, 0);
    first.extend(err(102, 102, -17)); // EEXIST
    first.extend(err(7, 7, 0)); // another request's ACK
    t.queue.push_back(Ok(first));
    t.queue.push_back(Err(ENOBUFS)); // the kernel dropped the answer to 103
    let mut second = err(104, 104, 0);
    second.extend(err(101, 101, -1)); // repeated: ignored
    t.queue.push_back(Ok(second));
    let mut got = Vec::new();
    let window = Window {
        requests: 8,
        max_send: 64 * 1024,
    };
    pipeline::exchange(&mut t, 5, window, put_or_fail(&[2]), |i, a| {
        got.push((i, a))
    })
    .unwrap();
    assert_eq!(
        got,
        vec![
            (2, Err("bad")),
            (0, Ok(Answer::Ack)),
            (1, Ok(Answer::Refused { errno: 17 })),
            (4, Ok(Answer::Ack)),
            (3, Ok(Answer::Lost)),
        ]
    );
    assert_eq!(t.overruns, 1);
    // One datagram, its numbers contiguous, the failed request's bytes removed.
    assert_eq!(t.sent.len(), 1);
    let seqs: Vec<u32> = messages(&t.sent[0]).map(|m| m.unwrap().seq()).collect();
    assert_eq!(seqs, vec![101, 102, 103, 104]);
    assert_eq!(t.seq, 104);
}

#[test]
fn exchange_sends_by_window_and_size_and_stops_at_a_failed_send() {
    // Window of 2, a datagram per request (max_send 1 byte): 0 and 1 are answered, the
    // second window's first send fails with EPERM: 2 is unsent, 3 and 4 never put.
    let mut t = Replay {
        seq: u32::MAX, // the numbers wrap
        fail_send: Some((2, 1)),
        ..Replay::default()
    };
    let mut acks = err(0, 0, 0);
    acks.extend(err(1, 1, 0));
    t.queue.push_back(Ok(acks));
    let mut got = Vec::new();
    let window = Window {
        requests: 2,
        max_send: 1,
    };
    let e = pipeline::exchange(&mut t, 5, window, put_or_fail(&[]), |i, a| got.push((i, a)))
        .unwrap_err();
    assert_eq!(e.errno(), Some(1), "{e}");
    assert_eq!(
        got,
        vec![
            (0, Ok(Answer::Ack)),
            (1, Ok(Answer::Ack)),
            (2, Ok(Answer::Unsent))
        ]
    );
    assert_eq!(t.sent.len(), 2);
    // Another receive error (EBADF) ends the exchange; the window's rest is lost.
    let mut t = Replay::default();
    t.queue.push_back(Ok(err(1, 1, 0)));
    t.queue.push_back(Err(9));
    let mut got = Vec::new();
    let e = pipeline::exchange(&mut t, 3, window, put_or_fail(&[]), |i, a| got.push((i, a)))
        .unwrap_err();
    assert_eq!(e.errno(), Some(9), "{e}");
    assert!(!e.is_overrun() && !e.is_would_block());
    assert_eq!(got, vec![(0, Ok(Answer::Ack)), (1, Ok(Answer::Lost))]);
    assert_eq!(
        Window::sized(212_992 * 2, 3072, 8192, 100),
        Window {
            requests: 138,
            max_send: 100
        }
    );
    assert_eq!(Window::sized(1000, 3072, 8192, 100).requests, 16);
}
