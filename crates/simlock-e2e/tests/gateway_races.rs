//! The two races of a grant and an end at the gateway (issue 13), and a lease held through a
//! gateway at once after its grant (issue 11, item 0), over real sockets: a gateway, real
//! workers, HTTP agents. Where a race needs a message held back, a proxy worker in front of a
//! real one holds it.

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    reason = "tests fail by panicking"
)]

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use serde_json::json;
use simlock_client::{Client, ConnectOptions, HoldEnd};
use simlock_contract::model::{Connection, Platform};
use simlock_contract::ops::LeaseRequestInput;
use simlock_contract::{ErrorCode, PROTOCOL_RANGE};
use simlock_e2e::{PATIENCE, TestFleet, fake_worker, gateway_config, session, worker_config};
use simlock_test_support::fake_worker::{AnswerHook, ProxyWorker};
use tokio::sync::{Semaphore, watch};

/// An agent of the gateway over HTTP, with a fresh agent token.
async fn http_agent(fleet: &TestFleet) -> Client {
    let operator = fleet.operator().await;
    let token = operator
        .call("token.create", json!({"role": "agent"}))
        .await
        .unwrap();
    let secret = token["secret"].as_str().unwrap();
    let url = format!("http://{}", fleet.gateway().running.http_addr().unwrap());
    Client::over_http(&url, secret, ConnectOptions::default()).unwrap()
}

/// An operator of the gateway over HTTP.
async fn http_operator(fleet: &TestFleet) -> Client {
    let operator = fleet.operator().await;
    let token = operator
        .call("token.create", json!({"role": "operator"}))
        .await
        .unwrap();
    let url = format!("http://{}", fleet.gateway().running.http_addr().unwrap());
    Client::over_http(
        &url,
        token["secret"].as_str().unwrap(),
        ConnectOptions::default(),
    )
    .unwrap()
}

fn ios() -> LeaseRequestInput {
    LeaseRequestInput::for_platform(Platform::Ios)
}

async fn patient<F: Future>(what: &str, future: F) -> F::Output {
    tokio::time::timeout(PATIENCE, future)
        .await
        .unwrap_or_else(|_| panic!("{what} in time"))
}

/// A hook that never lets an answer to `op` through while `armed` is set (once, and disarmed,
/// when `once`).
fn never_answering(op: &'static str, armed: Arc<AtomicBool>, once: bool) -> AnswerHook {
    Arc::new(move |answered, _| {
        let hold = answered == op
            && if once {
                armed.swap(false, Ordering::SeqCst)
            } else {
                armed.load(Ordering::SeqCst)
            };
        Box::pin(async move {
            if hold {
                std::future::pending::<()>().await;
            }
        })
    })
}

/// A real worker with `capacity` devices on its own home, and a proxy worker in front of it
/// joined to the gateway as `proxy`, its answers passed through `hook` (the proxy answered too,
/// to join it again on a new uplink, [`join_proxy`]).
async fn proxied(
    fleet: &TestFleet,
    capacity: u32,
    hook: AnswerHook,
) -> (
    simlock_worker::RunningWorker,
    simlock_link::LinkHandle,
    Arc<ProxyWorker>,
    tempfile::TempDir,
) {
    let dir = tempfile::tempdir().unwrap();
    let home = simlock_daemon::home::Home::at(dir.path().join("real"));
    let real = simlock_worker::start(simlock_worker::WorkerOptions::new(
        home.clone(),
        worker_config(capacity),
    ))
    .await
    .unwrap();
    let admin = session(&real.running.socket_path(), "front", Some(&home)).await;
    let proxy = ProxyWorker::new(admin.client, admin.pushes, hook);
    let link = join_proxy(fleet, &proxy).await;
    (real, link, proxy, dir)
}

