//! Routing stages and the fast-fail table, one behaviour per test.

use std::collections::{BTreeMap, BTreeSet};

use simlock_contract::ids::DeviceId;
use simlock_contract::model::{
    CapabilityStatus, Capacity, Connection, Device, DeviceSpec, DeviceState, GlobalCapacity,
    Health, Platform, PlatformCapacity, PlatformCatalog, WorkerView,
};

use super::*;

fn catalog() -> Vec<PlatformCatalog> {
    let mut runtimes = BTreeMap::new();
    runtimes.insert(
        "iPhone 16".to_owned(),
        vec!["18.2".to_owned(), "17.5".to_owned()],
    );
    runtimes.insert("iPad Air".to_owned(), vec!["18.2".to_owned()]);
    let mut aliases = BTreeMap::new();
    aliases.insert("iPhone 16".to_owned(), vec!["iphone".to_owned()]);
    vec![PlatformCatalog {
        platform: Platform::Ios,
        models: vec!["iPhone 16".into(), "iPad Air".into()],
        runtimes: vec!["18.2".into(), "17.5".into()],
        default_runtime: None,
        model_runtimes: runtimes,
        model_aliases: aliases,
        model_workers: None,
        runtime_workers: None,
        unavailable: None,
    }]
}

fn view(id: &str, free_ios: u32) -> WorkerView {
    let platform = PlatformCapacity {
        running: 0,
        max_running: free_ios,
        reserved: 0,
        warm: 0,
        over_limit: false,
        at_ram_budget: false,
    };
    WorkerView {
        id: id.into(),
        label: None,
        connection: Connection::Connected,
        drained: false,
        last_seen_at: 0,
        health: Some(Health::Running),
        version: None,
        protocol: None,
        capacity: Some(Capacity {
            ios: platform,
            android: PlatformCapacity::default(),
            global: GlobalCapacity {
                running: 0,
                max_running: free_ios,
                reserved: 0,
                warm: 0,
                over_limit: false,
            },
        }),
        lease: None,
        queue_depth: Some(0),
        leases: Some(vec![]),
        devices: Some(vec![]),
        catalog: Some(catalog()),
        catalog_read_at: Some(1),
        host: None,
        waiting: None,
        capabilities: Some(vec![]),
        releasing: Vec::new(),
    }
}

fn ready_device(model: &str, os: &str) -> Device {
    Device {
        id: DeviceId::from_raw("dev_1"),
        spec: DeviceSpec {
            platform: Platform::Ios,
            model: model.into(),
            os_version: os.into(),
        },
        state: DeviceState::Ready,
        driver_device_id: "udid".into(),
        created_at: 0,
        last_lease_ended_at: None,
        worker_id: None,
        worker: None,
        access: None,
        quarantine_attempts: None,
        quarantine_next_retry_at: None,
        recovery_attempts: None,
    }
}

fn wanted(model: Option<&str>, os: Option<&str>, requires: &[&str]) -> Wanted {
    Wanted {
        platform: Platform::Ios,
        model: model.map(String::from),
        os_version: os.map(String::from),
        requires: requires.iter().map(|s| (*s).to_owned()).collect(),
    }
}

fn capable(mut v: WorkerView, name: &str, available: bool) -> WorkerView {
    v.capabilities = Some(vec![CapabilityStatus {
        name: name.into(),
        available,
        reason: None,
    }]);
    v
}

#[test]
fn a_model_matches_by_name_or_alias_case_insensitively_and_forwards_the_workers_name() {
    let v = view("a", 1);
    assert_eq!(
        match_request(&v, &wanted(Some("IPHONE"), None, &[])),
        Some(Match {
            model: Some("iPhone 16".into())
        })
    );
    assert_eq!(
        match_request(&v, &wanted(Some("iphone 16"), Some("17.5"), &[])).map(|m| m.model),
        Some(Some("iPhone 16".into()))
    );
    assert_eq!(
        match_request(&v, &wanted(Some("iPad Air"), Some("17.5"), &[])),
        None
    );
    assert_eq!(match_request(&v, &wanted(Some("Pixel"), None, &[])), None);
    assert_eq!(
        match_request(&v, &wanted(None, Some("17.5"), &[])),
        Some(Match { model: None })
    );
}

