//! Human views: tables, durations and times. The `--json` view is the contract's output as is.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Write as _;

use serde_json::Value;
use simlock_contract::bounds;
use simlock_contract::model::{
    Connection, Device, DeviceAccess, EventEnvelope, LeaseGrant, LeaseRecord, PlatformCapacity,
    TokenRecord, WaitStage, WaitingRequest, WorkerRef, WorkerView,
};
use simlock_contract::ops::{CatalogOutput, StatusOutput};
use simlock_contract::push::WaitingFor;

/// Now, in ms since the epoch.
pub(crate) fn now_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX))
}

/// `1h30m`, `15m`, `45s`, `500ms`: whole seconds from one second on.
pub(crate) fn duration(ms: u64) -> String {
    if ms < 1000 {
        return simlock_contract::duration::text(ms);
    }
    simlock_contract::duration::text(ms - ms % 1000)
}

/// `in 14m59s` or `12s ago`, from now.
pub(crate) fn relative(ts_ms: i64) -> String {
    let delta = ts_ms.saturating_sub(now_ms());
    let magnitude = duration(delta.unsigned_abs());
    if delta >= 0 {
        format!("in {magnitude}")
    } else {
        format!("{magnitude} ago")
    }
}

/// `2024-05-01T12:00:00.123Z`.
pub(crate) fn timestamp(ts_ms: i64) -> String {
    let days = ts_ms.div_euclid(86_400_000);
    let in_day = ts_ms.rem_euclid(86_400_000);
    // Civil date from days since 1970-01-01 (proleptic Gregorian).
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    let (h, m, s, ms) = (
        in_day / 3_600_000,
        (in_day / 60_000) % 60,
        (in_day / 1000) % 60,
        in_day % 1000,
    );
    format!("{year:04}-{month:02}-{day:02}T{h:02}:{m:02}:{s:02}.{ms:03}Z")
}

/// Rows under headers, columns padded to their widest cell. A cell's control and invisible
/// characters are shown escaped (`\n`, `\u{1b}`, `\u{200b}`): a value from a daemon's
/// records cannot forge a row, send escape sequences to the terminal, or pass for another.
pub(crate) fn table(headers: &[&str], rows: &[Vec<String>]) -> String {
    let rows: Vec<Vec<String>> = rows
        .iter()
        .map(|row| row.iter().map(|cell| visible(cell)).collect())
        .collect();
    let rows = rows.as_slice();
    let mut widths: Vec<usize> = headers.iter().map(|h| h.chars().count()).collect();
    for row in rows {
        for (i, cell) in row.iter().enumerate() {
            if let Some(w) = widths.get_mut(i) {
                *w = (*w).max(cell.chars().count());
            }
        }
    }
    let line = |cells: Vec<&str>| {
        let mut out = String::new();
        for (i, cell) in cells.iter().enumerate() {
            if i + 1 == cells.len() {
                out.push_str(cell);
            } else {
                let width = widths.get(i).copied().unwrap_or(0);
                let _ = write!(out, "{cell:<width$}  ");
            }
        }
        out.trim_end().to_owned()
    };
    let mut out = line(headers.to_vec());
    for row in rows {
        out.push('\n');
        out.push_str(&line(row.iter().map(String::as_str).collect()));
    }
    out
}

/// `text` with each control or invisible character ([`bounds::is_hidden`]) escaped as Rust
/// writes it (`\n`, `\u{1b}`, `\u{200b}`).
fn visible(text: &str) -> String {
    if !text.chars().any(bounds::is_hidden) {
        return text.to_owned();
    }
    text.chars()
        .map(|c| {
            if bounds::is_hidden(c) {
                c.escape_default().to_string()
            } else {
                c.to_string()
            }
        })
        .collect()
}

fn or_dash(value: Option<&str>) -> String {
    value.map_or_else(|| "-".to_owned(), str::to_owned)
}

/// The grant of `simlock lease`.
pub(crate) fn grant(grant: &LeaseGrant) -> String {
    let spec = &grant.device.spec;
    let mut out = format!(
        "lease {} granted: {} ({} {}), device {} ({})\nexpires {} unless renewed (ttl {})",
        grant.lease.id,
        spec.model,
        spec.platform,
        spec.os_version,
        grant.device.id,
        grant.device.driver_device_id,
        relative(grant.lease.ttl_deadline),
        duration(grant.lease.ttl_ms),
    );
    if let Some(worker) = &grant.lease.worker {
        let _ = write!(
            out,
            "\non worker {}",
            visible(worker.label.as_deref().unwrap_or(&worker.id))
        );
    }
    if let Some(address) = &grant.device.address {
        let _ = write!(out, "\naddress {address}");
    }
    if let Some(access) = &grant.device.access {
        let _ = write!(out, "\nreach it: {}", reach(access));
    }
    for (key, value) in &grant.environment {
        let _ = write!(out, "\n{key}={value}");
    }
    out
}

