//! `cargo xtask fleet [--once]`: a local demo fleet (a gateway, workers and agents) on loopback. Not
//! implemented yet.

use std::process::ExitCode;

use anyhow::Result;

pub(crate) fn run(once: bool) -> Result<ExitCode> {
    let flags = if once { " --once" } else { "" };
    eprintln!("cargo xtask fleet{flags}: not yet implemented");
    Ok(ExitCode::from(2))
}
