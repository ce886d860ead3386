//! Public IPVS data types: virtual servers, real servers, timeouts, counters and operations.

use std::net::IpAddr;

/// The address family and transport protocol (crate `net-types`, shared by every crate).
pub use net_types::{Family, Protocol};

/// Identity of a virtual server: either protocol + address + port, or a firewall mark.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum ServiceKey {
    /// An address-based virtual server (`-t`, `-u`, `--sctp-service`).
    Inet {
        /// Transport protocol.
        protocol: Protocol,
        /// Virtual address (IPv4 or IPv6).
        addr: IpAddr,
        /// Virtual port.
        port: u16,
    },
    /// A firewall-mark virtual server (`-f`).
    Fwmark {
        /// Address family the mark applies to.
        family: Family,
        /// The firewall mark (non-zero).
        mark: u32,
    },
}

impl ServiceKey {
    /// Address family of the virtual server.
    pub fn family(&self) -> Family {
        match self {
            ServiceKey::Inet { addr, .. } => Family::of(addr),
            ServiceKey::Fwmark { family, .. } => *family,
        }
    }
}

/// Every IPVS scheduler the Linux kernel ships (module `ip_vs_NAME`), named as `ipvsadm -s` and
/// the netlink attribute name them: the one list kube-ipvs checks a scheduler name against, for
/// `ipvs.scheduler` / `--ipvs-scheduler` and for the `kube-ipvs.io/scheduler` annotation alike.
///
/// Why all of them, for the flag too: upstream kube-proxy once checked `ipvs.scheduler` against
/// ten names (`validateIPVSSchedulerMethod` in pkg/proxy/apis/config/validation: rr wrr lc wlc
/// lblc lblcr sh dh sed nq; no mh, fo, ovf), but Kubernetes 1.27 removed that function
/// (kubernetes/kubernetes#114878): any name is accepted and the scheduler is tried at start by
/// creating a virtual server with it (#114669). So every kernel scheduler works with the
/// kube-proxy versions kube-ipvs replaces, `mh` (which upstream's `syncProxyRules` gives
/// `mh-port`), `fo` and `ovf` included. kube-ipvs still rejects a name outside this list when
/// the configuration is loaded (so a typo is reported with the list), and tries the configured
/// scheduler at start like upstream (`kube_ipvs::probe`). Upstream has no per-Service
/// scheduler annotation.
pub const SCHEDULERS: &[&str] = &[
    "rr", "wrr", "lc", "wlc", "lblc", "lblcr", "sh", "dh", "sed", "nq", "mh", "fo", "ovf",
];

/// Virtual-server flags (`IP_VS_SVC_F_*`). Scheduler flags 1 and 2 mean
/// sh-fallback/sh-port for `sh` and mh-fallback/mh-port for `mh`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, PartialOrd, Ord)]
pub struct ServiceFlags(pub u32);

impl ServiceFlags {
    /// Persistent (sticky) service (`IP_VS_SVC_F_PERSISTENT`).
    pub const PERSISTENT: u32 = 0x0001;
    /// Hashed entry (`IP_VS_SVC_F_HASHED`), set by the kernel, read-only.
    pub const HASHED: u32 = 0x0002;
    /// One-packet scheduling (`IP_VS_SVC_F_ONEPACKET`).
    pub const ONEPACKET: u32 = 0x0004;
    /// Scheduler flag 1 (`IP_VS_SVC_F_SCHED1`).
    pub const SCHED1: u32 = 0x0008;
    /// Scheduler flag 2 (`IP_VS_SVC_F_SCHED2`).
    pub const SCHED2: u32 = 0x0010;
    /// Scheduler flag 3 (`IP_VS_SVC_F_SCHED3`).
    pub const SCHED3: u32 = 0x0020;
    /// `sh` scheduler: fall back to another server when the chosen one is unavailable.
    pub const SH_FALLBACK: u32 = Self::SCHED1;
    /// `sh` scheduler: include the source port in the hash.
    pub const SH_PORT: u32 = Self::SCHED2;
    /// `mh` scheduler: fall back to another server when the chosen one is unavailable.
    pub const MH_FALLBACK: u32 = Self::SCHED1;
    /// `mh` scheduler: include the source port in the hash.
    pub const MH_PORT: u32 = Self::SCHED2;

    /// True when every bit of `bits` is set.
    pub fn contains(self, bits: u32) -> bool {
        self.0 & bits == bits
    }

    /// Flags with `bits` added.
    pub fn with(self, bits: u32) -> ServiceFlags {
        ServiceFlags(self.0 | bits)
    }

    /// The flags user space sets: without the kernel-maintained `HASHED` bit, which every
    /// service read back from the kernel carries. Compare desired and read flags with this.
    pub fn settable(self) -> ServiceFlags {
        ServiceFlags(self.0 & !Self::HASHED)
    }
}

