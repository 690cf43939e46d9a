//! The worker, composed: the daemon's parts, the worker domain, the hosts and the uplink to a
//! gateway. The binary and the in-process fleet tests both start it here.

use std::sync::Arc;

use simlock_contract::event::{Event, EventModule};
use simlock_contract::model::Mode;
use simlock_core::{SystemFacts, Worker, WorkerParts};
use simlock_daemon::clock::SharedClock;
use simlock_daemon::config::Config;
use simlock_daemon::home::Home;
use simlock_daemon::runtime::{Base, Running, StartError};
use simlock_daemon::uplink::{self, UplinkConfig, UplinkState};
use simlock_relay_worker::RelayTargets;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

/// What a worker is started with.
#[derive(Clone)]
pub struct WorkerOptions {
    /// Its home.
    pub home: Home,
    /// Its configuration (already loaded and validated).
    pub config: Config,
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
    pub fn new(home: Home, config: Config) -> Self {
        Self {
            home,
            config,
            version: env!("CARGO_PKG_VERSION").to_owned(),
            clock: None,
            system: None,
            relay_targets: RelayTargets::new(),
            startup_hold: None,
        }
    }
}

/// A worker that serves.
pub struct RunningWorker {
    /// The daemon.
    pub running: Running,
    /// The worker domain.
    pub worker: Arc<Worker>,
    /// How the uplink stands, when a gateway is configured.
    pub uplink: Option<watch::Receiver<UplinkState>>,
    uplink_stop: CancellationToken,
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
    let base = Base::open(
        options.home,
        options.config,
        Mode::Worker,
        options.version,
        options.clock,
    )?;
    let mut parts = WorkerParts::new(
        base.config.clone(),
        base.db.clone(),
        base.clock.clone(),
        base.bus.clone(),
        base.presence.clone(),
        base.instance_id.clone(),
        base.version.clone(),
    );
    if let Some(system) = options.system {
        parts.system = system;
    }
    // Which driver serves each platform (logged once each); the virtual ones when asked.
    parts.drivers = simlock_drivers::select(&base.config, base.home.root()).await;
    let worker = Worker::new(parts).map_err(|e| StartError::Domain(e.to_string()))?;
    let mut router = base.router();
    simlock_core::register(&mut router, &worker, base.gate.clone());
    simlock_relay_worker::register(&mut router, options.relay_targets);
    simlock_daemon::pipeline::check_complete(&router, &simlock_daemon::pipeline::all_operations())
        .map_err(StartError::Domain)?;
    let http = base.config.http.enabled.unwrap_or(false);
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
    simlock_core::register_metrics(&base.metrics, &worker);
    let running = base.serve(router, http, Vec::new()).await?;
    let uplink_stop = CancellationToken::new();
    let dial = |running: &Running| {
        gateway
            .clone()
            .map(|config| uplink::run(config, running.pipeline.clone(), uplink_stop.clone()).1)
    };
    let uplink = match options.startup_hold {
        None => {
            worker
                .start(&running.base.gate)
                .map_err(|e| StartError::Domain(format!("start-up failed: {}", e.message)))?;
            running.started();
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
        uplink_stop,
    })
}

impl RunningWorker {
    /// Stops the worker: the uplink, then the hosts. Leases stay committed.
    pub async fn stop(self, reason: &str) {
        self.uplink_stop.cancel();
        self.worker.shutdown();
        self.running.stop(reason).await;
        self.worker.close_drivers().await;
    }
}
