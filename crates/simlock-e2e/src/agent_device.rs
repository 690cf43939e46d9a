//! A harness for the agent-device tests: a worker serving `/v1/agent-device` over an
//! agent-device daemon (the published 0.21.5 one, a fake in-process, or any command), an HTTP
//! client for raw requests, the published CLI with an isolated home, and a recording proxy
//! that shows what crossed between the CLI and simlock.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use bytes::Bytes;
use http::{HeaderMap, Method, Request, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::{TokioExecutor, TokioIo};
use parking_lot::Mutex;
use serde_json::{Value, json};
use simlock_daemon::home::Home;
use simlock_worker::WorkerConfig;
use simlock_worker::{RunningWorker, WorkerOptions};
use tempfile::TempDir;

use crate::{PATIENCE, Session, session, worker_config};

/// The published package's directory: `$AGENT_DEVICE_PKG`, else
/// `<workspace>/.cache/agent-device/pkg/package` (where `.ci/run` and `cargo xtask e2e` put
/// it). Panics with how to fetch it when it is missing: these tests never skip silently.
pub fn real_package() -> PathBuf {
    let dir = std::env::var_os("AGENT_DEVICE_PKG").map_or_else(
        || Path::new(env!("CARGO_MANIFEST_DIR")).join("../../.cache/agent-device/pkg/package"),
        PathBuf::from,
    );
    assert!(
        dir.join("bin/agent-device.mjs").exists(),
        "the published agent-device 0.21.5 is not at {}: run `cargo xtask fetch-peers` (or set AGENT_DEVICE_PKG)",
        dir.display()
    );
    dir
}

/// The argv that runs the published daemon.
pub fn real_daemon_command(pkg: &Path) -> Vec<String> {
    vec![
        "node".into(),
        pkg.join("dist/src/internal/daemon.js")
            .display()
            .to_string(),
    ]
}

/// A worker configuration serving agent-device with `command`.
pub fn agent_device_config(command: Vec<String>) -> WorkerConfig {
    let mut config = worker_config(4);
    config.daemon.http.enabled = Some(true);
    config.daemon.http.port = 0;
    config.agent_device.enabled = true;
    config.agent_device.command = Some(command);
    config
}

/// A worker configuration serving agent-device from a daemon that already runs (a fake
/// attached in-process): the command is never started.
pub fn attached_config() -> WorkerConfig {
    agent_device_config(vec!["agent-device-attached".into()])
}

/// A worker with agent-device, on a home of its own.
pub struct AdWorker {
    /// The worker.
    pub worker: Option<RunningWorker>,
    /// Its home.
    pub home: Home,
    /// Scratch space (the daemon's `HOME`, the CLI's).
    pub dir: TempDir,
}

impl AdWorker {
    /// Starts a worker with `config`, its options changed by `customize`; the agent-device
    /// daemon gets a `HOME` of its own.
    pub async fn start(config: WorkerConfig, customize: impl FnOnce(&mut WorkerOptions)) -> Self {
        let dir = tempfile::tempdir().expect("a temporary directory");
        let home = Home::at(dir.path().join("worker"));
        let daemon_home = dir.path().join("daemon-home");
        std::fs::create_dir_all(&daemon_home).expect("the daemon's home");
        let mut options = WorkerOptions::new(home.clone(), config);
        options.agent_device_env = vec![
            ("HOME".into(), daemon_home.display().to_string()),
            ("CI".into(), "1".into()),
        ];
        customize(&mut options);
        let worker = simlock_worker::start(options)
            .await
            .expect("the worker starts");
        Self {
            worker: Some(worker),
            home,
            dir,
        }
    }

    /// Starts a worker with the default agent-device configuration over the published daemon
    /// ([`real_package`]), and waits until that daemon serves.
    pub async fn with_real_daemon() -> Self {
        let command = real_daemon_command(&real_package());
        let worker = Self::start(agent_device_config(command), |_| {}).await;
        worker.wait_running().await;
        worker
    }

    /// Starts a worker with `config` serving the in-process `fake`.
    pub async fn with_fake(
        config: WorkerConfig,
        fake: &agent_device_fake::FakeAgentDevice,
    ) -> Self {
        let endpoint = agent_device_host::process::Endpoint {
            port: fake.port(),
            token: fake.token().to_owned(),
        };
        Self::start(config, |options| {
            options.agent_device_attach = Some(endpoint);
        })
        .await
    }

    /// Stops the worker and starts it again on the same home with `config`, serving `fake`
    /// (a fake attached in-process outlives the worker, as a new daemon would not: the worker
    /// has no memory of the fake's lease ids).
    pub async fn restart_with_fake(
        &mut self,
        config: WorkerConfig,
        fake: &agent_device_fake::FakeAgentDevice,
    ) {
        if let Some(worker) = self.worker.take() {
            worker.stop("test").await;
        }
        let mut options = WorkerOptions::new(self.home.clone(), config);
        options.agent_device_attach = Some(agent_device_host::process::Endpoint {
            port: fake.port(),
            token: fake.token().to_owned(),
        });
        self.worker = Some(
            simlock_worker::start(options)
                .await
                .expect("the worker starts again"),
        );
    }

    /// The worker.
    pub fn worker(&self) -> &RunningWorker {
        self.worker.as_ref().expect("the worker runs")
    }

    /// The HTTP origin, `http://127.0.0.1:<port>`.
    pub fn origin(&self) -> String {
        format!(
            "http://{}",
            self.worker().running.http_addr().expect("HTTP is served")
        )
    }

    /// The agent-device base URL the CLI is pointed at.
    pub fn base(&self) -> String {
        format!("{}/v1/agent-device", self.origin())
    }

    /// The host.
    pub fn host(&self) -> agent_device_host::AgentDeviceHost {
        self.worker()
            .agent_device
            .as_ref()
            .expect("agent-device is enabled")
            .host
            .clone()
    }

    /// Waits until the host's state satisfies `done`.
    pub async fn wait_host(&self, done: impl Fn(&agent_device_host::DaemonState) -> bool) {
        let mut watch = self.host().watch();
        let waited = tokio::time::timeout(PATIENCE, async {
            loop {
                if done(&watch.borrow_and_update()) {
                    return;
                }
                assert!(
                    watch.changed().await.is_ok(),
                    "the host went away before its state was as expected"
                );
            }
        })
        .await;
        assert!(
            waited.is_ok(),
            "the host state stayed {:?}",
            self.host().state()
        );
    }

    /// Waits until the daemon serves.
    pub async fn wait_running(&self) {
        self.wait_host(|s| matches!(s, agent_device_host::DaemonState::Running(_)))
            .await;
    }

    /// An admin session on the worker's socket.
    pub async fn operator(&self) -> Session {
        session(
            &self.worker().running.socket_path(),
            "operator",
            Some(&self.home),
        )
        .await
    }

    /// Mints a token of `role`: its id (the principal) and its secret.
    pub async fn token(&self, role: &str) -> (String, String) {
        let created = self
            .operator()
            .await
            .call("token.create", json!({"role": role, "label": "e2e"}))
            .await
            .expect("a token");
        (
            created["token"]["id"].as_str().expect("an id").to_owned(),
            created["secret"].as_str().expect("a secret").to_owned(),
        )
    }

    /// Every lease on the worker.
    pub async fn leases(&self) -> Vec<Value> {
        let listed = self
            .operator()
            .await
            .call("lease.list", json!({}))
            .await
            .expect("leases");
        listed["leases"].as_array().cloned().unwrap_or_default()
    }

    /// Stops the worker.
    pub async fn stop(mut self) {
        if let Some(worker) = self.worker.take() {
            worker.stop("test").await;
        }
    }
}

/// A small HTTP client for raw requests.
#[derive(Clone)]
pub struct Http {
    client: Client<HttpConnector, Full<Bytes>>,
}

impl Default for Http {
    fn default() -> Self {
        Self::new()
    }
}

/// One answer.
#[derive(Debug, Clone)]
pub struct Answer {
    /// Its status.
    pub status: StatusCode,
    /// Its headers.
    pub headers: HeaderMap,
    /// Its body.
    pub body: Bytes,
}

impl Answer {
    /// The body as JSON (`null` when it is not).
    pub fn json(&self) -> Value {
        serde_json::from_slice(&self.body).unwrap_or(Value::Null)
    }
}

impl Http {
    /// A client.
    pub fn new() -> Self {
        Self {
            client: Client::builder(TokioExecutor::new()).build_http(),
        }
    }

    /// Sends one request and reads the whole answer (bounded by [`PATIENCE`]).
    pub async fn send(
        &self,
        method: Method,
        url: &str,
        headers: &[(&str, &str)],
        body: impl Into<Bytes>,
    ) -> Answer {
        let mut request = Request::builder().method(method).uri(url);
        for (name, value) in headers {
            request = request.header(*name, *value);
        }
        let request = request.body(Full::new(body.into())).expect("a request");
        let response = tokio::time::timeout(PATIENCE, self.client.request(request))
            .await
            .expect("an answer within the bound")
            .expect("the request was sent");
        let (parts, body) = response.into_parts();
        let body = tokio::time::timeout(PATIENCE, body.collect())
            .await
            .expect("a whole body within the bound")
            .expect("the body")
            .to_bytes();
        Answer {
            status: parts.status,
            headers: parts.headers,
            body,
        }
    }

    /// `POST <base>/rpc` with `body`, as the CLI sends it (`Bearer` and the token header).
    pub async fn rpc(&self, base: &str, token: &str, body: &Value) -> Answer {
        let bearer = format!("Bearer {token}");
        self.send(
            Method::POST,
            &format!("{base}/rpc"),
            &[
                ("content-type", "application/json"),
                ("authorization", &bearer),
                ("x-agent-device-token", token),
            ],
            body.to_string(),
        )
        .await
    }
}

/// An upload ticket's headers (`upload.headers`), as the CLI sends them with its PUT.
///
/// # Panics
/// When the ticket has no headers of text: the test that read it fails.
pub fn ticket_headers(ticket: &Value) -> Vec<(String, String)> {
    ticket["upload"]["headers"]
        .as_object()
        .expect("a ticket with headers")
        .iter()
        .map(|(k, v)| (k.clone(), v.as_str().expect("a header of text").to_owned()))
        .collect()
}

/// What the front answers a request that its daemon's stop cut short.
pub fn stopping_message() -> String {
    format!(
        "agent-device is not available on this simlock: {}",
        agent_device_front::STOPPING
    )
}

/// How a reply carried its JSON-RPC answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Carried {
    /// The body is the answer.
    Plain,
    /// The body is a progress stream; the answer is its last line's `response`.
    StreamsLastLine,
}

