//! The lease index: which worker holds each lease the gateway issued, for whom, and the worker's
//! record of it as last heard. Plain data.
//!
//! A gateway lease id is `<workerId>.<workerLeaseId>`, or the bare id when the requester chose it.
//! Nothing is persisted: the index is rebuilt from each worker's reported leases (those whose
//! requester carries this gateway's `gw:<id>:` prefix).
//!
//! Every fact the index takes in carries a [`Stamp`]: the moment, in the order of the fleet's
//! decisions, the gateway learned it. A snapshot of a worker's leases is stamped when its
//! `status.get` is sent, so it shows every end and grant the gateway heard of before that, and
//! maybe some after. Hence:
//!
//! - a lease the gateway saw end is remembered (a *tombstone*), and a snapshot sent before the end
//!   cannot bring it back (a released lease never returns from a stale view);
//! - a lease indexed from a grant's answer is dropped by a snapshot only when that snapshot was
//!   sent after the answer and the worker no longer lists it (the worker's own word, never a view
//!   that raced the grant);
//! - an end that names no entry is remembered for a while ([`ENDS_REMEMBERED`]), since its grant's
//!   answer may still be on its way.

use std::collections::{BTreeMap, BTreeSet, HashMap, VecDeque};

use simlock_contract::ids::{DeviceId, LeaseId};
use simlock_contract::model::{LeaseEndReason, LeaseRecord, WorkerRef};

/// A moment in the order of the fleet's decisions (strictly increasing per gateway).
pub type Stamp = u64;

/// One lease the gateway issued.
#[derive(Debug, Clone, PartialEq)]
pub struct Entry {
    /// The id callers use.
    pub lease_id: String,
    /// The worker holding it.
    pub worker_id: String,
    /// The worker's id for it.
    pub worker_lease_id: String,
    /// The requester, without the gateway's prefix.
    pub requester_id: String,
    /// Who may renew and release it.
    pub owner_id: String,
    /// Whether the requester chose the id.
    pub chosen: bool,
    /// The worker's record of it, as last heard (grant, renewals, snapshots).
    pub record: LeaseRecord,
    /// When the gateway learned the worker holds it.
    pub(crate) known_at: Stamp,
}

impl Entry {
    /// When it was granted (the worker's clock).
    pub const fn granted_at(&self) -> i64 {
        self.record.granted_at
    }

    /// Its device.
    pub const fn device_id(&self) -> &DeviceId {
        &self.record.device_id
    }

    /// The record as the gateway's callers see it: the gateway's id, requester and owner, and
    /// the worker it lives on (`worker`, which names this entry's worker).
    pub fn project(&self, worker: WorkerRef) -> LeaseRecord {
        let mut record = self.record.clone();
        record.id = LeaseId::from_raw(self.lease_id.clone());
        record.requester_id.clone_from(&self.requester_id);
        record.owner_id.clone_from(&self.owner_id);
        debug_assert_eq!(worker.id, self.worker_id, "the entry's own worker");
        record.worker = Some(worker);
        record.worker_id = Some(self.worker_id.clone());
        record
    }
}

/// A renewal as the gateway heard it: in a `lease.renewed` event or a renew's answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Renewal {
    /// The new deadline, ms since the epoch.
    pub deadline: i64,
    /// The lease's width after it, when told (a renewal may set a new one).
    pub ttl_ms: Option<u64>,
    /// When it happened, ms since the epoch.
    pub at: i64,
}

impl Renewal {
    /// `record` takes the renewal unless it already holds a newer one.
    pub fn apply(self, record: &mut LeaseRecord) {
        if self.at >= record.last_renewed_at {
            record.ttl_deadline = self.deadline;
            record.last_renewed_at = self.at;
            if let Some(width) = self.ttl_ms {
                record.ttl_ms = width;
            }
        }
    }
}

/// A worker lease's end, as the gateway heard it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EndedLease {
    /// The worker that held it.
    pub worker_id: String,
    /// The worker's id for it.
    pub worker_lease_id: String,
    /// Its device.
    pub device_id: DeviceId,
    /// Why it ended.
    pub reason: LeaseEndReason,
    /// When the gateway heard it.
    pub heard_at: Stamp,
}

/// A lease the gateway saw end, or is ending itself (an orphan: a grant nobody waits for).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Tombstone {
    /// Which lease: a chosen id can be granted again, to a new lease with a new grant time.
    granted_at: i64,
    /// When the gateway heard it end.
    ended_at: Stamp,
    /// The gateway is releasing it; until the worker answers, no snapshot brings it back.
    orphan: bool,
    /// For an orphan: past this (ms), it has ended on its worker whatever happened.
    expires_at: i64,
}

