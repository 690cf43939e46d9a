//! Fake `xcrun`: `xcrun simctl [--set <path>] [--profiles <path>] <subcommand> …` over the
//! machine's simulators, one device set per path (no `--set`: the user's own set).

#![allow(
    clippy::print_stdout,
    clippy::print_stderr,
    clippy::unwrap_used,
    clippy::disallowed_methods,
    reason = "a fake tool prints what the real one prints and takes the time a boot step takes"
)]

use std::collections::BTreeMap;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Duration;

use serde_json::{Value, json};
use simlock_fake_tools::machine::{self, Profile, SimDevice, SimState, now_ms, set_key};
use simlock_fake_tools::simjson;
use simlock_fake_tools::tool::{self, Exit, Outcome};
use simlock_fake_tools::{FakeMachine, Knobs};

const CODE_PREFIX: &str = "An error was encountered processing the command (domain=com.apple.CoreSimulator.SimError, code=405):";

fn main() -> ExitCode {
    tool::run("xcrun", command_of, xcrun)
}

/// The simctl subcommand (after the globals), for fault matching.
fn command_of(args: &[String]) -> String {
    let mut i = 1;
    while i < args.len() && args[i].starts_with("--") {
        i += 2;
    }
    args.get(i).cloned().unwrap_or_default()
}

fn xcrun(machine: &FakeMachine, args: &[String]) -> Outcome {
    match args.first().map(String::as_str) {
        Some("simctl") => simctl(machine, &args[1..]),
        Some("--version") => {
            println!("xcrun version 70.");
            Ok(())
        }
        Some(other) => Err(Exit::new(
            72,
            format!(
                "xcrun: error: unable to find utility \"{other}\", not a developer tool or in PATH"
            ),
        )),
        None => Err(Exit::new(
            64,
            "Usage: xcrun [options] <tool name> ... arguments ...",
        )),
    }
}

struct Ctx<'a> {
    machine: &'a FakeMachine,
    profile: Profile,
    set: PathBuf,
}

fn simctl(machine: &FakeMachine, args: &[String]) -> Outcome {
    let mut set = machine.default_set();
    let mut i = 0;
    while let Some(arg) = args.get(i).filter(|a| a.starts_with('-')) {
        match arg.as_str() {
            "--set" | "--profiles" => {
                let Some(value) = args.get(i + 1) else {
                    return Err(Exit::new(64, format!("simctl: {arg} needs a path")));
                };
                if arg == "--set" {
                    set = PathBuf::from(value);
                }
                i += 2;
            }
            other => {
                return Err(Exit::new(
                    64,
                    format!("simctl: unrecognized option {other} before the subcommand"),
                ));
            }
        }
    }
    let ctx = Ctx {
        machine,
        profile: machine.profile(),
        set,
    };
    let Some(sub) = args.get(i) else {
        return Err(Exit::new(
            64,
            "usage: simctl [--set <path>] [--profiles <path>] <subcommand> ...",
        ));
    };
    let rest = &args[i + 1..];
    match sub.as_str() {
        "list" => list(&ctx, rest),
        "create" => create(&ctx, rest),
        "boot" => boot(&ctx, rest),
        "bootstatus" => bootstatus(&ctx, rest),
        "shutdown" => shutdown(&ctx, rest),
        "erase" => erase(&ctx, rest),
        "delete" => delete(&ctx, rest),
        "help" => {
            println!("usage: simctl [--set <path>] [--profiles <path>] <subcommand> ...");
            Ok(())
        }
        other => Err(Exit::new(
            64,
            format!(
                "Unrecognized subcommand: {other}\nusage: simctl [--set <path>] [--profiles <path>] <subcommand> ..."
            ),
        )),
    }
}

fn key(ctx: &Ctx<'_>) -> String {
    set_key(Some(&ctx.set))
}

fn state_error(action: &str, state: SimState) -> Exit {
    Exit::new(
        149,
        format!(
            "{CODE_PREFIX}\nUnable to {action} in current state: {}",
            state.as_str()
        ),
    )
}