/// Joins `proxy` to the gateway on a new uplink and waits for its view to be read.
async fn join_proxy(fleet: &TestFleet, proxy: &Arc<ProxyWorker>) -> simlock_link::LinkHandle {
    let link = fake_worker(
        &fleet.gateway_url(),
        &fleet.join_token,
        "proxy",
        proxy.clone(),
        PROTOCOL_RANGE,
    )
    .await;
    fleet
        .wait_for(|views| {
            views.iter().any(|v| {
                v.id == "proxy"
                    && v.connection == Connection::Connected
                    && v.catalog_read_at.is_some()
            })
        })
        .await;
    link
}

/// Race (a): a view read the worker answered before a release, arriving at the gateway after
/// the release was answered, does not bring the released lease back: the requester's next
/// request is granted, not refused `REQUESTER_ALREADY_LEASED` naming the released lease.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_view_read_before_a_release_does_not_refuse_the_next_request() {
    let fleet = TestFleet::start_with(gateway_config(), |timing| {
        // View reads come often, so one is out while the lease is held.
        timing.refresh_interval = std::time::Duration::from_millis(20);
    })
    .await;
    let armed = Arc::new(AtomicBool::new(false));
    let (read_tx, mut read_rx) = watch::channel(0u64);
    let held = Arc::new(Semaphore::new(0));
    let hook: AnswerHook = {
        let (armed, held) = (armed.clone(), held.clone());
        Arc::new(move |op, answer| {
            let (armed, held, read_tx) = (armed.clone(), held.clone(), read_tx.clone());
            let lists_a_lease = answer
                .as_ref()
                .is_ok_and(|v| v["leases"].as_array().is_some_and(|l| !l.is_empty()));
            let is_status = op == "status.get";
            Box::pin(async move {
                if !is_status {
                    return;
                }
                let hold = lists_a_lease && armed.swap(false, Ordering::SeqCst);
                read_tx.send_modify(|n| *n += 1);
                if hold {
                    // Held back, listing the lease, until the release was answered.
                    let _ = held
                        .acquire()
                        .await
                        .map(tokio::sync::SemaphorePermit::forget);
                }
            })
        })
    };
    let (real, _link, _, _dir) = proxied(&fleet, 1, hook).await;
    let agent = http_agent(&fleet).await;
    for round in 0..5 {
        let grant = patient(
            "the grant",
            agent.request_lease(ios(), |_| {}, std::future::pending()),
        )
        .await
        .unwrap();
        let lease_id = grant.lease.id.to_string();
        armed.store(true, Ordering::SeqCst);
        // A read listing the lease is answered by the worker and held.
        patient("a view read listing the lease", async {
            while armed.load(Ordering::SeqCst) {
                read_rx.changed().await.unwrap();
            }
        })
        .await;
        patient("the release", agent.release(&lease_id))
            .await
            .unwrap();
        assert!(
            real.worker.leases().is_empty(),
            "round {round}: released on the worker"
        );
        // The stale read goes; once the next read starts, the gateway applied it.
        let reads = *read_rx.borrow_and_update();
        held.add_permits(1);
        patient("the next view read", read_rx.wait_for(|n| *n > reads + 1))
            .await
            .unwrap();
        assert!(
            fleet.gateway().fleet.lease(&lease_id).is_none(),
            "round {round}: the stale read did not bring {lease_id} back"
        );
        let again = patient(
            "the next request",
            agent.request_lease(ios(), |_| {}, std::future::pending()),
        )
        .await
        .unwrap_or_else(|e| panic!("round {round}: refused after the release: {e:?}"));
        patient("its release", agent.release(again.lease.id.as_str()))
            .await
            .unwrap();
    }
    fleet.stop().await;
    real.stop("test").await;
}

