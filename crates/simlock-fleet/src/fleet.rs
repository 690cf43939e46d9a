//! The fleet's async shell: the fleet core ([`crate::state::Core`]) behind one lock, the live
//! uplinks, and the callers waiting on lease requests. It reads the clock, takes the lock for
//! every decision, then carries out the decision's effects under the same lock, in order
//! (answers, notices, events, forwards, view reads, orphan releases, closes), and runs the one
//! timer the core asks for. Nothing here decides: it performs calls and reports their outcomes
//! back as inputs.

use std::collections::HashMap;
use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::{Arc, Weak};
use std::time::Duration;

use parking_lot::Mutex;
use rusqlite::OptionalExtension as _;
use simlock_contract::event::EventModule;
use simlock_contract::ids::RequestId;
use simlock_contract::model::{LeaseGrant, LeaseLimits, WorkerView};
use simlock_contract::ops::{
    CatalogGet, ConfigGet, LeaseIdInput, LeaseRelease, LeaseRequest, ListGet, ListInput, ListKind,
    ListOutput, StatusGet,
};
use simlock_contract::push::Progress;
use simlock_contract::{ContractError, Push};
use simlock_daemon::clock::SharedClock;
use simlock_daemon::events::EventBus;
use simlock_daemon::presence::Presence;
use simlock_daemon::store::{Database, StoreError};
use simlock_link::LinkHandle;
use simlock_wire::{CallEvent, WireClient, decode_raw};
use tokio::sync::{Notify, mpsc, watch};
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};

use crate::config::FleetConfig;
use crate::error::FleetError;
use crate::state::index::Entry;
use crate::state::{
    Closing, Core, Effect, KnownWorker, Refresh, RefreshFailure, Settings, Stamp, StoredForward,
    StoredOrphan, routing,
};

const MIGRATIONS: &[&str] = &[
    "CREATE TABLE drained_workers (worker_id TEXT PRIMARY KEY, drained_at INTEGER NOT NULL)",
    "CREATE TABLE known_workers (worker_id TEXT PRIMARY KEY, label TEXT, \
     seen_at INTEGER NOT NULL, connected INTEGER NOT NULL)",
    "CREATE TABLE orphan_leases (worker_id TEXT NOT NULL, worker_lease_id TEXT NOT NULL, \
     granted_at INTEGER NOT NULL, expires_at INTEGER NOT NULL, \
     PRIMARY KEY (worker_id, worker_lease_id))",
    "CREATE TABLE forwards_out (worker_id TEXT NOT NULL, requester_id TEXT NOT NULL, \
     answered_lease TEXT, expires_at INTEGER NOT NULL, PRIMARY KEY (worker_id, requester_id))",
    // A restarted gateway keeps every stored forward until its worker is back: no bound is read.
    "ALTER TABLE forwards_out DROP COLUMN expires_at",
];

/// Timing the gateway works with; tests shorten it.
#[derive(Debug, Clone, Copy)]
pub struct FleetTiming {
    /// Every call to a worker is bounded by this (10 s).
    pub call_timeout: Duration,
    /// Every worker view is refreshed this often (30 s).
    pub refresh_interval: Duration,
    /// A refresh its events ask for waits this long after the previous one (50 ms); the asks
    /// in between fold into it.
    pub refresh_gap: Duration,
    /// A forwarded lease request is bounded by this (`gateway.leaseRequestTimeoutMs`).
    pub lease_request_timeout: Duration,
    /// A forwarded exec is stopped after this (`gateway.execTimeoutMs`).
    pub exec_timeout: Duration,
    /// A disconnected worker's view is forgotten after this (`gateway.disconnectedRetentionMs`).
    pub disconnected_retention: Duration,
    /// The stall timeout of the links on the gateway's uplinks (the link's 60 s; tests shorten it).
    pub link_stall_timeout: Duration,
}

impl FleetTiming {
    /// The timing `config` asks for.
    pub fn from_config(config: &FleetConfig) -> Self {
        Self {
            call_timeout: Duration::from_secs(10),
            refresh_interval: Duration::from_secs(30),
            refresh_gap: Duration::from_millis(50),
            lease_request_timeout: Duration::from_millis(config.lease_request_timeout_ms),
            exec_timeout: Duration::from_millis(config.exec_timeout_ms),
            disconnected_retention: Duration::from_millis(config.disconnected_retention_ms),
            link_stall_timeout: simlock_link::config::STALL_TIMEOUT,
        }
    }
}

fn millis(d: Duration) -> i64 {
    i64::try_from(d.as_millis()).unwrap_or(i64::MAX)
}

/// How many index removals a follower may lag behind.
const DROPPED_BUFFER: usize = 1024;

/// How long a stop waits for the uplinks' close handshakes: a little past the link's own
/// linger (1 s), which already bounds each.
const STOP_LINGER: Duration = Duration::from_secs(2);

/// What the fleet is built from.
pub struct FleetParts {
    /// The gateway's instance id.
    pub gateway_id: String,
    /// The gateway's lease limits.
    pub limits: LeaseLimits,
    /// `lease.maxWaiting`: the most requests the fleet queue holds.
    pub max_waiting: u32,
    /// Timing.
    pub timing: FleetTiming,
    /// The state store (drained set).
    pub db: Database,
    /// The gateway's event bus.
    pub bus: Arc<EventBus>,
    /// Time.
    pub clock: SharedClock,
    /// Connections by principal, for lease notices.
    pub presence: Presence,
}

/// A live uplink to a worker.
pub struct WorkerConn {
    /// The worker.
    pub worker_id: String,
    /// Which connection of that worker this is.
    pub generation: u64,
    /// The protocol client driving the worker.
    pub client: WireClient,
    /// The link under it, for byte channels.
    pub link: LinkHandle,
    /// The join token it came with.
    pub token_id: String,
    fleet: Weak<Fleet>,
    closed: CancellationToken,
}

impl std::fmt::Debug for WorkerConn {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WorkerConn")
            .field("worker_id", &self.worker_id)
            .field("generation", &self.generation)
            .finish_non_exhaustive()
    }
}

impl WorkerConn {
    /// How many refreshes of the view were asked for on this connection (asks made while one
    /// runs fold into one more, so more may be asked than run).
    pub fn refreshes_asked(&self) -> u64 {
        self.fleet.upgrade().map_or(0, |fleet| {
            fleet.shared.lock().core.refreshes_asked(self.generation)
        })
    }

