//! Session and client tests over a real unix socket pair (and, where time matters, an
//! in-memory pipe with paused time).

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    reason = "test helpers fail the test by panicking"
)]

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use futures::FutureExt;
use futures::future::BoxFuture;
use parking_lot::Mutex;
use serde_json::{Value, json};
use simlock_contract::push::Push;
use simlock_contract::{ContractError, ErrorCode, Hello, PROTOCOL_RANGE, ProtocolRange, Role};
use simlock_wire::{
    CallContext, CallEvent, Identity, Origin, Service, SessionConfig, Transport, WireClient, serve,
};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::net::UnixStream;
use tokio::net::unix::{OwnedReadHalf, OwnedWriteHalf};
use tokio::sync::Notify;

/// A service with a few test operations.
#[derive(Default)]
struct TestService {
    gates: Mutex<HashMap<String, Arc<Notify>>>,
    pushed: Arc<AtomicUsize>,
    closed_connections: AtomicUsize,
}

impl TestService {
    fn gate(&self, name: &str) -> Arc<Notify> {
        self.gates
            .lock()
            .entry(name.to_owned())
            .or_default()
            .clone()
    }
}

impl Service for TestService {
    fn greet(&self, _origin: Origin, hello: &Hello) -> Result<Identity, ContractError> {
        let role = match hello.credential.as_deref() {
            None => Role::Agent,
            Some("admin-secret") => Role::Admin,
            Some(_) => {
                return Err(ContractError::new(
                    ErrorCode::AdminAuthenticationFailed,
                    "Invalid admin credential",
                ));
            }
        };
        Ok(Identity {
            role,
            principal: hello
                .principal
                .clone()
                .unwrap_or_else(|| "anonymous".into()),
        })
    }

    fn dispatch(
        &self,
        ctx: CallContext,
        op: String,
        payload: Option<Value>,
    ) -> BoxFuture<'static, Result<Value, ContractError>> {
        let payload = payload.unwrap_or(Value::Null);
        match op.as_str() {
            "echo" => async move { Ok(payload) }.boxed(),
            "twice" => async move { Ok(json!({"a": payload["s"], "b": payload["s"]})) }.boxed(),
            "whoami" => {
                let identity = ctx.conn.identity();
                async move { Ok(json!({"principal": identity.map(|i| i.principal)})) }.boxed()
            }
            "wait" => {
                let gate = self.gate(payload["gate"].as_str().unwrap_or_default());
                async move {
                    gate.notified().await;
                    Ok(payload)
                }
                .boxed()
            }
            "pushy" => {
                let count = payload["count"].as_u64().unwrap_or(0);
                let pushed = self.pushed.clone();
                async move {
                    for _ in 0..count {
                        ctx.push(&Push::Started {
                            request_id: ctx.id.clone(),
                        })
                        .await
                        .map_err(|_| ContractError::connection_lost())?;
                        pushed.fetch_add(1, Ordering::SeqCst);
                    }
                    Ok(json!({"pushed": count}))
                }
                .boxed()
            }
            "daemon.stop" => async move { Ok(json!({"stopping": true})) }.boxed(),
            _ => async move {
                Err(ContractError::new(
                    ErrorCode::UnknownRequest,
                    format!("Unknown request type: {op}"),
                ))
            }
            .boxed(),
        }
    }

    fn closed(&self, _conn: &Arc<simlock_wire::Connection>) {
        self.closed_connections.fetch_add(1, Ordering::SeqCst);
    }
}

fn config() -> SessionConfig {
    SessionConfig {
        range: PROTOCOL_RANGE,
        version: "test".into(),
    }
}

/// The raw client end of a socket pair whose server end runs a session.
struct Raw {
    reader: BufReader<OwnedReadHalf>,
    writer: OwnedWriteHalf,
}

impl Raw {
    async fn send_line(&mut self, line: &str) {
        self.writer.write_all(line.as_bytes()).await.unwrap();
        self.writer.write_all(b"\n").await.unwrap();
    }

    async fn send(&mut self, frame: Value) {
        self.send_line(&frame.to_string()).await;
    }

