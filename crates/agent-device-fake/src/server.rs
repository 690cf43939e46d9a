//! The HTTP shell: the daemon's routes on one loopback listener (reference §2.2), token checks,
//! body caps, streaming bodies, NDJSON progress replies, holds and delays. What each route
//! answers is decided by the model; this module reads, waits and writes.

use std::convert::Infallible;
use std::io;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use futures::stream;
use http::header::{AUTHORIZATION, CONTENT_LENGTH, CONTENT_TYPE, HOST};
use http::{HeaderMap, HeaderValue, Method as HttpMethod, Request, Response, StatusCode};
use http_body_util::combinators::UnsyncBoxBody;
use http_body_util::{BodyExt, Full, StreamBody};
use hyper::body::{Frame, Incoming};
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
use parking_lot::Mutex;
use serde::Serialize;
use serde_json::{Value, json};
use sha2::{Digest, Sha256};
use tokio::net::TcpListener;
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;
use tracing::debug;

use crate::control;
use crate::holds::Holds;
use crate::ids::{TenantId, hex, percent_decode};
use crate::model::{Checked, Method, Model, Reply};
use crate::record::{BodyTap, RequestLog};
use crate::uploads::{MAX_UPLOAD_BYTES, Preflight, PutOutcome, PutPlan, legacy_headers};
use crate::wire::{DaemonError, ErrorCode, ErrorData, rpc_code, rpc_error};

/// The body of every answer.
pub(crate) type Body = UnsyncBoxBody<Bytes, Infallible>;

/// The largest `/rpc` body; past it the connection is closed with no answer, as 0.21.5 does.
pub const RPC_BODY_CAP: usize = 1_048_576;
/// The largest preflight or finalize body.
pub const JSON_BODY_CAP: usize = 65_536;

/// The exact `/health` answer of 0.21.5.
pub const HEALTH_BODY: &str =
    r#"{"ok":true,"service":"agent-device-daemon","version":"0.21.5","rpcProtocolVersion":2}"#;

/// The daemon's version.
pub const VERSION: &str = "0.21.5";

/// Time for the fake: tokio's clock (which a test may pause), anchored to the wall clock at start.
#[derive(Debug)]
pub(crate) struct Clock {
    epoch_ms: u64,
    anchor: tokio::time::Instant,
}

impl Clock {
    pub(crate) fn start() -> Self {
        let epoch_ms = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX));
        Self {
            epoch_ms,
            anchor: tokio::time::Instant::now(),
        }
    }

    /// Now, in epoch milliseconds.
    pub(crate) fn now_ms(&self) -> u64 {
        self.epoch_ms
            + u64::try_from(self.anchor.elapsed().as_millis()).unwrap_or(u64::MAX - self.epoch_ms)
    }
}

/// What every connection shares.
#[derive(Debug)]
pub(crate) struct Shared {
    pub(crate) model: Mutex<Model>,
    pub(crate) log: Arc<Mutex<RequestLog>>,
    pub(crate) holds: Arc<Holds>,
    pub(crate) token: String,
    pub(crate) clock: Clock,
    pub(crate) local: SocketAddr,
    pub(crate) state_dir: String,
}

/// Serves `listener` until `stop` is cancelled, then drops every connection.
pub(crate) async fn serve(listener: TcpListener, shared: Arc<Shared>, stop: CancellationToken) {
    let mut connections = JoinSet::new();
    loop {
        let accepted = tokio::select! {
            () = stop.cancelled() => break,
            accepted = listener.accept() => accepted,
        };
        let Ok((stream, peer)) = accepted else {
            // Accept errors (descriptor limits) are transient; retry after a pause.
            tokio::time::sleep(std::time::Duration::from_millis(50)).await;
            continue;
        };
        let _ = stream.set_nodelay(true);
        let shared = shared.clone();
        let stop = stop.clone();
        connections.spawn(async move {
            let service = service_fn(move |request| handle(shared.clone(), request));
            let connection = hyper::server::conn::http1::Builder::new()
                .serve_connection(TokioIo::new(stream), service);
            tokio::select! {
                outcome = connection => {
                    if let Err(error) = outcome {
                        debug!(%peer, %error, "connection ended");
                    }
                }
                () = stop.cancelled() => {}
            }
        });
        while connections.try_join_next().is_some() {}
    }
    connections.abort_all();
    while connections.join_next().await.is_some() {}
}

