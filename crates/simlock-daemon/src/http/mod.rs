//! The HTTP host: `/v1` routes over the one pipeline, bearer tokens, long-poll and
//! server-sent events, plus mounts other crates add (the gateway's `/v1/uplink`, the
//! agent-device front). Every route maps to an operation; see `docs/HTTP-API.md`.

pub mod body;
pub mod parse;
pub mod requests;
pub mod responses;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use futures::StreamExt;
use futures::future::BoxFuture;
use http::{Method, Request, Response, StatusCode};
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::{TokioIo, TokioTimer};
use serde_json::{Map, Value, json};
use simlock_contract::http::LeaseRequestBody;
use simlock_contract::model::{LeaseRecord, Platform};
use simlock_contract::ops::{
    CatalogGet, CatalogInput, ConfigGet, DaemonStop, Empty, EventsReplay, LeaseGet, LeaseGetInput,
    LeaseIdInput, LeaseList, LeaseRelease, LeaseReleaseAll, ListGet, ListInput, ListKind,
    Operation, ReplayInput, StatusGet, TokenList, TokenRevoke, TokenRevokeInput, WorkerDrain,
    WorkerIdInput, WorkerList, WorkerRemove, WorkerUndrain,
};
use simlock_contract::{ContractError, ErrorCode, Push, Role};
use tokio::net::TcpListener;
use tokio::sync::mpsc;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use tracing::{debug, info};

use self::body::{
    Body, error, error_with_status, json as json_response, read_json, sse, sse_event,
    stopping_error,
};
use self::parse::Query;
use self::requests::{RequestBook, Submitted};
use self::responses::{HttpResponses, Route};
use crate::auth::{HttpCaller, authorization, bearer};
use crate::clock::SharedClock;
use crate::context::{CallCtx, Viewer};
use crate::events::EventBus;
use crate::metrics::Metrics;
use crate::pipeline::Pipeline;
use crate::tokens::TokenStore;

/// How long a connection may take to send its request head, and may stay idle between an
/// answer and its next request.
pub const HEADER_READ_TIMEOUT: Duration = Duration::from_secs(30);
/// How long open connections get to finish when the daemon stops.
pub const DRAIN_GRACE: Duration = Duration::from_secs(5);
/// The largest request head (request line, header fields and the blank line that ends them)
/// a connection may send: 64 KiB. Larger answers hyper's own `431` and closes the connection.
///
/// Our callers send a bearer token, an idempotency key and a few standard fields, well under
/// 1 KiB; common servers take no more than 8 to 16 KiB (nginx 8 KiB a line, Node's HTTP server
/// 16 KiB a head), so 64 KiB refuses no real client, while what one connection can make the
/// daemon buffer before routing drops to a sixth of hyper's default (~400 KiB).
///
/// It is hyper's `max_header_size`, which bounds the head alone; the read buffer
/// (`max_buf_size`) keeps its default, so bodies still stream in large reads. hyper's own URI
/// bound (65534 bytes) is never reached first: such a request line is already over this bound,
/// so there is no `414`.
pub const MAX_REQUEST_HEAD: usize = 64 * 1024;
/// The most header fields a request may send: hyper's default, named here. One more answers
/// `431` as [`MAX_REQUEST_HEAD`] does. (Setting it explicitly would move hyper's header array
/// from the stack to the heap, so the default is left in place.)
pub const MAX_REQUEST_HEADERS: usize = 100;

/// The header on the answer a TLS listener gives to plain text (`http://` or `ws://` to an
/// HTTPS port): `x-simlock-tls: required`. The worker's dialler reads it to name the cause.
pub const TLS_REQUIRED_HEADER: &str = "x-simlock-tls";

/// Routes another crate serves on the same listener (it authenticates them itself).
pub trait Mount: Send + Sync + 'static {
    /// Whether this mount serves `path`.
    fn matches(&self, path: &str) -> bool;
    /// Its name in `simlock_http_responses_total`'s `route` label (`/v1/agent-device`).
    fn route(&self) -> &'static str;
    /// Whether it takes a WebSocket upgrade (the gateway's `/v1/uplink`); a request asking
    /// another mount for one answers `404 UNKNOWN_REQUEST`, as on every other route.
    fn takes_websocket(&self) -> bool {
        false
    }
    /// Serves one request.
    fn serve(&self, request: Request<Incoming>) -> BoxFuture<'static, Response<Body>>;
}

