//! Lease-scoped pushes: the daemon tells a lease's owner that the lease ended
//! (`lease-lost`), that its device crashed (`device-unhealthy`) or recovered (`device-recovered`).

use std::sync::Arc;

use simlock_contract::frame::PushFrame;
use simlock_contract::ids::DeviceId;
use simlock_contract::model::LeaseEndReason;
use simlock_contract::push::UnhealthyReason;
use simlock_contract::{ContractError, Push};
use tokio::sync::broadcast;

use crate::client::{Backend, Client, timed_out};
use crate::http::segment;
use crate::sse::{SseEvent, SseStream};
use crate::wire::WireBackend;

/// A lease-scoped push.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LeaseNotice {
    /// The lease ended without its holder releasing it.
    Lost {
        /// The lease.
        lease_id: String,
        /// Its device.
        device_id: DeviceId,
        /// Why it ended.
        reason: LeaseEndReason,
    },
    /// The leased device crashed; the daemon is recovering it under the same lease.
    Unhealthy {
        /// The lease.
        lease_id: String,
        /// Its device.
        device_id: DeviceId,
        /// Why.
        reason: UnhealthyReason,
    },
    /// The leased device recovered.
    Recovered {
        /// The lease.
        lease_id: String,
        /// Its device.
        device_id: DeviceId,
        /// How many attempts it took.
        attempts: u32,
    },
}

impl LeaseNotice {
    /// The lease the notice is about.
    pub fn lease_id(&self) -> &str {
        match self {
            Self::Lost { lease_id, .. }
            | Self::Unhealthy { lease_id, .. }
            | Self::Recovered { lease_id, .. } => lease_id,
        }
    }

    /// The notice a lease-scoped push carries; `None` for other pushes.
    pub fn from_push(push: Push) -> Option<Self> {
        match push {
            Push::LeaseLost {
                lease_id,
                device_id,
                reason,
            } => Some(Self::Lost {
                lease_id,
                device_id,
                reason,
            }),
            Push::DeviceUnhealthy {
                lease_id,
                device_id,
                reason,
            } => Some(Self::Unhealthy {
                lease_id,
                device_id,
                reason,
            }),
            Push::DeviceRecovered {
                lease_id,
                device_id,
                attempts,
            } => Some(Self::Recovered {
                lease_id,
                device_id,
                attempts,
            }),
            Push::Progress { .. }
            | Push::Started { .. }
            | Push::Output { .. }
            | Push::Event { .. }
            | Push::RelayHead { .. } => None,
        }
    }

    /// The push that carries the notice (its wire form: [`Push::kind`] and [`Push::payload`]).
    pub fn into_push(self) -> Push {
        match self {
            Self::Lost {
                lease_id,
                device_id,
                reason,
            } => Push::LeaseLost {
                lease_id,
                device_id,
                reason,
            },
            Self::Unhealthy {
                lease_id,
                device_id,
                reason,
            } => Push::DeviceUnhealthy {
                lease_id,
                device_id,
                reason,
            },
            Self::Recovered {
                lease_id,
                device_id,
                attempts,
            } => Push::DeviceRecovered {
                lease_id,
                device_id,
                attempts,
            },
        }
    }

    /// The notice an HTTP lease event carries: the event is named by the push's kind and its
    /// data is the push's payload. `None` for any other event.
    fn from_sse(event: &SseEvent) -> Result<Option<Self>, ContractError> {
        if !matches!(
            event.event.as_str(),
            "lease-lost" | "device-unhealthy" | "device-recovered"
        ) {
            return Ok(None);
        }
        let push = Push::from_frame(PushFrame {
            push: event.event.clone(),
            payload: event.json()?,
        })
        .map_err(ContractError::internal)?;
        Ok(Self::from_push(push))
    }
}

/// The notices of one lease, as they arrive. Ends after `lease-lost`.
#[derive(Debug)]
pub struct LeaseNotices {
    lease_id: String,
    inner: Inner,
    done: bool,
}

#[derive(Debug)]
enum Inner {
    Wire {
        backend: Arc<WireBackend>,
        rx: broadcast::Receiver<LeaseNotice>,
        /// A `lease-lost` that came before this stream opened.
        early_loss: Option<LeaseNotice>,
    },
    Http(SseStream),
}

impl LeaseNotices {
    pub(crate) async fn open(client: &Client, lease_id: &str) -> Result<Self, ContractError> {
        let http = match &client.backend {
            Backend::Wire(wire) => return Ok(Self::wire(wire, lease_id)),
            Backend::Http(http) => http,
        };
        let path = format!("/v1/leases/{}/events", segment(lease_id));
        let bound = client.options.call_timeout;
        let stream = tokio::time::timeout(bound, http.open_stream(http::Method::GET, &path, None))
            .await
            .unwrap_or_else(|_| Err(timed_out("GET lease events", bound)))?;
        Ok(Self {
            lease_id: lease_id.to_owned(),
            inner: Inner::Http(stream),
            done: false,
        })
    }

    /// Notices over a wire connection; never waits.
    pub(crate) fn wire(backend: &Arc<WireBackend>, lease_id: &str) -> Self {
        // Subscribe first, then look at what was already lost: nothing falls between the two.
        let rx = backend.notices();
        Self {
            lease_id: lease_id.to_owned(),
            inner: Inner::Wire {
                backend: backend.clone(),
                rx,
                early_loss: backend.was_lost(lease_id),
            },
            done: false,
        }
    }

    /// The lease the notices are about.
    pub fn lease_id(&self) -> &str {
        &self.lease_id
    }

    /// The next notice; `None` once the lease was lost (after that notice) or the stream ended.
    /// `Some(Err(DAEMON_CONNECTION_LOST))` when the connection is gone or an HTTP stream went
    /// silent past its idle bound.
    pub async fn next(&mut self) -> Option<Result<LeaseNotice, ContractError>> {
        if self.done {
            return None;
        }
        let item = match &mut self.inner {
            Inner::Wire {
                backend,
                rx,
                early_loss,
            } => {
                if let Some(lost) = early_loss.take() {
                    Some(Ok(lost))
                } else {
                    next_wire(backend, rx, &self.lease_id).await
                }
            }
            Inner::Http(stream) => next_http(stream).await,
        };
        match &item {
            Some(Ok(LeaseNotice::Lost { .. }) | Err(_)) | None => self.done = true,
            Some(Ok(_)) => {}
        }
        item
    }
}

async fn next_wire(
    backend: &WireBackend,
    rx: &mut broadcast::Receiver<LeaseNotice>,
    lease_id: &str,
) -> Option<Result<LeaseNotice, ContractError>> {
    loop {
        let received = tokio::select! {
            received = rx.recv() => received,
            () = backend.closed() => return Some(Err(ContractError::connection_lost())),
        };
        match received {
            Ok(notice) if notice.lease_id() == lease_id => return Some(Ok(notice)),
            Ok(_) => {}
            Err(broadcast::error::RecvError::Lagged(missed)) => {
                tracing::warn!(missed, "lease notices lagged");
                if let Some(lost) = backend.was_lost(lease_id) {
                    return Some(Ok(lost));
                }
            }
            Err(broadcast::error::RecvError::Closed) => return None,
        }
    }
}

async fn next_http(stream: &mut SseStream) -> Option<Result<LeaseNotice, ContractError>> {
    loop {
        let event = match stream.next().await? {
            Ok(event) => event,
            Err(e) => return Some(Err(e)),
        };
        if let Some(notice) = LeaseNotice::from_sse(&event).transpose() {
            return Some(notice);
        }
    }
}
