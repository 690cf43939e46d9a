//! The lease index: rebuilds from views, grants racing their ends, and stale views.

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

fn mine(id: &str) -> LeaseRecord {
    lease(id, "gw:g1:agent")
}

fn index() -> LeaseIndex {
    LeaseIndex::new("gw:g1:".into())
}

fn grant(index: &LeaseIndex, worker: &str, lease_id: &str, at: Stamp) -> Entry {
    index.entry_for(worker, &mine(lease_id), at).unwrap()
}

fn end(worker: &str, lease: &str) -> EndedLease {
    EndedLease {
        worker_id: worker.into(),
        worker_lease_id: lease.into(),
        device_id: DeviceId::from_raw("dev_1"),
        reason: LeaseEndReason::Expired,
        heard_at: 10,
    }
}

#[test]
fn a_rebuild_indexes_only_this_gateways_leases_under_worker_dot_lease() {
    let mut index = index();
    index.apply_snapshot(
        "w1",
        &[
            mine("lse_a"),
            lease("lse_b", "local-agent"),
            lease("lse_c", "gw:g2:x"),
        ],
        1,
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
    assert_eq!(worker_of("w1.lse_a"), Some("w1"));
    assert_eq!(
        worker_of("0123456789abcdef"),
        None,
        "a chosen id names no worker"
    );
}

#[test]
fn a_chosen_id_is_kept_bare() {
    let mut index = index();
    let mut chosen = lease(
        "0123456789abcdef0123456789abcdef",
        "gw:g1:0123456789abcdef0123456789abcdef",
    );
    chosen.id_chosen_by_requester = true;
    index.apply_snapshot("w1", &[chosen], 1);
    assert!(index.get("0123456789abcdef0123456789abcdef").is_some());
}

#[test]
fn a_snapshot_asked_after_the_gateway_knew_a_lease_and_missing_it_ends_it() {
    let mut index = index();
    index.apply_snapshot("w1", &[mine("lse_a")], 1);
    let ended = index.apply_snapshot("w1", &[], 2);
    assert_eq!(ended.len(), 1, "the worker's word: it no longer holds it");
    assert!(index.get("w1.lse_a").is_none());
    assert!(index.by_requester("agent").is_none());
}

#[test]
fn a_snapshot_asked_before_a_grant_was_answered_does_not_end_it() {
    let mut index = index();
    // The view read goes out at 1, the grant is answered at 2, the read comes back at 3
    // without the lease.
    let entry = grant(&index, "w1", "lse_a", 2);
    assert_eq!(index.record_grant(entry), Recorded::Indexed);
    assert!(index.apply_snapshot("w1", &[], 1).is_empty());
    assert!(
        index.get("w1.lse_a").is_some(),
        "a read older than the grant"
    );
    assert_eq!(index.apply_snapshot("w1", &[], 3).len(), 1);
}

#[test]
fn a_view_read_before_a_release_never_brings_the_lease_back() {
    let mut index = index();
    assert_eq!(
        index.record_grant(grant(&index, "w1", "lse_a", 1)),
        Recorded::Indexed
    );
    // A read goes out at 2 (the worker still holds it), the release is answered at 3.
    assert!(index.end("w1", "lse_a", 3).is_some());
    assert!(index.apply_snapshot("w1", &[mine("lse_a")], 2).is_empty());
    assert!(
        index.get("w1.lse_a").is_none(),
        "the stale read does not revive it"
    );
    assert!(index.by_requester("agent").is_none());
    assert!(index.ended("w1", "lse_a"));
    // A read asked after the end settles it: the tombstone goes.
    index.apply_snapshot("w1", &[], 4);
    assert_eq!(index.remembered(), (0, 0));
}

#[test]
fn an_older_snapshot_than_one_applied_changes_nothing() {
    let mut index = index();
    index.apply_snapshot("w1", &[], 5);
    index.apply_snapshot("w1", &[mine("lse_a")], 4);
    assert!(index.is_empty());
}

#[test]
fn a_chosen_id_granted_again_is_a_new_lease() {
    let mut index = index();
    assert_eq!(
        index.record_grant(grant(&index, "w1", "lse_a", 1)),
        Recorded::Indexed
    );
    index.end("w1", "lse_a", 2);
    let mut again = grant(&index, "w1", "lse_a", 3);
    again.record.granted_at = 50;
    assert_eq!(index.record_grant(again), Recorded::Indexed);
    assert!(index.get("w1.lse_a").is_some());
}

#[test]
fn another_workers_snapshot_does_not_touch_an_entry() {
    let mut index = index();
    index.apply_snapshot("w1", &[mine("lse_a")], 1);
    index.apply_snapshot("w2", &[], 2);
    index.apply_snapshot("w2", &[], 3);
    assert!(index.get("w1.lse_a").is_some());
    index.forget_worker("w1");
    assert!(index.is_empty());
}

#[test]
fn a_grant_whose_end_came_first_is_not_indexed_and_gets_the_end_once() {
    let mut index = index();
    index.end_unmatched(end("w1", "lse_a"));
    index.end_unmatched(end("w2", "lse_b"));
    let entry = grant(&index, "w1", "lse_a", 1);
    assert_eq!(
        index.record_grant(entry.clone()),
        Recorded::EndedFirst(end("w1", "lse_a"))
    );
    assert!(index.is_empty(), "the dead lease is never indexed");
    assert_eq!(
        index.record_grant(entry),
        Recorded::AlreadyEnded,
        "its end is told once"
    );
    assert!(
        index.apply_snapshot("w1", &[mine("lse_a")], 0).is_empty() && index.is_empty(),
        "nor brought back by a view read before"
    );
    // The same lease id from another worker is another lease.
    assert_eq!(
        index.record_grant(grant(&index, "w1", "lse_b", 2)),
        Recorded::Indexed
    );
    assert!(index.get("w1.lse_b").is_some());
}

#[test]
fn a_grant_whose_lease_a_snapshot_saw_end_is_not_indexed() {
    let mut index = index();
    // A read shows the lease before its answer came, then its end comes, then the answer.
    index.apply_snapshot("w1", &[mine("lse_a")], 1);
    assert!(index.end("w1", "lse_a", 2).is_some());
    assert_eq!(
        index.record_grant(grant(&index, "w1", "lse_a", 3)),
        Recorded::AlreadyEnded
    );
    assert!(index.is_empty());
}

#[test]
fn ends_are_remembered_up_to_the_bound_oldest_forgotten_first() {
    let mut index = index();
    for n in 0..=ENDS_REMEMBERED {
        index.end_unmatched(end("w1", &format!("lse_{n}")));
    }
    assert_eq!(index.remembered().1, ENDS_REMEMBERED);
    // One past the bound: the oldest went.
    assert_eq!(
        index.record_grant(grant(&index, "w1", "lse_0", 1)),
        Recorded::Indexed
    );
    assert!(index.get("w1.lse_0").is_some());
    for n in [1, ENDS_REMEMBERED] {
        let id = format!("lse_{n}");
        assert_eq!(
            index.record_grant(grant(&index, "w1", &id, 2)),
            Recorded::EndedFirst(end("w1", &id))
        );
    }
}

#[test]
fn an_orphan_is_never_indexed_until_its_worker_answered_its_release() {
    let mut index = index();
    index.orphan("w1", &mine("lse_a"), 1, 10_000);
    assert!(index.apply_snapshot("w1", &[mine("lse_a")], 2).is_empty());
    assert!(index.is_empty(), "still held while its release is out");
    assert_eq!(index.orphans_of("w1"), ["lse_a"]);
    index.orphan_released("w1", "lse_a", 3);
    assert!(index.orphans_of("w1").is_empty());
    assert!(
        index.apply_snapshot("w1", &[mine("lse_a")], 2).is_empty() && index.is_empty(),
        "a read from before the release"
    );
}

/// An orphan is stored while it is released, and settled when its worker answers or when it
/// has ended on its worker whatever happened (its worker never came back); forgetting its
/// worker keeps it.
#[test]
fn an_orphan_is_stored_until_released_or_expired_and_outlives_its_worker_being_forgotten() {
    let mut index = index();
    index.orphan("w1", &mine("lse_a"), 1, 10_000);
    index.orphan("w1", &mine("lse_b"), 1, 20_000);
    let kept: Vec<_> = index.take_store_changes();
    assert_eq!(kept.len(), 2, "{kept:?}");
    assert!(
        matches!(&kept[0], StoreChange::Kept(o) if o.worker_lease_id == "lse_a" && o.expires_at == 10_000)
    );
    index.forget_worker("w1");
    assert_eq!(index.orphans_of("w1"), ["lse_a", "lse_b"]);
    assert!(index.take_store_changes().is_empty());
    index.expire(9_999);
    assert!(index.take_store_changes().is_empty());
    index.expire(10_000);
    assert_eq!(
        index.take_store_changes(),
        [StoreChange::Settled("w1".into(), "lse_a".into())]
    );
    index.orphan_released("w1", "lse_b", 3);
    assert_eq!(
        index.take_store_changes(),
        [StoreChange::Settled("w1".into(), "lse_b".into())]
    );
    assert!(index.orphans_of("w1").is_empty());
}

#[test]
fn a_renewal_moves_the_deadline_forward_only() {
    let mut index = index();
    index.record_grant(grant(&index, "w1", "lse_a", 1));
    let renewal = |deadline, ttl_ms, at| Renewal {
        deadline,
        ttl_ms,
        at,
    };
    index.renewed("w1", "lse_a", renewal(2000, Some(1950), 50));
    index.renewed("w1", "lse_a", renewal(1500, Some(10), 40));
    let record = &index.get("w1.lse_a").unwrap().record;
    assert_eq!(
        (record.ttl_deadline, record.last_renewed_at, record.ttl_ms),
        (2000, 50, 1950),
        "the newer renewal, its width with it"
    );
    // A snapshot read before the renewal keeps it.
    index.apply_snapshot("w1", &[mine("lse_a")], 2);
    let record = &index.get("w1.lse_a").unwrap().record;
    assert_eq!(record.ttl_deadline, 2000);
    index.renewed("w1", "lse_a", renewal(2100, None, 60));
    let record = &index.get("w1.lse_a").unwrap().record;
    assert_eq!(
        (record.ttl_deadline, record.ttl_ms),
        (2100, 1950),
        "a renewal that tells no width (an older worker's) keeps the one held"
    );
}

#[test]
fn a_view_read_older_than_an_unmatched_end_does_not_index_its_lease() {
    let mut index = index();
    // The end is heard at 10; a read sent at 5 lists the lease; then the grant's answer comes.
    index.end_unmatched(end("w1", "lse_a"));
    assert!(index.apply_snapshot("w1", &[mine("lse_a")], 5).is_empty());
    assert!(index.is_empty(), "the read is older than the end");
    assert_eq!(
        index.record_grant(grant(&index, "w1", "lse_a", 11)),
        Recorded::EndedFirst(end("w1", "lse_a"))
    );
    assert!(index.is_empty());
}

#[test]
fn an_entry_that_leaves_the_index_is_told_once_and_a_newer_record_of_it_is_not_a_removal() {
    let mut index = index();
    let entry = grant(&index, "w1", "lse_a", 1);
    assert_eq!(index.record_grant(entry), Recorded::Indexed);
    // A snapshot listing it again replaces the entry with a newer record: nothing left.
    index.apply_snapshot("w1", &[mine("lse_a")], 2);
    assert!(
        index.take_dropped().is_empty(),
        "a replacement is no removal"
    );
    assert!(index.end("w1", "lse_a", 3).is_some());
    assert_eq!(index.take_dropped(), vec!["w1.lse_a".to_owned()]);
    assert!(index.take_dropped().is_empty(), "told once");
    // A snapshot missing a lease the gateway knew ends it, and that is told too.
    let entry = grant(&index, "w1", "lse_b", 4);
    index.record_grant(entry);
    index.apply_snapshot("w1", &[], 5);
    assert_eq!(index.take_dropped(), vec!["w1.lse_b".to_owned()]);
}
