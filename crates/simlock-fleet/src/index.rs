//! The lease index: which worker holds each lease the gateway issued, and for whom.
//!
//! A gateway lease id is `<workerId>.<workerLeaseId>`, or the bare id when the requester chose it.
//! Nothing is persisted: the index is rebuilt from each worker's reported leases (those whose
//! requester carries this gateway's `gw:<id>:` prefix). An entry missing from two snapshots in a
//! row of its worker is dropped, so a lease granted between a snapshot and its answer survives.
//! An end that names no entry is remembered for a while, since its grant may still be on its way.

use std::collections::{HashMap, VecDeque};

use simlock_contract::model::LeaseRecord;

/// One lease the gateway issued.
#[derive(Debug, Clone, PartialEq, Eq)]
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
    /// When it was granted.
    pub granted_at: i64,
    /// Whether the requester chose the id.
    pub chosen: bool,
    pub(crate) misses: u8,
}

/// A worker lease's end, as its event told it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EndedLease {
    /// The worker that held it.
    pub worker_id: String,
    /// The worker's id for it.
    pub worker_lease_id: String,
    /// Its device.
    pub device_id: String,
    /// Why it ended (`expired`, `explicit`, `killed`, `device-lost`).
    pub reason: String,
}

/// How many ends of leases it does not hold the index remembers. Ends of leases that are not
/// this gateway's (a worker's local callers, other gateways) come too: they are the many, and
/// the ones that matter are matched within moments.
pub const ENDS_REMEMBERED: usize = 256;

/// The index.
#[derive(Debug, Default)]
pub struct LeaseIndex {
    prefix: String,
    entries: HashMap<String, Entry>,
    by_requester: HashMap<String, String>,
    by_worker_lease: HashMap<(String, String), String>,
    /// Ends that named no entry, newest last, at most [`ENDS_REMEMBERED`]. A worker answers a
    /// grant and then sends events on one uplink, but the gateway handles the answer in the
    /// forwarding task and the events in the uplink's reader, so a short lease's end can come
    /// before its grant is recorded.
    early_ends: VecDeque<EndedLease>,
}

