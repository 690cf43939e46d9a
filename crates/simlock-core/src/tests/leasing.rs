//! Leases through the pipeline: grants, capacity, the FIFO queue, expiry, renewal, the
//! one-lease rule, idempotency, chosen ids, owners, capabilities and cancellation.

use std::time::Duration;

use serde_json::json;
use simlock_contract::model::{CapabilityStatus, DeviceState, LeaseEndReason};
use simlock_contract::ops::Empty;
use simlock_contract::ops::{
    CancelResult, LeaseCancel, LeaseCancelInput, LeaseIdInput, LeaseList, LeaseRelease,
    LeaseReleaseAll, LeaseRenew, LeaseRenewInput,
};
use simlock_contract::push::{Progress, WaitingFor};
use simlock_contract::{ErrorCode, Push};

use super::*;

#[tokio::test(start_paused = true)]
async fn two_requesters_get_two_devices_and_a_third_no_wait_is_refused() {
    let h = Harness::new();
    let mut events = h.bus.follow();
    let (ctx, mut pushes) = agent_with_pushes("agent-a");
    let started = h.now();
    let a = h.call::<LeaseRequest>(ctx, &ios()).await.unwrap();
    // A new device: provisioning then booting, each with its ETA, in that order.
    assert_eq!(
        next_push(&mut pushes).await,
        Push::Progress {
            request_id: 0.into(),
            progress: Progress::Provisioning { eta_ms: 1_500 }
        }
    );
    assert_eq!(
        next_push(&mut pushes).await,
        Push::Progress {
            request_id: 0.into(),
            progress: Progress::Booting { eta_ms: 1_000 }
        }
    );
    assert_eq!(
        h.now() - started,
        2_500,
        "provisionMs + bootMs of virtual time"
    );
    assert_eq!(a.timing.estimated_ready_ms, 2_500);
    let granted = next_event(&mut events, "lease.granted").await;
    assert_eq!(granted.payload["source"], "provisioned");
    assert_eq!(granted.payload["requester"], "agent-a");

    let b = h.lease("agent-b", ios()).await.unwrap();
    assert_ne!(a.device.id, b.device.id);
    assert_ne!(a.lease.id, b.lease.id);
    assert_eq!(a.lease.owner_id, "agent-a");
    assert_eq!(a.lease.requester_id, "agent-a");
    assert_eq!(a.lease.ttl_ms, 900_000, "lease.defaultTtlMs");
    assert_eq!(a.lease.ttl_deadline, a.lease.granted_at + 900_000);
    assert_eq!(
        a.environment["SIMLOCK_DEVICE_UDID"],
        a.device.driver_device_id
    );
    assert_eq!(h.worker.capacity().global.running, 2);

    let mut no_wait = ios();
    no_wait.no_wait = Some(true);
    let err = h.lease("agent-c", no_wait).await.unwrap_err();
    assert_eq!(err.code, ErrorCode::NoCapacity);
    let rejected = next_event(&mut events, "lease.rejected").await;
    assert_eq!(rejected.payload["reason"], "no-wait");
    assert!(h.worker.waiting().is_empty(), "noWait never queues");
}

