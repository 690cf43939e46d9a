//! The fleet core: every decision the gateway makes, as plain data taking `now`. No tokio, no
//! clock, no I/O (checked by `cargo xtask ci`).
//!
//! Inputs are `handle_*` calls: an uplink opened, passed its handshake, closed; a view was read;
//! a worker answered a forwarded request or sent an event; a caller asked, cancelled, renewed,
//! released; time passed ([`Core::handle_tick`]). Each one changes the state and queues what
//! must follow as [`Effect`]s (forward this request to that worker, answer this waiter, push this
//! notice, record this event, read that view, release that orphan, close that uplink), which the
//! async shell ([`crate::fleet`]) drains and carries out under the same lock, in order. Queries
//! (`views`, `lease`, `leases`, `waiting`) read the state as it is.
//!
//! The decisions follow one order, and [`Stamp`]s name moments in it: a view read is stamped
//! when its `status.get` goes out, so the lease index can tell a snapshot taken before a release
//! from one taken after (see [`index`]). A waiter is answered in the same decision that indexes
//! its grant, so from the moment a caller holds a grant, the gateway knows its lease.

pub mod index;
pub mod queue;
pub mod routing;
pub mod views;

#[cfg(any(test, feature = "sim"))]
pub mod sim;
#[cfg(test)]
pub(crate) mod tests;

use std::collections::{BTreeMap, BTreeSet, HashMap, VecDeque};

use simlock_contract::event::{
    CrashedDevice, Event, RejectionReason, WaitPolicy, WorkerRemovedReason,
};
use simlock_contract::ids::{LeaseId, RequestId};
use simlock_contract::model::{
    Connection, Device, EventEnvelope, LeaseEndReason, LeaseGrant, LeaseLimits, LeaseRecord,
    Platform, ProtocolPair, WaitStage, WaitingRequest, WorkerRef, WorkerView,
};
use simlock_contract::ops::{CancelResult, LeaseRequestInput, StatusOutput};
use simlock_contract::push::{Progress, Push, WaitingFor};
use simlock_contract::{ContractError, ErrorCode, ProtocolRange};
use simlock_daemon::context::Viewer;
use tracing::{debug, info, warn};

use crate::error::{FleetError, is_uplink_lost};
use index::{
    EndedLease, Entry, ForwardAnswer, LeaseIndex, Recorded, Renewal, StoreChange, gateway_lease_id,
    split_lease_id, worker_of,
};
pub use index::{Stamp, StoredForward, StoredOrphan};
use queue::{Attempt, Booked, Queue, Stage, Waiter};
use routing::{Assessment, Match, Pick, Wanted, assess, select};
pub use views::Refresh;
use views::{Granted, apply_read, blank_view, count_grant, renew_in_place};

/// How long an answered request's idempotency key is remembered (10 min).
pub const BOOK_RETENTION_MS: i64 = 600_000;

/// Consecutive `status.get` timeouts that close an uplink.
pub const MAX_STATUS_TIMEOUTS: u32 = 2;

/// What the decisions need from configuration.
#[derive(Debug, Clone)]
pub struct Settings {
    /// The gateway's instance id.
    pub gateway_id: String,
    /// The gateway's lease limits.
    pub limits: LeaseLimits,
    /// Every worker view is read again this often, ms.
    pub refresh_interval_ms: i64,
    /// A view read asked for by events waits this long after the previous one ended, ms (the
    /// asks in between fold into it).
    pub refresh_gap_ms: i64,
    /// A forwarded lease request fails if its worker has not answered in this long, ms.
    pub lease_request_timeout_ms: i64,
    /// A disconnected worker's view is forgotten after this long, ms.
    pub disconnected_retention_ms: i64,
    /// `lease.maxWaiting`: the most requests the fleet queue holds.
    pub max_waiting: u32,
}

/// Who calls, for ownership checks.
#[derive(Debug, Clone, Copy)]
pub struct Caller<'a> {
    /// The caller's principal.
    pub principal: &'a str,
    /// Whether the caller is an admin (operators, the gateway's own uplinks).
    pub admin: bool,
    /// The caller's connection, if it has one (its own `lease-lost` is skipped).
    pub connection: Option<u64>,
}

impl<'a> Caller<'a> {
    /// The caller as the one visibility rule sees it ([`Viewer::may_see`]).
    pub const fn viewer(self) -> Viewer<'a> {
        Viewer {
            principal: self.principal,
            admin: self.admin,
        }
    }

    fn may_act_for(self, owner: &str) -> bool {
        self.viewer().may_see(owner)
    }
}

/// How one of a worker's leases shows to a viewer at the gateway ([`Core::seen`]).
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Seen<'a> {
    /// A lease the gateway issued, and the viewer's to see (its owner, or an admin).
    Issued(&'a Entry),
    /// A lease made on the worker directly: an admin's to see.
    Direct,
    /// Not the viewer's to see.
    Hidden,
}

/// A `lease.request` arriving at the gateway.
#[derive(Debug, Clone)]
pub struct Ask {
    /// The request's id (minted by the shell).
    pub request_id: RequestId,
    /// The input as the caller sent it.
    pub input: LeaseRequestInput,
    /// The caller's principal (the lease's owner).
    pub principal: String,
}

/// How admission ended.
#[derive(Debug, Clone, PartialEq)]
pub enum Admitted {
    /// A new waiter: follow it until it is answered.
    New(RequestId),
    /// A repeat of a request still waiting (same idempotency key): follow that one, first
    /// told where it stands (its queue position and why it waits, once it was queued).
    Joined(RequestId, Option<Progress>),
    /// A repeat of an answered request: its outcome.
    Replay(Box<Result<LeaseGrant, FleetError>>),
}

/// Why a view could not be read.
#[derive(Debug, Clone, PartialEq)]
pub enum RefreshFailure {
    /// `status.get` did not answer within the call bound.
    StatusTimeout,
    /// A call failed.
    Failed(ContractError),
}

/// Where a lease lives, for a call about it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LeaseTarget {
    /// The gateway's id for it.
    pub lease_id: String,
    /// The worker holding it.
    pub worker_id: String,
    /// The uplink to that worker.
    pub generation: u64,
    /// The worker's id for it.
    pub worker_lease_id: String,
    /// Its requester, without the gateway's prefix.
    pub requester_id: String,
    /// The requester as the worker knows it (with the gateway's prefix).
    pub worker_requester_id: String,
}

/// What an orphan's expiry allows for a worker's clock running behind the gateway's.
pub const ORPHAN_CLOCK_MARGIN_MS: i64 = 60_000;

/// How a release goes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Release {
    /// Send it to the worker holding the lease; report with [`Core::handle_release_answered`].
    Send(LeaseTarget),
    /// The lease's worker is away: the release is answered now (this gateway id), and carried
    /// out once the worker is back, as an orphan's ([`Effect::ReleaseOrphan`]).
    Deferred(String),
}

/// What the gateway keeps of a worker across its own restarts (written through
/// [`Effect::Remember`], read back into [`Core::new`]): that it exists, what it is called and
/// when it was last seen, so that a worker away when the gateway restarts is still listed, and
/// still forgotten when its retention passes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KnownWorker {
    /// Its id.
    pub id: String,
    /// Its label.
    pub label: Option<String>,
    /// When its worker was last heard from: its uplink's handshake, or the last thing that
    /// uplink carried before it closed; ms since the epoch.
    pub seen_at: i64,
    /// Whether its uplink was up when this was written.
    pub connected: bool,
}

impl KnownWorker {
    /// When a gateway starting at `now` counts it last seen: a worker whose uplink was up when
    /// the gateway went away (stopped, or crashed before its close was written) was seen until
    /// then, which is no earlier than what was written, and is taken as `now`.
    pub fn last_seen(&self, now: i64) -> i64 {
        if self.connected {
            now.max(self.seen_at)
        } else {
            self.seen_at
        }
    }
}

/// What the shell must carry out, in order.
#[derive(Debug, Clone, PartialEq)]
pub enum Effect {
    /// Forward a lease request to a worker (with `noWait`, its own model name, the namespaced
    /// requester and the owner) and report its progress and answer for `attempt`.
    Forward {
        /// The forward.
        attempt: u64,
        /// The worker.
        worker_id: String,
        /// Its uplink.
        generation: u64,
        /// The request the worker gets.
        input: LeaseRequestInput,
    },
    /// Answer every caller of a waiter; it is gone from the queue.
    Answer {
        /// The request.
        request: RequestId,
        /// Its outcome (boxed: a grant is large beside the other effects).
        outcome: Box<Result<LeaseGrant, FleetError>>,
    },
    /// Tell a waiter's callers how it goes.
    Progress {
        /// The request.
        request: RequestId,
        /// What happened.
        progress: Progress,
    },
    /// Record an event on the gateway's bus (module `fleet`).
    Event(Event),
    /// A lease left the index (it ended, its worker was forgotten): tell whoever follows the
    /// index's removals (the agent-device front's relay host link).
    Dropped {
        /// The gateway's id for it.
        lease_id: String,
    },
    /// Record a worker's event on the gateway's bus, as it came plus its worker id.
    Relay(EventEnvelope),
    /// Push a lease notice to an owner's connections (but `except`).
    Notice {
        /// The owner.
        owner: String,
        /// The push.
        push: Push,
        /// The connection that asked for what ended the lease.
        except: Option<u64>,
    },
    /// Read a worker's view again: `status.get` and the device list, the catalog and config
    /// too when `catalog`; report with `sent` ([`Core::handle_refreshed`]).
    Refresh {
        /// The worker.
        worker_id: String,
        /// Its uplink.
        generation: u64,
        /// The moment the read goes out.
        sent: Stamp,
        /// Whether to read the catalog and config.
        catalog: bool,
    },
    /// Release a lease a worker granted to a request nobody waits for any more; report with
    /// [`Core::handle_orphan_released`].
    ReleaseOrphan {
        /// The worker.
        worker_id: String,
        /// Its uplink.
        generation: u64,
        /// The worker's id for the lease.
        worker_lease_id: String,
    },
    /// Store what is known of a worker (in order with [`Effect::Forget`]); a failure loses
    /// only its listing after a restart, until it reconnects.
    Remember(KnownWorker),
    /// Delete what was stored of a worker the gateway forgot.
    Forget {
        /// The worker.
        worker_id: String,
    },
    /// Store a lease the gateway is releasing on its worker (in order with
    /// [`Effect::SettleOrphan`]), read back into [`Core::restore_orphans`] after a restart; a
    /// failure leaves it to come back as a live lease after a restart, until its TTL.
    StoreOrphan(StoredOrphan),
    /// Delete a stored orphan: released, or found gone.
    SettleOrphan {
        /// The worker.
        worker_id: String,
        /// The worker's id for the lease.
        worker_lease_id: String,
    },
    /// Store a lease request forwarded to a worker (in order with [`Effect::SettleForward`]),
    /// read back into [`Core::restore_forwards`] after a restart; a failure leaves a grant whose
    /// answer the restart lost to be indexed as its requester's lease, until its TTL.
    StoreForward(StoredForward),
    /// Delete a stored forward: answered, its grant found, or expired.
    SettleForward {
        /// The worker.
        worker_id: String,
        /// The requester, without the gateway's prefix.
        requester_id: String,
    },
    /// Close an uplink, telling the worker why.
    Close {
        /// The uplink.
        generation: u64,
        /// Why: the text of the close frame the worker logs.
        why: Closing,
    },
}

/// Why the gateway closes a worker's uplink; its text is the close frame's, which the worker
/// logs as the reason its uplink went down (so it fits the frame's 123 bytes).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Closing {
    /// The same worker id connected again: a restarted worker whose old uplink had not closed
    /// yet, or a second worker started from a copy of this one's home (one instance id).
    Replaced,
    /// The worker left [`MAX_STATUS_TIMEOUTS`] status reads in a row unanswered.
    Unresponsive,
    /// The gateway is stopping.
    Stopping,
    /// An operator revoked the join token the uplink was opened with.
    TokenRevoked,
}

impl std::fmt::Display for Closing {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Replaced => f.write_str(
                "replaced by a newer uplink of this worker id (do two workers share one SIMLOCK_HOME?)",
            ),
            Self::Unresponsive => write!(
                f,
                "the worker left {MAX_STATUS_TIMEOUTS} status reads in a row unanswered"
            ),
            Self::Stopping => f.write_str("the gateway is stopping"),
            Self::TokenRevoked => f.write_str(
                "its join token was revoked: start the worker with a new one (gateway.token)",
            ),
        }
    }
}

/// A worker's live uplink, as the decisions see it.
#[derive(Debug, Clone)]
struct Link {
    generation: u64,
    token_id: String,
    /// A refresh is out (its stamp).
    refreshing: Option<Stamp>,
    /// More were asked while it ran: one more follows (with the catalog if any asked for it).
    again: Option<bool>,
    /// The next read goes out no sooner than this (the refresh gap after the last one).
    spaced_until: i64,
    /// Status reads in a row that timed out.
    timeouts: u32,
    /// When the next periodic refresh is due (once subscribed).
    periodic_at: Option<i64>,
    /// The worker's events come up this uplink: the releases of orphans go out from then on, so
    /// their `lease.released` reaches the gateway's event stream.
    subscribed: bool,
    /// A failed catalog read was asked for again once: the next failure waits for the
    /// periodic refresh.
    catalog_retried: bool,
    /// The catalog is still to be read (its last read failed).
    catalog_due: bool,
    /// How many refreshes this uplink was asked for (folded ones included).
    asked: u64,
}