fn full(bytes: impl Into<Bytes>) -> Body {
    Full::new(bytes.into()).boxed_unsync()
}

fn json_response(status: StatusCode, body: impl Into<Bytes>) -> Response<Body> {
    let mut response = Response::new(full(body));
    *response.status_mut() = status;
    response
        .headers_mut()
        .insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
    response
}

fn reply_response(reply: &Reply) -> Response<Body> {
    json_response(reply.status, reply.body.clone())
}

fn aux_error(err: &DaemonError) -> Response<Body> {
    json_response(err.http_status(), err.aux_body())
}

fn not_found() -> Response<Body> {
    let mut response = Response::new(full("Not found"));
    *response.status_mut() = StatusCode::NOT_FOUND;
    response
}

fn unauthorized() -> Response<Body> {
    aux_error(&DaemonError::new(ErrorCode::Unauthorized, "Invalid token"))
}

/// The token a request's headers carry: `x-agent-device-token`, else `Authorization: Bearer`.
fn header_token(headers: &HeaderMap) -> Option<&str> {
    if let Some(token) = headers
        .get("x-agent-device-token")
        .and_then(|v| v.to_str().ok())
    {
        return Some(token);
    }
    let value = headers.get(AUTHORIZATION)?.to_str().ok()?;
    let (scheme, token) = value.split_at_checked(7)?;
    scheme.eq_ignore_ascii_case("bearer ").then_some(token)
}

impl Shared {
    /// Whether `candidate` is the daemon's token (compared through their SHA-256).
    fn token_ok(&self, candidate: Option<&str>) -> bool {
        candidate
            .is_some_and(|c| Sha256::digest(c.as_bytes()) == Sha256::digest(self.token.as_bytes()))
    }
}

fn tenant_header(headers: &HeaderMap) -> Option<TenantId> {
    headers
        .get("x-agent-device-tenant")
        .and_then(|v| v.to_str().ok())
        .and_then(TenantId::parse)
}

/// Why a body could not be read.
enum ReadError {
    TooLarge,
    Gone,
}

/// Reads a whole body of at most `cap` bytes.
async fn read_capped(
    body: &mut Incoming,
    cap: usize,
    tap: &mut BodyTap,
) -> Result<Bytes, ReadError> {
    let mut out = Vec::new();
    while let Some(frame) = body.frame().await {
        let frame = frame.map_err(|_| ReadError::Gone)?;
        if let Some(data) = frame.data_ref() {
            tap.feed(data);
            if out.len() + data.len() > cap {
                return Err(ReadError::TooLarge);
            }
            out.extend_from_slice(data);
        }
    }
    tap.finish();
    Ok(Bytes::from(out))
}

/// Reads what is left of a small body into the record only, so that the record of a refused
/// request still shows what it carried. A large body is left unread (the connection then
/// closes after the answer).
async fn settle(body: &mut Incoming, tap: &mut BodyTap) {
    loop {
        if tap.finished() {
            return;
        }
        if http_body::Body::is_end_stream(body) {
            tap.finish();
            return;
        }
        if tap.len() > JSON_BODY_CAP as u64 {
            return;
        }
        match body.frame().await {
            None => {
                tap.finish();
                return;
            }
            Some(Ok(frame)) => {
                if let Some(data) = frame.data_ref() {
                    tap.feed(data);
                }
            }
            Some(Err(_)) => return,
        }
    }
}

