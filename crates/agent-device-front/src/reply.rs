//! The replies the front makes itself, in agent-device's own envelopes so the published CLI
//! prints them: a JSON-RPC error (`data.code`, `data.message`) on `/rpc`, `{ok:false, error,
//! code}` on every other route. The texts are the seeds' own.

use http::{Response, StatusCode};
use serde_json::{Map, Value, json};
use simlock_contract::{ContractError, ErrorCode};

use crate::Body;
use crate::lease_id::{LEASE_HEADER, LeaseId};
use crate::port::Hosts;

/// Which envelope a reply takes.
#[derive(Debug, Clone, PartialEq)]
pub enum Surface {
    /// `/rpc`: a JSON-RPC error echoing the request's id (`null` when it had none).
    Rpc {
        /// The request's `id`.
        id: Value,
    },
    /// Any other route.
    Route,
}

/// Every reply the front (or a host link) makes instead of agent-device.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Refusal {
    /// agent-device cannot serve this now.
    #[error("agent-device is not available on this simlock: {reason}")]
    NotAvailable {
        /// Why.
        reason: String,
        /// Whether trying again later may work.
        retriable: bool,
    },
    /// simlock refused the lease behind an allocate.
    #[error("refused by simlock: {message}")]
    Simlock {
        /// simlock's message.
        message: String,
        /// simlock's error code.
        code: ErrorCode,
    },
    /// No device of the platform can be leased here.
    #[error("refused: {0} is not available on this simlock")]
    PlatformUnavailable(String),
    /// The caller named a device; simlock chooses.
    #[error("refused: simlock picks the device")]
    SimlockPicksDevice,
    /// The lease is not the caller's, or not known here.
    #[error("refused: lease {lease} is not one of yours{}", answered_on(*.hosts))]
    NotYours {
        /// The lease named.
        lease: LeaseId,
        /// The answering link's hosts: [`Hosts::PerLease`] is a gateway.
        hosts: Hosts,
    },
    /// A request that names no lease reached a gateway.
    #[error("refused: this agent-device is too old to use through a gateway; update it")]
    TooOld,
    /// The lease header holds something that is not a lease id (never echoed).
    #[error("refused: the {LEASE_HEADER} header is not a lease id")]
    BadLeaseHeader,
    /// The caller's principal makes no tenant a relay can carry.
    #[error("refused: this token cannot be used through a gateway")]
    TokenNotUsable,
    /// The simlock lease behind the agent-device lease ended.
    #[error(
        "the simlock lease behind agent-device lease {0} has ended (released, expired, or dropped by a restart of its agent-device daemon); connect again for a new device"
    )]
    LeaseEnded(LeaseId),
    /// A worker's answer to `devices` held no list.
    #[error("could not read the device list from the worker holding lease {0}")]
    DevicesUnreadable(LeaseId),
    /// The token's leases could not be read.
    #[error("could not check your leases; try again")]
    LeaseCheckFailed,
    /// No or an unknown simlock token.
    #[error("{0}")]
    Unauthenticated(String),
    /// A token that may not use this surface.
    #[error("{0}")]
    Forbidden(String),
    /// A request body over its bound.
    #[error("request body is larger than {0} bytes")]
    BodyTooLarge(usize),
    /// A request agent-device's own envelope rules refuse.
    #[error("{message}")]
    Invalid {
        /// JSON-RPC error code (`-32700`, `-32600`, `-32602`).
        rpc_code: i64,
        /// The message.
        message: String,
    },
    /// A JSON-RPC method agent-device does not have: `404` and `-32601`, as its daemon answers.
    #[error("Method not found: {0}")]
    UnknownMethod(String),
    /// No such route.
    #[error("Not found")]
    NotFound,
}

impl Refusal {
    /// An allocate that waited `wait_ms` in simlock's queue and got no device (`QUEUE_TIMEOUT`).
    pub fn queue_wait(wait_ms: u64) -> Self {
        Self::Simlock {
            message: format!(
                "no device became free within {} in simlock's queue (agentDevice.queueWaitMs); try again later",
                simlock_contract::duration::text(wait_ms)
            ),
            code: ErrorCode::QueueTimeout,
        }
    }

    /// simlock refused a call the front made for the caller.
    pub fn from_simlock(err: &ContractError) -> Self {
        Self::Simlock {
            message: err.message.clone(),
            code: err.code,
        }
    }

