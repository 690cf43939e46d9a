//! Unit tests of the decisions, driven by hand with explicit times: no runtime, no I/O.

use simlock_contract::ErrorCode;

use super::*;
use crate::capacity::Limits;

fn settings(max: u32) -> Settings {
    let est = Estimates {
        provision_ms: 1_500,
        boot_ms: 1_000,
        reclaim_ms: 500,
    };
    Settings {
        default_ttl_ms: 900_000,
        max_ttl_ms: 14_400_000,
        retention_ms: 600_000,
        max_records: 10_000,
        max_waiting: 1_000,
        idle: IdleConfig {
            shutdown_after_ms: 600_000,
            delete_after_ms: 3_600_000,
        },
        limits: Limits {
            ios_max: max,
            android_max: max,
            global_max: max,
            ram: None,
        },
        estimates: BTreeMap::from([(Platform::Ios, est), (Platform::Android, est)]),
        health: HealthConfig::default(),
        quarantine: QuarantineConfig::default(),
        real: BTreeSet::new(),
    }
}

/// What a driver answers for a device it booted: the virtual kind, in these tests.
fn up() -> Result<DeviceAccess, DriverError> {
    Ok(DeviceAccess::Virtual {
        platform: Platform::Ios,
        driver_device_id: "udid".into(),
    })
}

fn spec(platform: Platform, model: &str) -> DeviceSpec {
    DeviceSpec {
        platform,
        model: model.into(),
        os_version: "1".into(),
    }
}

fn admission(n: u32, spec: DeviceSpec, timeout_ms: Option<u64>) -> Admission {
    Admission {
        request_id: RequestId::from_raw(format!("req_{n}")),
        requester_id: format!("agent-{n}"),
        principal: format!("agent-{n}"),
        idempotency_key: None,
        fingerprint: String::new(),
        requested: RequestedDevice {
            platform: spec.platform,
            model: Some(spec.model.clone()),
            os_version: None,
            requires: vec![],
        },
        spec,
        terms: LeaseTerms {
            ttl_ms: 900_000,
            owner_id: format!("agent-{n}"),
            chosen_id: None,
        },
        no_wait: false,
        timeout_ms,
    }
}

fn request(n: u32) -> RequestId {
    RequestId::from_raw(format!("req_{n}"))
}

fn outcome(fx: &Effects, id: &RequestId) -> Option<Result<LeaseGrant, ContractError>> {
    fx.updates.iter().find_map(|(r, u)| match u {
        Update::Done(outcome) if r == id => Some((**outcome).clone()),
        _ => None,
    })
}

fn progress(fx: &Effects, id: &RequestId) -> Vec<Progress> {
    fx.updates
        .iter()
        .filter_map(|(r, u)| match u {
            Update::Progress(p) if r == id => Some(*p),
            _ => None,
        })
        .collect()
}

fn provision_of(fx: &Effects) -> DeviceId {
    fx.work
        .iter()
        .find_map(|w| match w {
            Work::Provision { device, .. } => Some(device.clone()),
            _ => None,
        })
        .expect("a provision")
}

/// Admits request `n` and runs its provisioning and boot to a grant at `now`.
fn lease_new(state: &mut State, n: u32, spec: DeviceSpec, now: i64) -> LeaseGrant {
    state.admit(admission(n, spec, None), now).unwrap();
    let device = provision_of(&state.take_effects());
    assert!(
        state
            .provisioned(&device, Ok(format!("udid-{n}")), now)
            .is_some()
    );
    state.booted(&device, up(), now);
    outcome(&state.take_effects(), &request(n))
        .expect("settled")
        .expect("granted")
}

fn agent(principal: &str) -> Caller<'_> {
    Caller {
        principal,
        admin: false,
    }
}

fn release(state: &mut State, grant: &LeaseGrant, now: i64) {
    let caller = Caller {
        principal: &grant.lease.owner_id,
        admin: false,
    };
    state
        .release(
            grant.lease.id.as_str(),
            LeaseEndReason::Explicit,
            caller,
            None,
            now,
        )
        .unwrap();
}

#[test]
fn a_new_device_is_provisioned_booted_then_granted_and_every_step_is_stored() {
    let mut state = State::new(settings(2));
    let id = request(1);
    assert!(matches!(
        state.admit(admission(1, spec(Platform::Ios, "A"), None), 0),
        Ok(Admitted::Follow(ref r, _)) if *r == id
    ));
    let writes = state.take_writes();
    assert_eq!(writes.requests.len(), 1, "recorded before anything else");
    assert_eq!(writes.devices.len(), 1);
    let fx = state.take_effects();
    assert_eq!(
        progress(&fx, &id),
        [Progress::Provisioning { eta_ms: 1_500 }]
    );
    let device = provision_of(&fx);
    assert_eq!(state.capacity().ios.reserved, 1);

    assert_eq!(
        state.provisioned(&device, Ok("udid".into()), 1_500),
        Some("udid".to_owned())
    );
    let fx = state.take_effects();
    assert_eq!(progress(&fx, &id), [Progress::Booting { eta_ms: 1_000 }]);
    assert!(
        fx.events
            .iter()
            .any(|e| matches!(e.event, Event::DeviceProvisioned { .. }))
    );

    state.booted(&device, up(), 2_500);
    let writes = state.take_writes();
    assert_eq!(writes.leases.len(), 1);
    let fx = state.take_effects();
    let grant = outcome(&fx, &id).unwrap().unwrap();
    assert_eq!(grant.lease.granted_at, 2_500);
    assert_eq!(grant.lease.ttl_deadline, 2_500 + 900_000);
    assert_eq!(grant.device.driver_device_id, "udid");
    assert_eq!(grant.timing.estimated_ready_ms, 2_500);
    let names: Vec<String> = fx.events.iter().map(|e| e.event.parts().0).collect();
    assert_eq!(names, ["device.ready", "lease.granted"]);
    assert_eq!(state.capacity().ios.running, 1);
    assert_eq!(
        state.next_deadline(),
        Some(2_500 + 600_000),
        "first the settled request's retention"
    );
    state.tick(2_500 + 600_000);
    assert_eq!(
        state.next_deadline(),
        Some(2_500 + 900_000),
        "then the lease"
    );
}