async fn handle(
    shared: Arc<Shared>,
    request: Request<Incoming>,
) -> Result<Response<Body>, io::Error> {
    if request.uri().path().starts_with("/__fake/") {
        return Ok(control::handle(&shared, request).await);
    }
    let path = request.uri().path_and_query().map_or_else(
        || request.uri().path().to_owned(),
        |pq| pq.as_str().to_owned(),
    );
    let seq = shared
        .log
        .lock()
        .open(request.method().as_str(), &path, request.headers());
    let tap = BodyTap::new(shared.log.clone(), seq);
    let outcome = route(&shared, request, tap).await;
    if let Ok(response) = &outcome {
        shared
            .log
            .lock()
            .set_status(seq, response.status().as_u16());
    }
    outcome
}

async fn route(
    shared: &Arc<Shared>,
    request: Request<Incoming>,
    mut tap: BodyTap,
) -> Result<Response<Body>, io::Error> {
    let method = request.method().clone();
    let path = request.uri().path().to_owned();
    let exact = request.uri().query().is_none();
    let (parts, mut body) = request.into_parts();
    let headers = parts.headers;
    let response = match (&method, path.as_str()) {
        (&HttpMethod::GET, "/health") if exact => {
            let mut response = Response::new(full(HEALTH_BODY));
            response
                .headers_mut()
                .insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
            response
        }
        (&HttpMethod::POST, "/rpc") if exact => return rpc(shared, &headers, body, tap).await,
        (&HttpMethod::POST, "/upload/preflight") if exact => {
            preflight(shared, &headers, &mut body, &mut tap).await
        }
        (&HttpMethod::POST, "/upload/finalize") if exact => {
            finalize(shared, &headers, &mut body, &mut tap).await
        }
        (&HttpMethod::POST, "/upload") if exact => {
            legacy_upload(shared, &headers, &mut body, &mut tap).await
        }
        (&HttpMethod::PUT, p) if p.starts_with("/upload/direct/") => {
            let id = percent_decode(&p["/upload/direct/".len()..]).unwrap_or_default();
            direct_put(shared, &headers, &id, &mut body, &mut tap).await
        }
        (&HttpMethod::GET, "/artifacts" | "/artifacts/") => {
            if !shared.token_ok(header_token(&headers)) {
                unauthorized()
            } else {
                let now = shared.clock.now_ms();
                let list = shared
                    .model
                    .lock()
                    .artifact_list(tenant_header(&headers).as_ref(), now);
                json_response(StatusCode::OK, list.to_string())
            }
        }
        (&HttpMethod::GET, p) if p.starts_with("/artifacts/") => {
            let raw = &p["/artifacts/".len()..];
            let id = percent_decode(raw).unwrap_or_else(|| raw.to_owned());
            download(shared, &headers, &id)
        }
        (&HttpMethod::GET, p) if diagnostics_segments(p).is_some() => {
            diagnostics(shared, &headers, p)
        }
        _ => not_found(),
    };
    settle(&mut body, &mut tap).await;
    Ok(response)
}

