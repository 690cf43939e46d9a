//! The relay benchmark: `cargo bench -p simlock-e2e --bench relay` (or `cargo xtask bench relay`).
//!
//! One process: a real gateway and a real worker over a loopback WebSocket uplink, with relay
//! targets on the worker and the gateway's `GatewayRelay` as the caller. It measures, in one run:
//! - 1 GiB uploads and downloads through the relay, as ratios to direct loopback HTTP/1.1 (hyper
//!   client to hyper server) moving the same bodies in the same run (each relayed transfer next
//!   to a direct one; the median of eleven ratios, since the machine is shared). Each run also
//!   prints the process's CPU time per GiB for both, which the host's other tenants disturb less
//!   than wall-clock throughput (the relayed figure includes the renews running beside it);
//! - the p99 of a `lease.renew` forwarded to the same worker while those transfers run (all
//!   samples of every run together; each run's own p99 is printed beside its ratio);
//! - the growth of the process's RSS (gateway and worker together) with 64 relays whose callers
//!   never read, each target streaming freshly allocated bytes;
//! - a 4 GiB response body through the relay, every byte checked against a pattern, with the
//!   RSS sampled along the way (constant memory: growth under 64 MiB).
//!
//! With `--tls` (`cargo xtask bench relay --tls`) the gateway serves WSS and the worker dials
//! `wss://` (certificates made at start), and the direct baseline is HTTPS over loopback with
//! the same rustls settings, so the ratios compare TLS with TLS.
//!
//! The last line is the summary:
//! `relay upload_ratio=<x> download_ratio=<x> renew_p99_ms=<x> stalled64_rss_mib=<x> body4g_ok=<true|false>`.
#![allow(
    clippy::print_stdout,
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    reason = "a benchmark reports on stdout and fails by panicking"
)]

use std::convert::Infallible;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http_body::{Body, Frame};
use http_body_util::BodyExt;
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
use serde_json::json;
use simlock_e2e::relay::{
    PatternBody, PatternCheck, fill_pattern, fleet_with, fleet_with_tls, gateway_link_stats, get,
    no_channel_open, relay_targets, request, wait_until,
};
use simlock_relay_gateway::{GatewayRelay, RelayCall};
use simlock_relay_worker::{BoxError, RelayRequest, RelayTarget, RelayTargets};
use tokio::net::{TcpListener, TcpStream};
use tokio::time::Instant;

type BenchResult<T> = Result<T, Box<dyn std::error::Error + Send + Sync>>;

const MIB: u64 = 1024 * 1024;
const GIB: u64 = 1024 * MIB;
const CHUNK: usize = 64 * 1024;
/// Paired runs per direction. The summary takes the median of their ratios: on a shared host the
/// direct baseline alone swings by ±15 % from one transfer to the next.
const RUNS: usize = 11;

fn main() -> BenchResult<()> {
    // The daemons' own runtime (one worker thread per core: two on the bench machine), shared
    // here by the gateway, the worker, the targets and the callers. The measurement runs as a
    // task on it, as a gateway's HTTP connection reading a relayed body does; the main thread
    // only waits (a caller polled there would be a third thread, woken across threads for every
    // chunk).
    let tls = std::env::args().any(|arg| arg == "--tls");
    let runtime = simlock_daemon::launch::runtime()?;
    let summary = runtime.block_on(async { tokio::spawn(measure(tls)).await })??;
    println!("{summary}");
    Ok(())
}

/// A body of `left` bytes made of one shared chunk (no cost to produce, for throughput).
struct Repeat {
    chunk: Bytes,
    left: u64,
}

impl Repeat {
    fn new(len: u64) -> Self {
        let mut buf = vec![0; CHUNK];
        fill_pattern(1, 0, &mut buf);
        Self {
            chunk: Bytes::from(buf),
            left: len,
        }
    }
}

impl Body for Repeat {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        _cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        if self.left == 0 {
            return Poll::Ready(None);
        }
        let take = self.left.min(CHUNK as u64);
        self.left -= take;
        let chunk = self.chunk.slice(..usize::try_from(take).unwrap_or(CHUNK));
        Poll::Ready(Some(Ok(Frame::data(chunk))))
    }

    fn is_end_stream(&self) -> bool {
        self.left == 0
    }
}