#[tokio::test(start_paused = true)]
async fn waiting_requests_are_granted_in_fifo_order_as_devices_free() {
    let h = Harness::new();
    let mut events = h.bus.follow();
    let a = h.lease("agent-a", ios()).await.unwrap();
    let b = h.lease("agent-b", ios()).await.unwrap();

    let (c, mut c_pushes) = h.spawn_lease("agent-c", ios());
    assert_eq!(
        next_push(&mut c_pushes).await,
        Push::Progress {
            request_id: 0.into(),
            progress: Progress::Queued {
                queue_position: 1,
                waiting_for: Some(WaitingFor::Capacity)
            }
        }
    );
    let (d, mut d_pushes) = h.spawn_lease("agent-d", ios());
    assert_eq!(
        next_push(&mut d_pushes).await,
        Push::Progress {
            request_id: 0.into(),
            progress: Progress::Queued {
                queue_position: 2,
                waiting_for: Some(WaitingFor::Capacity)
            }
        }
    );
    assert_eq!(
        next_event(&mut events, "queue.changed").await.payload["depth"],
        1
    );
    assert_eq!(
        next_event(&mut events, "queue.changed").await.payload["depth"],
        2
    );
    let waiting = h.worker.waiting();
    assert_eq!(
        waiting
            .iter()
            .map(|w| (w.requester_id.as_str(), w.queue_position))
            .collect::<Vec<_>>(),
        [("agent-c", Some(1)), ("agent-d", Some(2))]
    );
    // With others waiting, a noWait request is refused even before capacity is checked.
    let mut no_wait = android();
    no_wait.no_wait = Some(true);
    assert_eq!(
        h.lease("agent-e", no_wait).await.unwrap_err().code,
        ErrorCode::NoCapacity
    );

    // The first freed device goes to the oldest waiter, after its reclaim.
    h.call::<LeaseRelease>(
        agent("agent-a"),
        &LeaseIdInput {
            reason: None,
            lease_id: a.lease.id.to_string(),
        },
    )
    .await
    .unwrap();
    assert_eq!(
        next_push(&mut c_pushes).await,
        Push::Progress {
            request_id: 0.into(),
            progress: Progress::Reclaiming { eta_ms: 500 }
        }
    );
    let c = within(Duration::from_secs(60), c).await.unwrap().unwrap();
    assert_eq!(c.device.id, a.device.id, "the released device, reclaimed");
    assert_eq!(c.lease.requester_id, "agent-c");
    let granted =
        next_event_where(&mut events, "lease.granted", "requester", &json!("agent-c")).await;
    assert_eq!(granted.payload["source"], "warm");
    assert!(!d.is_finished(), "the second waiter still waits");
    assert_eq!(h.worker.waiting()[0].queue_position, Some(1));
    // The second waiter is told its new place once the one ahead of it left the queue.
    assert_eq!(
        next_push(&mut d_pushes).await,
        Push::Progress {
            request_id: 0.into(),
            progress: Progress::Queued {
                queue_position: 1,
                waiting_for: Some(WaitingFor::Capacity)
            }
        }
    );

    h.call::<LeaseRelease>(
        agent("agent-b"),
        &LeaseIdInput {
            reason: None,
            lease_id: b.lease.id.to_string(),
        },
    )
    .await
    .unwrap();
    let d = within(Duration::from_secs(60), d).await.unwrap().unwrap();
    assert_eq!(d.device.id, b.device.id);
    assert!(h.worker.waiting().is_empty());
}

#[tokio::test(start_paused = true)]
async fn a_request_that_waits_past_its_timeout_fails_with_queue_timeout() {
    let h = Harness::new();
    let mut events = h.bus.follow();
    h.lease("agent-a", ios()).await.unwrap();
    h.lease("agent-b", ios()).await.unwrap();
    let mut input = ios();
    input.timeout_ms = Some(5_000);
    let queued_at = h.now();
    let err = h.lease("agent-c", input).await.unwrap_err();
    assert_eq!(err.code, ErrorCode::QueueTimeout);
    assert_eq!(
        h.now() - queued_at,
        5_000,
        "the deadline is timeoutMs after queueing"
    );
    let request_id = err.details.as_ref().unwrap()["requestId"].clone();
    assert!(request_id.as_str().unwrap().starts_with("req_"));
    let rejected = next_event(&mut events, "lease.rejected").await;
    assert_eq!(rejected.payload["reason"], "timeout");
    assert_eq!(rejected.payload["requestId"], request_id);
    assert!(h.worker.waiting().is_empty());
    // The requester may ask again: its failed request no longer counts.
    let (task, _pushes) = h.spawn_lease("agent-c", ios());
    next_event(&mut events, "lease.queued").await;
    task.abort();
}

