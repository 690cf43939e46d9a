//! Waiting for the end of a daemon's life: SIGINT, SIGTERM, SIGHUP, or `daemon.stop`.
//!
//! SIGHUP stops a daemon as SIGTERM does (the terminal it was started from closed, or a
//! supervisor hung up): nothing reloads configuration, and a daemon killed by the default
//! action would leave its socket, its children and its leases' renewals behind.

use tokio::signal::unix::{SignalKind, signal};

use crate::runtime::Running;

/// Resolves with the reason once the daemon should stop.
pub async fn wait(running: &Running) -> &'static str {
    let interrupt = signal(SignalKind::interrupt());
    let terminate = signal(SignalKind::terminate());
    let hangup = signal(SignalKind::hangup());
    match (interrupt, terminate, hangup) {
        (Ok(mut interrupt), Ok(mut terminate), Ok(mut hangup)) => tokio::select! {
            _ = interrupt.recv() => "SIGINT",
            _ = terminate.recv() => "SIGTERM",
            _ = hangup.recv() => "SIGHUP",
            () = running.stop_requested() => "daemon.stop",
        },
        _ => {
            running.stop_requested().await;
            "daemon.stop"
        }
    }
}