/// Everything the routes need.
pub struct HttpApp {
    /// The daemon's pipeline.
    pub pipeline: Arc<Pipeline>,
    /// Bearer tokens.
    pub tokens: Arc<TokenStore>,
    /// Events, for the replay and stream routes.
    pub bus: Arc<EventBus>,
    /// Time.
    pub clock: SharedClock,
    /// Lease requests made over HTTP.
    pub requests: Arc<RequestBook>,
    /// Metrics for `/v1/metrics`.
    pub metrics: Metrics,
    /// The answers given, for `/v1/metrics` (registered there by whoever builds the app).
    pub responses: HttpResponses,
    /// Extra routes.
    pub mounts: Vec<Arc<dyn Mount>>,
}

impl std::fmt::Debug for HttpApp {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HttpApp")
            .field("mounts", &self.mounts.len())
            .finish_non_exhaustive()
    }
}

/// Binds the listener.
///
/// # Errors
/// When the address cannot be bound.
pub async fn bind(host: &str, port: u16) -> std::io::Result<TcpListener> {
    TcpListener::bind((host, port)).await
}

/// Serves HTTP on `listener` until `shutdown`, then gives open connections a short grace. With
/// `tls`, every connection must open with a TLS handshake (HTTPS, and WSS for uplinks); plain
/// text gets a plain `400` saying so.
pub fn serve_http(
    listener: TcpListener,
    app: Arc<HttpApp>,
    tls: Option<simlock_tls::ServerTls>,
    shutdown: CancellationToken,
) -> JoinHandle<()> {
    let acceptor = tls.map(|tls| tls.acceptor());
    tokio::spawn(async move {
        if let Ok(addr) = listener.local_addr() {
            let scheme = if acceptor.is_some() { "HTTPS" } else { "HTTP" };
            info!(%addr, "listening for {scheme}");
        }
        let mut connections = tokio::task::JoinSet::new();
        let mut failures = crate::accept::AcceptFailures::default();
        loop {
            let accepted = tokio::select! {
                () = shutdown.cancelled() => break,
                accepted = listener.accept() => accepted,
            };
            let (stream, peer) = match accepted {
                Ok(found) => found,
                Err(e) => {
                    tokio::select! {
                        () = shutdown.cancelled() => break,
                        () = crate::accept::after_failure(&mut failures, "HTTP", &e) => {}
                    }
                    continue;
                }
            };
            crate::accept::after_success(&mut failures, "HTTP");
            let _ = stream.set_nodelay(true);
            let app = app.clone();
            let shutdown = shutdown.clone();
            connections.spawn(accept_connection(
                stream,
                peer,
                app,
                acceptor.clone(),
                shutdown,
            ));
            while connections.try_join_next().is_some() {}
        }
        let _ = tokio::time::timeout(DRAIN_GRACE, async {
            while connections.join_next().await.is_some() {}
        })
        .await;
        connections.abort_all();
    })
}

/// Serves one accepted connection: plain HTTP, or with `tls` the handshake first. A TLS
/// listener peeks at the first byte: a connection that does not open with a handshake record
/// is plain text, answered by [`tls_required`].
async fn accept_connection(
    stream: tokio::net::TcpStream,
    peer: SocketAddr,
    app: Arc<HttpApp>,
    tls: Option<simlock_tls::TlsAcceptor>,
    shutdown: CancellationToken,
) {
    let stop = shutdown.clone();
    let Some(acceptor) = tls else {
        let service = service_fn(move |request| {
            let (app, stop) = (app.clone(), stop.clone());
            async move { Ok::<_, std::convert::Infallible>(answer(&app, request, &stop).await) }
        });
        return serve_connection(TokioIo::new(stream), peer, service, shutdown).await;
    };
    let mut first = [0u8; 1];
    match tokio::time::timeout(HEADER_READ_TIMEOUT, stream.peek(&mut first)).await {
        Ok(Ok(1..)) if first[0] == simlock_tls::HANDSHAKE_RECORD => {}
        Ok(Ok(1..)) => {
            debug!(%peer, "plain text on the TLS listener");
            let service =
                service_fn(|_request| async { Ok::<_, std::convert::Infallible>(tls_required()) });
            return serve_connection(TokioIo::new(stream), peer, service, shutdown).await;
        }
        // Closed, failed or silent before sending anything.
        _ => return,
    }
    let accepted = tokio::select! {
        () = shutdown.cancelled() => return,
        accepted = tokio::time::timeout(HEADER_READ_TIMEOUT, acceptor.accept(stream)) => accepted,
    };
    let stream = match accepted {
        Ok(Ok(stream)) => stream,
        Ok(Err(e)) => {
            debug!(%peer, error = %e, "TLS handshake failed");
            return;
        }
        Err(_) => {
            debug!(%peer, "TLS handshake timed out");
            return;
        }
    };
    let service = service_fn(move |request| {
        let (app, stop) = (app.clone(), stop.clone());
        async move { Ok::<_, std::convert::Infallible>(answer(&app, request, &stop).await) }
    });
    serve_connection(TokioIo::new(stream), peer, service, shutdown).await;
}

