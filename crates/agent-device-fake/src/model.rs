//! The daemon's state and its decisions as plain data taking `now` (epoch ms): the JSON-RPC
//! methods (commands, leases, installs), sessions, artifacts, request diagnostics and the knobs a
//! test turns. The HTTP shell (`server`) parses, authenticates, waits (holds, delays) and writes;
//! everything it answers is decided here.

use std::collections::{BTreeMap, VecDeque};
use std::time::Duration;

use bytes::Bytes;
use http::StatusCode;
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value, json};

use crate::ids::{LeaseId, RunId, TenantId, base36, file_safe, hex, iso8601, random_base36, uuid};
use crate::leases::{Lease, LeaseBackend, LeaseCall, LeaseRegistry, Released, TtlPolicy};
use crate::uploads::{FinalizedUpload, UPLOAD_IDLE_MS, Uploads, sanitize_file_name};
use crate::wire::{
    DaemonError, Device, DiagnosticsRecord, ErrorCode, ErrorData, rpc_bare_error, rpc_code,
    rpc_error, rpc_result,
};

/// How many failed requests keep their diagnostics.
const DIAGNOSTICS_KEPT: usize = 512;
/// How long an undownloaded artifact lives.
const ARTIFACT_TTL_MS: u64 = 900_000;
/// How long materialized install paths live unless the call names a retention.
const MATERIALIZATION_TTL_MS: u64 = 900_000;
/// Commands the fake answers without an open session.
const SESSIONLESS: &[&str] = &[
    "devices",
    "open",
    "close",
    "install",
    "reinstall",
    "install_source",
    "snapshot",
    "apps",
    "boot",
    "shutdown",
    "doctor",
    "capabilities",
    "session",
];

/// A 73-byte 4×4 PNG: what a screenshot produces unless a test sets other bytes.
pub const TINY_PNG: &[u8] = &[
    0x89, 0x50, 0x4e, 0x47, 0x0d, 0x0a, 0x1a, 0x0a, 0x00, 0x00, 0x00, 0x0d, 0x49, 0x48, 0x44, 0x52,
    0x00, 0x00, 0x00, 0x04, 0x00, 0x00, 0x00, 0x04, 0x08, 0x02, 0x00, 0x00, 0x00, 0x26, 0x93, 0x09,
    0x29, 0x00, 0x00, 0x00, 0x10, 0x49, 0x44, 0x41, 0x54, 0x78, 0x9c, 0x63, 0xf8, 0xcf, 0xc0, 0x00,
    0x47, 0x0c, 0xc4, 0x71, 0x00, 0xae, 0x93, 0x0f, 0xf1, 0xd0, 0x5f, 0x23, 0x9e, 0x00, 0x00, 0x00,
    0x00, 0x49, 0x45, 0x4e, 0x44, 0xae, 0x42, 0x60, 0x82,
];

/// What `devices` answers.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub enum DevicesAnswer {
    /// These devices (they are also what `open` picks from).
    List(Vec<Device>),
    /// This failure.
    Error(DaemonError),
    /// `{"ok":true,"data":{}}`: a success that carries no list.
    NoList,
}

/// A lease method, for the failure knob.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub enum LeaseOp {
    /// `agent_device.lease.allocate`.
    Allocate,
    /// `agent_device.lease.heartbeat`.
    Heartbeat,
    /// `agent_device.lease.release`.
    Release,
}

impl LeaseOp {
    fn command(self) -> &'static str {
        match self {
            Self::Allocate => "lease_allocate",
            Self::Heartbeat => "lease_heartbeat",
            Self::Release => "lease_release",
        }
    }
}

/// A rule that makes matching commands fail (with a `diagnosticsRecord`, so a client fetches the
/// request's diagnostics).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct CommandFailure {
    /// The command it matches (`devices`, `open`, `install_source`, …); `None` matches any.
    #[serde(default)]
    pub command: Option<String>,
    /// The platform it matches: the command's `--platform` selector, else its session's device
    /// platform; `None` matches any.
    #[serde(default)]
    pub platform: Option<String>,
    /// The failure.
    pub error: DaemonError,
    /// How many commands it fails; `None` for every one.
    #[serde(default)]
    pub times: Option<u32>,
}

impl CommandFailure {
    /// A rule failing every command with `error`.
    pub fn new(error: DaemonError) -> Self {
        Self {
            command: None,
            platform: None,
            error,
            times: None,
        }
    }

    /// The same rule, for this command only.
    #[must_use]
    pub fn for_command(mut self, command: &str) -> Self {
        self.command = Some(command.to_owned());
        self
    }

    /// The same rule, for this platform only.
    #[must_use]
    pub fn on_platform(mut self, platform: &str) -> Self {
        self.platform = Some(platform.to_owned());
        self
    }

    /// The same rule, for the next `n` matching commands only.
    #[must_use]
    pub fn times(mut self, n: u32) -> Self {
        self.times = Some(n);
        self
    }
}

/// An open session.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Session {
    /// The effective name (`<tenant>:<session>` under tenant isolation).
    pub name: String,
    /// The device it holds.
    pub device: Device,
    /// The lease it was opened under; `close` releases it.
    pub lease_id: Option<LeaseId>,
    /// The tenant it was opened for.
    pub tenant: Option<TenantId>,
    /// The opener's working directory (`claimedBy.workspace`).
    pub workspace: Option<String>,
    /// When it was opened (epoch ms).
    pub opened_at: u64,
}

/// An artifact waiting to be downloaded once.
#[derive(Debug, Clone)]
pub(crate) struct Artifact {
    pub(crate) id: String,
    tenant: Option<TenantId>,
    artifact_type: &'static str,
    pub(crate) file_name: String,
    pub(crate) bytes: Bytes,
    created_at: u64,
    expires_at: u64,
}

impl Artifact {
    /// The `content-type` of its download.
    pub(crate) const MIME: &'static str = "application/octet-stream";

    fn visible_to(&self, tenant: Option<&TenantId>) -> bool {
        self.tenant.is_none() || self.tenant.as_ref() == tenant
    }
}

#[derive(Debug, Clone)]
struct DiagRecord {
    session: String,
    request_id: String,
    ndjson: String,
}

/// The knobs a test turns.
#[derive(Debug, Clone)]
pub(crate) struct Knobs {
    pub(crate) devices: DevicesAnswer,
    pub(crate) lease_failures: BTreeMap<LeaseOp, (u32, DaemonError)>,
    pub(crate) command_failures: Vec<CommandFailure>,
    pub(crate) rpc_delay: Option<Duration>,
    pub(crate) screenshot: Bytes,
}

/// A JSON-RPC method, in either spelling.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Method {
    Command,
    Lease(LeaseOp),
    InstallFromSource,
    ReleaseMaterializedPaths,
}

impl Method {
    /// The method of this name (`agent_device.*` or `agent-device.*`).
    pub(crate) fn parse(name: &str) -> Option<Self> {
        let rest = name
            .strip_prefix("agent_device.")
            .or_else(|| name.strip_prefix("agent-device."))?;
        match rest {
            "command" => Some(Self::Command),
            "lease.allocate" => Some(Self::Lease(LeaseOp::Allocate)),
            "lease.heartbeat" => Some(Self::Lease(LeaseOp::Heartbeat)),
            "lease.release" => Some(Self::Lease(LeaseOp::Release)),
            "install_from_source" => Some(Self::InstallFromSource),
            "release_materialized_paths" => Some(Self::ReleaseMaterializedPaths),
            _ => None,
        }
    }
}

/// An answer to write: a status and a JSON body (serialised, so that its fields keep the
/// daemon's order).
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Reply {
    pub(crate) status: StatusCode,
    pub(crate) body: String,
}

impl Reply {
    fn ok(id: &Value, data: &Value) -> Self {
        Self {
            status: StatusCode::OK,
            body: rpc_result(id, data),
        }
    }

    /// The body, parsed.
    #[cfg(test)]
    fn json(&self) -> Value {
        serde_json::from_str(&self.body).unwrap_or_default()
    }

    /// An envelope error with no `data`.
    pub(crate) fn bare(status: StatusCode, id: &Value, code: i64, message: &str) -> Self {
        Self {
            status,
            body: rpc_bare_error(id, code, message),
        }
    }

    /// A params failure: `-32602` with `data` but no diagnostics.
    pub(crate) fn invalid_params(id: &Value, message: &str, hint: Option<&str>) -> Self {
        let code = ErrorCode::InvalidArgs;
        let data = ErrorData {
            code,
            message,
            hint: hint.unwrap_or_else(|| code.default_hint()),
            diagnostic_id: None,
            log_path: None,
            diagnostics_record: None,
            retriable: None,
            details: None,
        };
        Self {
            status: StatusCode::BAD_REQUEST,
            body: rpc_error(id, rpc_code::INVALID_PARAMS, message, &data),
        }
    }
}

