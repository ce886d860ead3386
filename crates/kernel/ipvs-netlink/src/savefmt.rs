//! The `ipvsadm -S` text format: a parser (table and command forms) and a renderer that
//! prints exactly what `ipvsadm -Sn` (ipvsadm 1.31) prints, including its sort order.

use std::fmt::Write as _;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use crate::error::ParseError;
use crate::types::{
    tunnel_flags, Destination, Family, ForwardMethod, Op, Protocol, Service, ServiceFlags,
    ServiceKey, Timeouts, TunnelType,
};

/// ipvsadm's default scheduler (`DEF_SCHED`).
pub const DEFAULT_SCHEDULER: &str = "wlc";
/// ipvsadm's default persistence timeout for `-p` without a value (`IPVS_SVC_PERSISTENT_TIMEOUT`).
pub const DEFAULT_PERSISTENT_TIMEOUT: u32 = 360;
/// ipvsadm's largest timeout (31 days).
pub const MAX_TIMEOUT: u32 = 86400 * 31;

// ---------------------------------------------------------------------------------------------
// Rendering

/// Formats an IPv6 address like glibc's `inet_ntop` (which ipvsadm uses), including its
/// IPv4-embedded forms (`::a.b.c.d`, `::ffff:a.b.c.d`).
pub fn format_ipv6(a: &Ipv6Addr) -> String {
    let w = a.segments();
    // Longest run of zero words (length >= 2), first one wins ties.
    let (mut best_base, mut best_len) = (None::<usize>, 0usize);
    let (mut cur_base, mut cur_len) = (None::<usize>, 0usize);
    for (i, &word) in w.iter().enumerate() {
        if word == 0 {
            if cur_base.is_none() {
                cur_base = Some(i);
                cur_len = 1;
            } else {
                cur_len += 1;
            }
        } else if let Some(b) = cur_base.take() {
            if best_base.is_none() || cur_len > best_len {
                best_base = Some(b);
                best_len = cur_len;
            }
        }
    }
    if let Some(b) = cur_base {
        if best_base.is_none() || cur_len > best_len {
            best_base = Some(b);
            best_len = cur_len;
        }
    }
    if best_len < 2 {
        best_base = None;
    }
    let mut out = String::with_capacity(40);
    let in_best = |i: usize| best_base.is_some_and(|b| i >= b && i < b + best_len);
    let mut i = 0;
    while i < 8 {
        if in_best(i) {
            if best_base == Some(i) {
                out.push(':');
            }
            i += 1;
            continue;
        }
        if i != 0 {
            out.push(':');
        }
        if i == 6 && best_base == Some(0) && (best_len == 6 || (best_len == 5 && w[5] == 0xffff)) {
            let o = a.octets();
            let _ = write!(out, "{}.{}.{}.{}", o[12], o[13], o[14], o[15]);
            return out;
        }
        let _ = write!(out, "{:x}", w[i]);
        i += 1;
    }
    if let Some(b) = best_base {
        if b + best_len == 8 {
            out.push(':');
        }
    }
    out
}

fn addr_port(addr: &IpAddr, port: u16) -> String {
    match addr {
        IpAddr::V4(a) => format!("{a}:{port}"),
        IpAddr::V6(a) => format!("[{}]:{port}", format_ipv6(a)),
    }
}

/// The service part of a rule line (`-t 10.0.0.1:80`, `-f 5 -6`, ...).
pub fn service_arg(key: &ServiceKey) -> String {
    match key {
        // ipvsadm prints the mark with %d.
        ServiceKey::Fwmark { family, mark } => match family {
            Family::Inet => format!("-f {}", *mark as i32),
            Family::Inet6 => format!("-f {} -6", *mark as i32),
        },
        ServiceKey::Inet {
            protocol,
            addr,
            port,
        } => {
            let opt = match protocol {
                Protocol::Tcp => "-t",
                Protocol::Udp => "-u",
                Protocol::Sctp => "--sctp-service",
            };
            format!("{opt} {}", addr_port(addr, *port))
        }
    }
}

