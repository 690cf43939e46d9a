//! `simlock mcp` driven as an agent's MCP client drives it: the built binary spawned over stdio
//! and spoken to with the SDK's own client (`rmcp`), against real workers and a real gateway run
//! in-process. Also `simlock lease --bind-pid`. Every wait is on an event (a notification, a
//! daemon event, a process exit) and bounded by `PATIENCE`.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    reason = "a test fails by panicking"
)]

use std::process::Stdio;

use rmcp::model::{
    CallToolRequestParams, CallToolResult, ClientRequest, ProgressNotificationParam, Request,
    ServerResult,
};
use rmcp::service::{PeerRequestOptions, RunningService};
use rmcp::{ClientHandler, RoleClient, ServiceExt as _};
use serde_json::{Value, json};
use simlock_client::{Client, ConnectOptions, FollowItem};
use simlock_contract::model::{Connection, EventEnvelope};
use simlock_daemon::home::Home;
use simlock_e2e::{PATIENCE, TestFleet, gateway_config, worker_config};
use simlock_worker::WorkerConfig;
use simlock_worker::{RunningWorker, WorkerOptions};
use tokio::process::{Child, Command};
use tokio::sync::mpsc;

/// The session variables every agent CLI might have set in the test's own environment.
const SESSION_VARIABLES: &[&str] = &[
    "CLAUDE_CODE_SESSION_ID",
    "CODEX_THREAD_ID",
    "CURSOR_CONVERSATION_ID",
    "GEMINI_SESSION_ID",
    "SIMLOCK_AGENT_ID",
    "SIMLOCK_URL",
    "SIMLOCK_TOKEN",
];

async fn bounded<F: Future>(what: &str, future: F) -> F::Output {
    tokio::time::timeout(PATIENCE, future)
        .await
        .unwrap_or_else(|_| panic!("{what}: not within {PATIENCE:?}"))
}

// === Daemons ===

/// A worker in-process, on its own home.
struct Worker {
    running: Option<RunningWorker>,
    home: Home,
    _dir: tempfile::TempDir,
}

impl Worker {
    async fn start(config: WorkerConfig) -> Self {
        let dir = tempfile::tempdir().unwrap();
        let home = Home::at(dir.path().join("w"));
        let running = simlock_worker::start(WorkerOptions::new(home.clone(), config))
            .await
            .expect("the worker starts");
        Self {
            running: Some(running),
            home,
            _dir: dir,
        }
    }

    fn home(&self) -> &std::path::Path {
        self.home.root()
    }

    /// An operator's client on the worker's socket.
    async fn operator(&self) -> Client {
        operator_on(&self.home).await
    }

    /// Stops the worker (its leases are kept in its home) and starts it again on that home.
    async fn restart(&mut self, config: WorkerConfig) {
        self.halt().await;
        self.resume(config).await;
    }

    /// Stops the worker, keeping its home.
    async fn halt(&mut self) {
        if let Some(running) = self.running.take() {
            running.stop("test").await;
        }
    }

    /// Starts the worker again on its home.
    async fn resume(&mut self, config: WorkerConfig) {
        let running = simlock_worker::start(WorkerOptions::new(self.home.clone(), config))
            .await
            .expect("the worker starts again");
        self.running = Some(running);
    }

    async fn stop(mut self) {
        if let Some(running) = self.running.take() {
            running.stop("test").await;
        }
    }
}

async fn operator_on(home: &Home) -> Client {
    let secret = std::fs::read_to_string(home.admin_token()).unwrap();
    Client::connect_home(
        home.root(),
        ConnectOptions::default().credential(secret.trim()),
    )
    .await
    .unwrap()
}

/// The daemon's leases, as an operator sees them.
async fn leases(operator: &Client) -> Vec<Value> {
    let list = operator.leases().await.unwrap();
    list.leases.iter().map(|l| json!(l)).collect()
}

/// Waits for the daemon event `name` about lease `lease_id`.
async fn event_for(
    events: &mut simlock_client::EventFollow,
    name: &str,
    lease_id: &str,
) -> EventEnvelope {
    bounded(&format!("the {name} event of {lease_id}"), async {
        loop {
            match events.next().await {
                Some(Ok(FollowItem::Event(event)))
                    if event.event == name && event.payload["leaseId"] == lease_id =>
                {
                    return event;
                }
                Some(Ok(_)) => {}
                Some(Err(e)) => panic!("the event stream failed: {e}"),
                None => panic!("the event stream ended"),
            }
        }
    })
    .await
}

// === The MCP client ===

/// What the server told the client on its own.
#[derive(Debug)]
enum Note {
    Progress(ProgressNotificationParam),
    Log(Value),
}

/// The client side of the session: forwards notifications to the test.
#[derive(Debug, Clone)]
struct Probe {
    notes: mpsc::UnboundedSender<Note>,
}

impl ClientHandler for Probe {
    async fn on_progress(
        &self,
        params: ProgressNotificationParam,
        _context: rmcp::service::NotificationContext<RoleClient>,
    ) {
        let _ = self.notes.send(Note::Progress(params));
    }

    #[allow(
        deprecated,
        reason = "the server's lease notices are MCP logging messages"
    )]
    async fn on_logging_message(
        &self,
        params: rmcp::model::LoggingMessageNotificationParam,
        _context: rmcp::service::NotificationContext<RoleClient>,
    ) {
        let _ = self.notes.send(Note::Log(params.data));
    }
}

/// One `simlock mcp` process and the SDK client speaking to it over its stdio.
struct Agent {
    client: RunningService<RoleClient, Probe>,
    notes: mpsc::UnboundedReceiver<Note>,
    child: Child,
}

