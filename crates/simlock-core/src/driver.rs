//! The driver port: what the worker asks of a platform's device tooling, and the virtual
//! driver that answers it with configurable delays (the embedded default).
//!
//! The real drivers (`simctl`; `avdmanager`, `emulator` and `adb`) live in `simlock-drivers`
//! and implement the same [`Driver`] trait; the composition picks one per platform.

use std::sync::Arc;
use std::time::Duration;

use crate::config::VirtualConfig;
use futures::FutureExt;
use futures::future::BoxFuture;
use simlock_contract::ids::DeviceId;
use simlock_contract::model::{
    DeviceAccess, DeviceSpec, DriverKind, DriverStatus, Platform, PlatformCatalog,
};

use crate::catalog::platform_catalog;

/// How long a driver expects each kind of device work to take.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Estimates {
    /// Creating a device.
    pub provision_ms: u64,
    /// Booting a created device.
    pub boot_ms: u64,
    /// Wiping a device after a lease.
    pub reclaim_ms: u64,
}

/// A driver failure.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{platform} driver: {message}")]
pub struct DriverError {
    /// The driver's platform.
    pub platform: Platform,
    /// What failed.
    pub message: String,
}

/// Whether a device runs, as its tools say.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RunState {
    /// Booted and answering.
    Running,
    /// Not running.
    Stopped,
    /// Between states (booting, shutting down, not answering yet): no conclusion.
    Transitioning,
}

/// What a probe saw of one device.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Observation {
    /// The driver's id for the device.
    pub driver_device_id: String,
    /// Its state.
    pub state: RunState,
}

/// What a driver found of a device after a restart.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Adopted {
    /// It runs, and is reached this way.
    Running(DeviceAccess),
    /// It does not run (or does not exist).
    Stopped,
}

/// A device the registry knows, for [`Driver::sweep`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Keep {
    /// The driver's id for it.
    pub driver_device_id: String,
    /// Whether it must not be left running (the registry holds it shut down).
    pub stopped: bool,
}

/// What the worker asks of one platform's device tooling. Every call returns a `'static`
/// future so the worker can run it in a task of its own.
pub trait Driver: Send + Sync + 'static {
    /// The platform served.
    fn platform(&self) -> Platform;
    /// Which driver this is, whether it can serve, and why.
    fn status(&self) -> DriverStatus;
    /// What it can create.
    fn catalog(&self) -> PlatformCatalog;
    /// How long its work takes.
    fn estimates(&self) -> Estimates;
    /// Creates a device of `spec` for the registry's `device`; answers the driver's id for it
    /// (a UDID, an AVD name).
    fn provision(
        &self,
        spec: &DeviceSpec,
        device: &DeviceId,
    ) -> BoxFuture<'static, Result<String, DriverError>>;
    /// Boots a created device until it is ready to use; answers how it is reached.
    fn boot(&self, driver_device_id: &str)
    -> BoxFuture<'static, Result<DeviceAccess, DriverError>>;
    /// Wipes a device after a lease, leaving it running and ready; answers how it is reached.
    fn reclaim(
        &self,
        driver_device_id: &str,
    ) -> BoxFuture<'static, Result<DeviceAccess, DriverError>>;
    /// Boots again a leased device that stopped, keeping its data and its address.
    fn recover(
        &self,
        driver_device_id: &str,
    ) -> BoxFuture<'static, Result<DeviceAccess, DriverError>> {
        self.boot(driver_device_id)
    }
    /// After a restart: whether a device the registry holds running still runs (it is then
    /// attached again to whatever the driver runs, such as its adb server).
    fn adopt(&self, driver_device_id: &str) -> BoxFuture<'static, Result<Adopted, DriverError>>;
    /// Stops a running device, keeping it.
    fn shutdown(&self, driver_device_id: &str) -> BoxFuture<'static, Result<(), DriverError>>;
    /// Destroys a device.
    fn delete(&self, driver_device_id: &str) -> BoxFuture<'static, Result<(), DriverError>>;
    /// After a restart: deletes what the driver made that the registry does not know (a
    /// half-made device, a process of an earlier run) and stops the devices `keep` holds shut
    /// down. Answers the ids of the devices it deleted. Never touches anything it did not make.
    fn sweep(&self, keep: Vec<Keep>) -> BoxFuture<'static, Result<Vec<String>, DriverError>>;
    /// Which of its devices run now; `None` when the driver cannot tell (the virtual one).
    fn probe(&self) -> BoxFuture<'static, Result<Option<Vec<Observation>>, DriverError>>;
    /// The worker stops: stop what the driver runs for itself (an adb server). Devices stay as
    /// they are; the next start adopts them.
    fn close(&self) -> BoxFuture<'static, ()> {
        futures::future::ready(()).boxed()
    }
}

/// Devices that exist only as records: work takes the configured time and always succeeds.
#[derive(Debug, Clone)]
pub struct VirtualDriver {
    platform: Platform,
    catalog: PlatformCatalog,
    estimates: Estimates,
    reason: String,
}

