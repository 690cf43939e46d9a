//! What simlock's tests share, so that each fake is written once.
//!
//! - [`fake_daemon`]: an in-process daemon with canned handlers, for the client's and the CLI's
//!   tests (the real pipeline, socket and HTTP hosts; scripted lease requests, cancels and exec).
//! - [`fake_worker`]: the pieces every hand-written fake worker needs: how it greets the gateway,
//!   how it dials the gateway's uplink and serves its `Service` there, and the bookkeeping answers
//!   (status, lists, catalog, config, events) a gateway asks every worker for.
//! - [`markdown`]: the docs, read for the tests that hold them to the code.
//! - [`raw_http`]: HTTP/1.1 by hand over a raw socket.
//!
//! Only tests depend on this crate.
#![warn(missing_docs)]

pub mod fake_daemon;
pub mod fake_worker;
pub mod markdown;
pub mod raw_http;
