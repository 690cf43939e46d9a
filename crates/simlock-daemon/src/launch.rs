//! What a daemon binary does around its composition: load configuration (exit 64 naming the key
//! when it is bad), start logging, start the daemon, print one JSON ready line on stdout, wait
//! for SIGINT, SIGTERM or `daemon.stop`, stop gracefully, and log `stopped` with the reason
//! last.

use std::future::Future;
use std::io::Write as _;
use std::process::ExitCode;

use serde_json::{Value, json};
use simlock_contract::model::Mode;

use crate::config::{self, Loaded, Sections};
use crate::home::Home;
use crate::runtime::{Running, StartError};

/// Exit code for a configuration error (EX_USAGE).
pub const EXIT_CONFIG: u8 = 64;

/// Writes `line` to stdout. A stdout that cannot be written (a closed pipe, a full disk) loses
/// the line and nothing else: `println!` would panic the daemon.
pub fn say(line: &str) {
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "{line}").and_then(|()| out.flush());
}

/// Writes `line` to stderr, where a daemon reports what stops it; one that cannot be written
/// loses the line and nothing else: `eprintln!` would panic the daemon.
pub fn complain(line: &str) {
    let _ = writeln!(std::io::stderr().lock(), "{line}");
}

/// A started daemon, as its binary sees it.
pub trait Launched: Send + 'static {
    /// The daemon's hosts.
    fn running(&self) -> &Running;
    /// Stops it.
    fn stop(self, reason: &'static str) -> impl Future<Output = ()> + Send;
}

/// Reads `--set KEY=VALUE` flags into configuration overrides; a value parses as JSON when it
/// can (numbers, booleans), else it is a string.
///
/// # Errors
/// The flag that is not `KEY=VALUE`.
pub fn parse_sets(sets: &[String], sections: &Sections) -> Result<Vec<(String, Value)>, String> {
    sets.iter()
        .map(|pair| {
            let (key, value) = pair
                .split_once('=')
                .filter(|(key, _)| !key.trim().is_empty())
                .ok_or_else(|| format!("--set takes KEY=VALUE, got {pair:?}"))?;
            Ok((key.to_owned(), config::coerce(key, value, sections)))
        })
        .collect()
}

/// Task polls between two looks at the I/O driver (tokio's default is 61).
///
/// A daemon serves small calls beside bulk relays on the same threads. A small call crosses
/// several sockets (caller, uplink), and each crossing waits until a worker thread next looks
/// for I/O events; with bulk tasks in the run queue, 61 polls of them can take milliseconds.
/// Looking every 8 polls cut a renew's p99 under a 1 GiB relay from 5.6 ms to about 2 ms on the
/// bench machine, together with the link driver's bounded rounds (ADR 0014).
pub const EVENT_INTERVAL: u32 = 8;

/// The multi-threaded runtime a daemon runs on (one worker thread per core), tuned for small
/// calls beside bulk transfers: see [`EVENT_INTERVAL`].
///
/// # Errors
/// The runtime could not be built (no threads, no I/O driver).
pub fn runtime() -> std::io::Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_multi_thread()
        .event_interval(EVENT_INTERVAL)
        .enable_all()
        .build()
}

/// Runs a daemon binary: loads the configuration with the `sections` the binary registers, then
/// `start` composes the daemon from its home and the loaded configuration.
#[allow(
    clippy::print_stdout,
    clippy::print_stderr,
    reason = "a daemon's ready line and fatal errors go to the terminal"
)]
pub fn run<D, F, Fut>(
    name: &str,
    mode: Mode,
    home: Home,
    overrides: &[(String, Value)],
    sections: &Sections,
    start: F,
) -> ExitCode
where
    D: Launched,
    F: FnOnce(Home, Loaded) -> Fut,
    Fut: Future<Output = Result<D, StartError>>,
{
    let loaded = match config::load(home.root(), mode, overrides, sections) {
        Ok(loaded) => loaded,
        Err(e) => {
            complain(&format!("{name}: {e}"));
            return ExitCode::from(EXIT_CONFIG);
        }
    };
    // Held to the end: dropping it writes out the lines still queued (bounded).
    let _logging = crate::logging::init(&loaded.config.log.level);
    for warning in &loaded.warnings {
        tracing::warn!("{warning}");
    }
    let runtime = match runtime() {
        Ok(runtime) => runtime,
        Err(e) => {
            complain(&format!("{name}: cannot start the runtime: {e}"));
            return ExitCode::FAILURE;
        }
    };
    let stopped = runtime.block_on(async move {
        let daemon = match start(home, loaded).await {
            Ok(daemon) => daemon,
            Err(e) => {
                complain(&format!("{name}: {e}"));
                return None;
            }
        };
        let running = daemon.running();
        // Listening before the ready line: a signal sent as soon as it is read stops the daemon.
        let signals = crate::signals::StopSignals::listen();
        let ready = json!({
            "ready": mode.as_str(),
            "instanceId": running.base.instance_id,
            "socket": running.socket_path(),
            "http": running.http_addr().map(|a| a.to_string()),
        });
        say(&ready.to_string());
        let reason = signals.wait(running).await;
        daemon.stop(reason).await;
        Some(reason)
    });
    // Whatever the stop left on the runtime (blocking tasks) ends here, so the line below is
    // the last thing the process does.
    drop(runtime);
    match stopped {
        Some(reason) => {
            tracing::info!(reason, "stopped");
            ExitCode::SUCCESS
        }
        None => ExitCode::FAILURE,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sets_read_values_by_their_keys_type() {
        let sets = parse_sets(
            &[
                "http.port=5".into(),
                "gateway.label=42".into(),
                "http.enabled=true".into(),
            ],
            &Sections::new(),
        )
        .unwrap();
        assert_eq!(
            sets,
            [
                ("http.port".into(), json!(5)),
                ("gateway.label".into(), json!("42")),
                ("http.enabled".into(), json!(true))
            ]
        );
        for bad in ["nokey", "=5", " =5"] {
            assert_eq!(
                parse_sets(&[bad.into()], &Sections::new()).unwrap_err(),
                format!("--set takes KEY=VALUE, got {bad:?}"),
                "a flag with no key names the flag, not a key"
            );
        }
    }
}