/// Race (a) under load: agents over HTTP that ask again the moment their release is answered
/// are never refused for the lease they released.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn agents_asking_again_right_after_their_release_are_never_refused_for_it() {
    let mut fleet = TestFleet::start_with(gateway_config(), |timing| {
        timing.refresh_interval = std::time::Duration::from_millis(10);
    })
    .await;
    fleet.add_worker(worker_config(16)).await;
    let mut agents = Vec::new();
    for _ in 0..16 {
        agents.push(http_agent(&fleet).await);
    }
    let cycles = agents.into_iter().map(|agent| {
        tokio::spawn(async move {
            let mut previous: Option<String> = None;
            for cycle in 0..8 {
                let grant = agent
                    .request_lease(ios(), |_| {}, std::future::pending())
                    .await;
                match grant {
                    Ok(grant) => {
                        let lease_id = grant.lease.id.to_string();
                        agent.release(&lease_id).await.unwrap();
                        previous = Some(lease_id);
                    }
                    Err(err) => {
                        let named = err
                            .details
                            .as_ref()
                            .and_then(|d| d["existingLeaseId"].as_str())
                            .map(str::to_owned);
                        panic!(
                            "cycle {cycle}: refused {} (names {named:?}, released {previous:?})",
                            err.code
                        );
                    }
                }
            }
        })
    });
    for cycle in cycles {
        patient("the cycles", cycle).await.unwrap();
    }
    assert!(fleet.worker(0).worker.leases().is_empty());
    fleet.stop().await;
}

/// Race (b): from the moment a grant is answered, the gateway answers for its lease (its list,
/// its event stream, renewals), even while the worker's view cannot be read; while the worker
/// is away, the lease stays listed and renewals answer `WORKER_UNREACHABLE`, never
/// `UNKNOWN_LEASE`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lease_is_known_from_its_grant_while_the_workers_view_cannot_be_read() {
    let fleet = TestFleet::start_with(gateway_config(), |timing| {
        // The stalled view reads must not close the uplink during the test.
        timing.call_timeout = std::time::Duration::from_secs(300);
    })
    .await;
    let stalled = Arc::new(AtomicBool::new(false));
    let hook = never_answering("status.get", stalled.clone(), false);
    let (real, link, _, _dir) = proxied(&fleet, 1, hook).await;
    stalled.store(true, Ordering::SeqCst);
    let agent = http_agent(&fleet).await;
    let mut input = ios();
    input.ttl_ms = Some(600_000);
    let grant = patient(
        "the grant",
        agent.request_lease(input, |_| {}, std::future::pending()),
    )
    .await
    .unwrap();
    let lease_id = grant.lease.id.to_string();
    let view = fleet.gateway().fleet.view("proxy").unwrap();
    assert!(
        !view
            .leases
            .unwrap_or_default()
            .iter()
            .any(|l| lease_id.ends_with(l.id.as_str())),
        "no view read lists the lease: the window is open"
    );
    // GET /v1/leases and the lease's own stream know it at once.
    let listed = patient("the list", agent.leases()).await.unwrap();
    assert_eq!(listed.leases.len(), 1, "{listed:?}");
    assert_eq!(listed.leases[0].id.as_str(), lease_id);
    patient("the lease's event stream", agent.lease_notices(&lease_id))
        .await
        .expect("GET /v1/leases/{id}/events finds the lease");
    let renewed = patient("the renewal", agent.renew(&lease_id, None))
        .await
        .unwrap();
    assert_eq!(renewed.id.as_str(), lease_id);

    // The worker goes: the lease stays the gateway's to answer for.
    link.close();
    fleet
        .wait_for(|views| {
            views
                .iter()
                .any(|v| v.id == "proxy" && v.connection == Connection::Disconnected)
        })
        .await;
    let listed = patient("the list", agent.leases()).await.unwrap();
    assert_eq!(listed.leases.len(), 1);
    let err = patient("the renewal", agent.renew(&lease_id, None))
        .await
        .unwrap_err();
    assert_eq!(err.code, ErrorCode::WorkerUnreachable);
    assert_eq!(real.worker.leases().len(), 1, "the worker still holds it");
    let operator = http_operator(&fleet).await;
    assert_eq!(
        patient("the operator's list", operator.leases())
            .await
            .unwrap()
            .leases
            .len(),
        1
    );
    fleet.stop().await;
    real.stop("test").await;
}

