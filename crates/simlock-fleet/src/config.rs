//! The fleet's `gateway.*` keys (ADR 0026: the section is this crate's; a gateway reads it). The
//! table is shared with the worker's uplink keys (`gateway.url`, `gateway.token`, …), which are
//! the daemon's.

use serde::{Deserialize, Serialize};
use simlock_contract::model::Mode;
use simlock_daemon::config::{DaemonConfig, GATEWAY, Section, SectionError, above_zero};

/// How a gateway picks the worker that serves a lease request: `gateway.routing`.
///
/// Read from its spelling, as the other keys that take one of a few spellings are
/// (`capacity.strategy`, `drivers.*.driver`); any other value fails start-up on either daemon,
/// naming the key and the accepted spellings.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum RoutingPolicy {
    /// `warm-then-free`, the stages of [`crate::routing`]: a worker holding a ready device that
    /// matches first, then one with a free slot, then one with free capacity.
    #[default]
    WarmThenFree,
}

/// `gateway.*` as a gateway reads them.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", default)]
pub struct FleetConfig {
    /// The routing policy (only `warm-then-free`).
    pub routing: RoutingPolicy,
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
            routing: RoutingPolicy::WarmThenFree,
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
        above_zero(&[
            (
                "gateway.disconnectedRetentionMs",
                self.disconnected_retention_ms,
            ),
            ("gateway.execTimeoutMs", self.exec_timeout_ms),
            (
                "gateway.leaseRequestTimeoutMs",
                self.lease_request_timeout_ms,
            ),
        ])
    }
}

#[cfg(test)]
mod tests {
    use simlock_daemon::config::{Sections, load_text};

    use super::*;

    #[test]
    fn the_routing_policy_is_read_by_its_spelling_and_another_fails_naming_the_key() {
        let sections = Sections::new().with::<FleetConfig>();
        // A value of the section's type is read on either daemon (ADR 0026), so a spelling
        // that names no policy fails both, naming the key and the accepted spelling (as for
        // capacity.strategy and drivers.*.driver).
        for mode in [Mode::Gateway, Mode::Worker] {
            for value in ["round-robin", "Warm-Then-Free", "warm_then_free", ""] {
                let err = load_text(
                    &format!("[gateway]\nrouting = \"{value}\""),
                    mode,
                    &sections,
                )
                .unwrap_err()
                .to_string();
                assert_eq!(
                    err,
                    format!(
                        "configuration: gateway.routing: unknown value `{value}`, expected `warm-then-free`"
                    )
                );
            }
            let err = load_text("[gateway]\nrouting = 5", mode, &sections)
                .unwrap_err()
                .to_string();
            assert!(
                err.starts_with("configuration: gateway.routing: invalid type"),
                "{err}"
            );
        }
        let toml = "[gateway]\nrouting = \"warm-then-free\"";
        let worker = load_text(toml, Mode::Worker, &sections).unwrap();
        assert_eq!(
            worker.warnings,
            ["gateway.routing is a gateway setting; a worker ignores it"]
        );
        let gateway = load_text(toml, Mode::Gateway, &sections).unwrap();
        assert!(gateway.warnings.is_empty(), "{:?}", gateway.warnings);
        let fleet: FleetConfig = gateway.section().unwrap();
        assert_eq!(fleet.routing, RoutingPolicy::WarmThenFree);
        // Shown as it is spelled.
        assert_eq!(
            gateway.value()["gateway"]["routing"],
            serde_json::json!("warm-then-free")
        );
        assert_eq!(RoutingPolicy::default(), FleetConfig::default().routing);
    }

    #[test]
    fn the_gateway_table_holds_the_fleets_keys_beside_the_workers_uplink_keys() {
        let sections = Sections::new().with::<FleetConfig>();
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

    #[test]
    fn a_zero_timeout_or_retention_fails_a_gateway_naming_the_key_and_one_passes() {
        let sections = Sections::new().with::<FleetConfig>();
        for key in [
            "disconnectedRetentionMs",
            "execTimeoutMs",
            "leaseRequestTimeoutMs",
        ] {
            let err = load_text(&format!("[gateway]\n{key} = 0"), Mode::Gateway, &sections)
                .unwrap_err()
                .to_string();
            assert_eq!(err, format!("configuration: gateway.{key} must be above 0"));
            let one = load_text(&format!("[gateway]\n{key} = 1"), Mode::Gateway, &sections)
                .unwrap_or_else(|e| panic!("gateway.{key} = 1: {e}"));
            assert!(one.warnings.is_empty(), "{:?}", one.warnings);
            let fleet: FleetConfig = one.section().unwrap();
            let timing = crate::FleetTiming::from_config(&fleet);
            let read = match key {
                "disconnectedRetentionMs" => timing.disconnected_retention,
                "execTimeoutMs" => timing.exec_timeout,
                _ => timing.lease_request_timeout,
            };
            assert_eq!(read, std::time::Duration::from_millis(1), "{key}");
            // A worker does not read the fleet's section: warned about, not checked.
            let worker = load_text(&format!("[gateway]\n{key} = 0"), Mode::Worker, &sections)
                .unwrap_or_else(|e| panic!("gateway.{key} = 0 on a worker: {e}"));
            assert_eq!(
                worker.warnings,
                [format!(
                    "gateway.{key} is a gateway setting; a worker ignores it"
                )]
            );
        }
    }
}
