//! The `agent-device-fake` binary starts like the real daemon: the port line on stdout,
//! `daemon.json` (mode 0600) in its state directory, the token it names accepted, and on
//! SIGTERM both daemon files gone and exit status 0. Its control API steers it over HTTP.

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    reason = "tests fail by panicking"
)]

mod common;

use std::os::unix::fs::PermissionsExt as _;
use std::path::Path;
use std::process::Stdio;
use std::time::Duration;

use bytes::Bytes;
use common::{full, send};
use http::{Method, StatusCode};
use serde_json::{Value, json};
use tokio::io::{AsyncBufReadExt as _, BufReader};
use tokio::process::{Child, Command};

/// A bound for a broken test, not a speed target.
const BOUND: Duration = Duration::from_secs(30);

fn fake(state: &Path) -> Command {
    let mut command = Command::new(env!("CARGO_BIN_EXE_agent-device-fake"));
    command
        .env_clear()
        .env("PATH", std::env::var_os("PATH").unwrap_or_default())
        .env("HOME", state)
        .env("AGENT_DEVICE_STATE_DIR", state.join("state"))
        .env("AGENT_DEVICE_DAEMON_SERVER_MODE", "http")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true);
    command
}

/// Starts the fake and reads its port line.
async fn spawn(mut command: Command) -> (Child, u16) {
    let mut child = command.spawn().unwrap();
    let stdout = child.stdout.take().unwrap();
    let mut lines = BufReader::new(stdout).lines();
    let line = tokio::time::timeout(BOUND, lines.next_line())
        .await
        .expect("the port line in time")
        .unwrap()
        .expect("a port line");
    let port = line
        .strip_prefix("AGENT_DEVICE_DAEMON_HTTP_PORT=")
        .unwrap_or_else(|| panic!("unexpected first line {line:?}"))
        .parse()
        .unwrap();
    (child, port)
}

async fn terminate(mut child: Child) -> std::process::ExitStatus {
    let pid = rustix::process::Pid::from_raw(i32::try_from(child.id().unwrap()).unwrap()).unwrap();
    rustix::process::kill_process(pid, rustix::process::Signal::TERM).unwrap();
    tokio::time::timeout(BOUND, child.wait())
        .await
        .expect("exits in time")
        .unwrap()
}

/// `daemon.json` is written right after the port line; wait for it (bounded).
async fn daemon_json(state: &Path) -> Value {
    let path = state.join("state/daemon.json");
    let read = async {
        loop {
            if let Ok(text) = std::fs::read_to_string(&path)
                && let Ok(value) = serde_json::from_str::<Value>(&text)
            {
                return value;
            }
            tokio::task::yield_now().await;
        }
    };
    tokio::time::timeout(BOUND, read)
        .await
        .expect("daemon.json in time")
}

