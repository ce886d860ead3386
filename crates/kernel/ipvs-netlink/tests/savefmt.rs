//! Unprivileged tests of the `ipvsadm -S` parser and renderer.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::net::{IpAddr, Ipv6Addr};
use std::process::Command;

use ipvs_netlink::savefmt::{self, format_ipv6, parse, parse_commands, render};
use ipvs_netlink::*;

/// Deterministic xorshift, so failures reproduce.
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
}

/// Addresses rich in zero runs, ties and the IPv4-embedded shapes.
fn interesting_v6(rng: &mut Rng) -> Ipv6Addr {
    let mut w = [0u16; 8];
    for x in &mut w {
        let r = rng.next();
        *x = match r % 5 {
            0 | 1 => 0,
            2 => (r >> 8) as u16 & 0xf,
            3 => 0xffff,
            _ => (r >> 16) as u16,
        };
    }
    if rng.next() % 6 == 0 {
        w = [0, 0, 0, 0, 0, 0xffff, w[6], w[7]];
    }
    if rng.next() % 6 == 0 {
        w = [0, 0, 0, 0, 0, 0, w[6], w[7]];
    }
    Ipv6Addr::from(w)
}

#[test]
fn ipv6_text_matches_glibc_inet_ntop() {
    // Python's socket.inet_ntop is glibc's inet_ntop: the same function ipvsadm prints with.
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    let mut addrs: Vec<Ipv6Addr> = (0..3000).map(|_| interesting_v6(&mut rng)).collect();
    addrs.extend(
        [
            "::",
            "::1",
            "::2",
            "1::",
            "::ffff:1.2.3.4",
            "::102:304",
            "1:0:0:1:0:0:1:1",
            "2001:db8::1",
            "fe80::1:0:0:1",
            "0:1::",
            "1:0:1:0:1:0:1:0",
        ]
        .iter()
        .map(|s| s.parse::<Ipv6Addr>().unwrap()),
    );
    let input: String = addrs
        .iter()
        .map(|a| {
            a.octets()
                .iter()
                .map(|b| format!("{b:02x}"))
                .collect::<String>()
                + "\n"
        })
        .collect();
    let script = "import sys,socket\nfor l in sys.stdin:\n print(socket.inet_ntop(socket.AF_INET6, bytes.fromhex(l.strip())))\n";
    let mut child = Command::new("python3")
        .arg("-c")
        .arg(script)
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .expect("python3 is needed to cross-check against glibc inet_ntop");
    use std::io::Write;
    child
        .stdin
        .take()
        .unwrap()
        .write_all(input.as_bytes())
        .unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(out.status.success());
    let glibc: Vec<&str> = std::str::from_utf8(&out.stdout).unwrap().lines().collect();
    assert_eq!(glibc.len(), addrs.len());
    let mut ipv4_forms = 0;
    for (a, want) in addrs.iter().zip(glibc) {
        assert_eq!(format_ipv6(a), want, "{:?}", a.segments());
        ipv4_forms += usize::from(want.contains('.'));
    }
    assert!(ipv4_forms > 10, "the sample must cover IPv4-embedded forms");
}

fn tcp(addr: &str, port: u16) -> ServiceKey {
    ServiceKey::Inet {
        protocol: Protocol::Tcp,
        addr: addr.parse().unwrap(),
        port,
    }
}

