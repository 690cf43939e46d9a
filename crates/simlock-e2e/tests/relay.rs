//! The relay, end to end: a real gateway and real workers over loopback WebSockets with fake
//! relay targets; a raw gateway end driving a real worker; and a scripted worker speaking raw
//! relay frames to the real gateway. Each test names the seed line it proves.

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    reason = "tests fail by panicking"
)]

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use bytes::Bytes;
use futures::{FutureExt, StreamExt};
use http::{HeaderValue, Method, StatusCode};
use http_body::Body as _;
use http_body_util::BodyExt;
use serde_json::{Value, json};
use simlock_contract::{ContractError, ErrorCode};
use simlock_e2e::relay::{
    PatternBody, PatternCheck, Probe, RawWorker, ScriptedCall, ScriptedWorker, add_relay_worker,
    fill_pattern, fleet_with, gateway_link_stats, get, get_call, link_config, logs,
    no_channel_open, patient, pattern, pattern_response, pushes_and_reply, put_call, raw_request,
    read_body, relay, relay_targets, request, respond, spawn_relay, wait_until,
};
use simlock_e2e::{TestFleet, gateway_config, session, worker_config};
use simlock_link::{End, FailureReason, LinkConfig};
use simlock_relay_gateway::RelayCall;
use simlock_relay_worker::{
    BoxError, RelayRequest, RelayTarget, RelayTargets, ResponseBody, empty_body, full_body,
    stream_body,
};
use simlock_wire::CallEvent;
use tokio_util::sync::CancellationToken;

const MIB: u64 = 1024 * 1024;
const LEASE: &str = "0123456789abcdef0123456789abcdef";

// === Targets ===

/// A target that records each call and answers 200 with `body`.
fn answering(probe: &Arc<Probe>, body: &'static str) -> Arc<dyn RelayTarget> {
    probe.target(move |_, _| async move { Ok(respond(200, full_body(body))) })
}

/// A target that records each call, then waits for a permit (answering 200 `released`) or its
/// cancellation (failing).
fn holding(probe: &Arc<Probe>) -> Arc<dyn RelayTarget> {
    probe.target(|probe, request| async move {
        tokio::select! {
            permit = probe.permits.acquire() => {
                permit.unwrap().forget();
                Ok(respond(200, full_body("released")))
            }
            () = request.cancel.cancelled() => Err("cancelled while held".into()),
        }
    })
}

/// A target that records each call and answers a body that streams until its cancellation.
fn streaming_forever(probe: &Arc<Probe>, pulled: Arc<AtomicU64>) -> Arc<dyn RelayTarget> {
    probe.target(move |_, _| {
        let pulled = pulled.clone();
        async move { Ok(respond(200, pattern_response(7, u64::MAX / 2, pulled))) }
    })
}

/// A target that reads its whole upload, checks it against the pattern `seed`, and answers
/// `<bytes> <ok>`.
fn checking_upload(probe: &Arc<Probe>, seed: u64) -> Arc<dyn RelayTarget> {
    probe.target(move |probe, request| async move {
        let body = probe.drain(request.request.into_body()).await?;
        let ok = body == pattern(seed, body.len());
        Ok(respond(200, full_body(format!("{} {ok}", body.len()))))
    })
}

/// A target that answers a body failing after its first part.
fn breaking() -> Arc<dyn RelayTarget> {
    Arc::new(|_: RelayRequest| async {
        let parts = futures::stream::iter([
            Ok(Bytes::from_static(b"first")),
            Err::<Bytes, BoxError>("broken after the head".into()),
        ]);
        Ok(respond(200, stream_body(parts)))
    })
}

/// A target answering 200 with `x-0` … `x-<count - 1>` headers.
fn with_headers(count: usize) -> http::Response<ResponseBody> {
    let mut response = respond(200, full_body("ok"));
    for n in 0..count {
        response.headers_mut().insert(
            http::HeaderName::from_bytes(format!("x-{n}").as_bytes()).unwrap(),
            HeaderValue::from_static("v"),
        );
    }
    response
}

/// A target that fails before answering.
fn failing(message: &'static str) -> Arc<dyn RelayTarget> {
    Arc::new(move |_: RelayRequest| async move {
        Err::<http::Response<ResponseBody>, BoxError>(message.into())
    })
}

fn exec_config(script: &str) -> simlock_worker::WorkerConfig {
    let mut config = worker_config(2);
    config.core.exec.tools.insert(
        "talk".into(),
        simlock_core::config::ToolConfig {
            command: "/bin/sh".into(),
            args: vec!["-c".into(), script.into(), "sh".into()],
        },
    );
    config
}

/// Reads a relayed body to its end, checking it against the pattern `seed`.
async fn check_pattern(body: simlock_relay_gateway::RelayBody, seed: u64) -> PatternCheck {
    let mut check = PatternCheck::new(seed);
    let mut body = std::pin::pin!(body);
    while let Some(frame) = patient("a frame", body.frame()).await {
        check.feed(&frame.unwrap().into_data().unwrap());
    }
    check
}

// === Seed 000 and 002 through a real gateway and worker ===

/// 000: a GET relayed to the fake target arrives with its URL (origin, path and query), method,
/// headers, tenant and lease id, and its status, headers and body come back unchanged.
/// 002: the worker's server and the gateway's worker link hold link connections, and a relayed
/// GET crosses on a channel.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_get_crosses_on_a_channel_and_arrives_whole() {
    let probe = Probe::new();
    let target = probe.target(|_, _| async {
        let mut response = respond(201, full_body("hello from the target"));
        response
            .headers_mut()
            .insert("x-answer", HeaderValue::from_static("yes"));
        response
            .headers_mut()
            .insert("content-type", HeaderValue::from_static("text/plain"));
        Ok(response)
    });
    let (fleet, worker) = fleet_with(relay_targets(vec![("fake", target)])).await;
    let before = gateway_link_stats(&fleet, &worker);
    let mut request = get("http://device.test:4700/v1/things?x=1&y=two");
    request
        .headers_mut()
        .insert("x-custom", HeaderValue::from_static("custom value"));
    request
        .headers_mut()
        .insert("accept", HeaderValue::from_static("application/json"));
    let mut call = RelayCall::new("fake", request, "tenant-a");
    call.lease_id = Some(LEASE.into());
    let response = relay(&fleet, &worker, call).await.unwrap();
    assert_eq!(response.status(), StatusCode::CREATED);
    assert_eq!(response.headers()["x-answer"], "yes");
    assert_eq!(response.headers()["content-type"], "text/plain");
    let body = read_body(response.into_body()).await.unwrap();
    assert_eq!(body, b"hello from the target");

    let seen = probe.seen.lock()[0].clone();
    assert_eq!(seen.method, Method::GET);
    assert_eq!(
        seen.uri.to_string(),
        "http://device.test:4700/v1/things?x=1&y=two"
    );
    assert_eq!(seen.headers["x-custom"], "custom value");
    assert_eq!(seen.headers["accept"], "application/json");
    assert_eq!(seen.tenant, "tenant-a");
    assert_eq!(seen.lease_id.as_deref(), Some(LEASE));

    // The body crossed on a link channel of the uplink, and the channel is gone again.
    let after = gateway_link_stats(&fleet, &worker);
    assert!(
        after.bytes_received >= before.bytes_received + 21,
        "the response body came as DATA on the link"
    );
    no_channel_open(&fleet, &worker).await;
    fleet.stop().await;
}

/// 000/002: a 20 MiB PUT body arrives at the target byte for byte, and a 20 MiB response body
/// comes back byte for byte.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn twenty_mib_go_up_and_come_back_byte_for_byte() {
    let probe = Probe::new();
    let upload_ok = Arc::new(AtomicBool::new(false));
    let target = probe.target({
        let upload_ok = upload_ok.clone();
        move |probe, request| {
            let upload_ok = upload_ok.clone();
            async move {
                let body = probe.drain(request.request.into_body()).await?;
                upload_ok.store(body == pattern(1, 20 * MIB as usize), Ordering::SeqCst);
                Ok(respond(200, pattern_response(2, 20 * MIB, Arc::default())))
            }
        }
    });
    let (fleet, worker) = fleet_with(relay_targets(vec![("fake", target)])).await;
    let call = RelayCall::new(
        "fake",
        request(
            Method::PUT,
            "http://device.test/upload",
            PatternBody::new(1, 20 * MIB),
        ),
        "tenant",
    );
    let response = relay(&fleet, &worker, call).await.unwrap();
    assert_eq!(response.status(), StatusCode::OK);
    let check = check_pattern(response.into_body(), 2).await;
    assert!(check.ok, "the download arrived byte for byte");
    assert_eq!(check.offset, 20 * MIB);
    assert!(
        upload_ok.load(Ordering::SeqCst),
        "the upload arrived byte for byte"
    );
    assert_eq!(probe.read.load(Ordering::SeqCst), 20 * MIB);
    fleet.stop().await;
}

/// 002: an empty upload (0 bytes) and a GET relay.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_empty_upload_and_a_get_relay() {
    let probe = Probe::new();
    let target = probe.target(|probe, request| async move {
        let ended = request.request.body().is_end_stream();
        let body = probe.drain(request.request.into_body()).await?;
        Ok(respond(200, full_body(format!("{} {ended}", body.len()))))
    });
    let (fleet, worker) = fleet_with(relay_targets(vec![("fake", target)])).await;
    // An upload stream that turns out empty: hasBody, then END at once.
    let empty_upload = PatternBody::new(3, 0).failing_after(u64::MAX);
    let response = relay(
        &fleet,
        &worker,
        RelayCall::new(
            "fake",
            request(Method::POST, "http://t.test/empty", empty_upload),
            "t",
        ),
    )
    .await
    .unwrap();
    assert_eq!(read_body(response.into_body()).await.unwrap(), b"0 false");
    let response = relay(
        &fleet,
        &worker,
        RelayCall::new("fake", get("http://t.test/get"), "t"),
    )
    .await
    .unwrap();
    assert_eq!(read_body(response.into_body()).await.unwrap(), b"0 true");
    fleet.stop().await;
}

/// 000 (the channel analogue of "a relay.body frame right behind its relay.request is never
/// dropped"): a small upload written right behind the call always arrives, 50 times.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn small_uploads_right_behind_the_call_always_arrive() {
    let probe = Probe::new();
    let target = probe.target(|probe, request| async move {
        let body = probe.drain(request.request.into_body()).await?;
        Ok(respond(200, full_body(body)))
    });
    let (fleet, worker) = fleet_with(relay_targets(vec![("echo", target)])).await;
    for n in 0..50u64 {
        let body = http_body_util::Full::new(Bytes::from(format!("upload {n}")));
        let response = relay(
            &fleet,
            &worker,
            RelayCall::new("echo", request(Method::POST, "http://t.test/", body), "t"),
        )
        .await
        .unwrap();
        assert_eq!(
            read_body(response.into_body()).await.unwrap(),
            format!("upload {n}").as_bytes()
        );
    }
    fleet.stop().await;
}