#[tokio::test(start_paused = true)]
async fn an_expired_lease_tells_its_owner_and_its_device_is_reclaimed() {
    let h = Harness::new();
    let mut events = h.bus.follow();
    let mut notices = h.presence.follow();
    let mut input = ios();
    input.ttl_ms = Some(60_000);
    let grant = h.lease("agent-a", input).await.unwrap();
    let expired = next_event(&mut events, "lease.expired").await;
    assert_eq!(
        h.now(),
        grant.lease.ttl_deadline,
        "expires exactly at its deadline"
    );
    assert_eq!(
        expired.payload,
        json!({
            "leaseId": grant.lease.id,
            "deviceId": grant.device.id,
            "ownerId": "agent-a",
        })
    );
    let notice = next_notice(&mut notices).await;
    assert_eq!(notice.owner, "agent-a");
    assert_eq!(
        notice.push,
        Push::LeaseLost {
            lease_id: grant.lease.id.to_string(),
            device_id: grant.device.id.clone(),
            reason: LeaseEndReason::Expired,
        }
    );
    assert!(h.worker.leases().is_empty());
    assert_eq!(h.worker.devices()[0].state, DeviceState::Reclaiming);
    next_event(&mut events, "device.reclaimed").await;
    let device = &h.worker.devices()[0];
    assert_eq!(device.state, DeviceState::Ready);
    assert_eq!(device.last_lease_ended_at, Some(grant.lease.ttl_deadline));
    // Renewing the expired lease: it is gone.
    let err = h
        .call::<LeaseRenew>(
            agent("agent-a"),
            &LeaseRenewInput {
                lease_id: grant.lease.id.to_string(),
                ttl_ms: None,
            },
        )
        .await
        .unwrap_err();
    assert_eq!(err.code, ErrorCode::UnknownLease);
}

#[tokio::test(start_paused = true)]
async fn ttl_above_the_cap_is_refused_and_renewal_keeps_the_stored_width() {
    let h = Harness::new();
    let max = h.worker.lease_limits().max_ttl_ms;
    let mut input = ios();
    input.ttl_ms = Some(max + 1);
    let err = h.lease("agent-a", input).await.unwrap_err();
    assert_eq!(err.code, ErrorCode::BadRequest);
    assert!(err.message.contains("ttlMs"), "{}", err.message);
    assert!(h.worker.requests().is_empty(), "nothing recorded");

    let mut input = ios();
    input.ttl_ms = Some(max);
    let grant = h.lease("agent-a", input).await.unwrap();
    assert_eq!(
        grant.lease.ttl_ms, max,
        "exactly the cap is fine, not clamped"
    );

    let renew = |ttl_ms| LeaseRenewInput {
        lease_id: grant.lease.id.to_string(),
        ttl_ms,
    };
    let err = h
        .call::<LeaseRenew>(agent("agent-a"), &renew(Some(max + 1)))
        .await
        .unwrap_err();
    assert_eq!(err.code, ErrorCode::BadRequest);
    assert!(err.message.contains("ttlMs"), "{}", err.message);
    assert_eq!(
        h.worker.leases()[0],
        grant.lease,
        "a refused renewal changes nothing"
    );

    tokio::time::advance(Duration::from_secs(10)).await;
    let renewed = h
        .call::<LeaseRenew>(agent("agent-a"), &renew(None))
        .await
        .unwrap();
    assert_eq!(renewed.ttl_ms, max);
    assert_eq!(renewed.ttl_deadline, h.now() + i64::try_from(max).unwrap());
    assert_eq!(renewed.last_renewed_at, h.now());

    let narrowed = h
        .call::<LeaseRenew>(agent("agent-a"), &renew(Some(30_000)))
        .await
        .unwrap();
    assert_eq!(
        (narrowed.ttl_ms, narrowed.ttl_deadline),
        (30_000, h.now() + 30_000)
    );
    tokio::time::advance(Duration::from_secs(5)).await;
    let again = h
        .call::<LeaseRenew>(agent("agent-a"), &renew(None))
        .await
        .unwrap();
    assert_eq!(
        (again.ttl_ms, again.ttl_deadline),
        (30_000, h.now() + 30_000),
        "the recorded width, not the default"
    );
    // Another principal's renewal: the lease is invisible to it. An admin may renew.
    let err = h
        .call::<LeaseRenew>(agent("agent-b"), &renew(None))
        .await
        .unwrap_err();
    assert_eq!(err.code, ErrorCode::UnknownLease);
    h.call::<LeaseRenew>(admin("operator"), &renew(None))
        .await
        .unwrap();
}

