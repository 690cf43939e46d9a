//! The MCP tools: their names, descriptions and input schemas (from the argument types below),
//! how a call's arguments are read, and what each answers. A tool's failure is an MCP tool error
//! whose text is the contract error's message and code (`<message> (<CODE>)`), with the
//! contract's error body as its structured content; a bad argument is `BAD_REQUEST` the same
//! way, never a protocol error.

use std::sync::Arc;

use rmcp::model::{CallToolResult, ContentBlock, Tool, ToolAnnotations};
use rmcp::service::RequestContext;
use rmcp::{RoleServer, handler::server::tool::schema_for_input};
use schemars::JsonSchema;
use serde::Deserialize;
use serde::de::DeserializeOwned;
use serde_json::{Value, json};
use simlock_contract::model::{LeaseGrant, Platform};
use simlock_contract::ops::LeaseRequestInput;
use simlock_contract::{ContractError, ErrorCode};

use super::book::Entry;
use super::session::Session;
use crate::{duration, view};

/// `lease_simulator`.
pub(crate) const LEASE: &str = "lease_simulator";
/// `release_simulator`.
pub(crate) const RELEASE: &str = "release_simulator";
/// `lease_status`.
pub(crate) const STATUS: &str = "lease_status";
/// `list_devices`.
pub(crate) const DEVICES: &str = "list_devices";
/// `held_leases`.
pub(crate) const HELD: &str = "held_leases";
/// `device_access`.
pub(crate) const ACCESS: &str = "device_access";

/// A platform.
#[derive(Debug, Clone, Copy, Deserialize, JsonSchema)]
#[serde(rename_all = "lowercase")]
pub(crate) enum PlatformArg {
    /// iOS simulators.
    Ios,
    /// Android emulators.
    Android,
}

impl From<PlatformArg> for Platform {
    fn from(arg: PlatformArg) -> Self {
        match arg {
            PlatformArg::Ios => Self::Ios,
            PlatformArg::Android => Self::Android,
        }
    }
}

/// A duration: text like "15m", "90s", "1h30m", or a number of milliseconds.
#[derive(Debug, Clone, JsonSchema)]
#[serde(untagged)]
pub(crate) enum DurationArg {
    /// Milliseconds.
    Millis(u64),
    /// Text: 15m, 90s, 1h30m, 2d, 500ms.
    Text(String),
}

impl<'de> Deserialize<'de> for DurationArg {
    /// A number or a text; any other number (negative, fractional, past u64) or kind is named
    /// with the shapes a duration takes, instead of serde's "did not match any variant".
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        match Value::deserialize(deserializer)? {
            Value::Number(n) => n.as_u64().map(Self::Millis).ok_or_else(|| {
                serde::de::Error::custom(format!(
                    "{n} is not a duration: a positive whole number of milliseconds, or text \
                     like {}",
                    duration::SHAPES
                ))
            }),
            Value::String(text) => Ok(Self::Text(text)),
            other => Err(serde::de::Error::custom(format!(
                "{other} is not a duration: {}",
                duration::SHAPES
            ))),
        }
    }
}

impl DurationArg {
    /// The duration in milliseconds, checked as a `width`, or `BAD_REQUEST` naming `field`.
    fn millis(&self, field: &str, width: duration::Width) -> Result<u64, ContractError> {
        let parsed = match self {
            Self::Millis(ms) => width.check(*ms, &ms.to_string()),
            // A model writing "15" may mean minutes as well as milliseconds (outside trial 24:
            // "15" leased for 15 ms, renewed every 5 ms, then lost).
            Self::Text(text) => width.parse_with_unit(text),
        };
        parsed.map_err(|e| bad_request(&format!("{field}: {e}")))
    }
}

/// A lease request waits in the queue unless told not to.
const fn waits() -> bool {
    true
}

