//! Worker views: what the gateway knows of each worker, folded from its `status.get` and the
//! refreshes after it. Plain data.

use simlock_contract::ids::DeviceId;
use simlock_contract::model::{
    Capacity, Connection, Device, DeviceState, LeaseLimits, LeaseRecord, Platform, PlatformCatalog,
    WorkerView,
};
use simlock_contract::ops::StatusOutput;

use super::index::{Renewal, Stamp, keep_newer_renewal};

/// What one refresh read from a worker.
#[derive(Debug, Clone, PartialEq)]
pub struct Refresh {
    /// Its status.
    pub status: StatusOutput,
    /// Its devices, when the list read.
    pub devices: Option<Vec<Device>>,
    /// Its catalog, when asked for.
    pub catalog: Option<Vec<PlatformCatalog>>,
    /// Its lease limits, when asked for.
    pub limits: Option<LeaseLimits>,
}

/// A view of a worker the gateway knows nothing of yet.
pub fn blank_view(id: &str, label: Option<String>, now: i64, connection: Connection) -> WorkerView {
    WorkerView {
        id: id.to_owned(),
        label,
        connection,
        drained: false,
        last_seen_at: now,
        health: None,
        version: None,
        protocol: None,
        capacity: None,
        lease: None,
        queue_depth: None,
        leases: None,
        devices: None,
        catalog: None,
        catalog_read_at: None,
        host: None,
        waiting: None,
        capabilities: None,
        releasing: Vec::new(),
    }
}

/// A grant the gateway heard of (stamped `at`), counted into its worker's view until a read
/// sent after it shows it: without it, the view read before the grant still shows the slot the
/// grant took, and the next waiter is sent there only to be refused `NO_CAPACITY`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Granted {
    /// When the gateway heard of it.
    pub at: Stamp,
    /// The device granted.
    pub device: DeviceId,
    /// Its platform.
    pub platform: Platform,
}

/// Counts `granted` into a view's `capacity` and `devices` as the worker's own read would show
/// it: the device leased, and, when the list did not show it running (a boot it had reserved a
/// slot for, or a device it did not list yet), one more running slot. A list that already shows
/// it leased (a read that saw the grant) changes nothing, so counting twice is counting once.
pub fn count_grant(
    capacity: Option<&mut Capacity>,
    devices: Option<&mut Vec<Device>>,
    granted: &Granted,
) {
    let listed = devices.and_then(|list| list.iter_mut().find(|d| d.id == granted.device));
    let was = listed.as_ref().map(|d| d.state);
    if was == Some(DeviceState::Leased) {
        return;
    }
    if let Some(device) = listed {
        device.state = DeviceState::Leased;
    }
    let Some(capacity) = capacity else {
        return;
    };
    let global = &mut capacity.global;
    let platform = match granted.platform {
        Platform::Ios => &mut capacity.ios,
        Platform::Android => &mut capacity.android,
    };
    match was {
        Some(DeviceState::Ready) => {
            platform.warm = platform.warm.saturating_sub(1);
            global.warm = global.warm.saturating_sub(1);
        }
        Some(state) if state.is_running() => {}
        Some(DeviceState::Provisioning | DeviceState::Booting) => {
            platform.reserved = platform.reserved.saturating_sub(1);
            global.reserved = global.reserved.saturating_sub(1);
            platform.running = platform.running.saturating_add(1);
            global.running = global.running.saturating_add(1);
        }
        _ => {
            platform.running = platform.running.saturating_add(1);
            global.running = global.running.saturating_add(1);
        }
    }
}