/// The answer to plain text on a TLS listener: `400`, `x-simlock-tls: required`, and the
/// connection closes.
fn tls_required() -> Response<Body> {
    let err = ContractError::bad_request(
        "This port speaks TLS: use https:// (and wss:// for a worker's gateway.url)",
    );
    let mut response = error_with_status(&err, StatusCode::BAD_REQUEST);
    let headers = response.headers_mut();
    headers.insert(
        TLS_REQUIRED_HEADER,
        http::HeaderValue::from_static("required"),
    );
    headers.insert(
        http::header::CONNECTION,
        http::HeaderValue::from_static("close"),
    );
    response
}

async fn serve_connection<I, S>(io: I, peer: SocketAddr, service: S, shutdown: CancellationToken)
where
    I: hyper::rt::Read + hyper::rt::Write + Unpin + Send + 'static,
    S: hyper::service::HttpService<Incoming, ResBody = Body> + Send,
    S::Future: Send + 'static,
    S::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    let mut builder = hyper::server::conn::http1::Builder::new();
    builder
        .timer(TokioTimer::new())
        .header_read_timeout(HEADER_READ_TIMEOUT)
        .max_header_size(MAX_REQUEST_HEAD);
    let connection = builder.serve_connection(io, service).with_upgrades();
    tokio::pin!(connection);
    tokio::select! {
        outcome = connection.as_mut() => {
            if let Err(e) = outcome {
                log_connection_error(peer, &e);
            }
        }
        () = shutdown.cancelled() => {
            connection.as_mut().graceful_shutdown();
            let _ = connection.await;
        }
    }
}

/// Logs how a connection ended with an error. hyper answers a request head it cannot take
/// itself, before any route sees it, with a status and an empty body (its public API offers no
/// way to give that answer a body), so the refusal is logged here, with the peer, to be found
/// next to the caller's side of it.
fn log_connection_error(peer: SocketAddr, e: &hyper::Error) {
    if e.is_parse_too_large() {
        // A caller that may be real, sending more than we take: worth an operator's eye.
        info!(
            %peer,
            status = 431,
            max_head_bytes = MAX_REQUEST_HEAD,
            max_headers = MAX_REQUEST_HEADERS,
            "HTTP request refused: head too large",
        );
    } else if e.is_parse_version_h2() {
        debug!(%peer, "HTTP/2 preface on an HTTP/1.1 listener: closed without an answer");
    } else if e.is_parse() {
        // Not HTTP/1.1 at all, often (TLS to a plain port, a scanner): as quiet as the other
        // transport mismatches.
        debug!(%peer, status = 400, error = %e, "HTTP request refused: malformed head");
    } else {
        debug!(%peer, error = %e, "HTTP connection ended with an error");
    }
}

fn not_found(method: &Method, path: &str) -> Response<Body> {
    let err = ContractError::new(
        ErrorCode::UnknownRequest,
        format!("No route {method} {path}"),
    );
    error_with_status(&err, StatusCode::NOT_FOUND)
}

/// Every route [`route`] serves under `/v1/`: its method and its path, `{}` standing for one
/// segment. A path that one of them matches under another method is answered `405` with
/// `Allow`; a test keeps this table and the match in step.
const ROUTES: &[(&str, &str)] = &[
    ("GET", "healthz"),
    ("GET", "status"),
    ("GET", "catalog"),
    ("GET", "config"),
    ("POST", "lease-requests"),
    ("GET", "lease-requests"),
    ("GET", "lease-requests/{}"),
    ("GET", "lease-requests/{}/events"),
    ("DELETE", "lease-requests/{}"),
    ("GET", "leases"),
    ("DELETE", "leases"),
    ("GET", "leases/{}"),
    ("POST", "leases/{}/renew"),
    ("DELETE", "leases/{}"),
    ("POST", "leases/{}/exec"),
    ("GET", "leases/{}/events"),
    ("GET", "devices"),
    ("GET", "events"),
    ("GET", "events/stream"),
    ("GET", "tokens"),
    ("POST", "tokens"),
    ("DELETE", "tokens/{}"),
    ("GET", "workers"),
    ("POST", "workers/{}/drain"),
    ("DELETE", "workers/{}/drain"),
    ("DELETE", "workers/{}"),
    ("POST", "daemon/stop"),
    ("POST", "ops/{}"),
    ("GET", "metrics"),
];

