//! The daemon's session records (`<stateDir>/sessions/<session>/`: its request logs, which the
//! diagnostics route serves and the CLI fetches right after a failing command). agent-device
//! keeps them forever, about 30 KB and two directories per `connect` … `disconnect`; the host
//! removes those nothing has written to for `agentDevice.sessionRetentionMs`.

use std::path::Path;
use std::time::{Duration, SystemTime};

use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};

/// The sessions' directory under the daemon's state directory.
pub const SESSIONS_DIR: &str = "sessions";

/// What one sweep did.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Swept {
    /// Sessions removed.
    pub removed: usize,
    /// Sessions kept (written to within the retention).
    pub kept: usize,
}

/// Removes each session under `state_dir` whose newest write (its directory's, or a file's or
/// directory's within it) is older than `now - retention`, unless `held` says a lease the host
/// holds is in it (a lease heartbeated for hours without a command writes nothing there, and
/// the daemon would not make the directory again). A session written to since is kept; one that
/// cannot be read or removed is kept and logged. Nothing outside `sessions/` is touched, and a
/// missing `sessions/` is an empty one.
pub fn sweep(
    state_dir: &Path,
    retention: Duration,
    now: SystemTime,
    held: &dyn Fn(&str) -> bool,
) -> Swept {
    let mut swept = Swept::default();
    let Some(cutoff) = now.checked_sub(retention) else {
        return swept;
    };
    let Ok(entries) = std::fs::read_dir(state_dir.join(SESSIONS_DIR)) else {
        return swept;
    };
    for entry in entries.flatten() {
        let path = entry.path();
        // A symlink is not followed: only the daemon's own directories are removed.
        if !entry.file_type().is_ok_and(|t| t.is_dir()) {
            continue;
        }
        if entry.file_name().to_str().is_some_and(held) {
            swept.kept += 1;
            continue;
        }
        match newest_write(&path) {
            Some(newest) if newest < cutoff => match std::fs::remove_dir_all(&path) {
                Ok(()) => swept.removed += 1,
                Err(e) => {
                    warn!(path = %path.display(), error = %e, "an old agent-device session could not be removed");
                    swept.kept += 1;
                }
            },
            _ => swept.kept += 1,
        }
    }
    swept
}

/// The newest modification time of `dir` and everything under it; `None` when any of it cannot
/// be read (the session is then kept).
fn newest_write(dir: &Path) -> Option<SystemTime> {
    let mut newest = std::fs::symlink_metadata(dir).ok()?.modified().ok()?;
    for entry in std::fs::read_dir(dir).ok()? {
        let entry = entry.ok()?;
        let meta = entry.metadata().ok()?;
        let written = if meta.is_dir() {
            newest_write(&entry.path())?
        } else {
            meta.modified().ok()?
        };
        newest = newest.max(written);
    }
    Some(newest)
}

/// Whether the session directory `name` is the one the daemon keeps for `session` of `tenant`:
/// `<tenant>_<session>` (it scopes a tenant's session as `<tenant>:<session>` and names its
/// directory with `_` for `:`), or the bare session for a call it took unscoped.
pub fn names_session(name: &str, tenant: &str, session: &str) -> bool {
    name == session
        || name
            .strip_prefix(tenant)
            .and_then(|rest| rest.strip_prefix('_'))
            .is_some_and(|rest| rest == session)
}

/// Sweeps `state_dir` now and then every `every` until `stop`, each sweep on a blocking thread;
/// `held` says whether a lease held at that moment is in a session directory.
pub async fn sweep_until_stopped(
    state_dir: std::path::PathBuf,
    retention: Duration,
    every: Duration,
    held: impl Fn(&str) -> bool + Send + Sync + 'static,
    stop: CancellationToken,
) {
    let held = std::sync::Arc::new(held);
    loop {
        let (dir, held) = (state_dir.clone(), held.clone());
        let swept =
            tokio::task::spawn_blocking(move || sweep(&dir, retention, SystemTime::now(), &*held))
                .await;
        match swept {
            Ok(swept) if swept.removed > 0 => {
                info!(
                    removed = swept.removed,
                    kept = swept.kept,
                    "removed agent-device sessions past their retention"
                );
            }
            Ok(swept) => debug!(
                kept = swept.kept,
                "no agent-device session past its retention"
            ),
            Err(e) => warn!(error = %e, "sweeping agent-device sessions failed"),
        }
        tokio::select! {
            () = tokio::time::sleep(every) => {}
            () = stop.cancelled() => return,
        }
    }
}

#[cfg(test)]
mod tests {
    use std::fs::File;

    use super::*;

    const HOUR: Duration = Duration::from_secs(3600);