/// The params of `agent_device.command`, checked as `commandRpcParamsSchema` checks them.
#[derive(Debug, Clone)]
pub(crate) struct CommandParams {
    session: String,
    command: String,
    positionals: Vec<Value>,
    flags: Map<String, Value>,
    meta: Map<String, Value>,
}

fn text<'a>(map: &'a Map<String, Value>, key: &str) -> Option<&'a str> {
    map.get(key).and_then(Value::as_str)
}

impl CommandParams {
    /// Checks the params.
    ///
    /// # Errors
    /// The `-32602` reply for params that do not fit.
    pub(crate) fn read(id: &Value, params: &Value) -> Result<Self, Reply> {
        let Some(params) = params.as_object() else {
            return Err(Reply::invalid_params(
                id,
                "Invalid params: Expected an object",
                None,
            ));
        };
        let command = match params.get("command") {
            None | Some(Value::Null) => {
                return Err(Reply::bare(
                    StatusCode::BAD_REQUEST,
                    id,
                    rpc_code::INVALID_PARAMS,
                    "Invalid params: command is required",
                ));
            }
            Some(Value::String(command)) => command.clone(),
            Some(_) => {
                return Err(Reply::invalid_params(
                    id,
                    "Invalid params: command: Expected a string",
                    None,
                ));
            }
        };
        let session = match params.get("session") {
            None | Some(Value::Null) => "default".to_owned(),
            Some(Value::String(session)) => session.clone(),
            Some(_) => {
                return Err(Reply::invalid_params(
                    id,
                    "Invalid params: session: Expected a string",
                    None,
                ));
            }
        };
        let positionals = match params.get("positionals") {
            None | Some(Value::Null) => Vec::new(),
            Some(Value::Array(items)) => items.clone(),
            Some(_) => {
                return Err(Reply::invalid_params(
                    id,
                    "Invalid params: positionals: Expected an array",
                    None,
                ));
            }
        };
        let object = |key: &str| match params.get(key) {
            None | Some(Value::Null) => Ok(Map::new()),
            Some(Value::Object(map)) => Ok(map.clone()),
            Some(_) => Err(Reply::invalid_params(
                id,
                &format!("Invalid params: {key}: Expected an object"),
                None,
            )),
        };
        Ok(Self {
            session,
            command,
            positionals,
            flags: object("flags")?,
            meta: object("meta")?,
        })
    }

    /// Whether the caller asked for an NDJSON progress stream.
    pub(crate) fn wants_progress(&self) -> bool {
        matches!(
            text(&self.meta, "requestProgress"),
            Some("command" | "replay-test")
        )
    }

    /// A field of `meta`, else the same-meaning field of `flags`.
    fn scoped(&self, meta_key: &str, flag_key: &str) -> Option<&str> {
        text(&self.meta, meta_key).or_else(|| text(&self.flags, flag_key))
    }

    fn positional(&self, index: usize) -> Option<&str> {
        self.positionals.get(index).and_then(Value::as_str)
    }
}

/// The checked params of `install_from_source` (or of the `install_source` command).
#[derive(Debug, Clone)]
pub(crate) struct InstallCall {
    session: String,
    request_id: Option<String>,
    platform: &'static str,
    source_kind: &'static str,
    retain: Option<u64>,
}

/// Why install params were refused: the `-32602` message and, rarely, a hint of its own.
#[derive(Debug, Clone)]
struct InstallRefusal {
    message: &'static str,
    hint: Option<&'static str>,
}

impl InstallRefusal {
    fn reply(&self, id: &Value) -> Reply {
        Reply::invalid_params(id, self.message, self.hint)
    }
}

/// Reads install params; `uploaded` says whether the call names an uploaded artifact, which is
/// what a `path` source may then name.
fn read_install(
    params: &Map<String, Value>,
    uploaded: bool,
) -> Result<InstallCall, InstallRefusal> {
    let invalid = |message| InstallRefusal {
        message,
        hint: None,
    };
    let platform = match text(params, "platform") {
        Some("ios") => "ios",
        Some("android") => "android",
        _ => {
            return Err(invalid(
                "Invalid params: platform must be \"ios\" or \"android\"",
            ));
        }
    };
    let Some(source) = params.get("source").and_then(Value::as_object) else {
        return Err(invalid("Invalid params: source is required"));
    };
    let source_kind = match text(source, "kind") {
        Some("url") if text(source, "url").is_some_and(|u| !u.is_empty()) => "url",
        Some("url") => return Err(invalid("Invalid params: source.url is required")),
        Some("github-actions-artifact")
            if text(source, "owner").is_some()
                && text(source, "repo").is_some()
                && (source.get("artifactId").is_some()
                    || text(source, "artifactName").is_some()) =>
        {
            "github-actions-artifact"
        }
        Some("github-actions-artifact") => {
            return Err(invalid(
                "Invalid params: source needs owner, repo and artifactId or artifactName",
            ));
        }
        Some("path") if uploaded => "uploaded-artifact",
        Some("path") => {
            return Err(InstallRefusal {
                message: "Invalid params: source.kind \"path\" names a file on the daemon host and is not accepted over HTTP",
                hint: Some("Use a \"url\" or \"github-actions-artifact\" source."),
            });
        }
        _ => {
            return Err(invalid(
                "Invalid params: source.kind must be \"url\", \"path\" or \"github-actions-artifact\"",
            ));
        }
    };
    let retain = (params.get("retainPaths") == Some(&Value::Bool(true))).then(|| {
        params
            .get("retentionMs")
            .and_then(Value::as_u64)
            .unwrap_or(MATERIALIZATION_TTL_MS)
    });
    Ok(InstallCall {
        session: text(params, "session").unwrap_or("default").to_owned(),
        request_id: text(params, "requestId").map(str::to_owned),
        platform,
        source_kind,
        retain,
    })
}

/// A call whose params fit its method.
#[derive(Debug, Clone)]
pub(crate) enum Checked {
    Command(CommandParams),
    Lease(LeaseOp, LeaseCall),
    Install(InstallCall),
    ReleaseMaterialized {
        session: String,
        request_id: Option<String>,
        materialization: String,
    },
}

impl Checked {
    /// Checks `params` against `method`; `public_only` when the request carried
    /// `x-agent-device-network-access: public-only` (a proxy in front), which refuses `path`
    /// install sources that name no uploaded artifact.
    ///
    /// # Errors
    /// The `-32602` reply.
    pub(crate) fn read(
        method: Method,
        id: &Value,
        params: &Value,
        public_only: bool,
    ) -> Result<Self, Reply> {
        match method {
            Method::Command => {
                let params = CommandParams::read(id, params)?;
                let local_path = params.command == "install_source"
                    && params
                        .meta
                        .get("installSource")
                        .and_then(|source| source.get("kind"))
                        .and_then(Value::as_str)
                        == Some("path")
                    && text(&params.meta, "uploadedArtifactId").is_none();
                if public_only && local_path {
                    return Err(Reply::invalid_params(
                        id,
                        "Invalid params: path install sources are disabled on the remote HTTP surface",
                        None,
                    ));
                }
                Ok(Self::Command(params))
            }
            Method::Lease(op) => Ok(Self::Lease(op, LeaseCall::read(params))),
            Method::InstallFromSource | Method::ReleaseMaterializedPaths => {
                let Some(map) = params.as_object() else {
                    return Err(Reply::invalid_params(
                        id,
                        "Invalid params: Expected an object",
                        None,
                    ));
                };
                if method == Method::InstallFromSource {
                    return read_install(map, false)
                        .map(Self::Install)
                        .map_err(|refusal| refusal.reply(id));
                }
                let Some(materialization) =
                    text(map, "materializationId").filter(|m| !m.is_empty())
                else {
                    return Err(Reply::invalid_params(
                        id,
                        "Invalid params: materializationId is required",
                        None,
                    ));
                };
                Ok(Self::ReleaseMaterialized {
                    session: text(map, "session").unwrap_or("default").to_owned(),
                    request_id: text(map, "requestId").map(str::to_owned),
                    materialization: materialization.to_owned(),
                })
            }
        }
    }

    /// Whether the reply streams as NDJSON.
    pub(crate) fn wants_progress(&self) -> bool {
        matches!(self, Self::Command(params) if params.wants_progress())
    }
}

