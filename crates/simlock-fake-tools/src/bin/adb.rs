//! Fake `adb`: a server (`-P <port> nodaemon server`) that holds the transports emulators
//! announce to it (`host:emulator:<port>` over loopback TCP, 4-hex framing), and the client
//! commands drivers and agents use: `devices [-l]`, `shell`, `emu` (straight to the emulator's
//! console), `wait-for-device`, `get-state`, `kill-server`, `start-server`, `version`.
//!
//! The server port is the last `-P`, else `ANDROID_ADB_SERVER_PORT`, else 5037; a client command
//! with no server there starts an unscoped one, printing the two `* daemon …` lines on stderr,
//! as the real adb does.

#![allow(
    clippy::print_stdout,
    clippy::print_stderr,
    clippy::unwrap_used,
    clippy::disallowed_methods,
    reason = "a fake tool prints what the real one prints and polls as the real one does"
)]

use std::fs;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{ExitCode, Stdio};
use std::time::Duration;

use simlock_fake_tools::adbwire::{self, Answer};
use simlock_fake_tools::machine::{
    AdbServerRecord, EmulatorRecord, MACHINE_ENV, Transport, now_ms, pid_alive,
};
use simlock_fake_tools::tool::{self, Exit, Outcome};
use simlock_fake_tools::{FakeMachine, Knobs};

fn main() -> ExitCode {
    tool::run(
        "adb",
        |args| {
            Globals::parse(args).map_or_else(
                |_| String::new(),
                |(_, rest)| match rest.first().map(String::as_str) {
                    Some("nodaemon" | "fork-server" | "server") => "server".into(),
                    Some(other) => other.to_owned(),
                    None => String::new(),
                },
            )
        },
        adb,
    )
}

#[derive(Debug, Default)]
struct Globals {
    serial: Option<String>,
    port: Option<u16>,
}

impl Globals {
    fn parse(args: &[String]) -> Result<(Self, Vec<String>), Exit> {
        let mut g = Self::default();
        let mut i = 0;
        while i < args.len() {
            let a = args[i].as_str();
            let value = || {
                args.get(i + 1)
                    .cloned()
                    .ok_or_else(|| Exit::new(1, format!("adb: option {a} requires an argument")))
            };
            match a {
                "-s" => {
                    g.serial = Some(value()?);
                    i += 2;
                }
                "-P" => {
                    let v = value()?;
                    g.port = Some(
                        v.parse()
                            .map_err(|_| Exit::new(1, format!("adb: invalid port '{v}'")))?,
                    );
                    i += 2;
                }
                "-H" | "-L" | "-t" => i += 2,
                "-d" | "-e" | "-a" => i += 1,
                t if t.starts_with("-t") => i += 1,
                _ => break,
            }
        }
        Ok((g, args[i..].to_vec()))
    }

    fn server_port(&self) -> u16 {
        self.port
            .or_else(|| {
                std::env::var("ANDROID_ADB_SERVER_PORT")
                    .ok()
                    .and_then(|p| p.parse().ok())
            })
            .unwrap_or(5037)
    }
}

