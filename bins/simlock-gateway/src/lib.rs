//! The gateway, composed: the daemon's parts, the fleet, and the uplink route. The binary and
//! the in-process fleet tests both start it here.

mod agent_device;

use std::sync::{Arc, LazyLock};
use std::time::Duration;

use agent_device_front::placements::DbPlacements;
use agent_device_front::{AgentDeviceConfig, Front, FrontOptions};

use simlock_contract::model::{LeaseLimits, Mode};
use simlock_contract::ops::ConfigView;
use simlock_daemon::clock::SharedClock;
use simlock_daemon::config::{self, ConfigError, DaemonConfig, Loaded, Sections};
use simlock_daemon::home::Home;
use simlock_daemon::http::Mount;
use simlock_daemon::runtime::{Base, Running, StartError};
use simlock_fleet::uplink::UplinkMount;
use simlock_fleet::{Fleet, FleetConfig, FleetParts, FleetTiming, handlers};
use simlock_relay_gateway::{GatewayRelay, RelayOptions};

/// Every configuration section of simlock, as a gateway registers them: those it reads (the
/// fleet's, the agent-device front's) and those only a worker reads, so their keys are warned
/// about as a worker's. The worker registers the same list.
pub fn sections() -> &'static Sections {
    // Built once: its key tables are built at their first use and kept (see `Sections`).
    static SECTIONS: LazyLock<Sections> = LazyLock::new(|| {
        simlock_core::CoreConfig::register(Sections::new())
            .with::<AgentDeviceConfig>()
            .with::<FleetConfig>()
            .with::<simlock_drivers::DriversConfig>()
    });
    &SECTIONS
}

/// A gateway's configuration: the daemon's own section and the sections of the crates a gateway
/// composes, each typed by the crate that reads it.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct GatewayConfig {
    /// The daemon's own section (`lease`, `http`, `log`, `eventBuffer`).
    pub daemon: DaemonConfig,
    /// `agentDevice.*` (the front's).
    pub agent_device: AgentDeviceConfig,
    /// The fleet's `gateway.*`.
    pub fleet: FleetConfig,
}

impl GatewayConfig {
    /// The sections of `loaded` (loaded with [`sections`]).
    ///
    /// # Errors
    /// A section that was not registered.
    pub fn from_loaded(loaded: &Loaded) -> Result<Self, ConfigError> {
        Ok(Self {
            daemon: loaded.config.clone(),
            agent_device: loaded.section()?,
            fleet: loaded.section()?,
        })
    }

    /// `config.get`'s answer.
    pub fn view(&self) -> ConfigView {
        let values = [
            config::section_value(&self.agent_device),
            config::section_value(&self.fleet),
        ];
        config::view(&self.daemon, sections(), &values, Mode::Gateway)
    }
}

/// What a gateway is started with.
#[derive(Debug, Clone)]
pub struct GatewayOptions {
    /// Its home.
    pub home: Home,
    /// Its configuration (already loaded and validated).
    pub config: GatewayConfig,
    /// Its version.
    pub version: String,
    /// Time, for tests; the system's otherwise.
    pub clock: Option<SharedClock>,
    /// Timing of the fleet, for tests; from the configuration otherwise.
    pub timing: Option<FleetTiming>,
    /// The relay's deadline, for tests; 330 000 ms otherwise.
    pub relay_deadline: Option<Duration>,
    /// The clock the agent-device front's memory of dropped leases reads, for tests that move
    /// it; the daemon's otherwise.
    pub agent_device_clock: Option<SharedClock>,
}

impl GatewayOptions {
    /// Options with the given home and configuration.
    pub fn new(home: Home, config: GatewayConfig) -> Self {
        Self {
            home,
            config,
            version: env!("CARGO_PKG_VERSION").to_owned(),
            clock: None,
            timing: None,
            relay_deadline: None,
            agent_device_clock: None,
        }
    }
}

