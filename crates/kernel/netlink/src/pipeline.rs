//! The one pipelined request/ACK exchange every family client uses (IPVS writes, ipset
//! members, conntrack deletes): many requests per `send`, a bounded window of unanswered
//! requests, every ACK or error matched back to its request by sequence number, and one way
//! of handling a receive buffer overrun (ENOBUFS).
//!
//! Why reading without blocking is enough: the kernel handles a request to a generic netlink
//! or nfnetlink family synchronously inside `send` (`netlink_unicast_kernel` runs the family's
//! handler in the sender's context), so when the sends of a window have returned, every
//! answer is either queued on the socket or was dropped because the receive buffer was full.
//! A receive failing with ENOBUFS says the latter happened; the answers that fit are still
//! queued and are read. A request still unanswered when the queue is empty was lost
//! ([`Answer::Lost`]); it is never waited for. The window is sized so that this does not
//! happen ([`Window::sized`]).

use crate::message::Pending;
use crate::socket::Socket;
use crate::Error;

/// How many requests may be unanswered at once, and when the request buffer is sent.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Window {
    /// Most requests sent and not yet answered (at least 1).
    pub requests: usize,
    /// The request buffer is sent as soon as it holds this many bytes (and at the end of a
    /// window).
    pub max_send: usize,
}

impl Window {
    /// A window the receive buffer `rcvbuf` (what [`Socket::rcvbuf`] reports) can answer
    /// without overrunning when each answer takes at most `budget_per_reply` bytes of it;
    /// clamped to `16..=max_requests`.
    pub fn sized(
        rcvbuf: usize,
        budget_per_reply: usize,
        max_requests: usize,
        max_send: usize,
    ) -> Window {
        Window {
            requests: (rcvbuf / budget_per_reply.max(1)).clamp(16, max_requests.max(16)),
            max_send,
        }
    }
}

/// What became of one request of a pipelined exchange.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Answer {
    /// The kernel acknowledged it (NLMSG_ERROR with error 0).
    Ack,
    /// The kernel refused it.
    Refused {
        /// Positive errno (EEXIST, ENOENT, ...).
        errno: i32,
    },
    /// It was sent and no answer came: the kernel dropped the answer when the receive buffer
    /// overflowed (ENOBUFS). Whether the kernel carried it out is not known.
    Lost,
    /// Its datagram could not be sent (the send error is what [`Socket::exchange`] returns);
    /// the kernel did not see it.
    Unsent,
}

impl Socket {
    /// Sends requests `0..count`, a window at a time, and reports what became of each.
    ///
    /// `put(buf, seq, i)` appends request `i` with sequence number `seq` (and `NLM_F_ACK`, so
    /// the kernel answers it exactly once). When it fails, its bytes are removed, it uses up no
    /// sequence number (a window's numbers stay contiguous) and `answer(i, Err(e))` reports the
    /// error. Every request that was put gets exactly one `answer(i, Ok(_))`, in the order the
    /// answers arrive. Answers to other sequence numbers, repeated answers and data messages
    /// are skipped; a malformed message ends its datagram (the next one is still read).
    ///
    /// A receive that fails with ENOBUFS is counted ([`Socket::overruns`]) and reading goes
    /// on; requests left unanswered are [`Answer::Lost`]. A failed send stops the exchange:
    /// the answers the kernel gave are still read, the window's other requests are
    /// [`Answer::Unsent`], requests after the window are not reported, and the send error is
    /// returned. Any other receive error also stops it (after reporting the window's
    /// unanswered requests as [`Answer::Lost`]) and is returned.
    pub fn exchange<E>(
        &mut self,
        count: usize,
        window: Window,
        put: impl FnMut(&mut Vec<u8>, u32, usize) -> Result<(), E>,
        answer: impl FnMut(usize, Result<Answer, E>),
    ) -> Result<(), Error> {
        exchange(self, count, window, put, answer)
    }
}

