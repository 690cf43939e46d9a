//! The fake over HTTP, route by route: health, the JSON-RPC envelope and its statuses, auth,
//! body caps, NDJSON progress, leases in virtual time, uploads (preflight, chunked and resumed
//! PUTs, finalize), artifacts, diagnostics, tenant isolation, the knobs and the control API.

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    reason = "tests fail by panicking"
)]

mod common;

use std::time::Duration;

use agent_device_fake::{
    CommandFailure, DaemonError, Device, DevicesAnswer, ErrorCode, FakeAgentDevice, FakeOptions,
    HEALTH_BODY, JSON_BODY_CAP, LeaseOp, RPC_BODY_CAP, TINY_PNG,
};
use bytes::Bytes;
use common::{
    Answer, allocate, chunked, command, data, error_data, eventually, full, get, post_json, rpc,
    send, sha256, try_send,
};
use http::{Method, StatusCode};
use serde_json::{Value, json};

fn start() -> FakeAgentDevice {
    FakeAgentDevice::start(FakeOptions::default().with_devices(vec![
        Device::linux_local(),
        Device::android_emulator("emulator-5554", "Pixel A"),
        Device::android_emulator("emulator-5556", "Pixel B"),
    ]))
    .unwrap()
}

/// Request headers, as name and value pairs.
type Headers<'a> = &'a [(&'a str, &'a str)];

const INVALID_TOKEN: &str = r#"{"ok":false,"error":"Invalid token","code":"UNAUTHORIZED"}"#;

#[tokio::test]
async fn the_token_is_48_lower_hex_and_fresh_per_start() {
    let a = start();
    let b = start();
    for fake in [&a, &b] {
        assert_eq!(fake.token().len(), 48);
        assert!(
            fake.token()
                .bytes()
                .all(|c| c.is_ascii_digit() || (b'a'..=b'f').contains(&c))
        );
        assert_eq!(fake.base_url(), format!("http://127.0.0.1:{}", fake.port()));
    }
    assert_ne!(a.token(), b.token());
    let fixed = FakeAgentDevice::start(FakeOptions::default().with_token("fixed")).unwrap();
    assert_eq!(fixed.token(), "fixed");
}

#[tokio::test]
async fn health_needs_no_token_and_answers_the_exact_body() {
    let fake = start();
    let url = fake.base_url();
    let health = send(
        Method::GET,
        &format!("{url}/health"),
        &[],
        full(Bytes::new()),
    )
    .await;
    assert_eq!(health.status, StatusCode::OK);
    assert_eq!(health.header("content-type"), Some("application/json"));
    assert_eq!(health.text(), HEALTH_BODY);
    for (method, path) in [
        (Method::GET, "/health?x=1"),
        (Method::POST, "/health"),
        (Method::GET, "/agent-device/health"),
        (Method::GET, "/rpc"),
        (Method::GET, "/nope"),
        (Method::PUT, "/upload"),
        (Method::HEAD, "/artifacts/x"),
        (Method::GET, "/sessions/a/requests/r/diagnostics/"),
    ] {
        let answer = send(
            method.clone(),
            &format!("{url}{path}"),
            &[],
            full(Bytes::new()),
        )
        .await;
        assert_eq!(answer.status, StatusCode::NOT_FOUND, "{method} {path}");
        if method != Method::HEAD {
            assert_eq!(answer.text(), "Not found", "{method} {path}");
        }
    }
}