/// How to start `simlock mcp`.
struct Launch<'a> {
    home: &'a std::path::Path,
    env: Vec<(&'a str, String)>,
    args: Vec<String>,
    /// Run it under `sh`, so the test can kill its parent.
    under_shell: bool,
}

impl<'a> Launch<'a> {
    fn on(home: &'a std::path::Path) -> Self {
        Self {
            home,
            env: Vec::new(),
            args: Vec::new(),
            under_shell: false,
        }
    }

    fn session(mut self, id: &str) -> Self {
        self.env.push(("CLAUDE_CODE_SESSION_ID", id.to_owned()));
        self
    }

    fn url(mut self, url: &str, token: &str) -> Self {
        self.args
            .extend(["--url".into(), url.into(), "--token".into(), token.into()]);
        self
    }

    async fn start(self) -> Agent {
        let bin = env!("CARGO_BIN_EXE_simlock");
        let mut command = if self.under_shell {
            // `sh` stays the parent (the `; :` keeps it from exec'ing simlock).
            let mut c = Command::new("sh");
            c.arg("-c").arg("\"$0\" \"$@\"; :").arg(bin);
            c
        } else {
            Command::new(bin)
        };
        command.args(&self.args).arg("mcp");
        for name in SESSION_VARIABLES {
            command.env_remove(name);
        }
        command
            .env("SIMLOCK_HOME", self.home)
            .envs(self.env.iter().map(|(k, v)| (*k, v.as_str())))
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .kill_on_drop(true);
        let mut child = command.spawn().unwrap();
        let stdin = child.stdin.take().unwrap();
        let stdout = child.stdout.take().unwrap();
        let (tx, notes) = mpsc::unbounded_channel();
        let client = bounded("initialize", Probe { notes: tx }.serve((stdout, stdin)))
            .await
            .expect("the MCP handshake");
        Agent {
            client,
            notes,
            child,
        }
    }
}

impl Agent {
    /// Calls `tool` with `arguments`.
    async fn call(&self, tool: &str, arguments: Value) -> CallToolResult {
        let Value::Object(arguments) = arguments else {
            panic!("arguments are an object");
        };
        bounded(
            tool,
            self.client
                .call_tool(CallToolRequestParams::new(tool.to_owned()).with_arguments(arguments)),
        )
        .await
        .unwrap_or_else(|e| panic!("{tool}: a protocol error: {e}"))
    }

    /// Calls `tool` and answers its structured result, which must not be an error.
    async fn ok(&self, tool: &str, arguments: Value) -> Value {
        let result = self.call(tool, arguments).await;
        assert_ne!(result.is_error, Some(true), "{tool} failed: {result:?}");
        let value = result
            .structured_content
            .clone()
            .expect("structured content");
        // The text is the same JSON, for clients that read only text.
        let text = result.content[0]
            .as_text()
            .expect("a text block")
            .text
            .clone();
        assert_eq!(serde_json::from_str::<Value>(&text).unwrap(), value);
        value
    }

    /// Calls `tool`, which must fail; answers its text.
    async fn fails(&self, tool: &str, arguments: Value) -> (String, Value) {
        let result = self.call(tool, arguments).await;
        assert_eq!(result.is_error, Some(true), "{tool} succeeded: {result:?}");
        let text = result.content[0]
            .as_text()
            .expect("a text block")
            .text
            .clone();
        (text, result.structured_content.clone().unwrap_or_default())
    }

    /// The next logging notification whose `event` is `event`.
    async fn notice(&mut self, event: &str) -> Value {
        bounded(&format!("a {event} notification"), async {
            loop {
                match self.notes.recv().await {
                    Some(Note::Log(data)) if data["event"] == event => return data,
                    Some(_) => {}
                    None => panic!("the client stopped"),
                }
            }
        })
        .await
    }

    /// Closes stdin and waits for the process to exit.
    async fn close_stdin(self) -> std::process::ExitStatus {
        let Self {
            client, mut child, ..
        } = self;
        let _ = client.cancel().await;
        bounded("simlock mcp exits once stdin closes", child.wait())
            .await
            .unwrap()
    }
}

fn lease_id(grant: &Value) -> String {
    grant["leaseId"].as_str().expect("a lease id").to_owned()
}

