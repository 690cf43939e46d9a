//! A worker that dies without shutting down, and the one that starts on its database.

use std::time::Duration;

use simlock_contract::ErrorCode;
use simlock_contract::model::{DeviceState, Health};
use simlock_contract::ops::{LeaseRenew, LeaseRenewInput};

use super::*;
use crate::RecordState;

#[tokio::test(start_paused = true)]
async fn a_restart_restores_every_lease_expires_overdue_ones_and_fails_open_requests() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("state.db");
    let clock = TokioClock::starting_at(T0).shared();
    let build = |db: Database, start: bool| {
        Harness::build(Build {
            db: Some(db),
            clock: Some(clock.clone()),
            start,
            ..Build::default()
        })
    };

    let first = build(Database::open(&path).unwrap(), true);
    let mut long = ios();
    long.ttl_ms = Some(3_600_000);
    long.idempotency_key = Some("k-kept".into());
    let kept = first.lease("agent-a", long.clone()).await.unwrap();
    // A renewal rewrites the stored row: the restart must find the renewed deadline.
    tokio::time::advance(Duration::from_secs(1)).await;
    let renewed = first
        .call::<LeaseRenew>(
            agent("agent-a"),
            &LeaseRenewInput {
                lease_id: kept.lease.id.to_string(),
                ttl_ms: None,
            },
        )
        .await
        .unwrap();
    assert!(renewed.ttl_deadline > kept.lease.ttl_deadline);
    let mut short = android();
    short.ttl_ms = Some(60_000);
    let overdue = first.lease("agent-b", short).await.unwrap();
    let mut events = first.bus.follow();
    let (open, _pushes) = first.spawn_lease("agent-c", ios());
    next_event(&mut events, "lease.queued").await;
    let open_id = first.worker.waiting()[0].id.clone();

    // kill -9: the call and every handle go, nothing is shut down.
    open.abort();
    let _ = open.await;
    drop(first);

    tokio::time::advance(Duration::from_secs(120)).await;
    let second = build(Database::open(&path).unwrap(), false);
    assert_eq!(
        second
            .worker
            .status(&second.gate, simlock_daemon::Viewer::ADMIN)
            .daemon
            .health,
        Health::Starting
    );
    assert!(
        second
            .worker
            .status(&second.gate, simlock_daemon::Viewer::ADMIN)
            .leases
            .is_none()
    );
    let mut events = second.bus.follow();
    second.worker.start(&second.gate).unwrap();

    // The open request settled failed, as the daemon restarted.
    let rejected = next_event(&mut events, "lease.rejected").await;
    assert_eq!(rejected.payload["reason"], "daemon-restarted");
    assert_eq!(rejected.payload["requestId"], open_id.as_str());
    let record = second.worker.request(&open_id).unwrap();
    assert_eq!(record.state, RecordState::Failed);
    let failure = record.failure.unwrap();
    assert_eq!(failure.code, ErrorCode::Internal);
    assert!(failure.message.contains("restarted"), "{}", failure.message);

    // The overdue lease expires at once, before any time passes.
    let at = second.now();
    let expired = next_event(&mut events, "lease.expired").await;
    assert_eq!(expired.payload["leaseId"], overdue.lease.id.as_str());
    assert_eq!(second.now(), at);

    // The other lease is back, renewed deadline and all, on its leased device.
    let leases = second.worker.leases();
    assert_eq!(leases, vec![renewed.clone()]);
    // Its settled request is back too: an idempotent repeat answers the recorded grant.
    assert_eq!(second.lease("agent-a", long).await.unwrap(), kept);
    let device = second
        .worker
        .devices()
        .into_iter()
        .find(|d| d.id == kept.device.id)
        .unwrap();
    assert_eq!(device.state, DeviceState::Leased);
    assert_eq!(device.driver_device_id, kept.device.driver_device_id);
    // And it expires at that same deadline.
    let expired = next_event(&mut events, "lease.expired").await;
    assert_eq!(expired.payload["leaseId"], kept.lease.id.as_str());
    assert_eq!(second.now(), renewed.ttl_deadline);
}

