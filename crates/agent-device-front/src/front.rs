//! The front: `/v1/agent-device/*` behind simlock's bearer auth, over a [`HostLink`].
//!
//! It owns the agent-device leases it makes. An allocate mints the lease id `L`, makes a
//! simlock lease with id `L`, requester `L` and owner the token's principal, waits for the
//! grant, then forwards the allocate naming the granted device with the ceiling TTL (the
//! least of 600 000 ms, the holding daemon's `lease.maxTtlMs` and `agentDevice.leaseTtlCapMs`).
//! Commands are owner-checked and pinned to `L`'s device; a heartbeat goes to agent-device
//! first, then renews the simlock lease; a release goes to agent-device first, then releases
//! the simlock lease. A command that runs longer than the TTL renews every TTL/3.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use futures::FutureExt;
use futures::future::BoxFuture;
use http::header::{HOST, HeaderName, HeaderValue};
use http::{HeaderMap, Method, Request, Response, StatusCode, Uri};
use http_body_util::BodyExt;
use hyper::body::Incoming;
use serde_json::{Value, json};
use simlock_contract::model::{LeaseGrant, LeaseRecord};
use simlock_contract::ops::{
    LeaseCancel, LeaseCancelInput, LeaseIdInput, LeaseRelease, LeaseRenew, LeaseRenewInput,
    LeaseRequest, LeaseRequestInput,
};
use simlock_contract::{ContractError, ErrorCode};
use simlock_daemon::CallCtx;
use simlock_daemon::http::Mount;
use simlock_daemon::pipeline::Pipeline;
use simlock_daemon::tokens::TokenStore;
use tokio::sync::oneshot;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};

use crate::body::json as json_response;
use crate::body::{Guarded, ProgressTail, read_caller_body, read_to_bytes};
use crate::lease_id::{LEASE_HEADER, LeaseId};
use crate::leases::{FrontLease, FrontLeases};
use crate::port::{Caller, HostLink, HostStatus, Hosts, KeptRelease, Serving, StatusScope};
use crate::renewal::{self, KeepAsk, RenewAsk, Renewal};
use crate::reply::{Refusal, Surface};
use crate::rpc::{Answer, MAX_RPC_BODY, Method as RpcMethod, RpcCall, device_key};
use crate::{Body, PREFIX};

/// agent-device's own ceiling on a lease's TTL.
pub const AGENT_DEVICE_MAX_TTL_MS: u64 = 600_000;
/// The largest upload preflight body: agent-device's own cap, 64 KiB.
pub const MAX_PREFLIGHT_BODY: usize = 64 * 1024;
/// The longest a stop waits for the waiting allocates to withdraw and the renewals to end.
pub const STOP_BOUND: Duration = Duration::from_secs(10);
/// The largest answer the front reads whole (lease answers, preflight tickets, device lists).
const MAX_ANSWER: usize = 4 * 1024 * 1024;
/// Why a host could not be reached once the daemon serving the front is stopping.
pub const STOPPING: &str = "this simlock daemon is stopping; retry once it is back";

/// What a front is built from.
pub struct FrontOptions {
    /// How it reaches agent-device.
    pub link: Arc<dyn HostLink>,
    /// The daemon's own operations, for the simlock leases.
    pub pipeline: Arc<Pipeline>,
    /// simlock's tokens, for bearer auth.
    pub tokens: Arc<TokenStore>,
    /// `agentDevice.leaseTtlCapMs`.
    pub lease_ttl_cap_ms: Option<u64>,
    /// This daemon's `lease.maxTtlMs`.
    pub max_ttl_ms: u64,
    /// `agentDevice.queueWaitMs`.
    pub queue_wait_ms: u64,
}

impl std::fmt::Debug for FrontOptions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FrontOptions")
            .field("lease_ttl_cap_ms", &self.lease_ttl_cap_ms)
            .field("max_ttl_ms", &self.max_ttl_ms)
            .field("queue_wait_ms", &self.queue_wait_ms)
            .finish_non_exhaustive()
    }
}

/// The agent-device front of one daemon.
#[derive(Clone)]
pub struct Front {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for Front {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Front")
            .field("leases", &self.inner.leases.len())
            .finish_non_exhaustive()
    }
}

struct Inner {
    link: Arc<dyn HostLink>,
    pipeline: Arc<Pipeline>,
    tokens: Arc<TokenStore>,
    lease_ttl_cap_ms: Option<u64>,
    max_ttl_ms: u64,
    queue_wait_ms: u64,
    leases: FrontLeases,
    /// Releases a gateway carries out once the worker holding their lease is back
    /// ([`release_later`]).
    releasing: parking_lot::Mutex<std::collections::HashSet<LeaseId>>,
    /// The last healthy `/health` answer of a host ([`health`]).
    health: parking_lot::Mutex<KeptHealth>,
    /// Fires when the daemon stops: waiting allocates end cancelled, renewals stop.
    stop: CancellationToken,
    /// The allocates waiting for a grant and the renewals of running commands, so a stop can
    /// wait until each allocate withdrew its request and no renewal is in flight.
    waiting: tokio_util::task::TaskTracker,
}

impl Front {
    /// A front over `options.link`.
    pub fn new(options: FrontOptions) -> Self {
        Self {
            inner: Arc::new(Inner {
                link: options.link,
                pipeline: options.pipeline,
                tokens: options.tokens,
                lease_ttl_cap_ms: options.lease_ttl_cap_ms,
                max_ttl_ms: options.max_ttl_ms,
                queue_wait_ms: options.queue_wait_ms,
                leases: FrontLeases::default(),
                releasing: parking_lot::Mutex::default(),
                health: parking_lot::Mutex::default(),
                stop: CancellationToken::new(),
                waiting: tokio_util::task::TaskTracker::new(),
            }),
        }
    }

    /// Ends the simlock leases that agent-device leases of an earlier daemon stood on, for a
    /// worker that started its daemon anew (which holds none of them): of `leases` (the
    /// worker's simlock leases at start), those the front made ([`made_by_front`]) are
    /// released at once, freeing their devices for the queue, and remembered as ended, so each
    /// owner's next call answers `LEASE_ENDED_BY_HOST` (ADR 0028). Answers the ones ended.
    pub async fn end_earlier_daemons_leases(&self, leases: &[LeaseRecord]) -> Vec<LeaseId> {
        self.end_front_leases(leases, |_| true).await
    }

    /// Ends the simlock leases of the agent-device leases `lost` with a daemon that died while
    /// the worker ran (its host restarted it; the new one holds none of them), as
    /// [`Self::end_earlier_daemons_leases`] does for a worker's start: of `leases` (the
    /// worker's simlock leases now), those the front made and `lost` names. A lease made since,
    /// on the new daemon, is not among them. Answers the ones ended.
    pub async fn end_lost_leases(&self, lost: &[LeaseId], leases: &[LeaseRecord]) -> Vec<LeaseId> {
        self.end_front_leases(leases, |lease| lost.contains(lease))
            .await
    }

    /// Of `leases`, releases those the front made that `pick` picks ([`front_leases`]),
    /// remembering each as ended for its owner.
    async fn end_front_leases(
        &self,
        leases: &[LeaseRecord],
        pick: impl Fn(&LeaseId) -> bool,
    ) -> Vec<LeaseId> {
        let mut ended = Vec::new();
        for (lease, record) in front_leases(leases, pick) {
            self.inner
                .leases
                .end(&lease, &record.owner_id, Instant::now());
            let ctx =
                CallCtx::internal(record.owner_id.clone(), simlock_contract::Role::Agent, None);
            release_simlock_lease(&self.inner.pipeline, ctx, &lease).await;
            ended.push(lease);
        }
        ended
    }

    /// Resumes the releases an earlier run of this daemon answered `released: true` and had
    /// not carried out (a second gateway restart before the lease's worker was back), each
    /// until its lease's TTL (`release_later`). The composition calls it before the front
    /// serves, inside the runtime.
    pub fn resume_releases(&self) {
        for kept in self.inner.link.kept_releases() {
            if !self.inner.releasing.lock().insert(kept.lease.clone()) {
                continue;
            }
            info!(lease = %kept.lease, "a release asked for before a restart is carried out once the lease's worker is back");
            let inner = self.inner.clone();
            self.inner
                .waiting
                .spawn(async move { resume_release(&inner, kept).await });
        }
    }

    /// The HTTP mount serving `/v1/agent-device/*`.
    pub fn mount(&self) -> Arc<dyn Mount> {
        Arc::new(FrontMount {
            inner: self.inner.clone(),
        })
    }

    /// Stops: allocates still waiting withdraw their lease requests (they end cancelled, not
    /// with the daemon's `DAEMON_STOPPING`), and running commands stop renewing. Call it before
    /// the daemon's domain stops; it waits (at most [`STOP_BOUND`]) until every waiting
    /// allocate withdrew and every renewal ended, so none is sent after it returns.
    pub async fn stop(&self) {
        self.inner.stop.cancel();
        self.inner.waiting.close();
        if tokio::time::timeout(STOP_BOUND, self.inner.waiting.wait())
            .await
            .is_err()
        {
            warn!("waiting allocates and renewals did not end within {STOP_BOUND:?}");
        }
    }
}

struct FrontMount {
    inner: Arc<Inner>,
}

impl Mount for FrontMount {
    fn route(&self) -> &'static str {
        PREFIX
    }

    fn matches(&self, path: &str) -> bool {
        path == PREFIX
            || path
                .strip_prefix(PREFIX)
                .is_some_and(|rest| rest.starts_with('/'))
    }

    fn serve(&self, request: Request<Incoming>) -> BoxFuture<'static, Response<Body>> {
        let inner = self.inner.clone();
        async move {
            let (parts, body) = request.into_parts();
            let body = body
                .map_err(|e| -> crate::BoxError { Box::new(e) })
                .boxed_unsync();
            serve(inner, Request::from_parts(parts, body)).await
        }
        .boxed()
    }
}

/// The routes of `/v1/agent-device`, as agent-device's daemon serves them at its root.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Route {
    Health,
    Rpc,
    Upload,
    Preflight,
    Direct,
    Finalize,
    Artifacts,
    Artifact,
    Diagnostics,
}

/// Whether a path segment, percent-decoded, can name an upload, an artifact, a session or a
/// request: not empty, not `.` or `..`, no slash, backslash or control character (trial 13:
/// `..%2F` reached the daemon, which answered 500). agent-device's own ids are UUIDs.
fn path_name(segment: &str) -> bool {
    let id = simlock_daemon::http::parse::percent_decode(segment);
    !matches!(id.as_str(), "" | "." | "..")
        && !id
            .chars()
            .any(|c| c == '/' || c == '\\' || c.is_control() || c == char::REPLACEMENT_CHARACTER)
}

