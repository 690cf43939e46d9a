//! The bound on a request's head, over a raw loopback socket: a head over
//! [`MAX_REQUEST_HEAD`] bytes or [`MAX_REQUEST_HEADERS`] fields, and a head that is not HTTP,
//! are refused by the HTTP layer itself (status, empty body, connection closed), the refusal is
//! logged with the peer, and the daemon goes on serving new connections.

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    reason = "tests fail by panicking"
)]

mod common;

use std::sync::OnceLock;

use common::{Captured, Host, host_in};
use serde_json::Value;
use simlock_contract::model::Mode;
use simlock_daemon::http::{MAX_REQUEST_HEAD, MAX_REQUEST_HEADERS};
use simlock_test_support::markdown::doc;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// The log, every test's: the subscriber is the process's, set before any test serves, so no
/// log call site is met before it (a thread-local one races with other tests' threads over
/// tracing's call-site cache). Each test tells its own events by its peers' addresses.
fn logs() -> &'static Captured {
    static LOGS: OnceLock<Captured> = OnceLock::new();
    LOGS.get_or_init(|| {
        let captured = Captured::default();
        let writer = captured.clone();
        let subscriber = tracing_subscriber::fmt()
            .json()
            .with_max_level(tracing::Level::DEBUG)
            .with_writer(move || writer.clone())
            .finish();
        tracing::subscriber::set_global_default(subscriber).unwrap();
        captured
    })
}

async fn host() -> Host {
    logs();
    host_in(Mode::Gateway).await
}

/// What came back for `raw` sent on a new connection: the status, the head and the body, once
/// the daemon closed the connection. Also the connection's own address (the daemon's peer).
async fn send(addr: &str, raw: &[u8]) -> (u16, String, String, String) {
    let mut stream = tokio::net::TcpStream::connect(addr).await.unwrap();
    let local = stream.local_addr().unwrap().to_string();
    // A refused head may be answered before all of it was read: a failed write is fine then.
    let _ = stream.write_all(raw).await;
    let mut back = Vec::new();
    // A reset after the answer (unread bytes of ours) is fine too: the answer was read first.
    let _ = stream.read_to_end(&mut back).await;
    let text = String::from_utf8_lossy(&back).into_owned();
    let (head, body) = text
        .split_once("\r\n\r\n")
        .unwrap_or_else(|| panic!("no answer: {text:?}"));
    let status = head.split_whitespace().nth(1).unwrap().parse().unwrap();
    (status, head.to_owned(), body.to_owned(), local)
}

/// `GET /v1/healthz` with `Connection: close` whose head is exactly `len` bytes long, padded
/// by one `x-pad` field.
fn head_of(len: usize) -> Vec<u8> {
    let frame = |pad: usize| {
        format!(
            "GET /v1/healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\nx-pad: {}\r\n\r\n",
            "p".repeat(pad)
        )
    };
    let head = frame(len - frame(0).len());
    assert_eq!(head.len(), len);
    head.into_bytes()
}

/// `GET /v1/healthz` with `Connection: close` and `count` header fields in all.
fn head_with_fields(count: usize) -> Vec<u8> {
    let mut head = "GET /v1/healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n".to_owned();
    for n in 2..count {
        head.push_str(&format!("x-field-{n}: {n}\r\n"));
    }
    head.push_str("\r\n");
    head.into_bytes()
}

/// The daemon still answers a plain request on a new connection.
async fn still_serves(addr: &str) {
    let (status, _, body, _) = send(
        addr,
        b"GET /v1/healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
    )
    .await;
    assert_eq!(status, 200, "{body}");
}

