//! Numeric constants from `include/uapi/linux/ip_vs.h` and `genetlink.h`, plus the
//! `netlink.h` ones re-exported from [`::netlink::consts`].

// netlink.h: shared with every netlink family, defined in `netlink::consts`.
pub use ::netlink::consts::*;

// genetlink.h
/// `GENL_HDRLEN`.
pub const GENL_HDRLEN: usize = 4;
/// `GENL_ID_CTRL`.
pub const GENL_ID_CTRL: u16 = 0x10;
/// `CTRL_CMD_GETFAMILY`.
pub const CTRL_CMD_GETFAMILY: u8 = 3;
/// `CTRL_ATTR_FAMILY_ID` (u16).
pub const CTRL_ATTR_FAMILY_ID: u16 = 1;
/// `CTRL_ATTR_FAMILY_NAME` (string).
pub const CTRL_ATTR_FAMILY_NAME: u16 = 2;

// ip_vs.h
/// `IPVS_GENL_NAME`.
pub const IPVS_GENL_NAME: &str = "IPVS";
/// `IPVS_GENL_VERSION`.
pub const IPVS_GENL_VERSION: u8 = 1;
/// `IP_VS_SCHEDNAME_MAXLEN` (including the NUL).
pub const IP_VS_SCHEDNAME_MAXLEN: usize = 16;
/// `IP_VS_PENAME_MAXLEN` (including the NUL).
pub const IP_VS_PENAME_MAXLEN: usize = 16;

/// `IPVS_CMD_NEW_SERVICE`.
pub const IPVS_CMD_NEW_SERVICE: u8 = 1;
/// `IPVS_CMD_SET_SERVICE`.
pub const IPVS_CMD_SET_SERVICE: u8 = 2;
/// `IPVS_CMD_DEL_SERVICE`.
pub const IPVS_CMD_DEL_SERVICE: u8 = 3;
/// `IPVS_CMD_GET_SERVICE`.
pub const IPVS_CMD_GET_SERVICE: u8 = 4;
/// `IPVS_CMD_NEW_DEST`.
pub const IPVS_CMD_NEW_DEST: u8 = 5;
/// `IPVS_CMD_SET_DEST`.
pub const IPVS_CMD_SET_DEST: u8 = 6;
/// `IPVS_CMD_DEL_DEST`.
pub const IPVS_CMD_DEL_DEST: u8 = 7;
/// `IPVS_CMD_GET_DEST`.
pub const IPVS_CMD_GET_DEST: u8 = 8;
/// `IPVS_CMD_NEW_DAEMON`.
pub const IPVS_CMD_NEW_DAEMON: u8 = 9;
/// `IPVS_CMD_DEL_DAEMON`.
pub const IPVS_CMD_DEL_DAEMON: u8 = 10;
/// `IPVS_CMD_GET_DAEMON`.
pub const IPVS_CMD_GET_DAEMON: u8 = 11;
/// `IPVS_CMD_SET_CONFIG`.
pub const IPVS_CMD_SET_CONFIG: u8 = 12;
/// `IPVS_CMD_GET_CONFIG`.
pub const IPVS_CMD_GET_CONFIG: u8 = 13;
/// `IPVS_CMD_SET_INFO` (only in GET_INFO replies).
pub const IPVS_CMD_SET_INFO: u8 = 14;
/// `IPVS_CMD_GET_INFO`.
pub const IPVS_CMD_GET_INFO: u8 = 15;
/// `IPVS_CMD_ZERO`.
pub const IPVS_CMD_ZERO: u8 = 16;
/// `IPVS_CMD_FLUSH`.
pub const IPVS_CMD_FLUSH: u8 = 17;

/// `IPVS_CMD_ATTR_SERVICE` (nested).
pub const IPVS_CMD_ATTR_SERVICE: u16 = 1;
/// `IPVS_CMD_ATTR_DEST` (nested).
pub const IPVS_CMD_ATTR_DEST: u16 = 2;
/// `IPVS_CMD_ATTR_DAEMON` (nested).
pub const IPVS_CMD_ATTR_DAEMON: u16 = 3;
/// `IPVS_CMD_ATTR_TIMEOUT_TCP` (u32).
pub const IPVS_CMD_ATTR_TIMEOUT_TCP: u16 = 4;
/// `IPVS_CMD_ATTR_TIMEOUT_TCP_FIN` (u32).
pub const IPVS_CMD_ATTR_TIMEOUT_TCP_FIN: u16 = 5;
/// `IPVS_CMD_ATTR_TIMEOUT_UDP` (u32).
pub const IPVS_CMD_ATTR_TIMEOUT_UDP: u16 = 6;

