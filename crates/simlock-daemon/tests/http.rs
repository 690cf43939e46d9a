//! The HTTP host's own bounds and authentication, over a real loopback listener.

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    reason = "tests fail by panicking"
)]

mod common;

use std::time::Duration;

use common::{Host, host_in};
use serde_json::{Value, json};
use simlock_contract::model::{Mode, TokenRole};
use simlock_daemon::http::HEADER_READ_TIMEOUT;
use simlock_daemon::http::body::{BODY_READ_TIMEOUT, MAX_JSON_BODY};
use simlock_test_support::raw_http::{chunked_request, read_response, send};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

async fn host() -> Host {
    host_in(Mode::Gateway).await
}

/// One HTTP/1.1 exchange with `Connection: close`: the status and the body.
async fn exchange(
    addr: &str,
    method: &str,
    path: &str,
    token: Option<&str>,
    body: &[u8],
) -> (u16, String) {
    let (status, _, body) = raw_exchange(addr, method, path, token, &[], body).await;
    (status, body)
}

/// One request on its own connection, written by hand (the head as given, then `body`): the
/// status, the head (lower-cased) and the body of the answer.
async fn raw_exchange(
    addr: &str,
    method: &str,
    path: &str,
    token: Option<&str>,
    headers: &[&str],
    body: &[u8],
) -> (u16, String, String) {
    let mut stream = tokio::net::TcpStream::connect(addr).await.unwrap();
    let mut head = format!(
        "{method} {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Length: {}\r\n",
        body.len()
    );
    if let Some(token) = token {
        head.push_str(&format!("Authorization: Bearer {token}\r\n"));
    }
    for line in headers {
        head.push_str(line);
        head.push_str("\r\n");
    }
    head.push_str("\r\n");
    stream.write_all(head.as_bytes()).await.unwrap();
    // The server may answer before reading a refused body; a reset write is fine then.
    let _ = stream.write_all(body).await;
    let mut raw = Vec::new();
    let _ = stream.read_to_end(&mut raw).await;
    let text = String::from_utf8_lossy(&raw).into_owned();
    let (head, rest) = text
        .split_once("\r\n\r\n")
        .unwrap_or_else(|| panic!("no response to {method} {path}: {text:?}"));
    (
        head.split_whitespace().nth(1).unwrap().parse().unwrap(),
        head.to_ascii_lowercase(),
        rest.to_owned(),
    )
}

/// A JSON object of exactly `len` bytes that `token.create` accepts.
fn body_of(len: usize) -> Vec<u8> {
    let frame = |pad: usize| json!({"role": "agent", "pad": "p".repeat(pad)}).to_string();
    let overhead = frame(0).len();
    let body = frame(len - overhead);
    assert_eq!(body.len(), len);
    body.into_bytes()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_json_body_at_1_mib_is_read_and_one_byte_more_is_refused_naming_the_body() {
    let host = host().await;
    let (secret, _) = host.tokens.create(TokenRole::Operator, None).unwrap();
    let (status, body) = exchange(
        &host.addr,
        "POST",
        "/v1/ops/token.create",
        Some(&secret),
        &body_of(MAX_JSON_BODY),
    )
    .await;
    assert_eq!(status, 200, "{body}");
    assert!(
        serde_json::from_str::<Value>(&body).unwrap()["secret"]
            .as_str()
            .unwrap()
            .starts_with("slk_")
    );
    let (status, body) = exchange(
        &host.addr,
        "POST",
        "/v1/ops/token.create",
        Some(&secret),
        &body_of(MAX_JSON_BODY + 1),
    )
    .await;
    assert_eq!(status, 400, "{body}");
    let error: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(error["error"]["code"], "BAD_REQUEST");
    assert!(
        error["error"]["message"]
            .as_str()
            .unwrap()
            .starts_with("body:"),
        "{body}"
    );
    assert_eq!(
        host.tokens.list().unwrap().len(),
        2,
        "the refused body created nothing"
    );
    // The host lives on.
    assert_eq!(
        exchange(&host.addr, "GET", "/v1/healthz", None, b"")
            .await
            .0,
        200
    );
    host.stop.cancel();
}

/// A chunked body past the bound, sent whole before the caller reads (as curl and Node's
/// `fetch` send), is read on and dropped: the caller reads the refusal, not a reset, and the
/// connection serves its next request.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_chunked_body_past_1_mib_sent_whole_is_refused_and_the_connection_serves_on() {
    let host = host().await;
    let (secret, _) = host.tokens.create(TokenRole::Operator, None).unwrap();
    let mut stream = tokio::net::TcpStream::connect(&host.addr).await.unwrap();
    let request = chunked_request(
        &format!(
            "POST /v1/ops/token.create HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {secret}\r\n"
        ),
        2 * 1024 * 1024,
        b' ',
    );
    send(&mut stream, &request).await;
    let (status, body) = read_response(&mut stream).await;
    assert_eq!(status, 400, "{body}");
    assert!(
        body.contains(&format!("body: larger than {MAX_JSON_BODY} bytes")),
        "{body}"
    );
    send(&mut stream, b"GET /v1/healthz HTTP/1.1\r\nHost: x\r\n\r\n").await;
    assert_eq!(read_response(&mut stream).await.0, 200);
    assert_eq!(host.tokens.list().unwrap().len(), 1, "nothing was created");
    host.stop.cancel();
}

