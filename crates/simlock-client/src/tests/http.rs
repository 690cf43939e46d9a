//! Typed calls, errors, the lease-requests resource, exec, events, notices and holds over real
//! HTTP.

use serde_json::json;
use simlock_contract::model::{LeaseEndReason, Platform, TokenRole};
use simlock_contract::ops::{ExecInput, LeaseRequestInput, ListKind, ListOutput};
use simlock_contract::push::{OutputStream, Progress};
use simlock_contract::{ContractError, ErrorCode, Push};
use tokio::sync::mpsc;

use super::{guard, http_client, http_fake};
use crate::{FollowItem, HoldEnd, LeaseLost, LeaseNotice};
use simlock_test_support::fake_daemon::{CancelScript, RequestScript};

#[tokio::test]
async fn typed_calls_answer_over_http() {
    let fake = http_fake().await;
    let operator = http_client(&fake, fake.operator_token());
    assert!(operator.principal().is_none());
    let status = guard(operator.status()).await.unwrap();
    assert_eq!(status.devices.unwrap().len(), 1);
    let ListOutput::Devices(devices) = guard(operator.list(ListKind::Devices)).await.unwrap()
    else {
        panic!("not a device list");
    };
    assert_eq!(devices.len(), 1);
    assert_eq!(guard(operator.workers()).await.unwrap().workers.len(), 1);
    let created = guard(operator.token_create(TokenRole::Operator, None))
        .await
        .unwrap();
    assert!(created.secret.starts_with("slk_"));

    let agent = http_client(&fake, fake.agent_token());
    let err = guard(agent.list(ListKind::Devices)).await.unwrap_err();
    assert_eq!(err.code, ErrorCode::Forbidden);
    let stranger = http_client(&fake, "slk_unknown");
    let err = guard(stranger.status()).await.unwrap_err();
    assert_eq!(err.code, ErrorCode::Unauthenticated);
}

#[tokio::test]
async fn one_lease_is_read_by_its_route_over_http() {
    let fake = http_fake().await;
    let agent = http_client(&fake, fake.agent_token());
    let grant = guard(agent.request_lease(
        LeaseRequestInput::for_platform(Platform::Ios),
        |_| {},
        std::future::pending(),
    ))
    .await
    .unwrap();
    let lease = guard(agent.lease(grant.lease.id.as_str())).await.unwrap();
    assert_eq!(lease.id, grant.lease.id);
    let err = guard(agent.lease("lse_nope")).await.unwrap_err();
    assert_eq!(err.code, ErrorCode::UnknownLease);
    let err = guard(agent.lease("bad id!")).await.unwrap_err();
    assert_eq!(err.code, ErrorCode::BadRequest);
}

#[tokio::test]
async fn errors_keep_their_details_over_http() {
    let fake = http_fake().await;
    let agent = http_client(&fake, fake.agent_token());
    let err = guard(agent.renew("lse_nope", None)).await.unwrap_err();
    assert_eq!(err.code, ErrorCode::UnknownLease);
    assert_eq!(err.details, Some(json!({"leaseId": "lse_nope"})));
    let err = guard(agent.worker_drain("x")).await.unwrap_err();
    assert_eq!(err.code, ErrorCode::Forbidden);
}

#[tokio::test]
async fn a_daemon_not_listening_is_a_lost_connection() {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    drop(listener);
    let client = crate::Client::over_http(&url, "slk_x", crate::ConnectOptions::default()).unwrap();
    let err = guard(client.status()).await.unwrap_err();
    assert_eq!(err.code, ErrorCode::DaemonConnectionLost, "{err}");
    assert!(err.message.contains(&url), "{}", err.message);
}

