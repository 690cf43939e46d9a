//! Project automation: ci, e2e, bench, fleet.

fn main() {}
