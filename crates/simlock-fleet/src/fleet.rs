//! The fleet: every worker the gateway knows (its view and, while connected, its uplink), the
//! lease index and the fleet queue, behind one lock that is never held across an await.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use parking_lot::Mutex;
use serde_json::{Value, json};
use simlock_contract::event::{Event, EventModule, WorkerRemovedReason};
use simlock_contract::ids::gateway_requester_prefix;
use simlock_contract::model::{
    Connection, EventEnvelope, LeaseLimits, LeaseRecord, ProtocolPair, WorkerView,
};
use simlock_contract::ops::StatusOutput;
use simlock_contract::{ContractError, ErrorCode, ProtocolRange, Push};
use simlock_daemon::clock::SharedClock;
use simlock_daemon::config::Config;
use simlock_daemon::events::EventBus;
use simlock_daemon::presence::Presence;
use simlock_daemon::store::{Database, StoreError};
use simlock_link::LinkHandle;
use simlock_wire::WireClient;
use tokio::sync::{Notify, watch};
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use crate::index::{Entry, LeaseIndex};
use crate::queue::Queue;

const MIGRATIONS: &[&str] =
    &["CREATE TABLE drained_workers (worker_id TEXT PRIMARY KEY, drained_at INTEGER NOT NULL)"];

/// Timing the gateway works with; tests shorten it.
#[derive(Debug, Clone, Copy)]
pub struct FleetTiming {
    /// Every call to a worker is bounded by this (10 s).
    pub call_timeout: Duration,
    /// Every worker view is refreshed this often (30 s).
    pub refresh_interval: Duration,
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
    pub fn from_config(config: &Config) -> Self {
        Self {
            call_timeout: Duration::from_secs(10),
            refresh_interval: Duration::from_secs(30),
            lease_request_timeout: Duration::from_millis(config.gateway.lease_request_timeout_ms),
            exec_timeout: Duration::from_millis(config.gateway.exec_timeout_ms),
            disconnected_retention: Duration::from_millis(config.gateway.disconnected_retention_ms),
            link_stall_timeout: simlock_link::config::STALL_TIMEOUT,
        }
    }
}

/// What the fleet is built from.
pub struct FleetParts {
    /// The gateway's instance id.
    pub gateway_id: String,
    /// The gateway's lease limits.
    pub limits: LeaseLimits,
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
    refresh: watch::Sender<u64>,
    refresh_catalog: AtomicBool,
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
    /// Asks for a refresh of the view; requests made while one runs fold into one more.
    pub fn request_refresh(&self, include_catalog: bool) {
        if include_catalog {
            self.refresh_catalog.store(true, Ordering::SeqCst);
        }
        self.refresh.send_modify(|n| *n = n.wrapping_add(1));
    }

    /// How many refreshes of the view were asked for on this connection (requests made while
    /// one runs fold into one more, so more may be asked than run).
    pub fn refreshes_asked(&self) -> u64 {
        *self.refresh.borrow()
    }

    /// Takes the catalog flag of the pending refresh.
    pub(crate) fn take_catalog_flag(&self) -> bool {
        self.refresh_catalog.swap(false, Ordering::SeqCst)
    }

    /// Waits for the next refresh request.
    pub(crate) fn refresh_requests(&self) -> watch::Receiver<u64> {
        self.refresh.subscribe()
    }

    /// Closes the uplink.
    pub fn close(&self) {
        self.closed.cancel();
        self.link.close();
        self.client.close();
    }

    /// Fires when the uplink is closed locally.
    pub(crate) fn closed_token(&self) -> CancellationToken {
        self.closed.clone()
    }
}

pub(crate) struct Worker {
    pub(crate) view: WorkerView,
    pub(crate) conn: Option<Arc<WorkerConn>>,
    pub(crate) generation: u64,
}

pub(crate) struct State {
    pub(crate) workers: BTreeMap<String, Worker>,
    pub(crate) index: LeaseIndex,
    pub(crate) queue: Queue,
    /// Gateway leases being released by a caller, with the caller's connection, so the owner's
    /// `lease-lost` skips the connection that asked.
    pub(crate) releasing: HashMap<String, Option<u64>>,
}

