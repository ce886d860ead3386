//! The `ipvsadm -S` text format: a parser (table and command forms) and a renderer that
//! prints exactly what `ipvsadm -Sn` (ipvsadm 1.31) prints, including its sort order.

mod parse;
mod render;

pub use parse::*;
pub use render::*;

/// ipvsadm's default scheduler (`DEF_SCHED`).
pub const DEFAULT_SCHEDULER: &str = "wlc";
/// ipvsadm's default persistence timeout for `-p` without a value (`IPVS_SVC_PERSISTENT_TIMEOUT`).
pub const DEFAULT_PERSISTENT_TIMEOUT: u32 = 360;
/// ipvsadm's largest timeout (31 days).
pub const MAX_TIMEOUT: u32 = 86400 * 31;