    /// The HTTP status of the reply.
    pub fn status(&self) -> StatusCode {
        match self {
            Self::NotAvailable { .. } => StatusCode::SERVICE_UNAVAILABLE,
            Self::Simlock { code, .. } => StatusCode::from_u16(code.http_status())
                .unwrap_or(StatusCode::INTERNAL_SERVER_ERROR),
            Self::PlatformUnavailable(_)
            | Self::SimlockPicksDevice
            | Self::TooOld
            | Self::BadLeaseHeader
            | Self::Invalid { .. } => StatusCode::BAD_REQUEST,
            Self::NotYours { .. } | Self::TokenNotUsable | Self::Forbidden(_) => {
                StatusCode::FORBIDDEN
            }
            Self::LeaseEnded(_) | Self::Unauthenticated(_) => StatusCode::UNAUTHORIZED,
            Self::DevicesUnreadable(_) => StatusCode::BAD_GATEWAY,
            Self::LeaseCheckFailed => StatusCode::SERVICE_UNAVAILABLE,
            Self::BodyTooLarge(_) => StatusCode::PAYLOAD_TOO_LARGE,
            Self::NotFound | Self::UnknownMethod(_) => StatusCode::NOT_FOUND,
        }
    }

    /// agent-device's error code for it (`data.code`, or `code` off `/rpc`). A lease that is
    /// not the caller's is `UNAUTHORIZED` with reason `LEASE_SCOPE_MISMATCH`, which the CLI
    /// does not answer by allocating again.
    pub fn code(&self) -> &'static str {
        match self {
            Self::NotAvailable { .. } | Self::LeaseCheckFailed => "UNAVAILABLE",
            Self::Simlock { code, .. } if *code == ErrorCode::BadRequest => "INVALID_ARGS",
            Self::Simlock { .. } | Self::DevicesUnreadable(_) => "COMMAND_FAILED",
            Self::PlatformUnavailable(_)
            | Self::SimlockPicksDevice
            | Self::TooOld
            | Self::BadLeaseHeader
            | Self::BodyTooLarge(_)
            | Self::Invalid { .. }
            | Self::UnknownMethod(_) => "INVALID_ARGS",
            Self::NotYours { .. }
            | Self::TokenNotUsable
            | Self::Forbidden(_)
            | Self::LeaseEnded(_)
            | Self::Unauthenticated(_) => "UNAUTHORIZED",
            Self::NotFound => "NOT_FOUND",
        }
    }

    fn details(&self) -> Option<Value> {
        match self {
            Self::NotYours { .. } => Some(json!({ "reason": "LEASE_SCOPE_MISMATCH" })),
            Self::LeaseEnded(_) => Some(json!({ "reason": "LEASE_ENDED_BY_HOST" })),
            Self::Simlock { code, .. } => Some(json!({ "simlockCode": code.as_str() })),
            _ => None,
        }
    }

    /// What the caller can do about it (agent-device's `hint`, which the CLI prints under the
    /// message), where the front knows.
    fn hint(&self, surface: &Surface) -> Option<&'static str> {
        match (self, surface) {
            (Self::TooOld, Surface::Rpc { .. }) => Some(CONNECT_FIRST_HINT),
            (Self::TooOld, Surface::Route) => Some(TOO_OLD_ROUTE_HINT),
            _ => None,
        }
    }

    /// Whether trying again later may work (`Some(true)`), may not (`Some(false)`), or the reply
    /// does not say (`None`: a refusal of the request itself, as it stands).
    pub fn retriable(&self) -> Option<bool> {
        match self {
            Self::NotAvailable { retriable, .. } => Some(*retriable),
            Self::LeaseCheckFailed => Some(true),
            _ => None,
        }
    }

    /// The reply as an HTTP response in `surface`'s envelope.
    pub fn into_response(self, surface: &Surface) -> Response<Body> {
        let status = self.status();
        self.into_response_with_status(surface, status)
    }

    /// The reply with an explicit status (`/health` answers 200 whatever it says).
    pub fn into_response_with_status(
        self,
        surface: &Surface,
        status: StatusCode,
    ) -> Response<Body> {
        let body = match surface {
            Surface::Rpc { id } => self.rpc_error(id),
            Surface::Route => {
                let message = self.to_string();
                let mut body = Map::new();
                body.insert("ok".into(), Value::Bool(false));
                body.insert("error".into(), Value::from(message));
                body.insert("code".into(), Value::from(self.code()));
                if let Some(details) = self.details() {
                    body.insert("details".into(), details);
                }
                if let Some(hint) = self.hint(surface) {
                    body.insert("hint".into(), Value::from(hint));
                }
                if let Some(retriable) = self.retriable() {
                    body.insert("retriable".into(), Value::Bool(retriable));
                }
                Value::Object(body)
            }
        };
        crate::body::json(status, &body)
    }

    /// The reply as a JSON-RPC error answering the request `id` (the body of an `/rpc` reply,
    /// or the `response` of a progress stream's last line).
    pub fn rpc_error(&self, id: &Value) -> Value {
        let message = self.to_string();
        let mut data = Map::new();
        data.insert("code".into(), Value::from(self.code()));
        data.insert("message".into(), Value::from(message.clone()));
        if let Some(details) = self.details() {
            data.insert("details".into(), details);
        }
        if let Some(hint) = self.hint(&Surface::Rpc { id: id.clone() }) {
            data.insert("hint".into(), Value::from(hint));
        }
        if let Some(retriable) = self.retriable() {
            data.insert("retriable".into(), Value::Bool(retriable));
        }
        let rpc_code = match self {
            Self::Invalid { rpc_code, .. } => *rpc_code,
            Self::UnknownMethod(_) => -32601,
            _ => -32000,
        };
        json!({
            "jsonrpc": "2.0",
            "id": id,
            "error": { "code": rpc_code, "message": message, "data": data },
        })
    }
}