async fn rpc(
    shared: &Arc<Shared>,
    headers: &HeaderMap,
    mut body: Incoming,
    mut tap: BodyTap,
) -> Result<Response<Body>, io::Error> {
    let bytes = match read_capped(&mut body, RPC_BODY_CAP, &mut tap).await {
        Ok(bytes) => bytes,
        Err(ReadError::TooLarge) => {
            return Err(io::Error::other("rpc body over the 1 MiB cap"));
        }
        Err(ReadError::Gone) => return Err(io::Error::other("client left mid-body")),
    };
    let bad = |status, id: &Value, code, message: &str| {
        Ok(reply_response(&Reply::bare(status, id, code, message)))
    };
    let Ok(envelope) = serde_json::from_slice::<Value>(&bytes) else {
        return bad(
            StatusCode::BAD_REQUEST,
            &Value::Null,
            rpc_code::PARSE_ERROR,
            "Parse error",
        );
    };
    let Some(envelope) = envelope.as_object() else {
        return bad(
            StatusCode::BAD_REQUEST,
            &Value::Null,
            rpc_code::INVALID_REQUEST,
            "Invalid Request",
        );
    };
    let id = envelope.get("id").cloned().unwrap_or(Value::Null);
    let method_name = envelope.get("method").and_then(Value::as_str);
    let (Some(method_name), Some("2.0")) =
        (method_name, envelope.get("jsonrpc").and_then(Value::as_str))
    else {
        return bad(
            StatusCode::BAD_REQUEST,
            &id,
            rpc_code::INVALID_REQUEST,
            "Invalid Request",
        );
    };
    let Some(method) = Method::parse(method_name) else {
        return bad(
            StatusCode::NOT_FOUND,
            &id,
            rpc_code::METHOD_NOT_FOUND,
            &format!("Method not found: {method_name}"),
        );
    };
    let Some(params) = envelope.get("params") else {
        return bad(
            StatusCode::BAD_REQUEST,
            &id,
            rpc_code::INVALID_PARAMS,
            "Invalid params",
        );
    };
    let access = headers
        .get("x-agent-device-network-access")
        .map(|v| v.to_str().unwrap_or_default());
    if access.is_some_and(|a| a != "public-only") {
        return Ok(reply_response(&Reply::invalid_params(
            &id,
            "Invalid daemon HTTP network access marker",
            None,
        )));
    }
    let checked = match Checked::read(method, &id, params, access.is_some()) {
        Ok(checked) => checked,
        Err(reply) => return Ok(reply_response(&reply)),
    };
    let progress = checked.wants_progress();
    let token = params
        .get("token")
        .and_then(Value::as_str)
        .or_else(|| header_token(headers));
    let authorized = shared.token_ok(token);
    let shared = shared.clone();
    let answer = async move {
        if authorized {
            execute(&shared, id, checked).await
        } else {
            invalid_token(&id)
        }
    };
    if !progress {
        return Ok(reply_response(&answer.await));
    }
    // NDJSON: the head goes out at once, the one response line when the command ends; a client
    // that hangs up drops the stream, and with it the command.
    let lines = stream::once(async move {
        let reply = answer.await;
        let line = format!("{{\"type\":\"response\",\"response\":{}}}\n", reply.body);
        Ok::<_, Infallible>(Frame::data(Bytes::from(line)))
    });
    let mut response = Response::new(StreamBody::new(lines).boxed_unsync());
    response.headers_mut().insert(
        CONTENT_TYPE,
        HeaderValue::from_static("application/x-ndjson"),
    );
    Ok(response)
}

fn invalid_token(id: &Value) -> Reply {
    let code = ErrorCode::Unauthorized;
    let data = ErrorData {
        code,
        message: "Invalid token",
        hint: code.default_hint(),
        diagnostic_id: None,
        log_path: None,
        diagnostics_record: None,
        retriable: None,
        details: None,
    };
    Reply {
        status: StatusCode::UNAUTHORIZED,
        body: rpc_error(id, rpc_code::HANDLER, "Invalid token", &data),
    }
}

/// Runs one authorised call: the delay knob, the checks, any hold, then the call itself.
async fn execute(shared: &Arc<Shared>, id: Value, checked: Checked) -> Reply {
    let delay = shared.model.lock().knobs.rpc_delay;
    if let Some(delay) = delay {
        tokio::time::sleep(delay).await;
    }
    let begun = {
        let now = shared.clock.now_ms();
        shared.model.lock().begin(id, checked, now)
    };
    let prepared = match begun {
        Ok(prepared) => prepared,
        Err(reply) => return reply,
    };
    shared.holds.pass(prepared.command()).await;
    let now = shared.clock.now_ms();
    shared.model.lock().finish(prepared, now)
}

/// The preflight answer, in the daemon's field order.
#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
struct Ticket<'a> {
    ok: bool,
    upload_id: &'a str,
    cache_hit: bool,
    upload: TicketUpload<'a>,
}

#[derive(Serialize)]
struct TicketUpload<'a> {
    url: String,
    headers: TicketHeaders<'a>,
}

#[derive(Serialize)]
struct TicketHeaders<'a> {
    authorization: String,
    #[serde(rename = "x-agent-device-token")]
    token: &'a str,
    #[serde(rename = "content-type")]
    content_type: &'a str,
}

