//! The lease hold over an in-memory pipe, in paused time: renewals at a third of the TTL, and
//! the three ways a hold ends by itself.

use std::time::Duration;

use serde_json::json;
use simlock_contract::model::{LeaseEndReason, LeaseGrant, Platform};
use simlock_contract::ops::LeaseRequestInput;
use simlock_contract::push::UnhealthyReason;
use simlock_contract::{ContractError, ErrorCode, Push};
use tokio::time::Instant;

use super::{guard_paused, pipe_client};
use crate::{Client, HoldEnd, LeaseLost, LeaseNotice, Renewal};
use simlock_test_support::fake_daemon::FakeDaemon;

async fn grant(client: &Client, ttl_ms: u64) -> LeaseGrant {
    let mut input = LeaseRequestInput::for_platform(Platform::Ios);
    input.ttl_ms = Some(ttl_ms);
    client
        .request_lease(input, |_| {}, std::future::pending())
        .await
        .unwrap()
}

#[tokio::test(start_paused = true)]
async fn a_hold_renews_at_a_third_of_the_ttl_without_naming_one() {
    let fake = FakeDaemon::new().unwrap();
    let (client, _cut) = pipe_client(&fake).await;
    let grant = grant(&client, 30_000).await;
    let lease_id = grant.lease.id.to_string();
    let start = Instant::now();
    let hold = client.hold(grant);
    let renewals = guard_paused(fake.wait_for_calls("lease.renew", 3)).await;
    let offsets: Vec<Duration> = renewals.iter().map(|r| r.at - start).collect();
    assert_eq!(
        offsets,
        [
            Duration::from_secs(10),
            Duration::from_secs(20),
            Duration::from_secs(30)
        ]
    );
    assert!(
        renewals
            .iter()
            .all(|r| r.input == json!({"leaseId": lease_id}))
    );
    assert_eq!(guard_paused(hold.release()).await, HoldEnd::Released);
    assert_eq!(fake.calls_of("lease.renew").len(), 3);
    assert!(fake.leases().is_empty());
}

#[tokio::test(start_paused = true)]
async fn a_lease_lost_push_stops_the_hold() {
    let fake = FakeDaemon::new().unwrap();
    let (client, _cut) = pipe_client(&fake).await;
    let grant = grant(&client, 60_000).await;
    let lease_id = grant.lease.id.to_string();
    let mut hold = client.hold(grant);
    let mut health = hold.notices();
    fake.notify(
        "agent-1",
        &Push::DeviceUnhealthy {
            lease_id: lease_id.clone(),
            device_id: simlock_contract::ids::DeviceId::from_raw("dev_1"),
            reason: UnhealthyReason::Crashed,
        },
    );
    assert!(matches!(
        guard_paused(health.recv()).await.unwrap(),
        LeaseNotice::Unhealthy { .. }
    ));
    assert!(fake.end_lease(&lease_id, LeaseEndReason::Killed));
    assert_eq!(
        guard_paused(hold.ended()).await,
        HoldEnd::Lost(LeaseLost {
            lease_id: lease_id.clone(),
            reason: Some(LeaseEndReason::Killed)
        })
    );
    assert!(fake.calls_of("lease.renew").is_empty());
    // Releasing a lost hold sends nothing.
    assert!(matches!(
        guard_paused(hold.release()).await,
        HoldEnd::Lost(_)
    ));
    assert!(fake.calls_of("lease.release").is_empty());
}

#[tokio::test(start_paused = true)]
async fn unknown_lease_on_a_renewal_means_the_lease_is_lost() {
    let fake = FakeDaemon::new().unwrap();
    let (client, _cut) = pipe_client(&fake).await;
    let grant = grant(&client, 30_000).await;
    let lease_id = grant.lease.id.to_string();
    let start = Instant::now();
    let mut hold = client.hold(grant);
    assert!(fake.forget_lease(&lease_id));
    assert_eq!(
        guard_paused(hold.ended()).await,
        HoldEnd::Lost(LeaseLost {
            lease_id,
            reason: None
        })
    );
    assert_eq!(Instant::now() - start, Duration::from_secs(10));
}

/// Outside trial 24: a holder stopped (SIGSTOP) past its lease's deadline renews late and finds
/// the lease gone; it said only that the daemon no longer knew it. Past the deadline it knows,
/// the lease expired.
#[tokio::test(start_paused = true)]
async fn unknown_lease_on_a_renewal_past_the_deadline_means_it_expired() {
    let fake = FakeDaemon::new().unwrap();
    let (client, _cut) = pipe_client(&fake).await;
    let grant = grant(&client, 30_000).await;
    let lease_id = grant.lease.id.to_string();
    assert!(fake.forget_lease(&lease_id));
    // The renewal sent at 10 s is answered at 40 s, past the deadline, as a holder stopped
    // meanwhile reads it.
    fake.delay_renewals(Duration::from_secs(30));
    let mut hold = client.hold(grant);
    assert_eq!(
        guard_paused(hold.ended()).await,
        HoldEnd::Lost(LeaseLost {
            lease_id,
            reason: Some(LeaseEndReason::Expired)
        })
    );
}