fn invalid_device(id: &str, boot: bool) -> Exit {
    if boot {
        Exit::new(148, format!("Invalid device or device pair: {id}"))
    } else {
        Exit::new(148, format!("Invalid device: {id}"))
    }
}

fn one_arg<'a>(rest: &'a [String], usage: &str) -> Result<&'a str, Exit> {
    match rest {
        [one] => Ok(one),
        _ => Err(Exit::new(64, format!("usage: simctl {usage}"))),
    }
}

fn version_string(packed: u64) -> String {
    format!(
        "{}.{}.{}",
        packed >> 16,
        (packed >> 8) & 0xff,
        packed & 0xff
    )
}

fn device_types_json(ctx: &Ctx<'_>) -> Value {
    let x = &ctx.profile.xcode;
    Value::Array(
        x.device_types
            .iter()
            .map(|t| {
                json!({
                    "productFamily": t.product_family,
                    "bundlePath": format!("/Library/Developer/CoreSimulator/Profiles/DeviceTypes/{}.simdevicetype", t.name),
                    "maxRuntimeVersion": x.unbounded_max,
                    "maxRuntimeVersionString": version_string(x.unbounded_max.min(0xff_ffff)),
                    "identifier": t.identifier,
                    "modelIdentifier": "iPhone17,3",
                    "minRuntimeVersionString": version_string(t.min_runtime_version),
                    "minRuntimeVersion": t.min_runtime_version,
                    "name": t.name,
                })
            })
            .collect(),
    )
}

fn runtimes_json(ctx: &Ctx<'_>) -> Value {
    let x = &ctx.profile.xcode;
    Value::Array(
        x.runtimes
            .iter()
            .map(|r| {
                let supported: Vec<Value> = x
                    .device_types
                    .iter()
                    .filter(|t| r.supported.contains(&t.identifier))
                    .map(|t| {
                        json!({
                            "bundlePath": format!("/Library/Developer/CoreSimulator/Profiles/DeviceTypes/{}.simdevicetype", t.name),
                            "name": t.name,
                            "identifier": t.identifier,
                            "productFamily": t.product_family,
                        })
                    })
                    .collect();
                json!({
                    "isAvailable": r.available,
                    "version": r.version,
                    "isInternal": false,
                    "buildversion": r.buildversion,
                    "supportedArchitectures": ["arm64"],
                    "supportedDeviceTypes": supported,
                    "identifier": r.identifier,
                    "platform": "iOS",
                    "bundlePath": format!("/Library/Developer/CoreSimulator/Volumes/iOS_{}/{}.simruntime", r.buildversion, r.name),
                    "runtimeRoot": "/Library/Developer/CoreSimulator/RuntimeRoot",
                    "lastUsage": {"arm64": "2025-11-11T18:49:51Z"},
                    "name": r.name,
                })
            })
            .collect(),
    )
}

fn iso(ms: u64) -> String {
    let secs = ms / 1000;
    let (days, rem) = (secs / 86_400, secs % 86_400);
    let (y, m, d) = civil(i64::try_from(days).unwrap_or(0));
    format!(
        "{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}Z",
        rem / 3600,
        (rem / 60) % 60,
        rem % 60
    )
}

/// Days since 1970-01-01 to a civil date.
fn civil(z: i64) -> (i64, i64, i64) {
    let z = z + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    (yoe + era * 400 + i64::from(m <= 2), m, d)
}

fn device_json(ctx: &Ctx<'_>, d: &SimDevice) -> Value {
    let dir = ctx.set.join(&d.udid);
    let mut v = json!({
        "dataPath": dir.join("data").display().to_string(),
        "dataPathSize": 1_880_317_952_u64,
        "logPath": ctx.machine.home().join("Library/Logs/CoreSimulator").join(&d.udid).display().to_string(),
        "udid": d.udid,
        "isAvailable": true,
        "deviceTypeIdentifier": d.device_type,
        "state": d.state.as_str(),
        "name": d.name,
    });
    if let Some(t) = d.last_booted_ms {
        v["lastBootedAt"] = Value::String(iso(t));
    }
    v
}

