//! Byte-level tests of the codec. Expected bytes are written out from the UAPI layouts
//! (`struct nlmsghdr`, `struct genlmsghdr`, `struct nlattr`, `include/uapi/linux/ip_vs.h`),
//! little-endian (x86-64), not produced by the encoder under test.
#![cfg(target_endian = "little")]

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use super::*;
use crate::types::*;
use crate::Error;

const FAM: u16 = 0x22;

/// `struct nlattr` + payload + padding, written independently of the encoder.
fn tlv(ty: u16, payload: &[u8]) -> Vec<u8> {
    let len = 4 + payload.len();
    let mut v = vec![len as u8, (len >> 8) as u8, ty as u8, (ty >> 8) as u8];
    v.extend_from_slice(payload);
    while v.len() % 4 != 0 {
        v.push(0);
    }
    v
}

fn nest(ty: u16, parts: &[Vec<u8>]) -> Vec<u8> {
    tlv(ty, &parts.concat())
}

/// `struct nlmsghdr` + `struct genlmsghdr` + attributes.
fn msg(ty: u16, flags: u16, seq: u32, cmd: u8, attrs: &[Vec<u8>]) -> Vec<u8> {
    let body = attrs.concat();
    let len = (16 + 4 + body.len()) as u32;
    let mut v = Vec::new();
    v.extend_from_slice(&len.to_le_bytes());
    v.extend_from_slice(&ty.to_le_bytes());
    v.extend_from_slice(&flags.to_le_bytes());
    v.extend_from_slice(&seq.to_le_bytes());
    v.extend_from_slice(&0u32.to_le_bytes());
    v.extend_from_slice(&[cmd, 1, 0, 0]);
    v.extend_from_slice(&body);
    v
}

fn v4(a: u8, b: u8, c: u8, d: u8) -> IpAddr {
    IpAddr::V4(Ipv4Addr::new(a, b, c, d))
}

fn tcp(addr: IpAddr, port: u16) -> ServiceKey {
    ServiceKey::Inet {
        protocol: Protocol::Tcp,
        addr,
        port,
    }
}

fn encode(op: &Op, seq: u32) -> Vec<u8> {
    let mut b = Vec::new();
    put_op(&mut b, FAM, seq, op).unwrap();
    b
}

#[test]
fn new_service_tcp_v4_literal_bytes() {
    let s = Service::new(tcp(v4(10, 0, 0, 1), 80), "rr");
    let got = encode(&Op::NewService(s), 1);
    #[rustfmt::skip]
    let want: Vec<u8> = vec![
        // nlmsghdr: len 104, type 0x22, flags REQUEST|ACK, seq 1, pid 0
        104, 0, 0, 0,  0x22, 0,  0x05, 0,  1, 0, 0, 0,  0, 0, 0, 0,
        // genlmsghdr: cmd IPVS_CMD_NEW_SERVICE (1), version 1
        1, 1, 0, 0,
        // IPVS_CMD_ATTR_SERVICE (1), len 84
        84, 0, 1, 0,
        // IPVS_SVC_ATTR_AF (1) u16 AF_INET
        6, 0, 1, 0,  2, 0, 0, 0,
        // IPVS_SVC_ATTR_PROTOCOL (2) u16 IPPROTO_TCP
        6, 0, 2, 0,  6, 0, 0, 0,
        // IPVS_SVC_ATTR_ADDR (3) union nf_inet_addr (16 bytes)
        20, 0, 3, 0,  10, 0, 0, 1,  0, 0, 0, 0,  0, 0, 0, 0,  0, 0, 0, 0,
        // IPVS_SVC_ATTR_PORT (4) be16 80
        6, 0, 4, 0,  0, 80, 0, 0,
        // IPVS_SVC_ATTR_SCHED_NAME (6) "rr\0"
        7, 0, 6, 0,  b'r', b'r', 0, 0,
        // IPVS_SVC_ATTR_FLAGS (7) struct ip_vs_flags { flags 0, mask ~0 }
        12, 0, 7, 0,  0, 0, 0, 0,  0xff, 0xff, 0xff, 0xff,
        // IPVS_SVC_ATTR_TIMEOUT (8) u32 0
        8, 0, 8, 0,  0, 0, 0, 0,
        // IPVS_SVC_ATTR_NETMASK (9) 255.255.255.255
        8, 0, 9, 0,  0xff, 0xff, 0xff, 0xff,
    ];
    assert_eq!(got, want);
}

