//! A worker's whole configuration as its binary loads it: the sections it registers read from
//! the environment as the daemon's own keys are.

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::result_large_err,
    reason = "tests fail by panicking; figment's Jail takes a closure returning its own Result"
)]

use simlock_contract::model::Mode;
use simlock_core::config::{CapacityStrategy, ToolConfig};
use simlock_daemon::config::{self, ConfigError, Loaded};
use simlock_worker::{WorkerConfig, sections};

/// Loads a worker's configuration from `env` alone (a home without a file).
fn load_env(env: &[(&str, &str)]) -> Result<Loaded, ConfigError> {
    let home = std::env::temp_dir().join(format!("simlock-worker-no-home-{}", std::process::id()));
    assert!(!home.exists());
    let mut out = None;
    figment::Jail::expect_with(|jail| {
        for (name, value) in env {
            jail.set_env(name, value);
        }
        out = Some(config::load(&home, Mode::Worker, &[], sections()));
        Ok(())
    });
    out.unwrap()
}

#[test]
fn the_sections_read_the_environment_typed() {
    let env = [
        ("SIMLOCK_AGENT_DEVICE__COMMAND", r#"["node","x.js"]"#),
        ("SIMLOCK_AGENT_DEVICE__ENABLED", "true"),
        ("SIMLOCK_HTTP__PORT", "7"),
        // Reachable, so agent-device's own warning stays quiet.
        ("SIMLOCK_HTTP__ENABLED", "true"),
        ("SIMLOCK_DRIVERS__ANDROID__HEADLESS", "false"),
        ("SIMLOCK_CAPACITY__IOS__MAX_RUNNING", "3"),
        ("SIMLOCK_CAPACITY__STRATEGY", "fixed"),
        // Text keys given digits, a quoted word and spaces stay text as given.
        ("SIMLOCK_DRIVERS__IOS__DEVICE_SET", "42"),
        ("SIMLOCK_DRIVERS__ANDROID__SDK_ROOT", r#""/sdk""#),
        ("SIMLOCK_DRIVERS__IOS__XCRUN", " /usr/bin/xcrun "),
    ];
    let loaded = load_env(&env).unwrap();
    assert!(loaded.warnings.is_empty(), "{:?}", loaded.warnings);
    let config = WorkerConfig::from_loaded(&loaded).unwrap();
    assert!(config.agent_device.enabled);
    assert_eq!(
        config.agent_device.command,
        Some(vec!["node".to_owned(), "x.js".to_owned()])
    );
    assert_eq!(config.daemon.http.port, 7);
    assert!(!config.drivers.android.headless);
    assert_eq!(config.core.capacity.ios.max_running, Some(3));
    assert_eq!(config.core.capacity.strategy, CapacityStrategy::Fixed);
    assert_eq!(config.drivers.ios.device_set.as_deref(), Some("42"));
    assert_eq!(
        config.drivers.android.sdk_root.as_deref(),
        Some(r#""/sdk""#)
    );
    assert_eq!(config.drivers.ios.xcrun, " /usr/bin/xcrun ");
}

#[test]
fn a_bad_environment_value_of_a_section_fails_naming_its_key() {
    for (name, value, key) in [
        (
            "SIMLOCK_AGENT_DEVICE__COMMAND",
            "node x.js",
            "agentDevice.command",
        ),
        ("SIMLOCK_CAPACITY__STRATEGY", "lots", "capacity.strategy"),
        ("SIMLOCK_DRIVERS__IOS__DRIVER", "42", "drivers.ios.driver"),
    ] {
        let err = load_env(&[(name, value)]).unwrap_err().to_string();
        assert!(err.contains(key), "{name}={value}: {err}");
    }
}

/// The first leaf of `value` holding a positive integer, as a dotted key below `prefix`.
fn first_count(value: &serde_json::Value, prefix: &str) -> Option<(String, u64)> {
    match value {
        serde_json::Value::Object(map) => map.iter().find_map(|(k, v)| {
            let key = if prefix.is_empty() {
                k.clone()
            } else {
                format!("{prefix}.{k}")
            };
            first_count(v, &key)
        }),
        serde_json::Value::Number(n) => n
            .as_u64()
            .filter(|n| *n > 0)
            .map(|n| (prefix.to_owned(), n)),
        _ => None,
    }
}

#[test]
fn the_loaded_sections_make_the_workers_configuration_and_view() {
    // One count of every table a worker reads moved off its default (by two, so a port keeps
    // its parity), so a section the view leaves out shows.
    let defaults = sections().default_values();
    let mut moved = Vec::new();
    for (table, value) in defaults.as_object().unwrap() {
        if let Some((key, n)) = first_count(value, table) {
            moved.push((key, serde_json::json!(n + 2)));
        }
    }
    assert!(moved.len() >= 8, "{moved:?}");
    // agent-device's section holds no count by default.
    moved.push((
        "agentDevice.leaseTtlCapMs".into(),
        serde_json::json!(60_000),
    ));
    let home =
        std::env::temp_dir().join(format!("simlock-worker-no-home-v-{}", std::process::id()));
    assert!(!home.exists());
    let loaded = config::load(&home, Mode::Worker, &moved, sections())
        .unwrap_or_else(|e| panic!("{moved:?}: {e}"));
    let config = WorkerConfig::from_loaded(&loaded).unwrap();
    let view = serde_json::to_value(&config.view().settings).unwrap();
    for (key, value) in &moved {
        let shown = key.split('.').try_fold(&view, |v, part| v.get(part));
        if sections()
            .modes_of(key)
            .is_some_and(|m| m.contains(&Mode::Worker))
        {
            assert_eq!(shown, Some(value), "{key} shows as loaded");
        }
    }
    // Every table a worker reads is in its view, as loaded.
    let all = loaded.value();
    for (table, value) in view.as_object().unwrap() {
        if table != "gateway" {
            assert_eq!(&all[table], value, "{table}");
        }
    }
}

#[test]
fn an_open_map_entry_comes_from_the_environment() {
    let env = [
        ("SIMLOCK_EXEC__TOOLS__ECHO__COMMAND", "/bin/echo"),
        ("SIMLOCK_EXEC__TOOLS__ECHO__ARGS", r#"["-n"]"#),
    ];
    let echo = ToolConfig {
        command: "/bin/echo".into(),
        args: vec!["-n".into()],
    };
    let loaded = load_env(&env).unwrap();
    assert!(loaded.warnings.is_empty(), "{:?}", loaded.warnings);
    assert_eq!(
        WorkerConfig::from_loaded(&loaded).unwrap().core.exec.tools["echo"],
        echo
    );
    // The whole map as one figment table.
    let env = [(
        "SIMLOCK_EXEC__TOOLS",
        r#"{echo = {command = "/bin/echo", args = ["-n"]}}"#,
    )];
    let loaded = load_env(&env).unwrap();
    assert!(loaded.warnings.is_empty(), "{:?}", loaded.warnings);
    assert_eq!(
        WorkerConfig::from_loaded(&loaded).unwrap().core.exec.tools["echo"],
        echo
    );
}

#[test]
fn a_gateway_warns_about_a_workers_sections_as_a_workers() {
    let home = std::env::temp_dir().join(format!("simlock-gw-no-home-{}", std::process::id()));
    let flags = [
        ("idle.shutdownAfterMs".to_owned(), serde_json::json!(1000)),
        ("drivers.ios.xcrun".to_owned(), serde_json::json!("x")),
        ("agentDevice.command".to_owned(), serde_json::json!(["d"])),
        (
            "gateway.routing".to_owned(),
            serde_json::json!("warm-then-free"),
        ),
    ];
    let loaded = config::load(&home, Mode::Gateway, &flags, sections()).unwrap();
    assert_eq!(
        loaded.warnings,
        [
            "agentDevice.command is a worker setting; a gateway ignores it",
            "drivers.ios.xcrun is a worker setting; a gateway ignores it",
            "idle.shutdownAfterMs is a worker setting; a gateway ignores it",
        ]
    );
    let loaded = config::load(&home, Mode::Worker, &flags, sections()).unwrap();
    assert_eq!(
        loaded.warnings,
        ["gateway.routing is a gateway setting; a worker ignores it"]
    );
}

#[test]
fn a_tool_entry_from_the_environment_is_checked_as_a_files() {
    let env = [
        ("SIMLOCK_EXEC__TOOLS__ECHO__COMMAND", "/bin/echo"),
        ("SIMLOCK_EXEC__TOOLS__ECHO__ARG", r#"["-n"]"#),
    ];
    let loaded = load_env(&env).unwrap();
    assert_eq!(
        loaded.warnings,
        ["unknown configuration key exec.tools.echo.arg is ignored"]
    );
    let env = [("SIMLOCK_EXEC__TOOLS__ECHO__COMMAND", "")];
    let err = load_env(&env).unwrap_err().to_string();
    assert!(err.contains("exec.tools.echo.command is empty"), "{err}");
}
