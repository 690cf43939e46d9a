//! `agentDevice.*`: the agent-device edge's configuration section (ADR 0026). Both daemons read
//! `enabled` and `leaseTtlCapMs` (the front); a worker alone reads `command` (its host starts
//! that daemon).

use serde::{Deserialize, Serialize};
use simlock_contract::model::Mode;
use simlock_daemon::config::{BOTH, DaemonConfig, Section, SectionError, above_zero};

use crate::front::AGENT_DEVICE_MAX_TTL_MS;

/// `agentDevice.sessionRetentionMs` when unset: an hour.
pub const DEFAULT_SESSION_RETENTION_MS: u64 = 3_600_000;

/// `agentDevice.queueWaitMs` when unset: 4 minutes, so that the refusal reaches the CLI (which
/// gives up on a request after 330 s) with time left for a device to be made ready.
pub const DEFAULT_QUEUE_WAIT_MS: u64 = 240_000;

/// The longest `agentDevice.queueWaitMs`: agent-device 0.21.5 gives up on a request after
/// 330 s, and the wait must end before that with room for the answer.
pub const MAX_QUEUE_WAIT_MS: u64 = 300_000;

/// The shortest lease agent-device 0.21.5 takes (its `ttlMs` bounds are 5 000–600 000 ms).
pub const AGENT_DEVICE_MIN_TTL_MS: u64 = 5_000;

/// `agentDevice.*`: Callstack's agent-device CLI served at `/v1/agent-device`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", default)]
pub struct AgentDeviceConfig {
    /// Serve `/v1/agent-device` (both daemons). Off by default: every route answers 404.
    pub enabled: bool,
    /// A cap on the TTL of the leases the front makes (both daemons); at most
    /// `lease.maxTtlMs`.
    pub lease_ttl_cap_ms: Option<u64>,
    /// Worker: the argv that starts an agent-device daemon, e.g.
    /// `["node", "/opt/agent-device/dist/src/internal/daemon.js"]`.
    pub command: Option<Vec<String>>,
    /// Worker: how long the daemon's session records (its request logs, served as diagnostics)
    /// are kept once nothing writes to them; at least [`AGENT_DEVICE_MAX_TTL_MS`].
    pub session_retention_ms: u64,
    /// How long an allocate waits in simlock's queue for a device before it is refused, saying
    /// so (both daemons); at most [`MAX_QUEUE_WAIT_MS`].
    pub queue_wait_ms: u64,
}

impl Default for AgentDeviceConfig {
    fn default() -> Self {
        Self {
            enabled: false,
            lease_ttl_cap_ms: None,
            command: None,
            session_retention_ms: DEFAULT_SESSION_RETENTION_MS,
            queue_wait_ms: DEFAULT_QUEUE_WAIT_MS,
        }
    }
}