/// Which route serves `method`, as [`HttpResponses`] counts it: the `mount` the path is under,
/// else the table's shape that fits its `segments` under `/v1/` (under another method too: that
/// is a `405` of the route), or none.
fn route_of(mount: Option<&Arc<dyn Mount>>, method: &Method, segments: Option<&[&str]>) -> Route {
    if let Some(mount) = mount {
        return Route::Mount(mount.route());
    }
    let Some(segments) = segments else {
        return Route::Unmatched;
    };
    let fitting = || {
        ROUTES
            .iter()
            .filter(|(_, shape)| shape_fits(shape, segments))
    };
    fitting()
        .find(|(m, _)| *m == method.as_str())
        .or_else(|| fitting().next())
        .map_or(Route::Unmatched, |(_, shape)| Route::Table(shape))
}

/// Serves one request and counts its answer. Its mount and its path's segments are read once,
/// here, for both.
async fn answer(
    app: &Arc<HttpApp>,
    request: Request<Incoming>,
    stop: &CancellationToken,
) -> Response<Body> {
    let method = request.method().clone();
    let path = request.uri().path();
    let mount = app.mounts.iter().find(|m| m.matches(path)).cloned();
    let segments = path
        .strip_prefix("/v1/")
        .filter(|_| mount.is_none())
        .map(parse::segments);
    let segments: Option<Vec<&str>> = segments
        .as_ref()
        .map(|s| s.iter().map(String::as_str).collect());
    let route = route_of(mount.as_ref(), &method, segments.as_deref());
    let response = self::route(app, request, stop, mount.as_ref(), segments.as_deref()).await;
    app.responses.record(&method, route, response.status());
    response
}

/// The methods [`ROUTES`] serves at `segments` (the path under `/v1/`), in the table's order.
fn allowed_methods(segments: &[&str]) -> Vec<&'static str> {
    let mut methods: Vec<&'static str> = Vec::new();
    for (method, shape) in ROUTES {
        if shape_fits(shape, segments) && !methods.contains(method) {
            methods.push(method);
        }
    }
    methods
}

/// Whether a [`ROUTES`] `shape` fits `segments` (the path under `/v1/`), `{}` fitting any one.
fn shape_fits(shape: &str, segments: &[&str]) -> bool {
    let mut wanted = shape.split('/');
    let mut got = segments.iter();
    loop {
        match (wanted.next(), got.next()) {
            (None, None) => return true,
            (Some(want), Some(got)) if want == "{}" || want == *got => {}
            _ => return false,
        }
    }
}

/// No route for `method` at `path`: `405` with `Allow` when the path is served under other
/// methods, else `404`.
fn no_route(method: &Method, path: &str, segments: &[&str]) -> Response<Body> {
    let allowed = allowed_methods(segments);
    if allowed.is_empty() {
        return not_found(method, path);
    }
    let allow = allowed.join(", ");
    let err = ContractError::new(
        ErrorCode::UnknownRequest,
        format!("No route {method} {path}: it takes {allow}"),
    );
    let mut response = error_with_status(&err, StatusCode::METHOD_NOT_ALLOWED);
    if let Ok(value) = http::HeaderValue::from_str(&allow) {
        response.headers_mut().insert(http::header::ALLOW, value);
    }
    response
}

/// Whether the request asks for a WebSocket: only a mount takes one. Other upgrades (`h2c`)
/// are ignored, as RFC 9110 lets a server do, and the request is served as it is.
fn asks_for_websocket(request: &Request<Incoming>) -> bool {
    request
        .headers()
        .get_all(http::header::UPGRADE)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .any(|protocol| {
            let name = protocol.trim().split('/').next().unwrap_or_default();
            name.eq_ignore_ascii_case("websocket")
        })
}

/// The `Idempotency-Key` header, if sent.
///
/// # Errors
/// `BAD_REQUEST` for a value that is not visible ASCII: dropping it would make a retry a new
/// request.
fn idempotency_key(request: &Request<Incoming>) -> Result<Option<String>, ContractError> {
    let name = http::HeaderName::from_static("idempotency-key");
    crate::auth::single_header(request.headers(), &name, "Idempotency-Key")?
        .map(|v| {
            // Visible ASCII only: not a space either (a header value may hold one).
            v.to_str()
                .ok()
                .filter(|key| key.bytes().all(|b| b.is_ascii_graphic()))
                .map(String::from)
                .ok_or_else(|| {
                    ContractError::bad_request(
                        "Idempotency-Key: must be visible ASCII text (no spaces)",
                    )
                })
        })
        .transpose()
}

