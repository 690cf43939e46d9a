//! A pair of sans-IO links joined by an in-memory wire with a virtual clock (quinn's `Pair`).
//!
//! Messages travel in order with a configurable latency; the wire can be cut (link loss) or
//! turned into a black hole (a dead uplink that still looks connected). An independent credit
//! monitor decodes every frame in transit and checks that no DATA ever exceeds the credit the
//! receiver granted. Time moves only when the harness moves it.
//!
//! This file is also compiled into the benchmark (which runs the seeded simulation), so it uses
//! only the crate's public API through `crate::proto` and returns errors instead of panicking.

use std::{
    collections::{BTreeMap, VecDeque},
    time::{Duration, Instant},
};

use crate::proto::{
    CloseReason, End, Event, Link, LinkConfig, Transmit,
    frame::{ChannelId, Frame},
};

/// Steps `drive` and `advance` may take before the harness calls it a livelock.
const MAX_STEPS: usize = 2_000_000;

/// The base of virtual time. The only wall-clock read in the harness: every later instant is
/// this one plus virtual durations.
#[allow(clippy::disallowed_methods)]
pub(crate) fn epoch() -> Instant {
    Instant::now()
}

/// Checks, from the frames on the wire alone, that no direction ever carries more than its credit.
#[derive(Debug, Default)]
pub(crate) struct CreditMonitor {
    initial: u64,
    /// (sender, channel) → (bytes sent, bytes allowed).
    directions: BTreeMap<(u8, ChannelId), (u64, u64)>,
    pub(crate) errors: Vec<String>,
    pub(crate) data_frames: u64,
    pub(crate) max_payload: usize,
}

fn end_index(end: End) -> u8 {
    match end {
        End::Gateway => 0,
        End::Worker => 1,
    }
}

impl CreditMonitor {
    fn observe(&mut self, from: End, message: &Transmit) {
        let Transmit::Frame(bytes) = message else {
            return;
        };
        let frame = match Frame::decode(bytes) {
            Ok(frame) => frame,
            Err(error) => {
                self.errors
                    .push(format!("{from:?} sent an undecodable frame: {error}"));
                return;
            }
        };
        let me = end_index(from);
        let peer = end_index(from.peer());
        match frame {
            Frame::Open { id } => {
                self.directions.insert((me, id), (0, self.initial));
                self.directions.insert((peer, id), (0, self.initial));
            }
            Frame::Data { id, payload } => {
                self.data_frames += 1;
                self.max_payload = self.max_payload.max(payload.len());
                let entry = self.directions.entry((me, id)).or_insert((0, self.initial));
                entry.0 += payload.len() as u64;
                if entry.0 > entry.1 {
                    self.errors.push(format!(
                        "{from:?} sent {} bytes on {id} with {} allowed",
                        entry.0, entry.1
                    ));
                }
            }
            Frame::Credit { id, amount } => {
                let entry = self
                    .directions
                    .entry((peer, id))
                    .or_insert((0, self.initial));
                entry.1 += u64::from(amount);
            }
            Frame::End { .. }
            | Frame::Stop { .. }
            | Frame::Abort { .. }
            | Frame::Release { .. }
            | Frame::Ping { .. }
            | Frame::Pong { .. } => {}
        }
    }
}

/// Two links and the wire between them.
#[derive(Debug)]
pub(crate) struct Pair {
    pub(crate) gateway: Link,
    pub(crate) worker: Link,
    pub(crate) now: Instant,
    /// One-way delay of every message.
    pub(crate) latency: Duration,
    /// [to the worker, to the gateway]: messages in flight with their arrival time.
    in_flight: [VecDeque<(Instant, Transmit)>; 2],
    /// [gateway's, worker's] events not yet taken.
    events: [VecDeque<Event>; 2],
    /// Messages still reach the other side.
    pub(crate) connected: bool,
    /// The wire swallows everything without failing (a dead uplink).
    pub(crate) blackhole: bool,
    pub(crate) monitor: CreditMonitor,
    /// PING frames each end sent: [gateway, worker].
    pub(crate) pings_sent: [u64; 2],
    /// PONG frames each end sent.
    pub(crate) pongs_sent: [u64; 2],
}

impl Pair {
    /// A pair whose gateway uses `config` (the worker the same knobs), with no latency.
    pub(crate) fn new(config: LinkConfig) -> Self {
        let now = epoch();
        let mut gateway_config = config.clone();
        gateway_config.end = End::Gateway;
        let worker_config = gateway_config.for_peer();
        Self {
            monitor: CreditMonitor {
                initial: u64::from(config.initial_window),
                ..CreditMonitor::default()
            },
            gateway: Link::new(gateway_config, now),
            worker: Link::new(worker_config, now),
            now,
            latency: Duration::ZERO,
            in_flight: [VecDeque::new(), VecDeque::new()],
            events: [VecDeque::new(), VecDeque::new()],
            connected: true,
            blackhole: false,
            pings_sent: [0; 2],
            pongs_sent: [0; 2],
        }
    }

    /// The link at `end`.
    pub(crate) fn link(&mut self, end: End) -> &mut Link {
        match end {
            End::Gateway => &mut self.gateway,
            End::Worker => &mut self.worker,
        }
    }

    /// Takes the events `end` produced so far.
    pub(crate) fn take_events(&mut self, end: End) -> Vec<Event> {
        self.pump();
        self.events[usize::from(end_index(end))].drain(..).collect()
    }

