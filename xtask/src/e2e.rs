//! `cargo xtask e2e`: builds the real binaries and runs the end-to-end scenarios against them
//! (`crates/simlock-e2e/tests/binaries.rs` and `crates/simlock-fake-tools/tests/crash.rs`,
//! enabled by `SIMLOCK_E2E=1`): worker processes started with their own homes, driven by the
//! `simlock` CLI and by raw HTTP, killed with SIGKILL (mid-create, mid-boot, mid-reclaim on the
//! fake device tools) and started again.
//!
//! `cargo xtask e2e --real-devices` is the manual check on a machine with the real tools (a Mac
//! with Xcode, and/or an Android SDK with a system image): it runs
//! `crates/simlock-fake-tools/tests/real_devices.rs` with `SIMLOCK_REAL_DEVICES=1`.

use std::path::PathBuf;
use std::process::{Command, ExitCode};

use anyhow::Result;

use crate::cmd;

/// Cargo's target directory: `CARGO_TARGET_DIR` when set, else the workspace's `target/`.
pub(crate) fn target_dir() -> PathBuf {
    std::env::var_os("CARGO_TARGET_DIR")
        .map_or_else(|| cmd::workspace_root().join("target"), PathBuf::from)
}

/// Where cargo puts debug binaries.
pub(crate) fn bin_dir() -> PathBuf {
    target_dir().join("debug")
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
        // The agent-device a worker runs in the gateway-restart scenario.
        "-p",
        "agent-device-fake",
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

/// Runs the `kill -9` scenarios of the real drivers (on the fake tools) against the built worker.
pub(crate) fn crash_command() -> Command {
    let mut command = cmd::cargo([
        "test",
        "--locked",
        "-p",
        "simlock-fake-tools",
        "--test",
        "crash",
        "--",
        "--test-threads",
        "1",
    ]);
    command
        .env("SIMLOCK_E2E", "1")
        .env("SIMLOCK_BIN_DIR", bin_dir());
    command
}

/// The real-tool check: a worker on this machine's Xcode and/or Android SDK.
pub(crate) fn real_devices_command() -> Command {
    let mut command = cmd::cargo([
        "test",
        "--locked",
        "-p",
        "simlock-fake-tools",
        "--test",
        "real_devices",
        "--",
        "--test-threads",
        "1",
        "--nocapture",
    ]);
    command.env("SIMLOCK_REAL_DEVICES", "1");
    command
}

pub(crate) fn run(real_devices: bool) -> Result<ExitCode> {
    if real_devices {
        let status = cmd::status(real_devices_command())?;
        if !status.success() {
            eprintln!("cargo xtask e2e --real-devices: failed ({status})");
            return Ok(ExitCode::FAILURE);
        }
        println!("cargo xtask e2e --real-devices: the real-device check passed");
        return Ok(ExitCode::SUCCESS);
    }
    crate::peers::fetch_agent_device()?;
    for command in [build_command(), scenario_command(), crash_command()] {
        let status = cmd::status(command)?;
        if !status.success() {
            eprintln!("cargo xtask e2e: failed ({status})");
            return Ok(ExitCode::FAILURE);
        }
    }
    println!("cargo xtask e2e: the binary scenario passed");
    Ok(ExitCode::SUCCESS)
}