impl Route {
    fn parse(method: &Method, path: &str) -> Option<Self> {
        let rest = path.strip_prefix(PREFIX)?;
        let segments: Vec<&str> = rest.trim_start_matches('/').split('/').collect();
        let route = match (method, segments.as_slice()) {
            (&Method::GET, ["health"]) => Self::Health,
            (&Method::POST, ["rpc"]) => Self::Rpc,
            (&Method::POST, ["upload"]) => Self::Upload,
            (&Method::POST, ["upload", "preflight"]) => Self::Preflight,
            (&Method::PUT, ["upload", "direct", id]) if path_name(id) => Self::Direct,
            (&Method::POST, ["upload", "finalize"]) => Self::Finalize,
            (&Method::GET, ["artifacts"]) => Self::Artifacts,
            (&Method::GET, ["artifacts", id]) if path_name(id) => Self::Artifact,
            (&Method::GET, ["sessions", s, "requests", r, "diagnostics"])
                if path_name(s) && path_name(r) =>
            {
                Self::Diagnostics
            }
            _ => return None,
        };
        Some(route)
    }
}

async fn serve(inner: Arc<Inner>, mut request: Request<Body>) -> Response<Body> {
    // simlock's own headers between a front and a host are never a caller's to send.
    renewal::strip(request.headers_mut());
    let Some(route) = Route::parse(request.method(), request.uri().path()) else {
        // As the rest of `/v1` answers: a caller without a valid token hears that first, so
        // no route is told apart without one.
        let refusal = authenticate(&inner.tokens, request.headers())
            .map_or_else(|refusal| refusal, |_| Refusal::NotFound);
        return refusal.into_response(&Surface::Route);
    };
    let surface = if route == Route::Rpc {
        Surface::Rpc { id: Value::Null }
    } else {
        Surface::Route
    };
    let request = match absolute(request) {
        Ok(request) => request,
        Err(refusal) => return refusal.into_response(&surface),
    };
    if route == Route::Health {
        return health(inner, request).await;
    }
    let caller = match authenticate(&inner.tokens, request.headers()) {
        Ok(caller) => caller,
        Err(refusal) => return refusal.into_response(&surface),
    };
    let outcome = if route == Route::Rpc {
        rpc(inner, caller, request).await
    } else {
        auxiliary(inner, caller, route, request).await
    };
    outcome.unwrap_or_else(|(refusal, surface)| refusal.into_response(&surface))
}

/// A failure the front answers, in the envelope of the request that failed.
type Failed = (Refusal, Surface);

const fn route_fail(refusal: Refusal) -> Failed {
    (refusal, Surface::Route)
}

/// The request with an absolute URI as the caller addressed it (`Host`, and
/// `x-forwarded-proto` when a proxy set it), which the host rewrites upload tickets to.
fn absolute(request: Request<Body>) -> Result<Request<Body>, Refusal> {
    let (mut parts, body) = request.into_parts();
    if parts.uri.scheme().is_none() {
        let host = parts
            .headers
            .get(HOST)
            .and_then(|h| h.to_str().ok())
            .filter(|h| !h.is_empty())
            .unwrap_or("localhost")
            .to_owned();
        let scheme = parts
            .headers
            .get("x-forwarded-proto")
            .and_then(|h| h.to_str().ok())
            .filter(|p| *p == "https")
            .unwrap_or("http");
        let path = parts
            .uri
            .path_and_query()
            .map_or_else(|| parts.uri.path().to_owned(), ToString::to_string);
        parts.uri =
            Uri::try_from(format!("{scheme}://{host}{path}")).map_err(|_| Refusal::Invalid {
                rpc_code: -32600,
                message: "the request's Host header does not make a URL".into(),
            })?;
    }
    Ok(Request::from_parts(parts, body))
}

/// agent-device's own token header, which its CLI sends beside `Authorization`.
const TOKEN_HEADER: &str = "x-agent-device-token";

/// The simlock token in `Authorization: Bearer` (what the CLI sends as its daemon token), or
/// in `x-agent-device-token` (the CLI sends both, alike). Either sent twice, or the two naming
/// different secrets, is refused: which one counts would be a guess.
fn authenticate(tokens: &TokenStore, headers: &HeaderMap) -> Result<Caller, Refusal> {
    let bearer = simlock_daemon::auth::authorization(headers)
        .map_err(|e| Refusal::Unauthenticated(e.message))?
        .filter(|v| !v.is_empty())
        .map(String::from);
    let token = simlock_daemon::auth::single_header(
        headers,
        &HeaderName::from_static(TOKEN_HEADER),
        TOKEN_HEADER,
    )
    .map_err(|e| Refusal::Unauthenticated(e.message))?
    .map(|v| v.to_str().unwrap_or_default())
    .filter(|t| !t.is_empty());
    if let (Some(bearer), Some(token)) = (&bearer, token)
        && simlock_daemon::auth::bearer_secret(Some(bearer))
            .is_ok_and(|secret| secret != token.trim())
    {
        return Err(Refusal::Unauthenticated(format!(
            "Authorization and {TOKEN_HEADER} name different tokens; send one, or the same in both"
        )));
    }
    let header = bearer.or_else(|| token.map(|t| format!("Bearer {t}")));
    let refused = |e: ContractError| match e.code {
        ErrorCode::Forbidden => Refusal::Forbidden(e.message),
        ErrorCode::Unauthenticated => Refusal::Unauthenticated(e.message),
        _ => Refusal::NotAvailable {
            reason: format!("the token could not be checked: {}", e.message),
            retriable: true,
        },
    };
    let secret = simlock_daemon::auth::bearer_secret(header.as_deref()).map_err(refused)?;
    let caller = simlock_daemon::auth::http_caller(tokens, secret).map_err(refused)?;
    Ok(Caller {
        principal: caller.token.id.as_str().to_owned(),
        role: caller.role,
        credential: secret.to_owned(),
    })
}

/// `/health`: the host's health when one serves; otherwise the front's own answer, always
/// with status 200 (the CLI hides the reason of a health answer at 500 or above).
///
/// The CLI asks it before each call and gives up after a few seconds: a host that does not
/// answer within [`HEALTH_BOUND`] (an uplink that stalled, not yet declared dead) is answered
/// by the host's last healthy answer, at most [`HEALTH_KEPT`] old, so the call itself (a
/// `disconnect`'s release above all) is still sent, and answered by the front.
async fn health(inner: Arc<Inner>, request: Request<Body>) -> Response<Body> {
    let refusal = match inner.link.status(StatusScope::NewLease).serving() {
        Ok(_) => {
            // The bound covers the answer's body too: a host may stall after its head.
            let answered = async {
                let response = inner.link.forward(request, None, None).await?;
                Ok::<_, Refusal>(keep_health(&inner, response).await)
            };
            match tokio::time::timeout(HEALTH_BOUND, answered).await {
                // A host that answered it cannot serve says why; the CLI hides the reason of a
                // health answer at 500 or above, so it is answered as 200.
                Ok(Ok(response)) => return response,
                Ok(Err(refusal)) => refusal,
                Err(_) => match kept_health(&inner) {
                    Some(response) => return response,
                    None => Refusal::NotAvailable {
                        reason: format!(
                            "the agent-device daemon did not answer its health within {} ms",
                            HEALTH_BOUND.as_millis()
                        ),
                        retriable: true,
                    },
                },
            }
        }
        Err(refusal) => refusal,
    };
    refusal.into_response_with_status(&Surface::Route, StatusCode::OK)
}

/// How long `/health` waits for a host before it answers the last healthy answer.
const HEALTH_BOUND: Duration = Duration::from_secs(1);
/// How old a kept healthy answer may be.
const HEALTH_KEPT: Duration = Duration::from_secs(600);

/// `response`, a host's health answer, as the CLI gets it (a 5xx as 200); a healthy one is kept
/// ([`KeptHealth`]).
async fn keep_health(inner: &Inner, response: Response<Body>) -> Response<Body> {
    let (mut parts, body) = response.into_parts();
    if parts.status.is_server_error() {
        parts.status = StatusCode::OK;
    }
    let Ok(bytes) = read_to_bytes(body, MAX_ANSWER).await else {
        return Refusal::NotAvailable {
            reason: "the agent-device daemon's health answer could not be read".into(),
            retriable: true,
        }
        .into_response_with_status(&Surface::Route, StatusCode::OK);
    };
    inner
        .health
        .lock()
        .offer(&parts, &bytes, Instant::now().into_std());
    Response::from_parts(parts, crate::body::full(bytes))
}

/// A host's last healthy `/health` answer (status 200, a JSON body with `ok: true`), and when it
/// came; time is an input.
#[derive(Debug, Default)]
struct KeptHealth {
    kept: Option<(http::response::Parts, Bytes, std::time::Instant)>,
}

impl KeptHealth {
    /// Keeps `parts` and `bytes`, answered `at`, when they are a healthy answer.
    fn offer(&mut self, parts: &http::response::Parts, bytes: &Bytes, at: std::time::Instant) {
        let healthy = serde_json::from_slice::<Value>(bytes)
            .is_ok_and(|v| v.get("ok") == Some(&Value::Bool(true)));
        if parts.status == StatusCode::OK && healthy {
            self.kept = Some((parts.clone(), bytes.clone(), at));
        }
    }

    /// The kept answer, when it is at most [`HEALTH_KEPT`] old at `now`.
    fn answer(&self, now: std::time::Instant) -> Option<(http::response::Parts, Bytes)> {
        let (parts, bytes, at) = self.kept.as_ref()?;
        (now.saturating_duration_since(*at) <= HEALTH_KEPT).then(|| (parts.clone(), bytes.clone()))
    }
}

/// The last healthy answer, when it is recent enough.
fn kept_health(inner: &Inner) -> Option<Response<Body>> {
    let (parts, bytes) = inner.health.lock().answer(Instant::now().into_std())?;
    Some(Response::from_parts(parts, crate::body::full(bytes)))
}

