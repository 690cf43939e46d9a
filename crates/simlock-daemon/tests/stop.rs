//! A stopping daemon ends its open event streams at once, each with a last event, instead of
//! leaving them to the drain deadline. Time is paused for the stop: the stop and every stream end
//! while the tokio clock has not moved, so nothing waited on a timer.

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    reason = "tests fail by panicking"
)]

use serde_json::Value;
use simlock_contract::ids::{DeviceId, LeaseId};
use simlock_contract::model::{LeaseGrant, LeaseRecord, Mode, TokenRole};
use simlock_contract::ops::{DeviceExec, ExecOutput, LeaseGet, LeaseGetOutput, LeaseRequest};
use simlock_contract::push::Progress;
use simlock_contract::{ContractError, Push};
use simlock_daemon::config::DaemonConfig;
use simlock_daemon::home::Home;
use simlock_daemon::http::DRAIN_GRACE;
use simlock_daemon::runtime::Base;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

const LEASE: &str = "lse_0123456789abcdef0123456789abcdef";

fn lease_of(owner: &str) -> LeaseRecord {
    LeaseRecord {
        id: LeaseId::from_raw(LEASE),
        device_id: DeviceId::from_raw("dev_1"),
        requester_id: owner.to_owned(),
        owner_id: owner.to_owned(),
        granted_at: 0,
        ttl_ms: 60_000,
        ttl_deadline: 60_000,
        last_renewed_at: 0,
        access: None,
        id_chosen_by_requester: false,
        worker: None,
        worker_id: None,
    }
}

/// Opens a request on a new connection and reads until its head (and, for a stream, the bytes
/// already sent) arrived: everything up to `until`.
async fn open(addr: &str, head: &str, until: &str) -> (TcpStream, String) {
    let mut stream = TcpStream::connect(addr).await.unwrap();
    stream.write_all(head.as_bytes()).await.unwrap();
    let mut seen = Vec::new();
    let mut buf = [0u8; 4096];
    while !String::from_utf8_lossy(&seen).contains(until) {
        let n = stream.read(&mut buf).await.unwrap();
        assert!(
            n > 0,
            "the connection closed early: {}",
            String::from_utf8_lossy(&seen)
        );
        seen.extend_from_slice(&buf[..n]);
    }
    (stream, String::from_utf8_lossy(&seen).into_owned())
}

/// Reads what is left until the daemon closes the connection.
async fn rest(mut stream: TcpStream) -> String {
    let mut raw = Vec::new();
    let _ = stream.read_to_end(&mut raw).await;
    String::from_utf8_lossy(&raw).into_owned()
}

fn get(path: &str, token: &str) -> String {
    format!("GET {path} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {token}\r\n\r\n")
}

