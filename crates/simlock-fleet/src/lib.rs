//! The gateway domain: worker links and views, the lease index, the fleet queue and routing.
#![warn(missing_docs)]

pub mod aggregate;
pub mod coordinator;
pub mod fleet;
mod forward;
pub mod handlers;
pub mod index;
mod link;
pub mod metrics;
mod queue;
pub mod routing;
pub mod uplink;

pub use fleet::{Fleet, FleetParts, FleetTiming, WorkerConn};