#[test]
fn set_service_v6_persistent_netmask_is_prefix_length() {
    let addr = IpAddr::V6("2001:db8::1".parse().unwrap());
    let mut s = Service::new(
        ServiceKey::Inet {
            protocol: Protocol::Udp,
            addr,
            port: 53,
        },
        "sh",
    );
    s.flags = ServiceFlags(ServiceFlags::PERSISTENT | ServiceFlags::SH_PORT);
    s.timeout = 600;
    s.netmask = 64;
    s.pe_name = Some("sip".into());
    let got = encode(&Op::SetService(s), 7);
    let mut a16 = [0u8; 16];
    a16[..2].copy_from_slice(&[0x20, 0x01]);
    a16[2..4].copy_from_slice(&[0x0d, 0xb8]);
    a16[15] = 1;
    let want = msg(
        FAM,
        0x05,
        7,
        2, // IPVS_CMD_SET_SERVICE
        &[nest(
            1,
            &[
                tlv(1, &[10, 0]), // AF_INET6
                tlv(2, &[17, 0]), // IPPROTO_UDP
                tlv(3, &a16),
                tlv(4, &[0, 53]),
                tlv(6, b"sh\0"),
                tlv(11, b"sip\0"), // PE name
                tlv(7, &[0x11, 0, 0, 0, 0xff, 0xff, 0xff, 0xff]),
                tlv(8, &[0x58, 0x02, 0, 0]), // 600
                tlv(9, &[64, 0, 0, 0]),      // prefix length, host order
            ],
        )],
    );
    assert_eq!(got, want);
}

#[test]
fn netmask_v4_travels_in_network_order() {
    let mut s = Service::new(tcp(v4(1, 2, 3, 4), 1), "wlc");
    s.netmask = 0xffff_ff00; // 255.255.255.0
    let got = encode(&Op::NewService(s), 1);
    let nm = tlv(9, &[255, 255, 255, 0]);
    assert_eq!(&got[got.len() - 8..], &nm[..]);
}

#[test]
fn del_service_fwmark_sends_only_the_key() {
    let key = ServiceKey::Fwmark {
        family: Family::Inet6,
        mark: 0x1234_5678,
    };
    let got = encode(&Op::DelService(key), 3);
    let want = msg(
        FAM,
        0x05,
        3,
        3,
        &[nest(
            1,
            &[tlv(1, &[10, 0]), tlv(5, &[0x78, 0x56, 0x34, 0x12])],
        )],
    );
    assert_eq!(got, want);
}

