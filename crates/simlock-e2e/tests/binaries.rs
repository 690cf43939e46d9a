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
use simlock_e2e::agent_device::{Carried, rpc_answer, stopping_message};
use simlock_test_support::markdown::workspace_file;

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
        let (child, ready) = spawn_ready(&mut command, "worker");
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

    /// Stops the worker with SIGTERM (bounded) and hands back its home.
    fn terminate(mut self) -> tempfile::TempDir {
        send_signal(self.child.id(), "-TERM");
        assert!(
            wait_exit(&mut self.child).is_some_and(|s| s.success()),
            "the worker stopped"
        );
        let home = tempfile::TempDir::new().unwrap();
        std::mem::replace(&mut self.home, home)
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

/// Starts a daemon whose stdout is piped and reads its JSON ready line (bounded); the reader
/// thread ends with the process.
fn spawn_ready(command: &mut Command, role: &str) -> (Child, Value) {
    let mut child = command.spawn().unwrap();
    let stdout = child.stdout.take().unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let mut lines = BufReader::new(stdout).lines();
        if let Some(Ok(line)) = lines.next() {
            let _ = tx.send(line);
        }
        for _ in lines {}
    });
    let Ok(line) = rx.recv_timeout(PATIENCE) else {
        let _ = child.kill();
        let _ = child.wait();
        panic!("the {role} printed no ready line within {PATIENCE:?}");
    };
    let ready: Value = serde_json::from_str(&line).unwrap();
    assert_eq!(ready["ready"], role, "{line}");
    (child, ready)
}

struct Cli {
    code: i32,
    json: Value,
    stderr: String,
}

fn run_cli(home: &Path, args: &[&str], env: &[(&str, &str)]) -> Cli {
    let json: Vec<&str> = std::iter::once("--json")
        .chain(args.iter().copied())
        .collect();
    cli_result(&cli_output(home, &json, env))
}

/// Runs the CLI against the daemon whose home is `home` (bounded), with nothing from the
/// test's environment but `env`.
fn cli_output(home: &Path, args: &[&str], env: &[(&str, &str)]) -> Output {
    cli_output_into(home, args, env, Stdio::piped())
}

/// [`cli_output`] with its stdout going into `stdout`.
fn cli_output_into(home: &Path, args: &[&str], env: &[(&str, &str)], stdout: Stdio) -> Output {
    let mut command = Command::new(bin("simlock"));
    command
        .env("SIMLOCK_HOME", home)
        .env_remove("SIMLOCK_URL")
        .env_remove("SIMLOCK_TOKEN")
        .env_remove("SIMLOCK_AGENT_ID")
        .args(args);
    for (k, v) in env {
        command.env(k, v);
    }
    wait_bounded(
        command
            .stdin(Stdio::null())
            .stdout(stdout)
            .stderr(Stdio::piped())
            .spawn()
            .unwrap(),
    )
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

/// Outside trial 21 (ADR 0036): past `lease.maxWaiting` waiting requests, one more that would
/// wait exits 11 at once saying the queue is full; the waiting one is untouched.
#[test]
fn a_request_past_a_full_queue_exits_11_saying_so() {
    if !enabled() {
        return;
    }
    let worker = Worker::start(&format!("{}[lease]\nmaxWaiting = 1\n", fixed(1)), false);
    let first = detached(&worker, "first");
    let mut waiting = leasing(on_socket(worker.home.path()), "waiting", &[]);
    wait_until(&worker, "the request waits", |status| {
        waiting_requesters(status) == ["waiting"]
    });
    let refused = worker.cli(&[
        "lease",
        "--platform",
        "ios",
        "--detach",
        "--requester",
        "late",
    ]);
    assert_eq!(refused.code, 11, "{}", refused.stderr);
    assert_eq!(refused.json["error"]["code"], "NO_CAPACITY");
    assert!(
        refused
            .stderr
            .contains("the queue is full (it holds at most 1 waiting requests"),
        "{}",
        refused.stderr
    );
    assert_eq!(
        waiting_requesters(&worker.cli(&["status"]).json),
        ["waiting"]
    );
    worker.cli(&["release", &first]);
    send_signal(waiting.id(), "-TERM");
    wait_exit(&mut waiting);
}

/// Outside trial 21: a `simlock lease` killed with SIGKILL while it waits leaves its request
/// queued (a closed connection ends nothing it started); `simlock cancel` withdraws it, so the
/// next device does not go to nobody.
#[test]
fn simlock_cancel_withdraws_the_waiting_request_of_a_killed_lease() {
    if !enabled() {
        return;
    }
    let (worker, first) = one_device_leased();
    let mut ghost = leasing(on_socket(worker.home.path()), "ghost", &[]);
    wait_until(&worker, "the request waits", |status| {
        waiting_requesters(status) == ["ghost"]
    });
    send_signal(ghost.id(), "-KILL");
    wait_exit(&mut ghost);
    assert_eq!(
        waiting_requesters(&worker.cli(&["status"]).json),
        ["ghost"],
        "killed, it still waits"
    );
    let cancelled = worker.cli(&["cancel", "--requester", "ghost"]);
    assert_eq!(cancelled.code, 0, "{}", cancelled.stderr);
    assert_eq!(cancelled.json["result"], "cancelled");
    assert!(waiting_requesters(&worker.cli(&["status"]).json).is_empty());
    let again = run_cli_human(worker.home.path(), &["cancel", "--requester", "ghost"]);
    assert_eq!(
        again,
        (0, "ghost has no waiting lease request\n".to_owned())
    );
    worker.cli(&["release", &first]);
    let next = detached(&worker, "next");
    assert!(
        !next.is_empty(),
        "the freed device went to the next request"
    );
    worker.terminate();
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

/// A hang-up (the terminal the daemon was started from closed) stops it as SIGTERM does: exit
/// 0, its socket and admin token removed. Before, the default action killed it on the spot.
#[test]
fn a_daemon_sent_sighup_stops_cleanly() {
    if !enabled() {
        return;
    }
    let mut worker = Worker::start(&fixed(1), false);
    let socket = worker.home.path().join("daemon.sock");
    assert!(socket.exists());
    send_signal(worker.child.id(), "-HUP");
    let exited = wait_exit(&mut worker.child);
    assert!(
        exited.is_some_and(|s| s.success()),
        "the worker stopped cleanly: {exited:?}"
    );
    assert!(!socket.exists(), "its socket was removed");
    assert!(!worker.home.path().join("admin.token").exists());
}

/// Trial 19: a daemon whose output cannot be written (its log on a full disk, here `/dev/full`;
/// its ready line into a pipe nobody reads) serves, leases and stops as any other: what cannot
/// be written is dropped. Before, the first log line it could not write panicked the thread
/// that logged it (that call never answered; at start, the daemon exited 101), and so did a
/// ready line nobody could read.
#[test]
fn a_daemon_whose_output_cannot_be_written_serves_and_stops_cleanly() {
    if !enabled() {
        return;
    }
    for ready_line_read in [true, false] {
        let home = tempfile::tempdir().unwrap();
        std::fs::write(home.path().join("config.toml"), fixed(1)).unwrap();
        let full = std::fs::OpenOptions::new()
            .write(true)
            .open("/dev/full")
            .unwrap();
        let mut command = Command::new(bin("simlock-worker"));
        command
            .arg("--home")
            .arg(home.path())
            .args(["--set", "drivers.ios.driver=virtual"])
            .args(["--set", "drivers.android.driver=virtual"])
            // Every call logs.
            .env("SIMLOCK_LOG", "debug")
            .stdout(Stdio::piped())
            .stderr(full);
        let child = if ready_line_read {
            spawn_ready(&mut command, "worker").0
        } else {
            let mut child = command.spawn().unwrap();
            drop(child.stdout.take());
            child
        };
        let worker = Worker {
            child,
            home,
            http: None,
        };
        wait_until(&worker, "the worker serves", |status| {
            status["daemon"]["health"] == "running"
        });
        for _ in 0..5 {
            let status = worker.cli(&["status"]);
            assert_eq!(status.code, 0, "{}", status.stderr);
        }
        let lease = detached(&worker, "a");
        let released = worker.cli(&["release", &lease]);
        assert_eq!(released.code, 0, "{}", released.stderr);
        worker.terminate();
    }
}

/// Trial 20: a daemon whose standard error nobody reads (a pipe whose reader stalls: a stuck
/// journal, a paused pager) serves on; its log lines past what the pipe and its queue hold are
/// dropped. Before, the first log line the full pipe refused blocked the thread that wrote it,
/// and then every call.
#[test]
fn a_daemon_whose_log_nobody_reads_serves_on_and_stops() {
    if !enabled() {
        return;
    }
    let home = tempfile::tempdir().unwrap();
    std::fs::write(home.path().join("config.toml"), fixed(1)).unwrap();
    let (unread, stalled) = rustix::pipe::pipe().unwrap();
    // The smallest pipe: a few calls' worth of log fills it.
    rustix::pipe::fcntl_setpipe_size(&stalled, 4096).unwrap();
    let mut command = Command::new(bin("simlock-worker"));
    command
        .arg("--home")
        .arg(home.path())
        .args(["--set", "drivers.ios.driver=virtual"])
        .args(["--set", "drivers.android.driver=virtual"])
        .env("SIMLOCK_LOG", "debug")
        .stdout(Stdio::piped())
        .stderr(Stdio::from(stalled));
    let (child, _) = spawn_ready(&mut command, "worker");
    let worker = Worker {
        child,
        home,
        http: None,
    };
    for _ in 0..60 {
        let status = worker.cli(&["status"]);
        assert_eq!(status.code, 0, "{}", status.stderr);
    }
    let lease = detached(&worker, "a");
    let released = worker.cli(&["release", &lease]);
    assert_eq!(released.code, 0, "{}", released.stderr);
    worker.terminate();
    drop(unread);
}

/// Trial 20: a CLI whose result cannot be written (stdout on a full disk, here `/dev/full`)
/// exits 1 saying so, not 0; a lease granted with `--detach` whose grant it could not write is
/// given back (nobody was told its id).
#[test]
fn a_cli_whose_result_cannot_be_written_exits_1_and_gives_back_an_unreported_grant() {
    if !enabled() {
        return;
    }
    let worker = Worker::start(&fixed(1), false);
    let to_full = |args: &[&str]| {
        let full = std::fs::OpenOptions::new()
            .write(true)
            .open("/dev/full")
            .unwrap();
        cli_output_into(worker.home.path(), args, &[], Stdio::from(full))
    };
    let status = to_full(&["status"]);
    assert_eq!(status.status.code(), Some(1), "{status:?}");
    let said = String::from_utf8_lossy(&status.stderr);
    assert!(
        said.contains("the result could not be written to standard output"),
        "{said}"
    );
    for json in [false, true] {
        let mut args = vec!["lease", "--platform", "ios", "--detach", "--requester", "a"];
        if json {
            args.insert(0, "--json");
        }
        let leased = to_full(&args);
        assert_eq!(leased.status.code(), Some(1), "{leased:?}");
        let said = String::from_utf8_lossy(&leased.stderr);
        assert!(
            said.contains("was granted, but its grant could not be written; it was released"),
            "{said}"
        );
        let held = worker.cli(&["leases", "--all"]);
        assert_eq!(held.json["leases"], json!([]), "{}", held.json);
    }
    // `env` and `exec` too: their output lost is a failure, said on stderr.
    let lease = detached(&worker, "env");
    for (args, what) in [
        (vec!["env", lease.as_str()], "the result"),
        (
            vec!["exec", lease.as_str(), "echo", "hi"],
            "the tool's output",
        ),
        (
            vec!["--json", "exec", lease.as_str(), "echo", "hi"],
            "the tool's output",
        ),
    ] {
        let lost = to_full(&args);
        assert_eq!(lost.status.code(), Some(1), "{args:?}: {lost:?}");
        let said = String::from_utf8_lossy(&lost.stderr);
        assert!(
            said.contains(&format!("{what} could not be written to standard output")),
            "{args:?}: {said}"
        );
    }
    worker.cli(&["release", &lease]);
    // A reader that went away (`| head`): nobody is owed a status, so no failure; a grant
    // nobody read is given back all the same.
    let to_closed = |args: &[&str]| {
        let (reader, writer) = rustix::pipe::pipe().unwrap();
        drop(reader);
        cli_output_into(worker.home.path(), args, &[], Stdio::from(writer))
    };
    let status = to_closed(&["status"]);
    assert_eq!(status.status.code(), Some(0), "{status:?}");
    let lease = detached(&worker, "exec");
    // exec's tool outcome is not known then: it exits as a program SIGPIPE killed would.
    let exec = to_closed(&["exec", &lease, "echo", "hi"]);
    assert_eq!(exec.status.code(), Some(141), "{exec:?}");
    assert!(exec.stderr.is_empty(), "{exec:?}");
    worker.cli(&["release", &lease]);
    let leased = to_closed(&["lease", "--platform", "ios", "--detach", "--requester", "b"]);
    assert_eq!(leased.status.code(), Some(1), "{leased:?}");
    let held = worker.cli(&["leases", "--all"]);
    assert_eq!(held.json["leases"], json!([]), "{}", held.json);
    worker.terminate();
}

/// A hold whose stderr cannot be written (a full disk, here `/dev/full`, or a reader that went
/// away) waits in the queue, is granted, holds and releases on SIGTERM as any other: its
/// progress and notices are lost, never a panic that leaves the lease to its TTL. Before, its
/// first progress line panicked it (exit 101).
#[test]
fn a_hold_whose_stderr_cannot_be_written_waits_holds_and_releases() {
    if !enabled() {
        return;
    }
    let (worker, first) = one_device_leased();
    let full = || {
        Stdio::from(
            std::fs::OpenOptions::new()
                .write(true)
                .open("/dev/full")
                .unwrap(),
        )
    };
    let closed = || {
        let (reader, writer) = rustix::pipe::pipe().unwrap();
        drop(reader);
        Stdio::from(writer)
    };
    let mut previous = first;
    for (requester, stderr) in [("full", full()), ("closed", closed())] {
        let mut hold = leasing_into(on_socket(worker.home.path()), requester, &[], stderr);
        wait_until(&worker, "the hold waits in the queue", |status| {
            waiting_requesters(status).contains(&requester.to_owned())
        });
        worker.cli(&["release", &previous]);
        let stdout = hold.stdout.take().unwrap();
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let mut line = String::new();
            let _ = BufReader::new(stdout).read_line(&mut line);
            let _ = tx.send(line);
        });
        let line = rx
            .recv_timeout(PATIENCE)
            .expect("the grant, once the device is free");
        let grant: Value = serde_json::from_str(&line).expect(&line);
        let lease = grant["lease"]["id"].as_str().unwrap().to_owned();
        assert!(hold.try_wait().unwrap().is_none(), "the hold holds");
        send_signal(hold.id(), "-TERM");
        let exited = wait_exit(&mut hold);
        assert!(
            exited.is_some_and(|s| s.success()),
            "{requester}: {exited:?}"
        );
        let leases = worker.cli(&["leases", "--all"]).json.to_string();
        assert!(!leases.contains(&lease), "released: {leases}");
        previous = detached(&worker, &format!("{requester}-next"));
    }
    worker.terminate();
}