/// Reads a body to its end; returns the bytes read.
async fn drain<B>(body: B) -> BenchResult<u64>
where
    B: Body,
    B::Error: Into<BoxError>,
{
    let mut body = std::pin::pin!(body);
    let mut read = 0u64;
    while let Some(frame) = body.frame().await {
        if let Ok(data) = frame.map_err(Into::into)?.into_data() {
            read += bytes::Buf::remaining(&data) as u64;
        }
    }
    Ok(read)
}

/// The bytes a transfer's caller reads back: the body for a download; for an upload, the answer
/// naming how many bytes the server read.
fn answer_len(upload: bool, len: u64) -> u64 {
    if upload {
        len.to_string().len() as u64
    } else {
        len
    }
}

fn rss_mib() -> f64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    status
        .lines()
        .find_map(|line| line.strip_prefix("VmRSS:"))
        .and_then(|rest| {
            rest.trim()
                .trim_end_matches("kB")
                .trim()
                .parse::<f64>()
                .ok()
        })
        .map_or(0.0, |kib| kib / 1024.0)
}

/// CPU time of the live threads of this process (ns), from the scheduler's per-task accounting
/// (a thread that exits within a measurement takes its share with it; the runtime's threads all
/// live through the bench).
fn cpu_ns() -> u64 {
    let Ok(tasks) = std::fs::read_dir("/proc/self/task") else {
        return 0;
    };
    tasks
        .filter_map(Result::ok)
        .filter_map(|task| std::fs::read_to_string(task.path().join("schedstat")).ok())
        .filter_map(|stat| stat.split_whitespace().next()?.parse::<u64>().ok())
        .sum()
}

fn median(mut values: Vec<f64>) -> f64 {
    values.sort_by(f64::total_cmp);
    values.get(values.len() / 2).copied().unwrap_or(0.0)
}

fn mib_per_s(bytes: u64, elapsed: Duration) -> f64 {
    bytes as f64 / MIB as f64 / elapsed.as_secs_f64().max(1e-9)
}

// === Direct loopback HTTP, the baseline ===

/// TLS on both ends of the direct baseline, with the fleet's certificates.
#[derive(Clone)]
struct DirectTls {
    acceptor: simlock_tls::TlsAcceptor,
    connector: simlock_tls::TlsConnector,
}

impl DirectTls {
    fn of(fleet: &simlock_e2e::TestFleet) -> BenchResult<Self> {
        let tls = fleet.tls.as_ref().ok_or("the fleet serves no TLS")?;
        let server = simlock_tls::ServerTls::load(
            simlock_tls::PemFile::new(&tls.files.cert, "cert"),
            simlock_tls::PemFile::new(&tls.files.key, "key"),
        )?;
        let client =
            simlock_tls::client_config(Some(&simlock_tls::PemFile::new(&tls.ca_file, "ca")))?;
        Ok(Self {
            acceptor: server.acceptor(),
            connector: simlock_tls::TlsConnector::from(client),
        })
    }
}

async fn serve_direct<I>(io: I)
where
    I: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
{
    let service = service_fn(|request: http::Request<hyper::body::Incoming>| async move {
        if request.method() == http::Method::PUT {
            let read = drain(request.into_body()).await.unwrap_or(0);
            Ok::<_, Infallible>(http::Response::new(
                http_body_util::Full::new(Bytes::from(read.to_string())).boxed(),
            ))
        } else {
            let len: u64 = request.uri().path()[1..].parse().unwrap_or(0);
            Ok(http::Response::new(Repeat::new(len).boxed()))
        }
    });
    let _ = hyper::server::conn::http1::Builder::new()
        .serve_connection(TokioIo::new(io), service)
        .await;
}