#[test]
fn new_dest_literal_bytes() {
    let mut d = Destination::new(v4(10, 1, 0, 1), 8080);
    d.weight = 3;
    d.upper_threshold = 100;
    d.lower_threshold = 10;
    let got = encode(&Op::NewDest(tcp(v4(10, 0, 0, 1), 80), d), 0x0102_0304);
    #[rustfmt::skip]
    let dest: Vec<u8> = vec![
        // IPVS_CMD_ATTR_DEST (2), len 4+8+20+8+8+8+8+8+8+8+8 = 96
        96, 0, 2, 0,
        // IPVS_DEST_ATTR_ADDR_FAMILY (11) AF_INET
        6, 0, 11, 0,  2, 0, 0, 0,
        // IPVS_DEST_ATTR_ADDR (1)
        20, 0, 1, 0,  10, 1, 0, 1,  0, 0, 0, 0,  0, 0, 0, 0,  0, 0, 0, 0,
        // IPVS_DEST_ATTR_PORT (2) be16 8080 = 0x1f90
        6, 0, 2, 0,  0x1f, 0x90, 0, 0,
        // IPVS_DEST_ATTR_FWD_METHOD (3) IP_VS_CONN_F_MASQ
        8, 0, 3, 0,  0, 0, 0, 0,
        // IPVS_DEST_ATTR_WEIGHT (4) 3
        8, 0, 4, 0,  3, 0, 0, 0,
        // IPVS_DEST_ATTR_TUN_TYPE (13) u8 0
        5, 0, 13, 0,  0, 0, 0, 0,
        // IPVS_DEST_ATTR_TUN_PORT (14) be16 0
        6, 0, 14, 0,  0, 0, 0, 0,
        // IPVS_DEST_ATTR_TUN_FLAGS (15) u16 0
        6, 0, 15, 0,  0, 0, 0, 0,
        // IPVS_DEST_ATTR_U_THRESH (5) 100
        8, 0, 5, 0,  100, 0, 0, 0,
        // IPVS_DEST_ATTR_L_THRESH (6) 10
        8, 0, 6, 0,  10, 0, 0, 0,
    ];
    // Header: seq 0x01020304 little-endian, cmd IPVS_CMD_NEW_DEST (5).
    assert_eq!(&got[8..12], &[4, 3, 2, 1]);
    assert_eq!(got[16], 5);
    assert_eq!(
        u32::from_le_bytes(got[..4].try_into().unwrap()) as usize,
        got.len()
    );
    // The service nest carries only the key (no scheduler etc.).
    let svc_nest = nest(
        1,
        &[
            tlv(1, &[2, 0]),
            tlv(2, &[6, 0]),
            tlv(3, &[10, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0]),
            tlv(4, &[0, 80]),
        ],
    );
    assert_eq!(&got[20..20 + svc_nest.len()], &svc_nest[..]);
    assert_eq!(&got[20 + svc_nest.len()..], &dest[..]);
}

#[test]
fn set_dest_gue_tunnel_fields() {
    let mut d = Destination::new(IpAddr::V4(Ipv4Addr::new(192, 168, 1, 1)), 80);
    d.fwd = ForwardMethod::Tunnel;
    d.tun_type = TunnelType::Gue;
    d.tun_port = 6080; // 0x17c0
    d.tun_flags = tunnel_flags::REMCSUM;
    let key = ServiceKey::Fwmark {
        family: Family::Inet,
        mark: 5,
    };
    let got = encode(&Op::SetDest(key, d), 1);
    assert_eq!(got[16], 6, "IPVS_CMD_SET_DEST");
    let body = &got[20..];
    let find = |ty: u16, payload: &[u8]| {
        let t = tlv(ty, payload);
        body.windows(t.len()).any(|w| w == &t[..])
    };
    assert!(find(3, &[2, 0, 0, 0]), "IP_VS_CONN_F_TUNNEL");
    assert!(find(13, &[1]), "IP_VS_CONN_F_TUNNEL_TYPE_GUE");
    assert!(find(14, &[0x17, 0xc0]), "tunnel port in network order");
    assert!(find(15, &[2, 0]), "IP_VS_TUNNEL_ENCAP_FLAG_REMCSUM");
}