/// Serves one request, under `mount` when its path is one's, else by its `segments` under
/// `/v1/` (none: not under it).
async fn route(
    app: &Arc<HttpApp>,
    request: Request<Incoming>,
    stop: &CancellationToken,
    mount: Option<&Arc<dyn Mount>>,
    segments: Option<&[&str]>,
) -> Response<Body> {
    let path = request.uri().path().to_owned();
    let method = request.method().clone();
    if asks_for_websocket(&request) && !mount.is_some_and(|m| m.takes_websocket()) {
        // Only a mount that says so (the gateway's /v1/uplink) takes a WebSocket.
        let err = ContractError::new(
            ErrorCode::UnknownRequest,
            format!(
                "No WebSocket at {path}: only a gateway's /v1/uplink takes one; send the \
                 request without Upgrade"
            ),
        );
        return error_with_status(&err, StatusCode::NOT_FOUND);
    }
    if let Some(mount) = mount {
        return mount.serve(request).await;
    }
    if path == "/v1/healthz" {
        // No token here, for any method; only GET is a route.
        return if method == Method::GET {
            json_response(StatusCode::OK, &json!({ "ok": true }))
        } else {
            no_route(&method, &path, &["healthz"])
        };
    }
    let Some(segments) = segments else {
        return not_found(&method, &path);
    };
    let caller = match authorization(request.headers())
        .and_then(|authorization| bearer(&app.tokens, authorization))
    {
        Ok(caller) => caller,
        Err(err) => return error(&err),
    };
    let query = Query::parse(request.uri().query().unwrap_or(""));
    match (&method, segments) {
        (&Method::GET, ["status"]) => run::<StatusGet>(app, &caller, &Empty {}).await,
        (&Method::GET, ["catalog"]) => {
            let platform = match query
                .get("platform")
                .and_then(|p| p.map(platform).transpose())
            {
                Ok(platform) => platform,
                Err(err) => return error(&err),
            };
            run::<CatalogGet>(app, &caller, &CatalogInput { platform }).await
        }
        (&Method::GET, ["config"]) => run::<ConfigGet>(app, &caller, &Empty {}).await,
        (&Method::POST, ["lease-requests"]) => submit_request(app, &caller, request).await,
        (&Method::GET, ["lease-requests"]) => {
            let kind = ListKind::Requests;
            run::<ListGet>(app, &caller, &ListInput { kind }).await
        }
        (&Method::GET, ["lease-requests", id]) => {
            let wait = match query.get("wait") {
                Ok(wait) => parse::wait(wait, requests::MAX_WAIT),
                Err(err) => return error(&err),
            };
            let (principal, role) = (caller.token.id.as_str(), caller.role);
            // A stop answers a long-poll at once, with the view as it stands.
            let polled = tokio::select! {
                polled = app.requests.poll(id, principal, role, wait) => polled,
                () = stop.cancelled() => app.requests.poll(id, principal, role, Duration::ZERO).await,
            };
            match polled {
                Ok(view) => json_response(StatusCode::OK, &json!({ "request": view })),
                Err(err) => error(&err),
            }
        }
        (&Method::GET, ["lease-requests", id, "events"]) => request_events(app, &caller, id, stop),
        (&Method::DELETE, ["lease-requests", id]) => {
            match app
                .requests
                .cancel(&app.pipeline, id, caller.token.id.as_str(), caller.role)
                .await
            {
                Ok(()) => no_content(),
                Err(err) => error(&err),
            }
        }
        (&Method::GET, ["leases"]) => run::<LeaseList>(app, &caller, &Empty {}).await,
        (&Method::DELETE, ["leases"]) => run::<LeaseReleaseAll>(app, &caller, &Empty {}).await,
        (&Method::GET, ["leases", id]) => match visible_lease(app, &caller, id).await {
            Ok(lease) => json_response(StatusCode::OK, &json!({ "lease": lease })),
            Err(err) => error(&err),
        },
        (&Method::POST, ["leases", id, "renew"]) => {
            let id = (*id).to_owned();
            with_body(request, move |mut body| async move {
                // A misspelt key would renew with the lease's own width: refused instead.
                if let Err(err) = known_keys(&body, &["ttlMs"]) {
                    return error(&err);
                }
                body.insert("leaseId".into(), Value::String(id));
                op(app, &caller, "lease.renew", Value::Object(body)).await
            })
            .await
        }
        (&Method::DELETE, ["leases", id]) => {
            let lease_id = (*id).to_owned();
            run::<LeaseRelease>(
                app,
                &caller,
                &LeaseIdInput {
                    reason: None,
                    lease_id,
                },
            )
            .await
        }
        (&Method::POST, ["leases", id, "exec"]) => {
            let id = (*id).to_owned();
            with_body(request, move |mut body| async move {
                // The path names the lease; a body that names another is a mistake, not a choice.
                if let Some(named) = body.get("leaseId").filter(|named| **named != *id) {
                    return error(&ContractError::bad_request(format!(
                        "leaseId: the body names {named} and the path {id}; leave it out of the \
                         body"
                    )));
                }
                body.insert("leaseId".into(), Value::String(id));
                exec(app, &caller, Value::Object(body), stop).await
            })
            .await
        }
        (&Method::GET, ["leases", id, "events"]) => lease_events(app, &caller, id, stop).await,
        (&Method::GET, ["devices"]) => {
            let kind = ListKind::Devices;
            run::<ListGet>(app, &caller, &ListInput { kind }).await
        }
        (&Method::GET, ["events"]) => {
            let since_ts = match query
                .get("since")
                .and_then(|s| s.map(parse::since).transpose())
            {
                Ok(since) => since.map(|ms| app.clock.now_ms().saturating_sub(ms)),
                Err(err) => return error(&err),
            };
            run::<EventsReplay>(app, &caller, &ReplayInput { since_ts }).await
        }
        (&Method::GET, ["events", "stream"]) => event_stream(app, &caller, stop),
        (&Method::GET, ["tokens"]) => run::<TokenList>(app, &caller, &Empty {}).await,
        (&Method::POST, ["tokens"]) => {
            let response = with_body(request, |body| async move {
                // A misspelt label would mint a token without one: refused instead.
                if let Err(err) = known_keys(&body, &["role", "label"]) {
                    return error(&err);
                }
                op(app, &caller, "token.create", Value::Object(body)).await
            })
            .await;
            created(response)
        }
        (&Method::DELETE, ["tokens", id]) => {
            let id = (*id).to_owned();
            run::<TokenRevoke>(app, &caller, &TokenRevokeInput { id }).await
        }
        (&Method::GET, ["workers"]) => run::<WorkerList>(app, &caller, &Empty {}).await,
        (&Method::POST, ["workers", id, "drain"]) => {
            let worker_id = (*id).to_owned();
            run::<WorkerDrain>(app, &caller, &WorkerIdInput { worker_id }).await
        }
        (&Method::DELETE, ["workers", id, "drain"]) => {
            let worker_id = (*id).to_owned();
            run::<WorkerUndrain>(app, &caller, &WorkerIdInput { worker_id }).await
        }
        (&Method::DELETE, ["workers", id]) => {
            let worker_id = (*id).to_owned();
            run::<WorkerRemove>(app, &caller, &WorkerIdInput { worker_id }).await
        }
        (&Method::POST, ["daemon", "stop"]) => run::<DaemonStop>(app, &caller, &Empty {}).await,
        (&Method::POST, ["ops", name]) => {
            let name = (*name).to_owned();
            with_body(request, move |body| async move {
                op(app, &caller, &name, Value::Object(body)).await
            })
            .await
        }
        (&Method::GET, ["metrics"]) => {
            if caller.role != Role::Admin {
                return error(&ContractError::forbidden(
                    "/v1/metrics requires an operator token",
                ));
            }
            let mut response = Response::new(body::full(app.metrics.render()));
            response.headers_mut().insert(
                http::header::CONTENT_TYPE,
                http::HeaderValue::from_static("text/plain; version=0.0.4; charset=utf-8"),
            );
            response
        }
        _ => no_route(&method, &path, segments),
    }
}

