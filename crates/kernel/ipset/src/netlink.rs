//! The kernel's ipset netlink protocol (nfnetlink subsystem `NFNL_SUBSYS_IPSET`), pure: the
//! requests this crate sends (the protocol probe, ADD / DEL of one member, LIST of one set) and
//! the reading of their replies ([`Listing`] turns one set's dump into its state). No IO;
//! [`crate::Ipset`] sends these over the shared netlink socket of the `netlink` crate, with its
//! pipelined exchange.
//!
//! Every request is encoded the way ipset(8) 7.17 (libipset) encodes it, checked byte for byte
//! against its requests captured with `strace` (see the tests): `IPSET_ATTR_PROTOCOL`, then
//! `IPSET_ATTR_SETNAME`, then `IPSET_ATTR_DATA` (nested) holding the member's attributes in
//! libipset's order (IP, PORT, PROTO, IP2, CIDR2, LINENO). Addresses are nested
//! `IPSET_ATTR_IPADDR_IPV4` / `IPSET_ATTR_IPADDR_IPV6` in network byte order with
//! `NLA_F_NET_BYTEORDER`, ports are big-endian with `NLA_F_NET_BYTEORDER`: the kernel rejects
//! the nested attributes without `NLA_F_NESTED` and the addresses and ports without the byte
//! order flag (`IPSET_ERR_PROTOCOL`).
//!
//! Requests never carry `NLM_F_EXCL`: the kernel then treats "already added" (ADD) and "not
//! added" (DEL) as success, which is exactly what `ipset restore -exist` asks for.

use std::collections::BTreeMap;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::sync::Arc;

use ::netlink::consts::{NLA_F_NESTED, NLM_F_ACK, NLM_F_DUMP, NLM_F_REQUEST};
use ::netlink::{messages, put_message, AttrIter, AttrWriter, Message};

use crate::entry::{Entry, Protocol};
use crate::set::{Family, SetSpec, SetType, MAX_NAME_LEN};
use crate::state::SetState;
use crate::Error;

/// Numbers from `include/uapi/linux/netfilter/nfnetlink.h`,
/// `include/uapi/linux/netfilter/ipset/ip_set.h` (with `ip_set_hash.h`, `ip_set_bitmap.h`) and
/// `include/uapi/linux/netlink.h` (Linux 6.x; the same values since protocol 6, Linux 3.x).
pub mod consts {
    /// `NFNL_SUBSYS_IPSET` (nfnetlink.h): the high byte of `nlmsg_type`.
    pub const NFNL_SUBSYS_IPSET: u16 = 6;
    /// `NFNETLINK_V0` (nfnetlink.h): `nfgenmsg.version`.
    pub const NFNETLINK_V0: u8 = 0;
    /// `AF_INET`: the `nfgenmsg.nfgen_family` libipset sends with every ipset request (the
    /// kernel ignores it for ipset).
    pub const AF_INET: u8 = 2;
    /// `NLA_F_NET_BYTEORDER` (netlink.h): the payload is in network byte order.
    pub const NLA_F_NET_BYTEORDER: u16 = 1 << 14;

    /// `IPSET_PROTOCOL`: the protocol version this crate speaks (ip_set.h: 7).
    pub const IPSET_PROTOCOL: u8 = 7;
    /// `IPSET_PROTOCOL_MIN`: the oldest version a kernel may accept (ip_set.h: 6). ADD and DEL
    /// are encoded identically in versions 6 and 7.
    pub const IPSET_PROTOCOL_MIN: u8 = 6;
    /// `IPSET_MAXNAMELEN`: set names including the NUL.
    pub const IPSET_MAXNAMELEN: usize = 32;

