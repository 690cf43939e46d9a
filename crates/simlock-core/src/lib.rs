//! The worker domain: devices and their drivers, leases, the FIFO wait queue, capacity, idle
//! tiers, `device.exec`, the request book and their persistence, and the registration of the
//! worker's operation handlers into the daemon's router.
//!
//! # Layout
//! - [`worker`]: the [`Worker`], the async shell every operation goes through.
//! - [`handlers`]: [`register`] puts the worker's operations into a [`simlock_daemon::Router`].
//! - `state`: every decision, as plain data taking `now` (no I/O); `queue` and `book` beside it.
//! - [`capacity`], [`catalog`]: running limits and what can be leased.
//! - [`driver`]: the [`Driver`] port and the [`VirtualDriver`].
//! - [`store`]: the SQLite tables. [`system`]: CPUs and RAM behind a trait.
//! - [`error`]: [`CoreError`] and its one conversion into contract errors.
//!
//! # Composition
//! ```no_run
//! # use std::sync::Arc;
//! # use simlock_core::{Worker, WorkerParts, register};
//! # use simlock_daemon::{Router, StartupGate};
//! # fn build(parts: WorkerParts, router: &mut Router, gate: StartupGate) {
//! let worker = Worker::new(parts).expect("tables");
//! register(router, &worker, gate.clone());
//! // Inside the runtime, once the pipeline serves (status.get answers "starting" meanwhile):
//! worker.start(&gate).expect("start-up");
//! # }
//! ```
#![warn(missing_docs)]

pub mod book;
pub mod capacity;
pub mod catalog;
pub mod config;
pub mod driver;
pub mod error;
mod exec;
pub mod handlers;
pub mod metrics;
mod queue;
mod state;
pub mod store;
pub mod system;
pub mod worker;

pub use book::{RecordState, RequestRecord};
pub use config::CoreConfig;
pub use driver::{
    Adopted, Driver, DriverError, Estimates, Keep, Observation, RunState, VirtualDriver,
    virtual_drivers,
};
pub use error::CoreError;
pub use handlers::register;
pub use metrics::register_metrics;
pub use system::{FixedSystem, HostSystem, SystemFacts};
pub use worker::{LEASE_END_BOUND, LeaseEndHook, Worker, WorkerParts};

#[cfg(test)]
mod tests;
