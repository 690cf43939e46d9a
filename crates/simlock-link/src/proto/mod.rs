//! The sans-IO link: all protocol state and decisions, with no sockets, no clocks and no tasks.
//!
//! A [`Link`] never touches a socket or reads the time. It is fed:
//! - incoming messages: [`Link::handle_frame`] (binary) and [`Link::handle_text`] (text), and the
//!   end of the transport with [`Link::handle_transport_closed`];
//! - the passing of time: [`Link::handle_timeout`];
//! - application commands: [`Link::open`], [`Link::accept`], [`Link::write`], [`Link::read`],
//!   [`Link::finish`], [`Link::stop`], [`Link::abort`], [`Link::send_text`], [`Link::close`].
//!
//! It yields, when polled:
//! - messages to send, in priority order: [`Link::poll_transmit`];
//! - things the application should learn: [`Link::poll_event`];
//! - when it next needs [`Link::handle_timeout`]: [`Link::poll_timeout`].
//!
//! Call order for a driver: feed what arrived, then `handle_timeout` if the deadline passed, then
//! drain `poll_transmit` while the socket takes messages, then drain `poll_event`, then sleep
//! until `poll_timeout` or the next message. Every input takes `now`; nothing else tells the
//! link the time, so tests drive it with a virtual clock.
//!
//! Maps are `BTreeMap`s and queues `VecDeque`s, so the link is deterministic: the same inputs
//! give the same outputs.

mod chan;
pub mod frame;
mod rxbuf;

use std::{
    collections::{BTreeMap, VecDeque},
    time::{Duration, Instant},
};

use bytes::{BufMut, Bytes, BytesMut};

use self::{
    chan::{Chan, Chunk, Rx, Tx, WriterWait},
    frame::{ChannelId, EncodedData, Frame},
};
pub use crate::{
    config::{End, LinkConfig},
    error::{ChannelError, CloseReason, FailureReason, LinkError},
};

/// How much of the scratch buffer frames are encoded into is reserved at a time: frames are split
/// off it, so one allocation serves many frames.
const SCRATCH_CHUNK: usize = 256 * 1024;

/// PING nonces remembered for RTT samples: one more than the pings that may go unanswered.
const PINGS_REMEMBERED: usize = 8;

/// A window doubles when its last half was consumed within this many RTTs: the window, not the
/// reader, limits the transfer (the yamux auto-tuning rule).
const GROWTH_RTTS: u32 = 2;

/// An opaque handle to one channel inside one [`Link`]. Unlike a [`ChannelId`], it is never reused.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct ChannelKey(u64);

/// A place in the FIFO of channel opens waiting for a slot.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct OpenTicket(u64);

/// A message for the driver to send.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Transmit {
    /// A text WebSocket message (a wire frame from the priority lane).
    Text(String),
    /// A binary WebSocket message: one encoded link frame.
    Frame(Bytes),
    /// Close the WebSocket, then stop. Always the last transmit.
    Close(CloseReason),
}

/// Something the application should learn.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Event {
    /// The open with this ticket has a channel (or failed): call [`Link::take_opened`].
    OpenReady(OpenTicket),
    /// The peer opened a channel; it waits for [`Link::accept`].
    Incoming(ChannelId),
    /// A waiting reader can make progress (bytes, end of stream, or failure).
    Readable(ChannelKey),
    /// A waiting writer can make progress (room, drained, finished, or failure).
    Writable(ChannelKey),
    /// A text message arrived.
    Text(String),
    /// The text lane has room again (or the link closed).
    TextWritable,
    /// The link closed.
    Closed(CloseReason),
}

/// The result of [`Link::read`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Read {
    /// Bytes, in order.
    Data(Bytes),
    /// Clean end of stream: the writer finished.
    End,
    /// Nothing yet; a [`Event::Readable`] follows when there is.
    Blocked,
}

/// Why [`Link::send_text`] did not take a message.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum SendTextError {
    /// The text lane is full; the message is handed back. [`Event::TextWritable`] follows.
    Full(String),
    /// The link is closed.
    Closed(LinkError),
}

/// A snapshot of a link's counters.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct LinkStats {
    /// Channels open: at the gateway, the slots in use; at the worker, channels with a direction
    /// still going.
    pub open_channels: usize,
    /// Channel ids held, including those waiting for the peer's RELEASE.
    pub channel_entries: usize,
    /// Channels opened on this link since it started (by this end at the gateway, by the peer
    /// at the worker).
    pub channels_opened: u64,
    /// Channels the link keeps any state for (open, closing, or still held by the application).
    pub channel_states: usize,
    /// DATA payload bytes sent.
    pub bytes_sent: u64,
    /// DATA payload bytes received.
    pub bytes_received: u64,
    /// Bytes received and not yet read by the application, over all channels.
    pub recv_buffered: u64,
    /// Bytes written by the application and not yet sent, over all channels.
    pub send_buffered: u64,
    /// The largest `recv_buffered` of any one channel.
    pub max_channel_recv_buffered: u64,
    /// Times a writer with queued data ran out of credit.
    pub credit_stalls: u64,
    /// Sum of the receive windows of the directions still receiving.
    pub receive_windows: u64,
    /// Link frames sent and received.
    pub frames_sent: u64,
    /// Link frames received.
    pub frames_received: u64,
    /// Text messages sent.
    pub texts_sent: u64,
    /// Text messages received.
    pub texts_received: u64,
    /// Bytes of text waiting in the priority lane.
    pub text_queued: u64,
    /// Smoothed round-trip time from PING/PONG, once measured.
    pub rtt: Option<Duration>,
    /// The smallest PING/PONG round trip measured: the path's delay without queueing.
    pub min_rtt: Option<Duration>,
    /// The socket receive buffer (`SO_RCVBUF`) the driver set for that round trip; `None` while
    /// the kernel tunes it (not measured yet, a long path, or not a TCP socket).
    pub receive_buffer: Option<usize>,
}

/// Cumulative counters.
#[derive(Clone, Debug, Default)]
struct Counters {
    channels_opened: u64,
    bytes_sent: u64,
    bytes_received: u64,
    credit_stalls: u64,
    frames_sent: u64,
    frames_received: u64,
    texts_sent: u64,
    texts_received: u64,
}

