//! Blocking IPVS client over a generic netlink socket (neli owns the socket).
//!
//! Writes are pipelined: [`Client::apply`] packs many requests into each `send`, keeps a
//! bounded window of unanswered requests (sized from the socket receive buffer so ACKs are
//! never dropped), and matches every ACK or error back to its request by sequence number.

use std::io;

use neli::consts::socket::{Msg, NlFamily};
use neli::socket::NlSocket;
use neli::utils::Groups;

use crate::codec::consts::{IPVS_CMD_NEW_DEST, IPVS_CMD_NEW_SERVICE, IPVS_GENL_NAME};
use crate::codec::{self, Reply};
use crate::error::{libc_errno, OpKind};
use crate::types::{Counters, Destination, Info, Op, Service, ServiceKey, Timeouts};
use crate::Error;

/// Largest request datagram we build (the kernel limit is the socket send buffer).
const MAX_SEND: usize = 64 * 1024;
/// Receive buffer size we ask for (capped by `net.core.rmem_max`).
const WANT_RCVBUF: usize = 8 * 1024 * 1024;
/// Receive-buffer budget per unanswered request (an ACK's or error's skb truesize is below this).
const BUDGET_PER_REPLY: usize = 3072;
/// Receive buffer for one datagram; kernel dump datagrams are at most 32 KiB.
const RECV_BUF: usize = 128 * 1024;
const ENOBUFS: i32 = 105;

/// A blocking IPVS client. One netlink socket, family resolved once.
pub struct Client {
    sock: NlSocket,
    family: u16,
    seq: u32,
    window: usize,
    sbuf: Vec<u8>,
    rbuf: Vec<u8>,
    counters: Counters,
}

fn io_err(what: &'static str) -> impl FnOnce(io::Error) -> Error {
    move |source| Error::Io { what, source }
}

fn effective_rcvbuf() -> usize {
    let max = std::fs::read_to_string("/proc/sys/net/core/rmem_max")
        .ok()
        .and_then(|s| s.trim().parse::<usize>().ok())
        .unwrap_or(212_992);
    // The kernel doubles the requested value for bookkeeping.
    WANT_RCVBUF.min(max) * 2
}

impl Client {
    /// Opens a generic netlink socket and resolves the "IPVS" family.
    /// Returns [`Error::FamilyMissing`] when the kernel has no IPVS.
    pub fn new() -> Result<Client, Error> {
        let sock = NlSocket::connect(NlFamily::Generic, None, Groups::empty())
            .map_err(io_err("connect"))?;
        sock.set_recv_buffer_size(WANT_RCVBUF)
            .map_err(io_err("set SO_RCVBUF"))?;
        let window = (effective_rcvbuf() / BUDGET_PER_REPLY).clamp(16, 8192);
        let mut c = Client {
            sock,
            family: 0,
            seq: std::process::id().wrapping_mul(7919),
            window,
            sbuf: Vec::with_capacity(MAX_SEND + 1024),
            rbuf: vec![0; RECV_BUF],
            counters: Counters::default(),
        };
        c.family = c.resolve_family()?;
        Ok(c)
    }

    /// The generic netlink family id of IPVS on this kernel.
    pub fn family_id(&self) -> u16 {
        self.family
    }

    /// Maximum number of unanswered requests in flight during [`Client::apply`].
    pub fn window(&self) -> usize {
        self.window
    }

    /// Sets the maximum number of unanswered requests per window (at least 1). The default is
    /// sized from the receive buffer so replies are never dropped; larger values risk
    /// [`Error::NoReply`] results (the kernel drops replies that do not fit).
    pub fn set_window(&mut self, window: usize) {
        self.window = window.max(1);
    }

    /// Request counters since the client was created.
    pub fn counters(&self) -> Counters {
        self.counters
    }

    fn next_seq(&mut self) -> u32 {
        self.seq = self.seq.wrapping_add(1);
        self.seq
    }

