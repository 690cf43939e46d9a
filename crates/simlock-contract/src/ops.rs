//! The operation table, as data: every operation's name, role, effect, input and output.
//!
//! Each operation is a marker type implementing [`Operation`]; [`OPERATIONS`] lists them all
//! for the dispatch pipeline, the docs and the tests. Inputs carry their bounds (garde) and
//! enter only through [`crate::decode_input`].

use std::collections::BTreeMap;

use garde::Validate;
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::bounds::{
    self, CAPABILITY_RE, CHANNEL_RE, CHOSEN_LEASE_ID_RE, LEASE_ID_RE, RELAY_ID_RE,
    RELAY_LEASE_ID_RE, WORKER_ID_RE,
};
use crate::decode::Input;
use crate::error::ContractError;
use crate::ids::SubscriptionId;
use crate::model::{
    CapabilityStatus, Capacity, DaemonInfo, Device, DriverStatus, EventEnvelope, HostFacts,
    LeaseGrant, LeaseLimits, LeaseRecord, Mode, Platform, PlatformCatalog, ReleaseReason,
    TokenRecord, TokenRole, UplinkStatus, WaitingRequest, WorkerView,
};
use crate::protocol::{Hello, HelloReply, Role};

/// Whether an operation changes state.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Effect {
    /// Reads only.
    Read,
    /// Changes state.
    Write,
}

/// One row of the operation table.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OperationSpec {
    /// The operation's wire name.
    pub name: &'static str,
    /// The least role that may call it.
    pub role: Role,
    /// Whether it changes state.
    pub effect: Effect,
    /// Whether its input refuses unknown keys.
    pub strict: bool,
    /// Its input type's name.
    pub input: &'static str,
    /// Its output type's name.
    pub output: &'static str,
}

impl OperationSpec {
    /// The row for `name`.
    pub fn find(name: &str) -> Option<&'static Self> {
        OPERATIONS.iter().find(|spec| spec.name == name)
    }
}

/// An operation, at the type level.
pub trait Operation: 'static {
    /// Its wire name.
    const NAME: &'static str;
    /// The least role that may call it.
    const ROLE: Role;
    /// Whether it changes state.
    const EFFECT: Effect;
    /// Its input.
    type Input: Input + Serialize + Send + 'static;
    /// Its output.
    type Output: Serialize + DeserializeOwned + Send + 'static;

    /// The word a daemon logs an answer of it with: `ok`, unless the operation's answer can
    /// say that what it was asked for did not happen (a relay answers `cancelled`).
    fn outcome(_output: &Self::Output) -> &'static str {
        "ok"
    }
}

