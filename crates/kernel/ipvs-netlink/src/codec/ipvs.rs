//! IPVS generic netlink messages: encoding every command and decoding replies.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use super::consts::*;
use super::netlink::put_request;
use super::nla::{Attr, AttrIter, AttrWriter};
use crate::error::OpKind;
use crate::types::{
    Destination, Family, ForwardMethod, Info, Op, Protocol, Service, ServiceFlags, ServiceKey,
    Stats, Timeouts, TunnelType,
};
use crate::Error;

/// Flags of every write request: a request that wants an ACK.
pub const WRITE_FLAGS: u16 = NLM_F_REQUEST | NLM_F_ACK;
/// Flags of every dump request.
pub const DUMP_FLAGS: u16 = NLM_F_REQUEST | NLM_F_DUMP;

/// The 16-byte `union nf_inet_addr` image of an address (IPv4 in the first 4 bytes).
pub fn inet_addr_bytes(addr: &IpAddr) -> [u8; 16] {
    let mut out = [0u8; 16];
    match addr {
        IpAddr::V4(a) => out[..4].copy_from_slice(&a.octets()),
        IpAddr::V6(a) => out.copy_from_slice(&a.octets()),
    }
    out
}

fn decode_addr(a: &Attr<'_>, family: Family) -> Result<IpAddr, Error> {
    match family {
        Family::Inet => {
            let b: [u8; 4] = a
                .payload
                .get(..4)
                .and_then(|s| s.try_into().ok())
                .ok_or_else(|| {
                    Error::Malformed(format!("IPv4 address of length {}", a.payload.len()))
                })?;
            Ok(IpAddr::V4(Ipv4Addr::from(b)))
        }
        Family::Inet6 => {
            let b: [u8; 16] = a
                .payload
                .get(..16)
                .and_then(|s| s.try_into().ok())
                .ok_or_else(|| {
                    Error::Malformed(format!("IPv6 address of length {}", a.payload.len()))
                })?;
            Ok(IpAddr::V6(Ipv6Addr::from(b)))
        }
    }
}

fn family_from(af: u16) -> Result<Family, Error> {
    Family::from_af(af).ok_or_else(|| Error::Malformed(format!("unknown address family {af}")))
}

/// Netmask attribute bytes: IPv4 masks travel as the mask's bytes (network order), IPv6
/// "masks" are prefix lengths in host order, exactly as ipvsadm and the kernel use them.
pub fn netmask_to_wire(family: Family, netmask: u32) -> u32 {
    match family {
        Family::Inet => u32::from_ne_bytes(netmask.to_be_bytes()),
        Family::Inet6 => netmask,
    }
}

fn netmask_from_wire(family: Family, raw: u32) -> u32 {
    match family {
        Family::Inet => u32::from_be_bytes(raw.to_ne_bytes()),
        Family::Inet6 => raw,
    }
}

fn put_service_key(w: &mut AttrWriter<'_>, key: &ServiceKey) {
    w.u16(IPVS_SVC_ATTR_AF, key.family().to_af());
    match key {
        ServiceKey::Fwmark { mark, .. } => w.u32(IPVS_SVC_ATTR_FWMARK, *mark),
        ServiceKey::Inet {
            protocol,
            addr,
            port,
        } => {
            w.u16(IPVS_SVC_ATTR_PROTOCOL, u16::from(protocol.number()));
            w.bytes(IPVS_SVC_ATTR_ADDR, &inet_addr_bytes(addr));
            w.be16(IPVS_SVC_ATTR_PORT, *port);
        }
    }
}

fn check_name(what: &str, name: &str, max: usize) -> Result<(), Error> {
    if name.len() >= max || name.as_bytes().contains(&0) {
        return Err(Error::Invalid(format!(
            "{what} {name:?}: at most {} bytes, no NUL",
            max - 1
        )));
    }
    Ok(())
}

fn check_service(s: &Service) -> Result<(), Error> {
    check_name("scheduler name", &s.scheduler, IP_VS_SCHEDNAME_MAXLEN)?;
    if s.scheduler.is_empty() {
        return Err(Error::Invalid("empty scheduler name".into()));
    }
    if let Some(pe) = &s.pe_name {
        check_name("persistence engine name", pe, IP_VS_PENAME_MAXLEN)?;
    }
    if let ServiceKey::Fwmark { mark: 0, .. } = s.key {
        return Err(Error::Invalid("firewall mark 0".into()));
    }
    Ok(())
}

