//! Blocking IPVS client over a generic netlink [`Socket`].
//!
//! Writes are pipelined: [`Client::apply`] packs many requests into each `send`, keeps a
//! bounded window of unanswered requests (sized from the socket receive buffer so ACKs are
//! never dropped), and matches every ACK or error back to its request by sequence number.

use std::io;

use crate::codec::consts::{IPVS_CMD_NEW_DEST, IPVS_CMD_NEW_SERVICE, IPVS_GENL_NAME};
use crate::codec::{self, Genl};
use crate::error::{libc_errno, OpKind};
use crate::netlink::{End, Pending, Socket, SocketProtocol};
use crate::types::{Counters, Destination, Info, Op, Service, ServiceKey, Timeouts};
use crate::Error;

/// Largest request datagram we build (the kernel limit is the socket send buffer).
const MAX_SEND: usize = 64 * 1024;
/// Receive buffer size we ask for (capped by `net.core.rmem_max`).
const WANT_RCVBUF: usize = 8 * 1024 * 1024;
/// Receive-buffer budget per unanswered request (an ACK's or error's skb truesize is below this).
const BUDGET_PER_REPLY: usize = 3072;

/// A blocking IPVS client. One netlink socket, family resolved once.
pub struct Client {
    sock: Socket,
    family: u16,
    window: usize,
    counters: Counters,
}

impl Client {
    /// Opens a generic netlink socket and resolves the "IPVS" family.
    /// Returns [`Error::FamilyMissing`] when the kernel has no IPVS.
    pub fn new() -> Result<Client, Error> {
        let sock = Socket::connect(SocketProtocol::Generic, WANT_RCVBUF)?;
        let window = (sock.rcvbuf() / BUDGET_PER_REPLY).clamp(16, 8192);
        let mut c = Client {
            sock,
            family: 0,
            window,
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
        Counters {
            sends: self.sock.sends(),
            ..self.counters
        }
    }

    /// Sends the one request `put` appends (given the family id and a sequence number);
    /// returns its sequence number.
    fn send_one(
        &mut self,
        op: OpKind,
        put: impl FnOnce(&mut Vec<u8>, u16, u32),
    ) -> Result<u32, Error> {
        let seq = self.sock.next_seq();
        put(self.sock.buf(), self.family, seq);
        self.sock.send()?;
        self.counters.requests += 1;
        self.counters.by_op.inc(op);
        Ok(seq)
    }

    /// Receives until the replies to request `seq` end, passing every data message to `each`.
    fn recv_replies(
        &mut self,
        seq: u32,
        mut each: impl FnMut(Genl<'_>) -> Result<(), Error>,
    ) -> Result<End, Error> {
        self.sock.recv_replies(seq, |d| each(Genl::parse(d)?))
    }

    fn resolve_family(&mut self) -> Result<u16, Error> {
        let seq = self.send_one(OpKind::ResolveFamily, |b, _, seq| {
            codec::put_get_family(b, seq, IPVS_GENL_NAME)
        })?;
        let mut family = None;
        let end = self.recv_replies(seq, |m| {
            family = Some(codec::netlink::decode_family_id(m.attr_iter())?);
            Ok(())
        })?;
        match end.errno() {
            None => family.ok_or(Error::NoReply {
                op: OpKind::ResolveFamily,
            }),
            Some(libc_errno::ENOENT) => Err(Error::FamilyMissing),
            Some(errno) => Err(Error::Kernel {
                op: OpKind::ResolveFamily,
                errno,
            }),
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
            let base_seq = self.sock.seq().wrapping_add(1);
            let mut in_window: Vec<usize> = Vec::with_capacity(self.window.min(ops.len() - next));
            let mut send_failed = None;
            while next < ops.len() && in_window.len() < self.window {
                // An op that fails to encode does not use up a sequence number, so the
                // window's numbers stay contiguous from `base_seq`.
                let seq = self.sock.seq().wrapping_add(1);
                let before = self.sock.buf().len();
                match codec::put_op(self.sock.buf(), self.family, seq, &ops[next]) {
                    Ok(()) => {
                        self.sock.next_seq();
                        in_window.push(next);
                        self.counters.requests += 1;
                        self.counters.by_op.inc(codec::ipvs::op_kind(&ops[next]));
                    }
                    Err(e) => {
                        self.sock.buf().truncate(before);
                        results[next] = Some(Err(e));
                        self.counters.errors += 1;
                        next += 1;
                        continue;
                    }
                }
                next += 1;
                if self.sock.buf().len() >= MAX_SEND {
                    if let Err(e) = self.sock.send() {
                        send_failed = Some(e);
                        break;
                    }
                }
            }
            if send_failed.is_none() && !self.sock.buf().is_empty() {
                if let Err(e) = self.sock.send() {
                    send_failed = Some(e);
                }
            }
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
        let mut pending = Pending::new(base_seq, in_window.len());
        while pending.left() > 0 {
            let datagram = match self.sock.try_recv() {
                Ok(d) => d,
                // The overrun is reported once; the replies that fit are still queued.
                Err(e) if e.is_overrun() => {
                    self.counters.overruns += 1;
                    continue;
                }
                Err(_) => break,
            };
            // A malformed message ends this datagram; the next one is still read.
            let _ = pending.take(datagram, |i, result| {
                let op_idx = in_window[i];
                results[op_idx] = Some(result.map_err(|errno| {
                    self.counters.errors += 1;
                    Error::Kernel {
                        op: codec::ipvs::op_kind(&ops[op_idx]),
                        errno,
                    }
                }));
            });
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

    /// Runs a dump whose request `put` appends, calling `each` on every data message. The
    /// dump is read to its end even when `each` fails; the first failure is returned.
    fn dump_with(
        &mut self,
        op: OpKind,
        put: impl FnOnce(&mut Vec<u8>, u16, u32),
        mut each: impl FnMut(&Genl<'_>) -> Result<(), Error>,
    ) -> Result<(), Error> {
        let seq = self.send_one(op, put)?;
        self.counters.dumps += 1;
        let mut first_err = None;
        let end = self.recv_replies(seq, |m| {
            if first_err.is_none() {
                first_err = each(&m).err();
            }
            Ok(())
        })?;
        if let End::Error { errno } = end {
            return Err(Error::Kernel { op, errno });
        }
        if let Some(e) = first_err {
            return Err(e);
        }
        end.errno()
            .map_or(Ok(()), |errno| Err(Error::Kernel { op, errno }))
    }

    /// Runs a request that has one data reply (GET_INFO, GET_CONFIG, GET_SERVICE).
    fn get_one<T>(
        &mut self,
        op: OpKind,
        put: impl FnOnce(&mut Vec<u8>, u16, u32),
        decode: impl Fn(&Genl<'_>) -> Result<T, Error>,
    ) -> Result<T, Error> {
        let seq = self.send_one(op, put)?;
        let mut value = None;
        let end = self.recv_replies(seq, |m| {
            value = Some(decode(&m)?);
            Ok(())
        })?;
        match end.errno() {
            None => value.ok_or(Error::NoReply { op }),
            Some(errno) => Err(Error::Kernel { op, errno }),
        }
    }

    /// Every virtual server, in the kernel's order.
    pub fn services(&mut self) -> Result<Vec<Service>, Error> {
        let mut out = Vec::new();
        self.dump_with(OpKind::GetService, codec::put_dump_services, |m| {
            if m.cmd == IPVS_CMD_NEW_SERVICE {
                out.push(codec::decode_service(m.attr_iter())?);
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
                if m.cmd == IPVS_CMD_NEW_DEST {
                    out.push(codec::decode_dest(m.attr_iter(), family)?);
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
