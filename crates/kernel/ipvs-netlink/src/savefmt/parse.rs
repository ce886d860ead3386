//! Parsing: `ipvsadm -S` text (the table form and the command form) into services,
//! destinations and operations, with ipvsadm's option rules and limits.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use super::{DEFAULT_PERSISTENT_TIMEOUT, DEFAULT_SCHEDULER, MAX_TIMEOUT};
use crate::error::ParseError;
use crate::types::{
    tunnel_flags, Destination, Family, ForwardMethod, Op, Protocol, Service, ServiceFlags,
    ServiceKey, Timeouts, TunnelType,
};

/// One parsed line: which command and its arguments.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Cmd {
    Add,
    Edit,
    Del,
    AddDest,
    EditDest,
    DelDest,
    Clear,
    Set,
}

/// Splits text into lines of tokens the way `ipvsadm --restore` reads them: whitespace
/// separated, `#` starts a comment, the word `ipvsadm` is ignored. Yields (line number, tokens).
fn lines(text: &str) -> impl Iterator<Item = (usize, Vec<&str>)> {
    text.lines().enumerate().filter_map(|(i, l)| {
        let l = match l.find('#') {
            Some(p) => &l[..p],
            None => l,
        };
        let toks: Vec<&str> = l
            .split([' ', '\t', '\r'])
            .filter(|t| !t.is_empty() && *t != "ipvsadm")
            .collect();
        (!toks.is_empty()).then_some((i + 1, toks))
    })
}

fn perr(line: usize, message: impl Into<String>) -> ParseError {
    ParseError {
        line,
        message: message.into(),
    }
}

fn parse_number(s: &str, min: i64, max: i64) -> Option<i64> {
    let v: i64 = s.parse().ok()?;
    (min..=max).contains(&v).then_some(v)
}

/// Parses `addr[:port]` / `[v6]:port` like ipvsadm's `parse_service` (numeric only).
/// Returns the address and the port if one was given.
fn parse_addr_port(s: &str) -> Option<(IpAddr, Option<u16>)> {
    if let Some(rest) = s.strip_prefix('[') {
        let (a, p) = rest.split_once(']')?;
        let p = p.strip_prefix(':')?;
        let a: Ipv6Addr = a.parse().ok()?;
        let port = u16::try_from(parse_number(p, 0, 65535)?).ok()?;
        return Some((IpAddr::V6(a), Some(port)));
    }
    if let Ok(a) = s.parse::<Ipv6Addr>() {
        return Some((IpAddr::V6(a), None));
    }
    let (a, port) = match s.rsplit_once(':') {
        Some((a, p)) => (a, Some(u16::try_from(parse_number(p, 0, 65535)?).ok()?)),
        None => (s, None),
    };
    let a: Ipv4Addr = a.parse().ok()?;
    Some((IpAddr::V4(a), port))
}

#[derive(Default)]
struct Line {
    cmd: Option<Cmd>,
    protocol: Option<Protocol>,
    vaddr: Option<(IpAddr, u16)>,
    fwmark: Option<u32>,
    fwmark6: bool,
    scheduler: Option<String>,
    persistent: Option<u32>,
    netmask: Option<String>,
    onepacket: bool,
    pe: Option<String>,
    sched_flags: Option<String>,
    real: Option<(IpAddr, Option<u16>)>,
    fwd: Option<ForwardMethod>,
    weight: Option<u32>,
    u_thresh: Option<u32>,
    l_thresh: Option<u32>,
    tun_type: Option<TunnelType>,
    tun_port: Option<u16>,
    tun_flags: Vec<u16>,
    set_args: Vec<u32>,
}

fn set_cmd(l: &mut Line, c: Cmd, line: usize) -> Result<(), ParseError> {
    if l.cmd.is_some() {
        return Err(perr(line, "more than one command on a line"));
    }
    l.cmd = Some(c);
    Ok(())
}

