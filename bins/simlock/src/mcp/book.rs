//! The leases one MCP session holds and how each one stands: plain data and the decisions on it
//! (which lease a tool call means, what changed when a hold ended). The async shell
//! ([`super::session`]) applies them; nothing here waits or talks to a daemon.

use std::collections::VecDeque;

use simlock_contract::model::{LeaseEndReason, LeaseGrant, LeaseRecord};
use simlock_contract::{ContractError, ErrorCode};

/// Leases that ended are kept for `lease_status` and `held_leases`, the newest this many.
pub(crate) const MAX_ENDED: usize = 16;

/// How a lease of the session stands.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Standing {
    /// Held: renewed at a third of its TTL.
    Held,
    /// This session released it.
    Released,
    /// The daemon ended it; the reason when a `lease-lost` push said one.
    Lost(Option<LeaseEndReason>),
    /// Renewing it failed for good; it may live on until its TTL passes.
    Failed(ContractError),
}

impl Standing {
    /// Whether the lease is still held.
    pub(crate) const fn is_held(&self) -> bool {
        matches!(self, Self::Held)
    }

    /// The standing's name on the wire of the tools (`held`, `released`, `lost`, `failed`).
    pub(crate) const fn name(&self) -> &'static str {
        match self {
            Self::Held => "held",
            Self::Released => "released",
            Self::Lost(_) => "lost",
            Self::Failed(_) => "failed",
        }
    }

    /// Why a lease that is no longer held ended, in a sentence part.
    pub(crate) fn why(&self) -> String {
        match self {
            Self::Held => "it is held".to_owned(),
            Self::Released => "this session released it".to_owned(),
            Self::Lost(Some(LeaseEndReason::Killed)) => "an operator released it".to_owned(),
            Self::Lost(Some(LeaseEndReason::Expired)) => {
                "its TTL passed without a renewal".to_owned()
            }
            Self::Lost(Some(LeaseEndReason::DeviceLost)) => "its device was lost".to_owned(),
            Self::Lost(Some(LeaseEndReason::Explicit)) => {
                "it was released outside this session".to_owned()
            }
            Self::Lost(None) => "the daemon no longer knows it".to_owned(),
            Self::Failed(e) => format!("renewing it failed: {} ({})", e.message, e.code),
        }
    }
}

/// One lease of the session.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Entry {
    /// The grant, as the daemon answered it.
    pub(crate) grant: LeaseGrant,
    /// How it stands.
    pub(crate) standing: Standing,
}

impl Entry {
    /// The lease's id.
    pub(crate) fn lease_id(&self) -> &str {
        self.grant.lease.id.as_str()
    }
}

/// The session's leases, oldest first.
#[derive(Debug, Default)]
pub(crate) struct LeaseBook {
    entries: VecDeque<Entry>,
}

impl LeaseBook {
    /// Records a granted lease as held (a lease the book already has starts again as held).
    pub(crate) fn hold(&mut self, grant: LeaseGrant) {
        self.entries
            .retain(|e| e.lease_id() != grant.lease.id.as_str());
        self.entries.push_back(Entry {
            grant,
            standing: Standing::Held,
        });
        self.trim();
    }

    /// Records a held lease's record as the daemon answered a renewal (after connecting again).
    pub(crate) fn renewed(&mut self, record: &LeaseRecord) {
        if let Some(entry) = self
            .entries
            .iter_mut()
            .find(|e| e.lease_id() == record.id.as_str() && e.standing.is_held())
        {
            entry.grant.lease = record.clone();
        }
    }

    /// Records how a held lease ended. Answers the entry when it was held until now (the change
    /// to tell the client about); a lease that already ended, or is unknown, keeps its standing.
    pub(crate) fn settle(&mut self, lease_id: &str, standing: Standing) -> Option<Entry> {
        let entry = self
            .entries
            .iter_mut()
            .find(|e| e.lease_id() == lease_id && e.standing.is_held())?;
        entry.standing = standing;
        let settled = entry.clone();
        self.trim();
        Some(settled)
    }

    /// Drops the oldest ended entries past [`MAX_ENDED`]; held ones are always kept.
    fn trim(&mut self) {
        let mut ended = self
            .entries
            .iter()
            .filter(|e| !e.standing.is_held())
            .count();
        self.entries.retain(|e| {
            if ended > MAX_ENDED && !e.standing.is_held() {
                ended -= 1;
                false
            } else {
                true
            }
        });
    }

