//! The driver port: what the worker asks of a platform's device tooling, and the virtual
//! driver that answers it with configurable delays (the embedded default).
//!
//! Real drivers (`simctl`, `adb`/`emulator`) implement the same [`Driver`] trait later.

use std::sync::Arc;
use std::time::Duration;

use futures::FutureExt;
use futures::future::BoxFuture;
use simlock_contract::model::{DeviceSpec, Platform, PlatformCatalog};
use simlock_daemon::config::VirtualConfig;

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

/// What the worker asks of one platform's device tooling. Every call returns a `'static`
/// future so the worker can run it in a task of its own.
pub trait Driver: Send + Sync + 'static {
    /// The platform served.
    fn platform(&self) -> Platform;
    /// What it can create.
    fn catalog(&self) -> PlatformCatalog;
    /// How long its work takes.
    fn estimates(&self) -> Estimates;
    /// Creates a device of `spec`; answers the driver's id for it (a UDID, an AVD serial).
    fn provision(&self, spec: &DeviceSpec) -> BoxFuture<'static, Result<String, DriverError>>;
    /// Boots a created device until it is ready to use.
    fn boot(&self, driver_device_id: &str) -> BoxFuture<'static, Result<(), DriverError>>;
    /// Wipes a device after a lease, leaving it running and ready.
    fn reclaim(&self, driver_device_id: &str) -> BoxFuture<'static, Result<(), DriverError>>;
    /// Stops a running device, keeping it.
    fn shutdown(&self, driver_device_id: &str) -> BoxFuture<'static, Result<(), DriverError>>;
    /// Destroys a device.
    fn delete(&self, driver_device_id: &str) -> BoxFuture<'static, Result<(), DriverError>>;
}

/// Devices that exist only as records: work takes the configured time and always succeeds.
#[derive(Debug, Clone)]
pub struct VirtualDriver {
    platform: Platform,
    catalog: PlatformCatalog,
    estimates: Estimates,
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
        })
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

    fn catalog(&self) -> PlatformCatalog {
        self.catalog.clone()
    }

    fn estimates(&self) -> Estimates {
        self.estimates
    }

    fn provision(&self, _spec: &DeviceSpec) -> BoxFuture<'static, Result<String, DriverError>> {
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

    fn boot(&self, _driver_device_id: &str) -> BoxFuture<'static, Result<(), DriverError>> {
        Self::after(self.estimates.boot_ms)
    }

    fn reclaim(&self, _driver_device_id: &str) -> BoxFuture<'static, Result<(), DriverError>> {
        Self::after(self.estimates.reclaim_ms)
    }

    fn shutdown(&self, _driver_device_id: &str) -> BoxFuture<'static, Result<(), DriverError>> {
        Self::after(0)
    }

    fn delete(&self, _driver_device_id: &str) -> BoxFuture<'static, Result<(), DriverError>> {
        Self::after(0)
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
        let id = ios.provision(&spec).await.unwrap();
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