    /// A session directory with a request log, every part of it last written at `at`.
    fn session(state_dir: &Path, name: &str, at: SystemTime) {
        let dir = state_dir.join(SESSIONS_DIR).join(name);
        std::fs::create_dir_all(dir.join("requests")).unwrap();
        std::fs::write(dir.join("events.ndjson"), b"{}\n").unwrap();
        std::fs::write(dir.join("requests/r1.ndjson"), b"{}\n").unwrap();
        for path in [
            dir.join("requests/r1.ndjson"),
            dir.join("events.ndjson"),
            dir.join("requests"),
            dir.clone(),
        ] {
            File::open(&path).unwrap().set_modified(at).unwrap();
        }
    }

    fn sessions(state_dir: &Path) -> Vec<String> {
        let mut names: Vec<String> = std::fs::read_dir(state_dir.join(SESSIONS_DIR))
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .collect();
        names.sort();
        names
    }

    #[test]
    fn sessions_unwritten_past_the_retention_go_and_the_others_stay() {
        let dir = tempfile::tempdir().unwrap();
        let now = SystemTime::now();
        session(dir.path(), "old", now - 2 * HOUR);
        session(dir.path(), "fresh", now - HOUR / 2);
        // Old but for one request log written since: kept.
        session(dir.path(), "written", now - 3 * HOUR);
        let log = dir.path().join("sessions/written/requests/r2.ndjson");
        std::fs::write(&log, b"{}\n").unwrap();
        File::open(&log)
            .unwrap()
            .set_modified(now - HOUR / 4)
            .unwrap();
        // Not a session: left alone.
        std::fs::write(dir.path().join("daemon.log"), b"").unwrap();
        std::fs::write(dir.path().join("sessions/stray-file"), b"").unwrap();

        let swept = sweep(dir.path(), HOUR, now, &|_| false);
        assert_eq!(
            swept,
            Swept {
                removed: 1,
                kept: 2
            }
        );
        assert_eq!(sessions(dir.path()), ["fresh", "stray-file", "written"]);
        assert!(dir.path().join("daemon.log").exists());
        // Nothing more past the retention: a second sweep removes nothing.
        assert_eq!(sweep(dir.path(), HOUR, now, &|_| false).removed, 0);
    }

    #[test]
    fn no_sessions_directory_is_an_empty_one_and_a_retention_longer_than_the_clock_removes_nothing()
    {
        let dir = tempfile::tempdir().unwrap();
        assert_eq!(
            sweep(dir.path(), HOUR, SystemTime::now(), &|_| false),
            Swept::default()
        );
        session(dir.path(), "old", SystemTime::UNIX_EPOCH + HOUR);
        let swept = sweep(dir.path(), 2 * HOUR, SystemTime::UNIX_EPOCH + HOUR, &|_| {
            false
        });
        assert_eq!(swept.removed, 0);
        assert_eq!(sessions(dir.path()), ["old"]);
    }

    #[test]
    fn a_session_a_held_lease_is_in_stays_however_old() {
        let dir = tempfile::tempdir().unwrap();
        let now = SystemTime::now();
        session(dir.path(), "acme_adc-1", now - 5 * HOUR);
        session(dir.path(), "adc-1", now - 5 * HOUR);
        session(dir.path(), "acme_adc-2", now - 5 * HOUR);
        session(dir.path(), "xadc-1", now - 5 * HOUR);
        // Another tenant's session of the same name is not the held one.
        session(dir.path(), "other_adc-1", now - 5 * HOUR);
        let held = |name: &str| names_session(name, "acme", "adc-1");
        assert_eq!(
            sweep(dir.path(), HOUR, now, &held),
            Swept {
                removed: 3,
                kept: 2
            }
        );
        assert_eq!(sessions(dir.path()), ["acme_adc-1", "adc-1"]);
    }

    #[cfg(unix)]
    #[test]
    fn a_symlinked_session_is_not_followed_nor_removed() {
        let dir = tempfile::tempdir().unwrap();
        let elsewhere = tempfile::tempdir().unwrap();
        let now = SystemTime::now();
        session(elsewhere.path(), "target", now - 5 * HOUR);
        std::fs::create_dir_all(dir.path().join(SESSIONS_DIR)).unwrap();
        std::os::unix::fs::symlink(
            elsewhere.path().join("sessions/target"),
            dir.path().join("sessions/link"),
        )
        .unwrap();
        assert_eq!(sweep(dir.path(), HOUR, now, &|_| false).removed, 0);
        assert!(
            elsewhere
                .path()
                .join("sessions/target/events.ndjson")
                .exists()
        );
    }
}
