//! agent-device on a worker over an in-process fake of the daemon (`agent-device-fake`), where
//! a test needs to steer the daemon or move time: artifacts, long commands, `release --all`,
//! failing releases, pinned commands, the device list, waiting allocates.

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    reason = "tests"
)]

use std::future::Future;
use std::time::Duration;

use agent_device_fake::{
    DaemonError, Device, DeviceKind, DeviceTarget, DevicesAnswer, ErrorCode, FakeAgentDevice,
    FakeOptions, Platform,
};
use http::Method;
use serde_json::{Value, json};
use simlock_e2e::PATIENCE;
use simlock_e2e::agent_device::{
    AdWorker, Carried, Cli, Http, attached_config, callers_heartbeats, callers_requests,
    real_package, received, rpc_answer, rpc_call, stopping_message,
};

fn allocate_call(id: &str, session: &str) -> Value {
    rpc_call(
        id,
        "lease.allocate",
        json!({"session": session, "tenantId": "acme", "runId": "run1", "backend": "android-instance"}),
    )
}

fn command_call(id: &str, session: &str, lease: &str, command: &str, flags: Value) -> Value {
    let mut flags_object = json!({"leaseId": lease, "runId": "run1", "tenant": "acme"});
    if let (Some(into), Some(extra)) = (flags_object.as_object_mut(), flags.as_object()) {
        into.extend(extra.clone());
    }
    rpc_call(
        id,
        "command",
        json!({"session": session, "command": command, "positionals": [],
            "flags": flags_object,
            "meta": {"leaseId": lease, "runId": "run1", "tenantId": "acme", "requestId": id}}),
    )
}

fn heartbeat_call(id: &str, session: &str, lease: &str) -> Value {
    rpc_call(
        id,
        "lease.heartbeat",
        json!({"session": session, "tenantId": "acme", "runId": "run1", "leaseId": lease}),
    )
}

/// Allocates through the front and answers the lease id the CLI would keep.
async fn allocate(http: &Http, worker: &AdWorker, token: &str, session: &str) -> String {
    let answer = http
        .rpc(&worker.base(), token, &allocate_call("a1", session))
        .await;
    assert_eq!(answer.status, 200, "{answer:?}");
    answer.json()["result"]["data"]["lease"]["leaseId"]
        .as_str()
        .unwrap()
        .to_owned()
}

/// The driver's id of the device simlock lease `lease` holds.
async fn device_address(worker: &AdWorker, lease: &str) -> String {
    let leases = worker.leases().await;
    let device = leases.iter().find(|l| l["id"] == lease).unwrap()["deviceId"].clone();
    let devices = worker
        .operator()
        .await
        .call("list.get", json!({"kind": "devices"}))
        .await
        .unwrap();
    devices["devices"]
        .as_array()
        .unwrap()
        .iter()
        .find(|d| d["id"] == device)
        .unwrap()["driverDeviceId"]
        .as_str()
        .unwrap()
        .to_owned()
}

