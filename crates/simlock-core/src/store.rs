//! The worker's tables in the daemon's SQLite database: devices, leases and the request book.
//!
//! Rows are written in one transaction per decision, before anyone is answered, so a killed
//! process loses no committed lease. Wire shapes kept inside rows (a grant, a failure, a
//! requested device) are stored as the contract's JSON.

use rusqlite::{Connection, Row, params};
use serde_json::Value;
use simlock_contract::ids::{DeviceId, LeaseId, RequestId};
use simlock_contract::model::{DeviceAccess, DeviceSpec, DeviceState, LeaseRecord, Platform};
use simlock_contract::{ContractError, ErrorBody};
use simlock_daemon::Database;
use simlock_daemon::store::StoreError;

use crate::book::{RecordState, RequestRecord};
use crate::state::{DeviceEntry, Quarantine, Writes};

/// The component name under which the migrations are recorded.
pub const COMPONENT: &str = "core";

/// The schema, one migration per entry, applied in order once each.
pub const MIGRATIONS: &[&str] = &[
    "
CREATE TABLE core_devices (
    id TEXT PRIMARY KEY,
    platform TEXT NOT NULL,
    model TEXT NOT NULL,
    os_version TEXT NOT NULL,
    state TEXT NOT NULL,
    driver_device_id TEXT NOT NULL,
    created_at INTEGER NOT NULL,
    last_lease_ended_at INTEGER,
    idle_since INTEGER NOT NULL,
    last_used_at INTEGER NOT NULL
);
CREATE TABLE core_leases (
    id TEXT PRIMARY KEY,
    device_id TEXT NOT NULL,
    requester_id TEXT NOT NULL UNIQUE,
    owner_id TEXT NOT NULL,
    granted_at INTEGER NOT NULL,
    ttl_ms INTEGER NOT NULL,
    ttl_deadline INTEGER NOT NULL,
    last_renewed_at INTEGER NOT NULL,
    id_chosen INTEGER NOT NULL
);
CREATE TABLE core_requests (
    id TEXT PRIMARY KEY,
    requester_id TEXT NOT NULL,
    owner_id TEXT NOT NULL,
    principal TEXT NOT NULL,
    idempotency_key TEXT,
    fingerprint TEXT NOT NULL,
    requested TEXT NOT NULL,
    created_at INTEGER NOT NULL,
    state TEXT NOT NULL,
    settled_at INTEGER,
    grant_json TEXT,
    failure_json TEXT
);
CREATE INDEX core_requests_key ON core_requests (requester_id, idempotency_key);
",
    "
ALTER TABLE core_devices ADD COLUMN access_json TEXT;
ALTER TABLE core_devices ADD COLUMN quarantine_attempts INTEGER;
ALTER TABLE core_devices ADD COLUMN quarantine_next_retry_at INTEGER;
ALTER TABLE core_devices ADD COLUMN recovery_attempts INTEGER;
ALTER TABLE core_leases ADD COLUMN access_json TEXT;
",
];

/// Creates or upgrades the worker's tables.
///
/// # Errors
/// When a migration fails.
pub fn migrate(db: &Database) -> Result<(), StoreError> {
    db.migrate(COMPONENT, MIGRATIONS)
}

/// What was stored.
#[derive(Debug, Default)]
pub(crate) struct Stored {
    pub devices: Vec<DeviceEntry>,
    pub leases: Vec<LeaseRecord>,
    pub requests: Vec<RequestRecord>,
}

fn to_json<T: serde::Serialize>(value: &T) -> rusqlite::Result<String> {
    serde_json::to_string(value).map_err(|e| rusqlite::Error::ToSqlConversionFailure(Box::new(e)))
}

fn from_json<T: serde::de::DeserializeOwned>(index: usize, text: &str) -> rusqlite::Result<T> {
    serde_json::from_str(text).map_err(|e| {
        rusqlite::Error::FromSqlConversionFailure(index, rusqlite::types::Type::Text, Box::new(e))
    })
}

fn enum_name<T: serde::Serialize>(value: &T) -> rusqlite::Result<String> {
    match serde_json::to_value(value) {
        Ok(Value::String(name)) => Ok(name),
        Ok(other) => Err(rusqlite::Error::ToSqlConversionFailure(
            format!("not a name: {other}").into(),
        )),
        Err(e) => Err(rusqlite::Error::ToSqlConversionFailure(Box::new(e))),
    }
}

fn from_name<T: serde::de::DeserializeOwned>(index: usize, name: String) -> rusqlite::Result<T> {
    serde_json::from_value(Value::String(name)).map_err(|e| {
        rusqlite::Error::FromSqlConversionFailure(index, rusqlite::types::Type::Text, Box::new(e))
    })
}

