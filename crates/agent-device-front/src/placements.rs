//! The relay host link's memory kept in the gateway's own database (`agent_device_placements`),
//! so a gateway that restarts (cleanly or after `kill -9`) still knows where every lease it made
//! lives, and whose it is, before the lease's worker has reconnected.

use rusqlite::{OptionalExtension as _, params};
use simlock_daemon::store::Database;
use tracing::warn;

use crate::lease_id::LeaseId;
use crate::relay_link::{Placement, PlacementStore};

const MIGRATIONS: &[&str] = &[
    "CREATE TABLE agent_device_placements (
        lease_id TEXT PRIMARY KEY,
        worker_id TEXT NOT NULL,
        owner_id TEXT NOT NULL,
        dropped_at INTEGER
    );",
    // A release its holder asked for that the gateway carries out once the lease's worker is
    // back, kept until then (ms since the epoch; ADR 0030).
    "ALTER TABLE agent_device_placements ADD COLUMN release_until INTEGER;",
];

/// [`PlacementStore`] over the daemon's database. A write that fails is logged; the memory in
/// the process stays right, only a restart would miss it.
#[derive(Debug, Clone)]
pub struct DbPlacements {
    db: Database,
}

impl DbPlacements {
    /// The store in `db`, its table made when missing.
    ///
    /// # Errors
    /// When the table cannot be made.
    pub fn open(db: Database) -> Result<Self, simlock_daemon::store::StoreError> {
        db.migrate("agent-device-front", MIGRATIONS)?;
        Ok(Self { db })
    }

    fn write(
        &self,
        what: &str,
        f: impl FnOnce(&mut rusqlite::Connection) -> rusqlite::Result<usize>,
    ) {
        if let Err(e) = self.db.with(f) {
            warn!(error = %e, "cannot {what} an agent-device placement");
        }
    }
}

impl PlacementStore for DbPlacements {
    fn load(&self) -> Vec<(LeaseId, Placement, Option<i64>)> {
        let loaded = self.db.with(|conn| {
            let mut statement = conn.prepare(
                "SELECT lease_id, worker_id, owner_id, dropped_at FROM agent_device_placements",
            )?;
            let rows = statement.query_map([], |row| {
                Ok((
                    row.get::<_, String>(0)?,
                    row.get::<_, String>(1)?,
                    row.get::<_, String>(2)?,
                    row.get::<_, Option<i64>>(3)?,
                ))
            })?;
            rows.collect::<rusqlite::Result<Vec<_>>>()
        });
        match loaded {
            Ok(rows) => rows
                .into_iter()
                .filter_map(|(lease, worker, owner, dropped_at)| {
                    Some((
                        LeaseId::parse(&lease)?,
                        Placement { worker, owner },
                        dropped_at,
                    ))
                })
                .collect(),
            Err(e) => {
                warn!(error = %e, "cannot read the agent-device placements");
                Vec::new()
            }
        }
    }

    fn placed(&self, lease: &LeaseId, placement: &Placement) {
        self.write("record", |conn| {
            conn.execute(
                "INSERT INTO agent_device_placements (lease_id, worker_id, owner_id, dropped_at)
                 VALUES (?1, ?2, ?3, NULL)
                 ON CONFLICT (lease_id) DO UPDATE SET worker_id = ?2, owner_id = ?3, dropped_at = NULL",
                params![lease.as_str(), placement.worker, placement.owner],
            )
        });
    }

    fn dropped(&self, lease: &LeaseId, at: i64) {
        self.write("stamp", |conn| {
            conn.execute(
                "UPDATE agent_device_placements SET dropped_at = ?2 WHERE lease_id = ?1 AND dropped_at IS NULL",
                params![lease.as_str(), at],
            )
        });
    }

    fn releasing(&self, lease: &LeaseId, until: i64) -> bool {
        let kept = self.db.with(|conn| {
            conn.execute(
                "UPDATE agent_device_placements SET release_until = ?2 WHERE lease_id = ?1",
                params![lease.as_str(), until],
            )
        });
        match kept {
            Ok(1) => true,
            Ok(_) => {
                warn!(%lease, "no placement to keep the release of an agent-device lease with");
                false
            }
            Err(e) => {
                warn!(%lease, error = %e, "cannot keep the release of an agent-device lease");
                false
            }
        }
    }