    /// `IPSET_CMD_PROTOCOL` (1): return the kernel's protocol versions.
    pub const IPSET_CMD_PROTOCOL: u8 = 1;
    /// `IPSET_CMD_LIST` (7): dump a set's header and members (`NLM_F_DUMP`).
    pub const IPSET_CMD_LIST: u8 = 7;
    /// `IPSET_CMD_ADD` (9): add an element to a set.
    pub const IPSET_CMD_ADD: u8 = 9;
    /// `IPSET_CMD_DEL` (10): delete an element from a set.
    pub const IPSET_CMD_DEL: u8 = 10;

    /// `IPSET_ATTR_PROTOCOL` (1, u8), command level.
    pub const IPSET_ATTR_PROTOCOL: u16 = 1;
    /// `IPSET_ATTR_SETNAME` (2, string), command level.
    pub const IPSET_ATTR_SETNAME: u16 = 2;
    /// `IPSET_ATTR_TYPENAME` (3, string), command level (LIST reply).
    pub const IPSET_ATTR_TYPENAME: u16 = 3;
    /// `IPSET_ATTR_REVISION` (4, u8), command level (LIST reply).
    pub const IPSET_ATTR_REVISION: u16 = 4;
    /// `IPSET_ATTR_FAMILY` (5, u8: `NFPROTO_*`), command level (LIST reply).
    pub const IPSET_ATTR_FAMILY: u16 = 5;
    /// `IPSET_ATTR_DATA` (7, nested), command level.
    pub const IPSET_ATTR_DATA: u16 = 7;
    /// `IPSET_ATTR_ADT` (8, nested: one `IPSET_ATTR_DATA` per member), command level (LIST
    /// reply).
    pub const IPSET_ATTR_ADT: u16 = 8;
    /// `IPSET_ATTR_LINENO` (9, u32), command level and (as `IPSET_ATTR_CADT_LINENO`) in DATA.
    pub const IPSET_ATTR_LINENO: u16 = 9;
    /// `IPSET_ATTR_PROTOCOL_MIN` (10, u8), command level (protocol reply).
    pub const IPSET_ATTR_PROTOCOL_MIN: u16 = 10;

    /// `IPSET_ATTR_IP` (1, nested address), in DATA.
    pub const IPSET_ATTR_IP: u16 = 1;
    /// `IPSET_ATTR_CIDR` (3, u8), in DATA.
    pub const IPSET_ATTR_CIDR: u16 = 3;
    /// `IPSET_ATTR_PORT` (4, be16), in DATA.
    pub const IPSET_ATTR_PORT: u16 = 4;
    /// `IPSET_ATTR_PROTO` (7, u8), in DATA.
    pub const IPSET_ATTR_PROTO: u16 = 7;
    /// `IPSET_ATTR_IP2` (20 = `IPSET_ATTR_CADT_MAX` + 4, nested address), in DATA.
    pub const IPSET_ATTR_IP2: u16 = 20;
    /// `IPSET_ATTR_CIDR2` (21, u8), in DATA.
    pub const IPSET_ATTR_CIDR2: u16 = 21;

    /// `IPSET_ATTR_HASHSIZE` (18, be32), in a LIST reply's header DATA.
    pub const IPSET_ATTR_HASHSIZE: u16 = 18;
    /// `IPSET_ATTR_MAXELEM` (19, be32), in a LIST reply's header DATA.
    pub const IPSET_ATTR_MAXELEM: u16 = 19;

    /// `NFPROTO_UNSPEC` (netfilter.h): the family of a `bitmap:port` set.
    pub const NFPROTO_UNSPEC: u8 = 0;
    /// `NFPROTO_IPV4` (netfilter.h): `family inet`.
    pub const NFPROTO_IPV4: u8 = 2;
    /// `NFPROTO_IPV6` (netfilter.h): `family inet6`.
    pub const NFPROTO_IPV6: u8 = 10;

    /// `IPSET_ATTR_IPADDR_IPV4` (1, be32), in an address.
    pub const IPSET_ATTR_IPADDR_IPV4: u16 = 1;
    /// `IPSET_ATTR_IPADDR_IPV6` (2, 16 bytes), in an address.
    pub const IPSET_ATTR_IPADDR_IPV6: u16 = 2;

