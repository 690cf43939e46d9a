//! The fleet core, one decision per test: inputs in, effects and state out, time given.

use std::collections::BTreeMap;

use simlock_contract::ids::{DeviceId, EventId};
use simlock_contract::model::{
    CapabilityStatus, Capacity, DaemonInfo, DeviceSpec, DeviceState, GlobalCapacity, GrantDevice,
    GrantTiming, Health, HostFacts, Mode, Platform, PlatformCapacity, PlatformCatalog,
};

use super::*;

const T0: i64 = 1_000_000;

fn settings() -> Settings {
    Settings {
        gateway_id: "g1".into(),
        limits: LeaseLimits {
            default_ttl_ms: 1000,
            max_ttl_ms: 60_000,
        },
        refresh_interval_ms: 30_000,
        refresh_gap_ms: 0,
        lease_request_timeout_ms: 5_000,
        disconnected_retention_ms: 60_000,
        max_waiting: 1_000,
    }
}

fn record(id: &str, requester: &str, granted_at: i64) -> LeaseRecord {
    LeaseRecord {
        id: LeaseId::from_raw(id),
        device_id: DeviceId::from_raw("dev_1"),
        requester_id: requester.into(),
        owner_id: "agent".into(),
        granted_at,
        ttl_ms: 1000,
        ttl_deadline: granted_at + 1000,
        last_renewed_at: granted_at,
        id_chosen_by_requester: false,
        worker: None,
        worker_id: None,
        access: None,
    }
}

/// An iPhone 16 device in `state`, as a worker reports it.
pub(crate) fn device(id: &str, state: DeviceState) -> Device {
    Device {
        id: DeviceId::from_raw(id),
        spec: DeviceSpec {
            platform: Platform::Ios,
            model: "iPhone 16".into(),
            os_version: "18.2".into(),
        },
        state,
        driver_device_id: "udid".into(),
        created_at: 1,
        last_lease_ended_at: None,
        access: None,
        quarantine_attempts: None,
        quarantine_next_retry_at: None,
        recovery_attempts: None,
        worker_id: None,
        worker: None,
    }
}

pub(crate) fn status(leases: Vec<LeaseRecord>, slots: u32) -> StatusOutput {
    let running = u32::try_from(leases.len()).unwrap();
    let platform = PlatformCapacity {
        running,
        max_running: slots,
        reserved: 0,
        warm: 0,
        over_limit: false,
        at_ram_budget: false,
    };
    StatusOutput {
        daemon: DaemonInfo {
            health: Health::Running,
            mode: Mode::Worker,
            version: "t".into(),
            instance_id: "w".into(),
        },
        host: HostFacts {
            os: "linux".into(),
            os_version: String::new(),
            arch: "x86_64".into(),
            tools: Vec::new(),
        },
        capacity: Some(Capacity {
            ios: platform,
            android: PlatformCapacity::default(),
            global: GlobalCapacity {
                running,
                max_running: slots,
                reserved: 0,
                warm: 0,
                over_limit: false,
            },
        }),
        devices: Some(Vec::new()),
        leases: Some(leases),
        queue_depth: Some(0),
        waiting: Some(Vec::new()),
        capabilities: Some(Vec::new()),
        lease: None,
        workers: None,
        uplink: None,
        drivers: None,
    }
}

fn refresh(leases: Vec<LeaseRecord>, slots: u32) -> Refresh {
    Refresh {
        status: status(leases, slots),
        devices: Some(Vec::new()),
        catalog: Some(vec![PlatformCatalog {
            platform: Platform::Ios,
            models: vec!["iPhone 16".into()],
            runtimes: vec!["18.2".into()],
            default_runtime: None,
            model_runtimes: BTreeMap::from([("iPhone 16".to_owned(), vec!["18.2".to_owned()])]),
            model_aliases: BTreeMap::new(),
            model_workers: None,
            runtime_workers: None,
            unavailable: None,
        }]),
        limits: None,
    }
}

fn grant(record: LeaseRecord) -> LeaseGrant {
    LeaseGrant {
        device: GrantDevice {
            id: record.device_id.clone(),
            driver_device_id: "udid".into(),
            spec: DeviceSpec {
                platform: Platform::Ios,
                model: "iPhone 16".into(),
                os_version: "18.2".into(),
            },
            address: None,
            access: None,
        },
        environment: BTreeMap::from([("SIMLOCK_LEASE_ID".to_owned(), record.id.to_string())]),
        lease: record,
        timing: GrantTiming::default(),
    }
}

fn agent() -> Caller<'static> {
    Caller {
        principal: "agent",
        admin: false,
        connection: Some(7),
    }
}

/// A core with worker `w1` connected, subscribed and read in full, with `slots` free slots.
/// Answers the core and the uplink's generation.
fn fleet(slots: u32) -> (Core, u64) {
    fleet_with(settings(), slots)
}

fn fleet_with(settings: Settings, slots: u32) -> (Core, u64) {
    let mut core = Core::new(settings, Vec::new(), Vec::new(), T0);
    let generation = connect(&mut core, "w1", slots);
    (core, generation)
}

/// Worker `id` connects to `core`, subscribed and read in full, with `slots` free slots.
/// Answers its uplink's generation.
fn connect(core: &mut Core, id: &str, slots: u32) -> u64 {
    let generation = core.handle_uplink_opened(id, Some("one".into()), "tok_j".into(), T0);
    let sent = core.handle_probe_sent();
    core.handle_connected(generation, "v".into(), &status(Vec::new(), slots), sent, T0);
    core.handle_subscribed(generation, T0);
    let effects = core.take_effects();
    let sent = refresh_sent(&effects).expect("the first full read is asked");
    core.handle_refreshed(generation, sent, refresh(Vec::new(), slots), T0);
    core.take_effects();
    generation
}

/// Worker `generation` sends `event`; the read it asks for answers `read`, at `now`.
fn read_after(core: &mut Core, generation: u64, event_name: &str, read: Refresh, now: i64) {
    core.handle_worker_event(generation, event(event_name, serde_json::json!({})), now);
    let sent = refresh_sent(&core.take_effects()).unwrap();
    core.handle_refreshed(generation, sent, read, now);
}

fn refresh_sent(effects: &[Effect]) -> Option<Stamp> {
    effects.iter().find_map(|e| match e {
        Effect::Refresh { sent, .. } => Some(*sent),
        _ => None,
    })
}

fn ask(
    core: &mut Core,
    n: u32,
    input: LeaseRequestInput,
    now: i64,
) -> Result<Admitted, FleetError> {
    core.handle_lease_request(
        Ask {
            request_id: RequestId::from_raw(format!("req_{n}")),
            input,
            principal: "agent".into(),
        },
        now,
    )
}

fn forward(effects: &[Effect]) -> Option<(u64, LeaseRequestInput)> {
    effects.iter().find_map(|e| match e {
        Effect::Forward { attempt, input, .. } => Some((*attempt, input.clone())),
        _ => None,
    })
}

fn answers(effects: &[Effect]) -> Vec<(RequestId, Result<String, ErrorCode>)> {
    effects
        .iter()
        .filter_map(|e| match e {
            Effect::Answer { request, outcome } => Some((
                request.clone(),
                (**outcome)
                    .as_ref()
                    .map(|g| g.lease.id.to_string())
                    .map_err(FleetError::code),
            )),
            _ => None,
        })
        .collect()
}

fn ios() -> LeaseRequestInput {
    LeaseRequestInput::for_platform(Platform::Ios)
}

/// A lease granted through the core: answers the gateway's id for it.
fn granted(core: &mut Core) -> String {
    ask(core, 1, ios(), T0).unwrap();
    let (attempt, input) = forward(&core.take_effects()).expect("forwarded");
    let requester = input.requester_id.unwrap();
    core.handle_forward_answered(
        attempt,
        "w1",
        Ok(grant(record("lse_a", &requester, T0))),
        T0,
    );
    let answered = answers(&core.take_effects());
    answered[0].1.clone().unwrap()
}

/// The forward the last decision sent is refused by `w1` with `code`.
fn refused(core: &mut Core, code: ErrorCode) {
    let (attempt, _) = forward(&core.take_effects()).expect("forwarded");
    core.handle_forward_answered(attempt, "w1", Err(ContractError::new(code, "refused")), T0);
}

/// A lease granted through the core and read back in its worker's view, which is then full.
fn granted_full(core: &mut Core, generation: u64) -> String {
    let lease_id = granted(core);
    core.handle_worker_event(
        generation,
        event("lease.granted", serde_json::json!({})),
        T0,
    );
    let sent = refresh_sent(&core.take_effects()).unwrap();
    let held = record("lse_a", "gw:g1:agent", T0);
    core.handle_refreshed(generation, sent, refresh(vec![held], 1), T0);
    core.take_effects();
    lease_id
}

#[test]
fn a_forward_carries_no_wait_the_namespaced_requester_and_the_owner() {
    let (mut core, _) = fleet(1);
    let mut input = ios();
    input.ttl_ms = Some(5000);
    assert_eq!(
        ask(&mut core, 1, input, T0),
        Ok(Admitted::New(RequestId::from_raw("req_1")))
    );
    let (_, forwarded) = forward(&core.take_effects()).unwrap();
    assert_eq!(forwarded.no_wait, Some(true));
    assert_eq!(forwarded.requester_id.as_deref(), Some("gw:g1:agent"));
    assert_eq!(forwarded.owner.as_deref(), Some("agent"));
    assert_eq!(forwarded.ttl_ms, Some(5000));
}

#[test]
fn a_grant_is_indexed_in_the_decision_that_answers_it() {
    let (mut core, _) = fleet(1);
    let lease_id = granted(&mut core);
    assert_eq!(lease_id, "w1.lse_a");
    // No view lists it yet: the lookups and the owner's list still know it.
    assert!(core.view("w1").unwrap().leases.as_ref().unwrap().is_empty());
    assert_eq!(
        core.lease_target(&lease_id, agent())
            .unwrap()
            .worker_lease_id,
        "lse_a"
    );
    let listed = core.leases(agent().viewer());
    assert_eq!(listed.len(), 1);
    assert_eq!(listed[0].id.as_str(), "w1.lse_a");
    assert_eq!(listed[0].requester_id, "agent");
    // One lease per requester.
    assert!(matches!(
        ask(&mut core, 2, ios(), T0),
        Err(FleetError::RequesterHoldsLease { lease_id: Some(lease_id), .. }) if lease_id == "w1.lse_a"
    ));
    // Another principal naming the same requester is refused too, and not told the lease's id
    // (outside trial 24).
    let mut same_requester = ios();
    same_requester.requester_id = Some("agent".into());
    let refused = core.handle_lease_request(
        Ask {
            request_id: RequestId::from_raw("req_3"),
            input: same_requester,
            principal: "someone-else".into(),
        },
        T0,
    );
    assert!(
        matches!(
            refused,
            Err(FleetError::RequesterHoldsLease { lease_id: None, .. })
        ),
        "{refused:?}"
    );
}

#[test]
fn a_view_read_before_a_release_does_not_bring_the_lease_back() {
    let (mut core, generation) = fleet(1);
    let lease_id = granted(&mut core);
    // A read goes out (the worker still holds the lease when it reads it) ...
    core.handle_worker_event(generation, event("device.ready", serde_json::json!({})), T0);
    let sent = refresh_sent(&core.take_effects()).unwrap();
    // ... then the release is answered ...
    let target = send_release(&mut core, &lease_id, agent());
    core.handle_release_answered(&target, LeaseEndReason::Explicit, Ok(()), T0)
        .unwrap();
    let effects = core.take_effects();
    assert!(
        effects.iter().any(|e| matches!(
            e,
            Effect::Notice {
                except: Some(7),
                ..
            }
        )),
        "the owner's other connections hear it: {effects:?}"
    );
    // ... and the read comes back listing it.
    let held = record("lse_a", "gw:g1:agent", T0);
    core.handle_refreshed(generation, sent, refresh(vec![held], 1), T0);
    assert!(core.lease(&lease_id).is_none());
    assert_eq!(
        ask(&mut core, 2, ios(), T0),
        Ok(Admitted::New(RequestId::from_raw("req_2"))),
        "the requester may ask again at once"
    );
}

fn event(name: &str, payload: serde_json::Value) -> EventEnvelope {
    EventEnvelope {
        id: EventId::from_raw("evt_1"),
        seq: 1,
        timestamp: T0,
        event: name.into(),
        payload,
        module: "lease-lifecycle".into(),
    }
}

#[test]
fn an_end_before_its_grants_answer_reaches_the_owner_after_the_grant() {
    let (mut core, generation) = fleet(1);
    ask(&mut core, 1, ios(), T0).unwrap();
    let (attempt, _) = forward(&core.take_effects()).unwrap();
    core.handle_worker_event(
        generation,
        event(
            "lease.expired",
            serde_json::json!({"leaseId": "lse_a", "deviceId": "dev_1", "ownerId": "agent"}),
        ),
        T0,
    );
    let before = refresh_sent(&core.take_effects()).expect("the end asks for a read");
    core.handle_forward_answered(
        attempt,
        "w1",
        Ok(grant(record("lse_a", "gw:g1:agent", T0))),
        T0,
    );
    let effects = core.take_effects();
    let answer = effects
        .iter()
        .position(|e| matches!(e, Effect::Answer { outcome, .. } if outcome.is_ok()))
        .unwrap();
    let notice = effects
        .iter()
        .position(|e| matches!(e, Effect::Notice { .. }))
        .unwrap();
    assert!(answer < notice, "the grant, then its end: {effects:?}");
    assert!(core.lease("w1.lse_a").is_none());
    // The grant counts in the view until a read sent after it: the end's read went out
    // before, so one more is asked for once it is back.
    core.handle_refreshed(generation, before, refresh(Vec::new(), 1), T0);
    assert!(
        refresh_sent(&core.take_effects()).is_some(),
        "a read after the grant"
    );
}