/// 000: while a 20 MiB relay runs, a lease.renew forwarded to the same worker answers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lease_renew_answers_while_a_twenty_mib_relay_runs() {
    let probe = Probe::new();
    let stop = CancellationToken::new();
    let target = probe.target({
        let stop = stop.clone();
        move |_, _| {
            let stop = stop.clone();
            async move {
                // Streams until told to stop; the caller reads all the while.
                let chunks = futures::stream::unfold(0u64, move |sent| {
                    let stop = stop.clone();
                    async move {
                        if stop.is_cancelled() {
                            return None;
                        }
                        let mut buf = vec![0; 64 * 1024];
                        fill_pattern(4, sent, &mut buf);
                        Some((Ok::<_, BoxError>(Bytes::from(buf)), sent + 64 * 1024))
                    }
                });
                Ok(respond(200, stream_body(chunks)))
            }
        }
    });
    let (fleet, worker) = fleet_with(relay_targets(vec![("bulk", target)])).await;
    let agent = fleet.agent("agent-1").await;
    let grant = agent
        .call("lease.request", json!({"platform": "ios"}))
        .await
        .unwrap();
    let lease_id = grant["lease"]["id"].as_str().unwrap().to_owned();

    let response = relay(&fleet, &worker, get_call("bulk")).await.unwrap();
    let read = Arc::new(AtomicU64::new(0));
    let reader = tokio::spawn({
        let read = read.clone();
        async move {
            let mut check = PatternCheck::new(4);
            let mut body = response.into_body();
            while let Some(frame) = body.frame().await {
                let data = frame.unwrap().into_data().unwrap();
                check.feed(&data);
                read.fetch_add(data.len() as u64, Ordering::SeqCst);
            }
            check
        }
    });
    wait_until("the relay moves bytes", || {
        read.load(Ordering::SeqCst) >= MIB
    })
    .await;
    let renewed = agent
        .call("lease.renew", json!({"leaseId": lease_id}))
        .await
        .unwrap();
    assert_eq!(renewed["id"], lease_id.as_str());
    assert!(
        !reader.is_finished() && !stop.is_cancelled(),
        "the renew answered while the relay was still running"
    );
    wait_until("20 MiB went through", || {
        read.load(Ordering::SeqCst) >= 20 * MIB
    })
    .await;
    stop.cancel();
    let check = patient("the relay's end", reader).await.unwrap();
    assert!(check.ok, "every byte arrived in order");
    assert!(check.offset >= 20 * MIB);
    fleet.stop().await;
}

/// 000/002: a target that answers 401 without reading its 20 MiB upload: the caller gets the 401
/// and its body, and the gateway stops reading the caller's body (the `stopped` row).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_401_without_reading_the_upload_stops_the_callers_body() {
    let probe = Probe::new();
    let target = probe.target(|_, _| async { Ok(respond(401, full_body("who are you"))) });
    let (fleet, worker) = fleet_with(relay_targets(vec![("auth", target)])).await;
    let upload = PatternBody::new(5, 20 * MIB);
    let (pulled, dropped) = (upload.pulled.clone(), upload.dropped.clone());
    let response = relay(
        &fleet,
        &worker,
        RelayCall::new(
            "auth",
            request(Method::PUT, "http://t.test/up", upload),
            "t",
        ),
    )
    .await
    .unwrap();
    assert_eq!(response.status(), StatusCode::UNAUTHORIZED);
    assert_eq!(
        read_body(response.into_body()).await.unwrap(),
        b"who are you"
    );
    patient(
        "the gateway lets go of the caller's body",
        dropped.cancelled(),
    )
    .await;
    assert!(
        pulled.load(Ordering::SeqCst) < 20 * MIB,
        "the gateway stopped reading the upload after {} bytes",
        pulled.load(Ordering::SeqCst)
    );
    no_channel_open(&fleet, &worker).await;
    fleet.stop().await;
}

/// 000: a response the target streams in parts reaches the gateway caller part by part, before
/// the target's body ends.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_streamed_answer_reaches_the_caller_part_by_part() {
    let probe = Probe::new();
    let target = probe.target(|probe, _| async move {
        let release = probe.release.clone();
        let parts = futures::stream::iter([0, 1]).then(move |n| {
            let release = release.clone();
            async move {
                if n == 1 {
                    release.cancelled().await;
                }
                Ok::<_, BoxError>(Bytes::from(format!("part-{n};")))
            }
        });
        Ok(respond(200, stream_body(parts)))
    });
    let (fleet, worker) = fleet_with(relay_targets(vec![("parts", target)])).await;
    let response = relay(&fleet, &worker, get_call("parts")).await.unwrap();
    let mut body = response.into_body();
    let first = patient("the first part", body.frame())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(first.into_data().unwrap(), "part-0;");
    assert!(
        !probe.release.is_cancelled(),
        "the target's body has not ended"
    );
    probe.release.cancel();
    assert_eq!(read_body(body).await.unwrap(), b"part-1;");
    fleet.stop().await;
}

/// 000/002: 204, 205 and 304 answers and a HEAD answer reach the caller with an empty body, and
/// no body byte of theirs crosses; a GET answer keeps its body.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn head_204_205_and_304_answers_have_no_body() {
    let target: Arc<dyn RelayTarget> = Arc::new(|request: RelayRequest| async move {
        let status: u16 = request.request.uri().path()[1..].parse().unwrap_or(200);
        Ok(respond(status, full_body("a body that must not cross")))
    });
    let (fleet, worker) = fleet_with(relay_targets(vec![("nobody", target)])).await;
    for (method, status) in [
        (Method::GET, 204),
        (Method::GET, 205),
        (Method::GET, 304),
        (Method::HEAD, 200),
    ] {
        let before = gateway_link_stats(&fleet, &worker).bytes_received;
        let response = relay(
            &fleet,
            &worker,
            RelayCall::new(
                "nobody",
                request(
                    method.clone(),
                    &format!("http://t.test/{status}"),
                    http_body_util::Empty::<Bytes>::new(),
                ),
                "t",
            ),
        )
        .await
        .unwrap();
        assert_eq!(response.status().as_u16(), status);
        assert!(response.body().is_end_stream(), "{method} {status}");
        assert!(read_body(response.into_body()).await.unwrap().is_empty());
        no_channel_open(&fleet, &worker).await;
        assert_eq!(
            gateway_link_stats(&fleet, &worker).bytes_received,
            before,
            "{method} {status}: no body byte crossed"
        );
    }
    let response = relay(
        &fleet,
        &worker,
        RelayCall::new("nobody", get("http://t.test/200"), "t"),
    )
    .await
    .unwrap();
    assert_eq!(
        read_body(response.into_body()).await.unwrap(),
        b"a body that must not cross"
    );
    fleet.stop().await;
}

/// 000 (the credit analogue of the 64 MiB reader-fell-behind line): a caller that reads nothing
/// while the target streams 80 MiB holds the target back; the gateway buffers at most a window,
/// the worker less than its response queue and one part.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_caller_that_reads_nothing_holds_the_target_back() {
    let probe = Probe::new();
    let pulled = Arc::new(AtomicU64::new(0));
    let target = probe.target({
        let pulled = pulled.clone();
        move |_, _| {
            let pulled = pulled.clone();
            async move { Ok(respond(200, pattern_response(8, 80 * MIB, pulled))) }
        }
    });
    let (fleet, worker) = fleet_with(relay_targets(vec![("big", target)])).await;
    let response = relay(&fleet, &worker, get_call("big")).await.unwrap();
    wait_until("the gateway's window is used up", || {
        gateway_link_stats(&fleet, &worker).bytes_received >= 256 * 1024
    })
    .await;
    let stats = gateway_link_stats(&fleet, &worker);
    assert!(
        stats.bytes_received <= 256 * 1024,
        "no credit beyond one window: {stats:?}"
    );
    // Beyond the window, the worker holds less than its response queue plus one part written
    // past it (the target's parts are 64 KiB); it pulls nothing more until there is room. Wait
    // until it has filled that queue. (Over real sockets nothing marks the moment the pipe
    // stops; the pipe's own test, on a paused clock, checks that it stops exactly there.)
    let queue = simlock_relay_worker::RESPONSE_QUEUE as u64;
    wait_until("the worker's response queue is full", || {
        pulled.load(Ordering::SeqCst) >= 256 * 1024 + queue
    })
    .await;
    let bound = 256 * 1024 + queue + 64 * 1024;
    assert!(
        pulled.load(Ordering::SeqCst) <= bound,
        "the target was held back after {} bytes (bound {bound})",
        pulled.load(Ordering::SeqCst)
    );
    drop(response);
    probe.wait_cancelled(1).await;
    no_channel_open(&fleet, &worker).await;
    fleet.stop().await;
}

/// 000: aborting the caller's request signal before the head comes fails the call; the target's
/// request signal aborts.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_caller_abort_before_the_head_fails_the_call_and_cancels_the_target() {
    let probe = Probe::new();
    let (fleet, worker) = fleet_with(relay_targets(vec![("hold", holding(&probe))])).await;
    let abort = CancellationToken::new();
    let mut call = get_call("hold");
    call.cancel = Some(abort.clone());
    let relay_task = spawn_relay(&fleet, &worker, call);
    probe.wait_calls(1).await;
    abort.cancel();
    let err = patient("the relay", relay_task).await.unwrap().unwrap_err();
    assert_eq!(err.code, ErrorCode::Cancelled);
    assert_eq!(err.message, "The caller cancelled the relay");
    probe.wait_cancelled(1).await;
    no_channel_open(&fleet, &worker).await;

    // Dropping the future is an abort too.
    let dropped = spawn_relay(&fleet, &worker, get_call("hold"));
    probe.wait_calls(2).await;
    dropped.abort();
    probe.wait_cancelled(2).await;
    no_channel_open(&fleet, &worker).await;
    fleet.stop().await;
}

/// 000/002: a caller's cancel of the body stream (dropping it) after the head sends relay.cancel,
/// aborts the channel and aborts the target's request.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dropping_the_body_after_the_head_cancels_the_target_and_frees_the_channel() {
    let probe = Probe::new();
    let pulled = Arc::new(AtomicU64::new(0));
    let (fleet, worker) = fleet_with(relay_targets(vec![(
        "stream",
        streaming_forever(&probe, pulled),
    )]))
    .await;
    let response = relay(&fleet, &worker, get_call("stream")).await.unwrap();
    let mut body = response.into_body();
    let first = patient("a frame", body.frame()).await.unwrap().unwrap();
    assert!(!first.into_data().unwrap().is_empty());
    drop(body);
    probe.wait_cancelled(1).await;
    no_channel_open(&fleet, &worker).await;

    // The signal after the head errors the body.
    let abort = CancellationToken::new();
    let mut call = get_call("stream");
    call.cancel = Some(abort.clone());
    let response = relay(&fleet, &worker, call).await.unwrap();
    abort.cancel();
    let err = read_body(response.into_body()).await.unwrap_err();
    assert_eq!(err.code, ErrorCode::Cancelled);
    probe.wait_cancelled(2).await;
    no_channel_open(&fleet, &worker).await;
    fleet.stop().await;
}