/// Parses one tokenized line into a `Line`.
fn parse_tokens(toks: &[&str], line: usize) -> Result<Line, ParseError> {
    let mut l = Line::default();
    let mut i = 0;
    let mut positional: Vec<&str> = Vec::new();
    while i < toks.len() {
        let tok = toks[i];
        i += 1;
        // Normalise: long options (with optional =value) and short options (with optional
        // attached value) to (name, attached value).
        let (name, attached): (&str, Option<&str>) = if let Some(long) = tok.strip_prefix("--") {
            match long.split_once('=') {
                Some((n, v)) => (n, Some(v)),
                None => (long, None),
            }
        } else if let Some(short) = tok.strip_prefix('-') {
            let mut chars = short.chars();
            match chars.next() {
                Some(c) => {
                    let rest = chars.as_str();
                    let name = match c {
                        'A' => "add-service",
                        'E' => "edit-service",
                        'D' => "delete-service",
                        'C' => "clear",
                        'a' => "add-server",
                        'e' => "edit-server",
                        'd' => "delete-server",
                        't' => "tcp-service",
                        'u' => "udp-service",
                        'f' => "fwmark-service",
                        's' => "scheduler",
                        'p' => "persistent",
                        'M' => "netmask",
                        'r' => "real-server",
                        'm' => "masquerading",
                        'i' => "ipip",
                        'g' => "gatewaying",
                        'w' => "weight",
                        'x' => "u-threshold",
                        'y' => "l-threshold",
                        '6' => "ipv6",
                        'o' => "ops",
                        'b' => "sched-flags",
                        'n' => "numeric",
                        _ => return Err(perr(line, format!("unknown option `{tok}'"))),
                    };
                    (name, (!rest.is_empty()).then_some(rest))
                }
                None => return Err(perr(line, "empty option `-'")),
            }
        } else {
            positional.push(tok);
            continue;
        };
        let mut value = |required: bool| -> Result<Option<String>, ParseError> {
            if let Some(v) = attached {
                return Ok(Some(v.to_owned()));
            }
            if required {
                match toks.get(i) {
                    Some(v) => {
                        i += 1;
                        Ok(Some((*v).to_owned()))
                    }
                    None => Err(perr(line, format!("option `{tok}' needs a value"))),
                }
            } else {
                match toks.get(i) {
                    Some(v) if !v.starts_with('-') => {
                        i += 1;
                        Ok(Some((*v).to_owned()))
                    }
                    _ => Ok(None),
                }
            }
        };
        let req = |v: Option<String>| v.unwrap_or_default();
        match name {
            "add-service" => set_cmd(&mut l, Cmd::Add, line)?,
            "edit-service" => set_cmd(&mut l, Cmd::Edit, line)?,
            "delete-service" => set_cmd(&mut l, Cmd::Del, line)?,
            "clear" => set_cmd(&mut l, Cmd::Clear, line)?,
            "add-server" => set_cmd(&mut l, Cmd::AddDest, line)?,
            "edit-server" => set_cmd(&mut l, Cmd::EditDest, line)?,
            "delete-server" => set_cmd(&mut l, Cmd::DelDest, line)?,
            "set" => set_cmd(&mut l, Cmd::Set, line)?,
            "tcp-service" | "udp-service" | "sctp-service" => {
                let v = req(value(true)?);
                l.protocol = Some(match name {
                    "tcp-service" => Protocol::Tcp,
                    "udp-service" => Protocol::Udp,
                    _ => Protocol::Sctp,
                });
                let (a, p) = parse_addr_port(&v).ok_or_else(|| {
                    perr(line, format!("illegal virtual server address[:port] `{v}'"))
                })?;
                l.vaddr = Some((a, p.unwrap_or(0)));
                l.fwmark = None;
            }
            "fwmark-service" => {
                let v = req(value(true)?);
                let m = parse_number(&v, 1, i64::from(u32::MAX))
                    .ok_or_else(|| perr(line, format!("invalid fwmark value `{v}'")))?;
                l.fwmark = u32::try_from(m).ok();
                l.vaddr = None;
                l.protocol = None;
            }
            "ipv6" => {
                if l.fwmark.is_none() {
                    return Err(perr(line, "-6 used before -f"));
                }
                l.fwmark6 = true;
            }
            "scheduler" => l.scheduler = Some(req(value(true)?)),
            "persistent" => {
                let t = match value(false)? {
                    Some(v) => parse_number(&v, 1, i64::from(MAX_TIMEOUT))
                        .and_then(|n| u32::try_from(n).ok())
                        .ok_or_else(|| perr(line, format!("invalid timeout value `{v}'")))?,
                    None => DEFAULT_PERSISTENT_TIMEOUT,
                };
                l.persistent = Some(t);
            }
            "netmask" => l.netmask = Some(req(value(true)?)),
            "ops" => l.onepacket = true,
            "pe" => l.pe = Some(req(value(true)?)),
            "sched-flags" => l.sched_flags = Some(req(value(true)?)),
            "real-server" => {
                let v = req(value(true)?);
                l.real = Some(parse_addr_port(&v).ok_or_else(|| {
                    perr(line, format!("illegal real server address[:port] `{v}'"))
                })?);
            }
            "masquerading" => l.fwd = Some(ForwardMethod::Masq),
            "ipip" => l.fwd = Some(ForwardMethod::Tunnel),
            "gatewaying" => l.fwd = Some(ForwardMethod::Route),
            "weight" | "u-threshold" | "l-threshold" => {
                let v = req(value(true)?);
                let max = if name == "weight" {
                    65535
                } else {
                    i64::from(i32::MAX)
                };
                let n = parse_number(&v, 0, max)
                    .and_then(|n| u32::try_from(n).ok())
                    .ok_or_else(|| perr(line, format!("illegal {name} `{v}'")))?;
                match name {
                    "weight" => l.weight = Some(n),
                    "u-threshold" => l.u_thresh = Some(n),
                    _ => l.l_thresh = Some(n),
                }
            }
            "tun-type" => {
                let v = req(value(true)?);
                l.tun_type = Some(match v.as_str() {
                    "ipip" => TunnelType::Ipip,
                    "gue" => TunnelType::Gue,
                    "gre" => TunnelType::Gre,
                    _ => return Err(perr(line, format!("illegal tunnel type `{v}'"))),
                });
            }
            "tun-port" => {
                let v = req(value(true)?);
                l.tun_port = parse_number(&v, 1, 65535)
                    .and_then(|n| u16::try_from(n).ok())
                    .map(Some)
                    .ok_or_else(|| perr(line, format!("illegal tunnel port `{v}'")))?;
            }
            "tun-nocsum" => l.tun_flags.push(tunnel_flags::NOCSUM),
            "tun-csum" => l.tun_flags.push(tunnel_flags::CSUM),
            "tun-remcsum" => l.tun_flags.push(tunnel_flags::REMCSUM),
            "numeric" | "sort" => {}
            other => return Err(perr(line, format!("unsupported option `--{other}'"))),
        }
    }
    if l.cmd == Some(Cmd::Set) {
        if positional.len() != 3 {
            return Err(perr(line, "--set needs 3 timeout values"));
        }
        for p in &positional {
            let n = parse_number(p, 0, i64::from(MAX_TIMEOUT))
                .and_then(|n| u32::try_from(n).ok())
                .ok_or_else(|| perr(line, format!("invalid timeout value `{p}'")))?;
            l.set_args.push(n);
        }
    } else if let Some(p) = positional.first() {
        return Err(perr(line, format!("unexpected argument `{p}'")));
    }
    Ok(l)
}

