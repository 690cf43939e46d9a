//! An in-process daemon for tests of the client and of the CLI: the real dispatch pipeline with
//! canned handlers, served on a real unix socket in a temporary `SIMLOCK_HOME`, over real HTTP on
//! `127.0.0.1`, or over an in-memory pipe (for paused-time tests).
//!
//! Lease requests, cancels and exec output follow a script the test sets; every call to a canned
//! handler is recorded so a test can wait for one (`wait_for_calls`) instead of sleeping. The
//! event (`events.*`), token (`token.*`) and `daemon.stop` operations are the daemon crate's own
//! handlers and are not recorded.

use std::collections::{BTreeMap, HashMap};
use std::io;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use parking_lot::Mutex;
use serde_json::Value;
use simlock_contract::ids::{DeviceId, LeaseId};
use simlock_contract::model::{
    Capacity, Connection, DaemonInfo, Device, DeviceAccess, DeviceSpec, DeviceState, GrantDevice,
    GrantTiming, Health, HostFacts, LeaseEndReason, LeaseGrant, LeaseLimits, LeaseRecord, Mode,
    Platform, PlatformCatalog, WorkerView,
};
use simlock_contract::ops::{
    CancelResult, CatalogGet, CatalogOutput, ConfigGet, ConfigView, DeviceExec, ExecOutput,
    LeaseCancel, LeaseCancelOutput, LeaseGet, LeaseGetOutput, LeaseList, LeaseListOutput,
    LeaseRelease, LeaseReleaseAll, LeaseReleaseOutput, LeaseRenew, LeaseRequest, ListGet, ListKind,
    ListOutput, ReleaseAllOutput, StatusGet, StatusOutput, WorkerDrain, WorkerDrainOutput,
    WorkerList, WorkerListOutput, WorkerRemove, WorkerRemoveOutput, WorkerUndrain,
};
use simlock_contract::push::{OutputStream, Progress};
use simlock_contract::{ContractError, ErrorCode, Push, Role};
use simlock_daemon::auth::DaemonGreeter;
use simlock_daemon::clock::{SharedClock, TokioClock};
use simlock_daemon::context::CallCtx;
use simlock_daemon::events::EventBus;
use simlock_daemon::home::{AdminSecret, Home};
use simlock_daemon::http::requests::RequestBook;
use simlock_daemon::http::{HttpApp, bind, serve_http};
use simlock_daemon::metrics::Metrics;
use simlock_daemon::pipeline::{Pipeline, Router, Shutdown, StartupGate, register_daemon_ops};
use simlock_daemon::presence::Presence;
use simlock_daemon::socket::{claim, serve_socket};
use simlock_daemon::store::Database;
use simlock_daemon::tokens::TokenStore;
use simlock_wire::{Origin, Transport, serve};
use tokio::sync::{oneshot, watch};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

/// How the fake answers `lease.request`.
#[derive(Debug, Clone)]
pub enum RequestScript {
    /// Push these progress stages, then grant.
    Grant(Vec<Progress>),
    /// Push these progress stages, then refuse with the error.
    Fail(Vec<Progress>, ContractError),
    /// Push these progress stages, then wait until a cancel or [`FakeDaemon::settle_pending`]
    /// settles the request.
    Hold(Vec<Progress>),
}

/// How the fake answers `lease.cancel` while a request is held.
#[derive(Debug, Clone)]
pub enum CancelScript {
    /// The request was queued: it fails `CANCELLED`; answers `cancelled`.
    Cancelled,
    /// Device work started: answers `not-cancellable`, then grants the request.
    NotCancellable,
    /// The request settles with this outcome (a grant when `Ok`) before the cancel is seen;
    /// answers `not-found`.
    NotFound(Result<(), ContractError>),
}

/// What `device.exec` writes and answers.
#[derive(Debug, Clone)]
pub struct ExecScript {
    /// Chunks, in order.
    pub chunks: Vec<(OutputStream, String)>,
    /// The exit code.
    pub exit_code: i32,
}

