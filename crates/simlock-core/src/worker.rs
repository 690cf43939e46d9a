//! The worker: the async shell around the decision state (`state`). It reads the clock,
//! takes the one lock for every decision, stores the decision's rows, then carries out its
//! effects (events, lease notices, request updates, device work), and runs the timers.
//!
//! Its public methods are what the operation handlers ([`crate::handlers`]) and in-process
//! callers use; they answer contract errors.

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Weak};
use std::time::Duration;

use futures::future::BoxFuture;
use parking_lot::Mutex;
use serde_json::json;
use simlock_contract::ContractError;
use simlock_contract::ids::RequestId;
use simlock_contract::model::{
    Capacity, Connection, DaemonInfo, Device, Health, HostFacts, LeaseEndReason, LeaseGrant,
    LeaseLimits, LeaseRecord, Mode, Platform, ReleaseReason, RequestedDevice, WaitingRequest,
    WorkerView,
};
use simlock_contract::ops::{
    CatalogOutput, ConfigView, ExecInput, ExecOutput, LeaseCancelOutput, LeaseGetOutput,
    LeaseListOutput, LeaseReleaseOutput, LeaseRenewInput, LeaseRequestInput, ListKind, ListOutput,
    ReleaseAllOutput, StatusOutput,
};
use simlock_contract::protocol::Role;
use simlock_contract::push::Push;
use simlock_daemon::clock::instant_at;
use simlock_daemon::config::DaemonConfig;
use simlock_daemon::runtime::Base;
use simlock_daemon::uplink::UplinkReport;
use simlock_daemon::{
    CallCtx, Capabilities, Database, EventBus, Presence, SharedClock, StartupGate,
};
use tokio::sync::{Notify, mpsc};
use tokio_util::sync::CancellationToken;
use tracing::{error, info, warn};

use crate::book::RequestRecord;
use crate::capacity::Limits;
use crate::catalog::Catalog;
use crate::config::CoreConfig;
use crate::driver::{Driver, DriverError, Estimates, virtual_drivers};
use crate::error::CoreError;
use crate::exec;
use crate::queue::LeaseTerms;
use crate::state::{Admission, Admitted, Caller, Settings, State, Update, Work, check_ttl};
use crate::store;
use crate::system::{HostSystem, SystemFacts};
use simlock_daemon::processes::{Ledger, reap};

/// Everything a worker is built from.
#[derive(Clone)]
pub struct WorkerParts {
    /// The daemon's own configuration section (`lease`, `capabilities`, the uplink's label).
    pub config: DaemonConfig,
    /// The core's sections.
    pub core: CoreConfig,
    /// `config.get`'s answer: every section the worker was started with, as the binary that
    /// composes them builds it (the default shows the daemon's and the core's sections).
    pub config_view: ConfigView,
    /// The state store.
    pub db: Database,
    /// Wall time.
    pub clock: SharedClock,
    /// The event bus.
    pub bus: Arc<EventBus>,
    /// Live connections, for `lease-lost`.
    pub presence: Presence,
    /// What this worker can serve (`requires`).
    pub capabilities: Capabilities,
    /// CPUs and RAM, for the `resource` capacity strategy.
    pub system: Arc<dyn SystemFacts>,
    /// One driver per platform served.
    pub drivers: Vec<Arc<dyn Driver>>,
    /// The daemon's instance id.
    pub instance_id: String,
    /// The daemon's version.
    pub version: String,
    /// Modules that hold something for a lease (the agent-device host): each is told, and
    /// awaited (at most [`LEASE_END_BOUND`]), when a lease ends, before its device is wiped.
    pub lease_end: Vec<LeaseEndHook>,
    /// How the uplink to the gateway stands (`status.get`'s `uplink`), when `gateway.url` is set.
    pub uplink: Option<UplinkReport>,
    /// Where `device.exec` records the tools it runs (`$SIMLOCK_HOME/exec/processes`), so that a
    /// start after a crash stops those an earlier run left; `None` records nothing.
    pub exec_ledger: Option<std::path::PathBuf>,
}

/// Told the id of a lease that ended, before its device is reclaimed.
pub type LeaseEndHook = Arc<dyn Fn(String) -> BoxFuture<'static, ()> + Send + Sync>;

/// The longest a reclaim waits for the lease-end hooks.
pub const LEASE_END_BOUND: Duration = Duration::from_secs(10);

impl std::fmt::Debug for WorkerParts {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WorkerParts")
            .field("instance_id", &self.instance_id)
            .field("drivers", &self.drivers.len())
            .finish_non_exhaustive()
    }
}

