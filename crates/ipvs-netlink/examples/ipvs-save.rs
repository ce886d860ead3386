//! Prints the kernel IPVS table in `ipvsadm -Sn` format.
fn main() {}
