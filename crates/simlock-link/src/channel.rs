//! One byte channel: a [`ChannelReader`] for the peer's direction and a [`ChannelWriter`] for
//! this end's, usable as tokio `AsyncRead`/`AsyncWrite` or as futures `Stream`/`Sink` of
//! [`Bytes`].
//!
//! Dropping a reader before end of stream sends STOP; dropping a writer that did not finish
//! aborts the channel. Failures surface as [`ChannelError`], or as an [`io::Error`] carrying one
//! (recover it with [`ChannelError::from_io`]).

use std::{
    fmt, io,
    pin::Pin,
    sync::Arc,
    task::{Context, Poll},
};

use bytes::Bytes;
use futures::{Sink, Stream};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

use crate::{
    error::{ChannelError, FailureReason},
    proto::{
        ChannelKey, Read,
        frame::{ChannelId, EncodedData},
    },
    shared::Shared,
};

/// Chunks taken under the lock per `poll_read` (copied out after it is released): enough to
/// fill a 256 KiB buffer with 16 KiB frames, few enough to keep the lock short.
const READ_CHUNKS: usize = 16;

/// One channel: both halves, which can be moved to different tasks.
pub struct Channel {
    id: ChannelId,
    /// The peer's direction (at the gateway: the response; at the worker: the request).
    pub reader: ChannelReader,
    /// This end's direction (at the gateway: the request; at the worker: the response).
    pub writer: ChannelWriter,
}

impl fmt::Debug for Channel {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Channel")
            .field("id", &self.id)
            .finish_non_exhaustive()
    }
}

impl Channel {
    pub(crate) fn new(shared: Arc<Shared>, key: ChannelKey, id: ChannelId) -> Self {
        Self {
            id,
            reader: ChannelReader {
                shared: shared.clone(),
                key,
                id,
                done: false,
                chunks: Vec::with_capacity(READ_CHUNKS),
            },
            writer: ChannelWriter {
                frame_payload: shared.with(|state, _| state.link.config().max_data_frame),
                shared,
                key,
                id,
                finishing: false,
            },
        }
    }

    /// The channel's id (what the gateway names in `relay.request`).
    pub fn id(&self) -> &ChannelId {
        &self.id
    }

    /// Aborts the channel: both directions fail `aborted`, here and at the peer.
    pub fn abort(&self) {
        self.reader.abort();
    }

    /// The two halves.
    pub fn into_split(self) -> (ChannelReader, ChannelWriter) {
        (self.reader, self.writer)
    }
}

/// The reading half of a channel: `AsyncRead`, and a `Stream` of `Result<Bytes, ChannelError>`.
pub struct ChannelReader {
    shared: Arc<Shared>,
    key: ChannelKey,
    id: ChannelId,
    /// End of stream or failure was returned: the stream is over.
    done: bool,
    chunks: Vec<Bytes>,
}

impl fmt::Debug for ChannelReader {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ChannelReader")
            .field("id", &self.id)
            .finish_non_exhaustive()
    }
}

impl ChannelReader {
    /// The channel's id.
    pub fn id(&self) -> &ChannelId {
        &self.id
    }

    /// Wants no more of this direction: the peer's writer fails `stopped`. Same as dropping the
    /// reader.
    pub fn stop(self) {
        drop(self);
    }

    /// Aborts the whole channel: both directions fail `aborted`, here and at the peer.
    pub fn abort(&self) {
        self.shared
            .with(|state, now| state.link.abort(now, self.key));
    }

    /// Reads the next chunk of bytes: `Ok(None)` at the clean end of stream.
    ///
    /// # Errors
    /// The channel's failure.
    pub async fn read_chunk(&mut self) -> Result<Option<Bytes>, ChannelError> {
        self.read_up_to(usize::MAX).await
    }

    /// Reads the next chunk of at most `max` bytes (at least one): `Ok(None)` at the clean end
    /// of stream.
    ///
    /// # Errors
    /// The channel's failure.
    pub async fn read_up_to(&mut self, max: usize) -> Result<Option<Bytes>, ChannelError> {
        let max = max.max(1);
        futures::future::poll_fn(|cx| self.poll_chunk(cx, max)).await
    }

    fn poll_chunk(
        &mut self,
        cx: &mut Context<'_>,
        max: usize,
    ) -> Poll<Result<Option<Bytes>, ChannelError>> {
        let coop = std::task::ready!(tokio::task::coop::poll_proceed(cx));
        let key = self.key;
        let polled = self
            .shared
            .with(|state, now| match state.link.read(now, key, max) {
                Ok(Read::Data(bytes)) => Poll::Ready(Ok(Some(bytes))),
                Ok(Read::End) => Poll::Ready(Ok(None)),
                Ok(Read::Blocked) => {
                    state.readers.insert(key, cx.waker().clone());
                    Poll::Pending
                }
                Err(error) => Poll::Ready(Err(error)),
            });
        if polled.is_ready() {
            coop.made_progress();
        }
        polled
    }
}