impl WorkerParts {
    /// Parts from the daemon's `base`, the core's sections and `config.get`'s answer (which the
    /// binary builds: it alone holds every section), with the defaults: capabilities from
    /// `capabilities`, the real machine's facts, and the virtual drivers of
    /// `core.virtual_devices`.
    pub fn new(base: &Base, core: CoreConfig, config_view: ConfigView) -> Self {
        let config = base.config.clone();
        let bus = base.bus.clone();
        Self {
            capabilities: Capabilities::new(config.capabilities.clone(), bus.clone()),
            system: Arc::new(HostSystem),
            drivers: virtual_drivers(&core.virtual_devices),
            config_view,
            config,
            core,
            db: base.db.clone(),
            clock: base.clock.clone(),
            bus,
            presence: base.presence.clone(),
            instance_id: base.instance_id.clone(),
            version: base.version.clone(),
            lease_end: Vec::new(),
            uplink: None,
            exec_ledger: Some(base.home.root().join("exec").join("processes")),
        }
    }
}

/// How admission ended, for the caller.
enum Admit {
    /// Follow the request's updates (each request sends a handful: progress, then its end).
    Follow(mpsc::UnboundedReceiver<Update>),
    /// An idempotent repeat of a settled request.
    Replay(Box<Result<LeaseGrant, ContractError>>),
}

struct Shared {
    state: State,
    followers: HashMap<RequestId, Vec<mpsc::UnboundedSender<Update>>>,
    /// Set when a decision could not be stored: memory may be ahead of disk, so the worker stops
    /// deciding until a restart re-reads the store. Read and set under the same lock as the
    /// decisions, so no decision slips in between a failed store and the refusals after it.
    poisoned: Option<String>,
}

/// One worker's devices, leases and queue.
pub struct Worker {
    me: Weak<Self>,
    shared: Mutex<Shared>,
    settings: Settings,
    config: DaemonConfig,
    core: CoreConfig,
    config_view: ConfigView,
    catalog: Catalog,
    drivers: BTreeMap<Platform, Arc<dyn Driver>>,
    db: Database,
    clock: SharedClock,
    bus: Arc<EventBus>,
    presence: Presence,
    capabilities: Capabilities,
    lease_end: Vec<LeaseEndHook>,
    uplink: Option<UplinkReport>,
    /// Where `device.exec`'s tools are recorded while they run.
    exec_ledger: Option<Arc<Ledger>>,
    /// Held (written) while the start stops the tools an earlier run left: a new run waits for
    /// it, so none takes the pid of one being stopped, nor has its entry forgotten.
    exec_reaped: Arc<tokio::sync::RwLock<()>>,
    /// The machine, read once: it does not change while the worker runs.
    host: HostFacts,
    instance_id: String,
    version: String,
    wake: Arc<Notify>,
    stop: CancellationToken,
    started: AtomicBool,
}

impl std::fmt::Debug for Worker {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Worker")
            .field("instance_id", &self.instance_id)
            .finish_non_exhaustive()
    }
}

impl Drop for Worker {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

impl Worker {
    /// Builds a worker and creates its tables. Nothing runs until [`Worker::start`].
    ///
    /// # Errors
    /// `INTERNAL` when the tables cannot be created.
    pub fn new(parts: WorkerParts) -> Result<Arc<Self>, ContractError> {
        store::migrate(&parts.db).map_err(CoreError::from)?;
        let exec_ledger = parts
            .exec_ledger
            .as_deref()
            .map(Ledger::open)
            .transpose()
            .map_err(|e| CoreError::Internal(format!("the exec process ledger: {e}")))?
            .map(Arc::new);
        let drivers: BTreeMap<Platform, Arc<dyn Driver>> = parts
            .drivers
            .into_iter()
            .map(|d| (d.platform(), d))
            .collect();
        let catalog = Catalog::new(drivers.values().map(|d| d.catalog()));
        let settings = Settings {
            default_ttl_ms: parts.config.lease.default_ttl_ms,
            max_ttl_ms: parts.config.lease.max_ttl_ms,
            retention_ms: parts.config.lease.request_retention_ms,
            max_records: usize::try_from(parts.config.lease.max_request_records)
                .unwrap_or(usize::MAX),
            max_waiting: usize::try_from(parts.config.lease.max_waiting).unwrap_or(usize::MAX),
            idle: parts.core.idle,
            limits: Limits::from_config(&parts.core.capacity, &*parts.system),
            estimates: drivers.iter().map(|(p, d)| (*p, d.estimates())).collect(),
            health: parts.core.health,
            quarantine: parts.core.quarantine,
            real: drivers
                .iter()
                .filter(|(_, d)| {
                    let s = d.status();
                    s.available && s.driver != simlock_contract::model::DriverKind::Virtual
                })
                .map(|(p, _)| *p)
                .collect(),
        };
        Ok(Arc::new_cyclic(|me| Self {
            me: me.clone(),
            shared: Mutex::new(Shared {
                state: State::new(settings.clone()),
                followers: HashMap::new(),
                poisoned: None,
            }),
            settings,
            config: parts.config,
            core: parts.core,
            config_view: parts.config_view,
            catalog,
            drivers,
            db: parts.db,
            clock: parts.clock,
            bus: parts.bus,
            presence: parts.presence,
            capabilities: parts.capabilities,
            lease_end: parts.lease_end,
            uplink: parts.uplink,
            exec_ledger,
            exec_reaped: Arc::new(tokio::sync::RwLock::new(())),
            host: HostFacts {
                os: std::env::consts::OS.to_owned(),
                os_version: parts.system.os_version(),
                arch: std::env::consts::ARCH.to_owned(),
                tools: Vec::new(),
            },
            instance_id: parts.instance_id,
            version: parts.version,
            wake: Arc::new(Notify::new()),
            stop: CancellationToken::new(),
            started: AtomicBool::new(false),
        }))
    }