fn list(ctx: &Ctx<'_>, rest: &[String]) -> Outcome {
    let mut json_out = false;
    let mut sections = Vec::new();
    let mut search = None;
    for arg in rest {
        match arg.as_str() {
            "-j" | "--json" => json_out = true,
            "devices" | "devicetypes" | "runtimes" | "pairs" => sections.push(arg.clone()),
            s if !s.starts_with('-') && search.is_none() && !sections.is_empty() => {
                search = Some(s.to_owned());
            }
            other => {
                return Err(Exit::new(
                    64,
                    format!("simctl list: unrecognized argument {other}"),
                ));
            }
        }
    }
    if sections.is_empty() {
        sections = vec![
            "devicetypes".into(),
            "runtimes".into(),
            "devices".into(),
            "pairs".into(),
        ];
    }
    if !json_out {
        // The text form, for devices only: what people read.
        let devices = ctx.machine.simulators(&ctx.set);
        println!("== Devices ==");
        for r in &ctx.profile.xcode.runtimes {
            println!("-- {} --", r.name);
            for d in devices.iter().filter(|d| d.runtime == r.identifier) {
                println!("    {} ({}) ({})", d.name, d.udid, d.state.as_str());
            }
        }
        return Ok(());
    }
    let mut out = serde_json::Map::new();
    for section in &sections {
        match section.as_str() {
            "devicetypes" => {
                out.insert("devicetypes".into(), device_types_json(ctx));
            }
            "runtimes" => {
                out.insert("runtimes".into(), runtimes_json(ctx));
            }
            "pairs" => {
                out.insert("pairs".into(), json!({}));
            }
            _ => {
                let devices = ctx.machine.simulators(&ctx.set);
                let mut by_runtime: BTreeMap<String, Vec<Value>> = ctx
                    .profile
                    .xcode
                    .runtimes
                    .iter()
                    .map(|r| (r.identifier.clone(), Vec::new()))
                    .collect();
                for d in &devices {
                    if search
                        .as_ref()
                        .is_some_and(|s| s != &d.udid && s != &d.name)
                    {
                        continue;
                    }
                    by_runtime
                        .entry(d.runtime.clone())
                        .or_default()
                        .push(device_json(ctx, d));
                }
                out.insert("devices".into(), json!(by_runtime));
            }
        }
    }
    println!(
        "{}",
        simjson::to_string(&Value::Object(out), ctx.profile.xcode.escape_slashes)
    );
    Ok(())
}