    fn send_buf(&mut self) -> Result<(), Error> {
        let n = self
            .sock
            .send(&self.sbuf, Msg::empty())
            .map_err(io_err("send"))?;
        self.counters.sends += 1;
        if n != self.sbuf.len() {
            return Err(Error::Io {
                what: "send",
                source: io::Error::new(io::ErrorKind::WriteZero, "short netlink send"),
            });
        }
        self.sbuf.clear();
        Ok(())
    }

    /// Receives one datagram into `rbuf`; returns its length.
    fn recv_one(&mut self, flags: Msg) -> Result<usize, Error> {
        let (n, _) = self
            .sock
            .recv(&mut self.rbuf[..], flags | Msg::TRUNC)
            .map_err(io_err("recv"))?;
        if n > self.rbuf.len() {
            return Err(Error::Truncated("datagram larger than the receive buffer"));
        }
        Ok(n)
    }

    fn resolve_family(&mut self) -> Result<u16, Error> {
        let seq = self.next_seq();
        self.sbuf.clear();
        codec::put_get_family(&mut self.sbuf, seq, IPVS_GENL_NAME);
        self.send_buf()?;
        self.counters.requests += 1;
        let mut family = None;
        loop {
            let n = self.recv_one(Msg::empty())?;
            for m in codec::messages(&self.rbuf[..n]) {
                match m? {
                    Reply::Data { header, attrs, .. } if header.seq == seq => {
                        family = Some(codec::netlink::decode_family_id(codec::AttrIter::new(
                            attrs,
                        ))?);
                    }
                    Reply::Ack { seq: s } if s == seq => {
                        return family.ok_or(Error::NoReply {
                            op: OpKind::ResolveFamily,
                        });
                    }
                    Reply::Error { seq: s, errno } if s == seq => {
                        return Err(if errno == libc_errno::ENOENT {
                            Error::FamilyMissing
                        } else {
                            Error::Kernel {
                                op: OpKind::ResolveFamily,
                                errno,
                            }
                        });
                    }
                    _ => {}
                }
            }
        }
    }

    /// Applies `ops` in order, pipelined. Returns one result per op, in the same order; a
    /// failing op (EEXIST, ENOENT, ...) does not stop the others.
    pub fn apply(&mut self, ops: &[Op]) -> Vec<Result<(), Error>> {
        let mut results: Vec<Option<Result<(), Error>>> = Vec::with_capacity(ops.len());
        results.resize_with(ops.len(), || None);
        let mut next = 0;
        while next < ops.len() {
            // Build and send one window.
            let base_seq = self.seq.wrapping_add(1);
            let mut in_window: Vec<usize> = Vec::with_capacity(self.window.min(ops.len() - next));
            self.sbuf.clear();
            let mut send_failed = None;
            while next < ops.len() && in_window.len() < self.window {
                let seq = base_seq.wrapping_add(u32::try_from(in_window.len()).unwrap_or(0));
                let before = self.sbuf.len();
                match codec::put_op(&mut self.sbuf, self.family, seq, &ops[next]) {
                    Ok(()) => {
                        self.seq = seq;
                        in_window.push(next);
                        self.counters.requests += 1;
                    }
                    Err(e) => {
                        self.sbuf.truncate(before);
                        results[next] = Some(Err(e));
                        self.counters.errors += 1;
                        next += 1;
                        continue;
                    }
                }
                next += 1;
                if self.sbuf.len() >= MAX_SEND {
                    if let Err(e) = self.send_buf() {
                        send_failed = Some(e);
                        break;
                    }
                }
            }
            if send_failed.is_none() && !self.sbuf.is_empty() {
                if let Err(e) = self.send_buf() {
                    send_failed = Some(e);
                }
            }
            self.sbuf.clear();
            if let Some(e) = send_failed {
                // Requests of this window may or may not have been sent; collect what the
                // kernel answered, the rest fail with the send error.
                self.drain_window(base_seq, &in_window, ops, &mut results);
                let msg = e.to_string();
                for &i in &in_window {
                    if results[i].is_none() {
                        results[i] = Some(Err(Error::Io {
                            what: "send",
                            source: io::Error::other(msg.clone()),
                        }));
                    }
                }
                continue;
            }
            self.drain_window(base_seq, &in_window, ops, &mut results);
        }
        results
            .into_iter()
            .zip(ops)
            .map(|(r, op)| {
                r.unwrap_or(Err(Error::NoReply {
                    op: codec::ipvs::op_kind(op),
                }))
            })
            .collect()
    }

