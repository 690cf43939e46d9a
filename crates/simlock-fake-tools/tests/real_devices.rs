//! The manual check against real tools: `cargo xtask e2e --real-devices` on a Mac with Xcode
//! and/or a machine with an Android SDK and a system image (`ANDROID_HOME`). For each platform
//! whose tools are here, a worker with the real driver leases a device, checks it is reachable the
//! way the grant says, releases it, leases it again (clean, already running), then deletes it.
//! It runs only with `SIMLOCK_REAL_DEVICES=1`; it fails when no platform's tools are found.

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    reason = "a test fails by panicking"
)]
#![allow(clippy::print_stderr, reason = "a manual check says what it does")]

mod support;

use std::process::Command;
use std::time::Duration;

use simlock_contract::model::{DeviceAccess, Platform};
use simlock_core::config::CapacityStrategy;
use simlock_daemon::home::Home;
use simlock_drivers::{AndroidDriverChoice, IosDriverChoice};
use simlock_worker::WorkerConfig;

/// The SDK's adb, else the one on PATH.
fn adb() -> std::path::PathBuf {
    std::env::var_os("ANDROID_HOME")
        .or_else(|| std::env::var_os("ANDROID_SDK_ROOT"))
        .map_or_else(
            || "adb".into(),
            |sdk| std::path::PathBuf::from(sdk).join("platform-tools/adb"),
        )
}

/// A real boot may take minutes (a first boot after an Xcode update, a cold emulator).
async fn bounded(what: &str, check: impl Future<Output = ()>) {
    tokio::time::timeout(Duration::from_secs(1200), check)
        .await
        .unwrap_or_else(|_| panic!("{what} took more than 20 minutes"));
}

fn on_path(program: &str) -> bool {
    std::env::var_os("PATH")
        .is_some_and(|p| std::env::split_paths(&p).any(|d| d.join(program).is_file()))
}

async fn check(platform: Platform) {
    let dir = tempfile::tempdir().unwrap();
    let home = Home::at(dir.path().join("home"));
    let mut config = WorkerConfig::default();
    config.core.capacity.strategy = CapacityStrategy::Fixed;
    config.core.capacity.max_running = 1;
    config.drivers.ios.driver = IosDriverChoice::Virtual;
    config.drivers.android.driver = AndroidDriverChoice::Virtual;
    match platform {
        Platform::Ios => config.drivers.ios.driver = IosDriverChoice::Simctl,
        Platform::Android => {
            config.drivers.android.driver = AndroidDriverChoice::AndroidSdk;
            // Not the default 5038, in case another simlock runs here.
            config.drivers.android.adb_server_port = 5098;
        }
    }
    let worker = simlock_worker::start(simlock_worker::WorkerOptions::new(home.clone(), config))
        .await
        .unwrap();
    let status = worker
        .worker
        .status(&worker.running.base.gate, simlock_daemon::Viewer::ADMIN);
    let driver = status
        .drivers
        .unwrap()
        .into_iter()
        .find(|d| d.platform == platform)
        .unwrap();
    eprintln!("{platform}: {} — {}", driver.driver.as_str(), driver.reason);
    assert!(driver.available, "{}", driver.reason);
    let client = simlock_client::Client::connect_home(
        home.root(),
        simlock_client::ConnectOptions::default().principal("real-check"),
    )
    .await
    .unwrap();
    let catalog = client.catalog(Some(platform)).await.unwrap();
    eprintln!(
        "{platform}: catalog {:?} on {:?}",
        catalog.platforms[0].models, catalog.platforms[0].runtimes
    );
    let lease = || {
        client.request_lease(
            simlock_contract::ops::LeaseRequestInput::for_platform(platform),
            |p| eprintln!("{platform}: {p:?}"),
            std::future::pending(),
        )
    };
    let first = tokio::time::timeout(Duration::from_secs(600), lease())
        .await
        .unwrap()
        .unwrap();
    eprintln!("{platform}: granted {:?}", first.device.access);
    let reached = match first.device.access.clone().unwrap() {
        DeviceAccess::IosSimulator { udid, device_set } => {
            let out = Command::new("xcrun")
                .args(["simctl", "--set", &device_set, "list", "devices", &udid])
                .output()
                .unwrap();
            String::from_utf8_lossy(&out.stdout).contains("(Booted)")
        }
        DeviceAccess::AndroidEmulator { .. } => {
            let out = Command::new(adb())
                .args(["shell", "getprop", "sys.boot_completed"])
                .envs(&first.environment)
                .output()
                .unwrap();
            String::from_utf8_lossy(&out.stdout).trim() == "1"
        }
        other => panic!("not a real device: {other:?}"),
    };
    assert!(reached, "the device is reachable the way the grant says");
    client.release(first.lease.id.as_str()).await.unwrap();
    let second = tokio::time::timeout(Duration::from_secs(600), lease())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(
        second.device.id, first.device.id,
        "the reclaimed device, already running"
    );
    client.release(second.lease.id.as_str()).await.unwrap();
    // Leave nothing behind: the worker deletes its devices when they idle; do it now.
    worker.stop("real-device check").await;
    match platform {
        Platform::Ios => {
            let set = home.root().join("devices/ios");
            let _ = Command::new("xcrun")
                .args(["simctl", "--set"])
                .arg(&set)
                .args(["shutdown", "all"])
                .status();
            let _ = Command::new("xcrun")
                .args(["simctl", "--set"])
                .arg(&set)
                .args(["delete", "all"])
                .status();
        }
        Platform::Android => {
            if let DeviceAccess::AndroidEmulator {
                serial, avd_name, ..
            } = second.device.access.unwrap()
            {
                let _ = Command::new(adb())
                    .args(["-P", "5098", "-s", &serial, "emu", "kill"])
                    .status();
                let _ = Command::new("avdmanager")
                    .args(["delete", "avd", "-n", &avd_name])
                    .env("ANDROID_AVD_HOME", home.root().join("devices/android"))
                    .status();
            }
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn real_tools_serve_a_lease_cycle() {
    if std::env::var("SIMLOCK_REAL_DEVICES").as_deref() != Ok("1") {
        eprintln!(
            "skipped: cargo xtask e2e --real-devices runs this on a machine with Xcode or an Android SDK"
        );
        return;
    }
    let mut ran = 0;
    if on_path("xcrun") {
        bounded("the iOS check", check(Platform::Ios)).await;
        ran += 1;
    } else {
        eprintln!("ios: skipped, no xcrun on PATH");
    }
    if std::env::var_os("ANDROID_HOME").is_some() || std::env::var_os("ANDROID_SDK_ROOT").is_some()
    {
        bounded("the Android check", check(Platform::Android)).await;
        ran += 1;
    } else {
        eprintln!("android: skipped, neither ANDROID_HOME nor ANDROID_SDK_ROOT is set");
    }
    assert!(ran > 0, "no real device tools on this machine");
}
