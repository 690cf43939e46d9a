//! Both daemons' HTTP API from outside, over real loopback connections: who sees what on every
//! route that shows leases or requests, the shapes `docs/HTTP-API.md` promises through a gateway,
//! `/v1/metrics` checked by Prometheus's own parser, and arbitrary requests always answered with
//! a well-formed reply.

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    reason = "tests fail by panicking"
)]

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::rt::TokioIo;
use serde_json::{Value, json};
use simlock_contract::ErrorCode;
use simlock_contract::model::TokenRole;
use simlock_daemon::tokens::TokenStore;
use simlock_e2e::{PATIENCE, TestFleet, gateway_config, worker_config};

// === A small HTTP client ===

/// One answer: its status, content type and body (JSON, `Null` for an event stream or an empty
/// body, a string for anything else).
#[derive(Debug)]
struct Answer {
    status: u16,
    content_type: String,
    body: Value,
}

impl Answer {
    fn code(&self) -> &str {
        self.body["error"]["code"].as_str().unwrap_or_default()
    }
}

/// Sends one request on a new connection; `None` when the connection broke before an answer.
async fn try_send(addr: SocketAddr, request: http::Request<Full<Bytes>>) -> Result<Answer, String> {
    let exchange = async {
        let stream = tokio::net::TcpStream::connect(addr)
            .await
            .map_err(|e| e.to_string())?;
        let (mut sender, connection) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
            .await
            .map_err(|e| e.to_string())?;
        tokio::spawn(connection.with_upgrades());
        let head_only = request.method() == http::Method::HEAD;
        let response = sender
            .send_request(request)
            .await
            .map_err(|e| format!("no answer: {e}"))?;
        let status = response.status().as_u16();
        let content_type = response
            .headers()
            .get(http::header::CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
            .unwrap_or_default()
            .to_owned();
        if status == 101 || content_type.starts_with("text/event-stream") || head_only {
            return Ok(Answer {
                status,
                content_type,
                body: Value::Null,
            });
        }
        let bytes = response
            .into_body()
            .collect()
            .await
            .map_err(|e| format!("the body broke: {e}"))?
            .to_bytes();
        let body = if bytes.is_empty() {
            Value::Null
        } else if content_type == "application/json" {
            serde_json::from_slice(&bytes).map_err(|e| format!("invalid JSON: {e}"))?
        } else {
            Value::String(String::from_utf8_lossy(&bytes).into_owned())
        };
        Ok(Answer {
            status,
            content_type,
            body,
        })
    };
    tokio::time::timeout(PATIENCE, exchange)
        .await
        .unwrap_or_else(|_| Err("no answer within the bound".into()))
}

fn request(
    method: &str,
    path: &str,
    token: Option<&str>,
    body: Option<&Value>,
) -> http::Request<Full<Bytes>> {
    let mut builder = http::Request::builder()
        .method(method)
        .uri(path)
        .header(http::header::HOST, "simlock");
    if let Some(token) = token {
        builder = builder.header(http::header::AUTHORIZATION, format!("Bearer {token}"));
    }
    let bytes = body.map(|b| Bytes::from(b.to_string())).unwrap_or_default();
    builder.body(Full::new(bytes)).unwrap()
}

async fn send(
    addr: SocketAddr,
    method: &str,
    path: &str,
    token: Option<&str>,
    body: Option<Value>,
) -> Answer {
    try_send(addr, request(method, path, token, body.as_ref()))
        .await
        .unwrap_or_else(|e| panic!("{method} {path}: {e}"))
}

fn agent(tokens: &TokenStore) -> (String, String) {
    let (secret, record) = tokens.create(TokenRole::Agent, None).unwrap();
    (secret, record.id.to_string())
}

/// A lease request over HTTP, followed until it settles or is queued: its `request` view.
async fn lease_request(addr: SocketAddr, token: &str, settled: bool) -> Value {
    let created = send(
        addr,
        "POST",
        "/v1/lease-requests",
        Some(token),
        Some(json!({"platform": "ios"})),
    )
    .await;
    assert_eq!(created.status, 201, "{created:?}");
    let id = created.body["request"]["id"].as_str().unwrap().to_owned();
    if !settled {
        assert_eq!(created.body["request"]["state"], "queued", "{created:?}");
        return created.body["request"].clone();
    }
    // Each poll waits at most 30 s; the whole wait is bounded too.
    simlock_e2e::relay::patient("the grant", async {
        loop {
            let polled = send(
                addr,
                "GET",
                &format!("/v1/lease-requests/{id}?wait=30"),
                Some(token),
                None,
            )
            .await;
            assert_eq!(polled.status, 200, "{polled:?}");
            match polled.body["request"]["state"].as_str().unwrap() {
                "granted" => return polled.body["request"].clone(),
                "failed" | "cancelled" => panic!("the request settled without a lease: {polled:?}"),
                _ => {}
            }
        }
    })
    .await
}

fn ids(list: &Value) -> Vec<String> {
    list.as_array()
        .unwrap_or_else(|| panic!("not a list: {list}"))
        .iter()
        .map(|item| item["id"].as_str().unwrap().to_owned())
        .collect()
}

fn requesters(list: &Value) -> Vec<String> {
    list.as_array()
        .unwrap_or_else(|| panic!("not a list: {list}"))
        .iter()
        .map(|item| item["requesterId"].as_str().unwrap().to_owned())
        .collect()
}

/// What one agent may do with another agent's lease and request: nothing, and it cannot tell
/// the lease exists.
async fn others_are_out_of_reach(addr: SocketAddr, token: &str, lease: &str, request: &str) {
    for (method, path, body, status, code) in [
        (
            "GET",
            format!("/v1/leases/{lease}"),
            None,
            404,
            "UNKNOWN_LEASE",
        ),
        (
            "GET",
            format!("/v1/leases/{lease}/events"),
            None,
            404,
            "UNKNOWN_LEASE",
        ),
        (
            "POST",
            format!("/v1/leases/{lease}/renew"),
            None,
            404,
            "UNKNOWN_LEASE",
        ),
        (
            "POST",
            format!("/v1/leases/{lease}/exec"),
            Some(json!({"tool": "echo"})),
            404,
            "UNKNOWN_LEASE",
        ),
        (
            "DELETE",
            format!("/v1/leases/{lease}"),
            None,
            404,
            "UNKNOWN_LEASE",
        ),
        (
            "GET",
            format!("/v1/lease-requests/{request}"),
            None,
            403,
            "FORBIDDEN",
        ),
        (
            "GET",
            format!("/v1/lease-requests/{request}/events"),
            None,
            403,
            "FORBIDDEN",
        ),
        (
            "DELETE",
            format!("/v1/lease-requests/{request}"),
            None,
            403,
            "FORBIDDEN",
        ),
    ] {
        let answer = send(addr, method, &path, Some(token), body).await;
        assert_eq!(
            (answer.status, answer.code()),
            (status, code),
            "{method} {path}: {answer:?}"
        );
    }
    // The operator's views of everyone's things.
    for (method, path, body) in [
        ("GET", "/v1/workers", None),
        ("GET", "/v1/lease-requests", None),
        ("GET", "/v1/devices", None),
        ("GET", "/v1/events", None),
        ("GET", "/v1/events/stream", None),
        ("GET", "/v1/metrics", None),
        ("POST", "/v1/ops/list.get", Some(json!({"kind": "leases"}))),
        ("POST", "/v1/ops/worker.list", Some(json!({}))),
        ("POST", "/v1/ops/events.replay", Some(json!({}))),
    ] {
        let answer = send(addr, method, path, Some(token), body).await;
        assert_eq!(
            (answer.status, answer.code()),
            (403, "FORBIDDEN"),
            "{method} {path}: {answer:?}"
        );
    }
}

/// An agent's own lease list, by every route that answers one, holds exactly `lease`.
async fn own_leases_are(addr: SocketAddr, token: &str, lease: &str) {
    let listed = send(addr, "GET", "/v1/leases", Some(token), None).await;
    assert_eq!(ids(&listed.body["leases"]), [lease], "{listed:?}");
    let listed = send(
        addr,
        "POST",
        "/v1/ops/lease.list",
        Some(token),
        Some(json!({})),
    )
    .await;
    assert_eq!(ids(&listed.body["leases"]), [lease], "{listed:?}");
    let one = send(
        addr,
        "GET",
        &format!("/v1/leases/{lease}"),
        Some(token),
        None,
    )
    .await;
    assert_eq!(one.status, 200, "{one:?}");
    let events = send(
        addr,
        "GET",
        &format!("/v1/leases/{lease}/events"),
        Some(token),
        None,
    )
    .await;
    assert_eq!(
        (events.status, events.content_type.as_str()),
        (200, "text/event-stream")
    );
}

/// A worker serving HTTP on a free port, with two virtual devices per platform, and its home.
async fn http_worker() -> (simlock_worker::RunningWorker, tempfile::TempDir) {
    let mut config = worker_config(2);
    config.daemon.http.enabled = Some(true);
    config.daemon.http.port = 0;
    let dir = tempfile::tempdir().unwrap();
    let worker = simlock_worker::start(simlock_worker::WorkerOptions::new(
        simlock_daemon::home::Home::at(dir.path().join("worker")),
        config,
    ))
    .await
    .unwrap();
    (worker, dir)
}

/// A lease request's body is read under its own keys: a refusal names `device` or `os`, not
/// the operation's `model` or `osVersion`, and an unknown key lists the accepted ones.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lease_request_body_is_refused_naming_the_key_the_caller_sent() {
    let (worker, _dir) = http_worker().await;
    let addr = worker.running.http_addr().unwrap();
    let (token, _) = agent(&worker.running.base.tokens);
    for (body, message) in [
        (
            json!({"platform": "ios", "device": 5}),
            "device: invalid type",
        ),
        (
            json!({"platform": "ios", "os": ""}),
            "os: length is lower than 1",
        ),
        (
            json!({"platform": "ios", "model": "iPhone 16"}),
            "model: unknown field `model`, expected one of `platform`, `device`",
        ),
    ] {
        let refused = send(addr, "POST", "/v1/lease-requests", Some(&token), Some(body)).await;
        assert_eq!(
            (refused.status, refused.code()),
            (400, "BAD_REQUEST"),
            "{refused:?}"
        );
        let text = refused.body["error"]["message"].as_str().unwrap();
        assert!(text.starts_with(message), "{text}");
    }
    // Nothing was asked of the worker.
    let leases = send(addr, "GET", "/v1/leases", Some(&token), None).await;
    assert_eq!(leases.body["leases"], json!([]), "{leases:?}");
    let granted = send(
        addr,
        "POST",
        "/v1/lease-requests",
        Some(&token),
        Some(json!({"platform": "ios", "device": "iPhone 16", "noWait": true})),
    )
    .await;
    assert_eq!(granted.status, 201, "{granted:?}");
    worker.stop("test").await;
}