    /// Collects the ACKs/errors of a window that has been sent.
    ///
    /// The kernel processes generic netlink requests synchronously inside `send`, so when the
    /// sends have returned every reply is already queued on the socket (or was dropped because
    /// the receive buffer overflowed). Reading without blocking therefore cannot hang: a reply
    /// still missing when the queue is empty was lost, and its op reports [`Error::NoReply`].
    fn drain_window(
        &mut self,
        base_seq: u32,
        in_window: &[usize],
        ops: &[Op],
        results: &mut [Option<Result<(), Error>>],
    ) {
        let mut pending = in_window.len();
        while pending > 0 {
            let n = match self.recv_one(Msg::DONTWAIT) {
                Ok(n) => n,
                // The overrun is reported once; the replies that fit are still queued.
                Err(Error::Io { source, .. }) if source.raw_os_error() == Some(ENOBUFS) => {
                    self.counters.overruns += 1;
                    continue;
                }
                Err(_) => break,
            };
            for m in codec::messages(&self.rbuf[..n]) {
                let Ok(m) = m else { break };
                let (seq, res) = match m {
                    Reply::Ack { seq } => (seq, Ok(())),
                    Reply::Error { seq, errno } => (seq, Err(errno)),
                    _ => continue,
                };
                let idx = usize::try_from(seq.wrapping_sub(base_seq)).unwrap_or(usize::MAX);
                let Some(&op_idx) = in_window.get(idx) else {
                    continue;
                };
                if results[op_idx].is_some() {
                    continue;
                }
                results[op_idx] = Some(res.map_err(|errno| {
                    self.counters.errors += 1;
                    Error::Kernel {
                        op: codec::ipvs::op_kind(&ops[op_idx]),
                        errno,
                    }
                }));
                pending -= 1;
            }
        }
    }

    /// Applies one op (a batch of one).
    pub fn apply_one(&mut self, op: &Op) -> Result<(), Error> {
        self.apply(std::slice::from_ref(op))
            .pop()
            .unwrap_or(Err(Error::NoReply {
                op: codec::ipvs::op_kind(op),
            }))
    }