fn put_service_full(w: &mut AttrWriter<'_>, s: &Service) {
    w.nested(IPVS_CMD_ATTR_SERVICE, |w| {
        put_service_key(w, &s.key);
        w.string(IPVS_SVC_ATTR_SCHED_NAME, &s.scheduler);
        if let Some(pe) = &s.pe_name {
            w.string(IPVS_SVC_ATTR_PE_NAME, pe);
        }
        let mut flags = [0u8; 8];
        // struct ip_vs_flags { __u32 flags; __u32 mask; }: set every bit to what we say.
        flags[..4].copy_from_slice(&(s.flags.0 & !ServiceFlags::HASHED).to_ne_bytes());
        flags[4..].copy_from_slice(&u32::MAX.to_ne_bytes());
        w.bytes(IPVS_SVC_ATTR_FLAGS, &flags);
        w.u32(IPVS_SVC_ATTR_TIMEOUT, s.timeout);
        w.u32(
            IPVS_SVC_ATTR_NETMASK,
            netmask_to_wire(s.key.family(), s.netmask),
        );
    });
}

fn put_service_only_key(w: &mut AttrWriter<'_>, key: &ServiceKey) {
    w.nested(IPVS_CMD_ATTR_SERVICE, |w| put_service_key(w, key));
}

fn put_dest_full(w: &mut AttrWriter<'_>, d: &Destination) {
    w.nested(IPVS_CMD_ATTR_DEST, |w| {
        w.u16(IPVS_DEST_ATTR_ADDR_FAMILY, Family::of(&d.addr).to_af());
        w.bytes(IPVS_DEST_ATTR_ADDR, &inet_addr_bytes(&d.addr));
        w.be16(IPVS_DEST_ATTR_PORT, d.port);
        w.u32(IPVS_DEST_ATTR_FWD_METHOD, d.fwd.to_flags());
        w.u32(IPVS_DEST_ATTR_WEIGHT, d.weight);
        w.u8(IPVS_DEST_ATTR_TUN_TYPE, d.tun_type.to_u8());
        w.be16(IPVS_DEST_ATTR_TUN_PORT, d.tun_port);
        w.u16(IPVS_DEST_ATTR_TUN_FLAGS, d.tun_flags);
        w.u32(IPVS_DEST_ATTR_U_THRESH, d.upper_threshold);
        w.u32(IPVS_DEST_ATTR_L_THRESH, d.lower_threshold);
    });
}

fn put_dest_key(w: &mut AttrWriter<'_>, addr: &IpAddr, port: u16) {
    w.nested(IPVS_CMD_ATTR_DEST, |w| {
        w.u16(IPVS_DEST_ATTR_ADDR_FAMILY, Family::of(addr).to_af());
        w.bytes(IPVS_DEST_ATTR_ADDR, &inet_addr_bytes(addr));
        w.be16(IPVS_DEST_ATTR_PORT, port);
    });
}

/// The operation kind of a write op (for errors); see [`Op::kind`].
pub fn op_kind(op: &Op) -> OpKind {
    op.kind()
}