/// `?platform=` keeps one platform of the catalog; a name that is no platform is refused
/// naming it, and so is the query giving it twice.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_catalog_query_keeps_one_platform_and_refuses_what_is_none() {
    let (worker, _dir) = http_worker().await;
    let addr = worker.running.http_addr().unwrap();
    let (token, _) = agent(&worker.running.base.tokens);
    let platforms = |answer: &Answer| -> Vec<String> {
        let platforms = answer.body["platforms"].as_array().expect("a catalog");
        platforms
            .iter()
            .map(|p| p["platform"].as_str().unwrap().to_owned())
            .collect()
    };
    let all = send(addr, "GET", "/v1/catalog", Some(&token), None).await;
    assert_eq!(
        (all.status, platforms(&all)),
        (200, vec!["ios".into(), "android".into()])
    );
    let android = send(
        addr,
        "GET",
        "/v1/catalog?platform=android",
        Some(&token),
        None,
    )
    .await;
    assert_eq!(
        (android.status, platforms(&android)),
        (200, vec!["android".into()])
    );
    for (path, message) in [
        (
            "/v1/catalog?platform=iOS",
            r#"platform: "iOS" is not ios or android"#,
        ),
        (
            "/v1/catalog?platform=",
            r#"platform: "" is not ios or android"#,
        ),
        (
            "/v1/catalog?platform=ios&platform=ios",
            "platform: given more than once",
        ),
    ] {
        let refused = send(addr, "GET", path, Some(&token), None).await;
        assert_eq!(refused.status, 400, "{path}: {refused:?}");
        assert_eq!(refused.body["error"]["code"], "BAD_REQUEST", "{path}");
        let text = refused.body["error"]["message"].as_str().unwrap();
        assert!(text.starts_with(message), "{path}: {text}");
    }
    worker.stop("test").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn agents_on_a_worker_see_only_their_own_leases_and_requests() {
    let (worker, _dir) = http_worker().await;
    let addr = worker.running.http_addr().unwrap();
    let tokens = &worker.running.base.tokens;
    let ((a, a_id), (b, b_id), (c, c_id)) = (agent(tokens), agent(tokens), agent(tokens));
    let (operator, _) = tokens.create(TokenRole::Operator, None).unwrap();

    let a_request = lease_request(addr, &a, true).await;
    let b_request = lease_request(addr, &b, true).await;
    let c_request = lease_request(addr, &c, false).await;
    let a_lease = a_request["lease"]["lease"]["id"].as_str().unwrap();
    let b_lease = b_request["lease"]["lease"]["id"].as_str().unwrap();

    for (token, principal, lease) in [(&a, &a_id, Some(a_lease)), (&b, &b_id, Some(b_lease))] {
        let status = send(addr, "GET", "/v1/status", Some(token), None).await;
        assert_eq!(status.status, 200);
        assert_eq!(
            ids(&status.body["leases"]),
            [lease.unwrap()],
            "{principal}: {status:?}"
        );
        assert!(
            requesters(&status.body["waiting"]).is_empty(),
            "{principal} sees no other token's waiting request: {status:?}"
        );
        assert_eq!(status.body["queueDepth"], 1, "counts are everyone's");
        let by_op = send(
            addr,
            "POST",
            "/v1/ops/status.get",
            Some(token),
            Some(json!({})),
        )
        .await;
        assert_eq!(ids(&by_op.body["leases"]), [lease.unwrap()]);
        own_leases_are(addr, token, lease.unwrap()).await;
    }
    let status = send(addr, "GET", "/v1/status", Some(&c), None).await;
    assert!(ids(&status.body["leases"]).is_empty(), "{status:?}");
    assert_eq!(
        requesters(&status.body["waiting"]),
        [c_id.as_str()],
        "{status:?}"
    );

    others_are_out_of_reach(addr, &a, b_lease, b_request["id"].as_str().unwrap()).await;
    others_are_out_of_reach(addr, &b, a_lease, a_request["id"].as_str().unwrap()).await;
    others_are_out_of_reach(addr, &a, b_lease, c_request["id"].as_str().unwrap()).await;

    // An operator sees everything.
    let status = send(addr, "GET", "/v1/status", Some(&operator), None).await;
    let mut all = ids(&status.body["leases"]);
    all.sort();
    let mut expected = vec![a_lease.to_owned(), b_lease.to_owned()];
    expected.sort();
    assert_eq!(all, expected);
    assert_eq!(requesters(&status.body["waiting"]), [c_id]);
    let workers = send(addr, "GET", "/v1/workers", Some(&operator), None).await;
    assert_eq!(ids(&workers.body["workers"][0]["leases"]).len(), 2);
    worker.stop("test").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn agents_on_a_gateway_see_only_their_own_leases_and_requests_in_every_nested_view() {
    let mut fleet = TestFleet::start(gateway_config()).await;
    fleet.add_worker(worker_config(2)).await;
    let worker_id = fleet.worker_id(0);
    let addr = fleet.gateway().running.http_addr().unwrap();
    let tokens = &fleet.gateway().running.base.tokens;
    let ((a, a_id), (b, b_id), (c, c_id)) = (agent(tokens), agent(tokens), agent(tokens));
    let (operator, _) = tokens.create(TokenRole::Operator, None).unwrap();

    let a_request = lease_request(addr, &a, true).await;
    let b_request = lease_request(addr, &b, true).await;
    let c_request = lease_request(addr, &c, false).await;
    let a_lease = a_request["lease"]["lease"]["id"]
        .as_str()
        .unwrap()
        .to_owned();
    let b_lease = b_request["lease"]["lease"]["id"]
        .as_str()
        .unwrap()
        .to_owned();
    // The worker's own id of a gateway lease is what follows `<workerId>.`.
    let on_worker = |lease: &str| {
        lease
            .strip_prefix(&format!("{worker_id}."))
            .unwrap()
            .to_owned()
    };
    // Both leases are in the worker's view before anyone looks.
    fleet
        .wait_for(|views| {
            views
                .iter()
                .any(|v| v.leases.as_ref().is_some_and(|l| l.len() == 2))
        })
        .await;

    for (token, principal, lease) in [(&a, &a_id, &a_lease), (&b, &b_id, &b_lease)] {
        let status = send(addr, "GET", "/v1/status", Some(token), None).await;
        assert_eq!(status.status, 200);
        assert_eq!(
            ids(&status.body["leases"]),
            [lease.as_str()],
            "{principal}: {status:?}"
        );
        let workers = status.body["workers"].as_array().unwrap();
        assert_eq!(workers.len(), 1);
        assert_eq!(
            ids(&workers[0]["leases"]),
            [on_worker(lease)],
            "{principal} sees only its own lease in the worker's view: {status:?}"
        );
        assert!(requesters(&status.body["waiting"]).is_empty(), "{status:?}");
        assert!(
            requesters(&workers[0]["waiting"]).is_empty(),
            "{principal}: {status:?}"
        );
        assert_eq!(status.body["queueDepth"], 1, "counts are everyone's");
        let by_op = send(
            addr,
            "POST",
            "/v1/ops/status.get",
            Some(token),
            Some(json!({})),
        )
        .await;
        assert_eq!(ids(&by_op.body["workers"][0]["leases"]), [on_worker(lease)]);
        own_leases_are(addr, token, lease).await;
    }
    let status = send(addr, "GET", "/v1/status", Some(&c), None).await;
    assert!(ids(&status.body["leases"]).is_empty(), "{status:?}");
    assert!(
        ids(&status.body["workers"][0]["leases"]).is_empty(),
        "{status:?}"
    );
    assert_eq!(
        requesters(&status.body["waiting"]),
        [c_id.as_str()],
        "{status:?}"
    );

    others_are_out_of_reach(addr, &a, &b_lease, b_request["id"].as_str().unwrap()).await;
    others_are_out_of_reach(addr, &b, &a_lease, a_request["id"].as_str().unwrap()).await;
    others_are_out_of_reach(addr, &a, &b_lease, c_request["id"].as_str().unwrap()).await;

    // An operator sees everything, the workers' views as they report them.
    let status = send(addr, "GET", "/v1/status", Some(&operator), None).await;
    assert_eq!(ids(&status.body["leases"]).len(), 2, "{status:?}");
    assert_eq!(
        ids(&status.body["workers"][0]["leases"]).len(),
        2,
        "{status:?}"
    );
    assert_eq!(requesters(&status.body["waiting"]), [c_id]);
    let workers = send(addr, "GET", "/v1/workers", Some(&operator), None).await;
    assert_eq!(ids(&workers.body["workers"][0]["leases"]).len(), 2);

    // The shapes "Through a gateway" promises: the grant's environment names the gateway's
    // lease id, its lease record carries `worker` only; the lists and a renewal add `workerId`.
    let grant = &a_request["lease"];
    assert_eq!(grant["environment"]["SIMLOCK_LEASE_ID"], a_lease.as_str());
    assert_eq!(grant["lease"]["worker"]["id"], worker_id.as_str());
    assert!(grant["lease"].get("workerId").is_none(), "{grant}");
    let one = send(
        addr,
        "GET",
        &format!("/v1/leases/{a_lease}"),
        Some(&a),
        None,
    )
    .await;
    assert_eq!(one.body["lease"]["worker"]["id"], worker_id.as_str());
    assert_eq!(one.body["lease"]["workerId"], worker_id.as_str());
    let renewed = send(
        addr,
        "POST",
        &format!("/v1/leases/{a_lease}/renew"),
        Some(&a),
        None,
    )
    .await;
    assert_eq!(renewed.status, 200, "{renewed:?}");
    assert_eq!(renewed.body["workerId"], worker_id.as_str());
    assert_eq!(renewed.body["worker"]["id"], worker_id.as_str());

    let cancelled = send(
        addr,
        "DELETE",
        &format!("/v1/lease-requests/{}", c_request["id"].as_str().unwrap()),
        Some(&c),
        None,
    )
    .await;
    assert_eq!(cancelled.status, 204, "{cancelled:?}");
    // Cancelled, it carries no queue position (as its event said, before the view was fixed).
    let view = send(
        addr,
        "GET",
        &format!("/v1/lease-requests/{}", c_request["id"].as_str().unwrap()),
        Some(&c),
        None,
    )
    .await;
    assert_eq!(view.body["request"]["state"], "cancelled", "{view:?}");
    assert!(
        view.body["request"].get("queuePosition").is_none(),
        "{view:?}"
    );
    fleet.stop().await;
}

// === /v1/metrics through Prometheus's parser ===

/// `promtool`: `SIMLOCK_PROMTOOL`, the copy `.ci/run` unpacks into `.cache/`, or one on `PATH`.
fn promtool() -> Option<PathBuf> {
    if let Some(path) = std::env::var_os("SIMLOCK_PROMTOOL") {
        return Some(PathBuf::from(path));
    }
    let cached =
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../.cache/prometheus/usr/bin/promtool");
    if cached.is_file() {
        return Some(cached);
    }
    Command::new("promtool")
        .arg("--version")
        .output()
        .ok()
        .filter(|out| out.status.success())
        .map(|_| PathBuf::from("promtool"))
}

/// Runs `promtool check metrics` (the text format's parser, then its lints) on `text`. Without
/// promtool the check fails in CI (`.ci/run` installs it) and is skipped, loudly, elsewhere.
#[allow(
    clippy::print_stderr,
    reason = "a skipped check says so where the test output shows"
)]
fn check_metrics(what: &str, text: &str) {
    let Some(promtool) = promtool() else {
        assert!(
            std::env::var_os("CI").is_none(),
            "promtool is missing: .ci/run unpacks it into .cache/prometheus; the metrics check may not be skipped in CI"
        );
        eprintln!(
            "SKIPPED the promtool check of {what}: run .ci/run's setup or set SIMLOCK_PROMTOOL"
        );
        return;
    };
    let mut child = Command::new(&promtool)
        .args(["check", "metrics"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("{}: {e}", promtool.display()));
    {
        use std::io::Write as _;
        let mut stdin = child.stdin.take().unwrap();
        stdin.write_all(text.as_bytes()).unwrap();
    }
    let out = child.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "promtool refused {what}:\n{}{}\n--- the text ---\n{text}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_metrics_of_both_daemons_pass_prometheus_s_own_parser() {
    let mut fleet = TestFleet::start(gateway_config()).await;
    let mut config = worker_config(2);
    config.daemon.http.enabled = Some(true);
    config.daemon.http.port = 0;
    fleet.add_worker(config).await;
    // A lease, so every family has samples.
    let agent = fleet.agent("agent-1").await;
    agent
        .call("lease.request", json!({"platform": "ios"}))
        .await
        .unwrap();
    // The grant each daemon records (the gateway's fleet request, the worker's lease), and the
    // answers of a mount (the gateway's uplink, the worker's dial).
    for (what, addr, tokens, granted, mounted) in [
        (
            "the gateway's /v1/metrics",
            fleet.gateway().running.http_addr().unwrap(),
            &fleet.gateway().running.base.tokens,
            "request.granted",
            Some(
                "simlock_http_responses_total{method=\"GET\",route=\"/v1/uplink\",status=\"101\"} 1\n",
            ),
        ),
        (
            "the worker's /v1/metrics",
            fleet.worker(0).running.http_addr().unwrap(),
            &fleet.worker(0).running.base.tokens,
            "lease.granted",
            None,
        ),
    ] {
        let (operator, _) = tokens.create(TokenRole::Operator, None).unwrap();
        // Answers the responses' counter must show: a route's 404, a route's 405, no route.
        let unknown = send(addr, "GET", "/v1/leases/lse_nope", Some(&operator), None).await;
        assert_eq!(unknown.status, 404, "{what}");
        let wrong = send(addr, "DELETE", "/v1/metrics", Some(&operator), None).await;
        assert_eq!(wrong.status, 405, "{what}");
        let nowhere = send(addr, "GET", "/nowhere", None, None).await;
        assert_eq!(nowhere.status, 404, "{what}");
        let answer = send(addr, "GET", "/v1/metrics", Some(&operator), None).await;
        assert_eq!(answer.status, 200);
        assert_eq!(
            answer.content_type,
            "text/plain; version=0.0.4; charset=utf-8"
        );
        let text = answer.body.as_str().unwrap();
        assert!(text.contains("simlock_leases 1"), "{what}: {text}");
        let granted = format!("simlock_events_total{{event=\"{granted}\"}} 1\n");
        for line in [
            "simlock_events_total{event=\"lease.requested\"} 1\n",
            &granted,
            "simlock_http_responses_total{method=\"GET\",route=\"/v1/leases/{}\",status=\"404\"} 1\n",
            "simlock_http_responses_total{method=\"DELETE\",route=\"/v1/metrics\",status=\"405\"} 1\n",
            "simlock_http_responses_total{method=\"GET\",route=\"unmatched\",status=\"404\"} 1\n",
        ] {
            assert!(text.contains(line), "{what}: {line} in {text}");
        }
        if let Some(line) = mounted {
            assert!(text.contains(line), "{what}: {line} in {text}");
        }
        check_metrics(what, text);
    }
    fleet.stop().await;

    // Label values are user text: every character the format escapes, and then some.
    let metrics = simlock_daemon::metrics::Metrics::new();
    metrics.gauge("simlock_test", "Labels with every escape.", || {
        vec![
            (
                vec![("worker", "back\\slash \"quoted\"\nnew line".into())],
                1.0,
            ),
            (
                vec![("worker", "ünïcødé\ttab \\n not a newline".into())],
                f64::NAN,
            ),
            (vec![("worker", String::new())], f64::INFINITY),
            (vec![("worker", "}{,=".into())], f64::NEG_INFINITY),
        ]
    });
    check_metrics("label values with escapes", &metrics.render());
}

// === Arbitrary requests ===

/// One arbitrary request.
#[derive(Debug, Clone)]
struct Case {
    gateway: bool,
    method: &'static str,
    path: String,
    query: Option<String>,
    token: Credential,
    headers: Vec<(&'static str, Vec<u8>)>,
    body: Vec<u8>,
}

#[derive(Debug, Clone, Copy)]
enum Credential {
    None,
    Garbage,
    Agent,
    Join,
}

mod strategy {
    use proptest::prelude::*;

    use super::{Case, Credential};

    /// Characters a request target may hold as they are, `%` included (escapes or not).
    const URI: &[u8] = b"ABCXYZabcxyz0123456789-._~!$&'()*+,;=:@%/2EeFf";

    fn uri_text(max: usize) -> impl Strategy<Value = String> {
        proptest::collection::vec(proptest::sample::select(URI), 0..max)
            .prop_map(|bytes| bytes.into_iter().map(char::from).collect())
    }

    /// Numbers as a peer may spell them, the ones that are no finite number well represented.
    fn number_text() -> impl Strategy<Value = String> {
        prop_oneof![
            1 => any::<f64>().prop_map(|v| v.to_string()),
            1 => any::<i64>().prop_map(|v| v.to_string()),
            2 => proptest::sample::select(vec![
                "NaN", "nan", "-nan", "+NaN", "NAN", "%4EaN", "n%61n", "inf", "-inf", "+Inf",
                "infinity", "1e400", "-1e400",
            ])
            .prop_map(String::from),
            1 => proptest::sample::select(vec![
                "-1", "0", "60", "1.5", "%69nf", "1%2E5", "%", "%zz", "5s", "5ms", "2h", "1d",
                "-5s", "ios", "android", "",
            ])
            .prop_map(String::from),
        ]
    }

    fn query() -> impl Strategy<Value = String> {
        let key = prop_oneof![
            3 => Just("wait"),
            2 => Just("since"),
            2 => Just("platform"),
            1 => proptest::sample::select(vec!["w%61it", "x", ""]),
        ];
        let value = prop_oneof![3 => number_text(), 1 => uri_text(12)];
        let pair = (key, value).prop_map(|(k, v)| format!("{k}={v}"));
        proptest::collection::vec(prop_oneof![4 => pair, 1 => uri_text(8)], 1..4)
            .prop_map(|pairs| pairs.join("&"))
    }

    /// Every route of the host (`{}` for a parameter) with its method.
    const ROUTES: &[(&str, &str)] = &[
        ("GET", "/v1/healthz"),
        ("GET", "/v1/status"),
        ("GET", "/v1/catalog"),
        ("GET", "/v1/config"),
        ("POST", "/v1/lease-requests"),
        ("GET", "/v1/lease-requests"),
        ("GET", "/v1/lease-requests/{}"),
        ("GET", "/v1/lease-requests/{}/events"),
        ("DELETE", "/v1/lease-requests/{}"),
        ("GET", "/v1/leases"),
        ("GET", "/v1/leases/{}"),
        ("POST", "/v1/leases/{}/renew"),
        ("DELETE", "/v1/leases/{}"),
        ("POST", "/v1/leases/{}/exec"),
        ("GET", "/v1/leases/{}/events"),
        ("GET", "/v1/devices"),
        ("GET", "/v1/events"),
        ("GET", "/v1/events/stream"),
        ("GET", "/v1/tokens"),
        ("POST", "/v1/tokens"),
        ("DELETE", "/v1/tokens/{}"),
        ("GET", "/v1/workers"),
        ("POST", "/v1/workers/{}/drain"),
        ("DELETE", "/v1/workers/{}"),
        ("POST", "/v1/daemon/stop"),
        ("POST", "/v1/ops/{}"),
        ("GET", "/v1/metrics"),
        ("GET", "/v1/uplink"),
    ];

    /// A method and a path: mostly a route of the host with an arbitrary parameter, sometimes
    /// with another method, sometimes any path at all.
    fn target() -> impl Strategy<Value = (&'static str, String)> {
        let segment = proptest::collection::vec(
            proptest::sample::select(
                URI.iter()
                    .copied()
                    .filter(|b| *b != b'/')
                    .collect::<Vec<_>>(),
            ),
            0..24,
        )
        .prop_map(|bytes| bytes.into_iter().map(char::from).collect::<String>());
        let method = proptest::sample::select(vec![
            "GET", "POST", "DELETE", "PUT", "PATCH", "HEAD", "OPTIONS",
        ]);
        let route = (
            proptest::sample::select(ROUTES),
            segment,
            proptest::option::weighted(0.2, method.clone()),
        )
            .prop_map(|((method, path), segment, other)| {
                (other.unwrap_or(method), path.replace("{}", &segment))
            });
        let anything = (method, uri_text(32)).prop_map(|(m, p)| (m, format!("/{p}")));
        prop_oneof![4 => route, 1 => anything]
    }

    /// Bytes a header value may hold: visible ASCII, space, tab and obs-text.
    fn header_value() -> impl Strategy<Value = Vec<u8>> {
        prop_oneof![
            proptest::sample::select(vec![
                "websocket",
                "WebSocket",
                "h2c",
                "13",
                "8",
                "Upgrade",
                "dGhlIHNhbXBsZSBub25jZQ==",
                "w1",
                "bad.id",
                "NaN",
                "a%0Ab",
                "%",
                "",
            ])
            .prop_map(|v| v.as_bytes().to_vec()),
            proptest::collection::vec(prop_oneof![0x20u8..0x7f, Just(b'\t'), 0x80u8..=0xff], 0..40),
        ]
    }

    fn headers() -> impl Strategy<Value = Vec<(&'static str, Vec<u8>)>> {
        proptest::collection::vec(
            (
                proptest::sample::select(vec![
                    "idempotency-key",
                    "upgrade",
                    "connection",
                    "sec-websocket-version",
                    "sec-websocket-key",
                    "x-simlock-worker-id",
                    "x-simlock-worker-label",
                    "content-type",
                    "accept",
                ]),
                header_value(),
            ),
            0..5,
        )
    }

    fn body() -> impl Strategy<Value = Vec<u8>> {
        prop_oneof![
            Just(Vec::new()),
            proptest::sample::select(vec![
                "{}",
                "[]",
                "null",
                "{\"platform\": \"ios\", \"noWait\": true}",
                "{\"ttlMs\": 1e400}",
                "{\"kind\": \"leases\"}",
                "{",
            ])
            .prop_map(|b| b.as_bytes().to_vec()),
            proptest::collection::vec(any::<u8>(), 0..64),
        ]
    }

    pub(super) fn case() -> impl Strategy<Value = Case> {
        (
            any::<bool>(),
            target(),
            proptest::option::weighted(0.7, query()),
            prop_oneof![
                4 => Just(Credential::Agent),
                1 => Just(Credential::None),
                1 => Just(Credential::Garbage),
                1 => Just(Credential::Join),
            ],
            headers(),
            body(),
        )
            .prop_map(
                |(gateway, (method, path), query, token, headers, body)| Case {
                    gateway,
                    method,
                    path,
                    query,
                    token,
                    headers,
                    body,
                },
            )
    }
}

/// Panics anywhere in this process (a connection task's included) since the hook went in.
static PANICS: AtomicUsize = AtomicUsize::new(0);

/// Whether an answer is well-formed: an error is the contract's JSON error with the status of its
/// code (an unknown route's 404, a known path's 405 under another method, a refused WebSocket
/// version's 426); anything else is a known
/// success.
fn well_formed(case: &Case, answer: &Answer) -> Result<(), String> {
    let fail = |why: &str| Err(format!("{why}: {answer:?}"));
    match answer.status {
        101 | 200 | 201 | 204 => return Ok(()),
        400..=599 => {}
        _ => return fail("an unexpected status"),
    }
    if case.method == "HEAD" {
        return Ok(());
    }
    if answer.content_type != "application/json" {
        return fail("an error that is not JSON");
    }
    let Some(code) = answer.body["error"]["code"]
        .as_str()
        .and_then(ErrorCode::from_wire)
    else {
        return fail("an error without a contract code");
    };
    if !answer.body["error"]["message"].is_string() {
        return fail("an error without a message");
    }
    let status_of_code = match (answer.status, code) {
        (404 | 405, ErrorCode::UnknownRequest) | (426, ErrorCode::BadRequest) => answer.status,
        _ => code.http_status(),
    };
    if status_of_code != answer.status {
        return fail("a status that is not its code's");
    }
    Ok(())
}

#[test]
fn arbitrary_paths_queries_and_headers_get_a_well_formed_answer_from_both_daemons() {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let default_hook = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        PANICS.fetch_add(1, Ordering::SeqCst);
        default_hook(info);
    }));
    let (fleet, gateway, worker, gateway_agent, worker_agent) = runtime.block_on(async {
        let mut fleet = TestFleet::start(gateway_config()).await;
        let mut config = worker_config(1);
        config.daemon.http.enabled = Some(true);
        config.daemon.http.port = 0;
        fleet.add_worker(config).await;
        let gateway = fleet.gateway().running.http_addr().unwrap();
        let worker = fleet.worker(0).running.http_addr().unwrap();
        let (gateway_agent, _) = agent(&fleet.gateway().running.base.tokens);
        let (worker_agent, _) = agent(&fleet.worker(0).running.base.tokens);
        (fleet, gateway, worker, gateway_agent, worker_agent)
    });
    let join = fleet.join_token.clone();
    let config = proptest::test_runner::Config {
        cases: 2048,
        failure_persistence: None,
        ..proptest::test_runner::Config::default()
    };
    let mut runner = proptest::test_runner::TestRunner::new(config);
    let outcome = runner.run(&strategy::case(), |case| {
        let (addr, agent) = if case.gateway {
            (gateway, &gateway_agent)
        } else {
            (worker, &worker_agent)
        };
        let target = match &case.query {
            Some(query) => format!("{}?{query}", case.path),
            None => case.path.clone(),
        };
        let mut builder = http::Request::builder()
            .method(case.method)
            .uri(target.as_str())
            .header(http::header::HOST, "simlock");
        let secret = match case.token {
            Credential::None => None,
            Credential::Garbage => Some("slk_not-a-token".to_owned()),
            Credential::Agent => Some(agent.clone()),
            Credential::Join => Some(join.clone()),
        };
        if let Some(secret) = secret {
            builder = builder.header(http::header::AUTHORIZATION, format!("Bearer {secret}"));
        }
        for (name, value) in &case.headers {
            builder = builder.header(*name, http::HeaderValue::from_bytes(value).unwrap());
        }
        let request = builder
            .body(Full::new(Bytes::from(case.body.clone())))
            .map_err(|e| proptest::test_runner::TestCaseError::fail(format!("{target}: {e}")))?;
        let answer = runtime
            .block_on(try_send(addr, request))
            .map_err(|e| proptest::test_runner::TestCaseError::fail(format!("{case:?}: {e}")))?;
        well_formed(&case, &answer)
            .map_err(|e| proptest::test_runner::TestCaseError::fail(format!("{case:?}: {e}")))?;
        Ok(())
    });
    runtime.block_on(fleet.stop());
    if let Err(e) = outcome {
        panic!("{e}");
    }
    assert_eq!(PANICS.load(Ordering::SeqCst), 0, "something panicked");
}