/// Who is asking and about what: what a diagnostics record names.
#[derive(Debug, Clone)]
pub(crate) struct Ctx {
    rpc_id: Value,
    request_id: String,
    session: String,
    command: String,
    tenant: Option<TenantId>,
    isolated: bool,
}

/// A call that passed its checks and now runs (a hold or a delay may keep it waiting first).
#[derive(Debug, Clone)]
pub(crate) struct Prepared {
    ctx: Ctx,
    call: Call,
}

#[derive(Debug, Clone)]
enum Call {
    Command {
        params: CommandParams,
        lease: Option<LeaseId>,
    },
    Lease(LeaseOp, LeaseCall),
    Install(InstallCall),
    ReleaseMaterialized(String),
}

impl Prepared {
    /// The command's internal name (`open`, `lease_allocate`, `install_source`, …), which holds
    /// match.
    pub(crate) fn command(&self) -> &str {
        &self.ctx.command
    }
}

/// Where the daemon keeps its files, and its pid: the parts of paths and ids it reports.
#[derive(Debug, Clone)]
pub(crate) struct Identity {
    pub(crate) state_dir: String,
    pub(crate) pid: u32,
}

/// The daemon's state.
#[derive(Debug)]
pub(crate) struct Model {
    identity: Identity,
    devices: Vec<Device>,
    pub(crate) leases: LeaseRegistry,
    pub(crate) uploads: Uploads,
    sessions: BTreeMap<String, Session>,
    diagnostics: VecDeque<DiagRecord>,
    artifacts: BTreeMap<String, Artifact>,
    materializations: BTreeMap<String, u64>,
    pub(crate) knobs: Knobs,
}

impl Model {
    pub(crate) fn new(identity: Identity, devices: Vec<Device>, ttl: TtlPolicy) -> Self {
        Self {
            identity,
            knobs: Knobs {
                devices: DevicesAnswer::List(devices.clone()),
                lease_failures: BTreeMap::new(),
                command_failures: Vec::new(),
                rpc_delay: None,
                screenshot: Bytes::from_static(TINY_PNG),
            },
            devices,
            leases: LeaseRegistry::new(ttl),
            uploads: Uploads::default(),
            sessions: BTreeMap::new(),
            diagnostics: VecDeque::new(),
            artifacts: BTreeMap::new(),
            materializations: BTreeMap::new(),
        }
    }

    /// Sets what `devices` answers; a list also becomes what `open` picks from.
    pub(crate) fn set_devices(&mut self, answer: DevicesAnswer) {
        if let DevicesAnswer::List(devices) = &answer {
            self.devices.clone_from(devices);
        }
        self.knobs.devices = answer;
    }

    /// The open sessions.
    pub(crate) fn sessions(&self) -> Vec<Session> {
        self.sessions.values().cloned().collect()
    }

    /// The finalized uploads.
    pub(crate) fn finalized_uploads(&self) -> Vec<FinalizedUpload> {
        self.uploads.finalized().to_vec()
    }

    /// The active leases.
    pub(crate) fn active_leases(&self, now: u64) -> Vec<Lease> {
        self.leases.active(now)
    }

    fn derived_request_id(&self, rpc_id: &Value, now: u64) -> String {
        let id = match rpc_id {
            Value::String(id) => id.clone(),
            other => other.to_string(),
        };
        format!("req:{id}:{}:{now}:{}", self.identity.pid, random_base36(8))
    }

    fn session_dir(&self, session: &str) -> String {
        format!(
            "{}/sessions/{}",
            self.identity.state_dir,
            file_safe(session)
        )
    }

    fn request_log(&self, session: &str, request_id: &str) -> String {
        format!(
            "{}/requests/{}.ndjson",
            self.session_dir(session),
            file_safe(request_id)
        )
    }

    /// The failure reply for `err`, recording the request's diagnostics unless the failure
    /// came before a request log existed.
    fn fail(&mut self, ctx: &Ctx, err: &DaemonError, now: u64) -> Reply {
        let mut random = [0u8; 4];
        rand::fill(&mut random);
        let diagnostic_id = format!("{}-{}", base36(now), hex(&random));
        let record = (!err.unlogged).then(|| DiagnosticsRecord {
            session: ctx.session.clone(),
            request_id: ctx.request_id.clone(),
        });
        let log_path = match &record {
            Some(record) => self.request_log(&record.session, &record.request_id),
            None => format!("{}/daemon.log", self.identity.state_dir),
        };
        if record.is_some() {
            self.record_diagnostics(ctx, err, &log_path, now);
        }
        let retriable = err
            .retriable
            .or((err.code == ErrorCode::DeviceInUse).then_some(true));
        let data = ErrorData {
            code: err.code,
            message: &err.message,
            hint: err.effective_hint(),
            diagnostic_id: Some(&diagnostic_id),
            log_path: Some(&log_path),
            diagnostics_record: record.as_ref(),
            retriable,
            details: err.details.as_ref(),
        };
        Reply {
            status: err.http_status(),
            body: rpc_error(&ctx.rpc_id, rpc_code::HANDLER, &err.message, &data),
        }
    }

    fn record_diagnostics(&mut self, ctx: &Ctx, err: &DaemonError, log_path: &str, now: u64) {
        let mut start = Map::new();
        start.insert("publicSession".into(), json!(ctx.session));
        start.insert("effectiveSession".into(), json!(ctx.session));
        start.insert("command".into(), json!(ctx.command));
        if ctx.isolated
            && let Some(tenant) = &ctx.tenant
        {
            start.insert("tenant".into(), json!(tenant));
            start.insert("isolation".into(), json!("tenant"));
        }
        start.insert("requestLogPath".into(), json!(log_path));
        start.insert(
            "runnerLogPath".into(),
            json!(format!("{}/runner.log", self.session_dir(&ctx.session))),
        );
        let line = |level: &str, phase: &str, data: Value| {
            json!({
                "ts": iso8601(now),
                "level": level,
                "phase": phase,
                "session": ctx.session,
                "requestId": ctx.request_id,
                "command": ctx.command,
                "data": data,
            })
        };
        let lines = [
            line("info", "request_start", Value::Object(start)),
            line(
                "error",
                "request_failed",
                json!({ "code": err.code, "message": err.message }),
            ),
        ];
        let mut ndjson = String::new();
        for line in lines {
            ndjson.push_str(&line.to_string());
            ndjson.push('\n');
        }
        if self.diagnostics.len() == DIAGNOSTICS_KEPT {
            self.diagnostics.pop_front();
        }
        self.diagnostics.push_back(DiagRecord {
            session: ctx.session.clone(),
            request_id: ctx.request_id.clone(),
            ndjson,
        });
    }

    /// The NDJSON diagnostics of a failed request.
    ///
    /// # Errors
    /// `SESSION_NOT_FOUND` when no failed request of that id is known in that session.
    pub(crate) fn diagnostics(
        &self,
        session: &str,
        request_id: &str,
    ) -> Result<String, DaemonError> {
        self.diagnostics
            .iter()
            .rev()
            .find(|r| r.session == session && r.request_id == request_id)
            .map(|r| r.ndjson.clone())
            .ok_or_else(|| {
                DaemonError::new(
                    ErrorCode::SessionNotFound,
                    format!("No diagnostics record for request {request_id} in session {session}"),
                )
            })
    }

    /// The artifacts a tenant may see (`GET /artifacts`).
    pub(crate) fn artifact_list(&mut self, tenant: Option<&TenantId>, now: u64) -> Value {
        self.artifacts.retain(|_, a| a.expires_at > now);
        let items: Vec<Value> = self
            .artifacts
            .values()
            .filter(|a| a.visible_to(tenant))
            .map(|a| {
                json!({
                    "id": a.id,
                    "artifactType": a.artifact_type,
                    "filename": a.file_name,
                    "mimeType": Artifact::MIME,
                    "sizeBytes": a.bytes.len(),
                    "createdAt": iso8601(a.created_at),
                    "expiresAt": iso8601(a.expires_at),
                })
            })
            .collect();
        json!({ "artifacts": items })
    }

    /// Takes an artifact for its one download.
    ///
    /// # Errors
    /// An unknown, expired or already downloaded artifact (`COMMAND_FAILED`), or another
    /// tenant's (`UNAUTHORIZED`).
    pub(crate) fn take_artifact(
        &mut self,
        id: &str,
        tenant: Option<&TenantId>,
        now: u64,
    ) -> Result<Artifact, DaemonError> {
        self.artifacts.retain(|_, a| a.expires_at > now);
        let artifact = self.artifacts.get(id).ok_or_else(|| {
            DaemonError::new(
                ErrorCode::CommandFailed,
                format!("Artifact not found or expired: {id}"),
            )
        })?;
        if !artifact.visible_to(tenant) {
            return Err(DaemonError::new(
                ErrorCode::Unauthorized,
                "Artifact belongs to a different tenant",
            ));
        }
        self.artifacts
            .remove(id)
            .ok_or_else(|| DaemonError::new(ErrorCode::Unknown, "artifact vanished"))
    }

