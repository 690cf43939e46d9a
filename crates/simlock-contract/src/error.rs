//! The closed error table: every code with its kind, HTTP status and CLI exit code, in one place.
//!
//! A daemon answers every failure with one of these codes. The table is the single source of
//! the HTTP status and the CLI exit code for each; [`ErrorCode::row`] is the one classification
//! function both hosts and the CLI use.

use std::fmt;

use serde::{Deserialize, Serialize};
use serde_json::{Value, json};

/// Which layer a code belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ErrorKind {
    /// The caller broke the protocol or lacks the right.
    Protocol,
    /// The path to a daemon failed; the operation may or may not have happened.
    Transport,
    /// The operation was understood and refused by the domain.
    Domain,
}

/// One row of the error table.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ErrorRow {
    /// The code.
    pub code: ErrorCode,
    /// Its kind.
    pub kind: ErrorKind,
    /// The HTTP status a host answers with.
    pub http: u16,
    /// The exit code of the CLI.
    pub exit: u8,
}

macro_rules! error_table {
    ($($(#[doc = $doc:literal])* $variant:ident => $name:literal, $kind:ident, $http:literal, $exit:literal;)*) => {
        /// Every error code simlock answers with. The set is closed: a client maps a code it does
        /// not know to [`ErrorCode::UnknownDaemonError`].
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
        #[non_exhaustive]
        pub enum ErrorCode {
            $($(#[doc = $doc])* $variant,)*
        }

        /// The error table, in declaration order.
        pub const ERROR_TABLE: &[ErrorRow] = &[
            $(ErrorRow { code: ErrorCode::$variant, kind: ErrorKind::$kind, http: $http, exit: $exit },)*
        ];

        impl ErrorCode {
            /// The code as it travels on the wire.
            pub const fn as_str(self) -> &'static str {
                match self { $(Self::$variant => $name,)* }
            }

            /// The code named `name` on the wire, if it is one of ours.
            pub fn from_wire(name: &str) -> Option<Self> {
                match name { $($name => Some(Self::$variant),)* _ => None }
            }

            /// This code's row of the table: kind, HTTP status and CLI exit.
            pub const fn row(self) -> ErrorRow {
                match self { $(Self::$variant => ErrorRow { code: Self::$variant, kind: ErrorKind::$kind, http: $http, exit: $exit },)* }
            }
        }
    };
}

error_table! {
    /// A line that is not a frame: bad JSON, or no id/type.
    BadFrame => "BAD_FRAME", Protocol, 400, 2;
    /// The first call on a connection was not `hello`.
    HandshakeRequired => "HANDSHAKE_REQUIRED", Protocol, 400, 1;
    /// An input broke its schema or a bound.
    BadRequest => "BAD_REQUEST", Protocol, 400, 2;
    /// No such operation.
    UnknownRequest => "UNKNOWN_REQUEST", Protocol, 400, 2;
    /// The client's and the daemon's protocol ranges do not overlap.
    ProtocolVersionUnsupported => "PROTOCOL_VERSION_UNSUPPORTED", Protocol, 400, 1;
    /// A credential in `hello` was not accepted.
    AdminAuthenticationFailed => "ADMIN_AUTHENTICATION_FAILED", Protocol, 401, 1;
    /// The caller may not do this.
    Forbidden => "FORBIDDEN", Protocol, 403, 1;
    /// A daemon answered with a code this client does not know (client side only).
    UnknownDaemonError => "UNKNOWN_DAEMON_ERROR", Protocol, 500, 1;
    /// No bearer token, or an unknown one (HTTP only).
    Unauthenticated => "UNAUTHENTICATED", Protocol, 401, 1;
    /// Bad command-line usage (CLI only).
    Usage => "USAGE", Protocol, 400, 2;
    /// The daemon is stopping and takes no new work.
    DaemonStopping => "DAEMON_STOPPING", Transport, 503, 1;
    /// The daemon's start-up failed to converge.
    DaemonStartupFailed => "DAEMON_STARTUP_FAILED", Transport, 503, 1;
    /// The connection to the daemon was lost with the call pending (client side).
    DaemonConnectionLost => "DAEMON_CONNECTION_LOST", Transport, 503, 1;
    /// The gateway has no live uplink to the worker that must answer.
    WorkerUnreachable => "WORKER_UNREACHABLE", Transport, 503, 1;
    /// No device can be had now and the caller would not wait.
    NoCapacity => "NO_CAPACITY", Domain, 503, 11;
    /// The request waited past its deadline.
    QueueTimeout => "QUEUE_TIMEOUT", Domain, 500, 10;
    /// The requester already holds a lease or has a pending request.
    RequesterAlreadyLeased => "REQUESTER_ALREADY_LEASED", Domain, 409, 13;
    /// An idempotency key was reused for a different request.
    IdempotencyConflict => "IDEMPOTENCY_CONFLICT", Domain, 409, 2;
    /// The caller-chosen lease id is held by another lease.
    LeaseIdTaken => "LEASE_ID_TAKEN", Domain, 409, 13;
    /// No driver serves the platform.
    NoDriver => "NO_DRIVER", Domain, 422, 12;
    /// The runtime is not installed.
    RuntimeMissing => "RUNTIME_MISSING", Domain, 422, 12;
    /// The model is not in the catalog.
    UnknownModel => "UNKNOWN_MODEL", Domain, 422, 12;
    /// Not enough disk to provision.
    InsufficientDiskSpace => "INSUFFICIENT_DISK_SPACE", Domain, 422, 12;
    /// A licence must be accepted first.
    LicenseNotAccepted => "LICENSE_NOT_ACCEPTED", Domain, 422, 12;
    /// No such lease, or not the caller's.
    UnknownLease => "UNKNOWN_LEASE", Domain, 404, 1;
    /// A passthrough was refused.
    PassthroughRefused => "PASSTHROUGH_REFUSED", Domain, 422, 2;
    /// The tool is not one exec may run.
    UnknownPassthroughTool => "UNKNOWN_PASSTHROUGH_TOOL", Domain, 422, 2;
    /// `device.exec` ran past its time limit.
    ExecTimeout => "EXEC_TIMEOUT", Domain, 504, 10;
    /// A download ran past its time limit.
    DownloadTimeout => "DOWNLOAD_TIMEOUT", Domain, 504, 10;
    /// Downloads are disabled by configuration.
    DownloadsDisabled => "DOWNLOADS_DISABLED", Domain, 403, 12;
    /// The component is not simlock's.
    ComponentNotOwned => "COMPONENT_NOT_OWNED", Domain, 409, 2;
    /// The component is in use by devices.
    ComponentInUse => "COMPONENT_IN_USE", Domain, 409, 2;
    /// The component is busy with another operation.
    ComponentBusy => "COMPONENT_BUSY", Domain, 409, 2;
    /// Doctor cannot run here.
    DoctorUnavailable => "DOCTOR_UNAVAILABLE", Domain, 503, 1;
    /// Nuke cannot run here.
    NukeUnavailable => "NUKE_UNAVAILABLE", Domain, 503, 1;
    /// Something failed that the daemon did not expect.
    Internal => "INTERNAL", Domain, 500, 1;
    /// The operation exists only on a worker.
    UnsupportedInGatewayMode => "UNSUPPORTED_IN_GATEWAY_MODE", Domain, 501, 2;
    /// The operation exists only on a gateway.
    UnsupportedInWorkerMode => "UNSUPPORTED_IN_WORKER_MODE", Domain, 501, 2;
    /// The worker is connected, so it cannot be removed.
    WorkerConnected => "WORKER_CONNECTED", Domain, 409, 2;
    /// No worker with that id.
    UnknownWorker => "UNKNOWN_WORKER", Domain, 404, 12;
    /// The caller gave up (client side).
    Cancelled => "CANCELLED", Domain, 499, 1;
    /// No such lease request (HTTP only).
    UnknownLeaseRequest => "UNKNOWN_LEASE_REQUEST", Domain, 404, 1;
    /// The lease request is past the point where it can be cancelled (HTTP only).
    RequestNotCancellable => "REQUEST_NOT_CANCELLABLE", Domain, 409, 1;
    /// No worker can serve a required capability.
    CapabilityMissing => "CAPABILITY_MISSING", Domain, 422, 12;
    /// No module on the worker registered the relay target.
    RelayTargetMissing => "RELAY_TARGET_MISSING", Domain, 503, 1;
}

impl ErrorCode {
    /// The kind of this code.
    pub const fn kind(self) -> ErrorKind {
        self.row().kind
    }

    /// The HTTP status for this code.
    pub const fn http_status(self) -> u16 {
        self.row().http
    }

    /// The CLI exit code for this code.
    pub const fn exit_code(self) -> u8 {
        self.row().exit
    }

    /// Whether the error means the path to the daemon (or through it, to a worker) is lost,
    /// rather than an answer about the operation. This is the one place that decides
    /// "the uplink is lost" for every caller of a worker.
    pub const fn is_transport(self) -> bool {
        matches!(self.kind(), ErrorKind::Transport)
    }

    /// Whether only a request that was admitted and waited can end with this code (it timed
    /// out in the queue, or was cancelled): an outcome, never a refusal of a submission. An
    /// idempotent repeat of such a request is answered with the request's end, not refused.
    pub const fn ends_an_admitted_request(self) -> bool {
        matches!(self, Self::QueueTimeout | Self::Cancelled)
    }
}

impl fmt::Display for ErrorCode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl Serialize for ErrorCode {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.serialize_str(self.as_str())
    }
}

impl<'de> Deserialize<'de> for ErrorCode {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let name = String::deserialize(deserializer)?;
        Ok(Self::from_wire(&name).unwrap_or(Self::UnknownDaemonError))
    }
}

/// An error as simlock answers it: a code, a message for people, and typed details for programs.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("{code}: {message}")]
pub struct ContractError {
    /// The code, from the closed table.
    pub code: ErrorCode,
    /// What happened, in a sentence.
    pub message: String,
    /// Typed details, for the codes that declare them.
    pub details: Option<Value>,
}

impl ContractError {
    /// An error with no details.
    pub fn new(code: ErrorCode, message: impl Into<String>) -> Self {
        Self {
            code,
            message: message.into(),
            details: None,
        }
    }

    /// The same error with details attached.
    #[must_use]
    pub fn with_details(mut self, details: Value) -> Self {
        self.details = Some(details).filter(|d| !d.is_null());
        self
    }

    /// `BAD_REQUEST` with a message naming the field.
    pub fn bad_request(message: impl Into<String>) -> Self {
        Self::new(ErrorCode::BadRequest, message)
    }

    /// `FORBIDDEN`.
    pub fn forbidden(message: impl Into<String>) -> Self {
        Self::new(ErrorCode::Forbidden, message)
    }

    /// `INTERNAL`.
    pub fn internal(message: impl Into<String>) -> Self {
        Self::new(ErrorCode::Internal, message)
    }

    /// `INTERNAL` for a release a gateway took (the lease ended there, its worker releases it
    /// once back) but could not store: `details.releaseStored` is `false`, which
    /// [`Self::is_release_not_stored`] reads.
    pub fn release_not_stored(message: impl Into<String>) -> Self {
        Self::internal(message).with_details(json!({ "releaseStored": false }))
    }

    /// Whether this is [`Self::release_not_stored`]'s error: the release was taken, not lost.
    pub fn is_release_not_stored(&self) -> bool {
        self.code == ErrorCode::Internal
            && self
                .details
                .as_ref()
                .and_then(|d| d.get("releaseStored"))
                .and_then(Value::as_bool)
                == Some(false)
    }

    /// `UNKNOWN_LEASE` naming the lease.
    pub fn unknown_lease(lease_id: &str) -> Self {
        Self::new(ErrorCode::UnknownLease, format!("Unknown lease {lease_id}"))
            .with_details(json!({ "leaseId": lease_id }))
    }

    /// `WORKER_UNREACHABLE` naming the worker.
    pub fn worker_unreachable(worker_id: &str, message: impl Into<String>) -> Self {
        Self::new(ErrorCode::WorkerUnreachable, message)
            .with_details(json!({ "workerId": worker_id }))
    }

    /// `DAEMON_CONNECTION_LOST`.
    pub fn connection_lost() -> Self {
        Self::new(
            ErrorCode::DaemonConnectionLost,
            "The connection to the daemon was lost",
        )
    }

    /// `DAEMON_STOPPING`.
    pub fn stopping() -> Self {
        Self::new(ErrorCode::DaemonStopping, "The daemon is stopping")
    }

    /// The error as its wire body.
    pub fn to_body(&self) -> ErrorBody {
        ErrorBody {
            code: self.code.as_str().to_owned(),
            message: self.message.clone(),
            details: self.details.clone(),
        }
    }

    /// The error a wire body describes. A code this side does not know becomes
    /// `UNKNOWN_DAEMON_ERROR` carrying the original code and message in its details.
    pub fn from_body(body: ErrorBody) -> Self {
        match ErrorCode::from_wire(&body.code) {
            Some(code) => Self {
                code,
                message: body.message,
                details: body.details.filter(|d| !d.is_null()),
            },
            None => Self::new(
                ErrorCode::UnknownDaemonError,
                format!(
                    "The daemon answered an unknown error {}: {}",
                    body.code, body.message
                ),
            )
            .with_details(json!({ "code": body.code, "message": body.message })),
        }
    }
}

/// The `error` object of an error frame, as it travels.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ErrorBody {
    /// The code's wire name.
    pub code: String,
    /// The message.
    pub message: String,
    /// Typed details, when the code declares them.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub details: Option<Value>,
}