    /// Every entry, oldest first.
    pub(crate) fn entries(&self) -> impl Iterator<Item = &Entry> {
        self.entries.iter()
    }

    /// The held entries, oldest first.
    pub(crate) fn held(&self) -> impl Iterator<Item = &Entry> {
        self.entries.iter().filter(|e| e.standing.is_held())
    }

    /// The lease a call means: the one named, or the one the session holds.
    ///
    /// # Errors
    /// `UNKNOWN_LEASE` when the named lease is not this session's or the session holds none;
    /// `BAD_REQUEST` when none is named and the session holds several.
    pub(crate) fn pick(&self, lease_id: Option<&str>) -> Result<&Entry, ContractError> {
        if let Some(id) = lease_id {
            return self
                .entries
                .iter()
                .rev()
                .find(|e| e.lease_id() == id)
                .ok_or_else(|| {
                    ContractError::new(
                        ErrorCode::UnknownLease,
                        format!("Lease {id} is not one of this session's leases"),
                    )
                });
        }
        let held: Vec<&Entry> = self.held().collect();
        match held.as_slice() {
            [one] => Ok(one),
            [] => self.entries.back().ok_or_else(|| {
                ContractError::new(ErrorCode::UnknownLease, "This session holds no lease")
            }),
            several => Err(ContractError::new(
                ErrorCode::BadRequest,
                format!(
                    "This session holds {} leases ({}); name one with leaseId",
                    several.len(),
                    several
                        .iter()
                        .map(|e| e.lease_id())
                        .collect::<Vec<_>>()
                        .join(", ")
                ),
            )),
        }
    }

    /// Like [`Self::pick`], for a lease that must still be held.
    ///
    /// # Errors
    /// As [`Self::pick`]; `UNKNOWN_LEASE` saying why when the lease already ended.
    pub(crate) fn pick_held(&self, lease_id: Option<&str>) -> Result<&Entry, ContractError> {
        let entry = self.pick(lease_id)?;
        if entry.standing.is_held() {
            return Ok(entry);
        }
        Err(ContractError::new(
            ErrorCode::UnknownLease,
            format!(
                "Lease {} already ended: {}",
                entry.lease_id(),
                entry.standing.why()
            ),
        ))
    }
}

#[cfg(test)]
mod tests {
    use simlock_contract::ids::{DeviceId, LeaseId};
    use simlock_contract::model::{DeviceSpec, GrantDevice, GrantTiming, Platform};

    use super::*;

    fn grant(id: &str) -> LeaseGrant {
        LeaseGrant {
            device: GrantDevice {
                id: DeviceId::from_raw(format!("dev_{id}")),
                driver_device_id: format!("UDID-{id}"),
                spec: DeviceSpec {
                    platform: Platform::Ios,
                    model: "iPhone 16".into(),
                    os_version: "18.2".into(),
                },
                address: None,
                access: None,
            },
            environment: std::collections::BTreeMap::new(),
            lease: LeaseRecord {
                id: LeaseId::from_raw(id),
                device_id: DeviceId::from_raw(format!("dev_{id}")),
                requester_id: "claude-code:s1".into(),
                owner_id: "me".into(),
                granted_at: 0,
                ttl_ms: 900_000,
                ttl_deadline: 900_000,
                last_renewed_at: 0,
                access: None,
                id_chosen_by_requester: false,
                worker: None,
                worker_id: None,
            },
            timing: GrantTiming::default(),
        }
    }

    #[test]
    fn the_one_held_lease_is_the_default() {
        let mut book = LeaseBook::default();
        book.hold(grant("lse_a"));
        assert_eq!(book.pick(None).unwrap().lease_id(), "lse_a");
        assert_eq!(book.pick_held(None).unwrap().lease_id(), "lse_a");
        assert_eq!(book.pick(Some("lse_a")).unwrap().lease_id(), "lse_a");
    }

    #[test]
    fn an_empty_book_holds_no_lease() {
        let book = LeaseBook::default();
        let err = book.pick(None).unwrap_err();
        assert_eq!(err.code, ErrorCode::UnknownLease);
        assert_eq!(err.message, "This session holds no lease");
        let err = book.pick_held(Some("lse_x")).unwrap_err();
        assert_eq!(err.code, ErrorCode::UnknownLease);
        assert_eq!(
            err.message,
            "Lease lse_x is not one of this session's leases"
        );
    }

