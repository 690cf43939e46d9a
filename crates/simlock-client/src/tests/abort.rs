//! Aborting a pending lease request: `lease.cancel` and its three answers.

use serde_json::json;
use simlock_contract::model::Platform;
use simlock_contract::ops::LeaseRequestInput;
use simlock_contract::push::Progress;
use simlock_contract::{ContractError, ErrorCode};
use tokio::sync::oneshot;

use super::{guard, pipe_client, socket_client, socket_fake};
use crate::{Client, PendingLease, RequestEvent};
use simlock_test_support::fake_daemon::{CancelScript, FakeDaemon, RequestScript};

fn input() -> LeaseRequestInput {
    let mut input = LeaseRequestInput::for_platform(Platform::Ios);
    input.requester_id = Some("agent-9".into());
    input
}

/// A request the fake holds in the queue, read up to its first progress.
async fn queued(fake: &FakeDaemon, client: &Client, cancel: CancelScript) -> PendingLease {
    fake.script_request(RequestScript::Hold(vec![Progress::queued(1)]));
    fake.script_cancel(cancel);
    let mut pending = guard(client.begin_lease_request(input())).await.unwrap();
    assert_eq!(
        guard(pending.next()).await,
        RequestEvent::Progress(Progress::queued(1))
    );
    pending
}

#[tokio::test]
async fn cancelled_ends_the_request_cancelled() {
    let fake = FakeDaemon::new().unwrap();
    let (client, _cut) = pipe_client(&fake).await;
    let pending = queued(&fake, &client, CancelScript::Cancelled).await;
    let err = guard(pending.abort()).await.unwrap_err();
    assert_eq!(err.code, ErrorCode::Cancelled);
    let cancels = fake.calls_of("lease.cancel");
    assert_eq!(cancels.len(), 1);
    assert_eq!(cancels[0].input, json!({"requesterId": "agent-9"}));
    assert!(fake.leases().is_empty());
}

#[tokio::test]
async fn not_cancellable_waits_releases_the_grant_and_ends_cancelled() {
    let fake = FakeDaemon::new().unwrap();
    let (client, _cut) = pipe_client(&fake).await;
    let pending = queued(&fake, &client, CancelScript::NotCancellable).await;
    let err = guard(pending.abort()).await.unwrap_err();
    assert_eq!(err.code, ErrorCode::Cancelled);
    let released = fake.calls_of("lease.release");
    assert_eq!(released.len(), 1);
    assert_eq!(released[0].input, json!({"leaseId": "lse_1"}));
    assert!(fake.leases().is_empty());
}

#[tokio::test]
async fn not_found_answers_the_requests_own_outcome() {
    let fake = FakeDaemon::new().unwrap();
    let (client, _cut) = pipe_client(&fake).await;
    // It was granted meanwhile: the grant is the outcome, and nothing is released.
    let pending = queued(&fake, &client, CancelScript::NotFound(Ok(()))).await;
    let grant = guard(pending.abort()).await.unwrap();
    assert_eq!(grant.lease.requester_id, "agent-9");
    assert!(fake.calls_of("lease.release").is_empty());
    assert_eq!(fake.leases().len(), 1);
    // It failed meanwhile: that failure is the outcome.
    let timeout = ContractError::new(ErrorCode::QueueTimeout, "waited too long")
        .with_details(json!({"requestId": "req_1"}));
    let pending = queued(&fake, &client, CancelScript::NotFound(Err(timeout.clone()))).await;
    assert_eq!(guard(pending.abort()).await.unwrap_err(), timeout);
}

#[tokio::test]
async fn an_abort_future_withdraws_a_request_over_the_socket() {
    let fake = socket_fake().await;
    fake.script_request(RequestScript::Hold(vec![Progress::queued(3)]));
    fake.script_cancel(CancelScript::Cancelled);
    let client = socket_client(&fake, false).await;
    let (tx, rx) = oneshot::channel::<()>();
    let mut tx = Some(tx);
    let mut seen = Vec::new();
    let err = guard(client.request_lease(
        LeaseRequestInput::for_platform(Platform::Ios),
        |p| {
            seen.push(*p);
            if let Some(tx) = tx.take() {
                let _ = tx.send(());
            }
        },
        async {
            let _ = rx.await;
        },
    ))
    .await
    .unwrap_err();
    assert_eq!(err.code, ErrorCode::Cancelled);
    assert_eq!(seen, [Progress::queued(3)]);
    // No requester named: the daemon defaults it to the principal.
    assert_eq!(fake.calls_of("lease.cancel")[0].input, json!({}));
}
