//! The fleet queue: lease requests the gateway holds, oldest first, each with a deadline fixed
//! when it arrives, and the book of idempotency keys with their outcomes. Plain data: a waiter
//! is a record the fleet's decisions read and change under one lock, nothing in it is shared.

use std::collections::{BTreeMap, BTreeSet, HashMap};

use simlock_contract::ids::RequestId;
use simlock_contract::model::LeaseGrant;
use simlock_contract::ops::LeaseRequestInput;

use super::routing::{Pick, Wanted};
use crate::error::FleetError;

/// One forward of a waiter to a worker.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Attempt {
    /// Which forward this is (unique per gateway).
    pub id: u64,
    /// The worker.
    pub worker_id: String,
    /// The uplink it went out on.
    pub generation: u64,
    /// The routing decision.
    pub pick: Pick,
    /// When it was sent.
    pub started: i64,
    /// When it fails if the worker has not answered (`gateway.leaseRequestTimeoutMs`).
    pub deadline: i64,
    /// Whether `request.dispatched` was recorded (at the worker's first progress, or its answer).
    pub dispatched: bool,
}

/// Where a waiter is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Stage {
    /// In the queue.
    Queued,
    /// Forwarded to a worker, waiting for its answer.
    Forwarded(Attempt),
}

/// A lease request the gateway holds until it is answered.
#[derive(Debug, Clone)]
pub struct Waiter {
    /// The request.
    pub id: RequestId,
    /// Its requester (the caller's, without the gateway's prefix).
    pub requester: String,
    /// Who will own the lease.
    pub owner: String,
    /// The request as asked (TTL filled in).
    pub input: LeaseRequestInput,
    /// What it asks of a worker.
    pub wanted: Wanted,
    /// When it arrived.
    pub created_at: i64,
    /// When it fails while queued, if it has a timeout.
    pub deadline: Option<i64>,
    /// `noWait`.
    pub no_wait: bool,
    /// Where it is.
    pub stage: Stage,
    /// Workers that refused with `NO_CAPACITY`, with the view key they had then.
    pub refusals: HashMap<String, String>,
    /// Workers that can never serve this request (they refused its spec).
    pub excluded: BTreeSet<String>,
    /// The last refusal of the spec, answered when no worker is left.
    pub last_refusal: Option<FleetError>,
    /// A `noWait` request gets one more walk after a stale view refused it.
    pub second_walk: bool,
    /// Whether `queued` was announced.
    pub announced: bool,
    /// Whether a dispatch pass walked it once without a pick.
    pub walked: bool,
}

impl Waiter {
    /// A new waiter for `input`, arrived at `created_at`.
    pub fn new(
        id: RequestId,
        input: LeaseRequestInput,
        requester: String,
        owner: String,
        created_at: i64,
    ) -> Self {
        let deadline = input
            .timeout_ms
            .map(|t| created_at.saturating_add(i64::try_from(t).unwrap_or(i64::MAX)));
        Self {
            id,
            requester,
            owner,
            wanted: Wanted::of(&input),
            no_wait: input.no_wait.unwrap_or(false),
            input,
            created_at,
            deadline,
            stage: Stage::Queued,
            refusals: HashMap::new(),
            excluded: BTreeSet::new(),
            last_refusal: None,
            second_walk: false,
            announced: false,
            walked: false,
        }
    }

    /// Whether it waits in the queue (not forwarded).
    pub fn is_queued(&self) -> bool {
        self.stage == Stage::Queued
    }

    /// The forward under way, if any.
    pub const fn attempt(&self) -> Option<&Attempt> {
        match &self.stage {
            Stage::Forwarded(attempt) => Some(attempt),
            Stage::Queued => None,
        }
    }

    /// The next moment something happens to it by itself: its queue deadline while queued, its
    /// forward's deadline while forwarded.
    pub fn next_deadline(&self) -> Option<i64> {
        match &self.stage {
            Stage::Queued => self.deadline,
            Stage::Forwarded(attempt) => Some(attempt.deadline),
        }
    }

    /// The fingerprint idempotency compares: the request as asked.
    pub fn fingerprint(input: &LeaseRequestInput) -> String {
        let mut normal = input.clone();
        normal.idempotency_key = None;
        normal.timeout_ms = None;
        normal.no_wait = None;
        serde_json::to_string(&normal).unwrap_or_default()
    }
}

/// A recorded idempotency key.
#[derive(Debug, Clone)]
pub struct Booked {
    /// Who recorded it.
    pub principal: String,
    /// The request it was for.
    pub fingerprint: String,
    /// The request.
    pub request: RequestId,
    /// Its outcome, once answered.
    pub outcome: Option<Result<LeaseGrant, FleetError>>,
    /// When it was answered.
    pub settled_at: Option<i64>,
}

/// The queue and the book.
#[derive(Debug, Default, Clone)]
pub struct Queue {
    /// The waiters, oldest first.
    pub waiters: Vec<Waiter>,
    /// Idempotency keys by (requester, key).
    pub book: BTreeMap<(String, String), Booked>,
}

impl Queue {
    /// The waiter of `requester`, if it has one.
    pub fn pending_of(&self, requester: &str) -> Option<&Waiter> {
        self.waiters.iter().find(|w| w.requester == requester)
    }

    /// The waiter `id`.
    pub fn get(&self, id: &RequestId) -> Option<&Waiter> {
        self.waiters.iter().find(|w| &w.id == id)
    }

    /// The waiter `id`, to change.
    pub fn get_mut(&mut self, id: &RequestId) -> Option<&mut Waiter> {
        self.waiters.iter_mut().find(|w| &w.id == id)
    }

    /// The waiter whose forward is `attempt`.
    pub fn by_attempt(&mut self, attempt: u64) -> Option<&mut Waiter> {
        self.waiters
            .iter_mut()
            .find(|w| w.attempt().is_some_and(|a| a.id == attempt))
    }

    /// Takes `id` out of the queue.
    pub fn remove(&mut self, id: &RequestId) -> Option<Waiter> {
        let at = self.waiters.iter().position(|w| &w.id == id)?;
        Some(self.waiters.remove(at))
    }

    /// Records the outcome of `id` in the book, if a key names it.
    pub fn settle_book(
        &mut self,
        id: &RequestId,
        outcome: &Result<LeaseGrant, FleetError>,
        now: i64,
    ) {
        for booked in self.book.values_mut().filter(|b| &b.request == id) {
            booked.outcome = Some(outcome.clone());
            booked.settled_at = Some(now);
        }
    }

    /// Drops book records answered longer ago than `retention_ms`.
    pub fn prune_book(&mut self, now: i64, retention_ms: i64) {
        self.book.retain(|_, b| {
            b.settled_at
                .is_none_or(|at| now.saturating_sub(at) < retention_ms)
        });
    }

    /// When the oldest answered book record passes `retention_ms`.
    pub fn next_book_expiry(&self, retention_ms: i64) -> Option<i64> {
        self.book
            .values()
            .filter_map(|b| b.settled_at)
            .min()
            .map(|at| at.saturating_add(retention_ms))
    }

    /// The 1-based place of `id` among the waiters not answered yet.
    pub fn position(&self, id: &RequestId) -> u32 {
        let ahead = self.waiters.iter().take_while(|w| &w.id != id).count();
        u32::try_from(ahead + 1).unwrap_or(u32::MAX)
    }

    /// How many are queued (not forwarded).
    pub fn depth(&self) -> u32 {
        u32::try_from(self.waiters.iter().filter(|w| w.is_queued()).count()).unwrap_or(u32::MAX)
    }
}
