//! Bodies and small response helpers: JSON in with a size cap, JSON and errors out, and
//! server-sent events.

use std::convert::Infallible;
use std::time::Duration;

use bytes::Bytes;
use futures::{Stream, StreamExt};
use http::{HeaderValue, Response, StatusCode, header};
use http_body_util::combinators::UnsyncBoxBody;
use http_body_util::{BodyExt, Full, StreamBody};
use hyper::body::{Frame, Incoming};
use serde::Serialize;
use serde_json::{Map, Value};
use simlock_contract::{ContractError, ErrorCode};
use tokio_util::sync::CancellationToken;

/// An error a body may carry.
pub type BoxError = Box<dyn std::error::Error + Send + Sync>;
/// Every response body the host sends.
pub type Body = UnsyncBoxBody<Bytes, BoxError>;

/// The largest JSON body a route reads: the same 1 MiB as a call line.
pub const MAX_JSON_BODY: usize = simlock_contract::bounds::MAX_CALL_LINE;

/// How long a request body the daemon reads whole (a JSON body, an agent-device `/rpc` call)
/// may take to arrive once its head has: as long as the head itself may take. A caller that
/// promises a body and stops sending holds a connection no longer than this.
pub const BODY_READ_TIMEOUT: Duration = super::HEADER_READ_TIMEOUT;
/// How often an idle event stream sends a comment so proxies keep it open.
pub const KEEPALIVE: Duration = Duration::from_secs(15);

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

/// A JSON response.
pub fn json<T: Serialize>(status: StatusCode, value: &T) -> Response<Body> {
    match serde_json::to_vec(value) {
        Ok(bytes) => {
            let mut response = Response::new(full(bytes));
            *response.status_mut() = status;
            response.headers_mut().insert(
                header::CONTENT_TYPE,
                HeaderValue::from_static("application/json"),
            );
            response
        }
        Err(e) => error(&ContractError::internal(format!(
            "response could not be encoded: {e}"
        ))),
    }
}

/// An error response: the code's status, `{"error": {code, message, ...details}}`, and
/// `Retry-After` for `NO_CAPACITY`.
pub fn error(err: &ContractError) -> Response<Body> {
    error_with_status(
        err,
        StatusCode::from_u16(err.code.http_status()).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR),
    )
}

/// An error response with an explicit status.
pub fn error_with_status(err: &ContractError, status: StatusCode) -> Response<Body> {
    let mut wrapper = Map::new();
    wrapper.insert("error".into(), err.to_body().to_inline());
    let mut response = json(status, &Value::Object(wrapper));
    if err.code == ErrorCode::NoCapacity {
        response
            .headers_mut()
            .insert(header::RETRY_AFTER, HeaderValue::from_static("5"));
    }
    response
}

/// How much more of a request body that arrives past its bound without having declared its
/// length (chunked) is still read, and dropped, before the refusal is answered: a caller that
/// streams its whole body before it reads the answer then reads the refusal instead of a reset
/// connection, and the connection serves its next request. The rest of a larger body is left
/// unread and its connection closed. A body that declares a length over its bound is refused
/// before any of it is read (see [`read_limited`]), and nothing of it is read on.
pub const DISCARD_LIMIT: usize = 8 * 1024 * 1024;

/// How long reading on past the bound ([`DISCARD_LIMIT`]) may take.
pub const DISCARD_TIMEOUT: Duration = Duration::from_secs(2);

/// Why a request body was not read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum BodyError {
    /// It declared, or sent, more than its bound.
    #[error("larger than {0} bytes")]
    TooLarge(usize),
    /// It did not arrive within [`BODY_READ_TIMEOUT`].
    #[error("not received within {} s", BODY_READ_TIMEOUT.as_secs())]
    Stalled,
    /// It failed.
    #[error("{0}")]
    Failed(String),
}

/// Reads a caller's request body whole, at most `limit` bytes, within [`BODY_READ_TIMEOUT`]: a
/// caller that promises a body and stops sending is answered then. A body that declares more
/// (its `content-length`) is refused before any of it is read, so a caller that asked
/// `Expect: 100-continue` is not invited to send it; one that sends more is read on and dropped,
/// up to [`DISCARD_LIMIT`], before it is refused.
///
/// # Errors
/// [`BodyError`].
pub async fn read_limited<B>(mut body: B, limit: usize) -> Result<Bytes, BodyError>
where
    B: hyper::body::Body<Data = Bytes> + Unpin,
    B::Error: std::fmt::Display,
{
    if declares_more(&body, limit) {
        return Err(BodyError::TooLarge(limit));
    }
    let read = tokio::time::timeout(BODY_READ_TIMEOUT, read_upto(&mut body, limit))
        .await
        .unwrap_or(Err(BodyError::Stalled));
    if matches!(read, Err(BodyError::TooLarge(_))) {
        discard(&mut body).await;
    }
    read
}