/// How an agent's own tools reach a device.
pub(crate) fn reach(access: &DeviceAccess) -> String {
    match access {
        DeviceAccess::Virtual { .. } => "a virtual device: no tool reaches it".to_owned(),
        DeviceAccess::IosSimulator { udid, device_set } => {
            format!(
                "xcrun simctl --set {} <command> {udid}",
                shell_quote(device_set)
            )
        }
        DeviceAccess::AndroidEmulator {
            serial,
            adb_server_port,
            ..
        } => format!("adb -P {adb_server_port} -s {serial} <command>"),
    }
}

/// `value` as one POSIX shell word: single-quoted, a `'` written as `'\''`.
pub(crate) fn shell_quote(value: &str) -> String {
    format!("'{}'", value.replace('\'', "'\\''"))
}

/// Whose leases a list holds: what its empty answer and its footer say, so that a view of
/// one's own leases is never read as the daemon having none.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum LeaseScope<'a> {
    /// Every lease the daemon has (an operator's view).
    Every,
    /// The caller's own, by principal (an agent's session on the socket).
    Own(&'a str),
    /// What the token may see: over HTTP the CLI does not learn the token's role.
    Token,
}

impl<'a> LeaseScope<'a> {
    /// The scope of `lease.list` for a session in `role` as `principal` (`None`: HTTP).
    pub(crate) fn of(session: Option<(simlock_contract::Role, &'a str)>) -> Self {
        match session {
            Some((simlock_contract::Role::Admin, _)) => Self::Every,
            Some((simlock_contract::Role::Agent, principal)) => Self::Own(principal),
            None => Self::Token,
        }
    }
}

/// Where every lease is listed from.
const EVERY_LEASE: &str = "every lease: simlock leases --all (operators)";

/// Leases as a table, and whose they are when they are not every lease.
pub(crate) fn leases(leases: &[LeaseRecord], scope: LeaseScope<'_>) -> String {
    if leases.is_empty() {
        return match scope {
            LeaseScope::Every => "no leases".to_owned(),
            LeaseScope::Own(principal) => {
                format!("no leases of yours (principal {principal}); {EVERY_LEASE}")
            }
            LeaseScope::Token => format!("no leases this token may see; {EVERY_LEASE}"),
        };
    }
    let rows: Vec<(Vec<String>, _, _)> = leases
        .iter()
        .map(|l| {
            let cells = vec![
                l.id.to_string(),
                l.device_id.to_string(),
                l.requester_id.clone(),
                l.owner_id.clone(),
                relative(l.ttl_deadline),
            ];
            (cells, l.worker.as_ref(), l.worker_id.as_deref())
        })
        .collect();
    let mut out = table_with_workers(&["LEASE", "DEVICE", "REQUESTER", "OWNER", "EXPIRES"], rows);
    if let LeaseScope::Own(principal) = scope {
        let _ = write!(out, "\n(yours only, principal {principal}; {EVERY_LEASE})");
    }
    out
}

/// What `simlock leases` adds below its list on a gateway that has not read some of its
/// workers' leases (after its restart, until each is back), from the list's `unreadWorkers`:
/// their leases are not listed (the caller's own included), so an empty list is not read as a
/// fleet with nothing leased. `None` when it read every worker's.
pub(crate) fn unread_workers(workers: &[WorkerRef]) -> Option<String> {
    let unread: Vec<String> = workers
        .iter()
        .map(|w| match w.connection {
            Some(Connection::Connected) | None => visible(w.name()),
            Some(away) => format!("{} ({})", visible(w.name()), value_name(&away)),
        })
        .collect();
    (!unread.is_empty()).then(|| {
        format!(
            "(not listed: the leases on {}; this gateway has not read them since it started, and lists them once each worker reports)",
            unread.join(", ")
        )
    })
}

/// A table whose rows each name the worker they are on (its reference, else its id), in a last
/// WORKER column ([`worker`]); a table where no row names one (a worker's own) has none.
fn table_with_workers(
    headers: &[&str],
    rows: Vec<(Vec<String>, Option<&WorkerRef>, Option<&str>)>,
) -> String {
    if rows.iter().all(|(_, w, id)| w.is_none() && id.is_none()) {
        let cells: Vec<Vec<String>> = rows.into_iter().map(|(cells, _, _)| cells).collect();
        return table(headers, &cells);
    }
    let shared = shared_labels(rows.iter().map(|(_, w, _)| *w));
    let cells: Vec<Vec<String>> = rows
        .into_iter()
        .map(|(mut cells, w, id)| {
            cells.push(worker(w, id, &shared));
            cells
        })
        .collect();
    let mut headers = headers.to_vec();
    headers.push("WORKER");
    table(&headers, &cells)
}

/// The labels in one table that name more than one worker: their cells add the worker's id.
fn shared_labels<'a>(workers: impl Iterator<Item = Option<&'a WorkerRef>>) -> BTreeSet<&'a str> {
    let mut ids: BTreeMap<&str, BTreeSet<&str>> = BTreeMap::new();
    for w in workers.flatten() {
        if let Some(label) = &w.label {
            ids.entry(label).or_default().insert(&w.id);
        }
    }
    ids.into_iter()
        .filter(|(_, ids)| ids.len() > 1)
        .map(|(label, _)| label)
        .collect()
}

