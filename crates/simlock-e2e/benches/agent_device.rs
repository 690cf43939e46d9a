//! The agent-device upload benchmark: `cargo bench -p simlock-e2e --bench agent_device` (or
//! `cargo xtask bench agent-device`).
//!
//! One worker serving `/v1/agent-device` over the published agent-device 0.21.5 daemon (fetched
//! by `cargo xtask fetch-peers`). A 256 MiB upload — preflight, PUT, finalize, as the CLI does
//! it — goes through the worker's front and straight to the same daemon, alternated, seven times
//! each; the ratio of each pair's throughputs (direct time / through-the-worker time) is taken
//! and the median reported. The daemon hashes the whole file at finalize on both paths; the
//! PUT-only ratio is printed beside it.
//!
//! The last line is the summary: `agent-device worker_upload_ratio=<x>`.
#![allow(
    clippy::print_stdout,
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    reason = "a benchmark reports on stdout and fails by panicking"
)]

use std::time::Duration;

use bytes::Bytes;
use http::{Method, Request};
use http_body_util::{BodyExt, StreamBody};
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use serde_json::{Value, json};
use sha2::{Digest, Sha256};
use simlock_e2e::agent_device::{AdWorker, agent_device_config, real_daemon_command, real_package};
use tokio::time::Instant;

type BoxError = Box<dyn std::error::Error + Send + Sync>;
type Body = http_body_util::combinators::BoxBody<Bytes, BoxError>;

const MIB: usize = 1024 * 1024;
const SIZE: usize = 256 * MIB;
const CHUNK: usize = 256 * 1024;
const RUNS: usize = 7;

fn main() {
    let runtime = simlock_daemon::launch::runtime().expect("a runtime");
    runtime.block_on(async {
        tokio::spawn(bench()).await.expect("the bench ran");
    });
}

/// The body's bytes: a repeating pattern, the same every run.
fn chunk() -> Bytes {
    Bytes::from(
        (0..CHUNK)
            .map(|i| u8::try_from(i % 251).unwrap())
            .collect::<Vec<u8>>(),
    )
}

fn streamed(piece: Bytes) -> Body {
    let frames = futures::stream::iter(
        (0..SIZE / CHUNK).map(move |_| Ok::<_, BoxError>(http_body::Frame::data(piece.clone()))),
    );
    StreamBody::new(frames).boxed()
}

fn full(bytes: impl Into<Bytes>) -> Body {
    http_body_util::Full::new(bytes.into())
        .map_err(|never| match never {})
        .boxed()
}

struct Target {
    /// The base the routes hang off: the daemon's root, or the worker's `/v1/agent-device`.
    base: String,
    /// The token the request carries.
    token: String,
}

struct Timing {
    total: Duration,
    put: Duration,
}