/// `worker`'s store fails under it, as on a full disk: its lease table is gone.
fn fail_store(worker: &Worker) {
    let db = simlock_daemon::store::Database::open(&worker.home.path().join("state.db")).unwrap();
    db.with(|c| c.execute_batch("DROP TABLE core_leases"))
        .unwrap();
}

/// Trial 19: a worker whose store fails under it (a full disk; here its lease table dropped)
/// stops deciding: a lease request answers `INTERNAL` naming the store (exit 1), its status
/// says `failed`, and `leases --all` on it still lists what it holds, without the note a
/// gateway adds for workers it has not read.
#[test]
fn a_worker_whose_store_fails_refuses_decisions_and_says_so() {
    if !enabled() {
        return;
    }
    let worker = Worker::start(&fixed(2), false);
    let lease = detached(&worker, "a");
    fail_store(&worker);
    let refused = worker.cli(&["lease", "--platform", "ios", "--detach", "--requester", "b"]);
    assert_eq!(refused.code, 1, "{}", refused.stderr);
    assert!(
        refused.stderr.contains("state store failed") && refused.stderr.contains("(INTERNAL)"),
        "{}",
        refused.stderr
    );
    let status = worker.cli(&["status"]);
    assert_eq!(status.json["daemon"]["health"], "failed", "{}", status.json);
    let listed = cli_output(worker.home.path(), &["leases", "--all"], &[]);
    let listed = String::from_utf8_lossy(&listed.stdout);
    assert!(listed.contains(&lease), "{listed}");
    assert!(!listed.contains("not listed"), "{listed}");
    worker.terminate();
}

/// Trial 20: a held lease whose renewals fail (its worker's store failed) says so on stderr
/// as they start failing, as a JSON line when stderr is a program's, and keeps trying until the
/// TTL, then exits 1.
#[test]
fn a_hold_whose_renewals_fail_says_so_as_json_and_tries_until_the_ttl() {
    if !enabled() {
        return;
    }
    let worker = Worker::start(&fixed(1), false);
    let (mut hold, lease) = hold(&worker, "a", &["--ttl", "1500"]);
    fail_store(&worker);
    let exited = wait_exit(&mut hold);
    assert_eq!(exited.and_then(|s| s.code()), Some(1), "{exited:?}");
    let said = stderr_of(&mut hold);
    let retrying = said
        .lines()
        .filter_map(|line| serde_json::from_str::<Value>(line).ok())
        .find(|line| line["renewal"]["state"] == "retrying")
        .unwrap_or_else(|| panic!("no renewal line: {said}"));
    assert_eq!(retrying["renewal"]["leaseId"], lease.as_str(), "{retrying}");
    assert_eq!(
        retrying["renewal"]["error"]["code"], "INTERNAL",
        "{retrying}"
    );
    assert!(said.contains("could not be renewed"), "{said}");
    worker.terminate();
}

