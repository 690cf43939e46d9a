//! Byte channels with per-direction credit multiplexed over one WebSocket: a sans-IO core and a
//! thin tokio driver.
//!
//! A gateway and a worker share one WebSocket uplink. Text messages on it are wire frames (the
//! priority lane); binary messages are link frames that carry byte channels. The gateway end
//! opens channels ([`LinkHandle::open_channel`]), the worker end accepts them by id
//! ([`LinkHandle::accept_channel`]). Each channel has two directions, each with its own credit,
//! so a slow reader slows only itself and small calls never queue behind bulk bodies.
//!
//! - [`proto`] is the sans-IO core: a deterministic state machine fed with frames, commands and
//!   `now`, yielding frames, events and deadlines. It imports no tokio and reads no clock.
//! - The driver ([`spawn`]) is one tokio task that owns the socket and the timer.
//! - [`Channel`], [`ChannelReader`] and [`ChannelWriter`] are the application's ends:
//!   `AsyncRead`/`AsyncWrite` and `Stream`/`Sink` of [`bytes::Bytes`].
//!
//! Every failure is one [`FailureReason`] (`stopped | aborted | closed | stalled | refused`) in
//! one [`ChannelError`]. The frame encoding, the channel state machine, the credit rules and the
//! closing handshake are documented in `docs/LINK.md`.
//!
//! ```no_run
//! # async fn example(
//! #     gateway_ws: tokio_tungstenite::WebSocketStream<tokio::net::TcpStream>,
//! #     worker_ws: tokio_tungstenite::WebSocketStream<tokio::net::TcpStream>,
//! # ) -> Result<(), Box<dyn std::error::Error>> {
//! use futures::StreamExt;
//! use simlock_link::{End, LinkConfig, spawn};
//! use tokio::io::{AsyncReadExt, AsyncWriteExt};
//! use tokio_util::sync::CancellationToken;
//!
//! // Each end wraps its side of the uplink (built with `websocket_config()`).
//! let (gateway, _gateway_text) = spawn(gateway_ws, LinkConfig::new(End::Gateway));
//! let (worker, mut worker_text) = spawn(worker_ws, LinkConfig::new(End::Worker));
//!
//! // The gateway opens a channel (waiting while 64 are open) and names it on the text lane.
//! let channel = gateway.open_channel(&CancellationToken::new()).await?;
//! gateway.send_text(format!(r#"{{"channel":"{}"}}"#, channel.id())).await?;
//! let (mut response, mut request) = channel.into_split();
//! request.write_all(b"request body").await?;
//! request.shutdown().await?; // END
//!
//! // The worker reads the line, accepts the channel by id, and answers.
//! let _line = worker_text.next().await;
//! let accepted = worker.accept_channel("c0")?;
//! let (mut body, mut answer) = accepted.into_split();
//! let mut request_body = Vec::new();
//! body.read_to_end(&mut request_body).await?;
//! answer.write_all(b"response body").await?;
//! answer.shutdown().await?;
//!
//! let mut response_body = Vec::new();
//! response.read_to_end(&mut response_body).await?;
//! # Ok(())
//! # }
//! ```
#![warn(missing_docs)]

mod channel;
pub mod config;
mod driver;
mod error;
mod handle;
pub mod proto;
mod shared;
mod socket;

#[cfg(test)]
mod tests;

pub use channel::{Channel, ChannelReader, ChannelWriter};
pub use config::{End, LinkConfig};
pub use driver::{WS_MAX_MESSAGE, WS_WRITE_BUFFER, spawn, spawn_tuned, websocket_config};
pub use error::{ChannelError, CloseReason, FailureReason, LinkError};
pub use handle::{LinkHandle, TextReceiver};
pub use proto::{LinkStats, frame::ChannelId};
pub use socket::{
    MAX_RECEIVE_BUFFER, MIN_RECEIVE_BUFFER, NOTSENT_LOWAT, RECEIVE_RATE, ReceiveBuffer,
    receive_buffer_ceiling, receive_buffer_for, tune_tcp,
};