#[test]
fn a_queue_deadline_passed_during_device_work_fails_the_request_when_it_would_wait_again() {
    let mut state = State::new(settings(1));
    let first = lease_new(&mut state, 1, spec(Platform::Ios, "A"), 0);
    // Queued at 1 s with a 10 s timeout: the deadline is 11 s.
    state
        .admit(admission(2, spec(Platform::Ios, "B"), Some(10_000)), 1_000)
        .unwrap();
    let fx = state.take_effects();
    assert_eq!(
        progress(&fx, &request(2)),
        [queued_for(1, WaitingFor::Capacity)]
    );
    assert_eq!(state.next_deadline(), Some(11_000));

    // At 6 s the device frees; it is of another spec, so it is evicted and a new one made.
    release(&mut state, &first, 6_000);
    state.reclaimed(&first.device.id, up(), 6_500);
    let fx = state.take_effects();
    assert!(
        fx.work
            .iter()
            .any(|w| matches!(w, Work::Shutdown { device, .. } if *device == first.device.id)),
        "{:?}",
        fx.work
    );
    let device = provision_of(&fx);
    assert_eq!(
        progress(&fx, &request(2)),
        [Progress::Provisioning { eta_ms: 1_500 }]
    );
    // Processing: the deadline does not fire.
    state.tick(11_000);
    assert!(outcome(&state.take_effects(), &request(2)).is_none());

    // The work fails at 12 s: waiting again would pass the deadline fixed at 11 s.
    state.provisioned(
        &device,
        Err(DriverError {
            platform: Platform::Ios,
            message: "no disk".into(),
        }),
        12_000,
    );
    let err = outcome(&state.take_effects(), &request(2))
        .unwrap()
        .unwrap_err();
    assert_eq!(err.code, ErrorCode::QueueTimeout);
}

#[test]
fn failed_device_work_requeues_the_request_in_its_place() {
    let mut state = State::new(settings(2));
    state
        .admit(admission(1, spec(Platform::Ios, "A"), None), 0)
        .unwrap();
    let device = provision_of(&state.take_effects());
    let boom = || DriverError {
        platform: Platform::Ios,
        message: "boom".into(),
    };
    state.provisioned(&device, Err(boom()), 100);
    let fx = state.take_effects();
    // Queued again, then picked again at once (there is room): a second provision.
    assert_eq!(
        progress(&fx, &request(1)),
        [
            Progress::queued(1),
            Progress::Provisioning { eta_ms: 1_500 }
        ]
    );
    let second = provision_of(&fx);
    assert_ne!(second, device);
    state.provisioned(&second, Err(boom()), 200);
    let third = provision_of(&state.take_effects());
    state.provisioned(&third, Err(boom()), 300);
    let err = outcome(&state.take_effects(), &request(1))
        .unwrap()
        .unwrap_err();
    assert_eq!(err.code, ErrorCode::Internal);
    assert!(err.message.contains("boom"), "{}", err.message);
    assert!(state.devices().is_empty());
}

#[test]
fn eviction_takes_the_least_recently_used_idle_device_and_never_a_leased_one() {
    let mut state = State::new(settings(2));
    let a = lease_new(&mut state, 1, spec(Platform::Ios, "A"), 0);
    let b = lease_new(&mut state, 2, spec(Platform::Ios, "B"), 0);
    release(&mut state, &b, 10_000);
    state.reclaimed(&b.device.id, up(), 10_500);
    state.take_effects();
    // Full: one leased, one idle. A request of a third spec evicts the idle one.
    state
        .admit(admission(3, spec(Platform::Android, "P"), None), 20_000)
        .unwrap();
    let fx = state.take_effects();
    let evicted: Vec<&DeviceId> = fx
        .work
        .iter()
        .filter_map(|w| match w {
            Work::Shutdown { device, .. } => Some(device),
            _ => None,
        })
        .collect();
    assert_eq!(evicted, [&b.device.id]);
    provision_of(&fx);

    // Now both slots are taken by a lease and a reservation: a fourth spec waits, and the
    // leased device is never a candidate.
    state
        .admit(admission(4, spec(Platform::Android, "Q"), None), 21_000)
        .unwrap();
    let fx = state.take_effects();
    assert_eq!(
        progress(&fx, &request(4)),
        [queued_for(2, WaitingFor::Capacity)]
    );
    assert!(fx.work.is_empty(), "{:?}", fx.work);
    let leased = state
        .devices()
        .into_iter()
        .find(|d| d.id == a.device.id)
        .unwrap();
    assert_eq!(leased.state, DeviceState::Leased);
}

