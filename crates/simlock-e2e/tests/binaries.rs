//! The worker issue's scenario, end to end with the real binaries: `simlock-worker` started as
//! a process with its own home, driven by the `simlock` CLI and by raw HTTP.
//!
//! These run when `SIMLOCK_E2E=1` (set by `cargo xtask e2e`, which builds the binaries first);
//! `SIMLOCK_BIN_DIR` names where the binaries are (default: the workspace's `target/debug`).

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::print_stderr,
    reason = "tests fail by panicking, and say why they skip"
)]

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::Duration;

use serde_json::{Value, json};

/// Every wait on a process is bounded by this.
const PATIENCE: Duration = Duration::from_secs(60);

fn enabled() -> bool {
    let on = std::env::var("SIMLOCK_E2E").is_ok_and(|v| v == "1");
    if !on {
        eprintln!("skipped: set SIMLOCK_E2E=1 (cargo xtask e2e) to run the binary scenario");
    }
    on
}

fn bin(name: &str) -> PathBuf {
    let dir = std::env::var_os("SIMLOCK_BIN_DIR").map_or_else(
        || Path::new(env!("CARGO_MANIFEST_DIR")).join("../../target/debug"),
        PathBuf::from,
    );
    let path = dir.join(name);
    assert!(
        path.exists(),
        "{} is not built; run cargo xtask e2e",
        path.display()
    );
    path
}

/// A worker process with its own home.
struct Worker {
    child: Child,
    home: tempfile::TempDir,
    http: Option<String>,
}

impl Worker {
    fn start(config: &str, http: bool) -> Self {
        let home = tempfile::tempdir().unwrap();
        std::fs::write(home.path().join("config.toml"), config).unwrap();
        Self::start_in(home, http)
    }

    fn start_in(home: tempfile::TempDir, http: bool) -> Self {
        let mut command = Command::new(bin("simlock-worker"));
        command
            .arg("--home")
            .arg(home.path())
            // Virtual devices, whatever tools this machine has.
            .args(["--set", "drivers.ios.driver=virtual"])
            .args(["--set", "drivers.android.driver=virtual"])
            .env("SIMLOCK_LOG", "warn")
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit());
        if http {
            command.args(["--http", "--port", "0"]);
        }
        let mut child = command.spawn().unwrap();
        let stdout = child.stdout.take().unwrap();
        // The ready line names the HTTP address; the reader thread ends with the process.
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let mut lines = BufReader::new(stdout).lines();
            if let Some(Ok(line)) = lines.next() {
                let _ = tx.send(line);
            }
            for _ in lines {}
        });
        let line = rx
            .recv_timeout(PATIENCE)
            .expect("the worker printed its ready line");
        let ready: Value = serde_json::from_str(&line).unwrap();
        assert_eq!(ready["ready"], "worker");
        Self {
            child,
            home,
            http: ready["http"].as_str().map(String::from),
        }
    }

    /// Runs the CLI against this worker's socket with `--json`.
    fn cli(&self, args: &[&str]) -> Cli {
        run_cli(self.home.path(), args, &[])
    }

    fn kill9(mut self) -> tempfile::TempDir {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let home = tempfile::TempDir::new().unwrap();
        std::mem::replace(&mut self.home, home)
    }
}