fn adb(machine: &FakeMachine, args: &[String]) -> Outcome {
    let (globals, rest) = Globals::parse(args)?;
    let port = globals.server_port();
    let words: Vec<&str> = rest.iter().map(String::as_str).collect();
    match words.as_slice() {
        ["version"] => {
            println!(
                "Android Debug Bridge version 1.0.41\nVersion 35.0.2-fake\nInstalled as {}",
                std::env::args().next().unwrap_or_default()
            );
            Ok(())
        }
        ["nodaemon", "server"]
        | ["server", "nodaemon"]
        | ["fork-server", "server"]
        | ["-a", "nodaemon", "server"] => serve(machine, port),
        ["start-server"] => ensure_server(machine, port).map(|_| ()),
        ["kill-server"] => match adbwire::request(port, "host:kill", false) {
            Ok(Answer::Okay(_)) => Ok(()),
            Ok(Answer::Fail(msg)) => Err(Exit::new(1, format!("error: {msg}"))),
            Err(_) => Err(Exit::new(
                1,
                format!("cannot connect to daemon at tcp:{port}: Connection refused"),
            )),
        },
        ["devices"] | ["devices", "-l"] => {
            ensure_server(machine, port)?;
            let long = words.len() == 2;
            let service = if long {
                "host:devices-l"
            } else {
                "host:devices"
            };
            match adbwire::request(port, service, true) {
                Ok(Answer::Okay(Some(list))) => {
                    print!("List of devices attached\n{list}\n");
                    Ok(())
                }
                Ok(Answer::Fail(msg)) => Err(Exit::new(1, format!("adb: {msg}"))),
                _ => Err(Exit::new(1, "adb: failed to read the device list")),
            }
        }
        ["get-state"] => {
            let (t, _) = transport(machine, port, &globals)?;
            println!("{}", t.1);
            Ok(())
        }
        ["get-serialno"] => {
            let (t, _) = transport(machine, port, &globals)?;
            println!("{}", t.0);
            Ok(())
        }
        [w] if w.starts_with("wait-for-") => loop {
            ensure_server(machine, port)?;
            if let Ok((t, _)) = transport(machine, port, &globals)
                && t.1 == "device"
            {
                return Ok(());
            }
            std::thread::sleep(Duration::from_millis(20));
        },
        ["emu", cmd @ ..] if !cmd.is_empty() => emu(machine, port, &globals, cmd),
        ["shell", cmd @ ..] => {
            let (t, emulator) = transport(machine, port, &globals)?;
            if t.1 != "device" {
                return Err(Exit::new(1, "adb: device offline"));
            }
            let Some(emulator) = emulator else {
                return Err(Exit::new(1, format!("adb: device '{}' not found", t.0)));
            };
            let code = shell(machine, &emulator, &t.0, &cmd.join(" "));
            if code == 0 {
                Ok(())
            } else {
                Err(Exit::new(code, ""))
            }
        }
        ["forward" | "reverse", ..] => {
            transport(machine, port, &globals)?;
            Ok(())
        }
        [other, ..] => Err(Exit::new(1, format!("adb: unknown command {other}"))),
        [] => Err(Exit::new(1, "adb: no command given")),
    }
}

// === Server ===

fn serve(machine: &FakeMachine, port: u16) -> Outcome {
    let listener = TcpListener::bind(("127.0.0.1", port)).map_err(|e| {
        Exit::new(
            1,
            format!("error: could not install *smartsocket* listener: cannot bind to 127.0.0.1:{port}: {e}"),
        )
    })?;
    let env = |k: &str| std::env::var(k).ok();
    let record = AdbServerRecord {
        pid: std::process::id(),
        port,
        scanner: env("ADB_EMU").as_deref() != Some("0"),
        reject_kill: env("ADB_REJECT_KILL_SERVER").as_deref() == Some("1"),
        scan_max_port: env("ADB_LOCAL_TRANSPORT_MAX_PORT")
            .and_then(|p| p.parse().ok())
            .unwrap_or(5585),
        transports: Vec::new(),
        alive: true,
    };
    machine.with_world(|w, _| w.adb_servers.insert(port, record));
    for stream in listener.incoming() {
        let Ok(mut stream) = stream else { continue };
        let Ok(service) = adbwire::read_message(&mut stream) else {
            continue;
        };
        if service != "host:kill" {
            // Each request in its own thread, as the real server serves clients concurrently.
            let root = machine.root().to_path_buf();
            std::thread::spawn(move || {
                let reply = answer(&FakeMachine::at(&root), port, &service);
                let _ = stream.write_all(reply.as_bytes());
            });
            continue;
        }
        {
            let reject =
                machine.with_world(|w, _| w.adb_servers.get(&port).is_some_and(|s| s.reject_kill));
            if reject {
                let _ = stream.write_all(b"FAIL");
                let _ =
                    adbwire::write_message(&mut stream, "kill-server rejected by remote server");
                continue;
            }
            let _ = stream.write_all(b"OKAY");
            drop(stream);
            remove_server(machine, port);
            return Ok(());
        }
    }
    Ok(())
}