fn create(ctx: &Ctx<'_>, rest: &[String]) -> Outcome {
    let (name, ty, runtime) = match rest {
        [n, t] => (n, t, None),
        [n, t, r] => (n, t, Some(r)),
        _ => {
            return Err(Exit::new(
                64,
                "usage: simctl create <name> <device type id> [<runtime id>]",
            ));
        }
    };
    let x = &ctx.profile.xcode;
    let Some(ty) = x
        .device_types
        .iter()
        .find(|t| &t.identifier == ty || &t.name == ty)
    else {
        return Err(Exit::new(1, format!("Invalid device type: {ty}")));
    };
    let pairs = |r: &&machine::Runtime| {
        r.available
            && r.supported.contains(&ty.identifier)
            && machine::pack_version(&r.version) >= ty.min_runtime_version
    };
    let runtime = match runtime {
        Some(id) => {
            let Some(r) = x
                .runtimes
                .iter()
                .find(|r| &r.identifier == id || &r.name == id)
            else {
                return Err(Exit::new(1, format!("Invalid runtime: {id}")));
            };
            if !pairs(&r) {
                return Err(Exit::new(
                    1,
                    format!(
                        "An error was encountered processing the command (domain=com.apple.CoreSimulator.SimError, code=403):\nUnable to create a device for device type: {} ({}), runtime: {} ({} - {}) - {}",
                        ty.name, ty.identifier, r.name, r.version, r.buildversion, r.identifier
                    ),
                ));
            }
            r
        }
        None => match x
            .runtimes
            .iter()
            .filter(pairs)
            .max_by_key(|r| machine::pack_version(&r.version))
        {
            Some(r) => r,
            None => return Err(Exit::new(1, format!("No runtime for {}", ty.name))),
        },
    };
    let udid = uuid::Uuid::new_v4().hyphenated().to_string().to_uppercase();
    let dir = ctx.set.join(&udid);
    fs::create_dir_all(dir.join("data")).map_err(|e| Exit::new(1, e.to_string()))?;
    fs::write(
        dir.join("device.plist"),
        format!("<plist><dict><key>UDID</key><string>{udid}</string></dict></plist>\n"),
    )
    .map_err(|e| Exit::new(1, e.to_string()))?;
    let device = SimDevice {
        udid: udid.clone(),
        name: name.clone(),
        device_type: ty.identifier.clone(),
        runtime: runtime.identifier.clone(),
        state: SimState::Shutdown,
        boot_started_ms: None,
        last_booted_ms: None,
    };
    let key = key(ctx);
    ctx.machine.with_world(|w, _| {
        w.sets
            .entry(key)
            .or_default()
            .devices
            .insert(udid.clone(), device)
    });
    ctx.machine.log_cost(&udid, "create", 500);
    println!("{udid}");
    Ok(())
}

/// Runs `f` on the device `udid` of the addressed set; `Invalid device` when the set lacks it.
fn with_device<T>(
    ctx: &Ctx<'_>,
    udid: &str,
    boot: bool,
    f: impl FnOnce(&mut SimDevice, &Knobs) -> Result<T, Exit>,
) -> Result<T, Exit> {
    let key = key(ctx);
    ctx.machine.with_world(|w, knobs| {
        match w.sets.get_mut(&key).and_then(|s| s.devices.get_mut(udid)) {
            Some(d) => f(d, knobs),
            None => Err(invalid_device(udid, boot)),
        }
    })
}

fn start_boot(d: &mut SimDevice, knobs: &Knobs) {
    d.state = SimState::Booting;
    d.boot_started_ms = Some(now_ms());
    let _ = knobs;
}

fn boot(ctx: &Ctx<'_>, rest: &[String]) -> Outcome {
    let udid = match rest {
        [u] => u.as_str(),
        [u, arch] if arch.starts_with("--arch=") => u.as_str(),
        _ => return Err(Exit::new(64, "usage: simctl boot <device> [--arch=<arch>]")),
    };
    let steps = with_device(ctx, udid, true, |d, knobs| match d.state {
        SimState::Shutdown => {
            start_boot(d, knobs);
            Ok(knobs.ios_boot_steps)
        }
        other => Err(state_error("boot device", other)),
    })?;
    ctx.machine.log_cost(udid, "boot", u64::from(steps) * 1000);
    Ok(())
}