/// The IO the exchange needs: a [`Socket`], or in tests a replay of kernel bytes.
pub(crate) trait Transport {
    /// The sequence number used last.
    fn seq(&self) -> u32;
    /// The next sequence number.
    fn next_seq(&mut self) -> u32;
    /// The request buffer.
    fn buf(&mut self) -> &mut Vec<u8>;
    /// Sends the request buffer (empty afterwards).
    fn send(&mut self) -> Result<(), Error>;
    /// One queued datagram, without waiting.
    fn try_recv(&mut self) -> Result<&[u8], Error>;
    /// Counts one receive buffer overrun.
    fn count_overrun(&mut self);
}

impl Transport for Socket {
    fn seq(&self) -> u32 {
        Socket::seq(self)
    }
    fn next_seq(&mut self) -> u32 {
        Socket::next_seq(self)
    }
    fn buf(&mut self) -> &mut Vec<u8> {
        Socket::buf(self)
    }
    fn send(&mut self) -> Result<(), Error> {
        Socket::send(self)
    }
    fn try_recv(&mut self) -> Result<&[u8], Error> {
        Socket::try_recv(self)
    }
    fn count_overrun(&mut self) {
        Socket::count_overrun(self);
    }
}

/// [`Socket::exchange`] over any [`Transport`].
pub(crate) fn exchange<T: Transport, E>(
    t: &mut T,
    count: usize,
    window: Window,
    mut put: impl FnMut(&mut Vec<u8>, u32, usize) -> Result<(), E>,
    mut answer: impl FnMut(usize, Result<Answer, E>),
) -> Result<(), Error> {
    let per_window = window.requests.max(1);
    let mut next = 0;
    let mut in_window: Vec<usize> = Vec::with_capacity(per_window.min(count));
    while next < count {
        let base = t.seq().wrapping_add(1);
        in_window.clear();
        let mut send_error = None;
        while next < count && in_window.len() < per_window {
            let seq = t.seq().wrapping_add(1);
            let before = t.buf().len();
            let i = next;
            next += 1;
            if let Err(e) = put(t.buf(), seq, i) {
                t.buf().truncate(before);
                answer(i, Err(e));
                continue;
            }
            t.next_seq();
            in_window.push(i);
            if t.buf().len() >= window.max_send {
                if let Err(e) = t.send() {
                    send_error = Some(e);
                    break;
                }
            }
        }
        if send_error.is_none() && !t.buf().is_empty() {
            if let Err(e) = t.send() {
                send_error = Some(e);
            }
        }
        let (recv_error, unanswered) = drain(t, base, &in_window, &mut answer);
        let left = if send_error.is_some() {
            Answer::Unsent
        } else {
            Answer::Lost
        };
        for i in unanswered {
            answer(i, Ok(left));
        }
        if let Some(e) = send_error.or(recv_error) {
            return Err(e);
        }
    }
    Ok(())
}

/// Reads the answers to the window `in_window` (numbered from `base`) without blocking.
/// Returns a receive error other than "nothing queued" or ENOBUFS, and the requests left
/// unanswered.
fn drain<T: Transport, E>(
    t: &mut T,
    base: u32,
    in_window: &[usize],
    answer: &mut impl FnMut(usize, Result<Answer, E>),
) -> (Option<Error>, Vec<usize>) {
    let mut pending = Pending::new(base, in_window.len());
    let mut error = None;
    while pending.left() > 0 {
        let datagram = match t.try_recv() {
            Ok(d) => d,
            // The overrun is reported once; the answers that fit are still queued.
            Err(e) if e.is_overrun() => {
                t.count_overrun();
                continue;
            }
            Err(e) => {
                if !e.is_would_block() {
                    error = Some(e);
                }
                break;
            }
        };
        // A malformed message ends this datagram; the next one is still read.
        let _ = pending.take(datagram, |i, r| {
            let a = match r {
                Ok(()) => Answer::Ack,
                Err(errno) => Answer::Refused { errno },
            };
            answer(in_window[i], Ok(a));
        });
    }
    let left = pending.unanswered().map(|i| in_window[i]).collect();
    (error, left)
}
