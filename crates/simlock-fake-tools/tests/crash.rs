//! `kill -9` of the real `simlock-worker` binary mid-create, mid-boot and mid-reclaim, then a
//! restart on the same home: every process the killed worker had started is found again by
//! pid (an emulator of a lease is adopted; the rest is stopped), the adb server is reaped, no
//! half-made device is left, and no lease is lost.
//!
//! These run when `SIMLOCK_E2E=1` (set by `cargo xtask e2e`, which builds the binaries first);
//! `SIMLOCK_BIN_DIR` names where `simlock-worker` is (default: the workspace's `target/debug`).

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    reason = "a test fails by panicking"
)]
#![allow(clippy::print_stderr, reason = "a skipped test says why")]

mod support;

use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};

use simlock_contract::model::{DeviceState, LeaseGrant, Platform};
use simlock_contract::ops::LeaseRequestInput;
use simlock_drivers::{AndroidDriverChoice, IosDriverChoice};
use simlock_fake_tools::{Fault, FaultKind, SimState};
use simlock_worker::WorkerConfig;
use support::{PATIENCE, Rig, android_access, ios_access, within};

fn enabled() -> bool {
    let on = std::env::var("SIMLOCK_E2E").is_ok_and(|v| v == "1");
    if !on {
        eprintln!("skipped: set SIMLOCK_E2E=1 (cargo xtask e2e) to kill a real worker process");
    }
    on
}

fn worker_bin() -> PathBuf {
    let dir = std::env::var_os("SIMLOCK_BIN_DIR").map_or_else(
        || PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../target/debug"),
        PathBuf::from,
    );
    let path = dir.join("simlock-worker");
    assert!(
        path.exists(),
        "{} is not built; run cargo xtask e2e",
        path.display()
    );
    path
}

/// The `--set` flags that give the worker binary the rig's configuration.
fn sets(c: &WorkerConfig) -> Vec<String> {
    let ios = |d: IosDriverChoice| match d {
        IosDriverChoice::Auto => "auto",
        IosDriverChoice::Virtual => "virtual",
        IosDriverChoice::Simctl => "simctl",
    };
    let android = |d: AndroidDriverChoice| match d {
        AndroidDriverChoice::Auto => "auto",
        AndroidDriverChoice::Virtual => "virtual",
        AndroidDriverChoice::AndroidSdk => "android-sdk",
    };
    let (i, a) = (&c.drivers.ios, &c.drivers.android);
    let mut out = vec![
        "capacity.strategy=fixed".to_owned(),
        format!("capacity.maxRunning={}", c.core.capacity.max_running),
        format!("health.probeIntervalMs={}", c.core.health.probe_interval_ms),
        format!(
            "health.recoveryBackoffMs={}",
            c.core.health.recovery_backoff_ms
        ),
        format!("drivers.ios.driver={}", ios(i.driver)),
        format!("drivers.ios.xcrun={}", i.xcrun),
        format!("drivers.ios.bootTimeoutMs={}", i.boot_timeout_ms),
        format!("drivers.android.driver={}", android(a.driver)),
        format!("drivers.android.adbServerPort={}", a.adb_server_port),
        format!("drivers.android.consolePortMin={}", a.console_port_min),
        format!("drivers.android.consolePortMax={}", a.console_port_max),
        format!("drivers.android.bootPollMs={}", a.boot_poll_ms),
        format!("drivers.android.bootTimeoutMs={}", a.boot_timeout_ms),
    ];
    if let Some(sdk) = &a.sdk_root {
        out.push(format!("drivers.android.sdkRoot={sdk}"));
    }
    out
}

/// The worker binary on the rig's home, until it is killed.
struct Process(Child);

impl Process {
    fn start(rig: &Rig) -> Self {
        let mut command = Command::new(worker_bin());
        command
            .arg("--home")
            .arg(rig.home.root())
            .env("SIMLOCK_LOG", "warn")
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit());
        for set in sets(&rig.config) {
            command.arg("--set").arg(set);
        }
        let mut child = command.spawn().unwrap();
        let stdout = child.stdout.take().unwrap();
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let mut lines = BufReader::new(stdout).lines();
            if let Some(Ok(line)) = lines.next() {
                let _ = tx.send(line);
            }
            for _ in lines {}
        });
        let line = rx.recv_timeout(PATIENCE).expect("the worker's ready line");
        assert!(line.contains("\"ready\""), "{line}");
        Self(child)
    }

    fn kill9(mut self) {
        self.0.kill().unwrap();
        self.0.wait().unwrap();
    }
}