fn caller_ctx(caller: &HttpCaller, pushes: Option<mpsc::Sender<Push>>) -> CallCtx {
    CallCtx::http(caller.token.id.to_string(), caller.role, pushes)
}

/// Runs `name` with `payload` and answers its output or error.
/// Runs operation `O` with `input`, through the pipeline as a socket call would (the input is
/// checked there like any caller's), and answers its output as it is.
async fn run<O: Operation>(app: &HttpApp, caller: &HttpCaller, input: &O::Input) -> Response<Body> {
    match serde_json::to_value(input) {
        Ok(payload) => op(app, caller, O::NAME, payload).await,
        Err(e) => error(&ContractError::internal(e.to_string())),
    }
}

/// The platform a query names.
fn platform(name: &str) -> Result<Platform, ContractError> {
    Platform::from_wire(name).ok_or_else(|| {
        ContractError::bad_request(format!("platform: {name:?} is not ios or android"))
    })
}

async fn op(app: &HttpApp, caller: &HttpCaller, name: &str, payload: Value) -> Response<Body> {
    match app
        .pipeline
        .call(caller_ctx(caller, None), name, Some(payload))
        .await
    {
        Ok(value) => json_response(StatusCode::OK, &value),
        Err(err) => error(&err),
    }
}

async fn with_body<F, Fut>(request: Request<Incoming>, then: F) -> Response<Body>
where
    F: FnOnce(Map<String, Value>) -> Fut,
    Fut: Future<Output = Response<Body>>,
{
    match read_json(request.into_body()).await {
        Ok(Value::Object(body)) => then(body).await,
        Ok(_) => error(&ContractError::bad_request("body: must be a JSON object")),
        Err(err) => error(&err),
    }
}