/// One end of a link: the whole protocol state machine. See the module docs for the call order.
pub struct Link {
    config: LinkConfig,
    channels: BTreeMap<ChannelKey, Chan>,
    ids: BTreeMap<ChannelId, ChannelKey>,
    next_key: u64,
    next_id: u64,
    /// Opens waiting for a slot, oldest first.
    open_queue: VecDeque<OpenTicket>,
    /// Opens given a channel and not yet taken.
    opened: BTreeMap<OpenTicket, ChannelKey>,
    next_ticket: u64,
    /// Slots in use at the opener.
    slots_used: usize,
    /// Channels with control frames to send, in the order they asked.
    control: VecDeque<ChannelKey>,
    /// Channels with data and credit, round-robin.
    data: VecDeque<ChannelKey>,
    text_out: VecDeque<String>,
    text_out_bytes: usize,
    text_waits: bool,
    pending_ping: Option<u64>,
    pending_pong: Option<u64>,
    next_ping_nonce: u64,
    next_ping_at: Instant,
    pings_out: VecDeque<(u64, Instant)>,
    /// PINGs sent since anything was last received.
    pings_unanswered: u32,
    /// When something last arrived, or reading last resumed (silence is counted from then).
    last_rx: Instant,
    /// When the peer last sent anything (a frame or a text), or the link's start.
    last_heard: Instant,
    reading_paused: bool,
    srtt: Option<Duration>,
    min_rtt: Option<Duration>,
    /// Channels the peer aborted before this end accepted them, oldest first, each with why and
    /// until when `accept` still answers with that reason. The text naming such a channel may be
    /// read after the ABORT was handled; it must learn the abort, not "never opened".
    aborted_unaccepted: VecDeque<(ChannelId, FailureReason, Instant)>,
    closed: Option<CloseReason>,
    close_transmit: Option<CloseReason>,
    events: VecDeque<Event>,
    counters: Counters,
    scratch: BytesMut,
}

impl std::fmt::Debug for Link {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Link")
            .field("end", &self.config.end)
            .field("closed", &self.closed)
            .field("slots_used", &self.slots_used)
            .field("ids", &self.ids)
            .field("channels", &self.channels)
            .field("open_queue", &self.open_queue)
            .field("text_out_bytes", &self.text_out_bytes)
            .field("pings_unanswered", &self.pings_unanswered)
            .field("srtt", &self.srtt)
            .field("min_rtt", &self.min_rtt)
            .finish_non_exhaustive()
    }
}

// === impl Link: construction and queries ===

impl Link {
    /// A new link for `config.end`, created at `now`. The first PING goes at once so an RTT
    /// sample is ready early.
    pub fn new(config: LinkConfig, now: Instant) -> Self {
        Self {
            config: config.sanitized(),
            channels: BTreeMap::new(),
            ids: BTreeMap::new(),
            next_key: 0,
            next_id: 0,
            open_queue: VecDeque::new(),
            opened: BTreeMap::new(),
            next_ticket: 0,
            slots_used: 0,
            control: VecDeque::new(),
            data: VecDeque::new(),
            text_out: VecDeque::new(),
            text_out_bytes: 0,
            text_waits: false,
            pending_ping: None,
            pending_pong: None,
            next_ping_nonce: 0,
            next_ping_at: now,
            pings_out: VecDeque::new(),
            pings_unanswered: 0,
            aborted_unaccepted: VecDeque::new(),
            last_rx: now,
            last_heard: now,
            reading_paused: false,
            srtt: None,
            min_rtt: None,
            closed: None,
            close_transmit: None,
            events: VecDeque::new(),
            counters: Counters::default(),
            scratch: BytesMut::new(),
        }
    }

    /// The smallest PING/PONG round trip measured so far: the path's delay without the queueing
    /// that inflates the smoothed RTT under load.
    pub fn min_rtt(&self) -> Option<Duration> {
        self.min_rtt
    }

    /// When the peer last sent anything (a frame or a text); the link's start before it sent
    /// anything. Unlike the silence the PING timer counts, a pause of reading does not move it.
    pub fn last_heard(&self) -> Instant {
        self.last_heard
    }

    /// Which end this is.
    pub fn end(&self) -> End {
        self.config.end
    }

    /// The configuration in force.
    pub fn config(&self) -> &LinkConfig {
        &self.config
    }

    /// Why the link closed, once it has.
    pub fn close_reason(&self) -> Option<&CloseReason> {
        self.closed.as_ref()
    }

    /// The id of a channel.
    pub fn channel_id(&self, key: ChannelKey) -> Option<ChannelId> {
        self.channels.get(&key).map(|ch| ch.id)
    }

    /// Whether [`poll_transmit`](Self::poll_transmit) may have something to send.
    pub fn has_transmit(&self) -> bool {
        if self.closed.is_some() {
            return self.pending_ping.is_some()
                || !self.text_out.is_empty()
                || self.close_transmit.is_some();
        }
        self.pending_pong.is_some()
            || self.pending_ping.is_some()
            || !self.control.is_empty()
            || !self.text_out.is_empty()
            || !self.data.is_empty()
    }

    /// The link is closed and every message it had to send was taken.
    pub fn is_drained(&self) -> bool {
        self.closed.is_some()
            && self.pending_ping.is_none()
            && self.text_out.is_empty()
            && self.close_transmit.is_none()
    }

    /// A snapshot of the counters.
    pub fn stats(&self) -> LinkStats {
        let c = &self.counters;
        let mut stats = LinkStats {
            channel_entries: self.ids.len(),
            channel_states: self.channels.len(),
            channels_opened: c.channels_opened,
            bytes_sent: c.bytes_sent,
            bytes_received: c.bytes_received,
            credit_stalls: c.credit_stalls,
            frames_sent: c.frames_sent,
            frames_received: c.frames_received,
            texts_sent: c.texts_sent,
            texts_received: c.texts_received,
            text_queued: self.text_out_bytes as u64,
            rtt: self.srtt,
            min_rtt: self.min_rtt,
            ..LinkStats::default()
        };
        for ch in self.channels.values() {
            stats.open_channels += usize::from(ch.holds_slot);
            stats.recv_buffered += ch.rx_buf.len() as u64;
            stats.max_channel_recv_buffered =
                stats.max_channel_recv_buffered.max(ch.rx_buf.len() as u64);
            stats.send_buffered += ch.tx_queued as u64;
            if ch.rx == Rx::Open {
                stats.receive_windows += ch.rx_window;
            }
        }
        stats
    }

    /// Bytes buffered for the reader of one channel, and bytes received after this end stopped it.
    pub fn channel_buffered(&self, key: ChannelKey) -> Option<(usize, u64)> {
        self.channels
            .get(&key)
            .map(|ch| (ch.rx_buf.len(), ch.rx_after_stop))
    }

    /// The current receive window of one channel.
    pub fn channel_window(&self, key: ChannelKey) -> Option<u64> {
        self.channels.get(&key).map(|ch| ch.rx_window)
    }

    /// The next event for the application.
    pub fn poll_event(&mut self) -> Option<Event> {
        self.events.pop_front()
    }

    /// When [`handle_timeout`](Self::handle_timeout) must next be called (none once closed).
    pub fn poll_timeout(&self) -> Option<Instant> {
        if self.closed.is_some() {
            return None;
        }
        let mut next = self.next_ping_at;
        if let Some(dead) = self.dead_at() {
            next = next.min(dead);
        }
        for ch in self.channels.values() {
            if let Some(at) = ch.accept_deadline {
                next = next.min(at);
            }
            if let Some(at) = ch
                .tx_blocked_since
                .and_then(|since| since.checked_add(self.config.stall_timeout))
            {
                next = next.min(at);
            }
        }
        Some(next)
    }

    /// When the link is declared dead: once enough PINGs went unanswered, that many intervals
    /// after the last thing received. `None` while fewer PINGs are out (the next PING re-checks).
    fn dead_at(&self) -> Option<Instant> {
        if self.reading_paused || self.pings_unanswered < self.config.max_missed_pings {
            return None;
        }
        let silence = self
            .config
            .ping_interval
            .checked_mul(self.config.max_missed_pings)?;
        self.last_rx.checked_add(silence)
    }
}

