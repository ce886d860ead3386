//! VM tests against a real IPVS kernel, cross-checked with the real `ipvsadm`.
//! Run by `cargo xtask test --stage vm` (or `cargo xtask vm -- BIN --ignored vm_ --test-threads=1`).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::io::Write;
use std::net::IpAddr;
use std::path::PathBuf;
use std::process::{Command, Output, Stdio};

use ipvs_netlink::savefmt::{parse, render, table_ops};
use ipvs_netlink::*;

/// Every feature at once: all schedulers, scheduler flags, persistence with netmasks, one-packet,
/// persistence engine, all forwarding methods, tunnel types and flags, thresholds, IPv6, SCTP,
/// fwmark (v4 and v6), port-zero services, mixed-family tunnel, extreme weights and addresses
/// whose order exercises ipvsadm's wrapping comparisons.
const TABLE: &str = "\
-A -t 10.0.0.1:80 -s rr
-a -t 10.0.0.1:80 -r 10.1.0.1:8080 -m -w 1 -x 100 -y 10
-a -t 10.0.0.1:80 -r 10.1.0.2:8080 -m -w 65535
-a -t 10.0.0.1:80 -r 10.1.0.3:80 -g -w 0
-a -t 10.0.0.1:80 -r 10.1.0.4:80 -i -w 3
-A -t 10.0.1.1:80 -s rr
-a -t 10.0.1.1:80 -r 10.1.1.1:80 -m
-A -t 10.0.1.2:80 -s wrr
-a -t 10.0.1.2:80 -r 10.1.1.2:80 -m -w 4
-A -t 10.0.1.3:80 -s lc
-A -t 10.0.1.4:80 -s wlc
-A -t 10.0.1.5:80 -s lblc
-A -t 10.0.1.6:80 -s lblcr
-A -t 10.0.1.7:80 -s dh
-A -t 10.0.1.8:80 -s sh
-A -t 10.0.1.9:80 -s sed
-A -t 10.0.1.10:80 -s nq
-A -t 10.0.1.11:80 -s mh
-A -t 10.0.1.12:80 -s fo
-A -t 10.0.1.13:80 -s ovf
-A -t 10.0.2.1:443 -s sh -b sh-fallback
-A -t 10.0.2.2:443 -s sh -b sh-port
-A -t 10.0.2.3:443 -s sh -b sh-fallback,sh-port
-A -t 10.0.2.4:443 -s mh -b mh-fallback,mh-port
-A -t 10.0.2.5:443 -s mh -b mh-port
-A -t 10.0.2.6:443 -s rr -b flag-1,flag-3
-A -t 10.0.3.1:80 -s wlc -p 300
-A -t 10.0.3.2:80 -s wlc -p 10800 -M 255.255.255.0
-A -t 10.0.3.3:0 -s rr -p 60
-a -t 10.0.3.3:0 -r 10.1.3.3:0 -m
-A -t 10.0.3.4:80 -s rr -p
-A -u 10.0.4.1:53 -s rr -o
-a -u 10.0.4.1:53 -r 10.1.4.1:53 -m
-A -u 10.0.4.3:53 -s sh -o -p 120 -M 255.255.0.0 -b sh-port
-A --sctp-service 10.0.5.1:3868 -s rr
-a --sctp-service 10.0.5.1:3868 -r 10.1.5.1:3868 -m -w 1
-a --sctp-service 10.0.5.1:3868 -r 10.1.5.2:3868 -g -w 2
-A -t [2001:db8::1]:80 -s wrr
-a -t [2001:db8::1]:80 -r [2001:db8:1::1]:8080 -m -w 2 -x 50
-a -t [2001:db8::1]:80 -r [2001:db8:1::2]:80 -g -w 1
-a -t [2001:db8::1]:80 -r [2001:db8:1::10]:80 -g -w 1
-A -u [2001:db8::2]:53 -s rr -p 60 -M 64
-a -u [2001:db8::2]:53 -r [fd00::53]:53 -m
-A --sctp-service [2001:db8::3]:3868 -s sh -b sh-port
-A -t [::ffff:10.9.9.9]:80 -s rr
-A -f 1 -s rr
-a -f 1 -r 10.1.6.1:0 -m -w 1
-a -f 1 -r 10.1.6.2:8080 -m -w 1
-A -f 2 -6 -s lc -p 100 -M 96
-a -f 2 -6 -r [2001:db8:2::1]:80 -m
-A -f 3 -s rr
-a -f 3 -r 10.1.7.1 -g
-A -f 4 -s wlc -o
-A -t 10.0.8.1:80 -s rr
-a -t 10.0.8.1:80 -r 10.1.8.1 -i --tun-type ipip
-a -t 10.0.8.1:80 -r 10.1.8.2 -i --tun-type gue --tun-port 6080 --tun-csum
-a -t 10.0.8.1:80 -r 10.1.8.3 -i --tun-type gue --tun-port 6081 --tun-remcsum
-a -t 10.0.8.1:80 -r 10.1.8.4 -i --tun-type gre --tun-csum
-a -t 10.0.8.1:80 -r 10.1.8.5 -i --tun-type gue --tun-port 6082 --tun-nocsum
-a -t 10.0.8.1:80 -r 10.1.8.6 -i --tun-type gre
-A -t [2001:db8::8]:80 -s rr
-a -t [2001:db8::8]:80 -r 10.1.8.9 -i
-A -t 200.0.0.1:80 -s rr
-a -t 200.0.0.1:80 -r 10.0.0.9:80 -m
-a -t 200.0.0.1:80 -r 210.0.0.9:80 -m
-a -t 200.0.0.1:80 -r 100.0.0.9:80 -m
-a -t 200.0.0.1:80 -r 100.0.0.9:79 -m
-A -t 10.200.0.1:80 -s rr
-A -t 192.168.0.1:80 -s rr
-A -t 129.0.0.1:80 -s rr
-A -u 10.0.0.1:80 -s rr
-A -t 10.0.0.1:8080 -s rr
";

