//! A small HTTP client for the fake's tests: whole-body requests, JSON-RPC calls, and streamed
//! request bodies.

#![allow(
    dead_code,
    unreachable_pub,
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    reason = "shared by several test binaries, each using part; tests fail by panicking"
)]

use std::convert::Infallible;

use agent_device_fake::FakeAgentDevice;
use bytes::Bytes;
use futures::Stream;
use http::{HeaderMap, Method, Request, StatusCode};
use http_body_util::combinators::UnsyncBoxBody;
use http_body_util::{BodyExt, Full, StreamBody};
use hyper::body::Frame;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use serde_json::{Value, json};

pub type Body = UnsyncBoxBody<Bytes, std::io::Error>;

/// An answer: status, headers, body.
#[derive(Debug)]
pub struct Answer {
    pub status: StatusCode,
    pub headers: HeaderMap,
    pub body: Bytes,
}

impl Answer {
    pub fn json(&self) -> Value {
        serde_json::from_slice(&self.body)
            .unwrap_or_else(|e| panic!("not JSON ({e}): {:?}", String::from_utf8_lossy(&self.body)))
    }

    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }

    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).and_then(|v| v.to_str().ok())
    }
}

pub fn client() -> Client<HttpConnector, Body> {
    Client::builder(TokioExecutor::new()).build_http()
}

pub fn full(bytes: impl Into<Bytes>) -> Body {
    Full::new(bytes.into())
        .map_err(|never: Infallible| match never {})
        .boxed_unsync()
}

/// A body sent as chunks, without a length (`transfer-encoding: chunked`).
pub fn chunked<S>(chunks: S) -> Body
where
    S: Stream<Item = Result<Bytes, std::io::Error>> + Send + 'static,
{
    use futures::StreamExt as _;
    StreamBody::new(chunks.map(|chunk| chunk.map(Frame::data))).boxed_unsync()
}

/// Sends a request; `Err` when the connection failed or closed without an answer.
pub async fn try_send(
    method: Method,
    url: &str,
    headers: &[(&str, &str)],
    body: Body,
) -> Result<Answer, hyper_util::client::legacy::Error> {
    let mut request = Request::builder().method(method).uri(url);
    for (name, value) in headers {
        request = request.header(*name, *value);
    }
    let response = client().request(request.body(body).unwrap()).await?;
    let (parts, body) = response.into_parts();
    let body = body
        .collect()
        .await
        .map(|c| c.to_bytes())
        .unwrap_or_default();
    Ok(Answer {
        status: parts.status,
        headers: parts.headers,
        body,
    })
}

pub async fn send(method: Method, url: &str, headers: &[(&str, &str)], body: Body) -> Answer {
    try_send(method, url, headers, body)
        .await
        .unwrap_or_else(|e| panic!("{url}: {e}"))
}

pub async fn get(fake: &FakeAgentDevice, path: &str) -> Answer {
    let auth = format!("Bearer {}", fake.token());
    send(
        Method::GET,
        &format!("{}{path}", fake.base_url()),
        &[("authorization", &auth)],
        full(Bytes::new()),
    )
    .await
}

/// A JSON body sent with the daemon token in both headers, as the CLI sends it.
pub async fn post_json(fake: &FakeAgentDevice, path: &str, body: &Value) -> Answer {
    let auth = format!("Bearer {}", fake.token());
    send(
        Method::POST,
        &format!("{}{path}", fake.base_url()),
        &[
            ("authorization", &auth),
            ("x-agent-device-token", fake.token()),
            ("content-type", "application/json"),
        ],
        full(body.to_string()),
    )
    .await
}

/// A JSON-RPC call with the token in the headers.
pub async fn rpc(fake: &FakeAgentDevice, method: &str, params: Value) -> Answer {
    post_json(
        fake,
        "/rpc",
        &json!({"jsonrpc":"2.0","id":"r1","method":method,"params":params}),
    )
    .await
}

/// `agent_device.command`.
pub async fn command(fake: &FakeAgentDevice, params: Value) -> Answer {
    rpc(fake, "agent_device.command", params).await
}

/// The `result.data` of a successful RPC.
pub fn data(answer: &Answer) -> Value {
    assert_eq!(answer.status, StatusCode::OK, "{}", answer.text());
    answer.json()["result"]["data"].clone()
}

/// The `error.data` of a failed RPC.
pub fn error_data(answer: &Answer) -> Value {
    answer.json()["error"]["data"].clone()
}

/// Allocates a lease and answers its id.
pub async fn allocate(fake: &FakeAgentDevice, params: Value) -> String {
    let answer = rpc(fake, "agent_device.lease.allocate", params).await;
    data(&answer)["lease"]["leaseId"]
        .as_str()
        .unwrap()
        .to_owned()
}

/// The lower-case hex SHA-256 of `bytes`.
pub fn sha256(bytes: &[u8]) -> String {
    use sha2::Digest as _;
    sha2::Sha256::digest(bytes)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// Waits until `condition` holds, yielding between looks; fails after 30 s (a bound for a
/// broken test, not a speed target).
pub async fn eventually(what: &str, mut condition: impl FnMut() -> bool) {
    let wait = async {
        while !condition() {
            tokio::task::yield_now().await;
        }
    };
    if tokio::time::timeout(std::time::Duration::from_secs(30), wait)
        .await
        .is_err()
    {
        panic!("timed out waiting until {what}");
    }
}
