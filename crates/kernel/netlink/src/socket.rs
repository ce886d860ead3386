//! A blocking netlink socket: one send buffer that many requests share, one receive buffer
//! for a datagram, sequence numbers, and the receive loop of a request whose replies end in
//! ACK, error or DONE. The only IO of the netlink layer (with the pipelined exchange of
//! [`crate::pipeline`], built on it); the parsing it relies on is in [`crate::message`].
//!
//! Every blocking receive has a time limit (`SO_RCVTIMEO`, [`DEFAULT_RECV_TIMEOUT`] unless
//! changed with [`Socket::set_recv_timeout`]): a kernel that does not answer makes a request
//! fail with [`Error::Timeout`] instead of blocking its caller for good. The limit applies per
//! receive, so a long dump keeps going as long as datagrams keep coming.
//!
//! The socket belongs to the network namespace of the thread that creates it.

use std::io;
use std::os::fd::{AsRawFd as _, OwnedFd};
use std::time::Duration;

use nix::errno::Errno;
use nix::sys::socket::{
    self, setsockopt, sockopt, AddressFamily, MsgFlags, NetlinkAddr, SockFlag, SockProtocol,
    SockType,
};
use nix::sys::time::TimeVal;

use crate::message::{replies, Data, End};
use crate::Error;

/// How long one blocking receive waits for a datagram by default.
///
/// Why 10 s: the kernel answers a netlink request synchronously, inside the `send` (IPVS,
/// ipset, ctnetlink) or right after it, and a dump hands out its next datagram as soon as the
/// previous one is read, so a healthy kernel keeps a receive waiting for micro- to
/// milliseconds even for the largest tables. A receive that waits ten seconds is a kernel (or
/// a lock inside it) that is stuck, and the sync is better failed and retried than blocked.
pub const DEFAULT_RECV_TIMEOUT: Duration = Duration::from_secs(10);

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
    fd: OwnedFd,
    recv_timeout: Duration,
    seq: u32,
    rcvbuf: usize,
    sbuf: Vec<u8>,
    rbuf: Vec<u8>,
    sends: u64,
    overruns: u64,
}

fn io_err(what: &'static str) -> impl FnOnce(Errno) -> Error {
    move |errno| Error::Io {
        what,
        source: io::Error::from(errno),
    }
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
        let (proto, seq_factor) = match protocol {
            SocketProtocol::Generic => (SockProtocol::NetlinkGeneric, 7919),
            SocketProtocol::Netfilter => (SockProtocol::NetlinkNetFilter, 104_729),
        };
        let fd = socket::socket(
            AddressFamily::Netlink,
            SockType::Raw,
            SockFlag::SOCK_CLOEXEC,
            proto,
        )
        .map_err(io_err("connect"))?;
        // Port id 0: the kernel assigns one; no multicast groups.
        socket::bind(fd.as_raw_fd(), &NetlinkAddr::new(0, 0)).map_err(io_err("connect"))?;
        setsockopt(&fd, sockopt::RcvBuf, &want_rcvbuf).map_err(io_err("set SO_RCVBUF"))?;
        let mut sock = Socket {
            fd,
            recv_timeout: DEFAULT_RECV_TIMEOUT,
            seq: std::process::id().wrapping_mul(seq_factor),
            rcvbuf: effective_rcvbuf(want_rcvbuf),
            sbuf: Vec::new(),
            rbuf: vec![0; RECV_BUF],
            sends: 0,
            overruns: 0,
        };
        sock.set_recv_timeout(DEFAULT_RECV_TIMEOUT)?;
        Ok(sock)
    }

    /// Changes how long one blocking receive ([`Socket::recv`], and each receive of
    /// [`Socket::recv_replies`]) waits for a datagram before it fails with [`Error::Timeout`]
    /// (default [`DEFAULT_RECV_TIMEOUT`]; at least 1 ms: zero would mean no limit to the
    /// kernel).
    pub fn set_recv_timeout(&mut self, timeout: Duration) -> Result<(), Error> {
        let timeout = timeout.max(Duration::from_millis(1));
        let tv = TimeVal::new(
            i64::try_from(timeout.as_secs()).unwrap_or(i64::MAX),
            i64::from(timeout.subsec_micros()),
        );
        setsockopt(&self.fd, sockopt::ReceiveTimeout, &tv).map_err(io_err("set SO_RCVTIMEO"))?;
        self.recv_timeout = timeout;
        Ok(())
    }

    /// How long one blocking receive waits for a datagram.
    pub fn recv_timeout(&self) -> Duration {
        self.recv_timeout
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

    /// Receive buffer overruns (ENOBUFS) seen while reading the answers of pipelined
    /// exchanges ([`Socket::exchange`]): each means the kernel dropped answers.
    pub fn overruns(&self) -> u64 {
        self.overruns
    }

    pub(crate) fn count_overrun(&mut self) {
        self.overruns += 1;
    }

    /// Sends the request buffer as one datagram. The buffer is empty afterwards, whether or
    /// not the send succeeded.
    pub fn send(&mut self) -> Result<(), Error> {
        let sent = socket::send(self.fd.as_raw_fd(), &self.sbuf, MsgFlags::empty());
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

    /// Receives one datagram, waiting for it at most [`Socket::recv_timeout`]:
    /// [`Error::Timeout`] when none came.
    pub fn recv(&mut self) -> Result<&[u8], Error> {
        self.recv_flags(MsgFlags::empty())
    }

    /// Receives one datagram if one is queued; `Error::Io` with `WouldBlock` when none is.
    pub fn try_recv(&mut self) -> Result<&[u8], Error> {
        self.recv_flags(MsgFlags::MSG_DONTWAIT)
    }

    fn recv_flags(&mut self, flags: MsgFlags) -> Result<&[u8], Error> {
        let n = loop {
            match socket::recv(
                self.fd.as_raw_fd(),
                &mut self.rbuf[..],
                flags | MsgFlags::MSG_TRUNC,
            ) {
                Ok(n) => break n,
                // A signal interrupted the wait: wait again.
                Err(Errno::EINTR) => continue,
                // SO_RCVTIMEO expired on a blocking receive.
                Err(Errno::EAGAIN) if !flags.contains(MsgFlags::MSG_DONTWAIT) => {
                    return Err(Error::Timeout {
                        what: "recv",
                        after: self.recv_timeout,
                    })
                }
                Err(e) => return Err(io_err("recv")(e)),
            }
        };
        self.rbuf
            .get(..n)
            .ok_or(Error::Truncated("datagram larger than the receive buffer"))
    }

    /// Receives (waiting) until the replies to the request numbered `seq` end, passing its
    /// data messages to `each` (see [`replies`]); returns how they ended. Each receive waits
    /// at most [`Socket::recv_timeout`] ([`Error::Timeout`]): a dump that keeps delivering
    /// datagrams is never cut short, one that stalls is.
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
