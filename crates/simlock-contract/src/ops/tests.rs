//! Tests of the operation table and every input bound.
//!
//! Each bound is checked twice from a valid base payload: at its limit the input passes, one past
//! it the input fails `BAD_REQUEST` with a message naming the field as the wire spells it.

use serde_json::{Value, json};

use super::*;
use crate::ErrorCode;

/// Sets `field` of `base` to `value` (a `null` value removes it).
fn with(base: &Value, field: &str, value: Value) -> Value {
    let mut payload = base.clone();
    if let Some(object) = payload.as_object_mut() {
        if value.is_null() {
            object.remove(field);
        } else {
            object.insert(field.to_owned(), value);
        }
    }
    payload
}

/// At `at_limit` the input passes; at `past_limit` it fails naming `field`.
#[track_caller]
fn check_bound(op: &str, base: &Value, field: &str, at_limit: Value, past_limit: Value) {
    let ok = decode_named(op, Some(with(base, field, at_limit.clone()))).expect("known operation");
    assert!(
        ok.is_ok(),
        "{op}.{field} at its limit ({at_limit}) was refused: {ok:?}"
    );
    let err = decode_named(op, Some(with(base, field, past_limit.clone())))
        .expect("known operation")
        .expect_err("one past the limit must fail");
    assert_eq!(err.code, ErrorCode::BadRequest, "{op}.{field}");
    assert!(
        err.message.starts_with(field),
        "{op}.{field}: message does not name the field: {}",
        err.message
    );
}

/// The input fails naming `field`.
#[track_caller]
fn check_refused(op: &str, payload: Value, field: &str) {
    let err = decode_named(op, Some(payload))
        .expect("known operation")
        .expect_err("must be refused");
    assert_eq!(err.code, ErrorCode::BadRequest);
    assert!(
        err.message.contains(field),
        "message does not name {field}: {}",
        err.message
    );
}

fn s(n: usize) -> Value {
    Value::String("a".repeat(n))
}

#[test]
fn the_table_holds_every_operation_the_design_keeps() {
    let names: Vec<_> = OPERATIONS.iter().map(|op| op.name).collect();
    assert_eq!(
        names,
        [
            "hello",
            "status.get",
            "catalog.get",
            "config.get",
            "list.get",
            "lease.request",
            "lease.renew",
            "lease.release",
            "lease.cancel",
            "lease.list",
            "lease.get",
            "lease.release-all",
            "device.exec",
            "events.subscribe",
            "events.unsubscribe",
            "events.replay",
            "token.create",
            "token.list",
            "token.revoke",
            "daemon.stop",
            "worker.list",
            "worker.drain",
            "worker.undrain",
            "worker.remove",
            "relay.request",
            "relay.cancel",
        ]
    );
    assert_eq!(
        OperationSpec::find("lease.request").map(|op| op.role),
        Some(Role::Agent)
    );
    assert_eq!(
        OperationSpec::find("relay.request").map(|op| op.role),
        Some(Role::Admin)
    );
    assert_eq!(OperationSpec::find("nope"), None);
}

#[test]
fn strict_inputs_refuse_unknown_keys_and_the_others_ignore_them() {
    let valid: &[(&str, Value)] = &[
        ("hello", json!({"protocolVersion": 2})),
        ("status.get", json!({})),
        ("catalog.get", json!({})),
        ("config.get", json!({})),
        ("list.get", json!({})),
        ("lease.request", json!({"platform": "ios"})),
        ("lease.renew", json!({"leaseId": "lse_1"})),
        ("lease.release", json!({"leaseId": "lse_1"})),
        ("lease.cancel", json!({})),
        ("lease.list", json!({})),
        ("lease.get", json!({"leaseId": "lse_1"})),
        ("lease.release-all", json!({})),
        (
            "device.exec",
            json!({"leaseId": "lse_1", "tool": "echo", "args": []}),
        ),
        ("events.subscribe", json!({})),
        ("events.unsubscribe", json!({})),
        ("events.replay", json!({})),
        ("token.create", json!({"role": "agent"})),
        ("token.list", json!({})),
        ("token.revoke", json!({"id": "tok_1"})),
        ("daemon.stop", json!({})),
        ("worker.list", json!({})),
        ("worker.drain", json!({"workerId": "w1"})),
        ("worker.undrain", json!({"workerId": "w1"})),
        ("worker.remove", json!({"workerId": "w1"})),
        ("relay.request", relay_base()),
        ("relay.cancel", json!({"relayId": "r1"})),
    ];
    assert_eq!(valid.len(), OPERATIONS.len());
    for (op, payload) in valid {
        let spec = OperationSpec::find(op).expect("in the table");
        assert!(
            decode_named(op, Some(payload.clone()))
                .expect("known")
                .is_ok(),
            "{op} base payload refused"
        );
        let extra = with(payload, "surprise", json!(1));
        let outcome = decode_named(op, Some(extra)).expect("known");
        assert_eq!(
            outcome.is_err(),
            spec.strict,
            "{op}: strict is {} but an unknown key gave {outcome:?}",
            spec.strict
        );
        if let Err(err) = outcome {
            assert!(err.message.contains("surprise"), "{}", err.message);
        }
    }
}