/// `--home` names the daemon's home as the daemon's own flag does, over `$SIMLOCK_HOME`; a home
/// with no daemon says where it looked.
#[test]
fn the_cli_reaches_the_daemon_whose_home_it_is_given() {
    if !enabled() {
        return;
    }
    let worker = Worker::start(&fixed(1), false);
    let elsewhere = tempfile::tempdir().unwrap();
    let home = worker.home.path().to_str().unwrap();
    let status = run_cli(elsewhere.path(), &["--home", home, "status"], &[]);
    assert_eq!(status.code, 0, "{}", status.stderr);
    assert_eq!(status.json["daemon"]["mode"], "worker", "{}", status.json);
    let held = run_cli(
        elsewhere.path(),
        &["--home", home, "lease", "--platform", "ios", "--detach"],
        &[],
    );
    assert_eq!(held.code, 0, "{}", held.stderr);
    let released = run_cli(elsewhere.path(), &["--home", home, "release", "--all"], &[]);
    assert_eq!(
        released.code, 0,
        "an admin command reads the home's admin secret: {}",
        released.stderr
    );
    let nowhere = run_cli(
        worker.home.path(),
        &["--home", elsewhere.path().to_str().unwrap(), "status"],
        &[],
    );
    assert_eq!(nowhere.code, 1, "{}", nowhere.stderr);
    assert!(
        nowhere
            .stderr
            .contains(&elsewhere.path().display().to_string()),
        "{}",
        nowhere.stderr
    );
}

/// Sends `signal` (`-TERM`, `-HUP`, …) to process `pid`.
fn send_signal(pid: u32, signal: &str) {
    let status = Command::new("kill")
        .arg(signal)
        .arg(pid.to_string())
        .status()
        .unwrap();
    assert!(status.success(), "kill {signal} {pid}");
}

/// `simlock --json lease --platform ios --requester <requester> <extra>` holding on `worker`'s
/// socket, and the id of the lease it printed (read within [`PATIENCE`]).
fn hold(worker: &Worker, requester: &str, extra: &[&str]) -> (Child, String) {
    held(on_socket(worker.home.path()), requester, extra)
}

/// `simlock` on the socket of the daemon whose home is `home`, with no connection settings
/// inherited.
fn on_socket(home: &Path) -> Command {
    let mut command = Command::new(bin("simlock"));
    command
        .env("SIMLOCK_HOME", home)
        .env_remove("SIMLOCK_URL")
        .env_remove("SIMLOCK_TOKEN");
    command
}

/// Runs `simlock [connection…] --json lease --platform ios --requester <requester> <extra>…`
/// as `command` sets it up, until its grant is printed: the holding process and the lease id.
fn held(command: Command, requester: &str, extra: &[&str]) -> (Child, String) {
    held_into(command, requester, extra, Stdio::piped())
}

/// As [`held`], its stderr going to `stderr`.
fn held_into(command: Command, requester: &str, extra: &[&str], stderr: Stdio) -> (Child, String) {
    let mut hold = leasing_into(command, requester, extra, stderr);
    let stdout = hold.stdout.take().unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            let _ = tx.send(line);
        }
    });
    let grant: Value = serde_json::from_str(&rx.recv_timeout(PATIENCE).unwrap()).unwrap();
    let lease = grant["lease"]["id"].as_str().unwrap().to_owned();
    (hold, lease)
}

/// `simlock [connection…] --json lease --platform ios --requester <requester> <extra>…` started
/// as `command` sets it up, its output piped.
fn leasing(command: Command, requester: &str, extra: &[&str]) -> Child {
    leasing_into(command, requester, extra, Stdio::piped())
}

/// As [`leasing`], its stderr going to `stderr`.
fn leasing_into(mut command: Command, requester: &str, extra: &[&str], stderr: Stdio) -> Child {
    command
        .args([
            "--json",
            "lease",
            "--platform",
            "ios",
            "--requester",
            requester,
        ])
        .args(extra)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(stderr)
        .spawn()
        .unwrap()
}

/// A worker with one device, leased (`--detach`) by requester `first`: the worker and the lease.
fn one_device_leased() -> (Worker, String) {
    let worker = Worker::start(&fixed(1), false);
    let lease = detached(&worker, "first");
    (worker, lease)
}

/// An iOS lease for `requester`, granted with `--detach`: its id.
fn detached(worker: &Worker, requester: &str) -> String {
    let leased = worker.cli(&[
        "lease",
        "--platform",
        "ios",
        "--detach",
        "--requester",
        requester,
    ]);
    assert_eq!(leased.code, 0, "{}", leased.stderr);
    leased.json["lease"]["id"].as_str().unwrap().to_owned()
}

/// What a finished hold wrote on stderr.
fn stderr_of(hold: &mut Child) -> String {
    let mut stderr = String::new();
    if let Some(mut pipe) = hold.stderr.take() {
        let _ = pipe.read_to_string(&mut stderr);
    }
    stderr
}

/// `simlock lease` holding a lease on the socket keeps it across a restart of its daemon: it
/// connects again and renews the lease the daemon kept, and a SIGTERM then releases it. Before,
/// the hold exited with DAEMON_CONNECTION_LOST and left the lease to its TTL.
#[test]
fn a_socket_hold_keeps_its_lease_across_a_daemon_restart_and_releases_it_on_sigterm() {
    if !enabled() {
        return;
    }
    let worker = Worker::start(&fixed(1), false);
    let (mut hold, lease) = hold(&worker, "holder", &["--ttl", "3000"]);
    let deadline_of = |status: &Value| {
        status["leases"].as_array().and_then(|leases| {
            leases
                .iter()
                .find(|l| l["id"] == lease.as_str())
                .and_then(|l| l["ttlDeadline"].as_i64())
        })
    };
    let home = worker.terminate();
    let worker = Worker::start_in(home, false);
    let kept = deadline_of(&worker.cli(&["status"]).json).expect("the daemon kept the lease");
    wait_until(
        &worker,
        "the hold renews the lease after the restart",
        |status| deadline_of(status).is_some_and(|d| d > kept),
    );
    assert!(hold.try_wait().unwrap().is_none(), "the hold still runs");
    send_signal(hold.id(), "-TERM");
    let exited = wait_exit(&mut hold);
    let stderr = stderr_of(&mut hold);
    assert!(exited.is_some_and(|s| s.success()), "{exited:?}: {stderr}");
    assert_eq!(deadline_of(&worker.cli(&["status"]).json), None, "released");
}

/// A `simlock lease` waiting in the queue when its daemon restarts asks the next daemon on the
/// home again (a restart ends the waiting requests) and is granted once a device frees. Before,
/// it exited with DAEMON_CONNECTION_LOST.
#[test]
fn a_waiting_lease_asks_again_after_a_daemon_restart_and_is_granted() {
    if !enabled() {
        return;
    }
    let (worker, first_id) = one_device_leased();
    let home = worker.home.path().to_owned();
    let waiter = std::thread::spawn(move || held(on_socket(&home), "second", &[]));
    wait_until(&worker, "the second request waits", |status| {
        waiting_requesters(status) == ["second"]
    });
    let home = worker.terminate();
    let worker = Worker::start_in(home, false);
    wait_until(&worker, "the second request waits again", |status| {
        waiting_requesters(status) == ["second"]
    });
    let released = worker.cli(&["release", &first_id]);
    assert_eq!(released.code, 0, "{}", released.stderr);
    let (mut hold, lease) = waiter.join().unwrap();
    let leases = worker.cli(&["leases", "--all"]).json.to_string();
    assert!(leases.contains(&lease), "{leases}");
    send_signal(hold.id(), "-TERM");
    let exited = wait_exit(&mut hold);
    let stderr = stderr_of(&mut hold);
    assert!(exited.is_some_and(|s| s.success()), "{exited:?}: {stderr}");
    // Its progress: queued, queued again on the next daemon, then the freed device.
    let queued = stderr.matches("\"stage\":\"queued\"").count();
    assert!(queued >= 2, "{stderr}");
}

/// A `simlock lease` that waits for its daemon to come back (its request ended with the daemon)
/// and is then interrupted says so and exits 130, as an interrupt in the queue does.
#[test]
fn a_waiting_lease_interrupted_while_its_daemon_is_down_exits_130() {
    if !enabled() {
        return;
    }
    let (worker, _) = one_device_leased();
    let mut waiter = leasing(on_socket(worker.home.path()), "second", &[]);
    wait_until(&worker, "the second request waits", |status| {
        waiting_requesters(status) == ["second"]
    });
    // Stopped, the daemon ends the waiting request; the CLI waits for the next one on its home
    // (or is just finding out the connection ended: either way, the interrupt ends it).
    let _home = worker.terminate();
    send_signal(waiter.id(), "-INT");
    let exited = wait_exit(&mut waiter);
    let said = stderr_of(&mut waiter);
    assert_eq!(exited.and_then(|s| s.code()), Some(130), "{said}");
    assert!(
        said.contains("simlock: interrupted; the request was withdrawn (CANCELLED)"),
        "{said}"
    );
}