impl Drop for Process {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// A lease request that runs on until the worker dies (its outcome does not matter).
fn request_in_background(rig: &Rig, requester: &str, platform: Platform) {
    let home = rig.home.root().to_path_buf();
    let requester = requester.to_owned();
    tokio::spawn(async move {
        let options = simlock_client::ConnectOptions::default().principal(requester);
        if let Ok(client) = simlock_client::Client::connect_home(&home, options).await {
            let _ = client
                .request_lease(
                    LeaseRequestInput::for_platform(platform),
                    |_| {},
                    std::future::pending(),
                )
                .await;
        }
    });
}

/// Waits until the worker's start-up sweep of `platform` ran (or had run).
async fn swept(rig: &Rig, platform: Platform) {
    let admin = rig.admin().await;
    let mut follow = admin.follow_events().await.unwrap();
    let done = |e: &simlock_contract::model::EventEnvelope| {
        e.event == "driver.swept" && e.payload["platform"] == platform.as_str()
    };
    if admin.events(None).await.unwrap().events.iter().any(done) {
        return;
    }
    within("the start-up sweep", async {
        loop {
            if let Some(Ok(simlock_client::FollowItem::Event(e))) = follow.next().await
                && done(&e)
            {
                return;
            }
        }
    })
    .await;
}

/// The fake processes alive with no worker running (all the killed worker's), but `keep`.
fn orphans(rig: &Rig, keep: &[u32]) -> Vec<simlock_fake_tools::ProcRecord> {
    rig.machine
        .live_processes()
        .into_iter()
        .filter(|p| !keep.contains(&p.pid))
        .collect()
}

/// Waits until every one of `left` has ended (the restarted worker stops them by pid).
fn gone(rig: &Rig, left: &[simlock_fake_tools::ProcRecord]) {
    rig.machine.wait_until(
        "the killed worker's processes to be stopped",
        PATIENCE,
        |_| {
            left.iter()
                .all(|p| !simlock_fake_tools::machine::pid_alive(p.pid))
        },
    );
}

fn hang(tool: &str, command: &str) -> Fault {
    Fault {
        tool: tool.into(),
        command: command.into(),
        fault: FaultKind::Hang,
        times: Some(1),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn android_kill9_mid_create_mid_boot_and_mid_reclaim_loses_no_lease_and_leaves_no_orphan() {
    if !enabled() {
        return;
    }
    let rig = Rig::new(Platform::Android);
    let worker = Process::start(&rig);
    let held: LeaseGrant = rig.lease("holder", Platform::Android).await.unwrap();
    let (serial, _, held_avd) = android_access(&held);
    let held_pid = rig
        .machine
        .emulators()
        .into_iter()
        .find(|e| e.avd == held_avd)
        .unwrap()
        .pid;

    // Mid-boot: a second request's emulator boots for ever.
    rig.machine.set_knobs(|k| k.emulator_cold_steps = 1_000_000);
    request_in_background(&rig, "booter", Platform::Android);
    rig.machine
        .wait_until("the second emulator", PATIENCE, |m| {
            m.emulators().iter().filter(|e| e.alive).count() == 2
        });
    let server = rig
        .machine
        .adb_servers()
        .into_iter()
        .find(|s| s.alive)
        .unwrap()
        .pid;
    worker.kill9();
    let booting: Vec<u32> = rig
        .machine
        .emulators()
        .iter()
        .filter(|e| e.avd != held_avd && e.alive)
        .map(|e| e.pid)
        .collect();
    assert_eq!(
        booting.len(),
        1,
        "the half-booted emulator outlived the worker"
    );
    let left = orphans(&rig, &[held_pid]);
    assert!(
        left.iter().any(|p| p.pid == server),
        "so did the adb server"
    );
    rig.machine.set_knobs(|k| k.emulator_cold_steps = 60);

    let worker = Process::start(&rig);
    swept(&rig, Platform::Android).await;
    gone(&rig, &left);
    assert!(
        simlock_fake_tools::machine::pid_alive(held_pid),
        "the leased device's emulator runs on"
    );
    let leases = rig.admin().await.leases().await.unwrap().leases;
    assert_eq!(
        leases.len(),
        1,
        "the held lease survived; the interrupted request did not become one"
    );
    assert_eq!(leases[0].id, held.lease.id);
    // The held emulator was adopted: same process, reachable through the new server.
    let emulator = rig
        .machine
        .emulators()
        .into_iter()
        .find(|e| e.avd == held_avd)
        .unwrap();
    assert!(emulator.alive && emulator.pid == held_pid);
    let out = Command::new(rig.machine.sdk_root().join("platform-tools/adb"))
        .arg("devices")
        .envs(&held.environment)
        .output()
        .unwrap();
    assert!(
        String::from_utf8_lossy(&out.stdout).contains(&format!("{serial}\tdevice")),
        "{out:?}"
    );
    let devices = rig.devices().await;
    assert!(
        devices
            .iter()
            .all(|d| d.id == held.device.id || d.state == DeviceState::Shutdown),
        "{devices:?}"
    );

    // Mid-reclaim: the baseline load hangs.
    rig.machine.set_knobs(|k| k.faults.push(hang("adb", "emu")));
    rig.agent("holder")
        .await
        .release(held.lease.id.as_str())
        .await
        .unwrap();
    rig.machine.wait_until("the hung reclaim", PATIENCE, |m| {
        m.live_processes()
            .iter()
            .any(|p| p.tool == "adb" && p.args.contains(&"emu".to_owned()))
    });
    worker.kill9();
    let left = orphans(&rig, &[held_pid]);
    let worker = Process::start(&rig);
    swept(&rig, Platform::Android).await;
    gone(&rig, &left);
    let mut events = support::Events::follow(&rig).await;
    if rig
        .devices()
        .await
        .iter()
        .find(|d| d.id == held.device.id)
        .unwrap()
        .state
        != DeviceState::Ready
    {
        events
            .wait("device.reclaimed", |e| {
                e.payload["deviceId"] == held.device.id.as_str()
            })
            .await;
    }
    assert!(
        !rig.machine
            .live_processes()
            .iter()
            .any(|p| p.tool == "adb" && p.args.contains(&"emu".to_owned())),
        "the hung `adb emu` of the killed worker was stopped"
    );

    // Mid-create: avdmanager hangs.
    rig.machine.set_knobs(|k| {
        k.faults.push(hang("avdmanager", "create"));
    });
    // The ready device goes to its holder again, so the next request must create one.
    let again = rig.lease("holder", Platform::Android).await.unwrap();
    assert_eq!(again.device.id, held.device.id);
    // Another model than the shut-down one from the boot above, so a device is created.
    let home = rig.home.root().to_path_buf();
    tokio::spawn(async move {
        let options = simlock_client::ConnectOptions::default().principal("creator");
        if let Ok(client) = simlock_client::Client::connect_home(&home, options).await {
            let mut input = LeaseRequestInput::for_platform(Platform::Android);
            input.model = Some("Pixel Tablet".into());
            let _ = client
                .request_lease(input, |_| {}, std::future::pending())
                .await;
        }
    });
    rig.machine.wait_until("the hung create", PATIENCE, |m| {
        m.live_processes().iter().any(|p| p.tool == "avdmanager")
    });
    worker.kill9();
    let left = orphans(&rig, &[held_pid]);
    let worker = Process::start(&rig);
    swept(&rig, Platform::Android).await;
    gone(&rig, &left);
    assert!(
        !rig.machine
            .live_processes()
            .iter()
            .any(|p| p.tool == "avdmanager"),
        "the hung avdmanager was stopped"
    );
    let known: std::collections::BTreeSet<String> = rig
        .devices()
        .await
        .into_iter()
        .map(|d| d.driver_device_id)
        .collect();
    for entry in std::fs::read_dir(rig.avd_home()).unwrap().flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        if let Some(avd) = name.strip_suffix(".ini") {
            assert!(known.contains(avd), "a leaked AVD: {avd}");
        }
    }
    assert_eq!(
        rig.admin().await.leases().await.unwrap().leases.len(),
        1,
        "the lease made before survived"
    );
    drop(worker);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ios_kill9_mid_boot_leaves_no_orphan_and_no_booted_simulator() {
    if !enabled() {
        return;
    }
    let mut rig = Rig::new(Platform::Ios);
    rig.config.drivers.ios.boot_timeout_ms = 600_000;
    let worker = Process::start(&rig);
    let held = rig.lease("holder", Platform::Ios).await.unwrap();
    // bootstatus hangs silently (a printing one dies of SIGPIPE with the worker's pipe).
    rig.machine
        .set_knobs(|k| k.faults.push(hang("xcrun", "bootstatus")));
    request_in_background(&rig, "booter", Platform::Ios);
    rig.machine
        .wait_until("the hung bootstatus", PATIENCE, |m| {
            m.live_processes()
                .iter()
                .any(|p| p.args.contains(&"bootstatus".to_owned()))
        });
    worker.kill9();
    let left = orphans(&rig, &[]);
    assert!(
        left.iter()
            .any(|p| p.args.contains(&"bootstatus".to_owned())),
        "{left:?}"
    );
    let worker = Process::start(&rig);
    swept(&rig, Platform::Ios).await;
    gone(&rig, &left);
    let held_udid = ios_access(&held).0;
    for sim in rig.machine.simulators(&rig.device_set()) {
        if sim.udid == held_udid {
            assert_eq!(sim.state, SimState::Booted, "the leased simulator runs on");
        } else {
            assert_eq!(
                sim.state,
                SimState::Shutdown,
                "the half-booted one was shut down"
            );
        }
    }
    let leases = rig.admin().await.leases().await.unwrap().leases;
    assert_eq!(leases.len(), 1);
    assert_eq!(leases[0].id, held.lease.id, "no lease is lost");
    drop(worker);
}
