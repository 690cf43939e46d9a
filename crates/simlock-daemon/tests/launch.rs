//! What a daemon binary does around its composition (`launch::run`), in process: once stopped
//! it logs `stopped` with the reason, as its last line.

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    reason = "tests fail by panicking"
)]

mod common;

use std::future::Future;
use std::process::ExitCode;

use serde_json::Value;
use simlock_contract::model::Mode;
use simlock_daemon::config::Sections;
use simlock_daemon::home::Home;
use simlock_daemon::launch::{self, Launched};
use simlock_daemon::runtime::{Base, Listen, Running};

use common::Captured;

struct Daemon(Running);

impl Launched for Daemon {
    fn running(&self) -> &Running {
        &self.0
    }

    fn stop(self, reason: &'static str) -> impl Future<Output = ()> + Send {
        self.0.stop(reason)
    }
}

// The only test in this file: it sets the process's subscriber, which `launch::run` then keeps
// (its own is not installed over one already in place).
#[test]
fn a_stopped_daemon_logs_stopped_with_the_reason_as_its_last_line() {
    let captured = Captured::default();
    let writer = captured.clone();
    let subscriber = tracing_subscriber::fmt()
        .json()
        .with_max_level(tracing::Level::INFO)
        .with_writer(move || writer.clone())
        .finish();
    tracing::subscriber::set_global_default(subscriber).unwrap();
    let dir = tempfile::tempdir().unwrap();

    let code = launch::run(
        "test-daemon",
        Mode::Worker,
        Home::at(dir.path().join("home")),
        &[],
        &Sections::new(),
        |home, loaded| async move {
            let base = Base::open(home, loaded.config, Mode::Worker, "test".into(), None)?;
            let shutdown = base.shutdown.clone();
            let router = base.router();
            let running = base.serve(router, Listen::SocketOnly, Vec::new()).await?;
            running.started();
            // As `daemon.stop` does.
            shutdown.request();
            Ok(Daemon(running))
        },
    );
    assert_eq!(code, ExitCode::SUCCESS);

    let text = String::from_utf8_lossy(&captured.0.lock()).into_owned();
    let events: Vec<Value> = text
        .lines()
        .map(|line| serde_json::from_str(line).unwrap())
        .collect();
    let messages: Vec<&str> = events
        .iter()
        .map(|e| e["fields"]["message"].as_str().unwrap_or_default())
        .collect();
    assert!(messages.contains(&"daemon stopping"), "{messages:?}");
    let last = events.last().unwrap();
    assert_eq!(last["level"], "INFO", "{last}");
    assert_eq!(last["fields"]["message"], "stopped", "{last}");
    assert_eq!(last["fields"]["reason"], "daemon.stop", "{last}");
    assert_eq!(
        messages.iter().filter(|m| **m == "stopped").count(),
        1,
        "{messages:?}"
    );
}
