//! The simlock gateway daemon: parse flags, then the shared launch (configuration, start, ready
//! line, signals, graceful stop). No protocol logic lives here.

use std::process::ExitCode;

use clap::Parser;
use simlock_contract::model::Mode;
use simlock_daemon::home::Home;
use simlock_daemon::launch::{self, EXIT_CONFIG};
use simlock_daemon::runtime::{Running, StartError};
use simlock_gateway::{GatewayConfig, GatewayOptions, RunningGateway, start};

/// simlock-gateway: one URL for a fleet of simlock workers.
#[derive(Debug, Parser)]
#[command(version)]
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
    let sections = simlock_gateway::sections();
    match launch::parse_sets(&args.set, sections) {
        Ok(sets) => overrides.extend(sets),
        Err(e) => {
            launch::complain(&format!("simlock-gateway: {e}"));
            return ExitCode::from(EXIT_CONFIG);
        }
    }
    launch::run(
        "simlock-gateway",
        Mode::Gateway,
        home,
        &overrides,
        sections,
        |home, loaded| async move {
            let config = GatewayConfig::from_loaded(&loaded)
                .map_err(|e| StartError::Domain(e.to_string()))?;
            start(GatewayOptions::new(home, config)).await.map(Gateway)
        },
    )
}

/// The started daemon, for the shared launch.
struct Gateway(RunningGateway);

impl launch::Launched for Gateway {
    fn running(&self) -> &Running {
        &self.0.running
    }

    async fn stop(self, reason: &'static str) {
        self.0.stop(reason).await;
    }
}