macro_rules! operations {
    ($($(#[doc = $doc:literal])* $marker:ident = $name:literal, $role:ident, $effect:ident, $input:ty => $output:ty $(, outcome = $outcome:path)?;)*) => {
        $(
            $(#[doc = $doc])*
            #[derive(Debug)]
            pub enum $marker {}

            impl Operation for $marker {
                const NAME: &'static str = $name;
                const ROLE: Role = Role::$role;
                const EFFECT: Effect = Effect::$effect;
                type Input = $input;
                type Output = $output;
                $(
                    fn outcome(output: &Self::Output) -> &'static str {
                        $outcome(output)
                    }
                )?
            }
        )*

        /// Every operation, in table order.
        pub const OPERATIONS: &[OperationSpec] = &[
            $(OperationSpec {
                name: $name,
                role: Role::$role,
                effect: Effect::$effect,
                strict: <$input as Input>::STRICT,
                input: stringify!($input),
                output: stringify!($output),
            },)*
        ];

        /// Decodes `payload` as the input of the operation named `name`, for tests and tools
        /// that hold only a name. Unknown names answer `None`.
        pub fn decode_named(name: &str, payload: Option<Value>) -> Option<Result<Value, ContractError>> {
            match name {
                $($name => Some(crate::decode::decode_input::<$input>(payload).and_then(|input| {
                    serde_json::to_value(&input).map_err(|e| ContractError::internal(e.to_string()))
                })),)*
                _ => None,
            }
        }
    };
}

operations! {
    /// The handshake; the wire session answers it, before any other call.
    HelloOp = "hello", Agent, Read, Hello => HelloReply;
    /// The daemon's status.
    StatusGet = "status.get", Agent, Read, Empty => StatusOutput;
    /// What devices can be had.
    CatalogGet = "catalog.get", Agent, Read, CatalogInput => CatalogOutput;
    /// The effective configuration.
    ConfigGet = "config.get", Admin, Read, Empty => ConfigView;
    /// Devices, leases, rules or waiting requests.
    ListGet = "list.get", Admin, Read, ListInput => ListOutput;
    /// Lease a device, waiting in the queue unless `noWait`.
    LeaseRequest = "lease.request", Agent, Write, LeaseRequestInput => LeaseGrant;
    /// Extend a lease.
    LeaseRenew = "lease.renew", Agent, Write, LeaseRenewInput => LeaseRecord;
    /// End a lease.
    LeaseRelease = "lease.release", Agent, Write, LeaseIdInput => LeaseReleaseOutput;
    /// Withdraw a pending request.
    LeaseCancel = "lease.cancel", Agent, Write, LeaseCancelInput => LeaseCancelOutput;
    /// Leases: all for admins, own for agents.
    LeaseList = "lease.list", Agent, Read, Empty => LeaseListOutput;
    /// One lease, as `lease.list` shows it to the caller.
    LeaseGet = "lease.get", Agent, Read, LeaseGetInput => LeaseGetOutput;
    /// End every lease (reason `killed`).
    LeaseReleaseAll = "lease.release-all", Admin, Write, Empty => ReleaseAllOutput;
    /// Run a configured tool against a leased device.
    DeviceExec = "device.exec", Agent, Write, ExecInput => ExecOutput;
    /// Receive every event as an `event` push.
    EventsSubscribe = "events.subscribe", Admin, Read, Empty => SubscribeOutput;
    /// Stop receiving events.
    EventsUnsubscribe = "events.unsubscribe", Admin, Read, Empty => SubscribeOutput;
    /// Events from the ring buffer.
    EventsReplay = "events.replay", Admin, Read, ReplayInput => ReplayOutput;
    /// Mint a token; its secret is shown once.
    TokenCreate = "token.create", Admin, Write, TokenCreateInput => TokenCreateOutput;
    /// List tokens, never their secrets.
    TokenList = "token.list", Admin, Read, Empty => TokenListOutput;
    /// Revoke a token; uplinks opened with it close.
    TokenRevoke = "token.revoke", Admin, Write, TokenRevokeInput => TokenRevokeOutput;
    /// Stop the daemon.
    DaemonStop = "daemon.stop", Admin, Write, Empty => DaemonStopOutput;
    /// The workers a gateway knows (a worker answers about itself).
    WorkerList = "worker.list", Admin, Read, Empty => WorkerListOutput;
    /// Take no new leases on a worker.
    WorkerDrain = "worker.drain", Admin, Write, WorkerIdInput => WorkerDrainOutput;
    /// Take new leases on a worker again.
    WorkerUndrain = "worker.undrain", Admin, Write, WorkerIdInput => WorkerDrainOutput;
    /// Forget a disconnected worker.
    WorkerRemove = "worker.remove", Admin, Write, WorkerIdInput => WorkerRemoveOutput;
    /// Hand one HTTP exchange to a relay target (gateway uplink only).
    RelayRequest = "relay.request", Admin, Write, RelayRequestInput => RelayRequestOutput, outcome = RelayRequestOutput::outcome;
    /// Cancel a relay.
    RelayCancel = "relay.cancel", Admin, Write, RelayCancelInput => Empty;
}

// === Inputs ===

/// An input or output with no fields (unknown keys are ignored).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize, Validate)]
pub struct Empty {}

impl Input for Empty {}

impl Input for Hello {}

/// `catalog.get`.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize, Validate)]
#[serde(rename_all = "camelCase")]
pub struct CatalogInput {
    /// Only this platform.
    #[garde(skip)]
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub platform: Option<Platform>,
}

impl Input for CatalogInput {}

/// What `list.get` lists.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ListKind {
    /// Devices (the default).
    #[default]
    Devices,
    /// Leases.
    Leases,
    /// Cleanup rules.
    Rules,
    /// Waiting requests.
    Requests,
}

/// `list.get`.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize, Validate)]
#[serde(rename_all = "camelCase")]
pub struct ListInput {
    /// What to list.
    #[garde(skip)]
    #[serde(default)]
    pub kind: ListKind,
}

impl Input for ListInput {}

/// `lease.request`. Strict: unknown keys are refused.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, Validate)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct LeaseRequestInput {
    /// The platform.
    #[garde(skip)]
    pub platform: Platform,
    /// A model name or alias (case-insensitive).
    #[garde(inner(length(chars, min = 1, max = bounds::MAX_MODEL), custom(bounds::printable)))]
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model: Option<String>,
    /// An exact OS version.
    #[garde(inner(length(chars, min = 1, max = bounds::MAX_OS_VERSION), custom(bounds::printable)))]
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub os_version: Option<String>,
    /// Who the lease is for; defaults to the session's principal.
    #[garde(inner(length(chars, min = 1, max = bounds::MAX_REQUESTER), custom(bounds::printable)))]
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub requester_id: Option<String>,
    /// Refuse with `NO_CAPACITY` instead of waiting.
    #[garde(skip)]
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub no_wait: Option<bool>,
    /// How long to wait in the queue, from the first time the request is queued.
    #[garde(inner(range(min = 1, max = bounds::MAX_QUEUE_TIMEOUT_MS)))]
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub timeout_ms: Option<u64>,
    /// The lease's width; above `lease.maxTtlMs` is refused, never clamped.
    #[garde(inner(range(min = 1, max = bounds::MAX_TTL_MS)))]
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ttl_ms: Option<u64>,
    /// A repeat with the same key and requester returns the same outcome.
    #[garde(inner(length(chars, min = 1, max = bounds::MAX_IDEMPOTENCY_KEY), custom(bounds::printable)))]
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub idempotency_key: Option<String>,
    /// The owner to record (the gateway's uplink only).
    #[garde(inner(length(chars, min = 1, max = bounds::MAX_REQUESTER), custom(bounds::printable)))]
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub owner: Option<String>,
    /// The id the lease must have.
    #[garde(inner(pattern(CHOSEN_LEASE_ID_RE)))]
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lease_id: Option<String>,
    /// Capabilities the serving worker must have available (0–8).
    #[garde(length(max = bounds::MAX_REQUIRES), inner(pattern(CAPABILITY_RE)))]
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub requires: Vec<String>,
}

