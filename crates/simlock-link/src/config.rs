//! Link configuration: which end this is, and the timing and size knobs with the design's defaults.
//!
//! The defaults are the protocol. Both ends of one link must agree on the knobs marked
//! *protocol*: the initial window, the maximum window, the channel limits and the frame size are
//! assumed by the peer, so a mismatch shows up as a protocol violation. The others are local
//! policy. Tests shrink the knobs to reach the interesting states quickly.

use std::time::Duration;

use crate::proto::frame::MAX_DATA_LEN;

/// Which end of the uplink this link is.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum End {
    /// The gateway end: it opens channels.
    Gateway,
    /// The worker end: it accepts channels by id.
    Worker,
}

impl End {
    /// The other end.
    pub fn peer(self) -> Self {
        match self {
            Self::Gateway => Self::Worker,
            Self::Worker => Self::Gateway,
        }
    }
}

/// Credit each direction starts with: 256 KiB, the yamux and muxado default; it bounds what a
/// reader that never reads can hold, and on loopback it does not limit throughput.
pub const INITIAL_WINDOW: u32 = 256 * 1024;

/// Largest window a direction may grow to: 16 MiB covers a 1.3 Gbit/s path at 100 ms RTT.
pub const MAX_WINDOW: u32 = 16 * 1024 * 1024;

/// Receive budget of one link: the windows of all its channels together stay under 32 MiB, so a
/// worker's memory per uplink is bounded whatever its peer does.
pub const RECEIVE_BUDGET: u64 = 32 * 1024 * 1024;

/// Channels open at once per link (the design's limit); a 65th open waits for a slot.
pub const MAX_OPEN_CHANNELS: usize = 64;

/// Channel ids one end may hold, open or in their closing handshake: 64 open plus 64 waiting one
/// round trip for the peer's RELEASE. It bounds the state a slow or hostile peer can pin.
pub const MAX_CHANNEL_ENTRIES: usize = 128;

/// How long an opened channel may wait for the worker to accept it (the design's 30 s) before
/// the worker aborts it as refused.
pub const ACCEPT_TIMEOUT: Duration = Duration::from_secs(30);

/// How long a writer may hold data without getting credit (the design's 60 s) before it fails
/// stalled and the channel is aborted.
pub const STALL_TIMEOUT: Duration = Duration::from_secs(60);

/// Interval between PINGs: 5 s, so three missed PINGs see a dead uplink within 15 s.
pub const PING_INTERVAL: Duration = Duration::from_secs(5);

/// PINGs that may go unanswered before the link is declared dead (the design's three).
pub const MAX_MISSED_PINGS: u32 = 3;

/// Bytes a writer may queue in the link ahead of the socket: one initial window, so a writer
/// that gets a full grant has it ready to send while the application refills.
pub const SEND_BUFFER: usize = 256 * 1024;

/// Bytes of outgoing text the priority lane queues before `send_text` waits: a bounded queue of
/// small wire frames that is never the bottleneck.
pub const TEXT_SEND_BUFFER: usize = 1024 * 1024;

/// Bytes of incoming text held for the application before the driver stops reading the socket.
pub const TEXT_RECEIVE_BUFFER: usize = 1024 * 1024;

/// The least a reader must be behind, with its peer out of credit, for its waiting payloads to
/// be copied out of the transport's read buffers: four full DATA frames (see `proto::rxbuf`).
pub const COMPACT_AFTER: usize = 64 * 1024;

/// The link's configuration. Build it with [`LinkConfig::new`] and adjust the public fields.
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct LinkConfig {
    /// Which end this is.
    pub end: End,
    /// Credit each direction starts with (protocol). Default [`INITIAL_WINDOW`].
    pub initial_window: u32,
    /// Largest window a direction may grow to (protocol). Default [`MAX_WINDOW`].
    pub max_window: u32,
    /// Sum of all receive windows of this link. Default [`RECEIVE_BUDGET`].
    pub receive_budget: u64,
    /// Whether windows grow toward the bandwidth-delay product. Default `true`.
    pub grow_windows: bool,
    /// Largest DATA payload this end sends, at most 16 KiB. Default 16 KiB.
    pub max_data_frame: usize,
    /// Channels open at once (protocol). Default [`MAX_OPEN_CHANNELS`].
    pub max_open_channels: usize,
    /// Channel ids held at once, open or closing (protocol). Default [`MAX_CHANNEL_ENTRIES`].
    pub max_channel_entries: usize,
    /// How long an opened channel waits to be accepted. Default [`ACCEPT_TIMEOUT`].
    pub accept_timeout: Duration,
    /// How long a writer may hold data without credit. Default [`STALL_TIMEOUT`].
    pub stall_timeout: Duration,
    /// Interval between PINGs. Default [`PING_INTERVAL`].
    pub ping_interval: Duration,
    /// Unanswered PINGs that close the link. Default [`MAX_MISSED_PINGS`].
    pub max_missed_pings: u32,
    /// Bytes a writer may queue ahead of the socket. Default [`SEND_BUFFER`].
    pub send_buffer: usize,
    /// Bytes of outgoing text queued before `send_text` waits. Default [`TEXT_SEND_BUFFER`].
    pub text_send_buffer: usize,
    /// Bytes of incoming text held before reading pauses. Default [`TEXT_RECEIVE_BUFFER`].
    pub text_receive_buffer: usize,
    /// Bytes waiting for a reader whose peer is out of credit before they are compacted.
    /// Default [`COMPACT_AFTER`].
    pub compact_after: usize,
}

impl LinkConfig {
    /// The design's defaults for `end`.
    pub fn new(end: End) -> Self {
        Self {
            end,
            initial_window: INITIAL_WINDOW,
            max_window: MAX_WINDOW,
            receive_budget: RECEIVE_BUDGET,
            grow_windows: true,
            max_data_frame: MAX_DATA_LEN,
            max_open_channels: MAX_OPEN_CHANNELS,
            max_channel_entries: MAX_CHANNEL_ENTRIES,
            accept_timeout: ACCEPT_TIMEOUT,
            stall_timeout: STALL_TIMEOUT,
            ping_interval: PING_INTERVAL,
            max_missed_pings: MAX_MISSED_PINGS,
            send_buffer: SEND_BUFFER,
            text_send_buffer: TEXT_SEND_BUFFER,
            text_receive_buffer: TEXT_RECEIVE_BUFFER,
            compact_after: COMPACT_AFTER,
        }
    }

    /// The same configuration for the other end (for tests building both ends of a pair).
    pub fn for_peer(&self) -> Self {
        Self {
            end: self.end.peer(),
            ..self.clone()
        }
    }

    /// The configuration with every knob clamped into the range the link can work with.
    pub(crate) fn sanitized(mut self) -> Self {
        self.max_data_frame = self.max_data_frame.clamp(1, MAX_DATA_LEN);
        self.initial_window = self.initial_window.max(1);
        self.max_window = self.max_window.max(self.initial_window);
        self.max_open_channels = self.max_open_channels.max(1);
        self.max_channel_entries = self.max_channel_entries.max(self.max_open_channels);
        self.max_missed_pings = self.max_missed_pings.max(1);
        self.send_buffer = self.send_buffer.max(1);
        self.text_send_buffer = self.text_send_buffer.max(1);
        self.text_receive_buffer = self.text_receive_buffer.max(1);
        // A ping interval past a day would only ever be a mistake; bounding it keeps every
        // deadline computable.
        self.ping_interval = self
            .ping_interval
            .clamp(Duration::from_millis(1), Duration::from_secs(24 * 3600));
        self
    }
}