    /// Runs the checks a call makes before it executes.
    ///
    /// # Errors
    /// The failure reply.
    pub(crate) fn begin(
        &mut self,
        id: Value,
        checked: Checked,
        now: u64,
    ) -> Result<Prepared, Reply> {
        match checked {
            Checked::Command(params) => self.begin_command(id, params, now),
            Checked::Lease(op, call) => {
                let ctx = Ctx {
                    request_id: self.derived_request_id(&id, now),
                    rpc_id: id,
                    session: call.session.clone(),
                    command: op.command().to_owned(),
                    tenant: call.tenant().cloned(),
                    isolated: false,
                };
                Ok(Prepared {
                    ctx,
                    call: Call::Lease(op, call),
                })
            }
            Checked::Install(call) => {
                let ctx = Ctx {
                    request_id: call
                        .request_id
                        .clone()
                        .unwrap_or_else(|| self.derived_request_id(&id, now)),
                    rpc_id: id,
                    session: call.session.clone(),
                    command: "install_source".to_owned(),
                    tenant: None,
                    isolated: false,
                };
                Ok(Prepared {
                    ctx,
                    call: Call::Install(call),
                })
            }
            Checked::ReleaseMaterialized {
                session,
                request_id,
                materialization,
            } => {
                let ctx = Ctx {
                    request_id: request_id.unwrap_or_else(|| self.derived_request_id(&id, now)),
                    rpc_id: id,
                    session,
                    command: "release_materialized_paths".to_owned(),
                    tenant: None,
                    isolated: false,
                };
                Ok(Prepared {
                    ctx,
                    call: Call::ReleaseMaterialized(materialization),
                })
            }
        }
    }

    fn begin_command(
        &mut self,
        id: Value,
        params: CommandParams,
        now: u64,
    ) -> Result<Prepared, Reply> {
        let request_id = text(&params.meta, "requestId")
            .filter(|r| !r.is_empty())
            .map_or_else(|| self.derived_request_id(&id, now), str::to_owned);
        let isolated = params.scoped("sessionIsolation", "sessionIsolation") == Some("tenant");
        let mut ctx = Ctx {
            rpc_id: id,
            request_id,
            session: params.session.clone(),
            command: params.command.clone(),
            tenant: None,
            isolated,
        };
        let tenant = match params.scoped("tenantId", "tenant") {
            None => None,
            Some(raw) => match TenantId::parse(raw) {
                Some(tenant) => Some(tenant),
                None => {
                    let err = DaemonError::invalid_args(
                        "Invalid tenant id. Use 1-128 chars: letters, numbers, dot, underscore, hyphen.",
                    )
                    .unlogged();
                    return Err(self.fail(&ctx, &err, now));
                }
            },
        };
        ctx.tenant.clone_from(&tenant);
        let run_raw = params.scoped("runId", "runId");
        let lease_raw = params.scoped("leaseId", "leaseId");
        if isolated {
            let Some(tenant) = &tenant else {
                let err = DaemonError::invalid_args(
                    "session isolation mode tenant requires --tenant (or meta.tenantId).",
                )
                .unlogged();
                return Err(self.fail(&ctx, &err, now));
            };
            ctx.session = format!("{tenant}:{}", params.session);
            let run_problem = match run_raw {
                None => Some("tenant isolation requires run id."),
                Some(raw) if RunId::parse(raw).is_none() => Some(
                    "Invalid run id. Use 1-128 chars: letters, numbers, dot, underscore, hyphen.",
                ),
                Some(_) => None,
            };
            if let Some(problem) = run_problem {
                return Err(self.fail(&ctx, &DaemonError::invalid_args(problem), now));
            }
            if lease_raw.and_then(LeaseId::parse).is_none() {
                let err = DaemonError::invalid_args("tenant isolation requires lease id.");
                return Err(self.fail(&ctx, &err, now));
            }
        }
        let run = run_raw.and_then(RunId::parse);
        let lease = lease_raw.and_then(LeaseId::parse);
        let backend = params
            .scoped("leaseBackend", "leaseBackend")
            .and_then(LeaseBackend::parse)
            .unwrap_or_default();
        if params.command != "devices"
            && let (Some(tenant), Some(lease)) = (&tenant, &lease)
            && let Err(err) = self
                .leases
                .admit_command(tenant, run.as_ref(), lease, backend, now)
        {
            return Err(self.fail(&ctx, &err, now));
        }
        if let (Some(session), Some(named)) = (self.sessions.get(&ctx.session), &lease)
            && let Some(held) = &session.lease_id
            && held != named
        {
            let err = DaemonError::unauthorized(
                "Lease does not match session owner (leaseId)",
                "LEASE_SESSION_MISMATCH",
            )
            .with_details(json!({ "reason": "LEASE_SESSION_MISMATCH", "field": "leaseId" }));
            return Err(self.fail(&ctx, &err, now));
        }
        Ok(Prepared {
            ctx,
            call: Call::Command { params, lease },
        })
    }

    /// Runs a prepared call.
    pub(crate) fn finish(&mut self, prepared: Prepared, now: u64) -> Reply {
        let Prepared { ctx, call } = prepared;
        let outcome = match call {
            Call::Command { params, lease } => self.command(&ctx, &params, lease, now),
            Call::Lease(op, call) => self.lease(op, &call, now),
            Call::Install(call) => self.install_source(&call, now),
            Call::ReleaseMaterialized(id) => self.release_materialized(&id, now),
        };
        match outcome {
            Ok(data) => Reply::ok(&ctx.rpc_id, &data),
            Err(err) => self.fail(&ctx, &err, now),
        }
    }

    fn lease(&mut self, op: LeaseOp, call: &LeaseCall, now: u64) -> Result<Value, DaemonError> {
        if let Some(early) = call.early_failure() {
            return Err(early);
        }
        if let Some((left, err)) = self.knobs.lease_failures.get_mut(&op) {
            let err = err.clone();
            *left -= 1;
            if *left == 0 {
                self.knobs.lease_failures.remove(&op);
            }
            return Err(err);
        }
        match op {
            LeaseOp::Allocate => {
                let lease = self.leases.allocate(call, now)?;
                Ok(json!({ "lease": lease.wire() }))
            }
            LeaseOp::Heartbeat => {
                let lease = self.leases.heartbeat(call, now)?;
                Ok(json!({ "lease": lease.wire() }))
            }
            LeaseOp::Release => {
                let released = self.leases.release(call, now)? == Released::Released;
                Ok(json!({ "released": released }))
            }
        }
    }

    fn injected_failure(&mut self, command: &str, platform: Option<&str>) -> Option<DaemonError> {
        let index = self.knobs.command_failures.iter().position(|rule| {
            rule.command.as_deref().is_none_or(|c| c == command)
                && rule.platform.as_deref().is_none_or(|p| platform == Some(p))
        })?;
        let rule = &mut self.knobs.command_failures[index];
        let err = rule.error.clone();
        if let Some(left) = &mut rule.times {
            *left = left.saturating_sub(1);
            if *left == 0 {
                self.knobs.command_failures.remove(index);
            }
        }
        Some(err)
    }