    /// Converges stored state and starts the timers, then opens `gate` (or fails it).
    /// Open requests from before settle failed; every lease keeps its deadline, overdue ones
    /// expire at once; devices caught mid-transition settle. Call inside a runtime; a second
    /// call does nothing.
    ///
    /// # Errors
    /// `INTERNAL` when stored state cannot be read.
    pub fn start(&self, gate: &StartupGate) -> Result<(), ContractError> {
        if self.started.swap(true, Ordering::SeqCst) {
            return Ok(());
        }
        match self.converge() {
            Ok(()) => {
                if let (Some(ledger), Ok(reaping)) = (
                    self.exec_ledger.clone(),
                    Arc::clone(&self.exec_reaped).try_write_owned(),
                ) {
                    // Tools an earlier run left running (it was killed): none is anyone's now.
                    tokio::spawn(async move {
                        reap(&ledger, |_| false).await;
                        drop(reaping);
                    });
                }
                self.spawn_scheduler();
                self.spawn_health_probes();
                gate.open();
                info!(instance = %self.instance_id, "worker started");
                Ok(())
            }
            Err(e) => {
                let e = ContractError::from(e);
                gate.fail(e.message.clone());
                Err(e)
            }
        }
    }

    fn converge(&self) -> Result<(), CoreError> {
        let stored = store::load(&self.db)?;
        let mut shared = self.shared.lock();
        let now = self.clock.now_ms();
        shared
            .state
            .restore(stored.devices, stored.leases, stored.requests);
        shared.state.converge(now);
        self.apply(&mut shared, true)
    }

    /// Stops timers and device work. Leases stay stored; a later start restores them.
    pub fn shutdown(&self) {
        self.stop.cancel();
    }

    /// Stops what the drivers run for themselves (after [`Worker::shutdown`]).
    pub async fn close_drivers(&self) {
        for driver in self.drivers.values() {
            driver.close().await;
        }
    }

    /// The daemon's instance id.
    pub fn instance_id(&self) -> &str {
        &self.instance_id
    }

    /// The configuration the worker runs with.
    pub const fn config(&self) -> &DaemonConfig {
        &self.config
    }

    /// The lease limits.
    pub const fn lease_limits(&self) -> LeaseLimits {
        LeaseLimits {
            default_ttl_ms: self.settings.default_ttl_ms,
            max_ttl_ms: self.settings.max_ttl_ms,
        }
    }

    // === The one decision section ===

    /// Stores the rows of the decisions just made, then carries out their effects, in order,
    /// under the caller's lock. When the rows cannot be stored the effects are dropped (nobody
    /// hears of a decision that is not on disk) and the worker fails stop: every later decision
    /// answers `INTERNAL` until a restart re-reads the store.
    fn apply(&self, shared: &mut Shared, wake_timers: bool) -> Result<(), CoreError> {
        let writes = shared.state.take_writes();
        let stored = if writes.is_empty() {
            Ok(())
        } else {
            store::write(&self.db, &writes)
        };
        if let Err(e) = stored {
            error!(error = %e, "a decision could not be stored; the worker stops deciding until it is restarted");
            shared.poisoned = Some(e.to_string());
            // Said at once, so a gateway reads the failed health now, not at its next read.
            self.bus.emit(
                simlock_contract::event::EventModule::Daemon,
                &simlock_contract::event::Event::DaemonFailed {
                    error: e.to_string(),
                },
            );
            drop(shared.state.take_effects());
            // Every caller still waiting hears why, instead of waiting for an outcome that
            // will not come.
            let failure = ContractError::internal(store_failed(&e.to_string()));
            for (_, list) in shared.followers.drain() {
                for tx in list {
                    let _ = tx.send(Update::Done(Box::new(Err(failure.clone()))));
                }
            }
            // The caller of this decision hears what every later one will.
            return Err(CoreError::Internal(failure.message));
        }
        let fx = shared.state.take_effects();
        for event in fx.events {
            self.bus.emit(event.module, &event.event);
        }
        for notice in fx.notices {
            self.presence
                .notify(&notice.owner, &notice.push, notice.except);
        }
        for (id, update) in fx.updates {
            let done = matches!(update, Update::Done(_));
            if let Some(list) = shared.followers.get_mut(&id) {
                list.retain(|tx| tx.send(update.clone()).is_ok());
            }
            if done {
                shared.followers.remove(&id);
            }
        }
        for work in fx.work {
            self.spawn_work(work);
        }
        if wake_timers {
            self.wake.notify_one();
        }
        Ok(())
    }