/// `IPVS_SVC_ATTR_AF` (u16).
pub const IPVS_SVC_ATTR_AF: u16 = 1;
/// `IPVS_SVC_ATTR_PROTOCOL` (u16).
pub const IPVS_SVC_ATTR_PROTOCOL: u16 = 2;
/// `IPVS_SVC_ATTR_ADDR` (binary, up to 16 bytes, `union nf_inet_addr`).
pub const IPVS_SVC_ATTR_ADDR: u16 = 3;
/// `IPVS_SVC_ATTR_PORT` (u16, network byte order).
pub const IPVS_SVC_ATTR_PORT: u16 = 4;
/// `IPVS_SVC_ATTR_FWMARK` (u32).
pub const IPVS_SVC_ATTR_FWMARK: u16 = 5;
/// `IPVS_SVC_ATTR_SCHED_NAME` (NUL-terminated string).
pub const IPVS_SVC_ATTR_SCHED_NAME: u16 = 6;
/// `IPVS_SVC_ATTR_FLAGS` (`struct ip_vs_flags { u32 flags; u32 mask; }`).
pub const IPVS_SVC_ATTR_FLAGS: u16 = 7;
/// `IPVS_SVC_ATTR_TIMEOUT` (u32 seconds).
pub const IPVS_SVC_ATTR_TIMEOUT: u16 = 8;
/// `IPVS_SVC_ATTR_NETMASK` (u32: IPv4 mask bytes in network order; IPv6 prefix length).
pub const IPVS_SVC_ATTR_NETMASK: u16 = 9;
/// `IPVS_SVC_ATTR_STATS` (nested, 32-bit counters).
pub const IPVS_SVC_ATTR_STATS: u16 = 10;
/// `IPVS_SVC_ATTR_PE_NAME` (NUL-terminated string).
pub const IPVS_SVC_ATTR_PE_NAME: u16 = 11;
/// `IPVS_SVC_ATTR_STATS64` (nested, 64-bit counters).
pub const IPVS_SVC_ATTR_STATS64: u16 = 12;

/// `IPVS_DEST_ATTR_ADDR` (binary, up to 16 bytes).
pub const IPVS_DEST_ATTR_ADDR: u16 = 1;
/// `IPVS_DEST_ATTR_PORT` (u16, network byte order).
pub const IPVS_DEST_ATTR_PORT: u16 = 2;
/// `IPVS_DEST_ATTR_FWD_METHOD` (u32).
pub const IPVS_DEST_ATTR_FWD_METHOD: u16 = 3;
/// `IPVS_DEST_ATTR_WEIGHT` (u32).
pub const IPVS_DEST_ATTR_WEIGHT: u16 = 4;
/// `IPVS_DEST_ATTR_U_THRESH` (u32).
pub const IPVS_DEST_ATTR_U_THRESH: u16 = 5;
/// `IPVS_DEST_ATTR_L_THRESH` (u32).
pub const IPVS_DEST_ATTR_L_THRESH: u16 = 6;
/// `IPVS_DEST_ATTR_ACTIVE_CONNS` (u32).
pub const IPVS_DEST_ATTR_ACTIVE_CONNS: u16 = 7;
/// `IPVS_DEST_ATTR_INACT_CONNS` (u32).
pub const IPVS_DEST_ATTR_INACT_CONNS: u16 = 8;
/// `IPVS_DEST_ATTR_PERSIST_CONNS` (u32).
pub const IPVS_DEST_ATTR_PERSIST_CONNS: u16 = 9;
/// `IPVS_DEST_ATTR_STATS` (nested).
pub const IPVS_DEST_ATTR_STATS: u16 = 10;
/// `IPVS_DEST_ATTR_ADDR_FAMILY` (u16).
pub const IPVS_DEST_ATTR_ADDR_FAMILY: u16 = 11;
/// `IPVS_DEST_ATTR_STATS64` (nested).
pub const IPVS_DEST_ATTR_STATS64: u16 = 12;
/// `IPVS_DEST_ATTR_TUN_TYPE` (u8).
pub const IPVS_DEST_ATTR_TUN_TYPE: u16 = 13;
/// `IPVS_DEST_ATTR_TUN_PORT` (u16, network byte order).
pub const IPVS_DEST_ATTR_TUN_PORT: u16 = 14;
/// `IPVS_DEST_ATTR_TUN_FLAGS` (u16).
pub const IPVS_DEST_ATTR_TUN_FLAGS: u16 = 15;

/// `IPVS_STATS_ATTR_CONNS`.
pub const IPVS_STATS_ATTR_CONNS: u16 = 1;
/// `IPVS_STATS_ATTR_INPKTS`.
pub const IPVS_STATS_ATTR_INPKTS: u16 = 2;
/// `IPVS_STATS_ATTR_OUTPKTS`.
pub const IPVS_STATS_ATTR_OUTPKTS: u16 = 3;
/// `IPVS_STATS_ATTR_INBYTES`.
pub const IPVS_STATS_ATTR_INBYTES: u16 = 4;
/// `IPVS_STATS_ATTR_OUTBYTES`.
pub const IPVS_STATS_ATTR_OUTBYTES: u16 = 5;
/// `IPVS_STATS_ATTR_CPS`.
pub const IPVS_STATS_ATTR_CPS: u16 = 6;
/// `IPVS_STATS_ATTR_INPPS`.
pub const IPVS_STATS_ATTR_INPPS: u16 = 7;
/// `IPVS_STATS_ATTR_OUTPPS`.
pub const IPVS_STATS_ATTR_OUTPPS: u16 = 8;
/// `IPVS_STATS_ATTR_INBPS`.
pub const IPVS_STATS_ATTR_INBPS: u16 = 9;
/// `IPVS_STATS_ATTR_OUTBPS`.
pub const IPVS_STATS_ATTR_OUTBPS: u16 = 10;
/// `IPVS_STATS_ATTR_PAD`.
pub const IPVS_STATS_ATTR_PAD: u16 = 11;

/// `IPVS_INFO_ATTR_VERSION` (u32).
pub const IPVS_INFO_ATTR_VERSION: u16 = 1;
/// `IPVS_INFO_ATTR_CONN_TAB_SIZE` (u32).
pub const IPVS_INFO_ATTR_CONN_TAB_SIZE: u16 = 2;