async fn rpc(
    inner: Arc<Inner>,
    caller: Caller,
    request: Request<Body>,
) -> Result<Response<Body>, Failed> {
    let (parts, body) = request.into_parts();
    let anonymous = Surface::Rpc { id: Value::Null };
    let bytes = read_caller_body(body, MAX_RPC_BODY)
        .await
        .map_err(|e| (e.refusal(), anonymous.clone()))?;
    let call = RpcCall::parse(&bytes).map_err(|(r, id)| (r, Surface::Rpc { id }))?;
    let surface = Surface::Rpc {
        id: call.id.clone(),
    };
    let ctx = Exchange {
        inner,
        caller,
        parts,
        surface,
    };
    // The call names its own lease; a lease header sent with it must still be one, as on the
    // other routes.
    lease_header(&ctx.inner, &ctx.parts.headers).map_err(|r| ctx.fail(r))?;
    let lease = call.lease().map_err(|r| ctx.fail(r))?;
    match call.method.clone() {
        RpcMethod::Allocate => allocate(&ctx, call).await,
        RpcMethod::Heartbeat => {
            let lease = lease.ok_or_else(|| ctx.fail(lease_required()))?;
            heartbeat(&ctx, call, &lease).await
        }
        RpcMethod::Release => {
            let lease = lease.ok_or_else(|| ctx.fail(lease_required()))?;
            // A release goes on when its caller hangs up: the published CLI's `disconnect`
            // gives up after a few seconds and reports success all the same, so a release
            // held up by a stalled uplink must still end the lease.
            let task = ctx.detached();
            let surface = ctx.surface.clone();
            ctx.inner
                .waiting
                .spawn(async move { release(&task, call, &lease).await })
                .await
                .unwrap_or_else(|e| {
                    Err((
                        Refusal::NotAvailable {
                            reason: format!("the release stopped: {e}"),
                            retriable: true,
                        },
                        surface,
                    ))
                })
        }
        RpcMethod::Command | RpcMethod::InstallFromSource => {
            if call.names_a_device() {
                return Err(ctx.fail(Refusal::SimlockPicksDevice));
            }
            if call.command() == Some("devices") {
                return devices(&ctx, call, lease.as_ref()).await;
            }
            match lease {
                Some(lease) => command(&ctx, call, &lease).await,
                None => Ok(ctx.finished(ctx.forward(call.to_bytes(), None).await?)),
            }
        }
        RpcMethod::ReleaseMaterializedPaths => ctx.forward(call.to_bytes(), lease.as_ref()).await,
        RpcMethod::Other(name) => Err(ctx.fail(Refusal::UnknownMethod(name))),
    }
}

/// A device command on the caller's `lease`: owned and served, pinned to the lease's device,
/// the simlock lease renewed while it runs and kept once it ended ([`spawn_renewal`]; any
/// command but `close`, which ends the session). Through a gateway the worker holding the
/// lease keeps it when it takes the keep on ([`KeepAsk`]), so that a gateway gone mid-command
/// does not leave agent-device's lease at its 60 s default; else the front keeps it.
async fn command(
    ctx: &Exchange,
    mut call: RpcCall,
    lease: &LeaseId,
) -> Result<Response<Body>, Failed> {
    let entry = ctx.owned(lease)?;
    ctx.serving(lease)?;
    call.pin_device(entry.platform, &entry.address);
    let keep = (call.command() != Some("close")).then(|| call.heartbeat_after(lease));
    let mut request = ctx.request(call.to_bytes());
    if keep.is_some() && ctx.hosts_per_lease() {
        KeepAsk {
            ttl_ms: entry.ttl_ms,
        }
        .put(request.headers_mut());
    }
    let host_keeps = CancellationToken::new();
    let renewal = spawn_renewal(ctx, lease, entry.ttl_ms, keep, host_keeps.clone());
    let mut response = ctx.send(request, Some(lease)).await?;
    if KeepAsk::was_taken(response.headers_mut()) {
        host_keeps.cancel();
        // The worker renews it once the command ends, as the front's own keep would have.
        ctx.inner.leases.touch(lease, Instant::now());
    }
    let (parts, body) = ctx.finished(response).into_parts();
    let body = Guarded::new(body, renewal).boxed_unsync();
    Ok(Response::from_parts(parts, body))
}

fn lease_required() -> Refusal {
    Refusal::Invalid {
        rpc_code: -32602,
        message: "Invalid params: leaseId is required".into(),
    }
}

/// What one request's handlers share.
#[derive(Clone)]
struct Exchange {
    inner: Arc<Inner>,
    caller: Caller,
    parts: http::request::Parts,
    surface: Surface,
}

impl Exchange {
    fn fail(&self, refusal: Refusal) -> Failed {
        (refusal, self.surface.clone())
    }

    /// Whether each lease is on a host of its own (through a gateway).
    fn hosts_per_lease(&self) -> bool {
        self.inner.link.hosts() == Hosts::PerLease
    }

    /// The caller's lease, or the refusal that it is not one of theirs. One the front has no
    /// memory of (made by an earlier run of this gateway) is recovered from the host link,
    /// which answers for its holder while it is away.
    fn owned(&self, lease: &LeaseId) -> Result<FrontLease, Failed> {
        if let Some(entry) = self.inner.leases.owned(lease, &self.caller.principal) {
            return Ok(entry);
        }
        self.not_ended(lease)?;
        let recovered = self
            .inner
            .link
            .recover(lease, &self.caller)
            .map_err(|r| self.fail(r))?;
        let serving = self.serving(lease)?;
        let entry = FrontLease {
            principal: self.caller.principal.clone(),
            platform: recovered.platform,
            address: recovered.address,
            ttl_ms: self.inner.ceiling(serving.lease_max_ttl_ms),
            touched: Instant::now(),
            seq: 0,
        };
        self.inner.leases.insert(lease.clone(), entry.clone());
        Ok(entry)
    }

    /// The TTL of the caller's `lease`, for a heartbeat or a release, once the host holding it
    /// can serve. On a worker the front's own memory decides whose the lease is; through a
    /// gateway the relay host link does (it alone places leases, and remembers those the
    /// index dropped), so a lease the front has no memory of is forwarded for the link to
    /// refuse or place, with the holder's ceiling as its TTL.
    fn lease_ttl(&self, lease: &LeaseId) -> Result<u64, Failed> {
        let remembered = if self.hosts_per_lease() {
            self.inner.leases.owned(lease, &self.caller.principal)
        } else {
            Some(self.owned(lease)?)
        };
        let serving = self.serving(lease)?;
        Ok(remembered.map_or_else(
            || self.inner.ceiling(serving.lease_max_ttl_ms),
            |entry| entry.ttl_ms,
        ))
    }

    /// `LEASE_ENDED_BY_HOST` for a lease of the caller's that ended on this worker, so a CLI
    /// that calls again hears "connect again", not "not one of yours". Through a gateway the
    /// relay host link's memory answers for ended leases (it routes them to their worker).
    fn not_ended(&self, lease: &LeaseId) -> Result<(), Failed> {
        if self.ended(lease) {
            return Err(self.fail(Refusal::LeaseEnded(lease.clone())));
        }
        Ok(())
    }

    /// Whether `lease` is the caller's and ended on this worker ([`Self::not_ended`]).
    fn ended(&self, lease: &LeaseId) -> bool {
        !self.hosts_per_lease()
            && self
                .inner
                .leases
                .ended(lease, &self.caller.principal, Instant::now())
    }

    /// Forgets the caller's `lease`, which ended; on a worker, remembering it as theirs
    /// ([`Self::not_ended`]).
    fn end(&self, lease: &LeaseId) {
        if self.hosts_per_lease() {
            self.inner.leases.remove(lease);
        } else {
            self.inner
                .leases
                .end(lease, &self.caller.principal, Instant::now());
        }
    }

    /// This exchange, for a task that outlives the caller's request.
    fn detached(&self) -> Self {
        Self {
            inner: self.inner.clone(),
            caller: self.caller.clone(),
            parts: self.parts.clone(),
            surface: self.surface.clone(),
        }
    }

    /// Whether the worker holding the caller's `lease` is away (through a gateway).
    fn holder_away(&self, lease: &LeaseId) -> bool {
        matches!(
            self.inner.link.status(StatusScope::Lease {
                lease,
                caller: &self.caller,
            }),
            HostStatus::HolderAway
        )
    }

    /// The status of the host holding `lease`, refused when it cannot serve.
    fn serving(&self, lease: &LeaseId) -> Result<Serving, Failed> {
        self.inner
            .link
            .status(StatusScope::Lease {
                lease,
                caller: &self.caller,
            })
            .serving()
            .map_err(|r| self.fail(r))
    }

    /// This request again, with `body` as its body.
    fn request(&self, body: Bytes) -> Request<Body> {
        let mut parts = self.parts.clone();
        parts.headers.remove(http::header::CONTENT_LENGTH);
        if let Ok(len) = HeaderValue::from_str(&body.len().to_string()) {
            parts.headers.insert(http::header::CONTENT_LENGTH, len);
        }
        Request::from_parts(parts, crate::body::full(body))
    }

    /// Hands `request` to the host holding `lease` (any host without one).
    async fn send(
        &self,
        request: Request<Body>,
        lease: Option<&LeaseId>,
    ) -> Result<Response<Body>, Failed> {
        // A request in flight when this daemon stops is answered at once, naming the stop,
        // instead of holding the daemon's stop until its host gives up on it.
        let forwarded = tokio::select! {
            forwarded = self.inner.link.forward(request, Some(&self.caller), lease) => forwarded,
            () = self.inner.stop.cancelled() => Err(stopping()),
        };
        forwarded.map_err(|refusal| {
            // A host lost because this daemon stops (a gateway closing its uplinks) is named
            // as the stop, not as the worker's absence.
            let refusal = match refusal {
                Refusal::NotAvailable { .. } if self.inner.stop.is_cancelled() => stopping(),
                other => other,
            };
            (refusal, self.surface.clone())
        })
    }

    /// `response` with its progress stream, if it is one, finished by a response line of the
    /// front's making when the stream is cut before its own ([`ProgressTail`]): the request's
    /// host was lost mid-command. A plain JSON answer is passed as it is (its length is stated;
    /// nothing can be added to it).
    fn finished(&self, response: Response<Body>) -> Response<Body> {
        let streamed = response.status() == StatusCode::OK
            && response
                .headers()
                .get(http::header::CONTENT_TYPE)
                .and_then(|v| v.to_str().ok())
                .is_some_and(|v| v.contains("application/x-ndjson"));
        let (Surface::Rpc { id }, true) = (&self.surface, streamed) else {
            return response;
        };
        let (stop, id) = (self.inner.stop.clone(), id.clone());
        let cut = move |why: &str| {
            let refusal = host_lost(&stop, format!("its answer was cut off ({why}); retry"));
            let line = json!({"type": "response", "response": refusal.rpc_error(&id)});
            Bytes::from(format!("{line}\n"))
        };
        let (mut parts, body) = response.into_parts();
        parts.headers.remove(http::header::CONTENT_LENGTH);
        let body = ProgressTail::new(body, cut).until(self.inner.stop.clone());
        Response::from_parts(parts, body.boxed_unsync())
    }

    /// Forwards `body` as this request's body.
    async fn forward(
        &self,
        body: Bytes,
        lease: Option<&LeaseId>,
    ) -> Result<Response<Body>, Failed> {
        self.send(self.request(body), lease).await
    }