impl AsyncRead for ChannelReader {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        let want = buf.remaining();
        if want == 0 {
            return Poll::Ready(Ok(()));
        }
        let coop = std::task::ready!(tokio::task::coop::poll_proceed(cx));
        let key = this.key;
        let chunks = &mut this.chunks;
        // Take several chunks under one lock; copy them after it is released.
        let outcome = this.shared.with(|state, now| {
            let mut left = want;
            while left > 0 && chunks.len() < READ_CHUNKS {
                match state.link.read(now, key, left) {
                    Ok(Read::Data(bytes)) => {
                        left -= bytes.len();
                        chunks.push(bytes);
                    }
                    Ok(Read::End) => return Poll::Ready(Ok(())),
                    Ok(Read::Blocked) => {
                        if chunks.is_empty() {
                            state.readers.insert(key, cx.waker().clone());
                            return Poll::Pending;
                        }
                        break;
                    }
                    Err(error) if chunks.is_empty() => return Poll::Ready(Err(error)),
                    // Deliver what was read first; the failure shows on the next read.
                    Err(_) => break,
                }
            }
            Poll::Ready(Ok(()))
        });
        for chunk in chunks.drain(..) {
            buf.put_slice(&chunk);
        }
        if outcome.is_ready() {
            coop.made_progress();
        }
        outcome.map_err(io::Error::from)
    }
}

impl Stream for ChannelReader {
    type Item = Result<Bytes, ChannelError>;

    fn poll_next(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        let this = self.get_mut();
        if this.done {
            return Poll::Ready(None);
        }
        match this.poll_chunk(cx, usize::MAX) {
            Poll::Ready(Ok(Some(bytes))) => Poll::Ready(Some(Ok(bytes))),
            Poll::Ready(Ok(None)) => {
                this.done = true;
                Poll::Ready(None)
            }
            Poll::Ready(Err(error)) => {
                this.done = true;
                Poll::Ready(Some(Err(error)))
            }
            Poll::Pending => Poll::Pending,
        }
    }
}

impl Drop for ChannelReader {
    fn drop(&mut self) {
        let key = self.key;
        self.shared.with(|state, now| {
            state.readers.remove(&key);
            state.link.detach_reader(now, key);
        });
    }
}

/// The writing half of a channel: `AsyncWrite`, and a `Sink` of [`Bytes`].
///
/// `finish` (or `poll_shutdown`/`poll_close`) sends END after the queued bytes and completes
/// once END is sent. Writing after finish fails (`closed` for the `Sink`, `BrokenPipe` for
/// `AsyncWrite`). Every way of writing frames the bytes in the writer's task, so the link's
/// driver sends them without copying.
pub struct ChannelWriter {
    shared: Arc<Shared>,
    key: ChannelKey,
    id: ChannelId,
    finishing: bool,
    /// Payload bytes per DATA frame, for encoding outside the lock.
    frame_payload: usize,
}

impl fmt::Debug for ChannelWriter {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ChannelWriter")
            .field("id", &self.id)
            .finish_non_exhaustive()
    }
}

impl ChannelWriter {
    /// The channel's id.
    pub fn id(&self) -> &ChannelId {
        &self.id
    }

    /// Aborts the whole channel: both directions fail `aborted`, here and at the peer.
    pub fn abort(&self) {
        self.shared
            .with(|state, now| state.link.abort(now, self.key));
    }

    /// Writes all of `data`, waiting for room as needed. The bytes are framed here, in the
    /// caller's task (their one copy on the way out), so the link's driver sends the frames as
    /// they are: the copying is spread over the writers' tasks instead of piling up in the one
    /// task that drives the socket (about 10 % more relay throughput on a 2-core machine).
    ///
    /// # Errors
    /// The channel's failure (`stopped` when the reader stopped).
    pub async fn write_bytes(&mut self, data: Bytes) -> Result<(), ChannelError> {
        futures::future::poll_fn(|cx| self.poll_space(cx)).await?;
        self.queue_framed(&data)
    }

    /// Frames `data` into DATA frames outside the link's lock and queues them (it may overshoot
    /// the send buffer by this one item; only this writer adds to its queue).
    fn queue_framed(&mut self, data: &[u8]) -> Result<(), ChannelError> {
        if data.is_empty() {
            return Ok(());
        }
        let framed = EncodedData::new(self.id, data, self.frame_payload);
        let key = self.key;
        self.shared
            .with(|state, now| state.link.write_encoded(now, key, framed))
    }