#[test]
fn idle_tiers_skip_leased_devices() {
    let mut state = State::new(settings(2));
    let mut long = admission(1, spec(Platform::Ios, "A"), None);
    long.terms.ttl_ms = 10_000_000;
    state.admit(long, 0).unwrap();
    let device = provision_of(&state.take_effects());
    state.provisioned(&device, Ok("u".into()), 0);
    state.booted(&device, up(), 0);
    state.take_effects();
    state.tick(5_000_000);
    let fx = state.take_effects();
    assert!(fx.work.is_empty());
    assert_eq!(state.devices()[0].state, DeviceState::Leased);
    assert_eq!(
        state.next_deadline(),
        Some(10_000_000),
        "only the lease's deadline"
    );
}

#[test]
fn only_the_oldest_waiter_claims_a_reclaiming_device() {
    let mut state = State::new(settings(1));
    let a = lease_new(&mut state, 1, spec(Platform::Ios, "A"), 0);
    // Two waiters for the same spec, capacity full.
    state
        .admit(admission(2, spec(Platform::Ios, "A"), None), 1)
        .unwrap();
    state
        .admit(admission(3, spec(Platform::Ios, "A"), None), 2)
        .unwrap();
    state.take_effects();
    release(&mut state, &a, 10);
    let fx = state.take_effects();
    // The oldest waiter claims the reclaiming device; the next one keeps waiting.
    assert_eq!(
        progress(&fx, &request(2)),
        [Progress::Reclaiming { eta_ms: 500 }]
    );
    assert!(progress(&fx, &request(3)).is_empty());
    assert_eq!(
        state.cancel("agent-2", agent("agent-2"), 20).unwrap(),
        CancelResult::NotCancellable,
        "its device work started"
    );
    assert_eq!(
        state.cancel("agent-3", agent("agent-3"), 20).unwrap(),
        CancelResult::Cancelled
    );
    state.reclaimed(&a.device.id, up(), 510);
    let grant = outcome(&state.take_effects(), &request(2))
        .unwrap()
        .unwrap();
    assert_eq!(grant.device.id, a.device.id);
    assert_eq!(grant.timing.estimated_ready_ms, 500);
}

#[test]
fn only_its_owner_or_an_admin_may_cancel_a_pending_request_and_a_refusal_changes_nothing() {
    let mut state = State::new(settings(1));
    lease_new(&mut state, 1, spec(Platform::Ios, "A"), 0);
    state
        .admit(admission(2, spec(Platform::Ios, "A"), None), 1)
        .unwrap();
    state.take_writes();
    state.take_effects();
    // The decision itself refuses, whatever an earlier authorize step said.
    assert!(matches!(
        state.cancel("agent-2", agent("agent-x"), 2),
        Err(CoreError::Forbidden(_))
    ));
    assert!(state.take_writes().is_empty());
    let fx = state.take_effects();
    assert!(fx.events.is_empty() && fx.updates.is_empty(), "{fx:?}");
    assert_eq!(state.queue_depth(), 1);
    assert_eq!(
        state.cancel("nobody", agent("agent-x"), 2).unwrap(),
        CancelResult::NotFound
    );
    let admin = Caller {
        principal: "operator",
        admin: true,
    };
    assert_eq!(
        state.cancel("agent-2", admin, 3).unwrap(),
        CancelResult::Cancelled
    );
    let err = outcome(&state.take_effects(), &request(2))
        .unwrap()
        .unwrap_err();
    assert_eq!(err.code, ErrorCode::Cancelled);
}

#[test]
fn a_settled_request_is_forgotten_at_its_retention_deadline_not_before() {
    let mut state = State::new(settings(1));
    lease_new(&mut state, 1, spec(Platform::Ios, "A"), 0);
    let mut no_wait = admission(2, spec(Platform::Ios, "B"), None);
    no_wait.no_wait = true;
    state.admit(no_wait, 1_000).unwrap();
    let err = outcome(&state.take_effects(), &request(2))
        .unwrap()
        .unwrap_err();
    assert_eq!(err.code, ErrorCode::NoCapacity);
    state.take_writes();
    // Settled at 1 s (request 1 at 0 s): the tick is due when request 1's record expires.
    assert_eq!(state.next_deadline(), Some(600_000));
    state.tick(600_000);
    assert!(state.record(&request(1)).is_none());
    assert_eq!(state.next_deadline(), Some(601_000));
    state.tick(600_999);
    assert!(state.record(&request(2)).is_some(), "one ms early: kept");
    state.tick(601_000);
    assert!(state.record(&request(2)).is_none());
    let writes = state.take_writes();
    assert_eq!(
        writes.requests,
        vec![(request(1), None), (request(2), None)],
        "both rows are deleted"
    );
    assert_eq!(state.next_deadline(), Some(900_000), "the lease's deadline");
}

fn seen(id: &str, state: RunState) -> Vec<Observation> {
    vec![Observation {
        driver_device_id: id.into(),
        state,
    }]
}