// === impl Link: inputs from the network and the clock ===

impl Link {
    /// A binary WebSocket message arrived.
    pub fn handle_frame(&mut self, now: Instant, message: Bytes) {
        if self.closed.is_some() {
            return;
        }
        self.last_rx = now;
        self.last_heard = now;
        self.pings_unanswered = 0;
        self.counters.frames_received += 1;
        let frame = match Frame::decode(&message) {
            Ok(frame) => frame,
            Err(error) => return self.violation(format!("malformed frame: {error}")),
        };
        tracing::trace!(end = ?self.config.end, kind = %frame.kind(), channel = ?frame.channel(), "link frame in");
        match frame {
            Frame::Ping { nonce } => self.pending_pong = Some(nonce),
            Frame::Pong { nonce } => self.on_pong(now, nonce),
            Frame::Open { id } => self.on_open(now, id),
            Frame::Data { id, payload } => {
                self.on_channel_frame(now, id, ChannelFrame::Data(payload))
            }
            Frame::Credit { id, amount } => {
                self.on_channel_frame(now, id, ChannelFrame::Credit(amount));
            }
            Frame::End { id } => self.on_channel_frame(now, id, ChannelFrame::End),
            Frame::Stop { id } => self.on_channel_frame(now, id, ChannelFrame::Stop),
            Frame::Abort { id, reason } => {
                self.on_channel_frame(now, id, ChannelFrame::Abort(reason));
            }
            Frame::Release { id } => self.on_channel_frame(now, id, ChannelFrame::Release),
        }
        self.debug_check();
    }

    /// A text WebSocket message arrived: it goes to the application as [`Event::Text`].
    pub fn handle_text(&mut self, now: Instant, text: String) {
        if self.closed.is_some() {
            return;
        }
        self.last_rx = now;
        self.last_heard = now;
        self.pings_unanswered = 0;
        self.counters.texts_received += 1;
        self.events.push_back(Event::Text(text));
    }

    /// The transport ended (peer close, socket error): every channel fails `closed`.
    pub fn handle_transport_closed(&mut self, reason: CloseReason) {
        self.close_with(reason, false);
    }

    /// Time passed: PINGs, dead-link detection, accept and stall timeouts.
    pub fn handle_timeout(&mut self, now: Instant) {
        if self.closed.is_some() {
            return;
        }
        if now >= self.next_ping_at {
            self.pending_ping = Some(self.next_ping_nonce);
            self.next_ping_nonce = self.next_ping_nonce.wrapping_add(1);
            self.pings_unanswered = self.pings_unanswered.saturating_add(1);
            self.next_ping_at = now.checked_add(self.config.ping_interval).unwrap_or(now);
        }
        if self.dead_at().is_some_and(|dead| now >= dead) {
            tracing::warn!(end = ?self.config.end, missed = self.pings_unanswered, "link peer unresponsive; closing");
            self.close_with(CloseReason::Unresponsive, true);
            return;
        }
        let stall = self.config.stall_timeout;
        let mut expired = Vec::new();
        for (&key, ch) in &self.channels {
            if ch.accept_deadline.is_some_and(|at| now >= at) {
                expired.push((key, FailureReason::Refused));
            } else if ch
                .tx_blocked_since
                .and_then(|since| since.checked_add(stall))
                .is_some_and(|at| now >= at)
            {
                expired.push((key, FailureReason::Stalled));
            }
        }
        for (key, reason) in expired {
            if let Some(ch) = self.channels.get_mut(&key) {
                tracing::debug!(end = ?self.config.end, channel = %ch.id, %reason, "link channel timed out; aborting");
                ch.accept_deadline = None;
                ch.fail(reason);
                if !ch.released {
                    ch.released = true;
                    ch.ctl_abort = Some(reason);
                }
            }
            self.settle(now, key);
        }
        self.debug_check();
    }

    /// Tells the link the driver stopped reading the socket because the application is slow to
    /// take text (or resumed). While paused, silence from the peer is not held against it.
    pub fn set_reading_paused(&mut self, now: Instant, paused: bool) {
        if self.reading_paused && !paused {
            self.last_rx = now;
            self.pings_unanswered = 0;
        }
        self.reading_paused = paused;
    }
}

/// A frame about one channel, without its id.
enum ChannelFrame {
    Data(Bytes),
    Credit(u32),
    End,
    Stop,
    Abort(FailureReason),
    Release,
}

impl ChannelFrame {
    fn name(&self) -> &'static str {
        match self {
            Self::Data(_) => "DATA",
            Self::Credit(_) => "CREDIT",
            Self::End => "END",
            Self::Stop => "STOP",
            Self::Abort(_) => "ABORT",
            Self::Release => "RELEASE",
        }
    }
}

impl Link {
    fn on_pong(&mut self, now: Instant, nonce: u64) {
        let Some(pos) = self.pings_out.iter().position(|&(n, _)| n == nonce) else {
            return;
        };
        let sent = self.pings_out[pos].1;
        self.pings_out.drain(..=pos);
        let sample = now.saturating_duration_since(sent);
        self.srtt = Some(match self.srtt {
            None => sample,
            Some(srtt) => (srtt * 7 + sample) / 8,
        });
        self.min_rtt = Some(self.min_rtt.map_or(sample, |min| min.min(sample)));
    }

    fn on_open(&mut self, now: Instant, id: ChannelId) {
        if self.config.end == End::Gateway {
            return self.violation(format!("OPEN {id} from the worker end"));
        }
        if self.ids.contains_key(&id) {
            return self.violation(format!("OPEN {id}: channel already open"));
        }
        if self.ids.len() >= self.config.max_channel_entries {
            return self.violation(format!(
                "OPEN {id}: more than {} channels",
                self.config.max_channel_entries
            ));
        }
        let key = self.new_key();
        let mut ch = Chan::new(id, false, self.config.initial_window, now);
        ch.accept_deadline = now.checked_add(self.config.accept_timeout);
        self.channels.insert(key, ch);
        self.ids.insert(id, key);
        self.counters.channels_opened += 1;
        tracing::debug!(end = ?self.config.end, channel = %id, "link channel opened by peer");
        self.events.push_back(Event::Incoming(id));
    }

    fn on_channel_frame(&mut self, now: Instant, id: ChannelId, frame: ChannelFrame) {
        let Some(&key) = self.ids.get(&id) else {
            return self.violation(format!("{} for channel {id}, never opened", frame.name()));
        };
        let result = match self.channels.get_mut(&key) {
            Some(ch) => {
                let early_abort = match frame {
                    ChannelFrame::Abort(reason) if !ch.opener && !ch.accepted && !ch.released => {
                        Some(reason)
                    }
                    _ => None,
                };
                apply_channel_frame(ch, frame, &self.config, &mut self.counters)
                    .map(|()| early_abort)
            }
            None => Err(format!("{} for channel {id}: no state", frame.name())),
        };
        match result {
            Ok(early_abort) => {
                if let Some(reason) = early_abort {
                    self.remember_abort(now, id, reason);
                }
                self.settle(now, key);
            }
            Err(what) => self.violation(what),
        }
    }

