//! Waiting for the end of a daemon's life: SIGINT, SIGTERM, SIGHUP, or `daemon.stop`.
//!
//! SIGHUP stops a daemon as SIGTERM does (the terminal it was started from closed, or a
//! supervisor hung up): nothing reloads configuration, and a daemon killed by the default
//! action would leave its socket, its children and its leases' renewals behind.

use tokio::signal::unix::{Signal, SignalKind, signal};

use crate::runtime::Running;

/// The stop signals, listened to from the moment this is made: make it before the daemon says
/// it is ready, so a signal sent as soon as the ready line is read is never left to its default
/// action.
#[derive(Debug)]
pub struct StopSignals {
    listening: Option<(Signal, Signal, Signal)>,
}

impl StopSignals {
    /// Starts listening (without a runtime's signal driver, only `daemon.stop` ends the wait).
    pub fn listen() -> Self {
        let listening = match (
            signal(SignalKind::interrupt()),
            signal(SignalKind::terminate()),
            signal(SignalKind::hangup()),
        ) {
            (Ok(interrupt), Ok(terminate), Ok(hangup)) => Some((interrupt, terminate, hangup)),
            _ => None,
        };
        Self { listening }
    }

    /// Resolves with the reason once the daemon should stop.
    pub async fn wait(self, running: &Running) -> &'static str {
        match self.listening {
            Some((mut interrupt, mut terminate, mut hangup)) => tokio::select! {
                _ = interrupt.recv() => "SIGINT",
                _ = terminate.recv() => "SIGTERM",
                _ = hangup.recv() => "SIGHUP",
                () = running.stop_requested() => "daemon.stop",
            },
            None => {
                running.stop_requested().await;
                "daemon.stop"
            }
        }
    }
}
