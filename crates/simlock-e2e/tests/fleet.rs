//! The fleet, end to end in one process: a gateway and workers over real loopback WebSockets.

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    reason = "tests fail by panicking"
)]

use serde_json::{Value, json};
use simlock_contract::ErrorCode;
use simlock_e2e::{TestFleet, gateway_config, worker_config};

/// The lease id of a `lease.request` answer.
fn lease_id(grant: &Value) -> String {
    grant["lease"]["id"].as_str().unwrap().to_owned()
}

/// A session of agent `name` on the gateway holding an iOS lease: the session and the lease id.
async fn ios_lease(fleet: &TestFleet, name: &str) -> (simlock_e2e::Session, String) {
    let agent = fleet.agent(name).await;
    let grant = agent
        .call("lease.request", json!({"platform": "ios"}))
        .await
        .unwrap();
    (agent, lease_id(&grant))
}

/// The next push `holder` gets, which must be a `lease-lost`: its lease id, reason and device.
async fn lease_lost(
    holder: &mut simlock_e2e::Session,
) -> (
    String,
    simlock_contract::model::LeaseEndReason,
    simlock_contract::ids::DeviceId,
) {
    let push = tokio::time::timeout(PATIENCE, holder.pushes.recv())
        .await
        .expect("the holder is told")
        .unwrap();
    match Push::from_frame(push).unwrap() {
        Push::LeaseLost {
            lease_id,
            reason,
            device_id,
        } => (lease_id, reason, device_id),
        other => panic!("expected lease-lost, got {other:?}"),
    }
}

/// An operator session on the gateway subscribed to its events (worker events it relays
/// included).
async fn subscriber(fleet: &TestFleet) -> simlock_e2e::Session {
    let operator = fleet.operator().await;
    let answer = operator.call("events.subscribe", json!({})).await.unwrap();
    assert_eq!(answer["subscribed"], true);
    operator
}

