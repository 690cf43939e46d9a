//! Conformance: one scripted session of the real agent-device 0.21.5 CLI, run once against the
//! real 0.21.5 daemon and once against the fake, each time through a logging proxy; the
//! normalised request/response pairs (and the CLI's own output) must be the same.
//!
//! # Running it
//!
//! The real package is read from `AGENT_DEVICE_PKG`, by default
//! `<workspace>/.cache/agent-device/pkg/package`. Fetch it once with
//!
//! ```text
//! mkdir -p .cache/agent-device && cd .cache/agent-device \
//!   && npm pack agent-device@0.21.5 && mkdir -p pkg && tar xzf agent-device-0.21.5.tgz -C pkg
//! ```
//!
//! `node` (20 or later) must be on `PATH`. Without the package the test fails and says how to
//! fetch it, unless `SIMLOCK_SKIP_REAL_AGENT_DEVICE=1`. Both transcripts are written to
//! `<target>/tmp/agent-device-conformance/{real,fake}.json` for reading a difference.
//!
//! # The session
//!
//! `devices`; `open` and `close` on linux (session `lin1`); `open`, `screenshot` and `close`
//! (session `shot`: the real daemon gets a `scrot` that copies a 4×4 PNG, the fake answers the
//! same PNG; the CLI downloads the one artifact); `connect --remote-config` with an
//! android profile under tenant isolation (sends nothing); `devices` twice (the first allocates
//! the lease, the second heartbeats first; both fail `TOOL_MISSING` for want of adb, and the CLI
//! fetches each failure's diagnostics); `install` of a 3000-byte file (preflight, chunked PUT,
//! finalize, then the install fails and its diagnostics are fetched); `disconnect` (a `close`
//! that fails with its diagnostics, then the lease release). The fake is told to fail android
//! commands with the real box's `adb not found in PATH`; nothing else is set up for it.
//!
//! # What is normalised
//!
//! * Per-run values become placeholders: the run directory (`<run>`: daemon and CLI state
//!   directories, homes, the working directory), the proxy's `host:port` (`<proxy>`), the
//!   daemon token (`<token>`).
//! * Minted ids become numbered aliases in order of first appearance, so that which id is the
//!   same as which is still compared: UUIDs (`<uuid#n>`: upload and artifact ids), 32-hex ids
//!   (`<hex32#n>`: lease ids, `adc-` sessions), 16-hex ids (`<hex16#n>`: request ids),
//!   diagnostic ids (`<diagnostic#n>`); the remote temp path the CLI invents for a screenshot
//!   (`agent-device-screenshot-<ms>-<random>`).
//! * Times: ISO-8601 timestamps become `<iso>`; `createdAt` and `heartbeatAt` become `<ms>` and
//!   `expiresAt` becomes `heartbeatAt+<ttl>` (so the TTL is compared); `durationMs` and
//!   `totalDurationMs` become `<ms>`. The CLI's `remoteConfigHash` and
//!   `daemonBaseUrlFingerprint` (digests of the profile, which names the proxy's port) become
//!   `<digest>`.
//! * A diagnostics NDJSON body keeps its first and last lines (`request_start` and the final
//!   `request_failed`); the real daemon logs steps in between (`resolve_target_device`) that the
//!   fake does not.
//! * Compared headers: requests' `authorization`, `x-agent-device-token`, `content-type`,
//!   `content-range`, `transfer-encoding`, `x-agent-device-tenant`; responses' `content-type`,
//!   `content-disposition`, `range`, `x-upload-offset`. Other headers (`date`, `keep-alive`,
//!   `user-agent`, lengths) are not compared. Non-JSON bodies compare as text, or as length and
//!   SHA-256 when binary.

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::print_stdout,
    clippy::print_stderr,
    reason = "tests fail by panicking and report what they compared"
)]

use std::collections::HashMap;
use std::convert::Infallible;
use std::net::SocketAddr;
use std::os::unix::fs::PermissionsExt as _;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::Arc;
use std::time::Duration;

