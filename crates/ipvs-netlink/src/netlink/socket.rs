//! A blocking netlink socket (neli owns the file descriptor): one send buffer that many
//! requests share, one receive buffer for a datagram, sequence numbers, and the receive loop
//! of a request whose replies end in ACK, error or DONE. The only IO of the netlink layer;
//! the parsing it relies on is in [`super::message`].
//!
//! The socket belongs to the network namespace of the thread that creates it.

use std::io;

use neli::consts::socket::{Msg, NlFamily};
use neli::socket::NlSocket;
use neli::utils::Groups;

use super::message::{replies, Data, End};
use crate::Error;

/// Receive buffer for one datagram; kernel dump datagrams are at most 32 KiB.
const RECV_BUF: usize = 128 * 1024;
/// `net.core.rmem_max` when it cannot be read (the kernel default).
const DEFAULT_RMEM_MAX: usize = 212_992;

/// The netlink protocol a [`Socket`] speaks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SocketProtocol {
    /// `NETLINK_GENERIC` (IPVS is a generic netlink family).
    Generic,
    /// `NETLINK_NETFILTER` (nfnetlink: ctnetlink, ...).
    Netfilter,
}

/// A blocking netlink socket with its request buffer, receive buffer and sequence numbers.
pub struct Socket {
    sock: NlSocket,
    seq: u32,
    rcvbuf: usize,
    sbuf: Vec<u8>,
    rbuf: Vec<u8>,
    sends: u64,
}

fn io_err(what: &'static str) -> impl FnOnce(io::Error) -> Error {
    move |source| Error::Io { what, source }
}

/// The receive buffer the kernel grants for a request of `want` bytes: capped by
/// `net.core.rmem_max`, then doubled (the kernel counts its bookkeeping in the buffer).
fn effective_rcvbuf(want: usize) -> usize {
    let max = std::fs::read_to_string("/proc/sys/net/core/rmem_max")
        .ok()
        .and_then(|s| s.trim().parse::<usize>().ok())
        .unwrap_or(DEFAULT_RMEM_MAX);
    want.min(max) * 2
}

impl Socket {
    /// Opens a `protocol` socket in the calling thread's network namespace and asks for a
    /// receive buffer of `want_rcvbuf` bytes. Sequence numbers start from a value derived from
    /// the process id (and the protocol), so requests of different processes are told apart in
    /// traces.
    pub fn connect(protocol: SocketProtocol, want_rcvbuf: usize) -> Result<Socket, Error> {
        let (family, seq_factor) = match protocol {
            SocketProtocol::Generic => (NlFamily::Generic, 7919),
            SocketProtocol::Netfilter => (NlFamily::Netfilter, 104_729),
        };
        let sock = NlSocket::connect(family, None, Groups::empty()).map_err(io_err("connect"))?;
        sock.set_recv_buffer_size(want_rcvbuf)
            .map_err(io_err("set SO_RCVBUF"))?;
        Ok(Socket {
            sock,
            seq: std::process::id().wrapping_mul(seq_factor),
            rcvbuf: effective_rcvbuf(want_rcvbuf),
            sbuf: Vec::new(),
            rbuf: vec![0; RECV_BUF],
            sends: 0,
        })
    }

    /// The receive buffer size the kernel grants (what bounds the replies in flight).
    pub fn rcvbuf(&self) -> usize {
        self.rcvbuf
    }

    /// The sequence number used last.
    pub fn seq(&self) -> u32 {
        self.seq
    }

    /// The next sequence number (wrapping).
    pub fn next_seq(&mut self) -> u32 {
        self.seq = self.seq.wrapping_add(1);
        self.seq
    }

    /// The request buffer: append requests, then [`Socket::send`] them as one datagram.
    pub fn buf(&mut self) -> &mut Vec<u8> {
        &mut self.sbuf
    }

    /// Datagrams handed to the kernel (a short send counts, a failed one does not).
    pub fn sends(&self) -> u64 {
        self.sends
    }

    /// Sends the request buffer as one datagram. The buffer is empty afterwards, whether or
    /// not the send succeeded.
    pub fn send(&mut self) -> Result<(), Error> {
        let sent = self.sock.send(&self.sbuf, Msg::empty());
        let len = self.sbuf.len();
        self.sbuf.clear();
        let n = sent.map_err(io_err("send"))?;
        self.sends += 1;
        if n != len {
            return Err(Error::Io {
                what: "send",
                source: io::Error::new(io::ErrorKind::WriteZero, "short netlink send"),
            });
        }
        Ok(())
    }

    /// Receives one datagram, waiting for it.
    pub fn recv(&mut self) -> Result<&[u8], Error> {
        self.recv_flags(Msg::empty())
    }

    /// Receives one datagram if one is queued; `Error::Io` with `WouldBlock` when none is.
    pub fn try_recv(&mut self) -> Result<&[u8], Error> {
        self.recv_flags(Msg::DONTWAIT)
    }

    fn recv_flags(&mut self, flags: Msg) -> Result<&[u8], Error> {
        let (n, _) = self
            .sock
            .recv(&mut self.rbuf[..], flags | Msg::TRUNC)
            .map_err(io_err("recv"))?;
        self.rbuf
            .get(..n)
            .ok_or(Error::Truncated("datagram larger than the receive buffer"))
    }

    /// Receives (waiting) until the replies to the request numbered `seq` end, passing its
    /// data messages to `each` (see [`replies`]); returns how they ended.
    pub fn recv_replies<E: From<Error>>(
        &mut self,
        seq: u32,
        mut each: impl FnMut(Data<'_>) -> Result<(), E>,
    ) -> Result<End, E> {
        loop {
            let datagram = self.recv()?;
            if let Some(end) = replies(datagram, seq, &mut each)? {
                return Ok(end);
            }
        }
    }
}
