//! Owns and proxies a worker's agent-device daemon; the relay target `agent-device`.
//!
//! [`AgentDeviceHost`] starts the daemon (`agentDevice.command`) with its state under
//! `$SIMLOCK_HOME/agent-device`, in HTTP mode, reads where it serves, restarts it with backoff
//! when it goes away, and stops it by pid. It forwards requests as agent-device's own proxy
//! does ([`proxy`]) under the tenant the caller is given, mapping the front's lease ids to the
//! daemon's. Before simlock reclaims a device, [`AgentDeviceHost::end_lease`] ends the
//! agent-device lease on it. [`InProcessHostLink`] is the front's port on a worker;
//! [`AgentDeviceHost::relay_target`] serves the same requests relayed from a gateway.

pub mod process;
pub mod proxy;
pub mod sessions;
pub mod supervise;

use std::collections::{BTreeSet, HashMap};
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use agent_device_front::body::Guarded;
use agent_device_front::body::{ReadError, Upstream, read_to_bytes, upstream};
use agent_device_front::port::{
    Caller, HostLink, HostStatus, RecoveredLease, Serving, StatusScope,
};
use agent_device_front::renewal::{KeepAsk, RenewAsk, Renewal};
use agent_device_front::reply::{Refusal, Surface};
use agent_device_front::rpc::Answer;
use agent_device_front::{Body, BoxError, LeaseId, PREFIX, Tenant};
use bytes::Bytes;
use futures::FutureExt;
use futures::future::BoxFuture;
use http::{Method, Request, Response, StatusCode};
use http_body_util::BodyExt;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use parking_lot::Mutex;
use serde_json::{Value, json};
use simlock_contract::model::{CapabilityStatus, Platform};
use simlock_relay_worker::{RelayRequest, RelayTarget, ResponseBody};
use tokio::sync::{mpsc, watch};
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};

use crate::process::{DaemonSpec, Endpoint};
use crate::proxy::RpcRewrite;
use crate::supervise::{Phase, Supervision};

/// How long a daemon gets to say where it serves.
pub const START_TIMEOUT: Duration = Duration::from_secs(30);
/// How long a daemon gets between SIGTERM and SIGKILL (it drains sessions first: 1–3 s).
pub const STOP_GRACE: Duration = Duration::from_secs(5);
/// How often a running daemon's `/health` is read; two failed rounds in a row restart it (a
/// round reads again at once when its first read fails), so a daemon that stopped answering is
/// restarted within two rounds of two bounded reads: 40 s at most.
pub const HEALTH_INTERVAL: Duration = Duration::from_secs(10);
/// How long a session record nothing writes to is kept (`agentDevice.sessionRetentionMs`).
pub const SESSION_RETENTION: Duration =
    Duration::from_millis(agent_device_front::config::DEFAULT_SESSION_RETENTION_MS);
/// The longest wait between two sweeps of the session records.
const SESSION_SWEEP_MAX_EVERY: Duration = Duration::from_secs(600);
/// The shortest wait between two sweeps (a retention of nothing would sweep without pause).
const SESSION_SWEEP_MIN_EVERY: Duration = Duration::from_secs(1);
/// The bound on one `/health` read, and on each call the host makes on its own.
pub const CALL_TIMEOUT: Duration = Duration::from_secs(5);
/// How long a connection to the daemon may idle before it is not used again: under Node's
/// keep-alive timeout (5 s), so a request never goes on a connection the daemon is closing, nor,
/// after this process was stopped for a while, on one it closed meanwhile.
const POOL_IDLE: Duration = Duration::from_secs(4);
/// The bound on a forwarded `/rpc` call, until its answer's head: agent-device's own proxy's
/// upstream bound. A command the daemon never answers ends there, and its lease's renewals
/// with it.
pub const COMMAND_TIMEOUT: Duration = Duration::from_secs(300);
/// The largest `/rpc` body (agent-device's own cap; the front that sent it took 4 KiB less).
const MAX_RPC_BODY: usize = agent_device_front::rpc::AGENT_DEVICE_MAX_RPC_BODY;
/// The largest answer the host rewrites (lease answers, tickets).
const MAX_ANSWER: usize = 4 * 1024 * 1024;
/// The frame a request body is gathered into on its way to the daemon: the daemon pays per
/// chunk it parses and per wake-up (measured: 16 KiB chunks cost it about twice per byte what
/// 256 KiB ones do, 64 KiB ones about 1.4 times), and the host's own sends cost less per byte in
/// larger writes.
const UPSTREAM_FRAME: usize = 1024 * 1024;
/// How long a part of a request body waits for more before it goes to the daemon short of
/// [`UPSTREAM_FRAME`]: long enough for the next socket read or link part of a running upload,
/// short beside any upload's pace.
const UPSTREAM_LINGER: Duration = Duration::from_millis(5);

/// Which daemon a host serves.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Daemon {
    /// One it starts and supervises.
    Spawn(DaemonSpec),
    /// One that already runs at an endpoint (tests attach an in-process fake here, so that a
    /// paused clock drives both).
    Attach(Endpoint),
}

/// What a host is started with.
#[derive(Debug, Clone)]
pub struct HostOptions {
    /// The daemon.
    pub daemon: Daemon,
    /// How long a start may take.
    pub start_timeout: Duration,
    /// SIGTERM to SIGKILL.
    pub stop_grace: Duration,
    /// How often `/health` is read.
    pub health_interval: Duration,
    /// A spawned daemon's session records nothing wrote to for this long are removed
    /// (`agentDevice.sessionRetentionMs`, [`sessions`]).
    pub session_retention: Duration,
}

impl HostOptions {
    /// Options with the default timing.
    pub fn new(command: Vec<String>, state_dir: PathBuf) -> Self {
        Self {
            daemon: Daemon::Spawn(DaemonSpec {
                command,
                state_dir,
                env: Vec::new(),
            }),
            start_timeout: START_TIMEOUT,
            stop_grace: STOP_GRACE,
            health_interval: HEALTH_INTERVAL,
            session_retention: SESSION_RETENTION,
        }
    }
}

/// Where the daemon stands, as the host reports it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DaemonState {
    /// It serves at `endpoint`.
    Running(Endpoint),
    /// It does not, and why.
    Unavailable(String),
}

impl DaemonState {
    /// The worker's `agent-device` capability while the daemon stands so: available while it
    /// runs, unavailable with the reason otherwise.
    pub fn capability(&self) -> CapabilityStatus {
        let (available, reason) = match self {
            Self::Running(_) => (true, None),
            Self::Unavailable(reason) => (false, Some(reason.clone())),
        };
        CapabilityStatus {
            name: agent_device_front::CAPABILITY.into(),
            available,
            reason,
        }
    }
}

/// One agent-device lease the host forwarded the allocate of.
#[derive(Debug, Clone, PartialEq, Eq)]
struct HostLease {
    /// The daemon's own id for it.
    daemon_id: String,
    /// The tenant it lives under.
    tenant: Tenant,
    /// Its run id.
    run_id: String,
    /// The session it was made for.
    session: Option<String>,
    /// The tenant the caller declared, shown back in lease answers.
    caller_tenant: Option<String>,
    /// The device key the daemon recorded, filled in where a caller left it out.
    device_key: Option<String>,
    /// Its backend, filled in where a command left it out.
    backend: Option<String>,
}

impl HostLease {
    /// Its session as the daemon names it: the one it was made for, else agent-device's default.
    fn session(&self) -> &str {
        self.session.as_deref().unwrap_or(DEFAULT_SESSION)
    }
}

/// The session agent-device puts a call in when it names none.
const DEFAULT_SESSION: &str = "default";

impl HostLease {
    fn mapping(&self) -> proxy::LeaseMapping<'_> {
        proxy::LeaseMapping {
            daemon_id: &self.daemon_id,
            run_id: &self.run_id,
            device_key: self.device_key.as_deref(),
            backend: self.backend.as_deref(),
        }
    }
}

struct Shared {
    state: watch::Sender<DaemonState>,
    leases: Mutex<HashMap<LeaseId, HostLease>>,
    /// Numbers the keeps' request ids, so two at once never share one.
    keeps: AtomicU64,
    client: Client<HttpConnector, Upstream>,
    /// Where the leases a daemon took with it when it died go ([`AgentDeviceHost::lost_leases`]);
    /// dropped when the supervision ends, which ends the receiver's stream.
    lost: Mutex<Option<mpsc::UnboundedSender<Vec<LeaseId>>>>,
}