/// A WORKER cell: its label (else its id; with its id too when another worker in the table has
/// the same label), and `(disconnected)` when the gateway said its uplink was down. A table
/// with no worker in any row (a worker's own) has no WORKER column.
fn worker(worker: Option<&WorkerRef>, id: Option<&str>, shared: &BTreeSet<&str>) -> String {
    let Some(w) = worker else {
        return or_dash(id);
    };
    let name = match &w.label {
        Some(label) if shared.contains(label.as_str()) => format!("{label} [{}]", w.id),
        _ => w.name().to_owned(),
    };
    if w.is_away() {
        format!("{name} ({})", value_name(&w.connection))
    } else {
        name
    }
}

/// Devices as a table. The state of a device whose worker is disconnected is the last one
/// that worker reported; its WORKER cell says the worker is away.
pub(crate) fn devices(devices: &[Device]) -> String {
    if devices.is_empty() {
        return "no devices".to_owned();
    }
    let rows: Vec<(Vec<String>, _, _)> = devices
        .iter()
        .map(|d| {
            let cells = vec![
                d.id.to_string(),
                d.spec.platform.to_string(),
                d.spec.model.clone(),
                d.spec.os_version.clone(),
                value_name(&d.state),
            ];
            (cells, d.worker.as_ref(), d.worker_id.as_deref())
        })
        .collect();
    table_with_workers(&["DEVICE", "PLATFORM", "MODEL", "OS", "STATE"], rows)
}

/// The wire name of a unit enum (`ready`, `connected`, …).
pub(crate) fn value_name<T: serde::Serialize>(value: &T) -> String {
    match serde_json::to_value(value) {
        Ok(Value::String(name)) => name,
        Ok(other) => other.to_string(),
        Err(_) => "?".to_owned(),
    }
}

fn capacity(name: &str, c: &PlatformCapacity) -> String {
    format!(
        "{name} {}/{} running ({} reserved, {} warm{})",
        c.running,
        c.max_running,
        c.reserved,
        c.warm,
        if c.over_limit { ", over limit" } else { "" }
    )
}

/// `simlock status`.
/// The capabilities a daemon serves, one line: an unavailable one says so, and none at all is
/// said rather than left blank.
fn serves(capabilities: &[simlock_contract::model::CapabilityStatus]) -> String {
    if capabilities.is_empty() {
        return "no capabilities".to_owned();
    }
    capabilities
        .iter()
        .map(|c| {
            if c.available {
                c.name.clone()
            } else {
                format!("{} (unavailable)", c.name)
            }
        })
        .collect::<Vec<_>>()
        .join(", ")
}

/// The requests without a lease yet, one line each in queue order (at most ten):
/// `1. agent-c  ios iPhone 16  queued for 12s: every device is in use`, or
/// `- agent-b  ios  starting on mini for 3s`.
fn waiting(list: &[WaitingRequest]) -> Vec<String> {
    const WAITING_SHOWN: usize = 10;
    let shared = shared_labels(list.iter().map(|w| w.worker.as_ref()));
    let mut lines: Vec<String> = list
        .iter()
        .take(WAITING_SHOWN)
        .map(|w| {
            let place = w
                .queue_position
                .map_or_else(|| "-".to_owned(), |p| format!("{p}."));
            let mut asked = w.spec.platform.to_string();
            for part in [&w.spec.model, &w.spec.os_version].into_iter().flatten() {
                asked.push(' ');
                asked.push_str(part);
            }
            let stage = match w.stage {
                WaitStage::Queued => "queued",
                WaitStage::Starting => "starting",
            };
            let on = if w.worker.is_some() || w.worker_id.is_some() {
                let name = worker(w.worker.as_ref(), w.worker_id.as_deref(), &shared);
                format!(" on {}", visible(&name))
            } else {
                String::new()
            };
            let why = match w.waiting_for {
                None | Some(WaitingFor::Unknown) => "",
                Some(WaitingFor::Capacity) => ": every device is in use",
                Some(WaitingFor::Quarantine { .. }) => ": quarantined devices hold the room",
                Some(WaitingFor::NoWorker) => ": no worker that can serve it takes requests",
            };
            let waited = u64::try_from(now_ms().saturating_sub(w.created_at)).unwrap_or(0);
            format!(
                "{place} {}  {}  {stage}{on} for {}{why}",
                visible(&w.requester_id),
                visible(&asked),
                duration(waited)
            )
        })
        .collect();
    if list.len() > WAITING_SHOWN {
        lines.push(format!(
            "… and {} more (simlock status --json lists them)",
            list.len() - WAITING_SHOWN
        ));
    }
    lines
}

