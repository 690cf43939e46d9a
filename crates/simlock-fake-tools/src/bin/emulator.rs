//! Fake `emulator`: `-version`, `-list-avds`, and a launch (`-avd <name> …`) that runs until
//! killed: real loopback listeners on the console port and the adb port next to it, an
//! announcement to the adb server `ANDROID_ADB_SERVER_PORT` names, a boot that takes virtual
//! time, snapshots under `<avd>.avd/snapshots/`, and the console protocol `adb emu` speaks.

#![allow(
    clippy::print_stdout,
    clippy::print_stderr,
    clippy::unwrap_used,
    clippy::disallowed_methods,
    reason = "a fake tool prints what the real one prints and takes the time a boot step takes"
)]

use std::fs;
use std::io::{BufRead, BufReader, Write};
use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use simlock_fake_tools::adbwire;
use simlock_fake_tools::machine::{EmulatorRecord, now_ms, pid_alive};
use simlock_fake_tools::tool::{self, Exit, Outcome};
use simlock_fake_tools::{FakeMachine, Knobs};

fn main() -> ExitCode {
    tool::run("emulator", command_of, emulator)
}

fn command_of(args: &[String]) -> String {
    match args.first().map(String::as_str) {
        Some("-version") => "-version".into(),
        Some("-list-avds") => "-list-avds".into(),
        _ => "launch".into(),
    }
}

fn avd_home(machine: &FakeMachine) -> PathBuf {
    std::env::var_os("ANDROID_AVD_HOME")
        .map_or_else(|| machine.home().join(".android/avd"), PathBuf::from)
}

fn emulator(machine: &FakeMachine, args: &[String]) -> Outcome {
    match args.first().map(String::as_str) {
        Some("-version") => {
            let v = machine.profile().sdk.emulator_version;
            println!("INFO    | Android emulator version {v} (build_id 12538925) (CL:N/A)");
            println!("INFO    | Graphics backend: gfxstream");
            return Ok(());
        }
        Some("-list-avds") => {
            println!(
                "INFO    | Storing crashdata in: /tmp/android-fake/emu-crash-35.1.4.db, detection is enabled for process: {}",
                std::process::id()
            );
            let mut names: Vec<String> = fs::read_dir(avd_home(machine))
                .map(|d| {
                    d.filter_map(Result::ok)
                        .filter_map(|e| {
                            e.file_name()
                                .to_str()?
                                .strip_suffix(".ini")
                                .map(String::from)
                        })
                        .collect()
                })
                .unwrap_or_default();
            names.sort();
            for n in names {
                println!("{n}");
            }
            return Ok(());
        }
        _ => {}
    }
    let launch = Launch::parse(args)?;
    run(machine, &launch)
}

#[derive(Debug, Default)]
struct Launch {
    avd: String,
    port: Option<u16>,
    snapshot: Option<String>,
    no_snapshot_load: bool,
    wipe: bool,
    read_only: bool,
    no_boot_anim: bool,
}

impl Launch {
    fn parse(args: &[String]) -> Result<Self, Exit> {
        let mut l = Self::default();
        let mut i = 0;
        while i < args.len() {
            let arg = args[i].as_str();
            let value = || {
                args.get(i + 1)
                    .cloned()
                    .ok_or_else(|| Exit::new(1, format!("ERROR   | option {arg} needs a value")))
            };
            match arg {
                "-avd" => {
                    l.avd = value()?;
                    i += 1;
                }
                a if a.starts_with('@') => l.avd = a[1..].to_owned(),
                "-port" => {
                    let v = value()?;
                    let port: u16 = v
                        .parse()
                        .ok()
                        .filter(|p| p % 2 == 0 && *p >= 1024)
                        .ok_or_else(|| {
                            Exit::new(1, format!("ERROR   | -port {v}: not an even port"))
                        })?;
                    l.port = Some(port);
                    i += 1;
                }
                "-ports" => {
                    let v = value()?;
                    let console = v.split(',').next().and_then(|p| p.parse().ok());
                    l.port =
                        Some(console.ok_or_else(|| Exit::new(1, format!("ERROR   | -ports {v}")))?);
                    i += 1;
                }
                "-snapshot" => {
                    l.snapshot = Some(value()?);
                    i += 1;
                }
                "-gpu" | "-accel" | "-memory" | "-netdelay" | "-netspeed" | "-camera-back" => {
                    value()?;
                    i += 1;
                }
                "-no-snapshot-load" | "-no-snapshot" => l.no_snapshot_load = true,
                "-wipe-data" => l.wipe = true,
                "-read-only" => l.read_only = true,
                "-no-boot-anim" => l.no_boot_anim = true,
                "-no-snapshot-save" | "-no-window" | "-no-audio" | "-no-metrics" => {}
                other => return Err(Exit::new(1, format!("ERROR   | Unknown option: {other}"))),
            }
            i += 1;
        }
        if l.avd.is_empty() {
            return Err(Exit::new(
                1,
                "ERROR   | No AVD specified. Use '@foo' or '-avd foo' to launch a virtual device named 'foo'",
            ));
        }
        Ok(l)
    }
}