fn recovers(fx: &Effects) -> usize {
    fx.work
        .iter()
        .filter(|w| matches!(w, Work::Recover { .. }))
        .count()
}

fn notices(fx: &Effects) -> Vec<Push> {
    fx.notices.iter().map(|n| n.push.clone()).collect()
}

#[test]
fn a_leased_device_seen_stopped_twice_is_recovered_under_its_lease_and_its_owner_hears_both() {
    let mut state = State::new(settings(2));
    let grant = lease_new(&mut state, 1, spec(Platform::Ios, "A"), 0);
    let device = grant.device.id.clone();
    let lease = grant.lease.id.to_string();
    state.take_effects();
    state.observe(Platform::Ios, &seen("udid-1", RunState::Stopped), 100);
    assert_eq!(
        recovers(&state.take_effects()),
        0,
        "one sighting is no conclusion"
    );
    state.observe(Platform::Ios, &seen("udid-1", RunState::Transitioning), 150);
    state.observe(Platform::Ios, &[], 200);
    let fx = state.take_effects();
    assert_eq!(
        recovers(&fx),
        1,
        "a device missing from the probe counts as stopped"
    );
    assert_eq!(
        notices(&fx),
        [Push::DeviceUnhealthy {
            lease_id: lease.clone(),
            device_id: device.clone(),
            reason: UnhealthyReason::Crashed
        }]
    );
    assert!(
        fx.events
            .iter()
            .any(|e| matches!(&e.event, Event::DeviceCrashDetected {
                seen: CrashedDevice::Leased { lease_id: Some(id) },
                ..
            } if id == lease.as_str()))
    );
    // While it recovers, probes conclude nothing about it.
    state.observe(Platform::Ios, &seen("udid-1", RunState::Stopped), 300);
    state.observe(Platform::Ios, &seen("udid-1", RunState::Stopped), 400);
    assert_eq!(recovers(&state.take_effects()), 0);
    state.recovered(&device, up(), 500);
    let fx = state.take_effects();
    assert_eq!(
        notices(&fx),
        [Push::DeviceRecovered {
            lease_id: lease.clone(),
            device_id: device.clone(),
            attempts: 1
        }]
    );
    assert!(state.lease(&lease).is_some(), "the same lease");
    assert_eq!(state.devices()[0].state, DeviceState::Leased);
    assert_eq!(state.devices()[0].recovery_attempts, None);
}

#[test]
fn failed_recoveries_back_off_then_the_lease_ends_device_lost() {
    let mut state = State::new(settings(2));
    let grant = lease_new(&mut state, 1, spec(Platform::Ios, "A"), 0);
    let device = grant.device.id.clone();
    let lease = grant.lease.id.to_string();
    state.observe(Platform::Ios, &[], 10);
    state.observe(Platform::Ios, &[], 20);
    assert_eq!(recovers(&state.take_effects()), 1);
    let failed = || {
        Err(DriverError {
            platform: Platform::Ios,
            message: "no".into(),
        })
    };
    // 5 s, then 10 s (recoveryBackoffMs doubling), then the third failure gives up.
    state.recovered(&device, failed(), 1_000);
    assert_eq!(state.next_deadline(), Some(6_000));
    state.tick(5_999);
    assert_eq!(recovers(&state.take_effects()), 0, "not before its backoff");
    state.tick(6_000);
    assert_eq!(recovers(&state.take_effects()), 1);
    assert_eq!(state.devices()[0].recovery_attempts, Some(2));
    state.recovered(&device, failed(), 7_000);
    assert_eq!(state.next_deadline(), Some(17_000));
    state.tick(17_000);
    assert_eq!(recovers(&state.take_effects()), 1);
    state.recovered(&device, failed(), 18_000);
    let fx = state.take_effects();
    assert!(
        fx.events
            .iter()
            .any(|e| matches!(e.event, Event::DeviceRecoveryFailed { attempts: 3, .. }))
    );
    assert_eq!(
        notices(&fx),
        [Push::LeaseLost {
            lease_id: lease.clone(),
            device_id: device.clone(),
            reason: LeaseEndReason::DeviceLost
        }]
    );
    assert!(state.lease(&lease).is_none());
    assert!(
        fx.work.iter().any(|w| matches!(w, Work::Delete { .. })),
        "the untrusted device goes"
    );
}

#[test]
fn a_lease_that_ends_during_a_recovery_is_reclaimed_once_the_recovery_ends() {
    let mut state = State::new(settings(2));
    let grant = lease_new(&mut state, 1, spec(Platform::Ios, "A"), 0);
    let device = grant.device.id.clone();
    state.observe(Platform::Ios, &[], 10);
    state.observe(Platform::Ios, &[], 20);
    state.take_effects();
    release(&mut state, &grant, 30);
    let fx = state.take_effects();
    assert!(
        !fx.work.iter().any(|w| matches!(w, Work::Reclaim { .. })),
        "no reclaim while the recovery's boot runs"
    );
    assert_eq!(state.devices()[0].state, DeviceState::Reclaiming);
    state.recovered(&device, up(), 40);
    let fx = state.take_effects();
    assert!(fx.work.iter().any(|w| matches!(w, Work::Reclaim { .. })));
    assert!(notices(&fx).is_empty(), "nobody holds it any more");
}