/// A lease the gateway is releasing on its worker (an orphan): a grant nobody waits for, or a
/// release answered while its worker was away. Stored, so that a gateway restart keeps it from
/// coming back as a live lease and still releases it once its worker is back.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoredOrphan {
    /// The worker holding it.
    pub worker_id: String,
    /// The worker's id for it.
    pub worker_lease_id: String,
    /// Its grant time (which lease of that id it is).
    pub granted_at: i64,
    /// When it has ended on its worker whatever happens (ms): the gateway's longest TTL past
    /// the moment it became an orphan, as nobody renews an orphan. Then it is forgotten.
    pub expires_at: i64,
}

/// A lease request forwarded to a worker whose answer the gateway has not taken in: stored
/// from the moment it goes out until its answer settles it, so that a grant whose answer was
/// lost (with its uplink, or with the gateway) never becomes a live lease of a requester the
/// gateway answered otherwise (or never answered): a view that lists it finds it here, and it is
/// released as an orphan.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoredForward {
    /// The worker it went to.
    pub worker_id: String,
    /// Its requester, without the gateway's prefix.
    pub requester_id: String,
    /// The worker's id for the lease of the last grant answered to that requester while other
    /// forwards were out: a view may list it, and it is the requester's.
    pub answered_lease: Option<String>,
}

/// The forwards of one requester to one worker, as the index keeps them.
#[derive(Debug, Clone, PartialEq, Eq)]
struct ForwardOut {
    /// The attempts waiting for their answers (one, but for a forward whose waiter was answered
    /// first and a newer one of the same requester): a grant of theirs a view lists is theirs
    /// to answer.
    out: BTreeSet<u64>,
    /// An answer was lost (or its forward was taken back after a restart): whether it granted is
    /// known only from the worker's views.
    lost: bool,
    /// See [`StoredForward::answered_lease`].
    answered_lease: Option<String>,
    /// Past this (ms), any lease it granted has ended on its worker whatever happened: its
    /// worker's answer bound, then the gateway's longest TTL (nobody renews a grant nobody
    /// knows of), and a minute for the worker's clock, counted from when it went out and again
    /// from its worker's return; `i64::MAX` while its worker is away (a request that sat in a
    /// stopped worker's socket is read, and may be granted, once it runs again). Not stored: a
    /// restarted gateway keeps a stored forward until its worker is back.
    expires_at: i64,
}

/// How a forward was answered.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ForwardAnswer {
    /// A grant: the gateway knows its lease from here on (indexed, or an orphan). A worker
    /// holds one lease of a requester at a time, so a grant whose answer was lost earlier has
    /// ended by now.
    Granted {
        /// The worker's id for the lease.
        lease: String,
        /// Whether it answers its waiter (else it is an orphan).
        answered: bool,
    },
    /// A refusal: it granted nothing.
    Refused,
    /// No answer (the uplink was lost): it may have granted.
    Lost,
}

/// A change to what the index stores, in order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StoreChange {
    /// A new orphan.
    Kept(StoredOrphan),
    /// An orphan released, or found gone: `(worker_id, worker_lease_id)`.
    Settled(String, String),
    /// A forward out ([`StoredForward`]), new or with a later expiry.
    ForwardKept(StoredForward),
    /// A forward answered, found, or expired: `(worker_id, requester_id)`.
    ForwardSettled(String, String),
}

/// A view's leases, screened for the grants of forwards whose answers were lost
/// ([`LeaseIndex::screen`]).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Screened {
    /// What the view may fold in: every lease it listed but those whose forward is still to
    /// answer.
    pub listed: Vec<LeaseRecord>,
    /// The grants nobody knows of: now orphans, to release.
    pub strays: Vec<LeaseRecord>,
}

/// How recording a forwarded grant went.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Recorded {
    /// The lease is indexed.
    Indexed,
    /// Its end overtook the answer and nobody was told yet: its owner must hear of it now.
    EndedFirst(EndedLease),
    /// Its end overtook the answer and its owner was told when it came.
    AlreadyEnded,
}

/// How many ends of leases it does not hold the index remembers. Ends of leases that are not
/// this gateway's (a worker's local callers, other gateways) come too: they are the many, and
/// the ones that matter are matched within moments.
pub const ENDS_REMEMBERED: usize = 256;