#[test]
fn wrong_types_name_the_field() {
    check_refused("lease.request", json!({"platform": "windows"}), "platform");
    check_refused(
        "lease.request",
        json!({"platform": "ios", "ttlMs": "soon"}),
        "ttlMs",
    );
    check_refused("lease.request", json!({}), "platform");
    check_refused(
        "device.exec",
        json!({"leaseId": "lse_1", "tool": "x", "args": "a"}),
        "args",
    );
}

/// Outside trial 21: what a caller names may not hold control characters (an agent's
/// requester id forged a row, and sent escape codes, to an operator's `leases --all`); any
/// other character, accents and emoji included, is taken.
#[test]
fn names_refuse_control_characters_and_take_any_other_text() {
    let request = json!({"platform": "android"});
    for field in [
        "model",
        "osVersion",
        "requesterId",
        "idempotencyKey",
        "owner",
    ] {
        for bad in [
            "a\nb",
            "red\u{1b}[31m",
            "nul\u{0}",
            "del\u{7f}",
            "c1\u{85}",
            "tab\t",
            "agent-1\u{200b}",
            "\u{202e}RTL",
            "\u{feff}bom",
            "line\u{2028}sep",
        ] {
            check_bound(
                "lease.request",
                &request,
                field,
                json!("Zoë 🦀 x"),
                json!(bad),
            );
        }
    }
    check_bound(
        "lease.cancel",
        &json!({}),
        "requesterId",
        json!("é"),
        json!("a\rb"),
    );
    check_bound(
        "device.exec",
        &json!({"leaseId": "lse_1", "tool": "x"}),
        "requesterId",
        json!("é"),
        json!("a\u{1b}b"),
    );
    check_bound(
        "token.create",
        &json!({"role": "agent"}),
        "label",
        json!("ci runner · 2"),
        json!("x\ny"),
    );
    let err = crate::decode_input::<LeaseRequestInput>(Some(
        json!({"platform": "ios", "requesterId": "evil\nlse_fake"}),
    ))
    .unwrap_err();
    assert_eq!(err.code, ErrorCode::BadRequest);
    assert!(
        err.message.contains("requesterId") && err.message.contains("control characters"),
        "{}",
        err.message
    );
    for field in ["principal", "clientVersion"] {
        let hello = |value: &str| {
            crate::decode_input::<Hello>(Some(json!({ field: value, "protocolVersion": 2 })))
        };
        assert!(hello("agent · 1").is_ok(), "{field}");
        let err = hello("agent\u{1b}[2J").unwrap_err();
        assert_eq!(err.code, ErrorCode::BadRequest);
        assert!(err.message.contains(field), "{}", err.message);
    }
}

