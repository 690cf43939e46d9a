//! Typed calls, errors, progress, exec, events and notices over a real unix socket.

use serde_json::json;
use simlock_contract::model::{LeaseEndReason, Mode, Platform, TokenRole};
use simlock_contract::ops::{ExecInput, LeaseRequestInput, ListKind, ListOutput};
use simlock_contract::push::{OutputStream, Progress, UnhealthyReason};
use simlock_contract::{ContractError, ErrorCode, Push, Role};

use super::{guard, socket_client, socket_fake};
use crate::{Client, ConnectOptions, ExecEvent, FollowItem, LeaseNotice};
use simlock_test_support::fake_daemon::RequestScript;

#[tokio::test]
async fn typed_calls_answer_over_the_socket() {
    let fake = socket_fake().await;
    let agent = socket_client(&fake, false).await;
    assert_eq!(agent.principal(), Some("agent-1"));
    assert_eq!(agent.role(), Some(Role::Agent));
    let status = guard(agent.status()).await.unwrap();
    assert_eq!(status.daemon.mode, Mode::Worker);
    let catalog = guard(agent.catalog(Some(Platform::Ios))).await.unwrap();
    assert_eq!(catalog.platforms[0].models, ["iPhone 16"]);
    assert!(guard(agent.leases()).await.unwrap().leases.is_empty());
    let err = guard(agent.list(ListKind::Devices)).await.unwrap_err();
    assert_eq!(err.code, ErrorCode::Forbidden);

    let admin = socket_client(&fake, true).await;
    assert_eq!(admin.role(), Some(Role::Admin));
    let ListOutput::Devices(devices) = guard(admin.list(ListKind::Devices)).await.unwrap() else {
        panic!("not a device list");
    };
    assert_eq!(devices.len(), 1);
    assert_eq!(
        guard(admin.config()).await.unwrap().lease.max_ttl_ms,
        14_400_000
    );
    assert_eq!(guard(admin.workers()).await.unwrap().workers.len(), 1);
    let drained = guard(admin.worker_drain("fake-worker")).await.unwrap();
    assert!(drained.drained);
    let err = guard(admin.worker_undrain("other")).await.unwrap_err();
    assert_eq!(err.code, ErrorCode::UnknownWorker);
    assert_eq!(err.details, Some(json!({"workerId": "other"})));

    let created = guard(admin.token_create(TokenRole::Agent, Some("ci".into())))
        .await
        .unwrap();
    assert!(created.secret.starts_with("slk_"));
    let tokens = guard(admin.token_list()).await.unwrap().tokens;
    assert!(tokens.iter().any(|t| t.id == created.token.id));
    let revoked = guard(admin.token_revoke(created.token.id.as_str()))
        .await
        .unwrap();
    assert!(revoked.revoked);

    assert!(guard(admin.stop_daemon()).await.unwrap().stopping);
    assert!(fake.stop_requested());
}

#[tokio::test]
async fn a_bad_credential_is_refused_at_hello() {
    let fake = socket_fake().await;
    let options = ConnectOptions::default().credential("slk_not-a-secret");
    let err = guard(Client::connect_socket(fake.socket_path().unwrap(), options))
        .await
        .unwrap_err();
    assert_eq!(err.code, ErrorCode::AdminAuthenticationFailed);
    // An operator token's secret is an admin credential too.
    let options = ConnectOptions::default().credential(fake.operator_token());
    let admin = guard(Client::connect_socket(fake.socket_path().unwrap(), options))
        .await
        .unwrap();
    assert_eq!(admin.role(), Some(Role::Admin));
}

#[tokio::test]
async fn no_daemon_means_connection_lost_naming_the_socket() {
    let dir = tempfile::tempdir().unwrap();
    let err = guard(Client::connect_home(dir.path(), ConnectOptions::default()))
        .await
        .unwrap_err();
    assert_eq!(err.code, ErrorCode::DaemonConnectionLost);
    let path = dir.path().join("daemon.sock");
    assert_eq!(
        err.message,
        format!(
            "no simlock daemon is running at {}; start one with simlock-worker --home {home} \
             (or simlock-gateway --home {home})",
            path.display(),
            home = dir.path().display()
        )
    );
}