/// The index.
#[derive(Debug, Default, Clone)]
pub struct LeaseIndex {
    prefix: String,
    entries: HashMap<String, Entry>,
    /// A requester holds one lease, but may be seen with more for a while (a grant whose answer
    /// was lost while another was granted): every one is kept, the oldest answers.
    by_requester: HashMap<String, BTreeSet<(i64, String)>>,
    by_worker_lease: HashMap<(String, String), String>,
    /// Each worker's entries, oldest grant first: a worker's part is read without a scan.
    by_worker: HashMap<String, BTreeSet<(i64, String)>>,
    /// In (worker, lease) order, so a worker's are a range.
    tombstones: BTreeMap<(String, String), Tombstone>,
    /// The stamp of the newest snapshot applied, per worker: an older one is stale.
    applied: BTreeMap<String, Stamp>,
    /// Ends that named no entry, newest last, at most [`ENDS_REMEMBERED`]. A worker answers a
    /// grant and then sends events on one uplink, but the gateway handles the answer in the
    /// forwarding task and the events in the uplink's reader, so a short lease's end can come
    /// before its grant is recorded.
    early_ends: VecDeque<EndedLease>,
    /// Broken on purpose ([`super::Fault::StaleViewRevives`]): snapshots ignore what ended.
    pub(crate) revive_stale: bool,
    /// Ids of the entries that left the index since the core last took them.
    dropped: Vec<String>,
    /// Changes to the orphans since the core last took them.
    store_changes: Vec<StoreChange>,
    /// The orphans by expiry, soonest first: what [`Self::expire`] and the core's next
    /// deadline read without a scan of every tombstone.
    orphan_expiries: BTreeSet<(i64, (String, String))>,
    /// The forwards out, by (worker, requester): a requester has one request at a time, and a
    /// worker grants a requester one lease.
    forwards: BTreeMap<(String, String), ForwardOut>,
    /// The forwards out by expiry, soonest first.
    forward_expiries: BTreeSet<(i64, (String, String))>,
    /// The (worker, requester) of each forward attempt still to be answered.
    attempts: HashMap<u64, (String, String)>,
}

/// The gateway lease id for a worker's lease.
pub fn gateway_lease_id(worker_id: &str, worker_lease_id: &str, chosen: bool) -> String {
    if chosen {
        worker_lease_id.to_owned()
    } else {
        format!("{worker_id}.{worker_lease_id}")
    }
}

/// The worker a gateway lease id names, when it is `<workerId>.<workerLeaseId>` (a chosen id
/// names none).
pub fn worker_of(lease_id: &str) -> Option<&str> {
    split_lease_id(lease_id).map(|(worker, _)| worker)
}

/// The worker and the worker's own lease id a gateway lease id `<workerId>.<workerLeaseId>`
/// names (a chosen id names none).
pub fn split_lease_id(lease_id: &str) -> Option<(&str, &str)> {
    lease_id.split_once('.').filter(|(w, _)| !w.is_empty())
}

fn key(worker_id: &str, worker_lease_id: &str) -> (String, String) {
    (worker_id.to_owned(), worker_lease_id.to_owned())
}

impl LeaseIndex {
    /// An empty index for the gateway whose requester prefix is `prefix` (`gw:<id>:`).
    pub fn new(prefix: String) -> Self {
        Self {
            prefix,
            ..Self::default()
        }
    }

    /// The requester prefix.
    pub fn prefix(&self) -> &str {
        &self.prefix
    }

    fn insert(&mut self, entry: Entry) {
        // A newer record of the same lease replaces the old one: nothing left the index.
        self.unlink(&entry.lease_id.clone());
        self.unbury(&key(&entry.worker_id, &entry.worker_lease_id));
        self.by_requester
            .entry(entry.requester_id.clone())
            .or_default()
            .insert((entry.granted_at(), entry.lease_id.clone()));
        self.by_worker_lease.insert(
            key(&entry.worker_id, &entry.worker_lease_id),
            entry.lease_id.clone(),
        );
        self.by_worker
            .entry(entry.worker_id.clone())
            .or_default()
            .insert((entry.granted_at(), entry.lease_id.clone()));
        self.entries.insert(entry.lease_id.clone(), entry);
    }

    /// Takes an entry out of the index: it is gone, and that is told ([`Self::take_dropped`]).
    fn remove(&mut self, lease_id: &str) -> Option<Entry> {
        let entry = self.unlink(lease_id)?;
        self.dropped.push(entry.lease_id.clone());
        Some(entry)
    }

    /// The ids of the entries that left the index since the last call.
    pub fn take_dropped(&mut self) -> Vec<String> {
        std::mem::take(&mut self.dropped)
    }

    fn unlink(&mut self, lease_id: &str) -> Option<Entry> {
        let entry = self.entries.remove(lease_id)?;
        if let Some(held) = self.by_requester.get_mut(&entry.requester_id) {
            held.remove(&(entry.granted_at(), entry.lease_id.clone()));
            if held.is_empty() {
                self.by_requester.remove(&entry.requester_id);
            }
        }
        self.by_worker_lease
            .remove(&key(&entry.worker_id, &entry.worker_lease_id));
        if let Some(held) = self.by_worker.get_mut(&entry.worker_id) {
            held.remove(&(entry.granted_at(), entry.lease_id.clone()));
            if held.is_empty() {
                self.by_worker.remove(&entry.worker_id);
            }
        }
        Some(entry)
    }

    /// The ids of `worker_id`'s entries, oldest grant first.
    fn ids_of(&self, worker_id: &str) -> Vec<String> {
        self.by_worker
            .get(worker_id)
            .map(|held| held.iter().map(|(_, id)| id.clone()).collect())
            .unwrap_or_default()
    }