    /// The next line, or `None` at end of stream. Bounded so a broken session fails, not hangs.
    async fn recv(&mut self) -> Option<Value> {
        let mut line = String::new();
        let n = tokio::time::timeout(Duration::from_secs(30), self.reader.read_line(&mut line))
            .await
            .expect("the session answered within the bound")
            .unwrap();
        (n > 0).then(|| serde_json::from_str(&line).unwrap())
    }

    async fn hello(&mut self) {
        self.send(
            json!({"id": 0, "type": "hello", "payload": {"protocolVersion": 2, "principal": "p1"}}),
        )
        .await;
        let reply = self.recv().await.unwrap();
        assert_eq!(reply["ok"], true, "{reply}");
    }
}

fn start(service: Arc<TestService>) -> Raw {
    let (server, client) = UnixStream::pair().unwrap();
    let (r, w) = server.into_split();
    tokio::spawn(serve(
        Transport::server_io(r, w),
        Origin::Socket,
        service,
        config(),
    ));
    let (r, w) = client.into_split();
    Raw {
        reader: BufReader::new(r),
        writer: w,
    }
}

#[tokio::test]
async fn a_bad_frame_answers_bad_frame_with_a_null_id_and_the_connection_lives_on() {
    let mut raw = start(Arc::default());
    for bad in ["{nope", "[1,2]", r#"{"type":"echo"}"#, r#"{"id":1}"#] {
        raw.send_line(bad).await;
        let reply = raw.recv().await.unwrap();
        assert_eq!(reply["id"], Value::Null);
        assert_eq!(reply["ok"], false);
        assert_eq!(reply["error"]["code"], "BAD_FRAME", "{bad}");
    }
    raw.hello().await;
    raw.send(json!({"id": 2, "type": "echo", "payload": {"a": 1}}))
        .await;
    assert_eq!(
        raw.recv().await.unwrap(),
        json!({"id": 2, "ok": true, "payload": {"a": 1}})
    );
}

#[tokio::test]
async fn a_call_line_at_1_mib_is_read_and_one_past_it_answers_bad_frame() {
    let mut raw = start(Arc::default());
    raw.hello().await;
    let max = simlock_contract::bounds::MAX_CALL_LINE;
    let frame = |pad: usize| {
        format!(
            r#"{{"id":5,"type":"echo","payload":{{"pad":"{}"}}}}"#,
            "x".repeat(pad)
        )
    };
    let overhead = frame(0).len();
    let at_limit = frame(max - overhead);
    assert_eq!(at_limit.len(), max);
    raw.send_line(&at_limit).await;
    let reply = raw.recv().await.unwrap();
    assert_eq!(reply["ok"], true);
    assert_eq!(
        reply["payload"]["pad"].as_str().unwrap().len(),
        max - overhead
    );
    raw.send_line(&frame(max - overhead + 1)).await;
    let reply = raw.recv().await.unwrap();
    assert_eq!(reply["id"], Value::Null);
    assert_eq!(reply["error"]["code"], "BAD_FRAME");
    raw.send(json!({"id": 6, "type": "echo", "payload": {}}))
        .await;
    assert_eq!(raw.recv().await.unwrap()["id"], 6);
}

#[tokio::test]
async fn a_first_call_that_is_not_hello_answers_handshake_required_and_closes() {
    let service = Arc::new(TestService::default());
    let mut raw = start(service.clone());
    raw.send(json!({"id": 1, "type": "echo", "payload": {}}))
        .await;
    let reply = raw.recv().await.unwrap();
    assert_eq!(reply["id"], 1);
    assert_eq!(reply["error"]["code"], "HANDSHAKE_REQUIRED");
    assert_eq!(reply["error"]["message"], "First message must be hello");
    assert_eq!(
        raw.recv().await,
        None,
        "the session closes after HANDSHAKE_REQUIRED"
    );
    assert_eq!(service.closed_connections.load(Ordering::SeqCst), 1);
}

