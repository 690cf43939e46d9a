//! The request book: every lease request is recorded before it waits, and its outcome kept for
//! `lease.requestRetentionMs` after it settles (idempotent replays, HTTP polls), at most
//! `lease.maxRequestRecords` of them.

use std::collections::{BTreeMap, BTreeSet, HashMap};

use simlock_contract::ContractError;
use simlock_contract::ids::RequestId;
use simlock_contract::model::{LeaseGrant, RequestedDevice};

/// Where a recorded request stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RecordState {
    /// Not settled yet.
    Open,
    /// Granted a lease.
    Granted,
    /// Failed.
    Failed,
    /// Withdrawn with `lease.cancel`.
    Cancelled,
}

impl RecordState {
    /// The stored name.
    pub const fn as_str(self) -> &'static str {
        match self {
            Self::Open => "open",
            Self::Granted => "granted",
            Self::Failed => "failed",
            Self::Cancelled => "cancelled",
        }
    }

    /// The state a stored name stands for.
    pub fn parse(name: &str) -> Option<Self> {
        [Self::Open, Self::Granted, Self::Failed, Self::Cancelled]
            .into_iter()
            .find(|s| s.as_str() == name)
    }
}

/// One recorded request.
#[derive(Debug, Clone, PartialEq)]
pub struct RequestRecord {
    /// Its id.
    pub id: RequestId,
    /// For whom.
    pub requester_id: String,
    /// Who will own the lease.
    pub owner_id: String,
    /// The session principal that asked (idempotent replays must come from it).
    pub principal: String,
    /// Its idempotency key.
    pub idempotency_key: Option<String>,
    /// What makes two requests "the same" for idempotency.
    pub fingerprint: String,
    /// What it asked for.
    pub requested: RequestedDevice,
    /// When it arrived.
    pub created_at: i64,
    /// Where it stands.
    pub state: RecordState,
    /// When it settled.
    pub settled_at: Option<i64>,
    /// Its grant.
    pub grant: Option<LeaseGrant>,
    /// Its failure, as answered.
    pub failure: Option<ContractError>,
}

/// The book.
#[derive(Debug, Default)]
pub(crate) struct RequestBook {
    records: BTreeMap<RequestId, RequestRecord>,
    by_key: HashMap<(String, String), RequestId>,
    /// Settled records, oldest settlement first: pruning takes from the front.
    settled: BTreeSet<(i64, RequestId)>,
}

impl RequestBook {
    pub(crate) fn insert(&mut self, record: RequestRecord) {
        self.forget(&record.id);
        if let Some(key) = &record.idempotency_key {
            self.by_key.insert(
                (record.requester_id.clone(), key.clone()),
                record.id.clone(),
            );
        }
        if let Some(at) = record.settled_at {
            self.settled.insert((at, record.id.clone()));
        }
        self.records.insert(record.id.clone(), record);
    }

    /// Removes a record and what indexes it.
    pub(crate) fn forget(&mut self, id: &RequestId) {
        let Some(record) = self.records.remove(id) else {
            return;
        };
        if let Some(at) = record.settled_at {
            self.settled.remove(&(at, record.id));
        }
        if let Some(key) = record.idempotency_key {
            self.by_key.remove(&(record.requester_id, key));
        }
    }

    pub(crate) fn get(&self, id: &RequestId) -> Option<&RequestRecord> {
        self.records.get(id)
    }

    pub(crate) fn by_key(&self, requester: &str, key: &str) -> Option<&RequestRecord> {
        let id = self.by_key.get(&(requester.to_owned(), key.to_owned()))?;
        self.records.get(id)
    }

    /// Settles an open record. Answers whether it was open.
    pub(crate) fn settle(
        &mut self,
        id: &RequestId,
        outcome: &Result<LeaseGrant, ContractError>,
        state: RecordState,
        now: i64,
    ) -> bool {
        let Some(record) = self.records.get_mut(id) else {
            return false;
        };
        if record.state != RecordState::Open {
            return false;
        }
        record.state = state;
        record.settled_at = Some(now);
        match outcome {
            Ok(grant) => record.grant = Some(grant.clone()),
            Err(e) => record.failure = Some(e.clone()),
        }
        self.settled.insert((now, id.clone()));
        true
    }

    pub(crate) fn open(&self) -> Vec<RequestId> {
        self.records
            .values()
            .filter(|r| r.state == RecordState::Open)
            .map(|r| r.id.clone())
            .collect()
    }

    pub(crate) fn all(&self) -> impl Iterator<Item = &RequestRecord> {
        self.records.values()
    }

    /// When the oldest settled record passes `retention_ms`.
    pub(crate) fn next_expiry(&self, retention_ms: u64) -> Option<i64> {
        let retention = i64::try_from(retention_ms).unwrap_or(i64::MAX);
        self.settled
            .first()
            .map(|(at, _)| at.saturating_add(retention))
    }

    /// Forgets settled records past `retention_ms`, then the oldest settled ones beyond
    /// `max` records in all (open records are never forgotten). Answers the forgotten ids.
    pub(crate) fn prune(&mut self, now: i64, retention_ms: u64, max: usize) -> Vec<RequestId> {
        let retention = i64::try_from(retention_ms).unwrap_or(i64::MAX);
        let mut gone = Vec::new();
        while let Some((at, _)) = self.settled.first() {
            if at.saturating_add(retention) > now && self.records.len() <= max {
                break;
            }
            let Some((_, id)) = self.settled.pop_first() else {
                break;
            };
            self.forget(&id);
            gone.push(id);
        }
        gone
    }
}

#[cfg(test)]
mod tests {
    use simlock_contract::model::Platform;

    use super::*;

    fn record(n: u32, key: Option<&str>) -> RequestRecord {
        RequestRecord {
            id: RequestId::from_raw(format!("req_{n}")),
            requester_id: "agent".into(),
            owner_id: "agent".into(),
            principal: "agent".into(),
            idempotency_key: key.map(str::to_owned),
            fingerprint: String::new(),
            requested: RequestedDevice {
                platform: Platform::Ios,
                model: None,
                os_version: None,
                requires: vec![],
            },
            created_at: 0,
            state: RecordState::Open,
            settled_at: None,
            grant: None,
            failure: None,
        }
    }

    #[test]
    fn settled_records_are_pruned_after_retention_and_beyond_the_cap() {
        let mut book = RequestBook::default();
        for n in 0..4 {
            book.insert(record(n, Some(&format!("k{n}"))));
        }
        let failure = Err(ContractError::internal("x"));
        for n in 0..3 {
            let id = RequestId::from_raw(format!("req_{n}"));
            assert!(book.settle(&id, &failure, RecordState::Failed, i64::from(n) * 10));
            assert!(
                !book.settle(&id, &failure, RecordState::Failed, 99),
                "settles once"
            );
        }
        // Retention 25 ms at t=30: req_0 (settled at 0) goes.
        let gone = book.prune(30, 25, 100);
        assert_eq!(gone, vec![RequestId::from_raw("req_0")]);
        assert!(book.by_key("agent", "k0").is_none());
        // Cap 2: the oldest settled (req_1) goes; the open one stays whatever its age.
        let gone = book.prune(30, 1000, 2);
        assert_eq!(gone, vec![RequestId::from_raw("req_1")]);
        assert!(book.by_key("agent", "k3").is_some());
        assert_eq!(book.open(), vec![RequestId::from_raw("req_3")]);
    }
}