#[test]
fn lease_request_bounds() {
    let base = json!({"platform": "android"});
    let op = "lease.request";
    check_bound(
        op,
        &base,
        "model",
        s(bounds::MAX_MODEL),
        s(bounds::MAX_MODEL + 1),
    );
    check_bound(op, &base, "model", s(1), s(0));
    check_bound(
        op,
        &base,
        "osVersion",
        s(bounds::MAX_OS_VERSION),
        s(bounds::MAX_OS_VERSION + 1),
    );
    check_bound(
        op,
        &base,
        "requesterId",
        s(bounds::MAX_REQUESTER),
        s(bounds::MAX_REQUESTER + 1),
    );
    check_bound(op, &base, "requesterId", s(1), s(0));
    check_bound(
        op,
        &base,
        "timeoutMs",
        json!(bounds::MAX_QUEUE_TIMEOUT_MS),
        json!(bounds::MAX_QUEUE_TIMEOUT_MS + 1),
    );
    check_bound(op, &base, "timeoutMs", json!(1), json!(0));
    check_bound(
        op,
        &base,
        "ttlMs",
        json!(bounds::MAX_TTL_MS),
        json!(bounds::MAX_TTL_MS + 1),
    );
    check_bound(op, &base, "ttlMs", json!(1), json!(0));
    check_bound(
        op,
        &base,
        "idempotencyKey",
        s(bounds::MAX_IDEMPOTENCY_KEY),
        s(bounds::MAX_IDEMPOTENCY_KEY + 1),
    );
    check_bound(
        op,
        &base,
        "owner",
        s(bounds::MAX_REQUESTER),
        s(bounds::MAX_REQUESTER + 1),
    );
    check_bound(op, &base, "leaseId", s(64), s(65));
    check_bound(op, &base, "leaseId", json!("a_b-C9"), json!("a.b"));
    check_bound(op, &base, "leaseId", json!("a"), json!("_a"));
    let eight: Vec<_> = (0..8).map(|i| format!("cap-{i}")).collect();
    let nine: Vec<_> = (0..9).map(|i| format!("cap-{i}")).collect();
    check_bound(op, &base, "requires", json!(eight), json!(nine));
    let longest = format!("a{}", "b".repeat(63));
    check_bound(
        op,
        &base,
        "requires",
        json!([longest]),
        json!([format!("{longest}b")]),
    );
    check_bound(
        op,
        &base,
        "requires",
        json!(["agent-device"]),
        json!(["Agent-device"]),
    );
    check_bound(op, &base, "requires", json!(["a9-"]), json!(["9a"]));
}

#[test]
fn lease_id_inputs() {
    for op in ["lease.renew", "lease.release"] {
        let base = json!({"leaseId": "lse_1"});
        check_bound(op, &base, "leaseId", s(160), s(161));
        check_bound(
            op,
            &base,
            "leaseId",
            json!("3f81-aa.lse_0a"),
            json!("lse 1"),
        );
    }
    check_bound(
        "lease.renew",
        &json!({"leaseId": "x"}),
        "ttlMs",
        json!(bounds::MAX_TTL_MS),
        json!(bounds::MAX_TTL_MS + 1),
    );
    check_bound(
        "lease.renew",
        &json!({"leaseId": "x"}),
        "ttlMs",
        json!(1),
        json!(0),
    );
    check_bound(
        "lease.cancel",
        &json!({}),
        "requesterId",
        s(bounds::MAX_REQUESTER),
        s(bounds::MAX_REQUESTER + 1),
    );
}

#[test]
fn exec_bounds() {
    let op = "device.exec";
    let base = json!({"leaseId": "lse_1", "tool": "echo", "args": []});
    check_bound(
        op,
        &base,
        "tool",
        s(bounds::MAX_TOOL),
        s(bounds::MAX_TOOL + 1),
    );
    check_bound(op, &base, "tool", s(1), s(0));
    check_bound(
        op,
        &base,
        "args",
        json!(vec!["a"; bounds::MAX_ARGS]),
        json!(vec!["a"; bounds::MAX_ARGS + 1]),
    );
    check_bound(
        op,
        &base,
        "args",
        json!([s(bounds::MAX_ARG)]),
        json!([s(bounds::MAX_ARG + 1)]),
    );
    check_bound(
        op,
        &base,
        "stdin",
        s(bounds::MAX_STDIN),
        s(bounds::MAX_STDIN + 1),
    );
    check_bound(
        op,
        &base,
        "requesterId",
        s(bounds::MAX_REQUESTER),
        s(bounds::MAX_REQUESTER + 1),
    );
}

#[test]
fn admin_input_bounds() {
    check_bound(
        "token.create",
        &json!({"role": "agent"}),
        "label",
        s(bounds::MAX_LABEL),
        s(bounds::MAX_LABEL + 1),
    );
    check_refused("token.create", json!({"role": "root"}), "role");
    check_bound("token.revoke", &json!({"id": "tok_1"}), "id", s(64), s(65));
    for op in ["worker.drain", "worker.undrain", "worker.remove"] {
        check_bound(op, &json!({"workerId": "w"}), "workerId", s(128), s(129));
        check_bound(
            op,
            &json!({"workerId": "w"}),
            "workerId",
            json!("a-b_c"),
            json!("a.b"),
        );
    }
    let limit = bounds::MAX_TIMESTAMP_MS;
    check_bound(
        "events.replay",
        &json!({}),
        "sinceTs",
        json!(limit),
        json!(limit + 1),
    );
    check_bound(
        "events.replay",
        &json!({}),
        "sinceTs",
        json!(-limit),
        json!(-limit - 1),
    );
    check_refused("list.get", json!({"kind": "everything"}), "kind");
}