    /// Keeps, for the accept timeout, why the peer aborted a channel this end had not accepted
    /// yet. At most `max_channel_entries` are kept; the oldest go first.
    fn remember_abort(&mut self, now: Instant, id: ChannelId, reason: FailureReason) {
        self.forget_expired_aborts(now);
        while self.aborted_unaccepted.len() >= self.config.max_channel_entries {
            self.aborted_unaccepted.pop_front();
        }
        if let Some(until) = now.checked_add(self.config.accept_timeout) {
            self.aborted_unaccepted.push_back((id, reason, until));
        }
    }

    fn forget_expired_aborts(&mut self, now: Instant) {
        while self
            .aborted_unaccepted
            .front()
            .is_some_and(|&(.., until)| now >= until)
        {
            self.aborted_unaccepted.pop_front();
        }
    }

    fn violation(&mut self, what: String) {
        tracing::warn!(end = ?self.config.end, violation = %what, "link protocol violation; closing");
        self.close_with(CloseReason::Violation(what), true);
    }
}

/// Applies one frame from the peer to a channel, or names the violation it is.
fn apply_channel_frame(
    ch: &mut Chan,
    frame: ChannelFrame,
    config: &LinkConfig,
    counters: &mut Counters,
) -> Result<(), String> {
    let max_window = u64::from(config.max_window);
    let end = config.end;
    let compact_after = config.compact_after;
    let id = ch.id;
    if ch.peer_released {
        return Err(format!(
            "{} for channel {id} after the peer released it",
            frame.name()
        ));
    }
    match frame {
        ChannelFrame::Data(payload) => {
            if ch.end_received {
                return Err(format!("DATA for channel {id} after END"));
            }
            let len = payload.len() as u64;
            if ch.rx_received + len > ch.rx_limit {
                return Err(format!(
                    "DATA for channel {id} beyond credit: {} bytes allowed, {} sent",
                    ch.rx_limit,
                    ch.rx_received + len
                ));
            }
            ch.rx_received += len;
            counters.bytes_received += len;
            if ch.rx == Rx::Open {
                let room = usize::try_from(ch.rx_limit - ch.rx_received).unwrap_or(usize::MAX);
                ch.rx_buf.push(payload, room, compact_after);
            } else {
                // Late bytes after this end stopped or aborted: within credit, dropped.
                ch.rx_consumed += len;
                if ch.rx == Rx::Stopped {
                    ch.rx_after_stop += len;
                }
            }
        }
        ChannelFrame::Credit(amount) => {
            if ch.stop_received {
                return Err(format!("CREDIT for channel {id} after STOP"));
            }
            let limit = ch.tx_limit + u64::from(amount);
            if limit - ch.tx_sent > max_window {
                return Err(format!(
                    "CREDIT for channel {id} overflows the window: {} bytes outstanding",
                    limit - ch.tx_sent
                ));
            }
            ch.tx_limit = limit;
        }
        ChannelFrame::End => {
            if ch.end_received {
                return Err(format!("second END for channel {id}"));
            }
            ch.end_received = true;
            ch.ctl_stop = false;
            ch.ctl_credit = 0;
            if ch.rx == Rx::Open {
                ch.rx = Rx::Ended;
            }
        }
        ChannelFrame::Stop => {
            if ch.stop_received {
                return Err(format!("second STOP for channel {id}"));
            }
            ch.stop_received = true;
            if matches!(ch.tx, Tx::Open | Tx::Finishing) {
                ch.tx = Tx::Stopped;
                ch.discard_tx();
            }
        }
        ChannelFrame::Abort(reason) => {
            tracing::debug!(?end, channel = %id, %reason, "link channel aborted by peer");
            ch.peer_released = true;
            ch.accept_deadline = None;
            ch.fail(reason);
            if !ch.released {
                ch.released = true;
                ch.ctl_release = true;
            }
        }
        ChannelFrame::Release => {
            let inbound_over = ch.end_received || ch.stop_sent || ch.abort_sent;
            let outbound_over = ch.end_sent || ch.stop_received || ch.abort_sent;
            if !(inbound_over && outbound_over) {
                return Err(format!(
                    "RELEASE for channel {id} while a direction is still open"
                ));
            }
            ch.peer_released = true;
        }
    }
    Ok(())
}

// === impl Link: application commands ===

impl Link {
    /// Asks for a new channel (gateway end). The open waits FIFO for a slot;
    /// [`Event::OpenReady`] tells when [`take_opened`](Self::take_opened) has the answer. At the
    /// worker end, or once closed, the answer is ready at once and is an error.
    pub fn open(&mut self, now: Instant) -> OpenTicket {
        let ticket = OpenTicket(self.next_ticket);
        self.next_ticket += 1;
        self.open_queue.push_back(ticket);
        if self.config.end == End::Worker || self.closed.is_some() {
            self.events.push_back(Event::OpenReady(ticket));
        } else {
            self.assign_slots(now);
        }
        self.debug_check();
        ticket
    }

    /// The channel for an open, once it has one. `None` while it waits.
    ///
    /// # Errors
    /// `refused` at the worker end (only the gateway opens); `closed` once the link is closed.
    pub fn take_opened(&mut self, ticket: OpenTicket) -> Option<Result<ChannelKey, ChannelError>> {
        if let Some(key) = self.opened.remove(&ticket) {
            return Some(Ok(key));
        }
        if !self.open_queue.contains(&ticket) {
            // Unknown or cancelled ticket.
            return Some(Err(ChannelError::new(FailureReason::Closed)));
        }
        if self.config.end == End::Worker {
            self.open_queue.retain(|&t| t != ticket);
            return Some(Err(ChannelError::new(FailureReason::Refused)));
        }
        if self.closed.is_some() {
            self.open_queue.retain(|&t| t != ticket);
            return Some(Err(ChannelError::new(FailureReason::Closed)));
        }
        None
    }

    /// Gives up an open: it leaves the queue at once. If it already had a channel that was not
    /// taken, that channel is dropped (never announced, or aborted if it was).
    pub fn cancel_open(&mut self, now: Instant, ticket: OpenTicket) {
        self.open_queue.retain(|&t| t != ticket);
        if let Some(key) = self.opened.remove(&ticket) {
            self.abort(now, key);
            self.detach_reader(now, key);
            self.detach_writer(now, key);
        }
        self.assign_slots(now);
        self.debug_check();
    }