    /// Forwards `body` and reads the answer whole, asking the host to renew the simlock lease
    /// when `ask` is given.
    async fn exchange(
        &self,
        body: Bytes,
        lease: Option<&LeaseId>,
        ask: Option<RenewAsk>,
    ) -> Result<(http::response::Parts, Bytes), Failed> {
        let mut request = self.request(body);
        if let Some(ask) = ask {
            ask.put(request.headers_mut());
        }
        let response = self.send(request, lease).await?;
        let (parts, body) = response.into_parts();
        let bytes = read_to_bytes(body, MAX_ANSWER).await.map_err(|e| {
            self.fail(host_lost(
                &self.inner.stop,
                format!("agent-device's answer could not be read: {e}"),
            ))
        })?;
        Ok((parts, bytes))
    }

    fn ctx(&self) -> CallCtx {
        CallCtx::internal(self.caller.principal.clone(), self.caller.role, None)
    }

    /// Renews the simlock lease `lease` to now plus `ttl_ms` through the pipeline.
    ///
    /// # Errors
    /// Not available, with the pipeline's message, for any failure but an unknown lease.
    async fn renew_simlock(&self, lease: &LeaseId, ttl_ms: u64) -> Result<Renewal, Failed> {
        let renew = LeaseRenewInput {
            lease_id: lease.to_string(),
            ttl_ms: Some(ttl_ms),
        };
        match self
            .inner
            .pipeline
            .call_typed::<LeaseRenew>(self.ctx(), &renew)
            .await
        {
            Ok(_) => Ok(Renewal::Renewed),
            Err(e) if e.code == ErrorCode::UnknownLease => Ok(Renewal::LeaseEnded),
            Err(e) => Err(self.fail(Refusal::NotAvailable {
                reason: e.message,
                retriable: true,
            })),
        }
    }

    /// Ends the simlock lease `lease`; one already gone is not an error.
    async fn release_simlock(&self, lease: &LeaseId) {
        release_simlock_lease(&self.inner.pipeline, self.ctx(), lease).await;
    }
}

async fn release_simlock_lease(pipeline: &Pipeline, ctx: CallCtx, lease: &LeaseId) {
    let input = LeaseIdInput {
        reason: None,
        lease_id: lease.as_str().to_owned(),
    };
    match pipeline.call_typed::<LeaseRelease>(ctx, &input).await {
        Ok(_) => {}
        Err(e) if e.code == ErrorCode::UnknownLease => {}
        Err(e) => {
            warn!(%lease, code = %e.code, message = %e.message, "the simlock lease could not be released")
        }
    }
}

/// The lease id `L` of a simlock lease the front made (its id and its requester are both `L`,
/// a front lease id); `None` for any other (a `simlock lease --lease-id` is never one).
pub fn made_by_front(lease_id: &str, requester_id: &str) -> Option<LeaseId> {
    (lease_id == requester_id)
        .then(|| LeaseId::parse(lease_id))
        .flatten()
}

/// Of `leases`, those a front made ([`made_by_a_front`]) that `pick` picks by their lease id,
/// with their records.
fn front_leases(
    leases: &[LeaseRecord],
    pick: impl Fn(&LeaseId) -> bool,
) -> Vec<(LeaseId, &LeaseRecord)> {
    leases
        .iter()
        .filter_map(|record| {
            made_by_a_front(record.id.as_str(), &record.requester_id)
                .filter(|lease| pick(lease))
                .map(|lease| (lease, record))
        })
        .collect()
}

/// The lease id `L` of a simlock lease a front made on this worker: its own ([`made_by_front`])
/// or a gateway's, which forwarded its requester `L` as `gw:<gateway id>:L`. A worker's
/// agent-device daemon holds the agent-device leases of both kinds.
pub fn made_by_a_front(lease_id: &str, requester_id: &str) -> Option<LeaseId> {
    let requester = simlock_contract::ids::split_gateway_requester(requester_id)
        .map_or(requester_id, |(_, requester)| requester);
    made_by_front(lease_id, requester)
}

/// The refusal for a host lost mid-request: named as this daemon's stop when it is stopping
/// (a gateway closing its uplinks, a worker stopping its agent-device daemon), not as the
/// host's absence.
fn host_lost(stop: &CancellationToken, reason: String) -> Refusal {
    if stop.is_cancelled() {
        return stopping();
    }
    Refusal::NotAvailable {
        reason,
        retriable: true,
    }
}

/// The refusal of a request this daemon's stop cut short.
fn stopping() -> Refusal {
    Refusal::NotAvailable {
        reason: STOPPING.into(),
        retriable: true,
    }
}

/// An answer read whole (and perhaps rewritten), its length stated anew.
fn answer_from(mut parts: http::response::Parts, bytes: Bytes) -> Response<Body> {
    parts.headers.remove(http::header::TRANSFER_ENCODING);
    if let Ok(len) = HeaderValue::from_str(&bytes.len().to_string()) {
        parts.headers.insert(http::header::CONTENT_LENGTH, len);
    }
    Response::from_parts(parts, crate::body::full(bytes))
}

impl Inner {
    /// The ceiling on a lease's TTL, given the holding daemon's `lease.maxTtlMs`: the least
    /// of agent-device's own, this daemon's `lease.maxTtlMs` (through a gateway, a lease above
    /// the gateway's own bound could be neither granted nor renewed there), the holder's and
    /// `agentDevice.leaseTtlCapMs`.
    fn ceiling(&self, holder_max_ttl_ms: Option<u64>) -> u64 {
        let mut ceiling = AGENT_DEVICE_MAX_TTL_MS.min(self.max_ttl_ms);
        if let Some(holder) = holder_max_ttl_ms {
            ceiling = ceiling.min(holder);
        }
        if let Some(cap) = self.lease_ttl_cap_ms {
            ceiling = ceiling.min(cap);
        }
        ceiling.max(1)
    }
}

/// The allocate: a simlock lease first (waiting in the queue; a caller that hangs up
/// withdraws it), then agent-device's own, naming the granted device. Every exit leaves one
/// state: both leases held, or neither.
async fn allocate(ctx: &Exchange, mut call: RpcCall) -> Result<Response<Body>, Failed> {
    let inner = &ctx.inner;
    call.check_allocate_params().map_err(|r| ctx.fail(r))?;
    inner.leases.prune(Instant::now());
    let serving = inner
        .link
        .status(StatusScope::NewLease)
        .serving()
        .map_err(|r| ctx.fail(r))?;
    let platform = call
        .allocate_platform()
        .map_err(|name| ctx.fail(Refusal::PlatformUnavailable(name)))?;
    if !serving.platforms.contains(&platform) {
        return Err(ctx.fail(Refusal::PlatformUnavailable(platform.as_str().to_owned())));
    }
    let lease = LeaseId::mint();
    let mut input = LeaseRequestInput::for_platform(platform);
    input.model = call.allocate_model();
    input.requester_id = Some(lease.to_string());
    input.lease_id = Some(lease.to_string());
    input.ttl_ms = Some(inner.ceiling(serving.lease_max_ttl_ms));
    input.requires = inner.link.lease_requires();
    // The CLI waits 330 s for its answer and says only that it timed out: the queue wait ends
    // before that, with a refusal that says why.
    input.timeout_ms = Some(inner.queue_wait_ms);
    let grant = wait_for_grant(inner, &ctx.caller, input, &lease)
        .await
        .map_err(|e| match e.code {
            ErrorCode::Cancelled => ctx.fail(stopping()),
            ErrorCode::QueueTimeout => ctx.fail(Refusal::queue_wait(inner.queue_wait_ms)),
            _ => ctx.fail(Refusal::from_simlock(&e)),
        })?;
    let serving = match ctx.serving(&lease) {
        Ok(serving) => serving,
        Err(failed) => {
            ctx.release_simlock(&lease).await;
            return Err(failed);
        }
    };
    let ttl_ms = inner.ceiling(serving.lease_max_ttl_ms);
    if ttl_ms != grant.lease.ttl_ms {
        let renew = LeaseRenewInput {
            lease_id: lease.to_string(),
            ttl_ms: Some(ttl_ms),
        };
        if let Err(e) = inner
            .pipeline
            .call_typed::<LeaseRenew>(ctx.ctx(), &renew)
            .await
        {
            ctx.release_simlock(&lease).await;
            return Err(ctx.fail(Refusal::from_simlock(&e)));
        }
    }
    // How agent-device names the device: the serial or UDID its tools use.
    let address = grant
        .device
        .access
        .as_ref()
        .map_or(grant.device.driver_device_id.as_str(), |a| a.address())
        .to_owned();
    inner.leases.insert(
        lease.clone(),
        FrontLease {
            principal: ctx.caller.principal.clone(),
            platform,
            address: address.clone(),
            ttl_ms,
            touched: Instant::now(),
            seq: 0,
        },
    );
    call.set_allocation(&device_key(platform, &address), ttl_ms);
    let forwarded = ctx.exchange(call.to_bytes(), Some(&lease), None).await;
    let held = matches!(&forwarded, Ok((_, bytes)) if matches!(Answer::read(bytes), Answer::Ok(_)));
    if !held {
        inner.leases.remove(&lease);
        ctx.release_simlock(&lease).await;
    }
    let (parts, bytes) = forwarded?;
    Ok(answer_from(parts, bytes))
}

/// Runs the simlock `lease.request` in a task of its own, so that a caller that hangs up (the
/// handler's future dropped) or a daemon that stops withdraws it with `lease.cancel`; a grant
/// nobody waits for any more is released.
async fn wait_for_grant(
    inner: &Arc<Inner>,
    caller: &Caller,
    input: LeaseRequestInput,
    lease: &LeaseId,
) -> Result<LeaseGrant, ContractError> {
    let (tx, rx) = oneshot::channel();
    let abandon = CancellationToken::new();
    let task_abandon = abandon.clone();
    let stop = inner.stop.clone();
    let pipeline = inner.pipeline.clone();
    let (principal, role) = (caller.principal.clone(), caller.role);
    let ctx = || CallCtx::internal(principal.clone(), role, None);
    let (request_ctx, cancel_ctx, release_ctx) = (ctx(), ctx(), ctx());
    let lease = lease.clone();
    inner.waiting.spawn(async move {
        let call = pipeline.call_typed::<LeaseRequest>(request_ctx, &input);
        tokio::pin!(call);
        let settled = tokio::select! {
            outcome = &mut call => Some(outcome),
            () = task_abandon.cancelled() => None,
            () = stop.cancelled() => None,
        };
        let outcome = match settled {
            Some(outcome) => outcome,
            None => {
                let cancel = LeaseCancelInput {
                    requester_id: Some(lease.to_string()),
                };
                if let Err(e) = pipeline
                    .call_typed::<LeaseCancel>(cancel_ctx, &cancel)
                    .await
                {
                    debug!(%lease, code = %e.code, "lease.cancel for an abandoned allocate failed");
                }
                // The request ends now: cancelled, or granted because its device work had
                // started (or it waits in a worker's queue, past the gateway's cancel); such a
                // grant is released at once. The wait is bounded by the request's own queue
                // timeout and by the daemon's stop, which ends every call.
                if call.await.is_ok() {
                    release_simlock_lease(&pipeline, release_ctx, &lease).await;
                }
                Err(ContractError::new(
                    ErrorCode::Cancelled,
                    "the allocate was withdrawn",
                ))
            }
        };
        if let Err(Ok(_unwanted)) = tx.send(outcome) {
            let ctx = CallCtx::internal(principal, role, None);
            release_simlock_lease(&pipeline, ctx, &lease).await;
        }
    });
    let guard = abandon.drop_guard();
    let outcome = rx
        .await
        .unwrap_or_else(|_| Err(ContractError::internal("the allocate task ended")));
    guard.disarm();
    outcome
}