fn run(cmd: &mut Command, stdin: Option<&str>) -> Output {
    let mut child = cmd
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("spawn {cmd:?}: {e}"));
    let mut input = child.stdin.take().unwrap();
    let data = stdin.unwrap_or("").to_owned();
    // A thread feeds stdin so a child that writes a lot before reading everything can't
    // deadlock against us.
    let feeder = std::thread::spawn(move || {
        let _ = input.write_all(data.as_bytes());
    });
    let out = child.wait_with_output().unwrap();
    feeder.join().unwrap();
    out
}

/// Runs a command and returns stdout; panics with stderr on failure.
fn ok(cmd: &mut Command, stdin: Option<&str>) -> String {
    let out = run(cmd, stdin);
    assert!(
        out.status.success(),
        "{cmd:?} failed: {}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

fn ipvsadm(args: &[&str]) -> String {
    ok(Command::new("ipvsadm").args(args), None)
}

fn ipvsadm_restore(text: &str) {
    let out = run(Command::new("ipvsadm").arg("--restore"), Some(text));
    assert!(
        out.status.success() && out.stderr.is_empty(),
        "ipvsadm --restore: {} {}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
}

/// An example binary next to this test binary (target/<profile>/examples/NAME).
fn example(name: &str) -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    let dir = exe.parent().and_then(|d| d.parent()).unwrap();
    let p = dir.join("examples").join(name);
    assert!(
        p.exists(),
        "example binary {} is missing: build it with `cargo build -p ipvs-netlink --examples`",
        p.display()
    );
    p
}

fn clear() {
    ipvsadm(&["-C"]);
}

/// Table without kernel-only fields, in a canonical order, for equality checks.
fn normalize(mut t: Vec<(Service, Vec<Destination>)>) -> Vec<(Service, Vec<Destination>)> {
    for (s, ds) in &mut t {
        s.stats = None;
        s.flags = ServiceFlags(s.flags.0 & !ServiceFlags::HASHED);
        for d in ds.iter_mut() {
            d.stats = None;
            d.active_conns = 0;
            d.inactive_conns = 0;
            d.persist_conns = 0;
        }
        ds.sort_by_key(|d| (d.addr, d.port));
    }
    t.sort_by_key(|(s, _)| s.key);
    t
}

fn table_line_count() -> usize {
    TABLE.lines().filter(|l| !l.trim().is_empty()).count()
}

#[test]
#[ignore = "vm"]
fn vm_ipvs_save_prints_what_ipvsadm_prints() {
    clear();
    ipvsadm_restore(TABLE);
    // A mark >= 2^31: ipvsadm prints it with %d and sorts it with wrapping arithmetic.
    ipvsadm(&["-A", "-f", "2147483649", "-s", "rr"]);
    let want = ipvsadm(&["-Sn"]);
    assert_eq!(want.lines().count(), table_line_count() + 1);
    let got = ok(&mut Command::new(example("ipvs-save")), None);
    assert_eq!(got, want);
    clear();
}

#[test]
#[ignore = "vm"]
fn vm_ipvs_restore_builds_what_ipvsadm_restore_builds() {
    let views = |_: ()| {
        (
            ipvsadm(&["-Sn"]),
            ipvsadm(&["-Ln", "--thresholds"]),
            ipvsadm(&["-Ln", "--tun-info"]),
            ipvsadm(&["-Ln", "--persistent-conn"]),
        )
    };
    clear();
    ipvsadm_restore(TABLE);
    let want = views(());
    clear();
    assert_eq!(ipvsadm(&["-Sn"]), "");
    let out = ok(&mut Command::new(example("ipvs-restore")), Some(TABLE));
    assert_eq!(out, "");
    let got = views(());
    assert_eq!(got.0, want.0);
    assert_eq!(got.1, want.1, "thresholds");
    assert_eq!(got.2, want.2, "tunnel info");
    assert_eq!(got.3, want.3);
    assert_eq!(want.0.lines().count(), table_line_count());
    clear();
}

#[test]
#[ignore = "vm"]
fn vm_crate_decodes_what_ipvsadm_created() {
    clear();
    ipvsadm_restore(TABLE);
    let mut c = Client::new().unwrap();
    let got = normalize(c.dump().unwrap());
    let want = normalize(parse(TABLE).unwrap());
    assert_eq!(got.len(), want.len());
    for (g, w) in got.iter().zip(&want) {
        assert_eq!(g, w);
    }
    // Thresholds and tunnel parameters are not in -S output; check them explicitly.
    let svc = got
        .iter()
        .find(|(s, _)| s.key.to_string_key() == "-t 10.0.0.1:80")
        .unwrap();
    let d = svc.1.iter().find(|d| d.upper_threshold == 100).unwrap();
    assert_eq!(d.lower_threshold, 10);
    // The kernel sends counters with every entry; they are kept unless turned off, and
    // turning them off changes nothing else.
    let raw = c.dump().unwrap();
    assert!(raw
        .iter()
        .all(|(s, ds)| s.stats.is_some() && ds.iter().all(|d| d.stats.is_some())));
    let key = raw[0].0.key;
    assert!(c.service(&key).unwrap().unwrap().stats.is_some());
    c.set_stats(false);
    let bare = c.dump().unwrap();
    assert!(bare
        .iter()
        .all(|(s, ds)| s.stats.is_none() && ds.iter().all(|d| d.stats.is_none())));
    assert!(c.service(&key).unwrap().unwrap().stats.is_none());
    assert_eq!(normalize(bare), got);
    clear();
}

/// `ServiceKey` rendered like ipvsadm (test helper).
trait KeyText {
    fn to_string_key(&self) -> String;
}
impl KeyText for ServiceKey {
    fn to_string_key(&self) -> String {
        ipvs_netlink::savefmt::service_arg(self)
    }
}

/// TABLE without the entries whose addresses are more than 2^31 apart from others: on those,
/// ipvsadm's wrapping comparison is not a total order and its output depends on the kernel's
/// hash-table order, which only a kernel dump knows.
fn consistent_table() -> String {
    TABLE
        .lines()
        .filter(|l| {
            ![
                "200.0.0.1",
                "192.168.0.1",
                "129.0.0.1",
                "::ffff:",
                "fd00::",
                "210.0.0.9",
                "100.0.0.9",
            ]
            .iter()
            .any(|x| l.contains(x))
        })
        .map(|l| format!("{l}\n"))
        .collect()
}

#[test]
#[ignore = "vm"]
fn vm_crate_creates_what_ipvsadm_shows() {
    clear();
    let table = parse(TABLE).unwrap();
    let ops = table_ops(&table);
    let mut c = Client::new().unwrap();
    let results = c.apply(&ops);
    for (op, r) in ops.iter().zip(&results) {
        assert!(r.is_ok(), "{op:?}: {r:?}");
    }
    let counters = c.counters();
    assert!(counters.requests >= ops.len() as u64);
    assert!(
        counters.sends < ops.len() as u64 / 4,
        "requests must be batched: {counters:?}"
    );
    let shown = ipvsadm(&["-Sn"]);
    // Same lines as our rendering of the input (order: see consistent_table) ...
    let mut a: Vec<&str> = shown.lines().collect();
    let rendered = render(&table);
    let mut b: Vec<&str> = rendered.lines().collect();
    a.sort_unstable();
    b.sort_unstable();
    assert_eq!(a, b);
    // ... and exactly our rendering of the kernel's dump order.
    assert_eq!(shown, render(&c.dump().unwrap()));
    clear();

    // Where ipvsadm's comparison is a total order, the rendering is exact whatever the
    // input order: feed the table reversed.
    let text = consistent_table();
    let mut table = parse(&text).unwrap();
    table.reverse();
    for (_, ds) in &mut table {
        ds.reverse();
    }
    let r = c.apply(&table_ops(&table));
    assert!(r.iter().all(|r| r.is_ok()));
    assert_eq!(ipvsadm(&["-Sn"]), render(&table));
    assert!(render(&table).lines().count() > 50);
    clear();
}

fn tcp(addr: &str, port: u16) -> ServiceKey {
    ServiceKey::Inet {
        protocol: Protocol::Tcp,
        addr: addr.parse().unwrap(),
        port,
    }
}

#[test]
#[ignore = "vm"]
fn vm_batch_failures_do_not_abort_the_rest() {
    clear();
    let a = tcp("10.50.0.1", 80);
    let b = tcp("10.50.0.2", 80);
    let missing = tcp("10.50.0.3", 80);
    let d1 = Destination::new("10.51.0.1".parse().unwrap(), 80);
    let d2 = Destination::new("10.51.0.2".parse().unwrap(), 80);
    let ops = vec![
        Op::NewService(Service::new(a, "rr")),
        Op::NewService(Service::new(a, "rr")), // EEXIST
        Op::NewDest(a, d1.clone()),
        Op::NewDest(a, d1.clone()),                        // EEXIST
        Op::DelDest(a, "10.51.0.99".parse().unwrap(), 80), // ENOENT
        Op::NewDest(missing, d2.clone()),                  // no such service
        Op::NewService(Service::new(b, "wrr")),
        Op::DelService(missing), // no such service
        Op::NewService(Service::new(missing, "nosuchsched")), // unknown scheduler
        Op::NewService(Service::new(tcp("10.50.0.4", 80), "a-much-too-long-name")), // Invalid
        Op::NewDest(a, d2.clone()),
        Op::SetDest(b, d2.clone()), // destination does not exist
    ];
    let mut c = Client::new().unwrap();
    let r = c.apply(&ops);
    assert_eq!(r.len(), ops.len());
    assert!(r[0].is_ok());
    assert!(r[1].as_ref().unwrap_err().is_exists(), "{:?}", r[1]);
    assert_eq!(r[1].as_ref().unwrap_err().op(), Some(OpKind::NewService));
    assert!(r[2].is_ok());
    assert!(r[3].as_ref().unwrap_err().is_exists(), "{:?}", r[3]);
    assert!(r[4].as_ref().unwrap_err().is_not_found(), "{:?}", r[4]);
    assert_eq!(r[4].as_ref().unwrap_err().op(), Some(OpKind::DelDest));
    assert!(r[5].as_ref().unwrap_err().is_not_found(), "{:?}", r[5]);
    assert!(r[6].is_ok());
    assert!(r[7].as_ref().unwrap_err().is_not_found(), "{:?}", r[7]);
    assert!(r[8].as_ref().unwrap_err().is_not_found(), "{:?}", r[8]);
    assert!(matches!(r[9], Err(Error::Invalid(_))), "{:?}", r[9]);
    assert!(r[10].is_ok());
    assert!(r[11].as_ref().unwrap_err().is_not_found(), "{:?}", r[11]);
    assert_eq!(
        ipvsadm(&["-Sn"]),
        "-A -t 10.50.0.1:80 -s rr\n\
         -a -t 10.50.0.1:80 -r 10.51.0.1:80 -m -w 1\n\
         -a -t 10.50.0.1:80 -r 10.51.0.2:80 -m -w 1\n\
         -A -t 10.50.0.2:80 -s wrr\n"
    );
    assert_eq!(c.counters().errors, 8);
    clear();
}

#[test]
#[ignore = "vm"]
fn vm_edit_delete_get_flush() {
    clear();
    let k = ServiceKey::Inet {
        protocol: Protocol::Udp,
        addr: "2001:db8::77".parse().unwrap(),
        port: 53,
    };
    let mut c = Client::new().unwrap();
    assert_eq!(c.service(&k).unwrap(), None);
    let mut s = Service::new(k, "rr");
    c.apply_one(&Op::NewService(s.clone())).unwrap();
    let d: IpAddr = "fd00::1".parse().unwrap();
    c.apply_one(&Op::NewDest(k, Destination::new(d, 5353)))
        .unwrap();
    s.scheduler = "sh".into();
    s.flags = ServiceFlags(ServiceFlags::PERSISTENT | ServiceFlags::SH_PORT);
    s.timeout = 45;
    s.netmask = 120;
    c.apply_one(&Op::SetService(s.clone())).unwrap();
    let mut dd = Destination::new(d, 5353);
    dd.weight = 9;
    dd.upper_threshold = 7;
    c.apply_one(&Op::SetDest(k, dd)).unwrap();
    assert_eq!(
        ipvsadm(&["-Sn"]),
        "-A -u [2001:db8::77]:53 -s sh -p 45 -M 120 -b sh-port\n\
         -a -u [2001:db8::77]:53 -r [fd00::1]:5353 -m -w 9\n"
    );
    let got = c.service(&k).unwrap().unwrap();
    assert_eq!(
        (got.scheduler.as_str(), got.timeout, got.netmask),
        ("sh", 45, 120)
    );
    let dests = c.destinations(&k).unwrap();
    assert_eq!(
        (dests.len(), dests[0].weight, dests[0].upper_threshold),
        (1, 9, 7)
    );
    c.apply_one(&Op::DelDest(k, d, 5353)).unwrap();
    assert!(c.destinations(&k).unwrap().is_empty());
    c.apply_one(&Op::DelService(k)).unwrap();
    assert_eq!(ipvsadm(&["-Sn"]), "");
    assert!(c
        .apply_one(&Op::SetService(s.clone()))
        .unwrap_err()
        .is_not_found());
    c.apply_one(&Op::NewService(s)).unwrap();
    c.flush().unwrap();
    assert_eq!(ipvsadm(&["-Sn"]), "");
}

#[test]
#[ignore = "vm"]
fn vm_info_and_timeouts_match_ipvsadm() {
    let mut c = Client::new().unwrap();
    let info = c.info().unwrap();
    let header = ipvsadm(&["-Ln"]);
    let first = header.lines().next().unwrap();
    assert_eq!(
        first,
        format!(
            "IP Virtual Server version {}.{}.{} (size={})",
            (info.version >> 16) & 0xff,
            (info.version >> 8) & 0xff,
            info.version & 0xff,
            info.conn_tab_size
        )
    );
    let t = Timeouts {
        tcp: 901,
        tcp_fin: 121,
        udp: 301,
    };
    c.apply_one(&Op::SetTimeouts(t)).unwrap();
    assert_eq!(
        ipvsadm(&["-L", "--timeout"]),
        "Timeout (tcp tcpfin udp): 901 121 301\n"
    );
    ipvsadm(&["--set", "902", "0", "302"]);
    assert_eq!(
        c.timeouts().unwrap(),
        Timeouts {
            tcp: 902,
            tcp_fin: 121,
            udp: 302
        }
    );
    // 0 leaves a timeout unchanged, like ipvsadm --set.
    c.apply_one(&Op::SetTimeouts(Timeouts {
        tcp: 0,
        tcp_fin: 122,
        udp: 0,
    }))
    .unwrap();
    assert_eq!(
        ipvsadm(&["-L", "--timeout"]),
        "Timeout (tcp tcpfin udp): 902 122 302\n"
    );
    c.apply_one(&Op::SetTimeouts(Timeouts {
        tcp: 900,
        tcp_fin: 120,
        udp: 300,
    }))
    .unwrap();
}

#[test]
#[ignore = "vm"]
fn vm_dump_family_reads_only_that_familys_real_servers() {
    clear();
    let mut c = Client::new().unwrap();
    let v6 = ServiceKey::Inet {
        protocol: Protocol::Tcp,
        addr: "2001:db8::10".parse().unwrap(),
        port: 80,
    };
    let mut ops = vec![
        Op::NewService(Service::new(v6, "rr")),
        Op::NewDest(v6, Destination::new("fd00::1".parse().unwrap(), 8080)),
    ];
    for i in 1..=5u8 {
        let k = tcp(&format!("10.96.0.{i}"), 80);
        ops.push(Op::NewService(Service::new(k, "rr")));
        ops.push(Op::NewDest(
            k,
            Destination::new(format!("10.244.0.{i}").parse().unwrap(), 8080),
        ));
    }
    assert!(c.apply(&ops).iter().all(|r| r.is_ok()));
    let dests = |c: &Client| c.counters().by_op.get(OpKind::GetDest);

    let before = dests(&c);
    let six = c.dump_family(Family::Inet6).unwrap();
    assert_eq!(six.len(), 1, "{six:?}");
    assert_eq!((six[0].0.key, six[0].1.len()), (v6, 1));
    // One destinations dump, for the one IPv6 virtual server: the five IPv4 ones are left out
    // before their real servers are asked for.
    assert_eq!(dests(&c) - before, 1);

    let before = dests(&c);
    let four = c.dump_family(Family::Inet).unwrap();
    assert_eq!(four.len(), 5);
    assert!(four
        .iter()
        .all(|(s, d)| s.key.family() == Family::Inet && d.len() == 1));
    assert_eq!(dests(&c) - before, 5);

    let before = dests(&c);
    assert_eq!(c.dump().unwrap().len(), 6);
    assert_eq!(dests(&c) - before, 6);
    clear();
}

#[test]
#[ignore = "vm"]
fn vm_large_table_multipart_dumps() {
    clear();
    let mut table = Vec::new();
    for i in 0..3000u32 {
        let key = tcp(
            &format!("10.{}.{}.{}", 100 + i / 65536, (i / 256) % 256, i % 256),
            80,
        );
        let ds = (0..4u32)
            .map(|j| {
                let mut d = Destination::new(
                    format!("172.16.{}.{}", i % 256, j + 1).parse().unwrap(),
                    8080 + j as u16,
                );
                d.weight = j + 1;
                d
            })
            .collect();
        table.push((Service::new(key, "rr"), ds));
    }
    let ops = table_ops(&table);
    let mut c = Client::new().unwrap();
    let r = c.apply(&ops);
    assert!(
        r.iter().all(|r| r.is_ok()),
        "{:?}",
        r.iter().find(|r| r.is_err())
    );
    let sends = c.counters().sends;
    assert!(
        sends * 10 < ops.len() as u64,
        "{sends} sends for {} ops",
        ops.len()
    );
    let dump = c.dump().unwrap();
    assert_eq!(dump.len(), 3000);
    assert!(dump.iter().all(|(_, d)| d.len() == 4));
    assert_eq!(normalize(dump), normalize(table.clone()));
    let want = ipvsadm(&["-Sn"]);
    assert_eq!(want, render(&table));
    assert_eq!(ok(&mut Command::new(example("ipvs-save")), None), want);
    // Re-applying everything: every op fails with EEXIST, none is lost.
    let r = c.apply(&ops);
    assert!(r.iter().all(|r| r.as_ref().unwrap_err().is_exists()));
    clear();
}

#[test]
#[ignore = "vm"]
fn vm_ipvs_restore_rejects_bad_input_without_applying() {
    clear();
    let bad = "-A -t 10.0.0.1:80 -s rr\n-a -t 10.0.0.1:80 -r 10.1.0.1:80 -m\n-a -t 10.0.0.1:80 -r 10.1.0.999:80 -m\n";
    let out = run(&mut Command::new(example("ipvs-restore")), Some(bad));
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("line 3"), "{err}");
    assert_eq!(ipvsadm(&["-Sn"]), "", "nothing applied");
    // --flush first, then the table; a kernel error is reported with its line and the rest
    // is applied.
    ipvsadm(&["-A", "-t", "10.9.9.9:80", "-s", "rr"]);
    let text = "-A -t 10.0.0.1:80 -s rr\n-A -t 10.0.0.1:80 -s rr\n-A -t 10.0.0.2:80 -s rr\n";
    let out = run(
        Command::new(example("ipvs-restore")).arg("--flush"),
        Some(text),
    );
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("line 2") && err.contains("File exists"),
        "{err}"
    );
    assert_eq!(
        ipvsadm(&["-Sn"]),
        "-A -t 10.0.0.1:80 -s rr\n-A -t 10.0.0.2:80 -s rr\n"
    );
    clear();
}

