//! The application's handles on a running link: [`LinkHandle`] for the text lane, channels and
//! lifecycle, and [`TextReceiver`] for incoming text.

use std::{
    fmt,
    pin::Pin,
    sync::Arc,
    task::{Context, Poll},
};

use futures::Stream;
use tokio_util::sync::CancellationToken;

use crate::{
    channel::Channel,
    error::{ChannelError, CloseReason, FailureReason, LinkError},
    proto::{LinkStats, OpenTicket, SendTextError},
    shared::Shared,
};

/// A handle on a running link. Cheap to clone; the link closes when the last clone is dropped.
#[derive(Clone)]
pub struct LinkHandle {
    inner: Arc<HandleInner>,
}

/// Closes the link when the last [`LinkHandle`] goes.
struct HandleInner {
    shared: Arc<Shared>,
}

impl Drop for HandleInner {
    fn drop(&mut self) {
        self.shared.with(|state, _| state.link.close());
    }
}

impl fmt::Debug for LinkHandle {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LinkHandle")
            .field("end", &self.shared().with(|state, _| state.link.end()))
            .finish_non_exhaustive()
    }
}

impl LinkHandle {
    pub(crate) fn new(shared: Arc<Shared>) -> Self {
        Self {
            inner: Arc::new(HandleInner { shared }),
        }
    }

    fn shared(&self) -> &Arc<Shared> {
        &self.inner.shared
    }

    /// Sends a text message on the priority lane: it goes before any DATA. Waits while the lane
    /// holds its limit (1 MiB by default); never queues without bound.
    ///
    /// # Errors
    /// [`LinkError`] once the link is closed.
    pub async fn send_text(&self, text: String) -> Result<(), LinkError> {
        let shared = self.shared();
        let waiter = WaiterGuard {
            shared,
            id: shared.waiter_id(),
        };
        let mut text = Some(text);
        futures::future::poll_fn(|cx| {
            shared.with(|state, _| {
                let Some(message) = text.take() else {
                    return Poll::Ready(Ok(()));
                };
                match state.link.send_text(message) {
                    Ok(()) => Poll::Ready(Ok(())),
                    Err(SendTextError::Full(message)) => {
                        text = Some(message);
                        state.text_senders.insert(waiter.id, cx.waker().clone());
                        Poll::Pending
                    }
                    Err(SendTextError::Closed(error)) => Poll::Ready(Err(error)),
                }
            })
        })
        .await
    }

    /// Opens a channel (gateway end). While 64 channels are open it waits, first come first
    /// served, for one of them to end; the wait ends at once when `cancel` fires.
    ///
    /// # Errors
    /// `aborted` when `cancel` fired first; `closed` when the link closed; `refused` at the
    /// worker end, which cannot open.
    pub async fn open_channel(&self, cancel: &CancellationToken) -> Result<Channel, ChannelError> {
        let shared = self.shared();
        let ticket = shared.with(|state, now| state.link.open(now));
        let mut guard = OpenGuard {
            shared,
            ticket,
            taken: false,
        };
        let wait = futures::future::poll_fn(|cx| {
            shared.with(|state, _| match state.link.take_opened(ticket) {
                Some(result) => Poll::Ready(result),
                None => {
                    state.opens.insert(ticket, cx.waker().clone());
                    Poll::Pending
                }
            })
        });
        let result = tokio::select! {
            biased;
            () = cancel.cancelled() => Err(ChannelError::new(FailureReason::Aborted)),
            result = wait => result,
        };
        let key = result?;
        guard.taken = true;
        let id = shared
            .with(|state, _| state.link.channel_id(key))
            .ok_or_else(|| ChannelError::new(FailureReason::Closed))?;
        Ok(Channel::new(shared.clone(), key, id))
    }

    /// Accepts the channel the gateway opened as `id` (worker end).
    ///
    /// # Errors
    /// `refused` when `id` is malformed, was never opened, is no longer known or was already
    /// accepted (or at the gateway end); `closed` when the link is closed.
    pub fn accept_channel(&self, id: &str) -> Result<Channel, ChannelError> {
        let shared = self.shared();
        let (key, id) = shared.with(|state, now| {
            let key = state.link.accept(now, id)?;
            let id = state
                .link
                .channel_id(key)
                .ok_or_else(|| ChannelError::new(FailureReason::Closed))?;
            Ok::<_, ChannelError>((key, id))
        })?;
        Ok(Channel::new(shared.clone(), key, id))
    }

