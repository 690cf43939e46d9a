//! The JSON shapes agent-device 0.21.5 puts on the wire: devices, lease views, the error codes
//! with their default hints, and the two error envelopes (JSON-RPC on `/rpc`, `{ok:false,…}` on
//! the auxiliary routes).

use std::fmt;

use http::StatusCode;
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};

/// A device platform, as the `platform` field of a device names it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Platform {
    /// An iPhone or iPad simulator or device.
    Ios,
    /// The Mac itself.
    Macos,
    /// An Android emulator or device.
    Android,
    /// The Linux desktop (AT-SPI).
    Linux,
    /// The managed browser backend.
    Web,
    /// A HarmonyOS device.
    Harmonyos,
    /// A Vega (Fire TV) device.
    Vega,
}

impl Platform {
    /// The platform's name on the wire.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Ios => "ios",
            Self::Macos => "macos",
            Self::Android => "android",
            Self::Linux => "linux",
            Self::Web => "web",
            Self::Harmonyos => "harmonyos",
            Self::Vega => "vega",
        }
    }

    /// Whether a `--platform` selector names this platform: `apple` names both Apple platforms,
    /// every other selector names the platform of that name.
    pub fn matches_selector(self, selector: &str) -> bool {
        match selector {
            "apple" => matches!(self, Self::Ios | Self::Macos),
            other => other == self.as_str(),
        }
    }
}

impl fmt::Display for Platform {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// What kind of device a device entry is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DeviceKind {
    /// A physical device, or the host itself.
    Device,
    /// An iOS simulator.
    Simulator,
    /// An Android emulator.
    Emulator,
}

/// The form factor a device entry targets.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DeviceTarget {
    /// A phone or tablet.
    Mobile,
    /// A television.
    Tv,
    /// A desktop.
    Desktop,
}

/// One entry of a `devices` answer (reference §3.5).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Device {
    /// The platform.
    pub platform: Platform,
    /// The device id (a UDID, an adb serial, `local` for the Linux desktop).
    pub id: String,
    /// The display name (`open` answers it as `device`).
    pub name: String,
    /// Device, simulator or emulator.
    pub kind: DeviceKind,
    /// The form factor.
    pub target: DeviceTarget,
    /// Whether it is booted.
    pub booted: bool,
}

impl Device {
    /// The entry the real daemon lists on any Linux box: the desktop itself, named after the host.
    pub fn linux_local() -> Self {
        Self {
            platform: Platform::Linux,
            id: "local".to_owned(),
            name: hostname(),
            kind: DeviceKind::Device,
            target: DeviceTarget::Desktop,
            booted: true,
        }
    }

    /// A booted Android emulator with this adb serial and name.
    pub fn android_emulator(serial: &str, name: &str) -> Self {
        Self {
            platform: Platform::Android,
            id: serial.to_owned(),
            name: name.to_owned(),
            kind: DeviceKind::Emulator,
            target: DeviceTarget::Mobile,
            booted: true,
        }
    }

    /// A booted iOS simulator with this UDID and name.
    pub fn ios_simulator(udid: &str, name: &str) -> Self {
        Self {
            platform: Platform::Ios,
            id: udid.to_owned(),
            name: name.to_owned(),
            kind: DeviceKind::Simulator,
            target: DeviceTarget::Mobile,
            booted: true,
        }
    }
}

/// The host name, as Node's `os.hostname()` reports it on Linux.
fn hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .ok()
        .map(|name| name.trim().to_owned())
        .filter(|name| !name.is_empty())
        .unwrap_or_else(|| "localhost".to_owned())
}

/// The error codes of 0.21.5 (`data.code`). A client maps any other code to `COMMAND_FAILED`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "SCREAMING_SNAKE_CASE")]
pub enum ErrorCode {
    /// Bad arguments (HTTP 400).
    InvalidArgs,
    /// No device matches the selectors.
    DeviceNotFound,
    /// The device is leased or claimed by someone else.
    DeviceInUse,
    /// A platform tool (adb, xcrun, scrot, …) is missing.
    ToolMissing,
    /// The app is not installed.
    AppNotInstalled,
    /// The platform cannot do this.
    UnsupportedPlatform,
    /// The device cannot do this.
    UnsupportedOperation,
    /// Planned but not built.
    NotImplemented,
    /// The command failed.
    CommandFailed,
    /// No such session (HTTP 404).
    SessionNotFound,
    /// Bad token or lease (HTTP 401).
    Unauthorized,
    /// Several candidates matched.
    AmbiguousMatch,
    /// A replay diverged.
    ReplayDivergence,
    /// A repair session was reaped (HTTP 404).
    RepairSessionExpired,
    /// A repair could not be committed.
    RepairCommitFailed,
    /// An unexpected failure.
    Unknown,
}

