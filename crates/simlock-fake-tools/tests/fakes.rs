//! The fakes themselves: the argv grammar, formats, exit codes and state the drivers rely on.

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    reason = "a test fails by panicking"
)]

use std::path::Path;
use std::process::{Command, Output, Stdio};
use std::time::Duration;

use simlock_fake_tools::{FakeMachine, Fault, FaultKind, Profile, SimState, Tools};

fn tools() -> Tools {
    Tools {
        xcrun: env!("CARGO_BIN_EXE_xcrun").into(),
        adb: env!("CARGO_BIN_EXE_adb").into(),
        emulator: env!("CARGO_BIN_EXE_emulator").into(),
        avdmanager: env!("CARGO_BIN_EXE_avdmanager").into(),
    }
}

fn machine() -> (tempfile::TempDir, FakeMachine) {
    let dir = tempfile::tempdir().unwrap();
    let m = FakeMachine::create(&dir.path().join("m"), &tools(), &Profile::default());
    (dir, m)
}

fn run(program: &Path, args: &[&str], env: &[(&str, &str)]) -> Output {
    let mut c = Command::new(program);
    c.args(args).stdin(Stdio::null());
    for (k, v) in env {
        c.env(k, v);
    }
    c.output().unwrap()
}

fn text(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

fn err(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// `simctl bootstatus -b` of a simulator whose boot the knobs hold: once it reported the boot
/// under way, the boot is let go, and what it printed to its end is answered.
fn bootstatus_of_a_held_boot(m: &FakeMachine, xcrun: &Path, set: &str, udid: &str) -> Output {
    use std::io::BufRead as _;
    let mut child = Command::new(xcrun)
        .args(["simctl", "--set", set, "bootstatus", udid, "-b"])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let stdout = child.stdout.take().unwrap();
    let (tx, lines) = std::sync::mpsc::channel();
    let reader = std::thread::spawn(move || {
        for line in std::io::BufReader::new(stdout).lines() {
            let Ok(line) = line else { return };
            if tx.send(line).is_err() {
                return;
            }
        }
    });
    let mut printed = Vec::new();
    let mut let_go = false;
    loop {
        match lines.recv_timeout(Duration::from_secs(60)) {
            Ok(line) => {
                if !let_go && line.contains("Waiting on System App") {
                    m.set_knobs(|k| k.ios_hang_boot = false);
                    let_go = true;
                }
                printed.push(line);
            }
            Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => break,
            Err(std::sync::mpsc::RecvTimeoutError::Timeout) => {
                let _ = child.kill();
                panic!("bootstatus said {printed:?}, then nothing");
            }
        }
    }
    assert!(
        let_go,
        "bootstatus never saw the boot under way: {printed:?}"
    );
    reader.join().unwrap();
    let mut out = child.wait_with_output().unwrap();
    out.stdout = printed.join("\n").into_bytes();
    out
}

#[test]
fn simctl_scopes_every_call_to_its_set() {
    let (dir, m) = machine();
    let set = dir.path().join("set");
    std::fs::create_dir_all(&set).unwrap();
    let s = set.to_str().unwrap();
    let xcrun = m.xcrun();
    let out = run(
        &xcrun,
        &[
            "simctl",
            "--set",
            s,
            "create",
            "a",
            "com.apple.CoreSimulator.SimDeviceType.iPhone-16",
            "com.apple.CoreSimulator.SimRuntime.iOS-18-2",
        ],
        &[],
    );
    assert!(out.status.success(), "{}", err(&out));
    let udid = text(&out).trim().to_owned();
    assert_eq!(udid.len(), 36);
    assert_eq!(udid, udid.to_uppercase());
    // Outside the set the UDID is unknown.
    let out = run(&xcrun, &["simctl", "boot", &udid], &[]);
    assert_eq!(out.status.code(), Some(148));
    assert!(
        err(&out).contains("Invalid device or device pair"),
        "{}",
        err(&out)
    );
    let out = run(
        &xcrun,
        &["simctl", "--set", s, "list", "-j", "devices"],
        &[],
    );
    let listed = text(&out);
    assert!(listed.contains("\"udid\" : "), "simctl's spacing: {listed}");
    assert!(listed.contains("\\/"), "escaped slashes: {listed}");
    let json: serde_json::Value = serde_json::from_str(&listed).unwrap();
    let devices = &json["devices"]["com.apple.CoreSimulator.SimRuntime.iOS-18-2"];
    assert_eq!(devices[0]["state"], "Shutdown");
    assert!(devices[0].get("lastBootedAt").is_none(), "never booted");
    assert_eq!(
        json["devices"]["com.apple.CoreSimulator.SimRuntime.iOS-17-5"],
        serde_json::json!([])
    );

    // erase needs Shutdown; boot twice is a state error. The boot is held until bootstatus
    // has seen it booting (a boot's few milliseconds of wall time can pass before the next
    // tool even starts on a loaded machine).
    m.set_knobs(|k| k.ios_hang_boot = true);
    assert!(
        run(&xcrun, &["simctl", "--set", s, "boot", &udid], &[])
            .status
            .success()
    );
    let out = run(&xcrun, &["simctl", "--set", s, "boot", &udid], &[]);
    assert_eq!(out.status.code(), Some(149));
    assert!(
        err(&out).contains("current state: Booting") || err(&out).contains("current state: Booted")
    );
    let out = bootstatus_of_a_held_boot(&m, &xcrun, s, &udid);
    assert!(out.status.success(), "{}", err(&out));
    assert!(text(&out).contains("Finished"), "{}", text(&out));
    let out = run(&xcrun, &["simctl", "--set", s, "erase", &udid], &[]);
    assert_eq!(out.status.code(), Some(149));
    assert!(err(&out).contains("Unable to erase contents and settings in current state: Booted"));
    assert!(
        run(&xcrun, &["simctl", "--set", s, "shutdown", &udid], &[])
            .status
            .success()
    );
    let out = run(&xcrun, &["simctl", "--set", s, "shutdown", &udid], &[]);
    assert!(err(&out).contains("Unable to shutdown device in current state: Shutdown"));
    assert!(
        run(&xcrun, &["simctl", "--set", s, "erase", &udid], &[])
            .status
            .success()
    );
    assert!(
        run(&xcrun, &["simctl", "--set", s, "delete", &udid], &[])
            .status
            .success()
    );
    assert!(m.simulators(&set).is_empty());
    assert!(!set.join(&udid).exists());
    // Unknown grammar is refused.
    let out = run(&xcrun, &["simctl", "--set", s, "frobnicate"], &[]);
    assert!(!out.status.success());
    assert!(!m.calls().is_empty());
}

#[test]
fn a_fault_makes_a_command_fail_or_print_garbage_as_often_as_asked() {
    let (_dir, m) = machine();
    m.set_knobs(|k| {
        k.faults.push(Fault {
            tool: "xcrun".into(),
            command: "list".into(),
            fault: FaultKind::Garbage,
            times: Some(1),
        });
    });
    let out = run(&m.xcrun(), &["simctl", "list", "-j", "runtimes"], &[]);
    assert!(out.status.success());
    assert!(serde_json::from_slice::<serde_json::Value>(&out.stdout).is_err());
    let out = run(&m.xcrun(), &["simctl", "list", "-j", "runtimes"], &[]);
    assert!(
        serde_json::from_slice::<serde_json::Value>(&out.stdout).is_ok(),
        "once only"
    );
}

#[test]
fn an_emulator_boots_announces_itself_and_dies_on_emu_kill() {
    let (dir, m) = machine();
    let avd_home = dir.path().join("avd");
    std::fs::create_dir_all(&avd_home).unwrap();
    let home = avd_home.to_str().unwrap();
    let sdk = m.sdk_root();
    let avdmanager = sdk.join("cmdline-tools/latest/bin/avdmanager");
    let adb = sdk.join("platform-tools/adb");
    let emulator = sdk.join("emulator/emulator");
    let env = [
        ("ANDROID_AVD_HOME", home),
        ("ANDROID_ADB_SERVER_PORT", "27311"),
    ];
    // Without ANDROID_AVD_HOME the fake refuses.
    let out = run(&avdmanager, &["list", "avd"], &[]);
    assert!(!out.status.success());
    let out = run(
        &avdmanager,
        &[
            "create",
            "avd",
            "-n",
            "t1",
            "-k",
            "system-images;android-35;google_apis;x86_64",
            "-d",
            "pixel_8",
        ],
        &env,
    );
    assert!(out.status.success(), "{}", err(&out));
    let out = run(
        &avdmanager,
        &[
            "create",
            "avd",
            "-n",
            "t1",
            "-k",
            "system-images;android-35;google_apis;x86_64",
            "-d",
            "pixel_8",
        ],
        &env,
    );
    assert!(err(&out).contains("already exists"));
    let out = run(
        &avdmanager,
        &[
            "create",
            "avd",
            "-n",
            "t2",
            "-k",
            "system-images;android-99;x;y",
        ],
        &env,
    );
    assert!(err(&out).contains("Package path is not valid"));

    let mut server = Command::new(&adb);
    server
        .args(["-P", "27311", "nodaemon", "server"])
        .env("ADB_EMU", "0")
        .env("ADB_REJECT_KILL_SERVER", "1");
    let mut server = server.spawn().unwrap();
    m.wait_until("the adb server", Duration::from_secs(10), |m| {
        m.adb_servers().iter().any(|s| s.alive)
    });
    let mut emu = Command::new(&emulator);
    emu.args([
        "-avd",
        "t1",
        "-port",
        "27320",
        "-no-snapshot-load",
        "-no-window",
    ])
    .envs(env);
    let mut emu = emu.spawn().unwrap();
    m.wait_until("the boot", Duration::from_secs(30), |_| {
        let out = run(
            &adb,
            &[
                "-P",
                "27311",
                "-s",
                "emulator-27320",
                "shell",
                "getprop",
                "sys.boot_completed",
            ],
            &env,
        );
        text(&out).trim() == "1"
    });
    let out = run(&adb, &["-P", "27311", "devices"], &env);
    assert_eq!(
        text(&out),
        "List of devices attached\nemulator-27320\tdevice\n\n"
    );
    let out = run(&adb, &["-s", "emulator-27320", "emu", "avd", "path"], &env);
    assert!(text(&out).ends_with("t1.avd\r\nOK\r\n"), "{:?}", text(&out));
    let out = run(&adb, &["-P", "27311", "kill-server"], &env);
    assert!(err(&out).contains("kill-server rejected"), "{}", err(&out));
    // A second launch of the same AVD fails at once.
    let out = run(&emulator, &["-avd", "t1", "-port", "27330"], &env);
    assert!(
        err(&out).contains("another emulator instance"),
        "{}",
        err(&out)
    );
    let out = run(&adb, &["-s", "emulator-27320", "emu", "kill"], &env);
    assert!(text(&out).starts_with("OK: killing emulator"));
    assert!(emu.wait().unwrap().success());
    server.kill().unwrap();
    server.wait().unwrap();
    assert!(m.world().emulators.is_empty());
    let _ = SimState::Booted;
}

/// A hand-made `fake-machine.json` that is no profile is said so by every tool, without a
/// panic.
#[test]
fn a_profile_that_does_not_read_is_said_so_without_a_panic() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("fake-machine.json"), "{}").unwrap();
    let root = dir.path().to_str().unwrap();
    for (tool, args) in [
        (tools().xcrun, vec!["simctl", "list", "-j"]),
        (tools().adb, vec!["devices"]),
        (tools().avdmanager, vec!["list", "avd"]),
        (tools().emulator, vec!["-list-avds"]),
    ] {
        let out = run(&tool, &args, &[("SIMLOCK_FAKE_MACHINE", root)]);
        assert!(!out.status.success(), "{tool:?}");
        let said = err(&out);
        assert!(
            said.contains("fake-machine.json is not a fake machine's profile: missing field"),
            "{tool:?}: {said}"
        );
        assert!(!said.contains("panicked"), "{tool:?}: {said}");
    }
}

/// `fake-machine <dir>` lays out a machine the fakes find and prints the worker's flags for it;
/// without a directory it prints its usage and exits 2.
#[test]
fn fake_machine_lays_out_a_machine_and_says_how_to_use_it() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("m");
    let made = run(
        Path::new(env!("CARGO_BIN_EXE_fake-machine")),
        &[root.to_str().unwrap()],
        &[],
    );
    assert!(made.status.success(), "{}", err(&made));
    let said = text(&made);
    let root = root.canonicalize().unwrap();
    assert!(
        said.contains(&format!(
            "--set drivers.ios.xcrun={}",
            root.join("bin/xcrun").display()
        )),
        "{said}"
    );
    let listed = run(
        &root.join("bin/xcrun"),
        &["simctl", "list", "-j", "runtimes"],
        &[],
    );
    assert!(listed.status.success(), "{}", err(&listed));
    assert!(text(&listed).contains("\"runtimes\""));
    let usage = run(Path::new(env!("CARGO_BIN_EXE_fake-machine")), &[], &[]);
    assert_eq!(usage.status.code(), Some(2));
    assert!(err(&usage).starts_with("usage: fake-machine <dir>"));
}
