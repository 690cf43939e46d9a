//! The worker core's configuration sections (ADR 0026): `capacity`, `idle`, `exec`, `virtual`,
//! `health` and `quarantine`, each with its defaults and rules. A worker reads them; the lease
//! limits (`lease.*`) are the daemon's own section, which every daemon reads.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use simlock_contract::model::{Mode, Platform};
use simlock_daemon::config::{
    DaemonConfig, EntryShape, Section, SectionError, SectionValue, WORKER, above_zero,
    section_value,
};

/// The core's sections together, as a worker is started with them.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct CoreConfig {
    /// `capacity.*`.
    pub capacity: CapacityConfig,
    /// `idle.*`.
    pub idle: IdleConfig,
    /// `exec.*`.
    pub exec: ExecConfig,
    /// `virtual.*`.
    pub virtual_devices: VirtualConfig,
    /// `health.*`.
    pub health: HealthConfig,
    /// `quarantine.*`.
    pub quarantine: QuarantineConfig,
}

impl CoreConfig {
    /// Registers the core's sections on `sections`.
    pub fn register(
        sections: simlock_daemon::config::Sections,
    ) -> simlock_daemon::config::Sections {
        sections
            .with::<CapacityConfig>()
            .with::<IdleConfig>()
            .with::<ExecConfig>()
            .with::<VirtualConfig>()
            .with::<HealthConfig>()
            .with::<QuarantineConfig>()
    }

    /// The core's sections of `loaded`.
    ///
    /// # Errors
    /// A section that was not registered ([`CoreConfig::register`]).
    pub fn from_loaded(
        loaded: &simlock_daemon::config::Loaded,
    ) -> Result<Self, simlock_daemon::config::ConfigError> {
        Ok(Self {
            capacity: loaded.section()?,
            idle: loaded.section()?,
            exec: loaded.section()?,
            virtual_devices: loaded.section()?,
            health: loaded.section()?,
            quarantine: loaded.section()?,
        })
    }

    /// The sections as `config.get` shows them.
    pub fn values(&self) -> Vec<SectionValue> {
        vec![
            section_value(&self.capacity),
            section_value(&self.idle),
            section_value(&self.exec),
            section_value(&self.virtual_devices),
            section_value(&self.health),
            section_value(&self.quarantine),
        ]
    }
}

/// How running slots are counted.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum CapacityStrategy {
    /// Derived from the machine's CPUs and RAM.
    Resource,
    /// A fixed number.
    Fixed,
}

/// `capacity.*`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", default)]
pub struct CapacityConfig {
    /// `resource` (default) or `fixed`.
    pub strategy: CapacityStrategy,
    /// `fixed`: devices that may run at once, both platforms together (default 2).
    pub max_running: u32,
    /// Per-platform caps (`fixed` defaults each to `maxRunning`).
    pub ios: PlatformLimit,
    /// Per-platform caps.
    pub android: PlatformLimit,
    /// `resource`: RAM one iOS device takes (1.5 GiB).
    pub ios_bytes_per_device: u64,
    /// `resource`: RAM one Android device takes (4 GiB).
    pub android_bytes_per_device: u64,
}

impl Default for CapacityConfig {
    fn default() -> Self {
        Self {
            strategy: CapacityStrategy::Resource,
            max_running: 2,
            ios: PlatformLimit::default(),
            android: PlatformLimit::default(),
            ios_bytes_per_device: 1536 * 1024 * 1024,
            android_bytes_per_device: 4 * 1024 * 1024 * 1024,
        }
    }
}

/// A per-platform cap.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", default)]
pub struct PlatformLimit {
    /// Devices of this platform that may run at once.
    pub max_running: Option<u32>,
}

/// `idle.*`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", default)]
pub struct IdleConfig {
    /// An unleased running device is shut down after this long (10 min).
    pub shutdown_after_ms: u64,
    /// An unleased device is deleted after this long (1 h).
    pub delete_after_ms: u64,
}

impl Default for IdleConfig {
    fn default() -> Self {
        Self {
            shutdown_after_ms: 600_000,
            delete_after_ms: 3_600_000,
        }
    }
}