#[test]
fn a_warm_device_wins_over_more_free_capacity() {
    let mut warm = view("b", 1);
    warm.devices = Some(vec![ready_device("iPhone 16", "18.2")]);
    let roomy = view("a", 5);
    let pick = select(&[&roomy, &warm], &wanted(Some("iphone"), None, &[])).unwrap();
    assert_eq!(
        (pick.worker_id.as_str(), pick.reason),
        ("b", Reason::WarmHit)
    );
}

#[test]
fn without_a_warm_device_the_most_free_capacity_wins() {
    let (a, b, c) = (view("a", 1), view("b", 3), view("c", 3));
    let pick = select(&[&a, &c, &b], &wanted(None, None, &[])).unwrap();
    assert_eq!(
        (pick.worker_id.as_str(), pick.reason),
        ("b", Reason::FreeCapacity),
        "ties go to the lowest id"
    );
}

#[test]
fn drained_disconnected_unhealthy_busy_or_unread_workers_are_not_picked() {
    let mut drained = view("a", 9);
    drained.drained = true;
    let mut gone = view("b", 9);
    gone.connection = Connection::Disconnected;
    let mut starting = view("c", 9);
    starting.health = Some(Health::Starting);
    let mut queued = view("d", 9);
    queued.queue_depth = Some(1);
    let mut unread = view("e", 9);
    unread.catalog_read_at = None;
    let mut full = view("f", 9);
    full.capacity = Some(Capacity::default());
    let all = [&drained, &gone, &starting, &queued, &unread, &full];
    assert_eq!(select(&all, &wanted(None, None, &[])), None);
    let ok = view("z", 1);
    assert_eq!(
        select(&[&drained, &ok], &wanted(None, None, &[])).map(|p| p.worker_id),
        Some("z".into())
    );
}

#[test]
fn required_capabilities_route_only_to_workers_listing_them_available() {
    let with = capable(view("b", 1), "agent-device", true);
    let without = capable(view("a", 9), "agent-device", false);
    let pick = select(&[&without, &with], &wanted(None, None, &["agent-device"])).unwrap();
    assert_eq!(pick.worker_id, "b");
    assert_eq!(
        select(&[&without], &wanted(None, None, &["agent-device"])),
        None
    );
}

#[test]
fn assess_fails_fast_in_table_order() {
    let v = view("a", 1);
    let mut incompatible = view("x", 1);
    incompatible.connection = Connection::Incompatible;
    assert_eq!(
        assess(&[&incompatible], &wanted(None, None, &[])),
        Assessment::NoWorker
    );
    let mut android = wanted(None, None, &[]);
    android.platform = Platform::Android;
    assert_eq!(assess(&[&v], &android), Assessment::NoDriver);
    assert_eq!(
        assess(&[&v], &wanted(Some("Pixel"), None, &[])),
        Assessment::UnknownModel
    );
    assert_eq!(
        assess(&[&v], &wanted(Some("iPad Air"), Some("17.5"), &[])),
        Assessment::RuntimeMissing
    );
    assert_eq!(
        assess(&[&v], &wanted(None, None, &["agent-device"])),
        Assessment::CapabilityMissing("agent-device".into())
    );
    assert_eq!(
        assess(&[&v], &wanted(Some("iphone"), Some("18.2"), &[])),
        Assessment::Serviceable
    );
    // Only a worker that does not take requests could serve it: no capacity, not unresolvable.
    let mut drained = capable(view("b", 1), "agent-device", true);
    drained.drained = true;
    assert_eq!(
        assess(&[&v, &drained], &wanted(None, None, &["agent-device"])),
        Assessment::NoWorker
    );
    // A capable worker that does not know the model does not make the capability available.
    let mut other_catalog = capable(view("c", 1), "agent-device", true);
    if let Some(catalog) = other_catalog.catalog.as_mut() {
        catalog[0].models = vec!["iPad Air".into()];
    }
    assert_eq!(
        assess(
            &[&v, &other_catalog],
            &wanted(Some("iPhone 16"), None, &["agent-device"])
        ),
        Assessment::CapabilityMissing("agent-device".into())
    );
}

