//! Failure reasons and error types, shared by the sans-IO core and the tokio driver.
//!
//! Every way a channel can fail is one [`FailureReason`]; every channel failure the application
//! sees is a [`ChannelError`] carrying one. A [`ChannelError`] converts into a [`std::io::Error`]
//! for `AsyncRead`/`AsyncWrite` users, and [`ChannelError::from_io`] recovers it again.

use std::{fmt, io};

use crate::proto::frame::ChannelId;

/// Why a channel (or one direction of it) failed. The one list of reasons the link knows.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum FailureReason {
    /// The reader of this direction sent `STOP`: it wants no more bytes.
    Stopped,
    /// The channel was aborted, by the application at either end or by the relay.
    Aborted,
    /// The link is gone (peer close, protocol violation, missed pings, socket error or local close).
    Closed,
    /// A writer held data and got no credit for the stall timeout (60 s by default).
    Stalled,
    /// The channel was refused: never opened, already accepted, or not accepted in time.
    Refused,
}

impl FailureReason {
    /// Every reason, in declaration order.
    pub const ALL: [Self; 5] = [
        Self::Stopped,
        Self::Aborted,
        Self::Closed,
        Self::Stalled,
        Self::Refused,
    ];

    /// The lower-case name used in logs, metrics and on the wire's documentation.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Stopped => "stopped",
            Self::Aborted => "aborted",
            Self::Closed => "closed",
            Self::Stalled => "stalled",
            Self::Refused => "refused",
        }
    }

    /// The `std::io::ErrorKind` a failure of this kind maps to.
    pub fn io_kind(self) -> io::ErrorKind {
        match self {
            // The reader went away, as with a pipe whose reading end is closed.
            Self::Stopped => io::ErrorKind::BrokenPipe,
            Self::Aborted => io::ErrorKind::ConnectionAborted,
            Self::Closed => io::ErrorKind::ConnectionReset,
            Self::Stalled => io::ErrorKind::TimedOut,
            Self::Refused => io::ErrorKind::ConnectionRefused,
        }
    }
}

impl fmt::Display for FailureReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A channel (or one of its directions) failed. The only error type channel operations return.
///
/// Match on [`reason`](Self::reason); the message text is not a stable API.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub struct ChannelError {
    reason: FailureReason,
    channel: Option<ChannelId>,
}

impl ChannelError {
    /// An error with `reason`, not tied to a named channel (for example a failed open).
    pub fn new(reason: FailureReason) -> Self {
        Self {
            reason,
            channel: None,
        }
    }

    /// An error with `reason` on the channel `id`.
    pub fn on(reason: FailureReason, id: ChannelId) -> Self {
        Self {
            reason,
            channel: Some(id),
        }
    }

    /// Why the channel failed.
    pub fn reason(&self) -> FailureReason {
        self.reason
    }

    /// The channel that failed, when there is one.
    pub fn channel(&self) -> Option<&ChannelId> {
        self.channel.as_ref()
    }

    /// The [`ChannelError`] inside an [`io::Error`] produced by a channel's `AsyncRead` or
    /// `AsyncWrite`, if that is where it came from.
    pub fn from_io(error: &io::Error) -> Option<&Self> {
        error.get_ref()?.downcast_ref::<Self>()
    }
}

impl fmt::Display for ChannelError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.channel {
            Some(id) => write!(f, "channel {id} {}", self.reason),
            None => write!(f, "channel {}", self.reason),
        }
    }
}

impl From<ChannelError> for io::Error {
    fn from(error: ChannelError) -> Self {
        Self::new(error.reason.io_kind(), error)
    }
}

/// Why a link closed.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum CloseReason {
    /// This end closed it: `close()` was called or every `LinkHandle` was dropped.
    Local,
    /// This end closed it with `close_because()`, telling the peer why in its close frame.
    LocalBecause(String),
    /// The peer closed the WebSocket; `reason` is the text of its close frame (may be empty).
    Peer {
        /// The peer's close reason text.
        reason: String,
    },
    /// This end saw a protocol violation from the peer (the text names it) and closed the link.
    Violation(String),
    /// Pings went unanswered (three by default): the uplink is dead.
    Unresponsive,
    /// The socket failed or ended without a WebSocket close.
    Transport(String),
}

impl fmt::Display for CloseReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Local => f.write_str("closed by this end"),
            Self::LocalBecause(why) => write!(f, "closed by this end: {why}"),
            Self::Peer { reason } if reason.is_empty() => f.write_str("closed by the peer"),
            Self::Peer { reason } => write!(f, "closed by the peer: {reason}"),
            Self::Violation(what) => write!(f, "protocol violation: {what}"),
            Self::Unresponsive => f.write_str("peer unresponsive: pings went unanswered"),
            Self::Transport(what) => write!(f, "transport failed: {what}"),
        }
    }
}

/// The link is closed; operations on the link as a whole (the text lane) fail with this.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("link closed ({reason})")]
pub struct LinkError {
    reason: CloseReason,
}

impl LinkError {
    /// A link error for a link closed for `reason`.
    pub fn new(reason: CloseReason) -> Self {
        Self { reason }
    }

    /// Why the link closed.
    pub fn reason(&self) -> &CloseReason {
        &self.reason
    }
}

impl From<LinkError> for io::Error {
    fn from(error: LinkError) -> Self {
        Self::new(io::ErrorKind::ConnectionReset, error)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn io_error_keeps_the_typed_error() {
        let id = ChannelId::new("c1").unwrap();
        for reason in FailureReason::ALL {
            let io: io::Error = ChannelError::on(reason, id).into();
            assert_eq!(io.kind(), reason.io_kind());
            let back = ChannelError::from_io(&io).unwrap();
            assert_eq!(back.reason(), reason);
            assert_eq!(back.channel(), Some(&id));
            assert!(io.to_string().contains(reason.as_str()));
        }
    }

    #[test]
    fn foreign_io_error_has_no_channel_error() {
        let io = io::Error::other("something else");
        assert!(ChannelError::from_io(&io).is_none());
    }
}
