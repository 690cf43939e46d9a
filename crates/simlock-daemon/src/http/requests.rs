//! Lease requests as an HTTP resource: `POST /v1/lease-requests` starts a `lease.request` in the
//! background and answers once it is queued, working or settled; its state can then be polled
//! (long-poll), followed (SSE) or cancelled.
//!
//! The resource is built on the operation and its `progress` pushes only, so the same code
//! serves a worker and a gateway.

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use parking_lot::Mutex;
use serde_json::Value;
use simlock_contract::ids::RequestId;
use simlock_contract::model::LeaseGrant;
use simlock_contract::ops::{
    CancelResult, LeaseCancelOutput, LeaseRequest, LeaseRequestInput, Operation as _,
};
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
    records: Mutex<Records>,
    clock: SharedClock,
    retention_ms: i64,
    max_records: usize,
}

/// The records, and the settled ones in the order they settled, so that pruning costs what it
/// drops and not a scan of every record.
#[derive(Default)]
struct Records {
    by_id: HashMap<String, Arc<Record>>,
    /// `(settled_at, id)` of every recorded request that settled, oldest first.
    settled: VecDeque<(i64, String)>,
}

impl Records {
    /// Drops what settled `retention_ms` or more before `now`, then the oldest settled while
    /// `max` or more are held (room for one more); pending ones stay.
    fn prune(&mut self, now: i64, retention_ms: i64, max: usize) {
        while let Some((at, _)) = self.settled.front()
            && now.saturating_sub(*at) >= retention_ms
        {
            if let Some((_, id)) = self.settled.pop_front() {
                self.by_id.remove(&id);
            }
        }
        while self.by_id.len() >= max {
            let Some((_, id)) = self.settled.pop_front() else {
                break;
            };
            self.by_id.remove(&id);
        }
    }

    /// `id` settled at `at`: it joins the order, once it is recorded.
    fn settled(&mut self, id: &str, at: i64) {
        if self.by_id.contains_key(id) {
            self.settled.push_back((at, id.to_owned()));
        }
    }
}