async fn preflight(
    shared: &Arc<Shared>,
    headers: &HeaderMap,
    body: &mut Incoming,
    tap: &mut BodyTap,
) -> Response<Body> {
    if !shared.token_ok(header_token(headers)) {
        return unauthorized();
    }
    let bytes = match read_capped(body, JSON_BODY_CAP, tap).await {
        Ok(bytes) => bytes,
        Err(ReadError::TooLarge | ReadError::Gone) => {
            return aux_error(&DaemonError::invalid_args("Request body is too large."));
        }
    };
    let preflight = match Preflight::read(&bytes) {
        Ok(preflight) => preflight,
        Err(err) => return aux_error(&err),
    };
    let now = shared.clock.now_ms();
    let id = shared
        .model
        .lock()
        .uploads
        .preflight(&preflight, tenant_header(headers), now);
    let host = headers
        .get(HOST)
        .and_then(|v| v.to_str().ok())
        .map_or_else(|| shared.local.to_string(), str::to_owned);
    let proto = headers
        .get("x-forwarded-proto")
        .and_then(|v| v.to_str().ok())
        .unwrap_or("http");
    let token = &shared.token;
    let ticket = Ticket {
        ok: true,
        upload_id: &id,
        cache_hit: false,
        upload: TicketUpload {
            url: format!("{proto}://{host}/upload/direct/{id}"),
            headers: TicketHeaders {
                authorization: format!("Bearer {token}"),
                token,
                content_type: &preflight.content_type,
            },
        },
    };
    json_response(
        StatusCode::OK,
        serde_json::to_string(&ticket).unwrap_or_default(),
    )
}

/// Commits an accepted PUT's progress however the PUT ends: refused (nothing kept), finished,
/// or cut off by the client (what arrived is kept, so the client can resume).
struct PutGuard<'a> {
    shared: &'a Shared,
    id: String,
    taken: u64,
    hasher: Option<Sha256>,
}

impl PutGuard<'_> {
    fn refuse(mut self) {
        self.hasher = None;
        let now = self.shared.clock.now_ms();
        self.shared
            .model
            .lock()
            .uploads
            .end_put(&self.id, None, now);
        self.id.clear();
    }

    fn commit(mut self) -> PutOutcome {
        let taken = self.hasher.take().map(|h| (self.taken, h));
        let now = self.shared.clock.now_ms();
        let outcome = self
            .shared
            .model
            .lock()
            .uploads
            .end_put(&self.id, taken, now);
        self.id.clear();
        outcome
    }
}

impl Drop for PutGuard<'_> {
    fn drop(&mut self) {
        if !self.id.is_empty() {
            let taken = self.hasher.take().map(|h| (self.taken, h));
            let now = self.shared.clock.now_ms();
            self.shared
                .model
                .lock()
                .uploads
                .end_put(&self.id, taken, now);
        }
    }
}

fn resume_response(offset: u64) -> Response<Body> {
    let mut response = Response::new(full(Bytes::new()));
    *response.status_mut() = StatusCode::PERMANENT_REDIRECT;
    let headers = response.headers_mut();
    if offset > 0
        && let Ok(range) = HeaderValue::from_str(&format!("bytes=0-{}", offset - 1))
    {
        headers.insert("range", range);
    }
    headers.insert("x-upload-offset", HeaderValue::from(offset));
    headers.insert(CONTENT_LENGTH, HeaderValue::from(0));
    response
}