/// 000: a caller's request body that errors mid-upload aborts the target's request signal; the
/// call fails with the body's error.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_caller_body_that_fails_mid_upload_cancels_the_target() {
    let probe = Probe::new();
    let target = probe.target(|probe, request| async move {
        probe.drain(request.request.into_body()).await?;
        Ok(respond(200, empty_body()))
    });
    let (fleet, worker) = fleet_with(relay_targets(vec![("sink", target)])).await;
    let upload = PatternBody::new(9, 20 * MIB).failing_after(MIB);
    let err = relay(&fleet, &worker, put_call("sink", upload))
        .await
        .unwrap_err();
    assert_eq!(err.code, ErrorCode::Cancelled);
    assert!(err.message.contains("the caller's upload broke"), "{err}");
    probe.wait_cancelled(1).await;
    assert!(probe.read.load(Ordering::SeqCst) <= MIB);
    no_channel_open(&fleet, &worker).await;
    fleet.stop().await;
}

/// 000: a target that never answers is cancelled after a 200 ms deadline, and the caller gets
/// WORKER_UNREACHABLE with the deadline message; one that stalls after its head gets its body
/// stream errored with that message.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_200_ms_deadline_fails_before_the_head_and_errors_the_body_after_it() {
    let probe = Probe::new();
    let stalling = probe.target(|_, _| async {
        let first = futures::stream::once(async {
            Ok::<_, BoxError>(Bytes::from_static(b"head and a little"))
        });
        let never = futures::stream::pending();
        Ok(respond(200, stream_body(first.chain(never))))
    });
    let (fleet, worker) = fleet_with(relay_targets(vec![
        ("hold", holding(&probe)),
        ("stall", stalling),
    ]))
    .await;
    let short = fleet
        .gateway()
        .relay
        .with_deadline(Duration::from_millis(200));
    let message = format!("worker {worker} did not finish the relayed request within 200 ms");
    let err = patient("the relay", short.relay(&worker, get_call("hold")))
        .await
        .unwrap_err();
    assert_eq!(err.code, ErrorCode::WorkerUnreachable);
    assert_eq!(err.message, message);
    probe.wait_cancelled(1).await;

    let response = patient("the relay", short.relay(&worker, get_call("stall")))
        .await
        .unwrap();
    let mut body = response.into_body();
    let first = patient("a frame", body.frame()).await.unwrap().unwrap();
    assert_eq!(first.into_data().unwrap(), "head and a little");
    let err = read_body(body).await.unwrap_err();
    assert_eq!(err.code, ErrorCode::WorkerUnreachable);
    assert_eq!(err.message, message);
    probe.wait_cancelled(2).await;
    no_channel_open(&fleet, &worker).await;
    fleet.stop().await;
}

/// 000 and the `closed` row: closing the uplink mid-relay fails the caller with
/// WORKER_UNREACHABLE before the head, or errors its body after it, and the target's
/// cancellation fires on the worker.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn closing_the_uplink_mid_relay_is_worker_unreachable_and_cancels_the_target() {
    let probe = Probe::new();
    let pulled = Arc::new(AtomicU64::new(0));
    let (mut fleet, worker) = fleet_with(relay_targets(vec![
        ("hold", holding(&probe)),
        ("stream", streaming_forever(&probe, pulled)),
    ]))
    .await;
    let pending = spawn_relay(&fleet, &worker, get_call("hold"));
    probe.wait_calls(1).await;
    let first = fleet.gateway().fleet.conn(&worker).unwrap();
    first.close();
    let err = patient("the relay", pending).await.unwrap().unwrap_err();
    assert_eq!(err.code, ErrorCode::WorkerUnreachable);
    assert_eq!(err.details.unwrap()["workerId"], worker.as_str());
    probe.wait_cancelled(1).await;

    // After the head: the worker comes back; the uplink drops again mid-body.
    fleet
        .wait_until(|f| {
            f.conn(&worker)
                .is_some_and(|c| c.generation != first.generation)
        })
        .await;
    let response = relay(&fleet, &worker, get_call("stream")).await.unwrap();
    let mut body = response.into_body();
    patient("a frame", body.frame()).await.unwrap().unwrap();
    fleet.gateway().fleet.conn(&worker).unwrap().close();
    let err = read_body(body).await.unwrap_err();
    assert_eq!(err.code, ErrorCode::WorkerUnreachable);
    probe.wait_cancelled(2).await;
    fleet.stop_worker(0).await;
    fleet.stop().await;
}

/// 000: a relay to a worker with no uplink fails with WORKER_UNREACHABLE and the target sees
/// nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_relay_to_a_worker_without_an_uplink_fails_before_anything_is_sent() {
    let probe = Probe::new();
    let (mut fleet, worker) =
        fleet_with(relay_targets(vec![("fake", answering(&probe, "x"))])).await;
    let err = relay(&fleet, "no-such-worker", get_call("fake"))
        .await
        .unwrap_err();
    assert_eq!(err.code, ErrorCode::WorkerUnreachable);
    fleet.stop_worker(0).await;
    fleet
        .wait_for(|views| {
            views.iter().any(|v| {
                v.id == worker && v.connection == simlock_contract::model::Connection::Disconnected
            })
        })
        .await;
    let err = relay(&fleet, &worker, get_call("fake")).await.unwrap_err();
    assert_eq!(err.code, ErrorCode::WorkerUnreachable);
    assert_eq!(
        err.message,
        format!("Worker {worker} is not connected to this gateway")
    );
    assert_eq!(probe.calls.load(Ordering::SeqCst), 0);
    fleet.stop().await;
}

/// 000: a relay naming a target nobody registered fails with RELAY_TARGET_MISSING (HTTP 503,
/// CLI exit 1, details `{target}`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_target_nobody_registered_is_relay_target_missing() {
    let probe = Probe::new();
    let (fleet, worker) = fleet_with(relay_targets(vec![("fake", answering(&probe, "x"))])).await;
    let err = relay(&fleet, &worker, get_call("nobody"))
        .await
        .unwrap_err();
    assert_eq!(err.code, ErrorCode::RelayTargetMissing);
    assert_eq!(err.details.unwrap(), json!({"target": "nobody"}));
    assert_eq!(ErrorCode::RelayTargetMissing.http_status(), 503);
    assert_eq!(ErrorCode::RelayTargetMissing.exit_code(), 1);
    assert_eq!(probe.calls.load(Ordering::SeqCst), 0);
    no_channel_open(&fleet, &worker).await;
    fleet.stop().await;
}

/// 000 and the `aborted` row after the head: a target that fails is INTERNAL and the worker logs
/// its message; a response body that errors after the head errors the caller's body with the
/// worker's INTERNAL after the bytes already read.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failing_target_is_internal_and_logged_and_a_failing_body_errors_after_its_bytes() {
    let logs = logs();
    let release = CancellationToken::new();
    let breaking: Arc<dyn RelayTarget> = {
        let release = release.clone();
        Arc::new(move |_: RelayRequest| {
            let release = release.clone();
            async move {
                let parts = futures::stream::iter([0, 1]).then(move |n| {
                    let release = release.clone();
                    async move {
                        if n == 0 {
                            return Ok(Bytes::from_static(b"first part"));
                        }
                        release.cancelled().await;
                        Err::<Bytes, BoxError>("body-broke-91c2".into())
                    }
                });
                Ok(respond(200, stream_body(parts)))
            }
        })
    };
    let (fleet, worker) = fleet_with(relay_targets(vec![
        ("failing", failing("kaput-7f3a")),
        ("breaking", breaking),
    ]))
    .await;
    let err = relay(&fleet, &worker, get_call("failing"))
        .await
        .unwrap_err();
    assert_eq!(err.code, ErrorCode::Internal);
    assert!(err.message.contains("kaput-7f3a"), "{err}");
    wait_until("the worker logs the target's message", || {
        logs.has_line(&["relay", "kaput-7f3a"])
    })
    .await;

    let response = relay(&fleet, &worker, get_call("breaking")).await.unwrap();
    let mut body = response.into_body();
    let first = patient("a frame", body.frame()).await.unwrap().unwrap();
    assert_eq!(first.into_data().unwrap(), "first part");
    release.cancel();
    let err = read_body(body).await.unwrap_err();
    assert_eq!(err.code, ErrorCode::Internal);
    assert!(err.message.contains("body-broke-91c2"), "{err}");
    wait_until("the worker logs the body's failure", || {
        logs.has_line(&["body-broke-91c2"])
    })
    .await;
    no_channel_open(&fleet, &worker).await;
    fleet.stop().await;
}

/// 000: the caller's authorization, x-agent-device-token, connection and transfer-encoding
/// headers (and the other hop-by-hop ones, and what `connection` names) never reach the target,
/// and a target's content-length and connection headers never reach the caller.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn headers_are_filtered_both_ways() {
    let probe = Probe::new();
    let target = probe.target(|_, _| async {
        let mut response = respond(200, full_body("12345"));
        let headers = response.headers_mut();
        for (name, value) in [
            ("content-length", "5"),
            ("connection", "x-answer-hop"),
            ("x-answer-hop", "hop"),
            ("keep-alive", "timeout=5"),
            ("proxy-authenticate", "Basic"),
            ("x-answer-kept", "kept"),
        ] {
            headers.insert(name, HeaderValue::from_static(value));
        }
        Ok(response)
    });
    let (fleet, worker) = fleet_with(relay_targets(vec![("fake", target)])).await;
    let mut request = request(
        Method::POST,
        "http://t.test/",
        http_body_util::Full::new(Bytes::from_static(b"body")),
    );
    for (name, value) in [
        ("authorization", "Bearer gateway-secret"),
        ("x-agent-device-token", "device-secret"),
        ("connection", "x-hop, keep-alive"),
        ("x-hop", "hop"),
        ("keep-alive", "timeout=5"),
        ("transfer-encoding", "chunked"),
        ("content-length", "4"),
        ("upgrade", "websocket"),
        ("te", "trailers"),
        ("trailer", "x-t"),
        ("proxy-authorization", "Basic x"),
        ("x-kept", "kept"),
    ] {
        request
            .headers_mut()
            .insert(name, HeaderValue::from_static(value));
    }
    let response = relay(&fleet, &worker, RelayCall::new("fake", request, "t"))
        .await
        .unwrap();
    let names: Vec<String> = response
        .headers()
        .keys()
        .map(|n| n.as_str().to_owned())
        .collect();
    assert_eq!(names, ["x-answer-kept"]);
    assert_eq!(read_body(response.into_body()).await.unwrap(), b"12345");
    let seen = probe.seen.lock()[0].clone();
    let names: Vec<&str> = seen.headers.keys().map(http::HeaderName::as_str).collect();
    assert_eq!(names, ["x-kept"]);
    fleet.stop().await;
}