fn line_key(l: &Line, line: usize) -> Result<ServiceKey, ParseError> {
    if let Some(mark) = l.fwmark {
        let family = if l.fwmark6 {
            Family::Inet6
        } else {
            Family::Inet
        };
        return Ok(ServiceKey::Fwmark { family, mark });
    }
    match (l.protocol, l.vaddr) {
        (Some(protocol), Some((addr, port))) => Ok(ServiceKey::Inet {
            protocol,
            addr,
            port,
        }),
        _ => Err(perr(
            line,
            "no service given (-t, -u, --sctp-service or -f)",
        )),
    }
}

fn parse_sched_flags(sched: &str, arg: &str, line: usize) -> Result<u32, ParseError> {
    let mut flags = 0;
    for f in arg.split(',').filter(|f| !f.is_empty()) {
        let (bit, needs) = match f {
            "flag-1" => (ServiceFlags::SCHED1, None),
            "flag-2" => (ServiceFlags::SCHED2, None),
            "flag-3" => (ServiceFlags::SCHED3, None),
            "sh-fallback" => (ServiceFlags::SH_FALLBACK, Some("sh")),
            "sh-port" => (ServiceFlags::SH_PORT, Some("sh")),
            "mh-fallback" => (ServiceFlags::MH_FALLBACK, Some("mh")),
            "mh-port" => (ServiceFlags::MH_PORT, Some("mh")),
            _ => return Err(perr(line, format!("invalid scheduler flag `{f}'"))),
        };
        if let Some(s) = needs {
            if s != sched {
                return Err(perr(line, format!("incompatible scheduler flag `{f}'")));
            }
        }
        flags |= bit;
    }
    Ok(flags)
}