fn android(id: &str) -> Device {
    Device {
        platform: Platform::Android,
        id: id.into(),
        name: format!("emulator {id}"),
        kind: DeviceKind::Emulator,
        target: DeviceTarget::Mobile,
        booted: true,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_screenshot_artifact_downloads_through_the_worker_with_the_published_cli() {
    let pkg = real_package();
    let fake = FakeAgentDevice::start(FakeOptions::default()).unwrap();
    let worker = AdWorker::with_fake(attached_config(), &fake).await;
    let (_, secret) = worker.token("agent").await;
    let cli = Cli::new(&pkg, &worker.base(), &secret);
    cli.connect("android").await;
    // The first device command allocates; the fake then lists the leased emulator.
    let _ = cli.run(&["devices"]).await;
    let lease = worker.leases().await[0]["id"].as_str().unwrap().to_owned();
    fake.set_devices(DevicesAnswer::List(vec![android(
        &device_address(&worker, &lease).await,
    )]));
    let shot = cli.dir().join("shot.png");
    let opened = cli.run(&["open", "com.example"]).await;
    assert_eq!(opened.json["success"], json!(true), "{opened:?}");
    let taken = cli.run(&["screenshot", shot.to_str().unwrap()]).await;
    assert_eq!(taken.json["success"], json!(true), "{taken:?}");
    let bytes = std::fs::read(&shot).expect("the CLI saved the artifact");
    assert_eq!(bytes, agent_device_fake::TINY_PNG, "byte for byte");
    // The download went through the worker, under the caller's tenant.
    let download = fake
        .requests()
        .into_iter()
        .find(|r| r.path.starts_with("/artifacts/"))
        .expect("the artifact was fetched");
    assert_eq!(download.status, Some(200));
    let tenant = download
        .headers
        .iter()
        .find(|(k, _)| k == "x-agent-device-tenant")
        .map(|(_, v)| v.clone());
    assert!(
        tenant.is_some_and(|t| t.starts_with("tok_5f_")),
        "the token's tenant"
    );
    let _ = cli.run(&["disconnect"]).await;
    worker.stop().await;
    fake.stop().await;
}

#[tokio::test]
async fn a_long_command_keeps_its_simlock_lease_alive_past_two_ttls_until_the_front_stops() {
    let fake = FakeAgentDevice::start(FakeOptions::default()).unwrap();
    let mut config = attached_config();
    config.agent_device.lease_ttl_cap_ms = Some(10_000);
    let worker = AdWorker::with_fake(config, &fake).await;
    let (_, secret) = worker.token("agent").await;
    let http = Http::new();
    let lease = allocate(&http, &worker, &secret, "s1").await;
    assert_eq!(worker.leases().await[0]["ttlMs"], json!(10_000));
    let hold = fake.hold_commands("snapshot");
    let (base, token) = (worker.base(), secret.clone());
    let call = command_call("c1", "s1", &lease, "snapshot", json!({}));
    let running = tokio::spawn(async move { Http::new().rpc(&base, &token, &call).await });
    tokio::time::timeout(PATIENCE, hold.wait_entered(1))
        .await
        .unwrap();
    // Time moves on a paused clock: two and a half TTLs pass while the command runs.
    tokio::time::pause();
    let mut events = worker.worker().running.base.bus.follow();
    let start = tokio::time::Instant::now();
    let mut renewals = 0;
    while start.elapsed() < Duration::from_millis(25_000) {
        let event = tokio::time::timeout(Duration::from_secs(30), events.recv())
            .await
            .expect("something happens within a TTL")
            .unwrap();
        if event.event == "lease.renewed" {
            renewals += 1;
        }
        assert!(
            event.event != "lease.expired",
            "the lease expired at {:?}",
            start.elapsed()
        );
    }
    assert!(renewals >= 6, "renewed every TTL/3: {renewals}");
    assert_eq!(worker.leases().await.len(), 1, "the lease is alive");
    // A front that stopped renews no more, the command still running in the daemon (the
    // caller was answered that the daemon is stopping): the next word of the lease is its
    // expiry.
    let front = &worker.worker().agent_device.as_ref().unwrap().front;
    front.stop().await;
    let mut after_stop = worker.worker().running.base.bus.follow();
    loop {
        let event = tokio::time::timeout(Duration::from_secs(30), after_stop.recv())
            .await
            .expect("the lease expires within a TTL")
            .unwrap();
        assert_ne!(event.event, "lease.renewed", "renewed after the stop");
        if event.event == "lease.expired" {
            break;
        }
    }
    tokio::time::resume();
    hold.release();
    let answer = running.await.unwrap();
    assert_eq!(answer.status, 503, "{answer:?}");
    assert_eq!(
        answer.json()["error"]["data"]["message"],
        stopping_message(),
        "{answer:?}"
    );
    worker.stop().await;
    fake.stop().await;
}

/// A command the daemon never answers ends at agent-device's own proxy bound: the CLI gets a
/// retriable refusal naming it (not a request that hangs for as long as the lease renews).
#[tokio::test]
async fn a_command_the_daemon_never_answers_is_refused_at_the_proxys_bound() {
    let fake = FakeAgentDevice::start(FakeOptions::default()).unwrap();
    let worker = AdWorker::with_fake(attached_config(), &fake).await;
    let (_, secret) = worker.token("agent").await;
    let lease = allocate(&Http::new(), &worker, &secret, "s1").await;
    let hold = fake.hold_commands("snapshot");
    let call = command_call("c1", "s1", &lease, "snapshot", json!({}));
    // Not `Http`: its own bound is shorter than the host's.
    let request = http::Request::post(format!("{}/rpc", worker.base()))
        .header("content-type", "application/json")
        .header("authorization", format!("Bearer {secret}"))
        .body(http_body_util::Full::new(bytes::Bytes::from(
            call.to_string(),
        )))
        .unwrap();
    let client = hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
        .build_http();
    let running = tokio::spawn(async move {
        let response = client.request(request).await.unwrap();
        let status = response.status();
        let body = http_body_util::BodyExt::collect(response.into_body())
            .await
            .unwrap()
            .to_bytes();
        (status, body)
    });
    tokio::time::timeout(PATIENCE, hold.wait_entered(1))
        .await
        .unwrap();
    tokio::time::pause();
    let started = tokio::time::Instant::now();
    let (status, body) = tokio::time::timeout(Duration::from_secs(400), running)
        .await
        .expect("an answer by the host's bound")
        .unwrap();
    let waited = started.elapsed();
    tokio::time::resume();
    assert!(
        waited >= agent_device_host::COMMAND_TIMEOUT - Duration::from_secs(1),
        "answered at {waited:?}, before the bound"
    );
    let answer: Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(status, 503, "{answer}");
    assert_eq!(
        answer["error"]["data"]["message"],
        json!(
            "agent-device is not available on this simlock: the agent-device daemon did not answer command within 300 s"
        ),
    );
    assert_eq!(answer["error"]["data"]["retriable"], json!(true));
    hold.release();
    worker.stop().await;
    fake.stop().await;
}

/// agent-device lost in the middle of a command that streams its progress (as the CLI asks in
/// human mode): the stream the CLI reads ends with a response line saying so, retriable, not
/// cut short (which the CLI reports as a failure to talk to its daemon).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_progress_stream_cut_by_the_daemons_loss_ends_with_a_response_saying_so() {
    let fake = FakeAgentDevice::start(FakeOptions::default()).unwrap();
    let worker = AdWorker::with_fake(attached_config(), &fake).await;
    let (_, secret) = worker.token("agent").await;
    let lease = allocate(&Http::new(), &worker, &secret, "s1").await;
    let hold = fake.hold_commands("snapshot");
    let mut call = command_call("c1", "s1", &lease, "snapshot", json!({}));
    call["params"]["meta"]["requestProgress"] = json!("command");
    let (base, token) = (worker.base(), secret.clone());
    let running = tokio::spawn(async move { Http::new().rpc(&base, &token, &call).await });
    tokio::time::timeout(PATIENCE, hold.wait_entered(1))
        .await
        .unwrap();
    fake.stop().await;
    let answer = running.await.unwrap();
    assert_eq!(answer.status, 200, "the stream had begun: {answer:?}");
    let (last, carried) = rpc_answer(&answer.body);
    assert_eq!(carried, Carried::StreamsLastLine, "{answer:?}");
    assert_eq!(last["id"], "c1", "{last}");
    let data = &last["error"]["data"];
    assert_eq!(data["code"], "UNAVAILABLE", "{last}");
    assert_eq!(data["retriable"], json!(true), "{last}");
    let message = data["message"].as_str().unwrap();
    assert!(
        message
            .starts_with("agent-device is not available on this simlock: its answer was cut off ("),
        "{message}"
    );
    worker.stop().await;
}

/// A worker that stops while commands wait in its daemon answers them at once, naming the
/// stop: a plain one with the retriable refusal; one that asked for progress the same way, or,
/// when its stream had begun, with a last line saying so (the CLI reads either). It used to
/// hold its stop until the HTTP drain gave up, then cut both.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stopping_worker_answers_the_commands_in_flight_naming_the_stop() {
    let fake = FakeAgentDevice::start(FakeOptions::default()).unwrap();
    let worker = AdWorker::with_fake(attached_config(), &fake).await;
    let (_, secret) = worker.token("agent").await;
    let lease = allocate(&Http::new(), &worker, &secret, "s1").await;
    let hold = fake.hold_commands("snapshot");
    let plain = command_call("c1", "s1", &lease, "snapshot", json!({}));
    let mut streamed = command_call("c2", "s1", &lease, "snapshot", json!({}));
    streamed["params"]["meta"]["requestProgress"] = json!("command");
    let send = |call: Value| {
        let (base, token) = (worker.base(), secret.clone());
        tokio::spawn(async move { Http::new().rpc(&base, &token, &call).await })
    };
    let (plain, streamed) = (send(plain), send(streamed));
    tokio::time::timeout(PATIENCE, hold.wait_entered(2))
        .await
        .unwrap();
    let stopping = tokio::spawn(worker.stop());
    let plain = plain.await.unwrap();
    assert_eq!(plain.status, 503, "{plain:?}");
    let data = &plain.json()["error"]["data"];
    assert_eq!(data["message"], stopping_message(), "{plain:?}");
    assert_eq!(data["retriable"], json!(true));
    let streamed = streamed.await.unwrap();
    let (answer, carried) = rpc_answer(&streamed.body);
    assert!(
        matches!(
            (streamed.status.as_u16(), carried),
            (503, Carried::Plain) | (200, Carried::StreamsLastLine)
        ),
        "{streamed:?}"
    );
    assert_eq!(answer["id"], "c2", "{answer}");
    assert_eq!(
        answer["error"]["data"]["message"],
        stopping_message(),
        "{answer}"
    );
    stopping.await.unwrap();
    hold.release();
    fake.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn release_all_ends_the_agent_device_lease_before_the_device_is_reclaimed() {
    let fake = FakeAgentDevice::start(FakeOptions::default()).unwrap();
    let worker = AdWorker::with_fake(attached_config(), &fake).await;
    let (_, secret) = worker.token("agent").await;
    let http = Http::new();
    let lease = allocate(&http, &worker, &secret, "s1").await;
    assert_eq!(fake.leases().len(), 1);
    let hold = fake.hold_commands("lease_release");
    let mut events = worker.worker().running.base.bus.follow();
    worker
        .operator()
        .await
        .call("lease.release-all", json!({}))
        .await
        .unwrap();
    // The host's release reaches agent-device while the device waits, reclaiming.
    tokio::time::timeout(PATIENCE, hold.wait_entered(1))
        .await
        .unwrap();
    let devices = worker
        .operator()
        .await
        .call("list.get", json!({"kind": "devices"}))
        .await
        .unwrap();
    assert_eq!(
        devices["devices"][0]["state"],
        json!("reclaiming"),
        "{devices}"
    );
    hold.release();
    loop {
        let event = tokio::time::timeout(PATIENCE, events.recv())
            .await
            .unwrap()
            .unwrap();
        if event.event == "device.reclaimed" {
            break;
        }
    }
    assert!(fake.leases().is_empty(), "agent-device's lease ended first");
    // The next heartbeat reaches agent-device, which says the lease is gone: ended by simlock.
    let answer = http
        .rpc(&worker.base(), &secret, &heartbeat_call("h1", "s1", &lease))
        .await;
    assert_eq!(answer.status, 401, "{answer:?}");
    assert_eq!(
        answer.json()["error"]["data"]["details"]["reason"],
        json!("LEASE_ENDED_BY_HOST")
    );
    assert_eq!(callers_heartbeats(&fake), 1);
    // And again for every later call naming it, without asking agent-device.
    for call in [
        heartbeat_call("h2", "s1", &lease),
        command_call("c1", "s1", &lease, "snapshot", json!({})),
    ] {
        let again = http.rpc(&worker.base(), &secret, &call).await;
        assert_eq!(ended_reason(&again), "LEASE_ENDED_BY_HOST", "{again:?}");
    }
    assert_eq!(callers_heartbeats(&fake), 1);
    worker.stop().await;
    fake.stop().await;
}

/// The reason in a refusal's details (`LEASE_ENDED_BY_HOST`, `LEASE_SCOPE_MISMATCH`).
fn ended_reason(answer: &simlock_e2e::agent_device::Answer) -> String {
    answer.json()["error"]["data"]["details"]["reason"]
        .as_str()
        .unwrap_or_default()
        .to_owned()
}

/// A worker that restarts keeps its simlock leases on disk, but its agent-device daemon starts
/// anew without them: the owner's next call hears `LEASE_ENDED_BY_HOST` (and again on every
/// later call) and the device is freed; another token naming the lease is still refused as
/// not its own. Before this, the owner was told "not one of yours" for good and the device
/// stayed leased until the TTL ran out.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn after_a_worker_restart_its_agent_device_leases_end_for_their_owners_only() {
    let fake = FakeAgentDevice::start(FakeOptions::default()).unwrap();
    let mut worker = AdWorker::with_fake(attached_config(), &fake).await;
    let (_, owner) = worker.token("agent").await;
    let (_, other) = worker.token("agent").await;
    let http = Http::new();
    let lease = allocate(&http, &worker, &owner, "s1").await;
    worker.restart_with_fake(attached_config(), &fake).await;
    worker.wait_running().await;
    assert_eq!(
        worker.leases().await.len(),
        1,
        "the simlock lease is on disk"
    );

    let refused = http
        .rpc(&worker.base(), &other, &heartbeat_call("h0", "s9", &lease))
        .await;
    assert_eq!(
        ended_reason(&refused),
        "LEASE_SCOPE_MISMATCH",
        "{refused:?}"
    );
    let ended = http
        .rpc(&worker.base(), &owner, &heartbeat_call("h1", "s1", &lease))
        .await;
    assert_eq!(ended.status, 401, "{ended:?}");
    assert_eq!(ended_reason(&ended), "LEASE_ENDED_BY_HOST", "{ended:?}");
    assert!(worker.leases().await.is_empty(), "the device is freed");
    for call in [
        heartbeat_call("h2", "s1", &lease),
        command_call("c1", "s1", &lease, "snapshot", json!({})),
    ] {
        let again = http.rpc(&worker.base(), &owner, &call).await;
        assert_eq!(ended_reason(&again), "LEASE_ENDED_BY_HOST", "{again:?}");
        let theirs = http.rpc(&worker.base(), &other, &call).await;
        assert_eq!(ended_reason(&theirs), "LEASE_SCOPE_MISMATCH", "{theirs:?}");
    }
    // A new lease for the owner works as ever.
    allocate(&http, &worker, &owner, "s2").await;
    worker.stop().await;
    fake.stop().await;
}

