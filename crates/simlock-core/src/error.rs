//! The worker domain's errors, and the one function that turns them into contract errors.
//!
//! Everything inside the crate speaks [`CoreError`]; the `From<CoreError> for ContractError`
//! impl at the bottom is the only place a code, a message and details are chosen.

use serde_json::json;
use simlock_contract::ids::RequestId;
use simlock_contract::model::Platform;
use simlock_contract::{ContractError, ErrorCode};
use simlock_daemon::store::StoreError;

use crate::driver::DriverError;

/// What a requester already holds or waits for, as a refusal of its next request tells it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Held {
    /// A lease of the asking owner's.
    Lease(String),
    /// A pending request of the asking owner's.
    Pending(String),
    /// A lease or a pending request of another owner's: its id is not told.
    Foreign,
}

/// Why a worker operation failed.
#[derive(Debug, thiserror::Error)]
pub enum CoreError {
    /// An input broke a rule the contract cannot check alone (the message names the field).
    #[error("{0}")]
    BadRequest(String),
    /// The caller may not do this.
    #[error("{0}")]
    Forbidden(String),
    /// No such lease, or not one the caller may see.
    #[error("unknown lease {0}")]
    UnknownLease(String),
    /// No device now and the request would not wait.
    #[error("no capacity")]
    NoCapacity {
        /// Whether other requests were already waiting.
        waiters_ahead: bool,
    },
    /// The queue holds `lease.maxWaiting` requests already.
    #[error("the queue is full ({max_waiting} requests wait)")]
    QueueFull {
        /// `lease.maxWaiting`.
        max_waiting: usize,
    },
    /// The request waited past its deadline.
    #[error("request {request_id} timed out in the queue")]
    QueueTimeout {
        /// The request.
        request_id: RequestId,
        /// Its `timeoutMs`.
        timeout_ms: u64,
    },
    /// The requester already holds a lease or has a pending request.
    #[error("requester {requester_id} already leased")]
    RequesterAlreadyLeased {
        /// The requester.
        requester_id: String,
        /// What it holds or waits for, named to its owner only.
        held: Held,
    },
    /// The idempotency key was used for a different request.
    #[error("idempotency conflict")]
    IdempotencyConflict {
        /// The requester.
        requester_id: String,
        /// The key.
        key: String,
    },
    /// The idempotency key was recorded by another principal.
    #[error("idempotency key of another principal")]
    IdempotencyForeign {
        /// The requester.
        requester_id: String,
        /// The key.
        key: String,
    },
    /// The chosen lease id is held.
    #[error("lease id {0} taken")]
    LeaseIdTaken(String),
    /// No driver serves the platform.
    #[error("no driver for {0}")]
    NoDriver(Platform),
    /// The platform's driver cannot serve now (its tools are missing or broken).
    #[error("the {platform} driver is unavailable: {reason}")]
    PlatformUnavailable {
        /// The platform.
        platform: Platform,
        /// Why.
        reason: String,
    },
    /// The catalog has no such model.
    #[error("unknown model {model}")]
    UnknownModel {
        /// The platform.
        platform: Platform,
        /// The model as asked.
        model: String,
        /// The models the catalog has for the platform.
        known: Vec<String>,
    },
    /// The model does not run that OS version here.
    #[error("runtime {os_version} missing")]
    RuntimeMissing {
        /// The platform.
        platform: Platform,
        /// The OS version as asked.
        os_version: String,
        /// The model it was asked for, when one was resolved.
        model: Option<String>,
    },
    /// A required capability is not available.
    #[error("capability {capability} missing")]
    CapabilityMissing {
        /// The capability.
        capability: String,
        /// Why it is not available, when known.
        reason: Option<String>,
    },
    /// The tool is not one `device.exec` may run.
    #[error("unknown tool {tool}")]
    UnknownTool {
        /// The tool.
        tool: String,
        /// The tools that may run.
        known: Vec<String>,
    },
    /// The tool could not be started.
    #[error("tool {tool} could not start: {source}")]
    ExecSpawn {
        /// The tool.
        tool: String,
        /// The program its configuration names.
        command: String,
        /// Why.
        source: std::io::Error,
    },
    /// The tool ran past `exec.timeoutMs`.
    #[error("tool {tool} timed out")]
    ExecTimeout {
        /// The tool.
        tool: String,
        /// The limit.
        timeout_ms: u64,
    },
    /// The request was withdrawn with `lease.cancel`.
    #[error("request {0} cancelled")]
    Cancelled(RequestId),
    /// The request was open when the daemon stopped.
    #[error("request {0} lost to a restart")]
    Restarted(RequestId),
    /// Device work failed too often for the request.
    #[error("device work failed: {0}")]
    DeviceWork(String),
    /// A driver failed.
    #[error(transparent)]
    Driver(#[from] DriverError),
    /// The state store failed.
    #[error(transparent)]
    Store(#[from] StoreError),
    /// An outcome recorded earlier (an idempotent replay), answered as it was.
    #[error("{0}")]
    Recorded(ContractError),
    /// Something that should not happen.
    #[error("{0}")]
    Internal(String),
}

impl From<CoreError> for ContractError {
    /// The one place a worker failure becomes a contract code, message and details.
    fn from(error: CoreError) -> Self {
        match error {
            CoreError::BadRequest(message) => Self::bad_request(message),
            CoreError::Forbidden(message) => Self::forbidden(message),
            CoreError::UnknownLease(lease_id) => Self::unknown_lease(&lease_id),
            CoreError::NoCapacity { waiters_ahead } => Self::new(
                ErrorCode::NoCapacity,
                if waiters_ahead {
                    "No device is free: other requests are waiting and this one would not wait"
                } else {
                    "No device is free now and the request would not wait"
                },
            ),
            CoreError::QueueFull { max_waiting } => Self::new(
                ErrorCode::NoCapacity,
                format!(
                    "No device is free now, and the queue is full (it holds at most \
                     {max_waiting} waiting requests, lease.maxWaiting); try again later"
                ),
            )
            .with_details(serde_json::json!({ "maxWaiting": max_waiting })),
            CoreError::QueueTimeout {
                request_id,
                timeout_ms,
            } => Self::new(
                ErrorCode::QueueTimeout,
                format!("Request {request_id} got no device within timeoutMs ({timeout_ms} ms)"),
            )
            .with_details(json!({ "requestId": request_id })),
            CoreError::RequesterAlreadyLeased { requester_id, held } => {
                let message = match &held {
                    Held::Lease(lease) => {
                        format!("Requester {requester_id} already holds lease {lease}")
                    }
                    Held::Pending(request) => {
                        format!("Requester {requester_id} already has a pending request {request}")
                    }
                    Held::Foreign => format!(
                        "Requester {requester_id} already holds a lease or waits for one, for \
                         another owner: choose another requesterId"
                    ),
                };
                let details = match held {
                    Held::Lease(lease) => {
                        json!({ "requesterId": requester_id, "existingLeaseId": lease })
                    }
                    Held::Pending(_) | Held::Foreign => json!({ "requesterId": requester_id }),
                };
                Self::new(ErrorCode::RequesterAlreadyLeased, message).with_details(details)
            }
            CoreError::IdempotencyConflict { requester_id, key } => Self::new(
                ErrorCode::IdempotencyConflict,
                format!(
                    "idempotencyKey {key:?} of requester {requester_id} was used for a different request"
                ),
            ),
            CoreError::IdempotencyForeign { requester_id, key } => Self::forbidden(format!(
                "idempotencyKey {key:?} of requester {requester_id} belongs to another principal"
            )),
            CoreError::LeaseIdTaken(lease_id) => Self::new(
                ErrorCode::LeaseIdTaken,
                format!("Lease id {lease_id} is already held"),
            ),
            CoreError::NoDriver(platform) => Self::new(
                ErrorCode::NoDriver,
                format!("This worker has no {platform} driver"),
            )
            .with_details(json!({ "platform": platform })),
            CoreError::PlatformUnavailable { platform, reason } => Self::new(
                ErrorCode::NoDriver,
                format!("This worker's {platform} driver is unavailable: {reason}"),
            )
            .with_details(json!({ "platform": platform })),
            CoreError::UnknownModel {
                platform,
                model,
                known,
            } => Self::new(
                ErrorCode::UnknownModel,
                format!(
                    "No {platform} model named {model:?} in this worker's catalog; {}",
                    models_here(&known)
                ),
            )
            .with_details(json!({ "platform": platform, "model": model })),
            CoreError::RuntimeMissing {
                platform,
                os_version,
                model,
            } => {
                let message = match model {
                    Some(model) => format!("{model} has no {platform} runtime {os_version} here"),
                    None => format!("No {platform} runtime {os_version} here"),
                };
                Self::new(ErrorCode::RuntimeMissing, message).with_details(json!({
                    "platform": platform,
                    "osVersion": os_version,
                    "downloadable": false,
                }))
            }
            CoreError::CapabilityMissing { capability, reason } => {
                let message = match reason {
                    Some(reason) => format!("This worker cannot serve {capability}: {reason}"),
                    None => format!("This worker cannot serve {capability}"),
                };
                Self::new(ErrorCode::CapabilityMissing, message)
                    .with_details(json!({ "capability": capability }))
            }
            CoreError::UnknownTool { tool, known } => {
                let message = if known.is_empty() {
                    format!("Unknown exec tool {tool:?}: this worker runs no tools (exec.tools)")
                } else {
                    format!(
                        "Unknown exec tool {tool:?}: this worker runs {}",
                        known.join(", ")
                    )
                };
                Self::new(ErrorCode::UnknownPassthroughTool, message)
                    .with_details(json!({ "tool": tool }))
            }
            CoreError::ExecSpawn {
                tool,
                command,
                source,
            } => {
                // A program this machine cannot run is the operator's configuration to fix, not
                // a fault of the daemon.
                let why = match source.kind() {
                    std::io::ErrorKind::NotFound => "not found",
                    std::io::ErrorKind::PermissionDenied => "permission denied",
                    _ => {
                        return Self::internal(format!(
                            "Exec tool {tool} could not start: {source}"
                        ));
                    }
                };
                Self::new(
                    ErrorCode::PassthroughRefused,
                    format!(
                        "Exec tool {tool} runs {command}, which this worker cannot run ({why}): \
                         fix exec.tools.{tool}.command in the worker's configuration"
                    ),
                )
                .with_details(json!({ "tool": tool }))
            }
            CoreError::ExecTimeout { tool, timeout_ms } => Self::new(
                ErrorCode::ExecTimeout,
                format!("{tool} ran past exec.timeoutMs ({timeout_ms} ms) and was stopped"),
            ),
            CoreError::Cancelled(request_id) => Self::new(
                ErrorCode::Cancelled,
                format!("Request {request_id} was cancelled"),
            ),
            CoreError::Restarted(request_id) => Self::internal(format!(
                "Request {request_id} did not finish: the daemon restarted"
            )),
            CoreError::DeviceWork(why) => {
                Self::internal(format!("No device could be made ready: {why}"))
            }
            CoreError::Driver(e) => Self::internal(e.to_string()),
            CoreError::Store(e) => Self::internal(e.to_string()),
            CoreError::Recorded(e) => e,
            CoreError::Internal(message) => Self::internal(message),
        }
    }
}

/// The most models an `UNKNOWN_MODEL` message names.
const MODELS_NAMED: usize = 8;

/// The models a catalog has, for a message: at most [`MODELS_NAMED`] of them.
fn models_here(known: &[String]) -> String {
    match known {
        [] => "it has none".to_owned(),
        few if few.len() <= MODELS_NAMED => format!("it has {}", few.join(", ")),
        many => format!(
            "it has {} and {} more (simlock catalog lists them)",
            many[..MODELS_NAMED].join(", "),
            many.len() - MODELS_NAMED
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn already_leased_names_the_lease_in_message_and_details() {
        let err = ContractError::from(CoreError::RequesterAlreadyLeased {
            requester_id: "agent-1".into(),
            held: Held::Lease("lse_1".into()),
        });
        assert_eq!(err.code, ErrorCode::RequesterAlreadyLeased);
        assert!(err.message.contains("lse_1"), "{}", err.message);
        assert_eq!(
            err.details,
            Some(json!({"requesterId": "agent-1", "existingLeaseId": "lse_1"}))
        );
        // Another owner's lease or request is not named.
        let err = ContractError::from(CoreError::RequesterAlreadyLeased {
            requester_id: "agent-1".into(),
            held: Held::Foreign,
        });
        assert!(!err.message.contains("lse_"), "{}", err.message);
        assert_eq!(err.details, Some(json!({"requesterId": "agent-1"})));
    }

    #[test]
    fn capability_missing_carries_the_capability_and_the_reason() {
        let err = ContractError::from(CoreError::CapabilityMissing {
            capability: "agent-device".into(),
            reason: Some("its daemon is not running".into()),
        });
        assert_eq!(err.code, ErrorCode::CapabilityMissing);
        assert_eq!(
            err.message,
            "This worker cannot serve agent-device: its daemon is not running"
        );
        assert_eq!(err.details, Some(json!({"capability": "agent-device"})));
    }

    #[test]
    fn an_unknown_model_names_the_models_the_catalog_has() {
        let err = ContractError::from(CoreError::UnknownModel {
            platform: Platform::Android,
            model: "pixel8".into(),
            known: vec!["Pixel 8".into(), "Pixel Tablet".into()],
        });
        assert_eq!(err.code, ErrorCode::UnknownModel);
        assert_eq!(
            err.message,
            "No android model named \"pixel8\" in this worker's catalog; it has Pixel 8, Pixel Tablet"
        );
        let many: Vec<String> = (1..=10).map(|n| format!("M{n}")).collect();
        assert_eq!(
            models_here(&many[..MODELS_NAMED]),
            "it has M1, M2, M3, M4, M5, M6, M7, M8"
        );
        assert_eq!(
            models_here(&many[..=MODELS_NAMED]),
            "it has M1, M2, M3, M4, M5, M6, M7, M8 and 1 more (simlock catalog lists them)"
        );
        assert_eq!(
            models_here(&many),
            "it has M1, M2, M3, M4, M5, M6, M7, M8 and 2 more (simlock catalog lists them)"
        );
        assert_eq!(models_here(&[]), "it has none");
    }
}