#[test]
fn render_matches_ipvsadm_printf_formats() {
    let v6: IpAddr = "2001:db8::1".parse().unwrap();
    let mut persistent = Service::new(tcp("10.0.0.2", 443), "sh");
    persistent.flags =
        ServiceFlags(ServiceFlags::PERSISTENT | ServiceFlags::HASHED | ServiceFlags::SH_FALLBACK);
    persistent.timeout = 10800;
    persistent.netmask = 0xffff_ff00;
    let mut udp6 = Service::new(
        ServiceKey::Inet {
            protocol: Protocol::Udp,
            addr: v6,
            port: 53,
        },
        "mh",
    );
    udp6.flags = ServiceFlags(
        ServiceFlags::PERSISTENT
            | ServiceFlags::ONEPACKET
            | ServiceFlags::MH_FALLBACK
            | ServiceFlags::MH_PORT,
    );
    udp6.timeout = 60;
    udp6.netmask = 64;
    udp6.pe_name = Some("sip".into());
    let fwm = Service::new(
        ServiceKey::Fwmark {
            family: Family::Inet6,
            mark: 3,
        },
        "rr",
    );
    let mut flag3 = Service::new(tcp("10.0.0.1", 80), "wrr");
    flag3.flags = ServiceFlags(ServiceFlags::SCHED3);
    let mut d_masq = Destination::new("10.1.0.9".parse().unwrap(), 8443);
    d_masq.weight = 2;
    let mut d_dr = Destination::new("10.1.0.3".parse().unwrap(), 443);
    d_dr.fwd = ForwardMethod::Route;
    d_dr.weight = 0;
    let mut d_gue = Destination::new("10.1.0.4".parse().unwrap(), 443);
    d_gue.fwd = ForwardMethod::Tunnel;
    d_gue.tun_type = TunnelType::Gue;
    d_gue.tun_port = 6080;
    d_gue.tun_flags = tunnel_flags::CSUM;
    let mut d_gre = Destination::new("10.1.0.5".parse().unwrap(), 443);
    d_gre.fwd = ForwardMethod::Tunnel;
    d_gre.tun_type = TunnelType::Gre;
    let mut d_local = Destination::new("10.1.0.6".parse().unwrap(), 443);
    d_local.fwd = ForwardMethod::Local;
    let d6 = Destination::new("2001:db8::a".parse().unwrap(), 5353);
    let table = vec![
        (fwm, vec![]),
        (udp6, vec![d6]),
        (persistent, vec![d_masq, d_gre, d_dr, d_local, d_gue]),
        (flag3, vec![]),
    ];
    let want = "\
-A -t 10.0.0.1:80 -s wrr -b flag-3
-A -t 10.0.0.2:443 -s sh -p 10800 -M 255.255.255.0 -b sh-fallback
-a -t 10.0.0.2:443 -r 10.1.0.3:443 -g -w 0
-a -t 10.0.0.2:443 -r 10.1.0.4:443 -i -w 1 --tun-type gue --tun-port 6080 --tun-csum
-a -t 10.0.0.2:443 -r 10.1.0.5:443 -i -w 1 --tun-type gre --tun-nocsum
-a -t 10.0.0.2:443 -r 10.1.0.6:443 -g -w 1
-a -t 10.0.0.2:443 -r 10.1.0.9:8443 -m -w 2
-A -u [2001:db8::1]:53 -s mh -p 60 -M 64 --pe sip -o -b mh-fallback,mh-port
-a -u [2001:db8::1]:53 -r [2001:db8::a]:5353 -m -w 1
-A -f 3 -6 -s rr
";
    assert_eq!(render(&table), want);
}

#[test]
fn sort_reproduces_ipvsadm_wrapping_comparison() {
    // ipvsadm compares addresses with `int r = ntohl(a) - ntohl(b)`: 10.0.0.1 - 200.0.0.1
    // wraps to a positive int, so 200.0.0.1 sorts first. Likewise for fwmarks >= 2^31, which
    // sort before address services.
    let table = vec![
        (Service::new(tcp("10.0.0.1", 80), "rr"), vec![]),
        (Service::new(tcp("200.0.0.1", 80), "rr"), vec![]),
        (
            Service::new(
                ServiceKey::Fwmark {
                    family: Family::Inet,
                    mark: 0x8000_0001,
                },
                "rr",
            ),
            vec![],
        ),
        (
            Service::new(
                ServiceKey::Fwmark {
                    family: Family::Inet,
                    mark: 5,
                },
                "rr",
            ),
            vec![],
        ),
    ];
    let lines: Vec<String> = render(&table).lines().map(String::from).collect();
    // Merge sort, step by step: [10, 200]: cmp = 0x0a000001 - 0xc8000001 = 0x42000000 > 0
    // -> 200, 10. [fwBig, fw5]: cmp = 0x80000001 - 5 = 0x7ffffffc > 0 -> fw5, fwBig.
    // Merge: cmp(200, fw5) = 0 - 5 < 0 -> 200; cmp(10, fw5) < 0 -> 10; then fw5, fwBig.
    // (A consistent total order would put fwBig before the address services: 0 - 0x80000001
    // as int is positive.)
    assert_eq!(
        lines,
        vec![
            "-A -t 200.0.0.1:80 -s rr",
            "-A -t 10.0.0.1:80 -s rr",
            "-A -f 5 -s rr",
            "-A -f -2147483647 -s rr",
        ]
    );
}