#[tokio::test]
async fn it_starts_like_the_daemon_and_cleans_up_on_sigterm() {
    let dir = tempfile::tempdir().unwrap();
    let (child, port) = spawn(fake(dir.path())).await;
    let info = daemon_json(dir.path()).await;
    assert_eq!(info["httpPort"], port);
    assert_eq!(info["transport"], "http");
    assert_eq!(info["version"], "0.21.5");
    assert_eq!(info["pid"], child.id().unwrap());
    assert_eq!(
        info["stateDir"],
        dir.path().join("state").display().to_string()
    );
    let token = info["token"].as_str().unwrap().to_owned();
    assert_eq!(token.len(), 48);
    if let Some(start) = info.get("processStartTime") {
        assert!(start.as_str().is_some_and(|s| !s.is_empty()));
    }
    for name in ["daemon.json", "daemon.lock"] {
        let mode = std::fs::metadata(dir.path().join("state").join(name))
            .unwrap()
            .permissions()
            .mode();
        assert_eq!(mode & 0o777, 0o600, "{name}");
    }

    let base = format!("http://127.0.0.1:{port}");
    let health = send(
        Method::GET,
        &format!("{base}/health"),
        &[],
        full(Bytes::new()),
    )
    .await;
    assert_eq!(health.text(), agent_device_fake::HEALTH_BODY);
    let auth = format!("Bearer {token}");
    let devices = send(
        Method::POST,
        &format!("{base}/rpc"),
        &[("authorization", &auth)],
        full(r#"{"jsonrpc":"2.0","id":"a","method":"agent_device.command","params":{"command":"devices"}}"#),
    )
    .await;
    assert_eq!(devices.status, StatusCode::OK);
    assert_eq!(
        devices.json()["result"]["data"]["devices"][0]["platform"],
        "linux"
    );
    let requests = send(
        Method::GET,
        &format!("{base}/__fake/requests"),
        &[],
        full(Bytes::new()),
    )
    .await;
    assert_eq!(requests.json().as_array().map(Vec::len), Some(2));

    let status = terminate(child).await;
    assert!(status.success(), "{status}");
    assert!(!dir.path().join("state/daemon.json").exists());
    assert!(!dir.path().join("state/daemon.lock").exists());
}

#[tokio::test]
async fn its_token_and_devices_can_be_fixed_and_steered_over_http() {
    let dir = tempfile::tempdir().unwrap();
    let mut command = fake(dir.path());
    command
        .env("AGENT_DEVICE_FAKE_TOKEN", "fixed-token")
        .env(
            "AGENT_DEVICE_FAKE_DEVICES",
            json!([{"platform":"android","id":"emulator-5554","name":"Pixel","kind":"emulator","target":"mobile","booted":true}])
                .to_string(),
        )
        .env("AGENT_DEVICE_LEASE_TTL_MS", "120000");
    let (child, port) = spawn(command).await;
    assert_eq!(daemon_json(dir.path()).await["token"], "fixed-token");
    let base = format!("http://127.0.0.1:{port}");
    let rpc = |method: &'static str, params: Value| {
        let url = format!("{base}/rpc");
        async move {
            send(
                Method::POST,
                &url,
                &[("x-agent-device-token", "fixed-token")],
                full(json!({"jsonrpc":"2.0","id":"a","method":method,"params":params}).to_string()),
            )
            .await
        }
    };
    let devices = rpc("agent_device.command", json!({"command":"devices"})).await;
    assert_eq!(
        devices.json()["result"]["data"]["devices"][0]["id"],
        "emulator-5554"
    );
    let lease = rpc(
        "agent_device.lease.allocate",
        json!({"tenantId":"t","runId":"r"}),
    )
    .await
    .json();
    let view = &lease["result"]["data"]["lease"];
    assert_eq!(
        view["expiresAt"].as_u64().unwrap() - view["createdAt"].as_u64().unwrap(),
        120_000,
        "AGENT_DEVICE_LEASE_TTL_MS sets the default TTL"
    );
    let steer = send(
        Method::POST,
        &format!("{base}/__fake/command-failures"),
        &[],
        full(r#"{"command":"devices","error":{"code":"TOOL_MISSING","message":"adb not found in PATH"}}"#),
    )
    .await;
    assert_eq!(steer.status, StatusCode::OK);
    let failed = rpc("agent_device.command", json!({"command":"devices"})).await;
    assert_eq!(failed.json()["error"]["data"]["code"], "TOOL_MISSING");
    let leases = send(
        Method::GET,
        &format!("{base}/__fake/leases"),
        &[],
        full(Bytes::new()),
    )
    .await;
    assert_eq!(leases.json()[0]["tenantId"], "t");
    assert!(terminate(child).await.success());
}

#[tokio::test]
async fn it_refuses_what_it_cannot_be() {
    let dir = tempfile::tempdir().unwrap();
    for (name, value) in [
        ("AGENT_DEVICE_DAEMON_SERVER_MODE", "socket"),
        ("AGENT_DEVICE_FAKE_DEVICES", "[{\"platform\":\"nokia\"}]"),
        ("AGENT_DEVICE_LEASE_TTL_MS", "soon"),
        ("AGENT_DEVICE_FAKE_TOKEN", ""),
    ] {
        let mut command = fake(dir.path());
        command.env(name, value);
        let output = tokio::time::timeout(BOUND, command.output())
            .await
            .expect("exits in time")
            .unwrap();
        assert_eq!(output.status.code(), Some(2), "{name}={value}");
        assert!(output.stdout.is_empty(), "no port line for {name}={value}");
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert!(stderr.contains(name), "{name}: {stderr}");
        assert!(!dir.path().join("state/daemon.json").exists());
    }
}

#[tokio::test]
async fn a_second_fake_leaves_a_live_ones_directory_alone() {
    let dir = tempfile::tempdir().unwrap();
    let (first, port) = spawn(fake(dir.path())).await;
    let info = daemon_json(dir.path()).await;
    let output = tokio::time::timeout(BOUND, fake(dir.path()).output())
        .await
        .expect("exits in time")
        .unwrap();
    assert!(output.status.success());
    assert_eq!(
        String::from_utf8_lossy(&output.stdout),
        "Daemon lock is held by another process; exiting.\n"
    );
    assert_eq!(
        daemon_json(dir.path()).await,
        info,
        "the first daemon's files stand"
    );
    let health = send(
        Method::GET,
        &format!("http://127.0.0.1:{port}/health"),
        &[],
        full(Bytes::new()),
    )
    .await;
    assert_eq!(health.status, StatusCode::OK);
    assert!(terminate(first).await.success());
}

#[tokio::test]
async fn a_fake_takes_over_the_directory_of_one_that_was_killed() {
    let dir = tempfile::tempdir().unwrap();
    let (mut first, _) = spawn(fake(dir.path())).await;
    let old = daemon_json(dir.path()).await;
    first.kill().await.unwrap();
    first.wait().await.unwrap();
    assert!(
        dir.path().join("state/daemon.lock").exists(),
        "SIGKILL leaves the files"
    );
    let (second, port) = spawn(fake(dir.path())).await;
    let info = tokio::time::timeout(BOUND, async {
        loop {
            let info = daemon_json(dir.path()).await;
            if info["httpPort"] == port {
                return info;
            }
            tokio::task::yield_now().await;
        }
    })
    .await
    .expect("the new daemon.json in time");
    assert_ne!(info["pid"], old["pid"]);
    assert_ne!(info["token"], old["token"]);
    assert!(terminate(second).await.success());
}

/// `--help` prints the usage and exits 0 without starting a daemon (no port line, no
/// `daemon.json`); an argument it does not take exits 2 naming it.
#[tokio::test]
async fn help_prints_the_usage_and_an_unknown_argument_exits_2_without_serving() {
    let state = tempfile::tempdir().unwrap();
    let run = |args: &'static [&'static str]| {
        let mut command = fake(state.path());
        command.args(args);
        async move {
            tokio::time::timeout(BOUND, command.output())
                .await
                .expect("it exits at once")
                .unwrap()
        }
    };
    for flag in [&["--help"], &["-h"]] {
        let out = run(flag).await;
        assert_eq!(out.status.code(), Some(0), "{flag:?}");
        let usage = String::from_utf8_lossy(&out.stdout);
        assert!(
            usage.contains("Usage: agent-device-fake"),
            "{flag:?}: {usage}"
        );
        assert!(out.stderr.is_empty(), "{flag:?}");
    }
    let out = run(&["--bogus"]).await;
    assert_eq!(out.status.code(), Some(2));
    assert!(out.stdout.is_empty(), "no port line: it did not serve");
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("unexpected argument '--bogus'"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        !state.path().join("state").join("daemon.json").exists(),
        "no daemon started"
    );
}
