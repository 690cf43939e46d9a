//! The fleet queue: lease requests waiting for a worker, oldest first, each with a deadline fixed
//! when it arrives, and the book of idempotency keys.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use parking_lot::Mutex;
use simlock_contract::ContractError;
use simlock_contract::ids::RequestId;
use simlock_contract::model::LeaseGrant;
use simlock_contract::ops::LeaseRequestInput;
use simlock_contract::push::Progress;
use tokio::sync::{mpsc, watch};

use crate::routing::Wanted;

/// Where a waiter is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Stage {
    /// In the queue.
    Queued,
    /// Being tried on a worker.
    Processing(String),
    /// Done.
    Settled,
}

/// A lease request the gateway holds.
pub(crate) struct Waiter {
    pub(crate) id: RequestId,
    pub(crate) requester: String,
    pub(crate) owner: String,
    pub(crate) input: LeaseRequestInput,
    pub(crate) wanted: Wanted,
    pub(crate) created_at: i64,
    pub(crate) deadline: Option<i64>,
    pub(crate) no_wait: bool,
    pub(crate) stage: Mutex<Stage>,
    progress: Mutex<Option<mpsc::Sender<Progress>>>,
    result: watch::Sender<Option<Result<LeaseGrant, ContractError>>>,
    /// Workers that refused with `NO_CAPACITY`, with the view key they had then.
    pub(crate) refusals: Mutex<HashMap<String, String>>,
    /// Workers that can never serve this request (they refused its spec).
    pub(crate) excluded: Mutex<HashSet<String>>,
    /// The last refusal of the spec, answered when no worker is left.
    pub(crate) last_refusal: Mutex<Option<ContractError>>,
    /// A `noWait` request gets one more walk after a stale view refused it.
    pub(crate) second_walk: AtomicBool,
    /// Whether `queued` was announced.
    pub(crate) announced: AtomicBool,
    /// Whether the dispatcher walked it once.
    pub(crate) walked: AtomicBool,
}

impl std::fmt::Debug for Waiter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Waiter")
            .field("id", &self.id)
            .field("requester", &self.requester)
            .finish_non_exhaustive()
    }
}

impl Waiter {
    pub(crate) fn new(
        input: LeaseRequestInput,
        wanted: Wanted,
        requester: String,
        owner: String,
        created_at: i64,
        progress: Option<mpsc::Sender<Progress>>,
    ) -> Arc<Self> {
        let deadline = input
            .timeout_ms
            .map(|t| created_at.saturating_add(i64::try_from(t).unwrap_or(i64::MAX)));
        let no_wait = input.no_wait.unwrap_or(false);
        Arc::new(Self {
            id: RequestId::mint(),
            requester,
            owner,
            input,
            wanted,
            created_at,
            deadline,
            no_wait,
            stage: Mutex::new(Stage::Queued),
            progress: Mutex::new(progress),
            result: watch::Sender::new(None),
            refusals: Mutex::new(HashMap::new()),
            excluded: Mutex::new(HashSet::new()),
            last_refusal: Mutex::new(None),
            second_walk: AtomicBool::new(false),
            announced: AtomicBool::new(false),
            walked: AtomicBool::new(false),
        })
    }

    /// Sends a progress report to the caller, without waiting (progress is advisory).
    pub(crate) fn report(&self, progress: Progress) {
        if let Some(tx) = self.progress.lock().as_ref() {
            let _ = tx.try_send(progress);
        }
    }

    /// Ends the request with `outcome`; later calls change nothing.
    pub(crate) fn settle(&self, outcome: Result<LeaseGrant, ContractError>) -> bool {
        let mut stage = self.stage.lock();
        if *stage == Stage::Settled {
            return false;
        }
        *stage = Stage::Settled;
        drop(stage);
        self.progress.lock().take();
        self.result.send_replace(Some(outcome));
        true
    }

    pub(crate) fn is_settled(&self) -> bool {
        *self.stage.lock() == Stage::Settled
    }

    pub(crate) fn is_queued(&self) -> bool {
        *self.stage.lock() == Stage::Queued
    }

    /// Waits for the outcome.
    pub(crate) async fn outcome(&self) -> Result<LeaseGrant, ContractError> {
        let mut rx = self.result.subscribe();
        match rx.wait_for(Option::is_some).await {
            Ok(outcome) => outcome
                .clone()
                .unwrap_or_else(|| Err(ContractError::stopping())),
            Err(_) => Err(ContractError::stopping()),
        }
    }

    /// The fingerprint idempotency compares: the request as asked.
    pub(crate) fn fingerprint(input: &LeaseRequestInput) -> String {
        let mut normal = input.clone();
        normal.idempotency_key = None;
        normal.timeout_ms = None;
        normal.no_wait = None;
        serde_json::to_string(&normal).unwrap_or_default()
    }
}

/// A recorded idempotency key.
pub(crate) struct Booked {
    pub(crate) principal: String,
    pub(crate) fingerprint: String,
    pub(crate) waiter: Arc<Waiter>,
    pub(crate) settled_at: Option<i64>,
}

/// The queue and the book.
#[derive(Default)]
pub(crate) struct Queue {
    pub(crate) waiters: Vec<Arc<Waiter>>,
    pub(crate) book: HashMap<(String, String), Booked>,
}

impl Queue {
    /// The waiter of `requester`, if it has one pending.
    pub(crate) fn pending_of(&self, requester: &str) -> Option<&Arc<Waiter>> {
        self.waiters
            .iter()
            .find(|w| w.requester == requester && !w.is_settled())
    }

    /// Drops settled waiters.
    pub(crate) fn prune(&mut self) {
        self.waiters.retain(|w| !w.is_settled());
    }

    /// Drops book records settled longer ago than `retention_ms`.
    pub(crate) fn prune_book(&mut self, now: i64, retention_ms: i64) {
        for booked in self.book.values_mut() {
            if booked.settled_at.is_none() && booked.waiter.is_settled() {
                booked.settled_at = Some(now);
            }
        }
        self.book.retain(|_, b| {
            b.settled_at
                .is_none_or(|at| now.saturating_sub(at) < retention_ms)
        });
    }

    /// The 1-based place of `waiter` among the waiters still waiting.
    pub(crate) fn position(&self, waiter: &Waiter) -> u32 {
        let ahead = self
            .waiters
            .iter()
            .take_while(|w| w.id != waiter.id)
            .filter(|w| !w.is_settled())
            .count();
        u32::try_from(ahead + 1).unwrap_or(u32::MAX)
    }

    /// How many wait.
    pub(crate) fn depth(&self) -> u32 {
        u32::try_from(self.waiters.iter().filter(|w| w.is_queued()).count()).unwrap_or(u32::MAX)
    }

    /// Takes every waiter out (the gateway stops).
    pub(crate) fn drain_all(&mut self) -> Vec<Arc<Waiter>> {
        self.waiters.drain(..).collect()
    }

    /// Marks every waiter's walk so far; used by the second-walk rule.
    pub(crate) fn mark_walked(waiter: &Waiter) -> bool {
        waiter.walked.swap(true, Ordering::SeqCst)
    }
}
