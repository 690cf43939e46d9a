//! The one dispatch pipeline both daemons run every call through:
//! stopping gate → operation lookup → input parse → role → authorize → startup gate → handler →
//! output. A wire connection, an HTTP route and an in-process caller all enter here.

use std::collections::HashMap;
use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use futures::FutureExt;
use futures::future::BoxFuture;
use parking_lot::Mutex;
use serde_json::Value;
use simlock_contract::{
    ContractError, ErrorCode, Hello, Operation, OperationSpec, PROTOCOL_RANGE, Role, decode_input,
};
use simlock_wire::{CallContext, Connection, Identity, Origin, Service, SessionConfig};
use tokio::sync::watch;
use tracing::{debug, info, warn};

use crate::context::{CallCtx, Prepared};
use crate::presence::Presence;

/// An operation's run: its output, and the word its answer is logged with
/// ([`Operation::outcome`]).
type Run = Arc<
    dyn Fn(
            CallCtx,
            Option<Value>,
            StartupGate,
        ) -> BoxFuture<'static, Result<(Value, &'static str), ContractError>>
        + Send
        + Sync,
>;
type PrepareHook = Arc<dyn Fn(&CallCtx, Option<&Value>) -> Option<Prepared> + Send + Sync>;
type Authorize<I> = Arc<dyn Fn(&CallCtx, &I) -> Result<(), ContractError> + Send + Sync>;
type CloseHook = Arc<dyn Fn(&Arc<Connection>) + Send + Sync>;

/// How start-up stands. Every operation but `status.get` and `daemon.stop` waits for it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Startup {
    /// Converging.
    Starting,
    /// Serving.
    Ready,
    /// Start-up failed; the message says why.
    Failed(String),
}

/// The start-up gate: operations park on it until start-up converges.
#[derive(Debug, Clone)]
pub struct StartupGate {
    state: watch::Sender<Startup>,
}

impl Default for StartupGate {
    fn default() -> Self {
        Self::new()
    }
}

impl StartupGate {
    /// A gate that is still starting.
    pub fn new() -> Self {
        Self {
            state: watch::Sender::new(Startup::Starting),
        }
    }

    /// A gate that is already open.
    pub fn ready() -> Self {
        Self {
            state: watch::Sender::new(Startup::Ready),
        }
    }

    /// Opens the gate.
    pub fn open(&self) {
        self.state.send_replace(Startup::Ready);
    }

    /// Fails start-up; parked and later calls answer `DAEMON_STARTUP_FAILED`.
    pub fn fail(&self, why: impl Into<String>) {
        self.state.send_replace(Startup::Failed(why.into()));
    }

    /// The daemon's health as `status.get` reports it.
    pub fn health(&self) -> simlock_contract::model::Health {
        use simlock_contract::model::Health;
        match &*self.state.borrow() {
            Startup::Starting => Health::Starting,
            Startup::Ready => Health::Running,
            Startup::Failed(_) => Health::Failed,
        }
    }

    /// Where start-up is.
    pub fn state(&self) -> Startup {
        self.state.borrow().clone()
    }

    /// Waits until start-up converged.
    ///
    /// # Errors
    /// `DAEMON_STARTUP_FAILED` when it failed.
    pub async fn wait(&self) -> Result<(), ContractError> {
        let mut rx = self.state.subscribe();
        let state = rx
            .wait_for(|s| *s != Startup::Starting)
            .await
            .map(|s| s.clone());
        match state {
            Ok(Startup::Ready) => Ok(()),
            Ok(Startup::Failed(why)) => Err(ContractError::new(
                ErrorCode::DaemonStartupFailed,
                format!("Daemon start-up failed: {why}"),
            )),
            Ok(Startup::Starting) | Err(_) => Err(ContractError::stopping()),
        }
    }
}

struct Entry {
    run: Run,
    prepare: Option<PrepareHook>,
}

/// Asks a daemon to stop (`daemon.stop`, a signal) and lets its owner wait for that.
#[derive(Debug, Clone)]
pub struct Shutdown {
    requested: watch::Sender<bool>,
}

impl Default for Shutdown {
    fn default() -> Self {
        Self::new()
    }
}

impl Shutdown {
    /// Nothing requested yet.
    pub fn new() -> Self {
        Self {
            requested: watch::Sender::new(false),
        }
    }