    /// Runs one decision under the lock and applies it.
    fn decide<T>(
        &self,
        decision: impl FnOnce(&mut Shared, i64) -> Result<T, CoreError>,
    ) -> Result<T, CoreError> {
        let mut shared = self.shared.lock();
        if let Some(why) = &shared.poisoned {
            return Err(CoreError::Internal(store_failed(why)));
        }
        let now = self.clock.now_ms();
        let outcome = decision(&mut shared, now);
        let stored = self.apply(&mut shared, true);
        let value = outcome?;
        stored?;
        Ok(value)
    }

    fn on_work_result(&self, result: impl FnOnce(&mut State, i64)) {
        let _ = self.decide(|shared, now| {
            result(&mut shared.state, now);
            Ok(())
        });
    }

    // === Timers ===

    /// Sleeps until the state's next deadline and ticks then. A decision wakes it only to
    /// sleep again towards the (possibly earlier) new deadline: nothing is due sooner.
    fn spawn_scheduler(&self) {
        let me = self.me.clone();
        let wake = self.wake.clone();
        let stop = self.stop.clone();
        let clock = self.clock.clone();
        tokio::spawn(async move {
            loop {
                let next = match me.upgrade() {
                    Some(worker) => worker.shared.lock().state.next_deadline(),
                    None => break,
                };
                let due = async {
                    match next {
                        Some(at) => tokio::time::sleep_until(instant_at(&*clock, at)).await,
                        None => std::future::pending().await,
                    }
                };
                tokio::select! {
                    () = stop.cancelled() => break,
                    () = wake.notified() => continue,
                    () = due => {}
                }
                let Some(worker) = me.upgrade() else { break };
                let mut shared = worker.shared.lock();
                if shared.poisoned.is_some() {
                    break;
                }
                let now = worker.clock.now_ms();
                shared.state.tick(now);
                // The tick's own decisions do not wake the timers again.
                let _ = worker.apply(&mut shared, false);
            }
        });
    }

