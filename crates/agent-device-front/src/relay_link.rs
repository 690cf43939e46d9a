//! The relay host link: the front's port on a gateway. It places each agent-device lease on the
//! worker holding its simlock lease and relays there, under the tenant
//! `gw.<gateway instance id>.<principal>`.
//!
//! It reads the fleet through a narrow [`FleetPort`] the gateway's composition builds, and never
//! writes it. It remembers, per lease, the worker and owner it last read, and keeps routing to
//! that worker after the lease index dropped the lease (as `release --all` does), so the
//! worker's agent-device still answers for it; the memory of a dropped lease is forgotten once
//! the gateway's `lease.maxTtlMs` has passed since the drop ([`LeaseMemory`]).

use std::collections::{BTreeSet, HashMap};
use std::sync::Arc;
use std::time::Duration;

use futures::FutureExt;
use futures::future::BoxFuture;
use http::{Request, Response};
use parking_lot::Mutex;
use simlock_contract::model::Platform;
use simlock_daemon::clock::SharedClock;

use crate::lease_id::LeaseId;
use crate::port::{
    Caller, HostLink, HostStatus, Hosts, KeptRelease, RecoveredLease, Serving, StatusScope,
};
use crate::reply::Refusal;
use crate::tenant::Tenant;
use crate::{Body, CAPABILITY};

/// Why no worker can take a new agent-device lease.
pub const NO_CAPABLE_WORKER: &str = "no worker connected to this gateway can serve agent-device";
/// Why the worker holding a lease cannot serve it.
pub const HOLDER_CANNOT_SERVE: &str = "the worker holding this lease cannot serve agent-device";
pub use crate::port::HOLDER_DISCONNECTED;
/// How often the memory is swept of leases dropped long enough ago.
pub const SWEEP_EVERY: Duration = Duration::from_secs(60);

/// Where the lease index places a lease.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Placement {
    /// The worker holding it.
    pub worker: String,
    /// Its owner (the principal that made it).
    pub owner: String,
}

/// A worker as the link needs it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WorkerFacts {
    /// Its id.
    pub id: String,
    /// Whether its uplink is up.
    pub connected: bool,
    /// Whether it can serve the agent-device leases it holds now (connected, `agent-device`
    /// available; drained or not): the fleet's rule.
    pub serves: bool,
    /// The platforms of its catalog (empty until the catalog was read).
    pub platforms: BTreeSet<Platform>,
    /// Its `lease.maxTtlMs`, once read.
    pub lease_max_ttl_ms: Option<u64>,
    /// Whether its lease list was read since the gateway started (until then the lease index
    /// lacks its leases, and a lease the link remembers is not known to have ended).
    pub leases_known: bool,
}

/// A relay that failed, as the fleet's relay answers it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RelayFailure {
    /// The contract error's message.
    pub message: String,
}

/// What the link reads of the gateway. The gateway's composition implements it over the fleet
/// and the relay; the rules (where a lease is, who owns it, which workers are capable) live
/// there.
pub trait FleetPort: Send + Sync + 'static {
    /// The lease index's worker and owner for `lease`.
    fn placement(&self, lease: &LeaseId) -> Option<Placement>;
    /// The device of `lease` as the lease index has it.
    fn device(&self, lease: &LeaseId) -> Option<RecoveredLease>;
    /// The workers capable of a new agent-device lease (the fleet's rule: connected, not
    /// drained, `agent-device` available in their view, catalog and `lease.maxTtlMs` read).
    fn capable_workers(&self) -> Vec<WorkerFacts>;
    /// One worker the gateway knows, drained or not.
    fn worker(&self, id: &str) -> Option<WorkerFacts>;
    /// Relays one exchange to `worker`'s `agent-device` target.
    fn relay(
        &self,
        worker: &str,
        request: Request<Body>,
        tenant: &Tenant,
        lease: Option<&LeaseId>,
    ) -> BoxFuture<'static, Result<Response<Body>, RelayFailure>>;
    /// The gateway's instance id (the tenant prefix).
    fn gateway_id(&self) -> String;
}

/// Where the link's memory is kept across restarts of the gateway, so that a lease whose worker
/// has not reconnected yet is still known (and answered "disconnected; retry", not "not one of
/// yours"). The lease index, rebuilt from what the workers report, stays the truth once they are
/// back ([ADR 0025](../../../docs/adr/0025-a-gateway-restart-keeps-the-agent-device-leases.md)).
pub trait PlacementStore: Send + Sync + 'static {
    /// Everything kept: `(lease, placement, dropped_at)`.
    fn load(&self) -> Vec<(LeaseId, Placement, Option<i64>)>;
    /// `lease` is placed at `placement` (and not dropped).
    fn placed(&self, lease: &LeaseId, placement: &Placement);
    /// The index dropped `lease` at `at`.
    fn dropped(&self, lease: &LeaseId, at: i64);
    /// `lease`'s holder asked for its release, carried out once its worker is back: kept until
    /// `until` (ms since the epoch, the lease's TTL), a restart between included. Answers
    /// whether it was kept (false: the write failed, or `lease` has no placement).
    fn releasing(&self, lease: &LeaseId, until: i64) -> bool;
    /// The release of `lease` was carried out, or is past keeping.
    fn release_settled(&self, lease: &LeaseId);
    /// The releases kept: `(lease, until)`.
    fn releases(&self) -> Vec<(LeaseId, i64)>;
    /// `lease` is forgotten (a release kept for it too).
    fn forget(&self, lease: &LeaseId);
}

