//! `drivers.*`: which driver serves each platform, and the real drivers' settings (ADR 0026:
//! the section is this crate's; a worker reads it).

use serde::{Deserialize, Serialize};
use simlock_contract::model::Mode;
use simlock_daemon::config::{DaemonConfig, Section, SectionError, WORKER, above_zero};

/// Which driver serves iOS (`drivers.ios.driver`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case", try_from = "String")]
pub enum IosDriverChoice {
    /// `xcrun simctl` when it is found and works, else the virtual driver.
    Auto,
    /// The virtual driver, always.
    Virtual,
    /// `xcrun simctl`; iOS is unavailable (with the reason) when it does not work.
    Simctl,
}

impl TryFrom<String> for IosDriverChoice {
    type Error = String;

    fn try_from(name: String) -> Result<Self, String> {
        choice(
            &name,
            IOS,
            Self::Simctl,
            ANDROID,
            [Self::Auto, Self::Virtual],
        )
    }
}

/// Which driver serves Android (`drivers.android.driver`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case", try_from = "String")]
pub enum AndroidDriverChoice {
    /// The SDK's tools when they are found and work, else the virtual driver.
    Auto,
    /// The virtual driver, always.
    Virtual,
    /// The SDK's `avdmanager`, `emulator` and `adb`; Android is unavailable (with the reason)
    /// when they do not work.
    AndroidSdk,
}

impl TryFrom<String> for AndroidDriverChoice {
    type Error = String;

    fn try_from(name: String) -> Result<Self, String> {
        choice(
            &name,
            ANDROID,
            Self::AndroidSdk,
            IOS,
            [Self::Auto, Self::Virtual],
        )
    }
}

/// A platform's real driver, as config names it.
struct RealDriver {
    platform: &'static str,
    name: &'static str,
}

const IOS: RealDriver = RealDriver {
    platform: "iOS",
    name: "simctl",
};
const ANDROID: RealDriver = RealDriver {
    platform: "Android",
    name: "android-sdk",
};

/// The choice `name` of a platform whose real driver is `own` (`real` its value): `auto` and
/// `virtual` are `auto_virtual`'s two values; the `other` platform's real driver and any other
/// name are refused, listing this platform's choices.
fn choice<T>(
    name: &str,
    own: RealDriver,
    real: T,
    other: RealDriver,
    auto_virtual: [T; 2],
) -> Result<T, String> {
    let [auto, virtual_driver] = auto_virtual;
    let choices = format!("use auto, {} or virtual", own.name);
    match name {
        "auto" => Ok(auto),
        "virtual" => Ok(virtual_driver),
        _ if name == own.name => Ok(real),
        _ if name == other.name => Err(format!(
            "{} drives {}; {choices}",
            other.name, other.platform
        )),
        _ => Err(format!(
            "no {} driver is called `{name}`; {choices}",
            own.platform
        )),
    }
}

/// `drivers.*`.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", default)]
pub struct DriversConfig {
    /// iOS simulators.
    pub ios: IosDriverConfig,
    /// Android emulators.
    pub android: AndroidDriverConfig,
}

/// `drivers.ios.*`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", default)]
pub struct IosDriverConfig {
    /// `auto` (default), `simctl` or `virtual`.
    pub driver: IosDriverChoice,
    /// The `xcrun` program: a path, or a name looked up in `PATH`.
    pub xcrun: String,
    /// The device set simlock owns (`simctl --set`); default `$SIMLOCK_HOME/devices/ios`.
    pub device_set: Option<String>,
    /// The most one `simctl` call may take (30 s); the call is killed past it.
    pub call_timeout_ms: u64,
    /// The most a boot may take until `bootstatus` says it finished (120 s).
    pub boot_timeout_ms: u64,
}

impl Default for IosDriverConfig {
    fn default() -> Self {
        Self {
            driver: IosDriverChoice::Auto,
            xcrun: "xcrun".into(),
            device_set: None,
            call_timeout_ms: 30_000,
            boot_timeout_ms: 120_000,
        }
    }
}