impl Input for LeaseRequestInput {
    const STRICT: bool = true;
}

impl LeaseRequestInput {
    /// A request for `platform` and nothing else.
    pub fn for_platform(platform: Platform) -> Self {
        Self {
            platform,
            model: None,
            os_version: None,
            requester_id: None,
            no_wait: None,
            timeout_ms: None,
            ttl_ms: None,
            idempotency_key: None,
            owner: None,
            lease_id: None,
            requires: Vec::new(),
        }
    }
}

/// `lease.renew`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, Validate)]
#[serde(rename_all = "camelCase")]
pub struct LeaseRenewInput {
    /// The lease.
    #[garde(pattern(LEASE_ID_RE))]
    pub lease_id: String,
    /// A new width; absent keeps the recorded one.
    #[garde(inner(range(min = 1, max = bounds::MAX_TTL_MS)))]
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ttl_ms: Option<u64>,
}

impl Input for LeaseRenewInput {}

/// `lease.get`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, Validate)]
#[serde(rename_all = "camelCase")]
pub struct LeaseGetInput {
    /// The lease.
    #[garde(pattern(LEASE_ID_RE))]
    pub lease_id: String,
}

impl Input for LeaseGetInput {}

/// An input naming one lease (`lease.release`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, Validate)]
#[serde(rename_all = "camelCase")]
pub struct LeaseIdInput {
    /// The lease.
    #[garde(pattern(LEASE_ID_RE))]
    pub lease_id: String,
    /// Why it ends: absent is `explicit` (its holder let it go); `killed` is an operator's
    /// (admins only), as when a gateway carries out `lease.release-all` lease by lease.
    #[garde(skip)]
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<ReleaseReason>,
}