/// The link's memory of where leases are.
#[derive(Debug, Default)]
pub struct LeaseMemory {
    entries: HashMap<LeaseId, Remembered>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
struct Remembered {
    placement: Placement,
    /// When the index dropped the lease (ms since the epoch), if it did.
    dropped_at: Option<i64>,
}

fn older_than(now: i64, at: i64, keep: Duration) -> bool {
    u128::try_from(now.saturating_sub(at)).unwrap_or(0) > keep.as_millis()
}

impl LeaseMemory {
    /// The index placed `lease` at `placement` now: remembered, and no longer dropped.
    pub fn placed(&mut self, lease: &LeaseId, placement: Placement) -> bool {
        let entry = Remembered {
            placement,
            dropped_at: None,
        };
        self.entries.insert(lease.clone(), entry.clone()).as_ref() != Some(&entry)
    }

    /// Takes back what a store kept: `(lease, placement, dropped_at)`.
    pub fn restore(&mut self, kept: Vec<(LeaseId, Placement, Option<i64>)>) {
        for (lease, placement, dropped_at) in kept {
            self.entries.insert(
                lease,
                Remembered {
                    placement,
                    dropped_at,
                },
            );
        }
    }

    /// The index dropped `lease` at `now`: the memory keeps routing it, stamped.
    pub fn dropped(&mut self, lease: &LeaseId, now: i64) -> bool {
        match self.entries.get_mut(lease) {
            Some(entry) if entry.dropped_at.is_none() => {
                entry.dropped_at = Some(now);
                true
            }
            _ => false,
        }
    }

    /// Where `lease` was last placed, unless it was dropped more than `keep` before `now`
    /// (then it is forgotten).
    pub fn recall(&mut self, lease: &LeaseId, now: i64, keep: Duration) -> Option<Placement> {
        let entry = self.entries.get(lease)?;
        if entry.dropped_at.is_some_and(|at| older_than(now, at, keep)) {
            self.entries.remove(lease);
            return None;
        }
        Some(entry.placement.clone())
    }

    /// Forgets every lease dropped more than `keep` before `now`.
    pub fn sweep(&mut self, now: i64, keep: Duration) -> Vec<LeaseId> {
        let gone: Vec<LeaseId> = self
            .entries
            .iter()
            .filter(|(_, e)| e.dropped_at.is_some_and(|at| older_than(now, at, keep)))
            .map(|(l, _)| l.clone())
            .collect();
        for lease in &gone {
            self.entries.remove(lease);
        }
        gone
    }

    /// The remembered leases not stamped as dropped, with their placements.
    pub fn unstamped(&self) -> Vec<(LeaseId, Placement)> {
        self.entries
            .iter()
            .filter(|(_, e)| e.dropped_at.is_none())
            .map(|(l, e)| (l.clone(), e.placement.clone()))
            .collect()
    }

    /// Stamps, as dropped at `now`, each of `missing` (leases the index no longer holds: removals
    /// the link was not told of) still remembered as placed there and not stamped yet.
    pub fn stamp(&mut self, now: i64, missing: &[(LeaseId, Placement)]) -> Vec<LeaseId> {
        let mut stamped = Vec::new();
        for (lease, placement) in missing {
            if let Some(entry) = self.entries.get_mut(lease)
                && entry.dropped_at.is_none()
                && entry.placement == *placement
            {
                entry.dropped_at = Some(now);
                stamped.push(lease.clone());
            }
        }
        stamped
    }

    /// The leases remembered for `owner` and not dropped, in id order.
    pub fn held_by(&self, owner: &str) -> Vec<LeaseId> {
        let mut held: Vec<LeaseId> = self
            .entries
            .iter()
            .filter(|(_, e)| e.dropped_at.is_none() && e.placement.owner == owner)
            .map(|(l, _)| l.clone())
            .collect();
        held.sort_by(|a, b| a.as_str().cmp(b.as_str()));
        held
    }

    /// Where `lease` was last placed, dropped or not.
    pub fn placement(&self, lease: &LeaseId) -> Option<&Placement> {
        self.entries.get(lease).map(|e| &e.placement)
    }

    /// Whether `lease` is remembered as dropped by the index.
    pub fn is_dropped(&self, lease: &LeaseId) -> bool {
        self.entries
            .get(lease)
            .is_some_and(|e| e.dropped_at.is_some())
    }

    /// How many leases are remembered.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Whether `lease` is remembered.
    pub fn contains(&self, lease: &LeaseId) -> bool {
        self.entries.contains_key(lease)
    }

    /// Whether none is.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }
}

/// Where the link found a lease.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Source {
    /// In the lease index.
    Index,
    /// Only in the memory, not dropped: made by an earlier run of the gateway, its worker's
    /// leases not read since.
    Remembered,
    /// Only in the memory, dropped by the index.
    Dropped,
}

/// A lease's placement and where it was found.
#[derive(Debug, Clone)]
struct Placed {
    placement: Placement,
    source: Source,
}

/// The relay host link.
pub struct RelayHostLink {
    port: Arc<dyn FleetPort>,
    memory: Arc<Mutex<LeaseMemory>>,
    store: Option<Arc<dyn PlacementStore>>,
    /// The gateway's `lease.maxTtlMs`: how long a dropped lease is remembered.
    keep: Duration,
    /// The time the memory reads.
    clock: SharedClock,
    /// The workers whose last health read went unanswered until its caller gave up, and when:
    /// health is read elsewhere for [`HEALTH_SKIP_MS`].
    slow_health: Arc<Mutex<HashMap<String, i64>>>,
}

