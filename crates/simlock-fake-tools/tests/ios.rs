//! The iOS driver against the fake `xcrun simctl`: a worker started with the real composition,
//! its iOS platform served by `simctl` in the device set under its home.

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    reason = "a test fails by panicking"
)]

mod support;

use std::collections::BTreeSet;

use simlock_client::LeaseNotice;
use simlock_contract::ErrorCode;
use simlock_contract::model::{DeviceState, DriverKind, Platform};
use simlock_contract::push::UnhealthyReason;
use simlock_fake_tools::{Fault, FaultKind, SimState};
use support::{Events, Rig, ios_access, next_notice, within};

fn fault(command: &str, fault: FaultKind, times: Option<u32>) -> Fault {
    Fault {
        tool: "xcrun".into(),
        command: command.into(),
        fault,
        times,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fresh_worker_builds_its_ios_catalog_from_simctl() {
    let mut rig = Rig::new(Platform::Ios);
    rig.start().await;
    let client = rig.agent("agent").await;
    let catalog = client.catalog(Some(Platform::Ios)).await.unwrap();
    let ios = &catalog.platforms[0];
    assert_eq!(
        ios.models,
        [
            "iPhone 16",
            "iPhone 16 Pro",
            "iPhone 15",
            "iPad Air 11-inch (M2)"
        ],
        "the profile's iPhone and iPad types that pair with a runtime, not the watch"
    );
    assert_eq!(ios.runtimes, ["18.2", "17.5"]);
    assert_eq!(ios.default_runtime.as_deref(), Some("18.2"));
    assert_eq!(
        ios.model_runtimes["iPhone 16"],
        ["18.2"],
        "min runtime 18.0"
    );
    assert_eq!(ios.model_runtimes["iPhone 15"], ["18.2", "17.5"]);
    assert!(ios.unavailable.is_none());
    let status = client.status().await.unwrap();
    let driver = status
        .drivers
        .unwrap()
        .into_iter()
        .find(|d| d.platform == Platform::Ios)
        .unwrap();
    assert_eq!(driver.driver, DriverKind::Simctl);
    assert!(driver.available, "{}", driver.reason);
    let set = rig.device_set().display().to_string();
    assert!(
        rig.machine.calls().iter().any(|c| c.args
            == [
                "simctl",
                "--set",
                set.as_str(),
                "list",
                "-j",
                "devicetypes",
                "runtimes"
            ]),
        "the catalog comes from the tools, scoped to simlock's set"
    );
    rig.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lease_boots_a_simulator_and_a_second_lease_gets_it_clean_and_sooner() {
    let mut rig = Rig::new(Platform::Ios);
    rig.start().await;
    let mut events = Events::follow(&rig).await;

    let first = rig.lease("agent-a", Platform::Ios).await.unwrap();
    let (udid, set) = ios_access(&first);
    assert_eq!(
        std::path::Path::new(&set),
        rig.device_set(),
        "simlock's own set"
    );
    assert_eq!(first.device.driver_device_id, udid);
    assert_eq!(first.environment["SIMLOCK_IOS_DEVICE_SET"], set);
    assert_eq!(first.environment["SIMLOCK_DEVICE_UDID"], udid);
    assert_eq!(
        first.lease.access, first.device.access,
        "the lease keeps the access"
    );
    let sims = rig.machine.simulators(&rig.device_set());
    assert_eq!(sims.len(), 1);
    assert_eq!(sims[0].state, SimState::Booted);
    assert_eq!(sims[0].name, format!("simlock-{}", first.device.id));
    let granted = events.wait("lease.granted", |_| true).await;
    assert_eq!(granted.payload["source"], "provisioned");
    // The agent dirties its device.
    let dirty = rig.device_set().join(&udid).join("data/dirty");
    std::fs::write(&dirty, "agent-a was here").unwrap();

    let released_at = rig.machine.calls().len();
    rig.agent("agent-a")
        .await
        .release(first.lease.id.as_str())
        .await
        .unwrap();
    events
        .wait("device.reclaimed", |e| {
            e.payload["deviceId"] == first.device.id.as_str()
        })
        .await;
    let reclaim: Vec<String> = rig.machine.calls()[released_at..]
        .iter()
        .filter_map(|c| c.args.get(3).cloned())
        .filter(|sub| ["shutdown", "erase", "boot", "bootstatus"].contains(&sub.as_str()))
        .collect();
    assert_eq!(
        reclaim,
        ["shutdown", "erase", "boot", "bootstatus"],
        "reclaim = shutdown, erase, boot"
    );
    assert!(!dirty.exists(), "erase wiped the agent's data");

    let before = rig.machine.calls().len();
    let costs_before = rig.machine.virtual_costs().len();
    let second = rig.lease("agent-b", Platform::Ios).await.unwrap();
    assert_eq!(
        ios_access(&second).0,
        udid,
        "the same, already booted simulator"
    );
    let granted = events
        .wait("lease.granted", |e| e.payload["requester"] == "agent-b")
        .await;
    assert_eq!(granted.payload["source"], "warm");
    let work: Vec<_> = rig.machine.calls()[before..]
        .iter()
        .filter(|c| {
            c.args
                .iter()
                .any(|a| ["create", "boot", "erase"].contains(&a.as_str()))
        })
        .cloned()
        .collect();
    assert!(
        work.is_empty(),
        "no device work between the second request and its grant: {work:?}"
    );
    // What the first lease waited on: the work before its release (create and boot).
    let released_ms = rig.machine.calls()[released_at].at_ms;
    let first_cost: u64 = rig.machine.virtual_costs()[..costs_before]
        .iter()
        .filter(|c| c.at_ms < released_ms)
        .map(|c| c.virtual_ms)
        .sum();
    let second_cost: u64 = rig.machine.virtual_costs()[costs_before..]
        .iter()
        .map(|c| c.virtual_ms)
        .sum();
    assert!(
        second_cost < first_cost,
        "the second lease waited on {second_cost} virtual ms of device work, the first on {first_cost}"
    );
    assert!(second.timing.estimated_ready_ms < first.timing.estimated_ready_ms);
    rig.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn eight_parallel_leases_never_share_a_simulator() {
    let mut rig = Rig::new(Platform::Ios);
    rig.start().await;
    let rig = &rig;
    let grants = futures::future::join_all((0..8).map(|n| async move {
        rig.lease(&format!("agent-{n}"), Platform::Ios)
            .await
            .unwrap()
    }))
    .await;
    let udids: BTreeSet<String> = grants.iter().map(|g| ios_access(g).0).collect();
    let devices: BTreeSet<String> = grants.iter().map(|g| g.device.id.to_string()).collect();
    assert_eq!(udids.len(), 8, "eight simulators");
    assert_eq!(devices.len(), 8, "eight devices");
    let sims = rig.machine.simulators(&rig.device_set());
    let booted = sims.iter().filter(|s| s.state == SimState::Booted).count();
    if booted != 8 {
        let events = rig.admin().await.events(None).await.unwrap().events;
        let names: Vec<String> = events
            .iter()
            .filter(|e| e.event.starts_with("device."))
            .map(|e| format!("{} {}", e.event, e.payload))
            .collect();
        panic!("booted {booted}: {sims:#?}\n{names:#?}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_boot_that_hangs_fails_after_its_bound_and_the_device_is_not_handed_out() {
    let mut rig = Rig::new(Platform::Ios);
    rig.config.drivers.ios.boot_timeout_ms = 300;
    rig.machine.set_knobs(|k| k.ios_hang_boot = true);
    rig.start().await;
    let err = rig.lease("agent", Platform::Ios).await.unwrap_err();
    assert_eq!(err.code, ErrorCode::Internal);
    assert!(
        err.message.contains("did not finish booting within"),
        "{}",
        err.message
    );
    let admin = rig.admin().await;
    assert!(
        admin.leases().await.unwrap().leases.is_empty(),
        "nothing was granted"
    );
    for d in rig.devices().await {
        assert_ne!(d.state, DeviceState::Leased);
    }
    let simulators = rig.machine.simulators(&rig.device_set());
    assert!(!simulators.is_empty(), "a boot was tried");
    for s in simulators {
        assert_eq!(
            s.state,
            SimState::Shutdown,
            "an abandoned boot is shut down"
        );
    }
    let left: Vec<_> = rig
        .machine
        .live_processes()
        .into_iter()
        .filter(|p| p.args.contains(&"bootstatus".to_owned()))
        .collect();
    assert!(left.is_empty(), "the hung bootstatus was killed: {left:?}");
    rig.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_simulator_that_dies_mid_lease_comes_back_under_the_same_lease_and_its_holder_hears() {
    let mut rig = Rig::new(Platform::Ios);
    rig.start().await;
    let holder = rig.agent("agent").await;
    let grant = within(
        "a lease",
        holder.request_lease(
            simlock_contract::ops::LeaseRequestInput::for_platform(Platform::Ios),
            |_| {},
            std::future::pending(),
        ),
    )
    .await
    .unwrap();
    let lease = grant.lease.id.to_string();
    let mut notices = holder.lease_notices(&lease).await.unwrap();
    let (udid, _) = ios_access(&grant);
    rig.machine.crash_simulator(&rig.device_set(), &udid);
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
    let sims = rig.machine.simulators(&rig.device_set());
    assert_eq!(sims[0].state, SimState::Booted, "booted again");
    let leases = holder.leases().await.unwrap().leases;
    assert_eq!(leases.len(), 1);
    assert_eq!(leases[0].id.as_str(), lease, "the same lease");
    let events = rig.admin().await.events(None).await.unwrap().events;
    assert!(
        events
            .iter()
            .any(|e| e.event == "device.crash-detected" && e.payload["leaseId"] == lease.as_str())
    );
    assert!(
        events
            .iter()
            .any(|e| e.event == "device.recovered" && e.payload["attempts"] == 1)
    );
    rig.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reclaim_that_fails_quarantines_the_device_until_a_retry_works() {
    let mut rig = Rig::new(Platform::Ios);
    rig.start().await;
    let mut events = Events::follow(&rig).await;
    let first = rig.lease("agent-a", Platform::Ios).await.unwrap();
    let erase_fails = fault(
        "erase",
        FaultKind::Exit {
            code: 1,
            stderr: "An error was encountered processing the command (domain=NSPOSIXErrorDomain, code=28):\nNo space left on device".into(),
        },
        Some(2),
    );
    rig.machine.set_knobs(|k| k.faults.push(erase_fails));
    rig.agent("agent-a")
        .await
        .release(first.lease.id.as_str())
        .await
        .unwrap();
    let quarantined = events.wait("device.quarantined", |_| true).await;
    assert_eq!(quarantined.payload["deviceId"], first.device.id.as_str());
    assert_eq!(quarantined.payload["attempts"], 1);
    let device = rig
        .devices()
        .await
        .into_iter()
        .find(|d| d.id == first.device.id)
        .unwrap();
    assert_eq!(
        device.state,
        DeviceState::Quarantined,
        "visible to operators"
    );
    assert_eq!(device.quarantine_attempts, Some(1));
    assert!(device.quarantine_next_retry_at.is_some());
    // Never handed out meanwhile: another lease gets another simulator.
    let second = rig.lease("agent-b", Platform::Ios).await.unwrap();
    assert_ne!(second.device.id, first.device.id);
    // The fault answers twice; the third reclaim works.
    events
        .wait("device.quarantined", |e| e.payload["attempts"] == 2)
        .await;
    let recovered = events.wait("device.quarantine-recovered", |_| true).await;
    assert_eq!(recovered.payload["attempts"], 2);
    let device = rig
        .devices()
        .await
        .into_iter()
        .find(|d| d.id == first.device.id)
        .unwrap();
    assert_eq!(device.state, DeviceState::Ready);
    assert_eq!(device.quarantine_attempts, None);
    rig.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_device_whose_reclaims_keep_failing_is_deleted_after_its_retries() {
    let mut rig = Rig::new(Platform::Ios);
    rig.start().await;
    let mut events = Events::follow(&rig).await;
    let first = rig.lease("agent-a", Platform::Ios).await.unwrap();
    rig.machine.set_knobs(|k| {
        k.faults.push(fault(
            "erase",
            FaultKind::Exit {
                code: 1,
                stderr: "broken".into(),
            },
            None,
        ))
    });
    rig.agent("agent-a")
        .await
        .release(first.lease.id.as_str())
        .await
        .unwrap();
    let abandoned = events.wait("device.quarantine-abandoned", |_| true).await;
    assert_eq!(
        abandoned.payload["attempts"], 3,
        "the first failure and two retries"
    );
    events
        .wait("device.deleted", |e| {
            e.payload["deviceId"] == first.device.id.as_str()
        })
        .await;
    assert!(
        rig.machine.simulators(&rig.device_set()).is_empty(),
        "deleted from the set"
    );
    rig.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn simulators_outside_simlocks_set_survive_everything_untouched() {
    let mut rig = Rig::new(Platform::Ios);
    let default_set = rig.machine.default_set();
    let other_set = rig.dir.path().join("someone-elses-set");
    std::fs::create_dir_all(&other_set).unwrap();
    let mine = rig
        .machine
        .add_foreign_simulator(&default_set, "My iPhone", SimState::Booted);
    let theirs = rig
        .machine
        .add_foreign_simulator(&other_set, "Their iPhone", SimState::Shutdown);
    let before = (
        rig.machine.simulators(&default_set),
        rig.machine.simulators(&other_set),
    );
    rig.start().await;
    let mut events = Events::follow(&rig).await;
    // Leases, a crash, a reclaim, a failed reclaim, a restart, a release of everything.
    let a = rig.lease("agent-a", Platform::Ios).await.unwrap();
    let b = rig.lease("agent-b", Platform::Ios).await.unwrap();
    rig.machine
        .crash_simulator(&rig.device_set(), &ios_access(&a).0);
    events.wait("device.recovered", |_| true).await;
    rig.agent("agent-a")
        .await
        .release(a.lease.id.as_str())
        .await
        .unwrap();
    events.wait("device.reclaimed", |_| true).await;
    rig.machine.set_knobs(|k| {
        k.faults.push(fault(
            "erase",
            FaultKind::Exit {
                code: 1,
                stderr: "no".into(),
            },
            Some(1),
        ))
    });
    rig.agent("agent-b")
        .await
        .release(b.lease.id.as_str())
        .await
        .unwrap();
    events.wait("device.quarantined", |_| true).await;
    rig.stop().await;
    rig.start().await;
    rig.admin().await.release_all().await.unwrap();
    rig.stop().await;
    assert_eq!(
        (
            rig.machine.simulators(&default_set),
            rig.machine.simulators(&other_set)
        ),
        before
    );
    for (set, udid) in [(&default_set, &mine), (&other_set, &theirs)] {
        assert_eq!(
            std::fs::read_to_string(set.join(udid).join("data/user-file")).unwrap(),
            "the user's own data\n"
        );
    }
    let set = rig.device_set().display().to_string();
    for call in rig.machine.calls().iter().filter(|c| c.tool == "xcrun") {
        assert_eq!(
            call.args.get(1..3),
            Some(&["--set".to_owned(), set.clone()][..]),
            "every call names simlock's set: {call:?}"
        );
        assert!(
            !call.args.contains(&mine) && !call.args.contains(&theirs),
            "{call:?}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn garbled_simctl_output_is_a_typed_error_not_a_crash() {
    // At start-up: the platform is unavailable, with the reason, and the worker serves on.
    let mut rig = Rig::new(Platform::Ios);
    rig.machine
        .set_knobs(|k| k.faults.push(fault("list", FaultKind::Garbage, Some(1))));
    rig.start().await;
    let client = rig.agent("agent").await;
    let status = client.status().await.unwrap();
    let ios = status
        .drivers
        .unwrap()
        .into_iter()
        .find(|d| d.platform == Platform::Ios)
        .unwrap();
    assert!(!ios.available);
    assert!(
        ios.reason
            .contains("cannot read (a device type and runtime listing)"),
        "{}",
        ios.reason
    );
    let catalog = client.catalog(Some(Platform::Ios)).await.unwrap();
    assert!(catalog.platforms[0].models.is_empty());
    assert_eq!(
        catalog.platforms[0].unavailable.as_deref(),
        Some(ios.reason.as_str())
    );
    let err = rig.lease("agent", Platform::Ios).await.unwrap_err();
    assert_eq!(err.code, ErrorCode::NoDriver);
    assert!(err.message.contains("unavailable"), "{}", err.message);
    // Android (virtual here) is unaffected.
    assert!(rig.lease("agent", Platform::Android).await.is_ok());
    rig.stop().await;

    // During a lease: `create` prints garbage three times; the request fails with a typed error.
    let mut rig = Rig::new(Platform::Ios);
    rig.machine
        .set_knobs(|k| k.faults.push(fault("create", FaultKind::Garbage, None)));
    rig.start().await;
    let err = rig.lease("agent", Platform::Ios).await.unwrap_err();
    assert!(
        err.message
            .contains("cannot read (the new simulator's UDID)"),
        "{}",
        err.message
    );
    assert!(
        rig.agent("probe").await.status().await.is_ok(),
        "the worker still serves"
    );
    rig.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tool_call_past_its_bound_is_killed_and_fails_typed() {
    let mut rig = Rig::new(Platform::Ios);
    rig.config.drivers.ios.call_timeout_ms = 300;
    rig.machine.set_knobs(|k| {
        k.faults
            .push(fault("create", FaultKind::Slow { ms: 60_000 }, None))
    });
    rig.start().await;
    let err = rig.lease("agent", Platform::Ios).await.unwrap_err();
    assert!(
        err.message
            .contains("took longer than 300 ms and was killed"),
        "{}",
        err.message
    );
    let slow: Vec<_> = rig
        .machine
        .live_processes()
        .into_iter()
        .filter(|p| p.args.contains(&"create".to_owned()))
        .collect();
    assert!(slow.is_empty(), "the slow creates were killed: {slow:?}");
    rig.stop().await;
}
