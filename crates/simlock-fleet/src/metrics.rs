//! The gateway's metrics for `/v1/metrics`: workers by connection, each uplink's link counters,
//! the fleet queue and the gateway's leases.

use std::sync::{Arc, Weak};

use simlock_contract::model::Connection;
use simlock_daemon::metrics::{Metrics, Sample};
use simlock_link::LinkStats;

use crate::fleet::Fleet;

fn read(fleet: &Weak<Fleet>, f: impl Fn(&Fleet) -> Vec<Sample>) -> Vec<Sample> {
    fleet.upgrade().map(|f_| f(&f_)).unwrap_or_default()
}

/// One sample per connected worker's uplink.
fn per_uplink(fleet: &Fleet, value: fn(&LinkStats) -> f64) -> Vec<Sample> {
    fleet
        .views()
        .iter()
        .filter_map(|view| {
            fleet
                .conn(&view.id)
                .map(|conn| (vec![("worker", view.id.clone())], value(&conn.link.stats())))
        })
        .collect()
}

/// One family per uplink: name, help, whether it is a counter, and its value from the link.
type UplinkFamily = (&'static str, &'static str, bool, fn(&LinkStats) -> f64);

const UPLINK_FAMILIES: &[UplinkFamily] = &[
    (
        "simlock_uplink_up",
        "1 for each worker whose uplink is up.",
        false,
        |_| 1.0,
    ),
    (
        "simlock_link_channels_open",
        "Byte channels open on each uplink.",
        false,
        |s| s.open_channels as f64,
    ),
    (
        "simlock_link_bytes_sent_total",
        "Channel bytes sent to each worker.",
        true,
        |s| s.bytes_sent as f64,
    ),
    (
        "simlock_link_bytes_received_total",
        "Channel bytes received from each worker.",
        true,
        |s| s.bytes_received as f64,
    ),
    (
        "simlock_link_buffered_bytes",
        "Bytes buffered on each uplink, both ways.",
        false,
        |s| (s.recv_buffered + s.send_buffered) as f64,
    ),
    (
        "simlock_link_credit_stalls_total",
        "Times a channel writer waited for credit, per uplink.",
        true,
        |s| s.credit_stalls as f64,
    ),
];

/// Registers the gateway's metrics.
pub fn register_metrics(metrics: &Metrics, fleet: &Arc<Fleet>) {
    let f = Arc::downgrade(fleet);
    metrics.gauge(
        "simlock_workers",
        "Workers the gateway knows, by connection.",
        move || {
            read(&f, |fleet| {
                let views = fleet.views();
                [
                    (Connection::Connected, "connected"),
                    (Connection::Disconnected, "disconnected"),
                    (Connection::Incompatible, "incompatible"),
                ]
                .into_iter()
                .map(|(c, name)| {
                    (
                        vec![("connection", name.to_owned())],
                        views.iter().filter(|v| v.connection == c).count() as f64,
                    )
                })
                .collect()
            })
        },
    );
    for &(name, help, counter, value) in UPLINK_FAMILIES {
        let f = Arc::downgrade(fleet);
        let source = move || read(&f, |fleet| per_uplink(fleet, value));
        if counter {
            metrics.counter(name, help, source);
        } else {
            metrics.gauge(name, help, source);
        }
    }
    let f = Arc::downgrade(fleet);
    metrics.gauge(
        "simlock_queue_depth",
        "Lease requests waiting in the fleet queue.",
        move || read(&f, |fleet| vec![(vec![], f64::from(fleet.queue_depth()))]),
    );
    let f = Arc::downgrade(fleet);
    metrics.gauge(
        "simlock_leases",
        "Leases the gateway issued and indexes.",
        move || read(&f, |fleet| vec![(vec![], fleet.lease_count() as f64)]),
    );
}