/// Renews the simlock lease every TTL/3 until the returned guard drops (the answer it rides on
/// ended) or the daemon stops; once the guard dropped, sends `keep` ([`keep_after_command`])
/// unless `host_keeps` was cancelled (the host holding the lease took the keep on).
fn spawn_renewal(
    ctx: &Exchange,
    lease: &LeaseId,
    ttl_ms: u64,
    keep: Option<RpcCall>,
    host_keeps: CancellationToken,
) -> tokio_util::sync::DropGuard {
    let done = CancellationToken::new();
    let (ctx, lease, task_done) = (ctx.clone(), lease.clone(), done.clone());
    let stop = ctx.inner.stop.clone();
    let period = Duration::from_millis((ttl_ms / 3).max(1));
    let tracker = ctx.inner.waiting.clone();
    tracker.spawn(async move {
        loop {
            tokio::select! {
                () = tokio::time::sleep(period) => {}
                () = task_done.cancelled() => break,
                () = stop.cancelled() => return,
            }
            match ctx.renew_simlock(&lease, ttl_ms).await {
                Ok(Renewal::Renewed) => ctx.inner.leases.touch(&lease, Instant::now()),
                Ok(Renewal::LeaseEnded) => {
                    debug!(%lease, "the lease ended during its command");
                    return;
                }
                Err((refusal, _)) => {
                    debug!(%lease, %refusal, "renewal during a command failed");
                }
            }
        }
        if let Some(call) = keep.filter(|_| !host_keeps.is_cancelled()) {
            keep_after_command(&ctx, call, &lease).await;
        }
    });
    done.drop_guard()
}

/// The heartbeat: agent-device first, then the simlock lease renewed to now plus the lease's
/// TTL, by the host holding it when it can ([`crate::renewal`]: through a gateway, the worker,
/// in the relay's own round trip), else by the front. agent-device saying the lease is gone,
/// or simlock not knowing it, means simlock ended it: `LEASE_ENDED_BY_HOST`, never an answer
/// on which the CLI allocates again.
async fn heartbeat(
    ctx: &Exchange,
    call: RpcCall,
    lease: &LeaseId,
) -> Result<Response<Body>, Failed> {
    let Heartbeaten {
        parts,
        bytes,
        answer,
        renewal,
    } = renew_both(ctx, call, lease).await?;
    if answer.lease_gone() {
        ctx.end(lease);
        ctx.release_simlock(lease).await;
        return Err(ctx.fail(Refusal::LeaseEnded(lease.clone())));
    }
    let Some(renewal) = renewal else {
        return Ok(answer_from(parts, bytes));
    };
    match renewal {
        Renewal::Renewed => {
            ctx.inner.leases.touch(lease, Instant::now());
            Ok(answer_from(parts, bytes))
        }
        Renewal::LeaseEnded => {
            ctx.end(lease);
            Err(ctx.fail(Refusal::LeaseEnded(lease.clone())))
        }
    }
}

/// A heartbeat's outcome ([`renew_both`]).
struct Heartbeaten {
    parts: http::response::Parts,
    bytes: Bytes,
    /// agent-device's answer, read.
    answer: Answer,
    /// The simlock lease's renewal; `None` when agent-device did not answer ok (nothing was
    /// renewed).
    renewal: Option<Renewal>,
}

/// agent-device's heartbeat `call` of `lease`, with the lease's TTL, then, once agent-device
/// answered ok, the simlock lease renewed to now plus that TTL: by the host holding it, in the
/// same round trip, when it can ([`crate::renewal`]: through a gateway, the worker), else by
/// the front. agent-device's first, so simlock's lease never ends before it.
async fn renew_both(
    ctx: &Exchange,
    mut call: RpcCall,
    lease: &LeaseId,
) -> Result<Heartbeaten, Failed> {
    let ttl_ms = ctx.lease_ttl(lease)?;
    call.set_ttl(ttl_ms);
    let ask = RenewAsk { ttl_ms };
    let (mut parts, bytes) = ctx
        .exchange(call.to_bytes(), Some(lease), Some(ask))
        .await?;
    let renewal = Renewal::take(&mut parts.headers);
    let answer = Answer::read(&bytes);
    let renewal = match (&answer, renewal) {
        (Answer::Ok(_), Some(renewal)) => Some(renewal),
        (Answer::Ok(_), None) => Some(ctx.renew_simlock(lease, ttl_ms).await?),
        _ => None,
    };
    Ok(Heartbeaten {
        parts,
        bytes,
        answer,
        renewal,
    })
}

/// After a device command on `lease`: agent-device 0.21.5 renewed its lease with its default
/// TTL (60 s) when the command came ([`RpcCall::heartbeat_after`]), so both leases are renewed
/// to the lease's TTL again, as a heartbeat renews them. Nothing is ended here: a lease found
/// gone is the caller's next call to tell.
async fn keep_after_command(ctx: &Exchange, call: RpcCall, lease: &LeaseId) {
    match renew_both(ctx, call, lease).await {
        Ok(Heartbeaten {
            renewal: Some(Renewal::Renewed),
            ..
        }) => ctx.inner.leases.touch(lease, Instant::now()),
        Ok(Heartbeaten { answer, .. }) => {
            debug!(%lease, ?answer, "the lease was not kept after its command");
        }
        Err((refusal, _)) => {
            debug!(%lease, %refusal, "the lease was not kept after its command");
        }
    }
}

/// The release: agent-device first (`released: false` is a normal answer), then the simlock
/// lease. A release agent-device fails keeps the simlock lease. Releasing a lease that ended
/// answers `released: false`, as agent-device answers a second release.
///
/// Through a gateway, a release whose lease's worker is away (its uplink down, or not back since
/// the gateway started), or whose relay failed (an uplink stalled before it is declared dead),
/// is answered `released: true` and carried out once the worker is reachable
/// ([`release_later`]): the published CLI's `disconnect` reports success whatever the answer,
/// and an agent that let its device go must not keep it until its TTL.
async fn release(ctx: &Exchange, call: RpcCall, lease: &LeaseId) -> Result<Response<Body>, Failed> {
    // The caller's lease ended already: answered as agent-device answers a second release.
    if ctx.ended(lease) {
        return Ok(rpc_result(&call.id, json!({ "released": false })));
    }
    let away = match ctx.lease_ttl(lease) {
        Err(_) if ctx.holder_away(lease) => true,
        other => {
            other?;
            ctx.inner.releasing.lock().contains(lease)
        }
    };
    let answered = if away {
        None
    } else {
        match ctx.exchange(call.to_bytes(), Some(lease), None).await {
            // The worker went away, or the relay failed (a stalled uplink, cut before it is
            // declared dead): the lease is released once it is reachable.
            Err((refusal, _)) if ctx.holder_away(lease) || refusal.retriable() == Some(true) => {
                None
            }
            other => Some(other?),
        }
    };
    let Some((parts, bytes)) = answered else {
        release_later(ctx, &call, lease).await?;
        return Ok(rpc_result(&call.id, json!({ "released": true })));
    };
    let answer = Answer::read(&bytes);
    if matches!(answer, Answer::Ok(_)) || answer.lease_gone() {
        ctx.end(lease);
        ctx.release_simlock(lease).await;
    }
    Ok(answer_from(parts, bytes))
}

/// The first wait of a release carried out later, doubled after each try up to
/// [`RELEASE_LATER_MAX_WAIT`].
const RELEASE_LATER_FIRST_WAIT: Duration = Duration::from_millis(250);
/// The longest wait between two tries of a release carried out later.
const RELEASE_LATER_MAX_WAIT: Duration = Duration::from_secs(2);