#[tokio::test]
async fn a_bad_hello_or_credential_is_refused_and_closes() {
    let mut raw = start(Arc::default());
    raw.send(json!({"id": 1, "type": "hello", "payload": {"clientVersion": "x"}}))
        .await;
    let reply = raw.recv().await.unwrap();
    assert_eq!(reply["error"]["code"], "BAD_REQUEST");
    assert_eq!(raw.recv().await, None);

    let mut raw = start(Arc::default());
    raw.send(
        json!({"id": 1, "type": "hello", "payload": {"protocolVersion": 2, "credential": "guess"}}),
    )
    .await;
    let reply = raw.recv().await.unwrap();
    assert_eq!(reply["error"]["code"], "ADMIN_AUTHENTICATION_FAILED");
    assert_eq!(raw.recv().await, None);
}

#[tokio::test]
async fn a_mismatched_range_stays_open_and_refuses_everything_but_daemon_stop() {
    let mut raw = start(Arc::default());
    raw.send(json!({"id": 1, "type": "hello", "payload": {"protocolRange": {"min": 3, "max": 4}}}))
        .await;
    let reply = raw.recv().await.unwrap();
    assert_eq!(reply["error"]["code"], "PROTOCOL_VERSION_UNSUPPORTED");
    assert_eq!(
        reply["error"]["details"]["client"],
        json!({"min": 3, "max": 4})
    );
    assert_eq!(
        reply["error"]["details"]["daemon"],
        json!({"min": 2, "max": 2})
    );
    raw.send(json!({"id": 2, "type": "echo", "payload": {}}))
        .await;
    let reply = raw.recv().await.unwrap();
    assert_eq!(reply["id"], 2);
    assert_eq!(reply["error"]["code"], "PROTOCOL_VERSION_UNSUPPORTED");
    raw.send(json!({"id": 3, "type": "daemon.stop", "payload": {}}))
        .await;
    assert_eq!(
        raw.recv().await.unwrap(),
        json!({"id": 3, "ok": true, "payload": {"stopping": true}})
    );
}

#[tokio::test]
async fn hello_negotiates_the_highest_common_version_and_reports_the_identity() {
    let mut raw = start(Arc::default());
    raw.send(json!({"id": "h", "type": "hello", "payload": {"protocolRange": {"min": 1, "max": 9}, "principal": "agent-7", "credential": "admin-secret"}})).await;
    let reply = raw.recv().await.unwrap();
    assert_eq!(reply["id"], "h");
    assert_eq!(reply["payload"]["protocolVersion"], 2);
    assert_eq!(reply["payload"]["role"], "admin");
    assert_eq!(reply["payload"]["principal"], "agent-7");
    raw.send(json!({"id": 2, "type": "hello", "payload": {"protocolVersion": 2}}))
        .await;
    assert_eq!(raw.recv().await.unwrap()["error"]["code"], "BAD_REQUEST");
}

#[tokio::test]
async fn two_concurrent_calls_are_answered_out_of_order() {
    let service = Arc::new(TestService::default());
    let mut raw = start(service.clone());
    raw.hello().await;
    raw.send(json!({"id": 1, "type": "wait", "payload": {"gate": "a"}}))
        .await;
    raw.send(json!({"id": 2, "type": "echo", "payload": {"second": true}}))
        .await;
    assert_eq!(
        raw.recv().await.unwrap()["id"],
        2,
        "the second call answers while the first waits"
    );
    service.gate("a").notify_one();
    assert_eq!(
        raw.recv().await.unwrap(),
        json!({"id": 1, "ok": true, "payload": {"gate": "a"}})
    );
}