    /// Every `health.probeIntervalMs`, asks each driver which of its devices run and hands
    /// what it saw to the state (a failed probe concludes nothing).
    fn spawn_health_probes(&self) {
        let health = self.core.health;
        if !health.enabled {
            return;
        }
        let me = self.me.clone();
        let stop = self.stop.clone();
        let drivers: Vec<Arc<dyn Driver>> = self.drivers.values().cloned().collect();
        let period = Duration::from_millis(health.probe_interval_ms);
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(period);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            tick.tick().await;
            loop {
                tokio::select! {
                    () = stop.cancelled() => break,
                    _ = tick.tick() => {}
                }
                for driver in &drivers {
                    let platform = driver.platform();
                    let probe = bounded(platform, "probing", 0, driver.probe());
                    let seen = tokio::select! {
                        () = stop.cancelled() => return,
                        seen = probe => seen,
                    };
                    match seen {
                        Ok(Some(seen)) => {
                            report(&me, |state, now| state.observe(platform, &seen, now))
                        }
                        Ok(None) => {}
                        Err(e) => warn!(error = %e, "a health probe failed; it concludes nothing"),
                    }
                }
            }
        });
    }

    // === Device work ===

    fn spawn_work(&self, work: Work) {
        let platform = match &work {
            Work::Provision { spec, .. } => spec.platform,
            Work::Boot { platform, .. }
            | Work::Reclaim { platform, .. }
            | Work::Recover { platform, .. }
            | Work::Adopt { platform, .. }
            | Work::Sweep { platform, .. }
            | Work::Shutdown { platform, .. }
            | Work::Delete { platform, .. } => *platform,
        };
        let driver = self.drivers.get(&platform).cloned();
        let me = self.me.clone();
        let stop = self.stop.clone();
        tokio::spawn(async move {
            tokio::select! {
                () = stop.cancelled() => {}
                () = run_work(me, driver, platform, work) => {}
            }
        });
    }

    // === Operations ===

    fn caller(ctx: &CallCtx) -> Caller<'_> {
        ctx.viewer()
    }

    /// `status.get`: while starting (or failed), only `daemon` and `host`. The leases and waiting
    /// requests are those `viewer` may see.
    pub fn status(&self, gate: &StartupGate, viewer: Caller<'_>) -> StatusOutput {
        let at_gate = gate.health();
        // Capability probes run only for a full answer, and outside the worker's lock.
        let capabilities = (at_gate == Health::Running).then(|| self.capabilities.snapshot());
        let shared = self.shared.lock();
        let health = if shared.poisoned.is_some() {
            Health::Failed
        } else {
            at_gate
        };
        let daemon = DaemonInfo {
            health,
            mode: Mode::Worker,
            version: self.version.clone(),
            instance_id: self.instance_id.clone(),
        };
        let mut out = StatusOutput::bare(daemon, self.host.clone());
        if health != Health::Running {
            return out;
        }
        out.capacity = Some(shared.state.capacity());
        out.devices = Some(shared.state.devices());
        out.leases = Some(shared.state.visible_leases(viewer));
        out.queue_depth = Some(shared.state.queue_depth());
        out.waiting = Some(shared.state.waiting(viewer));
        out.capabilities = capabilities;
        out.drivers = Some(self.drivers.values().map(|d| d.status()).collect());
        out.lease = Some(self.lease_limits());
        out.uplink = self.uplink.as_ref().map(UplinkReport::status);
        out
    }

    /// `catalog.get`.
    pub fn catalog(&self, platform: Option<Platform>) -> CatalogOutput {
        CatalogOutput {
            platforms: self.catalog.list(platform),
        }
    }

    /// `config.get`: the configuration as JSON, the join token redacted.
    pub fn config_view(&self) -> ConfigView {
        self.config_view.clone()
    }

    /// `list.get`.
    pub fn list(&self, kind: ListKind) -> ListOutput {
        match kind {
            ListKind::Devices => ListOutput::Devices(self.devices()),
            ListKind::Leases => ListOutput::Leases(self.leases()),
            ListKind::Rules => ListOutput::Rules(Vec::new()),
            ListKind::Requests => ListOutput::Requests(self.waiting()),
        }
    }

    /// Whether a decision could not be stored: the worker refuses every decision until it is
    /// restarted (its health is `failed`).
    pub fn failed(&self) -> bool {
        self.shared.lock().poisoned.is_some()
    }

    /// Every device.
    pub fn devices(&self) -> Vec<Device> {
        self.shared.lock().state.devices()
    }

    /// What this worker can serve: its capabilities, fixed and live.
    pub(crate) const fn capabilities(&self) -> &Capabilities {
        &self.capabilities
    }

    /// Every lease, oldest first.
    pub fn leases(&self) -> Vec<LeaseRecord> {
        self.shared.lock().state.leases()
    }

    /// One lease.
    pub fn lease(&self, lease_id: &str) -> Option<LeaseRecord> {
        self.shared.lock().state.lease(lease_id).cloned()
    }

    /// Requests without a lease yet, oldest first.
    pub fn waiting(&self) -> Vec<WaitingRequest> {
        self.shared.lock().state.waiting(Caller::ADMIN)
    }

    /// Capacity now.
    pub fn capacity(&self) -> Capacity {
        self.shared.lock().state.capacity()
    }

    /// A recorded request (open, or settled within `lease.requestRetentionMs`).
    pub fn request(&self, id: &RequestId) -> Option<RequestRecord> {
        self.shared.lock().state.record(id)
    }

    /// Every recorded request.
    pub fn requests(&self) -> Vec<RequestRecord> {
        self.shared.lock().state.records()
    }

    /// Requests waiting for a device (`queueDepth`: device work has not started for them).
    pub fn queue_depth(&self) -> u32 {
        self.shared.lock().state.queue_depth()
    }

    /// `worker.list` on a worker: a fleet of one, with what `viewer` may see.
    pub fn worker_view(&self, gate: &StartupGate, viewer: Caller<'_>) -> WorkerView {
        let status = self.status(gate, viewer);
        let running = status.daemon.health == Health::Running;
        WorkerView {
            id: self.instance_id.clone(),
            label: self.config.gateway.label.clone(),
            connection: Connection::Connected,
            drained: false,
            last_seen_at: self.clock.now_ms(),
            health: Some(status.daemon.health),
            version: running.then(|| self.version.clone()),
            protocol: None,
            capacity: status.capacity,
            lease: status.lease,
            queue_depth: status.queue_depth,
            leases: status.leases,
            devices: status.devices,
            catalog: running.then(|| self.catalog.list(None)),
            catalog_read_at: running.then(|| self.clock.now_ms()),
            host: Some(status.host),
            waiting: status.waiting,
            capabilities: status.capabilities,
            releasing: Vec::new(),
        }
    }

    /// `lease.request`: checks, admission, then following the request until it settles,
    /// pushing its progress to the caller. A caller that goes away does not stop it.
    ///
    /// # Errors
    /// Any of the request's contract errors.
    pub async fn request_lease(
        &self,
        ctx: &CallCtx,
        input: LeaseRequestInput,
    ) -> Result<LeaseGrant, ContractError> {
        let mut updates = match self.admit(ctx, input)? {
            Admit::Follow(updates) => updates,
            Admit::Replay(outcome) => return *outcome,
        };
        loop {
            match updates.recv().await {
                Some(Update::Progress(progress)) => {
                    ctx.push(Push::Progress {
                        request_id: ctx.request_id().clone(),
                        progress,
                    })
                    .await;
                }
                Some(Update::Done(outcome)) => return *outcome,
                None => {
                    return Err(CoreError::Internal(
                        "The worker stopped before the request settled".into(),
                    )
                    .into());
                }
            }
        }
    }

    /// Checks a request and admits it: a receiver of its updates, or a replayed outcome.
    fn admit(&self, ctx: &CallCtx, input: LeaseRequestInput) -> Result<Admit, ContractError> {
        let ttl_ms = check_ttl(&self.settings, input.ttl_ms)?;
        let requester_id = input
            .requester_id
            .clone()
            .unwrap_or_else(|| ctx.principal.clone());
        if input.owner.is_some() && !ctx.is_gateway_uplink() {
            return Err(CoreError::Forbidden(
                "owner: only the gateway uplink may name a lease's owner".into(),
            )
            .into());
        }
        let owner_id = input.owner.clone().unwrap_or_else(|| ctx.principal.clone());
        if let Some((capability, reason)) = self.capabilities.missing(&input.requires) {
            return Err(CoreError::CapabilityMissing {
                capability: capability.to_owned(),
                reason,
            }
            .into());
        }
        let spec = self.catalog.resolve(
            input.platform,
            input.model.as_deref(),
            input.os_version.as_deref(),
        )?;
        let mut requires = input.requires.clone();
        requires.sort();
        requires.dedup();
        let fingerprint = json!({
            "spec": spec,
            "ttlMs": ttl_ms,
            "leaseId": input.lease_id,
            "requires": requires,
        })
        .to_string();
        let admission = Admission {
            request_id: RequestId::mint(),
            requester_id,
            principal: ctx.principal.clone(),
            idempotency_key: input.idempotency_key,
            fingerprint,
            spec,
            requested: RequestedDevice {
                platform: input.platform,
                model: input.model,
                os_version: input.os_version,
                requires: input.requires,
            },
            terms: LeaseTerms {
                ttl_ms,
                owner_id,
                chosen_id: input.lease_id,
            },
            no_wait: input.no_wait.unwrap_or(false),
            timeout_ms: input.timeout_ms,
        };
        let admitted = self.decide(|shared, now| {
            Ok(match shared.state.admit(admission, now)? {
                Admitted::Replay(outcome) => Admit::Replay(outcome),
                Admitted::Follow(id, told) => {
                    let (tx, rx) = mpsc::unbounded_channel();
                    if let Some(progress) = told {
                        let _ = tx.send(Update::Progress(progress));
                    }
                    shared.followers.entry(id).or_default().push(tx);
                    Admit::Follow(rx)
                }
            })
        })?;
        Ok(admitted)
    }

    /// `lease.renew`.
    ///
    /// # Errors
    /// `BAD_REQUEST` above `lease.maxTtlMs`; `UNKNOWN_LEASE` for a lease the caller cannot see.
    pub fn renew(
        &self,
        ctx: &CallCtx,
        input: &LeaseRenewInput,
    ) -> Result<LeaseRecord, ContractError> {
        let caller = Self::caller(ctx);
        Ok(self.decide(|shared, now| {
            shared
                .state
                .renew(&input.lease_id, input.ttl_ms, caller, now)
        })?)
    }

    /// `lease.release`, with reason `explicit` unless `reason` says otherwise: the caller's
    /// connection gets no `lease-lost` for it.
    ///
    /// # Errors
    /// `UNKNOWN_LEASE` for a lease the caller cannot see.
    pub fn release(
        &self,
        ctx: &CallCtx,
        lease_id: &str,
        reason: Option<ReleaseReason>,
    ) -> Result<LeaseReleaseOutput, ContractError> {
        let caller = Self::caller(ctx);
        let except = ctx.connection_id();
        let reason = reason.map_or(LeaseEndReason::Explicit, LeaseEndReason::from);
        let lease =
            self.decide(|shared, now| shared.state.release(lease_id, reason, caller, except, now))?;
        Ok(LeaseReleaseOutput {
            lease_id: lease.id.into_string(),
        })
    }

    /// `lease.release-all` (reason `killed`).
    ///
    /// # Errors
    /// `INTERNAL` when the decision cannot be stored.
    pub fn release_all(&self, ctx: &CallCtx) -> Result<ReleaseAllOutput, ContractError> {
        let except = ctx.connection_id();
        let lease_ids = self.decide(|shared, now| Ok(shared.state.release_all(except, now)))?;
        Ok(ReleaseAllOutput { lease_ids })
    }

    /// `lease.cancel` for `requester_id` (default: the caller's principal).
    ///
    /// # Errors
    /// `FORBIDDEN` for an agent cancelling another's request; `INTERNAL` when the decision
    /// cannot be stored.
    pub fn cancel(
        &self,
        ctx: &CallCtx,
        requester_id: Option<&str>,
    ) -> Result<LeaseCancelOutput, ContractError> {
        let requester = requester_id.unwrap_or(&ctx.principal);
        let caller = Self::caller(ctx);
        let result = self.decide(|shared, now| shared.state.cancel(requester, caller, now))?;
        Ok(LeaseCancelOutput { result })
    }

    /// Whether the caller may cancel `requester_id`'s pending request: admins always; agents
    /// when they own it (an unknown request is left to the handler's `not-found`). The early
    /// answer, before start-up parking; [`Worker::cancel`] checks again under its decision.
    ///
    /// # Errors
    /// `FORBIDDEN`.
    pub fn authorize_cancel(
        &self,
        ctx: &CallCtx,
        requester_id: Option<&str>,
    ) -> Result<(), ContractError> {
        let requester = requester_id.unwrap_or(&ctx.principal);
        self.shared
            .lock()
            .state
            .cancellable(requester, Self::caller(ctx))?;
        Ok(())
    }

    /// `lease.list`: admins see every lease, agents their own.
    pub fn lease_list(&self, ctx: &CallCtx) -> LeaseListOutput {
        let leases = self.shared.lock().state.visible_leases(Self::caller(ctx));
        LeaseListOutput {
            leases,
            unread_workers: Vec::new(),
        }
    }

    /// `lease.get`: the lease as `lease.list` shows it to `ctx`'s caller.
    ///
    /// # Errors
    /// `UNKNOWN_LEASE` when there is none, or the caller may not see it.
    pub fn lease_get(
        &self,
        ctx: &CallCtx,
        lease_id: &str,
    ) -> Result<LeaseGetOutput, ContractError> {
        let shared = self.shared.lock();
        shared
            .state
            .lease(lease_id)
            .filter(|lease| Self::caller(ctx).may_see(&lease.owner_id))
            .map(|lease| LeaseGetOutput {
                lease: lease.clone(),
            })
            .ok_or_else(|| ContractError::unknown_lease(lease_id))
    }

    /// Whether `device.exec` may name `requesterId`: only admins may.
    ///
    /// # Errors
    /// `FORBIDDEN`.
    pub fn authorize_exec(ctx: &CallCtx, input: &ExecInput) -> Result<(), ContractError> {
        if ctx.role != Role::Admin && input.requester_id.is_some() {
            return Err(CoreError::Forbidden(
                "requesterId: only an admin may name the requester on device.exec".into(),
            )
            .into());
        }
        Ok(())
    }

    /// `device.exec`: runs a configured tool against the lease's device, pushing `started`
    /// then its `output`; answers its exit code.
    ///
    /// # Errors
    /// `FORBIDDEN`, `UNKNOWN_LEASE`, `UNKNOWN_PASSTHROUGH_TOOL`, `EXEC_TIMEOUT`, `INTERNAL`.
    pub async fn exec(&self, ctx: &CallCtx, input: ExecInput) -> Result<ExecOutput, ContractError> {
        Self::authorize_exec(ctx, &input)?;
        let now = self.clock.now_ms();
        let target = self.shared.lock().state.exec_target(
            &input.lease_id,
            Self::caller(ctx),
            input.requester_id.as_deref(),
            now,
        )?;
        let Some(tool) = self.core.exec.tools.get(&input.tool).cloned() else {
            return Err(CoreError::UnknownTool {
                tool: input.tool,
                known: self.core.exec.tools.keys().cloned().collect(),
            }
            .into());
        };
        // Not before the tools an earlier run left are stopped.
        let _reaped = self.exec_reaped.read().await;
        let run = exec::Run {
            tool_name: input.tool,
            tool,
            args: input.args,
            stdin: input.stdin,
            target,
            timeout_ms: self.core.exec.timeout_ms,
            ledger: self.exec_ledger.clone(),
        };
        let exit_code = exec::run(ctx.clone(), run).await?;
        Ok(ExecOutput { exit_code })
    }
}

