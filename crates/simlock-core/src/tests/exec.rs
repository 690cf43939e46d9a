//! `device.exec` through the pipeline, running real host processes.
//!
//! These tests run in real time (a paused clock would jump to the exec timeout while the
//! runtime waits on a process), with the virtual driver's delays set to zero; the timeout
//! test pauses time on purpose.

use std::time::Duration;

use serde_json::json;
use simlock_contract::ops::{DeviceExec, ExecInput};
use simlock_contract::push::OutputStream;
use simlock_contract::{ErrorCode, Push};

use super::*;

fn instant_config() -> TestConfig {
    let mut config = config();
    config.core.virtual_devices.provision_ms = 0;
    config.core.virtual_devices.boot_ms = 0;
    config.core.virtual_devices.reclaim_ms = 0;
    config
}

fn exec(lease_id: &str, tool: &str, args: &[&str]) -> ExecInput {
    ExecInput {
        lease_id: lease_id.to_owned(),
        tool: tool.to_owned(),
        args: args.iter().map(|a| (*a).to_owned()).collect(),
        stdin: None,
        requester_id: None,
    }
}

const GUARD: Duration = Duration::from_secs(30);

/// Drains the pushes a finished call left: `started`, then outputs per stream.
fn drain(pushes: &mut mpsc::Receiver<Push>) -> (Vec<Push>, String, String) {
    let mut all = Vec::new();
    let (mut out, mut err) = (String::new(), String::new());
    while let Ok(push) = pushes.try_recv() {
        if let Push::Output { stream, chunk, .. } = &push {
            match stream {
                OutputStream::Stdout => out.push_str(chunk),
                OutputStream::Stderr => err.push_str(chunk),
            }
        }
        all.push(push);
    }
    (all, out, err)
}

#[tokio::test]
async fn output_is_pushed_in_order_after_started_and_the_exit_code_answered() {
    let h = Harness::with_config(instant_config());
    let grant = within(GUARD, h.lease("agent-a", ios())).await.unwrap();
    let lease_id = grant.lease.id.to_string();
    let (ctx, mut pushes) = agent_with_pushes("agent-a");
    let script = "printf 'one\\n'; printf 'two\\n' >&2; printf \"$SIMLOCK_LEASE_ID $SIMLOCK_PLATFORM $SIMLOCK_DEVICE_UDID\"; exit 3";
    let out = within(
        GUARD,
        h.call::<DeviceExec>(ctx, &exec(&lease_id, "sh", &[script])),
    )
    .await
    .unwrap();
    assert_eq!(out.exit_code, 3);
    let (all, stdout, stderr) = drain(&mut pushes);
    assert_eq!(
        all[0],
        Push::Started {
            request_id: 0.into()
        },
        "started comes first"
    );
    assert!(all[1..].iter().all(|p| matches!(p, Push::Output { .. })));
    assert_eq!(
        stdout,
        format!("one\n{lease_id} ios {}", grant.device.driver_device_id)
    );
    assert_eq!(stderr, "two\n");

    // stdin reaches the tool and is closed after.
    let (ctx, mut pushes) = agent_with_pushes("agent-a");
    let mut input = exec(&lease_id, "cat", &[]);
    input.stdin = Some("hello\nworld".into());
    let out = within(GUARD, h.call::<DeviceExec>(ctx, &input))
        .await
        .unwrap();
    assert_eq!(out.exit_code, 0);
    assert_eq!(drain(&mut pushes).1, "hello\nworld");

    // Many lines arrive whole and in order.
    let (ctx, mut pushes) = agent_with_pushes("agent-a");
    let out = within(
        GUARD,
        h.call::<DeviceExec>(
            ctx,
            &exec(
                &lease_id,
                "sh",
                &["i=0; while [ $i -lt 2000 ]; do echo line-$i; i=$((i+1)); done"],
            ),
        ),
    )
    .await
    .unwrap();
    assert_eq!(out.exit_code, 0);
    let stdout = drain(&mut pushes).1;
    let lines: Vec<&str> = stdout.lines().collect();
    assert_eq!(lines.len(), 2000);
    assert!(
        lines
            .iter()
            .enumerate()
            .all(|(i, l)| *l == format!("line-{i}"))
    );
}

