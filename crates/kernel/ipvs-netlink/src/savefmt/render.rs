//! Rendering: the `ipvsadm -Sn` lines of a table, in ipvsadm's own sort order (glibc's merge
//! sort with ipvsadm's comparators).

use std::fmt::Write as _;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use crate::types::{
    tunnel_flags, Destination, Family, ForwardMethod, Protocol, Service, ServiceFlags, ServiceKey,
    TunnelType,
};

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