impl ErrorCode {
    /// The hint the daemon attaches when the failure names none of its own.
    pub fn default_hint(self) -> &'static str {
        match self {
            Self::InvalidArgs => "Check command arguments and run --help for usage examples.",
            Self::SessionNotFound => "Run open first or pass an explicit device selector.",
            Self::ToolMissing => {
                "Install required platform tooling and ensure it is available in PATH."
            }
            Self::DeviceNotFound => {
                "Verify the target device is booted/connected and selectors match."
            }
            Self::AppNotInstalled => {
                "Run apps to discover the exact installed package or bundle id, or install the app before open."
            }
            Self::UnsupportedOperation => {
                "This command is not available for the selected platform/device."
            }
            Self::UnsupportedPlatform => {
                "This platform is not supported for the requested operation; run devices to inspect available targets."
            }
            Self::AmbiguousMatch => {
                "Multiple candidates matched. Narrow the query or pass an exact identifier."
            }
            Self::DeviceInUse => {
                "The device is busy with another agent-device request; retry once it frees up."
            }
            Self::ReplayDivergence => {
                "Read details.divergence (screen/suggestions) for repair context, or rerun with --json for the full report."
            }
            Self::RepairSessionExpired => {
                "The --save-script repair session was reaped before it was finalized; re-run replay <script> --save-script from the start."
            }
            Self::RepairCommitFailed => {
                "The repair transaction completed, but committing its healed script failed at teardown (no-clobber refusal or a filesystem error); inspect the target path/permissions, then re-run replay <script> --save-script to retry."
            }
            Self::NotImplemented => {
                "This command is part of the planned API but is not implemented yet."
            }
            Self::CommandFailed => "Retry with --debug and inspect diagnostics log for details.",
            Self::Unauthorized => "Refresh daemon metadata and retry the command.",
            Self::Unknown => {
                "Unexpected internal error. Retry with --debug and report the diagnostics log if it persists."
            }
        }
    }

    /// The code's name on the wire.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::InvalidArgs => "INVALID_ARGS",
            Self::DeviceNotFound => "DEVICE_NOT_FOUND",
            Self::DeviceInUse => "DEVICE_IN_USE",
            Self::ToolMissing => "TOOL_MISSING",
            Self::AppNotInstalled => "APP_NOT_INSTALLED",
            Self::UnsupportedPlatform => "UNSUPPORTED_PLATFORM",
            Self::UnsupportedOperation => "UNSUPPORTED_OPERATION",
            Self::NotImplemented => "NOT_IMPLEMENTED",
            Self::CommandFailed => "COMMAND_FAILED",
            Self::SessionNotFound => "SESSION_NOT_FOUND",
            Self::Unauthorized => "UNAUTHORIZED",
            Self::AmbiguousMatch => "AMBIGUOUS_MATCH",
            Self::ReplayDivergence => "REPLAY_DIVERGENCE",
            Self::RepairSessionExpired => "REPAIR_SESSION_EXPIRED",
            Self::RepairCommitFailed => "REPAIR_COMMIT_FAILED",
            Self::Unknown => "UNKNOWN",
        }
    }
}

impl fmt::Display for ErrorCode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A failure as the daemon reports it: the one error type of this crate. On `/rpc` it becomes
/// the `error.data` of a JSON-RPC error, on the other routes an `{ok:false,error,code}` body; its
/// HTTP status comes from [`DaemonError::http_status`] in both cases.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, thiserror::Error)]
#[error("{code}: {message}")]
pub struct DaemonError {
    /// The code.
    pub code: ErrorCode,
    /// The message, shown by the CLI.
    pub message: String,
    /// A hint; when `None` the code's default hint is sent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hint: Option<String>,
    /// `data.details` (for example `{"reason":"LEASE_NOT_FOUND"}`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub details: Option<Value>,
    /// `data.retriable`; when `None` it is sent only for `DEVICE_IN_USE` (as `true`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub retriable: Option<bool>,
    /// Whether the failure is raised before a request log exists (the reply then names the
    /// daemon log and no `diagnosticsRecord`). Not part of the control API.
    #[serde(skip)]
    pub(crate) unlogged: bool,
}

