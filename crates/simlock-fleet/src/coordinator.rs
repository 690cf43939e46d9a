//! The fleet coordinator: admits lease requests (idempotency, one lease per requester, the
//! fast-fail table), walks the queue oldest first to route each waiter to a worker, forwards it
//! there with `noWait`, and settles it with the worker's answer.

use std::collections::HashSet;
use std::sync::Arc;
use std::sync::atomic::Ordering;

use serde_json::{Value, json};
use simlock_contract::bounds::MAX_REQUESTER;
use simlock_contract::event::{Event, EventModule, RejectionReason, WaitPolicy};
use simlock_contract::ids::LeaseId;
use simlock_contract::model::{LeaseGrant, WorkerRef, WorkerView};
use simlock_contract::ops::{CancelResult, LeaseRequestInput};
use simlock_contract::push::Progress;
use simlock_contract::{ContractError, ErrorCode, Push};
use simlock_daemon::context::CallCtx;
use simlock_wire::CallEvent;
use tokio::sync::mpsc;
use tracing::{debug, warn};

use crate::fleet::{Fleet, WorkerConn};
use crate::index::{Entry, gateway_lease_id};
use crate::queue::{Booked, Queue, Stage, Waiter};
use crate::routing::{Assessment, Match, Pick, Wanted, assess, select};

/// How long a settled request's idempotency key is remembered (10 min).
const BOOK_RETENTION_MS: i64 = 600_000;

/// What admission decided.
enum Admission {
    /// A new waiter, queued.
    New(Arc<Waiter>),
    /// A repeat of a recorded request: its outcome is shared.
    Joined(Arc<Waiter>),
    /// Refused; `event` says whether to record `lease.rejected`.
    Refused { error: ContractError, event: bool },
}

impl Admission {
    fn refused(error: ContractError, event: bool) -> Self {
        Self::Refused { error, event }
    }
}

/// The message of `CAPABILITY_MISSING` through a gateway.
pub fn capability_missing(capability: &str) -> ContractError {
    ContractError::new(
        ErrorCode::CapabilityMissing,
        format!("No worker connected to this gateway can serve {capability} for this request"),
    )
    .with_details(json!({ "capability": capability }))
}

/// Whether a worker's error means its uplink is lost rather than an answer. This is the one
/// place that decides it for every caller of a worker (lease requests, forwards, the relay).
pub fn is_uplink_lost(err: &ContractError) -> bool {
    err.code.is_transport()
}

/// The error a caller sees for a worker whose uplink is lost.
pub fn unreachable(worker_id: &str) -> ContractError {
    ContractError::worker_unreachable(
        worker_id,
        format!("Worker {worker_id} is not connected to this gateway"),
    )
}

/// Translates a worker's error for the gateway's caller: a lost uplink reads as
/// `WORKER_UNREACHABLE` naming the worker; every other code passes through.
pub fn from_worker(worker_id: &str, err: ContractError) -> ContractError {
    if is_uplink_lost(&err) {
        unreachable(worker_id)
    } else {
        err
    }
}

fn assessment_error(assessment: &Assessment, wanted: &Wanted) -> Option<ContractError> {
    let platform = wanted.platform.as_str();
    match assessment {
        Assessment::Serviceable => None,
        Assessment::NoWorker => Some(ContractError::new(
            ErrorCode::NoCapacity,
            "No worker connected to this gateway can take this request now",
        )),
        Assessment::NoDriver => Some(
            ContractError::new(
                ErrorCode::NoDriver,
                format!("No worker connected to this gateway serves {platform}"),
            )
            .with_details(json!({ "platform": platform })),
        ),
        Assessment::UnknownModel => {
            let model = wanted.model.clone().unwrap_or_default();
            Some(
                ContractError::new(
                    ErrorCode::UnknownModel,
                    format!(
                        "No worker connected to this gateway knows the {platform} model {model}"
                    ),
                )
                .with_details(json!({ "platform": platform, "model": model })),
            )
        }
        Assessment::RuntimeMissing => {
            let os = wanted
                .os_version
                .clone()
                .unwrap_or_else(|| "default".into());
            Some(
                ContractError::new(
                    ErrorCode::RuntimeMissing,
                    format!(
                        "No worker connected to this gateway runs that {platform} model on {os}"
                    ),
                )
                .with_details(
                    json!({ "platform": platform, "osVersion": os, "downloadable": false }),
                ),
            )
        }
        Assessment::CapabilityMissing(capability) => Some(capability_missing(capability)),
    }
}