/// Reads `body` whole, at most `limit` bytes, with no time bound: one that declares more (its
/// `content-length`) is refused before any of it is read.
///
/// # Errors
/// [`BodyError::TooLarge`], [`BodyError::Failed`].
pub async fn read_upto<B>(body: &mut B, limit: usize) -> Result<Bytes, BodyError>
where
    B: hyper::body::Body<Data = Bytes> + Unpin,
    B::Error: std::fmt::Display,
{
    if declares_more(body, limit) {
        return Err(BodyError::TooLarge(limit));
    }
    let mut out = bytes::BytesMut::new();
    while let Some(frame) = body.frame().await {
        let frame = frame.map_err(|e| BodyError::Failed(e.to_string()))?;
        if let Ok(data) = frame.into_data() {
            if out.len() + data.len() > limit {
                return Err(BodyError::TooLarge(limit));
            }
            out.extend_from_slice(&data);
        }
    }
    Ok(out.freeze())
}

/// Whether `body` declares (its `content-length`) more than `limit` bytes.
fn declares_more<B: hyper::body::Body>(body: &B, limit: usize) -> bool {
    usize::try_from(body.size_hint().lower()).map_or(true, |n| n > limit)
}

/// Reads what is left of `body` and drops it: at most [`DISCARD_LIMIT`] bytes, within
/// [`DISCARD_TIMEOUT`], until it ends or fails.
async fn discard<B>(body: &mut B)
where
    B: hyper::body::Body<Data = Bytes> + Unpin,
{
    let mut left = DISCARD_LIMIT;
    let _ = tokio::time::timeout(DISCARD_TIMEOUT, async {
        while let Some(Ok(frame)) = body.frame().await {
            if let Ok(data) = frame.into_data() {
                match left.checked_sub(data.len()) {
                    Some(rest) => left = rest,
                    None => return,
                }
            }
        }
    })
    .await;
}

/// Reads a JSON object body of at most [`MAX_JSON_BODY`] bytes, as [`read_limited`] reads it;
/// an empty body reads as `{}`.
///
/// # Errors
/// `BAD_REQUEST` for a body too large, not JSON, not an object, or not received in time.
pub async fn read_json(body: Incoming) -> Result<Value, ContractError> {
    let bytes = read_limited(body, MAX_JSON_BODY)
        .await
        .map_err(|e| ContractError::bad_request(format!("body: {e}")))?;
    if bytes.iter().all(u8::is_ascii_whitespace) {
        return Ok(Value::Object(Map::new()));
    }
    match simlock_contract::json_value(&bytes) {
        Ok(value @ Value::Object(_)) => Ok(value),
        Ok(_) => Err(ContractError::bad_request("body: must be a JSON object")),
        Err(e) => Err(ContractError::bad_request(format!(
            "body: invalid JSON: {e}"
        ))),
    }
}

/// One server-sent event.
pub fn sse_event(name: &str, data: &Value) -> Bytes {
    Bytes::from(format!("event: {name}\ndata: {data}\n\n"))
}

/// What a stream's last event says when the daemon stops.
pub fn stopping_error() -> ContractError {
    ContractError::new(ErrorCode::DaemonStopping, "The daemon is stopping")
}