    /// Asks the daemon to stop.
    pub fn request(&self) {
        self.requested.send_replace(true);
    }

    /// Whether a stop was requested.
    pub fn is_requested(&self) -> bool {
        *self.requested.borrow()
    }

    /// Resolves once a stop was requested.
    pub async fn requested(&self) {
        let mut rx = self.requested.subscribe();
        let _ = rx.wait_for(|requested| *requested).await;
    }
}

/// Registers `daemon.stop`: answers `{stopping: true}` and asks the daemon to stop.
pub fn register_daemon_ops(router: &mut Router, shutdown: &Shutdown) {
    let shutdown = shutdown.clone();
    router.handle::<simlock_contract::ops::DaemonStop, _, _>(move |_, _| {
        shutdown.request();
        async move { Ok(simlock_contract::ops::DaemonStopOutput { stopping: true }) }
    });
}

/// The handlers of one daemon, by operation name.
#[derive(Default)]
pub struct Router {
    entries: HashMap<&'static str, Entry>,
}

impl std::fmt::Debug for Router {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mut names: Vec<_> = self.entries.keys().collect();
        names.sort_unstable();
        f.debug_struct("Router")
            .field("operations", &names)
            .finish()
    }
}

impl Router {
    /// An empty router.
    pub fn new() -> Self {
        Self::default()
    }

    /// Registers the handler of `O`, authorized by role alone.
    pub fn handle<O, F, Fut>(&mut self, handler: F) -> &mut Self
    where
        O: Operation,
        F: Fn(CallCtx, O::Input) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Result<O::Output, ContractError>> + Send + 'static,
    {
        self.handle_authorized::<O, _, _, _>(|_, _| Ok(()), handler)
    }

    /// Registers the handler of `O` with an authorize step that runs after the role check and
    /// before start-up parking (`FORBIDDEN` when it refuses).
    pub fn handle_authorized<O, A, F, Fut>(&mut self, authorize: A, handler: F) -> &mut Self
    where
        O: Operation,
        A: Fn(&CallCtx, &O::Input) -> Result<(), ContractError> + Send + Sync + 'static,
        F: Fn(CallCtx, O::Input) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Result<O::Output, ContractError>> + Send + 'static,
    {
        let authorize: Authorize<O::Input> = Arc::new(authorize);
        let handler = Arc::new(handler);
        let run: Run = Arc::new(move |ctx, payload, gate| {
            // Parsing happens as the line is read; the rest runs when the future is polled.
            let input = decode_input::<O::Input>(payload);
            let authorize = authorize.clone();
            let handler = handler.clone();
            async move {
                let input = input?;
                if !ctx.role.allows(O::ROLE) {
                    // Only an admin operation is ever refused: every role may run an agent's.
                    return Err(ContractError::forbidden(format!(
                        "Operation {} requires role {} (an operator token, or the daemon's admin secret); this caller has role {}",
                        O::NAME,
                        O::ROLE.as_str(),
                        ctx.role.as_str()
                    )));
                }
                authorize(&ctx, &input)?;
                if O::NAME != "status.get" && O::NAME != "daemon.stop" {
                    gate.wait().await?;
                }
                let output = handler(ctx, input).await?;
                let outcome = O::outcome(&output);
                let value = serde_json::to_value(output).map_err(|e| {
                    ContractError::internal(format!("{} output could not be encoded: {e}", O::NAME))
                })?;
                Ok((value, outcome))
            }
            .boxed()
        });
        let previous = self.entries.insert(O::NAME, Entry { run, prepare: None });
        debug_assert!(previous.is_none(), "{} registered twice", O::NAME);
        self
    }

    /// Registers a hook that runs for every `O` call at the moment its line is read, before any
    /// later line and before start-up parking. What it returns reaches the handler through
    /// [`CallCtx::take_prepared`]; if the call fails first, it is dropped.
    pub fn prepare<O, F>(&mut self, hook: F) -> &mut Self
    where
        O: Operation,
        F: Fn(&CallCtx, Option<&Value>) -> Option<Prepared> + Send + Sync + 'static,
    {
        if let Some(entry) = self.entries.get_mut(O::NAME) {
            entry.prepare = Some(Arc::new(hook));
        }
        self
    }