fn bootstatus(ctx: &Ctx<'_>, rest: &[String]) -> Outcome {
    let Some(udid) = rest.first() else {
        return Err(Exit::new(64, "usage: simctl bootstatus <device> [-bcd]"));
    };
    let mut boot_first = false;
    for flag in &rest[1..] {
        match flag.as_str() {
            "-b" => boot_first = true,
            "-c" | "-d" => {}
            other => {
                return Err(Exit::new(
                    64,
                    format!("simctl bootstatus: unrecognized option {other}"),
                ));
            }
        }
    }
    let name = with_device(ctx, udid, false, |d, _| Ok(d.name.clone()))?;
    println!("Monitoring boot status for {name} ({udid}).");
    let start = now_ms();
    let mut saw_booting = false;
    let mut printed = 0u64;
    loop {
        let (state, knobs) = with_device(ctx, udid, false, |d, knobs| {
            if boot_first && d.state == SimState::Shutdown && !saw_booting {
                start_boot(d, knobs);
            }
            Ok((d.state, knobs.clone()))
        })?;
        match state {
            SimState::Booted if !saw_booting && printed == 0 => {
                println!("Device already booted, nothing to do.");
                return Ok(());
            }
            SimState::Booted => {
                println!(
                    "[{}] Status=4294967295, isTerminal=YES, Elapsed={}.\n\tFinished\n",
                    stamp(),
                    elapsed(start)
                );
                return Ok(());
            }
            SimState::Booting => {
                if !saw_booting && boot_first {
                    ctx.machine
                        .log_cost(udid, "boot", u64::from(knobs.ios_boot_steps) * 1000);
                }
                saw_booting = true;
            }
            SimState::Shutdown if saw_booting => {
                return Err(Exit::new(
                    1,
                    format!(
                        "{CODE_PREFIX}\nDevice boot failed: the device shut down while booting"
                    ),
                ));
            }
            _ => {}
        }
        let step = knobs.step_ms.max(1);
        if (now_ms() - start) / (step * 10) >= printed {
            printed += 1;
            println!(
                "[{}] Status=4, isTerminal=NO, Elapsed={}.\n\tWaiting on System App\n",
                stamp(),
                elapsed(start)
            );
        }
        std::thread::sleep(Duration::from_millis(step));
    }
}

fn stamp() -> String {
    iso(now_ms()).replace('T', " ").replace('Z', " +0000")
}

fn elapsed(start: u64) -> String {
    let s = (now_ms() - start) / 1000;
    format!("{:02}:{:02}", s / 60, s % 60)
}

fn shutdown(ctx: &Ctx<'_>, rest: &[String]) -> Outcome {
    let udid = one_arg(rest, "shutdown <device> | all")?;
    if udid == "all" {
        let key = key(ctx);
        ctx.machine.with_world(|w, _| {
            for d in w.sets.entry(key).or_default().devices.values_mut() {
                d.state = SimState::Shutdown;
            }
        });
        return Ok(());
    }
    with_device(ctx, udid, false, |d, _| match d.state {
        SimState::Booted | SimState::Booting => {
            d.state = SimState::Shutdown;
            d.boot_started_ms = None;
            Ok(())
        }
        other => Err(state_error("shutdown device", other)),
    })
}

fn erase(ctx: &Ctx<'_>, rest: &[String]) -> Outcome {
    let udid = one_arg(rest, "erase <device> | all")?;
    with_device(ctx, udid, false, |d, _| match d.state {
        SimState::Shutdown => Ok(()),
        other => Err(state_error("erase contents and settings", other)),
    })?;
    let data = ctx.set.join(udid).join("data");
    let _ = fs::remove_dir_all(&data);
    fs::create_dir_all(&data).map_err(|e| Exit::new(1, e.to_string()))?;
    ctx.machine.log_cost(udid, "erase", 200);
    Ok(())
}

fn delete(ctx: &Ctx<'_>, rest: &[String]) -> Outcome {
    let udid = one_arg(rest, "delete <device> | unavailable | all")?;
    let key = key(ctx);
    let ids: Vec<String> = if udid == "all" {
        ctx.machine
            .simulators(&ctx.set)
            .into_iter()
            .map(|d| d.udid)
            .collect()
    } else if udid == "unavailable" {
        Vec::new()
    } else {
        with_device(ctx, udid, false, |_, _| Ok(()))?;
        vec![udid.to_owned()]
    };
    for id in ids {
        ctx.machine.with_world(|w, _| {
            if let Some(s) = w.sets.get_mut(&key) {
                s.devices.remove(&id);
            }
        });
        remove_dir(&ctx.set.join(&id));
    }
    Ok(())
}

fn remove_dir(dir: &Path) {
    let _ = fs::remove_dir_all(dir);
}