use agent_device_fake::{
    CommandFailure, DaemonError, Device, ErrorCode, FakeAgentDevice, FakeOptions, TINY_PNG,
};
use bytes::Bytes;
use http::{HeaderMap, Request, Response};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::{TokioExecutor, TokioIo};
use parking_lot::Mutex;
use regex::Regex;
use serde_json::{Map, Value, json};
use sha2::{Digest, Sha256};
use tokio::io::{AsyncBufReadExt as _, BufReader};
use tokio::net::TcpListener;
use tokio::process::{Child, Command};

/// How long one process may take to start, answer or stop: a bound for a broken run.
const BOUND: Duration = Duration::from_secs(120);

const REQUEST_HEADERS: &[&str] = &[
    "authorization",
    "x-agent-device-token",
    "content-type",
    "content-range",
    "transfer-encoding",
    "x-agent-device-tenant",
];
const RESPONSE_HEADERS: &[&str] = &[
    "content-type",
    "content-disposition",
    "range",
    "x-upload-offset",
];

fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .ancestors()
        .nth(2)
        .unwrap()
        .to_path_buf()
}

/// The package, or why the test cannot run.
fn package() -> Result<PathBuf, String> {
    let dir = std::env::var_os("AGENT_DEVICE_PKG").map_or_else(
        || workspace_root().join(".cache/agent-device/pkg/package"),
        PathBuf::from,
    );
    if dir.join("bin/agent-device.mjs").is_file()
        && dir.join("dist/src/internal/daemon.js").is_file()
    {
        return Ok(dir);
    }
    Err(format!(
        "the agent-device 0.21.5 package is not at {} (set AGENT_DEVICE_PKG, or fetch it: \
         mkdir -p .cache/agent-device && cd .cache/agent-device && npm pack agent-device@0.21.5 \
         && mkdir -p pkg && tar xzf agent-device-0.21.5.tgz -C pkg). \
         SIMLOCK_SKIP_REAL_AGENT_DEVICE=1 skips this test.",
        dir.display()
    ))
}

/// `PATH` without any directory that holds `adb`: the session relies on adb being missing, as
/// it is on simlock's Linux CI.
fn path_without_adb() -> String {
    let path = std::env::var("PATH").unwrap_or_default();
    path.split(':')
        .filter(|dir| !dir.is_empty() && !Path::new(dir).join("adb").exists())
        .collect::<Vec<_>>()
        .join(":")
}

// === The logging proxy =========================================================================

/// One request and its answer, as they crossed the proxy.
#[derive(Debug, Clone)]
struct Exchange {
    method: String,
    path: String,
    request_headers: HeaderMap,
    request_body: Bytes,
    status: u16,
    response_headers: HeaderMap,
    response_body: Bytes,
}

const HOP_BY_HOP: &[&str] = &[
    "connection",
    "keep-alive",
    "transfer-encoding",
    "content-length",
    "te",
    "trailer",
    "upgrade",
];

struct Proxy {
    addr: SocketAddr,
    log: Arc<Mutex<Vec<Exchange>>>,
    task: tokio::task::JoinHandle<()>,
}

impl Proxy {
    async fn start(upstream: SocketAddr) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let log = Arc::new(Mutex::new(Vec::new()));
        let client: Client<HttpConnector, Full<Bytes>> =
            Client::builder(TokioExecutor::new()).build_http();
        let task = {
            let log = log.clone();
            tokio::spawn(async move {
                loop {
                    let Ok((stream, _)) = listener.accept().await else {
                        continue;
                    };
                    let log = log.clone();
                    let client = client.clone();
                    tokio::spawn(async move {
                        let service = service_fn(move |request| {
                            forward(client.clone(), upstream, log.clone(), request)
                        });
                        let _ = hyper::server::conn::http1::Builder::new()
                            .serve_connection(TokioIo::new(stream), service)
                            .await;
                    });
                }
            })
        };
        Self { addr, log, task }
    }

    fn exchanges(&self) -> Vec<Exchange> {
        self.log.lock().clone()
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.task.abort();
    }
}

fn copy_headers(from: &HeaderMap, to: &mut HeaderMap) {
    for (name, value) in from {
        if !HOP_BY_HOP.contains(&name.as_str()) {
            to.append(name.clone(), value.clone());
        }
    }
}