/// One device may run per platform, two in all: a platform's cap binds before the worker's.
fn one_per_platform() -> Settings {
    let mut both = settings(1);
    both.limits = Limits {
        ios_max: 1,
        android_max: 1,
        global_max: 2,
        ram: None,
    };
    both
}

/// The progress of a waiter at `position`, told why it waits.
fn queued_for(position: u32, waiting_for: WaitingFor) -> Progress {
    Progress::Queued {
        queue_position: position,
        waiting_for: Some(waiting_for),
    }
}

/// What the driver answers for a wipe that fails.
fn erase_failed<T>() -> Result<T, DriverError> {
    Err(DriverError {
        platform: Platform::Ios,
        message: "erase failed".into(),
    })
}

/// The attempts and next retry of the first `device.quarantined` in `fx`.
fn quarantined(fx: &Effects) -> Option<(u32, i64)> {
    fx.events.iter().find_map(|e| match e.event {
        Event::DeviceQuarantined {
            attempts,
            next_retry_at,
            ..
        } => Some((attempts, next_retry_at)),
        _ => None,
    })
}

#[test]
fn a_failed_reclaim_quarantines_with_backoff_and_the_device_is_never_granted_meanwhile() {
    let mut state = State::new(settings(1));
    let first = lease_new(&mut state, 1, spec(Platform::Ios, "A"), 0);
    let device = first.device.id.clone();
    release(&mut state, &first, 1_000);
    state.take_effects();
    state.reclaimed(&device, erase_failed(), 2_000);
    let fx = state.take_effects();
    let (attempts, next_retry_at) = quarantined(&fx).unwrap();
    assert_eq!(attempts, 1);
    assert_eq!(next_retry_at, 32_000, "quarantine.retryBackoffMs");
    assert_eq!(state.devices()[0].state, DeviceState::Quarantined);
    assert_eq!(
        state.capacity().ios.running,
        1,
        "it still takes a running slot"
    );
    // A request for its spec waits: the quarantined device is not handed out.
    state
        .admit(admission(2, spec(Platform::Ios, "A"), None), 3_000)
        .unwrap();
    let fx = state.take_effects();
    assert!(outcome(&fx, &request(2)).is_none());
    assert_eq!(state.next_deadline(), Some(32_000));
    state.tick(32_000);
    let fx = state.take_effects();
    assert!(
        fx.work.iter().any(|w| matches!(w, Work::Reclaim { .. })),
        "the retry"
    );
    assert_eq!(
        state.devices()[0].state,
        DeviceState::Quarantined,
        "still quarantined while it runs"
    );
    state.reclaimed(&device, erase_failed(), 33_000);
    let fx = state.take_effects();
    let (_, next_retry_at) = quarantined(&fx).unwrap();
    assert_eq!(next_retry_at, 33_000 + 60_000, "doubled");
    state.tick(93_000);
    state.take_effects();
    state.reclaimed(&device, up(), 94_000);
    let fx = state.take_effects();
    assert!(fx.events.iter().any(|e| matches!(
        e.event,
        Event::DeviceQuarantineRecovered { attempts: 2, .. }
    )));
    assert!(
        outcome(&fx, &request(2)).is_some_and(|o| o.is_ok()),
        "the waiter gets it now"
    );
}

#[test]
fn a_waiter_is_told_when_quarantined_devices_hold_its_room_and_when_that_changes() {
    let mut state = State::new(settings(1));
    let first = lease_new(&mut state, 1, spec(Platform::Ios, "A"), 0);
    let device = first.device.id.clone();
    // The one slot is leased: the waiter is told the capacity is full.
    state
        .admit(admission(2, spec(Platform::Ios, "A"), None), 500)
        .unwrap();
    let fx = state.take_effects();
    assert_eq!(
        progress(&fx, &request(2)),
        [queued_for(1, WaitingFor::Capacity)]
    );
    // Released, its wipe fails: the device is quarantined and holds the slot; the waiter is
    // told so once, with the retry's time.
    release(&mut state, &first, 1_000);
    state.take_effects();
    state.reclaimed(&device, erase_failed(), 2_000);
    let fx = state.take_effects();
    assert_eq!(
        progress(&fx, &request(2)),
        [queued_for(1, WaitingFor::Quarantine { retry_at: 32_000 })]
    );
    // Nothing new to tell: told once.
    state.tick(3_000);
    assert!(progress(&state.take_effects(), &request(2)).is_empty());
    // The retry fails again: the new retry time is told.
    state.tick(32_000);
    state.take_effects();
    state.reclaimed(&device, erase_failed(), 33_000);
    let fx = state.take_effects();
    assert_eq!(
        progress(&fx, &request(2)),
        [queued_for(1, WaitingFor::Quarantine { retry_at: 93_000 })]
    );
    // A second waiter of another platform, whose room the quarantined iOS device does not hold
    // (a limit per platform), is told the capacity, not the quarantine.
    let mut state = State::new(one_per_platform());
    let ios = lease_new(&mut state, 1, spec(Platform::Ios, "A"), 0);
    let android = lease_new(&mut state, 2, spec(Platform::Android, "P"), 0);
    release(&mut state, &ios, 1_000);
    state.take_effects();
    state.reclaimed(&ios.device.id, erase_failed(), 2_000);
    state.take_effects();
    state
        .admit(admission(3, spec(Platform::Android, "P"), None), 3_000)
        .unwrap();
    assert_eq!(
        progress(&state.take_effects(), &request(3)),
        [queued_for(1, WaitingFor::Capacity)]
    );
    drop(android);

    // Quarantined devices of another platform do not free the room a request's platform cap
    // holds: the retry told is its own platform's, not an earlier one of another.
    let mut state = State::new(one_per_platform());
    let ios = lease_new(&mut state, 1, spec(Platform::Ios, "A"), 0);
    let android = lease_new(&mut state, 2, spec(Platform::Android, "P"), 0);
    release(&mut state, &android, 500);
    release(&mut state, &ios, 500);
    state.take_effects();
    state.reclaimed(&android.device.id, erase_failed(), 1_000);
    state.reclaimed(&ios.device.id, erase_failed(), 5_000);
    state.take_effects();
    state
        .admit(admission(3, spec(Platform::Ios, "A"), None), 6_000)
        .unwrap();
    assert_eq!(
        progress(&state.take_effects(), &request(3)),
        [queued_for(1, WaitingFor::Quarantine { retry_at: 35_000 })]
    );
}