/// Hands out view revisions. The one counter of them: unique per gateway, so a worker
/// forgotten and seen again never repeats one.
#[derive(Debug, Clone, Default)]
struct Revisions(u64);

impl Revisions {
    fn next(&mut self) -> u64 {
        self.0 += 1;
        self.0
    }
}

#[derive(Debug, Clone)]
struct Worker {
    view: WorkerView,
    link: Option<Link>,
    /// The view's revision: a fresh one for a new view, and a new one whenever a read changes
    /// what a refusal is remembered against ([`Worker::apply_read`]).
    revision: u64,
    /// Forgotten past retention while drained: only its drain flag is kept, so it is not swept
    /// again while it stays drained (see [`Worker::awaits_retention`]).
    retained: bool,
    /// Whether it is a worker at all: its uplink passed a handshake, or it was stored (known,
    /// or drained). A WebSocket that joined and closed without a handshake leaves nothing.
    known: bool,
    /// The platforms it answered `NO_CAPACITY` for since its last read: its view is stale for
    /// every request of that platform, not only the refused one's (else each waiter in turn
    /// would be sent there and refused). The read the refusal asks for clears it, changed or
    /// not; the refused waiter itself waits for a read that changes the view (`refusals`).
    no_room: Vec<Platform>,
    /// The grants heard of since the last read sent after them, counted into the view
    /// ([`views::count_grant`]) until a read shows them.
    granted: Vec<Granted>,
}

impl Worker {
    fn new(view: WorkerView, revisions: &mut Revisions, retained: bool, known: bool) -> Self {
        Self {
            view,
            link: None,
            revision: revisions.next(),
            retained,
            known,
            no_room: Vec::new(),
            granted: Vec::new(),
        }
    }

    /// Folds one read of the worker sent at `sent` (its status, its device list when read) into
    /// its view ([`apply_read`]), with the grants heard of after it was sent counted in: a grant
    /// heard of before is in what the worker answered, as it grants before it answers. The one
    /// place a view takes what a refusal is remembered against (capacity, devices, health, the
    /// leases held, queue depth), so its revision moves whenever one of them changes.
    fn apply_read(
        &mut self,
        revisions: &mut Revisions,
        status: &StatusOutput,
        devices: Option<Vec<Device>>,
        sent: Stamp,
        now: i64,
    ) {
        self.granted.retain(|g| g.at > sent);
        if apply_read(&mut self.view, status, devices, &self.granted, now) {
            self.revision = revisions.next();
        }
        self.no_room.clear();
    }

    /// The worker granted `device` (heard of at `at`): counted into the view until a read sent
    /// after `at` shows it ([`views::count_grant`]).
    fn granted(&mut self, granted: Granted) {
        let view = &mut self.view;
        count_grant(view.capacity.as_mut(), view.devices.as_mut(), &granted);
        self.granted.push(granted);
    }

    /// Whether retention's clock runs for it: disconnected, and not a drain flag kept past
    /// retention (undrained, what is kept is forgotten at the next sweep).
    fn awaits_retention(&self) -> bool {
        self.link.is_none()
            && self.view.connection == Connection::Disconnected
            && !(self.retained && self.view.drained)
    }
}

/// A deliberately broken decision, to show the simulation catches it. Only the simulation's
/// own tests set one ([`Core::break_with`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fault {
    /// A grant is recorded twice: its lease also answers the next waiter of the same platform.
    GrantTwice,
    /// A view read before a release brings the released lease back (race (a) of issue 13).
    StaleViewRevives,
    /// A grant's lease is known only once a view lists it (race (b) of issue 13).
    GrantKnownFromViews,
    /// A restart forgets the leases it was releasing (the stored orphans are not taken back).
    OrphansForgotten,
    /// A grant whose answer was lost is indexed as its requester's lease when a view lists it
    /// (the forwards out are not screened for).
    LostGrantsIndexed,
    /// A forward out is forgotten at its bound while its worker is away (a worker stopped with
    /// the request unread grants it once it runs again, and the grant is indexed).
    ForwardsForgottenWhileAway,
}

/// The fleet's state and every decision about it.
#[derive(Debug, Clone)]
pub struct Core {
    settings: Settings,
    prefix: String,
    workers: BTreeMap<String, Worker>,
    /// The worker of each attached uplink.
    generations: HashMap<u64, String>,
    /// The view revisions handed out.
    revisions: Revisions,
    index: LeaseIndex,
    queue: Queue,
    /// Gateway leases being released by a caller, with the caller's connection, so the owner's
    /// `lease-lost` skips the connection that asked.
    releasing: HashMap<String, Option<u64>>,
    stamp: Stamp,
    next_generation: u64,
    next_attempt: u64,
    last_depth: u32,
    stopping: bool,
    fx: VecDeque<Effect>,
    fault: Option<Fault>,
}

impl Core {
    /// A fleet with no worker connected; `drained` are the workers drained before a restart,
    /// with when.
    pub fn new(
        settings: Settings,
        drained: Vec<(String, i64)>,
        known: Vec<KnownWorker>,
        now: i64,
    ) -> Self {
        let prefix = simlock_contract::ids::gateway_requester_prefix(&settings.gateway_id);
        let mut revisions = Revisions::default();
        let mut workers: BTreeMap<String, Worker> = drained
            .into_iter()
            .map(|(id, at)| {
                let mut view = blank_view(&id, None, at, Connection::Disconnected);
                view.drained = true;
                // Nothing is known of it but its drain flag: there is nothing to sweep.
                (id, Worker::new(view, &mut revisions, true, true))
            })
            .collect();
        for worker in known {
            let seen = worker.last_seen(now);
            let drained = workers.get(&worker.id).is_some_and(|w| w.view.drained);
            let mut view = blank_view(&worker.id, worker.label, seen, Connection::Disconnected);
            view.drained = drained;
            // Known, and away until it reconnects: retention runs from when it was last seen.
            workers.insert(worker.id, Worker::new(view, &mut revisions, false, true));
        }
        Self {
            index: LeaseIndex::new(prefix.clone()),
            prefix,
            settings,
            workers,
            generations: HashMap::new(),
            revisions,
            queue: Queue::default(),
            releasing: HashMap::new(),
            stamp: 0,
            next_generation: 1,
            next_attempt: 1,
            last_depth: 0,
            stopping: false,
            fx: VecDeque::new(),
            fault: None,
        }
    }

    /// Takes back the orphans stored before a restart ([`Effect::StoreOrphan`]): no view brings
    /// them back as live leases, and each is released once its worker is connected.
    pub fn restore_orphans(&mut self, orphans: Vec<StoredOrphan>) {
        if self.broken(Fault::OrphansForgotten) {
            return;
        }
        let at = self.next_stamp();
        for orphan in orphans {
            self.index.restore_orphan(orphan, at);
        }
    }

    /// Takes back the forwards out stored before a restart ([`Effect::StoreForward`]): their
    /// answers are lost, and a grant of one a view lists is released, never indexed.
    pub fn restore_forwards(&mut self, forwards: Vec<StoredForward>) {
        for forward in forwards {
            self.index.restore_forward(forward);
        }
    }

    /// Breaks one decision on purpose: the simulation's own tests show it catches each
    /// [`Fault`] with the seed that shows it. Nothing else calls this.
    #[doc(hidden)]
    pub fn break_with(&mut self, fault: Fault) {
        self.fault = Some(fault);
        self.index.revive_stale = fault == Fault::StaleViewRevives;
    }

    fn broken(&self, fault: Fault) -> bool {
        self.fault == Some(fault)
    }

    // === Effects ===

    /// The next effect to carry out.
    pub fn poll_effect(&mut self) -> Option<Effect> {
        self.note_depth();
        self.note_dropped();
        self.fx.pop_front()
    }

    /// Every effect queued so far, in order.
    pub fn take_effects(&mut self) -> Vec<Effect> {
        self.note_depth();
        self.note_dropped();
        self.fx.drain(..).collect()
    }

    fn note_dropped(&mut self) {
        for lease_id in self.index.take_dropped() {
            self.fx.push_back(Effect::Dropped { lease_id });
        }
        for change in self.index.take_store_changes() {
            self.fx.push_back(match change {
                StoreChange::Kept(orphan) => Effect::StoreOrphan(orphan),
                StoreChange::Settled(worker_id, worker_lease_id) => Effect::SettleOrphan {
                    worker_id,
                    worker_lease_id,
                },
                StoreChange::ForwardKept(forward) => Effect::StoreForward(forward),
                StoreChange::ForwardSettled(worker_id, requester_id) => Effect::SettleForward {
                    worker_id,
                    requester_id,
                },
            });
        }
    }

    /// Tells waiter `request`'s callers `progress`, and keeps it for a repeat that joins later.
    fn tell(&mut self, request: RequestId, progress: Progress) {
        if let Some(waiter) = self.queue.get_mut(&request) {
            waiter.told = Some(progress);
        }
        self.fx.push_back(Effect::Progress { request, progress });
    }

    fn note_depth(&mut self) {
        for (request, position) in self.queue.moved() {
            let waiting_for = self.queue.get(&request).and_then(|w| w.told_waiting);
            self.tell(
                request,
                Progress::Queued {
                    queue_position: position,
                    waiting_for,
                },
            );
        }
        let depth = self.queue.depth();
        if depth != self.last_depth {
            self.last_depth = depth;
            self.fx
                .push_back(Effect::Event(Event::QueueChanged { depth }));
        }
    }

    fn event(&mut self, event: Event) {
        self.fx.push_back(Effect::Event(event));
    }

    fn next_stamp(&mut self) -> Stamp {
        self.stamp += 1;
        self.stamp
    }

    // === Queries ===

    /// The gateway's requester prefix: `gw:<id>:`.
    pub fn prefix(&self) -> &str {
        &self.prefix
    }

    /// The lease limits.
    pub const fn limits(&self) -> LeaseLimits {
        self.settings.limits
    }

    /// Every view, in id order.
    pub fn views(&self) -> Vec<WorkerView> {
        self.workers.values().map(|w| w.view.clone()).collect()
    }

    /// Every view, in id order, without copying.
    pub fn view_refs(&self) -> impl Iterator<Item = &WorkerView> {
        self.workers.values().map(|w| &w.view)
    }

    /// One worker's view.
    pub fn view(&self, worker_id: &str) -> Option<&WorkerView> {
        self.workers.get(worker_id).map(|w| &w.view)
    }

    /// A worker's label.
    pub fn label_of(&self, worker_id: &str) -> Option<String> {
        self.workers.get(worker_id)?.view.label.clone()
    }

    /// How callers are told where a lease or device lives: the worker's id, its label and how
    /// its uplink stands now (a worker the gateway has no view of is disconnected).
    pub fn worker_ref(&self, worker_id: &str) -> WorkerRef {
        let view = self.workers.get(worker_id).map(|w| &w.view);
        WorkerRef {
            id: worker_id.to_owned(),
            label: view.and_then(|v| v.label.clone()),
            connection: Some(view.map_or(Connection::Disconnected, |v| v.connection)),
        }
    }

    /// The workers whose leases this gateway has not read since it started (each away since,
    /// or not yet read): their leases are in no list until each reports.
    pub fn unread_workers(&self) -> Vec<WorkerRef> {
        self.workers
            .iter()
            .filter(|(_, w)| w.view.leases.is_none())
            .map(|(id, _)| self.worker_ref(id))
            .collect()
    }

    /// The uplink of `worker_id` that takes calls: attached and connected (handshake passed).
    pub fn live_generation(&self, worker_id: &str) -> Option<u64> {
        let worker = self.workers.get(worker_id)?;
        (worker.view.connection == Connection::Connected)
            .then(|| worker.link.as_ref().map(|l| l.generation))
            .flatten()
    }

    /// The uplink of `worker_id` an orphan's release goes out on: live, and subscribed to its
    /// events (until then, [`Self::handle_subscribed`] sends them all).
    fn releasing_generation(&self, worker_id: &str) -> Option<u64> {
        let generation = self.live_generation(worker_id)?;
        let link = self.workers.get(worker_id)?.link.as_ref()?;
        link.subscribed.then_some(generation)
    }

    /// The worker an uplink belongs to, while it is attached.
    pub fn worker_of_generation(&self, generation: u64) -> Option<&str> {
        self.generations.get(&generation).map(String::as_str)
    }

    /// How many refreshes an uplink was asked for (folded ones included).
    pub fn refreshes_asked(&self, generation: u64) -> u64 {
        self.generations
            .get(&generation)
            .and_then(|id| self.workers.get(id)?.link.as_ref())
            .map_or(0, |l| l.asked)
    }

    /// Whether a view read is out or folded, waiting for its gap, on any uplink.
    pub fn refreshes_pending(&self) -> bool {
        self.workers
            .values()
            .filter_map(|w| w.link.as_ref())
            .any(|l| l.refreshing.is_some() || l.again.is_some())
    }

    /// Every uplink attached, with the join token it came with.
    pub fn uplinks(&self) -> Vec<(u64, String)> {
        self.workers
            .values()
            .filter_map(|w| w.link.as_ref())
            .map(|l| (l.generation, l.token_id.clone()))
            .collect()
    }

    /// The lease index.
    pub const fn index(&self) -> &LeaseIndex {
        &self.index
    }