/// The JSON-RPC answer in a reply's body, as the CLI reads it, and how it came.
///
/// # Panics
/// When the body is neither an answer nor a progress stream ending in one.
pub fn rpc_answer(body: &[u8]) -> (Value, Carried) {
    if let Ok(answer) = serde_json::from_slice::<Value>(body)
        && answer.get("type").is_none()
    {
        return (answer, Carried::Plain);
    }
    let text = String::from_utf8_lossy(body);
    let last: Value = text
        .lines()
        .last()
        .and_then(|line| serde_json::from_str(line).ok())
        .unwrap_or_else(|| panic!("neither an answer nor a stream ending in one: {text:?}"));
    assert_eq!(last["type"], "response", "a stream's last line: {text}");
    (last["response"].clone(), Carried::StreamsLastLine)
}

/// The JSON-RPC bodies `fake` received for `method`, in order.
pub fn received(fake: &agent_device_fake::FakeAgentDevice, method: &str) -> Vec<Value> {
    fake.requests()
        .into_iter()
        .filter(|r| r.path == "/rpc")
        .filter_map(|r| serde_json::from_slice::<Value>(&r.body).ok())
        .filter(|b| b["method"] == method)
        .collect()
}

/// What the fake agent-device daemon received from callers, without what simlock sends it at
/// times of its own, which a test may straddle: the worker's health probes (every 10 s,
/// `GET /health`) and the front's heartbeats after a command (`<id>:keep`).
pub fn callers_requests(
    fake: &agent_device_fake::FakeAgentDevice,
) -> Vec<agent_device_fake::RecordedRequest> {
    fake.requests()
        .into_iter()
        .filter(|r| !(r.method == "GET" && r.path == "/health"))
        .filter(|r| {
            !serde_json::from_slice::<Value>(&r.body).is_ok_and(|body| is_front_keep(&body))
        })
        .collect()
}