/// Carries out `call`, the release of `lease`, once the worker holding it is back. The front
/// forgets the lease at once, as it does when a release is answered.
///
/// The simlock lease is released first: the gateway answers its holder's release while the
/// worker is away, keeps it (stored, a restart between included) and releases the lease on the
/// worker once it is back, whose host then releases agent-device's lease before it reclaims the
/// device. A gateway that has not heard from the worker since it started cannot yet (it does
/// not know the lease's owner): then a task tries `call` itself with backoff until agent-device
/// answers it (then the simlock lease is released, as [`release`] does), or the front finds
/// the lease ended or not the caller's, or the lease's TTL has run out (the worker ends it then
/// itself), or this daemon stops. The release is kept by the host link until then, so a
/// restart of this daemon resumes it ([`Front::resume_releases`]). One such task per lease.
///
/// # Errors
/// `refused by simlock` when the release cannot be kept (a full disk): it is still carried out
/// once the worker is back, unless this daemon restarts first, and the caller hears so.
async fn release_later(ctx: &Exchange, call: &RpcCall, lease: &LeaseId) -> Result<(), Failed> {
    if !ctx.inner.releasing.lock().insert(lease.clone()) {
        return Ok(());
    }
    let input = LeaseIdInput {
        reason: None,
        lease_id: lease.as_str().to_owned(),
    };
    match ctx
        .inner
        .pipeline
        .call_typed::<LeaseRelease>(ctx.ctx(), &input)
        .await
    {
        Ok(_) => {
            info!(%lease, "the worker holding the lease is away: the gateway releases it once it is back");
            ctx.end(lease);
            // A release an earlier run kept is the fleet's now.
            ctx.inner.link.release_settled(lease);
            ctx.inner.releasing.lock().remove(lease);
            return Ok(());
        }
        // The fleet took the release but could not store it: it says so, and so does the
        // answer (a `released: true` would promise what a restart loses).
        Err(e) if e.is_release_not_stored() => {
            ctx.end(lease);
            ctx.inner.releasing.lock().remove(lease);
            return Err(ctx.fail(Refusal::Simlock {
                message: e.message,
                code: e.code,
            }));
        }
        // `UNKNOWN_LEASE` too: a gateway that restarted cannot vouch for a lease whose id its
        // agent chose before that worker reported; the task finds out.
        Err(e) => {
            debug!(%lease, code = %e.code, "the simlock lease cannot be released yet: released once its worker is back");
        }
    }
    let now = Instant::now();
    let ttl = ctx
        .inner
        .leases
        .owned(lease, &ctx.caller.principal)
        .map_or_else(
            || ctx.inner.ceiling(None),
            |entry| {
                entry.ttl_ms.saturating_sub(
                    u64::try_from(now.saturating_duration_since(entry.touched).as_millis())
                        .unwrap_or(u64::MAX),
                )
            },
        );
    let within = Duration::from_millis(ttl);
    let deadline = now + within;
    ctx.end(lease);
    let kept = ctx.inner.link.keep_release(lease, within);
    info!(%lease, "the worker holding the lease is away: released once it is back");
    let task = ctx.detached();
    let (body, lease) = (call.to_bytes(), lease.clone());
    ctx.inner.waiting.spawn(async move {
        let mut wait = RELEASE_LATER_FIRST_WAIT;
        let outcome = loop {
            if let Some(end) = later_wait(&task.inner, &mut wait, deadline).await {
                break end;
            }
            if task.holder_away(&lease) {
                continue;
            }
            match task.exchange(body.clone(), Some(&lease), None).await {
                Ok((_, bytes)) => {
                    let answer = Answer::read(&bytes);
                    if matches!(answer, Answer::Ok(_)) || answer.lease_gone() {
                        task.release_simlock(&lease).await;
                        break Later::Done;
                    }
                    warn!(%lease, ?answer, "agent-device refused a release carried out later");
                    break Later::LeftToTtl;
                }
                Err((refusal, _)) if refusal.retriable() == Some(true) => {}
                // Ended meanwhile, or no longer the caller's: nothing is left to release.
                Err((refusal, _)) => {
                    info!(%lease, %refusal, "a release carried out later found nothing to release");
                    break Later::Done;
                }
            }
        };
        later_ended(&task.inner, &lease, outcome);
    });
    if kept {
        return Ok(());
    }
    Err(ctx.fail(Refusal::Simlock {
        message: "the release is carried out once the lease's worker is back, but could not \
                  be stored: should this gateway restart first, the lease is held until its TTL"
            .into(),
        code: ErrorCode::Internal,
    }))
}

/// How a release carried out later ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Later {
    /// Carried out, or nothing was left to release.
    Done,
    /// Given up: the lease ends on its TTL.
    LeftToTtl,
    /// Not done here: this daemon stops, or the fleet took the release without storing it
    /// (a full disk). It stays kept for the next run.
    Kept,
}

/// Waits `wait` (then doubled, up to [`RELEASE_LATER_MAX_WAIT`]) before the next try of a
/// release carried out later; answers how it ends instead when `deadline` passes or the
/// daemon stops.
async fn later_wait(inner: &Inner, wait: &mut Duration, deadline: Instant) -> Option<Later> {
    tokio::select! {
        () = tokio::time::sleep((*wait).min(deadline.saturating_duration_since(Instant::now()))) => {}
        () = inner.stop.cancelled() => return Some(Later::Kept),
    }
    if Instant::now() >= deadline {
        return Some(Later::LeftToTtl);
    }
    *wait = (*wait * 2).min(RELEASE_LATER_MAX_WAIT);
    None
}

/// A release carried out later ended: settled for good unless the daemon stops, when it stays
/// kept for the next run ([`Front::resume_releases`]).
fn later_ended(inner: &Inner, lease: &LeaseId, outcome: Later) {
    if outcome == Later::LeftToTtl {
        info!(%lease, "a release carried out later was left to the lease's TTL");
    }
    if outcome != Later::Kept {
        inner.link.release_settled(lease);
    }
    inner.releasing.lock().remove(lease);
}

/// Carries out a release an earlier run kept ([`Front::resume_releases`]): once the lease's
/// worker is back (and has reported its leases), the simlock lease is released as its owner;
/// the worker's host releases agent-device's lease before it reclaims the device. A lease the
/// index does not hold then ended already. Bounded by the lease's TTL and the daemon's stop.
async fn resume_release(inner: &Inner, kept: KeptRelease) {
    let KeptRelease {
        lease,
        owner,
        within,
    } = kept;
    let deadline = Instant::now() + within;
    let caller = Caller {
        principal: owner,
        role: simlock_contract::Role::Agent,
        credential: String::new(),
    };
    let input = LeaseIdInput {
        reason: None,
        lease_id: lease.as_str().to_owned(),
    };
    let mut wait = RELEASE_LATER_FIRST_WAIT;
    let mut unstored = false;
    let outcome = loop {
        if let Some(end) = later_wait(inner, &mut wait, deadline).await {
            break end;
        }
        let scope = StatusScope::Lease {
            lease: &lease,
            caller: &caller,
        };
        if inner.link.status(scope) == HostStatus::HolderAway {
            continue;
        }
        let ctx = CallCtx::internal(caller.principal.clone(), caller.role, None);
        let tried = inner
            .pipeline
            .call_typed::<LeaseRelease>(ctx, &input)
            .await
            .map(|_| ());
        match resumed_release_next(&tried, unstored) {
            Resumed::Ended(outcome) => {
                match &tried {
                    Ok(()) => {
                        info!(%lease, "a release asked for before a restart was carried out");
                    }
                    Err(e) if outcome == Later::Done && e.code == ErrorCode::UnknownLease => {
                        info!(%lease, "a release asked for before a restart found the lease ended");
                    }
                    Err(e) if outcome == Later::Done => {
                        warn!(%lease, code = %e.code, message = %e.message, "a release asked for before a restart was refused; the lease ends on its TTL");
                    }
                    Err(_) => {}
                }
                break outcome;
            }
            Resumed::Again { unstored: now } => {
                if let Err(e) = &tried {
                    debug!(%lease, code = %e.code, message = %e.message, "a release asked for before a restart is tried again");
                }
                unstored = now;
            }
        }
    };
    later_ended(inner, &lease, outcome);
}

/// What a resumed release does after one try.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Resumed {
    /// It ends so.
    Ended(Later),
    /// It is tried again; `unstored` once the fleet took it without storing it.
    Again { unstored: bool },
}

/// The rules of a resumed release ([`resume_release`]), after a try that answered `tried`;
/// `unstored` says whether an earlier try was taken without being stored.
///
/// - Carried out: done.
/// - Taken without being stored (a full disk): tried again, and from then on an
///   `UNKNOWN_LEASE` is that release, held in memory only: the row stays kept for the next run.
/// - `UNKNOWN_LEASE` otherwise: the lease ended already; done.
/// - Its worker away again or failed (`WORKER_UNREACHABLE`, `INTERNAL`), or a transport
///   failure: tried again.
/// - Any other refusal: given up (the lease ends on its TTL); nothing a later try could mend.
fn resumed_release_next(tried: &Result<(), ContractError>, unstored: bool) -> Resumed {
    let Err(e) = tried else {
        return Resumed::Ended(Later::Done);
    };
    if e.code == ErrorCode::UnknownLease {
        return Resumed::Ended(if unstored { Later::Kept } else { Later::Done });
    }
    if e.is_release_not_stored() {
        return Resumed::Again { unstored: true };
    }
    if e.code.is_transport() || matches!(e.code, ErrorCode::WorkerUnreachable | ErrorCode::Internal)
    {
        return Resumed::Again { unstored };
    }
    Resumed::Ended(Later::Done)
}

/// `devices`: only the devices the token leases. With none held, the empty list, and no host
/// is asked. On a worker one forward answers for all of them; through a gateway there is one
/// forward per held lease, all at once, each cut to its own lease's device and joined in lease
/// order (two workers' `emulator-5554` both appear, each from its own worker). A lease whose
/// worker is away is not asked; the answer names it in `unreadLeases`.
async fn devices(
    ctx: &Exchange,
    call: RpcCall,
    lease: Option<&LeaseId>,
) -> Result<Response<Body>, Failed> {
    if let Some(named) = lease {
        ctx.owned(named)?;
    }
    let mut unread = Vec::new();
    if ctx.hosts_per_lease() {
        // The leases an earlier run of this gateway made are the caller's too.
        for l in ctx.inner.link.held(&ctx.caller) {
            if let Err((refusal, _)) = ctx.owned(&l) {
                unread.push((l, refusal));
            }
        }
    }
    let mut held = ctx.inner.leases.of_principal(&ctx.caller.principal);
    if ctx.hosts_per_lease() {
        held.retain(|(l, _)| match ctx.serving(l) {
            Ok(_) => true,
            Err((refusal, _)) => {
                unread.push((l.clone(), refusal));
                false
            }
        });
    }
    // Ended leases are not unread: they are gone.
    unread.retain(|(_, refusal)| matches!(refusal, Refusal::NotAvailable { .. }));
    unread.sort_by(|(a, _), (b, _)| a.as_str().cmp(b.as_str()));
    unread.dedup_by(|(a, _), (b, _)| a == b);
    let Some((first, _)) = held.first() else {
        return Ok(devices_answer(&call.id, Vec::new(), &unread));
    };
    if !ctx.hosts_per_lease() {
        let asked = lease.unwrap_or(first).clone();
        let addresses: Vec<&str> = held.iter().map(|(_, e)| e.address.as_str()).collect();
        return match read_devices(ctx, &call, &asked, None).await? {
            Listed::Devices(list) => Ok(devices_answer(
                &call.id,
                keep_devices(list, &addresses),
                &unread,
            )),
            Listed::Error(answer) => Ok(answer),
        };
    }
    // One forward per held lease; the first failure (in time) cancels the rest, and the
    // failure of the first failing lease in lease order is the answer.
    let mut pending: futures::stream::FuturesUnordered<_> = held
        .iter()
        .enumerate()
        .map(|(i, (l, _))| {
            let call = &call;
            async move { (i, read_devices(ctx, call, l, Some(i)).await) }
        })
        .collect();
    let mut outcomes: Vec<Option<Result<Listed, Failed>>> =
        std::iter::repeat_with(|| None).take(held.len()).collect();
    while let Some((i, outcome)) = futures::StreamExt::next(&mut pending).await {
        let failed = !matches!(outcome, Ok(Listed::Devices(_)));
        outcomes[i] = Some(outcome);
        if failed {
            break;
        }
    }
    drop(pending);
    let addresses: Vec<&str> = held.iter().map(|(_, e)| e.address.as_str()).collect();
    match join_devices(&addresses, outcomes) {
        Ok(Joined::Devices(joined)) => Ok(devices_answer(&call.id, joined, &unread)),
        Ok(Joined::Error(answer)) => Ok(answer),
        Err(failed) => Err(failed),
    }
}

