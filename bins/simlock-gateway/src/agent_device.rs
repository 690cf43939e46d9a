//! The agent-device front on a gateway: the relay host link over a fleet port. The port is
//! translation only — where a lease is, who owns it and which workers are capable are the
//! fleet's rules ([`simlock_fleet::routing`]); relaying is the gateway relay's.

use std::sync::Arc;
use std::time::Duration;

use agent_device_front::relay_link::{
    FleetPort, Placement, PlacementStore, RelayFailure, WorkerFacts,
};
use agent_device_front::{Body, CAPABILITY, LeaseId, RecoveredLease, RelayHostLink, Tenant};
use futures::FutureExt;
use futures::future::BoxFuture;
use http_body_util::BodyExt;
use simlock_daemon::clock::SharedClock;
use simlock_fleet::Fleet;
use simlock_relay_gateway::{GatewayRelay, RelayCall};
use tokio_util::sync::CancellationToken;

/// The fleet as the relay host link reads it.
pub(crate) struct GatewayFleetPort {
    fleet: Arc<Fleet>,
    relay: GatewayRelay,
}

impl GatewayFleetPort {
    pub(crate) const fn new(fleet: Arc<Fleet>, relay: GatewayRelay) -> Self {
        Self { fleet, relay }
    }
}

impl FleetPort for GatewayFleetPort {
    fn placement(&self, lease: &LeaseId) -> Option<Placement> {
        self.fleet.lease(lease.as_str()).map(|entry| Placement {
            worker: entry.worker_id,
            owner: entry.owner_id,
        })
    }

    fn device(&self, lease: &LeaseId) -> Option<RecoveredLease> {
        let entry = self.fleet.lease(lease.as_str())?;
        let access = entry.record.access?;
        Some(RecoveredLease {
            platform: access.platform(),
            address: access.address().to_owned(),
        })
    }

    fn capable_workers(&self) -> Vec<WorkerFacts> {
        self.fleet
            .capable_workers(CAPABILITY)
            .into_iter()
            .map(|w| WorkerFacts {
                id: w.id,
                connected: true,
                serves: true,
                platforms: w.platforms,
                lease_max_ttl_ms: Some(w.lease_max_ttl_ms),
                leases_known: true,
            })
            .collect()
    }

    fn worker(&self, id: &str) -> Option<WorkerFacts> {
        let holder = self.fleet.holder(id, CAPABILITY)?;
        Some(WorkerFacts {
            id: holder.id,
            connected: holder.connected,
            leases_known: holder.leases_known,
            serves: holder.serves,
            platforms: holder.platforms,
            lease_max_ttl_ms: holder.lease_max_ttl_ms,
        })
    }

    fn relay(
        &self,
        worker: &str,
        request: http::Request<Body>,
        tenant: &Tenant,
        lease: Option<&LeaseId>,
    ) -> BoxFuture<'static, Result<http::Response<Body>, RelayFailure>> {
        let relay = self.relay.clone();
        let worker = worker.to_owned();
        let call = RelayCall {
            target: CAPABILITY.to_owned(),
            request,
            tenant: tenant.to_string(),
            lease_id: lease.map(ToString::to_string),
            cancel: None,
        };
        async move {
            match relay.relay(&worker, call).await {
                Ok(response) => Ok(response.map(|body| {
                    body.map_err(|e| -> agent_device_front::BoxError { Box::new(e) })
                        .boxed_unsync()
                })),
                Err(e) => Err(RelayFailure { message: e.message }),
            }
        }
        .boxed()
    }

    fn gateway_id(&self) -> String {
        self.fleet.gateway_id().to_owned()
    }
}

/// The relay host link over `port`, its memory kept in `store`, told of the index's removals
/// and swept until `stop`.
pub(crate) fn relay_link(
    fleet: &Arc<Fleet>,
    port: GatewayFleetPort,
    store: Arc<dyn PlacementStore>,
    keep: Duration,
    clock: SharedClock,
    stop: &CancellationToken,
) -> Arc<RelayHostLink> {
    let link = Arc::new(RelayHostLink::new(Arc::new(port), keep, clock).with_store(store));
    let mut dropped = fleet.dropped_leases();
    let (following, stop_following) = (link.clone(), stop.clone());
    tokio::spawn(async move {
        loop {
            let removed = tokio::select! {
                removed = dropped.recv() => removed,
                () = stop_following.cancelled() => return,
            };
            match removed {
                Ok(id) => {
                    // Only the front's leases have agent-device ids.
                    if let Some(lease) = LeaseId::parse(&id) {
                        following.dropped(&lease);
                    }
                }
                // Removals the follower missed are found by the sweep.
                Err(tokio::sync::broadcast::error::RecvError::Lagged(_)) => {}
                Err(tokio::sync::broadcast::error::RecvError::Closed) => return,
            }
        }
    });
    link.spawn_sweeper(stop.clone());
    link
}
