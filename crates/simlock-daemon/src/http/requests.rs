//! Lease requests as an HTTP resource: `POST /v1/lease-requests` starts a `lease.request` in the
//! background and answers once it is queued, working or settled; its state can then be polled
//! (long-poll), followed (SSE) or cancelled.
//!
//! The resource is built on the operation and its `progress` pushes only, so the same code
//! serves a worker and a gateway.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use parking_lot::Mutex;
use serde_json::Value;
use simlock_contract::ids::RequestId;
use simlock_contract::model::LeaseGrant;
use simlock_contract::ops::{CancelResult, LeaseCancelOutput};
use simlock_contract::push::Progress;
use simlock_contract::{ContractError, ErrorCode, Push, Role};
use tokio::sync::{mpsc, watch};
use tracing::debug;

pub use simlock_contract::http::{RequestState, RequestView};

use crate::clock::SharedClock;
use crate::context::{CallCtx, Viewer};
use crate::pipeline::Pipeline;

/// The longest long-poll: 60 s.
pub const MAX_WAIT: Duration = Duration::from_secs(60);

struct Record {
    owner: String,
    requester: String,
    view: watch::Sender<RequestView>,
    settled_at: Mutex<Option<i64>>,
    /// Whether a progress push came: after one, a failure is the request's outcome, not a
    /// refusal of the submission.
    progressed: AtomicBool,
}

/// The lease requests made over HTTP.
pub struct RequestBook {
    records: Mutex<HashMap<String, Arc<Record>>>,
    clock: SharedClock,
    retention_ms: i64,
    max_records: usize,
}

impl std::fmt::Debug for RequestBook {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RequestBook")
            .field("records", &self.records.lock().len())
            .finish_non_exhaustive()
    }
}

/// What `POST` answers.
#[derive(Debug)]
pub enum Submitted {
    /// Recorded; the view as it stands.
    Accepted(Box<RequestView>),
    /// Refused before any work started.
    Refused(ContractError),
}

impl RequestBook {
    /// A book keeping settled requests `retention_ms`, at most `max_records` of them.
    pub fn new(clock: SharedClock, retention_ms: u64, max_records: usize) -> Arc<Self> {
        Arc::new(Self {
            records: Mutex::new(HashMap::new()),
            clock,
            retention_ms: i64::try_from(retention_ms).unwrap_or(i64::MAX),
            max_records: max_records.max(1),
        })
    }

    /// Starts `lease.request` with `payload` for the caller and waits until it is queued,
    /// working or settled. A refusal before any work (no capacity, already leased, unknown
    /// model…) fails the submission and leaves no record.
    pub async fn submit(
        self: &Arc<Self>,
        pipeline: &Arc<Pipeline>,
        principal: String,
        role: Role,
        payload: Value,
    ) -> Submitted {
        self.prune();
        let requester = payload
            .get("requesterId")
            .and_then(Value::as_str)
            .map_or_else(|| principal.clone(), String::from);
        let id = RequestId::mint();
        let view = RequestView {
            id: id.clone(),
            state: RequestState::Pending,
            queue_position: None,
            eta_seconds: None,
            created_at: self.clock.now_ms(),
            lease: None,
            error: None,
        };
        let record = Arc::new(Record {
            owner: principal.clone(),
            requester,
            view: watch::Sender::new(view),
            settled_at: Mutex::new(None),
            progressed: AtomicBool::new(false),
        });
        let mut changes = record.view.subscribe();
        let (push_tx, mut push_rx) = mpsc::channel::<Push>(16);
        let ctx = CallCtx::http(principal, role, Some(push_tx));
        let call = pipeline.call(ctx, "lease.request", Some(payload));
        let task_record = record.clone();
        let clock = self.clock.clone();
        tokio::spawn(async move {
            let mut call = call;
            let outcome = loop {
                tokio::select! {
                    biased;
                    Some(push) = push_rx.recv() => apply_progress(&task_record, &push),
                    outcome = &mut call => break outcome,
                }
            };
            while let Ok(push) = push_rx.try_recv() {
                apply_progress(&task_record, &push);
            }
            settle(&task_record, outcome, clock.now_ms());
        });
        // Answer once something happened: a push, or the outcome.
        let _ = changes.changed().await;
        let view = record.view.borrow().clone();
        if view.state == RequestState::Failed && !record.progressed.load(Ordering::SeqCst) {
            let err = view.error.clone().map_or_else(
                || ContractError::internal("request failed"),
                ContractError::from_body,
            );
            return Submitted::Refused(err);
        }
        self.records.lock().insert(id.as_str().to_owned(), record);
        Submitted::Accepted(Box::new(view))
    }