/// `POST /v1/lease-requests` with `idempotency-key: key`, answered within the bound.
async fn keyed_request(addr: SocketAddr, token: &str, key: &str) -> Answer {
    let mut request = request(
        "POST",
        "/v1/lease-requests",
        Some(token),
        Some(&json!({"platform": "ios", "requesterId": "retrying"})),
    );
    request
        .headers_mut()
        .insert("idempotency-key", http::HeaderValue::from_str(key).unwrap());
    try_send(addr, request).await.unwrap()
}

/// A keyed lease request, then its retry (same key): both answered `201` in `state`.
async fn keyed_twice(addr: SocketAddr, token: &str, key: &str, state: &str) -> (Answer, Answer) {
    let first = keyed_request(addr, token, key).await;
    let again = keyed_request(addr, token, key).await;
    for answer in [&first, &again] {
        assert_eq!(answer.status, 201, "{answer:?}");
        assert_eq!(answer.body["request"]["state"], state, "{answer:?}");
    }
    (first, again)
}

/// A worker serving HTTP and a gateway with a worker of its own, each with two devices per
/// platform: the two daemons the lease-request resource's tests run against alike.
struct BothDaemons {
    worker: simlock_worker::RunningWorker,
    _dir: tempfile::TempDir,
    fleet: TestFleet,
}

