//! The link benchmark: `cargo bench -p simlock-link --bench link`.
//!
//! One process, real loopback WebSockets (tuned the way an uplink is: `tune_tcp`,
//! `websocket_config`). It measures, in one run:
//! - raw WebSocket binary-message throughput (16 KiB messages, the link's frame size), the baseline;
//! - one channel and eight channels carrying 1 GiB in total, as ratios to that baseline;
//! - p50/p99 of a small call on the text lane (echoed by the peer) while 1 GiB streams on the
//!   same link;
//! - bytes buffered for a reader that never reads, from the link's own counters;
//! - the seeded simulation with 10 000 seeds (or `SIMLOCK_LINK_SIM_SEEDS`).
//!
//! Throughput and latency run three times each and the medians count (the machine is shared). The last line is the summary:
//! `link one_channel_ratio=<x> eight_channel_ratio=<x> call_p99_ms=<x> stalled_reader_kib=<x>`.
#![allow(clippy::print_stdout, reason = "a benchmark reports on stdout")]

#[allow(dead_code)]
#[path = "../src/tests/pair.rs"]
mod pair;
#[allow(dead_code)]
#[path = "../src/tests/sim.rs"]
mod sim;

/// The paths `pair.rs` and `sim.rs` use inside the crate, here from outside it.
mod proto {
    pub(crate) use simlock_link::proto::*;
}

use std::{error::Error, time::Duration};

use bytes::Bytes;
use futures::{SinkExt, StreamExt};
use simlock_link::{
    Channel, End, LinkConfig, LinkHandle, ReceiveBuffer, TextReceiver, spawn_tuned, tune_tcp,
    websocket_config,
};
use tokio::{
    io::{AsyncReadExt, AsyncWriteExt},
    net::{TcpListener, TcpStream},
    time::Instant,
};
use tokio_tungstenite::{WebSocketStream, tungstenite::Message};
use tokio_util::sync::CancellationToken;

type BenchResult<T> = Result<T, Box<dyn Error + Send + Sync>>;

const GIB: u64 = 1024 * 1024 * 1024;
const KIB: usize = 1024;
const RUNS: usize = 3;

fn main() -> BenchResult<()> {
    // Cargo passes `--bench` (and filters); this harness takes none.
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let (one, eight, call, stalled) = runtime.block_on(measure())?;
    drop(runtime);

    let seeds = sim::seeds_from_env(10_000);
    let started = Instant::now();
    let report = sim::run_seeds(0, seeds).map_err(|error| format!("simulation failed: {error}"))?;
    println!(
        "simulation: {} seeds pass in {:.1} s ({} channels, {} MiB delivered, {} clean ends, failures {:?}, {} links lost)",
        report.seeds,
        started.elapsed().as_secs_f64(),
        report.channels,
        report.bytes_delivered / (1024 * 1024),
        report.clean_ends,
        report.failures,
        report.links_lost,
    );
    println!(
        "link one_channel_ratio={one:.2} eight_channel_ratio={eight:.2} call_p99_ms={call:.2} stalled_reader_kib={stalled}"
    );
    Ok(())
}

async fn measure() -> BenchResult<(f64, f64, f64, u64)> {
    let mut one = Vec::new();
    let mut eight = Vec::new();
    for run in 1..=RUNS {
        let raw = raw_websocket(GIB).await?;
        let single = channels(1, GIB).await?;
        let multi = channels(8, GIB).await?;
        println!(
            "run {run}: raw websocket {:.2} GiB/s, one channel {:.2} GiB/s ({:.2}), eight channels {:.2} GiB/s ({:.2})",
            raw,
            single,
            single / raw,
            multi,
            multi / raw
        );
        one.push(single / raw);
        eight.push(multi / raw);
    }
    let mut p99s = Vec::new();
    for run in 1..=RUNS {
        let (p50, p99, max, samples) = calls_during_bulk(GIB).await?;
        println!(
            "run {run}: text-lane call during 1 GiB bulk: p50 {p50:.3} ms, p99 {p99:.3} ms, max {max:.3} ms ({samples} calls)"
        );
        p99s.push(p99);
    }
    let p99 = median(p99s);
    let (stalled, sender_queued) = stalled_reader().await?;
    println!(
        "reader that never reads: {stalled} KiB buffered at the receiver, {sender_queued} KiB queued at the writer"
    );
    Ok((median(one), median(eight), p99, stalled))
}

fn median(mut values: Vec<f64>) -> f64 {
    values.sort_by(f64::total_cmp);
    values.get(values.len() / 2).copied().unwrap_or(0.0)
}

