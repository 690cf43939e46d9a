//! The fleet's errors, and the one function that turns them into contract errors.
//!
//! Everything inside the crate speaks [`FleetError`]; the `From<FleetError> for ContractError`
//! impl below is the only place a code, a message and details are chosen. A worker's own answer
//! travels as [`FleetError::Worker`] and passes through unchanged; a lost uplink is decided in one
//! function, [`is_uplink_lost`], and reads as [`FleetError::WorkerUnreachable`].

use serde_json::json;
use simlock_contract::ids::RequestId;
use simlock_contract::model::Platform;
use simlock_contract::{ContractError, ErrorCode};

/// Why a fleet operation failed.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum FleetError {
    /// An input broke a rule the contract cannot check alone (the message names the field).
    #[error("{0}")]
    BadRequest(String),
    /// The caller may not do this.
    #[error("{0}")]
    Forbidden(String),
    /// No such lease, or not one the caller may see.
    #[error("unknown lease {0}")]
    UnknownLease(String),
    /// No such worker.
    #[error("unknown worker {0}")]
    UnknownWorker(String),
    /// The worker's uplink is up, so it cannot be removed.
    #[error("worker {0} is connected")]
    WorkerConnected(String),
    /// The worker's uplink is lost, or it did not answer in time.
    #[error("{message}")]
    WorkerUnreachable {
        /// The worker.
        worker_id: String,
        /// What happened.
        message: String,
    },
    /// The requester holds a lease through this gateway.
    #[error("requester {requester_id} holds a lease")]
    RequesterHoldsLease {
        /// The requester.
        requester_id: String,
        /// The lease it holds; `None` when it is another owner's, whose lease id is not told.
        lease_id: Option<String>,
    },
    /// The requester has a request pending at this gateway.
    #[error("requester {0} has a pending request")]
    RequesterPending(String),
    /// The chosen lease id is held.
    #[error("lease id {0} taken")]
    LeaseIdTaken(String),
    /// The idempotency key was recorded by another principal.
    #[error("idempotency key of another principal")]
    IdempotencyForeign,
    /// The idempotency key was used for a different request.
    #[error("idempotency conflict")]
    IdempotencyConflict,
    /// The request waited in the fleet queue past its timeout.
    #[error("request {request_id} timed out")]
    QueueTimeout {
        /// The request.
        request_id: RequestId,
        /// The `timeoutMs` it asked for.
        timeout_ms: u64,
    },
    /// No worker can take the request now (`message` says which way).
    #[error("{0}")]
    NoCapacity(&'static str),
    /// The fleet queue holds `lease.maxWaiting` requests already.
    #[error("the queue is full ({max_waiting} requests wait)")]
    QueueFull {
        /// `lease.maxWaiting`.
        max_waiting: u32,
    },
    /// No known worker serves the platform.
    #[error("no worker serves {}", .0.as_str())]
    NoDriver(Platform),
    /// No known worker lists the model.
    #[error("no worker knows {} model {model}", platform.as_str())]
    UnknownModel {
        /// The platform.
        platform: Platform,
        /// The model as asked.
        model: String,
    },
    /// No known worker runs the model on that OS version.
    #[error("no worker runs {} on {os}", model.as_deref().unwrap_or(platform.as_str()))]
    RuntimeMissing {
        /// The platform.
        platform: Platform,
        /// The model asked, if one was.
        model: Option<String>,
        /// The OS version asked, or `default`.
        os: String,
    },
    /// No worker that could serve the spec has the capability available.
    #[error("no worker can serve {0}")]
    CapabilityMissing(String),
    /// The caller cancelled the request.
    #[error("cancelled")]
    Cancelled,
    /// The gateway is stopping.
    #[error("stopping")]
    Stopping,
    /// A worker's own answer, passed through as it came.
    #[error("{0}")]
    Worker(ContractError),
    /// A worker answered something that is not the operation's output.
    #[error("worker {worker_id} answered an invalid {what}: {detail}")]
    InvalidAnswer {
        /// The worker.
        worker_id: String,
        /// What it should have answered.
        what: &'static str,
        /// Why it does not read.
        detail: String,
    },
    /// A forwarded exec ran past `gateway.execTimeoutMs`.
    #[error("exec on {worker_id} timed out")]
    ExecTimeout {
        /// The worker.
        worker_id: String,
        /// The bound, ms.
        timeout_ms: u128,
    },
    /// `lease.release-all` could not release every lease.
    #[error("some leases could not be released: {message}")]
    SomeNotReleased {
        /// The worker of the first failure, when it named one.
        worker_id: Option<String>,
        /// The first failure's message.
        message: String,
        /// What was released.
        released: Vec<String>,
    },
    /// The gateway's store failed.
    #[error("store: {0}")]
    Store(String),
    /// A release the gateway took (the lease ended here; its worker releases it once back) but
    /// could not store (a full disk).
    #[error("{0}")]
    ReleaseNotStored(String),
}