impl Section for AgentDeviceConfig {
    const KEY: &'static str = "agentDevice";
    const MODES: &'static [Mode] = BOTH;
    const ONLY: &'static [(&'static str, Mode)] = &[
        ("command", Mode::Worker),
        ("sessionRetentionMs", Mode::Worker),
    ];

    fn check(&self, daemon: &DaemonConfig, mode: Mode) -> Result<(), SectionError> {
        let max_ttl_ms = daemon.lease.max_ttl_ms;
        above_zero(&[("agentDevice.queueWaitMs", self.queue_wait_ms)])?;
        if self.queue_wait_ms > MAX_QUEUE_WAIT_MS {
            return Err(SectionError::new(format!(
                "agentDevice.queueWaitMs ({}) is above {MAX_QUEUE_WAIT_MS}: agent-device gives up on a request after 330 s, before the refusal would reach it",
                self.queue_wait_ms
            )));
        }
        if let Some(cap) = self.lease_ttl_cap_ms {
            if cap < AGENT_DEVICE_MIN_TTL_MS {
                return Err(SectionError::new(format!(
                    "agentDevice.leaseTtlCapMs ({cap}) is below {AGENT_DEVICE_MIN_TTL_MS}, the shortest lease agent-device takes"
                )));
            }
            if cap > max_ttl_ms {
                return Err(SectionError::new(format!(
                    "agentDevice.leaseTtlCapMs ({cap}) is above lease.maxTtlMs ({max_ttl_ms})"
                )));
            }
        }
        if mode == Mode::Worker && self.session_retention_ms < AGENT_DEVICE_MAX_TTL_MS {
            return Err(SectionError::new(format!(
                "agentDevice.sessionRetentionMs ({}) is below {AGENT_DEVICE_MAX_TTL_MS}, the longest lease agent-device takes: a live session's records would go",
                self.session_retention_ms
            )));
        }
        if self.enabled && max_ttl_ms < AGENT_DEVICE_MIN_TTL_MS {
            return Err(SectionError::new(format!(
                "agentDevice.enabled needs lease.maxTtlMs ({max_ttl_ms}) at least {AGENT_DEVICE_MIN_TTL_MS}, the shortest lease agent-device takes"
            )));
        }
        if mode == Mode::Worker && daemon.capabilities.iter().any(|c| c == crate::CAPABILITY) {
            // Named there, it would say the worker serves agent-device whether a daemon runs or
            // not, and a gateway would send agent-device calls to a worker that has none.
            return Err(SectionError::new(format!(
                "capabilities: {cap} is not named there; the worker reports it itself while its agent-device daemon runs (set agentDevice.enabled and agentDevice.command)",
                cap = crate::CAPABILITY
            )));
        }
        if mode == Mode::Worker && self.enabled {
            match &self.command {
                None => {
                    return Err(SectionError::new(
                        "agentDevice.command must be set when agentDevice.enabled is true on a worker: the argv that starts an agent-device daemon, e.g. [\"node\", \"<agent-device>/dist/src/internal/daemon.js\"]",
                    ));
                }
                Some(argv) if argv.first().is_none_or(|p| p.trim().is_empty()) => {
                    return Err(SectionError::new(
                        "agentDevice.command: the first element must name a program",
                    ));
                }
                Some(_) => {}
            }
        }
        Ok(())
    }

    fn warnings(&self, daemon: &DaemonConfig, mode: Mode) -> Vec<String> {
        let reachable = daemon.http.turned_on() || daemon.gateway.url.is_some();
        if mode == Mode::Worker && self.enabled && !reachable {
            return vec![
                "agentDevice.enabled, but this worker serves no HTTP (http.enabled, --port) and joins no gateway (gateway.url): nothing can reach its /v1/agent-device".into(),
            ];
        }
        Vec::new()
    }
}

#[cfg(test)]
mod tests {
    use simlock_daemon::config::{ConfigError, Loaded, Sections, load_text};

    use super::*;

    fn load_with(toml: &str, mode: Mode) -> Result<Loaded, ConfigError> {
        load_text(toml, mode, &Sections::new().with::<AgentDeviceConfig>())
    }

    #[test]
    fn the_queue_wait_is_above_zero_and_ends_before_the_cli_gives_up() {
        let wait = |ms: u64| format!("[agentDevice]\nqueueWaitMs = {ms}");
        for mode in [Mode::Worker, Mode::Gateway] {
            let config: AgentDeviceConfig = load_with("", mode).unwrap().section().unwrap();
            assert_eq!(config.queue_wait_ms, 240_000);
            let config: AgentDeviceConfig =
                load_with(&wait(300_000), mode).unwrap().section().unwrap();
            assert_eq!(config.queue_wait_ms, 300_000, "at the bound");
            for (ms, said) in [(0, "must be above 0"), (300_001, "above 300000")] {
                let err = load_with(&wait(ms), mode).unwrap_err().to_string();
                assert!(
                    err.contains("agentDevice.queueWaitMs") && err.contains(said),
                    "{err}"
                );
            }
        }
    }