// === Tests ===

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn initialize_and_the_tools_with_valid_schemas() {
    let home = tempfile::tempdir().unwrap();
    let agent = Launch::on(home.path()).session("s-init").start().await;
    let info = agent.client.peer_info().expect("the server's info");
    assert_eq!(
        info.server_info.as_ref().map(|s| s.name.as_str()),
        Some("simlock")
    );
    assert!(info.capabilities.tools.is_some());
    assert!(
        info.instructions
            .as_deref()
            .is_some_and(|i| i.contains("lease_simulator"))
    );

    let tools = bounded("tools/list", agent.client.list_all_tools())
        .await
        .unwrap();
    let names: Vec<&str> = tools.iter().map(|t| t.name.as_ref()).collect();
    assert_eq!(
        names,
        [
            "lease_simulator",
            "release_simulator",
            "lease_status",
            "list_devices",
            "held_leases",
            "device_access"
        ]
    );
    for tool in &tools {
        let schema = Value::Object(tool.input_schema.as_ref().clone());
        assert!(
            jsonschema::meta::is_valid(&schema),
            "{}: not a valid JSON Schema: {schema:#}",
            tool.name
        );
        assert_eq!(schema["type"], "object", "{}", tool.name);
        assert!(
            tool.description.as_deref().is_some_and(|d| d.len() > 60),
            "{} has a description",
            tool.name
        );
    }
    let lease = tools.iter().find(|t| t.name == "lease_simulator").unwrap();
    let schema = Value::Object(lease.input_schema.as_ref().clone());
    assert_eq!(schema["required"], json!(["platform"]));
    for property in [
        "platform", "model", "os", "ttl", "wait", "timeout", "requires",
    ] {
        assert!(
            schema["properties"][property]["description"].is_string()
                || schema["properties"][property].is_object(),
            "{property}"
        );
    }
    // A default the schema states is the one the server applies (outside trial 11 saw `null`).
    assert_eq!(schema["properties"]["wait"]["default"], true, "{schema}");
    assert_eq!(schema["properties"]["wait"]["type"], "boolean", "{schema}");
    let validator = jsonschema::validator_for(&schema).unwrap();
    for good in [
        json!({"platform": "ios"}),
        json!({"platform": "android", "model": "pixel", "ttl": "15m", "wait": false, "timeout": 90000, "requires": ["agent-device"]}),
    ] {
        assert!(validator.is_valid(&good), "{good}");
    }
    for bad in [
        json!({}),
        json!({"platform": "windows"}),
        json!({"platform": "ios", "colour": "red"}),
        json!({"platform": "ios", "wait": "yes"}),
    ] {
        assert!(!validator.is_valid(&bad), "{bad}");
    }
    assert!(agent.close_stdin().await.success());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lease_from_a_worker_is_held_seen_by_the_daemon_read_and_released() {
    let worker = Worker::start(worker_config(2)).await;
    let operator = worker.operator().await;
    let agent = Launch::on(worker.home()).session("agent-a").start().await;

    let catalog = agent.ok("list_devices", json!({"platform": "ios"})).await;
    assert_eq!(catalog["platforms"][0]["platform"], "ios");

    let grant = agent
        .ok("lease_simulator", json!({"platform": "ios", "ttl": "15m"}))
        .await;
    let id = lease_id(&grant);
    assert_eq!(grant["held"], true);
    assert_eq!(grant["requesterId"], "claude-code:agent-a");
    assert_eq!(grant["renewedEvery"], "5m");
    assert_eq!(grant["grant"]["lease"]["ttlMs"], 900_000);
    assert!(
        grant["access"]["text"]
            .as_str()
            .unwrap()
            .starts_with(&format!("lease {id} granted"))
    );

    // The daemon has it, for this requester.
    let listed = leases(&operator).await;
    assert_eq!(listed.len(), 1);
    assert_eq!(listed[0]["id"], id.as_str());
    assert_eq!(listed[0]["requesterId"], "claude-code:agent-a");

    let status = agent.ok("lease_status", json!({})).await;
    assert_eq!(status["held"], true);
    assert_eq!(status["standing"], "held");
    assert_eq!(status["lease"]["id"], id.as_str());
    assert!(status["expires"].as_str().unwrap().starts_with("in "));

    let access = agent.ok("device_access", json!({"leaseId": id})).await;
    assert_eq!(
        access["driverDeviceId"],
        grant["grant"]["device"]["driverDeviceId"]
    );
    assert_eq!(access["environment"], grant["grant"]["environment"]);

    let held = agent.ok("held_leases", json!({})).await;
    assert_eq!(held["requesterId"], "claude-code:agent-a");
    assert_eq!(held["requesterSource"], "from $CLAUDE_CODE_SESSION_ID");
    assert_eq!(held["held"][0]["leaseId"], id.as_str());

    let released = agent.ok("release_simulator", json!({})).await;
    assert_eq!(released, json!({"leaseId": id, "released": true}));
    assert!(leases(&operator).await.is_empty());
    let status = agent.ok("lease_status", json!({})).await;
    assert_eq!(status["held"], false);
    assert_eq!(status["standing"], "released");
    assert_eq!(status["why"], "this session released it");
    let (text, _) = agent.fails("release_simulator", json!({})).await;
    assert_eq!(
        text,
        format!("Lease {id} already ended: this session released it (UNKNOWN_LEASE)")
    );

    assert!(agent.close_stdin().await.success());
    worker.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lease_through_a_gateway_over_http() {
    let mut fleet = TestFleet::start(gateway_config()).await;
    fleet.add_worker(worker_config(1)).await;
    let operator = fleet.operator().await;
    let token = operator
        .call("token.create", json!({"role": "agent", "label": "mcp"}))
        .await
        .unwrap();
    let url = format!(
        "http://{}",
        fleet.gateway().running.http_addr().expect("gateway HTTP")
    );
    let home = tempfile::tempdir().unwrap();
    let agent = Launch::on(home.path())
        .session("via-gateway")
        .url(&url, token["secret"].as_str().unwrap())
        .start()
        .await;

    let grant = agent
        .ok("lease_simulator", json!({"platform": "ios", "ttl": 600000}))
        .await;
    let id = lease_id(&grant);
    assert_eq!(grant["requesterId"], "claude-code:via-gateway");
    assert_eq!(grant["grant"]["lease"]["worker"]["id"], fleet.worker_id(0));
    assert!(grant["access"]["worker"]["id"].is_string());

    // The gateway lists it, for this requester, on its worker (once its view of the worker has
    // the lease: the gateway lists leases from its workers' views).
    let worker_lease = id.split_once('.').map(|(_, w)| w.to_owned()).unwrap();
    fleet
        .wait_for(|views| {
            views.iter().any(|v| {
                v.leases
                    .as_ref()
                    .is_some_and(|l| l.iter().any(|l| l.id.as_str() == worker_lease))
            })
        })
        .await;
    let listed = operator.call("lease.list", json!({})).await.unwrap();
    assert_eq!(listed["leases"][0]["id"], id.as_str());
    assert_eq!(
        listed["leases"][0]["requesterId"],
        "claude-code:via-gateway"
    );

    let status = agent.ok("lease_status", json!({"leaseId": id})).await;
    assert_eq!(status["held"], true, "{status:#}");
    assert_eq!(status["lease"]["id"], id.as_str());

    let released = agent.ok("release_simulator", json!({"leaseId": id})).await;
    assert_eq!(released["released"], true);
    fleet
        .wait_for(|views| {
            views.iter().all(|v| {
                v.leases
                    .as_ref()
                    .is_none_or(|l| l.iter().all(|l| l.id.as_str() != worker_lease))
            })
        })
        .await;
    let listed = operator.call("lease.list", json!({})).await.unwrap();
    assert_eq!(listed["leases"], json!([]));
    assert!(agent.close_stdin().await.success());
    fleet.stop().await;
}

/// A worker that restarts keeps its leases; the session connects again and holds on, as
/// `simlock lease` does, instead of leaving its lease to the TTL with the agent unable to lease
/// or release.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lease_is_held_on_across_a_restart_of_its_worker_and_released_after() {
    let mut worker = Worker::start(worker_config(1)).await;
    let mut agent = Launch::on(worker.home())
        .session("restarting")
        .start()
        .await;
    let grant = agent
        .ok("lease_simulator", json!({"platform": "ios", "ttl": "10m"}))
        .await;
    let id = lease_id(&grant);

    worker.restart(worker_config(1)).await;
    let lost = agent.notice("lease-reconnecting").await;
    assert_eq!(lost["leaseId"], id.as_str());
    assert!(
        lost["message"]
            .as_str()
            .unwrap()
            .ends_with(&format!("simlock is connecting again to keep lease {id}")),
        "{lost}"
    );
    let back = agent.notice("lease-reconnected").await;
    assert_eq!(back["leaseId"], id.as_str());

    // Held still: the daemon renewed it for this session, which can release it.
    let status = agent.ok("lease_status", json!({})).await;
    assert_eq!(status["standing"], "held", "{status}");
    let (text, _) = agent
        .fails("lease_simulator", json!({"platform": "ios"}))
        .await;
    assert!(text.contains("REQUESTER_ALREADY_LEASED"), "{text}");
    let released = agent.ok("release_simulator", json!({})).await;
    assert_eq!(released, json!({"leaseId": id, "released": true}));
    assert!(leases(&worker.operator().await).await.is_empty());

    assert!(agent.close_stdin().await.success());
    worker.stop().await;
}

/// While the session connects again, a release answers that it is connecting again and the
/// lease stays held; once connected, the release goes through.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_release_while_the_session_connects_again_keeps_the_lease_for_later() {
    let mut worker = Worker::start(worker_config(1)).await;
    let mut agent = Launch::on(worker.home()).session("patient").start().await;
    let id = lease_id(
        &agent
            .ok(
                "lease_simulator",
                json!({"platform": "android", "ttl": "10m"}),
            )
            .await,
    );

    worker.halt().await;
    agent.notice("lease-reconnecting").await;
    let (text, _) = agent.fails("release_simulator", json!({})).await;
    assert_eq!(
        text,
        format!(
            "The daemon went away; this session is connecting again to keep lease {id}: release \
             it again in a moment (DAEMON_CONNECTION_LOST)"
        )
    );
    // Its status answers from what the session knows.
    let status = agent.ok("lease_status", json!({"leaseId": id})).await;
    assert_eq!(status["standing"], "held", "{status}");
    assert!(
        status["message"]
            .as_str()
            .unwrap()
            .starts_with("The daemon cannot be reached right now"),
        "{status}"
    );
    assert_eq!(status["lease"]["id"], id.as_str());

    worker.resume(worker_config(1)).await;
    agent.notice("lease-reconnected").await;
    let released = agent.ok("release_simulator", json!({})).await;
    assert_eq!(released, json!({"leaseId": id, "released": true}));
    assert!(leases(&worker.operator().await).await.is_empty());
    assert!(agent.close_stdin().await.success());
    worker.stop().await;
}

