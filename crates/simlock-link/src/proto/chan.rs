//! The state of one channel inside the sans-IO core: both directions, their credit, and the
//! control frames waiting to go.
//!
//! This module only holds data and local transitions; the [`Link`](super::Link) decides when a
//! channel is scheduled, released and freed (in `Link::settle`).

use std::{collections::VecDeque, fmt, time::Instant};

use bytes::Bytes;

use super::{frame::ChannelId, rxbuf::RxBuf};
use crate::error::FailureReason;

/// The local view of this end's outgoing direction.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Tx {
    /// The writer may write.
    Open,
    /// The writer called finish; END goes once the queue is empty.
    Finishing,
    /// END was transmitted.
    Finished,
    /// The peer sent STOP: the writer fails `stopped`.
    Stopped,
    /// The channel failed.
    Failed(FailureReason),
}

/// The local view of the peer's direction, which this end reads.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Rx {
    /// Bytes may still arrive.
    Open,
    /// END arrived; the reader sees end of stream once the buffer is drained.
    Ended,
    /// The reader saw end of stream.
    Finished,
    /// The reader stopped (STOP sent or about to be): arriving bytes are discarded.
    Stopped,
    /// The channel failed.
    Failed(FailureReason),
}

/// What a waiting writer waits for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum WriterWait {
    /// Room in the send queue (at most half of it in use).
    Space,
    /// An empty send queue (flush).
    Drained,
    /// END transmitted, or the direction over otherwise (finish).
    Finished,
}

/// Bytes waiting in a writer's queue.
pub(crate) enum Chunk {
    /// Plain payload, framed (copied) when sent.
    Raw(Bytes),
    /// Payload already framed: consecutive DATA frames with `header`-byte headers and
    /// `frame_payload` bytes of payload each (the last may have fewer), `payload` in all.
    Encoded {
        frames: Bytes,
        header: usize,
        frame_payload: usize,
        payload: usize,
    },
}

impl fmt::Debug for Chunk {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Raw(bytes) => write!(f, "Raw({} bytes)", bytes.len()),
            Self::Encoded { payload, .. } => write!(f, "Encoded({payload} bytes)"),
        }
    }
}

impl Chunk {
    /// Payload bytes in the chunk.
    pub(crate) fn payload_len(&self) -> usize {
        match self {
            Self::Raw(bytes) => bytes.len(),
            Self::Encoded { payload, .. } => *payload,
        }
    }
}

/// One channel. Its `Debug` shows buffer sizes, not their bytes.
pub(crate) struct Chan {
    pub(crate) id: ChannelId,
    /// This end opened the channel (the gateway end).
    pub(crate) opener: bool,
    /// The acceptor accepted it; always true at the opener.
    pub(crate) accepted: bool,
    /// When an unaccepted channel is refused.
    pub(crate) accept_deadline: Option<Instant>,
    /// The application holds the reading half.
    pub(crate) reader: bool,
    /// The application holds the writing half.
    pub(crate) writer: bool,
    /// The reader waits for a `Readable` event.
    pub(crate) reader_waits: bool,
    /// The writer waits for a `Writable` event, and for what.
    pub(crate) writer_waits: Option<WriterWait>,

    // Outgoing direction.
    pub(crate) tx: Tx,
    /// Highest byte offset the peer allows.
    pub(crate) tx_limit: u64,
    /// Bytes transmitted.
    pub(crate) tx_sent: u64,
    pub(crate) tx_queue: VecDeque<Chunk>,
    pub(crate) tx_queued: usize,
    /// This writer's bound on `tx_queued`, when it set one (else the link's `send_buffer`).
    pub(crate) send_buffer: Option<usize>,
    /// Since when the writer holds data without credit.
    pub(crate) tx_blocked_since: Option<Instant>,
    pub(crate) end_sent: bool,
    pub(crate) stop_received: bool,

    // Incoming direction.
    pub(crate) rx: Rx,
    /// The current receive window.
    pub(crate) rx_window: u64,
    /// Highest byte offset the peer may send up to (initial window plus every grant).
    pub(crate) rx_limit: u64,
    pub(crate) rx_received: u64,
    /// Bytes the application read (or that were discarded).
    pub(crate) rx_consumed: u64,
    pub(crate) rx_buf: RxBuf,
    /// When the current window was granted (for window growth).
    pub(crate) rx_epoch: Instant,
    pub(crate) end_received: bool,
    pub(crate) stop_sent: bool,
    /// Bytes received after this end decided to STOP (for the "one window after STOP" bound).
    pub(crate) rx_after_stop: u64,

    // Control frames waiting to go, in the order they are sent.
    pub(crate) ctl_open: bool,
    pub(crate) ctl_abort: Option<FailureReason>,
    pub(crate) ctl_credit: u64,
    pub(crate) ctl_stop: bool,
    pub(crate) ctl_end: bool,
    pub(crate) ctl_release: bool,
    pub(crate) in_control: bool,
    pub(crate) in_data: bool,

