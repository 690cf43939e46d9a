//! The fleet queue: lease requests the gateway holds, oldest first, each with a deadline fixed
//! when it arrives, and the book of idempotency keys with their outcomes. Plain data: a waiter
//! is a record the fleet's decisions read and change under one lock, nothing in it is shared.

use std::collections::{BTreeSet, HashMap, VecDeque};

use simlock_contract::ids::RequestId;
use simlock_contract::model::LeaseGrant;
use simlock_contract::ops::LeaseRequestInput;
use simlock_contract::push::{Progress, WaitingFor};

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
    /// Where it is (it moves through [`Queue::set_stage`], which keeps the queue's count).
    stage: Stage,
    /// Workers that refused with `NO_CAPACITY`, with the view revision they had then.
    pub refusals: HashMap<String, u64>,
    /// Workers that can never serve this request (they refused its spec).
    pub excluded: BTreeSet<String>,
    /// The last refusal of the spec, answered when no worker is left.
    pub last_refusal: Option<FleetError>,
    /// A `noWait` request gets one more walk after a stale view refused it.
    pub second_walk: bool,
    /// The place it was last told (`queued` is announced once, then each move): none before
    /// it was announced.
    told_position: Option<u32>,
    /// Whether a dispatch pass walked it once without a pick.
    pub walked: bool,
    /// Why it waits, as it was last told.
    pub told_waiting: Option<WaitingFor>,
    /// Whether it got past admission: queued, or forwarded, once. Only a request that has not
    /// is held to `lease.maxWaiting` (one that comes back from a worker keeps its place).
    pub entered: bool,
    /// The last progress its callers were told: what an idempotent repeat that joins it hears
    /// at once.
    pub told: Option<Progress>,
}