impl Input for LeaseIdInput {}

impl LeaseIdInput {
    /// Whether `role` may release with this input's reason: `killed` is an admin's.
    ///
    /// # Errors
    /// `FORBIDDEN` for an agent naming `killed`.
    pub fn authorize(&self, role: Role) -> Result<(), ContractError> {
        match self.reason {
            Some(ReleaseReason::Killed) if role != Role::Admin => Err(ContractError::forbidden(
                "Only an admin may release a lease with reason killed",
            )),
            _ => Ok(()),
        }
    }
}

/// `lease.cancel`.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize, Validate)]
#[serde(rename_all = "camelCase")]
pub struct LeaseCancelInput {
    /// Whose pending request; defaults to the session's principal.
    #[garde(inner(length(chars, min = 1, max = bounds::MAX_REQUESTER), custom(bounds::printable)))]
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub requester_id: Option<String>,
}

impl Input for LeaseCancelInput {}

/// `device.exec`. Strict: unknown keys are refused.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, Validate)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ExecInput {
    /// The lease whose device the tool runs against.
    #[garde(pattern(LEASE_ID_RE))]
    pub lease_id: String,
    /// A tool named in the worker's `exec.tools`.
    #[garde(length(chars, min = 1, max = bounds::MAX_TOOL))]
    pub tool: String,
    /// Its arguments.
    #[garde(custom(bounds::exec_args))]
    #[serde(default)]
    pub args: Vec<String>,
    /// Text for its standard input.
    #[garde(inner(length(max = bounds::MAX_STDIN)))]
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stdin: Option<String>,
    /// The requester the lease must belong to (admin sessions only).
    #[garde(inner(length(chars, min = 1, max = bounds::MAX_REQUESTER), custom(bounds::printable)))]
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub requester_id: Option<String>,
}

impl Input for ExecInput {
    const STRICT: bool = true;
}

/// `events.replay`.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize, Validate)]
#[serde(rename_all = "camelCase")]
pub struct ReplayInput {
    /// Only events at or after this time, ms since the epoch.
    #[garde(inner(custom(bounds::timestamp)))]
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub since_ts: Option<i64>,
}

impl Input for ReplayInput {}

/// `token.create`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, Validate)]
#[serde(rename_all = "camelCase")]
pub struct TokenCreateInput {
    /// The token's role.
    #[garde(skip)]
    pub role: TokenRole,
    /// A label for people.
    #[garde(inner(length(chars, min = 1, max = bounds::MAX_LABEL), custom(bounds::printable)))]
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub label: Option<String>,
}

impl Input for TokenCreateInput {}

/// `token.revoke`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, Validate)]
#[serde(rename_all = "camelCase")]
pub struct TokenRevokeInput {
    /// The token's id.
    #[garde(length(chars, min = 1, max = 64))]
    pub id: String,
}

impl Input for TokenRevokeInput {}

/// An input naming one worker.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, Validate)]
#[serde(rename_all = "camelCase")]
pub struct WorkerIdInput {
    /// The worker.
    #[garde(pattern(WORKER_ID_RE))]
    pub worker_id: String,
}

impl Input for WorkerIdInput {}

/// The methods a relay carries.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "UPPERCASE")]
pub enum RelayMethod {
    /// GET.
    Get,
    /// HEAD.
    Head,
    /// POST.
    Post,
    /// PUT.
    Put,
    /// PATCH.
    Patch,
    /// DELETE.
    Delete,
    /// OPTIONS.
    Options,
}

impl RelayMethod {
    /// The method's name.
    pub const fn as_str(self) -> &'static str {
        match self {
            Self::Get => "GET",
            Self::Head => "HEAD",
            Self::Post => "POST",
            Self::Put => "PUT",
            Self::Patch => "PATCH",
            Self::Delete => "DELETE",
            Self::Options => "OPTIONS",
        }
    }

    /// The method named `name`, if a relay carries it.
    pub fn from_name(name: &str) -> Option<Self> {
        [
            Self::Get,
            Self::Head,
            Self::Post,
            Self::Put,
            Self::Patch,
            Self::Delete,
            Self::Options,
        ]
        .into_iter()
        .find(|m| m.as_str() == name)
    }
}