async fn hyper_server(tls: Option<DirectTls>) -> BenchResult<std::net::SocketAddr> {
    let listener = TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    tokio::spawn(async move {
        while let Ok((stream, _)) = listener.accept().await {
            let _ = stream.set_nodelay(true);
            let tls = tls.clone();
            tokio::spawn(async move {
                match tls {
                    None => serve_direct(stream).await,
                    Some(tls) => {
                        if let Ok(stream) = tls.acceptor.accept(stream).await {
                            serve_direct(stream).await;
                        }
                    }
                }
            });
        }
    });
    Ok(addr)
}

type DirectSender = hyper::client::conn::http1::SendRequest<
    http_body_util::combinators::BoxBody<Bytes, Infallible>,
>;

async fn direct_sender<I>(io: I) -> BenchResult<DirectSender>
where
    I: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
{
    let (sender, connection) = hyper::client::conn::http1::handshake(TokioIo::new(io)).await?;
    tokio::spawn(connection);
    Ok(sender)
}

async fn hyper_transfer(
    addr: std::net::SocketAddr,
    tls: Option<&DirectTls>,
    upload: bool,
    len: u64,
) -> BenchResult<Duration> {
    let stream = TcpStream::connect(addr).await?;
    stream.set_nodelay(true)?;
    let mut sender = match tls {
        None => direct_sender(stream).await?,
        Some(tls) => {
            let name = simlock_tls::server_name("localhost")?;
            direct_sender(tls.connector.connect(name, stream).await?).await?
        }
    };
    let started = Instant::now();
    let request = if upload {
        request(
            http::Method::PUT,
            &format!("http://{addr}/up"),
            Repeat::new(len).boxed(),
        )
    } else {
        request(
            http::Method::GET,
            &format!("http://{addr}/{len}"),
            http_body_util::Empty::new().boxed(),
        )
    };
    let response = sender.send_request(request).await?;
    let read = drain(response.into_body()).await?;
    let elapsed = started.elapsed();
    assert_eq!(
        read,
        answer_len(upload, len),
        "the baseline moved every byte"
    );
    Ok(elapsed)
}

// === Through the relay ===

fn bench_targets() -> RelayTargets {
    let sink: Arc<dyn RelayTarget> = Arc::new(|request: RelayRequest| async move {
        let read = drain(request.request.into_body()).await?;
        Ok(http::Response::new(simlock_relay_worker::full_body(
            read.to_string(),
        )))
    });
    let source: Arc<dyn RelayTarget> = Arc::new(|request: RelayRequest| async move {
        let len: u64 = request.request.uri().path()[1..].parse().unwrap_or(0);
        Ok(http::Response::new(
            Repeat::new(len)
                .map_err(|never| match never {})
                .boxed_unsync(),
        ))
    });
    // Pattern bytes, each chunk freshly allocated.
    let pattern: Arc<dyn RelayTarget> = Arc::new(|request: RelayRequest| async move {
        let len: u64 = request.request.uri().path()[1..].parse().unwrap_or(0);
        Ok(http::Response::new(
            PatternBody::new(99, len).boxed_unsync(),
        ))
    });
    relay_targets(vec![
        ("sink", sink),
        ("source", source),
        ("pattern", pattern),
    ])
}

async fn relay_transfer(
    relay: &GatewayRelay,
    worker: &str,
    upload: bool,
    len: u64,
) -> BenchResult<Duration> {
    let started = Instant::now();
    let read = if upload {
        let call = RelayCall::new(
            "sink",
            request(http::Method::PUT, "http://bench.test/up", Repeat::new(len)),
            "bench",
        );
        drain(relay.relay(worker, call).await?.into_body()).await?
    } else {
        let call = RelayCall::new("source", get(&format!("http://bench.test/{len}")), "bench");
        drain(relay.relay(worker, call).await?.into_body()).await?
    };
    let elapsed = started.elapsed();
    assert_eq!(read, answer_len(upload, len), "the relay moved every byte");
    Ok(elapsed)
}