/// Something at the URL that answers a lease read with JSON that is no lease (an array): a
/// clear error, not a panic.
#[tokio::test]
async fn a_lease_read_answered_with_no_lease_is_an_error_naming_the_operation() {
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let server = tokio::spawn(async move {
        let (mut socket, _) = listener.accept().await.unwrap();
        let mut head = [0u8; 4096];
        let _ = socket.read(&mut head).await.unwrap();
        socket
            .write_all(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 3\r\n\r\n[1]")
            .await
            .unwrap();
    });
    let client = crate::Client::over_http(&url, "slk_x", crate::ConnectOptions::default()).unwrap();
    let err = guard(client.lease("lse_1")).await.unwrap_err();
    assert_eq!(err.code, ErrorCode::Internal, "{err}");
    assert!(
        err.message.contains("invalid lease.get output"),
        "{}",
        err.message
    );
    guard(server).await.unwrap();
}

#[tokio::test]
async fn the_lease_requests_resource_reports_progress_then_the_grant() {
    let fake = http_fake().await;
    fake.script_request(RequestScript::Hold(vec![
        Progress::queued(2),
        Progress::Booting { eta_ms: 30_000 },
    ]));
    let agent = http_client(&fake, fake.agent_token());
    let (tx, mut rx) = mpsc::unbounded_channel();
    let mut input = LeaseRequestInput::for_platform(Platform::Ios);
    input.model = Some("iPhone 16".into());
    input.ttl_ms = Some(60_000);
    input.idempotency_key = Some("k1".into());
    let request = tokio::spawn({
        let agent = agent.clone();
        async move {
            agent
                .request_lease(
                    input,
                    move |p| {
                        let _ = tx.send(*p);
                    },
                    std::future::pending(),
                )
                .await
        }
    });
    // The view may show `queued` or go straight to `booting`; it ends at `booting`.
    loop {
        let progress = guard(rx.recv()).await.unwrap();
        if progress == (Progress::Booting { eta_ms: 30_000 }) {
            break;
        }
        assert_eq!(progress, Progress::queued(2));
    }
    assert!(fake.settle_pending(Ok(())));
    let grant = guard(request).await.unwrap().unwrap();
    assert_eq!(grant.lease.owner_id, fake.agent_token_id());
    assert_eq!(
        fake.calls_of("lease.request")[0].input,
        json!({"platform": "ios", "model": "iPhone 16", "ttlMs": 60_000, "idempotencyKey": "k1"})
    );
}

#[tokio::test]
async fn a_refused_request_fails_with_its_code_over_http() {
    let fake = http_fake().await;
    fake.script_request(RequestScript::Fail(
        Vec::new(),
        ContractError::new(ErrorCode::NoCapacity, "no device free"),
    ));
    let agent = http_client(&fake, fake.agent_token());
    let err = guard(agent.request_lease(
        LeaseRequestInput::for_platform(Platform::Ios),
        |_| {},
        std::future::pending(),
    ))
    .await
    .unwrap_err();
    assert_eq!(err.code, ErrorCode::NoCapacity);
}

#[tokio::test]
async fn a_named_requester_goes_through_the_resource_with_its_progress() {
    let fake = http_fake().await;
    fake.script_request(RequestScript::Hold(vec![Progress::queued(2)]));
    let agent = http_client(&fake, fake.agent_token());
    let mut input = LeaseRequestInput::for_platform(Platform::Ios);
    input.requester_id = Some("agent-3".into());
    let mut pending = guard(agent.begin_lease_request(input)).await.unwrap();
    assert_eq!(
        guard(pending.next()).await,
        crate::RequestEvent::Progress(Progress::queued(2))
    );
    assert!(fake.settle_pending(Ok(())));
    let crate::RequestEvent::Done(Ok(grant)) = guard(pending.next()).await else {
        panic!("no grant");
    };
    assert_eq!(grant.lease.requester_id, "agent-3");
    assert_eq!(grant.lease.owner_id, fake.agent_token_id());
    assert_eq!(
        fake.calls_of("lease.request")[0].input,
        json!({"platform": "ios", "requesterId": "agent-3"})
    );
}

#[tokio::test]
async fn abort_withdraws_the_resource_when_it_is_still_queued() {
    let fake = http_fake().await;
    fake.script_request(RequestScript::Hold(vec![Progress::queued(1)]));
    fake.script_cancel(CancelScript::Cancelled);
    let agent = http_client(&fake, fake.agent_token());
    let mut pending =
        guard(agent.begin_lease_request(LeaseRequestInput::for_platform(Platform::Ios)))
            .await
            .unwrap();
    assert_eq!(
        guard(pending.next()).await,
        crate::RequestEvent::Progress(Progress::queued(1))
    );
    assert!(
        pending
            .request_id()
            .is_some_and(|id| id.starts_with("req_"))
    );
    let err = guard(pending.abort()).await.unwrap_err();
    assert_eq!(err.code, ErrorCode::Cancelled);
    assert_eq!(
        fake.calls_of("lease.cancel")[0].input,
        json!({"requesterId": fake.agent_token_id()})
    );
}

#[tokio::test]
async fn abort_releases_the_grant_when_the_resource_is_past_cancelling() {
    let fake = http_fake().await;
    fake.script_request(RequestScript::Hold(vec![Progress::Booting {
        eta_ms: 1000,
    }]));
    fake.script_cancel(CancelScript::NotCancellable);
    let agent = http_client(&fake, fake.agent_token());
    let mut pending =
        guard(agent.begin_lease_request(LeaseRequestInput::for_platform(Platform::Ios)))
            .await
            .unwrap();
    assert!(matches!(
        guard(pending.next()).await,
        crate::RequestEvent::Progress(Progress::Booting { .. })
    ));
    let err = guard(pending.abort()).await.unwrap_err();
    assert_eq!(err.code, ErrorCode::Cancelled);
    let released = fake.calls_of("lease.release");
    assert_eq!(released.len(), 1);
    assert!(fake.leases().is_empty());
}

#[tokio::test]
async fn exec_streams_over_server_sent_events() {
    let fake = http_fake().await;
    let lease = fake.add_lease(fake.agent_token_id(), 60_000);
    let agent = http_client(&fake, fake.agent_token());
    let exec = guard(agent.exec(ExecInput {
        lease_id: lease.id.to_string(),
        tool: "adb".into(),
        args: vec!["devices".into()],
        stdin: None,
        requester_id: None,
    }))
    .await
    .unwrap();
    let mut output = Vec::new();
    let code = guard(exec.finish(|stream, chunk| output.push((stream, chunk.to_owned()))))
        .await
        .unwrap();
    assert_eq!(code, 3);
    assert_eq!(
        output,
        [
            (OutputStream::Stdout, "hello\n".to_owned()),
            (OutputStream::Stderr, "careful\n".to_owned()),
            (OutputStream::Stdout, "bye\n".to_owned()),
        ]
    );
    assert_eq!(
        fake.calls_of("device.exec")[0].input,
        json!({"leaseId": lease.id.as_str(), "tool": "adb", "args": ["devices"]})
    );
    // Refused before the tool starts: a JSON error, not a stream.
    let err = guard(agent.exec(ExecInput {
        lease_id: "lse_nope".into(),
        tool: "adb".into(),
        args: Vec::new(),
        stdin: None,
        requester_id: None,
    }))
    .await
    .unwrap_err();
    assert_eq!(err.code, ErrorCode::UnknownLease);
}

#[tokio::test]
async fn events_follow_over_http() {
    let fake = http_fake().await;
    let operator = http_client(&fake, fake.operator_token());
    let mut follow = guard(operator.follow_events()).await.unwrap();
    fake.emit("device.ready", json!({"deviceId": "dev_1"}));
    let Some(Ok(FollowItem::Event(event))) = guard(follow.next()).await else {
        panic!("no event");
    };
    assert_eq!(event.event, "device.ready");
    let replay = guard(operator.events(Some(0))).await.unwrap();
    assert_eq!(replay.events.len(), 1);
    let agent = http_client(&fake, fake.agent_token());
    assert_eq!(
        guard(agent.follow_events()).await.unwrap_err().code,
        ErrorCode::Forbidden
    );
}

#[tokio::test]
async fn lease_notices_over_http_end_with_the_loss() {
    let fake = http_fake().await;
    let owner = fake.agent_token_id().to_owned();
    let lease = fake.add_lease(&owner, 60_000);
    let agent = http_client(&fake, fake.agent_token());
    let mut notices = guard(agent.lease_notices(lease.id.as_str())).await.unwrap();
    fake.notify(
        &owner,
        &Push::DeviceRecovered {
            lease_id: lease.id.to_string(),
            device_id: lease.device_id.clone(),
            attempts: 2,
        },
    );
    assert_eq!(
        guard(notices.next()).await.unwrap().unwrap(),
        LeaseNotice::Recovered {
            lease_id: lease.id.to_string(),
            device_id: lease.device_id.clone(),
            attempts: 2
        }
    );
    assert!(fake.end_lease(lease.id.as_str(), LeaseEndReason::Killed));
    assert!(matches!(
        guard(notices.next()).await,
        Some(Ok(LeaseNotice::Lost {
            reason: LeaseEndReason::Killed,
            ..
        }))
    ));
    assert!(guard(notices.next()).await.is_none());
    assert_eq!(
        guard(agent.lease_notices("lse_nope"))
            .await
            .unwrap_err()
            .code,
        ErrorCode::UnknownLease
    );
}

#[tokio::test]
async fn an_http_hold_stops_on_lease_lost() {
    let fake = http_fake().await;
    let agent = http_client(&fake, fake.agent_token());
    let mut input = LeaseRequestInput::for_platform(Platform::Ios);
    input.ttl_ms = Some(60_000);
    let grant = guard(agent.request_lease(input, |_| {}, std::future::pending()))
        .await
        .unwrap();
    let lease_id = grant.lease.id.to_string();
    let mut hold = agent.hold(grant);
    // The lease's event stream checks the lease with `lease.get` once it follows notices.
    guard(fake.wait_for_calls("lease.get", 1)).await;
    assert!(fake.end_lease(&lease_id, LeaseEndReason::Expired));
    assert_eq!(
        guard(hold.ended()).await,
        HoldEnd::Lost(LeaseLost {
            lease_id,
            reason: Some(LeaseEndReason::Expired)
        })
    );
}

#[tokio::test]
async fn an_http_hold_whose_lease_is_not_listed_yet_lets_the_renewal_decide() {
    // A gateway lists a lease once its worker's view has it; the lease's event stream can answer
    // UNKNOWN_LEASE just after the grant. Only the renewal says the lease is gone.
    let fake = http_fake().await;
    let agent = http_client(&fake, fake.agent_token());
    let mut input = LeaseRequestInput::for_platform(Platform::Ios);
    input.ttl_ms = Some(300);
    let mut grant = guard(agent.request_lease(input, |_| {}, std::future::pending()))
        .await
        .unwrap();
    grant.lease.id = simlock_contract::ids::LeaseId::from_raw("lse_not_listed");
    let mut hold = agent.hold(grant);
    assert_eq!(
        guard(hold.ended()).await,
        HoldEnd::Lost(LeaseLost {
            lease_id: "lse_not_listed".into(),
            reason: None
        })
    );
    let renewals = fake.calls_of("lease.renew");
    assert_eq!(renewals.len(), 1, "the renewal decided");
    assert_eq!(renewals[0].input, json!({"leaseId": "lse_not_listed"}));
}

#[tokio::test]
async fn an_http_hold_renews_then_releases() {
    let fake = http_fake().await;
    let agent = http_client(&fake, fake.agent_token());
    let mut input = LeaseRequestInput::for_platform(Platform::Ios);
    input.ttl_ms = Some(300);
    let grant = guard(agent.request_lease(input, |_| {}, std::future::pending()))
        .await
        .unwrap();
    let lease_id = grant.lease.id.to_string();
    let hold = agent.hold(grant);
    let renewals = guard(fake.wait_for_calls("lease.renew", 2)).await;
    assert!(
        renewals
            .iter()
            .all(|r| r.input == json!({"leaseId": lease_id}))
    );
    assert_eq!(guard(hold.release()).await, HoldEnd::Released);
    assert_eq!(
        fake.calls_of("lease.release")[0].input,
        json!({"leaseId": lease_id})
    );
    assert!(fake.leases().is_empty());
}

/// Issue 11, item 0: a lookup that raced the grant (the lease's event stream opened at once and
/// its lease was not listed yet) is not the daemon's word: the hold renews and releases.
#[tokio::test]
async fn an_http_hold_whose_first_lookup_misses_the_lease_renews_and_releases() {
    let fake = http_fake().await;
    let agent = http_client(&fake, fake.agent_token());
    let mut input = LeaseRequestInput::for_platform(Platform::Ios);
    input.ttl_ms = Some(300);
    let grant = guard(agent.request_lease(input, |_| {}, std::future::pending()))
        .await
        .unwrap();
    fake.unlist_leases(true);
    let lease_id = grant.lease.id.to_string();
    let hold = agent.hold(grant);
    // The stream's lookup misses the lease; renewals go on.
    guard(fake.wait_for_calls("lease.get", 1)).await;
    guard(fake.wait_for_calls("lease.renew", 2)).await;
    fake.unlist_leases(false);
    assert_eq!(guard(hold.release()).await, HoldEnd::Released);
    assert_eq!(
        fake.calls_of("lease.release")[0].input,
        json!({"leaseId": lease_id})
    );
    assert!(fake.leases().is_empty());
}