    // Closing handshake.
    pub(crate) open_sent: bool,
    pub(crate) abort_sent: bool,
    /// This end will send no more frames (RELEASE or ABORT decided).
    pub(crate) released: bool,
    /// That RELEASE or ABORT was transmitted.
    pub(crate) release_sent: bool,
    /// The peer sent RELEASE or ABORT: nothing more comes from it.
    pub(crate) peer_released: bool,
    /// The id is in the link's table (frames for it are accepted).
    pub(crate) in_table: bool,
    /// Counted as open (at the opener: holds one of the channel slots).
    pub(crate) holds_slot: bool,
}

impl fmt::Debug for Chan {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Chan")
            .field("id", &self.id)
            .field("opener", &self.opener)
            .field("accepted", &self.accepted)
            .field("reader", &self.reader)
            .field("writer", &self.writer)
            .field("tx", &self.tx)
            .field("tx_sent", &self.tx_sent)
            .field("tx_limit", &self.tx_limit)
            .field("tx_queued", &self.tx_queued)
            .field("send_buffer", &self.send_buffer)
            .field("rx", &self.rx)
            .field("rx_received", &self.rx_received)
            .field("rx_limit", &self.rx_limit)
            .field("rx_buffered", &self.rx_buf.len())
            .field("rx_window", &self.rx_window)
            .field("end_sent", &self.end_sent)
            .field("end_received", &self.end_received)
            .field("stop_sent", &self.stop_sent)
            .field("stop_received", &self.stop_received)
            .field("released", &self.released)
            .field("release_sent", &self.release_sent)
            .field("peer_released", &self.peer_released)
            .field("in_table", &self.in_table)
            .field("holds_slot", &self.holds_slot)
            .finish_non_exhaustive()
    }
}

impl Chan {
    pub(crate) fn new(id: ChannelId, opener: bool, window: u32, now: Instant) -> Self {
        let window = u64::from(window);
        Self {
            id,
            opener,
            accepted: opener,
            accept_deadline: None,
            reader: opener,
            writer: opener,
            reader_waits: false,
            writer_waits: None,
            tx: Tx::Open,
            tx_limit: window,
            tx_sent: 0,
            tx_queue: VecDeque::new(),
            tx_queued: 0,
            send_buffer: None,
            tx_blocked_since: None,
            end_sent: false,
            stop_received: false,
            rx: Rx::Open,
            rx_window: window,
            rx_limit: window,
            rx_received: 0,
            rx_consumed: 0,
            rx_buf: RxBuf::default(),
            rx_epoch: now,
            end_received: false,
            stop_sent: false,
            rx_after_stop: 0,
            ctl_open: opener,
            ctl_abort: None,
            ctl_credit: 0,
            ctl_stop: false,
            ctl_end: false,
            ctl_release: false,
            in_control: false,
            in_data: false,
            open_sent: false,
            abort_sent: false,
            released: false,
            release_sent: false,
            peer_released: false,
            in_table: true,
            holds_slot: true,
        }
    }

    /// Nothing more will be written on the outgoing direction.
    pub(crate) fn tx_terminal(&self) -> bool {
        matches!(self.tx, Tx::Finished | Tx::Stopped | Tx::Failed(_))
    }

    /// No more credit or STOP is needed for the incoming direction.
    pub(crate) fn rx_terminal(&self) -> bool {
        !matches!(self.rx, Rx::Open)
    }

    /// Bytes the peer may still send.
    pub(crate) fn tx_credit(&self) -> u64 {
        self.tx_limit.saturating_sub(self.tx_sent)
    }

    pub(crate) fn can_send_data(&self) -> bool {
        matches!(self.tx, Tx::Open | Tx::Finishing) && self.tx_queued > 0 && self.tx_credit() > 0
    }

    pub(crate) fn has_control(&self) -> bool {
        self.ctl_open
            || self.ctl_abort.is_some()
            || self.ctl_credit > 0
            || self.ctl_stop
            || self.ctl_end
            || self.ctl_release
    }

    /// Drops everything buffered for the reader, counting it as consumed.
    pub(crate) fn discard_rx(&mut self) {
        self.rx_consumed += self.rx_buf.len() as u64;
        self.rx_buf.clear();
    }

    /// Drops everything queued by the writer.
    pub(crate) fn discard_tx(&mut self) {
        self.tx_queue.clear();
        self.tx_queued = 0;
        self.tx_blocked_since = None;
        self.ctl_end = false;
    }

    /// Fails every direction that is not over yet with `reason` (locally; no frame decided).
    pub(crate) fn fail(&mut self, reason: FailureReason) {
        if matches!(self.rx, Rx::Open | Rx::Ended) {
            self.rx = Rx::Failed(reason);
            self.discard_rx();
        }
        if matches!(self.tx, Tx::Open | Tx::Finishing) {
            self.tx = Tx::Failed(reason);
            self.discard_tx();
        }
        self.ctl_credit = 0;
        self.ctl_stop = false;
        self.ctl_end = false;
    }

    /// The reader wants no more: discard what is buffered and STOP the peer unless it ended.
    pub(crate) fn stop_rx(&mut self) {
        match self.rx {
            Rx::Open => {
                self.rx = Rx::Stopped;
                self.discard_rx();
                self.ctl_credit = 0;
                if !self.released {
                    self.ctl_stop = true;
                }
            }
            Rx::Ended => {
                self.rx = Rx::Finished;
                self.discard_rx();
            }
            Rx::Finished | Rx::Stopped | Rx::Failed(_) => {}
        }
    }
}