#[tokio::test]
async fn pushes_carry_their_call_id_and_reach_only_their_own_call() {
    let mut raw = start(Arc::default());
    raw.hello().await;
    raw.send(json!({"id": 10, "type": "pushy", "payload": {"count": 3}}))
        .await;
    raw.send(json!({"id": 11, "type": "pushy", "payload": {"count": 5}}))
        .await;
    let mut seen: HashMap<u64, usize> = HashMap::new();
    let mut replies = 0;
    while replies < 2 {
        let frame = raw.recv().await.unwrap();
        if frame.get("push").is_some() {
            assert_eq!(frame["push"], "started");
            *seen
                .entry(frame["payload"]["requestId"].as_u64().unwrap())
                .or_default() += 1;
        } else {
            let id = frame["id"].as_u64().unwrap();
            let expected = if id == 10 { 3 } else { 5 };
            assert_eq!(
                seen.get(&id).copied().unwrap_or(0),
                expected,
                "every push of call {id} precedes its reply"
            );
            replies += 1;
        }
    }

    // Through the client, each call's handle sees only its own pushes.
    let (server, client) = UnixStream::pair().unwrap();
    let (r, w) = server.into_split();
    tokio::spawn(serve(
        Transport::server_io(r, w),
        Origin::Socket,
        Arc::new(TestService::default()),
        config(),
    ));
    let (r, w) = client.into_split();
    let (client, _unsolicited) = WireClient::new(Transport::client_io(r, w));
    client.hello(&hello()).await.unwrap();
    let mut a = client.begin("pushy", json!({"count": 4}), 8).await.unwrap();
    let mut b = client.begin("pushy", json!({"count": 7}), 8).await.unwrap();
    let (count_a, count_b) = tokio::join!(count_pushes(&mut a), count_pushes(&mut b));
    assert_eq!((count_a, count_b), (4, 7));
}

async fn count_pushes(handle: &mut simlock_wire::CallHandle) -> usize {
    let mut count = 0;
    loop {
        match handle.next().await {
            CallEvent::Push(push) => {
                assert_eq!(
                    push.request_id().and_then(|id| id.as_u64()),
                    Some(handle.id())
                );
                count += 1;
            }
            CallEvent::Reply(reply) => {
                let reply = simlock_wire::decode_value(&reply.unwrap()).unwrap();
                assert_eq!(reply["pushed"], count);
                return count;
            }
        }
    }
}

fn hello() -> Hello {
    Hello {
        client_version: None,
        protocol_version: None,
        protocol_range: Some(ProtocolRange { min: 2, max: 2 }),
        principal: Some("tester".into()),
        credential: None,
    }
}

#[tokio::test]
async fn the_client_reads_lines_longer_than_the_servers_cap() {
    let (server, client) = UnixStream::pair().unwrap();
    let (r, w) = server.into_split();
    tokio::spawn(serve(
        Transport::server_io(r, w),
        Origin::Socket,
        Arc::new(TestService::default()),
        config(),
    ));
    let (r, w) = client.into_split();
    let (client, _) = WireClient::new(Transport::client_io(r, w));
    client.hello(&hello()).await.unwrap();
    // The call line stays under 1 MiB; the reply carries it twice, past 1 MiB.
    let big = "y".repeat(700 * 1024);
    let reply = client.call_value("twice", json!({"s": big})).await.unwrap();
    assert_eq!(reply["a"].as_str().unwrap().len(), big.len());
    assert_eq!(reply["b"].as_str().unwrap().len(), big.len());
}

#[tokio::test]
async fn the_client_sends_a_call_line_of_1_mib_and_refuses_one_past_it_without_sending_it() {
    let (server, client) = UnixStream::pair().unwrap();
    let (r, w) = server.into_split();
    tokio::spawn(serve(
        Transport::server_io(r, w),
        Origin::Socket,
        Arc::new(TestService::default()),
        config(),
    ));
    let (r, w) = client.into_split();
    let (client, _) = WireClient::new(Transport::client_io(r, w));
    client.hello(&hello()).await.unwrap();
    // The calls after hello are ids 2 and 3: their lines, newline left out, are `overhead`
    // bytes beside the padding.
    let max = simlock_contract::bounds::MAX_CALL_LINE;
    let overhead = simlock_contract::frame::to_line(&simlock_contract::CallOut {
        id: simlock_contract::FrameId::from(2),
        op: "echo",
        payload: &json!({"s": ""}),
    })
    .unwrap()
    .len()
        - 1;
    let at_limit = "y".repeat(max - overhead);
    let echoed = client
        .call_value("echo", json!({"s": at_limit}))
        .await
        .unwrap();
    assert_eq!(echoed["s"].as_str().map(str::len), Some(max - overhead));
    // Refused before it is sent: a line the server refuses would be answered with no id, and
    // the call would wait for ever.
    let one_past = client.call_value("echo", json!({"s": "y".repeat(max - overhead + 1)}));
    let err = tokio::time::timeout(Duration::from_secs(30), one_past)
        .await
        .expect("refused at once")
        .unwrap_err();
    assert_eq!(err.code, ErrorCode::BadRequest);
    assert!(err.message.starts_with("payload:"), "{}", err.message);
    // The connection is untouched.
    assert_eq!(
        client.call_value("echo", json!({"ok": 1})).await.unwrap(),
        json!({"ok": 1})
    );
}