fn sched_flags_text(s: &Service) -> String {
    let f = s.flags;
    let mut parts: Vec<&str> = Vec::new();
    match s.scheduler.as_str() {
        "sh" => {
            if f.contains(ServiceFlags::SH_FALLBACK) {
                parts.push("sh-fallback");
            }
            if f.contains(ServiceFlags::SH_PORT) {
                parts.push("sh-port");
            }
        }
        "mh" => {
            if f.contains(ServiceFlags::MH_FALLBACK) {
                parts.push("mh-fallback");
            }
            if f.contains(ServiceFlags::MH_PORT) {
                parts.push("mh-port");
            }
        }
        _ => {
            if f.contains(ServiceFlags::SCHED1) {
                parts.push("flag-1");
            }
            if f.contains(ServiceFlags::SCHED2) {
                parts.push("flag-2");
            }
            if f.contains(ServiceFlags::SCHED3) {
                parts.push("flag-3");
            }
        }
    }
    parts.join(",")
}

/// The `-A` line of a service (without the newline).
pub fn service_line(s: &Service) -> String {
    let mut out = format!("-A {} -s {}", service_arg(&s.key), s.scheduler);
    if s.flags.contains(ServiceFlags::PERSISTENT) {
        let _ = write!(out, " -p {}", s.timeout);
        match s.key.family() {
            Family::Inet if s.netmask != u32::MAX => {
                let _ = write!(out, " -M {}", Ipv4Addr::from(s.netmask));
            }
            Family::Inet6 if s.netmask != 128 => {
                let _ = write!(out, " -M {}", s.netmask as i32);
            }
            _ => {}
        }
    }
    if let Some(pe) = &s.pe_name {
        if !pe.is_empty() {
            let _ = write!(out, " --pe {pe}");
        }
    }
    if s.flags.contains(ServiceFlags::ONEPACKET) {
        out.push_str(" -o");
    }
    if s.flags.0 & (ServiceFlags::SCHED1 | ServiceFlags::SCHED2 | ServiceFlags::SCHED3) != 0 {
        let _ = write!(out, " -b {}", sched_flags_text(s));
    }
    out
}

fn fwd_switch(f: ForwardMethod) -> &'static str {
    match f {
        ForwardMethod::Masq => "-m",
        ForwardMethod::Tunnel => "-i",
        ForwardMethod::Local | ForwardMethod::Route => "-g",
        // printf("%s", NULL) in glibc.
        ForwardMethod::Bypass => "(null)",
    }
}

fn tun_flags_opt(flags: u16) -> Option<&'static str> {
    match flags {
        tunnel_flags::NOCSUM => Some("--tun-nocsum"),
        tunnel_flags::CSUM => Some("--tun-csum"),
        tunnel_flags::REMCSUM => Some("--tun-remcsum"),
        _ => None,
    }
}

/// The `-a` line of a real server (without the newline).
pub fn dest_line(key: &ServiceKey, d: &Destination) -> String {
    let mut out = format!(
        "-a {} -r {} {} -w {}",
        service_arg(key),
        addr_port(&d.addr, d.port),
        fwd_switch(d.fwd),
        d.weight as i32
    );
    if d.fwd == ForwardMethod::Tunnel {
        match (d.tun_type, tun_flags_opt(d.tun_flags)) {
            (TunnelType::Gre, Some(f)) => {
                let _ = write!(out, " --tun-type gre {f}");
            }
            (TunnelType::Gue, Some(f)) => {
                let _ = write!(out, " --tun-type gue --tun-port {} {f}", d.tun_port);
            }
            (TunnelType::Ipip, _) => out.push_str(" --tun-type ipip"),
            _ => {}
        }
    }
    out
}

fn addr_words(addr: &IpAddr) -> [u32; 4] {
    match addr {
        IpAddr::V4(a) => [u32::from(*a), 0, 0, 0],
        IpAddr::V6(a) => {
            let o = a.octets();
            let w = |i: usize| u32::from_be_bytes([o[i], o[i + 1], o[i + 2], o[i + 3]]);
            [w(0), w(4), w(8), w(12)]
        }
    }
}

/// `a - b` as C computes `int r = (unsigned) a - (unsigned) b`.
fn csub(a: u32, b: u32) -> i32 {
    a.wrapping_sub(b) as i32
}

fn cmp_addr(family: Family, a: &IpAddr, b: &IpAddr) -> i32 {
    let (wa, wb) = (addr_words(a), addr_words(b));
    match family {
        Family::Inet => csub(wa[0], wb[0]),
        Family::Inet6 => {
            for i in 0..4 {
                let r = csub(wa[i], wb[i]);
                if r != 0 {
                    return r;
                }
            }
            0
        }
    }
}