/// What the per-lease `devices` answers come to.
enum Joined {
    /// The joined list.
    Devices(Vec<Value>),
    /// The first failing lease's error reply.
    Error(Response<Body>),
}

/// Joins the answers of the held leases, in lease order: each answer is cut to its own
/// lease's device (`addresses[i]`) first, so two workers' devices of one id both appear, each
/// from its own worker, and no other device gets through. The first failure in lease order
/// wins; a lease cancelled because another failed adds nothing.
fn join_devices(
    addresses: &[&str],
    outcomes: Vec<Option<Result<Listed, Failed>>>,
) -> Result<Joined, Failed> {
    let mut joined = Vec::new();
    for (address, outcome) in addresses.iter().zip(outcomes) {
        match outcome {
            Some(Ok(Listed::Devices(list))) => joined.extend(keep_devices(list, &[address])),
            Some(Ok(Listed::Error(answer))) => return Ok(Joined::Error(answer)),
            Some(Err(failed)) => return Err(failed),
            None => {}
        }
    }
    Ok(Joined::Devices(joined))
}

/// One `devices` answer.
enum Listed {
    /// The list agent-device answered.
    Devices(Vec<Value>),
    /// Its error reply, passed on as it is.
    Error(Response<Body>),
}

/// Asks for the device list under `lease`, as forward `part` of several when there are.
async fn read_devices(
    ctx: &Exchange,
    call: &RpcCall,
    lease: &LeaseId,
    part: Option<usize>,
) -> Result<Listed, Failed> {
    let mut call = call.clone();
    call.set_lease(lease);
    call.as_own_read(part);
    let (parts, bytes) = ctx.exchange(call.to_bytes(), Some(lease), None).await?;
    match Answer::read(&bytes) {
        Answer::Ok(data) => match data.get("devices").and_then(Value::as_array) {
            Some(list) => Ok(Listed::Devices(list.clone())),
            None => Err(ctx.fail(Refusal::DevicesUnreadable(lease.clone()))),
        },
        Answer::Error { .. } => Ok(Listed::Error(answer_from(parts, bytes))),
        Answer::Unreadable => Err(ctx.fail(Refusal::DevicesUnreadable(lease.clone()))),
    }
}

/// The devices of `list` whose id is one of `addresses`.
fn keep_devices(list: Vec<Value>, addresses: &[&str]) -> Vec<Value> {
    list.into_iter()
        .filter(|d| {
            d.get("id")
                .and_then(Value::as_str)
                .is_some_and(|id| addresses.contains(&id))
        })
        .collect()
}

/// The `devices` answer, with the leases whose device could not be read (`unreadLeases`:
/// each lease's id, why, and whether a retry may read it) when there are any.
fn devices_answer(
    id: &Value,
    devices: Vec<Value>,
    unread: &[(LeaseId, Refusal)],
) -> Response<Body> {
    let mut data = json!({ "devices": devices });
    if !unread.is_empty() {
        let unread: Vec<Value> = unread
            .iter()
            .map(|(lease, refusal)| {
                let (reason, retriable) = match refusal {
                    Refusal::NotAvailable { reason, retriable } => (reason.clone(), *retriable),
                    other => (other.to_string(), false),
                };
                json!({ "leaseId": lease.as_str(), "reason": reason, "retriable": retriable })
            })
            .collect();
        data["unreadLeases"] = Value::Array(unread);
    }
    rpc_result(id, data)
}

/// A JSON-RPC result the front answers itself, in agent-device's envelope.
fn rpc_result(id: &Value, data: Value) -> Response<Body> {
    json_response(
        StatusCode::OK,
        &json!({
            "jsonrpc": "2.0",
            "id": id,
            "result": { "ok": true, "data": data },
        }),
    )
}

/// The lease header, where the host link reads it (through a gateway): none when absent or
/// empty; sent twice, or not a lease id, `BadLeaseHeader` (its value is not repeated). On a
/// worker it is not read.
fn lease_header(inner: &Inner, headers: &HeaderMap) -> Result<Option<LeaseId>, Refusal> {
    if !inner.link.hosts().reads_lease_header() {
        return Ok(None);
    }
    // Sent twice is refused as a header that is not a lease id: the value is never echoed.
    let Some(value) = simlock_daemon::auth::single_header(
        headers,
        &HeaderName::from_static(LEASE_HEADER),
        LEASE_HEADER,
    )
    .map_err(|_| Refusal::BadLeaseHeader)?
    .filter(|v| !v.is_empty()) else {
        return Ok(None);
    };
    std::str::from_utf8(value.as_bytes())
        .ok()
        .and_then(LeaseId::parse)
        .map(Some)
        .ok_or(Refusal::BadLeaseHeader)
}

/// Uploads, artifacts and diagnostics. Through a gateway the lease header decides where they
/// go; on a worker it is not read.
async fn auxiliary(
    inner: Arc<Inner>,
    caller: Caller,
    route: Route,
    request: Request<Body>,
) -> Result<Response<Body>, Failed> {
    let surface = Surface::Route;
    let lease = lease_header(&inner, request.headers()).map_err(route_fail)?;
    if let Some(lease) = &lease {
        inner
            .link
            .status(StatusScope::Lease {
                lease,
                caller: &caller,
            })
            .serving()
            .map_err(route_fail)?;
    }
    let request = if route == Route::Preflight {
        // Bounded as agent-device bounds it, before anything is forwarded.
        let (parts, body) = request.into_parts();
        let bytes = read_caller_body(body, MAX_PREFLIGHT_BODY)
            .await
            .map_err(|e| route_fail(e.refusal()))?;
        Request::from_parts(parts, crate::body::full(bytes))
    } else {
        request
    };
    let response = inner
        .link
        .forward(request, Some(&caller), lease.as_ref())
        .await
        .map_err(|r| (r, surface.clone()))?;
    if route != Route::Preflight || !response.status().is_success() {
        return Ok(response);
    }
    let (parts, body) = response.into_parts();
    let bytes = read_to_bytes(body, MAX_ANSWER).await.map_err(|e| {
        route_fail(Refusal::NotAvailable {
            reason: format!("agent-device's upload ticket could not be read: {e}"),
            retriable: true,
        })
    })?;
    Ok(answer_from(
        parts,
        with_credentials(bytes, &caller.credential),
    ))
}