#[tokio::test]
async fn losing_the_connection_fails_every_pending_call() {
    let service = Arc::new(TestService::default());
    let (server, client) = UnixStream::pair().unwrap();
    let (r, w) = server.into_split();
    let session = tokio::spawn(serve(
        Transport::server_io(r, w),
        Origin::Socket,
        service,
        config(),
    ));
    let (r, w) = client.into_split();
    let (client, _) = WireClient::new(Transport::client_io(r, w));
    client.hello(&hello()).await.unwrap();
    let first = client
        .begin("wait", json!({"gate": "never"}), 1)
        .await
        .unwrap();
    let second = client
        .begin("wait", json!({"gate": "never"}), 1)
        .await
        .unwrap();
    session.abort();
    let (a, b) = tokio::join!(first.finish(), second.finish());
    assert_eq!(a.unwrap_err().code, ErrorCode::DaemonConnectionLost);
    assert_eq!(b.unwrap_err().code, ErrorCode::DaemonConnectionLost);
    assert_eq!(
        client.call_value("echo", json!({})).await.unwrap_err().code,
        ErrorCode::DaemonConnectionLost
    );
}

/// Outside trial 21: a connection that never says `hello` is closed after
/// [`simlock_wire::HELLO_TIMEOUT`], told why; one that said it may idle for longer.
#[tokio::test(start_paused = true)]
async fn a_connection_without_hello_is_closed_at_the_bound_and_a_greeted_one_may_idle() {
    let service = Arc::new(TestService::default());
    let (silent_server, silent_client) = tokio::io::duplex(4096);
    let (greeted_server, greeted_client) = tokio::io::duplex(4096);
    for server in [silent_server, greeted_server] {
        let (r, w) = tokio::io::split(server);
        tokio::spawn(serve(
            Transport::server_io(r, w),
            Origin::Socket,
            service.clone(),
            config(),
        ));
    }
    let (r, mut w) = tokio::io::split(greeted_client);
    let mut greeted = BufReader::new(r);
    w.write_all(b"{\"id\":0,\"type\":\"hello\",\"payload\":{\"protocolVersion\":2}}\n")
        .await
        .unwrap();
    let mut line = String::new();
    greeted.read_line(&mut line).await.unwrap();
    assert!(line.contains("\"ok\":true"), "{line}");

    let (r, _silent_w) = tokio::io::split(silent_client);
    let mut silent = BufReader::new(r);
    let before = tokio::time::Instant::now();
    line.clear();
    silent.read_line(&mut line).await.unwrap();
    assert_eq!(before.elapsed(), simlock_wire::HELLO_TIMEOUT);
    let reply: Value = serde_json::from_str(&line).unwrap();
    assert_eq!(reply["error"]["code"], "HANDSHAKE_REQUIRED", "{reply}");
    line.clear();
    assert_eq!(silent.read_line(&mut line).await.unwrap(), 0, "closed");

    // Long past the bound, the greeted connection still answers.
    tokio::time::sleep(simlock_wire::HELLO_TIMEOUT * 10).await;
    w.write_all(b"{\"id\":1,\"type\":\"echo\",\"payload\":{\"a\":1}}\n")
        .await
        .unwrap();
    line.clear();
    greeted.read_line(&mut line).await.unwrap();
    assert!(
        line.contains("\"id\":1") && line.contains("\"ok\":true"),
        "{line}"
    );
}

/// Review: a client that sends bad lines before `hello` and never reads the answers is not
/// waited for past the greeting's deadline: the session closes.
#[tokio::test(start_paused = true)]
async fn a_client_that_sends_bad_lines_and_never_reads_is_closed_at_the_hello_bound() {
    let (server, client) = tokio::io::duplex(64);
    let (r, w) = tokio::io::split(server);
    let session = tokio::spawn(serve(
        Transport::server_io(r, w),
        Origin::Socket,
        Arc::new(TestService::default()),
        config(),
    ));
    let (_unread, mut w) = tokio::io::split(client);
    tokio::spawn(async move {
        for _ in 0..10_000 {
            if w.write_all(b"not json\n").await.is_err() {
                return;
            }
        }
    });
    tokio::time::timeout(simlock_wire::HELLO_TIMEOUT * 2, session)
        .await
        .expect("the session ended at the bound")
        .unwrap();
}

