//! The event bus: facts emitted after they are committed, kept in a ring buffer, and pushed to
//! subscribed connections. Observers only: nothing in simlock drives work from an event.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use parking_lot::Mutex;
use simlock_contract::event::{Event, EventModule};
use simlock_contract::ids::{EventId, SubscriptionId};
use simlock_contract::model::EventEnvelope;
use simlock_contract::ops::{
    EventsReplay, EventsSubscribe, EventsUnsubscribe, ReplayOutput, SubscribeOutput,
};
use simlock_contract::{ContractError, Push};
use tokio::sync::broadcast;
use tokio_util::sync::CancellationToken;
use tracing::warn;

use crate::clock::SharedClock;
use crate::context::CallCtx;
use crate::metrics::Metrics;
use crate::pipeline::Router;

/// The bus of one daemon.
pub struct EventBus {
    ring: Mutex<VecDeque<EventEnvelope>>,
    capacity: usize,
    seq: AtomicU64,
    live: broadcast::Sender<EventEnvelope>,
    clock: SharedClock,
    /// How many of each event (and reason) this daemon emitted since it started.
    counts: Mutex<BTreeMap<EventCount, u64>>,
}

/// What [`EventBus::counts`] counts by: an event's name and, for the events that give one, its
/// reason (a closed set: [`Event::reason`]).
pub type EventCount = (String, Option<&'static str>);

impl std::fmt::Debug for EventBus {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EventBus")
            .field("capacity", &self.capacity)
            .finish_non_exhaustive()
    }
}

impl EventBus {
    /// A bus keeping the last `capacity` events.
    pub fn new(capacity: usize, clock: SharedClock) -> Arc<Self> {
        Arc::new(Self {
            ring: Mutex::new(VecDeque::with_capacity(capacity.min(4096))),
            capacity: capacity.max(1),
            seq: AtomicU64::new(1),
            live: broadcast::channel(capacity.clamp(16, 4096)).0,
            clock,
            counts: Mutex::new(BTreeMap::new()),
        })
    }

    /// Records a fact that just committed, as `module` tells it.
    pub fn emit(&self, module: EventModule, event: &Event) -> u64 {
        let (name, payload) = event.parts();
        *self
            .counts
            .lock()
            .entry((name.clone(), event.reason()))
            .or_default() += 1;
        let envelope = EventEnvelope {
            id: EventId::mint(),
            seq: 0,
            timestamp: self.clock.now_ms(),
            event: name,
            payload,
            module: module.as_str().to_owned(),
        };
        self.record(envelope)
    }

    /// Records an event that happened elsewhere (a worker's, on the gateway), keeping its id and
    /// timestamp; it gets this bus's next sequence number (answered).
    pub fn relay(&self, envelope: EventEnvelope) -> u64 {
        self.record(envelope)
    }

    /// Keeps the event in the ring (no copy) and sends a copy to followers, if any; answers its
    /// sequence number.
    fn record(&self, mut envelope: EventEnvelope) -> u64 {
        let mut ring = self.ring.lock();
        let seq = self.seq.fetch_add(1, Ordering::SeqCst);
        envelope.seq = seq;
        let oldest = (ring.len() == self.capacity)
            .then(|| ring.pop_front())
            .flatten();
        // Sent under the lock so followers see events in sequence order; with nobody
        // following, there is nothing to copy.
        if self.live.receiver_count() > 0 {
            let _ = self.live.send(envelope.clone());
        }
        ring.push_back(envelope);
        drop(ring);
        // The event that made room is freed outside the lock.
        drop(oldest);
        seq
    }

    /// How many of each event this daemon emitted since it started, by name and reason, in
    /// that order. Events relayed from elsewhere ([`EventBus::relay`]) are a worker's own count,
    /// not this daemon's.
    pub fn counts(&self) -> Vec<(EventCount, u64)> {
        self.counts
            .lock()
            .iter()
            .map(|(key, n)| (key.clone(), *n))
            .collect()
    }