/// Whether an RPC body is one of the front's own heartbeats after a command (`<id>:keep`).
fn is_front_keep(body: &Value) -> bool {
    body["id"].as_str().is_some_and(|id| id.ends_with(":keep"))
}

/// How many heartbeats callers sent `fake`: not the front's own after a command (`<id>:keep`,
/// `RpcCall::heartbeat_after`), which follow each command's answer at a time of their own.
pub fn callers_heartbeats(fake: &agent_device_fake::FakeAgentDevice) -> usize {
    received(fake, "agent_device.lease.heartbeat")
        .iter()
        .filter(|body| !is_front_keep(body))
        .count()
}

/// A JSON-RPC request of the CLI's shape.
pub fn rpc_call(id: &str, method: &str, params: Value) -> Value {
    json!({"jsonrpc": "2.0", "id": id, "method": format!("agent_device.{method}"), "params": params})
}

/// The published CLI with a home, a state directory and a remote profile of its own, pointed
/// at `base` with `token`.
pub struct Cli {
    pkg: PathBuf,
    dir: TempDir,
    base: String,
    token: String,
}

/// What one CLI run printed.
#[derive(Debug)]
pub struct CliRun {
    /// Its exit status.
    pub status: std::process::ExitStatus,
    /// Its stdout as JSON (`--json`), `null` when it is not.
    pub json: Value,
    /// Its stdout.
    pub stdout: String,
    /// Its stderr.
    pub stderr: String,
}