#[test]
fn hello_bounds() {
    let base = json!({"protocolVersion": 2});
    check_bound(
        "hello",
        &base,
        "principal",
        s(bounds::MAX_REQUESTER),
        s(bounds::MAX_REQUESTER + 1),
    );
    check_bound("hello", &base, "clientVersion", s(64), s(65));
    check_bound("hello", &base, "credential", s(512), s(513));
    check_bound("hello", &base, "protocolVersion", json!(1), json!(0));
}

fn relay_base() -> Value {
    json!({
        "relayId": "r1",
        "target": "agent-device",
        "method": "POST",
        "url": "http://gateway.example/v1/agent-device/rpc?x=1",
        "headers": [["content-type", "application/json"]],
        "tenant": "gw.9a0c.tok_1",
        "leaseId": "0123456789abcdef0123456789abcdef",
        "hasBody": true,
        "channel": "c-1"
    })
}

#[test]
fn relay_request_bounds() {
    let op = "relay.request";
    let base = relay_base();
    check_bound(op, &base, "relayId", s(64), s(65));
    check_bound(op, &base, "relayId", json!("a_-Z9"), json!("a.b"));
    check_bound(
        op,
        &base,
        "target",
        json!(format!("a{}", "b".repeat(63))),
        json!(format!("a{}", "b".repeat(64))),
    );
    check_bound(
        op,
        &base,
        "target",
        json!("agent-device"),
        json!("Agent-device"),
    );
    check_bound(op, &base, "method", json!("OPTIONS"), json!("TRACE"));
    let at_limit = format!("http://h/{}", "a".repeat(bounds::MAX_RELAY_URL - 9));
    check_bound(
        op,
        &base,
        "url",
        json!(at_limit),
        json!(format!("{at_limit}a")),
    );
    check_bound(op, &base, "url", json!("https://h/"), json!("/relative"));
    check_bound(
        op,
        &base,
        "url",
        json!("http://h/"),
        json!("file:///etc/passwd"),
    );
    let headers = |n: usize| {
        json!(
            (0..n)
                .map(|i| [format!("x-h{i}"), "v".to_owned()])
                .collect::<Vec<_>>()
        )
    };
    check_bound(
        op,
        &base,
        "headers",
        headers(bounds::MAX_RELAY_HEADERS),
        headers(bounds::MAX_RELAY_HEADERS + 1),
    );
    check_bound(
        op,
        &base,
        "headers",
        json!([["x-ok", "v"]]),
        json!([["bad name", "v"]]),
    );
    check_bound(
        op,
        &base,
        "headers",
        json!([["x", "a b"]]),
        json!([["x", "a\nb"]]),
    );
    check_bound(
        op,
        &base,
        "headers",
        json!([["x", "a"]]),
        json!([["x", "a\rb"]]),
    );
    check_bound(
        op,
        &base,
        "headers",
        json!([["x", "a"]]),
        json!([["x", "a\u{0}b"]]),
    );
    check_bound(
        op,
        &base,
        "headers",
        json!([["x", "v".repeat(bounds::MAX_HEADER_VALUE)]]),
        json!([["x", "v".repeat(bounds::MAX_HEADER_VALUE + 1)]]),
    );
    check_bound(
        op,
        &base,
        "tenant",
        s(bounds::MAX_TENANT),
        s(bounds::MAX_TENANT + 1),
    );
    check_bound(op, &base, "tenant", s(1), s(0));
    check_bound(
        op,
        &base,
        "leaseId",
        json!("f".repeat(32)),
        json!("f".repeat(33)),
    );
    check_bound(
        op,
        &base,
        "leaseId",
        json!("0".repeat(32)),
        json!("A".repeat(32)),
    );
    check_bound(op, &base, "channel", s(32), s(33));
    check_bound(op, &base, "channel", json!("Ab-9"), json!("a_b"));
    check_bound(op, &base, "channel", s(1), s(0));
    check_refused(op, with(&base, "hasBody", Value::Null), "hasBody");
}