    /// Closes the uplink.
    pub fn close(&self) {
        self.shut(None);
    }

    /// Closes the uplink, telling the worker `why`.
    pub(crate) fn close_because(&self, why: Closing) {
        self.shut(Some(why));
    }

    fn shut(&self, why: Option<Closing>) {
        // The link first: the uplink's task wakes on `closed` (perhaps on another thread) and
        // closes the link itself, without a reason; the first close is the one the worker hears.
        match why {
            Some(why) => self.link.close_because(why.to_string()),
            None => self.link.close(),
        }
        self.client.close();
        self.closed.cancel();
    }

    /// Fires when the uplink is closed locally.
    pub(crate) fn closed_token(&self) -> CancellationToken {
        self.closed.clone()
    }
}

/// What a caller of a lease request hears.
#[derive(Debug, Clone)]
pub(crate) enum Update {
    Progress(Progress),
    Done(Box<Result<LeaseGrant, ContractError>>),
}

pub(crate) struct Shared {
    pub(crate) core: Core,
    /// The live uplinks, by generation.
    conns: HashMap<u64, Arc<WorkerConn>>,
    /// The callers of each waiting request (each request sends them a handful of updates).
    pub(crate) followers: HashMap<RequestId, Followers>,
    /// Orphans whose rows could not be written (a full disk): written again with every
    /// decision until they are, or until they settle.
    unstored_orphans: Vec<StoredOrphan>,
}

/// A change to the stored forwards out ([`Effect::StoreForward`], [`Effect::SettleForward`]).
enum ForwardRow {
    Store(StoredForward),
    Settle {
        worker_id: String,
        requester_id: String,
    },
}

/// The forwards out's row changes, queued under the fleet's lock in the order of their
/// decisions and written once it is released, all that are queued in one transaction: a lease
/// request costs the gateway two row changes, which under the lock held up every other decision
/// (and one transaction each paid a commit each).
#[derive(Default)]
struct ForwardRows {
    /// Queued in decision order; a leaf lock (taken under the fleet's lock, or under `writing`).
    queued: Mutex<Vec<ForwardRow>>,
    /// Held while a batch is written: a decider whose rows another took waits here until they
    /// are stored.
    writing: Mutex<()>,
}

/// What a decision leaves to be done once the fleet's lock is released, after the rows queued
/// so far are stored: a forward is stored before it goes out, and a grant's answer reaches its
/// waiter only once its forward's settling is stored (a gateway killed between the two would,
/// after its restart, release the lease its requester was told of).
#[derive(Default)]
struct AfterLock {
    rows: bool,
    forwards: Vec<(
        Arc<WorkerConn>,
        u64,
        simlock_contract::ops::LeaseRequestInput,
    )>,
    answers: Vec<(Followers, Outcome)>,
    /// Why an orphan the decision made could not be stored, if one could not.
    orphan_unstored: Option<String>,
}

/// The callers following one lease request.
type Followers = Vec<mpsc::UnboundedSender<Update>>;
/// How a lease request ended, for its callers.
type Outcome = Box<Result<LeaseGrant, ContractError>>;

/// The fleet of one gateway.
pub struct Fleet {
    me: Weak<Self>,
    gateway_id: String,
    pub(crate) limits: LeaseLimits,
    pub(crate) timing: FleetTiming,
    db: Database,
    /// Held by every change that is stored (drains, removals) from before its decision until
    /// it is stored and applied, always taken before the fleet's lock: stores happen in the
    /// order of their decisions, and none under the fleet's lock.
    persist: Mutex<()>,
    forward_rows: ForwardRows,
    pub(crate) bus: Arc<EventBus>,
    pub(crate) clock: SharedClock,
    presence: Presence,
    pub(crate) shared: Mutex<Shared>,
    changes: watch::Sender<u64>,
    /// The leases that left the index, for whoever follows them.
    dropped: tokio::sync::broadcast::Sender<String>,
    wake: Arc<Notify>,
    /// The deadline the timer sleeps toward (`i64::MAX` for none); set under the lock, so a
    /// decision wakes the timer only when it brought the next deadline forward.
    timer_at: Arc<AtomicI64>,
    pub(crate) stopping: CancellationToken,
}

impl std::fmt::Debug for Fleet {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Fleet")
            .field("gateway_id", &self.gateway_id)
            .finish_non_exhaustive()
    }
}

fn store_error(e: &StoreError) -> FleetError {
    FleetError::Store(e.to_string())
}

impl Fleet {
    /// Builds the fleet, loading the drained set, and starts its timer.
    ///
    /// # Errors
    /// When the store cannot be read.
    pub fn start(parts: FleetParts) -> Result<Arc<Self>, StoreError> {
        parts.db.migrate("fleet", MIGRATIONS)?;
        let drained: Vec<(String, i64)> = parts.db.with(|c| {
            let mut stmt =
                c.prepare("SELECT worker_id, drained_at FROM drained_workers ORDER BY worker_id")?;
            let rows = stmt.query_map([], |row| Ok((row.get(0)?, row.get(1)?)))?;
            rows.collect()
        })?;
        let known: Vec<KnownWorker> = parts.db.with(|c| {
            let mut stmt = c.prepare(
                "SELECT worker_id, label, seen_at, connected FROM known_workers ORDER BY worker_id",
            )?;
            let rows = stmt.query_map([], |row| {
                Ok(KnownWorker {
                    id: row.get(0)?,
                    label: row.get(1)?,
                    seen_at: row.get(2)?,
                    connected: row.get(3)?,
                })
            })?;
            rows.collect()
        })?;
        let orphans = parts.db.with(load_orphans)?;
        let forwards = parts.db.with(load_forwards)?;
        let settings = Settings {
            gateway_id: parts.gateway_id.clone(),
            limits: parts.limits,
            refresh_interval_ms: millis(parts.timing.refresh_interval),
            refresh_gap_ms: millis(parts.timing.refresh_gap),
            lease_request_timeout_ms: millis(parts.timing.lease_request_timeout),
            disconnected_retention_ms: millis(parts.timing.disconnected_retention),
            max_waiting: parts.max_waiting,
        };
        let mut core = Core::new(settings, drained, known, parts.clock.now_ms());
        core.restore_orphans(orphans);
        core.restore_forwards(forwards);
        let fleet = Arc::new_cyclic(|me| Self {
            me: me.clone(),
            gateway_id: parts.gateway_id,
            limits: parts.limits,
            timing: parts.timing,
            db: parts.db,
            persist: Mutex::new(()),
            forward_rows: ForwardRows::default(),
            bus: parts.bus,
            clock: parts.clock,
            presence: parts.presence,
            shared: Mutex::new(Shared {
                core,
                conns: HashMap::new(),
                followers: HashMap::new(),
                unstored_orphans: Vec::new(),
            }),
            changes: watch::Sender::new(0),
            dropped: tokio::sync::broadcast::channel(DROPPED_BUFFER).0,
            wake: Arc::new(Notify::new()),
            timer_at: Arc::new(AtomicI64::new(i64::MAX)),
            stopping: CancellationToken::new(),
        });
        fleet.spawn_timer();
        Ok(fleet)
    }