/// How long a worker whose health read went unanswered is passed over for health reads, while
/// another capable worker exists (its uplink is declared dead within 15 s when it is).
const HEALTH_SKIP_MS: i64 = 30_000;

/// Marks `worker` slow for health reads when dropped before it was answered (the front's
/// bound passed); an answer clears the mark.
struct HealthRead {
    /// The worker read, until the read is answered.
    worker: Option<String>,
    slow: Arc<Mutex<HashMap<String, i64>>>,
    clock: SharedClock,
}

impl HealthRead {
    /// The read was answered (well or not): the worker is not slow.
    fn answered(mut self) {
        if let Some(worker) = self.worker.take() {
            self.slow.lock().remove(&worker);
        }
    }
}

impl Drop for HealthRead {
    fn drop(&mut self) {
        if let Some(worker) = self.worker.take() {
            let now = self.clock.now_ms();
            self.slow.lock().insert(worker, now);
        }
    }
}

impl std::fmt::Debug for RelayHostLink {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RelayHostLink")
            .field("remembered", &self.memory.lock().len())
            .finish_non_exhaustive()
    }
}

impl RelayHostLink {
    /// A link over `port`, remembering dropped leases for `keep` (the gateway's
    /// `lease.maxTtlMs`) by `clock`.
    pub fn new(port: Arc<dyn FleetPort>, keep: Duration, clock: SharedClock) -> Self {
        Self {
            port,
            memory: Arc::new(Mutex::new(LeaseMemory::default())),
            store: None,
            keep,
            clock,
            slow_health: Arc::default(),
        }
    }

    /// The link, its memory kept in `store` (and what `store` kept taken back now).
    #[must_use]
    pub fn with_store(mut self, store: Arc<dyn PlacementStore>) -> Self {
        self.memory.lock().restore(store.load());
        self.store = Some(store);
        self
    }

    /// The fleet's lease index dropped `lease` (the composition calls this from the index's
    /// removals).
    pub fn dropped(&self, lease: &LeaseId) {
        let now = self.clock.now_ms();
        if self.memory.lock().dropped(lease, now)
            && let Some(store) = &self.store
        {
            store.dropped(lease, now);
        }
    }

    /// Stamps what the index dropped unannounced, and forgets the leases dropped longer ago
    /// than the gateway's `lease.maxTtlMs`; the composition calls it every [`SWEEP_EVERY`].
    pub fn sweep(&self) {
        let now = self.clock.now_ms();
        // The fleet is read with the memory's lock released, each worker once.
        let remembered = self.memory.lock().unstamped();
        let mut leases_known: HashMap<String, bool> = HashMap::new();
        let missing: Vec<(LeaseId, Placement)> = remembered
            .into_iter()
            .filter(|(lease, placement)| {
                // A lease whose worker has not reported its leases since the gateway started
                // is not missing: the index cannot have it yet.
                self.port.placement(lease).is_none()
                    && *leases_known
                        .entry(placement.worker.clone())
                        .or_insert_with(|| {
                            self.port
                                .worker(&placement.worker)
                                .is_some_and(|w| w.leases_known)
                        })
            })
            .collect();
        let mut memory = self.memory.lock();
        let stamped = memory.stamp(now, &missing);
        let forgotten = memory.sweep(now, self.keep);
        drop(memory);
        if let Some(store) = &self.store {
            for lease in &stamped {
                store.dropped(lease, now);
            }
            for lease in &forgotten {
                store.forget(lease);
            }
        }
    }