/// Appends the request for one write operation (with `NLM_F_ACK`). On an invalid op nothing
/// is appended.
pub fn put_op(buf: &mut Vec<u8>, family: u16, seq: u32, op: &Op) -> Result<(), Error> {
    let v = IPVS_GENL_VERSION;
    match op {
        Op::NewService(s) | Op::SetService(s) => {
            check_service(s)?;
            let cmd = if matches!(op, Op::NewService(_)) {
                IPVS_CMD_NEW_SERVICE
            } else {
                IPVS_CMD_SET_SERVICE
            };
            put_request(buf, family, WRITE_FLAGS, seq, cmd, v, |w| {
                put_service_full(w, s)
            });
        }
        Op::DelService(k) => {
            put_request(
                buf,
                family,
                WRITE_FLAGS,
                seq,
                IPVS_CMD_DEL_SERVICE,
                v,
                |w| put_service_only_key(w, k),
            );
        }
        Op::NewDest(k, d) | Op::SetDest(k, d) => {
            let cmd = if matches!(op, Op::NewDest(..)) {
                IPVS_CMD_NEW_DEST
            } else {
                IPVS_CMD_SET_DEST
            };
            put_request(buf, family, WRITE_FLAGS, seq, cmd, v, |w| {
                put_service_only_key(w, k);
                put_dest_full(w, d);
            });
        }
        Op::DelDest(k, addr, port) => {
            put_request(buf, family, WRITE_FLAGS, seq, IPVS_CMD_DEL_DEST, v, |w| {
                put_service_only_key(w, k);
                put_dest_key(w, addr, *port);
            });
        }
        Op::Flush => {
            put_request(buf, family, WRITE_FLAGS, seq, IPVS_CMD_FLUSH, v, |_| {});
        }
        Op::SetTimeouts(t) => {
            put_request(buf, family, WRITE_FLAGS, seq, IPVS_CMD_SET_CONFIG, v, |w| {
                w.u32(IPVS_CMD_ATTR_TIMEOUT_TCP, t.tcp);
                w.u32(IPVS_CMD_ATTR_TIMEOUT_TCP_FIN, t.tcp_fin);
                w.u32(IPVS_CMD_ATTR_TIMEOUT_UDP, t.udp);
            });
        }
    }
    Ok(())
}

/// Appends a dump request for every virtual server.
pub fn put_dump_services(buf: &mut Vec<u8>, family: u16, seq: u32) {
    put_request(
        buf,
        family,
        DUMP_FLAGS,
        seq,
        IPVS_CMD_GET_SERVICE,
        IPVS_GENL_VERSION,
        |_| {},
    );
}

/// Appends a request for one virtual server.
pub fn put_get_service(buf: &mut Vec<u8>, family: u16, seq: u32, key: &ServiceKey) {
    put_request(
        buf,
        family,
        WRITE_FLAGS,
        seq,
        IPVS_CMD_GET_SERVICE,
        IPVS_GENL_VERSION,
        |w| put_service_only_key(w, key),
    );
}

/// Appends a dump request for the real servers of one virtual server.
pub fn put_dump_dests(buf: &mut Vec<u8>, family: u16, seq: u32, key: &ServiceKey) {
    put_request(
        buf,
        family,
        DUMP_FLAGS,
        seq,
        IPVS_CMD_GET_DEST,
        IPVS_GENL_VERSION,
        |w| put_service_only_key(w, key),
    );
}

/// Appends a `GET_INFO` request.
pub fn put_get_info(buf: &mut Vec<u8>, family: u16, seq: u32) {
    put_request(
        buf,
        family,
        WRITE_FLAGS,
        seq,
        IPVS_CMD_GET_INFO,
        IPVS_GENL_VERSION,
        |_| {},
    );
}

/// Appends a `GET_CONFIG` (timeouts) request.
pub fn put_get_config(buf: &mut Vec<u8>, family: u16, seq: u32) {
    put_request(
        buf,
        family,
        WRITE_FLAGS,
        seq,
        IPVS_CMD_GET_CONFIG,
        IPVS_GENL_VERSION,
        |_| {},
    );
}

fn find_nested<'a>(attrs: AttrIter<'a>, ty: u16) -> Result<Option<Attr<'a>>, Error> {
    for a in attrs {
        let a = a?;
        if a.ty == ty {
            return Ok(Some(a));
        }
    }
    Ok(None)
}

/// Decodes a stats nest (`IPVS_*_ATTR_STATS` or `STATS64`; both counter widths accepted).
pub fn decode_stats(attrs: AttrIter<'_>) -> Result<Stats, Error> {
    let mut s = Stats::default();
    for a in attrs {
        let a = a?;
        let slot = match a.ty {
            IPVS_STATS_ATTR_CONNS => &mut s.conns,
            IPVS_STATS_ATTR_INPKTS => &mut s.inpkts,
            IPVS_STATS_ATTR_OUTPKTS => &mut s.outpkts,
            IPVS_STATS_ATTR_INBYTES => &mut s.inbytes,
            IPVS_STATS_ATTR_OUTBYTES => &mut s.outbytes,
            IPVS_STATS_ATTR_CPS => &mut s.cps,
            IPVS_STATS_ATTR_INPPS => &mut s.inpps,
            IPVS_STATS_ATTR_OUTPPS => &mut s.outpps,
            IPVS_STATS_ATTR_INBPS => &mut s.inbps,
            IPVS_STATS_ATTR_OUTBPS => &mut s.outbps,
            _ => continue,
        };
        *slot = a.as_uint()?;
    }
    Ok(s)
}

