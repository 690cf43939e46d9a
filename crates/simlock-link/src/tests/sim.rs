//! The seeded simulation: random schedules of opens, accepts, writes, slow and stalled readers,
//! STOPs, aborts, cancelled opens, text, time jumps, link loss and dead uplinks, over a [`Pair`].
//!
//! In every schedule each byte of every direction arrives once and in order (checked against a
//! pattern derived from its offset), or that direction fails with a named reason that fits what
//! happened (`stopped` only where the reader stopped, `aborted` only where the application aborted,
//! `closed` only after link loss, `stalled` only where a reader stalled or time jumped past the
//! stall timeout, `refused` only for channels never accepted). No schedule may produce a protocol
//! violation, exceed credit on the wire, or leave state behind once every handle is dropped.
//!
//! Also compiled into the benchmark, which runs 10 000 seeds: no panics, errors name the seed.
//! With `SIMLOCK_LINK_SIM_DEBUG` set, a seed that leaves state behind dumps both links.

use std::{
    collections::BTreeMap,
    time::{Duration, Instant},
};

use bytes::Bytes;
use rand::{RngExt, SeedableRng, rngs::Xoshiro256PlusPlus};

use super::pair::Pair;
use crate::proto::{
    ChannelKey, CloseReason, End, Event, FailureReason, LinkConfig, OpenTicket, Read,
    SendTextError,
    frame::{ChannelId, EncodedData},
};

type Rng = Xoshiro256PlusPlus;

/// The environment variable that sets how many seeds the simulation runs.
pub(crate) const SEEDS_VAR: &str = "SIMLOCK_LINK_SIM_SEEDS";

/// What a run of the simulation saw, over all its seeds.
#[derive(Debug, Default, Clone)]
pub(crate) struct SimReport {
    pub(crate) seeds: u64,
    pub(crate) channels: u64,
    pub(crate) bytes_delivered: u64,
    pub(crate) clean_ends: u64,
    pub(crate) failures: BTreeMap<&'static str, u64>,
    pub(crate) links_lost: u64,
    pub(crate) texts: u64,
}

/// The number of seeds from [`SEEDS_VAR`], or `default`.
pub(crate) fn seeds_from_env(default: u64) -> u64 {
    std::env::var(SEEDS_VAR)
        .ok()
        .and_then(|value| value.trim().parse().ok())
        .unwrap_or(default)
}

/// Runs seeds `first..first + count`.
///
/// # Errors
/// The first failing seed and what failed.
pub(crate) fn run_seeds(first: u64, count: u64) -> Result<SimReport, String> {
    let mut report = SimReport::default();
    for seed in first..first + count {
        Sim::new(seed)
            .run(&mut report)
            .map_err(|error| format!("seed {seed}: {error}"))?;
        report.seeds += 1;
    }
    Ok(report)
}

/// The byte at `offset` of direction `dir` of channel `n`.
fn pattern(n: u64, dir: usize, offset: u64) -> u8 {
    let x = offset
        .wrapping_mul(0x9E37_79B9_7F4A_7C15)
        .wrapping_add(n.wrapping_mul(0xBF58_476D_1CE4_E5B9))
        .wrapping_add(dir as u64 * 0x94D0_49BB_1331_11EB);
    (x >> 56) as u8
}

/// One direction, as the application at both of its ends sees it.
#[derive(Debug, Default)]
struct Dir {
    total: u64,
    written: u64,
    finish_called: bool,
    finished: bool,
    writer_failed: Option<FailureReason>,
    writer_gone: bool,
    read: u64,
    eof: bool,
    reader_failed: Option<FailureReason>,
    reader_stopped: bool,
    /// The reader does not read until the very end.
    stalled: bool,
    /// The reader was stalled at some point.
    was_stalled: bool,
}

impl Dir {
    fn writer_active(&self) -> bool {
        self.writer_failed.is_none() && !self.writer_gone && !self.finished
    }