/// The driver serving each platform and why, one line; one that cannot serve says so.
fn drivers(list: &[simlock_contract::model::DriverStatus]) -> String {
    list.iter()
        .map(|d| {
            let unavailable = if d.available { "" } else { ", unavailable" };
            format!(
                "{} {}{unavailable} ({})",
                d.platform,
                d.driver.as_str(),
                d.reason
            )
        })
        .collect::<Vec<_>>()
        .join("; ")
}

pub(crate) fn status(status: &StatusOutput, scope: LeaseScope<'_>) -> String {
    let d = &status.daemon;
    let mut out = format!(
        "daemon    {} {}, version {}, instance {}\nhost      {} {} {}",
        value_name(&d.mode),
        value_name(&d.health),
        d.version,
        d.instance_id,
        status.host.os,
        status.host.os_version,
        status.host.arch,
    );
    if let Some(c) = &status.capacity {
        let _ = write!(
            out,
            "\ncapacity  {}; {}",
            capacity("ios", &c.ios),
            capacity("android", &c.android)
        );
    }
    if let Some(list) = status.drivers.as_deref().filter(|l| !l.is_empty()) {
        let _ = write!(out, "\ndrivers   {}", drivers(list));
    }
    if let Some(depth) = status.queue_depth {
        let _ = write!(out, "\nqueue     {depth} waiting");
    }
    for line in waiting(status.waiting.as_deref().unwrap_or_default()) {
        let _ = write!(out, "\n          {line}");
    }
    if let Some(capabilities) = &status.capabilities {
        let _ = write!(out, "\nserves    {}", serves(capabilities));
    }
    if let Some(workers) = &status.workers {
        let _ = write!(out, "\nworkers   {}", worker_count(workers));
    }
    // A worker's uplink: where it dials, whether it is in, and if not, why.
    if let Some(uplink) = &status.uplink {
        let _ = write!(
            out,
            "\ngateway   {} {}",
            uplink.gateway,
            value_name(&uplink.state)
        );
        if let Some(error) = &uplink.last_error {
            let _ = write!(out, " (last error: {error})");
        }
    }
    if let Some(list) = &status.devices {
        let _ = write!(out, "\n\n{}", devices(list));
    }
    if let Some(list) = &status.leases {
        let _ = write!(out, "\n\n{}", leases(list, scope));
    }
    out
}

/// `simlock catalog`.
pub(crate) fn catalog(catalog: &CatalogOutput) -> String {
    if catalog.platforms.is_empty() {
        return "nothing can be leased".to_owned();
    }
    let mut out = String::new();
    for p in &catalog.platforms {
        if !out.is_empty() {
            out.push('\n');
        }
        if let Some(why) = &p.unavailable {
            let _ = write!(out, "{}: unavailable ({why})", p.platform);
            continue;
        }
        let _ = write!(
            out,
            "{}: models {}; runtimes {}",
            p.platform,
            p.models.join(", "),
            p.runtimes.join(", ")
        );
        if let Some(default) = &p.default_runtime {
            let _ = write!(out, " (default {default})");
        }
    }
    out
}

/// Tokens as a table.
pub(crate) fn tokens(tokens: &[TokenRecord]) -> String {
    if tokens.is_empty() {
        return "no tokens".to_owned();
    }
    let rows: Vec<Vec<String>> = tokens
        .iter()
        .map(|t| {
            vec![
                t.id.to_string(),
                t.role.as_str().to_owned(),
                or_dash(t.label.as_deref()),
                timestamp(t.created_at),
            ]
        })
        .collect();
    table(&["TOKEN", "ROLE", "LABEL", "CREATED"], &rows)
}

/// `3 (2 connected, 1 disconnected; 1 drained)`: how many workers a gateway knows, how many
/// of them it can reach, and how many take no new requests because an operator drained them.
fn worker_count(workers: &[WorkerView]) -> String {
    let connected = workers
        .iter()
        .filter(|w| w.connection == Connection::Connected)
        .count();
    let mut out = format!("{} ({connected} connected", workers.len());
    for away in [Connection::Disconnected, Connection::Incompatible] {
        let n = workers.iter().filter(|w| w.connection == away).count();
        if n > 0 {
            let _ = write!(out, ", {n} {}", value_name(&away));
        }
    }
    let drained = workers.iter().filter(|w| w.drained).count();
    if drained > 0 {
        let _ = write!(out, "; {drained} drained");
    }
    out.push(')');
    out
}