impl BothDaemons {
    async fn start() -> Self {
        let (worker, _dir) = http_worker().await;
        let mut fleet = TestFleet::start(gateway_config()).await;
        fleet.add_worker(worker_config(2)).await;
        Self {
            worker,
            _dir,
            fleet,
        }
    }

    /// On each daemon, both iOS devices leased by agents of their own, so that a new iOS
    /// request waits: the daemon's address and a fresh agent token.
    async fn busy(&self) -> Vec<(SocketAddr, String)> {
        let mut busy = Vec::new();
        for (addr, tokens) in [
            (
                self.worker.running.http_addr().unwrap(),
                &self.worker.running.base.tokens,
            ),
            (
                self.fleet.gateway().running.http_addr().unwrap(),
                &self.fleet.gateway().running.base.tokens,
            ),
        ] {
            let ((a, _), (b, _), (c, _)) = (agent(tokens), agent(tokens), agent(tokens));
            lease_request(addr, &a, true).await;
            lease_request(addr, &b, true).await;
            busy.push((addr, c));
        }
        busy
    }

    async fn stop(self) {
        self.fleet.stop().await;
        self.worker.stop("test").await;
    }
}

/// Outside trial 21: an agent retrying a queued request with its idempotency key (its first
/// answer was lost) hears at once where the original stands, on a worker and on a gateway;
/// the retry used to hang until the original's state changed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retry_of_a_queued_request_answers_at_once_on_both_daemons() {
    let both = BothDaemons::start().await;
    // Both devices taken, so the keyed request waits.
    for (addr, a) in both.busy().await {
        let (first, again) = keyed_twice(addr, &a, "rep-1", "queued").await;
        assert_eq!(
            again.body["request"]["queuePosition"], first.body["request"]["queuePosition"],
            "{again:?}"
        );
        assert_ne!(again.body["request"]["id"], first.body["request"]["id"]);
    }
    both.stop().await;
}