impl Default for ExecScript {
    fn default() -> Self {
        Self {
            chunks: vec![
                (OutputStream::Stdout, "hello\n".to_owned()),
                (OutputStream::Stderr, "careful\n".to_owned()),
                (OutputStream::Stdout, "bye\n".to_owned()),
            ],
            exit_code: 3,
        }
    }
}

/// One call the fake received.
#[derive(Debug, Clone, PartialEq)]
pub struct Recorded {
    /// The operation.
    pub op: String,
    /// Its input, as JSON.
    pub input: Value,
    /// The caller's principal.
    pub principal: String,
    /// The caller's role.
    pub role: Role,
    /// When the handler ran (tokio time: paused tests read virtual time).
    pub at: tokio::time::Instant,
}

struct Pending {
    finish: oneshot::Sender<Result<(), ContractError>>,
}

struct State {
    clock: SharedClock,
    presence: Presence,
    request: Mutex<RequestScript>,
    cancel: Mutex<CancelScript>,
    exec: Mutex<ExecScript>,
    pending: Mutex<Option<Pending>>,
    leases: Mutex<BTreeMap<String, LeaseRecord>>,
    /// Lists (`lease.list`, `list.get`, `status.get`) leave the leases out.
    unlisted: AtomicBool,
    /// What every `lease.renew` answers instead of renewing, while set.
    renew_fails: Mutex<Option<ContractError>>,
    /// How long a renewal waits before it is answered.
    renew_delay: Mutex<std::time::Duration>,
    next_lease: AtomicU64,
    calls: watch::Sender<Vec<Recorded>>,
}

impl State {
    fn record<T: serde::Serialize>(&self, op: &str, ctx: &CallCtx, input: &T) {
        let recorded = Recorded {
            op: op.to_owned(),
            input: serde_json::to_value(input).unwrap_or(Value::Null),
            principal: ctx.principal.clone(),
            role: ctx.role,
            at: tokio::time::Instant::now(),
        };
        self.calls.send_modify(|calls| calls.push(recorded));
    }

    fn grant(&self, ctx: &CallCtx, requester: Option<String>, ttl_ms: Option<u64>) -> LeaseGrant {
        let now = self.clock.now_ms();
        let n = self.next_lease.fetch_add(1, Ordering::SeqCst) + 1;
        let ttl_ms = ttl_ms.unwrap_or(900_000);
        let lease = LeaseRecord {
            id: LeaseId::from_raw(format!("lse_{n}")),
            device_id: DeviceId::from_raw("dev_1"),
            requester_id: requester.unwrap_or_else(|| ctx.principal.clone()),
            owner_id: ctx.principal.clone(),
            granted_at: now,
            ttl_ms,
            ttl_deadline: now.saturating_add(i64::try_from(ttl_ms).unwrap_or(i64::MAX)),
            last_renewed_at: now,
            id_chosen_by_requester: false,
            worker: None,
            worker_id: None,
            access: Some(access()),
        };
        self.leases
            .lock()
            .insert(lease.id.to_string(), lease.clone());
        LeaseGrant {
            device: GrantDevice {
                id: DeviceId::from_raw("dev_1"),
                driver_device_id: "UDID-1".to_owned(),
                spec: spec(),
                address: None,
                access: Some(access()),
            },
            environment: access().environment(lease.id.as_str(), &lease.device_id),
            lease,
            timing: GrantTiming::default(),
        }
    }

    /// The leases the lists show.
    fn listed(&self) -> Vec<LeaseRecord> {
        if self.unlisted.load(Ordering::SeqCst) {
            return Vec::new();
        }
        self.leases.lock().values().cloned().collect()
    }

    fn owned(&self, ctx: &CallCtx, lease_id: &str) -> Result<LeaseRecord, ContractError> {
        self.leases
            .lock()
            .get(lease_id)
            .filter(|l| ctx.role == Role::Admin || l.owner_id == ctx.principal)
            .cloned()
            .ok_or_else(|| ContractError::unknown_lease(lease_id))
    }
}