/// A gateway with one worker, and a session `session` on the gateway's URL with an agent token:
/// answers them, the gateway's address, and the session's home.
async fn through_a_gateway(
    session: &str,
) -> (TestFleet, Agent, std::net::SocketAddr, tempfile::TempDir) {
    let mut fleet = TestFleet::start(gateway_config()).await;
    fleet.add_worker(worker_config(1)).await;
    let token = fleet
        .operator()
        .await
        .call("token.create", json!({"role": "agent"}))
        .await
        .unwrap();
    let addr = fleet.gateway().running.http_addr().expect("gateway HTTP");
    let home = tempfile::tempdir().unwrap();
    let agent = Launch::on(home.path())
        .session(session)
        .url(&format!("http://{addr}"), token["secret"].as_str().unwrap())
        .start()
        .await;
    (fleet, agent, addr, home)
}

/// Through a gateway that is down, a release answers `DAEMON_CONNECTION_LOST` and the session
/// keeps the lease (outside trial 11: it dropped it, telling of a failed renewal, and the device
/// stayed leased until its TTL); once the gateway is back, the release goes through.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_release_while_the_gateway_is_down_keeps_the_lease_for_later() {
    let (mut fleet, agent, addr, _home) = through_a_gateway("through-an-outage").await;
    let id = lease_id(
        &agent
            .ok("lease_simulator", json!({"platform": "ios", "ttl": "10m"}))
            .await,
    );

    fleet.stop_gateway().await;
    let (text, _) = agent.fails("release_simulator", json!({})).await;
    assert!(
        text.ends_with(&format!(
            "this session keeps lease {id}: release it again in a moment (DAEMON_CONNECTION_LOST)"
        )),
        "{text}"
    );
    let status = agent.ok("lease_status", json!({"leaseId": id})).await;
    assert_eq!(status["standing"], "held", "{status}");

    let mut config = gateway_config();
    config.daemon.http.port = addr.port();
    fleet.restart_gateway(config).await;
    let worker = fleet.worker_id(0);
    fleet
        .wait_for(|views| {
            views.iter().any(|v| {
                v.id == worker
                    && v.connection == Connection::Connected
                    && v.leases.as_ref().is_some_and(|l| l.len() == 1)
            })
        })
        .await;
    let released = agent.ok("release_simulator", json!({})).await;
    assert_eq!(released, json!({"leaseId": id, "released": true}));
    assert!(fleet.worker(0).worker.leases().is_empty());
    assert!(agent.close_stdin().await.success());
    fleet.stop().await;
}