/// Issue 11, item 0: a hold through a gateway started at once after its grant never ends
/// `Lost` and always releases, hundreds of times over.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hold_through_a_gateway_started_at_once_after_its_grant_always_releases() {
    let mut fleet = TestFleet::start(gateway_config()).await;
    fleet.add_worker(worker_config(2)).await;
    let agent = http_agent(&fleet).await;
    for round in 0..300 {
        let mut input = ios();
        // Every tenth hold renews once before it is released.
        let renews = round % 10 == 0;
        input.ttl_ms = Some(if renews { 300 } else { 60_000 });
        let grant = patient(
            "the grant",
            agent.request_lease(input, |_| {}, std::future::pending()),
        )
        .await
        .unwrap_or_else(|e| panic!("round {round}: {e:?}"));
        let (lease_id, granted_at) = (grant.lease.id.to_string(), grant.lease.granted_at);
        let mut hold = agent.hold(grant);
        if renews {
            let renewed = fleet.wait_until(|f| {
                f.lease(&lease_id)
                    .is_some_and(|e| e.record.last_renewed_at > granted_at)
            });
            tokio::select! {
                end = hold.ended() => panic!("round {round}: the hold ended by itself: {end:?}"),
                () = renewed => {}
            }
        }
        let end = patient("the release", hold.release()).await;
        assert_eq!(end, HoldEnd::Released, "round {round}");
    }
    assert!(
        fleet.worker(0).worker.leases().is_empty(),
        "every lease was released on the worker"
    );
    fleet.stop().await;
}

/// Trial 8: a holder's release whose answer the worker does not send within the gateway's call
/// bound (an uplink stalling, not yet declared dead) is answered all the same: the worker had
/// carried it out, and its end reached the gateway meanwhile, so nothing is left to release.
/// Before, the CLI's hold exited 1 saying the lease expires on its TTL. (A release the worker
/// did not carry out goes out again as an orphan's: the core's tests.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_release_whose_answer_is_held_past_the_call_bound_is_answered_and_carried_out() {
    let fleet = TestFleet::start_with(gateway_config(), |timing| {
        timing.call_timeout = std::time::Duration::from_secs(1);
    })
    .await;
    let holding = Arc::new(AtomicBool::new(false));
    let hook = never_answering("lease.release", holding.clone(), true);
    let (real, _link, _, _dir) = proxied(&fleet, 1, hook).await;
    let agent = http_agent(&fleet).await;
    let grant = patient(
        "the grant",
        agent.request_lease(ios(), |_| {}, std::future::pending()),
    )
    .await
    .unwrap();
    let lease_id = grant.lease.id.to_string();
    holding.store(true, Ordering::SeqCst);
    let released = patient("the release", agent.release(&lease_id))
        .await
        .unwrap();
    assert_eq!(released.lease_id, lease_id);
    assert!(real.worker.leases().is_empty(), "the worker carried it out");
    let listed = patient("the list", agent.leases()).await.unwrap();
    assert!(listed.leases.is_empty(), "{listed:?}");
    // The orphan's release is answered (the worker says it is gone): nothing stays stored.
    fleet
        .wait_until(|f| f.stored_orphans().unwrap().is_empty())
        .await;
    fleet.stop().await;
}