    /// Registers `simlock_events_total` on `metrics`: [`EventBus::counts`] at each scrape.
    pub fn register_metrics(self: &Arc<Self>, metrics: &Metrics) {
        let bus = Arc::downgrade(self);
        metrics.counter(
            "simlock_events_total",
            "Events this daemon emitted since it started, by event and, where the event gives one, reason.",
            move || {
                bus.upgrade()
                    .map(|bus| bus.counts())
                    .unwrap_or_default()
                    .into_iter()
                    .map(|((event, reason), n)| {
                        let mut labels = vec![("event", event)];
                        labels.extend(reason.map(|r| ("reason", r.to_owned())));
                        (labels, n as f64)
                    })
                    .collect()
            },
        );
    }

    /// Follows events from now on.
    pub fn follow(&self) -> broadcast::Receiver<EventEnvelope> {
        self.live.subscribe()
    }

    /// The buffered events at or after `since_ts` (all of them without it), oldest first.
    pub fn replay(&self, since_ts: Option<i64>) -> Vec<EventEnvelope> {
        self.ring
            .lock()
            .iter()
            .filter(|e| since_ts.is_none_or(|since| e.timestamp >= since))
            .cloned()
            .collect()
    }
}

/// The connection subscriptions of one daemon.
#[derive(Default)]
struct Subscriptions {
    next: AtomicU64,
    by_connection: Mutex<HashMap<u64, (SubscriptionId, CancellationToken)>>,
}

/// Registers `events.subscribe`, `events.unsubscribe` and `events.replay`.
pub fn register(router: &mut Router, bus: &Arc<EventBus>) {
    let subscriptions = Arc::new(Subscriptions::default());
    let (bus_sub, subs) = (bus.clone(), subscriptions.clone());
    router.handle::<EventsSubscribe, _, _>(move |ctx: CallCtx, _| {
        let outcome = subscribe(&bus_sub, &subs, &ctx);
        async move { outcome }
    });
    let subs = subscriptions;
    router.handle::<EventsUnsubscribe, _, _>(move |ctx: CallCtx, _| {
        if let Some(id) = ctx.connection_id()
            && let Some((_, cancel)) = subs.by_connection.lock().remove(&id)
        {
            cancel.cancel();
        }
        async move {
            Ok(SubscribeOutput {
                subscribed: false,
                subscription_id: None,
            })
        }
    });
    let bus_replay = bus.clone();
    router.handle::<EventsReplay, _, _>(move |_, input| {
        let events = bus_replay.replay(input.since_ts);
        async move { Ok(ReplayOutput { events }) }
    });
}

