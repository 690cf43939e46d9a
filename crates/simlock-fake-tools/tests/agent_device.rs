//! The real agent-device 0.21.5 daemon (a test peer, not part of simlock) sees an emulator
//! leased from a worker through the fake `adb` on its `PATH`, with the grant's environment, and
//! opens and closes a session on it.
//!
//! Runs when the unpacked npm package is found — `AGENT_DEVICE_PKG`, else
//! `.cache/agent-device/pkg/package` in the workspace (what `.ci/run` fetches with
//! `npm pack agent-device@0.21.5`) — and `node` is on `PATH`; skipped otherwise, so the suite
//! passes offline.

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::print_stderr,
    reason = "a test fails by panicking, and says what the peer answered"
)]

mod support;

use std::io::{BufRead, BufReader, Read, Write};
use std::path::PathBuf;
use std::process::{Command, Stdio};

use simlock_contract::model::Platform;
use support::{Rig, android_access};

/// One JSON-RPC call to the daemon on `port`.
fn rpc(port: u16, token: &str, body: &serde_json::Value) -> serde_json::Value {
    let body = body.to_string();
    let mut stream = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
    write!(
        stream,
        "POST /rpc HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\nauthorization: Bearer {token}\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let mut answer = String::new();
    stream.read_to_string(&mut answer).unwrap();
    let json = answer.split("\r\n\r\n").nth(1).unwrap_or_default();
    serde_json::from_str(json).unwrap_or_else(|_| serde_json::json!({ "raw": answer }))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_agent_device_daemon_lists_the_leased_emulator_through_simlocks_adb() {
    let cached =
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../.cache/agent-device/pkg/package");
    let pkg = std::env::var_os("AGENT_DEVICE_PKG").map_or(cached, PathBuf::from);
    let node = Command::new("node")
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success());
    if !pkg.join("dist/src/internal/daemon.js").exists() || !node {
        eprintln!(
            "skipped: no agent-device@0.21.5 package at {} (AGENT_DEVICE_PKG), or no node",
            pkg.display()
        );
        return;
    }
    let mut rig = Rig::new(Platform::Android);
    rig.start().await;
    let grant = rig.lease("agent", Platform::Android).await.unwrap();
    let (serial, _, _) = android_access(&grant);

    let state = rig.dir.path().join("agent-device-state");
    let path = format!(
        "{}:{}",
        rig.machine.sdk_root().join("platform-tools").display(),
        std::env::var("PATH").unwrap_or_default()
    );
    let mut daemon = Command::new("node")
        .arg(pkg.join("dist/src/internal/daemon.js"))
        .env("PATH", path)
        .env("HOME", rig.dir.path().join("agent-home"))
        .env("CI", "1")
        .env("AGENT_DEVICE_NO_UPDATE_NOTIFIER", "1")
        .env("AGENT_DEVICE_STATE_DIR", &state)
        .env("AGENT_DEVICE_DAEMON_SERVER_MODE", "http")
        .env("SIMLOCK_FAKE_MACHINE", rig.machine.root())
        .envs(&grant.environment)
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap();
    let stdout = daemon.stdout.take().unwrap();
    let port: u16 = BufReader::new(stdout)
        .lines()
        .map_while(Result::ok)
        .find_map(|l| {
            l.strip_prefix("AGENT_DEVICE_DAEMON_HTTP_PORT=")
                .and_then(|p| p.trim().parse().ok())
        })
        .expect("the daemon's port line");
    let token = serde_json::from_slice::<serde_json::Value>(
        &std::fs::read(state.join("daemon.json")).unwrap(),
    )
    .unwrap()["token"]
        .as_str()
        .unwrap()
        .to_owned();
    let answer = rpc(
        port,
        &token,
        &serde_json::json!({"jsonrpc": "2.0", "id": "r1", "method": "agent_device.command",
            "params": {"session": "default", "command": "devices", "positionals": [], "flags": {"platform": "android"}}}),
    );
    eprintln!("agent-device devices --platform android: {answer}");
    // A session on it: `open` launches an app with `adb shell am start` on the leased emulator.
    let opened = rpc(
        port,
        &token,
        &serde_json::json!({"jsonrpc": "2.0", "id": "r2", "method": "agent_device.command",
            "params": {"session": "s1", "command": "open", "positionals": ["settings"], "flags": {"platform": "android", "serial": serial}}}),
    );
    eprintln!("agent-device open settings --serial {serial}: {opened}");
    let closed = rpc(
        port,
        &token,
        &serde_json::json!({"jsonrpc": "2.0", "id": "r3", "method": "agent_device.command",
            "params": {"session": "s1", "command": "close", "positionals": [], "flags": {}}}),
    );
    let _ = daemon.kill();
    let _ = daemon.wait();
    let devices = answer["result"]["data"]["devices"]
        .as_array()
        .cloned()
        .unwrap_or_default();
    assert!(
        devices.iter().any(|d| d["id"] == serial.as_str()),
        "the leased {serial} in {answer}"
    );
    assert_eq!(
        opened["result"]["data"]["serial"],
        serial.as_str(),
        "{opened}"
    );
    assert_eq!(opened["result"]["ok"], true, "{opened}");
    assert_eq!(closed["result"]["ok"], true, "{closed}");
    rig.stop().await;
}