/// One tool `device.exec` may run.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ToolConfig {
    /// The program.
    pub command: String,
    /// Arguments put before the caller's.
    #[serde(default)]
    pub args: Vec<String>,
}

/// `exec.*`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", default)]
pub struct ExecConfig {
    /// A run is stopped after this long (10 min): SIGTERM, then SIGKILL 10 s later.
    pub timeout_ms: u64,
    /// The tools exec may run, by the name callers use. None by default.
    pub tools: BTreeMap<String, ToolConfig>,
}

impl Default for ExecConfig {
    fn default() -> Self {
        Self {
            timeout_ms: 600_000,
            tools: BTreeMap::new(),
        }
    }
}

/// One model of the virtual catalog.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct VirtualModel {
    /// The platform.
    pub platform: Platform,
    /// The model's name.
    pub name: String,
    /// Other names it answers to.
    #[serde(default)]
    pub aliases: Vec<String>,
    /// The runtimes (OS versions) it runs.
    pub runtimes: Vec<String>,
}

/// `virtual.*`: the built-in virtual devices.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", default)]
pub struct VirtualConfig {
    /// How long creating a device takes.
    pub provision_ms: u64,
    /// How long booting takes.
    pub boot_ms: u64,
    /// How long wiping after a lease takes.
    pub reclaim_ms: u64,
    /// The catalog; the default has three iOS models on two runtimes and two Android models
    /// on two API levels.
    pub models: Vec<VirtualModel>,
}

impl Default for VirtualConfig {
    fn default() -> Self {
        let model = |platform, name: &str, aliases: &[&str], runtimes: &[&str]| VirtualModel {
            platform,
            name: name.into(),
            aliases: aliases.iter().map(|a| (*a).into()).collect(),
            runtimes: runtimes.iter().map(|r| (*r).into()).collect(),
        };
        Self {
            provision_ms: 1_500,
            boot_ms: 1_000,
            reclaim_ms: 500,
            models: vec![
                model(
                    Platform::Ios,
                    "iPhone 16",
                    &["iphone16", "iphone"],
                    &["18.2", "17.5"],
                ),
                model(Platform::Ios, "iPhone 16 Pro", &["iphone16pro"], &["18.2"]),
                model(
                    Platform::Ios,
                    "iPad Air 11-inch (M2)",
                    &["ipad", "ipad-air"],
                    &["18.2", "17.5"],
                ),
                model(
                    Platform::Android,
                    "Pixel 8",
                    &["pixel8", "pixel"],
                    &["34", "35"],
                ),
                model(Platform::Android, "Pixel 9", &["pixel9"], &["35"]),
            ],
        }
    }
}

/// `health.*`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", default)]
pub struct HealthConfig {
    /// Watch leased devices at all.
    pub enabled: bool,
    /// How often the drivers are asked which devices run (30 s).
    pub probe_interval_ms: u64,
    /// Consecutive probes that must see a leased device stopped before it counts as crashed (2).
    pub stable_observations: u32,
    /// Boots tried under the lease before it ends with `device-lost` (3).
    pub max_recovery_attempts: u32,
    /// The wait before the second boot; doubled for each one after (5 s).
    pub recovery_backoff_ms: u64,
}

impl Default for HealthConfig {
    fn default() -> Self {
        Self {
            enabled: true,
            probe_interval_ms: 30_000,
            stable_observations: 2,
            max_recovery_attempts: 3,
            recovery_backoff_ms: 5_000,
        }
    }
}

/// `quarantine.*`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", default)]
pub struct QuarantineConfig {
    /// Reclaims retried on a quarantined device before it is deleted (3).
    pub max_retries: u32,
    /// The wait before the first retry (30 s).
    pub retry_backoff_ms: u64,
    /// Each later wait is the one before times this (2).
    pub retry_backoff_multiplier: u32,
    /// The longest wait (5 min).
    pub max_retry_backoff_ms: u64,
}

impl Default for QuarantineConfig {
    fn default() -> Self {
        Self {
            max_retries: 3,
            retry_backoff_ms: 30_000,
            retry_backoff_multiplier: 2,
            max_retry_backoff_ms: 300_000,
        }
    }
}