const TABLE: &str = "\
# a comment line
-A -t 10.0.0.1:80 -s rr
-a -t 10.0.0.1:80 -r 10.1.0.1:8080 -m -w 3   # trailing comment
ipvsadm -a -t 10.0.0.1:80 -r 10.1.0.2:8080 -m
-A -u [2001:db8::1]:53 -s sh -b sh-fallback,sh-port -p 60 -M 64
-a -u [2001:db8::1]:53 -r [2001:db8::10]:53 -m -w 2 -x 100 -y 10
-A -f 7 -s mh -b mh-port
-a -f 7 -r 10.9.0.1:81 -g
-A -f 9 -6 -p
-A --sctp-service 10.0.0.3:3868 -s lc -p 100 -M 255.255.255.0
-a --sctp-service 10.0.0.3:3868 -r 10.2.0.1:9999 -g -w 0
-a --sctp-service 10.0.0.3:3868 -r 2001:db8::77 -i --tun-type gue --tun-port 6080 --tun-remcsum
-A -u 10.0.0.4:5060 -s rr -o --pe sip -p
";

#[test]
fn parse_table_applies_ipvsadm_defaults() {
    let t = parse(TABLE).unwrap();
    assert_eq!(t.len(), 6);
    let (s, d) = &t[0];
    assert_eq!((s.key, s.scheduler.as_str()), (tcp("10.0.0.1", 80), "rr"));
    assert_eq!(s.netmask, u32::MAX);
    assert_eq!(d.len(), 2);
    assert_eq!((d[0].weight, d[0].fwd), (3, ForwardMethod::Masq));
    assert_eq!(d[1].weight, 1, "default weight");
    let (s, d) = &t[1];
    assert_eq!(
        s.flags.0,
        ServiceFlags::PERSISTENT | ServiceFlags::SH_FALLBACK | ServiceFlags::SH_PORT
    );
    assert_eq!((s.timeout, s.netmask), (60, 64));
    assert_eq!((d[0].upper_threshold, d[0].lower_threshold), (100, 10));
    let (s, d) = &t[2];
    assert_eq!(s.netmask, u32::MAX);
    assert_eq!(d[0].fwd, ForwardMethod::Route, "default forwarding is -g");
    assert_eq!(d[0].port, 81, "fwmark services keep the given port");
    let (s, _) = &t[3];
    assert_eq!(
        s.key,
        ServiceKey::Fwmark {
            family: Family::Inet6,
            mark: 9
        }
    );
    assert_eq!(
        (s.scheduler.as_str(), s.timeout, s.netmask),
        ("wlc", 360, 128)
    );
    let (s, d) = &t[4];
    assert_eq!(s.netmask, 0xffff_ff00);
    assert_eq!(d[0].port, 3868, "direct routing forces the virtual port");
    assert_eq!(d[1].addr, "2001:db8::77".parse::<IpAddr>().unwrap());
    assert_eq!(
        (d[1].tun_type, d[1].tun_port, d[1].tun_flags),
        (TunnelType::Gue, 6080, tunnel_flags::REMCSUM)
    );
    let (s, _) = &t[5];
    assert!(s.flags.contains(ServiceFlags::ONEPACKET));
    assert_eq!(s.pe_name.as_deref(), Some("sip"));
}

#[test]
fn render_parse_round_trip() {
    let t = parse(TABLE).unwrap();
    let text = render(&t);
    let again = parse(&text).unwrap();
    // Thresholds are not part of the -S output; everything else survives.
    let strip = |t: &[(Service, Vec<Destination>)]| {
        let mut t = t.to_vec();
        for (_, ds) in &mut t {
            for d in ds.iter_mut() {
                d.upper_threshold = 0;
                d.lower_threshold = 0;
            }
            ds.sort_by_key(|d| (d.addr, d.port));
        }
        t.sort_by_key(|(s, _)| s.key);
        t
    };
    assert_eq!(strip(&t), strip(&again));
    assert_eq!(render(&again), text);
}

