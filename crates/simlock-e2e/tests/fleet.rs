//! The fleet, end to end in one process: a gateway and workers over real loopback WebSockets.

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    reason = "tests fail by panicking"
)]

use serde_json::json;
use simlock_contract::ErrorCode;
use simlock_e2e::{TestFleet, gateway_config, worker_config};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lease_through_the_gateway_lands_on_the_worker_and_renews_and_releases_there() {
    let mut fleet = TestFleet::start(gateway_config()).await;
    fleet.add_worker(worker_config(2)).await;
    let worker_id = fleet.worker_id(0);
    let agent = fleet.agent("agent-1").await;
    let grant = agent
        .call(
            "lease.request",
            json!({"platform": "ios", "model": "iphone"}),
        )
        .await
        .unwrap();
    let lease_id = grant["lease"]["id"].as_str().unwrap().to_owned();
    assert!(
        lease_id.starts_with(&format!("{worker_id}.lse_")),
        "{lease_id}"
    );
    assert_eq!(grant["lease"]["requesterId"], "agent-1");
    assert_eq!(grant["lease"]["worker"]["id"], worker_id.as_str());
    assert_eq!(grant["device"]["spec"]["model"], "iPhone 16");

    // The worker holds it under the gateway's namespaced requester.
    let leases = fleet.worker(0).worker.leases();
    assert_eq!(leases.len(), 1);
    assert!(
        leases[0].requester_id.starts_with("gw:"),
        "{}",
        leases[0].requester_id
    );
    assert!(leases[0].requester_id.ends_with(":agent-1"));
    assert_eq!(leases[0].owner_id, "agent-1");

    let renewed = agent
        .call("lease.renew", json!({"leaseId": lease_id}))
        .await
        .unwrap();
    assert_eq!(renewed["id"], lease_id.as_str());
    let again = agent
        .call("lease.request", json!({"platform": "ios"}))
        .await
        .unwrap_err();
    assert_eq!(again.code, ErrorCode::RequesterAlreadyLeased);
    assert_eq!(again.details.unwrap()["existingLeaseId"], lease_id.as_str());
    let released = agent
        .call("lease.release", json!({"leaseId": lease_id}))
        .await
        .unwrap();
    assert_eq!(released["leaseId"], lease_id.as_str());
    assert!(fleet.worker(0).worker.leases().is_empty());
    let err = agent
        .call("lease.renew", json!({"leaseId": lease_id}))
        .await
        .unwrap_err();
    assert_eq!(err.code, ErrorCode::UnknownLease);
    fleet.stop().await;
}