    /// Registers every operation in `names` as answering `code` (e.g. a worker refusing the
    /// gateway-only operations with `UNSUPPORTED_IN_WORKER_MODE`).
    pub fn unsupported(&mut self, names: &[&'static str], code: ErrorCode) -> &mut Self {
        for name in names {
            let name: &'static str = name;
            let run: Run = Arc::new(move |_, _, _| {
                let err =
                    ContractError::new(code, format!("{name} is not supported by this daemon"))
                        .with_details(serde_json::json!({ "operation": name }));
                async move { Err(err) }.boxed()
            });
            self.entries.insert(name, Entry { run, prepare: None });
        }
        self
    }

    /// The names registered.
    pub fn names(&self) -> Vec<&'static str> {
        let mut names: Vec<_> = self.entries.keys().copied().collect();
        names.sort_unstable();
        names
    }
}

/// What a pipeline says about its daemon in `hello`, and how it authenticates sessions.
pub trait Greeter: Send + Sync + 'static {
    /// Whether `secret` grants the admin role on the socket (an operator token or the
    /// per-start admin secret).
    fn is_admin_secret(&self, secret: &str) -> bool;

    /// The principal of a socket session that names none.
    fn default_principal(&self) -> String;
}

/// The pipeline of one daemon.
pub struct Pipeline {
    router: Router,
    gate: StartupGate,
    stopping: AtomicBool,
    shutdown: Shutdown,
    version: String,
    greeter: Arc<dyn Greeter>,
    presence: Presence,
    close_hooks: Mutex<Vec<CloseHook>>,
}

impl std::fmt::Debug for Pipeline {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Pipeline")
            .field("router", &self.router)
            .finish_non_exhaustive()
    }
}

impl Pipeline {
    /// A pipeline over `router`, parking calls on `gate`; `shutdown` is the daemon's.
    pub fn new(
        router: Router,
        gate: StartupGate,
        shutdown: Shutdown,
        version: String,
        greeter: Arc<dyn Greeter>,
        presence: Presence,
    ) -> Self {
        Self {
            router,
            gate,
            stopping: AtomicBool::new(false),
            shutdown,
            version,
            greeter,
            presence,
            close_hooks: Mutex::new(Vec::new()),
        }
    }

    /// The start-up gate.
    pub const fn gate(&self) -> &StartupGate {
        &self.gate
    }

    /// Connections by principal, for lease-scoped pushes.
    pub const fn presence(&self) -> &Presence {
        &self.presence
    }

    /// Marks the daemon stopping: every later call but `daemon.stop` answers `DAEMON_STOPPING`.
    pub fn begin_stopping(&self) {
        self.stopping.store(true, Ordering::SeqCst);
    }

    /// Whether the daemon is stopping.
    pub fn is_stopping(&self) -> bool {
        self.stopping.load(Ordering::SeqCst)
    }

    /// The daemon's shutdown handle.
    pub const fn shutdown(&self) -> &Shutdown {
        &self.shutdown
    }

    /// Runs `hook` whenever a wire connection ends (after its calls were told).
    pub fn on_connection_closed(&self, hook: impl Fn(&Arc<Connection>) + Send + Sync + 'static) {
        self.close_hooks.lock().push(Arc::new(hook));
    }

    /// The wire session configuration for this daemon.
    pub fn session_config(&self) -> SessionConfig {
        SessionConfig {
            range: PROTOCOL_RANGE,
            version: self.version.clone(),
        }
    }

