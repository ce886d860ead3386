//! glibc malloc settings for a long-running proxy: the process re-executes itself once, at
//! start, with `GLIBC_TUNABLES` set, unless the operator already set that variable.
//!
//! Why: glibc's malloc grows its trim and mmap thresholds after the first large block is freed
//! (up to 32 MiB / 64 MiB) and gives every contending thread its own arena, so the memory of
//! the initial list and the first full sync stays resident for the process's lifetime. Fixed
//! thresholds, one arena and no fastbins let `free` hand more of it back (docs/benchmarks.md,
//! issue #18). The
//! settings only exist as environment tunables read by the dynamic loader, and `mallopt` /
//! `malloc_trim` would need `unsafe` FFI, so the binary sets them for its own image by
//! `execve("/proc/self/exe")`: same pid, same arguments, no extra process.

use std::ffi::{OsStr, OsString};

/// The variable glibc's loader reads.
pub const VAR: &str = "GLIBC_TUNABLES";

/// What the proxy runs with: one malloc arena (every thread reuses the memory another freed,
/// instead of stranding it in a second heap), a fixed 128 KiB trim threshold and a fixed
/// 64 KiB mmap threshold (blocks from 64 KiB up, hash tables and vectors, get their own
/// mappings and go back to the kernel when freed; glibc would otherwise raise both), and no
/// fastbins (a freed small block coalesces at once, so more of the heap's top can be trimmed).
/// Measured at 10k services x 10 endpoints, two runs each in one boot: steady RSS 64.1–64.3 ->
/// 59.4–60.8 MiB from the API, peak 74.8–75.7 -> 70.7–72.2 MiB, start not slower
/// (docs/benchmarks.md).
pub const TUNABLES: &str = "glibc.malloc.arena_max=1:\
glibc.malloc.trim_threshold=131072:glibc.malloc.mmap_threshold=65536:glibc.malloc.mxfast=0";

/// The value to re-execute with, given the current one: `None` when the operator (or a previous
/// execution of this process) already chose one, even an empty one, which is how an operator
/// turns this off.
pub fn wanted(current: Option<&OsStr>) -> Option<&'static str> {
    match current {
        Some(_) => None,
        None => Some(TUNABLES),
    }
}

/// Re-executes the process with [`TUNABLES`] when [`wanted`] says so. Returns only when no
/// re-execution was wanted or it failed (then the reason, and the process goes on with glibc's
/// defaults: a missed memory saving is not worth failing a start). Call first thing in `main`,
/// before any thread exists.
#[cfg(all(target_os = "linux", target_env = "gnu"))]
pub fn tune() -> Option<std::io::Error> {
    use std::os::unix::process::CommandExt;
    let value = wanted(std::env::var_os(VAR).as_deref())?;
    let mut args = std::env::args_os();
    let arg0 = args.next().unwrap_or_else(|| OsString::from("kube-ipvs"));
    // `exec` only returns on failure.
    Some(
        std::process::Command::new("/proc/self/exe")
            .arg0(arg0)
            .args(args)
            .env(VAR, value)
            .exec(),
    )
}

/// Other C libraries have none of glibc's tunables: nothing to do.
#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
pub fn tune() -> Option<std::io::Error> {
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_unset_variable_is_set_and_any_value_is_kept() {
        assert_eq!(wanted(None), Some(TUNABLES));
        assert_eq!(wanted(Some(OsStr::new(""))), None);
        assert_eq!(wanted(Some(OsStr::new(TUNABLES))), None);
        assert_eq!(wanted(Some(OsStr::new("glibc.malloc.arena_max=8"))), None);
    }

    #[test]
    fn the_value_is_four_colon_separated_malloc_tunables() {
        let parts: Vec<&str> = TUNABLES.split(':').collect();
        assert_eq!(
            parts,
            [
                "glibc.malloc.arena_max=1",
                "glibc.malloc.trim_threshold=131072",
                "glibc.malloc.mmap_threshold=65536",
                "glibc.malloc.mxfast=0"
            ]
        );
    }
}