/// A socket hold whose daemon does not come back stops trying once the lease's TTL has passed
/// (the lease is gone by then whatever happens), exiting as a connection failure: connecting
/// again is bounded.
#[test]
fn a_socket_hold_whose_daemon_stays_down_gives_up_after_the_leases_ttl() {
    if !enabled() {
        return;
    }
    let worker = Worker::start(&fixed(1), false);
    let (mut hold, _) = hold(&worker, "stranded", &["--ttl", "2000"]);
    let _home = worker.kill9();
    let exited = wait_exit(&mut hold);
    let stderr = stderr_of(&mut hold);
    assert_eq!(
        exited.and_then(|s| s.code()),
        Some(1),
        "a connection failure's exit: {stderr}"
    );
    assert!(stderr.contains("DAEMON_CONNECTION_LOST"), "{stderr}");
}

/// Closing the terminal a hold runs in (SIGHUP) releases its lease, as Ctrl-C does. Before,
/// the default action killed the CLI and left the lease to its TTL.
#[test]
fn a_hold_sent_sighup_releases_its_lease() {
    if !enabled() {
        return;
    }
    let worker = Worker::start(&fixed(1), false);
    let (mut hold, lease) = hold(&worker, "hangup", &[]);
    send_signal(hold.id(), "-HUP");
    let exited = wait_exit(&mut hold);
    assert!(exited.is_some_and(|s| s.success()), "{exited:?}");
    let leases = worker.cli(&["leases"]).json.to_string();
    assert!(!leases.contains(&lease), "released: {leases}");
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

/// On the socket, an operator's `--token` counts for every command, as over HTTP: the lease an
/// agent made over HTTP is listed, renewed and released. Without it, the socket's own agent
/// sees only its own leases. Before, the token was sent only with admin commands, so
/// `leases --token <operator>` listed nothing and `release <id>` answered UNKNOWN_LEASE.
#[test]
fn an_operator_token_on_the_socket_sees_and_acts_on_every_lease() {
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
    let (alice, operator) = (token("agent"), token("operator"));
    let (status, body) = http(
        &addr,
        "POST",
        "/v1/lease-requests",
        Some(&alice),
        &[],
        Some(&json!({"platform": "ios"})),
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
    let lease = settled["request"]["lease"]["lease"]["id"]
        .as_str()
        .unwrap()
        .to_owned();
    let listed = |args: &[&str]| worker.cli(args).json.to_string().contains(&lease);
    assert!(
        !listed(&["leases"]),
        "the socket's own agent sees only its own"
    );
    assert!(listed(&["leases", "--token", &operator]));
    assert!(listed(&["status", "--token", &operator]));
    let renewed = worker.cli(&["renew", &lease, "--token", &operator]);
    assert_eq!(renewed.code, 0, "{}", renewed.stderr);
    let released = worker.cli(&["release", &lease, "--token", &operator]);
    assert_eq!(released.code, 0, "{}", released.stderr);
    assert!(!listed(&["leases", "--token", &operator]), "released");
    // An agent's token is no credential on the socket: refused, saying what the socket takes.
    let refused = worker.cli(&["leases", "--token", &alice]);
    assert_ne!(refused.code, 0);
    assert!(
        refused.stderr.contains("operator token"),
        "{}",
        refused.stderr
    );
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
    let (alice, bob) = (token("agent"), token("agent"));
    // A join token is a gateway's to mint: a worker refuses it (exit 2, the role named) and
    // mints nothing. (A worker token's 403 on these routes is the daemon's HTTP test's.)
    let join = worker.cli(&["token", "create", "--role", "worker"]);
    assert_eq!(join.code, 2, "{}", join.stderr);
    assert!(
        join.stderr
            .contains("role: a worker token joins a worker to a gateway"),
        "{}",
        join.stderr
    );

    assert_eq!(http(&addr, "GET", "/v1/healthz", None, &[], None).0, 200);
    assert_eq!(http(&addr, "GET", "/v1/status", None, &[], None).0, 401);
    assert_eq!(
        http(&addr, "GET", "/v1/status", Some("slk_unknown"), &[], None).0,
        401
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

fn agent_device_pids(home: &Path) -> Vec<agent_device_host::process::Recorded> {
    let file = home
        .join("agent-device")
        .join(agent_device_host::process::PID_FILE);
    let Ok(text) = std::fs::read_to_string(file) else {
        return Vec::new();
    };
    let parsed: Value = serde_json::from_str(&text).unwrap_or(Value::Null);
    serde_json::from_value(parsed["processes"].clone()).unwrap_or_default()
}

/// Waits for `child` to exit, at most [`PATIENCE`].
#[allow(
    clippy::disallowed_methods,
    reason = "a bound on waiting for another process, not a timing assertion"
)]
fn wait_exit(child: &mut Child) -> Option<std::process::ExitStatus> {
    let deadline = std::time::Instant::now() + PATIENCE;
    loop {
        if let Some(status) = child.try_wait().unwrap() {
            return Some(status);
        }
        if std::time::Instant::now() > deadline {
            return None;
        }
        std::thread::yield_now();
    }
}

fn agent_device_available(status: &Value) -> bool {
    status["capabilities"].as_array().is_some_and(|caps| {
        caps.iter()
            .any(|c| c["name"] == "agent-device" && c["available"] == true)
    })
}

#[test]
fn no_agent_device_daemon_outlives_its_worker_stopped_or_killed_and_restarted() {
    if !enabled() {
        return;
    }
    let pkg = simlock_e2e::agent_device::real_package();
    let command: Vec<String> = simlock_e2e::agent_device::real_daemon_command(&pkg);
    let config = format!(
        "{}\n[agentDevice]\nenabled = true\ncommand = {}\n",
        fixed(1),
        serde_json::to_string(&command).unwrap()
    );
    let worker = Worker::start(&config, true);
    wait_until(
        &worker,
        "the agent-device daemon serves",
        agent_device_available,
    );
    let first = agent_device_pids(worker.home.path());
    assert!(!first.is_empty(), "the daemon's pid is recorded");
    // A kill -9 of the worker closes the pipe its daemon's watch holds: the daemon stops with
    // the worker, without waiting for the next start (which would stop a leftover too).
    let home = worker.kill9();
    poll("the daemon to stop with its killed worker", || {
        let left: Vec<_> = first
            .iter()
            .filter(|pid| agent_device_host::process::is_alive(pid))
            .collect();
        if left.is_empty() {
            Ok(())
        } else {
            Err(format!("{left:?} still run"))
        }
    });
    let worker = Worker::start_in(home, true);
    wait_until(
        &worker,
        "the agent-device daemon serves again",
        agent_device_available,
    );
    let second = agent_device_pids(worker.home.path());
    assert!(!second.is_empty() && second != first);
    // A graceful stop stops the daemon too.
    let mut worker = worker;
    let status = Command::new("kill")
        .arg("-TERM")
        .arg(worker.child.id().to_string())
        .status()
        .unwrap();
    assert!(status.success());
    let exited = wait_exit(&mut worker.child);
    assert!(
        exited.is_some_and(|s| s.success()),
        "the worker stopped: {exited:?}"
    );
    for pid in &second {
        assert!(
            !agent_device_host::process::is_alive(pid),
            "{pid:?} survived the stop"
        );
    }
    assert!(
        agent_device_pids(worker.home.path()).is_empty(),
        "nothing is left recorded"
    );
}

/// A worker killed with SIGKILL and started again spawns its agent-device daemon anew, which
/// holds none of the earlier leases: their simlock leases end at start-up, their devices free
/// for the queue at once (not at the end of their TTL, however the agent goes on), and the
/// owner's next call on the old lease says it ended.
#[test]
fn a_restarted_worker_ends_the_simlock_leases_of_its_earlier_agent_device_daemon_at_once() {
    if !enabled() {
        return;
    }
    let fake = bin("agent-device-fake").display().to_string();
    let config = format!(
        "{}\n[agentDevice]\nenabled = true\ncommand = {}\n",
        fixed(1),
        serde_json::to_string(&[fake]).unwrap()
    );
    let worker = Worker::start(&config, true);
    wait_until(
        &worker,
        "the agent-device daemon serves",
        agent_device_available,
    );
    let token = |worker: &Worker, role: &str| {
        worker.cli(&["token", "create", "--role", role]).json["secret"]
            .as_str()
            .unwrap()
            .to_owned()
    };
    let (alice, operator) = (token(&worker, "agent"), token(&worker, "operator"));
    let addr = worker.http.clone().unwrap();
    let lease = ad_allocate(&addr, &alice);
    let leases = |worker: &Worker| {
        let addr = worker.http.clone().unwrap();
        let (status, body) = http(&addr, "GET", "/v1/leases", Some(&operator), &[], None);
        assert_eq!(status, 200, "{body}");
        serde_json::from_str::<Value>(&body).unwrap()["leases"]
            .as_array()
            .cloned()
            .unwrap()
    };
    assert_eq!(leases(&worker).len(), 1);
    let home = worker.kill9();
    // The restarted worker stops the daemon the killed one left; dropped, this one's goes too.
    let restarted = AgentDeviceWorker(Worker::start_in(home, true));
    let worker = &restarted.0;
    wait_until(
        worker,
        "the agent-device daemon serves again",
        agent_device_available,
    );
    poll("the earlier lease to end", || {
        match leases(worker).as_slice() {
            [] => Ok(()),
            left => Err(format!("{left:?}")),
        }
    });
    let addr = worker.http.clone().unwrap();
    let (status, beat) = agent_device_rpc(
        &addr,
        &alice,
        &ad_lease_call("h1", "lease.heartbeat", &lease),
    );
    assert_eq!(status, 401, "{beat}");
    assert_eq!(
        beat["error"]["data"]["details"]["reason"], "LEASE_ENDED_BY_HOST",
        "{beat}"
    );
}

/// A gateway process on a home the test keeps, so that it can be killed and started again on it.
struct Gateway {
    child: Child,
    http: String,
}

impl Gateway {
    /// Starts `simlock-gateway` on `home`, HTTP on `port` (0 picks one), agent-device on.
    fn start(home: &Path, port: u16) -> Self {
        let mut command = Command::new(bin("simlock-gateway"));
        command
            .arg("--home")
            .arg(home)
            .args(["--port", &port.to_string()])
            .args(["--set", "agentDevice.enabled=true"])
            .env("SIMLOCK_LOG", "warn")
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit());
        let (child, ready) = spawn_ready(&mut command, "gateway");
        Self {
            child,
            http: ready["http"].as_str().unwrap().to_owned(),
        }
    }

    fn port(&self) -> u16 {
        self.http.rsplit_once(':').unwrap().1.parse().unwrap()
    }
}

impl Drop for Gateway {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A worker whose agent-device daemon is stopped with it whatever happens: dropping it kills
/// the worker, then any daemon it recorded that still runs (a killed worker leaves its daemon).
struct AgentDeviceWorker(Worker);

impl Drop for AgentDeviceWorker {
    fn drop(&mut self) {
        let _ = self.0.child.kill();
        let _ = self.0.child.wait();
        for daemon in agent_device_pids(self.0.home.path()) {
            if agent_device_host::process::is_alive(&daemon) {
                let _ = Command::new("kill")
                    .args(["-9", &daemon.pid.to_string()])
                    .status();
            }
        }
    }
}

impl AgentDeviceWorker {
    /// Kills the worker with SIGKILL (its daemon stops with it, as its watch sees the worker
    /// gone) and hands back its home.
    fn kill9(&mut self) -> tempfile::TempDir {
        let _ = self.0.child.kill();
        let _ = self.0.child.wait();
        std::mem::replace(&mut self.0.home, tempfile::TempDir::new().unwrap())
    }
}

/// Polls `probe` (each poll a real call to another process) until it answers `Some`, at most
/// [`PATIENCE`]; `probe` also says what it last saw, for the failure.
#[allow(
    clippy::disallowed_methods,
    reason = "a bound on polling another process, not a timing assertion"
)]
fn poll<T>(what: &str, mut probe: impl FnMut() -> Result<T, String>) -> T {
    let deadline = std::time::Instant::now() + PATIENCE;
    loop {
        match probe() {
            Ok(found) => return found,
            Err(seen) => assert!(
                std::time::Instant::now() < deadline,
                "timed out waiting for {what}; last seen: {seen}"
            ),
        }
        std::thread::yield_now();
    }
}

