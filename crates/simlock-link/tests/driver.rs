//! Driver tests: two links over a real WebSocket pair on 127.0.0.1, and, for behaviour that
//! depends on time, over an in-memory duplex with tokio's clock paused. No test sleeps to wait
//! for an event: each waits on the event itself, bounded by `tokio::time::timeout`.
#![cfg(test)]

use std::{
    io,
    pin::Pin,
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    },
    task::{Context, Poll},
    time::Duration,
};

use bytes::Bytes;
use futures::{SinkExt, StreamExt};
use simlock_link::{
    Channel, ChannelError, CloseReason, End, FailureReason, LinkConfig, LinkHandle, LinkStats,
    MIN_RECEIVE_BUFFER, ReceiveBuffer, TextReceiver, receive_buffer_ceiling, receive_buffer_for,
    spawn_tuned, tune_tcp, websocket_config,
};
use tokio::{
    io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, DuplexStream, ReadBuf},
    net::{TcpListener, TcpStream},
    task::JoinHandle,
};
use tokio_tungstenite::{WebSocketStream, tungstenite::protocol::Role};
use tokio_util::sync::CancellationToken;

/// Generous bound on any wait in these tests: a shared 2-core machine can be slow, and a hang
/// should fail rather than block CI. (Virtual time in the paused tests, so it must exceed the
/// link's 60 s stall timeout.)
const PATIENCE: Duration = Duration::from_secs(120);

async fn within<T>(what: &str, future: impl Future<Output = T>) -> T {
    match tokio::time::timeout(PATIENCE, future).await {
        Ok(value) => value,
        Err(_) => panic!("timed out waiting for {what}"),
    }
}

struct Ends {
    gateway: LinkHandle,
    gateway_text: TextReceiver,
    worker: LinkHandle,
    worker_text: TextReceiver,
}

fn start<S: AsyncRead + AsyncWrite + Unpin + Send + 'static>(
    gateway_ws: WebSocketStream<S>,
    worker_ws: WebSocketStream<S>,
    config: &LinkConfig,
) -> Ends {
    start_tuned(
        (gateway_ws, ReceiveBuffer::untuned()),
        (worker_ws, ReceiveBuffer::untuned()),
        config,
    )
}

/// Both ends of a link, each driver sizing its socket's receive buffer through its handle.
fn start_tuned<S: AsyncRead + AsyncWrite + Unpin + Send + 'static>(
    (gateway_ws, gateway_buffer): (WebSocketStream<S>, ReceiveBuffer),
    (worker_ws, worker_buffer): (WebSocketStream<S>, ReceiveBuffer),
    config: &LinkConfig,
) -> Ends {
    let mut gateway_config = config.clone();
    gateway_config.end = End::Gateway;
    let worker_config = gateway_config.for_peer();
    let (gateway, gateway_text) = spawn_tuned(gateway_ws, gateway_config, gateway_buffer);
    let (worker, worker_text) = spawn_tuned(worker_ws, worker_config, worker_buffer);
    Ends {
        gateway,
        gateway_text,
        worker,
        worker_text,
    }
}

/// A WebSocket pair over loopback TCP: (gateway side = server, worker side = client).
async fn loopback_ws() -> (WebSocketStream<TcpStream>, WebSocketStream<TcpStream>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let server = tokio::spawn(async move {
        let (tcp, _) = listener.accept().await.unwrap();
        tune_tcp(&tcp).unwrap();
        tokio_tungstenite::accept_async_with_config(tcp, Some(websocket_config()))
            .await
            .unwrap()
    });
    let tcp = TcpStream::connect(addr).await.unwrap();
    tune_tcp(&tcp).unwrap();
    let (client, _) = tokio_tungstenite::client_async_with_config(
        format!("ws://{addr}/v1/uplink"),
        tcp,
        Some(websocket_config()),
    )
    .await
    .unwrap();
    (server.await.unwrap(), client)
}

/// Two links over loopback TCP, each driver sizing its socket's receive buffer.
async fn loopback(config: &LinkConfig) -> Ends {
    let (gateway_ws, worker_ws) = loopback_ws().await;
    let gateway_buffer = ReceiveBuffer::of(gateway_ws.get_ref());
    let worker_buffer = ReceiveBuffer::of(worker_ws.get_ref());
    start_tuned(
        (gateway_ws, gateway_buffer),
        (worker_ws, worker_buffer),
        config,
    )
}

