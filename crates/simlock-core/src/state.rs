//! The worker's state and every decision about it: devices, leases, the wait queue and the
//! request book. Plain data taking `now_ms`; no tokio, no I/O.
//!
//! Each command mutates the state and records what must follow: rows to store ([`Writes`]),
//! events, lease notices, request updates and device work ([`Effects`]). The async shell
//! ([`crate::worker`]) stores the rows, then carries out the effects, under the same lock, so
//! effects follow the order of the decisions. A command that fails changes nothing.

use std::collections::{BTreeMap, BTreeSet, HashMap};

use crate::config::{HealthConfig, IdleConfig, QuarantineConfig};
use simlock_contract::ContractError;
use simlock_contract::event::{CrashedDevice, Event, EventModule, RejectionReason, WaitPolicy};
use simlock_contract::ids::{DeviceId, LeaseId, RequestId};
use simlock_contract::model::{
    Capacity, Device, DeviceAccess, DeviceSpec, DeviceState, GrantDevice, GrantTiming,
    LeaseEndReason, LeaseGrant, LeaseRecord, Platform, RequestedDevice, WaitStage, WaitingRequest,
};
use simlock_contract::ops::CancelResult;
use simlock_contract::push::{Progress, Push, UnhealthyReason, WaitingFor};

use crate::book::{RecordState, RequestBook, RequestRecord};
use crate::capacity::{Limits, Usage};
use crate::driver::{Adopted, DriverError, Estimates, Keep, Observation, RunState};
use crate::error::{CoreError, Held};
use crate::queue::{LeaseTerms, Pending, Source, Stage, TimedOut, WaitQueue, Waiter};

/// The module of lease and queue events.
const LEASES: EventModule = EventModule::LeaseLifecycle;
/// The module of device events.
const DEVICES: EventModule = EventModule::Devices;
/// Device work attempts a waiting request survives before it fails.
const MAX_WORK_FAILURES: u32 = 3;

/// What the decisions need from configuration.
#[derive(Debug, Clone)]
pub(crate) struct Settings {
    pub default_ttl_ms: u64,
    pub max_ttl_ms: u64,
    pub retention_ms: u64,
    pub max_records: usize,
    /// `lease.maxWaiting`: the most requests the queue holds.
    pub max_waiting: usize,
    pub idle: IdleConfig,
    pub limits: Limits,
    pub estimates: BTreeMap<Platform, Estimates>,
    pub health: HealthConfig,
    pub quarantine: QuarantineConfig,
    /// Platforms whose driver makes real devices (swept at start-up).
    pub real: BTreeSet<Platform>,
}

/// A device whose reclaim failed: when it is tried again, and how often it was.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Quarantine {
    /// Reclaims that failed so far.
    pub attempts: u32,
    /// When the next one starts.
    pub next_retry_at: i64,
}

/// One device in the registry.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct DeviceEntry {
    pub id: DeviceId,
    pub spec: DeviceSpec,
    pub state: DeviceState,
    pub driver_device_id: String,
    pub created_at: i64,
    pub last_lease_ended_at: Option<i64>,
    /// Since when nobody leases it (the idle tiers count from here).
    pub idle_since: i64,
    /// When it was last granted or released (eviction takes the least recent).
    pub last_used_at: i64,
    /// How it is reached, since it last booted.
    pub access: Option<DeviceAccess>,
    /// Set while quarantined.
    pub quarantine: Option<Quarantine>,
    /// Leased and crashed: the recoveries started so far (0: healthy).
    pub recovery_attempts: u32,
    /// The request device work on it is for (not stored).
    pub claim: Option<RequestId>,
    /// A driver call on it is under way (not stored).
    pub busy: bool,
    /// When its reclaim should end (not stored).
    pub reclaim_until: Option<i64>,
    /// Probes in a row that saw it stopped (not stored).
    pub stopped_seen: u32,
    /// When the next recovery of a crashed leased device starts (not stored).
    pub recovery_due: Option<i64>,
    /// Its lease ended while driver work on it ran: reclaim once that work ends (not stored).
    pub reclaim_after_work: bool,
    /// The lease that ended while that work ran, told to the lease-end hooks at the reclaim
    /// (not stored).
    pub ended_during_work: Option<String>,
}

impl DeviceEntry {
    fn view(&self) -> Device {
        Device {
            id: self.id.clone(),
            spec: self.spec.clone(),
            state: self.state,
            driver_device_id: self.driver_device_id.clone(),
            created_at: self.created_at,
            last_lease_ended_at: self.last_lease_ended_at,
            access: self.access.clone(),
            quarantine_attempts: self.quarantine.map(|q| q.attempts),
            quarantine_next_retry_at: self.quarantine.map(|q| q.next_retry_at),
            recovery_attempts: (self.recovery_attempts > 0).then_some(self.recovery_attempts),
            worker_id: None,
            worker: None,
        }
    }

    /// How the device is reached: what its driver said, else its virtual id.
    fn access_or_virtual(&self) -> DeviceAccess {
        self.access
            .clone()
            .unwrap_or_else(|| DeviceAccess::Virtual {
                platform: self.spec.platform,
                driver_device_id: self.driver_device_id.clone(),
            })
    }

    fn free(&self) -> bool {
        self.claim.is_none() && !self.busy
    }
}

/// Who calls, for ownership checks: the daemon's one visibility rule.
pub(crate) use simlock_daemon::context::Viewer as Caller;

/// A lease request, checked and resolved, ready for admission.
#[derive(Debug, Clone)]
pub(crate) struct Admission {
    pub request_id: RequestId,
    pub requester_id: String,
    pub principal: String,
    pub idempotency_key: Option<String>,
    pub fingerprint: String,
    pub spec: DeviceSpec,
    pub requested: RequestedDevice,
    pub terms: LeaseTerms,
    pub no_wait: bool,
    pub timeout_ms: Option<u64>,
}

/// How admission ended.
#[derive(Debug)]
pub(crate) enum Admitted {
    /// An idempotent repeat of a settled request: its recorded outcome.
    Replay(Box<Result<LeaseGrant, ContractError>>),
    /// Follow this request's updates until it settles; an idempotent repeat of an open
    /// request first hears where it stands (the last progress told).
    Follow(RequestId, Option<Progress>),
}

/// What a following caller hears about its request.
#[derive(Debug, Clone)]
pub(crate) enum Update {
    Progress(Progress),
    Done(Box<Result<LeaseGrant, ContractError>>),
}

/// Device work for the shell to run.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Work {
    /// Create, then boot, a device for a request.
    Provision { device: DeviceId, spec: DeviceSpec },
    /// Boot a created device.
    Boot {
        device: DeviceId,
        platform: Platform,
        driver_device_id: String,
    },
    /// Wipe a device after a lease (`ended`, when a lease just ended on it: its modules end
    /// what they hold for it first).
    Reclaim {
        device: DeviceId,
        platform: Platform,
        driver_device_id: String,
        ended: Option<String>,
    },
    /// Boot a crashed leased device again, under its lease.
    Recover {
        device: DeviceId,
        platform: Platform,
        driver_device_id: String,
    },
    /// After a restart: find out whether a device held running still runs.
    Adopt {
        device: DeviceId,
        platform: Platform,
        driver_device_id: String,
    },
    /// After a restart: delete what the driver made that the registry does not know.
    Sweep { platform: Platform, keep: Vec<Keep> },
    /// Stop an idle device.
    Shutdown {
        device: DeviceId,
        platform: Platform,
        driver_device_id: String,
    },
    /// Destroy a device (stopping it first when it runs).
    Delete {
        device: DeviceId,
        platform: Platform,
        driver_device_id: String,
        running: bool,
    },
}

/// An event to emit.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Emitted {
    pub module: EventModule,
    pub event: Event,
}

/// A lease-scoped push for an owner's connections.
#[derive(Debug, Clone)]
pub(crate) struct Notice {
    pub owner: String,
    pub push: Push,
    pub except: Option<u64>,
}

/// What must follow the decisions made since the last take.
#[derive(Debug, Default)]
pub(crate) struct Effects {
    pub events: Vec<Emitted>,
    pub notices: Vec<Notice>,
    pub updates: Vec<(RequestId, Update)>,
    pub work: Vec<Work>,
}

/// Rows to store: `None` deletes.
#[derive(Debug, Default)]
pub(crate) struct Writes {
    pub devices: Vec<(DeviceId, Option<DeviceEntry>)>,
    pub leases: Vec<(String, Option<LeaseRecord>)>,
    pub requests: Vec<(RequestId, Option<RequestRecord>)>,
}

impl Writes {
    pub(crate) fn is_empty(&self) -> bool {
        self.devices.is_empty() && self.leases.is_empty() && self.requests.is_empty()
    }
}

