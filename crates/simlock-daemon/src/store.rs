//! The SQLite database both daemons keep their state in: WAL, `synchronous = NORMAL`
//! (ADR 0013), migrations in code.
//!
//! Each component owns its tables and their migrations; [`Database::migrate`] applies the ones
//! a component has not seen yet, each in its own transaction, and records them.

use std::path::Path;
use std::sync::Arc;

use parking_lot::Mutex;
use rusqlite::{Connection, OptionalExtension, params};

/// A store failure. Surfaces to callers as `INTERNAL`.
#[derive(Debug, thiserror::Error)]
#[error("state store: {0}")]
pub struct StoreError(#[from] rusqlite::Error);

/// A handle to the database, shared by every component of a daemon.
#[derive(Clone)]
pub struct Database {
    conn: Arc<Mutex<Connection>>,
}

impl std::fmt::Debug for Database {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Database").finish_non_exhaustive()
    }
}

impl Database {
    /// Opens (creating) the database at `path`.
    ///
    /// # Errors
    /// When the file cannot be opened or configured.
    pub fn open(path: &Path) -> Result<Self, StoreError> {
        let conn = Connection::open(path)?;
        Self::configure(conn)
    }

    /// An in-memory database, for tests.
    ///
    /// # Errors
    /// When SQLite cannot allocate it.
    pub fn open_in_memory() -> Result<Self, StoreError> {
        Self::configure(Connection::open_in_memory()?)
    }

    fn configure(conn: Connection) -> Result<Self, StoreError> {
        // WAL keeps readers off the writer's back. NORMAL sync in WAL mode makes every commit
        // survive a killed process (kill -9) without an fsync per commit; only a power loss can
        // roll back the last commits (ADR 0013).
        conn.pragma_update(None, "journal_mode", "WAL")?;
        conn.pragma_update(None, "synchronous", "NORMAL")?;
        conn.pragma_update(None, "foreign_keys", "ON")?;
        conn.busy_timeout(std::time::Duration::from_secs(5))?;
        conn.execute_batch(
            "CREATE TABLE IF NOT EXISTS schema_migrations (
                component TEXT NOT NULL,
                version INTEGER NOT NULL,
                PRIMARY KEY (component, version)
            );
            CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);",
        )?;
        Ok(Self {
            conn: Arc::new(Mutex::new(conn)),
        })
    }

    /// Applies `component`'s migrations it has not applied yet, in order.
    ///
    /// # Errors
    /// When a migration fails; nothing of that migration is kept.
    pub fn migrate(&self, component: &str, migrations: &[&str]) -> Result<(), StoreError> {
        let mut conn = self.conn.lock();
        for (index, sql) in migrations.iter().enumerate() {
            let version = i64::try_from(index).unwrap_or(i64::MAX) + 1;
            let applied: Option<i64> = conn
                .query_row(
                    "SELECT version FROM schema_migrations WHERE component = ?1 AND version = ?2",
                    params![component, version],
                    |row| row.get(0),
                )
                .optional()?;
            if applied.is_some() {
                continue;
            }
            let tx = conn.transaction()?;
            tx.execute_batch(sql)?;
            tx.execute(
                "INSERT INTO schema_migrations (component, version) VALUES (?1, ?2)",
                params![component, version],
            )?;
            tx.commit()?;
        }
        Ok(())
    }

    /// Runs `f` with the connection (one writer at a time).
    ///
    /// # Errors
    /// Whatever `f` returns.
    pub fn with<T>(
        &self,
        f: impl FnOnce(&mut Connection) -> rusqlite::Result<T>,
    ) -> Result<T, StoreError> {
        let mut conn = self.conn.lock();
        Ok(f(&mut conn)?)
    }

    /// A value from the `meta` table.
    ///
    /// # Errors
    /// On a store failure.
    pub fn meta(&self, key: &str) -> Result<Option<String>, StoreError> {
        self.with(|c| {
            c.query_row("SELECT value FROM meta WHERE key = ?1", [key], |row| {
                row.get(0)
            })
            .optional()
        })
    }

    /// Sets a value in the `meta` table.
    ///
    /// # Errors
    /// On a store failure.
    pub fn set_meta(&self, key: &str, value: &str) -> Result<(), StoreError> {
        self.with(|c| {
            c.execute(
                "INSERT INTO meta (key, value) VALUES (?1, ?2) ON CONFLICT(key) DO UPDATE SET value = excluded.value",
                params![key, value],
            )
            .map(|_| ())
        })
    }

    /// The daemon's instance id, minted by `mint` on first start and kept for good.
    ///
    /// # Errors
    /// On a store failure.
    pub fn instance_id(&self, mint: impl FnOnce() -> String) -> Result<String, StoreError> {
        if let Some(id) = self.meta("instance_id")? {
            return Ok(id);
        }
        let id = mint();
        self.set_meta("instance_id", &id)?;
        Ok(id)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn migrations_apply_once_per_component() {
        let db = Database::open_in_memory().unwrap();
        let migrations = [
            "CREATE TABLE a (x INTEGER)",
            "ALTER TABLE a ADD COLUMN y INTEGER",
        ];
        db.migrate("test", &migrations).unwrap();
        db.migrate("test", &migrations).unwrap();
        let count: i64 = db
            .with(|c| c.query_row("SELECT count(*) FROM schema_migrations", [], |r| r.get(0)))
            .unwrap();
        assert_eq!(count, 2);
    }

    #[test]
    fn a_failed_migration_leaves_nothing_behind() {
        let db = Database::open_in_memory().unwrap();
        assert!(
            db.migrate("bad", &["CREATE TABLE b (x INTEGER); THIS IS NOT SQL"])
                .is_err()
        );
        let tables: i64 = db
            .with(|c| {
                c.query_row(
                    "SELECT count(*) FROM sqlite_master WHERE name = 'b'",
                    [],
                    |r| r.get(0),
                )
            })
            .unwrap();
        assert_eq!(tables, 0);
    }

    #[test]
    fn the_instance_id_is_minted_once() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("state.db");
        let first = Database::open(&path)
            .unwrap()
            .instance_id(|| "one".into())
            .unwrap();
        let again = Database::open(&path)
            .unwrap()
            .instance_id(|| "two".into())
            .unwrap();
        assert_eq!((first.as_str(), again.as_str()), ("one", "one"));
    }
}