#[tokio::test]
async fn an_unknown_tool_is_refused_before_anything_starts() {
    let h = Harness::with_config(instant_config());
    let grant = within(GUARD, h.lease("agent-a", ios())).await.unwrap();
    let (ctx, mut pushes) = agent_with_pushes("agent-a");
    let err = h
        .call::<DeviceExec>(ctx, &exec(grant.lease.id.as_str(), "rm", &["-rf", "/"]))
        .await
        .unwrap_err();
    assert_eq!(err.code, ErrorCode::UnknownPassthroughTool);
    assert_eq!(err.details, Some(json!({"tool": "rm"})));
    assert!(pushes.try_recv().is_err(), "no started push");
}

/// The refusal of an exec of tool `name` configured to run `command`, which cannot start; no
/// `started` push went out.
async fn refused_tool(name: &str, command: &str) -> ContractError {
    let mut config = instant_config();
    config.core.exec.tools.insert(
        name.into(),
        ToolConfig {
            command: command.into(),
            args: vec![],
        },
    );
    let h = Harness::with_config(config);
    let grant = within(GUARD, h.lease("agent-a", ios())).await.unwrap();
    let (ctx, mut pushes) = agent_with_pushes("agent-a");
    let err = h
        .call::<DeviceExec>(ctx, &exec(grant.lease.id.as_str(), name, &[]))
        .await
        .unwrap_err();
    assert!(pushes.try_recv().is_err(), "no started push");
    err
}

#[tokio::test]
async fn a_tool_that_cannot_start_fails_before_started() {
    let err = refused_tool("ghost", "/nonexistent/simlock-test-tool").await;
    // The configuration's to fix, said so: not the daemon's INTERNAL.
    assert_eq!(err.code, ErrorCode::PassthroughRefused);
    assert_eq!(
        err.message,
        "Exec tool ghost runs /nonexistent/simlock-test-tool, which this worker cannot run (not \
         found): fix exec.tools.ghost.command in the worker's configuration"
    );
    assert_eq!(err.details, Some(serde_json::json!({"tool": "ghost"})));
}

#[tokio::test]
async fn a_tool_that_is_not_executable_is_the_configurations_to_fix() {
    let dir = tempfile::tempdir().unwrap();
    let script = dir.path().join("not-executable");
    std::fs::write(&script, "#!/bin/sh\necho hi\n").unwrap();
    let err = refused_tool("flat", &script.display().to_string()).await;
    assert_eq!(err.code, ErrorCode::PassthroughRefused);
    assert_eq!(
        err.message,
        format!(
            "Exec tool flat runs {}, which this worker cannot run (permission denied): fix \
             exec.tools.flat.command in the worker's configuration",
            script.display()
        )
    );
    assert_eq!(err.details, Some(serde_json::json!({"tool": "flat"})));
}