/// 000: a target answering 101 headers fails the call with INTERNAL and the worker logs which
/// bound; 100 pass.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_target_answering_101_headers_is_internal_and_logged() {
    let logs = logs();
    let target: Arc<dyn RelayTarget> = Arc::new(|request: RelayRequest| async move {
        Ok(with_headers(
            request.request.uri().path()[1..].parse().unwrap(),
        ))
    });
    let (fleet, worker) = fleet_with(relay_targets(vec![("many", target)])).await;
    let err = relay(
        &fleet,
        &worker,
        RelayCall::new("many", get("http://t.test/101"), "t"),
    )
    .await
    .unwrap_err();
    assert_eq!(err.code, ErrorCode::Internal);
    assert!(
        err.message.contains("at most 100 headers, got 101"),
        "{err}"
    );
    wait_until("the worker logs the bound", || {
        logs.has_line(&["out of bounds", "at most 100 headers, got 101"])
    })
    .await;
    let response = relay(
        &fleet,
        &worker,
        RelayCall::new("many", get("http://t.test/100"), "t"),
    )
    .await
    .unwrap();
    assert_eq!(response.headers().len(), 100);
    no_channel_open(&fleet, &worker).await;
    fleet.stop().await;
}

/// 000: a relay and a device.exec with output running at once on one worker each get only their
/// own pushes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_relay_and_an_exec_on_one_worker_each_get_only_their_own_pushes() {
    let probe = Probe::new();
    let target = probe
        .target(|_, _| async { Ok(respond(200, pattern_response(11, 4 * MIB, Arc::default()))) });
    let mut fleet = TestFleet::start(gateway_config()).await;
    add_relay_worker(
        &mut fleet,
        exec_config("for i in 1 2 3 4 5 6 7 8; do echo out-$i; done"),
        relay_targets(vec![("bulk", target)]),
        None,
    )
    .await;
    let worker = fleet.worker_id(0);
    let agent = fleet.agent("agent-1").await;
    let grant = agent
        .call("lease.request", json!({"platform": "ios"}))
        .await
        .unwrap();
    let lease_id = grant["lease"]["id"].as_str().unwrap().to_owned();
    let exec = agent
        .client
        .begin(
            "device.exec",
            json!({"leaseId": lease_id, "tool": "talk", "args": []}),
            64,
        )
        .await
        .unwrap();
    let exec_id = exec.id();
    let relayed = tokio::spawn({
        let relay = fleet.gateway().relay.clone();
        let worker = worker.clone();
        async move {
            let response = relay.relay(&worker, get_call("bulk")).await.unwrap();
            check_pattern(response.into_body(), 11).await
        }
    });
    let (pushes, reply) = pushes_and_reply(exec).await;
    assert_eq!(reply.unwrap()["exitCode"], 0);
    let mut output = String::new();
    for push in &pushes {
        assert!(
            push.push == "started" || push.push == "output",
            "the exec got a {} push",
            push.push
        );
        assert_eq!(push.payload["requestId"], exec_id);
        if push.push == "output" {
            output.push_str(push.payload["chunk"].as_str().unwrap());
        }
    }
    assert_eq!(
        output,
        "out-1\nout-2\nout-3\nout-4\nout-5\nout-6\nout-7\nout-8\n"
    );
    let check = patient("the relay", relayed).await.unwrap();
    assert!(
        check.ok && check.offset == 4 * MIB,
        "the relay got its own body whole"
    );
    fleet.stop().await;
}

/// 002: with 63 relays to one worker held in their targets, a 64th starts at once; a 65th whose
/// 200 ms deadline passes first fails WORKER_UNREACHABLE with the deadline message; a 65th whose
/// caller aborts while it waits fails at once with the abort reason; a 65th starts once one of
/// them ends.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_65th_relay_to_one_worker_waits_for_a_channel() {
    let probe = Probe::new();
    let (fleet, worker) = fleet_with(relay_targets(vec![("hold", holding(&probe))])).await;
    let mut held: Vec<_> = (0..63)
        .map(|_| spawn_relay(&fleet, &worker, get_call("hold")))
        .collect();
    probe.wait_calls(63).await;
    held.push(spawn_relay(&fleet, &worker, get_call("hold")));
    // The 64th starts at once.
    probe.wait_calls(64).await;
    assert_eq!(gateway_link_stats(&fleet, &worker).open_channels, 64);

    let short = fleet
        .gateway()
        .relay
        .with_deadline(Duration::from_millis(200));
    let err = patient("the 65th", short.relay(&worker, get_call("hold")))
        .await
        .unwrap_err();
    assert_eq!(err.code, ErrorCode::WorkerUnreachable);
    assert_eq!(
        err.message,
        format!("worker {worker} did not finish the relayed request within 200 ms")
    );
    assert_eq!(probe.calls.load(Ordering::SeqCst), 64, "it never started");

    let abort = CancellationToken::new();
    let mut call = get_call("hold");
    call.cancel = Some(abort.clone());
    let waiting = spawn_relay(&fleet, &worker, call);
    abort.cancel();
    let err = patient("the aborted 65th", waiting)
        .await
        .unwrap()
        .unwrap_err();
    assert_eq!(err.code, ErrorCode::Cancelled);
    assert_eq!(probe.calls.load(Ordering::SeqCst), 64, "it never started");

    held.push(spawn_relay(&fleet, &worker, get_call("hold")));
    probe.permits.add_permits(1);
    // The 65th starts once one ended.
    probe.wait_calls(65).await;
    probe.permits.add_permits(64);
    for relay in held {
        let response = patient("a held relay", relay).await.unwrap().unwrap();
        assert_eq!(read_body(response.into_body()).await.unwrap(), b"released");
    }
    no_channel_open(&fleet, &worker).await;
    fleet.stop().await;
}

/// 002: after 64 relays to one worker that were cancelled, timed out, failed with a missing
/// target, or whose target answered without reading its upload, a 65th starts at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_way_a_relay_ends_gives_its_channel_back() {
    let probe = Probe::new();
    let (fleet, worker) = fleet_with(relay_targets(vec![
        ("hold", holding(&probe)),
        ("auth", answering(&probe, "no")),
    ]))
    .await;
    let short = fleet
        .gateway()
        .relay
        .with_deadline(Duration::from_millis(200));
    for _ in 0..16 {
        let calls = probe.calls.load(Ordering::SeqCst);
        // Cancelled by its caller once its target holds it.
        let abort = CancellationToken::new();
        let mut call = get_call("hold");
        call.cancel = Some(abort.clone());
        let cancelled = spawn_relay(&fleet, &worker, call);
        // At least: the last round's timed-out relay may reach its target only now.
        probe.wait_calls_at_least(calls + 1).await;
        abort.cancel();
        let err = patient("a cancelled relay", cancelled)
            .await
            .unwrap()
            .unwrap_err();
        assert_eq!(err.code, ErrorCode::Cancelled);
        // Timed out.
        let err = patient(
            "a relay past its deadline",
            short.relay(&worker, get_call("hold")),
        )
        .await
        .unwrap_err();
        assert_eq!(err.code, ErrorCode::WorkerUnreachable);
        // A missing target.
        let err = relay(&fleet, &worker, get_call("nobody"))
            .await
            .unwrap_err();
        assert_eq!(err.code, ErrorCode::RelayTargetMissing);
        // Answered without reading its upload.
        let response = relay(&fleet, &worker, put_call("auth", PatternBody::new(12, MIB)))
            .await
            .unwrap();
        assert_eq!(read_body(response.into_body()).await.unwrap(), b"no");
    }
    no_channel_open(&fleet, &worker).await;
    let response = relay(&fleet, &worker, get_call("auth")).await.unwrap();
    assert_eq!(read_body(response.into_body()).await.unwrap(), b"no");
    fleet.stop().await;
}

/// 002: a relay sent while the worker is still starting holds its channel, and its 2 MiB upload
/// arrives in full once startup converges.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_relay_parked_by_start_up_gets_its_2_mib_upload_once_start_up_converges() {
    let probe = Probe::new();
    let hold = CancellationToken::new();
    let mut fleet = TestFleet::start(gateway_config()).await;
    add_relay_worker(
        &mut fleet,
        worker_config(2),
        relay_targets(vec![("up", checking_upload(&probe, 13))]),
        Some(hold.clone()),
    )
    .await;
    let worker = fleet.worker_id(0);
    let relaying = spawn_relay(
        &fleet,
        &worker,
        put_call("up", PatternBody::new(13, 2 * MIB)),
    );
    // The upload fills the worker's window and waits for credit while the relay is parked.
    wait_until("the gateway's upload waits for credit", || {
        gateway_link_stats(&fleet, &worker).credit_stalls >= 1
    })
    .await;
    assert_eq!(probe.calls.load(Ordering::SeqCst), 0, "the relay is parked");
    assert_eq!(gateway_link_stats(&fleet, &worker).open_channels, 1);
    hold.cancel();
    let response = patient("the parked relay", relaying)
        .await
        .unwrap()
        .unwrap();
    let answer = read_body(response.into_body()).await.unwrap();
    assert_eq!(answer, format!("{} true", 2 * MIB).as_bytes());
    fleet.stop().await;
}

/// 002 and the `stalled` row before the head: a relay whose 8 MiB upload stays parked by worker
/// startup past the link's stall timeout fails INTERNAL on the gateway with the stall message;
/// the worker answers it without running its target once start-up converges. The stall timeout
/// is shortened to 300 ms through the gateway's fleet timing (the knob the link has), so the
/// message names 300 ms instead of 60 s.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_upload_parked_past_the_stall_timeout_fails_internal_with_the_stall_message() {
    let logs = logs();
    let probe = Probe::new();
    let hold = CancellationToken::new();
    let mut fleet = TestFleet::start_with(gateway_config(), |timing| {
        timing.link_stall_timeout = Duration::from_millis(300);
    })
    .await;
    add_relay_worker(
        &mut fleet,
        worker_config(2),
        relay_targets(vec![("up", checking_upload(&probe, 14))]),
        Some(hold.clone()),
    )
    .await;
    let worker = fleet.worker_id(0);
    let err = relay(
        &fleet,
        &worker,
        put_call("up", PatternBody::new(14, 8 * MIB)),
    )
    .await
    .unwrap_err();
    assert_eq!(err.code, ErrorCode::Internal);
    assert_eq!(
        err.message,
        format!("The relay's channel to worker {worker} stalled: no credit for 300 ms")
    );
    // The worker has seen the channel fail once it answered the gateway's final frame.
    wait_until("the worker saw the stall", || {
        gateway_link_stats(&fleet, &worker).channel_entries == 0
    })
    .await;
    hold.cancel();
    wait_until("the parked relay fails on the worker", || {
        logs.has_line(&["relay.request", "stalled"])
    })
    .await;
    assert_eq!(
        probe.calls.load(Ordering::SeqCst),
        0,
        "its target never ran"
    );
    no_channel_open(&fleet, &worker).await;
    fleet.stop().await;
}