#[test]
fn a_get_or_head_with_a_body_is_refused() {
    let base = relay_base();
    for method in ["GET", "HEAD"] {
        let payload = with(
            &with(&base, "method", json!(method)),
            "hasBody",
            json!(true),
        );
        check_refused("relay.request", payload.clone(), "hasBody");
        let payload = with(&payload, "hasBody", json!(false));
        assert!(
            decode_named("relay.request", Some(payload))
                .expect("known")
                .is_ok()
        );
    }
}

#[test]
fn relay_cancel_bounds() {
    check_bound(
        "relay.cancel",
        &json!({"relayId": "r"}),
        "relayId",
        s(64),
        s(65),
    );
}

#[test]
fn list_output_is_keyed_by_kind() {
    let out = ListOutput::Requests(vec![]);
    assert_eq!(serde_json::to_value(out).unwrap(), json!({"requests": []}));
    let cancel = LeaseCancelOutput {
        result: CancelResult::NotCancellable,
    };
    assert_eq!(
        serde_json::to_value(cancel).unwrap(),
        json!({"result": "not-cancellable"})
    );
    assert_eq!(
        serde_json::to_value(RelayRequestOutput::default()).unwrap(),
        json!({})
    );
}

#[test]
fn a_workers_uplink_is_spelled_in_camel_case_and_names_an_error_only_when_there_is_one() {
    use crate::model::{UplinkConnection, UplinkStatus};
    let connecting = UplinkStatus {
        gateway: "ws://gw:4700".into(),
        state: UplinkConnection::Connecting,
        last_error: Some("rejected with HTTP 401: the gateway refused the join token (unknown or revoked): check gateway.token".into()),
        since: 1_700_000_000_000,
    };
    let value = json!({
        "gateway": "ws://gw:4700",
        "state": "connecting",
        "lastError": "rejected with HTTP 401: the gateway refused the join token (unknown or revoked): check gateway.token",
        "since": 1_700_000_000_000_i64,
    });
    assert_eq!(serde_json::to_value(&connecting).unwrap(), value);
    assert_eq!(
        serde_json::from_value::<UplinkStatus>(value).unwrap(),
        connecting
    );
    let connected = UplinkStatus {
        state: UplinkConnection::Connected,
        last_error: None,
        ..connecting
    };
    assert_eq!(
        serde_json::to_value(&connected).unwrap(),
        json!({"gateway": "ws://gw:4700", "state": "connected", "since": 1_700_000_000_000_i64})
    );
}

#[test]
fn a_relay_that_was_cancelled_is_logged_as_cancelled_and_every_other_answer_as_ok() {
    let cancelled = RelayRequestOutput {
        cancelled: Some(true),
    };
    assert_eq!(RelayRequest::outcome(&cancelled), "cancelled");
    assert_eq!(RelayRequest::outcome(&RelayRequestOutput::default()), "ok");
    assert_eq!(
        RelayRequest::outcome(&RelayRequestOutput {
            cancelled: Some(false)
        }),
        "ok"
    );
    assert_eq!(RelayCancel::outcome(&Empty {}), "ok");
}

#[test]
fn a_release_named_killed_is_an_admins_and_absent_or_explicit_is_anyones() {
    let input = |reason: Option<ReleaseReason>| LeaseIdInput {
        lease_id: "lse_1".into(),
        reason,
    };
    let refused = input(Some(ReleaseReason::Killed))
        .authorize(Role::Agent)
        .unwrap_err();
    assert_eq!(refused.code, ErrorCode::Forbidden);
    assert!(
        input(Some(ReleaseReason::Killed))
            .authorize(Role::Admin)
            .is_ok()
    );
    for role in [Role::Agent, Role::Admin] {
        assert!(input(None).authorize(role).is_ok());
        assert!(input(Some(ReleaseReason::Explicit)).authorize(role).is_ok());
    }
    // On the wire: absent is not sent; the reason in kebab case.
    assert_eq!(
        serde_json::to_value(input(None)).unwrap(),
        json!({"leaseId": "lse_1"})
    );
    assert_eq!(
        serde_json::to_value(input(Some(ReleaseReason::Killed))).unwrap(),
        json!({"leaseId": "lse_1", "reason": "killed"})
    );
}

#[test]
fn a_drain_answer_that_does_not_say_whether_it_changed_reads_as_changed() {
    let read = |value: Value| serde_json::from_value::<WorkerDrainOutput>(value).unwrap();
    assert!(read(json!({"workerId": "w1", "drained": true})).changed);
    assert!(!read(json!({"workerId": "w1", "drained": true, "changed": false})).changed);
}