impl Shared {
    /// Hands `leases` over as lost with their daemon (kept in the channel until the receiver is
    /// taken; nothing once the supervision ended).
    fn lose(&self, leases: Vec<LeaseId>) {
        if leases.is_empty() {
            return;
        }
        if let Some(lost) = &*self.lost.lock() {
            let _ = lost.send(leases);
        }
    }
}

/// The worker's agent-device host.
#[derive(Clone)]
pub struct AgentDeviceHost {
    shared: Arc<Shared>,
    stop: CancellationToken,
    supervisor: Arc<Mutex<Option<tokio::task::JoinHandle<()>>>>,
    lost: Arc<Mutex<Option<mpsc::UnboundedReceiver<Vec<LeaseId>>>>>,
}

impl std::fmt::Debug for AgentDeviceHost {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AgentDeviceHost")
            .field("state", &*self.shared.state.borrow())
            .finish_non_exhaustive()
    }
}

/// The retriable refusal for a request the daemon did not answer (it died or closed the
/// connection), naming the root cause (`connection closed before message completed`), not the
/// HTTP client's own layers around it.
fn not_answered(e: &(dyn std::error::Error + 'static)) -> Refusal {
    let mut root = e;
    while let Some(source) = root.source() {
        root = source;
    }
    Refusal::NotAvailable {
        reason: format!("the agent-device daemon did not answer ({root}); retry"),
        retriable: true,
    }
}

impl AgentDeviceHost {
    /// Stops whatever an earlier run left behind, then starts the daemon and supervises it.
    /// Returns at once; [`Self::state`] says when it serves.
    pub async fn start(options: HostOptions) -> Self {
        if let Daemon::Spawn(spec) = &options.daemon {
            process::stop_leftovers(&spec.state_dir, options.stop_grace).await;
        }
        let (state, _) = watch::channel(match &options.daemon {
            Daemon::Spawn(_) => {
                DaemonState::Unavailable("the agent-device daemon is starting".into())
            }
            Daemon::Attach(endpoint) => DaemonState::Running(endpoint.clone()),
        });
        let mut connector = HttpConnector::new();
        connector.set_nodelay(true);
        let client = Client::builder(TokioExecutor::new())
            .pool_idle_timeout(POOL_IDLE)
            .build(connector);
        let (lost, lost_rx) = mpsc::unbounded_channel();
        // An attached daemon is not this host's to restart: it loses nothing through it.
        let lost = matches!(options.daemon, Daemon::Spawn(_)).then_some(lost);
        let shared = Arc::new(Shared {
            state,
            leases: Mutex::new(HashMap::new()),
            keeps: AtomicU64::new(0),
            client,
            lost: Mutex::new(lost),
        });
        let stop = CancellationToken::new();
        let task = match options.daemon.clone() {
            Daemon::Spawn(spec) => {
                // Read for each session as it is swept, so that one a lease takes meanwhile stays.
                let held =
                    {
                        let shared = shared.clone();
                        move |name: &str| {
                            shared.leases.lock().values().any(|l| {
                                sessions::names_session(name, l.tenant.as_str(), l.session())
                            })
                        }
                    };
                tokio::spawn(sessions::sweep_until_stopped(
                    spec.state_dir.clone(),
                    options.session_retention,
                    (options.session_retention / 4)
                        .clamp(SESSION_SWEEP_MIN_EVERY, SESSION_SWEEP_MAX_EVERY),
                    held,
                    stop.clone(),
                ));
                tokio::spawn(supervise(shared.clone(), spec, options, stop.clone()))
            }
            Daemon::Attach(_) => {
                let (shared, stop) = (shared.clone(), stop.clone());
                tokio::spawn(async move {
                    stop.cancelled().await;
                    shared.state.send_replace(DaemonState::Unavailable(
                        "the agent-device daemon is stopped".into(),
                    ));
                })
            }
        };
        Self {
            shared,
            stop,
            supervisor: Arc::new(Mutex::new(Some(task))),
            lost: Arc::new(Mutex::new(Some(lost_rx))),
        }
    }

    /// The leases each daemon that died (or stopped answering and was stopped) held: one list
    /// per death, sent as the supervision restarts it. The new daemon holds none of them, so
    /// whoever owns their simlock leases ends them at once rather than at their TTL. The first
    /// call takes the receiver; later ones answer `None`. A daemon stopped with the host sends
    /// nothing: its leases stay, and the next start deals with them. The stream ends when the
    /// supervision does (at once for an attached daemon).
    pub fn lost_leases(&self) -> Option<mpsc::UnboundedReceiver<Vec<LeaseId>>> {
        self.lost.lock().take()
    }

    /// Where the daemon stands now.
    pub fn state(&self) -> DaemonState {
        self.shared.state.borrow().clone()
    }

    /// Changes of [`Self::state`].
    pub fn watch(&self) -> watch::Receiver<DaemonState> {
        self.shared.state.subscribe()
    }

    /// The worker's `agent-device` capability now.
    pub fn capability(&self) -> CapabilityStatus {
        self.shared.state.borrow().capability()
    }

    /// Stops the daemon (SIGTERM, SIGKILL after the grace) and the supervision.
    pub async fn stop(&self) {
        self.stop.cancel();
        let task = self.supervisor.lock().take();
        if let Some(task) = task {
            let _ = task.await;
        }
    }

    /// Ends the agent-device lease behind simlock lease `lease` (its session closed, then the
    /// lease released), before simlock reclaims the device. Bounded; a failure is logged.
    pub async fn end_lease(&self, lease: &LeaseId) {
        let Some(record) = self.shared.leases.lock().remove(lease) else {
            return;
        };
        let DaemonState::Running(endpoint) = self.state() else {
            return;
        };
        // The calls the CLI would make for the lease (`close`, then the release), filled in and
        // rewritten as any caller's.
        let session = record.session();
        let close = json!({
            "jsonrpc": "2.0", "id": format!("simlock-close-{lease}"), "method": "agent_device.command",
            "params": {"session": session, "command": "close", "positionals": [],
                "flags": {}, "meta": {}},
        });
        let release = json!({
            "jsonrpc": "2.0", "id": format!("simlock-release-{lease}"), "method": "agent_device.lease.release",
            "params": {"session": session, "leaseId": lease.as_str()},
        });
        for call in [close, release] {
            match self.call_for(&endpoint, &record, &call).await {
                Ok(answer) => debug!(%lease, ?answer, "ended with its simlock lease"),
                Err(e) => warn!(%lease, error = %e, "the agent-device lease could not be ended"),
            }
        }
        info!(%lease, "agent-device lease ended before the device is reclaimed");
    }

    /// A call the host makes itself for `record`'s lease, rewritten as any caller's (the
    /// daemon's token, the lease's tenant and its ids), then sent ([`Self::call_daemon`]).
    async fn call_for(
        &self,
        endpoint: &Endpoint,
        record: &HostLease,
        call: &Value,
    ) -> Result<Value, String> {
        let mut call = RpcRewrite::parse(call.to_string().as_bytes())
            .ok_or("the call could not be read back")?;
        call.rewrite(
            &endpoint.token,
            record.tenant.as_str(),
            Some(record.mapping()),
        );
        self.call_daemon(endpoint, &call.to_bytes()).await
    }

    async fn call_daemon(&self, endpoint: &Endpoint, call: &Bytes) -> Result<Value, String> {
        let headers = proxy::upstream_headers(
            &http::HeaderMap::new(),
            &endpoint.token,
            "",
            proxy::DaemonRoute::Rpc,
        );
        let request = proxy::upstream_request(
            Method::POST,
            endpoint.port,
            "/rpc",
            headers,
            upstream(agent_device_front::body::full(call.clone())),
        )
        .ok_or("the request could not be built")?;
        let response = tokio::time::timeout(CALL_TIMEOUT, self.send(request))
            .await
            .map_err(|_| format!("no answer within {CALL_TIMEOUT:?}"))?
            .map_err(|e| e.to_string())?;
        let bytes = tokio::time::timeout(
            CALL_TIMEOUT,
            read_to_bytes(response.into_body(), MAX_ANSWER),
        )
        .await
        .map_err(|_| format!("no answer within {CALL_TIMEOUT:?}"))?
        .map_err(|e| e.to_string())?;
        serde_json::from_slice(&bytes).map_err(|e| e.to_string())
    }

    /// Forwards one request (absolute URI under `/v1/agent-device`) to the daemon, for
    /// `tenant`, naming the front's `lease` when it is for one.
    ///
    /// # Errors
    /// The reply to answer instead, in the request's envelope: the daemon is unavailable, the
    /// request is refused, the daemon did not answer.
    pub async fn forward(
        &self,
        request: Request<Body>,
        tenant: &Tenant,
        lease: Option<&LeaseId>,
    ) -> Result<Response<Body>, (Refusal, Surface)> {
        let (parts, body) = request.into_parts();
        let path = parts.uri.path();
        let route = path.strip_prefix(PREFIX).unwrap_or(path).to_owned();
        let query = parts
            .uri
            .query()
            .map(|q| format!("?{q}"))
            .unwrap_or_default();
        let public_prefix = match (parts.uri.scheme_str(), parts.uri.authority()) {
            (Some(scheme), Some(authority)) => format!("{scheme}://{authority}{PREFIX}"),
            _ => PREFIX.to_owned(),
        };
        let caller_request_id = parts.headers.get("x-request-id").cloned();
        if route == "/rpc" {
            let bytes = read_to_bytes(body, MAX_RPC_BODY)
                .await
                .map_err(|e| (e.refusal(), Surface::Rpc { id: Value::Null }))?;
            let call = RpcRewrite::parse(&bytes).ok_or((
                Refusal::Invalid {
                    rpc_code: -32700,
                    message: "Parse error".into(),
                },
                Surface::Rpc { id: Value::Null },
            ))?;
            let surface = Surface::Rpc { id: call.id() };
            let endpoint = self.endpoint().map_err(|r| (r, surface.clone()))?;
            if call.installs_from_a_path() {
                return Err((
                    Refusal::Invalid {
                        rpc_code: -32602,
                        message: "Invalid params: an install source of kind \"path\" names a file on the daemon's host and is not accepted from a caller".into(),
                    },
                    surface,
                ));
            }
            return self
                .forward_rpc(
                    &endpoint,
                    &parts.headers,
                    call,
                    tenant,
                    lease,
                    caller_request_id,
                )
                .await
                .map_err(|r| (r, surface));
        }
        let surface = Surface::Route;
        let endpoint = self.endpoint().map_err(|r| (r, surface.clone()))?;
        if route == "/health" {
            return self.health(&endpoint).await.map_err(|r| (r, surface));
        }
        if let Some(rest) = route.strip_prefix("/sessions/") {
            let segment = rest.split('/').next().unwrap_or_default();
            if !proxy::session_inside(segment, tenant.as_str()) {
                return Err((Refusal::NotFound, surface));
            }
        }
        let headers = proxy::upstream_headers(
            &parts.headers,
            &endpoint.token,
            tenant.as_str(),
            proxy::DaemonRoute::Other,
        );
        // Uploads reach the daemon in frames of UPSTREAM_FRAME, whatever sizes they came in (the
        // link's parts are 16 KiB; a socket's reads cut a chunk in two): the daemon pays per
        // chunk it parses.
        let body = agent_device_front::body::Coalesced::new(body, UPSTREAM_FRAME, UPSTREAM_LINGER)
            .boxed_unsync();
        let upstream = proxy::upstream_request(
            parts.method.clone(),
            endpoint.port,
            &format!("{route}{query}"),
            headers,
            body,
        )
        .ok_or((Refusal::NotFound, Surface::Route))?;
        let response = self.send(upstream).await.map_err(|r| (r, Surface::Route))?;
        let response = proxy::downstream(response, caller_request_id.as_ref());
        if route != "/upload/preflight" || !response.status().is_success() {
            return Ok(response);
        }
        rewritten(response, |ticket| {
            proxy::rewrite_ticket(ticket, &public_prefix);
            true
        })
        .await
        .map_err(|e| (unreadable(&e), Surface::Route))
    }

    async fn forward_rpc(
        &self,
        endpoint: &Endpoint,
        incoming: &http::HeaderMap,
        mut call: RpcRewrite,
        tenant: &Tenant,
        lease: Option<&LeaseId>,
        caller_request_id: Option<http::HeaderValue>,
    ) -> Result<Response<Body>, Refusal> {
        let method = call.method().to_owned();
        let known = lease.and_then(|l| self.shared.leases.lock().get(l).cloned());
        let scope = match (&method[..], lease) {
            ("lease.allocate", Some(l)) => Some(call.allocate_scope(l)),
            _ => None,
        };
        let caller_tenant = call.caller_tenant();
        if lease.is_none() && method == "command" {
            // Before `connect` (no lease) the daemon refuses a command for want of a lease's
            // ids; its one answer gains the hint to connect first below. A progress stream's
            // refusal would come as its last line, past the hint.
            call.without_progress();
        }
        let mapping = known.as_ref().map(HostLease::mapping);
        call.rewrite(&endpoint.token, tenant.as_str(), mapping);
        let body = call.to_bytes();
        let mut headers = proxy::upstream_headers(
            incoming,
            &endpoint.token,
            tenant.as_str(),
            proxy::DaemonRoute::Rpc,
        );
        proxy::set_length(&mut headers, body.len());
        let upstream = proxy::upstream_request(
            Method::POST,
            endpoint.port,
            "/rpc",
            headers,
            upstream(agent_device_front::body::full(body)),
        )
        .ok_or(Refusal::NotFound)?;
        let response = tokio::time::timeout(COMMAND_TIMEOUT, self.send(upstream))
            .await
            .map_err(|_| Refusal::NotAvailable {
                reason: format!(
                    "the agent-device daemon did not answer {method} within {} s",
                    COMMAND_TIMEOUT.as_secs()
                ),
                retriable: true,
            })??;
        let response = proxy::downstream(response, caller_request_id.as_ref());
        // Only a refusal is read (a command's answer may be large, and streams).
        if lease.is_none() && method == "command" && !response.status().is_success() {
            // The daemon's answer to a command sent before `connect`, with the hint to connect
            // first when it refused it for want of a lease.
            return rewritten(response, agent_device_front::reply::hint_connect_first)
                .await
                .map_err(|e| unreadable(&e));
        }
        let Some(lease) = lease.filter(|_| method.starts_with("lease.")) else {
            return Ok(response);
        };
        // A lease answer: the daemon's id becomes the front's, and an allocate is recorded.
        rewritten(response, |answer| {
            if let (Some(scope), Some(daemon_id)) = (scope, proxy::answered_lease_id(answer)) {
                self.record_allocated(
                    endpoint,
                    lease.clone(),
                    HostLease {
                        daemon_id,
                        tenant: tenant.clone(),
                        run_id: scope.run_id,
                        session: scope.session,
                        caller_tenant: scope.caller_tenant,
                        device_key: answer
                            .pointer("/result/data/lease/deviceKey")
                            .and_then(Value::as_str)
                            .map(String::from),
                        backend: answer
                            .pointer("/result/data/lease/backend")
                            .and_then(Value::as_str)
                            .map(String::from),
                    },
                );
            }
            if method == "lease.release" && answer.pointer("/result/ok") == Some(&Value::Bool(true))
            {
                self.shared.leases.lock().remove(lease);
            }
            let shown_tenant = caller_tenant.or_else(|| known.and_then(|k| k.caller_tenant));
            proxy::rewrite_lease_answer(answer, lease, shown_tenant.as_deref());
            true
        })
        .await
        .map_err(|e| unreadable(&e))
    }

    /// Records the agent-device lease `lease` the daemon at `endpoint` allocated. A daemon that
    /// has since died (the state is no longer `Running` on that endpoint) took it with it: it
    /// is handed over as lost, never left for the next daemon's map. The state is read under
    /// the map's lock, and the supervision changes the state before it drains the map, so a
    /// lease is either drained with its daemon or handed over here.
    fn record_allocated(&self, endpoint: &Endpoint, lease: LeaseId, record: HostLease) {
        let mut leases = self.shared.leases.lock();
        let alive =
            matches!(&*self.shared.state.borrow(), DaemonState::Running(e) if e == endpoint);
        if alive {
            leases.insert(lease, record);
        } else {
            drop(leases);
            self.shared.lose(vec![lease]);
        }
    }

    /// `/health` in the shape agent-device's proxy answers it, the daemon's own inside.
    async fn health(&self, endpoint: &Endpoint) -> Result<Response<Body>, Refusal> {
        let upstream = proxy::upstream_request(
            Method::GET,
            endpoint.port,
            "/health",
            http::HeaderMap::new(),
            upstream(agent_device_front::body::empty()),
        )
        .ok_or(Refusal::NotFound)?;
        let response = tokio::time::timeout(CALL_TIMEOUT, self.send(upstream))
            .await
            .map_err(|_| Refusal::NotAvailable {
                reason: "the agent-device daemon did not answer /health".into(),
                retriable: true,
            })??;
        let status = response.status();
        let bytes = read_to_bytes(response.into_body(), MAX_ANSWER)
            .await
            .map_err(|e| unreadable(&e))?;
        let upstream: Value = serde_json::from_slice(&bytes).unwrap_or(Value::Null);
        let body = json!({
            "ok": status.is_success(),
            "service": "simlock-agent-device",
            "version": upstream.get("version").cloned().unwrap_or(Value::Null),
            "rpcProtocolVersion": upstream.get("rpcProtocolVersion").cloned().unwrap_or(Value::Null),
            "upstream": upstream,
        });
        Ok(agent_device_front::body::json(StatusCode::OK, &body))
    }

    fn endpoint(&self) -> Result<Endpoint, Refusal> {
        match self.state() {
            DaemonState::Running(endpoint) => Ok(endpoint),
            DaemonState::Unavailable(reason) => Err(Refusal::NotAvailable {
                reason,
                retriable: true,
            }),
        }
    }

    async fn send(&self, request: Request<Upstream>) -> Result<Response<Body>, Refusal> {
        let response = self
            .shared
            .client
            .request(request)
            .await
            .map_err(|e| not_answered(&e))?;
        let (parts, body) = response.into_parts();
        Ok(Response::from_parts(
            parts,
            body.map_err(|e| -> BoxError { Box::new(e) }).boxed_unsync(),
        ))
    }

    /// Heartbeats agent-device's `lease` to `ttl_ms` and, once it answered ok, renews the
    /// simlock lease to the same with `renew` ([`Keeper`]): the call a heartbeat makes, as
    /// [`Self::end_lease`] makes the CLI's close and release. Bounded; a failure is logged and
    /// left for the agent's next call to meet.
    async fn keep(&self, lease: &LeaseId, ttl_ms: u64, renew: Option<&RenewLease>) {
        let Some(record) = self.shared.leases.lock().get(lease).cloned() else {
            return;
        };
        let DaemonState::Running(endpoint) = self.state() else {
            return;
        };
        let n = self.shared.keeps.fetch_add(1, Ordering::Relaxed);
        let mut params = json!({"leaseId": lease.as_str(), "ttlMs": ttl_ms});
        if let Some(session) = &record.session {
            params["session"] = Value::from(session.as_str());
        }
        let beat = json!({
            "jsonrpc": "2.0", "id": format!("{lease}:{n}:keep"),
            "method": "agent_device.lease.heartbeat", "params": params,
        });
        match self.call_for(&endpoint, &record, &beat).await {
            Ok(answer) if answer.pointer("/result/ok") == Some(&Value::Bool(true)) => {
                if let Some(Err(e)) = renew.map(|renew| renew(lease, ttl_ms)) {
                    debug!(%lease, code = %e.code, "the simlock lease was not kept after its command");
                }
            }
            Ok(answer) => {
                debug!(%lease, ?answer, "agent-device's lease was not kept after its command")
            }
            Err(e) => {
                debug!(%lease, error = %e, "agent-device's lease was not kept after its command")
            }
        }
    }

    /// The relay target `agent-device`: requests a gateway relays, for the tenant it computed.
    /// With `renew`, a heartbeat whose relay asks for it ([`RenewAsk`]) renews the worker's
    /// simlock lease once the daemon answered ok, and its answer says so ([`Renewal`]); without
    /// it, the ask is dropped and the gateway renews the lease itself.
    pub fn relay_target(&self, renew: Option<RenewLease>) -> Arc<dyn RelayTarget> {
        Arc::new(HostTarget {
            host: self.clone(),
            renew,
        })
    }

    /// Serves one relayed request: forwards it for `tenant` and, with `renew`,
    /// renews the simlock lease after an ok answer ([`Self::relay_target`]).
    async fn relayed(
        &self,
        mut request: Request<Body>,
        tenant: &Tenant,
        lease: Option<&LeaseId>,
        renew: Option<&RenewLease>,
    ) -> Response<Body> {
        // Taken off whether or not this host renews: the daemon never sees it.
        let ask = RenewAsk::take(request.headers_mut());
        let response = self
            .forward(request, tenant, lease)
            .await
            .unwrap_or_else(|(refusal, surface)| refusal.into_response(&surface));
        match (ask, lease, renew) {
            (Some(ask), Some(lease), Some(renew)) => {
                renew_after_ok(response, lease, ask, renew).await
            }
            _ => response,
        }
    }
}

/// Renews the worker's simlock lease named by a relayed heartbeat to now plus a TTL, with the
/// authority of the gateway that relayed it (the composition gives it the core's
/// `lease.renew`, as the gateway's own renewal over the uplink would reach it).
pub type RenewLease =
    Arc<dyn Fn(&LeaseId, u64) -> Result<(), simlock_contract::ContractError> + Send + Sync>;

/// A relayed heartbeat's answer, with the simlock lease renewed when the daemon answered ok
/// (the seed's order: agent-device first, then simlock). Any other answer goes back as it
/// came, with no [`Renewal`].
async fn renew_after_ok(
    response: Response<Body>,
    lease: &LeaseId,
    ask: RenewAsk,
    renew: &RenewLease,
) -> Response<Body> {
    if !response.status().is_success() {
        return response;
    }
    let (mut parts, body) = response.into_parts();
    let bytes = match read_to_bytes(body, MAX_ANSWER).await {
        Ok(bytes) => bytes,
        Err(error) => {
            return unreadable(&error).into_response(&Surface::Rpc { id: Value::Null });
        }
    };
    if matches!(Answer::read(&bytes), Answer::Ok(_)) {
        match renew(lease, ask.ttl_ms) {
            Ok(()) => Renewal::Renewed.put(&mut parts.headers),
            Err(e) if e.code == simlock_contract::ErrorCode::UnknownLease => {
                Renewal::LeaseEnded.put(&mut parts.headers);
            }
            Err(e) => {
                // The gateway, seeing no renewal, renews the lease itself and answers its error.
                warn!(%lease, code = %e.code, message = %e.message, "a relayed heartbeat's lease could not be renewed here");
            }
        }
    }
    Response::from_parts(parts, agent_device_front::body::full(bytes))
}

/// `response` with its JSON body read whole (at most [`MAX_ANSWER`]) and handed to `rewrite`:
/// when it rewrote it (answers `true`), the body is the rewritten JSON and its length is set;
/// a body that is not JSON, or one left as it was, goes on as it came.
async fn rewritten(
    response: Response<Body>,
    rewrite: impl FnOnce(&mut Value) -> bool,
) -> Result<Response<Body>, ReadError> {
    let (mut parts, body) = response.into_parts();
    let bytes = read_to_bytes(body, MAX_ANSWER).await?;
    let changed = serde_json::from_slice::<Value>(&bytes)
        .ok()
        .and_then(|mut answer| rewrite(&mut answer).then(|| Bytes::from(answer.to_string())));
    let bytes = match changed {
        Some(changed) => {
            proxy::set_length(&mut parts.headers, changed.len());
            changed
        }
        None => bytes,
    };
    Ok(Response::from_parts(
        parts,
        agent_device_front::body::full(bytes),
    ))
}

fn unreadable(error: &ReadError) -> Refusal {
    Refusal::NotAvailable {
        reason: format!("the agent-device daemon's answer could not be read: {error}"),
        retriable: true,
    }
}

/// The supervision's shell: start, watch, restart after a backoff, stop.
async fn supervise(
    shared: Arc<Shared>,
    spec: DaemonSpec,
    options: HostOptions,
    stop: CancellationToken,
) {
    let mut supervision = Supervision::new();
    let epoch = tokio::time::Instant::now();
    let now = || epoch.elapsed();
    loop {
        let spawned = tokio::select! {
            spawned = process::spawn(&spec, options.start_timeout, options.stop_grace) => spawned,
            () = stop.cancelled() => break,
        };
        match spawned {
            Ok(mut daemon) => {
                supervision.handle_started(now());
                shared
                    .state
                    .send_replace(DaemonState::Running(daemon.endpoint.clone()));
                let ended = tokio::select! {
                    status = daemon.child.wait() => Ended::Exited(status.map_or_else(|e| e.to_string(), |s| s.to_string())),
                    () = unhealthy(options.health_interval, health_probe(&daemon.endpoint)) => Ended::Unhealthy,
                    () = stop.cancelled() => Ended::Stop,
                };
                if matches!(ended, Ended::Stop) {
                    // A daemon stopped with the host hands nothing over, an allocate it answers
                    // while it stops included.
                    shared.lost.lock().take();
                }
                shared.state.send_replace(DaemonState::Unavailable(
                    "the agent-device daemon is restarting".into(),
                ));
                process::stop(
                    &daemon.recorded,
                    Some(&mut daemon.child),
                    options.stop_grace,
                )
                .await;
                process::clear_pid_file(&spec.state_dir);
                // A new daemon knows none of the old one's leases.
                // (The state left `Running` above, before this drain: an allocate answered
                // after it is handed over by `record_allocated`, never left in the map.)
                let lost: Vec<LeaseId> = shared.leases.lock().drain().map(|(l, _)| l).collect();
                let reason = match ended {
                    Ended::Stop => break,
                    Ended::Exited(status) => {
                        format!("the agent-device daemon exited ({status}); restarting")
                    }
                    Ended::Unhealthy => {
                        "the agent-device daemon stopped answering /health; restarting".to_owned()
                    }
                };
                warn!(%reason, leases = lost.len(), "agent-device daemon down");
                shared.lose(lost);
                supervision.handle_down(now(), reason);
            }
            Err(e) => {
                let reason = format!("{e}; retrying");
                warn!(%reason, "agent-device daemon did not start");
                supervision.handle_down(now(), reason);
            }
        }
        // The machine says why the daemon is down and when the next start is due.
        if let Phase::Down { reason, .. } = supervision.phase() {
            shared
                .state
                .send_replace(DaemonState::Unavailable(reason.clone()));
        }
        let Some(retry_at) = supervision.poll_timeout() else {
            break;
        };
        tokio::select! {
            () = tokio::time::sleep_until(epoch + retry_at) => {}
            () = stop.cancelled() => break,
        }
        supervision.handle_timeout(now());
    }
    supervision.handle_stop();
    shared.state.send_replace(DaemonState::Unavailable(
        "the agent-device daemon is stopped".into(),
    ));
    // No daemon of this host will die again: the lost leases' stream ends.
    shared.lost.lock().take();
}

enum Ended {
    Exited(String),
    Unhealthy,
    Stop,
}

/// Returns once the daemon failed two rounds of health reads in a row, a round every
/// `interval`. A round whose read fails reads again at once before it counts: a worker that was
/// stopped (SIGSTOP, a paused VM) or starved of CPU wakes with the bound of a read in flight
/// already past, though the daemon answered it; the second read, with its own bound, tells a
/// daemon that answers from one that does not (trial 13: a frozen worker restarted its healthy
/// daemon and ended the agents' leases).
async fn unhealthy<Probe, Read>(interval: Duration, mut probe: Probe)
where
    Probe: FnMut() -> Read,
    Read: Future<Output = bool>,
{
    let mut failures = 0;
    loop {
        tokio::time::sleep(interval).await;
        let healthy = probe().await || probe().await;
        failures = if healthy { 0 } else { failures + 1 };
        if failures >= 2 {
            return;
        }
    }
}

/// One health read of the daemon at `endpoint`, bounded by [`CALL_TIMEOUT`], each on a
/// connection of its own: a pooled one the daemon closed while this process was not running
/// would fail the read for a reason that is not the daemon's.
fn health_probe(endpoint: &Endpoint) -> impl FnMut() -> BoxFuture<'static, bool> + use<> {
    let mut connector = HttpConnector::new();
    connector.set_nodelay(true);
    let client: Client<HttpConnector, Upstream> = Client::builder(TokioExecutor::new())
        .pool_max_idle_per_host(0)
        .build(connector);
    let port = endpoint.port;
    move || {
        let client = client.clone();
        Box::pin(async move {
            let Some(request) = proxy::upstream_request(
                Method::GET,
                port,
                "/health",
                http::HeaderMap::new(),
                upstream(agent_device_front::body::empty()),
            ) else {
                return false;
            };
            matches!(
                tokio::time::timeout(CALL_TIMEOUT, client.request(request)).await,
                Ok(Ok(response)) if response.status().is_success()
            )
        })
    }
}

