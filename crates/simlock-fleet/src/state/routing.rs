//! Routing: which worker serves a lease request. A policy is an ordered list of stages over the
//! worker views; filters drop workers, ranks score them. Pure functions of the views.
//!
//! `warm-then-free` (the only policy): `takes-requests` → `can-serve` → `has-capabilities` →
//! `healthy` → `idle-queue` → `warm-hit` (rank, settles) → `free-slot` → `free-capacity` (rank).
//! Workers are walked in id order; the pick is the first one left, if a rank decided.

use simlock_contract::model::{
    Connection, Device, DeviceState, Health, Platform, PlatformCatalog, RequestedDevice, WorkerView,
};
use simlock_contract::push::WaitingFor;

/// What a request asks of a worker, resolved against nothing yet.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Wanted {
    /// The platform.
    pub platform: Platform,
    /// A model or alias, as the caller typed it.
    pub model: Option<String>,
    /// An exact OS version.
    pub os_version: Option<String>,
    /// Capabilities the worker must have available.
    pub requires: Vec<String>,
}

impl Wanted {
    /// What a `lease.request` asks for.
    pub fn of(input: &simlock_contract::ops::LeaseRequestInput) -> Self {
        Self {
            platform: input.platform,
            model: input.model.clone(),
            os_version: input.os_version.clone(),
            requires: input.requires.clone(),
        }
    }

    /// The request as the contract shows it (waiting lists, events).
    pub fn requested(&self) -> RequestedDevice {
        RequestedDevice {
            platform: self.platform,
            model: self.model.clone(),
            os_version: self.os_version.clone(),
            requires: self.requires.clone(),
        }
    }
}

/// How a request matches one worker's catalog: the worker's own model name for it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Match {
    /// The worker's name for the model (forwarded to it), when a model was asked for.
    pub model: Option<String>,
}

/// The catalog entry for `platform` in `view`, when its driver can serve (an entry marked
/// unavailable counts as no driver).
fn catalog_of(view: &WorkerView, platform: Platform) -> Option<&PlatformCatalog> {
    view.catalog
        .as_ref()?
        .iter()
        .find(|c| c.platform == platform && c.unavailable.is_none())
}

/// Whether `view`'s catalog can serve `wanted`, and under which model name.
pub fn match_request(view: &WorkerView, wanted: &Wanted) -> Option<Match> {
    let catalog = catalog_of(view, wanted.platform)?;
    let runs = |model: &str| {
        let runtimes = catalog
            .model_runtimes
            .get(model)
            .map(Vec::as_slice)
            .unwrap_or_default();
        match &wanted.os_version {
            Some(os) => runtimes.iter().any(|r| r == os),
            None => !runtimes.is_empty(),
        }
    };
    match &wanted.model {
        Some(requested) => {
            let model = catalog.resolve_model(requested)?;
            runs(model).then(|| Match {
                model: Some(model.to_owned()),
            })
        }
        None => catalog
            .models
            .iter()
            .any(|m| runs(m))
            .then_some(Match { model: None }),
    }
}

/// Whether `view` lists every capability in `requires` as available.
pub fn has_capabilities(view: &WorkerView, requires: &[String]) -> bool {
    requires.iter().all(|name| {
        view.capabilities
            .as_ref()
            .is_some_and(|caps| caps.iter().any(|c| &c.name == name && c.available))
    })
}

/// A worker that can take a new lease requiring a module's capability, with what it serves.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CapableWorker {
    /// Its id.
    pub id: String,
    /// The platforms its catalog serves now.
    pub platforms: std::collections::BTreeSet<Platform>,
    /// Its `lease.maxTtlMs`.
    pub lease_max_ttl_ms: u64,
}