fn remove_server(machine: &FakeMachine, port: u16) {
    let pid = std::process::id();
    machine.with_world(|w, _| {
        if w.adb_servers.get(&port).is_some_and(|s| s.pid == pid) {
            w.adb_servers.remove(&port);
        }
    });
}

fn framed(status: &str, payload: &str) -> String {
    format!("{status}{:04x}{payload}", payload.len())
}

fn answer(machine: &FakeMachine, port: u16, service: &str) -> String {
    if let Some(p) = service.strip_prefix("host:emulator:") {
        let Ok(adb_port) = p.parse::<u16>() else {
            return framed("FAIL", "bad port");
        };
        machine.with_world(|w, _| {
            w.next_transport_id += 1;
            let id = w.next_transport_id;
            if let Some(s) = w.adb_servers.get_mut(&port)
                && !s.transports.iter().any(|t| t.adb_port == adb_port)
            {
                s.transports.push(Transport {
                    serial: format!("emulator-{}", adb_port - 1),
                    adb_port,
                    transport_id: id,
                });
            }
        });
        return "OKAY".into();
    }
    match service {
        "host:version" => framed("OKAY", "0029"),
        "host:devices" | "host:devices-l" => {
            let long = service.ends_with("-l");
            let mut text = String::new();
            for (serial, state, id) in device_list(machine, port) {
                if long {
                    text.push_str(&format!(
                        "{serial:<22} {state} product:sdk_gphone64_x86_64 model:sdk_gphone64_x86_64 device:emu64x transport_id:{id}\n"
                    ));
                } else {
                    text.push_str(&format!("{serial}\t{state}\n"));
                }
            }
            framed("OKAY", &text)
        }
        other => framed("FAIL", &format!("unknown host service {other}")),
    }
}

/// The server's transports with their states, pruning those whose emulator died.
fn device_list(machine: &FakeMachine, port: u16) -> Vec<(String, &'static str, u32)> {
    let now = now_ms();
    machine.with_world(|w, knobs| {
        let emulators: Vec<EmulatorRecord> = w
            .emulators
            .values()
            .filter(|e| pid_alive(e.pid))
            .cloned()
            .collect();
        let Some(server) = w.adb_servers.get_mut(&port) else {
            return Vec::new();
        };
        server
            .transports
            .retain(|t| emulators.iter().any(|e| e.console_port + 1 == t.adb_port));
        if server.scanner {
            for e in &emulators {
                if e.console_port >= 5554
                    && e.console_port < server.scan_max_port
                    && !server
                        .transports
                        .iter()
                        .any(|t| t.adb_port == e.console_port + 1)
                {
                    w.next_transport_id += 1;
                    server.transports.push(Transport {
                        serial: format!("emulator-{}", e.console_port),
                        adb_port: e.console_port + 1,
                        transport_id: w.next_transport_id,
                    });
                }
            }
        }
        server
            .transports
            .iter()
            .map(|t| {
                let up = emulators
                    .iter()
                    .find(|e| e.console_port + 1 == t.adb_port)
                    .is_some_and(|e| e.adbd_up(now, knobs));
                (
                    t.serial.clone(),
                    if up { "device" } else { "offline" },
                    t.transport_id,
                )
            })
            .collect()
    })
}

// === Client ===

fn listening(port: u16) -> bool {
    TcpStream::connect_timeout(&([127, 0, 0, 1], port).into(), Duration::from_millis(500)).is_ok()
}

