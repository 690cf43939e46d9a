//! The tokio driver: one task per link that owns the WebSocket and the timer, feeds what arrives
//! into the sans-IO [`Link`] and sends what it yields. Nothing else.
//!
//! Writing respects the sink's readiness, so tungstenite never holds more than its write buffer
//! plus one message; the driver flushes whenever the link has nothing more to send, which keeps
//! a priority frame at most that far behind bulk data (plus the kernel's unsent bytes, which
//! [`tune_tcp`](crate::tune_tcp) keeps at 16 KiB where the OS allows, and the peer's unread
//! bytes, which a [`ReceiveBuffer`] keeps near the path's bandwidth-delay product).

use std::{
    future::Future,
    pin::Pin,
    sync::Arc,
    task::{Context, Poll},
    time::Duration,
};

use futures::{Sink, Stream};
use tokio::{
    io::{AsyncRead, AsyncWrite},
    time::Sleep,
};
use tokio_tungstenite::{
    WebSocketStream,
    tungstenite::{
        Message,
        protocol::{CloseFrame, WebSocketConfig, frame::coding::CloseCode},
    },
};

use crate::{
    config::LinkConfig,
    error::CloseReason,
    handle::{LinkHandle, TextReceiver},
    proto::{Link, Transmit},
    shared::Shared,
    socket::ReceiveBuffer,
};

/// Messages read from the socket in one round (at most 256 KiB of DATA), handed to the link
/// under one lock. Reading takes more per round than writing: draining the kernel's queue is
/// what lets a text frame that arrived behind bulk data be seen.
const READ_BATCH: usize = 16;

/// Messages written to the socket in one round (at most 128 KiB of DATA).
const WRITE_BATCH: usize = 8;

/// Rounds of read, timer and write in one poll before the driver yields to other tasks. One:
/// a busy link takes turns with the tasks of small calls on its thread instead of holding the
/// thread for megabytes (the relay bench's renew p99 went from 5.6 ms to about 2 ms with this,
/// the batches above and the daemon runtime's event interval: ADR 0014).
const MAX_ROUNDS: usize = 1;

/// How long the driver waits for the WebSocket close handshake before dropping the socket, so a
/// dead peer cannot hold a closing link.
const CLOSE_LINGER: Duration = Duration::from_secs(1);

/// The bytes tungstenite gathers before writing to the socket: 64 KiB batches syscalls while
/// keeping what sits ahead of a priority frame small.
pub const WS_WRITE_BUFFER: usize = 64 * 1024;

/// Largest message the link lets tungstenite accept (text wire frames included): 16 MiB.
pub const WS_MAX_MESSAGE: usize = 16 * 1024 * 1024;

/// The WebSocket configuration a link should be built with: a small write buffer, a bounded
/// maximum write buffer (one buffer plus one largest message), and a 16 MiB message cap. Pass it
/// to `accept_async_with_config` / `client_async_with_config`.
pub fn websocket_config() -> WebSocketConfig {
    WebSocketConfig::default()
        .write_buffer_size(WS_WRITE_BUFFER)
        .max_write_buffer_size(WS_WRITE_BUFFER + WS_MAX_MESSAGE + 64)
        .max_message_size(Some(WS_MAX_MESSAGE))
        .max_frame_size(Some(WS_MAX_MESSAGE))
}

/// Starts a link over an established WebSocket: spawns its driver task on the current tokio
/// runtime and returns the handle and the incoming text.
///
/// Build the WebSocket with [`websocket_config`], and tune a TCP socket with
/// [`tune_tcp`](crate::tune_tcp) first. Over TCP, prefer [`spawn_tuned`].
///
/// # Panics
/// Outside a tokio runtime (as `tokio::spawn` does).
pub fn spawn<S>(ws: WebSocketStream<S>, config: LinkConfig) -> (LinkHandle, TextReceiver)
where
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    spawn_tuned(ws, config, ReceiveBuffer::untuned())
}

/// [`spawn`] over a TCP socket whose receive buffer the driver sizes once the link has measured
/// its round trip (`ReceiveBuffer::of(&stream)`, taken before the WebSocket handshake).
///
/// # Panics
/// Outside a tokio runtime (as `tokio::spawn` does).
pub fn spawn_tuned<S>(
    ws: WebSocketStream<S>,
    config: LinkConfig,
    receive_buffer: ReceiveBuffer,
) -> (LinkHandle, TextReceiver)
where
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    if ws.get_config().max_write_buffer_size == usize::MAX {
        tracing::debug!(
            "link WebSocket has an unbounded write buffer; use simlock_link::websocket_config()"
        );
    }
    let now = tokio::time::Instant::now();
    let shared = Shared::new(Link::new(config, now.into_std()));
    let driver = Driver {
        ws,
        shared: shared.clone(),
        timer: Box::pin(tokio::time::sleep_until(now)),
        timer_at: None,
        incoming: Vec::with_capacity(READ_BATCH),
        peer_close: None,
        receive_buffer,
        unflushed: false,
        read_over: false,
        closing: None,
    };
    tokio::spawn(driver);
    (LinkHandle::new(shared.clone()), TextReceiver::new(shared))
}

