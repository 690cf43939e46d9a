//! The one body type of the edge, and bodies that hold something alive while they stream.

use std::collections::VecDeque;
use std::future::Future;
use std::io::IoSlice;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::{Buf, Bytes, BytesMut};
use http_body::{Frame, SizeHint};
use http_body_util::BodyExt;
use tokio::time::Sleep;

/// Every body the edge passes on: requests to a host link, responses to the caller. It is the
/// daemon's HTTP body and the relay's body, so nothing is copied between them.
pub use simlock_daemon::http::body::Body;
/// An error a body may carry: the daemon's one error box.
pub use simlock_daemon::http::body::BoxError;

/// A body holding its bytes, an empty one and a JSON response: the daemon's.
pub use simlock_daemon::http::body::{empty, full, json};

/// Reads a whole body of at most `limit` bytes, with no time bound (a daemon's answer), as
/// [`read_upto`](simlock_daemon::http::body::read_upto) reads it.
///
/// # Errors
/// [`ReadError::TooLarge`] past `limit`; [`ReadError::Body`] when the body fails.
pub async fn read_to_bytes(mut body: Body, limit: usize) -> Result<Bytes, ReadError> {
    Ok(simlock_daemon::http::body::read_upto(&mut body, limit).await?)
}

/// Reads a caller's request body whole, at most `limit` bytes, as the daemon reads its own
/// ([`read_limited`](simlock_daemon::http::body::read_limited)): within
/// [`BODY_READ_TIMEOUT`](simlock_daemon::http::body::BODY_READ_TIMEOUT), so a caller that
/// promises a body and stops sending is answered then and holds nothing longer; a body past
/// `limit` read on and dropped up to a bound, so its caller reads the refusal.
///
/// # Errors
/// [`ReadError`], [`ReadError::Stalled`] past the time bound.
pub async fn read_caller_body(body: Body, limit: usize) -> Result<Bytes, ReadError> {
    Ok(simlock_daemon::http::body::read_limited(body, limit).await?)
}

impl From<simlock_daemon::http::body::BodyError> for ReadError {
    fn from(error: simlock_daemon::http::body::BodyError) -> Self {
        use simlock_daemon::http::body::BodyError;
        match error {
            BodyError::TooLarge(limit) => Self::TooLarge(limit),
            BodyError::Stalled => Self::Stalled,
            BodyError::Failed(message) => Self::Body(message),
        }
    }
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
            Self::Stalled => crate::Refusal::Invalid {
                rpc_code: -32600,
                message: self.to_string(),
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
    /// Not whole within [`BODY_READ_TIMEOUT`](simlock_daemon::http::body::BODY_READ_TIMEOUT).
    #[error(
        "request body not received within {} s",
        simlock_daemon::http::body::BODY_READ_TIMEOUT.as_secs()
    )]
    Stalled,
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

/// What opens the last line of a progress stream (agent-device's own serialisation).
const RESPONSE_LINE: &[u8] = b"{\"type\":\"response\"";

/// A progress stream (`application/x-ndjson`: progress lines, then one `{"type":"response",…}`
/// line) passed on as it comes. When it fails or ends before its response line (its host lost:
/// a daemon stopping, an uplink down, agent-device killed), the stream is finished here with a
/// response line of `cut`'s making, given why, so the CLI reads an error it can print instead
/// of a broken stream.
pub struct ProgressTail<F> {
    inner: Body,
    /// Ends the stream early, finished as if cut: the daemon stopping.
    stop: Option<Pin<Box<tokio_util::sync::WaitForCancellationFutureOwned>>>,
    /// The first bytes of the line being read, up to the length of [`RESPONSE_LINE`]: empty
    /// at the start of a line.
    head: Vec<u8>,
    /// Whether the response line passed whole.
    answered: bool,
    /// Makes the last line; taken when the stream ends, which it has once this is `None`.
    cut: Option<F>,
}

impl<F: FnOnce(&str) -> Bytes> ProgressTail<F> {
    /// `inner`, finished by `cut` if it needs to be.
    pub const fn new(inner: Body, cut: F) -> Self {
        Self {
            inner,
            stop: None,
            head: Vec::new(),
            answered: false,
            cut: Some(cut),
        }
    }