#[test]
fn a_capable_worker_takes_requests_has_the_capability_and_its_limits_were_read() {
    let cap = "agent-device";
    let mut v = view("w1", 1);
    v.capabilities = Some(vec![CapabilityStatus {
        name: cap.into(),
        available: true,
        reason: None,
    }]);
    v.lease = Some(simlock_contract::model::LeaseLimits {
        default_ttl_ms: 60_000,
        max_ttl_ms: 300_000,
    });
    let found = super::capable(&v, cap).expect("capable");
    assert_eq!(found.id, "w1");
    assert_eq!(found.lease_max_ttl_ms, 300_000);
    assert_eq!(found.platforms, [Platform::Ios].into_iter().collect());
    assert!(serves_held(&v, cap));
    // Each condition alone takes it out.
    let mut drained = v.clone();
    drained.drained = true;
    assert!(super::capable(&drained, cap).is_none(), "drained");
    assert!(
        serves_held(&drained, cap),
        "a drained worker keeps serving what it holds"
    );
    let mut unread = v.clone();
    unread.catalog_read_at = None;
    assert!(
        super::capable(&unread, cap).is_none(),
        "catalog not read yet"
    );
    let mut no_limits = v.clone();
    no_limits.lease = None;
    assert!(
        super::capable(&no_limits, cap).is_none(),
        "lease limits not read yet"
    );
    let mut down = v.clone();
    down.capabilities = Some(vec![CapabilityStatus {
        name: cap.into(),
        available: false,
        reason: Some("the daemon is restarting".into()),
    }]);
    assert!(super::capable(&down, cap).is_none(), "unavailable");
    assert!(!serves_held(&down, cap));
    let mut gone = v.clone();
    gone.connection = Connection::Disconnected;
    assert!(super::capable(&gone, cap).is_none());
    assert!(!serves_held(&gone, cap), "disconnected");
    let mut unserved = v;
    if let Some(catalog) = unserved.catalog.as_mut() {
        catalog[0].unavailable = Some("xcrun is missing".into());
    }
    assert!(
        super::capable(&unserved, cap)
            .expect("capable")
            .platforms
            .is_empty()
    );
}

#[test]
fn a_holder_knows_its_leases_only_while_connected_with_its_lease_list_read() {
    let cap = "agent-device";
    let mut v = capable(view("w1", 1), cap, true);
    v.lease = Some(simlock_contract::model::LeaseLimits {
        default_ttl_ms: 60_000,
        max_ttl_ms: 300_000,
    });
    let held = holder(&v, cap);
    assert_eq!(held.id, "w1");
    assert!(held.connected && held.leases_known && held.serves);
    assert_eq!(held.platforms, [Platform::Ios].into_iter().collect());
    assert_eq!(held.lease_max_ttl_ms, Some(300_000));
    let mut unread = v.clone();
    unread.leases = None;
    let held = holder(&unread, cap);
    assert!(
        held.connected && !held.leases_known,
        "its leases not read yet"
    );
    let mut gone = v;
    gone.connection = Connection::Disconnected;
    let held = holder(&gone, cap);
    assert!(!held.connected && !held.leases_known && !held.serves);
    let unlisted = holder(&capable(view("w2", 1), cap, false), cap);
    assert!(
        unlisted.connected && !unlisted.serves,
        "its capability is unavailable"
    );
    assert_eq!(unlisted.lease_max_ttl_ms, None, "limits not read yet");
}

/// A worker at its running cap with an idle iPhone makes room for an Android request by
/// shutting the iPhone down, as it does for a request sent to it straight: the gateway routes
/// there instead of queueing. A leased iPhone makes no room.
#[test]
fn an_idle_device_of_another_platform_is_room_under_the_workers_cap() {
    let mut full = view("a", 1);
    if let Some(capacity) = full.capacity.as_mut() {
        capacity.ios.running = 1;
        capacity.android.max_running = 1;
        capacity.global.running = 1;
    }
    full.devices = Some(vec![ready_device("iPhone 16", "18.2")]);
    let mut android = catalog().remove(0);
    android.platform = Platform::Android;
    android.models = vec!["Pixel 8".into()];
    android.model_runtimes = BTreeMap::from([("Pixel 8".to_owned(), vec!["35".to_owned()])]);
    android.model_aliases = BTreeMap::new();
    if let Some(catalog) = full.catalog.as_mut() {
        catalog.push(android);
    }
    let pixel = Wanted {
        platform: Platform::Android,
        ..wanted(None, None, &[])
    };
    let pick = select(&[&full], &pixel).expect("the idle iPhone makes room");
    assert_eq!(
        (pick.worker_id.as_str(), pick.reason),
        ("a", Reason::FreeCapacity)
    );

    let mut busy = full.clone();
    if let Some(devices) = busy.devices.as_mut() {
        devices[0].state = DeviceState::Leased;
    }
    assert_eq!(
        select(&[&busy], &pixel),
        None,
        "a leased iPhone makes no room"
    );
    // Its own cap full, an idle device of another platform frees nothing for it.
    let mut capped = full.clone();
    if let Some(capacity) = capped.capacity.as_mut() {
        capacity.android.running = 1;
        capacity.global.max_running = 2;
        capacity.global.running = 2;
    }
    assert_eq!(select(&[&capped], &pixel), None);
}