#[test]
fn parse_errors_carry_the_line_number_and_nothing_is_returned() {
    let cases = [
        (
            "-A -t 10.0.0.1:80\n-A -t 10.0.0.300:80\n",
            2,
            "illegal virtual server",
        ),
        ("\n\n-A -t 10.0.0.1:80 --bogus\n", 3, "unsupported option"),
        ("-A -t 10.0.0.1:80 -Q\n", 1, "unknown option"),
        ("-a -t 10.0.0.1:80 -r 10.1.0.1\n", 1, "not defined above"),
        ("-A -t 10.0.0.1:0\n", 1, "Zero port"),
        ("-A -t 10.0.0.1:80 -o\n", 1, "One-Packet"),
        ("-A -t 10.0.0.1:80 -s rr -b sh-port\n", 1, "incompatible"),
        (
            "-A -t 10.0.0.1:80 -s rr -b bogus\n",
            1,
            "invalid scheduler flag",
        ),
        (
            "-A -t 10.0.0.1:80\n-a -t 10.0.0.1:80 -r [::1]:80 -m\n",
            2,
            "Different address family",
        ),
        (
            "-A -t 10.0.0.1:80\n-a -t 10.0.0.1:80 -r 10.1.0.1 -m --tun-type gre\n",
            2,
            "Tunnel options",
        ),
        (
            "-A -t 10.0.0.1:80\n-a -t 10.0.0.1:80 -r 10.1.0.1 -i --tun-type gue\n",
            2,
            "tun-port",
        ),
        (
            "-A -t 10.0.0.1:80\n-a -t 10.0.0.1:80 -r 10.1.0.1 -m -w 65536\n",
            2,
            "illegal weight",
        ),
        ("-A -t 10.0.0.1:80 -p 0\n", 1, "invalid timeout"),
        ("-A -t 10.0.0.1:80 -M 255.255.255.0.1 -p\n", 1, "mask"),
        ("-A -t 10.0.0.1:80\n-A -t 10.0.0.1:80\n", 2, "twice"),
        ("-A -f 0\n", 1, "fwmark"),
        ("-A -6 -f 1\n", 1, "-6 used before -f"),
        ("-A -t 10.0.0.1:80 extra\n", 1, "unexpected argument"),
        ("-t 10.0.0.1:80\n", 1, "only -A and -a"),
        ("-A -t 10.0.0.1:80 -s\n", 1, "needs a value"),
        ("-A -D -t 10.0.0.1:80\n", 1, "more than one command"),
    ];
    for (text, line, needle) in cases {
        let e = parse(text).unwrap_err();
        assert_eq!(e.line, line, "{text:?}: {e}");
        assert!(e.message.contains(needle), "{text:?}: {e}");
    }
}

#[test]
fn parse_commands_maps_every_command() {
    let text = "\
-C
--set 900 120 300
-A -t 10.0.0.1:80 -s rr
-E -t 10.0.0.1:80 -s wrr -p 30
-a -t 10.0.0.1:80 -r 10.1.0.1:81 -m
-e -t 10.0.0.1:80 -r 10.1.0.1:81 -m -w 5
-d -t 10.0.0.1:80 -r 10.1.0.1:81
-D -t 10.0.0.1:80
--add-service --udp-service=10.0.0.9:53 --scheduler=nq
";
    let ops = parse_commands(text).unwrap();
    let key = tcp("10.0.0.1", 80);
    assert_eq!(ops.len(), 9);
    assert_eq!(ops[0], Op::Flush);
    assert_eq!(
        ops[1],
        Op::SetTimeouts(Timeouts {
            tcp: 900,
            tcp_fin: 120,
            udp: 300
        })
    );
    assert!(matches!(&ops[2], Op::NewService(s) if s.key == key && s.scheduler == "rr"));
    assert!(matches!(&ops[3], Op::SetService(s) if s.scheduler == "wrr" && s.timeout == 30));
    assert!(matches!(&ops[4], Op::NewDest(k, d) if *k == key && d.port == 81 && d.weight == 1));
    assert!(matches!(&ops[5], Op::SetDest(_, d) if d.weight == 5));
    assert_eq!(
        ops[6],
        Op::DelDest(key, "10.1.0.1".parse().unwrap(), 81),
        "ipvsadm forces the virtual port for -g only on -a/-e, not on -d"
    );
    assert_eq!(ops[7], Op::DelService(key));
    assert!(matches!(&ops[8], Op::NewService(s) if s.scheduler == "nq"
        && s.key == ServiceKey::Inet { protocol: Protocol::Udp, addr: "10.0.0.9".parse().unwrap(), port: 53 }));
    let e = parse_commands("-A -t 1.2.3.4:5\n-L\n").unwrap_err();
    assert_eq!(e.line, 2);
    assert_eq!(savefmt::DEFAULT_PERSISTENT_TIMEOUT, 360);
}
