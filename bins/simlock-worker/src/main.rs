//! The simlock worker daemon: parse flags, then the shared launch (configuration, start, ready
//! line, signals, graceful stop). No protocol logic lives here.

use std::process::ExitCode;

use clap::Parser;
use simlock_contract::model::Mode;
use simlock_daemon::home::Home;
use simlock_daemon::launch::{self, EXIT_CONFIG};
use simlock_daemon::runtime::{Running, StartError};
use simlock_worker::{RunningWorker, WorkerConfig, WorkerOptions, start};

/// The configuration keys the flags set (`--set` comes after them, and wins). A port asks for
/// HTTP: `--port` alone serves it, where it was silently ignored without `--http`.
fn flag_overrides(args: &Args) -> Vec<(String, serde_json::Value)> {
    let mut overrides = Vec::new();
    if args.http || args.port.is_some() {
        overrides.push(("http.enabled".to_owned(), serde_json::json!(true)));
    }
    if let Some(port) = args.port {
        overrides.push(("http.port".to_owned(), serde_json::json!(port)));
    }
    for (key, value) in [
        ("gateway.url", &args.gateway),
        ("gateway.token", &args.join_token),
        ("gateway.label", &args.label),
    ] {
        if let Some(value) = value {
            overrides.push((key.to_owned(), serde_json::json!(value)));
        }
    }
    overrides
}

/// simlock-worker: leases this machine's simulators and emulators to coding agents.
#[derive(Debug, Parser)]
#[command(version)]
struct Args {
    /// The daemon's home (default $SIMLOCK_HOME, else ~/.simlock).
    #[arg(long, env = "SIMLOCK_HOME")]
    home: Option<std::path::PathBuf>,
    /// Serve HTTP `/v1` too; same as --set http.enabled=true.
    #[arg(long)]
    http: bool,
    /// The HTTP port (0 picks a free one); serves HTTP, as --http does; same as
    /// --set http.enabled=true --set http.port=N.
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
    let mut overrides = flag_overrides(&args);
    let home = args.home.map_or_else(Home::from_env, Home::at);
    let sections = simlock_worker::sections();
    match launch::parse_sets(&args.set, sections) {
        Ok(sets) => overrides.extend(sets),
        Err(e) => {
            launch::complain(&format!("simlock-worker: {e}"));
            return ExitCode::from(EXIT_CONFIG);
        }
    }
    launch::run(
        "simlock-worker",
        Mode::Worker,
        home,
        &overrides,
        sections,
        |home, loaded| async move {
            let config = WorkerConfig::from_loaded(&loaded)
                .map_err(|e| StartError::Domain(e.to_string()))?;
            start(WorkerOptions::new(home, config)).await.map(Worker)
        },
    )
}

/// The started daemon, for the shared launch.
struct Worker(RunningWorker);

impl launch::Launched for Worker {
    fn running(&self) -> &Running {
        &self.0.running
    }

    async fn stop(self, reason: &'static str) {
        self.0.stop(reason).await;
    }
}

#[cfg(test)]
mod tests {
    use clap::Parser as _;
    use serde_json::json;

    use super::*;

    fn keys(argv: &[&str]) -> Vec<(String, serde_json::Value)> {
        let args =
            Args::try_parse_from(std::iter::once("simlock-worker").chain(argv.iter().copied()))
                .expect("the flags parse");
        flag_overrides(&args)
    }

    #[test]
    fn a_port_serves_http_as_http_does() {
        assert!(keys(&[]).is_empty());
        assert_eq!(
            keys(&["--http"]),
            [("http.enabled".to_owned(), json!(true))]
        );
        assert_eq!(
            keys(&["--port", "4701"]),
            [
                ("http.enabled".to_owned(), json!(true)),
                ("http.port".to_owned(), json!(4701)),
            ]
        );
        assert_eq!(
            keys(&["--gateway", "ws://gw:4700", "--label", "mini"]),
            [
                ("gateway.url".to_owned(), json!("ws://gw:4700")),
                ("gateway.label".to_owned(), json!("mini")),
            ]
        );
    }
}
