//! The Android driver against the fake `avdmanager`, `emulator` and `adb`: a worker started with
//! the real composition, its Android platform served by the SDK tools with its own AVD home
//! and its own adb server.

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    reason = "a test fails by panicking"
)]

mod support;

use std::collections::BTreeSet;
use std::process::Command;

use simlock_client::LeaseNotice;
use simlock_contract::ErrorCode;
use simlock_contract::model::{DeviceState, DriverKind, LeaseGrant, Platform};
use simlock_contract::ops::LeaseRequestInput;
use simlock_contract::push::UnhealthyReason;
use simlock_fake_tools::{Fault, FaultKind};
use support::{Events, Rig, android_access, next_notice, within};

fn fault(tool: &str, command: &str, fault: FaultKind, times: Option<u32>) -> Fault {
    Fault {
        tool: tool.into(),
        command: command.into(),
        fault,
        times,
    }
}

/// Runs the machine's `adb` as an agent would, with only the grant's environment.
fn agent_adb(rig: &Rig, grant: &LeaseGrant, args: &[&str]) -> std::process::Output {
    Command::new(rig.machine.sdk_root().join("platform-tools/adb"))
        .args(args)
        .env_remove("ANDROID_ADB_SERVER_PORT")
        .env_remove("ANDROID_SERIAL")
        .envs(&grant.environment)
        .output()
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fresh_worker_builds_its_android_catalog_from_the_sdk_and_runs_its_own_adb_server() {
    let mut rig = Rig::new(Platform::Android);
    rig.start().await;
    let client = rig.agent("agent").await;
    let catalog = client.catalog(Some(Platform::Android)).await.unwrap();
    let android = &catalog.platforms[0];
    assert_eq!(
        android.models,
        ["Pixel 8", "Pixel Tablet"],
        "phones and tablets, not the watch"
    );
    assert_eq!(
        android.runtimes,
        ["35", "34"],
        "the installed system images, newest first"
    );
    assert_eq!(android.default_runtime.as_deref(), Some("35"));
    assert_eq!(android.resolve_model("pixel_8"), Some("Pixel 8"));
    let status = client.status().await.unwrap();
    let driver = status
        .drivers
        .unwrap()
        .into_iter()
        .find(|d| d.platform == Platform::Android)
        .unwrap();
    assert_eq!(driver.driver, DriverKind::AndroidSdk);
    assert!(driver.available, "{}", driver.reason);
    let port = rig.config.drivers.android.adb_server_port;
    let servers = rig.machine.adb_servers();
    assert_eq!(servers.len(), 1, "{servers:?}");
    let server = &servers[0];
    assert!(server.alive && server.port == port);
    assert!(
        !server.scanner && server.reject_kill,
        "scanner off, kill-server refused"
    );
    rig.stop().await;
    assert!(
        !rig.machine.adb_servers().iter().any(|s| s.alive),
        "stopped with the worker, by pid"
    );
    for call in rig.machine.calls().iter().filter(|c| c.tool == "adb") {
        assert_eq!(
            call.args.get(..2),
            Some(&["-P".to_owned(), port.to_string()][..]),
            "never the user's server: {call:?}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lease_boots_an_emulator_and_a_second_lease_gets_it_clean_from_the_baseline() {
    let mut rig = Rig::new(Platform::Android);
    rig.start().await;
    let mut events = Events::follow(&rig).await;

    let first = rig.lease("agent-a", Platform::Android).await.unwrap();
    let (serial, port, avd) = android_access(&first);
    let (min, max) = (
        rig.config.drivers.android.console_port_min,
        rig.config.drivers.android.console_port_max,
    );
    let console: u16 = serial.trim_start_matches("emulator-").parse().unwrap();
    assert!(
        (min..=max).contains(&console) && console.is_multiple_of(2),
        "{serial} in {min}–{max}"
    );
    assert_eq!(port, rig.config.drivers.android.adb_server_port);
    assert_eq!(avd, format!("simlock_{}", first.device.id));
    assert_eq!(first.device.address.as_deref(), Some(serial.as_str()));
    assert_eq!(
        first.environment["ANDROID_ADB_SERVER_PORT"],
        port.to_string()
    );
    assert_eq!(first.environment["ANDROID_SERIAL"], serial);
    assert!(
        rig.avd_home()
            .join(format!("{avd}.avd/config.ini"))
            .exists(),
        "in simlock's AVD home"
    );
    // Plain adb with the grant's environment reaches the device through simlock's server.
    let out = agent_adb(&rig, &first, &["devices"]);
    assert_eq!(
        String::from_utf8_lossy(&out.stdout),
        format!("List of devices attached\n{serial}\tdevice\n\n")
    );
    assert!(
        agent_adb(&rig, &first, &["shell", "touch", "/data/local/tmp/dirty"])
            .status
            .success()
    );
    let granted = events.wait("lease.granted", |_| true).await;
    assert_eq!(granted.payload["source"], "provisioned");

    let costs_at_release = rig.machine.virtual_costs().len();
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
    let reclaim = &rig.machine.virtual_costs()[costs_at_release..];
    assert_eq!(
        reclaim.iter().map(|c| c.work.as_str()).collect::<Vec<_>>(),
        ["snapshot-load"],
        "the reclaim loads the clean baseline: {reclaim:?}"
    );
    let cold = rig.machine.virtual_costs()[..costs_at_release]
        .iter()
        .find(|c| c.work == "cold-boot")
        .unwrap()
        .virtual_ms;
    assert!(
        reclaim[0].virtual_ms < cold,
        "a snapshot load ({}) beats a cold boot ({cold})",
        reclaim[0].virtual_ms
    );
    let out = agent_adb(&rig, &first, &["shell", "ls", "/data/local/tmp/dirty"]);
    assert!(
        !out.status.success(),
        "the agent's file went with the baseline"
    );

    let costs_before = rig.machine.virtual_costs().len();
    let second = rig.lease("agent-b", Platform::Android).await.unwrap();
    assert_eq!(
        android_access(&second).0,
        serial,
        "the same emulator, already running"
    );
    let granted = events
        .wait("lease.granted", |e| e.payload["requester"] == "agent-b")
        .await;
    assert_eq!(granted.payload["source"], "warm");
    assert!(
        rig.machine.virtual_costs()[costs_before..].is_empty(),
        "no device work between the second request and its grant"
    );
    assert!(second.timing.estimated_ready_ms < first.timing.estimated_ready_ms);
    rig.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn eight_parallel_leases_never_share_an_emulator_a_serial_or_a_port() {
    let mut rig = Rig::new(Platform::Android);
    rig.start().await;
    let rig = &rig;
    let grants = futures::future::join_all((0..8).map(|n| async move {
        rig.lease(&format!("agent-{n}"), Platform::Android)
            .await
            .unwrap()
    }))
    .await;
    let serials: BTreeSet<String> = grants.iter().map(|g| android_access(g).0).collect();
    let avds: BTreeSet<String> = grants.iter().map(|g| android_access(g).2).collect();
    let devices: BTreeSet<String> = grants.iter().map(|g| g.device.id.to_string()).collect();
    assert_eq!((serials.len(), avds.len(), devices.len()), (8, 8, 8));
    let emulators = rig.machine.emulators();
    let ports: BTreeSet<u16> = emulators
        .iter()
        .filter(|e| e.alive)
        .map(|e| e.console_port)
        .collect();
    assert_eq!(ports.len(), 8, "eight console ports");
    for p in &ports {
        assert!(
            !ports.contains(&(p + 1)),
            "a console port is never another's adb port"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_boot_that_hangs_fails_after_its_bound_and_the_emulator_is_stopped() {
    let mut rig = Rig::new(Platform::Android);
    rig.config.drivers.android.boot_timeout_ms = 300;
    rig.machine.set_knobs(|k| k.emulator_hang_boot = true);
    rig.start().await;
    let err = rig.lease("agent", Platform::Android).await.unwrap_err();
    assert_eq!(err.code, ErrorCode::Internal);
    assert!(
        err.message.contains("did not finish booting within"),
        "{}",
        err.message
    );
    assert!(
        rig.admin().await.leases().await.unwrap().leases.is_empty(),
        "nothing was granted"
    );
    for d in rig.devices().await {
        assert_ne!(d.state, DeviceState::Leased);
    }
    let emulators = rig.machine.emulators();
    assert!(!emulators.is_empty(), "a boot was tried");
    assert!(
        emulators.iter().all(|e| !e.alive),
        "every hung emulator was killed"
    );
    rig.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_emulator_killed_mid_lease_comes_back_under_the_same_lease_and_its_holder_hears() {
    let mut rig = Rig::new(Platform::Android);
    rig.start().await;
    let holder = rig.agent("agent").await;
    let grant = within(
        "a lease",
        holder.request_lease(
            LeaseRequestInput::for_platform(Platform::Android),
            |_| {},
            std::future::pending(),
        ),
    )
    .await
    .unwrap();
    let lease = grant.lease.id.to_string();
    let mut notices = holder.lease_notices(&lease).await.unwrap();
    let (serial, _, avd) = android_access(&grant);
    let killed = rig.machine.kill_emulator(&avd).unwrap();
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
    let emulator = rig
        .machine
        .emulators()
        .into_iter()
        .find(|e| e.avd == avd)
        .unwrap();
    assert!(
        emulator.alive && emulator.pid != killed,
        "a new emulator process"
    );
    assert_eq!(
        format!("emulator-{}", emulator.console_port),
        serial,
        "on the same port: the serial holds"
    );
    assert_eq!(
        emulator.boot_kind, "cold",
        "a recovery never loads a snapshot or wipes"
    );
    let leases = holder.leases().await.unwrap().leases;
    assert_eq!(leases.len(), 1);
    assert_eq!(leases[0].id.as_str(), lease);
    assert!(
        agent_adb(&rig, &grant, &["shell", "getprop", "sys.boot_completed"])
            .status
            .success()
    );
    rig.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reclaim_that_fails_quarantines_the_emulator() {
    let mut rig = Rig::new(Platform::Android);
    rig.start().await;
    let mut events = Events::follow(&rig).await;
    let first = rig.lease("agent-a", Platform::Android).await.unwrap();
    // The baseline load fails twice (the reclaim and its first retry), then works.
    rig.machine.set_knobs(|k| {
        k.faults.push(fault(
            "adb",
            "emu",
            FaultKind::Exit {
                code: 1,
                stderr: "error: could not connect to TCP port".into(),
            },
            Some(2),
        ));
    });
    rig.agent("agent-a")
        .await
        .release(first.lease.id.as_str())
        .await
        .unwrap();
    let quarantined = events.wait("device.quarantined", |_| true).await;
    assert_eq!(quarantined.payload["deviceId"], first.device.id.as_str());
    let device = rig
        .devices()
        .await
        .into_iter()
        .find(|d| d.id == first.device.id)
        .unwrap();
    assert_eq!(device.state, DeviceState::Quarantined);
    let second = rig.lease("agent-b", Platform::Android).await.unwrap();
    assert_ne!(
        second.device.id, first.device.id,
        "never handed out while quarantined"
    );
    events
        .wait("device.quarantine-recovered", |e| {
            e.payload["deviceId"] == first.device.id.as_str()
        })
        .await;
    let device = rig
        .devices()
        .await
        .into_iter()
        .find(|d| d.id == first.device.id)
        .unwrap();
    assert_eq!(device.state, DeviceState::Ready);
    rig.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn garbled_sdk_output_is_a_typed_error_not_a_crash() {
    let mut rig = Rig::new(Platform::Android);
    rig.machine.set_knobs(|k| {
        k.faults
            .push(fault("avdmanager", "list", FaultKind::Garbage, Some(1)))
    });
    rig.start().await;
    let client = rig.agent("agent").await;
    let status = client.status().await.unwrap();
    let android = status
        .drivers
        .unwrap()
        .into_iter()
        .find(|d| d.platform == Platform::Android)
        .unwrap();
    assert!(!android.available);
    assert!(
        android
            .reason
            .contains("cannot read (the hardware profiles)"),
        "{}",
        android.reason
    );
    let catalog = client.catalog(Some(Platform::Android)).await.unwrap();
    assert_eq!(
        catalog.platforms[0].unavailable.as_deref(),
        Some(android.reason.as_str())
    );
    let err = rig.lease("agent", Platform::Android).await.unwrap_err();
    assert_eq!(err.code, ErrorCode::NoDriver);
    assert!(
        rig.machine.adb_servers().is_empty(),
        "no adb server for a driver that did not open"
    );
    rig.stop().await;

    let mut rig = Rig::new(Platform::Android);
    rig.machine
        .set_knobs(|k| k.faults.push(fault("adb", "emu", FaultKind::Garbage, None)));
    rig.start().await;
    let err = rig.lease("agent", Platform::Android).await.unwrap_err();
    assert!(
        err.message
            .contains("cannot read (the console's answer, ending OK)"),
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
async fn exec_runs_tools_with_the_grants_environment_and_they_reach_the_device() {
    let mut rig = Rig::new(Platform::Android);
    let adb = rig.machine.sdk_root().join("platform-tools/adb");
    rig.config.core.exec.tools.insert(
        "adb".into(),
        simlock_core::config::ToolConfig {
            command: adb.display().to_string(),
            args: vec![],
        },
    );
    rig.config.core.exec.tools.insert(
        "env".into(),
        simlock_core::config::ToolConfig {
            command: "env".into(),
            args: vec![],
        },
    );
    rig.start().await;
    let client = rig.agent("agent").await;
    let grant = within(
        "a lease",
        client.request_lease(
            LeaseRequestInput::for_platform(Platform::Android),
            |_| {},
            std::future::pending(),
        ),
    )
    .await
    .unwrap();
    let run = |tool: &str, args: &[&str]| {
        let input = simlock_contract::ops::ExecInput {
            lease_id: grant.lease.id.to_string(),
            tool: tool.into(),
            args: args.iter().map(|a| (*a).to_owned()).collect(),
            stdin: None,
            requester_id: None,
        };
        let client = client.clone();
        async move {
            let mut stream = client.exec(input).await.unwrap();
            let mut out = String::new();
            loop {
                match within("exec output", stream.next()).await {
                    Some(Ok(simlock_client::ExecEvent::Output { chunk, .. })) => {
                        out.push_str(&chunk)
                    }
                    Some(Ok(simlock_client::ExecEvent::Exit { exit_code })) => {
                        return (exit_code, out);
                    }
                    other => panic!("{other:?}"),
                }
            }
        }
    };
    let (code, env) = run("env", &[]).await;
    assert_eq!(code, 0);
    for (key, value) in &grant.environment {
        assert!(
            env.lines().any(|l| l == format!("{key}={value}")),
            "{key}={value} in\n{env}"
        );
    }
    // Plain `adb shell` (no -P, no -s) reaches the leased emulator through simlock's server.
    let (code, out) = run("adb", &["shell", "getprop", "ro.boot.qemu.avd_name"]).await;
    assert_eq!(code, 0, "{out}");
    assert_eq!(out.trim(), android_access(&grant).2);
    rig.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stale_baseline_is_replaced_by_a_wipe_and_a_new_baseline() {
    let mut rig = Rig::new(Platform::Android);
    rig.start().await;
    let mut events = Events::follow(&rig).await;
    let first = rig.lease("agent-a", Platform::Android).await.unwrap();
    let (_, _, avd) = android_access(&first);
    assert!(
        agent_adb(&rig, &first, &["shell", "touch", "/data/local/tmp/dirty"])
            .status
            .success()
    );
    // The AVD's hardware changes: the baseline no longer matches what it was taken of.
    let config = rig.avd_home().join(format!("{avd}.avd/config.ini"));
    let text = std::fs::read_to_string(&config)
        .unwrap()
        .replace("hw.ramSize=2048", "hw.ramSize=4096");
    std::fs::write(&config, text).unwrap();
    let costs = rig.machine.virtual_costs().len();
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
    let reclaim: Vec<String> = rig.machine.virtual_costs()[costs..]
        .iter()
        .map(|c| c.work.clone())
        .collect();
    assert_eq!(
        reclaim,
        ["wipe-boot"],
        "a full wipe, not the stale snapshot"
    );
    assert!(
        !agent_adb(&rig, &first, &["shell", "ls", "/data/local/tmp/dirty"])
            .status
            .success()
    );
    // The new baseline serves the next reclaim.
    let second = rig.lease("agent-b", Platform::Android).await.unwrap();
    let costs = rig.machine.virtual_costs().len();
    rig.agent("agent-b")
        .await
        .release(second.lease.id.as_str())
        .await
        .unwrap();
    events
        .wait("device.reclaimed", |e| {
            e.payload["deviceId"] == first.device.id.as_str()
        })
        .await;
    let reclaim: Vec<String> = rig.machine.virtual_costs()[costs..]
        .iter()
        .map(|c| c.work.clone())
        .collect();
    assert_eq!(reclaim, ["snapshot-load"]);
    rig.stop().await;
}