async fn forward(
    client: Client<HttpConnector, Full<Bytes>>,
    upstream: SocketAddr,
    log: Arc<Mutex<Vec<Exchange>>>,
    request: Request<Incoming>,
) -> Result<Response<Full<Bytes>>, Infallible> {
    let (parts, body) = request.into_parts();
    let request_body = body
        .collect()
        .await
        .map(|c| c.to_bytes())
        .unwrap_or_default();
    let path = parts
        .uri
        .path_and_query()
        .map_or_else(|| "/".to_owned(), |pq| pq.as_str().to_owned());
    let mut upstream_request = Request::builder()
        .method(parts.method.clone())
        .uri(format!("http://{upstream}{path}"))
        .body(Full::new(request_body.clone()))
        .unwrap();
    // The Host header goes through as the client sent it: the daemon builds the upload ticket's
    // URL from it, and the ticket must point back at the proxy.
    copy_headers(&parts.headers, upstream_request.headers_mut());
    let (status, response_headers, response_body) = match client.request(upstream_request).await {
        Ok(response) => {
            let (head, body) = response.into_parts();
            let bytes = body
                .collect()
                .await
                .map(|c| c.to_bytes())
                .unwrap_or_default();
            (head.status, head.headers, bytes)
        }
        Err(error) => (
            http::StatusCode::BAD_GATEWAY,
            HeaderMap::new(),
            Bytes::from(format!("proxy: {error}")),
        ),
    };
    log.lock().push(Exchange {
        method: parts.method.to_string(),
        path,
        request_headers: parts.headers.clone(),
        request_body,
        status: status.as_u16(),
        response_headers: response_headers.clone(),
        response_body: response_body.clone(),
    });
    let mut response = Response::new(Full::new(response_body));
    *response.status_mut() = status;
    copy_headers(&response_headers, response.headers_mut());
    Ok(response)
}

// === The daemons ===============================================================================

/// A daemon the session talks to.
enum Daemon {
    Real { child: Child, addr: SocketAddr },
    Fake(FakeAgentDevice),
}