/// The hint to connect first: on [`Refusal::TooOld`] on a gateway's `/rpc` (the published CLI
/// names its lease once it has connected), and on a worker's answer to a device command sent
/// before `connect`, which the daemon refuses for want of the run and lease ids a lease brings
/// (simlock runs every caller in its own tenant, which needs them) in words that do not say what
/// to do.
const CONNECT_FIRST_HINT: &str = "through simlock, requests name the lease `connect` made: run \
    `agent-device connect --remote-config <file>` first, then the device commands";

/// What the daemon says when a tenant's command names no run or lease (`tenant isolation
/// requires run id.`).
const TENANT_ISOLATION_REFUSAL: &str = "tenant isolation requires";

/// Puts the hint to connect first on the daemon's JSON-RPC `answer` to a command that named no
/// lease, when the daemon refused it for want of a lease's ids, in place of the daemon's own
/// hint (its generic one for `INVALID_ARGS`: check the arguments); answers whether it did.
pub fn hint_connect_first(answer: &mut Value) -> bool {
    let Some(error) = answer.get_mut("error").and_then(Value::as_object_mut) else {
        return false;
    };
    let said = |v: Option<&Value>| {
        v.and_then(Value::as_str)
            .is_some_and(|m| m.starts_with(TENANT_ISOLATION_REFUSAL))
    };
    let refused =
        said(error.get("message")) || said(error.get("data").and_then(|d| d.get("message")));
    if !refused {
        return false;
    }
    let data = error
        .entry("data")
        .or_insert_with(|| Value::Object(Map::new()));
    match data.as_object_mut() {
        Some(data) => {
            data.insert("hint".into(), Value::from(CONNECT_FIRST_HINT));
            true
        }
        None => false,
    }
}

/// [`Refusal::TooOld`] on the other routes: only a newer agent-device sends the lease header.
const TOO_OLD_ROUTE_HINT: &str = "through a gateway, uploads, artifact downloads and \
    diagnostics need the x-agent-device-lease-id header, which agent-device 0.21.5 does not \
    send; a worker's own URL serves them without it, where the worker serves HTTP and a token \
    of its own";

/// Where a refusal of a lease is answered from, in its message.
const fn answered_on(hosts: Hosts) -> &'static str {
    match hosts {
        Hosts::One => "",
        Hosts::PerLease => " on this gateway",
    }
}

#[cfg(test)]
mod tests {
    use http_body_util::BodyExt;

    use super::*;

    async fn body_of(response: Response<Body>) -> Value {
        let bytes = response.into_body().collect().await.unwrap().to_bytes();
        serde_json::from_slice(&bytes).unwrap()
    }

    #[tokio::test]
    async fn an_rpc_refusal_is_a_json_rpc_error_with_data_code_and_message() {
        let refusal = Refusal::NotAvailable {
            reason: "the daemon is starting".into(),
            retriable: true,
        };
        let response = refusal.into_response(&Surface::Rpc { id: json!("r1") });
        assert_eq!(response.status(), StatusCode::SERVICE_UNAVAILABLE);
        let body = body_of(response).await;
        assert_eq!(body["id"], json!("r1"));
        assert_eq!(body["error"]["code"], json!(-32000));
        let message = "agent-device is not available on this simlock: the daemon is starting";
        assert_eq!(body["error"]["message"], json!(message));
        assert_eq!(body["error"]["data"]["message"], json!(message));
        assert_eq!(body["error"]["data"]["code"], json!("UNAVAILABLE"));
        assert_eq!(body["error"]["data"]["retriable"], json!(true));
    }

