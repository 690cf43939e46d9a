//! `fake-machine <dir>`: lays out a fake machine (the default profile: its Xcode device types and
//! runtimes, its Android SDK images) under `dir`, its tools linked to the fakes built beside
//! this binary, and prints how to start a worker on it. For trying the real drivers' paths
//! (device sets, AVDs, adb servers, crashes and restarts) where no Xcode or Android SDK is.

#![allow(
    clippy::print_stdout,
    clippy::print_stderr,
    reason = "a command-line tool says what it made"
)]

use std::path::PathBuf;
use std::process::ExitCode;

use simlock_fake_tools::{FakeMachine, Profile, Tools};

const USAGE: &str = "usage: fake-machine <dir>\n\nLays out a fake machine under <dir> (fake xcrun \
simctl, avdmanager, emulator and adb sharing its state) and prints the simlock-worker flags that \
use it.";

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let dir = match args.as_slice() {
        [flag] if flag == "--help" || flag == "-h" => {
            println!("{USAGE}");
            return ExitCode::SUCCESS;
        }
        [dir] if !dir.starts_with('-') => PathBuf::from(dir),
        _ => {
            eprintln!("{USAGE}");
            return ExitCode::from(2);
        }
    };
    let Some(bin) = std::env::current_exe()
        .ok()
        .and_then(|exe| exe.parent().map(PathBuf::from))
    else {
        eprintln!("fake-machine: cannot tell where its fake tools are");
        return ExitCode::from(1);
    };
    let tools = Tools {
        xcrun: bin.join("xcrun"),
        adb: bin.join("adb"),
        emulator: bin.join("emulator"),
        avdmanager: bin.join("avdmanager"),
    };
    for tool in [&tools.xcrun, &tools.adb, &tools.emulator, &tools.avdmanager] {
        if !tool.is_file() {
            eprintln!(
                "fake-machine: {} is missing: build the fake tools first (cargo build -p \
                 simlock-fake-tools --bins)",
                tool.display()
            );
            return ExitCode::from(1);
        }
    }
    if let Err(e) = std::fs::create_dir_all(&dir) {
        eprintln!("fake-machine: cannot make {}: {e}", dir.display());
        return ExitCode::from(1);
    }
    let machine = FakeMachine::create(&dir, &tools, &Profile::default());
    let root = machine.root().to_path_buf();
    // The machine outlives this command: nothing of it runs yet, and nothing is stopped.
    std::mem::forget(machine);
    println!("a fake machine at {}", root.display());
    println!("start a worker on it:");
    println!(
        "  simlock-worker --home {home} --set drivers.ios.driver=simctl --set \
         drivers.ios.xcrun={xcrun} --set drivers.android.driver=android-sdk --set \
         drivers.android.sdkRoot={sdk}",
        home = root.join("worker").display(),
        xcrun = root.join("bin/xcrun").display(),
        sdk = root.join("sdk").display(),
    );
    println!(
        "its boot times and faults: {}",
        root.join("state/knobs.json").display()
    );
    ExitCode::SUCCESS
}
