//! The read-only operations: status, catalog, config, lists and the fleet of one.

use serde_json::json;
use simlock_contract::model::{Connection, Health, Mode, Platform};
use simlock_contract::ops::{
    CatalogGet, CatalogInput, ConfigGet, Empty, ListGet, ListInput, ListKind, ListOutput,
    StatusGet, WorkerList,
};

use super::*;

#[tokio::test(start_paused = true)]
async fn status_answers_only_daemon_and_host_while_starting() {
    let h = Harness::build(Build {
        start: false,
        ..Build::default()
    });
    let status = h.call::<StatusGet>(agent("x"), &Empty {}).await.unwrap();
    assert_eq!(status.daemon.health, Health::Starting);
    assert_eq!(status.daemon.mode, Mode::Worker);
    assert_eq!(status.daemon.instance_id, "worker-test");
    assert_eq!(status.host.os, std::env::consts::OS);
    assert!(status.host.tools.is_empty());
    assert!(status.capacity.is_none() && status.leases.is_none() && status.devices.is_none());
    let value = h
        .call_raw(agent("x"), "status.get", json!({}))
        .await
        .unwrap();
    let keys: Vec<&String> = value.as_object().unwrap().keys().collect();
    assert_eq!(keys, ["daemon", "host"]);
    let fleet = h.worker.worker_view(&h.gate, simlock_daemon::Viewer::ADMIN);
    assert_eq!(fleet.health, Some(Health::Starting));
    assert!(fleet.host.is_some() && fleet.capacity.is_none() && fleet.catalog.is_none());

    h.worker.start(&h.gate).unwrap();
    let grant = h.lease("agent-a", ios()).await.unwrap();
    // An agent sees its own lease; another agent sees none of it, an admin all.
    let status = h.call::<StatusGet>(agent("x"), &Empty {}).await.unwrap();
    assert_eq!(
        status.leases,
        Some(vec![]),
        "another agent's lease is not shown"
    );
    let by_admin = h.call::<StatusGet>(admin("op"), &Empty {}).await.unwrap();
    assert_eq!(by_admin.leases.unwrap(), vec![grant.lease.clone()]);
    let status = h
        .call::<StatusGet>(agent("agent-a"), &Empty {})
        .await
        .unwrap();
    assert_eq!(status.daemon.health, Health::Running);
    assert_eq!(status.leases.unwrap(), vec![grant.lease.clone()]);
    assert_eq!(status.devices.unwrap().len(), 1);
    assert_eq!(status.queue_depth, Some(0));
    assert_eq!(status.waiting, Some(vec![]));
    assert_eq!(status.capabilities, Some(vec![]));
    assert_eq!(status.lease.unwrap().max_ttl_ms, 14_400_000);
    assert_eq!(status.capacity.unwrap().ios.running, 1);
    assert!(status.workers.is_none());
}

#[tokio::test(start_paused = true)]
async fn catalog_config_lists_and_the_fleet_of_one() {
    let mut config = config();
    config.daemon.gateway.url = Some("ws://gw".into());
    config.daemon.gateway.token = Some("slk_secret".into());
    config.daemon.gateway.label = Some("mac-1".into());
    let h = Harness::with_config(config);

    let all = h
        .call::<CatalogGet>(agent("x"), &CatalogInput { platform: None })
        .await
        .unwrap();
    assert_eq!(all.platforms.len(), 2);
    let android = h
        .call::<CatalogGet>(
            agent("x"),
            &CatalogInput {
                platform: Some(Platform::Android),
            },
        )
        .await
        .unwrap();
    assert_eq!(android.platforms.len(), 1);
    assert_eq!(android.platforms[0].models, ["Pixel 8", "Pixel 9"]);
    assert_eq!(
        android.platforms[0].model_aliases["Pixel 8"],
        ["pixel8", "pixel"]
    );

    let view = h.call::<ConfigGet>(admin("op"), &Empty {}).await.unwrap();
    assert_eq!(view.mode, Mode::Worker);
    assert_eq!(view.lease.default_ttl_ms, 900_000);
    assert_eq!(view.settings["gateway"]["token"], "[redacted]");
    assert_eq!(view.settings["gateway"]["url"], "ws://gw");
    assert_eq!(view.settings["capacity"]["maxRunning"], 2);
    assert!(!serde_json::to_string(&view).unwrap().contains("slk_secret"));

    let grant = h.lease("agent-a", ios()).await.unwrap();
    let list = |kind| {
        let h = &h;
        async move {
            h.call::<ListGet>(admin("op"), &ListInput { kind })
                .await
                .unwrap()
        }
    };
    assert!(matches!(list(ListKind::Devices).await, ListOutput::Devices(d) if d.len() == 1));
    assert_eq!(
        list(ListKind::Leases).await,
        ListOutput::Leases(vec![grant.lease.clone()])
    );
    assert_eq!(list(ListKind::Rules).await, ListOutput::Rules(vec![]));
    assert_eq!(list(ListKind::Requests).await, ListOutput::Requests(vec![]));

    let fleet = h.call::<WorkerList>(admin("op"), &Empty {}).await.unwrap();
    assert_eq!(fleet.workers.len(), 1);
    let me = &fleet.workers[0];
    assert_eq!(me.id, "worker-test");
    assert_eq!(me.label.as_deref(), Some("mac-1"));
    assert_eq!(me.connection, Connection::Connected);
    assert!(!me.drained);
    assert_eq!(me.health, Some(Health::Running));
    assert_eq!(me.leases.as_ref().unwrap().len(), 1);
    assert_eq!(me.catalog.as_ref().unwrap().len(), 2);
    assert_eq!(me.capabilities, Some(vec![]));
}