/// The gateway's one worker, once it is connected with agent-device available and its catalog
/// read (what the front needs to place an allocate there).
fn serving_worker(gateway_home: &Path) -> Result<Value, String> {
    let listed = run_cli(gateway_home, &["workers"], &[]);
    let workers = listed.json["workers"]
        .as_array()
        .cloned()
        .unwrap_or_default();
    match workers.as_slice() {
        [worker]
            if worker["connection"] == "connected"
                && agent_device_available(worker)
                && worker["catalogReadAt"].is_i64() =>
        {
            Ok(worker.clone())
        }
        _ => Err(format!("{} {}", listed.json, listed.stderr)),
    }
}

/// Every lease the gateway's index has (`GET /v1/leases` with an operator token).
fn gateway_leases(gateway: &str, operator: &str) -> Vec<Value> {
    let (status, body) = http(gateway, "GET", "/v1/leases", Some(operator), &[], None);
    assert_eq!(status, 200, "{body}");
    serde_json::from_str::<Value>(&body).unwrap()["leases"]
        .as_array()
        .cloned()
        .unwrap()
}

/// One JSON-RPC call to the gateway's `/v1/agent-device/rpc`, as the CLI sends it.
fn agent_device_rpc(gateway: &str, token: &str, call: &Value) -> (u16, Value) {
    let (status, body) = http(
        gateway,
        "POST",
        "/v1/agent-device/rpc",
        Some(token),
        &[
            ("content-type", "application/json"),
            ("x-agent-device-token", token),
        ],
        Some(call),
    );
    (status, serde_json::from_str(&body).unwrap_or(Value::Null))
}

fn ad_lease_call(id: &str, method: &str, lease: &str) -> Value {
    simlock_e2e::agent_device::rpc_call(
        id,
        method,
        json!({"session": "s1", "tenantId": "acme", "runId": "run1", "leaseId": lease}),
    )
}

fn ad_command_call(id: &str, lease: &str, command: &str) -> Value {
    simlock_e2e::agent_device::rpc_call(
        id,
        "command",
        json!({"session": "s1", "command": command, "positionals": [],
            "flags": {"leaseId": lease, "runId": "run1", "tenant": "acme", "platform": "android"},
            "meta": {"leaseId": lease, "runId": "run1", "tenantId": "acme", "requestId": id}}),
    )
}

/// The fake agent-device's address (its control API is beside its RPC), from the `daemon.json`
/// it wrote in the worker's home.
fn fake_daemon(worker_home: &Path) -> String {
    let info = std::fs::read_to_string(worker_home.join("agent-device").join("daemon.json"))
        .expect("the fake daemon wrote its daemon.json");
    let info: Value = serde_json::from_str(&info).unwrap();
    format!("127.0.0.1:{}", info["httpPort"].as_u64().unwrap())
}

/// `GET /__fake/<what>` on the fake daemon.
fn fake_read(daemon: &str, what: &str) -> Value {
    let (status, body) = http(daemon, "GET", &format!("/__fake/{what}"), None, &[], None);
    assert_eq!(status, 200, "{body}");
    serde_json::from_str(&body).unwrap()
}

/// A gateway and one worker whose agent-device daemon is the fake, both as processes, with
/// tokens: the worker's join, an operator and two agents.
struct AgentDeviceFleet {
    gateway_home: tempfile::TempDir,
    gateway: Gateway,
    worker: AgentDeviceWorker,
    worker_id: String,
    operator: String,
    alice: String,
    bob: String,
}

impl AgentDeviceFleet {
    /// Starts both and waits until the gateway can place an allocate on the worker.
    fn start() -> Self {
        let gateway_home = tempfile::tempdir().unwrap();
        let gateway = Gateway::start(gateway_home.path(), 0);
        let token = |role: &str| {
            let created = run_cli(
                gateway_home.path(),
                &["token", "create", "--role", role],
                &[],
            );
            assert_eq!(created.code, 0, "{}", created.stderr);
            created.json["secret"].as_str().unwrap().to_owned()
        };
        let (join, operator, alice, bob) = (
            token("worker"),
            token("operator"),
            token("agent"),
            token("agent"),
        );
        let fake = bin("agent-device-fake").display().to_string();
        let config = format!(
            "{}\n[gateway]\nurl = \"ws://{}\"\ntoken = \"{join}\"\n[agentDevice]\nenabled = true\ncommand = {}\n",
            fixed(1),
            gateway.http,
            serde_json::to_string(&[fake]).unwrap()
        );
        let worker = AgentDeviceWorker(Worker::start(&config, false));
        // The worker may dial in before its daemon is up; the gateway then sees agent-device
        // available at its next view refresh (up to 30 s): a capability's change asks for none.
        let view = poll(
            "the worker to serve agent-device through the gateway",
            || serving_worker(gateway_home.path()),
        );
        let worker_id = view["id"].as_str().unwrap().to_owned();
        Self {
            gateway_home,
            gateway,
            worker,
            worker_id,
            operator,
            alice,
            bob,
        }
    }
}

/// `lease.allocate` of an Android device through the gateway at `gateway` as `token`: the
/// lease id.
fn ad_allocate(gateway: &str, token: &str) -> String {
    let (status, allocated) = agent_device_rpc(
        gateway,
        token,
        &simlock_e2e::agent_device::rpc_call(
            "a1",
            "lease.allocate",
            json!({"session": "s1", "tenantId": "acme", "runId": "run1", "backend": "android-instance"}),
        ),
    );
    assert_eq!(status, 200, "{allocated}");
    allocated["result"]["data"]["lease"]["leaseId"]
        .as_str()
        .unwrap_or_else(|| panic!("an allocated lease: {allocated}"))
        .to_owned()
}