/// Whether `view`'s worker can take a new lease requiring `capability` (the agent-device
/// front's "capable worker"): it takes requests (connected, not drained, capacity and catalog
/// read), lists `capability` as available, and its lease limits were read. A worker whose view
/// lists the capability before its catalog or limits were read does not count yet.
pub fn capable(view: &WorkerView, capability: &str) -> Option<CapableWorker> {
    if !takes_requests(view) || !has_capabilities(view, &[capability.to_owned()]) {
        return None;
    }
    let lease_max_ttl_ms = view.lease.as_ref()?.max_ttl_ms;
    Some(CapableWorker {
        id: view.id.clone(),
        platforms: served_platforms(view),
        lease_max_ttl_ms,
    })
}

/// The platforms `view`'s catalog serves now.
pub fn served_platforms(view: &WorkerView) -> std::collections::BTreeSet<Platform> {
    view.catalog
        .iter()
        .flatten()
        .filter(|c| c.unavailable.is_none())
        .map(|c| c.platform)
        .collect()
}

/// Whether `view`'s worker can serve a lease it already holds that needs `capability`:
/// connected, with `capability` available. A drained worker keeps serving the leases it holds.
pub fn serves_held(view: &WorkerView, capability: &str) -> bool {
    view.connection == Connection::Connected && has_capabilities(view, &[capability.to_owned()])
}

/// What the gateway knows of a worker that holds leases needing a module's capability.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Holder {
    /// Its id.
    pub id: String,
    /// Whether its uplink is up.
    pub connected: bool,
    /// Whether its lease list was read since the gateway started (the greeting's status
    /// carries it, folded into the index with it): until then the index lacks its leases.
    pub leases_known: bool,
    /// Whether it serves the leases it holds ([`serves_held`]).
    pub serves: bool,
    /// The platforms its catalog serves now.
    pub platforms: std::collections::BTreeSet<Platform>,
    /// Its `lease.maxTtlMs`, once read.
    pub lease_max_ttl_ms: Option<u64>,
}

/// `view`'s worker as a holder of leases needing `capability`.
pub fn holder(view: &WorkerView, capability: &str) -> Holder {
    let connected = view.connection == Connection::Connected;
    Holder {
        id: view.id.clone(),
        connected,
        leases_known: connected && view.leases.is_some(),
        serves: serves_held(view, capability),
        platforms: served_platforms(view),
        lease_max_ttl_ms: view.lease.as_ref().map(|l| l.max_ttl_ms),
    }
}

/// Whether the worker takes new requests at all: connected, not drained, not failed (its store
/// did: it decides nothing until it is restarted), and the gateway holds its capacity and its
/// catalog.
pub fn takes_requests(view: &WorkerView) -> bool {
    view.connection == Connection::Connected
        && !view.drained
        && view.health != Some(Health::Failed)
        && view.capacity.is_some()
        && view.catalog_read_at.is_some()
}

/// Whether `device` is one `wanted` (resolved to `matched`) could be granted.
pub fn fits(device: &Device, wanted: &Wanted, matched: &Match) -> bool {
    device.spec.platform == wanted.platform
        && matched
            .model
            .as_ref()
            .is_none_or(|m| &device.spec.model == m)
        && wanted
            .os_version
            .as_ref()
            .is_none_or(|os| &device.spec.os_version == os)
}

/// Running slots free or held by idle devices that could be shut down for this request, as
/// the worker makes room: the platform's own cap frees only by shutting down one of its own idle
/// devices; the worker's cap frees by shutting down any idle device (an idle iPhone makes room
/// for an Android request).
fn free_or_evictable(view: &WorkerView, platform: Platform) -> u32 {
    room(view, platform, |d| d.state == DeviceState::Ready)
}

