//! `cargo xtask e2e`: builds the real binaries, starts a fleet on loopback and runs the end-to-end
//! scenarios. Not implemented yet.

use std::process::ExitCode;

use anyhow::Result;

pub(crate) fn run() -> Result<ExitCode> {
    eprintln!("cargo xtask e2e: not yet implemented");
    Ok(ExitCode::from(2))
}