/// The fleet of one gateway.
pub struct Fleet {
    pub(crate) gateway_id: String,
    pub(crate) prefix: String,
    pub(crate) limits: LeaseLimits,
    pub(crate) timing: FleetTiming,
    db: Database,
    pub(crate) bus: Arc<EventBus>,
    pub(crate) clock: SharedClock,
    pub(crate) presence: Presence,
    pub(crate) state: Mutex<State>,
    pub(crate) kick: Arc<Notify>,
    changes: watch::Sender<u64>,
    generations: AtomicU64,
    pub(crate) stopping: CancellationToken,
}

impl std::fmt::Debug for Fleet {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Fleet")
            .field("gateway_id", &self.gateway_id)
            .finish_non_exhaustive()
    }
}

fn store_error(e: &StoreError) -> ContractError {
    ContractError::internal(e.to_string())
}

impl Fleet {
    /// Builds the fleet, loading the drained set, and starts its dispatcher and sweeper.
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
        let mut workers = BTreeMap::new();
        for (id, at) in drained {
            let view = blank_view(&id, None, at, Connection::Disconnected);
            workers.insert(
                id,
                Worker {
                    view: WorkerView {
                        drained: true,
                        ..view
                    },
                    conn: None,
                    generation: 0,
                },
            );
        }
        let prefix = gateway_requester_prefix(&parts.gateway_id);
        let fleet = Arc::new(Self {
            gateway_id: parts.gateway_id,
            prefix: prefix.clone(),
            limits: parts.limits,
            timing: parts.timing,
            db: parts.db,
            bus: parts.bus,
            clock: parts.clock,
            presence: parts.presence,
            state: Mutex::new(State {
                workers,
                index: LeaseIndex::new(prefix),
                queue: Queue::default(),
                releasing: HashMap::new(),
            }),
            kick: Arc::new(Notify::new()),
            changes: watch::Sender::new(0),
            generations: AtomicU64::new(1),
            stopping: CancellationToken::new(),
        });
        crate::coordinator::spawn_dispatcher(&fleet);
        spawn_sweeper(&fleet);
        Ok(fleet)
    }

    /// The gateway's instance id.
    pub fn gateway_id(&self) -> &str {
        &self.gateway_id
    }

    /// The prefix of the requester ids the gateway forwards: `gw:<id>:`.
    pub fn requester_prefix(&self) -> &str {
        &self.prefix
    }

    /// Stops dispatching; waiting requests fail `DAEMON_STOPPING`; uplinks close.
    pub fn stop(&self) {
        self.stopping.cancel();
        let (waiters, conns) = {
            let mut state = self.state.lock();
            let waiters = state.queue.drain_all();
            let conns: Vec<_> = state
                .workers
                .values()
                .filter_map(|w| w.conn.clone())
                .collect();
            (waiters, conns)
        };
        for waiter in waiters {
            waiter.settle(Err(ContractError::stopping()));
        }
        for conn in conns {
            conn.close();
        }
    }

    /// Every view, in id order.
    pub fn views(&self) -> Vec<WorkerView> {
        self.state
            .lock()
            .workers
            .values()
            .map(|w| w.view.clone())
            .collect()
    }

    /// One worker's view.
    pub fn view(&self, worker_id: &str) -> Option<WorkerView> {
        self.state
            .lock()
            .workers
            .get(worker_id)
            .map(|w| w.view.clone())
    }

    /// A worker's label, without copying its view.
    pub fn label_of(&self, worker_id: &str) -> Option<String> {
        self.state
            .lock()
            .workers
            .get(worker_id)
            .and_then(|w| w.view.label.clone())
    }

    /// The live uplink of `worker_id`, if it has one (and it agrees on the protocol).
    pub fn conn(&self, worker_id: &str) -> Option<Arc<WorkerConn>> {
        let state = self.state.lock();
        let worker = state.workers.get(worker_id)?;
        if worker.view.connection != Connection::Connected {
            return None;
        }
        worker.conn.clone()
    }

    /// A snapshot of the lease index entry for `lease_id`.
    pub fn lease(&self, lease_id: &str) -> Option<Entry> {
        self.state.lock().index.get(lease_id).cloned()
    }

    /// Follows changes to the views (a counter that moves on every change).
    pub fn changes(&self) -> watch::Receiver<u64> {
        self.changes.subscribe()
    }

    /// Records that views changed: wakes the dispatcher and followers.
    pub(crate) fn views_changed(&self) {
        self.views_touched();
        self.kick.notify_one();
    }

    /// Tells the watchers of the views (not the dispatcher) that one changed.
    fn views_touched(&self) {
        self.changes.send_modify(|n| *n = n.wrapping_add(1));
    }

    /// Registers a new uplink for `worker_id`, replacing (and closing) any previous one.
    pub(crate) fn attach(
        &self,
        worker_id: &str,
        label: Option<String>,
        token_id: String,
        client: WireClient,
        link: LinkHandle,
    ) -> Arc<WorkerConn> {
        let generation = self.generations.fetch_add(1, Ordering::SeqCst);
        let conn = Arc::new(WorkerConn {
            worker_id: worker_id.to_owned(),
            generation,
            client,
            link,
            token_id,
            refresh: watch::Sender::new(0),
            refresh_catalog: AtomicBool::new(true),
            closed: CancellationToken::new(),
        });
        let previous = {
            let mut state = self.state.lock();
            let now = self.clock.now_ms();
            let worker = state
                .workers
                .entry(worker_id.to_owned())
                .or_insert_with(|| Worker {
                    view: blank_view(worker_id, label.clone(), now, Connection::Disconnected),
                    conn: None,
                    generation,
                });
            worker.generation = generation;
            worker.view.label = label.or_else(|| worker.view.label.take());
            // The view waits for the handshake before it counts as connected.
            worker.view.catalog_read_at = None;
            worker.conn.replace(conn.clone())
        };
        if let Some(previous) = previous {
            info!(
                worker = worker_id,
                "a reconnect replaces the previous uplink"
            );
            previous.close();
        }
        conn
    }

    /// The handshake succeeded: the worker is connected with its first status.
    pub(crate) fn connected(&self, conn: &WorkerConn, version: String, status: &StatusOutput) {
        let label = {
            let mut state = self.state.lock();
            let State { workers, index, .. } = &mut *state;
            let Some(worker) = workers
                .get_mut(&conn.worker_id)
                .filter(|w| w.generation == conn.generation)
            else {
                return;
            };
            worker.view.connection = Connection::Connected;
            worker.view.protocol = None;
            worker.view.version = Some(version.clone());
            apply_status(&mut worker.view, status, self.clock.now_ms());
            // The probe already lists the worker's leases: index them now, so a renew right
            // after a gateway restart finds its lease.
            if let Some(leases) = &status.leases {
                index.apply_snapshot(&conn.worker_id, leases);
            }
            worker.view.label.clone()
        };
        self.bus.emit(
            EventModule::Fleet,
            &Event::WorkerConnected {
                worker_id: conn.worker_id.clone(),
                label,
                version,
            },
        );
        info!(worker = %conn.worker_id, "worker connected");
        self.views_changed();
    }

    /// The worker speaks no protocol version the gateway does.
    pub(crate) fn incompatible(
        &self,
        conn: &WorkerConn,
        gateway: ProtocolRange,
        worker: ProtocolRange,
    ) {
        let mut state = self.state.lock();
        if let Some(w) = state
            .workers
            .get_mut(&conn.worker_id)
            .filter(|w| w.generation == conn.generation)
        {
            w.view.connection = Connection::Incompatible;
            w.view.protocol = Some(ProtocolPair { gateway, worker });
            w.view.last_seen_at = self.clock.now_ms();
        }
        drop(state);
        warn!(worker = %conn.worker_id, ?worker, ?gateway, "worker speaks no protocol version in common");
        self.views_changed();
    }

    /// The uplink ended. A stale connection's late close changes nothing.
    pub(crate) fn disconnected(&self, conn: &WorkerConn) {
        let (label, lease_count) = {
            let mut state = self.state.lock();
            let Some(worker) = state
                .workers
                .get_mut(&conn.worker_id)
                .filter(|w| w.generation == conn.generation)
            else {
                return;
            };
            worker.conn = None;
            let was_connected = worker.view.connection == Connection::Connected;
            worker.view.connection = Connection::Disconnected;
            worker.view.last_seen_at = self.clock.now_ms();
            if !was_connected {
                return;
            }
            let label = worker.view.label.clone();
            let leases = worker.view.leases.as_ref().map_or(0, Vec::len);
            (label, leases)
        };
        self.bus.emit(
            EventModule::Fleet,
            &Event::WorkerDisconnected {
                worker_id: conn.worker_id.clone(),
                label,
                lease_count,
            },
        );
        info!(worker = %conn.worker_id, "worker disconnected");
        self.views_changed();
    }

    /// Folds a refresh into the worker's view and rebuilds its part of the lease index.
    pub(crate) fn refreshed(&self, conn: &WorkerConn, refresh: Refresh) {
        {
            let mut state = self.state.lock();
            let now = self.clock.now_ms();
            let State { workers, index, .. } = &mut *state;
            let Some(worker) = workers
                .get_mut(&conn.worker_id)
                .filter(|w| w.generation == conn.generation)
            else {
                return;
            };
            apply_status(&mut worker.view, &refresh.status, now);
            if let Some(devices) = refresh.devices {
                worker.view.devices = Some(devices);
            }
            if let Some(catalog) = refresh.catalog {
                worker.view.catalog = Some(catalog);
                worker.view.catalog_read_at = Some(now);
            }
            if let Some(limits) = refresh.limits {
                if limits.max_ttl_ms < self.limits.max_ttl_ms {
                    warn!(worker = %conn.worker_id, worker_max = limits.max_ttl_ms, gateway_max = self.limits.max_ttl_ms,
                        "the worker's lease.maxTtlMs is below the gateway's; longer leases will be refused there");
                }
                worker.view.lease = Some(limits);
            }
            index.apply_snapshot(
                &conn.worker_id,
                worker.view.leases.as_deref().unwrap_or_default(),
            );
        }
        self.views_changed();
    }

    /// Relays a worker's event onto the gateway's bus, with its worker id; gateway-only facts
    /// a worker should not send are dropped.
    pub(crate) fn relay_event(
        &self,
        worker_id: &str,
        mut event: EventEnvelope,
    ) -> Option<EventEnvelope> {
        if event.event.starts_with("worker.") {
            return None;
        }
        if let Value::Object(payload) = &mut event.payload {
            payload.insert("workerId".into(), Value::String(worker_id.to_owned()));
        }
        Some(self.bus.relay(event))
    }

    /// A worker says one of its leases ended: drop it from the index and tell its owner.
    pub(crate) fn lease_ended(
        &self,
        worker_id: &str,
        worker_lease_id: &str,
        device_id: &str,
        reason: &str,
    ) {
        let (entry, except) = {
            let mut state = self.state.lock();
            let Some(id) = state
                .index
                .by_worker_lease(worker_id, worker_lease_id)
                .map(|e| e.lease_id.clone())
            else {
                // Its grant may still be on its way (`LeaseIndex::record_grant`).
                state.index.end_unindexed(crate::index::EndedLease {
                    worker_id: worker_id.to_owned(),
                    worker_lease_id: worker_lease_id.to_owned(),
                    device_id: device_id.to_owned(),
                    reason: reason.to_owned(),
                });
                return;
            };
            let except = state.releasing.remove(&id).flatten();
            (state.index.remove(&id), except)
        };
        let Some(entry) = entry else { return };
        self.notify_lease_lost(&entry.lease_id, &entry.owner_id, device_id, reason, except);
        self.views_changed();
    }

    /// Tells `owner_id`'s connections (but `except`) that the gateway lease `lease_id` ended.
    pub(crate) fn notify_lease_lost(
        &self,
        lease_id: &str,
        owner_id: &str,
        device_id: &str,
        reason: &str,
        except: Option<u64>,
    ) {
        let reason = match reason {
            "expired" => simlock_contract::model::LeaseEndReason::Expired,
            "killed" => simlock_contract::model::LeaseEndReason::Killed,
            "device-lost" => simlock_contract::model::LeaseEndReason::DeviceLost,
            _ => simlock_contract::model::LeaseEndReason::Explicit,
        };
        let push = Push::LeaseLost {
            lease_id: lease_id.to_owned(),
            device_id: simlock_contract::ids::DeviceId::from_raw(device_id),
            reason,
        };
        self.presence.notify(owner_id, &push, except);
    }

    /// A worker renewed one of its leases: the record in the view of `conn`'s worker takes the
    /// new deadline in place (and the event's time as `lastRenewedAt`). A renew changes nothing
    /// routing reads (devices, capacity, lease ids, queue depth), so it is worth neither a refresh
    /// of the view nor a dispatch pass (ADR 0015); a changed TTL width shows at the next refresh.
    /// Returns whether the view held that lease (if not, the caller refreshes the view).
    pub(crate) fn lease_renewed(
        &self,
        conn: &WorkerConn,
        worker_lease_id: &str,
        deadline: i64,
        at: i64,
    ) -> bool {
        let updated = {
            let mut state = self.state.lock();
            let record = state
                .workers
                .get_mut(&conn.worker_id)
                .filter(|w| w.generation == conn.generation)
                .and_then(|worker| {
                    worker
                        .view
                        .leases
                        .iter_mut()
                        .flatten()
                        .find(|lease| lease.id.as_str() == worker_lease_id)
                });
            record.is_some_and(|record| {
                record.ttl_deadline = deadline;
                record.last_renewed_at = at;
                true
            })
        };
        if updated {
            self.views_touched();
        }
        updated
    }

    /// Drains or undrains a worker; persisted before answering; idempotent.
    ///
    /// # Errors
    /// `UNKNOWN_WORKER`, or `INTERNAL` on a store failure.
    pub fn set_drained(&self, worker_id: &str, drained: bool) -> Result<bool, ContractError> {
        let changed = {
            let state = self.state.lock();
            let worker = state
                .workers
                .get(worker_id)
                .ok_or_else(|| unknown_worker(worker_id))?;
            worker.view.drained != drained
        };
        if changed {
            let now = self.clock.now_ms();
            self.db
                .with(|c| {
                    if drained {
                        c.execute("INSERT OR REPLACE INTO drained_workers (worker_id, drained_at) VALUES (?1, ?2)", rusqlite::params![worker_id, now])
                    } else {
                        c.execute("DELETE FROM drained_workers WHERE worker_id = ?1", [worker_id])
                    }
                })
                .map_err(|e| store_error(&e))?;
            let mut state = self.state.lock();
            if let Some(worker) = state.workers.get_mut(worker_id) {
                worker.view.drained = drained;
            }
            drop(state);
            let worker_id = worker_id.to_owned();
            let event = if drained {
                Event::WorkerDrainStarted { worker_id }
            } else {
                Event::WorkerDrainEnded { worker_id }
            };
            self.bus.emit(EventModule::Fleet, &event);
            self.views_changed();
        }
        Ok(drained)
    }

    /// Forgets a disconnected worker (and its drain flag).
    ///
    /// # Errors
    /// `WORKER_CONNECTED` while its uplink is up.
    pub fn remove(&self, worker_id: &str) -> Result<bool, ContractError> {
        let removed = {
            let mut state = self.state.lock();
            match state.workers.get(worker_id) {
                None => return Ok(false),
                Some(w) if w.conn.is_some() => {
                    return Err(ContractError::new(ErrorCode::WorkerConnected, format!("Worker {worker_id} is connected; it can be removed once its uplink is down"))
                        .with_details(json!({ "workerId": worker_id })));
                }
                Some(_) => {}
            }
            let removed = state.workers.remove(worker_id);
            state.index.forget_worker(worker_id);
            removed
        };
        let _ = self.db.with(|c| {
            c.execute(
                "DELETE FROM drained_workers WHERE worker_id = ?1",
                [worker_id],
            )
        });
        if let Some(worker) = removed {
            self.bus.emit(
                EventModule::Fleet,
                &Event::WorkerRemoved {
                    worker_id: worker_id.to_owned(),
                    label: worker.view.label,
                    reason: WorkerRemovedReason::Operator,
                },
            );
        }
        self.views_changed();
        Ok(true)
    }

    /// Closes every uplink opened with token `token_id` (it was revoked).
    pub fn close_uplinks_of(&self, token_id: &str) {
        let conns: Vec<_> = self
            .state
            .lock()
            .workers
            .values()
            .filter_map(|w| w.conn.clone())
            .filter(|c| c.token_id == token_id)
            .collect();
        for conn in conns {
            info!(worker = %conn.worker_id, "closing an uplink whose join token was revoked");
            conn.close();
        }
    }

    /// Forgets disconnected workers past retention that hold no live gateway lease.
    fn sweep(&self) {
        let now = self.clock.now_ms();
        let retention =
            i64::try_from(self.timing.disconnected_retention.as_millis()).unwrap_or(i64::MAX);
        let removed: Vec<(String, Option<String>)> = {
            let mut state = self.state.lock();
            let prefix = self.prefix.clone();
            let expired: Vec<String> = state
                .workers
                .iter()
                .filter(|(_, w)| w.conn.is_none() && w.view.connection == Connection::Disconnected)
                .filter(|(_, w)| w.view.last_seen_at <= now.saturating_sub(retention))
                .filter(|(_, w)| {
                    !w.view
                        .leases
                        .as_deref()
                        .unwrap_or_default()
                        .iter()
                        .any(|l| l.requester_id.starts_with(&prefix) && l.ttl_deadline > now)
                })
                .map(|(id, _)| id.clone())
                .collect();
            expired
                .into_iter()
                .filter_map(|id| {
                    let worker = state.workers.remove(&id)?;
                    state.index.forget_worker(&id);
                    if worker.view.drained {
                        // Retention keeps the drain flag: the worker comes back drained.
                        state.workers.insert(
                            id.clone(),
                            Worker {
                                view: WorkerView {
                                    drained: true,
                                    ..blank_view(
                                        &id,
                                        worker.view.label.clone(),
                                        now,
                                        Connection::Disconnected,
                                    )
                                },
                                conn: None,
                                generation: 0,
                            },
                        );
                        return None;
                    }
                    Some((id, worker.view.label))
                })
                .collect()
        };
        let any = !removed.is_empty();
        for (id, label) in removed {
            self.bus.emit(
                EventModule::Fleet,
                &Event::WorkerRemoved {
                    worker_id: id,
                    label,
                    reason: WorkerRemovedReason::Retention,
                },
            );
        }
        if any {
            self.views_changed();
        }
    }
}