#[test]
#[ignore = "vm"]
fn vm_overrun_loses_replies_but_never_hangs() {
    clear();
    let mut c = Client::new().unwrap();
    let svc = Service::new(tcp("10.60.0.1", 80), "rr");
    c.apply_one(&Op::NewService(svc.clone())).unwrap();
    // 20000 duplicates in one window: the error replies (which echo the request) cannot all
    // fit in the receive buffer.
    c.set_window(100_000);
    let ops = vec![Op::NewService(svc.clone()); 20_000];
    let r = c.apply(&ops);
    assert_eq!(r.len(), ops.len());
    let exists = r
        .iter()
        .filter(|r| matches!(r, Err(e) if e.is_exists()))
        .count();
    let lost = r
        .iter()
        .filter(|r| {
            matches!(
                r,
                Err(Error::NoReply {
                    op: OpKind::NewService
                })
            )
        })
        .count();
    assert_eq!(exists + lost, ops.len(), "only EEXIST or lost replies");
    assert!(exists > 0 && lost > 0, "exists {exists}, lost {lost}");
    assert!(c.counters().overruns >= 1, "{:?}", c.counters());
    // The client stays usable and matches later replies correctly.
    let d = Destination::new("10.61.0.1".parse().unwrap(), 80);
    let r = c.apply(&[
        Op::NewDest(svc.key, d.clone()),
        Op::NewDest(svc.key, d),
        Op::DelService(tcp("10.60.0.9", 80)),
    ]);
    assert!(r[0].is_ok());
    assert!(r[1].as_ref().unwrap_err().is_exists());
    assert!(r[2].as_ref().unwrap_err().is_not_found());
    assert_eq!(c.services().unwrap().len(), 1);
    clear();
}

