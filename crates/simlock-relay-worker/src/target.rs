//! Relay targets: the [`RelayTarget`] trait a worker module implements, the [`RelayTargets`]
//! registry the composition fills by capability name, and the bodies a target sees.

use std::collections::BTreeMap;
use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll, Waker};

use bytes::Bytes;
use futures::future::BoxFuture;
use futures::{FutureExt, Stream};
use http_body::{Body, Frame, SizeHint};
use http_body_util::{BodyExt, Empty, Full, StreamBody};
use parking_lot::Mutex;
use simlock_contract::bounds;
use simlock_link::{ChannelError, ChannelReader, FailureReason};
use tokio_util::sync::CancellationToken;

/// An error a target or a body may carry: the daemon's one error box.
pub use simlock_daemon::http::body::BoxError;

/// The body of a target's response: any body of [`Bytes`], boxed (the daemon's HTTP body, so
/// nothing is copied between them).
pub type ResponseBody = simlock_daemon::http::body::Body;

/// One relayed exchange, as a target receives it.
#[derive(Debug)]
pub struct RelayRequest {
    /// The request: method, absolute URL, filtered headers, and a body that streams from the
    /// relay's channel as the target reads it.
    pub request: http::Request<RequestBody>,
    /// Whose the exchange is, on this worker.
    pub tenant: String,
    /// The lease the exchange is for, when the gateway named one.
    pub lease_id: Option<String>,
    /// Fires when the exchange is cancelled: `relay.cancel`, the uplink closing, the deadline on
    /// the gateway, or any failure of the relay. A target stops its work when it fires.
    pub cancel: CancellationToken,
}

/// A module on the worker that answers relayed HTTP exchanges, registered under a capability
/// name. Closures `Fn(RelayRequest) -> impl Future<Output = Result<Response, BoxError>>`
/// implement it.
pub trait RelayTarget: Send + Sync + 'static {
    /// Answers one exchange. An error fails the relay with `INTERNAL` (its message is logged).
    /// Once the target answered, the unread rest of the request body is stopped.
    fn call(
        &self,
        request: RelayRequest,
    ) -> BoxFuture<'static, Result<http::Response<ResponseBody>, BoxError>>;
}

impl<F, Fut> RelayTarget for F
where
    F: Fn(RelayRequest) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = Result<http::Response<ResponseBody>, BoxError>> + Send + 'static,
{
    fn call(
        &self,
        request: RelayRequest,
    ) -> BoxFuture<'static, Result<http::Response<ResponseBody>, BoxError>> {
        self(request).boxed()
    }
}

/// A target name that is not a capability name (`^[a-z][a-z0-9-]{0,63}$`).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("relay target name {0:?} is not a capability name (^[a-z][a-z0-9-]{{0,63}}$)")]
pub struct InvalidTargetName(pub String);

/// The relay targets of one worker, by capability name. The composition builds it and hands it
/// to [`crate::register`]; nothing else names a target.
#[derive(Clone, Default)]
pub struct RelayTargets {
    by_name: BTreeMap<String, Arc<dyn RelayTarget>>,
}

impl fmt::Debug for RelayTargets {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_set().entries(self.by_name.keys()).finish()
    }
}

impl RelayTargets {
    /// No targets.
    pub fn new() -> Self {
        Self::default()
    }

    /// Registers `target` under `name`, replacing any target of that name.
    ///
    /// # Errors
    /// [`InvalidTargetName`] when `name` is not a capability name.
    pub fn insert(
        &mut self,
        name: impl Into<String>,
        target: Arc<dyn RelayTarget>,
    ) -> Result<&mut Self, InvalidTargetName> {
        let name = name.into();
        if !bounds::is_capability_name(&name) {
            return Err(InvalidTargetName(name));
        }
        self.by_name.insert(name, target);
        Ok(self)
    }

    /// The target registered under `name`.
    pub fn get(&self, name: &str) -> Option<Arc<dyn RelayTarget>> {
        self.by_name.get(name).cloned()
    }

    /// The registered names, sorted.
    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.by_name.keys().map(String::as_str)
    }

    /// How many targets are registered.
    pub fn len(&self) -> usize {
        self.by_name.len()
    }

    /// Whether no target is registered.
    pub fn is_empty(&self) -> bool {
        self.by_name.is_empty()
    }
}

