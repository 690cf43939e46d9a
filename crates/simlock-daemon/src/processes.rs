//! Keeping every process a worker starts findable by pid, across its own crash.
//!
//! Each process is written to a **ledger** (one file per pid in a directory of the worker's
//! home: `drivers/<platform>/processes/` for a driver's, `exec/processes/` for `device.exec`'s)
//! before anything waits on it, and forgotten only once it is known to have ended. A worker
//! killed with SIGKILL therefore leaves a ledger naming everything it had running: at the next
//! start each part stops what it does not adopt, by pid, after checking the pid still runs the
//! recorded program (a pid can be reused). Every such process leads a process group of its own,
//! so stopping it stops its children too.

use std::io;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use serde::{Deserialize, Serialize};

/// What a ledger entry is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Role {
    /// A tool call the driver waits on.
    Tool,
    /// A `device.exec` run (a tool an agent runs against its leased device).
    Exec,
    /// An emulator (a device: it may outlive the worker and be adopted).
    Emulator,
    /// The driver's own adb server.
    AdbServer,
}

/// A process a worker started.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Entry {
    /// Its pid (also its process group).
    pub pid: u32,
    /// The program, as it was started.
    pub program: String,
    /// Its arguments.
    pub args: Vec<String>,
    /// What it is.
    pub role: Role,
    /// The device it serves, if any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub device: Option<String>,
    /// The port it holds, if any (an emulator's console port, the adb server's port).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub port: Option<u16>,
    /// When it started, where that can be read ([`started_of`]): what tells it from a later
    /// process given the same pid, whatever its program became (a tool that `exec`s another).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub started: Option<Started>,
}

/// When a process started: the boot it started in, and the moment after that boot.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Started {
    /// The kernel's id of the boot (`/proc/sys/kernel/random/boot_id`).
    pub boot: String,
    /// Clock ticks after that boot (`/proc/<pid>/stat`, field 22).
    pub ticks: u64,
}

/// When `pid` started, where `/proc` tells it (Linux); `None` elsewhere, or when it is gone.
pub fn started_of(pid: u32) -> Option<Started> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // `pid (comm) state …`: the fields after the last `)` start at the third.
    let ticks = stat
        .rsplit_once(')')?
        .1
        .split_whitespace()
        .nth(22 - 3)?
        .parse()
        .ok()?;
    let boot = std::fs::read_to_string("/proc/sys/kernel/random/boot_id").ok()?;
    Some(Started {
        boot: boot.trim().to_owned(),
        ticks,
    })
}

/// The processes one part of a worker started (a driver, `device.exec`), on disk.
#[derive(Debug)]
pub struct Ledger {
    dir: PathBuf,
}

impl Ledger {
    /// The ledger in `dir` (created, mode 0700).
    ///
    /// # Errors
    /// When the directory cannot be made.
    pub fn open(dir: &Path) -> io::Result<Self> {
        make_private_dir(dir)?;
        Ok(Self {
            dir: dir.to_path_buf(),
        })
    }

    fn path(&self, pid: u32) -> PathBuf {
        self.dir.join(format!("{pid}.json"))
    }

    /// Records a started process.
    ///
    /// # Errors
    /// When the entry cannot be written.
    pub fn record(&self, entry: &Entry) -> io::Result<()> {
        let text = serde_json::to_vec(entry).map_err(io::Error::other)?;
        let tmp = self.dir.join(format!(".{}.tmp", entry.pid));
        std::fs::write(&tmp, text)?;
        std::fs::rename(&tmp, self.path(entry.pid))
    }

    /// Forgets a process that ended.
    pub fn forget(&self, pid: u32) {
        let _ = std::fs::remove_file(self.path(pid));
    }

    /// Every recorded process.
    pub fn entries(&self) -> Vec<Entry> {
        let Ok(dir) = std::fs::read_dir(&self.dir) else {
            return Vec::new();
        };
        let mut entries: Vec<Entry> = dir
            .filter_map(Result::ok)
            .filter(|e| e.file_name().to_string_lossy().ends_with(".json"))
            .filter_map(|e| std::fs::read(e.path()).ok())
            .filter_map(|bytes| serde_json::from_slice(&bytes).ok())
            .collect();
        entries.sort_by_key(|e| e.pid);
        entries
    }
}

/// Makes `dir` (and its parents), owner-only.
///
/// # Errors
/// When it cannot be made.
pub fn make_private_dir(dir: &Path) -> io::Result<()> {
    let context = |what: &str, e: io::Error| {
        io::Error::new(e.kind(), format!("{what} {}: {e}", dir.display()))
    };
    std::fs::create_dir_all(dir).map_err(|e| context("creating", e))?;
    use std::os::unix::fs::PermissionsExt as _;
    std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o700))
        .map_err(|e| context("securing", e))
}

/// Whether `pid` runs (and is not a zombie waiting to be reaped).
pub fn pid_alive(pid: u32) -> bool {
    if let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        return stat
            .rsplit_once(')')
            .and_then(|(_, rest)| rest.trim_start().chars().next())
            .is_some_and(|s| s != 'Z' && s != 'X');
    }
    if Path::new("/proc/self").exists() {
        return false;
    }
    to_pid(pid).is_some_and(|p| rustix::process::test_kill_process(p).is_ok())
}