/// Folds one read of a worker into `view`: its `status.get`, and its device list when that was
/// read (it wins over the status's), with the grants the gateway heard of that the read may not
/// show (`granted`, [`count_grant`]). Answers whether what a refusal is remembered against
/// changed — the capacity, the devices, the health, which leases the worker holds (a renewal is
/// not a change), the queue depth — compared field by field: a worker that refused a request
/// with `NO_CAPACITY` is not tried again for it until one of them does.
pub fn apply_read(
    view: &mut WorkerView,
    status: &StatusOutput,
    devices: Option<Vec<Device>>,
    granted: &[Granted],
    now: i64,
) -> bool {
    let mut changed = false;
    view.last_seen_at = now;
    changed |= set(&mut view.health, Some(status.daemon.health));
    view.version = Some(status.daemon.version.clone());
    view.host = Some(status.host.clone());
    // The grants count into what this read carries: the view's own capacity and devices
    // have them already.
    let mut capacity = status.capacity;
    let mut devices = devices.or_else(|| status.devices.clone());
    if !granted.is_empty() && (capacity.is_some() || devices.is_some()) {
        // A read without a list of its own is counted against the view's (a copy: the view's
        // list is not this read's).
        let mut views_list = devices.is_none().then(|| view.devices.clone()).flatten();
        for grant in granted {
            let list = devices.as_mut().or(views_list.as_mut());
            count_grant(capacity.as_mut(), list, grant);
        }
    }
    if capacity.is_some() {
        changed |= set(&mut view.capacity, capacity);
    }
    if let Some(leases) = &status.leases {
        let mut leases = leases.clone();
        let held = view.leases.as_deref().unwrap_or_default();
        keep_newer_renewals(held, &mut leases);
        changed |= !held.iter().map(|l| &l.id).eq(leases.iter().map(|l| &l.id));
        view.leases = Some(leases);
    }
    if devices.is_some() {
        changed |= set(&mut view.devices, devices);
    }
    if status.queue_depth.is_some() {
        changed |= set(&mut view.queue_depth, status.queue_depth);
    }
    if let Some(waiting) = &status.waiting {
        view.waiting = Some(waiting.clone());
    }
    if let Some(capabilities) = &status.capabilities {
        view.capabilities = Some(capabilities.clone());
    }
    if status.lease.is_some() {
        view.lease = status.lease;
    }
    changed
}

/// Sets `field` to `value`; answers whether that changed it.
fn set<T: PartialEq>(field: &mut T, value: T) -> bool {
    if *field == value {
        return false;
    }
    *field = value;
    true
}

/// A snapshot of leases read before a `lease.renewed` event that the view already took in
/// (ADR 0015): the renewal in `held` is newer than the snapshot's, and stays.
pub fn keep_newer_renewals(held: &[LeaseRecord], snapshot: &mut [LeaseRecord]) {
    for lease in snapshot {
        if let Some(old) = held.iter().find(|old| old.id == lease.id) {
            let mut kept = old.clone();
            keep_newer_renewal(&mut kept, lease);
            lease.ttl_deadline = kept.ttl_deadline;
            lease.last_renewed_at = kept.last_renewed_at;
            lease.ttl_ms = kept.ttl_ms;
        }
    }
}

/// The record of `worker_lease_id` in `view` takes a renewal in place (ADR 0015), its width
/// too when the renewal tells it. Answers whether the view held that lease.
pub fn renew_in_place(view: &mut WorkerView, worker_lease_id: &str, renewal: Renewal) -> bool {
    let record = view
        .leases
        .iter_mut()
        .flatten()
        .find(|lease| lease.id.as_str() == worker_lease_id);
    record.is_some_and(|record| {
        renewal.apply(record);
        true
    })
}

#[cfg(test)]
mod tests {
    use simlock_contract::ids::{DeviceId, LeaseId};
    use simlock_contract::model::{CapabilityStatus, Capacity, DeviceState, Health};

    use super::*;

    /// A worker's status with `leases` (the core's tests' view, with no slots).
    fn status(leases: Vec<LeaseRecord>) -> StatusOutput {
        crate::state::tests::status(leases, 0)
    }

    use crate::state::tests::device;