/// The driver task's state.
struct Driver<S> {
    ws: WebSocketStream<S>,
    shared: Arc<Shared>,
    timer: Pin<Box<Sleep>>,
    timer_at: Option<std::time::Instant>,
    incoming: Vec<Message>,
    /// The reason text of the peer's close frame, once one arrived.
    peer_close: Option<String>,
    /// The socket's receive buffer, sized to the link's smallest round trip.
    receive_buffer: ReceiveBuffer,
    unflushed: bool,
    /// The socket's read side ended.
    read_over: bool,
    /// The link is closing: the WebSocket close is under way, with this linger deadline.
    closing: Option<Pin<Box<Sleep>>>,
}

impl<S> Driver<S>
where
    S: AsyncRead + AsyncWrite + Unpin,
{
    /// Reads what the socket has (a batch) into the link. Returns whether anything happened.
    fn drive_read(&mut self, cx: &mut Context<'_>) -> bool {
        if self.read_over {
            return false;
        }
        let room = self.shared.with_driver(|state, now| {
            if !state
                .driver
                .as_ref()
                .is_some_and(|w| w.will_wake(cx.waker()))
            {
                state.driver = Some(cx.waker().clone());
            }
            let room = state.inbox_has_room();
            if room == state.reading_paused {
                state.reading_paused = !room;
                state.link.set_reading_paused(now, !room);
            }
            room && state.link.close_reason().is_none()
        });
        if !room {
            return false;
        }
        let mut ended = None;
        while self.incoming.len() < READ_BATCH {
            match Pin::new(&mut self.ws).poll_next(cx) {
                Poll::Ready(Some(Ok(Message::Close(frame)))) => {
                    // tungstenite answers the close; the stream ends next.
                    self.peer_close = Some(
                        frame
                            .map(|f| f.reason.as_str().to_owned())
                            .unwrap_or_default(),
                    );
                }
                Poll::Ready(Some(Ok(message))) => self.incoming.push(message),
                Poll::Ready(Some(Err(error))) => {
                    // After the peer's close frame, a failing reply is still the peer's close.
                    ended = Some(match self.peer_close.take() {
                        Some(reason) => CloseReason::Peer { reason },
                        None => CloseReason::Transport(error.to_string()),
                    });
                    break;
                }
                Poll::Ready(None) => {
                    ended = Some(match self.peer_close.take() {
                        Some(reason) => CloseReason::Peer { reason },
                        None => CloseReason::Transport("connection ended without a close".into()),
                    });
                    break;
                }
                Poll::Pending => break,
            }
        }
        if self.incoming.is_empty() && ended.is_none() {
            return false;
        }
        let incoming = &mut self.incoming;
        let min_rtt = self.shared.with_driver(|state, now| {
            for message in incoming.drain(..) {
                match message {
                    Message::Binary(bytes) => state.link.handle_frame(now, bytes),
                    Message::Text(text) => state.link.handle_text(now, text.as_str().to_owned()),
                    // WebSocket-level pings are answered by tungstenite; the link has its own.
                    // Close frames were taken while reading.
                    Message::Ping(_) | Message::Pong(_) | Message::Frame(_) | Message::Close(_) => {
                    }
                }
            }
            if let Some(reason) = ended.clone() {
                state.link.handle_transport_closed(reason);
            }
            state.link.min_rtt()
        });
        if ended.is_some() {
            self.read_over = true;
        }
        // A round trip within the ceiling sizes the socket's receive buffer (once).
        if let Some(rtt) = min_rtt.filter(|_| self.receive_buffer.pending())
            && let Some(size) = self.receive_buffer.fit(rtt)
        {
            self.shared
                .with_driver(|state, _| state.receive_buffer = Some(size));
        }
        true
    }

    /// Fires the link's timer when due, and keeps it set to the link's next deadline.
    fn drive_timer(&mut self, cx: &mut Context<'_>) -> bool {
        let mut progress = false;
        loop {
            let next = self.shared.with_driver(|state, _| {
                let next = state.link.poll_timeout();
                state.timer = next;
                next
            });
            let Some(next) = next else {
                return progress;
            };
            if self.timer_at != Some(next) {
                self.timer_at = Some(next);
                self.timer
                    .as_mut()
                    .reset(tokio::time::Instant::from_std(next));
            }
            if self.timer.as_mut().poll(cx).is_pending() {
                return progress;
            }
            self.shared
                .with_driver(|state, now| state.link.handle_timeout(now));
            self.timer_at = None;
            progress = true;
        }
    }

    /// Sends what the link yields while the socket takes it, then flushes. Returns whether
    /// anything happened.
    fn drive_write(&mut self, cx: &mut Context<'_>) -> bool {
        let mut progress = false;
        let mut sent = 0;
        while self.closing.is_none() && sent < WRITE_BATCH {
            match Pin::new(&mut self.ws).poll_ready(cx) {
                Poll::Ready(Ok(())) => {}
                Poll::Ready(Err(error)) => {
                    self.transport_failed(error.to_string());
                    return true;
                }
                Poll::Pending => break,
            }
            let Some(transmit) = self
                .shared
                .with_driver(|state, now| state.link.poll_transmit(now))
            else {
                break;
            };
            let message = match transmit {
                Transmit::Frame(bytes) => Message::Binary(bytes),
                Transmit::Text(text) => Message::Text(text.into()),
                Transmit::Close(reason) => {
                    self.closing = Some(Box::pin(tokio::time::sleep(CLOSE_LINGER)));
                    self.receive_buffer.release();
                    Message::Close(Some(close_frame(&reason)))
                }
            };
            if let Err(error) = Pin::new(&mut self.ws).start_send(message) {
                self.transport_failed(error.to_string());
                return true;
            }
            self.unflushed = true;
            progress = true;
            sent += 1;
        }
        if self.unflushed && self.closing.is_none() {
            match Pin::new(&mut self.ws).poll_flush(cx) {
                Poll::Ready(Ok(())) => self.unflushed = false,
                Poll::Ready(Err(error)) => {
                    self.transport_failed(error.to_string());
                    return true;
                }
                Poll::Pending => {}
            }
        }
        progress
    }

    fn transport_failed(&mut self, error: String) {
        let reason = match self.peer_close.take() {
            Some(reason) => CloseReason::Peer { reason },
            None => CloseReason::Transport(error),
        };
        self.shared
            .with_driver(|state, _| state.link.handle_transport_closed(reason));
        self.read_over = true;
    }
}

