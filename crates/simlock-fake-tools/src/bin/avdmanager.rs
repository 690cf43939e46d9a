//! Fake `avdmanager`: `create avd`, `list device`, `list avd`, `delete avd`, in the AVD home
//! `ANDROID_AVD_HOME` names (required: the fake refuses to guess).

#![allow(
    clippy::print_stdout,
    clippy::print_stderr,
    clippy::unwrap_used,
    reason = "a fake tool prints what the real one prints"
)]

use std::fs;
use std::io::BufRead as _;
use std::path::PathBuf;
use std::process::ExitCode;

use simlock_fake_tools::FakeMachine;
use simlock_fake_tools::machine::pid_alive;
use simlock_fake_tools::tool::{self, Exit, Outcome};

fn main() -> ExitCode {
    tool::run(
        "avdmanager",
        |args| args.first().cloned().unwrap_or_default(),
        avdmanager,
    )
}

fn avd_home() -> Result<PathBuf, Exit> {
    std::env::var_os("ANDROID_AVD_HOME")
        .map(PathBuf::from)
        .ok_or_else(|| Exit::new(1, "Error: ANDROID_AVD_HOME is not set (this fake never falls back to ~/.android/avd)\nnull"))
}

fn avdmanager(machine: &FakeMachine, args: &[String]) -> Outcome {
    let words: Vec<&str> = args.iter().map(String::as_str).collect();
    match words.as_slice() {
        ["create", "avd", rest @ ..] => create(machine, rest),
        ["list", "device", rest @ ..] => list_devices(machine, rest),
        ["list", "avd", rest @ ..] => list_avds(rest),
        ["delete", "avd", rest @ ..] => delete(machine, rest),
        _ => Err(Exit::new(
            1,
            format!(
                "Error: Invalid verb/object combination: {}\nUsage:\n      avdmanager [global options] [action] [action options]\nnull",
                args.join(" ")
            ),
        )),
    }
}

fn create(machine: &FakeMachine, rest: &[&str]) -> Outcome {
    let home = avd_home()?;
    let (mut name, mut package, mut device, mut force) = (None, None, None, false);
    let mut i = 0;
    while i < rest.len() {
        let value = rest.get(i + 1).copied();
        match rest[i] {
            "-n" | "--name" => name = value,
            "-k" | "--package" => package = value,
            "-d" | "--device" => device = value,
            "-f" | "--force" => {
                force = true;
                i += 1;
                continue;
            }
            "-c" | "--sdcard" | "-g" | "--tag" | "-b" | "--abi" | "-p" | "--path" => {}
            other => {
                return Err(Exit::new(
                    1,
                    format!("Error: Flag '{other}' is not valid for 'create avd'.\nnull"),
                ));
            }
        }
        if value.is_none() {
            return Err(Exit::new(
                1,
                format!("Error: Missing argument for flag {}.\nnull", rest[i]),
            ));
        }
        i += 2;
    }
    let (Some(name), Some(package)) = (name, package) else {
        return Err(Exit::new(
            1,
            "Error: The parameters --package, --name must be defined for action 'create avd'\nnull",
        ));
    };
    let profile = machine.profile();
    if !profile.sdk.images.iter().any(|i| i == package)
        || !machine
            .sdk_root()
            .join(package.replace(';', "/"))
            .join("package.xml")
            .exists()
    {
        return Err(Exit::new(
            1,
            "Error: Package path is not valid. Valid system image paths are:\nnull",
        ));
    }
    let device = match device {
        Some(id) => match profile
            .sdk
            .profiles
            .iter()
            .find(|p| p.id == id || p.name == id)
        {
            Some(p) => Some(p.clone()),
            None => {
                return Err(Exit::new(
                    1,
                    format!("Error: No device found matching --device {id}.\nnull"),
                ));
            }
        },
        None => {
            print!("Do you wish to create a custom hardware profile? [no] ");
            let mut answer = String::new();
            let _ = std::io::stdin().lock().read_line(&mut answer);
            println!();
            None
        }
    };
    let ini = home.join(format!("{name}.ini"));
    let dir = home.join(format!("{name}.avd"));
    if ini.exists() && !force {
        return Err(Exit::new(
            1,
            format!(
                "Error: Android Virtual Device '{name}' already exists.\nUse --force if you want to replace it.\nnull"
            ),
        ));
    }
    let parts: Vec<&str> = package.split(';').collect();
    let (api, tag, abi) = (parts[1], parts[2], parts[3]);
    let _ = fs::remove_dir_all(&dir);
    fs::create_dir_all(dir.join("userdata")).map_err(|e| Exit::new(1, e.to_string()))?;
    fs::write(
        &ini,
        format!(
            "avd.ini.encoding=UTF-8\npath={}\npath.rel=avd/{name}.avd\ntarget={api}\n",
            dir.display()
        ),
    )
    .map_err(|e| Exit::new(1, e.to_string()))?;
    let mut config = format!(
        "AvdId={name}\nPlayStore.enabled=false\nabi.type={abi}\navd.ini.displayname={name}\navd.ini.encoding=UTF-8\nhw.cpu.arch=x86_64\nhw.lcd.density=420\nhw.ramSize=2048\nimage.sysdir.1=system-images/{api}/{tag}/{abi}/\ntag.display=Google APIs\ntag.id={tag}\n"
    );
    if let Some(p) = &device {
        config.push_str(&format!(
            "hw.device.manufacturer={}\nhw.device.name={}\n",
            p.oem, p.id
        ));
    }
    fs::write(dir.join("config.ini"), config).map_err(|e| Exit::new(1, e.to_string()))?;
    machine.log_cost(name, "create", 1000);
    Ok(())
}