#[tokio::test]
async fn exec_is_for_the_lease_owner_and_admins_are_held_to_the_requester() {
    let h = Harness::with_config(instant_config());
    let grant = within(GUARD, h.lease("agent-a", ios())).await.unwrap();
    let lease_id = grant.lease.id.to_string();
    let true_tool = exec(&lease_id, "sh", &["true"]);

    let err = h
        .call::<DeviceExec>(agent("agent-b"), &true_tool)
        .await
        .unwrap_err();
    assert_eq!(
        err.code,
        ErrorCode::UnknownLease,
        "another's lease is invisible"
    );

    let mut naming = true_tool.clone();
    naming.requester_id = Some("agent-a".into());
    let err = h
        .call::<DeviceExec>(agent("agent-a"), &naming)
        .await
        .unwrap_err();
    assert_eq!(
        err.code,
        ErrorCode::Forbidden,
        "agents may not name a requester"
    );

    // An admin is not waved through: the lease's requester must match.
    let err = h
        .call::<DeviceExec>(admin("operator"), &true_tool)
        .await
        .unwrap_err();
    assert_eq!(err.code, ErrorCode::UnknownLease);
    let out = within(GUARD, h.call::<DeviceExec>(admin("operator"), &naming))
        .await
        .unwrap();
    assert_eq!(out.exit_code, 0);
    let (ctx, mut pushes) = admin_with_pushes("agent-a");
    within(GUARD, h.call::<DeviceExec>(ctx, &true_tool))
        .await
        .unwrap();
    assert_eq!(
        next_push(&mut pushes).await,
        Push::Started {
            request_id: 0.into()
        }
    );
}

#[tokio::test(start_paused = true)]
async fn a_tool_that_runs_past_the_timeout_is_stopped() {
    let mut config = config();
    config.core.exec.timeout_ms = 1_000;
    let h = Harness::with_config(config);
    let grant = h.lease("agent-a", ios()).await.unwrap();
    let (ctx, mut pushes) = agent_with_pushes("agent-a");
    let started = h.now();
    let err = h
        .call::<DeviceExec>(ctx, &exec(grant.lease.id.as_str(), "sleep", &["30"]))
        .await
        .unwrap_err();
    assert_eq!(err.code, ErrorCode::ExecTimeout);
    assert!(err.message.contains("1000 ms"), "{}", err.message);
    assert!(h.now() - started >= 1_000);
    assert_eq!(
        next_push(&mut pushes).await,
        Push::Started {
            request_id: 0.into()
        }
    );
}

/// In real time: the tool must have installed its trap and printed its pid before the timeout.
#[tokio::test]
async fn a_timed_out_tool_gets_sigterm_first_and_is_gone_when_the_call_answers() {
    let mut config = instant_config();
    config.core.exec.timeout_ms = 2_000;
    let h = Harness::with_config(config);
    let grant = within(GUARD, h.lease("agent-a", ios())).await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let mark = dir.path().join("term");
    let script = format!(
        "trap 'kill $! 2>/dev/null; echo term > {}; exit 0' TERM; echo $$; sleep 30 & wait",
        mark.display()
    );
    let (ctx, mut pushes) = agent_with_pushes("agent-a");
    let err = within(
        GUARD,
        h.call::<DeviceExec>(ctx, &exec(grant.lease.id.as_str(), "sh", &[&script])),
    )
    .await
    .unwrap_err();
    assert_eq!(err.code, ErrorCode::ExecTimeout);
    let pid: i32 = drain(&mut pushes).1.trim().parse().unwrap();
    assert_eq!(
        std::fs::read_to_string(&mark).unwrap(),
        "term\n",
        "SIGTERM came first, and the tool could end on its own"
    );
    let pid = rustix::process::Pid::from_raw(pid).unwrap();
    assert!(
        rustix::process::test_kill_process(pid).is_err(),
        "the tool is gone and reaped when the call answers"
    );
}

/// Whether `pid` is gone (reaped, or a zombie no one waits for: its group was killed).
fn gone(pid: i32) -> bool {
    u32::try_from(pid).is_ok_and(|pid| !simlock_daemon::processes::pid_alive(pid))
}

