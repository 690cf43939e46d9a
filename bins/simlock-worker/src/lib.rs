//! The worker, composed: the daemon's parts, the worker domain, the hosts and the uplink to a
//! gateway. The binary and the in-process fleet tests both start it here.

use std::collections::BTreeSet;
use std::sync::{Arc, LazyLock};

use agent_device_front::{AgentDeviceConfig, Front, FrontOptions, LeaseId, RecoveredLease};
use agent_device_host::{
    AgentDeviceHost, Daemon, DaemonState, FindLease, HostOptions, InProcessHostLink, RenewLease,
    WorkerLease,
};
use futures::FutureExt;

use simlock_contract::Role;
use simlock_contract::event::{Event, EventModule};
use simlock_contract::model::Mode;
use simlock_contract::ops::{ConfigView, LeaseRenewInput};
use simlock_core::config::CoreConfig;
use simlock_core::{SystemFacts, Worker, WorkerParts};
use simlock_daemon::clock::SharedClock;
use simlock_daemon::config::{self, ConfigError, DaemonConfig, Loaded, Sections};
use simlock_daemon::context::CallCtx;
use simlock_daemon::home::Home;
use simlock_daemon::runtime::{Base, Running, StartError};
use simlock_daemon::uplink::{self, UplinkConfig, UplinkReport, UplinkState};
use simlock_drivers::DriversConfig;
use simlock_relay_worker::RelayTargets;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

/// Every configuration section of simlock, as a worker registers them: those it reads (the
/// core's, the drivers', the agent-device edge's) and those only a gateway reads, so their keys
/// are warned about as a gateway's. The gateway registers the same list.
pub fn sections() -> &'static Sections {
    // Built once: its key tables are built at their first use and kept (see `Sections`).
    static SECTIONS: LazyLock<Sections> = LazyLock::new(|| {
        CoreConfig::register(Sections::new())
            .with::<AgentDeviceConfig>()
            .with::<DriversConfig>()
            .with::<simlock_fleet::FleetConfig>()
    });
    &SECTIONS
}

/// A worker's configuration: the daemon's own section and the sections of the crates a worker
/// composes, each typed by the crate that reads it.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct WorkerConfig {
    /// The daemon's own section (`lease`, `http`, `log`, `eventBuffer`, `capabilities`, the
    /// uplink's `gateway.*`).
    pub daemon: DaemonConfig,
    /// The core's sections (`capacity`, `idle`, `exec`, `virtual`, `health`, `quarantine`).
    pub core: CoreConfig,
    /// `agentDevice.*` (the front's and the host's).
    pub agent_device: AgentDeviceConfig,
    /// `drivers.*`.
    pub drivers: DriversConfig,
}

impl WorkerConfig {
    /// The sections of `loaded` (loaded with [`sections`]).
    ///
    /// # Errors
    /// A section that was not registered.
    pub fn from_loaded(loaded: &Loaded) -> Result<Self, ConfigError> {
        Ok(Self {
            daemon: loaded.config.clone(),
            core: CoreConfig::from_loaded(loaded)?,
            agent_device: loaded.section()?,
            drivers: loaded.section()?,
        })
    }

    /// `config.get`'s answer.
    pub fn view(&self) -> ConfigView {
        let mut values = self.core.values();
        values.push(config::section_value(&self.agent_device));
        values.push(config::section_value(&self.drivers));
        config::view(&self.daemon, sections(), &values, Mode::Worker)
    }
}

/// What a worker is started with.
#[derive(Clone)]
pub struct WorkerOptions {
    /// Its home.
    pub home: Home,
    /// Its configuration (already loaded and validated).
    pub config: WorkerConfig,
    /// Its version.
    pub version: String,
    /// Time, for tests; the system's otherwise.
    pub clock: Option<SharedClock>,
    /// Machine facts, for tests; the real machine's otherwise.
    pub system: Option<Arc<dyn SystemFacts>>,
    /// The relay targets this worker serves, by capability name (none by default).
    pub relay_targets: RelayTargets,
    /// Test hook: when set, the uplink dials before start-up converges, and start-up converges
    /// only once this fires (so calls park behind the start-up gate meanwhile).
    pub startup_hold: Option<CancellationToken>,
    /// More environment for the agent-device daemon (tests: an isolated `HOME`, a fake's knobs).
    pub agent_device_env: Vec<(String, String)>,
    /// Test hook: serve an agent-device daemon that already runs here instead of starting
    /// `agentDevice.command`.
    pub agent_device_attach: Option<agent_device_host::process::Endpoint>,
}

