//! The dispatch pipeline's order of checks, over a real wire session on a unix socket pair.

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    reason = "test helpers fail the test by panicking"
)]

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use serde_json::json;
use simlock_contract::ops::{LeaseList, LeaseListOutput, LeaseRenew, RelayCancel, StatusGet};
use simlock_contract::{ContractError, ErrorCode, Role};
use simlock_daemon::context::CallCtx;
use simlock_daemon::pipeline::{
    Greeter, Pipeline, Router, Shutdown, StartupGate, register_daemon_ops,
};
use simlock_daemon::presence::Presence;
use simlock_wire::{Origin, Transport, WireClient, serve};
use tokio::net::UnixStream;

struct Greet;

impl Greeter for Greet {
    fn is_admin_secret(&self, secret: &str) -> bool {
        secret == "admin"
    }

    fn default_principal(&self) -> String {
        "local".into()
    }
}

struct Harness {
    pipeline: Arc<Pipeline>,
    handled: Arc<AtomicUsize>,
    released: Arc<AtomicUsize>,
}

/// A claim made at read time that counts its release.
struct Claim(Arc<AtomicUsize>);

impl Drop for Claim {
    fn drop(&mut self) {
        self.0.fetch_add(1, Ordering::SeqCst);
    }
}

fn harness(gate: StartupGate) -> Harness {
    let handled = Arc::new(AtomicUsize::new(0));
    let released = Arc::new(AtomicUsize::new(0));
    let mut router = Router::new();
    let h = handled.clone();
    router.handle::<LeaseList, _, _>(move |_, _| {
        h.fetch_add(1, Ordering::SeqCst);
        async move {
            Ok(LeaseListOutput {
                leases: vec![],
                unread_workers: vec![],
            })
        }
    });
    router.handle::<StatusGet, _, _>(|_, _| async move {
        Err(ContractError::internal("status is only probed"))
    });
    router.handle_authorized::<LeaseRenew, _, _, _>(
        |ctx, input| {
            if input.lease_id == "theirs" && ctx.role != Role::Admin {
                Err(ContractError::forbidden("not yours"))
            } else {
                Ok(())
            }
        },
        |_, _| async move { Err(ContractError::unknown_lease("x")) },
    );
    let r = released.clone();
    router.handle::<RelayCancel, _, _>(|ctx: CallCtx, _| {
        let claimed = ctx.take_prepared::<Claim>().is_some();
        async move {
            if claimed {
                Ok(simlock_contract::ops::Empty {})
            } else {
                Err(ContractError::internal("no claim"))
            }
        }
    });
    router.prepare::<RelayCancel, _>(move |_, _| Some(Box::new(Claim(r.clone()))));
    let shutdown = Shutdown::new();
    register_daemon_ops(&mut router, &shutdown);
    let pipeline = Arc::new(Pipeline::new(
        router,
        gate,
        shutdown,
        "test".into(),
        Arc::new(Greet),
        Presence::new(),
    ));
    Harness {
        pipeline,
        handled,
        released,
    }
}

async fn client(pipeline: &Arc<Pipeline>, credential: Option<&str>) -> WireClient {
    let (server, client) = UnixStream::pair().unwrap();
    let (r, w) = server.into_split();
    tokio::spawn(serve(
        Transport::server_io(r, w),
        Origin::Socket,
        pipeline.clone(),
        pipeline.session_config(),
    ));
    let (r, w) = client.into_split();
    let (client, _) = WireClient::new(Transport::client_io(r, w));
    let hello = simlock_contract::Hello {
        client_version: None,
        protocol_version: Some(2),
        protocol_range: None,
        principal: Some("p1".into()),
        credential: credential.map(String::from),
    };
    client.hello(&hello).await.unwrap();
    client
}

#[tokio::test]
async fn an_unknown_operation_answers_unknown_request() {
    let h = harness(StartupGate::ready());
    let c = client(&h.pipeline, None).await;
    let err = c.call_value("nope.nothing", json!({})).await.unwrap_err();
    assert_eq!(err.code, ErrorCode::UnknownRequest);
    assert_eq!(err.message, "Unknown request type: nope.nothing");
}

#[tokio::test]
async fn bad_input_is_refused_before_the_role_check_and_changes_nothing() {
    let h = harness(StartupGate::ready());
    let c = client(&h.pipeline, None).await;
    let err = c
        .call_value("lease.renew", json!({"leaseId": "a b"}))
        .await
        .unwrap_err();
    assert_eq!(err.code, ErrorCode::BadRequest);
    assert!(err.message.starts_with("leaseId"), "{}", err.message);
    let err = c.call_value("daemon.stop", json!({})).await.unwrap_err();
    assert_eq!(err.code, ErrorCode::Forbidden);
    assert_eq!(
        err.message,
        "Operation daemon.stop requires role admin (an operator token, or the daemon's admin secret); this caller has role agent"
    );
    assert!(!h.pipeline.shutdown().is_requested());
}