/// 000: each bound the gateway can check is refused BAD_REQUEST one past its limit before
/// anything is sent (an unknown method, a relative or ftp: URL (a `file:` URL is no `http::Uri`;
/// the worker's test sends one raw), a 4097-character URL, 101
/// headers, an 8193-byte value, a 301-character tenant, a bad lease id, an upper-case target,
/// GET with a body), and passes at its limit.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_gateway_refuses_what_breaks_a_bound_before_anything_is_sent() {
    let probe = Probe::new();
    let (fleet, worker) = fleet_with(relay_targets(vec![("fake", answering(&probe, "ok"))])).await;
    let before = gateway_link_stats(&fleet, &worker);
    let send = |call: RelayCall<http_body_util::Full<Bytes>>| {
        let (fleet, worker) = (&fleet, &worker);
        async move { relay(fleet, worker, call).await.map(drop) }
    };
    let body = |text: &'static str| http_body_util::Full::new(Bytes::from_static(text.as_bytes()));
    let url_of = |len: usize| format!("http://t.test/{}", "a".repeat(len - 14));
    let call = |method: Method, url: &str, text: &'static str| {
        RelayCall::new("fake", request(method, url, body(text)), "t")
    };
    let many = |count: usize, value_len: usize| {
        let mut call = call(Method::GET, "http://t.test/", "");
        for n in 0..count {
            call.request.headers_mut().insert(
                http::HeaderName::from_bytes(format!("x-h-{n}").as_bytes()).unwrap(),
                HeaderValue::from_str(&"v".repeat(value_len)).unwrap(),
            );
        }
        call
    };
    let with = |change: fn(&mut RelayCall<http_body_util::Full<Bytes>>)| {
        let mut call = call(Method::GET, "http://t.test/", "");
        change(&mut call);
        call
    };
    let cases: Vec<(&str, RelayCall<http_body_util::Full<Bytes>>)> = vec![
        ("method", call(Method::TRACE, "http://t.test/", "")),
        ("relative url", call(Method::GET, "/relative", "")),
        ("ftp url", call(Method::GET, "ftp://t.test/x", "")),
        ("long url", call(Method::GET, &url_of(4097), "")),
        ("101 headers", many(101, 1)),
        ("long value", many(1, 8193)),
        ("long tenant", with(|c| c.tenant = "t".repeat(301))),
        ("target", with(|c| c.target = "Fake".into())),
        ("get with a body", call(Method::GET, "http://t.test/", "x")),
        ("empty tenant", with(|c| c.tenant = String::new())),
        ("lease id", with(|c| c.lease_id = Some("XYZ".into()))),
    ];
    for (what, call) in cases {
        let err = send(call).await.unwrap_err();
        assert_eq!(err.code, ErrorCode::BadRequest, "{what}: {err}");
    }
    assert_eq!(probe.calls.load(Ordering::SeqCst), 0);
    let after = gateway_link_stats(&fleet, &worker);
    assert_eq!(
        after.channels_opened, before.channels_opened,
        "no channel was opened"
    );
    assert_eq!(after.bytes_sent, before.bytes_sent, "no body byte went");

    // At the limits.
    let mut at = call(Method::GET, &url_of(4096), "");
    at.tenant = "t".repeat(300);
    at.lease_id = Some(LEASE.into());
    send(at).await.unwrap();
    send(many(100, 8192)).await.unwrap();
    send(call(Method::POST, "http://t.test/", "x"))
        .await
        .unwrap();
    assert_eq!(probe.calls.load(Ordering::SeqCst), 3);
    fleet.stop().await;
}

// === A real worker driven through a raw gateway end ===

fn raw_link() -> LinkConfig {
    LinkConfig::new(End::Gateway)
}

/// A raw gateway end whose writers stall after 200 ms without credit.
fn stalling_raw_link() -> LinkConfig {
    link_config(
        End::Gateway,
        Duration::from_millis(200),
        Duration::from_secs(30),
    )
}

/// Reads a channel's response direction to its failure and returns the reason.
async fn failure_of(reader: &mut simlock_link::ChannelReader) -> FailureReason {
    loop {
        match patient("the channel's end", reader.read_chunk()).await {
            Ok(Some(_)) => {}
            Ok(None) => panic!("the channel ended instead of failing"),
            Err(e) => return e.reason(),
        }
    }
}

/// The relay request `raw_request` builds, changed by `change`.
fn payload_with(
    relay_id: &str,
    target: &str,
    channel: &str,
    change: impl FnOnce(&mut Value),
) -> Value {
    let mut payload = raw_request(relay_id, target, channel);
    change(&mut payload);
    payload
}

/// A PUT with a body, as `raw_request` builds it otherwise.
fn raw_upload(relay_id: &str, target: &str, channel: &str) -> Value {
    payload_with(relay_id, target, channel, |p| {
        p["method"] = json!("PUT");
        p["hasBody"] = json!(true);
    })
}

/// 000/002: relay.request and relay.cancel from an admin session that is not the gateway's
/// uplink answer FORBIDDEN.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn relay_operations_off_the_uplink_are_forbidden() {
    let probe = Probe::new();
    let raw = RawWorker::start(
        relay_targets(vec![("fake", answering(&probe, "x"))]),
        false,
        raw_link(),
    )
    .await;
    let worker = raw.worker();
    let admin = session(
        &worker.running.socket_path(),
        "operator",
        Some(&worker.running.base.home),
    )
    .await;
    let err = admin
        .call("relay.request", raw_request("r1", "fake", "c0"))
        .await
        .unwrap_err();
    assert_eq!(err.code, ErrorCode::Forbidden);
    let err = admin
        .call("relay.cancel", json!({"relayId": "r1"}))
        .await
        .unwrap_err();
    assert_eq!(err.code, ErrorCode::Forbidden);
    assert_eq!(probe.calls.load(Ordering::SeqCst), 0);
    raw.stop().await;
}

/// 002: a relay.request that fails on its schema, a duplicate relayId, a missing target, a target
/// error, target headers out of bounds, a response body failing after the head, or startup
/// failure leaves the test end's channel errored `aborted`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_way_a_relay_fails_on_the_worker_aborts_its_channel() {
    let probe = Probe::new();
    let too_many: Arc<dyn RelayTarget> =
        Arc::new(|_: RelayRequest| async { Ok(with_headers(101)) });
    let raw = RawWorker::start(
        relay_targets(vec![
            ("hold", holding(&probe)),
            ("fail", failing("no")),
            ("many", too_many),
            ("break", breaking()),
        ]),
        false,
        raw_link(),
    )
    .await;
    // The first relay with id "dup" holds its target.
    let held = raw.open().await;
    let dup = raw
        .begin(
            "relay.request",
            raw_request("dup", "hold", held.id().as_str()),
        )
        .await;
    probe.wait_calls(1).await;
    type Payload = Box<dyn Fn(&str) -> Value>;
    let cases: Vec<(&str, Payload, ErrorCode)> = vec![
        (
            "schema",
            Box::new(|ch: &str| payload_with("s1", "hold", ch, |p| p["tenant"] = json!(""))),
            ErrorCode::BadRequest,
        ),
        (
            "duplicate",
            Box::new(|ch: &str| raw_request("dup", "hold", ch)),
            ErrorCode::BadRequest,
        ),
        (
            "missing target",
            Box::new(|ch: &str| raw_request("m1", "nobody", ch)),
            ErrorCode::RelayTargetMissing,
        ),
        (
            "target error",
            Box::new(|ch: &str| raw_request("t1", "fail", ch)),
            ErrorCode::Internal,
        ),
        (
            "headers out of bounds",
            Box::new(|ch: &str| raw_request("h1", "many", ch)),
            ErrorCode::Internal,
        ),
        (
            "body after the head",
            Box::new(|ch: &str| raw_request("b1", "break", ch)),
            ErrorCode::Internal,
        ),
    ];
    for (what, payload, code) in cases {
        let (mut reader, writer) = raw.open().await.into_split();
        let err = raw
            .call("relay.request", payload(writer.id().as_str()))
            .await
            .unwrap_err();
        assert_eq!(err.code, code, "{what}: {err}");
        assert_eq!(
            failure_of(&mut reader).await,
            FailureReason::Aborted,
            "{what}"
        );
    }
    raw.call("relay.cancel", json!({"relayId": "dup"}))
        .await
        .unwrap();
    let (_, reply) = pushes_and_reply(dup).await;
    assert_eq!(reply.unwrap(), json!({"cancelled": true}));
    raw.stop().await;

    // Start-up failure: the parked relay fails DAEMON_STARTUP_FAILED and its channel is aborted.
    let raw = RawWorker::start(
        relay_targets(vec![("hold", holding(&probe))]),
        true,
        raw_link(),
    )
    .await;
    let (mut reader, writer) = raw.open().await.into_split();
    let parked = raw
        .begin(
            "relay.request",
            raw_request("p1", "hold", writer.id().as_str()),
        )
        .await;
    raw.worker()
        .running
        .base
        .gate
        .fail("held start-up failed for the test");
    let (_, reply) = pushes_and_reply(parked).await;
    assert_eq!(reply.unwrap_err().code, ErrorCode::DaemonStartupFailed);
    assert_eq!(failure_of(&mut reader).await, FailureReason::Aborted);
    raw.stop().await;
}

/// 000/002: a relay.request reusing an active relayId fails BAD_REQUEST (above); relay.cancel for
/// an unknown relay id answers {}.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cancel_of_an_unknown_relay_answers_empty() {
    let raw = RawWorker::start(RelayTargets::new(), false, raw_link()).await;
    let answer = raw
        .call("relay.cancel", json!({"relayId": "nobody"}))
        .await
        .unwrap();
    assert_eq!(answer, json!({}));
    raw.stop().await;
}

/// 002 and the `refused` row on the worker: a relay.request naming a channel the gateway never
/// opened or one already accepted fails BAD_REQUEST; with channel missing or out of bounds it
/// fails BAD_REQUEST.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_channel_never_opened_or_already_accepted_or_malformed_is_bad_request() {
    let probe = Probe::new();
    let raw = RawWorker::start(
        relay_targets(vec![("hold", holding(&probe))]),
        false,
        raw_link(),
    )
    .await;
    let held = raw.open().await;
    let held_id = held.id().to_string();
    let first = raw
        .begin("relay.request", raw_request("a", "hold", &held_id))
        .await;
    probe.wait_calls(1).await;
    for (what, payload) in [
        ("never opened", raw_request("b", "hold", "c999")),
        ("already accepted", raw_request("c", "hold", &held_id)),
        ("out of bounds", raw_request("d", "hold", &"c".repeat(33))),
        ("bad characters", raw_request("e", "hold", "c 1")),
        (
            "missing",
            payload_with("f", "hold", "c0", |p| {
                p.as_object_mut().unwrap().remove("channel");
            }),
        ),
    ] {
        let err = raw.call("relay.request", payload).await.unwrap_err();
        assert_eq!(err.code, ErrorCode::BadRequest, "{what}: {err}");
    }
    assert_eq!(probe.calls.load(Ordering::SeqCst), 1);
    raw.call("relay.cancel", json!({"relayId": "a"}))
        .await
        .unwrap();
    let (_, reply) = pushes_and_reply(first).await;
    assert_eq!(reply.unwrap(), json!({"cancelled": true}));
    raw.stop().await;
}