impl std::fmt::Debug for WorkerOptions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WorkerOptions")
            .field("home", &self.home)
            .finish_non_exhaustive()
    }
}

impl WorkerOptions {
    /// Options with the given home and configuration.
    pub fn new(home: Home, config: WorkerConfig) -> Self {
        Self {
            home,
            config,
            version: env!("CARGO_PKG_VERSION").to_owned(),
            clock: None,
            system: None,
            relay_targets: RelayTargets::new(),
            startup_hold: None,
            agent_device_env: Vec::new(),
            agent_device_attach: None,
        }
    }
}

/// The agent-device daemon's environment: simlock's own adb server and SDK (so it reaches the
/// emulators simlock leases, never the user's adb server), then the caller's additions.
/// The front's view of the worker's simlock lease `L`: its owner, its requester and its
/// device as agent-device names it (the access's address, else the driver's id).
fn find_lease(worker: Arc<Worker>) -> FindLease {
    Arc::new(move |lease: &LeaseId| {
        let record = worker.lease(lease.as_str())?;
        let device = match &record.access {
            Some(access) => RecoveredLease {
                platform: access.platform(),
                address: access.address().to_owned(),
            },
            None => worker
                .devices()
                .into_iter()
                .find(|d| d.id == record.device_id)
                .map(|d| RecoveredLease {
                    platform: d.spec.platform,
                    address: d.driver_device_id,
                })?,
        };
        Some(WorkerLease {
            owner: record.owner_id,
            requester: record.requester_id,
            device,
        })
    })
}

fn agent_device_env(drivers: &DriversConfig, extra: &[(String, String)]) -> Vec<(String, String)> {
    let android = &drivers.android;
    let mut env = vec![(
        "ANDROID_ADB_SERVER_PORT".to_owned(),
        android.adb_server_port.to_string(),
    )];
    if let Some(sdk) = &android.sdk_root {
        env.push(("ANDROID_HOME".to_owned(), sdk.clone()));
        env.push(("ANDROID_SDK_ROOT".to_owned(), sdk.clone()));
    }
    env.extend(extra.iter().cloned());
    env
}

/// A worker that serves.
pub struct RunningWorker {
    /// The daemon.
    pub running: Running,
    /// The worker domain.
    pub worker: Arc<Worker>,
    /// How the uplink stands, when a gateway is configured.
    pub uplink: Option<watch::Receiver<UplinkState>>,
    /// The agent-device host and front, when `agentDevice.enabled`.
    pub agent_device: Option<AgentDevice>,
    uplink_stop: CancellationToken,
}

/// The worker's agent-device parts.
#[derive(Debug, Clone)]
pub struct AgentDevice {
    /// The host of the daemon.
    pub host: AgentDeviceHost,
    /// The `/v1/agent-device` front.
    pub front: Front,
}

impl std::fmt::Debug for RunningWorker {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RunningWorker")
            .field("running", &self.running)
            .finish_non_exhaustive()
    }
}