/// Why `Client::dump` reads destination dumps one after another: the kernel runs one dump per
/// netlink socket at a time; a second dump request sent in the same datagram gets EBUSY.
#[test]
#[ignore = "vm"]
fn vm_kernel_allows_one_dump_per_socket() {
    use ipvs_netlink::codec::{self, Genl, Reply};
    use neli::consts::socket::{Msg, NlFamily};
    use neli::socket::NlSocket;
    use neli::utils::Groups;

    clear();
    ipvsadm_restore(TABLE);
    let family = Client::new().unwrap().family_id();
    let sock = NlSocket::connect(NlFamily::Generic, None, Groups::empty()).unwrap();
    let mut buf = Vec::new();
    codec::put_dump_dests(&mut buf, family, 1, &tcp("10.0.0.1", 80));
    codec::put_dump_dests(&mut buf, family, 2, &tcp("200.0.0.1", 80));
    sock.send(&buf, Msg::empty()).unwrap();
    let mut rbuf = vec![0u8; 65536];
    let (mut dests1, mut done1, mut busy2) = (0, false, false);
    while !(done1 && busy2) {
        let (n, _) = sock.recv(&mut rbuf[..], Msg::empty()).unwrap();
        for m in codec::messages(&rbuf[..n]) {
            match m.unwrap() {
                Reply::Data(Genl { header, .. }) if header.seq == 1 => dests1 += 1,
                Reply::Done { seq: 1, .. } => done1 = true,
                Reply::Error { seq: 2, errno } => {
                    assert_eq!(errno, 16, "EBUSY");
                    busy2 = true;
                }
                other => panic!("unexpected {other:?}"),
            }
        }
    }
    assert_eq!(dests1, 4);
    clear();
}