    /// Cuts the wire: both ends see the transport end, in-flight messages are lost.
    pub(crate) fn disconnect(&mut self) {
        self.connected = false;
        self.in_flight[0].clear();
        self.in_flight[1].clear();
        let reason = CloseReason::Transport("wire cut".into());
        self.gateway.handle_transport_closed(reason.clone());
        self.worker.handle_transport_closed(reason);
        self.pump();
    }

    /// Moves what both links want to send onto the wire, and their events into the queues.
    /// Returns whether anything moved.
    fn pump(&mut self) -> bool {
        let mut moved = false;
        for end in [End::Gateway, End::Worker] {
            let index = usize::from(end_index(end));
            let arrival = self.now + self.latency;
            loop {
                let now = self.now;
                let Some(transmit) = self.link(end).poll_transmit(now) else {
                    break;
                };
                moved = true;
                self.monitor.observe(end, &transmit);
                if let Transmit::Frame(bytes) = &transmit {
                    match Frame::decode(bytes) {
                        Ok(Frame::Ping { .. }) => self.pings_sent[index] += 1,
                        Ok(Frame::Pong { .. }) => self.pongs_sent[index] += 1,
                        Ok(_) | Err(_) => {}
                    }
                }
                if self.connected && !self.blackhole {
                    self.in_flight[index].push_back((arrival, transmit));
                }
            }
            while let Some(event) = self.link(end).poll_event() {
                moved = true;
                self.events[index].push_back(event);
            }
        }
        moved
    }

    /// Delivers every message due by now. Returns whether any was.
    fn deliver_due(&mut self) -> bool {
        let mut delivered = false;
        for (index, to) in [(0, End::Worker), (1, End::Gateway)] {
            while self.in_flight[index]
                .front()
                .is_some_and(|(at, _)| *at <= self.now)
            {
                let Some((_, message)) = self.in_flight[index].pop_front() else {
                    break;
                };
                delivered = true;
                let now = self.now;
                let link = self.link(to);
                match message {
                    Transmit::Frame(bytes) => link.handle_frame(now, bytes),
                    Transmit::Text(text) => link.handle_text(now, text),
                    Transmit::Close(reason) => {
                        link.handle_transport_closed(CloseReason::Peer {
                            reason: reason.to_string(),
                        });
                        self.connected = false;
                        self.in_flight[0].clear();
                        self.in_flight[1].clear();
                    }
                }
            }
        }
        delivered
    }

    /// Fires the timeouts of both links that are due by now. Returns whether any was.
    fn fire_timeouts(&mut self) -> bool {
        let mut fired = false;
        for end in [End::Gateway, End::Worker] {
            let now = self.now;
            let link = self.link(end);
            if link.poll_timeout().is_some_and(|at| at <= now) {
                link.handle_timeout(now);
                fired = true;
            }
        }
        fired
    }

    fn next_arrival(&self) -> Option<Instant> {
        self.in_flight
            .iter()
            .filter_map(|queue| queue.front().map(|(at, _)| *at))
            .min()
    }

    fn next_timeout(&self) -> Option<Instant> {
        [self.gateway.poll_timeout(), self.worker.poll_timeout()]
            .into_iter()
            .flatten()
            .min()
    }

    /// Runs until nothing is in flight and neither link has anything to send, moving time only
    /// as far as message latency needs (timeouts that come due on the way fire).
    ///
    /// # Errors
    /// When it does not settle within a bounded number of steps.
    pub(crate) fn drive(&mut self) -> Result<(), String> {
        for _ in 0..MAX_STEPS {
            let moved = self.pump();
            let delivered = self.deliver_due();
            let fired = self.fire_timeouts();
            if moved || delivered || fired {
                continue;
            }
            match self.next_arrival() {
                Some(at) => self.now = self.now.max(at),
                None => return Ok(()),
            }
        }
        Err("pair did not settle (livelock?)".into())
    }

    /// Runs for `duration` of virtual time, firing timeouts and delivering messages on the way.
    ///
    /// # Errors
    /// When it does not settle within a bounded number of steps.
    pub(crate) fn advance(&mut self, duration: Duration) -> Result<(), String> {
        let target = self.now + duration;
        for _ in 0..MAX_STEPS {
            let moved = self.pump();
            let delivered = self.deliver_due();
            let fired = self.fire_timeouts();
            if moved || delivered || fired {
                continue;
            }
            let next = [self.next_arrival(), self.next_timeout()]
                .into_iter()
                .flatten()
                .min();
            match next {
                Some(at) if at <= target => self.now = self.now.max(at),
                _ => {
                    self.now = target;
                    return Ok(());
                }
            }
        }
        Err("pair did not settle (livelock?)".into())
    }

    /// Runs until `done` holds or `limit` of virtual time passes, one latency step at a time.
    ///
    /// # Errors
    /// When the step bound is hit.
    pub(crate) fn run_until(
        &mut self,
        limit: Duration,
        mut done: impl FnMut(&mut Self) -> bool,
    ) -> Result<bool, String> {
        let target = self.now + limit;
        for _ in 0..MAX_STEPS {
            if done(self) {
                return Ok(true);
            }
            if self.now >= target {
                return Ok(false);
            }
            let moved = self.pump();
            let delivered = self.deliver_due();
            let fired = self.fire_timeouts();
            if moved || delivered || fired {
                continue;
            }
            let next = [self.next_arrival(), self.next_timeout()]
                .into_iter()
                .flatten()
                .min()
                .unwrap_or(target);
            self.now = next.clamp(self.now, target);
        }
        Err("pair did not settle (livelock?)".into())
    }
}