fn rejection_reason(err: &ContractError) -> RejectionReason {
    match err.code {
        ErrorCode::NoCapacity => RejectionReason::NoWorker,
        ErrorCode::QueueTimeout => RejectionReason::Timeout,
        ErrorCode::RequesterAlreadyLeased => RejectionReason::AlreadyLeased,
        ErrorCode::LeaseIdTaken => RejectionReason::LeaseIdTaken,
        ErrorCode::Cancelled => RejectionReason::Cancelled,
        ErrorCode::WorkerUnreachable => RejectionReason::WorkerFailed,
        ErrorCode::DaemonStopping => RejectionReason::Killed,
        _ => RejectionReason::UnresolvableSpec,
    }
}

/// The view key a refusal is remembered against: a worker that refused with `NO_CAPACITY` is
/// not tried again for that request until its view changes.
fn view_key(view: &WorkerView) -> String {
    let leases: Vec<&str> = view
        .leases
        .as_deref()
        .unwrap_or_default()
        .iter()
        .map(|l| l.id.as_str())
        .collect();
    json!({
        "capacity": view.capacity,
        "devices": view.devices,
        "health": view.health,
        "leases": leases,
        "queueDepth": view.queue_depth,
    })
    .to_string()
}

impl Fleet {
    /// `lease.request` through the gateway.
    ///
    /// # Errors
    /// Every refusal of the table, the worker's answer, or `QUEUE_TIMEOUT`.
    pub async fn request_lease(
        self: &Arc<Self>,
        ctx: &CallCtx,
        mut input: LeaseRequestInput,
    ) -> Result<LeaseGrant, ContractError> {
        if input.owner.is_some() {
            return Err(ContractError::forbidden(
                "owner may only be set by a gateway on its worker's uplink",
            ));
        }
        let ttl = input.ttl_ms.unwrap_or(self.limits.default_ttl_ms);
        if ttl > self.limits.max_ttl_ms {
            return Err(ContractError::bad_request(format!(
                "ttlMs: {ttl} is above lease.maxTtlMs ({})",
                self.limits.max_ttl_ms
            )));
        }
        input.ttl_ms = Some(ttl);
        let requester = input
            .requester_id
            .clone()
            .unwrap_or_else(|| ctx.principal.clone());
        let room = MAX_REQUESTER.saturating_sub(self.prefix.len());
        if requester.chars().count() > room {
            return Err(ContractError::bad_request(format!(
                "requesterId: at most {room} characters through a gateway"
            )));
        }
        let wanted = Wanted::of(&input);
        let now = self.clock.now_ms();
        let (progress_tx, mut progress_rx) = mpsc::channel::<Progress>(16);
        let waiter = match self.admit(ctx, &input, &requester, wanted, now, progress_tx) {
            Admission::New(waiter) => waiter,
            Admission::Joined(waiter) => return waiter.outcome().await,
            Admission::Refused { error, event } => {
                if event {
                    self.reject_event(None, &requester, &input, &error);
                }
                return Err(error);
            }
        };
        self.bus.emit(
            EventModule::Fleet,
            &Event::LeaseRequested {
                request_id: waiter.id.clone(),
                request_spec: waiter.wanted.requested(),
                requester: requester.clone(),
                wait_policy: WaitPolicy::of(waiter.no_wait),
            },
        );
        // The queue changed: wake the dispatcher and followers.
        self.views_changed();
        if let Some(deadline) = waiter.deadline {
            self.wake_at(deadline);
        }
        // Relay progress to the caller until the outcome.
        let outcome = waiter.outcome();
        tokio::pin!(outcome);
        loop {
            tokio::select! {
                biased;
                Some(progress) = progress_rx.recv() => {
                    let _ = ctx.push(Push::Progress { request_id: ctx.request_id().clone(), progress }).await;
                }
                result = &mut outcome => return result,
            }
        }
    }

