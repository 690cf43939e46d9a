//! `cargo xtask fleet [--once]`: the local demo. Builds the binaries, starts a gateway and two
//! workers on loopback (fresh homes under `fleet-demo/` in cargo's target directory, generated
//! tokens, the built-in virtual devices), leases a device through the gateway with the CLI over
//! HTTP, and prints the fleet's status. It then keeps the fleet running until Ctrl-C; with `--once` it releases the
//! lease, stops the fleet and exits 0 only if the lease was granted and released.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitCode, Output, Stdio};
use std::sync::mpsc;
use std::time::Duration;

use anyhow::{Context, Result, bail};
use serde_json::Value;

use crate::cmd;

/// Every wait on the fleet is bounded by this.
const PATIENCE: Duration = Duration::from_secs(90);

struct Daemon {
    name: &'static str,
    child: Child,
}

impl Daemon {
    /// Starts `binary` with `args` and reads its ready line.
    fn start(name: &'static str, binary: &Path, args: &[String]) -> Result<(Self, Value)> {
        let mut child = Command::new(binary)
            .args(args)
            .env("SIMLOCK_LOG", "warn")
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .with_context(|| format!("starting {}", binary.display()))?;
        let stdout = child.stdout.take().context("the daemon's stdout")?;
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            let mut lines = BufReader::new(stdout).lines();
            if let Some(Ok(line)) = lines.next() {
                let _ = tx.send(line);
            }
            for _ in lines {}
        });
        let daemon = Self { name, child };
        let line = rx
            .recv_timeout(PATIENCE)
            .with_context(|| format!("{name} did not report ready"))?;
        let ready: Value =
            serde_json::from_str(&line).with_context(|| format!("{name}'s ready line: {line}"))?;
        Ok((daemon, ready))
    }

    /// Asks it to stop (SIGTERM) and waits.
    fn stop(mut self) {
        let _ = Command::new("kill")
            .arg("-TERM")
            .arg(self.child.id().to_string())
            .status();
        let _ = self.child.wait();
        println!("stopped {}", self.name);
    }
}

fn simlock(bin: &Path, home: Option<&Path>, args: &[&str]) -> Result<Output> {
    let mut command = Command::new(bin.join("simlock"));
    command.args(args).stdin(Stdio::null());
    command
        .env_remove("SIMLOCK_URL")
        .env_remove("SIMLOCK_TOKEN")
        .env_remove("SIMLOCK_AGENT_ID");
    if let Some(home) = home {
        command.env("SIMLOCK_HOME", home);
    }
    command.output().context("running simlock")
}

fn json_of(output: &Output, what: &str) -> Result<Value> {
    if !output.status.success() {
        bail!(
            "{what} failed ({}): {}{}",
            output.status,
            String::from_utf8_lossy(&output.stdout),
            String::from_utf8_lossy(&output.stderr)
        );
    }
    serde_json::from_slice(&output.stdout).with_context(|| format!("{what}: not JSON"))
}

pub(crate) fn run(once: bool) -> Result<ExitCode> {
    println!("building the gateway, the worker and the CLI…");
    if !cmd::status(crate::e2e::build_command())?.success() {
        bail!("the build failed");
    }
    let bin = crate::e2e::bin_dir();
    let root = crate::e2e::target_dir().join("fleet-demo");
    let _ = std::fs::remove_dir_all(&root);
    std::fs::create_dir_all(&root).with_context(|| format!("creating {}", root.display()))?;
    let home = |name: &str| root.join(name);

    let mut daemons = Vec::new();
    let outcome = demo(&bin, &home, once, &mut daemons);
    if once || outcome.is_err() {
        for daemon in daemons.into_iter().rev() {
            daemon.stop();
        }
    }
    match outcome {
        Ok(()) => Ok(ExitCode::SUCCESS),
        Err(e) => {
            eprintln!("cargo xtask fleet: {e:#}");
            Ok(ExitCode::FAILURE)
        }
    }
}