fn no_content() -> Response<Body> {
    let mut response = Response::new(body::empty());
    *response.status_mut() = StatusCode::NO_CONTENT;
    response
}

fn created(mut response: Response<Body>) -> Response<Body> {
    if response.status() == StatusCode::OK {
        *response.status_mut() = StatusCode::CREATED;
    }
    response
}

/// Refuses a body holding a key outside `known`, naming it and what is accepted.
///
/// # Errors
/// `BAD_REQUEST`: `<key>: unknown field, expected one of [...]`.
fn known_keys(body: &Map<String, Value>, known: &[&str]) -> Result<(), ContractError> {
    match body.keys().find(|key| !known.contains(&key.as_str())) {
        Some(key) => Err(ContractError::bad_request(format!(
            "{key}: unknown field, expected one of {known:?}"
        ))),
        None => Ok(()),
    }
}

async fn submit_request(
    app: &Arc<HttpApp>,
    caller: &HttpCaller,
    request: Request<Incoming>,
) -> Response<Body> {
    let idempotency_key = match idempotency_key(&request) {
        Ok(key) => key,
        Err(err) => return error(&err),
    };
    let input = match read_json(request.into_body()).await {
        Ok(body @ Value::Object(_)) => LeaseRequestBody::decode(body, idempotency_key),
        Ok(_) => Err(ContractError::bad_request("body: must be a JSON object")),
        Err(err) => Err(err),
    };
    let input = match input {
        Ok(input) => input,
        Err(err) => return error(&err),
    };
    let principal = caller.token.id.to_string();
    match app
        .requests
        .submit(&app.pipeline, principal, caller.role, &input)
        .await
    {
        Submitted::Accepted(view) => {
            let mut response = json_response(StatusCode::CREATED, &json!({ "request": view }));
            if let Ok(location) =
                http::HeaderValue::from_str(&format!("/v1/lease-requests/{}", view.id))
            {
                response
                    .headers_mut()
                    .insert(http::header::LOCATION, location);
            }
            response
        }
        Submitted::Refused(err) => error(&err),
    }
}

fn request_events(
    app: &Arc<HttpApp>,
    caller: &HttpCaller,
    id: &str,
    stop: &CancellationToken,
) -> Response<Body> {
    let rx = match app.requests.view(id, caller.token.id.as_str(), caller.role) {
        Ok(rx) => rx,
        Err(err) => return error(&err),
    };
    // An event for every change of the view (state, position, why it waits, ETA), none for a
    // push that changed nothing.
    let events = futures::stream::unfold((rx, None, false), |(mut rx, last, done)| async move {
        if done {
            return None;
        }
        loop {
            let view = rx.borrow_and_update().clone();
            if last.as_ref() != Some(&view) {
                let value = serde_json::to_value(&view).unwrap_or(Value::Null);
                let bytes = sse_event(view.state.as_str(), &value);
                let settled = view.state.is_settled();
                return Some((bytes, (rx, Some(view), settled)));
            }
            if rx.changed().await.is_err() {
                return None;
            }
        }
    });
    sse(events, stop, stopping_event())
}

async fn visible_lease(
    app: &HttpApp,
    caller: &HttpCaller,
    id: &str,
) -> Result<LeaseRecord, ContractError> {
    // An id that is no lease id is refused as renew and release refuse it (the input's check),
    // not looked up, nor echoed back whole in a 404.
    let input = LeaseGetInput {
        lease_id: id.to_owned(),
    };
    let answer = app
        .pipeline
        .call_typed::<LeaseGet>(caller_ctx(caller, None), &input)
        .await?;
    Ok(answer.lease)
}

async fn lease_events(
    app: &Arc<HttpApp>,
    caller: &HttpCaller,
    id: &str,
    stop: &CancellationToken,
) -> Response<Body> {
    // Follow first, then check the lease, so nothing between the two is missed.
    let notices = app.pipeline.presence().follow();
    if let Err(err) = visible_lease(app, caller, id).await {
        return error(&err);
    }
    let (principal, role, id) = (caller.token.id.to_string(), caller.role, id.to_owned());
    let events = futures::stream::unfold((notices, false), move |(mut rx, done)| {
        let (principal, id) = (principal.clone(), id.clone());
        async move {
            if done {
                return None;
            }
            loop {
                let notice = match rx.recv().await {
                    Ok(notice) => notice,
                    Err(tokio::sync::broadcast::error::RecvError::Lagged(_)) => continue,
                    Err(tokio::sync::broadcast::error::RecvError::Closed) => return None,
                };
                let lease = match &notice.push {
                    Push::LeaseLost { lease_id, .. }
                    | Push::DeviceUnhealthy { lease_id, .. }
                    | Push::DeviceRecovered { lease_id, .. } => lease_id.clone(),
                    Push::Progress { .. }
                    | Push::Started { .. }
                    | Push::Output { .. }
                    | Push::Event { .. }
                    | Push::RelayHead { .. } => continue,
                };
                if lease != id || !Viewer::new(&principal, role).may_see(&notice.owner) {
                    continue;
                }
                let payload = notice.push.payload().unwrap_or(Value::Null);
                let end = matches!(notice.push, Push::LeaseLost { .. });
                return Some((sse_event(notice.push.kind(), &payload), (rx, end)));
            }
        }
    });
    sse(events, stop, stopping_event())
}