    /// `IPPROTO_TCP`.
    pub const IPPROTO_TCP: u8 = 6;
    /// `IPPROTO_UDP`.
    pub const IPPROTO_UDP: u8 = 17;
    /// `IPPROTO_SCTP`.
    pub const IPPROTO_SCTP: u8 = 132;

    /// `IPSET_ERR_PRIVATE` (4096): first ipset-specific error number.
    pub const IPSET_ERR_PRIVATE: i32 = 4096;
    /// `IPSET_ERR_PROTOCOL` (4097): malformed request or unsupported protocol version.
    pub const IPSET_ERR_PROTOCOL: i32 = 4097;
    /// `IPSET_ERR_FIND_TYPE` (4098).
    pub const IPSET_ERR_FIND_TYPE: i32 = 4098;
    /// `IPSET_ERR_MAX_SETS` (4099).
    pub const IPSET_ERR_MAX_SETS: i32 = 4099;
    /// `IPSET_ERR_BUSY` (4100).
    pub const IPSET_ERR_BUSY: i32 = 4100;
    /// `IPSET_ERR_EXIST_SETNAME2` (4101).
    pub const IPSET_ERR_EXIST_SETNAME2: i32 = 4101;
    /// `IPSET_ERR_TYPE_MISMATCH` (4102).
    pub const IPSET_ERR_TYPE_MISMATCH: i32 = 4102;
    /// `IPSET_ERR_EXIST` (4103): ADD of a present / DEL of an absent element (with
    /// `NLM_F_EXCL`).
    pub const IPSET_ERR_EXIST: i32 = 4103;
    /// `IPSET_ERR_INVALID_CIDR` (4104).
    pub const IPSET_ERR_INVALID_CIDR: i32 = 4104;
    /// `IPSET_ERR_INVALID_NETMASK` (4105).
    pub const IPSET_ERR_INVALID_NETMASK: i32 = 4105;
    /// `IPSET_ERR_INVALID_FAMILY` (4106).
    pub const IPSET_ERR_INVALID_FAMILY: i32 = 4106;
    /// `IPSET_ERR_TIMEOUT` (4107).
    pub const IPSET_ERR_TIMEOUT: i32 = 4107;
    /// `IPSET_ERR_REFERENCED` (4108).
    pub const IPSET_ERR_REFERENCED: i32 = 4108;
    /// `IPSET_ERR_IPADDR_IPV4` (4109).
    pub const IPSET_ERR_IPADDR_IPV4: i32 = 4109;
    /// `IPSET_ERR_IPADDR_IPV6` (4110).
    pub const IPSET_ERR_IPADDR_IPV6: i32 = 4110;
    /// `IPSET_ERR_TYPE_SPECIFIC` (4352): first set-type specific error number.
    pub const IPSET_ERR_TYPE_SPECIFIC: i32 = 4352;
    /// `IPSET_ERR_HASH_FULL` (ip_set_hash.h, 4352).
    pub const IPSET_ERR_HASH_FULL: i32 = 4352;
    /// `IPSET_ERR_HASH_ELEM` (ip_set_hash.h, 4353).
    pub const IPSET_ERR_HASH_ELEM: i32 = 4353;
    /// `IPSET_ERR_INVALID_PROTO` (ip_set_hash.h, 4354).
    pub const IPSET_ERR_INVALID_PROTO: i32 = 4354;
    /// `IPSET_ERR_MISSING_PROTO` (ip_set_hash.h, 4355).
    pub const IPSET_ERR_MISSING_PROTO: i32 = 4355;
    /// `IPSET_ERR_BITMAP_RANGE` (ip_set_bitmap.h, 4352; same number as the hash one).
    pub const IPSET_ERR_BITMAP_RANGE: i32 = 4352;

    /// `ENOENT`: no set of that name.
    pub const ENOENT: i32 = 2;
    /// `EPERM`: missing CAP_NET_ADMIN.
    pub const EPERM: i32 = 1;
}

