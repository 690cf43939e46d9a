//! The `HostLink` port: how the front reaches an agent-device host. On a worker the in-process
//! link hands requests to the worker's own host; on a gateway the relay host link places each
//! lease on its worker and relays there.

use std::collections::BTreeSet;
use std::time::Duration;

use futures::future::BoxFuture;
use http::{Request, Response};
use simlock_contract::Role;
use simlock_contract::model::Platform;

use crate::Body;
use crate::lease_id::LeaseId;
use crate::reply::Refusal;

/// The caller of one request, as simlock authenticated it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Caller {
    /// The token's principal (its id): the owner of the leases it makes.
    pub principal: String,
    /// The session role the token grants.
    pub role: Role,
    /// The simlock token the caller presented, put into upload tickets so the CLI's PUT is
    /// authenticated as the caller. Never sent to a host.
    pub credential: String,
}

/// Whether a host can serve, and what.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum HostStatus {
    /// It serves.
    Running(Serving),
    /// It does not, and why.
    Unavailable {
        /// A sentence for the agent.
        reason: String,
        /// Whether trying again soon may work.
        retriable: bool,
    },
    /// The worker holding the lease is disconnected, or has not reported its leases since the
    /// gateway started: the lease is not ended, and a retry may reach it.
    HolderAway,
}

/// Why a lease cannot be reached while its worker is away. Retriable, and never an answer on
/// which the CLI allocates again: the lease is not ended, and no other lease replaces it.
pub const HOLDER_DISCONNECTED: &str = "the worker holding this lease is disconnected; retry";

impl HostStatus {
    /// Unavailable for `reason`, worth trying again later.
    pub fn unavailable(reason: impl Into<String>) -> Self {
        Self::Unavailable {
            reason: reason.into(),
            retriable: true,
        }
    }

    /// What the host serves.
    ///
    /// # Errors
    /// The refusal the front answers when it serves nothing.
    pub fn serving(self) -> Result<Serving, Refusal> {
        match self {
            Self::Running(serving) => Ok(serving),
            Self::Unavailable { reason, retriable } => {
                Err(Refusal::NotAvailable { reason, retriable })
            }
            Self::HolderAway => Err(holder_away()),
        }
    }
}

/// The refusal while the worker holding a lease is away.
pub(crate) fn holder_away() -> Refusal {
    Refusal::NotAvailable {
        reason: HOLDER_DISCONNECTED.into(),
        retriable: true,
    }
}

/// What a running host serves.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Serving {
    /// The platforms its devices have; what a new lease may ask for (a link may leave it empty
    /// for a status read with a lease id, which needs only the ceiling).
    pub platforms: BTreeSet<Platform>,
    /// The `lease.maxTtlMs` of the daemon holding the lease, for a status read with a lease
    /// id; for a new lease through a gateway, the least among the workers that could take it
    /// (a lease request every one of them accepts). `None`: this daemon's own bound is the
    /// only one.
    pub lease_max_ttl_ms: Option<u64>,
}

/// A lease the front has no memory of (it was made by an earlier run of this gateway), as the
/// host link knows it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RecoveredLease {
    /// The leased device's platform.
    pub platform: Platform,
    /// How agent-device names the device.
    pub address: String,
}

/// Which status the front reads.
#[derive(Debug, Clone, Copy)]
pub enum StatusScope<'a> {
    /// The status for a new lease (and `/health`).
    NewLease,
    /// The status of the host holding `lease`, for `caller`.
    Lease {
        /// The lease.
        lease: &'a LeaseId,
        /// Who asks.
        caller: &'a Caller,
    },
}

/// How the front reaches agent-device.
pub trait HostLink: Send + Sync + 'static {
    /// The status of a host for `scope`.
    fn status(&self, scope: StatusScope<'_>) -> HostStatus;

    /// Hands one request (absolute URI as the caller sent it, under `/v1/agent-device`) to the
    /// host holding `lease`, or to any host when `lease` is `None`. `caller` is `None` for
    /// `/health` alone, which needs no token.
    ///
    /// # Errors
    /// A [`Refusal`] the front answers instead: the lease is not the caller's, the host is
    /// unavailable, the relay failed.
    fn forward(
        &self,
        request: Request<Body>,
        caller: Option<&Caller>,
        lease: Option<&LeaseId>,
    ) -> BoxFuture<'static, Result<Response<Body>, Refusal>>;

    /// The device of `caller`'s `lease`, which the front has no memory of.
    ///
    /// # Errors
    /// The answer instead: not the caller's lease (the default, on a worker, where the front's
    /// memory is the truth), its holder away, or the lease ended.
    fn recover(&self, lease: &LeaseId, caller: &Caller) -> Result<RecoveredLease, Refusal> {
        let _ = caller;
        Err(Refusal::NotYours {
            lease: lease.clone(),
            hosts: Hosts::One,
        })
    }

    /// The leases the link places for `caller` and has not seen end, in id order (none on a
    /// worker).
    fn held(&self, caller: &Caller) -> Vec<LeaseId> {
        let _ = caller;
        Vec::new()
    }

    /// Capabilities the front's lease requests must require (`agent-device` through a
    /// gateway, none on a worker).
    fn lease_requires(&self) -> Vec<String>;

    /// Where the link's leases are held: by its one host, or each by its own.
    fn hosts(&self) -> Hosts;

    /// Keeps the release of `lease` that the front carries out once its holder is back, for
    /// `within` (the lease's TTL), so a restart of this daemon resumes it
    /// ([`Self::kept_releases`]). Answers whether it is kept (false: a full disk, or no
    /// placement to keep it with). Nothing needs keeping by default: a worker's own host is
    /// never away.
    fn keep_release(&self, lease: &LeaseId, within: Duration) -> bool {
        let _ = (lease, within);
        true
    }

    /// The release of `lease` kept was carried out, found nothing to release, or ran out of
    /// time.
    fn release_settled(&self, lease: &LeaseId) {
        let _ = lease;
    }

    /// The releases an earlier run kept and did not settle, still within their time.
    fn kept_releases(&self) -> Vec<KeptRelease> {
        Vec::new()
    }
}

/// A release an earlier run of the daemon answered and had not carried out
/// ([`HostLink::kept_releases`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KeptRelease {
    /// The lease.
    pub lease: LeaseId,
    /// Its owner (the token's principal that asked for the release).
    pub owner: String,
    /// The time left of the lease's TTL, past which the worker ends it itself.
    pub within: Duration,
}

/// Where a host link's leases are held, which decides how the front routes and whose word on
/// a lease counts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Hosts {
    /// One host holds them all (a worker's own daemon): the front's memory says whose a lease
    /// is, and requests go to that host whatever lease they name.
    One,
    /// Each lease is on the host that holds it (the relay host link, through a gateway): the
    /// lease header routes uploads, artifacts and diagnostics, `devices` asks every holder,
    /// and the link answers for leases the front does not remember.
    PerLease,
}

impl Hosts {
    /// Whether the front reads the lease header (`x-agent-device-lease-id`).
    pub const fn reads_lease_header(self) -> bool {
        matches!(self, Self::PerLease)
    }
}
