//! The worker half of the relay: relay targets and `relay.request` / `relay.cancel`.
//!
//! A gateway hands one HTTP exchange to a module on a worker over the worker's uplink. The
//! module is a [`RelayTarget`], registered by capability name in a [`RelayTargets`] registry that
//! the composition builds; [`register`] puts the two operations on the worker's router.
//!
//! The bodies travel on a link channel the gateway opened and named in `relay.request`: the
//! request body is the channel's request direction, pulled as the target reads it
//! ([`RequestBody`]); the response body is piped into the response direction after the
//! `relay-head` push, then END, then the `{}` answer. Every failure aborts the channel.
//!
//! | channel failure | the relay on the worker |
//! |---|---|
//! | `closed` (the uplink is gone) | the target's cancellation fires |
//! | `stalled` | fails `INTERNAL` |
//! | `aborted` by the gateway | the target's cancellation fires; `{cancelled: true}` |
//! | `refused` (a channel never opened or already accepted) | fails `BAD_REQUEST` |
#![warn(missing_docs)]

mod relay;
mod target;

pub use relay::{RESPONSE_QUEUE, register};
pub use target::{
    BoxError, InvalidTargetName, RelayRequest, RelayTarget, RelayTargets, RequestBody,
    ResponseBody, empty_body, full_body, stream_body,
};