/// Through a gateway, renewals that fail while it is down are told as `lease-reconnecting`, and
/// the first that goes through again as `lease-reconnected`, as on a socket that reconnects
/// (outside trial 11: the session said nothing either way). The lease lives on: renewals are due
/// every 10 s, and it has 30 s past the last one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn renewals_failing_through_a_gateway_that_is_down_are_told_and_so_is_their_return() {
    let (mut fleet, mut agent, addr, _home) = through_a_gateway("renewing-through-an-outage").await;
    let id = lease_id(
        &agent
            .ok("lease_simulator", json!({"platform": "ios", "ttl": "30s"}))
            .await,
    );

    fleet.stop_gateway().await;
    let failing = agent.notice("lease-reconnecting").await;
    assert_eq!(failing["leaseId"], id.as_str());
    let message = failing["message"].as_str().unwrap();
    assert!(
        message.starts_with(&format!("renewing lease {id} failed: ")),
        "{message}"
    );
    assert!(message.contains("simlock keeps trying, for "), "{message}");

    let mut config = gateway_config();
    config.daemon.http.port = addr.port();
    fleet.restart_gateway(config).await;
    let back = agent.notice("lease-reconnected").await;
    assert_eq!(back["leaseId"], id.as_str());
    let released = agent.ok("release_simulator", json!({})).await;
    assert_eq!(released, json!({"leaseId": id, "released": true}));
    assert!(agent.close_stdin().await.success());
    fleet.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_session_whose_stdin_closes_releases_its_lease() {
    let worker = Worker::start(worker_config(1)).await;
    let operator = worker.operator().await;
    let mut events = operator.follow_events().await.unwrap();
    let agent = Launch::on(worker.home()).session("closing").start().await;
    let id = lease_id(
        &agent
            .ok("lease_simulator", json!({"platform": "android"}))
            .await,
    );

    let status = agent.close_stdin().await;
    assert!(status.success(), "{status}");
    let released = event_for(&mut events, "lease.released", &id).await;
    assert_eq!(released.payload["reason"], "explicit");
    assert!(leases(&operator).await.is_empty());
    worker.stop().await;
}

/// Outside trial 24: a session that ended while its worker restarted gave up at once and left
/// its lease held for its whole TTL. Its end asks again (within its 15 s bound) until the
/// worker is back, and releases the lease then.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_session_that_ends_while_its_worker_restarts_releases_its_lease_once_it_is_back() {
    let mut worker = Worker::start(worker_config(1)).await;
    let mut agent = Launch::on(worker.home())
        .session("ends-in-restart")
        .start()
        .await;
    let id = lease_id(
        &agent
            .ok("lease_simulator", json!({"platform": "ios", "ttl": "10m"}))
            .await,
    );
    worker.halt().await;
    agent.notice("lease-reconnecting").await;
    // The session ends while the worker is down; it comes back while the end waits.
    let closing = tokio::spawn(agent.close_stdin());
    worker.resume(worker_config(1)).await;
    let status = bounded("the session's end", closing).await.unwrap();
    assert!(status.success(), "{status}");
    let operator = worker.operator().await;
    assert!(
        leases(&operator).await.is_empty(),
        "lease {id} was released"
    );
    worker.stop().await;
}