#[derive(Debug, Default)]
struct Dirty {
    devices: BTreeSet<DeviceId>,
    leases: BTreeSet<String>,
    requests: BTreeSet<RequestId>,
}

/// Where a lease's device and its tools are.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct ExecTarget {
    pub lease_id: String,
    pub device_id: DeviceId,
    pub access: DeviceAccess,
}

impl ExecTarget {
    /// The environment tools run with: the same as the grant's (and `simlock env`'s).
    pub(crate) fn environment(&self) -> BTreeMap<String, String> {
        self.access.environment(&self.lease_id, &self.device_id)
    }
}

/// The `ttlMs` cap: above `lease.maxTtlMs` is refused, never clamped. Answers the width.
pub(crate) fn check_ttl(settings: &Settings, ttl_ms: Option<u64>) -> Result<u64, CoreError> {
    let limits = simlock_contract::model::LeaseLimits {
        default_ttl_ms: settings.default_ttl_ms,
        max_ttl_ms: settings.max_ttl_ms,
    };
    limits
        .ttl(ttl_ms)
        .map_err(|e| CoreError::BadRequest(e.to_string()))
}

fn ms(value: u64) -> i64 {
    i64::try_from(value).unwrap_or(i64::MAX)
}

/// The worker's state.
#[derive(Debug)]
pub(crate) struct State {
    settings: Settings,
    devices: BTreeMap<DeviceId, DeviceEntry>,
    leases: BTreeMap<String, LeaseRecord>,
    queue: WaitQueue,
    book: RequestBook,
    dirty: Dirty,
    fx: Effects,
    last_depth: u32,
    /// Platforms whose start-up sweep runs: no device is created on them until it ends (the
    /// sweep deletes what the registry does not know, which a new device would be).
    sweeping: BTreeSet<Platform>,
}

impl State {
    pub(crate) fn new(settings: Settings) -> Self {
        Self {
            settings,
            devices: BTreeMap::new(),
            leases: BTreeMap::new(),
            queue: WaitQueue::default(),
            book: RequestBook::default(),
            dirty: Dirty::default(),
            fx: Effects::default(),
            last_depth: 0,
            sweeping: BTreeSet::new(),
        }
    }

    /// Loads stored rows (before [`Self::converge`]).
    pub(crate) fn restore(
        &mut self,
        devices: Vec<DeviceEntry>,
        leases: Vec<LeaseRecord>,
        requests: Vec<RequestRecord>,
    ) {
        self.devices = devices.into_iter().map(|d| (d.id.clone(), d)).collect();
        self.leases = leases
            .into_iter()
            .map(|l| (l.id.as_str().to_owned(), l))
            .collect();
        for record in requests {
            self.book.insert(record);
        }
    }

    fn estimates(&self, platform: Platform) -> Estimates {
        self.settings
            .estimates
            .get(&platform)
            .copied()
            .unwrap_or_default()
    }

    fn emit(&mut self, module: EventModule, event: Event) {
        self.fx.events.push(Emitted { module, event });
    }

    fn progress(&mut self, id: &RequestId, progress: Progress) {
        if let Some(waiter) = self.queue.get_mut(id) {
            waiter.told = Some(progress);
        }
        self.fx
            .updates
            .push((id.clone(), Update::Progress(progress)));
    }

    fn touch_device(&mut self, id: &DeviceId) {
        self.dirty.devices.insert(id.clone());
    }

    // === Queries ===

    pub(crate) fn usage(&self) -> Usage {
        let ram = self.settings.limits.ram.as_ref();
        let mut usage = Usage::default();
        for d in self.devices.values() {
            if d.state.is_running() {
                let warm = d.state == DeviceState::Ready && d.claim.is_none();
                usage.add_running(d.spec.platform, warm, ram);
            } else if matches!(d.state, DeviceState::Provisioning | DeviceState::Booting) {
                usage.add_reserved(d.spec.platform, ram);
            }
        }
        usage
    }

    pub(crate) fn capacity(&self) -> Capacity {
        self.settings.limits.snapshot(&self.usage())
    }

    pub(crate) fn devices(&self) -> Vec<Device> {
        self.devices
            .values()
            .filter(|d| d.state != DeviceState::Deleted)
            .map(DeviceEntry::view)
            .collect()
    }

    pub(crate) fn leases(&self) -> Vec<LeaseRecord> {
        let mut leases: Vec<LeaseRecord> = self.leases.values().cloned().collect();
        leases.sort_by(|a, b| (a.granted_at, &a.id).cmp(&(b.granted_at, &b.id)));
        leases
    }

    /// The leases `caller` may see, oldest first.
    pub(crate) fn visible_leases(&self, caller: Caller<'_>) -> Vec<LeaseRecord> {
        let mut leases = self.leases();
        leases.retain(|lease| caller.may_see(&lease.owner_id));
        leases
    }

    pub(crate) fn lease(&self, id: &str) -> Option<&LeaseRecord> {
        self.leases.get(id)
    }

    pub(crate) fn queue_depth(&self) -> u32 {
        self.queue.depth()
    }

    /// The requests without a lease yet that `caller` may see, oldest first.
    pub(crate) fn waiting(&self, caller: Caller<'_>) -> Vec<WaitingRequest> {
        self.queue
            .iter()
            .filter(|w| w.stage != Stage::New && caller.may_see(&w.terms.owner_id))
            .map(|w| WaitingRequest {
                id: w.id.clone(),
                requester_id: w.requester_id.clone(),
                spec: w.requested.clone(),
                created_at: w.created_at,
                stage: if w.stage == Stage::Queued {
                    WaitStage::Queued
                } else {
                    WaitStage::Starting
                },
                queue_position: (w.stage == Stage::Queued)
                    .then(|| self.queue.position(&w.id))
                    .flatten(),
                waiting_for: (w.stage == Stage::Queued)
                    .then_some(w.told_waiting)
                    .flatten(),
                worker_id: None,
                worker: None,
            })
            .collect()
    }

    /// `requester`'s pending request, if it has one and the caller may cancel it.
    pub(crate) fn cancellable(
        &self,
        requester: &str,
        caller: Caller<'_>,
    ) -> Result<Option<&Waiter>, CoreError> {
        match self.queue.of_requester(requester) {
            Some(waiter) if !caller.may_see(&waiter.terms.owner_id) => Err(CoreError::Forbidden(
                format!("requesterId: the pending request of {requester} is not yours"),
            )),
            found => Ok(found),
        }
    }

    pub(crate) fn record(&self, id: &RequestId) -> Option<RequestRecord> {
        self.book.get(id).cloned()
    }

    pub(crate) fn records(&self) -> Vec<RequestRecord> {
        self.book.all().cloned().collect()
    }

    /// Where a lease's device is, if the caller may run tools on it: an agent must own the
    /// lease; an admin is held to the lease's requester (`requester`, else its principal).
    pub(crate) fn exec_target(
        &self,
        lease_id: &str,
        caller: Caller<'_>,
        requester: Option<&str>,
        now: i64,
    ) -> Result<ExecTarget, CoreError> {
        let unknown = || CoreError::UnknownLease(lease_id.to_owned());
        // Past its deadline a lease is over, whether or not the tick has ended it yet.
        let lease = self
            .leases
            .get(lease_id)
            .filter(|lease| lease.ttl_deadline > now)
            .ok_or_else(unknown)?;
        let allowed = if caller.admin {
            lease.requester_id == requester.unwrap_or(caller.principal)
        } else {
            lease.owner_id == caller.principal
        };
        if !allowed {
            return Err(unknown());
        }
        let device = self.devices.get(&lease.device_id).ok_or_else(unknown)?;
        Ok(ExecTarget {
            lease_id: lease_id.to_owned(),
            device_id: device.id.clone(),
            access: device.access_or_virtual(),
        })
    }

    /// The next moment [`Self::tick`] has something to do: a lease deadline, an idle tier, a
    /// queue deadline or a settled request passing its retention.
    pub(crate) fn next_deadline(&self) -> Option<i64> {
        let idle = self.settings.idle;
        let (to_shutdown, to_delete) = (ms(idle.shutdown_after_ms), ms(idle.delete_after_ms));
        let leases = self.leases.values().map(|l| l.ttl_deadline);
        let devices = self
            .devices
            .values()
            .filter(|d| d.free())
            .filter_map(|d| match d.state {
                DeviceState::Ready => Some(d.idle_since.saturating_add(to_shutdown.min(to_delete))),
                DeviceState::Shutdown => Some(d.idle_since.saturating_add(to_delete)),
                _ => None,
            });
        let retries = self.devices.values().filter_map(|d| match d.state {
            DeviceState::Quarantined if !d.busy => d.quarantine.map(|q| q.next_retry_at),
            DeviceState::Leased if !d.busy => d.recovery_due,
            _ => None,
        });
        leases
            .chain(devices)
            .chain(retries)
            .chain(self.queue.next_deadline())
            .chain(self.book.next_expiry(self.settings.retention_ms))
            .min()
    }