struct HostTarget {
    host: AgentDeviceHost,
    renew: Option<RenewLease>,
}

impl RelayTarget for HostTarget {
    fn call(
        &self,
        relayed: RelayRequest,
    ) -> BoxFuture<'static, Result<Response<ResponseBody>, BoxError>> {
        let host = self.host.clone();
        let renew = self.renew.clone();
        async move {
            let RelayRequest {
                request,
                tenant,
                lease_id,
                cancel,
            } = relayed;
            let rpc = request.uri().path().ends_with("/rpc");
            let surface = if rpc {
                Surface::Rpc { id: Value::Null }
            } else {
                Surface::Route
            };
            let Some(tenant) = Tenant::from_peer(&tenant) else {
                return Ok(Refusal::TokenNotUsable.into_response(&surface));
            };
            let lease = lease_id.as_deref().and_then(LeaseId::parse);
            let (mut parts, body) = request.into_parts();
            // Dropped when the exchange ends, however it ends: then it keeps the lease.
            let keeper = match (KeepAsk::take(&mut parts.headers), &lease) {
                (Some(ask), Some(lease)) => Some(Keeper {
                    host: host.clone(),
                    lease: lease.clone(),
                    ttl_ms: ask.ttl_ms,
                    renew: renew.clone(),
                }),
                _ => None,
            };
            let body = body.map_err(|e| -> BoxError { Box::new(e) }).boxed_unsync();
            let request = Request::from_parts(parts, body);
            tokio::select! {
                response = host.relayed(request, &tenant, lease.as_ref(), renew.as_ref()) => {
                    let Some(keeper) = keeper else {
                        return Ok(response);
                    };
                    let (mut parts, body) = response.into_parts();
                    KeepAsk::taken(&mut parts.headers);
                    let body = Guarded::new(body, keeper).boxed_unsync();
                    Ok(Response::from_parts(parts, body))
                }
                () = cancel.cancelled() => Err("the relay was cancelled".into()),
            }
        }
        .boxed()
    }
}

