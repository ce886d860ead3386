//! Blocking IPVS client over a generic netlink [`Socket`].
//!
//! Writes are pipelined with the `netlink` crate's one exchange ([`Socket::exchange`]):
//! [`Client::apply`] packs many requests into each `send`, keeps a bounded window of
//! unanswered requests (sized from the socket receive buffer so ACKs are never dropped), and
//! gets every ACK or error matched back to its request by sequence number.

use std::io;

use crate::codec::consts::{IPVS_CMD_NEW_DEST, IPVS_CMD_NEW_SERVICE, IPVS_GENL_NAME};
use crate::codec::{self, Genl};
use crate::error::{libc_errno, OpKind};
use crate::types::{Counters, Destination, Family, Info, Op, Service, ServiceKey, Timeouts};
use crate::Error;
use netlink::{Answer, End, Socket, SocketProtocol, Window};

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
    stats: bool,
}

impl Client {
    /// Opens a generic netlink socket and resolves the "IPVS" family.
    /// Returns [`Error::FamilyMissing`] when the kernel has no IPVS.
    pub fn new() -> Result<Client, Error> {
        let sock = Socket::connect(SocketProtocol::Generic, WANT_RCVBUF)?;
        let window = Window::sized(sock.rcvbuf(), BUDGET_PER_REPLY, 8192, MAX_SEND).requests;
        let mut c = Client {
            sock,
            family: 0,
            window,
            counters: Counters::default(),
            stats: true,
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

    /// Whether reads keep the kernel's traffic counters ([`Service::stats`],
    /// [`Destination::stats`]; on by default). A reader that only compares tables turns them
    /// off: at 110,000 real servers they are ~10 MB of a table read.
    pub fn set_stats(&mut self, keep: bool) {
        self.stats = keep;
    }

    /// Request counters since the client was created.
    pub fn counters(&self) -> Counters {
        Counters {
            sends: self.sock.sends(),
            overruns: self.sock.overruns(),
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

    /// Applies `ops` in order, pipelined ([`Socket::exchange`]). Returns one result per op,
    /// in the same order; a failing op (EEXIST, ENOENT, ...) does not stop the others, and
    /// neither does a failed send: the window it belonged to reports the send error for its
    /// unanswered ops and the next window starts.
    pub fn apply(&mut self, ops: &[Op]) -> Vec<Result<(), Error>> {
        let mut results: Vec<Option<Result<(), Error>>> = Vec::with_capacity(ops.len());
        results.resize_with(ops.len(), || None);
        let window = Window {
            requests: self.window,
            max_send: MAX_SEND,
        };
        let family = self.family;
        let Counters {
            requests,
            errors,
            by_op,
            ..
        } = &mut self.counters;
        let mut next = 0;
        while next < ops.len() {
            let rest = &ops[next..];
            let done = &mut results[next..];
            // One past the last op the exchange reported: where to go on after a failed send.
            let mut reported = 0;
            let mut unsent = Vec::new();
            let r = self.sock.exchange(
                rest.len(),
                window,
                |buf, seq, i| {
                    codec::put_op(buf, family, seq, &rest[i])?;
                    *requests += 1;
                    by_op.inc(codec::ipvs::op_kind(&rest[i]));
                    Ok(())
                },
                |i, answer| {
                    reported = reported.max(i + 1);
                    let op = codec::ipvs::op_kind(&rest[i]);
                    done[i] = match answer {
                        Ok(Answer::Ack) => Some(Ok(())),
                        Ok(Answer::Refused { errno }) => {
                            *errors += 1;
                            Some(Err(Error::Kernel { op, errno }))
                        }
                        Ok(Answer::Lost) => Some(Err(Error::NoReply { op })),
                        Ok(Answer::Unsent) => {
                            unsent.push(i);
                            None
                        }
                        // An op that fails to encode is never sent.
                        Err(e) => {
                            *errors += 1;
                            Some(Err(e))
                        }
                    };
                },
            );
            match r {
                Ok(()) => break,
                Err(e) => {
                    for i in unsent {
                        done[i] = Some(Err(Error::Io {
                            what: "send",
                            source: io_error_like(&e),
                        }));
                    }
                    if reported == 0 {
                        break;
                    }
                    next += reported;
                }
            }
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
        let keep_stats = self.stats;
        self.dump_with(OpKind::GetService, codec::put_dump_services, |m| {
            if m.cmd == IPVS_CMD_NEW_SERVICE {
                let mut s = codec::decode_service(m.attr_iter())?;
                if !keep_stats {
                    s.stats = None;
                }
                out.push(s);
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
        let r = r.map(|mut s| {
            if !self.stats {
                s.stats = None;
            }
            s
        });
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
        let keep_stats = self.stats;
        self.dump_with(
            OpKind::GetDest,
            |b, f, s| codec::put_dump_dests(b, f, s, key),
            |m| {
                if m.cmd == IPVS_CMD_NEW_DEST {
                    let mut d = codec::decode_dest(m.attr_iter(), family)?;
                    if !keep_stats {
                        d.stats = None;
                    }
                    out.push(d);
                }
                Ok(())
            },
        )?;
        Ok(out)
    }

    /// The whole table: one services dump, then one destinations dump per service (the
    /// kernel runs one dump at a time per socket, so these are sequential).
    pub fn dump(&mut self) -> Result<Vec<(Service, Vec<Destination>)>, Error> {
        self.dump_where(|_| true)
    }

    /// The virtual servers of one address family with their real servers: one services dump
    /// (the kernel has no per-family dump), then one destinations dump per virtual server of
    /// `family` only. A proxy of one family reads a dual-stack node's table at the cost of its
    /// own virtual servers, not of the other family's.
    pub fn dump_family(
        &mut self,
        family: Family,
    ) -> Result<Vec<(Service, Vec<Destination>)>, Error> {
        self.dump_where(|k| k.family() == family)
    }

    /// The virtual servers `keep` selects, each with its real servers.
    fn dump_where(
        &mut self,
        keep: impl Fn(&ServiceKey) -> bool,
    ) -> Result<Vec<(Service, Vec<Destination>)>, Error> {
        let services = self.services()?;
        let mut out = Vec::with_capacity(services.len());
        for s in services.into_iter().filter(|s| keep(&s.key)) {
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

/// A copy of a failed send's error for each op it left unsent (`std::io::Error` is not
/// `Clone`): the same errno, or the same kind and text.
fn io_error_like(e: &netlink::Error) -> io::Error {
    match e {
        netlink::Error::Io { source, .. } => match source.raw_os_error() {
            Some(errno) => io::Error::from_raw_os_error(errno),
            None => io::Error::new(source.kind(), source.to_string()),
        },
        other => io::Error::other(other.to_string()),
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