#[test]
fn del_dest_sends_address_and_port_only() {
    let a6: Ipv6Addr = "fd00::5".parse().unwrap();
    let key = ServiceKey::Inet {
        protocol: Protocol::Sctp,
        addr: IpAddr::V6("fd00::1".parse().unwrap()),
        port: 3868,
    };
    let got = encode(&Op::DelDest(key, IpAddr::V6(a6), 3868), 9);
    let want = msg(
        FAM,
        0x05,
        9,
        7,
        &[
            nest(
                1,
                &[
                    tlv(1, &[10, 0]),
                    tlv(2, &[132, 0]),
                    tlv(3, &"fd00::1".parse::<Ipv6Addr>().unwrap().octets()),
                    tlv(4, &[0x0f, 0x1c]),
                ],
            ),
            nest(
                2,
                &[
                    tlv(11, &[10, 0]),
                    tlv(1, &a6.octets()),
                    tlv(2, &[0x0f, 0x1c]),
                ],
            ),
        ],
    );
    assert_eq!(got, want);
}

#[test]
fn flush_and_set_config() {
    assert_eq!(encode(&Op::Flush, 2), msg(FAM, 0x05, 2, 17, &[]));
    let t = Timeouts {
        tcp: 900,
        tcp_fin: 120,
        udp: 300,
    };
    let want = msg(
        FAM,
        0x05,
        4,
        12, // IPVS_CMD_SET_CONFIG
        &[
            tlv(4, &900u32.to_le_bytes()),
            tlv(5, &120u32.to_le_bytes()),
            tlv(6, &300u32.to_le_bytes()),
        ],
    );
    assert_eq!(encode(&Op::SetTimeouts(t), 4), want);
}

#[test]
fn get_requests() {
    let mut b = Vec::new();
    put_dump_services(&mut b, FAM, 1);
    // NLM_F_REQUEST | NLM_F_DUMP (0x300), IPVS_CMD_GET_SERVICE (4)
    assert_eq!(b, msg(FAM, 0x301, 1, 4, &[]));
    b.clear();
    put_get_info(&mut b, FAM, 2);
    assert_eq!(b, msg(FAM, 0x05, 2, 15, &[]));
    b.clear();
    put_get_config(&mut b, FAM, 3);
    assert_eq!(b, msg(FAM, 0x05, 3, 13, &[]));
    b.clear();
    let key = ServiceKey::Fwmark {
        family: Family::Inet,
        mark: 1,
    };
    put_dump_dests(&mut b, FAM, 4, &key);
    assert_eq!(
        b,
        msg(
            FAM,
            0x301,
            4,
            8,
            &[nest(1, &[tlv(1, &[2, 0]), tlv(5, &[1, 0, 0, 0])])]
        )
    );
    b.clear();
    put_get_service(&mut b, FAM, 5, &key);
    assert_eq!(
        b,
        msg(
            FAM,
            0x05,
            5,
            4,
            &[nest(1, &[tlv(1, &[2, 0]), tlv(5, &[1, 0, 0, 0])])]
        )
    );
}

#[test]
fn get_family_request() {
    let mut b = Vec::new();
    put_get_family(&mut b, 11, "IPVS");
    // GENL_ID_CTRL (0x10), CTRL_CMD_GETFAMILY (3), CTRL_ATTR_FAMILY_NAME (2) "IPVS\0"
    assert_eq!(b, msg(0x10, 0x05, 11, 3, &[tlv(2, b"IPVS\0")]));
}

#[test]
fn invalid_ops_append_nothing() {
    let mut b = vec![1, 2, 3];
    let s = Service::new(tcp(v4(1, 1, 1, 1), 1), "a-scheduler-name-too-long");
    assert!(matches!(
        put_op(&mut b, FAM, 1, &Op::NewService(s)),
        Err(Error::Invalid(_))
    ));
    let s = Service::new(
        ServiceKey::Fwmark {
            family: Family::Inet,
            mark: 0,
        },
        "rr",
    );
    assert!(put_op(&mut b, FAM, 1, &Op::NewService(s)).is_err());
    let s = Service::new(tcp(v4(1, 1, 1, 1), 1), "");
    assert!(put_op(&mut b, FAM, 1, &Op::NewService(s)).is_err());
    assert_eq!(b, vec![1, 2, 3]);
}

