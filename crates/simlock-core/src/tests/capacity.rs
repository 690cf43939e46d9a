//! Capacity through the worker: the resource strategy's numbers, idle tiers and eviction.

use std::time::Duration;

use crate::config::CapacityStrategy;
use serde_json::json;
use simlock_contract::model::{DeviceState, Platform};
use simlock_contract::ops::{LeaseIdInput, LeaseRelease};
use simlock_contract::{ErrorCode, model::Health};

use super::*;

#[tokio::test(start_paused = true)]
async fn the_resource_strategy_derives_limits_from_the_machine() {
    let mut config = config();
    config.core.capacity.strategy = CapacityStrategy::Resource;
    let h = Harness::build(Build {
        config,
        system: Arc::new(FixedSystem {
            cpus: 8,
            ram_bytes: 32 * GIB,
        }),
        ..Build::default()
    });
    let status = h.worker.status(&h.gate, simlock_daemon::Viewer::ADMIN);
    assert_eq!(status.daemon.health, Health::Running);
    let capacity = status.capacity.unwrap();
    assert_eq!(capacity.ios.max_running, 4, "max(1, 8/2)");
    assert_eq!(capacity.android.max_running, 2, "max(1, min(8/4, 32/8))");
    assert_eq!(capacity.global.max_running, 6);
    assert!(!capacity.android.at_ram_budget);

    // 10 GiB: a 6 GiB budget holds one Android device (4 GiB) but not two.
    let mut config = super::config();
    config.core.capacity.strategy = CapacityStrategy::Resource;
    let h = Harness::build(Build {
        config,
        system: Arc::new(FixedSystem {
            cpus: 16,
            ram_bytes: 10 * GIB,
        }),
        ..Build::default()
    });
    let capacity = h.worker.capacity();
    assert_eq!(
        (capacity.ios.max_running, capacity.android.max_running),
        (8, 1)
    );
    h.lease("agent-a", android()).await.unwrap();
    let capacity = h.worker.capacity();
    assert!(capacity.android.at_ram_budget);
    assert!(!capacity.ios.at_ram_budget, "1.5 GiB more still fits");
    let mut no_wait = android();
    no_wait.model = Some("pixel9".into());
    no_wait.no_wait = Some(true);
    assert_eq!(
        h.lease("agent-b", no_wait).await.unwrap_err().code,
        ErrorCode::NoCapacity
    );
    h.lease("agent-c", ios()).await.unwrap();
}

#[tokio::test(start_paused = true)]
async fn idle_devices_are_shut_down_then_deleted_and_leased_ones_never_touched() {
    let mut config = config();
    config.core.idle.shutdown_after_ms = 60_000;
    config.core.idle.delete_after_ms = 180_000;
    let h = Harness::with_config(config);
    let mut events = h.bus.follow();
    let mut long = android();
    long.ttl_ms = Some(3_600_000);
    let kept = h.lease("agent-keep", long).await.unwrap();
    let idle = h.lease("agent-a", ios()).await.unwrap();
    h.call::<LeaseRelease>(
        agent("agent-a"),
        &LeaseIdInput {
            reason: None,
            lease_id: idle.lease.id.to_string(),
        },
    )
    .await
    .unwrap();
    next_event(&mut events, "device.reclaimed").await;
    let idle_since = h.now();

    let shutdown = next_event(&mut events, "device.shutdown").await;
    assert_eq!(shutdown.payload["deviceId"], json!(idle.device.id));
    assert_eq!(h.now() - idle_since, 60_000);
    let states = |h: &Harness| -> Vec<(String, DeviceState)> {
        h.worker
            .devices()
            .into_iter()
            .map(|d| (d.id.to_string(), d.state))
            .collect()
    };
    assert!(states(&h).contains(&(idle.device.id.to_string(), DeviceState::Shutdown)));

    let deleted = next_event(&mut events, "device.deleted").await;
    assert_eq!(deleted.payload["deviceId"], json!(idle.device.id));
    assert_eq!(h.now() - idle_since, 180_000);
    assert_eq!(
        states(&h),
        vec![(kept.device.id.to_string(), DeviceState::Leased)],
        "the leased device is untouched"
    );
    assert_eq!(h.worker.leases(), vec![kept.lease.clone()]);
}

#[tokio::test(start_paused = true)]
async fn a_shutdown_device_is_booted_for_a_request_of_its_spec() {
    let mut config = config();
    config.core.idle.shutdown_after_ms = 60_000;
    let h = Harness::with_config(config);
    let mut events = h.bus.follow();
    let first = h.lease("agent-a", ios()).await.unwrap();
    h.worker
        .release(&agent("agent-a"), first.lease.id.as_str(), None)
        .unwrap();
    next_event(&mut events, "device.shutdown").await;
    let (ctx, mut pushes) = agent_with_pushes("agent-b");
    let booted = h.call::<LeaseRequest>(ctx, &ios()).await.unwrap();
    assert_eq!(booted.device.id, first.device.id);
    assert_eq!(booted.timing.estimated_ready_ms, 1_000);
    assert_eq!(
        next_push(&mut pushes).await,
        Push::Progress {
            request_id: 0.into(),
            progress: simlock_contract::push::Progress::Booting { eta_ms: 1_000 }
        }
    );
    let granted = next_event(&mut events, "lease.granted").await;
    assert_eq!(granted.payload["source"], "booted");
}

#[tokio::test(start_paused = true)]
async fn a_full_worker_evicts_its_least_recently_used_idle_device_of_another_spec() {
    let h = Harness::new();
    let mut events = h.bus.follow();
    let phone = h.lease("agent-a", ios()).await.unwrap();
    let mut tablet = ios();
    tablet.model = Some("ipad".into());
    let tablet = h.lease("agent-b", tablet).await.unwrap();
    let release = |principal: &'static str, lease_id: String| {
        let h = &h;
        async move {
            h.call::<LeaseRelease>(
                agent(principal),
                &LeaseIdInput {
                    reason: None,
                    lease_id,
                },
            )
            .await
            .unwrap()
        }
    };
    // The tablet goes idle first, so it is the least recently used.
    release("agent-b", tablet.lease.id.to_string()).await;
    tokio::time::advance(Duration::from_secs(5)).await;
    release("agent-a", phone.lease.id.to_string()).await;
    next_event(&mut events, "device.reclaimed").await;
    next_event(&mut events, "device.reclaimed").await;
    assert_eq!(h.worker.capacity().global.warm, 2);

    let pixel = h.lease("agent-c", android()).await.unwrap();
    assert_eq!(pixel.device.spec.platform, Platform::Android);
    let shutdown = next_event(&mut events, "device.shutdown").await;
    assert_eq!(shutdown.payload["deviceId"], json!(tablet.device.id));
    let state_of = |id: &simlock_contract::ids::DeviceId| {
        h.worker
            .devices()
            .into_iter()
            .find(|d| &d.id == id)
            .map(|d| d.state)
    };
    assert_eq!(state_of(&tablet.device.id), Some(DeviceState::Shutdown));
    assert_eq!(state_of(&phone.device.id), Some(DeviceState::Ready));
    let capacity = h.worker.capacity();
    assert_eq!(
        (capacity.global.running, capacity.global.max_running),
        (2, 2)
    );
}
