//! Every registered operation, given bad input: a contract error, and no state changed.

use serde_json::{Value, json};
use simlock_contract::ErrorCode;
use simlock_daemon::CallCtx;

use super::*;
use crate::handlers::OPERATIONS;

/// A worker holding one lease (`agent-a`) and one waiting request (`agent-w`), so a refused
/// call has something to disturb.
async fn busy() -> (
    Harness,
    String,
    tokio::task::JoinHandle<Result<LeaseGrant, ContractError>>,
) {
    let mut config = config();
    config.capacity.max_running = 1;
    let h = Harness::with_config(config);
    let grant = h.lease("agent-a", ios()).await.unwrap();
    let mut events = h.bus.follow();
    let (waiting, _pushes) = h.spawn_lease("agent-w", android());
    next_event(&mut events, "lease.queued").await;
    (h, grant.lease.id.to_string(), waiting)
}

async fn refused(h: &Harness, ctx: CallCtx, op: &str, payload: Value, code: ErrorCode) {
    let before = h.snapshot();
    let err = h.call_raw(ctx, op, payload.clone()).await.unwrap_err();
    assert_eq!(err.code, code, "{op} {payload}: {}", err.message);
    assert_eq!(h.snapshot(), before, "{op} {payload} changed state");
}

#[tokio::test(start_paused = true)]
async fn status_get() {
    let (h, _, _w) = busy().await;
    refused(
        &h,
        agent("x"),
        "status.get",
        json!("not an object"),
        ErrorCode::BadRequest,
    )
    .await;
}

#[tokio::test(start_paused = true)]
async fn catalog_get() {
    let (h, _, _w) = busy().await;
    refused(
        &h,
        agent("x"),
        "catalog.get",
        json!({"platform": "windows"}),
        ErrorCode::BadRequest,
    )
    .await;
}

#[tokio::test(start_paused = true)]
async fn config_get() {
    let (h, _, _w) = busy().await;
    refused(
        &h,
        agent("x"),
        "config.get",
        json!({}),
        ErrorCode::Forbidden,
    )
    .await;
    refused(
        &h,
        admin("op"),
        "config.get",
        json!(7),
        ErrorCode::BadRequest,
    )
    .await;
}

#[tokio::test(start_paused = true)]
async fn list_get() {
    let (h, _, _w) = busy().await;
    refused(
        &h,
        admin("op"),
        "list.get",
        json!({"kind": "tokens"}),
        ErrorCode::BadRequest,
    )
    .await;
    refused(&h, agent("x"), "list.get", json!({}), ErrorCode::Forbidden).await;
}

#[tokio::test(start_paused = true)]
async fn lease_request() {
    let (h, lease_id, _w) = busy().await;
    let cases = [
        (
            json!({"platform": "ios", "color": "red"}),
            ErrorCode::BadRequest,
        ),
        (json!({"platform": "windows"}), ErrorCode::BadRequest),
        (json!({}), ErrorCode::BadRequest),
        (
            json!({"platform": "ios", "ttlMs": 14_400_001}),
            ErrorCode::BadRequest,
        ),
        (
            json!({"platform": "ios", "ttlMs": 0}),
            ErrorCode::BadRequest,
        ),
        (
            json!({"platform": "ios", "timeoutMs": -1}),
            ErrorCode::BadRequest,
        ),
        (
            json!({"platform": "ios", "leaseId": "has.dot"}),
            ErrorCode::BadRequest,
        ),
        (
            json!({"platform": "ios", "requires": ["Bad Name"]}),
            ErrorCode::BadRequest,
        ),
        (
            json!({"platform": "ios", "model": "Nokia 3310"}),
            ErrorCode::UnknownModel,
        ),
        (
            json!({"platform": "ios", "model": "iPhone 16 Pro", "osVersion": "17.5"}),
            ErrorCode::RuntimeMissing,
        ),
        (
            json!({"platform": "ios", "requires": ["tv-out"]}),
            ErrorCode::CapabilityMissing,
        ),
        (
            json!({"platform": "ios", "owner": "someone"}),
            ErrorCode::Forbidden,
        ),
        (
            json!({"platform": "ios", "requesterId": "agent-a"}),
            ErrorCode::RequesterAlreadyLeased,
        ),
        (
            json!({"platform": "ios", "requesterId": "agent-w"}),
            ErrorCode::RequesterAlreadyLeased,
        ),
        (
            json!({"platform": "ios", "leaseId": lease_id}),
            ErrorCode::LeaseIdTaken,
        ),
        (
            json!({"platform": "ios", "noWait": true}),
            ErrorCode::NoCapacity,
        ),
    ];
    for (payload, code) in cases {
        let before = h.snapshot();
        let err = h
            .call_raw(agent("fresh"), "lease.request", payload.clone())
            .await
            .unwrap_err();
        assert_eq!(err.code, code, "{payload}: {}", err.message);
        let after = h.snapshot();
        assert_eq!(
            (&after.devices, &after.leases, &after.waiting),
            (&before.devices, &before.leases, &before.waiting),
            "{payload} changed state"
        );
        // Only a noWait refusal is recorded (settled failed), as the original records it.
        if code != ErrorCode::NoCapacity {
            assert_eq!(
                after.requests, before.requests,
                "{payload} recorded a request"
            );
        }
    }
}