/// ipvsadm's service comparison (`ipvs_cmp_services`), with its C integer arithmetic.
pub fn cmp_services(a: &ServiceKey, b: &ServiceKey) -> i32 {
    let parts = |k: &ServiceKey| -> (u32, u16, u16, IpAddr, u16) {
        match k {
            ServiceKey::Fwmark { family, mark } => {
                (*mark, family.to_af(), 0, family.unspecified(), 0)
            }
            ServiceKey::Inet {
                protocol,
                addr,
                port,
            } => (
                0,
                Family::of(addr).to_af(),
                u16::from(protocol.number()),
                *addr,
                *port,
            ),
        }
    };
    let (ma, afa, pa, aa, porta) = parts(a);
    let (mb, afb, pb, ab, portb) = parts(b);
    let r = csub(ma, mb);
    if r != 0 {
        return r;
    }
    let r = i32::from(afa) - i32::from(afb);
    if r != 0 {
        return r;
    }
    let r = i32::from(pa) - i32::from(pb);
    if r != 0 {
        return r;
    }
    let r = cmp_addr(a.family(), &aa, &ab);
    if r != 0 {
        return r;
    }
    i32::from(porta) - i32::from(portb)
}

/// ipvsadm's real-server comparison (`ipvs_cmp_dests`): by the first one's family.
pub fn cmp_dests(a: &Destination, b: &Destination) -> i32 {
    let r = cmp_addr(Family::of(&a.addr), &a.addr, &b.addr);
    if r != 0 {
        return r;
    }
    i32::from(a.port) - i32::from(b.port)
}

/// Sorts like glibc's `qsort` (a top-down merge sort), so that even ipvsadm's
/// non-transitive comparisons give the same order.
pub fn glibc_msort<T>(v: &mut Vec<T>, cmp: &impl Fn(&T, &T) -> i32) {
    let n = v.len();
    if n <= 1 {
        return;
    }
    let mut idx: Vec<usize> = (0..n).collect();
    let mut tmp: Vec<usize> = Vec::with_capacity(n);
    msort_idx(v, &mut idx, &mut tmp, cmp);
    let mut slots: Vec<Option<T>> = v.drain(..).map(Some).collect();
    for i in idx {
        if let Some(x) = slots[i].take() {
            v.push(x);
        }
    }
}

fn msort_idx<T>(v: &[T], idx: &mut [usize], tmp: &mut Vec<usize>, cmp: &impl Fn(&T, &T) -> i32) {
    let n = idx.len();
    if n <= 1 {
        return;
    }
    let n1 = n / 2;
    {
        let (l, r) = idx.split_at_mut(n1);
        msort_idx(v, l, tmp, cmp);
        msort_idx(v, r, tmp, cmp);
    }
    tmp.clear();
    let (mut i, mut j) = (0, n1);
    while i < n1 && j < n {
        if cmp(&v[idx[i]], &v[idx[j]]) <= 0 {
            tmp.push(idx[i]);
            i += 1;
        } else {
            tmp.push(idx[j]);
            j += 1;
        }
    }
    tmp.extend_from_slice(&idx[i..n1]);
    tmp.extend_from_slice(&idx[j..n]);
    idx.copy_from_slice(tmp);
}

/// Renders a table exactly as `ipvsadm -Sn` prints it (services and real servers sorted the
/// way ipvsadm sorts them).
///
/// ipvsadm compares addresses with wrapping `int` subtraction, which is not a total order
/// when two addresses (or fwmarks) are 2^31 or more apart (e.g. 10.x and 192.168.x). Then its
/// output depends on the input order, i.e. the kernel's hash-table order: pass the table in
/// kernel dump order (as [`crate::Client::dump`] returns it) for a byte-exact match. For tables
/// without such pairs the output is the same for any input order.
pub fn render(table: &[(Service, Vec<Destination>)]) -> String {
    let mut order: Vec<(&Service, Vec<&Destination>)> =
        table.iter().map(|(s, d)| (s, d.iter().collect())).collect();
    glibc_msort(&mut order, &|a, b| cmp_services(&a.0.key, &b.0.key));
    let mut out = String::with_capacity(table.len() * 64);
    for (s, dests) in &mut order {
        out.push_str(&service_line(s));
        out.push('\n');
        glibc_msort(dests, &|a, b| cmp_dests(a, b));
        for d in dests.iter() {
            out.push_str(&dest_line(&s.key, d));
            out.push('\n');
        }
    }
    out
}

// ---------------------------------------------------------------------------------------------
// Parsing

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
