//! Reading nf_tables objects straight over netlink (nfnetlink, `NFNL_SUBSYS_NFTABLES`): the
//! rules of one chain and the elements of one set, as raw messages. The change checks of the
//! nftables and iptables modes (iptables-nft programs nf_tables too) look for chain names and
//! addresses in them; one dump of one chain costs the kernel a hash lookup and the chain's own
//! rules, so a check every millisecond does not load the node the way a `nft list` or
//! `iptables-save` process would.

use std::net::Ipv4Addr;

use netlink::consts::{NLM_F_DUMP, NLM_F_REQUEST};
use netlink::{put_message, Socket, SocketProtocol};

use crate::{BenchError, Res};

const NFNL_SUBSYS_NFTABLES: u16 = 10;
const NFT_MSG_GETRULE: u16 = 7;
const NFT_MSG_GETSETELEM: u16 = 13;
/// `NFTA_RULE_TABLE` = `NFTA_SET_ELEM_LIST_TABLE`.
const ATTR_TABLE: u16 = 1;
/// `NFTA_RULE_CHAIN` = `NFTA_SET_ELEM_LIST_SET`.
const ATTR_OBJECT: u16 = 2;
/// `struct nfgenmsg`: NFPROTO_IPV4, version 0, resource id 0.
const NFGENMSG_IPV4: [u8; 4] = [2, 0, 0, 0];
const ENOENT: i32 = 2;

/// A netfilter netlink socket for dumps.
pub struct Nft {
    sock: Socket,
}

impl Nft {
    /// Opens the socket (in the calling thread's network namespace).
    pub fn new() -> Res<Nft> {
        Ok(Nft {
            sock: Socket::connect(SocketProtocol::Netfilter, 4 << 20)?,
        })
    }

    fn dump(&mut self, msg: u16, table: &str, object: &str) -> Res<Vec<Vec<u8>>> {
        let seq = self.sock.next_seq();
        put_message(
            self.sock.buf(),
            (NFNL_SUBSYS_NFTABLES << 8) | msg,
            NLM_F_REQUEST | NLM_F_DUMP,
            seq,
            &NFGENMSG_IPV4,
            |w| {
                w.string(ATTR_TABLE, table);
                w.string(ATTR_OBJECT, object);
            },
        );
        self.sock.send()?;
        let mut out = Vec::new();
        let end = self.sock.recv_replies::<BenchError>(seq, |d| {
            out.push(d.payload.to_vec());
            Ok(())
        })?;
        match end.errno() {
            None => Ok(out),
            // No such table, chain or set (yet): nothing.
            Some(ENOENT) => Ok(Vec::new()),
            Some(e) => Err(BenchError::Check(format!(
                "nf_tables dump of {table} {object}: errno {e}"
            ))),
        }
    }

    /// The rules of `chain` in the IPv4 table `table`, one raw message each.
    pub fn rules(&mut self, table: &str, chain: &str) -> Res<Vec<Vec<u8>>> {
        self.dump(NFT_MSG_GETRULE, table, chain)
    }

    /// The elements of `set` in the IPv4 table `table`, as raw messages.
    pub fn set_elements(&mut self, table: &str, set: &str) -> Res<Vec<Vec<u8>>> {
        self.dump(NFT_MSG_GETSETELEM, table, set)
    }
}

/// Whether `hay` holds `needle`.
pub fn contains(hay: &[u8], needle: &[u8]) -> bool {
    !needle.is_empty() && hay.windows(needle.len()).any(|w| w == needle)
}

/// Whether `hay` holds `ip` as text, not as part of a longer number (`10.0.0.1` is not in
/// `10.0.0.12`).
pub fn contains_ip(hay: &[u8], ip: Ipv4Addr) -> bool {
    let s = ip.to_string();
    let n = s.as_bytes();
    let digit = |b: Option<&u8>| b.is_some_and(u8::is_ascii_digit);
    hay.windows(n.len()).enumerate().any(|(at, w)| {
        w == n && !digit(hay.get(at + n.len())) && (at == 0 || !digit(hay.get(at - 1)))
    })
}

/// Whether an nf_tables message holds `ip`: as text (in a chain name) or as the four bytes of
/// an address (in a map's data, e.g. `IP . port` of a dnat map).
pub fn holds_ip(hay: &[u8], ip: Ipv4Addr) -> bool {
    contains_ip(hay, ip) || contains(hay, &ip.octets())
}

/// The NUL-terminated strings in `hay` that start with `prefix` (e.g. anonymous set names
/// `__map12` in a rule's `lookup` expression).
pub fn strings_with_prefix(hay: &[u8], prefix: &[u8]) -> Vec<String> {
    let mut out = Vec::new();
    let mut from = 0;
    while let Some(pos) = hay[from..]
        .windows(prefix.len())
        .position(|w| w == prefix)
        .map(|p| p + from)
    {
        let end = hay[pos..]
            .iter()
            .position(|&b| b == 0)
            .map_or(hay.len(), |e| pos + e);
        let s = String::from_utf8_lossy(&hay[pos..end]).into_owned();
        if !out.contains(&s) {
            out.push(s);
        }
        from = end.max(pos + 1);
        if from >= hay.len() {
            break;
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn byte_searches() {
        let hay = b"x\0endpoint-A-bench/svc-1/tcp/http__10.240.0.12/8080\0__map7\0y__map12\0";
        assert!(contains_ip(hay, Ipv4Addr::new(10, 240, 0, 12)));
        assert!(!contains_ip(hay, Ipv4Addr::new(10, 240, 0, 1)));
        assert!(!contains_ip(hay, Ipv4Addr::new(0, 240, 0, 12)));
        assert!(contains(hay, b"svc-1/"));
        assert!(holds_ip(
            &[1, 10, 253, 0, 7, 0x1f, 0x90],
            Ipv4Addr::new(10, 253, 0, 7)
        ));
        assert!(!holds_ip(&[1, 10, 253, 0, 7], Ipv4Addr::new(10, 253, 0, 8)));
        assert!(!contains(hay, b""));
        assert_eq!(strings_with_prefix(hay, b"__map"), ["__map7", "__map12"]);
        assert!(strings_with_prefix(b"__ma", b"__map").is_empty());
    }
}