fn copy_dir(from: &Path, to: &Path) {
    let _ = fs::remove_dir_all(to);
    fs::create_dir_all(to).unwrap();
    for entry in fs::read_dir(from).into_iter().flatten().flatten() {
        let target = to.join(entry.file_name());
        if entry.path().is_dir() {
            copy_dir(&entry.path(), &target);
        } else {
            let _ = fs::copy(entry.path(), target);
        }
    }
}

fn clear_dir(dir: &Path) {
    let _ = fs::remove_dir_all(dir);
    fs::create_dir_all(dir).unwrap();
}

fn bind(port: u16) -> Option<TcpListener> {
    TcpListener::bind(("127.0.0.1", port)).ok()
}

fn run(machine: &FakeMachine, launch: &Launch) -> Outcome {
    let home = avd_home(machine);
    let avd_dir = home.join(format!("{}.avd", launch.avd));
    if !home.join(format!("{}.ini", launch.avd)).exists() || !avd_dir.exists() {
        return Err(Exit::new(
            1,
            format!(
                "ERROR   | Unknown AVD name [{}], use -list-avds to see valid list.",
                launch.avd
            ),
        ));
    }
    let busy = machine.with_world(|w, _| {
        w.emulators
            .get(&launch.avd)
            .is_some_and(|e| e.pid != std::process::id() && pid_alive(e.pid))
    });
    if busy && !launch.read_only {
        return Err(Exit::new(
            1,
            "ERROR   | Running multiple emulators with the same AVD is an experimental feature.\nThere's another emulator instance running with the current AVD",
        ));
    }
    let ports: Vec<u16> = match launch.port {
        Some(p) => vec![p],
        None => (5554..=5584).step_by(2).collect(),
    };
    let mut bound = None;
    for p in ports {
        if let (Some(console), Some(adb)) = (bind(p), bind(p + 1)) {
            bound = Some((p, console, adb));
            break;
        }
    }
    let Some((port, console, adb)) = bound else {
        return Err(Exit::new(
            1,
            format!(
                "ERROR   | Could not bind the console port {} or the adb port next to it: address in use",
                launch
                    .port
                    .map_or_else(|| "5554-5584".to_owned(), |p| p.to_string())
            ),
        ));
    };
    let knobs = machine.knobs();
    let userdata = avd_dir.join("userdata");
    let snapshots = avd_dir.join("snapshots");
    let (kind, steps) = if launch.wipe {
        clear_dir(&userdata);
        ("wipe", knobs.emulator_cold_steps)
    } else if let Some(name) = launch
        .snapshot
        .clone()
        .or_else(|| (!launch.no_snapshot_load).then(|| "default_boot".to_owned()))
        .filter(|n| snapshots.join(n).exists())
    {
        copy_dir(&snapshots.join(&name).join("userdata"), &userdata);
        ("snapshot", knobs.emulator_snapshot_steps)
    } else {
        ("cold", knobs.emulator_cold_steps)
    };
    let server_port = std::env::var("ANDROID_ADB_SERVER_PORT")
        .ok()
        .and_then(|p| p.parse().ok())
        .unwrap_or(5037);
    let record = EmulatorRecord {
        pid: std::process::id(),
        avd: launch.avd.clone(),
        avd_dir: avd_dir.clone(),
        console_port: port,
        server_port,
        boot_started_ms: now_ms(),
        boot_steps: steps,
        boot_kind: kind.into(),
        no_boot_anim: launch.no_boot_anim,
        alive: true,
    };
    machine.with_world(|w, _| w.emulators.insert(launch.avd.clone(), record));
    machine.log_cost(
        &launch.avd,
        &format!("{kind}-boot"),
        u64::from(steps) * 1000,
    );
    println!(
        "INFO    | Android emulator version (fake) launching {} on port {port}",
        launch.avd
    );

    let killed = Arc::new(AtomicBool::new(false));
    {
        let machine_root = machine.root().to_path_buf();
        let avd = launch.avd.clone();
        let killed = killed.clone();
        std::thread::spawn(move || console_loop(&machine_root, &avd, &console, &killed));
    }
    std::thread::spawn(move || {
        // The adb port only has to be held (and answer a connect).
        for stream in adb.incoming() {
            drop(stream);
        }
    });
    let started = now_ms();
    let mut announced = false;
    loop {
        let knobs: Knobs = machine.knobs();
        let step = knobs.step_ms.max(1);
        let elapsed_steps = (now_ms() - started) / step;
        if !announced && elapsed_steps >= 1 {
            announced = true;
            // Exactly once, to the server the environment names.
            let _ = adbwire::request(server_port, &format!("host:emulator:{}", port + 1), false);
        }
        if knobs
            .emulator_die_after_steps
            .is_some_and(|n| elapsed_steps >= u64::from(n))
        {
            eprintln!("FATAL   | the emulator died (fault knob)");
            finish(machine, &launch.avd);
            std::process::exit(1);
        }
        if killed.load(Ordering::SeqCst) {
            // `emu kill` answered before the process goes.
            std::thread::sleep(Duration::from_millis(30));
            finish(machine, &launch.avd);
            return Ok(());
        }
        std::thread::sleep(Duration::from_millis(step));
    }
}

