//! agent-device on a worker, with the published 0.21.5 CLI and daemon as real peers.
//!
//! The package is fetched by `.ci/run` (and `cargo xtask fetch-peers`) into `.cache/`; these
//! tests fail, never skip, when it is missing. The daemon runs on the `linux` platform only
//! (no adb, no Xcode here), so device commands on a leased Android device fail with
//! `TOOL_MISSING`: that failure is itself what the diagnostics flow needs.

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    reason = "tests"
)]

use std::time::Duration;

use http::Method;
use serde_json::{Value, json};
use simlock_e2e::agent_device::{
    AdWorker, Cli, Http, Output, Recorder, agent_device_config, real_daemon_command, real_package,
    rpc_call,
};

const CEILING_MS: i64 = 600_000;
const MAX_RPC: usize = agent_device_front::rpc::MAX_RPC_BODY;

fn driver_id_of(devices: &Value, device_id: &str) -> String {
    devices["devices"]
        .as_array()
        .unwrap()
        .iter()
        .find(|d| d["id"] == device_id)
        .unwrap()["driverDeviceId"]
        .as_str()
        .unwrap()
        .to_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_published_cli_leases_drives_and_releases_a_device_through_a_worker() {
    let pkg = real_package();
    let worker = AdWorker::with_real_daemon().await;
    let (principal, secret) = worker.token("agent").await;
    let recorder = Recorder::start(&worker.origin()).await;
    let base = format!("{}/v1/agent-device", recorder.origin());

    // Health: the host's answer with the daemon's inside, no token needed.
    let health = Http::new()
        .send(Method::GET, &format!("{base}/health"), &[], "")
        .await;
    assert_eq!(health.status, 200);
    assert_eq!(health.json()["ok"], json!(true));
    assert_eq!(health.json()["rpcProtocolVersion"], json!(2));
    assert_eq!(
        health.json()["upstream"]["service"],
        json!("agent-device-daemon")
    );

    let cli = Cli::new(&pkg, &base, &secret);
    cli.connect("android").await;

    // The first device command allocates: a simlock lease owned by the token, with requester
    // and id the lease id the CLI got.
    let first = cli.run(&["devices"]).await;
    let calls = recorder.rpc_calls();
    let (_, _, allocated) = calls
        .iter()
        .find(|(m, _, _)| m == "agent_device.lease.allocate")
        .expect("the CLI allocated");
    let lease_id = allocated["result"]["data"]["lease"]["leaseId"]
        .as_str()
        .expect("a lease id")
        .to_owned();
    let leases = worker.leases().await;
    assert_eq!(leases.len(), 1, "{leases:?}");
    let lease = &leases[0];
    assert_eq!(lease["id"], json!(lease_id));
    assert_eq!(lease["requesterId"], json!(lease_id));
    assert_eq!(lease["ownerId"], json!(principal));
    assert_eq!(lease["ttlMs"], json!(CEILING_MS));
    // The daemon's allocate named the granted device, with the ceiling TTL.
    let devices = worker
        .operator()
        .await
        .call("list.get", json!({"kind": "devices"}))
        .await
        .unwrap();
    let driver_id = driver_id_of(&devices, lease["deviceId"].as_str().unwrap());
    let record = &allocated["result"]["data"]["lease"];
    assert_eq!(
        record["deviceKey"],
        json!(format!("local:android:none:{driver_id}"))
    );
    assert_eq!(
        record["expiresAt"].as_i64().unwrap() - record["createdAt"].as_i64().unwrap(),
        CEILING_MS
    );
    assert_eq!(
        record["tenantId"],
        json!("acme"),
        "the CLI sees its own tenant"
    );
    // That command failed for want of adb; the CLI fetched and saved its diagnostics.
    assert_eq!(first.json["success"], json!(false), "{first:?}");
    assert_eq!(first.json["error"]["code"], json!("TOOL_MISSING"));
    let log_path = first.json["error"]["logPath"].as_str().expect("a log path");
    assert!(
        log_path.contains("remote-diagnostics") && std::path::Path::new(log_path).exists(),
        "the CLI saved the diagnostics at {log_path}"
    );
    assert!(
        recorder
            .exchanges()
            .iter()
            .any(|e| e.path.ends_with("/diagnostics") && e.status == 200)
    );

    // In human mode (a progress stream asked for), `devices` prints agent-device's own error,
    // not simlock's "could not read the device list".
    let human = cli.run_as(Output::Human, &["devices"]).await;
    let printed = format!("{}{}", human.stdout, human.stderr);
    assert!(
        printed.contains("TOOL_MISSING") || printed.contains("adb"),
        "agent-device's own error: {human:?}"
    );
    assert!(
        !printed.contains("could not read the device list"),
        "{human:?}"
    );

    // The next command heartbeats first, and the simlock lease's expiry moves.
    let before = lease["ttlDeadline"].as_i64().unwrap();
    tokio::time::sleep(Duration::from_millis(20)).await; // a different millisecond
    let seen = recorder.rpc_calls().len();
    let _ = cli.run(&["snapshot"]).await;
    let calls = recorder.rpc_calls();
    let later: Vec<&str> = calls[seen..].iter().map(|(m, _, _)| m.as_str()).collect();
    assert_eq!(
        later,
        ["agent_device.lease.heartbeat", "agent_device.command"],
        "a heartbeat, then the command"
    );
    let after = worker.leases().await[0]["ttlDeadline"].as_i64().unwrap();
    assert!(after > before, "the expiry moved: {before} → {after}");

    // An install of a 3 MiB file goes preflight → PUT → finalize through the worker.
    let apk = cli.dir().join("app.apk");
    std::fs::write(&apk, vec![7u8; 3 * 1024 * 1024]).unwrap();
    let install = cli
        .run(&[
            "install",
            "com.example",
            apk.to_str().unwrap(),
            "--platform",
            "android",
        ])
        .await;
    let paths: Vec<(String, u16)> = recorder
        .exchanges()
        .iter()
        .map(|e| (e.path.clone(), e.status.as_u16()))
        .collect();
    let at = |suffix: &str| {
        paths
            .iter()
            .position(|(p, s)| p.contains(suffix) && *s == 200)
            .unwrap_or_else(|| panic!("no 200 for {suffix} in {paths:?} ({install:?})"))
    };
    let (preflight, put, finalize) = (
        at("/upload/preflight"),
        at("/upload/direct/"),
        at("/upload/finalize"),
    );
    assert!(preflight < put && put < finalize, "{paths:?}");
    let put_exchange = &recorder.exchanges()[put];
    assert_eq!(put_exchange.request.len(), 3 * 1024 * 1024);
    assert_eq!(
        put_exchange.request_headers["authorization"],
        format!("Bearer {secret}").as_str(),
        "the ticket carried the caller's own credentials"
    );

    // disconnect ends both leases.
    let disconnect = cli.run(&["disconnect"]).await;
    assert_eq!(disconnect.json["success"], json!(true), "{disconnect:?}");
    let (_, _, released) = recorder
        .rpc_calls()
        .into_iter()
        .rfind(|(m, _, _)| m == "agent_device.lease.release")
        .expect("a release");
    assert_eq!(released["result"]["ok"], json!(true), "{released}");
    assert!(
        worker.leases().await.is_empty(),
        "the simlock lease ended too"
    );

    // No daemon process survives the worker's stop.
    let pids = daemon_pids(&worker);
    assert!(!pids.is_empty());
    worker.stop().await;
    for pid in pids {
        assert!(
            !agent_device_host::process::is_alive(&pid),
            "{pid:?} survived"
        );
    }
}

fn daemon_pids(worker: &AdWorker) -> Vec<agent_device_host::process::Recorded> {
    let file = worker
        .home
        .root()
        .join("agent-device")
        .join(agent_device_host::process::PID_FILE);
    let text = std::fs::read_to_string(file).expect("the pid file");
    let parsed: Value = serde_json::from_str(&text).unwrap();
    serde_json::from_value(parsed["processes"].clone()).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_tokens_never_see_each_others_leases_sessions_or_devices() {
    let worker = AdWorker::with_real_daemon().await;
    let (_, alice) = worker.token("agent").await;
    let (_, bob) = worker.token("agent").await;
    let http = Http::new();
    let base = worker.base();
    let allocate = rpc_call(
        "a1",
        "lease.allocate",
        json!({"session": "s1", "tenantId": "acme", "runId": "run1", "backend": "android-instance"}),
    );
    let answer = http.rpc(&base, &alice, &allocate).await;
    assert_eq!(answer.status, 200, "{answer:?}");
    let lease = answer.json()["result"]["data"]["lease"]["leaseId"]
        .as_str()
        .unwrap()
        .to_owned();

    let not_yours = format!("refused: lease {lease} is not one of yours");
    let command = rpc_call(
        "b1",
        "command",
        json!({"session": "s1", "command": "snapshot",
            "flags": {"leaseId": lease, "runId": "run1", "tenant": "acme"},
            "meta": {"leaseId": lease, "runId": "run1", "tenantId": "acme"}}),
    );
    let refused = http.rpc(&base, &bob, &command).await;
    assert_eq!(refused.status, 403);
    assert_eq!(refused.json()["error"]["data"]["message"], json!(not_yours));
    let heartbeat = rpc_call(
        "b2",
        "lease.heartbeat",
        json!({"session": "s1", "tenantId": "acme", "runId": "run1", "leaseId": lease}),
    );
    let refused = http.rpc(&base, &bob, &heartbeat).await;
    assert_eq!(refused.status, 403);
    assert_eq!(
        refused.json()["error"]["data"]["details"]["reason"],
        json!("LEASE_SCOPE_MISMATCH")
    );
    let release = rpc_call(
        "b3",
        "lease.release",
        json!({"session": "s1", "tenantId": "acme", "runId": "run1", "leaseId": lease}),
    );
    assert_eq!(http.rpc(&base, &bob, &release).await.status, 403);
    // Bob holds nothing, so he sees no device; his requests never named Alice's lease.
    let devices = rpc_call(
        "b4",
        "command",
        json!({"session": "default", "command": "devices"}),
    );
    let answer = http.rpc(&base, &bob, &devices).await;
    assert_eq!(answer.json()["result"]["data"]["devices"], json!([]));
    // Alice's sessions live under her tenant; Bob's requests for them find nothing.
    let alice_tenant = agent_device_front::Tenant::on_worker(
        worker.leases().await[0]["ownerId"].as_str().unwrap(),
    );
    let path = format!(
        "{base}/sessions/{}%3As1/requests/r1/diagnostics",
        alice_tenant.as_str()
    );
    let bearer = format!("Bearer {bob}");
    let peek = http
        .send(Method::GET, &path, &[("authorization", &bearer)], "")
        .await;
    assert_eq!(peek.status, 404, "{peek:?}");
    // And Alice still holds her lease.
    let heartbeat = rpc_call(
        "a2",
        "lease.heartbeat",
        json!({"session": "s1", "tenantId": "acme", "runId": "run1", "leaseId": lease}),
    );
    let kept = http.rpc(&base, &alice, &heartbeat).await;
    assert_eq!(kept.json()["result"]["ok"], json!(true), "{kept:?}");
    assert_eq!(worker.leases().await.len(), 1);
    worker.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bodies_past_their_bounds_and_malformed_lease_ids_are_refused_and_change_nothing() {
    let worker = AdWorker::with_real_daemon().await;
    let (_, secret) = worker.token("agent").await;
    let http = Http::new();
    let base = worker.base();
    let bearer = format!("Bearer {secret}");

    // An allocate padded to exactly 1 MiB is read; one byte more is refused before anything.
    let padded = |len: usize| {
        let mut call = rpc_call(
            "p1",
            "lease.allocate",
            json!({"session": "s1", "tenantId": "acme", "runId": "run1", "backend": "android-instance", "pad": ""}),
        );
        let bare = call.to_string().len();
        call["params"]["pad"] = json!("x".repeat(len - bare));
        let text = call.to_string();
        assert_eq!(text.len(), len);
        text
    };
    let headers = [
        ("content-type", "application/json"),
        ("authorization", bearer.as_str()),
    ];
    let past = http
        .send(
            Method::POST,
            &format!("{base}/rpc"),
            &headers,
            padded(MAX_RPC + 1),
        )
        .await;
    assert_eq!(past.status, 413, "{past:?}");
    assert_eq!(past.json()["error"]["data"]["code"], json!("INVALID_ARGS"));
    assert!(worker.leases().await.is_empty(), "nothing was leased");
    let at = http
        .send(
            Method::POST,
            &format!("{base}/rpc"),
            &headers,
            padded(MAX_RPC),
        )
        .await;
    assert_eq!(at.status, 200, "{at:?}");
    assert_eq!(worker.leases().await.len(), 1);

    // A preflight body past 64 KiB.
    let preflight = |len: usize| {
        let mut body = json!({"uploadAttemptId": "u1", "sha256": "0".repeat(64), "fileName": "a.apk",
            "sizeBytes": 1, "artifactType": "file", "pad": ""});
        let bare = body.to_string().len();
        body["pad"] = json!("x".repeat(len - bare));
        body.to_string()
    };
    let past = http
        .send(
            Method::POST,
            &format!("{base}/upload/preflight"),
            &headers,
            preflight(64 * 1024 + 1),
        )
        .await;
    assert_eq!(past.status, 413, "{past:?}");
    assert_eq!(past.json()["ok"], json!(false));
    let at = http
        .send(
            Method::POST,
            &format!("{base}/upload/preflight"),
            &headers,
            preflight(64 * 1024),
        )
        .await;
    assert_eq!(at.status, 200, "{at:?}");

    // A malformed lease id.
    for bad in [
        "nothex",
        "0123456789ABCDEF0123456789ABCDEF",
        &"a".repeat(33),
    ] {
        let heartbeat = rpc_call(
            "h1",
            "lease.heartbeat",
            json!({"session": "s1", "tenantId": "acme", "runId": "run1", "leaseId": bad}),
        );
        let refused = http.rpc(&base, &secret, &heartbeat).await;
        assert_eq!(refused.status, 400, "{refused:?}");
        assert_eq!(refused.json()["error"]["code"], json!(-32602));
    }
    assert_eq!(worker.leases().await.len(), 1, "nothing changed");
    worker.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_command_before_connect_keeps_the_daemons_refusal_and_gains_the_hint_to_connect() {
    let worker = AdWorker::with_real_daemon().await;
    let (_, secret) = worker.token("agent").await;
    // What the CLI sends for `open` before any `connect`: no run, no lease.
    let command = rpc_call(
        "c1",
        "command",
        json!({"session": "default", "command": "open", "positionals": ["com.example"],
            "flags": {"platform": "android"}, "meta": {}}),
    );
    let answer = Http::new().rpc(&worker.base(), &secret, &command).await;
    let error = &answer.json()["error"];
    assert!(
        error["data"]["message"]
            .as_str()
            .is_some_and(|m| m.starts_with("tenant isolation requires")),
        "{answer:?}"
    );
    assert!(
        error["data"]["hint"]
            .as_str()
            .is_some_and(|h| h.contains("agent-device connect --remote-config")),
        "{answer:?}"
    );
    assert!(worker.leases().await.is_empty(), "nothing leased");
    // The published CLI prints it, in human mode too (which asks for a progress stream).
    let cli = Cli::new(&real_package(), &worker.base(), &secret);
    for output in [Output::Human, Output::Json] {
        let run = cli.run_as(output, &["snapshot"]).await;
        let printed = format!("{}{}", run.stdout, run.stderr);
        assert!(!run.status.success(), "{output:?}: {run:?}");
        assert!(
            printed.contains("agent-device connect --remote-config <file>"),
            "{output:?}: {run:?}"
        );
    }
    assert!(worker.leases().await.is_empty(), "nothing leased");
    worker.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_daemon_is_restarted_and_meanwhile_allocates_answer_not_available() {
    let pkg = real_package();
    let dir = tempfile::tempdir().unwrap();
    let hold = dir.path().join("hold");
    // The daemon runs through a shell that execs it (same pid); a restart waits while the hold
    // file exists, so the test sees the window between the kill and the new daemon.
    let daemon = real_daemon_command(&pkg).join(" ");
    let script = format!(
        "while [ -e '{}' ]; do sleep 0.05; done; exec {daemon}",
        hold.display()
    );
    let mut config = agent_device_config(vec!["sh".into(), "-c".into(), script]);
    config.core.virtual_devices.boot_ms = 10;
    let worker = AdWorker::start(config, |_| {}).await;
    worker.wait_running().await;
    let (_, secret) = worker.token("agent").await;
    let first = daemon_pids(&worker);
    assert!(!first.is_empty(), "the daemon's pid is recorded");
    // A lease held when the daemon dies: the new daemon will not know it.
    let allocate = rpc_call(
        "a1",
        "lease.allocate",
        json!({"session": "s1", "tenantId": "acme", "runId": "run1", "backend": "android-instance"}),
    );
    let held = Http::new().rpc(&worker.base(), &secret, &allocate).await;
    let lease = held.json()["result"]["data"]["lease"]["leaseId"]
        .as_str()
        .unwrap()
        .to_owned();
    assert_eq!(worker.leases().await.len(), 1);
    let mut events = worker.worker().running.base.bus.follow();

    std::fs::write(&hold, b"").unwrap();
    for pid in &first {
        rustix::process::kill_process(
            rustix::process::Pid::from_raw(pid.pid).unwrap(),
            rustix::process::Signal::KILL,
        )
        .unwrap();
    }
    worker
        .wait_host(
            |s| matches!(s, agent_device_host::DaemonState::Unavailable(r) if r.contains("exited")),
        )
        .await;
    let status = worker
        .operator()
        .await
        .call("status.get", json!({}))
        .await
        .unwrap();
    let capability = status["capabilities"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["name"] == "agent-device")
        .unwrap()
        .clone();
    assert_eq!(capability["available"], json!(false));
    assert!(
        capability["reason"]
            .as_str()
            .unwrap()
            .contains("agent-device daemon"),
        "{capability}"
    );
    // The dead daemon's lease ends at once, not at its TTL: its device is free for the queue.
    let released = tokio::time::timeout(simlock_e2e::PATIENCE, async {
        loop {
            let event = events.recv().await.unwrap();
            if event.event == "lease.released" {
                return event;
            }
        }
    })
    .await
    .expect("the lost lease is released");
    assert_eq!(released.payload["leaseId"], json!(lease));
    assert!(worker.leases().await.is_empty());

    let answer = Http::new().rpc(&worker.base(), &secret, &allocate).await;
    let message = answer.json()["error"]["data"]["message"]
        .as_str()
        .unwrap()
        .to_owned();
    assert!(
        message.starts_with("agent-device is not available on this simlock: "),
        "{message}"
    );
    assert!(worker.leases().await.is_empty());

    std::fs::remove_file(&hold).unwrap();
    worker.wait_running().await;
    let again = Http::new().rpc(&worker.base(), &secret, &allocate).await;
    assert_eq!(again.json()["result"]["ok"], json!(true), "{again:?}");
    // The owner's next call on the lost lease says it ended (connect again).
    let heartbeat = rpc_call(
        "h1",
        "lease.heartbeat",
        json!({"session": "s1", "tenantId": "acme", "runId": "run1", "leaseId": lease}),
    );
    let ended = Http::new().rpc(&worker.base(), &secret, &heartbeat).await;
    assert_eq!(
        ended.json()["error"]["data"]["details"]["reason"],
        json!("LEASE_ENDED_BY_HOST"),
        "{ended:?}"
    );
    assert_eq!(worker.leases().await.len(), 1, "the new lease alone");
    for pid in &first {
        assert!(!agent_device_host::process::is_alive(pid));
    }
    worker.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_published_cli_through_a_gateway_lands_on_the_capable_worker_heartbeats_and_disconnects()
 {
    let pkg = real_package();
    let mut gateway = simlock_e2e::gateway_config();
    gateway.agent_device.enabled = true;
    let mut fleet = simlock_e2e::TestFleet::start(gateway).await;
    fleet.add_worker(simlock_e2e::worker_config(2)).await;
    // HTTP on, for the agent of the worker's own tokens.
    let capable = agent_device_config(real_daemon_command(&pkg));
    let daemon_home = tempfile::tempdir().unwrap();
    let home = daemon_home.path().display().to_string();
    fleet
        .join_worker(
            1,
            capable,
            |options| {
                options.agent_device_env = vec![("HOME".into(), home), ("CI".into(), "1".into())]
            },
            true,
        )
        .await;
    let capable_id = fleet.worker_id(1);
    fleet
        .wait_until(|f| {
            f.capable_workers("agent-device")
                .iter()
                .any(|w| w.id == capable_id)
        })
        .await;
    let created = fleet
        .operator()
        .await
        .call("token.create", json!({"role": "agent", "label": "cli"}))
        .await
        .unwrap();
    let (principal, secret) = (
        created["token"]["id"].as_str().unwrap().to_owned(),
        created["secret"].as_str().unwrap().to_owned(),
    );
    let origin = format!("http://{}", fleet.gateway().running.http_addr().unwrap());
    let recorder = Recorder::start(&origin).await;
    let base = format!("{}/v1/agent-device", recorder.origin());
    let health = Http::new()
        .send(Method::GET, &format!("{base}/health"), &[], "")
        .await;
    assert_eq!(
        health.json()["upstream"]["service"],
        json!("agent-device-daemon"),
        "{health:?}"
    );
    let cli = Cli::new(&pkg, &base, &secret);
    for round in 0..5 {
        cli.connect("android").await;
        let _ = cli.run(&["devices"]).await;
        let listed = fleet
            .operator()
            .await
            .call("lease.list", json!({}))
            .await
            .unwrap();
        let leases = listed["leases"].as_array().unwrap().clone();
        assert_eq!(leases.len(), 1, "round {round}: {leases:?}");
        let lease = leases[0]["id"].as_str().unwrap().to_owned();
        assert_eq!(
            leases[0]["workerId"],
            json!(capable_id),
            "round {round} landed on the capable worker"
        );
        assert_eq!(leases[0]["ownerId"], json!(principal));
        assert_eq!(leases[0]["requesterId"], json!(lease));
        if round == 0 {
            // The next command heartbeats through the relay, and the lease's expiry moves.
            let before = fleet.worker(1).worker.lease(&lease).unwrap().ttl_deadline;
            tokio::time::sleep(Duration::from_millis(20)).await;
            let seen = recorder.rpc_calls().len();
            let _ = cli.run(&["snapshot"]).await;
            let methods: Vec<String> = recorder.rpc_calls()[seen..]
                .iter()
                .map(|(m, _, _)| m.clone())
                .collect();
            assert_eq!(
                methods,
                ["agent_device.lease.heartbeat", "agent_device.command"]
            );
            let after = fleet.worker(1).worker.lease(&lease).unwrap().ttl_deadline;
            assert!(after > before, "the expiry moved: {before} → {after}");
            an_agent_of_the_worker_never_reads_the_gateway_agents_session(
                &pkg, &fleet, &recorder, &base, &secret, &lease,
            )
            .await;
        }
        let disconnect = cli.run(&["disconnect"]).await;
        assert_eq!(disconnect.json["success"], json!(true), "{disconnect:?}");
        assert!(
            fleet.worker(1).worker.lease(&lease).is_none(),
            "both leases ended"
        );
    }
    fleet.stop().await;
}

/// The gateway agent's failed command left a diagnostics record in its session on the worker's
/// daemon: the gateway agent reads it (naming its lease), and an agent of the worker's own
/// tokens, straight at the worker, does not, by the session's name or its tenant-qualified one.
async fn an_agent_of_the_worker_never_reads_the_gateway_agents_session(
    pkg: &std::path::Path,
    fleet: &simlock_e2e::TestFleet,
    recorder: &Recorder,
    base: &str,
    secret: &str,
    lease: &str,
) {
    let record = recorder
        .rpc_calls()
        .into_iter()
        .rev()
        .find_map(|(method, _, answer)| {
            (method == "agent_device.command")
                .then(|| answer["error"]["data"]["diagnosticsRecord"].clone())
                .filter(|r| r.is_object())
        })
        .expect("the failed command's diagnostics record");
    let (session, request) = (
        record["session"].as_str().unwrap(),
        record["requestId"].as_str().unwrap(),
    );
    let enc = |s: &str| s.replace(':', "%3A");
    let path = |session: &str| {
        format!(
            "sessions/{}/requests/{}/diagnostics",
            enc(session),
            enc(request)
        )
    };
    let bearer = format!("Bearer {secret}");
    let own = Http::new()
        .send(
            Method::GET,
            &format!("{base}/{}", path(session)),
            &[
                ("authorization", bearer.as_str()),
                ("x-agent-device-lease-id", lease),
            ],
            "",
        )
        .await;
    assert_eq!(own.status, 200, "the gateway agent reads its own: {own:?}");
    let created = simlock_e2e::session(
        &fleet.worker(1).running.socket_path(),
        "operator",
        Some(&fleet.worker_home(1)),
    )
    .await
    .call("token.create", json!({"role": "agent", "label": "direct"}))
    .await
    .unwrap();
    let direct = format!("Bearer {}", created["secret"].as_str().unwrap());
    let worker_base = format!(
        "http://{}/v1/agent-device",
        fleet.worker(1).running.http_addr().unwrap()
    );
    let gateway_id = fleet.gateway().fleet.gateway_id().to_owned();
    let principal = fleet
        .gateway()
        .fleet
        .lease(lease)
        .expect("indexed")
        .owner_id;
    let tenant = agent_device_front::Tenant::through_gateway(&gateway_id, &principal);
    for named in [session.to_owned(), format!("{}:{session}", tenant.as_str())] {
        let peek = Http::new()
            .send(
                Method::GET,
                &format!("{worker_base}/{}", path(&named)),
                &[("authorization", direct.as_str())],
                "",
            )
            .await;
        assert_eq!(peek.status, 404, "{named}: {peek:?}");
    }
    // The same agent with the published CLI, connected to the worker straight: its failed
    // command's diagnostics, which the CLI fetches and saves, are its own session's, and the
    // gateway agent's request is not among them.
    let cli = Cli::new(pkg, &worker_base, created["secret"].as_str().unwrap());
    cli.connect("android").await;
    let failed = cli.run(&["snapshot"]).await;
    assert_eq!(
        failed.json["error"]["code"],
        json!("TOOL_MISSING"),
        "{failed:?}"
    );
    let own = &failed.json["error"]["diagnosticsRecord"];
    assert!(own["requestId"].is_string(), "{failed:?}");
    assert_ne!(own["requestId"], json!(request));
    assert_ne!(own["session"], json!(session), "its own session");
    let log_path = failed.json["error"]["logPath"]
        .as_str()
        .expect("a log path");
    let saved = std::fs::read_to_string(log_path).expect("the CLI saved its diagnostics");
    assert!(
        !saved.contains(request) && !saved.contains(tenant.as_str()),
        "nothing of the gateway agent's session: {saved}"
    );
    let disconnect = cli.run(&["disconnect"]).await;
    assert_eq!(disconnect.json["success"], json!(true), "{disconnect:?}");
}
