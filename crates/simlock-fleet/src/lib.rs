//! The gateway domain: worker links and views, the lease index, the fleet queue and routing.
//!
//! # Layout
//! - [`state`]: the fleet core, every decision as plain data taking `now` (views and
//!   connectivity, drains, the lease index, the fleet queue, routing and the fast-fail table);
//!   its seeded simulation lives beside it.
//! - [`fleet`]: the async shell that applies the core's decisions under one lock and carries out
//!   their effects; `link`, `requests` and `leases` are its calls to workers and from callers.
//! - [`error`]: the fleet's one error type and its one mapping to contract codes.
//! - [`aggregate`], [`handlers`], [`uplink`], [`metrics`]: what the gateway serves.
#![warn(missing_docs)]

pub mod aggregate;
pub mod config;
pub mod error;
pub mod fleet;
pub mod handlers;
mod leases;
mod link;
pub mod metrics;
mod requests;
pub mod state;
pub mod uplink;

pub use config::{FleetConfig, RoutingPolicy};
pub use error::FleetError;
pub use fleet::{Fleet, FleetParts, FleetTiming, WorkerConn};
/// Routing: which worker serves a lease request (pure functions of the views).
pub use state::routing;
