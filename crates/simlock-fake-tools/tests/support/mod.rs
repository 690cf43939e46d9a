//! A worker on a fake machine: the real composition (`simlock_worker::start`) with the real
//! drivers, pointed at the fake tools; clients over its socket; waits bounded and on events.

#![allow(dead_code, reason = "each test file uses part of the rig")]

use std::path::PathBuf;
use std::time::Duration;

use simlock_client::{Client, ConnectOptions, EventFollow, FollowItem, LeaseNotice, LeaseNotices};
use simlock_contract::model::{DeviceAccess, DeviceState, EventEnvelope, LeaseGrant, Platform};
use simlock_contract::ops::{LeaseRequestInput, ListKind, ListOutput};
use simlock_contract::{ContractError, Operation};
use simlock_core::config::CapacityStrategy;
use simlock_daemon::home::Home;
use simlock_drivers::{AndroidDriverChoice, IosDriverChoice};
use simlock_fake_tools::{FakeMachine, Profile, Tools};
use simlock_worker::WorkerConfig;
use simlock_worker::{RunningWorker, WorkerOptions};
use tempfile::TempDir;

/// The bound on every wait: long for a loaded 2-core machine, short enough to fail a hang.
pub(crate) const PATIENCE: Duration = Duration::from_secs(240);

/// The fake binaries of this package.
pub(crate) fn tools() -> Tools {
    Tools {
        xcrun: env!("CARGO_BIN_EXE_xcrun").into(),
        adb: env!("CARGO_BIN_EXE_adb").into(),
        emulator: env!("CARGO_BIN_EXE_emulator").into(),
        avdmanager: env!("CARGO_BIN_EXE_avdmanager").into(),
    }
}

/// A port nobody listens on now.
pub(crate) fn free_port() -> u16 {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    l.local_addr().unwrap().port()
}

/// An even console-port window of 64 ports that no other test process is likely to pick.
fn console_window() -> (u16, u16) {
    let seed = u64::from(std::process::id())
        .wrapping_mul(2_654_435_761)
        .wrapping_add(u64::from(free_port()));
    // Below Linux's ephemeral range (32768+), where outgoing connections take their ports.
    let base = 20_000 + u16::try_from((seed % 11_000) & !1).unwrap();
    (base, base + 62)
}

/// A worker (started or not) on its own fake machine.
pub(crate) struct Rig {
    pub(crate) worker: Option<RunningWorker>,
    pub(crate) machine: FakeMachine,
    pub(crate) home: Home,
    pub(crate) config: WorkerConfig,
    /// Last: the directory goes after everything in it.
    pub(crate) dir: TempDir,
}

impl Rig {
    /// A rig whose `platform` is served by its real driver over the fakes (the other platform
    /// is virtual).
    pub(crate) fn new(platform: Platform) -> Self {
        let dir = tempfile::tempdir().unwrap();
        let machine =
            FakeMachine::create(&dir.path().join("machine"), &tools(), &Profile::default());
        let home = Home::at(dir.path().join("home"));
        let mut config = WorkerConfig::default();
        config.core.capacity.strategy = CapacityStrategy::Fixed;
        config.core.capacity.max_running = 8;
        config.core.health.probe_interval_ms = 100;
        config.core.health.recovery_backoff_ms = 50;
        config.core.quarantine.retry_backoff_ms = 100;
        config.core.quarantine.max_retry_backoff_ms = 400;
        config.core.quarantine.max_retries = 2;
        config.drivers.ios.driver = IosDriverChoice::Virtual;
        config.drivers.android.driver = AndroidDriverChoice::Virtual;
        match platform {
            Platform::Ios => {
                config.drivers.ios.driver = IosDriverChoice::Simctl;
                config.drivers.ios.xcrun = machine.xcrun().display().to_string();
                config.drivers.ios.call_timeout_ms = 60_000;
                config.drivers.ios.boot_timeout_ms = 120_000;
            }
            Platform::Android => {
                let (min, max) = console_window();
                config.drivers.android.driver = AndroidDriverChoice::AndroidSdk;
                config.drivers.android.sdk_root = Some(machine.sdk_root().display().to_string());
                config.drivers.android.adb_server_port = free_port();
                config.drivers.android.console_port_min = min;
                config.drivers.android.console_port_max = max;
                config.drivers.android.call_timeout_ms = 60_000;
                config.drivers.android.boot_timeout_ms = 120_000;
                config.drivers.android.boot_poll_ms = 20;
            }
        }
        Self {
            dir,
            machine,
            home,
            config,
            worker: None,
        }
    }

    /// Starts the worker.
    pub(crate) async fn start(&mut self) {
        let options = WorkerOptions::new(self.home.clone(), self.config.clone());
        self.worker = Some(simlock_worker::start(options).await.unwrap());
    }