async fn upload(
    client: &Client<hyper_util::client::legacy::connect::HttpConnector, Body>,
    target: &Target,
    piece: &Bytes,
    sha256: &str,
    attempt: usize,
) -> Timing {
    let started = Instant::now();
    let bearer = format!("Bearer {}", target.token);
    let send = |method: Method, url: String, headers: Vec<(String, String)>, body: Body| {
        let mut request = Request::builder().method(method).uri(url);
        for (name, value) in headers {
            request = request.header(name, value);
        }
        client.request(request.body(body).unwrap())
    };
    let preflight = json!({
        "uploadAttemptId": format!("bench-{attempt}"),
        "sha256": sha256,
        "fileName": format!("bench-{attempt}.apk"),
        "sizeBytes": SIZE,
        "artifactType": "file",
        "platform": "android",
        "contentType": "application/octet-stream",
    });
    let auth = vec![
        ("authorization".to_owned(), bearer.clone()),
        ("x-agent-device-token".to_owned(), target.token.clone()),
        ("content-type".to_owned(), "application/json".to_owned()),
    ];
    let ticket = send(
        Method::POST,
        format!("{}/upload/preflight", target.base),
        auth.clone(),
        full(preflight.to_string()),
    )
    .await
    .unwrap();
    assert!(
        ticket.status().is_success(),
        "preflight: {}",
        ticket.status()
    );
    let ticket: Value =
        serde_json::from_slice(&ticket.into_body().collect().await.unwrap().to_bytes()).unwrap();
    let url = ticket["upload"]["url"].as_str().unwrap().to_owned();
    let headers: Vec<(String, String)> = ticket["upload"]["headers"]
        .as_object()
        .unwrap()
        .iter()
        .map(|(k, v)| (k.clone(), v.as_str().unwrap().to_owned()))
        .collect();
    let put_started = Instant::now();
    let put = send(Method::PUT, url, headers, streamed(piece.clone()))
        .await
        .unwrap();
    let status = put.status();
    let _ = put.into_body().collect().await.unwrap();
    assert!(status.is_success(), "PUT: {status}");
    let put_time = put_started.elapsed();
    let finalize = json!({"uploadId": ticket["uploadId"]});
    let done = send(
        Method::POST,
        format!("{}/upload/finalize", target.base),
        auth,
        full(finalize.to_string()),
    )
    .await
    .unwrap();
    let status = done.status();
    let body = done.into_body().collect().await.unwrap().to_bytes();
    assert!(
        status.is_success(),
        "finalize: {status} {}",
        String::from_utf8_lossy(&body)
    );
    Timing {
        total: started.elapsed(),
        put: put_time,
    }
}

fn median(mut values: Vec<f64>) -> f64 {
    values.sort_by(f64::total_cmp);
    values[values.len() / 2]
}

async fn bench() {
    let pkg = real_package();
    let worker = AdWorker::start(agent_device_config(real_daemon_command(&pkg)), |_| {}).await;
    worker.wait_running().await;
    let (_, secret) = worker.token("agent").await;
    let agent_device_host::DaemonState::Running(endpoint) = worker.host().state() else {
        panic!("the daemon runs");
    };
    let direct = Target {
        base: format!("http://127.0.0.1:{}", endpoint.port),
        token: endpoint.token.clone(),
    };
    let through = Target {
        base: worker.base(),
        token: secret,
    };
    let piece = chunk();
    let mut hasher = Sha256::new();
    for _ in 0..SIZE / CHUNK {
        hasher.update(&piece);
    }
    let sha256: String = hasher
        .finalize()
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    let client = Client::builder(TokioExecutor::new()).build_http();
    // One of each first, to warm up connections and the daemon.
    let _ = upload(&client, &direct, &piece, &sha256, 0).await;
    let _ = upload(&client, &through, &piece, &sha256, 1).await;
    let mut ratios = Vec::new();
    let mut put_ratios = Vec::new();
    for run in 0..RUNS {
        // Alternate which goes first, so neither always meets a warmer machine.
        let (d, w) = if run % 2 == 0 {
            let d = upload(&client, &direct, &piece, &sha256, 10 + 2 * run).await;
            let w = upload(&client, &through, &piece, &sha256, 11 + 2 * run).await;
            (d, w)
        } else {
            let w = upload(&client, &through, &piece, &sha256, 11 + 2 * run).await;
            let d = upload(&client, &direct, &piece, &sha256, 10 + 2 * run).await;
            (d, w)
        };
        let ratio = d.total.as_secs_f64() / w.total.as_secs_f64();
        let put_ratio = d.put.as_secs_f64() / w.put.as_secs_f64();
        let mibs = |t: Duration| 256.0 / t.as_secs_f64();
        println!(
            "run {run}: direct {:.0} MiB/s (PUT {:.0}), through the worker {:.0} MiB/s (PUT {:.0}): ratio {ratio:.3} (PUT {put_ratio:.3})",
            mibs(d.total),
            mibs(d.put),
            mibs(w.total),
            mibs(w.put)
        );
        ratios.push(ratio);
        put_ratios.push(put_ratio);
    }
    let ratio = median(ratios);
    println!("PUT-only median ratio {:.3}", median(put_ratios));
    worker.stop().await;
    println!("agent-device worker_upload_ratio={ratio:.3}");
}
