//! The `HostLink` port: how the front reaches an agent-device host. On a worker the in-process
//! link hands requests to the worker's own host; on a gateway the relay host link places each
//! lease on its worker and relays there.

use std::collections::BTreeSet;

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
        /// Whether trying again soon may work (the lease's worker is only away).
        retriable: bool,
    },
}

impl HostStatus {
    /// Unavailable for `reason`, worth trying again later.
    pub fn unavailable(reason: impl Into<String>) -> Self {
        Self::Unavailable {
            reason: reason.into(),
            retriable: true,
        }
    }
}

/// What a running host serves.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Serving {
    /// The platforms its devices have.
    pub platforms: BTreeSet<Platform>,
    /// The `lease.maxTtlMs` of the daemon holding the lease; given only for a status read
    /// with a lease id.
    pub lease_max_ttl_ms: Option<u64>,
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

    /// Capabilities the front's lease requests must require (`agent-device` through a
    /// gateway, none on a worker).
    fn lease_requires(&self) -> Vec<String>;

    /// Whether the front reads the lease header and fans `devices` out per lease (through a
    /// gateway only).
    fn reads_lease_header(&self) -> bool;
}
