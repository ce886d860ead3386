//! Project automation: `cargo xtask vm|test|bench|e2e`.
fn main() {}