/// A worker under a gateway, killed with SIGKILL and started again: its agent-device daemon
/// starts anew without the leases made through the gateway, so the worker ends their simlock
/// leases once started (ADR 0028), freeing their devices without waiting for their owners,
/// and the owner's next heartbeat through the gateway hears `LEASE_ENDED_BY_HOST`.
#[test]
fn a_worker_under_a_gateway_killed_and_restarted_frees_the_devices_of_its_gateway_leases() {
    if !enabled() {
        return;
    }
    let AgentDeviceFleet {
        gateway,
        mut worker,
        alice,
        ..
    } = AgentDeviceFleet::start();
    let lease = ad_allocate(&gateway.http, &alice);
    let operator = worker
        .0
        .cli(&["token", "create", "--role", "operator"])
        .json["secret"]
        .as_str()
        .unwrap()
        .to_owned();
    let leases_on = |worker: &Worker| {
        let listed = worker.cli(&["--token", &operator, "leases"]);
        assert_eq!(listed.code, 0, "{}", listed.stderr);
        listed.json["leases"].as_array().cloned().unwrap()
    };
    let held = leases_on(&worker.0);
    assert_eq!(held.len(), 1, "{held:?}");
    assert_eq!(held[0]["id"], lease.as_str());
    assert!(
        held[0]["requesterId"]
            .as_str()
            .is_some_and(|r| r.starts_with("gw:") && r.ends_with(&format!(":{lease}"))),
        "the gateway's requester: {held:?}"
    );
    let home = worker.kill9();
    let restarted = AgentDeviceWorker(Worker::start_in(home, false));
    wait_until(
        &restarted.0,
        "the agent-device daemon serves again",
        agent_device_available,
    );
    poll(
        "the gateway's lease to end on the worker",
        || match leases_on(&restarted.0).as_slice() {
            [] => Ok(()),
            left => Err(format!("{left:?}")),
        },
    );
    poll("the owner to hear that the lease ended", || {
        let (status, beat) = agent_device_rpc(
            &gateway.http,
            &alice,
            &ad_lease_call("h1", "lease.heartbeat", &lease),
        );
        match beat["error"]["data"]["details"]["reason"].as_str() {
            Some("LEASE_ENDED_BY_HOST") => Ok(status),
            _ => Err(format!("{status} {beat}")),
        }
    });
}

#[test]
fn agent_device_leases_through_a_gateway_killed_with_sigkill_work_again_for_their_owners_only() {
    if !enabled() {
        return;
    }
    let AgentDeviceFleet {
        gateway_home,
        gateway,
        worker,
        worker_id,
        operator,
        alice,
        bob,
    } = AgentDeviceFleet::start();

    // Alice allocates through the gateway and opens a session on the leased device.
    let lease = ad_allocate(&gateway.http, &alice);
    let before = gateway_leases(&gateway.http, &operator);
    assert_eq!(before.len(), 1, "{before:?}");
    assert_eq!(before[0]["id"], lease.as_str());
    assert_eq!(before[0]["workerId"], worker_id.as_str());
    let device = before[0]["deviceId"].clone();
    // agent-device holds one lease (under its own id) on the leased device.
    let only_lease = |leases: Value| match leases.as_array().map(Vec::as_slice) {
        Some([one]) => one.clone(),
        _ => panic!("agent-device holds one lease: {leases}"),
    };
    let daemon = fake_daemon(worker.0.home.path());
    let held = only_lease(fake_read(&daemon, "leases"));
    let driver = held["deviceKey"]
        .as_str()
        .and_then(|key| key.strip_prefix("local:android:none:"))
        .unwrap_or_else(|| panic!("an Android device key: {held}"))
        .to_owned();
    // The fake lists the worker's device, so that `open` finds the serial simlock sends.
    let emulator = agent_device_fake::Device::android_emulator(&driver, "Pixel");
    let (status, body) = http(
        &daemon,
        "PUT",
        "/__fake/devices",
        None,
        &[("content-type", "application/json")],
        Some(&json!({"list": [emulator]})),
    );
    assert_eq!(status, 200, "{body}");
    let (status, opened) = agent_device_rpc(
        &gateway.http,
        &alice,
        &ad_command_call("c1", &lease, "open"),
    );
    assert_eq!(status, 200, "{opened}");
    assert_eq!(opened["result"]["ok"], json!(true), "{opened}");
    let sessions = fake_read(&daemon, "sessions");
    assert_eq!(sessions[0]["device"]["id"], driver.as_str(), "{sessions}");

    // The worker is held still, so that the restarted gateway sees it away; the gateway dies.
    let worker_pid = worker.0.child.id().to_string();
    assert!(
        Command::new("kill")
            .args(["-STOP", &worker_pid])
            .status()
            .unwrap()
            .success()
    );
    let port = gateway.port();
    drop(gateway); // SIGKILL
    let gateway = Gateway::start(gateway_home.path(), port);
    assert_eq!(gateway.port(), port);
    // Until its worker is back, the lease is its owner's and away: retry, not "not yours", and
    // never an ended lease.
    let (status, away) = agent_device_rpc(
        &gateway.http,
        &alice,
        &ad_lease_call("h0", "lease.heartbeat", &lease),
    );
    assert_eq!(status, 503, "{away}");
    assert_eq!(
        away["error"]["data"]["message"],
        "agent-device is not available on this simlock: the worker holding this lease is disconnected; retry",
        "{away}"
    );
    assert_eq!(away["error"]["data"]["retriable"], json!(true), "{away}");
    assert_eq!(away["error"]["data"]["code"], "UNAVAILABLE", "{away}");
    let not_yours = format!("refused: lease {lease} is not one of yours on this gateway");
    let (status, refused) = agent_device_rpc(
        &gateway.http,
        &bob,
        &ad_command_call("b0", &lease, "snapshot"),
    );
    assert_eq!(status, 403, "{refused}");
    assert_eq!(refused["error"]["data"]["message"], not_yours.as_str());
    assert!(
        Command::new("kill")
            .args(["-CONT", &worker_pid])
            .status()
            .unwrap()
            .success()
    );

    // The worker reconnects and reports its leases: the same lease, on the same worker.
    poll("the worker back, its lease indexed", || {
        let view = serving_worker(gateway_home.path())?;
        let leases = gateway_leases(&gateway.http, &operator);
        if view["id"] == worker_id.as_str()
            && leases.len() == 1
            && leases[0]["id"] == lease.as_str()
            && leases[0]["workerId"] == worker_id.as_str()
            && leases[0]["ownerId"] == before[0]["ownerId"]
            && leases[0]["deviceId"] == device
        {
            Ok(())
        } else {
            Err(format!("{view} {leases:?}"))
        }
    });
    let (status, beat) = agent_device_rpc(
        &gateway.http,
        &alice,
        &ad_lease_call("h1", "lease.heartbeat", &lease),
    );
    assert_eq!(status, 200, "{beat}");
    assert_eq!(beat["result"]["ok"], json!(true), "{beat}");
    let (status, snapshot) = agent_device_rpc(
        &gateway.http,
        &alice,
        &ad_command_call("c2", &lease, "snapshot"),
    );
    assert_eq!(status, 200, "{snapshot}");
    assert_eq!(snapshot["result"]["ok"], json!(true), "{snapshot}");
    // Both reached the same agent-device lease and session on the same device.
    let after = only_lease(fake_read(&daemon, "leases"));
    assert_eq!(after["leaseId"], held["leaseId"]);
    assert_eq!(after["deviceKey"], held["deviceKey"]);
    assert!(
        after["heartbeats"].as_u64().unwrap() > held["heartbeats"].as_u64().unwrap(),
        "the heartbeat reached it: {after}"
    );
    // The callers' heartbeats that reached it: this one alone, once (the away one, `h0`, did
    // not). The front's own after each command (`<id>:keep`) come at times of their own.
    let requests = fake_read(&daemon, "requests");
    let beats: Vec<Value> = requests
        .as_array()
        .unwrap()
        .iter()
        .filter(|r| r["path"] == "/rpc")
        .filter_map(|r| serde_json::from_str::<Value>(r["body"].as_str()?).ok())
        .filter(|b| b["method"] == "agent_device.lease.heartbeat")
        .map(|b| b["id"].clone())
        .filter(|id| !id.as_str().is_some_and(|id| id.ends_with(":keep")))
        .collect();
    assert_eq!(beats, [json!("h1")], "{requests}");
    assert_eq!(fake_read(&daemon, "sessions"), sessions, "the same session");
    let (status, refused) = agent_device_rpc(
        &gateway.http,
        &bob,
        &ad_command_call("b1", &lease, "snapshot"),
    );
    assert_eq!(status, 403, "{refused}");
    assert_eq!(refused["error"]["data"]["message"], not_yours.as_str());
    let (status, refused) = agent_device_rpc(
        &gateway.http,
        &bob,
        &ad_lease_call("b2", "lease.heartbeat", &lease),
    );
    assert_eq!(status, 403, "{refused}");
    assert_eq!(refused["error"]["data"]["message"], not_yours.as_str());

    // Alice's release ends it everywhere.
    let (status, released) = agent_device_rpc(
        &gateway.http,
        &alice,
        &ad_lease_call("r1", "lease.release", &lease),
    );
    assert_eq!(status, 200, "{released}");
    assert_eq!(released["result"]["ok"], json!(true), "{released}");
    assert!(gateway_leases(&gateway.http, &operator).is_empty());
    assert!(
        fake_read(&daemon, "leases").as_array().unwrap().is_empty(),
        "agent-device's lease ended too"
    );

    // Stopped, the worker stops its agent-device daemon; the gateway stops cleanly.
    let daemons = agent_device_pids(worker.0.home.path());
    assert!(!daemons.is_empty(), "the daemon's pid is recorded");
    let mut worker = worker;
    assert!(
        Command::new("kill")
            .args(["-TERM", &worker_pid])
            .status()
            .unwrap()
            .success()
    );
    let exited = wait_exit(&mut worker.0.child);
    assert!(exited.is_some_and(|s| s.success()), "{exited:?}");
    for daemon in &daemons {
        assert!(
            !agent_device_host::process::is_alive(daemon),
            "{daemon:?} survived its worker"
        );
    }
    assert!(
        agent_device_pids(worker.0.home.path()).is_empty(),
        "nothing is left recorded"
    );
    let mut gateway = gateway;
    assert!(
        Command::new("kill")
            .args(["-TERM", &gateway.child.id().to_string()])
            .status()
            .unwrap()
            .success()
    );
    let exited = wait_exit(&mut gateway.child);
    assert!(exited.is_some_and(|s| s.success()), "{exited:?}");
}