    /// The view of request `id` if `principal` may see it (its owner, or an admin).
    ///
    /// # Errors
    /// `UNKNOWN_LEASE_REQUEST` (404) or `FORBIDDEN` (403).
    pub fn view(
        &self,
        id: &str,
        principal: &str,
        role: Role,
    ) -> Result<watch::Receiver<RequestView>, ContractError> {
        let record = self.record(id, principal, role)?;
        Ok(record.view.subscribe())
    }

    /// Waits up to `wait` (at most [`MAX_WAIT`]) for request `id` to settle, then answers its view.
    ///
    /// # Errors
    /// As [`Self::view`].
    pub async fn poll(
        &self,
        id: &str,
        principal: &str,
        role: Role,
        wait: Duration,
    ) -> Result<RequestView, ContractError> {
        let mut rx = self.view(id, principal, role)?;
        let wait = wait.min(MAX_WAIT);
        let _ = tokio::time::timeout(wait, rx.wait_for(|v| v.state.is_settled())).await;
        let view = rx.borrow().clone();
        Ok(view)
    }

    /// Cancels request `id`.
    ///
    /// # Errors
    /// `REQUEST_NOT_CANCELLABLE` (409, naming the lease when granted), or as [`Self::view`].
    pub async fn cancel(
        &self,
        pipeline: &Arc<Pipeline>,
        id: &str,
        principal: &str,
        role: Role,
    ) -> Result<(), ContractError> {
        let record = self.record(id, principal, role)?;
        let view = record.view.borrow().clone();
        match view.state {
            RequestState::Cancelled => return Ok(()),
            RequestState::Granted => {
                let lease = view
                    .lease
                    .as_ref()
                    .map(|g| g.lease.id.to_string())
                    .unwrap_or_default();
                return Err(ContractError::new(
                    ErrorCode::RequestNotCancellable,
                    format!(
                        "Request {id} was already granted lease {lease}; release the lease instead"
                    ),
                )
                .with_details(serde_json::json!({ "leaseId": lease, "state": "granted" })));
            }
            RequestState::Failed => {
                return Err(ContractError::new(
                    ErrorCode::RequestNotCancellable,
                    format!("Request {id} already failed"),
                )
                .with_details(serde_json::json!({ "state": "failed" })));
            }
            RequestState::Pending
            | RequestState::Unknown
            | RequestState::Queued
            | RequestState::Provisioning
            | RequestState::Booting
            | RequestState::Reclaiming => {}
        }
        let ctx = CallCtx::http(record.owner.clone(), role, None);
        let payload = serde_json::json!({ "requesterId": record.requester });
        let value = pipeline.call(ctx, "lease.cancel", Some(payload)).await?;
        let outcome: LeaseCancelOutput = serde_json::from_value(value)
            .map_err(|e| ContractError::internal(format!("invalid lease.cancel output: {e}")))?;
        match outcome.result {
            CancelResult::Cancelled => {
                record.view.send_modify(|v| {
                    if !v.state.is_settled() {
                        v.state = RequestState::Cancelled;
                    }
                });
                Ok(())
            }
            CancelResult::NotCancellable => Err(ContractError::new(
                ErrorCode::RequestNotCancellable,
                format!(
                    "Request {id} is past the point where it can be cancelled: a device is being made ready for it"
                ),
            )
            .with_details(serde_json::json!({ "state": "starting" }))),
            CancelResult::NotFound => {
                // It settled in between: answer by its final state.
                let mut rx = record.view.subscribe();
                let _ = tokio::time::timeout(
                    Duration::from_secs(5),
                    rx.wait_for(|v| v.state.is_settled()),
                )
                .await;
                let state = rx.borrow().state;
                if state == RequestState::Cancelled {
                    Ok(())
                } else {
                    Err(ContractError::new(
                        ErrorCode::RequestNotCancellable,
                        format!("Request {id} already {}", state.as_str()),
                    )
                    .with_details(serde_json::json!({ "state": state.as_str() })))
                }
            }
        }
    }