#[tokio::test(start_paused = true)]
async fn one_lease_per_requester() {
    let h = Harness::new();
    let mut events = h.bus.follow();
    let grant = h.lease("agent-a", ios()).await.unwrap();
    let err = h.lease("agent-a", android()).await.unwrap_err();
    assert_eq!(err.code, ErrorCode::RequesterAlreadyLeased);
    assert!(
        err.message.contains(grant.lease.id.as_str()),
        "{}",
        err.message
    );
    assert_eq!(
        err.details,
        Some(json!({"requesterId": "agent-a", "existingLeaseId": grant.lease.id}))
    );
    let rejected = next_event(&mut events, "lease.rejected").await;
    assert_eq!(rejected.payload["reason"], "already-leased");

    // A pending request counts too; the requester is the rule's key, not the principal.
    h.lease("agent-b", ios()).await.unwrap();
    let mut for_c = ios();
    for_c.requester_id = Some("job-c".into());
    let (waiting, _pushes) = h.spawn_lease("proxy", for_c.clone());
    next_event(&mut events, "lease.queued").await;
    let err = h.lease("someone-else", for_c).await.unwrap_err();
    assert_eq!(err.code, ErrorCode::RequesterAlreadyLeased);
    assert_eq!(err.details, Some(json!({"requesterId": "job-c"})));
    waiting.abort();
}

#[tokio::test(start_paused = true)]
async fn idempotency_keys_replay_conflict_and_belong_to_their_principal() {
    let h = Harness::new();
    let mut input = ios();
    input.idempotency_key = Some("k-1".into());
    let first = h.lease("agent-a", input.clone()).await.unwrap();
    let again = h.lease("agent-a", input.clone()).await.unwrap();
    assert_eq!(again, first, "the same grant");
    assert_eq!(h.worker.leases().len(), 1);

    let mut different = android();
    different.idempotency_key = Some("k-1".into());
    let before = h.snapshot();
    let err = h.lease("agent-a", different).await.unwrap_err();
    assert_eq!(err.code, ErrorCode::IdempotencyConflict);
    assert_eq!(h.snapshot(), before);

    let mut foreign = input.clone();
    foreign.requester_id = Some("agent-a".into());
    let err = h.lease("agent-b", foreign).await.unwrap_err();
    assert_eq!(err.code, ErrorCode::Forbidden);
    assert_eq!(h.snapshot(), before);

    // A repeat while the first is still waiting joins the wait.
    h.lease("agent-b", ios()).await.unwrap();
    let mut queued = ios();
    queued.idempotency_key = Some("k-2".into());
    let mut events = h.bus.follow();
    let (first_try, _p1) = h.spawn_lease("agent-c", queued.clone());
    next_event(&mut events, "lease.queued").await;
    let (retry, _p2) = h.spawn_lease("agent-c", queued);
    tokio::task::yield_now().await;
    assert_eq!(
        h.worker.waiting().len(),
        1,
        "the retry joined, it did not queue again"
    );
    h.call::<LeaseRelease>(
        agent("agent-a"),
        &LeaseIdInput {
            reason: None,
            lease_id: first.lease.id.to_string(),
        },
    )
    .await
    .unwrap();
    let (x, y) = tokio::join!(first_try, retry);
    assert_eq!(x.unwrap().unwrap(), y.unwrap().unwrap());
}