/// A relayed device command's [`KeepAsk`], carried out when it drops: when the command's
/// answer has been read to its end, or the exchange was cut (the relay cancelled, the uplink
/// or the gateway gone), agent-device's lease is heartbeaten to the lease's TTL and, once it
/// answered ok, the simlock lease renewed to the same. agent-device 0.21.5 put its lease back
/// to its 60 s default when the command came; without this, a gateway that stopped
/// mid-command would leave the agent a minute before its device is lost.
struct Keeper {
    host: AgentDeviceHost,
    lease: LeaseId,
    ttl_ms: u64,
    renew: Option<RenewLease>,
}

impl Drop for Keeper {
    fn drop(&mut self) {
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let (host, lease, ttl_ms, renew) = (
            self.host.clone(),
            self.lease.clone(),
            self.ttl_ms,
            self.renew.take(),
        );
        runtime.spawn(async move {
            host.keep(&lease, ttl_ms, renew.as_ref()).await;
        });
    }
}

/// A simlock lease the worker holds, as the front's recovery reads it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WorkerLease {
    /// Who may renew and release it.
    pub owner: String,
    /// Who it is for: the front's own leases have their id as requester.
    pub requester: String,
    /// Its device, as agent-device names it.
    pub device: RecoveredLease,
}

/// Reads the worker's simlock lease by id (the composition gives it the core's lease table).
pub type FindLease = Arc<dyn Fn(&LeaseId) -> Option<WorkerLease> + Send + Sync>;