impl Drop for Worker {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

struct Cli {
    code: i32,
    json: Value,
    stderr: String,
}

fn run_cli(home: &Path, args: &[&str], env: &[(&str, &str)]) -> Cli {
    let mut command = Command::new(bin("simlock"));
    command
        .env("SIMLOCK_HOME", home)
        .env_remove("SIMLOCK_URL")
        .env_remove("SIMLOCK_TOKEN")
        .env_remove("SIMLOCK_AGENT_ID");
    command.arg("--json").args(args);
    for (k, v) in env {
        command.env(k, v);
    }
    let output = wait_bounded(
        command
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap(),
    );
    cli_result(&output)
}

fn cli_result(output: &Output) -> Cli {
    let stdout = String::from_utf8_lossy(&output.stdout);
    let json = stdout.lines().next().map_or(Value::Null, |l| {
        serde_json::from_str(l).unwrap_or(Value::Null)
    });
    Cli {
        code: output.status.code().unwrap_or(-1),
        json,
        stderr: String::from_utf8_lossy(&output.stderr).into_owned(),
    }
}

fn wait_bounded(child: Child) -> Output {
    let (tx, rx) = std::sync::mpsc::channel();
    let id = child.id();
    std::thread::spawn(move || {
        let _ = tx.send(child.wait_with_output());
    });
    match rx.recv_timeout(PATIENCE) {
        Ok(output) => output.unwrap(),
        Err(_) => {
            let _ = Command::new("kill").arg("-9").arg(id.to_string()).status();
            panic!("a simlock command did not finish within {PATIENCE:?}");
        }
    }
}

fn fixed(max_running: u32) -> String {
    format!(
        "[capacity]\nstrategy = \"fixed\"\nmaxRunning = {max_running}\n[virtual]\nprovisionMs = 50\nbootMs = 50\nreclaimMs = 20\n[exec.tools.echo]\ncommand = \"echo\"\n"
    )
}

/// Polls `check` on the daemon's state (via the CLI) until it holds; each poll is a real call.
#[allow(
    clippy::disallowed_methods,
    reason = "a bound on polling another process, not a timing assertion"
)]
fn wait_until(worker: &Worker, what: &str, check: impl Fn(&Value) -> bool) {
    let deadline = std::time::Instant::now() + PATIENCE;
    loop {
        let status = worker.cli(&["status"]);
        if check(&status.json) {
            return;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "timed out waiting for {what}; status: {}",
            status.json
        );
        std::thread::yield_now();
    }
}

fn waiting_requesters(status: &Value) -> Vec<String> {
    status["waiting"]
        .as_array()
        .map(|w| {
            w.iter()
                .filter_map(|r| r["requesterId"].as_str().map(String::from))
                .collect()
        })
        .unwrap_or_default()
}

#[test]
fn two_requesters_get_two_devices_and_at_capacity_no_wait_exits_11() {
    if !enabled() {
        return;
    }
    let worker = Worker::start(&fixed(2), false);
    let a = worker.cli(&["lease", "--platform", "ios", "--detach", "--requester", "a"]);
    assert_eq!(a.code, 0, "{}", a.stderr);
    let b = worker.cli(&["lease", "--platform", "ios", "--detach", "--requester", "b"]);
    assert_eq!(b.code, 0, "{}", b.stderr);
    assert_ne!(
        a.json["device"]["id"], b.json["device"]["id"],
        "two devices"
    );
    let c = worker.cli(&[
        "lease",
        "--platform",
        "ios",
        "--detach",
        "--requester",
        "c",
        "--no-wait",
    ]);
    assert_eq!(c.code, 11, "{}", c.stderr);
    assert_eq!(c.json["error"]["code"], "NO_CAPACITY");
}

#[test]
fn a_waiting_request_is_granted_in_fifo_order_and_a_timeout_exits_10() {
    if !enabled() {
        return;
    }
    let worker = Worker::start(&fixed(1), false);
    let a = worker.cli(&["lease", "--platform", "ios", "--detach", "--requester", "a"]);
    assert_eq!(a.code, 0, "{}", a.stderr);
    let spawn_waiter = |requester: &str| {
        Command::new(bin("simlock"))
            .env("SIMLOCK_HOME", worker.home.path())
            .args([
                "--json",
                "lease",
                "--platform",
                "ios",
                "--detach",
                "--requester",
                requester,
            ])
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap()
    };
    let b = spawn_waiter("b");
    wait_until(&worker, "b to queue", |s| waiting_requesters(s) == ["b"]);
    let c = spawn_waiter("c");
    wait_until(&worker, "c to queue behind b", |s| {
        waiting_requesters(s) == ["b", "c"]
    });

    let timeout = worker.cli(&[
        "lease",
        "--platform",
        "ios",
        "--requester",
        "d",
        "--timeout",
        "200",
    ]);
    assert_eq!(timeout.code, 10, "{}", timeout.stderr);
    assert_eq!(timeout.json["error"]["code"], "QUEUE_TIMEOUT");

    assert_eq!(
        worker
            .cli(&["release", a.json["lease"]["id"].as_str().unwrap()])
            .code,
        0
    );
    let b = cli_result(&wait_bounded(b));
    assert_eq!(b.code, 0, "{}", b.stderr);
    assert_eq!(
        b.json["lease"]["requesterId"], "b",
        "the first waiter is served first"
    );
    wait_until(&worker, "c still waits", |s| waiting_requesters(s) == ["c"]);
    assert_eq!(
        worker
            .cli(&["release", b.json["lease"]["id"].as_str().unwrap()])
            .code,
        0
    );
    let c = cli_result(&wait_bounded(c));
    assert_eq!(c.json["lease"]["requesterId"], "c");
}