/// Hands a piece of device work's result to the state, if the worker still exists.
fn report(me: &Weak<Worker>, result: impl FnOnce(&mut State, i64)) {
    if let Some(worker) = me.upgrade() {
        worker.on_work_result(result);
    }
}

/// Runs one piece of device work and reports its result to the worker.
async fn run_work(
    me: Weak<Worker>,
    driver: Option<Arc<dyn Driver>>,
    platform: Platform,
    work: Work,
) {
    let driver = driver.as_ref();
    match work {
        Work::Provision { device, spec } => {
            let result = drive(
                driver,
                platform,
                "provisioning",
                |e| e.provision_ms,
                |d| d.provision(&spec, &device),
            )
            .await;
            let mut next = None;
            report(&me, |state, now| {
                next = state.provisioned(&device, result, now)
            });
            let Some(driver_device_id) = next else {
                return;
            };
            let result = boot(driver, platform, &driver_device_id).await;
            report(&me, |state, now| state.booted(&device, result, now));
        }
        Work::Boot {
            device,
            driver_device_id,
            ..
        } => {
            let result = boot(driver, platform, &driver_device_id).await;
            report(&me, |state, now| state.booted(&device, result, now));
        }
        Work::Reclaim {
            device,
            driver_device_id,
            ended,
            ..
        } => {
            if let Some(lease) = ended {
                let hooks = me
                    .upgrade()
                    .map(|w| w.lease_end.clone())
                    .unwrap_or_default();
                for hook in hooks {
                    if tokio::time::timeout(LEASE_END_BOUND, hook(lease.clone()))
                        .await
                        .is_err()
                    {
                        warn!(%lease, %device, "a module did not end its part of the lease within {LEASE_END_BOUND:?}; reclaiming anyway");
                    }
                }
            }
            let result = drive(
                driver,
                platform,
                "reclaiming",
                |e| e.reclaim_ms,
                |d| d.reclaim(&driver_device_id),
            )
            .await;
            report(&me, |state, now| state.reclaimed(&device, result, now));
        }
        Work::Recover {
            device,
            driver_device_id,
            ..
        } => {
            let result = drive(
                driver,
                platform,
                "recovering",
                |e| e.boot_ms,
                |d| d.recover(&driver_device_id),
            )
            .await;
            if let Err(e) = &result {
                warn!(error = %e, %device, "booting a crashed device again failed");
            }
            report(&me, |state, now| state.recovered(&device, result, now));
        }
        Work::Adopt {
            device,
            driver_device_id,
            ..
        } => {
            let result = drive(
                driver,
                platform,
                "adopting",
                |e| e.boot_ms,
                |d| d.adopt(&driver_device_id),
            )
            .await;
            report(&me, |state, now| state.adopted(&device, result, now));
        }
        Work::Sweep { keep, .. } => {
            let result = drive(
                driver,
                platform,
                "sweeping",
                |e| e.provision_ms,
                |d| d.sweep(keep),
            )
            .await;
            if let Err(e) = &result {
                warn!(error = %e, %platform, "sweeping what an earlier run left failed");
            }
            report(&me, |state, now| state.swept(platform, result, now));
        }
        Work::Shutdown {
            device,
            driver_device_id,
            ..
        } => {
            let result = shut_down(driver, platform, &driver_device_id).await;
            if let Err(e) = &result {
                warn!(error = %e, %device, "shutting a device down failed");
            }
            report(&me, |state, now| state.shut_down(&device, result, now));
        }
        Work::Delete {
            device,
            driver_device_id,
            running,
            ..
        } => {
            // Without a driver there is nothing to shut down or delete: the device is forgotten.
            if driver.is_some() {
                if running && let Err(e) = shut_down(driver, platform, &driver_device_id).await {
                    warn!(error = %e, %device, "shutting a device down before deleting it failed");
                }
                if let Err(e) = drive(
                    driver,
                    platform,
                    "deleting",
                    |e| e.provision_ms,
                    |d| d.delete(&driver_device_id),
                )
                .await
                {
                    warn!(error = %e, %device, "deleting a device failed; it is forgotten anyway");
                }
            }
            report(&me, |state, now| state.deleted(&device, now));
        }
    }
}