    /// The index entry of `lease_id`.
    pub fn lease(&self, lease_id: &str) -> Option<&Entry> {
        self.index.get(lease_id)
    }

    /// The waiter `id`, while it waits.
    pub fn waiter(&self, id: &RequestId) -> Option<&Waiter> {
        self.queue.get(id)
    }

    /// The waiters, oldest first.
    pub fn waiters(&self) -> &[Waiter] {
        self.queue.waiters()
    }

    /// The number of requests waiting in the fleet queue.
    pub fn queue_depth(&self) -> u32 {
        self.queue.depth()
    }

    /// The owner of `requester`'s pending request, if it has one.
    pub fn pending_owner(&self, requester: &str) -> Option<&str> {
        self.queue.pending_of(requester).map(|w| w.owner.as_str())
    }

    /// The fleet queue's waiting requests, oldest first.
    pub fn waiting(&self) -> Vec<WaitingRequest> {
        self.waiting_seen_by(Viewer::ADMIN)
    }

    /// The fleet queue's waiting requests `viewer` may see (an agent its own), oldest first.
    fn waiting_seen_by(&self, viewer: Viewer<'_>) -> Vec<WaitingRequest> {
        // A waiter's place is its index among them all, counted in the same pass.
        self.queue
            .waiters()
            .iter()
            .zip(1u32..)
            .filter(|(w, _)| viewer.may_see(&w.owner))
            .map(|(w, position)| WaitingRequest {
                id: w.id.clone(),
                requester_id: w.requester.clone(),
                spec: w.wanted.requested(),
                created_at: w.created_at,
                stage: if w.is_queued() {
                    WaitStage::Queued
                } else {
                    WaitStage::Starting
                },
                queue_position: w.is_queued().then_some(position),
                waiting_for: w.is_queued().then_some(w.told_waiting).flatten(),
                worker_id: w.attempt().map(|a| a.worker_id.clone()),
                worker: w.attempt().map(|a| self.worker_ref(&a.worker_id)),
            })
            .collect()
    }

    /// Every request waiting, as far as `viewer` may see them: the fleet queue's (an agent its
    /// own), then each connected worker's own with its worker (an agent only those the gateway
    /// forwarded for a pending request of its own). A worker's request that is the gateway's
    /// forward of a fleet request starting on that worker is that request, listed once, as the
    /// fleet queue's.
    pub fn all_waiting(&self, viewer: Viewer<'_>) -> Vec<WaitingRequest> {
        let mut waiting = self.waiting_seen_by(viewer);
        // A worker that is away says nothing of what waits on it now: the gateway's forward of
        // a request to it has failed, and a worker that restarts ends its waiting requests. Its
        // last report stays in its own view only.
        let connected = self
            .view_refs()
            .filter(|view| view.connection == Connection::Connected);
        for view in connected {
            for w in view.waiting.as_deref().unwrap_or_default() {
                if self.may_see_forwarded(viewer, &w.requester_id)
                    && !self.is_starting_forward(&view.id, &w.requester_id)
                {
                    let mut w = w.clone();
                    w.worker_id = Some(view.id.clone());
                    w.worker = Some(self.worker_ref(&view.id));
                    waiting.push(w);
                }
            }
        }
        waiting
    }

    /// Whether `worker_requester`, waiting on worker `worker_id`, is this gateway's forward of
    /// a fleet request whose attempt is on that worker now.
    fn is_starting_forward(&self, worker_id: &str, worker_requester: &str) -> bool {
        worker_requester
            .strip_prefix(self.prefix.as_str())
            .and_then(|requester| self.queue.pending_of(requester))
            .and_then(|w| w.attempt())
            .is_some_and(|a| a.worker_id == worker_id)
    }

    /// Every view, in id order, with the nested leases and waiting requests `viewer` may see:
    /// an admin the views as the workers report them, and the leases the gateway releases on
    /// each once it is back (`releasing`); an agent only its own leases (the rule of the lease
    /// list, [`Self::seen`]) and the requests the gateway forwarded for it.
    pub fn views_seen_by(&self, viewer: Viewer<'_>) -> Vec<WorkerView> {
        if viewer.admin {
            let mut views = self.views();
            for view in &mut views {
                view.releasing = self.index.orphans_of(&view.id);
            }
            return views;
        }
        self.view_refs()
            .map(|view| {
                let mut view = view.clone();
                if let Some(leases) = view.leases.as_mut() {
                    leases.retain(|lease| {
                        matches!(self.seen(viewer, &view.id, lease), Seen::Issued(_))
                    });
                }
                if let Some(waiting) = view.waiting.as_mut() {
                    waiting.retain(|w| self.may_see_forwarded(viewer, &w.requester_id));
                }
                view
            })
            .collect()
    }

