//! A lease request in flight: its progress, its outcome, and how it is withdrawn.
//!
//! Abort follows the contract's rule for typed clients: send `lease.cancel` for the request's
//! requester; `cancelled` ends it `CANCELLED`; `not-cancellable` (a device is already being made
//! ready) waits for the outcome, releases any grant, then ends `CANCELLED`; `not-found` (it
//! settled meanwhile) ends with the request's own outcome.

use std::sync::Arc;
use std::time::Duration;

use serde_json::Value;
use simlock_contract::http::{LeaseRequestBody, RequestView};
use simlock_contract::model::LeaseGrant;
use simlock_contract::ops::{CancelResult, LeaseRequest, LeaseRequestInput};
use simlock_contract::push::Progress;
use simlock_contract::{ContractError, ErrorCode, Operation as _, Push};
use simlock_wire::{CallEvent, CallHandle, decode_output, decode_raw};
use tokio::sync::{mpsc, oneshot};
use tokio::task::JoinHandle;
use tracing::{debug, warn};

use crate::client::{Backend, Client, cancelled, payload, timed_out};
use crate::http::{HttpBackend, segment};

/// Progress pushes a request may hold unread before the connection waits for the caller.
const PROGRESS_QUEUE: usize = 16;
/// How long an HTTP long-poll for a request's state waits at most.
const LONG_POLL_SECS: u64 = 30;
/// Consecutive failed reads of an HTTP request's state before the request is given up.
const HTTP_READ_ATTEMPTS: u32 = 3;

/// What a pending lease request yields.
#[allow(
    clippy::large_enum_variant,
    reason = "one outcome per request; boxing buys nothing"
)]
#[derive(Debug, Clone, PartialEq)]
pub enum RequestEvent {
    /// Where the request is.
    Progress(Progress),
    /// The outcome; nothing follows it.
    Done(Result<LeaseGrant, ContractError>),
}

/// A lease request in flight. Dropping it stops following the request; the daemon goes on with
/// it (use [`Self::abort`] to withdraw it).
#[derive(Debug)]
pub struct PendingLease {
    client: Client,
    requester_id: Option<String>,
    inner: Inner,
    settled: bool,
}

#[derive(Debug)]
enum Inner {
    /// `lease.request` on a wire connection: its pushes and its reply.
    Wire(Box<CallHandle>),
    /// The HTTP lease-requests resource, followed by a task.
    HttpResource {
        http: Arc<HttpBackend>,
        updates: mpsc::Receiver<Update>,
        id: Option<String>,
        _task: AbortOnDrop,
    },
    /// `POST /v1/ops/lease.request`, run by a task.
    HttpOps {
        outcome: oneshot::Receiver<Result<LeaseGrant, ContractError>>,
        _task: AbortOnDrop,
    },
}

/// What the HTTP follower reports.
#[allow(
    clippy::large_enum_variant,
    reason = "one outcome per request; boxing buys nothing"
)]
#[derive(Debug)]
enum Update {
    /// The resource's id, once created.
    Id(String),
    /// A new state.
    Progress(Progress),
    /// The outcome.
    Done(Result<LeaseGrant, ContractError>),
}

/// How a withdrawal went.
#[allow(
    clippy::large_enum_variant,
    reason = "one outcome per request; boxing buys nothing"
)]
enum Withdrawal {
    /// `lease.cancel`'s answer.
    Answered(CancelResult),
    /// The request settled before it could be withdrawn.
    Settled(Result<LeaseGrant, ContractError>),
}