/// What one refresh read from a worker.
pub(crate) struct Refresh {
    pub(crate) status: StatusOutput,
    pub(crate) devices: Option<Vec<simlock_contract::model::Device>>,
    pub(crate) catalog: Option<Vec<simlock_contract::model::PlatformCatalog>>,
    pub(crate) limits: Option<LeaseLimits>,
}

pub(crate) fn unknown_worker(worker_id: &str) -> ContractError {
    ContractError::new(
        ErrorCode::UnknownWorker,
        format!("Unknown worker {worker_id}"),
    )
    .with_details(json!({ "workerId": worker_id }))
}

fn blank_view(id: &str, label: Option<String>, now: i64, connection: Connection) -> WorkerView {
    WorkerView {
        id: id.to_owned(),
        label,
        connection,
        drained: false,
        last_seen_at: now,
        health: None,
        version: None,
        protocol: None,
        capacity: None,
        lease: None,
        queue_depth: None,
        leases: None,
        devices: None,
        catalog: None,
        catalog_read_at: None,
        host: None,
        waiting: None,
        capabilities: None,
    }
}

/// The view fields a worker's `status.get` carries.
fn apply_status(view: &mut WorkerView, status: &StatusOutput, now: i64) {
    view.last_seen_at = now;
    view.health = Some(status.daemon.health);
    view.version = Some(status.daemon.version.clone());
    view.host = Some(status.host.clone());
    if status.capacity.is_some() {
        view.capacity = status.capacity;
    }
    if let Some(leases) = &status.leases {
        let mut leases = leases.clone();
        keep_newer_renewals(view.leases.as_deref().unwrap_or_default(), &mut leases);
        view.leases = Some(leases);
    }
    if let Some(devices) = &status.devices {
        view.devices = Some(devices.clone());
    }
    if status.queue_depth.is_some() {
        view.queue_depth = status.queue_depth;
    }
    if let Some(waiting) = &status.waiting {
        view.waiting = Some(waiting.clone());
    }
    if let Some(capabilities) = &status.capabilities {
        view.capabilities = Some(capabilities.clone());
    }
    if status.lease.is_some() {
        view.lease = status.lease;
    }
}