fn line_service(l: &Line, line: usize) -> Result<Service, ParseError> {
    let key = line_key(l, line)?;
    let scheduler = l
        .scheduler
        .clone()
        .unwrap_or_else(|| DEFAULT_SCHEDULER.to_owned());
    if scheduler.is_empty() || scheduler.len() >= 16 {
        return Err(perr(line, format!("bad scheduler name `{scheduler}'")));
    }
    let mut s = Service::new(key, scheduler);
    if let Some(t) = l.persistent {
        s.flags = s.flags.with(ServiceFlags::PERSISTENT);
        s.timeout = t;
    }
    if let Some(m) = &l.netmask {
        s.netmask = match key.family() {
            Family::Inet => u32::from(m.parse::<Ipv4Addr>().map_err(|_| {
                perr(
                    line,
                    format!("illegal virtual server persistent mask `{m}'"),
                )
            })?),
            Family::Inet6 => u32::try_from(
                parse_number(m, 1, 128)
                    .ok_or_else(|| perr(line, format!("illegal ipv6 netmask `{m}'")))?,
            )
            .unwrap_or(128),
        };
    }
    if l.onepacket {
        if !matches!(
            key,
            ServiceKey::Fwmark { .. }
                | ServiceKey::Inet {
                    protocol: Protocol::Udp,
                    ..
                }
        ) {
            return Err(perr(
                line,
                "One-Packet Scheduling is only for UDP virtual services",
            ));
        }
        s.flags = s.flags.with(ServiceFlags::ONEPACKET);
    }
    if let Some(pe) = &l.pe {
        if pe.len() >= 16 {
            return Err(perr(line, format!("bad persistence engine `{pe}'")));
        }
        s.pe_name = Some(pe.clone());
    }
    if let Some(f) = &l.sched_flags {
        s.flags = s.flags.with(parse_sched_flags(&s.scheduler, f, line)?);
    }
    if let ServiceKey::Inet { port: 0, .. } = key {
        if !s.flags.contains(ServiceFlags::PERSISTENT) {
            return Err(perr(line, "Zero port specified for non-persistent service"));
        }
    }
    Ok(s)
}

fn line_dest(l: &Line, key: &ServiceKey, line: usize) -> Result<Destination, ParseError> {
    line_dest_for(l, key, line, false)
}

/// Builds the real server of an -a/-e/-d line; ipvsadm applies the forwarding-method rules
/// (port forcing, family and tunnel checks) only when adding or editing.
fn line_dest_for(
    l: &Line,
    key: &ServiceKey,
    line: usize,
    delete: bool,
) -> Result<Destination, ParseError> {
    let (addr, port) = l
        .real
        .ok_or_else(|| perr(line, "no real server given (-r)"))?;
    let fwd = l.fwd.unwrap_or(ForwardMethod::Route);
    let vport = match key {
        ServiceKey::Inet { port, .. } => *port,
        ServiceKey::Fwmark { .. } => 0,
    };
    let mut port = port.unwrap_or(vport);
    if delete {
        return Ok(Destination::new(addr, port));
    }
    if matches!(key, ServiceKey::Inet { .. })
        && matches!(fwd, ForwardMethod::Tunnel | ForwardMethod::Route)
    {
        port = vport;
    }
    if Family::of(&addr) != key.family() && fwd != ForwardMethod::Tunnel {
        return Err(perr(
            line,
            "Different address family is allowed only for tunneling servers",
        ));
    }
    let mut d = Destination::new(addr, port);
    d.fwd = fwd;
    d.weight = l.weight.unwrap_or(1);
    d.upper_threshold = l.u_thresh.unwrap_or(0);
    d.lower_threshold = l.l_thresh.unwrap_or(0);
    let tun_opts = l.tun_type.is_some() || l.tun_port.is_some() || !l.tun_flags.is_empty();
    if tun_opts && fwd != ForwardMethod::Tunnel {
        return Err(perr(line, "Tunnel options conflict with forward method"));
    }
    if fwd == ForwardMethod::Tunnel {
        let t = l.tun_type.unwrap_or(TunnelType::Ipip);
        if l.tun_flags.len() > 1 {
            return Err(perr(
                line,
                "only one of --tun-nocsum/--tun-csum/--tun-remcsum",
            ));
        }
        let flags = l.tun_flags.first().copied();
        match t {
            TunnelType::Ipip if l.tun_port.is_some() || flags.is_some() => {
                return Err(perr(
                    line,
                    "Illegal tunnel option with the 'ipip' tunnel type",
                ))
            }
            TunnelType::Gue if l.tun_port.is_none() => {
                return Err(perr(
                    line,
                    "You need to supply the '--tun-port' option for the 'gue' tunnel type",
                ))
            }
            TunnelType::Gre if l.tun_port.is_some() || flags == Some(tunnel_flags::REMCSUM) => {
                return Err(perr(
                    line,
                    "Illegal tunnel option with the 'gre' tunnel type",
                ))
            }
            _ => {}
        }
        d.tun_type = t;
        d.tun_port = l.tun_port.unwrap_or(0);
        d.tun_flags = flags.unwrap_or(tunnel_flags::NOCSUM);
    }
    Ok(d)
}