/// The gateway lease id for a worker's lease.
pub fn gateway_lease_id(worker_id: &str, worker_lease_id: &str, chosen: bool) -> String {
    if chosen {
        worker_lease_id.to_owned()
    } else {
        format!("{worker_id}.{worker_lease_id}")
    }
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

    /// Records a grant.
    pub fn insert(&mut self, entry: Entry) {
        self.remove(&entry.lease_id.clone());
        self.by_requester
            .insert(entry.requester_id.clone(), entry.lease_id.clone());
        self.by_worker_lease.insert(
            (entry.worker_id.clone(), entry.worker_lease_id.clone()),
            entry.lease_id.clone(),
        );
        self.entries
            .insert(entry.lease_id.clone(), Entry { misses: 0, ..entry });
    }

    /// Records a forwarded grant, unless its end already came ([`Self::end_unindexed`]): then
    /// nothing is indexed and that end is returned, once.
    pub fn record_grant(&mut self, entry: Entry) -> Option<EndedLease> {
        let early = self.early_ends.iter().position(|end| {
            end.worker_id == entry.worker_id && end.worker_lease_id == entry.worker_lease_id
        });
        match early.and_then(|at| self.early_ends.remove(at)) {
            Some(end) => Some(end),
            None => {
                self.insert(entry);
                None
            }
        }
    }

    /// Remembers an end that named no entry, in case its grant is still on its way.
    pub fn end_unindexed(&mut self, end: EndedLease) {
        if self.early_ends.len() >= ENDS_REMEMBERED {
            self.early_ends.pop_front();
        }
        self.early_ends.push_back(end);
    }

    /// A new entry for `lease`, reported by `worker_id`, if it is one of this gateway's.
    pub fn entry_for(&self, worker_id: &str, lease: &LeaseRecord) -> Option<Entry> {
        let requester = lease.requester_id.strip_prefix(&self.prefix)?;
        Some(Entry {
            lease_id: gateway_lease_id(worker_id, lease.id.as_str(), lease.id_chosen_by_requester),
            worker_id: worker_id.to_owned(),
            worker_lease_id: lease.id.to_string(),
            requester_id: requester.to_owned(),
            owner_id: lease.owner_id.clone(),
            granted_at: lease.granted_at,
            chosen: lease.id_chosen_by_requester,
            misses: 0,
        })
    }

    /// Folds one snapshot of `worker_id`'s leases in.
    pub fn apply_snapshot(&mut self, worker_id: &str, leases: &[LeaseRecord]) {
        let mut seen = Vec::new();
        for lease in leases {
            if let Some(entry) = self.entry_for(worker_id, lease) {
                seen.push(entry.lease_id.clone());
                match self.entries.get_mut(&entry.lease_id) {
                    Some(existing) => existing.misses = 0,
                    None => self.insert(entry),
                }
            }
        }
        let missing: Vec<String> = self
            .entries
            .values()
            .filter(|e| e.worker_id == worker_id && !seen.contains(&e.lease_id))
            .map(|e| e.lease_id.clone())
            .collect();
        for id in missing {
            let drop_it = self.entries.get_mut(&id).is_some_and(|e| {
                e.misses += 1;
                e.misses >= 2
            });
            if drop_it {
                self.remove(&id);
            }
        }
    }

    /// The entry for gateway lease `lease_id`.
    pub fn get(&self, lease_id: &str) -> Option<&Entry> {
        self.entries.get(lease_id)
    }

    /// The lease `requester` holds.
    pub fn by_requester(&self, requester: &str) -> Option<&Entry> {
        self.by_requester
            .get(requester)
            .and_then(|id| self.entries.get(id))
    }

    /// The entry for a worker's lease.
    pub fn by_worker_lease(&self, worker_id: &str, worker_lease_id: &str) -> Option<&Entry> {
        self.by_worker_lease
            .get(&(worker_id.to_owned(), worker_lease_id.to_owned()))
            .and_then(|id| self.entries.get(id))
    }

    /// Forgets a lease; returns its entry.
    pub fn remove(&mut self, lease_id: &str) -> Option<Entry> {
        let entry = self.entries.remove(lease_id)?;
        if self.by_requester.get(&entry.requester_id) == Some(&entry.lease_id) {
            self.by_requester.remove(&entry.requester_id);
        }
        self.by_worker_lease
            .remove(&(entry.worker_id.clone(), entry.worker_lease_id.clone()));
        Some(entry)
    }

    /// Forgets every lease of a worker that is gone for good.
    pub fn forget_worker(&mut self, worker_id: &str) {
        let ids: Vec<String> = self
            .entries
            .values()
            .filter(|e| e.worker_id == worker_id)
            .map(|e| e.lease_id.clone())
            .collect();
        for id in ids {
            self.remove(&id);
        }
    }

    /// Every entry.
    pub fn entries(&self) -> impl Iterator<Item = &Entry> {
        self.entries.values()
    }

    /// How many leases are indexed.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Whether none are.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use simlock_contract::ids::{DeviceId, LeaseId};

    use super::*;

    fn lease(id: &str, requester: &str) -> LeaseRecord {
        LeaseRecord {
            id: LeaseId::from_raw(id),
            device_id: DeviceId::from_raw("dev_1"),
            requester_id: requester.into(),
            owner_id: "tok_1".into(),
            granted_at: 5,
            ttl_ms: 1000,
            ttl_deadline: 1005,
            last_renewed_at: 5,
            id_chosen_by_requester: false,
            worker: None,
            worker_id: None,
            access: None,
        }
    }

    #[test]
    fn a_rebuild_indexes_only_this_gateways_leases_under_worker_dot_lease() {
        let mut index = LeaseIndex::new("gw:g1:".into());
        index.apply_snapshot(
            "w1",
            &[
                lease("lse_a", "gw:g1:agent"),
                lease("lse_b", "local-agent"),
                lease("lse_c", "gw:g2:x"),
            ],
        );
        assert_eq!(index.len(), 1);
        let entry = index.get("w1.lse_a").unwrap();
        assert_eq!(
            (entry.requester_id.as_str(), entry.owner_id.as_str()),
            ("agent", "tok_1")
        );
        assert_eq!(
            index.by_requester("agent").map(|e| e.lease_id.as_str()),
            Some("w1.lse_a")
        );
        assert_eq!(
            index
                .by_worker_lease("w1", "lse_a")
                .map(|e| e.lease_id.as_str()),
            Some("w1.lse_a")
        );
    }

    #[test]
    fn a_chosen_id_is_kept_bare() {
        let mut index = LeaseIndex::new("gw:g1:".into());
        let mut chosen = lease(
            "0123456789abcdef0123456789abcdef",
            "gw:g1:0123456789abcdef0123456789abcdef",
        );
        chosen.id_chosen_by_requester = true;
        index.apply_snapshot("w1", &[chosen]);
        assert!(index.get("0123456789abcdef0123456789abcdef").is_some());
    }

    #[test]
    fn an_entry_survives_one_missing_snapshot_and_is_dropped_after_two() {
        let mut index = LeaseIndex::new("gw:g1:".into());
        index.apply_snapshot("w1", &[lease("lse_a", "gw:g1:agent")]);
        index.apply_snapshot("w1", &[]);
        assert!(index.get("w1.lse_a").is_some(), "one miss keeps it");
        index.apply_snapshot("w1", &[lease("lse_a", "gw:g1:agent")]);
        index.apply_snapshot("w1", &[]);
        assert!(
            index.get("w1.lse_a").is_some(),
            "a sighting resets the count"
        );
        index.apply_snapshot("w1", &[]);
        assert!(index.get("w1.lse_a").is_none());
        assert!(index.by_requester("agent").is_none());
    }

    #[test]
    fn another_workers_snapshot_does_not_touch_an_entry() {
        let mut index = LeaseIndex::new("gw:g1:".into());
        index.apply_snapshot("w1", &[lease("lse_a", "gw:g1:agent")]);
        index.apply_snapshot("w2", &[]);
        index.apply_snapshot("w2", &[]);
        assert!(index.get("w1.lse_a").is_some());
        index.forget_worker("w1");
        assert!(index.is_empty());
    }

    fn end(worker: &str, lease: &str) -> EndedLease {
        EndedLease {
            worker_id: worker.into(),
            worker_lease_id: lease.into(),
            device_id: "dev_1".into(),
            reason: "expired".into(),
        }
    }

    fn grant(index: &LeaseIndex, worker: &str, lease_id: &str) -> Entry {
        index
            .entry_for(worker, &lease(lease_id, "gw:g1:agent"))
            .unwrap()
    }

    #[test]
    fn a_grant_whose_end_came_first_is_not_indexed_and_gets_the_end_once() {
        let mut index = LeaseIndex::new("gw:g1:".into());
        index.end_unindexed(end("w1", "lse_a"));
        index.end_unindexed(end("w2", "lse_b"));
        let entry = grant(&index, "w1", "lse_a");
        assert_eq!(index.record_grant(entry.clone()), Some(end("w1", "lse_a")));
        assert!(index.is_empty(), "the dead lease is never indexed");
        // The same lease id from another worker is another lease.
        assert_eq!(index.record_grant(grant(&index, "w1", "lse_b")), None);
        assert!(index.get("w1.lse_b").is_some());
        // Matched once: a later grant of the same id is indexed.
        assert_eq!(index.record_grant(entry), None);
        assert!(index.get("w1.lse_a").is_some());
    }

    #[test]
    fn ends_are_remembered_up_to_the_bound_oldest_forgotten_first() {
        let mut index = LeaseIndex::new("gw:g1:".into());
        for n in 0..=ENDS_REMEMBERED {
            index.end_unindexed(end("w1", &format!("lse_{n}")));
        }
        // One past the bound: the oldest went.
        assert_eq!(index.record_grant(grant(&index, "w1", "lse_0")), None);
        assert!(index.get("w1.lse_0").is_some());
        for n in [1, ENDS_REMEMBERED] {
            let id = format!("lse_{n}");
            assert_eq!(
                index.record_grant(grant(&index, "w1", &id)),
                Some(end("w1", &id))
            );
        }
    }
}