/// How the fake's device is reached: a simulator in a set whose path needs shell quoting.
fn access() -> DeviceAccess {
    DeviceAccess::IosSimulator {
        udid: "UDID-1".to_owned(),
        device_set: "/tmp/it's a set".to_owned(),
    }
}

fn spec() -> DeviceSpec {
    DeviceSpec {
        platform: Platform::Ios,
        model: "iPhone 16".to_owned(),
        os_version: "18.0".to_owned(),
    }
}

fn device() -> Device {
    Device {
        id: DeviceId::from_raw("dev_1"),
        spec: spec(),
        state: DeviceState::Ready,
        driver_device_id: "UDID-1".to_owned(),
        created_at: 1_700_000_000_000,
        last_lease_ended_at: None,
        worker_id: None,
        worker: None,
        access: None,
        quarantine_attempts: None,
        quarantine_next_retry_at: None,
        recovery_attempts: None,
    }
}

fn worker_view(id: &str, drained: bool) -> WorkerView {
    WorkerView {
        id: id.to_owned(),
        label: Some("fake".to_owned()),
        connection: Connection::Connected,
        drained,
        last_seen_at: 1_700_000_000_000,
        health: Some(Health::Running),
        version: Some("fake".to_owned()),
        protocol: None,
        capacity: None,
        lease: None,
        queue_depth: Some(0),
        leases: None,
        devices: None,
        catalog: None,
        catalog_read_at: None,
        host: None,
        waiting: None,
        capabilities: None,
        releasing: Vec::new(),
    }
}

/// An in-process daemon with canned handlers.
pub struct FakeDaemon {
    state: Arc<State>,
    pipeline: Arc<Pipeline>,
    bus: Arc<EventBus>,
    tokens: Arc<TokenStore>,
    clock: SharedClock,
    home: tempfile::TempDir,
    admin_secret: String,
    operator_token: String,
    agent_token: String,
    agent_token_id: String,
    stop: CancellationToken,
    socket: Option<PathBuf>,
    http: Option<SocketAddr>,
    https: bool,
}

impl std::fmt::Debug for FakeDaemon {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FakeDaemon")
            .field("home", &self.home.path())
            .field("socket", &self.socket)
            .field("http", &self.http)
            .finish_non_exhaustive()
    }
}

impl Drop for FakeDaemon {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

fn other(e: impl std::fmt::Display) -> io::Error {
    io::Error::other(e.to_string())
}

impl FakeDaemon {
    /// A fake with a fresh temporary home holding its admin secret, an operator token and an
    /// agent token; serving nothing yet. Must be called inside a tokio runtime.
    ///
    /// # Errors
    /// When the home or the token store cannot be made.
    pub fn new() -> io::Result<Self> {
        let home = tempfile::Builder::new().prefix("slk").tempdir()?;
        let paths = Home::at(home.path());
        let admin = AdminSecret::create(&paths)?;
        let admin_secret = std::fs::read_to_string(paths.admin_token())?;
        let clock = TokioClock::system().shared();
        let db = Database::open_in_memory().map_err(other)?;
        let tokens = TokenStore::open(db, clock.clone()).map_err(other)?;
        let (operator_token, _) = tokens
            .create(
                simlock_contract::model::TokenRole::Operator,
                Some("ops".into()),
            )
            .map_err(other)?;
        let (agent_token, agent_record) = tokens
            .create(
                simlock_contract::model::TokenRole::Agent,
                Some("agent".into()),
            )
            .map_err(other)?;
        let bus = EventBus::new(256, clock.clone());
        let presence = Presence::new();
        let (calls, _) = watch::channel(Vec::new());
        let state = Arc::new(State {
            clock: clock.clone(),
            presence: presence.clone(),
            request: Mutex::new(RequestScript::Grant(Vec::new())),
            cancel: Mutex::new(CancelScript::Cancelled),
            exec: Mutex::new(ExecScript::default()),
            pending: Mutex::new(None),
            leases: Mutex::new(BTreeMap::new()),
            unlisted: AtomicBool::new(false),
            renew_fails: Mutex::new(None),
            renew_delay: Mutex::new(std::time::Duration::ZERO),
            next_lease: AtomicU64::new(0),
            calls,
        });
        let shutdown = Shutdown::new();
        let mut router = Router::new();
        register(&mut router, &state);
        simlock_daemon::events::register(&mut router, &bus);
        simlock_daemon::tokens::register(&mut router, &tokens, Mode::Worker);
        register_daemon_ops(&mut router, &shutdown);
        let greeter = DaemonGreeter::new(tokens.clone(), Some(admin));
        let pipeline = Arc::new(Pipeline::new(
            router,
            StartupGate::ready(),
            shutdown,
            "fake".to_owned(),
            Arc::new(greeter),
            presence,
        ));
        Ok(Self {
            state,
            pipeline,
            bus,
            tokens,
            clock,
            home,
            admin_secret,
            operator_token,
            agent_token,
            agent_token_id: agent_record.id.to_string(),
            stop: CancellationToken::new(),
            socket: None,
            http: None,
            https: false,
        })
    }