    // === Taking what must follow ===

    pub(crate) fn take_writes(&mut self) -> Writes {
        let dirty = std::mem::take(&mut self.dirty);
        Writes {
            devices: dirty
                .devices
                .into_iter()
                .map(|id| {
                    let row = self
                        .devices
                        .get(&id)
                        .filter(|d| d.state != DeviceState::Deleted)
                        .cloned();
                    (id, row)
                })
                .collect(),
            leases: dirty
                .leases
                .into_iter()
                .map(|id| {
                    let row = self.leases.get(&id).cloned();
                    (id, row)
                })
                .collect(),
            requests: dirty
                .requests
                .into_iter()
                .map(|id| {
                    let row = self.book.get(&id).cloned();
                    (id, row)
                })
                .collect(),
        }
    }

    pub(crate) fn take_effects(&mut self) -> Effects {
        for (id, position) in self.queue.moved() {
            let waiting_for = self.queue.get(&id).and_then(|w| w.told_waiting);
            self.progress(
                &id,
                Progress::Queued {
                    queue_position: position,
                    waiting_for,
                },
            );
        }
        let depth = self.queue.depth();
        if depth != self.last_depth {
            self.last_depth = depth;
            self.emit(LEASES, Event::QueueChanged { depth });
        }
        std::mem::take(&mut self.fx)
    }

    // === Admission ===

    /// Admits a lease request: an idempotent repeat, the one-lease rule, a chosen lease id,
    /// then recording, one dispatch walk with it as the last candidate, and queueing (or
    /// `NO_CAPACITY` for `noWait`). One serialized decision.
    pub(crate) fn admit(&mut self, a: Admission, now: i64) -> Result<Admitted, CoreError> {
        self.prune(now);
        // A requester whose lease is past its deadline holds none.
        self.expire_due(now);
        if let Some(key) = &a.idempotency_key
            && let Some(record) = self.book.by_key(&a.requester_id, key)
        {
            if record.principal != a.principal {
                return Err(CoreError::IdempotencyForeign {
                    requester_id: a.requester_id.clone(),
                    key: key.clone(),
                });
            }
            if record.fingerprint != a.fingerprint {
                return Err(CoreError::IdempotencyConflict {
                    requester_id: a.requester_id.clone(),
                    key: key.clone(),
                });
            }
            return Ok(match (record.state, &record.grant, &record.failure) {
                (RecordState::Open, _, _) => Admitted::Follow(
                    record.id.clone(),
                    self.queue.get(&record.id).and_then(|w| w.told),
                ),
                (_, Some(grant), _) => Admitted::Replay(Box::new(Ok(grant.clone()))),
                (_, None, Some(failure)) => Admitted::Replay(Box::new(Err(failure.clone()))),
                (_, None, None) => Admitted::Replay(Box::new(Err(CoreError::Internal(format!(
                    "request {} settled without an outcome",
                    record.id
                ))
                .into()))),
            });
        }
        if let Some((reason, error)) = self.refusal(&a) {
            self.rejected(&a.request_id, &a.requester_id, &a.requested, reason);
            return Err(error);
        }

        let id = a.request_id.clone();
        self.book.insert(RequestRecord {
            id: id.clone(),
            requester_id: a.requester_id.clone(),
            owner_id: a.terms.owner_id.clone(),
            principal: a.principal.clone(),
            idempotency_key: a.idempotency_key.clone(),
            fingerprint: a.fingerprint.clone(),
            requested: a.requested.clone(),
            created_at: now,
            state: RecordState::Open,
            settled_at: None,
            grant: None,
            failure: None,
        });
        self.dirty.requests.insert(id.clone());
        self.emit(
            LEASES,
            Event::LeaseRequested {
                request_id: id.clone(),
                request_spec: a.requested.clone(),
                requester: a.requester_id.clone(),
                wait_policy: WaitPolicy::of(a.no_wait),
            },
        );
        let waiters_ahead = self.queue.depth() > 0;
        self.queue.push(Waiter {
            id: id.clone(),
            requester_id: a.requester_id,
            spec: a.spec,
            requested: a.requested,
            terms: a.terms,
            no_wait: a.no_wait,
            timeout_ms: a.timeout_ms,
            deadline: None,
            stage: Stage::New,
            created_at: now,
            failures: 0,
            pending: None,
            told_position: None,
            told_waiting: None,
            told: None,
        });
        if a.no_wait && waiters_ahead {
            // A worker with anyone waiting refuses every noWait request: FIFO stays fair.
            self.fail(
                &id,
                CoreError::NoCapacity { waiters_ahead },
                RejectionReason::NoWait,
                now,
            );
            return Ok(Admitted::Follow(id, None));
        }
        self.dispatch(now);
        if self.queue.get(&id).is_some_and(|w| w.stage == Stage::New) {
            if a.no_wait {
                self.fail(
                    &id,
                    CoreError::NoCapacity { waiters_ahead },
                    RejectionReason::NoWait,
                    now,
                );
            } else if usize::try_from(self.queue.depth()).unwrap_or(usize::MAX)
                >= self.settings.max_waiting
            {
                // Queued ones only: this one is new.
                // Each waiter costs every decision a little: the queue's bound keeps one
                // caller from slowing the worker for everyone.
                self.fail(
                    &id,
                    CoreError::QueueFull {
                        max_waiting: self.settings.max_waiting,
                    },
                    RejectionReason::QueueFull,
                    now,
                );
                // Refused before it got in, as a refusal at admission is: no record, so a
                // repeat with the same key, once there is room, is a new request.
                self.book.forget(&id);
                self.dirty.requests.insert(id.clone());
            } else {
                self.queue_again(&id, now);
            }
        }
        Ok(Admitted::Follow(id, None))
    }

    /// Why a new request may not be admitted (the `lease.rejected` reason and the error): the
    /// one-lease rule (a lease or a pending request of the requester), or a chosen lease id
    /// that is held or promised.
    fn refusal(&self, a: &Admission) -> Option<(RejectionReason, CoreError)> {
        // A lease's or a request's id is told to its owner only.
        let already = |owner: &str, held: Held| CoreError::RequesterAlreadyLeased {
            requester_id: a.requester_id.clone(),
            held: if owner == a.terms.owner_id {
                held
            } else {
                Held::Foreign
            },
        };
        if let Some(lease) = self
            .leases
            .values()
            .find(|l| l.requester_id == a.requester_id)
        {
            let held = Held::Lease(lease.id.as_str().to_owned());
            return Some((
                RejectionReason::AlreadyLeased,
                already(&lease.owner_id, held),
            ));
        }
        if let Some(waiter) = self.queue.of_requester(&a.requester_id) {
            let held = Held::Pending(waiter.id.to_string());
            return Some((
                RejectionReason::AlreadyLeased,
                already(&waiter.terms.owner_id, held),
            ));
        }
        let chosen = a.terms.chosen_id.as_ref()?;
        (self.leases.contains_key(chosen) || self.queue.holds_chosen_id(chosen)).then(|| {
            (
                RejectionReason::LeaseIdTaken,
                CoreError::LeaseIdTaken(chosen.clone()),
            )
        })
    }

    /// Queues a new or failed-processing waiter, telling it where it is.
    fn queue_again(&mut self, id: &RequestId, now: i64) {
        match self.queue.enqueue(id, now) {
            Some(Ok(position)) => {
                // A request queued again after failed device work may be served by the next
                // walk: it is told why it waits only when no device can be had now.
                let waiting_for = self
                    .queue
                    .get(id)
                    .map(|w| w.spec.clone())
                    .filter(|spec| self.plan(spec, true).is_none())
                    .and_then(|spec| self.waiting_for(&spec));
                if let Some(waiter) = self.queue.get_mut(id) {
                    waiter.told_waiting = waiting_for;
                }
                self.progress(
                    id,
                    Progress::Queued {
                        queue_position: position,
                        waiting_for,
                    },
                );
                self.emit(
                    LEASES,
                    Event::LeaseQueued {
                        request_id: id.clone(),
                        queue_position: position,
                    },
                );
            }
            Some(Err(TimedOut)) => self.time_out(id, now),
            None => {}
        }
    }

    fn rejected(
        &mut self,
        id: &RequestId,
        requester: &str,
        spec: &RequestedDevice,
        reason: RejectionReason,
    ) {
        self.emit(
            LEASES,
            Event::LeaseRejected {
                request_id: Some(id.clone()),
                requester: requester.to_owned(),
                request_spec: spec.clone(),
                reason,
                worker_id: None,
            },
        );
    }