fn to_pid(pid: u32) -> Option<rustix::process::Pid> {
    i32::try_from(pid)
        .ok()
        .and_then(rustix::process::Pid::from_raw)
}

/// The program `pid` runs, as it was started (its first argument).
fn program_of(pid: u32) -> Option<String> {
    if let Ok(cmdline) = std::fs::read(format!("/proc/{pid}/cmdline")) {
        return cmdline
            .split(|b| *b == 0)
            .next()
            .map(|a| String::from_utf8_lossy(a).into_owned());
    }
    // Where there is no /proc (macOS): ask ps.
    let out = std::process::Command::new("ps")
        .args(["-o", "command=", "-p", &pid.to_string()])
        .stderr(Stdio::null())
        .output()
        .ok()?;
    let text = String::from_utf8_lossy(&out.stdout).trim().to_owned();
    (!text.is_empty()).then_some(text)
}

/// Whether the recorded process still runs its program (not a reused pid).
pub fn still_runs(entry: &Entry) -> bool {
    if !pid_alive(entry.pid) {
        return false;
    }
    match (&entry.started, started_of(entry.pid)) {
        // The same start on the same boot: ours, whatever it runs now.
        (Some(recorded), Some(now)) => *recorded == now,
        // No start time to compare (an entry of an earlier version, or no /proc): its program.
        _ => program_of(entry.pid)
            .is_some_and(|p| p == entry.program || p.starts_with(&format!("{} ", entry.program))),
    }
}

/// Sends `signal` to `pid`'s process group (and to `pid`, should it have left the group).
pub fn signal(pid: u32, signal: rustix::process::Signal) {
    if let Some(p) = to_pid(pid) {
        let _ = rustix::process::kill_process_group(p, signal);
        let _ = rustix::process::kill_process(p, signal);
    }
}

/// Stops a process that is not our child (one an earlier run started): SIGTERM, then SIGKILL
/// once `grace` passed. The liveness checks are bounded polls: nothing else tells us when a
/// process we did not start has ended.
pub async fn stop_foreign(pid: u32, grace: Duration) {
    signal(pid, rustix::process::Signal::TERM);
    let deadline = tokio::time::Instant::now() + grace;
    while pid_alive(pid) && tokio::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    if pid_alive(pid) {
        signal(pid, rustix::process::Signal::KILL);
        let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
        while pid_alive(pid) && tokio::time::Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

/// Stops every process of `ledger` that `keep` does not claim, by pid, after checking each
/// still runs its recorded program; forgets the ones that are gone. Answers what it stopped.
pub async fn reap(ledger: &Ledger, keep: impl Fn(&Entry) -> bool) -> Vec<Entry> {
    let mut stopped = Vec::new();
    for entry in ledger.entries() {
        if !still_runs(&entry) {
            ledger.forget(entry.pid);
            continue;
        }
        if keep(&entry) {
            continue;
        }
        tracing::info!(pid = entry.pid, program = %entry.program, role = ?entry.role, "stopping a process an earlier run left");
        stop_foreign(entry.pid, Duration::from_secs(5)).await;
        ledger.forget(entry.pid);
        stopped.push(entry);
    }
    stopped
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(pid: u32, program: &str, started: Option<Started>) -> Entry {
        Entry {
            pid,
            program: program.into(),
            args: Vec::new(),
            role: Role::Exec,
            device: None,
            port: None,
            started,
        }
    }

    /// A process is known again by when it started, whatever it runs now: a tool that `exec`s
    /// another is still ours; a later process given the same pid is not, whatever its program
    /// (outside trial 12's review: argv[0] alone missed the first and would stop the second).
    #[test]
    fn a_process_is_known_by_its_start_whatever_it_runs_now() {
        let mut child = std::process::Command::new("sh")
            .args(["-c", "exec sleep 30"])
            .spawn()
            .unwrap();
        let pid = child.id();
        let Some(started) = started_of(pid) else {
            // No /proc here: only the program is compared.
            let _ = child.kill();
            let _ = child.wait();
            return;
        };
        assert!(still_runs(&entry(pid, "sh", Some(started.clone()))));
        let later = Started {
            ticks: started.ticks + 1,
            ..started.clone()
        };
        assert!(
            !still_runs(&entry(pid, "sh", Some(later))),
            "not the same start"
        );
        let other_boot = Started {
            boot: "another boot".into(),
            ..started
        };
        assert!(
            !still_runs(&entry(pid, "sh", Some(other_boot))),
            "not this boot"
        );
        // An entry with no start time (written by an earlier version): its program decides.
        let _ = child.kill();
        let _ = child.wait();
        assert!(!still_runs(&entry(pid, "sh", None)), "gone");
    }

    /// An entry written before `started` existed reads back without it.
    #[test]
    fn an_entry_without_a_start_time_reads_back() {
        let old = r#"{"pid":7,"program":"adb","args":[],"role":"adb-server","port":5038}"#;
        let entry: Entry = serde_json::from_str(old).unwrap();
        assert_eq!(entry.started, None);
        assert_eq!(entry.role, Role::AdbServer);
    }
}
