//! Criterion benchmarks of the policy crate.
fn main() {}