    /// A snapshot of the link's counters: open channels, bytes each way, buffered bytes, credit
    /// stalls.
    pub fn stats(&self) -> LinkStats {
        self.shared().with(|state, _| LinkStats {
            receive_buffer: state.receive_buffer,
            ..state.link.stats()
        })
    }

    /// How long since the peer last sent anything (a frame or a text; since the link started,
    /// if nothing yet). After a close it stays counted from the last thing heard: a peer that
    /// went silent until the PINGs gave up was last heard that long before the close.
    pub fn silent_for(&self) -> std::time::Duration {
        self.shared()
            .with(|state, now| now.saturating_duration_since(state.link.last_heard()))
    }

    /// Closes the link: every channel fails `closed`, queued text still goes, then the WebSocket
    /// closes.
    pub fn close(&self) {
        self.shared().with(|state, _| state.link.close());
    }

    /// [`Self::close`], telling the peer `why`: it reads it as [`CloseReason::Peer`].
    pub fn close_because(&self, why: impl Into<String>) {
        let why = why.into();
        self.shared().with(|state, _| state.link.close_because(why));
    }

    /// Why the link closed, if it has.
    pub fn close_reason(&self) -> Option<CloseReason> {
        self.shared()
            .with(|state, _| state.link.close_reason().cloned())
    }

    /// Resolves when the link's driver has ended: after a local close, once the close frame is
    /// on the wire and the peer answered it (or the linger ran out), so a process that waits for
    /// this before it exits tells its peer why it closed.
    pub async fn finished(&self) {
        self.shared().finished().cancelled().await;
    }

    /// Resolves when the link is gone (peer close, violation, missed pings, socket error, or a
    /// local close), with the reason.
    pub async fn closed(&self) -> CloseReason {
        let mut closed = self.shared().closed();
        match closed.wait_for(Option::is_some).await {
            Ok(reason) => reason.clone().unwrap_or(CloseReason::Local),
            // The sender lives in `Shared`, which this handle keeps alive.
            Err(_) => CloseReason::Local,
        }
    }
}

/// Removes a text sender's waker when its future ends or is dropped.
struct WaiterGuard<'a> {
    shared: &'a Shared,
    id: u64,
}

impl Drop for WaiterGuard<'_> {
    fn drop(&mut self) {
        self.shared
            .with(|state, _| state.text_senders.remove(&self.id));
    }
}

/// Cancels an open that did not complete: its place in the queue, or its channel, goes.
struct OpenGuard<'a> {
    shared: &'a Shared,
    ticket: OpenTicket,
    taken: bool,
}

impl Drop for OpenGuard<'_> {
    fn drop(&mut self) {
        if !self.taken {
            self.shared.with(|state, now| {
                state.opens.remove(&self.ticket);
                state.link.cancel_open(now, self.ticket);
            });
        }
    }
}

/// Incoming text messages (wire frames), in order. Ends when the link closes.
///
/// While the application does not take them, at most the text receive buffer (1 MiB by default)
/// is held; past that the driver stops reading the socket until there is room. Dropping the
/// receiver drops later text on arrival.
pub struct TextReceiver {
    shared: Arc<Shared>,
}

impl fmt::Debug for TextReceiver {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TextReceiver").finish_non_exhaustive()
    }
}

impl TextReceiver {
    pub(crate) fn new(shared: Arc<Shared>) -> Self {
        Self { shared }
    }

    /// The next text message, or `None` once the link closed and every message was taken.
    pub async fn recv(&mut self) -> Option<String> {
        futures::future::poll_fn(|cx| Pin::new(&mut *self).poll_next(cx)).await
    }
}

impl Stream for TextReceiver {
    type Item = String;

    fn poll_next(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<String>> {
        self.shared.with(|state, _| {
            if let Some(text) = state.inbox.pop_front() {
                state.inbox_bytes -= text.len();
                return Poll::Ready(Some(text));
            }
            if state.link.close_reason().is_some() {
                return Poll::Ready(None);
            }
            state.text_reader = Some(cx.waker().clone());
            Poll::Pending
        })
    }
}

impl Drop for TextReceiver {
    fn drop(&mut self) {
        self.shared.with(|state, _| {
            state.text_receiver_alive = false;
            state.text_reader = None;
            state.inbox.clear();
            state.inbox_bytes = 0;
        });
    }
}