/// A snapshot of leases read before a `lease.renewed` event that the view already took in
/// (ADR 0015): the renewal in `held` is newer than the snapshot's, and stays.
fn keep_newer_renewals(held: &[LeaseRecord], snapshot: &mut [LeaseRecord]) {
    for lease in snapshot {
        let newer = held
            .iter()
            .find(|old| old.id == lease.id && old.last_renewed_at > lease.last_renewed_at);
        if let Some(newer) = newer {
            lease.ttl_deadline = newer.ttl_deadline;
            lease.last_renewed_at = newer.last_renewed_at;
        }
    }
}

fn spawn_sweeper(fleet: &Arc<Fleet>) {
    let weak = Arc::downgrade(fleet);
    let stopping = fleet.stopping.clone();
    let interval = fleet.timing.refresh_interval;
    tokio::spawn(async move {
        loop {
            tokio::select! {
                () = stopping.cancelled() => return,
                () = tokio::time::sleep(interval) => {}
            }
            let Some(fleet) = weak.upgrade() else { return };
            fleet.sweep();
        }
    });
}

#[cfg(test)]
mod tests {
    use simlock_contract::ids::{DeviceId, LeaseId};

    use super::*;

    fn lease(id: &str, renewed_at: i64, deadline: i64) -> LeaseRecord {
        LeaseRecord {
            id: LeaseId::from_raw(id),
            device_id: DeviceId::from_raw("dev_1"),
            requester_id: "gw:g1:agent".into(),
            owner_id: "agent".into(),
            granted_at: 5,
            ttl_ms: 1000,
            ttl_deadline: deadline,
            last_renewed_at: renewed_at,
            id_chosen_by_requester: false,
            worker: None,
            worker_id: None,
        }
    }

    #[test]
    fn a_snapshot_older_than_a_renew_the_view_took_keeps_the_renew() {
        let held = [lease("lse_a", 200, 1200), lease("lse_b", 50, 1050)];
        let mut snapshot = [
            lease("lse_a", 100, 1100),
            lease("lse_b", 300, 1300),
            lease("lse_c", 10, 1010),
        ];
        keep_newer_renewals(&held, &mut snapshot);
        assert_eq!(
            (snapshot[0].last_renewed_at, snapshot[0].ttl_deadline),
            (200, 1200),
            "the renew seen after the snapshot stays"
        );
        assert_eq!(
            (snapshot[1].last_renewed_at, snapshot[1].ttl_deadline),
            (300, 1300),
            "a newer snapshot wins"
        );
        assert_eq!(snapshot[2].ttl_deadline, 1010, "a new lease is taken as is");
    }
}
