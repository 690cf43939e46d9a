//! The simlock worker daemon: composition only.

fn main() {}
