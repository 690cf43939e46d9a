//! The shapes operations and pushes carry: devices, leases, requests, catalogs, capacity,
//! status, worker views, tokens and events.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::ids::{DeviceId, EventId, LeaseId, RequestId, TokenId};
use crate::protocol::ProtocolRange;

/// A device platform.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Platform {
    /// iOS simulators.
    Ios,
    /// Android emulators.
    Android,
}

impl Platform {
    /// Both platforms, in a fixed order.
    pub const ALL: [Self; 2] = [Self::Ios, Self::Android];

    /// The wire name.
    pub const fn as_str(self) -> &'static str {
        match self {
            Self::Ios => "ios",
            Self::Android => "android",
        }
    }

    /// The platform whose wire name is `name`, exactly (`ios`, `android`).
    pub fn from_wire(name: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|p| p.as_str() == name)
    }
}

impl std::fmt::Display for Platform {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// What a device is: platform, model and OS version.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct DeviceSpec {
    /// Its platform.
    pub platform: Platform,
    /// Its model, as the worker's catalog names it.
    pub model: String,
    /// Its OS version (runtime).
    pub os_version: String,
}

/// Where a device is in its life.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DeviceState {
    /// Being created.
    Provisioning,
    /// Created and starting up.
    Booting,
    /// Running and free.
    Ready,
    /// Running and leased.
    Leased,
    /// Being wiped after a lease.
    Reclaiming,
    /// Created but not running.
    Shutdown,
    /// Its reclaim failed: never handed out, retried with backoff, then deleted.
    Quarantined,
    /// Gone.
    Deleted,
}

impl DeviceState {
    /// Whether the device occupies a running slot (ready, leased, reclaiming or quarantined).
    pub const fn is_running(self) -> bool {
        matches!(
            self,
            Self::Ready | Self::Leased | Self::Reclaiming | Self::Quarantined
        )
    }
}

/// A device as a worker reports it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Device {
    /// Its id.
    pub id: DeviceId,
    /// What it is.
    pub spec: DeviceSpec,
    /// Its state.
    pub state: DeviceState,
    /// The driver's own id for it (a UDID, an AVD serial).
    pub driver_device_id: String,
    /// When it was created, ms since the epoch.
    pub created_at: i64,
    /// When its last lease ended.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_lease_ended_at: Option<i64>,
    /// How to reach it, once it has booted.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub access: Option<DeviceAccess>,
    /// Quarantined: the reclaims tried so far.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub quarantine_attempts: Option<u32>,
    /// Quarantined: when the next reclaim is tried, ms since the epoch.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub quarantine_next_retry_at: Option<i64>,
    /// Leased and crashed: the recoveries tried so far.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub recovery_attempts: Option<u32>,
    /// The worker holding it (gateway views only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub worker_id: Option<String>,
    /// The worker holding it, with its label and whether its uplink is up (gateway views
    /// only): the state of a device whose worker is disconnected is the last one it reported.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub worker: Option<WorkerRef>,
}

/// The worker a gateway lease or device lives on.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct WorkerRef {
    /// The worker's id.
    pub id: String,
    /// Its label.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub label: Option<String>,
    /// How its uplink stood when the gateway answered; absent from gateways before this field.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub connection: Option<Connection>,
}

impl WorkerRef {
    /// What to call the worker: its label, else its id.
    pub fn name(&self) -> &str {
        self.label.as_deref().unwrap_or(&self.id)
    }

    /// Whether the gateway said its uplink was down (or its protocol incompatible) when it
    /// answered.
    pub fn is_away(&self) -> bool {
        matches!(
            self.connection,
            Some(Connection::Disconnected | Connection::Incompatible)
        )
    }
}