use consts::*;

/// ADD or DEL of one member.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Adt {
    /// `IPSET_CMD_ADD`.
    Add,
    /// `IPSET_CMD_DEL`.
    Del,
}

impl Adt {
    fn cmd(self) -> u8 {
        match self {
            Adt::Add => IPSET_CMD_ADD,
            Adt::Del => IPSET_CMD_DEL,
        }
    }
}

/// `nlmsg_type` of an ipset command.
pub fn msg_type(cmd: u8) -> u16 {
    (NFNL_SUBSYS_IPSET << 8) | u16::from(cmd)
}

/// `struct nfgenmsg` as libipset sends it: AF_INET, version 0, resource id 0.
const NFGENMSG: [u8; 4] = [AF_INET, NFNETLINK_V0, 0, 0];

/// Appends the protocol probe (`IPSET_CMD_PROTOCOL`, carrying our version), as ipset(8) sends
/// it first in every session. The reply is read with [`parse_protocol_reply`].
pub fn put_protocol(buf: &mut Vec<u8>, seq: u32) {
    put_message(
        buf,
        msg_type(IPSET_CMD_PROTOCOL),
        NLM_F_REQUEST,
        seq,
        &NFGENMSG,
        |w| w.u8(IPSET_ATTR_PROTOCOL, IPSET_PROTOCOL),
    );
}

/// The kernel's protocol versions from an `IPSET_CMD_PROTOCOL` reply payload (after the
/// netlink header): `(protocol, protocol_min)`; a kernel without `IPSET_ATTR_PROTOCOL_MIN`
/// (protocol 6 only) reports its protocol as the minimum.
pub fn parse_protocol_reply(payload: &[u8]) -> Result<(u8, u8), Error> {
    let attrs = payload
        .get(NFGENMSG.len()..)
        .ok_or_else(|| Error::Netlink("truncated ipset protocol reply".into()))?;
    let mut proto = None;
    let mut min = None;
    for a in AttrIter::new(attrs) {
        let a = a.map_err(Error::ProtocolReply)?;
        let v = a.as_u8().map_err(Error::ProtocolReply);
        match a.ty {
            IPSET_ATTR_PROTOCOL => proto = Some(v?),
            IPSET_ATTR_PROTOCOL_MIN => min = Some(v?),
            _ => {}
        }
    }
    let proto =
        proto.ok_or_else(|| Error::Netlink("ipset protocol reply without a version".into()))?;
    Ok((proto, min.unwrap_or(proto)))
}

/// The version to speak with a kernel that reports `(protocol, protocol_min)`: ours when the
/// kernel accepts it, else the kernel's when we can speak it; `None` when there is no common
/// version.
pub fn negotiate(kernel: (u8, u8)) -> Option<u8> {
    let (max, min) = kernel;
    let v = max.min(IPSET_PROTOCOL);
    (v >= min && v >= IPSET_PROTOCOL_MIN).then_some(v)
}

fn put_addr(w: &mut AttrWriter<'_>, ty: u16, ip: &IpAddr) {
    w.nested(ty | NLA_F_NESTED, |w| match ip {
        IpAddr::V4(a) => w.bytes(IPSET_ATTR_IPADDR_IPV4 | NLA_F_NET_BYTEORDER, &a.octets()),
        IpAddr::V6(a) => w.bytes(IPSET_ATTR_IPADDR_IPV6 | NLA_F_NET_BYTEORDER, &a.octets()),
    });
}

fn put_port(w: &mut AttrWriter<'_>, port: u16) {
    w.be16(IPSET_ATTR_PORT | NLA_F_NET_BYTEORDER, port);
}

