//! The simlock gateway daemon: parse configuration, start, wait for a signal or `daemon.stop`,
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
use simlock_gateway::{GatewayOptions, start};

/// Exit code for a configuration error (EX_USAGE).
const EXIT_CONFIG: u8 = 64;

/// simlock-gateway: one URL for a fleet of simlock workers.
#[derive(Debug, Parser)]
#[command(version, about)]
struct Args {
    /// The daemon's home (default $SIMLOCK_HOME, else ~/.simlock).
    #[arg(long, env = "SIMLOCK_HOME")]
    home: Option<std::path::PathBuf>,
    /// The HTTP port (0 picks a free one); same as --set http.port=N.
    #[arg(long)]
    port: Option<u16>,
    /// The HTTP address; same as --set http.host=ADDR.
    #[arg(long)]
    host: Option<String>,
    /// Any configuration key, e.g. --set lease.maxTtlMs=7200000 (repeatable).
    #[arg(long = "set", value_name = "KEY=VALUE")]
    set: Vec<String>,
}

fn main() -> ExitCode {
    let args = Args::parse();
    let home = args.home.map_or_else(Home::from_env, Home::at);
    let mut overrides = Vec::new();
    if let Some(port) = args.port {
        overrides.push(("http.port".to_owned(), serde_json::json!(port)));
    }
    if let Some(host) = args.host {
        overrides.push(("http.host".to_owned(), serde_json::json!(host)));
    }
    for pair in &args.set {
        let Some((key, value)) = pair.split_once('=') else {
            eprintln!("simlock-gateway: --set takes KEY=VALUE, got {pair:?}");
            return ExitCode::from(EXIT_CONFIG);
        };
        overrides.push((
            key.to_owned(),
            serde_json::from_str(value).unwrap_or_else(|_| serde_json::json!(value)),
        ));
    }
    let loaded = match config::load(home.root(), Mode::Gateway, std::env::vars(), &overrides) {
        Ok(loaded) => loaded,
        Err(e) => {
            eprintln!("simlock-gateway: {e}");
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
            eprintln!("simlock-gateway: cannot start the runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    runtime.block_on(async move {
        let gateway = match start(GatewayOptions::new(home, loaded.config)).await {
            Ok(gateway) => gateway,
            Err(e) => {
                eprintln!("simlock-gateway: {e}");
                return ExitCode::FAILURE;
            }
        };
        let ready = serde_json::json!({
            "ready": "gateway",
            "instanceId": gateway.running.base.instance_id,
            "socket": gateway.running.socket_path(),
            "http": gateway.running.http_addr().map(|a| a.to_string()),
        });
        println!("{ready}");
        let reason = simlock_daemon::signals::wait(&gateway.running).await;
        gateway.stop(reason).await;
        ExitCode::SUCCESS
    })
}