    /// The decision section: idempotency, one lease per requester, the chosen id, the fast-fail
    /// table, and recording the waiter, all under one lock.
    fn admit(
        &self,
        ctx: &CallCtx,
        input: &LeaseRequestInput,
        requester: &str,
        wanted: Wanted,
        now: i64,
        progress: mpsc::Sender<Progress>,
    ) -> Admission {
        let mut state = self.state.lock();
        state.queue.prune_book(now, BOOK_RETENTION_MS);
        if let Some(key) = &input.idempotency_key
            && let Some(booked) = state.queue.book.get(&(requester.to_owned(), key.clone()))
        {
            if booked.principal != ctx.principal {
                return Admission::refused(
                    ContractError::forbidden("That idempotency key belongs to another principal"),
                    false,
                );
            }
            if booked.fingerprint != Waiter::fingerprint(input) {
                let err = ContractError::new(
                    ErrorCode::IdempotencyConflict,
                    "The idempotency key was used for a different request",
                );
                return Admission::refused(err, false);
            }
            return Admission::Joined(booked.waiter.clone());
        }
        if let Some(existing) = state.index.by_requester(requester) {
            let err = ContractError::new(
                ErrorCode::RequesterAlreadyLeased,
                format!(
                    "Requester {requester} already holds lease {}",
                    existing.lease_id
                ),
            )
            .with_details(
                json!({ "requesterId": requester, "existingLeaseId": existing.lease_id }),
            );
            return Admission::refused(err, true);
        }
        if state.queue.pending_of(requester).is_some() {
            let err = ContractError::new(
                ErrorCode::RequesterAlreadyLeased,
                format!("Requester {requester} already has a pending request"),
            )
            .with_details(json!({ "requesterId": requester }));
            return Admission::refused(err, true);
        }
        if let Some(id) = &input.lease_id
            && state.index.get(id).is_some()
        {
            let err = ContractError::new(
                ErrorCode::LeaseIdTaken,
                format!("Lease id {id} is held by another lease"),
            )
            .with_details(json!({ "leaseId": id }));
            return Admission::refused(err, true);
        }
        let views: Vec<&WorkerView> = state.workers.values().map(|w| &w.view).collect();
        if let Some(err) = assessment_error(&assess(&views, &wanted), &wanted) {
            return Admission::refused(err, true);
        }
        let waiter = Waiter::new(
            input.clone(),
            wanted,
            requester.to_owned(),
            ctx.principal.clone(),
            now,
            Some(progress),
        );
        if let Some(key) = &input.idempotency_key {
            state.queue.book.insert(
                (requester.to_owned(), key.clone()),
                Booked {
                    principal: ctx.principal.clone(),
                    fingerprint: Waiter::fingerprint(input),
                    waiter: waiter.clone(),
                    settled_at: None,
                },
            );
        }
        state.queue.waiters.push(waiter.clone());
        Admission::New(waiter)
    }

    fn reject_event(
        &self,
        waiter: Option<&Waiter>,
        requester: &str,
        input: &LeaseRequestInput,
        err: &ContractError,
    ) {
        let worker_id = (err.code == ErrorCode::WorkerUnreachable)
            .then(|| {
                err.details
                    .as_ref()?
                    .get("workerId")?
                    .as_str()
                    .map(str::to_owned)
            })
            .flatten();
        self.bus.emit(
            EventModule::Fleet,
            &Event::LeaseRejected {
                request_id: waiter.map(|w| w.id.clone()),
                requester: requester.to_owned(),
                request_spec: Wanted::of(input).requested(),
                reason: rejection_reason(err),
                worker_id,
            },
        );
    }

    fn settle_waiter(&self, waiter: &Arc<Waiter>, outcome: Result<LeaseGrant, ContractError>) {
        if let Err(err) = &outcome {
            self.reject_event(Some(waiter), &waiter.requester, &waiter.input, err);
        }
        if waiter.settle(outcome) {
            let depth = {
                let mut state = self.state.lock();
                state.queue.prune();
                state.queue.depth()
            };
            self.bus
                .emit(EventModule::Fleet, &Event::QueueChanged { depth });
        }
        self.views_changed();
    }

    /// `lease.cancel` through the gateway.
    pub fn cancel_request(&self, requester: &str) -> CancelResult {
        let waiter = {
            let state = self.state.lock();
            state.queue.pending_of(requester).cloned()
        };
        let Some(waiter) = waiter else {
            return CancelResult::NotFound;
        };
        if !waiter.is_queued() {
            return CancelResult::NotCancellable;
        }
        self.settle_waiter(
            &waiter,
            Err(ContractError::new(
                ErrorCode::Cancelled,
                "The lease request was cancelled",
            )),
        );
        CancelResult::Cancelled
    }

    /// The owner of `requester`'s pending request, if it has one.
    pub fn pending_owner(&self, requester: &str) -> Option<String> {
        self.state
            .lock()
            .queue
            .pending_of(requester)
            .map(|w| w.owner.clone())
    }