/// Starts a worker: serves the socket (and HTTP when `http.enabled`), converges its devices and
/// leases, then dials its gateway when one is configured.
///
/// # Errors
/// [`StartError`].
pub async fn start(options: WorkerOptions) -> Result<RunningWorker, StartError> {
    let config = options.config;
    let config_view = config.view();
    let core = config.core.clone();
    let base = Base::open(
        options.home,
        config.daemon,
        Mode::Worker,
        options.version,
        options.clock,
    )?;
    let mut parts = WorkerParts::new(&base, core, config_view);
    if let Some(system) = options.system {
        parts.system = system;
    }
    // Which driver serves each platform (logged once each); the virtual ones when asked.
    parts.drivers = simlock_drivers::select(
        &config.drivers,
        &config.core.virtual_devices,
        base.home.root(),
    )
    .await;
    let mut relay_targets = options.relay_targets;
    let host = match (&config.agent_device.enabled, &config.agent_device.command) {
        (true, Some(command)) => {
            let state_dir = base.home.root().join("agent-device");
            let mut host_options = HostOptions::new(command.clone(), state_dir.clone());
            host_options.session_retention =
                std::time::Duration::from_millis(config.agent_device.session_retention_ms);
            host_options.daemon = match options.agent_device_attach.clone() {
                Some(endpoint) => Daemon::Attach(endpoint),
                None => Daemon::Spawn(agent_device_host::process::DaemonSpec {
                    command: command.clone(),
                    state_dir,
                    env: agent_device_env(&config.drivers, &options.agent_device_env),
                }),
            };
            let host = AgentDeviceHost::start(host_options).await;
            // Read at each `status.get`; each change goes on the bus as `capability.changed`.
            parts
                .capabilities
                .watch(host.watch(), DaemonState::capability);
            let ending = host.clone();
            parts.lease_end.push(Arc::new(move |lease: String| {
                let host = ending.clone();
                async move {
                    if let Some(lease) = LeaseId::parse(&lease) {
                        host.end_lease(&lease).await;
                    }
                }
                .boxed()
            }));
            Some(host)
        }
        _ => None,
    };
    let gateway = match (&base.config.gateway.url, &base.config.gateway.token) {
        (Some(url), Some(token)) => {
            // A CA file that cannot be read fails start-up; TLS failures later are retried.
            let ca_file = base
                .config
                .gateway
                .ca_file
                .as_deref()
                .map(|path| base.home.resolve(path));
            Some(UplinkConfig {
                url: url.clone(),
                token: token.clone(),
                worker_id: base.instance_id.clone(),
                label: base.config.gateway.label.clone(),
                tls: uplink::uplink_tls(url, ca_file.as_deref())?,
            })
        }
        _ => None,
    };
    // `status.get` reads how the uplink stands; the uplink writes it once it dials.
    let gateway = gateway.map(|config| {
        let report = UplinkReport::new(&config.url, base.clock.clone());
        (config, report)
    });
    parts.uplink = gateway.as_ref().map(|(_, report)| report.clone());
    let worker = Worker::new(parts).map_err(|e| StartError::Domain(e.to_string()))?;
    if let Some(host) = &host {
        // A relayed heartbeat renews the lease here with the authority of the gateway that
        // relayed it: its calls over the uplink are the admin's.
        let renewing = worker.clone();
        let renew: RenewLease = Arc::new(move |lease, ttl_ms| {
            let ctx = CallCtx::internal("gateway".into(), Role::Admin, None);
            let input = LeaseRenewInput {
                lease_id: lease.to_string(),
                ttl_ms: Some(ttl_ms),
            };
            renewing.renew(&ctx, &input).map(drop)
        });
        relay_targets
            .insert(
                agent_device_front::CAPABILITY,
                host.relay_target(Some(renew)),
            )
            .map_err(|e| StartError::Domain(e.to_string()))?;
    }
    let mut router = base.router();
    simlock_core::register(&mut router, &worker, base.gate.clone());
    simlock_relay_worker::register(&mut router, relay_targets);
    simlock_daemon::pipeline::check_complete(&router, &simlock_daemon::pipeline::all_operations())
        .map_err(StartError::Domain)?;
    let listen = simlock_daemon::runtime::Listen::as_configured(&base.config);
    simlock_core::register_metrics(&base.metrics, &worker);
    let agent_device_front = host.as_ref().map(|host| {
        let catalog = worker.clone();
        let link = InProcessHostLink::new(
            host.clone(),
            move || {
                catalog
                    .catalog(None)
                    .platforms
                    .into_iter()
                    .map(|p| p.platform)
                    .collect::<BTreeSet<_>>()
            },
            base.config.lease.max_ttl_ms,
            find_lease(worker.clone()),
        );
        (host.clone(), link)
    });
    let (tokens, cap, max_ttl, queue_wait) = (
        base.tokens.clone(),
        config.agent_device.lease_ttl_cap_ms,
        base.config.lease.max_ttl_ms,
        config.agent_device.queue_wait_ms,
    );
    let mut agent_device = None;
    let running = base
        .serve_with(router, listen, |pipeline| {
            let Some((host, link)) = agent_device_front else {
                return Vec::new();
            };
            let front = Front::new(FrontOptions {
                link: Arc::new(link),
                pipeline: pipeline.clone(),
                tokens,
                lease_ttl_cap_ms: cap,
                max_ttl_ms: max_ttl,
                queue_wait_ms: queue_wait,
            });
            let mount = front.mount();
            agent_device = Some(AgentDevice { host, front });
            vec![mount]
        })
        .await?;
    let uplink_stop = CancellationToken::new();
    let dial = |running: &Running| {
        gateway.clone().map(|(config, report)| {
            uplink::run(
                config,
                report,
                running.pipeline.clone(),
                uplink_stop.clone(),
            )
            .1
        })
    };
    // A daemon spawned anew holds none of the agent-device leases an earlier run made: once
    // start-up has run, their simlock leases end, their devices freed (an attached daemon may
    // still hold them).
    let spawned_front = agent_device
        .as_ref()
        .filter(|_| options.agent_device_attach.is_none())
        .map(|a| a.front.clone());
    // Only a daemon the host supervises dies and is restarted with leases lost.
    if let Some(agent_device) = agent_device
        .as_ref()
        .filter(|_| options.agent_device_attach.is_none())
    {
        end_lost_leases(agent_device, &worker);
    }
    let uplink = match options.startup_hold {
        None => {
            worker
                .start(&running.base.gate)
                .map_err(|e| StartError::Domain(format!("start-up failed: {}", e.message)))?;
            running.started();
            end_earlier_daemons_leases(spawned_front, &worker);
            dial(&running)
        }
        Some(hold) => {
            let uplink = dial(&running);
            let (held, gate) = (worker.clone(), running.base.gate.clone());
            let (bus, version) = (running.base.bus.clone(), running.base.version.clone());
            tokio::spawn(async move {
                hold.cancelled().await;
                match held.start(&gate) {
                    Ok(()) => {
                        bus.emit(
                            EventModule::Daemon,
                            &Event::DaemonStarted {
                                version,
                                mode: Mode::Worker,
                            },
                        );
                        end_earlier_daemons_leases(spawned_front, &held);
                    }
                    Err(e) => tracing::warn!(error = %e.message, "start-up failed"),
                }
            });
            uplink
        }
    };
    Ok(RunningWorker {
        running,
        worker,
        uplink,
        agent_device,
        uplink_stop,
    })
}

