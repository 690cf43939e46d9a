//! The one body type of the edge, and bodies that hold something alive while they stream.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use tokio::time::Sleep;
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
    let mut out = BytesMut::new();
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

/// A body that hands on its data frames joined into larger ones, up to `max` bytes: a stream of
/// small frames (the link's 16 KiB parts, the parts a socket's reads cut a chunk into) reaches
/// its reader as fewer, larger ones, and a reader that pays per frame (a Node daemon parsing a
/// chunked upload pays about twice per byte for 64 KiB chunks what it pays for 256 KiB ones)
/// pays less. What is ready goes at once when it fills `max`; short of that, it waits for more
/// at most `linger` from the moment nothing more was ready. A frame that
/// is not data (trailers) and an error come after the data before them.
pub struct Coalesced {
    inner: Body,
    max: usize,
    linger: Duration,
    /// The data gathered and not handed on yet.
    gathered: Gathered,
    /// Running while gathered data waits for more.
    timer: Option<Pin<Box<Sleep>>>,
    /// What comes after the gathered data.
    held: Option<Result<Frame<Bytes>, BoxError>>,
    /// The inner body has ended.
    ended: bool,
}

/// Data gathered: nothing, one frame as it came, or frames joined (copied) into one buffer.
enum Gathered {
    Empty,
    One(Bytes),
    Joined(BytesMut),
}

impl Gathered {
    fn len(&self) -> usize {
        match self {
            Self::Empty => 0,
            Self::One(data) => data.len(),
            Self::Joined(buffer) => buffer.len(),
        }
    }

    fn push(&mut self, data: Bytes, max: usize) {
        *self = match std::mem::replace(self, Self::Empty) {
            Self::Empty => Self::One(data),
            Self::One(before) => {
                let mut buffer = BytesMut::with_capacity(max.max(before.len() + data.len()));
                buffer.extend_from_slice(&before);
                buffer.extend_from_slice(&data);
                Self::Joined(buffer)
            }
            Self::Joined(mut buffer) => {
                buffer.extend_from_slice(&data);
                Self::Joined(buffer)
            }
        };
    }

    fn take(&mut self) -> Option<Bytes> {
        match std::mem::replace(self, Self::Empty) {
            Self::Empty => None,
            Self::One(data) => Some(data),
            Self::Joined(buffer) => Some(buffer.freeze()),
        }
    }
}

impl Coalesced {
    /// `inner`, its frames joined up to `max` bytes, waiting up to `linger` for more while it
    /// holds less (`Duration::ZERO`: only what is ready at once is joined).
    pub fn new(inner: Body, max: usize, linger: Duration) -> Self {
        Self {
            inner,
            max: max.max(1),
            linger,
            gathered: Gathered::Empty,
            timer: None,
            held: None,
            ended: false,
        }
    }