/// 002, the `aborted` row when the worker reads the call late: the gateway's ABORT of a channel
/// can be handled before the text that names it is read. The relay answers {cancelled: true}
/// (not "never opened") and its target never runs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_relay_whose_channel_was_aborted_before_the_call_was_read_is_cancelled() {
    let probe = Probe::new();
    let raw = RawWorker::start(
        relay_targets(vec![("ok", answering(&probe, "fine"))]),
        false,
        raw_link(),
    )
    .await;
    let aborted = raw.open().await;
    let id = aborted.id().to_string();
    // OPEN goes before text: once a call made after it is answered, the worker knows the channel.
    let answer = raw.call("relay.cancel", json!({"relayId": "nobody"})).await;
    assert_eq!(answer.unwrap(), json!({}));
    aborted.abort();
    wait_until("the worker handled the abort and freed the id", || {
        raw.uplink.link.stats().channel_entries == 0
    })
    .await;
    let (pushes, reply) = pushes_and_reply(
        raw.begin("relay.request", raw_request("a", "ok", &id))
            .await,
    )
    .await;
    assert!(pushes.is_empty(), "{pushes:?}");
    assert_eq!(reply.unwrap(), json!({"cancelled": true}));
    let err = raw
        .call("relay.request", raw_request("b", "ok", &id))
        .await
        .unwrap_err();
    assert_eq!(err.code, ErrorCode::BadRequest, "a second claim: {err}");
    assert_eq!(probe.calls.load(Ordering::SeqCst), 0, "no target ran");
    raw.stop().await;
}

/// 002: a hasBody: false relay whose channel still receives bytes: the worker stops that
/// direction and the gateway's writer errors `stopped`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_has_body_false_relay_stops_bytes_that_still_come() {
    let probe = Probe::new();
    let raw = RawWorker::start(
        relay_targets(vec![("ok", answering(&probe, "fine"))]),
        false,
        raw_link(),
    )
    .await;
    let (mut reader, mut writer) = raw.open().await.into_split();
    let id = writer.id().to_string();
    let writing = tokio::spawn(async move {
        loop {
            if let Err(e) = writer.write_bytes(Bytes::from(vec![7u8; 64 * 1024])).await {
                return e.reason();
            }
        }
    });
    let answer = raw
        .call("relay.request", raw_request("r", "ok", &id))
        .await
        .unwrap();
    assert_eq!(answer, json!({}));
    assert_eq!(
        patient("the writer", writing).await.unwrap(),
        FailureReason::Stopped
    );
    let mut body = Vec::new();
    while let Some(chunk) = patient("the response", reader.read_chunk()).await.unwrap() {
        body.extend_from_slice(&chunk);
    }
    assert_eq!(body, b"fine");
    raw.stop().await;
}

/// 000: relay.cancel aborts the target's request signal and relay.request answers
/// {cancelled: true} with no push after the cancel, even from a target that answers anyway.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cancel_answers_cancelled_with_no_push_after_it() {
    let probe = Probe::new();
    let stubborn = probe.target(|_, request| async move {
        request.cancel.cancelled().await;
        Ok(respond(200, full_body("answered anyway")))
    });
    let raw = RawWorker::start(
        relay_targets(vec![("stubborn", stubborn)]),
        false,
        raw_link(),
    )
    .await;
    let (mut reader, writer) = raw.open().await.into_split();
    let call = raw
        .begin(
            "relay.request",
            raw_request("r", "stubborn", writer.id().as_str()),
        )
        .await;
    probe.wait_calls(1).await;
    assert_eq!(
        raw.call("relay.cancel", json!({"relayId": "r"}))
            .await
            .unwrap(),
        json!({})
    );
    let (pushes, reply) = pushes_and_reply(call).await;
    assert_eq!(reply.unwrap(), json!({"cancelled": true}));
    assert!(pushes.is_empty(), "no push after the cancel: {pushes:?}");
    probe.wait_cancelled(1).await;
    assert_eq!(failure_of(&mut reader).await, FailureReason::Aborted);
    raw.stop().await;
}

/// 002: a parked relay whose channel failed while it waited answers by the table without running
/// its target: `stalled` fails INTERNAL, `aborted` answers {cancelled: true}.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_parked_relay_whose_channel_failed_answers_by_the_table_without_its_target() {
    let probe = Probe::new();
    let raw = RawWorker::start(
        relay_targets(vec![("up", checking_upload(&probe, 15))]),
        true,
        stalling_raw_link(),
    )
    .await;
    let (_stalling_reader, mut writer) = raw.open().await.into_split();
    let stalling_id = writer.id().to_string();
    let writing = tokio::spawn(async move {
        for offset in (0..8 * MIB).step_by(64 * 1024) {
            let mut buf = vec![0; 64 * 1024];
            fill_pattern(15, offset, &mut buf);
            if let Err(e) = writer.write_bytes(Bytes::from(buf)).await {
                return Some(e.reason());
            }
        }
        None
    });
    let stalled = raw
        .begin("relay.request", raw_upload("s", "up", &stalling_id))
        .await;
    let aborting = raw.open().await;
    let sent = raw.uplink.link.stats().texts_sent;
    let aborted = raw
        .begin(
            "relay.request",
            raw_request("a", "up", aborting.id().as_str()),
        )
        .await;
    // ABORT goes before text on the link: abort only once the call's line went.
    wait_until("the call's line went", || {
        raw.uplink.link.stats().texts_sent > sent
    })
    .await;
    aborting.abort();
    assert_eq!(
        patient("the stalled writer", writing).await.unwrap(),
        Some(FailureReason::Stalled)
    );
    wait_until("the worker saw both channels fail", || {
        raw.uplink.link.stats().channel_entries == 0
    })
    .await;
    raw.hold.cancel();
    let (pushes, reply) = pushes_and_reply(stalled).await;
    assert!(pushes.is_empty());
    let err = reply.unwrap_err();
    assert_eq!(err.code, ErrorCode::Internal);
    assert!(err.message.contains("stalled"), "{err}");
    let (pushes, reply) = pushes_and_reply(aborted).await;
    assert!(pushes.is_empty());
    assert_eq!(reply.unwrap(), json!({"cancelled": true}));
    assert_eq!(probe.calls.load(Ordering::SeqCst), 0, "no target ran");
    raw.stop().await;
}

/// The `stalled` row on the worker: a relay whose channel stalled while its target ran fails
/// INTERNAL once the target answers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_channel_that_stalls_under_a_running_target_fails_the_relay_internal() {
    let probe = Probe::new();
    let late = probe.target(|probe, _| async move {
        probe.release.cancelled().await;
        Ok(respond(200, full_body("late")))
    });
    let raw = RawWorker::start(
        relay_targets(vec![("late", late)]),
        false,
        stalling_raw_link(),
    )
    .await;
    let (_reader, mut writer) = raw.open().await.into_split();
    let call = raw
        .begin(
            "relay.request",
            raw_upload("r", "late", writer.id().as_str()),
        )
        .await;
    probe.wait_calls(1).await;
    let reason = loop {
        if let Err(e) = writer.write_bytes(Bytes::from(vec![1u8; 64 * 1024])).await {
            break e.reason();
        }
    };
    assert_eq!(reason, FailureReason::Stalled);
    wait_until("the worker saw the stall", || {
        raw.uplink.link.stats().channel_entries == 0
    })
    .await;
    probe.release.cancel();
    let (pushes, reply) = pushes_and_reply(call).await;
    assert!(pushes.is_empty(), "no head for a stalled channel");
    let err = reply.unwrap_err();
    assert_eq!(err.code, ErrorCode::Internal);
    assert!(err.message.contains("stalled"), "{err}");
    raw.stop().await;
}

/// 000: each bound in the field table is refused BAD_REQUEST one past its limit (a 65-character
/// relay id, an upper-case target, an unknown method, a relative or file: URL, a 4097-character
/// URL, 101 headers, a header name with a space, a value with a newline, an 8193-character value,
/// a 301-character tenant, a bad lease id, GET with hasBody, a 33-character channel), and passes
/// at its limit.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_bound_is_refused_one_past_its_limit_and_passes_at_it() {
    let probe = Probe::new();
    let long_target = format!("a{}", "b".repeat(63));
    let raw = RawWorker::start(
        relay_targets(vec![
            ("fake", answering(&probe, "ok")),
            (long_target.as_str(), answering(&probe, "ok")),
        ]),
        false,
        raw_link(),
    )
    .await;
    let url_of = |len: usize| format!("http://t.test/{}", "a".repeat(len - 14));
    let headers_of = |count: usize, value: &str| {
        json!(
            (0..count)
                .map(|n| [format!("x-{n}"), value.to_owned()])
                .collect::<Vec<_>>()
        )
    };
    type Change = Box<dyn Fn(&mut Value)>;
    let past: Vec<(&str, Change)> = vec![
        (
            "relayId",
            Box::new(|p| p["relayId"] = json!("r".repeat(65))),
        ),
        ("target", Box::new(|p| p["target"] = json!("Fake"))),
        ("method", Box::new(|p| p["method"] = json!("TRACE"))),
        ("relative url", Box::new(|p| p["url"] = json!("/relative"))),
        (
            "file url",
            Box::new(|p| p["url"] = json!("file:///etc/passwd")),
        ),
        (
            "long url",
            Box::new(move |p| p["url"] = json!(url_of(4097))),
        ),
        (
            "101 headers",
            Box::new(move |p| p["headers"] = headers_of(101, "v")),
        ),
        (
            "name with a space",
            Box::new(|p| p["headers"] = json!([["bad name", "v"]])),
        ),
        (
            "value with a newline",
            Box::new(|p| p["headers"] = json!([["x-a", "a\nb"]])),
        ),
        (
            "long value",
            Box::new(move |p| p["headers"] = headers_of(1, &"v".repeat(8193))),
        ),
        (
            "long tenant",
            Box::new(|p| p["tenant"] = json!("t".repeat(301))),
        ),
        (
            "lease id",
            Box::new(|p| p["leaseId"] = json!("0123456789ABCDEF0123456789abcdef")),
        ),
        ("GET with hasBody", Box::new(|p| p["hasBody"] = json!(true))),
        ("unknown key", Box::new(|p| p["extra"] = json!(1))),
    ];
    for (n, (what, change)) in past.iter().enumerate() {
        let channel = raw.open().await;
        let mut payload = raw_request(&format!("past-{n}"), "fake", channel.id().as_str());
        change(&mut payload);
        let err = raw.call("relay.request", payload).await.unwrap_err();
        assert_eq!(err.code, ErrorCode::BadRequest, "{what}: {err}");
    }
    let err = raw
        .call("relay.request", raw_request("c", "fake", &"c".repeat(33)))
        .await
        .unwrap_err();
    assert_eq!(err.code, ErrorCode::BadRequest);
    assert_eq!(
        probe.calls.load(Ordering::SeqCst),
        0,
        "nothing out of bounds ran"
    );

    let at: Vec<(&str, Change)> = vec![
        (
            "relayId",
            Box::new(|p| p["relayId"] = json!("r".repeat(64))),
        ),
        (
            "target",
            Box::new(move |p| p["target"] = json!(long_target)),
        ),
        ("url", Box::new(move |p| p["url"] = json!(url_of(4096)))),
        (
            "100 headers",
            Box::new(move |p| p["headers"] = headers_of(100, "v")),
        ),
        (
            "value",
            Box::new(move |p| p["headers"] = headers_of(1, &"v".repeat(8192))),
        ),
        ("tenant", Box::new(|p| p["tenant"] = json!("t".repeat(300)))),
        ("lease id", Box::new(|p| p["leaseId"] = json!(LEASE))),
        (
            "POST with hasBody",
            Box::new(|p| {
                p["method"] = json!("POST");
                p["hasBody"] = json!(true);
            }),
        ),
    ];
    for (what, change) in &at {
        let (_reader, mut writer) = raw.open().await.into_split();
        let mut payload = raw_request("at", "fake", writer.id().as_str());
        change(&mut payload);
        writer.finish().await.unwrap();
        let answer = raw.call("relay.request", payload).await;
        assert_eq!(answer.unwrap(), json!({}), "{what}");
    }
    assert_eq!(probe.calls.load(Ordering::SeqCst), at.len());
    raw.stop().await;
}