#[tokio::test]
async fn renew_and_release_answer_and_fail_with_typed_errors() {
    let fake = socket_fake().await;
    let client = socket_client(&fake, false).await;
    let lease = fake.add_lease("agent-1", 60_000);
    let renewed = guard(client.renew(lease.id.as_str(), None)).await.unwrap();
    assert_eq!(renewed.ttl_ms, 60_000);
    assert_eq!(
        fake.calls_of("lease.renew")[0].input,
        json!({"leaseId": lease.id.as_str()})
    );
    let err = guard(client.renew("lse_nope", Some(1000)))
        .await
        .unwrap_err();
    assert_eq!(err.code, ErrorCode::UnknownLease);
    assert_eq!(err.details, Some(json!({"leaseId": "lse_nope"})));
    let released = guard(client.release(lease.id.as_str())).await.unwrap();
    assert_eq!(released.lease_id, lease.id.as_str());
    let err = guard(client.release(lease.id.as_str())).await.unwrap_err();
    assert_eq!(err.code, ErrorCode::UnknownLease);
    // Bounds are checked by the daemon's pipeline and come back as BAD_REQUEST.
    let err = guard(client.renew("not a lease id", None))
        .await
        .unwrap_err();
    assert_eq!(err.code, ErrorCode::BadRequest);
}

#[tokio::test]
async fn progress_reaches_the_callback_in_order_then_the_grant() {
    let fake = socket_fake().await;
    let stages = vec![Progress::queued(2), Progress::Booting { eta_ms: 30_000 }];
    fake.script_request(RequestScript::Grant(stages.clone()));
    let client = socket_client(&fake, false).await;
    let mut input = LeaseRequestInput::for_platform(Platform::Ios);
    input.model = Some("iPhone 16".into());
    input.requester_id = Some("agent-9".into());
    input.ttl_ms = Some(120_000);
    let mut seen = Vec::new();
    let grant = guard(client.request_lease(input, |p| seen.push(*p), std::future::pending()))
        .await
        .unwrap();
    assert_eq!(seen, stages);
    assert_eq!(grant.lease.requester_id, "agent-9");
    assert_eq!(grant.lease.owner_id, "agent-1");
    assert_eq!(grant.lease.ttl_ms, 120_000);
    assert_eq!(
        fake.calls_of("lease.request")[0].input,
        json!({"platform": "ios", "model": "iPhone 16", "requesterId": "agent-9", "ttlMs": 120_000})
    );
}

#[tokio::test]
async fn a_refused_request_keeps_its_code_and_details() {
    let fake = socket_fake().await;
    let refusal = ContractError::new(ErrorCode::RequesterAlreadyLeased, "agent-1 holds lse_9")
        .with_details(json!({"requesterId": "agent-1", "existingLeaseId": "lse_9"}));
    fake.script_request(RequestScript::Fail(Vec::new(), refusal.clone()));
    let client = socket_client(&fake, false).await;
    let err = guard(client.request_lease(
        LeaseRequestInput::for_platform(Platform::Android),
        |_| {},
        std::future::pending(),
    ))
    .await
    .unwrap_err();
    assert_eq!(err, refusal);
}

#[tokio::test]
async fn exec_streams_output_as_it_comes_then_the_exit_code() {
    let fake = socket_fake().await;
    let client = socket_client(&fake, false).await;
    let lease = fake.add_lease("agent-1", 60_000);
    let mut exec = guard(client.exec(ExecInput {
        lease_id: lease.id.to_string(),
        tool: "simctl".into(),
        args: vec!["list".into()],
        stdin: None,
        requester_id: None,
    }))
    .await
    .unwrap();
    let mut events = Vec::new();
    while let Some(event) = guard(exec.next()).await {
        events.push(event.unwrap());
    }
    assert_eq!(
        events,
        [
            ExecEvent::Output {
                stream: OutputStream::Stdout,
                chunk: "hello\n".into()
            },
            ExecEvent::Output {
                stream: OutputStream::Stderr,
                chunk: "careful\n".into()
            },
            ExecEvent::Output {
                stream: OutputStream::Stdout,
                chunk: "bye\n".into()
            },
            ExecEvent::Exit { exit_code: 3 },
        ]
    );
    // A refusal arrives on the stream.
    let mut exec = guard(client.exec(ExecInput {
        lease_id: "lse_nope".into(),
        tool: "simctl".into(),
        args: Vec::new(),
        stdin: None,
        requester_id: None,
    }))
    .await
    .unwrap();
    let err = guard(exec.next()).await.unwrap().unwrap_err();
    assert_eq!(err.code, ErrorCode::UnknownLease);
    assert!(guard(exec.next()).await.is_none());
}

