//! One async lock per device: a driver's operations on one device never overlap (a reclaim and
//! a health probe's recovery, a sweep and an adoption), while different devices go in parallel.

use std::collections::HashMap;
use std::sync::Arc;

use parking_lot::Mutex;

/// Locks by device id.
#[derive(Debug, Default)]
pub(crate) struct DeviceLocks {
    locks: Mutex<HashMap<String, Arc<tokio::sync::Mutex<()>>>>,
}

impl DeviceLocks {
    /// Holds `device`'s lock until the guard goes.
    pub(crate) async fn lock(&self, device: &str) -> tokio::sync::OwnedMutexGuard<()> {
        let lock = self
            .locks
            .lock()
            .entry(device.to_owned())
            .or_default()
            .clone();
        lock.lock_owned().await
    }
}