#[tokio::test(start_paused = true)]
async fn a_chosen_lease_id_is_granted_exactly_and_refused_while_held() {
    let h = Harness::new();
    let mut input = ios();
    input.lease_id = Some("0123456789abcdef0123456789abcdef".into());
    let grant = h.lease("agent-a", input.clone()).await.unwrap();
    assert_eq!(grant.lease.id.as_str(), "0123456789abcdef0123456789abcdef");
    assert!(grant.lease.id_chosen_by_requester);
    assert_eq!(
        grant.environment["SIMLOCK_LEASE_ID"],
        "0123456789abcdef0123456789abcdef"
    );
    let before = h.snapshot();
    let err = h.lease("agent-b", input).await.unwrap_err();
    assert_eq!(err.code, ErrorCode::LeaseIdTaken);
    assert_eq!(h.snapshot(), before);
}

#[tokio::test(start_paused = true)]
async fn owner_is_refused_off_the_gateway_uplink() {
    let h = Harness::new();
    let mut input = ios();
    input.owner = Some("tok_abc".into());
    let err = h.lease("agent-a", input.clone()).await.unwrap_err();
    assert_eq!(err.code, ErrorCode::Forbidden);
    assert!(err.message.contains("owner"), "{}", err.message);
    // Admin role is not enough: only the uplink may name an owner.
    let err = h
        .call::<LeaseRequest>(admin("operator"), &input)
        .await
        .unwrap_err();
    assert_eq!(err.code, ErrorCode::Forbidden);
    assert!(h.worker.requests().is_empty());
}

#[tokio::test(start_paused = true)]
async fn required_capabilities_must_be_available() {
    let mut config = config();
    config.daemon.capabilities = vec!["gpu".into()];
    let h = Harness::with_config(config);
    h.capabilities.register(|| CapabilityStatus {
        name: "agent-device".into(),
        available: false,
        reason: Some("its daemon is not running".into()),
    });
    let mut input = ios();
    input.requires = vec!["gpu".into(), "tv-out".into()];
    let err = h.lease("agent-a", input).await.unwrap_err();
    assert_eq!(err.code, ErrorCode::CapabilityMissing);
    assert_eq!(err.message, "This worker cannot serve tv-out");
    assert_eq!(err.details, Some(json!({"capability": "tv-out"})));

    let mut input = ios();
    input.requires = vec!["agent-device".into()];
    let err = h.lease("agent-a", input).await.unwrap_err();
    assert_eq!(err.code, ErrorCode::CapabilityMissing);
    assert_eq!(
        err.message,
        "This worker cannot serve agent-device: its daemon is not running"
    );
    assert!(h.worker.requests().is_empty());

    let mut input = ios();
    input.requires = vec!["gpu".into()];
    let grant = h.lease("agent-a", input).await.unwrap();
    assert_eq!(grant.lease.requester_id, "agent-a");
    let status = h.worker.status(&h.gate, simlock_daemon::Viewer::ADMIN);
    assert_eq!(status.capabilities.unwrap().len(), 2);
    // The metric says the same as status.
    let metrics = simlock_daemon::metrics::Metrics::new();
    crate::register_metrics(&metrics, &h.worker);
    let text = metrics.render();
    for line in [
        "simlock_capability_available{capability=\"agent-device\"} 0\n",
        "simlock_capability_available{capability=\"gpu\"} 1\n",
    ] {
        assert!(text.contains(line), "{line} in {text}");
    }
}