/// Outside trial 22: a retry (same idempotency key) of a request that timed out in the queue is
/// answered `201` with that request's end, `failed` with `QUEUE_TIMEOUT`, as a retry of a
/// cancelled one is answered `cancelled`; it used to be refused `500` as if the retry itself had
/// failed. On a worker and on a gateway.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retry_of_a_request_that_timed_out_or_was_cancelled_answers_its_end() {
    let both = BothDaemons::start().await;
    // Both devices taken, so keyed requests wait.
    for (addr, c) in both.busy().await {
        let keyed = |key: &'static str, body: Value| {
            let mut request = request("POST", "/v1/lease-requests", Some(&c), Some(&body));
            request
                .headers_mut()
                .insert("idempotency-key", http::HeaderValue::from_static(key));
            request
        };
        let settle = |id: String| {
            let c = c.clone();
            simlock_e2e::relay::patient("the request's end", async move {
                loop {
                    let path = format!("/v1/lease-requests/{id}?wait=30");
                    let polled = send(addr, "GET", &path, Some(&c), None).await;
                    assert_eq!(polled.status, 200, "{polled:?}");
                    if ["failed", "cancelled"]
                        .contains(&polled.body["request"]["state"].as_str().unwrap())
                    {
                        return polled;
                    }
                }
            })
        };
        let body = json!({"platform": "ios", "requesterId": "late", "timeoutMs": 50});
        let first = try_send(addr, keyed("late-1", body.clone())).await.unwrap();
        assert_eq!(first.status, 201, "{first:?}");
        let ended = settle(first.body["request"]["id"].as_str().unwrap().to_owned()).await;
        assert_eq!(ended.body["request"]["state"], "failed", "{ended:?}");
        let again = try_send(addr, keyed("late-1", body)).await.unwrap();
        assert_eq!(again.status, 201, "{again:?}");
        assert_eq!(again.body["request"]["state"], "failed", "{again:?}");
        assert_eq!(
            again.body["request"]["error"]["code"], "QUEUE_TIMEOUT",
            "{again:?}"
        );

        let body = json!({"platform": "ios", "requesterId": "quitter"});
        let first = try_send(addr, keyed("quit-1", body.clone())).await.unwrap();
        assert_eq!(first.status, 201, "{first:?}");
        let id = first.body["request"]["id"].as_str().unwrap().to_owned();
        let path = format!("/v1/lease-requests/{id}");
        let cancelled = send(addr, "DELETE", &path, Some(&c), None).await;
        assert_eq!(cancelled.status, 204, "{cancelled:?}");
        settle(id).await;
        let again = try_send(addr, keyed("quit-1", body)).await.unwrap();
        assert_eq!(again.status, 201, "{again:?}");
        assert_eq!(again.body["request"]["state"], "cancelled", "{again:?}");
    }
    both.stop().await;
}