/// A queued request is told its new place once one ahead of it leaves the queue (here, by
/// timing out); a request whose place did not change hears nothing more.
#[test]
fn a_queued_request_is_told_its_new_place_when_one_ahead_leaves() {
    let (mut core, generation) = fleet(1);
    let _held = granted_full(&mut core, generation);
    let mut first = ios();
    first.requester_id = Some("first".into());
    first.timeout_ms = Some(200);
    ask(&mut core, 2, first, T0).unwrap();
    let mut second = ios();
    second.requester_id = Some("second".into());
    ask(&mut core, 3, second, T0).unwrap();
    let queued = |effects: &[Effect]| -> Vec<(String, u32)> {
        effects
            .iter()
            .filter_map(|e| match e {
                Effect::Progress {
                    request,
                    progress: Progress::Queued { queue_position, .. },
                } => Some((request.to_string(), *queue_position)),
                _ => None,
            })
            .collect()
    };
    assert_eq!(
        queued(&core.take_effects()),
        [("req_2".to_owned(), 1), ("req_3".to_owned(), 2)]
    );
    core.handle_tick(T0 + 200);
    let effects = core.take_effects();
    assert_eq!(
        answers(&effects),
        [(RequestId::from_raw("req_2"), Err(ErrorCode::QueueTimeout))]
    );
    assert_eq!(queued(&effects), [("req_3".to_owned(), 1)]);
    core.handle_tick(T0 + 300);
    assert!(queued(&core.take_effects()).is_empty(), "told once");
}

/// The reasons the queued waiters in `effects` are told, in order.
fn told_why(effects: &[Effect]) -> Vec<Option<WaitingFor>> {
    effects
        .iter()
        .filter_map(|e| match e {
            Effect::Progress {
                progress: Progress::Queued { waiting_for, .. },
                ..
            } => Some(*waiting_for),
            _ => None,
        })
        .collect()
}

#[test]
fn a_waiter_is_told_why_no_worker_takes_it_and_told_again_when_that_changes() {
    let (mut core, generation) = fleet(1);
    let _held = granted_full(&mut core, generation);
    let mut waiting = ios();
    waiting.requester_id = Some("other".into());
    ask(&mut core, 2, waiting, T0).unwrap();
    assert_eq!(
        told_why(&core.take_effects()),
        [Some(WaitingFor::Capacity)],
        "the one worker's room is full of leases"
    );
    // The lease ended and its device's wipe failed: quarantined, it holds the slot.
    let mut quarantined = device("d_q", DeviceState::Quarantined);
    quarantined.quarantine_next_retry_at = Some(T0 + 30_000);
    let mut read = refresh(Vec::new(), 1);
    if let Some(capacity) = read.status.capacity.as_mut() {
        capacity.ios.running = 1;
        capacity.global.running = 1;
    }
    read.devices = Some(vec![quarantined.clone()]);
    read.status.devices = Some(vec![quarantined]);
    read_after(
        &mut core,
        generation,
        "device.quarantined",
        read.clone(),
        T0 + 1_000,
    );
    assert_eq!(
        told_why(&core.take_effects()),
        [Some(WaitingFor::Quarantine {
            retry_at: T0 + 30_000
        })]
    );
    // Nothing changed: nothing more is told.
    core.handle_tick(T0 + 2_000);
    assert!(told_why(&core.take_effects()).is_empty(), "told once");
    // Its one worker goes away: it waits for a worker to come back, and is told so.
    core.handle_uplink_closed(generation, T0 + 3_000, T0 + 3_000);
    assert_eq!(told_why(&core.take_effects()), [Some(WaitingFor::NoWorker)]);
}

#[test]
fn a_waiter_left_for_the_next_pass_by_a_worker_with_room_is_not_told_capacity() {
    let (mut core, generation) = fleet(0);
    connect(&mut core, "w2", 0);
    ask(&mut core, 1, ios(), T0).unwrap();
    let mut second = ios();
    second.requester_id = Some("other".into());
    ask(&mut core, 2, second, T0).unwrap();
    let effects = core.take_effects();
    assert!(forward(&effects).is_none());
    assert_eq!(
        told_why(&effects),
        [Some(WaitingFor::Capacity), Some(WaitingFor::Capacity)],
        "neither worker has room"
    );
    // Two slots free up on w1: one pass gives it the first request (one forward per worker
    // per pass); the second, which w2 cannot take, waits for the next pass, not for a device.
    read_after(
        &mut core,
        generation,
        "device.deleted",
        refresh(Vec::new(), 2),
        T0 + 1_000,
    );
    let effects = core.take_effects();
    assert!(forward(&effects).is_some(), "{effects:?}");
    assert_eq!(
        told_why(&effects),
        [None],
        "told again: room is not what it waits for"
    );
}

#[test]
fn a_queued_request_times_out_at_its_deadline_and_a_forward_at_the_lease_request_bound() {
    let (mut core, generation) = fleet(1);
    let _held = granted_full(&mut core, generation);
    let mut waiting = ios();
    waiting.requester_id = Some("other".into());
    waiting.timeout_ms = Some(200);
    ask(&mut core, 2, waiting, T0).unwrap();
    let effects = core.take_effects();
    assert!(
        effects.iter().any(|e| matches!(
            e,
            Effect::Progress {
                progress: Progress::Queued {
                    queue_position: 1,
                    waiting_for: Some(WaitingFor::Capacity)
                },
                ..
            }
        )),
        "{effects:?}"
    );
    assert_eq!(core.next_deadline(), Some(T0 + 200));
    core.handle_tick(T0 + 200);
    assert_eq!(
        answers(&core.take_effects()),
        [(RequestId::from_raw("req_2"), Err(ErrorCode::QueueTimeout))]
    );

    // A forward the worker does not answer fails at the bound; its late grant is released.
    let (mut core, generation) = fleet(1);
    ask(&mut core, 1, ios(), T0).unwrap();
    let (attempt, _) = forward(&core.take_effects()).unwrap();
    assert_eq!(core.next_deadline(), Some(T0 + 5_000));
    core.handle_tick(T0 + 5_000);
    assert_eq!(
        answers(&core.take_effects()),
        [(
            RequestId::from_raw("req_1"),
            Err(ErrorCode::WorkerUnreachable)
        )]
    );
    core.handle_forward_answered(
        attempt,
        "w1",
        Ok(grant(record("lse_late", "gw:g1:agent", T0))),
        T0 + 6_000,
    );
    let effects = core.take_effects();
    assert!(
        effects.iter().any(|e| matches!(e, Effect::ReleaseOrphan { worker_lease_id, .. } if worker_lease_id == "lse_late")),
        "{effects:?}"
    );
    assert!(answers(&effects).is_empty(), "nobody is answered twice");
    // Until its release is answered, no view indexes it.
    let late = record("lse_late", "gw:g1:agent", T0);
    core.handle_worker_event(generation, event("device.ready", serde_json::json!({})), T0);
    let sent = refresh_sent(&core.take_effects()).unwrap();
    core.handle_refreshed(generation, sent, refresh(vec![late], 1), T0 + 6_000);
    assert!(core.lease("w1.lse_late").is_none());
}

#[test]
fn no_capacity_from_a_stale_view_requeues_and_a_no_wait_request_gets_one_more_walk() {
    let (mut core, _) = fleet(1);
    let mut input = ios();
    input.no_wait = Some(true);
    ask(&mut core, 1, input, T0).unwrap();
    refused(&mut core, ErrorCode::NoCapacity);
    let effects = core.take_effects();
    assert!(refresh_sent(&effects).is_some(), "the view is read again");
    assert!(answers(&effects).is_empty(), "{effects:?}");
    // The same view refused it: it is not tried again; a noWait request then fails.
    core.handle_tick(T0 + 1);
    assert_eq!(
        answers(&core.take_effects()),
        [(RequestId::from_raw("req_1"), Err(ErrorCode::NoCapacity))]
    );
}

/// `req_1` is refused `NO_CAPACITY` by `w1`; `req_2` of the same platform, from another
/// requester, is then not sent there (it would be refused the same way), nor is `req_1` again.
/// Answers the read the refusal asked for.
fn refused_then_another_asks(core: &mut Core) -> Stamp {
    ask(core, 1, ios(), T0).unwrap();
    refused(core, ErrorCode::NoCapacity);
    let sent = refresh_sent(&core.take_effects()).expect("the view is read again");
    let mut second = ios();
    second.requester_id = Some("other".into());
    ask(core, 2, second, T0).unwrap();
    let effects = core.take_effects();
    assert!(
        forward(&effects).is_none(),
        "held until the read: {effects:?}"
    );
    sent
}

#[test]
fn a_no_capacity_refusal_holds_off_every_request_of_that_platform_until_a_read() {
    let (mut core, generation) = fleet(1);
    let sent = refused_then_another_asks(&mut core);
    // The read shows a device freed since: the oldest waiter goes first.
    core.handle_refreshed(generation, sent, refresh(Vec::new(), 2), T0 + 10);
    let (_, input) = forward(&core.take_effects()).expect("sent again after the read");
    assert_eq!(input.platform, Platform::Ios);
}

#[test]
fn the_hold_on_other_waiters_ends_with_the_next_read_even_an_unchanged_one() {
    let (mut core, generation) = fleet(1);
    let sent = refused_then_another_asks(&mut core);
    // The read shows the same view (say the worker refused while it swept its devices after
    // a restart): the other waiter is tried, so no platform waits on a view that never moves;
    // the refused one waits for a read that changes it.
    core.handle_refreshed(generation, sent, refresh(Vec::new(), 1), T0 + 10);
    let (_, input) = forward(&core.take_effects()).expect("the other waiter is sent");
    assert!(
        input
            .requester_id
            .as_deref()
            .is_some_and(|r| r.ends_with("other")),
        "{input:?}"
    );
}

#[test]
fn a_grant_counts_in_its_workers_view_until_a_read_sent_after_it() {
    let (mut core, generation) = fleet(1);
    // A read goes out before the grant is heard of.
    core.handle_worker_event(
        generation,
        event("device.booted", serde_json::json!({})),
        T0,
    );
    let before = refresh_sent(&core.take_effects()).expect("read");
    granted(&mut core);
    // The grant took the worker's one slot: the next waiter is not sent there to be refused.
    let mut second = ios();
    second.requester_id = Some("other".into());
    ask(&mut core, 2, second, T0).unwrap();
    let effects = core.take_effects();
    assert!(
        forward(&effects).is_none(),
        "the grant is counted: {effects:?}"
    );
    // The read sent before the grant shows the slot free: the grant still counts.
    core.handle_refreshed(generation, before, refresh(Vec::new(), 1), T0 + 1);
    let effects = core.take_effects();
    assert!(
        forward(&effects).is_none(),
        "a read from before: {effects:?}"
    );
    // A read sent after it shows the slot free (the lease ended): the waiter goes.
    read_after(
        &mut core,
        generation,
        "lease.released",
        refresh(Vec::new(), 1),
        T0 + 2,
    );
    let (_, input) = forward(&core.take_effects()).expect("sent after a read from after");
    assert_eq!(input.requester_id.as_deref(), Some("gw:g1:other"));
}

#[test]
fn a_no_capacity_refusal_holds_until_a_read_changes_the_view_it_was_remembered_against() {
    let (mut core, generation) = fleet(2);
    // The worker holds one lease of its own: one slot is free.
    let direct = record("lse_d", "someone", T0);
    read_after(
        &mut core,
        generation,
        "lease.granted",
        refresh(vec![direct.clone()], 2),
        T0,
    );
    core.take_effects();
    ask(&mut core, 1, ios(), T0).unwrap();
    refused(&mut core, ErrorCode::NoCapacity);
    let sent = refresh_sent(&core.take_effects()).expect("the view is read again");
    // The read finds the same view, its lease renewed: no change, no second try.
    let mut renewed = direct;
    renewed.last_renewed_at = T0 + 500;
    renewed.ttl_deadline = T0 + 1500;
    core.handle_refreshed(generation, sent, refresh(vec![renewed], 2), T0 + 500);
    let effects = core.take_effects();
    assert!(forward(&effects).is_none(), "{effects:?}");
    assert!(answers(&effects).is_empty(), "it waits: {effects:?}");
    assert_eq!(
        core.view("w1").unwrap().leases.as_ref().unwrap()[0].ttl_deadline,
        T0 + 1500,
        "the view took the renewal"
    );
    // The lease ended: the next read changes the view, and the worker is tried again.
    read_after(
        &mut core,
        generation,
        "lease.released",
        refresh(Vec::new(), 2),
        T0 + 600,
    );
    assert!(forward(&core.take_effects()).is_some());
}

#[test]
fn a_forward_a_worker_fails_internally_goes_to_another_and_that_worker_is_read_again() {
    let (mut core, first) = fleet(1);
    let second = connect(&mut core, "w2", 1);
    ask(&mut core, 1, ios(), T0).unwrap();
    // w1 first (id order); its store failed.
    refused(&mut core, ErrorCode::Internal);
    let effects = core.take_effects();
    let read = effects.iter().find_map(|e| match e {
        Effect::Refresh { generation, .. } => Some(*generation),
        _ => None,
    });
    assert_eq!(read, Some(first), "w1's view is read again: {effects:?}");
    assert!(answers(&effects).is_empty(), "{effects:?}");
    let sent = effects.iter().find_map(|e| match e {
        Effect::Forward { generation, .. } => Some(*generation),
        _ => None,
    });
    assert_eq!(sent, Some(second), "tried on w2: {effects:?}");
}

#[test]
fn a_waiter_a_failed_worker_refused_internally_goes_there_again_once_it_runs_again() {
    let (mut core, generation) = fleet(1);
    let mut input = ios();
    input.requester_id = Some("patient".into());
    ask(&mut core, 1, input, T0).unwrap();
    refused(&mut core, ErrorCode::Internal);
    let sent = refresh_sent(&core.take_effects()).expect("w1 is read again");
    // It failed: it reports its health alone, and gets no request.
    let mut failed = refresh(Vec::new(), 1);
    failed.status.daemon.health = Health::Failed;
    (failed.status.capacity, failed.status.leases) = (None, None);
    core.handle_refreshed(generation, sent, failed, T0 + 1);
    let effects = core.take_effects();
    assert!(forward(&effects).is_none(), "{effects:?}");
    assert!(answers(&effects).is_empty(), "it waits: {effects:?}");
    // A new request that only it could serve is refused at once, saying why (trial 20).
    let mut another = ios();
    another.requester_id = Some("another".into());
    assert_eq!(
        ask(&mut core, 2, another, T0 + 1),
        Err(FleetError::NoCapacity(
            "No worker of this gateway that can serve this request takes requests now: each is away, drained or failed"
        ))
    );
    // Restarted with its disk healthy: its view changes, and the waiter goes there again.
    read_after(
        &mut core,
        generation,
        "lease.expired",
        refresh(Vec::new(), 1),
        T0 + 2,
    );
    let (_, forwarded) = forward(&core.take_effects()).expect("sent again");
    assert_eq!(forwarded.requester_id.as_deref(), Some("gw:g1:patient"));
}