#[tokio::test(start_paused = true)]
async fn status_reports_the_uplink_of_a_worker_with_a_gateway_once_started() {
    use simlock_contract::model::{UplinkConnection, UplinkStatus};
    use simlock_daemon::uplink::UplinkReport;

    // No gateway: no uplink.
    let h = Harness::new();
    let status = h.call::<StatusGet>(agent("x"), &Empty {}).await.unwrap();
    assert_eq!(status.uplink, None);
    let value = h
        .call_raw(agent("x"), "status.get", json!({}))
        .await
        .unwrap();
    assert!(value.get("uplink").is_none(), "{value}");

    let clock = TokioClock::starting_at(T0).shared();
    let report = UplinkReport::new("ws://gw:4700/v1", clock.clone());
    let h = Harness::build(Build {
        clock: Some(clock),
        start: false,
        uplink: Some(report),
        ..Build::default()
    });
    // While starting, only `daemon` and `host`.
    let status = h.call::<StatusGet>(agent("x"), &Empty {}).await.unwrap();
    assert_eq!(status.uplink, None);
    h.worker.start(&h.gate).unwrap();
    let status = h.call::<StatusGet>(agent("x"), &Empty {}).await.unwrap();
    assert_eq!(
        status.uplink,
        Some(UplinkStatus {
            gateway: "ws://gw:4700/v1".into(),
            state: UplinkConnection::Connecting,
            last_error: None,
            since: T0,
        })
    );
    let value = h
        .call_raw(agent("x"), "status.get", json!({}))
        .await
        .unwrap();
    assert_eq!(
        value["uplink"],
        json!({"gateway": "ws://gw:4700/v1", "state": "connecting", "since": T0})
    );
}

#[tokio::test(start_paused = true)]
async fn the_queue_depth_metric_counts_what_status_calls_the_queue() {
    let h = Harness::new();
    let metrics = simlock_daemon::metrics::Metrics::new();
    crate::register_metrics(&metrics, &h.worker);
    let mut events = h.bus.follow();
    // Capacity 2: two requests get device work at once, the third queues.
    let (a, mut a_pushes) = h.spawn_lease("agent-a", ios());
    let (b, mut b_pushes) = h.spawn_lease("agent-b", ios());
    next_push(&mut a_pushes).await;
    next_push(&mut b_pushes).await;
    let (c, _c_pushes) = h.spawn_lease("agent-c", ios());
    next_event(&mut events, "lease.queued").await;
    assert_eq!(h.worker.waiting().len(), 3, "two starting, one queued");
    let status = h.worker.status(&h.gate, simlock_daemon::Viewer::ADMIN);
    assert_eq!(status.queue_depth, Some(1));
    let text = metrics.render();
    assert!(text.contains("\nsimlock_queue_depth 1\n"), "{text}");
    assert!(text.contains("\nsimlock_leases 0\n"), "{text}");
    assert!(
        text.contains("simlock_devices{state=\"provisioning\"} 2\n"),
        "{text}"
    );
    assert!(
        text.contains("simlock_capacity_max_running{platform=\"ios\"} 2\n"),
        "{text}"
    );
    for task in [a, b, c] {
        task.abort();
    }
}

#[tokio::test(start_paused = true)]
async fn an_agent_sees_only_its_own_leases_and_waiting_requests_in_status() {
    let h = Harness::new();
    let mut events = h.bus.follow();
    let grant = h.lease("agent-a", ios()).await.unwrap();
    // Capacity 2: one more request gets device work, the next queues.
    let (b, mut b_pushes) = h.spawn_lease("agent-b", ios());
    next_push(&mut b_pushes).await;
    let (c, _c_pushes) = h.spawn_lease("agent-c", ios());
    next_event(&mut events, "lease.queued").await;
    let requesters = |status: &simlock_contract::ops::StatusOutput| -> Vec<String> {
        let waiting = status.waiting.as_ref().unwrap();
        waiting.iter().map(|w| w.requester_id.clone()).collect()
    };
    for (who, leases, waiting) in [
        ("agent-a", vec![grant.lease.clone()], vec![]),
        ("agent-b", vec![], vec!["agent-b".to_owned()]),
        ("agent-c", vec![], vec!["agent-c".to_owned()]),
        ("nobody", vec![], vec![]),
    ] {
        let status = h.call::<StatusGet>(agent(who), &Empty {}).await.unwrap();
        assert_eq!(status.leases.as_ref(), Some(&leases), "{who}");
        assert_eq!(requesters(&status), waiting, "{who}");
        assert_eq!(status.queue_depth, Some(1), "{who}: counts are everyone's");
    }
    let status = h.call::<StatusGet>(admin("op"), &Empty {}).await.unwrap();
    assert_eq!(status.leases.as_ref().map(Vec::len), Some(1));
    assert_eq!(requesters(&status).len(), 2);
    for task in [b, c] {
        task.abort();
    }
}
