//! The worker's metrics for `/v1/metrics`: leases, the queue, devices by state, capacity, and
//! whether it failed.

use std::sync::{Arc, Weak};

use simlock_contract::model::{DeviceState, Platform, PlatformCapacity};
use simlock_daemon::metrics::{Metrics, Sample};

use crate::worker::Worker;

fn read(worker: &Weak<Worker>, f: impl Fn(&Worker) -> Vec<Sample>) -> Vec<Sample> {
    worker.upgrade().map(|w| f(&w)).unwrap_or_default()
}

/// One sample per platform of what `value` reads from its capacity.
fn per_platform(worker: &Worker, value: impl Fn(&PlatformCapacity) -> u32) -> Vec<Sample> {
    let capacity = worker.capacity();
    Platform::ALL
        .iter()
        .map(|p| {
            (
                vec![("platform", p.as_str().to_owned())],
                f64::from(value(capacity.platform(*p))),
            )
        })
        .collect()
}

/// Registers the worker's metrics.
pub fn register_metrics(metrics: &Metrics, worker: &Arc<Worker>) {
    let w = Arc::downgrade(worker);
    metrics.gauge(
        "simlock_leases",
        "Active leases on this worker.",
        move || read(&w, |w| vec![(vec![], w.leases().len() as f64)]),
    );
    let w = Arc::downgrade(worker);
    metrics.gauge(
        "simlock_queue_depth",
        "Lease requests waiting in this worker's queue.",
        move || read(&w, |w| vec![(vec![], f64::from(w.queue_depth()))]),
    );
    let w = Arc::downgrade(worker);
    metrics.gauge("simlock_devices", "Devices by state.", move || {
        read(&w, |w| {
            let devices = w.devices();
            [
                (DeviceState::Provisioning, "provisioning"),
                (DeviceState::Booting, "booting"),
                (DeviceState::Ready, "ready"),
                (DeviceState::Leased, "leased"),
                (DeviceState::Reclaiming, "reclaiming"),
                (DeviceState::Shutdown, "shutdown"),
            ]
            .into_iter()
            .map(|(state, name)| {
                (
                    vec![("state", name.to_owned())],
                    devices.iter().filter(|d| d.state == state).count() as f64,
                )
            })
            .collect()
        })
    });
    let w = Arc::downgrade(worker);
    metrics.gauge(
        "simlock_capacity_running",
        "Running devices by platform.",
        move || read(&w, |w| per_platform(w, |c| c.running)),
    );
    let w = Arc::downgrade(worker);
    metrics.gauge(
        "simlock_capability_available",
        "1 for each capability this worker can serve now (agent-device: its daemon runs), else 0.",
        move || {
            read(&w, |w| {
                w.capabilities()
                    .snapshot()
                    .into_iter()
                    .map(|c| {
                        (
                            vec![("capability", c.name)],
                            if c.available { 1.0 } else { 0.0 },
                        )
                    })
                    .collect()
            })
        },
    );
    let w = Arc::downgrade(worker);
    metrics.gauge(
        "simlock_worker_failed",
        "1 once a decision could not be stored (a full disk): the worker refuses every decision until it is restarted; else 0.",
        move || read(&w, |w| vec![(vec![], if w.failed() { 1.0 } else { 0.0 })]),
    );
    let w = Arc::downgrade(worker);
    metrics.gauge(
        "simlock_capacity_max_running",
        "The most devices that may run, by platform.",
        move || read(&w, |w| per_platform(w, |c| c.max_running)),
    );
}
