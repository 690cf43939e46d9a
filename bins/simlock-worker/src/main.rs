//! The simlock worker daemon: parse configuration, start, wait for a signal or `daemon.stop`,
//! drain. No protocol logic lives here.

#![allow(
    clippy::print_stdout,
    clippy::print_stderr,
    reason = "a daemon's start-up line and fatal errors go to the terminal"
)]

use std::process::ExitCode;

use clap::Parser;
use simlock_contract::model::Mode;
use simlock_daemon::config;
use simlock_daemon::home::Home;
use simlock_worker::{WorkerOptions, start};

/// Exit code for a configuration error (EX_USAGE).
const EXIT_CONFIG: u8 = 64;

/// simlock-worker: leases this machine's simulators and emulators to coding agents.
#[derive(Debug, Parser)]
#[command(version, about)]
struct Args {
    /// The daemon's home (default $SIMLOCK_HOME, else ~/.simlock).
    #[arg(long, env = "SIMLOCK_HOME")]
    home: Option<std::path::PathBuf>,
    /// Serve HTTP `/v1` too; same as --set http.enabled=true.
    #[arg(long)]
    http: bool,
    /// The HTTP port (0 picks a free one); same as --set http.port=N.
    #[arg(long)]
    port: Option<u16>,
    /// The gateway to join, e.g. ws://gateway:4700; same as --set gateway.url=URL.
    #[arg(long)]
    gateway: Option<String>,
    /// The join token; same as --set gateway.token=SECRET.
    #[arg(long, env = "SIMLOCK_JOIN_TOKEN", hide_env_values = true)]
    join_token: Option<String>,
    /// A label for the gateway's views; same as --set gateway.label=TEXT.
    #[arg(long)]
    label: Option<String>,
    /// Any configuration key, e.g. --set capacity.strategy=fixed (repeatable).
    #[arg(long = "set", value_name = "KEY=VALUE")]
    set: Vec<String>,
}

fn main() -> ExitCode {
    let args = Args::parse();
    let home = args.home.map_or_else(Home::from_env, Home::at);
    let mut overrides = Vec::new();
    if args.http {
        overrides.push(("http.enabled".to_owned(), serde_json::json!(true)));
    }
    if let Some(port) = args.port {
        overrides.push(("http.port".to_owned(), serde_json::json!(port)));
    }
    for (key, value) in [
        ("gateway.url", args.gateway),
        ("gateway.token", args.join_token),
        ("gateway.label", args.label),
    ] {
        if let Some(value) = value {
            overrides.push((key.to_owned(), serde_json::json!(value)));
        }
    }
    for pair in &args.set {
        let Some((key, value)) = pair.split_once('=') else {
            eprintln!("simlock-worker: --set takes KEY=VALUE, got {pair:?}");
            return ExitCode::from(EXIT_CONFIG);
        };
        overrides.push((
            key.to_owned(),
            serde_json::from_str(value).unwrap_or_else(|_| serde_json::json!(value)),
        ));
    }
    let loaded = match config::load(home.root(), Mode::Worker, std::env::vars(), &overrides) {
        Ok(loaded) => loaded,
        Err(e) => {
            eprintln!("simlock-worker: {e}");
            return ExitCode::from(EXIT_CONFIG);
        }
    };
    simlock_daemon::logging::init(&loaded.config.log.level);
    for warning in &loaded.warnings {
        tracing::warn!("{warning}");
    }
    let runtime = match tokio::runtime::Runtime::new() {
        Ok(runtime) => runtime,
        Err(e) => {
            eprintln!("simlock-worker: cannot start the runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    runtime.block_on(async move {
        let worker = match start(WorkerOptions::new(home, loaded.config)).await {
            Ok(worker) => worker,
            Err(e) => {
                eprintln!("simlock-worker: {e}");
                return ExitCode::FAILURE;
            }
        };
        let ready = serde_json::json!({
            "ready": "worker",
            "instanceId": worker.running.base.instance_id,
            "socket": worker.running.socket_path(),
            "http": worker.running.http_addr().map(|a| a.to_string()),
        });
        println!("{ready}");
        let reason = simlock_daemon::signals::wait(&worker.running).await;
        worker.stop(reason).await;
        ExitCode::SUCCESS
    })
}
