//! The read path: each owned set listed over the kernel's ipset netlink protocol
//! (`IPSET_CMD_LIST` of that set by name, on the applier's socket), members decoded in process.
//! No process, nothing printed: a set that does not exist answers `ENOENT` at once, and no
//! other set's members are read. [`Ipset::read`] falls back to `ipset list -n` + `ipset save`
//! whenever this path cannot be used or fails.

use std::collections::BTreeSet;
use std::sync::atomic::Ordering;

use super::members::{Channel, NetlinkState};
use super::Ipset;
use crate::netlink::{self as nl, consts::ENOENT, Adt, Listing};
use crate::state::IpsetState;
use crate::{Error, Result};

impl Ipset {
    /// The sets named in `owned`, listed over netlink; `None` when netlink is unavailable or
    /// the read failed (socket error, kernel refusal other than "no such set", a reply that
    /// cannot be decoded): the caller reads with `ipset save` instead. A socket error closes
    /// the channel (reopened by the next use).
    pub(super) fn read_netlink(&self, owned: &BTreeSet<&str>) -> Option<IpsetState> {
        let mut state = self.channel();
        let NetlinkState::Open(ch) = &mut *state else {
            return None;
        };
        let mut requests = 0;
        let read = list_sets(ch, owned, &mut requests);
        self.requests.fetch_add(requests, Ordering::Relaxed);
        match read {
            Ok(st) => Some(st),
            Err(e) => {
                if matches!(e, Error::Socket(_)) {
                    *state = NetlinkState::Closed;
                }
                tracing::warn!(error = %e,
                    "ipset list over netlink failed; reading with ipset save");
                None
            }
        }
    }
}

/// One LIST request per set, each answered before the next is sent (a dump holds the
/// socket until its `NLMSG_DONE`).
fn list_sets(ch: &mut Channel, owned: &BTreeSet<&str>, requests: &mut u64) -> Result<IpsetState> {
    let mut out = IpsetState::new();
    for &name in owned {
        let seq = ch.sock.next_seq();
        nl::put_list(ch.sock.buf(), seq, ch.protocol, name)?;
        ch.sock.send()?;
        *requests += 1;
        let mut listing = Listing::new(name);
        let end = ch
            .sock
            .recv_replies::<Error>(seq, |d| listing.take(d.header.ty, d.payload))?;
        match end.errno() {
            None => match listing.finish() {
                Some(set) => out.put_set(set),
                None => {
                    return Err(Error::Parse(format!(
                        "ipset list of set {name}: the kernel sent no header"
                    )))
                }
            },
            Some(ENOENT) => {}
            Some(errno) => {
                return Err(Error::Netlink(format!(
                    "list of set {name}: {}",
                    nl::error_message(Adt::Add, errno)
                )))
            }
        }
    }
    Ok(out)
}
