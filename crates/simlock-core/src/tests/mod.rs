//! Tests through the real router and pipeline: an in-memory (or temp-file) database, the
//! tokio clock (paused where time matters), the event bus, presence, and calls made with
//! `CallCtx::http`/`CallCtx::internal` whose pushes land in a channel.

mod bad_input;
mod capacity;
mod driver;
mod exec;
mod leasing;
mod restart;
mod views;
mod wire;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use serde_json::Value;
use simlock_contract::model::{
    Device, EventEnvelope, LeaseGrant, LeaseRecord, Platform, WaitingRequest,
};
use simlock_contract::ops::{LeaseRequest, LeaseRequestInput};
use simlock_contract::{ContractError, Operation, Push, Role};
use simlock_daemon::config::DaemonConfig;

use crate::config::{CapacityStrategy, CoreConfig, ToolConfig};
use simlock_daemon::pipeline::Greeter;
use simlock_daemon::presence::Notice;
use simlock_daemon::{
    CallCtx, Capabilities, Database, EventBus, Pipeline, Presence, Router, SharedClock, Shutdown,
    StartupGate, TokioClock,
};
use tokio::sync::{broadcast, mpsc};

use crate::book::RequestRecord;
use crate::system::{FixedSystem, GIB, SystemFacts};
use crate::{Worker, WorkerParts, register, virtual_drivers};

/// The wall time every test starts at.
pub(crate) const T0: i64 = 1_700_000_000_000;

pub(crate) struct TestGreeter;

impl Greeter for TestGreeter {
    fn is_admin_secret(&self, secret: &str) -> bool {
        secret == "admin-secret"
    }

    fn default_principal(&self) -> String {
        "local".into()
    }
}

/// A worker's configuration in tests: the daemon's section and the core's.
#[derive(Debug, Clone, Default)]
pub(crate) struct TestConfig {
    pub daemon: DaemonConfig,
    pub core: CoreConfig,
}

/// A worker config for tests: fixed capacity 2, the default catalog and timings, and a few
/// exec tools.
pub(crate) fn config() -> TestConfig {
    let mut config = TestConfig::default();
    config.core.capacity.strategy = CapacityStrategy::Fixed;
    config.core.capacity.max_running = 2;
    let tool = |command: &str, args: &[&str]| ToolConfig {
        command: command.into(),
        args: args.iter().map(|a| (*a).to_owned()).collect(),
    };
    config.core.exec.tools = BTreeMap::from([
        ("sh".to_owned(), tool("sh", &["-c"])),
        ("cat".to_owned(), tool("cat", &[])),
        ("sleep".to_owned(), tool("sleep", &[])),
    ]);
    config
}

/// One worker behind a pipeline.
pub(crate) struct Harness {
    pub worker: Arc<Worker>,
    pub pipeline: Arc<Pipeline>,
    pub bus: Arc<EventBus>,
    pub presence: Presence,
    pub gate: StartupGate,
    pub clock: SharedClock,
    pub capabilities: Capabilities,
}

pub(crate) struct Build {
    pub config: TestConfig,
    pub db: Option<Database>,
    pub clock: Option<SharedClock>,
    pub system: Arc<dyn SystemFacts>,
    pub start: bool,
    /// Drivers to use instead of the virtual ones of the config.
    pub drivers: Option<Vec<Arc<dyn crate::Driver>>>,
    /// Lease-end hooks.
    pub lease_end: Vec<crate::LeaseEndHook>,
    /// The uplink's report, for a worker with a gateway.
    pub uplink: Option<simlock_daemon::uplink::UplinkReport>,
    /// Where `device.exec` records its tools.
    pub exec_ledger: Option<std::path::PathBuf>,
}

impl Default for Build {
    fn default() -> Self {
        Self {
            config: config(),
            db: None,
            clock: None,
            system: Arc::new(FixedSystem {
                cpus: 8,
                ram_bytes: 32 * GIB,
            }),
            start: true,
            drivers: None,
            lease_end: Vec::new(),
            uplink: None,
            exec_ledger: None,
        }
    }
}

impl Harness {
    /// A started worker with the test config.
    pub(crate) fn new() -> Self {
        Self::build(Build::default())
    }

    pub(crate) fn with_config(config: TestConfig) -> Self {
        Self::build(Build {
            config,
            ..Build::default()
        })
    }

    pub(crate) fn build(b: Build) -> Self {
        let db = match b.db {
            Some(db) => db,
            None => Database::open_in_memory().unwrap(),
        };
        let clock = b
            .clock
            .unwrap_or_else(|| TokioClock::starting_at(T0).shared());
        let bus = EventBus::new(10_000, clock.clone());
        let presence = Presence::new();
        let capabilities = Capabilities::new(b.config.daemon.capabilities.clone(), bus.clone());
        let parts = WorkerParts {
            drivers: b
                .drivers
                .unwrap_or_else(|| virtual_drivers(&b.config.core.virtual_devices)),
            config_view: simlock_daemon::config::view(
                &b.config.daemon,
                &CoreConfig::register(simlock_daemon::config::Sections::new()),
                &b.config.core.values(),
                simlock_contract::model::Mode::Worker,
            ),
            config: b.config.daemon,
            core: b.config.core,
            db,
            clock: clock.clone(),
            bus: bus.clone(),
            presence: presence.clone(),
            capabilities: capabilities.clone(),
            system: b.system,
            instance_id: "worker-test".into(),
            version: "0.0.0-test".into(),
            lease_end: b.lease_end,
            uplink: b.uplink,
            exec_ledger: b.exec_ledger,
        };
        let worker = Worker::new(parts).unwrap();
        let gate = StartupGate::new();
        let mut router = Router::new();
        register(&mut router, &worker, gate.clone());
        let pipeline = Arc::new(Pipeline::new(
            router,
            gate.clone(),
            Shutdown::new(),
            "0.0.0-test".into(),
            Arc::new(TestGreeter),
            presence.clone(),
        ));
        if b.start {
            worker.start(&gate).unwrap();
        }
        Self {
            worker,
            pipeline,
            bus,
            presence,
            gate,
            clock,
            capabilities,
        }
    }