fn access_column(row: &Row<'_>, index: usize) -> rusqlite::Result<Option<DeviceAccess>> {
    row.get::<_, Option<String>>(index)?
        .map(|text| from_json(index, &text))
        .transpose()
}

fn device_row(row: &Row<'_>) -> rusqlite::Result<DeviceEntry> {
    let platform: Platform = from_name(1, row.get(1)?)?;
    let state: DeviceState = from_name(4, row.get(4)?)?;
    let quarantine = match (
        row.get::<_, Option<u32>>(11)?,
        row.get::<_, Option<i64>>(12)?,
    ) {
        (Some(attempts), Some(next_retry_at)) => Some(Quarantine {
            attempts,
            next_retry_at,
        }),
        _ => None,
    };
    Ok(DeviceEntry {
        id: DeviceId::from_raw(row.get::<_, String>(0)?),
        spec: DeviceSpec {
            platform,
            model: row.get(2)?,
            os_version: row.get(3)?,
        },
        state,
        driver_device_id: row.get(5)?,
        created_at: row.get(6)?,
        last_lease_ended_at: row.get(7)?,
        idle_since: row.get(8)?,
        last_used_at: row.get(9)?,
        access: access_column(row, 10)?,
        quarantine,
        recovery_attempts: row.get::<_, Option<u32>>(13)?.unwrap_or_default(),
        claim: None,
        busy: false,
        reclaim_until: None,
        stopped_seen: 0,
        recovery_due: None,
        reclaim_after_work: false,
    })
}

fn lease_row(row: &Row<'_>) -> rusqlite::Result<LeaseRecord> {
    Ok(LeaseRecord {
        id: LeaseId::from_raw(row.get::<_, String>(0)?),
        device_id: DeviceId::from_raw(row.get::<_, String>(1)?),
        requester_id: row.get(2)?,
        owner_id: row.get(3)?,
        granted_at: row.get(4)?,
        ttl_ms: u64::try_from(row.get::<_, i64>(5)?).unwrap_or_default(),
        ttl_deadline: row.get(6)?,
        last_renewed_at: row.get(7)?,
        id_chosen_by_requester: row.get(8)?,
        access: access_column(row, 9)?,
        worker: None,
        worker_id: None,
    })
}

fn request_row(row: &Row<'_>) -> rusqlite::Result<RequestRecord> {
    let state_name: String = row.get(8)?;
    let state = RecordState::parse(&state_name).ok_or_else(|| {
        rusqlite::Error::FromSqlConversionFailure(
            8,
            rusqlite::types::Type::Text,
            format!("unknown request state {state_name}").into(),
        )
    })?;
    let grant = row
        .get::<_, Option<String>>(10)?
        .map(|text| from_json(10, &text))
        .transpose()?;
    let failure = row
        .get::<_, Option<String>>(11)?
        .map(|text| from_json::<ErrorBody>(11, &text).map(ContractError::from_body))
        .transpose()?;
    Ok(RequestRecord {
        id: RequestId::from_raw(row.get::<_, String>(0)?),
        requester_id: row.get(1)?,
        owner_id: row.get(2)?,
        principal: row.get(3)?,
        idempotency_key: row.get(4)?,
        fingerprint: row.get(5)?,
        requested: from_json(6, &row.get::<_, String>(6)?)?,
        created_at: row.get(7)?,
        state,
        settled_at: row.get(9)?,
        grant,
        failure,
    })
}

/// Reads every stored row.
pub(crate) fn load(db: &Database) -> Result<Stored, StoreError> {
    db.with(|c| {
        let devices = c
            .prepare(
                "SELECT id, platform, model, os_version, state, driver_device_id, created_at,
                        last_lease_ended_at, idle_since, last_used_at, access_json,
                        quarantine_attempts, quarantine_next_retry_at, recovery_attempts
                 FROM core_devices ORDER BY id",
            )?
            .query_map([], device_row)?
            .collect::<rusqlite::Result<Vec<_>>>()?;
        let leases = c
            .prepare(
                "SELECT id, device_id, requester_id, owner_id, granted_at, ttl_ms, ttl_deadline,
                        last_renewed_at, id_chosen, access_json
                 FROM core_leases ORDER BY granted_at, id",
            )?
            .query_map([], lease_row)?
            .collect::<rusqlite::Result<Vec<_>>>()?;
        let requests = c
            .prepare(
                "SELECT id, requester_id, owner_id, principal, idempotency_key, fingerprint,
                        requested, created_at, state, settled_at, grant_json, failure_json
                 FROM core_requests ORDER BY created_at, id",
            )?
            .query_map([], request_row)?
            .collect::<rusqlite::Result<Vec<_>>>()?;
        Ok(Stored {
            devices,
            leases,
            requests,
        })
    })
}