impl Section for CapacityConfig {
    const KEY: &'static str = "capacity";
    const MODES: &'static [Mode] = WORKER;

    fn check(&self, _daemon: &DaemonConfig, _mode: Mode) -> Result<(), SectionError> {
        // A platform capped at 0 could never grant: its requests would wait out their timeout,
        // or forever without one.
        for (key, cap) in [
            ("capacity.ios.maxRunning", self.ios.max_running),
            ("capacity.android.maxRunning", self.android.max_running),
        ] {
            if let Some(cap) = cap {
                above_zero(&[(key, u64::from(cap))])?;
            }
        }
        match self.strategy {
            CapacityStrategy::Fixed => {
                above_zero(&[("capacity.maxRunning", u64::from(self.max_running))])
            }
            CapacityStrategy::Resource => Ok(()),
        }
    }
}

impl Section for IdleConfig {
    const KEY: &'static str = "idle";
    const MODES: &'static [Mode] = WORKER;

    fn check(&self, _daemon: &DaemonConfig, _mode: Mode) -> Result<(), SectionError> {
        if self.delete_after_ms < self.shutdown_after_ms {
            return Err(SectionError::new(
                "idle.deleteAfterMs is below idle.shutdownAfterMs",
            ));
        }
        Ok(())
    }
}

impl Section for ExecConfig {
    const KEY: &'static str = "exec";
    const MODES: &'static [Mode] = WORKER;
    const OPEN_MAPS: &'static [&'static str] = &["tools"];

    fn entry_shapes() -> Vec<EntryShape> {
        let tool = ToolConfig {
            command: String::new(),
            args: Vec::new(),
        };
        vec![EntryShape::of("tools", &tool)]
    }

    fn check(&self, _daemon: &DaemonConfig, _mode: Mode) -> Result<(), SectionError> {
        // 0 would stop every run as it starts.
        above_zero(&[("exec.timeoutMs", self.timeout_ms)])?;
        // An empty command names no program: every run of the tool would fail to start.
        if let Some(name) = self
            .tools
            .iter()
            .find_map(|(name, tool)| tool.command.trim().is_empty().then_some(name))
        {
            return Err(SectionError::new(format!(
                "exec.tools.{name}.command is empty: it must name a program, a path or a name looked up in PATH"
            )));
        }
        Ok(())
    }
}

impl Section for VirtualConfig {
    const KEY: &'static str = "virtual";
    const MODES: &'static [Mode] = WORKER;

    fn entry_shapes() -> Vec<EntryShape> {
        let model = VirtualModel {
            platform: Platform::Ios,
            name: String::new(),
            aliases: Vec::new(),
            runtimes: Vec::new(),
        };
        vec![EntryShape::of("models", &model)]
    }

    fn check(&self, _daemon: &DaemonConfig, _mode: Mode) -> Result<(), SectionError> {
        if self.models.is_empty() {
            return Err(SectionError::new(
                "virtual.models is empty: a worker needs at least one model",
            ));
        }
        for model in &self.models {
            if model.runtimes.is_empty() {
                return Err(SectionError::new(format!(
                    "virtual.models: {} has no runtimes",
                    model.name
                )));
            }
        }
        Ok(())
    }
}

impl Section for HealthConfig {
    const KEY: &'static str = "health";
    const MODES: &'static [Mode] = WORKER;

    fn check(&self, _daemon: &DaemonConfig, _mode: Mode) -> Result<(), SectionError> {
        above_zero(&[
            ("health.probeIntervalMs", self.probe_interval_ms),
            (
                "health.stableObservations",
                u64::from(self.stable_observations),
            ),
        ])
    }
}

impl Section for QuarantineConfig {
    const KEY: &'static str = "quarantine";
    const MODES: &'static [Mode] = WORKER;