/// A task aborted when its owner is dropped.
#[derive(Debug)]
struct AbortOnDrop(JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

impl PendingLease {
    pub(crate) async fn begin(
        client: Client,
        input: LeaseRequestInput,
    ) -> Result<Self, ContractError> {
        let requester_id = input.requester_id.clone();
        let inner = match &client.backend {
            Backend::Wire(wire) => Inner::Wire(Box::new(
                wire.client()
                    .begin_call::<LeaseRequest>(&input, PROGRESS_QUEUE)
                    .await?,
            )),
            Backend::Http(http) if input.owner.is_some() => {
                let payload = payload(&input)?;
                let (tx, outcome) = oneshot::channel();
                let http = http.clone();
                let task = tokio::spawn(async move {
                    let result = http
                        .op(LeaseRequest::NAME, payload)
                        .await
                        .and_then(decode_output::<LeaseRequest>);
                    let _ = tx.send(result);
                });
                Inner::HttpOps {
                    outcome,
                    _task: AbortOnDrop(task),
                }
            }
            Backend::Http(http) => {
                let (tx, updates) = mpsc::channel(PROGRESS_QUEUE);
                let task = tokio::spawn(follow_resource(
                    http.clone(),
                    input,
                    tx,
                    client.options.call_timeout,
                ));
                Inner::HttpResource {
                    http: http.clone(),
                    updates,
                    id: None,
                    _task: AbortOnDrop(task),
                }
            }
        };
        Ok(Self {
            client,
            requester_id,
            inner,
            settled: false,
        })
    }

    /// The HTTP lease-request resource's id (`req_…`), once the daemon created it.
    pub fn request_id(&self) -> Option<&str> {
        match &self.inner {
            Inner::HttpResource { id, .. } => id.as_deref(),
            Inner::Wire(_) | Inner::HttpOps { .. } => None,
        }
    }

    /// The next progress or the outcome. After the outcome, answers `INTERNAL`.
    pub async fn next(&mut self) -> RequestEvent {
        if self.settled {
            return RequestEvent::Done(Err(ContractError::internal(
                "the lease request already settled",
            )));
        }
        let event = match &mut self.inner {
            Inner::Wire(handle) => next_wire(handle).await,
            Inner::HttpResource { updates, id, .. } => loop {
                match updates.recv().await {
                    Some(Update::Id(found)) => *id = Some(found),
                    Some(Update::Progress(progress)) => break RequestEvent::Progress(progress),
                    Some(Update::Done(outcome)) => break RequestEvent::Done(outcome),
                    None => break RequestEvent::Done(Err(ContractError::connection_lost())),
                }
            },
            Inner::HttpOps { outcome, .. } => RequestEvent::Done(
                outcome
                    .await
                    .unwrap_or_else(|_| Err(ContractError::connection_lost())),
            ),
        };
        if matches!(event, RequestEvent::Done(_)) {
            self.settled = true;
        }
        event
    }

    /// Waits for the outcome, handing each progress to `on_progress`; withdraws the request
    /// when `abort` resolves first.
    pub(crate) async fn run<F, A>(
        mut self,
        mut on_progress: F,
        abort: A,
    ) -> Result<LeaseGrant, ContractError>
    where
        F: FnMut(&Progress),
        A: Future<Output = ()>,
    {
        tokio::pin!(abort);
        loop {
            tokio::select! {
                biased;
                () = &mut abort => return self.abort().await,
                event = self.next() => match event {
                    RequestEvent::Progress(progress) => on_progress(&progress),
                    RequestEvent::Done(outcome) => return outcome,
                },
            }
        }
    }

    /// Withdraws the request (`lease.cancel`, or `DELETE` on the HTTP resource):
    /// `CANCELLED` when it was withdrawn; when it can no longer be (a device is being made
    /// ready), waits up to [`ConnectOptions::settle_timeout`](crate::ConnectOptions) for its
    /// outcome, releases any grant and answers `CANCELLED`; when there was nothing to withdraw
    /// (it settled meanwhile), answers its own outcome.
    ///
    /// # Errors
    /// `CANCELLED`; the request's own error; or the failure of the withdrawal itself.
    pub async fn abort(mut self) -> Result<LeaseGrant, ContractError> {
        if self.settled {
            return Err(cancelled());
        }
        let bound = self.client.options.settle_timeout;
        match self.withdraw(bound).await? {
            Withdrawal::Settled(outcome) => outcome,
            Withdrawal::Answered(CancelResult::Cancelled) => Err(cancelled()),
            Withdrawal::Answered(CancelResult::NotCancellable) => {
                if let Some(Ok(grant)) = self.settle(bound).await {
                    let lease = grant.lease.id.to_string();
                    match self.client.release(&lease).await {
                        Ok(_) => debug!(%lease, "released the grant of an aborted request"),
                        Err(e) => {
                            warn!(%lease, error = %e, "could not release the grant of an aborted request; it expires on its TTL")
                        }
                    }
                }
                Err(cancelled())
            }
            Withdrawal::Answered(CancelResult::NotFound) => self
                .settle(bound)
                .await
                .unwrap_or_else(|| Err(timed_out("lease.request", bound))),
        }
    }

    /// The outcome, ignoring progress, waiting at most `bound`.
    async fn settle(&mut self, bound: Duration) -> Option<Result<LeaseGrant, ContractError>> {
        tokio::time::timeout(bound, async {
            loop {
                if let RequestEvent::Done(outcome) = self.next().await {
                    return outcome;
                }
            }
        })
        .await
        .ok()
    }

    async fn withdraw(&mut self, bound: Duration) -> Result<Withdrawal, ContractError> {
        let Inner::HttpResource {
            http, updates, id, ..
        } = &mut self.inner
        else {
            let answer = self.client.cancel(self.requester_id.clone()).await?;
            return Ok(Withdrawal::Answered(answer.result));
        };
        // The resource's id comes once the POST answered; wait for it (or for the outcome).
        let id = loop {
            if let Some(id) = id.clone() {
                break id;
            }
            match tokio::time::timeout(bound, updates.recv()).await {
                Err(_) => return Err(timed_out("POST /v1/lease-requests", bound)),
                Ok(None) => return Err(ContractError::connection_lost()),
                Ok(Some(Update::Id(found))) => *id = Some(found),
                Ok(Some(Update::Progress(_))) => {}
                Ok(Some(Update::Done(outcome))) => {
                    self.settled = true;
                    return Ok(Withdrawal::Settled(outcome));
                }
            }
        };
        let http = http.clone();
        // Settled already: nothing to withdraw (`not-found`). Otherwise a refused DELETE means
        // device work started (`not-cancellable`); a request that settles between the two reads
        // is then waited for and any grant released, so no lease is left behind.
        let path = format!("/v1/lease-requests/{}", segment(&id));
        let call_bound = self.client.options.call_timeout;
        let view = tokio::time::timeout(call_bound, http.json(http::Method::GET, &path, None, &[]))
            .await
            .unwrap_or_else(|_| Err(timed_out("GET lease request", call_bound)));
        match view {
            Ok(view) => {
                let settled = view
                    .get("request")
                    .and_then(|r| serde_json::from_value::<RequestView>(r.clone()).ok())
                    .is_some_and(|r| r.state.is_settled());
                if settled {
                    return Ok(Withdrawal::Answered(CancelResult::NotFound));
                }
            }
            Err(e) if e.code == ErrorCode::UnknownLeaseRequest => {
                return Ok(Withdrawal::Answered(CancelResult::NotFound));
            }
            Err(e) => return Err(e),
        }
        let deleted = tokio::time::timeout(
            call_bound,
            http.json(http::Method::DELETE, &path, None, &[]),
        )
        .await
        .unwrap_or_else(|_| Err(timed_out("DELETE lease request", call_bound)));
        match deleted {
            Ok(_) => Ok(Withdrawal::Answered(CancelResult::Cancelled)),
            Err(e) if e.code == ErrorCode::UnknownLeaseRequest => {
                Ok(Withdrawal::Answered(CancelResult::NotFound))
            }
            Err(e) if e.code == ErrorCode::RequestNotCancellable => {
                Ok(Withdrawal::Answered(CancelResult::NotCancellable))
            }
            Err(e) => Err(e),
        }
    }
}

async fn next_wire(handle: &mut CallHandle) -> RequestEvent {
    loop {
        match handle.next().await {
            CallEvent::Push(frame) => match Push::from_frame(frame) {
                Ok(Push::Progress { progress, .. }) => return RequestEvent::Progress(progress),
                Ok(other) => debug!(push = other.kind(), "ignoring a push on lease.request"),
                Err(e) => warn!(error = %e, "ignoring a push the client cannot read"),
            },
            CallEvent::Reply(outcome) => {
                return RequestEvent::Done(
                    outcome.and_then(|raw| decode_raw::<LeaseRequest>(&raw)),
                );
            }
        }
    }
}

// === The HTTP lease-requests resource ===

/// Extra request headers, by name.
type Headers = Vec<(&'static str, String)>;

/// The resource's body for `input` ([`LeaseRequestBody`]) and its idempotency key's header.
fn resource_body(input: &LeaseRequestInput) -> Result<(Value, Headers), ContractError> {
    let body = serde_json::to_value(LeaseRequestBody::of(input))
        .map_err(|e| ContractError::internal(format!("a lease request body: {e}")))?;
    let headers = input
        .idempotency_key
        .iter()
        .map(|key| ("idempotency-key", key.clone()))
        .collect();
    Ok((body, headers))
}

/// What a request view says: its progress while it works, its outcome once settled.
fn read_view(view: &Value) -> Result<ViewState, ContractError> {
    let view: RequestView = serde_json::from_value(view.clone())
        .map_err(|e| ContractError::internal(format!("invalid lease request view: {e}")))?;
    Ok(match view.outcome() {
        Some(outcome) => ViewState::Settled(outcome),
        None => ViewState::Working(view.progress()),
    })
}

#[allow(
    clippy::large_enum_variant,
    reason = "one outcome per request; boxing buys nothing"
)]
enum ViewState {
    Working(Option<Progress>),
    Settled(Result<LeaseGrant, ContractError>),
}