    /// Accepts the channel the gateway opened as `id` (worker end).
    ///
    /// # Errors
    /// `refused` if this is the gateway end, `id` is malformed, was never opened, is no longer
    /// known, or was already accepted; `closed` if the link is closed. A channel the peer
    /// aborted before this end accepted it answers with the abort's reason (`aborted`, or the
    /// peer's) once, for the accept timeout after the ABORT: the text that names a channel may
    /// be read after its ABORT was handled.
    pub fn accept(&mut self, now: Instant, id: &str) -> Result<ChannelKey, ChannelError> {
        let refused = ChannelError::new(FailureReason::Refused);
        if self.closed.is_some() {
            return Err(ChannelError::new(FailureReason::Closed));
        }
        if self.config.end != End::Worker {
            return Err(refused);
        }
        let id = ChannelId::new(id).map_err(|_| refused.clone())?;
        self.forget_expired_aborts(now);
        let early = self
            .aborted_unaccepted
            .iter()
            .position(|&(aborted, ..)| aborted == id);
        if let Some((_, reason, _)) = early.and_then(|at| self.aborted_unaccepted.remove(at)) {
            return Err(ChannelError::on(reason, id));
        }
        let refused = ChannelError::on(FailureReason::Refused, id);
        let &key = self.ids.get(&id).ok_or_else(|| refused.clone())?;
        let ch = self.channels.get_mut(&key).ok_or_else(|| refused.clone())?;
        if ch.accepted || ch.released {
            return Err(refused);
        }
        ch.accepted = true;
        ch.accept_deadline = None;
        ch.reader = true;
        ch.writer = true;
        ch.rx_epoch = now;
        tracing::debug!(end = ?self.config.end, channel = %id, "link channel accepted");
        self.settle(now, key);
        self.debug_check();
        Ok(key)
    }

    /// Reads up to `max` bytes (at least one if any are buffered and `max > 0`).
    ///
    /// # Errors
    /// The channel's failure: `aborted`, `stalled`, `refused` or `closed`.
    pub fn read(
        &mut self,
        now: Instant,
        key: ChannelKey,
        max: usize,
    ) -> Result<Read, ChannelError> {
        let ch = self.chan(key)?;
        if let Rx::Failed(reason) = ch.rx {
            return Err(ChannelError::on(reason, ch.id));
        }
        let result = if let Some(chunk) = ch.rx_buf.take(max) {
            ch.rx_consumed += chunk.len() as u64;
            Read::Data(chunk)
        } else {
            match ch.rx {
                Rx::Open => {
                    ch.reader_waits = true;
                    Read::Blocked
                }
                Rx::Ended => {
                    ch.rx = Rx::Finished;
                    Read::End
                }
                Rx::Finished | Rx::Stopped | Rx::Failed(_) => Read::End,
            }
        };
        if matches!(result, Read::Data(_)) {
            self.maybe_grant(now, key);
        }
        self.settle(now, key);
        self.debug_check();
        Ok(result)
    }

    /// Room in the send queue: how many bytes [`write`](Self::write) would take now. When zero,
    /// a [`Event::Writable`] follows once there is room.
    ///
    /// # Errors
    /// The writer's failure: `stopped`, `aborted`, `stalled`, `refused` or `closed`.
    pub fn write_space(&mut self, key: ChannelKey) -> Result<usize, ChannelError> {
        let default = self.config.send_buffer;
        let ch = self.chan(key)?;
        check_tx(ch)?;
        let send_buffer = ch.send_buffer.unwrap_or(default);
        if !matches!(ch.tx, Tx::Open) {
            return Ok(0);
        }
        let space = send_buffer.saturating_sub(ch.tx_queued);
        if space == 0 {
            ch.writer_waits = Some(WriterWait::Space);
        }
        Ok(space)
    }

    /// Bounds this channel's queue of unsent bytes at `bytes` (at least 1) instead of the link's
    /// `send_buffer`: [`write_space`](Self::write_space) offers room only below it, and a waiting
    /// writer is woken once the queue is down to half of it.
    ///
    /// # Errors
    /// The writer's failure: `stopped`, `aborted`, `stalled`, `refused` or `closed`.
    pub fn set_send_buffer(
        &mut self,
        now: Instant,
        key: ChannelKey,
        bytes: usize,
    ) -> Result<(), ChannelError> {
        let ch = self.chan(key)?;
        check_tx(ch)?;
        ch.send_buffer = Some(bytes.max(1));
        self.settle(now, key);
        self.debug_check();
        Ok(())
    }

    /// Queues as much of `data` as there is room for; returns how much. Nothing is taken after
    /// [`finish`](Self::finish).
    ///
    /// # Errors
    /// The writer's failure: `stopped`, `aborted`, `stalled`, `refused` or `closed`.
    pub fn write(
        &mut self,
        now: Instant,
        key: ChannelKey,
        data: Bytes,
    ) -> Result<usize, ChannelError> {
        let space = self.write_space(key)?;
        let take = space.min(data.len());
        if take > 0 {
            let chunk = if take == data.len() {
                data
            } else {
                data.slice(..take)
            };
            self.enqueue(now, key, chunk);
        }
        self.debug_check();
        Ok(take)
    }

    /// Queues all of `data` even past the send buffer (a `Sink` that checked
    /// [`write_space`](Self::write_space) first overshoots by at most one item).
    ///
    /// # Errors
    /// The writer's failure: `stopped`, `aborted`, `stalled`, `refused` or `closed`.
    pub fn write_all(
        &mut self,
        now: Instant,
        key: ChannelKey,
        data: Bytes,
    ) -> Result<(), ChannelError> {
        let ch = self.chan(key)?;
        check_tx(ch)?;
        if matches!(ch.tx, Tx::Open) && !data.is_empty() {
            self.enqueue(now, key, data);
        }
        self.debug_check();
        Ok(())
    }

    /// Queues data already encoded as DATA frames for this channel (see [`EncodedData`]): it is
    /// sent without another copy. Like [`write_all`](Self::write_all), it may overshoot the
    /// send buffer by this one item.
    ///
    /// # Errors
    /// The writer's failure: `stopped`, `aborted`, `stalled`, `refused` or `closed`.
    pub fn write_encoded(
        &mut self,
        now: Instant,
        key: ChannelKey,
        data: EncodedData,
    ) -> Result<(), ChannelError> {
        let max_frame = self.config.max_data_frame;
        let ch = self.chan(key)?;
        check_tx(ch)?;
        if matches!(ch.tx, Tx::Open) && data.payload > 0 {
            if data.id == ch.id && data.frame_payload <= max_frame {
                ch.tx_queued += data.payload;
                ch.tx_queue.push_back(Chunk::Encoded {
                    header: frame::data_header_len(&data.id),
                    frames: data.frames,
                    frame_payload: data.frame_payload,
                    payload: data.payload,
                });
                self.settle(now, key);
            } else {
                // Encoded for another channel or frame size: send the payload as plain bytes.
                let header = frame::data_header_len(&data.id);
                let mut frames = data.frames;
                let mut payload = Vec::with_capacity(data.payload);
                while !frames.is_empty() {
                    let take = (header + data.frame_payload).min(frames.len());
                    payload.extend_from_slice(&frames.split_to(take)[header.min(take)..]);
                }
                self.enqueue(now, key, payload.into());
            }
        }
        self.debug_check();
        Ok(())
    }

    fn enqueue(&mut self, now: Instant, key: ChannelKey, data: Bytes) {
        if let Some(ch) = self.channels.get_mut(&key) {
            ch.tx_queued += data.len();
            ch.tx_queue.push_back(Chunk::Raw(data));
        }
        self.settle(now, key);
    }