/// Waits until `pid` is gone (a killed process ends in its own time; nothing tells us when):
/// fails the test past [`GUARD`].
async fn until_gone(pid: i32) {
    within(GUARD, async {
        while !gone(pid) {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await;
}

/// Outside trial 12: what a tool starts in the background is stopped with it, at its timeout and
/// when it ends on its own (they were left running, reparented to init).
#[tokio::test]
async fn what_a_tool_starts_in_the_background_is_stopped_with_it() {
    let mut config = instant_config();
    config.core.exec.timeout_ms = 1_000;
    let h = Harness::with_config(config);
    let grant = within(GUARD, h.lease("agent-a", ios())).await.unwrap();
    let lease_id = grant.lease.id.to_string();

    // Past the timeout: the tool and its background child.
    let (ctx, mut pushes) = agent_with_pushes("agent-a");
    let script = "sleep 300 & echo $!; sleep 301";
    let err = within(
        GUARD,
        h.call::<DeviceExec>(ctx, &exec(&lease_id, "sh", &[script])),
    )
    .await
    .unwrap_err();
    assert_eq!(err.code, ErrorCode::ExecTimeout);
    let child: i32 = drain(&mut pushes).1.trim().parse().unwrap();
    // The background child is stopped too.
    until_gone(child).await;

    // Ended on its own, a child left behind in the background.
    let (ctx, mut pushes) = agent_with_pushes("agent-a");
    let script = "sleep 300 >/dev/null 2>&1 & echo $!";
    let out = within(
        GUARD,
        h.call::<DeviceExec>(ctx, &exec(&lease_id, "sh", &[script])),
    )
    .await
    .unwrap();
    assert_eq!(out.exit_code, 0);
    let child: i32 = drain(&mut pushes).1.trim().parse().unwrap();
    // The straggler is stopped.
    until_gone(child).await;
}

/// A tool runs recorded in the exec process ledger, and is forgotten once it ended; a tool an
/// earlier run left running (the worker was killed) is stopped, by pid, when the worker starts
/// again (outside trial 12: it ran on, and the restarted worker never looked).
#[tokio::test]
async fn a_tool_is_recorded_while_it_runs_and_one_left_by_a_crash_is_stopped_at_the_next_start() {
    use simlock_daemon::processes::{Entry, Ledger, Role};
    let dir = tempfile::tempdir().unwrap();
    let ledger_dir = dir.path().join("exec").join("processes");
    let h = Harness::build(Build {
        config: instant_config(),
        exec_ledger: Some(ledger_dir.clone()),
        ..Build::default()
    });
    let grant = within(GUARD, h.lease("agent-a", ios())).await.unwrap();
    let ledger = Ledger::open(&ledger_dir).unwrap();
    let (ctx, mut pushes) = agent_with_pushes("agent-a");
    // The tool reads its stdin first: it is written once the tool is recorded (a tool is
    // recorded by its pid, after it started).
    let script = format!("read go; ls {} | grep -c json", ledger_dir.display());
    let mut input = exec(grant.lease.id.as_str(), "sh", &[&script]);
    input.stdin = Some("go\n".into());
    let out = within(GUARD, h.call::<DeviceExec>(ctx, &input))
        .await
        .unwrap();
    assert_eq!(out.exit_code, 0);
    assert_eq!(drain(&mut pushes).1.trim(), "1", "recorded while it runs");
    assert!(ledger.entries().is_empty(), "forgotten once it ended");

    // A crash left one running: the next start stops it.
    let mut left = std::process::Command::new("sleep");
    std::os::unix::process::CommandExt::process_group(&mut left, 0);
    let mut left = left.arg("300").spawn().unwrap();
    ledger
        .record(&Entry {
            pid: left.id(),
            program: "sleep".into(),
            args: vec!["300".into()],
            role: Role::Exec,
            device: None,
            port: None,
            started: simlock_daemon::processes::started_of(left.id()),
        })
        .unwrap();
    let _again = Harness::build(Build {
        config: instant_config(),
        exec_ledger: Some(ledger_dir.clone()),
        ..Build::default()
    });
    let status = within(GUARD, tokio::task::spawn_blocking(move || left.wait()))
        .await
        .unwrap()
        .unwrap();
    assert!(!status.success(), "stopped by a signal: {status:?}");
    within(GUARD, async {
        while !ledger.entries().is_empty() {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await;
}
