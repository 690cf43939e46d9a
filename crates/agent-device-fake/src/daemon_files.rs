//! The files a daemon leaves in its state directory while it runs, as 0.21.5 writes them:
//! `daemon.json` (how to reach it: port, token, pid) and `daemon.lock` (who holds the directory),
//! both mode 0600, both removed when it stops.

use std::fs;
use std::io::{self, Write as _};
use std::os::unix::fs::OpenOptionsExt as _;
use std::path::{Path, PathBuf};
use std::process::Command;

use serde::Serialize;

use crate::server::VERSION;

/// `daemon.json`.
#[derive(Debug, Clone, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct DaemonInfo {
    /// The HTTP port.
    pub http_port: u16,
    /// Always `http`.
    pub transport: &'static str,
    /// The token (48 lower-case hex characters unless fixed).
    pub token: String,
    /// The daemon's pid.
    pub pid: u32,
    /// `0.21.5`.
    pub version: &'static str,
    /// How the code was installed (`installed`).
    pub code_origin: &'static str,
    /// The process start time as `ps -o lstart=` prints it, which clients compare to tell a live
    /// daemon from a reused pid.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub process_start_time: Option<String>,
    /// The state directory.
    pub state_dir: String,
}

#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
struct LockInfo<'a> {
    pid: u32,
    version: &'static str,
    started_at: u64,
    #[serde(skip_serializing_if = "Option::is_none")]
    process_start_time: Option<&'a str>,
}

/// The start time of process `pid` as `ps -o lstart=` prints it, if `ps` can tell.
pub fn process_start_time(pid: u32) -> Option<String> {
    let output = Command::new("ps")
        .args(["-o", "lstart=", "-p", &pid.to_string()])
        .output()
        .ok()?;
    let text = String::from_utf8(output.stdout).ok()?;
    let text = text.trim();
    (output.status.success() && !text.is_empty()).then(|| text.to_owned())
}

/// The pid of a live daemon that holds `state_dir` (its `daemon.lock` names a process that is
/// still running and, when the lock records one, started at the recorded time). A lock left by a
/// daemon that died (a `kill -9`) names no live holder.
pub fn live_holder(state_dir: &Path) -> Option<u32> {
    let text = fs::read_to_string(state_dir.join("daemon.lock")).ok()?;
    let lock: serde_json::Value = serde_json::from_str(&text).ok()?;
    let pid = u32::try_from(lock.get("pid")?.as_u64()?).ok()?;
    if pid == std::process::id() {
        return None;
    }
    let raw = rustix::process::Pid::from_raw(i32::try_from(pid).ok()?)?;
    rustix::process::test_kill_process(raw).ok()?;
    match lock
        .get("processStartTime")
        .and_then(serde_json::Value::as_str)
    {
        Some(recorded) if process_start_time(pid).as_deref() != Some(recorded) => None,
        _ => Some(pid),
    }
}

/// The daemon files of a running fake; [`DaemonFiles::remove`] takes them away.
#[derive(Debug)]
pub struct DaemonFiles {
    info: PathBuf,
    lock: PathBuf,
}

fn write_private(path: &Path, text: &str) -> io::Result<()> {
    let partial = path.with_extension("json.tmp");
    let mut file = fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(&partial)?;
    file.write_all(text.as_bytes())?;
    file.sync_all()?;
    drop(file);
    fs::rename(&partial, path)
}

impl DaemonFiles {
    /// Writes `daemon.json` and `daemon.lock` into `state_dir` (created if missing).
    ///
    /// # Errors
    /// When the directory or a file cannot be written.
    pub fn write(state_dir: &Path, info: &DaemonInfo, started_at: u64) -> io::Result<Self> {
        fs::create_dir_all(state_dir)?;
        let files = Self {
            info: state_dir.join("daemon.json"),
            lock: state_dir.join("daemon.lock"),
        };
        let lock = LockInfo {
            pid: info.pid,
            version: VERSION,
            started_at,
            process_start_time: info.process_start_time.as_deref(),
        };
        write_private(&files.lock, &serde_json::to_string_pretty(&lock)?)?;
        write_private(&files.info, &serde_json::to_string_pretty(info)?)?;
        Ok(files)
    }

    /// The path of `daemon.json`.
    pub fn info_path(&self) -> &Path {
        &self.info
    }

    /// Removes both files (a file already gone is not an error).
    pub fn remove(&self) {
        for path in [&self.info, &self.lock] {
            if let Err(error) = fs::remove_file(path)
                && error.kind() != io::ErrorKind::NotFound
            {
                tracing::warn!(path = %path.display(), %error, "could not remove a daemon file");
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::PermissionsExt as _;

    use super::*;

    #[test]
    fn the_files_are_private_and_go_away() {
        let dir = tempfile::tempdir().unwrap();
        let info = DaemonInfo {
            http_port: 4242,
            transport: "http",
            token: "t".repeat(48),
            pid: std::process::id(),
            version: VERSION,
            code_origin: "installed",
            process_start_time: process_start_time(std::process::id()),
            state_dir: dir.path().display().to_string(),
        };
        let files = DaemonFiles::write(dir.path(), &info, 7).unwrap();
        let text = fs::read_to_string(files.info_path()).unwrap();
        let parsed: serde_json::Value = serde_json::from_str(&text).unwrap();
        assert_eq!(parsed["httpPort"], 4242);
        assert_eq!(parsed["transport"], "http");
        assert_eq!(parsed["version"], "0.21.5");
        assert_eq!(parsed["pid"], std::process::id());
        for name in ["daemon.json", "daemon.lock"] {
            let mode = fs::metadata(dir.path().join(name))
                .unwrap()
                .permissions()
                .mode();
            assert_eq!(mode & 0o777, 0o600, "{name}");
        }
        assert_eq!(
            live_holder(dir.path()),
            None,
            "the holder is this process itself"
        );
        files.remove();
        assert!(!dir.path().join("daemon.json").exists());
        assert!(!dir.path().join("daemon.lock").exists());
        files.remove();
    }

    #[test]
    fn a_lock_of_a_dead_process_has_no_live_holder() {
        let dir = tempfile::tempdir().unwrap();
        let mut child = Command::new("true").spawn().unwrap();
        let dead = child.id();
        child.wait().unwrap();
        fs::write(
            dir.path().join("daemon.lock"),
            format!(r#"{{"pid":{dead},"version":"0.21.5","startedAt":1}}"#),
        )
        .unwrap();
        assert_eq!(live_holder(dir.path()), None);
        assert_eq!(live_holder(&dir.path().join("missing")), None);
    }
}