    /// Whether everything written so far was sent. When not, a [`Event::Writable`] follows.
    ///
    /// # Errors
    /// The writer's failure.
    pub fn poll_drained(&mut self, key: ChannelKey) -> Result<bool, ChannelError> {
        let ch = self.chan(key)?;
        check_tx(ch)?;
        if ch.tx_queued == 0 {
            return Ok(true);
        }
        ch.writer_waits = Some(WriterWait::Drained);
        Ok(false)
    }

    /// Finishes the outgoing direction: END goes after the queued bytes.
    ///
    /// # Errors
    /// The writer's failure.
    pub fn finish(&mut self, now: Instant, key: ChannelKey) -> Result<(), ChannelError> {
        let ch = self.chan(key)?;
        check_tx(ch)?;
        if ch.tx == Tx::Open {
            ch.tx = Tx::Finishing;
            if ch.tx_queued == 0 {
                ch.ctl_end = true;
            }
        }
        self.settle(now, key);
        self.debug_check();
        Ok(())
    }

    /// Whether END was sent. When not, a [`Event::Writable`] follows.
    ///
    /// # Errors
    /// The writer's failure, including `stopped` when the peer stopped before END went.
    pub fn poll_finished(&mut self, key: ChannelKey) -> Result<bool, ChannelError> {
        let ch = self.chan(key)?;
        check_tx(ch)?;
        if ch.tx == Tx::Finished {
            return Ok(true);
        }
        ch.writer_waits = Some(WriterWait::Finished);
        Ok(false)
    }

    /// The reader wants no more of this direction: STOP goes to the peer, whose writer fails
    /// `stopped`; buffered and late bytes are dropped.
    pub fn stop(&mut self, now: Instant, key: ChannelKey) {
        if let Some(ch) = self.channels.get_mut(&key) {
            ch.stop_rx();
        }
        self.settle(now, key);
        self.debug_check();
    }

    /// Aborts the channel: both directions fail `aborted` here and at the peer.
    pub fn abort(&mut self, now: Instant, key: ChannelKey) {
        let Some(ch) = self.channels.get_mut(&key) else {
            return;
        };
        ch.fail(FailureReason::Aborted);
        if ch.opener && !ch.open_sent {
            // Never announced to the peer: forget it without a frame.
            ch.ctl_open = false;
            ch.released = true;
            ch.release_sent = true;
            ch.peer_released = true;
        } else if !ch.released {
            ch.released = true;
            ch.ctl_abort = Some(FailureReason::Aborted);
        }
        tracing::debug!(end = ?self.config.end, channel = %ch.id, "link channel aborted");
        self.settle(now, key);
        self.debug_check();
    }

    /// The application dropped the reading half: STOP unless the stream was read to its end.
    pub fn detach_reader(&mut self, now: Instant, key: ChannelKey) {
        if let Some(ch) = self.channels.get_mut(&key) {
            ch.reader = false;
            ch.reader_waits = false;
            ch.stop_rx();
        }
        self.settle(now, key);
        self.debug_check();
    }

    /// The application dropped the writing half: ABORT unless it finished.
    pub fn detach_writer(&mut self, now: Instant, key: ChannelKey) {
        let unfinished = match self.channels.get_mut(&key) {
            Some(ch) => {
                ch.writer = false;
                ch.writer_waits = None;
                ch.tx == Tx::Open
            }
            None => return,
        };
        if unfinished {
            self.abort(now, key);
        } else {
            self.settle(now, key);
        }
        self.debug_check();
    }

    /// Queues a text message on the priority lane.
    ///
    /// # Errors
    /// [`SendTextError::Full`] hands the message back when the lane holds its limit;
    /// [`SendTextError::Closed`] once the link is closed.
    pub fn send_text(&mut self, text: String) -> Result<(), SendTextError> {
        if let Some(reason) = &self.closed {
            return Err(SendTextError::Closed(LinkError::new(reason.clone())));
        }
        if self.text_out_bytes >= self.config.text_send_buffer {
            self.text_waits = true;
            return Err(SendTextError::Full(text));
        }
        self.text_out_bytes += text.len();
        self.text_out.push_back(text);
        Ok(())
    }

    /// Closes the link from this end: channels fail `closed`; queued text still goes, then the
    /// WebSocket close.
    pub fn close(&mut self) {
        self.close_with(CloseReason::Local, true);
    }

    /// [`Self::close`], telling the peer `why` in the close frame (cut to the frame's 123 bytes).
    pub fn close_because(&mut self, why: String) {
        self.close_with(CloseReason::LocalBecause(why), true);
    }

    fn chan(&mut self, key: ChannelKey) -> Result<&mut Chan, ChannelError> {
        let closed = self.closed.is_some();
        self.channels.get_mut(&key).ok_or_else(|| {
            ChannelError::new(if closed {
                FailureReason::Closed
            } else {
                FailureReason::Aborted
            })
        })
    }
}

fn check_tx(ch: &Chan) -> Result<(), ChannelError> {
    match ch.tx {
        Tx::Stopped => Err(ChannelError::on(FailureReason::Stopped, ch.id)),
        Tx::Failed(reason) => Err(ChannelError::on(reason, ch.id)),
        Tx::Open | Tx::Finishing | Tx::Finished => Ok(()),
    }
}

// === impl Link: output ===

impl Link {
    /// The next message to send: PONG and PING, then control frames (OPEN, ABORT, CREDIT, STOP,
    /// END, RELEASE), then text, then DATA round-robin, one frame per channel per turn.
    pub fn poll_transmit(&mut self, now: Instant) -> Option<Transmit> {
        if self.closed.is_some() {
            if let Some(nonce) = self.pending_ping.take() {
                // The last PING of an unresponsive link still goes, before the close.
                return Some(self.encode(&Frame::Ping { nonce }));
            }
            if let Some(text) = self.text_out.pop_front() {
                self.text_out_bytes -= text.len();
                self.counters.texts_sent += 1;
                return Some(Transmit::Text(text));
            }
            return self.close_transmit.take().map(Transmit::Close);
        }
        if let Some(nonce) = self.pending_pong.take() {
            return Some(self.encode(&Frame::Pong { nonce }));
        }
        if let Some(nonce) = self.pending_ping.take() {
            self.pings_out.push_back((nonce, now));
            while self.pings_out.len() > PINGS_REMEMBERED {
                self.pings_out.pop_front();
            }
            return Some(self.encode(&Frame::Ping { nonce }));
        }
        while let Some(&key) = self.control.front() {
            if let Some(frame) = self.next_control(now, key) {
                return Some(frame);
            }
            self.control.pop_front();
            if let Some(ch) = self.channels.get_mut(&key) {
                ch.in_control = false;
            }
        }
        if let Some(text) = self.text_out.pop_front() {
            self.text_out_bytes -= text.len();
            self.counters.texts_sent += 1;
            if self.text_waits && self.text_out_bytes < self.config.text_send_buffer {
                self.text_waits = false;
                self.events.push_back(Event::TextWritable);
            }
            return Some(Transmit::Text(text));
        }
        while let Some(key) = self.data.pop_front() {
            if let Some(frame) = self.next_data(now, key) {
                return Some(frame);
            }
        }
        None
    }