/// A service reply as the 6.1 kernel builds it (`ip_vs_genl_fill_service`).
fn kernel_service_reply(seq: u32) -> Vec<u8> {
    let mut addr = [0u8; 16];
    addr[..4].copy_from_slice(&[10, 96, 0, 10]);
    let stats32 = nest(
        10,
        &[
            tlv(1, &5u32.to_le_bytes()),
            tlv(2, &6u32.to_le_bytes()),
            tlv(3, &7u32.to_le_bytes()),
            tlv(11, &[]), // PAD
            tlv(4, &8u64.to_le_bytes()),
            tlv(5, &9u64.to_le_bytes()),
        ],
    );
    let stats64 = nest(
        12,
        &[
            tlv(1, &(1u64 << 40).to_le_bytes()),
            tlv(2, &2u64.to_le_bytes()),
            tlv(10, &3u64.to_le_bytes()),
        ],
    );
    msg(
        FAM,
        0x2, // NLM_F_MULTI
        seq,
        1, // IPVS_CMD_NEW_SERVICE
        &[nest(
            1,
            &[
                tlv(1, &[2, 0]),
                tlv(2, &[6, 0]),
                tlv(3, &addr),
                tlv(4, &[0x01, 0xbb]),
                tlv(6, b"wrr\0"),
                tlv(7, &[0x03, 0, 0, 0, 0xff, 0xff, 0xff, 0xff]),
                tlv(8, &10800u32.to_le_bytes()),
                tlv(9, &[255, 255, 0, 0]),
                stats32,
                stats64,
                tlv(99, &[1, 2, 3]), // unknown attribute: ignored
            ],
        )],
    )
}

#[test]
fn decode_service_reply() {
    let bytes = kernel_service_reply(42);
    let mut it = messages(&bytes);
    let m = it.next().unwrap().unwrap();
    assert!(it.next().is_none());
    let Reply::Data(Genl { header, cmd, .. }) = m else {
        panic!("not data: {m:?}")
    };
    assert_eq!((header.seq, header.ty, cmd), (42, FAM, 1));
    let s = decode_service(m.attr_iter()).unwrap();
    assert_eq!(s.key, tcp(v4(10, 96, 0, 10), 443));
    assert_eq!(s.scheduler, "wrr");
    assert_eq!(s.flags.0, ServiceFlags::PERSISTENT | ServiceFlags::HASHED);
    assert_eq!(s.timeout, 10800);
    assert_eq!(s.netmask, 0xffff_0000);
    assert_eq!(s.pe_name, None);
    let st = s.stats.unwrap();
    assert_eq!(
        (st.conns, st.inpkts, st.outbps),
        (1 << 40, 2, 3),
        "STATS64 wins"
    );
}

#[test]
fn decode_service_old_kernel_stats_only() {
    let addr6: Ipv6Addr = "2001:db8::10".parse().unwrap();
    let bytes = msg(
        FAM,
        0x2,
        1,
        1,
        &[nest(
            1,
            &[
                tlv(1, &[10, 0]),
                tlv(2, &[17, 0]),
                tlv(3, &addr6.octets()),
                tlv(4, &[0, 53]),
                tlv(6, b"mh\0"),
                tlv(11, b"sip\0"),
                tlv(7, &[0x10, 0, 0, 0, 0xff, 0xff, 0xff, 0xff]),
                tlv(8, &0u32.to_le_bytes()),
                tlv(9, &[48, 0, 0, 0]),
                nest(
                    10,
                    &[tlv(1, &77u32.to_le_bytes()), tlv(4, &5u64.to_le_bytes())],
                ),
            ],
        )],
    );
    let m = messages(&bytes).next().unwrap().unwrap();
    let s = decode_service(m.attr_iter()).unwrap();
    assert_eq!(
        s.key,
        ServiceKey::Inet {
            protocol: Protocol::Udp,
            addr: IpAddr::V6(addr6),
            port: 53
        }
    );
    assert_eq!(s.netmask, 48);
    assert!(s.flags.contains(ServiceFlags::MH_PORT));
    assert_eq!(s.pe_name.as_deref(), Some("sip"));
    let st = s.stats.unwrap();
    assert_eq!((st.conns, st.inbytes), (77, 5));
}