    fn reader_active(&self) -> bool {
        !self.eof && self.reader_failed.is_none() && !self.reader_stopped
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Accept {
    Prompt,
    Late(Instant),
    Never,
}

#[derive(Debug)]
struct SimChan {
    n: u64,
    ticket: Option<OpenTicket>,
    cancelled: bool,
    id: Option<ChannelId>,
    gkey: Option<ChannelKey>,
    wkey: Option<ChannelKey>,
    accept: Accept,
    accept_failed: Option<FailureReason>,
    /// 0: request (gateway writes, worker reads); 1: response.
    dirs: [Dir; 2],
    /// The application aborted it, or dropped an unfinished writer.
    aborted: bool,
}

impl SimChan {
    /// (end, key) of the writer of direction `d`.
    fn writer(&self, d: usize) -> (End, Option<ChannelKey>) {
        if d == 0 {
            (End::Gateway, self.gkey)
        } else {
            (End::Worker, self.wkey)
        }
    }

    /// (end, key) of the reader of direction `d`.
    fn reader(&self, d: usize) -> (End, Option<ChannelKey>) {
        if d == 0 {
            (End::Worker, self.wkey)
        } else {
            (End::Gateway, self.gkey)
        }
    }
}

struct Sim {
    rng: Rng,
    pair: Pair,
    chans: Vec<SimChan>,
    by_id: BTreeMap<ChannelId, usize>,
    /// Ids the worker was told about (OPEN arrived): only those can be accepted.
    incoming: std::collections::BTreeSet<ChannelId>,
    max_chans: usize,
    max_total: u64,
    link_lost: bool,
    big_jump: bool,
    texts_sent: [u64; 2],
    texts_seen: [u64; 2],
}

fn pick<T: Copy>(rng: &mut Rng, options: &[T]) -> T {
    options[rng.random_range(0..options.len())]
}

impl Sim {
    fn new(seed: u64) -> Self {
        let mut rng = Rng::seed_from_u64(seed);
        let mut config = LinkConfig::new(End::Gateway);
        config.initial_window = pick(&mut rng, &[512, 2048, 8192, 65536]);
        config.max_window = config.initial_window * pick(&mut rng, &[1, 4, 16]);
        config.receive_budget = u64::from(config.max_window) * pick(&mut rng, &[1, 4, 64]);
        config.max_data_frame = pick(&mut rng, &[100, 1000, 4096, 16384]);
        config.send_buffer = pick(&mut rng, &[300, 4096, 65536]);
        config.max_open_channels = pick(&mut rng, &[1, 2, 4, 8]);
        config.max_channel_entries = config.max_open_channels * pick(&mut rng, &[1, 2]);
        config.text_send_buffer = pick(&mut rng, &[64, 10_000]);
        // Compaction of a stalled reader's bytes, from always to the default.
        config.compact_after = pick(&mut rng, &[0, 300, 4096, 65536]);
        let mut pair = Pair::new(config);
        pair.latency = pick(
            &mut rng,
            &[
                Duration::ZERO,
                Duration::from_millis(1),
                Duration::from_millis(5),
                Duration::from_millis(50),
            ],
        );
        let max_total = pick(&mut rng, &[0, 3000, 20_000, 60_000]);
        let max_chans = rng.random_range(1..=10);
        Self {
            rng,
            pair,
            chans: Vec::new(),
            by_id: BTreeMap::new(),
            incoming: std::collections::BTreeSet::new(),
            max_chans,
            max_total,
            link_lost: false,
            big_jump: false,
            texts_sent: [0; 2],
            texts_seen: [0; 2],
        }
    }

    fn run(mut self, report: &mut SimReport) -> Result<(), String> {
        let ops = self.rng.random_range(30..250);
        for _ in 0..ops {
            self.random_op()?;
            self.sync()?;
        }
        self.quiesce()?;
        self.check(report)
    }

    fn random_op(&mut self) -> Result<(), String> {
        let roll = self.rng.random_range(0..1000);
        match roll {
            0..100 => self.open(),
            100..350 => self.write_random(),
            350..600 => self.read_random(),
            600..750 => {
                if self.rng.random_bool(0.5) {
                    self.pair.drive()?;
                } else {
                    let ms = self.rng.random_range(0..40);
                    self.pair.advance(Duration::from_millis(ms))?;
                }
            }
            750..790 => self.stop_random(),
            790..815 => self.abort_random(),
            815..835 => self.drop_writer_random(),
            835..850 => self.cancel_random(),
            850..950 => self.send_text(),
            950..985 => self.finish_random(),
            985..997 => {
                // A long pause: accept (30 s) and stall (60 s) timeouts may fire.
                self.big_jump = true;
                let secs = pick(&mut self.rng, &[31, 61]);
                self.pair.advance(Duration::from_secs(secs))?;
            }
            _ => {
                if !self.link_lost {
                    self.link_lost = true;
                    if self.rng.random_bool(0.5) {
                        self.pair.disconnect();
                    } else {
                        // A dead uplink: nothing arrives, nothing fails, until pings give up.
                        self.pair.blackhole = true;
                        self.pair.advance(Duration::from_secs(16))?;
                    }
                }
            }
        }
        Ok(())
    }

    fn open(&mut self) {
        if self.chans.len() >= self.max_chans {
            return;
        }
        let now = self.pair.now;
        let ticket = self.pair.gateway.open(now);
        let n = self.chans.len() as u64;
        let accept = match self.rng.random_range(0..10) {
            0 => Accept::Never,
            1 => Accept::Late(now + Duration::from_millis(self.rng.random_range(0..40_000))),
            _ => Accept::Prompt,
        };
        let mut dirs = [Dir::default(), Dir::default()];
        for dir in &mut dirs {
            dir.total = if self.max_total == 0 {
                0
            } else {
                self.rng.random_range(0..=self.max_total)
            };
            dir.stalled = self.rng.random_ratio(1, 12);
            dir.was_stalled = dir.stalled;
        }
        self.chans.push(SimChan {
            n,
            ticket: Some(ticket),
            cancelled: false,
            id: None,
            gkey: None,
            wkey: None,
            accept,
            accept_failed: None,
            dirs,
            aborted: false,
        });
    }

    fn random_chan(&mut self) -> Option<usize> {
        if self.chans.is_empty() {
            return None;
        }
        Some(self.rng.random_range(0..self.chans.len()))
    }

    fn write_random(&mut self) {
        if let Some(c) = self.random_chan() {
            let d = self.rng.random_range(0..2);
            let max = self.rng.random_range(1..5000);
            self.write(c, d, max);
        }
    }

    /// Writes up to `max` more bytes of direction `d`, finishing when all are written (usually).
    fn write(&mut self, c: usize, d: usize, max: u64) {
        let now = self.pair.now;
        let mode = self.rng.random_range(0..10);
        let frame_payload = self.rng.random_range(1..20_000);
        let finish_now = self.rng.random_ratio(9, 10);
        let chan = &mut self.chans[c];
        let (end, Some(key)) = chan.writer(d) else {
            return;
        };
        let n = chan.n;
        let dir = &mut chan.dirs[d];
        if !dir.writer_active() || dir.finish_called {
            return;
        }
        let len = max.min(dir.total - dir.written);
        let link = self.pair.link(end);
        if len > 0 {
            let data: Vec<u8> = (dir.written..dir.written + len)
                .map(|offset| pattern(n, d, offset))
                .collect();
            let data = Bytes::from(data);
            let result = match mode {
                // As a `Sink` does: check for room, then queue the whole item.
                0..2 => match link.write_space(key) {
                    Ok(0) => Ok(0),
                    Ok(_) => link.write_all(now, key, data).map(|()| len as usize),
                    Err(error) => Err(error),
                },
                // As `AsyncWrite` does: encode what fits as DATA frames first.
                2..6 => match link.write_space(key) {
                    Ok(0) => Ok(0),
                    Ok(space) => {
                        let take = space.min(data.len());
                        let id = link.channel_id(key).ok_or("writer without an id");
                        match id {
                            Ok(id) => {
                                let encoded = EncodedData::new(id, &data[..take], frame_payload);
                                link.write_encoded(now, key, encoded).map(|()| take)
                            }
                            Err(_) => Ok(0),
                        }
                    }
                    Err(error) => Err(error),
                },
                _ => link.write(now, key, data),
            };
            match result {
                Ok(taken) => dir.written += taken as u64,
                Err(error) => {
                    dir.writer_failed = Some(error.reason());
                    return;
                }
            }
        }
        if dir.written == dir.total && finish_now {
            dir.finish_called = true;
            if let Err(error) = link.finish(now, key) {
                dir.writer_failed = Some(error.reason());
            }
        }
    }

    fn finish_random(&mut self) {
        if let Some(c) = self.random_chan() {
            let d = self.rng.random_range(0..2);
            self.write(c, d, u64::MAX);
        }
    }

    fn read_random(&mut self) {
        if let Some(c) = self.random_chan() {
            let d = self.rng.random_range(0..2);
            let max = self.rng.random_range(1..20_000);
            if !self.chans[c].dirs[d].stalled {
                let _ = self.read(c, d, max);
            }
        }
    }

    /// Reads up to `max` bytes of direction `d`, checking each against the pattern.
    fn read(&mut self, c: usize, d: usize, max: usize) -> Result<(), String> {
        let now = self.pair.now;
        let chan = &mut self.chans[c];
        let (end, Some(key)) = chan.reader(d) else {
            return Ok(());
        };
        let n = chan.n;
        let dir = &mut chan.dirs[d];
        let link = self.pair.link(end);
        let mut left = max;
        while left > 0 && dir.reader_active() {
            match link.read(now, key, left) {
                Ok(Read::Data(bytes)) => {
                    for (i, &byte) in bytes.iter().enumerate() {
                        let offset = dir.read + i as u64;
                        if byte != pattern(n, d, offset) {
                            return Err(format!(
                                "channel {n} dir {d}: wrong byte at offset {offset}"
                            ));
                        }
                    }
                    dir.read += bytes.len() as u64;
                    if dir.read > dir.written {
                        return Err(format!(
                            "channel {n} dir {d}: read {} of {} written",
                            dir.read, dir.written
                        ));
                    }
                    left -= bytes.len().min(left);
                }
                Ok(Read::End) => {
                    if !dir.finish_called || dir.read != dir.written {
                        return Err(format!(
                            "channel {n} dir {d}: end of stream after {} of {} bytes (finish called: {})",
                            dir.read, dir.written, dir.finish_called
                        ));
                    }
                    dir.eof = true;
                }
                Ok(Read::Blocked) => break,
                Err(error) => dir.reader_failed = Some(error.reason()),
            }
        }
        Ok(())
    }

    fn stop_random(&mut self) {
        let Some(c) = self.random_chan() else {
            return;
        };
        let d = self.rng.random_range(0..2);
        let detach = self.rng.random_bool(0.5);
        let now = self.pair.now;
        let chan = &mut self.chans[c];
        let (end, Some(key)) = chan.reader(d) else {
            return;
        };
        let dir = &mut chan.dirs[d];
        if !dir.reader_active() {
            return;
        }
        dir.reader_stopped = true;
        let link = self.pair.link(end);
        if detach {
            link.detach_reader(now, key);
        } else {
            link.stop(now, key);
        }
    }

    fn abort_random(&mut self) {
        let Some(c) = self.random_chan() else {
            return;
        };
        let now = self.pair.now;
        let end = if self.rng.random_bool(0.5) {
            End::Gateway
        } else {
            End::Worker
        };
        let chan = &mut self.chans[c];
        let key = match end {
            End::Gateway => chan.gkey,
            End::Worker => chan.wkey,
        };
        if let Some(key) = key {
            chan.aborted = true;
            self.pair.link(end).abort(now, key);
        }
    }

    fn drop_writer_random(&mut self) {
        let Some(c) = self.random_chan() else {
            return;
        };
        let d = self.rng.random_range(0..2);
        let now = self.pair.now;
        let chan = &mut self.chans[c];
        let (end, Some(key)) = chan.writer(d) else {
            return;
        };
        let dir = &mut chan.dirs[d];
        if dir.writer_gone {
            return;
        }
        dir.writer_gone = true;
        if !dir.finish_called && dir.writer_failed.is_none() {
            chan.aborted = true;
        }
        self.pair.link(end).detach_writer(now, key);
    }

    fn cancel_random(&mut self) {
        let Some(c) = self.random_chan() else {
            return;
        };
        let now = self.pair.now;
        let chan = &mut self.chans[c];
        if let Some(ticket) = chan.ticket.take() {
            chan.cancelled = true;
            self.pair.gateway.cancel_open(now, ticket);
        }
    }

    fn send_text(&mut self) {
        let side = self.rng.random_range(0..2);
        let end = if side == 0 { End::Gateway } else { End::Worker };
        let text = format!("t{}", self.texts_sent[side]);
        match self.pair.link(end).send_text(text) {
            Ok(()) => self.texts_sent[side] += 1,
            Err(SendTextError::Full(_) | SendTextError::Closed(_)) => {}
        }
    }

    /// Takes opened channels, accepts per policy, records text, and polls finishing writers.
    fn sync(&mut self) -> Result<(), String> {
        let now = self.pair.now;
        for chan in &mut self.chans {
            let Some(ticket) = chan.ticket else {
                continue;
            };
            match self.pair.gateway.take_opened(ticket) {
                None => {}
                Some(Ok(key)) => {
                    chan.ticket = None;
                    chan.gkey = Some(key);
                    let id = self
                        .pair
                        .gateway
                        .channel_id(key)
                        .ok_or("opened channel without an id")?;
                    chan.id = Some(id);
                    self.by_id.insert(id, chan.n as usize);
                }
                Some(Err(error)) => {
                    chan.ticket = None;
                    chan.cancelled = true;
                    if error.reason() != FailureReason::Closed || !self.link_lost {
                        return Err(format!("open failed: {error}"));
                    }
                }
            }
        }
        for (side, end) in [(0usize, End::Gateway), (1, End::Worker)] {
            for event in self.pair.take_events(end) {
                match event {
                    Event::Text(text) => {
                        let seq: u64 = text
                            .trim_start_matches('t')
                            .parse()
                            .map_err(|_| format!("garbled text {text:?}"))?;
                        let from = 1 - side;
                        let expected = self.texts_seen[from];
                        if seq != expected && !(self.link_lost && seq > expected) {
                            return Err(format!("text {seq} arrived, {expected} expected"));
                        }
                        self.texts_seen[from] = seq + 1;
                    }
                    Event::Incoming(id) => {
                        self.incoming.insert(id);
                    }
                    _ => {}
                }
            }
        }
        for c in 0..self.chans.len() {
            let chan = &self.chans[c];
            let announced = chan.id.is_some_and(|id| self.incoming.contains(&id));
            if chan.wkey.is_none() && chan.accept_failed.is_none() && announced {
                let due = match chan.accept {
                    Accept::Prompt => true,
                    Accept::Late(at) => now >= at,
                    Accept::Never => false,
                };
                if due {
                    self.accept(c);
                }
            }
        }
        for chan in &mut self.chans {
            for d in 0..2 {
                let (end, key) = chan.writer(d);
                let dir = &mut chan.dirs[d];
                let Some(key) = key else {
                    continue;
                };
                if dir.finish_called
                    && !dir.finished
                    && dir.writer_failed.is_none()
                    && !dir.writer_gone
                {
                    match self.pair.link(end).poll_finished(key) {
                        Ok(true) => dir.finished = true,
                        Ok(false) => {}
                        Err(error) => dir.writer_failed = Some(error.reason()),
                    }
                }
            }
        }
        Ok(())
    }

    fn accept(&mut self, c: usize) {
        let now = self.pair.now;
        let chan = &mut self.chans[c];
        let Some(id) = chan.id else {
            return;
        };
        if chan.wkey.is_some() || chan.accept_failed.is_some() {
            return;
        }
        match self.pair.worker.accept(now, id.as_str()) {
            Ok(key) => chan.wkey = Some(key),
            Err(error) => {
                // The worker never gets the channel: its ends of both directions fail.
                let reason = error.reason();
                chan.accept_failed = Some(reason);
                chan.dirs[0].reader_failed.get_or_insert(reason);
                chan.dirs[1].writer_failed.get_or_insert(reason);
            }
        }
    }

    /// How long settling may take: 300 s, or more when channels wait for few slots one after
    /// another, each possibly for its accept timeout and then its stall timeout.
    fn patience(&self) -> Duration {
        let config = self.pair.gateway.config();
        let per_channel = config.accept_timeout + config.stall_timeout + Duration::from_secs(30);
        let channels = u32::try_from(self.chans.len()).unwrap_or(u32::MAX);
        Duration::from_secs(300).max(per_channel.saturating_mul(channels))
    }

    fn settled(&self) -> bool {
        self.chans.iter().all(|chan| {
            chan.cancelled
                || chan.ticket.is_some() && self.link_lost
                || chan.dirs.iter().all(|dir| {
                    let writer_done = !dir.writer_active();
                    let reader_done = !dir.reader_active() || dir.stalled;
                    writer_done && reader_done
                })
        })
    }

    /// Lets every active party finish: writers write and finish, readers read (stalled readers
    /// only at the very end), late accepts happen, timeouts fire. Then drops every handle.
    fn quiesce(&mut self) -> Result<(), String> {
        let started = self.pair.now;
        let patience = self.patience();
        while !self.settled() {
            if self.pair.now.duration_since(started) > patience {
                return Err(format!("did not settle: {:?}", self.unsettled()));
            }
            for c in 0..self.chans.len() {
                for d in 0..2 {
                    self.write(c, d, u64::MAX);
                    if !self.chans[c].dirs[d].finish_called && self.chans[c].dirs[d].writer_active()
                    {
                        // Make sure every writer finishes eventually.
                        let dir = &self.chans[c].dirs[d];
                        if dir.written == dir.total {
                            let now = self.pair.now;
                            let (end, key) = self.chans[c].writer(d);
                            if let Some(key) = key {
                                self.chans[c].dirs[d].finish_called = true;
                                if let Err(error) = self.pair.link(end).finish(now, key) {
                                    self.chans[c].dirs[d].writer_failed = Some(error.reason());
                                }
                            }
                        }
                    }
                    if !self.chans[c].dirs[d].stalled {
                        self.read(c, d, usize::MAX)?;
                    }
                }
            }
            if self.pair.now.duration_since(started) > Duration::from_secs(31) {
                // Past the accept timeout: whatever was not accepted is refused by now.
                for c in 0..self.chans.len() {
                    self.accept(c);
                }
            }
            self.sync()?;
            let ms = self.rng.random_range(1..500);
            self.pair.advance(Duration::from_millis(ms))?;
            self.sync()?;
        }
        // Stalled readers wake up; everyone reads until every stream ended or failed.
        for chan in &mut self.chans {
            for dir in &mut chan.dirs {
                dir.stalled = false;
            }
        }
        let woke = self.pair.now;
        while !self.settled() {
            if self.pair.now.duration_since(woke) > patience {
                return Err(format!(
                    "did not settle after waking: {:?}",
                    self.unsettled()
                ));
            }
            for c in 0..self.chans.len() {
                for d in 0..2 {
                    self.read(c, d, usize::MAX)?;
                }
            }
            self.sync()?;
            let ms = self.rng.random_range(1..500);
            self.pair.advance(Duration::from_millis(ms))?;
        }
        // Drop every handle, then let the closing handshakes finish.
        let now = self.pair.now;
        for chan in &mut self.chans {
            if let Some(ticket) = chan.ticket.take() {
                self.pair.gateway.cancel_open(now, ticket);
            }
            for (end, key) in [(End::Gateway, chan.gkey), (End::Worker, chan.wkey)] {
                if let Some(key) = key {
                    let link = self.pair.link(end);
                    link.detach_reader(now, key);
                    link.detach_writer(now, key);
                }
            }
        }
        // An unaccepted channel stays until it is accepted or refused (30 s).
        self.pair.advance(Duration::from_secs(35))?;
        self.pair.drive()
    }

    fn unsettled(&self) -> Vec<String> {
        self.chans
            .iter()
            .filter(|chan| !chan.cancelled)
            .flat_map(|chan| {
                chan.dirs.iter().enumerate().filter_map(move |(d, dir)| {
                    let open = dir.writer_active() || (dir.reader_active() && !dir.stalled);
                    open.then(|| {
                        format!("channel {} dir {d}: {dir:?} (wkey {:?})", chan.n, chan.wkey)
                    })
                })
            })
            .collect()
    }

    fn check(&self, report: &mut SimReport) -> Result<(), String> {
        for (end, link) in [
            (End::Gateway, &self.pair.gateway),
            (End::Worker, &self.pair.worker),
        ] {
            if let Some(CloseReason::Violation(what)) = link.close_reason() {
                return Err(format!("{end:?} saw a protocol violation: {what}"));
            }
            if link.close_reason().is_some() && !self.link_lost {
                return Err(format!("{end:?} closed: {:?}", link.close_reason()));
            }
            let stats = link.stats();
            if stats.channel_states != 0
                || stats.channel_entries != 0
                || stats.open_channels != 0
                || stats.recv_buffered != 0
                || stats.send_buffered != 0
            {
                return Err(format!(
                    "{end:?} kept state after every handle went: {stats:?}{}",
                    if std::env::var_os("SIMLOCK_LINK_SIM_DEBUG").is_some() {
                        format!(
                            "\n{:#?}\n{:#?}\n{:#?}",
                            self.chans, self.pair.gateway, self.pair.worker
                        )
                    } else {
                        String::new()
                    }
                ));
            }
        }
        if let Some(error) = self.pair.monitor.errors.first() {
            return Err(format!("credit monitor: {error}"));
        }
        let config = self.pair.gateway.config();
        if self.pair.monitor.max_payload > config.max_data_frame {
            return Err("a DATA frame exceeded the frame size".into());
        }
        for chan in &self.chans {
            if chan.cancelled || chan.id.is_none() {
                continue;
            }
            report.channels += 1;
            for (d, dir) in chan.dirs.iter().enumerate() {
                let what = format!("channel {} dir {d}", chan.n);
                report.bytes_delivered += dir.read;
                if dir.eof {
                    report.clean_ends += 1;
                    continue;
                }
                let reasons: Vec<FailureReason> = [dir.reader_failed, dir.writer_failed]
                    .into_iter()
                    .flatten()
                    .collect();
                if reasons.is_empty() && !dir.reader_stopped {
                    return Err(format!("{what}: neither delivered nor failed: {dir:?}"));
                }
                for reason in reasons {
                    *report.failures.entry(reason.as_str()).or_default() += 1;
                    let fits = match reason {
                        FailureReason::Stopped => {
                            dir.reader_stopped && dir.reader_failed != Some(FailureReason::Stopped)
                        }
                        FailureReason::Aborted => chan.aborted,
                        FailureReason::Closed => self.link_lost,
                        FailureReason::Stalled => {
                            self.big_jump || chan.dirs.iter().any(|dir| dir.was_stalled)
                        }
                        FailureReason::Refused => chan.wkey.is_none(),
                    };
                    if !fits {
                        return Err(format!(
                            "{what}: failed {reason}, which does not fit: {dir:?} {chan:?}"
                        ));
                    }
                }
            }
        }
        report.links_lost += u64::from(self.link_lost);
        report.texts += self.texts_seen.iter().sum::<u64>();
        Ok(())
    }
}
