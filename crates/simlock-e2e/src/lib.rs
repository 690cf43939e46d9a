//! A harness for in-process fleet tests: a real gateway and real workers, each with its own
//! temporary home, talking over loopback WebSockets and unix sockets exactly as in production.
//!
//! Waits are on events (view changes), each bounded by [`PATIENCE`] so a broken build fails
//! instead of hanging.

#![allow(
    clippy::expect_used,
    clippy::panic,
    reason = "a test harness fails the test by panicking"
)]

pub mod agent_device;
pub mod relay;

use std::path::Path;
use std::time::Duration;

use serde_json::{Value, json};
use simlock_contract::model::{Connection, WorkerView};
use simlock_contract::{ContractError, Hello, PROTOCOL_RANGE};
use simlock_core::config::CapacityStrategy;
use simlock_daemon::home::Home;
use simlock_drivers::{AndroidDriverChoice, IosDriverChoice};
use simlock_gateway::{GatewayConfig, GatewayOptions, RunningGateway};
use simlock_wire::{Transport, Unsolicited, WireClient};
use simlock_worker::{RunningWorker, WorkerConfig, WorkerOptions};
use tempfile::TempDir;

/// The bound on every wait in a test: long enough for a loaded 2-core machine, short enough to
/// fail a hang.
pub const PATIENCE: Duration = Duration::from_secs(60);

/// A worker configuration for tests: fixed capacity, quick virtual devices (on both platforms,
/// whatever tools the machine has).
pub fn worker_config(max_running: u32) -> WorkerConfig {
    let mut config = WorkerConfig::default();
    config.drivers.ios.driver = IosDriverChoice::Virtual;
    config.drivers.android.driver = AndroidDriverChoice::Virtual;
    config.core.capacity.strategy = CapacityStrategy::Fixed;
    config.core.capacity.max_running = max_running;
    config.core.virtual_devices.provision_ms = 20;
    config.core.virtual_devices.boot_ms = 20;
    config.core.virtual_devices.reclaim_ms = 10;
    config
}

/// A gateway configuration for tests: HTTP on a port the system picks when it binds (a port
/// probed free and bound later could be taken in between by another test's connection).
pub fn gateway_config() -> GatewayConfig {
    let mut config = GatewayConfig::default();
    config.daemon.http.port = 0;
    config
}

/// A running test fleet.
pub struct TestFleet {
    /// The gateway.
    pub gateway: Option<RunningGateway>,
    /// The workers, in start order.
    pub workers: Vec<Option<RunningWorker>>,
    /// A join token for workers.
    pub join_token: String,
    /// The certificates of a gateway that serves TLS ([`TestFleet::start_tls`]).
    pub tls: Option<FleetTls>,
    dir: TempDir,
}

/// A TLS gateway's certificates, made at test time: a CA, and a leaf for `localhost` and
/// `127.0.0.1` that the gateway serves (`http.tls.*`). Its workers trust the CA (`gateway.caFile`).
pub struct FleetTls {
    /// The CA.
    pub ca: simlock_tls::testing::TestCa,
    /// The CA's certificate file.
    pub ca_file: std::path::PathBuf,
    /// The gateway's certificate and key files.
    pub files: simlock_tls::testing::LeafFiles,
}

impl FleetTls {
    /// A CA and a leaf for `localhost` and `127.0.0.1`, written into `dir`.
    pub fn new(dir: &Path) -> Self {
        std::fs::create_dir_all(dir).expect("the certificate directory");
        let ca = simlock_tls::testing::TestCa::new("simlock e2e CA");
        let files = ca.leaf(&["localhost", "127.0.0.1"]).write(dir);
        let ca_file = ca.write(&dir.join("ca.pem"));
        Self { ca, ca_file, files }
    }

    /// `config` serving TLS with these files.
    pub fn serve(&self, config: &mut GatewayConfig) {
        config.daemon.http.tls.cert_file = Some(self.files.cert.display().to_string());
        config.daemon.http.tls.key_file = Some(self.files.key.display().to_string());
    }
}

pub use simlock_test_support::fake_worker::{fake_worker, greet_gateway};

/// A client session on a daemon's unix socket.
pub struct Session {
    /// The client.
    pub client: WireClient,
    /// Its pushes that belong to no call.
    pub pushes: Unsolicited,
}

impl Session {
    /// Calls `op`.
    ///
    /// # Errors
    /// The daemon's error.
    pub async fn call(&self, op: &str, payload: Value) -> Result<Value, ContractError> {
        tokio::time::timeout(PATIENCE, self.client.call_value(op, payload))
            .await
            .expect("the daemon answered within the bound")
    }
}