#[test]
fn decode_fwmark_service() {
    let bytes = msg(
        FAM,
        0x2,
        1,
        1,
        &[nest(
            1,
            &[
                tlv(1, &[10, 0]),
                tlv(5, &[0xff, 0xff, 0xff, 0xff]),
                tlv(6, b"rr\0"),
            ],
        )],
    );
    let m = messages(&bytes).next().unwrap().unwrap();
    let s = decode_service(m.attr_iter()).unwrap();
    assert_eq!(
        s.key,
        ServiceKey::Fwmark {
            family: Family::Inet6,
            mark: u32::MAX
        }
    );
    assert_eq!(s.netmask, 128, "default when absent");
}

/// A destination reply as the 6.1 kernel builds it (`ip_vs_genl_fill_dest`): an IPv4 tunnel
/// real server of an IPv6 service.
fn kernel_dest_reply() -> Vec<u8> {
    let mut addr = [0u8; 16];
    addr[..4].copy_from_slice(&[192, 0, 2, 7]);
    msg(
        FAM,
        0x2,
        9,
        5, // IPVS_CMD_NEW_DEST
        &[nest(
            2,
            &[
                tlv(1, &addr),
                tlv(2, &[0, 80]),
                tlv(3, &2u32.to_le_bytes()),
                tlv(4, &7u32.to_le_bytes()),
                tlv(13, &[2]),
                tlv(14, &[0, 0]),
                tlv(15, &[1, 0]),
                tlv(5, &1000u32.to_le_bytes()),
                tlv(6, &100u32.to_le_bytes()),
                tlv(7, &11u32.to_le_bytes()),
                tlv(8, &12u32.to_le_bytes()),
                tlv(9, &13u32.to_le_bytes()),
                tlv(11, &[2, 0]),
                nest(10, &[tlv(1, &1u32.to_le_bytes())]),
                nest(12, &[tlv(11, &[]), tlv(1, &99u64.to_le_bytes())]),
            ],
        )],
    )
}

#[test]
fn decode_dest_reply() {
    let bytes = kernel_dest_reply();
    let m = messages(&bytes).next().unwrap().unwrap();
    let d = decode_dest(m.attr_iter(), Family::Inet6).unwrap();
    assert_eq!(
        d.addr,
        v4(192, 0, 2, 7),
        "ADDR_FAMILY overrides the service family"
    );
    assert_eq!(d.port, 80);
    assert_eq!(d.fwd, ForwardMethod::Tunnel);
    assert_eq!(d.weight, 7);
    assert_eq!(
        (d.tun_type, d.tun_port, d.tun_flags),
        (TunnelType::Gre, 0, 1)
    );
    assert_eq!((d.upper_threshold, d.lower_threshold), (1000, 100));
    assert_eq!(
        (d.active_conns, d.inactive_conns, d.persist_conns),
        (11, 12, 13)
    );
    assert_eq!(d.stats.unwrap().conns, 99);
}

#[test]
fn decode_dest_without_family_uses_service_family() {
    let a6: Ipv6Addr = "fd00::9".parse().unwrap();
    let bytes = msg(
        FAM,
        0x2,
        1,
        5,
        &[nest(2, &[tlv(1, &a6.octets()), tlv(2, &[0x1f, 0x90])])],
    );
    let m = messages(&bytes).next().unwrap().unwrap();
    let d = decode_dest(m.attr_iter(), Family::Inet6).unwrap();
    assert_eq!((d.addr, d.port), (IpAddr::V6(a6), 8080));
}