    pub(crate) fn now(&self) -> i64 {
        self.clock.now_ms()
    }

    /// Calls an operation through the pipeline.
    pub(crate) async fn call<O: Operation>(
        &self,
        ctx: CallCtx,
        input: &O::Input,
    ) -> Result<O::Output, ContractError> {
        self.pipeline.call_typed::<O>(ctx, input).await
    }

    /// Calls an operation with a raw payload.
    pub(crate) async fn call_raw(
        &self,
        ctx: CallCtx,
        op: &str,
        payload: Value,
    ) -> Result<Value, ContractError> {
        self.pipeline.call(ctx, op, Some(payload)).await
    }

    /// Requests a lease for `principal` and waits for it.
    pub(crate) async fn lease(
        &self,
        principal: &str,
        input: LeaseRequestInput,
    ) -> Result<LeaseGrant, ContractError> {
        self.call::<LeaseRequest>(agent(principal), &input).await
    }

    /// Starts a request in its own task; its pushes arrive on the receiver.
    pub(crate) fn spawn_lease(
        &self,
        principal: &str,
        input: LeaseRequestInput,
    ) -> (
        tokio::task::JoinHandle<Result<LeaseGrant, ContractError>>,
        mpsc::Receiver<Push>,
    ) {
        let (ctx, pushes) = agent_with_pushes(principal);
        let pipeline = self.pipeline.clone();
        let task =
            tokio::spawn(async move { pipeline.call_typed::<LeaseRequest>(ctx, &input).await });
        (task, pushes)
    }

    /// What the worker holds, to show a refused call changed nothing.
    pub(crate) fn snapshot(&self) -> Snapshot {
        Snapshot {
            devices: self.worker.devices(),
            leases: self.worker.leases(),
            waiting: self.worker.waiting(),
            requests: self.worker.requests(),
        }
    }
}

#[derive(Debug, PartialEq)]
pub(crate) struct Snapshot {
    pub devices: Vec<Device>,
    pub leases: Vec<LeaseRecord>,
    pub waiting: Vec<WaitingRequest>,
    pub requests: Vec<RequestRecord>,
}

pub(crate) fn agent(principal: &str) -> CallCtx {
    CallCtx::http(principal.to_owned(), Role::Agent, None)
}

pub(crate) fn admin(principal: &str) -> CallCtx {
    CallCtx::internal(principal.to_owned(), Role::Admin, None)
}

pub(crate) fn agent_with_pushes(principal: &str) -> (CallCtx, mpsc::Receiver<Push>) {
    let (tx, rx) = mpsc::channel(1024);
    (
        CallCtx::http(principal.to_owned(), Role::Agent, Some(tx)),
        rx,
    )
}

pub(crate) fn admin_with_pushes(principal: &str) -> (CallCtx, mpsc::Receiver<Push>) {
    let (tx, rx) = mpsc::channel(1024);
    (
        CallCtx::internal(principal.to_owned(), Role::Admin, Some(tx)),
        rx,
    )
}

pub(crate) fn ios() -> LeaseRequestInput {
    LeaseRequestInput::for_platform(Platform::Ios)
}

pub(crate) fn android() -> LeaseRequestInput {
    LeaseRequestInput::for_platform(Platform::Android)
}

/// A hang guard: fails the test if `future` does not finish within `limit` (virtual time when
/// paused). Never a way to wait for something: the future is what waits.
pub(crate) async fn within<F: Future>(limit: Duration, future: F) -> F::Output {
    tokio::time::timeout(limit, future)
        .await
        .expect("hang guard: the awaited thing never happened")
}

const GUARD: Duration = Duration::from_secs(6 * 3600);

/// Waits for the next event named `name`.
pub(crate) async fn next_event(
    events: &mut broadcast::Receiver<EventEnvelope>,
    name: &str,
) -> EventEnvelope {
    within(GUARD, async {
        loop {
            let event = events.recv().await.unwrap();
            if event.event == name {
                return event;
            }
        }
    })
    .await
}

/// Waits for the next event named `name` whose payload has `key` = `value`.
pub(crate) async fn next_event_where(
    events: &mut broadcast::Receiver<EventEnvelope>,
    name: &str,
    key: &str,
    value: &Value,
) -> EventEnvelope {
    within(GUARD, async {
        loop {
            let event = events.recv().await.unwrap();
            if event.event == name && event.payload.get(key) == Some(value) {
                return event;
            }
        }
    })
    .await
}

/// Waits for the next lease notice.
pub(crate) async fn next_notice(notices: &mut broadcast::Receiver<Notice>) -> Notice {
    within(GUARD, async { notices.recv().await.unwrap() }).await
}

/// Waits for the next push.
pub(crate) async fn next_push(pushes: &mut mpsc::Receiver<Push>) -> Push {
    within(GUARD, async { pushes.recv().await.unwrap() }).await
}