/// Outside trial 24: a session killed with SIGKILL leaves its lease to its TTL; the next
/// session of the same requester was refused REQUESTER_ALREADY_LEASED and could not release
/// that lease ("not one of this session's leases"). The refusal says how, and it can; a session
/// of another requester still cannot.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lease_an_earlier_session_of_the_requester_left_can_be_released_by_the_next() {
    let worker = Worker::start(worker_config(2)).await;
    let mut first = Launch::on(worker.home())
        .session("same-agent")
        .start()
        .await;
    let id = lease_id(
        &first
            .ok("lease_simulator", json!({"platform": "ios", "ttl": "10m"}))
            .await,
    );
    first.child.start_kill().unwrap();
    let _ = first.child.wait().await;

    let other = Launch::on(worker.home())
        .session("another-agent")
        .start()
        .await;
    let (text, _) = other
        .fails("release_simulator", json!({"leaseId": id}))
        .await;
    assert!(text.contains("UNKNOWN_LEASE"), "{text}");

    let next = Launch::on(worker.home())
        .session("same-agent")
        .start()
        .await;
    let (text, _) = next
        .fails("lease_simulator", json!({"platform": "ios"}))
        .await;
    assert!(
        text.contains("REQUESTER_ALREADY_LEASED")
            && text.contains(&format!("release_simulator with leaseId {id} ends it now")),
        "{text}"
    );
    let released = next.ok("release_simulator", json!({"leaseId": id})).await;
    assert_eq!(released, json!({"leaseId": id, "released": true}));
    assert!(leases(&worker.operator().await).await.is_empty());
    // And it may lease again.
    next.ok("lease_simulator", json!({"platform": "ios"})).await;
    assert!(next.close_stdin().await.success());
    assert!(other.close_stdin().await.success());
    worker.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_ends_the_session_and_releases_its_lease() {
    let worker = Worker::start(worker_config(1)).await;
    let operator = worker.operator().await;
    let mut events = operator.follow_events().await.unwrap();
    let mut agent = Launch::on(worker.home())
        .session("terminated")
        .start()
        .await;
    let id = lease_id(
        &agent
            .ok("lease_simulator", json!({"platform": "ios"}))
            .await,
    );

    let pid = agent.child.id().unwrap();
    rustix::process::kill_process(
        rustix::process::Pid::from_raw(i32::try_from(pid).unwrap()).unwrap(),
        rustix::process::Signal::TERM,
    )
    .unwrap();
    let released = event_for(&mut events, "lease.released", &id).await;
    assert_eq!(released.payload["reason"], "explicit");
    let status = bounded("simlock mcp exits on SIGTERM", agent.child.wait())
        .await
        .unwrap();
    assert!(status.success(), "{status}");
    worker.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_session_is_released_when_the_agent_that_started_it_exits() {
    let worker = Worker::start(worker_config(1)).await;
    let operator = worker.operator().await;
    let mut events = operator.follow_events().await.unwrap();
    let mut launch = Launch::on(worker.home()).session("orphaned");
    launch.under_shell = true;
    let mut agent = launch.start().await;
    let id = lease_id(
        &agent
            .ok("lease_simulator", json!({"platform": "ios"}))
            .await,
    );

    // The "agent" (the shell that started simlock mcp) dies; stdin stays open (the test holds it).
    agent.child.kill().await.unwrap();
    let released = event_for(&mut events, "lease.released", &id).await;
    assert_eq!(released.payload["reason"], "explicit");
    assert!(leases(&operator).await.is_empty());
    worker.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_operator_release_all_reaches_the_client_as_a_notification() {
    let worker = Worker::start(worker_config(1)).await;
    let operator = worker.operator().await;
    let mut agent = Launch::on(worker.home()).session("killed").start().await;
    let grant = agent
        .ok("lease_simulator", json!({"platform": "ios"}))
        .await;
    let id = lease_id(&grant);

    let out = operator.release_all().await.unwrap();
    assert_eq!(out.lease_ids, std::slice::from_ref(&id));
    let notice = agent.notice("lease-lost").await;
    assert_eq!(notice["leaseId"], id.as_str());
    assert_eq!(notice["reason"], "killed");
    assert_eq!(notice["deviceId"], grant["grant"]["device"]["id"]);
    assert!(
        notice["message"]
            .as_str()
            .unwrap()
            .contains("an operator released it")
    );

    let status = agent.ok("lease_status", json!({})).await;
    assert_eq!(status["held"], false);
    assert_eq!(status["standing"], "lost");
    assert_eq!(status["why"], "an operator released it");
    let held = agent.ok("held_leases", json!({})).await;
    assert_eq!(held["held"], json!([]));
    assert_eq!(held["ended"][0]["leaseId"], id.as_str());
    // The requester is free again: the session can lease anew.
    let again = agent
        .ok("lease_simulator", json!({"platform": "ios"}))
        .await;
    assert_ne!(lease_id(&again), id);
    assert!(agent.close_stdin().await.success());
    worker.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_queued_lease_reports_progress_then_is_granted() {
    let worker = Worker::start(worker_config(1)).await;
    let first = Launch::on(worker.home()).session("first").start().await;
    let held = lease_id(
        &first
            .ok("lease_simulator", json!({"platform": "ios"}))
            .await,
    );

    let mut second = Launch::on(worker.home()).session("second").start().await;
    let handle = second
        .client
        .send_cancellable_request(
            ClientRequest::CallToolRequest(Request::new(
                CallToolRequestParams::new("lease_simulator").with_arguments(
                    json!({"platform": "ios", "timeout": "10m"})
                        .as_object()
                        .cloned()
                        .unwrap(),
                ),
            )),
            PeerRequestOptions::no_options(),
        )
        .await
        .unwrap();
    let token = handle.progress_token.clone();
    let progress = bounded("a progress notification", async {
        loop {
            match second.notes.recv().await {
                Some(Note::Progress(p)) => return p,
                Some(Note::Log(_)) => {}
                None => panic!("the client stopped"),
            }
        }
    })
    .await;
    assert_eq!(progress.progress_token, token);
    assert_eq!(
        progress.message.as_deref(),
        Some("waiting for a device: position 1 in the queue; every device that may run is in use")
    );

    // The first agent gives its device back; the queued one gets it.
    first
        .ok("release_simulator", json!({"leaseId": held}))
        .await;
    let result = bounded("the queued grant", handle.await_response())
        .await
        .unwrap();
    let ServerResult::CallToolResult(result) = result else {
        panic!("not a tool result: {result:?}");
    };
    assert_ne!(result.is_error, Some(true), "{result:?}");
    let grant = result.structured_content.unwrap();
    assert_eq!(grant["requesterId"], "claude-code:second");
    assert!(first.close_stdin().await.success());
    assert!(second.close_stdin().await.success());
    worker.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_arguments_and_refusals_are_tool_errors_not_crashes() {
    let worker = Worker::start(worker_config(1)).await;
    let agent = Launch::on(worker.home()).session("careless").start().await;

    let (text, body) = agent
        .fails("lease_simulator", json!({"platform": "windows"}))
        .await;
    assert!(
        text.starts_with(
            "Invalid argument platform for lease_simulator: unknown variant `windows`"
        ),
        "{text}"
    );
    assert!(text.ends_with("(BAD_REQUEST)"), "{text}");
    assert_eq!(body["error"]["code"], "BAD_REQUEST");
    let (text, _) = agent.fails("lease_simulator", json!({})).await;
    assert!(text.contains("missing field `platform`"), "{text}");
    let (text, _) = agent
        .fails(
            "lease_simulator",
            json!({"platform": "ios", "colour": "red"}),
        )
        .await;
    assert!(text.contains("unknown field `colour`"), "{text}");
    let (text, _) = agent
        .fails("lease_simulator", json!({"platform": "ios", "ttl": "soon"}))
        .await;
    assert_eq!(
        text,
        "ttl: \"soon\" is not a duration like 15m, 90s, 1h30m, 2d, 500ms or a number of milliseconds (BAD_REQUEST)"
    );
    let (text, _) = agent
        .fails("lease_simulator", json!({"platform": "ios", "timeout": 0}))
        .await;
    assert_eq!(
        text,
        "timeout: 0 is zero; a duration must be positive (BAD_REQUEST)"
    );
    for ttl in [json!(-5), json!(1.5), json!(1e30)] {
        let (text, _) = agent
            .fails("lease_simulator", json!({"platform": "ios", "ttl": ttl}))
            .await;
        assert!(
            text.contains(&format!(
                "{ttl} is not a duration: a positive whole number of milliseconds"
            )),
            "{text}"
        );
    }
    let (text, _) = agent
        .fails(
            "lease_simulator",
            json!({"platform": "ios", "ttl": "1000d"}),
        )
        .await;
    assert_eq!(
        text,
        "ttl: \"1000d\" is longer than the longest TTL simlock takes, 31d (BAD_REQUEST)"
    );
    // A lease id that is none is refused without being echoed (outside trial 24: a 9 MB one
    // came back twice).
    for tool in ["lease_status", "release_simulator", "device_access"] {
        for bad in [
            "x".repeat(161),
            "x".repeat(100_000),
            String::new(),
            "lse x".into(),
        ] {
            let (text, _) = agent.fails(tool, json!({"leaseId": bad})).await;
            assert!(
                text.starts_with("leaseId: not a lease id") && text.len() < 200,
                "{tool}: {text}"
            );
        }
        // At the bound it is a lease id, only not this session's.
        let (text, _) = agent.fails(tool, json!({"leaseId": "x".repeat(160)})).await;
        assert!(text.contains("UNKNOWN_LEASE"), "{tool}: {text}");
    }
    // Text without a unit is refused: "15" could mean minutes (outside trial 24).
    let (text, _) = agent
        .fails("lease_simulator", json!({"platform": "ios", "ttl": "15"}))
        .await;
    assert_eq!(
        text,
        "ttl: \"15\" has no unit: write it like 15m, 90s or 500ms (a JSON number is milliseconds) (BAD_REQUEST)"
    );
    let (text, _) = agent
        .fails(
            "lease_simulator",
            json!({"platform": "ios", "timeout": 172_800_000}),
        )
        .await;
    assert_eq!(
        text,
        "timeout: 172800000 is longer than the longest queue wait simlock takes, 1d (BAD_REQUEST)"
    );
    // The daemon's own refusal, passed on with its code: above lease.maxTtlMs (4h).
    let (text, body) = agent
        .fails("lease_simulator", json!({"platform": "ios", "ttl": "5h"}))
        .await;
    assert!(text.ends_with("(BAD_REQUEST)"), "{text}");
    assert_eq!(body["error"]["code"], "BAD_REQUEST");
    let (text, _) = agent
        .fails(
            "lease_simulator",
            json!({"platform": "ios", "model": "Nokia 3310"}),
        )
        .await;
    assert!(text.ends_with("(UNKNOWN_MODEL)"), "{text}");
    let (text, _) = agent.fails("release_simulator", json!({})).await;
    assert_eq!(text, "This session holds no lease (UNKNOWN_LEASE)");
    let (text, _) = agent
        .fails("device_access", json!({"leaseId": "lse_someone_elses"}))
        .await;
    assert_eq!(
        text,
        "Lease lse_someone_elses is not one of this session's leases (UNKNOWN_LEASE)"
    );
    let (text, _) = agent.fails("held_leases", json!({"all": true})).await;
    assert!(text.contains("unknown field `all`"), "{text}");
    // Holding nothing is an answer, not an error.
    let status = agent.ok("lease_status", json!({})).await;
    assert_eq!(status["held"], false);
    // An unknown tool is a protocol error; the server carries on.
    let unknown = agent
        .client
        .call_tool(CallToolRequestParams::new("format_disk"))
        .await;
    assert!(unknown.is_err());
    let grant = agent
        .ok("lease_simulator", json!({"platform": "ios"}))
        .await;
    assert_eq!(grant["held"], true);
    // One lease per agent session: the daemon's rule, answered with its code.
    let (text, body) = agent
        .fails("lease_simulator", json!({"platform": "ios", "wait": false}))
        .await;
    assert!(text.ends_with("(REQUESTER_ALREADY_LEASED)"), "{text}");
    assert_eq!(body["error"]["code"], "REQUESTER_ALREADY_LEASED");
    assert!(agent.close_stdin().await.success());
    worker.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_daemon_is_a_tool_error_naming_the_socket() {
    let home = tempfile::tempdir().unwrap();
    let agent = Launch::on(home.path()).session("alone").start().await;
    let (text, body) = agent.fails("list_devices", json!({})).await;
    assert!(
        text.starts_with("no simlock daemon is running at "),
        "{text}"
    );
    assert!(text.ends_with("(DAEMON_CONNECTION_LOST)"), "{text}");
    assert_eq!(body["error"]["code"], "DAEMON_CONNECTION_LOST");
    assert!(agent.close_stdin().await.success());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_agents_with_different_sessions_on_one_socket_hold_a_lease_each() {
    let worker = Worker::start(worker_config(2)).await;
    let operator = worker.operator().await;
    let a = Launch::on(worker.home()).session("session-a").start().await;
    let b = Launch::on(worker.home()).session("session-b").start().await;
    let ga = a
        .ok("lease_simulator", json!({"platform": "ios", "wait": false}))
        .await;
    let gb = b
        .ok("lease_simulator", json!({"platform": "ios", "wait": false}))
        .await;
    assert_ne!(ga["leaseId"], gb["leaseId"]);
    assert_ne!(ga["grant"]["device"]["id"], gb["grant"]["device"]["id"]);
    let mut requesters: Vec<String> = leases(&operator)
        .await
        .iter()
        .map(|l| l["requesterId"].as_str().unwrap().to_owned())
        .collect();
    requesters.sort();
    assert_eq!(
        requesters,
        ["claude-code:session-a", "claude-code:session-b"]
    );
    // Each sees only its own lease.
    let held_a = a.ok("held_leases", json!({})).await;
    assert_eq!(held_a["held"].as_array().unwrap().len(), 1);
    assert_eq!(held_a["held"][0]["leaseId"], ga["leaseId"]);
    let (text, _) = a
        .fails("release_simulator", json!({"leaseId": gb["leaseId"]}))
        .await;
    assert!(
        text.ends_with("is not one of this session's leases (UNKNOWN_LEASE)"),
        "{text}"
    );
    assert!(a.close_stdin().await.success());
    assert!(b.close_stdin().await.success());
    assert!(leases(&operator).await.is_empty());
    worker.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bind_pid_lease_is_released_once_its_process_is_killed() {
    let worker = Worker::start(worker_config(1)).await;
    let operator = worker.operator().await;
    let mut events = operator.follow_events().await.unwrap();
    let mut bound = Command::new("sleep")
        .arg("600")
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let pid = bound.id().unwrap().to_string();
    // A TTL of an hour: renewals every 20 minutes, so a release seen within the test's patience
    // came from the binding, well within one renewal period.
    let mut command = Command::new(env!("CARGO_BIN_EXE_simlock"));
    for name in SESSION_VARIABLES {
        command.env_remove(name);
    }
    let mut lease = command
        .env("SIMLOCK_HOME", worker.home())
        .args([
            "--json",
            "lease",
            "--platform",
            "ios",
            "--ttl",
            "1h",
            "--bind-pid",
            &pid,
        ])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let stdout = lease.stdout.take().unwrap();
    let mut lines = tokio::io::AsyncBufReadExt::lines(tokio::io::BufReader::new(stdout));
    let line = bounded("the grant", lines.next_line())
        .await
        .unwrap()
        .unwrap();
    let grant: Value = serde_json::from_str(&line).unwrap();
    let id = grant["lease"]["id"].as_str().unwrap().to_owned();
    assert_eq!(grant["lease"]["ttlMs"], 3_600_000);
    // No requester named, no agent session: the parent process (this test) is the requester.
    assert_eq!(
        grant["lease"]["requesterId"]
            .as_str()
            .unwrap()
            .split('@')
            .next(),
        Some(format!("pid:{}", std::process::id()).as_str())
    );

    bound.kill().await.unwrap();
    bound.wait().await.unwrap();
    let released = event_for(&mut events, "lease.released", &id).await;
    assert_eq!(released.payload["reason"], "explicit");
    let status = bounded("simlock lease exits", lease.wait()).await.unwrap();
    assert_eq!(status.code(), Some(0));
    assert!(leases(&operator).await.is_empty());
    worker.stop().await;
}

/// A CA file that cannot be read stops the server at start, naming the flag (outside trial 11:
/// every tool answered `BAD_REQUEST`, as if the model could mend it); so does `--url` without a
/// token.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_whose_connection_settings_are_wrong_does_not_start() {
    let home = tempfile::tempdir().unwrap();
    let missing = home.path().join("no-such-ca.pem");
    for (env, code, said) in [
        (
            vec![
                ("SIMLOCK_TOKEN", "slk_x".to_owned()),
                ("SIMLOCK_CA_FILE", missing.display().to_string()),
            ],
            2,
            "--ca-file (SIMLOCK_CA_FILE): cannot read",
        ),
        (Vec::new(), 2, "--url needs a token"),
    ] {
        let out = Command::new(env!("CARGO_BIN_EXE_simlock"))
            .env("SIMLOCK_HOME", home.path())
            .env_remove("SIMLOCK_TOKEN")
            .env_remove("SIMLOCK_CA_FILE")
            .envs(env)
            .args(["--url", "https://127.0.0.1:9", "mcp"])
            .stdin(Stdio::null())
            .output()
            .await
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(code), "{stderr}");
        assert!(stderr.contains(said), "{stderr}");
        assert!(!stderr.contains("serving on stdio"), "{stderr}");
    }
    // A requester no daemon takes (outside trial 24: the server started, and every lease was
    // refused for a reason the model could not mend).
    for (requester, said) in [
        ("a\u{1b}b".to_owned(), "control"),
        ("r".repeat(217), "longer than 216 characters"),
    ] {
        let out = Command::new(env!("CARGO_BIN_EXE_simlock"))
            .env("SIMLOCK_HOME", home.path())
            .args(["mcp", "--requester", &requester])
            .stdin(Stdio::null())
            .output()
            .await
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{stderr}");
        assert!(
            stderr.contains("the requester (named explicitly)") && stderr.contains(said),
            "{stderr}"
        );
        assert!(!stderr.contains("serving on stdio"), "{stderr}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bind_pid_refuses_a_process_that_is_not_running() {
    let worker = Worker::start(worker_config(1)).await;
    let mut gone = std::process::Command::new("true").spawn().unwrap();
    gone.wait().unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_simlock"))
        .env("SIMLOCK_HOME", worker.home())
        .args(["lease", "--platform", "ios", "--bind-pid"])
        .arg(gone.id().to_string())
        .stdin(Stdio::null())
        .output()
        .await
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("no such process is running"), "{stderr}");
    assert!(leases(&worker.operator().await).await.is_empty());
    worker.stop().await;
}
