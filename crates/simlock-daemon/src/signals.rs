//! Waiting for the end of a daemon's life: SIGINT, SIGTERM, or `daemon.stop`.

use tokio::signal::unix::{SignalKind, signal};

use crate::runtime::Running;

/// Resolves with the reason once the daemon should stop.
pub async fn wait(running: &Running) -> &'static str {
    let interrupt = signal(SignalKind::interrupt());
    let terminate = signal(SignalKind::terminate());
    match (interrupt, terminate) {
        (Ok(mut interrupt), Ok(mut terminate)) => tokio::select! {
            _ = interrupt.recv() => "SIGINT",
            _ = terminate.recv() => "SIGTERM",
            () = running.stop_requested() => "daemon.stop",
        },
        _ => {
            running.stop_requested().await;
            "daemon.stop"
        }
    }
}