/// A gateway sent SIGTERM while a relayed command waits in its worker's daemon answers that
/// command naming the stop (retriable) before it exits, instead of dropping the connection.
/// The command asks for progress, as the CLI does in human mode: when the daemon's stream has
/// begun, the gateway ends it with a response line of its own.
#[test]
fn a_gateway_stopped_by_sigterm_answers_a_relayed_command_in_flight_naming_the_stop() {
    if !enabled() {
        return;
    }
    let mut fleet = AgentDeviceFleet::start();
    let lease = ad_allocate(&fleet.gateway.http, &fleet.alice);
    let daemon = fake_daemon(fleet.worker.0.home.path());
    let (status, body) = http(
        &daemon,
        "POST",
        "/__fake/holds",
        None,
        &[("content-type", "application/json")],
        Some(&json!({"command": "snapshot"})),
    );
    assert_eq!(status, 200, "{body}");
    let hold = serde_json::from_str::<Value>(&body).unwrap()["id"].clone();
    let (gateway, alice) = (fleet.gateway.http.clone(), fleet.alice.clone());
    let mut call = ad_command_call("c1", &lease, "snapshot");
    call["params"]["meta"]["requestProgress"] = json!("command");
    let running = std::thread::spawn(move || {
        http(
            &gateway,
            "POST",
            "/v1/agent-device/rpc",
            Some(&alice),
            &[
                ("content-type", "application/json"),
                ("x-agent-device-token", &alice),
            ],
            Some(&call),
        )
    });
    poll("the command to wait in the daemon", || {
        let status = fake_read(&daemon, &format!("holds/{hold}"));
        if status["entered"] == json!(1) {
            Ok(())
        } else {
            Err(status.to_string())
        }
    });
    assert!(
        Command::new("kill")
            .args(["-TERM", &fleet.gateway.child.id().to_string()])
            .status()
            .unwrap()
            .success()
    );
    // The stop answers it at once: as a plain refusal, or, when the daemon's stream had
    // already begun, with a last line of its own (the CLI reads either).
    let (status, body) = running.join().unwrap();
    let (answer, carried) = rpc_answer(body.as_bytes());
    assert!(
        matches!(
            (status, carried),
            (503, Carried::Plain) | (200, Carried::StreamsLastLine)
        ),
        "{status} {body}"
    );
    assert_eq!(answer["id"], json!("c1"), "{answer}");
    let data = &answer["error"]["data"];
    assert_eq!(data["message"], stopping_message(), "{answer}");
    assert_eq!(data["retriable"], json!(true), "{answer}");
    let exited = wait_exit(&mut fleet.gateway.child);
    assert!(exited.is_some_and(|s| s.success()), "{exited:?}");
}

/// The CLI's human view (no `--json`) against the daemon whose home is `home`: exit code and
/// stdout.
fn run_cli_human(home: &Path, args: &[&str]) -> (i32, String) {
    let output = cli_output(home, args, &[]);
    (
        output.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&output.stdout).into_owned(),
    )
}

/// The gateway's one worker as `simlock workers` lists it, once `check` holds for it.
fn the_worker(gateway_home: &Path, what: &str, check: impl Fn(&Value) -> bool) -> Value {
    poll(what, || {
        let listed = run_cli(gateway_home, &["workers"], &[]);
        match listed.json["workers"].as_array().map(Vec::as_slice) {
            Some([worker]) if check(worker) => Ok(worker.clone()),
            _ => Err(format!("{} {}", listed.json, listed.stderr)),
        }
    })
}

/// A worker killed with SIGKILL under a gateway: the gateway's views say it is away (its
/// devices keep their last state and name their worker as disconnected, the workers table shows
/// no health and since when), and a gateway killed and started again still lists it, until it
/// reconnects. The lease views say whose leases they show.
#[test]
fn a_gateway_lists_a_killed_worker_as_away_and_still_after_its_own_restart() {
    if !enabled() {
        return;
    }
    let gateway_home = tempfile::tempdir().unwrap();
    let gateway = Gateway::start(gateway_home.path(), 0);
    let join = run_cli(
        gateway_home.path(),
        &["token", "create", "--role", "worker"],
        &[],
    );
    let join = join.json["secret"].as_str().unwrap().to_owned();
    let config = format!(
        "{}\n[gateway]\nurl = \"ws://{}\"\ntoken = \"{join}\"\nlabel = \"lab-mini\"\n",
        fixed(1),
        gateway.http,
    );
    let worker = Worker::start(&config, false);
    let connected = |w: &Value| w["connection"] == "connected" && w["catalogReadAt"].is_i64();
    let id = the_worker(gateway_home.path(), "the worker to join", connected)["id"]
        .as_str()
        .unwrap()
        .to_owned();
    let devices = |home: &Path| {
        run_cli(home, &["devices"], &[]).json["devices"]
            .as_array()
            .cloned()
            .unwrap_or_default()
    };
    // An agent leases a device through the gateway and holds it.
    let agent = run_cli(
        gateway_home.path(),
        &["token", "create", "--role", "agent"],
        &[],
    );
    let agent = agent.json["secret"].as_str().unwrap().to_owned();
    let mut command = Command::new(bin("simlock"));
    command
        .env_remove("SIMLOCK_HOME")
        .args(["--url", &format!("http://{}", gateway.http)])
        .args(["--token", &agent]);
    let (mut holder, lease) = held(command, "r1", &[]);
    let listed = poll("the leased device", || {
        match devices(gateway_home.path()).as_slice() {
            [device] if device["state"] == "leased" => Ok(device.clone()),
            list => Err(format!("{list:?}")),
        }
    });
    assert_eq!(
        listed["worker"],
        json!({"id": id, "label": "lab-mini", "connection": "connected"})
    );

    let home = worker.kill9();
    let away = the_worker(gateway_home.path(), "the worker to be seen away", |w| {
        w["connection"] == "disconnected"
    });
    assert_eq!(away["label"], "lab-mini");
    let listed = devices(gateway_home.path());
    assert_eq!(listed.len(), 1, "its device stays listed: {listed:?}");
    assert_eq!(listed[0]["state"], "leased", "as last reported");
    assert_eq!(listed[0]["workerId"], id.as_str());
    assert_eq!(listed[0]["worker"]["connection"], "disconnected");
    let (code, table) = run_cli_human(gateway_home.path(), &["workers"]);
    assert_eq!(code, 0);
    let row = table
        .lines()
        .find(|l| l.starts_with(&id))
        .unwrap_or_else(|| panic!("{table}"));
    assert!(row.contains("disconnected, seen"), "{table}");
    assert!(
        !row.contains("running"),
        "no health for a worker away: {table}"
    );
    let (_, table) = run_cli_human(gateway_home.path(), &["devices"]);
    assert!(table.contains("lab-mini (disconnected)"), "{table}");
    let (_, status) = run_cli_human(gateway_home.path(), &["status"]);
    assert!(
        status.contains("workers   1 (0 connected, 1 disconnected)"),
        "{status}"
    );
    // The socket without a token is an agent's view, and says so.
    assert!(
        status.contains("no leases of yours") && status.contains("simlock leases --all"),
        "{status}"
    );
    let (code, every) = run_cli_human(gateway_home.path(), &["leases", "--all"]);
    assert_eq!(code, 0);
    let row = every
        .lines()
        .find(|l| l.starts_with(&lease))
        .unwrap_or_else(|| panic!("the agent's lease, for an operator: {every}"));
    assert!(row.ends_with("lab-mini (disconnected)"), "{every}");

    // The gateway dies and starts again: the worker it knew is listed, away.
    let port = gateway.port();
    drop(gateway); // SIGKILL
    let gateway = Gateway::start(gateway_home.path(), port);
    let remembered = run_cli(gateway_home.path(), &["workers"], &[]);
    let remembered = remembered.json["workers"].as_array().cloned().unwrap();
    assert_eq!(remembered.len(), 1, "{remembered:?}");
    assert_eq!(remembered[0]["id"], id.as_str());
    assert_eq!(remembered[0]["label"], "lab-mini");
    assert_eq!(remembered[0]["connection"], "disconnected");
    // Its leases are not read yet: both lists say so rather than show nothing (trial 23).
    let note = "(not listed: the leases on lab-mini (disconnected); this gateway has not read";
    for args in [&["leases", "--all"][..], &["leases"][..]] {
        let (code, listed) = run_cli_human(gateway_home.path(), args);
        assert_eq!(code, 0, "{args:?}: {listed}");
        assert!(
            listed.contains(note) && !listed.contains(&lease),
            "{args:?}: {listed}"
        );
    }

    // The worker comes back to the restarted gateway: one worker, connected.
    let _worker = Worker::start_in(home, false);
    the_worker(gateway_home.path(), "the worker to come back", connected);
    let _ = holder.kill();
    let _ = holder.wait();
    drop(gateway);
}