/// Decodes the attributes nested in `IPVS_CMD_ATTR_SERVICE`.
pub fn decode_service_nest(attrs: AttrIter<'_>) -> Result<Service, Error> {
    let mut af = None;
    let mut protocol = None;
    let mut addr = None;
    let mut port = None;
    let mut fwmark = None;
    let mut sched = None;
    let mut flags = 0u32;
    let mut timeout = 0u32;
    let mut netmask = None;
    let mut pe_name = None;
    let mut stats = None;
    let mut stats64 = None;
    for a in attrs {
        let a = a?;
        match a.ty {
            IPVS_SVC_ATTR_AF => af = Some(a.as_u16()?),
            IPVS_SVC_ATTR_PROTOCOL => protocol = Some(a.as_u16()?),
            IPVS_SVC_ATTR_ADDR => addr = Some(a),
            IPVS_SVC_ATTR_PORT => port = Some(a.as_be16()?),
            IPVS_SVC_ATTR_FWMARK => fwmark = Some(a.as_u32()?),
            IPVS_SVC_ATTR_SCHED_NAME => sched = Some(a.as_str()?.to_owned()),
            IPVS_SVC_ATTR_FLAGS => {
                let b = a
                    .payload
                    .get(..4)
                    .ok_or_else(|| Error::Malformed("service flags shorter than 4 bytes".into()))?;
                flags = u32::from_ne_bytes([b[0], b[1], b[2], b[3]]);
            }
            IPVS_SVC_ATTR_TIMEOUT => timeout = a.as_u32()?,
            IPVS_SVC_ATTR_NETMASK => netmask = Some(a.as_u32()?),
            IPVS_SVC_ATTR_PE_NAME => {
                let pe = a.as_str()?;
                if !pe.is_empty() {
                    pe_name = Some(pe.to_owned());
                }
            }
            IPVS_SVC_ATTR_STATS => stats = Some(decode_stats(a.nested())?),
            IPVS_SVC_ATTR_STATS64 => stats64 = Some(decode_stats(a.nested())?),
            _ => {}
        }
    }
    let af = af.ok_or_else(|| Error::Malformed("service without IPVS_SVC_ATTR_AF".into()))?;
    let family = family_from(af)?;
    let key = match (fwmark, protocol, addr, port) {
        (Some(mark), _, _, _) if mark != 0 => ServiceKey::Fwmark { family, mark },
        (_, Some(p), Some(a), Some(port)) => ServiceKey::Inet {
            protocol: u8::try_from(p)
                .ok()
                .and_then(Protocol::from_number)
                .ok_or_else(|| Error::Malformed(format!("unsupported protocol {p}")))?,
            addr: decode_addr(&a, family)?,
            port,
        },
        _ => {
            return Err(Error::Malformed(
                "service without fwmark or protocol/address/port".into(),
            ))
        }
    };
    let scheduler =
        sched.ok_or_else(|| Error::Malformed("service without scheduler name".into()))?;
    let netmask = match netmask {
        Some(raw) => netmask_from_wire(family, raw),
        None => match family {
            Family::Inet => u32::MAX,
            Family::Inet6 => 128,
        },
    };
    Ok(Service {
        key,
        scheduler,
        flags: ServiceFlags(flags),
        timeout,
        netmask,
        pe_name,
        stats: stats64.or(stats).map(Box::new),
    })
}

/// Decodes a service reply message's top-level attributes.
pub fn decode_service(attrs: AttrIter<'_>) -> Result<Service, Error> {
    let nest = find_nested(attrs, IPVS_CMD_ATTR_SERVICE)?
        .ok_or_else(|| Error::Malformed("reply without IPVS_CMD_ATTR_SERVICE".into()))?;
    decode_service_nest(nest.nested())
}

