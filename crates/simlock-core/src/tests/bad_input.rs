//! Every registered operation, given bad input: a contract error, and no state changed.
//!
//! The cases are one table; every operation in [`OPERATIONS`] must have at least one, so a new
//! operation without a bad-input case fails here.

use serde_json::{Value, json};
use simlock_contract::ErrorCode;
use simlock_daemon::CallCtx;

use super::*;
use crate::RecordState;
use crate::handlers::OPERATIONS;

/// A worker holding one lease (`agent-a`) and one waiting request (`agent-w`), so a refused
/// call has something to disturb. Answers the lease's id and the waiting call.
async fn busy() -> (
    Harness,
    String,
    tokio::task::JoinHandle<Result<LeaseGrant, ContractError>>,
) {
    let mut config = config();
    config.core.capacity.max_running = 1;
    let h = Harness::with_config(config);
    let grant = h.lease("agent-a", ios()).await.unwrap();
    let mut events = h.bus.follow();
    let (waiting, _pushes) = h.spawn_lease("agent-w", android());
    next_event(&mut events, "lease.queued").await;
    (h, grant.lease.id.to_string(), waiting)
}

/// What a refused call may leave behind.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Leaves {
    /// Nothing at all.
    Nothing,
    /// One new request record, settled failed with the refusal's code, and nothing else (a
    /// `noWait` refusal is recorded, as the original of idempotent repeats).
    FailedRecord,
}

/// One call that must be refused.
struct Case {
    ctx: CallCtx,
    op: &'static str,
    payload: Value,
    code: ErrorCode,
    details: Option<Value>,
    leaves: Leaves,
}

fn refused(ctx: CallCtx, op: &'static str, payload: Value, code: ErrorCode) -> Case {
    Case {
        ctx,
        op,
        payload,
        code,
        details: None,
        leaves: Leaves::Nothing,
    }
}

/// Every refusal, against [`busy`]'s worker holding `lease_id`.
fn cases(lease_id: &str) -> Vec<Case> {
    use ErrorCode::{
        BadRequest, CapabilityMissing, Forbidden, LeaseIdTaken, NoCapacity, RequesterAlreadyLeased,
        RuntimeMissing, UnknownLease, UnknownModel, UnknownPassthroughTool,
        UnsupportedInWorkerMode,
    };
    let request = |payload: Value, code| refused(agent("fresh"), "lease.request", payload, code);
    let exec_ok = json!({"leaseId": lease_id, "tool": "sh", "args": ["true"]});
    let exec_with = |key: &str, value: Value| {
        let mut payload = exec_ok.clone();
        payload[key] = value;
        payload
    };
    let mut cases = vec![
        refused(agent("x"), "status.get", json!("not an object"), BadRequest),
        refused(
            agent("x"),
            "catalog.get",
            json!({"platform": "windows"}),
            BadRequest,
        ),
        refused(agent("x"), "config.get", json!({}), Forbidden),
        refused(admin("op"), "config.get", json!(7), BadRequest),
        refused(
            admin("op"),
            "list.get",
            json!({"kind": "tokens"}),
            BadRequest,
        ),
        refused(agent("x"), "list.get", json!({}), Forbidden),
        request(json!({"platform": "ios", "color": "red"}), BadRequest),
        request(json!({"platform": "windows"}), BadRequest),
        request(json!({}), BadRequest),
        request(json!({"platform": "ios", "ttlMs": 14_400_001}), BadRequest),
        request(json!({"platform": "ios", "ttlMs": 0}), BadRequest),
        request(json!({"platform": "ios", "timeoutMs": -1}), BadRequest),
        request(json!({"platform": "ios", "leaseId": "has.dot"}), BadRequest),
        request(
            json!({"platform": "ios", "requires": ["Bad Name"]}),
            BadRequest,
        ),
        request(
            json!({"platform": "ios", "model": "Nokia 3310"}),
            UnknownModel,
        ),
        request(
            json!({"platform": "ios", "model": "iPhone 16 Pro", "osVersion": "17.5"}),
            RuntimeMissing,
        ),
        request(
            json!({"platform": "ios", "requires": ["tv-out"]}),
            CapabilityMissing,
        ),
        request(json!({"platform": "ios", "owner": "someone"}), Forbidden),
        request(
            json!({"platform": "ios", "requesterId": "agent-a"}),
            RequesterAlreadyLeased,
        ),
        request(
            json!({"platform": "ios", "requesterId": "agent-w"}),
            RequesterAlreadyLeased,
        ),
        request(
            json!({"platform": "ios", "leaseId": lease_id}),
            LeaseIdTaken,
        ),
        Case {
            leaves: Leaves::FailedRecord,
            ..request(json!({"platform": "ios", "noWait": true}), NoCapacity)
        },
        refused(
            agent("agent-a"),
            "lease.renew",
            json!({"leaseId": "lse_nope"}),
            UnknownLease,
        ),
        refused(
            agent("agent-a"),
            "lease.renew",
            json!({"leaseId": "bad id!"}),
            BadRequest,
        ),
        refused(agent("agent-a"), "lease.renew", json!({}), BadRequest),
        refused(
            agent("agent-a"),
            "lease.renew",
            json!({"leaseId": lease_id, "ttlMs": 14_400_001}),
            BadRequest,
        ),
        refused(
            agent("agent-b"),
            "lease.renew",
            json!({"leaseId": lease_id}),
            UnknownLease,
        ),
        refused(
            agent("agent-a"),
            "lease.release",
            json!({"leaseId": "../etc"}),
            BadRequest,
        ),
        refused(
            agent("agent-a"),
            "lease.release",
            json!({"leaseId": "lse_nope"}),
            UnknownLease,
        ),
        refused(
            agent("agent-b"),
            "lease.release",
            json!({"leaseId": lease_id}),
            UnknownLease,
        ),
        refused(
            agent("agent-w"),
            "lease.cancel",
            json!({"requesterId": ""}),
            BadRequest,
        ),
        refused(
            agent("agent-x"),
            "lease.cancel",
            json!({"requesterId": "agent-w"}),
            Forbidden,
        ),
        refused(agent("agent-a"), "lease.list", json!([1]), BadRequest),
        refused(agent("agent-a"), "lease.get", json!({}), BadRequest),
        refused(
            agent("agent-a"),
            "lease.get",
            json!({"leaseId": "../etc"}),
            BadRequest,
        ),
        refused(
            agent("agent-a"),
            "lease.get",
            json!({"leaseId": "lse_nope"}),
            UnknownLease,
        ),
        // Another agent's lease is as unknown to this one as it is in `lease.list`.
        refused(
            agent("agent-b"),
            "lease.get",
            json!({"leaseId": lease_id}),
            UnknownLease,
        ),
        refused(agent("agent-a"), "lease.release-all", json!({}), Forbidden),
        // An operator's reason is an admin's to give, on the holder's own lease too.
        refused(
            agent("agent-a"),
            "lease.release",
            json!({"leaseId": lease_id, "reason": "killed"}),
            Forbidden,
        ),
        refused(
            agent("agent-a"),
            "lease.release",
            json!({"leaseId": lease_id, "reason": "expired"}),
            BadRequest,
        ),
        refused(admin("op"), "lease.release-all", json!("x"), BadRequest),
        refused(
            agent("agent-a"),
            "device.exec",
            exec_with("shell", json!(true)),
            BadRequest,
        ),
        refused(
            agent("agent-a"),
            "device.exec",
            json!({"leaseId": lease_id, "tool": ""}),
            BadRequest,
        ),
        refused(
            agent("agent-a"),
            "device.exec",
            json!({"leaseId": "lse_nope", "tool": "sh"}),
            UnknownLease,
        ),
        refused(
            agent("agent-a"),
            "device.exec",
            json!({"leaseId": lease_id, "tool": "nope"}),
            UnknownPassthroughTool,
        ),
        refused(
            agent("agent-a"),
            "device.exec",
            exec_with("requesterId", json!("agent-a")),
            Forbidden,
        ),
        refused(agent("x"), "worker.list", json!({}), Forbidden),
    ];
    for op in ["worker.drain", "worker.undrain", "worker.remove"] {
        cases.push(Case {
            details: Some(json!({"operation": op})),
            ..refused(
                admin("op"),
                op,
                json!({"workerId": "worker-test"}),
                UnsupportedInWorkerMode,
            )
        });
    }
    cases
}