    fn record(&self, id: &str, principal: &str, role: Role) -> Result<Arc<Record>, ContractError> {
        let record = self.records.lock().get(id).cloned().ok_or_else(|| {
            ContractError::new(
                ErrorCode::UnknownLeaseRequest,
                format!("Unknown lease request {id}"),
            )
            .with_details(serde_json::json!({ "requestId": id }))
        })?;
        if !Viewer::new(principal, role).may_see(&record.owner) {
            return Err(ContractError::forbidden(format!(
                "Lease request {id} belongs to another token"
            )));
        }
        Ok(record)
    }

    /// Drops settled records past retention, and the oldest settled ones over the cap.
    fn prune(&self) {
        let now = self.clock.now_ms();
        let mut records = self.records.lock();
        records.retain(|_, r| {
            r.settled_at
                .lock()
                .is_none_or(|at| now.saturating_sub(at) < self.retention_ms)
        });
        if records.len() >= self.max_records {
            let mut settled: Vec<(String, i64)> = records
                .iter()
                .filter_map(|(id, r)| r.settled_at.lock().map(|at| (id.clone(), at)))
                .collect();
            settled.sort_by_key(|(_, at)| *at);
            let excess = records.len() + 1 - self.max_records;
            for (id, _) in settled.into_iter().take(excess) {
                records.remove(&id);
            }
        }
    }
}

fn apply_progress(record: &Record, push: &Push) {
    let Push::Progress { progress, .. } = push else {
        return;
    };
    record.progressed.store(true, Ordering::SeqCst);
    record.view.send_modify(|v| {
        v.queue_position = None;
        v.eta_seconds = None;
        match *progress {
            Progress::Queued { queue_position } => {
                v.state = RequestState::Queued;
                v.queue_position = Some(queue_position);
            }
            Progress::Provisioning { eta_ms } => {
                v.state = RequestState::Provisioning;
                v.eta_seconds = Some(eta_ms.div_ceil(1000));
            }
            Progress::Booting { eta_ms } => {
                v.state = RequestState::Booting;
                v.eta_seconds = Some(eta_ms.div_ceil(1000));
            }
            Progress::Reclaiming { eta_ms } => {
                v.state = RequestState::Reclaiming;
                v.eta_seconds = Some(eta_ms.div_ceil(1000));
            }
        }
    });
}

fn settle(record: &Record, outcome: Result<Value, ContractError>, now: i64) {
    *record.settled_at.lock() = Some(now);
    record.view.send_modify(|v| {
        v.queue_position = None;
        v.eta_seconds = None;
        match outcome {
            Ok(value) => match serde_json::from_value::<LeaseGrant>(value) {
                Ok(grant) => {
                    v.state = RequestState::Granted;
                    v.lease = Some(grant);
                }
                Err(e) => {
                    v.state = RequestState::Failed;
                    v.error = Some(
                        ContractError::internal(format!("invalid lease.request output: {e}"))
                            .to_body(),
                    );
                }
            },
            Err(err) if v.state == RequestState::Cancelled || err.code == ErrorCode::Cancelled => {
                v.state = RequestState::Cancelled;
                v.error = Some(err.to_body());
            }
            Err(err) => {
                debug!(code = %err.code, "lease request failed");
                v.state = RequestState::Failed;
                v.error = Some(err.to_body());
            }
        }
    });
}