/// Packet forwarding method of a real server (`IP_VS_CONN_F_FWD_MASK` values).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, PartialOrd, Ord)]
pub enum ForwardMethod {
    /// Masquerading / NAT (`-m`, value 0).
    #[default]
    Masq,
    /// Local node (value 1), reported by the kernel for addresses of the node itself.
    Local,
    /// IP-in-IP tunnelling (`-i`, value 2).
    Tunnel,
    /// Direct routing / gatewaying (`-g`, value 3).
    Route,
    /// Bypass (value 4), kernel-internal.
    Bypass,
}

impl ForwardMethod {
    /// The kernel's connection-flags value for this method.
    pub fn to_flags(self) -> u32 {
        match self {
            ForwardMethod::Masq => 0,
            ForwardMethod::Local => 1,
            ForwardMethod::Tunnel => 2,
            ForwardMethod::Route => 3,
            ForwardMethod::Bypass => 4,
        }
    }

    /// Method from the kernel's connection flags (only the low 3 bits count).
    pub fn from_flags(flags: u32) -> Option<ForwardMethod> {
        match flags & 0x7 {
            0 => Some(ForwardMethod::Masq),
            1 => Some(ForwardMethod::Local),
            2 => Some(ForwardMethod::Tunnel),
            3 => Some(ForwardMethod::Route),
            4 => Some(ForwardMethod::Bypass),
            _ => None,
        }
    }
}

/// Tunnel encapsulation of a tunnelling real server (`IP_VS_CONN_F_TUNNEL_TYPE_*`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, PartialOrd, Ord)]
pub enum TunnelType {
    /// Plain IP-in-IP (value 0, the default).
    #[default]
    Ipip,
    /// GUE encapsulation (value 1).
    Gue,
    /// GRE encapsulation (value 2).
    Gre,
}

impl TunnelType {
    /// Kernel numeric value.
    pub fn to_u8(self) -> u8 {
        match self {
            TunnelType::Ipip => 0,
            TunnelType::Gue => 1,
            TunnelType::Gre => 2,
        }
    }

    /// From the kernel numeric value.
    pub fn from_u8(v: u8) -> Option<TunnelType> {
        match v {
            0 => Some(TunnelType::Ipip),
            1 => Some(TunnelType::Gue),
            2 => Some(TunnelType::Gre),
            _ => None,
        }
    }
}

/// Tunnel flags (`IP_VS_TUNNEL_ENCAP_FLAG_*`).
pub mod tunnel_flags {
    /// No checksum.
    pub const NOCSUM: u16 = 0;
    /// UDP checksum.
    pub const CSUM: u16 = 1 << 0;
    /// Remote checksum offload.
    pub const REMCSUM: u16 = 1 << 1;
}

/// Traffic counters and rate estimates of a virtual or real server (read-only).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct Stats {
    /// Connections scheduled.
    pub conns: u64,
    /// Incoming packets.
    pub inpkts: u64,
    /// Outgoing packets.
    pub outpkts: u64,
    /// Incoming bytes.
    pub inbytes: u64,
    /// Outgoing bytes.
    pub outbytes: u64,
    /// Current connection rate.
    pub cps: u64,
    /// Current incoming packet rate.
    pub inpps: u64,
    /// Current outgoing packet rate.
    pub outpps: u64,
    /// Current incoming byte rate.
    pub inbps: u64,
    /// Current outgoing byte rate.
    pub outbps: u64,
}

/// A virtual server.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Service {
    /// Identity (protocol/address/port or fwmark).
    pub key: ServiceKey,
    /// Scheduler name (`rr`, `wrr`, `sh`, `mh`, ...).
    pub scheduler: String,
    /// Flags (persistent, one-packet, scheduler flags; `HASHED` is kernel-set).
    pub flags: ServiceFlags,
    /// Persistence timeout in seconds (meaningful with `PERSISTENT`; 0 = off).
    pub timeout: u32,
    /// Persistence netmask: for IPv4 a mask in host byte order (e.g. 0xffffffff),
    /// for IPv6 a prefix length (e.g. 128).
    pub netmask: u32,
    /// Persistence engine name (`--pe`, e.g. `sip`), if any.
    pub pe_name: Option<String>,
    /// Counters, filled by the kernel on reads; ignored on writes.
    pub stats: Option<Box<Stats>>,
}

impl Service {
    /// A service with the given key and scheduler, no flags, no persistence and the
    /// default netmask of its family (what `ipvsadm -A` creates).
    pub fn new(key: ServiceKey, scheduler: impl Into<String>) -> Service {
        let netmask = match key.family() {
            Family::Inet => 0xffff_ffff,
            Family::Inet6 => 128,
        };
        Service {
            key,
            scheduler: scheduler.into(),
            flags: ServiceFlags::default(),
            timeout: 0,
            netmask,
            pe_name: None,
            stats: None,
        }
    }
}