    fn command(
        &mut self,
        ctx: &Ctx,
        params: &CommandParams,
        lease: Option<LeaseId>,
        now: u64,
    ) -> Result<Value, DaemonError> {
        let session_platform = self
            .sessions
            .get(&ctx.session)
            .map(|s| s.device.platform.as_str());
        let platform = text(&params.flags, "platform").or(session_platform);
        if let Some(err) = self.injected_failure(&params.command, platform) {
            return Err(err);
        }
        let data = match params.command.as_str() {
            "devices" => self.devices(params)?,
            "open" => self.open(ctx, params, lease, now)?,
            "close" => self.close(ctx, now)?,
            "screenshot" => self.screenshot(ctx, params, now)?,
            "install" | "reinstall" => self.install(ctx, params, now)?,
            "install_source" => {
                // The CLI sends the source in meta.installSource and the rest as flags.
                let mut call_params = Map::new();
                for key in ["platform", "retainPaths", "retentionMs"] {
                    if let Some(value) = params.flags.get(key) {
                        call_params.insert(key.into(), value.clone());
                    }
                }
                if let Some(source) = params.meta.get("installSource") {
                    call_params.insert("source".into(), source.clone());
                }
                call_params.insert("session".into(), json!(ctx.session));
                let uploaded = self.check_uploaded(ctx, params, now)?;
                let call = read_install(&call_params, uploaded).map_err(|refusal| {
                    let err = DaemonError::invalid_args(refusal.message);
                    match refusal.hint {
                        Some(hint) => err.with_hint(hint),
                        None => err,
                    }
                })?;
                return self.install_source(&call, now);
            }
            other => {
                if !SESSIONLESS.contains(&other) && !self.sessions.contains_key(&ctx.session) {
                    return Err(DaemonError::new(
                        ErrorCode::SessionNotFound,
                        "No active session. Run open first.",
                    ));
                }
                if other == "snapshot" {
                    json!({ "nodes": [], "truncated": false })
                } else {
                    json!({})
                }
            }
        };
        Ok(data)
    }

    fn devices(&self, params: &CommandParams) -> Result<Value, DaemonError> {
        let devices = match &self.knobs.devices {
            DevicesAnswer::Error(err) => return Err(err.clone()),
            DevicesAnswer::NoList => return Ok(json!({})),
            DevicesAnswer::List(devices) => devices,
        };
        let selector = text(&params.flags, "platform");
        let listed: Vec<Value> = devices
            .iter()
            .filter(|d| selector.is_none_or(|s| d.platform.matches_selector(s)))
            .map(|device| {
                let mut entry = serde_json::to_value(device).unwrap_or_default();
                if let Some(holder) = self
                    .sessions
                    .values()
                    .find(|s| s.device.platform == device.platform && s.device.id == device.id)
                    && let Some(entry) = entry.as_object_mut()
                {
                    let mut claim = Map::new();
                    claim.insert("session".into(), json!(holder.name));
                    if let Some(workspace) = &holder.workspace {
                        claim.insert("workspace".into(), json!(workspace));
                    }
                    entry.insert("claimedBy".into(), Value::Object(claim));
                }
                entry
            })
            .collect();
        Ok(json!({ "devices": listed }))
    }

    fn open(
        &mut self,
        ctx: &Ctx,
        params: &CommandParams,
        lease: Option<LeaseId>,
        now: u64,
    ) -> Result<Value, DaemonError> {
        if self.sessions.contains_key(&ctx.session) {
            return Err(DaemonError::invalid_args(
                "Session already active. Close it first or pass a new --session name.",
            ));
        }
        let selector = text(&params.flags, "platform");
        let by_id = text(&params.flags, "udid").or_else(|| text(&params.flags, "serial"));
        let by_name = text(&params.flags, "device");
        let candidates: Vec<&Device> = self
            .devices
            .iter()
            .filter(|d| d.booted)
            .filter(|d| selector.is_none_or(|s| d.platform.matches_selector(s)))
            .filter(|d| by_id.is_none_or(|id| d.id == id))
            .filter(|d| by_name.is_none_or(|name| d.name == name || d.id == name))
            .collect();
        let Some(device) = candidates.first().map(|d| (*d).clone()) else {
            return Err(DaemonError::new(
                ErrorCode::DeviceNotFound,
                "No booted device matches the requested selectors",
            ));
        };
        if let Some(holder) = self
            .sessions
            .values()
            .find(|s| s.device.platform == device.platform && s.device.id == device.id)
        {
            return Err(DaemonError::new(
                ErrorCode::DeviceInUse,
                format!("Device is claimed by session {}", holder.name),
            )
            .with_details(json!({ "reason": "DEVICE_CLAIM_LIVE_OWNER", "session": holder.name })));
        }
        let count = candidates.len();
        let dir = self.session_dir(&ctx.session);
        self.sessions.insert(
            ctx.session.clone(),
            Session {
                name: ctx.session.clone(),
                device: device.clone(),
                lease_id: lease,
                tenant: ctx.tenant.clone(),
                workspace: text(&params.meta, "cwd").map(str::to_owned),
                opened_at: now,
            },
        );
        Ok(json!({
            "session": ctx.session,
            "surface": "app",
            "sessionStateDir": dir,
            "runnerLogPath": format!("{dir}/runner.log"),
            "requestLogPath": self.request_log(&ctx.session, &ctx.request_id),
            "eventLogPath": format!("{dir}/events.ndjson"),
            "sessionReused": false,
            "selection": {
                "reason": if count == 1 { "single-booted-local" } else { "first-booted-local" },
                "source": "local",
                "candidateCount": count,
                "bootOccurred": false,
            },
            "timing": { "totalDurationMs": 0 },
            "platform": device.platform,
            "target": device.target,
            "device": device.name,
            "id": device.id,
            "kind": device.kind,
            "message": format!("Opened: {}", ctx.session),
        }))
    }

    fn close(&mut self, ctx: &Ctx, now: u64) -> Result<Value, DaemonError> {
        let Some(session) = self.sessions.remove(&ctx.session) else {
            return Err(DaemonError::new(
                ErrorCode::SessionNotFound,
                "No active session",
            ));
        };
        if let Some(lease) = &session.lease_id {
            self.leases.release_id(lease, now);
        }
        Ok(json!({ "session": ctx.session, "message": format!("Closed: {}", ctx.session) }))
    }

    fn screenshot(
        &mut self,
        ctx: &Ctx,
        params: &CommandParams,
        now: u64,
    ) -> Result<Value, DaemonError> {
        if !self.sessions.contains_key(&ctx.session) {
            return Err(DaemonError::new(
                ErrorCode::SessionNotFound,
                "No active session. Run open first.",
            ));
        }
        let path = params.positional(0).map_or_else(
            || {
                format!(
                    "/tmp/agent-device-screenshot-{}/screenshot.png",
                    random_base36(6)
                )
            },
            str::to_owned,
        );
        let bytes = self.knobs.screenshot.clone();
        let (width, height) = png_size(&bytes);
        let mut data = json!({
            "path": path,
            "message": format!("Saved screenshot: {path}"),
            "width": width,
            "height": height,
        });
        if let Some(local) = params
            .meta
            .get("clientArtifactPaths")
            .and_then(|paths| paths.get("path"))
            .and_then(Value::as_str)
        {
            let artifact = Artifact {
                id: uuid(),
                tenant: ctx.tenant.clone(),
                artifact_type: "screenshot",
                file_name: sanitize_file_name(local),
                bytes,
                created_at: now,
                expires_at: now + ARTIFACT_TTL_MS,
            };
            data["artifacts"] = json!([{
                "field": "path",
                "artifactType": artifact.artifact_type,
                "artifactId": artifact.id,
                "fileName": artifact.file_name,
                "localPath": local,
            }]);
            self.artifacts.insert(artifact.id.clone(), artifact);
        }
        Ok(data)
    }

    /// Checks a command's `meta.uploadedArtifactId`: finalized within the last five minutes,
    /// for no tenant or the command's.
    fn check_uploaded(
        &self,
        ctx: &Ctx,
        params: &CommandParams,
        now: u64,
    ) -> Result<bool, DaemonError> {
        let Some(uploaded) = text(&params.meta, "uploadedArtifactId") else {
            return Ok(false);
        };
        let known = self.uploads.finalized().iter().any(|u| {
            u.id == uploaded
                && u.finalized_at + UPLOAD_IDLE_MS > now
                && (u.tenant.is_none() || u.tenant.as_ref() == ctx.tenant.as_ref())
        });
        if !known {
            return Err(DaemonError::new(
                ErrorCode::CommandFailed,
                format!("Uploaded artifact not found or expired: {uploaded}"),
            )
            .with_hint(
                "Uploaded artifacts expire 5 minutes after upload. Upload the file again and retry with the new upload id.",
            )
            .with_details(json!({ "reason": "RESOURCE_EXPIRED" })));
        }
        Ok(true)
    }

    fn install(&self, ctx: &Ctx, params: &CommandParams, now: u64) -> Result<Value, DaemonError> {
        let uploaded = self.check_uploaded(ctx, params, now)?;
        if !uploaded
            && let Some(path) = params.positional(1)
            && !std::path::Path::new(path).exists()
        {
            return Err(DaemonError::invalid_args(format!(
                "App binary not found: {path}"
            )));
        }
        let app = params.positional(0).unwrap_or("app");
        Ok(json!({ "appId": app, "message": format!("Installed: {app}") }))
    }