/// `drivers.android.*`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", default)]
pub struct AndroidDriverConfig {
    /// `auto` (default), `android-sdk` or `virtual`.
    pub driver: AndroidDriverChoice,
    /// The SDK's root; default `$ANDROID_HOME`, else `$ANDROID_SDK_ROOT`.
    pub sdk_root: Option<String>,
    /// The AVD home simlock owns (`ANDROID_AVD_HOME`); default `$SIMLOCK_HOME/devices/android`.
    pub avd_home: Option<String>,
    /// The port of simlock's own adb server (5038; never the user's 5037).
    pub adb_server_port: u16,
    /// The lowest emulator console port (even; the adb port is the next one).
    pub console_port_min: u16,
    /// The highest emulator console port.
    pub console_port_max: u16,
    /// Launch emulators without a window, audio or boot animation.
    pub headless: bool,
    /// The most one tool call may take (30 s); the call is killed past it.
    pub call_timeout_ms: u64,
    /// The most a boot may take until the emulator reports `sys.boot_completed` (180 s).
    pub boot_timeout_ms: u64,
    /// How often a booting emulator is asked whether it finished (2 s).
    pub boot_poll_ms: u64,
}

impl Default for AndroidDriverConfig {
    fn default() -> Self {
        Self {
            driver: AndroidDriverChoice::Auto,
            sdk_root: None,
            avd_home: None,
            adb_server_port: 5038,
            console_port_min: 5586,
            console_port_max: 5682,
            headless: true,
            call_timeout_ms: 30_000,
            boot_timeout_ms: 180_000,
            boot_poll_ms: 2_000,
        }
    }
}