/// Renews `lease_id` through the gateway until `stop`, recording each call's latency (µs).
async fn renew_loop(
    session: simlock_e2e::Session,
    lease_id: String,
    stop: Arc<AtomicBool>,
    samples: Arc<parking_lot::Mutex<Vec<f64>>>,
) {
    while !stop.load(Ordering::SeqCst) {
        let started = Instant::now();
        let renewed = session
            .client
            .call_value("lease.renew", json!({"leaseId": lease_id}))
            .await;
        let elapsed = started.elapsed();
        if renewed.is_ok() {
            samples.lock().push(elapsed.as_secs_f64() * 1000.0);
        }
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
}

fn percentile(values: &[f64], p: f64) -> f64 {
    let mut sorted = values.to_vec();
    sorted.sort_by(f64::total_cmp);
    if sorted.is_empty() {
        return f64::NAN;
    }
    let rank = ((p * sorted.len() as f64).ceil() as usize).clamp(1, sorted.len());
    sorted[rank - 1]
}

async fn measure(tls: bool) -> BenchResult<String> {
    let (fleet, worker) = if tls {
        fleet_with_tls(bench_targets()).await
    } else {
        fleet_with(bench_targets()).await
    };
    println!(
        "uplink {}, direct baseline over {}",
        fleet.gateway_url(),
        if tls { "HTTPS" } else { "HTTP" }
    );
    let direct_tls = if tls {
        Some(DirectTls::of(&fleet)?)
    } else {
        None
    };
    let relay = fleet.gateway().relay.clone();
    // Warm up both paths.
    relay_transfer(&relay, &worker, true, 8 * MIB).await?;
    relay_transfer(&relay, &worker, false, 8 * MIB).await?;

    // 64 stalled readers: their targets stream fresh bytes; the callers read nothing.
    let rss_before = rss_mib();
    let received_before = gateway_link_stats(&fleet, &worker).bytes_received;
    let mut stalled = Vec::new();
    for _ in 0..64 {
        let response = relay
            .relay(
                &worker,
                RelayCall::new("pattern", get(&format!("http://bench.test/{GIB}")), "bench"),
            )
            .await?;
        stalled.push(response);
    }
    // The link counts every byte it ever received (the warm-up's too): wait for 64 more windows.
    let full = 64 * 256 * 1024;
    wait_until("the 64 windows are full", || {
        gateway_link_stats(&fleet, &worker).bytes_received >= received_before + full
    })
    .await;
    // Let the worker's send queues fill behind the full windows too (the worker's side has no
    // counter the bench can read).
    tokio::time::sleep(Duration::from_millis(500)).await;
    let stats = gateway_link_stats(&fleet, &worker);
    let rss_stalled = rss_mib();
    let stalled_growth = rss_stalled - rss_before;
    println!(
        "stalled64: rss {rss_before:.1} -> {rss_stalled:.1} MiB (+{stalled_growth:.1}), gateway received {} KiB, buffered {} KiB",
        stats.bytes_received / 1024,
        stats.recv_buffered / 1024
    );
    drop(stalled);
    no_channel_open(&fleet, &worker).await;

    // Throughput, with renews running alongside the relayed transfers.
    let agent = fleet.agent("bench-agent").await;
    let grant = agent
        .call("lease.request", json!({"platform": "ios"}))
        .await?;
    let lease_id = grant["lease"]["id"].as_str().unwrap_or_default().to_owned();
    let idle = Arc::new(parking_lot::Mutex::new(Vec::new()));
    let stop = Arc::new(AtomicBool::new(false));
    let renews = tokio::spawn(renew_loop(
        fleet.agent("bench-agent").await,
        lease_id.clone(),
        stop.clone(),
        idle.clone(),
    ));
    tokio::time::sleep(Duration::from_millis(500)).await;
    stop.store(true, Ordering::SeqCst);
    renews.await?;
    let idle = idle.lock().clone();
    println!(
        "renew while idle: {} samples, p50 {:.3} ms, p99 {:.3} ms",
        idle.len(),
        percentile(&idle, 0.50),
        percentile(&idle, 0.99)
    );
    let addr = hyper_server(direct_tls.clone()).await?;
    hyper_transfer(addr, direct_tls.as_ref(), true, 8 * MIB).await?;
    hyper_transfer(addr, direct_tls.as_ref(), false, 8 * MIB).await?;
    let samples = Arc::new(parking_lot::Mutex::new(Vec::new()));
    let mut up_ratios = Vec::new();
    let mut down_ratios = Vec::new();
    for run in 0..RUNS {
        for upload in [true, false] {
            let cpu0 = cpu_ns();
            let direct = mib_per_s(
                GIB,
                hyper_transfer(addr, direct_tls.as_ref(), upload, GIB).await?,
            );
            let cpu1 = cpu_ns();
            let stop = Arc::new(AtomicBool::new(false));
            let run_samples = Arc::new(parking_lot::Mutex::new(Vec::new()));
            let renews = tokio::spawn(renew_loop(
                fleet.agent("bench-agent").await,
                lease_id.clone(),
                stop.clone(),
                run_samples.clone(),
            ));
            let cpu2 = cpu_ns();
            let relayed = mib_per_s(GIB, relay_transfer(&relay, &worker, upload, GIB).await?);
            let cpu3 = cpu_ns();
            stop.store(true, Ordering::SeqCst);
            renews.await?;
            let run_samples = run_samples.lock().clone();
            let run_p99 = percentile(&run_samples, 0.99);
            samples.lock().extend(run_samples.iter().copied());
            let ratio = relayed / direct;
            println!(
                "run {run} {}: direct {direct:.0} MiB/s, relayed {relayed:.0} MiB/s, ratio {ratio:.2}, renew p99 {run_p99:.3} ms of {}, cpu per GiB: direct {} ms, relayed (with the renews) {} ms",
                if upload { "upload" } else { "download" },
                run_samples.len(),
                cpu1.saturating_sub(cpu0) / 1_000_000,
                cpu3.saturating_sub(cpu2) / 1_000_000,
            );
            if upload {
                up_ratios.push(ratio);
            } else {
                down_ratios.push(ratio);
            }
        }
    }
    let stats = gateway_link_stats(&fleet, &worker);
    println!(
        "uplink at the gateway: min rtt {:?}, smoothed rtt {:?}, receive buffer {}",
        stats.min_rtt,
        stats.rtt,
        stats.receive_buffer.map_or_else(
            || "left to the kernel".to_owned(),
            |size| format!("{} KiB", size / 1024)
        )
    );
    let samples = samples.lock().clone();
    let p50 = percentile(&samples, 0.50);
    let p99 = percentile(&samples, 0.99);
    println!(
        "renew during transfers: {} samples, p50 {p50:.3} ms, p99 {p99:.3} ms, max {:.3} ms",
        samples.len(),
        percentile(&samples, 1.0)
    );

    // A 4 GiB body, every byte checked, in constant memory.
    let rss_start = rss_mib();
    let response = relay
        .relay(
            &worker,
            RelayCall::new(
                "pattern",
                get(&format!("http://bench.test/{}", 4 * GIB)),
                "bench",
            ),
        )
        .await?;
    let mut check = PatternCheck::new(99);
    let mut body = response.into_body();
    let mut rss_max = rss_start;
    let mut next_sample = 0u64;
    let started = Instant::now();
    while let Some(frame) = body.frame().await {
        let data = frame?.into_data().unwrap_or_default();
        check.feed(&data);
        if check.offset >= next_sample {
            rss_max = rss_max.max(rss_mib());
            next_sample += 256 * MIB;
        }
    }
    let elapsed = started.elapsed();
    let growth = rss_max - rss_start;
    let body4g_ok = check.ok && check.offset == 4 * GIB && growth < 64.0;
    println!(
        "body4g: {} bytes in {:.1} s ({:.0} MiB/s), pattern {}, rss {rss_start:.1} -> max {rss_max:.1} MiB (+{growth:.1})",
        check.offset,
        elapsed.as_secs_f64(),
        mib_per_s(check.offset, elapsed),
        if check.ok { "ok" } else { "MISMATCH" }
    );
    fleet.stop().await;
    Ok(format!(
        "relay upload_ratio={:.2} download_ratio={:.2} renew_p99_ms={p99:.3} stalled64_rss_mib={stalled_growth:.1} body4g_ok={body4g_ok}",
        median(up_ratios),
        median(down_ratios)
    ))
}
