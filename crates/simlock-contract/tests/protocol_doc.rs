//! `docs/PROTOCOL.md` cannot drift: every example frame in it parses as the kind it claims, and
//! its operation and error tables list exactly what the contract defines.

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    reason = "test helpers fail the test by panicking"
)]

use simlock_contract::error::ERROR_TABLE;
use simlock_contract::{Call, OPERATIONS, Push, RawInbound};

fn doc() -> String {
    std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../docs/PROTOCOL.md"
    ))
    .unwrap()
}

/// The examples: (kind, text) for every ```json frame=<kind> block.
fn examples(doc: &str) -> Vec<(String, String)> {
    let mut out = Vec::new();
    let mut lines = doc.lines();
    while let Some(line) = lines.next() {
        if let Some(kind) = line.strip_prefix("```json frame=") {
            let body: Vec<&str> = lines
                .by_ref()
                .take_while(|l| !l.starts_with("```"))
                .collect();
            out.push((kind.trim().to_owned(), body.join("\n")));
        }
    }
    out
}

#[test]
fn every_example_frame_parses_as_its_kind() {
    let doc = doc();
    let examples = examples(&doc);
    let mut kinds: Vec<&str> = examples.iter().map(|(k, _)| k.as_str()).collect();
    kinds.sort_unstable();
    kinds.dedup();
    assert_eq!(
        kinds,
        ["call", "push", "reply"],
        "one example of every frame kind"
    );
    let mut push_kinds = Vec::new();
    let mut saw_error = false;
    let mut saw_result = false;
    for (kind, text) in &examples {
        match kind.as_str() {
            "call" => {
                let call = Call::parse(text.as_bytes()).unwrap_or_else(|e| panic!("{e}: {text}"));
                assert!(
                    OPERATIONS.iter().any(|op| op.name == call.op),
                    "unknown operation in {text}"
                );
                let check =
                    simlock_contract::ops::decode_named(&call.op, call.payload.clone()).unwrap();
                assert!(check.is_ok(), "example input refused: {check:?}: {text}");
            }
            "reply" => {
                let Ok(RawInbound::Reply { outcome, .. }) = RawInbound::parse(text.as_bytes())
                else {
                    panic!("not a reply: {text}")
                };
                match outcome {
                    Ok(_) => saw_result = true,
                    Err(body) => {
                        saw_error = true;
                        let err = simlock_contract::ContractError::from_body(body);
                        assert_ne!(
                            err.code,
                            simlock_contract::ErrorCode::UnknownDaemonError,
                            "{text}"
                        );
                    }
                }
            }
            "push" => {
                let Ok(RawInbound::Push(frame)) = RawInbound::parse(text.as_bytes()) else {
                    panic!("not a push: {text}")
                };
                let push = Push::from_frame(frame).unwrap_or_else(|e| panic!("{e}: {text}"));
                push_kinds.push(push.kind());
            }
            other => panic!("unknown example kind {other}"),
        }
    }
    assert!(
        saw_result && saw_error,
        "examples of a result and of an error"
    );
    push_kinds.sort_unstable();
    push_kinds.dedup();
    assert_eq!(
        push_kinds,
        [
            "device-recovered",
            "device-unhealthy",
            "event",
            "lease-lost",
            "output",
            "progress",
            "relay-head",
            "started"
        ],
        "one example of every push kind"
    );
}

#[test]
fn the_operation_table_lists_every_operation() {
    let doc = doc();
    for op in OPERATIONS {
        assert!(
            doc.contains(&format!("| `{}` |", op.name)),
            "{} missing from the operation table",
            op.name
        );
    }
}

#[test]
fn the_error_table_matches_the_contract() {
    let doc = doc();
    for row in ERROR_TABLE {
        let kind = serde_json::to_value(row.kind).unwrap();
        let line = format!(
            "| `{}` | {} | {} | {} |",
            row.code,
            kind.as_str().unwrap(),
            row.http,
            row.exit
        );
        assert!(doc.contains(&line), "missing or wrong row: {line}");
    }
}