/// The front's port on a worker: every request goes to this worker's own host, under the
/// caller's principal as tenant. The lease id is not needed to place anything.
pub struct InProcessHostLink {
    host: AgentDeviceHost,
    platforms: Arc<dyn Fn() -> BTreeSet<Platform> + Send + Sync>,
    max_ttl_ms: u64,
    find: FindLease,
}

impl std::fmt::Debug for InProcessHostLink {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("InProcessHostLink")
            .field("host", &self.host)
            .finish_non_exhaustive()
    }
}

impl InProcessHostLink {
    /// A link to `host` on a worker whose devices have `platforms`, whose `lease.maxTtlMs` is
    /// `max_ttl_ms`, and whose simlock leases `find` reads.
    pub fn new(
        host: AgentDeviceHost,
        platforms: impl Fn() -> BTreeSet<Platform> + Send + Sync + 'static,
        max_ttl_ms: u64,
        find: FindLease,
    ) -> Self {
        Self {
            host,
            platforms: Arc::new(platforms),
            max_ttl_ms,
            find,
        }
    }
}

impl HostLink for InProcessHostLink {
    fn status(&self, scope: StatusScope<'_>) -> HostStatus {
        match self.host.state() {
            // The catalog is read for a new lease alone: a lease's calls need only the ceiling.
            DaemonState::Running(_) => HostStatus::Running(match scope {
                StatusScope::NewLease => Serving {
                    platforms: (self.platforms)(),
                    lease_max_ttl_ms: None,
                },
                StatusScope::Lease { .. } => Serving {
                    platforms: BTreeSet::new(),
                    lease_max_ttl_ms: Some(self.max_ttl_ms),
                },
            }),
            DaemonState::Unavailable(reason) => HostStatus::unavailable(reason),
        }
    }