    /// The gateway's instance id.
    pub fn gateway_id(&self) -> &str {
        &self.gateway_id
    }

    // === The one decision section ===

    /// Runs one decision under the lock and carries out its effects: under the lock, but for the
    /// forwards out's rows and the forwards themselves (after it, rows first).
    pub(crate) fn decide<T>(&self, decision: impl FnOnce(&mut Shared, i64) -> T) -> T {
        self.decide_storing(decision).0
    }

    /// [`Self::decide`], answering too why an orphan the decision made could not be stored (a
    /// full disk), for a caller that must not be told its release is kept when it is not.
    pub(crate) fn decide_storing<T>(
        &self,
        decision: impl FnOnce(&mut Shared, i64) -> T,
    ) -> (T, Option<String>) {
        let mut shared = self.shared.lock();
        let now = self.clock.now_ms();
        let out = decision(&mut shared, now);
        let after = self.apply(&mut shared);
        drop(shared);
        if after.rows || !after.forwards.is_empty() {
            self.store_forward_rows();
        }
        // Once, after the lock and the rows: whoever waits for a change and reads the store
        // sees them.
        self.changes.send_modify(|n| *n = n.wrapping_add(1));
        for (followers, outcome) in after.answers {
            for tx in followers {
                let _ = tx.send(Update::Done(outcome.clone()));
            }
        }
        for (conn, attempt, input) in after.forwards {
            self.spawn_forward(conn, attempt, input);
        }
        (out, after.orphan_unstored)
    }

    /// Stores every forward row queued so far, in one transaction; when another decider took
    /// them, waits until it has stored them.
    fn store_forward_rows(&self) {
        let _writing = self.forward_rows.writing.lock();
        let rows = std::mem::take(&mut *self.forward_rows.queued.lock());
        if rows.is_empty() {
            return;
        }
        let stored = self.db.with(|c| {
            let tx = c.transaction()?;
            for row in &rows {
                match row {
                    ForwardRow::Store(forward) => store_forward(&tx, forward)?,
                    ForwardRow::Settle {
                        worker_id,
                        requester_id,
                    } => settle_forward(&tx, worker_id, requester_id)?,
                };
            }
            tx.commit()
        });
        if let Err(e) = stored {
            for row in &rows {
                match row {
                    ForwardRow::Store(forward) => {
                        warn!(worker = %forward.worker_id, requester = %forward.requester_id, error = %e, "a forwarded lease request could not be stored; should the gateway restart before its answer, a grant it made is listed as its requester's until its TTL");
                    }
                    ForwardRow::Settle {
                        worker_id,
                        requester_id,
                    } => {
                        warn!(worker = %worker_id, requester = %requester_id, error = %e, "an answered lease request stays stored; after a restart a lease of that requester on that worker not yet known is released");
                    }
                }
            }
        }
    }

    /// Carries out every effect the core queued, in order, under the caller's lock; what must
    /// wait for the lock's release is returned.
    fn apply(&self, shared: &mut Shared) -> AfterLock {
        let mut after = AfterLock::default();
        if !shared.unstored_orphans.is_empty() {
            // What a full disk refused before, written again in one transaction (one failed
            // commit per decision while the disk stays full).
            let written = self.db.with(|c| {
                let tx = c.transaction()?;
                for orphan in &shared.unstored_orphans {
                    store_orphan(&tx, orphan)?;
                }
                tx.commit()
            });
            if written.is_ok() {
                for orphan in std::mem::take(&mut shared.unstored_orphans) {
                    info!(worker = %orphan.worker_id, lease = %orphan.worker_lease_id, "a lease being released is stored now");
                }
            }
        }
        while let Some(effect) = shared.core.poll_effect() {
            match effect {
                Effect::Answer { request, outcome } => {
                    let outcome = Box::new((*outcome).map_err(ContractError::from));
                    let followers = shared.followers.remove(&request).unwrap_or_default();
                    after.answers.push((followers, outcome));
                }
                Effect::Progress { request, progress } => {
                    if let Some(list) = shared.followers.get_mut(&request) {
                        list.retain(|tx| tx.send(Update::Progress(progress)).is_ok());
                    }
                }
                Effect::Event(event) => {
                    self.bus.emit(EventModule::Fleet, &event);
                }
                Effect::Dropped { lease_id } => {
                    // Nobody following is fine; a follower that lagged catches up by looking.
                    let _ = self.dropped.send(lease_id);
                }
                Effect::Relay(envelope) => {
                    self.bus.relay(envelope);
                }
                Effect::Notice {
                    owner,
                    push,
                    except,
                } => self.presence.notify(&owner, &push, except),
                Effect::Forward {
                    attempt,
                    worker_id,
                    generation,
                    input,
                } => match shared.conns.get(&generation) {
                    Some(conn) => after.forwards.push((conn.clone(), attempt, input)),
                    None => {
                        let now = self.clock.now_ms();
                        shared.core.handle_forward_answered(
                            attempt,
                            &worker_id,
                            Err(ContractError::connection_lost()),
                            now,
                        );
                    }
                },
                Effect::Refresh {
                    generation,
                    sent,
                    catalog,
                    ..
                } => match shared.conns.get(&generation) {
                    Some(conn) => self.spawn_refresh(conn.clone(), sent, catalog),
                    None => shared.core.handle_refresh_failed(
                        generation,
                        sent,
                        RefreshFailure::Failed(ContractError::connection_lost()),
                        false,
                        self.clock.now_ms(),
                    ),
                },
                Effect::ReleaseOrphan {
                    worker_id,
                    generation,
                    worker_lease_id,
                } => match shared.conns.get(&generation) {
                    Some(conn) => self.spawn_orphan_release(conn.clone(), worker_lease_id),
                    None => shared.core.handle_orphan_released(
                        &worker_id,
                        &worker_lease_id,
                        Err(ContractError::connection_lost()),
                    ),
                },
                Effect::Remember(worker) => {
                    // Small and rare (a handshake, a close): written in order with the
                    // decisions, so a crash right after loses none of it.
                    if let Err(e) = self.db.with(|c| remember(c, &worker)) {
                        warn!(worker = %worker.id, error = %e, "what is known of the worker could not be stored; after a restart it is listed again once it reconnects");
                    }
                }
                Effect::Forget { worker_id } => {
                    if let Err(e) = self.db.with(|c| forget(c, &worker_id)) {
                        warn!(worker = %worker_id, error = %e, "the forgotten worker stays stored; a restart lists it again until its retention passes");
                    }
                }
                Effect::StoreOrphan(orphan) => {
                    if let Err(e) = self.db.with(|c| store_orphan(c, &orphan)) {
                        warn!(worker = %orphan.worker_id, lease = %orphan.worker_lease_id, error = %e, "a lease being released could not be stored yet (stored once there is room); a restart before lists it again until its TTL");
                        after.orphan_unstored.get_or_insert_with(|| e.to_string());
                        // One pending row per lease: the newest.
                        shared.unstored_orphans.retain(|o| {
                            o.worker_id != orphan.worker_id
                                || o.worker_lease_id != orphan.worker_lease_id
                        });
                        shared.unstored_orphans.push(orphan);
                    }
                }
                Effect::SettleOrphan {
                    worker_id,
                    worker_lease_id,
                } => {
                    shared.unstored_orphans.retain(|o| {
                        o.worker_id != worker_id || o.worker_lease_id != worker_lease_id
                    });
                    if let Err(e) = self
                        .db
                        .with(|c| settle_orphan(c, &worker_id, &worker_lease_id))
                    {
                        warn!(worker = %worker_id, lease = %worker_lease_id, error = %e, "a released lease stays stored; after a restart its release is tried again");
                    }
                }
                Effect::StoreForward(forward) => {
                    self.forward_rows
                        .queued
                        .lock()
                        .push(ForwardRow::Store(forward));
                    after.rows = true;
                }
                Effect::SettleForward {
                    worker_id,
                    requester_id,
                } => {
                    self.forward_rows.queued.lock().push(ForwardRow::Settle {
                        worker_id,
                        requester_id,
                    });
                    after.rows = true;
                }
                Effect::Close { generation, why } => {
                    if let Some(conn) = shared.conns.get(&generation) {
                        conn.close_because(why);
                    }
                }
            }
        }
        if shared
            .core
            .next_deadline()
            .is_some_and(|at| at < self.timer_at.load(Ordering::SeqCst))
        {
            self.wake.notify_one();
        }
        after
    }