/// Creates the resource and follows it until it settles, reporting on `tx`.
async fn follow_resource(
    http: Arc<HttpBackend>,
    input: LeaseRequestInput,
    tx: mpsc::Sender<Update>,
    call_bound: Duration,
) {
    let created = match resource_body(&input) {
        Ok((body, headers)) => {
            http.json(
                http::Method::POST,
                "/v1/lease-requests",
                Some(&body),
                &headers,
            )
            .await
        }
        Err(e) => Err(e),
    };
    let view = match created {
        Ok(answer) => answer.get("request").cloned().unwrap_or(Value::Null),
        Err(e) => {
            let _ = tx.send(Update::Done(Err(e))).await;
            return;
        }
    };
    let Some(id) = view.get("id").and_then(Value::as_str).map(String::from) else {
        let err = ContractError::internal("the daemon created a lease request without an id");
        let _ = tx.send(Update::Done(Err(err))).await;
        return;
    };
    if tx.send(Update::Id(id.clone())).await.is_err() {
        return;
    }
    let mut last = None;
    if report(&tx, &view, &mut last).await {
        return;
    }
    // Follow the state as it changes; fall back to long-polls if the stream breaks.
    let events = format!("/v1/lease-requests/{}/events", segment(&id));
    match tokio::time::timeout(
        call_bound,
        http.open_stream(http::Method::GET, &events, None),
    )
    .await
    {
        Ok(Ok(mut stream)) => {
            while let Some(event) = stream.next().await {
                let Ok(event) = event else { break };
                let Ok(view) = event.json() else { continue };
                if report(&tx, &view, &mut last).await {
                    return;
                }
            }
        }
        Ok(Err(e)) => debug!(error = %e, "could not follow the lease request; polling"),
        Err(_) => debug!("following the lease request timed out; polling"),
    }
    let poll = format!("/v1/lease-requests/{}?wait={LONG_POLL_SECS}", segment(&id));
    let poll_bound = call_bound + Duration::from_secs(LONG_POLL_SECS);
    let mut failures = 0;
    loop {
        let answer =
            tokio::time::timeout(poll_bound, http.json(http::Method::GET, &poll, None, &[]))
                .await
                .unwrap_or_else(|_| Err(timed_out("GET lease request", poll_bound)));
        match answer {
            Ok(answer) => {
                failures = 0;
                let view = answer.get("request").cloned().unwrap_or(Value::Null);
                if report(&tx, &view, &mut last).await {
                    return;
                }
            }
            Err(e) if e.code.is_transport() && failures + 1 < HTTP_READ_ATTEMPTS => {
                failures += 1;
                tokio::time::sleep(Duration::from_millis(500)).await;
            }
            Err(e) => {
                let _ = tx.send(Update::Done(Err(e))).await;
                return;
            }
        }
    }
}

/// Reports a view; answers whether it settled (or nobody listens any more).
async fn report(tx: &mpsc::Sender<Update>, view: &Value, last: &mut Option<Progress>) -> bool {
    match read_view(view) {
        Ok(ViewState::Working(Some(progress))) if *last != Some(progress) => {
            *last = Some(progress);
            tx.send(Update::Progress(progress)).await.is_err()
        }
        Ok(ViewState::Working(_)) => false,
        Ok(ViewState::Settled(outcome)) => {
            let _ = tx.send(Update::Done(outcome)).await;
            true
        }
        Err(e) => {
            let _ = tx.send(Update::Done(Err(e))).await;
            true
        }
    }
}