/// A lease.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct LeaseRecord {
    /// Its id.
    pub id: LeaseId,
    /// The leased device.
    pub device_id: DeviceId,
    /// Who the lease is for (one lease per requester).
    pub requester_id: String,
    /// Who may renew and release it: the principal that asked, or the gateway's `owner`.
    pub owner_id: String,
    /// When it was granted, ms since the epoch.
    pub granted_at: i64,
    /// Its width: each renewal without `ttlMs` extends it by this much.
    pub ttl_ms: u64,
    /// When it expires unless renewed, ms since the epoch.
    pub ttl_deadline: i64,
    /// When it was last renewed (or granted).
    pub last_renewed_at: i64,
    /// How to reach the leased device.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub access: Option<DeviceAccess>,
    /// Whether the requester chose the id.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub id_chosen_by_requester: bool,
    /// The worker it lives on (gateway answers only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub worker: Option<WorkerRef>,
    /// The worker it lives on, as an id (gateway lists only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub worker_id: Option<String>,
}

/// The device part of a grant.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct GrantDevice {
    /// Its id.
    pub id: DeviceId,
    /// The driver's id for it.
    pub driver_device_id: String,
    /// What it is.
    pub spec: DeviceSpec,
    /// How to reach it, when the driver knows (an adb serial, a host:port).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub address: Option<String>,
    /// What the agent needs to reach it with its own tools.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub access: Option<DeviceAccess>,
}

/// What an agent needs to reach its leased device with its own tools. A grant carries it, the
/// lease record keeps it, and [`DeviceAccess::environment`] turns it into the environment that
/// `simlock env` exports and `device.exec` runs tools with.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "kebab-case")]
pub enum DeviceAccess {
    /// A device of the virtual driver: a record; no tool reaches it.
    #[serde(rename_all = "camelCase")]
    Virtual {
        /// Its platform.
        platform: Platform,
        /// The driver's id for it.
        driver_device_id: String,
    },
    /// An iOS simulator in simlock's own device set: every `simctl` call names the set
    /// (`xcrun simctl --set <deviceSet> … <udid>`); outside it, the UDID is unknown.
    #[serde(rename_all = "camelCase")]
    IosSimulator {
        /// The simulator's UDID.
        udid: String,
        /// The device set it lives in (a directory).
        device_set: String,
    },
    /// An Android emulator attached to simlock's own adb server: `adb -P <adbServerPort> -s
    /// <serial> …` (or plain `adb` with the environment, which names both).
    #[serde(rename_all = "camelCase")]
    AndroidEmulator {
        /// The adb serial, `emulator-<console port>`.
        serial: String,
        /// The port of simlock's adb server (never the user's 5037).
        adb_server_port: u16,
        /// The AVD's name.
        avd_name: String,
    },
}

impl DeviceAccess {
    /// The device's platform.
    pub const fn platform(&self) -> Platform {
        match self {
            Self::Virtual { platform, .. } => *platform,
            Self::IosSimulator { .. } => Platform::Ios,
            Self::AndroidEmulator { .. } => Platform::Android,
        }
    }

    /// The driver's id for the device: the UDID, the AVD name, or the virtual id.
    pub fn driver_device_id(&self) -> &str {
        match self {
            Self::Virtual {
                driver_device_id, ..
            } => driver_device_id,
            Self::IosSimulator { udid, .. } => udid,
            Self::AndroidEmulator { avd_name, .. } => avd_name,
        }
    }

    /// How a device tool (adb, simctl, agent-device) names the device: the adb serial, the
    /// UDID, or the virtual id.
    pub fn address(&self) -> &str {
        match self {
            Self::Virtual {
                driver_device_id, ..
            } => driver_device_id,
            Self::IosSimulator { udid, .. } => udid,
            Self::AndroidEmulator { serial, .. } => serial,
        }
    }