impl std::fmt::Debug for RequestBook {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RequestBook")
            .field("records", &self.records.lock().by_id.len())
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
            records: Mutex::new(Records::default()),
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
        input: &LeaseRequestInput,
    ) -> Submitted {
        self.prune();
        let payload = match serde_json::to_value(input) {
            Ok(payload) => payload,
            Err(e) => return Submitted::Refused(ContractError::internal(e.to_string())),
        };
        let requester = input
            .requester_id
            .clone()
            .unwrap_or_else(|| principal.clone());
        let id = RequestId::mint();
        let view = RequestView {
            id: id.clone(),
            state: RequestState::Pending,
            queue_position: None,
            waiting_for: None,
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
        let call = pipeline.call(ctx, LeaseRequest::NAME, Some(payload));
        let task_record = record.clone();
        let clock = self.clock.clone();
        let (book, key) = (self.clone(), id.as_str().to_owned());
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
            let now = clock.now_ms();
            // Under the book's lock, so that the submit's insert and this settle agree on who
            // puts it in the settled order.
            let mut records = book.records.lock();
            settle(&task_record, outcome, now);
            records.settled(&key, now);
        });
        // Answer once something happened: a push, or the outcome.
        let _ = changes.changed().await;
        let view = record.view.borrow().clone();
        if view.state == RequestState::Failed && !record.progressed.load(Ordering::SeqCst) {
            let err = view.error.clone().map_or_else(
                || ContractError::internal("request failed"),
                ContractError::from_body,
            );
            // A failure only a waiting request can have is the end of an earlier request this
            // one repeats (its idempotency key): answered as that request's view, as a
            // cancelled one is, not as a refusal of this submission.
            if !err.code.ends_an_admitted_request() {
                return Submitted::Refused(err);
            }
        }
        let mut records = self.records.lock();
        let settled_at = *record.settled_at.lock();
        records.by_id.insert(id.as_str().to_owned(), record);
        if let Some(at) = settled_at {
            records.settled(id.as_str(), at);
        }
        drop(records);
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
                // Settled here when the operation's own end has not come yet (a gateway answers
                // the cancel first): with its error, as every cancelled view has.
                record.view.send_modify(|v| {
                    if !v.state.is_settled() {
                        v.enter(RequestState::Cancelled);
                        v.error = Some(
                            ContractError::new(
                                ErrorCode::Cancelled,
                                format!("Request {id} was cancelled"),
                            )
                            .to_body(),
                        );
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
        let record = self.records.lock().by_id.get(id).cloned().ok_or_else(|| {
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

    /// Drops settled records past retention, and the oldest settled ones while the book is
    /// full (pending requests are never dropped). Costs what it drops.
    fn prune(&self) {
        let now = self.clock.now_ms();
        self.records
            .lock()
            .prune(now, self.retention_ms, self.max_records);
    }
}

fn apply_progress(record: &Record, push: &Push) {
    let Push::Progress { progress, .. } = push else {
        return;
    };
    record.progressed.store(true, Ordering::SeqCst);
    record.view.send_modify(|v| {
        v.queue_position = None;
        v.waiting_for = None;
        v.eta_seconds = None;
        match *progress {
            Progress::Queued {
                queue_position,
                waiting_for,
            } => {
                v.state = RequestState::Queued;
                v.queue_position = Some(queue_position);
                v.waiting_for = waiting_for;
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
        v.waiting_for = None;
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
                // A cancel that settled the view first keeps what it said.
                if v.error.is_none() {
                    v.error = Some(err.to_body());
                }
            }
            Err(err) => {
                debug!(code = %err.code, "lease request failed");
                v.state = RequestState::Failed;
                v.error = Some(err.to_body());
            }
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record() -> Arc<Record> {
        Arc::new(Record {
            owner: "tok_a".into(),
            requester: "r".into(),
            view: watch::Sender::new(RequestView {
                id: RequestId::mint(),
                state: RequestState::Pending,
                queue_position: None,
                waiting_for: None,
                eta_seconds: None,
                created_at: 0,
                lease: None,
                error: None,
            }),
            settled_at: Mutex::new(None),
            progressed: AtomicBool::new(false),
        })
    }

    /// A book with `settled` requests settled at the given times and `pending` ones.
    fn book(settled: &[i64], pending: usize) -> Records {
        let mut records = Records::default();
        for (i, at) in settled.iter().enumerate() {
            let id = format!("s{i}");
            records.by_id.insert(id.clone(), record());
            records.settled(&id, *at);
        }
        for i in 0..pending {
            records.by_id.insert(format!("p{i}"), record());
        }
        records
    }

    fn ids(records: &Records) -> Vec<String> {
        let mut ids: Vec<String> = records.by_id.keys().cloned().collect();
        ids.sort();
        ids
    }

    #[test]
    fn a_settled_request_goes_at_its_retention_and_not_a_moment_before() {
        let mut records = book(&[0, 1, 2], 1);
        records.prune(9, 10, 100);
        assert_eq!(ids(&records), ["p0", "s0", "s1", "s2"], "before the bound");
        records.prune(10, 10, 100);
        assert_eq!(ids(&records), ["p0", "s1", "s2"], "at it");
        records.prune(1_000, 10, 100);
        assert_eq!(ids(&records), ["p0"], "pending ones stay");
    }

    #[test]
    fn a_full_book_drops_the_oldest_settled_first_and_never_a_pending_one() {
        let mut records = book(&[5, 6, 7], 2);
        records.prune(8, 1_000, 4);
        assert_eq!(ids(&records), ["p0", "p1", "s2"], "room for one more");
        let mut all_pending = book(&[], 3);
        all_pending.prune(8, 1_000, 2);
        assert_eq!(ids(&all_pending), ["p0", "p1", "p2"]);
    }

    #[test]
    fn a_settled_request_keeps_nothing_of_its_wait() {
        use simlock_contract::push::WaitingFor;
        for outcome in [
            Err(ContractError::new(ErrorCode::QueueTimeout, "no device")),
            Err(ContractError::new(ErrorCode::Cancelled, "withdrawn")),
        ] {
            let record = record();
            let queued = Push::Progress {
                request_id: 1.into(),
                progress: Progress::Queued {
                    queue_position: 2,
                    waiting_for: Some(WaitingFor::Capacity),
                },
            };
            apply_progress(&record, &queued);
            assert_eq!(record.view.borrow().waiting_for, Some(WaitingFor::Capacity));
            settle(&record, outcome, 10);
            let view = record.view.borrow();
            assert!(view.state.is_settled(), "{:?}", view.state);
            assert_eq!(view.queue_position, None);
            assert_eq!(view.waiting_for, None, "{:?}", view.state);
        }
    }

    #[test]
    fn a_request_joins_the_settled_order_only_once_it_is_recorded() {
        let mut records = Records::default();
        records.settled("early", 1);
        assert!(
            records.settled.is_empty(),
            "not recorded yet: the submit adds it"
        );
    }
}