    /// Sweeps every [`SWEEP_EVERY`] until `stop` fires.
    pub fn spawn_sweeper(self: &Arc<Self>, stop: tokio_util::sync::CancellationToken) {
        let link = self.clone();
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(SWEEP_EVERY);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tokio::select! {
                    _ = tick.tick() => link.sweep(),
                    () = stop.cancelled() => return,
                }
            }
        });
    }

    /// Where `lease` is: the index first (remembered), else the memory.
    fn place(&self, lease: &LeaseId) -> Option<Placed> {
        let mut memory = self.memory.lock();
        match self.port.placement(lease) {
            Some(placement) => {
                let changed = memory.placed(lease, placement.clone());
                drop(memory);
                if changed && let Some(store) = &self.store {
                    store.placed(lease, &placement);
                }
                Some(Placed {
                    placement,
                    source: Source::Index,
                })
            }
            None => {
                let (had, dropped) = (memory.contains(lease), memory.is_dropped(lease));
                let recalled = memory.recall(lease, self.clock.now_ms(), self.keep);
                drop(memory);
                if had
                    && recalled.is_none()
                    && let Some(store) = &self.store
                {
                    store.forget(lease);
                }
                recalled.map(|placement| Placed {
                    placement,
                    source: if dropped {
                        Source::Dropped
                    } else {
                        Source::Remembered
                    },
                })
            }
        }
    }

    /// The lease's worker when `caller` owns it.
    fn owned(&self, lease: &LeaseId, caller: &Caller) -> Option<Placed> {
        self.place(lease)
            .filter(|p| p.placement.owner == caller.principal)
    }

    /// The status of the worker holding a lease: serving while connected with agent-device
    /// available (drained or not); away while its uplink is down, or while it was not seen
    /// (or its leases not read) since the gateway started and the index does not have the
    /// lease yet, which is worth retrying; else unable.
    fn holder_status(&self, placed: &Placed) -> HostStatus {
        match self.port.worker(&placed.placement.worker) {
            Some(worker) if !worker.connected => HostStatus::HolderAway,
            None => HostStatus::HolderAway,
            Some(worker) if placed.source != Source::Index && !worker.leases_known => {
                HostStatus::HolderAway
            }
            Some(worker) if worker.serves => HostStatus::Running(Serving {
                platforms: worker.platforms,
                lease_max_ttl_ms: worker.lease_max_ttl_ms,
            }),
            Some(_) => HostStatus::Unavailable {
                reason: HOLDER_CANNOT_SERVE.into(),
                retriable: false,
            },
        }
    }

    /// The worker a health read goes to: the first capable one not passed over for a health
    /// read its caller gave up on (a stalled worker not yet declared dead would hold every
    /// agent's health read to the front's bound, trial 13), else the first.
    fn health_worker(&self) -> Option<String> {
        let capable = self.port.capable_workers();
        let now = self.clock.now_ms();
        let mut slow = self.slow_health.lock();
        slow.retain(|_, since| now.saturating_sub(*since) < HEALTH_SKIP_MS);
        capable
            .iter()
            .find(|w| !slow.contains_key(&w.id))
            .or_else(|| capable.first())
            .map(|w| w.id.clone())
    }

    fn new_lease_status(&self) -> HostStatus {
        let capable = self.port.capable_workers();
        if capable.is_empty() {
            return HostStatus::unavailable(NO_CAPABLE_WORKER);
        }
        // A lease asks for a TTL every capable worker accepts; once granted, it is renewed up
        // to its holder's ceiling.
        let lease_max_ttl_ms = capable.iter().filter_map(|w| w.lease_max_ttl_ms).min();
        HostStatus::Running(Serving {
            platforms: capable.into_iter().flat_map(|w| w.platforms).collect(),
            lease_max_ttl_ms,
        })
    }
}

impl HostLink for RelayHostLink {
    fn status(&self, scope: StatusScope<'_>) -> HostStatus {
        let StatusScope::Lease { lease, caller } = scope else {
            return self.new_lease_status();
        };
        // Nothing about another token's lease shows, nor about the fleet: it is "running", and
        // the forward that follows refuses it as not the caller's, whatever the workers' state
        // (a "not available; retry" would send the caller retrying a lease that is not its).
        let Some(placed) = self.owned(lease, caller) else {
            return HostStatus::Running(Serving {
                platforms: BTreeSet::new(),
                lease_max_ttl_ms: None,
            });
        };
        self.holder_status(&placed)
    }

    fn recover(&self, lease: &LeaseId, caller: &Caller) -> Result<RecoveredLease, Refusal> {
        let not_yours = || Refusal::NotYours {
            lease: lease.clone(),
            hosts: Hosts::PerLease,
        };
        let placed = self.owned(lease, caller).ok_or_else(not_yours)?;
        self.holder_status(&placed).serving()?;
        match placed.source {
            Source::Index => self
                .port
                .device(lease)
                .ok_or_else(|| Refusal::NotAvailable {
                    reason: HOLDER_CANNOT_SERVE.into(),
                    retriable: false,
                }),
            // Its worker reported its leases, and this one is not among them.
            Source::Remembered | Source::Dropped => Err(Refusal::LeaseEnded(lease.clone())),
        }
    }

    fn held(&self, caller: &Caller) -> Vec<LeaseId> {
        self.memory.lock().held_by(&caller.principal)
    }

    fn forward(
        &self,
        request: Request<Body>,
        caller: Option<&Caller>,
        lease: Option<&LeaseId>,
    ) -> BoxFuture<'static, Result<Response<Body>, Refusal>> {
        let port = self.port.clone();
        let Some(lease) = lease else {
            let is_health = request.uri().path() == format!("{}/health", crate::PREFIX);
            if !is_health {
                return async { Err(Refusal::TooOld) }.boxed();
            }
            let Some(worker) = self.health_worker() else {
                return async {
                    Err(Refusal::NotAvailable {
                        reason: NO_CAPABLE_WORKER.into(),
                        retriable: true,
                    })
                }
                .boxed();
            };
            let tenant = Tenant::through_gateway(&port.gateway_id(), "");
            let read = HealthRead {
                worker: Some(worker.clone()),
                slow: self.slow_health.clone(),
                clock: self.clock.clone(),
            };
            let relayed = relay(&*port, &worker, request, &tenant, None);
            return async move {
                let answer = relayed.await;
                read.answered();
                answer
            }
            .boxed();
        };
        let placed = caller.and_then(|c| self.owned(lease, c));
        let (Some(placed), Some(caller)) = (placed, caller) else {
            let refusal = Refusal::NotYours {
                lease: lease.clone(),
                hosts: Hosts::PerLease,
            };
            return async { Err(refusal) }.boxed();
        };
        // A worker that is away is not tried: the answer comes at once, and says to retry.
        if self.holder_status(&placed) == HostStatus::HolderAway {
            return async { Err(crate::port::holder_away()) }.boxed();
        }
        let tenant = Tenant::through_gateway(&port.gateway_id(), &caller.principal);
        relay(
            &*port,
            &placed.placement.worker,
            request,
            &tenant,
            Some(lease),
        )
    }

    fn lease_requires(&self) -> Vec<String> {
        vec![CAPABILITY.to_owned()]
    }

    fn keep_release(&self, lease: &LeaseId, within: Duration) -> bool {
        let Some(store) = &self.store else {
            return true;
        };
        let within = i64::try_from(within.as_millis()).unwrap_or(i64::MAX);
        store.releasing(lease, self.clock.now_ms().saturating_add(within))
    }

    fn release_settled(&self, lease: &LeaseId) {
        if let Some(store) = &self.store {
            store.release_settled(lease);
        }
    }

    fn kept_releases(&self) -> Vec<KeptRelease> {
        let Some(store) = &self.store else {
            return Vec::new();
        };
        let now = self.clock.now_ms();
        let mut kept = Vec::new();
        for (lease, until) in store.releases() {
            let owner = self
                .memory
                .lock()
                .placement(&lease)
                .map(|p| p.owner.clone());
            match (owner, u64::try_from(until.saturating_sub(now))) {
                (Some(owner), Ok(left)) if left > 0 => kept.push(KeptRelease {
                    lease,
                    owner,
                    within: Duration::from_millis(left),
                }),
                // Past the lease's TTL: its worker ended it.
                _ => store.release_settled(&lease),
            }
        }
        kept
    }

    fn hosts(&self) -> Hosts {
        Hosts::PerLease
    }
}

