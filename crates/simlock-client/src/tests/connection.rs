//! Connections that end or misbehave: pending calls fail `DAEMON_CONNECTION_LOST`, unknown error
//! codes become `UNKNOWN_DAEMON_ERROR`, a silent daemon is bounded.

use std::time::Duration;

use serde_json::{Value, json};
use simlock_contract::ErrorCode;
use simlock_contract::model::Platform;
use simlock_contract::ops::LeaseRequestInput;
use simlock_wire::Transport;
use tokio::io::{AsyncBufReadExt as _, AsyncWriteExt as _, BufReader};

use super::{guard, guard_paused, pipe_client};
use crate::{Client, ConnectOptions};
use simlock_test_support::fake_daemon::{FakeDaemon, RequestScript};

#[tokio::test]
async fn a_lost_connection_fails_pending_and_later_calls() {
    let fake = FakeDaemon::new().unwrap();
    fake.script_request(RequestScript::Hold(Vec::new()));
    let (client, cut) = pipe_client(&fake).await;
    let request = tokio::spawn({
        let client = client.clone();
        async move {
            client
                .request_lease(
                    LeaseRequestInput::for_platform(Platform::Ios),
                    |_| {},
                    std::future::pending(),
                )
                .await
        }
    });
    guard(fake.wait_for_calls("lease.request", 1)).await;
    cut.cut();
    let err = guard(request).await.unwrap().unwrap_err();
    assert_eq!(err.code, ErrorCode::DaemonConnectionLost);
    assert!(client.is_closed());
    assert_eq!(
        guard(client.status()).await.unwrap_err().code,
        ErrorCode::DaemonConnectionLost
    );
}

/// `hello`'s success.
fn hello_ok(call: &Value) -> Value {
    json!({"id": call["id"], "ok": true, "payload": {
        "protocolVersion": 2,
        "daemonProtocolRange": {"min": 2, "max": 2},
        "version": "scripted",
        "role": "agent",
        "principal": "someone"
    }})
}

/// A daemon written by hand: answers each call with `answer(call)` (or nothing).
fn scripted_daemon(answer: impl Fn(&Value) -> Option<Value> + Send + 'static) -> Transport {
    let (client_end, server_end) = tokio::io::duplex(64 * 1024);
    tokio::spawn(async move {
        let (r, mut w) = tokio::io::split(server_end);
        let mut lines = BufReader::new(r).lines();
        while let Ok(Some(line)) = lines.next_line().await {
            let call: Value = serde_json::from_str(&line).unwrap();
            if let Some(reply) = answer(&call) {
                let mut text = reply.to_string();
                text.push('\n');
                w.write_all(text.as_bytes()).await.unwrap();
            }
        }
    });
    let (r, w) = tokio::io::split(client_end);
    Transport::client_io(r, w)
}

#[tokio::test]
async fn an_unknown_error_code_becomes_unknown_daemon_error() {
    let transport = scripted_daemon(|call| {
        Some(if call["type"] == "hello" {
            hello_ok(call)
        } else {
            json!({"id": call["id"], "ok": false, "error": {"code": "BRAND_NEW", "message": "a new failure"}})
        })
    });
    let client = guard(Client::over_transport(transport, ConnectOptions::default()))
        .await
        .unwrap();
    assert_eq!(client.principal(), Some("someone"));
    let err = guard(client.status()).await.unwrap_err();
    assert_eq!(err.code, ErrorCode::UnknownDaemonError);
    assert_eq!(
        err.details,
        Some(json!({"code": "BRAND_NEW", "message": "a new failure"}))
    );
    assert_eq!(err.code.exit_code(), 1);
}

#[tokio::test(start_paused = true)]
async fn a_daemon_that_never_answers_is_bounded() {
    let transport = scripted_daemon(|call| (call["type"] == "hello").then(|| hello_ok(call)));
    let options = ConnectOptions::default().call_timeout(Duration::from_secs(5));
    let client = guard_paused(Client::over_transport(transport, options))
        .await
        .unwrap();
    let start = tokio::time::Instant::now();
    let err = guard_paused(client.status()).await.unwrap_err();
    assert_eq!(err.code, ErrorCode::DaemonConnectionLost);
    assert_eq!(
        err.message,
        "the daemon did not answer status.get within 5000 ms"
    );
    assert_eq!(tokio::time::Instant::now() - start, Duration::from_secs(5));
}

#[tokio::test]
async fn a_protocol_mismatch_is_refused_at_hello() {
    let transport = scripted_daemon(|call| {
        // The client offers the contract's range.
        assert_eq!(
            call["payload"]["protocolRange"],
            json!({"min": 2, "max": 2})
        );
        Some(json!({"id": call["id"], "ok": false, "error": {
            "code": "PROTOCOL_VERSION_UNSUPPORTED",
            "message": "Protocol version mismatch: client speaks 1..1, daemon speaks 7..8",
            "details": {"client": {"min": 2, "max": 2}, "daemon": {"min": 7, "max": 8}, "daemonVersion": "9"}
        }}))
    });
    let err = guard(Client::over_transport(transport, ConnectOptions::default()))
        .await
        .unwrap_err();
    assert_eq!(err.code, ErrorCode::ProtocolVersionUnsupported);
    assert_eq!(
        simlock_contract::protocol::unsupported_ranges(err.details.as_ref())
            .map(|(_, daemon)| daemon.min),
        Some(7)
    );
}