    /// Also finishes the stream when `stop` fires, before the stream itself ends.
    #[must_use]
    pub fn until(mut self, stop: tokio_util::sync::CancellationToken) -> Self {
        self.stop = Some(Box::pin(stop.cancelled_owned()));
        self
    }

    fn see(&mut self, mut data: &[u8]) {
        while !data.is_empty() {
            let (line, rest, complete) = match data.iter().position(|b| *b == b'\n') {
                Some(at) => (&data[..at], &data[at + 1..], true),
                None => (data, &[][..], false),
            };
            let room = RESPONSE_LINE.len().saturating_sub(self.head.len());
            self.head.extend_from_slice(&line[..line.len().min(room)]);
            if complete {
                self.answered |= self.head.as_slice() == RESPONSE_LINE;
                self.head.clear();
            }
            data = rest;
        }
    }

    /// The stream's last bytes when it was cut before its answer.
    fn finish(&mut self, why: &str) -> Option<Bytes> {
        let cut = self.cut.take()?;
        if self.answered {
            return None;
        }
        let line = cut(why);
        let mut out = BytesMut::with_capacity(line.len() + 1);
        if !self.head.is_empty() {
            // Cut inside a line: the made one starts on a line of its own.
            out.extend_from_slice(b"\n");
        }
        out.extend_from_slice(&line);
        Some(out.freeze())
    }
}

impl<F: FnOnce(&str) -> Bytes + Unpin> http_body::Body for ProgressTail<F> {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let this = self.get_mut();
        if this.cut.is_none() {
            return Poll::Ready(None);
        }
        let why = match Pin::new(&mut this.inner).poll_frame(cx) {
            Poll::Pending => match this.stop.as_mut().map(|stop| stop.as_mut().poll(cx)) {
                Some(Poll::Ready(())) => "this daemon is stopping".to_owned(),
                _ => return Poll::Pending,
            },
            Poll::Ready(Some(Ok(frame))) => {
                if let Some(data) = frame.data_ref() {
                    this.see(data);
                }
                return Poll::Ready(Some(Ok(frame)));
            }
            Poll::Ready(Some(Err(e))) => e.to_string(),
            Poll::Ready(None) => "the stream ended without its response".to_owned(),
        };
        Poll::Ready(this.finish(&why).map(|last| Ok(Frame::data(last))))
    }

    fn is_end_stream(&self) -> bool {
        self.cut.is_none()
    }

    fn size_hint(&self) -> SizeHint {
        // Perhaps a line more than the stream's own.
        SizeHint::default()
    }
}

/// The size from which a frame [`Coalesced`] gathers is kept as it came instead of copied.
pub const KEEP_AS_IS: usize = 64 * 1024;

/// The body of a request the host sends on to its daemon: frames of [`Parts`].
pub type Upstream = http_body_util::combinators::UnsyncBoxBody<Parts, BoxError>;

/// `body` as an [`Upstream`] body, each frame one part.
pub fn upstream(body: Body) -> Upstream {
    body.map_frame(|frame| frame.map_data(Parts::from))
        .boxed_unsync()
}

/// Byte slices sent on as one frame without being copied together: the HTTP client writes
/// them with one vectored write (a chunked upload's chunk is one `size`, these parts, one CRLF).
/// A body's frames are kept as they came when they are large; small ones are copied into one
/// part, which costs less than keeping each (a kept slice also keeps the buffer it was read
/// into, and a link's 16 KiB parts would pin its read buffers until the write).
#[derive(Debug, Default)]
pub struct Parts {
    parts: VecDeque<Bytes>,
    len: usize,
}

impl Parts {
    fn push(&mut self, data: Bytes) {
        self.len += data.len();
        self.parts.push_back(data);
    }
}

impl From<Bytes> for Parts {
    fn from(data: Bytes) -> Self {
        let mut parts = Self::default();
        if !data.is_empty() {
            parts.push(data);
        }
        parts
    }
}

impl Buf for Parts {
    fn remaining(&self) -> usize {
        self.len
    }

    fn chunk(&self) -> &[u8] {
        self.parts.front().map_or(&[], |part| &part[..])
    }

