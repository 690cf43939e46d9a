//! The one body type of the edge, and bodies that hold something alive while they stream.

use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::Bytes;
use http_body::{Frame, SizeHint};
use http_body_util::BodyExt;

/// Every body the edge passes on: requests to a host link, responses to the caller. It is the
/// daemon's HTTP body and the relay's body, so nothing is copied between them.
pub use simlock_daemon::http::body::Body;
/// An error a body may carry: the daemon's one error box.
pub use simlock_daemon::http::body::BoxError;

/// A body holding its bytes, an empty one and a JSON response: the daemon's.
pub use simlock_daemon::http::body::{empty, full, json};

/// Reads a whole body of at most `limit` bytes.
///
/// # Errors
/// [`ReadError::TooLarge`] past `limit`; [`ReadError::Body`] when the body fails.
///
/// (Not `http_body_util::Limited` + `collect`: that future is not `Send` for every lifetime
/// with this body type, and the front's futures must be.)
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

impl ReadError {
    /// The refusal the front and the host answer for it: past a bound, or a body that failed
    /// (as agent-device answers a body it cannot read, `-32700`).
    pub fn refusal(&self) -> crate::Refusal {
        match self {
            Self::TooLarge(limit) => crate::Refusal::BodyTooLarge(*limit),
            Self::Body(message) => crate::Refusal::Invalid {
                rpc_code: -32700,
                message: message.clone(),
            },
        }
    }
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

/// A body that hands on together the data frames that are ready at once, up to `max` bytes: a
/// stream of small frames (the link's 16 KiB parts, a socket's short reads) reaches its reader
/// as fewer, larger ones, and a reader that pays per frame (a Node daemon parsing a chunked
/// upload) pays less. It never waits for more: what is ready goes at once. A frame that is not
/// data (trailers) and an error come after the data before them.
pub struct Coalesced {
    inner: Body,
    max: usize,
    /// What comes after the data handed on last.
    held: Option<Result<Frame<Bytes>, BoxError>>,
}

impl Coalesced {
    /// `inner`, its ready frames joined up to `max` bytes.
    pub fn new(inner: Body, max: usize) -> Self {
        Self {
            inner,
            max: max.max(1),
            held: None,
        }
    }
}

impl http_body::Body for Coalesced {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let this = self.get_mut();
        if let Some(held) = this.held.take() {
            return Poll::Ready(Some(held));
        }
        let mut first: Option<Bytes> = None;
        let mut joined: Option<bytes::BytesMut> = None;
        let ready = |first: Option<Bytes>, joined: Option<bytes::BytesMut>| {
            joined
                .map(bytes::BytesMut::freeze)
                .or(first)
                .map(|data| Ok(Frame::data(data)))
        };
        loop {
            let length = joined.as_ref().map_or_else(
                || first.as_ref().map_or(0, Bytes::len),
                bytes::BytesMut::len,
            );
            if length >= this.max {
                return Poll::Ready(ready(first, joined));
            }
            match Pin::new(&mut this.inner).poll_frame(cx) {
                Poll::Ready(Some(Ok(frame))) => match frame.into_data() {
                    Ok(data) if data.is_empty() => {}
                    Ok(data) => match (&mut joined, first.take()) {
                        (Some(buffer), _) => buffer.extend_from_slice(&data),
                        (None, None) => first = Some(data),
                        (None, Some(before)) => {
                            let mut buffer = bytes::BytesMut::with_capacity(this.max);
                            buffer.extend_from_slice(&before);
                            buffer.extend_from_slice(&data);
                            joined = Some(buffer);
                        }
                    },
                    Err(other) => {
                        if length == 0 {
                            return Poll::Ready(Some(Ok(other)));
                        }
                        this.held = Some(Ok(other));
                        return Poll::Ready(ready(first, joined));
                    }
                },
                Poll::Ready(Some(Err(e))) => {
                    if length == 0 {
                        return Poll::Ready(Some(Err(e)));
                    }
                    this.held = Some(Err(e));
                    return Poll::Ready(ready(first, joined));
                }
                Poll::Ready(None) => return Poll::Ready(ready(first, joined)),
                Poll::Pending if length == 0 => return Poll::Pending,
                Poll::Pending => return Poll::Ready(ready(first, joined)),
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.held.is_none() && self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

#[cfg(test)]
mod tests {
    use std::collections::VecDeque;

    use super::*;

    /// A body whose frames come as scripted: `None` is a moment with nothing ready.
    struct Script(VecDeque<Option<Result<Frame<Bytes>, BoxError>>>);

    impl http_body::Body for Script {
        type Data = Bytes;
        type Error = BoxError;

        fn poll_frame(
            self: Pin<&mut Self>,
            cx: &mut Context<'_>,
        ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
            match self.get_mut().0.pop_front() {
                Some(Some(frame)) => Poll::Ready(Some(frame)),
                Some(None) => {
                    cx.waker().wake_by_ref();
                    Poll::Pending
                }
                None => Poll::Ready(None),
            }
        }
    }

    fn data(text: &str) -> Option<Result<Frame<Bytes>, BoxError>> {
        Some(Ok(Frame::data(Bytes::copy_from_slice(text.as_bytes()))))
    }

    /// What a reader of `script` coalesced to `max` sees, frame by frame.
    async fn seen(script: Vec<Option<Result<Frame<Bytes>, BoxError>>>, max: usize) -> Vec<String> {
        let mut body = Coalesced::new(Script(script.into()).boxed_unsync(), max);
        let mut out = Vec::new();
        while let Some(frame) = body.frame().await {
            out.push(match frame {
                Ok(frame) => match frame.into_data() {
                    Ok(data) => String::from_utf8_lossy(&data).into_owned(),
                    Err(frame) => {
                        format!("trailers {}", frame.trailers_ref().map_or(0, |t| t.len()))
                    }
                },
                Err(e) => format!("error {e}"),
            });
        }
        out
    }

    #[tokio::test]
    async fn a_body_at_its_bound_is_read_and_one_byte_more_is_too_large() {
        let script = |n: usize| Script(vec![data(&"a".repeat(n - 1)), data("b")].into());
        let read = read_to_bytes(script(8).boxed_unsync(), 8).await.unwrap();
        assert_eq!(read.len(), 8);
        assert_eq!(
            read_to_bytes(script(9).boxed_unsync(), 8).await,
            Err(ReadError::TooLarge(8))
        );
        let failing = Script(vec![data("ab"), Some(Err("cut".into()))].into());
        assert_eq!(
            read_to_bytes(failing.boxed_unsync(), 8).await,
            Err(ReadError::Body("cut".into()))
        );
    }

    #[tokio::test]
    async fn ready_frames_join_up_to_the_bound_and_nothing_waits_for_more() {
        let script = vec![
            data("ab"),
            data("cd"),
            data("ef"),
            None,
            data("gh"),
            None,
            data("ij"),
        ];
        assert_eq!(seen(script, 4).await, ["abcd", "ef", "gh", "ij"]);
        let one_big = vec![data("abcdefgh"), data("ij")];
        assert_eq!(seen(one_big, 4).await, ["abcdefgh", "ij"], "never split");
    }

    #[tokio::test]
    async fn trailers_and_errors_come_after_the_data_before_them() {
        let mut trailers = http::HeaderMap::new();
        trailers.insert("x-done", http::HeaderValue::from_static("1"));
        let script = vec![data("ab"), data("cd"), Some(Ok(Frame::trailers(trailers)))];
        assert_eq!(seen(script, 64).await, ["abcd", "trailers 1"]);
        let failing = vec![data("ab"), Some(Err("cut".into())), data("never")];
        assert_eq!(seen(failing, 64).await, ["ab", "error cut", "never"]);
    }
}