/// A gateway that serves.
#[derive(Debug)]
pub struct RunningGateway {
    /// The daemon.
    pub running: Running,
    /// The fleet.
    pub fleet: Arc<Fleet>,
    /// The relay to the workers' relay targets (its callers, and tests, use it in-process).
    pub relay: GatewayRelay,
    /// The `/v1/agent-device` front, when `agentDevice.enabled`.
    pub agent_device: Option<Front>,
    stop: tokio_util::sync::CancellationToken,
}

/// Starts a gateway.
///
/// # Errors
/// [`StartError`].
pub async fn start(options: GatewayOptions) -> Result<RunningGateway, StartError> {
    let timing = options
        .timing
        .unwrap_or_else(|| FleetTiming::from_config(&options.config.fleet));
    let config_view = options.config.view();
    let agent_device_config = options.config.agent_device.clone();
    let base = Base::open(
        options.home,
        options.config.daemon,
        Mode::Gateway,
        options.version,
        options.clock,
    )?;
    let limits = LeaseLimits {
        default_ttl_ms: base.config.lease.default_ttl_ms,
        max_ttl_ms: base.config.lease.max_ttl_ms,
    };
    let fleet = Fleet::start(FleetParts {
        gateway_id: base.instance_id.clone(),
        limits,
        max_waiting: base.config.lease.max_waiting,
        timing,
        db: base.db.clone(),
        bus: base.bus.clone(),
        clock: base.clock.clone(),
        presence: base.presence.clone(),
    })?;
    let mut router = base.router();
    handlers::register(&mut router, &fleet, &base.gate, config_view, &base.version);
    simlock_daemon::pipeline::check_complete(&router, &simlock_daemon::pipeline::all_operations())
        .map_err(StartError::Domain)?;
    let uplink: Arc<dyn Mount> = UplinkMount::new(fleet.clone(), base.tokens.clone());
    simlock_fleet::metrics::register_metrics(&base.metrics, &fleet);
    let relay = GatewayRelay::new(
        fleet.clone(),
        RelayOptions {
            deadline: options
                .relay_deadline
                .unwrap_or(simlock_relay_gateway::DEFAULT_DEADLINE),
            stall_timeout: timing.link_stall_timeout,
        },
    );
    let stop = tokio_util::sync::CancellationToken::new();
    let (tokens, max_ttl_ms) = (base.tokens.clone(), base.config.lease.max_ttl_ms);
    let link = if agent_device_config.enabled {
        let port = agent_device::GatewayFleetPort::new(fleet.clone(), relay.clone());
        let store = Arc::new(DbPlacements::open(base.db.clone())?);
        let clock = options
            .agent_device_clock
            .clone()
            .unwrap_or_else(|| base.clock.clone());
        Some(agent_device::relay_link(
            &fleet,
            port,
            store,
            Duration::from_millis(max_ttl_ms),
            clock,
            &stop,
        ))
    } else {
        None
    };
    let mut front = None;
    let running = base
        .serve_with(
            router,
            simlock_daemon::runtime::Listen::SocketAndHttp,
            |pipeline| {
                let mut mounts = vec![uplink];
                if let Some(link) = link {
                    let built = Front::new(FrontOptions {
                        link,
                        pipeline: pipeline.clone(),
                        tokens,
                        lease_ttl_cap_ms: agent_device_config.lease_ttl_cap_ms,
                        max_ttl_ms,
                        queue_wait_ms: agent_device_config.queue_wait_ms,
                    });
                    // Before it serves: a holder's release of the same lease arriving first
                    // finds the kept one taken up.
                    built.resume_releases();
                    mounts.push(built.mount());
                    front = Some(built);
                }
                mounts
            },
        )
        .await?;
    running.started();
    Ok(RunningGateway {
        running,
        fleet,
        relay,
        agent_device: front,
        stop,
    })
}

impl RunningGateway {
    /// Stops the gateway: the agent-device front's waiting allocates (their lease requests end
    /// cancelled) and renewals, then the fleet (waiting requests fail, uplinks close), then the
    /// hosts.
    pub async fn stop(self, reason: &str) {
        if let Some(front) = &self.agent_device {
            front.stop().await;
        }
        self.stop.cancel();
        self.fleet.stop().await;
        self.running.stop(reason).await;
    }
}