impl VirtualDriver {
    /// The virtual driver of `platform`, or `None` when `config` names no model for it.
    pub fn new(platform: Platform, config: &VirtualConfig) -> Option<Self> {
        Some(Self {
            platform,
            catalog: platform_catalog(platform, &config.models)?,
            estimates: Estimates {
                provision_ms: config.provision_ms,
                boot_ms: config.boot_ms,
                reclaim_ms: config.reclaim_ms,
            },
            reason: "virtual devices from configuration".into(),
        })
    }

    /// The same driver, saying `reason` for why it serves (in `status`).
    #[must_use]
    pub fn because(mut self, reason: impl Into<String>) -> Self {
        self.reason = reason.into();
        self
    }

    fn access(&self, driver_device_id: &str) -> DeviceAccess {
        DeviceAccess::Virtual {
            platform: self.platform,
            driver_device_id: driver_device_id.to_owned(),
        }
    }

    fn ready_after(
        &self,
        driver_device_id: &str,
        ms: u64,
    ) -> BoxFuture<'static, Result<DeviceAccess, DriverError>> {
        let access = self.access(driver_device_id);
        let wait = Self::after(ms);
        async move {
            wait.await?;
            Ok(access)
        }
        .boxed()
    }

    fn after(ms: u64) -> BoxFuture<'static, Result<(), DriverError>> {
        async move {
            if ms > 0 {
                tokio::time::sleep(Duration::from_millis(ms)).await;
            }
            Ok(())
        }
        .boxed()
    }
}

impl Driver for VirtualDriver {
    fn platform(&self) -> Platform {
        self.platform
    }

    fn status(&self) -> DriverStatus {
        DriverStatus {
            platform: self.platform,
            driver: DriverKind::Virtual,
            available: true,
            reason: self.reason.clone(),
        }
    }

    fn catalog(&self) -> PlatformCatalog {
        self.catalog.clone()
    }

    fn estimates(&self) -> Estimates {
        self.estimates
    }

    fn provision(
        &self,
        _spec: &DeviceSpec,
        _device: &DeviceId,
    ) -> BoxFuture<'static, Result<String, DriverError>> {
        let uuid = uuid::Uuid::new_v4();
        let id = match self.platform {
            // Shaped like a simulator UDID.
            Platform::Ios => uuid.hyphenated().to_string().to_uppercase(),
            Platform::Android => format!("virtual-{}", &uuid.simple().to_string()[..12]),
        };
        let wait = Self::after(self.estimates.provision_ms);
        async move {
            wait.await?;
            Ok(id)
        }
        .boxed()
    }

    fn boot(
        &self,
        driver_device_id: &str,
    ) -> BoxFuture<'static, Result<DeviceAccess, DriverError>> {
        self.ready_after(driver_device_id, self.estimates.boot_ms)
    }

    fn reclaim(
        &self,
        driver_device_id: &str,
    ) -> BoxFuture<'static, Result<DeviceAccess, DriverError>> {
        self.ready_after(driver_device_id, self.estimates.reclaim_ms)
    }

    fn adopt(&self, driver_device_id: &str) -> BoxFuture<'static, Result<Adopted, DriverError>> {
        let access = self.access(driver_device_id);
        async move { Ok(Adopted::Running(access)) }.boxed()
    }

    fn shutdown(&self, _driver_device_id: &str) -> BoxFuture<'static, Result<(), DriverError>> {
        Self::after(0)
    }

    fn delete(&self, _driver_device_id: &str) -> BoxFuture<'static, Result<(), DriverError>> {
        Self::after(0)
    }

    fn sweep(&self, _keep: Vec<Keep>) -> BoxFuture<'static, Result<Vec<String>, DriverError>> {
        async { Ok(Vec::new()) }.boxed()
    }

    fn probe(&self) -> BoxFuture<'static, Result<Option<Vec<Observation>>, DriverError>> {
        async { Ok(None) }.boxed()
    }
}

/// The virtual drivers for every platform `config` names models of.
pub fn virtual_drivers(config: &VirtualConfig) -> Vec<Arc<dyn Driver>> {
    Platform::ALL
        .into_iter()
        .filter_map(|p| VirtualDriver::new(p, config))
        .map(|d| Arc::new(d) as Arc<dyn Driver>)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn virtual_work_takes_the_configured_time() {
        let config = VirtualConfig::default();
        let drivers = virtual_drivers(&config);
        assert_eq!(drivers.len(), 2);
        let ios = &drivers[0];
        assert_eq!(ios.platform(), Platform::Ios);
        let spec = DeviceSpec {
            platform: Platform::Ios,
            model: "iPhone 16".into(),
            os_version: "18.2".into(),
        };
        let start = tokio::time::Instant::now();
        let id = ios.provision(&spec, &DeviceId::mint()).await.unwrap();
        assert_eq!(id.len(), 36);
        assert_eq!(
            start.elapsed(),
            Duration::from_millis(config.provision_ms),
            "provisioning takes virtual.provisionMs"
        );
        ios.boot(&id).await.unwrap();
        assert_eq!(
            start.elapsed(),
            Duration::from_millis(config.provision_ms + config.boot_ms)
        );
    }
}