#[tokio::test(start_paused = true)]
async fn a_lost_connection_fails_the_hold() {
    let fake = FakeDaemon::new().unwrap();
    let (client, cut) = pipe_client(&fake).await;
    let grant = grant(&client, 30_000).await;
    let mut hold = client.hold(grant);
    cut.cut();
    let HoldEnd::Failed(err) = guard_paused(hold.ended()).await else {
        panic!("the hold did not fail");
    };
    assert_eq!(err.code, ErrorCode::DaemonConnectionLost);
}

#[tokio::test(start_paused = true)]
async fn renewals_that_fail_are_said_once_retried_until_the_ttl_and_said_again_when_they_pass() {
    let fake = FakeDaemon::new().unwrap();
    let (client, _cut) = pipe_client(&fake).await;
    let grant = grant(&client, 30_000).await;
    let start = Instant::now();
    let hold = client.hold(grant);
    let mut renewal = hold.renewal();
    assert_eq!(*renewal.borrow(), Renewal::Renewing);
    fake.fail_renewals(Some(unreachable()));
    guard_paused(renewal.changed()).await.unwrap();
    let Renewal::Retrying { error, deadline } = renewal.borrow_and_update().clone() else {
        panic!("not retrying");
    };
    assert_eq!(error.code, ErrorCode::WorkerUnreachable);
    // The first renewal, at a third of the TTL, failed: the lease lasts until its TTL.
    assert_eq!(Instant::now() - start, Duration::from_secs(10));
    assert_eq!(deadline - start, Duration::from_secs(30));
    // Retries (every tenth of the TTL) change nothing to say.
    guard_paused(fake.wait_for_calls("lease.renew", 3)).await;
    assert!(!renewal.has_changed().unwrap());
    fake.fail_renewals(None);
    guard_paused(renewal.changed()).await.unwrap();
    assert_eq!(*renewal.borrow_and_update(), Renewal::Renewing);
    assert_eq!(guard_paused(hold.release()).await, HoldEnd::Released);
}

#[tokio::test(start_paused = true)]
async fn a_renewal_the_daemon_fails_internally_is_retried_and_the_hold_goes_on_once_it_passes() {
    let fake = FakeDaemon::new().unwrap();
    let (client, _cut) = pipe_client(&fake).await;
    let grant = grant(&client, 30_000).await;
    let hold = client.hold(grant);
    let mut renewal = hold.renewal();
    // A worker whose disk is full answers what its store said.
    fake.fail_renewals(Some(ContractError::new(
        ErrorCode::Internal,
        "the worker's state store failed (state store: database or disk is full)",
    )));
    guard_paused(renewal.changed()).await.unwrap();
    let Renewal::Retrying { error, .. } = renewal.borrow_and_update().clone() else {
        panic!("not retrying");
    };
    assert_eq!(error.code, ErrorCode::Internal);
    guard_paused(fake.wait_for_calls("lease.renew", 3)).await;
    fake.fail_renewals(None);
    guard_paused(renewal.changed()).await.unwrap();
    assert_eq!(*renewal.borrow_and_update(), Renewal::Renewing);
    assert_eq!(guard_paused(hold.release()).await, HoldEnd::Released);
}

#[tokio::test(start_paused = true)]
async fn renewals_that_fail_until_the_ttl_end_the_hold_with_their_error() {
    let fake = FakeDaemon::new().unwrap();
    let (client, _cut) = pipe_client(&fake).await;
    let grant = grant(&client, 30_000).await;
    let start = Instant::now();
    let mut hold = client.hold(grant);
    fake.fail_renewals(Some(unreachable()));
    let HoldEnd::Failed(error) = guard_paused(hold.ended()).await else {
        panic!("the hold did not fail");
    };
    assert_eq!(error.code, ErrorCode::WorkerUnreachable);
    // Renewals at 10 s, then every tenth of the TTL: the one at 28 s is the last before the
    // TTL runs out at 30 s.
    assert_eq!(Instant::now() - start, Duration::from_secs(28));
    assert_eq!(fake.calls_of("lease.renew").len(), 7);
}

/// What a gateway answers a renewal while the lease's worker is away.
fn unreachable() -> ContractError {
    ContractError::new(
        ErrorCode::WorkerUnreachable,
        "Worker w1 is not connected to this gateway",
    )
}