/// Appends the `IPSET_ATTR_DATA` contents of `entry` (libipset's order).
fn put_data(w: &mut AttrWriter<'_>, entry: &Entry) {
    match entry {
        Entry::Ip(ip) => put_addr(w, IPSET_ATTR_IP, ip),
        Entry::IpPort { ip, proto, port } => {
            put_addr(w, IPSET_ATTR_IP, ip);
            put_port(w, *port);
            w.u8(IPSET_ATTR_PROTO, proto.number());
        }
        Entry::IpPortIp {
            ip,
            proto,
            port,
            ip2,
        } => {
            put_addr(w, IPSET_ATTR_IP, ip);
            put_port(w, *port);
            w.u8(IPSET_ATTR_PROTO, proto.number());
            put_addr(w, IPSET_ATTR_IP2, ip2);
        }
        Entry::IpPortNet {
            ip,
            proto,
            port,
            net,
        } => {
            put_addr(w, IPSET_ATTR_IP, ip);
            put_port(w, *port);
            w.u8(IPSET_ATTR_PROTO, proto.number());
            put_addr(w, IPSET_ATTR_IP2, &net.addr());
            // A host network goes without CIDR2 (the kernel's default is the host mask),
            // exactly as ipset(8) sends `1.2.3.4,tcp:80,10.1.2.3`.
            if net.prefix_len() != net.max_prefix_len() {
                w.u8(IPSET_ATTR_CIDR2, net.prefix_len());
            }
        }
        Entry::Port(port) => put_port(w, *port),
    }
    // libipset always ends the data with the restore line number (0 outside restore).
    w.bytes(IPSET_ATTR_LINENO | NLA_F_NET_BYTEORDER, &0u32.to_be_bytes());
}

/// Appends one ADD or DEL request for `entry` in set `set`, with `NLM_F_ACK` (one ACK or error
/// each) and without `NLM_F_EXCL` (`-exist` semantics), speaking protocol `protocol`.
///
/// Errors (nothing appended) for a set name the kernel cannot hold and an entry mixing IPv4 and
/// IPv6 addresses (the kernel would misread it).
pub fn put_adt(
    buf: &mut Vec<u8>,
    adt: Adt,
    seq: u32,
    protocol: u8,
    set: &str,
    entry: &Entry,
) -> Result<(), Error> {
    check_set_name(set)?;
    entry.family()?;
    put_message(
        buf,
        msg_type(adt.cmd()),
        NLM_F_REQUEST | NLM_F_ACK,
        seq,
        &NFGENMSG,
        |w| {
            w.u8(IPSET_ATTR_PROTOCOL, protocol);
            w.string(IPSET_ATTR_SETNAME, set);
            w.nested(IPSET_ATTR_DATA | NLA_F_NESTED, |w| put_data(w, entry));
        },
    );
    Ok(())
}

/// A set name the kernel can hold: 1 to [`MAX_NAME_LEN`] bytes, no NUL.
fn check_set_name(set: &str) -> Result<(), Error> {
    if set.is_empty() || set.len() > MAX_NAME_LEN || set.contains('\0') {
        return Err(Error::InvalidEntry(format!(
            "set name {set:?} is not 1 to {MAX_NAME_LEN} bytes"
        )));
    }
    Ok(())
}

/// Appends one LIST request for set `set` (`NLM_F_DUMP`, `NLM_F_ACK`), speaking protocol
/// `protocol`, exactly as `ipset list SET` sends it. The kernel answers with one or more
/// `IPSET_CMD_LIST` messages (read with [`Listing::take`]) and `NLMSG_DONE`, or with `ENOENT`
/// when no set of that name exists.
pub fn put_list(buf: &mut Vec<u8>, seq: u32, protocol: u8, set: &str) -> Result<(), Error> {
    check_set_name(set)?;
    put_message(
        buf,
        msg_type(IPSET_CMD_LIST),
        NLM_F_REQUEST | NLM_F_ACK | NLM_F_DUMP,
        seq,
        &NFGENMSG,
        |w| {
            w.u8(IPSET_ATTR_PROTOCOL, protocol);
            w.string(IPSET_ATTR_SETNAME, set);
        },
    );
    Ok(())
}

