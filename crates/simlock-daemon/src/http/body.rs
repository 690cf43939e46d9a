//! Bodies and small response helpers: JSON in with a size cap, JSON and errors out, and
//! server-sent events.

use std::convert::Infallible;
use std::time::Duration;

use bytes::Bytes;
use futures::{Stream, StreamExt};
use http::{HeaderValue, Response, StatusCode, header};
use http_body_util::combinators::UnsyncBoxBody;
use http_body_util::{BodyExt, Full, Limited, StreamBody};
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

/// Reads a JSON object body of at most [`MAX_JSON_BODY`] bytes, whole within
/// [`BODY_READ_TIMEOUT`]; an empty body reads as `{}`. A body whose declared length is larger is
/// refused before any of it is read (and a caller that asked `Expect: 100-continue` is not
/// invited to send it).
///
/// # Errors
/// `BAD_REQUEST` for a body too large, not JSON, not an object, or not received in time.
pub async fn read_json(body: Incoming) -> Result<Value, ContractError> {
    if usize::try_from(hyper::body::Body::size_hint(&body).lower())
        .map_or(true, |n| n > MAX_JSON_BODY)
    {
        return Err(too_large());
    }
    let collected = tokio::time::timeout(
        BODY_READ_TIMEOUT,
        Limited::new(body, MAX_JSON_BODY).collect(),
    )
    .await
    .map_err(|_| {
        ContractError::bad_request(format!(
            "body: not received within {} s",
            BODY_READ_TIMEOUT.as_secs()
        ))
    })?;
    let bytes = collected
        .map_err(|e| {
            if e.downcast_ref::<http_body_util::LengthLimitError>()
                .is_some()
            {
                too_large()
            } else {
                ContractError::bad_request(format!("body: {e}"))
            }
        })?
        .to_bytes();
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

fn too_large() -> ContractError {
    ContractError::bad_request(format!("body: larger than {MAX_JSON_BODY} bytes"))
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