    /// Also serves the unix socket `<home>/daemon.sock`.
    ///
    /// # Errors
    /// When the socket cannot be claimed.
    pub async fn with_socket(mut self) -> io::Result<Self> {
        let path = Home::at(self.home.path()).socket();
        let listener = claim(&path).await.map_err(other)?;
        serve_socket(listener, self.pipeline.clone(), self.stop.clone());
        self.socket = Some(path);
        Ok(self)
    }

    /// Also serves HTTP on `127.0.0.1` (a free port).
    ///
    /// # Errors
    /// When no port can be bound.
    pub async fn with_http(self) -> io::Result<Self> {
        self.serve_http(None).await
    }

    /// Also serves HTTPS on `127.0.0.1` (a free port) with `tls`; [`Self::url`] is then
    /// `https://127.0.0.1:<port>`.
    ///
    /// # Errors
    /// When no port can be bound.
    pub async fn with_https(self, tls: simlock_tls::ServerTls) -> io::Result<Self> {
        self.serve_http(Some(tls)).await
    }

    async fn serve_http(mut self, tls: Option<simlock_tls::ServerTls>) -> io::Result<Self> {
        let listener = bind("127.0.0.1", 0).await?;
        let addr = listener.local_addr()?;
        let app = Arc::new(HttpApp {
            pipeline: self.pipeline.clone(),
            tokens: self.tokens.clone(),
            bus: self.bus.clone(),
            clock: self.clock.clone(),
            requests: RequestBook::new(self.clock.clone(), 600_000, 1000),
            metrics: Metrics::new(),
            responses: simlock_daemon::http::responses::HttpResponses::default(),
            mounts: Vec::new(),
        });
        self.https = tls.is_some();
        serve_http(listener, app, tls, self.stop.clone());
        self.http = Some(addr);
        Ok(self)
    }

    /// A wire transport to the fake over an in-memory pipe, and a [`Cut`] that drops the pipe
    /// as a lost connection would.
    pub fn pipe(&self) -> (Transport, Cut) {
        let (client_end, relay_client) = tokio::io::duplex(64 * 1024);
        let (relay_server, server_end) = tokio::io::duplex(64 * 1024);
        let (r, w) = tokio::io::split(server_end);
        let pipeline = self.pipeline.clone();
        let config = pipeline.session_config();
        tokio::spawn(serve(
            Transport::server_io(r, w),
            Origin::Socket,
            pipeline,
            config,
        ));
        let relay = tokio::spawn(async move {
            let (mut a, mut b) = (relay_client, relay_server);
            let _ = tokio::io::copy_bidirectional(&mut a, &mut b).await;
        });
        let (r, w) = tokio::io::split(client_end);
        (Transport::client_io(r, w), Cut(relay))
    }

    /// The temporary `SIMLOCK_HOME`.
    pub fn home(&self) -> &Path {
        self.home.path()
    }

    /// The socket's path, when served.
    pub fn socket_path(&self) -> Option<&Path> {
        self.socket.as_deref()
    }