/// One set's state read from the messages of its LIST dump, in order: the first carries the
/// header (type name, family, revision and the header DATA with hashsize and maxelem) and the
/// first members (`IPSET_ATTR_ADT`), the later ones only the set name and more members. A set
/// of a type this crate does not model is kept with [`SetState::foreign_type`] and no members
/// (as [`crate::parse_save`] keeps it), so the diff recreates it.
#[derive(Debug)]
pub struct Listing {
    name: String,
    set: Option<SetState>,
    /// Members read from the kernel have no owner: one shared empty label.
    unknown: Arc<str>,
}

impl Listing {
    /// A listing of set `name`, nothing read yet.
    pub fn new(name: &str) -> Listing {
        Listing {
            name: name.to_string(),
            set: None,
            unknown: Arc::from(""),
        }
    }

    /// Reads one data message of the dump (its payload after the netlink header). Messages of
    /// another type are skipped; one naming another set, a member before the header and a
    /// member that does not fit the set's type are errors naming the set.
    pub fn take(&mut self, ty: u16, payload: &[u8]) -> Result<(), Error> {
        if ty != msg_type(IPSET_CMD_LIST) {
            return Ok(());
        }
        let attrs = payload
            .get(NFGENMSG.len()..)
            .ok_or_else(|| self.bad("truncated message"))?;
        let mut type_name = None;
        let mut family = None;
        let mut header = None;
        let mut adt = None;
        for a in AttrIter::new(attrs) {
            let a = a.map_err(|e| self.bad(&e.to_string()))?;
            match a.ty {
                IPSET_ATTR_SETNAME => {
                    let name = a.as_str().map_err(|e| self.bad(&e.to_string()))?;
                    if name != self.name {
                        return Err(self.bad(&format!("a message of set {name:?}")));
                    }
                }
                IPSET_ATTR_TYPENAME => {
                    type_name = Some(a.as_str().map_err(|e| self.bad(&e.to_string()))?)
                }
                IPSET_ATTR_FAMILY => {
                    family = Some(a.as_u8().map_err(|e| self.bad(&e.to_string()))?)
                }
                IPSET_ATTR_DATA => header = Some(a),
                IPSET_ATTR_ADT => adt = Some(a),
                _ => {}
            }
        }
        if let Some(type_name) = type_name {
            self.set = Some(self.header(type_name, family, header)?);
        }
        let Some(adt) = adt else {
            return Ok(());
        };
        let name = self.name.as_str();
        let Some(set) = self.set.as_mut() else {
            return Err(parse_error(name, "members before the set's header"));
        };
        if set.foreign_type.is_some() {
            return Ok(());
        }
        let set_type = set.spec.set_type;
        for data in adt.nested() {
            let data = data.map_err(|e| parse_error(name, &e.to_string()))?;
            if data.ty != IPSET_ATTR_DATA {
                continue;
            }
            let entry = member(set_type, data).map_err(|why| parse_error(name, &why))?;
            set.entries.insert(entry, self.unknown.clone());
        }
        Ok(())
    }

    /// The set as read: `None` when the dump carried no header (the kernel always sends one for
    /// a set that exists).
    pub fn finish(self) -> Option<SetState> {
        self.set
    }