/// Running slots free for `platform` on `view`, counting as free the running devices `freed`
/// picks, each toward its own platform's cap and the worker's.
fn room(view: &WorkerView, platform: Platform, freed: impl Fn(&Device) -> bool) -> u32 {
    let Some(capacity) = view.capacity else {
        return 0;
    };
    let count = |only: Option<Platform>| {
        let count = view
            .devices
            .as_deref()
            .unwrap_or_default()
            .iter()
            .filter(|d| freed(d) && only.is_none_or(|p| d.spec.platform == p))
            .count();
        u32::try_from(count).unwrap_or(u32::MAX)
    };
    let platform_free = capacity
        .platform(platform)
        .free()
        .saturating_add(count(Some(platform)));
    let global_free = capacity
        .global
        .max_running
        .saturating_sub(capacity.global.running)
        .saturating_sub(capacity.global.reserved)
        .saturating_add(count(None));
    platform_free.min(global_free)
}

/// Why no worker among `views` takes `wanted` now ([`select`] picked none): no worker that
/// could serve it takes requests (`noWorker`: each is away, drained or failed); or, a matter of
/// devices, every worker that could serve it, but those in `excluded` (they refused its spec),
/// has its room full, and quarantined devices (a wipe that failed) hold some of that room
/// (`quarantine`, with the earliest retry), or none do (`capacity`). `None` when one has room,
/// or only excluded ones take requests (it waits for another reason: a worker's own queue, a
/// refusal).
pub fn waiting_for(
    views: &[&WorkerView],
    excluded: &std::collections::BTreeSet<String>,
    wanted: &Wanted,
) -> Option<WaitingFor> {
    let mut servers: Vec<&WorkerView> = views
        .iter()
        .copied()
        .filter(|v| takes_requests(v))
        .filter(|v| match_request(v, wanted).is_some())
        .filter(|v| has_capabilities(v, &wanted.requires))
        .collect();
    if servers.is_empty() {
        return Some(WaitingFor::NoWorker);
    }
    servers.retain(|v| !excluded.contains(&v.id));
    if servers.is_empty()
        || servers
            .iter()
            .any(|v| free_or_evictable(v, wanted.platform) > 0)
    {
        return None;
    }
    let mut retry_at: Option<i64> = None;
    for view in servers {
        // Its room with its quarantined devices gone: those of the platform first, else any
        // (the worker's own cap); the earliest retry among those that would make it.
        let devices = view.devices.as_deref().unwrap_or_default();
        for only in [Some(wanted.platform), None] {
            let quarantined = |d: &Device| {
                d.state == DeviceState::Quarantined && only.is_none_or(|p| d.spec.platform == p)
            };
            let opens = room(view, wanted.platform, |d| {
                d.state == DeviceState::Ready || quarantined(d)
            }) > 0;
            let earliest = devices
                .iter()
                .filter(|d| quarantined(d))
                .filter_map(|d| d.quarantine_next_retry_at)
                .min();
            if let (true, Some(at)) = (opens, earliest) {
                retry_at = Some(retry_at.map_or(at, |r| r.min(at)));
                break;
            }
        }
    }
    Some(
        retry_at.map_or(WaitingFor::Capacity, |retry_at| WaitingFor::Quarantine {
            retry_at,
        }),
    )
}

/// Why a worker was picked.
pub use simlock_contract::event::DispatchReason as Reason;
/// The stage that decided a pick.
pub use simlock_contract::event::DispatchStage as Stage;

/// The routing decision.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Pick {
    /// The worker.
    pub worker_id: String,
    /// Its name for the model.
    pub matched: Match,
    /// Why.
    pub reason: Reason,
    /// The stage that decided.
    pub stage: Stage,
}