    #[test]
    fn the_session_retention_is_the_workers_and_at_least_the_longest_lease() {
        let retention = |ms: u64| format!("[agentDevice]\nsessionRetentionMs = {ms}");
        let loaded = load_with("", Mode::Worker).unwrap();
        let config: AgentDeviceConfig = loaded.section().unwrap();
        assert_eq!(config.session_retention_ms, 3_600_000);
        assert!(
            load_with(&retention(600_000), Mode::Worker).is_ok(),
            "at the bound"
        );
        let err = load_with(&retention(599_999), Mode::Worker)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("agentDevice.sessionRetentionMs") && err.contains("600000"),
            "{err}"
        );
        // A gateway keeps no sessions: it does not read the key.
        assert!(load_with(&retention(1), Mode::Gateway).is_ok());
    }

    #[test]
    fn agent_device_keys_are_checked_on_both_sides_and_the_command_is_the_workers() {
        let cap = |ms: u64| {
            format!(
                "[lease]\ndefaultTtlMs = 60000\nmaxTtlMs = 600000\n[agentDevice]\nleaseTtlCapMs = {ms}"
            )
        };
        for mode in [Mode::Worker, Mode::Gateway] {
            assert!(load_with(&cap(600_000), mode).is_ok(), "at the bound");
            let err = load_with(&cap(600_001), mode).unwrap_err().to_string();
            assert!(
                err.contains("agentDevice.leaseTtlCapMs") && err.contains("lease.maxTtlMs"),
                "{err}"
            );
            assert!(
                load_with(&cap(5_000), mode).is_ok(),
                "agent-device's shortest"
            );
            for below in [0, 4_999] {
                let err = load_with(&cap(below), mode).unwrap_err().to_string();
                assert!(
                    err.contains("agentDevice.leaseTtlCapMs") && err.contains("5000"),
                    "{err}"
                );
            }
            let short = "[lease]\ndefaultTtlMs = 1000\nmaxTtlMs = 4999\n[agentDevice]\nenabled = true\ncommand = [\"d\"]";
            let err = load_with(short, mode).unwrap_err().to_string();
            assert!(
                err.contains("agentDevice.enabled") && err.contains("lease.maxTtlMs"),
                "{err}"
            );
            let shortest = "[lease]\ndefaultTtlMs = 1000\nmaxTtlMs = 5000\n[agentDevice]\nenabled = true\ncommand = [\"d\"]";
            assert!(
                load_with(shortest, mode).is_ok(),
                "agent-device's shortest lease is enough"
            );
            let off = "[lease]\ndefaultTtlMs = 1000\nmaxTtlMs = 4999";
            assert!(
                load_with(off, mode).is_ok(),
                "without agent-device it is fine"
            );
        }
        let err = load_with("[agentDevice]\nenabled = true", Mode::Worker)
            .unwrap_err()
            .to_string();
        assert!(err.contains("agentDevice.command"), "{err}");
        for named in [
            "capabilities = [\"agent-device\"]",
            "capabilities = [\"gpu\", \"agent-device\"]\n[agentDevice]\nenabled = true\ncommand = [\"d\"]",
        ] {
            let err = load_with(named, Mode::Worker).unwrap_err().to_string();
            assert!(
                err.contains("capabilities: agent-device is not named there")
                    && err.contains("agentDevice.enabled"),
                "{err}"
            );
        }
        assert!(load_with("capabilities = [\"gpu\"]", Mode::Worker).is_ok());
        let err = load_with("[agentDevice]\nenabled = true\ncommand = []", Mode::Worker)
            .unwrap_err()
            .to_string();
        assert!(err.contains("agentDevice.command"), "{err}");
        let worker = load_with(
            "[agentDevice]\nenabled = true\ncommand = [\"node\", \"d.js\"]",
            Mode::Worker,
        )
        .unwrap();
        assert_eq!(
            worker.warnings,
            [
                "agentDevice.enabled, but this worker serves no HTTP (http.enabled, --port) and joins no gateway (gateway.url): nothing can reach its /v1/agent-device"
            ]
        );
        for reached in [
            "[http]\nenabled = true\n",
            "[gateway]\nurl = \"ws://gw:4700\"\ntoken = \"t\"\n",
        ] {
            let worker = load_with(
                &format!("{reached}[agentDevice]\nenabled = true\ncommand = [\"node\", \"d.js\"]"),
                Mode::Worker,
            )
            .unwrap();
            assert!(
                worker.warnings.is_empty(),
                "{reached}: {:?}",
                worker.warnings
            );
        }
        let gateway = load_with(
            "[agentDevice]\nenabled = true\ncommand = [\"node\", \"d.js\"]",
            Mode::Gateway,
        )
        .unwrap();
        assert_eq!(
            gateway.warnings,
            vec!["agentDevice.command is a worker setting; a gateway ignores it".to_owned()]
        );
        assert!(gateway.section::<AgentDeviceConfig>().unwrap().enabled);
        let err = load_with("[agentDevice]\ncommand = \"node x.js\"", Mode::Worker)
            .unwrap_err()
            .to_string();
        assert!(err.contains("agentDevice.command"), "{err}");
    }
}