    fn advance(&mut self, mut cnt: usize) {
        assert!(cnt <= self.len, "advanced past the end of the parts");
        self.len -= cnt;
        while cnt > 0 {
            let Some(front) = self.parts.front_mut() else {
                break;
            };
            if cnt < front.len() {
                front.advance(cnt);
                break;
            }
            cnt -= front.len();
            self.parts.pop_front();
        }
    }

    fn chunks_vectored<'a>(&'a self, dst: &mut [IoSlice<'a>]) -> usize {
        let mut filled = 0;
        for (slot, part) in dst.iter_mut().zip(&self.parts) {
            *slot = IoSlice::new(part);
            filled += 1;
        }
        filled
    }
}

/// A body that hands on its data frames gathered into larger ones, up to `max` bytes: a stream
/// of small frames (the link's 16 KiB parts, the parts a socket's reads cut a chunk into)
/// reaches its reader as fewer, larger ones, and a reader that pays per frame (a Node daemon
/// parsing a chunked upload pays about twice per byte for 16 KiB chunks what it pays for
/// 256 KiB ones) pays less. Frames of at least [`KEEP_AS_IS`] bytes are not copied; smaller ones
/// are copied together into one part of the [`Parts`] handed on. What is
/// ready goes at once when it fills `max`; short of that, it waits for more at most `linger`
/// from the moment nothing more was ready. A frame that is not data (trailers) and an error
/// come after the data before them.
pub struct Coalesced {
    inner: Body,
    max: usize,
    linger: Duration,
    /// The data gathered and not handed on yet: `gathered`, then `small`.
    gathered: Parts,
    /// Small frames since the last large one, copied together.
    small: BytesMut,
    /// Running while gathered data waits for more.
    timer: Option<Pin<Box<Sleep>>>,
    /// What comes after the gathered data.
    held: Option<Result<Frame<Parts>, BoxError>>,
    /// The inner body has ended.
    ended: bool,
}

impl Coalesced {
    /// `inner`, its frames gathered up to `max` bytes, waiting up to `linger` for more while it
    /// holds less (`Duration::ZERO`: only what is ready at once is gathered).
    pub fn new(inner: Body, max: usize, linger: Duration) -> Self {
        Self {
            inner,
            max: max.max(1),
            linger,
            gathered: Parts::default(),
            small: BytesMut::new(),
            timer: None,
            held: None,
            ended: false,
        }
    }

    /// Bytes gathered and not handed on yet.
    fn len(&self) -> usize {
        self.gathered.len + self.small.len()
    }

    /// Gathers `data`: kept as it came when large, else copied after the small ones before it.
    fn gather(&mut self, data: Bytes) {
        if data.len() >= KEEP_AS_IS {
            self.seal_small();
            self.gathered.push(data);
        } else {
            if self.small.capacity() - self.small.len() < data.len() {
                // A lone small frame (a JSON body) takes what it needs; once a second one
                // comes, room for the rest of the frame, so the parts are copied once.
                let room = if self.small.is_empty() {
                    data.len()
                } else {
                    data.len().max(self.max.saturating_sub(self.len()))
                };
                self.small.reserve(room);
            }
            self.small.extend_from_slice(&data);
        }
    }

    /// The small frames gathered so far become one part.
    fn seal_small(&mut self) {
        if !self.small.is_empty() {
            let small = self.small.split().freeze();
            self.gathered.push(small);
        }
    }

    /// Hands on what was gathered, if anything.
    fn flush(&mut self) -> Poll<Option<Result<Frame<Parts>, BoxError>>> {
        self.timer = None;
        self.seal_small();
        let gathered = std::mem::take(&mut self.gathered);
        Poll::Ready((gathered.len > 0).then(|| Ok(Frame::data(gathered))))
    }
}

