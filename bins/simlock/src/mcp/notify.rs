//! The session's notifications to its client: `notifications/message` (MCP logging) at the
//! level the client set with `logging/setLevel`. The SDK marks MCP logging deprecated (SEP-2577,
//! for the 2026-07-28 revision), but it is the notification the agent CLIs of today receive on a
//! stdio session; ADR 0019 says why it carries the lease notices. Every use of the deprecated
//! API is in this module.
#![allow(
    deprecated,
    reason = "MCP logging is deprecated by SEP-2577 yet is what current agent CLIs receive (ADR 0019)"
)]

use parking_lot::Mutex;
use rmcp::model::{LoggingLevel, LoggingMessageNotificationParam};
use rmcp::{Peer, RoleServer};
use serde_json::Value;

/// The logger named in every notification.
pub(crate) const LOGGER: &str = "simlock";

/// How much a notification matters, least first.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) enum Level {
    /// Worth knowing (a device recovered).
    Info,
    /// Needs attention (a lease ended, a device crashed).
    Warning,
    /// Something failed (renewing a lease).
    Error,
}

impl Level {
    const fn mcp(self) -> LoggingLevel {
        match self {
            Self::Info => LoggingLevel::Info,
            Self::Warning => LoggingLevel::Warning,
            Self::Error => LoggingLevel::Error,
        }
    }
}

/// A logging level's rank, least severe first.
const fn rank(level: LoggingLevel) -> u8 {
    match level {
        LoggingLevel::Debug => 0,
        LoggingLevel::Info => 1,
        LoggingLevel::Notice => 2,
        LoggingLevel::Warning => 3,
        LoggingLevel::Error => 4,
        LoggingLevel::Critical => 5,
        LoggingLevel::Alert => 6,
        LoggingLevel::Emergency => 7,
    }
}

/// Where the session's notifications go.
#[derive(Debug)]
pub(crate) struct Notifier {
    peer: Mutex<Option<Peer<RoleServer>>>,
    /// The least severe level the client wants; `info` until it says.
    least: Mutex<LoggingLevel>,
}

impl Default for Notifier {
    fn default() -> Self {
        Self {
            peer: Mutex::new(None),
            least: Mutex::new(LoggingLevel::Info),
        }
    }
}

impl Notifier {
    /// Notifications go to `peer` from now on.
    pub(crate) fn attach(&self, peer: Peer<RoleServer>) {
        *self.peer.lock() = Some(peer);
    }

    /// `logging/setLevel`.
    pub(crate) fn set_level(&self, level: LoggingLevel) {
        *self.least.lock() = level;
    }

    /// Whether the client wants notifications of `level`.
    pub(crate) fn wants(&self, level: Level) -> bool {
        rank(level.mcp()) >= rank(*self.least.lock())
    }

    /// Sends `data` at `level`, when a client is attached and wants it. A notification that
    /// cannot be sent (the client left) is dropped.
    pub(crate) async fn tell(&self, level: Level, data: Value) {
        if !self.wants(level) {
            return;
        }
        let Some(peer) = self.peer.lock().clone() else {
            return;
        };
        let mut note = LoggingMessageNotificationParam::new(level.mcp(), data);
        note.logger = Some(LOGGER.to_owned());
        if let Err(e) = peer.notify_logging_message(note).await {
            tracing::debug!(error = %e, "a notification could not be sent");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_level_the_client_sets_filters_notifications() {
        let notifier = Notifier::default();
        assert!(notifier.wants(Level::Info));
        notifier.set_level(LoggingLevel::Warning);
        assert!(!notifier.wants(Level::Info));
        assert!(notifier.wants(Level::Warning));
        assert!(notifier.wants(Level::Error));
        notifier.set_level(LoggingLevel::Emergency);
        assert!(!notifier.wants(Level::Error));
        notifier.set_level(LoggingLevel::Debug);
        assert!(notifier.wants(Level::Info));
    }
}