impl DaemonError {
    /// A failure with this code and message and the code's default hint.
    pub fn new(code: ErrorCode, message: impl Into<String>) -> Self {
        Self {
            code,
            message: message.into(),
            hint: None,
            details: None,
            retriable: None,
            unlogged: false,
        }
    }

    /// `INVALID_ARGS` with this message.
    pub fn invalid_args(message: impl Into<String>) -> Self {
        Self::new(ErrorCode::InvalidArgs, message)
    }

    /// `UNAUTHORIZED` with this message and `details.reason`.
    pub fn unauthorized(message: impl Into<String>, reason: &str) -> Self {
        Self::new(ErrorCode::Unauthorized, message).with_details(json!({ "reason": reason }))
    }

    /// The same failure with this hint.
    #[must_use]
    pub fn with_hint(mut self, hint: impl Into<String>) -> Self {
        self.hint = Some(hint.into());
        self
    }

    /// The same failure with these details.
    #[must_use]
    pub fn with_details(mut self, details: Value) -> Self {
        self.details = Some(details);
        self
    }

    /// The same failure with `retriable` set.
    #[must_use]
    pub fn with_retriable(mut self, retriable: bool) -> Self {
        self.retriable = Some(retriable);
        self
    }

    /// The same failure, raised before any request log exists.
    #[must_use]
    pub(crate) fn unlogged(mut self) -> Self {
        self.unlogged = true;
        self
    }

    /// The hint that goes on the wire.
    pub fn effective_hint(&self) -> &str {
        self.hint
            .as_deref()
            .unwrap_or_else(|| self.code.default_hint())
    }

    /// The HTTP status the daemon answers for this failure (reference §3.3).
    pub fn http_status(&self) -> StatusCode {
        match self.code {
            ErrorCode::InvalidArgs => StatusCode::BAD_REQUEST,
            ErrorCode::Unauthorized => StatusCode::UNAUTHORIZED,
            ErrorCode::SessionNotFound | ErrorCode::RepairSessionExpired => StatusCode::NOT_FOUND,
            ErrorCode::DeviceInUse
                if self
                    .details
                    .as_ref()
                    .and_then(|d| d.get("reason"))
                    .and_then(Value::as_str)
                    == Some("human_control_active") =>
            {
                StatusCode::LOCKED
            }
            _ => StatusCode::INTERNAL_SERVER_ERROR,
        }
    }

    /// The `{ok:false,error,code}` body of the auxiliary routes.
    pub(crate) fn aux_body(&self) -> String {
        text(&AuxError {
            ok: false,
            error: &self.message,
            code: self.code,
        })
    }
}

/// Where a failed request's log lives: `data.diagnosticsRecord`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct DiagnosticsRecord {
    /// The (effective) session.
    pub session: String,
    /// The request id.
    pub request_id: String,
}

/// `error.data` of a handler failure, in the order the daemon writes its fields.
#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
pub(crate) struct ErrorData<'a> {
    pub(crate) code: ErrorCode,
    pub(crate) message: &'a str,
    pub(crate) hint: &'a str,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) diagnostic_id: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) log_path: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) diagnostics_record: Option<&'a DiagnosticsRecord>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) retriable: Option<bool>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) details: Option<&'a Value>,
}

/// JSON-RPC error codes.
pub(crate) mod rpc_code {
    /// The body is not JSON.
    pub(crate) const PARSE_ERROR: i64 = -32700;
    /// The body is not a JSON-RPC 2.0 request.
    pub(crate) const INVALID_REQUEST: i64 = -32600;
    /// No such method.
    pub(crate) const METHOD_NOT_FOUND: i64 = -32601;
    /// The params do not fit the method.
    pub(crate) const INVALID_PARAMS: i64 = -32602;
    /// A handler failure.
    pub(crate) const HANDLER: i64 = -32000;
}

/// A JSON-RPC response, with its fields in the daemon's order.
#[derive(Serialize)]
struct Envelope<'a> {
    jsonrpc: &'static str,
    id: &'a Value,
    #[serde(skip_serializing_if = "Option::is_none")]
    result: Option<Success<'a>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    error: Option<ErrorObject<'a>>,
}

/// A daemon response that succeeded: `{"ok":true,"data":…}`.
#[derive(Serialize)]
struct Success<'a> {
    ok: bool,
    data: &'a Value,
}