#[test]
fn a_worker_that_says_it_failed_is_read_again_at_once() {
    let (mut core, generation) = fleet(1);
    core.handle_worker_event(
        generation,
        event(
            "daemon.failed",
            serde_json::json!({"error": "state store: database or disk is full"}),
        ),
        T0,
    );
    assert!(refresh_sent(&core.take_effects()).is_some());
}

#[test]
fn a_no_wait_request_a_worker_fails_internally_is_answered_its_error_when_no_other_can_take_it() {
    let (mut core, _) = fleet(1);
    let mut input = ios();
    input.no_wait = Some(true);
    ask(&mut core, 1, input.clone(), T0).unwrap();
    refused(&mut core, ErrorCode::Internal);
    assert_eq!(
        answers(&core.take_effects()),
        [(RequestId::from_raw("req_1"), Err(ErrorCode::Internal))],
        "the worker's error, not NO_CAPACITY"
    );
    // With another worker that can take it, it goes there.
    let second = connect(&mut core, "w2", 1);
    input.requester_id = Some("again".into());
    ask(&mut core, 2, input, T0).unwrap();
    refused(&mut core, ErrorCode::Internal);
    let effects = core.take_effects();
    assert!(answers(&effects).is_empty(), "{effects:?}");
    let sent = effects.iter().find_map(|e| match e {
        Effect::Forward { generation, .. } => Some(*generation),
        _ => None,
    });
    assert_eq!(sent, Some(second), "{effects:?}");
}

#[test]
fn a_worker_that_refuses_the_spec_is_not_tried_again_and_its_refusal_is_answered() {
    let (mut core, _) = fleet(1);
    let mut input = ios();
    input.requires = vec!["gpu".into()];
    // The view lists no capability: the fast-fail table refuses at once.
    assert!(matches!(
        ask(&mut core, 1, input, T0),
        Err(FleetError::CapabilityMissing(cap)) if cap == "gpu"
    ));
    ask(&mut core, 2, ios(), T0).unwrap();
    refused(&mut core, ErrorCode::RuntimeMissing);
    assert_eq!(
        answers(&core.take_effects()),
        [(RequestId::from_raw("req_2"), Err(ErrorCode::RuntimeMissing))],
        "no worker is left"
    );
}

#[test]
fn cancelling_answers_a_queued_request_refuses_another_principal_and_leaves_a_forward() {
    let (mut core, generation) = fleet(1);
    let _held = granted_full(&mut core, generation);
    let mut queued = ios();
    queued.requester_id = Some("second".into());
    ask(&mut core, 2, queued, T0).unwrap();
    core.take_effects();
    let stranger = Caller {
        principal: "stranger",
        admin: false,
        connection: None,
    };
    assert!(matches!(
        core.handle_cancel("second", stranger, T0),
        Err(FleetError::Forbidden(_))
    ));
    assert_eq!(
        core.handle_cancel("second", agent(), T0),
        Ok(CancelResult::Cancelled)
    );
    assert_eq!(
        answers(&core.take_effects()),
        [(RequestId::from_raw("req_2"), Err(ErrorCode::Cancelled))]
    );
    assert_eq!(
        core.handle_cancel("second", agent(), T0),
        Ok(CancelResult::NotFound)
    );

    let (mut core, _) = fleet(1);
    ask(&mut core, 1, ios(), T0).unwrap();
    core.take_effects();
    assert_eq!(
        core.handle_cancel("agent", agent(), T0),
        Ok(CancelResult::NotCancellable),
        "a forwarded request is the worker's now"
    );
}

/// Outside trial 21: a repeat of a queued request (a retry after a timeout) is told at once
/// where the original stands; it used to hear nothing until the original's state changed.
#[test]
fn a_repeat_of_a_queued_request_is_told_where_it_stands_at_once() {
    let (mut core, generation) = fleet(1);
    let _held = granted_full(&mut core, generation);
    let mut input = ios();
    input.requester_id = Some("other".into());
    input.idempotency_key = Some("k1".into());
    ask(&mut core, 2, input.clone(), T0).unwrap();
    core.take_effects();
    assert_eq!(
        ask(&mut core, 3, input, T0 + 1_000),
        Ok(Admitted::Joined(
            RequestId::from_raw("req_2"),
            Some(Progress::Queued {
                queue_position: 1,
                waiting_for: Some(WaitingFor::Capacity),
            })
        ))
    );
}

#[test]
fn an_idempotency_key_joins_replays_and_refuses_a_conflict_or_another_principal() {
    let (mut core, _) = fleet(1);
    let mut input = ios();
    input.idempotency_key = Some("k1".into());
    ask(&mut core, 1, input.clone(), T0).unwrap();
    let (attempt, forwarded) = forward(&core.take_effects()).unwrap();
    assert_eq!(
        ask(&mut core, 2, input.clone(), T0),
        Ok(Admitted::Joined(
            RequestId::from_raw("req_1"),
            Some(Progress::Queued {
                queue_position: 1,
                waiting_for: None
            })
        )),
        "forwarded before anything was told: at the head, handed to a worker"
    );
    core.handle_forward_progress(attempt, Progress::Booting { eta_ms: 900 });
    core.take_effects();
    assert_eq!(
        ask(&mut core, 3, input.clone(), T0),
        Ok(Admitted::Joined(
            RequestId::from_raw("req_1"),
            Some(Progress::Booting { eta_ms: 900 })
        )),
        "the worker's last report"
    );
    core.handle_forward_answered(
        attempt,
        "w1",
        Ok(grant(record("lse_a", &forwarded.requester_id.unwrap(), T0))),
        T0,
    );
    core.take_effects();
    match ask(&mut core, 3, input.clone(), T0) {
        Ok(Admitted::Replay(outcome)) => {
            assert_eq!(outcome.unwrap().lease.id.as_str(), "w1.lse_a");
        }
        other => panic!("{other:?}"),
    }
    let mut other_spec = input.clone();
    other_spec.model = Some("iPad".into());
    assert_eq!(
        ask(&mut core, 4, other_spec, T0),
        Err(FleetError::IdempotencyConflict)
    );
    // Another principal naming the same requester reaches the key and is refused.
    let mut theirs = input;
    theirs.requester_id = Some("agent".into());
    let foreign = core.handle_lease_request(
        Ask {
            request_id: RequestId::from_raw("req_5"),
            input: theirs,
            principal: "intruder".into(),
        },
        T0,
    );
    assert_eq!(foreign, Err(FleetError::IdempotencyForeign));
}

#[test]
fn inputs_past_the_gateways_rules_are_refused_and_change_nothing() {
    let (mut core, _) = fleet(1);
    let mut long = ios();
    long.ttl_ms = Some(60_001);
    assert!(
        matches!(ask(&mut core, 1, long, T0), Err(FleetError::BadRequest(m)) if m.starts_with("ttlMs"))
    );
    let mut at_cap = ios();
    at_cap.ttl_ms = Some(60_000);
    at_cap.requester_id = Some("capped".into());
    assert!(ask(&mut core, 2, at_cap, T0).is_ok(), "at the cap");
    let mut owned = ios();
    owned.owner = Some("someone".into());
    assert!(matches!(
        ask(&mut core, 3, owned, T0),
        Err(FleetError::Forbidden(_))
    ));
    let room = simlock_contract::bounds::MAX_REQUESTER - "gw:g1:".len();
    let mut fits = ios();
    fits.requester_id = Some("r".repeat(room));
    assert!(
        ask(&mut core, 4, fits, T0).is_ok(),
        "a requester at the room left"
    );
    let mut past = ios();
    past.requester_id = Some("r".repeat(room + 1));
    assert!(
        matches!(ask(&mut core, 5, past, T0), Err(FleetError::BadRequest(m)) if m.starts_with("requesterId"))
    );
    assert_eq!(core.waiters().len(), 2);
}

#[test]
fn a_lookup_answers_unknown_only_when_the_gateway_can_vouch_for_it() {
    let (mut core, generation) = fleet(1);
    assert!(matches!(
        core.lease_target("w1.lse_none", agent()),
        Err(FleetError::UnknownLease(_))
    ));
    assert!(
        matches!(
            core.lease_target("w9.lse_none", agent()),
            Err(FleetError::WorkerUnreachable { worker_id, message })
                if worker_id == "w9" && message.starts_with(
                    "No worker w9 is known to this gateway: check the lease id"
                )
        ),
        "a worker it has no view of: a typo, or one yet to come back after a restart"
    );
    let lease_id = granted(&mut core);
    let stranger = Caller {
        principal: "stranger",
        admin: false,
        connection: None,
    };
    assert!(matches!(
        core.lease_target(&lease_id, stranger),
        Err(FleetError::UnknownLease(_))
    ));
    core.handle_uplink_closed(generation, T0, T0);
    assert!(matches!(
        core.lease_target(&lease_id, agent()),
        Err(FleetError::WorkerUnreachable { message, .. })
            if message == "Worker w1 is not connected to this gateway"
    ));
    assert!(
        core.lease(&lease_id).is_some(),
        "a lost uplink ends no lease"
    );
}

#[test]
fn a_read_of_a_lease_answers_as_renew_does_while_its_worker_has_not_reported_since_a_restart() {
    // The gateway restarted: it knows w1 from its store, and w1 has not reconnected.
    let stored = KnownWorker {
        id: "w1".into(),
        label: Some("one".into()),
        seen_at: T0 - 1000,
        connected: true,
    };
    let mut core = Core::new(settings(), Vec::new(), vec![stored], T0);
    let lease_id = "w1.lse_0123456789abcdef0123456789abcdef";
    let viewer = agent().viewer();
    let unreachable = |read: Result<LeaseRecord, FleetError>| {
        matches!(read, Err(FleetError::WorkerUnreachable { worker_id, message })
            if worker_id == "w1" && message == "Worker w1 is not connected to this gateway")
    };
    assert!(unreachable(core.lease_seen(lease_id, viewer)), "not gone");
    assert!(matches!(
        core.lease_target(lease_id, agent()),
        Err(FleetError::WorkerUnreachable { worker_id, .. }) if worker_id == "w1"
    ));
    assert!(
        matches!(
            core.lease_seen("w9.lse_none", viewer),
            Err(FleetError::WorkerUnreachable { worker_id, message })
                if worker_id == "w9" && message.starts_with("No worker w9 is known to this gateway")
        ),
        "a worker it does not know either"
    );

    // Its uplink is open but its handshake has not passed: it has not reported yet.
    let generation = core.handle_uplink_opened("w1", Some("one".into()), "tok_j".into(), T0 + 1);
    assert!(
        unreachable(core.lease_seen(lease_id, viewer)),
        "not reported"
    );

    // Its handshake passed, but it failed (its store did): it reports its health alone, not
    // its leases, and the gateway cannot vouch for any (trial 19).
    let mut failed = status(Vec::new(), 1);
    failed.daemon.health = Health::Failed;
    (failed.capacity, failed.devices, failed.leases) = (None, None, None);
    let sent = core.handle_probe_sent();
    core.handle_connected(generation, "v".into(), &failed, sent, T0 + 2);
    for read in [
        core.lease_seen(lease_id, viewer).map(|_| ()),
        core.lease_target(lease_id, agent()).map(|_| ()),
    ] {
        assert!(
            matches!(&read, Err(FleetError::WorkerUnreachable { worker_id, message })
                if worker_id == "w1" && message.contains("has not reported its leases")),
            "{read:?}"
        );
    }

    // It reported, without that lease: now the gateway can vouch that it is gone.
    let sent = core.handle_probe_sent();
    core.handle_connected(generation, "v".into(), &status(Vec::new(), 1), sent, T0 + 2);
    assert_eq!(
        core.lease_seen(lease_id, viewer),
        Err(FleetError::UnknownLease(lease_id.to_owned()))
    );
    assert!(matches!(
        core.lease_target(lease_id, agent()),
        Err(FleetError::UnknownLease(_))
    ));
}

#[test]
fn a_read_of_a_lease_shows_it_to_its_owner_and_to_nobody_else() {
    let (mut core, generation) = fleet(1);
    let lease_id = granted(&mut core);
    let seen = core.lease_seen(&lease_id, agent().viewer()).unwrap();
    assert_eq!(seen.id.as_str(), lease_id);
    assert_eq!(seen.worker_id.as_deref(), Some("w1"));
    let stranger = Caller {
        principal: "stranger",
        admin: false,
        connection: None,
    };
    assert_eq!(
        core.lease_seen(&lease_id, stranger.viewer()),
        Err(FleetError::UnknownLease(lease_id.clone()))
    );
    core.handle_uplink_closed(generation, T0, T0);
    assert_eq!(
        core.lease_seen(&lease_id, agent().viewer()).map(|l| l.id),
        Ok(seen.id),
        "a lease the index holds is shown while its worker is away, as the list shows it"
    );
}

#[test]
fn a_workers_unknown_lease_is_its_word_and_the_owner_hears_it() {
    let (mut core, _) = fleet(1);
    let lease_id = granted(&mut core);
    let target = core.lease_target(&lease_id, agent()).unwrap();
    let err = core
        .handle_renew_answered(
            &target,
            Err(FleetError::Worker(ContractError::unknown_lease("lse_a"))),
            T0,
        )
        .unwrap_err();
    assert_eq!(err, FleetError::UnknownLease(lease_id.clone()));
    assert!(core.lease(&lease_id).is_none());
    assert!(
        core.take_effects()
            .iter()
            .any(|e| matches!(e, Effect::Notice { .. }))
    );
    // A timeout is no such word.
    let (mut core, _) = fleet(1);
    let lease_id = granted(&mut core);
    let target = core.lease_target(&lease_id, agent()).unwrap();
    let err = core
        .handle_renew_answered(
            &target,
            Err(FleetError::no_answer("w1", "lease.renew", 10)),
            T0,
        )
        .unwrap_err();
    assert!(
        matches!(err, FleetError::WorkerUnreachable { ref message, .. } if message.contains("did not answer lease.renew"))
    );
    assert!(core.lease(&lease_id).is_some());
}

#[test]
fn asks_for_a_refresh_while_one_runs_fold_into_one_more() {
    let (mut core, generation) = fleet(1);
    let before = core.refreshes_asked(generation);
    for _ in 0..3 {
        core.handle_worker_event(generation, event("device.ready", serde_json::json!({})), T0);
    }
    let effects = core.take_effects();
    let sent: Vec<Stamp> = effects
        .iter()
        .filter_map(|e| match e {
            Effect::Refresh { sent, .. } => Some(*sent),
            _ => None,
        })
        .collect();
    assert_eq!(sent.len(), 1, "one read out at a time");
    assert_eq!(core.refreshes_asked(generation), before + 3);
    core.handle_refreshed(generation, sent[0], refresh(Vec::new(), 1), T0);
    assert!(
        refresh_sent(&core.take_effects()).is_some(),
        "one more for the folded asks"
    );
}

