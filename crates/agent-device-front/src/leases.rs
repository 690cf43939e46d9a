//! The front's memory of the agent-device leases it made: for each `L`, whose it is, the
//! device it is pinned to and its TTL. The simlock lease behind `L` has the id `L` too, on a
//! worker and through a gateway. It also remembers, for a while, whose the leases that ended
//! were, so that their owner keeps hearing `LEASE_ENDED_BY_HOST` (connect again) and not "not
//! one of yours".

use std::collections::HashMap;
use std::time::Duration;

use parking_lot::Mutex;
use simlock_contract::model::Platform;
use tokio::time::Instant;

use crate::lease_id::LeaseId;

/// One agent-device lease the front made.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FrontLease {
    /// The owner: the principal of the token that allocated it.
    pub principal: String,
    /// The leased device's platform.
    pub platform: Platform,
    /// How agent-device names the device (the driver's UDID or serial).
    pub address: String,
    /// The lease's TTL: each heartbeat renews the simlock lease to now plus this.
    pub ttl_ms: u64,
    /// When it was allocated, heartbeated or renewed last.
    pub touched: Instant,
    /// Allocation order, for answers joined in lease order.
    pub seq: u64,
}

/// The leases the front made, by `L`.
#[derive(Debug, Default)]
pub struct FrontLeases {
    inner: Mutex<Inner>,
}

#[derive(Debug, Default)]
struct Inner {
    by_id: HashMap<LeaseId, FrontLease>,
    next_seq: u64,
    /// Leases that ended: their owner, and when.
    ended: HashMap<LeaseId, (String, Instant)>,
}

/// How long an ended lease's owner is remembered.
pub const ENDED_RETENTION: Duration = Duration::from_secs(3600);
/// How many ended leases are remembered at most; past it, the oldest is forgotten.
pub const MAX_ENDED: usize = 4096;

impl Inner {
    fn remember_ended(&mut self, lease: LeaseId, principal: String, now: Instant) {
        self.ended
            .retain(|_, (_, at)| now.saturating_duration_since(*at) <= ENDED_RETENTION);
        while self.ended.len() >= MAX_ENDED {
            let oldest = self
                .ended
                .iter()
                .min_by_key(|(_, (_, at))| *at)
                .map(|(l, _)| l.clone());
            match oldest {
                Some(oldest) => self.ended.remove(&oldest),
                None => break,
            };
        }
        self.ended.insert(lease, (principal, now));
    }
}

impl FrontLeases {
    /// Records a lease; its order is the order of recording.
    pub fn insert(&self, lease: LeaseId, mut entry: FrontLease) {
        let mut inner = self.inner.lock();
        entry.seq = inner.next_seq;
        inner.next_seq += 1;
        inner.by_id.insert(lease, entry);
    }

    /// The lease when `principal` owns it.
    pub fn owned(&self, lease: &LeaseId, principal: &str) -> Option<FrontLease> {
        self.inner
            .lock()
            .by_id
            .get(lease)
            .filter(|e| e.principal == principal)
            .cloned()
    }

    /// Marks a lease as used now.
    pub fn touch(&self, lease: &LeaseId, now: Instant) {
        if let Some(entry) = self.inner.lock().by_id.get_mut(lease) {
            entry.touched = now;
        }
    }

    /// Forgets a lease: one that never was (its allocate failed), or one that ended where the
    /// front keeps no memory of ended leases (through a gateway).
    pub fn remove(&self, lease: &LeaseId) -> Option<FrontLease> {
        self.inner.lock().by_id.remove(lease)
    }

    /// Forgets a lease that ended (released, or ended by simlock), remembering whose it was.
    /// `principal` is its owner when the front had no memory of it (recovered after a restart).
    pub fn end(&self, lease: &LeaseId, principal: &str, now: Instant) {
        let mut inner = self.inner.lock();
        let owner = inner
            .by_id
            .remove(lease)
            .map_or_else(|| principal.to_owned(), |entry| entry.principal);
        inner.remember_ended(lease.clone(), owner, now);
    }

    /// Whether `lease` was `principal`'s and ended within [`ENDED_RETENTION`].
    pub fn ended(&self, lease: &LeaseId, principal: &str, now: Instant) -> bool {
        self.inner
            .lock()
            .ended
            .get(lease)
            .is_some_and(|(owner, at)| {
                owner == principal && now.saturating_duration_since(*at) <= ENDED_RETENTION
            })
    }

    /// The leases `principal` holds, in allocation order.
    pub fn of_principal(&self, principal: &str) -> Vec<(LeaseId, FrontLease)> {
        let mut held: Vec<(LeaseId, FrontLease)> = self
            .inner
            .lock()
            .by_id
            .iter()
            .filter(|(_, e)| e.principal == principal)
            .map(|(l, e)| (l.clone(), e.clone()))
            .collect();
        held.sort_by_key(|(_, e)| e.seq);
        held
    }