impl<S> Future for Driver<S>
where
    S: AsyncRead + AsyncWrite + Unpin,
{
    type Output = ();

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        let this = &mut *self;
        for _ in 0..MAX_ROUNDS {
            let read = this.drive_read(cx);
            let timer = this.drive_timer(cx);
            let write = this.drive_write(cx);
            if let Some(linger) = this.closing.as_mut() {
                // The close frame is queued: flush it, wait for the peer's answer (the stream
                // ends), or give up after the linger.
                let flushed = Pin::new(&mut this.ws).poll_close(cx).is_ready();
                let mut answered = this.read_over;
                while flushed && !answered {
                    match Pin::new(&mut this.ws).poll_next(cx) {
                        Poll::Ready(Some(Ok(_))) => {}
                        Poll::Ready(Some(Err(_)) | None) => answered = true,
                        Poll::Pending => break,
                    }
                }
                if answered || linger.as_mut().poll(cx).is_ready() {
                    return Poll::Ready(());
                }
                return Poll::Pending;
            }
            let drained = this.shared.with_driver(|state, _| state.link.is_drained());
            if drained && this.read_over {
                // The transport is gone and nothing is left to send.
                return Poll::Ready(());
            }
            if !(read || timer || write) {
                return Poll::Pending;
            }
        }
        cx.waker().wake_by_ref();
        Poll::Pending
    }
}

impl<S> Drop for Driver<S> {
    fn drop(&mut self) {
        // A driver that stops (runtime shutdown included) leaves no one waiting forever.
        self.shared.with_driver(|state, _| {
            state
                .link
                .handle_transport_closed(CloseReason::Transport("link driver stopped".into()));
            state.driver = None;
        });
        self.shared.finished().cancel();
    }
}

fn close_frame(reason: &CloseReason) -> CloseFrame {
    let (code, text) = match reason {
        CloseReason::Violation(what) => (CloseCode::Protocol, what.as_str()),
        CloseReason::Unresponsive => (CloseCode::Away, "unresponsive"),
        CloseReason::LocalBecause(why) => (CloseCode::Normal, why.as_str()),
        _ => (CloseCode::Normal, ""),
    };
    // A close frame's reason must fit in 123 bytes; cut at a character boundary.
    let mut end = text.len().min(123);
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    CloseFrame {
        code,
        reason: text[..end].into(),
    }
}