    /// `http://127.0.0.1:<port>` (`https://` with [`Self::with_https`]), when served.
    pub fn url(&self) -> Option<String> {
        let scheme = if self.https { "https" } else { "http" };
        self.http.map(|addr| format!("{scheme}://{addr}"))
    }

    /// The per-start admin secret (also in `<home>/admin.token`).
    pub fn admin_secret(&self) -> &str {
        &self.admin_secret
    }

    /// An operator token's secret.
    pub fn operator_token(&self) -> &str {
        &self.operator_token
    }

    /// An agent token's secret.
    pub fn agent_token(&self) -> &str {
        &self.agent_token
    }

    /// The agent token's id: the principal of HTTP calls made with it.
    pub fn agent_token_id(&self) -> &str {
        &self.agent_token_id
    }

    /// The pipeline, for tests that reach further.
    pub const fn pipeline(&self) -> &Arc<Pipeline> {
        &self.pipeline
    }

    /// Records an event on the fake's bus under module `fake`, with any name and payload (a
    /// fake's events need not be ones a daemon records).
    pub fn emit(&self, event: &str, payload: Value) {
        self.bus.relay(simlock_contract::model::EventEnvelope {
            id: simlock_contract::ids::EventId::mint(),
            seq: 0,
            timestamp: self.clock.now_ms(),
            event: event.to_owned(),
            payload,
            module: "fake".to_owned(),
        });
    }

    /// Whether `daemon.stop` was called.
    pub fn stop_requested(&self) -> bool {
        self.pipeline.shutdown().is_requested()
    }

    /// Sets how `lease.request` answers.
    pub fn script_request(&self, script: RequestScript) {
        *self.state.request.lock() = script;
    }

    /// Sets how `lease.cancel` answers while a request is held.
    pub fn script_cancel(&self, script: CancelScript) {
        *self.state.cancel.lock() = script;
    }

    /// Sets what `device.exec` writes and answers.
    pub fn script_exec(&self, script: ExecScript) {
        *self.state.exec.lock() = script;
    }

    /// Settles a held lease request: a grant when `Ok`. Answers whether one was held.
    pub fn settle_pending(&self, outcome: Result<(), ContractError>) -> bool {
        self.state
            .pending
            .lock()
            .take()
            .is_some_and(|p| p.finish.send(outcome).is_ok())
    }

    /// Whether a lease request is held.
    pub fn has_pending(&self) -> bool {
        self.state.pending.lock().is_some()
    }

    /// While `error` is set, every `lease.renew` answers it and renews nothing (a daemon or a
    /// lease's worker out of reach); `None` renews again.
    pub fn fail_renewals(&self, error: Option<ContractError>) {
        *self.state.renew_fails.lock() = error;
    }

    /// Answers each renewal `delay` after it came (on tokio's clock), as a daemon that a stop
    /// or a stall held up; its outcome is decided when it came.
    pub fn delay_renewals(&self, delay: std::time::Duration) {
        *self.state.renew_delay.lock() = delay;
    }

    /// While `unlisted`, the lists (`lease.list`, `list.get`, `status.get`) leave every lease
    /// out, as a lookup that raced a grant would; renewals and releases still find them.
    pub fn unlist_leases(&self, unlisted: bool) {
        self.state.unlisted.store(unlisted, Ordering::SeqCst);
    }

    /// Adds a lease as if granted to `owner`; answers its record.
    pub fn add_lease(&self, owner: &str, ttl_ms: u64) -> LeaseRecord {
        let ctx = CallCtx::internal(owner.to_owned(), Role::Agent, None);
        self.state.grant(&ctx, None, Some(ttl_ms)).lease
    }

    /// The leases the fake holds.
    pub fn leases(&self) -> Vec<LeaseRecord> {
        self.state.leases.lock().values().cloned().collect()
    }

