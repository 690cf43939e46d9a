//! `cargo xtask e2e`: builds the real binaries and runs the end-to-end scenario against them
//! (`crates/simlock-e2e/tests/binaries.rs`, enabled by `SIMLOCK_E2E=1`): worker processes
//! started with their own homes, driven by the `simlock` CLI and by raw HTTP, killed with
//! SIGKILL and started again.

use std::path::PathBuf;
use std::process::{Command, ExitCode};

use anyhow::Result;

use crate::cmd;

/// Where cargo puts debug binaries.
pub(crate) fn bin_dir() -> PathBuf {
    std::env::var_os("CARGO_TARGET_DIR")
        .map_or_else(|| cmd::workspace_root().join("target"), PathBuf::from)
        .join("debug")
}

/// Builds the daemons and the CLI.
pub(crate) fn build_command() -> Command {
    cmd::cargo([
        "build",
        "--locked",
        "-p",
        "simlock-worker",
        "-p",
        "simlock-gateway",
        "-p",
        "simlock",
    ])
}

/// Runs the scenario against the built binaries.
pub(crate) fn scenario_command() -> Command {
    let mut command = cmd::cargo([
        "test",
        "--locked",
        "-p",
        "simlock-e2e",
        "--test",
        "binaries",
        "--",
        "--test-threads",
        "2",
    ]);
    command
        .env("SIMLOCK_E2E", "1")
        .env("SIMLOCK_BIN_DIR", bin_dir());
    command
}

pub(crate) fn run() -> Result<ExitCode> {
    crate::peers::fetch_agent_device()?;
    for command in [build_command(), scenario_command()] {
        let status = cmd::status(command)?;
        if !status.success() {
            eprintln!("cargo xtask e2e: failed ({status})");
            return Ok(ExitCode::FAILURE);
        }
    }
    println!("cargo xtask e2e: the binary scenario passed");
    Ok(ExitCode::SUCCESS)
}