#[test]
fn quarantine_backoff_grows_by_its_multiplier_up_to_its_cap() {
    let q = QuarantineConfig {
        max_retries: 10,
        retry_backoff_ms: 30_000,
        retry_backoff_multiplier: 2,
        max_retry_backoff_ms: 300_000,
    };
    let waits: Vec<u64> = (1..=6).map(|n| quarantine_backoff(&q, n)).collect();
    assert_eq!(waits, [30_000, 60_000, 120_000, 240_000, 300_000, 300_000]);
    let huge = QuarantineConfig {
        retry_backoff_multiplier: u32::MAX,
        ..q
    };
    assert_eq!(quarantine_backoff(&huge, 40), 300_000, "no overflow");
}

#[test]
fn past_its_retries_a_quarantined_device_is_deleted() {
    let mut s = settings(1);
    s.quarantine.max_retries = 1;
    let mut state = State::new(s);
    let first = lease_new(&mut state, 1, spec(Platform::Ios, "A"), 0);
    let device = first.device.id.clone();
    release(&mut state, &first, 1);
    state.reclaimed(&device, erase_failed(), 2);
    state.tick(30_002);
    state.take_effects();
    state.reclaimed(&device, erase_failed(), 30_003);
    let fx = state.take_effects();
    assert!(fx.events.iter().any(|e| matches!(
        e.event,
        Event::DeviceQuarantineAbandoned { attempts: 2, .. }
    )));
    assert!(fx.work.iter().any(|w| matches!(w, Work::Delete { .. })));
}

#[test]
fn after_a_restart_running_devices_are_adopted_and_a_stopped_leased_one_is_recovered() {
    let mut state = State::new(settings(2));
    let a = lease_new(&mut state, 1, spec(Platform::Ios, "A"), 0);
    let b = lease_new(&mut state, 2, spec(Platform::Ios, "B"), 0);
    release(&mut state, &b, 1);
    state.reclaimed(&b.device.id, up(), 2);
    state.take_effects();
    state.take_writes();
    let devices: Vec<DeviceEntry> = state.devices.values().cloned().collect();
    let leases: Vec<LeaseRecord> = state.leases();
    let mut real = settings(2);
    real.real = BTreeSet::from([Platform::Ios, Platform::Android]);
    let mut again = State::new(real);
    again.restore(devices, leases, Vec::new());
    again.converge(10);
    let fx = again.take_effects();
    let adopts = fx
        .work
        .iter()
        .filter(|w| matches!(w, Work::Adopt { .. }))
        .count();
    assert_eq!(adopts, 2, "the leased and the ready device");
    let sweeps: Vec<&Work> = fx
        .work
        .iter()
        .filter(|w| matches!(w, Work::Sweep { .. }))
        .collect();
    assert_eq!(sweeps.len(), 2, "one per real driver");
    // Until its sweep ends, nothing is created on a platform: the sweep would take it for a
    // leftover.
    again
        .admit(admission(3, spec(Platform::Ios, "C"), None), 15)
        .unwrap();
    let fx = again.take_effects();
    assert!(!fx.work.iter().any(|w| matches!(w, Work::Provision { .. })));
    assert_eq!(progress(&fx, &request(3)), [Progress::queued(1)]);
    again.swept(Platform::Ios, Ok(vec![]), 16);
    let fx = again.take_effects();
    assert!(
        fx.work.iter().any(|w| matches!(w, Work::Provision { .. })),
        "then it is"
    );
    again.adopted(&b.device.id, Ok(Adopted::Stopped), 20);
    assert_eq!(
        again
            .devices()
            .iter()
            .find(|d| d.id == b.device.id)
            .unwrap()
            .state,
        DeviceState::Shutdown,
        "a ready device that stopped is shut down"
    );
    again.adopted(&a.device.id, Ok(Adopted::Stopped), 20);
    let fx = again.take_effects();
    assert_eq!(
        recovers(&fx),
        1,
        "a leased one that stopped is recovered under its lease"
    );
    assert!(matches!(notices(&fx)[..], [Push::DeviceUnhealthy { .. }]));
}

