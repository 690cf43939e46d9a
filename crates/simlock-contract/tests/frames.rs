//! Property tests: every frame kind survives serialise → parse unchanged, and arbitrary bytes
//! never panic the frame parsers.

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    reason = "test helpers fail the test by panicking"
)]

use proptest::prelude::*;
use serde_json::{Value, json};
use simlock_contract::frame::to_line;
use simlock_contract::push::{OutputStream, Progress};
use simlock_contract::{
    Call, ContractError, ErrorBody, ErrorCode, FrameId, Push, PushFrame, RawInbound, Reply,
};

fn frame_id() -> impl Strategy<Value = FrameId> {
    prop_oneof![
        any::<u64>().prop_map(FrameId::from),
        "[ -~]{0,20}".prop_map(FrameId::Str)
    ]
}

/// The reply a line reads as (its payload as a value), in the shape it was written from.
fn read_reply(line: &str) -> Reply {
    let Ok(RawInbound::Reply { id, outcome }) = RawInbound::parse(line.as_bytes()) else {
        panic!("not a reply: {line}")
    };
    let outcome: Result<Value, ErrorBody> =
        outcome.map(|raw| serde_json::from_str(raw.get()).unwrap());
    Reply { id, outcome }
}

/// The push a line reads as.
fn read_push(line: &str) -> PushFrame {
    let Ok(RawInbound::Push(frame)) = RawInbound::parse(line.as_bytes()) else {
        panic!("not a push: {line}")
    };
    frame
}

fn payload() -> impl Strategy<Value = Value> {
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::Bool),
        any::<i64>().prop_map(|n| json!(n)),
        ".{0,16}".prop_map(Value::String),
    ];
    leaf.prop_recursive(3, 24, 4, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..4).prop_map(Value::Array),
            prop::collection::btree_map("[a-zA-Z]{1,8}", inner, 0..4)
                .prop_map(|m| Value::Object(m.into_iter().collect())),
        ]
    })
}

fn object() -> impl Strategy<Value = Value> {
    prop::collection::btree_map("[a-zA-Z]{1,8}", payload(), 0..4)
        .prop_map(|m| Value::Object(m.into_iter().collect()))
}

fn error_code() -> impl Strategy<Value = ErrorCode> {
    (0..simlock_contract::error::ERROR_TABLE.len())
        .prop_map(|i| simlock_contract::error::ERROR_TABLE[i].code)
}

fn push() -> impl Strategy<Value = Push> {
    prop_oneof![
        (frame_id(), 1u32..1000).prop_map(|(id, p)| Push::Progress {
            request_id: id,
            progress: Progress::queued(p)
        }),
        (frame_id(), any::<u64>()).prop_map(|(id, eta)| Push::Progress {
            request_id: id,
            progress: Progress::Booting { eta_ms: eta }
        }),
        frame_id().prop_map(|id| Push::Started { request_id: id }),
        (frame_id(), ".{0,40}", any::<bool>()).prop_map(|(id, chunk, out)| Push::Output {
            request_id: id,
            stream: if out {
                OutputStream::Stdout
            } else {
                OutputStream::Stderr
            },
            chunk,
        }),
        (
            frame_id(),
            200u16..600,
            prop::collection::vec(("[a-z-]{1,10}", "[ -~]{0,20}"), 0..5)
        )
            .prop_map(|(id, status, headers)| Push::RelayHead {
                request_id: id,
                status,
                headers
            }),
    ]
}

proptest! {
    #[test]
    fn calls_round_trip(id in frame_id(), op in "[a-z.-]{1,20}", payload in proptest::option::of(payload())) {
        let payload = payload.filter(|p| !p.is_null());
        let call = Call { id, op, payload };
        let line = to_line(&call).unwrap();
        prop_assert!(line.ends_with('\n'));
        prop_assert_eq!(Call::parse(line.trim_end().as_bytes()).unwrap(), call);
    }

    #[test]
    fn results_round_trip(id in frame_id(), payload in object()) {
        let reply = Reply::ok(id, payload);
        let line = to_line(&reply).unwrap();
        prop_assert_eq!(read_reply(&line), reply);
    }

    #[test]
    fn errors_round_trip(id in proptest::option::of(frame_id()), code in error_code(), message in ".{0,40}", details in proptest::option::of(object())) {
        let mut error = ContractError::new(code, message);
        error.details = details;
        let reply = Reply::err(id, &error);
        let line = to_line(&reply).unwrap();
        let back = read_reply(&line);
        prop_assert_eq!(&back, &reply);
        let Err(body) = back.outcome else { panic!("not an error") };
        prop_assert_eq!(ContractError::from_body(body), error);
    }

    #[test]
    fn pushes_round_trip(push in push()) {
        let frame = push.to_frame().unwrap();
        let line = to_line(&frame).unwrap();
        let back = read_push(&line);
        prop_assert_eq!(Push::from_frame(back).unwrap(), push);
    }

    #[test]
    fn arbitrary_bytes_never_panic_the_parsers(bytes in prop::collection::vec(any::<u8>(), 0..256)) {
        let _ = Call::parse(&bytes);
        let _ = RawInbound::parse(&bytes);
    }

    #[test]
    fn arbitrary_json_never_panics_the_decoders(value in payload()) {
        for spec in simlock_contract::OPERATIONS {
            let _ = simlock_contract::ops::decode_named(spec.name, Some(value.clone()));
        }
    }
}