#[tokio::test(start_paused = true)]
async fn cancel_answers_cancelled_not_found_or_not_cancellable() {
    let h = Harness::new();
    let mut events = h.bus.follow();
    let cancel = |requester: Option<&str>| LeaseCancelInput {
        requester_id: requester.map(str::to_owned),
    };
    let result = h
        .call::<LeaseCancel>(agent("agent-a"), &cancel(None))
        .await
        .unwrap();
    assert_eq!(result.result, CancelResult::NotFound);

    // Device work under way: not cancellable.
    let (provisioning, mut pushes) = h.spawn_lease("agent-a", ios());
    assert!(matches!(
        next_push(&mut pushes).await,
        Push::Progress {
            progress: Progress::Provisioning { .. },
            ..
        }
    ));
    let result = h
        .call::<LeaseCancel>(agent("agent-a"), &cancel(None))
        .await
        .unwrap();
    assert_eq!(result.result, CancelResult::NotCancellable);
    within(Duration::from_secs(60), provisioning)
        .await
        .unwrap()
        .unwrap();

    // Queued: cancelled, and the waiting call answers CANCELLED.
    h.lease("agent-b", ios()).await.unwrap();
    let (queued, _pushes) = h.spawn_lease("agent-c", ios());
    next_event(&mut events, "lease.queued").await;
    // Someone else's pending request: forbidden for an agent.
    let err = h
        .call::<LeaseCancel>(agent("agent-x"), &cancel(Some("agent-c")))
        .await
        .unwrap_err();
    assert_eq!(err.code, ErrorCode::Forbidden);
    let result = h
        .call::<LeaseCancel>(agent("agent-c"), &cancel(None))
        .await
        .unwrap();
    assert_eq!(result.result, CancelResult::Cancelled);
    let err = within(Duration::from_secs(1), queued)
        .await
        .unwrap()
        .unwrap_err();
    assert_eq!(err.code, ErrorCode::Cancelled);
    let rejected = next_event(&mut events, "lease.rejected").await;
    assert_eq!(rejected.payload["reason"], "cancelled");
    assert!(h.worker.waiting().is_empty());
    let record = h
        .worker
        .requests()
        .into_iter()
        .find(|r| r.requester_id == "agent-c")
        .unwrap();
    assert_eq!(record.state, crate::RecordState::Cancelled);
}

#[tokio::test(start_paused = true)]
async fn lease_list_shows_agents_their_own_and_release_all_kills_every_lease() {
    let h = Harness::new();
    let mut events = h.bus.follow();
    let mut notices = h.presence.follow();
    let a = h.lease("agent-a", ios()).await.unwrap();
    let b = h.lease("agent-b", android()).await.unwrap();
    let own = h
        .call::<LeaseList>(agent("agent-a"), &Empty {})
        .await
        .unwrap();
    assert_eq!(own.leases, vec![a.lease.clone()]);
    let all = h
        .call::<LeaseList>(admin("operator"), &Empty {})
        .await
        .unwrap();
    assert_eq!(all.leases, vec![a.lease.clone(), b.lease.clone()]);

    let out = h
        .call::<LeaseReleaseAll>(admin("operator"), &Empty {})
        .await
        .unwrap();
    assert_eq!(
        out.lease_ids,
        vec![a.lease.id.to_string(), b.lease.id.to_string()]
    );
    for _ in 0..2 {
        let released = next_event(&mut events, "lease.released").await;
        assert_eq!(released.payload["reason"], "killed");
        let notice = next_notice(&mut notices).await;
        assert!(matches!(
            notice.push,
            Push::LeaseLost {
                reason: LeaseEndReason::Killed,
                ..
            }
        ));
    }
    assert!(h.worker.leases().is_empty());
}

