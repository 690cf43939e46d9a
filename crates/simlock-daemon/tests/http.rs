//! The HTTP host's own bounds and authentication, over a real loopback listener.

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    reason = "tests fail by panicking"
)]

use std::sync::Arc;

use serde_json::{Value, json};
use simlock_contract::model::TokenRole;
use simlock_daemon::clock::TokioClock;
use simlock_daemon::events::EventBus;
use simlock_daemon::http::body::MAX_JSON_BODY;
use simlock_daemon::http::requests::RequestBook;
use simlock_daemon::http::{HttpApp, bind, serve_http};
use simlock_daemon::metrics::Metrics;
use simlock_daemon::pipeline::{Greeter, Pipeline, Router, Shutdown, StartupGate};
use simlock_daemon::presence::Presence;
use simlock_daemon::store::Database;
use simlock_daemon::tokens::{self, TokenStore};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio_util::sync::CancellationToken;

struct NoAdmin;

impl Greeter for NoAdmin {
    fn is_admin_secret(&self, _: &str) -> bool {
        false
    }

    fn default_principal(&self) -> String {
        "local".into()
    }
}

struct Host {
    addr: String,
    tokens: Arc<TokenStore>,
    stop: CancellationToken,
}

async fn host() -> Host {
    let clock = TokioClock::system().shared();
    let store = TokenStore::open(Database::open_in_memory().unwrap(), clock.clone()).unwrap();
    let mut router = Router::new();
    tokens::register(&mut router, &store);
    let pipeline = Arc::new(Pipeline::new(
        router,
        StartupGate::ready(),
        Shutdown::new(),
        "test".into(),
        Arc::new(NoAdmin),
        Presence::new(),
    ));
    let app = Arc::new(HttpApp {
        pipeline,
        tokens: store.clone(),
        bus: EventBus::new(10, clock.clone()),
        clock: clock.clone(),
        requests: RequestBook::new(clock, 1000, 10),
        metrics: Metrics::new(),
        mounts: Vec::new(),
    });
    let listener = bind("127.0.0.1", 0).await.unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    let stop = CancellationToken::new();
    serve_http(listener, app, None, stop.clone());
    Host {
        addr,
        tokens: store,
        stop,
    }
}

/// One HTTP/1.1 exchange with `Connection: close`: the status and the body.
async fn exchange(
    addr: &str,
    method: &str,
    path: &str,
    token: Option<&str>,
    body: &[u8],
) -> (u16, String) {
    let mut stream = tokio::net::TcpStream::connect(addr).await.unwrap();
    let mut head = format!(
        "{method} {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Length: {}\r\n",
        body.len()
    );
    if let Some(token) = token {
        head.push_str(&format!("Authorization: Bearer {token}\r\n"));
    }
    head.push_str("\r\n");
    stream.write_all(head.as_bytes()).await.unwrap();
    // The server may answer before reading a refused body; a reset write is fine then.
    let _ = stream.write_all(body).await;
    let mut raw = Vec::new();
    let _ = stream.read_to_end(&mut raw).await;
    let text = String::from_utf8_lossy(&raw).into_owned();
    let (head, rest) = text.split_once("\r\n\r\n").expect("a response");
    (
        head.split_whitespace().nth(1).unwrap().parse().unwrap(),
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