/// Boots a device on the platform's driver (bounded by its boot estimate).
async fn boot(
    driver: Option<&Arc<dyn Driver>>,
    platform: Platform,
    driver_device_id: &str,
) -> Result<simlock_contract::model::DeviceAccess, DriverError> {
    drive(
        driver,
        platform,
        "booting",
        |e| e.boot_ms,
        |d| d.boot(driver_device_id),
    )
    .await
}

/// Shuts a device down on the platform's driver (bounded by its boot estimate).
async fn shut_down(
    driver: Option<&Arc<dyn Driver>>,
    platform: Platform,
    driver_device_id: &str,
) -> Result<(), DriverError> {
    drive(
        driver,
        platform,
        "shutting down",
        |e| e.boot_ms,
        |d| d.shutdown(driver_device_id),
    )
    .await
}

/// One call on the platform's driver, bounded by [`driver_bound`] of the estimate `estimate`
/// reads from it; without a driver, the call fails at once.
async fn drive<T>(
    driver: Option<&Arc<dyn Driver>>,
    platform: Platform,
    what: &str,
    estimate: fn(&Estimates) -> u64,
    call: impl FnOnce(&dyn Driver) -> BoxFuture<'static, Result<T, DriverError>>,
) -> Result<T, DriverError> {
    let Some(driver) = driver else {
        return Err(DriverError {
            platform,
            message: "no driver serves this platform".into(),
        });
    };
    let estimate_ms = estimate(&driver.estimates());
    bounded(platform, what, estimate_ms, call(driver.as_ref())).await
}