async fn exec(
    app: &Arc<HttpApp>,
    caller: &HttpCaller,
    payload: Value,
    stop: &CancellationToken,
) -> Response<Body> {
    let (tx, mut rx) = mpsc::channel::<Push>(16);
    let call = app
        .pipeline
        .call(caller_ctx(caller, Some(tx)), "device.exec", Some(payload));
    let mut call = Box::pin(call);
    // Pre-spawn failures answer as JSON; the stream commits at `started`.
    loop {
        tokio::select! {
            biased;
            push = rx.recv() => match push {
                Some(Push::Started { .. }) => break,
                Some(_) => {}
                None => break,
            },
            outcome = &mut call => {
                // The run may have finished in the same turn as its pushes: keep them.
                let mut events = Vec::new();
                while let Ok(push) = rx.try_recv() {
                    if let Push::Output { stream, chunk, .. } = push {
                        events.push(sse_event("output", &json!({ "stream": stream, "chunk": chunk })));
                    } else if matches!(push, Push::Started { .. }) {
                        events.clear();
                    }
                }
                return match outcome {
                    Ok(value) => {
                        events.push(sse_event("exit", &value));
                        sse(futures::stream::iter(events), stop, Bytes::new())
                    }
                    Err(err) if events.is_empty() => error(&err),
                    Err(err) => {
                        events.push(sse_event("error", &json!({ "error": err.to_body().to_inline() })));
                        sse(futures::stream::iter(events), stop, Bytes::new())
                    }
                };
            }
        }
    }
    let events = futures::stream::unfold(Some((rx, call)), |state| async move {
        let (mut rx, mut call) = state?;
        tokio::select! {
            biased;
            Some(push) = rx.recv() => {
                let bytes = match &push {
                    Push::Output { stream, chunk, .. } => sse_event("output", &json!({ "stream": stream, "chunk": chunk })),
                    _ => Bytes::new(),
                };
                Some((bytes, Some((rx, call))))
            }
            outcome = &mut call => {
                // Drain output that raced the outcome.
                let mut tail = Vec::new();
                while let Ok(Push::Output { stream, chunk, .. }) = rx.try_recv() {
                    tail.extend_from_slice(&sse_event("output", &json!({ "stream": stream, "chunk": chunk })));
                }
                let last = match outcome {
                    Ok(value) => sse_event("exit", &value),
                    Err(err) => sse_event("error", &json!({ "error": err.to_body().to_inline() })),
                };
                tail.extend_from_slice(&last);
                Some((Bytes::from(tail), None))
            }
        }
    })
    .filter(|bytes| futures::future::ready(!bytes.is_empty()));
    // A stop ends the stream with the one `error` an exec stream may end with; the tool runs on.
    sse(events, stop, error_event(&stopping_error()))
}

fn event_stream(
    app: &Arc<HttpApp>,
    caller: &HttpCaller,
    stop: &CancellationToken,
) -> Response<Body> {
    if caller.role != Role::Admin {
        return error(&ContractError::forbidden(
            "/v1/events/stream requires an operator token",
        ));
    }
    let rx = app.bus.follow();
    let events = futures::stream::unfold(rx, |mut rx| async move {
        match rx.recv().await {
            Ok(event) => {
                let value = serde_json::to_value(&event).unwrap_or(Value::Null);
                Some((sse_event("event", &value), rx))
            }
            Err(tokio::sync::broadcast::error::RecvError::Lagged(missed)) => {
                Some((sse_event("lagged", &json!({ "missed": missed })), rx))
            }
            Err(tokio::sync::broadcast::error::RecvError::Closed) => None,
        }
    });
    sse(events, stop, stopping_event())
}

/// The `error` event of an exec stream.
fn error_event(err: &ContractError) -> Bytes {
    sse_event("error", &json!({ "error": err.to_body().to_inline() }))
}

/// The last event of a lease-request, lease or event stream when the daemon stops.
fn stopping_event() -> Bytes {
    let data = json!({ "error": stopping_error().to_body().to_inline() });
    sse_event("stopping", &data)
}