    /// Sleeps until the core's next deadline and ticks then; a decision wakes it to sleep again
    /// towards the (possibly earlier) new deadline.
    fn spawn_timer(&self) {
        let me = self.me.clone();
        let stopping = self.stopping.clone();
        let (wake, clock, timer_at) =
            (self.wake.clone(), self.clock.clone(), self.timer_at.clone());
        tokio::spawn(async move {
            loop {
                let Some(fleet) = me.upgrade() else { return };
                let next = {
                    let shared = fleet.shared.lock();
                    let next = shared.core.next_deadline();
                    timer_at.store(next.unwrap_or(i64::MAX), Ordering::SeqCst);
                    next
                };
                drop(fleet);
                let at = next.map(|at| simlock_daemon::clock::instant_at(&*clock, at));
                let woken = wake.notified();
                let due = async {
                    match at {
                        Some(at) => tokio::time::sleep_until(at).await,
                        None => std::future::pending().await,
                    }
                };
                tokio::select! {
                    () = stopping.cancelled() => return,
                    () = woken => continue,
                    () = due => {}
                }
                let Some(fleet) = me.upgrade() else { return };
                fleet.decide(|shared, now| shared.core.handle_tick(now));
            }
        });
    }

    // === Effects carried out ===

    /// Forwards one lease request and reports its progress and answer.
    fn spawn_forward(
        &self,
        conn: Arc<WorkerConn>,
        attempt: u64,
        input: simlock_contract::ops::LeaseRequestInput,
    ) {
        let me = self.me.clone();
        // The core fails the attempt at `leaseRequestTimeoutMs`; this bound only ends the call.
        let bound = self
            .timing
            .lease_request_timeout
            .saturating_add(self.timing.call_timeout);
        tokio::spawn(async move {
            let run = async {
                let mut call = conn.client.begin_call::<LeaseRequest>(&input, 16).await?;
                loop {
                    match call.next().await {
                        CallEvent::Push(frame) => {
                            if let Ok(Push::Progress { progress, .. }) = Push::from_frame(frame)
                                && let Some(fleet) = me.upgrade()
                            {
                                fleet.decide(|shared, _| {
                                    shared.core.handle_forward_progress(attempt, progress);
                                });
                            }
                        }
                        CallEvent::Reply(reply) => {
                            return reply.and_then(|raw| decode_raw::<LeaseRequest>(&raw));
                        }
                    }
                }
            };
            let outcome = tokio::time::timeout(bound, run)
                .await
                .unwrap_or_else(|_| Err(ContractError::connection_lost()));
            if let Err(err) = &outcome
                && crate::error::is_uplink_lost(err)
            {
                warn!(worker = %conn.worker_id, "the uplink was lost while a lease request was forwarded");
            }
            if let Some(fleet) = me.upgrade() {
                fleet.decide(|shared, now| {
                    shared
                        .core
                        .handle_forward_answered(attempt, &conn.worker_id, outcome, now);
                });
            }
        });
    }

    /// Reads a worker's view (its status, then its devices, then, when asked, its catalog and
    /// config), each call bounded, and reports it.
    fn spawn_refresh(&self, conn: Arc<WorkerConn>, sent: Stamp, catalog: bool) {
        let me = self.me.clone();
        let bound = self.timing.call_timeout;
        tokio::spawn(async move {
            let outcome = read_view(&conn.client, bound, catalog).await;
            let Some(fleet) = me.upgrade() else { return };
            fleet.decide(|shared, now| match outcome {
                Ok(refresh) => shared
                    .core
                    .handle_refreshed(conn.generation, sent, refresh, now),
                Err(failure) => {
                    if let RefreshFailure::Failed(err) = &failure {
                        debug!(worker = %conn.worker_id, error = %err, "a refresh failed");
                    }
                    shared
                        .core
                        .handle_refresh_failed(conn.generation, sent, failure, catalog, now);
                }
            });
        });
    }