impl ErrorBody {
    /// The HTTP form: `{"code", "message", ...details}`, the details inlined beside the code.
    pub fn to_inline(&self) -> Value {
        let mut object = serde_json::Map::new();
        object.insert("code".into(), Value::String(self.code.clone()));
        object.insert("message".into(), Value::String(self.message.clone()));
        if let Some(Value::Object(details)) = &self.details {
            for (key, value) in details {
                object.entry(key.clone()).or_insert_with(|| value.clone());
            }
        }
        Value::Object(object)
    }

    /// Reads the HTTP form back: every field beside `code` and `message` is a detail.
    pub fn from_inline(value: &Value) -> Option<Self> {
        let object = value.as_object()?;
        let code = object.get("code")?.as_str()?.to_owned();
        let message = object
            .get("message")
            .and_then(Value::as_str)
            .unwrap_or_default()
            .to_owned();
        let details: serde_json::Map<String, Value> = object
            .iter()
            .filter(|(k, _)| *k != "code" && *k != "message")
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect();
        Some(Self {
            code,
            message,
            details: (!details.is_empty()).then_some(Value::Object(details)),
        })
    }
}

/// An error and its sources, on one line (`outer: cause: root cause`): what a message about
/// an I/O or HTTP client failure should carry, since the outer words alone ("client error
/// (SendRequest)") often say nothing.
pub fn error_chain(error: &dyn std::error::Error) -> String {
    let mut text = error.to_string();
    let mut source = error.source();
    while let Some(cause) = source {
        text.push_str(": ");
        text.push_str(&cause.to_string());
        source = cause.source();
    }
    text
}

