//! The wire backend: a [`WireClient`] after `hello`, with its unsolicited pushes read all the
//! time (a held receiver nobody reads would stall the connection) and fanned out to lease
//! notices and event followers.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;
use simlock_contract::model::EventEnvelope;
use simlock_contract::ops::{Empty, EventsSubscribe, EventsUnsubscribe};
use simlock_contract::{ContractError, Hello, HelloReply, Operation as _, PROTOCOL_RANGE, Push};
use simlock_wire::{Transport, Unsolicited, WireClient};
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
    /// How many [`EventFollow`](crate::EventFollow)s are open. The connection is subscribed
    /// while it is not zero; `events.subscribe` and `events.unsubscribe` are sent under this
    /// lock, so they reach the daemon in the order the count changed.
    followers: tokio::sync::Mutex<usize>,
    /// The bound on those two calls.
    call_timeout: Duration,
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
            followers: tokio::sync::Mutex::new(0),
            call_timeout: options.call_timeout,
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

    /// Follows lease notices from now on.
    pub(crate) fn notices(&self) -> broadcast::Receiver<LeaseNotice> {
        self.fanout.notices.subscribe()
    }

    /// The `lease-lost` push that ended `lease_id` on this connection, if one came.
    pub(crate) fn was_lost(&self, lease_id: &str) -> Option<LeaseNotice> {
        self.fanout.lost.lock().get(lease_id).cloned()
    }

    /// Follows `event` pushes from now on, counting the follower; the first one subscribes the
    /// connection (`events.subscribe`, bounded by the call timeout).
    pub(crate) async fn follow_events(
        &self,
    ) -> Result<broadcast::Receiver<EventEnvelope>, ContractError> {
        let mut followers = self.followers.lock().await;
        // Listen before subscribing so the first pushes are not missed.
        let rx = self.fanout.events.subscribe();
        if *followers == 0 {
            let bound = self.call_timeout;
            tokio::time::timeout(bound, self.client.call::<EventsSubscribe>(&Empty {}))
                .await
                .unwrap_or_else(|_| Err(timed_out(EventsSubscribe::NAME, bound)))?;
        }
        *followers += 1;
        Ok(rx)
    }

    /// Forgets one follower; the last one unsubscribes the connection (bounded, best effort).
    pub(crate) async fn unfollow_events(&self) {
        let mut followers = self.followers.lock().await;
        *followers = followers.saturating_sub(1);
        if *followers == 0 && !self.is_closed() {
            let unsubscribe = self.client.call::<EventsUnsubscribe>(&Empty {});
            if let Ok(Err(e)) = tokio::time::timeout(self.call_timeout, unsubscribe).await {
                debug!(error = %e, "events.unsubscribe failed");
            }
        }
    }
}

/// Reads every unsolicited push until the connection ends.
async fn read_unsolicited(mut unsolicited: Unsolicited, fanout: Arc<Fanout>) {
    while let Some(frame) = unsolicited.recv().await {
        let push = match Push::from_frame(frame) {
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
