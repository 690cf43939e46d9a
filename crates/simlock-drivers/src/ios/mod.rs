//! iOS simulators over `xcrun simctl`, in a device set simlock owns.
//!
//! Every call is `xcrun simctl --set <device set> …`: simulators outside the set are invisible
//! to the driver (simctl answers `Invalid device` for their UDIDs), so it cannot touch one. A
//! boot is `boot` (an already booted device is fine) then `bootstatus -b`, bounded by
//! `drivers.ios.bootTimeoutMs` (past it the boot is abandoned and the simulator shut down), then
//! checked against `list -j devices`, since `bootstatus` can report a failure for a device that
//! did boot. A reclaim is `shutdown`, `erase`, then a boot: the next lease gets a clean device
//! that is already running.

pub mod json;

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use futures::FutureExt;
use futures::future::BoxFuture;
use simlock_contract::ids::DeviceId;
use simlock_contract::model::{
    DeviceAccess, DeviceSpec, DriverKind, DriverStatus, Platform, PlatformCatalog,
};
use simlock_core::{Adopted, Driver, DriverError, Estimates, Keep, Observation, RunState};

use crate::error::ToolError;
use crate::locks::DeviceLocks;
use crate::process::{Runner, make_private_dir, reap};

use self::json::{Devices, IosCatalog, Listing};

/// The marker simlock writes at the root of the device set it owns.
pub const MARKER: &str = ".simlock-owned.json";

/// What the iOS driver is built from.
#[derive(Debug, Clone)]
pub struct IosSettings {
    /// The `xcrun` program.
    pub xcrun: PathBuf,
    /// The device set simlock owns.
    pub device_set: PathBuf,
    /// Where its process ledger lives.
    pub ledger: PathBuf,
    /// The bound on one `simctl` call.
    pub call_timeout: Duration,
    /// The bound on a boot.
    pub boot_timeout: Duration,
}

struct Inner {
    settings: IosSettings,
    runner: Runner,
    catalog: IosCatalog,
    locks: DeviceLocks,
    reason: String,
}

/// The iOS driver.
#[derive(Clone)]
pub struct SimctlDriver {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for SimctlDriver {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SimctlDriver")
            .field("device_set", &self.inner.settings.device_set)
            .finish_non_exhaustive()
    }
}

impl SimctlDriver {
    /// Opens the driver: makes the device set (owner-only, marked as simlock's), stops what an
    /// earlier run left running (a `bootstatus` the worker waited on when it died), and reads
    /// the catalog from `simctl list -j devicetypes runtimes`.
    ///
    /// # Errors
    /// When simctl cannot be run, answers what cannot be read, or pairs no runtime with an
    /// iPhone or iPad.
    pub async fn open(settings: IosSettings) -> Result<Self, ToolError> {
        make_private_dir(&settings.device_set)?;
        let marker = settings.device_set.join(MARKER);
        if !marker.exists() {
            std::fs::write(
                &marker,
                "{\"schemaVersion\":1,\"owner\":\"simlock\",\"platform\":\"ios\"}\n",
            )
            .map_err(|e| ToolError::io(format!("marking {}", settings.device_set.display()), e))?;
        }
        let ledger = Arc::new(crate::process::open_ledger(&settings.ledger)?);
        reap(&ledger, |_| false).await;
        let runner = Runner::new(ledger, Vec::new());
        let mut inner = Inner {
            settings,
            runner,
            catalog: IosCatalog::default(),
            locks: DeviceLocks::default(),
            reason: String::new(),
        };
        let listing: Listing = inner
            .json(
                &["list", "-j", "devicetypes", "runtimes"],
                "a device type and runtime listing",
            )
            .await?;
        inner.catalog = IosCatalog::from_listing(&listing);
        if inner.catalog.types.is_empty() {
            return Err(ToolError::State(
                "simctl lists no available iOS runtime that pairs with an iPhone or iPad device type"
                    .into(),
            ));
        }
        inner.reason = format!(
            "xcrun simctl ({}), device set {}: {} models on {} runtimes",
            inner.settings.xcrun.display(),
            inner.settings.device_set.display(),
            inner.catalog.types.len(),
            inner.catalog.runtimes.len()
        );
        Ok(Self {
            inner: Arc::new(inner),
        })
    }

    /// The device set.
    pub fn device_set(&self) -> &Path {
        &self.inner.settings.device_set
    }

    /// Why it serves (for status).
    pub fn reason(&self) -> &str {
        &self.inner.reason
    }
}

impl Inner {
    fn args(&self, sub: &[&str]) -> Vec<String> {
        let mut args = vec![
            "simctl".to_owned(),
            "--set".to_owned(),
            self.settings.device_set.display().to_string(),
        ];
        args.extend(sub.iter().map(|s| (*s).to_owned()));
        args
    }

