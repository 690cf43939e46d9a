//! Following a daemon's events as they happen: `events.subscribe` and its `event` pushes on a
//! wire connection, `GET /v1/events/stream` over HTTP.

use std::sync::Arc;

use serde_json::Value;
use simlock_contract::ContractError;
use simlock_contract::model::EventEnvelope;
use tokio::sync::broadcast;

use crate::client::{Backend, Client, timed_out};
use crate::sse::SseStream;
use crate::wire::WireBackend;

/// What a follow yields.
#[derive(Debug, Clone, PartialEq)]
pub enum FollowItem {
    /// An event.
    Event(EventEnvelope),
    /// The reader fell behind and `missed` events were dropped.
    Lagged {
        /// How many.
        missed: u64,
    },
}

/// Events as they happen. Dropping it stops following.
#[derive(Debug)]
pub struct EventFollow {
    inner: Inner,
}

#[derive(Debug)]
enum Inner {
    Wire {
        backend: Arc<WireBackend>,
        rx: broadcast::Receiver<EventEnvelope>,
    },
    Http(SseStream),
}

impl EventFollow {
    pub(crate) async fn start(client: &Client) -> Result<Self, ContractError> {
        let inner = match &client.backend {
            Backend::Wire(wire) => Inner::Wire {
                backend: wire.clone(),
                rx: wire.follow_events().await?,
            },
            Backend::Http(http) => {
                let bound = client.options.call_timeout;
                let stream = tokio::time::timeout(
                    bound,
                    http.open_stream(http::Method::GET, "/v1/events/stream", None),
                )
                .await
                .unwrap_or_else(|_| Err(timed_out("GET /v1/events/stream", bound)))?;
                Inner::Http(stream)
            }
        };
        Ok(Self { inner })
    }

    /// The next event; `None` when the stream ended. `Some(Err(DAEMON_CONNECTION_LOST))` when
    /// the connection is gone.
    pub async fn next(&mut self) -> Option<Result<FollowItem, ContractError>> {
        match &mut self.inner {
            Inner::Wire { backend, rx } => {
                let received = tokio::select! {
                    received = rx.recv() => received,
                    () = backend.closed() => return Some(Err(ContractError::connection_lost())),
                };
                match received {
                    Ok(event) => Some(Ok(FollowItem::Event(event))),
                    Err(broadcast::error::RecvError::Lagged(missed)) => {
                        Some(Ok(FollowItem::Lagged { missed }))
                    }
                    Err(broadcast::error::RecvError::Closed) => None,
                }
            }
            Inner::Http(stream) => loop {
                let event = match stream.next().await? {
                    Ok(event) => event,
                    Err(e) => return Some(Err(e)),
                };
                let item = match event.event.as_str() {
                    "event" => event.json().and_then(|data| {
                        serde_json::from_value::<EventEnvelope>(data)
                            .map(FollowItem::Event)
                            .map_err(|e| ContractError::internal(format!("invalid event: {e}")))
                    }),
                    "lagged" => event.json().map(|data| FollowItem::Lagged {
                        missed: data.get("missed").and_then(Value::as_u64).unwrap_or(0),
                    }),
                    _ => continue,
                };
                return Some(item);
            },
        }
    }
}

impl Drop for EventFollow {
    fn drop(&mut self) {
        let Inner::Wire { backend, .. } = &self.inner else {
            return;
        };
        // Without a runtime the count stays up and the connection stays subscribed: a later
        // follower then finds the subscription in place.
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            let backend = backend.clone();
            runtime.spawn(async move { backend.unfollow_events().await });
        }
    }
}
