//! What a worker can serve: capabilities named in config, and ones modules report live
//! (agent-device reports whether its daemon runs). `status.get` lists them; a lease request's
//! `requires` is checked against them. A module that holds its capability in a watch
//! ([`Capabilities::watch`]) has each change published as `capability.changed` on the
//! daemon's bus, so a gateway reads the worker again at once rather than at its next refresh.

use std::sync::Arc;

use parking_lot::Mutex;
use simlock_contract::event::{Event, EventModule};
use simlock_contract::model::CapabilityStatus;
use tokio::sync::watch;

use crate::events::EventBus;

type Probe = Arc<dyn Fn() -> CapabilityStatus + Send + Sync>;

/// The capabilities of one worker.
#[derive(Clone)]
pub struct Capabilities {
    fixed: Arc<Vec<String>>,
    probes: Arc<Mutex<Vec<Probe>>>,
    /// Every capability as `capability.changed` last told it (as registered, before a change).
    told: Arc<Mutex<Vec<CapabilityStatus>>>,
    bus: Arc<EventBus>,
}

impl std::fmt::Debug for Capabilities {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Capabilities")
            .field("fixed", &self.fixed)
            .finish_non_exhaustive()
    }
}

impl Capabilities {
    /// Capabilities named in config, always available; changes of live ones go on `bus`.
    pub fn new(fixed: Vec<String>, bus: Arc<EventBus>) -> Self {
        let caps = Self {
            fixed: Arc::new(fixed),
            probes: Arc::default(),
            told: Arc::default(),
            bus,
        };
        *caps.told.lock() = caps.snapshot();
        caps
    }

    /// Adds a capability a module reports; `probe` is asked each time. Its changes are not
    /// published unless another watched capability changes too: a module whose capability
    /// changes registers it with [`Self::watch`].
    pub fn register(&self, probe: impl Fn() -> CapabilityStatus + Send + Sync + 'static) {
        self.probes.lock().push(Arc::new(probe));
        // A capability is told as it is when registered: registering is no change.
        let mut told = self.told.lock();
        for status in self.snapshot() {
            if !told.iter().any(|t| t.name == status.name) {
                told.push(status);
            }
        }
    }

    /// Adds a capability a module holds in a watch: `status` reads it from the watched state
    /// each time it is asked (as a probe is), and every change of the state that changes the
    /// capability's status — available or not, or its reason — is published as
    /// `capability.changed`; an unchanged status is not. The watching ends when the state's
    /// sender is dropped.
    ///
    /// # Panics
    /// Outside a tokio runtime (it spawns the watching).
    pub fn watch<T: Send + Sync + 'static>(
        &self,
        state: watch::Receiver<T>,
        status: impl Fn(&T) -> CapabilityStatus + Send + Sync + 'static,
    ) {
        let probed = state.clone();
        self.register(move || status(&probed.borrow()));
        let (caps, mut state) = (self.clone(), state);
        tokio::spawn(async move {
            while state.changed().await.is_ok() {
                caps.publish_changes();
            }
        });
    }

    /// Publishes `capability.changed` for every capability whose status differs from the one
    /// last told.
    fn publish_changes(&self) {
        let mut told = self.told.lock();
        let now = self.snapshot();
        for change in changes(&told, &now) {
            self.bus.emit(
                EventModule::Capabilities,
                &Event::CapabilityChanged {
                    name: change.name.clone(),
                    available: change.available,
                    reason: change.reason.clone(),
                },
            );
        }
        *told = now;
    }

    /// Every capability now, sorted by name.
    pub fn snapshot(&self) -> Vec<CapabilityStatus> {
        let probes: Vec<Probe> = self.probes.lock().clone();
        let mut all: Vec<CapabilityStatus> = self
            .fixed
            .iter()
            .map(|name| CapabilityStatus {
                name: name.clone(),
                available: true,
                reason: None,
            })
            .chain(probes.iter().map(|probe| probe()))
            .collect();
        all.sort_by(|a, b| a.name.cmp(&b.name));
        all.dedup_by(|b, a| {
            // The same name twice: available if either says so (and then without a reason).
            if a.name == b.name {
                if b.available {
                    a.available = true;
                }
                if a.available {
                    a.reason = None;
                }
                true
            } else {
                false
            }
        });
        all
    }

    /// The first of `required` that is not available now, with why.
    pub fn missing<'a>(&self, required: &'a [String]) -> Option<(&'a str, Option<String>)> {
        let now = self.snapshot();
        required
            .iter()
            .find_map(|name| match now.iter().find(|c| &c.name == name) {
                Some(c) if c.available => None,
                Some(c) => Some((name.as_str(), c.reason.clone())),
                None => Some((name.as_str(), None)),
            })
    }
}

/// The statuses of `now` that differ from those of `before` (by name), or that `before` lacks.
fn changes<'a>(
    before: &[CapabilityStatus],
    now: &'a [CapabilityStatus],
) -> Vec<&'a CapabilityStatus> {
    now.iter()
        .filter(|status| !before.contains(status))
        .collect()
}

#[cfg(test)]
mod tests {
    use simlock_contract::model::EventEnvelope;
    use tokio::sync::broadcast;