/// `relay.request`. Strict: unknown keys are refused.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, Validate)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct RelayRequestInput {
    /// The gateway's id for the relay, unique among the connection's active relays.
    #[garde(pattern(RELAY_ID_RE))]
    pub relay_id: String,
    /// The relay target (a capability name).
    #[garde(pattern(CAPABILITY_RE))]
    pub target: String,
    /// The HTTP method.
    #[garde(skip)]
    pub method: RelayMethod,
    /// The absolute URL the caller asked for.
    #[garde(custom(bounds::absolute_http_url))]
    pub url: String,
    /// Request headers, `[name, value]`, filtered before the bounds apply.
    #[garde(custom(bounds::relay_headers))]
    pub headers: Vec<(String, String)>,
    /// Whose the exchange is, on the worker.
    #[garde(length(chars, min = 1, max = bounds::MAX_TENANT))]
    pub tenant: String,
    /// The lease the exchange is for.
    #[garde(inner(pattern(RELAY_LEASE_ID_RE)))]
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lease_id: Option<String>,
    /// Whether a request body follows on the channel.
    #[garde(skip)]
    pub has_body: bool,
    /// The link channel carrying both bodies.
    #[garde(pattern(CHANNEL_RE))]
    pub channel: String,
}

impl Input for RelayRequestInput {
    const STRICT: bool = true;

    fn check(&self) -> Result<(), ContractError> {
        if self.has_body && matches!(self.method, RelayMethod::Get | RelayMethod::Head) {
            return Err(ContractError::bad_request(format!(
                "hasBody: a {} request carries no body",
                self.method.as_str()
            )));
        }
        Ok(())
    }
}

/// `relay.cancel`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, Validate)]
#[serde(rename_all = "camelCase")]
pub struct RelayCancelInput {
    /// The relay.
    #[garde(pattern(RELAY_ID_RE))]
    pub relay_id: String,
}

impl Input for RelayCancelInput {}

// === Outputs ===

/// `status.get`. While the daemon starts, only `daemon` and `host` are present.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct StatusOutput {
    /// The daemon.
    pub daemon: DaemonInfo,
    /// Its machine.
    pub host: HostFacts,
    /// Capacity (summed over connected workers on a gateway).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub capacity: Option<Capacity>,
    /// Devices.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub devices: Option<Vec<Device>>,
    /// Leases.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub leases: Option<Vec<LeaseRecord>>,
    /// Waiting requests in the queue.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub queue_depth: Option<u32>,
    /// The waiting requests.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub waiting: Option<Vec<WaitingRequest>>,
    /// What the worker can serve (worker only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub capabilities: Option<Vec<CapabilityStatus>>,
    /// Which driver serves each platform, and whether it can (worker only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub drivers: Option<Vec<DriverStatus>>,
    /// The lease limits.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lease: Option<LeaseLimits>,
    /// The workers (gateway only; absent on a worker).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub workers: Option<Vec<WorkerView>>,
    /// The worker's uplink to its gateway (a worker with `gateway.url` only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub uplink: Option<UplinkStatus>,
}

impl StatusOutput {
    /// `daemon` and `host` alone, as while the daemon starts; a running daemon fills in the
    /// rest it has.
    pub fn bare(daemon: DaemonInfo, host: HostFacts) -> Self {
        Self {
            daemon,
            host,
            capacity: None,
            devices: None,
            leases: None,
            queue_depth: None,
            waiting: None,
            capabilities: None,
            drivers: None,
            lease: None,
            workers: None,
            uplink: None,
        }
    }
}

/// `catalog.get`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct CatalogOutput {
    /// One entry per platform served.
    pub platforms: Vec<PlatformCatalog>,
}

/// `config.get`: the effective configuration, as far as peers need it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ConfigView {
    /// Worker or gateway.
    pub mode: Mode,
    /// Lease limits.
    pub lease: LeaseLimits,
    /// Every other key, as loaded (secrets redacted).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub settings: BTreeMap<String, Value>,
}