/// Asserts that `outcome` is the case's refusal and that the worker went from `before` to
/// `after` leaving only what the case allows.
#[track_caller]
fn check(case: &Case, before: &Snapshot, outcome: Result<Value, ContractError>, after: &Snapshot) {
    let (op, payload) = (case.op, &case.payload);
    let err = match outcome {
        Ok(answer) => panic!("{op} {payload} was answered: {answer}"),
        Err(err) => err,
    };
    assert_eq!(err.code, case.code, "{op} {payload}: {}", err.message);
    if let Some(details) = &case.details {
        assert_eq!(err.details.as_ref(), Some(details), "{op} {payload}");
    }
    assert_eq!(
        (&after.devices, &after.leases, &after.waiting),
        (&before.devices, &before.leases, &before.waiting),
        "{op} {payload} changed state"
    );
    match case.leaves {
        Leaves::Nothing => assert_eq!(
            after.requests, before.requests,
            "{op} {payload} recorded a request"
        ),
        Leaves::FailedRecord => {
            let new: Vec<&RequestRecord> = after
                .requests
                .iter()
                .filter(|r| !before.requests.contains(r))
                .collect();
            assert_eq!(
                (after.requests.len(), new.len()),
                (before.requests.len() + 1, 1),
                "{op} {payload}: exactly one new record, every other kept as it was"
            );
            assert_eq!(new[0].state, RecordState::Failed, "{op} {payload}");
            assert_eq!(
                new[0].failure.as_ref().map(|f| f.code),
                Some(case.code),
                "{op} {payload}"
            );
        }
    }
}

#[tokio::test(start_paused = true)]
async fn every_operation_refuses_bad_input_and_changes_nothing() {
    for op in OPERATIONS {
        let (h, lease_id, waiting) = busy().await;
        let cases: Vec<Case> = cases(&lease_id)
            .into_iter()
            .filter(|c| c.op == *op)
            .collect();
        assert!(!cases.is_empty(), "{op} has no bad-input case");
        for case in &cases {
            let before = h.snapshot();
            let call = h.call_raw(case.ctx.clone(), case.op, case.payload.clone());
            let outcome = within(GUARD, call).await;
            check(case, &before, outcome, &h.snapshot());
        }
        waiting.abort();
    }
}

#[tokio::test]
async fn every_case_is_of_a_registered_operation_and_every_operation_is_registered() {
    for case in cases("lse_any") {
        assert!(
            OPERATIONS.contains(&case.op),
            "{} is not registered",
            case.op
        );
    }
    let h = Harness::build(Build {
        start: false,
        ..Build::default()
    });
    let mut router = Router::new();
    register(&mut router, &h.worker, h.gate.clone());
    let mut names = router.names();
    names.sort_unstable();
    let mut expected = OPERATIONS.to_vec();
    expected.sort_unstable();
    assert_eq!(names, expected);
}