fn demo(
    bin: &Path,
    home: &dyn Fn(&str) -> PathBuf,
    once: bool,
    daemons: &mut Vec<Daemon>,
) -> Result<()> {
    let gateway_home = home("gateway");
    let (gateway, ready) = Daemon::start(
        "gateway",
        &bin.join("simlock-gateway"),
        &[
            "--home".into(),
            gateway_home.display().to_string(),
            "--port".into(),
            "0".into(),
        ],
    )?;
    daemons.push(gateway);
    let http = ready["http"]
        .as_str()
        .context("the gateway's HTTP address")?
        .to_owned();
    println!(
        "gateway up: http://{http} (home {})",
        gateway_home.display()
    );

    let join = json_of(
        &simlock(
            bin,
            Some(&gateway_home),
            &[
                "--json",
                "token",
                "create",
                "--role",
                "worker",
                "--label",
                "fleet-demo",
            ],
        )?,
        "creating a join token",
    )?;
    let join = join["secret"]
        .as_str()
        .context("the join token's secret")?
        .to_owned();
    let agent = json_of(
        &simlock(
            bin,
            Some(&gateway_home),
            &[
                "--json",
                "token",
                "create",
                "--role",
                "agent",
                "--label",
                "demo-agent",
            ],
        )?,
        "creating an agent token",
    )?;
    let agent = agent["secret"]
        .as_str()
        .context("the agent token's secret")?
        .to_owned();
    let operator = json_of(
        &simlock(
            bin,
            Some(&gateway_home),
            &[
                "--json",
                "token",
                "create",
                "--role",
                "operator",
                "--label",
                "demo-operator",
            ],
        )?,
        "creating an operator token",
    )?;
    let operator = operator["secret"]
        .as_str()
        .context("the operator token's secret")?
        .to_owned();

    for n in 1..=2 {
        let worker_home = home(&format!("worker-{n}"));
        let (worker, _) = Daemon::start(
            if n == 1 { "worker-1" } else { "worker-2" },
            &bin.join("simlock-worker"),
            &[
                "--home".into(),
                worker_home.display().to_string(),
                "--gateway".into(),
                format!("ws://{http}"),
                "--join-token".into(),
                join.clone(),
                "--label".into(),
                format!("demo-{n}"),
                // The demo's devices are virtual, whatever tools this machine has.
                "--set".into(),
                "drivers.ios.driver=virtual".into(),
                "--set".into(),
                "drivers.android.driver=virtual".into(),
            ],
        )?;
        daemons.push(worker);
        println!("worker-{n} up (home {})", worker_home.display());
    }

    // Wait until the gateway lists both workers connected, with their catalogs read: each poll
    // is a real call to the gateway; the pause between polls only spares the CPU.
    let mut joined = false;
    for _ in 0..(PATIENCE.as_millis() / 100) {
        let workers = json_of(
            &simlock(bin, Some(&gateway_home), &["--json", "workers"])?,
            "listing workers",
        )?;
        joined = workers["workers"].as_array().is_some_and(|w| {
            w.iter()
                .filter(|v| v["connection"] == "connected" && v.get("catalogReadAt").is_some())
                .count()
                == 2
        });
        if joined {
            break;
        }
        std::thread::park_timeout(Duration::from_millis(100));
    }
    if !joined {
        bail!("the workers did not join the gateway within {PATIENCE:?}");
    }
    println!("both workers joined the gateway\n");

    let url = format!("http://{http}");
    println!(
        "$ simlock --url {url} --token <agent> lease --platform ios --device \"iPhone 16\" --detach"
    );
    let lease = simlock(
        bin,
        None,
        &[
            "--url",
            &url,
            "--token",
            &agent,
            "--json",
            "lease",
            "--platform",
            "ios",
            "--device",
            "iPhone 16",
            "--detach",
        ],
    )?;
    let grant = json_of(&lease, "leasing through the gateway")?;
    let lease_id = grant["lease"]["id"]
        .as_str()
        .context("the lease id")?
        .to_owned();
    println!(
        "granted {} on {} ({} {}), expires in {} s\n",
        lease_id,
        grant["lease"]["worker"]["label"].as_str().unwrap_or("?"),
        grant["device"]["spec"]["model"].as_str().unwrap_or("?"),
        grant["device"]["spec"]["osVersion"].as_str().unwrap_or("?"),
        grant["lease"]["ttlMs"].as_u64().unwrap_or(0) / 1000
    );

    println!("$ simlock --url {url} --token <operator> status");
    let status = simlock(bin, None, &["--url", &url, "--token", &operator, "status"])?;
    print!("{}", String::from_utf8_lossy(&status.stdout));
    if !status.status.success() {
        bail!("status failed: {}", String::from_utf8_lossy(&status.stderr));
    }

    if once {
        println!("\n$ simlock --url {url} --token <agent> release {lease_id}");
        let released = json_of(
            &simlock(
                bin,
                None,
                &[
                    "--url", &url, "--token", &agent, "--json", "release", &lease_id,
                ],
            )?,
            "releasing",
        )?;
        if released["leaseId"] != lease_id.as_str() {
            bail!("release answered {released}");
        }
        println!("released {lease_id}\nthe fleet demo passed");
        return Ok(());
    }
    println!("\nThe fleet runs until Ctrl-C. Try it:");
    println!("  export SIMLOCK_URL={url} SIMLOCK_TOKEN={agent}");
    println!("  simlock lease --platform android        # held until Ctrl-C");
    println!(
        "  SIMLOCK_HOME={} simlock workers          # as the gateway's operator",
        gateway_home.display()
    );
    // Ctrl-C reaches the daemons too (same process group); wait for them to stop.
    for daemon in daemons.iter_mut() {
        let _ = daemon.child.wait();
    }
    Ok(())
}
