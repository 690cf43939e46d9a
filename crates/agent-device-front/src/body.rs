//! The one body type of the edge, and bodies that hold something alive while they stream.

use std::convert::Infallible;
use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::Bytes;
use http_body::{Frame, SizeHint};
use http_body_util::{BodyExt, Full};

/// Every body the edge passes on: requests to a host link, responses to the caller. It is the
/// daemon's HTTP body and the relay's body, so nothing is copied between them.
pub use simlock_daemon::http::body::Body;
/// An error a body may carry: the daemon's one error box.
pub use simlock_daemon::http::body::BoxError;

/// A body holding `bytes`.
pub fn full(bytes: impl Into<Bytes>) -> Body {
    Full::new(bytes.into())
        .map_err(|never: Infallible| match never {})
        .boxed_unsync()
}

/// An empty body.
pub fn empty() -> Body {
    full(Bytes::new())
}

/// Reads a whole body of at most `limit` bytes.
///
/// # Errors
/// [`ReadError::TooLarge`] past `limit`; [`ReadError::Body`] when the body fails.
pub async fn read_to_bytes(mut body: Body, limit: usize) -> Result<Bytes, ReadError> {
    let mut out = bytes::BytesMut::new();
    while let Some(frame) = body.frame().await {
        let frame = frame.map_err(|e| ReadError::Body(e.to_string()))?;
        if let Ok(data) = frame.into_data() {
            if out.len() + data.len() > limit {
                return Err(ReadError::TooLarge(limit));
            }
            out.extend_from_slice(&data);
        }
    }
    Ok(out.freeze())
}

/// Why a body could not be read whole.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ReadError {
    /// Past its bound.
    #[error("body is larger than {0} bytes")]
    TooLarge(usize),
    /// The body failed.
    #[error("body failed: {0}")]
    Body(String),
}

/// A body that keeps `guard` alive until it ends or is dropped (a lease renewal that lasts as
/// long as a command's answer streams).
pub struct Guarded<G> {
    inner: Body,
    guard: Option<G>,
}

impl<G> Guarded<G> {
    /// `inner`, holding `guard`.
    pub const fn new(inner: Body, guard: G) -> Self {
        Self {
            inner,
            guard: Some(guard),
        }
    }
}

impl<G: Unpin> http_body::Body for Guarded<G> {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let this = self.get_mut();
        let polled = Pin::new(&mut this.inner).poll_frame(cx);
        if matches!(polled, Poll::Ready(None | Some(Err(_)))) {
            this.guard = None;
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}