impl Cli {
    /// A CLI for `base` with `token`.
    pub fn new(pkg: &Path, base: &str, token: &str) -> Self {
        let dir = tempfile::tempdir().expect("a temporary directory");
        std::fs::create_dir_all(dir.path().join("home")).expect("the CLI's home");
        Self {
            pkg: pkg.to_owned(),
            dir,
            base: base.to_owned(),
            token: token.to_owned(),
        }
    }

    /// The CLI's own scratch directory.
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    /// Writes a remote profile for `platform` and returns its path.
    pub fn profile(&self, platform: &str) -> PathBuf {
        let path = self.dir.path().join("remote.json");
        let profile = json!({
            "daemonBaseUrl": self.base,
            "tenant": "acme",
            "runId": "run9",
            "sessionIsolation": "tenant",
            "platform": platform,
        });
        std::fs::write(&path, profile.to_string()).expect("the profile");
        path
    }

    /// `agent-device connect` with a remote profile for `platform`, which must succeed.
    pub async fn connect(&self, platform: &str) -> CliRun {
        let profile = self.profile(platform);
        let profile = profile.to_str().expect("a UTF-8 profile path");
        let connect = self.run(&["connect", "--remote-config", profile]).await;
        assert_eq!(connect.json["success"], json!(true), "{connect:?}");
        connect
    }

    /// Runs the CLI with `args` and `--json` (bounded by [`PATIENCE`]). The base URL is always
    /// set: without one the CLI starts a local daemon of its own.
    pub async fn run(&self, args: &[&str]) -> CliRun {
        self.run_as(Output::Json, args).await
    }

    /// Runs the CLI with `args` in `output` mode (human mode asks the daemon for progress
    /// streams).
    pub async fn run_as(&self, output: Output, args: &[&str]) -> CliRun {
        let home = self.dir.path().join("home");
        let mut command = tokio::process::Command::new("node");
        command
            .arg(self.pkg.join("bin/agent-device.mjs"))
            .args(args);
        if output == Output::Json {
            command.arg("--json");
        }
        command
            .current_dir(self.dir.path())
            .env_clear()
            .env("PATH", std::env::var_os("PATH").unwrap_or_default())
            .env("HOME", &home)
            .env("CI", "1")
            .env("AGENT_DEVICE_NO_UPDATE_NOTIFIER", "1")
            .env("AGENT_DEVICE_STATE_DIR", self.dir.path().join("state"))
            .env("AGENT_DEVICE_DAEMON_BASE_URL", &self.base)
            .env("AGENT_DEVICE_DAEMON_AUTH_TOKEN", &self.token)
            .kill_on_drop(true);
        let output = tokio::time::timeout(PATIENCE, command.output())
            .await
            .expect("the CLI finished within the bound")
            .expect("the CLI ran");
        let stdout = String::from_utf8_lossy(&output.stdout).into_owned();
        CliRun {
            status: output.status,
            json: serde_json::from_str(&stdout).unwrap_or(Value::Null),
            stdout,
            stderr: String::from_utf8_lossy(&output.stderr).into_owned(),
        }
    }
}

/// How the CLI prints.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Output {
    /// `--json`.
    Json,
    /// For people (commands ask for progress streams).
    Human,
}