/// `lease_simulator`'s arguments.
#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub(crate) struct LeaseArgs {
    /// The platform: "ios" for an iOS simulator, "android" for an Android emulator.
    pub(crate) platform: PlatformArg,
    /// A device model or alias, any case (e.g. "iPhone 16", "pixel"); list_devices shows them.
    /// Default: the daemon's choice for the platform.
    #[serde(default)]
    pub(crate) model: Option<String>,
    /// An exact OS version (runtime), e.g. "18.2"; default: the platform's default runtime.
    #[serde(default)]
    pub(crate) os: Option<String>,
    /// How long the lease lasts between renewals: "15m", "1h" (text needs a unit), or a number
    /// of milliseconds. This session
    /// renews it every third of that until it is released; default: the daemon's.
    #[serde(default)]
    pub(crate) ttl: Option<DurationArg>,
    /// Whether to wait in the queue when no device is free (default true). With false, a busy
    /// fleet answers NO_CAPACITY at once.
    #[serde(default = "waits")]
    pub(crate) wait: bool,
    /// The longest to wait in the queue: "90s", "10m", or milliseconds (then QUEUE_TIMEOUT).
    #[serde(default)]
    pub(crate) timeout: Option<DurationArg>,
    /// Capabilities the serving worker must have (e.g. "agent-device").
    #[serde(default)]
    pub(crate) requires: Vec<String>,
}

/// The arguments of the tools that are about one lease.
#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub(crate) struct LeaseIdArgs {
    /// The lease (lse_…); default: the one this session holds.
    #[serde(default)]
    pub(crate) lease_id: Option<String>,
}

/// Reads the arguments of a tool about one lease. A `leaseId` that is no lease id is refused
/// without being echoed back (a long one would flood the model's context).
fn lease_args(tool: &str, arguments: Value) -> Result<LeaseIdArgs, ContractError> {
    let args: LeaseIdArgs = parse(tool, arguments)?;
    if let Some(id) = &args.lease_id
        && !simlock_contract::bounds::LEASE_ID_RE.is_match(id)
    {
        return Err(bad_request(
            "leaseId: not a lease id (letters, digits, '.', '_' and '-', at most 160 characters, \
             as lease_simulator answered it)",
        ));
    }
    Ok(args)
}

/// `list_devices`'s arguments.
#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub(crate) struct DevicesArgs {
    /// Only this platform; default: all.
    #[serde(default)]
    pub(crate) platform: Option<PlatformArg>,
}

/// `held_leases`'s arguments: none.
#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub(crate) struct NoArgs {}

/// The tool definitions, as `tools/list` answers them.
///
/// # Errors
/// `INTERNAL` when an argument type does not make an object schema (a bug, found by the tests).
pub(crate) fn definitions() -> Result<Vec<Tool>, ContractError> {
    let schema = |result: Result<_, String>| result.map_err(ContractError::internal);
    let read_only = || ToolAnnotations::new().read_only(true);
    Ok(vec![
        Tool::new(
            LEASE,
            "Lease one device (an iOS simulator or Android emulator) for this agent session and \
             hold it: simlock renews the lease every third of its TTL until release_simulator, \
             or until this MCP session ends (the lease is then released). Waits in the queue \
             when no device is free unless wait is false, sending progress notifications when \
             the call carries a progress token. Answers the grant and how to reach the device \
             (its UDID or serial and the environment to export). One lease per agent session: \
             a second answers REQUESTER_ALREADY_LEASED.",
            schema(schema_for_input::<LeaseArgs>())?,
        )
        .with_title("Lease a device")
        .with_annotations(ToolAnnotations::new().read_only(false).destructive(false)),
        Tool::new(
            RELEASE,
            "Release a lease this session holds (default: its only one), giving the device back \
             to be wiped and reused. A session releases only its own leases, and those an \
             earlier session of the same agent left (the REQUESTER_ALREADY_LEASED refusal of \
             lease_simulator names such a lease).",
            schema(schema_for_input::<LeaseIdArgs>())?,
        )
        .with_title("Release a device")
        .with_annotations(ToolAnnotations::new().read_only(false).destructive(true)),
        Tool::new(
            STATUS,
            "The status of this session's lease (default: the one it holds, else the last one): \
             held, with its deadline read from the daemon now; or ended, and why (released, \
             expired, released by an operator, device lost). Small and safe to call again, e.g. \
             after a context compaction or a notification.",
            schema(schema_for_input::<LeaseIdArgs>())?,
        )
        .with_title("Lease status")
        .with_annotations(read_only()),
        Tool::new(
            DEVICES,
            "What can be leased: per platform, the device models and the installed OS versions \
             (runtimes), with the default runtime. Call it before lease_simulator to pick a \
             valid model and os instead of guessing.",
            schema(schema_for_input::<DevicesArgs>())?,
        )
        .with_title("List leasable devices")
        .with_annotations(read_only()),
        Tool::new(
            HELD,
            "What this agent session holds: its leases that are held now, and the ones that \
             ended lately with why, plus the requester id its leases are made for.",
            schema(schema_for_input::<NoArgs>())?,
        )
        .with_title("Held leases")
        .with_annotations(read_only()),
        Tool::new(
            ACCESS,
            "How to reach a leased device (default: the one this session holds): its platform, \
             model and OS, the simulator UDID or emulator serial, the address when there is one, \
             the worker it runs on, and the environment variables that point tools at it — the \
             same information `simlock lease` prints.",
            schema(schema_for_input::<LeaseIdArgs>())?,
        )
        .with_title("Reach a leased device")
        .with_annotations(read_only()),
    ])
}

