//! The simlock contract: frames, `hello`, the operation table, inputs and outputs with their
//! bounds, pushes and the error table.
//!
//! This crate is the only one that derives serde for simlock's own wire types and the only
//! home of their bounds. Every other crate speaks to peers through these types.
//!
//! # Layout
//! - [`frame`]: call, result, error and push frames, and how a line becomes one.
//! - [`protocol`]: `hello`, protocol ranges and their negotiation, session roles.
//! - [`ops`]: the operation table and every operation's input and output.
//! - [`push`]: the push kinds.
//! - [`event`]: the events daemons record, each one's name, module and payload.
//! - [`model`]: the shapes operations carry (devices, leases, catalogs, views, events).
//! - [`error`]: the closed error table and [`ContractError`].
//! - [`bounds`]: every input bound, declared once.
//! - [`duration`]: durations for people, in messages beside their milliseconds.
//! - [`ids`]: identifier newtypes.
#![warn(missing_docs)]

pub mod bounds;
mod decode;
pub mod duration;
pub mod error;
pub mod event;
pub mod frame;
pub mod http;
pub mod ids;
pub mod model;
pub mod ops;
pub mod protocol;
pub mod push;
mod tagged;

pub use decode::{Input, decode_input, in_json_terms, json_value};
pub use error::{ContractError, ErrorBody, ErrorCode, ErrorKind};
pub use frame::{BadFrame, Call, CallOut, FrameId, PushFrame, RawInbound, Reply};
pub use ops::{OPERATIONS, Operation, OperationSpec};
pub use protocol::{Hello, HelloReply, PROTOCOL_RANGE, ProtocolRange, Role};
pub use push::Push;