    fn forward(
        &self,
        request: Request<Body>,
        caller: Option<&Caller>,
        lease: Option<&LeaseId>,
    ) -> BoxFuture<'static, Result<Response<Body>, Refusal>> {
        let host = self.host.clone();
        let tenant = Tenant::on_worker(caller.map_or("", |c| c.principal.as_str()));
        let lease = lease.cloned();
        async move {
            host.forward(request, &tenant, lease.as_ref())
                .await
                .map_err(|(refusal, _)| refusal)
        }
        .boxed()
    }

    /// A lease of the caller's that the front made before this worker restarted: the simlock
    /// lease survived on disk, the front's memory did not (and the agent-device daemon, started
    /// anew, no longer holds it, so the next heartbeat ends it: `LEASE_ENDED_BY_HOST`). Any
    /// other lease is not the caller's, or not one the front made.
    fn recover(&self, lease: &LeaseId, caller: &Caller) -> Result<RecoveredLease, Refusal> {
        match (self.find)(lease) {
            Some(held)
                if held.owner == caller.principal
                    && agent_device_front::made_by_front(lease.as_str(), &held.requester)
                        .is_some() =>
            {
                Ok(held.device)
            }
            _ => Err(Refusal::NotYours {
                lease: lease.clone(),
                hosts: agent_device_front::Hosts::One,
            }),
        }
    }

    fn lease_requires(&self) -> Vec<String> {
        Vec::new()
    }

    fn hosts(&self) -> agent_device_front::Hosts {
        agent_device_front::Hosts::One
    }
}

#[cfg(test)]
mod tests {
    use agent_device_fake::LeaseOp;
    use agent_device_fake::{DaemonError, ErrorCode as FakeCode, FakeAgentDevice, FakeOptions};
    use simlock_contract::{ContractError, ErrorCode};

    use super::*;

