//! The wire backend: a [`WireClient`] after `hello`, with its unsolicited pushes read all the
//! time (a held receiver nobody reads would stall the connection) and fanned out to lease
//! notices and event followers.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use parking_lot::Mutex;
use serde_json::Value;
use simlock_contract::model::EventEnvelope;
use simlock_contract::{ContractError, Hello, HelloReply, PROTOCOL_RANGE, Push};
use simlock_wire::{CallHandle, Transport, Unsolicited, WireClient};
use tokio::sync::broadcast;
use tracing::{debug, warn};

use crate::client::{ConnectOptions, timed_out};
use crate::notices::LeaseNotice;

/// Notices and events kept for slow readers before they are told they lagged.
const FANOUT: usize = 1024;

/// What the unsolicited reader shares with the backend.
#[derive(Debug)]
pub(crate) struct Fanout {
    notices: broadcast::Sender<LeaseNotice>,
    events: broadcast::Sender<EventEnvelope>,
    /// Leases a `lease-lost` push ended, kept for the connection's life: repeats are dropped,
    /// and a hold that starts late still learns its lease is gone.
    lost: Mutex<HashMap<String, LeaseNotice>>,
}

/// A wire connection after `hello`.
#[derive(Debug)]
pub(crate) struct WireBackend {
    client: WireClient,
    hello: HelloReply,
    fanout: Arc<Fanout>,
    followers: AtomicUsize,
}

impl WireBackend {
    /// Starts the client over `transport` and says `hello`.
    pub(crate) async fn start(
        transport: Transport,
        options: &ConnectOptions,
    ) -> Result<Arc<Self>, ContractError> {
        let (client, unsolicited) = WireClient::new(transport);
        let fanout = Arc::new(Fanout {
            notices: broadcast::channel(FANOUT).0,
            events: broadcast::channel(FANOUT).0,
            lost: Mutex::new(HashMap::new()),
        });
        tokio::spawn(read_unsolicited(unsolicited, fanout.clone()));
        let hello = Hello {
            client_version: options.client_version.clone(),
            protocol_version: None,
            protocol_range: Some(PROTOCOL_RANGE),
            principal: options.principal.clone(),
            credential: options.credential.clone(),
        };
        let reply = tokio::time::timeout(options.call_timeout, client.hello(&hello))
            .await
            .unwrap_or_else(|_| Err(timed_out("hello", options.call_timeout)));
        let hello = match reply {
            Ok(hello) => hello,
            Err(err) => {
                client.close();
                return Err(err);
            }
        };
        Ok(Arc::new(Self {
            client,
            hello,
            fanout,
            followers: AtomicUsize::new(0),
        }))
    }

    pub(crate) const fn client(&self) -> &WireClient {
        &self.client
    }

    pub(crate) const fn hello(&self) -> &HelloReply {
        &self.hello
    }

    pub(crate) fn is_closed(&self) -> bool {
        self.client.is_closed()
    }

    pub(crate) fn close(&self) {
        self.client.close();
    }

    /// Resolves when the connection ends.
    pub(crate) async fn closed(&self) {
        self.client.closed().await;
    }

    pub(crate) async fn call_value(
        &self,
        op: &str,
        payload: Value,
    ) -> Result<Value, ContractError> {
        self.client.call_value(op, payload).await
    }

    /// Starts a call whose pushes the caller reads.
    pub(crate) async fn begin(
        &self,
        op: &str,
        payload: Value,
        push_capacity: usize,
    ) -> Result<CallHandle, ContractError> {
        self.client.begin(op, payload, push_capacity).await
    }

    /// Follows lease notices from now on.
    pub(crate) fn notices(&self) -> broadcast::Receiver<LeaseNotice> {
        self.fanout.notices.subscribe()
    }

    /// The `lease-lost` push that ended `lease_id` on this connection, if one came.
    pub(crate) fn was_lost(&self, lease_id: &str) -> Option<LeaseNotice> {
        self.fanout.lost.lock().get(lease_id).cloned()
    }

    /// Follows `event` pushes from now on, counting the follower.
    pub(crate) fn follow_events(&self) -> broadcast::Receiver<EventEnvelope> {
        self.followers.fetch_add(1, Ordering::SeqCst);
        self.fanout.events.subscribe()
    }

    /// Forgets one follower; answers whether it was the last.
    pub(crate) fn unfollow_events(&self) -> bool {
        self.followers.fetch_sub(1, Ordering::SeqCst) == 1
    }
}

/// Reads every unsolicited push until the connection ends.
async fn read_unsolicited(mut unsolicited: Unsolicited, fanout: Arc<Fanout>) {
    while let Some(frame) = unsolicited.recv().await {
        let push = match Push::from_frame(&frame) {
            Ok(push) => push,
            Err(e) => {
                warn!(error = %e, "dropping a push the client cannot read");
                continue;
            }
        };
        match push {
            Push::Event { event, .. } => {
                let _ = fanout.events.send(event);
            }
            Push::LeaseLost { .. }
            | Push::DeviceUnhealthy { .. }
            | Push::DeviceRecovered { .. } => {
                let Some(notice) = LeaseNotice::from_push(push) else {
                    continue;
                };
                if let LeaseNotice::Lost { lease_id, .. } = &notice {
                    let mut lost = fanout.lost.lock();
                    if lost.contains_key(lease_id) {
                        debug!(lease = %lease_id, "dropping a repeated lease-lost");
                        continue;
                    }
                    lost.insert(lease_id.clone(), notice.clone());
                }
                let _ = fanout.notices.send(notice);
            }
            Push::Progress { .. }
            | Push::Started { .. }
            | Push::Output { .. }
            | Push::RelayHead { .. } => {
                debug!(
                    push = push.kind(),
                    "dropping a request-scoped push for no call"
                );
            }
        }
    }
}
