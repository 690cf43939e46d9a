//! The daemon runtime shared by the worker and the gateway: the one dispatch pipeline, the
//! socket and HTTP hosts, authentication, the event bus, tokens and the state store.
//!
//! # Layout
//! - [`pipeline`]: the [`pipeline::Router`] of handlers and the [`pipeline::Pipeline`]
//!   every call runs through, with the start-up gate.
//! - [`context`]: what a handler knows about its call.
//! - [`presence`]: live connections by principal, for lease-scoped pushes.
//! - [`events`], [`tokens`], [`auth`]: the event bus, the token store, sessions and bearers.
//! - [`store`], [`home`], [`config`], [`clock`]: state, files, configuration and time.
//! - [`socket`]: the unix socket host.

pub mod accept;
pub mod auth;
pub mod capabilities;
pub mod clock;
pub mod config;
pub mod context;
pub mod events;
pub mod home;
pub mod host;
pub mod http;
pub mod launch;
pub mod logging;
pub mod metrics;
pub mod pipeline;
pub mod presence;
pub mod processes;
pub mod runtime;
pub mod signals;
pub mod socket;
pub mod store;
pub mod tokens;
pub mod uplink;

pub use capabilities::Capabilities;
pub use clock::{Clock, SharedClock, TokioClock};
pub use context::{CallCtx, CallOrigin, Viewer};
pub use events::EventBus;
pub use pipeline::{Pipeline, Router, Shutdown, StartupGate};
pub use presence::Presence;
pub use store::Database;
pub use tokens::TokenStore;
