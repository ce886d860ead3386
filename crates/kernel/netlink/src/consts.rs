//! Numeric constants from `include/uapi/linux/netlink.h`, shared by every netlink family.

/// `NLMSG_NOOP`.
pub const NLMSG_NOOP: u16 = 1;
/// `NLMSG_ERROR` (also carries ACKs with error 0).
pub const NLMSG_ERROR: u16 = 2;
/// `NLMSG_DONE`, ends a dump.
pub const NLMSG_DONE: u16 = 3;
/// `NLMSG_OVERRUN`.
pub const NLMSG_OVERRUN: u16 = 4;
/// `NLM_F_REQUEST`.
pub const NLM_F_REQUEST: u16 = 0x1;
/// `NLM_F_MULTI`.
pub const NLM_F_MULTI: u16 = 0x2;
/// `NLM_F_ACK`.
pub const NLM_F_ACK: u16 = 0x4;
/// `NLM_F_ROOT`.
pub const NLM_F_ROOT: u16 = 0x100;
/// `NLM_F_MATCH`.
pub const NLM_F_MATCH: u16 = 0x200;
/// `NLM_F_DUMP` = ROOT | MATCH.
pub const NLM_F_DUMP: u16 = NLM_F_ROOT | NLM_F_MATCH;
/// `NLM_F_CAPPED` on an error message: the echoed request carries no payload.
pub const NLM_F_CAPPED: u16 = 0x100;
/// `NLM_F_ACK_TLVS` on an error message: extended ACK attributes follow.
pub const NLM_F_ACK_TLVS: u16 = 0x200;
/// `sizeof(struct nlmsghdr)`.
pub const NLMSG_HDRLEN: usize = 16;
/// `NLA_HDRLEN`.
pub const NLA_HDRLEN: usize = 4;
/// `NLA_F_NESTED`: marks a nested attribute (families parsed with strict validation, such as
/// ctnetlink's `CTA_FILTER`, require it; IPVS does not set it).
pub const NLA_F_NESTED: u16 = 0x8000;
/// `NLA_TYPE_MASK`: attribute type without the NESTED / NET_BYTEORDER bits.
pub const NLA_TYPE_MASK: u16 = 0x3fff;