#[tokio::test(start_paused = true)]
async fn release_reclaims_the_device_and_reports_who_owned_it() {
    let h = Harness::new();
    let mut events = h.bus.follow();
    let grant = h.lease("agent-a", ios()).await.unwrap();
    let err = h
        .call::<LeaseRelease>(
            agent("agent-b"),
            &LeaseIdInput {
                reason: None,
                lease_id: grant.lease.id.to_string(),
            },
        )
        .await
        .unwrap_err();
    assert_eq!(
        err.code,
        ErrorCode::UnknownLease,
        "another's lease is invisible"
    );
    let out = h
        .call::<LeaseRelease>(
            agent("agent-a"),
            &LeaseIdInput {
                reason: None,
                lease_id: grant.lease.id.to_string(),
            },
        )
        .await
        .unwrap();
    assert_eq!(out.lease_id, grant.lease.id.as_str());
    let released = next_event(&mut events, "lease.released").await;
    assert_eq!(
        released.payload,
        json!({
            "leaseId": grant.lease.id,
            "deviceId": grant.device.id,
            "ownerId": "agent-a",
            "reason": "explicit",
        })
    );
    assert_eq!(h.worker.devices()[0].state, DeviceState::Reclaiming);
    next_event(&mut events, "device.reclaimed").await;
    assert_eq!(h.worker.devices()[0].state, DeviceState::Ready);
    // The warm device is granted at once to the next request of its spec.
    let warm = h.lease("agent-b", ios()).await.unwrap();
    assert_eq!(warm.device.id, grant.device.id);
    assert_eq!(warm.timing.estimated_ready_ms, 0);
    let granted =
        next_event_where(&mut events, "lease.granted", "requester", &json!("agent-b")).await;
    assert_eq!(granted.payload["source"], "warm");
}

#[tokio::test(start_paused = true)]
async fn a_module_ends_its_part_of_a_lease_before_the_device_is_wiped() {
    use futures::FutureExt as _;
    // The hook records the lease and holds until the test lets it go.
    let (told_tx, mut told) = mpsc::unbounded_channel::<String>();
    let gate = Arc::new(tokio::sync::Notify::new());
    let held = gate.clone();
    let hook: crate::LeaseEndHook = Arc::new(move |lease: String| {
        let (told_tx, held) = (told_tx.clone(), held.clone());
        async move {
            let _ = told_tx.send(lease);
            held.notified().await;
        }
        .boxed()
    });
    let h = Harness::build(Build {
        lease_end: vec![hook],
        ..Build::default()
    });
    let mut events = h.bus.follow();
    let grant = h.lease("agent-a", ios()).await.unwrap();
    h.call::<LeaseRelease>(
        agent("agent-a"),
        &LeaseIdInput {
            reason: None,
            lease_id: grant.lease.id.to_string(),
        },
    )
    .await
    .unwrap();
    assert_eq!(told.recv().await.as_deref(), Some(grant.lease.id.as_str()));
    // However long the module takes (within its bound), the device waits, reclaiming.
    tokio::time::sleep(crate::LEASE_END_BOUND - Duration::from_millis(1)).await;
    assert_eq!(h.worker.devices()[0].state, DeviceState::Reclaiming);
    gate.notify_one();
    next_event(&mut events, "device.reclaimed").await;
    assert_eq!(h.worker.devices()[0].state, DeviceState::Ready);
}

#[tokio::test(start_paused = true)]
async fn a_module_that_never_ends_its_part_holds_the_reclaim_only_to_its_bound() {
    use futures::FutureExt as _;
    let hook: crate::LeaseEndHook = Arc::new(|_lease: String| futures::future::pending().boxed());
    let h = Harness::build(Build {
        lease_end: vec![hook],
        ..Build::default()
    });
    let mut events = h.bus.follow();
    let grant = h.lease("agent-a", ios()).await.unwrap();
    h.call::<LeaseRelease>(
        agent("agent-a"),
        &LeaseIdInput {
            reason: None,
            lease_id: grant.lease.id.to_string(),
        },
    )
    .await
    .unwrap();
    next_event(&mut events, "device.reclaimed").await;
    assert_eq!(h.worker.devices()[0].state, DeviceState::Ready);
}