#[tokio::test(start_paused = true)]
async fn devices_caught_mid_transition_converge_at_start() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("state.db");
    let clock = TokioClock::starting_at(T0).shared();
    let build = |db: Database| {
        Harness::build(Build {
            db: Some(db),
            clock: Some(clock.clone()),
            ..Build::default()
        })
    };
    let first = build(Database::open(&path).unwrap());
    let grant = first.lease("agent-a", ios()).await.unwrap();
    // A second request dies mid-provisioning; the first lease is released mid-reclaim.
    let mut events = first.bus.follow();
    let (provisioning, mut pushes) = first.spawn_lease("agent-b", android());
    next_push(&mut pushes).await;
    first
        .worker
        .release(&agent("agent-a"), grant.lease.id.as_str(), None)
        .unwrap();
    next_event(&mut events, "lease.released").await;
    let states: Vec<DeviceState> = first.worker.devices().iter().map(|d| d.state).collect();
    assert!(states.contains(&DeviceState::Provisioning), "{states:?}");
    assert!(states.contains(&DeviceState::Reclaiming), "{states:?}");
    provisioning.abort();
    let _ = provisioning.await;
    drop(first);

    let second = build(Database::open(&path).unwrap());
    let mut events = second.bus.follow();
    next_event(&mut events, "device.reclaimed").await;
    let devices = second.worker.devices();
    assert_eq!(
        devices.len(),
        1,
        "the half-created device is gone: {devices:?}"
    );
    assert_eq!(devices[0].id, grant.device.id);
    assert_eq!(devices[0].state, DeviceState::Ready);
    assert!(second.worker.leases().is_empty());
    assert_eq!(second.worker.capacity().global.reserved, 0);
}

#[tokio::test(start_paused = true)]
async fn a_decision_that_cannot_be_stored_is_not_announced_and_the_worker_stops_deciding() {
    let db = Database::open_in_memory().unwrap();
    let h = Harness::build(Build {
        db: Some(db.clone()),
        ..Build::default()
    });
    let held = h.lease("agent-a", ios()).await.unwrap();
    let mut events = h.bus.follow();
    let metrics = simlock_daemon::metrics::Metrics::new();
    crate::register_metrics(&metrics, &h.worker);
    assert!(metrics.render().contains("\nsimlock_worker_failed 0\n"));
    // The disk fails under the worker: its lease table is gone.
    db.with(|c| c.execute_batch("DROP TABLE core_leases"))
        .unwrap();
    let err = h.lease("agent-b", android()).await.unwrap_err();
    assert_store_failed(&err);
    assert!(
        err.message.contains("restart the worker"),
        "{}",
        err.message
    );
    let said: Vec<_> = std::iter::from_fn(|| events.try_recv().ok()).collect();
    assert!(
        !said.iter().any(|e| e.event == "lease.granted"),
        "no grant is announced for a decision that is not on disk"
    );
    let failed = said.iter().find(|e| e.event == "daemon.failed");
    assert!(
        failed.is_some_and(|e| e.payload["error"]
            .as_str()
            .is_some_and(|error| error.contains("core_leases"))),
        "the failure is told at once: {said:?}"
    );
    // Every later decision is refused, naming the store, and status says the worker failed.
    let err = h
        .call_raw(
            agent("agent-a"),
            "lease.renew",
            serde_json::json!({"leaseId": held.lease.id}),
        )
        .await
        .unwrap_err();
    assert_store_failed(&err);
    assert_eq!(
        h.worker
            .status(&h.gate, simlock_daemon::Viewer::ADMIN)
            .daemon
            .health,
        Health::Failed
    );
    let text = metrics.render();
    assert!(text.contains("\nsimlock_worker_failed 1\n"), "{text}");
    // Release-all too: it does not answer an empty success as if nothing were held.
    let err = h
        .call_raw(admin("op"), "lease.release-all", serde_json::json!({}))
        .await
        .unwrap_err();
    assert_store_failed(&err);
}

/// A call refused because the worker's state store failed: `INTERNAL`, naming the store.
fn assert_store_failed(err: &ContractError) {
    assert_eq!(err.code, ErrorCode::Internal);
    assert!(
        err.message.contains("state store failed"),
        "{}",
        err.message
    );
}