    async fn simctl(&self, sub: &[&str]) -> Result<String, ToolError> {
        self.simctl_within(sub, self.settings.call_timeout).await
    }

    async fn simctl_within(&self, sub: &[&str], bound: Duration) -> Result<String, ToolError> {
        let out = self
            .runner
            .run(&self.settings.xcrun, &self.args(sub), None, bound)
            .await?;
        Ok(out.stdout)
    }

    async fn json<T: serde::de::DeserializeOwned>(
        &self,
        sub: &[&str],
        what: &'static str,
    ) -> Result<T, ToolError> {
        let text = self.simctl(sub).await?;
        serde_json::from_str(&text).map_err(|e| ToolError::Garbled {
            command: format!("simctl {}", sub.join(" ")),
            what,
            detail: e.to_string(),
        })
    }

    async fn devices(&self) -> Result<Devices, ToolError> {
        self.json(&["list", "-j", "devices"], "a device listing")
            .await
    }

    fn access(&self, udid: &str) -> DeviceAccess {
        DeviceAccess::IosSimulator {
            udid: udid.to_owned(),
            device_set: self.settings.device_set.display().to_string(),
        }
    }

    /// `shutdown`, where a device already shut down is fine.
    async fn shutdown(&self, udid: &str) -> Result<(), ToolError> {
        match self.simctl(&["shutdown", udid]).await {
            Ok(_) => Ok(()),
            Err(e) if e.says("current state: Shutdown") => Ok(()),
            Err(e) => Err(e),
        }
    }

    async fn create(&self, spec: &DeviceSpec, device: &DeviceId) -> Result<String, ToolError> {
        let ty = self.catalog.type_id(&spec.model).ok_or_else(|| {
            ToolError::State(format!("simctl lists no device type named {}", spec.model))
        })?;
        let runtime = self.catalog.runtime_id(&spec.os_version).ok_or_else(|| {
            ToolError::State(format!("simctl lists no iOS {} runtime", spec.os_version))
        })?;
        let name = format!("simlock-{device}");
        let out = self.simctl(&["create", &name, ty, runtime]).await?;
        let udid = out.trim();
        if !is_udid(udid) {
            return Err(ToolError::Garbled {
                command: "simctl create".into(),
                what: "the new simulator's UDID",
                detail: format!("{:?}", truncate(udid)),
            });
        }
        Ok(udid.to_owned())
    }

    async fn boot(&self, udid: &str) -> Result<DeviceAccess, ToolError> {
        match self.simctl(&["boot", udid]).await {
            Ok(_) => {}
            Err(e)
                if e.says("current state: Booted")
                    || e.says("current state: Booting")
                    || e.says("already booted") => {}
            Err(e) => return Err(e),
        }
        let bound = self.settings.boot_timeout;
        let waited = self.simctl_within(&["bootstatus", udid, "-b"], bound).await;
        if let Err(ToolError::Timeout { .. }) = &waited {
            // Abandoned: it must not keep booting (nor be handed out).
            let _ = self.shutdown(udid).await;
            return Err(ToolError::State(format!(
                "simulator {udid} did not finish booting within {} s; it was shut down",
                bound.as_secs()
            )));
        }
        // bootstatus may report a failure for a device that booted: the listing decides.
        let devices = self.devices().await?;
        match devices.get(udid) {
            Some(d) if d.state == "Booted" => Ok(self.access(udid)),
            Some(d) => Err(match waited {
                Err(e) => e,
                Ok(_) => ToolError::State(format!(
                    "simulator {udid} is {} after bootstatus finished",
                    d.state
                )),
            }),
            None => Err(ToolError::State(format!(
                "simulator {udid} is not in simlock's device set"
            ))),
        }
    }

    async fn reclaim(&self, udid: &str) -> Result<DeviceAccess, ToolError> {
        self.shutdown(udid).await?;
        self.simctl(&["erase", udid]).await?;
        self.boot(udid).await
    }

    async fn delete(&self, udid: &str) -> Result<(), ToolError> {
        match self.shutdown(udid).await {
            Err(e) if e.says("Invalid device") => return Ok(()),
            other => other?,
        }
        match self.simctl(&["delete", udid]).await {
            Ok(_) => Ok(()),
            Err(e) if e.says("Invalid device") => Ok(()),
            Err(e) => Err(e),
        }
    }
}

/// The port's future for a driver call.
fn boxed<T: Send + 'static>(
    call: impl Future<Output = Result<T, ToolError>> + Send + 'static,
) -> BoxFuture<'static, Result<T, DriverError>> {
    async move { call.await.map_err(|e| e.into_driver(Platform::Ios)) }.boxed()
}

fn is_udid(text: &str) -> bool {
    text.len() == 36
        && text.char_indices().all(|(i, c)| match i {
            8 | 13 | 18 | 23 => c == '-',
            _ => c.is_ascii_hexdigit() && !c.is_ascii_lowercase(),
        })
}

