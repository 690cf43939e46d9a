//! Which driver serves each platform: `drivers.<platform>.driver` from config, where `auto`
//! takes the real driver when its tools are found and work, else the virtual one. An explicit
//! real driver whose tools do not work leaves the platform **unavailable**, with the reason in
//! `status` and the catalog, rather than failing the worker's start. One log line per platform
//! says which driver serves it and why.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use futures::FutureExt;
use futures::future::BoxFuture;
use simlock_contract::ids::DeviceId;
use simlock_contract::model::{
    DeviceAccess, DeviceSpec, DriverKind, DriverStatus, Platform, PlatformCatalog,
};
use simlock_core::config::VirtualConfig;
use simlock_core::{Adopted, Driver, DriverError, Estimates, Keep, Observation, VirtualDriver};

use crate::config::{AndroidDriverChoice, DriversConfig, IosDriverChoice};
use tracing::{info, warn};

use crate::android::{AndroidDriver, AndroidSettings, Sdk};
use crate::ios::{IosSettings, SimctlDriver};

/// A platform whose driver cannot serve: its catalog lists nothing and says why, and every
/// call fails with the reason.
#[derive(Debug, Clone)]
pub struct Unavailable {
    platform: Platform,
    driver: DriverKind,
    reason: String,
}

impl Unavailable {
    /// `platform`'s `driver`, unavailable for `reason`.
    pub fn new(platform: Platform, driver: DriverKind, reason: impl Into<String>) -> Self {
        Self {
            platform,
            driver,
            reason: reason.into(),
        }
    }

    fn fail<T: Send + 'static>(&self) -> BoxFuture<'static, Result<T, DriverError>> {
        let error = DriverError {
            platform: self.platform,
            message: format!("the driver is unavailable: {}", self.reason),
        };
        async move { Err(error) }.boxed()
    }
}

impl Driver for Unavailable {
    fn platform(&self) -> Platform {
        self.platform
    }

    fn status(&self) -> DriverStatus {
        DriverStatus {
            platform: self.platform,
            driver: self.driver,
            available: false,
            reason: self.reason.clone(),
        }
    }

    fn catalog(&self) -> PlatformCatalog {
        PlatformCatalog {
            platform: self.platform,
            models: Vec::new(),
            runtimes: Vec::new(),
            default_runtime: None,
            model_runtimes: Default::default(),
            model_aliases: Default::default(),
            model_workers: None,
            runtime_workers: None,
            unavailable: Some(self.reason.clone()),
        }
    }

    fn estimates(&self) -> Estimates {
        Estimates::default()
    }

    fn provision(
        &self,
        _: &DeviceSpec,
        _: &DeviceId,
    ) -> BoxFuture<'static, Result<String, DriverError>> {
        self.fail()
    }

    fn boot(&self, _: &str) -> BoxFuture<'static, Result<DeviceAccess, DriverError>> {
        self.fail()
    }

    fn reclaim(&self, _: &str) -> BoxFuture<'static, Result<DeviceAccess, DriverError>> {
        self.fail()
    }

    fn adopt(&self, _: &str) -> BoxFuture<'static, Result<Adopted, DriverError>> {
        self.fail()
    }

    fn shutdown(&self, _: &str) -> BoxFuture<'static, Result<(), DriverError>> {
        self.fail()
    }

    fn delete(&self, _: &str) -> BoxFuture<'static, Result<(), DriverError>> {
        self.fail()
    }

    fn sweep(&self, _: Vec<Keep>) -> BoxFuture<'static, Result<Vec<String>, DriverError>> {
        self.fail()
    }

    fn probe(&self) -> BoxFuture<'static, Result<Option<Vec<Observation>>, DriverError>> {
        // Nothing to watch: no conclusion.
        async { Ok(None) }.boxed()
    }
}

/// `program` as a path: itself when it names one, else the first match in `PATH`.
fn find_program(program: &str) -> Option<PathBuf> {
    if program.contains('/') {
        let path = PathBuf::from(program);
        return path.is_file().then_some(path);
    }
    std::env::split_paths(&std::env::var_os("PATH")?)
        .map(|dir| dir.join(program))
        .find(|p| p.is_file())
}

/// The SDK root config or the environment names.
fn sdk_root(configured: Option<&str>) -> Option<PathBuf> {
    configured
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("ANDROID_HOME").map(PathBuf::from))
        .or_else(|| std::env::var_os("ANDROID_SDK_ROOT").map(PathBuf::from))
        .filter(|p| !p.as_os_str().is_empty())
}

/// What serves one platform.
enum Choice {
    Real(Arc<dyn Driver>),
    Virtual(String),
    Unavailable(DriverKind, String),
}