/// Outside trial 21: a repeat of a queued request (a retry after a timeout, same idempotency
/// key) is told at once where the original stands; it used to hear nothing until the
/// original's state changed, so an HTTP retry hung.
#[test]
fn a_repeat_of_a_queued_request_is_told_where_it_stands_at_once() {
    let mut state = State::new(settings(1));
    state
        .admit(admission(1, spec(Platform::Ios, "A"), None), 0)
        .unwrap();
    let mut second = admission(2, spec(Platform::Ios, "A"), None);
    second.idempotency_key = Some("k".into());
    state.admit(second.clone(), 0).unwrap();
    let fx = state.take_effects();
    assert_eq!(
        progress(&fx, &request(2)),
        [queued_for(2, WaitingFor::Capacity)]
    );
    // The operator's list says why it waits, as it was told.
    let listed = state.waiting(Caller::ADMIN);
    let queued = listed.iter().find(|w| w.id == request(2)).expect("listed");
    assert_eq!(
        (queued.queue_position, queued.waiting_for),
        (Some(2), Some(WaitingFor::Capacity))
    );
    let repeat = Admission {
        request_id: request(3),
        ..second
    };
    match state.admit(repeat, 1_000) {
        Ok(Admitted::Follow(id, told)) => {
            assert_eq!(id, request(2), "the original is followed");
            assert_eq!(told, Some(queued_for(2, WaitingFor::Capacity)));
        }
        other => panic!("{other:?}"),
    }
}

/// Outside trial 21: one caller queueing thousands of requests slowed every decision of the
/// worker. The queue holds `lease.maxWaiting`; one more that would wait is refused
/// `NO_CAPACITY` (queue full, with the bound), announced as `queue-full`; a request a device can
/// serve at once is not refused.
#[test]
fn a_request_past_a_full_queue_is_refused_and_one_served_at_once_is_not() {
    // One iPhone at a time, and room for an Android device beside it.
    let mut state = State::new(Settings {
        max_waiting: 2,
        limits: Limits {
            ios_max: 1,
            android_max: 1,
            global_max: 2,
            ram: None,
        },
        ..settings(1)
    });
    state
        .admit(admission(1, spec(Platform::Ios, "A"), None), 0)
        .unwrap();
    for n in [2, 3] {
        state
            .admit(admission(n, spec(Platform::Ios, "A"), None), 0)
            .unwrap();
        let fx = state.take_effects();
        assert_eq!(outcome(&fx, &request(n)), None, "{n} waits");
    }
    let mut keyed = admission(4, spec(Platform::Ios, "A"), None);
    keyed.idempotency_key = Some("k4".into());
    state.admit(keyed.clone(), 0).unwrap();
    let fx = state.take_effects();
    let err = outcome(&fx, &request(4)).unwrap().unwrap_err();
    assert_eq!(err.code, ErrorCode::NoCapacity);
    assert!(err.message.contains("the queue is full"), "{}", err.message);
    assert_eq!(err.details.unwrap()["maxWaiting"], 2);
    assert!(fx.events.iter().any(|e| matches!(
        &e.event,
        Event::LeaseRejected {
            reason: RejectionReason::QueueFull,
            ..
        }
    )));
    assert_eq!(
        state.queue.depth(),
        2,
        "the refused one left nothing queued"
    );
    assert!(state.book.get(&request(4)).is_none(), "nor a record");
    assert!(
        state
            .take_writes()
            .requests
            .iter()
            .any(|(id, row)| *id == request(4) && row.is_none()),
        "and none is stored"
    );
    // An Android device can be had now: the full queue does not refuse it.
    state
        .admit(admission(5, spec(Platform::Android, "A"), None), 0)
        .unwrap();
    let fx = state.take_effects();
    assert_eq!(outcome(&fx, &request(5)), None);
    assert!(matches!(
        progress(&fx, &request(5)).as_slice(),
        [Progress::Provisioning { .. }]
    ));
    // Its key was not kept with the refusal: once there is room, a repeat is a new request.
    state.cancel("agent-2", agent("agent-2"), 1).unwrap();
    state.take_effects();
    let repeat = Admission {
        request_id: request(6),
        ..keyed
    };
    match state.admit(repeat, 2) {
        Ok(Admitted::Follow(id, None)) => assert_eq!(id, request(6)),
        other => panic!("{other:?}"),
    }
    let fx = state.take_effects();
    assert_eq!(outcome(&fx, &request(6)), None, "it waits");
}

/// Whether the effects announce that `lease` expired.
fn expired(fx: &Effects, lease: &LeaseGrant) -> bool {
    fx.events.iter().any(|e| {
        matches!(&e.event, Event::LeaseExpired { lease_id, .. } if lease_id == lease.lease.id.as_str())
    })
}