    /// The tombstones of `worker_id`.
    fn tombstones_of<'a>(
        &'a self,
        worker_id: &'a str,
    ) -> impl Iterator<Item = (&'a (String, String), &'a Tombstone)> + 'a {
        self.tombstones
            .range((worker_id.to_owned(), String::new())..)
            .take_while(move |((w, _), _)| w == worker_id)
    }

    fn bury(&mut self, worker_id: &str, worker_lease_id: &str, granted_at: i64, at: Stamp) {
        self.set_tombstone(
            key(worker_id, worker_lease_id),
            Tombstone {
                granted_at,
                ended_at: at,
                orphan: false,
                expires_at: 0,
            },
        );
    }

    /// Every tombstone is set here, so that the orphans to store and their expiries follow (but
    /// an orphan taken back after a restart, [`Self::restore_orphan`], which is stored already).
    fn set_tombstone(&mut self, key: (String, String), tomb: Tombstone) {
        let orphan = tomb.orphan.then(|| StoredOrphan {
            worker_id: key.0.clone(),
            worker_lease_id: key.1.clone(),
            granted_at: tomb.granted_at,
            expires_at: tomb.expires_at,
        });
        if tomb.orphan {
            self.orphan_expiries.insert((tomb.expires_at, key.clone()));
        }
        let was = self.tombstones.insert(key.clone(), tomb);
        if let Some(was) = was.as_ref().filter(|t| t.orphan) {
            self.orphan_expiries.remove(&(was.expires_at, key.clone()));
        }
        match (was.is_some_and(|t| t.orphan), orphan) {
            (_, Some(orphan)) => self.store_changes.push(StoreChange::Kept(orphan)),
            (true, None) => self.store_changes.push(StoreChange::Settled(key.0, key.1)),
            (false, None) => {}
        }
    }

    /// Every tombstone is removed here, so that the orphans to store and their expiries follow.
    fn unbury(&mut self, key: &(String, String)) {
        if let Some(was) = self.tombstones.remove(key).filter(|t| t.orphan) {
            self.orphan_expiries.remove(&(was.expires_at, key.clone()));
            self.store_changes
                .push(StoreChange::Settled(key.0.clone(), key.1.clone()));
        }
    }

    /// When the soonest orphan or forward out expires, if any is kept.
    pub fn next_expiry(&self) -> Option<i64> {
        let orphan = self.orphan_expiries.first().map(|(at, _)| *at);
        let forward = self.forward_expiries.first().map(|(at, _)| *at);
        orphan.into_iter().chain(forward).min()
    }

    /// The changes to the orphans since the last call, in order.
    pub fn take_store_changes(&mut self) -> Vec<StoreChange> {
        std::mem::take(&mut self.store_changes)
    }

    fn buried(&self, worker_id: &str, record: &LeaseRecord) -> Option<&Tombstone> {
        self.tombstones
            .get(&key(worker_id, record.id.as_str()))
            .filter(|t| t.granted_at == record.granted_at)
    }

    /// A new entry for `lease`, reported by `worker_id` and known since `at`, if it is one of
    /// this gateway's.
    pub fn entry_for(&self, worker_id: &str, lease: &LeaseRecord, at: Stamp) -> Option<Entry> {
        let requester = lease.requester_id.strip_prefix(&self.prefix)?;
        Some(Entry {
            lease_id: gateway_lease_id(worker_id, lease.id.as_str(), lease.id_chosen_by_requester),
            worker_id: worker_id.to_owned(),
            worker_lease_id: lease.id.to_string(),
            requester_id: requester.to_owned(),
            owner_id: lease.owner_id.clone(),
            chosen: lease.id_chosen_by_requester,
            record: lease.clone(),
            known_at: at,
        })
    }

    /// Records a forwarded grant, learned at `entry.known_at`. Unless its end already came
    /// ([`Self::end_unmatched`]) or ended the entry a snapshot made for it, it is indexed.
    pub fn record_grant(&mut self, entry: Entry) -> Recorded {
        let early = self.early_ends.iter().position(|end| {
            end.worker_id == entry.worker_id && end.worker_lease_id == entry.worker_lease_id
        });
        if let Some(end) = early.and_then(|at| self.early_ends.remove(at)) {
            // A view read may have listed it meanwhile: the lease is dead all the same.
            if self
                .entries
                .get(&entry.lease_id)
                .is_some_and(|e| e.granted_at() == entry.granted_at())
            {
                self.remove(&entry.lease_id);
            }
            self.bury(
                &entry.worker_id,
                &entry.worker_lease_id,
                entry.granted_at(),
                entry.known_at,
            );
            return Recorded::EndedFirst(end);
        }
        if self.buried(&entry.worker_id, &entry.record).is_some() {
            return Recorded::AlreadyEnded;
        }
        self.insert(entry);
        Recorded::Indexed
    }

    /// A worker's lease ended, as it said at `at` (an event, a release's answer, `UNKNOWN_LEASE`):
    /// the entry goes and is remembered as ended. Answers the entry, if there was one.
    pub fn end(&mut self, worker_id: &str, worker_lease_id: &str, at: Stamp) -> Option<Entry> {
        let id = self
            .by_worker_lease
            .get(&key(worker_id, worker_lease_id))
            .cloned()?;
        let entry = self.remove(&id)?;
        self.bury(worker_id, worker_lease_id, entry.granted_at(), at);
        Some(entry)
    }

    /// Whether the gateway already heard `worker_lease_id` of `worker_id` end (or is releasing
    /// it as an orphan).
    pub fn ended(&self, worker_id: &str, worker_lease_id: &str) -> bool {
        self.tombstones
            .contains_key(&key(worker_id, worker_lease_id))
    }

    /// Remembers an end that named no entry, in case its grant is still on its way.
    pub fn end_unmatched(&mut self, end: EndedLease) {
        if self.early_ends.len() >= ENDS_REMEMBERED {
            self.early_ends.pop_front();
        }
        self.early_ends.push_back(end);
    }

    /// A grant nobody waits for any more (its waiter was answered first): it is being released,
    /// and until the worker answers that release no snapshot indexes it.
    pub fn orphan(&mut self, worker_id: &str, record: &LeaseRecord, at: Stamp, expires_at: i64) {
        self.set_tombstone(
            key(worker_id, record.id.as_str()),
            Tombstone {
                granted_at: record.granted_at,
                ended_at: at,
                orphan: true,
                expires_at,
            },
        );
    }

    /// Takes `lease_id`'s entry out of the index as an orphan (a release answered while its
    /// worker is away, carried out once it is back): answers the entry.
    pub fn defer_release(&mut self, lease_id: &str, at: Stamp, expires_at: i64) -> Option<Entry> {
        let entry = self.remove(lease_id)?;
        self.set_tombstone(
            key(&entry.worker_id, &entry.worker_lease_id),
            Tombstone {
                granted_at: entry.granted_at(),
                ended_at: at,
                orphan: true,
                expires_at,
            },
        );
        Some(entry)
    }

    /// An orphan stored before a restart, at `at`.
    pub fn restore_orphan(&mut self, orphan: StoredOrphan, at: Stamp) {
        // Stored already: set directly, not through `set_tombstone`, which would store it again.
        let key = key(&orphan.worker_id, &orphan.worker_lease_id);
        self.orphan_expiries
            .insert((orphan.expires_at, key.clone()));
        self.tombstones.insert(
            key,
            Tombstone {
                granted_at: orphan.granted_at,
                ended_at: at,
                orphan: true,
                expires_at: orphan.expires_at,
            },
        );
    }

    /// Forgets the orphans that have ended on their worker by `now` whatever happened (their
    /// worker never came back to have them released), and the forwards out whose grants have.
    pub fn expire(&mut self, now: i64) {
        while let Some((_, key)) = self
            .orphan_expiries
            .first()
            .filter(|(at, _)| *at <= now)
            .cloned()
        {
            self.unbury(&key);
        }
        while let Some((_, (worker_id, requester_id))) = self
            .forward_expiries
            .first()
            .filter(|(at, _)| *at <= now)
            .cloned()
        {
            self.forward_settled(&worker_id, &requester_id);
        }
    }

    // === Forwards out ===

    /// Forward `attempt` (attempts are numbered in the order they go out) of a lease request
    /// for `requester_id` goes out to `worker_id`: until its answer settles it, a grant of it a
    /// view lists is held back ([`Self::screen`]).
    pub fn forward_sent(
        &mut self,
        worker_id: &str,
        requester_id: &str,
        attempt: u64,
        expires_at: i64,
    ) {
        let key = key(worker_id, requester_id);
        let fresh = !self.forwards.contains_key(&key);
        let forward = self
            .forwards
            .entry(key.clone())
            .or_insert_with(|| ForwardOut {
                out: BTreeSet::new(),
                lost: false,
                answered_lease: None,
                expires_at: i64::MIN,
            });
        forward.out.insert(attempt);
        let later = expires_at > forward.expires_at;
        self.attempts.insert(attempt, key.clone());
        if later {
            self.set_forward_expiry(&key, expires_at);
        }
        // Stored as it goes out, once per (worker, requester): the row holds no bound.
        if fresh {
            self.keep_forward(key);
        }
    }

    /// Stores the forwards of `key` as they are now.
    fn keep_forward(&mut self, key: (String, String)) {
        if let Some(forward) = self.forwards.get(&key) {
            let stored = StoredForward {
                answered_lease: forward.answered_lease.clone(),
                worker_id: key.0,
                requester_id: key.1,
            };
            self.store_changes.push(StoreChange::ForwardKept(stored));
        }
    }

    /// Forward `attempt` was answered. Its requester's forwards to its worker are settled once
    /// none is out and no answer is in doubt (a grant ends the doubt: the worker holds one lease
    /// of a requester). Answers its worker, and whether a lost answer's grant is still to be
    /// found in a view of it; nothing for an attempt it does not know.
    pub fn forward_answered(
        &mut self,
        attempt: u64,
        answer: ForwardAnswer,
    ) -> Option<(String, bool)> {
        let (worker_id, requester_id) = self.attempts.remove(&attempt)?;
        let Some(forward) = self.forwards.get_mut(&key(&worker_id, &requester_id)) else {
            // Settled meanwhile (its grant found in a view, or expired).
            return Some((worker_id, false));
        };
        forward.out.remove(&attempt);
        let granted = match answer {
            ForwardAnswer::Granted { lease, answered } => {
                forward.lost = false;
                if answered {
                    forward.answered_lease = Some(lease);
                }
                answered
            }
            ForwardAnswer::Lost => {
                forward.lost = true;
                false
            }
            ForwardAnswer::Refused => false,
        };
        let (settled, lost) = (forward.out.is_empty() && !forward.lost, forward.lost);
        if settled {
            self.forward_settled(&worker_id, &requester_id);
        } else if granted {
            self.keep_forward(key(&worker_id, &requester_id));
        }
        Some((worker_id, lost))
    }

    /// Settles the forwards of `requester_id` to `worker_id`: answered, their grant found in a
    /// view, or expired.
    fn forward_settled(&mut self, worker_id: &str, requester_id: &str) {
        let key = key(worker_id, requester_id);
        if let Some(out) = self.forwards.remove(&key) {
            self.forward_expiries.remove(&(out.expires_at, key.clone()));
            self.store_changes
                .push(StoreChange::ForwardSettled(key.0, key.1));
        }
    }

    /// A forward stored before a restart: its answer is lost with the gateway that sent it. Its
    /// worker is away until it connects: the forward waits for it ([`Self::arm_forwards`]).
    pub fn restore_forward(&mut self, forward: StoredForward) {
        // Stored already: set directly.
        let key = key(&forward.worker_id, &forward.requester_id);
        self.forwards.insert(
            key,
            ForwardOut {
                out: BTreeSet::new(),
                lost: true,
                answered_lease: forward.answered_lease,
                expires_at: i64::MAX,
            },
        );
    }

    /// The keys of `worker_id`'s forwards out.
    fn forward_keys_of(&self, worker_id: &str) -> Vec<(String, String)> {
        self.forwards
            .range(key(worker_id, "")..)
            .take_while(|((worker, _), _)| worker == worker_id)
            .map(|(k, _)| k.clone())
            .collect()
    }

    /// `worker_id`'s uplink closed: its forwards out are not forgotten while it is away (a
    /// stopped worker reads what its socket held, and may grant it, whenever it runs again).
    /// Nothing is stored: a restarted gateway keeps every stored forward until its worker is
    /// back ([`Self::restore_forward`]). A worker the gateway forgets (retention, an operator's
    /// removal) keeps them too: should it ever come back, its grants of them are screened.
    pub fn park_forwards(&mut self, worker_id: &str) {
        for k in self.forward_keys_of(worker_id) {
            self.set_forward_expiry(&k, i64::MAX);
        }
    }

    /// Moves the bound of `key`'s forwards out to `at`, in the expiry order; `i64::MAX` parks
    /// them (kept, in no expiry order).
    fn set_forward_expiry(&mut self, key: &(String, String), at: i64) {
        let Some(forward) = self.forwards.get_mut(key) else {
            return;
        };
        let was = std::mem::replace(&mut forward.expires_at, at);
        self.forward_expiries.remove(&(was, key.clone()));
        if at != i64::MAX {
            self.forward_expiries.insert((at, key.clone()));
        }
    }

    /// Each of `worker_id`'s forwards out is kept at least until `expires_at`, the bound of a
    /// grant the worker makes of one now: it connected, and reads now what it had not read when
    /// it stopped.
    pub fn arm_forwards(&mut self, worker_id: &str, expires_at: i64) {
        for k in self.forward_keys_of(worker_id) {
            let Some(was) = self.forwards.get(&k).map(|f| f.expires_at) else {
                continue;
            };
            let at = if was == i64::MAX {
                expires_at
            } else {
                was.max(expires_at)
            };
            if at != was {
                self.set_forward_expiry(&k, at);
            }
        }
    }

    /// Screens the leases a view of `worker_id` lists, learned at `at`, for grants nobody was
    /// told of. A lease of this gateway the index neither holds nor buried is one when its
    /// requester has forwards to that worker not settled (and it is not the one last answered to
    /// it), or holds another indexed lease there (a worker holds one lease of a requester: this
    /// one is a grant whose answer was lost, or ended, and its release then finds it gone).
    /// While a forward of it still waits for its answer, the answer decides and the view leaves
    /// the lease out; else it becomes an orphan (expiring at the forward's expiry, or at
    /// `expires_at`), and the forwards are settled.
    pub fn screen(
        &mut self,
        worker_id: &str,
        leases: &[LeaseRecord],
        at: Stamp,
        expires_at: i64,
    ) -> Screened {
        let mut screened = Screened::default();
        for lease in leases {
            let requester = lease.requester_id.strip_prefix(&self.prefix);
            let known = self
                .by_worker_lease(worker_id, lease.id.as_str())
                .is_some_and(|e| e.granted_at() == lease.granted_at)
                || self.buried(worker_id, lease).is_some();
            let Some(requester) = requester.filter(|_| !known).map(str::to_owned) else {
                screened.listed.push(lease.clone());
                continue;
            };
            let forward = self
                .forwards
                .get(&key(worker_id, &requester))
                .filter(|out| out.answered_lease.as_deref() != Some(lease.id.as_str()))
                .map(|out| (out.out.is_empty(), out.expires_at));
            let displaced = self
                .of_worker(worker_id)
                .iter()
                .any(|e| e.requester_id == requester && e.worker_lease_id != lease.id.as_str());
            let stray_until = match forward {
                // Its answer decides.
                Some((false, _)) => continue,
                Some((true, until)) => Some(until),
                None => displaced.then_some(expires_at),
            };
            if let Some(until) = stray_until {
                // Orphaned before its forwards are settled: stored in that order, so a crash
                // between the two leaves it an orphan, never a lease to index.
                self.orphan(worker_id, lease, at, until);
                self.forward_settled(worker_id, &requester);
                screened.strays.push(lease.clone());
            }
            screened.listed.push(lease.clone());
        }
        screened
    }

    /// The forwards out stored, for a test's look.
    pub fn forwards_out(&self) -> Vec<StoredForward> {
        self.forwards
            .iter()
            .map(|((worker_id, requester_id), out)| StoredForward {
                worker_id: worker_id.clone(),
                requester_id: requester_id.clone(),
                answered_lease: out.answered_lease.clone(),
            })
            .collect()
    }

    /// The worker answered the release of an orphan (or said it is gone) at `at`.
    pub fn orphan_released(&mut self, worker_id: &str, worker_lease_id: &str, at: Stamp) {
        let key = key(worker_id, worker_lease_id);
        if let Some(t) = self.tombstones.get(&key).filter(|t| t.orphan) {
            let tomb = Tombstone {
                granted_at: t.granted_at,
                ended_at: at,
                orphan: false,
                expires_at: 0,
            };
            self.set_tombstone(key, tomb);
        }
    }

    /// Whether the gateway is releasing `worker_lease_id` of `worker_id` (an orphan).
    pub fn is_orphan(&self, worker_id: &str, worker_lease_id: &str) -> bool {
        self.tombstones
            .get(&key(worker_id, worker_lease_id))
            .is_some_and(|t| t.orphan)
    }

    /// The orphans of `worker_id` still to release.
    pub fn orphans_of(&self, worker_id: &str) -> Vec<String> {
        // In lease order already.
        self.tombstones_of(worker_id)
            .filter(|(_, t)| t.orphan)
            .map(|((_, id), _)| id.clone())
            .collect()
    }

    /// Folds in a snapshot of `worker_id`'s leases whose `status.get` was sent at `sent`.
    /// Answers the entries it shows to have ended: the worker no longer lists them although the
    /// gateway knew of them before the snapshot was asked. A snapshot older than one already
    /// applied changes nothing.
    pub fn apply_snapshot(
        &mut self,
        worker_id: &str,
        leases: &[LeaseRecord],
        sent: Stamp,
    ) -> Vec<Entry> {
        if self.applied.get(worker_id).is_some_and(|&at| at > sent) {
            return Vec::new();
        }
        self.applied.insert(worker_id.to_owned(), sent);
        let mut seen = Vec::new();
        for lease in leases {
            let Some(entry) = self.entry_for(worker_id, lease, sent) else {
                continue;
            };
            seen.push(entry.lease_id.clone());
            if let Some(tomb) = self.buried(worker_id, lease).filter(|_| !self.revive_stale) {
                // Ended before the snapshot was asked and still listed: the worker holds it
                // after all (it is the arbiter). Ended after: the snapshot is older than the end.
                if tomb.orphan || tomb.ended_at > sent {
                    continue;
                }
            }
            // An end heard after the read was sent, whose grant is still on its way: the
            // read is older than the end.
            if !self.revive_stale
                && self.early_ends.iter().any(|end| {
                    end.worker_id == worker_id
                        && end.worker_lease_id == lease.id.as_str()
                        && end.heard_at > sent
                })
            {
                continue;
            }
            match self.entries.get_mut(&entry.lease_id) {
                Some(existing) if existing.granted_at() == lease.granted_at => {
                    keep_newer_renewal(&mut existing.record, lease);
                }
                _ => self.insert(entry),
            }
        }
        let seen: BTreeSet<String> = seen.into_iter().collect();
        let gone: Vec<String> = self
            .ids_of(worker_id)
            .into_iter()
            .filter(|id| !seen.contains(id))
            .filter(|id| self.entries.get(id).is_some_and(|e| e.known_at < sent))
            .collect();
        let mut ended = Vec::new();
        for id in gone {
            if let Some(entry) = self.remove(&id) {
                self.bury(worker_id, &entry.worker_lease_id, entry.granted_at(), sent);
                ended.push(entry);
            }
        }
        // What the snapshot settles need not be remembered: an ended lease it does not list is
        // gone for good; an orphan it does not list is released (or expired).
        let listed: BTreeSet<&str> = leases.iter().map(|l| l.id.as_str()).collect();
        let settled: Vec<(String, String)> = self
            .tombstones_of(worker_id)
            .filter(|((_, id), t)| {
                t.ended_at <= sent && !(t.orphan && listed.contains(id.as_str()))
            })
            .map(|(k, _)| k.clone())
            .collect();
        for k in settled {
            self.unbury(&k);
        }
        ended
    }

    /// A renewal the worker announced: the entry takes it if it is newer.
    pub fn renewed(&mut self, worker_id: &str, worker_lease_id: &str, renewal: Renewal) {
        if let Some(entry) = self
            .by_worker_lease
            .get(&key(worker_id, worker_lease_id))
            .and_then(|id| self.entries.get_mut(id))
        {
            renewal.apply(&mut entry.record);
        }
    }

    /// A renewal's answer: the entry takes the worker's record (width included).
    pub fn renewal_answered(&mut self, lease_id: &str, record: &LeaseRecord) {
        if let Some(entry) = self.entries.get_mut(lease_id)
            && entry.granted_at() == record.granted_at
            && record.last_renewed_at >= entry.record.last_renewed_at
        {
            entry.record.ttl_ms = record.ttl_ms;
            entry.record.ttl_deadline = record.ttl_deadline;
            entry.record.last_renewed_at = record.last_renewed_at;
        }
    }

    /// The entry for gateway lease `lease_id`.
    pub fn get(&self, lease_id: &str) -> Option<&Entry> {
        self.entries.get(lease_id)
    }

    /// The lease `requester` holds (the oldest, should the index know of more than one).
    pub fn by_requester(&self, requester: &str) -> Option<&Entry> {
        self.by_requester
            .get(requester)?
            .iter()
            .find_map(|(_, id)| self.entries.get(id))
    }

    /// The entry for a worker's lease.
    pub fn by_worker_lease(&self, worker_id: &str, worker_lease_id: &str) -> Option<&Entry> {
        self.by_worker_lease
            .get(&key(worker_id, worker_lease_id))
            .and_then(|id| self.entries.get(id))
    }

    /// Forgets every lease of a worker that is gone for good.
    pub fn forget_worker(&mut self, worker_id: &str) {
        for id in self.ids_of(worker_id) {
            self.remove(&id);
        }
        // Its orphans stay: should it come back, they are released, never listed as live. (Only
        // plain tombstones go here, directly: nothing of them is stored.)
        let buried: Vec<(String, String)> = self
            .tombstones_of(worker_id)
            .filter(|(_, t)| !t.orphan)
            .map(|(k, _)| k.clone())
            .collect();
        for k in buried {
            self.tombstones.remove(&k);
        }
        self.applied.remove(worker_id);
        self.early_ends.retain(|e| e.worker_id != worker_id);
    }

    /// Every entry, in no order.
    pub fn entries(&self) -> impl Iterator<Item = &Entry> {
        self.entries.values()
    }

    /// The entries of `worker_id`, oldest grant first.
    pub fn of_worker(&self, worker_id: &str) -> Vec<&Entry> {
        self.by_worker
            .get(worker_id)
            .into_iter()
            .flatten()
            .filter_map(|(_, id)| self.entries.get(id))
            .collect()
    }

    /// How many leases are indexed.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Whether none are.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// How many ended leases are remembered (tombstones and unmatched ends), for the bound tests.
    pub fn remembered(&self) -> (usize, usize) {
        (self.tombstones.len(), self.early_ends.len())
    }
}

/// A snapshot read before a renewal the record already took in keeps the renewal (ADR 0015).
pub(crate) fn keep_newer_renewal(held: &mut LeaseRecord, snapshot: &LeaseRecord) {
    if snapshot.last_renewed_at >= held.last_renewed_at {
        let (deadline, renewed) = (snapshot.ttl_deadline, snapshot.last_renewed_at);
        *held = LeaseRecord {
            ttl_deadline: deadline,
            last_renewed_at: renewed,
            ..snapshot.clone()
        };
    }
}

#[cfg(test)]
mod tests;