/// The shortest bound on a driver call: a minute.
const MIN_DRIVER_BOUND_MS: u64 = 60_000;
/// A driver call may take this many times its estimate before it counts as stalled.
const DRIVER_BOUND_FACTOR: u64 = 3;

/// How long a driver call estimated at `estimate_ms` may run: three times the estimate, and never
/// less than a minute (the original's stalled-transition rule).
fn driver_bound(estimate_ms: u64) -> Duration {
    Duration::from_millis(
        estimate_ms
            .saturating_mul(DRIVER_BOUND_FACTOR)
            .max(MIN_DRIVER_BOUND_MS),
    )
}

/// Runs a driver call under [`driver_bound`]; one that runs past it fails like any driver error,
/// so a hung driver cannot keep a device busy and its request waiting for ever.
async fn bounded<T>(
    platform: Platform,
    what: &str,
    estimate_ms: u64,
    call: impl Future<Output = Result<T, DriverError>>,
) -> Result<T, DriverError> {
    let bound = driver_bound(estimate_ms);
    tokio::time::timeout(bound, call).await.unwrap_or_else(|_| {
        Err(DriverError {
            platform,
            message: format!("{what} took longer than {} s", bound.as_secs()),
        })
    })
}

/// What every decision answers once one could not be stored (`why`, the store's error).
fn store_failed(why: &str) -> String {
    format!("the worker's state store failed ({why}); restart the worker once the disk is healthy")
}