    fn release_settled(&self, lease: &LeaseId) {
        self.write("settle the release of", |conn| {
            conn.execute(
                "UPDATE agent_device_placements SET release_until = NULL WHERE lease_id = ?1",
                params![lease.as_str()],
            )
        });
    }

    fn releases(&self) -> Vec<(LeaseId, i64)> {
        let loaded = self.db.with(|conn| {
            let mut statement = conn.prepare(
                "SELECT lease_id, release_until FROM agent_device_placements
                 WHERE release_until IS NOT NULL",
            )?;
            let rows = statement.query_map([], |row| {
                Ok((row.get::<_, String>(0)?, row.get::<_, i64>(1)?))
            })?;
            rows.collect::<rusqlite::Result<Vec<_>>>()
        });
        match loaded {
            Ok(rows) => rows
                .into_iter()
                .filter_map(|(lease, until)| Some((LeaseId::parse(&lease)?, until)))
                .collect(),
            Err(e) => {
                warn!(error = %e, "cannot read the agent-device releases kept");
                Vec::new()
            }
        }
    }

    fn forget(&self, lease: &LeaseId) {
        self.write("forget", |conn| {
            conn.execute(
                "DELETE FROM agent_device_placements WHERE lease_id = ?1",
                params![lease.as_str()],
            )
        });
    }
}

impl DbPlacements {
    /// Whether `lease` is kept (tests).
    pub fn holds(&self, lease: &LeaseId) -> bool {
        self.db
            .with(|conn| {
                conn.query_row(
                    "SELECT 1 FROM agent_device_placements WHERE lease_id = ?1",
                    params![lease.as_str()],
                    |_| Ok(()),
                )
                .optional()
            })
            .ok()
            .flatten()
            .is_some()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn placements_survive_a_reopen_with_their_drop_stamps_and_forgotten_ones_go() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("state.db");
        let (a, b) = (LeaseId::mint(), LeaseId::mint());
        let place = |w: &str| Placement {
            worker: w.into(),
            owner: "tok_1".into(),
        };
        {
            let store = DbPlacements::open(Database::open(&path).unwrap()).unwrap();
            store.placed(&a, &place("w1"));
            store.placed(&b, &place("w2"));
            store.dropped(&a, 1_000);
            store.dropped(&a, 2_000);
            store.placed(&b, &place("w3"));
        }
        let store = DbPlacements::open(Database::open(&path).unwrap()).unwrap();
        let mut loaded = store.load();
        loaded.sort_by_key(|(_, p, _)| p.worker.clone());
        assert_eq!(
            loaded,
            vec![
                (a.clone(), place("w1"), Some(1_000)),
                (b.clone(), place("w3"), None)
            ]
        );
        store.forget(&a);
        assert!(!store.holds(&a));
        assert!(store.holds(&b));
    }

    #[test]
    fn a_kept_release_survives_a_reopen_until_settled_or_its_lease_is_forgotten() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("state.db");
        let (a, b, unknown) = (LeaseId::mint(), LeaseId::mint(), LeaseId::mint());
        let place = Placement {
            worker: "w1".into(),
            owner: "tok_1".into(),
        };
        {
            let store = DbPlacements::open(Database::open(&path).unwrap()).unwrap();
            store.placed(&a, &place);
            store.placed(&b, &place);
            assert!(store.releasing(&a, 5_000));
            assert!(store.releasing(&b, 6_000));
            // A lease with no placement keeps nothing, and says so.
            assert!(!store.releasing(&unknown, 7_000));
        }
        let store = DbPlacements::open(Database::open(&path).unwrap()).unwrap();
        let mut kept = store.releases();
        kept.sort_by_key(|(_, until)| *until);
        assert_eq!(kept, vec![(a.clone(), 5_000), (b.clone(), 6_000)]);
        store.release_settled(&a);
        store.forget(&b);
        assert!(store.releases().is_empty());
        assert!(store.holds(&a), "settling keeps the placement");
    }
}