fn post(path: &str, token: &str, body: &str) -> String {
    format!(
        "POST {path} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {token}\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )
}

#[tokio::test]
async fn a_stop_ends_every_open_stream_at_once_with_a_last_event() {
    let dir = tempfile::tempdir().unwrap();
    let mut config = DaemonConfig::default();
    config.http.port = 0;
    let base = Base::open(
        Home::at(dir.path().join("home")),
        config,
        Mode::Worker,
        "test".into(),
        None,
    )
    .unwrap();
    let (operator, _) = base.tokens.create(TokenRole::Operator, None).unwrap();
    let (agent, agent_record) = base.tokens.create(TokenRole::Agent, None).unwrap();
    let owner = agent_record.id.to_string();
    let mut router = base.router();
    // A lease the agent owns, a request that stays queued and an exec that never ends.
    router.handle::<LeaseGet, _, _>(move |_, _| {
        let lease = lease_of(&owner);
        async move { Ok(LeaseGetOutput { lease }) }
    });
    router.handle::<LeaseRequest, _, _>(|ctx, _| async move {
        let queued = Push::Progress {
            request_id: ctx.request_id().clone(),
            progress: Progress::queued(1),
        };
        ctx.push(queued).await;
        std::future::pending::<Result<LeaseGrant, ContractError>>().await
    });
    router.handle::<DeviceExec, _, _>(|ctx, _| async move {
        let started = Push::Started {
            request_id: ctx.request_id().clone(),
        };
        ctx.push(started).await;
        std::future::pending::<Result<ExecOutput, ContractError>>().await
    });
    let running = base
        .serve(
            router,
            simlock_daemon::runtime::Listen::SocketAndHttp,
            Vec::new(),
        )
        .await
        .unwrap();
    running.started();
    let addr = running.http_addr().unwrap().to_string();

    let (events, _) = open(&addr, &get("/v1/events/stream", &operator), "\r\n\r\n").await;
    let (_, created) = open(
        &addr,
        &post("/v1/lease-requests", &agent, r#"{"platform": "ios"}"#),
        "\"queued\"",
    )
    .await;
    let request_id = created
        .split("\"id\":\"")
        .nth(1)
        .and_then(|rest| rest.split('"').next())
        .unwrap_or_else(|| panic!("no request id in {created}"))
        .to_owned();
    // A long-poll that would wait a minute. It is sent before the streams below are opened, so
    // the host is waiting in it by the time they answered (one thread serves them in order).
    let mut long_poll = TcpStream::connect(&addr).await.unwrap();
    long_poll
        .write_all(get(&format!("/v1/lease-requests/{request_id}?wait=60"), &agent).as_bytes())
        .await
        .unwrap();
    let (request_events, _) = open(
        &addr,
        &get(&format!("/v1/lease-requests/{request_id}/events"), &agent),
        "event: queued",
    )
    .await;
    let (lease_events, _) = open(
        &addr,
        &get(&format!("/v1/leases/{LEASE}/events"), &agent),
        "\r\n\r\n",
    )
    .await;
    let (exec, _) = open(
        &addr,
        &post(
            &format!("/v1/leases/{LEASE}/exec"),
            &agent,
            r#"{"tool": "echo"}"#,
        ),
        "\r\n\r\n",
    )
    .await;

    tokio::time::pause();
    let stop_began = tokio::time::Instant::now();
    let ((), events, request_events, lease_events, exec, long_poll) = tokio::join!(
        running.stop("test"),
        rest(events),
        rest(request_events),
        rest(lease_events),
        rest(exec),
        rest(long_poll),
    );
    let took = stop_began.elapsed();
    assert!(
        took < DRAIN_GRACE,
        "the stop waited {took:?} of virtual time: something waited on the drain deadline"
    );

    let stopping = r#"event: stopping
data: {"error":{"code":"DAEMON_STOPPING","message":"The daemon is stopping"}}"#;
    for (name, tail) in [
        ("the event stream", &events),
        ("the lease request's events", &request_events),
        ("the lease's events", &lease_events),
    ] {
        assert!(
            tail.contains(stopping),
            "{name} ended without its last event: {tail:?}"
        );
        assert!(
            tail.trim_end().ends_with("0"),
            "{name} ended its chunked body: {tail:?}"
        );
    }
    let daemon_stopping = events.find("\"event\":\"daemon.stopping\"");
    assert!(
        daemon_stopping.is_some_and(|at| at < events.find(stopping).unwrap()),
        "the event stream carries daemon.stopping before its last event: {events:?}"
    );
    assert!(
        exec.contains(
            r#"event: error
data: {"error":{"code":"DAEMON_STOPPING","message":"The daemon is stopping"}}"#
        ),
        "the exec stream ends with its one error: {exec:?}"
    );
    assert!(long_poll.starts_with("HTTP/1.1 200"), "{long_poll}");
    let body: Value = serde_json::from_str(long_poll.split_once("\r\n\r\n").unwrap().1).unwrap();
    assert_eq!(
        body["request"]["state"], "queued",
        "the long-poll answered at once"
    );
}

/// A stop closes the socket's sessions, as the process's exit does: a client (a lease hold)
/// reads the end of its connection and can connect to the next daemon on the home, instead of
/// a stopped daemon answering `DAEMON_STOPPING` for as long as the client stays.
#[tokio::test]
async fn a_stop_closes_the_sockets_sessions() {
    use tokio::io::AsyncBufReadExt as _;

    let dir = tempfile::tempdir().unwrap();
    let home = Home::at(dir.path().join("home"));
    let base = Base::open(
        home.clone(),
        DaemonConfig::default(),
        Mode::Worker,
        "test".into(),
        None,
    )
    .unwrap();
    let router = base.router();
    let running = base
        .serve(
            router,
            simlock_daemon::runtime::Listen::SocketOnly,
            Vec::new(),
        )
        .await
        .unwrap();
    running.started();

    let stream = tokio::net::UnixStream::connect(home.socket())
        .await
        .unwrap();
    let (read, mut write) = stream.into_split();
    let mut lines = tokio::io::BufReader::new(read).lines();
    let version = simlock_contract::PROTOCOL_RANGE.max;
    write
        .write_all(
            format!(
                "{{\"id\": 0, \"type\": \"hello\", \"payload\": {{\"protocolVersion\": {version}}}}}\n"
            )
            .as_bytes(),
        )
        .await
        .unwrap();
    let greeted = lines
        .next_line()
        .await
        .unwrap()
        .expect("the hello's answer");
    assert!(greeted.contains("\"protocolVersion\":2"), "{greeted}");

    running.stop("test").await;
    // The session ended with the stop: the client reads the end, not a silence.
    let after = tokio::time::timeout(std::time::Duration::from_secs(10), lines.next_line())
        .await
        .expect("the connection ends with the stop");
    assert!(matches!(after, Ok(None) | Err(_)), "{after:?}");
}