    /// Ends a lease the way the daemon would: forgets it and pushes `lease-lost` to its owner.
    /// Answers whether it existed.
    pub fn end_lease(&self, lease_id: &str, reason: LeaseEndReason) -> bool {
        let Some(lease) = self.state.leases.lock().remove(lease_id) else {
            return false;
        };
        let push = Push::LeaseLost {
            lease_id: lease_id.to_owned(),
            device_id: lease.device_id.clone(),
            reason,
        };
        self.state.presence.notify(&lease.owner_id, &push, None);
        true
    }

    /// Pushes a lease-scoped notice to `owner`'s connections and HTTP followers.
    pub fn notify(&self, owner: &str, push: &Push) {
        self.state.presence.notify(owner, push, None);
    }

    /// Forgets a lease silently (a renewal then answers `UNKNOWN_LEASE`).
    pub fn forget_lease(&self, lease_id: &str) -> bool {
        self.state.leases.lock().remove(lease_id).is_some()
    }

    /// Every call to a canned handler received so far.
    pub fn calls(&self) -> Vec<Recorded> {
        self.state.calls.borrow().clone()
    }

    /// The calls of `op` received so far.
    pub fn calls_of(&self, op: &str) -> Vec<Recorded> {
        self.state
            .calls
            .borrow()
            .iter()
            .filter(|c| c.op == op)
            .cloned()
            .collect()
    }