fn relay(
    port: &dyn FleetPort,
    worker: &str,
    request: Request<Body>,
    tenant: &Tenant,
    lease: Option<&LeaseId>,
) -> BoxFuture<'static, Result<Response<Body>, Refusal>> {
    let relayed = port.relay(worker, request, tenant, lease);
    let whose = if lease.is_some() {
        "the worker holding this lease".to_owned()
    } else {
        format!("worker {worker}")
    };
    async move {
        relayed
            .await
            .map_err(|failure| relay_failed(&whose, &failure))
    }
    .boxed()
}

/// The retriable refusal for a relay to `whose` that failed (its uplink lost mid-request, the
/// relay's deadline, no `agent-device` target), the relay's own words kept for the detail.
fn relay_failed(whose: &str, failure: &RelayFailure) -> Refusal {
    Refusal::NotAvailable {
        reason: format!("the relay to {whose} failed ({}); retry", failure.message),
        retriable: true,
    }
}

#[cfg(test)]
mod tests {
    use simlock_contract::Role;

    use super::*;

    #[test]
    fn a_failed_relay_is_retriable_and_says_so_keeping_the_relays_words() {
        let failure = RelayFailure {
            message: "Worker w1 is not connected to this gateway".into(),
        };
        assert_eq!(
            relay_failed("the worker holding this lease", &failure).to_string(),
            "agent-device is not available on this simlock: the relay to the worker holding this lease failed (Worker w1 is not connected to this gateway); retry"
        );
        assert!(matches!(
            relay_failed("worker w1", &failure),
            Refusal::NotAvailable {
                retriable: true,
                ..
            }
        ));
    }

    fn lease() -> LeaseId {
        LeaseId::parse("0123456789abcdef0123456789abcdef").unwrap()
    }

    fn placement(worker: &str, owner: &str) -> Placement {
        Placement {
            worker: worker.into(),
            owner: owner.into(),
        }
    }

    #[test]
    fn a_dropped_lease_is_recalled_until_keep_has_passed_and_not_a_moment_after() {
        let keep = Duration::from_secs(3600);
        let mut memory = LeaseMemory::default();
        let l = lease();
        memory.placed(&l, placement("w1", "tok_a"));
        let at = 1_000_000;
        memory.dropped(&l, at);
        assert_eq!(
            memory.recall(&l, at + 3_600_000, keep),
            Some(placement("w1", "tok_a"))
        );
        memory.sweep(at + 3_600_000, keep);
        assert_eq!(memory.len(), 1, "at the bound it is kept");
        assert_eq!(memory.recall(&l, at + 3_600_001, keep), None);
        assert!(memory.is_empty(), "past it, forgotten");
    }

    #[test]
    fn a_lease_placed_again_is_no_longer_dropped_and_the_first_drop_stamps() {
        let keep = Duration::from_secs(10);
        let mut memory = LeaseMemory::default();
        let l = lease();
        memory.placed(&l, placement("w1", "tok_a"));
        memory.dropped(&l, 0);
        memory.dropped(&l, 9_000);
        assert_eq!(
            memory.recall(&l, 11_000, keep),
            None,
            "stamped at the first drop"
        );
        memory.placed(&l, placement("w2", "tok_a"));
        memory.dropped(&l, 20_000);
        memory.placed(&l, placement("w2", "tok_a"));
        memory.sweep(1_000_000, keep);
        assert_eq!(
            memory.recall(&l, 1_000_000, keep),
            Some(placement("w2", "tok_a"))
        );
    }