    /// Settles a request's record and tells its followers.
    fn settle(
        &mut self,
        id: &RequestId,
        outcome: Result<LeaseGrant, ContractError>,
        state: RecordState,
        now: i64,
    ) {
        if self.book.settle(id, &outcome, state, now) {
            self.dirty.requests.insert(id.clone());
        }
        self.fx
            .updates
            .push((id.clone(), Update::Done(Box::new(outcome))));
    }

    /// Ends a request without a lease.
    fn fail(&mut self, id: &RequestId, error: CoreError, reason: RejectionReason, now: i64) {
        let state = if matches!(error, CoreError::Cancelled(_)) {
            RecordState::Cancelled
        } else {
            RecordState::Failed
        };
        self.queue.remove(id);
        self.settle(id, Err(ContractError::from(error)), state, now);
        if let Some(record) = self.book.get(id) {
            let (requester, spec) = (record.requester_id.clone(), record.requested.clone());
            self.rejected(id, &requester, &spec, reason);
        }
    }

    fn time_out(&mut self, id: &RequestId, now: i64) {
        let timeout_ms = self
            .queue
            .get(id)
            .and_then(|w| w.timeout_ms)
            .unwrap_or_default();
        let error = CoreError::QueueTimeout {
            request_id: id.clone(),
            timeout_ms,
        };
        self.fail(id, error, RejectionReason::Timeout, now);
    }

    // === Acquisition ===

    /// One walk over the waiters, oldest first: each gets a device if one can be had now.
    /// A waiter may wait on a reclaiming device only when no older waiter was passed over.
    fn dispatch(&mut self, now: i64) {
        let mut passed_over = false;
        for id in self.queue.pickable() {
            let Some(waiter) = self.queue.get(&id) else {
                continue;
            };
            let (spec, no_wait) = (waiter.spec.clone(), waiter.no_wait);
            match self.plan(&spec, !passed_over && !no_wait) {
                Some(plan) => match self.queue.mark_processing(&id, now) {
                    Some(Ok(())) => self.start(&id, plan, now),
                    Some(Err(TimedOut)) => self.time_out(&id, now),
                    None => {}
                },
                None => {
                    passed_over = true;
                    self.tell_why_waiting(&id, &spec);
                }
            }
        }
    }

    /// Tells a queued waiter that gets no device why, when that changed since it was told.
    fn tell_why_waiting(&mut self, id: &RequestId, spec: &DeviceSpec) {
        // Only a waiter told its place is told why (a new one is told both on queueing).
        let Some(queue_position) = self
            .queue
            .get(id)
            .filter(|w| w.stage == Stage::Queued)
            .and_then(|w| w.told_position)
        else {
            return;
        };
        let waiting_for = self.waiting_for(spec);
        let Some(waiter) = self.queue.get_mut(id) else {
            return;
        };
        if waiter.told_waiting == waiting_for {
            return;
        }
        waiter.told_waiting = waiting_for;
        self.progress(
            id,
            Progress::Queued {
                queue_position,
                waiting_for,
            },
        );
    }

    /// Why no device of `spec` can be had now ([`Self::plan`] found none): quarantined devices
    /// hold the room one needs (without them it would fit: those of its platform first, else
    /// any, for the worker's own cap), with the earliest retry among those, or the capacity is
    /// full with devices in use. `None` while the platform's devices are being swept (a moment).
    fn waiting_for(&self, spec: &DeviceSpec) -> Option<WaitingFor> {
        if self.sweeping.contains(&spec.platform) {
            return None;
        }
        let ram = self.settings.limits.ram.as_ref();
        let quarantined = |only: Option<Platform>| {
            self.devices.values().filter(move |d| {
                d.state == DeviceState::Quarantined && only.is_none_or(|p| d.spec.platform == p)
            })
        };
        let usage = self.usage();
        for only in [Some(spec.platform), None] {
            let mut without = usage;
            for d in quarantined(only) {
                without = without.without_running(d.spec.platform, false, ram);
            }
            let retry_at = quarantined(only)
                .filter_map(|d| d.quarantine.map(|q| q.next_retry_at))
                .min();
            if let Some(retry_at) = retry_at
                && self.settings.limits.fits(&without, spec.platform)
            {
                return Some(WaitingFor::Quarantine { retry_at });
            }
        }
        Some(WaitingFor::Capacity)
    }

    /// Where a device of `spec` can come from now: a ready one, one being reclaimed, a
    /// shutdown one to boot, or a new one, making room by evicting the least recently used
    /// idle device of another spec when capacity is full.
    fn plan(&self, spec: &DeviceSpec, may_wait_for_reclaim: bool) -> Option<Plan> {
        let of_spec = |d: &&DeviceEntry| &d.spec == spec;
        let ready = self
            .devices
            .values()
            .filter(of_spec)
            .filter(|d| d.state == DeviceState::Ready && d.free())
            .max_by_key(|d| (d.last_used_at, d.id.clone()));
        if let Some(device) = ready {
            return Some(Plan::Warm(device.id.clone()));
        }
        if may_wait_for_reclaim
            && let Some(device) = self
                .devices
                .values()
                .filter(of_spec)
                .filter(|d| d.state == DeviceState::Reclaiming && d.claim.is_none())
                .min_by_key(|d| (d.reclaim_until, d.id.clone()))
        {
            return Some(Plan::AfterReclaim(device.id.clone()));
        }
        let usage = self.usage();
        let room = self.settings.limits.fits(&usage, spec.platform);
        let evict = || (!room).then(|| self.eviction(&usage, spec)).flatten();
        let shutdown = self
            .devices
            .values()
            .filter(of_spec)
            .filter(|d| d.state == DeviceState::Shutdown && d.free())
            .max_by_key(|d| (d.last_used_at, d.id.clone()));
        if let Some(device) = shutdown {
            if room {
                return Some(Plan::Boot {
                    device: device.id.clone(),
                    evict: None,
                });
            }
            if let Some(victim) = evict() {
                return Some(Plan::Boot {
                    device: device.id.clone(),
                    evict: Some(victim),
                });
            }
            return None;
        }
        if self.sweeping.contains(&spec.platform) {
            return None;
        }
        if room {
            return Some(Plan::Provision { evict: None });
        }
        evict().map(|victim| Plan::Provision {
            evict: Some(victim),
        })
    }

    /// The least recently used idle running device of another spec whose shutdown makes
    /// room for a device of `spec`.
    fn eviction(&self, usage: &Usage, spec: &DeviceSpec) -> Option<DeviceId> {
        let limits = &self.settings.limits;
        let mut idle: Vec<&DeviceEntry> = self
            .devices
            .values()
            .filter(|d| d.state == DeviceState::Ready && d.free() && &d.spec != spec)
            .collect();
        idle.sort_by_key(|d| (d.last_used_at, d.id.clone()));
        idle.into_iter()
            .find(|d| {
                let after = usage.without_running(d.spec.platform, true, limits.ram.as_ref());
                limits.fits(&after, spec.platform)
            })
            .map(|d| d.id.clone())
    }

    fn set_pending(&mut self, id: &RequestId, pending: Pending) {
        if let Some(waiter) = self.queue.get_mut(id) {
            waiter.pending = Some(pending);
        }
    }

    fn start(&mut self, id: &RequestId, plan: Plan, now: i64) {
        match plan {
            Plan::Warm(device) => self.grant(id, &device, Source::Warm, now),
            Plan::AfterReclaim(device) => {
                let Some(entry) = self.devices.get_mut(&device) else {
                    return;
                };
                entry.claim = Some(id.clone());
                let eta = u64::try_from(entry.reclaim_until.unwrap_or(now).saturating_sub(now))
                    .unwrap_or(0);
                self.set_pending(
                    id,
                    Pending {
                        source: Source::Warm,
                        eta_ms: eta,
                    },
                );
                self.progress(id, Progress::Reclaiming { eta_ms: eta });
            }
            Plan::Boot { device, evict } => {
                if let Some(victim) = evict {
                    self.evict(&victim);
                }
                let Some(entry) = self.devices.get_mut(&device) else {
                    return;
                };
                entry.state = DeviceState::Booting;
                entry.claim = Some(id.clone());
                entry.busy = true;
                let (platform, driver_device_id) =
                    (entry.spec.platform, entry.driver_device_id.clone());
                self.touch_device(&device);
                let eta = self.estimates(platform).boot_ms;
                self.set_pending(
                    id,
                    Pending {
                        source: Source::Booted,
                        eta_ms: eta,
                    },
                );
                self.progress(id, Progress::Booting { eta_ms: eta });
                self.fx.work.push(Work::Boot {
                    device,
                    platform,
                    driver_device_id,
                });
            }
            Plan::Provision { evict } => {
                if let Some(victim) = evict {
                    self.evict(&victim);
                }
                let Some(spec) = self.queue.get(id).map(|w| w.spec.clone()) else {
                    return;
                };
                let device = DeviceId::mint();
                self.devices.insert(
                    device.clone(),
                    DeviceEntry {
                        id: device.clone(),
                        spec: spec.clone(),
                        state: DeviceState::Provisioning,
                        driver_device_id: String::new(),
                        created_at: now,
                        last_lease_ended_at: None,
                        idle_since: now,
                        last_used_at: now,
                        access: None,
                        quarantine: None,
                        recovery_attempts: 0,
                        claim: Some(id.clone()),
                        busy: true,
                        reclaim_until: None,
                        stopped_seen: 0,
                        recovery_due: None,
                        reclaim_after_work: false,
                        ended_during_work: None,
                    },
                );
                self.touch_device(&device);
                let est = self.estimates(spec.platform);
                self.set_pending(
                    id,
                    Pending {
                        source: Source::Provisioned,
                        eta_ms: est.provision_ms.saturating_add(est.boot_ms),
                    },
                );
                self.progress(
                    id,
                    Progress::Provisioning {
                        eta_ms: est.provision_ms,
                    },
                );
                self.fx.work.push(Work::Provision { device, spec });
            }
        }
    }