    use super::*;
    use crate::clock::TokioClock;

    fn bus() -> Arc<EventBus> {
        EventBus::new(100, TokioClock::starting_at(0).shared())
    }

    fn status(available: bool, reason: Option<&str>) -> CapabilityStatus {
        CapabilityStatus {
            name: "agent-device".into(),
            available,
            reason: reason.map(str::to_owned),
        }
    }

    #[test]
    fn fixed_and_probed_capabilities_merge() {
        let caps = Capabilities::new(vec!["gpu".into()], bus());
        caps.register(|| CapabilityStatus {
            name: "agent-device".into(),
            available: false,
            reason: Some("its daemon is not running".into()),
        });
        let names: Vec<_> = caps
            .snapshot()
            .into_iter()
            .map(|c| (c.name, c.available))
            .collect();
        assert_eq!(
            names,
            [("agent-device".to_owned(), false), ("gpu".to_owned(), true)]
        );
        assert_eq!(caps.missing(&["gpu".into()]), None);
        let required = ["gpu".to_owned(), "agent-device".to_owned()];
        assert_eq!(
            caps.missing(&required),
            Some(("agent-device", Some("its daemon is not running".into())))
        );
        assert_eq!(caps.missing(&["tv".into()]), Some(("tv", None)));
    }

    #[test]
    fn a_name_available_from_either_source_has_no_reason() {
        let caps = Capabilities::new(vec!["agent-device".into()], bus());
        caps.register(|| status(false, Some("its daemon is not running")));
        assert_eq!(caps.snapshot(), [status(true, None)]);
    }

    #[test]
    fn only_a_changed_or_new_status_is_a_change() {
        let (down, up) = (status(false, Some("starting")), status(true, None));
        let gpu = CapabilityStatus {
            name: "gpu".into(),
            available: true,
            reason: None,
        };
        let before = [down.clone(), gpu.clone()];
        assert!(changes(&before, &before).is_empty(), "nothing changed");
        assert_eq!(changes(&before, &[up.clone(), gpu.clone()]), [&up]);
        let restarting = status(false, Some("restarting"));
        assert_eq!(
            changes(&before, &[restarting.clone(), gpu.clone()]),
            [&restarting],
            "a new reason is a change"
        );
        assert_eq!(
            changes(std::slice::from_ref(&gpu), &[down.clone(), gpu.clone()]),
            [&down]
        );
    }

    fn next_change(events: &mut broadcast::Receiver<EventEnvelope>) -> Option<Event> {
        match events.try_recv() {
            Ok(envelope) => {
                assert_eq!(envelope.module, "capabilities");
                Event::from_envelope(&envelope)
            }
            Err(_) => None,
        }
    }

    fn changed(available: bool, reason: Option<&str>) -> Option<Event> {
        Some(Event::CapabilityChanged {
            name: "agent-device".into(),
            available,
            reason: reason.map(str::to_owned),
        })
    }

    /// Lets the watching task run until it waits again.
    async fn settle() {
        for _ in 0..8 {
            tokio::task::yield_now().await;
        }
    }

    #[tokio::test(start_paused = true)]
    async fn a_watched_capability_publishes_each_change_once() {
        let bus = bus();
        let mut events = bus.follow();
        let caps = Capabilities::new(vec!["gpu".into()], bus.clone());
        let (state, watched) = watch::channel(Some("the daemon is starting".to_owned()));
        caps.watch(watched, |reason: &Option<String>| {
            status(reason.is_none(), reason.as_deref())
        });
        settle().await;
        assert_eq!(next_change(&mut events), None, "registering is no change");
        assert_eq!(
            caps.missing(&["agent-device".into()]),
            Some(("agent-device", Some("the daemon is starting".into()))),
            "the probe path reads the watch"
        );

        state.send_replace(None);
        settle().await;
        assert_eq!(next_change(&mut events), changed(true, None));
        assert_eq!(next_change(&mut events), None, "gpu did not change");
        assert_eq!(caps.missing(&["agent-device".into()]), None);

        state.send_replace(None);
        settle().await;
        assert_eq!(
            next_change(&mut events),
            None,
            "the same status again is no change"
        );

        state.send_replace(Some("the daemon is restarting".into()));
        settle().await;
        assert_eq!(
            next_change(&mut events),
            changed(false, Some("the daemon is restarting"))
        );
        state.send_replace(Some("the daemon exited; restarting".into()));
        settle().await;
        assert_eq!(
            next_change(&mut events),
            changed(false, Some("the daemon exited; restarting")),
            "a new reason is told"
        );
        assert_eq!(next_change(&mut events), None);
    }

    #[tokio::test(start_paused = true)]
    async fn the_watching_ends_with_the_state() {
        let bus = bus();
        let caps = Capabilities::new(Vec::new(), bus);
        let (state, watched) = watch::channel(true);
        caps.watch(watched, |up: &bool| status(*up, None));
        settle().await;
        // The task holds the capabilities; once the state is gone, it lets them go.
        assert!(Arc::strong_count(&caps.told) > 1);
        drop(state);
        settle().await;
        assert_eq!(Arc::strong_count(&caps.told), 1);
    }
}