/// `BAD_REQUEST` with `message`.
fn bad_request(message: &str) -> ContractError {
    ContractError::new(ErrorCode::BadRequest, message)
}

/// Reads a tool's arguments; a mismatch is `BAD_REQUEST` naming the argument.
fn parse<T: DeserializeOwned>(tool: &str, arguments: Value) -> Result<T, ContractError> {
    serde_path_to_error::deserialize(arguments).map_err(|e| {
        let path = e.path().to_string();
        let inner = e.into_inner();
        if path == "." {
            bad_request(&format!("Invalid arguments for {tool}: {inner}"))
        } else {
            bad_request(&format!("Invalid argument {path} for {tool}: {inner}"))
        }
    })
}

/// The tool error for `err`: its message and code as text, its error body as structured content.
pub(crate) fn tool_error(err: &ContractError) -> CallToolResult {
    let mut result = CallToolResult::error(vec![ContentBlock::text(format!(
        "{} ({})",
        err.message, err.code
    ))]);
    result.structured_content = Some(json!({ "error": err.to_body() }));
    result
}

/// Runs tool `name`; `None` when there is no such tool.
pub(crate) async fn call(
    session: &Arc<Session>,
    name: &str,
    arguments: Value,
    ctx: &RequestContext<RoleServer>,
) -> Option<Result<Value, ContractError>> {
    Some(match name {
        LEASE => lease(session, arguments, ctx).await,
        RELEASE => release(session, arguments).await,
        STATUS => status(session, arguments).await,
        DEVICES => devices(session, arguments).await,
        HELD => held(session, arguments),
        ACCESS => access(session, arguments),
        _ => return None,
    })
}

async fn lease(
    session: &Arc<Session>,
    arguments: Value,
    ctx: &RequestContext<RoleServer>,
) -> Result<Value, ContractError> {
    let args: LeaseArgs = parse(LEASE, arguments)?;
    let mut input = LeaseRequestInput::for_platform(args.platform.into());
    input.model = args.model;
    input.os_version = args.os;
    input.ttl_ms = args
        .ttl
        .as_ref()
        .map(|d| d.millis("ttl", duration::Width::Ttl))
        .transpose()?;
    input.timeout_ms = args
        .timeout
        .as_ref()
        .map(|d| d.millis("timeout", duration::Width::QueueWait))
        .transpose()?;
    input.no_wait = (!args.wait).then_some(true);
    input.requires = args.requires;
    let progress = ctx
        .meta
        .get_progress_token()
        .map(|token| (ctx.peer.clone(), token));
    let grant = session.lease(input, progress, ctx.ct.clone()).await?;
    Ok(json!({
        "leaseId": grant.lease.id,
        "held": true,
        "requesterId": grant.lease.requester_id,
        "renewedEvery": view::duration(grant.lease.ttl_ms / 3),
        "access": access_of(&grant),
        "grant": grant,
    }))
}

async fn release(session: &Arc<Session>, arguments: Value) -> Result<Value, ContractError> {
    let args = lease_args(RELEASE, arguments)?;
    let lease_id = session.release(args.lease_id.as_deref()).await?;
    Ok(json!({ "leaseId": lease_id, "released": true }))
}

