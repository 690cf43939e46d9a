//! The `/v1/agent-device` edge: the front agents talk to, over a [`HostLink`] port.
//!
//! Callstack's agent-device CLI, pointed at a simlock daemon, speaks its own JSON-RPC and a few
//! HTTP routes. The [`Front`] serves them behind simlock's bearer auth: it makes a simlock lease
//! for every agent-device lease, pins commands to the leased device and keeps the two leases
//! together. It reaches agent-device only through a [`HostLink`]: in-process on a worker, over
//! the relay through a gateway. It imports nothing of the worker's or the fleet's domain.

pub mod body;
pub mod config;
mod front;
pub mod lease_id;
pub mod leases;
pub mod placements;
pub mod port;
pub mod relay_link;
pub mod renewal;
pub mod reply;
pub mod rpc;
pub mod tenant;

pub use body::{Body, BoxError};
pub use config::AgentDeviceConfig;
pub use front::{
    AGENT_DEVICE_MAX_TTL_MS, Front, FrontOptions, MAX_PREFLIGHT_BODY, STOP_BOUND, STOPPING,
    made_by_a_front, made_by_front,
};
pub use lease_id::{LEASE_HEADER, LeaseId};
pub use port::{
    Caller, HostLink, HostStatus, Hosts, KeptRelease, RecoveredLease, Serving, StatusScope,
};
pub use relay_link::{FleetPort, RelayHostLink};
pub use reply::{Refusal, Surface};
pub use tenant::Tenant;

/// Where the front is mounted; a host strips it to reach agent-device's own routes.
pub const PREFIX: &str = "/v1/agent-device";

/// The capability a worker reports while its agent-device daemon runs, and that a lease
/// request through a gateway requires.
pub const CAPABILITY: &str = "agent-device";
