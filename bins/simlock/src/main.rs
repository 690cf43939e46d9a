//! The simlock command-line interface.

fn main() {}