#[tokio::test]
async fn envelope_errors_have_the_daemon_statuses() {
    let fake = start();
    let raw = |body: &str| {
        let body = body.to_owned();
        let fake = &fake;
        async move {
            let auth = format!("Bearer {}", fake.token());
            send(
                Method::POST,
                &format!("{}/rpc", fake.base_url()),
                &[("authorization", &auth)],
                full(body),
            )
            .await
        }
    };
    let cases = [
        (
            "{bad",
            400,
            json!({"jsonrpc":"2.0","id":null,"error":{"code":-32700,"message":"Parse error"}}),
        ),
        (
            "[]",
            400,
            json!({"jsonrpc":"2.0","id":null,"error":{"code":-32600,"message":"Invalid Request"}}),
        ),
        (
            r#"{"id":"a","method":"agent_device.command","params":{}}"#,
            400,
            json!({"jsonrpc":"2.0","id":"a","error":{"code":-32600,"message":"Invalid Request"}}),
        ),
        (
            r#"{"jsonrpc":"2.0","id":"a","method":5,"params":{}}"#,
            400,
            json!({"jsonrpc":"2.0","id":"a","error":{"code":-32600,"message":"Invalid Request"}}),
        ),
        (
            r#"{"jsonrpc":"2.0","id":"a","method":"nope","params":{}}"#,
            404,
            json!({"jsonrpc":"2.0","id":"a","error":{"code":-32601,"message":"Method not found: nope"}}),
        ),
        (
            r#"{"jsonrpc":"2.0","id":"a","method":"agent_device.command"}"#,
            400,
            json!({"jsonrpc":"2.0","id":"a","error":{"code":-32602,"message":"Invalid params"}}),
        ),
        (
            r#"{"jsonrpc":"2.0","id":"a","method":"agent_device.command","params":{}}"#,
            400,
            json!({"jsonrpc":"2.0","id":"a","error":{"code":-32602,"message":"Invalid params: command is required"}}),
        ),
    ];
    for (body, status, expected) in cases {
        let answer = raw(body).await;
        assert_eq!(answer.status.as_u16(), status, "{body}");
        assert_eq!(answer.header("content-type"), Some("application/json"));
        assert_eq!(answer.json(), expected, "{body}");
    }
    // The id is echoed exactly, whatever its type.
    for id in [json!(7), json!("x"), json!(null), json!({"a":1})] {
        let answer = raw(
            &json!({"jsonrpc":"2.0","id":id,"method":"agent_device.command","params":{"command":"devices"}})
                .to_string(),
        )
        .await;
        assert_eq!(answer.json()["id"], id);
    }
    // A request with no id is answered with a null one.
    let answer =
        raw(r#"{"jsonrpc":"2.0","method":"agent-device.command","params":{"command":"devices"}}"#)
            .await;
    assert_eq!(answer.json()["id"], Value::Null);
    assert!(answer.json()["result"]["ok"].as_bool().unwrap());
}

#[tokio::test]
async fn rpc_takes_the_token_from_params_or_either_header() {
    let fake = start();
    let url = format!("{}/rpc", fake.base_url());
    let body = |token: Option<&str>| {
        let mut params = json!({"command":"devices"});
        if let Some(token) = token {
            params["token"] = json!(token);
        }
        full(
            json!({"jsonrpc":"2.0","id":"a","method":"agent_device.command","params":params})
                .to_string(),
        )
    };
    let bearer = format!("bearer {}", fake.token());
    let ok_cases: [(Headers<'_>, Option<&str>); 3] = [
        (&[("authorization", &bearer)], None),
        (&[("x-agent-device-token", fake.token())], None),
        (&[], Some(fake.token())),
    ];
    for (headers, token) in ok_cases {
        let answer = send(Method::POST, &url, headers, body(token)).await;
        assert_eq!(answer.status, StatusCode::OK, "{headers:?} {token:?}");
    }
    let expected = json!({"jsonrpc":"2.0","id":"a","error":{"code":-32000,"message":"Invalid token",
        "data":{"code":"UNAUTHORIZED","message":"Invalid token","hint":"Refresh daemon metadata and retry the command."}}});
    let double_space = format!("Bearer  {}", fake.token());
    let refused: [(Headers<'_>, Option<&str>); 4] = [
        (&[], None),
        (&[("authorization", "Bearer nope")], None),
        (&[("authorization", &double_space)], None),
        // params.token wins over a right header.
        (&[("authorization", &bearer)], Some("bad")),
    ];
    for (headers, token) in refused {
        let answer = send(Method::POST, &url, headers, body(token)).await;
        assert_eq!(
            answer.status,
            StatusCode::UNAUTHORIZED,
            "{headers:?} {token:?}"
        );
        assert_eq!(answer.json(), expected);
    }
    // An unknown method is answered before the token is looked at.
    let unknown = send(
        Method::POST,
        &url,
        &[],
        full(r#"{"jsonrpc":"2.0","id":"a","method":"nope","params":{}}"#),
    )
    .await;
    assert_eq!(unknown.status, StatusCode::NOT_FOUND);
}

#[tokio::test]
async fn the_auxiliary_routes_refuse_a_missing_token() {
    let fake = start();
    let url = fake.base_url();
    for (method, path) in [
        (Method::GET, "/artifacts"),
        (Method::GET, "/artifacts/x"),
        (Method::GET, "/sessions/x/requests/y/diagnostics"),
        (Method::POST, "/upload/preflight"),
        (Method::PUT, "/upload/direct/abc"),
        (Method::POST, "/upload/finalize"),
        (Method::POST, "/upload"),
    ] {
        let answer = send(
            method.clone(),
            &format!("{url}{path}"),
            &[("authorization", "Bearer wrong")],
            full("{}"),
        )
        .await;
        assert_eq!(answer.status, StatusCode::UNAUTHORIZED, "{method} {path}");
        assert_eq!(answer.text(), INVALID_TOKEN, "{method} {path}");
    }
}

fn rpc_body_of(len: usize) -> String {
    let head = r#"{"jsonrpc":"2.0","id":"a","method":"agent_device.command","params":{"command":"devices","pad":""#;
    let tail = r#""}}"#;
    format!("{head}{}{tail}", "x".repeat(len - head.len() - tail.len()))
}

#[tokio::test]
async fn an_rpc_body_past_one_mib_gets_no_answer() {
    let fake = start();
    let url = format!("{}/rpc", fake.base_url());
    let auth = format!("Bearer {}", fake.token());
    let at_cap = send(
        Method::POST,
        &url,
        &[("authorization", &auth)],
        full(rpc_body_of(RPC_BODY_CAP)),
    )
    .await;
    assert_eq!(at_cap.status, StatusCode::OK);
    let past = try_send(
        Method::POST,
        &url,
        &[("authorization", &auth)],
        full(rpc_body_of(RPC_BODY_CAP + 1)),
    )
    .await;
    assert!(
        past.is_err(),
        "the connection closes with no answer: {past:?}"
    );
    let records = fake.requests();
    let last = records.last().unwrap();
    assert_eq!(last.status, None);
    assert!(!last.complete);
    assert_eq!(
        last.body.len(),
        64 * 1024,
        "the record keeps the first 64 KiB"
    );
    // Nothing ran: no diagnostics, no state.
    assert!(fake.leases().is_empty() && fake.sessions().is_empty());
}

#[tokio::test]
async fn progress_streams_ndjson_and_nothing_else_does() {
    let fake = start();
    for progress in ["command", "replay-test"] {
        let answer = command(
            &fake,
            json!({"command":"devices","flags":{"platform":"linux"},"meta":{"requestProgress":progress}}),
        )
        .await;
        assert_eq!(answer.status, StatusCode::OK);
        assert_eq!(answer.header("content-type"), Some("application/x-ndjson"));
        assert!(
            answer.header("content-length").is_none(),
            "streamed, not sized"
        );
        let text = answer.text();
        assert!(text.ends_with('\n'));
        let lines: Vec<Value> = text
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect();
        assert_eq!(lines.len(), 1);
        assert_eq!(lines[0]["type"], "response");
        assert_eq!(lines[0]["response"]["id"], "r1");
        assert_eq!(
            lines[0]["response"]["result"]["data"]["devices"][0]["platform"],
            "linux"
        );
    }
    // Errors stream too, with HTTP 200.
    let failed = command(
        &fake,
        json!({"command":"close","session":"none","meta":{"requestProgress":"command"}}),
    )
    .await;
    assert_eq!(failed.status, StatusCode::OK);
    let line: Value = serde_json::from_str(failed.text().trim()).unwrap();
    assert_eq!(
        line["response"]["error"]["data"]["code"],
        "SESSION_NOT_FOUND"
    );
    // Other values, and lease calls, answer plain JSON.
    let plain = command(
        &fake,
        json!({"command":"devices","meta":{"requestProgress":"other"}}),
    )
    .await;
    assert_eq!(plain.header("content-type"), Some("application/json"));
    let lease = rpc(
        &fake,
        "agent_device.lease.allocate",
        json!({"tenantId":"t","runId":"r","meta":{"requestProgress":"command"}}),
    )
    .await;
    assert_eq!(lease.header("content-type"), Some("application/json"));
}

#[tokio::test(start_paused = true)]
async fn leases_expire_in_virtual_time() {
    let fake = start();
    let scope =
        json!({"session":"s1","tenantId":"acme","runId":"run1","backend":"android-instance"});
    let lease = allocate(&fake, scope.clone()).await;
    assert_eq!(lease.len(), 32);
    tokio::time::advance(Duration::from_secs(30)).await;
    assert_eq!(
        allocate(&fake, scope).await,
        lease,
        "the same scope refreshes the same lease"
    );
    let held = fake.leases();
    assert_eq!(held.len(), 1);
    assert_eq!(held[0].refreshes, 1);
    assert_eq!(held[0].expires_at - held[0].created_at, 90_000);

    let beat =
        json!({"session":"s1","tenantId":"acme","runId":"run1","leaseId":lease,"ttlMs":5000});
    let answer = rpc(&fake, "agent_device.lease.heartbeat", beat.clone()).await;
    let view = &data(&answer)["lease"];
    assert_eq!(
        view["expiresAt"].as_u64().unwrap() - view["heartbeatAt"].as_u64().unwrap(),
        5_000
    );
    assert_eq!(fake.leases()[0].heartbeats, 1);

    tokio::time::advance(Duration::from_millis(4_999)).await;
    assert_eq!(
        rpc(&fake, "agent_device.lease.heartbeat", beat.clone())
            .await
            .status,
        StatusCode::OK
    );
    tokio::time::advance(Duration::from_millis(5_000)).await;
    let expired = rpc(&fake, "agent_device.lease.heartbeat", beat).await;
    assert_eq!(expired.status, StatusCode::UNAUTHORIZED);
    let err = error_data(&expired);
    assert_eq!(err["message"], "Lease is not active");
    assert_eq!(err["details"], json!({"reason":"LEASE_NOT_FOUND"}));
    assert_eq!(err["diagnosticsRecord"]["session"], "s1");
    assert!(fake.leases().is_empty());
}

#[tokio::test]
async fn release_is_true_once_and_false_after_with_http_200() {
    let fake = start();
    let lease = allocate(&fake, json!({"tenantId":"acme","runId":"r"})).await;
    let params = json!({"tenantId":"acme","runId":"r","leaseId":lease});
    let first = rpc(&fake, "agent_device.lease.release", params.clone()).await;
    assert_eq!(data(&first), json!({"released":true}));
    let again = rpc(&fake, "agent-device.lease.release", params).await;
    assert_eq!(data(&again), json!({"released":false}));
    let bad = rpc(
        &fake,
        "agent_device.lease.release",
        json!({"leaseId":"nothex"}),
    )
    .await;
    assert_eq!(bad.status, StatusCode::BAD_REQUEST);
    assert_eq!(error_data(&bad)["message"], "Invalid lease id.");
}

#[tokio::test]
async fn the_next_releases_fail_and_keep_the_lease() {
    let fake = start();
    let lease = allocate(&fake, json!({"tenantId":"acme","runId":"r"})).await;
    fake.fail_next_releases(
        2,
        DaemonError::new(ErrorCode::CommandFailed, "provider release failed"),
    );
    let params = json!({"tenantId":"acme","runId":"r","leaseId":lease});
    for _ in 0..2 {
        let failed = rpc(&fake, "agent_device.lease.release", params.clone()).await;
        assert_eq!(failed.status, StatusCode::INTERNAL_SERVER_ERROR);
        assert_eq!(error_data(&failed)["message"], "provider release failed");
        assert!(error_data(&failed)["diagnosticsRecord"].is_object());
        assert_eq!(fake.leases().len(), 1);
    }
    let released = rpc(&fake, "agent_device.lease.release", params).await;
    assert_eq!(data(&released), json!({"released":true}));
    fake.fail_next_lease_calls(
        LeaseOp::Heartbeat,
        1,
        DaemonError::unauthorized("Lease is not active", "LEASE_EXPIRED"),
    );
    let beat = rpc(
        &fake,
        "agent_device.lease.heartbeat",
        json!({"leaseId":lease}),
    )
    .await;
    assert_eq!(beat.status, StatusCode::UNAUTHORIZED);
    assert_eq!(error_data(&beat)["details"]["reason"], "LEASE_EXPIRED");
}

#[tokio::test]
async fn devices_answers_the_list_an_error_or_no_list() {
    let fake = start();
    let android = command(
        &fake,
        json!({"command":"devices","flags":{"platform":"android"}}),
    )
    .await;
    assert_eq!(data(&android)["devices"].as_array().unwrap().len(), 2);
    fake.set_devices(DevicesAnswer::NoList);
    assert_eq!(
        data(&command(&fake, json!({"command":"devices"})).await),
        json!({})
    );
    fake.set_devices(DevicesAnswer::Error(DaemonError::new(
        ErrorCode::ToolMissing,
        "adb not found in PATH",
    )));
    let failed = command(&fake, json!({"command":"devices"})).await;
    assert_eq!(failed.status, StatusCode::INTERNAL_SERVER_ERROR);
    assert_eq!(
        error_data(&failed)["hint"],
        "Install required platform tooling and ensure it is available in PATH."
    );
    fake.set_devices(DevicesAnswer::List(vec![Device::ios_simulator(
        "UDID-1",
        "iPhone 16",
    )]));
    let apple = command(
        &fake,
        json!({"command":"devices","flags":{"platform":"apple"}}),
    )
    .await;
    assert_eq!(data(&apple)["devices"][0]["id"], "UDID-1");
}

#[tokio::test]
async fn tenant_isolation_namespaces_sessions() {
    let fake = start();
    let mut opened = Vec::new();
    for (tenant, serial) in [("acme", "emulator-5554"), ("beta", "emulator-5556")] {
        let lease = allocate(
            &fake,
            json!({"tenantId":tenant,"runId":"r","backend":"android-instance"}),
        )
        .await;
        let meta = json!({"tenantId":tenant,"runId":"r","leaseId":lease,
                          "leaseBackend":"android-instance","sessionIsolation":"tenant"});
        let answer = command(
            &fake,
            json!({"command":"open","session":"s","flags":{"platform":"android","serial":serial},"meta":meta}),
        )
        .await;
        assert_eq!(data(&answer)["session"], format!("{tenant}:s"));
        opened.push((tenant, lease, meta));
    }
    let mut names: Vec<String> = fake.sessions().into_iter().map(|s| s.name).collect();
    names.sort();
    assert_eq!(names, ["acme:s", "beta:s"]);
    // A tenant's close reaches only its own session, and releases its lease.
    let (tenant, lease, meta) = &opened[0];
    let closed = command(&fake, json!({"command":"close","session":"s","meta":meta})).await;
    assert_eq!(data(&closed)["message"], format!("Closed: {tenant}:s"));
    assert!(fake.leases().iter().all(|l| l.lease_id.as_str() != lease));
    assert_eq!(fake.sessions().len(), 1);
    // Another tenant naming that lease is refused.
    let (_, beta_lease, _) = &opened[1];
    let stolen = command(
        &fake,
        json!({"command":"close","session":"s","meta":{"tenantId":"acme","runId":"r","leaseId":beta_lease,
               "leaseBackend":"android-instance","sessionIsolation":"tenant"}}),
    )
    .await;
    assert_eq!(
        error_data(&stolen)["details"]["reason"],
        "LEASE_SCOPE_MISMATCH"
    );
    assert_eq!(fake.sessions().len(), 1);
}

async fn preflight(fake: &FakeAgentDevice, bytes: &[u8], attempt: &str) -> Value {
    let answer = post_json(
        fake,
        "/upload/preflight",
        &json!({"uploadAttemptId":attempt,"sha256":sha256(bytes),"fileName":"app.apk",
                "sizeBytes":bytes.len(),"artifactType":"file","platform":"android",
                "contentType":"application/octet-stream"}),
    )
    .await;
    assert_eq!(answer.status, StatusCode::OK, "{}", answer.text());
    answer.json()
}

async fn put(
    fake: &FakeAgentDevice,
    ticket: &Value,
    extra: &[(&str, &str)],
    body: common::Body,
) -> Answer {
    let mut headers: Vec<(String, String)> = ticket["upload"]["headers"]
        .as_object()
        .unwrap()
        .iter()
        .map(|(k, v)| (k.clone(), v.as_str().unwrap().to_owned()))
        .collect();
    headers.extend(
        extra
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned())),
    );
    let headers: Vec<(&str, &str)> = headers
        .iter()
        .map(|(k, v)| (k.as_str(), v.as_str()))
        .collect();
    let url = ticket["upload"]["url"].as_str().unwrap().to_owned();
    assert!(url.starts_with(&fake.base_url()));
    send(Method::PUT, &url, &headers, body).await
}

fn chunks_of(bytes: &'static [u8], size: usize) -> common::Body {
    chunked(futures::stream::iter(
        bytes.chunks(size).map(|c| Ok(Bytes::from_static(c))),
    ))
}

#[tokio::test]
async fn an_upload_goes_preflight_put_finalize() {
    const FILE: &[u8] = b"0123456789abcdefghijklmnopqrstuvwxyz";
    let fake = start();
    let ticket = preflight(&fake, FILE, "att-1").await;
    let id = ticket["uploadId"].as_str().unwrap().to_owned();
    assert_eq!(ticket["cacheHit"], false);
    assert_eq!(
        ticket["upload"],
        json!({"url":format!("{}/upload/direct/{id}", fake.base_url()),
               "headers":{"authorization":format!("Bearer {}", fake.token()),
                          "x-agent-device-token":fake.token(),
                          "content-type":"application/octet-stream"}})
    );
    assert_eq!(
        preflight(&fake, FILE, "att-1").await["uploadId"],
        id,
        "preflight is idempotent"
    );

    let done = put(&fake, &ticket, &[], chunks_of(FILE, 7)).await;
    assert_eq!((done.status, done.text().as_str()), (StatusCode::OK, "ok"));
    let finalized = post_json(&fake, "/upload/finalize", &json!({"uploadId":id})).await;
    assert_eq!(finalized.status, StatusCode::OK);
    let artifact = finalized.json()["uploadId"].as_str().unwrap().to_owned();
    assert_ne!(artifact, id);
    let uploads = fake.uploads();
    assert_eq!(uploads.len(), 1);
    assert_eq!(
        (
            uploads[0].id.as_str(),
            uploads[0].file_name.as_str(),
            uploads[0].size,
            uploads[0].sha256.as_str()
        ),
        (
            artifact.as_str(),
            "app.apk",
            FILE.len() as u64,
            sha256(FILE).as_str()
        )
    );
    let put_record = fake
        .requests()
        .into_iter()
        .find(|r| r.method == "PUT")
        .unwrap();
    assert_eq!(put_record.header("transfer-encoding"), Some("chunked"));
    assert_eq!(put_record.body_sha256, sha256(FILE));
    assert!(put_record.complete);

    // The artifact can now be installed; an unknown one cannot.
    let install = command(
        &fake,
        json!({"command":"install","positionals":["com.example","/tmp/app.apk"],
               "flags":{"platform":"android"},"meta":{"uploadedArtifactId":artifact}}),
    )
    .await;
    assert_eq!(data(&install)["appId"], "com.example");
}

#[tokio::test]
async fn the_ticket_follows_the_host_and_forwarded_proto() {
    let fake = start();
    let auth = format!("Bearer {}", fake.token());
    let answer = send(
        Method::POST,
        &format!("{}/upload/preflight", fake.base_url()),
        &[
            ("authorization", &auth),
            ("host", "gateway.example:9443"),
            ("x-forwarded-proto", "https"),
        ],
        full(
            json!({"uploadAttemptId":"a","sha256":"0".repeat(64),"fileName":"f","sizeBytes":1,
                   "artifactType":"file","contentType":"application/zip"})
            .to_string(),
        ),
    )
    .await;
    let ticket = answer.json();
    let id = ticket["uploadId"].as_str().unwrap();
    assert_eq!(
        ticket["upload"]["url"],
        format!("https://gateway.example:9443/upload/direct/{id}")
    );
    assert_eq!(
        ticket["upload"]["headers"]["content-type"],
        "application/zip"
    );
}

#[tokio::test]
async fn a_partial_put_answers_308_and_resumes_with_content_range() {
    const FILE: &[u8] = b"hello world 14";
    let fake = start();
    let ticket = preflight(&fake, FILE, "resume").await;
    let id = ticket["uploadId"].as_str().unwrap().to_owned();
    let partial = put(&fake, &ticket, &[], full(&FILE[..5])).await;
    assert_eq!(partial.status, StatusCode::PERMANENT_REDIRECT);
    assert_eq!(partial.header("range"), Some("bytes=0-4"));
    assert_eq!(partial.header("x-upload-offset"), Some("5"));
    let incomplete = post_json(&fake, "/upload/finalize", &json!({"uploadId":id})).await;
    assert_eq!(incomplete.status, StatusCode::BAD_REQUEST);
    assert_eq!(incomplete.json()["error"], "Upload is incomplete");
    // Not at the offset: told the offset, nothing taken.
    let restart = put(&fake, &ticket, &[], full(&FILE[5..])).await;
    assert_eq!(restart.header("x-upload-offset"), Some("5"));
    let too_long = put(
        &fake,
        &ticket,
        &[("content-range", "bytes 5-10/14")],
        full(&FILE[5..]),
    )
    .await;
    assert_eq!(too_long.status, StatusCode::BAD_REQUEST);
    assert_eq!(
        too_long.json()["error"],
        "Upload chunk exceeds its permitted byte range"
    );
    let short = put(
        &fake,
        &ticket,
        &[("content-range", "bytes 5-13/14")],
        full(&FILE[5..8]),
    )
    .await;
    assert_eq!(
        short.json()["error"],
        "Upload chunk length does not match content-range"
    );
    let bad_range = put(
        &fake,
        &ticket,
        &[("content-range", "bytes 5-13/15")],
        full(&FILE[5..]),
    )
    .await;
    assert_eq!(bad_range.json()["error"], "Invalid content-range header");
    let rest = put(
        &fake,
        &ticket,
        &[("content-range", "bytes 5-13/14")],
        full(&FILE[5..]),
    )
    .await;
    assert_eq!((rest.status, rest.text().as_str()), (StatusCode::OK, "ok"));
    let finalized = post_json(&fake, "/upload/finalize", &json!({"uploadId":id})).await;
    assert_eq!(finalized.status, StatusCode::OK);
    assert_eq!(fake.uploads()[0].sha256, sha256(FILE));
    let gone = post_json(&fake, "/upload/finalize", &json!({"uploadId":id})).await;
    assert_eq!(gone.status, StatusCode::INTERNAL_SERVER_ERROR);
    assert_eq!(
        gone.json()["error"],
        format!("Upload not found or expired: {id}")
    );
}

#[tokio::test]
async fn a_client_that_leaves_mid_put_keeps_what_arrived() {
    let fake = start();
    let file = vec![7u8; 100_000];
    let ticket = preflight(&fake, &file, "cut").await;
    let (tx, rx) = tokio::sync::mpsc::channel::<Result<Bytes, std::io::Error>>(1);
    let body = chunked(tokio_stream_from(rx));
    let putting = {
        let ticket = ticket.clone();
        let base = fake.base_url();
        let token = fake.token().to_owned();
        tokio::spawn(async move {
            let url = ticket["upload"]["url"].as_str().unwrap().to_owned();
            assert!(url.starts_with(&base));
            let auth = format!("Bearer {token}");
            try_send(Method::PUT, &url, &[("authorization", &auth)], body).await
        })
    };
    tx.send(Ok(Bytes::from(vec![7u8; 40_000]))).await.unwrap();
    // Wait until the fake has seen the chunk, then cut the body off.
    while fake
        .requests()
        .iter()
        .all(|r| r.method != "PUT" || r.body_len < 40_000)
    {
        tokio::task::yield_now().await;
    }
    tx.send(Err(std::io::Error::other("cut"))).await.unwrap();
    let _ = putting.await;
    // Ask where the upload stands: a PUT from 0 is told the offset.
    let probe = put(&fake, &ticket, &[], full(Bytes::new())).await;
    assert_eq!(probe.status, StatusCode::PERMANENT_REDIRECT);
    assert_eq!(probe.header("x-upload-offset"), Some("40000"));
    let rest = put(
        &fake,
        &ticket,
        &[("content-range", "bytes 40000-99999/100000")],
        full(vec![7u8; 60_000]),
    )
    .await;
    assert_eq!(rest.status, StatusCode::OK);
    let id = ticket["uploadId"].as_str().unwrap();
    let finalized = post_json(&fake, "/upload/finalize", &json!({"uploadId":id})).await;
    assert_eq!(finalized.status, StatusCode::OK, "{}", finalized.text());
}

fn tokio_stream_from(
    mut rx: tokio::sync::mpsc::Receiver<Result<Bytes, std::io::Error>>,
) -> impl futures::Stream<Item = Result<Bytes, std::io::Error>> + Send + 'static {
    futures::stream::poll_fn(move |cx| rx.poll_recv(cx))
}

#[tokio::test]
async fn finalize_refuses_a_hash_mismatch_and_drops_the_upload() {
    let fake = start();
    let answer = post_json(
        &fake,
        "/upload/preflight",
        &json!({"uploadAttemptId":"m","sha256":"0".repeat(64),"fileName":"f.apk","sizeBytes":3,"artifactType":"file"}),
    )
    .await;
    let ticket = answer.json();
    let id = ticket["uploadId"].as_str().unwrap().to_owned();
    assert_eq!(
        put(&fake, &ticket, &[], full("abc")).await.status,
        StatusCode::OK
    );
    let mismatch = post_json(&fake, "/upload/finalize", &json!({"uploadId":id})).await;
    assert_eq!(mismatch.status, StatusCode::BAD_REQUEST);
    assert_eq!(
        mismatch.json(),
        json!({"ok":false,"error":"Upload hash mismatch","code":"INVALID_ARGS"})
    );
    let again = post_json(&fake, "/upload/finalize", &json!({"uploadId":id})).await;
    assert_eq!(again.status, StatusCode::INTERNAL_SERVER_ERROR);
    assert!(fake.uploads().is_empty());
    for (body, message) in [
        (json!({}), "uploadId is required"),
        (json!({"uploadId":5}), "uploadId is required"),
    ] {
        let refused = post_json(&fake, "/upload/finalize", &body).await;
        assert_eq!(refused.json()["error"], message);
    }
}

#[tokio::test]
async fn a_preflight_body_is_capped_at_64_kib() {
    let fake = start();
    let body_of = |len: usize| {
        let head = format!(
            r#"{{"uploadAttemptId":"z","sha256":"{}","fileName":"f","sizeBytes":1,"artifactType":"file","pad":""#,
            "0".repeat(64)
        );
        let tail = r#""}"#;
        format!("{head}{}{tail}", "x".repeat(len - head.len() - tail.len()))
    };
    let auth = format!("Bearer {}", fake.token());
    let url = format!("{}/upload/preflight", fake.base_url());
    let at_cap = send(
        Method::POST,
        &url,
        &[("authorization", &auth)],
        full(body_of(JSON_BODY_CAP)),
    )
    .await;
    assert_eq!(at_cap.status, StatusCode::OK);
    let past = send(
        Method::POST,
        &url,
        &[("authorization", &auth)],
        full(body_of(JSON_BODY_CAP + 1)),
    )
    .await;
    assert_eq!(past.status, StatusCode::BAD_REQUEST);
    assert_eq!(
        past.json(),
        json!({"ok":false,"error":"Request body is too large.","code":"INVALID_ARGS"})
    );
}

#[tokio::test]
async fn a_legacy_upload_is_taken_whole() {
    let fake = start();
    let auth = format!("Bearer {}", fake.token());
    let url = format!("{}/upload", fake.base_url());
    let answer = send(
        Method::POST,
        &url,
        &[
            ("authorization", &auth),
            ("x-artifact-type", "file"),
            ("x-artifact-filename", "legacy.apk"),
            ("x-artifact-hash", &"0".repeat(64)),
            ("x-artifact-hash-algorithm", "sha256"),
        ],
        chunks_of(b"legacy bytes", 4),
    )
    .await;
    assert_eq!(answer.status, StatusCode::OK);
    let id = answer.json()["uploadId"].as_str().unwrap().to_owned();
    let upload = &fake.uploads()[0];
    assert_eq!((upload.id.as_str(), upload.size), (id.as_str(), 12));
    assert_eq!(
        upload.sha256,
        sha256(b"legacy bytes"),
        "the bytes that came, not the header"
    );
    let missing = send(Method::POST, &url, &[("authorization", &auth)], full("x")).await;
    assert_eq!(
        missing.json()["error"],
        "Missing required headers: x-artifact-type and x-artifact-filename"
    );
}

#[tokio::test]
async fn a_screenshot_artifact_downloads_once() {
    let fake = start();
    data(
        &command(
            &fake,
            json!({"command":"open","session":"shot","flags":{"platform":"linux"}}),
        )
        .await,
    );
    let shot = command(
        &fake,
        json!({"command":"screenshot","session":"shot",
               "positionals":["/tmp/agent-device-screenshot-1-abcdef.png"],
               "meta":{"clientArtifactPaths":{"path":"/home/me/dl/shot.png"}}}),
    )
    .await;
    let shot = data(&shot);
    assert_eq!(shot["path"], "/tmp/agent-device-screenshot-1-abcdef.png");
    assert_eq!(
        (shot["width"].as_u64(), shot["height"].as_u64()),
        (Some(4), Some(4))
    );
    let artifact = &shot["artifacts"][0];
    assert_eq!(artifact["field"], "path");
    assert_eq!(artifact["artifactType"], "screenshot");
    assert_eq!(artifact["fileName"], "shot.png");
    let id = artifact["artifactId"].as_str().unwrap().to_owned();

    let listed = get(&fake, "/artifacts").await.json();
    assert_eq!(listed["artifacts"][0]["id"], id);
    assert_eq!(listed["artifacts"][0]["sizeBytes"], TINY_PNG.len());

    let download = get(&fake, &format!("/artifacts/{id}")).await;
    assert_eq!(download.status, StatusCode::OK);
    assert_eq!(
        download.header("content-type"),
        Some("application/octet-stream")
    );
    assert_eq!(download.header("content-length"), Some("73"));
    assert_eq!(
        download.header("content-disposition"),
        Some("attachment; filename=\"shot.png\"")
    );
    assert_eq!(download.body, TINY_PNG);

    let twice = get(&fake, &format!("/artifacts/{id}")).await;
    assert_eq!(twice.status, StatusCode::INTERNAL_SERVER_ERROR);
    assert_eq!(
        twice.json(),
        json!({"ok":false,"error":format!("Artifact not found or expired: {id}"),"code":"COMMAND_FAILED"})
    );
    assert_eq!(
        get(&fake, "/artifacts").await.json(),
        json!({"artifacts":[]})
    );

    fake.set_screenshot(Bytes::from_static(b"not a png"));
    let other = command(
        &fake,
        json!({"command":"screenshot","session":"shot","meta":{"clientArtifactPaths":{"path":"/x/b.bin"}}}),
    )
    .await;
    let id = data(&other)["artifacts"][0]["artifactId"]
        .as_str()
        .unwrap()
        .to_owned();
    assert_eq!(
        get(&fake, &format!("/artifacts/{id}")).await.body,
        &b"not a png"[..]
    );
}

#[tokio::test]
async fn a_failing_command_leaves_diagnostics_at_its_url_encoded_route() {
    let fake = start();
    fake.fail_commands(
        CommandFailure::new(DaemonError::new(
            ErrorCode::ToolMissing,
            "adb not found in PATH",
        ))
        .on_platform("android"),
    );
    let lease = allocate(
        &fake,
        json!({"tenantId":"acme","runId":"run9","backend":"android-instance"}),
    )
    .await;
    let failed = command(
        &fake,
        json!({"session":"adc-1","command":"devices","flags":{"platform":"android"},
               "meta":{"requestId":"34fac462079aa516","tenantId":"acme","runId":"run9","leaseId":lease,
                       "leaseBackend":"android-instance","sessionIsolation":"tenant"}}),
    )
    .await;
    assert_eq!(failed.status, StatusCode::INTERNAL_SERVER_ERROR);
    let err = error_data(&failed);
    assert_eq!(
        err["diagnosticsRecord"],
        json!({"session":"acme:adc-1","requestId":"34fac462079aa516"})
    );
    assert_eq!(
        err["logPath"],
        format!(
            "{}/sessions/acme_adc-1/requests/34fac462079aa516.ndjson",
            fake.state_dir().display()
        )
    );
    let auth = format!("Bearer {}", fake.token());
    let diagnostics = send(
        Method::GET,
        &format!(
            "{}/sessions/acme%3Aadc-1/requests/34fac462079aa516/diagnostics?x=1",
            fake.base_url()
        ),
        &[("authorization", &auth), ("x-agent-device-tenant", "acme")],
        full(Bytes::new()),
    )
    .await;
    assert_eq!(diagnostics.status, StatusCode::OK);
    assert_eq!(
        diagnostics.header("content-type"),
        Some("application/x-ndjson")
    );
    assert_eq!(
        diagnostics.header("content-length").map(str::to_owned),
        Some(diagnostics.body.len().to_string())
    );
    let lines: Vec<Value> = diagnostics
        .text()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(lines[0]["phase"], "request_start");
    assert_eq!(lines[0]["data"]["tenant"], "acme");
    assert_eq!(lines[0]["data"]["isolation"], "tenant");
    assert_eq!(
        lines[1]["data"],
        json!({"code":"TOOL_MISSING","message":"adb not found in PATH"})
    );

    let missing = get(&fake, "/sessions/x/requests/y/diagnostics").await;
    assert_eq!(missing.status, StatusCode::NOT_FOUND);
    assert_eq!(
        missing.json(),
        json!({"ok":false,"error":"No diagnostics record for request y in session x","code":"SESSION_NOT_FOUND"})
    );
    let malformed = get(&fake, "/sessions/%ZZ/requests/y/diagnostics").await;
    assert_eq!(malformed.status, StatusCode::BAD_REQUEST);
    assert_eq!(
        malformed.json()["error"],
        "Invalid session or request id in diagnostics route"
    );
    // A successful command leaves none.
    data(
        &command(
            &fake,
            json!({"command":"devices","meta":{"requestId":"ok1"}}),
        )
        .await,
    );
    assert_eq!(
        get(&fake, "/sessions/default/requests/ok1/diagnostics")
            .await
            .status,
        StatusCode::NOT_FOUND
    );
}

#[tokio::test(start_paused = true)]
async fn a_held_command_runs_while_time_passes_and_its_lease_stays_alive() {
    let fake = start();
    let lease = allocate(
        &fake,
        json!({"tenantId":"acme","runId":"r","backend":"android-instance","ttlMs":10_000}),
    )
    .await;
    let meta =
        json!({"tenantId":"acme","runId":"r","leaseId":lease,"leaseBackend":"android-instance"});
    data(
        &command(
            &fake,
            json!({"command":"open","session":"long","flags":{"platform":"android"},"meta":meta}),
        )
        .await,
    );
    let hold = fake.hold_commands("snapshot");
    let snapshot = {
        let url = format!("{}/rpc", fake.base_url());
        let token = fake.token().to_owned();
        let meta = meta.clone();
        tokio::spawn(async move {
            let auth = format!("Bearer {token}");
            send(
                Method::POST,
                &url,
                &[("authorization", &auth)],
                full(
                    json!({"jsonrpc":"2.0","id":"s","method":"agent_device.command",
                            "params":{"command":"snapshot","session":"long","meta":meta}})
                    .to_string(),
                ),
            )
            .await
        })
    };
    hold.wait_entered(1).await;
    // Two and a half TTLs pass while the command runs; heartbeats keep the lease.
    for _ in 0..5 {
        tokio::time::advance(Duration::from_secs(5)).await;
        let beat = rpc(
            &fake,
            "agent_device.lease.heartbeat",
            json!({"tenantId":"acme","runId":"r","leaseId":lease}),
        )
        .await;
        assert_eq!(beat.status, StatusCode::OK);
    }
    assert!(!snapshot.is_finished());
    assert_eq!(hold.waiting(), 1);
    let in_flight = fake
        .requests()
        .into_iter()
        .find(|r| r.json().is_some_and(|b| b["id"] == "s"))
        .unwrap();
    assert_eq!(
        in_flight.status, None,
        "recorded on arrival, answered later"
    );
    hold.release();
    let answer = snapshot.await.unwrap();
    assert_eq!(data(&answer), json!({"nodes":[],"truncated":false}));
    assert_eq!(fake.leases()[0].heartbeats, 5);
}

#[tokio::test]
async fn a_held_command_whose_client_hangs_up_stops_waiting() {
    let fake = start();
    let hold = fake.hold_commands("devices");
    let call = {
        let url = format!("{}/rpc", fake.base_url());
        let token = fake.token().to_owned();
        tokio::spawn(async move {
            let auth = format!("Bearer {token}");
            send(
                Method::POST,
                &url,
                &[("authorization", &auth)],
                full(r#"{"jsonrpc":"2.0","id":"d","method":"agent_device.command","params":{"command":"devices"}}"#),
            )
            .await
        })
    };
    hold.wait_entered(1).await;
    call.abort();
    let _ = call.await;
    eventually("the hung-up call left the hold", || hold.waiting() == 0).await;
    assert_eq!(hold.entered(), 1);
}

#[tokio::test(start_paused = true)]
async fn the_rpc_delay_is_virtual_time() {
    let fake = start();
    fake.set_rpc_delay(Some(Duration::from_secs(30)));
    let started = tokio::time::Instant::now();
    data(&command(&fake, json!({"command":"devices"})).await);
    assert!(started.elapsed() >= Duration::from_secs(30));
    fake.set_rpc_delay(None);
    let started = tokio::time::Instant::now();
    data(&command(&fake, json!({"command":"devices"})).await);
    assert!(started.elapsed() < Duration::from_secs(30));
}

#[tokio::test]
async fn every_request_is_recorded_with_its_body_digest_and_status() {
    let fake = start();
    data(&command(&fake, json!({"command":"devices"})).await);
    let _ = get(&fake, "/nope").await;
    let control = send(
        Method::GET,
        &format!("{}/__fake/requests", fake.base_url()),
        &[],
        full(Bytes::new()),
    )
    .await;
    assert_eq!(control.status, StatusCode::OK);
    let records = fake.requests();
    assert_eq!(records.len(), 2, "control requests are not recorded");
    let rpc_record = &records[0];
    assert_eq!(
        (rpc_record.method.as_str(), rpc_record.path.as_str()),
        ("POST", "/rpc")
    );
    assert_eq!(rpc_record.status, Some(200));
    assert_eq!(rpc_record.header("content-type"), Some("application/json"));
    assert_eq!(rpc_record.body_len, rpc_record.body.len() as u64);
    assert_eq!(rpc_record.body_sha256, sha256(&rpc_record.body));
    assert_eq!(rpc_record.json().unwrap()["params"]["command"], "devices");
    assert_eq!(records[1].status, Some(404));
    let listed = control.json();
    assert_eq!(listed[0]["path"], "/rpc");
    assert_eq!(listed[0]["bodySha256"], rpc_record.body_sha256.as_str());
    fake.clear_requests();
    assert!(fake.requests().is_empty());
}

async fn control(fake: &FakeAgentDevice, method: Method, path: &str, body: Value) -> Answer {
    send(
        method,
        &format!("{}/__fake/{path}", fake.base_url()),
        &[("content-type", "application/json")],
        full(body.to_string()),
    )
    .await
}

#[tokio::test]
async fn the_control_api_inspects_and_steers() {
    let fake = start();
    let info = control(&fake, Method::GET, "info", Value::Null)
        .await
        .json();
    assert_eq!(info["token"], fake.token());
    assert_eq!(info["port"], fake.port());
    assert_eq!(info["version"], "0.21.5");

    let put = control(
        &fake,
        Method::PUT,
        "devices",
        json!({"error":{"code":"TOOL_MISSING","message":"adb not found in PATH"}}),
    )
    .await;
    assert_eq!(put.status, StatusCode::OK);
    assert_eq!(
        error_data(&command(&fake, json!({"command":"devices"})).await)["code"],
        "TOOL_MISSING"
    );
    control(&fake, Method::PUT, "devices", json!("noList")).await;
    assert_eq!(
        data(&command(&fake, json!({"command":"devices"})).await),
        json!({})
    );
    control(&fake, Method::PUT, "devices", json!({"list":[{"platform":"ios","id":"U","name":"iPhone","kind":"simulator","target":"mobile","booted":true}]})).await;
    assert_eq!(
        data(&command(&fake, json!({"command":"devices"})).await)["devices"][0]["id"],
        "U"
    );

    let lease = allocate(&fake, json!({"tenantId":"t","runId":"r"})).await;
    let leases = control(&fake, Method::GET, "leases", Value::Null)
        .await
        .json();
    assert_eq!(leases[0]["leaseId"], lease.as_str());
    assert_eq!(leases[0]["heartbeats"], 0);
    control(
        &fake,
        Method::POST,
        "lease-failures",
        json!({"op":"release","count":1,"error":{"code":"COMMAND_FAILED","message":"nope"}}),
    )
    .await;
    let failed = rpc(
        &fake,
        "agent_device.lease.release",
        json!({"leaseId":lease}),
    )
    .await;
    assert_eq!(error_data(&failed)["message"], "nope");
    assert_eq!(
        data(
            &rpc(
                &fake,
                "agent_device.lease.release",
                json!({"leaseId":lease})
            )
            .await
        ),
        json!({"released":true})
    );

    control(&fake, Method::POST, "command-failures", json!({"command":"devices","error":{"code":"UNSUPPORTED_PLATFORM","message":"no"},"times":1})).await;
    assert_eq!(
        error_data(&command(&fake, json!({"command":"devices"})).await)["code"],
        "UNSUPPORTED_PLATFORM"
    );
    data(&command(&fake, json!({"command":"devices"})).await);
    control(
        &fake,
        Method::POST,
        "command-failures",
        json!({"error":{"code":"UNKNOWN","message":"all"}}),
    )
    .await;
    assert_eq!(
        error_data(&command(&fake, json!({"command":"devices"})).await)["code"],
        "UNKNOWN"
    );
    control(&fake, Method::DELETE, "command-failures", Value::Null).await;
    data(&command(&fake, json!({"command":"devices"})).await);

    let hold = control(&fake, Method::POST, "holds", json!({"command":"devices"}))
        .await
        .json();
    let id = hold["id"].as_u64().unwrap();
    let call = {
        let url = format!("{}/rpc", fake.base_url());
        let token = fake.token().to_owned();
        tokio::spawn(async move {
            let auth = format!("Bearer {token}");
            send(Method::POST, &url, &[("authorization", &auth)],
                 full(r#"{"jsonrpc":"2.0","id":"h","method":"agent_device.command","params":{"command":"devices"}}"#)).await
        })
    };
    let wait = async {
        while control(&fake, Method::GET, &format!("holds/{id}"), Value::Null)
            .await
            .json()["waiting"]
            != 1
        {
            tokio::task::yield_now().await;
        }
    };
    tokio::time::timeout(Duration::from_secs(30), wait)
        .await
        .expect("the held call reached the hold");
    assert_eq!(
        control(&fake, Method::DELETE, &format!("holds/{id}"), Value::Null)
            .await
            .status,
        StatusCode::OK
    );
    assert_eq!(call.await.unwrap().status, StatusCode::OK);
    assert_eq!(
        control(&fake, Method::DELETE, "holds/999", Value::Null)
            .await
            .status,
        StatusCode::NOT_FOUND
    );

    assert_eq!(
        control(&fake, Method::PUT, "rpc-delay", json!({"ms":1}))
            .await
            .status,
        StatusCode::OK
    );
    control(&fake, Method::PUT, "rpc-delay", json!({"ms":null})).await;
    let screenshot = send(
        Method::PUT,
        &format!("{}/__fake/screenshot", fake.base_url()),
        &[],
        full("PIXELS"),
    )
    .await;
    assert_eq!(screenshot.status, StatusCode::OK);

    assert_eq!(
        control(&fake, Method::GET, "uploads", Value::Null)
            .await
            .json(),
        json!([])
    );
    assert_eq!(
        control(&fake, Method::GET, "sessions", Value::Null)
            .await
            .json(),
        json!([])
    );
    let bad = control(&fake, Method::PUT, "devices", json!({"bogus":1})).await;
    assert_eq!(bad.status, StatusCode::BAD_REQUEST);
    assert_eq!(
        control(&fake, Method::GET, "nothing", Value::Null)
            .await
            .status,
        StatusCode::NOT_FOUND
    );
    let cleared = control(&fake, Method::DELETE, "requests", Value::Null).await;
    assert_eq!(cleared.status, StatusCode::OK);
    assert!(fake.requests().is_empty());
}

#[tokio::test]
async fn stop_closes_the_listener() {
    let fake = start();
    let url = format!("{}/health", fake.base_url());
    assert_eq!(
        send(Method::GET, &url, &[], full(Bytes::new()))
            .await
            .status,
        StatusCode::OK
    );
    fake.stop().await;
    assert!(
        try_send(Method::GET, &url, &[], full(Bytes::new()))
            .await
            .is_err()
    );
}

#[tokio::test]
async fn the_network_access_marker_is_public_only_or_refused() {
    let fake = start();
    let auth = format!("Bearer {}", fake.token());
    let call = |marker: &'static str, params: Value| {
        let url = format!("{}/rpc", fake.base_url());
        let auth = auth.clone();
        async move {
            send(
                Method::POST,
                &url,
                &[("authorization", &auth), ("x-agent-device-network-access", marker)],
                full(json!({"jsonrpc":"2.0","id":"n","method":"agent_device.command","params":params}).to_string()),
            )
            .await
        }
    };
    data(&call("public-only", json!({"command":"devices"})).await);
    let bad = call("anything", json!({"command":"devices"})).await;
    assert_eq!(bad.status, StatusCode::BAD_REQUEST);
    assert_eq!(
        bad.json(),
        json!({"jsonrpc":"2.0","id":"n","error":{"code":-32602,"message":"Invalid daemon HTTP network access marker",
               "data":{"code":"INVALID_ARGS","message":"Invalid daemon HTTP network access marker",
                       "hint":"Check command arguments and run --help for usage examples."}}})
    );
    let local = json!({"command":"install_source","flags":{"platform":"android"},
                       "meta":{"installSource":{"kind":"path","path":"/tmp/a.apk"}}});
    let refused = call("public-only", local.clone()).await;
    assert_eq!(
        refused.json()["error"]["message"],
        "Invalid params: path install sources are disabled on the remote HTTP surface"
    );
    let mut uploaded = local;
    uploaded["meta"]["uploadedArtifactId"] = json!("zz");
    let unknown = call("public-only", uploaded).await;
    assert_eq!(
        error_data(&unknown)["message"],
        "Uploaded artifact not found or expired: zz"
    );
}