async fn direct_put(
    shared: &Arc<Shared>,
    headers: &HeaderMap,
    id: &str,
    body: &mut Incoming,
    tap: &mut BodyTap,
) -> Response<Body> {
    if !shared.token_ok(header_token(headers)) {
        return unauthorized();
    }
    let range = headers.get("content-range").and_then(|v| v.to_str().ok());
    let tenant = tenant_header(headers);
    let now = shared.clock.now_ms();
    let plan = shared
        .model
        .lock()
        .uploads
        .begin_put(id, tenant.as_ref(), range, now);
    let (limit, exact, hasher) = match plan {
        Err(err) => return aux_error(&err),
        Ok(PutPlan::Resume { offset }) => return resume_response(offset),
        Ok(PutPlan::Accept {
            limit,
            exact,
            hasher,
        }) => (limit, exact, hasher),
    };
    let mut guard = PutGuard {
        shared,
        id: id.to_owned(),
        taken: 0,
        hasher: Some(hasher),
    };
    while let Some(frame) = body.frame().await {
        let Ok(frame) = frame else {
            // The client left: what arrived stays (the guard commits it).
            return resume_response(guard.taken);
        };
        let Some(data) = frame.data_ref() else {
            continue;
        };
        tap.feed(data);
        let len = data.len() as u64;
        if guard.taken + len > limit {
            guard.refuse();
            return aux_error(&DaemonError::invalid_args(
                "Upload chunk exceeds its permitted byte range",
            ));
        }
        if let Some(hasher) = &mut guard.hasher {
            hasher.update(data);
        }
        guard.taken += len;
    }
    tap.finish();
    if exact && guard.taken != limit {
        guard.refuse();
        return aux_error(&DaemonError::invalid_args(
            "Upload chunk length does not match content-range",
        ));
    }
    match guard.commit() {
        PutOutcome::Complete => Response::new(full("ok")),
        PutOutcome::Partial { offset } => resume_response(offset),
    }
}

async fn finalize(
    shared: &Arc<Shared>,
    headers: &HeaderMap,
    body: &mut Incoming,
    tap: &mut BodyTap,
) -> Response<Body> {
    if !shared.token_ok(header_token(headers)) {
        return unauthorized();
    }
    let Ok(bytes) = read_capped(body, JSON_BODY_CAP, tap).await else {
        return aux_error(&DaemonError::invalid_args("Request body is too large."));
    };
    let Ok(parsed) = serde_json::from_slice::<Value>(&bytes) else {
        return aux_error(&DaemonError::invalid_args("Invalid JSON request body"));
    };
    let Some(id) = parsed
        .get("uploadId")
        .and_then(Value::as_str)
        .filter(|id| !id.is_empty())
    else {
        return aux_error(&DaemonError::invalid_args("uploadId is required"));
    };
    let now = shared.clock.now_ms();
    let tenant = tenant_header(headers);
    let finalized = shared
        .model
        .lock()
        .uploads
        .finalize(id, tenant.as_ref(), now);
    match finalized {
        Ok(done) => json_response(
            StatusCode::OK,
            json!({ "ok": true, "uploadId": done.id }).to_string(),
        ),
        Err(err) => aux_error(&err),
    }
}

async fn legacy_upload(
    shared: &Arc<Shared>,
    headers: &HeaderMap,
    body: &mut Incoming,
    tap: &mut BodyTap,
) -> Response<Body> {
    if !shared.token_ok(header_token(headers)) {
        return unauthorized();
    }
    let header = |name: &str| headers.get(name).and_then(|v| v.to_str().ok());
    let (kind, file_name) =
        match legacy_headers(header("x-artifact-type"), header("x-artifact-filename")) {
            Ok(found) => found,
            Err(err) => return aux_error(&err),
        };
    let mut hasher = Sha256::new();
    let mut size = 0u64;
    while let Some(frame) = body.frame().await {
        let Ok(frame) = frame else {
            return aux_error(&DaemonError::new(ErrorCode::Unknown, "Upload was aborted"));
        };
        if let Some(data) = frame.data_ref() {
            tap.feed(data);
            size += data.len() as u64;
            if size > MAX_UPLOAD_BYTES {
                return aux_error(&DaemonError::invalid_args(format!(
                    "Upload exceeds maximum size of {MAX_UPLOAD_BYTES} bytes"
                )));
            }
            hasher.update(data);
        }
    }
    tap.finish();
    let now = shared.clock.now_ms();
    let done = shared.model.lock().uploads.legacy(
        &file_name,
        kind,
        size,
        hex(&hasher.finalize()),
        tenant_header(headers),
        now,
    );
    json_response(
        StatusCode::OK,
        json!({ "ok": true, "uploadId": done.id }).to_string(),
    )
}