    /// The environment that points tools at the device of lease `lease_id`: simlock's own
    /// variables, and the ones the platform's tools read (`ANDROID_ADB_SERVER_PORT` and
    /// `ANDROID_SERIAL` for adb; the device set for `simctl --set`).
    pub fn environment(&self, lease_id: &str, device_id: &DeviceId) -> BTreeMap<String, String> {
        let mut env = BTreeMap::from([
            ("SIMLOCK_LEASE_ID".to_owned(), lease_id.to_owned()),
            ("SIMLOCK_DEVICE_ID".to_owned(), device_id.to_string()),
            (
                "SIMLOCK_DEVICE_UDID".to_owned(),
                self.driver_device_id().to_owned(),
            ),
            (
                "SIMLOCK_PLATFORM".to_owned(),
                self.platform().as_str().to_owned(),
            ),
        ]);
        match self {
            Self::Virtual { .. } => {}
            Self::IosSimulator { device_set, .. } => {
                env.insert("SIMLOCK_IOS_DEVICE_SET".to_owned(), device_set.clone());
            }
            Self::AndroidEmulator {
                serial,
                adb_server_port,
                ..
            } => {
                let port = adb_server_port.to_string();
                env.insert("ANDROID_ADB_SERVER_PORT".to_owned(), port.clone());
                env.insert("ANDROID_SERIAL".to_owned(), serial.clone());
                env.insert("SIMLOCK_ADB_SERVER_PORT".to_owned(), port);
                env.insert("SIMLOCK_ANDROID_SERIAL".to_owned(), serial.clone());
            }
        }
        env
    }
}

/// How long the parts of getting a device took or are expected to take.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct GrantTiming {
    /// Expected provisioning time.
    pub estimated_provision_ms: u64,
    /// Expected boot time.
    pub estimated_boot_ms: u64,
    /// Expected reclaim time.
    pub estimated_reclaim_ms: u64,
    /// Expected time until ready, from the request.
    pub estimated_ready_ms: u64,
}

/// What `lease.request` answers.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct LeaseGrant {
    /// The device.
    pub device: GrantDevice,
    /// Environment variables that point tools at the device.
    pub environment: BTreeMap<String, String>,
    /// The lease.
    pub lease: LeaseRecord,
    /// Timing.
    pub timing: GrantTiming,
}

/// What a request asked for.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct RequestedDevice {
    /// The platform.
    pub platform: Platform,
    /// A model or alias, if one was named.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model: Option<String>,
    /// An exact OS version, if one was named.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub os_version: Option<String>,
    /// Capabilities the serving worker must have.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub requires: Vec<String>,
}

/// Where a waiting request is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum WaitStage {
    /// In the queue.
    Queued,
    /// Picked; a device is being made ready.
    Starting,
}

/// A request that has no lease yet.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct WaitingRequest {
    /// Its id.
    pub id: RequestId,
    /// For whom.
    pub requester_id: String,
    /// What it asks for.
    pub spec: RequestedDevice,
    /// When it arrived, ms since the epoch.
    pub created_at: i64,
    /// Where it is.
    pub stage: WaitStage,
    /// Its 1-based place in the queue.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub queue_position: Option<u32>,
    /// Why a queued one waits, as it was last told (absent from daemons before this field).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub waiting_for: Option<crate::push::WaitingFor>,
    /// The worker it waits on (gateway lists only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub worker_id: Option<String>,
    /// That worker's id, label and how its uplink stands (gateway lists only; absent from
    /// gateways before this field).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub worker: Option<WorkerRef>,
}

/// What one platform offers on a worker (or, on a gateway, across workers).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct PlatformCatalog {
    /// The platform.
    pub platform: Platform,
    /// Model names.
    pub models: Vec<String>,
    /// Runtimes (OS versions).
    pub runtimes: Vec<String>,
    /// The runtime used when a request names none.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub default_runtime: Option<String>,
    /// Which runtimes each model runs.
    pub model_runtimes: BTreeMap<String, Vec<String>>,
    /// Other names each model answers to.
    pub model_aliases: BTreeMap<String, Vec<String>>,
    /// Which workers serve each model (gateway only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model_workers: Option<BTreeMap<String, Vec<String>>>,
    /// Which workers serve each runtime (gateway only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub runtime_workers: Option<BTreeMap<String, Vec<String>>>,
    /// Why the platform cannot be served now (its tools are missing or broken); the entry then
    /// lists no models.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub unavailable: Option<String>,
}

impl PlatformCatalog {
    /// The catalog's own name for `requested` (a model name or alias, ASCII case-insensitive).
    pub fn resolve_model(&self, requested: &str) -> Option<&str> {
        self.models.iter().map(String::as_str).find(|model| {
            model.eq_ignore_ascii_case(requested)
                || self.model_aliases.get(*model).is_some_and(|aliases| {
                    aliases
                        .iter()
                        .any(|alias| alias.eq_ignore_ascii_case(requested))
                })
        })
    }
}