/// `list.get`: one of the lists, under its kind's name.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub enum ListOutput {
    /// `{"devices": [...]}`.
    Devices(Vec<Device>),
    /// `{"leases": [...]}`.
    Leases(Vec<LeaseRecord>),
    /// `{"rules": [...]}`.
    Rules(Vec<Value>),
    /// `{"requests": [...]}`.
    Requests(Vec<WaitingRequest>),
}

/// `lease.release`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct LeaseReleaseOutput {
    /// The released lease.
    pub lease_id: String,
}

/// The three ways `lease.cancel` ends.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum CancelResult {
    /// The request was queued and is withdrawn.
    Cancelled,
    /// No pending request for that requester.
    NotFound,
    /// Device work already started for it.
    NotCancellable,
}

/// `lease.cancel`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct LeaseCancelOutput {
    /// What happened.
    pub result: CancelResult,
}

/// `lease.list`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LeaseListOutput {
    /// The leases.
    pub leases: Vec<LeaseRecord>,
    /// On a gateway, the workers whose leases it has not read since it started (each away
    /// since): their leases, the caller's included, are not in `leases` until each reports.
    /// Empty on a worker.
    #[serde(
        rename = "unreadWorkers",
        default,
        skip_serializing_if = "Vec::is_empty"
    )]
    pub unread_workers: Vec<crate::model::WorkerRef>,
}

/// `lease.get`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LeaseGetOutput {
    /// The lease.
    pub lease: LeaseRecord,
}

/// `lease.release-all`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ReleaseAllOutput {
    /// The released leases.
    pub lease_ids: Vec<String>,
}

/// `device.exec`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ExecOutput {
    /// The tool's exit code.
    pub exit_code: i32,
}

/// `events.subscribe` and `events.unsubscribe`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct SubscribeOutput {
    /// Whether the connection is now subscribed.
    pub subscribed: bool,
    /// The subscription, when subscribed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub subscription_id: Option<SubscriptionId>,
}

/// `events.replay`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ReplayOutput {
    /// The events, oldest first.
    pub events: Vec<EventEnvelope>,
}

/// `token.create`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TokenCreateOutput {
    /// The secret, shown this once.
    pub secret: String,
    /// The record.
    pub token: TokenRecord,
}

/// `token.list`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TokenListOutput {
    /// The tokens.
    pub tokens: Vec<TokenRecord>,
}

/// `token.revoke`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct TokenRevokeOutput {
    /// Whether a token was revoked.
    pub revoked: bool,
}

/// `daemon.stop`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct DaemonStopOutput {
    /// Always true.
    pub stopping: bool,
}

/// `worker.list`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct WorkerListOutput {
    /// The workers.
    pub workers: Vec<WorkerView>,
}

/// `worker.drain` and `worker.undrain`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct WorkerDrainOutput {
    /// The worker.
    pub worker_id: String,
    /// Whether it is drained now.
    pub drained: bool,
    /// Whether this call changed that (`false`: it already was so). A daemon that does not say
    /// is read as having changed it.
    #[serde(default = "changed_unless_said")]
    pub changed: bool,
}

/// [`WorkerDrainOutput::changed`] from a daemon that does not say.
const fn changed_unless_said() -> bool {
    true
}

/// `worker.remove`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct WorkerRemoveOutput {
    /// The worker.
    pub worker_id: String,
    /// Whether it was forgotten.
    pub removed: bool,
}

/// `relay.request`: `{}` once the response body ended, `{"cancelled": true}` after a cancel.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct RelayRequestOutput {
    /// Whether a cancel took effect.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cancelled: Option<bool>,
}

impl RelayRequestOutput {
    /// How the relay ended, as the worker logs it: `cancelled` when the gateway's cancel (its
    /// caller gone, its deadline passed) or the uplink's end took effect, else `ok`.
    pub fn outcome(&self) -> &'static str {
        if self.cancelled == Some(true) {
            "cancelled"
        } else {
            "ok"
        }
    }
}

#[cfg(test)]
mod tests;