fn list_devices(machine: &FakeMachine, rest: &[&str]) -> Outcome {
    let profile = machine.profile();
    if rest == ["-c"] {
        for p in &profile.sdk.profiles {
            println!("{}", p.id);
        }
        return Ok(());
    }
    if !rest.is_empty() {
        return Err(Exit::new(
            1,
            format!(
                "Error: Flag '{}' is not valid for 'list device'.\nnull",
                rest[0]
            ),
        ));
    }
    println!("Available devices definitions:");
    for (n, p) in profile.sdk.profiles.iter().enumerate() {
        if n > 0 {
            println!("---------");
        }
        println!("id: {n} or \"{}\"", p.id);
        println!("    Name: {}", p.name);
        println!("    OEM : {}", p.oem);
        if let Some(tag) = &p.tag {
            println!("    Tag : {tag}");
        }
    }
    Ok(())
}

fn list_avds(rest: &[&str]) -> Outcome {
    let home = avd_home()?;
    let mut names: Vec<String> = fs::read_dir(&home)
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
    if rest == ["-c"] {
        for n in names {
            println!("{n}");
        }
        return Ok(());
    }
    println!("Available Android Virtual Devices:");
    for (i, n) in names.iter().enumerate() {
        if i > 0 {
            println!("---------");
        }
        println!("    Name: {n}");
        println!("    Path: {}", home.join(format!("{n}.avd")).display());
    }
    Ok(())
}

fn delete(machine: &FakeMachine, rest: &[&str]) -> Outcome {
    let home = avd_home()?;
    let name = match rest {
        ["-n" | "--name", name] => *name,
        _ => {
            return Err(Exit::new(
                1,
                "Error: The parameter --name must be defined for action 'delete avd'\nnull",
            ));
        }
    };
    let ini = home.join(format!("{name}.ini"));
    if !ini.exists() {
        return Err(Exit::new(
            1,
            format!("Error: There is no Android Virtual Device named '{name}'.\nnull"),
        ));
    }
    let running = machine.with_world(|w, _| w.emulators.get(name).map(|e| e.pid));
    if running.is_some_and(pid_alive) {
        return Err(Exit::new(
            1,
            format!(
                "Error: AVD '{name}' is currently running in the Android Emulator, make sure to stop it first.\nnull"
            ),
        ));
    }
    fs::remove_file(&ini).map_err(|e| Exit::new(1, e.to_string()))?;
    let _ = fs::remove_dir_all(home.join(format!("{name}.avd")));
    println!("\nAVD '{name}' deleted.");
    Ok(())
}
