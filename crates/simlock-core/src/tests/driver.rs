//! A driver that hangs cannot keep a device busy and its request waiting for ever.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use futures::future::BoxFuture;
use simlock_contract::ErrorCode;
use simlock_contract::ids::DeviceId;
use simlock_contract::model::{DeviceAccess, DeviceSpec, DriverStatus, Platform, PlatformCatalog};

use super::*;
use crate::driver::{Adopted, Driver, DriverError, Estimates, Keep, Observation};

/// The virtual iOS driver, except that provisioning never finishes (`hang_provision`) or every
/// reclaim fails (`fail_reclaim`).
struct Hangs {
    inner: Arc<dyn Driver>,
    provisions: Arc<AtomicUsize>,
    hang_provision: bool,
    fail_reclaim: bool,
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
        if self.hang_provision {
            Box::pin(futures::future::pending())
        } else {
            self.inner.provision(_spec, _device)
        }
    }

    fn boot(&self, id: &str) -> BoxFuture<'static, Result<DeviceAccess, DriverError>> {
        self.inner.boot(id)
    }

    fn reclaim(&self, id: &str) -> BoxFuture<'static, Result<DeviceAccess, DriverError>> {
        if self.fail_reclaim {
            let platform = self.inner.platform();
            return Box::pin(async move {
                Err(DriverError {
                    platform,
                    message: "erase failed".into(),
                })
            });
        }
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
    let inner = virtual_drivers(&config.core.virtual_devices)
        .into_iter()
        .find(|d| d.platform() == Platform::Ios)
        .unwrap();
    let provisions = Arc::new(AtomicUsize::new(0));
    let hangs: Arc<dyn Driver> = Arc::new(Hangs {
        inner,
        provisions: provisions.clone(),
        hang_provision: true,
        fail_reclaim: false,
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

#[tokio::test(start_paused = true)]
async fn a_quarantined_device_and_a_leases_access_survive_a_restart() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("state.db");
    let clock = TokioClock::starting_at(T0).shared();
    let build = |fail_reclaim: bool| {
        let mut config = config();
        config.core.health.enabled = false;
        let inner = virtual_drivers(&config.core.virtual_devices)
            .into_iter()
            .find(|d| d.platform() == Platform::Ios)
            .unwrap();
        let driver: Arc<dyn Driver> = Arc::new(Hangs {
            inner,
            provisions: Arc::new(AtomicUsize::new(0)),
            hang_provision: false,
            fail_reclaim,
        });
        Harness::build(Build {
            config,
            db: Some(Database::open(&path).unwrap()),
            clock: Some(clock.clone()),
            drivers: Some(vec![driver]),
            ..Build::default()
        })
    };
    let first = build(true);
    let mut events = first.bus.follow();
    let kept = first.lease("agent-a", ios()).await.unwrap();
    let released = first.lease("agent-b", ios()).await.unwrap();
    first
        .call::<simlock_contract::ops::LeaseRelease>(
            agent("agent-b"),
            &simlock_contract::ops::LeaseIdInput {
                reason: None,
                lease_id: released.lease.id.to_string(),
            },
        )
        .await
        .unwrap();
    next_event(&mut events, "device.quarantined").await;
    let before = first
        .worker
        .devices()
        .into_iter()
        .find(|d| d.id == released.device.id)
        .unwrap();
    assert_eq!(
        before.state,
        simlock_contract::model::DeviceState::Quarantined
    );
    drop(first);

    let second = build(false);
    let after = second
        .worker
        .devices()
        .into_iter()
        .find(|d| d.id == released.device.id)
        .unwrap();
    assert_eq!(after.state, before.state);
    assert_eq!(after.quarantine_attempts, before.quarantine_attempts);
    assert_eq!(
        after.quarantine_next_retry_at,
        before.quarantine_next_retry_at
    );
    assert_eq!(
        second.worker.lease(kept.lease.id.as_str()).unwrap().access,
        kept.device.access,
        "the lease keeps how its device is reached"
    );
    // The retry, due after the restart, now works.
    let mut events = second.bus.follow();
    next_event(&mut events, "device.quarantine-recovered").await;
}