    #[derive(Debug, thiserror::Error)]
    #[error("client error (SendRequest)")]
    struct Outer(#[source] std::io::Error);

    #[test]
    fn a_request_the_daemon_did_not_answer_is_named_by_its_cause_and_retriable() {
        let e = Outer(std::io::Error::other(
            "connection closed before message completed",
        ));
        let refusal = not_answered(&e);
        assert_eq!(
            refusal.to_string(),
            "agent-device is not available on this simlock: the agent-device daemon did not answer (connection closed before message completed); retry"
        );
        assert!(matches!(
            refusal,
            Refusal::NotAvailable {
                retriable: true,
                ..
            }
        ));
    }

    /// `unhealthy` over scripted reads: how many reads it made before it gave up, or `None`
    /// when it had not within `rounds` rounds.
    async fn health_rounds(script: &[bool], rounds: u32) -> (Option<usize>, usize) {
        let reads = Arc::new(AtomicU64::new(0));
        let probe = {
            let (reads, script) = (reads.clone(), script.to_vec());
            move || {
                let n = reads.fetch_add(1, Ordering::SeqCst);
                let answer = script
                    .get(usize::try_from(n).unwrap())
                    .copied()
                    .unwrap_or(true);
                std::future::ready(answer)
            }
        };
        let interval = Duration::from_secs(10);
        let gave_up =
            tokio::time::timeout(interval * rounds + interval / 2, unhealthy(interval, probe))
                .await
                .is_ok();
        let reads = usize::try_from(reads.load(Ordering::SeqCst)).unwrap();
        (gave_up.then_some(reads), reads)
    }

    #[tokio::test(start_paused = true)]
    async fn a_failed_health_read_counts_only_when_the_read_at_once_after_it_fails_too() {
        // A worker that wakes from a freeze finds its read in flight past its bound: the read
        // again at once is answered, and nothing counts.
        assert_eq!(
            health_rounds(&[false, true, false, true, false, true], 5).await,
            (None, 8),
            "each failed read answered again at once: never down"
        );
        // A daemon that answers neither read of a round, two rounds in a row, is down.
        assert_eq!(health_rounds(&[false; 4], 5).await, (Some(4), 4));
        // One failed round between answered ones counts for nothing.
        assert_eq!(
            health_rounds(&[false, false, true, false, false, true], 6).await,
            (None, 8)
        );
        assert_eq!(
            health_rounds(&[true, false, false, false, false], 6).await,
            (Some(5), 5),
            "two failed rounds in a row after a good one"
        );
    }

    const L: &str = "0123456789abcdef0123456789abcdef";

    /// What a renewal port was asked, and what it answers.
    struct Port {
        asked: Mutex<Vec<(LeaseId, u64)>>,
        answer: Mutex<Result<(), ContractError>>,
    }

    impl Port {
        fn new() -> Arc<Self> {
            Arc::new(Self {
                asked: Mutex::new(Vec::new()),
                answer: Mutex::new(Ok(())),
            })
        }

        fn renew(self: &Arc<Self>) -> RenewLease {
            let port = self.clone();
            Arc::new(move |lease: &LeaseId, ttl_ms: u64| {
                port.asked.lock().push((lease.clone(), ttl_ms));
                port.answer.lock().clone()
            })
        }
    }

    struct Bench {
        fake: FakeAgentDevice,
        host: AgentDeviceHost,
        lease: LeaseId,
        tenant: Tenant,
    }

    /// A host attached to a fake, with `L` allocated through it under a gateway's tenant.
    async fn bench() -> Bench {
        let fake = FakeAgentDevice::start(FakeOptions::default()).unwrap();
        let mut options = HostOptions::new(Vec::new(), std::env::temp_dir());
        options.daemon = Daemon::Attach(Endpoint {
            port: fake.port(),
            token: fake.token().to_owned(),
        });
        let host = AgentDeviceHost::start(options).await;
        let mut states = host.watch();
        states
            .wait_for(|s| matches!(s, DaemonState::Running(_)))
            .await
            .unwrap();
        let lease = LeaseId::parse(L).unwrap();
        let tenant = Tenant::through_gateway("gw1", "tok_a");
        let answer = host.relayed(allocate(), &tenant, Some(&lease), None).await;
        let bytes = read_to_bytes(answer.into_body(), MAX_ANSWER).await.unwrap();
        assert!(
            matches!(Answer::read(&bytes), Answer::Ok(_)),
            "{}",
            String::from_utf8_lossy(&bytes)
        );
        Bench {
            fake,
            host,
            lease,
            tenant,
        }
    }

    /// The allocate that makes lease `L`.
    fn allocate() -> Request<Body> {
        rpc(
            "a1",
            "agent_device.lease.allocate",
            json!({"session": "s1", "tenantId": "acme", "runId": "run1", "backend": "android-instance"}),
        )
    }

    fn rpc(id: &str, method: &str, params: Value) -> Request<Body> {
        let body = json!({"jsonrpc": "2.0", "id": id, "method": method, "params": params});
        Request::post("http://gw.example/v1/agent-device/rpc")
            .header("content-type", "application/json")
            .body(agent_device_front::body::full(body.to_string()))
            .unwrap()
    }

    impl Bench {
        /// A heartbeat for `L`, with the ask for a renewal to `ask` when given, relayed naming
        /// `lease` to a host with `port` (none: an older worker's host, in effect): the
        /// answer's renewal, and whether agent-device said ok.
        async fn beat(
            &self,
            ask: Option<u64>,
            lease: Option<&LeaseId>,
            port: Option<&Arc<Port>>,
        ) -> (Option<Renewal>, bool) {
            let mut request = rpc(
                "h1",
                "agent_device.lease.heartbeat",
                json!({"session": "s1", "tenantId": "acme", "runId": "run1", "leaseId": L}),
            );
            if let Some(ttl_ms) = ask {
                RenewAsk { ttl_ms }.put(request.headers_mut());
            }
            let renew = port.map(Port::renew);
            let answer = self
                .host
                .relayed(request, &self.tenant, lease, renew.as_ref())
                .await;
            let (mut parts, body) = answer.into_parts();
            let renewal = Renewal::take(&mut parts.headers);
            let bytes = read_to_bytes(body, MAX_ANSWER).await.unwrap();
            (renewal, matches!(Answer::read(&bytes), Answer::Ok(_)))
        }

        /// The heartbeats the daemon received, each checked to carry no simlock header.
        fn heartbeats_seen_without_an_ask(&self) -> usize {
            let seen: Vec<_> = self
                .fake
                .requests()
                .into_iter()
                .filter(|r| String::from_utf8_lossy(&r.body).contains("lease.heartbeat"))
                .collect();
            for request in &seen {
                assert!(
                    request
                        .headers
                        .iter()
                        .all(|(name, _)| !name.starts_with("x-simlock")),
                    "the ask never reaches the daemon: {:?}",
                    request.headers
                );
            }
            seen.len()
        }

        async fn stop(self) {
            self.fake.stop().await;
            self.host.stop().await;
        }
    }

    #[tokio::test]
    async fn an_asked_heartbeat_renews_the_lease_after_the_daemons_ok_and_says_so() {
        let b = bench().await;
        let port = Port::new();
        let lease = Some(&b.lease);
        assert_eq!(
            b.beat(Some(600_000), lease, Some(&port)).await,
            (Some(Renewal::Renewed), true)
        );
        assert_eq!(*port.asked.lock(), vec![(b.lease.clone(), 600_000)]);
        assert_eq!(b.heartbeats_seen_without_an_ask(), 1, "agent-device first");
        b.stop().await;
    }

    #[tokio::test]
    async fn a_lease_the_worker_does_not_know_answers_ended_and_another_failure_no_renewal() {
        let b = bench().await;
        let port = Port::new();
        let lease = Some(&b.lease);
        *port.answer.lock() = Err(ContractError::new(ErrorCode::UnknownLease, "no such lease"));
        assert_eq!(
            b.beat(Some(5_000), lease, Some(&port)).await,
            (Some(Renewal::LeaseEnded), true)
        );
        *port.answer.lock() = Err(ContractError::bad_request("ttlMs: above lease.maxTtlMs"));
        assert_eq!(
            b.beat(Some(5_000), lease, Some(&port)).await,
            (None, true),
            "the gateway, seeing none, renews itself and answers its own error"
        );
        assert_eq!(port.asked.lock().len(), 2);
        b.stop().await;
    }

    #[tokio::test]
    async fn a_heartbeat_the_daemon_fails_renews_nothing() {
        let b = bench().await;
        let port = Port::new();
        b.fake.fail_next_lease_calls(
            LeaseOp::Heartbeat,
            1,
            DaemonError::new(FakeCode::CommandFailed, "not now"),
        );
        assert_eq!(
            b.beat(Some(5_000), Some(&b.lease), Some(&port)).await,
            (None, false)
        );
        assert!(port.asked.lock().is_empty());
        b.stop().await;
    }

    #[tokio::test]
    async fn without_an_ask_a_lease_or_a_port_nothing_is_renewed_and_the_ask_is_still_dropped() {
        let b = bench().await;
        let port = Port::new();
        let lease = Some(&b.lease);
        assert_eq!(b.beat(None, lease, Some(&port)).await, (None, true));
        // An older worker's host, in effect: it has no port.
        assert_eq!(b.beat(Some(5_000), lease, None).await, (None, true));
        // A relay naming no lease renews none (the daemon refuses the unknown lease).
        assert_eq!(b.beat(Some(5_000), None, Some(&port)).await.0, None);
        assert!(port.asked.lock().is_empty());
        assert_eq!(b.heartbeats_seen_without_an_ask(), 3);
        b.stop().await;
    }

    /// The in-process link recovers a lease the front forgot (a worker restart) from the
    /// simlock lease, for its owner only, and only a lease the front made (requester `L`).
    #[tokio::test]
    async fn recovery_is_the_owners_and_only_for_a_lease_the_front_made() {
        let b = bench().await;
        let device = RecoveredLease {
            platform: Platform::Android,
            address: "emulator-5554".into(),
        };
        let held: Arc<Mutex<Option<WorkerLease>>> = Arc::new(Mutex::new(None));
        let find: FindLease = {
            let held = held.clone();
            Arc::new(move |_: &LeaseId| held.lock().clone())
        };
        let link = InProcessHostLink::new(b.host.clone(), BTreeSet::new, 600_000, find);
        let caller = |principal: &str| Caller {
            principal: principal.into(),
            role: simlock_contract::Role::Agent,
            credential: "slk_x".into(),
        };
        let not_yours = |r: Result<RecoveredLease, Refusal>| {
            matches!(
                r,
                Err(Refusal::NotYours {
                    hosts: agent_device_front::Hosts::One,
                    ..
                })
            )
        };
        assert!(
            not_yours(link.recover(&b.lease, &caller("tok_a"))),
            "no such lease"
        );
        *held.lock() = Some(WorkerLease {
            owner: "tok_a".into(),
            requester: L.into(),
            device: device.clone(),
        });
        assert_eq!(link.recover(&b.lease, &caller("tok_a")), Ok(device.clone()));
        assert!(
            not_yours(link.recover(&b.lease, &caller("tok_b"))),
            "another token's"
        );
        *held.lock() = Some(WorkerLease {
            owner: "tok_a".into(),
            requester: "ci-7".into(),
            device,
        });
        assert!(
            not_yours(link.recover(&b.lease, &caller("tok_a"))),
            "a lease made by `simlock lease --lease-id`, not by the front"
        );
        b.stop().await;
    }

    /// How long a test waits for what it expects before it fails.
    const PATIENCE: Duration = Duration::from_secs(30);

    /// A lease made in no named session is in agent-device's default one: its directory is
    /// the one the sweep keeps for it.
    #[test]
    fn a_lease_without_a_session_is_in_the_default_one() {
        let lease = |session: Option<&str>| HostLease {
            daemon_id: "d1".into(),
            tenant: Tenant::on_worker("agent"),
            run_id: "r1".into(),
            session: session.map(String::from),
            caller_tenant: None,
            device_key: None,
            backend: None,
        };
        let unnamed = lease(None);
        assert_eq!(unnamed.session(), "default");
        let dir = format!("{}_default", unnamed.tenant.as_str());
        assert!(sessions::names_session(
            &dir,
            unnamed.tenant.as_str(),
            unnamed.session()
        ));
        assert_eq!(lease(Some("adc-1")).session(), "adc-1");
    }

    /// A host that spawns its daemon sweeps the sessions an earlier daemon left at once: one
    /// nothing wrote to for the retention goes, a fresher one stays.
    #[tokio::test]
    async fn a_spawning_host_sweeps_old_sessions_when_it_starts() {
        let dir = tempfile::tempdir().unwrap();
        let state_dir = dir.path().join("state");
        let sessions = state_dir.join(sessions::SESSIONS_DIR);
        let now = std::time::SystemTime::now();
        for (name, age) in [("old", 7_200), ("fresh", 60)] {
            std::fs::create_dir_all(sessions.join(name)).unwrap();
            std::fs::File::open(sessions.join(name))
                .unwrap()
                .set_modified(now - Duration::from_secs(age))
                .unwrap();
        }
        let mut options = HostOptions::new(Vec::new(), state_dir.clone());
        // A daemon that never serves: the sweep does not wait for one.
        options.daemon = Daemon::Spawn(DaemonSpec {
            command: vec!["sh".into(), "-c".into(), "exit 3".into()],
            state_dir,
            env: Vec::new(),
        });
        let host = AgentDeviceHost::start(options).await;
        tokio::time::timeout(PATIENCE, async {
            while sessions.join("old").exists() {
                tokio::task::yield_now().await;
            }
        })
        .await
        .expect("the old session went");
        assert!(sessions.join("fresh").exists());
        host.stop().await;
    }

    fn endpoint_of(fake: &FakeAgentDevice) -> Endpoint {
        Endpoint {
            port: fake.port(),
            token: fake.token().to_owned(),
        }
    }

    /// A host whose daemon is `sh` serving as the in-process fake the file `$SERVES` names when
    /// it starts (`<port> <token>`; no file, no start), running once that daemon serves; with
    /// `deaf`, the daemon ignores TERM, so the host's stop waits out its grace (5 s) for it.
    struct ShHost {
        host: AgentDeviceHost,
        lost: mpsc::UnboundedReceiver<Vec<LeaseId>>,
        states: watch::Receiver<DaemonState>,
        serves: PathBuf,
        state_dir: PathBuf,
        _dir: tempfile::TempDir,
    }

    async fn sh_host(first: &FakeAgentDevice, deaf: bool) -> ShHost {
        let dir = tempfile::tempdir().unwrap();
        let serves = dir.path().join("serves");
        std::fs::write(&serves, format!("{} {}\n", first.port(), first.token())).unwrap();
        let state_dir = dir.path().join("state");
        let script = format!(
            r#"{}read -r port token < "$SERVES" || exit 3; printf '{{"httpPort":%s,"token":"%s","pid":%s}}' "$port" "$token" $$ > "$AGENT_DEVICE_STATE_DIR/daemon.json"; echo "AGENT_DEVICE_DAEMON_HTTP_PORT=$port"; exec sleep 600"#,
            if deaf { "trap '' TERM; " } else { "" }
        );
        let mut options = HostOptions::new(Vec::new(), state_dir.clone());
        options.daemon = Daemon::Spawn(DaemonSpec {
            command: vec!["sh".into(), "-c".into(), script],
            state_dir: state_dir.clone(),
            env: vec![("SERVES".into(), serves.display().to_string())],
        });
        // No health reads: the daemons go only when the test says.
        options.health_interval = Duration::from_secs(24 * 3600);
        options.stop_grace = Duration::from_secs(if deaf { 5 } else { 1 });
        let host = AgentDeviceHost::start(options).await;
        let lost = host.lost_leases().unwrap();
        let mut states = host.watch();
        tokio::time::timeout(
            PATIENCE,
            states.wait_for(|s| *s == DaemonState::Running(endpoint_of(first))),
        )
        .await
        .expect("the first daemon serves")
        .unwrap();
        ShHost {
            host,
            lost,
            states,
            serves,
            state_dir,
            _dir: dir,
        }
    }

    /// A relayed allocate of `lease`, sent and held by `daemon` before it answers: the
    /// allocate's task and the hold that lets it go.
    async fn allocate_held_by(
        host: &AgentDeviceHost,
        daemon: &FakeAgentDevice,
        lease: &LeaseId,
    ) -> (
        tokio::task::JoinHandle<Response<Body>>,
        agent_device_fake::CommandHold,
    ) {
        let hold = daemon.hold_commands("lease_allocate");
        let allocating = tokio::spawn({
            let (host, lease) = (host.clone(), lease.clone());
            async move {
                let tenant = Tenant::through_gateway("gw1", "tok_a");
                host.relayed(allocate(), &tenant, Some(&lease), None).await
            }
        });
        tokio::time::timeout(PATIENCE, hold.wait_entered(1))
            .await
            .expect("the daemon has the allocate");
        (allocating, hold)
    }

    /// An allocate of `L` that its daemon answers only once its process died and the host saw
    /// it go: dead (its restart fails), or, with `restarted`, replaced by a new daemon that
    /// serves. The daemon's process can die while the in-process fake still holds the
    /// allocate's answer, as an answer may still be on its way when its daemon dies.
    async fn allocate_answered_after_its_daemon_died(restarted: bool) {
        let first = FakeAgentDevice::start(FakeOptions::default()).unwrap();
        let next = FakeAgentDevice::start(FakeOptions::default()).unwrap();
        let names = |fake: &FakeAgentDevice| format!("{} {}\n", fake.port(), fake.token());
        let ShHost {
            host,
            mut lost,
            mut states,
            serves,
            state_dir,
            _dir,
        } = sh_host(&first, false).await;

        let lease = LeaseId::parse(L).unwrap();
        let (allocating, hold) = allocate_held_by(&host, &first, &lease).await;
        // The daemon dies with the allocate's answer still to come.
        if restarted {
            std::fs::write(&serves, names(&next)).unwrap();
        } else {
            std::fs::remove_file(&serves).unwrap();
        }
        let meta: Value =
            serde_json::from_slice(&std::fs::read(state_dir.join("daemon.json")).unwrap()).unwrap();
        let pid = i32::try_from(meta["pid"].as_i64().unwrap()).unwrap();
        rustix::process::kill_process(
            rustix::process::Pid::from_raw(pid).unwrap(),
            rustix::process::Signal::KILL,
        )
        .unwrap();
        let replaced = DaemonState::Running(endpoint_of(&next));
        tokio::time::timeout(
            PATIENCE,
            states.wait_for(|s| {
                if restarted {
                    *s == replaced
                } else {
                    matches!(s, DaemonState::Unavailable(_))
                }
            }),
        )
        .await
        .expect("the host saw the daemon go")
        .unwrap();
        assert!(
            lost.try_recv().is_err(),
            "the death lost nothing: the allocate was not recorded yet"
        );

        hold.release();
        tokio::time::timeout(PATIENCE, allocating)
            .await
            .expect("the allocate is answered")
            .unwrap();
        assert_eq!(
            lost.try_recv().ok(),
            Some(vec![lease.clone()]),
            "handed over as lost by the time the allocate was answered"
        );
        assert!(
            !host.shared.leases.lock().contains_key(&lease),
            "no daemon now running holds it"
        );
        // Ending its simlock lease asks no daemon to end an agent-device lease behind it.
        host.end_lease(&lease).await;
        assert!(
            next.requests().iter().all(|r| r.path != "/rpc"),
            "{:?}",
            next.requests()
        );

        host.stop().await;
        assert_eq!(
            tokio::time::timeout(PATIENCE, lost.recv())
                .await
                .expect("the stream ends with the supervision"),
            None,
            "lost once, and nothing else"
        );
        first.stop().await;
        next.stop().await;
    }

    #[tokio::test]
    async fn an_allocate_answered_while_the_host_stops_its_daemon_is_not_handed_over_as_lost() {
        let first = FakeAgentDevice::start(FakeOptions::default()).unwrap();
        let ShHost {
            host,
            mut lost,
            mut states,
            _dir,
            ..
        } = sh_host(&first, true).await;
        let lease = LeaseId::parse(L).unwrap();
        let (allocating, hold) = allocate_held_by(&host, &first, &lease).await;
        // The host stops; its daemon ignores TERM, so the stop waits out its grace, and the
        // allocate is answered meanwhile.
        let stopping = tokio::spawn({
            let host = host.clone();
            async move { host.stop().await }
        });
        tokio::time::timeout(
            PATIENCE,
            states.wait_for(|s| matches!(s, DaemonState::Unavailable(_))),
        )
        .await
        .expect("the host is stopping its daemon")
        .unwrap();
        hold.release();
        tokio::time::timeout(PATIENCE, allocating)
            .await
            .expect("the allocate is answered")
            .unwrap();
        assert!(
            !stopping.is_finished(),
            "answered within the stop's grace, while the daemon was being stopped"
        );
        tokio::time::timeout(PATIENCE, stopping)
            .await
            .expect("the host stops")
            .unwrap();
        assert_eq!(
            tokio::time::timeout(PATIENCE, lost.recv())
                .await
                .expect("the stream ends with the supervision"),
            None,
            "a daemon stopped with the host hands nothing over"
        );
        first.stop().await;
    }

    #[tokio::test]
    async fn an_allocate_answered_after_its_daemon_died_is_handed_over_as_lost_and_not_kept() {
        allocate_answered_after_its_daemon_died(false).await;
    }

    #[tokio::test]
    async fn an_allocate_answered_after_a_restart_replaced_its_daemon_is_lost_not_kept_for_the_new_one()
     {
        allocate_answered_after_its_daemon_died(true).await;
    }
}