    /// Hands on what was gathered (there is some).
    fn flush(&mut self) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        self.timer = None;
        Poll::Ready(self.gathered.take().map(|data| Ok(Frame::data(data))))
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
        if this.gathered.len() == 0
            && let Some(held) = this.held.take()
        {
            return Poll::Ready(Some(held));
        }
        loop {
            if this.gathered.len() >= this.max {
                return this.flush();
            }
            if this.ended {
                return this.flush();
            }
            match Pin::new(&mut this.inner).poll_frame(cx) {
                Poll::Ready(Some(Ok(frame))) => match frame.into_data() {
                    Ok(data) if data.is_empty() => {}
                    Ok(data) => this.gathered.push(data, this.max),
                    Err(other) => {
                        if this.gathered.len() == 0 {
                            return Poll::Ready(Some(Ok(other)));
                        }
                        this.held = Some(Ok(other));
                        return this.flush();
                    }
                },
                Poll::Ready(Some(Err(e))) => {
                    if this.gathered.len() == 0 {
                        return Poll::Ready(Some(Err(e)));
                    }
                    this.held = Some(Err(e));
                    return this.flush();
                }
                Poll::Ready(None) => {
                    this.ended = true;
                    return this.flush();
                }
                Poll::Pending if this.gathered.len() == 0 => return Poll::Pending,
                Poll::Pending if this.linger.is_zero() => return this.flush(),
                Poll::Pending => {
                    let linger = this.linger;
                    let timer = this
                        .timer
                        .get_or_insert_with(|| Box::pin(tokio::time::sleep(linger)));
                    return match timer.as_mut().poll(cx) {
                        Poll::Ready(()) => this.flush(),
                        Poll::Pending => Poll::Pending,
                    };
                }
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.held.is_none()
            && self.gathered.len() == 0
            && (self.ended || self.inner.is_end_stream())
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
        let mut body = Coalesced::new(Script(script.into()).boxed_unsync(), max, Duration::ZERO);
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

    /// A body fed frame by frame from the test, and the sender that feeds it.
    fn fed() -> (
        futures::channel::mpsc::UnboundedSender<Result<Frame<Bytes>, BoxError>>,
        Body,
    ) {
        let (tx, rx) = futures::channel::mpsc::unbounded();
        (tx, http_body_util::StreamBody::new(rx).boxed_unsync())
    }

    fn frame(text: &str) -> Result<Frame<Bytes>, BoxError> {
        Ok(Frame::data(Bytes::copy_from_slice(text.as_bytes())))
    }

    /// The next frame's data as text, if one comes within `within` (paused clock).
    async fn next_within(body: &mut Coalesced, within: Duration) -> Option<String> {
        let next = tokio::time::timeout(within, body.frame()).await.ok()??;
        Some(String::from_utf8_lossy(&next.ok()?.into_data().ok()?).into_owned())
    }

    #[tokio::test(start_paused = true)]
    async fn a_lingering_body_waits_for_more_up_to_its_linger_then_hands_on_what_it_has() {
        let linger = Duration::from_millis(2);
        let (tx, inner) = fed();
        let mut body = Coalesced::new(inner, 6, linger);
        tx.unbounded_send(frame("ab")).unwrap();
        // Nothing more is ready: "ab" waits, and is handed on once the linger has passed.
        let started = tokio::time::Instant::now();
        assert_eq!(
            next_within(&mut body, linger * 10).await.as_deref(),
            Some("ab")
        );
        assert_eq!(started.elapsed(), linger, "held exactly its linger");
        // More that comes within the linger joins it, up to the bound, which goes at once.
        tx.unbounded_send(frame("cd")).unwrap();
        let feeder = {
            let tx = tx.clone();
            tokio::spawn(async move {
                tokio::time::sleep(linger / 2).await;
                tx.unbounded_send(frame("ef")).unwrap();
                tx.unbounded_send(frame("gh")).unwrap();
            })
        };
        let started = tokio::time::Instant::now();
        assert_eq!(
            next_within(&mut body, linger * 10).await.as_deref(),
            Some("cdefgh")
        );
        assert_eq!(started.elapsed(), linger / 2, "full: no more waiting");
        feeder.await.unwrap();
        // The end hands on what is held at once, and then ends.
        tx.unbounded_send(frame("ij")).unwrap();
        drop(tx);
        let started = tokio::time::Instant::now();
        assert_eq!(
            next_within(&mut body, linger * 10).await.as_deref(),
            Some("ij")
        );
        assert_eq!(started.elapsed(), Duration::ZERO);
        assert!(body.frame().await.is_none());
        assert!(http_body::Body::is_end_stream(&body));
    }

    #[tokio::test(start_paused = true)]
    async fn a_lingering_body_hands_on_its_data_before_an_error_or_trailers_without_waiting() {
        let linger = Duration::from_secs(60);
        let (tx, inner) = fed();
        let mut body = Coalesced::new(inner, 64, linger);
        tx.unbounded_send(frame("ab")).unwrap();
        tx.unbounded_send(Err("cut".into())).unwrap();
        let started = tokio::time::Instant::now();
        assert_eq!(next_within(&mut body, linger).await.as_deref(), Some("ab"));
        let after = body.frame().await.unwrap();
        assert_eq!(after.unwrap_err().to_string(), "cut");
        assert_eq!(started.elapsed(), Duration::ZERO, "an error is not held");

        let (tx, inner) = fed();
        let mut body = Coalesced::new(inner, 64, linger);
        let mut trailers = http::HeaderMap::new();
        trailers.insert("x-done", http::HeaderValue::from_static("1"));
        tx.unbounded_send(frame("cd")).unwrap();
        tx.unbounded_send(Ok(Frame::trailers(trailers))).unwrap();
        assert_eq!(next_within(&mut body, linger).await.as_deref(), Some("cd"));
        let after = body.frame().await.unwrap().unwrap();
        assert!(after.is_trailers());
        assert_eq!(started.elapsed(), Duration::ZERO, "trailers are not held");
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