/// The HTTP layer's refusal: no body (`content-length: 0`) and the connection closes.
fn assert_bodyless(head: &str, body: &str) {
    assert!(body.is_empty(), "{body:?}");
    assert!(
        head.to_ascii_lowercase().contains("content-length: 0"),
        "{head}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_head_at_the_bound_is_served_and_one_byte_more_is_refused_with_431() {
    let host = host().await;
    let (status, _, body, _) = send(&host.addr, &head_of(MAX_REQUEST_HEAD)).await;
    assert_eq!(
        status, 200,
        "a head of exactly {MAX_REQUEST_HEAD} bytes: {body}"
    );

    let (status, head, body, _) = send(&host.addr, &head_of(MAX_REQUEST_HEAD + 1)).await;
    assert_eq!(status, 431, "{head}");
    assert_bodyless(&head, &body);
    still_serves(&host.addr).await;

    // Far over the bound (hyper's own read buffer would have taken 200 KB): the same refusal.
    let (status, _, _, _) = send(&host.addr, &head_of(200 * 1024)).await;
    assert_eq!(status, 431);
    still_serves(&host.addr).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_head_of_the_most_fields_is_served_and_one_field_more_is_refused_with_431() {
    let host = host().await;
    let (status, _, body, _) = send(&host.addr, &head_with_fields(MAX_REQUEST_HEADERS)).await;
    assert_eq!(status, 200, "{MAX_REQUEST_HEADERS} fields: {body}");

    let (status, head, body, _) =
        send(&host.addr, &head_with_fields(MAX_REQUEST_HEADERS + 1)).await;
    assert_eq!(status, 431, "{head}");
    assert_bodyless(&head, &body);
    still_serves(&host.addr).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_garbled_request_line_is_refused_with_400_and_the_daemon_keeps_serving() {
    let host = host().await;
    for garbled in [
        &b"\x01\x02 this is not HTTP\r\n\r\n"[..],
        // What an https:// client sends first to a plain port: a TLS record.
        &b"\x16\x03\x01\x00\xa5\x01\x00\x00\xa1\x03\x03\r\n\r\n"[..],
        b"GET /v1/healthz HTTP/9\r\nHost: x\r\n\r\n",
    ] {
        let (status, head, body, _) = send(&host.addr, garbled).await;
        assert_eq!(status, 400, "{garbled:?}: {head}");
        assert_bodyless(&head, &body);
        still_serves(&host.addr).await;
    }
}

/// Each logged event's fields, with its level as `level`.
fn events(captured: &Captured) -> Vec<Value> {
    String::from_utf8_lossy(&captured.0.lock())
        .lines()
        .map(|line| {
            let mut event: Value = serde_json::from_str(line).unwrap();
            let level = event["level"].clone();
            let mut fields = event["fields"].take();
            fields["level"] = level;
            fields
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_head_is_logged_with_its_peer_and_status() {
    let host = host().await;

    let (status, _, _, too_large) = send(&host.addr, &head_of(MAX_REQUEST_HEAD + 1)).await;
    assert_eq!(status, 431);
    let (status, _, _, garbled) = send(&host.addr, b"\x01\x02 this is not HTTP\r\n\r\n").await;
    assert_eq!(status, 400);
    // Every connection's task has ended, and logged, once the host has stopped.
    host.stop.cancel();
    host.served.await.unwrap();

    let events = events(logs());
    let of = |peer: &str| {
        events
            .iter()
            .filter(|e| e["peer"] == peer)
            .cloned()
            .collect::<Vec<_>>()
    };
    let [too_large] = &of(&too_large)[..] else {
        panic!("one event for the oversized head's peer: {events:#?}");
    };
    assert_eq!(too_large["level"], "INFO", "{too_large}");
    assert_eq!(too_large["status"], 431, "{too_large}");
    assert_eq!(too_large["message"], "HTTP request refused: head too large");
    let [garbled] = &of(&garbled)[..] else {
        panic!("one event for the garbled head's peer: {events:#?}");
    };
    assert_eq!(garbled["level"], "DEBUG", "{garbled}");
    assert_eq!(garbled["status"], 400, "{garbled}");
    assert_eq!(garbled["message"], "HTTP request refused: malformed head");
}

#[test]
fn the_head_bounds_are_documented() {
    let text = doc("HTTP-API.md");
    for expected in [
        format!("{} KiB ({MAX_REQUEST_HEAD} bytes)", MAX_REQUEST_HEAD / 1024),
        format!("more than {MAX_REQUEST_HEADERS} header fields"),
        "answers `431`".to_owned(),
        "`content-length: 0`".to_owned(),
    ] {
        assert!(
            text.contains(&expected),
            "HTTP-API.md does not say {expected:?}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_authorization_sent_twice_is_refused_whichever_comes_first() {
    let host = host().await;
    let (operator, _) = host
        .tokens
        .create(simlock_contract::model::TokenRole::Operator, None)
        .unwrap();
    let (agent, _) = host
        .tokens
        .create(simlock_contract::model::TokenRole::Agent, None)
        .unwrap();
    let request_with = |first: &str, second: Option<&str>| {
        let mut raw = format!(
            "GET /v1/tokens HTTP/1.1\r\nHost: x\r\nConnection: close\r\nAuthorization: Bearer {first}\r\n"
        );
        if let Some(second) = second {
            raw.push_str(&format!("Authorization: Bearer {second}\r\n"));
        }
        raw.push_str("\r\n");
        raw
    };
    let (status, _, body, _) = send(&host.addr, request_with(&operator, None).as_bytes()).await;
    assert_eq!(status, 200, "one operator token: {body}");
    for (first, second) in [(&operator, &agent), (&agent, &operator)] {
        let (status, _, body, _) =
            send(&host.addr, request_with(first, Some(second)).as_bytes()).await;
        assert_eq!(status, 400, "{body}");
        let error: Value = serde_json::from_str(&body).unwrap();
        assert_eq!(error["error"]["code"], "BAD_REQUEST");
        assert_eq!(
            error["error"]["message"],
            "Authorization: sent 2 times; send it once"
        );
    }
}