/// Makes sure a server listens on `port`, starting one as the real adb does when none does.
fn ensure_server(machine: &FakeMachine, port: u16) -> Result<(), Exit> {
    if listening(port) {
        return Ok(());
    }
    eprintln!("* daemon not running; starting now at tcp:{port}");
    let exe = std::env::current_exe().map_err(|e| Exit::new(1, e.to_string()))?;
    let mut command = std::process::Command::new(exe);
    command
        .args(["-P", &port.to_string(), "fork-server", "server"])
        .env(MACHINE_ENV, machine.root())
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null());
    std::os::unix::process::CommandExt::process_group(&mut command, 0);
    if command.spawn().is_err() {
        return Err(Exit::new(1, "* failed to start daemon"));
    }
    for _ in 0..250 {
        if listening(port) {
            eprintln!("* daemon started successfully");
            return Ok(());
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    Err(Exit::new(1, "* failed to start daemon"))
}

type Found = ((String, &'static str), Option<EmulatorRecord>);

/// The transport the command addresses: `-s`, else `ANDROID_SERIAL`, else the only one.
fn transport(machine: &FakeMachine, port: u16, globals: &Globals) -> Result<Found, Exit> {
    ensure_server(machine, port)?;
    let list = device_list(machine, port);
    let wanted = globals
        .serial
        .clone()
        .or_else(|| std::env::var("ANDROID_SERIAL").ok());
    let found = match wanted {
        Some(serial) => list
            .into_iter()
            .find(|(s, _, _)| *s == serial)
            .ok_or_else(|| Exit::new(1, format!("adb: device '{serial}' not found")))?,
        None => match list.len() {
            0 => return Err(Exit::new(1, "adb: no devices/emulators found")),
            1 => list.into_iter().next().unwrap(),
            _ => return Err(Exit::new(1, "adb: more than one device/emulator")),
        },
    };
    let console: u16 = found.0.trim_start_matches("emulator-").parse().unwrap_or(0);
    let emulator = machine.with_world(|w, _| {
        w.emulators
            .values()
            .find(|e| e.console_port == console && pid_alive(e.pid))
            .cloned()
    });
    Ok(((found.0, found.1), emulator))
}

/// `adb emu`: straight to the emulator's console (with `-s emulator-N`, no server is asked).
fn emu(machine: &FakeMachine, port: u16, globals: &Globals, cmd: &[&str]) -> Outcome {
    let console = match &globals.serial {
        Some(serial) => serial
            .strip_prefix("emulator-")
            .and_then(|p| p.parse::<u16>().ok())
            .ok_or_else(|| Exit::new(1, "error: no emulator detected"))?,
        None => {
            ensure_server(machine, port)?;
            let list = device_list(machine, port);
            match list.as_slice() {
                [] => return Err(Exit::new(1, "error: no emulator detected")),
                [one] => one.0.trim_start_matches("emulator-").parse().unwrap_or(0),
                _ => {
                    return Err(Exit::new(
                        1,
                        "error: more than one emulator detected; use -s",
                    ));
                }
            }
        }
    };
    let stream = TcpStream::connect(("127.0.0.1", console)).map_err(|e| {
        Exit::new(
            1,
            format!("error: could not connect to TCP port {console}: {e}"),
        )
    })?;
    stream
        .set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    let mut out = stream.try_clone().unwrap();
    let mut lines = BufReader::new(stream).lines();
    // The greeting ends with its OK.
    for line in lines.by_ref() {
        if line
            .map_err(|e| Exit::new(1, e.to_string()))?
            .starts_with("OK")
        {
            break;
        }
    }
    out.write_all(format!("{}\r\n", cmd.join(" ")).as_bytes())
        .map_err(|e| Exit::new(1, e.to_string()))?;
    let mut reply = String::new();
    for line in lines {
        let Ok(line) = line else { break };
        reply.push_str(&line);
        reply.push('\n');
        if line.starts_with("OK") || line.starts_with("KO") {
            break;
        }
    }
    let _ = out.write_all(b"quit\r\n");
    print!("{}", reply.replace('\r', "").replace('\n', "\r\n"));
    // Whatever the console answered: adb emu's status means nothing.
    Ok(())
}

// === The device's shell ===

fn api_of(emulator: &EmulatorRecord) -> String {
    fs::read_to_string(emulator.avd_dir.join("config.ini"))
        .unwrap_or_default()
        .lines()
        .find_map(|l| l.strip_prefix("image.sysdir.1=system-images/android-"))
        .and_then(|rest| rest.split('/').next())
        .unwrap_or("35")
        .to_owned()
}

fn getprop(emulator: &EmulatorRecord, knobs: &Knobs, serial: &str, name: &str) -> String {
    let booted = emulator.booted(now_ms(), knobs);
    match name {
        "sys.boot_completed" | "dev.bootcomplete" => if booted { "1" } else { "" }.into(),
        "init.svc.bootanim" if emulator.no_boot_anim => String::new(),
        "init.svc.bootanim" => if booted { "stopped" } else { "running" }.into(),
        "ro.boot.qemu.avd_name" | "ro.kernel.qemu.avd_name" => emulator.avd.clone(),
        "ro.product.model" => "sdk_gphone64_x86_64".into(),
        "ro.build.version.sdk" => api_of(emulator),
        "ro.serialno" => serial.into(),
        "ro.kernel.qemu" | "ro.boot.qemu" => "1".into(),
        _ => String::new(),
    }
}

fn device_path(emulator: &EmulatorRecord, path: &str) -> PathBuf {
    emulator
        .avd_dir
        .join("userdata")
        .join(path.trim_start_matches('/'))
}

/// A few shell commands over the emulator's userdata and properties; answers the status.
fn shell(machine: &FakeMachine, emulator: &EmulatorRecord, serial: &str, line: &str) -> u8 {
    let knobs = machine.knobs();
    let mut status = 0;
    for command in line.split(';').map(str::trim).filter(|c| !c.is_empty()) {
        let (command, redirect) = match command.split_once('>') {
            Some((c, target)) => (
                c.trim(),
                Some(target.trim().trim_matches('\'').trim_matches('"')),
            ),
            None => (command, None),
        };
        let words: Vec<&str> = command.split_whitespace().collect();
        let (out, code): (String, u8) = match words.as_slice() {
            ["getprop", name] => (format!("{}\n", getprop(emulator, &knobs, serial, name)), 0),
            ["getprop"] => (
                format!(
                    "[sys.boot_completed]: [{}]\n[ro.boot.qemu.avd_name]: [{}]\n",
                    getprop(emulator, &knobs, serial, "sys.boot_completed"),
                    emulator.avd
                ),
                0,
            ),
            ["echo", rest @ ..] => (
                format!("{}\n", rest.join(" ").trim_matches('\'').trim_matches('"')),
                0,
            ),
            ["true"] => (String::new(), 0),
            ["exit", n] => (String::new(), n.parse().unwrap_or(1)),
            ["touch", p] => {
                let path = device_path(emulator, p);
                let _ = fs::create_dir_all(path.parent().unwrap_or(Path::new("/")));
                (String::new(), u8::from(fs::write(path, "").is_err()))
            }
            ["cat", p] => match fs::read_to_string(device_path(emulator, p)) {
                Ok(text) => (text, 0),
                Err(_) => (format!("cat: {p}: No such file or directory\n"), 1),
            },
            ["ls", p] => {
                let path = device_path(emulator, p);
                if path.exists() {
                    (format!("{p}\n"), 0)
                } else {
                    (format!("ls: {p}: No such file or directory\n"), 1)
                }
            }
            ["rm", "-f", p] | ["rm", p] => {
                let _ = fs::remove_file(device_path(emulator, p));
                (String::new(), 0)
            }
            ["pm", "list", "packages", ..] => (
                "package:com.android.settings\npackage:com.android.shell\n".into(),
                0,
            ),
            ["wm", "size"] => ("Physical size: 1080x2400\n".into(), 0),
            ["am", "start", rest @ ..] => (
                format!(
                    "Starting: Intent {{ {} }}\nStatus: ok\nLaunchState: COLD\nActivity: com.android.settings/.Settings\nTotalTime: 312\nWaitTime: 320\nComplete\n",
                    rest.join(" ")
                ),
                0,
            ),
            ["am", "force-stop", _] => (String::new(), 0),
            [other, ..] => (
                format!("/system/bin/sh: {other}: inaccessible or not found\n"),
                127,
            ),
            [] => (String::new(), 0),
        };
        match redirect {
            Some(target) => {
                let path = device_path(emulator, target);
                let _ = fs::create_dir_all(path.parent().unwrap_or(Path::new("/")));
                let _ = fs::write(path, out);
            }
            None => {
                if code == 0 {
                    print!("{out}");
                } else {
                    eprint!("{out}");
                }
            }
        }
        status = code;
    }
    let _ = std::io::stdout().flush();
    let _ = std::io::stdin().read(&mut [0u8; 0]);
    status
}