#[tokio::test(start_paused = true)]
async fn a_push_waits_while_the_reader_does_not_read() {
    let service = Arc::new(TestService::default());
    let pushed = service.pushed.clone();
    let (server, client) = tokio::io::duplex(4096);
    let (r, w) = tokio::io::split(server);
    tokio::spawn(serve(
        Transport::server_io(r, w),
        Origin::Socket,
        service,
        config(),
    ));
    let (r, mut w) = tokio::io::split(client);
    w.write_all(b"{\"id\":0,\"type\":\"hello\",\"payload\":{\"protocolVersion\":2}}\n")
        .await
        .unwrap();
    w.write_all(b"{\"id\":1,\"type\":\"pushy\",\"payload\":{\"count\":10000}}\n")
        .await
        .unwrap();
    // With time paused, the clock moves only once every task is blocked: the pusher is stuck.
    tokio::time::sleep(Duration::from_secs(1)).await;
    let stuck_at = pushed.load(Ordering::SeqCst);
    assert!(
        stuck_at < 10_000,
        "pushes were queued without bound ({stuck_at})"
    );
    assert!(
        stuck_at >= 64,
        "the writer queue should absorb some pushes ({stuck_at})"
    );
    // Reading everything lets the pusher finish.
    let mut reader = BufReader::new(r);
    let mut line = String::new();
    loop {
        line.clear();
        reader.read_line(&mut line).await.unwrap();
        if line.contains("\"pushed\":10000") {
            break;
        }
    }
    assert_eq!(pushed.load(Ordering::SeqCst), 10_000);
}

/// A daemon that answers calls and hangs up at once (a refused `hello` does): each call hears
/// its answer, not `DAEMON_CONNECTION_LOST`, even the one whose line was still queued when the
/// connection ended.
#[tokio::test]
async fn a_call_answered_just_before_the_daemon_hangs_up_gets_its_answer() {
    use simlock_contract::frame::{FrameId, Reply};
    // The daemon reads nothing until it has answered: the client's writes back up through a
    // 16-byte pipe into the client's queue, and the last call waits to be queued.
    let (client_write, mut daemon_read) = tokio::io::duplex(16);
    let (mut daemon_write, client_read) = tokio::io::duplex(1 << 20);
    let (client, _unsolicited) = WireClient::new(Transport::client_io(client_read, client_write));
    const CALLS: u64 = 80;
    let mut calls = Vec::new();
    for _ in 0..CALLS {
        let client = client.clone();
        calls.push(tokio::spawn(async move {
            client.call_value("echo", json!({})).await
        }));
    }
    // Every call has started (ids 1..=CALLS) and the last ones wait for room in the queue.
    for _ in 0..10 {
        tokio::task::yield_now().await;
    }
    let refused = ContractError::new(ErrorCode::AdminAuthenticationFailed, "no such token");
    for id in 1..=CALLS {
        let reply = Reply::err(Some(FrameId::from(id)), &refused);
        let mut line = serde_json::to_vec(&reply).unwrap();
        line.push(b'\n');
        daemon_write.write_all(&line).await.unwrap();
    }
    drop(daemon_write);
    // The client reads every answer and the end before its writer gets room again.
    for _ in 0..10 {
        tokio::task::yield_now().await;
    }
    assert!(client.is_closed());
    tokio::spawn(async move {
        let mut sink = Vec::new();
        let _ = tokio::io::AsyncReadExt::read_to_end(&mut daemon_read, &mut sink).await;
    });
    for (n, call) in calls.into_iter().enumerate() {
        let outcome = call.await.unwrap();
        assert_eq!(
            outcome.unwrap_err().code,
            ErrorCode::AdminAuthenticationFailed,
            "call {n}"
        );
    }
}