/// One exchange the recorder saw.
#[derive(Debug, Clone)]
pub struct Exchange {
    /// The method.
    pub method: Method,
    /// The path and query.
    pub path: String,
    /// The request's headers.
    pub request_headers: HeaderMap,
    /// The request's body.
    pub request: Bytes,
    /// The answer's status.
    pub status: StatusCode,
    /// The answer's body.
    pub response: Bytes,
}

impl Exchange {
    /// The request body as JSON.
    pub fn request_json(&self) -> Value {
        serde_json::from_slice(&self.request).unwrap_or(Value::Null)
    }

    /// The answer body as JSON.
    pub fn response_json(&self) -> Value {
        serde_json::from_slice(&self.response).unwrap_or(Value::Null)
    }

    /// The JSON-RPC method of the request, if it is one.
    pub fn rpc_method(&self) -> Option<String> {
        self.request_json()
            .get("method")
            .and_then(Value::as_str)
            .map(String::from)
    }
}

/// A recording reverse proxy: every exchange is read whole, forwarded and kept.
pub struct Recorder {
    addr: SocketAddr,
    seen: Arc<Mutex<Vec<Exchange>>>,
    task: tokio::task::JoinHandle<()>,
}

impl Recorder {
    /// A recorder in front of `upstream` (`http://host:port`).
    pub async fn start(upstream: &str) -> Self {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("a port");
        let addr = listener.local_addr().expect("an address");
        let seen = Arc::new(Mutex::new(Vec::new()));
        let (upstream, log) = (upstream.to_owned(), seen.clone());
        let client: Client<HttpConnector, Full<Bytes>> =
            Client::builder(TokioExecutor::new()).build_http();
        let task = tokio::spawn(async move {
            loop {
                let Ok((stream, _)) = listener.accept().await else {
                    return;
                };
                let (upstream, log, client) = (upstream.clone(), log.clone(), client.clone());
                tokio::spawn(async move {
                    let service = hyper::service::service_fn(move |request: Request<Incoming>| {
                        let (upstream, log, client) =
                            (upstream.clone(), log.clone(), client.clone());
                        async move {
                            let (parts, body) = request.into_parts();
                            let request_body = body.collect().await?.to_bytes();
                            let path = parts
                                .uri
                                .path_and_query()
                                .map_or_else(|| "/".to_owned(), ToString::to_string);
                            let mut forward = Request::builder()
                                .method(parts.method.clone())
                                .uri(format!("{upstream}{path}"));
                            for (name, value) in &parts.headers {
                                if name != http::header::HOST {
                                    forward = forward.header(name, value);
                                }
                            }
                            if let Some(host) = parts.headers.get(http::header::HOST) {
                                forward = forward.header(http::header::HOST, host);
                            }
                            let forward = forward
                                .body(Full::new(request_body.clone()))
                                .expect("a request");
                            let response = match client.request(forward).await {
                                Ok(response) => response,
                                Err(e) => {
                                    let mut failed =
                                        hyper::Response::new(Full::new(Bytes::from(e.to_string())));
                                    *failed.status_mut() = StatusCode::BAD_GATEWAY;
                                    return Ok::<_, hyper::Error>(failed);
                                }
                            };
                            let (rparts, rbody) = response.into_parts();
                            let response_body = rbody.collect().await?.to_bytes();
                            log.lock().push(Exchange {
                                method: parts.method,
                                path,
                                request_headers: parts.headers,
                                request: request_body,
                                status: rparts.status,
                                response: response_body.clone(),
                            });
                            let mut out =
                                hyper::Response::from_parts(rparts, Full::new(response_body));
                            out.headers_mut().remove(http::header::TRANSFER_ENCODING);
                            Ok(out)
                        }
                    });
                    let _ = hyper::server::conn::http1::Builder::new()
                        .serve_connection(TokioIo::new(stream), service)
                        .await;
                });
            }
        });
        Self { addr, seen, task }
    }

    /// The recorder's origin, `http://127.0.0.1:<port>`.
    pub fn origin(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// What it saw so far, in order.
    pub fn exchanges(&self) -> Vec<Exchange> {
        self.seen.lock().clone()
    }

    /// The JSON-RPC calls it saw, in order, as `(method, request, answer)`.
    pub fn rpc_calls(&self) -> Vec<(String, Value, Value)> {
        self.exchanges()
            .into_iter()
            .filter_map(|e| Some((e.rpc_method()?, e.request_json(), e.response_json())))
            .collect()
    }
}

impl Drop for Recorder {
    fn drop(&mut self) {
        self.task.abort();
    }
}