/// Picks a worker among `views` (already stripped of the ones this request may not try) for
/// `wanted`, or none.
pub fn select(views: &[&WorkerView], wanted: &Wanted) -> Option<Pick> {
    let mut candidates: Vec<(&WorkerView, Match)> = views
        .iter()
        .copied()
        .filter(|v| takes_requests(v))
        .filter_map(|v| match_request(v, wanted).map(|m| (v, m)))
        .filter(|(v, _)| has_capabilities(v, &wanted.requires))
        .filter(|(v, _)| v.health == Some(Health::Running))
        .filter(|(v, _)| v.queue_depth.unwrap_or(0) == 0)
        .collect();
    candidates.sort_by(|a, b| a.0.id.cmp(&b.0.id));

    // warm-hit: a ready device that fits settles the walk.
    let warm: Vec<_> = candidates
        .iter()
        .filter(|(v, m)| {
            v.devices
                .as_deref()
                .unwrap_or_default()
                .iter()
                .any(|d| d.state == DeviceState::Ready && fits(d, wanted, m))
        })
        .collect();
    if let Some((view, matched)) = warm.first() {
        return Some(Pick {
            worker_id: view.id.clone(),
            matched: matched.clone(),
            reason: Reason::WarmHit,
            stage: Stage::WarmHit,
        });
    }

    // free-slot, then free-capacity: the most free slots for the platform wins.
    candidates.retain(|(v, _)| free_or_evictable(v, wanted.platform) > 0);
    let best = candidates
        .iter()
        .map(|(v, _)| v.capacity.map_or(0, |c| c.platform(wanted.platform).free()))
        .max()?;
    if best == 0 {
        // Only evictable slots are left: any of them, in id order.
        let (view, matched) = candidates.first()?;
        return Some(Pick {
            worker_id: view.id.clone(),
            matched: matched.clone(),
            reason: Reason::FreeCapacity,
            stage: Stage::FreeSlot,
        });
    }
    let (view, matched) = candidates.into_iter().find(|(v, _)| {
        v.capacity
            .is_some_and(|c| c.platform(wanted.platform).free() == best)
    })?;
    Some(Pick {
        worker_id: view.id.clone(),
        matched,
        reason: Reason::FreeCapacity,
        stage: Stage::FreeCapacity,
    })
}

/// Why no worker can take a request, before it is queued.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Assessment {
    /// Some worker could serve it now or later: route or wait.
    Serviceable,
    /// No worker takes requests at all, or none that takes requests can serve it.
    NoWorker,
    /// No known worker has the platform.
    NoDriver,
    /// No known worker lists the model.
    UnknownModel,
    /// No known worker runs the model on that OS version.
    RuntimeMissing,
    /// No known worker that can serve the spec has this capability available.
    CapabilityMissing(String),
}

/// The fast-fail table, in order; "known" workers are the ones not `incompatible`.
pub fn assess(views: &[&WorkerView], wanted: &Wanted) -> Assessment {
    let known: Vec<&WorkerView> = views
        .iter()
        .copied()
        .filter(|v| v.connection != Connection::Incompatible)
        .collect();
    if !views.iter().any(|v| takes_requests(v)) {
        return Assessment::NoWorker;
    }
    let with_platform: Vec<_> = known
        .iter()
        .filter(|v| catalog_of(v, wanted.platform).is_some())
        .collect();
    if with_platform.is_empty() {
        return Assessment::NoDriver;
    }
    if let Some(model) = &wanted.model
        && !with_platform.iter().any(|v| {
            catalog_of(v, wanted.platform).is_some_and(|c| c.resolve_model(model).is_some())
        })
    {
        return Assessment::UnknownModel;
    }
    let serving: Vec<&&&WorkerView> = with_platform
        .iter()
        .filter(|v| match_request(v, wanted).is_some())
        .collect();
    if serving.is_empty() {
        return Assessment::RuntimeMissing;
    }
    if let Some(missing) = wanted.requires.iter().find(|cap| {
        !serving
            .iter()
            .any(|v| has_capabilities(v, std::slice::from_ref(cap)))
    }) {
        return Assessment::CapabilityMissing(missing.clone());
    }
    let able_now = serving
        .iter()
        .any(|v| takes_requests(v) && has_capabilities(v, &wanted.requires));
    if able_now {
        Assessment::Serviceable
    } else {
        Assessment::NoWorker
    }
}

#[cfg(test)]
mod tests;