/// A `text/event-stream` response over `events`, with a keepalive comment after each idle
/// [`KEEPALIVE`]. The response ends when `events` ends, or at once when `stop` fires: then the
/// events already at hand are sent, then `on_stop` (when not empty), and the stream ends, so a
/// stopping daemon never waits on an open stream.
pub fn sse<S>(events: S, stop: &CancellationToken, on_stop: Bytes) -> Response<Body>
where
    S: Stream<Item = Bytes> + Send + 'static,
{
    let state = (Box::pin(events), stop.clone(), Some(on_stop));
    // The state's last part is `None` once the stop's event went out: the stream is over.
    let frames = futures::stream::unfold(state, |(mut events, stop, on_stop)| async move {
        let on_stop = on_stop?;
        let (bytes, on_stop) = tokio::select! {
            biased;
            next = events.next() => (next?, Some(on_stop)),
            () = stop.cancelled() => {
                if on_stop.is_empty() {
                    return None;
                }
                (on_stop, None)
            }
            () = tokio::time::sleep(KEEPALIVE) => {
                (Bytes::from_static(b": keepalive\n\n"), Some(on_stop))
            }
        };
        Some((
            Ok::<_, BoxError>(Frame::data(bytes)),
            (events, stop, on_stop),
        ))
    });
    let mut response = Response::new(StreamBody::new(frames).boxed_unsync());
    let headers = response.headers_mut();
    headers.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/event-stream"),
    );
    headers.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    response
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicUsize, Ordering};

    use super::*;

    /// A body of `frames` frames of `size` bytes, then (when `stall`) one that never comes;
    /// `sent` counts the bytes it handed over.
    fn counted(
        frames: usize,
        size: usize,
        stall: bool,
    ) -> (Arc<AtomicUsize>, UnsyncBoxBody<Bytes, Infallible>) {
        let sent = Arc::new(AtomicUsize::new(0));
        let piece = Bytes::from(vec![b'x'; size]);
        let counter = sent.clone();
        let frames = futures::stream::iter(0..frames)
            .map(move |_| {
                counter.fetch_add(piece.len(), Ordering::SeqCst);
                Ok::<_, Infallible>(Frame::data(piece.clone()))
            })
            .chain(
                futures::stream::iter(stall.then_some(())).then(|()| futures::future::pending()),
            );
        (sent, StreamBody::new(frames).boxed_unsync())
    }

    const KIB: usize = 1024;

    #[tokio::test]
    async fn a_body_at_its_bound_is_read_whole() {
        let (_, body) = counted(4, 16 * KIB, false);
        let bytes = read_limited(body, 64 * KIB).await.unwrap();
        assert_eq!(bytes.len(), 64 * KIB);
    }

    #[tokio::test]
    async fn a_body_past_its_bound_is_refused_after_the_rest_is_read_up_to_the_discard_bound() {
        // Its bound, and DISCARD_LIMIT more: read to its end, then refused.
        let frames = (64 * KIB + DISCARD_LIMIT) / (16 * KIB);
        let (sent, body) = counted(frames, 16 * KIB, false);
        assert_eq!(
            read_limited(body, 64 * KIB).await,
            Err(BodyError::TooLarge(64 * KIB))
        );
        assert_eq!(sent.load(Ordering::SeqCst), frames * 16 * KIB);
        // A longer one: after the frame that passed the bound, DISCARD_LIMIT more are read and
        // dropped, and the frame past those is the last one taken.
        let (sent, body) = counted(frames + 100, 16 * KIB, false);
        assert_eq!(
            read_limited(body, 64 * KIB).await,
            Err(BodyError::TooLarge(64 * KIB))
        );
        assert_eq!(
            sent.load(Ordering::SeqCst),
            (64 + 16) * KIB + DISCARD_LIMIT + 16 * KIB
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_body_past_its_bound_that_then_stalls_is_refused_at_the_discard_timeout() {
        let (_, body) = counted(5, 16 * KIB, true);
        let started = tokio::time::Instant::now();
        assert_eq!(
            read_limited(body, 64 * KIB).await,
            Err(BodyError::TooLarge(64 * KIB))
        );
        assert_eq!(started.elapsed(), DISCARD_TIMEOUT);
    }

    #[tokio::test(start_paused = true)]
    async fn a_body_that_stalls_within_its_bound_is_stalled_at_the_read_timeout() {
        let (_, body) = counted(2, 16 * KIB, true);
        let started = tokio::time::Instant::now();
        assert_eq!(read_limited(body, 64 * KIB).await, Err(BodyError::Stalled));
        assert_eq!(started.elapsed(), BODY_READ_TIMEOUT);
    }

    #[tokio::test]
    async fn a_body_declared_past_its_bound_is_refused_before_a_byte_is_read() {
        /// A counted body that declares its length.
        struct Declared(UnsyncBoxBody<Bytes, Infallible>, u64);
        impl hyper::body::Body for Declared {
            type Data = Bytes;
            type Error = Infallible;
            fn poll_frame(
                mut self: std::pin::Pin<&mut Self>,
                cx: &mut std::task::Context<'_>,
            ) -> std::task::Poll<Option<Result<Frame<Bytes>, Infallible>>> {
                std::pin::Pin::new(&mut self.0).poll_frame(cx)
            }
            fn size_hint(&self) -> hyper::body::SizeHint {
                hyper::body::SizeHint::with_exact(self.1)
            }
        }
        let (sent, body) = counted(5, 16 * KIB, false);
        assert_eq!(
            read_limited(Declared(body, 80 * 1024), 64 * KIB).await,
            Err(BodyError::TooLarge(64 * KIB))
        );
        assert_eq!(sent.load(Ordering::SeqCst), 0);
    }
}