fn subscribe(
    bus: &Arc<EventBus>,
    subs: &Subscriptions,
    ctx: &CallCtx,
) -> Result<SubscribeOutput, ContractError> {
    let Some(conn) = ctx.connection().cloned() else {
        return Err(ContractError::bad_request(
            "events.subscribe needs a connection; over HTTP follow GET /v1/events/stream",
        ));
    };
    let id = SubscriptionId::from_raw(format!(
        "sub_{}",
        subs.next.fetch_add(1, Ordering::SeqCst) + 1
    ));
    let cancel = CancellationToken::new();
    // A second subscribe replaces the first.
    if let Some((_, old)) = subs
        .by_connection
        .lock()
        .insert(conn.id(), (id.clone(), cancel.clone()))
    {
        old.cancel();
    }
    let mut live = bus.follow();
    let closed = conn.closed();
    let subscription_id = id.clone();
    tokio::spawn(async move {
        loop {
            let event = tokio::select! {
                () = cancel.cancelled() => break,
                () = closed.cancelled() => break,
                event = live.recv() => event,
            };
            match event {
                Ok(event) => conn.push_detached(&Push::Event {
                    subscription_id: subscription_id.clone(),
                    event,
                }),
                Err(broadcast::error::RecvError::Lagged(missed)) => {
                    warn!(
                        connection = conn.id(),
                        missed, "an event subscriber fell behind and missed events"
                    );
                }
                Err(broadcast::error::RecvError::Closed) => break,
            }
        }
    });
    Ok(SubscribeOutput {
        subscribed: true,
        subscription_id: Some(id),
    })
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;
    use crate::clock::TokioClock;

    #[tokio::test]
    async fn the_ring_keeps_the_newest_events_in_order() {
        let bus = EventBus::new(3, TokioClock::starting_at(100).shared());
        for depth in 0..5 {
            let seq = bus.emit(EventModule::Fleet, &Event::QueueChanged { depth });
            let emitted = bus.replay(None).pop().unwrap();
            assert_eq!(
                (emitted.event.as_str(), emitted.module.as_str(), emitted.seq),
                ("queue.changed", "fleet", seq)
            );
        }
        let events = bus.replay(None);
        let depths: Vec<_> = events
            .iter()
            .map(|e| e.payload["depth"].as_i64().unwrap())
            .collect();
        assert_eq!(depths, [2, 3, 4]);
        let seqs: Vec<_> = events.iter().map(|e| e.seq).collect();
        assert_eq!(seqs, [3, 4, 5]);
        assert!(events.iter().all(|e| e.id.as_str().starts_with("evt_")));
    }

    #[tokio::test]
    async fn relayed_events_keep_their_id_and_timestamp() {
        let bus = EventBus::new(10, TokioClock::starting_at(100).shared());
        let mut follower = bus.follow();
        let original = EventEnvelope {
            id: EventId::from_raw("evt_remote"),
            seq: 41,
            timestamp: 7,
            event: "lease.granted".into(),
            payload: json!({}),
            module: "lease-lifecycle".into(),
        };
        let seq = bus.relay(original);
        let relayed = bus.replay(None).pop().unwrap();
        assert_eq!(
            (relayed.id.as_str(), relayed.timestamp, relayed.seq, seq),
            ("evt_remote", 7, 1, 1)
        );
        assert_eq!(follower.recv().await.unwrap(), relayed);
        assert_eq!(bus.replay(Some(8)), vec![]);
        assert_eq!(bus.counts(), vec![], "a relayed event is not this daemon's");
    }

    #[tokio::test]
    async fn emitted_events_are_counted_by_name_and_reason_past_the_ring() {
        let bus = EventBus::new(1, TokioClock::starting_at(100).shared());
        let metrics = Metrics::new();
        bus.register_metrics(&metrics);
        let released = |reason| Event::LeaseReleased {
            lease_id: "lse_1".into(),
            device_id: simlock_contract::ids::DeviceId::from_raw("dev_1"),
            owner_id: "o".into(),
            reason,
        };
        for depth in 0..3 {
            bus.emit(EventModule::Fleet, &Event::QueueChanged { depth });
        }
        bus.emit(
            EventModule::LeaseLifecycle,
            &released(simlock_contract::model::LeaseEndReason::Expired),
        );
        bus.emit(
            EventModule::LeaseLifecycle,
            &released(simlock_contract::model::LeaseEndReason::Explicit),
        );
        bus.emit(
            EventModule::LeaseLifecycle,
            &released(simlock_contract::model::LeaseEndReason::Explicit),
        );
        assert_eq!(
            bus.counts(),
            vec![
                (("lease.released".into(), Some("expired")), 1),
                (("lease.released".into(), Some("explicit")), 2),
                (("queue.changed".into(), None), 3),
            ],
            "every emitted event counts, though the ring keeps one"
        );
        let text = metrics.render();
        assert!(
            text.contains("# TYPE simlock_events_total counter\n"),
            "{text}"
        );
        assert!(
            text.contains("simlock_events_total{event=\"lease.released\",reason=\"explicit\"} 2\n"),
            "{text}"
        );
        assert!(
            text.contains("simlock_events_total{event=\"queue.changed\"} 3\n"),
            "{text}"
        );
    }
}