    /// Dispatches one call. Runs the operation's read-time hook now; the rest when polled.
    pub fn call(
        &self,
        ctx: CallCtx,
        op: &str,
        payload: Option<Value>,
    ) -> BoxFuture<'static, Result<Value, ContractError>> {
        let Some(entry) = self.router.entries.get(op) else {
            let err = ContractError::new(
                ErrorCode::UnknownRequest,
                format!("Unknown request type: {op}"),
            );
            return async move { Err(err) }.boxed();
        };
        if let Some(prepare) = &entry.prepare
            && let Some(prepared) = prepare(&ctx, payload.as_ref())
        {
            ctx.set_prepared(prepared);
        }
        if self.is_stopping() && op != "daemon.stop" {
            return async move { Err(ContractError::stopping()) }.boxed();
        }
        let started = tokio::time::Instant::now();
        let principal = ctx.principal.clone();
        let op_name = op.to_owned();
        let future = (entry.run)(ctx, payload, self.gate.clone());
        async move {
            let outcome = future.await;
            let elapsed_ms = started.elapsed().as_millis();
            match &outcome {
                Ok((_, word)) => {
                    info!(target: "operation", op = %op_name, %principal, elapsed_ms, "{word}");
                }
                Err(e) if e.code == ErrorCode::Internal => {
                    warn!(target: "operation", op = %op_name, %principal, elapsed_ms, code = %e.code, message = %e.message, "failed");
                }
                Err(e) => info!(target: "operation", op = %op_name, %principal, elapsed_ms, code = %e.code, "refused"),
            }
            outcome.map(|(value, _)| value)
        }
        .boxed()
    }

    /// Dispatches a typed call in-process.
    ///
    /// # Errors
    /// The operation's error, or `INTERNAL` when the output does not decode.
    pub async fn call_typed<O: Operation>(
        &self,
        ctx: CallCtx,
        input: &O::Input,
    ) -> Result<O::Output, ContractError> {
        let payload =
            serde_json::to_value(input).map_err(|e| ContractError::internal(e.to_string()))?;
        let value = self.call(ctx, O::NAME, Some(payload)).await?;
        simlock_wire::decode_output::<O>(value)
    }

    fn identity_of(conn: &Connection) -> Identity {
        conn.identity().unwrap_or(Identity {
            role: Role::Agent,
            principal: String::new(),
        })
    }
}

impl Service for Pipeline {
    fn greet(&self, origin: Origin, hello: &Hello) -> Result<Identity, ContractError> {
        let role = match (origin, hello.credential.as_deref()) {
            // The gateway drives the worker over the uplink: admin, no credential consulted.
            (Origin::GatewayUplink, _) => Role::Admin,
            (Origin::Socket, None) => Role::Agent,
            (Origin::Socket, Some(secret)) if self.greeter.is_admin_secret(secret) => Role::Admin,
            (Origin::Socket, Some(_)) => {
                return Err(ContractError::new(
                    ErrorCode::AdminAuthenticationFailed,
                    "Invalid admin credential",
                ));
            }
        };
        let principal = hello
            .principal
            .clone()
            .unwrap_or_else(|| self.greeter.default_principal());
        Ok(Identity { role, principal })
    }

    fn greeted(&self, conn: &Arc<Connection>) {
        self.presence.add(conn);
    }

    fn dispatch(
        &self,
        ctx: CallContext,
        op: String,
        payload: Option<Value>,
    ) -> BoxFuture<'static, Result<Value, ContractError>> {
        let identity = Self::identity_of(&ctx.conn);
        let call = CallCtx::on_connection(ctx.conn, ctx.id, identity.principal, identity.role);
        self.call(call, &op, payload)
    }

    fn refused(&self, ctx: CallContext, op: &str, payload: Option<Value>) {
        // Run the read-time hook so whatever it claims is released with the refusal.
        if let Some(prepare) = self.router.entries.get(op).and_then(|e| e.prepare.clone()) {
            let identity = Self::identity_of(&ctx.conn);
            let call = CallCtx::on_connection(ctx.conn, ctx.id, identity.principal, identity.role);
            drop(prepare(&call, payload.as_ref()));
        }
    }

    fn closed(&self, conn: &Arc<Connection>) {
        self.presence.remove(conn);
        let hooks: Vec<CloseHook> = self.close_hooks.lock().clone();
        for hook in hooks {
            hook(conn);
        }
        debug!(connection = conn.id(), "connection closed");
    }
}

/// Checks that every operation a daemon must answer has a handler. Composition calls it once
/// at start so a forgotten registration fails loudly, not as `UNKNOWN_REQUEST` in production.
///
/// # Errors
/// The names of the missing operations.
pub fn check_complete(router: &Router, expected: &[&str]) -> Result<(), String> {
    let missing: Vec<_> = expected
        .iter()
        .filter(|name| !router.entries.contains_key(*name))
        .collect();
    if missing.is_empty() {
        Ok(())
    } else {
        Err(format!("no handler for {missing:?}"))
    }
}

/// Every operation in the contract's table except `hello`, which the wire session answers.
pub fn all_operations() -> Vec<&'static str> {
    simlock_contract::OPERATIONS
        .iter()
        .map(|op: &OperationSpec| op.name)
        .filter(|name| *name != "hello")
        .collect()
}