    fn install_source(&mut self, call: &InstallCall, now: u64) -> Result<Value, DaemonError> {
        if let Some(err) = self.injected_failure("install_source", Some(call.platform)) {
            return Err(err);
        }
        if !self
            .devices
            .iter()
            .any(|d| d.booted && d.platform.matches_selector(call.platform))
        {
            return Err(DaemonError::new(
                ErrorCode::DeviceNotFound,
                format!("No booted {} device to install on", call.platform),
            ));
        }
        let materialization = uuid();
        let dir = format!("{}/materialized/{materialization}", self.identity.state_dir);
        let (app_id, file) = match call.platform {
            "ios" => ("com.agentdevice.fake", "Fake.app"),
            _ => ("com.agentdevice.fake", "fake.apk"),
        };
        let mut data = Map::new();
        data.insert("appName".into(), json!("Fake"));
        data.insert("appId".into(), json!(app_id));
        let id_key = if call.platform == "ios" {
            "bundleId"
        } else {
            "packageName"
        };
        data.insert(id_key.into(), json!(app_id));
        data.insert("launchTarget".into(), json!(app_id));
        data.insert("source".into(), json!(call.source_kind));
        if let Some(retain) = call.retain {
            data.insert("installablePath".into(), json!(format!("{dir}/{file}")));
            data.insert("materializationId".into(), json!(materialization));
            data.insert("materializationExpiresAt".into(), json!(now + retain));
            self.materializations.insert(materialization, now + retain);
        }
        Ok(Value::Object(data))
    }

    fn release_materialized(&mut self, id: &str, now: u64) -> Result<Value, DaemonError> {
        self.materializations.retain(|_, expires| *expires > now);
        if self.materializations.remove(id).is_none() {
            return Err(DaemonError::new(
                ErrorCode::CommandFailed,
                format!("Materialized paths not found or expired: {id}"),
            )
            .with_hint(
                "Materialized paths are released automatically when their TTL expires; re-run the command that materialized them if the paths are still needed.",
            )
            .with_details(json!({ "reason": "RESOURCE_EXPIRED" })));
        }
        Ok(json!({ "released": true, "materializationId": id }))
    }
}