    fn next_control(&mut self, now: Instant, key: ChannelKey) -> Option<Transmit> {
        let ch = self.channels.get_mut(&key)?;
        let id = ch.id;
        let frame = if ch.ctl_open {
            ch.ctl_open = false;
            ch.open_sent = true;
            Frame::Open { id }
        } else if let Some(reason) = ch.ctl_abort.take() {
            ch.abort_sent = true;
            ch.release_sent = true;
            ch.ctl_release = false;
            Frame::Abort { id, reason }
        } else if ch.ctl_credit > 0 {
            let amount = u32::try_from(ch.ctl_credit).unwrap_or(u32::MAX);
            ch.ctl_credit -= u64::from(amount);
            Frame::Credit { id, amount }
        } else if ch.ctl_stop {
            ch.ctl_stop = false;
            ch.stop_sent = true;
            Frame::Stop { id }
        } else if ch.ctl_end {
            ch.ctl_end = false;
            ch.end_sent = true;
            ch.tx = Tx::Finished;
            Frame::End { id }
        } else if ch.ctl_release {
            ch.ctl_release = false;
            ch.release_sent = true;
            Frame::Release { id }
        } else {
            return None;
        };
        tracing::trace!(end = ?self.config.end, kind = %frame.kind(), channel = %id, "link frame out");
        let transmit = self.encode(&frame);
        self.settle(now, key);
        Some(transmit)
    }

    fn next_data(&mut self, now: Instant, key: ChannelKey) -> Option<Transmit> {
        let max_frame = self.config.max_data_frame;
        let ch = self.channels.get_mut(&key)?;
        ch.in_data = false;
        if !ch.can_send_data() {
            return None;
        }
        let credit = usize::try_from(ch.tx_credit()).unwrap_or(usize::MAX);
        let id = ch.id;
        let front = ch.tx_queue.front_mut()?;
        // A pre-encoded frame that fits the credit goes as is; anything else is framed here.
        let mut ready = None;
        let mut raw = None;
        let mut used_up = false;
        if let Chunk::Encoded {
            frames,
            header,
            frame_payload,
            payload,
        } = front
        {
            let first = (*frame_payload).min(*payload);
            let frame = frames.split_to((*header + first).min(frames.len()));
            *payload -= first;
            used_up = *payload == 0;
            if first <= credit {
                ready = Some((frame, first));
            } else {
                // Not enough credit for the whole frame: its payload goes back as plain bytes.
                raw = Some(frame.slice((*header).min(frame.len())..));
            }
        }
        if used_up {
            ch.tx_queue.pop_front();
        }
        if let Some(rest) = raw {
            ch.tx_queue.push_front(Chunk::Raw(rest));
        }
        let (bytes, take) = if let Some(ready) = ready {
            ready
        } else {
            let Some(Chunk::Raw(front)) = ch.tx_queue.front_mut() else {
                return None;
            };
            let take = front.len().min(max_frame).min(credit);
            let payload = if take == front.len() {
                match ch.tx_queue.pop_front() {
                    Some(Chunk::Raw(bytes)) => bytes,
                    _ => return None,
                }
            } else {
                front.split_to(take)
            };
            let scratch = &mut self.scratch;
            if scratch.capacity() - scratch.len() < 2 + frame::MAX_ID_LEN + take {
                scratch.reserve(SCRATCH_CHUNK.max(2 + frame::MAX_ID_LEN + take));
            }
            frame::put_data_header(scratch, &id);
            scratch.put_slice(&payload);
            (scratch.split().freeze(), take)
        };
        ch.tx_queued -= take;
        ch.tx_sent += take as u64;
        if ch.tx_queued == 0 && ch.tx == Tx::Finishing {
            ch.ctl_end = true;
        }
        self.counters.bytes_sent += take as u64;
        self.counters.frames_sent += 1;
        self.settle(now, key);
        Some(Transmit::Frame(bytes))
    }

    fn encode(&mut self, frame: &Frame) -> Transmit {
        self.counters.frames_sent += 1;
        if self.scratch.capacity() - self.scratch.len() < frame.encoded_len() {
            self.scratch.reserve(SCRATCH_CHUNK);
        }
        frame.encode(&mut self.scratch);
        Transmit::Frame(self.scratch.split().freeze())
    }
}

// === impl Link: internal bookkeeping ===

impl Link {
    fn new_key(&mut self) -> ChannelKey {
        let key = ChannelKey(self.next_key);
        self.next_key += 1;
        key
    }

    /// Gives free slots to waiting opens, oldest first.
    fn assign_slots(&mut self, now: Instant) {
        while self.closed.is_none()
            && self.config.end == End::Gateway
            && self.slots_used < self.config.max_open_channels
            && self.ids.len() < self.config.max_channel_entries
        {
            let Some(ticket) = self.open_queue.pop_front() else {
                break;
            };
            let key = self.new_key();
            let id = ChannelId::numbered(self.next_id);
            self.next_id += 1;
            self.channels
                .insert(key, Chan::new(id, true, self.config.initial_window, now));
            self.ids.insert(id, key);
            self.counters.channels_opened += 1;
            self.slots_used += 1;
            self.opened.insert(ticket, key);
            tracing::debug!(end = ?self.config.end, channel = %id, "link channel opened");
            self.events.push_back(Event::OpenReady(ticket));
            self.settle(now, key);
        }
    }

    /// Grants more credit once half of the window was consumed, growing the window when the
    /// last half went within a few RTTs and the link's budget allows.
    fn maybe_grant(&mut self, now: Instant, key: ChannelKey) {
        let Some(ch) = self.channels.get(&key) else {
            return;
        };
        if ch.rx != Rx::Open || !ch.accepted {
            return;
        }
        let outstanding = ch.rx_limit - ch.rx_consumed;
        if outstanding > ch.rx_window / 2 {
            return;
        }
        let mut window = ch.rx_window;
        let max_window = u64::from(self.config.max_window);
        let fast = self
            .srtt
            .is_some_and(|srtt| now.saturating_duration_since(ch.rx_epoch) < srtt * GROWTH_RTTS);
        if self.config.grow_windows && fast && window < max_window {
            let grown = (window * 2).min(max_window);
            let (committed, live) = self
                .channels
                .values()
                .filter(|c| c.rx == Rx::Open)
                .fold((0u64, 0usize), |(sum, n), c| (sum + c.rx_window, n + 1));
            // Keep room for the initial windows of channels that may still open.
            let reserve = self.config.max_open_channels.saturating_sub(live) as u64
                * u64::from(self.config.initial_window);
            if committed + (grown - window) + reserve <= self.config.receive_budget {
                window = grown;
            }
        }
        let Some(ch) = self.channels.get_mut(&key) else {
            return;
        };
        if window != ch.rx_window {
            tracing::trace!(end = ?self.config.end, channel = %ch.id, window, "link window grows");
        }
        ch.rx_window = window;
        let limit = ch.rx_consumed + window;
        ch.ctl_credit += limit - ch.rx_limit;
        ch.rx_limit = limit;
        ch.rx_epoch = now;
    }

