//! NDJSON framing, the server [`Session`](session) and the [`WireClient`] that speak the
//! simlock contract over a unix socket or over the uplink's text lane.
//!
//! # Layout
//! - [`codec`]: lines with a cap; an oversized line is dropped as it arrives.
//! - [`transport`]: lines in and out over a byte stream or over text messages.
//! - [`session`]: one server connection: `hello`, concurrent calls, pushes with backpressure.
//! - [`client`]: calls by id, per-call pushes, connection loss fails every pending call.
#![warn(missing_docs)]

pub mod client;
pub mod codec;
pub mod session;
pub mod transport;

pub use client::{
    CallEvent, CallHandle, RawReply, Unsolicited, WireClient, decode_output, decode_raw,
    decode_value,
};
pub use codec::{Line, LineCodec};
pub use session::{
    CallContext, Closed, Connection, HELLO_TIMEOUT, Identity, Origin, Service, SessionConfig,
    serve, serve_attached,
};
pub use transport::Transport;