/// A worker over `fake` whose agent-device leases are capped at 120 s (neither agent-device's
/// default nor the 600 s ceiling), an agent token on it, and that token's lease (session `s1`).
async fn capped_lease(fake: &FakeAgentDevice) -> (AdWorker, String, Http, String) {
    let mut config = attached_config();
    config.agent_device.lease_ttl_cap_ms = Some(120_000);
    let worker = AdWorker::with_fake(config, fake).await;
    let (_, secret) = worker.token("agent").await;
    let http = Http::new();
    let lease = allocate(&http, &worker, &secret, "s1").await;
    (worker, secret, http, lease)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_heartbeat_goes_to_agent_device_first_then_renews_the_simlock_lease_to_its_ttl() {
    let fake = FakeAgentDevice::start(FakeOptions::default()).unwrap();
    let (worker, secret, http, lease) = capped_lease(&fake).await;
    let allocated = received(&fake, "agent_device.lease.allocate");
    assert_eq!(
        allocated[0]["params"]["ttlMs"],
        json!(120_000),
        "the capped ceiling"
    );
    let address = device_address(&worker, &lease).await;
    assert_eq!(
        allocated[0]["params"]["deviceKey"],
        json!(format!("local:android:none:{address}")),
        "the allocate names the granted device"
    );
    let before = worker.leases().await[0]["ttlDeadline"].as_i64().unwrap();
    // A heartbeat agent-device refuses renews nothing.
    fake.fail_next_lease_calls(
        agent_device_fake::LeaseOp::Heartbeat,
        1,
        DaemonError::new(ErrorCode::CommandFailed, "busy"),
    );
    let refused = http
        .rpc(&worker.base(), &secret, &heartbeat_call("h0", "s1", &lease))
        .await;
    assert_eq!(refused.json()["error"]["data"]["message"], json!("busy"));
    assert_eq!(
        worker.leases().await[0]["ttlDeadline"].as_i64().unwrap(),
        before
    );
    tokio::time::sleep(Duration::from_millis(5)).await;
    let answer = http
        .rpc(&worker.base(), &secret, &heartbeat_call("h1", "s1", &lease))
        .await;
    assert_eq!(answer.json()["result"]["ok"], json!(true), "{answer:?}");
    assert_eq!(
        answer.json()["result"]["data"]["lease"]["leaseId"],
        json!(lease)
    );
    let heartbeats = received(&fake, "agent_device.lease.heartbeat");
    assert_eq!(
        heartbeats.last().unwrap()["params"]["ttlMs"],
        json!(120_000)
    );
    let record = &worker.leases().await[0];
    let deadline = record["ttlDeadline"].as_i64().unwrap();
    assert_eq!(
        deadline,
        record["lastRenewedAt"].as_i64().unwrap() + 120_000
    );
    assert!(deadline > before);
    worker.stop().await;
    fake.stop().await;
}

/// agent-device 0.21.5 renews a lease with its default TTL (60 s) on every device command,
/// whatever TTL it had; an agent that then paused for a minute lost its device while simlock
/// still showed minutes left. Once a command's answer ended, the front heartbeats the lease
/// back to its TTL, agent-device's first, then simlock's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn after_a_command_both_leases_are_renewed_to_the_leases_ttl_not_agent_devices_default() {
    let fake = FakeAgentDevice::start(FakeOptions::default()).unwrap();
    let (worker, secret, http, lease) = capped_lease(&fake).await;
    assert_eq!(fake.leases()[0].ttl_ms, 120_000);
    let renewed_before = worker.leases().await[0]["lastRenewedAt"].as_i64().unwrap();
    tokio::time::sleep(Duration::from_millis(5)).await;
    let call = command_call("c1", "s1", &lease, "snapshot", json!({}));
    let answer = http.rpc(&worker.base(), &secret, &call).await;
    assert_eq!(answer.json()["result"]["ok"], json!(true), "{answer:?}");
    // The fake renewed the lease for 60 s when the command came; the front's heartbeat follows
    // the answer.
    wait_for(|| async { fake.leases()[0].ttl_ms == 120_000 && fake.leases()[0].heartbeats == 1 })
        .await;
    let kept = received(&fake, "agent_device.lease.heartbeat");
    assert_eq!(kept.len(), 1);
    let params = &kept[0]["params"];
    assert_eq!(params["ttlMs"], json!(120_000));
    assert_eq!(params["session"], json!("s1"));
    assert_eq!(params["runId"], json!("run1"));
    assert_eq!(params["leaseId"], json!(fake.leases()[0].lease_id.as_str()));
    assert_eq!(kept[0]["id"], json!("c1:keep"));
    // And the simlock lease after it: renewed to its TTL from then.
    wait_for(|| async {
        worker.leases().await[0]["lastRenewedAt"].as_i64().unwrap() > renewed_before
    })
    .await;
    let record = &worker.leases().await[0];
    assert_eq!(
        record["ttlDeadline"].as_i64().unwrap(),
        record["lastRenewedAt"].as_i64().unwrap() + 120_000
    );
    // `close` ends the session: no heartbeat follows it. (A keep of `c2` would be sent before
    // the next command is; `c3`'s comes after `c3`'s answer.)
    let close = command_call("c2", "s1", &lease, "close", json!({}));
    http.rpc(&worker.base(), &secret, &close).await;
    let call = command_call("c3", "s1", &lease, "snapshot", json!({}));
    let answer = http.rpc(&worker.base(), &secret, &call).await;
    assert_eq!(answer.json()["result"]["ok"], json!(true), "{answer:?}");
    wait_for(|| async { fake.leases()[0].heartbeats >= 2 }).await;
    let ids: Vec<Value> = received(&fake, "agent_device.lease.heartbeat")
        .iter()
        .map(|b| b["id"].clone())
        .collect();
    assert_eq!(ids, [json!("c1:keep"), json!("c3:keep")]);
    // A release still ends both.
    let released = http
        .rpc(
            &worker.base(),
            &secret,
            &rpc_call(
                "r1",
                "lease.release",
                json!({"session": "s1", "tenantId": "acme", "runId": "run1", "leaseId": lease}),
            ),
        )
        .await;
    assert_eq!(released.json()["result"]["ok"], json!(true), "{released:?}");
    assert!(worker.leases().await.is_empty(), "the device is freed");
    worker.stop().await;
    fake.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_release_agent_device_fails_keeps_the_simlock_lease_and_a_release_that_works_ends_both() {
    let fake = FakeAgentDevice::start(FakeOptions::default()).unwrap();
    let worker = AdWorker::with_fake(attached_config(), &fake).await;
    let (_, secret) = worker.token("agent").await;
    let http = Http::new();
    let lease = allocate(&http, &worker, &secret, "s1").await;
    let release = rpc_call(
        "r1",
        "lease.release",
        json!({"session": "s1", "tenantId": "acme", "runId": "run1", "leaseId": lease}),
    );
    fake.fail_next_releases(1, DaemonError::new(ErrorCode::CommandFailed, "not now"));
    let failed = http.rpc(&worker.base(), &secret, &release).await;
    assert_eq!(failed.json()["error"]["data"]["message"], json!("not now"));
    assert_eq!(worker.leases().await.len(), 1, "the simlock lease stays");
    let released = http.rpc(&worker.base(), &secret, &release).await;
    assert_eq!(
        released.json()["result"]["data"]["released"],
        json!(true),
        "{released:?}"
    );
    assert!(worker.leases().await.is_empty());
    // A second release answers released:false as a normal answer, as agent-device does.
    let releases = received(&fake, "agent_device.lease.release").len();
    let again = http.rpc(&worker.base(), &secret, &release).await;
    assert_eq!(again.status, 200, "{again:?}");
    assert_eq!(again.json()["result"]["data"]["released"], json!(false));
    assert_eq!(again.json()["id"], json!("r1"));
    assert_eq!(
        received(&fake, "agent_device.lease.release").len(),
        releases,
        "answered by the front"
    );
    // Another token releasing it is refused as before.
    let (_, other) = worker.token("agent").await;
    let theirs = http.rpc(&worker.base(), &other, &release).await;
    assert_eq!(theirs.status, 403, "{theirs:?}");
    worker.stop().await;
    fake.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn commands_are_pinned_to_the_leased_device_and_a_device_selector_is_refused() {
    let fake = FakeAgentDevice::start(FakeOptions::default()).unwrap();
    let worker = AdWorker::with_fake(attached_config(), &fake).await;
    let (_, secret) = worker.token("agent").await;
    let http = Http::new();
    let lease = allocate(&http, &worker, &secret, "s1").await;
    let address = device_address(&worker, &lease).await;
    fake.set_devices(DevicesAnswer::List(vec![
        android(&address),
        android("emulator-5556"),
    ]));
    let answer = http
        .rpc(
            &worker.base(),
            &secret,
            &command_call("c1", "s1", &lease, "open", json!({"device": "Pixel 8"})),
        )
        .await;
    assert_eq!(answer.status, 200, "{answer:?}");
    let sent = received(&fake, "agent_device.command");
    let flags = &sent.last().unwrap()["params"]["flags"];
    assert_eq!(
        flags["serial"],
        json!(address),
        "pinned to the leased emulator"
    );
    assert!(
        flags.get("device").is_none(),
        "the profile's device name is dropped"
    );
    assert_eq!(flags["sessionIsolation"], json!("tenant"));
    assert_ne!(
        flags["leaseId"],
        json!(lease),
        "agent-device sees its own lease id"
    );
    for selector in [json!({"udid": "X"}), json!({"serial": "emulator-5556"})] {
        let refused = http
            .rpc(
                &worker.base(),
                &secret,
                &command_call("c2", "s1", &lease, "open", selector),
            )
            .await;
        assert_eq!(refused.status, 400);
        assert_eq!(
            refused.json()["error"]["data"]["message"],
            json!("refused: simlock picks the device")
        );
    }
    assert_eq!(
        received(&fake, "agent_device.command").len(),
        1,
        "nothing more reached it"
    );
    worker.stop().await;
    fake.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn devices_lists_only_the_devices_the_token_leases() {
    let fake = FakeAgentDevice::start(FakeOptions::default()).unwrap();
    let worker = AdWorker::with_fake(attached_config(), &fake).await;
    let (_, alice) = worker.token("agent").await;
    let (_, bob) = worker.token("agent").await;
    let http = Http::new();
    let devices = |id: &str| {
        rpc_call(
            id,
            "command",
            json!({"session": "default", "command": "devices", "positionals": [], "flags": {}, "meta": {}}),
        )
    };
    // Nothing held: the empty list, and agent-device is not asked.
    let none = http.rpc(&worker.base(), &alice, &devices("d0")).await;
    assert_eq!(none.json()["result"]["data"]["devices"], json!([]));
    assert!(received(&fake, "agent_device.command").is_empty());
    let lease_a = allocate(&http, &worker, &alice, "s1").await;
    let lease_b = allocate(&http, &worker, &bob, "s2").await;
    let (a, b) = (
        device_address(&worker, &lease_a).await,
        device_address(&worker, &lease_b).await,
    );
    fake.set_devices(DevicesAnswer::List(vec![
        android(&a),
        android(&b),
        android("emulator-9999"),
    ]));
    let listed = http.rpc(&worker.base(), &alice, &devices("d1")).await;
    let ids: Vec<Value> = listed.json()["result"]["data"]["devices"]
        .as_array()
        .unwrap()
        .iter()
        .map(|d| d["id"].clone())
        .collect();
    assert_eq!(ids, vec![json!(a)], "only Alice's device");
    fake.set_devices(DevicesAnswer::NoList);
    let unreadable = http.rpc(&worker.base(), &alice, &devices("d2")).await;
    assert_eq!(unreadable.status, 502);
    assert_eq!(
        unreadable.json()["error"]["data"]["message"],
        json!(format!(
            "could not read the device list from the worker holding lease {lease_a}"
        ))
    );
    worker.stop().await;
    fake.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_allocate_waits_for_a_device_and_one_whose_caller_hangs_up_is_withdrawn() {
    let fake = FakeAgentDevice::start(FakeOptions::default()).unwrap();
    let mut config = attached_config();
    config.core.capacity.max_running = 1;
    let worker = AdWorker::with_fake(config, &fake).await;
    let (_, alice) = worker.token("agent").await;
    let (_, bob) = worker.token("agent").await;
    let (_, carol) = worker.token("agent").await;
    let http = Http::new();
    let lease_a = allocate(&http, &worker, &alice, "s1").await;
    // Bob waits behind Alice's lease; Carol waits too, then hangs up.
    let (base, token) = (worker.base(), bob.clone());
    let bob_waits = tokio::spawn(async move {
        Http::new()
            .rpc(&base, &token, &allocate_call("b1", "s2"))
            .await
    });
    let (base, token) = (worker.base(), carol.clone());
    let carol_waits = tokio::spawn(async move {
        Http::new()
            .rpc(&base, &token, &allocate_call("c1", "s3"))
            .await
    });
    wait_for(|| waiting(&worker, 2)).await;
    carol_waits.abort();
    wait_for(|| waiting(&worker, 1)).await;
    let release = rpc_call(
        "r1",
        "lease.release",
        json!({"session": "s1", "tenantId": "acme", "runId": "run1", "leaseId": lease_a}),
    );
    http.rpc(&worker.base(), &alice, &release).await;
    let granted = bob_waits.await.unwrap();
    assert_eq!(granted.json()["result"]["ok"], json!(true), "{granted:?}");
    let leases = worker.leases().await;
    assert_eq!(leases.len(), 1, "Bob's, and nothing for Carol: {leases:?}");
    assert_eq!(fake.leases().len(), 1);
    worker.stop().await;
    fake.stop().await;
}

/// Outside trial 23: an allocate queued behind busy devices got no answer until the CLI gave
/// up (330 s) with only `Daemon request timed out`. It waits `agentDevice.queueWaitMs` in the
/// queue, then is refused saying why, and its request leaves the queue.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_allocate_that_waits_past_the_queue_wait_is_refused_saying_so() {
    let fake = FakeAgentDevice::start(FakeOptions::default()).unwrap();
    let mut config = attached_config();
    config.core.capacity.max_running = 1;
    config.agent_device.queue_wait_ms = 300;
    let worker = AdWorker::with_fake(config, &fake).await;
    let (_, alice) = worker.token("agent").await;
    let (_, bob) = worker.token("agent").await;
    let http = Http::new();
    allocate(&http, &worker, &alice, "s1").await;
    let refused = tokio::time::timeout(
        PATIENCE,
        http.rpc(&worker.base(), &bob, &allocate_call("b1", "s2")),
    )
    .await
    .expect("answered within the bound");
    let error = &refused.json()["error"];
    assert_eq!(
        error["data"]["message"],
        "refused by simlock: no device became free within 300ms in simlock's queue (agentDevice.queueWaitMs); try again later",
        "{refused:?}"
    );
    assert!(waiting(&worker, 0).await, "nothing is left waiting");
    assert_eq!(worker.leases().await.len(), 1, "Alice's only");
    assert_eq!(fake.leases().len(), 1);
    worker.stop().await;
    fake.stop().await;
}

/// Whether `n` requests wait on the worker.
async fn waiting(worker: &AdWorker, n: usize) -> bool {
    let status = worker
        .operator()
        .await
        .call("status.get", json!({}))
        .await
        .unwrap();
    status["waiting"].as_array().map_or(0, Vec::len) == n
}

/// Polls `check` (each poll a real call) until it holds, within [`PATIENCE`].
async fn wait_for<F, Fut>(check: F)
where
    F: Fn() -> Fut,
    Fut: Future<Output = bool>,
{
    tokio::time::timeout(PATIENCE, async {
        while !check().await {
            tokio::task::yield_now().await;
        }
    })
    .await
    .expect("the state was reached within the bound");
}

/// An allocate whose params are of the wrong type is refused naming the param and leases
/// nothing (a `backend` of `5` leased the default platform's device); a call of an unknown
/// method is "Method not found" with its id, params or not.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_calls_are_refused_with_json_rpcs_codes_and_lease_nothing() {
    let fake = FakeAgentDevice::start(FakeOptions::default()).unwrap();
    let worker = AdWorker::with_fake(attached_config(), &fake).await;
    let (_, secret) = worker.token("agent").await;
    let http = Http::new();
    for (params, message) in [
        (
            json!({"session": "s", "tenantId": "t", "runId": "r", "backend": 5}),
            "Invalid params: backend must be a string",
        ),
        (
            json!({"session": "s", "tenantId": "t", "runId": "r", "backend": "android-instance", "ttlMs": "huge"}),
            "Invalid params: ttlMs must be a whole number of milliseconds",
        ),
        (
            json!({"session": "s", "tenantId": "t", "runId": "r", "backend": "android-instance", "ttlMs": 600_001}),
            "Invalid params: ttlMs must be between 5000 and 600000",
        ),
    ] {
        let refused = http
            .rpc(
                &worker.base(),
                &secret,
                &rpc_call("a1", "lease.allocate", params),
            )
            .await;
        assert_eq!(refused.status, 400, "{refused:?}");
        assert_eq!(refused.json()["error"]["code"], json!(-32602));
        assert_eq!(refused.json()["error"]["data"]["message"], json!(message));
        assert_eq!(refused.json()["id"], json!("a1"));
    }
    assert!(worker.leases().await.is_empty(), "nothing was leased");
    assert!(received(&fake, "agent_device.lease.allocate").is_empty());
    let unknown = json!({"jsonrpc": "2.0", "id": 9, "method": "nope"});
    let answer = http.rpc(&worker.base(), &secret, &unknown).await;
    assert_eq!(
        answer.status, 404,
        "as agent-device's daemon answers: {answer:?}"
    );
    assert_eq!(answer.json()["error"]["code"], json!(-32601), "{answer:?}");
    assert_eq!(
        answer.json()["error"]["message"],
        json!("Method not found: nope")
    );
    assert_eq!(answer.json()["id"], json!(9));
    let no_params = json!({"jsonrpc": "2.0", "id": 10, "method": "agent_device.command"});
    let answer = http.rpc(&worker.base(), &secret, &no_params).await;
    assert_eq!(answer.json()["error"]["code"], json!(-32602), "{answer:?}");
    assert_eq!(answer.json()["id"], json!(10), "the id is echoed once read");
    worker.stop().await;
    fake.stop().await;
}

/// The agent-device routes take no WebSocket: a request asking for one answers
/// `404 UNKNOWN_REQUEST`, before its token is read, as every route but the gateway's uplink
/// does; nothing reaches agent-device.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_websocket_upgrade_on_an_agent_device_route_is_refused_and_nothing_is_forwarded() {
    let fake = FakeAgentDevice::start(FakeOptions::default()).unwrap();
    let worker = AdWorker::with_fake(attached_config(), &fake).await;
    let (_, secret) = worker.token("agent").await;
    let bearer = format!("Bearer {secret}");
    let seen = callers_requests(&fake).len();
    for (method, route, token) in [
        (Method::GET, "health", None),
        (Method::POST, "rpc", Some(bearer.as_str())),
        (Method::POST, "rpc", None),
        (Method::GET, "artifacts/a1", Some(bearer.as_str())),
    ] {
        let mut headers = vec![
            ("connection", "Upgrade"),
            ("upgrade", "websocket"),
            ("sec-websocket-version", "13"),
            ("sec-websocket-key", "dGhlIHNhbXBsZSBub25jZQ=="),
        ];
        if let Some(bearer) = token {
            headers.push(("authorization", bearer));
        }
        let url = format!("{}/{route}", worker.base());
        let refused = Http::new().send(method, &url, &headers, "{}").await;
        assert_eq!(refused.status, 404, "{route}: {refused:?}");
        assert_eq!(
            refused.json()["error"]["code"],
            "UNKNOWN_REQUEST",
            "{route}"
        );
    }
    assert_eq!(
        callers_requests(&fake).len(),
        seen,
        "nothing reached agent-device"
    );
    worker.stop().await;
    fake.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_platform_the_worker_has_no_device_of_is_refused_and_nothing_is_leased() {
    let fake = FakeAgentDevice::start(FakeOptions::default()).unwrap();
    let mut config = attached_config();
    config
        .core
        .virtual_devices
        .models
        .retain(|m| m.platform == simlock_contract::model::Platform::Android);
    let worker = AdWorker::with_fake(config, &fake).await;
    let (_, secret) = worker.token("agent").await;
    let http = Http::new();
    for (backend, name) in [
        ("ios-simulator", "ios"),
        ("harmonyos-instance", "harmonyos"),
    ] {
        let call = rpc_call(
            "a1",
            "lease.allocate",
            json!({"session": "s", "tenantId": "acme", "runId": "r", "backend": backend}),
        );
        let refused = http.rpc(&worker.base(), &secret, &call).await;
        assert_eq!(
            refused.json()["error"]["data"]["message"],
            json!(format!("refused: {name} is not available on this simlock"))
        );
    }
    assert!(worker.leases().await.is_empty());
    assert!(received(&fake, "agent_device.lease.allocate").is_empty());
    worker.stop().await;
    fake.stop().await;
}

/// Every route but `/health` needs a token, an unknown one too: without a valid token it is a
/// 401, as on the rest of `/v1`; with one, a 404.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unknown_route_needs_a_token_before_it_is_a_404() {
    let fake = FakeAgentDevice::start(FakeOptions::default()).unwrap();
    let worker = AdWorker::with_fake(attached_config(), &fake).await;
    let (_, secret) = worker.token("agent").await;
    let http = Http::new();
    let url = format!("{}/nope", worker.base());
    for headers in [vec![], vec![("authorization", "Bearer slk_nope")]] {
        let answer = http.send(Method::GET, &url, &headers, "").await;
        assert_eq!(answer.status, 401, "{headers:?}: {answer:?}");
        assert_eq!(answer.json()["code"], json!("UNAUTHORIZED"), "{answer:?}");
    }
    let bearer = format!("Bearer {secret}");
    let answer = http
        .send(Method::GET, &url, &[("authorization", &bearer)], "")
        .await;
    assert_eq!(answer.status, 404, "{answer:?}");
    assert_eq!(answer.json()["code"], json!("NOT_FOUND"), "{answer:?}");
    assert!(fake.requests().is_empty(), "nothing reached agent-device");
    worker.stop().await;
    fake.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_agent_device_off_every_route_answers_404() {
    let mut config = simlock_e2e::worker_config(1);
    config.daemon.http.enabled = Some(true);
    config.daemon.http.port = 0;
    let worker = AdWorker::start(config, |_| {}).await;
    let (_, secret) = worker.token("agent").await;
    let bearer = format!("Bearer {secret}");
    let http = Http::new();
    for (method, route) in [
        (Method::GET, "health"),
        (Method::POST, "rpc"),
        (Method::POST, "upload/preflight"),
        (Method::GET, "artifacts/a1"),
        (Method::GET, "sessions/s/requests/r/diagnostics"),
    ] {
        let answer = http
            .send(
                method,
                &format!("{}/{route}", worker.base()),
                &[("authorization", &bearer)],
                "",
            )
            .await;
        assert_eq!(answer.status, 404, "{route}: {answer:?}");
    }
    worker.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_a_worker_the_lease_header_is_not_read() {
    let fake = FakeAgentDevice::start(FakeOptions::default()).unwrap();
    let worker = AdWorker::with_fake(attached_config(), &fake).await;
    let (_, secret) = worker.token("agent").await;
    let (_, other) = worker.token("agent").await;
    let http = Http::new();
    let others = allocate(&http, &worker, &other, "s9").await;
    let bearer = format!("Bearer {secret}");
    let before = callers_requests(&fake).len();
    for header in [Some(others.as_str()), Some("NOT-A-LEASE"), None] {
        let mut headers = vec![("authorization", bearer.as_str())];
        if let Some(value) = header {
            headers.push(("x-agent-device-lease-id", value));
        }
        let answer = http
            .send(
                Method::GET,
                &format!("{}/artifacts", worker.base()),
                &headers,
                "",
            )
            .await;
        assert_eq!(
            answer.status, 200,
            "{header:?}: forwarded as ever: {answer:?}"
        );
    }
    assert_eq!(callers_requests(&fake).len(), before + 3);
    worker.stop().await;
    fake.stop().await;
}