/// A body declared larger than the bound is refused at once, before any of it arrives: the
/// caller is not kept waiting for the body's time bound, and one that asked
/// `Expect: 100-continue` is not invited to send it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_body_declared_larger_than_1_mib_is_refused_before_it_is_sent() {
    let host = host().await;
    let (secret, _) = host.tokens.create(TokenRole::Operator, None).unwrap();
    for (length, expect) in [
        (MAX_JSON_BODY + 1, ""),
        (99_999_999_999, ""),
        (5_000_000, "Expect: 100-continue\r\n"),
    ] {
        let mut stream = tokio::net::TcpStream::connect(&host.addr).await.unwrap();
        let head = format!(
            "POST /v1/ops/token.create HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\
             Authorization: Bearer {secret}\r\nContent-Length: {length}\r\n{expect}\r\n"
        );
        stream.write_all(head.as_bytes()).await.unwrap();
        // No body byte is sent: the answer comes anyway, and names the body.
        let mut raw = Vec::new();
        let _ = stream.read_to_end(&mut raw).await;
        let text = String::from_utf8_lossy(&raw);
        assert!(text.starts_with("HTTP/1.1 400"), "{length}: {text}");
        assert!(!text.contains("100 Continue"), "{length}: {text}");
        assert!(
            text.contains(&format!("body: larger than {MAX_JSON_BODY} bytes")),
            "{length}: {text}"
        );
    }
    assert_eq!(host.tokens.list().unwrap().len(), 1, "nothing was created");
    host.stop.cancel();
}

/// A body naming a key twice is refused naming the key (serde_json alone keeps the last, so
/// `{"role":"agent","role":"operator"}` minted an operator token), and creates nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_body_naming_a_key_twice_is_refused_naming_it_and_changes_nothing() {
    let host = host().await;
    let (secret, _) = host.tokens.create(TokenRole::Operator, None).unwrap();
    let (status, body) = exchange(
        &host.addr,
        "POST",
        "/v1/ops/token.create",
        Some(&secret),
        br#"{"role":"agent","role":"operator"}"#,
    )
    .await;
    assert_eq!(status, 400, "{body}");
    assert_eq!(code_of(&body), "BAD_REQUEST", "{body}");
    assert!(
        body.contains(r#"body: invalid JSON: duplicate key \"role\""#),
        "{body}"
    );
    assert_eq!(host.tokens.list().unwrap().len(), 1, "nothing was created");
    host.stop.cancel();
}