/// Deliver list: the close of the connection a relay came on cancels the relay, while a
/// device.exec running on the same connection keeps running to its end.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn closing_the_connection_cancels_its_relays_and_an_exec_keeps_running() {
    let dir = tempfile::tempdir().unwrap();
    let (go, marker) = (dir.path().join("go"), dir.path().join("marker"));
    let probe = Probe::new();
    let raw = RawWorker::start_with(
        exec_config(r#"while [ ! -e "$1" ]; do sleep 0.01; done; echo done > "$2""#),
        relay_targets(vec![("hold", holding(&probe))]),
        false,
        raw_link(),
    )
    .await;
    let grant = raw
        .call("lease.request", json!({"platform": "ios"}))
        .await
        .unwrap();
    let mut exec = raw
        .begin(
            "device.exec",
            json!({
                "leaseId": grant["lease"]["id"],
                "tool": "talk",
                "args": [go.to_str().unwrap(), marker.to_str().unwrap()],
                "requesterId": grant["lease"]["requesterId"],
            }),
        )
        .await;
    match patient("the exec starts", exec.next()).await {
        CallEvent::Push(push) => assert_eq!(push.push, "started"),
        CallEvent::Reply(reply) => panic!("the exec ended early: {reply:?}"),
    }
    let channel = raw.open().await;
    let _relay = raw
        .begin(
            "relay.request",
            raw_request("r", "hold", channel.id().as_str()),
        )
        .await;
    probe.wait_calls(1).await;
    raw.uplink.link.close();
    probe.wait_cancelled(1).await;
    std::fs::write(&go, b"go").unwrap();
    wait_until("the exec ran to its end", || marker.exists()).await;
    raw.stop().await;
}

/// 000 (on the uplink itself): a relay and a device.exec with output running at once on one
/// connection each get only their own pushes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_one_connection_a_relay_and_an_exec_get_only_their_own_pushes() {
    let target: Arc<dyn RelayTarget> = Arc::new(|_: RelayRequest| async {
        Ok(respond(202, pattern_response(16, 2 * MIB, Arc::default())))
    });
    let raw = RawWorker::start_with(
        exec_config("for i in 1 2 3 4 5; do echo line-$i; echo err-$i >&2; done"),
        relay_targets(vec![("bulk", target)]),
        false,
        raw_link(),
    )
    .await;
    let grant = raw
        .call("lease.request", json!({"platform": "ios"}))
        .await
        .unwrap();
    let exec = raw
        .begin(
            "device.exec",
            json!({
                "leaseId": grant["lease"]["id"],
                "tool": "talk",
                "args": [],
                "requesterId": grant["lease"]["requesterId"],
            }),
        )
        .await;
    let (mut reader, writer) = raw.open().await.into_split();
    let relay = raw
        .begin(
            "relay.request",
            raw_request("r", "bulk", writer.id().as_str()),
        )
        .await;
    let (exec_id, relay_id) = (exec.id(), relay.id());
    let reading = tokio::spawn(async move {
        let mut check = PatternCheck::new(16);
        while let Some(chunk) = reader.read_chunk().await.unwrap() {
            check.feed(&chunk);
        }
        check
    });
    let (exec_pushes, exec_reply) = pushes_and_reply(exec).await;
    let (relay_pushes, relay_reply) = pushes_and_reply(relay).await;
    assert_eq!(exec_reply.unwrap()["exitCode"], 0);
    assert_eq!(relay_reply.unwrap(), json!({}));
    assert!(exec_pushes.iter().all(|p| {
        (p.push == "started" || p.push == "output") && p.payload["requestId"] == exec_id
    }));
    assert!(exec_pushes.iter().filter(|p| p.push == "output").count() >= 2);
    assert_eq!(relay_pushes.len(), 1);
    assert_eq!(relay_pushes[0].push, "relay-head");
    assert_eq!(relay_pushes[0].payload["requestId"], relay_id);
    assert_eq!(relay_pushes[0].payload["status"], 202);
    let check = patient("the relayed body", reading).await.unwrap();
    assert!(check.ok && check.offset == 2 * MIB);
    raw.stop().await;
}

// === The real gateway against a scripted worker (raw relay frames) ===

fn worker_link() -> LinkConfig {
    LinkConfig::new(End::Worker)
}

type ScriptResult = futures::future::BoxFuture<'static, Result<Value, ContractError>>;

/// A gateway with one scripted worker `scripted`.
async fn scripted(
    link: LinkConfig,
    script: impl Fn(ScriptedCall) -> ScriptResult + Send + Sync + 'static,
) -> (TestFleet, Arc<ScriptedWorker>, simlock_link::LinkHandle) {
    let fleet = TestFleet::start(gateway_config()).await;
    let (worker, link) = ScriptedWorker::start(&fleet, "scripted", link, script).await;
    (fleet, worker, link)
}

/// 000: a relay-head with status 101 fails the relay with INTERNAL naming the worker, and the
/// gateway sends relay.cancel.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_invalid_relay_head_fails_internal_and_sends_relay_cancel() {
    let relay_ids: Arc<parking_lot::Mutex<Vec<String>>> = Arc::default();
    let ids = relay_ids.clone();
    let (fleet, worker, _link) = scripted(worker_link(), move |call| {
        let channel = call.accept();
        ids.lock().push(call.relay_id());
        async move {
            call.head(101, vec![]).await;
            futures::future::pending::<()>().await;
            drop(channel);
            Ok(json!({}))
        }
        .boxed()
    })
    .await;
    let err = relay(&fleet, "scripted", get_call("fake"))
        .await
        .unwrap_err();
    assert_eq!(err.code, ErrorCode::Internal);
    assert!(
        err.message
            .starts_with("worker scripted sent an invalid relay response"),
        "{err}"
    );
    let relay_id = relay_ids.lock()[0].clone();
    worker.wait_cancel(&relay_id).await;
    fleet.stop().await;
}

/// 000: relay.request answering {} with no head, and {cancelled: true} with no cancel sent, fail
/// the relay with INTERNAL saying the worker ended it without a response.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_answer_without_a_head_fails_internal() {
    let (fleet, _worker, _link) = scripted(worker_link(), |call| {
        let channel = call.accept();
        let cancelled = call.payload["tenant"] == "cancelled";
        async move {
            drop(channel);
            Ok(if cancelled {
                json!({"cancelled": true})
            } else {
                json!({})
            })
        }
        .boxed()
    })
    .await;
    for tenant in ["plain", "cancelled"] {
        let err = relay(
            &fleet,
            "scripted",
            RelayCall::new("fake", get("http://t.test/"), tenant),
        )
        .await
        .unwrap_err();
        assert_eq!(err.code, ErrorCode::Internal, "{tenant}");
        assert_eq!(
            err.message,
            "worker scripted ended the relay without a response"
        );
    }
    fleet.stop().await;
}

/// 000 and the `aborted` row after the head: a worker INTERNAL after the head errors the
/// caller's body stream with that message.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_internal_after_the_head_errors_the_body_with_its_message() {
    let (fleet, _worker, _link) = scripted(worker_link(), |call| {
        let channel = call.accept();
        async move {
            call.head(200, vec![]).await;
            let (_reader, mut writer) = channel.unwrap().into_split();
            writer
                .write_bytes(Bytes::from_static(b"partial"))
                .await
                .unwrap();
            writer.abort();
            Err(ContractError::internal("the worker broke after the head"))
        }
        .boxed()
    })
    .await;
    let response = relay(&fleet, "scripted", get_call("fake")).await.unwrap();
    let err = read_body(response.into_body()).await.unwrap_err();
    assert_eq!(err.code, ErrorCode::Internal);
    assert_eq!(err.message, "the worker broke after the head");
    fleet.stop().await;
}

/// 000: DAEMON_STOPPING from a worker reads as a lost uplink in the relay and in the
/// coordinator (the one classification).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn daemon_stopping_from_a_worker_reads_as_a_lost_uplink() {
    assert!(simlock_fleet::error::is_uplink_lost(
        &ContractError::stopping()
    ));
    let (fleet, _worker, _link) = scripted(worker_link(), |call| {
        let channel = call.accept();
        async move {
            drop(channel);
            Err(ContractError::stopping())
        }
        .boxed()
    })
    .await;
    let err = relay(&fleet, "scripted", get_call("fake"))
        .await
        .unwrap_err();
    assert_eq!(err.code, ErrorCode::WorkerUnreachable);
    assert_eq!(err.details.unwrap()["workerId"], "scripted");
    fleet.stop().await;
}

