//! The built `simlock` binary against the in-test daemon on a unix socket in a temporary
//! `SIMLOCK_HOME` (and over HTTP): JSON shapes, exit codes, detached and held leases, signals.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    reason = "a test fails by panicking"
)]

use std::process::Stdio;
use std::time::Duration;

use serde_json::{Value, json};
use simlock_contract::ids::DeviceId;
use simlock_contract::model::LeaseEndReason;
use simlock_contract::push::{Progress, UnhealthyReason};
use simlock_contract::{ContractError, ErrorCode, Push};
use simlock_test_support::fake_daemon::{CancelScript, FakeDaemon, RequestScript};
use tokio::io::{AsyncBufReadExt as _, AsyncRead, BufReader, Lines};
use tokio::process::{Child, Command};

/// A hang guard: a test that waits longer than this has failed.
const GUARD: Duration = Duration::from_secs(30);

async fn guard<F: Future>(future: F) -> F::Output {
    tokio::time::timeout(GUARD, future)
        .await
        .expect("the test hung")
}

async fn fake() -> FakeDaemon {
    FakeDaemon::new().unwrap().with_socket().await.unwrap()
}

/// The binary, pointed at `home`, with no connection settings inherited.
fn simlock(home: &std::path::Path) -> Command {
    let mut command = Command::new(env!("CARGO_BIN_EXE_simlock"));
    command
        .env("SIMLOCK_HOME", home)
        .env_remove("SIMLOCK_URL")
        .env_remove("SIMLOCK_TOKEN")
        .env_remove("SIMLOCK_AGENT_ID")
        .env_remove("SIMLOCK_CA_FILE")
        .stdin(Stdio::null())
        .kill_on_drop(true);
    // The agent session the tests themselves may run in.
    for name in AGENT_SESSIONS {
        command.env_remove(name);
    }
    command
}

/// The session-id variables agent CLIs export (`docs/MCP.md`).
const AGENT_SESSIONS: &[&str] = &[
    "CLAUDE_CODE_SESSION_ID",
    "CODEX_THREAD_ID",
    "CURSOR_CONVERSATION_ID",
    "GEMINI_SESSION_ID",
];

struct Run {
    code: i32,
    stdout: String,
    stderr: String,
}

impl Run {
    fn json(&self) -> Value {
        serde_json::from_str(self.stdout.trim())
            .unwrap_or_else(|e| panic!("stdout is not one JSON document ({e}): {}", self.stdout))
    }
}

async fn run_in(command: &mut Command) -> Run {
    let output = guard(command.output()).await.unwrap();
    Run {
        code: output.status.code().expect("killed by a signal"),
        stdout: String::from_utf8(output.stdout).unwrap(),
        stderr: String::from_utf8(output.stderr).unwrap(),
    }
}

async fn run(fake: &FakeDaemon, args: &[&str]) -> Run {
    run_in(simlock(fake.home()).args(args)).await
}

/// A held `simlock lease`, its stdout and stderr read line by line.
struct Held {
    child: Child,
    stdout: Lines<BufReader<Box<dyn AsyncRead + Unpin + Send>>>,
    stderr: Lines<BufReader<Box<dyn AsyncRead + Unpin + Send>>>,
}

impl Held {
    fn spawn(fake: &FakeDaemon, args: &[&str]) -> Self {
        let mut child = simlock(fake.home())
            .args(args)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let stdout: Box<dyn AsyncRead + Unpin + Send> = Box::new(child.stdout.take().unwrap());
        let stderr: Box<dyn AsyncRead + Unpin + Send> = Box::new(child.stderr.take().unwrap());
        Self {
            child,
            stdout: BufReader::new(stdout).lines(),
            stderr: BufReader::new(stderr).lines(),
        }
    }

    async fn stdout_line(&mut self) -> String {
        guard(self.stdout.next_line())
            .await
            .unwrap()
            .expect("stdout ended")
    }

    async fn stderr_line(&mut self) -> String {
        guard(self.stderr.next_line())
            .await
            .unwrap()
            .expect("stderr ended")
    }

    async fn signal(&self, name: &str) {
        let pid = self.child.id().unwrap().to_string();
        let status = guard(Command::new("kill").args([name, &pid]).status())
            .await
            .unwrap();
        assert!(status.success());
    }