    #[test]
    fn several_held_leases_must_be_named() {
        let mut book = LeaseBook::default();
        book.hold(grant("lse_a"));
        book.hold(grant("lse_b"));
        let err = book.pick(None).unwrap_err();
        assert_eq!(err.code, ErrorCode::BadRequest);
        assert_eq!(
            err.message,
            "This session holds 2 leases (lse_a, lse_b); name one with leaseId"
        );
        assert_eq!(book.pick(Some("lse_b")).unwrap().lease_id(), "lse_b");
    }

    #[test]
    fn a_lease_the_daemon_ended_is_settled_once_and_says_why() {
        let mut book = LeaseBook::default();
        book.hold(grant("lse_a"));
        let settled = book
            .settle("lse_a", Standing::Lost(Some(LeaseEndReason::Killed)))
            .unwrap();
        assert_eq!(
            settled.standing,
            Standing::Lost(Some(LeaseEndReason::Killed))
        );
        // A second end (the release that raced it) changes nothing and tells nothing.
        assert_eq!(book.settle("lse_a", Standing::Released), None);
        assert_eq!(book.settle("lse_unknown", Standing::Released), None);
        // Still the default, for lease_status; not holdable.
        assert_eq!(book.pick(None).unwrap().lease_id(), "lse_a");
        let err = book.pick_held(None).unwrap_err();
        assert_eq!(err.code, ErrorCode::UnknownLease);
        assert_eq!(
            err.message,
            "Lease lse_a already ended: an operator released it"
        );
        assert_eq!(book.held().count(), 0);
    }

    #[test]
    fn every_way_of_ending_says_why() {
        let failed = Standing::Failed(ContractError::new(
            ErrorCode::DaemonConnectionLost,
            "The connection to the daemon was lost",
        ));
        for (standing, why) in [
            (Standing::Released, "this session released it"),
            (
                Standing::Lost(Some(LeaseEndReason::Expired)),
                "its TTL passed without a renewal",
            ),
            (
                Standing::Lost(Some(LeaseEndReason::DeviceLost)),
                "its device was lost",
            ),
            (
                Standing::Lost(Some(LeaseEndReason::Explicit)),
                "it was released outside this session",
            ),
            (Standing::Lost(None), "the daemon no longer knows it"),
            (
                failed,
                "renewing it failed: The connection to the daemon was lost (DAEMON_CONNECTION_LOST)",
            ),
        ] {
            assert_eq!(standing.why(), why);
            assert!(!standing.is_held());
        }
    }

    #[test]
    fn a_renewal_after_connecting_again_updates_a_held_lease_only() {
        let mut book = LeaseBook::default();
        book.hold(grant("lse_a"));
        book.hold(grant("lse_b"));
        let mut record = grant("lse_a").lease;
        record.ttl_deadline = 1_800_000;
        book.renewed(&record);
        let a = book.pick(Some("lse_a")).unwrap();
        assert_eq!(a.grant.lease.ttl_deadline, 1_800_000);
        assert!(a.standing.is_held());
        // The order and the other lease are as they were.
        let ids: Vec<&str> = book.entries().map(Entry::lease_id).collect();
        assert_eq!(ids, ["lse_a", "lse_b"]);
        // A lease that ended keeps its last record.
        book.settle("lse_b", Standing::Released);
        let mut late = grant("lse_b").lease;
        late.ttl_deadline = 5;
        book.renewed(&late);
        assert_eq!(
            book.pick(Some("lse_b")).unwrap().grant.lease.ttl_deadline,
            900_000
        );
    }

    #[test]
    fn ended_leases_are_kept_up_to_the_bound_and_held_ones_always() {
        let mut book = LeaseBook::default();
        book.hold(grant("lse_held"));
        for n in 0..=MAX_ENDED {
            let id = format!("lse_{n}");
            book.hold(grant(&id));
            assert!(book.settle(&id, Standing::Released).is_some());
        }
        // One past the bound: the oldest ended one is gone, the held one stays.
        let ids: Vec<&str> = book.entries().map(Entry::lease_id).collect();
        assert_eq!(ids.len(), MAX_ENDED + 1);
        assert_eq!(ids[0], "lse_held");
        assert!(!ids.contains(&"lse_0"));
        assert!(ids.contains(&"lse_1"));
        assert_eq!(book.pick(None).unwrap().lease_id(), "lse_held");
    }
}
