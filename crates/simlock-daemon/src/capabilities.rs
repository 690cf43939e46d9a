//! What a worker can serve: capabilities named in config, and ones modules report live
//! (agent-device reports whether its daemon runs). `status.get` lists them; a lease request's
//! `requires` is checked against them.

use std::sync::Arc;

use parking_lot::Mutex;
use simlock_contract::model::CapabilityStatus;

type Probe = Arc<dyn Fn() -> CapabilityStatus + Send + Sync>;

/// The capabilities of one worker.
#[derive(Clone, Default)]
pub struct Capabilities {
    fixed: Arc<Vec<String>>,
    probes: Arc<Mutex<Vec<Probe>>>,
}

impl std::fmt::Debug for Capabilities {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Capabilities")
            .field("fixed", &self.fixed)
            .finish_non_exhaustive()
    }
}

impl Capabilities {
    /// Capabilities named in config, always available.
    pub fn new(fixed: Vec<String>) -> Self {
        Self {
            fixed: Arc::new(fixed),
            probes: Arc::default(),
        }
    }

    /// Adds a capability a module reports; `probe` is asked each time.
    pub fn register(&self, probe: impl Fn() -> CapabilityStatus + Send + Sync + 'static) {
        self.probes.lock().push(Arc::new(probe));
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
            // The same name twice: available if either says so.
            if a.name == b.name {
                a.available |= b.available;
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fixed_and_probed_capabilities_merge() {
        let caps = Capabilities::new(vec!["gpu".into()]);
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
}