/// Outside trial 22: through a gateway, a retry of a request its worker is provisioning a
/// device for answers at once with the worker's last report, as on a worker; it used to wait
/// for the next stage.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retry_of_a_request_being_provisioned_answers_at_once_through_a_gateway() {
    let mut fleet = TestFleet::start(gateway_config()).await;
    let mut slow = worker_config(2);
    // Longer than the test: the request stays provisioning.
    slow.core.virtual_devices.provision_ms = 600_000;
    fleet.add_worker(slow).await;
    let gateway = fleet.gateway().running.http_addr().unwrap();
    let (a, _) = agent(&fleet.gateway().running.base.tokens);
    keyed_twice(gateway, &a, "prov-1", "provisioning").await;
    fleet.stop().await;
}

/// The events of `GET path` (an event stream that ends by itself), each its `data` as JSON,
/// read to the stream's end within the bound; `started` fires once the stream's head came.
async fn stream_events(
    addr: SocketAddr,
    path: String,
    token: String,
    started: tokio::sync::oneshot::Sender<()>,
) -> Vec<Value> {
    let exchange = async {
        let stream = tokio::net::TcpStream::connect(addr).await.unwrap();
        let (mut sender, connection) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
            .await
            .unwrap();
        tokio::spawn(connection);
        let response = sender
            .send_request(request("GET", &path, Some(&token), None))
            .await
            .unwrap();
        assert_eq!(response.status(), 200);
        let _ = started.send(());
        let bytes = response.into_body().collect().await.unwrap().to_bytes();
        String::from_utf8_lossy(&bytes)
            .lines()
            .filter_map(|line| line.strip_prefix("data: "))
            .map(|data| serde_json::from_str(data).unwrap())
            .collect::<Vec<Value>>()
    };
    tokio::time::timeout(PATIENCE, exchange)
        .await
        .expect("the stream ended within the bound")
}