    #[tokio::test]
    async fn the_too_old_refusal_hints_at_connect_on_rpc_and_at_the_header_elsewhere() {
        let rpc = body_of(Refusal::TooOld.into_response(&Surface::Rpc { id: json!("r2") })).await;
        assert_eq!(rpc["error"]["data"]["hint"], json!(CONNECT_FIRST_HINT));
        assert!(CONNECT_FIRST_HINT.contains("agent-device connect --remote-config"));
        let route = body_of(Refusal::TooOld.into_response(&Surface::Route)).await;
        assert_eq!(route["hint"], json!(TOO_OLD_ROUTE_HINT));
        assert!(TOO_OLD_ROUTE_HINT.contains(LEASE_HEADER));
        // Other refusals carry none.
        let other = body_of(Refusal::SimlockPicksDevice.into_response(&Surface::Route)).await;
        assert!(other.get("hint").is_none(), "{other}");
    }

    #[test]
    fn a_command_refused_for_want_of_a_lease_hints_at_connect_and_nothing_else_changes() {
        let refused = |message: &str| {
            json!({"jsonrpc": "2.0", "id": "c1", "error": {"code": -32602, "message": message,
                "data": {"code": "INVALID_ARGS", "message": message}}})
        };
        for missing in ["run id.", "lease id.", "tenant id."] {
            let mut answer = refused(&format!("tenant isolation requires {missing}"));
            assert!(hint_connect_first(&mut answer));
            assert_eq!(answer["error"]["data"]["hint"], json!(CONNECT_FIRST_HINT));
            assert_eq!(answer["error"]["data"]["code"], json!("INVALID_ARGS"));
        }
        // The daemon's generic hint gives way.
        let mut hinted = refused("tenant isolation requires run id.");
        hinted["error"]["data"]["hint"] = json!("Check command arguments and run --help");
        assert!(hint_connect_first(&mut hinted));
        assert_eq!(hinted["error"]["data"]["hint"], json!(CONNECT_FIRST_HINT));
        // Another refusal, and a result: left alone.
        let mut other = refused("Unknown command: frobnicate");
        let mut ok = json!({"jsonrpc": "2.0", "id": "c1", "result": {"ok": true}});
        for answer in [&mut other, &mut ok] {
            let before = answer.clone();
            assert!(!hint_connect_first(answer));
            assert_eq!(*answer, before);
        }
        assert!(CONNECT_FIRST_HINT.contains("agent-device connect --remote-config"));
    }

    #[tokio::test]
    async fn a_route_refusal_is_ok_false_with_error_and_code() {
        let lease = LeaseId::parse("0123456789abcdef0123456789abcdef").unwrap();
        let response = Refusal::NotYours {
            lease: lease.clone(),
            hosts: Hosts::PerLease,
        }
        .into_response(&Surface::Route);
        assert_eq!(response.status(), StatusCode::FORBIDDEN);
        let body = body_of(response).await;
        assert_eq!(body["ok"], json!(false));
        assert_eq!(
            body["error"],
            json!(format!(
                "refused: lease {lease} is not one of yours on this gateway"
            ))
        );
        assert_eq!(body["code"], json!("UNAUTHORIZED"));
        assert_eq!(body["details"]["reason"], json!("LEASE_SCOPE_MISMATCH"));
    }

    #[test]
    fn the_seeds_strings_are_exact() {
        assert_eq!(
            Refusal::TooOld.to_string(),
            "refused: this agent-device is too old to use through a gateway; update it"
        );
        assert_eq!(
            Refusal::BadLeaseHeader.to_string(),
            "refused: the x-agent-device-lease-id header is not a lease id"
        );
        assert_eq!(
            Refusal::SimlockPicksDevice.to_string(),
            "refused: simlock picks the device"
        );
        assert_eq!(
            Refusal::PlatformUnavailable("ios".into()).to_string(),
            "refused: ios is not available on this simlock"
        );
        let lease = LeaseId::parse("0123456789abcdef0123456789abcdef").unwrap();
        assert_eq!(
            Refusal::NotYours {
                lease: lease.clone(),
                hosts: Hosts::One
            }
            .to_string(),
            format!("refused: lease {lease} is not one of yours")
        );
        assert_eq!(
            Refusal::DevicesUnreadable(lease.clone()).to_string(),
            format!("could not read the device list from the worker holding lease {lease}")
        );
        assert_eq!(
            Refusal::DevicesUnreadable(lease).status(),
            StatusCode::BAD_GATEWAY
        );
        assert_eq!(
            Refusal::TokenNotUsable.to_string(),
            "refused: this token cannot be used through a gateway"
        );
    }
}