    #[test]
    fn a_removal_nobody_announced_is_stamped_by_the_sweep() {
        let keep = Duration::from_secs(10);
        let mut memory = LeaseMemory::default();
        let l = lease();
        memory.placed(&l, placement("w1", "tok_a"));
        memory.stamp(5_000, &[]);
        memory.sweep(100_000, keep);
        assert_eq!(memory.len(), 1, "still indexed: kept");
        let elsewhere = [(l.clone(), placement("w2", "tok_a"))];
        assert!(
            memory.stamp(100_000, &elsewhere).is_empty(),
            "placed again elsewhere since it was read: not stamped"
        );
        assert_eq!(
            memory.unstamped(),
            vec![(l.clone(), placement("w1", "tok_a"))]
        );
        let missing = memory.unstamped();
        assert_eq!(memory.stamp(100_000, &missing), vec![l.clone()]);
        assert!(memory.stamp(100_500, &missing).is_empty(), "stamped once");
        memory.sweep(110_000, keep);
        assert_eq!(memory.len(), 1, "stamped at 100 s, kept to 110 s");
        memory.sweep(110_001, keep);
        assert!(memory.is_empty());
    }

    struct Fleet {
        placement: Mutex<Option<Placement>>,
        workers: Vec<WorkerFacts>,
    }

