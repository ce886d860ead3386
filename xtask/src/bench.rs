//! `cargo xtask bench`: benchmarks (not yet implemented; extend [`bench`]).

use crate::error::Result;

/// Entry point for `cargo xtask bench ARGS...`. Returns the process exit code.
///
/// To implement: build the benchmark binaries, then run them in the VM with
/// [`crate::vm::run`] (see `test::vm_stage` for copying binaries in and parsing output).
pub fn bench(args: &[String]) -> Result<u8> {
    eprintln!("xtask bench: not yet implemented (args: {args:?})");
    Ok(2)
}
