//! The gateway's side of one uplink: it greets the worker as its protocol client, probes its
//! version with a first `status.get`, subscribes to its events, then hands every event to the
//! fleet core until the uplink ends. Every call is bounded. Refreshes of the view, forwards and
//! closes are the core's effects ([`crate::fleet`]).

use std::sync::Arc;

use simlock_contract::model::EventEnvelope;
use simlock_contract::ops::{EventsSubscribe, StatusGet};
use simlock_contract::protocol::unsupported_ranges;
use simlock_contract::{ContractError, ErrorCode, Hello, PROTOCOL_RANGE, Push, PushFrame, Role};
use simlock_link::{LinkHandle, TextReceiver};
use simlock_wire::{Unsolicited, WireClient};
use tracing::{debug, info, warn};

use crate::fleet::{Fleet, WorkerConn};
use crate::state::Closing;

impl Fleet {
    /// Takes over a worker's new uplink and drives it until it ends.
    pub fn accept_uplink(
        self: &Arc<Self>,
        worker_id: String,
        label: Option<String>,
        token_id: String,
        link: LinkHandle,
        text: TextReceiver,
    ) {
        let (client, unsolicited) =
            WireClient::new(simlock_daemon::uplink::client_text_transport(&link, text));
        let conn = self.attach(&worker_id, label, token_id, client, link);
        let fleet = self.clone();
        tokio::spawn(async move {
            fleet.drive(&conn, unsolicited).await;
            // An uplink accepted while the gateway stops (its worker redialled at once) closes
            // telling the worker why, as the ones the stop found did.
            if fleet.stopping.is_cancelled() {
                conn.close_because(Closing::Stopping);
            } else {
                conn.close();
            }
            fleet.detach(&conn);
        });
    }

    async fn bounded<T>(
        &self,
        call: impl Future<Output = Result<T, ContractError>>,
    ) -> Result<T, ContractError> {
        tokio::time::timeout(self.timing.call_timeout, call)
            .await
            .unwrap_or_else(|_| {
                Err(ContractError::new(
                    ErrorCode::WorkerUnreachable,
                    "the worker did not answer in time",
                ))
            })
    }

    /// The worker answered the handshake with a protocol range the gateway does not speak:
    /// its view says so, and the uplink stays open, asked nothing more.
    async fn incompatible(&self, conn: &WorkerConn, err: &ContractError) {
        let (_, worker) =
            unsupported_ranges(err.details.as_ref()).unwrap_or((PROTOCOL_RANGE, PROTOCOL_RANGE));
        self.decide(|shared, now| {
            shared
                .core
                .handle_incompatible(conn.generation, PROTOCOL_RANGE, worker, now);
        });
        let closed = conn.closed_token();
        tokio::select! {
            () = conn.client.closed() => {}
            () = closed.cancelled() => {}
            () = self.stopping.cancelled() => {}
        }
    }

    async fn drive(&self, conn: &Arc<WorkerConn>, mut unsolicited: Unsolicited) {
        let hello = Hello {
            client_version: Some(env!("CARGO_PKG_VERSION").to_owned()),
            protocol_version: None,
            protocol_range: Some(PROTOCOL_RANGE),
            principal: Some(format!("gw:{}", self.gateway_id())),
            credential: None,
        };
        let version = match self.bounded(conn.client.hello(&hello)).await {
            Ok(reply) if reply.role == Role::Admin => reply.version,
            Ok(reply) => {
                warn!(worker = %conn.worker_id, role = ?reply.role, "the uplink session is not admin; closing it");
                return;
            }
            Err(err) if err.code == ErrorCode::ProtocolVersionUnsupported => {
                return self.incompatible(conn, &err).await;
            }
            Err(err) => {
                warn!(worker = %conn.worker_id, error = %err, "the uplink handshake failed");
                return;
            }
        };
        // The first status doubles as the version probe; its leases are indexed at once.
        let sent = self.decide(|shared, _| shared.core.handle_probe_sent());
        let status = match self
            .bounded(conn.client.call::<StatusGet>(&Default::default()))
            .await
        {
            Ok(status) => status,
            Err(err) if err.code == ErrorCode::ProtocolVersionUnsupported => {
                return self.incompatible(conn, &err).await;
            }
            Err(err) => {
                warn!(worker = %conn.worker_id, error = %err, "the worker's first status failed");
                return;
            }
        };
        self.decide(|shared, now| {
            shared
                .core
                .handle_connected(conn.generation, version, &status, sent, now);
        });
        // Subscribe before the first full refresh, so no event after it is missed.
        if let Err(err) = self
            .bounded(conn.client.call::<EventsSubscribe>(&Default::default()))
            .await
        {
            warn!(worker = %conn.worker_id, error = %err, "could not subscribe to the worker's events");
        }
        self.decide(|shared, now| shared.core.handle_subscribed(conn.generation, now));
        let closed = conn.closed_token();
        loop {
            tokio::select! {
                () = closed.cancelled() => break,
                () = self.stopping.cancelled() => break,
                () = conn.client.closed() => break,
                push = unsolicited.recv() => match push {
                    Some(frame) => self.on_push(conn, frame),
                    None => break,
                },
            }
        }
        info!(worker = %conn.worker_id, "uplink ended");
    }

    fn on_push(&self, conn: &WorkerConn, frame: PushFrame) {
        if frame.push != Push::EVENT {
            debug!(worker = %conn.worker_id, push = %frame.push, "ignoring a push from the worker");
            return;
        }
        let Ok(Push::Event { event, .. }) = Push::from_frame(frame) else {
            debug!(worker = %conn.worker_id, "ignoring an event push from the worker that breaks its schema");
            return;
        };
        self.on_event(conn, event);
    }

    fn on_event(&self, conn: &WorkerConn, event: EventEnvelope) {
        self.decide(|shared, now| {
            shared.core.handle_worker_event(conn.generation, event, now);
        });
    }
}