#[cfg(test)]
mod tests {

    #[test]
    fn a_release_not_stored_reads_back_as_such_through_its_wire_form_and_nothing_else_does() {
        let said = ContractError::release_not_stored("taken, not stored");
        assert!(said.is_release_not_stored());
        let wire = serde_json::to_value(said.to_body()).unwrap();
        let read = ContractError::from_body(serde_json::from_value(wire).unwrap());
        assert!(read.is_release_not_stored(), "{read:?}");
        assert!(!ContractError::internal("taken, not stored").is_release_not_stored());
        let mut other = ContractError::release_not_stored("x");
        other.code = ErrorCode::WorkerUnreachable;
        assert!(!other.is_release_not_stored());
    }
    use super::*;

    #[test]
    fn an_error_chain_reads_outer_to_root_on_one_line() {
        #[derive(Debug)]
        struct Outer(std::io::Error);
        impl fmt::Display for Outer {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("client error (SendRequest)")
            }
        }
        impl std::error::Error for Outer {
            fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
                Some(&self.0)
            }
        }
        let e = Outer(std::io::Error::other(
            "connection closed before message completed",
        ));
        assert_eq!(
            error_chain(&e),
            "client error (SendRequest): connection closed before message completed"
        );
        assert_eq!(error_chain(&std::io::Error::other("alone")), "alone");
    }

    #[test]
    fn the_inline_form_round_trips() {
        let body = ContractError::unknown_lease("lse_1").to_body();
        let inline = body.to_inline();
        assert_eq!(
            inline,
            json!({"code": "UNKNOWN_LEASE", "message": "Unknown lease lse_1", "leaseId": "lse_1"})
        );
        assert_eq!(ErrorBody::from_inline(&inline), Some(body));
        assert_eq!(ErrorBody::from_inline(&json!({"message": "no code"})), None);
    }

    #[test]
    fn every_code_round_trips_through_its_wire_name() {
        for row in ERROR_TABLE {
            assert_eq!(ErrorCode::from_wire(row.code.as_str()), Some(row.code));
            assert_eq!(
                row.code.row(),
                *row,
                "row() disagrees with the table for {}",
                row.code
            );
        }
    }

    #[test]
    fn wire_names_are_unique() {
        let mut names: Vec<_> = ERROR_TABLE.iter().map(|r| r.code.as_str()).collect();
        names.sort_unstable();
        let before = names.len();
        names.dedup();
        assert_eq!(before, names.len());
    }

    #[test]
    fn additions_have_their_rows() {
        assert_eq!(
            ErrorCode::CapabilityMissing.row(),
            ErrorRow {
                code: ErrorCode::CapabilityMissing,
                kind: ErrorKind::Domain,
                http: 422,
                exit: 12
            }
        );
        assert_eq!(
            ErrorCode::RelayTargetMissing.row(),
            ErrorRow {
                code: ErrorCode::RelayTargetMissing,
                kind: ErrorKind::Domain,
                http: 503,
                exit: 1
            }
        );
        assert_eq!(ErrorCode::LeaseIdTaken.http_status(), 409);
        assert_eq!(ErrorCode::NoCapacity.exit_code(), 11);
        assert_eq!(ErrorCode::QueueTimeout.exit_code(), 10);
    }

    #[test]
    fn only_transport_codes_read_as_a_lost_path() {
        let transport: Vec<_> = ERROR_TABLE
            .iter()
            .filter(|r| r.code.is_transport())
            .map(|r| r.code)
            .collect();
        assert_eq!(
            transport,
            [
                ErrorCode::DaemonStopping,
                ErrorCode::DaemonStartupFailed,
                ErrorCode::DaemonConnectionLost,
                ErrorCode::WorkerUnreachable
            ]
        );
    }

    #[test]
    fn an_unknown_code_becomes_unknown_daemon_error_with_the_original() {
        let err = ContractError::from_body(ErrorBody {
            code: "SOMETHING_NEW".into(),
            message: "hi".into(),
            details: None,
        });
        assert_eq!(err.code, ErrorCode::UnknownDaemonError);
        assert_eq!(
            err.details,
            Some(json!({"code": "SOMETHING_NEW", "message": "hi"}))
        );
    }
}