/// A systemd unit's `Key=value` settings, in order.
fn unit_settings(unit: &str) -> Vec<(String, String)> {
    unit.lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with(['#', ';', '[']))
        .filter_map(|l| l.split_once('='))
        .map(|(k, v)| (k.to_owned(), v.to_owned()))
        .collect()
}

/// The values of `key` in `settings`.
fn unit_values<'a>(settings: &'a [(String, String)], key: &str) -> Vec<&'a str> {
    settings
        .iter()
        .filter(|(k, _)| k == key)
        .map(|(_, v)| v.as_str())
        .collect()
}

/// What a property list holds under `key` up to `end` (the plists here hold no nesting there).
fn plist_section<'a>(plist: &'a str, key: &str, end: &str) -> &'a str {
    let after = plist
        .split_once(&format!("<key>{key}</key>"))
        .unwrap_or_else(|| panic!("no {key} in the plist"))
        .1;
    after.split_once(end).unwrap().0
}

/// The texts of the `<tag>` elements in `xml`, in order (the plists here hold no escapes).
fn elements(xml: &str, tag: &str) -> Vec<String> {
    xml.split(&format!("<{tag}>"))
        .skip(1)
        .filter_map(|s| s.split_once(&format!("</{tag}>")))
        .map(|(value, _)| value.to_owned())
        .collect()
}

/// A daemon a test started, killed when the test ends however it ends.
struct Started(Child);

impl Drop for Started {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Starts the daemon a service file's command line names, as its service manager would, with
/// what the file marks as this machine's own replaced: the home (`--home`, or `SIMLOCK_HOME`
/// for a file that keeps the default home), the HTTP address (loopback, a free port), the
/// gateway's address and the host name systemd puts for `%H`. Devices are virtual whatever
/// tools this machine has.
fn start_as_service(
    argv: &[String],
    env: &[(String, String)],
    home: &Path,
    gateway: Option<&str>,
) -> (Started, Value) {
    let (program, args) = argv.split_first().unwrap();
    let name = Path::new(program).file_name().unwrap().to_str().unwrap();
    let mut replaced = Vec::new();
    let mut args = args.iter();
    while let Some(arg) = args.next() {
        let value = match arg.as_str() {
            "--home" => Some(home.display().to_string()),
            "--host" => Some("127.0.0.1".to_owned()),
            "--port" => Some("0".to_owned()),
            "--gateway" => Some(format!("ws://{}", gateway.unwrap())),
            _ => None,
        };
        replaced.push(arg.replace("%H", "test-host"));
        if let Some(value) = value {
            assert!(args.next().is_some(), "{arg} has its value in {argv:?}");
            replaced.push(value);
        }
    }
    let mut command = Command::new(bin(name));
    command
        .args(&replaced)
        .env("SIMLOCK_HOME", home)
        .envs(env.iter().map(|(k, v)| (k, v)))
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit());
    let role = name.trim_start_matches("simlock-");
    if role == "worker" {
        command.args([
            "--set",
            "drivers.ios.driver=virtual",
            "--set",
            "drivers.android.driver=virtual",
        ]);
    }
    let (child, ready) = spawn_ready(&mut command, role);
    (Started(child), ready)
}

/// `Environment=` settings of a unit as pairs.
fn unit_environment(settings: &[(String, String)]) -> Vec<(String, String)> {
    unit_values(settings, "Environment")
        .into_iter()
        .filter_map(|e| e.split_once('='))
        .map(|(k, v)| (k.to_owned(), v.to_owned()))
        .collect()
}

/// The service files in `contrib/` (docs/OPERATIONS.md) start what they promise: the gateway's
/// systemd unit a gateway, a join token minted on it as the guide says, and the Linux worker's
/// unit (its token from the environment file) and the Mac's LaunchAgent (its token in the
/// home's `config.toml`) two workers that join it under the labels the files give; each stops
/// cleanly (exit 0) on the SIGTERM its service manager sends. The worker's unit stops the worker
/// alone, so that its emulators outlive it and are adopted (ADR 0021).
#[test]
fn the_service_files_start_a_gateway_and_workers_that_join_it_and_stop_on_sigterm() {
    if !enabled() {
        return;
    }
    let gateway_unit = unit_settings(&workspace_file("contrib/systemd/simlock-gateway.service"));
    let worker_unit = unit_settings(&workspace_file("contrib/systemd/simlock-worker.service"));
    let agent_plist = workspace_file("contrib/launchd/dev.simlock.worker.plist");
    assert_eq!(unit_values(&worker_unit, "KillMode"), ["process"]);
    for unit in [&gateway_unit, &worker_unit] {
        assert_eq!(unit_values(unit, "RestartPreventExitStatus"), ["2 64"]);
        // The home is the directory systemd makes for the unit (the test puts its own there).
        let [state] = unit_values(unit, "StateDirectory")[..] else {
            panic!("one StateDirectory");
        };
        let home = format!("--home /var/lib/{state} ");
        assert!(unit_values(unit, "ExecStart")[0].contains(&home), "{home}");
    }
    let exec = |unit: &[(String, String)]| -> Vec<String> {
        let [line] = unit_values(unit, "ExecStart")[..] else {
            panic!("one ExecStart");
        };
        line.split_whitespace().map(String::from).collect()
    };

    let gateway_home = tempfile::tempdir().unwrap();
    let (mut gateway, ready) = start_as_service(
        &exec(&gateway_unit),
        &unit_environment(&gateway_unit),
        gateway_home.path(),
        None,
    );
    let address = ready["http"].as_str().unwrap().to_owned();
    let join = run_cli(
        gateway_home.path(),
        &["token", "create", "--role", "worker"],
        &[],
    );
    let join = join.json["secret"].as_str().unwrap().to_owned();

    // The Linux worker: its join token from /etc/simlock/worker.env.
    let linux_home = tempfile::tempdir().unwrap();
    let mut env = unit_environment(&worker_unit);
    env.push(("SIMLOCK_JOIN_TOKEN".to_owned(), join.clone()));
    let (mut linux, _) =
        start_as_service(&exec(&worker_unit), &env, linux_home.path(), Some(&address));

    // The Mac's worker: the default home, its join token in that home's config.toml.
    let mac_home = tempfile::tempdir().unwrap();
    std::fs::write(
        mac_home.path().join("config.toml"),
        format!("[gateway]\ntoken = \"{join}\"\n"),
    )
    .unwrap();
    let variables = plist_section(&agent_plist, "EnvironmentVariables", "</dict>");
    let env: Vec<(String, String)> = elements(variables, "key")
        .into_iter()
        .zip(elements(variables, "string"))
        .collect();
    let (mut mac, _) = start_as_service(
        &elements(
            plist_section(&agent_plist, "ProgramArguments", "</array>"),
            "string",
        ),
        &env,
        mac_home.path(),
        Some(&address),
    );

    poll("both workers to join under their labels", || {
        let listed = run_cli(gateway_home.path(), &["workers"], &[]);
        let mut labels: Vec<String> = listed.json["workers"]
            .as_array()
            .into_iter()
            .flatten()
            .filter(|w| w["connection"] == "connected")
            .filter_map(|w| w["label"].as_str().map(String::from))
            .collect();
        labels.sort();
        if labels == ["mac mini 3", "test-host"] {
            Ok(())
        } else {
            Err(listed.json.to_string())
        }
    });
    for (name, child) in [
        ("the Mac's worker", &mut mac),
        ("the Linux worker", &mut linux),
        ("the gateway", &mut gateway),
    ] {
        send_signal(child.0.id(), "-TERM");
        let status = wait_exit(&mut child.0);
        assert!(
            status.is_some_and(|s| s.success()),
            "{name} stopped cleanly: {status:?}"
        );
    }
}