/// Writes one decision's rows in one transaction.
pub(crate) fn write(db: &Database, writes: &Writes) -> Result<(), StoreError> {
    db.with(|c| {
        let tx = c.transaction()?;
        write_rows(&tx, writes)?;
        tx.commit()
    })
}

/// One statement per row: an upsert, or a delete. Statements are prepared once per
/// connection (a renewal, the most frequent decision, is one cached upsert).
fn write_rows(c: &Connection, writes: &Writes) -> rusqlite::Result<()> {
    for (id, row) in &writes.devices {
        match row {
            Some(d) => {
                c.prepare_cached(
                    "INSERT INTO core_devices (id, platform, model, os_version, state,
                        driver_device_id, created_at, last_lease_ended_at, idle_since, last_used_at,
                        access_json, quarantine_attempts, quarantine_next_retry_at,
                        recovery_attempts)
                     VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?12, ?13, ?14)
                     ON CONFLICT(id) DO UPDATE SET state = excluded.state,
                        driver_device_id = excluded.driver_device_id,
                        last_lease_ended_at = excluded.last_lease_ended_at,
                        idle_since = excluded.idle_since, last_used_at = excluded.last_used_at,
                        access_json = excluded.access_json,
                        quarantine_attempts = excluded.quarantine_attempts,
                        quarantine_next_retry_at = excluded.quarantine_next_retry_at,
                        recovery_attempts = excluded.recovery_attempts",
                )?
                .execute(params![
                    d.id.as_str(),
                    d.spec.platform.as_str(),
                    d.spec.model,
                    d.spec.os_version,
                    enum_name(&d.state)?,
                    d.driver_device_id,
                    d.created_at,
                    d.last_lease_ended_at,
                    d.idle_since,
                    d.last_used_at,
                    d.access.as_ref().map(to_json).transpose()?,
                    d.quarantine.map(|q| q.attempts),
                    d.quarantine.map(|q| q.next_retry_at),
                    (d.recovery_attempts > 0).then_some(d.recovery_attempts),
                ])?;
            }
            None => {
                c.prepare_cached("DELETE FROM core_devices WHERE id = ?1")?
                    .execute([id.as_str()])?;
            }
        }
    }
    // Deletes first: a requester's new lease may replace its old one in one decision
    // (`requester_id` is unique).
    for (id, row) in &writes.leases {
        if row.is_none() {
            c.prepare_cached("DELETE FROM core_leases WHERE id = ?1")?
                .execute([id])?;
        }
    }
    for l in writes.leases.iter().filter_map(|(_, row)| row.as_ref()) {
        c.prepare_cached(
            "INSERT INTO core_leases (id, device_id, requester_id, owner_id, granted_at,
                ttl_ms, ttl_deadline, last_renewed_at, id_chosen, access_json)
             VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10)
             ON CONFLICT(id) DO UPDATE SET device_id = excluded.device_id,
                requester_id = excluded.requester_id, owner_id = excluded.owner_id,
                granted_at = excluded.granted_at, ttl_ms = excluded.ttl_ms,
                ttl_deadline = excluded.ttl_deadline, last_renewed_at = excluded.last_renewed_at,
                id_chosen = excluded.id_chosen, access_json = excluded.access_json",
        )?
        .execute(params![
            l.id.as_str(),
            l.device_id.as_str(),
            l.requester_id,
            l.owner_id,
            l.granted_at,
            i64::try_from(l.ttl_ms).unwrap_or(i64::MAX),
            l.ttl_deadline,
            l.last_renewed_at,
            l.id_chosen_by_requester,
            l.access.as_ref().map(to_json).transpose()?,
        ])?;
    }
    for (id, row) in &writes.requests {
        let Some(r) = row else {
            c.prepare_cached("DELETE FROM core_requests WHERE id = ?1")?
                .execute([id.as_str()])?;
            continue;
        };
        let grant = r.grant.as_ref().map(to_json).transpose()?;
        let failure = r
            .failure
            .as_ref()
            .map(|f| to_json(&f.to_body()))
            .transpose()?;
        // The id is the table's only key: a replace is an upsert of the whole row.
        c.prepare_cached(
            "INSERT OR REPLACE INTO core_requests (id, requester_id, owner_id, principal,
                idempotency_key, fingerprint, requested, created_at, state, settled_at,
                grant_json, failure_json)
             VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?12)",
        )?
        .execute(params![
            r.id.as_str(),
            r.requester_id,
            r.owner_id,
            r.principal,
            r.idempotency_key,
            r.fingerprint,
            to_json(&r.requested)?,
            r.created_at,
            r.state.as_str(),
            r.settled_at,
            grant,
            failure,
        ])?;
    }
    Ok(())
}