    /// The waiting requests, oldest first.
    pub fn waiting(&self) -> Vec<simlock_contract::model::WaitingRequest> {
        let state = self.state.lock();
        state
            .queue
            .waiters
            .iter()
            .filter(|w| !w.is_settled())
            .map(|w| simlock_contract::model::WaitingRequest {
                id: w.id.clone(),
                requester_id: w.requester.clone(),
                spec: w.wanted.requested(),
                created_at: w.created_at,
                stage: if w.is_queued() {
                    simlock_contract::model::WaitStage::Queued
                } else {
                    simlock_contract::model::WaitStage::Starting
                },
                queue_position: w.is_queued().then(|| state.queue.position(w)),
                worker_id: match &*w.stage.lock() {
                    Stage::Processing(worker) => Some(worker.clone()),
                    Stage::Queued | Stage::Settled => None,
                },
            })
            .collect()
    }

    /// The number of requests waiting in the fleet queue.
    pub fn queue_depth(&self) -> u32 {
        self.state.lock().queue.depth()
    }

    fn wake_at(self: &Arc<Self>, deadline: i64) {
        let weak = Arc::downgrade(self);
        let at = simlock_daemon::clock::instant_at(&*self.clock, deadline);
        let stopping = self.stopping.clone();
        tokio::spawn(async move {
            tokio::select! {
                () = stopping.cancelled() => {}
                () = tokio::time::sleep_until(at) => {
                    if let Some(fleet) = weak.upgrade() {
                        fleet.kick.notify_one();
                    }
                }
            }
        });
    }

    /// One pass over the queue, oldest first.
    fn dispatch_pass(self: &Arc<Self>) {
        let now = self.clock.now_ms();
        let mut starts: Vec<(Arc<Waiter>, Pick, Arc<WorkerConn>)> = Vec::new();
        let mut failures: Vec<(Arc<Waiter>, ContractError)> = Vec::new();
        let mut announce: Vec<(Arc<Waiter>, u32)> = Vec::new();
        {
            let mut state = self.state.lock();
            let crate::fleet::State { workers, queue, .. } = &mut *state;
            let mut claimed: HashSet<String> = HashSet::new();
            let views: Vec<&WorkerView> = workers.values().map(|w| &w.view).collect();
            let waiters: Vec<Arc<Waiter>> = queue
                .waiters
                .iter()
                .filter(|w| w.is_queued())
                .cloned()
                .collect();
            for waiter in waiters {
                if waiter.deadline.is_some_and(|d| d <= now) {
                    let err = ContractError::new(
                        ErrorCode::QueueTimeout,
                        format!("Request {} waited past its timeout", waiter.id),
                    )
                    .with_details(json!({ "requestId": waiter.id }));
                    failures.push((waiter, err));
                    continue;
                }
                // A drain or a lost uplink can leave a waiting spec that no known worker serves.
                if let Some(err) = assessment_error(&assess(&views, &waiter.wanted), &waiter.wanted)
                    && err.code != ErrorCode::NoCapacity
                {
                    failures.push((waiter, err));
                    continue;
                }
                let excluded = waiter.excluded.lock().clone();
                let refusals = waiter.refusals.lock().clone();
                let eligible: Vec<&WorkerView> = views
                    .iter()
                    .copied()
                    .filter(|v| !claimed.contains(&v.id) && !excluded.contains(&v.id))
                    .filter(|v| refusals.get(&v.id).is_none_or(|key| *key != view_key(v)))
                    .collect();
                if eligible.is_empty()
                    && !excluded.is_empty()
                    && views.iter().all(|v| excluded.contains(&v.id))
                {
                    let err = waiter.last_refusal.lock().clone().unwrap_or_else(|| {
                        ContractError::new(
                            ErrorCode::NoCapacity,
                            "No worker can serve this request",
                        )
                    });
                    failures.push((waiter, err));
                    continue;
                }
                let pick = select(&eligible, &waiter.wanted);
                let conn = pick
                    .as_ref()
                    .and_then(|p| workers.get(&p.worker_id))
                    .and_then(|w| w.conn.clone());
                match (pick, conn) {
                    (Some(pick), Some(conn)) => {
                        claimed.insert(pick.worker_id.clone());
                        *waiter.stage.lock() = Stage::Processing(pick.worker_id.clone());
                        starts.push((waiter, pick, conn));
                    }
                    _ => {
                        let walked_before = Queue::mark_walked(&waiter);
                        if waiter.no_wait
                            && (walked_before || !waiter.second_walk.load(Ordering::SeqCst))
                        {
                            let err = ContractError::new(
                                ErrorCode::NoCapacity,
                                "No worker connected to this gateway has a device free now",
                            );
                            failures.push((waiter, err));
                        } else if !waiter.no_wait && !waiter.announced.swap(true, Ordering::SeqCst)
                        {
                            announce.push((waiter.clone(), queue.position(&waiter)));
                        }
                    }
                }
            }
        }
        for (waiter, err) in failures {
            self.settle_waiter(&waiter, Err(err));
        }
        for (waiter, position) in announce {
            waiter.report(Progress::Queued {
                queue_position: position,
            });
            self.bus.emit(
                EventModule::Fleet,
                &Event::LeaseQueued {
                    request_id: waiter.id.clone(),
                    queue_position: position,
                },
            );
            let depth = self.queue_depth();
            self.bus
                .emit(EventModule::Fleet, &Event::QueueChanged { depth });
        }
        for (waiter, pick, conn) in starts {
            let fleet = self.clone();
            tokio::spawn(async move { fleet.attempt(waiter, pick, conn).await });
        }
    }