    /// Shuts an idle running device down to make room.
    fn evict(&mut self, device: &DeviceId) {
        let Some(entry) = self.devices.get_mut(device) else {
            return;
        };
        entry.state = DeviceState::Shutdown;
        entry.busy = true;
        let work = Work::Shutdown {
            device: device.clone(),
            platform: entry.spec.platform,
            driver_device_id: entry.driver_device_id.clone(),
        };
        self.touch_device(device);
        self.fx.work.push(work);
    }

    /// Grants `device` to request `id`.
    fn grant(&mut self, id: &RequestId, device_id: &DeviceId, source: Source, now: i64) {
        let Some(waiter) = self.queue.remove(id) else {
            return;
        };
        let Some(device) = self.devices.get_mut(device_id) else {
            let error = CoreError::Internal(format!("device {device_id} vanished"));
            self.settle(id, Err(error.into()), RecordState::Failed, now);
            return;
        };
        device.state = DeviceState::Leased;
        device.claim = None;
        device.busy = false;
        device.reclaim_until = None;
        device.last_used_at = now;
        let device = device.clone();
        self.touch_device(device_id);

        let chosen = waiter.terms.chosen_id.is_some();
        let lease_id = waiter
            .terms
            .chosen_id
            .clone()
            .unwrap_or_else(|| LeaseId::mint().into_string());
        let lease = LeaseRecord {
            id: LeaseId::from_raw(lease_id.clone()),
            device_id: device.id.clone(),
            requester_id: waiter.requester_id.clone(),
            owner_id: waiter.terms.owner_id.clone(),
            granted_at: now,
            ttl_ms: waiter.terms.ttl_ms,
            ttl_deadline: now.saturating_add(ms(waiter.terms.ttl_ms)),
            last_renewed_at: now,
            id_chosen_by_requester: chosen,
            access: Some(device.access_or_virtual()),
            worker: None,
            worker_id: None,
        };
        self.leases.insert(lease_id.clone(), lease.clone());
        self.dirty.leases.insert(lease_id.clone());
        let est = self.estimates(device.spec.platform);
        let access = device.access_or_virtual();
        let address = match &access {
            DeviceAccess::AndroidEmulator { serial, .. } => Some(serial.clone()),
            _ => None,
        };
        let grant = LeaseGrant {
            device: GrantDevice {
                id: device.id.clone(),
                driver_device_id: device.driver_device_id.clone(),
                spec: device.spec.clone(),
                address,
                access: Some(access.clone()),
            },
            environment: access.environment(&lease_id, &device.id),
            lease,
            timing: GrantTiming {
                estimated_provision_ms: est.provision_ms,
                estimated_boot_ms: est.boot_ms,
                estimated_reclaim_ms: est.reclaim_ms,
                estimated_ready_ms: waiter.pending.map_or(0, |p| p.eta_ms),
            },
        };
        self.settle(id, Ok(grant), RecordState::Granted, now);
        self.emit(
            LEASES,
            Event::LeaseGranted {
                lease_id: lease_id.clone(),
                device_id: device.id.clone(),
                requester: waiter.requester_id.clone(),
                owner_id: waiter.terms.owner_id.clone(),
                request_id: id.clone(),
                source: source.event(),
            },
        );
    }

    /// Device work for a waiter failed: it waits again (deadline unchanged) or, past the
    /// limit or for `noWait`, fails.
    fn work_failed(&mut self, id: &RequestId, why: &str, now: i64) {
        let Some(waiter) = self.queue.get_mut(id) else {
            return;
        };
        waiter.failures += 1;
        waiter.pending = None;
        if waiter.no_wait || waiter.failures >= MAX_WORK_FAILURES {
            self.fail(
                id,
                CoreError::DeviceWork(why.to_owned()),
                RejectionReason::WorkerFailed,
                now,
            );
        } else {
            self.queue_again(id, now);
        }
    }

    // === Work results ===

    /// A device was created (answers its driver id when boot should follow).
    pub(crate) fn provisioned(
        &mut self,
        device: &DeviceId,
        result: Result<String, DriverError>,
        now: i64,
    ) -> Option<String> {
        let outcome = match result {
            Ok(driver_device_id) => {
                let entry = self.devices.get_mut(device)?;
                entry.driver_device_id.clone_from(&driver_device_id);
                entry.state = DeviceState::Booting;
                let (claim, spec) = (entry.claim.clone(), entry.spec.clone());
                self.touch_device(device);
                self.emit(
                    DEVICES,
                    Event::DeviceProvisioned {
                        device_id: device.clone(),
                        spec: spec.clone(),
                        driver_device_id: driver_device_id.clone(),
                    },
                );
                if let Some(claim) = claim {
                    let eta = self.estimates(spec.platform).boot_ms;
                    self.progress(&claim, Progress::Booting { eta_ms: eta });
                }
                Some(driver_device_id)
            }
            Err(e) => {
                if let Some(entry) = self.devices.remove(device) {
                    self.touch_device(device);
                    if let Some(claim) = entry.claim {
                        self.work_failed(&claim, &e.to_string(), now);
                    }
                }
                None
            }
        };
        self.dispatch(now);
        outcome
    }

    /// A device finished booting.
    pub(crate) fn booted(
        &mut self,
        device: &DeviceId,
        result: Result<DeviceAccess, DriverError>,
        now: i64,
    ) {
        let Some(entry) = self.devices.get_mut(device) else {
            return;
        };
        let claim = entry.claim.take();
        match result {
            Ok(access) => {
                entry.access = Some(access);
                let claim = claim.map(|claim| {
                    let source = self
                        .queue
                        .get(&claim)
                        .and_then(|w| w.pending.as_ref())
                        .map_or(Source::Booted, |p| p.source);
                    (claim, source)
                });
                self.ready(
                    device,
                    |device_id, spec| Event::DeviceReady { device_id, spec },
                    claim,
                    now,
                );
            }
            Err(e) => {
                entry.busy = false;
                entry.state = DeviceState::Shutdown;
                self.touch_device(device);
                if let Some(claim) = claim {
                    self.work_failed(&claim, &e.to_string(), now);
                }
            }
        }
        self.dispatch(now);
    }

    /// A device finished its reclaim.
    pub(crate) fn reclaimed(
        &mut self,
        device: &DeviceId,
        result: Result<DeviceAccess, DriverError>,
        now: i64,
    ) {
        let Some(entry) = self.devices.get_mut(device) else {
            return;
        };
        let claim = entry.claim.take();
        entry.reclaim_until = None;
        match result {
            Ok(access) => {
                entry.access = Some(access);
                if let Some(q) = entry.quarantine.take() {
                    self.emit(
                        DEVICES,
                        Event::DeviceQuarantineRecovered {
                            device_id: device.clone(),
                            attempts: q.attempts,
                        },
                    );
                }
                let claim = claim.map(|claim| (claim, Source::Warm));
                self.ready(
                    device,
                    |device_id, spec| Event::DeviceReclaimed { device_id, spec },
                    claim,
                    now,
                );
            }
            Err(e) => {
                // A device that could not be wiped is never handed out: it is quarantined and
                // retried with backoff, then deleted.
                self.quarantine(device, &e.to_string(), now);
                if let Some(claim) = claim {
                    self.work_failed(&claim, &e.to_string(), now);
                }
            }
        }
        self.dispatch(now);
    }

