//! The simlock gateway daemon: composition only.

fn main() {}