#[test]
fn a_renew_event_updates_the_view_in_place_without_a_refresh() {
    let (mut core, generation) = fleet(1);
    let lease_id = granted(&mut core);
    core.handle_worker_event(
        generation,
        event("lease.granted", serde_json::json!({})),
        T0,
    );
    let sent = refresh_sent(&core.take_effects()).unwrap();
    let held = record("lse_a", "gw:g1:agent", T0);
    // A lease made on the worker directly, which the gateway lists from the view alone.
    let direct = record("lse_d", "local", T0);
    core.handle_refreshed(generation, sent, refresh(vec![held, direct], 1), T0);
    core.take_effects();
    let asked = core.refreshes_asked(generation);
    for lease in ["lse_a", "lse_d"] {
        // Renewed with a new width (`renew --ttl`): the event says both.
        let mut renewed = event(
            "lease.renewed",
            serde_json::json!({"leaseId": lease, "newDeadline": T0 + 9000, "ttlMs": 8990}),
        );
        renewed.timestamp = T0 + 10;
        core.handle_worker_event(generation, renewed, T0 + 10);
    }
    assert_eq!(core.refreshes_asked(generation), asked);
    let view = core.view("w1").unwrap();
    for lease in view.leases.as_ref().unwrap() {
        assert_eq!(
            (lease.ttl_deadline, lease.ttl_ms),
            (T0 + 9000, 8990),
            "{lease:?}"
        );
    }
    let indexed = &core.lease(&lease_id).unwrap().record;
    assert_eq!((indexed.ttl_deadline, indexed.ttl_ms), (T0 + 9000, 8990));
    let listed: Vec<(String, u64)> = core
        .leases(Viewer::ADMIN)
        .into_iter()
        .map(|l| (l.id.to_string(), l.ttl_ms))
        .collect();
    assert_eq!(
        listed,
        [("w1.lse_a".to_owned(), 8990), ("lse_d".to_owned(), 8990)],
        "both lists show the new width"
    );
    let relayed: Vec<serde_json::Value> = core
        .take_effects()
        .into_iter()
        .filter_map(|e| match e {
            Effect::Relay(envelope) => Some(envelope.payload),
            _ => None,
        })
        .collect();
    assert_eq!(
        relayed,
        [
            serde_json::json!({"leaseId": "lse_a", "gatewayLeaseId": "w1.lse_a", "newDeadline": T0 + 9000, "ttlMs": 8990, "workerId": "w1"}),
            serde_json::json!({"leaseId": "lse_d", "newDeadline": T0 + 9000, "ttlMs": 8990, "workerId": "w1"}),
        ],
        "relayed with the worker's id, a lease the gateway issued with the gateway's id too"
    );
}

#[test]
fn two_status_timeouts_in_a_row_close_the_uplink_and_a_read_resets_the_count() {
    let (mut core, generation) = fleet(1);
    let timeout = |core: &mut Core| {
        core.handle_worker_event(generation, event("device.ready", serde_json::json!({})), T0);
        let sent = refresh_sent(&core.take_effects()).unwrap();
        core.handle_refresh_failed(generation, sent, RefreshFailure::StatusTimeout, false, T0);
        core.take_effects()
    };
    assert!(
        !timeout(&mut core)
            .iter()
            .any(|e| matches!(e, Effect::Close { .. }))
    );
    core.handle_worker_event(generation, event("device.ready", serde_json::json!({})), T0);
    let sent = refresh_sent(&core.take_effects()).unwrap();
    core.handle_refreshed(generation, sent, refresh(Vec::new(), 1), T0);
    core.take_effects();
    assert!(
        !timeout(&mut core)
            .iter()
            .any(|e| matches!(e, Effect::Close { .. }))
    );
    assert!(
        timeout(&mut core)
            .iter()
            .any(|e| matches!(e, Effect::Close { generation: g, why: Closing::Unresponsive } if *g == generation))
    );
}

#[test]
fn a_failed_catalog_read_is_asked_again_once_and_a_lost_uplink_is_not_retried() {
    let (mut core, generation) = fleet(1);
    core.handle_tick(T0 + 30_000);
    let sent = refresh_sent(&core.take_effects()).expect("the periodic full read");
    let failed = RefreshFailure::Failed(ContractError::internal("catalog broke"));
    core.handle_refresh_failed(generation, sent, failed.clone(), true, T0);
    let again = refresh_sent(&core.take_effects()).expect("asked again once");
    core.handle_refresh_failed(generation, again, failed, true, T0);
    assert!(
        refresh_sent(&core.take_effects()).is_none(),
        "then it waits"
    );
    core.handle_worker_event(generation, event("device.ready", serde_json::json!({})), T0);
    let effects = core.take_effects();
    assert!(
        effects
            .iter()
            .any(|e| matches!(e, Effect::Refresh { catalog: true, .. })),
        "the next read takes the catalog: {effects:?}"
    );
}

#[test]
fn a_stale_uplinks_inputs_change_nothing_and_a_reconnect_closes_the_old_one() {
    let (mut core, first) = fleet(1);
    let second = core.handle_uplink_opened("w1", None, "tok_j".into(), T0);
    let effects = core.take_effects();
    assert!(effects.contains(&Effect::Close {
        generation: first,
        why: Closing::Replaced
    }));
    assert_eq!(
        core.view("w1").unwrap().label.as_deref(),
        Some("one"),
        "the label stays"
    );
    core.handle_uplink_closed(first, T0, T0);
    assert_eq!(core.worker_of_generation(second), Some("w1"));
    core.handle_connected(first, "old".into(), &status(Vec::new(), 1), 0, T0);
    assert_ne!(core.view("w1").unwrap().version.as_deref(), Some("old"));
}

#[test]
fn stopping_answers_every_waiter_closes_every_uplink_and_refuses_new_requests() {
    let (mut core, generation) = fleet(1);
    ask(&mut core, 1, ios(), T0).unwrap();
    core.take_effects();
    core.handle_stop(T0);
    let effects = core.take_effects();
    assert_eq!(
        answers(&effects),
        [(RequestId::from_raw("req_1"), Err(ErrorCode::DaemonStopping))]
    );
    assert!(effects.contains(&Effect::Close {
        generation,
        why: Closing::Stopping
    }));
    assert_eq!(ask(&mut core, 2, ios(), T0), Err(FleetError::Stopping));
}

#[test]
fn a_disconnected_worker_is_forgotten_after_retention_unless_it_holds_a_live_lease() {
    let (mut core, generation) = fleet(1);
    let mut input = ios();
    input.ttl_ms = Some(60_000);
    ask(&mut core, 1, input, T0).unwrap();
    let (attempt, forwarded) = forward(&core.take_effects()).unwrap();
    let mut held = record("lse_a", &forwarded.requester_id.unwrap(), T0);
    held.ttl_deadline = T0 + 120_000;
    core.handle_forward_answered(attempt, "w1", Ok(grant(held)), T0);
    core.handle_uplink_closed(generation, T0, T0);
    core.take_effects();
    core.handle_tick(T0 + 60_000);
    assert!(core.view("w1").is_some(), "its lease lives on");
    core.handle_tick(T0 + 120_001);
    assert!(core.view("w1").is_none());
    assert!(core.lease("w1.lse_a").is_none());

    let mut core = Core::new(settings(), vec![("w2".into(), T0)], Vec::new(), T0);
    let generation = core.handle_uplink_opened("w2", None, "tok_j".into(), T0);
    core.handle_uplink_closed(generation, T0, T0);
    core.handle_tick(T0 + 60_000);
    assert!(
        core.view("w2").is_some_and(|v| v.drained),
        "a drained worker keeps its flag"
    );
}

#[test]
fn drain_and_removal_follow_their_rules() {
    let (mut core, generation) = fleet(1);
    assert_eq!(core.drain_changes("w1", true), Ok(true));
    core.handle_drained("w1", true, T0);
    assert_eq!(core.drain_changes("w1", true), Ok(false), "idempotent");
    let mut input = ios();
    input.no_wait = Some(true);
    assert!(
        matches!(ask(&mut core, 1, input, T0), Err(FleetError::NoCapacity(_))),
        "a drained worker takes no request"
    );
    assert_eq!(
        core.drain_changes("nobody", true),
        Err(FleetError::UnknownWorker("nobody".into()))
    );
    assert_eq!(
        core.handle_remove("w1", T0),
        Err(FleetError::WorkerConnected("w1".into()))
    );
    core.handle_uplink_closed(generation, T0, T0);
    assert_eq!(core.handle_remove("w1", T0), Ok(true));
    assert_eq!(core.handle_remove("w1", T0), Ok(false));
}

#[test]
fn a_refresh_events_ask_for_waits_the_gap_after_the_last_one() {
    let mut settings = settings();
    settings.refresh_gap_ms = 50;
    let mut core = Core::new(settings, Vec::new(), Vec::new(), T0);
    let generation = core.handle_uplink_opened("w1", None, "tok_j".into(), T0);
    let sent = core.handle_probe_sent();
    core.handle_connected(generation, "v".into(), &status(Vec::new(), 1), sent, T0);
    core.handle_subscribed(generation, T0);
    let sent = refresh_sent(&core.take_effects()).expect("the first read goes at once");
    core.handle_refreshed(generation, sent, refresh(Vec::new(), 1), T0 + 5);
    core.take_effects();
    for n in 0..3 {
        core.handle_worker_event(
            generation,
            event("device.ready", serde_json::json!({})),
            T0 + 10 + n,
        );
    }
    assert!(
        refresh_sent(&core.take_effects()).is_none(),
        "within the gap"
    );
    assert_eq!(core.next_deadline(), Some(T0 + 55));
    core.handle_tick(T0 + 55);
    assert!(
        refresh_sent(&core.take_effects()).is_some(),
        "one read for the three asks"
    );
}

fn requested_ios() -> simlock_contract::model::RequestedDevice {
    simlock_contract::model::RequestedDevice {
        platform: Platform::Ios,
        model: None,
        os_version: None,
        requires: Vec::new(),
    }
}

fn notices(effects: &[Effect]) -> Vec<(String, Push)> {
    effects
        .iter()
        .filter_map(|e| match e {
            Effect::Notice { owner, push, .. } => Some((owner.clone(), push.clone())),
            _ => None,
        })
        .collect()
}

#[test]
fn a_leased_devices_crash_and_recovery_reach_the_gateway_leases_owner() {
    let (mut core, generation) = fleet(1);
    let lease_id = granted(&mut core);
    let crashed = Event::DeviceCrashDetected {
        device_id: DeviceId::from_raw("dev_1"),
        seen: CrashedDevice::Leased {
            lease_id: Some("lse_a".into()),
        },
        reason: simlock_contract::push::UnhealthyReason::Crashed,
    };
    let (name, payload) = crashed.parts();
    core.handle_worker_event(generation, event(&name, payload), T0);
    let effects = core.take_effects();
    assert_eq!(
        notices(&effects),
        [(
            "agent".to_owned(),
            Push::DeviceUnhealthy {
                lease_id: lease_id.clone(),
                device_id: DeviceId::from_raw("dev_1"),
                reason: simlock_contract::push::UnhealthyReason::Crashed,
            }
        )],
        "under the gateway's lease id, to the owner the index names"
    );
    assert!(
        refresh_sent(&effects).is_some(),
        "a device event reads the view"
    );
    let recovered = Event::DeviceRecovered {
        device_id: DeviceId::from_raw("dev_1"),
        lease_id: "lse_a".into(),
        attempts: 2,
    };
    let (name, payload) = recovered.parts();
    core.handle_worker_event(generation, event(&name, payload), T0);
    assert_eq!(
        notices(&core.take_effects()),
        [(
            "agent".to_owned(),
            Push::DeviceRecovered {
                lease_id,
                device_id: DeviceId::from_raw("dev_1"),
                attempts: 2,
            }
        )]
    );
}

#[test]
fn a_crash_of_a_lease_the_index_does_not_hold_or_of_a_free_device_reaches_nobody() {
    let (mut core, generation) = fleet(1);
    granted(&mut core);
    // A lease made on the worker directly, whatever owner its event names.
    let foreign = serde_json::json!({"deviceId": "dev_2", "leaseId": "lse_other", "reason": "crashed", "ownerId": "agent"});
    core.handle_worker_event(generation, event("device.crash-detected", foreign), T0);
    let recovered = serde_json::json!({"deviceId": "dev_2", "leaseId": "lse_other", "attempts": 1});
    core.handle_worker_event(generation, event("device.recovered", recovered), T0);
    // A free device seen stopped names no lease.
    let free = Event::DeviceCrashDetected {
        device_id: DeviceId::from_raw("dev_3"),
        seen: CrashedDevice::Free {
            spec: DeviceSpec {
                platform: Platform::Ios,
                model: "iPhone 16".into(),
                os_version: "18.2".into(),
            },
        },
        reason: simlock_contract::push::UnhealthyReason::Crashed,
    };
    let (name, payload) = free.parts();
    core.handle_worker_event(generation, event(&name, payload), T0);
    let effects = core.take_effects();
    assert_eq!(notices(&effects), []);
    assert_eq!(
        effects
            .iter()
            .filter(|e| matches!(e, Effect::Relay(_)))
            .count(),
        3,
        "each is relayed onto the gateway's bus all the same"
    );
}