/// Puts the caller's own credentials into an upload ticket's headers, so the CLI's PUT is
/// authenticated as the caller. The host already pointed the ticket's URL at the caller's
/// origin and removed agent-device's own token from it.
fn with_credentials(bytes: Bytes, credential: &str) -> Bytes {
    let Ok(mut ticket) = serde_json::from_slice::<Value>(&bytes) else {
        return bytes;
    };
    let Some(headers) = ticket
        .get_mut("upload")
        .and_then(|u| u.get_mut("headers"))
        .and_then(Value::as_object_mut)
    else {
        return bytes;
    };
    headers.insert(
        "authorization".into(),
        Value::from(format!("Bearer {credential}")),
    );
    headers.insert(TOKEN_HEADER.into(), Value::from(credential));
    Bytes::from(ticket.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every rule of a release resumed after a restart, one try at a time; the not-stored
    /// then `UNKNOWN_LEASE` sequence keeps the row.
    #[test]
    fn a_resumed_release_ends_keeps_or_tries_again_by_its_answer() {
        let refused = |code: ErrorCode| Err(ContractError::new(code, "refused"));
        let not_stored = Err(ContractError::release_not_stored("not stored"));
        for unstored in [false, true] {
            assert_eq!(
                resumed_release_next(&Ok(()), unstored),
                Resumed::Ended(Later::Done),
                "carried out"
            );
            assert_eq!(
                resumed_release_next(&not_stored, unstored),
                Resumed::Again { unstored: true },
                "taken, not stored: tried again"
            );
            for again in [
                ErrorCode::WorkerUnreachable,
                ErrorCode::Internal,
                ErrorCode::DaemonConnectionLost,
                ErrorCode::DaemonStopping,
            ] {
                assert_eq!(
                    resumed_release_next(&refused(again), unstored),
                    Resumed::Again { unstored },
                    "{again}: tried again, what was not stored still remembered"
                );
            }
            for gives_up in [ErrorCode::Forbidden, ErrorCode::BadRequest] {
                assert_eq!(
                    resumed_release_next(&refused(gives_up), unstored),
                    Resumed::Ended(Later::Done),
                    "{gives_up}: nothing a later try mends"
                );
            }
        }
        assert_eq!(
            resumed_release_next(&refused(ErrorCode::UnknownLease), false),
            Resumed::Ended(Later::Done),
            "the lease ended already"
        );
        assert_eq!(
            resumed_release_next(&refused(ErrorCode::UnknownLease), true),
            Resumed::Ended(Later::Kept),
            "the fleet holds the unstored release in memory only: the row stays kept"
        );
    }

    #[test]
    fn a_healthy_answer_is_kept_for_ten_minutes_and_no_other_is_kept() {
        let parts = |status: StatusCode| {
            Response::builder()
                .status(status)
                .body(())
                .unwrap()
                .into_parts()
                .0
        };
        let healthy = Bytes::from_static(br#"{"ok":true,"rpcProtocolVersion":2}"#);
        let t0 = Instant::now().into_std();
        let mut kept = KeptHealth::default();
        // Not healthy: a 200 saying `ok: false`, a 503, a body that is no JSON.
        kept.offer(
            &parts(StatusCode::OK),
            &Bytes::from_static(br#"{"ok":false}"#),
            t0,
        );
        kept.offer(&parts(StatusCode::SERVICE_UNAVAILABLE), &healthy, t0);
        kept.offer(&parts(StatusCode::OK), &Bytes::from_static(b"ok"), t0);
        assert!(kept.answer(t0).is_none());
        kept.offer(&parts(StatusCode::OK), &healthy, t0);
        assert_eq!(
            kept.answer(t0 + HEALTH_KEPT).map(|(_, b)| b),
            Some(healthy.clone())
        );
        assert!(
            kept.answer(t0 + HEALTH_KEPT + Duration::from_nanos(1))
                .is_none()
        );
        // A later unhealthy answer leaves the kept one; a later healthy one replaces it.
        let later = t0 + Duration::from_secs(60);
        kept.offer(
            &parts(StatusCode::OK),
            &Bytes::from_static(br#"{"ok":false}"#),
            later,
        );
        assert!(
            kept.answer(t0 + HEALTH_KEPT + Duration::from_secs(1))
                .is_none()
        );
        kept.offer(&parts(StatusCode::OK), &healthy, later);
        assert!(
            kept.answer(t0 + HEALTH_KEPT + Duration::from_secs(1))
                .is_some()
        );
    }

    #[test]
    fn a_token_sent_twice_is_refused_and_one_sent_once_in_either_header_is_read() {
        let clock = simlock_daemon::clock::TokioClock::system().shared();
        let db = simlock_daemon::store::Database::open_in_memory().unwrap();
        let tokens = TokenStore::open(db, clock).unwrap();
        let (secret, _) = tokens
            .create(simlock_contract::model::TokenRole::Agent, None)
            .unwrap();
        let with = |pairs: &[(&str, String)]| {
            let mut headers = HeaderMap::new();
            for (name, value) in pairs {
                headers.append(
                    HeaderName::from_bytes(name.as_bytes()).unwrap(),
                    HeaderValue::from_str(value).unwrap(),
                );
            }
            headers
        };
        let bearer = format!("Bearer {secret}");
        assert!(authenticate(&tokens, &with(&[("authorization", bearer.clone())])).is_ok());
        assert!(authenticate(&tokens, &with(&[("x-agent-device-token", secret.clone())])).is_ok());
        let twice = with(&[
            ("authorization", bearer.clone()),
            ("authorization", bearer.clone()),
        ]);
        assert!(matches!(
            authenticate(&tokens, &twice),
            Err(Refusal::Unauthenticated(message)) if message == "Authorization: sent 2 times; send it once"
        ));
        // The CLI sends both headers, alike.
        let both = with(&[
            ("authorization", bearer.clone()),
            ("x-agent-device-token", secret.clone()),
        ]);
        assert!(authenticate(&tokens, &both).is_ok());
        // An empty token header is none, beside a bearer as alone.
        let empty = with(&[
            ("authorization", bearer.clone()),
            ("x-agent-device-token", String::new()),
        ]);
        assert!(authenticate(&tokens, &empty).is_ok());
        let token_twice = with(&[
            ("x-agent-device-token", secret.clone()),
            ("x-agent-device-token", secret.clone()),
        ]);
        assert!(matches!(
            authenticate(&tokens, &token_twice),
            Err(Refusal::Unauthenticated(message)) if message == "x-agent-device-token: sent 2 times; send it once"
        ));
        let (other, _) = tokens
            .create(simlock_contract::model::TokenRole::Agent, None)
            .unwrap();
        for pairs in [
            [
                ("authorization", bearer.clone()),
                ("x-agent-device-token", other.clone()),
            ],
            [
                ("authorization", format!("Bearer {other}")),
                ("x-agent-device-token", secret.clone()),
            ],
        ] {
            assert!(matches!(
                authenticate(&tokens, &with(&pairs)),
                Err(Refusal::Unauthenticated(message))
                    if message == "Authorization and x-agent-device-token name different tokens; send one, or the same in both"
            ));
        }
    }

    #[test]
    fn a_lease_a_gateways_front_made_is_one_a_front_made_and_a_plain_gateway_lease_is_not() {
        let l = "0123456789abcdef0123456789abcdef";
        let expected = LeaseId::parse(l);
        assert_eq!(made_by_a_front(l, l), expected);
        assert_eq!(made_by_a_front(l, &format!("gw:g1:{l}")), expected);
        // A gateway's plain simlock lease: its requester is the agent's, its id simlock's.
        assert_eq!(made_by_a_front("lse_1", "gw:g1:agent"), None);
        assert_eq!(made_by_a_front(l, "gw:g1:agent"), None);
        assert_eq!(made_by_a_front(l, &format!("gw::{l}")), None);
        // Only the worker's own front recovers a lease for a direct caller.
        assert_eq!(made_by_front(l, &format!("gw:g1:{l}")), None);
    }

    #[test]
    fn a_dead_daemons_lost_leases_are_the_front_leases_it_named_direct_or_through_a_gateway() {
        let record = |id: &str, requester: &str| -> LeaseRecord {
            serde_json::from_value(serde_json::json!({
                "id": id, "deviceId": "dev_1", "requesterId": requester, "ownerId": "tok_a",
                "grantedAt": 0, "lastRenewedAt": 0, "ttlDeadline": 1, "ttlMs": 1
            }))
            .unwrap()
        };
        let (lost_direct, kept, lost_relayed) = (
            "0123456789abcdef0123456789abcdef",
            "1123456789abcdef0123456789abcdef",
            "2123456789abcdef0123456789abcdef",
        );
        let leases = [
            record(lost_direct, lost_direct),
            // Made since, on the new daemon: not among the lost.
            record(kept, kept),
            record(lost_relayed, &format!("gw:g1:{lost_relayed}")),
            // A plain simlock lease, whatever its id.
            record("lse_1", "agent-7"),
        ];
        let lost = [
            LeaseId::parse(lost_direct).unwrap(),
            LeaseId::parse(lost_relayed).unwrap(),
        ];
        let picked: Vec<String> = front_leases(&leases, |l| lost.contains(l))
            .into_iter()
            .map(|(lease, record)| {
                assert_eq!(record.id.as_str(), lease.as_str());
                lease.to_string()
            })
            .collect();
        assert_eq!(picked, [lost_direct, lost_relayed]);
        // At a worker's start, every front lease: the plain one still not.
        assert_eq!(front_leases(&leases, |_| true).len(), 3);
    }

    #[test]
    fn a_lease_the_front_made_has_its_own_id_as_requester_and_a_front_lease_id() {
        let l = "0123456789abcdef0123456789abcdef";
        assert_eq!(
            made_by_front(l, l).map(|id| id.to_string()),
            Some(l.to_owned())
        );
        assert_eq!(made_by_front(l, "agent-7"), None, "another requester");
        assert_eq!(
            made_by_front("ci-run-981", "ci-run-981"),
            None,
            "not a front lease id"
        );
    }

    #[test]
    fn routes_are_agent_device_routes_under_the_prefix() {
        let p = |m: Method, path: &str| Route::parse(&m, path);
        assert_eq!(
            p(Method::GET, "/v1/agent-device/health"),
            Some(Route::Health)
        );
        assert_eq!(p(Method::POST, "/v1/agent-device/rpc"), Some(Route::Rpc));
        assert_eq!(
            p(Method::GET, "/v1/agent-device/rpc"),
            None,
            "another method"
        );
        assert_eq!(
            p(Method::PUT, "/v1/agent-device/upload/direct/abc"),
            Some(Route::Direct)
        );
        assert_eq!(p(Method::PUT, "/v1/agent-device/upload/direct/"), None);
        assert_eq!(
            p(
                Method::GET,
                "/v1/agent-device/sessions/a%3Ab/requests/r1/diagnostics"
            ),
            Some(Route::Diagnostics)
        );
        assert_eq!(
            p(Method::GET, "/v1/agent-device/admin/human-control/holds"),
            None
        );
        assert_eq!(p(Method::GET, "/v1/agent-device"), None);
        // An artifact is named by one segment that decodes to a name, never to a path.
        for id in [
            "26b1c844-daef-4ba9-8f2a-67f9724c8c31",
            "shot.png",
            "a%20b",
            "...",
        ] {
            let path = format!("/v1/agent-device/artifacts/{id}");
            assert_eq!(p(Method::GET, &path), Some(Route::Artifact), "{id}");
        }
        for id in [
            "",
            ".",
            "..",
            "%2E%2E",
            "..%2F..%2Fetc",
            "a%2Fb",
            "a%5Cb",
            "a%00b",
            "a%0Ab",
            "%FF",
        ] {
            let path = format!("/v1/agent-device/artifacts/{id}");
            assert_eq!(p(Method::GET, &path), None, "{id}");
        }
        assert_eq!(p(Method::GET, "/v1/agent-device/artifacts/../x"), None);
        // So are an upload's, a session's and a request's.
        for bad in ["..", "%2E%2E", "a%2Fb", "a%00b"] {
            assert_eq!(
                p(
                    Method::PUT,
                    &format!("/v1/agent-device/upload/direct/{bad}")
                ),
                None
            );
            for path in [
                format!("/v1/agent-device/sessions/{bad}/requests/r1/diagnostics"),
                format!("/v1/agent-device/sessions/s1/requests/{bad}/diagnostics"),
            ] {
                assert_eq!(p(Method::GET, &path), None, "{path}");
            }
        }
    }

    #[test]
    fn devices_of_one_id_on_two_workers_both_appear_each_from_its_own_answer() {
        let device = |name: &str, id: &str| json!({"platform": "android", "id": id, "name": name});
        let w1 = vec![
            device("w1 emulator", "emulator-5554"),
            device("w1 other", "emulator-5556"),
        ];
        let w2 = vec![
            device("w2 emulator", "emulator-5554"),
            device("w2 other", "emulator-5558"),
        ];
        let outcomes = vec![Some(Ok(Listed::Devices(w1))), Some(Ok(Listed::Devices(w2)))];
        let Ok(Joined::Devices(joined)) =
            join_devices(&["emulator-5554", "emulator-5554"], outcomes)
        else {
            panic!("joined");
        };
        let names: Vec<&str> = joined.iter().filter_map(|d| d["name"].as_str()).collect();
        assert_eq!(
            names,
            ["w1 emulator", "w2 emulator"],
            "each cut to its own lease, in lease order"
        );
    }

    #[test]
    fn the_first_failing_lease_in_lease_order_wins_and_a_cancelled_one_adds_nothing() {
        let lease = |c: char| LeaseId::parse(&c.to_string().repeat(32)).unwrap();
        let failed = |l: LeaseId| (Refusal::DevicesUnreadable(l), Surface::Route);
        let outcomes = vec![
            None,
            Some(Err(failed(lease('b')))),
            Some(Err(failed(lease('c')))),
        ];
        let Err((refusal, _)) = join_devices(&["a", "b", "c"], outcomes) else {
            panic!("a failure");
        };
        assert_eq!(refusal, Refusal::DevicesUnreadable(lease('b')));
    }

    #[test]
    fn a_ticket_gets_the_callers_credentials() {
        let ticket = br#"{"ok":true,"uploadId":"u","upload":{"url":"http://gw/v1/agent-device/upload/direct/u","headers":{"content-type":"application/octet-stream"}}}"#;
        let out: Value =
            serde_json::from_slice(&with_credentials(Bytes::from_static(ticket), "slk_me"))
                .unwrap();
        assert_eq!(
            out["upload"]["headers"]["authorization"],
            json!("Bearer slk_me")
        );
        assert_eq!(
            out["upload"]["headers"]["x-agent-device-token"],
            json!("slk_me")
        );
        assert_eq!(
            out["upload"]["headers"]["content-type"],
            json!("application/octet-stream")
        );
        let not_a_ticket = Bytes::from_static(b"{\"ok\":false}");
        assert_eq!(with_credentials(not_a_ticket.clone(), "x"), not_a_ticket);
    }
}
