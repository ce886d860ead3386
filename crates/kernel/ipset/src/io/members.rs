//! The member path: adds and deletes of set members as pipelined requests over the kernel's
//! ipset netlink protocol, on a socket opened (and the protocol version agreed) once per
//! applier; [`Ipset::apply`] falls back to `ipset restore` whenever this path cannot be used.

use std::path::PathBuf;
use std::sync::atomic::Ordering;
use std::sync::MutexGuard;

use netlink::{Answer, Socket, SocketProtocol, Window};

use super::{rejected, ApplyReport, Ipset};
use crate::netlink::{self as nl, Adt};
use crate::state::{IpsetDiff, LineOrigin};
use crate::{Error, Result};

/// Receive buffer asked for the ipset netlink socket (capped by `net.core.rmem_max`).
const WANT_RCVBUF: usize = 1024 * 1024;
/// Receive-buffer budget per unanswered request: an error reply echoes the request (~100
/// bytes); its skb truesize stays below this.
const BUDGET_PER_REPLY: usize = 3072;
/// A request datagram is sent once it holds this many bytes (a window of member requests,
/// ~100 bytes each, stays below it).
const MAX_SEND: usize = 64 * 1024;

/// The netlink side of an applier: a socket in the runner's namespace and the protocol
/// version agreed with the kernel.
pub(super) struct Channel {
    pub(super) sock: Socket,
    pub(super) protocol: u8,
    window: usize,
}

/// Whether the netlink path can be used.
pub(super) enum NetlinkState {
    /// Not opened yet (or dropped after a socket error: reopened on the next apply).
    Closed,
    /// Open and probed.
    Open(Channel),
    /// The kernel cannot be spoken to over netlink (no common protocol version, or the
    /// namespace cannot be entered): every apply uses `ipset restore`.
    Unavailable,
}

impl Ipset {
    /// The netlink path; `None` when netlink is unavailable or the socket failed (nothing is
    /// known to be lost: ADD/DEL with `-exist` semantics can be sent again with restore).
    pub(super) fn apply_netlink(&self, lines: &[LineOrigin<'_>]) -> Option<ApplyReport> {
        let mut state = self.channel();
        let NetlinkState::Open(ch) = &mut *state else {
            return None;
        };
        let mut report = ApplyReport {
            lines: lines.len(),
            ..ApplyReport::default()
        };
        match send_members(ch, lines, &mut report) {
            Ok(()) => {
                self.requests.fetch_add(report.requests, Ordering::Relaxed);
                Some(report)
            }
            Err(e) => {
                self.requests.fetch_add(report.requests, Ordering::Relaxed);
                tracing::warn!(error = %e, "ipset netlink failed; applying with ipset restore");
                *state = NetlinkState::Closed;
                None
            }
        }
    }

    /// The netlink state, locked, with the socket opened and probed first if it is closed
    /// (the one way the read, apply and prepare paths get at it).
    pub(super) fn channel(&self) -> MutexGuard<'_, NetlinkState> {
        let mut state = self.netlink.lock().unwrap_or_else(|e| e.into_inner());
        if matches!(*state, NetlinkState::Closed) {
            *state = self.open_channel();
        }
        state
    }

    /// Opens and probes the netlink socket in the runner's namespace.
    fn open_channel(&self) -> NetlinkState {
        let opened = match &self.runner.exec.netns {
            None => Socket::connect(SocketProtocol::Netfilter, WANT_RCVBUF).map_err(Error::from),
            Some(ns) => socket_in_netns(ns),
        };
        let mut sock = match opened {
            Ok(s) => s,
            Err(e) => {
                tracing::warn!(error = %e, "ipset over netlink unavailable; using ipset restore");
                return NetlinkState::Unavailable;
            }
        };
        self.requests.fetch_add(1, Ordering::Relaxed);
        match probe_protocol(&mut sock) {
            Ok(protocol) => {
                let window =
                    Window::sized(sock.rcvbuf(), BUDGET_PER_REPLY, 8192, MAX_SEND).requests;
                NetlinkState::Open(Channel {
                    sock,
                    protocol,
                    window,
                })
            }
            Err(e) => {
                tracing::warn!(error = %e, "ipset over netlink unavailable; using ipset restore");
                NetlinkState::Unavailable
            }
        }
    }
}

/// Whether [`Ipset::apply`] with threshold `max` sends the members of `diff` over netlink (when
/// the kernel can be spoken to): between 1 and `max` members and no set destroyed (a diff that
/// destroys a set is one `ipset restore`, members included). Sets created or recreated by such
/// a diff still take one `ipset restore`, before the members. Pure, so in-memory kernels can
/// count requests and processes the way the real applier does.
pub fn netlink_eligible(diff: &IpsetDiff, max: usize) -> bool {
    let members = diff.adds.len() + diff.dels.len();
    diff.destroys.is_empty() && members > 0 && members <= max
}