fn download(shared: &Shared, headers: &HeaderMap, id: &str) -> Response<Body> {
    if !shared.token_ok(header_token(headers)) {
        return unauthorized();
    }
    let now = shared.clock.now_ms();
    let taken = shared
        .model
        .lock()
        .take_artifact(id, tenant_header(headers).as_ref(), now);
    let artifact = match taken {
        Ok(artifact) => artifact,
        Err(err) => return aux_error(&err),
    };
    let length = artifact.bytes.len();
    let disposition = format!(
        "attachment; filename=\"{}\"",
        artifact.file_name.replace(['"', '\\'], "_")
    );
    let mut response = Response::new(full(artifact.bytes));
    let out = response.headers_mut();
    out.insert(
        CONTENT_TYPE,
        HeaderValue::from_static(crate::model::Artifact::MIME),
    );
    out.insert(CONTENT_LENGTH, HeaderValue::from(length));
    if let Ok(value) = HeaderValue::from_str(&disposition) {
        out.insert("content-disposition", value);
    }
    response
}

/// The raw session and request segments of `/sessions/<s>/requests/<id>/diagnostics`.
fn diagnostics_segments(path: &str) -> Option<(&str, &str)> {
    let rest = path.strip_prefix("/sessions/")?;
    let mut parts = rest.split('/');
    let session = parts.next()?;
    let (Some("requests"), Some(request), Some("diagnostics"), None) =
        (parts.next(), parts.next(), parts.next(), parts.next())
    else {
        return None;
    };
    (!session.is_empty() && !request.is_empty()).then_some((session, request))
}

fn diagnostics(shared: &Shared, headers: &HeaderMap, path: &str) -> Response<Body> {
    if !shared.token_ok(header_token(headers)) {
        return unauthorized();
    }
    let Some((session, request)) = diagnostics_segments(path) else {
        return not_found();
    };
    let (Some(session), Some(request)) = (percent_decode(session), percent_decode(request)) else {
        return aux_error(&DaemonError::invalid_args(
            "Invalid session or request id in diagnostics route",
        ));
    };
    let found = shared.model.lock().diagnostics(&session, &request);
    match found {
        Ok(ndjson) => {
            let length = ndjson.len();
            let mut response = Response::new(full(ndjson));
            response.headers_mut().insert(
                CONTENT_TYPE,
                HeaderValue::from_static("application/x-ndjson"),
            );
            response
                .headers_mut()
                .insert(CONTENT_LENGTH, HeaderValue::from(length));
            response
        }
        Err(err) => aux_error(&err),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bearer_is_matched_case_insensitively_and_exactly() {
        let mut headers = HeaderMap::new();
        headers.insert(AUTHORIZATION, HeaderValue::from_static("bearer abc"));
        assert_eq!(header_token(&headers), Some("abc"));
        headers.insert(AUTHORIZATION, HeaderValue::from_static("BEARER  abc"));
        assert_eq!(header_token(&headers), Some(" abc"));
        headers.insert(AUTHORIZATION, HeaderValue::from_static("Basic abc"));
        assert_eq!(header_token(&headers), None);
        headers.insert("x-agent-device-token", HeaderValue::from_static("xyz"));
        assert_eq!(header_token(&headers), Some("xyz"));
    }

    #[test]
    fn diagnostics_paths_have_exactly_five_segments() {
        assert_eq!(
            diagnostics_segments("/sessions/a%3Ab/requests/r1/diagnostics"),
            Some(("a%3Ab", "r1"))
        );
        assert_eq!(
            diagnostics_segments("/sessions/a/b/requests/r/diagnostics"),
            None
        );
        assert_eq!(
            diagnostics_segments("/sessions/a/requests/r/diagnostics/"),
            None
        );
        assert_eq!(
            diagnostics_segments("/sessions//requests/r/diagnostics"),
            None
        );
    }
}