    /// Brings one channel's derived state up to date after any change: stall tracking, slot,
    /// closing handshake, scheduling, wake-ups, and freeing.
    fn settle(&mut self, now: Instant, key: ChannelKey) {
        let default_buffer = self.config.send_buffer;
        let Some(ch) = self.channels.get_mut(&key) else {
            return;
        };
        let half_buffer = ch.send_buffer.unwrap_or(default_buffer) / 2;
        let mut reassign = false;
        // Credit stalls.
        let blocked =
            matches!(ch.tx, Tx::Open | Tx::Finishing) && ch.tx_queued > 0 && ch.tx_credit() == 0;
        match (blocked, ch.tx_blocked_since) {
            (true, None) => {
                ch.tx_blocked_since = Some(now);
                self.counters.credit_stalls += 1;
            }
            (false, Some(_)) => ch.tx_blocked_since = None,
            _ => {}
        }
        if ch.rx != Rx::Open {
            ch.ctl_credit = 0;
        }
        // Slot: both directions done on this side.
        if ch.holds_slot && ch.tx_terminal() && ch.rx_terminal() {
            ch.holds_slot = false;
            if ch.opener {
                self.slots_used -= 1;
                reassign = true;
            }
        }
        // Closing handshake: this end will send nothing more.
        if !ch.released
            && ch.accepted
            && ch.tx_terminal()
            && ch.rx_terminal()
            && !ch.ctl_open
            && !ch.ctl_stop
            && !ch.ctl_end
            && ch.ctl_credit == 0
        {
            ch.released = true;
            ch.ctl_release = true;
        }
        // Scheduling.
        if self.closed.is_none() {
            if ch.has_control() && !ch.in_control {
                ch.in_control = true;
                self.control.push_back(key);
            }
            if ch.can_send_data() && !ch.in_data {
                ch.in_data = true;
                self.data.push_back(key);
            }
        }
        // Wake-ups.
        if ch.reader_waits && (ch.rx_buf.len() > 0 || ch.rx != Rx::Open) {
            ch.reader_waits = false;
            self.events.push_back(Event::Readable(key));
        }
        if let Some(wait) = ch.writer_waits {
            let over = !matches!(ch.tx, Tx::Open | Tx::Finishing);
            let ready = over
                || match wait {
                    WriterWait::Space => ch.tx == Tx::Open && ch.tx_queued <= half_buffer,
                    WriterWait::Drained => ch.tx_queued == 0,
                    WriterWait::Finished => false,
                };
            if ready {
                ch.writer_waits = None;
                self.events.push_back(Event::Writable(key));
            }
        }
        // Freeing: the id once both ends released it, the state once the application let go.
        if ch.in_table && ch.released && ch.release_sent && ch.peer_released {
            ch.in_table = false;
            self.ids.remove(&ch.id);
            reassign = true;
            tracing::trace!(end = ?self.config.end, channel = %ch.id, "link channel released");
        }
        if !ch.in_table && !ch.reader && !ch.writer {
            if ch.holds_slot && ch.opener {
                self.slots_used -= 1;
                reassign = true;
            }
            self.channels.remove(&key);
        }
        if reassign && !self.open_queue.is_empty() {
            self.assign_slots(now);
        }
    }

    fn close_with(&mut self, reason: CloseReason, send_close: bool) {
        if self.closed.is_some() {
            return;
        }
        tracing::debug!(end = ?self.config.end, %reason, "link closed");
        self.closed = Some(reason.clone());
        if !matches!(reason, CloseReason::Local | CloseReason::LocalBecause(_)) {
            self.text_out.clear();
            self.text_out_bytes = 0;
        }
        self.control.clear();
        self.data.clear();
        if reason != CloseReason::Unresponsive {
            self.pending_ping = None;
        }
        self.pending_pong = None;
        self.ids.clear();
        self.slots_used = 0;
        // Opens that had a channel and were not taken: their channel goes with the link.
        let opened = std::mem::take(&mut self.opened);
        for (ticket, key) in opened {
            if let Some(ch) = self.channels.get_mut(&key) {
                ch.reader = false;
                ch.writer = false;
            }
            self.open_queue.push_back(ticket);
        }
        let now = self.last_rx;
        let keys: Vec<ChannelKey> = self.channels.keys().copied().collect();
        for key in keys {
            if let Some(ch) = self.channels.get_mut(&key) {
                ch.fail(FailureReason::Closed);
                ch.in_table = false;
                ch.holds_slot = false;
                ch.ctl_open = false;
                ch.ctl_abort = None;
                ch.ctl_release = false;
                ch.tx_blocked_since = None;
                ch.accept_deadline = None;
            }
            self.settle(now, key);
        }
        for &ticket in &self.open_queue {
            self.events.push_back(Event::OpenReady(ticket));
        }
        self.events.push_back(Event::TextWritable);
        self.events.push_back(Event::Closed(reason.clone()));
        if send_close {
            self.close_transmit = Some(reason);
        }
    }

    fn debug_check(&self) {
        if cfg!(debug_assertions) {
            self.assert_invariants();
        }
    }

    /// Checks the link's internal invariants (credit never exceeded, buffers within windows,
    /// slot and table accounting). Panics on a broken invariant: a bug in the link, never a
    /// reaction to peer input. Runs after every input in debug builds.
    pub fn assert_invariants(&self) {
        let mut slots = 0;
        let mut entries = 0;
        for (key, ch) in &self.channels {
            slots += usize::from(ch.holds_slot && ch.opener);
            entries += usize::from(ch.in_table);
            if ch.in_table {
                assert_eq!(self.ids.get(&ch.id), Some(key), "id table out of step");
            }
            assert!(ch.tx_sent <= ch.tx_limit, "sent beyond credit");
            assert!(ch.rx_received <= ch.rx_limit, "received beyond credit");
            assert!(
                ch.rx_consumed + ch.rx_buf.len() as u64 == ch.rx_received,
                "receive accounting"
            );
            assert!(
                ch.rx_buf.len() as u64 <= ch.rx_window,
                "buffer beyond the window"
            );
            assert!(
                ch.rx_limit - ch.rx_consumed <= ch.rx_window,
                "granted beyond the window"
            );
            assert!(
                ch.rx_window <= u64::from(self.config.max_window),
                "window beyond the maximum"
            );
            assert_eq!(ch.rx_buf.len(), ch.rx_buf.counted(), "receive buffer count");
            assert_eq!(
                ch.tx_queued,
                ch.tx_queue.iter().map(Chunk::payload_len).sum::<usize>(),
                "send queue count"
            );
            assert!(!ch.ctl_release || ch.released, "RELEASE without release");
            assert!(
                ch.ctl_abort.is_none() || ch.released,
                "ABORT without release"
            );
        }
        assert_eq!(slots, self.slots_used, "slot count");
        assert_eq!(entries, self.ids.len(), "table count");
        if self.closed.is_none() {
            assert!(
                self.slots_used <= self.config.max_open_channels,
                "too many slots"
            );
            assert!(
                self.ids.len() <= self.config.max_channel_entries,
                "too many entries"
            );
        }
    }
}