/// Running slots of one platform.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct PlatformCapacity {
    /// Devices running (ready, leased, reclaiming).
    pub running: u32,
    /// The most that may run.
    pub max_running: u32,
    /// Slots held for devices being provisioned or booted.
    pub reserved: u32,
    /// Running devices nobody leases.
    pub warm: u32,
    /// Whether more run than may.
    pub over_limit: bool,
    /// Whether one more device would be refused for RAM.
    pub at_ram_budget: bool,
}

impl PlatformCapacity {
    /// Slots free now: `maxRunning − running − reserved`, at least 0.
    pub const fn free(&self) -> u32 {
        self.max_running
            .saturating_sub(self.running)
            .saturating_sub(self.reserved)
    }
}

/// Running slots across platforms.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct GlobalCapacity {
    /// Devices running.
    pub running: u32,
    /// The most that may run.
    pub max_running: u32,
    /// Reserved slots.
    pub reserved: u32,
    /// Idle running devices.
    pub warm: u32,
    /// Whether more run than may.
    pub over_limit: bool,
}

/// A worker's capacity.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Capacity {
    /// iOS.
    pub ios: PlatformCapacity,
    /// Android.
    pub android: PlatformCapacity,
    /// Both.
    pub global: GlobalCapacity,
}

impl Capacity {
    /// The capacity of one platform.
    pub const fn platform(&self, platform: Platform) -> &PlatformCapacity {
        match platform {
            Platform::Ios => &self.ios,
            Platform::Android => &self.android,
        }
    }
}

/// Whether a worker can serve a capability now.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct CapabilityStatus {
    /// The capability's name.
    pub name: String,
    /// Whether it is available.
    pub available: bool,
    /// Why not, when it is not.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
}

/// Which driver serves a platform on a worker.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum DriverKind {
    /// Devices that exist only as records.
    Virtual,
    /// iOS simulators through `xcrun simctl`.
    Simctl,
    /// Android emulators through `avdmanager`, `emulator` and `adb`.
    AndroidSdk,
}

impl DriverKind {
    /// The wire name.
    pub const fn as_str(self) -> &'static str {
        match self {
            Self::Virtual => "virtual",
            Self::Simctl => "simctl",
            Self::AndroidSdk => "android-sdk",
        }
    }
}

/// Which driver serves one platform of a worker, and whether it can serve now.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct DriverStatus {
    /// The platform.
    pub platform: Platform,
    /// The driver chosen for it.
    pub driver: DriverKind,
    /// Whether it can serve.
    pub available: bool,
    /// Why it was chosen, or why it cannot serve.
    pub reason: String,
}

/// A daemon's health.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Health {
    /// Start-up has not converged yet.
    Starting,
    /// Serving.
    Running,
    /// Start-up failed.
    Failed,
}

/// Which daemon answers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Mode {
    /// A worker owns devices.
    Worker,
    /// A gateway fronts workers.
    Gateway,
}

impl Mode {
    /// The wire name.
    pub const fn as_str(self) -> &'static str {
        match self {
            Self::Worker => "worker",
            Self::Gateway => "gateway",
        }
    }
}

/// The daemon part of `status.get`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct DaemonInfo {
    /// Its health.
    pub health: Health,
    /// Worker or gateway.
    pub mode: Mode,
    /// Its version.
    pub version: String,
    /// Its instance id.
    pub instance_id: String,
}

/// A tool found on the host.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ToolFact {
    /// The platform it serves.
    pub platform: Platform,
    /// Its name.
    pub name: String,
    /// Its version.
    pub version: String,
}

/// Facts about the daemon's machine.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct HostFacts {
    /// OS family.
    pub os: String,
    /// OS version, when known.
    pub os_version: String,
    /// CPU architecture.
    pub arch: String,
    /// Device tools found (at most 32).
    pub tools: Vec<ToolFact>,
}