/// Opens a session on the socket at `path` as `principal`, admin when `admin_home` names the
/// daemon's home (its admin secret is read from there).
pub async fn session(path: &Path, principal: &str, admin_home: Option<&Home>) -> Session {
    let stream = tokio::net::UnixStream::connect(path)
        .await
        .expect("the daemon's socket accepts");
    let (r, w) = stream.into_split();
    let (client, pushes) = WireClient::new(Transport::client_io(r, w));
    let credential = admin_home
        .map(|home| std::fs::read_to_string(home.admin_token()).expect("the admin secret exists"));
    let hello = Hello {
        client_version: Some("e2e".into()),
        protocol_version: None,
        protocol_range: Some(PROTOCOL_RANGE),
        principal: Some(principal.into()),
        credential,
    };
    client.hello(&hello).await.expect("hello");
    Session { client, pushes }
}

impl TestFleet {
    /// A gateway with `config`, and a join token minted on it.
    pub async fn start(config: GatewayConfig) -> Self {
        Self::start_with(config, |_| {}).await
    }

    /// A gateway with `config` and its fleet timing changed by `tune` (short timeouts for the
    /// tests that wait on them), and a join token minted on it.
    pub async fn start_with(
        config: GatewayConfig,
        tune: impl FnOnce(&mut simlock_fleet::FleetTiming),
    ) -> Self {
        Self::start_full(config, tune, |_| {}, false).await
    }

    /// As [`Self::start_with`], with the gateway's options changed by `customize` too.
    pub async fn start_customized(
        config: GatewayConfig,
        tune: impl FnOnce(&mut simlock_fleet::FleetTiming),
        customize: impl FnOnce(&mut GatewayOptions),
    ) -> Self {
        Self::start_full(config, tune, customize, false).await
    }

    /// A gateway with `config` that serves HTTPS and WSS with certificates made here
    /// ([`FleetTls`]); its workers dial `wss://localhost:<port>` trusting the CA.
    pub async fn start_tls(config: GatewayConfig) -> Self {
        Self::start_full(config, |_| {}, |_| {}, true).await
    }

    async fn start_full(
        mut config: GatewayConfig,
        tune: impl FnOnce(&mut simlock_fleet::FleetTiming),
        customize: impl FnOnce(&mut GatewayOptions),
        tls: bool,
    ) -> Self {
        let dir = tempfile::tempdir().expect("a temporary directory");
        let tls = tls.then(|| FleetTls::new(&dir.path().join("pki")));
        if let Some(tls) = &tls {
            tls.serve(&mut config);
        }
        let home = Home::at(dir.path().join("gateway"));
        let mut options = GatewayOptions::new(home.clone(), config);
        let mut timing = simlock_fleet::FleetTiming::from_config(&options.config.fleet);
        tune(&mut timing);
        options.timing = Some(timing);
        customize(&mut options);
        let gateway = simlock_gateway::start(options)
            .await
            .expect("the gateway starts");
        let admin = session(&gateway.running.socket_path(), "operator", Some(&home)).await;
        let token = admin
            .call("token.create", json!({"role": "worker", "label": "e2e"}))
            .await
            .expect("a join token");
        let join_token = token["secret"].as_str().expect("a secret").to_owned();
        Self {
            gateway: Some(gateway),
            workers: Vec::new(),
            join_token,
            tls,
            dir,
        }
    }

    /// The gateway.
    pub fn gateway(&self) -> &RunningGateway {
        self.gateway.as_ref().expect("the gateway runs")
    }

    /// The gateway's home.
    pub fn gateway_home(&self) -> Home {
        Home::at(self.dir.path().join("gateway"))
    }

    /// The gateway's uplink base URL: `ws://127.0.0.1:<port>`, or `wss://localhost:<port>` for a
    /// TLS gateway.
    pub fn gateway_url(&self) -> String {
        let addr = self
            .gateway()
            .running
            .http_addr()
            .expect("the gateway serves HTTP");
        if self.tls.is_some() {
            format!("wss://localhost:{}", addr.port())
        } else {
            format!("ws://{addr}")
        }
    }

    /// Starts worker number `self.workers.len()` with `config`, joined to the gateway, and waits
    /// until the gateway lists it connected with its catalog read.
    pub async fn add_worker(&mut self, config: WorkerConfig) -> usize {
        let n = self.workers.len();
        self.join_worker(n, config, |_| {}, true).await;
        n
    }