/// Workers as a table. A worker the gateway cannot reach shows since when, and no health: what
/// it last reported is not how it is now.
pub(crate) fn workers(workers: &[WorkerView]) -> String {
    if workers.is_empty() {
        return "no workers".to_owned();
    }
    let rows: Vec<Vec<String>> = workers
        .iter()
        .map(|w| {
            let connected = w.connection == Connection::Connected;
            vec![
                w.id.clone(),
                or_dash(w.label.as_deref()),
                if connected {
                    value_name(&w.connection)
                } else {
                    format!(
                        "{}, seen {}",
                        value_name(&w.connection),
                        relative(w.last_seen_at)
                    )
                },
                if w.drained { "yes" } else { "no" }.to_owned(),
                w.health
                    .as_ref()
                    .filter(|_| connected)
                    .map_or_else(|| "-".to_owned(), value_name),
                // The gateway releases some on it once it is back: its devices are held till then.
                {
                    let held = w
                        .leases
                        .as_ref()
                        .map_or_else(|| "-".to_owned(), |l| l.len().to_string());
                    match w.releasing.len() {
                        0 => held,
                        releasing => format!("{held} ({releasing} releasing)"),
                    }
                },
                // What it can serve, as it last said: only while it is reachable.
                w.capabilities
                    .as_deref()
                    .filter(|_| connected)
                    .map_or_else(|| "-".to_owned(), serves),
            ]
        })
        .collect();
    table(
        &[
            "WORKER",
            "LABEL",
            "CONNECTION",
            "DRAINED",
            "HEALTH",
            "LEASES",
            "SERVES",
        ],
        &rows,
    )
}