    fn check(&self, _daemon: &DaemonConfig, _mode: Mode) -> Result<(), SectionError> {
        above_zero(&[(
            "quarantine.retryBackoffMultiplier",
            u64::from(self.retry_backoff_multiplier),
        )])
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;
    use simlock_daemon::config::{ConfigError, Loaded, Sections, load_text};

    use super::*;

    fn sections() -> Sections {
        CoreConfig::register(Sections::new())
    }

    fn load_with(toml: &str, mode: Mode) -> Result<Loaded, ConfigError> {
        load_text(toml, mode, &sections())
    }

    #[test]
    fn the_cores_settings_past_their_limits_fail_naming_the_key() {
        let ok = |toml: &str| load_with(toml, Mode::Worker).is_ok();
        let err = |toml: &str| load_with(toml, Mode::Worker).unwrap_err().to_string();
        for (section, key) in [
            ("health", "probeIntervalMs"),
            ("health", "stableObservations"),
            ("quarantine", "retryBackoffMultiplier"),
            ("exec", "timeoutMs"),
            ("capacity.ios", "maxRunning"),
            ("capacity.android", "maxRunning"),
        ] {
            let e = err(&format!("[{section}]\n{key} = 0"));
            assert!(e.contains(&format!("{section}.{key}")), "{e}");
            assert!(ok(&format!("[{section}]\n{key} = 1")));
        }
        let e = err("[capacity]\nstrategy = \"fixed\"\nmaxRunning = 0");
        assert!(e.contains("capacity.maxRunning"), "{e}");
        assert!(ok("[capacity]\nstrategy = \"fixed\"\nmaxRunning = 1"));
        assert!(
            ok("[capacity]\nmaxRunning = 0"),
            "resource ignores maxRunning"
        );
        let e = err("[capacity]\nstrategy = \"fixed\"\n[capacity.ios]\nmaxRunning = 0");
        assert!(e.contains("capacity.ios.maxRunning"), "fixed too: {e}");
        let e = err("[idle]\nshutdownAfterMs = 2\ndeleteAfterMs = 1");
        assert!(
            e.contains("idle.deleteAfterMs") && e.contains("idle.shutdownAfterMs"),
            "{e}"
        );
        assert!(ok("[idle]\nshutdownAfterMs = 2\ndeleteAfterMs = 2"));
        let e = err("[virtual]\nmodels = []");
        assert!(e.contains("virtual.models"), "{e}");
        let e = err("[[virtual.models]]\nplatform = \"ios\"\nname = \"X\"\nruntimes = []");
        assert!(e.contains("virtual.models") && e.contains("X"), "{e}");
        let e = err("[capacity]\nstrategy = \"lots\"");
        assert!(e.contains("capacity.strategy"), "{e}");
    }

    #[test]
    fn a_gateway_warns_about_the_cores_keys_and_does_not_check_them() {
        let loaded = load_with(
            "[idle]\nshutdownAfterMs = 1000\ndeleteAfterMs = 2\n[lease]\nmaxTtlMS = 5",
            Mode::Gateway,
        )
        .unwrap();
        assert_eq!(
            loaded.warnings,
            [
                "idle.deleteAfterMs is a worker setting; a gateway ignores it",
                "idle.shutdownAfterMs is a worker setting; a gateway ignores it",
                "unknown configuration key lease.maxTtlMS is ignored",
            ]
        );
    }

    #[test]
    fn an_unknown_key_in_a_model_entry_is_warned_naming_the_entry() {
        let models = "[[virtual.models]]\nplatform = \"ios\"\nname = \"iPhone 16\"\n\
                      aliases = [\"iphone\"]\nruntimes = [\"18.2\"]\n\n\
                      [[virtual.models]]\nplatform = \"android\"\nname = \"Pixel 8\"\n\
                      alias = [\"ix\"]\ncolour = \"red\"\nruntimes = [\"34\"]";
        let loaded = load_with(models, Mode::Worker).unwrap();
        assert_eq!(
            loaded.warnings,
            [
                "unknown configuration key virtual.models[1].alias is ignored",
                "unknown configuration key virtual.models[1].colour is ignored",
            ]
        );
        // Ignored indeed: the model answers to no alias.
        let catalog: VirtualConfig = loaded.section().unwrap();
        assert_eq!(catalog.models[1].name, "Pixel 8");
        assert!(catalog.models[1].aliases.is_empty());
        assert_eq!(catalog.models[0].aliases, ["iphone"]);
    }

    #[test]
    fn an_unknown_key_in_a_tool_entry_is_warned_naming_the_tool() {
        let tools = "[exec.tools.x]\ncommand = \"/bin/echo\"\narg = [\"a\"]\n\
                     [exec.tools.y]\ncommand = \"/bin/true\"\nargs = [\"b\"]";
        let loaded = load_with(tools, Mode::Worker).unwrap();
        assert_eq!(
            loaded.warnings,
            ["unknown configuration key exec.tools.x.arg is ignored"]
        );
        let exec: ExecConfig = loaded.section().unwrap();
        assert!(exec.tools["x"].args.is_empty());
        assert_eq!(exec.tools["y"].args, ["b"]);
    }

    #[test]
    fn valid_model_and_tool_entries_are_not_warned_about() {
        let valid = "[exec.tools.echo]\ncommand = \"echo\"\nargs = [\"-n\"]\n\
                     [exec.tools.true]\ncommand = \"true\"\n\
                     [[virtual.models]]\nplatform = \"ios\"\nname = \"iPhone 16\"\n\
                     aliases = [\"iphone\"]\nruntimes = [\"18.2\"]\n\
                     [[virtual.models]]\nplatform = \"android\"\nname = \"Pixel 8\"\n\
                     runtimes = [\"34\"]";
        let loaded = load_with(valid, Mode::Worker).unwrap();
        assert!(loaded.warnings.is_empty(), "{:?}", loaded.warnings);
        // The default catalog's entries, given as a flag, are of the shape too.
        let defaults = serde_json::to_value(VirtualConfig::default()).unwrap();
        let flags = [("virtual.models".to_owned(), defaults["models"].clone())];
        let home = tempfile::tempdir().unwrap();
        let loaded =
            simlock_daemon::config::load(home.path(), Mode::Worker, &flags, &sections()).unwrap();
        assert!(loaded.warnings.is_empty(), "{:?}", loaded.warnings);
        assert_eq!(
            loaded.section::<VirtualConfig>().unwrap(),
            VirtualConfig::default()
        );
        // Each entry's keys are its type's.
        let sections = sections();
        assert_eq!(
            sections.entry_keys("virtual.models").unwrap(),
            ["aliases", "name", "platform", "runtimes"]
        );
        assert_eq!(
            sections.entry_keys("exec.tools").unwrap(),
            ["args", "command"]
        );
        assert_eq!(sections.layout_problems(), Vec::<String>::new());
    }

    #[test]
    fn an_empty_tool_command_fails_naming_the_key() {
        for command in ["\"\"", "\"  \""] {
            let toml = format!(
                "[exec.tools.ok]\ncommand = \"/bin/true\"\n[exec.tools.x]\ncommand = {command}"
            );
            let err = load_with(&toml, Mode::Worker).unwrap_err().to_string();
            assert_eq!(
                err,
                "configuration: exec.tools.x.command is empty: it must name a program, a path or a name looked up in PATH"
            );
        }
        assert!(load_with("[exec.tools.x]\ncommand = \"true\"", Mode::Worker).is_ok());
        // A gateway reads no tools: it warns, and does not check them.
        let loaded = load_with("[exec.tools.x]\ncommand = \"\"", Mode::Gateway).unwrap();
        assert_eq!(
            loaded.warnings,
            ["exec.tools is a worker setting; a gateway ignores it"]
        );
    }

    #[test]
    fn exec_tools_are_the_users_names() {
        let loaded = load_with("[exec.tools.echo]\ncommand = \"/bin/echo\"", Mode::Worker).unwrap();
        assert!(loaded.warnings.is_empty(), "{:?}", loaded.warnings);
        let exec: ExecConfig = loaded.section().unwrap();
        assert_eq!(exec.tools["echo"].command, "/bin/echo");
        let config = CoreConfig::from_loaded(&loaded).unwrap();
        assert_eq!(config.exec, exec);
        let values = config.values();
        assert_eq!(values.len(), 6);
        let view = simlock_daemon::config::view(
            &DaemonConfig::default(),
            &sections(),
            &values,
            Mode::Worker,
        );
        assert_eq!(
            view.settings["exec"]["tools"]["echo"]["command"],
            json!("/bin/echo")
        );
        assert_eq!(view.settings["capacity"]["maxRunning"], json!(2));
    }
}