fn gib_per_s(bytes: u64, elapsed: Duration) -> f64 {
    bytes as f64 / GIB as f64 / elapsed.as_secs_f64()
}

/// A tuned WebSocket pair over loopback: (server side, client side).
async fn ws_pair() -> BenchResult<(WebSocketStream<TcpStream>, WebSocketStream<TcpStream>)> {
    let listener = TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    let server = tokio::spawn(async move {
        let (tcp, _) = listener.accept().await?;
        tune_tcp(&tcp)?;
        let ws = tokio_tungstenite::accept_async_with_config(tcp, Some(websocket_config())).await?;
        Ok::<_, Box<dyn Error + Send + Sync>>(ws)
    });
    let tcp = TcpStream::connect(addr).await?;
    tune_tcp(&tcp)?;
    let (client, _) = tokio_tungstenite::client_async_with_config(
        format!("ws://{addr}/v1/uplink"),
        tcp,
        Some(websocket_config()),
    )
    .await?;
    Ok((server.await??, client))
}

struct Ends {
    gateway: LinkHandle,
    gateway_text: TextReceiver,
    worker: LinkHandle,
    worker_text: TextReceiver,
}

async fn link_pair() -> BenchResult<Ends> {
    let (server, client) = ws_pair().await?;
    let server_buffer = ReceiveBuffer::of(server.get_ref());
    let client_buffer = ReceiveBuffer::of(client.get_ref());
    let (gateway, gateway_text) = spawn_tuned(server, LinkConfig::new(End::Gateway), server_buffer);
    let (worker, worker_text) = spawn_tuned(client, LinkConfig::new(End::Worker), client_buffer);
    Ok(Ends {
        gateway,
        gateway_text,
        worker,
        worker_text,
    })
}

/// Opens a channel at the gateway and accepts it at the worker by the id named on the text lane
/// (the way the relay does). Returns (the worker's channel, the gateway's channel).
async fn open_accepted(ends: &mut Ends) -> BenchResult<(Channel, Channel)> {
    let channel = ends.gateway.open_channel(&CancellationToken::new()).await?;
    ends.gateway.send_text(channel.id().to_string()).await?;
    let id = ends.worker_text.next().await.ok_or("no channel id")?;
    let accepted = ends.worker.accept_channel(&id)?;
    Ok((accepted, channel))
}

/// Raw WebSocket: `bytes` in 16 KiB binary messages, server to client (the gateway-to-worker
/// direction the channel runs use).
async fn raw_websocket(bytes: u64) -> BenchResult<f64> {
    let (mut server, mut client) = ws_pair().await?;
    let chunk = Bytes::from(vec![0x5a; 16 * KIB]);
    let count = bytes / chunk.len() as u64;
    let started = Instant::now();
    let sender = tokio::spawn(async move {
        for _ in 0..count {
            server.feed(Message::Binary(chunk.clone())).await?;
        }
        server.flush().await?;
        Ok::<_, Box<dyn Error + Send + Sync>>(server)
    });
    let mut received = 0u64;
    while received < count * 16 * KIB as u64 {
        match client.next().await {
            Some(Ok(Message::Binary(data))) => received += data.len() as u64,
            Some(Ok(_)) => {}
            Some(Err(error)) => return Err(error.into()),
            None => return Err("raw websocket ended early".into()),
        }
    }
    let elapsed = started.elapsed();
    let _server = sender.await??;
    Ok(gib_per_s(received, elapsed))
}

/// `n` channels carrying `total` bytes between them, gateway to worker, through `AsyncWrite`
/// and `AsyncRead` with 256 KiB application buffers.
async fn channels(n: usize, total: u64) -> BenchResult<f64> {
    let mut ends = link_pair().await?;
    let per_channel = total / n as u64;
    let mut readers = Vec::new();
    let mut writers = Vec::new();
    let mut unused = Vec::new();
    for _ in 0..n {
        let (accepted, channel) = open_accepted(&mut ends).await?;
        let (gateway_reader, writer) = channel.into_split();
        let (reader, mut worker_writer) = accepted.into_split();
        // Only the request direction carries data: the response ends at once.
        worker_writer.shutdown().await?;
        unused.push((gateway_reader, worker_writer));
        writers.push(writer);
        readers.push(reader);
    }
    let started = Instant::now();
    let mut tasks = Vec::new();
    for mut writer in writers {
        tasks.push(tokio::spawn(async move {
            let buf = vec![0xa5u8; 256 * KIB];
            let mut left = per_channel;
            while left > 0 {
                let len = left.min(buf.len() as u64) as usize;
                writer.write_all(&buf[..len]).await?;
                left -= len as u64;
            }
            writer.shutdown().await?;
            Ok::<u64, std::io::Error>(0)
        }));
    }
    for mut reader in readers {
        tasks.push(tokio::spawn(async move {
            let mut buf = vec![0u8; 256 * KIB];
            let mut got = 0u64;
            loop {
                let read = reader.read(&mut buf).await?;
                if read == 0 {
                    return Ok(got);
                }
                got += read as u64;
            }
        }));
    }
    let mut received = 0;
    for task in tasks {
        received += task.await??;
    }
    let elapsed = started.elapsed();
    if received != per_channel * n as u64 {
        return Err(format!("received {received} of {} bytes", per_channel * n as u64).into());
    }
    drop(ends.gateway_text);
    Ok(gib_per_s(received, elapsed))
}