/// A worker whose one iOS slot (and its cap) is held by `devices`.
fn full_with(id: &str, devices: Vec<Device>) -> WorkerView {
    let mut full = view(id, 1);
    let running = u32::try_from(devices.len()).unwrap_or(u32::MAX);
    if let Some(capacity) = full.capacity.as_mut() {
        capacity.ios.running = 1;
        capacity.global.running = running;
        capacity.global.max_running = running;
    }
    full.devices = Some(devices);
    full
}

fn in_state(state: DeviceState, platform: Platform, retry_at: Option<i64>) -> Device {
    let mut device = ready_device("iPhone 16", "18.2");
    device.state = state;
    device.spec.platform = platform;
    device.quarantine_next_retry_at = retry_at;
    device
}

#[test]
fn why_no_worker_takes_a_request_is_told_when_none_takes_requests_or_every_server_is_full() {
    let iphone = wanted(None, None, &[]);
    let leased = || in_state(DeviceState::Leased, Platform::Ios, None);
    let quarantined = |at| in_state(DeviceState::Quarantined, Platform::Ios, Some(at));
    assert_eq!(
        waiting_for(&[], &BTreeSet::new(), &iphone),
        Some(WaitingFor::NoWorker),
        "no worker at all"
    );
    let mut away = full_with("a", vec![leased()]);
    away.connection = Connection::Disconnected;
    let mut drained = view("b", 1);
    drained.drained = true;
    let mut failed = view("c", 1);
    failed.health = Some(Health::Failed);
    assert_eq!(
        waiting_for(&[&away, &drained, &failed], &BTreeSet::new(), &iphone),
        Some(WaitingFor::NoWorker),
        "none takes requests: away, drained, failed"
    );
    // One that takes requests refused its spec: the wait is not for a worker to come back.
    let refusing = view("d", 1);
    assert_eq!(
        waiting_for(
            &[&away, &refusing],
            &BTreeSet::from(["d".to_owned()]),
            &iphone
        ),
        None
    );
    let full = full_with("a", vec![leased()]);
    assert_eq!(
        waiting_for(&[&full], &BTreeSet::new(), &iphone),
        Some(WaitingFor::Capacity)
    );
    let room = view("b", 1);
    assert_eq!(
        waiting_for(&[&full, &room], &BTreeSet::new(), &iphone),
        None,
        "another worker has room"
    );
    // Quarantined devices holding the room: the earliest retry across the workers.
    let late = full_with("a", vec![quarantined(9_000)]);
    let early = full_with("b", vec![quarantined(5_000)]);
    assert_eq!(
        waiting_for(&[&late, &early, &full], &BTreeSet::new(), &iphone),
        Some(WaitingFor::Quarantine { retry_at: 5_000 })
    );
}

#[test]
fn a_quarantine_of_another_platform_is_told_only_when_the_workers_cap_holds_the_room() {
    let iphone = wanted(None, None, &[]);
    // The iOS cap is held by a quarantined iPhone (retry 9 s); an Android device quarantined
    // earlier (retry 5 s) frees nothing under the iOS cap.
    let both = full_with(
        "a",
        vec![
            in_state(DeviceState::Quarantined, Platform::Ios, Some(9_000)),
            in_state(DeviceState::Quarantined, Platform::Android, Some(5_000)),
        ],
    );
    assert_eq!(
        waiting_for(&[&both], &BTreeSet::new(), &iphone),
        Some(WaitingFor::Quarantine { retry_at: 9_000 })
    );
    // The iOS cap has room; the worker's cap is held by a quarantined Android device.
    let mut global = view("b", 2);
    if let Some(capacity) = global.capacity.as_mut() {
        capacity.global.running = 1;
        capacity.global.max_running = 1;
    }
    global.devices = Some(vec![in_state(
        DeviceState::Quarantined,
        Platform::Android,
        Some(5_000),
    )]);
    assert_eq!(
        waiting_for(&[&global], &BTreeSet::new(), &iphone),
        Some(WaitingFor::Quarantine { retry_at: 5_000 })
    );
}
