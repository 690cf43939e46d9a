//! The gateway's side of one uplink: it greets the worker as its protocol client, probes its
//! version, subscribes to its events, and keeps its view fresh (on its lease and device events,
//! and every 30 s). Every call is bounded; two `status.get` timeouts in a row close the uplink.

use std::sync::Arc;

use serde_json::{Value, json};
use simlock_contract::model::{Device, EventEnvelope, LeaseLimits, PlatformCatalog};
use simlock_contract::ops::{ConfigView, ListOutput};
use simlock_contract::protocol::unsupported_ranges;
use simlock_contract::{ContractError, ErrorCode, Hello, PROTOCOL_RANGE, Push, PushFrame, Role};
use simlock_link::{LinkHandle, TextReceiver};
use simlock_wire::{Unsolicited, WireClient};
use tracing::{debug, info, warn};

use crate::fleet::{Fleet, Refresh, WorkerConn};

/// Consecutive `status.get` timeouts that close an uplink.
const MAX_STATUS_TIMEOUTS: u32 = 2;

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
            conn.close();
            fleet.disconnected(&conn);
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

    async fn drive(self: &Arc<Self>, conn: &Arc<WorkerConn>, mut unsolicited: Unsolicited) {
        let hello = Hello {
            client_version: Some(env!("CARGO_PKG_VERSION").to_owned()),
            protocol_version: None,
            protocol_range: Some(PROTOCOL_RANGE),
            principal: Some(format!("gw:{}", self.gateway_id)),
            credential: None,
        };
        let version = match self.bounded(conn.client.hello(&hello)).await {
            Ok(reply) if reply.role == Role::Admin => reply.version,
            Ok(reply) => {
                warn!(worker = %conn.worker_id, role = ?reply.role, "the uplink session is not admin; closing it");
                return;
            }
            Err(err) if err.code == ErrorCode::ProtocolVersionUnsupported => {
                let (_, worker) = unsupported_ranges(err.details.as_ref())
                    .unwrap_or((PROTOCOL_RANGE, PROTOCOL_RANGE));
                self.incompatible(conn, PROTOCOL_RANGE, worker);
                // The uplink stays open; nothing else is asked.
                tokio::select! {
                    () = conn.client.closed() => {}
                    () = self.stopping.cancelled() => {}
                }
                return;
            }
            Err(err) => {
                warn!(worker = %conn.worker_id, error = %err, "the uplink handshake failed");
                return;
            }
        };
        // The first status doubles as the version probe.
        let status = match self
            .bounded(call::<simlock_contract::ops::StatusGet>(&conn.client))
            .await
        {
            Ok(status) => status,
            Err(err) if err.code == ErrorCode::ProtocolVersionUnsupported => {
                let (_, worker) = unsupported_ranges(err.details.as_ref())
                    .unwrap_or((PROTOCOL_RANGE, PROTOCOL_RANGE));
                self.incompatible(conn, PROTOCOL_RANGE, worker);
                conn.client.closed().await;
                return;
            }
            Err(err) => {
                warn!(worker = %conn.worker_id, error = %err, "the worker's first status failed");
                return;
            }
        };
        self.connected(conn, version, &status);
        if let Err(err) = self
            .bounded(conn.client.call_value("events.subscribe", json!({})))
            .await
        {
            warn!(worker = %conn.worker_id, error = %err, "could not subscribe to the worker's events");
        }
        // Subscribe before asking, so the first request is not missed.
        let requests = conn.refresh_requests();
        conn.request_refresh(true);
        let refresher = tokio::spawn(self.clone().refresh_loop(conn.clone(), requests));
        let mut tick = tokio::time::interval(self.timing.refresh_interval);
        tick.tick().await;
        let closed = conn.closed_token();
        loop {
            tokio::select! {
                () = closed.cancelled() => break,
                () = self.stopping.cancelled() => break,
                () = conn.client.closed() => break,
                _ = tick.tick() => conn.request_refresh(true),
                push = unsolicited.recv() => match push {
                    Some(frame) => self.on_push(conn, &frame),
                    None => break,
                },
            }
        }
        refresher.abort();
        info!(worker = %conn.worker_id, "uplink ended");
    }

    fn on_push(&self, conn: &WorkerConn, frame: &PushFrame) {
        let Ok(Push::Event { event, .. }) = Push::from_frame(frame) else {
            debug!(worker = %conn.worker_id, push = %frame.push, "ignoring a push from the worker");
            return;
        };
        let name = event.event.clone();
        if name == "lease.released" || name == "lease.expired" {
            self.on_lease_end(conn, &event);
        }
        if name == "device.crash-detected" || name == "device.recovered" {
            self.device_health(&conn.worker_id, &event);
        }
        if name == "lease.renewed" {
            // The most frequent event of all: updated in place, without a refresh (ADR 0015).
            let lease_id = event.payload.get("leaseId").and_then(Value::as_str);
            let deadline = event.payload.get("newDeadline").and_then(Value::as_i64);
            let updated = match (lease_id, deadline) {
                (Some(lease_id), Some(deadline)) => {
                    self.lease_renewed(conn, lease_id, deadline, event.timestamp)
                }
                _ => false,
            };
            if !updated {
                conn.request_refresh(false);
            }
        } else if name.starts_with("lease.") || name.starts_with("device.") {
            conn.request_refresh(false);
        }
        let _ = self.relay_event(&conn.worker_id, event);
    }

    fn on_lease_end(&self, conn: &WorkerConn, event: &EventEnvelope) {
        let field = |k: &str| {
            event
                .payload
                .get(k)
                .and_then(Value::as_str)
                .unwrap_or_default()
                .to_owned()
        };
        let reason = if event.event == "lease.expired" {
            "expired".to_owned()
        } else {
            field("reason")
        };
        self.lease_ended(
            &conn.worker_id,
            &field("leaseId"),
            &field("deviceId"),
            &reason,
        );
    }

    async fn refresh_loop(
        self: Arc<Self>,
        conn: Arc<WorkerConn>,
        mut requests: tokio::sync::watch::Receiver<u64>,
    ) {
        let mut timeouts = 0u32;
        loop {
            if requests.changed().await.is_err() {
                return;
            }
            let include_catalog = conn.take_catalog_flag();
            match self.refresh(&conn, include_catalog).await {
                Ok(()) => timeouts = 0,
                Err(RefreshError::StatusTimeout) => {
                    timeouts += 1;
                    warn!(worker = %conn.worker_id, timeouts, "the worker's status read timed out");
                    if timeouts >= MAX_STATUS_TIMEOUTS {
                        warn!(worker = %conn.worker_id, "closing an uplink that missed {MAX_STATUS_TIMEOUTS} status reads in a row");
                        conn.close();
                        return;
                    }
                }
                Err(RefreshError::Failed(err)) => {
                    debug!(worker = %conn.worker_id, error = %err, "a refresh failed");
                    if include_catalog {
                        conn.request_refresh(true);
                    }
                }
            }
        }
    }

    async fn refresh(&self, conn: &WorkerConn, include_catalog: bool) -> Result<(), RefreshError> {
        let status = match tokio::time::timeout(
            self.timing.call_timeout,
            call::<simlock_contract::ops::StatusGet>(&conn.client),
        )
        .await
        {
            Err(_) => return Err(RefreshError::StatusTimeout),
            Ok(Err(err)) => return Err(RefreshError::Failed(err)),
            Ok(Ok(status)) => status,
        };
        let devices: Option<Vec<Device>> = match self
            .bounded(
                conn.client
                    .call_value("list.get", json!({"kind": "devices"})),
            )
            .await
        {
            Ok(value) => match serde_json::from_value::<ListOutput>(value) {
                Ok(ListOutput::Devices(devices)) => Some(devices),
                _ => None,
            },
            Err(err) => return Err(RefreshError::Failed(err)),
        };
        let (catalog, limits): (Option<Vec<PlatformCatalog>>, Option<LeaseLimits>) =
            if include_catalog {
                let catalog = self
                    .bounded(call::<simlock_contract::ops::CatalogGet>(&conn.client))
                    .await
                    .map_err(RefreshError::Failed)?;
                let config: ConfigView = self
                    .bounded(call::<simlock_contract::ops::ConfigGet>(&conn.client))
                    .await
                    .map_err(RefreshError::Failed)?;
                (Some(catalog.platforms), Some(config.lease))
            } else {
                (None, None)
            };
        self.refreshed(
            conn,
            Refresh {
                status,
                devices,
                catalog,
                limits,
            },
        );
        Ok(())
    }
}

enum RefreshError {
    StatusTimeout,
    Failed(ContractError),
}

/// Calls a typed operation with an empty-ish default input.
async fn call<O>(client: &WireClient) -> Result<O::Output, ContractError>
where
    O: simlock_contract::Operation,
    O::Input: Default,
{
    client.call::<O>(&O::Input::default()).await
}
