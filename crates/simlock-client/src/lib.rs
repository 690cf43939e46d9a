//! A typed async client for simlock daemons: over the local unix socket, over HTTP with a bearer
//! token, or over an already-open wire [`Transport`](simlock_wire::Transport) (a gateway driving a
//! worker over its uplink).
//!
//! One [`Client`] hides the transport. Its methods take and return the contract's types
//! ([`simlock_contract::ops`], [`simlock_contract::model`]) and fail with a
//! [`ContractError`] whose code comes from the contract's closed
//! table; a code this build does not know arrives as `UNKNOWN_DAEMON_ERROR`.
//!
//! # Layout
//! - [`client`]: [`Client`], its constructors and the typed operations.
//! - [`request`]: a lease request in flight: progress, outcome, and abort (`lease.cancel`).
//! - [`hold`]: [`LeaseHold`], which keeps a granted lease alive and says when it is lost.
//! - [`exec`]: `device.exec` output as it arrives.
//! - [`events`]: following the daemon's events.
//! - [`notices`]: lease-scoped pushes (`lease-lost`, `device-unhealthy`, `device-recovered`).
//! - [`guide`]: how to use the client (`docs/CLIENT.md`).
//!
//! Every wait on a daemon is bounded (plain calls by [`ConnectOptions::call_timeout`], streams by
//! an idle limit) or cancellable (lease requests take an abort future; streams stop when dropped).
#![warn(missing_docs)]

pub mod client;
pub mod events;
pub mod exec;
pub mod hold;
mod http;
pub mod notices;
pub mod request;
mod sse;
mod wire;

#[cfg(test)]
mod tests;

#[doc = include_str!("../../../docs/CLIENT.md")]
pub mod guide {}

pub use client::{Client, ConnectOptions};
pub use events::{EventFollow, FollowItem};
pub use exec::{ExecEvent, ExecStream};
pub use hold::{HoldEnd, LeaseHold, LeaseLost, Renewal};
pub use notices::{LeaseNotice, LeaseNotices};
pub use request::{PendingLease, RequestEvent};
pub use simlock_contract::{ContractError, ErrorCode};