/// How a worker's uplink stands, as the gateway sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Connection {
    /// Uplink up and the protocol agrees.
    Connected,
    /// Uplink down.
    Disconnected,
    /// Uplink up, but no protocol version in common.
    Incompatible,
}

/// How a worker's own uplink to its gateway stands, as the worker sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum UplinkConnection {
    /// Up: the gateway accepted the worker.
    Connected,
    /// Dialling, or waiting to dial again.
    Connecting,
}

/// A worker's uplink to its gateway (`status.get`'s `uplink`; absent on a gateway and on a worker
/// with no `gateway.url`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct UplinkStatus {
    /// The gateway, as `gateway.url` names it.
    pub gateway: String,
    /// How the uplink stands.
    pub state: UplinkConnection,
    /// Why the last attempt failed or the last uplink ended (only while `connecting`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_error: Option<String>,
    /// When the uplink entered `state`, ms since the epoch.
    pub since: i64,
}

/// The two ranges of an incompatible worker.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct ProtocolPair {
    /// The gateway's range.
    pub gateway: ProtocolRange,
    /// The worker's range.
    pub worker: ProtocolRange,
}

/// The lease limits a worker reported.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct LeaseLimits {
    /// The default width.
    pub default_ttl_ms: u64,
    /// The most a request or renewal may ask.
    pub max_ttl_ms: u64,
}

impl LeaseLimits {
    /// The one `ttlMs` rule, for requests and renewals alike: absent means the default, above
    /// `lease.maxTtlMs` is refused, never clamped. Answers the width.
    ///
    /// # Errors
    /// [`TtlAboveMax`] naming both.
    pub const fn ttl(&self, ttl_ms: Option<u64>) -> Result<u64, TtlAboveMax> {
        let asked = match ttl_ms {
            Some(ttl) => ttl,
            None => self.default_ttl_ms,
        };
        if asked > self.max_ttl_ms {
            return Err(TtlAboveMax {
                asked,
                max: self.max_ttl_ms,
            });
        }
        Ok(asked)
    }
}

/// A `ttlMs` above `lease.maxTtlMs` ([`LeaseLimits::ttl`]); answered `BAD_REQUEST`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error(
    "ttlMs: {asked} ({}) is above lease.maxTtlMs ({max}, {})",
    crate::duration::text(*asked),
    crate::duration::text(*max)
)]
pub struct TtlAboveMax {
    /// The width asked for.
    pub asked: u64,
    /// The most allowed.
    pub max: u64,
}

/// A gateway's view of one worker.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct WorkerView {
    /// The worker's instance id.
    pub id: String,
    /// Its label.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub label: Option<String>,
    /// How its uplink stands.
    pub connection: Connection,
    /// Whether it takes no new leases.
    pub drained: bool,
    /// When the gateway last heard from it, ms since the epoch.
    pub last_seen_at: i64,
    /// Its health.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub health: Option<Health>,
    /// Its version.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub version: Option<String>,
    /// Both ranges, when incompatible.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub protocol: Option<ProtocolPair>,
    /// Its capacity.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub capacity: Option<Capacity>,
    /// Its lease limits.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lease: Option<LeaseLimits>,
    /// Its queue depth.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub queue_depth: Option<u32>,
    /// Its leases.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub leases: Option<Vec<LeaseRecord>>,
    /// Its devices.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub devices: Option<Vec<Device>>,
    /// Its catalog.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub catalog: Option<Vec<PlatformCatalog>>,
    /// When the catalog was read.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub catalog_read_at: Option<i64>,
    /// Its host.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub host: Option<HostFacts>,
    /// Its waiting requests.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub waiting: Option<Vec<WaitingRequest>>,
    /// What it can serve.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub capabilities: Option<Vec<CapabilityStatus>>,
    /// On a gateway, to an admin: its leases (by its own lease ids) that the gateway ended and is
    /// releasing on it (released by their holders while it was away, grants whose answers were
    /// lost, the leases of a worker removed); while it is away, once it is back. The worker holds
    /// their devices until then.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub releasing: Vec<String>,
}