#[test]
fn decode_info_and_timeouts() {
    let bytes = msg(
        FAM,
        0,
        3,
        14, // IPVS_CMD_SET_INFO
        &[
            tlv(1, &0x010201u32.to_le_bytes()),
            tlv(2, &4096u32.to_le_bytes()),
        ],
    );
    let m = messages(&bytes).next().unwrap().unwrap();
    assert_eq!(
        decode_info(m.attr_iter()).unwrap(),
        Info {
            version: 0x010201,
            conn_tab_size: 4096
        }
    );
    let bytes = msg(
        FAM,
        0,
        3,
        12,
        &[
            tlv(4, &900u32.to_le_bytes()),
            tlv(5, &120u32.to_le_bytes()),
            tlv(6, &300u32.to_le_bytes()),
        ],
    );
    let m = messages(&bytes).next().unwrap().unwrap();
    assert_eq!(
        decode_timeouts(m.attr_iter()).unwrap(),
        Timeouts {
            tcp: 900,
            tcp_fin: 120,
            udp: 300
        }
    );
    let bytes = msg(FAM, 0, 3, 14, &[tlv(1, &1u32.to_le_bytes())]);
    let m = messages(&bytes).next().unwrap().unwrap();
    assert!(decode_info(m.attr_iter()).is_err(), "size missing");
}

/// `struct nlmsgerr` reply: nlmsghdr(type NLMSG_ERROR) + int error + echoed request header.
fn nlmsgerr(seq: u32, error: i32) -> Vec<u8> {
    let mut v = Vec::new();
    v.extend_from_slice(&36u32.to_le_bytes());
    v.extend_from_slice(&2u16.to_le_bytes());
    v.extend_from_slice(&0x100u16.to_le_bytes()); // NLM_F_CAPPED
    v.extend_from_slice(&seq.to_le_bytes());
    v.extend_from_slice(&77u32.to_le_bytes());
    v.extend_from_slice(&error.to_le_bytes());
    // echoed request header
    v.extend_from_slice(&40u32.to_le_bytes());
    v.extend_from_slice(&FAM.to_le_bytes());
    v.extend_from_slice(&5u16.to_le_bytes());
    v.extend_from_slice(&seq.to_le_bytes());
    v.extend_from_slice(&0u32.to_le_bytes());
    v
}

#[test]
fn acks_errors_and_done_in_one_datagram() {
    let mut d = nlmsgerr(10, 0);
    d.extend(nlmsgerr(11, -17));
    d.extend(nlmsgerr(12, -3));
    // NLMSG_DONE with int error 0
    let mut done = vec![20, 0, 0, 0, 3, 0, 2, 0];
    done.extend_from_slice(&13u32.to_le_bytes());
    done.extend_from_slice(&[0; 4]);
    done.extend_from_slice(&0i32.to_le_bytes());
    d.extend(&done);
    let got: Vec<Reply<'_>> = messages(&d).map(|m| m.unwrap()).collect();
    assert_eq!(
        got,
        vec![
            Reply::Ack { seq: 10 },
            Reply::Error { seq: 11, errno: 17 },
            Reply::Error { seq: 12, errno: 3 },
            Reply::Done { seq: 13, errno: 0 },
        ]
    );
}

#[test]
fn family_reply() {
    let bytes = msg(
        0x10,
        0,
        1,
        1, // CTRL_CMD_NEWFAMILY
        &[
            tlv(2, b"IPVS\0"),
            tlv(1, &[0x23, 0]),
            tlv(3, &1u32.to_le_bytes()),
        ],
    );
    let m = messages(&bytes).next().unwrap().unwrap();
    assert_eq!(netlink::decode_family_id(m.attr_iter()).unwrap(), 0x23);
}

