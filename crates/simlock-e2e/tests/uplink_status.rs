//! A worker's `status.get` says how its uplink stands (`uplink`): `connected` once its gateway
//! took it; `connecting` with the rejection in `lastError` when its join token is refused, since
//! the time it began dialling however many attempts fail; and a `gateway.url` pasted with the
//! uplink path joins as well. A gateway's own status has no `uplink`.
//!
//! Each wait is on the worker's uplink state or the gateway's views, bounded by [`PATIENCE`].

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    reason = "tests fail by panicking"
)]

use serde_json::json;
use simlock_contract::model::{Connection, UplinkConnection, UplinkStatus};
use simlock_contract::ops::StatusOutput;
use simlock_daemon::uplink::UplinkState;
use simlock_e2e::{PATIENCE, TestFleet, gateway_config, session, worker_config};
use simlock_worker::{RunningWorker, WorkerOptions};

/// Waits until `worker`'s uplink state satisfies `done` (checking the state it is in first,
/// then each change), and answers it.
async fn uplink_until(worker: &RunningWorker, done: impl Fn(&UplinkState) -> bool) -> UplinkState {
    let mut state = worker.uplink.clone().expect("the worker dials");
    tokio::time::timeout(PATIENCE, async {
        loop {
            let now = state.borrow_and_update().clone();
            if done(&now) {
                return now;
            }
            state.changed().await.expect("the worker runs");
        }
    })
    .await
    .expect("the uplink reached the expected state within the bound")
}

/// Waits for the next change of `worker`'s uplink state that satisfies `done`.
async fn next_uplink(
    state: &mut tokio::sync::watch::Receiver<UplinkState>,
    done: impl Fn(&UplinkState) -> bool,
) -> UplinkState {
    tokio::time::timeout(PATIENCE, async {
        loop {
            state.changed().await.expect("the worker runs");
            let now = state.borrow_and_update().clone();
            if done(&now) {
                return now;
            }
        }
    })
    .await
    .expect("the uplink changed within the bound")
}

/// `worker`'s `status.get`, asked over its own socket by an agent: the typed output and the
/// JSON as sent.
async fn worker_status(worker: &RunningWorker) -> (StatusOutput, serde_json::Value) {
    let agent = session(&worker.running.socket_path(), "ops", None).await;
    let value = agent.call("status.get", json!({})).await.unwrap();
    let typed = serde_json::from_value(value.clone()).expect("status.get's output");
    (typed, value)
}

/// Wall time now, in ms since the epoch (the workers here read the system's clock).
fn now_ms() -> i64 {
    i64::try_from(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_millis(),
    )
    .unwrap()
}

fn rejected(state: &UplinkState) -> bool {
    matches!(
        state,
        UplinkState::Connecting { last_error: Some(error) } if error.contains("401")
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_in_the_fleet_reports_its_uplink_connected() {
    let mut fleet = TestFleet::start(gateway_config()).await;
    let before = now_ms();
    let n = fleet.add_worker(worker_config(1)).await;
    let worker = fleet.worker(n);
    uplink_until(worker, |s| *s == UplinkState::Connected).await;

    let (status, value) = worker_status(worker).await;
    let uplink = status
        .uplink
        .expect("a worker with gateway.url reports its uplink");
    assert_eq!(uplink.gateway, fleet.gateway_url(), "as configured");
    assert_eq!(uplink.state, UplinkConnection::Connected);
    assert_eq!(uplink.last_error, None);
    assert!(
        (before..=now_ms()).contains(&uplink.since),
        "connected since it joined: {} not in [{before}, now]",
        uplink.since
    );
    assert_eq!(value["uplink"]["state"], "connected", "{value}");
    assert!(value["uplink"].get("lastError").is_none(), "{value}");

    // The gateway's own status has no uplink.
    let gateway = fleet.operator().await;
    let value = gateway.call("status.get", json!({})).await.unwrap();
    assert!(value.get("uplink").is_none(), "{value}");
    fleet.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_whose_join_token_is_rejected_reports_connecting_with_the_rejection() {
    let fleet = TestFleet::start(gateway_config()).await;
    let mut config = worker_config(1);
    let url = fleet.gateway_url();
    config.daemon.gateway.url = Some(url.clone());
    config.daemon.gateway.token = Some("not-the-join-token".into());
    let before = now_ms();
    let worker = simlock_worker::start(WorkerOptions::new(fleet.worker_home(0), config))
        .await
        .expect("a rejected join is retried, not a start-up error");

    let mut state = worker.uplink.clone().unwrap();
    uplink_until(&worker, rejected).await;
    let (status, value) = worker_status(&worker).await;
    let expected = |since| {
        UplinkStatus {
        gateway: url.clone(),
        state: UplinkConnection::Connecting,
        last_error: Some("rejected with HTTP 401: the gateway refused the join token (unknown or revoked): check gateway.token".into()),
        since,
    }
    };
    let uplink = status.uplink.expect("the uplink is reported");
    assert_eq!(uplink, expected(uplink.since));
    assert!(
        (before..=now_ms()).contains(&uplink.since),
        "connecting since the worker began dialling: {} not in [{before}, now]",
        uplink.since
    );
    assert_eq!(value["uplink"]["state"], "connecting", "{value}");
    assert_eq!(
        value["uplink"]["lastError"],
        "rejected with HTTP 401: the gateway refused the join token (unknown or revoked): check gateway.token",
        "{value}"
    );

    // The next attempt is rejected too: still connecting since the same time.
    state.borrow_and_update();
    next_uplink(&mut state, rejected).await;
    let (again, _) = worker_status(&worker).await;
    assert_eq!(again.uplink, Some(expected(uplink.since)));
    assert!(
        fleet.gateway().fleet.views().is_empty(),
        "a rejected worker never joins"
    );
    worker.stop("test").await;
    fleet.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gateway_url_pasted_with_the_uplink_path_joins_and_is_reported_as_configured() {
    let fleet = TestFleet::start(gateway_config()).await;
    let mut config = worker_config(1);
    let pasted = format!("{}/v1/uplink/", fleet.gateway_url());
    config.daemon.gateway.url = Some(pasted.clone());
    config.daemon.gateway.token = Some(fleet.join_token.clone());
    let worker = simlock_worker::start(WorkerOptions::new(fleet.worker_home(0), config))
        .await
        .expect("the worker starts");
    // The first attempt's outcome: up, or why not (a doubled path is answered 404).
    let first = uplink_until(&worker, |s| {
        matches!(
            s,
            UplinkState::Connected
                | UplinkState::Connecting {
                    last_error: Some(_)
                }
        )
    })
    .await;
    assert_eq!(first, UplinkState::Connected, "{pasted}");
    let id = worker.running.base.instance_id.clone();
    fleet
        .wait_for(|views| {
            views
                .iter()
                .any(|v| v.id == id && v.connection == Connection::Connected)
        })
        .await;
    let (status, _) = worker_status(&worker).await;
    let uplink = status.uplink.expect("the uplink is reported");
    assert_eq!(
        (uplink.gateway.as_str(), uplink.state),
        (pasted.as_str(), UplinkConnection::Connected)
    );
    worker.stop("test").await;
    fleet.stop().await;
}
