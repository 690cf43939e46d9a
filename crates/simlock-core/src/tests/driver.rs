//! A driver that hangs cannot keep a device busy and its request waiting for ever.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use futures::future::BoxFuture;
use simlock_contract::ErrorCode;
use simlock_contract::ids::DeviceId;
use simlock_contract::model::{DeviceAccess, DeviceSpec, DriverStatus, Platform, PlatformCatalog};

use super::*;
use crate::driver::{Adopted, Driver, DriverError, Estimates, Keep, Observation};

/// The virtual iOS driver, except that provisioning never finishes.
struct Hangs {
    inner: Arc<dyn Driver>,
    provisions: Arc<AtomicUsize>,
}

impl Driver for Hangs {
    fn platform(&self) -> Platform {
        self.inner.platform()
    }

    fn status(&self) -> DriverStatus {
        self.inner.status()
    }

    fn catalog(&self) -> PlatformCatalog {
        self.inner.catalog()
    }

    fn estimates(&self) -> Estimates {
        self.inner.estimates()
    }

    fn provision(
        &self,
        _spec: &DeviceSpec,
        _device: &DeviceId,
    ) -> BoxFuture<'static, Result<String, DriverError>> {
        self.provisions.fetch_add(1, Ordering::SeqCst);
        Box::pin(futures::future::pending())
    }

    fn boot(&self, id: &str) -> BoxFuture<'static, Result<DeviceAccess, DriverError>> {
        self.inner.boot(id)
    }

    fn reclaim(&self, id: &str) -> BoxFuture<'static, Result<DeviceAccess, DriverError>> {
        self.inner.reclaim(id)
    }

    fn adopt(&self, id: &str) -> BoxFuture<'static, Result<Adopted, DriverError>> {
        self.inner.adopt(id)
    }

    fn shutdown(&self, id: &str) -> BoxFuture<'static, Result<(), DriverError>> {
        self.inner.shutdown(id)
    }

    fn delete(&self, id: &str) -> BoxFuture<'static, Result<(), DriverError>> {
        self.inner.delete(id)
    }

    fn sweep(&self, keep: Vec<Keep>) -> BoxFuture<'static, Result<Vec<String>, DriverError>> {
        self.inner.sweep(keep)
    }

    fn probe(&self) -> BoxFuture<'static, Result<Option<Vec<Observation>>, DriverError>> {
        self.inner.probe()
    }
}

#[tokio::test(start_paused = true)]
async fn a_driver_call_past_its_bound_fails_and_the_request_settles() {
    let config = config();
    let inner = virtual_drivers(&config.virtual_devices)
        .into_iter()
        .find(|d| d.platform() == Platform::Ios)
        .unwrap();
    let provisions = Arc::new(AtomicUsize::new(0));
    let hangs: Arc<dyn Driver> = Arc::new(Hangs {
        inner,
        provisions: provisions.clone(),
    });
    let h = Harness::build(Build {
        config,
        drivers: Some(vec![hangs]),
        ..Build::default()
    });
    let err = h.lease("agent-a", ios()).await.unwrap_err();
    assert_eq!(err.code, ErrorCode::Internal, "{}", err.message);
    assert!(provisions.load(Ordering::SeqCst) >= 1);
    assert!(
        h.worker.waiting().is_empty(),
        "the request is settled, not left waiting"
    );
}