    /// A reclaim of `device` failed: quarantine it (or, past `quarantine.maxRetries`, delete it).
    fn quarantine(&mut self, device: &DeviceId, why: &str, now: i64) {
        let q = self.settings.quarantine;
        let Some(entry) = self.devices.get_mut(device) else {
            return;
        };
        let attempts = entry.quarantine.map_or(1, |q| q.attempts.saturating_add(1));
        // `attempts` reclaims failed: the first, then `attempts − 1` retries.
        if attempts > q.max_retries {
            entry.quarantine = None;
            self.emit(
                DEVICES,
                Event::DeviceQuarantineAbandoned {
                    device_id: device.clone(),
                    attempts,
                    error: why.to_owned(),
                },
            );
            self.delete_device(device);
            return;
        }
        let backoff = quarantine_backoff(&q, attempts);
        let next_retry_at = now.saturating_add(ms(backoff));
        entry.state = DeviceState::Quarantined;
        entry.busy = false;
        entry.quarantine = Some(Quarantine {
            attempts,
            next_retry_at,
        });
        self.touch_device(device);
        self.emit(
            DEVICES,
            Event::DeviceQuarantined {
                device_id: device.clone(),
                attempts,
                next_retry_at,
                error: why.to_owned(),
            },
        );
    }

    /// A crashed leased device was booted again (or not).
    pub(crate) fn recovered(
        &mut self,
        device: &DeviceId,
        result: Result<DeviceAccess, DriverError>,
        now: i64,
    ) {
        if self.reclaim_if_released(device, now) {
            return;
        }
        let health = self.settings.health;
        let lease = self.lease_of(device);
        let Some(entry) = self.devices.get_mut(device) else {
            return;
        };
        entry.busy = false;
        let attempts = entry.recovery_attempts;
        match result {
            Ok(access) => {
                entry.access = Some(access.clone());
                entry.recovery_attempts = 0;
                entry.recovery_due = None;
                entry.stopped_seen = 0;
                self.touch_device(device);
                let Some((lease_id, owner)) = lease else {
                    return;
                };
                if let Some(record) = self.leases.get_mut(&lease_id) {
                    record.access = Some(access);
                    self.dirty.leases.insert(lease_id.clone());
                }
                self.emit(
                    DEVICES,
                    Event::DeviceRecovered {
                        device_id: device.clone(),
                        lease_id: lease_id.clone(),
                        attempts,
                    },
                );
                self.fx.notices.push(Notice {
                    owner,
                    push: Push::DeviceRecovered {
                        lease_id,
                        device_id: device.clone(),
                        attempts,
                    },
                    except: None,
                });
            }
            Err(e) if attempts < health.max_recovery_attempts => {
                let backoff = health
                    .recovery_backoff_ms
                    .saturating_mul(1u64 << attempts.saturating_sub(1).min(16));
                entry.recovery_due = Some(now.saturating_add(ms(backoff)));
                self.touch_device(device);
                self.emit(
                    DEVICES,
                    Event::DeviceRecoveryAttemptFailed {
                        device_id: device.clone(),
                        lease_id: lease.map(|(id, _)| id),
                        attempts,
                        error: e.to_string(),
                    },
                );
            }
            Err(e) => {
                entry.recovery_attempts = 0;
                entry.recovery_due = None;
                self.emit(
                    DEVICES,
                    Event::DeviceRecoveryFailed {
                        device_id: device.clone(),
                        lease_id: lease.as_ref().map(|(id, _)| id.clone()),
                        attempts,
                        error: e.to_string(),
                    },
                );
                // The device is not trusted again: it goes, and so does its lease.
                self.delete_device(device);
                if let Some((lease_id, _)) = lease {
                    self.end_lease(&lease_id, LeaseEndReason::DeviceLost, None, now);
                }
            }
        }
        self.dispatch(now);
    }

    /// After a restart, the driver said whether a device held running still runs.
    pub(crate) fn adopted(
        &mut self,
        device: &DeviceId,
        result: Result<Adopted, DriverError>,
        now: i64,
    ) {
        if self.reclaim_if_released(device, now) {
            return;
        }
        let Some(entry) = self.devices.get_mut(device) else {
            return;
        };
        entry.busy = false;
        match result {
            Ok(Adopted::Running(access)) => {
                if entry.access.as_ref() != Some(&access) {
                    entry.access = Some(access);
                    self.touch_device(device);
                }
            }
            // A failed look is no conclusion: the health probes decide later.
            Err(_) => {}
            Ok(Adopted::Stopped) => match entry.state {
                DeviceState::Leased => self.crashed(device, now),
                DeviceState::Ready if entry.claim.is_none() => {
                    entry.state = DeviceState::Shutdown;
                    let spec = entry.spec.clone();
                    self.touch_device(device);
                    self.emit(
                        DEVICES,
                        Event::DeviceShutdown {
                            device_id: device.clone(),
                            spec,
                        },
                    );
                }
                _ => {}
            },
        }
        self.dispatch(now);
    }

    /// After a restart, the driver deleted what the registry did not know.
    pub(crate) fn swept(
        &mut self,
        platform: Platform,
        result: Result<Vec<String>, DriverError>,
        now: i64,
    ) {
        self.sweeping.remove(&platform);
        match result {
            Ok(purged) => {
                let count = purged.len();
                for driver_device_id in purged {
                    self.emit(
                        DEVICES,
                        Event::DeviceOrphanPurged {
                            platform,
                            driver_device_id,
                        },
                    );
                }
                self.emit(
                    DEVICES,
                    Event::DriverSwept {
                        platform,
                        purged: count,
                    },
                );
            }
            Err(e) => self.emit(
                DEVICES,
                Event::DeviceSweepFailed {
                    platform,
                    error: e.to_string(),
                },
            ),
        }
        // Requests that waited for the sweep may get a new device now.
        self.dispatch(now);
    }

    /// What a health probe of `platform` saw. A leased device seen stopped by
    /// `health.stableObservations` probes in a row crashed: its holder is told and it is booted
    /// again under the lease. A free ready device seen stopped as often is marked shut down.
    pub(crate) fn observe(&mut self, platform: Platform, seen: &[Observation], now: i64) {
        let stable = self.settings.health.stable_observations.max(1);
        let states: HashMap<&str, RunState> = seen
            .iter()
            .map(|o| (o.driver_device_id.as_str(), o.state))
            .collect();
        let mut crashed = Vec::new();
        let mut stopped = Vec::new();
        for entry in self.devices.values_mut() {
            let watched = matches!(entry.state, DeviceState::Leased | DeviceState::Ready);
            if entry.spec.platform != platform
                || !watched
                || entry.busy
                || entry.claim.is_some()
                || entry.recovery_attempts > 0
            {
                continue;
            }
            // A device its driver no longer lists is as stopped as one it lists stopped.
            let state = states
                .get(entry.driver_device_id.as_str())
                .copied()
                .unwrap_or(RunState::Stopped);
            match state {
                RunState::Running => entry.stopped_seen = 0,
                RunState::Transitioning => {}
                RunState::Stopped => {
                    entry.stopped_seen = entry.stopped_seen.saturating_add(1);
                    if entry.stopped_seen >= stable {
                        entry.stopped_seen = 0;
                        if entry.state == DeviceState::Leased {
                            crashed.push(entry.id.clone());
                        } else {
                            stopped.push(entry.id.clone());
                        }
                    }
                }
            }
        }
        for id in crashed {
            self.crashed(&id, now);
        }
        for id in stopped {
            if let Some(entry) = self.devices.get_mut(&id) {
                entry.state = DeviceState::Shutdown;
                let spec = entry.spec.clone();
                self.touch_device(&id);
                self.emit(
                    DEVICES,
                    Event::DeviceCrashDetected {
                        device_id: id.clone(),
                        seen: CrashedDevice::Free { spec },
                        reason: UnhealthyReason::Crashed,
                    },
                );
            }
        }
        self.dispatch(now);
    }

    /// A leased device stopped: its holder hears `device-unhealthy` and its first recovery
    /// starts.
    fn crashed(&mut self, device: &DeviceId, _now: i64) {
        let lease = self.lease_of(device);
        let Some(entry) = self.devices.get_mut(device) else {
            return;
        };
        entry.recovery_attempts = 0;
        let platform = entry.spec.platform;
        self.emit(
            DEVICES,
            Event::DeviceCrashDetected {
                device_id: device.clone(),
                seen: CrashedDevice::Leased {
                    lease_id: lease.as_ref().map(|(id, _)| id.clone()),
                },
                reason: UnhealthyReason::Crashed,
            },
        );
        if let Some((lease_id, owner)) = lease {
            self.fx.notices.push(Notice {
                owner,
                push: Push::DeviceUnhealthy {
                    lease_id,
                    device_id: device.clone(),
                    reason: UnhealthyReason::Crashed,
                },
                except: None,
            });
        }
        self.start_recovery(device, platform);
    }