    impl FleetPort for Fleet {
        fn placement(&self, _: &LeaseId) -> Option<Placement> {
            self.placement.lock().clone()
        }
        fn device(&self, _: &LeaseId) -> Option<RecoveredLease> {
            self.placement.lock().as_ref().map(|p| RecoveredLease {
                platform: Platform::Android,
                address: format!("{}-emulator-5554", p.worker),
            })
        }
        fn capable_workers(&self) -> Vec<WorkerFacts> {
            self.workers
                .iter()
                .filter(|w| w.serves && !w.platforms.is_empty())
                .cloned()
                .collect()
        }
        fn worker(&self, id: &str) -> Option<WorkerFacts> {
            self.workers.iter().find(|w| w.id == id).cloned()
        }
        fn relay(
            &self,
            worker: &str,
            _: Request<Body>,
            tenant: &Tenant,
            _: Option<&LeaseId>,
        ) -> BoxFuture<'static, Result<Response<Body>, RelayFailure>> {
            let answer = format!("{worker} {tenant}");
            async move { Ok(Response::new(crate::body::full(answer))) }.boxed()
        }
        fn gateway_id(&self) -> String {
            "gw1".into()
        }
    }

    fn clock() -> SharedClock {
        simlock_daemon::clock::TokioClock::starting_at(0).shared()
    }

    fn worker(id: &str, platforms: &[Platform], available: bool) -> WorkerFacts {
        WorkerFacts {
            id: id.into(),
            connected: true,
            serves: available,
            platforms: platforms.iter().copied().collect(),
            lease_max_ttl_ms: Some(300_000),
            leases_known: true,
        }
    }

    /// What a restarted gateway's link knows of `lease` (at `w2`, `tok_a`'s) before the index
    /// has it, its worker as `w2` is.
    fn restarted(w2: Option<WorkerFacts>, dropped: Option<i64>) -> RelayHostLink {
        #[derive(Default)]
        struct Kept(Mutex<Vec<(LeaseId, Placement, Option<i64>)>>);
        impl PlacementStore for Kept {
            fn load(&self) -> Vec<(LeaseId, Placement, Option<i64>)> {
                self.0.lock().clone()
            }
            fn placed(&self, _: &LeaseId, _: &Placement) {}
            fn dropped(&self, _: &LeaseId, _: i64) {}
            fn releasing(&self, _: &LeaseId, _: i64) -> bool {
                true
            }
            fn release_settled(&self, _: &LeaseId) {}
            fn releases(&self) -> Vec<(LeaseId, i64)> {
                Vec::new()
            }
            fn forget(&self, _: &LeaseId) {}
        }
        let fleet = Fleet {
            placement: Mutex::new(None),
            workers: w2.into_iter().collect(),
        };
        let kept = Kept::default();
        kept.0
            .lock()
            .push((lease(), placement("w2", "tok_a"), dropped));
        RelayHostLink::new(Arc::new(fleet), Duration::from_secs(600), clock())
            .with_store(Arc::new(kept))
    }

    #[tokio::test(start_paused = true)]
    async fn a_kept_release_is_given_back_with_its_owner_and_time_left_until_that_runs_out() {
        use simlock_daemon::store::Database;
        let dir = tempfile::tempdir().unwrap();
        let db = || Database::open(&dir.path().join("state.db")).unwrap();
        let store = crate::placements::DbPlacements::open(db()).unwrap();
        let (l, other) = (lease(), LeaseId::mint());
        store.placed(&l, &placement("w2", "tok_a"));
        // The wall clock both runs read.
        let now = clock();
        let link = |store| {
            let fleet = Fleet {
                placement: Mutex::new(None),
                workers: Vec::new(),
            };
            RelayHostLink::new(Arc::new(fleet), Duration::from_secs(600), now.clone())
                .with_store(Arc::new(store))
        };
        let first = link(store);
        assert!(first.kept_releases().is_empty());
        assert!(first.keep_release(&l, Duration::from_secs(5)));
        // A lease the link never placed keeps nothing, and says so.
        assert!(!first.keep_release(&other, Duration::from_secs(5)));
        drop(first);

        tokio::time::advance(Duration::from_secs(2)).await;
        let next = link(crate::placements::DbPlacements::open(db()).unwrap());
        assert_eq!(
            next.kept_releases(),
            vec![KeptRelease {
                lease: l.clone(),
                owner: "tok_a".into(),
                within: Duration::from_secs(3),
            }]
        );
        next.release_settled(&l);
        assert!(next.kept_releases().is_empty(), "settled");

        // One whose time ran out is settled as it is read.
        assert!(next.keep_release(&l, Duration::from_secs(1)));
        tokio::time::advance(Duration::from_millis(1_001)).await;
        assert!(next.kept_releases().is_empty());
        let store = crate::placements::DbPlacements::open(db()).unwrap();
        assert!(store.releases().is_empty(), "and no longer kept");
    }

    #[tokio::test]
    async fn after_a_restart_a_lease_is_away_until_its_worker_reported_then_ended_if_not_listed() {
        let l = lease();
        let owner = caller("tok_a");
        let scope = StatusScope::Lease {
            lease: &l,
            caller: &owner,
        };
        // Not seen since the start, connected but its leases unread: away, for its owner.
        let unread = WorkerFacts {
            leases_known: false,
            ..worker("w2", &[Platform::Android], true)
        };
        for w2 in [None, Some(unread)] {
            let link = restarted(w2, None);
            assert_eq!(link.status(scope), HostStatus::HolderAway);
            assert_eq!(link.recover(&l, &owner), Err(crate::port::holder_away()));
            assert_eq!(link.held(&owner), vec![l.clone()]);
            assert!(link.held(&caller("tok_b")).is_empty());
            let answer = link
                .forward(Request::new(crate::body::empty()), Some(&owner), Some(&l))
                .await
                .unwrap_err();
            assert_eq!(answer, crate::port::holder_away(), "at once, not relayed");
            assert_eq!(
                link.recover(&l, &caller("tok_b")),
                Err(Refusal::NotYours {
                    lease: l.clone(),
                    hosts: Hosts::PerLease
                }),
                "another token's is never shown"
            );
            link.sweep();
            assert!(
                !link.memory.lock().is_dropped(&l),
                "a lease whose worker has not reported is not missing"
            );
        }
        // Its worker reported and does not list it: ended, and the sweep stamps it.
        let link = restarted(Some(worker("w2", &[Platform::Android], true)), None);
        assert_eq!(
            link.recover(&l, &owner),
            Err(Refusal::LeaseEnded(l.clone()))
        );
        link.sweep();
        assert!(link.memory.lock().is_dropped(&l));
        assert!(link.held(&owner).is_empty(), "a dropped lease is not held");
    }

    /// A fleet whose relays take an hour (to `only` that worker, or to every one): any that is
    /// tried shows on a paused clock; the others answer at once.
    struct Slow {
        fleet: Fleet,
        only: Option<&'static str>,
    }

    impl FleetPort for Slow {
        fn placement(&self, lease: &LeaseId) -> Option<Placement> {
            self.fleet.placement(lease)
        }
        fn device(&self, lease: &LeaseId) -> Option<RecoveredLease> {
            self.fleet.device(lease)
        }
        fn capable_workers(&self) -> Vec<WorkerFacts> {
            self.fleet.capable_workers()
        }
        fn worker(&self, id: &str) -> Option<WorkerFacts> {
            self.fleet.worker(id)
        }
        fn relay(
            &self,
            worker: &str,
            request: Request<Body>,
            tenant: &Tenant,
            lease: Option<&LeaseId>,
        ) -> BoxFuture<'static, Result<Response<Body>, RelayFailure>> {
            if self.only.is_some_and(|only| only != worker) {
                return self.fleet.relay(worker, request, tenant, lease);
            }
            async {
                tokio::time::sleep(Duration::from_secs(3600)).await;
                Err(RelayFailure {
                    message: "the relay's deadline passed".into(),
                })
            }
            .boxed()
        }
        fn gateway_id(&self) -> String {
            self.fleet.gateway_id()
        }
    }

    #[tokio::test(start_paused = true)]
    async fn a_worker_that_left_a_health_read_unanswered_is_passed_over_for_health_a_while() {
        let fleet = Slow {
            fleet: Fleet {
                placement: Mutex::new(None),
                workers: vec![
                    worker("w1", &[Platform::Android], true),
                    worker("w2", &[Platform::Android], true),
                ],
            },
            only: Some("w1"),
        };
        let link = RelayHostLink::new(Arc::new(fleet), Duration::from_secs(60), clock());
        let health = || {
            link.forward(
                Request::get(format!("{}/health", crate::PREFIX))
                    .body(crate::body::empty())
                    .unwrap(),
                None,
                None,
            )
        };
        let answered_by = |response: Response<Body>| async move {
            let body = crate::body::read_to_bytes(response.into_body(), 1024)
                .await
                .unwrap();
            let body = String::from_utf8(body.to_vec()).unwrap();
            body.split(' ').next().unwrap().to_owned()
        };
        // The first capable worker is read first; its caller gives up on it at its bound.
        assert!(
            tokio::time::timeout(Duration::from_secs(1), health())
                .await
                .is_err()
        );
        // Then the next one is read, at once.
        let start = tokio::time::Instant::now();
        let answer = health().await.unwrap();
        assert_eq!(answered_by(answer).await, "w2");
        assert_eq!(tokio::time::Instant::now(), start);
        // One millisecond before the pass-over ends, still the next one; at its end, the first
        // again.
        tokio::time::advance(Duration::from_millis(29_999)).await;
        let answer = health().await.unwrap();
        assert_eq!(answered_by(answer).await, "w2");
        tokio::time::advance(Duration::from_millis(1)).await;
        assert!(
            tokio::time::timeout(Duration::from_secs(1), health())
                .await
                .is_err(),
            "the first capable worker is read again"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_lease_whose_worker_is_disconnected_is_answered_with_no_time_passing() {
        let fleet = Slow {
            fleet: Fleet {
                placement: Mutex::new(Some(placement("w2", "tok_a"))),
                workers: vec![WorkerFacts {
                    connected: false,
                    serves: false,
                    ..worker("w2", &[Platform::Android], true)
                }],
            },
            only: None,
        };
        let link = RelayHostLink::new(Arc::new(fleet), Duration::from_secs(60), clock());
        let start = tokio::time::Instant::now();
        let answer = link
            .forward(
                Request::new(crate::body::empty()),
                Some(&caller("tok_a")),
                Some(&lease()),
            )
            .await
            .unwrap_err();
        assert_eq!(answer, crate::port::holder_away());
        assert_eq!(tokio::time::Instant::now(), start, "no relay was tried");
    }

    #[tokio::test]
    async fn an_indexed_lease_is_recovered_with_its_device_and_away_while_its_worker_is() {
        let l = lease();
        let owner = caller("tok_a");
        let fleet = Fleet {
            placement: Mutex::new(Some(placement("w2", "tok_a"))),
            workers: vec![worker("w2", &[Platform::Android], true)],
        };
        let link = RelayHostLink::new(Arc::new(fleet), Duration::from_secs(60), clock());
        assert_eq!(
            link.recover(&l, &owner),
            Ok(RecoveredLease {
                platform: Platform::Android,
                address: "w2-emulator-5554".into()
            })
        );
        let away = Fleet {
            placement: Mutex::new(Some(placement("w2", "tok_a"))),
            workers: vec![WorkerFacts {
                connected: false,
                serves: false,
                ..worker("w2", &[Platform::Android], true)
            }],
        };
        let link = RelayHostLink::new(Arc::new(away), Duration::from_secs(60), clock());
        assert_eq!(link.recover(&l, &owner), Err(crate::port::holder_away()));
        assert_eq!(
            link.status(StatusScope::Lease {
                lease: &l,
                caller: &owner
            })
            .serving(),
            Err(Refusal::NotAvailable {
                reason: HOLDER_DISCONNECTED.into(),
                retriable: true
            })
        );
    }

    fn caller(principal: &str) -> Caller {
        Caller {
            principal: principal.into(),
            role: Role::Agent,
            credential: "slk_x".into(),
        }
    }

    #[tokio::test]
    async fn the_status_of_a_new_lease_is_the_union_of_the_capable_workers() {
        let fleet = Fleet {
            placement: Mutex::new(None),
            workers: vec![
                WorkerFacts {
                    lease_max_ttl_ms: Some(600_000),
                    ..worker("w1", &[Platform::Ios], true)
                },
                worker("w2", &[Platform::Android], true),
                WorkerFacts {
                    lease_max_ttl_ms: Some(10_000),
                    ..worker("w3", &[Platform::Android], false)
                },
            ],
        };
        let link = RelayHostLink::new(Arc::new(fleet), Duration::from_secs(60), clock());
        let HostStatus::Running(serving) = link.status(StatusScope::NewLease) else {
            panic!("running");
        };
        assert_eq!(
            serving.platforms,
            [Platform::Ios, Platform::Android].into_iter().collect()
        );
        assert_eq!(
            serving.lease_max_ttl_ms,
            Some(300_000),
            "the least ceiling among the capable workers (w3 is not one)"
        );
        let none = RelayHostLink::new(
            Arc::new(Fleet {
                placement: Mutex::new(None),
                workers: vec![worker("w3", &[Platform::Android], false)],
            }),
            Duration::from_secs(60),
            clock(),
        );
        assert_eq!(
            none.status(StatusScope::NewLease),
            HostStatus::unavailable(NO_CAPABLE_WORKER)
        );
    }

    #[tokio::test]
    async fn a_lease_is_relayed_to_its_worker_for_its_owner_only() {
        let fleet = Arc::new(Fleet {
            placement: Mutex::new(Some(placement("w2", "tok_a"))),
            workers: vec![
                worker("w1", &[Platform::Ios], true),
                worker("w2", &[Platform::Android], true),
            ],
        });
        let link = RelayHostLink::new(fleet, Duration::from_secs(60), clock());
        let l = lease();
        let HostStatus::Running(serving) = link.status(StatusScope::Lease {
            lease: &l,
            caller: &caller("tok_a"),
        }) else {
            panic!("running");
        };
        assert_eq!(
            serving.lease_max_ttl_ms,
            Some(300_000),
            "the holder's ceiling"
        );
        let request = || Request::new(crate::body::empty());
        let answer = link
            .forward(request(), Some(&caller("tok_a")), Some(&l))
            .await
            .unwrap();
        let body = crate::body::read_to_bytes(answer.into_body(), 1024)
            .await
            .unwrap();
        assert_eq!(body, "w2 gw.gw1.tok_5f_a");
        let refused = link
            .forward(request(), Some(&caller("tok_b")), Some(&l))
            .await
            .unwrap_err();
        assert_eq!(
            refused,
            Refusal::NotYours {
                lease: l.clone(),
                hosts: Hosts::PerLease
            }
        );
        assert_eq!(
            link.forward(request(), Some(&caller("tok_a")), None)
                .await
                .unwrap_err(),
            Refusal::TooOld
        );
    }
}