/// 002: with the worker's {} answer overtaking a 20 MiB response, the caller still gets every
/// byte, and its body ends only at the channel's END.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_answer_that_overtakes_the_body_still_delivers_every_byte() {
    let (fleet, _worker, _link) = scripted(worker_link(), |call| {
        let channel = call.accept();
        let link = call.link();
        async move {
            // Counted before the head: the head and then the answer go first.
            let sent = link.stats().texts_sent;
            call.head(200, vec![]).await;
            let (_reader, mut writer) = channel.unwrap().into_split();
            tokio::spawn(async move {
                // The answer goes first; the body follows it on the socket.
                wait_until("the answer went", || link.stats().texts_sent > sent + 1).await;
                for offset in (0..20 * MIB).step_by(256 * 1024) {
                    let mut buf = vec![0; 256 * 1024];
                    fill_pattern(17, offset, &mut buf);
                    writer.write_bytes(Bytes::from(buf)).await.unwrap();
                }
                writer.finish().await.unwrap();
            });
            Ok(json!({}))
        }
        .boxed()
    })
    .await;
    // The gateway's bookkeeping calls are answered: the relay's texts are the only ones left.
    fleet
        .wait_for(|views| {
            views
                .iter()
                .any(|v| v.id == "scripted" && v.catalog_read_at.is_some())
        })
        .await;
    let response = relay(&fleet, "scripted", get_call("fake")).await.unwrap();
    let check = check_pattern(response.into_body(), 17).await;
    assert!(check.ok);
    assert_eq!(check.offset, 20 * MIB);
    fleet.stop().await;
}

/// 002: response bytes that overtake their head wait at the gateway: a 1 MiB body that fills
/// its window before the head is pushed, and a small body whose END went before the head, each
/// reach the caller whole, in order, after the head.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_body_ahead_of_its_head_reaches_the_caller_whole() {
    let (fleet, _worker, _link) = scripted(worker_link(), |call| {
        let channel = call.accept();
        let link = call.link();
        let len = if call.payload["tenant"] == "small" {
            1000
        } else {
            MIB
        };
        async move {
            let (_reader, mut writer) = channel.unwrap().into_split();
            let stalls = link.stats().credit_stalls;
            let writing = tokio::spawn(async move {
                let mut buf = vec![0; usize::try_from(len).unwrap()];
                fill_pattern(20, 0, &mut buf);
                writer.write_bytes(Bytes::from(buf)).await.unwrap();
                writer.finish().await.unwrap();
            });
            if len == MIB {
                // The body used up its window while the head was held back.
                wait_until("the body fills its window", || {
                    link.stats().credit_stalls > stalls
                })
                .await;
            } else {
                // The whole body and its END went before the head.
                patient("the small body", writing).await.unwrap();
            }
            call.head(200, vec![]).await;
            Ok(json!({}))
        }
        .boxed()
    })
    .await;
    for (tenant, len) in [("large", MIB), ("small", 1000)] {
        let call = RelayCall::new("fake", get("http://t.test/"), tenant);
        let response = relay(&fleet, "scripted", call).await.unwrap();
        let check = check_pattern(response.into_body(), 20).await;
        assert!(check.ok, "{tenant}: every byte in order");
        assert_eq!(check.offset, len, "{tenant}");
    }
    fleet.stop().await;
}

/// 002: a worker that answers {} and never ends the response body: the caller's body errors
/// with the deadline message. (2 s: the head and the first bytes must be read before it.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_answer_without_an_end_errors_the_body_at_the_deadline() {
    let (fleet, _worker, _link) = scripted(worker_link(), |call| {
        let channel = call.accept();
        async move {
            call.head(200, vec![]).await;
            let (reader, mut writer) = channel.unwrap().into_split();
            writer
                .write_bytes(Bytes::from_static(b"some"))
                .await
                .unwrap();
            // Keep the channel open, never END it.
            tokio::spawn(async move {
                futures::future::pending::<()>().await;
                drop((reader, writer));
            });
            Ok(json!({}))
        }
        .boxed()
    })
    .await;
    let short = fleet.gateway().relay.with_deadline(Duration::from_secs(2));
    let response = patient("the relay", short.relay("scripted", get_call("fake")))
        .await
        .unwrap();
    let mut body = response.into_body();
    let first = patient("a frame", body.frame()).await.unwrap().unwrap();
    assert_eq!(first.into_data().unwrap(), "some");
    let err = read_body(body).await.unwrap_err();
    assert_eq!(err.code, ErrorCode::WorkerUnreachable);
    assert_eq!(
        err.message,
        "worker scripted did not finish the relayed request within 2000 ms"
    );
    fleet.stop().await;
}

/// The `stalled` row after the head: a response whose writer stalls on the worker (the caller
/// reads nothing) errors the caller's body INTERNAL, naming the worker and the stall timeout.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stall_after_the_head_errors_the_body_with_the_stall_message() {
    let stalled = CancellationToken::new();
    let (fleet, _worker, _link) = scripted(
        link_config(
            End::Worker,
            Duration::from_millis(200),
            Duration::from_secs(30),
        ),
        {
            let stalled = stalled.clone();
            move |call| {
                let channel = call.accept();
                let stalled = stalled.clone();
                async move {
                    call.head(200, vec![]).await;
                    let (_reader, mut writer) = channel.unwrap().into_split();
                    loop {
                        if let Err(e) = writer.write_bytes(Bytes::from(vec![0u8; 64 * 1024])).await
                        {
                            assert_eq!(e.reason(), FailureReason::Stalled);
                            stalled.cancel();
                            return Err(ContractError::internal("stalled on the worker"));
                        }
                    }
                }
                .boxed()
            }
        },
    )
    .await;
    let response = relay(&fleet, "scripted", get_call("fake")).await.unwrap();
    patient("the worker's writer stalls", stalled.cancelled()).await;
    let err = read_body(response.into_body()).await.unwrap_err();
    assert_eq!(err.code, ErrorCode::Internal);
    assert_eq!(
        err.message,
        "The relay's channel to worker scripted stalled: no credit for 60 s"
    );
    fleet.stop().await;
}

/// The `aborted` row before the head: the worker's relay.request error if one arrives, else
/// INTERNAL naming the worker; and after the head with a {} answer, INTERNAL naming the worker.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_abort_by_the_worker_reads_as_its_error_or_internal() {
    let (fleet, _worker, _link) = scripted(worker_link(), |call| {
        let channel = call.accept();
        let tenant = call.payload["tenant"]
            .as_str()
            .unwrap_or_default()
            .to_owned();
        async move {
            let channel = channel.unwrap();
            if tenant == "after" {
                call.head(200, vec![]).await;
            }
            channel.abort();
            match tenant.as_str() {
                "error" => Err(ContractError::bad_request("the worker said no")),
                _ => Ok(json!({})),
            }
        }
        .boxed()
    })
    .await;
    let upload = |tenant: &str| {
        RelayCall::new(
            "fake",
            request(Method::PUT, "http://t.test/", PatternBody::new(18, 4 * MIB)),
            tenant,
        )
    };
    let err = relay(&fleet, "scripted", upload("error"))
        .await
        .unwrap_err();
    assert_eq!(err.code, ErrorCode::BadRequest);
    assert_eq!(err.message, "the worker said no");
    let err = relay(&fleet, "scripted", upload("quiet"))
        .await
        .unwrap_err();
    assert_eq!(err.code, ErrorCode::Internal);
    assert!(err.message.contains("worker scripted"), "{err}");
    let response = relay(
        &fleet,
        "scripted",
        RelayCall::new("fake", get("http://t.test/"), "after"),
    )
    .await
    .unwrap();
    let err = read_body(response.into_body()).await.unwrap_err();
    assert_eq!(err.code, ErrorCode::Internal);
    assert_eq!(err.message, "worker scripted aborted the relay");
    fleet.stop().await;
}

/// The `refused` row: a channel the worker never accepts (its 200 ms accept timeout passes)
/// fails the relay INTERNAL naming the worker, with an upload and without.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_channel_fails_internal_naming_the_worker() {
    let (fleet, worker, _link) = scripted(
        link_config(
            End::Worker,
            Duration::from_secs(60),
            Duration::from_millis(200),
        ),
        |_call| futures::future::pending().boxed(),
    )
    .await;
    let upload = put_call("fake", PatternBody::new(19, 4 * MIB));
    let err = relay(&fleet, "scripted", upload).await.unwrap_err();
    assert_eq!(err.code, ErrorCode::Internal);
    assert_eq!(err.message, "worker scripted refused the relay's channel");
    let err = relay(&fleet, "scripted", get_call("fake"))
        .await
        .unwrap_err();
    assert_eq!(err.code, ErrorCode::Internal);
    assert_eq!(err.message, "worker scripted refused the relay's channel");
    worker.wait_cancels(2).await;
    fleet.stop().await;
}

/// 002: OPERATIONS has no relay.body and no relay-chunk push exists; RELAY_TARGET_MISSING maps to
/// HTTP 503 and CLI exit 1.
#[test]
fn the_contract_has_no_relay_body_and_no_relay_chunk() {
    assert!(
        simlock_contract::OPERATIONS
            .iter()
            .all(|op| op.name != "relay.body")
    );
    assert!(
        simlock_contract::OPERATIONS
            .iter()
            .any(|op| op.name == "relay.request")
    );
    let chunk = simlock_contract::PushFrame {
        push: "relay-chunk".into(),
        payload: json!({"requestId": 1, "chunk": "AAAA"}),
    };
    assert!(simlock_contract::Push::from_frame(chunk).is_err());
    assert_eq!(ErrorCode::RelayTargetMissing.http_status(), 503);
    assert_eq!(ErrorCode::RelayTargetMissing.exit_code(), 1);
}

/// 002/000: the caller's abort sends relay.cancel, before the head (its signal) and after it
/// (dropping the body); both abort the channel.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_callers_abort_sends_relay_cancel_before_and_after_the_head() {
    let relay_ids: Arc<parking_lot::Mutex<Vec<String>>> = Arc::default();
    let ids = relay_ids.clone();
    let (fleet, worker, link) = scripted(worker_link(), move |call| {
        let channel = call.accept();
        ids.lock().push(call.relay_id());
        let head = call.payload["tenant"] == "head";
        async move {
            let (reader, mut writer) = channel.unwrap().into_split();
            if head {
                call.head(200, vec![]).await;
                writer
                    .write_bytes(Bytes::from_static(b"some"))
                    .await
                    .unwrap();
            }
            futures::future::pending::<()>().await;
            drop((reader, writer));
            Ok(json!({}))
        }
        .boxed()
    })
    .await;
    let abort = CancellationToken::new();
    let mut call = RelayCall::new("fake", get("http://t.test/"), "early");
    call.cancel = Some(abort.clone());
    let relaying = spawn_relay(&fleet, "scripted", call);
    wait_until("the worker has the relay", || relay_ids.lock().len() == 1).await;
    abort.cancel();
    let err = patient("the relay", relaying).await.unwrap().unwrap_err();
    assert_eq!(err.code, ErrorCode::Cancelled);
    let first = relay_ids.lock()[0].clone();
    worker.wait_cancel(&first).await;

    let response = relay(
        &fleet,
        "scripted",
        RelayCall::new("fake", get("http://t.test/"), "head"),
    )
    .await
    .unwrap();
    let mut body = response.into_body();
    patient("a frame", body.frame()).await.unwrap().unwrap();
    drop(body);
    let second = relay_ids.lock()[1].clone();
    worker.wait_cancel(&second).await;
    wait_until("both channels are gone on the worker's link", || {
        link.stats().open_channels == 0
    })
    .await;
    fleet.stop().await;
}
