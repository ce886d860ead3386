//! Applies an `ipvsadm -S` formatted table through the batch API.
fn main() {}