#[test]
fn a_lease_whose_ttl_passes_ends_its_held_cli_with_exit_14_and_the_device_is_reclaimed() {
    if !enabled() {
        return;
    }
    let worker = Worker::start(&fixed(1), false);
    let held = Command::new(bin("simlock"))
        .env("SIMLOCK_HOME", worker.home.path())
        .args([
            "--json",
            "lease",
            "--platform",
            "ios",
            "--ttl",
            "600",
            "--requester",
            "holder",
        ])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    wait_until(&worker, "the lease", |s| {
        s["leases"].as_array().is_some_and(|l| l.len() == 1)
    });
    // Freeze the holder so it cannot renew; the worker expires the lease on its own clock.
    let pid = held.id().to_string();
    assert!(
        Command::new("kill")
            .args(["-STOP", &pid])
            .status()
            .unwrap()
            .success()
    );
    wait_until(&worker, "the expiry", |s| {
        s["leases"].as_array().is_some_and(Vec::is_empty)
    });
    assert!(
        Command::new("kill")
            .args(["-CONT", &pid])
            .status()
            .unwrap()
            .success()
    );
    let output = wait_bounded(held);
    assert_eq!(
        output.status.code(),
        Some(14),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    wait_until(&worker, "the device to be reclaimed", |s| {
        s["devices"]
            .as_array()
            .is_some_and(|d| d.len() == 1 && d[0]["state"] == "ready")
    });
    let events = worker.cli(&["events"]);
    let names: Vec<&str> = events.json["events"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|e| e["event"].as_str())
        .collect();
    assert!(names.contains(&"lease.expired"), "{names:?}");
}

#[test]
fn a_worker_killed_with_sigkill_comes_back_with_the_same_leases_and_deadlines() {
    if !enabled() {
        return;
    }
    let worker = Worker::start(&fixed(2), false);
    for requester in ["a", "b"] {
        let lease = worker.cli(&[
            "lease",
            "--platform",
            "android",
            "--detach",
            "--requester",
            requester,
            "--ttl",
            "3600000",
        ]);
        assert_eq!(lease.code, 0, "{}", lease.stderr);
    }
    let before = worker.cli(&["leases"]).json["leases"].clone();
    assert_eq!(before.as_array().unwrap().len(), 2);
    let home = worker.kill9();
    let worker = Worker::start_in(home, false);
    let after = worker.cli(&["leases"]).json["leases"].clone();
    let key = |leases: &Value| {
        let mut v: Vec<(String, i64)> = leases
            .as_array()
            .unwrap()
            .iter()
            .map(|l| {
                (
                    l["id"].as_str().unwrap().to_owned(),
                    l["ttlDeadline"].as_i64().unwrap(),
                )
            })
            .collect();
        v.sort();
        v
    };
    assert_eq!(
        key(&after),
        key(&before),
        "the same leases with the same deadlines"
    );
}

#[test]
fn bounds_the_one_lease_rule_and_their_exit_codes() {
    if !enabled() {
        return;
    }
    let worker = Worker::start(&fixed(2), false);
    let too_long = worker.cli(&[
        "lease",
        "--platform",
        "ios",
        "--detach",
        "--ttl",
        "14400001",
    ]);
    assert_eq!(too_long.code, 2, "{}", too_long.stderr);
    assert_eq!(too_long.json["error"]["code"], "BAD_REQUEST");
    assert!(
        too_long.json["error"]["message"]
            .as_str()
            .unwrap()
            .contains("ttlMs")
    );
    assert!(
        worker.cli(&["leases"]).json["leases"]
            .as_array()
            .unwrap()
            .is_empty(),
        "never clamped, nothing leased"
    );
    let first = worker.cli(&["lease", "--platform", "ios", "--detach", "--requester", "r"]);
    let lease_id = first.json["lease"]["id"].as_str().unwrap().to_owned();
    let second = worker.cli(&["lease", "--platform", "ios", "--detach", "--requester", "r"]);
    assert_eq!(second.code, 13, "{}", second.stderr);
    assert_eq!(second.json["error"]["code"], "REQUESTER_ALREADY_LEASED");
    assert!(
        second.json["error"]["message"]
            .as_str()
            .unwrap()
            .contains(&lease_id)
    );
}

/// A minimal HTTP/1.1 exchange (Connection: close), chunked bodies decoded.
fn http(
    addr: &str,
    method: &str,
    path: &str,
    token: Option<&str>,
    headers: &[(&str, &str)],
    body: Option<&Value>,
) -> (u16, String) {
    http_watching(addr, method, path, token, headers, body, |_| {})
}

/// [`http`], calling `seen` with everything received so far after each read (to act on a
/// streamed answer before it ends).
fn http_watching(
    addr: &str,
    method: &str,
    path: &str,
    token: Option<&str>,
    headers: &[(&str, &str)],
    body: Option<&Value>,
    mut seen: impl FnMut(&[u8]),
) -> (u16, String) {
    let mut stream = TcpStream::connect(addr).unwrap();
    stream.set_read_timeout(Some(PATIENCE)).unwrap();
    let body = body.map(Value::to_string).unwrap_or_default();
    let mut request = format!(
        "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\nContent-Length: {}\r\n",
        body.len()
    );
    if let Some(token) = token {
        request.push_str(&format!("Authorization: Bearer {token}\r\n"));
    }
    for (k, v) in headers {
        request.push_str(&format!("{k}: {v}\r\n"));
    }
    request.push_str("\r\n");
    request.push_str(&body);
    stream.write_all(request.as_bytes()).unwrap();
    let mut raw = Vec::new();
    let mut buf = [0u8; 16 * 1024];
    loop {
        let n = stream.read(&mut buf).unwrap();
        if n == 0 {
            break;
        }
        raw.extend_from_slice(&buf[..n]);
        seen(&raw);
    }
    let text = String::from_utf8_lossy(&raw).into_owned();
    let (head, rest) = text.split_once("\r\n\r\n").unwrap();
    let status: u16 = head.split_whitespace().nth(1).unwrap().parse().unwrap();
    let body = if head
        .to_ascii_lowercase()
        .contains("transfer-encoding: chunked")
    {
        dechunk(rest)
    } else {
        rest.to_owned()
    };
    (status, body)
}

fn dechunk(mut rest: &str) -> String {
    let mut out = String::new();
    while let Some((size, tail)) = rest.split_once("\r\n") {
        let Ok(n) = usize::from_str_radix(size.trim(), 16) else {
            break;
        };
        if n == 0 {
            break;
        }
        out.push_str(&tail[..n]);
        rest = &tail[n + 2..];
    }
    out
}

#[test]
fn http_tokens_ownership_idempotency_and_exec_as_server_sent_events() {
    if !enabled() {
        return;
    }
    let worker = Worker::start(&fixed(2), true);
    let addr = worker.http.clone().unwrap();
    let token = |role: &str| {
        worker.cli(&["token", "create", "--role", role]).json["secret"]
            .as_str()
            .unwrap()
            .to_owned()
    };
    let (alice, bob, join) = (token("agent"), token("agent"), token("worker"));

    assert_eq!(http(&addr, "GET", "/v1/healthz", None, &[], None).0, 200);
    assert_eq!(http(&addr, "GET", "/v1/status", None, &[], None).0, 401);
    assert_eq!(
        http(&addr, "GET", "/v1/status", Some("slk_unknown"), &[], None).0,
        401
    );
    assert_eq!(
        http(&addr, "GET", "/v1/status", Some(&join), &[], None).0,
        403
    );

    let request = json!({"platform": "ios"});
    let (status, body) = http(
        &addr,
        "POST",
        "/v1/lease-requests",
        Some(&alice),
        &[("Idempotency-Key", "k1")],
        Some(&request),
    );
    assert_eq!(status, 201, "{body}");
    let created: Value = serde_json::from_str(&body).unwrap();
    let id = created["request"]["id"].as_str().unwrap().to_owned();
    let (_, body) = http(
        &addr,
        "GET",
        &format!("/v1/lease-requests/{id}?wait=30"),
        Some(&alice),
        &[],
        None,
    );
    let settled: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(settled["request"]["state"], "granted", "{settled}");
    let lease_id = settled["request"]["lease"]["lease"]["id"]
        .as_str()
        .unwrap()
        .to_owned();
    // An idempotent retry returns the same grant.
    let (status, body) = http(
        &addr,
        "POST",
        "/v1/lease-requests",
        Some(&alice),
        &[("Idempotency-Key", "k1")],
        Some(&request),
    );
    assert_eq!(status, 201, "{body}");
    let retry: Value = serde_json::from_str(&body).unwrap();
    let retry_id = retry["request"]["id"].as_str().unwrap();
    let (_, body) = http(
        &addr,
        "GET",
        &format!("/v1/lease-requests/{retry_id}?wait=30"),
        Some(&alice),
        &[],
        None,
    );
    let retried: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(
        retried["request"]["lease"]["lease"]["id"],
        lease_id.as_str(),
        "the same grant"
    );

    // Operators read metrics; agents cannot.
    let operator = token("operator");
    let (status, metrics) = http(&addr, "GET", "/v1/metrics", Some(&operator), &[], None);
    assert_eq!(status, 200);
    assert!(metrics.contains("simlock_leases 1\n"), "{metrics}");
    assert!(
        metrics.contains("simlock_devices{state=\"leased\"} 1\n"),
        "{metrics}"
    );
    assert_eq!(
        http(&addr, "GET", "/v1/metrics", Some(&alice), &[], None).0,
        403
    );

    // Another token's lease is invisible.
    assert_eq!(
        http(
            &addr,
            "GET",
            &format!("/v1/leases/{lease_id}"),
            Some(&bob),
            &[],
            None
        )
        .0,
        404
    );
    assert_eq!(
        http(
            &addr,
            "POST",
            &format!("/v1/leases/{lease_id}/renew"),
            Some(&bob),
            &[],
            Some(&json!({}))
        )
        .0,
        404
    );
    assert_eq!(
        http(
            &addr,
            "GET",
            &format!("/v1/leases/{lease_id}"),
            Some(&alice),
            &[],
            None
        )
        .0,
        200
    );

    // exec streams as server-sent events to its end.
    let exec = json!({"tool": "echo", "args": ["hello", "over", "http"]});
    let (status, body) = http(
        &addr,
        "POST",
        &format!("/v1/leases/{lease_id}/exec"),
        Some(&alice),
        &[],
        Some(&exec),
    );
    assert_eq!(status, 200, "{body}");
    assert!(
        body.contains(
            "event: output\ndata: {\"chunk\":\"hello over http\\n\",\"stream\":\"stdout\"}"
        ),
        "{body}"
    );
    assert!(
        body.trim_end()
            .ends_with("event: exit\ndata: {\"exitCode\":0}"),
        "{body}"
    );
    let (status, body) = http(
        &addr,
        "POST",
        &format!("/v1/leases/{lease_id}/exec"),
        Some(&alice),
        &[],
        Some(&json!({"tool": "rm", "args": []})),
    );
    assert_eq!(status, 422, "a pre-spawn refusal answers as JSON: {body}");
    assert_eq!(
        http(
            &addr,
            "DELETE",
            &format!("/v1/leases/{lease_id}"),
            Some(&alice),
            &[],
            None
        )
        .0,
        200
    );
}

#[test]
fn http_lease_requests_stream_their_states_and_can_be_cancelled() {
    if !enabled() {
        return;
    }
    let worker = Worker::start(&fixed(1), true);
    let addr = worker.http.clone().unwrap();
    let token = |role: &str| {
        worker.cli(&["token", "create", "--role", role]).json["secret"]
            .as_str()
            .unwrap()
            .to_owned()
    };
    let (alice, bob, carol) = (token("agent"), token("agent"), token("agent"));
    let request = json!({"platform": "ios"});
    let lease = |who: &str| {
        let (status, body) = http(
            &addr,
            "POST",
            "/v1/lease-requests",
            Some(who),
            &[],
            Some(&request),
        );
        assert_eq!(status, 201, "{body}");
        serde_json::from_str::<Value>(&body).unwrap()["request"].clone()
    };
    let held = lease(&alice);
    let (_, body) = http(
        &addr,
        "GET",
        &format!(
            "/v1/lease-requests/{}?wait=30",
            held["id"].as_str().unwrap()
        ),
        Some(&alice),
        &[],
        None,
    );
    let held: Value = serde_json::from_str(&body).unwrap();
    let alice_lease = held["request"]["lease"]["lease"]["id"]
        .as_str()
        .unwrap()
        .to_owned();

    let queued = lease(&bob);
    assert_eq!(queued["state"], "queued");
    assert_eq!(queued["queuePosition"], 1);
    let bob_id = queued["id"].as_str().unwrap().to_owned();
    // Another token cannot see it; an unknown id is 404.
    assert_eq!(
        http(
            &addr,
            "GET",
            &format!("/v1/lease-requests/{bob_id}"),
            Some(&carol),
            &[],
            None
        )
        .0,
        403
    );
    assert_eq!(
        http(
            &addr,
            "GET",
            "/v1/lease-requests/req_nope",
            Some(&bob),
            &[],
            None
        )
        .0,
        404
    );
    let (queued_seen, queued_event) = std::sync::mpsc::channel();
    let stream = {
        let (addr, bob, bob_id) = (addr.clone(), bob.clone(), bob_id.clone());
        std::thread::spawn(move || {
            http_watching(
                &addr,
                "GET",
                &format!("/v1/lease-requests/{bob_id}/events"),
                Some(&bob),
                &[],
                None,
                |raw| {
                    let queued = b"event: queued";
                    if raw.windows(queued.len()).any(|w| w == queued) {
                        let _ = queued_seen.send(());
                    }
                },
            )
        })
    };
    // The stream shows bob queued before anything changes his request.
    queued_event
        .recv_timeout(PATIENCE)
        .expect("the stream's first event, queued");
    let carols = lease(&carol);
    assert_eq!(carols["state"], "queued");
    let carol_id = carols["id"].as_str().unwrap().to_owned();
    assert_eq!(
        http(
            &addr,
            "DELETE",
            &format!("/v1/lease-requests/{carol_id}"),
            Some(&carol),
            &[],
            None
        )
        .0,
        204
    );
    let (_, body) = http(
        &addr,
        "GET",
        &format!("/v1/lease-requests/{carol_id}"),
        Some(&carol),
        &[],
        None,
    );
    assert_eq!(
        serde_json::from_str::<Value>(&body).unwrap()["request"]["state"],
        "cancelled"
    );

    assert_eq!(
        http(
            &addr,
            "DELETE",
            &format!("/v1/leases/{alice_lease}"),
            Some(&alice),
            &[],
            None
        )
        .0,
        200
    );
    let (status, events) = stream.join().unwrap();
    assert_eq!(status, 200);
    let names: Vec<&str> = events
        .lines()
        .filter_map(|l| l.strip_prefix("event: "))
        .collect();
    assert_eq!(names.first(), Some(&"queued"), "{events}");
    assert_eq!(
        names.last(),
        Some(&"granted"),
        "the stream ends at the grant: {events}"
    );
    // A granted request cannot be cancelled; its lease must be released instead.
    let (status, body) = http(
        &addr,
        "DELETE",
        &format!("/v1/lease-requests/{bob_id}"),
        Some(&bob),
        &[],
        None,
    );
    assert_eq!(status, 409, "{body}");
    assert!(body.contains("REQUEST_NOT_CANCELLABLE"));
}