    /// Releases a lease the gateway ended (an orphan: a grant nobody waits for, or a holder's
    /// release its worker could not take then) and reports the worker's answer.
    fn spawn_orphan_release(&self, conn: Arc<WorkerConn>, worker_lease_id: String) {
        let me = self.me.clone();
        let bound = self.timing.call_timeout;
        tokio::spawn(async move {
            info!(worker = %conn.worker_id, lease = %worker_lease_id, "releasing a lease the gateway ended (a grant nobody waits for, or released while its worker was away)");
            let input = LeaseIdInput {
                reason: None,
                lease_id: worker_lease_id.clone(),
            };
            let outcome = tokio::time::timeout(bound, conn.client.call::<LeaseRelease>(&input))
                .await
                .unwrap_or_else(|_| Err(ContractError::connection_lost()))
                .map(|_| ());
            if let Some(fleet) = me.upgrade() {
                fleet.decide(|shared, _| {
                    shared
                        .core
                        .handle_orphan_released(&conn.worker_id, &worker_lease_id, outcome);
                });
            }
        });
    }

    // === Uplinks ===

    /// Registers a new uplink for `worker_id`, replacing (and closing) any previous one.
    pub(crate) fn attach(
        &self,
        worker_id: &str,
        label: Option<String>,
        token_id: String,
        client: WireClient,
        link: LinkHandle,
    ) -> Arc<WorkerConn> {
        self.decide(|shared, now| {
            let generation =
                shared
                    .core
                    .handle_uplink_opened(worker_id, label, token_id.clone(), now);
            let conn = Arc::new(WorkerConn {
                worker_id: worker_id.to_owned(),
                generation,
                client,
                link,
                token_id,
                fleet: self.me.clone(),
                closed: CancellationToken::new(),
            });
            shared.conns.insert(generation, conn.clone());
            conn
        })
    }

    /// The uplink ended. A replaced uplink's late close changes nothing.
    pub(crate) fn detach(&self, conn: &WorkerConn) {
        // A worker that went silent until its link gave up on it was last seen when it went
        // silent, up to the PINGs' 15 s before the close.
        let silent = i64::try_from(conn.link.silent_for().as_millis()).unwrap_or(i64::MAX);
        self.decide(|shared, now| {
            shared.conns.remove(&conn.generation);
            let heard_at = now.saturating_sub(silent);
            shared
                .core
                .handle_uplink_closed(conn.generation, heard_at, now);
        });
    }

    /// Stops: waiting requests fail `DAEMON_STOPPING`; uplinks close, telling their workers
    /// the gateway is stopping. Resolves once every uplink's close handshake is done or given
    /// up (the link's linger bounds it), so a gateway that exits next has said why.
    pub async fn stop(&self) {
        let links: Vec<LinkHandle> = {
            let shared = self.shared.lock();
            shared
                .conns
                .values()
                .map(|conn| conn.link.clone())
                .collect()
        };
        // The decision first: its effects close each uplink telling the worker why, before the
        // uplinks' own tasks see the stop and close them without a reason.
        self.decide(|shared, now| shared.core.handle_stop(now));
        self.stopping.cancel();
        let finished = futures::future::join_all(links.iter().map(LinkHandle::finished));
        if tokio::time::timeout(STOP_LINGER, finished).await.is_err() {
            warn!("an uplink's close did not finish within {STOP_LINGER:?}");
        }
    }

    // === Queries ===

    /// Every view, in id order.
    pub fn views(&self) -> Vec<WorkerView> {
        self.shared.lock().core.views()
    }

    /// One worker's view.
    pub fn view(&self, worker_id: &str) -> Option<WorkerView> {
        self.shared.lock().core.view(worker_id).cloned()
    }

    /// `worker_id` as a holder of leases needing `capability`, read in place.
    pub fn holder(&self, worker_id: &str, capability: &str) -> Option<routing::Holder> {
        self.shared
            .lock()
            .core
            .view(worker_id)
            .map(|view| routing::holder(view, capability))
    }

    /// A worker's label, without copying its view.
    pub fn label_of(&self, worker_id: &str) -> Option<String> {
        self.shared.lock().core.label_of(worker_id)
    }

    /// The live uplink of `worker_id`, if it has one (and it agrees on the protocol).
    pub fn conn(&self, worker_id: &str) -> Option<Arc<WorkerConn>> {
        let shared = self.shared.lock();
        let generation = shared.core.live_generation(worker_id)?;
        shared.conns.get(&generation).cloned()
    }

    /// The uplink `generation`, while it is attached.
    pub(crate) fn conn_of(&self, generation: u64) -> Option<Arc<WorkerConn>> {
        self.shared.lock().conns.get(&generation).cloned()
    }

    /// A snapshot of the lease index entry for `lease_id`.
    pub fn lease(&self, lease_id: &str) -> Option<Entry> {
        self.shared.lock().core.lease(lease_id).cloned()
    }

    /// The leases this gateway is releasing on their workers, as stored: what a restart takes
    /// back (ADR 0030).
    ///
    /// # Errors
    /// When the store cannot be read.
    pub fn stored_orphans(&self) -> Result<Vec<StoredOrphan>, StoreError> {
        self.db.with(load_orphans)
    }

    /// The lease requests forwarded to workers whose answers are still to settle, as stored:
    /// what a restart takes back.
    ///
    /// # Errors
    /// When the store cannot be read.
    pub fn stored_forwards(&self) -> Result<Vec<StoredForward>, StoreError> {
        self.db.with(load_forwards)
    }

    /// How many leases the gateway issued and indexes.
    pub fn lease_count(&self) -> usize {
        self.shared.lock().core.index().len()
    }

    /// Follows the leases that leave the index (ended, or their worker forgotten), by the
    /// gateway's id. A follower that falls more than 1024 behind loses the oldest.
    pub fn dropped_leases(&self) -> tokio::sync::broadcast::Receiver<String> {
        self.dropped.subscribe()
    }

    /// Every worker that can take a new lease requiring `capability` now
    /// ([`routing::capable`]), in id order.
    pub fn capable_workers(&self, capability: &str) -> Vec<routing::CapableWorker> {
        // The views come in id order.
        self.shared
            .lock()
            .core
            .view_refs()
            .filter_map(|v| routing::capable(v, capability))
            .collect()
    }