#[derive(Serialize)]
struct ErrorObject<'a> {
    code: i64,
    message: &'a str,
    #[serde(skip_serializing_if = "Option::is_none")]
    data: Option<&'a ErrorData<'a>>,
}

fn text(value: &impl Serialize) -> String {
    serde_json::to_string(value).unwrap_or_default()
}

/// A JSON-RPC success carrying the daemon's `{ok:true,data}`.
pub(crate) fn rpc_result(id: &Value, data: &Value) -> String {
    text(&Envelope {
        jsonrpc: "2.0",
        id,
        result: Some(Success { ok: true, data }),
        error: None,
    })
}

/// A JSON-RPC error with no `data` (the envelope errors of reference §3.3).
pub(crate) fn rpc_bare_error(id: &Value, code: i64, message: &str) -> String {
    text(&Envelope {
        jsonrpc: "2.0",
        id,
        result: None,
        error: Some(ErrorObject {
            code,
            message,
            data: None,
        }),
    })
}

/// A JSON-RPC error carrying `data`.
pub(crate) fn rpc_error(id: &Value, code: i64, message: &str, data: &ErrorData<'_>) -> String {
    text(&Envelope {
        jsonrpc: "2.0",
        id,
        result: None,
        error: Some(ErrorObject {
            code,
            message,
            data: Some(data),
        }),
    })
}

/// The `{ok:false,error,code}` body of the auxiliary routes.
#[derive(Serialize)]
struct AuxError<'a> {
    ok: bool,
    error: &'a str,
    code: ErrorCode,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn statuses_follow_the_code() {
        let cases = [
            (ErrorCode::InvalidArgs, 400),
            (ErrorCode::Unauthorized, 401),
            (ErrorCode::SessionNotFound, 404),
            (ErrorCode::RepairSessionExpired, 404),
            (ErrorCode::DeviceInUse, 500),
            (ErrorCode::ToolMissing, 500),
            (ErrorCode::CommandFailed, 500),
        ];
        for (code, status) in cases {
            assert_eq!(
                DaemonError::new(code, "m").http_status().as_u16(),
                status,
                "{code}"
            );
        }
        let human = DaemonError::new(ErrorCode::DeviceInUse, "held")
            .with_details(json!({ "reason": "human_control_active" }));
        assert_eq!(human.http_status(), StatusCode::LOCKED);
    }

    #[test]
    fn codes_serialise_as_their_wire_names() {
        for code in [
            ErrorCode::InvalidArgs,
            ErrorCode::DeviceNotFound,
            ErrorCode::RepairSessionExpired,
            ErrorCode::Unknown,
        ] {
            assert_eq!(
                serde_json::to_value(code).ok(),
                Some(Value::String(code.as_str().to_owned()))
            );
        }
    }

    #[test]
    fn envelopes_keep_the_daemon_field_order() {
        let id = json!("r1");
        assert_eq!(
            rpc_result(&id, &json!({"released": true})),
            r#"{"jsonrpc":"2.0","id":"r1","result":{"ok":true,"data":{"released":true}}}"#
        );
        assert_eq!(
            rpc_bare_error(&Value::Null, rpc_code::PARSE_ERROR, "Parse error"),
            r#"{"jsonrpc":"2.0","id":null,"error":{"code":-32700,"message":"Parse error"}}"#
        );
        assert_eq!(
            DaemonError::new(ErrorCode::Unauthorized, "Invalid token").aux_body(),
            r#"{"ok":false,"error":"Invalid token","code":"UNAUTHORIZED"}"#
        );
    }

    #[test]
    fn apple_selects_both_apple_platforms() {
        assert!(Platform::Ios.matches_selector("apple"));
        assert!(Platform::Macos.matches_selector("apple"));
        assert!(Platform::Ios.matches_selector("ios"));
        assert!(!Platform::Android.matches_selector("apple"));
        assert!(!Platform::Linux.matches_selector("android"));
    }

    #[test]
    fn a_knob_error_reads_from_json_without_the_optional_fields() {
        let parsed: DaemonError =
            serde_json::from_value(json!({ "code": "TOOL_MISSING", "message": "adb not found" }))
                .unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(
            parsed,
            DaemonError::new(ErrorCode::ToolMissing, "adb not found")
        );
        assert_eq!(
            parsed.effective_hint(),
            "Install required platform tooling and ensure it is available in PATH."
        );
    }
}