    fn header(
        &self,
        type_name: &str,
        family: Option<u8>,
        data: Option<::netlink::Attr<'_>>,
    ) -> Result<SetState, Error> {
        let family = match family {
            Some(NFPROTO_IPV6) => Family::Inet6,
            Some(NFPROTO_IPV4 | NFPROTO_UNSPEC) | None => Family::Inet,
            Some(other) => return Err(self.bad(&format!("family {other}"))),
        };
        let Some(set_type) = SetType::parse(type_name) else {
            return Ok(SetState {
                spec: SetSpec::new(&self.name, SetType::HashIp, family),
                entries: BTreeMap::new(),
                foreign_type: Some(type_name.to_string()),
            });
        };
        let mut spec = SetSpec::new(&self.name, set_type, family);
        for a in data.iter().flat_map(|d| d.nested()) {
            let a = a.map_err(|e| self.bad(&e.to_string()))?;
            let be32 = || {
                <[u8; 4]>::try_from(a.payload)
                    .map(u32::from_be_bytes)
                    .map_err(|_| {
                        self.bad(&format!(
                            "header attribute {} of length {}",
                            a.ty,
                            a.payload.len()
                        ))
                    })
            };
            match a.ty {
                IPSET_ATTR_HASHSIZE if set_type.is_hash() => spec.hash_size = be32()?,
                IPSET_ATTR_MAXELEM if set_type.is_hash() => spec.max_elem = be32()?,
                _ => {}
            }
        }
        Ok(SetState {
            spec,
            entries: BTreeMap::new(),
            foreign_type: None,
        })
    }

    fn bad(&self, why: &str) -> Error {
        parse_error(&self.name, why)
    }
}

/// A LIST reply of set `name` that cannot be read.
fn parse_error(name: &str, why: &str) -> Error {
    Error::Parse(format!("ipset list of set {name}: {why}"))
}

/// One member from its `IPSET_ATTR_DATA` in a LIST reply, for a set of type `set_type`:
/// addresses (`IPSET_ATTR_IP`, `IPSET_ATTR_IP2`), port, protocol and `IPSET_ATTR_CIDR2` (the
/// kernel always sends it for `hash:ip,port,net`; a host network when absent). Extensions
/// (comment, counters, ...) are skipped.
fn member(set_type: SetType, data: ::netlink::Attr<'_>) -> Result<Entry, String> {
    let (mut ip, mut ip2, mut port, mut proto, mut cidr2) = (None, None, None, None, None);
    for a in data.nested() {
        let a = a.map_err(|e| e.to_string())?;
        match a.ty {
            IPSET_ATTR_IP => ip = Some(address(a)?),
            IPSET_ATTR_IP2 => ip2 = Some(address(a)?),
            IPSET_ATTR_PORT => port = Some(a.as_be16().map_err(|e| e.to_string())?),
            IPSET_ATTR_PROTO => proto = Some(a.as_u8().map_err(|e| e.to_string())?),
            IPSET_ATTR_CIDR2 => cidr2 = Some(a.as_u8().map_err(|e| e.to_string())?),
            _ => {}
        }
    }
    let missing = |what: &str| format!("a {set_type} member without {what}");
    let ip = || ip.ok_or_else(|| missing("an address"));
    let port = || port.ok_or_else(|| missing("a port"));
    let proto = || {
        let n = proto.ok_or_else(|| missing("a protocol"))?;
        Protocol::from_number(n).ok_or_else(|| format!("a {set_type} member with protocol {n}"))
    };
    let ip2 = || ip2.ok_or_else(|| missing("a second address"));
    Ok(match set_type {
        SetType::HashIp => Entry::Ip(ip()?),
        SetType::HashIpPort => Entry::ip_port(ip()?, proto()?, port()?),
        SetType::HashIpPortIp => Entry::ip_port_ip(ip()?, proto()?, port()?, ip2()?),
        SetType::HashIpPortNet => {
            let addr = ip2()?;
            let len = cidr2.unwrap_or(if addr.is_ipv4() { 32 } else { 128 });
            let net = ipnet::IpNet::new(addr, len)
                .map_err(|_| format!("a {set_type} member with prefix length {len}"))?;
            Entry::ip_port_net(ip()?, proto()?, port()?, net)
        }
        SetType::BitmapPort => Entry::Port(port()?),
    })
}

