//! Through a gateway: a real (fake-tooled) worker's grant reaches the agent with its access
//! details unchanged, over HTTP and over the gateway's socket, and the device's health pushes
//! reach the lease's owner under the gateway's lease id.

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    reason = "a test fails by panicking"
)]

mod support;

use simlock_client::{Client, ConnectOptions, LeaseNotice};
use simlock_contract::model::{LeaseGrant, Platform};
use simlock_contract::ops::LeaseRequestInput;
use simlock_contract::push::UnhealthyReason;
use simlock_e2e::{TestFleet, gateway_config};
use support::{Rig, android_access, next_notice, within};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_real_grants_access_details_reach_the_agent_unchanged_through_a_gateway() {
    let rig = Rig::new(Platform::Android);
    let mut fleet = TestFleet::start(gateway_config()).await;
    let n = fleet.add_worker(rig.config.clone()).await;
    let operator = fleet.operator().await;
    let token = operator
        .call(
            "token.create",
            serde_json::json!({"role": "agent", "label": "agent"}),
        )
        .await
        .unwrap();
    let secret = token["secret"].as_str().unwrap();
    let url = format!("http://{}", fleet.gateway().running.http_addr().unwrap());
    let agent = Client::over_http(&url, secret, ConnectOptions::default()).unwrap();

    let grant: LeaseGrant = within(
        "a lease through the gateway",
        agent.request_lease(
            LeaseRequestInput::for_platform(Platform::Android),
            |_| {},
            std::future::pending(),
        ),
    )
    .await
    .unwrap();
    let worker_leases = fleet.worker(n).worker.leases();
    assert_eq!(worker_leases.len(), 1);
    let at_worker = &worker_leases[0];
    assert_eq!(
        grant.device.access, at_worker.access,
        "the worker's access, unchanged"
    );
    let (serial, port, _) = android_access(&grant);
    assert_eq!(port, rig.config.drivers.android.adb_server_port);
    assert_eq!(grant.environment["ANDROID_SERIAL"], serial);
    assert_eq!(
        grant.environment["ANDROID_ADB_SERVER_PORT"],
        port.to_string()
    );
    assert_eq!(
        grant.environment["SIMLOCK_LEASE_ID"],
        grant.lease.id.as_str(),
        "the environment names the lease as the gateway's callers know it"
    );
    // The lease record shown later carries it too (what `simlock env` reads), once the gateway's
    // view of the worker holds the lease.
    fleet
        .wait_for(|views| {
            views
                .iter()
                .any(|v| v.leases.as_ref().is_some_and(|l| !l.is_empty()))
        })
        .await;
    let listed = agent.leases().await.unwrap().leases;
    assert_eq!(listed[0].access, grant.device.access);
    agent.release(grant.lease.id.as_str()).await.unwrap();

    // Over the gateway's socket: the raw grant JSON, and the health pushes of the device.
    let holder = Client::connect_socket(
        fleet.gateway().running.socket_path(),
        ConnectOptions::default().principal("holder"),
    )
    .await
    .unwrap();
    let grant = within(
        "a second lease through the gateway",
        holder.request_lease(
            LeaseRequestInput::for_platform(Platform::Android),
            |_| {},
            std::future::pending(),
        ),
    )
    .await
    .unwrap();
    let at_worker = fleet.worker(n).worker.leases();
    assert_eq!(grant.device.access, at_worker[0].access);
    let lease = grant.lease.id.to_string();
    assert!(lease.contains('.'), "a gateway lease id: {lease}");
    let mut notices = holder.lease_notices(&lease).await.unwrap();
    rig.machine
        .kill_emulator(&android_access(&grant).2)
        .unwrap();
    assert_eq!(
        next_notice(&mut notices).await,
        LeaseNotice::Unhealthy {
            lease_id: lease.clone(),
            device_id: grant.device.id.clone(),
            reason: UnhealthyReason::Crashed
        }
    );
    assert_eq!(
        next_notice(&mut notices).await,
        LeaseNotice::Recovered {
            lease_id: lease.clone(),
            device_id: grant.device.id.clone(),
            attempts: 1
        }
    );
    fleet.stop().await;
}