impl http_body::Body for Coalesced {
    type Data = Parts;
    type Error = BoxError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Parts>, BoxError>>> {
        let this = self.get_mut();
        if this.len() == 0
            && let Some(held) = this.held.take()
        {
            return Poll::Ready(Some(held));
        }
        loop {
            if this.len() >= this.max {
                return this.flush();
            }
            if this.ended {
                return this.flush();
            }
            match Pin::new(&mut this.inner).poll_frame(cx) {
                Poll::Ready(Some(Ok(frame))) => match frame.into_data() {
                    Ok(data) if data.is_empty() => {}
                    Ok(data) => this.gather(data),
                    Err(other) => {
                        let other = other.map_data(Parts::from);
                        if this.len() == 0 {
                            return Poll::Ready(Some(Ok(other)));
                        }
                        this.held = Some(Ok(other));
                        return this.flush();
                    }
                },
                Poll::Ready(Some(Err(e))) => {
                    if this.len() == 0 {
                        return Poll::Ready(Some(Err(e)));
                    }
                    this.held = Some(Err(e));
                    return this.flush();
                }
                Poll::Ready(None) => {
                    this.ended = true;
                    return this.flush();
                }
                Poll::Pending if this.len() == 0 => return Poll::Pending,
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
        self.held.is_none() && self.len() == 0 && (self.ended || self.inner.is_end_stream())
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
                    Ok(data) => text(data),
                    Err(frame) => {
                        format!("trailers {}", frame.trailers_ref().map_or(0, |t| t.len()))
                    }
                },
                Err(e) => format!("error {e}"),
            });
        }
        out
    }

    #[tokio::test(start_paused = true)]
    async fn a_callers_body_that_stops_arriving_is_stalled_at_the_daemons_bound() {
        let bound = simlock_daemon::http::body::BODY_READ_TIMEOUT;
        // A body whose sender stays open and sends nothing after its first part.
        let (open, stalled) = fed();
        open.unbounded_send(frame("{")).unwrap();
        let started = tokio::time::Instant::now();
        let read = read_caller_body(stalled, 1024).await;
        drop(open);
        assert_eq!(read, Err(ReadError::Stalled));
        assert_eq!(
            started.elapsed(),
            bound,
            "answered at the bound, not before"
        );
        assert_eq!(
            read.unwrap_err().refusal(),
            crate::Refusal::Invalid {
                rpc_code: -32600,
                message: format!("request body not received within {} s", bound.as_secs()),
            }
        );
        // A body whose last part comes a moment before the bound is read whole.
        let (tx, body) = fed();
        tx.unbounded_send(frame("{")).unwrap();
        let late = send_later(&tx, bound - Duration::from_millis(1), &["}"]);
        drop(tx);
        assert_eq!(
            read_caller_body(body, 1024).await.unwrap(),
            Bytes::from_static(b"{}")
        );
        late.await.unwrap();
    }

    /// A body that declares `0` bytes (its `content-length`) and never sends one.
    struct Declared(u64);

    impl http_body::Body for Declared {
        type Data = Bytes;
        type Error = BoxError;

        fn poll_frame(
            self: Pin<&mut Self>,
            _: &mut Context<'_>,
        ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
            Poll::Pending
        }

        fn size_hint(&self) -> SizeHint {
            SizeHint::with_exact(self.0)
        }
    }

    #[tokio::test(start_paused = true)]
    async fn a_body_declaring_more_than_its_bound_is_refused_before_it_is_read() {
        let start = tokio::time::Instant::now();
        assert_eq!(
            read_caller_body(Declared(9).boxed_unsync(), 8).await,
            Err(ReadError::TooLarge(8))
        );
        assert_eq!(
            start.elapsed(),
            Duration::ZERO,
            "answered at once, not at the time bound"
        );
        // One declaring its bound is waited for, as any body.
        assert_eq!(
            read_caller_body(Declared(8).boxed_unsync(), 8).await,
            Err(ReadError::Stalled)
        );
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
        Some(text(next.ok()?.into_data().ok()?))
    }

    fn text(mut data: Parts) -> String {
        String::from_utf8_lossy(&data.copy_to_bytes(data.remaining())).into_owned()
    }

    #[test]
    fn parts_are_written_as_they_came_and_advance_across_their_bounds() {
        let (a, b, c) = (
            Bytes::from_static(b"abc"),
            Bytes::from_static(b"de"),
            Bytes::from_static(b"fghi"),
        );
        let mut parts = Parts::from(a.clone());
        parts.push(b.clone());
        parts.push(c.clone());
        assert_eq!(Parts::from(Bytes::new()).remaining(), 0, "no empty part");
        let mut slices = [IoSlice::new(&[]); 4];
        assert_eq!(parts.chunks_vectored(&mut slices), 3);
        // The slices are the frames' own bytes: nothing was copied.
        for (slice, part) in slices.iter().zip([&a, &b, &c]) {
            assert_eq!(slice.as_ptr(), part.as_ptr());
            assert_eq!(slice.len(), part.len());
        }
        let mut two = [IoSlice::new(&[]); 2];
        assert_eq!(parts.chunks_vectored(&mut two), 2, "as many as fit");
        assert_eq!(parts.remaining(), 9);
        parts.advance(4);
        assert_eq!(parts.chunk(), b"e");
        assert_eq!(parts.remaining(), 5);
        parts.advance(1);
        assert_eq!(parts.chunk(), b"fghi");
        parts.advance(4);
        assert_eq!((parts.remaining(), parts.chunk()), (0, &b""[..]));
    }

    #[tokio::test]
    async fn small_frames_are_copied_into_one_part_and_large_ones_kept_as_they_came() {
        let large = Bytes::from(vec![7_u8; KEEP_AS_IS]);
        let (tx, inner) = fed();
        let mut body = Coalesced::new(inner, 4 * KEEP_AS_IS, Duration::ZERO);
        for frame in [
            Ok(Frame::data(Bytes::from_static(b"ab"))),
            Ok(Frame::data(Bytes::from_static(b"cd"))),
            Ok(Frame::data(large.clone())),
            Ok(Frame::data(Bytes::from_static(b"ef"))),
        ] {
            tx.unbounded_send(frame).unwrap();
        }
        let parts = body.frame().await.unwrap().unwrap().into_data().unwrap();
        let seen: Vec<&[u8]> = parts.parts.iter().map(|part| &part[..]).collect();
        assert_eq!(seen, [&b"abcd"[..], &large[..], &b"ef"[..]]);
        assert_eq!(parts.parts[1].as_ptr(), large.as_ptr(), "not copied");
        assert_eq!(parts.remaining(), 6 + KEEP_AS_IS);
    }

    #[test]
    fn a_lone_small_frame_takes_the_room_it_needs_and_a_second_the_room_for_the_frame() {
        let max = 1024 * 1024;
        let mut body = Coalesced::new(empty(), max, Duration::ZERO);
        body.gather(Bytes::from_static(b"{\"uploadId\":\"u\"}"));
        assert!(
            body.small.capacity() < KEEP_AS_IS,
            "a JSON body reserves {} bytes",
            body.small.capacity()
        );
        body.gather(Bytes::from_static(b"more"));
        assert!(
            body.small.capacity() >= max - 4,
            "room for the frame at once: {}",
            body.small.capacity()
        );
    }

    /// Sends `texts` as frames on `tx` once `after` has passed.
    fn send_later(
        tx: &futures::channel::mpsc::UnboundedSender<Result<Frame<Bytes>, BoxError>>,
        after: Duration,
        texts: &'static [&'static str],
    ) -> tokio::task::JoinHandle<()> {
        let tx = tx.clone();
        tokio::spawn(async move {
            tokio::time::sleep(after).await;
            for text in texts {
                tx.unbounded_send(frame(text)).unwrap();
            }
        })
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
        let feeder = send_later(&tx, linger / 2, &["ef", "gh"]);
        let started = tokio::time::Instant::now();
        assert_eq!(
            next_within(&mut body, linger * 10).await.as_deref(),
            Some("cdefgh")
        );
        assert_eq!(started.elapsed(), linger / 2, "full: no more waiting");
        feeder.await.unwrap();
        // A frame that comes while it waits, and does not fill it, does not move its deadline:
        // the linger runs from the first wait.
        tx.unbounded_send(frame("k")).unwrap();
        let feeder = send_later(&tx, linger / 2, &["l"]);
        let started = tokio::time::Instant::now();
        assert_eq!(
            next_within(&mut body, linger * 10).await.as_deref(),
            Some("kl")
        );
        assert_eq!(started.elapsed(), linger, "not linger after the last frame");
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

    /// Everything a [`ProgressTail`] over `script` passes on, as text, and how it ended.
    async fn tail_of(script: Vec<Option<Result<Frame<Bytes>, BoxError>>>) -> (String, bool) {
        let inner = Script(script.into()).boxed_unsync();
        let mut body = ProgressTail::new(inner, |why: &str| {
            Bytes::from(format!("{{\"type\":\"response\",\"why\":\"{why}\"}}\n"))
        });
        let mut out = String::new();
        while let Some(frame) = body.frame().await {
            match frame {
                Ok(frame) => out.push_str(&String::from_utf8_lossy(&frame.into_data().unwrap())),
                Err(_) => return (out, false),
            }
        }
        (out, http_body::Body::is_end_stream(&body))
    }

    const PROGRESS: &str = "{\"type\":\"progress\",\"event\":{}}\n";
    const RESPONSE: &str = "{\"type\":\"response\",\"response\":{\"id\":1}}\n";

    #[tokio::test]
    async fn a_progress_stream_with_its_response_passes_as_it_came() {
        let whole = vec![data(PROGRESS), data(RESPONSE)];
        assert_eq!(
            tail_of(whole).await,
            (format!("{PROGRESS}{RESPONSE}"), true)
        );
        // The response line in pieces, its opening split too; then the stream fails: the
        // answer was whole, so nothing is added and the stream just ends.
        let (a, b) = RESPONSE.split_at(5);
        let pieces = vec![
            data(PROGRESS),
            data(a),
            None,
            data(b),
            Some(Err("gone".into())),
        ];
        assert_eq!(
            tail_of(pieces).await,
            (format!("{PROGRESS}{RESPONSE}"), true)
        );
    }

    #[tokio::test]
    async fn a_progress_stream_cut_before_its_response_is_finished_with_one_saying_why() {
        let cut = vec![data(PROGRESS), Some(Err("uplink lost".into()))];
        assert_eq!(
            tail_of(cut).await,
            (
                format!("{PROGRESS}{{\"type\":\"response\",\"why\":\"uplink lost\"}}\n"),
                true
            )
        );
        // Cut inside a line (the response's own included): the made line starts on a line of
        // its own.
        let (half, _) = RESPONSE.split_at(30);
        let mid = vec![data(PROGRESS), data(half), Some(Err("reset".into()))];
        assert_eq!(
            tail_of(mid).await,
            (
                format!("{PROGRESS}{half}\n{{\"type\":\"response\",\"why\":\"reset\"}}\n"),
                true
            )
        );
        // Ended cleanly but without a response: finished the same way.
        let (out, ended) = tail_of(vec![data(PROGRESS)]).await;
        assert!(ended);
        assert!(
            out.ends_with("\"why\":\"the stream ended without its response\"}\n"),
            "{out}"
        );
        // A line that only starts like the response's opening is not the response.
        let lookalike = vec![data("{\"type\":\"respons\"}\n"), Some(Err("x".into()))];
        assert!(tail_of(lookalike).await.0.ends_with("\"why\":\"x\"}\n"));
    }

    #[tokio::test]
    async fn a_progress_stream_ends_when_its_stop_fires_finished_like_a_cut_one() {
        let (tx, rx) = futures::channel::mpsc::unbounded::<Result<Frame<Bytes>, BoxError>>();
        let stop = tokio_util::sync::CancellationToken::new();
        let inner = http_body_util::StreamBody::new(rx).boxed_unsync();
        let mut body = ProgressTail::new(inner, |why: &str| Bytes::from(format!("[{why}]\n")))
            .until(stop.clone());
        tx.unbounded_send(Ok(Frame::data(Bytes::from_static(PROGRESS.as_bytes()))))
            .unwrap();
        let first = body.frame().await.unwrap().unwrap().into_data().unwrap();
        assert_eq!(first, PROGRESS.as_bytes());
        stop.cancel();
        let last = body.frame().await.unwrap().unwrap().into_data().unwrap();
        assert_eq!(last, "[this daemon is stopping]\n".as_bytes());
        assert!(body.frame().await.is_none());
        drop(tx);
    }
}