#[tokio::test]
async fn the_authorize_step_refuses_after_the_role_check() {
    let h = harness(StartupGate::ready());
    let agent = client(&h.pipeline, None).await;
    let err = agent
        .call_value("lease.renew", json!({"leaseId": "theirs"}))
        .await
        .unwrap_err();
    assert_eq!(err.code, ErrorCode::Forbidden);
    let admin = client(&h.pipeline, Some("admin")).await;
    let err = admin
        .call_value("lease.renew", json!({"leaseId": "theirs"}))
        .await
        .unwrap_err();
    assert_eq!(err.code, ErrorCode::UnknownLease);
}

#[tokio::test]
async fn calls_park_behind_startup_except_status_get() {
    let gate = StartupGate::new();
    let h = harness(gate.clone());
    let c = client(&h.pipeline, None).await;
    let parked = tokio::spawn({
        let c = c.clone();
        async move { c.call_value("lease.list", json!({})).await }
    });
    // status.get answers while starting (here with its handler's own error).
    let err = c.call_value("status.get", json!({})).await.unwrap_err();
    assert_eq!(err.message, "status is only probed");
    assert_eq!(
        h.handled.load(Ordering::SeqCst),
        0,
        "lease.list must wait for start-up"
    );
    gate.open();
    assert_eq!(parked.await.unwrap().unwrap(), json!({"leases": []}));
    assert_eq!(h.handled.load(Ordering::SeqCst), 1);
}

#[tokio::test]
async fn a_failed_startup_answers_daemon_startup_failed() {
    let gate = StartupGate::new();
    let h = harness(gate.clone());
    let c = client(&h.pipeline, None).await;
    gate.fail("the drivers could not be read");
    let err = c.call_value("lease.list", json!({})).await.unwrap_err();
    assert_eq!(err.code, ErrorCode::DaemonStartupFailed);
    assert!(err.message.contains("the drivers could not be read"));
}

#[tokio::test]
async fn a_stopping_daemon_refuses_everything_but_daemon_stop() {
    let h = harness(StartupGate::ready());
    let c = client(&h.pipeline, Some("admin")).await;
    h.pipeline.begin_stopping();
    assert_eq!(
        c.call_value("lease.list", json!({}))
            .await
            .unwrap_err()
            .code,
        ErrorCode::DaemonStopping
    );
    assert_eq!(
        c.call_value("daemon.stop", json!({})).await.unwrap(),
        json!({"stopping": true})
    );
    assert!(h.pipeline.shutdown().is_requested());
}

#[tokio::test]
async fn a_read_time_claim_reaches_the_handler_or_is_released_with_the_failure() {
    let h = harness(StartupGate::ready());
    let admin = client(&h.pipeline, Some("admin")).await;
    assert_eq!(
        admin
            .call_value("relay.cancel", json!({"relayId": "r1"}))
            .await
            .unwrap(),
        json!({})
    );
    assert_eq!(
        h.released.load(Ordering::SeqCst),
        1,
        "the handler took and dropped the claim"
    );
    // Refused by role: the claim made at read time is released.
    let agent = client(&h.pipeline, None).await;
    assert_eq!(
        agent
            .call_value("relay.cancel", json!({"relayId": "r1"}))
            .await
            .unwrap_err()
            .code,
        ErrorCode::Forbidden
    );
    assert_eq!(h.released.load(Ordering::SeqCst), 2);
    // Refused while stopping.
    h.pipeline.begin_stopping();
    assert_eq!(
        admin
            .call_value("relay.cancel", json!({"relayId": "r1"}))
            .await
            .unwrap_err()
            .code,
        ErrorCode::DaemonStopping
    );
    assert_eq!(h.released.load(Ordering::SeqCst), 3);
}

#[tokio::test]
async fn a_protocol_mismatch_releases_the_read_time_claim() {
    let h = harness(StartupGate::ready());
    let (server, client) = UnixStream::pair().unwrap();
    let (r, w) = server.into_split();
    let pipeline = h.pipeline.clone();
    tokio::spawn(serve(
        Transport::server_io(r, w),
        Origin::Socket,
        pipeline.clone(),
        pipeline.session_config(),
    ));
    let (r, w) = client.into_split();
    let (c, _) = WireClient::new(Transport::client_io(r, w));
    let err = c
        .call_value("hello", json!({"protocolRange": {"min": 5, "max": 6}}))
        .await
        .unwrap_err();
    assert_eq!(err.code, ErrorCode::ProtocolVersionUnsupported);
    let err = c
        .call_value("relay.cancel", json!({"relayId": "r1"}))
        .await
        .unwrap_err();
    assert_eq!(err.code, ErrorCode::ProtocolVersionUnsupported);
    assert_eq!(h.released.load(Ordering::SeqCst), 1);
}