/// Decodes the attributes nested in `IPVS_CMD_ATTR_DEST`; `svc_family` is used when the
/// kernel does not report the destination's own family (kernels before 4.x).
pub fn decode_dest_nest(attrs: AttrIter<'_>, svc_family: Family) -> Result<Destination, Error> {
    let mut addr = None;
    let mut port = None;
    let mut af = None;
    let mut d = Destination::new(svc_family.unspecified(), 0);
    d.weight = 0;
    let mut stats = None;
    let mut stats64 = None;
    for a in attrs {
        let a = a?;
        match a.ty {
            IPVS_DEST_ATTR_ADDR => addr = Some(a),
            IPVS_DEST_ATTR_PORT => port = Some(a.as_be16()?),
            IPVS_DEST_ATTR_FWD_METHOD => {
                let v = a.as_u32()?;
                d.fwd = ForwardMethod::from_flags(v)
                    .ok_or_else(|| Error::Malformed(format!("forwarding method {v}")))?;
            }
            IPVS_DEST_ATTR_WEIGHT => d.weight = a.as_u32()?,
            IPVS_DEST_ATTR_U_THRESH => d.upper_threshold = a.as_u32()?,
            IPVS_DEST_ATTR_L_THRESH => d.lower_threshold = a.as_u32()?,
            IPVS_DEST_ATTR_ACTIVE_CONNS => d.active_conns = a.as_u32()?,
            IPVS_DEST_ATTR_INACT_CONNS => d.inactive_conns = a.as_u32()?,
            IPVS_DEST_ATTR_PERSIST_CONNS => d.persist_conns = a.as_u32()?,
            IPVS_DEST_ATTR_ADDR_FAMILY => af = Some(a.as_u16()?),
            IPVS_DEST_ATTR_TUN_TYPE => {
                let v = a.as_u8()?;
                d.tun_type = TunnelType::from_u8(v)
                    .ok_or_else(|| Error::Malformed(format!("tunnel type {v}")))?;
            }
            IPVS_DEST_ATTR_TUN_PORT => d.tun_port = a.as_be16()?,
            IPVS_DEST_ATTR_TUN_FLAGS => d.tun_flags = a.as_u16()?,
            IPVS_DEST_ATTR_STATS => stats = Some(decode_stats(a.nested())?),
            IPVS_DEST_ATTR_STATS64 => stats64 = Some(decode_stats(a.nested())?),
            _ => {}
        }
    }
    let family = match af {
        Some(af) => family_from(af)?,
        None => svc_family,
    };
    let addr = addr.ok_or_else(|| Error::Malformed("destination without address".into()))?;
    d.addr = decode_addr(&addr, family)?;
    d.port = port.ok_or_else(|| Error::Malformed("destination without port".into()))?;
    d.stats = stats64.or(stats).map(Box::new);
    Ok(d)
}

/// Decodes a destination reply message's top-level attributes.
pub fn decode_dest(attrs: AttrIter<'_>, svc_family: Family) -> Result<Destination, Error> {
    let nest = find_nested(attrs, IPVS_CMD_ATTR_DEST)?
        .ok_or_else(|| Error::Malformed("reply without IPVS_CMD_ATTR_DEST".into()))?;
    decode_dest_nest(nest.nested(), svc_family)
}

/// Decodes a `GET_INFO` reply.
pub fn decode_info(attrs: AttrIter<'_>) -> Result<Info, Error> {
    let mut version = None;
    let mut size = None;
    for a in attrs {
        let a = a?;
        match a.ty {
            IPVS_INFO_ATTR_VERSION => version = Some(a.as_u32()?),
            IPVS_INFO_ATTR_CONN_TAB_SIZE => size = Some(a.as_u32()?),
            _ => {}
        }
    }
    Ok(Info {
        version: version.ok_or_else(|| Error::Malformed("info without version".into()))?,
        conn_tab_size: size
            .ok_or_else(|| Error::Malformed("info without connection table size".into()))?,
    })
}

/// Decodes a `GET_CONFIG` reply (missing timeouts read as 0).
pub fn decode_timeouts(attrs: AttrIter<'_>) -> Result<Timeouts, Error> {
    let mut t = Timeouts::default();
    for a in attrs {
        let a = a?;
        match a.ty {
            IPVS_CMD_ATTR_TIMEOUT_TCP => t.tcp = a.as_u32()?,
            IPVS_CMD_ATTR_TIMEOUT_TCP_FIN => t.tcp_fin = a.as_u32()?,
            IPVS_CMD_ATTR_TIMEOUT_UDP => t.udp = a.as_u32()?,
            _ => {}
        }
    }
    Ok(t)
}