    /// Forwards one waiter to the picked worker and settles or re-queues it.
    async fn attempt(self: Arc<Self>, waiter: Arc<Waiter>, pick: Pick, conn: Arc<WorkerConn>) {
        let worker_id = pick.worker_id.clone();
        let payload = forward_payload(&self.prefix, &waiter, &pick.matched);
        let started = self.clock.now_ms();
        let outcome = tokio::time::timeout(self.timing.lease_request_timeout, async {
            let mut call = conn.client.begin("lease.request", payload, 16).await?;
            let mut dispatched = false;
            loop {
                match call.next().await {
                    CallEvent::Push(frame) => {
                        if let Ok(Push::Progress { progress, .. }) = Push::from_frame(&frame) {
                            if !dispatched {
                                dispatched = true;
                                self.dispatched_event(&waiter, &pick, started);
                            }
                            waiter.report(progress);
                        }
                    }
                    CallEvent::Reply(reply) => return reply.map(|v| (v, dispatched)),
                }
            }
        })
        .await;
        let outcome = match outcome {
            Ok(outcome) => outcome,
            Err(_) => Err(ContractError::worker_unreachable(
                &worker_id,
                format!(
                    "Worker {worker_id} did not answer the lease request within {} ms",
                    self.timing.lease_request_timeout.as_millis()
                ),
            )),
        };
        match outcome {
            Ok((value, dispatched)) => match serde_json::from_value::<LeaseGrant>(value) {
                Ok(grant) => {
                    if !dispatched {
                        self.dispatched_event(&waiter, &pick, started);
                    }
                    let grant = self.record_grant(&waiter, &worker_id, grant);
                    self.settle_waiter(&waiter, Ok(grant));
                }
                Err(e) => {
                    let err = ContractError::internal(format!(
                        "Worker {worker_id} answered an invalid grant: {e}"
                    ));
                    self.settle_waiter(&waiter, Err(err));
                }
            },
            Err(err) if err.code == ErrorCode::NoCapacity => {
                // The view was stale: remember the refusal against it and read it again.
                let key = self
                    .view(&worker_id)
                    .map(|v| view_key(&v))
                    .unwrap_or_default();
                waiter.refusals.lock().insert(worker_id.clone(), key);
                conn.request_refresh(false);
                if waiter.no_wait && waiter.second_walk.swap(true, Ordering::SeqCst) {
                    self.settle_waiter(&waiter, Err(err));
                } else {
                    waiter.walked.store(false, Ordering::SeqCst);
                    *waiter.stage.lock() = Stage::Queued;
                    self.kick.notify_one();
                }
            }
            Err(err)
                if matches!(
                    err.code,
                    ErrorCode::UnknownModel
                        | ErrorCode::RuntimeMissing
                        | ErrorCode::NoDriver
                        | ErrorCode::CapabilityMissing
                ) =>
            {
                // That worker can never serve this spec: try the others.
                debug!(worker = %worker_id, code = %err.code, "a worker refused the spec; trying others");
                waiter.excluded.lock().insert(worker_id.clone());
                *waiter.last_refusal.lock() = Some(if err.code == ErrorCode::CapabilityMissing {
                    capability_missing(
                        err.details
                            .as_ref()
                            .and_then(|d| d.get("capability"))
                            .and_then(Value::as_str)
                            .unwrap_or_default(),
                    )
                } else {
                    err
                });
                conn.request_refresh(true);
                waiter.walked.store(false, Ordering::SeqCst);
                *waiter.stage.lock() = Stage::Queued;
                self.kick.notify_one();
            }
            Err(err) => {
                if is_uplink_lost(&err) {
                    warn!(worker = %worker_id, "the uplink was lost while a lease request was forwarded");
                }
                self.settle_waiter(&waiter, Err(from_worker(&worker_id, err)));
            }
        }
    }