#[test]
fn an_agent_sees_only_its_own_leases_and_requests_in_the_workers_views_and_the_waiting_list() {
    let (mut core, generation) = fleet(2);
    granted(&mut core);
    // Another agent waits in the fleet queue (the worker's view is full).
    let full = refresh(
        vec![
            record("lse_a", "gw:g1:agent", T0),
            record("lse_direct", "local", T0),
        ],
        2,
    );
    core.handle_worker_event(generation, event("device.ready", serde_json::json!({})), T0);
    let sent = refresh_sent(&core.take_effects()).unwrap();
    let mut full = full;
    full.status.waiting = Some(vec![
        WaitingRequest {
            id: RequestId::from_raw("req_w1"),
            requester_id: "gw:g1:other".into(),
            spec: requested_ios(),
            created_at: T0,
            stage: WaitStage::Queued,
            queue_position: Some(1),
            waiting_for: None,
            worker_id: None,
            worker: None,
        },
        WaitingRequest {
            id: RequestId::from_raw("req_w2"),
            requester_id: "local".into(),
            spec: requested_ios(),
            created_at: T0,
            stage: WaitStage::Queued,
            queue_position: Some(2),
            waiting_for: None,
            worker_id: None,
            worker: None,
        },
    ]);
    core.handle_refreshed(generation, sent, full, T0);
    core.take_effects();
    core.handle_lease_request(
        Ask {
            request_id: RequestId::from_raw("req_o"),
            input: ios(),
            principal: "other".into(),
        },
        T0,
    )
    .unwrap();
    core.take_effects();

    let agent = agent().viewer();
    let view = &core.views_seen_by(agent)[0];
    let leases: Vec<&str> = view
        .leases
        .as_deref()
        .unwrap()
        .iter()
        .map(|l| l.id.as_str())
        .collect();
    assert_eq!(leases, ["lse_a"], "its own, not the worker's local lease");
    assert_eq!(
        view.waiting.as_deref(),
        Some(&[][..]),
        "not another's request"
    );
    assert!(
        core.all_waiting(agent).is_empty(),
        "neither the fleet queue's nor the worker's requests of others"
    );

    let other = Viewer {
        principal: "other",
        admin: false,
    };
    let view = &core.views_seen_by(other)[0];
    assert_eq!(view.leases.as_deref(), Some(&[][..]));
    let waiting: Vec<&str> = view
        .waiting
        .as_deref()
        .unwrap()
        .iter()
        .map(|w| w.id.as_str())
        .collect();
    assert_eq!(
        waiting,
        ["req_w1"],
        "the request forwarded for its pending one"
    );
    let all: Vec<String> = core
        .all_waiting(other)
        .into_iter()
        .map(|w| format!("{}@{}", w.id, w.worker_id.unwrap_or_default()))
        .collect();
    assert_eq!(all, ["req_o@", "req_w1@w1"]);

    let admin = Viewer::ADMIN;
    assert_eq!(
        core.views_seen_by(admin),
        core.views(),
        "as the workers report them"
    );
    assert_eq!(core.all_waiting(admin).len(), 3);
    let listed: Vec<String> = core
        .leases(admin)
        .into_iter()
        .map(|l| l.id.to_string())
        .collect();
    assert_eq!(listed, ["w1.lse_a", "lse_direct"]);
    // One lease read by its id is the list's record of it, for whoever reads.
    for viewer in [admin, agent, other] {
        for lease in core.leases(viewer) {
            assert_eq!(
                core.lease_seen(lease.id.as_str(), viewer).ok(),
                Some(lease),
                "{}",
                viewer.principal
            );
        }
    }
    assert!(matches!(
        core.lease_seen("lse_direct", agent),
        Err(FleetError::UnknownLease(_))
    ));

    // Once the worker is away, what it last reported waiting is no longer said to wait (its
    // forward failed, a restart ends it); its view keeps its last report.
    core.handle_uplink_closed(generation, T0 + 1, T0 + 1);
    core.take_effects();
    let still: Vec<String> = core
        .all_waiting(admin)
        .into_iter()
        .map(|w| w.id.to_string())
        .collect();
    assert!(!still.iter().any(|id| id.starts_with("req_w")), "{still:?}");
    assert_eq!(core.views()[0].waiting.as_deref().map(<[_]>::len), Some(2));
}

/// A read of `w1` whose status lists `agent-device` as `available` (with `reason` when not),
/// with its lease limits.
fn refresh_with_agent_device(available: bool, reason: Option<&str>) -> Refresh {
    let mut read = refresh(Vec::new(), 1);
    read.status.capabilities = Some(vec![CapabilityStatus {
        name: "agent-device".into(),
        available,
        reason: reason.map(str::to_owned),
    }]);
    read.limits = Some(LeaseLimits {
        default_ttl_ms: 1000,
        max_ttl_ms: 60_000,
    });
    read
}

fn capability_changed(available: bool, reason: Option<&str>) -> EventEnvelope {
    let (name, payload) = Event::CapabilityChanged {
        name: "agent-device".into(),
        available,
        reason: reason.map(str::to_owned),
    }
    .parts();
    let mut envelope = event(&name, payload);
    envelope.module = "capabilities".into();
    envelope
}

fn capable_of_agent_device(core: &Core) -> bool {
    core.view("w1")
        .and_then(|v| routing::capable(v, "agent-device"))
        .is_some()
}

#[test]
fn a_capability_change_asks_for_a_spaced_view_read_long_before_the_periodic_one() {
    let mut settings = settings();
    settings.refresh_gap_ms = 50;
    let mut core = Core::new(settings, Vec::new(), Vec::new(), T0);
    let generation = core.handle_uplink_opened("w1", None, "tok_j".into(), T0);
    let sent = core.handle_probe_sent();
    core.handle_connected(generation, "v".into(), &status(Vec::new(), 1), sent, T0);
    core.handle_subscribed(generation, T0);
    // The worker joined while its agent-device daemon was starting.
    let sent = refresh_sent(&core.take_effects()).expect("the first read goes at once");
    let starting = refresh_with_agent_device(false, Some("the agent-device daemon is starting"));
    core.handle_refreshed(generation, sent, starting, T0 + 5);
    core.take_effects();
    assert!(!capable_of_agent_device(&core));
    assert_eq!(
        core.next_deadline(),
        Some(T0 + 30_000),
        "only the periodic read is due"
    );

    // Its daemon started: the change is read after the gap, not at the periodic read.
    core.handle_worker_event(generation, capability_changed(true, None), T0 + 10);
    let effects = core.take_effects();
    assert!(
        effects.iter().any(
            |e| matches!(e, Effect::Relay(env) if env.event == "capability.changed"
                && env.payload["workerId"] == "w1")
        ),
        "relayed onto the gateway's bus with its worker: {effects:?}"
    );
    assert!(refresh_sent(&effects).is_none(), "within the gap");
    assert_eq!(core.next_deadline(), Some(T0 + 55));
    core.handle_tick(T0 + 55);
    let effects = core.take_effects();
    let (sent, catalog) = effects
        .iter()
        .find_map(|e| match e {
            Effect::Refresh { sent, catalog, .. } => Some((*sent, *catalog)),
            _ => None,
        })
        .expect("a read once the gap passed");
    assert!(!catalog, "a capability change reads no catalog");
    core.handle_refreshed(
        generation,
        sent,
        refresh_with_agent_device(true, None),
        T0 + 60,
    );
    core.take_effects();
    assert!(capable_of_agent_device(&core), "capable after one read");

    // Its daemon went down: out of the capable workers after the next read, at once here.
    core.handle_worker_event(
        generation,
        capability_changed(false, Some("the agent-device daemon is stopped")),
        T0 + 200,
    );
    let sent = refresh_sent(&core.take_effects()).expect("past the gap, read at once");
    assert!(
        capable_of_agent_device(&core),
        "the event itself changes nothing: the read does"
    );
    let stopped = refresh_with_agent_device(false, Some("the agent-device daemon is stopped"));
    core.handle_refreshed(generation, sent, stopped, T0 + 205);
    assert!(!capable_of_agent_device(&core));
    let listed = core.view("w1").unwrap().capabilities.clone().unwrap();
    assert_eq!(
        listed[0].reason.as_deref(),
        Some("the agent-device daemon is stopped")
    );
}

#[test]
fn a_capability_change_of_an_unknown_uplink_is_ignored() {
    let (mut core, generation) = fleet(1);
    core.handle_worker_event(generation + 1, capability_changed(true, None), T0);
    assert!(core.take_effects().is_empty());
}

#[test]
fn a_release_abandoned_on_one_connection_keeps_the_one_sent_since_on_another() {
    let (mut core, generation) = fleet(1);
    let lease_id = granted_full(&mut core, generation);
    let first = send_release(&mut core, &lease_id, agent());
    let other = Caller {
        connection: Some(8),
        ..agent()
    };
    let second = send_release(&mut core, &lease_id, other);
    // The first caller hangs up; the second's release is still under way, and answered.
    core.handle_release_abandoned(&first, agent().connection);
    core.take_effects();
    core.handle_release_answered(&second, LeaseEndReason::Explicit, Ok(()), T0)
        .unwrap();
    let lost: Vec<_> = core
        .take_effects()
        .into_iter()
        .filter_map(|e| match e {
            Effect::Notice {
                push: Push::LeaseLost { reason, .. },
                except,
                ..
            } => Some((reason, except)),
            _ => None,
        })
        .collect();
    assert_eq!(
        lost,
        vec![(LeaseEndReason::Explicit, Some(8))],
        "an explicit release, not told to the connection that sent it"
    );
}

#[test]
fn a_release_whose_caller_hung_up_leaves_the_leases_later_end_told_as_it_is() {
    let (mut core, generation) = fleet(1);
    let lease_id = granted_full(&mut core, generation);
    let target = send_release(&mut core, &lease_id, agent());
    // The caller hangs up before the worker answers (the release never reached it).
    core.handle_release_abandoned(&target, agent().connection);
    core.take_effects();
    // The lease then runs out: a read sent after its deadline no longer lists it.
    core.handle_worker_event(generation, event("device.ready", serde_json::json!({})), T0);
    let sent = refresh_sent(&core.take_effects()).unwrap();
    core.handle_refreshed(generation, sent, refresh(Vec::new(), 1), T0 + 1_000);
    let lost = core
        .take_effects()
        .into_iter()
        .find_map(|e| match e {
            Effect::Notice {
                push: Push::LeaseLost { reason, .. },
                except,
                ..
            } => Some((reason, except)),
            _ => None,
        })
        .expect("the owner hears the end");
    assert_eq!(
        lost,
        (LeaseEndReason::Expired, None),
        "an expiry, heard by every connection of the owner, the one that hung up included"
    );
}

#[test]
fn a_drained_worker_forgotten_past_retention_is_not_swept_again() {
    let (mut core, generation) = fleet(1);
    core.handle_drained("w1", true, T0);
    core.handle_uplink_closed(generation, T0, T0);
    core.take_effects();
    let retention = settings().disconnected_retention_ms;
    core.handle_tick(T0 + retention);
    assert_eq!(
        core.take_effects(),
        [Effect::Forget {
            worker_id: "w1".into()
        }],
        "what is stored of it goes; its drain flag is kept apart"
    );
    let kept = core
        .view("w1")
        .expect("a drained worker keeps its flag")
        .clone();
    assert!(kept.drained);
    assert_eq!(
        kept.last_seen_at, T0,
        "it was last seen when its uplink closed"
    );
    assert_eq!(
        core.next_deadline(),
        None,
        "nothing is due for what is kept"
    );
    // Retention after retention, nothing changes.
    for n in 2..5 {
        core.handle_tick(T0 + n * retention);
        assert_eq!(core.view("w1"), Some(&kept));
        assert!(core.take_effects().is_empty());
    }
    // A drained worker loaded after a restart is kept the same way.
    let mut core = Core::new(settings(), vec![("w2".into(), T0)], Vec::new(), T0);
    assert_eq!(core.next_deadline(), None);
    core.handle_tick(T0 + 3 * retention);
    assert_eq!(
        core.view("w2").map(|v| (v.drained, v.last_seen_at)),
        Some((true, T0))
    );
}

#[test]
fn a_kept_drain_flag_undrained_is_forgotten_at_the_next_sweep() {
    let retention = settings().disconnected_retention_ms;
    // Kept past retention by a sweep, and loaded after a restart: each undrained goes.
    let (mut core, generation) = fleet(1);
    core.handle_drained("w1", true, T0);
    core.handle_uplink_closed(generation, T0, T0);
    core.handle_tick(T0 + retention);
    assert!(core.view("w1").is_some_and(|v| v.drained));
    let mut loaded = Core::new(settings(), vec![("w2".into(), T0)], Vec::new(), T0);
    for (core, id) in [(&mut core, "w1"), (&mut loaded, "w2")] {
        core.take_effects();
        let now = T0 + 2 * retention;
        core.handle_drained(id, false, now);
        assert!(
            core.next_deadline().is_some_and(|at| at <= now),
            "{id}: retention is due at once"
        );
        core.handle_tick(now);
        assert_eq!(core.view(id), None, "{id} is forgotten");
        assert!(
            core.take_effects()
                .iter()
                .any(|e| matches!(e, Effect::Event(Event::WorkerRemoved { worker_id, .. }) if worker_id == id)),
            "{id}: its removal is told"
        );
    }
}

/// A lease made on a worker directly is listed to admins at the gateway with the worker's own
/// id; an admin may release it there too (it goes to that worker, under that id), and nobody
/// else may.
#[test]
fn an_admin_may_act_on_a_lease_made_on_a_worker_directly_and_an_agent_may_not() {
    let (mut core, generation) = fleet(2);
    core.handle_worker_event(
        generation,
        event("lease.granted", serde_json::json!({})),
        T0,
    );
    let sent = refresh_sent(&core.take_effects()).unwrap();
    core.handle_refreshed(
        generation,
        sent,
        refresh(vec![record("lse_d", "local", T0)], 2),
        T0,
    );
    core.take_effects();
    let admin = Caller {
        principal: "operator",
        admin: true,
        connection: None,
    };
    let target = core.lease_target("lse_d", admin).unwrap();
    assert_eq!(
        (
            target.worker_id.as_str(),
            target.generation,
            target.worker_lease_id.as_str()
        ),
        ("w1", generation, "lse_d")
    );
    assert!(matches!(
        core.lease_target("lse_d", agent()),
        Err(FleetError::UnknownLease(_))
    ));
    assert!(matches!(
        core.lease_target("lse_none", admin),
        Err(FleetError::UnknownLease(_))
    ));
    // Released there, it ends without an index entry to forget.
    let target = send_release(&mut core, "lse_d", admin);
    assert_eq!(
        core.handle_release_answered(&target, LeaseEndReason::Explicit, Ok(()), T0 + 1),
        Ok("lse_d".to_owned())
    );
}

/// What the core asked to store or delete of its workers, in order.
fn stored_changes(effects: &[Effect]) -> Vec<Effect> {
    only(effects, |e| {
        matches!(e, Effect::Remember(_) | Effect::Forget { .. })
    })
}

/// The effects `keep` keeps, in order.
fn only(effects: &[Effect], keep: impl Fn(&Effect) -> bool) -> Vec<Effect> {
    effects.iter().filter(|e| keep(e)).cloned().collect()
}