/// One event on one line.
pub(crate) fn event(event: &EventEnvelope) -> String {
    format!(
        "{}  {}  {}  {}",
        timestamp(event.timestamp),
        event.event,
        event.module,
        event.payload
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A cell cannot forge a row or reach the terminal with an escape sequence.
    #[test]
    fn a_cells_control_characters_are_shown_escaped() {
        let rows = vec![vec![
            "lse_1".to_owned(),
            "evil\nlse_fake  root\u{1b}[31mRED\u{0}".to_owned(),
        ]];
        let out = table(&["LEASE", "REQUESTER"], &rows);
        assert_eq!(out.lines().count(), 2, "{out}");
        assert!(!out.chars().any(|c| c.is_control() && c != '\n'), "{out:?}");
        assert!(
            out.ends_with("evil\\nlse_fake  root\\u{1b}[31mRED\\u{0}"),
            "{out}"
        );
        assert_eq!(visible("Zoë 🦀"), "Zoë 🦀");
        assert_eq!(visible("agent-1\u{200b}"), "agent-1\\u{200b}");
    }

    /// A running worker's status with nothing in it but `uplink`.
    fn worker_status(uplink: Option<simlock_contract::model::UplinkStatus>) -> StatusOutput {
        use simlock_contract::model::{DaemonInfo, Health, HostFacts, Mode};
        let daemon = DaemonInfo {
            health: Health::Running,
            mode: Mode::Worker,
            version: "0.1.0".into(),
            instance_id: "63a0ce42".into(),
        };
        let host = HostFacts {
            os: "linux".into(),
            os_version: "6.8".into(),
            arch: "x86_64".into(),
            tools: Vec::new(),
        };
        StatusOutput {
            uplink,
            ..StatusOutput::bare(daemon, host)
        }
    }

    #[test]
    fn the_status_lists_who_waits_in_queue_order() {
        let mut status = worker_status(None);
        status.queue_depth = Some(2);
        let w = |id: &str, requester: &str, position: Option<u32>, model: Option<&str>| {
            serde_json::from_value::<WaitingRequest>(serde_json::json!({
                "id": id, "requesterId": requester, "createdAt": now_ms() - 12_000,
                "spec": {"platform": "ios", "model": model},
                "stage": if position.is_some() { "queued" } else { "starting" },
                "queuePosition": position,
            }))
            .unwrap()
        };
        status.waiting = Some(vec![
            w("req_1", "agent-b", None, None),
            w("req_2", "agent-c", Some(2), Some("iPhone 16")),
        ]);
        let out = status_text(&status);
        let lines: Vec<&str> = out.lines().skip(2).collect();
        assert_eq!(lines[0], "queue     2 waiting");
        assert!(
            lines[1].starts_with("          - agent-b  ios  starting for 1"),
            "{out}"
        );
        assert!(
            lines[2].starts_with("          2. agent-c  ios iPhone 16  queued for 1"),
            "{out}"
        );
        // Why a queued one waits, and the worker a starting one is on, by its label.
        let mut why = w("req_3", "agent-d", Some(1), None);
        why.waiting_for = Some(WaitingFor::NoWorker);
        let mut on = w("req_4", "agent-e", None, None);
        on.worker_id = Some("5f0e-uuid".into());
        on.worker = Some(WorkerRef {
            id: "5f0e-uuid".into(),
            label: Some("mini".into()),
            connection: Some(Connection::Connected),
        });
        let mut forged = w("req_5", "agent-f\u{1b}[2K\rroot", Some(2), None);
        forged.worker = Some(WorkerRef {
            id: "w9".into(),
            label: Some("lab\u{7}".into()),
            connection: Some(Connection::Connected),
        });
        let lines = waiting(&[why, on, forged]);
        // What a daemon sent is printed with its hidden characters escaped, as tables do.
        assert!(
            lines[2].starts_with("2. agent-f\\u{1b}[2K\\rroot  ios  queued on lab\\u{7} for"),
            "{lines:?}"
        );
        assert!(
            lines[0].starts_with("1. agent-d  ios  queued for 1")
                && lines[0].ends_with(": no worker that can serve it takes requests"),
            "{lines:?}"
        );
        assert!(
            lines[1].starts_with("- agent-e  ios  starting on mini for 1"),
            "{lines:?}"
        );
        let many: Vec<WaitingRequest> = (0..12)
            .map(|n| w(&format!("req_{n}"), "a", Some(n), None))
            .collect();
        assert_eq!(waiting(&many[..10]).len(), 10, "ten are all shown");
        let listed = waiting(&many[..11]);
        assert_eq!(listed.len(), 11);
        assert_eq!(
            listed[10],
            "… and 1 more (simlock status --json lists them)"
        );
        let listed = waiting(&many);
        assert_eq!(listed.len(), 11);
        assert_eq!(
            listed[10],
            "… and 2 more (simlock status --json lists them)"
        );
    }

    fn status_text(status: &StatusOutput) -> String {
        self::status(status, LeaseScope::Every)
    }

    #[test]
    fn status_shows_a_workers_gateway_and_why_it_is_not_connected() {
        use simlock_contract::model::{UplinkConnection, UplinkStatus};
        let head = "daemon    worker running, version 0.1.0, instance 63a0ce42\nhost      linux 6.8 x86_64";
        assert_eq!(status(&worker_status(None), LeaseScope::Every), head);

        let connected = UplinkStatus {
            gateway: "ws://gw:4700".into(),
            state: UplinkConnection::Connected,
            last_error: None,
            since: 1_700_000_000_000,
        };
        assert_eq!(
            status(&worker_status(Some(connected.clone())), LeaseScope::Every),
            format!("{head}\ngateway   ws://gw:4700 connected")
        );

        let rejected = UplinkStatus {
            state: UplinkConnection::Connecting,
            last_error: Some("rejected with HTTP 401: check gateway.token".into()),
            ..connected.clone()
        };
        assert_eq!(
            status(&worker_status(Some(rejected)), LeaseScope::Every),
            format!(
                "{head}\ngateway   ws://gw:4700 connecting (last error: rejected with HTTP 401: check gateway.token)"
            )
        );

        // Before the first attempt has failed there is no error to name.
        let dialling = UplinkStatus {
            state: UplinkConnection::Connecting,
            ..connected
        };
        assert_eq!(
            status(&worker_status(Some(dialling)), LeaseScope::Every),
            format!("{head}\ngateway   ws://gw:4700 connecting")
        );
    }

    #[test]
    fn each_platforms_driver_is_shown_with_why_and_one_that_cannot_serve_says_so() {
        use simlock_contract::model::{DriverKind, DriverStatus, Platform};
        let list = [
            DriverStatus {
                platform: Platform::Ios,
                driver: DriverKind::Virtual,
                available: true,
                reason: "auto: xcrun not found".into(),
            },
            DriverStatus {
                platform: Platform::Android,
                driver: DriverKind::AndroidSdk,
                available: false,
                reason: "adb did not answer".into(),
            },
        ];
        assert_eq!(
            drivers(&list),
            "ios virtual (auto: xcrun not found); android android-sdk, unavailable (adb did not answer)"
        );
    }

    #[test]
    fn durations_read_naturally() {
        assert_eq!(duration(500), "500ms");
        assert_eq!(duration(45_000), "45s");
        assert_eq!(duration(900_000), "15m");
        assert_eq!(duration(5_430_000), "1h30m30s");
        assert_eq!(duration(3_600_000), "1h");
        assert_eq!(duration(93_600_999), "1d2h");
    }

    #[test]
    fn timestamps_are_utc_iso() {
        assert_eq!(timestamp(0), "1970-01-01T00:00:00.000Z");
        assert_eq!(timestamp(1_700_000_000_123), "2023-11-14T22:13:20.123Z");
        assert_eq!(timestamp(951_782_400_000), "2000-02-29T00:00:00.000Z");
    }

    #[test]
    fn the_serves_line_names_each_capability_and_says_when_there_is_none() {
        use simlock_contract::model::CapabilityStatus;
        assert_eq!(serves(&[]), "no capabilities");
        let both = [
            CapabilityStatus {
                name: "agent-device".into(),
                available: true,
                reason: None,
            },
            CapabilityStatus {
                name: "metal".into(),
                available: false,
                reason: Some("no GPU".into()),
            },
        ];
        assert_eq!(serves(&both), "agent-device, metal (unavailable)");
    }

    #[test]
    fn a_view_of_ones_own_leases_says_whose_it_is() {
        assert_eq!(leases(&[], LeaseScope::Every), "no leases");
        assert_eq!(
            leases(&[], LeaseScope::Own("alice")),
            "no leases of yours (principal alice); every lease: simlock leases --all (operators)"
        );
        assert_eq!(
            leases(&[], LeaseScope::Token),
            "no leases this token may see; every lease: simlock leases --all (operators)"
        );
        assert_eq!(
            LeaseScope::of(Some((simlock_contract::Role::Agent, "alice"))),
            LeaseScope::Own("alice")
        );
        assert_eq!(
            LeaseScope::of(Some((simlock_contract::Role::Admin, "root"))),
            LeaseScope::Every
        );
        assert_eq!(LeaseScope::of(None), LeaseScope::Token);
    }

    #[test]
    fn a_platform_that_cannot_serve_says_why_in_the_catalog() {
        let out: CatalogOutput = serde_json::from_value(serde_json::json!({"platforms": [
            {"platform": "ios", "models": ["iPhone 16"], "runtimes": ["18.2"],
             "modelRuntimes": {"iPhone 16": ["18.2"]}, "modelAliases": {}},
            {"platform": "android", "models": [], "runtimes": [], "modelRuntimes": {}, "modelAliases": {},
             "unavailable": "no adb on PATH"}
        ]}))
        .unwrap();
        assert_eq!(
            catalog(&out),
            "ios: models iPhone 16; runtimes 18.2\nandroid: unavailable (no adb on PATH)"
        );
    }

    #[test]
    fn a_workers_own_tables_have_no_worker_column_and_a_gateways_do() {
        let device = |worker: Option<Value>| -> Device {
            let mut d = serde_json::json!({
                "createdAt": 0, "driverDeviceId": "U-1", "id": "dev_1", "state": "ready",
                "spec": {"model": "iPhone 16", "osVersion": "18.2", "platform": "ios"}
            });
            if let Some(w) = worker {
                d["worker"] = w;
            }
            serde_json::from_value(d).unwrap()
        };
        let own = devices(&[device(None)]);
        assert_eq!(
            own.lines().next().unwrap().split_whitespace().last(),
            Some("STATE")
        );
        let through = devices(&[device(Some(
            serde_json::json!({"id": "w1", "label": "mini", "connection": "connected"}),
        ))]);
        assert!(
            through.lines().next().unwrap().ends_with("WORKER"),
            "{through}"
        );
        assert!(
            through.lines().nth(1).unwrap().ends_with("mini"),
            "{through}"
        );

        let lease = |worker_id: Option<&str>| -> LeaseRecord {
            let mut l = serde_json::json!({
                "deviceId": "dev_1", "grantedAt": 0, "id": "lse_1", "lastRenewedAt": 0,
                "ownerId": "alice", "requesterId": "agent-7", "ttlDeadline": 0, "ttlMs": 1000
            });
            if let Some(id) = worker_id {
                l["workerId"] = id.into();
            }
            serde_json::from_value(l).unwrap()
        };
        let own = leases(&[lease(None)], LeaseScope::Every);
        assert!(!own.contains("WORKER"), "{own}");
        let through = leases(&[lease(Some("w1")), lease(None)], LeaseScope::Every);
        assert!(
            through.lines().next().unwrap().ends_with("WORKER"),
            "{through}"
        );
        assert!(through.lines().nth(2).unwrap().ends_with('-'), "{through}");
    }

    #[test]
    fn a_worker_cell_names_the_worker_and_says_when_it_is_away() {
        let named = |label: Option<&str>, connection| WorkerRef {
            id: "63a0ce42".into(),
            label: label.map(str::to_owned),
            connection,
        };
        let none = BTreeSet::new();
        assert_eq!(worker(None, None, &none), "-");
        assert_eq!(worker(None, Some("63a0ce42"), &none), "63a0ce42");
        let mini = named(Some("mini"), Some(Connection::Connected));
        assert_eq!(worker(Some(&mini), None, &none), "mini");
        assert_eq!(worker(Some(&named(None, None)), None, &none), "63a0ce42");
        let away = named(Some("mini"), Some(Connection::Disconnected));
        assert_eq!(worker(Some(&away), None, &none), "mini (disconnected)");
        assert_eq!(
            worker(
                Some(&named(None, Some(Connection::Incompatible))),
                None,
                &none
            ),
            "63a0ce42 (incompatible)"
        );
        // Two workers in one table with one label: each cell adds its id.
        let twin = WorkerRef {
            id: "9e71f5c7".into(),
            ..mini.clone()
        };
        let shared = shared_labels([Some(&mini), Some(&twin), Some(&mini), None].into_iter());
        assert_eq!(shared, BTreeSet::from(["mini"]));
        assert_eq!(worker(Some(&twin), None, &shared), "mini [9e71f5c7]");
        assert_eq!(
            worker(Some(&away), None, &shared),
            "mini [63a0ce42] (disconnected)"
        );
        assert!(shared_labels([Some(&mini), Some(&mini)].into_iter()).is_empty());
    }

    #[test]
    fn leases_a_gateway_has_not_read_are_named_below_the_list() {
        let worker = |id: &str, label: Option<&str>, connection| WorkerRef {
            id: id.into(),
            label: label.map(String::from),
            connection: Some(connection),
        };
        assert_eq!(unread_workers(&[]), None, "every worker's leases read");
        assert_eq!(
            unread_workers(&[
                worker("w1", Some("mini"), Connection::Disconnected),
                worker("w3", None, Connection::Connected),
            ])
            .as_deref(),
            Some(
                "(not listed: the leases on mini (disconnected), w3; this gateway has not read them since it started, and lists them once each worker reports)"
            )
        );
    }

    #[test]
    fn the_worker_count_says_how_many_the_gateway_can_reach() {
        let view = |id: &str, connection| {
            let mut view: WorkerView = serde_json::from_value(serde_json::json!({
                "id": id, "connection": "connected", "drained": false, "lastSeenAt": 0
            }))
            .unwrap();
            view.connection = connection;
            view
        };
        assert_eq!(worker_count(&[]), "0 (0 connected)");
        assert_eq!(
            worker_count(&[
                view("a", Connection::Connected),
                view("b", Connection::Disconnected),
                view("c", Connection::Connected),
            ]),
            "3 (2 connected, 1 disconnected)"
        );
        let mut drained = view("d", Connection::Connected);
        drained.drained = true;
        assert_eq!(
            worker_count(&[view("a", Connection::Connected), drained]),
            "2 (2 connected; 1 drained)"
        );
        let mut away = view("b", Connection::Disconnected);
        let agent_device = simlock_contract::model::CapabilityStatus {
            name: "agent-device".into(),
            available: true,
            reason: None,
        };
        away.capabilities = Some(vec![agent_device.clone()]);
        let mut near = view("a", Connection::Connected);
        near.capabilities = Some(vec![agent_device]);
        let table = workers(&[away, near]);
        let row = table.lines().nth(1).unwrap();
        assert!(row.contains("disconnected, seen "), "{table}");
        assert!(
            row.ends_with(" -"),
            "what it can serve is unknown while away: {table}"
        );
        let row = table.lines().nth(2).unwrap();
        assert!(row.ends_with(" agent-device"), "{table}");
        assert!(table.lines().next().unwrap().ends_with("SERVES"), "{table}");
        // Leases the gateway releases on a worker once it is back are counted beside its own.
        let mut away = view("b", Connection::Disconnected);
        away.leases = Some(Vec::new());
        away.releasing = vec!["w-lease-1".into(), "w-lease-2".into()];
        let unread = WorkerView {
            releasing: vec!["w-lease-3".into()],
            ..view("c", Connection::Disconnected)
        };
        let table = workers(&[away, unread, view("a", Connection::Connected)]);
        let cells = |n: usize| {
            table
                .lines()
                .nth(n)
                .unwrap()
                .split("  ")
                .filter(|c| !c.is_empty())
                .map(str::trim)
                .map(str::to_owned)
                .collect::<Vec<_>>()
        };
        assert!(cells(1).contains(&"0 (2 releasing)".to_owned()), "{table}");
        assert!(cells(2).contains(&"- (1 releasing)".to_owned()), "{table}");
        assert!(cells(3).contains(&"-".to_owned()), "{table}");
    }

    #[test]
    fn tables_pad_columns() {
        let rows = vec![vec!["a".to_owned(), "bb".to_owned(), "c".to_owned()]];
        assert_eq!(table(&["X", "Y", "Z"], &rows), "X  Y   Z\na  bb  c");
    }
}