    async fn exit_code(mut self) -> (i32, String) {
        let status = guard(self.child.wait()).await.unwrap();
        let mut rest = Vec::new();
        while let Some(line) = guard(self.stderr.next_line()).await.unwrap() {
            rest.push(line);
        }
        (status.code().expect("killed by a signal"), rest.join("\n"))
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn results_are_the_contracts_json_documents() {
    let fake = fake().await;
    let status = run(&fake, &["status", "--json"]).await;
    assert_eq!(status.code, 0, "{}", status.stderr);
    assert_eq!(status.json()["daemon"]["mode"], "worker");

    let leases = run(&fake, &["--json", "leases"]).await;
    assert_eq!(leases.json(), json!({"leases": []}));

    // Admin commands send the daemon's admin secret from SIMLOCK_HOME/admin.token.
    let devices = run(&fake, &["--json", "devices"]).await;
    assert_eq!(devices.code, 0, "{}", devices.stderr);
    assert_eq!(devices.json()["devices"][0]["id"], "dev_1");
    assert_eq!(
        fake.calls_of("list.get")[0].role,
        simlock_contract::Role::Admin
    );
    // Agent commands do not.
    assert_eq!(
        fake.calls_of("lease.list")[0].role,
        simlock_contract::Role::Agent
    );

    let catalog = run(&fake, &["--json", "catalog", "--platform", "ios"]).await;
    assert_eq!(
        catalog.json()["platforms"][0]["models"],
        json!(["iPhone 16"])
    );

    // Without --json: a human view.
    let human = run(&fake, &["status"]).await;
    assert_eq!(human.code, 0);
    assert!(human.stdout.contains("worker running"), "{}", human.stdout);
    assert!(human.stdout.contains("dev_1"), "{}", human.stdout);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refusals_exit_with_their_codes_and_print_the_error() {
    let fake = fake().await;
    let cases = [
        (ErrorCode::NoCapacity, 11),
        (ErrorCode::QueueTimeout, 10),
        (ErrorCode::RequesterAlreadyLeased, 13),
        (ErrorCode::CapabilityMissing, 12),
    ];
    for (code, exit) in cases {
        let refusal = ContractError::new(code, format!("refused with {code}"))
            .with_details(json!({"requestId": "req_1"}));
        fake.script_request(RequestScript::Fail(Vec::new(), refusal));
        let out = run(
            &fake,
            &[
                "lease",
                "--platform",
                "ios",
                "--no-wait",
                "--json",
                "--requester",
                "r1",
            ],
        )
        .await;
        assert_eq!(out.code, exit, "{code}: {}", out.stderr);
        assert_eq!(
            out.json(),
            json!({"error": {"code": code.as_str(), "message": format!("refused with {code}"), "details": {"requestId": "req_1"}}})
        );
        assert_eq!(
            out.stderr.trim(),
            format!("simlock: refused with {code} ({code})")
        );
    }
    // A requester nobody named (the parent process here) that already holds a lease: the
    // refusal says how to name another.
    let taken = ContractError::new(ErrorCode::RequesterAlreadyLeased, "taken");
    fake.script_request(RequestScript::Fail(Vec::new(), taken));
    let out = run(&fake, &["lease", "--platform", "ios", "--no-wait"]).await;
    assert_eq!(out.code, 13);
    assert!(
        out.stderr
            .contains("give each lease its own with --requester ID (or SIMLOCK_AGENT_ID)"),
        "{}",
        out.stderr
    );
    let unknown = run(&fake, &["renew", "lse_nope"]).await;
    assert_eq!(unknown.code, 1);
    assert!(unknown.stdout.is_empty());
    assert!(
        unknown.stderr.contains("UNKNOWN_LEASE"),
        "{}",
        unknown.stderr
    );
    let bad = run(&fake, &["renew", "not a lease"]).await;
    assert_eq!(bad.code, 2, "{}", bad.stderr);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn usage_errors_exit_2() {
    let fake = fake().await;
    assert_eq!(run(&fake, &["lease"]).await.code, 2);
    assert_eq!(
        run(&fake, &["lease", "--platform", "windows"]).await.code,
        2
    );
    assert_eq!(run(&fake, &["release"]).await.code, 2);
    assert_eq!(run(&fake, &["events", "--since", "soon"]).await.code, 2);
    for bad in ["0", "0s", "soon", "5 m", "-5s"] {
        let out = run(&fake, &["lease", "--platform", "ios", "--ttl", bad]).await;
        assert_eq!(out.code, 2, "--ttl {bad}: {}", out.stderr);
        let out = run(&fake, &["renew", "lse_1", "--ttl", bad]).await;
        assert_eq!(out.code, 2, "renew --ttl {bad}: {}", out.stderr);
        let out = run(&fake, &["lease", "--platform", "ios", "--timeout", bad]).await;
        assert_eq!(out.code, 2, "--timeout {bad}: {}", out.stderr);
    }
    let out = run(&fake, &["lease", "--platform", "ios", "--ttl", "soon"]).await;
    assert!(
        out.stderr
            .contains("is not a duration like 15m, 90s, 1h30m"),
        "{}",
        out.stderr
    );
    let out = run(
        &fake,
        &["lease", "--platform", "ios", "--detach", "--bind-pid", "1"],
    )
    .await;
    assert_eq!(out.code, 2, "{}", out.stderr);
    assert_eq!(
        run(&fake, &["--url", "http://127.0.0.1:1", "status"])
            .await
            .code,
        2
    );
    assert!(fake.calls().is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_daemon_is_a_clear_message_and_exit_1() {
    let home = tempfile::tempdir().unwrap();
    let out = run_in(simlock(home.path()).arg("status")).await;
    assert_eq!(out.code, 1);
    let socket = home.path().join("daemon.sock");
    assert_eq!(
        out.stderr.trim(),
        format!(
            "simlock: no simlock daemon is running at {}; start one with simlock-worker --home {home} (or simlock-gateway --home {home}) (DAEMON_CONNECTION_LOST)",
            socket.display(),
            home = home.path().display()
        )
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_blank_requester_is_a_usage_error_and_a_blank_agent_id_is_unset() {
    let fake = fake().await;
    for blank in ["", "  "] {
        let out = run(
            &fake,
            &[
                "lease",
                "--platform",
                "ios",
                "--requester",
                blank,
                "--detach",
            ],
        )
        .await;
        assert_eq!(out.code, 2, "{}", out.stderr);
        assert!(
            out.stderr.contains("a requester cannot be blank"),
            "{}",
            out.stderr
        );
        let out = run(&fake, &["mcp", "--requester", blank]).await;
        assert_eq!(out.code, 2, "{}", out.stderr);
    }
    assert!(fake.calls_of("lease.request").is_empty());

    // The variable an agent's configuration left empty: the default requester instead.
    let out = run_in(
        simlock(fake.home())
            .env("SIMLOCK_AGENT_ID", "")
            .env("CODEX_THREAD_ID", "t-1")
            .args(["lease", "--platform", "ios", "--detach", "--json"]),
    )
    .await;
    assert_eq!(out.code, 0, "{}", out.stderr);
    assert_eq!(out.json()["lease"]["requesterId"], "codex:t-1");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn detach_prints_the_grant_and_leaves_the_lease() {
    let fake = fake().await;
    let out = run_in(
        simlock(fake.home())
            .env("SIMLOCK_AGENT_ID", "agent-7")
            .args([
                "lease",
                "--platform",
                "ios",
                "--device",
                "iPhone 16",
                "--ttl",
                "60000",
                "--requires",
                "agent-device",
                "--detach",
                "--json",
            ]),
    )
    .await;
    assert_eq!(out.code, 0, "{}", out.stderr);
    let grant = out.json();
    assert_eq!(grant["lease"]["id"], "lse_1");
    assert_eq!(grant["lease"]["requesterId"], "agent-7");
    assert_eq!(grant["environment"]["SIMLOCK_DEVICE_UDID"], "UDID-1");
    assert_eq!(
        grant["device"]["access"],
        json!({"kind": "ios-simulator", "udid": "UDID-1", "deviceSet": "/tmp/it's a set"})
    );
    assert_eq!(
        fake.calls_of("lease.request")[0].input,
        json!({"platform": "ios", "model": "iPhone 16", "ttlMs": 60000, "requesterId": "agent-7", "requires": ["agent-device"]})
    );
    assert_eq!(fake.leases().len(), 1);
    assert!(fake.calls_of("lease.release").is_empty());
    assert!(fake.calls_of("lease.renew").is_empty());

    // The lease can then be renewed, used and released by id.
    let renewed = run(&fake, &["--json", "renew", "lse_1", "--ttl", "120000"]).await;
    assert_eq!(renewed.json()["ttlMs"], 120_000);
    let exec = run(&fake, &["exec", "lse_1", "simctl", "list", "--json-ish"]).await;
    assert_eq!(exec.code, 3, "{}", exec.stderr);
    assert_eq!(exec.stdout, "hello\nbye\n");
    assert_eq!(exec.stderr, "careful\n");
    assert_eq!(
        fake.calls_of("device.exec")[0].input,
        json!({"leaseId": "lse_1", "tool": "simctl", "args": ["list", "--json-ish"]})
    );
    // `simlock env` prints the same environment as shell exports, quoted for sh.
    let env = run(&fake, &["env", "lse_1"]).await;
    assert_eq!(env.code, 0, "{}", env.stderr);
    assert!(
        env.stdout
            .contains("export SIMLOCK_IOS_DEVICE_SET='/tmp/it'\\''s a set'\n"),
        "{}",
        env.stdout
    );
    let script = format!(
        "{}\nprintf '%s|%s' \"$SIMLOCK_IOS_DEVICE_SET\" \"$SIMLOCK_DEVICE_UDID\"",
        env.stdout
    );
    let evaluated = run_in(Command::new("sh").args(["-c", &script])).await;
    assert_eq!(evaluated.stdout, "/tmp/it's a set|UDID-1");
    let env_json = run(&fake, &["--json", "env", "lse_1"]).await;
    assert_eq!(
        env_json.json()["environment"],
        grant["environment"],
        "the grant's environment"
    );
    let unknown = run(&fake, &["env", "lse_404"]).await;
    assert_eq!(unknown.code, 1);
    assert!(
        unknown.stderr.contains("UNKNOWN_LEASE"),
        "{}",
        unknown.stderr
    );
    // A malformed id is a usage error naming leaseId, as renew and release answer it.
    for malformed in ["bad id!", ""] {
        let bad = run(&fake, &["env", malformed]).await;
        assert_eq!(bad.code, 2, "{malformed:?}: {}", bad.stderr);
        assert!(
            bad.stderr.contains("leaseId") && bad.stderr.contains("BAD_REQUEST"),
            "{malformed:?}: {}",
            bad.stderr
        );
    }
    let released = run(&fake, &["release", "lse_1"]).await;
    assert_eq!(released.code, 0);
    assert_eq!(released.stdout.trim(), "released lease lse_1");
    assert!(fake.leases().is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_held_lease_is_renewed_then_released_on_sigterm() {
    let fake = fake().await;
    fake.script_request(RequestScript::Grant(vec![Progress::queued(1)]));
    let mut held = Held::spawn(
        &fake,
        &["lease", "--platform", "ios", "--ttl", "300", "--json"],
    );
    // stderr is not a terminal: progress comes as JSON lines.
    let progress: Value = serde_json::from_str(&held.stderr_line().await).unwrap();
    assert_eq!(
        progress,
        json!({"progress": {"stage": "queued", "queuePosition": 1}})
    );
    let grant: Value = serde_json::from_str(&held.stdout_line().await).unwrap();
    let lease_id = grant["lease"]["id"].as_str().unwrap().to_owned();
    let renewals = guard(fake.wait_for_calls("lease.renew", 2)).await;
    assert!(
        renewals
            .iter()
            .all(|r| r.input == json!({"leaseId": lease_id}))
    );
    held.signal("-TERM").await;
    let (code, stderr) = held.exit_code().await;
    assert_eq!(code, 0, "{stderr}");
    assert_eq!(
        fake.calls_of("lease.release")[0].input,
        json!({"leaseId": lease_id})
    );
    assert!(fake.leases().is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_held_lease_the_daemon_ends_exits_14() {
    let fake = fake().await;
    let mut held = Held::spawn(&fake, &["lease", "--platform", "android", "--json"]);
    let grant: Value = serde_json::from_str(&held.stdout_line().await).unwrap();
    let lease_id = grant["lease"]["id"].as_str().unwrap().to_owned();
    // A health notice reaches stderr as a JSON line: the push's payload, named by its kind.
    fake.notify(
        grant["lease"]["ownerId"].as_str().unwrap(),
        &Push::DeviceUnhealthy {
            lease_id: lease_id.clone(),
            device_id: DeviceId::from_raw("dev_1"),
            reason: UnhealthyReason::Crashed,
        },
    );
    let notice: Value = serde_json::from_str(&held.stderr_line().await).unwrap();
    assert_eq!(
        notice,
        json!({"notice": {"event": "device-unhealthy", "leaseId": lease_id, "deviceId": "dev_1", "reason": "crashed"}})
    );
    assert!(fake.end_lease(&lease_id, LeaseEndReason::Expired));
    let (code, stderr) = held.exit_code().await;
    assert_eq!(code, 14, "{stderr}");
    assert!(
        stderr.contains(&format!("the daemon ended lease {lease_id} (expired)")),
        "{stderr}"
    );
    assert!(fake.calls_of("lease.release").is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_interrupt_while_queued_withdraws_the_request_and_exits_130() {
    let fake = fake().await;
    fake.script_request(RequestScript::Hold(vec![Progress::queued(4)]));
    fake.script_cancel(CancelScript::Cancelled);
    let mut held = Held::spawn(&fake, &["lease", "--platform", "ios", "--json"]);
    let progress = held.stderr_line().await;
    assert!(progress.contains("\"queuePosition\":4"), "{progress}");
    held.signal("-INT").await;
    let (code, stderr) = held.exit_code().await;
    assert_eq!(code, 130, "{stderr}");
    assert!(
        stderr.contains("simlock: interrupted; the request was withdrawn (CANCELLED)"),
        "{stderr}"
    );
    assert_eq!(fake.calls_of("lease.cancel").len(), 1);
    assert!(fake.leases().is_empty());
}

/// A request granted before the interrupt's withdrawal reached the daemon is given back, and the
/// command still ends as interrupted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_interrupt_that_loses_the_race_with_the_grant_releases_the_lease_and_exits_130() {
    let fake = fake().await;
    fake.script_request(RequestScript::Hold(vec![Progress::queued(1)]));
    fake.script_cancel(CancelScript::NotFound(Ok(())));
    let mut held = Held::spawn(&fake, &["lease", "--platform", "ios", "--json"]);
    let progress = held.stderr_line().await;
    assert!(progress.contains("\"queuePosition\":1"), "{progress}");
    held.signal("-INT").await;
    let (code, stderr) = held.exit_code().await;
    assert_eq!(code, 130, "{stderr}");
    let released = fake.calls_of("lease.release");
    assert_eq!(released.len(), 1, "{stderr}");
    let lease_id = released[0].input["leaseId"].as_str().unwrap().to_owned();
    assert!(
        stderr.contains(&format!(
            "interrupted; lease {lease_id} was granted meanwhile and released"
        )),
        "{stderr}"
    );
    assert!(fake.leases().is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn operators_manage_tokens_workers_events_and_the_daemon() {
    let fake = fake().await;
    let created = run(
        &fake,
        &[
            "--json", "token", "create", "--role", "agent", "--label", "ci",
        ],
    )
    .await;
    assert_eq!(created.code, 0, "{}", created.stderr);
    let created = created.json();
    assert!(created["secret"].as_str().unwrap().starts_with("slk_"));
    let id = created["token"]["id"].as_str().unwrap().to_owned();
    let listed = run(&fake, &["--json", "token", "list"]).await.json();
    assert!(
        listed["tokens"]
            .as_array()
            .unwrap()
            .iter()
            .any(|t| t["id"] == id.as_str())
    );
    let revoked = run(&fake, &["--json", "token", "revoke", &id]).await;
    assert_eq!(revoked.json(), json!({"revoked": true}));
    // A second time (or a typo) revokes nothing, and says so: exit 1.
    let again = run(&fake, &["token", "revoke", &id]).await;
    assert_eq!(again.code, 1, "{}", again.stderr);
    assert!(again.stdout.is_empty(), "{}", again.stdout);
    assert!(
        again.stderr.contains(&format!(
            "no token {id} is known to this daemon; nothing was revoked"
        )),
        "{}",
        again.stderr
    );
    let again = run(&fake, &["--json", "token", "revoke", &id]).await;
    assert_eq!(again.code, 1, "{}", again.stderr);
    assert_eq!(again.json(), json!({"revoked": false}));

    let workers = run(&fake, &["--json", "workers"]).await.json();
    assert_eq!(workers["workers"][0]["id"], "fake-worker");
    // Each answer says whether the call changed the worker.
    for (command, said) in [
        (
            "drain",
            "worker fake-worker is drained: it takes no new leases",
        ),
        (
            "drain",
            "worker fake-worker was already drained: it takes no new leases",
        ),
        ("undrain", "worker fake-worker takes new leases again"),
        (
            "undrain",
            "worker fake-worker was not drained: it takes new leases",
        ),
    ] {
        let out = run(&fake, &["workers", command, "fake-worker"]).await;
        assert_eq!(out.code, 0, "{}", out.stderr);
        assert_eq!(out.stdout.trim(), said);
    }
    let unknown = run(&fake, &["workers", "undrain", "nope"]).await;
    assert_eq!(unknown.code, 12, "{}", unknown.stderr);
    let connected = run(&fake, &["workers", "remove", "fake-worker"]).await;
    assert_eq!(connected.code, 2, "{}", connected.stderr);
    // Idempotent over HTTP (removed: false), but a name that matches no worker is a typo here.
    let typo = run(&fake, &["workers", "remove", "fake-wroker"]).await;
    assert_eq!(typo.code, 12, "{}", typo.stderr);
    assert!(typo.stdout.is_empty(), "{}", typo.stdout);
    assert!(
        typo.stderr
            .contains("no worker fake-wroker is known to this gateway; nothing was removed"),
        "{}",
        typo.stderr
    );
    let typo = run(&fake, &["--json", "workers", "remove", "fake-wroker"]).await;
    assert_eq!(typo.code, 12, "{}", typo.stderr);
    assert_eq!(
        typo.json()["error"]["code"],
        "UNKNOWN_WORKER",
        "{}",
        typo.stdout
    );
    assert_eq!(
        typo.json()["error"]["message"],
        "no worker fake-wroker is known to this gateway; nothing was removed"
    );

    fake.emit("lease.granted", json!({"leaseId": "lse_1"}));
    let events = run(&fake, &["--json", "events", "--since", "1h"]).await;
    assert_eq!(events.json()["events"][0]["event"], "lease.granted");

    fake.add_lease("someone", 60_000);
    let all = run(&fake, &["--json", "release", "--all"]).await;
    assert_eq!(all.json(), json!({"leaseIds": ["lse_1"]}));

    let stop = run(&fake, &["--json", "stop"]).await;
    assert_eq!(stop.json(), json!({"stopping": true}));
    assert!(fake.stop_requested());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn events_follow_prints_new_events_as_lines() {
    let fake = fake().await;
    fake.emit("daemon.started", json!({}));
    let mut follow = Held::spawn(&fake, &["--json", "events", "--follow"]);
    let first: Value = serde_json::from_str(&follow.stdout_line().await).unwrap();
    assert_eq!(first["event"], "daemon.started");
    // The replay is printed after the subscription started: what comes now is followed.
    fake.emit("device.ready", json!({"deviceId": "dev_1"}));
    let next: Value = serde_json::from_str(&follow.stdout_line().await).unwrap();
    assert_eq!(next["event"], "device.ready");
    follow.signal("-INT").await;
    let (code, stderr) = follow.exit_code().await;
    assert_eq!(code, 0, "{stderr}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn url_and_token_reach_the_http_api() {
    let fake = FakeDaemon::new().unwrap().with_http().await.unwrap();
    let url = fake.url().unwrap();
    let status = run_in(
        simlock(fake.home())
            .env("SIMLOCK_URL", &url)
            .env("SIMLOCK_TOKEN", fake.operator_token())
            .args(["--json", "status"]),
    )
    .await;
    assert_eq!(status.code, 0, "{}", status.stderr);
    assert_eq!(status.json()["daemon"]["instanceId"], "fake-worker");
    let out = run(
        &fake,
        &[
            "--url",
            &url,
            "--token",
            fake.agent_token(),
            "--json",
            "lease",
            "--platform",
            "ios",
            "--detach",
        ],
    )
    .await;
    assert_eq!(out.code, 0, "{}", out.stderr);
    assert_eq!(out.json()["lease"]["ownerId"], fake.agent_token_id());
    let forbidden = run(
        &fake,
        &["--url", &url, "--token", fake.agent_token(), "devices"],
    )
    .await;
    assert_eq!(forbidden.code, 1);
    assert!(
        forbidden.stderr.contains("FORBIDDEN"),
        "{}",
        forbidden.stderr
    );
    let stranger = run(&fake, &["--url", &url, "--token", "slk_nope", "status"]).await;
    assert_eq!(stranger.code, 1);
    assert!(
        stranger.stderr.contains("UNAUTHENTICATED"),
        "{}",
        stranger.stderr
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_cli_leases_over_https_trusting_its_ca_file() {
    let pki = tempfile::tempdir().unwrap();
    let ca = simlock_tls::testing::TestCa::new("simlock CLI test CA");
    let files = ca.leaf(&["127.0.0.1", "localhost"]).write(pki.path());
    let ca_file = ca.write(&pki.path().join("ca.pem"));
    let tls = simlock_tls::ServerTls::load(
        simlock_tls::PemFile::new(&files.cert, "http.tls.certFile"),
        simlock_tls::PemFile::new(&files.key, "http.tls.keyFile"),
    )
    .unwrap();
    let fake = FakeDaemon::new().unwrap().with_https(tls).await.unwrap();
    let url = fake.url().unwrap();
    assert!(url.starts_with("https://127.0.0.1:"), "{url}");

    // The platform's roots alone do not trust the test CA: the error names the flag.
    let untrusted = run(
        &fake,
        &["--url", &url, "--token", fake.agent_token(), "status"],
    )
    .await;
    assert_eq!(untrusted.code, 1, "{}", untrusted.stderr);
    assert!(
        untrusted.stderr.contains("not signed by a trusted CA")
            && untrusted.stderr.contains("--ca-file"),
        "{}",
        untrusted.stderr
    );
    assert!(fake.calls().is_empty());

    let out = run_in(simlock(fake.home()).env("SIMLOCK_CA_FILE", &ca_file).args([
        "--url",
        &url,
        "--token",
        fake.agent_token(),
        "--json",
        "lease",
        "--platform",
        "ios",
        "--detach",
    ]))
    .await;
    assert_eq!(out.code, 0, "{}", out.stderr);
    assert_eq!(out.json()["lease"]["ownerId"], fake.agent_token_id());
    let ca_arg = ca_file.display().to_string();
    let status = run(
        &fake,
        &[
            "--url",
            &url,
            "--token",
            fake.operator_token(),
            "--ca-file",
            &ca_arg,
            "--json",
            "status",
        ],
    )
    .await;
    assert_eq!(status.code, 0, "{}", status.stderr);
    assert_eq!(status.json()["daemon"]["instanceId"], "fake-worker");

    // Plain http:// to the TLS port is told to use https://.
    let plain = url.replacen("https://", "http://", 1);
    let out = run(
        &fake,
        &["--url", &plain, "--token", fake.agent_token(), "status"],
    )
    .await;
    assert_ne!(out.code, 0);
    assert!(out.stderr.contains("use https://"), "{}", out.stderr);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_held_lease_whose_renewal_finds_it_gone_exits_14() {
    let fake = fake().await;
    let mut held = Held::spawn(&fake, &["lease", "--platform", "ios", "--ttl", "300"]);
    // Human view on stdout: the first line names the lease.
    let first = held.stdout_line().await;
    assert!(first.starts_with("lease lse_1 granted"), "{first}");
    assert!(fake.forget_lease("lse_1"));
    let (code, stderr) = held.exit_code().await;
    assert_eq!(code, 14, "{stderr}");
    assert!(
        stderr.contains("the daemon ended lease lse_1 (it is gone)"),
        "{stderr}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_held_lease_whose_renewals_keep_failing_exits_with_the_errors_code_and_one_document() {
    let fake = fake().await;
    let mut held = Held::spawn(
        &fake,
        &["lease", "--platform", "ios", "--ttl", "300", "--json"],
    );
    let grant: Value = serde_json::from_str(&held.stdout_line().await).unwrap();
    assert_eq!(grant["lease"]["id"], "lse_1");
    // Every later call answers DAEMON_STOPPING: renewing fails until the lease's deadline.
    fake.pipeline().begin_stopping();
    let status = guard(held.child.wait()).await.unwrap();
    assert_eq!(
        status.code(),
        Some(i32::from(ErrorCode::DaemonStopping.exit_code()))
    );
    // stdout keeps its one document, the grant: the failure is told on stderr only.
    assert_eq!(guard(held.stdout.next_line()).await.unwrap(), None);
    let mut stderr = Vec::new();
    while let Some(line) = guard(held.stderr.next_line()).await.unwrap() {
        stderr.push(line);
    }
    // It says what became of the lease.
    assert_eq!(
        stderr.last().map(String::as_str),
        Some(
            "simlock: lease lse_1 could not be renewed: The daemon is stopping (DAEMON_STOPPING); \
             it expires on its TTL if it has not already"
        ),
        "{stderr:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn durations_are_typed_as_people_type_them() {
    let fake = fake().await;
    let out = run(
        &fake,
        &[
            "--json",
            "lease",
            "--platform",
            "ios",
            "--ttl",
            "15m",
            "--timeout",
            "90s",
            "--detach",
        ],
    )
    .await;
    assert_eq!(out.code, 0, "{}", out.stderr);
    let input = &fake.calls_of("lease.request")[0].input;
    assert_eq!(input["ttlMs"], 900_000);
    assert_eq!(input["timeoutMs"], 90_000);
    let renewed = run(&fake, &["renew", "lse_1", "--ttl", "1h30m"]).await;
    assert_eq!(renewed.code, 0, "{}", renewed.stderr);
    assert_eq!(
        fake.calls_of("lease.renew")[0].input,
        json!({"leaseId": "lse_1", "ttlMs": 5_400_000})
    );
    // The human view says it the same way.
    assert!(renewed.stdout.contains("(ttl 1h30m)"), "{}", renewed.stdout);
    // Milliseconds are still accepted.
    let out = run(&fake, &["--json", "renew", "lse_1", "--ttl", "60000"]).await;
    assert_eq!(out.json()["ttlMs"], 60_000);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_a_requester_the_agent_session_or_the_parent_process_names_it() {
    let fake = fake().await;
    let out = run_in(
        simlock(fake.home())
            .env("CODEX_THREAD_ID", "thread-9")
            .args(["--json", "lease", "--platform", "ios", "--detach"]),
    )
    .await;
    assert_eq!(out.code, 0, "{}", out.stderr);
    assert_eq!(out.json()["lease"]["requesterId"], "codex:thread-9");
    assert_eq!(
        fake.calls_of("lease.request")[0].input["requesterId"],
        "codex:thread-9"
    );
    // No session: this test process started the CLI, so it is the requester.
    let out = run(
        &fake,
        &["--json", "lease", "--platform", "android", "--detach"],
    )
    .await;
    assert_eq!(out.code, 0, "{}", out.stderr);
    let requester = out.json()["lease"]["requesterId"]
        .as_str()
        .unwrap()
        .to_owned();
    let (pid, host) = requester.split_once('@').expect("pid:<pid>@<host>");
    assert_eq!(pid, format!("pid:{}", std::process::id()));
    assert!(!host.is_empty());
    // An explicit requester still wins over both.
    let out = run_in(
        simlock(fake.home())
            .env("CLAUDE_CODE_SESSION_ID", "s-1")
            .args([
                "--json",
                "lease",
                "--platform",
                "ios",
                "--detach",
                "--requester",
                "me",
            ]),
    )
    .await;
    assert_eq!(out.json()["lease"]["requesterId"], "me");
}