#[test]
fn a_worker_is_stored_when_its_handshake_passes_and_when_its_uplink_closes() {
    let mut core = Core::new(settings(), Vec::new(), Vec::new(), T0);
    let generation = core.handle_uplink_opened("w1", Some("one".into()), "tok_j".into(), T0);
    let sent = core.handle_probe_sent();
    core.handle_connected(generation, "v".into(), &status(Vec::new(), 1), sent, T0 + 1);
    core.handle_uplink_closed(generation, T0 + 50, T0 + 50);
    let known = |seen_at, connected| {
        Effect::Remember(KnownWorker {
            id: "w1".into(),
            label: Some("one".into()),
            seen_at,
            connected,
        })
    };
    assert_eq!(
        stored_changes(&core.take_effects()),
        [known(T0 + 1, true), known(T0 + 50, false)]
    );
}

#[test]
fn a_worker_that_went_silent_was_last_seen_when_it_was_last_heard() {
    let mut core = Core::new(settings(), Vec::new(), Vec::new(), T0);
    let generation = core.handle_uplink_opened("w1", None, "tok_j".into(), T0);
    let sent = core.handle_probe_sent();
    core.handle_connected(generation, "v".into(), &status(Vec::new(), 1), sent, T0 + 1);
    core.take_effects();
    // Heard last at T0 + 2 000; the PINGs gave up 15 s later.
    core.handle_uplink_closed(generation, T0 + 2_000, T0 + 17_000);
    assert_eq!(core.view("w1").map(|v| v.last_seen_at), Some(T0 + 2_000));
    let stored = stored_changes(&core.take_effects());
    assert!(
        matches!(&stored[..], [Effect::Remember(k)] if k.seen_at == T0 + 2_000 && !k.connected),
        "{stored:?}"
    );

    // Never before its handshake, never after the close.
    let generation = core.handle_uplink_opened("w1", None, "tok_j".into(), T0 + 20_000);
    let sent = core.handle_probe_sent();
    let status = status(Vec::new(), 1);
    core.handle_connected(generation, "v".into(), &status, sent, T0 + 20_000);
    core.handle_uplink_closed(generation, T0 + 19_999, T0 + 21_000);
    assert_eq!(core.view("w1").map(|v| v.last_seen_at), Some(T0 + 20_000));
    let generation = core.handle_uplink_opened("w1", None, "tok_j".into(), T0 + 30_000);
    let sent = core.handle_probe_sent();
    core.handle_connected(generation, "v".into(), &status, sent, T0 + 30_000);
    core.handle_uplink_closed(generation, T0 + 31_001, T0 + 31_000);
    assert_eq!(core.view("w1").map(|v| v.last_seen_at), Some(T0 + 31_000));
}

#[test]
fn an_uplink_that_closes_before_its_handshake_leaves_no_worker_and_stores_nothing() {
    let mut core = Core::new(settings(), Vec::new(), Vec::new(), T0);
    let generation = core.handle_uplink_opened("w9", None, "tok_j".into(), T0);
    assert!(core.view("w9").is_some(), "listed while its handshake runs");
    core.handle_uplink_closed(generation, T0 + 10, T0 + 10);
    assert_eq!(core.view("w9"), None, "a silent join is not a worker");
    let effects = core.take_effects();
    assert!(stored_changes(&effects).is_empty(), "{effects:?}");
    assert!(
        !effects.iter().any(|e| matches!(e, Effect::Event(_))),
        "no worker event: {effects:?}"
    );
    assert_eq!(core.next_deadline(), None, "no retention runs for it");
}

#[test]
fn a_worker_known_before_a_restart_is_listed_away_until_its_retention_passes() {
    let retention = settings().disconnected_retention_ms;
    let away = KnownWorker {
        id: "w1".into(),
        label: Some("one".into()),
        seen_at: T0 - 1000,
        connected: false,
    };
    // The gateway stopped (or crashed) while w2's uplink was up: seen until the restart.
    let up = KnownWorker {
        id: "w2".into(),
        label: None,
        seen_at: T0 - 5000,
        connected: true,
    };
    let mut core = Core::new(settings(), Vec::new(), vec![away, up], T0);
    let listed: Vec<_> = core
        .views()
        .into_iter()
        .map(|v| (v.id, v.label, v.connection, v.last_seen_at, v.leases))
        .collect();
    assert_eq!(
        listed,
        [
            (
                "w1".to_owned(),
                Some("one".to_owned()),
                Connection::Disconnected,
                T0 - 1000,
                None
            ),
            ("w2".to_owned(), None, Connection::Disconnected, T0, None),
        ]
    );
    assert_eq!(core.next_deadline(), Some(T0 - 1000 + retention));
    assert!(
        core.worker_ref("w1").is_away(),
        "its devices and leases say so"
    );
    // Neither worker's leases are read: every lease list says which are missing (trial 23: an
    // agent's own lease on such a worker vanished from its list without a word).
    let unread: Vec<(String, Option<Connection>)> = core
        .unread_workers()
        .into_iter()
        .map(|w| (w.name().to_owned(), w.connection))
        .collect();
    assert_eq!(
        unread,
        [
            ("one".to_owned(), Some(Connection::Disconnected)),
            ("w2".to_owned(), Some(Connection::Disconnected)),
        ]
    );

    // w1's retention passes: it is forgotten, and so is what was stored of it.
    core.handle_tick(T0 - 1000 + retention);
    assert_eq!(core.view("w1"), None);
    let effects = core.take_effects();
    assert_eq!(
        stored_changes(&effects),
        [Effect::Forget {
            worker_id: "w1".into()
        }]
    );
    assert!(effects.iter().any(|e| matches!(
        e,
        Effect::Event(Event::WorkerRemoved { worker_id, reason: WorkerRemovedReason::Retention, .. }) if worker_id == "w1"
    )));

    // w2 comes back: connected, and stored so again.
    let generation = core.handle_uplink_opened("w2", Some("two".into()), "tok_j".into(), T0 + 10);
    let sent = core.handle_probe_sent();
    core.handle_connected(
        generation,
        "v".into(),
        &status(Vec::new(), 1),
        sent,
        T0 + 11,
    );
    assert_eq!(
        core.view("w2").map(|v| v.connection),
        Some(Connection::Connected)
    );
    assert_eq!(
        stored_changes(&core.take_effects()),
        [Effect::Remember(KnownWorker {
            id: "w2".into(),
            label: Some("two".into()),
            seen_at: T0 + 11,
            connected: true,
        })]
    );
}

#[test]
fn an_operator_removal_deletes_what_was_stored_of_the_worker() {
    let (mut core, generation) = fleet(1);
    core.handle_uplink_closed(generation, T0 + 5, T0 + 5);
    core.take_effects();
    assert_eq!(core.handle_remove("w1", T0 + 6), Ok(true));
    assert_eq!(
        stored_changes(&core.take_effects()),
        [Effect::Forget {
            worker_id: "w1".into()
        }]
    );
}

#[test]
fn devices_name_their_worker_and_say_when_it_is_away() {
    let mut core = Core::new(settings(), Vec::new(), Vec::new(), T0);
    let generation = core.handle_uplink_opened("w1", Some("one".into()), "tok_j".into(), T0);
    let sent = core.handle_probe_sent();
    let mut first = status(Vec::new(), 1);
    first.devices = Some(vec![device("dev_1", DeviceState::Leased)]);
    core.handle_connected(generation, "v".into(), &first, sent, T0);
    let named = |core: &Core| {
        core.devices()
            .into_iter()
            .map(|d| (d.state, d.worker_id, d.worker))
            .collect::<Vec<_>>()
    };
    let worker = |connection| WorkerRef {
        id: "w1".into(),
        label: Some("one".into()),
        connection: Some(connection),
    };
    assert_eq!(
        named(&core),
        [(
            DeviceState::Leased,
            Some("w1".to_owned()),
            Some(worker(Connection::Connected))
        )]
    );
    core.handle_uplink_closed(generation, T0 + 2, T0 + 2);
    assert_eq!(
        named(&core),
        [(
            DeviceState::Leased,
            Some("w1".to_owned()),
            Some(worker(Connection::Disconnected))
        )],
        "the device keeps the state last reported, and says its worker is away"
    );
    assert_eq!(
        core.worker_ref("gone"),
        WorkerRef {
            id: "gone".into(),
            label: None,
            connection: Some(Connection::Disconnected),
        },
        "a worker the gateway has no view of is away"
    );
}

#[test]
fn an_operator_names_a_worker_by_id_or_by_a_label_only_it_has() {
    let mut core = Core::new(settings(), Vec::new(), Vec::new(), T0);
    for (id, label) in [("w1", "lab-a"), ("w2", "twin"), ("w3", "twin")] {
        let generation = core.handle_uplink_opened(id, Some(label.into()), "tok_j".into(), T0);
        let sent = core.handle_probe_sent();
        core.handle_connected(generation, "v".into(), &status(Vec::new(), 1), sent, T0);
    }
    assert_eq!(core.resolve_worker("w2").unwrap(), "w2", "an id");
    assert_eq!(
        core.resolve_worker("lab-a").unwrap(),
        "w1",
        "a label only w1 has"
    );
    assert_eq!(
        core.resolve_worker("nobody").unwrap(),
        "nobody",
        "as given: the operation says it is unknown"
    );
    assert_eq!(
        core.resolve_worker("twin"),
        Err(FleetError::BadRequest(
            "label twin names 2 workers (w2, w3): name one by its id".into()
        ))
    );
}

/// `handle_release_sent` of the holder's release, which goes to the worker.
fn send_release(core: &mut Core, lease_id: &str, caller: Caller<'_>) -> LeaseTarget {
    match core
        .handle_release_sent(lease_id, caller, LeaseEndReason::Explicit, T0)
        .unwrap()
    {
        Release::Send(target) => target,
        Release::Deferred(id) => panic!("the release of {id} was deferred"),
    }
}

/// A holder's release while its worker is away is answered at once: the lease ends here (the
/// owner's other connections hear it), it is stored as an orphan, and reads answer it gone.
/// After a restart the stored orphan is taken back: the worker's view listing the lease does
/// not index it again, and the release goes out once the worker is connected. Another's
/// release, and an operator's `killed`, still need the worker.
#[test]
fn a_holders_release_while_its_worker_is_away_is_answered_and_carried_out_once_it_is_back() {
    let (mut core, generation) = fleet(1);
    let lease_id = granted(&mut core);
    core.handle_uplink_closed(generation, T0, T0);
    core.take_effects();
    let other = Caller {
        principal: "other",
        admin: false,
        connection: Some(8),
    };
    assert!(matches!(
        core.handle_release_sent(&lease_id, other, LeaseEndReason::Explicit, T0),
        Err(FleetError::UnknownLease(_))
    ));
    let admin = Caller {
        principal: "op",
        admin: true,
        connection: None,
    };
    assert!(matches!(
        core.handle_release_sent(&lease_id, admin, LeaseEndReason::Killed, T0),
        Err(FleetError::WorkerUnreachable { .. })
    ));
    assert!(core.take_effects().is_empty(), "refusals change nothing");

    let released = core
        .handle_release_sent(&lease_id, agent(), LeaseEndReason::Explicit, T0)
        .unwrap();
    assert_eq!(released, Release::Deferred(lease_id.clone()));
    let effects = core.take_effects();
    assert!(
        effects.iter().any(|e| matches!(
            e,
            Effect::Notice {
                except: Some(7),
                push: Push::LeaseLost {
                    reason: LeaseEndReason::Explicit,
                    ..
                },
                ..
            }
        )),
        "the owner's other connections hear it: {effects:?}"
    );
    let stored = StoredOrphan {
        worker_id: "w1".into(),
        worker_lease_id: "lse_a".into(),
        granted_at: T0,
        expires_at: T0 + 60_000 + ORPHAN_CLOCK_MARGIN_MS,
    };
    assert!(
        effects.contains(&Effect::StoreOrphan(stored.clone())),
        "{effects:?}"
    );
    assert!(core.lease(&lease_id).is_none());
    assert!(core.leases(agent().viewer()).is_empty());
    // The gateway vouches for its end: a second release, and a read, say it is gone.
    assert!(matches!(
        core.handle_release_sent(&lease_id, agent(), LeaseEndReason::Explicit, T0),
        Err(FleetError::UnknownLease(_))
    ));
    assert!(matches!(
        core.lease_seen(&lease_id, agent().viewer()),
        Err(FleetError::UnknownLease(_))
    ));

    // The gateway restarts and takes the stored orphan back; the worker connects, still
    // holding the lease.
    let mut core = Core::new(settings(), Vec::new(), Vec::new(), T0);
    core.restore_orphans(vec![stored]);
    let held = record("lse_a", "gw:g1:agent", T0);
    let generation = core.handle_uplink_opened("w1", Some("one".into()), "tok_j".into(), T0);
    let sent = core.handle_probe_sent();
    core.handle_connected(
        generation,
        "v".into(),
        &status(vec![held.clone()], 1),
        sent,
        T0,
    );
    core.handle_subscribed(generation, T0);
    let effects = core.take_effects();
    assert!(
        effects.iter().any(|e| matches!(
            e,
            Effect::ReleaseOrphan { worker_id, worker_lease_id, .. }
                if worker_id == "w1" && worker_lease_id == "lse_a"
        )),
        "{effects:?}"
    );
    let sent = refresh_sent(&effects).expect("a full read is asked");
    core.handle_refreshed(generation, sent, refresh(vec![held], 1), T0);
    assert!(core.lease(&lease_id).is_none(), "no view brings it back");
    core.take_effects();
    core.handle_orphan_released("w1", "lse_a", Ok(()));
    assert_eq!(
        orphan_changes(&core.take_effects()),
        [Effect::SettleOrphan {
            worker_id: "w1".into(),
            worker_lease_id: "lse_a".into(),
        }]
    );
}

/// `agent` asks at `T0`, and its forward's deadline passes (`T0` + 5 s) with no answer:
/// answers the forward's attempt and the requester the worker sees.
fn a_forward_whose_waiter_timed_out(core: &mut Core) -> (u64, String) {
    ask(core, 1, ios(), T0).unwrap();
    let (attempt, input) = forward(&core.take_effects()).expect("forwarded");
    core.handle_tick(T0 + 5_000);
    core.take_effects();
    (attempt, input.requester_id.unwrap())
}