/// Whether a worker's error means its uplink is lost rather than an answer. This is the one
/// place that decides it for every caller of a worker (lease requests, forwards, the relay).
pub fn is_uplink_lost(err: &ContractError) -> bool {
    err.code.is_transport()
}

impl FleetError {
    /// `WORKER_UNREACHABLE` for a worker whose uplink is lost.
    pub fn unreachable(worker_id: &str) -> Self {
        Self::WorkerUnreachable {
            worker_id: worker_id.to_owned(),
            message: format!("Worker {worker_id} is not connected to this gateway"),
        }
    }

    /// `WORKER_UNREACHABLE` for a worker that did not answer `what` within `bound_ms`.
    pub fn no_answer(worker_id: &str, what: &str, bound_ms: u128) -> Self {
        Self::WorkerUnreachable {
            worker_id: worker_id.to_owned(),
            message: format!("Worker {worker_id} did not answer {what} within {bound_ms} ms"),
        }
    }

    /// A worker's error for the gateway's caller: a lost uplink reads as `WORKER_UNREACHABLE`
    /// naming the worker; every other answer passes through.
    pub fn from_worker(worker_id: &str, err: ContractError) -> Self {
        if is_uplink_lost(&err) {
            Self::unreachable(worker_id)
        } else {
            Self::Worker(err)
        }
    }

    /// The contract code this error answers with.
    pub fn code(&self) -> ErrorCode {
        ContractError::from(self.clone()).code
    }
}

/// The error a caller sees for a worker whose uplink is lost.
pub fn unreachable(worker_id: &str) -> ContractError {
    FleetError::unreachable(worker_id).into()
}

/// Translates a worker's error for the gateway's caller: a lost uplink reads as
/// `WORKER_UNREACHABLE` naming the worker; every other code passes through.
pub fn from_worker(worker_id: &str, err: ContractError) -> ContractError {
    FleetError::from_worker(worker_id, err).into()
}

/// The message of `CAPABILITY_MISSING` through a gateway.
pub fn capability_missing(capability: &str) -> ContractError {
    FleetError::CapabilityMissing(capability.to_owned()).into()
}

