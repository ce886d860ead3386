//! `cargo xtask test` and `cargo xtask e2e`: every test stage with one summary line each.

use crate::error::Result;

/// `cargo xtask test [--stage NAME]...`.
pub fn test_cmd(_args: &[String]) -> Result<u8> {
    Ok(0)
}

/// `cargo xtask e2e [--filter S]`.
pub fn e2e_cmd(_args: &[String]) -> Result<u8> {
    Ok(0)
}