/// The width and height in a PNG's header (0×0 for anything else).
fn png_size(bytes: &[u8]) -> (u32, u32) {
    let read = |at: usize| {
        bytes
            .get(at..at + 4)
            .and_then(|b| <[u8; 4]>::try_from(b).ok())
            .map_or(0, u32::from_be_bytes)
    };
    if bytes.starts_with(&[0x89, b'P', b'N', b'G']) && bytes.get(12..16) == Some(b"IHDR") {
        (read(16), read(20))
    } else {
        (0, 0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wire::Platform;

    const T0: u64 = 1_796_133_674_244;

    fn model() -> Model {
        Model::new(
            Identity {
                state_dir: "/state".to_owned(),
                pid: 42,
            },
            vec![
                Device::linux_local(),
                Device::android_emulator("emulator-5554", "Pixel"),
            ],
            TtlPolicy::default(),
        )
    }

    fn run(model: &mut Model, method: &str, params: Value) -> Reply {
        let id = json!("r1");
        let method = Method::parse(method).unwrap();
        let checked = match Checked::read(method, &id, &params, false) {
            Ok(checked) => checked,
            Err(reply) => return reply,
        };
        match model.begin(id, checked, T0) {
            Ok(prepared) => model.finish(prepared, T0),
            Err(reply) => reply,
        }
    }

    fn command(model: &mut Model, params: Value) -> Reply {
        run(model, "agent_device.command", params)
    }

    fn data(reply: &Reply) -> Value {
        assert_eq!(reply.status, StatusCode::OK, "{}", reply.body);
        reply.json()["result"]["data"].clone()
    }

    fn error(reply: &Reply) -> Value {
        reply.json()["error"]["data"].clone()
    }

    #[test]
    fn method_names_take_both_spellings() {
        assert_eq!(
            Method::parse("agent-device.lease.release"),
            Some(Method::Lease(LeaseOp::Release))
        );
        assert_eq!(
            Method::parse("agent_device.install_from_source"),
            Some(Method::InstallFromSource)
        );
        assert_eq!(Method::parse("agent_device.nope"), None);
        assert_eq!(Method::parse("command"), None);
    }

    #[test]
    fn params_that_do_not_fit_are_refused_before_anything_runs() {
        let mut model = model();
        let cases = [
            (json!([]), "Invalid params: Expected an object", true),
            (json!({}), "Invalid params: command is required", false),
            (
                json!({"command":5}),
                "Invalid params: command: Expected a string",
                true,
            ),
            (
                json!({"command":"devices","positionals":"x"}),
                "Invalid params: positionals: Expected an array",
                true,
            ),
            (
                json!({"command":"devices","flags":[]}),
                "Invalid params: flags: Expected an object",
                true,
            ),
            (
                json!({"command":"devices","session":5}),
                "Invalid params: session: Expected a string",
                true,
            ),
        ];
        for (params, message, has_data) in cases {
            let reply = command(&mut model, params.clone());
            assert_eq!(reply.status, StatusCode::BAD_REQUEST, "{params}");
            assert_eq!(reply.json()["error"]["code"], -32602, "{params}");
            assert_eq!(reply.json()["error"]["message"], message, "{params}");
            assert_eq!(
                reply.json()["error"].get("data").is_some(),
                has_data,
                "{params}"
            );
        }
        assert!(model.diagnostics.is_empty());
    }

    #[test]
    fn devices_lists_and_filters_by_platform() {
        let mut model = model();
        let all = command(&mut model, json!({"command":"devices"}));
        assert_eq!(data(&all)["devices"].as_array().map(Vec::len), Some(2));
        let android = command(
            &mut model,
            json!({"command":"devices","flags":{"platform":"android"}}),
        );
        assert_eq!(
            data(&android)["devices"],
            json!([{"platform":"android","id":"emulator-5554","name":"Pixel","kind":"emulator",
                    "target":"mobile","booted":true}])
        );
        let apple = command(
            &mut model,
            json!({"command":"devices","flags":{"platform":"apple"}}),
        );
        assert_eq!(data(&apple)["devices"], json!([]));
    }

    #[test]
    fn the_devices_knob_answers_an_error_or_no_list() {
        let mut model = model();
        model.set_devices(DevicesAnswer::NoList);
        assert_eq!(
            data(&command(&mut model, json!({"command":"devices"}))),
            json!({})
        );
        model.set_devices(DevicesAnswer::Error(DaemonError::new(
            ErrorCode::ToolMissing,
            "adb not found in PATH",
        )));
        let reply = command(&mut model, json!({"command":"devices"}));
        assert_eq!(reply.status.as_u16(), 500);
        assert_eq!(error(&reply)["code"], "TOOL_MISSING");
        model.set_devices(DevicesAnswer::List(vec![Device::ios_simulator(
            "U1", "iPhone",
        )]));
        let reply = command(&mut model, json!({"command":"devices"}));
        assert_eq!(data(&reply)["devices"][0]["platform"], "ios");
    }

    #[test]
    fn open_then_close_and_the_claim_shows_in_devices() {
        let mut model = model();
        let opened = command(
            &mut model,
            json!({"command":"open","session":"t1","flags":{"platform":"linux"},
                   "meta":{"requestId":"q1","cwd":"/work"}}),
        );
        let opened = data(&opened);
        assert_eq!(opened["message"], "Opened: t1");
        assert_eq!(opened["id"], "local");
        assert_eq!(opened["sessionStateDir"], "/state/sessions/t1");
        assert_eq!(
            opened["requestLogPath"],
            "/state/sessions/t1/requests/q1.ndjson"
        );
        let listed = command(
            &mut model,
            json!({"command":"devices","flags":{"platform":"linux"}}),
        );
        assert_eq!(
            data(&listed)["devices"][0]["claimedBy"],
            json!({"session":"t1","workspace":"/work"})
        );
        let again = command(
            &mut model,
            json!({"command":"open","session":"t1","flags":{"platform":"linux"}}),
        );
        assert_eq!(
            error(&again)["message"],
            "Session already active. Close it first or pass a new --session name."
        );
        let elsewhere = command(
            &mut model,
            json!({"command":"open","session":"t2","flags":{"platform":"linux"}}),
        );
        assert_eq!(error(&elsewhere)["code"], "DEVICE_IN_USE");
        let closed = command(&mut model, json!({"command":"close","session":"t1"}));
        assert_eq!(
            data(&closed),
            json!({"session":"t1","message":"Closed: t1"})
        );
        let twice = command(&mut model, json!({"command":"close","session":"t1"}));
        assert_eq!(twice.status, StatusCode::NOT_FOUND);
        assert_eq!(error(&twice)["message"], "No active session");
        assert_eq!(
            error(&twice)["diagnosticsRecord"]["session"],
            "t1",
            "a failed close names its diagnostics"
        );
    }

    #[test]
    fn open_without_a_matching_device_is_device_not_found() {
        let mut model = model();
        let reply = command(
            &mut model,
            json!({"command":"open","flags":{"platform":"ios"}}),
        );
        assert_eq!(error(&reply)["code"], "DEVICE_NOT_FOUND");
        assert!(model.sessions().is_empty());
    }

    #[test]
    fn a_failure_is_recorded_as_diagnostics() {
        let mut model = model();
        let reply = command(
            &mut model,
            json!({"command":"close","session":"s","meta":{"requestId":"abc"}}),
        );
        let err = error(&reply);
        assert_eq!(err["logPath"], "/state/sessions/s/requests/abc.ndjson");
        assert_eq!(
            err["hint"],
            "Run open first or pass an explicit device selector."
        );
        assert!(
            err["diagnosticId"]
                .as_str()
                .is_some_and(|d| d.starts_with(&base36(T0)))
        );
        let ndjson = model.diagnostics("s", "abc").unwrap();
        let lines: Vec<Value> = ndjson
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect();
        assert_eq!(lines.len(), 2);
        assert_eq!(lines[0]["phase"], "request_start");
        assert_eq!(lines[0]["ts"], iso8601(T0));
        assert_eq!(lines[0]["data"]["command"], "close");
        assert_eq!(
            lines[1]["data"],
            json!({"code":"SESSION_NOT_FOUND","message":"No active session"})
        );
        assert_eq!(
            model.diagnostics("s", "other").unwrap_err().message,
            "No diagnostics record for request other in session s"
        );
    }

    #[test]
    fn a_derived_request_id_names_the_rpc_id_and_pid() {
        let mut model = model();
        let reply = command(&mut model, json!({"command":"close","session":"s"}));
        let id = error(&reply)["diagnosticsRecord"]["requestId"]
            .as_str()
            .unwrap()
            .to_owned();
        assert!(id.starts_with(&format!("req:r1:42:{T0}:")), "{id}");
        assert_eq!(id.len(), format!("req:r1:42:{T0}:").len() + 8);
        assert_eq!(
            error(&reply)["logPath"],
            format!("/state/sessions/s/requests/{}.ndjson", file_safe(&id))
        );
    }

    fn lease_id(model: &mut Model, tenant: &str, run_id: &str, backend: &str) -> String {
        let reply = run(
            model,
            "agent_device.lease.allocate",
            json!({"tenantId":tenant,"runId":run_id,"backend":backend}),
        );
        data(&reply)["lease"]["leaseId"]
            .as_str()
            .unwrap()
            .to_owned()
    }

    #[test]
    fn tenant_isolation_needs_tenant_run_and_lease() {
        let mut model = model();
        let iso = |meta: Value| {
            let mut meta = meta;
            meta["sessionIsolation"] = json!("tenant");
            json!({"command":"open","session":"i1","flags":{"platform":"linux"},"meta":meta})
        };
        let no_tenant = command(&mut model, iso(json!({})));
        assert_eq!(
            error(&no_tenant)["message"],
            "session isolation mode tenant requires --tenant (or meta.tenantId)."
        );
        assert!(error(&no_tenant).get("diagnosticsRecord").is_none());
        assert_eq!(error(&no_tenant)["logPath"], "/state/daemon.log");
        let no_run = command(&mut model, iso(json!({"tenantId":"acme"})));
        assert_eq!(
            error(&no_run)["message"],
            "tenant isolation requires run id."
        );
        assert_eq!(error(&no_run)["diagnosticsRecord"]["session"], "acme:i1");
        let no_lease = command(&mut model, iso(json!({"tenantId":"acme","runId":"r1"})));
        assert_eq!(
            error(&no_lease)["message"],
            "tenant isolation requires lease id."
        );
        let bad_lease = command(
            &mut model,
            iso(json!({"tenantId":"acme","runId":"r1","leaseId":"zz"})),
        );
        assert_eq!(
            error(&bad_lease)["message"],
            "tenant isolation requires lease id."
        );
        let unknown = command(
            &mut model,
            iso(json!({"tenantId":"acme","runId":"r1","leaseId":"0".repeat(32)})),
        );
        assert_eq!(unknown.status, StatusCode::UNAUTHORIZED);
        assert_eq!(error(&unknown)["details"]["reason"], "LEASE_NOT_FOUND");

        let lease = lease_id(&mut model, "acme", "r1", "android-instance");
        let wrong_backend = command(
            &mut model,
            iso(json!({"tenantId":"acme","runId":"r1","leaseId":lease})),
        );
        assert_eq!(
            error(&wrong_backend)["details"]["reason"],
            "LEASE_SCOPE_MISMATCH"
        );
        let opened = command(
            &mut model,
            iso(json!({"tenantId":"acme","runId":"r1","leaseId":lease,
                       "leaseBackend":"android-instance"})),
        );
        assert_eq!(data(&opened)["message"], "Opened: acme:i1");
        assert_eq!(model.sessions()[0].name, "acme:i1");
        assert_eq!(
            model.sessions()[0].lease_id.as_ref().map(LeaseId::as_str),
            Some(lease.as_str())
        );
        let bad_tenant = command(&mut model, iso(json!({"tenantId":"a b"})));
        assert!(error(&bad_tenant).get("diagnosticsRecord").is_none());
    }

    #[test]
    fn close_releases_the_sessions_lease() {
        let mut model = model();
        let lease = lease_id(&mut model, "acme", "r1", "ios-simulator");
        let meta = json!({"tenantId":"acme","runId":"r1","leaseId":lease});
        let opened = command(
            &mut model,
            json!({"command":"open","session":"n1","flags":{"platform":"linux"},"meta":meta}),
        );
        data(&opened);
        let other_lease = lease_id(&mut model, "acme", "r2", "ios-simulator");
        let other = command(
            &mut model,
            json!({"command":"screenshot","session":"n1",
                   "meta":{"tenantId":"acme","leaseId":other_lease}}),
        );
        assert_eq!(error(&other)["details"]["reason"], "LEASE_SESSION_MISMATCH");
        assert_eq!(error(&other)["details"]["field"], "leaseId");
        data(&command(
            &mut model,
            json!({"command":"close","session":"n1","meta":meta}),
        ));
        let release = run(
            &mut model,
            "agent_device.lease.release",
            json!({"tenantId":"acme","runId":"r1","leaseId":lease}),
        );
        assert_eq!(data(&release), json!({"released":false}));
        assert_eq!(
            model.active_leases(T0).len(),
            1,
            "only the other run's lease is left"
        );
    }

    #[test]
    fn devices_does_not_check_the_lease() {
        let mut model = model();
        let reply = command(
            &mut model,
            json!({"command":"devices","meta":{"tenantId":"acme","leaseId":"0".repeat(32)}}),
        );
        data(&reply);
    }

    #[test]
    fn the_lease_failure_knob_fails_the_next_calls_then_stops() {
        let mut model = model();
        let lease = lease_id(&mut model, "acme", "r1", "ios-simulator");
        model.knobs.lease_failures.insert(
            LeaseOp::Release,
            (
                2,
                DaemonError::new(ErrorCode::CommandFailed, "release failed"),
            ),
        );
        let params = json!({"tenantId":"acme","runId":"r1","leaseId":lease});
        for _ in 0..2 {
            let reply = run(&mut model, "agent_device.lease.release", params.clone());
            assert_eq!(reply.status.as_u16(), 500);
            assert_eq!(error(&reply)["message"], "release failed");
            assert_eq!(
                model.active_leases(T0).len(),
                1,
                "a failed release keeps the lease"
            );
        }
        let reply = run(&mut model, "agent_device.lease.release", params);
        assert_eq!(data(&reply), json!({"released":true}));
    }

    #[test]
    fn the_command_failure_knob_matches_command_and_platform() {
        let mut model = model();
        model.knobs.command_failures.push(
            CommandFailure::new(DaemonError::new(
                ErrorCode::ToolMissing,
                "adb not found in PATH",
            ))
            .on_platform("android"),
        );
        model.knobs.command_failures.push(
            CommandFailure::new(DaemonError::new(ErrorCode::CommandFailed, "once"))
                .for_command("home")
                .times(1),
        );
        let android = command(
            &mut model,
            json!({"command":"devices","flags":{"platform":"android"}}),
        );
        assert_eq!(error(&android)["code"], "TOOL_MISSING");
        assert!(error(&android)["diagnosticsRecord"].is_object());
        data(&command(
            &mut model,
            json!({"command":"devices","flags":{"platform":"linux"}}),
        ));
        data(&command(
            &mut model,
            json!({"command":"open","session":"h","flags":{"platform":"linux"}}),
        ));
        let once = command(&mut model, json!({"command":"home","session":"h"}));
        assert_eq!(error(&once)["message"], "once");
        data(&command(
            &mut model,
            json!({"command":"home","session":"h"}),
        ));
    }

    #[test]
    fn a_screenshot_makes_one_artifact_for_its_tenant() {
        let mut model = model();
        let no_session = command(&mut model, json!({"command":"screenshot","session":"s"}));
        assert_eq!(
            error(&no_session)["message"],
            "No active session. Run open first."
        );
        data(&command(
            &mut model,
            json!({"command":"open","session":"s","flags":{"platform":"linux"}}),
        ));
        let plain = command(
            &mut model,
            json!({"command":"screenshot","session":"s","positionals":["/tmp/x.png"]}),
        );
        assert_eq!(
            data(&plain),
            json!({"path":"/tmp/x.png","message":"Saved screenshot: /tmp/x.png","width":4,"height":4})
        );
        let shot = command(
            &mut model,
            json!({"command":"screenshot","session":"s","positionals":["/tmp/y.png"],
                   "meta":{"clientArtifactPaths":{"path":"/home/u/a.png"},"tenantId":"acme"}}),
        );
        let artifact = &data(&shot)["artifacts"][0];
        assert_eq!(artifact["fileName"], "a.png");
        assert_eq!(artifact["localPath"], "/home/u/a.png");
        let id = artifact["artifactId"].as_str().unwrap().to_owned();
        let acme = TenantId::parse("acme");
        assert_eq!(model.artifact_list(None, T0), json!({"artifacts":[]}));
        assert_eq!(
            model.artifact_list(acme.as_ref(), T0)["artifacts"][0]["sizeBytes"],
            TINY_PNG.len()
        );
        assert_eq!(
            model.take_artifact(&id, None, T0).unwrap_err().message,
            "Artifact belongs to a different tenant"
        );
        assert_eq!(
            model.take_artifact(&id, acme.as_ref(), T0).unwrap().bytes,
            TINY_PNG
        );
        assert_eq!(
            model
                .take_artifact(&id, acme.as_ref(), T0)
                .unwrap_err()
                .message,
            format!("Artifact not found or expired: {id}")
        );
    }

    #[test]
    fn unknown_commands_need_a_session() {
        let mut model = model();
        let reply = command(&mut model, json!({"command":"click","session":"z"}));
        assert_eq!(reply.status, StatusCode::NOT_FOUND);
        assert_eq!(
            error(&reply)["message"],
            "No active session. Run open first."
        );
        data(&command(
            &mut model,
            json!({"command":"open","session":"z","flags":{"platform":"linux"}}),
        ));
        assert_eq!(
            data(&command(
                &mut model,
                json!({"command":"click","session":"z"})
            )),
            json!({})
        );
    }

    #[test]
    fn install_names_a_finalized_upload_or_fails() {
        let mut model = model();
        let reply = command(
            &mut model,
            json!({"command":"install","positionals":["com.example","/x.apk"],
                   "flags":{"platform":"android"},"meta":{"uploadedArtifactId":"nope"}}),
        );
        assert_eq!(
            error(&reply)["message"],
            "Uploaded artifact not found or expired: nope"
        );
        let done = model.uploads.legacy(
            "x.apk",
            crate::uploads::ArtifactType::File,
            1,
            "0".repeat(64),
            None,
            T0,
        );
        let reply = command(
            &mut model,
            json!({"command":"install","positionals":["com.example","/x.apk"],
                   "flags":{"platform":"android"},"meta":{"uploadedArtifactId":done.id}}),
        );
        assert_eq!(data(&reply)["appId"], "com.example");
        // An uploaded artifact is good for five minutes.
        let later = Checked::read(
            Method::Command,
            &json!("r2"),
            &json!({"command":"install","positionals":["com.example","/x.apk"],
                    "flags":{"platform":"android"},"meta":{"uploadedArtifactId":done.id}}),
            false,
        )
        .unwrap();
        let prepared = model
            .begin(json!("r2"), later, T0 + UPLOAD_IDLE_MS)
            .unwrap();
        let expired = model.finish(prepared, T0 + UPLOAD_IDLE_MS);
        assert_eq!(error(&expired)["details"]["reason"], "RESOURCE_EXPIRED");
        assert_eq!(
            error(&expired)["hint"],
            "Uploaded artifacts expire 5 minutes after upload. Upload the file again and retry with the new upload id."
        );
        let missing = command(
            &mut model,
            json!({"command":"install","positionals":["com.example","/nonexistent/x.apk"],
                   "flags":{"platform":"android"}}),
        );
        assert_eq!(
            error(&missing)["message"],
            "App binary not found: /nonexistent/x.apk"
        );
    }

    #[test]
    fn install_from_source_checks_its_params_and_materializes() {
        let mut model = model();
        let cases = [
            (
                json!({}),
                "Invalid params: platform must be \"ios\" or \"android\"",
            ),
            (
                json!({"platform":"android"}),
                "Invalid params: source is required",
            ),
            (
                json!({"platform":"android","source":{"kind":"path","path":"/x.apk"}}),
                "Invalid params: source.kind \"path\" names a file on the daemon host and is not accepted over HTTP",
            ),
        ];
        for (params, message) in cases {
            let reply = run(&mut model, "agent_device.install_from_source", params);
            assert_eq!(reply.json()["error"]["code"], -32602);
            assert_eq!(reply.json()["error"]["message"], message);
        }
        let reply = run(
            &mut model,
            "agent_device.install_from_source",
            json!({"platform":"android","retainPaths":true,
                   "source":{"kind":"url","url":"https://example.invalid/app.apk"}}),
        );
        let installed = data(&reply);
        assert_eq!(installed["packageName"], "com.agentdevice.fake");
        assert_eq!(
            installed["materializationExpiresAt"],
            T0 + MATERIALIZATION_TTL_MS
        );
        let id = installed["materializationId"].as_str().unwrap().to_owned();
        let released = run(
            &mut model,
            "agent_device.release_materialized_paths",
            json!({"materializationId":id}),
        );
        assert_eq!(data(&released)["released"], true);
        let again = run(
            &mut model,
            "agent_device.release_materialized_paths",
            json!({"materializationId":id}),
        );
        assert_eq!(error(&again)["details"]["reason"], "RESOURCE_EXPIRED");
        let ios = run(
            &mut model,
            "agent_device.install_from_source",
            json!({"platform":"ios","source":{"kind":"url","url":"https://x.invalid/a.ipa"}}),
        );
        assert_eq!(error(&ios)["code"], "DEVICE_NOT_FOUND");
    }

    #[test]
    fn the_install_source_command_reads_its_source_from_meta() {
        let mut model = model();
        let reply = command(
            &mut model,
            json!({"command":"install_source","flags":{"platform":"android"},
                   "meta":{"installSource":{"kind":"url","url":"https://example.invalid/a.apk"}}}),
        );
        assert_eq!(data(&reply)["packageName"], "com.agentdevice.fake");
        let local = command(
            &mut model,
            json!({"command":"install_source","flags":{"platform":"android"},
                   "meta":{"installSource":{"kind":"path","path":"/tmp/a.apk"}}}),
        );
        assert_eq!(error(&local)["code"], "INVALID_ARGS");
        assert_eq!(
            error(&local)["hint"],
            "Use a \"url\" or \"github-actions-artifact\" source."
        );
        let done = model.uploads.legacy(
            "a.apk",
            crate::uploads::ArtifactType::File,
            1,
            "0".repeat(64),
            None,
            T0,
        );
        let uploaded = command(
            &mut model,
            json!({"command":"install_source","flags":{"platform":"android","retainPaths":true},
                   "meta":{"installSource":{"kind":"path","path":"/tmp/a.apk"},"uploadedArtifactId":done.id}}),
        );
        assert_eq!(data(&uploaded)["source"], "uploaded-artifact");
        assert!(data(&uploaded)["materializationId"].is_string());
    }

    #[test]
    fn png_sizes_are_read_from_the_header() {
        assert_eq!(png_size(TINY_PNG), (4, 4));
        assert_eq!(png_size(b"not a png"), (0, 0));
        assert_eq!(Platform::Linux.as_str(), "linux");
    }
}