impl From<FleetError> for ContractError {
    /// The one place a fleet failure becomes a contract code, message and details.
    fn from(error: FleetError) -> Self {
        match error {
            FleetError::BadRequest(message) => Self::bad_request(message),
            FleetError::Forbidden(message) => Self::forbidden(message),
            FleetError::UnknownLease(lease_id) => Self::unknown_lease(&lease_id),
            FleetError::UnknownWorker(worker_id) => Self::new(
                ErrorCode::UnknownWorker,
                format!("Unknown worker {worker_id}"),
            )
            .with_details(json!({ "workerId": worker_id })),
            FleetError::WorkerConnected(worker_id) => Self::new(
                ErrorCode::WorkerConnected,
                format!(
                    "Worker {worker_id} is connected; it can be removed once its uplink is down"
                ),
            )
            .with_details(json!({ "workerId": worker_id })),
            FleetError::WorkerUnreachable { worker_id, message } => {
                Self::worker_unreachable(&worker_id, message)
            }
            FleetError::RequesterHoldsLease {
                requester_id,
                lease_id: Some(lease_id),
            } => Self::new(
                ErrorCode::RequesterAlreadyLeased,
                format!("Requester {requester_id} already holds lease {lease_id}"),
            )
            .with_details(json!({ "requesterId": requester_id, "existingLeaseId": lease_id })),
            FleetError::RequesterHoldsLease {
                requester_id,
                lease_id: None,
            } => Self::new(
                ErrorCode::RequesterAlreadyLeased,
                format!(
                    "Requester {requester_id} already holds a lease, another owner's: choose \
                     another requesterId"
                ),
            )
            .with_details(json!({ "requesterId": requester_id })),
            FleetError::RequesterPending(requester_id) => Self::new(
                ErrorCode::RequesterAlreadyLeased,
                format!("Requester {requester_id} already has a pending request"),
            )
            .with_details(json!({ "requesterId": requester_id })),
            FleetError::LeaseIdTaken(lease_id) => Self::new(
                ErrorCode::LeaseIdTaken,
                format!("Lease id {lease_id} is held by another lease"),
            )
            .with_details(json!({ "leaseId": lease_id })),
            FleetError::IdempotencyForeign => {
                Self::forbidden("That idempotency key belongs to another principal")
            }
            FleetError::IdempotencyConflict => Self::new(
                ErrorCode::IdempotencyConflict,
                "The idempotency key was used for a different request",
            ),
            FleetError::QueueTimeout {
                request_id,
                timeout_ms,
            } => Self::new(
                ErrorCode::QueueTimeout,
                format!("Request {request_id} got no device within timeoutMs ({timeout_ms} ms)"),
            )
            .with_details(json!({ "requestId": request_id })),
            FleetError::NoCapacity(message) => Self::new(ErrorCode::NoCapacity, message),
            FleetError::QueueFull { max_waiting } => Self::new(
                ErrorCode::NoCapacity,
                format!(
                    "No worker connected to this gateway has a device free now, and the queue \
                     is full (it holds at most {max_waiting} waiting requests, \
                     lease.maxWaiting); try again later"
                ),
            )
            .with_details(serde_json::json!({ "maxWaiting": max_waiting })),
            FleetError::NoDriver(platform) => Self::new(
                ErrorCode::NoDriver,
                format!(
                    "No worker connected to this gateway serves {}",
                    platform.as_str()
                ),
            )
            .with_details(json!({ "platform": platform })),
            FleetError::UnknownModel { platform, model } => Self::new(
                ErrorCode::UnknownModel,
                format!(
                    "No worker connected to this gateway knows the {} model {model}",
                    platform.as_str()
                ),
            )
            .with_details(json!({ "platform": platform, "model": model })),
            FleetError::RuntimeMissing {
                platform,
                model,
                os,
            } => Self::new(
                ErrorCode::RuntimeMissing,
                match model {
                    Some(model) => format!(
                        "No worker connected to this gateway runs the {} model {model} on {os}",
                        platform.as_str()
                    ),
                    None => format!(
                        "No worker connected to this gateway runs {} {os}",
                        platform.as_str()
                    ),
                },
            )
            .with_details(json!({ "platform": platform, "osVersion": os, "downloadable": false })),
            FleetError::CapabilityMissing(capability) => Self::new(
                ErrorCode::CapabilityMissing,
                format!(
                    "No worker connected to this gateway can serve {capability} for this request"
                ),
            )
            .with_details(json!({ "capability": capability })),
            FleetError::Cancelled => {
                Self::new(ErrorCode::Cancelled, "The lease request was cancelled")
            }
            FleetError::Stopping => Self::stopping(),
            FleetError::Worker(err) => err,
            FleetError::InvalidAnswer {
                worker_id,
                what,
                detail,
            } => Self::internal(format!(
                "Worker {worker_id} answered an invalid {what}: {detail}"
            )),
            FleetError::ExecTimeout {
                worker_id,
                timeout_ms,
            } => Self::new(
                ErrorCode::ExecTimeout,
                format!(
                    "The exec on worker {worker_id} ran past gateway.execTimeoutMs ({timeout_ms} ms)"
                ),
            ),
            FleetError::SomeNotReleased {
                worker_id,
                message,
                released,
            } => Self::new(
                ErrorCode::WorkerUnreachable,
                format!("Some leases could not be released: {message}"),
            )
            .with_details(json!({ "workerId": worker_id, "releasedLeaseIds": released })),
            FleetError::Store(message) => Self::internal(message),
            FleetError::ReleaseNotStored(message) => Self::release_not_stored(message),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_lost_uplink_reads_as_unreachable_naming_the_worker_and_other_answers_pass_through() {
        let lost = from_worker("w1", ContractError::connection_lost());
        assert_eq!(lost.code, ErrorCode::WorkerUnreachable);
        assert_eq!(lost.details.unwrap()["workerId"], "w1");
        let answer = ContractError::new(ErrorCode::NoCapacity, "full");
        assert_eq!(from_worker("w1", answer.clone()), answer);
    }

    #[test]
    fn a_queue_timeout_is_worded_as_a_workers_naming_its_timeout() {
        let timed_out: ContractError = FleetError::QueueTimeout {
            request_id: RequestId::from_raw("req_1"),
            timeout_ms: 2000,
        }
        .into();
        assert_eq!(timed_out.code, ErrorCode::QueueTimeout);
        assert_eq!(
            timed_out.message,
            "Request req_1 got no device within timeoutMs (2000 ms)"
        );
        assert_eq!(timed_out.details.unwrap()["requestId"], "req_1");
    }

    #[test]
    fn refusals_keep_the_gateways_messages_and_details() {
        let held: ContractError = FleetError::RequesterHoldsLease {
            requester_id: "a".into(),
            lease_id: Some("w1.lse_1".into()),
        }
        .into();
        assert_eq!(held.code, ErrorCode::RequesterAlreadyLeased);
        assert_eq!(held.details.unwrap()["existingLeaseId"], "w1.lse_1");
        // Another owner's lease is not named.
        let foreign: ContractError = FleetError::RequesterHoldsLease {
            requester_id: "a".into(),
            lease_id: None,
        }
        .into();
        assert_eq!(foreign.code, ErrorCode::RequesterAlreadyLeased);
        assert!(!foreign.message.contains("lse"), "{}", foreign.message);
        assert_eq!(foreign.details, Some(json!({"requesterId": "a"})));
        let missing = capability_missing("gpu");
        assert_eq!(
            missing.message,
            "No worker connected to this gateway can serve gpu for this request"
        );
        let partial: ContractError = FleetError::SomeNotReleased {
            worker_id: Some("w2".into()),
            message: "gone".into(),
            released: vec!["w1.lse_1".into()],
        }
        .into();
        assert_eq!(partial.code, ErrorCode::WorkerUnreachable);
        assert_eq!(
            partial.details.unwrap(),
            json!({"workerId": "w2", "releasedLeaseIds": ["w1.lse_1"]})
        );
        assert_eq!(FleetError::Stopping.code(), ErrorCode::DaemonStopping);
    }

    #[test]
    fn a_missing_runtime_names_the_model_only_when_one_was_asked() {
        let missing = |model: Option<&str>| -> ContractError {
            FleetError::RuntimeMissing {
                platform: Platform::Ios,
                model: model.map(str::to_owned),
                os: "99".into(),
            }
            .into()
        };
        assert_eq!(
            missing(None).message,
            "No worker connected to this gateway runs ios 99"
        );
        assert_eq!(
            missing(Some("iPhone 16")).message,
            "No worker connected to this gateway runs the ios model iPhone 16 on 99"
        );
    }
}