/// Waits until the gateway relays `event` about the worker's lease `worker_lease` (any lease with
/// `None`) to `subscriber`; the event, as pushed. Once it is relayed, the gateway handled the
/// worker's push to its end.
async fn relayed(
    subscriber: &mut simlock_e2e::Session,
    event: &str,
    worker_lease: Option<&str>,
) -> simlock_contract::model::EventEnvelope {
    loop {
        let frame = tokio::time::timeout(PATIENCE, subscriber.pushes.recv())
            .await
            .unwrap_or_else(|_| panic!("{event} for {worker_lease:?} was relayed in time"))
            .expect("the session is open");
        if let Ok(Push::Event {
            event: envelope, ..
        }) = Push::from_frame(frame)
            && envelope.event == event
            && worker_lease.is_none_or(|lease| envelope.payload["leaseId"] == lease)
        {
            return envelope;
        }
    }
}

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
    let lease_id = lease_id(&grant);
    assert!(
        lease_id.starts_with(&format!("{worker_id}.lse_")),
        "{lease_id}"
    );
    assert_eq!(grant["lease"]["requesterId"], "agent-1");
    assert_eq!(grant["lease"]["worker"]["id"], worker_id.as_str());
    assert_eq!(grant["device"]["spec"]["model"], "iPhone 16");
    assert_eq!(
        grant["environment"]["SIMLOCK_LEASE_ID"],
        lease_id.as_str(),
        "the environment names the gateway's lease id"
    );

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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_renew_updates_the_gateways_view_in_place_without_a_refresh() {
    // No periodic refresh lands inside the window the test counts.
    let mut fleet = TestFleet::start_with(gateway_config(), |timing| {
        timing.refresh_interval = std::time::Duration::from_secs(3600);
    })
    .await;
    fleet.add_worker(worker_config(1)).await;
    let worker_id = fleet.worker_id(0);
    let mut events = subscriber(&fleet).await;
    let agent = fleet.agent("agent-1").await;
    let grant = agent
        .call("lease.request", json!({"platform": "ios", "ttlMs": 60_000}))
        .await
        .unwrap();
    let lease_id = lease_id(&grant);
    let worker_lease = lease_id
        .strip_prefix(&format!("{worker_id}."))
        .unwrap()
        .to_owned();
    // The grant's events refresh the view. Once lease.granted is relayed, the gateway asked for
    // every refresh the grant brings (it asks before it relays); then wait until the view shows
    // the lease and the leased device.
    relayed(&mut events, "lease.granted", Some(&worker_lease)).await;
    fleet
        .wait_for(|views| {
            views.iter().any(|v| {
                v.id == worker_id
                    && v.leases
                        .iter()
                        .flatten()
                        .any(|l| l.id.as_str() == worker_lease)
                    && v.devices
                        .iter()
                        .flatten()
                        .any(|d| d.state == DeviceState::Leased)
            })
        })
        .await;
    let conn = fleet.gateway().fleet.conn(&worker_id).unwrap();
    let asked = conn.refreshes_asked();
    let deadline_of = |fleet: &simlock_fleet::Fleet| {
        fleet
            .view(&worker_id)
            .and_then(|v| v.leases)
            .and_then(|leases| leases.into_iter().find(|l| l.id.as_str() == worker_lease))
            .map(|l| l.ttl_deadline)
    };
    let before = deadline_of(&fleet.gateway().fleet).unwrap();
    let mut last = before;
    // Longer TTLs each time, so each deadline moves even within one millisecond. The second
    // renew's event follows the first's through the same uplink: once the view shows it, the
    // first event was handled to its end.
    for ttl in [120_000, 180_000] {
        let renewed = agent
            .call("lease.renew", json!({"leaseId": lease_id, "ttlMs": ttl}))
            .await
            .unwrap();
        let deadline = renewed["ttlDeadline"].as_i64().unwrap();
        assert!(deadline > last, "the renew moved the deadline");
        last = deadline;
        fleet
            .wait_until(|fleet| deadline_of(fleet) == Some(deadline))
            .await;
        let view = fleet.gateway().fleet.view(&worker_id).unwrap();
        let record = view
            .leases
            .unwrap()
            .into_iter()
            .find(|l| l.id.as_str() == worker_lease)
            .unwrap();
        assert!(
            record.last_renewed_at >= renewed["lastRenewedAt"].as_i64().unwrap(),
            "lastRenewedAt moved with it"
        );
    }
    assert_eq!(
        conn.refreshes_asked(),
        asked,
        "the lease.renewed event asked for no refresh of the view"
    );
    fleet.stop().await;
}

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use futures::FutureExt;
use futures::future::BoxFuture;
use simlock_contract::model::{Connection, DeviceState};
use simlock_contract::{ContractError, Hello, ProtocolRange, Push};
use simlock_e2e::{PATIENCE, fake_worker, greet_gateway, session};
use simlock_test_support::fake_worker::bookkeeping_or_refuse;
use simlock_wire::{CallContext, Identity, Origin, Service};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_warm_device_wins_and_otherwise_the_worker_with_the_most_free_capacity() {
    let mut fleet = TestFleet::start(gateway_config()).await;
    fleet.add_worker(worker_config(1)).await;
    fleet.add_worker(worker_config(3)).await;
    let (small, big) = (fleet.worker_id(0), fleet.worker_id(1));
    // A lease made and released on the small worker directly leaves it a warm device.
    let local = session(&fleet.worker(0).running.socket_path(), "local", None).await;
    let grant = local
        .call(
            "lease.request",
            json!({"platform": "android", "model": "pixel8"}),
        )
        .await
        .unwrap();
    local
        .call("lease.release", json!({"leaseId": grant["lease"]["id"]}))
        .await
        .unwrap();
    fleet
        .wait_for(|views| {
            views.iter().any(|v| {
                v.id == small
                    && v.devices
                        .as_deref()
                        .unwrap_or_default()
                        .iter()
                        .any(|d| d.state == DeviceState::Ready)
            })
        })
        .await;

    let agent = fleet.agent("agent-1").await;
    let warm = agent
        .call(
            "lease.request",
            json!({"platform": "android", "model": "Pixel 8"}),
        )
        .await
        .unwrap();
    assert_eq!(
        warm["lease"]["worker"]["id"],
        small.as_str(),
        "the warm device wins over free capacity"
    );
    let other = fleet.agent("agent-2").await;
    let free = other
        .call(
            "lease.request",
            json!({"platform": "android", "model": "Pixel 8"}),
        )
        .await
        .unwrap();
    assert_eq!(
        free["lease"]["worker"]["id"],
        big.as_str(),
        "then the most free capacity"
    );
    fleet.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn required_capabilities_route_only_to_the_workers_listing_them() {
    let mut fleet = TestFleet::start(gateway_config()).await;
    let mut capable = worker_config(6);
    capable.daemon.capabilities = vec!["gpu".into()];
    fleet.add_worker(worker_config(6)).await;
    fleet.add_worker(capable).await;
    let gpu_worker = fleet.worker_id(1);
    for n in 0..5 {
        let agent = fleet.agent(&format!("agent-{n}")).await;
        let grant = agent
            .call(
                "lease.request",
                json!({"platform": "ios", "requires": ["gpu"]}),
            )
            .await
            .unwrap();
        assert_eq!(
            grant["lease"]["worker"]["id"],
            gpu_worker.as_str(),
            "request {n}"
        );
    }
    assert_eq!(fleet.worker(1).worker.leases().len(), 5);
    assert!(fleet.worker(0).worker.leases().is_empty());

    let agent = fleet.agent("agent-x").await;
    let err = agent
        .call(
            "lease.request",
            json!({"platform": "ios", "requires": ["tv-remote"]}),
        )
        .await
        .unwrap_err();
    assert_eq!(err.code, ErrorCode::CapabilityMissing);
    assert_eq!(
        err.message,
        "No worker connected to this gateway can serve tv-remote for this request"
    );
    assert_eq!(err.details.unwrap()["capability"], "tv-remote");
    assert_eq!(
        fleet.worker(0).worker.leases().len() + fleet.worker(1).worker.leases().len(),
        5,
        "nothing more was leased"
    );
    fleet.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_uplink_answers_worker_unreachable_and_the_lease_renews_once_it_is_back() {
    let mut fleet = TestFleet::start(gateway_config()).await;
    fleet.add_worker(worker_config(2)).await;
    let worker_id = fleet.worker_id(0);
    let agent = fleet.agent("agent-1").await;
    let grant = agent
        .call(
            "lease.request",
            json!({"platform": "ios", "ttlMs": 600_000}),
        )
        .await
        .unwrap();
    let lease_id = lease_id(&grant);

    fleet.stop_worker_seen_away(0).await;
    let err = agent
        .call("lease.renew", json!({"leaseId": lease_id}))
        .await
        .unwrap_err();
    assert_eq!(err.code, ErrorCode::WorkerUnreachable);
    assert_eq!(err.details.unwrap()["workerId"], worker_id.as_str());
    // An operator's release (`killed`) needs the worker too; a holder's is answered at once
    // (`a_release_while_the_worker_is_away_…`).
    let err = fleet
        .operator()
        .await
        .call(
            "lease.release",
            json!({"leaseId": lease_id, "reason": "killed"}),
        )
        .await
        .unwrap_err();
    assert_eq!(err.code, ErrorCode::WorkerUnreachable);

    // The worker comes back with its lease from disk; the index is rebuilt from its view.
    fleet.restart_worker(0, worker_config(2)).await;
    let renewed = agent
        .call("lease.renew", json!({"leaseId": lease_id}))
        .await
        .unwrap();
    assert_eq!(renewed["id"], lease_id.as_str());
    assert_eq!(renewed["requesterId"], "agent-1");
    fleet.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_uplink_closed_by_the_gateway_comes_back_on_its_own() {
    let mut fleet = TestFleet::start(gateway_config()).await;
    fleet.add_worker(worker_config(2)).await;
    let worker_id = fleet.worker_id(0);
    let (agent, lease_id) = ios_lease(&fleet, "agent-1").await;
    let first = fleet.gateway().fleet.conn(&worker_id).unwrap();
    first.close();
    fleet
        .wait_until(|f| {
            f.conn(&worker_id)
                .is_some_and(|c| c.generation != first.generation)
                && f.view(&worker_id)
                    .is_some_and(|v| v.catalog_read_at.is_some())
        })
        .await;
    agent
        .call("lease.renew", json!({"leaseId": lease_id}))
        .await
        .unwrap();
    fleet.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gateway_restart_keeps_every_lease() {
    let config = gateway_config();
    let mut fleet = TestFleet::start(config.clone()).await;
    fleet.add_worker(worker_config(2)).await;
    fleet.add_worker(worker_config(2)).await;
    let mut leases = Vec::new();
    for n in 0..3 {
        let agent = fleet.agent(&format!("agent-{n}")).await;
        let grant = agent
            .call("lease.request", json!({"platform": "ios"}))
            .await
            .unwrap();
        leases.push((format!("agent-{n}"), lease_id(&grant)));
    }
    fleet.restart_gateway(config).await;
    let ids = [fleet.worker_id(0), fleet.worker_id(1)];
    fleet
        .wait_for(|views| {
            ids.iter().all(|id| {
                views.iter().any(|v| {
                    &v.id == id && v.connection == Connection::Connected && v.leases.is_some()
                })
            })
        })
        .await;
    for (agent, lease_id) in &leases {
        let session = fleet.agent(agent).await;
        let renewed = session
            .call("lease.renew", json!({"leaseId": lease_id}))
            .await
            .unwrap();
        assert_eq!(renewed["id"], lease_id.as_str());
        let again = session
            .call("lease.request", json!({"platform": "ios"}))
            .await
            .unwrap_err();
        assert_eq!(
            again.code,
            ErrorCode::RequesterAlreadyLeased,
            "the one-lease rule holds after a restart"
        );
    }
    fleet.stop().await;
}

/// A fleet of one worker (two slots) and an iOS lease of `agent-0` on it, then the worker
/// stopped: the fleet, the agent's session, the gateway's lease id and the worker's.
async fn a_lease_whose_worker_stopped(
    config: &simlock_gateway::GatewayConfig,
) -> (TestFleet, simlock_e2e::Session, String, String) {
    let mut fleet = TestFleet::start(config.clone()).await;
    fleet.add_worker(worker_config(2)).await;
    let (agent, lease_id) = ios_lease(&fleet, "agent-0").await;
    let worker_lease = lease_id
        .split_once('.')
        .map(|(_, id)| id.to_owned())
        .unwrap();
    fleet.stop_worker(0).await;
    (fleet, agent, lease_id, worker_lease)
}

/// A holder's release while its worker is away is answered at once; the gateway keeps it
/// through a restart (stored), and the worker releases the lease once it is back. Meanwhile the
/// lease reads as gone, and no view brings it back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_release_while_the_worker_is_away_survives_a_gateway_restart_and_ends_the_lease_on_the_worker()
 {
    let config = gateway_config();
    let (mut fleet, agent, lease_id, worker_lease) = a_lease_whose_worker_stopped(&config).await;
    let released = agent
        .call("lease.release", json!({"leaseId": lease_id}))
        .await
        .unwrap();
    assert_eq!(released, json!({"leaseId": lease_id}));
    let read = agent
        .call("lease.get", json!({"leaseId": lease_id}))
        .await
        .unwrap_err();
    assert_eq!(read.code, ErrorCode::UnknownLease, "{read:?}");
    drop(agent);
    // An operator sees the release the worker owes, through a gateway restart too.
    let releasing = |workers: Value| workers["workers"][0]["releasing"].clone();
    let operator = fleet.operator().await;
    let workers = operator.call("worker.list", json!({})).await.unwrap();
    assert_eq!(releasing(workers), json!([worker_lease]));

    fleet.restart_gateway(config).await;
    let workers = fleet
        .operator()
        .await
        .call("worker.list", json!({}))
        .await
        .unwrap();
    assert_eq!(releasing(workers), json!([worker_lease]));
    fleet.restart_worker(0, worker_config(2)).await;
    fleet.wait_connected_holding_none(0).await;
    assert!(
        fleet.worker(0).worker.lease(&worker_lease).is_none(),
        "the worker released it"
    );
    fleet
        .wait_until(|f| {
            f.views_seen_by(simlock_daemon::context::Viewer::ADMIN)
                .iter()
                .all(|v| v.releasing.is_empty())
        })
        .await;
    let agent = fleet.agent("agent-0").await;
    let listed = agent.call("lease.list", json!({})).await.unwrap();
    assert_eq!(listed, json!({"leases": []}));
    fleet.stop().await;
}

/// Trial 19: a holder's release while its worker is away that the gateway cannot store (its
/// disk full) is not answered as kept: the caller hears why, `INTERNAL`, and that the release is
/// still carried out once the worker is back unless the gateway restarts first.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_release_while_the_worker_is_away_that_cannot_be_stored_is_not_answered_as_kept() {
    let (mut fleet, agent, lease_id, worker_lease) =
        a_lease_whose_worker_stopped(&gateway_config()).await;
    // The gateway's store refuses to keep a release, as a full disk does.
    let db = simlock_daemon::store::Database::open(&fleet.gateway_home().database()).unwrap();
    db.with(|c| {
        c.execute_batch(
            "CREATE TRIGGER full_disk BEFORE INSERT ON orphan_leases
             BEGIN SELECT RAISE(FAIL, 'database or disk is full'); END;",
        )
    })
    .unwrap();
    let refused = agent
        .call("lease.release", json!({"leaseId": lease_id}))
        .await
        .unwrap_err();
    assert!(refused.is_release_not_stored(), "{refused:?}");
    assert!(
        refused.message.contains("could not be stored yet (")
            && refused.message.contains("database or disk is full")
            && refused
                .message
                .contains("it is stored once the disk has room")
            && refused.message.contains("release it again then"),
        "{}",
        refused.message
    );
    assert!(fleet.gateway().fleet.stored_orphans().unwrap().is_empty());
    // The disk has room again: the gateway's next decision (here another agent's request)
    // stores the release, so a restart now keeps it.
    db.with(|c| c.execute_batch("DROP TRIGGER full_disk"))
        .unwrap();
    let other = fleet.agent("agent-1").await;
    let _ = other
        .call("lease.request", json!({"platform": "ios", "noWait": true}))
        .await;
    let stored = fleet.gateway().fleet.stored_orphans().unwrap();
    assert_eq!(stored.len(), 1, "{stored:?}");
    assert_eq!(stored[0].worker_lease_id, worker_lease);
    // Decided all the same: the worker releases it once it is back, and the row goes.
    fleet.restart_worker(0, worker_config(2)).await;
    fleet.wait_connected_holding_none(0).await;
    assert!(fleet.worker(0).worker.lease(&worker_lease).is_none());
    fleet
        .wait_until(|f| f.stored_orphans().unwrap().is_empty())
        .await;
    fleet.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn after_a_gateway_restart_a_lease_whose_worker_is_not_back_reads_as_unreachable_not_gone() {
    let config = gateway_config();
    let mut fleet = TestFleet::start(config.clone()).await;
    fleet.add_worker(worker_config(2)).await;
    let worker_id = fleet.worker_id(0);
    let (agent, lease_id) = ios_lease(&fleet, "agent-0").await;
    drop(agent);
    // The worker is away (its lease stays on its disk) while the gateway restarts.
    fleet.stop_worker(0).await;
    fleet.restart_gateway(config).await;
    // `lease.get`, which `GET /v1/leases/{id}`, its events and `simlock env` read.
    let session = fleet.agent("agent-0").await;
    let read = session
        .call("lease.get", json!({"leaseId": lease_id}))
        .await
        .unwrap_err();
    assert_eq!(read.code, ErrorCode::WorkerUnreachable, "{read:?}");
    let renew = session
        .call("lease.renew", json!({"leaseId": lease_id}))
        .await
        .unwrap_err();
    assert_eq!(
        (read.code, read.message.clone()),
        (renew.code, renew.message),
        "the read answers as renew does"
    );
    assert_eq!(read.details.unwrap()["workerId"], worker_id.as_str());
    // Its owner's list does not hold it, and says which worker's leases it lacks.
    let listed = session.call("lease.list", json!({})).await.unwrap();
    assert_eq!(listed["leases"], json!([]), "{listed}");
    assert_eq!(
        listed["unreadWorkers"][0]["id"],
        worker_id.as_str(),
        "{listed}"
    );
    assert_eq!(
        listed["unreadWorkers"][0]["connection"], "disconnected",
        "{listed}"
    );
    fleet.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_drained_worker_takes_no_new_lease_and_still_serves_its_own() {
    let mut fleet = TestFleet::start(gateway_config()).await;
    fleet.add_worker(worker_config(3)).await;
    let worker_id = fleet.worker_id(0);
    let (agent, lease_id) = ios_lease(&fleet, "agent-1").await;
    let operator = fleet.operator().await;
    let drained = operator
        .call("worker.drain", json!({"workerId": worker_id}))
        .await
        .unwrap();
    assert_eq!(
        drained,
        json!({"workerId": worker_id, "drained": true, "changed": true})
    );
    // Again: nothing changes, and the answer says so.
    let again = operator
        .call("worker.drain", json!({"workerId": worker_id}))
        .await
        .unwrap();
    assert_eq!(
        again,
        json!({"workerId": worker_id, "drained": true, "changed": false})
    );

    let other = fleet.agent("agent-2").await;
    let err = other
        .call("lease.request", json!({"platform": "ios", "noWait": true}))
        .await
        .unwrap_err();
    assert_eq!(err.code, ErrorCode::NoCapacity);
    agent
        .call("lease.renew", json!({"leaseId": lease_id}))
        .await
        .unwrap();
    agent
        .call("lease.release", json!({"leaseId": lease_id}))
        .await
        .unwrap();

    let undrained = operator
        .call("worker.undrain", json!({"workerId": worker_id}))
        .await
        .unwrap();
    assert_eq!(
        undrained,
        json!({"workerId": worker_id, "drained": false, "changed": true})
    );
    other
        .call("lease.request", json!({"platform": "ios"}))
        .await
        .unwrap();
    let err = operator
        .call("worker.drain", json!({"workerId": "nobody"}))
        .await
        .unwrap_err();
    assert_eq!(err.code, ErrorCode::UnknownWorker);
    // A worker is named by its label too, when no other worker has it: the answer says its id.
    for (op, drained) in [("worker.drain", true), ("worker.undrain", false)] {
        let answer = operator
            .call(op, json!({"workerId": "worker-0"}))
            .await
            .unwrap();
        assert_eq!(
            answer,
            json!({"workerId": worker_id, "drained": drained, "changed": true})
        );
    }
    fleet.stop().await;
}

/// A worker that answers everything with its own protocol range; status.get can be made to hang.
#[derive(Default)]
struct FakeWorker {
    status_calls: AtomicUsize,
    hang_after: Option<usize>,
}

impl Service for FakeWorker {
    fn greet(&self, _origin: Origin, hello: &Hello) -> Result<Identity, ContractError> {
        greet_gateway(hello)
    }

    fn dispatch(
        &self,
        _ctx: CallContext,
        op: String,
        _payload: Option<Value>,
    ) -> BoxFuture<'static, Result<Value, ContractError>> {
        let calls = if op == "status.get" {
            self.status_calls.fetch_add(1, Ordering::SeqCst) + 1
        } else {
            0
        };
        let hang = self.hang_after.is_some_and(|after| calls > after);
        async move {
            if hang {
                futures::future::pending::<()>().await;
            }
            bookkeeping_or_refuse(&op, "fake")
        }
        .boxed()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_one_protocol_version_behind_is_incompatible_and_gets_no_request() {
    let fleet = TestFleet::start(gateway_config()).await;
    let _link = fake_worker(
        &fleet.gateway_url(),
        &fleet.join_token,
        "old-worker",
        Arc::new(FakeWorker::default()),
        ProtocolRange { min: 0, max: 0 },
    )
    .await;
    fleet
        .wait_for(|views| {
            views
                .iter()
                .any(|v| v.id == "old-worker" && v.connection == Connection::Incompatible)
        })
        .await;
    let view = fleet.gateway().fleet.view("old-worker").unwrap();
    let protocol = view.protocol.unwrap();
    assert_eq!(protocol.worker, ProtocolRange { min: 0, max: 0 });
    assert_eq!(protocol.gateway, simlock_contract::PROTOCOL_RANGE);
    let agent = fleet.agent("agent-1").await;
    let err = agent
        .call("lease.request", json!({"platform": "ios", "noWait": true}))
        .await
        .unwrap_err();
    assert_eq!(err.code, ErrorCode::NoCapacity);
    fleet.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_status_timeouts_in_a_row_close_the_uplink() {
    let fleet = TestFleet::start_with(gateway_config(), |timing| {
        // The bound covers the handshake and the first probe too: long enough for a loaded
        // machine to answer those, short enough that two hung reads pass quickly.
        timing.call_timeout = std::time::Duration::from_secs(1);
        timing.refresh_interval = std::time::Duration::from_millis(50);
    })
    .await;
    let fake = Arc::new(FakeWorker {
        hang_after: Some(1),
        ..FakeWorker::default()
    });
    let link = fake_worker(
        &fleet.gateway_url(),
        &fleet.join_token,
        "slow-worker",
        fake.clone(),
        simlock_contract::PROTOCOL_RANGE,
    )
    .await;
    let closed = tokio::time::timeout(PATIENCE, link.closed()).await;
    assert!(closed.is_ok(), "the gateway closed the uplink");
    assert!(
        fake.status_calls.load(Ordering::SeqCst) >= 3,
        "the probe, then two reads that timed out"
    );
    fleet
        .wait_for(|views| {
            views
                .iter()
                .any(|v| v.id == "slow-worker" && v.connection == Connection::Disconnected)
        })
        .await;
    fleet.stop().await;
}

async fn uplink_status(url: &str, headers: &[(&'static str, &str)]) -> u16 {
    use tokio_tungstenite::tungstenite::client::IntoClientRequest;
    let mut request = url.into_client_request().unwrap();
    for (name, value) in headers {
        request
            .headers_mut()
            .append(*name, http::HeaderValue::from_str(value).unwrap());
    }
    match tokio_tungstenite::connect_async(request).await {
        Ok(_) => 101,
        Err(tokio_tungstenite::tungstenite::Error::Http(response)) => response.status().as_u16(),
        Err(e) => panic!("unexpected uplink failure: {e}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refused_uplinks_get_their_statuses_and_change_no_view() {
    let fleet = TestFleet::start(gateway_config()).await;
    let base = fleet.gateway_url();
    let uplink = format!("{base}/v1/uplink");
    let agent_token = fleet
        .operator()
        .await
        .call("token.create", json!({"role": "agent"}))
        .await
        .unwrap();
    let agent_bearer = format!("Bearer {}", agent_token["secret"].as_str().unwrap());
    let join_bearer = format!("Bearer {}", fleet.join_token);
    let (agent, join) = (agent_bearer.as_str(), join_bearer.as_str());
    let (id, auth) = ("x-simlock-worker-id", "authorization");
    let uplink_path = uplink.as_str();
    let elsewhere = format!("{base}/v1/elsewhere");
    for (url, headers, status) in [
        (
            uplink_path,
            vec![(id, "w1"), (auth, "Bearer slk_nope")],
            401,
        ),
        (uplink_path, vec![(id, "w1")], 401),
        (uplink_path, vec![(id, "w1"), (auth, agent)], 403),
        // Who dials is checked before what it sends (outside trial 21): without a worker
        // token, a missing or bad worker id is not the refusal's reason.
        (uplink_path, vec![], 401),
        (uplink_path, vec![(auth, agent)], 403),
        (uplink_path, vec![(id, "bad.id"), (auth, agent)], 403),
        (uplink_path, vec![(auth, join)], 400),
        // A worker id sent twice, or an authorization sent twice: a malformed head, answered
        // 400 and not recorded as a refusal of who dials.
        (uplink_path, vec![(id, "w1"), (id, "w2"), (auth, join)], 400),
        (
            uplink_path,
            vec![(id, "w1"), (auth, join), (auth, join)],
            400,
        ),
        (uplink_path, vec![(id, "bad.id"), (auth, join)], 400),
        (elsewhere.as_str(), vec![(id, "w1"), (auth, join)], 404),
    ] {
        assert_eq!(
            uplink_status(url, &headers).await,
            status,
            "{url} {headers:?}"
        );
    }
    assert!(
        fleet.gateway().fleet.views().is_empty(),
        "no refused uplink made a view"
    );
    let events = fleet
        .operator()
        .await
        .call("events.replay", json!({}))
        .await
        .unwrap();
    let rejected: Vec<&Value> = events["events"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|e| e["event"] == "worker.rejected")
        .collect();
    assert_eq!(rejected.len(), 6, "401s and 403s are recorded");
    assert_eq!(
        rejected
            .iter()
            .filter(|e| e["payload"]["workerId"] == "w1")
            .count(),
        3,
        "named by a valid worker id, when one was sent: {rejected:?}"
    );
    fleet.stop().await;
}

/// A hand-made uplink handshake (a WebSocket client always sends version 13): the status line
/// and the head.
async fn raw_uplink(addr: &str, join: &str, version: Option<&str>) -> String {
    open_raw_uplink(addr, join, version, "old-client").await.0
}

/// A raw uplink handshake as `worker_id`: the gateway's answer, and the socket, still open.
async fn open_raw_uplink(
    addr: &str,
    join: &str,
    version: Option<&str>,
    worker_id: &str,
) -> (String, tokio::net::TcpStream) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut stream = tokio::net::TcpStream::connect(addr).await.unwrap();
    let mut head = format!(
        "GET /v1/uplink HTTP/1.1\r\nHost: x\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n\
         Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nx-simlock-worker-id: {worker_id}\r\n\
         Authorization: Bearer {join}\r\n"
    );
    if let Some(version) = version {
        head.push_str(&format!("Sec-WebSocket-Version: {version}\r\n"));
    }
    head.push_str("\r\n");
    stream.write_all(head.as_bytes()).await.unwrap();
    let mut seen = Vec::new();
    let mut buf = [0u8; 4096];
    let read = tokio::time::timeout(PATIENCE, async {
        loop {
            let text = String::from_utf8_lossy(&seen).into_owned();
            // A refusal has a JSON body after its head; a 101 has nothing after it.
            if let Some((head, body)) = text.split_once("\r\n\r\n")
                && (head.starts_with("HTTP/1.1 101") || body.ends_with('}'))
            {
                return text;
            }
            let n = stream.read(&mut buf).await.unwrap();
            if n == 0 {
                return text;
            }
            seen.extend_from_slice(&buf[..n]);
        }
    });
    (
        read.await.expect("the gateway answered the handshake"),
        stream,
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_view_an_uplink_makes_before_its_greeting_wakes_the_fleets_watchers() {
    // The watcher looks before the uplink opens, and nothing after the upgrade changes the
    // fleet (the socket stays open and answers no greeting, whose bound is an hour): only the
    // decision that made the view can wake it.
    let fleet = TestFleet::start_with(gateway_config(), |timing| {
        timing.call_timeout = std::time::Duration::from_secs(3600);
    })
    .await;
    let gateway = fleet.gateway().fleet.clone();
    let mut changes = gateway.changes();
    changes.borrow_and_update();
    assert!(gateway.view("silent").is_none());
    let addr = fleet.gateway().running.http_addr().unwrap().to_string();
    let (answer, _held_open) =
        open_raw_uplink(&addr, &fleet.join_token, Some("13"), "silent").await;
    assert!(answer.starts_with("HTTP/1.1 101"), "{answer}");
    let seen = tokio::time::timeout(PATIENCE, async {
        while gateway.view("silent").is_none() {
            changes.changed().await.unwrap();
        }
    })
    .await;
    assert!(seen.is_ok(), "no change was told for the new view");
    assert_eq!(
        gateway.view("silent").unwrap().connection,
        Connection::Disconnected,
        "not connected before its greeting"
    );
    fleet.stop().await;
}

/// A stop waits for its uplinks' close handshakes, but not for a worker that never answers
/// one: a peer that took the upgrade and then reads nothing does not hold the stop.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stop_is_not_held_by_an_uplink_that_never_answers_its_close() {
    let fleet = TestFleet::start(gateway_config()).await;
    let addr = fleet.gateway().running.http_addr().unwrap().to_string();
    let (answer, _silent) = open_raw_uplink(&addr, &fleet.join_token, Some("13"), "silent").await;
    assert!(answer.starts_with("HTTP/1.1 101"), "{answer}");
    fleet
        .wait_for(|views| views.iter().any(|v| v.id == "silent"))
        .await;
    tokio::time::timeout(PATIENCE, fleet.gateway().fleet.stop())
        .await
        .expect("the stop ends by the link's linger");
    fleet.stop().await;
}

/// A worker that redials while the gateway stops (its listener still open) is told the gateway
/// is stopping, and nothing is recorded for it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_uplink_dialled_while_the_gateway_stops_gets_503_daemon_stopping() {
    let fleet = TestFleet::start(gateway_config()).await;
    let addr = fleet.gateway().running.http_addr().unwrap().to_string();
    // The fleet alone stops; the HTTP listener, stopped after it in a real stop, still answers.
    fleet.gateway().fleet.stop().await;
    let answer = raw_uplink(&addr, &fleet.join_token, Some("13")).await;
    let (head, body) = answer.split_once("\r\n\r\n").unwrap();
    assert!(head.starts_with("HTTP/1.1 503"), "{answer}");
    let error: Value = serde_json::from_str(body).unwrap();
    assert_eq!(error["error"]["code"], "DAEMON_STOPPING", "{body}");
    assert!(fleet.gateway().fleet.view("old-client").is_none());
    fleet.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_uplink_with_another_websocket_version_or_none_gets_426_and_records_nothing() {
    let fleet = TestFleet::start(gateway_config()).await;
    let addr = fleet.gateway().running.http_addr().unwrap().to_string();
    for version in [Some("8"), Some("12"), Some("13, 8"), None] {
        let answer = raw_uplink(&addr, &fleet.join_token, version).await;
        let (head, body) = answer.split_once("\r\n\r\n").unwrap();
        assert!(head.starts_with("HTTP/1.1 426"), "{version:?}: {answer}");
        assert!(
            head.to_ascii_lowercase()
                .contains("\r\nsec-websocket-version: 13"),
            "{version:?}: the refusal names version 13: {head}"
        );
        let error: Value = serde_json::from_str(body).unwrap();
        assert_eq!(error["error"]["code"], "BAD_REQUEST");
        assert!(
            error["error"]["message"]
                .as_str()
                .unwrap()
                .starts_with("Sec-WebSocket-Version:"),
            "{body}"
        );
    }
    // The same handshake with version 13 is taken: the refusals were for the version alone.
    let (answer, socket) =
        open_raw_uplink(&addr, &fleet.join_token, Some("13"), "old-client").await;
    assert!(answer.starts_with("HTTP/1.1 101"), "{answer}");
    fleet
        .wait_for(|views| views.iter().any(|v| v.id == "old-client"))
        .await;
    let events = fleet
        .operator()
        .await
        .call("events.replay", json!({}))
        .await
        .unwrap();
    let about_it: Vec<&Value> = events["events"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|e| e["payload"]["workerId"] == "old-client")
        .collect();
    assert!(
        about_it.iter().all(|e| e["event"] != "worker.rejected"),
        "a refused version records nothing: {about_it:?}"
    );
    assert_eq!(
        fleet.gateway().fleet.views().len(),
        1,
        "only the accepted handshake made a worker"
    );
    // It speaks no protocol and hangs up: a join whose handshake never passed leaves nothing.
    drop(socket);
    fleet.wait_for(<[_]>::is_empty).await;
    fleet.stop().await;
}

/// Revoking a join token closes its uplinks, and the worker is told why: its uplink state says
/// the token was revoked (the close frame's reason), then that the gateway refuses it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn revoking_a_join_token_closes_its_uplinks() {
    let mut fleet = TestFleet::start(gateway_config()).await;
    fleet.add_worker(worker_config(1)).await;
    let worker_id = fleet.worker_id(0);
    let operator = fleet.operator().await;
    let tokens = operator.call("token.list", json!({})).await.unwrap();
    let join = tokens["tokens"]
        .as_array()
        .unwrap()
        .iter()
        .find(|t| t["role"] == "worker")
        .unwrap()["id"]
        .clone();
    operator
        .call("token.revoke", json!({"id": join}))
        .await
        .unwrap();
    fleet
        .wait_for(|views| {
            views
                .iter()
                .any(|v| v.id == worker_id && v.connection == Connection::Disconnected)
        })
        .await;
    // Either message the worker may be showing by now names the revocation.
    let told = uplink_lost_with(&fleet, 0, "revoked").await;
    assert!(
        told.contains("its join token was revoked")
            || told.contains("refused the join token (unknown or revoked)"),
        "{told}"
    );
    fleet.stop().await;
}

/// A worker in front of a real one: every call goes to the real worker as its admin, but a
/// granted lease ends at once, and its `lease.expired` event goes up the uplink while the
/// grant's answer waits for a permit of `answer`: the order a short lease's end can take at the
/// gateway under load.
struct EndFirstWorker {
    real: simlock_wire::WireClient,
    answer: Arc<tokio::sync::Semaphore>,
}

impl Service for EndFirstWorker {
    fn greet(&self, _origin: Origin, hello: &Hello) -> Result<Identity, ContractError> {
        greet_gateway(hello)
    }

    fn dispatch(
        &self,
        ctx: CallContext,
        op: String,
        payload: Option<Value>,
    ) -> BoxFuture<'static, Result<Value, ContractError>> {
        let (real, answer_permit) = (self.real.clone(), self.answer.clone());
        async move {
            if op == "events.subscribe" {
                return bookkeeping_or_refuse(&op, "fake");
            }
            let mut payload = payload.unwrap_or_else(|| json!({}));
            if let Some(fields) = payload.as_object_mut() {
                // Only a gateway's uplink may name an owner; this front reaches the real worker
                // on its socket.
                fields.remove("owner");
            }
            let answer = real.call_value(&op, payload).await?;
            if op == "lease.request" {
                // The lease ends for real, so no view refresh brings it back.
                real.call_value("lease.release", json!({"leaseId": answer["lease"]["id"]}))
                    .await?;
                let event = simlock_contract::model::EventEnvelope {
                    id: simlock_contract::ids::EventId::from_raw("evt_early"),
                    seq: 1,
                    timestamp: 0,
                    event: "lease.expired".into(),
                    payload: json!({
                        "leaseId": answer["lease"]["id"],
                        "deviceId": answer["device"]["id"],
                    }),
                    module: "lease".into(),
                };
                let push = Push::Event {
                    subscription_id: simlock_contract::ids::SubscriptionId::from_raw("sub_1"),
                    event,
                };
                ctx.push(&push)
                    .await
                    .map_err(|_| ContractError::internal("closed"))?;
                answer_permit
                    .acquire()
                    .await
                    .map_err(|_| ContractError::internal("closed"))?
                    .forget();
            }
            Ok(answer)
        }
        .boxed()
    }
}

/// A lease whose end event the gateway handled before the grant's answer: the caller still gets
/// its grant, the owner a lease-lost under the gateway's id, and the index never holds it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lease_end_that_overtakes_its_grant_still_reaches_the_owner() {
    let fleet = TestFleet::start(gateway_config()).await;
    let dir = tempfile::tempdir().unwrap();
    let home = simlock_daemon::home::Home::at(dir.path().join("real"));
    let real = simlock_worker::start(simlock_worker::WorkerOptions::new(
        home.clone(),
        worker_config(1),
    ))
    .await
    .unwrap();
    let admin = session(&real.running.socket_path(), "front", Some(&home)).await;
    let answer = Arc::new(tokio::sync::Semaphore::new(0));
    let _link = fake_worker(
        &fleet.gateway_url(),
        &fleet.join_token,
        "end-first",
        Arc::new(EndFirstWorker {
            real: admin.client.clone(),
            answer: answer.clone(),
        }),
        simlock_contract::PROTOCOL_RANGE,
    )
    .await;
    fleet
        .wait_for(|views| {
            views.iter().any(|v| {
                v.id == "end-first"
                    && v.connection == Connection::Connected
                    && v.catalog_read_at.is_some()
            })
        })
        .await;
    let mut events = subscriber(&fleet).await;
    let mut agent = fleet.agent("agent-1").await;
    let (grant, ()) = tokio::join!(
        agent.call("lease.request", json!({"platform": "ios"})),
        async {
            // The gateway handled the end (it relays an event after handling it); only then
            // does the grant's answer go.
            relayed(&mut events, "lease.expired", None).await;
            answer.add_permits(1);
        }
    );
    let grant = grant.unwrap();
    let lease_id = lease_id(&grant);
    assert!(lease_id.starts_with("end-first.lse_"), "{lease_id}");
    let (lost, reason, device_id) = lease_lost(&mut agent).await;
    assert_eq!(lost, lease_id);
    assert_eq!(reason, simlock_contract::model::LeaseEndReason::Expired);
    assert_eq!(device_id.as_str(), grant["device"]["id"].as_str().unwrap());
    assert!(
        fleet.gateway().fleet.lease(&lease_id).is_none(),
        "the index never held the ended lease"
    );
    fleet.stop().await;
    real.stop("test").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_expired_gateway_lease_reaches_its_owner_as_lease_lost_with_the_gateway_id() {
    let mut fleet = TestFleet::start(gateway_config()).await;
    fleet.add_worker(worker_config(1)).await;
    let mut agent = fleet.agent("agent-1").await;
    let grant = agent
        .call("lease.request", json!({"platform": "ios", "ttlMs": 300}))
        .await
        .unwrap();
    let lease_id = lease_id(&grant);
    let (lost, reason, _) = lease_lost(&mut agent).await;
    assert_eq!(lost, lease_id);
    assert_eq!(reason, simlock_contract::model::LeaseEndReason::Expired);
    assert!(
        fleet.gateway().fleet.lease(&lease_id).is_none(),
        "the index forgot the lease"
    );
    fleet.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn exec_through_the_gateway_streams_the_workers_output_to_the_owner() {
    let mut fleet = TestFleet::start(gateway_config()).await;
    let mut config = worker_config(1);
    config.core.exec.tools.insert(
        "echo".into(),
        simlock_core::config::ToolConfig {
            command: "echo".into(),
            args: vec![],
        },
    );
    fleet.add_worker(config).await;
    let (agent, lease_id) = ios_lease(&fleet, "agent-1").await;
    let mut call = agent
        .client
        .begin(
            "device.exec",
            json!({"leaseId": lease_id, "tool": "echo", "args": ["hello", "fleet"]}),
            16,
        )
        .await
        .unwrap();
    let mut kinds = Vec::new();
    let mut output = String::new();
    let reply = loop {
        match tokio::time::timeout(PATIENCE, call.next()).await.unwrap() {
            simlock_wire::CallEvent::Push(frame) => {
                assert_eq!(
                    frame.request_id().and_then(|id| id.as_u64()),
                    Some(call.id())
                );
                match Push::from_frame(frame).unwrap() {
                    Push::Started { .. } => kinds.push("started"),
                    Push::Output { chunk, .. } => {
                        kinds.push("output");
                        output.push_str(&chunk);
                    }
                    other => panic!("unexpected push {other:?}"),
                }
            }
            simlock_wire::CallEvent::Reply(reply) => break reply,
        }
    };
    assert_eq!(
        simlock_wire::decode_value(&reply.unwrap()).unwrap(),
        json!({"exitCode": 0})
    );
    assert_eq!(kinds.first(), Some(&"started"));
    assert_eq!(output, "hello fleet\n");
    let stranger = fleet.agent("agent-2").await;
    let err = stranger
        .call(
            "device.exec",
            json!({"leaseId": lease_id, "tool": "echo", "args": []}),
        )
        .await
        .unwrap_err();
    assert_eq!(err.code, ErrorCode::UnknownLease);
    fleet.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiting_request_is_queued_then_granted_when_a_device_frees_up() {
    let mut fleet = TestFleet::start(gateway_config()).await;
    fleet.add_worker(worker_config(1)).await;
    let first = fleet.agent("agent-1").await;
    let grant = first
        .call("lease.request", json!({"platform": "ios"}))
        .await
        .unwrap();
    let second = fleet.agent("agent-2").await;
    let mut waiting = second
        .client
        .begin("lease.request", json!({"platform": "ios"}), 16)
        .await
        .unwrap();
    // The waiter reports its place in the fleet queue first.
    let queued = match tokio::time::timeout(PATIENCE, waiting.next())
        .await
        .unwrap()
    {
        simlock_wire::CallEvent::Push(frame) => Push::from_frame(frame).unwrap(),
        simlock_wire::CallEvent::Reply(reply) => panic!("answered before queueing: {reply:?}"),
    };
    assert!(
        matches!(
            queued,
            Push::Progress {
                progress: simlock_contract::push::Progress::Queued {
                    queue_position: 1,
                    ..
                },
                ..
            }
        ),
        "{queued:?}"
    );
    let status = fleet
        .operator()
        .await
        .call("status.get", json!({}))
        .await
        .unwrap();
    assert_eq!(status["queueDepth"], 1);
    first
        .call("lease.release", json!({"leaseId": grant["lease"]["id"]}))
        .await
        .unwrap();
    let granted = loop {
        match tokio::time::timeout(PATIENCE, waiting.next())
            .await
            .unwrap()
        {
            simlock_wire::CallEvent::Push(_) => {}
            simlock_wire::CallEvent::Reply(reply) => {
                break simlock_wire::decode_value(&reply.unwrap()).unwrap();
            }
        }
    };
    assert_eq!(granted["lease"]["requesterId"], "agent-2");
    fleet.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiting_request_times_out_or_is_cancelled_through_the_gateway() {
    let mut fleet = TestFleet::start(gateway_config()).await;
    fleet.add_worker(worker_config(1)).await;
    let holder = fleet.agent("agent-1").await;
    holder
        .call("lease.request", json!({"platform": "ios"}))
        .await
        .unwrap();
    let waiter = fleet.agent("agent-2").await;
    let err = waiter
        .call(
            "lease.request",
            json!({"platform": "ios", "timeoutMs": 200}),
        )
        .await
        .unwrap_err();
    assert_eq!(err.code, ErrorCode::QueueTimeout);
    assert!(
        err.details.unwrap()["requestId"]
            .as_str()
            .unwrap()
            .starts_with("req_")
    );

    let pending = waiter
        .client
        .begin("lease.request", json!({"platform": "ios"}), 16)
        .await
        .unwrap();
    // Once it is queued it can be cancelled; another agent cannot cancel it.
    fleet.wait_until(|f| f.queue_depth() == 1).await;
    let stranger = fleet.agent("agent-3").await;
    let err = stranger
        .call("lease.cancel", json!({"requesterId": "agent-2"}))
        .await
        .unwrap_err();
    assert_eq!(err.code, ErrorCode::Forbidden);
    let cancelled = waiter.call("lease.cancel", json!({})).await.unwrap();
    assert_eq!(cancelled, json!({"result": "cancelled"}));
    assert_eq!(
        pending.finish().await.unwrap_err().code,
        ErrorCode::Cancelled
    );
    assert_eq!(
        waiter.call("lease.cancel", json!({})).await.unwrap(),
        json!({"result": "not-found"})
    );
    fleet.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn release_all_through_the_gateway_ends_only_the_gateways_leases_each_as_killed() {
    let mut fleet = TestFleet::start(gateway_config()).await;
    fleet.add_worker(worker_config(3)).await;
    fleet.add_worker(worker_config(3)).await;
    // The holders stay connected: each is told its lease was lost, and why.
    let mut holders = Vec::new();
    for n in 0..3 {
        let holder = fleet.agent(&format!("agent-{n}")).await;
        let grant = holder
            .call("lease.request", json!({"platform": "ios"}))
            .await
            .unwrap();
        holders.push((holder, lease_id(&grant)));
    }
    // A lease made on a worker directly is not the gateway's to end.
    let local = session(&fleet.worker(0).running.socket_path(), "local", None).await;
    let own = local
        .call("lease.request", json!({"platform": "android"}))
        .await
        .unwrap();
    let mut subscribed = subscriber(&fleet).await;
    let operator = fleet.operator().await;
    let released = operator.call("lease.release-all", json!({})).await.unwrap();
    assert_eq!(released["leaseIds"].as_array().unwrap().len(), 3);
    for _ in 0..3 {
        let ended = relayed(&mut subscribed, "lease.released", None).await;
        assert_eq!(
            ended.payload["reason"], "killed",
            "an operator's release-all ends each lease as killed, as on a worker"
        );
    }
    for (holder, lease_id) in &mut holders {
        let (lost, reason, _) = lease_lost(holder).await;
        assert_eq!(&lost, lease_id);
        assert_eq!(reason, simlock_contract::model::LeaseEndReason::Killed);
    }
    let left: Vec<String> = fleet
        .worker(0)
        .worker
        .leases()
        .iter()
        .chain(fleet.worker(1).worker.leases().iter())
        .map(|l| l.id.to_string())
        .collect();
    let own_id = own["lease"]["id"].as_str().unwrap().to_owned();
    assert_eq!(left, std::slice::from_ref(&own_id));
    // Named by its id, an operator may end it through the gateway (which lists it to
    // operators), once the gateway's view of the worker has it.
    let worker_id = fleet.worker_id(0);
    fleet
        .wait_until(|f| {
            f.view(&worker_id)
                .and_then(|v| v.leases)
                .is_some_and(|leases| leases.iter().any(|l| l.id.as_str() == own_id))
        })
        .await;
    operator
        .call("lease.release", json!({"leaseId": own_id}))
        .await
        .unwrap();
    assert!(fleet.worker(0).worker.leases().is_empty());
    let agent = fleet.agent("agent-a").await;
    let err = agent
        .call("lease.release-all", json!({}))
        .await
        .unwrap_err();
    assert_eq!(err.code, ErrorCode::Forbidden);
    fleet.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn worker_events_are_relayed_with_their_worker_id_and_status_sums_the_fleet() {
    let mut fleet = TestFleet::start(gateway_config()).await;
    fleet.add_worker(worker_config(2)).await;
    fleet.add_worker(worker_config(3)).await;
    let worker_id = fleet.worker_id(0);
    let mut subscribed = subscriber(&fleet).await;
    let local = session(&fleet.worker(0).running.socket_path(), "local", None).await;
    let grant = local
        .call("lease.request", json!({"platform": "ios"}))
        .await
        .unwrap();
    let worker_lease = lease_id(&grant);
    let operator = fleet.operator().await;
    let pushed = relayed(&mut subscribed, "lease.granted", Some(&worker_lease)).await;
    assert_eq!(pushed.payload["workerId"], worker_id.as_str());
    fleet
        .wait_until(|f| {
            f.view(&worker_id)
                .is_some_and(|v| v.leases.as_ref().is_some_and(|l| l.len() == 1))
        })
        .await;
    let events = operator.call("events.replay", json!({})).await.unwrap();
    let granted = events["events"]
        .as_array()
        .unwrap()
        .iter()
        .find(|e| e["event"] == "lease.granted" && e["payload"]["leaseId"] == worker_lease.as_str())
        .cloned()
        .expect("the worker's lease.granted was relayed");
    assert_eq!(granted["payload"]["workerId"], worker_id.as_str());
    assert!(granted["id"].as_str().unwrap().starts_with("evt_"));
    let connected = events["events"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|e| e["event"] == "worker.connected")
        .count();
    assert_eq!(connected, 2);

    let status = operator.call("status.get", json!({})).await.unwrap();
    assert_eq!(status["daemon"]["mode"], "gateway");
    assert_eq!(
        status["capacity"]["global"]["maxRunning"], 5,
        "capacity summed over connected workers"
    );
    assert_eq!(status["capacity"]["ios"]["running"], 1);
    assert_eq!(status["workers"].as_array().unwrap().len(), 2);
    let lease = &status["leases"][0];
    assert_eq!(
        lease["id"],
        worker_lease.as_str(),
        "a worker's own lease passes through with its id"
    );
    assert_eq!(lease["workerId"], worker_id.as_str());
    let metrics = fleet.gateway().running.base.metrics.render();
    assert!(
        metrics.contains("simlock_workers{connection=\"connected\"} 2\n"),
        "{metrics}"
    );
    assert!(
        metrics.contains(&format!("simlock_uplink_up{{worker=\"{worker_id}\"}} 1\n")),
        "{metrics}"
    );
    assert!(metrics.contains("simlock_link_channels_open{"), "{metrics}");
    let catalog = operator
        .call("catalog.get", json!({"platform": "android"}))
        .await
        .unwrap();
    let android = &catalog["platforms"][0];
    assert_eq!(android["platform"], "android");
    assert_eq!(
        android["modelWorkers"]["Pixel 8"].as_array().unwrap().len(),
        2
    );
    fleet.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_disconnected_worker_is_forgotten_after_retention() {
    let fleet = TestFleet::start_with(gateway_config(), |timing| {
        timing.refresh_interval = std::time::Duration::from_millis(50);
        timing.disconnected_retention = std::time::Duration::from_millis(100);
    })
    .await;
    let link = fake_worker(
        &fleet.gateway_url(),
        &fleet.join_token,
        "passing-worker",
        Arc::new(FakeWorker::default()),
        simlock_contract::PROTOCOL_RANGE,
    )
    .await;
    fleet
        .wait_for(|views| {
            views
                .iter()
                .any(|v| v.id == "passing-worker" && v.connection == Connection::Connected)
        })
        .await;
    link.close();
    fleet
        .wait_for(|views| !views.iter().any(|v| v.id == "passing-worker"))
        .await;
    let events = fleet
        .operator()
        .await
        .call("events.replay", json!({}))
        .await
        .unwrap();
    let removed = events["events"]
        .as_array()
        .unwrap()
        .iter()
        .find(|e| e["event"] == "worker.removed")
        .cloned()
        .expect("a worker.removed event");
    assert_eq!(removed["payload"]["reason"], "retention");
    assert_eq!(removed["payload"]["workerId"], "passing-worker");
    fleet.stop().await;
}

use simlock_daemon::uplink::UplinkState;

/// Waits until worker `n` reports its uplink down with an error that contains `text`.
async fn uplink_lost_with(fleet: &TestFleet, n: usize, text: &str) -> String {
    let mut state = fleet.worker(n).uplink.clone().expect("the worker dials");
    tokio::time::timeout(PATIENCE, async {
        loop {
            if let UplinkState::Connecting {
                last_error: Some(error),
            } = &*state.borrow_and_update()
                && error.contains(text)
            {
                return error.clone();
            }
            state.changed().await.expect("the worker runs");
        }
    })
    .await
    .unwrap_or_else(|_| panic!("worker {n}'s uplink went down with {text:?}"))
}

/// Copies the regular files of `from` into `to` (a worker's home: its state, not its socket).
fn copy_home(from: &std::path::Path, to: &std::path::Path) {
    std::fs::create_dir_all(to).unwrap();
    for entry in std::fs::read_dir(from).unwrap() {
        let entry = entry.unwrap();
        let kind = entry.file_type().unwrap();
        if kind.is_dir() {
            copy_home(&entry.path(), &to.join(entry.file_name()));
        } else if kind.is_file() {
            std::fs::copy(entry.path(), to.join(entry.file_name())).unwrap();
        }
    }
}

/// Two workers started from one home share its instance id: each new uplink replaces the
/// other's, and each worker is told why in the close frame, so its log names the likely cause
/// instead of a bare "closed by the peer".
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_workers_from_one_home_are_each_told_why_they_were_replaced() {
    let mut fleet = TestFleet::start(gateway_config()).await;
    fleet.add_worker(worker_config(2)).await;
    let worker_id = fleet.worker_id(0);
    fleet.stop_worker(0).await;
    copy_home(fleet.worker_home(0).root(), fleet.worker_home(1).root());
    fleet.restart_worker(0, worker_config(2)).await;

    fleet.join_worker(1, worker_config(2), |_| {}, false).await;
    assert_eq!(
        fleet.worker_id(1),
        worker_id,
        "the copy has the same instance id"
    );
    let told = uplink_lost_with(&fleet, 0, "replaced by a newer uplink").await;
    assert!(told.contains("SIMLOCK_HOME"), "{told}");
    // The first worker dials again and replaces the copy in turn.
    uplink_lost_with(&fleet, 1, "replaced by a newer uplink").await;
    fleet.stop().await;
}

/// A gateway that stops tells its workers so.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stopping_gateway_tells_its_workers_why_their_uplink_closed() {
    let mut fleet = TestFleet::start(gateway_config()).await;
    fleet.add_worker(worker_config(2)).await;
    fleet.stop_gateway().await;
    let told = uplink_lost_with(&fleet, 0, "closed by the peer").await;
    assert!(told.contains("the gateway is stopping"), "{told}");
    fleet.stop().await;
}

/// An operator's `workers remove` of a worker that is away ends its leases at the gateway: their
/// holders hear `lease-lost` `killed` (they were left renewing in vain until the TTL), and each is
/// released on the worker should it come back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn removing_an_away_worker_ends_its_leases_and_releases_them_if_it_returns() {
    let mut fleet = TestFleet::start(gateway_config()).await;
    fleet.add_worker(worker_config(1)).await;
    let mut holder = fleet.agent("holder").await;
    let grant = holder
        .call(
            "lease.request",
            json!({"platform": "ios", "ttlMs": 600_000}),
        )
        .await
        .unwrap();
    let lease = lease_id(&grant);
    let worker_id = fleet.worker_id(0);
    fleet.stop_worker_seen_away(0).await;
    let removed = fleet
        .operator()
        .await
        .call("worker.remove", json!({"workerId": worker_id}))
        .await
        .unwrap();
    assert_eq!(removed["removed"], true);
    let (lost, reason, _) = lease_lost(&mut holder).await;
    assert_eq!(lost, lease);
    assert_eq!(reason, simlock_contract::model::LeaseEndReason::Killed);
    let renewed = holder
        .call("lease.renew", json!({"leaseId": lease}))
        .await
        .unwrap_err();
    assert_eq!(renewed.code, ErrorCode::UnknownLease, "{renewed:?}");
    assert_eq!(fleet.gateway().fleet.stored_orphans().unwrap().len(), 1);

    // The worker comes back, its lease kept on its disk: it is released there.
    fleet.restart_worker(0, worker_config(1)).await;
    fleet
        .wait_until(|f| f.stored_orphans().unwrap().is_empty())
        .await;
    assert!(fleet.worker(0).worker.leases().is_empty());
    fleet.stop().await;
}