/// A grant nobody waits for is stored while it is released, and settled once the worker
/// answers; a lost uplink keeps it stored for the worker's next connection.
#[test]
fn an_orphaned_grant_is_stored_until_its_worker_answers_its_release() {
    let (mut core, _) = fleet(1);
    let (attempt, requester) = a_forward_whose_waiter_timed_out(&mut core);
    core.handle_forward_answered(
        attempt,
        "w1",
        Ok(grant(record("lse_late", &requester, T0))),
        T0 + 6_000,
    );
    let stored = StoredOrphan {
        worker_id: "w1".into(),
        worker_lease_id: "lse_late".into(),
        granted_at: T0,
        expires_at: T0 + 6_000 + 60_000 + ORPHAN_CLOCK_MARGIN_MS,
    };
    assert_eq!(
        orphan_changes(&core.take_effects()),
        [Effect::StoreOrphan(stored)]
    );
    core.handle_orphan_released("w1", "lse_late", Err(ContractError::connection_lost()));
    assert!(orphan_changes(&core.take_effects()).is_empty());
    core.handle_orphan_released("w1", "lse_late", Ok(()));
    assert_eq!(
        orphan_changes(&core.take_effects()),
        [Effect::SettleOrphan {
            worker_id: "w1".into(),
            worker_lease_id: "lse_late".into(),
        }]
    );
}

fn orphan_changes(effects: &[Effect]) -> Vec<Effect> {
    only(effects, |e| {
        matches!(e, Effect::StoreOrphan(_) | Effect::SettleOrphan { .. })
    })
}

/// A holder's release the worker did not answer in time (a stalled uplink not yet declared
/// dead) ends the lease all the same and goes out again as an orphan's release at once; an
/// operator's `killed` without an answer is still an error.
#[test]
fn a_holders_release_its_worker_did_not_answer_is_carried_out_as_an_orphans() {
    let (mut core, generation) = fleet(1);
    let lease_id = granted(&mut core);
    let target = send_release(&mut core, &lease_id, agent());
    let no_answer = FleetError::no_answer("w1", "lease.release", 10_000);
    assert!(matches!(
        core.handle_release_answered(&target, LeaseEndReason::Killed, Err(no_answer.clone()), T0),
        Err(FleetError::WorkerUnreachable { .. })
    ));
    assert!(
        core.lease(&lease_id).is_some(),
        "an operator's is not taken over"
    );
    let target = send_release(&mut core, &lease_id, agent());
    assert_eq!(
        core.handle_release_answered(&target, LeaseEndReason::Explicit, Err(no_answer), T0),
        Ok(lease_id.clone())
    );
    assert!(core.lease(&lease_id).is_none());
    let effects = core.take_effects();
    assert!(
        effects.iter().any(|e| matches!(
            e,
            Effect::ReleaseOrphan { generation: g, worker_lease_id, .. }
                if *g == generation && worker_lease_id == "lse_a"
        )),
        "{effects:?}"
    );
    assert_eq!(orphan_changes(&effects).len(), 1, "{effects:?}");
    assert!(
        effects.iter().any(|e| matches!(
            e,
            Effect::Notice {
                except: Some(7),
                push: Push::LeaseLost { .. },
                ..
            }
        )),
        "{effects:?}"
    );
}

/// An orphan whose worker never returns is forgotten at its expiry, which the core's next
/// deadline names (time alone moves), and not a moment before.
#[test]
fn an_orphan_of_a_worker_that_never_returns_expires_on_time_alone() {
    let (mut core, generation) = fleet(1);
    let lease_id = granted(&mut core);
    core.handle_uplink_closed(generation, T0, T0);
    core.handle_release_sent(&lease_id, agent(), LeaseEndReason::Explicit, T0)
        .unwrap();
    core.take_effects();
    let expiry = T0 + 60_000 + ORPHAN_CLOCK_MARGIN_MS;
    // Its worker passes retention first and is forgotten; its orphan stays.
    core.handle_tick(T0 + settings().disconnected_retention_ms);
    assert!(core.view("w1").is_none(), "forgotten");
    core.take_effects();
    assert_eq!(core.next_deadline(), Some(expiry), "nothing else is due");
    core.handle_tick(expiry - 1);
    assert!(orphan_changes(&core.take_effects()).is_empty());
    assert!(core.index().is_orphan("w1", "lse_a"));
    core.handle_tick(expiry);
    assert_eq!(
        orphan_changes(&core.take_effects()),
        [Effect::SettleOrphan {
            worker_id: "w1".into(),
            worker_lease_id: "lse_a".into(),
        }]
    );
    assert!(!core.index().is_orphan("w1", "lse_a"));
}

fn forward_changes(effects: &[Effect]) -> Vec<Effect> {
    only(effects, |e| {
        matches!(e, Effect::StoreForward(_) | Effect::SettleForward { .. })
    })
}

fn forward_settled() -> Effect {
    Effect::SettleForward {
        worker_id: "w1".into(),
        requester_id: "agent".into(),
    }
}

/// The stored forward of `agent`'s request to `w1`.
fn stored_forward(answered_lease: Option<&str>) -> StoredForward {
    StoredForward {
        worker_id: "w1".into(),
        requester_id: "agent".into(),
        answered_lease: answered_lease.map(str::to_owned),
    }
}

/// `agent` asks; the forward's answer is lost with `w1`'s uplink `generation`. Answers the
/// effects of the ask, then those of the loss.
fn a_forward_whose_answer_is_lost(core: &mut Core) -> [Vec<Effect>; 2] {
    ask(core, 1, ios(), T0).unwrap();
    let asked = core.take_effects();
    let (attempt, _) = forward(&asked).expect("forwarded");
    core.handle_forward_answered(attempt, "w1", Err(ContractError::connection_lost()), T0);
    [asked, core.take_effects()]
}

/// `w1`'s uplink drops and a new one passes its handshake listing `leases`: answers the new
/// generation and the handshake's effects; then the uplink subscribes, and the effects of that
/// follow (its orphans' releases, the first full read).
fn reconnected(core: &mut Core, old: u64, leases: Vec<LeaseRecord>) -> (u64, [Vec<Effect>; 2]) {
    core.handle_uplink_closed(old, T0, T0);
    back_at(core, leases, T0)
}

/// `w1`, away, connects again at `now` listing `leases`: answers the new generation, the
/// handshake's effects and those of the subscription.
fn back_at(core: &mut Core, leases: Vec<LeaseRecord>, now: i64) -> (u64, [Vec<Effect>; 2]) {
    let generation = core.handle_uplink_opened("w1", Some("one".into()), "tok_j".into(), now);
    let sent = core.handle_probe_sent();
    core.handle_connected(generation, "v".into(), &status(leases, 1), sent, now);
    let connected = core.take_effects();
    core.handle_subscribed(generation, now);
    (generation, [connected, core.take_effects()])
}

/// `agent`'s forward to `w1` is still kept at `expiry - 1` and settled at `expiry`, on time
/// alone.
fn forward_forgotten_at(core: &mut Core, expiry: i64) {
    core.handle_tick(expiry - 1);
    assert!(forward_changes(&core.take_effects()).is_empty());
    assert_eq!(core.index().forwards_out().len(), 1);
    core.handle_tick(expiry);
    assert_eq!(forward_changes(&core.take_effects()), [forward_settled()]);
    assert!(core.index().forwards_out().is_empty());
}

fn orphan_releases(effects: &[Effect]) -> Vec<String> {
    effects
        .iter()
        .filter_map(|e| match e {
            Effect::ReleaseOrphan {
                worker_lease_id, ..
            } => Some(worker_lease_id.clone()),
            _ => None,
        })
        .collect()
}

/// Outside trial 9: a request forwarded to a worker whose uplink was lost before it answered is
/// refused `WORKER_UNREACHABLE`; the worker granted it all the same. When its view lists that
/// grant, it is released as an orphan (once), never indexed as the requester's lease.
#[test]
fn a_grant_whose_answer_was_lost_with_its_uplink_is_released_when_a_view_lists_it() {
    let (mut core, generation) = fleet(1);
    let [asked, effects] = a_forward_whose_answer_is_lost(&mut core);
    assert_eq!(
        forward_changes(&asked),
        [Effect::StoreForward(stored_forward(None))],
        "stored as it goes out"
    );
    assert!(matches!(
        answers(&effects)[..],
        [(_, Err(ErrorCode::WorkerUnreachable))]
    ));
    assert!(forward_changes(&effects).is_empty(), "still in doubt");
    assert_eq!(core.next_deadline(), Some(T0 + 30_000), "the periodic read");

    let stray = record("lse_stray", "gw:g1:agent", T0);
    let (generation, [connected, subscribed]) =
        reconnected(&mut core, generation, vec![stray.clone()]);
    assert!(orphan_releases(&connected).is_empty(), "{connected:?}");
    assert_eq!(forward_changes(&connected), [forward_settled()]);
    assert_eq!(
        orphan_releases(&subscribed),
        ["lse_stray"],
        "released once its events come up the uplink (their lease.released reaches the gateway's stream)"
    );
    assert!(core.lease("w1.lse_stray").is_none());
    assert!(core.leases(agent().viewer()).is_empty());
    assert!(matches!(
        core.lease_seen("w1.lse_stray", agent().viewer()),
        Err(FleetError::UnknownLease(_))
    ));
    // The next read still lists it until the release lands: nothing changes.
    let sent = refresh_sent(&subscribed).expect("a full read");
    core.handle_refreshed(generation, sent, refresh(vec![stray], 1), T0);
    assert!(orphan_releases(&core.take_effects()).is_empty());
    assert!(core.lease("w1.lse_stray").is_none());
    // Released, its device is free again for the requester's next request.
    core.handle_orphan_released("w1", "lse_stray", Ok(()));
    core.handle_worker_event(
        generation,
        event("lease.released", serde_json::json!({})),
        T0,
    );
    let sent = refresh_sent(&core.take_effects()).expect("a read");
    core.handle_refreshed(generation, sent, refresh(Vec::new(), 1), T0);
    core.take_effects();
    ask(&mut core, 2, ios(), T0).unwrap();
    assert!(forward(&core.take_effects()).is_some());
}

/// A view that lists a forward's grant before its answer comes leaves it to the answer: not
/// released, and indexed with the answer.
#[test]
fn a_view_listing_a_grant_before_its_answer_leaves_it_to_the_answer() {
    let (mut core, generation) = fleet(1);
    ask(&mut core, 1, ios(), T0).unwrap();
    let (attempt, input) = forward(&core.take_effects()).expect("forwarded");
    let held = record("lse_a", &input.requester_id.unwrap(), T0);
    core.handle_worker_event(
        generation,
        event("lease.granted", serde_json::json!({})),
        T0,
    );
    let sent = refresh_sent(&core.take_effects()).expect("a read");
    core.handle_refreshed(generation, sent, refresh(vec![held.clone()], 1), T0);
    let effects = core.take_effects();
    assert!(orphan_releases(&effects).is_empty(), "{effects:?}");
    assert!(core.lease("w1.lse_a").is_none(), "the answer decides");
    core.handle_forward_answered(attempt, "w1", Ok(grant(held)), T0);
    let effects = core.take_effects();
    assert_eq!(answers(&effects)[0].1, Ok("w1.lse_a".into()));
    assert_eq!(forward_changes(&effects), [forward_settled()]);
    assert!(core.lease("w1.lse_a").is_some());
}

/// A refusal after a lost answer keeps the doubt and asks for a view, which finds the grant.
#[test]
fn a_refusal_after_a_lost_answer_asks_for_the_view_that_finds_its_grant() {
    let (mut core, generation) = fleet(1);
    a_forward_whose_answer_is_lost(&mut core);
    let (generation, [_, subscribed]) = reconnected(&mut core, generation, Vec::new());
    let sent = refresh_sent(&subscribed).expect("a full read");
    core.handle_refreshed(generation, sent, refresh(Vec::new(), 1), T0);
    core.take_effects();
    ask(&mut core, 2, ios(), T0).unwrap();
    refused(&mut core, ErrorCode::RequesterAlreadyLeased);
    let effects = core.take_effects();
    assert!(forward_changes(&effects).is_empty(), "{effects:?}");
    let sent = refresh_sent(&effects).expect("a read is asked");
    let stray = record("lse_stray", "gw:g1:agent", T0);
    core.handle_refreshed(generation, sent, refresh(vec![stray], 1), T0);
    let effects = core.take_effects();
    assert_eq!(orphan_releases(&effects), ["lse_stray"]);
    assert_eq!(forward_changes(&effects), [forward_settled()]);
}

/// After a restart the stored forwards are in doubt: a view's lease of that requester on that
/// worker is released, but the one last answered to it while another forward was out is its.
#[test]
fn a_restarted_gateway_releases_the_grants_of_its_stored_forwards_but_the_one_it_answered() {
    // Two forwards of one requester out: the first's waiter timed out, the second is granted.
    let (mut core, _) = fleet(2);
    let (first, _) = a_forward_whose_waiter_timed_out(&mut core);
    ask(&mut core, 2, ios(), T0 + 5_000).unwrap();
    let (second, input) = forward(&core.take_effects()).expect("forwarded again");
    assert_ne!(first, second);
    let held = record("lse_b", &input.requester_id.unwrap(), T0 + 5_000);
    core.handle_forward_answered(second, "w1", Ok(grant(held.clone())), T0 + 5_000);
    let effects = core.take_effects();
    let kept = stored_forward(Some("lse_b"));
    assert_eq!(
        forward_changes(&effects),
        [Effect::StoreForward(kept.clone())],
        "the first is still out: the answered lease is stored beside it"
    );

    for (listed, released) in [("lse_b", false), ("lse_c", true)] {
        let mut core = Core::new(settings(), Vec::new(), Vec::new(), T0);
        core.restore_forwards(vec![kept.clone()]);
        let lease = record(listed, "gw:g1:agent", T0 + 5_000);
        let generation = core.handle_uplink_opened("w1", None, "tok_j".into(), T0);
        let sent = core.handle_probe_sent();
        core.handle_connected(generation, "v".into(), &status(vec![lease], 2), sent, T0);
        core.handle_subscribed(generation, T0);
        let effects = core.take_effects();
        let id = format!("w1.{listed}");
        assert_eq!(core.lease(&id).is_none(), released, "{listed}");
        assert_eq!(
            orphan_releases(&effects),
            if released {
                vec![listed.to_owned()]
            } else {
                Vec::new()
            }
        );
    }
}

/// How long after it goes out (or its worker is back) a forward is kept: the answer bound,
/// the longest TTL and the clock margin.
const FORWARD_BOUND: i64 = 5_000 + 60_000 + ORPHAN_CLOCK_MARGIN_MS;

/// A forward in doubt whose worker stays connected (its answer lost to the call's bound, say)
/// is forgotten a bound after it went out, on time alone.
#[test]
fn a_forward_in_doubt_is_forgotten_a_bound_after_it_went_out() {
    let (mut core, _) = fleet(1);
    ask(&mut core, 1, ios(), T0).unwrap();
    let (attempt, _) = forward(&core.take_effects()).expect("forwarded");
    core.handle_forward_answered(attempt, "w1", Err(ContractError::connection_lost()), T0);
    core.take_effects();
    forward_forgotten_at(&mut core, T0 + FORWARD_BOUND);
}