/// An address nested in `IPSET_ATTR_IP` / `IPSET_ATTR_IP2`.
fn address(a: ::netlink::Attr<'_>) -> Result<IpAddr, String> {
    for n in a.nested() {
        let n = n.map_err(|e| e.to_string())?;
        match n.ty {
            IPSET_ATTR_IPADDR_IPV4 => {
                let b: [u8; 4] = n.payload.try_into().map_err(|_| "a short IPv4 address")?;
                return Ok(IpAddr::V4(Ipv4Addr::from(b)));
            }
            IPSET_ATTR_IPADDR_IPV6 => {
                let b: [u8; 16] = n.payload.try_into().map_err(|_| "a short IPv6 address")?;
                return Ok(IpAddr::V6(Ipv6Addr::from(b)));
            }
            _ => {}
        }
    }
    Err("an address attribute without an address".to_string())
}

/// Whether the kernel's answer to an ADD/DEL means the member is as asked: success, or
/// `IPSET_ERR_EXIST` (already added / not added), which `-exist` ignores. Without
/// `NLM_F_EXCL` the kernel already answers 0 then; this keeps the contract explicit.
pub fn answer_ok(result: Result<(), i32>) -> bool {
    matches!(result, Ok(()) | Err(IPSET_ERR_EXIST))
}

/// A message for a kernel error answering an ADD/DEL, worded like ipset(8)'s where it has one.
pub fn error_message(adt: Adt, errno: i32) -> String {
    let what = match errno {
        ENOENT => "The set with the given name does not exist",
        EPERM => "Operation not permitted (CAP_NET_ADMIN is needed)",
        IPSET_ERR_PROTOCOL => {
            "Kernel error received: ipset protocol error (the member does not fit the set's \
             type or family)"
        }
        IPSET_ERR_EXIST => match adt {
            Adt::Add => "Element cannot be added to the set: it's already added",
            Adt::Del => "Element cannot be deleted from the set: it's not added",
        },
        IPSET_ERR_INVALID_CIDR => "The value of the CIDR parameter of the IP address is invalid",
        IPSET_ERR_INVALID_FAMILY => "Protocol family not supported by the set type",
        IPSET_ERR_IPADDR_IPV4 => "An IPv4 address is expected",
        IPSET_ERR_IPADDR_IPV6 => "An IPv6 address is expected",
        IPSET_ERR_TYPE_MISMATCH => "The set type does not match",
        IPSET_ERR_TIMEOUT => "Timeout cannot be used: set was created without timeout support",
        IPSET_ERR_HASH_FULL => {
            "Hash is full, cannot add more elements (or bitmap: element out of the set's range)"
        }
        IPSET_ERR_HASH_ELEM => "Null-valued element, cannot be stored in a hash type of set",
        IPSET_ERR_INVALID_PROTO => "Invalid protocol specified",
        IPSET_ERR_MISSING_PROTO => "Protocol missing, but must be specified",
        _ => "",
    };
    if what.is_empty() {
        let os = if errno < IPSET_ERR_PRIVATE {
            std::io::Error::from_raw_os_error(errno).to_string()
        } else {
            format!("ipset error {errno}")
        };
        format!("Kernel error received: {os}")
    } else {
        what.to_string()
    }
}

/// The kernel's answer to the protocol probe: its `(protocol, protocol_min)`, or the positive
/// errno it refused the probe with.
pub type ProtocolAnswer = Result<(u8, u8), i32>;

/// The `(protocol, protocol_min)` of the `IPSET_CMD_PROTOCOL` reply to request `seq` in one
/// datagram; `Ok(None)` when the datagram holds no answer to it, `Err` with the errno when the
/// kernel refused the probe.
pub fn protocol_answer(datagram: &[u8], seq: u32) -> Result<Option<ProtocolAnswer>, Error> {
    for m in messages(datagram) {
        let m = m?;
        if m.seq() != seq {
            continue;
        }
        match m {
            Message::Data(d) if d.header.ty == msg_type(IPSET_CMD_PROTOCOL) => {
                return Ok(Some(Ok(parse_protocol_reply(d.payload)?)));
            }
            Message::Error { errno, .. } => return Ok(Some(Err(errno))),
            _ => {}
        }
    }
    Ok(None)
}

#[cfg(test)]
mod tests;