    /// Follows changes to the fleet (a counter that moves on every decision).
    pub fn changes(&self) -> watch::Receiver<u64> {
        self.changes.subscribe()
    }

    // === Workers ===

    /// The worker an operator names, by id or unique label
    /// ([`crate::state::Core::resolve_worker`]).
    ///
    /// # Errors
    /// `BAD_REQUEST` for a label several workers have.
    pub fn resolve_worker(&self, name: &str) -> Result<String, ContractError> {
        self.shared
            .lock()
            .core
            .resolve_worker(name)
            .map_err(ContractError::from)
    }

    /// Drains or undrains a worker; persisted before answering; idempotent: whether this call
    /// changed it.
    ///
    /// # Errors
    /// `UNKNOWN_WORKER`, or `INTERNAL` on a store failure.
    pub fn set_drained(&self, worker_id: &str, drained: bool) -> Result<bool, ContractError> {
        let _stored_in_order = self.persist.lock();
        let now = self.clock.now_ms();
        if !self
            .shared
            .lock()
            .core
            .drain_changes(worker_id, drained)
            .map_err(ContractError::from)?
        {
            return Ok(false);
        }
        // Stored outside the fleet's lock; a failure changes nothing.
        self.db
            .with(|c| {
                if drained {
                    store_drain(c, worker_id, now)
                } else {
                    forget_drain(c, worker_id)
                }
            })
            .map_err(|e| ContractError::from(store_error(&e)))?;
        let known = self.decide(|shared, now| {
            let known = shared.core.view(worker_id).is_some();
            shared.core.handle_drained(worker_id, drained, now);
            known
        });
        if !known {
            // Retention forgot it in between: what was stored goes too.
            self.forget_stored_drain(worker_id);
            return Err(FleetError::UnknownWorker(worker_id.to_owned()).into());
        }
        Ok(true)
    }

    /// Forgets a disconnected worker (and its drain flag); its stored drain flag goes first.
    ///
    /// # Errors
    /// `WORKER_CONNECTED` while its uplink is up, or `INTERNAL` on a store failure (the worker
    /// is not forgotten).
    pub fn remove(&self, worker_id: &str) -> Result<bool, ContractError> {
        let _stored_in_order = self.persist.lock();
        if !self
            .shared
            .lock()
            .core
            .removable(worker_id)
            .map_err(ContractError::from)?
        {
            // Nothing to forget here; a drain flag a failed store left behind goes.
            self.forget_stored_drain(worker_id);
            return Ok(false);
        }
        // Stored outside the fleet's lock, before the fleet forgets it; a failure changes
        // nothing. A drain of the same worker waits for this store.
        let drained_at = self
            .db
            .with(|c| take_drain(c, worker_id))
            .map_err(|e| ContractError::from(store_error(&e)))?;
        let removed = self.decide(|shared, now| shared.core.handle_remove(worker_id, now));
        if removed.is_err()
            && let Some(at) = drained_at
        {
            // Its uplink came back in between: it stays, drained, and so does what was stored.
            if let Err(e) = self.db.with(|c| store_drain(c, worker_id, at)) {
                warn!(worker = %worker_id, error = %e, "the worker's drain flag could not be stored again; it comes back undrained after a restart");
            }
        }
        removed.map_err(ContractError::from)
    }

    /// Deletes `worker_id`'s stored drain flag when the fleet knows no such worker; a failure
    /// is logged (the worker would come back drained after a restart) and changes nothing else.
    fn forget_stored_drain(&self, worker_id: &str) {
        if let Err(e) = self.db.with(|c| forget_drain(c, worker_id)) {
            warn!(worker = %worker_id, error = %e, "the forgotten worker's drain flag stays stored");
        }
    }

    /// Closes every uplink opened with token `token_id` (it was revoked).
    pub fn close_uplinks_of(&self, token_id: &str) {
        let shared = self.shared.lock();
        for (generation, token) in shared.core.uplinks() {
            if token == token_id
                && let Some(conn) = shared.conns.get(&generation)
            {
                info!(worker = %conn.worker_id, "closing an uplink whose join token was revoked");
                conn.close_because(Closing::TokenRevoked);
            }
        }
    }
}

/// One view read: every call bounded by `bound`; a status read that times out is told apart.
async fn read_view(
    client: &WireClient,
    bound: Duration,
    catalog: bool,
) -> Result<Refresh, RefreshFailure> {
    let failed = |err| RefreshFailure::Failed(err);
    let timed_out = || {
        RefreshFailure::Failed(ContractError::new(
            simlock_contract::ErrorCode::WorkerUnreachable,
            "the worker did not answer in time",
        ))
    };
    let status =
        match tokio::time::timeout(bound, client.call::<StatusGet>(&Default::default())).await {
            Err(_) => return Err(RefreshFailure::StatusTimeout),
            Ok(outcome) => outcome.map_err(failed)?,
        };
    let list = ListInput {
        kind: ListKind::Devices,
    };
    let devices = match tokio::time::timeout(bound, client.call::<ListGet>(&list)).await {
        Err(_) => return Err(timed_out()),
        Ok(Ok(ListOutput::Devices(devices))) => Some(devices),
        Ok(Ok(_)) => None,
        Ok(Err(err)) => return Err(failed(err)),
    };
    let (catalog, limits) = if catalog {
        let catalog = tokio::time::timeout(bound, client.call::<CatalogGet>(&Default::default()))
            .await
            .map_err(|_| timed_out())?
            .map_err(failed)?;
        let config = tokio::time::timeout(bound, client.call::<ConfigGet>(&Default::default()))
            .await
            .map_err(|_| timed_out())?
            .map_err(failed)?;
        (Some(catalog.platforms), Some(config.lease))
    } else {
        (None, None)
    };
    Ok(Refresh {
        status,
        devices,
        catalog,
        limits,
    })
}

/// Stores what is known of a worker, replacing what was.
fn remember(c: &rusqlite::Connection, worker: &KnownWorker) -> rusqlite::Result<usize> {
    c.execute(
        "INSERT OR REPLACE INTO known_workers (worker_id, label, seen_at, connected) \
         VALUES (?1, ?2, ?3, ?4)",
        rusqlite::params![worker.id, worker.label, worker.seen_at, worker.connected],
    )
}