impl Section for DriversConfig {
    const KEY: &'static str = "drivers";
    const MODES: &'static [Mode] = WORKER;
    const TEXT_KEYS: &'static [&'static str] =
        &["ios.deviceSet", "android.sdkRoot", "android.avdHome"];

    fn check(&self, _daemon: &DaemonConfig, _mode: Mode) -> Result<(), SectionError> {
        let bad = |msg: String| Err(SectionError::new(msg));
        let (ios, android) = (&self.ios, &self.android);
        above_zero(&[
            ("drivers.ios.callTimeoutMs", ios.call_timeout_ms),
            ("drivers.ios.bootTimeoutMs", ios.boot_timeout_ms),
            ("drivers.android.callTimeoutMs", android.call_timeout_ms),
            ("drivers.android.bootTimeoutMs", android.boot_timeout_ms),
            ("drivers.android.bootPollMs", android.boot_poll_ms),
        ])?;
        if android.adb_server_port < 1024 || android.adb_server_port == 5037 {
            return bad(format!(
                "drivers.android.adbServerPort: {} is not simlock's own port (1024–65535, never the user's 5037)",
                android.adb_server_port
            ));
        }
        let (min, max) = (android.console_port_min, android.console_port_max);
        if min % 2 != 0 || max % 2 != 0 || min < 1024 || max < min {
            return bad(format!(
                "drivers.android.consolePortMin and drivers.android.consolePortMax: even ports from 1024 with min ≤ max (got {min}–{max})"
            ));
        }
        if (min..=max.saturating_add(1)).contains(&android.adb_server_port) {
            return bad(format!(
                "drivers.android.adbServerPort ({}) is inside the console ports {min}–{}",
                android.adb_server_port,
                max.saturating_add(1)
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;
    use simlock_daemon::config::{ConfigError, Loaded, Sections, coerce, load_text};

    use super::*;

    fn sections() -> Sections {
        Sections::new().with::<DriversConfig>()
    }

    fn load_with(toml: &str) -> Result<Loaded, ConfigError> {
        load_text(toml, Mode::Worker, &sections())
    }

    #[test]
    fn driver_settings_past_their_limits_fail_naming_the_key() {
        let ok = |toml: &str| load_with(toml).is_ok();
        let err = |toml: &str| load_with(toml).unwrap_err().to_string();
        assert!(ok("[drivers.android]\nadbServerPort = 1024"));
        for port in [1023, 5037] {
            let e = err(&format!("[drivers.android]\nadbServerPort = {port}"));
            assert!(e.contains("drivers.android.adbServerPort"), "{e}");
        }
        let e = err("[drivers.android]\nadbServerPort = 5600");
        assert!(e.contains("inside the console ports"), "{e}");
        assert!(
            ok("[drivers.android]\nadbServerPort = 5684"),
            "one past the last adb port"
        );
        assert!(
            !ok("[drivers.android]\nadbServerPort = 5683"),
            "the last adb port"
        );
        assert!(
            !ok("[drivers.android]\nadbServerPort = 5586"),
            "the first console port"
        );
        assert!(
            ok("[drivers.android]\nadbServerPort = 5585"),
            "one below the first console port"
        );
        assert!(
            ok("[drivers.android]\nconsolePortMin = 65532\nconsolePortMax = 65534"),
            "the highest console pair ends at the last port"
        );
        for bad in [
            "consolePortMin = 5587",
            "consolePortMax = 5683",
            "consolePortMin = 5700\nconsolePortMax = 5600",
            "consolePortMin = 1022",
        ] {
            let e = err(&format!("[drivers.android]\n{bad}"));
            assert!(e.contains("drivers.android.consolePortMin"), "{bad}: {e}");
        }
        assert!(ok(
            "[drivers.android]\nconsolePortMin = 5600\nconsolePortMax = 5600"
        ));
        for (section, key) in [
            ("drivers.ios", "callTimeoutMs"),
            ("drivers.ios", "bootTimeoutMs"),
            ("drivers.android", "bootPollMs"),
            ("drivers.android", "callTimeoutMs"),
            ("drivers.android", "bootTimeoutMs"),
        ] {
            let e = err(&format!("[{section}]\n{key} = 0"));
            assert!(e.contains(&format!("{section}.{key}")), "{e}");
            assert!(ok(&format!("[{section}]\n{key} = 1")));
        }
        // Each platform's key names its own drivers, and only those.
        for (text, says) in [
            (
                "[drivers.ios]\ndriver = \"android-sdk\"",
                "drivers.ios.driver: android-sdk drives Android; use auto, simctl or virtual",
            ),
            (
                "[drivers.ios]\ndriver = \"xcode\"",
                "drivers.ios.driver: no iOS driver is called `xcode`; use auto, simctl or virtual",
            ),
            (
                "[drivers.android]\ndriver = \"simctl\"",
                "drivers.android.driver: simctl drives iOS; use auto, android-sdk or virtual",
            ),
            (
                "[drivers.android]\ndriver = \"genymotion\"",
                "drivers.android.driver: no Android driver is called `genymotion`; use auto, android-sdk or virtual",
            ),
        ] {
            assert_eq!(err(text), format!("configuration: {says}"), "{text}");
        }
        for (text, ios, android) in [
            (
                "driver = \"auto\"",
                IosDriverChoice::Auto,
                AndroidDriverChoice::Auto,
            ),
            (
                "driver = \"virtual\"",
                IosDriverChoice::Virtual,
                AndroidDriverChoice::Virtual,
            ),
        ] {
            let both = format!("[drivers.ios]\n{text}\n[drivers.android]\n{text}");
            let drivers = load_with(&both)
                .unwrap()
                .section::<DriversConfig>()
                .unwrap();
            assert_eq!((drivers.ios.driver, drivers.android.driver), (ios, android));
        }
        // Paths are text, even when they look like numbers.
        assert_eq!(
            coerce("drivers.ios.deviceSet", "42", &sections()),
            json!("42")
        );
    }

    #[test]
    fn a_gateway_warns_about_and_does_not_check_the_drivers() {
        let loaded = load_text(
            "[drivers.ios]\ncallTimeoutMs = 0",
            Mode::Gateway,
            &sections(),
        )
        .unwrap();
        assert_eq!(
            loaded.warnings,
            ["drivers.ios.callTimeoutMs is a worker setting; a gateway ignores it"]
        );
    }
}