#[tokio::test(start_paused = true)]
async fn lease_renew() {
    let (h, lease_id, _w) = busy().await;
    refused(
        &h,
        agent("agent-a"),
        "lease.renew",
        json!({"leaseId": "lse_nope"}),
        ErrorCode::UnknownLease,
    )
    .await;
    refused(
        &h,
        agent("agent-a"),
        "lease.renew",
        json!({"leaseId": "bad id!"}),
        ErrorCode::BadRequest,
    )
    .await;
    refused(
        &h,
        agent("agent-a"),
        "lease.renew",
        json!({}),
        ErrorCode::BadRequest,
    )
    .await;
    refused(
        &h,
        agent("agent-a"),
        "lease.renew",
        json!({"leaseId": lease_id, "ttlMs": 14_400_001}),
        ErrorCode::BadRequest,
    )
    .await;
    refused(
        &h,
        agent("agent-b"),
        "lease.renew",
        json!({"leaseId": lease_id}),
        ErrorCode::UnknownLease,
    )
    .await;
}

#[tokio::test(start_paused = true)]
async fn lease_release() {
    let (h, lease_id, _w) = busy().await;
    refused(
        &h,
        agent("agent-a"),
        "lease.release",
        json!({"leaseId": "../etc"}),
        ErrorCode::BadRequest,
    )
    .await;
    refused(
        &h,
        agent("agent-a"),
        "lease.release",
        json!({"leaseId": "lse_nope"}),
        ErrorCode::UnknownLease,
    )
    .await;
    refused(
        &h,
        agent("agent-b"),
        "lease.release",
        json!({"leaseId": lease_id}),
        ErrorCode::UnknownLease,
    )
    .await;
}

#[tokio::test(start_paused = true)]
async fn lease_cancel() {
    let (h, _, _w) = busy().await;
    refused(
        &h,
        agent("agent-w"),
        "lease.cancel",
        json!({"requesterId": ""}),
        ErrorCode::BadRequest,
    )
    .await;
    refused(
        &h,
        agent("agent-x"),
        "lease.cancel",
        json!({"requesterId": "agent-w"}),
        ErrorCode::Forbidden,
    )
    .await;
}

#[tokio::test(start_paused = true)]
async fn lease_list() {
    let (h, _, _w) = busy().await;
    refused(
        &h,
        agent("agent-a"),
        "lease.list",
        json!([1]),
        ErrorCode::BadRequest,
    )
    .await;
}

#[tokio::test(start_paused = true)]
async fn lease_release_all() {
    let (h, _, _w) = busy().await;
    refused(
        &h,
        agent("agent-a"),
        "lease.release-all",
        json!({}),
        ErrorCode::Forbidden,
    )
    .await;
    refused(
        &h,
        admin("op"),
        "lease.release-all",
        json!("x"),
        ErrorCode::BadRequest,
    )
    .await;
}

#[tokio::test(start_paused = true)]
async fn device_exec() {
    let (h, lease_id, _w) = busy().await;
    let ok = json!({"leaseId": lease_id, "tool": "sh", "args": ["true"]});
    let mut extra = ok.clone();
    extra["shell"] = json!(true);
    refused(
        &h,
        agent("agent-a"),
        "device.exec",
        extra,
        ErrorCode::BadRequest,
    )
    .await;
    refused(
        &h,
        agent("agent-a"),
        "device.exec",
        json!({"leaseId": lease_id, "tool": ""}),
        ErrorCode::BadRequest,
    )
    .await;
    refused(
        &h,
        agent("agent-a"),
        "device.exec",
        json!({"leaseId": "lse_nope", "tool": "sh"}),
        ErrorCode::UnknownLease,
    )
    .await;
    refused(
        &h,
        agent("agent-a"),
        "device.exec",
        json!({"leaseId": lease_id, "tool": "nope"}),
        ErrorCode::UnknownPassthroughTool,
    )
    .await;
    let mut naming = ok;
    naming["requesterId"] = json!("agent-a");
    refused(
        &h,
        agent("agent-a"),
        "device.exec",
        naming,
        ErrorCode::Forbidden,
    )
    .await;
}

#[tokio::test(start_paused = true)]
async fn worker_list() {
    let (h, _, _w) = busy().await;
    refused(
        &h,
        agent("x"),
        "worker.list",
        json!({}),
        ErrorCode::Forbidden,
    )
    .await;
}

#[tokio::test(start_paused = true)]
async fn gateway_only_operations() {
    let (h, _, _w) = busy().await;
    for op in ["worker.drain", "worker.undrain", "worker.remove"] {
        refused(
            &h,
            admin("op"),
            op,
            json!({"workerId": "worker-test"}),
            ErrorCode::UnsupportedInWorkerMode,
        )
        .await;
        let err = h
            .call_raw(admin("op"), op, json!({"workerId": "worker-test"}))
            .await
            .unwrap_err();
        assert_eq!(err.details, Some(json!({"operation": op})));
    }
}

#[tokio::test]
async fn every_registered_operation_has_a_bad_input_test_above() {
    // Keep this list in step with the tests in this file.
    let tested = [
        "status.get",
        "catalog.get",
        "config.get",
        "list.get",
        "lease.request",
        "lease.renew",
        "lease.release",
        "lease.cancel",
        "lease.list",
        "lease.release-all",
        "device.exec",
        "worker.list",
        "worker.drain",
        "worker.undrain",
        "worker.remove",
    ];
    assert_eq!(OPERATIONS, tested);
    let mut router = Router::new();
    let h = Harness::build(Build {
        start: false,
        ..Build::default()
    });
    register(&mut router, &h.worker, h.gate.clone());
    let mut names = router.names();
    names.sort_unstable();
    let mut expected = OPERATIONS.to_vec();
    expected.sort_unstable();
    assert_eq!(names, expected);
}