/// The stored orphans, in (worker, lease) order.
fn load_orphans(c: &mut rusqlite::Connection) -> rusqlite::Result<Vec<StoredOrphan>> {
    let mut stmt = c.prepare(
        "SELECT worker_id, worker_lease_id, granted_at, expires_at FROM orphan_leases \
         ORDER BY worker_id, worker_lease_id",
    )?;
    let rows = stmt.query_map([], |row| {
        Ok(StoredOrphan {
            worker_id: row.get(0)?,
            worker_lease_id: row.get(1)?,
            granted_at: row.get(2)?,
            expires_at: row.get(3)?,
        })
    })?;
    rows.collect()
}

/// Stores a lease being released on its worker.
fn store_orphan(c: &rusqlite::Connection, orphan: &StoredOrphan) -> rusqlite::Result<usize> {
    c.execute(
        "INSERT OR REPLACE INTO orphan_leases \
         (worker_id, worker_lease_id, granted_at, expires_at) VALUES (?1, ?2, ?3, ?4)",
        rusqlite::params![
            orphan.worker_id,
            orphan.worker_lease_id,
            orphan.granted_at,
            orphan.expires_at
        ],
    )
}

/// Deletes a stored orphan.
fn settle_orphan(
    c: &rusqlite::Connection,
    worker_id: &str,
    worker_lease_id: &str,
) -> rusqlite::Result<usize> {
    c.execute(
        "DELETE FROM orphan_leases WHERE worker_id = ?1 AND worker_lease_id = ?2",
        [worker_id, worker_lease_id],
    )
}

/// The stored forwards out, in (worker, requester) order.
fn load_forwards(c: &mut rusqlite::Connection) -> rusqlite::Result<Vec<StoredForward>> {
    let mut stmt = c.prepare(
        "SELECT worker_id, requester_id, answered_lease FROM forwards_out \
         ORDER BY worker_id, requester_id",
    )?;
    let rows = stmt.query_map([], |row| {
        Ok(StoredForward {
            worker_id: row.get(0)?,
            requester_id: row.get(1)?,
            answered_lease: row.get(2)?,
        })
    })?;
    rows.collect()
}

/// Stores a lease request forwarded to a worker.
fn store_forward(c: &rusqlite::Connection, forward: &StoredForward) -> rusqlite::Result<usize> {
    c.prepare_cached(
        "INSERT OR REPLACE INTO forwards_out (worker_id, requester_id, answered_lease) \
         VALUES (?1, ?2, ?3)",
    )?
    .execute(rusqlite::params![
        forward.worker_id,
        forward.requester_id,
        forward.answered_lease
    ])
}

/// Deletes a stored forward.
fn settle_forward(
    c: &rusqlite::Connection,
    worker_id: &str,
    requester_id: &str,
) -> rusqlite::Result<usize> {
    c.prepare_cached("DELETE FROM forwards_out WHERE worker_id = ?1 AND requester_id = ?2")?
        .execute([worker_id, requester_id])
}

/// Deletes what was stored of a worker.
fn forget(c: &rusqlite::Connection, worker_id: &str) -> rusqlite::Result<usize> {
    c.execute(
        "DELETE FROM known_workers WHERE worker_id = ?1",
        [worker_id],
    )
}

/// Stores `worker_id`'s drain flag, set at `at`.
fn store_drain(c: &rusqlite::Connection, worker_id: &str, at: i64) -> rusqlite::Result<usize> {
    c.execute(
        "INSERT OR REPLACE INTO drained_workers (worker_id, drained_at) VALUES (?1, ?2)",
        rusqlite::params![worker_id, at],
    )
}

/// Deletes `worker_id`'s stored drain flag; answers when it was set, if it was stored.
fn take_drain(c: &mut rusqlite::Connection, worker_id: &str) -> rusqlite::Result<Option<i64>> {
    let tx = c.transaction()?;
    let at = tx
        .query_row(
            "SELECT drained_at FROM drained_workers WHERE worker_id = ?1",
            [worker_id],
            |row| row.get(0),
        )
        .optional()?;
    forget_drain(&tx, worker_id)?;
    tx.commit()?;
    Ok(at)
}

/// Deletes `worker_id`'s stored drain flag.
fn forget_drain(c: &rusqlite::Connection, worker_id: &str) -> rusqlite::Result<usize> {
    c.execute(
        "DELETE FROM drained_workers WHERE worker_id = ?1",
        [worker_id],
    )
}

#[cfg(test)]
mod tests {
    use simlock_contract::ErrorCode;
    use simlock_daemon::clock::TokioClock;

    use super::*;

    const T0: i64 = 1_000_000;

    /// A forward stored by a gateway whose rows held its bound is taken back after the
    /// migration that drops it.
    #[test]
    fn a_forward_stored_with_a_bound_is_taken_back_after_the_bound_is_dropped() {
        let db = Database::open_in_memory().unwrap();
        db.migrate("fleet", &MIGRATIONS[..MIGRATIONS.len() - 1])
            .unwrap();
        db.with(|c| {
            c.execute(
                "INSERT INTO forwards_out (worker_id, requester_id, answered_lease, expires_at) \
                 VALUES ('w1', 'agent', 'lse_1', 5)",
                [],
            )
        })
        .unwrap();
        db.migrate("fleet", MIGRATIONS).unwrap();
        assert_eq!(
            db.with(load_forwards).unwrap(),
            [StoredForward {
                worker_id: "w1".into(),
                requester_id: "agent".into(),
                answered_lease: Some("lse_1".into()),
            }]
        );
    }

    /// A fleet over `db` (whose drained set it loads), with an event bus to look at.
    fn fleet(db: &Database) -> (Arc<Fleet>, Arc<EventBus>) {
        let clock = TokioClock::starting_at(T0).shared();
        let bus = EventBus::new(64, clock.clone());
        let fleet = Fleet::start(FleetParts {
            gateway_id: "g1".into(),
            limits: LeaseLimits {
                default_ttl_ms: 1000,
                max_ttl_ms: 60_000,
            },
            max_waiting: 1_000,
            timing: FleetTiming::from_config(&FleetConfig::default()),
            db: db.clone(),
            bus: bus.clone(),
            clock,
            presence: Presence::new(),
        })
        .unwrap();
        (fleet, bus)
    }

    /// A store whose drained set holds `drained`.
    fn store(drained: &[&str]) -> Database {
        let db = Database::open_in_memory().unwrap();
        db.migrate("fleet", MIGRATIONS).unwrap();
        for worker_id in drained {
            db.with(|c| store_drain(c, worker_id, T0 - 1)).unwrap();
        }
        db
    }