/// With the `front` of a daemon this worker spawned, ends the simlock leases of the earlier
/// daemon's agent-device leases among the worker's ([`Front::end_earlier_daemons_leases`]).
fn end_earlier_daemons_leases(front: Option<Front>, worker: &Worker) {
    let Some(front) = front else {
        return;
    };
    let leases = worker.leases();
    tokio::spawn(async move {
        let ended = front.end_earlier_daemons_leases(&leases).await;
        if !ended.is_empty() {
            tracing::info!(
                count = ended.len(),
                "ended the simlock leases of an earlier agent-device daemon's leases"
            );
        }
    });
}

/// Ends, each time the host restarts a daemon that died, the simlock leases of the
/// agent-device leases it took with it ([`Front::end_lost_leases`]): their devices go back to
/// the queue at once, and each owner's next call answers `LEASE_ENDED_BY_HOST` (ADR 0028). The
/// task ends with the host's supervision (the stream of lost leases ends).
fn end_lost_leases(agent_device: &AgentDevice, worker: &Arc<Worker>) {
    let Some(mut lost) = agent_device.host.lost_leases() else {
        return;
    };
    let (front, worker) = (agent_device.front.clone(), Arc::downgrade(worker));
    tokio::spawn(async move {
        while let Some(leases) = lost.recv().await {
            let Some(held) = worker.upgrade().map(|w| w.leases()) else {
                return;
            };
            let ended = front.end_lost_leases(&leases, &held).await;
            if !ended.is_empty() {
                tracing::info!(
                    count = ended.len(),
                    "ended the simlock leases of a restarted agent-device daemon's leases"
                );
            }
        }
    });
}

impl RunningWorker {
    /// Stops the worker: the front's waiting allocates, the uplink, then the hosts, then the
    /// agent-device daemon. Leases stay committed.
    pub async fn stop(self, reason: &str) {
        if let Some(agent_device) = &self.agent_device {
            agent_device.front.stop().await;
        }
        self.uplink_stop.cancel();
        self.worker.shutdown();
        self.running.stop(reason).await;
        self.worker.close_drivers().await;
        if let Some(agent_device) = &self.agent_device {
            agent_device.host.stop().await;
        }
    }
}