impl Waiter {
    /// The place it was last told, else the first (a waiter forwarded before it was ever
    /// announced is at the head of the queue, handed to a worker).
    pub fn told_position_or_first(&self) -> u32 {
        self.told_position.unwrap_or(1)
    }

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
            told_position: None,
            told_waiting: None,
            walked: false,
            entered: false,
            told: None,
        }
    }

    /// Whether it waits in the queue (not forwarded).
    pub fn is_queued(&self) -> bool {
        self.stage == Stage::Queued
    }

    /// Where it is.
    pub const fn stage(&self) -> &Stage {
        &self.stage
    }

    /// The forward under way, if any.
    pub const fn attempt(&self) -> Option<&Attempt> {
        match &self.stage {
            Stage::Forwarded(attempt) => Some(attempt),
            Stage::Queued => None,
        }
    }

    /// The forward under way, to change (its `dispatched` mark).
    pub const fn attempt_mut(&mut self) -> Option<&mut Attempt> {
        match &mut self.stage {
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

/// How many answered idempotency keys the book holds at most: past it, the oldest answered ones
/// go first. A key still waiting is never dropped, so the book holds up to this many answered
/// keys beside one key per keyed request waiting in the queue (which has no cap of its own).
pub const BOOK_CAP: usize = 10_000;

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

/// A book key: (requester, idempotency key).
type BookKey = (String, String);

/// The book of idempotency keys: the records, the waiting ones by request (so an answer finds
/// its key at once), and the answered ones in the order they were answered, so that pruning
/// costs what it drops and never a scan of every record.
#[derive(Debug, Clone)]
pub struct Book {
    records: HashMap<BookKey, Booked>,
    /// The key of each request still waiting.
    waiting: HashMap<RequestId, BookKey>,
    /// `(settled_at, key)` of every answered record, oldest first.
    settled: VecDeque<(i64, BookKey)>,
    cap: usize,
}

impl Default for Book {
    fn default() -> Self {
        Self::with_cap(BOOK_CAP)
    }
}

impl Book {
    /// An empty book holding at most `cap` records (at least one).
    pub fn with_cap(cap: usize) -> Self {
        Self {
            records: HashMap::new(),
            waiting: HashMap::new(),
            settled: VecDeque::new(),
            cap: cap.max(1),
        }
    }

    /// The record of `key` of `requester`.
    pub fn get(&self, requester: &str, key: &str) -> Option<&Booked> {
        self.records.get(&(requester.to_owned(), key.to_owned()))
    }

    /// How many records it holds.
    pub fn len(&self) -> usize {
        self.records.len()
    }

    /// Whether it holds none.
    pub fn is_empty(&self) -> bool {
        self.records.is_empty()
    }

    /// Records `key` of `requester` for a request that waits; when the book is full, the oldest
    /// answered record makes room.
    pub fn insert(&mut self, requester: String, key: String, booked: Booked) {
        while self.records.len() >= self.cap {
            let Some((_, oldest)) = self.settled.pop_front() else {
                break;
            };
            self.records.remove(&oldest);
        }
        let key = (requester, key);
        self.waiting.insert(booked.request.clone(), key.clone());
        self.records.insert(key, booked);
    }

    /// Forgets the key of `id`, if one names it: a refusal that is not the request's outcome
    /// (the queue was full), which a repeat with the same key must not replay.
    pub fn forget(&mut self, id: &RequestId) {
        if let Some(key) = self.waiting.remove(id) {
            self.records.remove(&key);
        }
    }

    /// Records the outcome of `id`, if a key names it.
    pub fn settle(&mut self, id: &RequestId, outcome: &Result<LeaseGrant, FleetError>, now: i64) {
        let Some(key) = self.waiting.remove(id) else {
            return;
        };
        if let Some(booked) = self.records.get_mut(&key) {
            booked.outcome = Some(outcome.clone());
            booked.settled_at = Some(now);
            self.settled.push_back((now, key));
        }
    }

    /// Drops the records answered `retention_ms` or more before `now`.
    pub fn prune(&mut self, now: i64, retention_ms: i64) {
        while let Some((at, _)) = self.settled.front()
            && now.saturating_sub(*at) >= retention_ms
        {
            if let Some((_, key)) = self.settled.pop_front() {
                self.records.remove(&key);
            }
        }
    }

    /// When the oldest answered record passes `retention_ms`.
    pub fn next_expiry(&self, retention_ms: i64) -> Option<i64> {
        self.settled
            .front()
            .map(|(at, _)| at.saturating_add(retention_ms))
    }
}

/// The queue and the book.
#[derive(Debug, Default, Clone)]
pub struct Queue {
    /// The waiters, oldest first.
    waiters: Vec<Waiter>,
    /// How many of them are queued (not forwarded).
    queued: u32,
    /// Whether a waiter left since [`Self::moved`] last looked (only a removal moves others).
    reordered: bool,
    /// Idempotency keys by (requester, key).
    pub book: Book,
}

impl Queue {
    /// The waiters, oldest first.
    pub fn waiters(&self) -> &[Waiter] {
        &self.waiters
    }

    /// A new waiter joins the end of the queue.
    pub fn push(&mut self, waiter: Waiter) {
        if waiter.is_queued() {
            self.queued += 1;
        }
        self.waiters.push(waiter);
    }

    /// The waiter of `requester`, if it has one.
    pub fn pending_of(&self, requester: &str) -> Option<&Waiter> {
        self.waiters.iter().find(|w| w.requester == requester)
    }

    /// The waiter `id`.
    pub fn get(&self, id: &RequestId) -> Option<&Waiter> {
        self.waiters.iter().find(|w| &w.id == id)
    }

    /// The waiter `id`, to change (its stage changes through [`Self::set_stage`]).
    pub fn get_mut(&mut self, id: &RequestId) -> Option<&mut Waiter> {
        self.waiters.iter_mut().find(|w| &w.id == id)
    }

    /// Moves waiter `id` to `stage`.
    pub fn set_stage(&mut self, id: &RequestId, stage: Stage) {
        let Some(waiter) = self.waiters.iter_mut().find(|w| &w.id == id) else {
            return;
        };
        let was_queued = waiter.is_queued();
        waiter.stage = stage;
        match (was_queued, waiter.is_queued()) {
            (true, false) => self.queued -= 1,
            (false, true) => self.queued += 1,
            _ => {}
        }
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
        let waiter = self.waiters.remove(at);
        if waiter.is_queued() {
            self.queued -= 1;
        }
        self.reordered = true;
        Some(waiter)
    }

    /// Announces waiter `id` as queued, the first time: answers its place, which it is now told,
    /// or `None` when it was announced before.
    pub fn announce(&mut self, id: &RequestId) -> Option<u32> {
        let at = self.waiters.iter().position(|w| &w.id == id)?;
        let waiter = &mut self.waiters[at];
        if waiter.told_position.is_some() {
            return None;
        }
        let position = u32::try_from(at + 1).unwrap_or(u32::MAX);
        waiter.told_position = Some(position);
        Some(position)
    }

    /// The place `id` was last told, once it was announced.
    pub fn told_position(&self, id: &RequestId) -> Option<u32> {
        self.get(id).and_then(|w| w.told_position)
    }

    /// The 1-based place of `id` among the waiters not answered yet.
    pub fn position(&self, id: &RequestId) -> u32 {
        let ahead = self.waiters.iter().take_while(|w| &w.id != id).count();
        u32::try_from(ahead + 1).unwrap_or(u32::MAX)
    }

    /// The announced, still queued waiters whose place changed since they were last told (one
    /// ahead of them was granted, answered or withdrawn), each with its place now, which it is
    /// now told.
    pub fn moved(&mut self) -> Vec<(RequestId, u32)> {
        let mut moved = Vec::new();
        if !std::mem::take(&mut self.reordered) {
            return moved;
        }
        for (index, waiter) in self.waiters.iter_mut().enumerate() {
            let position = u32::try_from(index + 1).unwrap_or(u32::MAX);
            if waiter.is_queued()
                && waiter.told_position.is_some()
                && waiter.told_position != Some(position)
            {
                waiter.told_position = Some(position);
                moved.push((waiter.id.clone(), position));
            }
        }
        moved
    }

    /// How many are queued (not forwarded).
    pub const fn depth(&self) -> u32 {
        self.queued
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn booked(request: &str) -> Booked {
        Booked {
            principal: "agent".into(),
            fingerprint: String::new(),
            request: RequestId::from_raw(request),
            outcome: None,
            settled_at: None,
        }
    }

    fn keys(book: &Book) -> Vec<String> {
        let mut keys: Vec<String> = book.records.keys().map(|(_, k)| k.clone()).collect();
        keys.sort();
        keys
    }

    /// A book with `settled` keys answered at the given times and `pending` ones waiting.
    fn book(cap: usize, settled: &[i64], pending: usize) -> Book {
        let mut book = Book::with_cap(cap);
        for (i, at) in settled.iter().enumerate() {
            let id = format!("s{i}");
            book.insert("r".into(), id.clone(), booked(&id));
            book.settle(&RequestId::from_raw(&id), &Err(FleetError::Cancelled), *at);
        }
        for i in 0..pending {
            let id = format!("p{i}");
            book.insert("r".into(), id.clone(), booked(&id));
        }
        book
    }

    #[test]
    fn an_answered_key_goes_at_its_retention_and_not_a_moment_before() {
        let mut book = book(100, &[0, 1, 2], 1);
        assert_eq!(book.next_expiry(10), Some(10));
        book.prune(9, 10);
        assert_eq!(keys(&book), ["p0", "s0", "s1", "s2"], "before the bound");
        book.prune(10, 10);
        assert_eq!(keys(&book), ["p0", "s1", "s2"], "at it");
        assert_eq!(book.next_expiry(10), Some(11));
        book.prune(1_000, 10);
        assert_eq!(keys(&book), ["p0"], "waiting ones stay");
        assert_eq!(book.next_expiry(10), None);
    }

    #[test]
    fn a_settle_records_the_outcome_once_and_ignores_a_request_with_no_key() {
        let mut book = book(100, &[], 1);
        book.settle(
            &RequestId::from_raw("nobody"),
            &Err(FleetError::Cancelled),
            5,
        );
        assert_eq!(book.next_expiry(10), None);
        book.settle(&RequestId::from_raw("p0"), &Err(FleetError::Cancelled), 5);
        let record = book.get("r", "p0").unwrap();
        assert_eq!(record.settled_at, Some(5));
        assert!(matches!(record.outcome, Some(Err(FleetError::Cancelled))));
        book.settle(&RequestId::from_raw("p0"), &Err(FleetError::Stopping), 6);
        assert_eq!(book.get("r", "p0").unwrap().settled_at, Some(5), "once");
        assert_eq!(book.settled.len(), 1);
    }

    #[test]
    fn a_full_book_drops_the_oldest_answered_key_first_and_never_a_waiting_one() {
        // At the cap: all kept.
        let at_cap = book(BOOK_CAP, &vec![1; BOOK_CAP - 1], 1);
        assert_eq!(at_cap.len(), BOOK_CAP);
        // One past it: the oldest answered one makes room.
        let mut past = at_cap;
        past.insert("r".into(), "new".into(), booked("new"));
        assert_eq!(past.len(), BOOK_CAP);
        assert!(past.get("r", "s0").is_none(), "the oldest answered went");
        assert!(past.get("r", "s1").is_some());
        assert!(past.get("r", "p0").is_some(), "a waiting key stays");
        assert!(past.get("r", "new").is_some());
        // Only waiting keys: none is dropped.
        let mut waiting = book(2, &[], 2);
        waiting.insert("r".into(), "p2".into(), booked("p2"));
        assert_eq!(keys(&waiting), ["p0", "p1", "p2"]);
    }
}