#[tokio::test]
async fn events_replay_and_follow() {
    let fake = socket_fake().await;
    let admin = socket_client(&fake, true).await;
    fake.emit("lease.granted", json!({"leaseId": "lse_1"}));
    let replay = guard(admin.events(None)).await.unwrap();
    assert_eq!(replay.events.len(), 1);
    assert_eq!(replay.events[0].event, "lease.granted");
    let mut follow = guard(admin.follow_events()).await.unwrap();
    fake.emit("lease.released", json!({"leaseId": "lse_1"}));
    let Some(Ok(FollowItem::Event(event))) = guard(follow.next()).await else {
        panic!("no event");
    };
    assert_eq!(event.event, "lease.released");
    // An agent may not follow.
    let agent = socket_client(&fake, false).await;
    let err = guard(agent.follow_events()).await.unwrap_err();
    assert_eq!(err.code, ErrorCode::Forbidden);
}

#[tokio::test]
async fn lease_notices_reach_the_owner_and_end_with_the_loss() {
    let fake = socket_fake().await;
    let client = socket_client(&fake, false).await;
    let lease = fake.add_lease("agent-1", 60_000);
    let other = fake.add_lease("agent-1", 60_000);
    let mut notices = guard(client.lease_notices(lease.id.as_str()))
        .await
        .unwrap();
    fake.notify(
        "agent-1",
        &Push::DeviceUnhealthy {
            lease_id: other.id.to_string(),
            device_id: other.device_id.clone(),
            reason: UnhealthyReason::Crashed,
        },
    );
    fake.notify(
        "agent-1",
        &Push::DeviceUnhealthy {
            lease_id: lease.id.to_string(),
            device_id: lease.device_id.clone(),
            reason: UnhealthyReason::Crashed,
        },
    );
    assert_eq!(
        guard(notices.next()).await.unwrap().unwrap(),
        LeaseNotice::Unhealthy {
            lease_id: lease.id.to_string(),
            device_id: lease.device_id.clone(),
            reason: UnhealthyReason::Crashed
        }
    );
    assert!(fake.end_lease(lease.id.as_str(), LeaseEndReason::DeviceLost));
    assert_eq!(
        guard(notices.next()).await.unwrap().unwrap(),
        LeaseNotice::Lost {
            lease_id: lease.id.to_string(),
            device_id: lease.device_id.clone(),
            reason: LeaseEndReason::DeviceLost
        }
    );
    assert!(guard(notices.next()).await.is_none());
    // A stream opened after the loss still learns of it.
    let mut late = guard(client.lease_notices(lease.id.as_str()))
        .await
        .unwrap();
    assert!(matches!(
        guard(late.next()).await,
        Some(Ok(LeaseNotice::Lost { .. }))
    ));
}

#[tokio::test]
async fn a_follow_started_right_after_another_ended_still_gets_events() {
    let fake = socket_fake().await;
    let admin = socket_client(&fake, true).await;
    let first = guard(admin.follow_events()).await.unwrap();
    drop(first);
    let mut second = guard(admin.follow_events()).await.unwrap();
    fake.emit("device.ready", json!({"deviceId": "dev_1"}));
    let Some(Ok(FollowItem::Event(event))) = guard(second.next()).await else {
        panic!("no event");
    };
    assert_eq!(event.event, "device.ready");
}

/// The client finds the socket and the admin secret where the daemon's `Home` puts them (it
/// cannot use `Home` itself: the client does not depend on the daemon crate).
#[test]
fn the_home_layout_is_the_daemons() {
    use simlock_daemon::home::{AdminSecret, Home};

    use crate::client::{admin_secret_in, socket_in};

    let dir = tempfile::tempdir().unwrap();
    let home = Home::at(dir.path());
    assert_eq!(socket_in(dir.path()), home.socket());
    assert_eq!(admin_secret_in(dir.path()), None);
    let admin = AdminSecret::create(&home).unwrap();
    let secret = admin_secret_in(dir.path()).unwrap();
    assert!(admin.matches(&secret));
}