    /// Runs a dump whose request `put` appends, calling `each` on every data message.
    fn dump_with(
        &mut self,
        op: OpKind,
        put: impl FnOnce(&mut Vec<u8>, u16, u32),
        mut each: impl FnMut(&Reply<'_>) -> Result<(), Error>,
    ) -> Result<(), Error> {
        let seq = self.next_seq();
        self.sbuf.clear();
        put(&mut self.sbuf, self.family, seq);
        self.send_buf()?;
        self.counters.requests += 1;
        self.counters.dumps += 1;
        let mut first_err = None;
        loop {
            let n = self.recv_one(Msg::empty())?;
            for m in codec::messages(&self.rbuf[..n]) {
                let m = m?;
                if m.seq() != seq {
                    continue;
                }
                match m {
                    Reply::Data { .. } => {
                        if first_err.is_none() {
                            if let Err(e) = each(&m) {
                                first_err = Some(e);
                            }
                        }
                    }
                    Reply::Done { errno, .. } => {
                        if let Some(e) = first_err {
                            return Err(e);
                        }
                        return if errno == 0 {
                            Ok(())
                        } else {
                            Err(Error::Kernel { op, errno })
                        };
                    }
                    Reply::Error { errno, .. } => return Err(Error::Kernel { op, errno }),
                    Reply::Ack { .. } => {
                        if let Some(e) = first_err {
                            return Err(e);
                        }
                        return Ok(());
                    }
                    Reply::Other { .. } => {}
                }
            }
        }
    }

    /// Runs a request that has one data reply (GET_INFO, GET_CONFIG, GET_SERVICE).
    fn get_one<T>(
        &mut self,
        op: OpKind,
        put: impl FnOnce(&mut Vec<u8>, u16, u32),
        decode: impl Fn(&Reply<'_>) -> Result<T, Error>,
    ) -> Result<T, Error> {
        let seq = self.next_seq();
        self.sbuf.clear();
        put(&mut self.sbuf, self.family, seq);
        self.send_buf()?;
        self.counters.requests += 1;
        let mut value = None;
        loop {
            let n = self.recv_one(Msg::empty())?;
            for m in codec::messages(&self.rbuf[..n]) {
                let m = m?;
                if m.seq() != seq {
                    continue;
                }
                match m {
                    Reply::Data { .. } => value = Some(decode(&m)?),
                    Reply::Ack { .. } | Reply::Done { errno: 0, .. } => {
                        return value.ok_or(Error::NoReply { op });
                    }
                    Reply::Error { errno, .. } | Reply::Done { errno, .. } => {
                        return Err(Error::Kernel { op, errno })
                    }
                    Reply::Other { .. } => {}
                }
            }
        }
    }

    /// Every virtual server, in the kernel's order.
    pub fn services(&mut self) -> Result<Vec<Service>, Error> {
        let mut out = Vec::new();
        self.dump_with(OpKind::GetService, codec::put_dump_services, |m| {
            if let Reply::Data { cmd, .. } = m {
                if *cmd == IPVS_CMD_NEW_SERVICE {
                    out.push(codec::decode_service(m.attr_iter())?);
                }
            }
            Ok(())
        })?;
        Ok(out)
    }

    /// One virtual server; `Ok(None)` when it does not exist.
    pub fn service(&mut self, key: &ServiceKey) -> Result<Option<Service>, Error> {
        let r = self.get_one(
            OpKind::GetService,
            |b, f, s| codec::put_get_service(b, f, s, key),
            |m| codec::decode_service(m.attr_iter()),
        );
        match r {
            Ok(s) => Ok(Some(s)),
            Err(e) if e.is_not_found() => Ok(None),
            Err(e) => Err(e),
        }
    }

    /// The real servers of one virtual server, in the kernel's order (empty when the service
    /// does not exist: the kernel's dump does not report that case).
    pub fn destinations(&mut self, key: &ServiceKey) -> Result<Vec<Destination>, Error> {
        let mut out = Vec::new();
        let family = key.family();
        self.dump_with(
            OpKind::GetDest,
            |b, f, s| codec::put_dump_dests(b, f, s, key),
            |m| {
                if let Reply::Data { cmd, .. } = m {
                    if *cmd == IPVS_CMD_NEW_DEST {
                        out.push(codec::decode_dest(m.attr_iter(), family)?);
                    }
                }
                Ok(())
            },
        )?;
        Ok(out)
    }

    /// The whole table: one services dump, then one destinations dump per service (the
    /// kernel runs one dump at a time per socket, so these are sequential).
    pub fn dump(&mut self) -> Result<Vec<(Service, Vec<Destination>)>, Error> {
        let services = self.services()?;
        let mut out = Vec::with_capacity(services.len());
        for s in services {
            let d = self.destinations(&s.key)?;
            out.push((s, d));
        }
        Ok(out)
    }

    /// IPVS version and connection table size.
    pub fn info(&mut self) -> Result<Info, Error> {
        self.get_one(OpKind::GetInfo, codec::put_get_info, |m| {
            codec::decode_info(m.attr_iter())
        })
    }

    /// Connection timeouts (tcp, tcp_fin, udp).
    pub fn timeouts(&mut self) -> Result<Timeouts, Error> {
        self.get_one(OpKind::GetConfig, codec::put_get_config, |m| {
            codec::decode_timeouts(m.attr_iter())
        })
    }

    /// Deletes every virtual server.
    pub fn flush(&mut self) -> Result<(), Error> {
        self.apply_one(&Op::Flush)
    }
}

#[cfg(test)]
mod tests {
    use super::Client;

    #[test]
    fn client_is_send() {
        fn assert_send<T: Send>() {}
        assert_send::<Client>();
    }
}