/// Outside trial 24: a gateway's event stream ended a cancelled request with a view without
/// its `error` (its `GET` and a worker's stream had it). Every cancelled view carries it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cancelled_request_s_stream_ends_with_its_error_on_both_daemons() {
    let both = BothDaemons::start().await;
    for (addr, c) in both.busy().await {
        let queued = lease_request(addr, &c, false).await;
        let id = queued["id"].as_str().unwrap().to_owned();
        let (started, head) = tokio::sync::oneshot::channel();
        let events = tokio::spawn(stream_events(
            addr,
            format!("/v1/lease-requests/{id}/events"),
            c.clone(),
            started,
        ));
        head.await.unwrap();
        let deleted = send(
            addr,
            "DELETE",
            &format!("/v1/lease-requests/{id}"),
            Some(&c),
            None,
        )
        .await;
        assert_eq!(deleted.status, 204, "{deleted:?}");
        let events = events.await.unwrap();
        let last = events.last().expect("an event");
        assert_eq!(last["state"], "cancelled", "{events:?}");
        assert_eq!(last["error"]["code"], "CANCELLED", "{events:?}");
        let polled = send(
            addr,
            "GET",
            &format!("/v1/lease-requests/{id}"),
            Some(&c),
            None,
        )
        .await;
        assert_eq!(
            &polled.body["request"], last,
            "the stream's end is the request's view"
        );
    }
    both.stop().await;
}