/// Opens a netfilter netlink socket inside the named namespace (`/run/netns/NAME`), from a
/// helper thread that enters it: a socket stays in the namespace it was created in.
fn socket_in_netns(ns: &str) -> Result<Socket> {
    let path = if ns.contains('/') {
        PathBuf::from(ns)
    } else {
        PathBuf::from("/run/netns").join(ns)
    };
    let file = std::fs::File::open(&path)
        .map_err(|e| Error::Netlink(format!("open {}: {e}", path.display())))?;
    std::thread::spawn(move || {
        nix::sched::setns(&file, nix::sched::CloneFlags::CLONE_NEWNET)
            .map_err(|e| Error::Netlink(format!("setns: {e}")))?;
        Socket::connect(SocketProtocol::Netfilter, WANT_RCVBUF).map_err(Error::from)
    })
    .join()
    .map_err(|_| Error::Netlink("netns helper thread panicked".into()))?
}

/// Sends `IPSET_CMD_PROTOCOL` and agrees on a version.
fn probe_protocol(sock: &mut Socket) -> Result<u8> {
    let seq = sock.next_seq();
    nl::put_protocol(sock.buf(), seq);
    sock.send()?;
    loop {
        let datagram = sock.recv()?;
        match nl::protocol_answer(datagram, seq)? {
            None => continue,
            Some(Err(errno)) => {
                return Err(Error::KernelSupport(format!(
                    "the kernel refused the ipset protocol probe: {}",
                    nl::error_message(Adt::Add, errno)
                )))
            }
            Some(Ok(kernel)) => {
                return nl::negotiate(kernel).ok_or_else(|| {
                    Error::KernelSupport(format!(
                        "kernel ipset protocol versions {}..{} do not include {}..{}",
                        kernel.1,
                        kernel.0,
                        nl::consts::IPSET_PROTOCOL_MIN,
                        nl::consts::IPSET_PROTOCOL
                    ))
                })
            }
        }
    }
}

/// Sends one ADD/DEL per member line with the netlink crate's pipelined exchange (a window of
/// requests at a time), and records each rejected member. A socket error is returned (the
/// caller falls back to restore).
fn send_members(
    ch: &mut Channel,
    lines: &[LineOrigin<'_>],
    report: &mut ApplyReport,
) -> Result<()> {
    let member = |i: usize| match lines[i] {
        LineOrigin::Add(c) => Some((Adt::Add, c)),
        LineOrigin::Del(c) => Some((Adt::Del, c)),
        _ => None,
    };
    // Not eligible for netlink; `netlink_eligible` keeps these out.
    if let Some(i) = (0..lines.len()).find(|&i| member(i).is_none()) {
        return Err(Error::Netlink(format!(
            "not a member line: {:?}",
            lines[i].to_string()
        )));
    }
    let window = Window {
        requests: ch.window,
        max_send: MAX_SEND,
    };
    let protocol = ch.protocol;
    let mut requests = 0;
    let sent = ch.sock.exchange(
        lines.len(),
        window,
        |buf, seq, i| match member(i) {
            Some((adt, c)) => {
                nl::put_adt(buf, adt, seq, protocol, &c.set, &c.entry)?;
                requests += 1;
                Ok(())
            }
            None => Err(Error::Netlink(format!(
                "not a member line: {:?}",
                lines[i].to_string()
            ))),
        },
        |i, answer| {
            let origin = &lines[i];
            let message = match (answer, member(i)) {
                (Err(e), _) => {
                    report.rejected.push(rejected(origin, e.to_string()));
                    return;
                }
                (Ok(Answer::Ack), _) => return,
                (Ok(Answer::Refused { errno }), _) if nl::answer_ok(Err(errno)) => return,
                (Ok(Answer::Refused { errno }), Some((adt, _))) => nl::error_message(adt, errno),
                // The send failed: the error is returned and the caller falls back to restore.
                (Ok(Answer::Unsent), _) => return,
                _ => "no answer from the kernel (netlink receive buffer overrun)".to_string(),
            };
            let r = rejected(origin, message);
            tracing::warn!(set = %r.set, line = %r.line, owner = %r.owner,
                message = %r.message, "kernel rejected an ipset member");
            report.rejected.push(r);
        },
    );
    report.requests += requests;
    Ok(sent?)
}