/// Parses `ipvsadm` command lines (the `ipvsadm --restore` input: -A, -E, -D, -a, -e, -d, -C,
/// --set) into operations, in file order. Fails on the first bad line; nothing is returned then.
pub fn parse_commands(text: &str) -> Result<Vec<Op>, ParseError> {
    Ok(parse_commands_with_lines(text)?
        .into_iter()
        .map(|(_, op)| op)
        .collect())
}

/// Like [`parse_commands`], with the 1-based line number of every operation.
pub fn parse_commands_with_lines(text: &str) -> Result<Vec<(usize, Op)>, ParseError> {
    let mut ops = Vec::new();
    for (line, toks) in lines(text) {
        let l = parse_tokens(&toks, line)?;
        let cmd = l
            .cmd
            .ok_or_else(|| perr(line, "no command (-A, -E, -D, -a, -e, -d, -C, --set)"))?;
        let op = match cmd {
            Cmd::Add => Op::NewService(line_service(&l, line)?),
            Cmd::Edit => Op::SetService(line_service(&l, line)?),
            Cmd::Del => Op::DelService(line_key(&l, line)?),
            Cmd::AddDest | Cmd::EditDest => {
                let key = line_key(&l, line)?;
                let d = line_dest(&l, &key, line)?;
                if cmd == Cmd::AddDest {
                    Op::NewDest(key, d)
                } else {
                    Op::SetDest(key, d)
                }
            }
            Cmd::DelDest => {
                let key = line_key(&l, line)?;
                let d = line_dest_for(&l, &key, line, true)?;
                Op::DelDest(key, d.addr, d.port)
            }
            Cmd::Clear => Op::Flush,
            Cmd::Set => Op::SetTimeouts(Timeouts {
                tcp: l.set_args[0],
                tcp_fin: l.set_args[1],
                udp: l.set_args[2],
            }),
        };
        ops.push((line, op));
    }
    Ok(ops)
}

/// Parses a saved table (`-A` and `-a` lines only) into services with their real servers, in
/// file order. A real server must follow its service's `-A` line.
pub fn parse(text: &str) -> Result<Vec<(Service, Vec<Destination>)>, ParseError> {
    let mut out: Vec<(Service, Vec<Destination>)> = Vec::new();
    let mut index: std::collections::HashMap<ServiceKey, usize> = std::collections::HashMap::new();
    for (line, toks) in lines(text) {
        let l = parse_tokens(&toks, line)?;
        match l.cmd {
            Some(Cmd::Add) => {
                let s = line_service(&l, line)?;
                if index.contains_key(&s.key) {
                    return Err(perr(line, "service defined twice"));
                }
                index.insert(s.key, out.len());
                out.push((s, Vec::new()));
            }
            Some(Cmd::AddDest) => {
                let key = line_key(&l, line)?;
                let d = line_dest(&l, &key, line)?;
                let i = *index
                    .get(&key)
                    .ok_or_else(|| perr(line, "real server for a service not defined above"))?;
                if out[i]
                    .1
                    .iter()
                    .any(|x| x.addr == d.addr && x.port == d.port)
                {
                    return Err(perr(line, "real server defined twice"));
                }
                out[i].1.push(d);
            }
            _ => return Err(perr(line, "only -A and -a lines are allowed in a table")),
        }
    }
    Ok(out)
}

/// The operations that create `table` from an empty kernel table.
pub fn table_ops(table: &[(Service, Vec<Destination>)]) -> Vec<Op> {
    let mut ops = Vec::with_capacity(table.iter().map(|(_, d)| d.len() + 1).sum());
    for (s, dests) in table {
        ops.push(Op::NewService(s.clone()));
        for d in dests {
            ops.push(Op::NewDest(s.key, d.clone()));
        }
    }
    ops
}
