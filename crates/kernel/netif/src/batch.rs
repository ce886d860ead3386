//! Pipelined rtnetlink requests: many messages per datagram on a dedicated socket, one ACK
//! (or error) per message collected afterwards, so each message gets its own result.

use std::collections::HashMap;

use netlink_packet_route::RouteNetlinkMessage;
use rtnetlink::packet_core::{NetlinkBuffer, NetlinkMessage, NetlinkPayload};
use rtnetlink::sys::protocols::NETLINK_ROUTE;
use rtnetlink::sys::{AsyncSocket, AsyncSocketExt, SocketAddr, TokioSocket};

use crate::Error;

/// Upper bound of one datagram of requests (the kernel accepts far larger; this keeps the
/// ACKs of one datagram well inside the receive buffer).
const MAX_DATAGRAM: usize = 32 * 1024;

/// Upper bound of requests per datagram. The kernel handles a whole datagram inside one
/// sendmsg and queues one ACK per request; every ACK must fit in the receive buffer (about
/// 1 KiB of buffer each, and the buffer is capped by net.core.rmem_max, 208 KiB by default),
/// or ACKs are dropped.
const MAX_PER_DATAGRAM: usize = 128;

/// Receive buffer size asked for (the kernel caps it at net.core.rmem_max).
const RX_BUF: usize = 1 << 20;

/// A netlink route socket used only for pipelined requests.
pub(crate) struct BatchSocket {
    socket: tokio::sync::Mutex<TokioSocket>,
    seq: std::sync::atomic::AtomicU32,
}

/// The kernel's answer to one request.
pub(crate) enum Answer {
    /// ACK without error.
    Ok,
    /// The kernel's error message (errno inside).
    Nack(rtnetlink::Error),
    /// No usable answer (socket error, malformed reply).
    Failed(String),
    /// No answer within the time limit (the kernel is stuck or the replies were lost).
    TimedOut(std::time::Duration),
}

impl BatchSocket {
    /// Open the socket in the calling thread's network namespace.
    pub(crate) fn new() -> Result<Self, Error> {
        let mut s = TokioSocket::new(NETLINK_ROUTE).map_err(Error::Socket)?;
        let sock = s.socket_mut();
        sock.bind_auto().map_err(Error::Socket)?;
        sock.connect(&SocketAddr::new(0, 0))
            .map_err(Error::Socket)?;
        // Error ACKs without the echoed request: smaller replies.
        sock.set_cap_ack(true).map_err(Error::Socket)?;
        sock.set_rx_buf_sz(RX_BUF).map_err(Error::Socket)?;
        Ok(Self {
            socket: tokio::sync::Mutex::new(s),
            seq: std::sync::atomic::AtomicU32::new(1),
        })
    }

    /// Send every message (flags already set by the caller; ACK is forced on) and return one
    /// answer per message, in order. Datagrams are filled up to [`MAX_DATAGRAM`]. Sending a
    /// datagram and each wait for the next reply take at most `timeout`; past it the
    /// datagram's unanswered requests are [`Answer::TimedOut`].
    pub(crate) async fn run(
        &self,
        msgs: Vec<NetlinkMessage<RouteNetlinkMessage>>,
        timeout: std::time::Duration,
    ) -> Vec<Answer> {
        let mut answers: Vec<Option<Answer>> = (0..msgs.len()).map(|_| None).collect();
        let socket = self.socket.lock().await;
        let mut i = 0;
        while i < msgs.len() {
            let mut buf = Vec::with_capacity(MAX_DATAGRAM);
            let mut pending: HashMap<u32, usize> = HashMap::new();
            while i < msgs.len() {
                let mut m = msgs[i].clone();
                m.header.flags |= rtnetlink::packet_core::NLM_F_ACK;
                let seq = self.seq.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                m.header.sequence_number = seq;
                m.finalize();
                let len = m.buffer_len();
                if !buf.is_empty()
                    && (buf.len() + len > MAX_DATAGRAM || pending.len() >= MAX_PER_DATAGRAM)
                {
                    break;
                }
                let start = buf.len();
                buf.resize(start + len, 0);
                m.serialize(&mut buf[start..]);
                pending.insert(seq, i);
                i += 1;
            }
            match tokio::time::timeout(timeout, socket.send(&buf)).await {
                Ok(Ok(_)) => {}
                Ok(Err(e)) => {
                    for idx in pending.into_values() {
                        answers[idx] = Some(Answer::Failed(format!("send: {e}")));
                    }
                    continue;
                }
                Err(_) => {
                    for idx in pending.into_values() {
                        answers[idx] = Some(Answer::TimedOut(timeout));
                    }
                    continue;
                }
            }
            while !pending.is_empty() {
                let data = match tokio::time::timeout(timeout, socket.recv_from_full()).await {
                    Ok(Ok((d, _))) => d,
                    Err(_) => {
                        for idx in pending.drain().map(|(_, v)| v) {
                            answers[idx] = Some(Answer::TimedOut(timeout));
                        }
                        break;
                    }
                    Ok(Err(e)) => {
                        for idx in pending.drain().map(|(_, v)| v) {
                            answers[idx] = Some(Answer::Failed(format!("receive: {e}")));
                        }
                        break;
                    }
                };
                if let Err(e) = parse_acks(&data, &mut pending, &mut answers) {
                    let detail = e.to_string();
                    for idx in pending.drain().map(|(_, v)| v) {
                        answers[idx] = Some(Answer::Failed(detail.clone()));
                    }
                }
            }
        }
        answers
            .into_iter()
            .map(|a| a.unwrap_or_else(|| Answer::Failed("no answer".into())))
            .collect()
    }
}