/// A token's record; the secret is never stored or listed.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct TokenRecord {
    /// Its id.
    pub id: TokenId,
    /// Its role.
    pub role: TokenRole,
    /// Its label.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub label: Option<String>,
    /// When it was created, ms since the epoch.
    pub created_at: i64,
}

/// What a token may do.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum TokenRole {
    /// Leases for itself.
    Agent,
    /// Operates the daemon (admin sessions).
    Operator,
    /// Joins a worker to a gateway (uplink only).
    Worker,
}

impl TokenRole {
    /// The wire name.
    pub const fn as_str(self) -> &'static str {
        match self {
            Self::Agent => "agent",
            Self::Operator => "operator",
            Self::Worker => "worker",
        }
    }

    /// Whether a daemon in `mode` has any use for a token of this role: a worker token joins a
    /// worker to a gateway, so only a gateway mints and reads one.
    pub const fn used_by(self, mode: Mode) -> bool {
        match self {
            Self::Agent | Self::Operator => true,
            Self::Worker => matches!(mode, Mode::Gateway),
        }
    }
}

/// One event as the bus records it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct EventEnvelope {
    /// Its id, kept when relayed.
    pub id: EventId,
    /// Its sequence number on the daemon that recorded it.
    pub seq: u64,
    /// When it happened, ms since the epoch.
    pub timestamp: i64,
    /// Its name (`lease.granted`, …).
    pub event: String,
    /// What happened.
    pub payload: Value,
    /// Which module emitted it.
    pub module: String,
}

/// Why a lease ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum LeaseEndReason {
    /// Released by its holder.
    Explicit,
    /// Released by an operator (`release-all`).
    Killed,
    /// Its device was lost.
    DeviceLost,
    /// Its TTL passed.
    Expired,
}

/// Why a release ends a lease: the reasons a caller may give `lease.release`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum ReleaseReason {
    /// Its holder let it go.
    Explicit,
    /// An operator ended it (`release-all`).
    Killed,
}

impl From<ReleaseReason> for LeaseEndReason {
    fn from(reason: ReleaseReason) -> Self {
        match reason {
            ReleaseReason::Explicit => Self::Explicit,
            ReleaseReason::Killed => Self::Killed,
        }
    }
}

impl LeaseEndReason {
    /// Every reason.
    pub const ALL: [Self; 4] = [
        Self::Explicit,
        Self::Killed,
        Self::DeviceLost,
        Self::Expired,
    ];

    /// As the wire spells it.
    pub const fn as_str(self) -> &'static str {
        match self {
            Self::Explicit => "explicit",
            Self::Killed => "killed",
            Self::DeviceLost => "device-lost",
            Self::Expired => "expired",
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_ttl_rule_takes_the_default_passes_the_most_and_refuses_one_past_it() {
        let limits = LeaseLimits {
            default_ttl_ms: 1_000,
            max_ttl_ms: 60_000,
        };
        assert_eq!(limits.ttl(None), Ok(1_000));
        assert_eq!(limits.ttl(Some(60_000)), Ok(60_000));
        let refused = limits.ttl(Some(60_001)).unwrap_err();
        assert_eq!(
            refused,
            TtlAboveMax {
                asked: 60_001,
                max: 60_000
            }
        );
        assert_eq!(
            refused.to_string(),
            "ttlMs: 60001 (1m1ms) is above lease.maxTtlMs (60000, 1m)"
        );
    }

    #[test]
    fn a_mode_and_a_token_role_name_themselves_as_the_wire_does() {
        for mode in [Mode::Worker, Mode::Gateway] {
            assert_eq!(serde_json::to_value(mode).unwrap(), mode.as_str());
        }
        for role in [TokenRole::Agent, TokenRole::Operator, TokenRole::Worker] {
            assert_eq!(serde_json::to_value(role).unwrap(), role.as_str());
        }
        assert!(TokenRole::Worker.used_by(Mode::Gateway));
        assert!(!TokenRole::Worker.used_by(Mode::Worker));
        for mode in [Mode::Worker, Mode::Gateway] {
            assert!(TokenRole::Agent.used_by(mode) && TokenRole::Operator.used_by(mode));
        }
    }
}
