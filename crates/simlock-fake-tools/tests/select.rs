//! Which driver serves each platform: `auto` takes the real driver where its tools are found and
//! work, else the virtual one, and says why; an explicit real driver that cannot work leaves its
//! platform unavailable with the reason.

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    reason = "a test fails by panicking"
)]

mod support;

use simlock_contract::model::{DriverKind, DriverStatus, Platform};
use simlock_drivers::{AndroidDriverChoice, IosDriverChoice};
use support::Rig;

async fn statuses(rig: &Rig) -> Vec<DriverStatus> {
    let drivers = simlock_drivers::select(
        &rig.config.drivers,
        &rig.config.core.virtual_devices,
        rig.home.root(),
    )
    .await;
    let statuses = drivers.iter().map(|d| d.status()).collect();
    for d in drivers {
        d.close().await;
    }
    statuses
}

fn of(statuses: &[DriverStatus], platform: Platform) -> &DriverStatus {
    statuses.iter().find(|s| s.platform == platform).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn auto_takes_the_real_driver_where_the_tools_work_and_says_why_it_did_not_elsewhere() {
    let mut rig = Rig::new(Platform::Android);
    rig.config.drivers.ios.driver = IosDriverChoice::Auto;
    rig.config.drivers.ios.xcrun = rig.dir.path().join("no/xcrun").display().to_string();
    rig.config.drivers.android.driver = AndroidDriverChoice::Auto;
    let s = statuses(&rig).await;
    let ios = of(&s, Platform::Ios);
    assert_eq!(ios.driver, DriverKind::Virtual);
    assert!(ios.available);
    assert!(
        ios.reason.starts_with("auto: ") && ios.reason.contains("not found"),
        "{}",
        ios.reason
    );
    let android = of(&s, Platform::Android);
    assert_eq!(android.driver, DriverKind::AndroidSdk, "{}", android.reason);

    // Tools that are there but broken: auto falls back, with the reason.
    rig.config.drivers.ios.xcrun = rig.machine.xcrun().display().to_string();
    rig.machine.set_knobs(|k| {
        k.faults.push(simlock_fake_tools::Fault {
            tool: "xcrun".into(),
            command: "list".into(),
            fault: simlock_fake_tools::FaultKind::Exit {
                code: 72,
                stderr: "xcrun: error: unable to find utility \"simctl\"".into(),
            },
            times: Some(1),
        });
    });
    rig.config.drivers.android.sdk_root = Some(rig.dir.path().join("no-sdk").display().to_string());
    let s = statuses(&rig).await;
    let ios = of(&s, Platform::Ios);
    assert_eq!(ios.driver, DriverKind::Virtual);
    assert!(
        ios.reason.contains("simctl does not work")
            && ios.reason.contains("unable to find utility"),
        "{}",
        ios.reason
    );
    let android = of(&s, Platform::Android);
    assert_eq!(android.driver, DriverKind::Virtual);
    assert!(
        android.reason.contains("lacks platform-tools/adb"),
        "{}",
        android.reason
    );

    // The same, chosen explicitly: unavailable, never virtual.
    rig.config.drivers.ios.driver = IosDriverChoice::Simctl;
    rig.config.drivers.ios.xcrun = rig.dir.path().join("no/xcrun").display().to_string();
    rig.config.drivers.android.driver = AndroidDriverChoice::AndroidSdk;
    let s = statuses(&rig).await;
    for platform in Platform::ALL {
        let st = of(&s, platform);
        assert!(!st.available, "{st:?}");
        assert_ne!(st.driver, DriverKind::Virtual);
    }
}