    fn dispatched_event(&self, waiter: &Waiter, pick: &Pick, started: i64) {
        self.bus.emit(
            EventModule::Fleet,
            &Event::RequestDispatched {
                request_id: waiter.id.clone(),
                worker_id: pick.worker_id.clone(),
                requester_id: waiter.requester.clone(),
                platform: waiter.wanted.platform,
                model: pick.matched.model.clone(),
                reason: pick.reason,
                stage: pick.stage,
                queued_ms: started.saturating_sub(waiter.created_at),
            },
        );
    }

    /// Indexes a worker's grant and projects it for the caller.
    fn record_grant(&self, waiter: &Waiter, worker_id: &str, mut grant: LeaseGrant) -> LeaseGrant {
        let chosen = waiter.input.lease_id.is_some();
        let lease_id = gateway_lease_id(worker_id, grant.lease.id.as_str(), chosen);
        let label = self.label_of(worker_id);
        let entry = Entry {
            lease_id: lease_id.clone(),
            worker_id: worker_id.to_owned(),
            worker_lease_id: grant.lease.id.to_string(),
            requester_id: waiter.requester.clone(),
            owner_id: waiter.owner.clone(),
            granted_at: grant.lease.granted_at,
            chosen,
            misses: 0,
        };
        let ended = self.state.lock().index.record_grant(entry);
        self.bus.emit(
            EventModule::Fleet,
            &Event::RequestGranted {
                request_id: waiter.id.clone(),
                worker_id: worker_id.to_owned(),
                lease_id: lease_id.clone(),
                worker_lease_id: grant.lease.id.to_string(),
            },
        );
        // The environment names the lease as callers of the gateway know it.
        if let Some(id) = grant.environment.get_mut("SIMLOCK_LEASE_ID") {
            id.clone_from(&lease_id);
        }
        grant.lease.id = LeaseId::from_raw(lease_id.clone());
        grant.lease.requester_id = waiter.requester.clone();
        grant.lease.owner_id = waiter.owner.clone();
        grant.lease.worker = Some(WorkerRef {
            id: worker_id.to_owned(),
            label,
        });
        if let Some(end) = ended {
            // Its end event overtook this answer: the caller still gets the grant it asked for,
            // and its owner the end (which may reach it just ahead of the grant's answer); the
            // index never holds the dead lease.
            self.notify_lease_lost(&lease_id, &waiter.owner, &end.device_id, &end.reason, None);
        }
        grant
    }
}

/// The `lease.request` a worker gets: its own model name, the namespaced requester, the owner,
/// and `noWait` (the gateway never routes into a worker's queue).
fn forward_payload(prefix: &str, waiter: &Waiter, matched: &Match) -> Value {
    let mut payload = json!({
        "platform": waiter.wanted.platform,
        "requesterId": format!("{prefix}{}", waiter.requester),
        "owner": waiter.owner,
        "noWait": true,
        "ttlMs": waiter.input.ttl_ms,
    });
    if let Some(model) = matched
        .model
        .clone()
        .or_else(|| waiter.wanted.model.clone())
    {
        payload["model"] = Value::String(model);
    }
    if let Some(os) = &waiter.wanted.os_version {
        payload["osVersion"] = Value::String(os.clone());
    }
    if let Some(id) = &waiter.input.lease_id {
        payload["leaseId"] = Value::String(id.clone());
    }
    if !waiter.wanted.requires.is_empty() {
        payload["requires"] = json!(waiter.wanted.requires);
    }
    payload
}

/// Starts the task that runs a dispatch pass whenever something changed.
pub(crate) fn spawn_dispatcher(fleet: &Arc<Fleet>) {
    let weak = Arc::downgrade(fleet);
    let stopping = fleet.stopping.clone();
    let kick = fleet.kick.clone();
    tokio::spawn(async move {
        loop {
            tokio::select! {
                () = stopping.cancelled() => return,
                () = kick.notified() => {}
            }
            let Some(fleet) = weak.upgrade() else { return };
            fleet.dispatch_pass();
        }
    });
}