    /// Starts worker `n` on its home (a new one when `n` is the next number), joined to the
    /// gateway, with its options changed by `customize`; waits until the gateway lists it
    /// connected, and with `catalog` until it has read its catalog too.
    pub async fn join_worker(
        &mut self,
        n: usize,
        mut config: WorkerConfig,
        customize: impl FnOnce(&mut WorkerOptions),
        catalog: bool,
    ) {
        config.daemon.gateway.url = Some(self.gateway_url());
        config.daemon.gateway.token = Some(self.join_token.clone());
        if let Some(tls) = &self.tls {
            config.daemon.gateway.ca_file = Some(tls.ca_file.display().to_string());
        }
        config.daemon.gateway.label = Some(format!("worker-{n}"));
        let mut options = WorkerOptions::new(self.worker_home(n), config);
        customize(&mut options);
        let worker = simlock_worker::start(options)
            .await
            .expect("the worker starts");
        let id = worker.running.base.instance_id.clone();
        if n == self.workers.len() {
            self.workers.push(Some(worker));
        } else {
            self.workers[n] = Some(worker);
        }
        self.wait_for(|views| {
            views.iter().any(|v| {
                v.id == id
                    && v.connection == Connection::Connected
                    && (!catalog || v.catalog_read_at.is_some())
            })
        })
        .await;
    }

    /// Worker `n`.
    pub fn worker(&self, n: usize) -> &RunningWorker {
        self.workers[n].as_ref().expect("the worker runs")
    }

    /// Worker `n`'s instance id.
    pub fn worker_id(&self, n: usize) -> String {
        self.worker(n).running.base.instance_id.clone()
    }

    /// Worker `n`'s home.
    pub fn worker_home(&self, n: usize) -> Home {
        Home::at(self.dir.path().join(format!("worker-{n}")))
    }

    /// Waits until the gateway's views satisfy `done`.
    pub async fn wait_for(&self, done: impl Fn(&[WorkerView]) -> bool) {
        self.wait_until(|fleet| done(&fleet.views())).await;
    }

    /// Waits until the gateway lists worker `n` connected with a view that shows no lease.
    pub async fn wait_connected_holding_none(&self, n: usize) {
        let id = self.worker_id(n);
        self.wait_for(|views| {
            views.iter().any(|v| {
                v.id == id
                    && v.connection == Connection::Connected
                    && v.leases.as_ref().is_some_and(Vec::is_empty)
            })
        })
        .await;
    }

    /// Waits until the gateway's fleet satisfies `done`.
    pub async fn wait_until(&self, done: impl Fn(&simlock_fleet::Fleet) -> bool) {
        let fleet = self.gateway().fleet.clone();
        let mut changes = fleet.changes();
        let waited = tokio::time::timeout(PATIENCE, async {
            loop {
                if done(&fleet) {
                    return;
                }
                assert!(
                    changes.changed().await.is_ok(),
                    "the fleet went away before it reached the expected state"
                );
            }
        })
        .await;
        assert!(
            waited.is_ok(),
            "the fleet did not reach the expected state; views: {:#?}",
            fleet.views()
        );
    }

    /// A session on the gateway's socket as `principal` (an agent).
    pub async fn agent(&self, principal: &str) -> Session {
        session(&self.gateway().running.socket_path(), principal, None).await
    }

    /// An admin session on the gateway's socket.
    pub async fn operator(&self) -> Session {
        session(
            &self.gateway().running.socket_path(),
            "operator",
            Some(&self.gateway_home()),
        )
        .await
    }

    /// Stops worker `n` (its leases stay on its disk).
    pub async fn stop_worker(&mut self, n: usize) {
        if let Some(worker) = self.workers[n].take() {
            worker.stop("test").await;
        }
    }

    /// Stops worker `n` and waits until the gateway lists it away.
    pub async fn stop_worker_seen_away(&mut self, n: usize) {
        let id = self.worker_id(n);
        self.stop_worker(n).await;
        self.wait_for(|views| {
            views
                .iter()
                .any(|v| v.id == id && v.connection == Connection::Disconnected)
        })
        .await;
    }

    /// Stops the gateway; its workers keep running (and dialling).
    pub async fn stop_gateway(&mut self) {
        if let Some(gateway) = self.gateway.take() {
            gateway.stop("test").await;
        }
    }

    /// Stops the gateway and starts it again on the same home and port.
    pub async fn restart_gateway(&mut self, mut config: GatewayConfig) {
        if let Some(tls) = &self.tls {
            tls.serve(&mut config);
        }
        if let Some(gateway) = self.gateway.take() {
            // It comes back where its workers dial.
            if config.daemon.http.port == 0
                && let Some(addr) = gateway.running.http_addr()
            {
                config.daemon.http.port = addr.port();
            }
            gateway.stop("test").await;
        }
        let options = GatewayOptions::new(self.gateway_home(), config);
        self.gateway = Some(
            simlock_gateway::start(options)
                .await
                .expect("the gateway restarts"),
        );
    }

    /// Starts worker `n` again on its home, after [`Self::stop_worker`].
    pub async fn restart_worker(&mut self, n: usize, config: WorkerConfig) {
        self.join_worker(n, config, |_| {}, true).await;
    }

    /// Stops everything.
    pub async fn stop(mut self) {
        for worker in self.workers.iter_mut().filter_map(Option::take) {
            worker.stop("test").await;
        }
        if let Some(gateway) = self.gateway.take() {
            gateway.stop("test").await;
        }
    }
}