    /// Starts the next boot of a crashed leased device.
    fn start_recovery(&mut self, device: &DeviceId, platform: Platform) {
        let Some(entry) = self.devices.get_mut(device) else {
            return;
        };
        entry.recovery_attempts = entry.recovery_attempts.saturating_add(1);
        entry.recovery_due = None;
        entry.busy = true;
        let work = Work::Recover {
            device: device.clone(),
            platform,
            driver_device_id: entry.driver_device_id.clone(),
        };
        self.touch_device(device);
        self.fx.work.push(work);
    }

    /// The lease on `device` and its owner, if it is leased.
    fn lease_of(&self, device: &DeviceId) -> Option<(String, String)> {
        self.leases
            .values()
            .find(|l| &l.device_id == device)
            .map(|l| (l.id.as_str().to_owned(), l.owner_id.clone()))
    }

    /// When the lease of `device` ended while driver work on it ran, that work's result no
    /// longer matters: the device is reclaimed now. Answers whether it was.
    fn reclaim_if_released(&mut self, device: &DeviceId, now: i64) -> bool {
        let Some(entry) = self.devices.get_mut(device) else {
            return false;
        };
        if !entry.reclaim_after_work {
            return false;
        }
        entry.reclaim_after_work = false;
        entry.busy = false;
        let ended = entry.ended_during_work.take();
        self.reclaim(device, ended.as_deref(), now);
        self.dispatch(now);
        true
    }

    /// Device work left `device` running and free: it is announced with `event`, then granted
    /// to the request that claimed it, if any.
    fn ready(
        &mut self,
        device: &DeviceId,
        event: fn(DeviceId, DeviceSpec) -> Event,
        claim: Option<(RequestId, Source)>,
        now: i64,
    ) {
        let Some(entry) = self.devices.get_mut(device) else {
            return;
        };
        entry.busy = false;
        entry.state = DeviceState::Ready;
        entry.idle_since = now;
        let spec = entry.spec.clone();
        self.touch_device(device);
        self.emit(DEVICES, event(device.clone(), spec));
        if let Some((claim, source)) = claim {
            self.grant(&claim, device, source, now);
        }
    }

    /// A device finished shutting down.
    pub(crate) fn shut_down(
        &mut self,
        device: &DeviceId,
        result: Result<(), DriverError>,
        now: i64,
    ) {
        let Some(entry) = self.devices.get_mut(device) else {
            return;
        };
        entry.busy = false;
        let spec = entry.spec.clone();
        if result.is_ok() {
            self.emit(
                DEVICES,
                Event::DeviceShutdown {
                    device_id: device.clone(),
                    spec,
                },
            );
        }
        self.dispatch(now);
    }

    /// A device was destroyed.
    pub(crate) fn deleted(&mut self, device: &DeviceId, now: i64) {
        if let Some(entry) = self.devices.remove(device) {
            self.touch_device(device);
            self.emit(
                DEVICES,
                Event::DeviceDeleted {
                    device_id: device.clone(),
                    spec: entry.spec,
                },
            );
        }
        self.dispatch(now);
    }

    // === Leases ===

    /// The lease, if the caller may see it (an unknown lease otherwise).
    fn visible(
        &mut self,
        lease_id: &str,
        caller: Caller<'_>,
    ) -> Result<&mut LeaseRecord, CoreError> {
        self.leases
            .get_mut(lease_id)
            .filter(|lease| caller.may_see(&lease.owner_id))
            .ok_or_else(|| CoreError::UnknownLease(lease_id.to_owned()))
    }

    /// Renews a lease: `ttlMs` absent keeps the recorded width; present sets a new one.
    pub(crate) fn renew(
        &mut self,
        lease_id: &str,
        ttl_ms: Option<u64>,
        caller: Caller<'_>,
        now: i64,
    ) -> Result<LeaseRecord, CoreError> {
        if ttl_ms.is_some() {
            check_ttl(&self.settings, ttl_ms)?;
        }
        self.expire_due(now);
        let lease = self.visible(lease_id, caller)?;
        let width = ttl_ms.unwrap_or(lease.ttl_ms);
        lease.ttl_ms = width;
        lease.ttl_deadline = now.saturating_add(ms(width));
        lease.last_renewed_at = now;
        let lease = lease.clone();
        self.dirty.leases.insert(lease_id.to_owned());
        self.emit(
            LEASES,
            Event::LeaseRenewed {
                lease_id: lease_id.to_owned(),
                new_deadline: lease.ttl_deadline,
                ttl_ms: Some(lease.ttl_ms),
            },
        );
        Ok(lease)
    }

    /// Releases a lease the caller owns (admins: any) for `reason`. `except` is the releasing
    /// connection, which gets no `lease-lost` for it.
    pub(crate) fn release(
        &mut self,
        lease_id: &str,
        reason: LeaseEndReason,
        caller: Caller<'_>,
        except: Option<u64>,
        now: i64,
    ) -> Result<LeaseRecord, CoreError> {
        self.expire_due(now);
        self.visible(lease_id, caller)?;
        self.end_lease(lease_id, reason, except, now)
            .ok_or_else(|| CoreError::UnknownLease(lease_id.to_owned()))
    }

    /// Releases every lease (reason `killed`).
    pub(crate) fn release_all(&mut self, except: Option<u64>, now: i64) -> Vec<String> {
        let ids: Vec<String> = self
            .leases()
            .into_iter()
            .map(|l| l.id.into_string())
            .collect();
        for id in &ids {
            self.end_lease(id, LeaseEndReason::Killed, except, now);
        }
        ids
    }

    /// Ends a lease: gone, device reclaiming, event, `lease-lost` to the owner.
    fn end_lease(
        &mut self,
        lease_id: &str,
        reason: LeaseEndReason,
        except: Option<u64>,
        now: i64,
    ) -> Option<LeaseRecord> {
        let lease = self.leases.remove(lease_id)?;
        self.dirty.leases.insert(lease_id.to_owned());
        if let Some(device) = self.devices.get_mut(&lease.device_id)
            && device.state == DeviceState::Leased
        {
            device.last_lease_ended_at = Some(now);
            device.last_used_at = now;
            device.idle_since = now;
            device.recovery_attempts = 0;
            device.recovery_due = None;
            device.stopped_seen = 0;
            if device.busy {
                // A recovery or a restart's look at it runs: reclaim once it ends.
                device.state = DeviceState::Reclaiming;
                device.reclaim_after_work = true;
                device.ended_during_work = Some(lease_id.to_owned());
                self.touch_device(&lease.device_id);
            } else {
                self.reclaim(&lease.device_id, Some(lease_id), now);
            }
        }
        match reason {
            LeaseEndReason::Expired => self.emit(
                LEASES,
                Event::LeaseExpired {
                    lease_id: lease_id.to_owned(),
                    device_id: lease.device_id.clone(),
                    owner_id: lease.owner_id.clone(),
                },
            ),
            other => self.emit(
                LEASES,
                Event::LeaseReleased {
                    lease_id: lease_id.to_owned(),
                    device_id: lease.device_id.clone(),
                    owner_id: lease.owner_id.clone(),
                    reason: other,
                },
            ),
        }
        self.fx.notices.push(Notice {
            owner: lease.owner_id.clone(),
            push: Push::LeaseLost {
                lease_id: lease_id.to_owned(),
                device_id: lease.device_id.clone(),
                reason,
            },
            except,
        });
        self.dispatch(now);
        Some(lease)
    }

    /// Withdraws `requester`'s pending request if it is still only waiting. The caller must
    /// be allowed to ([`Self::cancellable`]): checked here, under the decision, so no request
    /// admitted since an earlier check can be withdrawn by someone else.
    pub(crate) fn cancel(
        &mut self,
        requester: &str,
        caller: Caller<'_>,
        now: i64,
    ) -> Result<CancelResult, CoreError> {
        let Some(waiter) = self.cancellable(requester, caller)? else {
            return Ok(CancelResult::NotFound);
        };
        if waiter.stage == Stage::Processing {
            return Ok(CancelResult::NotCancellable);
        }
        let id = waiter.id.clone();
        self.fail(
            &id,
            CoreError::Cancelled(id.clone()),
            RejectionReason::Cancelled,
            now,
        );
        self.dispatch(now);
        Ok(CancelResult::Cancelled)
    }

    // === Time ===

    /// Does what is due at `now`: expiries, queue timeouts, idle tiers, book pruning.
    pub(crate) fn tick(&mut self, now: i64) {
        self.expire_due(now);
        for id in self.queue.due(now) {
            self.time_out(&id, now);
        }
        self.retries(now);
        self.idle_tiers(now);
        self.prune(now);
        self.dispatch(now);
    }