/// Walk one datagram of replies, settling the pending requests it answers.
fn parse_acks(
    data: &[u8],
    pending: &mut HashMap<u32, usize>,
    answers: &mut [Option<Answer>],
) -> Result<(), Error> {
    let mut off = 0;
    while off < data.len() {
        let rest = &data[off..];
        let len = NetlinkBuffer::new_checked(rest)
            .map_err(Error::MalformedReply)?
            .length() as usize;
        if len < 16 || len > rest.len() {
            return Err(Error::ReplyLength(len));
        }
        let msg = NetlinkMessage::<RouteNetlinkMessage>::deserialize(&rest[..len])
            .map_err(Error::MalformedReply)?;
        if let NetlinkPayload::Error(err) = msg.payload {
            if let Some(idx) = pending.remove(&msg.header.sequence_number) {
                answers[idx] = Some(if err.code.is_none() {
                    Answer::Ok
                } else {
                    Answer::Nack(rtnetlink::Error::NetlinkError(err))
                });
            }
        }
        off += (len + 3) & !3;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// NLMSG_ERROR reply: header (len, type 2, flags, seq, pid) + i32 code + echoed header.
    fn ack(seq: u32, code: i32) -> Vec<u8> {
        let mut v = Vec::new();
        v.extend_from_slice(&36u32.to_ne_bytes());
        v.extend_from_slice(&2u16.to_ne_bytes());
        v.extend_from_slice(&0u16.to_ne_bytes());
        v.extend_from_slice(&seq.to_ne_bytes());
        v.extend_from_slice(&0u32.to_ne_bytes());
        v.extend_from_slice(&code.to_ne_bytes());
        v.extend_from_slice(&[0u8; 16]);
        v
    }

    fn setup(seqs: &[u32]) -> (HashMap<u32, usize>, Vec<Option<Answer>>) {
        let pending = seqs.iter().enumerate().map(|(i, s)| (*s, i)).collect();
        (pending, (0..seqs.len()).map(|_| None).collect())
    }

    #[test]
    fn acks_and_nacks_settle_their_requests() {
        let (mut pending, mut answers) = setup(&[7, 8, 9]);
        let mut data = ack(7, 0);
        data.extend(ack(8, -99));
        data.extend(ack(42, 0)); // not ours: ignored
        parse_acks(&data, &mut pending, &mut answers).unwrap();
        assert!(matches!(answers[0], Some(Answer::Ok)));
        match &answers[1] {
            Some(Answer::Nack(e)) => assert_eq!(crate::errno_of(e), Some(99)),
            _ => panic!("expected a NACK"),
        }
        assert!(answers[2].is_none());
        assert_eq!(pending.len(), 1);
        assert!(pending.contains_key(&9));
    }

    #[test]
    fn truncated_or_lying_replies_are_errors() {
        let (mut pending, mut answers) = setup(&[7]);
        let full = ack(7, 0);
        for cut in [1usize, 10, 20, 35] {
            assert!(
                parse_acks(&full[..cut], &mut pending, &mut answers).is_err(),
                "cut {cut}"
            );
        }
        let mut lying = full.clone();
        lying[0..4].copy_from_slice(&400u32.to_ne_bytes());
        assert!(parse_acks(&lying, &mut pending, &mut answers).is_err());
        let mut tiny = full.clone();
        tiny[0..4].copy_from_slice(&4u32.to_ne_bytes());
        assert!(parse_acks(&tiny, &mut pending, &mut answers).is_err());
        assert!(answers[0].is_none());
        assert_eq!(pending.len(), 1);
    }
}