    /// The rule for a worker's lease at the gateway, for the lease list and the workers' nested
    /// views alike: a lease the gateway issued is its owner's (and an admin's) to see, through
    /// [`Viewer::may_see`]; one made on the worker directly is an admin's; one the index does
    /// not hold (yet, or any more) is nobody's in the list.
    pub fn seen(&self, viewer: Viewer<'_>, worker_id: &str, lease: &LeaseRecord) -> Seen<'_> {
        match self.index.by_worker_lease(worker_id, lease.id.as_str()) {
            Some(entry) if viewer.may_see(&entry.owner_id) => Seen::Issued(entry),
            Some(_) => Seen::Hidden,
            None if viewer.admin && !lease.requester_id.starts_with(&self.prefix) => Seen::Direct,
            None => Seen::Hidden,
        }
    }

    /// Whether `viewer` may see a request waiting on a worker: one the gateway forwarded (its
    /// requester namespaced `gw:<id>:`) for a pending request of the viewer's. A request made
    /// on the worker directly is an admin's to see.
    fn may_see_forwarded(&self, viewer: Viewer<'_>, worker_requester: &str) -> bool {
        viewer.admin
            || worker_requester
                .strip_prefix(self.prefix.as_str())
                .and_then(|requester| self.pending_owner(requester))
                .is_some_and(|owner| viewer.may_see(owner))
    }

    /// Every device of every worker, as each last reported it, with its worker: id, label and
    /// whether its uplink is up (a disconnected worker's devices keep the state it last
    /// reported, and say that their worker is away).
    pub fn devices(&self) -> Vec<Device> {
        self.workers
            .iter()
            .flat_map(|(worker_id, worker)| {
                let worker_ref = self.worker_ref(worker_id);
                worker.view.devices.iter().flatten().map(move |device| {
                    let mut device = device.clone();
                    device.worker_id = Some(worker_ref.id.clone());
                    device.worker = Some(worker_ref.clone());
                    device
                })
            })
            .collect()
    }

    /// Every lease on every worker, projected: the gateway's own with their gateway ids (from
    /// the index, so a lease is listed from the moment its grant is answered, before any view
    /// shows it); others (leases made on a worker directly) as they are, with the worker's id,
    /// for admins. Who sees which is [`Self::seen`]'s rule: an agent sees only the gateway
    /// leases it owns.
    pub fn leases(&self, viewer: Viewer<'_>) -> Vec<LeaseRecord> {
        let mut out = Vec::new();
        for (worker_id, worker) in &self.workers {
            let view = &worker.view;
            let mut listed = BTreeSet::new();
            for lease in view.leases.as_deref().unwrap_or_default() {
                match self.seen(viewer, worker_id, lease) {
                    Seen::Issued(entry) => {
                        listed.insert(entry.lease_id.clone());
                        out.push(entry.project(self.worker_ref(worker_id)));
                    }
                    Seen::Direct => {
                        let mut lease = lease.clone();
                        lease.worker_id = Some(view.id.clone());
                        lease.worker = Some(self.worker_ref(worker_id));
                        out.push(lease);
                    }
                    Seen::Hidden => {}
                }
            }
            // Granted, and not in the view yet: listed from the index.
            for entry in self.index.of_worker(worker_id) {
                if !listed.contains(&entry.lease_id) && viewer.may_see(&entry.owner_id) {
                    out.push(entry.project(self.worker_ref(worker_id)));
                }
            }
        }
        out
    }

    /// The next moment [`Self::handle_tick`] has something to do: a waiter's deadline, a
    /// periodic refresh, a disconnected worker passing retention, a book record expiring, an
    /// orphan expiring.
    pub fn next_deadline(&self) -> Option<i64> {
        let waiters = self
            .queue
            .waiters()
            .iter()
            .filter_map(Waiter::next_deadline);
        let refreshes = self.workers.values().filter_map(|w| {
            let link = w.link.as_ref()?;
            let folded =
                (link.again.is_some() && link.refreshing.is_none()).then_some(link.spaced_until);
            match (link.periodic_at, folded) {
                (Some(a), Some(b)) => Some(a.min(b)),
                (a, b) => a.or(b),
            }
        });
        let retention = self
            .workers
            .values()
            .filter(|w| w.awaits_retention())
            .map(|w| {
                w.view
                    .last_seen_at
                    .saturating_add(self.settings.disconnected_retention_ms)
            });
        waiters
            .chain(refreshes)
            .chain(retention)
            .chain(self.queue.book.next_expiry(BOOK_RETENTION_MS))
            .chain(self.index.next_expiry())
            .min()
    }

    // === Uplinks ===

    /// A worker's uplink opened (before its handshake): it replaces any previous one, which
    /// is closed. Answers the new uplink's generation.
    pub fn handle_uplink_opened(
        &mut self,
        worker_id: &str,
        label: Option<String>,
        token_id: String,
        now: i64,
    ) -> u64 {
        let generation = self.next_generation;
        self.next_generation += 1;
        let revisions = &mut self.revisions;
        let worker = self.workers.entry(worker_id.to_owned()).or_insert_with(|| {
            let view = blank_view(worker_id, None, now, Connection::Disconnected);
            Worker::new(view, revisions, false, false)
        });
        worker.retained = false;
        if label.is_some() {
            worker.view.label = label;
        }
        // The view waits for the handshake before it counts as connected.
        worker.view.catalog_read_at = None;
        worker.view.connection = Connection::Disconnected;
        let previous = worker.link.replace(Link {
            generation,
            token_id,
            refreshing: None,
            again: None,
            spaced_until: i64::MIN,
            timeouts: 0,
            periodic_at: None,
            subscribed: false,
            catalog_retried: false,
            catalog_due: false,
            asked: 0,
        });
        self.generations.insert(generation, worker_id.to_owned());
        if let Some(previous) = previous {
            self.generations.remove(&previous.generation);
            // A worker that restarted closed its old uplink as it went, unless its machine or
            // network failed; one whose old uplink still stands is most often a twin: a second
            // worker started from a copy of this one's home, the two knocking each other off.
            warn!(
                worker = worker_id,
                "a new uplink replaces one still open for this worker id: a worker whose old \
                 connection had not closed yet, or two workers sharing one instance id (a copied \
                 SIMLOCK_HOME)"
            );
            self.fx.push_back(Effect::Close {
                generation: previous.generation,
                why: Closing::Replaced,
            });
        }
        self.dispatch(now);
        generation
    }

    /// The moment the handshake's first `status.get` goes out (a stamp for
    /// [`Self::handle_connected`]).
    pub fn handle_probe_sent(&mut self) -> Stamp {
        self.next_stamp()
    }

    fn current(&mut self, generation: u64) -> Option<(String, &mut Worker)> {
        let worker_id = self.generations.get(&generation)?;
        let worker = self.workers.get_mut(worker_id)?;
        Some((worker_id.clone(), worker))
    }

    /// The handshake passed: the worker is connected with its first status, sent at `sent`.
    /// Its leases are indexed at once, so a renew right after a gateway restart finds its lease.
    pub fn handle_connected(
        &mut self,
        generation: u64,
        version: String,
        status: &StatusOutput,
        sent: Stamp,
        now: i64,
    ) {
        let Some(worker_id) = self.generations.get(&generation).cloned() else {
            return;
        };
        if !self.workers.contains_key(&worker_id) {
            return;
        }
        // A forward it had not read when it stopped (its process stopped, its machine asleep)
        // is read, and may be granted, from now on.
        let back = self.forward_expiry(now);
        self.index.arm_forwards(&worker_id, back);
        let Some(worker) = self.workers.get_mut(&worker_id) else {
            return;
        };
        worker.view.connection = Connection::Connected;
        worker.view.protocol = None;
        worker.view.version = Some(version.clone());
        worker.apply_read(&mut self.revisions, status, None, sent, now);
        worker.known = true;
        let label = worker.view.label.clone();
        self.fx.push_back(Effect::Remember(KnownWorker {
            id: worker_id.clone(),
            label: label.clone(),
            seen_at: now,
            connected: true,
        }));
        if let Some(leases) = &status.leases {
            self.fold_snapshot(&worker_id, leases, sent, now);
        }
        info!(worker = %worker_id, "worker connected");
        if let Some(label) = &label {
            let namesakes: Vec<&str> = self
                .workers
                .iter()
                .filter(|(id, w)| **id != worker_id && w.view.label.as_ref() == Some(label))
                .map(|(id, _)| id.as_str())
                .collect();
            if !namesakes.is_empty() {
                warn!(worker = %worker_id, %label, others = ?namesakes,
                    "another worker has this label: the views tell them apart by id, and an operator names them by id");
            }
        }
        self.event(Event::WorkerConnected {
            worker_id: worker_id.clone(),
            label,
            version,
        });
        self.dispatch(now);
    }

    /// The worker speaks no protocol version the gateway does. The uplink stays open.
    pub fn handle_incompatible(
        &mut self,
        generation: u64,
        gateway: ProtocolRange,
        worker: ProtocolRange,
        now: i64,
    ) {
        if let Some((worker_id, w)) = self.current(generation) {
            warn!(worker = %worker_id, ?worker, ?gateway, "worker speaks no protocol version in common");
            w.view.connection = Connection::Incompatible;
            w.view.protocol = Some(ProtocolPair { gateway, worker });
            w.view.last_seen_at = now;
        }
        self.dispatch(now);
    }

    /// The gateway subscribed to the worker's events: its first full refresh is asked for, and
    /// the periodic ones are armed.
    pub fn handle_subscribed(&mut self, generation: u64, now: i64) {
        let interval = self.settings.refresh_interval_ms;
        if let Some((worker_id, w)) = self.current(generation) {
            if let Some(link) = w.link.as_mut() {
                link.periodic_at = Some(now.saturating_add(interval));
                link.subscribed = true;
            }
            // The orphans a lost uplink kept from being released, and those its handshake
            // found, go now.
            for worker_lease_id in self.index.orphans_of(&worker_id) {
                self.fx.push_back(Effect::ReleaseOrphan {
                    worker_id: worker_id.clone(),
                    generation,
                    worker_lease_id,
                });
            }
            self.ask_refresh(&worker_id, true, now);
        }
    }

    /// An uplink ended; its worker was last heard at `heard_at` (a worker that went silent was
    /// last seen then, not when its link gave up on it). A replaced uplink's late close changes
    /// nothing.
    pub fn handle_uplink_closed(&mut self, generation: u64, heard_at: i64, now: i64) {
        let Some((worker_id, worker)) = self.current(generation) else {
            return;
        };
        worker.link = None;
        let was_connected = worker.view.connection == Connection::Connected;
        worker.view.connection = Connection::Disconnected;
        // Never before what was already seen (its handshake), never after the close (a clock
        // stepped back between the two included).
        let seen_at = heard_at.max(worker.view.last_seen_at).min(now);
        worker.view.last_seen_at = seen_at;
        let (label, lease_count, known) = (
            worker.view.label.clone(),
            worker.view.leases.as_ref().map_or(0, Vec::len),
            worker.known,
        );
        // Its forwards out wait for it: what it had not read when it stopped it reads, and may
        // grant, whenever it runs again.
        if !self.broken(Fault::ForwardsForgottenWhileAway) {
            self.index.park_forwards(&worker_id);
        }
        self.generations.remove(&generation);
        if !known {
            // No handshake ever passed, and nothing was stored: not a worker to list.
            debug!(worker = %worker_id, "an uplink closed before its handshake");
            self.workers.remove(&worker_id);
            self.dispatch(now);
            return;
        }
        if was_connected {
            self.fx.push_back(Effect::Remember(KnownWorker {
                id: worker_id.clone(),
                label: label.clone(),
                seen_at,
                connected: false,
            }));
            info!(worker = %worker_id, "worker disconnected");
            let event = Event::WorkerDisconnected {
                worker_id,
                label,
                lease_count,
            };
            self.event(event);
        }
        self.dispatch(now);
    }

    // === Views ===

    /// Asks for a refresh of `worker_id`'s view; asks made while one runs, or within the gap
    /// after it, fold into one more.
    fn ask_refresh(&mut self, worker_id: &str, catalog: bool, now: i64) {
        let Some(worker) = self.workers.get_mut(worker_id) else {
            return;
        };
        let Some(link) = worker.link.as_mut() else {
            return;
        };
        link.asked += 1;
        let catalog = catalog || link.catalog_due;
        if link.refreshing.is_some() || now < link.spaced_until {
            link.again = Some(link.again.unwrap_or(false) || catalog);
            return;
        }
        link.again = None;
        let generation = link.generation;
        self.stamp += 1;
        let sent = self.stamp;
        if let Some(link) = self
            .workers
            .get_mut(worker_id)
            .and_then(|w| w.link.as_mut())
        {
            link.refreshing = Some(sent);
        }
        self.fx.push_back(Effect::Refresh {
            worker_id: worker_id.to_owned(),
            generation,
            sent,
            catalog,
        });
    }

    /// The refresh out on `generation` ended; the next one folded in goes out after the gap.
    fn refresh_done(&mut self, generation: u64, sent: Stamp, now: i64) -> Option<String> {
        let gap = self.settings.refresh_gap_ms;
        let (worker_id, worker) = self.current(generation)?;
        let link = worker.link.as_mut()?;
        if link.refreshing != Some(sent) {
            return None;
        }
        link.refreshing = None;
        link.spaced_until = now.saturating_add(gap);
        if gap <= 0
            && let Some(catalog) = link.again.take()
        {
            link.asked -= 1;
            self.ask_refresh(&worker_id, catalog, now);
        }
        Some(worker_id)
    }

    /// A refresh sent at `sent` read the worker's view: it is folded in, and the worker's part
    /// of the lease index is reconciled with it.
    pub fn handle_refreshed(&mut self, generation: u64, sent: Stamp, refresh: Refresh, now: i64) {
        let Some(worker_id) = self.refresh_done(generation, sent, now) else {
            return;
        };
        let max_ttl = self.settings.limits.max_ttl_ms;
        let Some(worker) = self.workers.get_mut(&worker_id) else {
            return;
        };
        if let Some(link) = worker.link.as_mut() {
            link.timeouts = 0;
            if refresh.catalog.is_some() {
                link.catalog_due = false;
                link.catalog_retried = false;
            }
        }
        worker.apply_read(
            &mut self.revisions,
            &refresh.status,
            refresh.devices,
            sent,
            now,
        );
        if let Some(catalog) = refresh.catalog {
            worker.view.catalog = Some(catalog);
            worker.view.catalog_read_at = Some(now);
        }
        if let Some(limits) = refresh.limits {
            if limits.max_ttl_ms < max_ttl {
                warn!(worker = %worker_id, worker_max = limits.max_ttl_ms, gateway_max = max_ttl,
                    "the worker's lease.maxTtlMs is below the gateway's; longer leases will be refused there");
            }
            worker.view.lease = Some(limits);
        }
        let leases = worker.view.leases.clone().unwrap_or_default();
        if refresh.status.leases.is_some() {
            self.fold_snapshot(&worker_id, &leases, sent, now);
        }
        self.dispatch(now);
    }

    /// A refresh sent at `sent` failed. Two status timeouts in a row close the uplink; a
    /// failed catalog read is asked for again.
    pub fn handle_refresh_failed(
        &mut self,
        generation: u64,
        sent: Stamp,
        failure: RefreshFailure,
        catalog: bool,
        now: i64,
    ) {
        let Some(worker_id) = self.refresh_done(generation, sent, now) else {
            return;
        };
        let Some(link) = self
            .workers
            .get_mut(&worker_id)
            .and_then(|w| w.link.as_mut())
        else {
            return;
        };
        match failure {
            RefreshFailure::StatusTimeout => {
                link.timeouts += 1;
                warn!(worker = %worker_id, timeouts = link.timeouts, "the worker's status read timed out");
                if link.timeouts >= MAX_STATUS_TIMEOUTS {
                    warn!(worker = %worker_id, "closing an uplink that missed {MAX_STATUS_TIMEOUTS} status reads in a row");
                    self.fx.push_back(Effect::Close {
                        generation,
                        why: Closing::Unresponsive,
                    });
                }
            }
            RefreshFailure::Failed(err) => {
                // A read that failed because the uplink went needs no retry: the uplink ends.
                if catalog && !err.code.is_transport() {
                    link.catalog_due = true;
                    if !std::mem::replace(&mut link.catalog_retried, true) {
                        self.ask_refresh(&worker_id, true, now);
                    }
                }
            }
        }
    }

    /// Reconciles the index with a snapshot of `worker_id`'s leases sent at `sent`: leases the
    /// gateway knew of and the worker no longer lists ended, and their owners hear it.
    /// Folds in a view's leases read at `sent`, screened first ([`Self::screen`]).
    fn fold_snapshot(&mut self, worker_id: &str, leases: &[LeaseRecord], sent: Stamp, now: i64) {
        let leases = self.screen(worker_id, leases, now);
        for entry in self.index.apply_snapshot(worker_id, &leases, sent) {
            let except = self.releasing.remove(&entry.lease_id).flatten();
            let reason = if except.is_some() {
                LeaseEndReason::Explicit
            } else if entry.record.ttl_deadline <= now {
                LeaseEndReason::Expired
            } else {
                LeaseEndReason::Killed
            };
            self.entry_ended(&entry, reason, except);
        }
    }

    /// Screens a view's leases for the grants of forwards whose answers were lost: each is an
    /// orphan, released at once; a forward still waiting for its answer leaves its grant to it.
    /// Answers what the view may fold in.
    fn screen(&mut self, worker_id: &str, leases: &[LeaseRecord], now: i64) -> Vec<LeaseRecord> {
        if self.broken(Fault::LostGrantsIndexed) {
            return leases.to_vec();
        }
        let at = self.next_stamp();
        let expires_at = self.orphan_expiry(now);
        let screened = self.index.screen(worker_id, leases, at, expires_at);
        let generation = self.releasing_generation(worker_id);
        for stray in screened.strays {
            info!(worker = %worker_id, lease = %stray.id, requester = %stray.requester_id,
                "a grant whose answer was lost: released, nobody was told of it");
            if let Some(generation) = generation {
                self.fx.push_back(Effect::ReleaseOrphan {
                    worker_id: worker_id.to_owned(),
                    generation,
                    worker_lease_id: stray.id.to_string(),
                });
            }
        }
        screened.listed
    }

    // === Worker events ===

    /// A worker's event arrived on `generation`: lease ends end the gateway's lease and reach
    /// its owner; a leased device's crash and recovery reach the gateway lease's owner as
    /// `device-unhealthy` and `device-recovered`; a renew updates the view in place (ADR 0015);
    /// other lease and device events, and `capability.changed` (so the view's capabilities, and
    /// the workers capable of a `requires`, follow within one spaced refresh), ask for a
    /// refresh; every event but the `worker.*` ones (gateway-only facts) is relayed onto the
    /// gateway's bus with its worker id.
    pub fn handle_worker_event(&mut self, generation: u64, mut envelope: EventEnvelope, now: i64) {
        let Some(worker_id) = self.worker_of_generation(generation).map(str::to_owned) else {
            return;
        };
        if envelope.event.starts_with("worker.") {
            return;
        }
        // A lease the gateway issued is also named by the gateway's id in what it relays, as
        // its owner knows it; read before the event is applied, which may end the lease.
        let issued = envelope
            .payload
            .get("leaseId")
            .and_then(serde_json::Value::as_str)
            .and_then(|id| self.index.by_worker_lease(&worker_id, id))
            .map(|entry| entry.lease_id.clone());
        match Event::from_envelope(&envelope) {
            Some(Event::LeaseExpired {
                lease_id,
                device_id,
                ..
            }) => {
                self.lease_ended(
                    &worker_id,
                    &lease_id,
                    device_id,
                    LeaseEndReason::Expired,
                    now,
                );
                self.ask_refresh(&worker_id, false, now);
            }
            Some(Event::LeaseReleased {
                lease_id,
                device_id,
                reason,
                ..
            }) => {
                self.lease_ended(&worker_id, &lease_id, device_id, reason, now);
                self.ask_refresh(&worker_id, false, now);
            }
            Some(Event::LeaseRenewed {
                lease_id,
                new_deadline,
                ttl_ms,
            }) => {
                // The most frequent event of all: updated in place, without a refresh.
                let renewal = Renewal {
                    deadline: new_deadline,
                    ttl_ms,
                    at: envelope.timestamp,
                };
                self.index.renewed(&worker_id, &lease_id, renewal);
                let in_view = self
                    .workers
                    .get_mut(&worker_id)
                    .is_some_and(|w| renew_in_place(&mut w.view, &lease_id, renewal));
                if !in_view {
                    self.ask_refresh(&worker_id, false, now);
                }
            }
            Some(Event::DeviceCrashDetected {
                device_id,
                seen:
                    CrashedDevice::Leased {
                        lease_id: Some(lease_id),
                    },
                reason,
            }) => {
                self.device_health(&worker_id, &lease_id, |lease_id| Push::DeviceUnhealthy {
                    lease_id,
                    device_id,
                    reason,
                });
                self.ask_refresh(&worker_id, false, now);
            }
            Some(Event::DeviceRecovered {
                device_id,
                lease_id,
                attempts,
            }) => {
                self.device_health(&worker_id, &lease_id, |lease_id| Push::DeviceRecovered {
                    lease_id,
                    device_id,
                    attempts,
                });
                self.ask_refresh(&worker_id, false, now);
            }
            // Its health changed: read now, so requests go elsewhere (trial 20).
            Some(Event::CapabilityChanged { .. } | Event::DaemonFailed { .. }) => {
                self.ask_refresh(&worker_id, false, now);
            }
            _ if envelope.event.starts_with("lease.") || envelope.event.starts_with("device.") => {
                self.ask_refresh(&worker_id, false, now);
            }
            _ => {}
        }
        if let serde_json::Value::Object(payload) = &mut envelope.payload {
            payload.insert("workerId".into(), serde_json::Value::String(worker_id));
            if let Some(gateway_lease_id) = issued {
                payload.insert(
                    "gatewayLeaseId".into(),
                    serde_json::Value::String(gateway_lease_id),
                );
            }
        }
        self.fx.push_back(Effect::Relay(envelope));
    }

    /// A worker's leased device crashed or recovered: the owner of the gateway lease hears it
    /// (`push`, under the gateway's lease id). The owner comes from the index, never from the
    /// relayed event; a lease the index does not hold is nobody's here.
    fn device_health(
        &mut self,
        worker_id: &str,
        worker_lease_id: &str,
        push: impl FnOnce(String) -> Push,
    ) {
        let Some(entry) = self.index.by_worker_lease(worker_id, worker_lease_id) else {
            return;
        };
        let owner = entry.owner_id.clone();
        let push = push(entry.lease_id.clone());
        self.fx.push_back(Effect::Notice {
            owner,
            push,
            except: None,
        });
    }

    /// A worker says one of its leases ended: drop it from the index and tell its owner, once.
    fn lease_ended(
        &mut self,
        worker_id: &str,
        worker_lease_id: &str,
        device_id: simlock_contract::ids::DeviceId,
        reason: LeaseEndReason,
        now: i64,
    ) {
        let at = self.next_stamp();
        if let Some(entry) = self.index.end(worker_id, worker_lease_id, at) {
            let except = self.releasing.remove(&entry.lease_id).flatten();
            self.entry_ended(&entry, reason, except);
            self.dispatch(now);
        } else if !self.index.ended(worker_id, worker_lease_id) {
            // Its grant may still be on its way (`LeaseIndex::record_grant`).
            self.index.end_unmatched(EndedLease {
                worker_id: worker_id.to_owned(),
                worker_lease_id: worker_lease_id.to_owned(),
                device_id,
                reason,
                heard_at: at,
            });
        }
    }

    /// An indexed lease ended: its owner hears it, unless its grant's answer is still on its
    /// way (a view listed the lease first): then the end waits for that answer, so the owner
    /// hears the grant, then the end.
    fn entry_ended(&mut self, entry: &Entry, reason: LeaseEndReason, except: Option<u64>) {
        let in_flight = self.queue.waiters().iter().any(|w| {
            w.requester == entry.requester_id
                && w.attempt().is_some_and(|a| a.worker_id == entry.worker_id)
        });
        if in_flight {
            let heard_at = self.next_stamp();
            self.index.end_unmatched(EndedLease {
                worker_id: entry.worker_id.clone(),
                worker_lease_id: entry.worker_lease_id.clone(),
                device_id: entry.device_id().clone(),
                reason,
                heard_at,
            });
        } else {
            self.notify_lost(entry, reason, except);
        }
    }

    fn notify_lost(&mut self, entry: &Entry, reason: LeaseEndReason, except: Option<u64>) {
        self.fx.push_back(Effect::Notice {
            owner: entry.owner_id.clone(),
            push: Push::LeaseLost {
                lease_id: entry.lease_id.clone(),
                device_id: entry.device_id().clone(),
                reason,
            },
            except,
        });
    }

    // === Lease requests ===

    /// Admits a `lease.request`: the input's rules, an idempotent repeat, one lease per
    /// requester, the chosen id, the fast-fail table, then a new waiter and a dispatch pass.
    ///
    /// # Errors
    /// Every refusal of the table.
    pub fn handle_lease_request(&mut self, ask: Ask, now: i64) -> Result<Admitted, FleetError> {
        let Ask {
            request_id,
            mut input,
            principal,
        } = ask;
        if self.stopping {
            return Err(FleetError::Stopping);
        }
        if input.owner.is_some() {
            return Err(FleetError::Forbidden(
                "owner may only be set by a gateway on its worker's uplink".into(),
            ));
        }
        let ttl = self
            .settings
            .limits
            .ttl(input.ttl_ms)
            .map_err(|e| FleetError::BadRequest(e.to_string()))?;
        input.ttl_ms = Some(ttl);
        let requester = input
            .requester_id
            .clone()
            .unwrap_or_else(|| principal.clone());
        let room = simlock_contract::bounds::MAX_REQUESTER.saturating_sub(self.prefix.len());
        if requester.chars().count() > room {
            return Err(FleetError::BadRequest(format!(
                "requesterId: at most {room} characters through a gateway"
            )));
        }
        self.queue.book.prune(now, BOOK_RETENTION_MS);
        if let Some(key) = &input.idempotency_key
            && let Some(booked) = self.queue.book.get(&requester, key)
        {
            if booked.principal != principal {
                return Err(FleetError::IdempotencyForeign);
            }
            if booked.fingerprint != Waiter::fingerprint(&input) {
                return Err(FleetError::IdempotencyConflict);
            }
            return Ok(match &booked.outcome {
                Some(outcome) => Admitted::Replay(Box::new(outcome.clone())),
                None => Admitted::Joined(
                    booked.request.clone(),
                    self.queue.get(&booked.request).map(|w| {
                        // Forwarded before anything was told: at the head, handed to a worker.
                        w.told.unwrap_or(Progress::Queued {
                            queue_position: w.told_position_or_first(),
                            waiting_for: None,
                        })
                    }),
                ),
            });
        }
        let wanted = Wanted::of(&input);
        if let Err(refusal) = self.refusal(&input, &requester, &principal, &wanted) {
            self.rejected(None, &requester, &wanted, &refusal);
            return Err(refusal);
        }
        let waiter = Waiter::new(
            request_id.clone(),
            input.clone(),
            requester.clone(),
            principal.clone(),
            now,
        );
        if let Some(key) = &input.idempotency_key {
            self.queue.book.insert(
                requester.clone(),
                key.clone(),
                Booked {
                    principal,
                    fingerprint: Waiter::fingerprint(&input),
                    request: request_id.clone(),
                    outcome: None,
                    settled_at: None,
                },
            );
        }
        self.event(Event::LeaseRequested {
            request_id: request_id.clone(),
            request_spec: waiter.wanted.requested(),
            requester,
            wait_policy: WaitPolicy::of(waiter.no_wait),
        });
        self.queue.push(waiter);
        self.dispatch(now);
        Ok(Admitted::New(request_id))
    }

    /// Why a new request is refused before it is queued, if it is.
    /// A lease another owner holds for the same requester is named without its id: a lease id
    /// is told only to its owner.
    fn refusal(
        &self,
        input: &LeaseRequestInput,
        requester: &str,
        principal: &str,
        wanted: &Wanted,
    ) -> Result<(), FleetError> {
        if let Some(existing) = self.index.by_requester(requester) {
            return Err(FleetError::RequesterHoldsLease {
                requester_id: requester.to_owned(),
                lease_id: (existing.owner_id == principal).then(|| existing.lease_id.clone()),
            });
        }
        if self.queue.pending_of(requester).is_some() {
            return Err(FleetError::RequesterPending(requester.to_owned()));
        }
        if let Some(id) = &input.lease_id
            && self.index.get(id).is_some()
        {
            return Err(FleetError::LeaseIdTaken(id.clone()));
        }
        let views: Vec<&WorkerView> = self.view_refs().collect();
        match assessment_error(&assess(&views, wanted), wanted) {
            Some(err) => Err(err),
            None => Ok(()),
        }
    }

    fn rejected(
        &mut self,
        request: Option<&RequestId>,
        requester: &str,
        wanted: &Wanted,
        err: &FleetError,
    ) {
        let worker_id = match err {
            FleetError::WorkerUnreachable { worker_id, .. } => Some(worker_id.clone()),
            _ => None,
        };
        self.event(Event::LeaseRejected {
            request_id: request.cloned(),
            requester: requester.to_owned(),
            request_spec: wanted.requested(),
            reason: rejection_reason(err),
            worker_id,
        });
    }

    /// Answers a waiter and takes it out of the queue.
    fn answer(&mut self, id: &RequestId, outcome: Result<LeaseGrant, FleetError>, now: i64) {
        let Some(waiter) = self.queue.remove(id) else {
            return;
        };
        if let Err(err) = &outcome {
            self.rejected(Some(id), &waiter.requester, &waiter.wanted, err);
        }
        self.queue.book.settle(id, &outcome, now);
        self.fx.push_back(Effect::Answer {
            request: id.clone(),
            outcome: Box::new(outcome),
        });
    }

    /// `lease.cancel` of `requester`'s pending request, by `caller`.
    ///
    /// # Errors
    /// `FORBIDDEN` when the pending request is another principal's.
    pub fn handle_cancel(
        &mut self,
        requester: &str,
        caller: Caller<'_>,
        now: i64,
    ) -> Result<CancelResult, FleetError> {
        let Some(waiter) = self.queue.pending_of(requester) else {
            return Ok(CancelResult::NotFound);
        };
        if !caller.may_act_for(&waiter.owner) {
            return Err(FleetError::Forbidden(
                "That pending request belongs to another principal".into(),
            ));
        }
        if !waiter.is_queued() {
            return Ok(CancelResult::NotCancellable);
        }
        let id = waiter.id.clone();
        self.answer(&id, Err(FleetError::Cancelled), now);
        self.dispatch(now);
        Ok(CancelResult::Cancelled)
    }

    /// One pass over the queue, oldest first: deadlines, the fast-fail table again, then a
    /// worker for each waiter (one new forward per worker per pass).
    fn dispatch(&mut self, now: i64) {
        let mut claimed: BTreeSet<String> = BTreeSet::new();
        let ids: Vec<RequestId> = self
            .queue
            .waiters()
            .iter()
            .filter(|w| w.is_queued())
            .map(|w| w.id.clone())
            .collect();
        for id in ids {
            let Some(waiter) = self.queue.get(&id) else {
                continue;
            };
            // A deadline is the request's timeoutMs from when it came.
            if let Some(timeout_ms) = waiter
                .input
                .timeout_ms
                .filter(|_| waiter.deadline.is_some_and(|d| d <= now))
            {
                let timeout = FleetError::QueueTimeout {
                    request_id: id.clone(),
                    timeout_ms,
                };
                self.answer(&id, Err(timeout), now);
                continue;
            }
            // The one-lease rule, learned after the request came: a worker that was away (a
            // gateway restart) is back and lists a lease of this requester. Forwarded, the
            // request would be refused by that worker, or granted a second lease by another;
            // and a forward whose answer a restart lost would take that lease for its grant.
            if let Some(held) = self.index.by_requester(&waiter.requester) {
                let held = FleetError::RequesterHoldsLease {
                    requester_id: waiter.requester.clone(),
                    lease_id: (held.owner_id == waiter.owner).then(|| held.lease_id.clone()),
                };
                self.answer(&id, Err(held), now);
                continue;
            }
            let views: Vec<&WorkerView> = self.workers.values().map(|w| &w.view).collect();
            // A drain or a lost uplink can leave a waiting spec that no known worker serves.
            if let Some(err) = assessment_error(&assess(&views, &waiter.wanted), &waiter.wanted)
                && !matches!(err, FleetError::NoCapacity(_))
            {
                self.answer(&id, Err(err), now);
                continue;
            }
            let eligible: Vec<&WorkerView> = views
                .iter()
                .copied()
                .filter(|v| !claimed.contains(&v.id) && !waiter.excluded.contains(&v.id))
                .filter(|v| {
                    waiter.refusals.get(&v.id).is_none_or(|revision| {
                        self.workers
                            .get(&v.id)
                            .is_none_or(|w| w.revision != *revision)
                    })
                })
                .filter(|v| {
                    self.workers
                        .get(&v.id)
                        .is_none_or(|w| !w.no_room.contains(&waiter.wanted.platform))
                })
                .collect();
            if eligible.is_empty()
                && !waiter.excluded.is_empty()
                && views.iter().all(|v| waiter.excluded.contains(&v.id))
            {
                let err = waiter
                    .last_refusal
                    .clone()
                    .unwrap_or(FleetError::NoCapacity("No worker can serve this request"));
                self.answer(&id, Err(err), now);
                continue;
            }
            let pick = select(&eligible, &waiter.wanted);
            let generation = pick
                .as_ref()
                .and_then(|p| self.workers.get(&p.worker_id))
                .and_then(|w| w.link.as_ref())
                .map(|l| l.generation);
            match (pick, generation) {
                (Some(pick), Some(generation)) => {
                    claimed.insert(pick.worker_id.clone());
                    self.forward(&id, pick, generation, now);
                }
                _ => {
                    // Over the workers this pass gave a request too: one with room left says
                    // the wait is not for capacity. A noWait request is answered, not told.
                    let waiting_for = if waiter.no_wait {
                        None
                    } else {
                        routing::waiting_for(&views, &waiter.excluded, &waiter.wanted)
                    };
                    self.no_pick(&id, waiting_for, now);
                }
            }
        }
    }

    /// No worker takes `id` in this pass: a `noWait` request fails (after its second walk when
    /// a stale view refused it), another is announced as queued once, and told again when why
    /// it waits (`waiting_for`) changed.
    fn no_pick(&mut self, id: &RequestId, waiting_for: Option<WaitingFor>, now: i64) {
        let Some(waiter) = self.queue.get_mut(id) else {
            return;
        };
        let told_before = std::mem::replace(&mut waiter.told_waiting, waiting_for);
        let walked_before = std::mem::replace(&mut waiter.walked, true);
        let entered_before = std::mem::replace(&mut waiter.entered, true);
        if waiter.no_wait {
            if walked_before || !waiter.second_walk {
                self.answer(
                    id,
                    Err(FleetError::NoCapacity(
                        "No worker connected to this gateway has a device free now",
                    )),
                    now,
                );
            }
        } else if !entered_before
            && self.queue.depth().saturating_sub(1) >= self.settings.max_waiting
        {
            // A new request would wait behind a full queue: each waiter costs every pass a
            // little, and the bound keeps one caller from slowing the gateway for everyone. One
            // that waited before (back from a worker that refused it) keeps its place.
            let max_waiting = self.settings.max_waiting;
            // Refused before it got in, as a refusal at admission is: its key keeps nothing, so
            // a repeat once there is room is a new request (settling a forgotten key is a no-op).
            self.queue.book.forget(id);
            self.answer(id, Err(FleetError::QueueFull { max_waiting }), now);
        } else if let Some(position) = self.queue.announce(id) {
            self.tell(
                id.clone(),
                Progress::Queued {
                    queue_position: position,
                    waiting_for,
                },
            );
            self.event(Event::LeaseQueued {
                request_id: id.clone(),
                queue_position: position,
            });
        } else if told_before != waiting_for
            && let Some(position) = self.queue.told_position(id)
        {
            self.tell(
                id.clone(),
                Progress::Queued {
                    queue_position: position,
                    waiting_for,
                },
            );
        }
    }

    fn forward(&mut self, id: &RequestId, pick: Pick, generation: u64, now: i64) {
        let attempt = self.next_attempt;
        self.next_attempt += 1;
        let timeout = self.settings.lease_request_timeout_ms;
        let prefix = self.prefix.clone();
        let Some(waiter) = self.queue.get_mut(id) else {
            return;
        };
        waiter.entered = true;
        let input = forward_input(&prefix, waiter, &pick.matched);
        let requester = waiter.requester.clone();
        let worker_id = pick.worker_id.clone();
        self.queue.set_stage(
            id,
            Stage::Forwarded(Attempt {
                id: attempt,
                worker_id: worker_id.clone(),
                generation,
                pick,
                started: now,
                deadline: now.saturating_add(timeout),
                dispatched: false,
            }),
        );
        let expires_at = self.forward_expiry(now);
        self.index
            .forward_sent(&worker_id, &requester, attempt, expires_at);
        self.fx.push_back(Effect::Forward {
            attempt,
            worker_id,
            generation,
            input,
        });
    }

    fn dispatched(&mut self, attempt: u64) {
        let Some(waiter) = self.queue.by_attempt(attempt) else {
            return;
        };
        let requester = waiter.requester.clone();
        let (request_id, platform, created_at) =
            (waiter.id.clone(), waiter.wanted.platform, waiter.created_at);
        let Some(a) = waiter.attempt_mut() else {
            return;
        };
        if std::mem::replace(&mut a.dispatched, true) {
            return;
        }
        let event = Event::RequestDispatched {
            request_id,
            worker_id: a.worker_id.clone(),
            requester_id: requester,
            platform,
            model: a.pick.matched.model.clone(),
            reason: a.pick.reason,
            stage: a.pick.stage,
            queued_ms: a.started.saturating_sub(created_at),
        };
        self.event(event);
    }

    /// The worker reported progress on forward `attempt`: the caller hears it (and the first
    /// report records `request.dispatched`).
    pub fn handle_forward_progress(&mut self, attempt: u64, progress: Progress) {
        self.dispatched(attempt);
        if let Some(waiter) = self.queue.by_attempt(attempt) {
            let request = waiter.id.clone();
            self.tell(request, progress);
        }
    }

    /// The worker answered forward `attempt` (sent to `worker_id`): a grant is indexed and
    /// answered in one decision; `NO_CAPACITY` (a stale view) and refusals of the spec send the
    /// waiter back to the queue; anything else answers it. A grant for a request nobody waits
    /// for any more is released.
    pub fn handle_forward_answered(
        &mut self,
        attempt: u64,
        worker_id: &str,
        outcome: Result<LeaseGrant, ContractError>,
        now: i64,
    ) {
        let current = self.queue.by_attempt(attempt).map(|w| w.id.clone());
        self.forward_answered(attempt, &outcome, current.is_some(), now);
        if let Ok(grant) = &outcome {
            let granted = Granted {
                at: self.next_stamp(),
                device: grant.device.id.clone(),
                platform: grant.device.spec.platform,
            };
            if let Some(worker) = self.workers.get_mut(worker_id) {
                worker.granted(granted);
            }
        }
        let Some(id) = current else {
            if let Ok(grant) = outcome {
                self.orphaned(worker_id, &grant.lease, now);
            }
            return;
        };
        match outcome {
            Ok(grant) => {
                self.dispatched(attempt);
                let (grant, ended_first) = self.record_grant(&id, worker_id, grant);
                if self.broken(Fault::GrantTwice) {
                    let twin = self
                        .queue
                        .waiters()
                        .iter()
                        .find(|w| w.id != id && w.wanted.platform == grant.device.spec.platform)
                        .map(|w| w.id.clone());
                    if let Some(twin) = twin {
                        self.answer(&twin, Ok(grant.clone()), now);
                    }
                }
                self.answer(&id, Ok(grant), now);
                if let Some((entry, reason)) = ended_first {
                    // Its end event overtook this answer: the caller still gets the grant it
                    // asked for, then its owner the end; the index never holds the dead lease.
                    // The read that end asked for went out before this grant was counted into
                    // the view: one more shows the slot free again.
                    self.notify_lost(&entry, reason, None);
                    self.ask_refresh(worker_id, false, now);
                }
            }
            Err(err) if err.code == ErrorCode::NoCapacity => {
                // The view was stale: remember the refusal against it, for every request of
                // the platform, and read it again.
                let platform = self.queue.get(&id).map(|w| w.wanted.platform);
                let revision = match self.workers.get_mut(worker_id) {
                    Some(worker) => {
                        let revision = worker.revision;
                        if let Some(platform) = platform
                            && !worker.no_room.contains(&platform)
                        {
                            worker.no_room.push(platform);
                        }
                        revision
                    }
                    None => 0,
                };
                self.ask_refresh(worker_id, false, now);
                let Some(waiter) = self.queue.get_mut(&id) else {
                    return;
                };
                waiter.refusals.insert(worker_id.to_owned(), revision);
                if waiter.no_wait && std::mem::replace(&mut waiter.second_walk, true) {
                    self.answer(&id, Err(FleetError::Worker(err)), now);
                } else {
                    waiter.walked = false;
                    self.queue.set_stage(&id, Stage::Queued);
                }
            }
            Err(err)
                if matches!(
                    err.code,
                    ErrorCode::UnknownModel
                        | ErrorCode::RuntimeMissing
                        | ErrorCode::NoDriver
                        | ErrorCode::CapabilityMissing
                ) =>
            {
                // That worker can never serve this spec: try the others.
                self.ask_refresh(worker_id, true, now);
                let Some(waiter) = self.queue.get_mut(&id) else {
                    return;
                };
                waiter.excluded.insert(worker_id.to_owned());
                waiter.last_refusal = Some(if err.code == ErrorCode::CapabilityMissing {
                    FleetError::CapabilityMissing(
                        err.details
                            .as_ref()
                            .and_then(|d| d.get("capability"))
                            .and_then(serde_json::Value::as_str)
                            .unwrap_or_default()
                            .to_owned(),
                    )
                } else {
                    FleetError::Worker(err)
                });
                waiter.walked = false;
                self.queue.set_stage(&id, Stage::Queued);
            }
            Err(err) if err.code == ErrorCode::Internal => {
                // The worker failed the request (its state store failed, say) or its answer
                // could not be read: its view is read again (a failed worker says so, and is
                // passed over until it runs again), and the waiter tries the others, that
                // worker again once its view changes. A grant it may have made is released as
                // a lost one (ADR 0031). A noWait request no other worker can take now is
                // answered this error.
                let revision = self.workers.get(worker_id).map_or(0, |w| w.revision);
                self.ask_refresh(worker_id, false, now);
                let elsewhere = self.queue.get(&id).is_some_and(|waiter| {
                    let others: Vec<&WorkerView> = self
                        .workers
                        .values()
                        .map(|w| &w.view)
                        .filter(|v| v.id != worker_id && !waiter.excluded.contains(&v.id))
                        .collect();
                    select(&others, &waiter.wanted).is_some()
                });
                let Some(waiter) = self.queue.get_mut(&id) else {
                    return;
                };
                if waiter.no_wait && !elsewhere {
                    self.answer(&id, Err(FleetError::from_worker(worker_id, err)), now);
                } else {
                    waiter.refusals.insert(worker_id.to_owned(), revision);
                    waiter.walked = false;
                    self.queue.set_stage(&id, Stage::Queued);
                }
            }
            Err(err) => {
                self.answer(&id, Err(FleetError::from_worker(worker_id, err)), now);
            }
        }
        self.dispatch(now);
    }

    /// Tells the index how forward `attempt` was answered ([`LeaseIndex::forward_answered`]), a
    /// grant to its waiter when `waited`; a refusal while an earlier answer was lost asks for a
    /// view, which finds that grant.
    fn forward_answered(
        &mut self,
        attempt: u64,
        outcome: &Result<LeaseGrant, ContractError>,
        waited: bool,
        now: i64,
    ) {
        let answer = match outcome {
            Ok(grant) => ForwardAnswer::Granted {
                lease: grant.lease.id.to_string(),
                answered: waited,
            },
            // Not the worker's word on the request (the uplink was lost, or the answer could
            // not be read): it may have granted.
            Err(err) if is_uplink_lost(err) || err.code == ErrorCode::Internal => {
                ForwardAnswer::Lost
            }
            Err(_) => ForwardAnswer::Refused,
        };
        let refused = answer == ForwardAnswer::Refused;
        if let Some((worker_id, true)) = self.index.forward_answered(attempt, answer)
            && refused
        {
            self.ask_refresh(&worker_id, false, now);
        }
    }

    /// Indexes a worker's grant for waiter `id` and projects it for the caller; answers, too,
    /// the entry and the end reason when its end came first and its owner is still to hear it.
    fn record_grant(
        &mut self,
        id: &RequestId,
        worker_id: &str,
        mut grant: LeaseGrant,
    ) -> (LeaseGrant, Option<(Entry, LeaseEndReason)>) {
        let Some(waiter) = self.queue.get(id) else {
            return (grant, None);
        };
        let chosen = waiter.input.lease_id.is_some();
        let (requester, owner) = (waiter.requester.clone(), waiter.owner.clone());
        let lease_id = gateway_lease_id(worker_id, grant.lease.id.as_str(), chosen);
        let at = self.next_stamp();
        let entry = Entry {
            lease_id: lease_id.clone(),
            worker_id: worker_id.to_owned(),
            worker_lease_id: grant.lease.id.to_string(),
            requester_id: requester.clone(),
            owner_id: owner.clone(),
            chosen,
            record: grant.lease.clone(),
            known_at: at,
        };
        let recorded = if self.broken(Fault::GrantKnownFromViews) {
            Recorded::AlreadyEnded
        } else {
            self.index.record_grant(entry.clone())
        };
        self.event(Event::RequestGranted {
            request_id: id.clone(),
            worker_id: worker_id.to_owned(),
            lease_id: lease_id.clone(),
            worker_lease_id: grant.lease.id.to_string(),
        });
        let ended_first = match recorded {
            Recorded::EndedFirst(end) => Some((entry, end.reason)),
            Recorded::Indexed | Recorded::AlreadyEnded => None,
        };
        // The environment names the lease as callers of the gateway know it.
        if let Some(env) = grant.environment.get_mut("SIMLOCK_LEASE_ID") {
            env.clone_from(&lease_id);
        }
        grant.lease.id = LeaseId::from_raw(lease_id);
        grant.lease.requester_id = requester;
        grant.lease.owner_id = owner;
        grant.lease.worker = Some(self.worker_ref(worker_id));
        (grant, ended_first)
    }

    /// A grant nobody waits for: remembered as an orphan (no snapshot indexes it) and released
    /// (once its worker's uplink is subscribed, if it is not yet).
    fn orphaned(&mut self, worker_id: &str, lease: &LeaseRecord, now: i64) {
        let at = self.next_stamp();
        let expires_at = self.orphan_expiry(now);
        self.index.orphan(worker_id, lease, at, expires_at);
        if let Some(generation) = self.releasing_generation(worker_id) {
            self.fx.push_back(Effect::ReleaseOrphan {
                worker_id: worker_id.to_owned(),
                generation,
                worker_lease_id: lease.id.to_string(),
            });
        }
    }

    /// Takes over its holder's release of the indexed lease `lease_id` that its worker cannot
    /// answer now (away, or silent past the call bound): the lease ends here (the owner's
    /// connections but `except` hear it, `explicit`) and becomes an orphan, released on the
    /// worker at once while its uplink is up, else once it connects.
    fn take_over_release(&mut self, lease_id: &str, except: Option<u64>, now: i64) {
        let at = self.next_stamp();
        let expires_at = self.orphan_expiry(now);
        if let Some(entry) = self.index.defer_release(lease_id, at, expires_at) {
            info!(lease = %lease_id, worker = %entry.worker_id,
                "its worker cannot take the release now: released there as soon as it can");
            self.notify_lost(&entry, LeaseEndReason::Explicit, except);
            if let Some(generation) = self.releasing_generation(&entry.worker_id) {
                self.fx.push_back(Effect::ReleaseOrphan {
                    worker_id: entry.worker_id.clone(),
                    generation,
                    worker_lease_id: entry.worker_lease_id.clone(),
                });
            }
        }
        self.dispatch(now);
    }

    /// When a lease that becomes an orphan `now` has ended on its worker whatever happens: nobody
    /// renews an orphan, and its last renewal (one in flight when the uplink dropped included)
    /// gave it at most the gateway's longest TTL; a minute is added for the worker's clock.
    /// When a lease request forwarded (or read by its worker) at `now` has ended whatever it
    /// granted: the forward's answer bound, then [`Self::orphan_expiry`].
    fn forward_expiry(&self, now: i64) -> i64 {
        self.orphan_expiry(now.saturating_add(self.settings.lease_request_timeout_ms))
    }

    fn orphan_expiry(&self, now: i64) -> i64 {
        let max_ttl = i64::try_from(self.settings.limits.max_ttl_ms).unwrap_or(i64::MAX);
        now.saturating_add(max_ttl)
            .saturating_add(ORPHAN_CLOCK_MARGIN_MS)
    }

    /// The worker answered the release of an orphan: released, or already gone, it is done; a
    /// lost uplink leaves it for the worker's next connection.
    pub fn handle_orphan_released(
        &mut self,
        worker_id: &str,
        worker_lease_id: &str,
        outcome: Result<(), ContractError>,
    ) {
        match outcome {
            Err(err) if err.code.is_transport() => {}
            _ => {
                let at = self.next_stamp();
                self.index.orphan_released(worker_id, worker_lease_id, at);
            }
        }
    }

    // === Leases ===

    /// A miss in the index: `UNKNOWN_LEASE` only when the gateway can vouch for it (the worker
    /// the id names is connected and its view read, or the gateway is releasing the lease
    /// there), else `WORKER_UNREACHABLE` naming it. A
    /// worker this gateway does not know (neither seen since it started nor stored from before)
    /// may be a mistyped id, or one it forgot that comes back: the gateway never declares a
    /// lease gone before its worker says so, and the message names both.
    fn missing(&self, lease_id: &str) -> FleetError {
        // Released while its worker was away: the gateway vouches that it ended.
        if split_lease_id(lease_id).is_some_and(|(worker, id)| self.index.is_orphan(worker, id)) {
            return FleetError::UnknownLease(lease_id.to_owned());
        }
        match worker_of(lease_id) {
            Some(worker) if !self.workers.contains_key(worker) => FleetError::WorkerUnreachable {
                worker_id: worker.to_owned(),
                message: format!(
                    "No worker {worker} is known to this gateway: check the lease id, or retry \
                     once its worker is back"
                ),
            },
            Some(worker) if self.live_generation(worker).is_none() => {
                FleetError::unreachable(worker)
            }
            // Connected, but it has not reported its leases: it is starting, or failed (a
            // worker whose store failed reports its health alone), since this gateway started.
            Some(worker)
                if self
                    .workers
                    .get(worker)
                    .is_some_and(|w| w.view.leases.is_none()) =>
            {
                FleetError::WorkerUnreachable {
                    worker_id: worker.to_owned(),
                    message: format!(
                        "Worker {worker} has not reported its leases to this gateway (it is \
                         starting, or failed); retry once it has"
                    ),
                }
            }
            _ => FleetError::UnknownLease(lease_id.to_owned()),
        }
    }

    /// One lease by id as `viewer` may see it, for the read routes (`GET /v1/leases/{id}` and
    /// its events): the record the lease list shows. A lease the list does not show is answered
    /// by the rule renew and release follow (`missing`): another's lease the index holds
    /// is `UNKNOWN_LEASE`; a miss is `UNKNOWN_LEASE` only when the worker the id names is
    /// connected and has reported its leases, else `WORKER_UNREACHABLE`.
    ///
    /// # Errors
    /// `UNKNOWN_LEASE`, `WORKER_UNREACHABLE`.
    pub fn lease_seen(
        &self,
        lease_id: &str,
        viewer: Viewer<'_>,
    ) -> Result<LeaseRecord, FleetError> {
        // The gateway's own lease, projected as the list projects it (view or not).
        if let Some(entry) = self.index.get(lease_id) {
            return if viewer.may_see(&entry.owner_id) {
                Ok(entry.project(self.worker_ref(&entry.worker_id)))
            } else {
                Err(FleetError::UnknownLease(lease_id.to_owned()))
            };
        }
        // A lease made on a worker directly, as the list shows it (to admins).
        for (worker_id, worker) in &self.workers {
            let found = worker
                .view
                .leases
                .as_deref()
                .unwrap_or_default()
                .iter()
                .find(|lease| {
                    lease.id.as_str() == lease_id
                        && matches!(self.seen(viewer, worker_id, lease), Seen::Direct)
                });
            if let Some(lease) = found {
                let mut lease = lease.clone();
                lease.worker_id = Some(worker.view.id.clone());
                lease.worker = Some(self.worker_ref(worker_id));
                return Ok(lease);
            }
        }
        Err(self.missing(lease_id))
    }

    fn target(&self, entry: &Entry) -> Result<LeaseTarget, FleetError> {
        let generation = self
            .live_generation(&entry.worker_id)
            .ok_or_else(|| FleetError::unreachable(&entry.worker_id))?;
        Ok(LeaseTarget {
            lease_id: entry.lease_id.clone(),
            worker_id: entry.worker_id.clone(),
            generation,
            worker_lease_id: entry.worker_lease_id.clone(),
            requester_id: entry.requester_id.clone(),
            worker_requester_id: format!("{}{}", self.prefix, entry.requester_id),
        })
    }

    /// Where `lease_id` lives, if `caller` may act on it (its owner, or an admin).
    ///
    /// # Errors
    /// `UNKNOWN_LEASE` (also for another's lease), `WORKER_UNREACHABLE` while its uplink is
    /// down.
    pub fn lease_target(
        &self,
        lease_id: &str,
        caller: Caller<'_>,
    ) -> Result<LeaseTarget, FleetError> {
        let Some(entry) = self.index.get(lease_id) else {
            // A lease made on a worker directly is an admin's to see here, and so to act on.
            if caller.admin
                && let Some(target) = self.direct_target(lease_id)
            {
                return Ok(target);
            }
            return Err(self.missing(lease_id));
        };
        if !caller.may_act_for(&entry.owner_id) {
            return Err(FleetError::UnknownLease(lease_id.to_owned()));
        }
        self.target(entry)
    }

    /// Where a lease made on a connected worker directly (listed to admins as it is, with the
    /// worker's own id) lives.
    fn direct_target(&self, lease_id: &str) -> Option<LeaseTarget> {
        self.workers.iter().find_map(|(worker_id, worker)| {
            let lease = worker
                .view
                .leases
                .as_deref()
                .unwrap_or_default()
                .iter()
                .find(|l| l.id.as_str() == lease_id)?;
            if self.seen(Viewer::ADMIN, worker_id, lease) != Seen::Direct {
                return None;
            }
            Some(LeaseTarget {
                lease_id: lease_id.to_owned(),
                worker_id: worker_id.clone(),
                generation: self.live_generation(worker_id)?,
                worker_lease_id: lease_id.to_owned(),
                requester_id: lease.requester_id.clone(),
                worker_requester_id: lease.requester_id.clone(),
            })
        })
    }

    /// Where `lease_id` lives for a `device.exec`: an agent must own it; an admin is held to
    /// its requester (`requester`, else the admin's principal).
    ///
    /// # Errors
    /// `FORBIDDEN`, `UNKNOWN_LEASE`, `WORKER_UNREACHABLE`.
    pub fn exec_target(
        &self,
        lease_id: &str,
        caller: Caller<'_>,
        requester: Option<&str>,
    ) -> Result<LeaseTarget, FleetError> {
        if !caller.admin && requester.is_some() {
            return Err(FleetError::Forbidden(
                "Only an admin may name requesterId on device.exec".into(),
            ));
        }
        let entry = self
            .index
            .get(lease_id)
            .ok_or_else(|| self.missing(lease_id))?;
        let allowed = if caller.admin {
            entry.requester_id == requester.unwrap_or(caller.principal)
        } else {
            entry.owner_id == caller.principal
        };
        if !allowed {
            return Err(FleetError::UnknownLease(lease_id.to_owned()));
        }
        self.target(entry)
    }

    /// A `lease.release` of `lease_id` by `caller`, for `reason`, goes out: to the worker
    /// holding it, or, when that worker is away and the release is its holder's (`explicit`),
    /// nowhere yet: the lease ends here now (its owner's other connections hear it), and the
    /// worker releases it once it is back, a gateway restart between included (the lease is
    /// kept as a stored orphan). An operator's `killed` still needs the worker.
    ///
    /// # Errors
    /// As [`Self::lease_target`].
    pub fn handle_release_sent(
        &mut self,
        lease_id: &str,
        caller: Caller<'_>,
        reason: LeaseEndReason,
        now: i64,
    ) -> Result<Release, FleetError> {
        let target = match self.lease_target(lease_id, caller) {
            Ok(target) => target,
            // The caller's own lease (the index holds it, and the caller may act on it) on a
            // worker that is away: its holder let it go, and is told so now.
            Err(FleetError::WorkerUnreachable { .. })
                if reason == LeaseEndReason::Explicit && self.index.get(lease_id).is_some() =>
            {
                self.take_over_release(lease_id, caller.connection, now);
                return Ok(Release::Deferred(lease_id.to_owned()));
            }
            Err(err) => return Err(err),
        };
        self.releasing
            .insert(target.lease_id.clone(), caller.connection);
        Ok(Release::Send(target))
    }

    /// The caller of a release sent for `target` on `connection` hung up before the worker
    /// answered: the release is nobody's any more, unless another caller has sent one since
    /// (theirs stays). Should the worker have carried it out, its own event says so; a later
    /// end of the lease is told as what it is, and reaches every connection.
    pub fn handle_release_abandoned(&mut self, target: &LeaseTarget, connection: Option<u64>) {
        if self.releasing.get(&target.lease_id) == Some(&connection) {
            self.releasing.remove(&target.lease_id);
        }
    }

    /// The worker answered a release for `reason`: the lease ends (its owner's other
    /// connections hear it once, with that reason); `UNKNOWN_LEASE` means it was gone already.
    /// A holder's (`explicit`) release the worker did not answer (`WORKER_UNREACHABLE`) ends
    /// the lease all the same, and is carried out as an orphan's: at once while the uplink is up,
    /// else once the worker is back.
    ///
    /// # Errors
    /// `UNKNOWN_LEASE`, `WORKER_UNREACHABLE`, or the worker's error.
    pub fn handle_release_answered(
        &mut self,
        target: &LeaseTarget,
        reason: LeaseEndReason,
        outcome: Result<(), FleetError>,
        now: i64,
    ) -> Result<String, FleetError> {
        match outcome {
            Ok(()) => {
                let except = self.releasing.remove(&target.lease_id).flatten();
                let at = self.next_stamp();
                if let Some(entry) = self
                    .index
                    .end(&target.worker_id, &target.worker_lease_id, at)
                {
                    self.notify_lost(&entry, reason, except);
                }
                self.dispatch(now);
                Ok(target.lease_id.clone())
            }
            // No answer (the uplink dropped, or the call timed out: a stalled uplink not yet
            // declared dead) to its holder's release: the worker may or may not have carried it
            // out. Either way the holder let the lease go: it ends here and is released as an
            // orphan, now if the uplink is still up, else once the worker is back.
            Err(FleetError::WorkerUnreachable { .. })
                if reason == LeaseEndReason::Explicit
                    && self.index.get(&target.lease_id).is_some() =>
            {
                let except = self.releasing.remove(&target.lease_id).flatten();
                self.take_over_release(&target.lease_id, except, now);
                Ok(target.lease_id.clone())
            }
            // Its end came meanwhile (the worker's event, or a view read without it): what the
            // release asked for is done.
            Err(FleetError::WorkerUnreachable { .. })
                if reason == LeaseEndReason::Explicit
                    && self.index.get(&target.lease_id).is_none()
                    && matches!(self.missing(&target.lease_id), FleetError::UnknownLease(_)) =>
            {
                self.releasing.remove(&target.lease_id);
                Ok(target.lease_id.clone())
            }
            Err(err) => {
                self.releasing.remove(&target.lease_id);
                Err(self.lease_error(target, err, now))
            }
        }
    }

    /// The worker answered a renew: the index and the view take the new deadline in place.
    ///
    /// # Errors
    /// `UNKNOWN_LEASE`, `WORKER_UNREACHABLE`, or the worker's error.
    pub fn handle_renew_answered(
        &mut self,
        target: &LeaseTarget,
        outcome: Result<LeaseRecord, FleetError>,
        now: i64,
    ) -> Result<LeaseRecord, FleetError> {
        let record = outcome.map_err(|err| self.lease_error(target, err, now))?;
        self.index.renewal_answered(&target.lease_id, &record);
        if let Some(worker) = self.workers.get_mut(&target.worker_id) {
            let renewal = Renewal {
                deadline: record.ttl_deadline,
                ttl_ms: Some(record.ttl_ms),
                at: record.last_renewed_at,
            };
            renew_in_place(&mut worker.view, &target.worker_lease_id, renewal);
        }
        let worker = self.worker_ref(&target.worker_id);
        Ok(match self.index.get(&target.lease_id) {
            Some(entry) => entry.project(worker),
            None => {
                // Ended between the answer and now: the worker's record, projected.
                let mut record = record;
                record.id = LeaseId::from_raw(target.lease_id.clone());
                record.requester_id.clone_from(&target.requester_id);
                record.worker_id = Some(worker.id.clone());
                record.worker = Some(worker);
                record
            }
        })
    }

    /// A call about a lease failed with `err` (the worker's answer, a lost uplink, a timeout):
    /// the worker's `UNKNOWN_LEASE` is its word that the lease is gone (the index forgets it and
    /// its owner hears it); anything else is answered as it is.
    pub fn handle_lease_call_failed(
        &mut self,
        target: &LeaseTarget,
        err: FleetError,
        now: i64,
    ) -> FleetError {
        self.lease_error(target, err, now)
    }

    fn lease_error(&mut self, target: &LeaseTarget, err: FleetError, now: i64) -> FleetError {
        if !matches!(&err, FleetError::Worker(e) if e.code == ErrorCode::UnknownLease) {
            return err;
        }
        let at = self.next_stamp();
        if let Some(entry) = self
            .index
            .end(&target.worker_id, &target.worker_lease_id, at)
        {
            let reason = if entry.record.ttl_deadline <= now {
                LeaseEndReason::Expired
            } else {
                LeaseEndReason::Killed
            };
            self.notify_lost(&entry, reason, None);
            self.dispatch(now);
        }
        FleetError::UnknownLease(target.lease_id.clone())
    }

    /// The ids of every lease the gateway issued (`lease.release-all`).
    pub fn lease_ids(&self) -> Vec<String> {
        let mut ids: Vec<String> = self.index.entries().map(|e| e.lease_id.clone()).collect();
        ids.sort();
        ids
    }

    // === Workers ===

    /// The worker an operator names: by its id, else by its label when exactly one worker has
    /// it. A name neither matches is answered as given (the operation says it is unknown).
    ///
    /// # Errors
    /// `BAD_REQUEST` when the label is several workers', naming their ids.
    pub fn resolve_worker(&self, name: &str) -> Result<String, FleetError> {
        if self.workers.contains_key(name) {
            return Ok(name.to_owned());
        }
        let labelled: Vec<&str> = self
            .workers
            .iter()
            .filter(|(_, w)| w.view.label.as_deref() == Some(name))
            .map(|(id, _)| id.as_str())
            .collect();
        match labelled.as_slice() {
            [] => Ok(name.to_owned()),
            [one] => Ok((*one).to_owned()),
            several => Err(FleetError::BadRequest(format!(
                "label {name} names {} workers ({}): name one by its id",
                several.len(),
                several.join(", ")
            ))),
        }
    }

    /// Whether draining (or undraining) `worker_id` changes anything.
    ///
    /// # Errors
    /// `UNKNOWN_WORKER`.
    pub fn drain_changes(&self, worker_id: &str, drained: bool) -> Result<bool, FleetError> {
        let worker = self
            .workers
            .get(worker_id)
            .ok_or_else(|| FleetError::UnknownWorker(worker_id.to_owned()))?;
        Ok(worker.view.drained != drained)
    }

    /// A worker was drained or undrained (and the change stored).
    pub fn handle_drained(&mut self, worker_id: &str, drained: bool, now: i64) {
        let Some(worker) = self.workers.get_mut(worker_id) else {
            return;
        };
        if worker.view.drained == drained {
            return;
        }
        worker.view.drained = drained;
        let worker_id = worker_id.to_owned();
        self.event(if drained {
            Event::WorkerDrainStarted { worker_id }
        } else {
            Event::WorkerDrainEnded { worker_id }
        });
        self.dispatch(now);
    }

    /// Whether an operator may forget `worker_id`: `true` for a known worker whose uplink is
    /// down, `false` for one the fleet does not know.
    ///
    /// # Errors
    /// `WORKER_CONNECTED` while its uplink is up.
    pub fn removable(&self, worker_id: &str) -> Result<bool, FleetError> {
        match self.workers.get(worker_id) {
            None => Ok(false),
            Some(w) if w.link.is_some() => Err(FleetError::WorkerConnected(worker_id.to_owned())),
            Some(_) => Ok(true),
        }
    }

    /// An operator forgets a disconnected worker (and its drain flag). Its leases end here: the
    /// operator says the worker is gone, so their owners hear `lease-lost` `killed` and may ask
    /// for other devices; each is kept as an orphan (ADR 0030), released should the worker ever
    /// connect again. Answers whether it was known.
    ///
    /// # Errors
    /// `WORKER_CONNECTED` while its uplink is up.
    pub fn handle_remove(&mut self, worker_id: &str, now: i64) -> Result<bool, FleetError> {
        if !self.removable(worker_id)? {
            return Ok(false);
        }
        if let Some(worker) = self.workers.remove(worker_id) {
            let held: Vec<String> = self
                .index
                .of_worker(worker_id)
                .into_iter()
                .map(|e| e.lease_id.clone())
                .collect();
            let at = self.next_stamp();
            let expires_at = self.orphan_expiry(now);
            for lease_id in held {
                if let Some(entry) = self.index.defer_release(&lease_id, at, expires_at) {
                    // A release of it in flight is answered; its caller's connection hears no
                    // more of it.
                    let except = self.releasing.remove(&lease_id).flatten();
                    info!(lease = %lease_id, worker = %worker_id,
                        "its worker was removed: the lease ends here, and is released there should it come back");
                    self.notify_lost(&entry, LeaseEndReason::Killed, except);
                }
            }
            self.index.forget_worker(worker_id);
            self.fx.push_back(Effect::Forget {
                worker_id: worker_id.to_owned(),
            });
            self.event(Event::WorkerRemoved {
                worker_id: worker_id.to_owned(),
                label: worker.view.label,
                reason: WorkerRemovedReason::Operator,
            });
        }
        self.dispatch(now);
        Ok(true)
    }

    // === Time ===

    /// Time passed: waiters past their deadline are answered (queued ones `QUEUE_TIMEOUT`,
    /// forwarded ones `WORKER_UNREACHABLE` and their grant, should it come, released), periodic
    /// refreshes go out, disconnected workers past retention that hold no live lease of this
    /// gateway are forgotten (a drained one keeps its flag), old book records go.
    pub fn handle_tick(&mut self, now: i64) {
        self.index.expire(now);
        let timed_out: Vec<(RequestId, String, u64)> = self
            .queue
            .waiters()
            .iter()
            .filter_map(|w| {
                let a = w.attempt()?;
                (a.deadline <= now).then(|| (w.id.clone(), a.worker_id.clone(), a.id))
            })
            .collect();
        for (id, worker_id, _) in timed_out {
            let bound = u128::try_from(self.settings.lease_request_timeout_ms).unwrap_or(0);
            self.answer(
                &id,
                Err(FleetError::no_answer(
                    &worker_id,
                    "the lease request",
                    bound,
                )),
                now,
            );
        }
        let due: Vec<String> = self
            .workers
            .iter()
            .filter(|(_, w)| {
                w.link
                    .as_ref()
                    .and_then(|l| l.periodic_at)
                    .is_some_and(|at| at <= now)
            })
            .map(|(id, _)| id.clone())
            .collect();
        let interval = self.settings.refresh_interval_ms;
        for worker_id in due {
            if let Some(link) = self
                .workers
                .get_mut(&worker_id)
                .and_then(|w| w.link.as_mut())
            {
                link.periodic_at = Some(now.saturating_add(interval));
            }
            self.ask_refresh(&worker_id, true, now);
        }
        let folded: Vec<(String, bool)> = self
            .workers
            .iter()
            .filter_map(|(id, w)| {
                let link = w.link.as_ref()?;
                let due = link.refreshing.is_none() && link.spaced_until <= now;
                link.again
                    .filter(|_| due)
                    .map(|catalog| (id.clone(), catalog))
            })
            .collect();
        for (worker_id, catalog) in folded {
            if let Some(link) = self
                .workers
                .get_mut(&worker_id)
                .and_then(|w| w.link.as_mut())
            {
                link.asked -= 1;
            }
            self.ask_refresh(&worker_id, catalog, now);
        }
        self.sweep(now);
        self.queue.book.prune(now, BOOK_RETENTION_MS);
        self.dispatch(now);
    }

    /// Forgets disconnected workers past retention that hold no live gateway lease.
    fn sweep(&mut self, now: i64) {
        let retention = self.settings.disconnected_retention_ms;
        let expired: Vec<String> = self
            .workers
            .iter()
            .filter(|(_, w)| w.awaits_retention())
            .filter(|(_, w)| w.view.last_seen_at <= now.saturating_sub(retention))
            .filter(|(id, w)| {
                let in_view = w
                    .view
                    .leases
                    .as_deref()
                    .unwrap_or_default()
                    .iter()
                    .any(|l| l.requester_id.starts_with(&self.prefix) && l.ttl_deadline > now);
                let indexed = self
                    .index
                    .of_worker(id)
                    .iter()
                    .any(|e| e.record.ttl_deadline > now);
                !in_view && !indexed
            })
            .map(|(id, _)| id.clone())
            .collect();
        for id in expired {
            let Some(worker) = self.workers.remove(&id) else {
                continue;
            };
            self.index.forget_worker(&id);
            self.fx.push_back(Effect::Forget {
                worker_id: id.clone(),
            });
            if worker.view.drained {
                // Retention keeps the drain flag: the worker comes back drained. What is kept
                // is not swept again, and says when the worker was last seen.
                let mut view = blank_view(
                    &id,
                    worker.view.label,
                    worker.view.last_seen_at,
                    Connection::Disconnected,
                );
                view.drained = true;
                let kept = Worker::new(view, &mut self.revisions, true, true);
                self.workers.insert(id, kept);
                continue;
            }
            self.event(Event::WorkerRemoved {
                worker_id: id,
                label: worker.view.label,
                reason: WorkerRemovedReason::Retention,
            });
        }
    }

    /// The gateway stops: every waiter fails `DAEMON_STOPPING`, every uplink closes, and new
    /// requests are refused.
    pub fn handle_stop(&mut self, now: i64) {
        self.stopping = true;
        let ids: Vec<RequestId> = self.queue.waiters().iter().map(|w| w.id.clone()).collect();
        for id in ids {
            self.answer(&id, Err(FleetError::Stopping), now);
        }
        let generations: Vec<u64> = self
            .workers
            .values()
            .filter_map(|w| w.link.as_ref().map(|l| l.generation))
            .collect();
        for generation in generations {
            self.fx.push_back(Effect::Close {
                generation,
                why: Closing::Stopping,
            });
        }
    }
}

/// The error of a fast-fail assessment, if it refuses.
fn assessment_error(assessment: &Assessment, wanted: &Wanted) -> Option<FleetError> {
    let platform = wanted.platform;
    match assessment {
        Assessment::Serviceable => None,
        Assessment::NoWorker => Some(FleetError::NoCapacity(
            "No worker of this gateway that can serve this request takes requests now: each is away, drained or failed",
        )),
        Assessment::NoDriver => Some(FleetError::NoDriver(platform)),
        Assessment::UnknownModel => Some(FleetError::UnknownModel {
            platform,
            model: wanted.model.clone().unwrap_or_default(),
        }),
        Assessment::RuntimeMissing => Some(FleetError::RuntimeMissing {
            platform,
            model: wanted.model.clone(),
            os: wanted
                .os_version
                .clone()
                .unwrap_or_else(|| "default".into()),
        }),
        Assessment::CapabilityMissing(capability) => {
            Some(FleetError::CapabilityMissing(capability.clone()))
        }
    }
}

/// How `lease.rejected` names a refusal.
fn rejection_reason(err: &FleetError) -> RejectionReason {
    if matches!(err, FleetError::QueueFull { .. }) {
        return RejectionReason::QueueFull;
    }
    match err.code() {
        ErrorCode::NoCapacity => RejectionReason::NoWorker,
        ErrorCode::QueueTimeout => RejectionReason::Timeout,
        ErrorCode::RequesterAlreadyLeased => RejectionReason::AlreadyLeased,
        ErrorCode::LeaseIdTaken => RejectionReason::LeaseIdTaken,
        ErrorCode::Cancelled => RejectionReason::Cancelled,
        ErrorCode::WorkerUnreachable => RejectionReason::WorkerFailed,
        ErrorCode::DaemonStopping => RejectionReason::Killed,
        _ => RejectionReason::UnresolvableSpec,
    }
}

/// The `lease.request` a worker gets: its own model name, the namespaced requester, the owner,
/// and `noWait` (the gateway never routes into a worker's queue).
fn forward_input(prefix: &str, waiter: &Waiter, matched: &Match) -> LeaseRequestInput {
    LeaseRequestInput {
        platform: waiter.wanted.platform,
        model: matched
            .model
            .clone()
            .or_else(|| waiter.wanted.model.clone()),
        os_version: waiter.wanted.os_version.clone(),
        requester_id: Some(format!("{prefix}{}", waiter.requester)),
        no_wait: Some(true),
        timeout_ms: None,
        ttl_ms: waiter.input.ttl_ms,
        idempotency_key: None,
        owner: Some(waiter.owner.clone()),
        lease_id: waiter.input.lease_id.clone(),
        requires: waiter.wanted.requires.clone(),
    }
}