/// A forward in doubt whose worker is away waits for it however long, the worker forgotten
/// (retention) included; it is counted again from the worker's return.
#[test]
fn a_forward_in_doubt_waits_while_its_worker_is_away_even_forgotten() {
    let (mut core, generation) = fleet(1);
    a_forward_whose_answer_is_lost(&mut core);
    core.handle_uplink_closed(generation, T0, T0);
    assert!(
        forward_changes(&core.take_effects()).is_empty(),
        "nothing stored"
    );
    let forgotten = T0 + settings().disconnected_retention_ms;
    core.handle_tick(forgotten);
    core.take_effects();
    assert!(core.view("w1").is_none(), "the worker is forgotten");
    assert_eq!(core.next_deadline(), None, "nothing is due");
    let later = T0 + 100 * FORWARD_BOUND;
    core.handle_tick(later);
    assert!(forward_changes(&core.take_effects()).is_empty());
    assert_eq!(core.index().forwards_out().len(), 1, "kept");
    // Back with nothing to show: forgotten a bound after its return, on time alone.
    back_at(&mut core, Vec::new(), later);
    forward_forgotten_at(&mut core, later + FORWARD_BOUND);
}

/// A worker stopped (SIGSTOP, its machine asleep) with a forward unread in its socket reads it,
/// and may grant it, whenever it runs again, long past the forward's own bound: the forward is
/// kept while it is away, its grant is released once a view lists it, and a worker back with
/// nothing to show has it forgotten a bound after its return.
#[test]
fn a_forward_a_stopped_worker_reads_long_after_is_still_screened_once_it_is_back() {
    let long = Settings {
        disconnected_retention_ms: 100 * FORWARD_BOUND,
        ..settings()
    };
    for grants in [true, false] {
        let (mut core, generation) = fleet_with(long.clone(), 1);
        a_forward_whose_answer_is_lost(&mut core);
        core.handle_uplink_closed(generation, T0, T0);
        core.take_effects();
        let back = T0 + 10 * FORWARD_BOUND;
        core.handle_tick(back);
        assert!(forward_changes(&core.take_effects()).is_empty());
        assert_eq!(core.index().forwards_out().len(), 1, "kept while away");
        let leases = if grants {
            vec![record("lse_late", "gw:g1:agent", back)]
        } else {
            Vec::new()
        };
        let (_, [connected, subscribed]) = back_at(&mut core, leases, back);
        if grants {
            assert_eq!(forward_changes(&connected), [forward_settled()]);
            assert_eq!(
                orphan_releases(&subscribed),
                ["lse_late"],
                "released, never indexed"
            );
            assert!(core.lease("w1.lse_late").is_none());
            assert!(core.leases(agent().viewer()).is_empty());
        } else {
            assert!(forward_changes(&connected).is_empty(), "{connected:?}");
            forward_forgotten_at(&mut core, back + FORWARD_BOUND);
        }
    }
}

/// After a restart, a stored forward waits for its worker whatever its stored expiry says, and
/// counts a bound from the worker's return.
#[test]
fn a_restored_forward_waits_for_its_worker() {
    let mut core = Core::new(settings(), Vec::new(), Vec::new(), T0);
    core.restore_forwards(vec![stored_forward(None)]);
    core.handle_tick(T0 + 10 * FORWARD_BOUND);
    assert!(forward_changes(&core.take_effects()).is_empty());
    assert_eq!(core.index().forwards_out().len(), 1);
    let back = T0 + 10 * FORWARD_BOUND;
    back_at(&mut core, Vec::new(), back);
    forward_forgotten_at(&mut core, back + FORWARD_BOUND);
}

/// An operator's removal of a worker that is away ends its leases here (`killed` to their
/// owners), keeps each as an orphan, and releases it once the worker is back and subscribed.
#[test]
fn removing_an_away_worker_ends_its_leases_as_orphans() {
    let (mut core, generation) = fleet(1);
    let lease_id = granted(&mut core);
    core.handle_uplink_closed(generation, T0, T0);
    core.take_effects();
    assert_eq!(core.handle_remove("w1", T0), Ok(true));
    let effects = core.take_effects();
    assert!(
        effects.iter().any(|e| matches!(
            e,
            Effect::Notice {
                except: None,
                push: Push::LeaseLost {
                    reason: LeaseEndReason::Killed,
                    ..
                },
                ..
            }
        )),
        "{effects:?}"
    );
    assert_eq!(orphan_changes(&effects).len(), 1, "{effects:?}");
    assert!(core.lease(&lease_id).is_none());
    assert!(matches!(
        core.lease_seen(&lease_id, agent().viewer()),
        Err(FleetError::UnknownLease(_))
    ));
    let held = record("lse_a", "gw:g1:agent", T0);
    let (_, [connected, subscribed]) = reconnected(&mut core, generation, vec![held]);
    assert!(orphan_releases(&connected).is_empty());
    assert_eq!(orphan_releases(&subscribed), ["lse_a"]);
    assert!(core.lease(&lease_id).is_none(), "no view brings it back");
}

/// A view listing a lease of a requester that holds another indexed lease on that worker (a
/// worker holds one lease of a requester): the unknown one is a grant nobody was told of (its
/// forward settled early by the other's grant), released, never indexed beside the other.
#[test]
fn a_second_lease_of_a_requester_on_one_worker_is_released_not_indexed() {
    let (mut core, generation) = fleet(2);
    let lease_id = granted(&mut core);
    core.handle_worker_event(
        generation,
        event("lease.granted", serde_json::json!({})),
        T0,
    );
    let sent = refresh_sent(&core.take_effects()).expect("a read");
    let held = record("lse_a", "gw:g1:agent", T0);
    let stray = record("lse_old", "gw:g1:agent", T0 - 5_000);
    core.handle_refreshed(generation, sent, refresh(vec![stray, held], 2), T0);
    let effects = core.take_effects();
    assert_eq!(orphan_releases(&effects), ["lse_old"], "{effects:?}");
    assert!(core.lease("w1.lse_old").is_none());
    assert!(core.lease(&lease_id).is_some(), "the answered one stays");
    assert_eq!(core.leases(agent().viewer()).len(), 1);
}

/// Outside trial 21: each waiter costs every pass a little, so one caller queueing thousands
/// slowed the gateway for everyone. The queue holds `lease.maxWaiting`; one more that would
/// wait is answered `NO_CAPACITY` (queue full) at once, and a place that frees takes the next.
#[test]
fn a_request_past_a_full_queue_is_refused_at_once_and_a_freed_place_takes_the_next() {
    let bounded = Settings {
        max_waiting: 2,
        ..settings()
    };
    let (mut core, generation) = fleet_with(bounded, 1);
    let _held = granted_full(&mut core, generation);
    let waiting = |core: &mut Core, n: u32| {
        let mut input = ios();
        input.requester_id = Some(format!("waiter-{n}"));
        ask(core, n, input, T0).unwrap();
        core.take_effects()
    };
    for n in [2, 3] {
        assert!(answers(&waiting(&mut core, n)).is_empty(), "{n} waits");
    }
    assert_eq!(core.queue_depth(), 2);
    let effects = {
        let mut input = ios();
        input.requester_id = Some("waiter-4".into());
        input.idempotency_key = Some("k4".into());
        ask(&mut core, 4, input, T0).unwrap();
        core.take_effects()
    };
    assert_eq!(
        answers(&effects),
        [(RequestId::from_raw("req_4"), Err(ErrorCode::NoCapacity))]
    );
    let refused = effects.iter().find_map(|e| match e {
        Effect::Answer { outcome, .. } => (**outcome).clone().err(),
        _ => None,
    });
    let err = ContractError::from(refused.unwrap());
    assert!(err.message.contains("the queue is full"), "{}", err.message);
    assert_eq!(err.details.unwrap()["maxWaiting"], 2);
    assert_eq!(core.queue_depth(), 2, "the refused one left nothing");
    core.handle_cancel("waiter-2", agent(), T0).unwrap();
    core.take_effects();
    // The refusal was not kept under its key: a repeat, once there is room, is a new request.
    let mut repeat = ios();
    repeat.requester_id = Some("waiter-4".into());
    repeat.idempotency_key = Some("k4".into());
    assert_eq!(
        ask(&mut core, 5, repeat, T0),
        Ok(Admitted::New(RequestId::from_raw("req_5")))
    );
    assert!(answers(&core.take_effects()).is_empty(), "it waits");
    assert_eq!(core.queue_depth(), 2);
}

/// Review of ADR 0036: a request that waited keeps its place when it comes back from a worker
/// that refused it (a stale view), even with the queue full meanwhile; only a new one is held
/// to the bound.
#[test]
fn a_waiter_back_from_a_refusing_worker_keeps_its_place_in_a_full_queue() {
    let bounded = Settings {
        max_waiting: 1,
        ..settings()
    };
    let (mut core, generation) = fleet_with(bounded, 1);
    ask(&mut core, 1, ios(), T0).unwrap();
    let (attempt, _) = forward(&core.take_effects()).expect("forwarded at once");
    // The worker's room is taken meanwhile (by a caller of its own).
    read_after(
        &mut core,
        generation,
        "device.ready",
        refresh(Vec::new(), 0),
        T0,
    );
    core.take_effects();
    let mut second = ios();
    second.requester_id = Some("second".into());
    ask(&mut core, 2, second, T0).unwrap();
    assert!(answers(&core.take_effects()).is_empty(), "the second waits");
    assert_eq!(core.queue_depth(), 1, "full");
    core.handle_forward_answered(
        attempt,
        "w1",
        Err(ContractError::new(ErrorCode::NoCapacity, "taken meanwhile")),
        T0,
    );
    let effects = core.take_effects();
    assert!(answers(&effects).is_empty(), "{effects:?}");
    assert_eq!(core.queue_depth(), 2, "back in the queue past the bound");
}

/// Found by the simulation (seed 6428 of a longer run): a request admitted while its
/// requester's lease was out of sight (its worker away after a gateway restart) is answered
/// `REQUESTER_ALREADY_LEASED` once a view shows that lease, not forwarded. Forwarded, it would
/// be refused there or granted a second lease elsewhere; and after one more restart its stored
/// forward took the requester's own lease for a lost grant and released it.
#[test]
fn a_waiter_whose_requester_turns_out_to_hold_a_lease_is_answered_already_leased() {
    let (mut core, generation) = fleet(0);
    ask(&mut core, 1, ios(), T0).unwrap();
    let effects = core.take_effects();
    assert!(
        forward(&effects).is_none() && answers(&effects).is_empty(),
        "it waits"
    );
    let held = record("lse_old", "gw:g1:agent", T0 - 60_000);
    read_after(
        &mut core,
        generation,
        "device.ready",
        refresh(vec![held], 1),
        T0 + 1_000,
    );
    let effects = core.take_effects();
    assert!(forward(&effects).is_none(), "{effects:?}");
    assert_eq!(
        answers(&effects),
        [(
            RequestId::from_raw("req_1"),
            Err(ErrorCode::RequesterAlreadyLeased)
        )]
    );
    assert!(core.lease("w1.lse_old").is_some(), "its lease is indexed");
}

/// Review: a waiter a connected worker refused (its spec) while the others are away does not
/// wait "for a worker to come back" (`noWorker`): one that takes requests is there.
#[test]
fn a_waiter_refused_by_a_serving_worker_is_not_told_no_worker() {
    let (mut core, _) = fleet(1);
    let away = connect(&mut core, "w2", 0);
    core.handle_uplink_closed(away, T0, T0);
    core.take_effects();
    ask(&mut core, 1, ios(), T0).unwrap();
    refused(&mut core, ErrorCode::RuntimeMissing);
    let told = told_why(&core.take_effects());
    assert!(!told.is_empty(), "it waits, and is told so");
    assert!(!told.contains(&Some(WaitingFor::NoWorker)), "{told:?}");
}

/// Outside trial 23: while a request forwarded to a worker was being started there, the
/// gateway's waiting list held it twice: the fleet queue's entry and the worker's own, under
/// the gateway's internal requester (`gw:<id>:<requester>`). It is listed once, as the fleet's,
/// with its worker's label; a queued request says why it waits.
#[test]
fn a_request_starting_on_a_worker_is_listed_once_with_its_worker_and_a_queued_one_with_why() {
    let (mut core, generation) = fleet(1);
    ask(&mut core, 1, ios(), T0).unwrap();
    let (_attempt, input) = forward(&core.take_effects()).expect("forwarded");
    let forwarded = input.requester_id.unwrap();
    // The worker reports the forward as its own request, starting, and no room for another.
    let mut read = refresh(Vec::new(), 0);
    read.status.waiting = Some(vec![WaitingRequest {
        id: RequestId::from_raw("req_on_w1"),
        requester_id: forwarded.clone(),
        spec: requested_ios(),
        created_at: T0,
        stage: WaitStage::Starting,
        queue_position: None,
        waiting_for: None,
        worker_id: None,
        worker: None,
    }]);
    read_after(&mut core, generation, "lease.requested", read, T0);
    core.take_effects();
    for viewer in [Viewer::ADMIN, agent().viewer()] {
        let all = core.all_waiting(viewer);
        assert_eq!(all.len(), 1, "{all:?}");
        assert_eq!(all[0].id, RequestId::from_raw("req_1"));
        assert_eq!(all[0].stage, WaitStage::Starting);
        let worker = all[0].worker.as_ref().expect("its worker");
        assert_eq!((worker.id.as_str(), worker.name()), ("w1", "one"));
    }
    assert!(core.unread_workers().is_empty(), "its leases were read");
    // The worker's view itself still says what the worker reported.
    assert_eq!(core.views()[0].waiting.as_deref().map(<[_]>::len), Some(1));

    // A second request waits for the device the first is starting on; once the only worker is
    // drained, for a worker that takes requests.
    let mut second = ios();
    second.requester_id = Some("second".into());
    ask(&mut core, 2, second, T0).unwrap();
    core.take_effects();
    let queued = |core: &Core| {
        core.waiting()
            .into_iter()
            .find(|w| w.id == RequestId::from_raw("req_2"))
            .expect("queued")
    };
    assert_eq!(queued(&core).stage, WaitStage::Queued);
    assert_eq!(queued(&core).waiting_for, Some(WaitingFor::Capacity));
    assert_eq!(queued(&core).worker, None);
    core.handle_drained("w1", true, T0);
    core.take_effects();
    assert_eq!(queued(&core).waiting_for, Some(WaitingFor::NoWorker));
}