impl Daemon {
    async fn real(package: &Path, run: &Path) -> (Self, String) {
        let state = run.join("daemon-state");
        // A `scrot` that "captures" the fake's 4×4 PNG, so that a screenshot succeeds on a box
        // with no display (reference §7.6).
        let shim = run.join("shim");
        std::fs::create_dir_all(&shim).unwrap();
        let png = run.join("shim/tiny.png");
        std::fs::write(&png, TINY_PNG).unwrap();
        let scrot = shim.join("scrot");
        std::fs::write(
            &scrot,
            format!("#!/bin/sh\ncp '{}' \"$1\"\n", png.display()),
        )
        .unwrap();
        std::fs::set_permissions(&scrot, std::fs::Permissions::from_mode(0o755)).unwrap();
        let mut child = Command::new("node")
            .arg(package.join("dist/src/internal/daemon.js"))
            .env_clear()
            .env("PATH", format!("{}:{}", shim.display(), path_without_adb()))
            .env("DISPLAY", ":99")
            .env("HOME", run.join("daemon-home"))
            .env("CI", "1")
            .env("AGENT_DEVICE_NO_UPDATE_NOTIFIER", "1")
            .env("AGENT_DEVICE_STATE_DIR", &state)
            .env("AGENT_DEVICE_CLAIMS_DIR", run.join("daemon-claims"))
            .env("AGENT_DEVICE_DAEMON_SERVER_MODE", "http")
            .current_dir(run)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .kill_on_drop(true)
            .spawn()
            .expect("node starts (is node on PATH?)");
        let stdout = child.stdout.take().unwrap();
        let port_line = async {
            let mut lines = BufReader::new(stdout).lines();
            while let Some(line) = lines.next_line().await.unwrap() {
                if let Some(port) = line.strip_prefix("AGENT_DEVICE_DAEMON_HTTP_PORT=") {
                    return port.parse::<u16>().unwrap();
                }
            }
            panic!("the real daemon exited without its port line");
        };
        let port = tokio::time::timeout(BOUND, port_line)
            .await
            .expect("the real daemon's port line in time");
        let info_path = state.join("daemon.json");
        let info = tokio::time::timeout(BOUND, async {
            loop {
                if let Ok(text) = std::fs::read_to_string(&info_path)
                    && let Ok(info) = serde_json::from_str::<Value>(&text)
                    && info["httpPort"] == port
                {
                    return info;
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        })
        .await
        .expect("the real daemon's daemon.json in time");
        assert_eq!(info["pid"], child.id().unwrap(), "the daemon is our child");
        let token = info["token"].as_str().unwrap().to_owned();
        let addr = SocketAddr::from(([127, 0, 0, 1], port));
        (Self::Real { child, addr }, token)
    }

    fn fake(run: &Path) -> (Self, String) {
        let fake = FakeAgentDevice::start(
            FakeOptions::default()
                .with_devices(vec![Device::linux_local()])
                .with_state_dir(run.join("daemon-state")),
        )
        .unwrap();
        // What the real daemon answers on a box without adb.
        fake.fail_commands(
            CommandFailure::new(DaemonError::new(
                ErrorCode::ToolMissing,
                "adb not found in PATH",
            ))
            .on_platform("android"),
        );
        let token = fake.token().to_owned();
        (Self::Fake(fake), token)
    }

    fn addr(&self) -> SocketAddr {
        match self {
            Self::Real { addr, .. } => *addr,
            Self::Fake(fake) => SocketAddr::from(([127, 0, 0, 1], fake.port())),
        }
    }

    /// Stops the daemon: the real one by its pid (TERM, then KILL past the bound).
    async fn stop(self) {
        match self {
            Self::Real { mut child, .. } => {
                if let Some(pid) = child.id() {
                    let pid = rustix::process::Pid::from_raw(i32::try_from(pid).unwrap()).unwrap();
                    let _ = rustix::process::kill_process(pid, rustix::process::Signal::TERM);
                }
                if tokio::time::timeout(BOUND, child.wait()).await.is_err() {
                    let _ = child.kill().await;
                }
            }
            Self::Fake(fake) => fake.stop().await,
        }
    }
}

// === The session ===============================================================================

/// One CLI step: its arguments, exit status and `--json` output.
#[derive(Debug)]
struct Step {
    args: Vec<String>,
    code: Option<i32>,
    stdout: String,
}

async fn cli(package: &Path, run: &Path, proxy: SocketAddr, token: &str, args: &[&str]) -> Step {
    let output = Command::new("node")
        .arg(package.join("bin/agent-device.mjs"))
        .args(args)
        .env_clear()
        .env("PATH", path_without_adb())
        .env("HOME", run.join("cli-home"))
        .env("CI", "1")
        .env("AGENT_DEVICE_NO_UPDATE_NOTIFIER", "1")
        .env("AGENT_DEVICE_STATE_DIR", run.join("cli-state"))
        .env("AGENT_DEVICE_CLAIMS_DIR", run.join("cli-claims"))
        // Always set: without a base URL the CLI silently starts a daemon of its own.
        .env("AGENT_DEVICE_DAEMON_BASE_URL", format!("http://{proxy}"))
        .env("AGENT_DEVICE_DAEMON_AUTH_TOKEN", token)
        .current_dir(run.join("work"))
        .stdin(Stdio::null())
        .kill_on_drop(true)
        .output();
    let output = tokio::time::timeout(BOUND, output)
        .await
        .unwrap_or_else(|_| panic!("agent-device {args:?} did not finish in time"))
        .unwrap();
    Step {
        args: args.iter().map(|a| (*a).to_owned()).collect(),
        code: output.status.code(),
        stdout: String::from_utf8_lossy(&output.stdout).into_owned(),
    }
}

/// Runs the session against one daemon; answers the exchanges and the CLI's steps.
async fn session(
    package: &Path,
    run: &Path,
    daemon: Daemon,
    token: &str,
) -> (Vec<Exchange>, Vec<Step>) {
    let proxy = Proxy::start(daemon.addr()).await;
    let work = run.join("work");
    std::fs::create_dir_all(&work).unwrap();
    let apk: Vec<u8> = (0..3000u32)
        .map(|i| u8::try_from(i % 251).unwrap())
        .collect();
    let apk_path = work.join("small.apk");
    std::fs::write(&apk_path, apk).unwrap();
    let profile = work.join("remote.json");
    std::fs::write(
        &profile,
        json!({"daemonBaseUrl": format!("http://{}", proxy.addr), "tenant": "acme", "runId": "run9",
               "sessionIsolation": "tenant", "platform": "android"})
        .to_string(),
    )
    .unwrap();
    let profile = profile.display().to_string();
    let apk_path = apk_path.display().to_string();
    std::fs::create_dir_all(work.join("dl")).unwrap();
    let shot = work.join("dl/shot.png").display().to_string();
    // The run directory is a temporary directory: its paths hold no spaces.
    let script = [
        "devices --json".to_owned(),
        "open --platform linux --session lin1 --json".to_owned(),
        "close --platform linux --session lin1 --json".to_owned(),
        "open --platform linux --session shot --json".to_owned(),
        format!("screenshot {shot} --platform linux --session shot --json"),
        "close --platform linux --session shot --json".to_owned(),
        format!("connect --remote-config {profile} --json"),
        "devices --json".to_owned(),
        "devices --json".to_owned(),
        format!("install com.example {apk_path} --platform android --json"),
        "disconnect --json".to_owned(),
    ];
    let mut steps = Vec::new();
    for line in &script {
        let args: Vec<&str> = line.split_whitespace().collect();
        steps.push(cli(package, run, proxy.addr, token, &args).await);
    }
    let exchanges = proxy.exchanges();
    drop(proxy);
    daemon.stop().await;
    // The CLI must not have started a daemon of its own; if it did, stop it and fail.
    let stray = run.join("cli-state/daemon.json");
    if let Ok(text) = std::fs::read_to_string(&stray) {
        if let Some(pid) = serde_json::from_str::<Value>(&text)
            .ok()
            .and_then(|info| info["pid"].as_i64())
            .and_then(|pid| i32::try_from(pid).ok())
            .and_then(rustix::process::Pid::from_raw)
        {
            let _ = rustix::process::kill_process(pid, rustix::process::Signal::KILL);
        }
        panic!(
            "the CLI started a local daemon of its own ({})",
            stray.display()
        );
    }
    (exchanges, steps)
}

// === Normalisation =============================================================================

struct Normaliser {
    run: String,
    proxy: String,
    token: String,
    patterns: Vec<(&'static str, Regex)>,
    aliases: HashMap<(&'static str, String), String>,
    counts: HashMap<&'static str, usize>,
}

impl Normaliser {
    fn new(run: &Path, proxy: &str, token: &str) -> Self {
        let patterns = [
            ("iso", r"\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}(\.\d+)?Z"),
            ("stamp", r"agent-device-screenshot-\d+-[0-9a-z]+"),
            (
                "uuid",
                r"\b[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}\b",
            ),
            ("diagnostic", r"\b[0-9a-z]{8}-[0-9a-f]{8}\b"),
            ("hex32", r"\b[0-9a-f]{32}\b"),
            ("hex16", r"\b[0-9a-f]{16}\b"),
        ]
        .into_iter()
        .map(|(kind, pattern)| (kind, Regex::new(pattern).unwrap()))
        .collect();
        Self {
            run: run.display().to_string(),
            proxy: proxy.to_owned(),
            token: token.to_owned(),
            patterns,
            aliases: HashMap::new(),
            counts: HashMap::new(),
        }
    }

    fn text(&mut self, text: &str) -> String {
        let mut out = text
            .replace(&self.run, "<run>")
            .replace(&self.proxy, "<proxy>")
            .replace(&self.token, "<token>");
        for index in 0..self.patterns.len() {
            let (kind, pattern) = (self.patterns[index].0, self.patterns[index].1.clone());
            let mut replaced = String::new();
            let mut last = 0;
            for found in pattern.find_iter(&out) {
                replaced.push_str(&out[last..found.start()]);
                if kind == "iso" {
                    replaced.push_str("<iso>");
                } else if kind == "stamp" {
                    replaced.push_str("agent-device-screenshot-<ms>-<random>");
                } else {
                    let key = (kind, found.as_str().to_owned());
                    let alias = if let Some(alias) = self.aliases.get(&key) {
                        alias.clone()
                    } else {
                        let count = self.counts.entry(kind).or_insert(0);
                        *count += 1;
                        let alias = format!("<{kind}#{count}>");
                        self.aliases.insert(key, alias.clone());
                        alias
                    };
                    replaced.push_str(&alias);
                }
                last = found.end();
            }
            replaced.push_str(&out[last..]);
            out = replaced;
        }
        out
    }

    fn value(&mut self, value: &Value) -> Value {
        match value {
            Value::String(text) => Value::String(self.text(text)),
            Value::Array(items) => Value::Array(items.iter().map(|v| self.value(v)).collect()),
            Value::Object(map) => {
                let heartbeat = map.get("heartbeatAt").and_then(Value::as_u64);
                let mut out = Map::new();
                for (key, item) in map {
                    let normalised = match (key.as_str(), item) {
                        ("createdAt" | "heartbeatAt", Value::Number(_))
                        | ("durationMs" | "totalDurationMs", _) => json!("<ms>"),
                        ("expiresAt", Value::Number(n)) => match (n.as_u64(), heartbeat) {
                            (Some(expires), Some(beat)) => {
                                json!(format!("heartbeatAt+{}", expires.saturating_sub(beat)))
                            }
                            _ => json!("<ms>"),
                        },
                        ("remoteConfigHash" | "daemonBaseUrlFingerprint", _) => json!("<digest>"),
                        _ => self.value(item),
                    };
                    out.insert(self.text(key), normalised);
                }
                Value::Object(out)
            }
            other => other.clone(),
        }
    }

    fn headers(&mut self, headers: &HeaderMap, names: &[&str]) -> Value {
        let mut out = Map::new();
        for name in names {
            let values: Vec<Value> = headers
                .get_all(*name)
                .iter()
                .map(|v| json!(self.text(&String::from_utf8_lossy(v.as_bytes()))))
                .collect();
            if !values.is_empty() {
                out.insert((*name).to_owned(), Value::Array(values));
            }
        }
        Value::Object(out)
    }

    fn body(&mut self, headers: &HeaderMap, body: &Bytes) -> Value {
        if body.is_empty() {
            return Value::Null;
        }
        let ndjson = headers
            .get("content-type")
            .and_then(|v| v.to_str().ok())
            .is_some_and(|t| t.contains("application/x-ndjson"));
        if ndjson && let Ok(text) = std::str::from_utf8(body) {
            let lines: Vec<&str> = text.lines().filter(|l| !l.trim().is_empty()).collect();
            let kept: Vec<Value> = match lines.as_slice() {
                [] => Vec::new(),
                [only] => vec![self.line(only)],
                [first, .., last] => vec![self.line(first), self.line(last)],
            };
            return json!({ "ndjson": kept });
        }
        if let Ok(parsed) = serde_json::from_slice::<Value>(body) {
            return self.value(&parsed);
        }
        match std::str::from_utf8(body) {
            Ok(text)
                if !text.contains('\u{0}')
                    && text.chars().all(|c| !c.is_control() || c == '\n') =>
            {
                json!(self.text(text))
            }
            _ => {
                let sha: String = Sha256::digest(body)
                    .iter()
                    .map(|b| format!("{b:02x}"))
                    .collect();
                json!({ "bytes": body.len(), "sha256": sha })
            }
        }
    }

    fn line(&mut self, line: &str) -> Value {
        match serde_json::from_str::<Value>(line) {
            Ok(v) => self.value(&v),
            Err(_) => json!(self.text(line)),
        }
    }

    fn exchange(&mut self, exchange: &Exchange) -> Value {
        json!({
            "request": format!("{} {}", exchange.method, self.text(&exchange.path)),
            "requestHeaders": self.headers(&exchange.request_headers, REQUEST_HEADERS),
            "requestBody": self.body(&exchange.request_headers, &exchange.request_body),
            "status": exchange.status,
            "responseHeaders": self.headers(&exchange.response_headers, RESPONSE_HEADERS),
            "responseBody": self.body(&exchange.response_headers, &exchange.response_body),
        })
    }

    fn step(&mut self, step: &Step) -> Value {
        let output = match serde_json::from_str::<Value>(&step.stdout) {
            Ok(v) => self.value(&v),
            Err(_) => json!(self.text(step.stdout.trim())),
        };
        json!({
            "cli": self.text(&step.args.join(" ")),
            "exit": step.code,
            "output": output,
        })
    }
}

/// The normalised transcript of one run.
fn transcript(run: &Path, token: &str, exchanges: &[Exchange], steps: &[Step]) -> Value {
    // Every exchange carries the proxy's address in its Host header and in the profile.
    let proxy = exchanges
        .iter()
        .find_map(|e| e.request_headers.get("host"))
        .and_then(|v| v.to_str().ok())
        .unwrap_or("127.0.0.1:0")
        .to_owned();
    let mut normaliser = Normaliser::new(run, &proxy, token);
    let exchanges: Vec<Value> = exchanges.iter().map(|e| normaliser.exchange(e)).collect();
    let steps: Vec<Value> = steps.iter().map(|s| normaliser.step(s)).collect();
    json!({ "exchanges": exchanges, "steps": steps })
}

fn first_difference(real: &Value, fake: &Value) -> String {
    for part in ["exchanges", "steps"] {
        let (Some(a), Some(b)) = (real[part].as_array(), fake[part].as_array()) else {
            continue;
        };
        for index in 0..a.len().max(b.len()) {
            if a.get(index) != b.get(index) {
                return format!(
                    "{part}[{index}] differs\n--- real:\n{}\n--- fake:\n{}",
                    serde_json::to_string_pretty(&a.get(index)).unwrap(),
                    serde_json::to_string_pretty(&b.get(index)).unwrap()
                );
            }
        }
    }
    "no difference".to_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_real_cli_sees_the_same_exchanges_from_the_fake_and_the_real_daemon() {
    let package = match package() {
        Ok(package) => package,
        Err(why) if std::env::var("SIMLOCK_SKIP_REAL_AGENT_DEVICE").as_deref() == Ok("1") => {
            println!("skipped (SIMLOCK_SKIP_REAL_AGENT_DEVICE=1): {why}");
            return;
        }
        Err(why) => panic!("{why}"),
    };
    let root = tempfile::tempdir().unwrap();
    let mut transcripts = Vec::new();
    for name in ["real", "fake"] {
        let run = root.path().join(name);
        std::fs::create_dir_all(&run).unwrap();
        let (daemon, token) = match name {
            "real" => Daemon::real(&package, &run).await,
            _ => Daemon::fake(&run),
        };
        let (exchanges, steps) = session(&package, &run, daemon, &token).await;
        transcripts.push(transcript(&run, &token, &exchanges, &steps));
    }
    let out = Path::new(env!("CARGO_TARGET_TMPDIR")).join("agent-device-conformance");
    std::fs::create_dir_all(&out).unwrap();
    for (name, transcript) in ["real", "fake"].iter().zip(&transcripts) {
        std::fs::write(
            out.join(format!("{name}.json")),
            serde_json::to_string_pretty(transcript).unwrap(),
        )
        .unwrap();
    }
    let (real, fake) = (&transcripts[0], &transcripts[1]);

    // The session did what it is for, on the real daemon.
    let requests: Vec<&str> = real["exchanges"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|e| e["request"].as_str())
        .collect();
    let rpc_methods: Vec<&str> = real["exchanges"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|e| e["requestBody"]["method"].as_str())
        .collect();
    for method in [
        "agent_device.lease.allocate",
        "agent_device.lease.heartbeat",
        "agent_device.lease.release",
        "agent_device.command",
    ] {
        assert!(
            rpc_methods.contains(&method),
            "the session sent {method}: {rpc_methods:?}"
        );
    }
    for route in [
        "POST /upload/preflight",
        "PUT /upload/direct/",
        "POST /upload/finalize",
        "GET /sessions/",
        "GET /artifacts/",
    ] {
        assert!(
            requests.iter().any(|r| r.starts_with(route)),
            "the session sent {route}: {requests:?}"
        );
    }
    assert!(
        real == fake,
        "the fake's exchanges differ from the real daemon's (transcripts in {}):\n{}",
        out.display(),
        first_difference(real, fake)
    );
}