/// Small calls on the text lane, echoed by the worker, while `bulk` bytes stream gateway to
/// worker on one channel. Returns (p50, p99, max) in milliseconds and the number of calls.
async fn calls_during_bulk(bulk: u64) -> BenchResult<(f64, f64, f64, usize)> {
    let mut ends = link_pair().await?;
    let (accepted, channel) = open_accepted(&mut ends).await?;
    let (_gateway_reader, mut writer) = channel.into_split();
    let (mut reader, mut worker_writer) = accepted.into_split();
    worker_writer.shutdown().await?;
    // The worker echoes every text line.
    let worker = ends.worker.clone();
    let mut worker_text = ends.worker_text;
    let echo = tokio::spawn(async move {
        while let Some(line) = worker_text.next().await {
            if worker.send_text(line).await.is_err() {
                break;
            }
        }
    });
    let done = CancellationToken::new();
    let bulk_task = tokio::spawn({
        let done = done.clone();
        async move {
            let writing = async {
                let buf = vec![0x3cu8; 256 * KIB];
                let mut left = bulk;
                while left > 0 {
                    let len = left.min(buf.len() as u64) as usize;
                    writer.write_all(&buf[..len]).await?;
                    left -= len as u64;
                }
                writer.shutdown().await
            };
            let reading = async {
                let mut buf = vec![0u8; 256 * KIB];
                while reader.read(&mut buf).await? > 0 {}
                Ok::<(), std::io::Error>(())
            };
            let result = tokio::try_join!(writing, reading);
            done.cancel();
            result.map(|_| ())
        }
    });
    let mut latencies = Vec::new();
    let mut sequence = 0u64;
    while !done.is_cancelled() {
        let call = format!("{{\"id\":{sequence},\"type\":\"status.get\",\"payload\":{{}}}}");
        sequence += 1;
        let started = Instant::now();
        ends.gateway.send_text(call.clone()).await?;
        let answer = ends.gateway_text.next().await.ok_or("no answer")?;
        latencies.push(started.elapsed());
        if answer != call {
            return Err("the echo differs".into());
        }
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    bulk_task.await??;
    ends.gateway.close();
    let _ = echo.await;
    latencies.sort();
    let at = |q: f64| -> f64 {
        let index = ((latencies.len() as f64 * q).ceil() as usize).saturating_sub(1);
        latencies
            .get(index)
            .map_or(0.0, |d| d.as_secs_f64() * 1000.0)
    };
    Ok((at(0.5), at(0.99), at(1.0), latencies.len()))
}

/// A reader that never reads, while its writer has 4 MiB to send: what the link buffers for it.
/// Returns (KiB buffered at the receiver, KiB queued at the writer), both from the link's counters.
async fn stalled_reader() -> BenchResult<(u64, u64)> {
    let mut ends = link_pair().await?;
    let (accepted, channel) = open_accepted(&mut ends).await?;
    let (_gateway_reader, mut writer) = channel.into_split();
    let writing = tokio::spawn(async move {
        let _ = writer.write_all(&vec![1u8; 4 * 1024 * KIB]).await;
        writer
    });
    // Wait until the writer is blocked: its queue is full and nothing moves any more.
    let mut last = (u64::MAX, u64::MAX);
    let mut stable = 0;
    for _ in 0..2000 {
        tokio::time::sleep(Duration::from_millis(5)).await;
        let now = (
            ends.worker.stats().max_channel_recv_buffered,
            ends.gateway.stats().send_buffered,
        );
        stable = if now == last { stable + 1 } else { 0 };
        last = now;
        if stable >= 20 {
            break;
        }
    }
    writing.abort();
    drop(accepted);
    Ok((last.0 / 1024, last.1 / 1024))
}