    /// The workers the store holds drained.
    fn stored(db: &Database) -> Vec<String> {
        db.with(|c| {
            let mut stmt = c.prepare("SELECT worker_id FROM drained_workers ORDER BY worker_id")?;
            let rows = stmt.query_map([], |row| row.get(0))?;
            rows.collect()
        })
        .unwrap()
    }

    /// The disk fails under the gateway: the drained set's table is gone.
    fn break_store(db: &Database) {
        db.with(|c| c.execute_batch("DROP TABLE drained_workers"))
            .unwrap();
    }

    /// The disk is back, empty.
    fn heal_store(db: &Database) {
        db.with(|c| c.execute_batch(MIGRATIONS[0])).unwrap();
    }

    /// A worker the fleet knows, connected once (its handshake passed) and now disconnected.
    fn seen(fleet: &Fleet, worker_id: &str) {
        fleet.decide(|shared, now| {
            let generation = shared
                .core
                .handle_uplink_opened(worker_id, None, "tok_j".into(), now);
            let sent = shared.core.handle_probe_sent();
            let status = crate::state::tests::status(Vec::new(), 0);
            shared
                .core
                .handle_connected(generation, "t".into(), &status, sent, now);
            shared.core.handle_uplink_closed(generation, now, now);
        });
    }

    fn drained(fleet: &Fleet, worker_id: &str) -> Option<bool> {
        fleet.view(worker_id).map(|v| v.drained)
    }

    /// The worker events recorded on the bus, by name, but the uplinks' (those of [`seen`]).
    fn worker_events(bus: &EventBus) -> Vec<String> {
        bus.replay(None)
            .into_iter()
            .map(|e| e.event)
            .filter(|e| e.starts_with("worker."))
            .filter(|e| !matches!(e.as_str(), "worker.connected" | "worker.disconnected"))
            .collect()
    }

    /// A call refused because the gateway's store failed: `INTERNAL`, naming the store.
    fn assert_store_failed(err: &ContractError) {
        assert_eq!(err.code, ErrorCode::Internal, "{err:?}");
        assert!(err.message.contains("state store"), "{}", err.message);
    }

    #[tokio::test(start_paused = true)]
    async fn a_drain_or_undrain_that_cannot_be_stored_changes_nothing_and_is_reported() {
        let db = store(&["w1"]);
        let (fleet, bus) = fleet(&db);
        seen(&fleet, "w2");
        assert_eq!(
            (drained(&fleet, "w1"), drained(&fleet, "w2")),
            (Some(true), Some(false))
        );
        break_store(&db);

        assert_store_failed(&fleet.set_drained("w2", true).unwrap_err());
        assert_store_failed(&fleet.set_drained("w1", false).unwrap_err());
        assert_eq!(
            (drained(&fleet, "w1"), drained(&fleet, "w2")),
            (Some(true), Some(false)),
            "neither view moved"
        );
        assert!(worker_events(&bus).is_empty(), "{:?}", worker_events(&bus));
        // What changes nothing needs no store, and still answers (unchanged).
        assert!(!fleet.set_drained("w1", true).unwrap());

        // Once the store takes writes again, the same calls go through.
        heal_store(&db);
        assert!(fleet.set_drained("w2", true).unwrap());
        assert_eq!(stored(&db), ["w2"]);
        assert_eq!(drained(&fleet, "w2"), Some(true));
        assert_eq!(worker_events(&bus), ["worker.drain-started"]);
    }

    #[tokio::test(start_paused = true)]
    async fn a_removal_that_cannot_be_stored_changes_nothing_and_is_reported() {
        let db = store(&["w1"]);
        let (fleet, bus) = fleet(&db);
        seen(&fleet, "w2");
        break_store(&db);

        assert_store_failed(&fleet.remove("w1").unwrap_err());
        assert_store_failed(&fleet.remove("w2").unwrap_err());
        assert_eq!(
            (drained(&fleet, "w1"), drained(&fleet, "w2")),
            (Some(true), Some(false)),
            "both are still known, as they were"
        );
        assert!(worker_events(&bus).is_empty(), "{:?}", worker_events(&bus));

        // Once the store takes writes again, the same calls go through.
        heal_store(&db);
        db.with(|c| store_drain(c, "w1", T0 - 1)).unwrap();
        assert!(fleet.remove("w1").unwrap());
        assert!(fleet.remove("w2").unwrap());
        assert_eq!((fleet.view("w1"), fleet.view("w2")), (None, None));
        assert!(
            stored(&db).is_empty(),
            "the drain flag went with the worker"
        );
        assert_eq!(worker_events(&bus), ["worker.removed", "worker.removed"]);
        assert!(
            !fleet.remove("w1").unwrap(),
            "a worker the fleet does not know"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_restarted_gateway_lists_the_workers_it_knew_until_they_are_removed() {
        let db = store(&[]);
        let (first, _bus) = fleet(&db);
        seen(&first, "w1");
        // A WebSocket that joined and never passed a handshake is no worker, before or after.
        first.decide(|shared, now| {
            let generation = shared
                .core
                .handle_uplink_opened("w9", None, "tok_j".into(), now);
            shared.core.handle_uplink_closed(generation, now, now);
        });
        first.stop().await;
        drop(first);

        let (again, _bus) = fleet(&db);
        let listed: Vec<_> = again
            .views()
            .into_iter()
            .map(|v| (v.id, v.connection, v.last_seen_at))
            .collect();
        assert_eq!(
            listed,
            [(
                "w1".to_owned(),
                simlock_contract::model::Connection::Disconnected,
                T0
            )],
            "w1 is listed away, last seen when its uplink closed"
        );
        assert!(again.remove("w1").unwrap());
        again.stop().await;
        drop(again);
        let (third, _bus) = fleet(&db);
        assert!(third.views().is_empty(), "a removed worker stays forgotten");
    }

    #[tokio::test(start_paused = true)]
    async fn a_connected_worker_is_not_removed_and_keeps_its_stored_drain_flag() {
        let db = store(&["w1"]);
        let (fleet, _bus) = fleet(&db);
        fleet.decide(|shared, now| {
            shared
                .core
                .handle_uplink_opened("w1", None, "tok_j".into(), now)
        });
        assert_eq!(
            fleet.remove("w1").unwrap_err().code,
            ErrorCode::WorkerConnected
        );
        assert_eq!(drained(&fleet, "w1"), Some(true));
        assert_eq!(stored(&db), ["w1"]);
    }
}