    /// Stops the worker gracefully.
    pub(crate) async fn stop(&mut self) {
        if let Some(w) = self.worker.take() {
            w.stop("test").await;
        }
    }

    /// simlock's device set.
    pub(crate) fn device_set(&self) -> PathBuf {
        self.home.root().join("devices/ios")
    }

    /// simlock's AVD home.
    pub(crate) fn avd_home(&self) -> PathBuf {
        self.home.root().join("devices/android")
    }

    /// A client over the socket as `principal`.
    pub(crate) async fn agent(&self, principal: &str) -> Client {
        let options = ConnectOptions::default().principal(principal);
        Client::connect_home(self.home.root(), options)
            .await
            .unwrap()
    }

    /// An admin client over the socket.
    pub(crate) async fn admin(&self) -> Client {
        let secret = simlock_client::client::admin_secret_in(self.home.root()).unwrap();
        let options = ConnectOptions::default()
            .principal("operator")
            .credential(secret);
        Client::connect_home(self.home.root(), options)
            .await
            .unwrap()
    }

    /// Leases a device of `platform` for `requester` (as its own principal).
    pub(crate) async fn lease(
        &self,
        requester: &str,
        platform: Platform,
    ) -> Result<LeaseGrant, ContractError> {
        let client = self.agent(requester).await;
        within(
            "a lease",
            client.request_lease(
                LeaseRequestInput::for_platform(platform),
                |_| {},
                std::future::pending(),
            ),
        )
        .await
    }

    /// The worker's devices (admin view).
    pub(crate) async fn devices(&self) -> Vec<simlock_contract::model::Device> {
        match self.admin().await.list(ListKind::Devices).await.unwrap() {
            ListOutput::Devices(d) => d,
            other => panic!("not devices: {other:?}"),
        }
    }
}

impl Drop for Rig {
    fn drop(&mut self) {
        // The machine's drop kills whatever fake process is left (emulators outlive a worker).
        self.machine.kill_all();
    }
}

/// `future` within [`PATIENCE`], or the test fails naming `what`.
pub(crate) async fn within<T>(what: &str, future: impl Future<Output = T>) -> T {
    tokio::time::timeout(PATIENCE, future)
        .await
        .unwrap_or_else(|_| panic!("waited {PATIENCE:?} for {what}"))
}

/// Events as they happen (admin).
pub(crate) struct Events {
    follow: EventFollow,
    _client: Client,
}

impl Events {
    pub(crate) async fn follow(rig: &Rig) -> Self {
        let client = rig.admin().await;
        let follow = client.follow_events().await.unwrap();
        Self {
            follow,
            _client: client,
        }
    }

    /// The next event named `name` whose payload satisfies `pred`.
    pub(crate) async fn wait(
        &mut self,
        name: &str,
        pred: impl Fn(&EventEnvelope) -> bool,
    ) -> EventEnvelope {
        within(&format!("event {name}"), async {
            loop {
                match self.follow.next().await {
                    Some(Ok(FollowItem::Event(e))) if e.event == name && pred(&e) => return e,
                    Some(Ok(_)) => {}
                    Some(Err(e)) => panic!("the event stream failed: {e}"),
                    None => panic!("the event stream ended"),
                }
            }
        })
        .await
    }
}

/// The next lease notice.
pub(crate) async fn next_notice(notices: &mut LeaseNotices) -> LeaseNotice {
    within("a lease notice", notices.next())
        .await
        .unwrap()
        .unwrap()
}

/// The iOS access of a grant.
pub(crate) fn ios_access(grant: &LeaseGrant) -> (String, String) {
    match grant.device.access.clone().unwrap() {
        DeviceAccess::IosSimulator { udid, device_set } => (udid, device_set),
        other => panic!("not a simulator: {other:?}"),
    }
}

/// The Android access of a grant.
pub(crate) fn android_access(grant: &LeaseGrant) -> (String, u16, String) {
    match grant.device.access.clone().unwrap() {
        DeviceAccess::AndroidEmulator {
            serial,
            adb_server_port,
            avd_name,
        } => (serial, adb_server_port, avd_name),
        other => panic!("not an emulator: {other:?}"),
    }
}

/// Waits until the worker's device `id` is in `state`.
pub(crate) async fn wait_state(rig: &Rig, events: &mut Events, id: &str, state: DeviceState) {
    loop {
        if rig
            .devices()
            .await
            .iter()
            .any(|d| d.id.as_str() == id && d.state == state)
        {
            return;
        }
        // Any device event may be the change; then look again.
        within(&format!("device {id} to be {state:?}"), async {
            loop {
                if let Some(Ok(FollowItem::Event(e))) = events.follow.next().await
                    && e.event.starts_with("device.")
                {
                    return;
                }
            }
        })
        .await;
    }
}

/// The name of an operation, for messages.
pub(crate) fn op<O: Operation>() -> &'static str {
    O::NAME
}