    /// Ends every lease whose deadline is at or before `now` (reason `expired`). [`Self::tick`]
    /// does it when the deadline comes; a decision about leases does it first as well, since
    /// the tick may not have run yet (a process stopped past a deadline resumes with messages
    /// and its timer both due): no lease acts, or is renewed, past its deadline.
    fn expire_due(&mut self, now: i64) {
        let expired: Vec<String> = self
            .leases
            .values()
            .filter(|l| l.ttl_deadline <= now)
            .map(|l| l.id.as_str().to_owned())
            .collect();
        for id in expired {
            self.end_lease(&id, LeaseEndReason::Expired, None, now);
        }
    }

    /// Starts what waited out its backoff: a quarantined device's next reclaim, a crashed
    /// device's next recovery.
    fn retries(&mut self, now: i64) {
        let due: Vec<(DeviceId, DeviceState, Platform)> = self
            .devices
            .values()
            .filter(|d| !d.busy)
            .filter(|d| match d.state {
                DeviceState::Quarantined => d.quarantine.is_some_and(|q| q.next_retry_at <= now),
                DeviceState::Leased => d.recovery_due.is_some_and(|at| at <= now),
                _ => false,
            })
            .map(|d| (d.id.clone(), d.state, d.spec.platform))
            .collect();
        for (id, state, platform) in due {
            if state == DeviceState::Quarantined {
                self.reclaim(&id, None, now);
                // Still quarantined while the retry runs: never handed out meanwhile.
                if let Some(entry) = self.devices.get_mut(&id) {
                    entry.state = DeviceState::Quarantined;
                }
            } else {
                self.start_recovery(&id, platform);
            }
        }
    }

    /// Shuts down devices idle past `idle.shutdownAfterMs` and deletes those idle past
    /// `idle.deleteAfterMs`. Never touches a leased or claimed device.
    fn idle_tiers(&mut self, now: i64) {
        let idle = self.settings.idle;
        let (to_shutdown, to_delete) = (ms(idle.shutdown_after_ms), ms(idle.delete_after_ms));
        let due: Vec<(DeviceId, bool)> = self
            .devices
            .values()
            .filter(|d| d.free())
            .filter_map(|d| {
                let idle_for = now.saturating_sub(d.idle_since);
                match d.state {
                    DeviceState::Ready if idle_for >= to_delete => Some((d.id.clone(), true)),
                    DeviceState::Ready if idle_for >= to_shutdown => Some((d.id.clone(), false)),
                    DeviceState::Shutdown if idle_for >= to_delete => Some((d.id.clone(), true)),
                    _ => None,
                }
            })
            .collect();
        for (id, delete) in due {
            if delete {
                self.delete_device(&id);
            } else {
                self.evict(&id);
            }
        }
    }

    fn delete_device(&mut self, id: &DeviceId) {
        let Some(entry) = self.devices.get_mut(id) else {
            return;
        };
        let running = entry.state.is_running();
        entry.state = DeviceState::Deleted;
        entry.busy = true;
        let work = Work::Delete {
            device: id.clone(),
            platform: entry.spec.platform,
            driver_device_id: entry.driver_device_id.clone(),
            running,
        };
        self.touch_device(id);
        self.fx.work.push(work);
    }

    fn prune(&mut self, now: i64) {
        let gone = self
            .book
            .prune(now, self.settings.retention_ms, self.settings.max_records);
        self.dirty.requests.extend(gone);
    }

    // === Start-up ===

    /// Converges restored state: open requests fail (the daemon restarted), devices caught
    /// mid-transition settle, leases whose device is gone end (`device-lost`). Leases keep
    /// their deadlines; overdue ones expire at the first tick.
    pub(crate) fn converge(&mut self, now: i64) {
        for id in self.book.open() {
            self.fail(
                &id,
                CoreError::Restarted(id.clone()),
                RejectionReason::DaemonRestarted,
                now,
            );
        }
        let leases: Vec<(String, DeviceId)> = self
            .leases
            .values()
            .map(|l| (l.id.as_str().to_owned(), l.device_id.clone()))
            .collect();
        for (lease_id, device_id) in &leases {
            match self.devices.get_mut(device_id) {
                Some(d) if d.state == DeviceState::Leased => {}
                Some(d) if d.state == DeviceState::Ready => {
                    d.state = DeviceState::Leased;
                    self.touch_device(device_id);
                }
                _ => {
                    self.end_lease(lease_id, LeaseEndReason::DeviceLost, None, now);
                }
            }
        }
        let leased: BTreeSet<DeviceId> =
            self.leases.values().map(|l| l.device_id.clone()).collect();
        let ids: Vec<DeviceId> = self.devices.keys().cloned().collect();
        for id in ids {
            let Some(entry) = self.devices.get_mut(&id) else {
                continue;
            };
            entry.claim = None;
            entry.busy = false;
            match entry.state {
                DeviceState::Provisioning if entry.driver_device_id.is_empty() => {
                    let spec = entry.spec.clone();
                    self.devices.remove(&id);
                    self.touch_device(&id);
                    self.emit(
                        DEVICES,
                        Event::DeviceDeleted {
                            device_id: id.clone(),
                            spec,
                        },
                    );
                }
                DeviceState::Provisioning => self.delete_device(&id),
                DeviceState::Booting => {
                    entry.state = DeviceState::Shutdown;
                    let spec = entry.spec.clone();
                    self.touch_device(&id);
                    self.emit(
                        DEVICES,
                        Event::DeviceShutdown {
                            device_id: id.clone(),
                            spec,
                        },
                    );
                }
                DeviceState::Leased if !leased.contains(&id) => self.reclaim(&id, None, now),
                DeviceState::Reclaiming => self.reclaim(&id, None, now),
                DeviceState::Deleted => {
                    self.devices.remove(&id);
                    self.touch_device(&id);
                }
                // The driver says whether it still runs; meanwhile it serves as it did.
                DeviceState::Leased | DeviceState::Ready => {
                    let work = Work::Adopt {
                        device: id.clone(),
                        platform: entry.spec.platform,
                        driver_device_id: entry.driver_device_id.clone(),
                    };
                    self.fx.work.push(work);
                }
                _ => {}
            }
        }
        // What each driver made that the registry does not know (a device half made when the
        // worker died, a process of the earlier run) goes; what the registry holds shut down is
        // stopped.
        let platforms: Vec<Platform> = self.settings.real.iter().copied().collect();
        for platform in platforms {
            let keep = self
                .devices
                .values()
                .filter(|d| d.spec.platform == platform && !d.driver_device_id.is_empty())
                .map(|d| Keep {
                    driver_device_id: d.driver_device_id.clone(),
                    stopped: d.state == DeviceState::Shutdown,
                })
                .collect();
            self.sweeping.insert(platform);
            self.fx.work.push(Work::Sweep { platform, keep });
        }
    }

    /// Starts wiping a device: busy until the driver's reclaim ends. `ended` names the lease
    /// that just ended on it, if one did.
    fn reclaim(&mut self, id: &DeviceId, ended: Option<&str>, now: i64) {
        let Some(platform) = self.devices.get(id).map(|d| d.spec.platform) else {
            return;
        };
        let reclaim_ms = self.estimates(platform).reclaim_ms;
        let Some(entry) = self.devices.get_mut(id) else {
            return;
        };
        entry.state = DeviceState::Reclaiming;
        entry.busy = true;
        entry.reclaim_until = Some(now.saturating_add(ms(reclaim_ms)));
        let work = Work::Reclaim {
            device: id.clone(),
            platform,
            driver_device_id: entry.driver_device_id.clone(),
            ended: ended.map(String::from),
        };
        self.touch_device(id);
        self.fx.work.push(work);
    }
}

/// Where a waiter's device comes from.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Plan {
    Warm(DeviceId),
    AfterReclaim(DeviceId),
    Boot {
        device: DeviceId,
        evict: Option<DeviceId>,
    },
    Provision {
        evict: Option<DeviceId>,
    },
}

#[cfg(test)]
mod tests;

/// The wait before quarantine retry `attempts` (1 = after the first failure):
/// `retryBackoffMs × multiplier^(attempts−1)`, at most `maxRetryBackoffMs`.
pub(crate) fn quarantine_backoff(q: &QuarantineConfig, attempts: u32) -> u64 {
    let mut wait = q.retry_backoff_ms;
    for _ in 1..attempts {
        wait = wait.saturating_mul(u64::from(q.retry_backoff_multiplier));
        if wait >= q.max_retry_backoff_ms {
            break;
        }
    }
    wait.min(q.max_retry_backoff_ms)
}