async fn ios(config: &DriversConfig, home: &Path) -> Choice {
    let c = &config.ios;
    let auto = match c.driver {
        IosDriverChoice::Virtual => return Choice::Virtual("drivers.ios.driver is virtual".into()),
        IosDriverChoice::Auto => true,
        IosDriverChoice::Simctl => false,
    };
    let Some(xcrun) = find_program(&c.xcrun) else {
        let why = format!("{} not found", c.xcrun);
        return if auto {
            Choice::Virtual(format!("auto: {why}"))
        } else {
            Choice::Unavailable(DriverKind::Simctl, why)
        };
    };
    let settings = IosSettings {
        xcrun,
        device_set: c
            .device_set
            .as_ref()
            .map_or_else(|| home.join("devices/ios"), PathBuf::from),
        ledger: home.join("drivers/ios/processes"),
        call_timeout: Duration::from_millis(c.call_timeout_ms),
        boot_timeout: Duration::from_millis(c.boot_timeout_ms),
    };
    match SimctlDriver::open(settings).await {
        Ok(driver) => Choice::Real(Arc::new(driver)),
        Err(e) if auto => Choice::Virtual(format!(
            "auto: xcrun was found but simctl does not work: {e}"
        )),
        Err(e) => Choice::Unavailable(DriverKind::Simctl, format!("simctl does not work: {e}")),
    }
}

async fn android(config: &DriversConfig, home: &Path) -> Choice {
    let c = &config.android;
    let auto = match c.driver {
        AndroidDriverChoice::Virtual => {
            return Choice::Virtual("drivers.android.driver is virtual".into());
        }
        AndroidDriverChoice::Auto => true,
        AndroidDriverChoice::AndroidSdk => false,
    };
    let missing = |why: String| {
        if auto {
            Choice::Virtual(format!("auto: {why}"))
        } else {
            Choice::Unavailable(DriverKind::AndroidSdk, why)
        }
    };
    let Some(root) = sdk_root(c.sdk_root.as_deref()) else {
        return missing(
            "no Android SDK (drivers.android.sdkRoot, ANDROID_HOME and ANDROID_SDK_ROOT are unset)"
                .into(),
        );
    };
    let sdk = match Sdk::at(&root) {
        Ok(sdk) => sdk,
        Err(why) => return missing(why),
    };
    let settings = AndroidSettings {
        sdk,
        avd_home: c
            .avd_home
            .as_ref()
            .map_or_else(|| home.join("devices/android"), PathBuf::from),
        state_dir: home.join("drivers/android"),
        adb_server_port: c.adb_server_port,
        console_ports: (c.console_port_min, c.console_port_max),
        headless: c.headless,
        call_timeout: Duration::from_millis(c.call_timeout_ms),
        boot_timeout: Duration::from_millis(c.boot_timeout_ms),
        boot_poll: Duration::from_millis(c.boot_poll_ms),
    };
    match AndroidDriver::open(settings).await {
        Ok(driver) => Choice::Real(Arc::new(driver)),
        Err(e) if auto => Choice::Virtual(format!(
            "auto: the Android SDK was found but does not work: {e}"
        )),
        Err(e) => Choice::Unavailable(
            DriverKind::AndroidSdk,
            format!("the Android SDK does not work: {e}"),
        ),
    }
}

/// The drivers of a worker whose home is `home`, one per platform served, each choice logged
/// once (which driver, and why); a platform served virtually gets the models of
/// `virtual_devices`.
pub async fn select(
    config: &DriversConfig,
    virtual_devices: &VirtualConfig,
    home: &Path,
) -> Vec<Arc<dyn Driver>> {
    let mut drivers: Vec<Arc<dyn Driver>> = Vec::new();
    for platform in Platform::ALL {
        let choice = match platform {
            Platform::Ios => ios(config, home).await,
            Platform::Android => android(config, home).await,
        };
        let driver: Option<Arc<dyn Driver>> = match choice {
            Choice::Real(d) => Some(d),
            Choice::Virtual(why) => VirtualDriver::new(platform, virtual_devices).map(|d| {
                Arc::new(d.because(format!("{why}; virtual devices from configuration")))
                    as Arc<dyn Driver>
            }),
            Choice::Unavailable(kind, why) => Some(Arc::new(Unavailable::new(platform, kind, why))),
        };
        match &driver {
            Some(d) => {
                let s = d.status();
                if s.available {
                    info!(%platform, driver = s.driver.as_str(), reason = %s.reason, "driver selected");
                } else {
                    warn!(%platform, driver = s.driver.as_str(), reason = %s.reason, "driver unavailable");
                }
            }
            None => {
                info!(%platform, "no driver: the virtual catalog has no model of this platform")
            }
        }
        drivers.extend(driver);
    }
    drivers
}