    #[test]
    fn a_read_changes_the_view_when_what_refusals_depend_on_moves_and_only_then() {
        let mut view = blank_view("w1", None, 0, Connection::Connected);
        let base = status(vec![lease("lse_a", 100, 1100)]);
        assert!(
            apply_read(&mut view, &base, None, &[], 10),
            "the first read"
        );
        assert!(
            !apply_read(&mut view, &base, None, &[], 20),
            "the same read"
        );
        assert_eq!(view.last_seen_at, 20);

        // Neither a renewal, nor what no refusal depends on, is a change.
        let mut other = base.clone();
        other.leases = Some(vec![lease("lse_a", 200, 1200)]);
        other.daemon.version = "t2".into();
        other.waiting = None;
        other.capabilities = Some(vec![CapabilityStatus {
            name: "gpu".into(),
            available: true,
            reason: None,
        }]);
        other.lease = Some(LeaseLimits {
            default_ttl_ms: 1,
            max_ttl_ms: 2,
        });
        assert!(!apply_read(&mut view, &other, None, &[], 30));
        assert_eq!(view.leases.as_ref().unwrap()[0].ttl_deadline, 1200);
        assert_eq!(view.version.as_deref(), Some("t2"));
        assert!(view.capabilities.as_ref().is_some_and(|c| c.len() == 1));

        // Each field a refusal depends on is.
        type Change = (&'static str, fn(&mut StatusOutput));
        let changes: [Change; 5] = [
            ("health", |s| s.daemon.health = Health::Failed),
            ("capacity", |s| {
                s.capacity = Some(Capacity {
                    ios: simlock_contract::model::PlatformCapacity {
                        max_running: 1,
                        ..Default::default()
                    },
                    ..Default::default()
                });
            }),
            ("leases", |s| s.leases = Some(Vec::new())),
            ("devices", |s| {
                s.devices = Some(vec![device("dev_1", DeviceState::Ready)]);
            }),
            ("queue depth", |s| s.queue_depth = Some(3)),
        ];
        for (what, change) in changes {
            let mut view = view.clone();
            let mut read = other.clone();
            change(&mut read);
            assert!(apply_read(&mut view, &read, None, &[], 40), "{what}");
            assert!(!apply_read(&mut view, &read, None, &[], 50), "{what} again");
        }
    }

    #[test]
    fn a_device_list_read_wins_over_the_statuss_and_is_what_is_compared() {
        let mut view = blank_view("w1", None, 0, Connection::Connected);
        let listed = vec![device("dev_1", DeviceState::Leased)];
        assert!(apply_read(
            &mut view,
            &status(Vec::new()),
            Some(listed.clone()),
            &[],
            10
        ));
        assert_eq!(view.devices.as_ref(), Some(&listed));
        // The status's own (stale) list is not taken when a list was read; the same list is
        // no change.
        assert!(!apply_read(
            &mut view,
            &status(Vec::new()),
            Some(listed.clone()),
            &[],
            20
        ));
        assert_eq!(view.devices.as_ref(), Some(&listed));
        // Without a list read, the status's is taken.
        assert!(apply_read(&mut view, &status(Vec::new()), None, &[], 30));
        assert_eq!(view.devices.as_deref(), Some(&[][..]));
    }

    /// `dev_1`'s grant, heard of at stamp 5.
    fn granted() -> Granted {
        Granted {
            at: 5,
            device: DeviceId::from_raw("dev_1"),
            platform: Platform::Ios,
        }
    }

    /// A read's capacity: `running` and `reserved` iOS devices of 4, `warm` of them idle.
    fn capacity(running: u32, reserved: u32, warm: u32) -> Capacity {
        let mut capacity = crate::state::tests::status(Vec::new(), 4).capacity.unwrap();
        capacity.ios.running = running;
        capacity.ios.reserved = reserved;
        capacity.ios.warm = warm;
        capacity.global.running = running;
        capacity.global.reserved = reserved;
        capacity.global.warm = warm;
        capacity
    }

    #[test]
    fn a_grant_counts_as_the_workers_next_read_would_show_it_and_counting_twice_is_once() {
        // (the device as the view lists it, the capacity before, the capacity after)
        let cases = [
            // An idle device leased: no more running, one fewer idle.
            (
                Some(DeviceState::Ready),
                capacity(1, 0, 1),
                capacity(1, 0, 0),
            ),
            // A boot the worker had reserved a slot for: the slot runs now.
            (
                Some(DeviceState::Booting),
                capacity(0, 1, 0),
                capacity(1, 0, 0),
            ),
            (
                Some(DeviceState::Provisioning),
                capacity(0, 1, 0),
                capacity(1, 0, 0),
            ),
            // Shut down, or not listed yet: one more running.
            (
                Some(DeviceState::Shutdown),
                capacity(0, 0, 0),
                capacity(1, 0, 0),
            ),
            (None, capacity(2, 0, 0), capacity(3, 0, 0)),
            // A read that saw the grant: nothing moves.
            (
                Some(DeviceState::Leased),
                capacity(1, 0, 0),
                capacity(1, 0, 0),
            ),
        ];
        for (listed, before, after) in cases {
            let mut devices: Vec<Device> = listed.map(|s| device("dev_1", s)).into_iter().collect();
            devices.push(device("dev_2", DeviceState::Ready));
            let mut capacity = before;
            count_grant(Some(&mut capacity), Some(&mut devices), &granted());
            assert_eq!(capacity, after, "{listed:?}");
            if listed.is_some() {
                assert_eq!(devices[0].state, DeviceState::Leased, "{listed:?}");
            }
            assert_eq!(
                devices.last().unwrap().state,
                DeviceState::Ready,
                "others kept"
            );
            count_grant(Some(&mut capacity), Some(&mut devices), &granted());
            if listed.is_some() {
                assert_eq!(capacity, after, "{listed:?} counted twice");
            }
        }
    }

    #[test]
    fn a_read_from_before_a_grant_is_no_change_once_the_grant_is_counted_into_it() {
        let mut view = blank_view("w1", None, 0, Connection::Connected);
        let mut read = status(Vec::new());
        read.capacity = Some(capacity(1, 0, 1));
        read.devices = Some(vec![device("dev_1", DeviceState::Ready)]);
        apply_read(&mut view, &read, None, &[], 10);
        count_grant(view.capacity.as_mut(), view.devices.as_mut(), &granted());
        // The same read again (sent before the grant): with the grant counted in, no change,
        // and the view still shows the device leased.
        assert!(!apply_read(&mut view, &read, None, &[granted()], 20));
        assert_eq!(view.capacity, Some(capacity(1, 0, 0)));
        assert_eq!(view.devices.as_ref().unwrap()[0].state, DeviceState::Leased);
        // A read that saw the grant is the same view.
        let mut after = read.clone();
        after.capacity = Some(capacity(1, 0, 0));
        after.devices = Some(vec![device("dev_1", DeviceState::Leased)]);
        assert!(!apply_read(&mut view, &after, None, &[], 30));
        // One that shows it ended (the read sent after the grant, nothing counted) is a change.
        assert!(apply_read(&mut view, &read, None, &[], 40));
        assert_eq!(view.devices.as_ref().unwrap()[0].state, DeviceState::Ready);
    }

    #[test]
    fn a_read_that_carries_no_capacity_leaves_the_counted_one_as_it_is() {
        let mut view = blank_view("w1", None, 0, Connection::Connected);
        let mut read = status(Vec::new());
        read.capacity = Some(capacity(2, 0, 0));
        apply_read(&mut view, &read, None, &[], 10);
        // A device it did not list: one more running.
        let unlisted = Granted {
            device: DeviceId::from_raw("dev_9"),
            ..granted()
        };
        count_grant(view.capacity.as_mut(), view.devices.as_mut(), &unlisted);
        assert_eq!(view.capacity, Some(capacity(3, 0, 0)));
        // A failed worker's read (its health alone): the count is not made again.
        let mut failed = status(Vec::new());
        (failed.capacity, failed.devices) = (None, None);
        apply_read(&mut view, &failed, None, &[unlisted], 20);
        assert_eq!(view.capacity, Some(capacity(3, 0, 0)));
    }

    fn lease(id: &str, renewed_at: i64, deadline: i64) -> LeaseRecord {
        LeaseRecord {
            id: LeaseId::from_raw(id),
            device_id: DeviceId::from_raw("dev_1"),
            requester_id: "gw:g1:agent".into(),
            owner_id: "agent".into(),
            granted_at: 5,
            ttl_ms: 1000,
            ttl_deadline: deadline,
            last_renewed_at: renewed_at,
            id_chosen_by_requester: false,
            worker: None,
            worker_id: None,
            access: None,
        }
    }

    #[test]
    fn a_snapshot_older_than_a_renew_the_view_took_keeps_the_renew() {
        let held = [lease("lse_a", 200, 1200), lease("lse_b", 50, 1050)];
        let mut snapshot = [
            lease("lse_a", 100, 1100),
            lease("lse_b", 300, 1300),
            lease("lse_c", 10, 1010),
        ];
        keep_newer_renewals(&held, &mut snapshot);
        assert_eq!(
            (snapshot[0].last_renewed_at, snapshot[0].ttl_deadline),
            (200, 1200),
            "the renew seen after the snapshot stays"
        );
        assert_eq!(
            (snapshot[1].last_renewed_at, snapshot[1].ttl_deadline),
            (300, 1300),
            "a newer snapshot wins"
        );
        assert_eq!(snapshot[2].ttl_deadline, 1010, "a new lease is taken as is");
    }

    #[test]
    fn a_renew_lands_in_place_only_on_a_listed_lease_and_never_moves_back() {
        let mut view = blank_view("w1", None, 0, Connection::Connected);
        view.leases = Some(vec![lease("lse_a", 100, 1100)]);
        let renewal = |deadline, ttl_ms, at| Renewal {
            deadline,
            ttl_ms: Some(ttl_ms),
            at,
        };
        assert!(renew_in_place(&mut view, "lse_a", renewal(2000, 1850, 150)));
        assert!(
            renew_in_place(&mut view, "lse_a", renewal(1500, 5, 120)),
            "an older renew is no news"
        );
        let held = &view.leases.as_ref().unwrap()[0];
        assert_eq!(
            (held.ttl_deadline, held.last_renewed_at, held.ttl_ms),
            (2000, 150, 1850),
            "the deadline and the width a renewal set"
        );
        assert!(!renew_in_place(
            &mut view,
            "lse_other",
            renewal(2000, 1, 150)
        ));
    }
}