/// Outside trial 9: a lease request whose uplink is lost before the worker's grant comes back
/// is refused `WORKER_UNREACHABLE`, though the worker granted it. Once the worker is back, its
/// view lists that grant, and the gateway releases it: it never becomes the agent's lease (which
/// it did, until its TTL, refusing the agent's next request `REQUESTER_ALREADY_LEASED`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_grant_whose_answer_was_lost_with_its_uplink_is_released_once_the_worker_is_back() {
    let fleet = TestFleet::start(gateway_config()).await;
    let holding = Arc::new(AtomicBool::new(true));
    let hook = never_answering("lease.request", holding, true);
    let (real, link, proxy, _dir) = proxied(&fleet, 1, hook).await;
    let agent = http_agent(&fleet).await;
    let mut input = ios();
    input.ttl_ms = Some(600_000);
    let asked = {
        let (agent, input) = (agent.clone(), input.clone());
        tokio::spawn(async move {
            agent
                .request_lease(input, |_| {}, std::future::pending())
                .await
        })
    };
    // The worker granted it; its answer is held.
    fleet
        .wait_for(|views| {
            views
                .iter()
                .any(|v| v.id == "proxy" && v.leases.as_ref().is_some_and(|l| l.len() == 1))
        })
        .await;
    let stray = real.worker.leases()[0].id.to_string();
    link.close();
    let refused = patient("the refusal", asked).await.unwrap().unwrap_err();
    assert_eq!(refused.code, ErrorCode::WorkerUnreachable, "{refused:?}");
    assert_eq!(
        fleet.gateway().fleet.stored_forwards().unwrap().len(),
        1,
        "the forward in doubt is stored"
    );

    // Released once the uplink carries the worker's events: its end reaches the gateway's
    // stream (it did not when the release went out before the subscription).
    let operator = http_operator(&fleet).await;
    let mut events = patient("the event stream", operator.follow_events())
        .await
        .unwrap();
    let _link = join_proxy(&fleet, &proxy).await;
    patient("the stray's lease.released", async {
        loop {
            match events.next().await {
                Some(Ok(simlock_client::events::FollowItem::Event(e)))
                    if e.event == "lease.released"
                        && e.payload["leaseId"].as_str() == Some(stray.as_str()) =>
                {
                    return;
                }
                Some(Ok(_)) => {}
                other => panic!("the stream ended: {other:?}"),
            }
        }
    })
    .await;
    fleet
        .wait_until(|f| {
            f.stored_forwards().unwrap().is_empty() && f.stored_orphans().unwrap().is_empty()
        })
        .await;
    assert!(real.worker.leases().is_empty(), "released on the worker");
    let listed = patient("the list", agent.leases()).await.unwrap();
    assert!(listed.leases.is_empty(), "{listed:?}");

    fleet
        .wait_for(|views| {
            views
                .iter()
                .any(|v| v.id == "proxy" && v.leases.as_ref().is_some_and(Vec::is_empty))
        })
        .await;
    let grant = patient(
        "the next grant",
        agent.request_lease(input, |_| {}, std::future::pending()),
    )
    .await
    .unwrap();
    assert!(grant.lease.id.as_str().starts_with("proxy."));
    fleet.stop().await;
    real.stop("test").await;
}

/// Outside trial 23: a queued `simlock lease` (which follows its request's event stream) was
/// not told when its only worker was drained: the stream sent an event only when the state,
/// the queue position or the ETA changed, not when only why it waits did. Now it hears
/// `noWorker`, then `capacity` again once the worker is undrained.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_queued_request_s_stream_tells_when_only_why_it_waits_changes() {
    use simlock_client::RequestEvent;
    use simlock_contract::push::{Progress, WaitingFor};

    let mut fleet = TestFleet::start(gateway_config()).await;
    fleet.add_worker(worker_config(1)).await;
    let worker_id = fleet.worker_id(0);
    let (holder, waiter) = (http_agent(&fleet).await, http_agent(&fleet).await);
    let operator = http_operator(&fleet).await;
    let grant = patient(
        "the grant",
        holder.request_lease(ios(), |_| {}, std::future::pending()),
    )
    .await
    .unwrap();
    let mut pending = waiter.begin_lease_request(ios()).await.unwrap();
    let mut next_waiting_for = async || match patient("progress", pending.next()).await {
        RequestEvent::Progress(Progress::Queued {
            queue_position,
            waiting_for,
        }) => (queue_position, waiting_for),
        other => panic!("{other:?}"),
    };
    assert_eq!(next_waiting_for().await, (1, Some(WaitingFor::Capacity)));
    operator.worker_drain(&worker_id).await.unwrap();
    assert_eq!(next_waiting_for().await, (1, Some(WaitingFor::NoWorker)));
    operator.worker_undrain(&worker_id).await.unwrap();
    assert_eq!(next_waiting_for().await, (1, Some(WaitingFor::Capacity)));
    holder.release(grant.lease.id.as_str()).await.unwrap();
    match patient("the grant", pending.next()).await {
        RequestEvent::Done(Ok(_)) => {}
        other => panic!("{other:?}"),
    }
    fleet.stop().await;
}
