//! The state shared by the driver task and the application's handles: the sans-IO [`Link`]
//! behind one lock, and the wakers of whoever waits on it.
//!
//! Every access goes through [`Shared::with`], which runs the caller's operation, turns the
//! link's events into wake-ups (collected under the lock, woken after it is released) and wakes
//! the driver when the link has something to send or an earlier deadline.

use std::{
    collections::{BTreeMap, VecDeque},
    sync::{
        Arc,
        atomic::{AtomicU64, Ordering},
    },
    task::Waker,
    time::Instant,
};

use parking_lot::Mutex;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use crate::{
    error::CloseReason,
    proto::{ChannelKey, Event, Link, OpenTicket},
};

/// The shared half of a link.
#[derive(Debug)]
pub(crate) struct Shared {
    state: Mutex<State>,
    closed: watch::Sender<Option<CloseReason>>,
    /// Cancelled when the driver task ends: the close handshake done, or given up.
    finished: CancellationToken,
    next_waiter: AtomicU64,
}

/// Everything behind the lock.
#[derive(Debug)]
pub(crate) struct State {
    pub(crate) link: Link,
    /// The driver task, to wake when there is work for it.
    pub(crate) driver: Option<Waker>,
    /// The driver was woken and has not run since.
    driver_woken: bool,
    /// The deadline the driver's timer is set to.
    pub(crate) timer: Option<Instant>,
    /// The driver stopped reading because the text inbox is full.
    pub(crate) reading_paused: bool,
    /// The socket receive buffer the driver set, once it fitted one to the round trip.
    pub(crate) receive_buffer: Option<usize>,
    pub(crate) readers: BTreeMap<ChannelKey, Waker>,
    pub(crate) writers: BTreeMap<ChannelKey, Waker>,
    pub(crate) opens: BTreeMap<OpenTicket, Waker>,
    pub(crate) text_senders: BTreeMap<u64, Waker>,
    /// Text received and not yet taken by the `TextReceiver`.
    pub(crate) inbox: VecDeque<String>,
    pub(crate) inbox_bytes: usize,
    pub(crate) text_reader: Option<Waker>,
    /// The `TextReceiver` still exists (otherwise text is dropped on arrival).
    pub(crate) text_receiver_alive: bool,
}

impl State {
    /// The inbox has room for more text.
    pub(crate) fn inbox_has_room(&self) -> bool {
        self.inbox_bytes < self.link.config().text_receive_buffer
    }

    fn dispatch(&mut self, wakes: &mut Vec<Waker>, closed: &watch::Sender<Option<CloseReason>>) {
        while let Some(event) = self.link.poll_event() {
            match event {
                Event::OpenReady(ticket) => wakes.extend(self.opens.remove(&ticket)),
                Event::Incoming(id) => {
                    tracing::trace!(channel = %id, "link channel waits for accept")
                }
                Event::Readable(key) => wakes.extend(self.readers.remove(&key)),
                Event::Writable(key) => wakes.extend(self.writers.remove(&key)),
                Event::Text(text) => {
                    if self.text_receiver_alive {
                        self.inbox_bytes += text.len();
                        self.inbox.push_back(text);
                        wakes.extend(self.text_reader.take());
                    }
                }
                Event::TextWritable => {
                    wakes.extend(std::mem::take(&mut self.text_senders).into_values());
                }
                Event::Closed(reason) => {
                    closed.send_replace(Some(reason));
                    wakes.extend(self.text_reader.take());
                    wakes.extend(std::mem::take(&mut self.readers).into_values());
                    wakes.extend(std::mem::take(&mut self.writers).into_values());
                    wakes.extend(std::mem::take(&mut self.opens).into_values());
                }
            }
        }
    }
}

impl Shared {
    pub(crate) fn new(link: Link) -> Arc<Self> {
        Arc::new(Self {
            state: Mutex::new(State {
                link,
                driver: None,
                driver_woken: false,
                timer: None,
                reading_paused: false,
                receive_buffer: None,
                readers: BTreeMap::new(),
                writers: BTreeMap::new(),
                opens: BTreeMap::new(),
                text_senders: BTreeMap::new(),
                inbox: VecDeque::new(),
                inbox_bytes: 0,
                text_reader: None,
                text_receiver_alive: true,
            }),
            closed: watch::Sender::new(None),
            finished: CancellationToken::new(),
            next_waiter: AtomicU64::new(0),
        })
    }

    /// A fresh id for a waiter in one of the waker maps.
    pub(crate) fn waiter_id(&self) -> u64 {
        self.next_waiter.fetch_add(1, Ordering::Relaxed)
    }

    /// Subscribes to the link's close reason.
    pub(crate) fn closed(&self) -> watch::Receiver<Option<CloseReason>> {
        self.closed.subscribe()
    }

    /// Fires when the driver task has ended.
    pub(crate) fn finished(&self) -> &CancellationToken {
        &self.finished
    }

    /// Runs `op` on the state from an application handle, then wakes whoever its effects concern,
    /// the driver included.
    pub(crate) fn with<R>(&self, op: impl FnOnce(&mut State, Instant) -> R) -> R {
        self.run(op, false)
    }

    /// Runs `op` on the state from the driver, which needs no wake-up of its own.
    pub(crate) fn with_driver<R>(&self, op: impl FnOnce(&mut State, Instant) -> R) -> R {
        self.run(op, true)
    }

    fn run<R>(&self, op: impl FnOnce(&mut State, Instant) -> R, driver: bool) -> R {
        let mut wakes = Vec::new();
        let result = {
            let mut state = self.state.lock();
            let now = tokio::time::Instant::now().into_std();
            let result = op(&mut state, now);
            state.dispatch(&mut wakes, &self.closed);
            if driver {
                state.driver_woken = false;
            } else if !state.driver_woken {
                let earlier_deadline = match (state.link.poll_timeout(), state.timer) {
                    (Some(next), Some(timer)) => next < timer,
                    (Some(_), None) => true,
                    (None, _) => false,
                };
                let wanted = state.link.has_transmit()
                    || earlier_deadline
                    || (state.reading_paused && state.inbox_has_room());
                if wanted && let Some(waker) = state.driver.clone() {
                    state.driver_woken = true;
                    wakes.push(waker);
                }
            }
            result
        };
        for waker in wakes {
            waker.wake();
        }
        result
    }
}