/// A path segment that is no lease id is refused naming `leaseId` on the reads, as renew and
/// release refuse it (their inputs are checked by the pipeline), and is not echoed back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lease_route_with_a_malformed_lease_id_is_refused_naming_it() {
    let host = host().await;
    let (secret, _) = host.tokens.create(TokenRole::Agent, None).unwrap();
    let long = "a".repeat(5_000);
    for id in ["%00", "..", "%2F..%2F", long.as_str()] {
        for (method, path) in [
            ("GET", format!("/v1/leases/{id}")),
            ("GET", format!("/v1/leases/{id}/events")),
        ] {
            let (status, body) = exchange(&host.addr, method, &path, Some(&secret), b"").await;
            let shown = &body[..body.len().min(200)];
            assert_eq!(status, 400, "{method} {shown}");
            assert_eq!(code_of(&body), "BAD_REQUEST", "{method} {shown}");
            let error: Value = serde_json::from_str(&body).unwrap();
            let message = error["error"]["message"].as_str().unwrap();
            assert!(message.starts_with("leaseId"), "{method} {message}");
            assert!(
                body.len() < 1_000,
                "{method}: the id is not echoed: {shown}"
            );
        }
    }
    host.stop.cancel();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tokens_authenticate_and_roles_gate_routes() {
    let host = host().await;
    let (agent, _) = host.tokens.create(TokenRole::Agent, None).unwrap();
    let (worker, _) = host.tokens.create(TokenRole::Worker, None).unwrap();
    assert_eq!(
        exchange(&host.addr, "GET", "/v1/tokens", None, b"").await.0,
        401
    );
    assert_eq!(
        exchange(&host.addr, "GET", "/v1/tokens", Some("slk_unknown"), b"")
            .await
            .0,
        401
    );
    assert_eq!(
        exchange(&host.addr, "GET", "/v1/tokens", Some(&worker), b"")
            .await
            .0,
        403
    );
    let (status, body) = exchange(&host.addr, "GET", "/v1/tokens", Some(&agent), b"").await;
    assert_eq!(status, 403, "an agent may not list tokens: {body}");
    assert_eq!(
        exchange(&host.addr, "GET", "/v1/nowhere", Some(&agent), b"")
            .await
            .0,
        404
    );
    host.stop.cancel();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_mints_no_worker_token_and_a_gateway_does() {
    for mode in [Mode::Worker, Mode::Gateway] {
        let host = host_in(mode).await;
        let (operator, _) = host.tokens.create(TokenRole::Operator, None).unwrap();
        let before = host.tokens.list().unwrap().len();
        let (status, body) = exchange(
            &host.addr,
            "POST",
            "/v1/tokens",
            Some(&operator),
            br#"{"role":"worker"}"#,
        )
        .await;
        if mode == Mode::Worker {
            assert_eq!(status, 400, "{body}");
            assert_eq!(code_of(&body), "BAD_REQUEST");
            let message: Value = serde_json::from_str(&body).unwrap();
            assert_eq!(
                message["error"]["message"],
                json!(
                    "role: a worker token joins a worker to a gateway, and this daemon is a worker: create it on the gateway the worker dials"
                )
            );
            assert_eq!(host.tokens.list().unwrap().len(), before, "nothing minted");
        } else {
            assert!(status < 300, "{status} {body}");
            assert_eq!(host.tokens.list().unwrap().len(), before + 1);
        }
        // Both mint the roles they use.
        let (status, body) = exchange(
            &host.addr,
            "POST",
            "/v1/tokens",
            Some(&operator),
            br#"{"role":"agent"}"#,
        )
        .await;
        assert!(status < 300, "{status} {body}");
        host.stop.cancel();
    }
}

fn code_of(body: &str) -> String {
    let value: Value = serde_json::from_str(body).unwrap_or_else(|e| panic!("{e}: {body}"));
    value["error"]["code"].as_str().unwrap().to_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wait_that_is_not_a_finite_number_answers_at_once_instead_of_panicking() {
    let host = host().await;
    let (agent, _) = host.tokens.create(TokenRole::Agent, None).unwrap();
    for wait in [
        "NaN", "nan", "inf", "-inf", "1e400", "-1", "%4EaN", "1%2E5", "", "x", "%zz",
    ] {
        let path = format!("/v1/lease-requests/req_nope?wait={wait}");
        let (status, body) = exchange(&host.addr, "GET", &path, Some(&agent), b"").await;
        assert_eq!(status, 404, "{wait}: {body}");
        assert_eq!(code_of(&body), "UNKNOWN_LEASE_REQUEST", "{wait}");
    }
    // The host lives on.
    assert_eq!(
        exchange(&host.addr, "GET", "/v1/healthz", None, b"")
            .await
            .0,
        200
    );
    host.stop.cancel();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn query_values_and_path_segments_are_percent_decoded() {
    let host = host().await;
    let (operator, _) = host.tokens.create(TokenRole::Operator, None).unwrap();
    // `%74okens` is `tokens`.
    let (status, body) = exchange(&host.addr, "GET", "/v1/%74okens", Some(&operator), b"").await;
    assert_eq!(status, 200, "{body}");
    // `5%73` is `5s`; `5%zz` stays as it is and is no duration.
    let (status, body) = exchange(
        &host.addr,
        "GET",
        "/v1/events?since=5%73",
        Some(&operator),
        b"",
    )
    .await;
    assert_eq!(status, 200, "{body}");
    let (status, body) = exchange(
        &host.addr,
        "GET",
        "/v1/events?since=5%zz",
        Some(&operator),
        b"",
    )
    .await;
    assert_eq!(status, 400, "{body}");
    assert!(body.contains(r#"since: \"5%zz\""#), "{body}");
    host.stop.cancel();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_query_name_given_twice_is_refused_naming_it() {
    let host = host().await;
    let (operator, _) = host.tokens.create(TokenRole::Operator, None).unwrap();
    for (path, name) in [
        ("/v1/catalog?platform=ios&platform=android", "platform"),
        ("/v1/events?since=5s&since=1d", "since"),
        ("/v1/lease-requests/req_nope?wait=1&wait=2", "wait"),
    ] {
        let (status, body) = exchange(&host.addr, "GET", path, Some(&operator), b"").await;
        assert_eq!(status, 400, "{path}: {body}");
        assert_eq!(code_of(&body), "BAD_REQUEST", "{path}");
        assert!(
            body.contains(&format!("{name}: given more than once")),
            "{path}: {body}"
        );
    }
    // Once is served.
    let (status, body) = exchange(
        &host.addr,
        "GET",
        "/v1/events?since=5s",
        Some(&operator),
        b"",
    )
    .await;
    assert_eq!(status, 200, "{body}");
    host.stop.cancel();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn healthz_needs_no_token_for_any_method_and_only_get_is_its_route() {
    let host = host().await;
    let (status, body) = exchange(&host.addr, "GET", "/v1/healthz", None, b"").await;
    assert_eq!((status, body.as_str()), (200, r#"{"ok":true}"#));
    for method in ["POST", "DELETE", "PUT", "PATCH"] {
        let (status, body) = exchange(&host.addr, method, "/v1/healthz", None, b"").await;
        assert_eq!(status, 405, "{method}: {body}");
        assert_eq!(code_of(&body), "UNKNOWN_REQUEST", "{method}");
    }
    host.stop.cancel();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_known_path_under_another_method_answers_405_with_allow() {
    let host = host().await;
    let (operator, _) = host.tokens.create(TokenRole::Operator, None).unwrap();
    for (method, path, allow) in [
        ("PUT", "/v1/leases/lse_1", "GET, DELETE"),
        ("POST", "/v1/status", "GET"),
        ("GET", "/v1/leases/lse_1/renew", "POST"),
        ("PATCH", "/v1/leases", "GET, DELETE"),
        ("GET", "/v1/daemon/stop", "POST"),
        ("PUT", "/v1/workers/w1/drain", "POST, DELETE"),
        ("POST", "/v1/healthz", "GET"),
    ] {
        let (status, head, body) =
            raw_exchange(&host.addr, method, path, Some(&operator), &[], b"").await;
        assert_eq!(status, 405, "{method} {path}: {body}");
        assert!(
            head.contains(&format!("\r\nallow: {}", allow.to_ascii_lowercase())),
            "{method} {path}: {head}"
        );
        assert_eq!(code_of(&body), "UNKNOWN_REQUEST");
        let message: Value = serde_json::from_str(&body).unwrap();
        assert_eq!(
            message["error"]["message"],
            format!("No route {method} {path}: it takes {allow}")
        );
    }
    // A path no route serves under any method stays 404, and the token still comes first.
    let (status, head, _) = raw_exchange(
        &host.addr,
        "PUT",
        "/v1/leases/lse_1/nowhere",
        Some(&operator),
        &[],
        b"",
    )
    .await;
    assert_eq!(status, 404);
    assert!(!head.contains("allow:"), "{head}");
    assert_eq!(
        raw_exchange(&host.addr, "PUT", "/v1/leases/lse_1", None, &[], b"")
            .await
            .0,
        401
    );
    // Nothing ran: the daemon still answers, no lease or stop came of it.
    assert_eq!(
        raw_exchange(&host.addr, "GET", "/v1/healthz", None, &[], b"")
            .await
            .0,
        200
    );
    host.stop.cancel();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_websocket_upgrade_is_refused_before_auth_and_other_upgrades_are_ignored() {
    let host = host().await;
    let (operator, _) = host.tokens.create(TokenRole::Operator, None).unwrap();
    for upgrade in ["websocket", "WebSocket", "h2c, websocket"] {
        let (status, _, body) = raw_exchange(
            &host.addr,
            "GET",
            "/v1/tokens",
            Some(&operator),
            &["Connection: Upgrade", &format!("Upgrade: {upgrade}")],
            b"",
        )
        .await;
        assert_eq!(status, 404, "{upgrade}: {body}");
        assert_eq!(code_of(&body), "UNKNOWN_REQUEST");
        let said: Value = serde_json::from_str(&body).unwrap();
        assert_eq!(
            said["error"]["message"],
            "No WebSocket at /v1/tokens: only a gateway's /v1/uplink takes one; send the \
             request without Upgrade"
        );
        let (status, _, _) = raw_exchange(
            &host.addr,
            "GET",
            "/v1/tokens",
            None,
            &["Connection: Upgrade", &format!("Upgrade: {upgrade}")],
            b"",
        )
        .await;
        assert_eq!(status, 404, "before auth: {upgrade}");
    }
    // curl --http2 on plain HTTP asks for h2c: the request is served as HTTP/1.1.
    let (status, _, body) = raw_exchange(
        &host.addr,
        "GET",
        "/v1/tokens",
        Some(&operator),
        &[
            "Connection: Upgrade, HTTP2-Settings",
            "Upgrade: h2c",
            "HTTP2-Settings: AAMAAABkAARAAAAAAAIAAAAA",
        ],
        b"",
    )
    .await;
    assert_eq!(status, 200, "{body}");
    host.stop.cancel();
}

/// `Idempotency-Key` lines `keys` on a lease request: the raw answer's head and body.
async fn keyed_lease_request(host: &Host, keys: &[&[u8]]) -> (String, String) {
    let (agent, _) = host.tokens.create(TokenRole::Agent, None).unwrap();
    let mut stream = tokio::net::TcpStream::connect(&host.addr).await.unwrap();
    let mut head = format!(
        "POST /v1/lease-requests HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Length: 2\r\nAuthorization: Bearer {agent}\r\n"
    )
    .into_bytes();
    for key in keys {
        head.extend_from_slice(b"Idempotency-Key: ");
        head.extend_from_slice(key);
        head.extend_from_slice(b"\r\n");
    }
    head.extend_from_slice(b"\r\n{}");
    stream.write_all(&head).await.unwrap();
    let mut raw = Vec::new();
    let _ = stream.read_to_end(&mut raw).await;
    let text = String::from_utf8_lossy(&raw).into_owned();
    let (head, body) = text.split_once("\r\n\r\n").expect("a response");
    (head.to_owned(), body.to_owned())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idempotency_key_that_is_not_visible_ascii_is_refused_not_dropped() {
    let host = host().await;
    for key in [&b"caf\xc3\xa9"[..], b"a b"] {
        let (head, body) = keyed_lease_request(&host, &[key]).await;
        assert!(head.starts_with("HTTP/1.1 400"), "{head}");
        assert_eq!(code_of(&body), "BAD_REQUEST");
        assert!(body.contains("Idempotency-Key"), "{body}");
    }
    host.stop.cancel();
}

/// Outside trial 21: a key sent twice is refused, as `Authorization` is: which one counts
/// would be a guess (the first used to).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idempotency_key_sent_twice_is_refused() {
    let host = host().await;
    let (head, body) = keyed_lease_request(&host, &[b"kA", b"kB"]).await;
    assert!(head.starts_with("HTTP/1.1 400"), "{head}");
    assert_eq!(code_of(&body), "BAD_REQUEST");
    assert!(
        body.contains("Idempotency-Key: sent 2 times; send it once"),
        "{body}"
    );
    host.stop.cancel();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_authorization_that_is_not_visible_ascii_is_no_bearer_not_a_missing_header() {
    let host = host().await;
    let mut stream = tokio::net::TcpStream::connect(&host.addr).await.unwrap();
    stream
        .write_all(
            b"GET /v1/tokens HTTP/1.1\r\nHost: x\r\nConnection: close\r\nAuthorization: Bearer slk_\xc3\xa9\r\n\r\n",
        )
        .await
        .unwrap();
    let mut raw = Vec::new();
    let _ = stream.read_to_end(&mut raw).await;
    let text = String::from_utf8_lossy(&raw).into_owned();
    let (head, body) = text.split_once("\r\n\r\n").expect("a response");
    assert!(head.starts_with("HTTP/1.1 401"), "{head}");
    let error: Value = serde_json::from_str(body).unwrap();
    assert_eq!(error["error"]["code"], "UNAUTHENTICATED");
    assert_eq!(
        error["error"]["message"],
        "Authorization must be Bearer <token>"
    );
    host.stop.cancel();
}

/// `POST /v1/ops/token.create` with `{` first and the rest of a 100-byte body `after` later
/// (never, with `None`): the raw answer, read to the connection's close, and when it came.
async fn body_in_two(host: &Host, secret: &str, after: Option<Duration>) -> (String, Duration) {
    let started = tokio::time::Instant::now();
    let mut stream = tokio::net::TcpStream::connect(&host.addr).await.unwrap();
    let head = format!(
        "POST /v1/ops/token.create HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Length: 100\r\nAuthorization: Bearer {secret}\r\n\r\n"
    );
    stream.write_all(head.as_bytes()).await.unwrap();
    let body = body_of(100);
    stream.write_all(&body[..1]).await.unwrap();
    if let Some(after) = after {
        tokio::time::sleep(after).await;
        stream.write_all(&body[1..]).await.unwrap();
    }
    let mut raw = Vec::new();
    let read = tokio::time::timeout(BODY_READ_TIMEOUT * 4, stream.read_to_end(&mut raw)).await;
    assert!(read.is_ok(), "the connection closed after the answer");
    (
        String::from_utf8_lossy(&raw).into_owned(),
        started.elapsed(),
    )
}

/// A caller that promises a body and stops sending is answered at the body's bound, not
/// before, and its connection closes: it holds nothing longer. One whose body is whole a
/// moment before the bound is served. Time is paused: the bound passes at once.
#[tokio::test(start_paused = true)]
async fn a_body_that_stops_arriving_is_refused_at_its_bound_and_the_connection_closes() {
    let host = host().await;
    let (secret, _) = host.tokens.create(TokenRole::Operator, None).unwrap();
    let (text, took) = body_in_two(&host, &secret, None).await;
    assert!(took >= BODY_READ_TIMEOUT, "answered at the bound: {took:?}");
    let (head, body) = text.split_once("\r\n\r\n").expect("a response");
    assert!(head.starts_with("HTTP/1.1 400"), "{head}");
    let error: Value = serde_json::from_str(body).unwrap();
    assert_eq!(error["error"]["code"], "BAD_REQUEST");
    assert_eq!(
        error["error"]["message"],
        format!(
            "body: not received within {} s",
            BODY_READ_TIMEOUT.as_secs()
        )
    );
    assert_eq!(host.tokens.list().unwrap().len(), 1, "nothing was created");
    let just_in_time = BODY_READ_TIMEOUT - Duration::from_millis(1);
    let (text, _) = body_in_two(&host, &secret, Some(just_in_time)).await;
    assert!(text.starts_with("HTTP/1.1 200"), "{text}");
    assert_eq!(
        host.tokens.list().unwrap().len(),
        2,
        "the late body was served"
    );
    host.stop.cancel();
}

/// An idle kept-alive connection is closed once the head's bound passes with no new request,
/// not before; a request a moment before the bound is served on it.
#[tokio::test(start_paused = true)]
async fn an_idle_kept_alive_connection_closes_at_the_heads_bound() {
    let host = host().await;
    let mut stream = tokio::net::TcpStream::connect(&host.addr).await.unwrap();
    let request = b"GET /v1/healthz HTTP/1.1\r\nHost: x\r\n\r\n";
    let answer = b"HTTP/1.1 200";
    stream.write_all(request).await.unwrap();
    let mut first = [0u8; 12];
    stream.read_exact(&mut first).await.unwrap();
    assert_eq!(&first, answer);
    tokio::time::sleep(HEADER_READ_TIMEOUT - Duration::from_millis(1)).await;
    stream.write_all(request).await.unwrap();
    let idle_from = tokio::time::Instant::now();
    let mut raw = Vec::new();
    let read = tokio::time::timeout(HEADER_READ_TIMEOUT * 4, stream.read_to_end(&mut raw)).await;
    assert!(read.is_ok(), "closed while idle");
    let text = String::from_utf8_lossy(&raw);
    assert_eq!(
        text.matches("HTTP/1.1 200").count(),
        1,
        "the second request was served: {text}"
    );
    assert!(
        idle_from.elapsed() >= HEADER_READ_TIMEOUT,
        "closed at the bound, not before: {:?}",
        idle_from.elapsed()
    );
    host.stop.cancel();
}

/// A renewal or token body holding a key it does not take is refused naming the key, before
/// anything is renewed or minted (a misspelt `ttl` would renew with the lease's own width).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_renewal_or_token_body_with_an_unknown_key_is_refused_naming_it() {
    let host = host().await;
    let (secret, _) = host.tokens.create(TokenRole::Operator, None).unwrap();
    let (status, body) = exchange(
        &host.addr,
        "POST",
        "/v1/leases/lse_x/renew",
        Some(&secret),
        br#"{"ttl": 5000}"#,
    )
    .await;
    assert_eq!(status, 400, "{body}");
    let error: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(error["error"]["code"], "BAD_REQUEST");
    assert_eq!(
        error["error"]["message"],
        r#"ttl: unknown field, expected one of ["ttlMs"]"#
    );
    let (_, body) = exchange(
        &host.addr,
        "POST",
        "/v1/leases/lse_x/renew",
        Some(&secret),
        br#"{"ttlMs": 5000}"#,
    )
    .await;
    assert!(!body.contains("unknown field"), "{body}");

    // A token with a misspelt label is not minted without one.
    let (status, body) = exchange(
        &host.addr,
        "POST",
        "/v1/tokens",
        Some(&secret),
        br#"{"role": "agent", "lable": "ci"}"#,
    )
    .await;
    assert_eq!(status, 400, "{body}");
    let error: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(
        error["error"]["message"],
        r#"lable: unknown field, expected one of ["role", "label"]"#
    );
    assert_eq!(host.tokens.list().unwrap().len(), 1, "nothing minted");
    let (status, body) = exchange(
        &host.addr,
        "POST",
        "/v1/tokens",
        Some(&secret),
        br#"{"role": "agent", "label": "ci"}"#,
    )
    .await;
    assert_eq!(status, 201, "{body}");
    host.stop.cancel();
}

/// An exec body naming another lease than its path is refused, naming both; the same lease, or
/// none, goes on to the operation.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_exec_body_naming_another_lease_than_its_path_is_refused() {
    let host = host().await;
    let (agent, _) = host.tokens.create(TokenRole::Agent, None).unwrap();
    let (status, body) = exchange(
        &host.addr,
        "POST",
        "/v1/leases/lse_a/exec",
        Some(&agent),
        br#"{"leaseId": "lse_b", "tool": "echo"}"#,
    )
    .await;
    assert_eq!(status, 400, "{body}");
    let said: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(
        said["error"]["message"],
        r#"leaseId: the body names "lse_b" and the path lse_a; leave it out of the body"#
    );
    for same in [
        &br#"{"leaseId": "lse_a", "tool": "echo"}"#[..],
        br#"{"tool": "echo"}"#,
    ] {
        let (_, body) = exchange(
            &host.addr,
            "POST",
            "/v1/leases/lse_a/exec",
            Some(&agent),
            same,
        )
        .await;
        assert!(!body.contains("leave it out"), "{body}");
    }
    host.stop.cancel();
}