    /// Forgets leases untouched for longer than twice their TTL: their simlock lease has
    /// most likely expired (nothing the front saw renewed it). They are not remembered as
    /// ended: one renewed otherwise (`simlock renew`) is still recovered from its simlock lease
    /// by the host link when its owner calls again.
    pub fn prune(&self, now: Instant) {
        self.inner.lock().by_id.retain(|_, e| {
            now.saturating_duration_since(e.touched) <= Duration::from_millis(e.ttl_ms) * 2
        });
    }

    /// How many leases are remembered.
    pub fn len(&self) -> usize {
        self.inner.lock().by_id.len()
    }

    /// Whether none is.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(principal: &str, ttl_ms: u64, touched: Instant) -> FrontLease {
        FrontLease {
            principal: principal.into(),
            platform: Platform::Ios,
            address: "udid".into(),
            ttl_ms,
            touched,
            seq: 0,
        }
    }

    #[tokio::test(start_paused = true)]
    async fn only_the_owner_sees_a_lease_and_order_is_allocation_order() {
        let leases = FrontLeases::default();
        let now = Instant::now();
        let (a, b, c) = (LeaseId::mint(), LeaseId::mint(), LeaseId::mint());
        leases.insert(b.clone(), entry("tok_1", 60_000, now));
        leases.insert(a.clone(), entry("tok_1", 60_000, now));
        leases.insert(c.clone(), entry("tok_2", 60_000, now));
        assert!(leases.owned(&a, "tok_1").is_some());
        assert!(leases.owned(&a, "tok_2").is_none());
        let held: Vec<LeaseId> = leases
            .of_principal("tok_1")
            .into_iter()
            .map(|(l, _)| l)
            .collect();
        assert_eq!(held, vec![b, a]);
    }

    #[tokio::test(start_paused = true)]
    async fn a_lease_untouched_past_twice_its_ttl_is_forgotten_and_not_a_moment_before() {
        let leases = FrontLeases::default();
        let start = Instant::now();
        let l = LeaseId::mint();
        leases.insert(l.clone(), entry("tok_1", 10_000, start));
        leases.prune(start + Duration::from_millis(20_000));
        assert_eq!(leases.len(), 1, "at the bound it is kept");
        let later = start + Duration::from_millis(20_001);
        leases.prune(later);
        assert!(leases.is_empty(), "one past the bound it goes");
        assert!(
            !leases.ended(&l, "tok_1", later),
            "forgotten, not ended: a simlock lease renewed otherwise is recovered"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn an_ended_lease_is_its_owners_to_hear_of_until_the_retention_passes() {
        let leases = FrontLeases::default();
        let start = Instant::now();
        let (l, recovered) = (LeaseId::mint(), LeaseId::mint());
        leases.insert(l.clone(), entry("tok_1", 10_000, start));
        leases.end(&l, "ignored: the entry names its owner", start);
        assert!(leases.owned(&l, "tok_1").is_none());
        assert!(leases.ended(&l, "tok_1", start));
        assert!(
            !leases.ended(&l, "tok_2", start),
            "another token's ended lease is not its"
        );
        // One the front had no entry for (recovered after a restart) ends as the caller's.
        leases.end(&recovered, "tok_3", start);
        assert!(leases.ended(&recovered, "tok_3", start));
        assert!(
            leases.ended(&l, "tok_1", start + ENDED_RETENTION),
            "at the bound"
        );
        assert!(!leases.ended(
            &l,
            "tok_1",
            start + ENDED_RETENTION + Duration::from_millis(1)
        ));
    }

    #[tokio::test(start_paused = true)]
    async fn past_the_bound_the_oldest_ended_lease_is_forgotten() {
        let leases = FrontLeases::default();
        let start = Instant::now();
        let first = LeaseId::mint();
        leases.end(&first, "tok_1", start);
        for i in 1..MAX_ENDED {
            leases.end(
                &LeaseId::mint(),
                "tok_1",
                start + Duration::from_millis(i as u64),
            );
        }
        let at = start + Duration::from_millis(MAX_ENDED as u64);
        assert!(
            leases.ended(&first, "tok_1", at),
            "at the bound all are kept"
        );
        let last = LeaseId::mint();
        leases.end(&last, "tok_1", at);
        assert!(
            !leases.ended(&first, "tok_1", at),
            "one past it, the oldest goes"
        );
        assert!(leases.ended(&last, "tok_1", at));
        assert_eq!(leases.inner.lock().ended.len(), MAX_ENDED);
    }
}