    /// Bounds this writer's queue of unsent bytes at `bytes` instead of the link's send buffer
    /// (256 KiB by default): writing waits while that much is queued (a `Sink` item may overshoot
    /// it once), and resumes once half of it went. A small bound keeps what a stalled reader
    /// holds back on this side small; a bound of a few frames still keeps the link's batches full.
    ///
    /// # Errors
    /// The channel's failure.
    pub fn set_send_buffer(&mut self, bytes: usize) -> Result<(), ChannelError> {
        let key = self.key;
        self.shared
            .with(|state, now| state.link.set_send_buffer(now, key, bytes))
    }

    /// Sends END after everything written, and waits until it was sent.
    ///
    /// # Errors
    /// The channel's failure; `stopped` if the reader stopped before END went.
    pub async fn finish(&mut self) -> Result<(), ChannelError> {
        futures::future::poll_fn(|cx| self.poll_finish(cx)).await
    }

    fn after_finish(&self) -> ChannelError {
        ChannelError::on(FailureReason::Closed, self.id)
    }

    fn poll_space(&mut self, cx: &mut Context<'_>) -> Poll<Result<usize, ChannelError>> {
        if self.finishing {
            return Poll::Ready(Err(self.after_finish()));
        }
        let coop = std::task::ready!(tokio::task::coop::poll_proceed(cx));
        let key = self.key;
        let polled = self
            .shared
            .with(|state, _| match state.link.write_space(key) {
                Ok(0) => {
                    state.writers.insert(key, cx.waker().clone());
                    Poll::Pending
                }
                other => Poll::Ready(other),
            });
        if polled.is_ready() {
            coop.made_progress();
        }
        polled
    }

    fn poll_drained(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), ChannelError>> {
        let key = self.key;
        self.shared
            .with(|state, _| match state.link.poll_drained(key) {
                Ok(true) => Poll::Ready(Ok(())),
                Ok(false) => {
                    state.writers.insert(key, cx.waker().clone());
                    Poll::Pending
                }
                Err(error) => Poll::Ready(Err(error)),
            })
    }

    fn poll_finish(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), ChannelError>> {
        let key = self.key;
        let start = !self.finishing;
        self.finishing = true;
        self.shared.with(|state, now| {
            if start && let Err(error) = state.link.finish(now, key) {
                return Poll::Ready(Err(error));
            }
            match state.link.poll_finished(key) {
                Ok(true) => Poll::Ready(Ok(())),
                Ok(false) => {
                    state.writers.insert(key, cx.waker().clone());
                    Poll::Pending
                }
                Err(error) => Poll::Ready(Err(error)),
            }
        })
    }
}

impl AsyncWrite for ChannelWriter {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        if this.finishing {
            return Poll::Ready(Err(io::Error::new(
                io::ErrorKind::BrokenPipe,
                "write on a channel writer after finish",
            )));
        }
        if buf.is_empty() {
            return Poll::Ready(Ok(0));
        }
        let space = match this.poll_space(cx) {
            Poll::Ready(Ok(space)) => space,
            Poll::Ready(Err(error)) => return Poll::Ready(Err(error.into())),
            Poll::Pending => return Poll::Pending,
        };
        // Encode into DATA frames outside the lock (the one copy of the bytes on the way out);
        // only this writer adds to its queue, so the room stays.
        let take = space.min(buf.len());
        let data = EncodedData::new(this.id, &buf[..take], this.frame_payload);
        let key = this.key;
        Poll::Ready(
            this.shared
                .with(|state, now| state.link.write_encoded(now, key, data))
                .map(|()| take)
                .map_err(io::Error::from),
        )
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        self.get_mut().poll_drained(cx).map_err(io::Error::from)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        self.get_mut().poll_finish(cx).map_err(io::Error::from)
    }
}

impl Sink<Bytes> for ChannelWriter {
    type Error = ChannelError;

    fn poll_ready(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Result<(), ChannelError>> {
        self.get_mut().poll_space(cx).map_ok(|_| ())
    }

    fn start_send(self: Pin<&mut Self>, item: Bytes) -> Result<(), ChannelError> {
        let this = self.get_mut();
        if this.finishing {
            return Err(this.after_finish());
        }
        this.queue_framed(&item)
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Result<(), ChannelError>> {
        self.get_mut().poll_drained(cx)
    }

    fn poll_close(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Result<(), ChannelError>> {
        self.get_mut().poll_finish(cx)
    }
}

impl Drop for ChannelWriter {
    fn drop(&mut self) {
        let key = self.key;
        self.shared.with(|state, now| {
            state.writers.remove(&key);
            state.link.detach_writer(now, key);
        });
    }
}