/// A WebSocket pair over an in-memory duplex (for paused-time tests), with the worker side
/// behind a switch that can turn it into a black hole.
async fn duplex(config: &LinkConfig) -> (Ends, Arc<AtomicBool>) {
    let (a, b) = tokio::io::duplex(256 * 1024);
    let hole = Arc::new(AtomicBool::new(false));
    let gateway_ws = WebSocketStream::from_raw_socket(
        Switchable {
            inner: a,
            hole: hole.clone(),
        },
        Role::Server,
        Some(websocket_config()),
    )
    .await;
    let worker_ws = WebSocketStream::from_raw_socket(
        Switchable {
            inner: b,
            hole: hole.clone(),
        },
        Role::Client,
        Some(websocket_config()),
    )
    .await;
    (start(gateway_ws, worker_ws, config), hole)
}

/// A stream that, once its switch is on, swallows writes and never delivers reads: a dead uplink
/// that does not fail.
struct Switchable {
    inner: DuplexStream,
    hole: Arc<AtomicBool>,
}

impl AsyncRead for Switchable {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        if self.hole.load(Ordering::SeqCst) {
            return Poll::Pending;
        }
        Pin::new(&mut self.inner).poll_read(cx, buf)
    }
}

impl AsyncWrite for Switchable {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        if self.hole.load(Ordering::SeqCst) {
            return Poll::Ready(Ok(buf.len()));
        }
        Pin::new(&mut self.inner).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

/// Opens a channel at the gateway, names it on the text lane, and accepts it at the worker the
/// way the relay does.
async fn open_named(ends: &mut Ends) -> (Channel, Channel) {
    let gateway = within("open", ends.gateway.open_channel(&CancellationToken::new()))
        .await
        .unwrap();
    ends.gateway
        .send_text(format!("accept {}", gateway.id()))
        .await
        .unwrap();
    let line = within("the accept line", ends.worker_text.next())
        .await
        .unwrap();
    let id = line.strip_prefix("accept ").unwrap();
    let worker = ends.worker.accept_channel(id).unwrap();
    (gateway, worker)
}

fn pattern(len: usize, seed: u64) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

fn reason_of(error: &io::Error) -> FailureReason {
    ChannelError::from_io(error)
        .unwrap_or_else(|| panic!("not a channel error: {error:?}"))
        .reason()
}

fn spawn_copy_out(
    mut channel_writer: simlock_link::ChannelWriter,
    data: Vec<u8>,
) -> JoinHandle<io::Result<()>> {
    tokio::spawn(async move {
        for chunk in data.chunks(50_000) {
            channel_writer.write_all(chunk).await?;
        }
        channel_writer.shutdown().await?;
        Ok(())
    })
}

#[test]
fn handles_can_move_between_tasks() {
    fn send_sync<T: Send + Sync + 'static>() {}
    fn send<T: Send + 'static>() {}
    send_sync::<LinkHandle>();
    send::<TextReceiver>();
    send::<Channel>();
    send::<simlock_link::ChannelReader>();
    send::<simlock_link::ChannelWriter>();
    send_sync::<ChannelError>();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_text_lane_carries_messages_both_ways_in_order() {
    let mut ends = loopback(&LinkConfig::new(End::Gateway)).await;
    for n in 0..200 {
        ends.gateway.send_text(format!("g{n}")).await.unwrap();
        ends.worker.send_text(format!("w{n}")).await.unwrap();
    }
    for n in 0..200 {
        assert_eq!(
            within("text", ends.worker_text.next()).await.unwrap(),
            format!("g{n}")
        );
        assert_eq!(
            within("text", ends.gateway_text.next()).await.unwrap(),
            format!("w{n}")
        );
    }
    assert_eq!(ends.gateway.stats().texts_sent, 200);
}

/// The link's stats once `done` holds. A link's first PING goes at once and its PONG brings the
/// first round trip; there is no event for that, so this looks between turns of the runtime.
async fn stats_once(link: &LinkHandle, done: impl Fn(&LinkStats) -> bool) -> LinkStats {
    within("the first round trip", async {
        loop {
            let stats = link.stats();
            if done(&stats) {
                break stats;
            }
            tokio::task::yield_now().await;
        }
    })
    .await
}

#[tokio::test]
async fn a_tcp_link_sizes_its_receive_buffer_to_the_measured_round_trip() {
    // Frequent PINGs: on a loaded machine the first round trips may run past the ceiling's
    // 3.4 ms, and the driver waits for a shorter one.
    let mut config = LinkConfig::new(End::Gateway);
    config.ping_interval = Duration::from_millis(10);
    config.max_missed_pings = 10_000;
    let mut ends = loopback(&config).await;
    for link in [&ends.gateway, &ends.worker] {
        let stats = stats_once(link, |stats| stats.receive_buffer.is_some()).await;
        let size = stats.receive_buffer.unwrap();
        // Sized at a round trip no shorter than the smallest one seen since.
        let at_min_rtt = receive_buffer_for(stats.min_rtt.unwrap(), receive_buffer_ceiling());
        assert!(at_min_rtt.is_some_and(|at_min| size >= at_min), "{stats:?}");
        assert!(size >= MIN_RECEIVE_BUFFER.min(receive_buffer_ceiling()));
        assert!(size <= receive_buffer_ceiling());
    }
    // The links still carry data.
    let (gateway_end, worker_end) = open_named(&mut ends).await;
    let (_response, mut request) = gateway_end.into_split();
    let (mut body, _answer) = worker_end.into_split();
    let sent = pattern(1024 * 1024, 7);
    let writer = tokio::spawn(async move {
        request.write_all(&sent).await.unwrap();
        request.shutdown().await.unwrap();
        sent
    });
    let mut received = Vec::new();
    within("the body", body.read_to_end(&mut received))
        .await
        .unwrap();
    assert_eq!(received, writer.await.unwrap());
}

#[tokio::test]
async fn an_untuned_link_leaves_the_receive_buffer_to_the_kernel() {
    let (gateway_ws, worker_ws) = loopback_ws().await;
    let ends = start(gateway_ws, worker_ws, &LinkConfig::new(End::Gateway));
    for link in [&ends.gateway, &ends.worker] {
        let stats = stats_once(link, |stats| stats.min_rtt.is_some()).await;
        assert_eq!(stats.receive_buffer, None);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_channel_carries_several_mib_both_ways_byte_for_byte() {
    let mut ends = loopback(&LinkConfig::new(End::Gateway)).await;
    let (gateway, worker) = open_named(&mut ends).await;
    let request = pattern(8 * 1024 * 1024 + 123, 1);
    let response = pattern(6 * 1024 * 1024 + 7, 2);
    let (mut gateway_reader, gateway_writer) = gateway.into_split();
    let (mut worker_reader, worker_writer) = worker.into_split();
    let up = spawn_copy_out(gateway_writer, request.clone());
    let down = spawn_copy_out(worker_writer, response.clone());
    let mut got_request = Vec::new();
    let mut got_response = Vec::new();
    let (a, b) = within("both bodies", async {
        tokio::join!(
            worker_reader.read_to_end(&mut got_request),
            gateway_reader.read_to_end(&mut got_response)
        )
    })
    .await;
    a.unwrap();
    b.unwrap();
    up.await.unwrap().unwrap();
    down.await.unwrap().unwrap();
    assert!(got_request == request, "request differs");
    assert!(got_response == response, "response differs");
    let stats = ends.gateway.stats();
    assert_eq!(stats.bytes_sent, request.len() as u64);
    assert_eq!(stats.bytes_received, response.len() as u64);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stream_and_sink_carry_bytes_in_order() {
    let mut ends = loopback(&LinkConfig::new(End::Gateway)).await;
    let (gateway, worker) = open_named(&mut ends).await;
    let (_gateway_reader, mut gateway_writer) = gateway.into_split();
    let (mut worker_reader, _worker_writer) = worker.into_split();
    let chunks: Vec<Bytes> = (0..64).map(|n| Bytes::from(pattern(40_000, n))).collect();
    let expected: Vec<u8> = chunks.iter().flat_map(|c| c.iter().copied()).collect();
    let send = tokio::spawn(async move {
        let mut items = futures::stream::iter(chunks.into_iter().map(Ok::<_, ChannelError>));
        gateway_writer.send_all(&mut items).await.unwrap();
        gateway_writer.close().await.unwrap();
    });
    let mut got = Vec::new();
    while let Some(chunk) = within("a chunk", worker_reader.next()).await {
        let chunk = chunk.unwrap();
        // A frame as it came, or a compacted stretch when the reader fell behind; never empty.
        assert!(!chunk.is_empty());
        got.extend_from_slice(&chunk);
    }
    send.await.unwrap();
    assert!(got == expected);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stop_fails_the_peer_writer_stopped() {
    let mut ends = loopback(&LinkConfig::new(End::Gateway)).await;
    let (gateway, worker) = open_named(&mut ends).await;
    let (_gateway_reader, mut gateway_writer) = gateway.into_split();
    let (mut worker_reader, mut worker_writer) = worker.into_split();
    let writing = tokio::spawn(async move {
        let block = vec![7u8; 64 * 1024];
        loop {
            if let Err(error) = gateway_writer.write_all(&block).await {
                return error;
            }
        }
    });
    let mut buf = vec![0u8; 300 * 1024];
    within("some bytes", worker_reader.read_exact(&mut buf))
        .await
        .unwrap();
    worker_reader.stop();
    let error = within("the writer to fail", writing).await.unwrap();
    assert_eq!(reason_of(&error), FailureReason::Stopped);
    assert_eq!(error.kind(), io::ErrorKind::BrokenPipe);
    // The other direction still works.
    worker_writer.write_all(b"answer").await.unwrap();
    worker_writer.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn abort_fails_both_directions_at_both_ends() {
    let mut ends = loopback(&LinkConfig::new(End::Gateway)).await;
    let (gateway, worker) = open_named(&mut ends).await;
    let (mut worker_reader, mut worker_writer) = worker.into_split();
    gateway.abort();
    let mut buf = [0u8; 16];
    let error = within("the read to fail", worker_reader.read(&mut buf))
        .await
        .unwrap_err();
    assert_eq!(reason_of(&error), FailureReason::Aborted);
    let error = worker_writer.write_all(b"late").await.unwrap_err();
    assert_eq!(reason_of(&error), FailureReason::Aborted);
    let (mut gateway_reader, _gateway_writer) = gateway.into_split();
    let error = gateway_reader.read(&mut buf).await.unwrap_err();
    assert_eq!(reason_of(&error), FailureReason::Aborted);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dropping_an_unfinished_writer_aborts_and_dropping_a_reader_stops() {
    let mut ends = loopback(&LinkConfig::new(End::Gateway)).await;
    let (gateway, worker) = open_named(&mut ends).await;
    let (mut gateway_reader, gateway_writer) = gateway.into_split();
    drop(gateway_writer);
    let (mut worker_reader, _worker_writer) = worker.into_split();
    let error = within("abort", worker_reader.read_chunk())
        .await
        .unwrap_err();
    assert_eq!(error.reason(), FailureReason::Aborted);
    let mut buf = [0u8; 4];
    assert_eq!(
        reason_of(&gateway_reader.read(&mut buf).await.unwrap_err()),
        FailureReason::Aborted
    );

    let (gateway, worker) = open_named(&mut ends).await;
    let (gateway_reader, _gateway_writer) = gateway.into_split();
    drop(gateway_reader);
    let (_worker_reader, mut worker_writer) = worker.into_split();
    let error = within("stop", async {
        loop {
            if let Err(error) = worker_writer.write_all(&[1u8; 65536]).await {
                return error;
            }
        }
    })
    .await;
    assert_eq!(reason_of(&error), FailureReason::Stopped);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn losing_the_websocket_fails_every_channel_closed() {
    // The worker reaches the gateway through a loopback proxy; killing the proxy drops both
    // TCP connections without a WebSocket close.
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let server_addr = listener.local_addr().unwrap();
    let proxy_listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let proxy_addr = proxy_listener.local_addr().unwrap();
    let proxy = tokio::spawn(async move {
        let (mut inbound, _) = proxy_listener.accept().await.unwrap();
        let mut outbound = TcpStream::connect(server_addr).await.unwrap();
        let _ = tokio::io::copy_bidirectional(&mut inbound, &mut outbound).await;
    });
    let server = tokio::spawn(async move {
        let (tcp, _) = listener.accept().await.unwrap();
        tokio_tungstenite::accept_async_with_config(tcp, Some(websocket_config()))
            .await
            .unwrap()
    });
    let tcp = TcpStream::connect(proxy_addr).await.unwrap();
    let (client, _) = tokio_tungstenite::client_async_with_config(
        format!("ws://{proxy_addr}/"),
        tcp,
        Some(websocket_config()),
    )
    .await
    .unwrap();
    let mut ends = start(
        server.await.unwrap(),
        client,
        &LinkConfig::new(End::Gateway),
    );
    let mut channels = Vec::new();
    for _ in 0..5 {
        channels.push(open_named(&mut ends).await);
    }
    proxy.abort();
    let gateway_reason = within("gateway close", ends.gateway.closed()).await;
    let worker_reason = within("worker close", ends.worker.closed()).await;
    assert!(
        matches!(gateway_reason, CloseReason::Transport(_)),
        "{gateway_reason:?}"
    );
    assert!(
        matches!(worker_reason, CloseReason::Transport(_)),
        "{worker_reason:?}"
    );
    for (gateway, worker) in channels {
        for channel in [gateway, worker] {
            let (mut reader, mut writer) = channel.into_split();
            let mut buf = [0u8; 4];
            assert_eq!(
                reason_of(&reader.read(&mut buf).await.unwrap_err()),
                FailureReason::Closed
            );
            assert_eq!(
                reason_of(&writer.write_all(b"x").await.unwrap_err()),
                FailureReason::Closed
            );
        }
    }
    let error = ends
        .gateway
        .open_channel(&CancellationToken::new())
        .await
        .unwrap_err();
    assert_eq!(error.reason(), FailureReason::Closed);
    assert!(ends.gateway.send_text("late".into()).await.is_err());
    assert_eq!(within("text end", ends.worker_text.next()).await, None);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_local_close_reaches_the_peer() {
    let mut ends = loopback(&LinkConfig::new(End::Gateway)).await;
    let (_gateway, worker) = open_named(&mut ends).await;
    ends.gateway.send_text("last words".into()).await.unwrap();
    ends.gateway.close();
    assert_eq!(
        within("local close", ends.gateway.closed()).await,
        CloseReason::Local
    );
    let reason = within("peer close", ends.worker.closed()).await;
    assert!(matches!(reason, CloseReason::Peer { .. }), "{reason:?}");
    assert_eq!(
        within("text", ends.worker_text.next()).await.as_deref(),
        Some("last words")
    );
    let (mut reader, _writer) = worker.into_split();
    let mut buf = [0u8; 1];
    assert_eq!(
        reason_of(&reader.read(&mut buf).await.unwrap_err()),
        FailureReason::Closed
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_close_with_a_reason_tells_the_peer_why_cut_to_the_frames_bound() {
    let ends = loopback(&LinkConfig::new(End::Gateway)).await;
    ends.gateway.close_because("replaced by a newer uplink");
    assert_eq!(
        within("local close", ends.gateway.closed()).await,
        CloseReason::LocalBecause("replaced by a newer uplink".into())
    );
    assert_eq!(
        within("peer close", ends.worker.closed()).await,
        CloseReason::Peer {
            reason: "replaced by a newer uplink".into()
        }
    );
    // A reason past the close frame's 123 bytes is cut there, at a character's boundary.
    let ends = loopback(&LinkConfig::new(End::Gateway)).await;
    let long = "é".repeat(100);
    ends.gateway.close_because(long.clone());
    let CloseReason::Peer { reason } = within("peer close", ends.worker.closed()).await else {
        panic!("a peer close");
    };
    assert_eq!(reason, long[..122]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn many_channels_run_concurrently_past_the_limit() {
    let ends = loopback(&LinkConfig::new(End::Gateway)).await;
    let gateway = ends.gateway.clone();
    let worker = ends.worker.clone();
    // The worker: accepts every named channel and echoes it back.
    let mut worker_text = ends.worker_text;
    let echo = tokio::spawn(async move {
        let mut tasks = Vec::new();
        while let Some(line) = worker_text.next().await {
            let Some(id) = line.strip_prefix("accept ") else {
                break;
            };
            let channel = worker.accept_channel(id).unwrap();
            tasks.push(tokio::spawn(async move {
                let (mut reader, mut writer) = channel.into_split();
                tokio::io::copy(&mut reader, &mut writer).await.unwrap();
                writer.shutdown().await.unwrap();
            }));
        }
        for task in tasks {
            task.await.unwrap();
        }
    });
    let mut clients = Vec::new();
    for n in 0..150u64 {
        let gateway = gateway.clone();
        clients.push(tokio::spawn(async move {
            let channel = gateway
                .open_channel(&CancellationToken::new())
                .await
                .unwrap();
            gateway
                .send_text(format!("accept {}", channel.id()))
                .await
                .unwrap();
            let (mut reader, writer) = channel.into_split();
            let data = pattern(64 * 1024 + n as usize, n);
            let sending = spawn_copy_out(writer, data.clone());
            let mut echoed = Vec::new();
            reader.read_to_end(&mut echoed).await.unwrap();
            sending.await.unwrap().unwrap();
            assert!(echoed == data, "channel {n} echoed wrong bytes");
        }));
    }
    for client in clients {
        within("a client", client).await.unwrap();
    }
    assert!(gateway.stats().open_channels <= 64);
    ends.gateway.send_text("done".into()).await.unwrap();
    within("the echo server", echo).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_65th_open_waits_for_a_slot_and_fails_at_once_when_cancelled() {
    let mut ends = loopback(&LinkConfig::new(End::Gateway)).await;
    let mut held = Vec::new();
    for _ in 0..64 {
        held.push(open_named(&mut ends).await);
    }
    let cancel = CancellationToken::new();
    let waiting_65 = tokio::spawn({
        let gateway = ends.gateway.clone();
        let cancel = cancel.clone();
        async move { gateway.open_channel(&cancel).await }
    });
    let waiting_66 = tokio::spawn({
        let gateway = ends.gateway.clone();
        async move { gateway.open_channel(&CancellationToken::new()).await }
    });
    // Both wait: nothing completes them until a slot frees (checked after the cancel below).
    tokio::task::yield_now().await;
    assert!(!waiting_65.is_finished() && !waiting_66.is_finished());
    cancel.cancel();
    let error = within("the cancelled open", waiting_65)
        .await
        .unwrap()
        .unwrap_err();
    assert_eq!(error.reason(), FailureReason::Aborted);
    assert!(!waiting_66.is_finished());
    // One channel ends both ways: the 66th gets its slot.
    let (gateway, worker) = held.pop().unwrap();
    let (mut gateway_reader, mut gateway_writer) = gateway.into_split();
    let (mut worker_reader, mut worker_writer) = worker.into_split();
    gateway_writer.shutdown().await.unwrap();
    worker_writer.shutdown().await.unwrap();
    let mut sink = Vec::new();
    worker_reader.read_to_end(&mut sink).await.unwrap();
    gateway_reader.read_to_end(&mut sink).await.unwrap();
    let channel = within("the 66th open", waiting_66).await.unwrap().unwrap();
    assert!(!channel.id().as_str().is_empty());
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_writer_without_credit_for_60s_fails_stalled() {
    let (mut ends, _hole) = duplex(&LinkConfig::new(End::Gateway)).await;
    let (gateway, worker) = open_named(&mut ends).await;
    let (mut worker_reader, _worker_writer) = worker.into_split();
    let (_gateway_reader, mut gateway_writer) = gateway.into_split();
    let started = tokio::time::Instant::now();
    let error = within("the stall", async {
        loop {
            if let Err(error) = gateway_writer.write_all(&[3u8; 64 * 1024]).await {
                return error;
            }
        }
    })
    .await;
    assert_eq!(reason_of(&error), FailureReason::Stalled);
    assert_eq!(error.kind(), io::ErrorKind::TimedOut);
    let waited = started.elapsed();
    assert!(
        waited >= Duration::from_secs(60) && waited < Duration::from_secs(61),
        "{waited:?}"
    );
    // The reader that never read held one window, and learns why the channel went.
    let stats = ends.worker.stats();
    assert!(stats.max_channel_recv_buffered <= 256 * 1024, "{stats:?}");
    let mut buf = vec![0u8; 1024 * 1024];
    let error = loop {
        match worker_reader.read(&mut buf).await {
            Ok(n) => assert!(n > 0),
            Err(error) => break error,
        }
    };
    assert_eq!(reason_of(&error), FailureReason::Stalled);
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn an_unaccepted_channel_is_refused_after_30s() {
    let (ends, _hole) = duplex(&LinkConfig::new(End::Gateway)).await;
    let channel = ends
        .gateway
        .open_channel(&CancellationToken::new())
        .await
        .unwrap();
    let id = channel.id().to_string();
    let (mut reader, _writer) = channel.into_split();
    let started = tokio::time::Instant::now();
    let mut buf = [0u8; 1];
    let error = within("the refusal", reader.read(&mut buf))
        .await
        .unwrap_err();
    assert_eq!(reason_of(&error), FailureReason::Refused);
    let waited = started.elapsed();
    assert!(
        waited >= Duration::from_secs(30) && waited < Duration::from_secs(31),
        "{waited:?}"
    );
    assert_eq!(
        ends.worker.accept_channel(&id).unwrap_err().reason(),
        FailureReason::Refused
    );
    assert_eq!(
        ends.worker.accept_channel("c-never").unwrap_err().reason(),
        FailureReason::Refused
    );
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_dead_uplink_closes_the_link_within_15s() {
    let (mut ends, hole) = duplex(&LinkConfig::new(End::Gateway)).await;
    let (gateway, _worker) = open_named(&mut ends).await;
    // Let a few pings go through first.
    tokio::time::sleep(Duration::from_secs(12)).await;
    assert!(ends.gateway.close_reason().is_none());
    hole.store(true, Ordering::SeqCst);
    let started = tokio::time::Instant::now();
    let reason = within("the dead uplink", ends.gateway.closed()).await;
    assert_eq!(reason, CloseReason::Unresponsive);
    assert!(
        started.elapsed() <= Duration::from_secs(15),
        "{:?}",
        started.elapsed()
    );
    // The worker was last heard before the hole opened, not when the link gave up on it.
    let silent = ends.gateway.silent_for();
    assert!(
        silent >= started.elapsed() && silent <= started.elapsed() + Duration::from_secs(5),
        "silent for {silent:?}, the hole open for {:?}",
        started.elapsed()
    );
    let (mut reader, _writer) = gateway.into_split();
    let mut buf = [0u8; 1];
    assert_eq!(
        reason_of(&reader.read(&mut buf).await.unwrap_err()),
        FailureReason::Closed
    );
    assert_eq!(
        within("worker close", ends.worker.closed()).await,
        CloseReason::Unresponsive
    );
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_quiet_link_stays_up_for_an_hour() {
    let (ends, _hole) = duplex(&LinkConfig::new(End::Gateway)).await;
    tokio::time::sleep(Duration::from_secs(3600)).await;
    assert!(ends.gateway.close_reason().is_none());
    assert!(ends.worker.close_reason().is_none());
    assert!(ends.gateway.stats().rtt.is_some());
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn send_text_waits_for_room_and_never_queues_without_bound() {
    let mut config = LinkConfig::new(End::Gateway);
    config.text_send_buffer = 1000;
    config.text_receive_buffer = 1000;
    let (mut ends, _hole) = duplex(&config).await;
    // The worker does not read text: the gateway's lane, the worker's inbox and the socket fill.
    let sender = tokio::spawn({
        let gateway = ends.gateway.clone();
        async move {
            let mut sent = 0u32;
            loop {
                let text = "x".repeat(500);
                match tokio::time::timeout(Duration::from_secs(2), gateway.send_text(text)).await {
                    Ok(Ok(())) => sent += 1,
                    Ok(Err(error)) => panic!("{error}"),
                    Err(_) => return sent,
                }
            }
        }
    });
    let sent = within("the sender to block", sender).await.unwrap();
    let stats = ends.gateway.stats();
    assert!(stats.text_queued <= 1000 + 500, "{stats:?}");
    assert!(sent < 10_000, "sent {sent} without anyone reading");
    // The link is alive: reading text resumes everything.
    for _ in 0..sent {
        within("text", ends.worker_text.next()).await.unwrap();
    }
    assert!(ends.gateway.close_reason().is_none() && ends.worker.close_reason().is_none());
}