/// A real server of a virtual server.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Destination {
    /// Real server address (may differ in family from the service only with tunnelling).
    pub addr: IpAddr,
    /// Real server port.
    pub port: u16,
    /// Forwarding method.
    pub fwd: ForwardMethod,
    /// Weight.
    pub weight: u32,
    /// Upper connection threshold (0 = none).
    pub upper_threshold: u32,
    /// Lower connection threshold (0 = none).
    pub lower_threshold: u32,
    /// Tunnel type (tunnelling only; kernels >= 5.2).
    pub tun_type: TunnelType,
    /// Tunnel destination port (GUE only), host order.
    pub tun_port: u16,
    /// Tunnel flags (`tunnel_flags`).
    pub tun_flags: u16,
    /// Active connections (read-only).
    pub active_conns: u32,
    /// Inactive connections (read-only).
    pub inactive_conns: u32,
    /// Persistent connection templates (read-only).
    pub persist_conns: u32,
    /// Counters, filled by the kernel on reads; ignored on writes.
    pub stats: Option<Box<Stats>>,
}

impl Destination {
    /// A masquerading real server with weight 1 (what `ipvsadm -a ... -m` creates).
    pub fn new(addr: IpAddr, port: u16) -> Destination {
        Destination {
            addr,
            port,
            fwd: ForwardMethod::Masq,
            weight: 1,
            upper_threshold: 0,
            lower_threshold: 0,
            tun_type: TunnelType::Ipip,
            tun_port: 0,
            tun_flags: 0,
            active_conns: 0,
            inactive_conns: 0,
            persist_conns: 0,
            stats: None,
        }
    }
}

/// Connection timeouts (`ipvsadm --set tcp tcpfin udp`), seconds; 0 = leave unchanged.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct Timeouts {
    /// TCP established timeout.
    pub tcp: u32,
    /// TCP FIN_WAIT timeout.
    pub tcp_fin: u32,
    /// UDP timeout.
    pub udp: u32,
}

/// IPVS version and connection hash table size.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct Info {
    /// Version as the kernel encodes it (`(major << 16) | (minor << 8) | patch`).
    pub version: u32,
    /// Connection hash table size.
    pub conn_tab_size: u32,
}

/// One write operation for the batch API.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Op {
    /// Create a virtual server.
    NewService(Service),
    /// Modify a virtual server.
    SetService(Service),
    /// Delete a virtual server (and its real servers).
    DelService(ServiceKey),
    /// Add a real server to a virtual server.
    NewDest(ServiceKey, Destination),
    /// Modify a real server.
    SetDest(ServiceKey, Destination),
    /// Delete a real server by address and port.
    DelDest(ServiceKey, IpAddr, u16),
    /// Delete every virtual server.
    Flush,
    /// Set connection timeouts.
    SetTimeouts(Timeouts),
}

impl Op {
    /// The IPVS command this operation sends (what errors name).
    pub fn kind(&self) -> crate::OpKind {
        use crate::OpKind;
        match self {
            Op::NewService(_) => OpKind::NewService,
            Op::SetService(_) => OpKind::SetService,
            Op::DelService(_) => OpKind::DelService,
            Op::NewDest(..) => OpKind::NewDest,
            Op::SetDest(..) => OpKind::SetDest,
            Op::DelDest(..) => OpKind::DelDest,
            Op::Flush => OpKind::Flush,
            Op::SetTimeouts(_) => OpKind::SetConfig,
        }
    }
}

impl Info {
    /// The version as `major.minor.patch` (what `ipvsadm` prints).
    pub fn version_string(&self) -> String {
        format!(
            "{}.{}.{}",
            (self.version >> 16) & 0xff,
            (self.version >> 8) & 0xff,
            self.version & 0xff
        )
    }
}

/// Request counters of a client, for tests and benchmarks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Counters {
    /// Netlink requests sent (each message counts once).
    pub requests: u64,
    /// `send` system calls made.
    pub sends: u64,
    /// Dump requests sent.
    pub dumps: u64,
    /// Write operations that failed.
    pub errors: u64,
    /// Receive-buffer overruns seen while collecting replies (replies may have been lost).
    pub overruns: u64,
    /// Of `requests`: requests sent per IPVS command.
    pub by_op: OpCounts,
}

/// Requests sent per IPVS command ([`crate::OpKind`]), cumulative.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct OpCounts([u64; 13]);

impl OpCounts {
    /// Counts one request of `op`.
    pub fn inc(&mut self, op: crate::OpKind) {
        if let Some(n) = self.0.get_mut(op.index()) {
            *n += 1;
        }
    }

    /// Requests of `op` so far.
    pub fn get(&self, op: crate::OpKind) -> u64 {
        self.0.get(op.index()).copied().unwrap_or(0)
    }

    /// Every operation with its count, in [`crate::OpKind::ALL`] order.
    pub fn iter(&self) -> impl Iterator<Item = (crate::OpKind, u64)> + '_ {
        crate::OpKind::ALL.iter().map(|op| (*op, self.get(*op)))
    }

    /// The sum of every operation's count.
    pub fn total(&self) -> u64 {
        self.0.iter().sum()
    }

    /// The requests that change the kernel ([`crate::OpKind::is_write`]).
    pub fn writes(&self) -> u64 {
        self.iter()
            .filter(|(op, _)| op.is_write())
            .map(|(_, n)| n)
            .sum()
    }
}