/// Outside trial 23: a renewal held up in a stopped worker (SIGSTOP) reached the core after
/// the lease's deadline, before the expiry timer ran, and brought the lease back for a whole
/// TTL although its holder had been told the renewal failed. A decision about a lease at `now`
/// first ends what is past its deadline: the late renewal, a late release and a late exec
/// find no lease, the lease ends `expired` (its device reclaimed), and its requester may lease
/// again.
#[test]
fn nothing_renews_releases_or_runs_on_a_lease_past_its_deadline_before_the_tick_ends_it() {
    let ttl = 900_000;
    let past = |grant: &LeaseGrant| grant.lease.ttl_deadline + 1;

    // A renewal at the deadline or later: UNKNOWN_LEASE, and the lease expired, not renewed.
    for late in [0, 1, 20_000] {
        let mut state = State::new(settings(1));
        let grant = lease_new(&mut state, 1, spec(Platform::Ios, "A"), 0);
        assert_eq!(grant.lease.ttl_deadline, ttl);
        let owner = agent(&grant.lease.owner_id);
        let at = grant.lease.ttl_deadline + late;
        let err = state
            .renew(grant.lease.id.as_str(), Some(ttl as u64), owner, at)
            .unwrap_err();
        assert!(matches!(err, CoreError::UnknownLease(_)), "{err:?}");
        assert!(state.lease(grant.lease.id.as_str()).is_none());
        let fx = state.take_effects();
        assert!(expired(&fx, &grant), "{fx:?}");
        assert!(
            !fx.events
                .iter()
                .any(|e| matches!(e.event, Event::LeaseRenewed { .. })),
            "{fx:?}"
        );
    }

    // A renewal a moment before the deadline still renews.
    let mut state = State::new(settings(1));
    let grant = lease_new(&mut state, 1, spec(Platform::Ios, "A"), 0);
    let owner = agent(&grant.lease.owner_id);
    let renewed = state
        .renew(grant.lease.id.as_str(), None, owner, ttl - 1)
        .unwrap();
    assert_eq!(renewed.ttl_deadline, 2 * ttl - 1);

    // A late release: the lease ended by its deadline, not by the release.
    let mut state = State::new(settings(1));
    let grant = lease_new(&mut state, 1, spec(Platform::Ios, "A"), 0);
    let owner = agent(&grant.lease.owner_id);
    let err = state
        .release(
            grant.lease.id.as_str(),
            LeaseEndReason::Explicit,
            owner,
            None,
            past(&grant),
        )
        .unwrap_err();
    assert!(matches!(err, CoreError::UnknownLease(_)), "{err:?}");
    assert!(expired(&state.take_effects(), &grant));

    // A late exec finds no lease; the state is unchanged by the look.
    let mut state = State::new(settings(1));
    let grant = lease_new(&mut state, 1, spec(Platform::Ios, "A"), 0);
    let owner = agent(&grant.lease.owner_id);
    let err = state
        .exec_target(grant.lease.id.as_str(), owner, None, past(&grant))
        .unwrap_err();
    assert!(matches!(err, CoreError::UnknownLease(_)), "{err:?}");
    assert!(
        state
            .exec_target(grant.lease.id.as_str(), owner, None, ttl - 1)
            .is_ok()
    );

    // Its requester asks again after the deadline: not "already leased", but queued for the
    // device its old lease frees (reclaiming).
    let mut state = State::new(settings(1));
    let grant = lease_new(&mut state, 1, spec(Platform::Ios, "A"), 0);
    let again = Admission {
        request_id: request(2),
        ..admission(1, spec(Platform::Ios, "A"), None)
    };
    assert!(state.admit(again, past(&grant)).is_ok());
    let fx = state.take_effects();
    assert!(expired(&fx, &grant), "{fx:?}");
    assert!(
        fx.work
            .iter()
            .any(|w| matches!(w, Work::Reclaim { device, .. } if *device == grant.lease.device_id)),
        "{fx:?}"
    );
}

/// Outside trial 24: a requester id is one namespace for every token, so a token naming a
/// requester another token's lease (or waiting request) has is refused; the refusal used to
/// name that lease's id. It names the ids of the asking owner's own only.
#[test]
fn a_requester_held_for_another_owner_is_refused_without_naming_its_lease_or_request() {
    let mut state = State::new(settings(1));
    let grant = lease_new(&mut state, 1, spec(Platform::Ios, "A"), 0);
    let theirs = |n: u32, owner: &str| {
        let mut a = admission(n, spec(Platform::Ios, "A"), None);
        a.requester_id = grant.lease.requester_id.clone();
        a.principal = owner.into();
        a.terms.owner_id = owner.into();
        a
    };
    let held = |result: Result<Admitted, CoreError>| match result {
        Err(CoreError::RequesterAlreadyLeased { held, .. }) => held,
        other => panic!("{other:?}"),
    };
    assert_eq!(
        held(state.admit(theirs(2, "agent-1"), 1)),
        Held::Lease(grant.lease.id.to_string()),
        "its owner is told which lease"
    );
    assert_eq!(held(state.admit(theirs(3, "intruder"), 1)), Held::Foreign);

    // The same for a waiting request.
    let mut state = State::new(settings(1));
    lease_new(&mut state, 1, spec(Platform::Ios, "A"), 0);
    state
        .admit(admission(2, spec(Platform::Ios, "A"), None), 0)
        .unwrap();
    let mut again = admission(3, spec(Platform::Ios, "A"), None);
    again.requester_id = "agent-2".into();
    again.principal = "agent-2".into();
    again.terms.owner_id = "agent-2".into();
    assert_eq!(
        held(state.admit(again.clone(), 1)),
        Held::Pending("req_2".into())
    );
    again.principal = "intruder".into();
    again.terms.owner_id = "intruder".into();
    assert_eq!(held(state.admit(again, 1)), Held::Foreign);
}