/// Decode everything a datagram holds, the way the client does.
fn decode_all(b: &[u8]) -> Result<(), Error> {
    for m in messages(b) {
        let m = m?;
        if let Reply::Data(Genl { cmd, .. }) = m {
            match cmd {
                1 => {
                    decode_service(m.attr_iter())?;
                }
                5 => {
                    decode_dest(m.attr_iter(), Family::Inet)?;
                }
                _ => {}
            }
        }
    }
    Ok(())
}

#[test]
fn every_truncation_is_an_error_never_a_panic() {
    for full in [
        kernel_service_reply(1),
        kernel_dest_reply(),
        nlmsgerr(1, -2),
    ] {
        assert!(decode_all(&full).is_ok());
        for cut in 1..full.len() {
            assert!(
                decode_all(&full[..cut]).is_err(),
                "prefix of {cut} bytes of {} decoded",
                full.len()
            );
            // Same cut with nlmsg_len patched to match: the attribute walk must catch it.
            if cut >= 20 {
                let mut b = full[..cut].to_vec();
                b[..4].copy_from_slice(&(cut as u32).to_le_bytes());
                if full[4] != 2 {
                    assert!(decode_all(&b).is_err(), "attribute cut at {cut} decoded");
                }
            }
        }
    }
}

#[test]
fn corrupted_lengths_are_errors_never_panics() {
    // Flip every byte of a reply to a few values; decoding may succeed or fail, never panic,
    // and a zero-length nlmsg / attribute must be rejected.
    let full = kernel_dest_reply();
    for i in 0..full.len() {
        for v in [0u8, 1, 3, 0x7f, 0xff] {
            let mut b = full.clone();
            b[i] = v;
            let _ = decode_all(&b);
        }
    }
    let mut b = kernel_dest_reply();
    b[..4].copy_from_slice(&8u32.to_le_bytes());
    assert!(decode_all(&b).is_err(), "nlmsg_len below header size");
    let mut b = kernel_dest_reply();
    b[20] = 2; // outer DEST nest length 2 < NLA_HDRLEN
    b[21] = 0;
    assert!(decode_all(&b).is_err());
}

#[test]
fn malformed_attribute_sizes_are_errors() {
    // AF attribute with 4 bytes instead of 2.
    let bytes = msg(
        FAM,
        2,
        1,
        1,
        &[nest(
            1,
            &[
                tlv(1, &[2, 0, 0, 0]),
                tlv(5, &[1, 0, 0, 0]),
                tlv(6, b"rr\0"),
            ],
        )],
    );
    assert!(matches!(decode_all(&bytes), Err(Error::Malformed(_))));
    // IPv4 service with a 2-byte address.
    let bytes = msg(
        FAM,
        2,
        1,
        1,
        &[nest(
            1,
            &[
                tlv(1, &[2, 0]),
                tlv(2, &[6, 0]),
                tlv(3, &[1, 2]),
                tlv(4, &[0, 1]),
                tlv(6, b"rr\0"),
            ],
        )],
    );
    assert!(decode_all(&bytes).is_err());
    // Missing scheduler, missing AF, unknown family, unknown protocol.
    for attrs in [
        vec![tlv(1, &[2, 0]), tlv(5, &[1, 0, 0, 0])],
        vec![tlv(5, &[1, 0, 0, 0]), tlv(6, b"rr\0")],
        vec![tlv(1, &[7, 0]), tlv(5, &[1, 0, 0, 0]), tlv(6, b"rr\0")],
        vec![
            tlv(1, &[2, 0]),
            tlv(2, &[50, 0]),
            tlv(3, &[1, 2, 3, 4]),
            tlv(4, &[0, 1]),
            tlv(6, b"rr\0"),
        ],
    ] {
        let bytes = msg(FAM, 2, 1, 1, &[nest(1, &attrs)]);
        assert!(decode_all(&bytes).is_err(), "{attrs:?}");
    }
    // A service message without the service nest.
    let bytes = msg(FAM, 2, 1, 1, &[tlv(4, &[0, 0, 0, 0])]);
    assert!(decode_all(&bytes).is_err());
}