async fn status(session: &Arc<Session>, arguments: Value) -> Result<Value, ContractError> {
    let args = lease_args(STATUS, arguments)?;
    let picked = session.with_book(|b| b.pick(args.lease_id.as_deref()).cloned());
    let entry = match picked {
        Ok(entry) => entry,
        // Asked about nothing in particular, holding nothing: an answer, not an error.
        Err(e) if args.lease_id.is_none() && e.code == ErrorCode::UnknownLease => {
            return Ok(json!({
                "held": false,
                "requesterId": session.requester().id(),
                "message": "This session holds no lease; lease_simulator leases one",
            }));
        }
        Err(e) => return Err(e),
    };
    if !entry.standing.is_held() {
        return Ok(summary(&entry));
    }
    let mut out = summary(&entry);
    match session.record(entry.lease_id()).await {
        Ok(Some(record)) => {
            if let Some(map) = out.as_object_mut() {
                map.insert(
                    "expires".into(),
                    Value::from(view::relative(record.ttl_deadline)),
                );
                map.insert("lease".into(), json!(record));
            }
        }
        // Not listed: just granted through a gateway (its list follows its workers' views), or
        // just ended (the hold hears at its next renewal at the latest). The hold decides.
        Ok(None) => {
            if let Some(map) = out.as_object_mut() {
                map.insert("lease".into(), json!(entry.grant.lease));
                map.insert(
                    "message".into(),
                    Value::from(
                        "The daemon does not list this lease right now; the session still holds \
                         it, and says so if the daemon ended it",
                    ),
                );
            }
        }
        // The daemon is away (a restart): the session still holds the lease and connects
        // again; the book's record is the last the daemon answered.
        Err(e) if e.code.is_transport() => {
            if let Some(map) = out.as_object_mut() {
                map.insert(
                    "expires".into(),
                    Value::from(view::relative(entry.grant.lease.ttl_deadline)),
                );
                map.insert("lease".into(), json!(entry.grant.lease));
                map.insert(
                    "message".into(),
                    Value::from(format!(
                        "The daemon cannot be reached right now ({}); the session still holds \
                         the lease and connects again to keep it",
                        e.message
                    )),
                );
            }
        }
        Err(e) => return Err(e),
    }
    Ok(out)
}

async fn devices(session: &Arc<Session>, arguments: Value) -> Result<Value, ContractError> {
    let args: DevicesArgs = parse(DEVICES, arguments)?;
    let client = session.client().await?;
    let catalog = client.catalog(args.platform.map(Into::into)).await?;
    Ok(json!(catalog))
}

fn held(session: &Arc<Session>, arguments: Value) -> Result<Value, ContractError> {
    let _: NoArgs = parse(HELD, arguments)?;
    let (held, ended): (Vec<Value>, Vec<Value>) = session.with_book(|b| {
        let held = b.held().map(summary).collect();
        let ended = b
            .entries()
            .filter(|e| !e.standing.is_held())
            .map(summary)
            .collect();
        (held, ended)
    });
    Ok(json!({
        "requesterId": session.requester().id(),
        "requesterSource": session.requester().source(),
        "held": held,
        "ended": ended,
    }))
}

fn access(session: &Arc<Session>, arguments: Value) -> Result<Value, ContractError> {
    let args = lease_args(ACCESS, arguments)?;
    let entry = session.with_book(|b| b.pick_held(args.lease_id.as_deref()).cloned())?;
    Ok(access_of(&entry.grant))
}

/// One lease of the session, as the tools show it.
fn summary(entry: &Entry) -> Value {
    let lease = &entry.grant.lease;
    let spec = &entry.grant.device.spec;
    let mut out = json!({
        "leaseId": lease.id,
        "held": entry.standing.is_held(),
        "standing": entry.standing.name(),
        "platform": spec.platform,
        "model": spec.model,
        "osVersion": spec.os_version,
        "deviceId": entry.grant.device.id,
        "ttl": view::duration(lease.ttl_ms),
    });
    if !entry.standing.is_held()
        && let Some(map) = out.as_object_mut()
    {
        map.insert("why".into(), Value::from(entry.standing.why()));
    }
    out
}

/// How to reach a leased device.
fn access_of(grant: &LeaseGrant) -> Value {
    let device = &grant.device;
    let mut out = json!({
        "leaseId": grant.lease.id,
        "platform": device.spec.platform,
        "model": device.spec.model,
        "osVersion": device.spec.os_version,
        "deviceId": device.id,
        "driverDeviceId": device.driver_device_id,
        "environment": grant.environment,
        "text": view::grant(grant),
    });
    if let Some(map) = out.as_object_mut() {
        if let Some(address) = &device.address {
            map.insert("address".into(), json!(address));
        }
        if let Some(worker) = &grant.lease.worker {
            map.insert("worker".into(), json!(worker));
        }
    }
    out
}