fn truncate(text: &str) -> String {
    text.chars().take(80).collect()
}

fn run_state(state: &str) -> RunState {
    match state {
        "Booted" => RunState::Running,
        "Shutdown" => RunState::Stopped,
        _ => RunState::Transitioning,
    }
}

impl Driver for SimctlDriver {
    fn platform(&self) -> Platform {
        Platform::Ios
    }

    fn status(&self) -> DriverStatus {
        DriverStatus {
            platform: Platform::Ios,
            driver: DriverKind::Simctl,
            available: true,
            reason: self.inner.reason.clone(),
        }
    }

    fn catalog(&self) -> PlatformCatalog {
        self.inner.catalog.platform_catalog()
    }

    fn estimates(&self) -> Estimates {
        // The original's measurements: create ≈ 0.5 s, a cold boot up to 60 s, erase + boot.
        Estimates {
            provision_ms: 500,
            boot_ms: 60_000,
            reclaim_ms: 40_000,
        }
    }

    fn provision(
        &self,
        spec: &DeviceSpec,
        device: &DeviceId,
    ) -> BoxFuture<'static, Result<String, DriverError>> {
        let (spec, device) = (spec.clone(), device.clone());
        let i = self.inner.clone();
        boxed(async move { i.create(&spec, &device).await })
    }

    fn boot(&self, udid: &str) -> BoxFuture<'static, Result<DeviceAccess, DriverError>> {
        let udid = udid.to_owned();
        let i = self.inner.clone();
        boxed(async move {
            let _held = i.locks.lock(&udid).await;
            i.boot(&udid).await
        })
    }

    fn reclaim(&self, udid: &str) -> BoxFuture<'static, Result<DeviceAccess, DriverError>> {
        let udid = udid.to_owned();
        let i = self.inner.clone();
        boxed(async move {
            let _held = i.locks.lock(&udid).await;
            i.reclaim(&udid).await
        })
    }

    fn adopt(&self, udid: &str) -> BoxFuture<'static, Result<Adopted, DriverError>> {
        let udid = udid.to_owned();
        let i = self.inner.clone();
        boxed(async move {
            let _held = i.locks.lock(&udid).await;
            let devices = i.devices().await?;
            Ok(match devices.get(&udid) {
                Some(d) if d.state == "Booted" => Adopted::Running(i.access(&udid)),
                _ => Adopted::Stopped,
            })
        })
    }

    fn shutdown(&self, udid: &str) -> BoxFuture<'static, Result<(), DriverError>> {
        let udid = udid.to_owned();
        let i = self.inner.clone();
        boxed(async move {
            let _held = i.locks.lock(&udid).await;
            i.shutdown(&udid).await
        })
    }

    fn delete(&self, udid: &str) -> BoxFuture<'static, Result<(), DriverError>> {
        let udid = udid.to_owned();
        let i = self.inner.clone();
        boxed(async move {
            let _held = i.locks.lock(&udid).await;
            i.delete(&udid).await
        })
    }

    fn sweep(&self, keep: Vec<Keep>) -> BoxFuture<'static, Result<Vec<String>, DriverError>> {
        let i = self.inner.clone();
        boxed(async move {
            let devices = i.devices().await?;
            let mut purged = Vec::new();
            for d in devices.all() {
                let kept = keep.iter().find(|k| k.driver_device_id == d.udid);
                let _held = i.locks.lock(&d.udid).await;
                match kept {
                    None => {
                        tracing::info!(udid = %d.udid, state = %d.state, "deleting a simulator no lease or device record holds (an earlier run's)");
                        i.delete(&d.udid).await?;
                        purged.push(d.udid.clone());
                    }
                    Some(k) if k.stopped && d.state != "Shutdown" => {
                        tracing::info!(udid = %d.udid, state = %d.state, "shutting down a simulator an earlier run left booted");
                        i.shutdown(&d.udid).await?;
                    }
                    Some(_) => {}
                }
            }
            Ok(purged)
        })
    }

    fn probe(&self) -> BoxFuture<'static, Result<Option<Vec<Observation>>, DriverError>> {
        let i = self.inner.clone();
        boxed(async move {
            let devices = i.devices().await?;
            Ok(Some(
                devices
                    .all()
                    .map(|d| Observation {
                        driver_device_id: d.udid.clone(),
                        state: run_state(&d.state),
                    })
                    .collect(),
            ))
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn udids_are_upper_case_uuids() {
        assert!(is_udid("03423413-ED3A-44FD-AD37-E9B456938AAA"));
        assert!(!is_udid("03423413-ed3a-44fd-ad37-e9b456938aaa"));
        assert!(!is_udid("An error was encountered processing the command"));
        assert!(!is_udid(""));
    }
}