    /// Waits until `op` was called at least `n` times; answers those calls. Bound it with a
    /// timeout in tests.
    pub async fn wait_for_calls(&self, op: &str, n: usize) -> Vec<Recorded> {
        let mut rx = self.state.calls.subscribe();
        let _ = rx
            .wait_for(|calls| calls.iter().filter(|c| c.op == op).count() >= n)
            .await;
        self.calls_of(op)
    }
}

/// Drops an in-memory pipe's relay: the client sees its connection end.
#[derive(Debug)]
pub struct Cut(JoinHandle<()>);

impl Cut {
    /// Cuts the pipe.
    pub fn cut(self) {
        self.0.abort();
    }
}

fn register(router: &mut Router, state: &Arc<State>) {
    let s = state.clone();
    router.handle::<StatusGet, _, _>(move |ctx, input| {
        s.record("status.get", &ctx, &input);
        let leases = s.listed();
        let output = StatusOutput {
            daemon: DaemonInfo {
                health: Health::Running,
                mode: Mode::Worker,
                version: "fake".to_owned(),
                instance_id: "fake-worker".to_owned(),
            },
            host: HostFacts {
                os: "linux".to_owned(),
                os_version: "6".to_owned(),
                arch: "x86_64".to_owned(),
                tools: Vec::new(),
            },
            capacity: Some(Capacity::default()),
            devices: Some(vec![device()]),
            queue_depth: Some(u32::from(s.pending.lock().is_some())),
            leases: Some(leases),
            waiting: Some(Vec::new()),
            capabilities: None,
            lease: Some(LeaseLimits {
                default_ttl_ms: 900_000,
                max_ttl_ms: 14_400_000,
            }),
            workers: None,
            drivers: None,
            uplink: None,
        };
        async move { Ok(output) }
    });
    let s = state.clone();
    router.handle::<CatalogGet, _, _>(move |ctx, input| {
        s.record("catalog.get", &ctx, &input);
        let output = CatalogOutput {
            platforms: vec![PlatformCatalog {
                platform: Platform::Ios,
                models: vec!["iPhone 16".to_owned()],
                runtimes: vec!["18.0".to_owned()],
                default_runtime: Some("18.0".to_owned()),
                model_runtimes: BTreeMap::from([("iPhone 16".to_owned(), vec!["18.0".to_owned()])]),
                model_aliases: BTreeMap::new(),
                model_workers: None,
                runtime_workers: None,
                unavailable: None,
            }],
        };
        async move { Ok(output) }
    });
    let s = state.clone();
    router.handle::<ConfigGet, _, _>(move |ctx, input| {
        s.record("config.get", &ctx, &input);
        async move {
            Ok(ConfigView {
                mode: Mode::Worker,
                lease: LeaseLimits {
                    default_ttl_ms: 900_000,
                    max_ttl_ms: 14_400_000,
                },
                settings: BTreeMap::new(),
            })
        }
    });
    let s = state.clone();
    router.handle::<ListGet, _, _>(move |ctx, input| {
        s.record("list.get", &ctx, &input);
        let output = match input.kind {
            ListKind::Devices => ListOutput::Devices(vec![device()]),
            ListKind::Leases => ListOutput::Leases(s.listed()),
            ListKind::Rules => ListOutput::Rules(Vec::new()),
            ListKind::Requests => ListOutput::Requests(Vec::new()),
        };
        async move { Ok(output) }
    });
    let s = state.clone();
    router.handle::<LeaseRequest, _, _>(move |ctx: CallCtx, input| {
        let s = s.clone();
        async move {
            let script = s.request.lock().clone();
            let (progress, held) = match &script {
                RequestScript::Grant(progress) | RequestScript::Fail(progress, _) => {
                    (progress.clone(), None)
                }
                RequestScript::Hold(progress) => {
                    let (finish, rx) = oneshot::channel();
                    *s.pending.lock() = Some(Pending { finish });
                    (progress.clone(), Some(rx))
                }
            };
            s.record("lease.request", &ctx, &input);
            for stage in progress {
                ctx.push(Push::Progress {
                    request_id: ctx.request_id().clone(),
                    progress: stage,
                })
                .await;
            }
            if let RequestScript::Fail(_, err) = script {
                return Err(err);
            }
            if let Some(rx) = held {
                rx.await.unwrap_or_else(|_| {
                    Err(ContractError::internal("the fake dropped the request"))
                })?;
            }
            Ok(s.grant(&ctx, input.requester_id.clone(), input.ttl_ms))
        }
    });
    let s = state.clone();
    router.handle::<LeaseCancel, _, _>(move |ctx, input| {
        s.record("lease.cancel", &ctx, &input);
        let pending = s.pending.lock().take();
        let script = s.cancel.lock().clone();
        let result = match (pending, script) {
            (None, _) => CancelResult::NotFound,
            (Some(p), CancelScript::Cancelled) => {
                let _ = p.finish.send(Err(ContractError::new(
                    ErrorCode::Cancelled,
                    "The request was cancelled by its requester",
                )));
                CancelResult::Cancelled
            }
            (Some(p), CancelScript::NotCancellable) => {
                let _ = p.finish.send(Ok(()));
                CancelResult::NotCancellable
            }
            (Some(p), CancelScript::NotFound(outcome)) => {
                let _ = p.finish.send(outcome);
                CancelResult::NotFound
            }
        };
        async move { Ok(LeaseCancelOutput { result }) }
    });
    let s = state.clone();
    router.handle::<LeaseRenew, _, _>(move |ctx, input| {
        s.record("lease.renew", &ctx, &input);
        if let Some(error) = s.renew_fails.lock().clone() {
            return futures::future::Either::Left(async move { Err(error) });
        }
        let outcome = s.owned(&ctx, &input.lease_id).map(|mut lease| {
            let now = s.clock.now_ms();
            if let Some(ttl) = input.ttl_ms {
                lease.ttl_ms = ttl;
            }
            lease.last_renewed_at = now;
            lease.ttl_deadline =
                now.saturating_add(i64::try_from(lease.ttl_ms).unwrap_or(i64::MAX));
            s.leases.lock().insert(lease.id.to_string(), lease.clone());
            lease
        });
        let delay = *s.renew_delay.lock();
        futures::future::Either::Right(async move {
            tokio::time::sleep(delay).await;
            outcome
        })
    });
    let s = state.clone();
    router.handle::<LeaseRelease, _, _>(move |ctx, input| {
        s.record("lease.release", &ctx, &input);
        let outcome = s.owned(&ctx, &input.lease_id).map(|lease| {
            s.leases.lock().remove(lease.id.as_str());
            LeaseReleaseOutput {
                lease_id: lease.id.to_string(),
            }
        });
        async move { outcome }
    });
    let s = state.clone();
    router.handle::<LeaseList, _, _>(move |ctx, input| {
        s.record("lease.list", &ctx, &input);
        let leases = s
            .listed()
            .into_iter()
            .filter(|l| ctx.role == Role::Admin || l.owner_id == ctx.principal)
            .collect();
        async move {
            Ok(LeaseListOutput {
                leases,
                unread_workers: Vec::new(),
            })
        }
    });
    let s = state.clone();
    router.handle::<LeaseGet, _, _>(move |ctx, input| {
        s.record("lease.get", &ctx, &input);
        let outcome = s
            .listed()
            .into_iter()
            .find(|l| {
                l.id.as_str() == input.lease_id
                    && (ctx.role == Role::Admin || l.owner_id == ctx.principal)
            })
            .map(|lease| LeaseGetOutput { lease })
            .ok_or_else(|| ContractError::unknown_lease(&input.lease_id));
        async move { outcome }
    });
    let s = state.clone();
    router.handle::<LeaseReleaseAll, _, _>(move |ctx, input| {
        s.record("lease.release-all", &ctx, &input);
        let lease_ids = std::mem::take(&mut *s.leases.lock()).into_keys().collect();
        async move { Ok(ReleaseAllOutput { lease_ids }) }
    });
    let s = state.clone();
    router.handle::<DeviceExec, _, _>(move |ctx: CallCtx, input| {
        let s = s.clone();
        async move {
            s.record("device.exec", &ctx, &input);
            s.owned(&ctx, &input.lease_id)?;
            let script = s.exec.lock().clone();
            // A real tool takes time between its pushes; yielding after each gives the HTTP
            // route the turn a running process would (it commits its stream at `started`).
            ctx.push(Push::Started {
                request_id: ctx.request_id().clone(),
            })
            .await;
            tokio::task::yield_now().await;
            for (stream, chunk) in script.chunks {
                ctx.push(Push::Output {
                    request_id: ctx.request_id().clone(),
                    stream,
                    chunk,
                })
                .await;
                tokio::task::yield_now().await;
            }
            Ok(ExecOutput {
                exit_code: script.exit_code,
            })
        }
    });
    let s = state.clone();
    router.handle::<WorkerList, _, _>(move |ctx, input| {
        s.record("worker.list", &ctx, &input);
        async move {
            Ok(WorkerListOutput {
                workers: vec![worker_view("fake-worker", false)],
            })
        }
    });
    let drained: Arc<Mutex<HashMap<String, bool>>> = Arc::default();
    for undrain in [false, true] {
        let (s, drained) = (state.clone(), drained.clone());
        let handler = move |ctx: CallCtx, input: simlock_contract::ops::WorkerIdInput| {
            let op = if undrain {
                "worker.undrain"
            } else {
                "worker.drain"
            };
            s.record(op, &ctx, &input);
            let outcome = if input.worker_id == "fake-worker" {
                let before = drained.lock().insert(input.worker_id.clone(), !undrain);
                Ok(WorkerDrainOutput {
                    worker_id: input.worker_id,
                    drained: !undrain,
                    changed: before.unwrap_or(false) == undrain,
                })
            } else {
                Err(ContractError::new(
                    ErrorCode::UnknownWorker,
                    format!("Unknown worker {}", input.worker_id),
                )
                .with_details(serde_json::json!({ "workerId": input.worker_id })))
            };
            async move { outcome }
        };
        if undrain {
            router.handle::<WorkerUndrain, _, _>(handler);
        } else {
            router.handle::<WorkerDrain, _, _>(handler);
        }
    }
    let s = state.clone();
    router.handle::<WorkerRemove, _, _>(move |ctx, input| {
        s.record("worker.remove", &ctx, &input);
        let outcome = if input.worker_id == "fake-worker" {
            Err(ContractError::new(
                ErrorCode::WorkerConnected,
                "Worker fake-worker is connected",
            )
            .with_details(serde_json::json!({ "workerId": "fake-worker" })))
        } else {
            Ok(WorkerRemoveOutput {
                worker_id: input.worker_id,
                removed: false,
            })
        };
        async move { outcome }
    });
}
