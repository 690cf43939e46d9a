//! `cargo xtask fetch-peers`: the real test peers, fetched into `.cache/` (which git ignores):
//! the published agent-device 0.21.5, unpacked, for the tests that run its CLI and daemon.
//! Idempotent: a package already unpacked at the right version is kept.

use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode};

use anyhow::{Context, Result, bail};

use crate::cmd;

/// The version the tests pair with.
pub(crate) const AGENT_DEVICE_VERSION: &str = "0.21.5";
/// The registry's SHA-1 of its tarball (`npm view agent-device@0.21.5 dist.shasum`).
const AGENT_DEVICE_SHASUM: &str = "2e8a7d3dc2c201a3af44d8f332e9a53f41d8a9d5";

/// Where the unpacked package lives.
pub(crate) fn agent_device_dir() -> PathBuf {
    cmd::workspace_root().join(".cache/agent-device")
}

/// The unpacked package (`bin/agent-device.mjs` inside).
pub(crate) fn agent_device_package() -> PathBuf {
    agent_device_dir().join("pkg/package")
}

pub(crate) fn run() -> Result<ExitCode> {
    let package = fetch_agent_device()?;
    println!("agent-device {AGENT_DEVICE_VERSION}: {}", package.display());
    Ok(ExitCode::SUCCESS)
}

/// Fetches and unpacks agent-device unless it is already there; answers its directory.
pub(crate) fn fetch_agent_device() -> Result<PathBuf> {
    let package = agent_device_package();
    if installed_version(&package).as_deref() == Some(AGENT_DEVICE_VERSION) {
        return Ok(package);
    }
    let dir = agent_device_dir();
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    println!(
        "fetching agent-device@{AGENT_DEVICE_VERSION} with npm pack into {}",
        dir.display()
    );
    let output = Command::new("npm")
        .args([
            "pack",
            &format!("agent-device@{AGENT_DEVICE_VERSION}"),
            "--json",
            "--pack-destination",
        ])
        .arg(&dir)
        .output()
        .context("running npm (Node.js and npm are needed for the agent-device tests)")?;
    if !output.status.success() {
        bail!(
            "npm pack agent-device@{AGENT_DEVICE_VERSION} failed: {}",
            String::from_utf8_lossy(&output.stderr)
        );
    }
    let packed: serde_json::Value =
        serde_json::from_slice(&output.stdout).context("reading npm pack --json")?;
    let entry = packed.get(0).context("npm pack named no tarball")?;
    let shasum = entry
        .get("shasum")
        .and_then(|s| s.as_str())
        .unwrap_or_default();
    if shasum != AGENT_DEVICE_SHASUM {
        bail!(
            "agent-device@{AGENT_DEVICE_VERSION}'s tarball has SHA-1 {shasum}, not {AGENT_DEVICE_SHASUM}"
        );
    }
    let file = entry
        .get("filename")
        .and_then(|s| s.as_str())
        .context("npm pack named no file")?;
    let tarball = dir.join(Path::new(file).file_name().context("a file name")?);
    let unpack = dir.join("pkg");
    let _ = std::fs::remove_dir_all(&unpack);
    std::fs::create_dir_all(&unpack)?;
    let status = Command::new("tar")
        .arg("xzf")
        .arg(&tarball)
        .arg("-C")
        .arg(&unpack)
        .status()
        .context("running tar")?;
    if !status.success() {
        bail!("unpacking {} failed", tarball.display());
    }
    match installed_version(&package) {
        Some(v) if v == AGENT_DEVICE_VERSION => Ok(package),
        other => bail!("the unpacked package is version {other:?}, not {AGENT_DEVICE_VERSION}"),
    }
}

fn installed_version(package: &Path) -> Option<String> {
    let text = std::fs::read_to_string(package.join("package.json")).ok()?;
    let json: serde_json::Value = serde_json::from_str(&text).ok()?;
    json.get("version")?.as_str().map(String::from)
}