/// A response body holding `bytes`.
pub fn full_body(bytes: impl Into<Bytes>) -> ResponseBody {
    Full::new(bytes.into())
        .map_err(|never| match never {})
        .boxed_unsync()
}

/// An empty response body.
pub fn empty_body() -> ResponseBody {
    Empty::new().map_err(|never| match never {}).boxed_unsync()
}

/// A response body streamed from `chunks`; an error ends it failed.
pub fn stream_body<S, E>(chunks: S) -> ResponseBody
where
    S: Stream<Item = Result<Bytes, E>> + Send + 'static,
    E: Into<BoxError> + 'static,
{
    use futures::TryStreamExt;
    StreamBody::new(chunks.map_ok(Frame::data).map_err(Into::into)).boxed_unsync()
}

/// The request direction of a relay's channel, shared by the target's body and the relay, which
/// stops it once the target has answered.
#[derive(Debug)]
pub(crate) struct RequestSlot {
    reader: Option<ChannelReader>,
    ended: bool,
    waiter: Option<Waker>,
}

impl RequestSlot {
    pub(crate) fn new(reader: ChannelReader) -> Arc<Mutex<Self>> {
        Arc::new(Mutex::new(Self {
            reader: Some(reader),
            ended: false,
            waiter: None,
        }))
    }

    /// Stops the direction: STOP goes for any unread rest (nothing when it was read to its end),
    /// and a body still waiting on it wakes to an error.
    pub(crate) fn stop(slot: &Mutex<Self>) {
        let (reader, waiter) = {
            let mut slot = slot.lock();
            (slot.reader.take(), slot.waiter.take())
        };
        drop(reader);
        if let Some(waiter) = waiter {
            waiter.wake();
        }
    }
}

/// The body of a relayed request: the channel's request direction, pulled as the target reads.
/// Its error is the channel's failure (`stopped` when read after the target answered).
#[derive(Debug)]
pub struct RequestBody {
    slot: Option<Arc<Mutex<RequestSlot>>>,
}

impl RequestBody {
    /// A body with nothing in it (a relay with `hasBody: false`).
    pub fn empty() -> Self {
        Self { slot: None }
    }

    pub(crate) fn channel(slot: Arc<Mutex<RequestSlot>>) -> Self {
        Self { slot: Some(slot) }
    }
}

impl Body for RequestBody {
    type Data = Bytes;
    type Error = ChannelError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, ChannelError>>> {
        let Some(slot) = &self.slot else {
            return Poll::Ready(None);
        };
        // The channel reader takes part in the task's tokio budget.
        let mut slot = slot.lock();
        if slot.ended {
            return Poll::Ready(None);
        }
        let Some(reader) = slot.reader.as_mut() else {
            slot.ended = true;
            return Poll::Ready(Some(Err(ChannelError::new(FailureReason::Stopped))));
        };
        match Pin::new(reader).poll_next(cx) {
            Poll::Ready(Some(Ok(bytes))) => Poll::Ready(Some(Ok(Frame::data(bytes)))),
            Poll::Ready(Some(Err(error))) => {
                slot.ended = true;
                Poll::Ready(Some(Err(error)))
            }
            Poll::Ready(None) => {
                slot.ended = true;
                Poll::Ready(None)
            }
            Poll::Pending => {
                slot.waiter = Some(cx.waker().clone());
                Poll::Pending
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.slot.as_ref().is_none_or(|slot| slot.lock().ended)
    }

    fn size_hint(&self) -> SizeHint {
        if self.slot.is_none() {
            SizeHint::with_exact(0)
        } else {
            SizeHint::default()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_must_be_capability_names() {
        let mut targets = RelayTargets::new();
        let target: Arc<dyn RelayTarget> =
            Arc::new(|_: RelayRequest| async { Ok(http::Response::new(empty_body())) });
        assert!(targets.insert("agent-device", target.clone()).is_ok());
        assert!(targets.insert("Agent", target.clone()).is_err());
        assert!(targets.insert("", target).is_err());
        assert_eq!(targets.names().collect::<Vec<_>>(), ["agent-device"]);
        assert!(targets.get("agent-device").is_some());
        assert!(targets.get("other").is_none());
    }

    #[test]
    fn an_empty_request_body_ends_at_once() {
        let body = RequestBody::empty();
        assert!(body.is_end_stream());
        assert_eq!(body.size_hint().exact(), Some(0));
    }
}
