//! The fleet's `gateway.*` keys (ADR 0026: the section is this crate's; a gateway reads it). The
//! table is shared with the worker's uplink keys (`gateway.url`, `gateway.token`, …), which are
//! the daemon's.

use serde::{Deserialize, Serialize};
use simlock_contract::model::Mode;
use simlock_daemon::config::{DaemonConfig, GATEWAY, Section, SectionError};

/// The only routing policy.
pub const WARM_THEN_FREE: &str = "warm-then-free";

/// `gateway.*` as a gateway reads them.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", default)]
pub struct FleetConfig {
    /// The routing policy (only `warm-then-free`).
    pub routing: String,
    /// How long a disconnected worker's view is kept (24 h).
    pub disconnected_retention_ms: u64,
    /// Backstop for a forwarded exec (11 min).
    pub exec_timeout_ms: u64,
    /// Bound on a forwarded lease request (5 min).
    pub lease_request_timeout_ms: u64,
}

impl Default for FleetConfig {
    fn default() -> Self {
        Self {
            routing: WARM_THEN_FREE.into(),
            disconnected_retention_ms: 86_400_000,
            exec_timeout_ms: 660_000,
            lease_request_timeout_ms: 300_000,
        }
    }
}

impl Section for FleetConfig {
    const KEY: &'static str = "gateway";
    const MODES: &'static [Mode] = GATEWAY;

    fn check(&self, _daemon: &DaemonConfig, _mode: Mode) -> Result<(), SectionError> {
        if self.routing != WARM_THEN_FREE {
            return Err(SectionError::new(format!(
                "gateway.routing: unknown policy {:?} (only warm-then-free)",
                self.routing
            )));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use simlock_daemon::config::{Sections, load_text};

    use super::*;

    #[test]
    fn the_routing_policy_is_checked_on_a_gateway_and_warned_about_on_a_worker() {
        let sections = Sections::new().with::<FleetConfig>();
        let toml = "[gateway]\nrouting = \"round-robin\"";
        let err = load_text(toml, Mode::Gateway, &sections)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("gateway.routing") && err.contains("round-robin"),
            "{err}"
        );
        let worker = load_text(toml, Mode::Worker, &sections).unwrap();
        assert_eq!(
            worker.warnings,
            ["gateway.routing is a gateway setting; a worker ignores it"]
        );
        let toml = "[gateway]\nrouting = \"warm-then-free\"\nexecTimeoutMs = 5\nurl = \"ws://gw\"\ntoken = \"t\"";
        let gateway = load_text(toml, Mode::Gateway, &sections).unwrap();
        assert_eq!(
            gateway.warnings,
            [
                "gateway.token is a worker setting; a gateway ignores it",
                "gateway.url is a worker setting; a gateway ignores it"
            ]
        );
        let fleet: FleetConfig = gateway.section().unwrap();
        assert_eq!(fleet.exec_timeout_ms, 5);
        assert_eq!(gateway.config.gateway.url.as_deref(), Some("ws://gw"));
    }
}