/// Removes the process's record and registration.
fn finish(machine: &FakeMachine, avd: &str) {
    let pid = std::process::id();
    machine.with_world(|w, _| {
        if w.emulators.get(avd).is_some_and(|e| e.pid == pid) {
            w.emulators.remove(avd);
        }
        w.procs.remove(&pid);
    });
}

fn console_loop(root: &Path, avd: &str, console: &TcpListener, killed: &AtomicBool) {
    for stream in console.incoming() {
        let Ok(stream) = stream else { continue };
        let root = root.to_path_buf();
        let avd = avd.to_owned();
        let kill = serve_console(&root, &avd, stream);
        if kill {
            killed.store(true, Ordering::SeqCst);
        }
    }
}

/// One console session; answers whether it asked the emulator to die.
fn serve_console(root: &Path, avd: &str, stream: TcpStream) -> bool {
    let Ok(mut out) = stream.try_clone() else {
        return false;
    };
    let _ = out.write_all(b"Android Console: type 'help' for a list of commands\r\nOK\r\n");
    let machine = machine_at(root);
    for line in BufReader::new(stream).lines() {
        let Ok(line) = line else { break };
        let words: Vec<&str> = line.split_whitespace().collect();
        let reply = match words.as_slice() {
            ["quit" | "exit"] => break,
            ["auth", _] => "OK\r\n".to_owned(),
            ["ping"] => "I am alive!\r\nOK\r\n".to_owned(),
            ["kill"] => {
                let _ = out.write_all(b"OK: killing emulator, bye bye\r\nOK\r\n");
                return true;
            }
            ["avd", "name"] => format!("{avd}\r\nOK\r\n"),
            ["avd", "path"] => {
                let dir =
                    machine.with_world(|w, _| w.emulators.get(avd).map(|e| e.avd_dir.clone()));
                format!("{}\r\nOK\r\n", dir.unwrap_or_default().display())
            }
            ["avd", "snapshot", op, rest @ ..] => snapshot(&machine, avd, op, rest),
            _ => "KO: unknown command, try 'help'\r\n".to_owned(),
        };
        if out.write_all(reply.as_bytes()).is_err() {
            break;
        }
    }
    false
}

fn machine_at(root: &Path) -> FakeMachine {
    FakeMachine::at(root)
}

fn snapshot(machine: &FakeMachine, avd: &str, op: &str, rest: &[&str]) -> String {
    let Some(dir) = machine.with_world(|w, _| w.emulators.get(avd).map(|e| e.avd_dir.clone()))
    else {
        return "KO: no AVD\r\n".into();
    };
    let snapshots = dir.join("snapshots");
    match (op, rest) {
        ("save", [name]) => {
            copy_dir(
                &dir.join("userdata"),
                &snapshots.join(name).join("userdata"),
            );
            "OK\r\n".into()
        }
        ("load", [name]) => {
            if !snapshots.join(name).exists() {
                return format!("KO: snapshot '{name}' does not exist\r\n");
            }
            copy_dir(
                &snapshots.join(name).join("userdata"),
                &dir.join("userdata"),
            );
            let steps = machine.knobs().emulator_snapshot_steps;
            machine.with_world(|w, _| {
                if let Some(e) = w.emulators.get_mut(avd) {
                    e.boot_started_ms = now_ms();
                    e.boot_steps = steps;
                    e.boot_kind = "snapshot".into();
                }
            });
            machine.log_cost(avd, "snapshot-load", u64::from(steps) * 1000);
            "OK\r\n".into()
        }
        ("delete", [name]) => {
            let _ = fs::remove_dir_all(snapshots.join(name));
            "OK\r\n".into()
        }
        ("list", []) => {
            let mut out = String::from(
                "List of snapshots present on all disks:\r\nID        TAG                 VM SIZE                DATE       VM CLOCK\r\n",
            );
            for e in fs::read_dir(&snapshots).into_iter().flatten().flatten() {
                out.push_str(&format!(
                    "--        {:<20}    75M 2026-09-09 11:41:45   00:10:07.753\r\n",
                    e.file_name().to_string_lossy()
                ));
            }
            out.push_str("OK\r\n");
            out
        }
        _ => "KO: bad snapshot command\r\n".into(),
    }
}
