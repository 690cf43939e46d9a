//! Keeping every process a worker starts findable by pid, across its own crash.
//!
//! Each process is written to a **ledger** (one file per pid in a directory of the worker's
//! home: `drivers/<platform>/processes/` for a driver's, `exec/processes/` for `device.exec`'s)
//! before anything waits on it, and forgotten only once it is known to have ended. A worker
//! killed with SIGKILL therefore leaves a ledger naming everything it had running: at the next
//! start each part stops what it does not adopt, by pid, after checking the pid still runs the
//! recorded program (a pid can be reused). Every such process leads a process group of its own,
//! so stopping it stops its children too.
//!
//! A pid exists only once the process does, so a worker killed between starting a process and
//! recording its pid would leave it unknown. Each process is therefore **expected** first
//! ([`Ledger::expect`]): what it will be is written before it starts, with a tag that the
//! process carries in its environment ([`PROCESS_TAG_ENV`]). The next [`Ledger::open`] finds an
//! expected process that was never recorded by that tag and records it by pid (ADR 0035).

use std::io;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::OnceLock;
use std::sync::atomic::{AtomicU64, Ordering};
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

/// The environment variable that carries an expected process's tag ([`Ledger::expect`]).
pub const PROCESS_TAG_ENV: &str = "SIMLOCK_PROCESS_TAG";

/// The name of an expected process's file: `expected-<tag>.json`.
const EXPECTED_PREFIX: &str = "expected-";

/// The processes one part of a worker started (a driver, `device.exec`), on disk.
#[derive(Debug)]
pub struct Ledger {
    dir: PathBuf,
}

impl Ledger {
    /// The ledger in `dir` (created, mode 0700). Every process an earlier run expected and
    /// never recorded (it was killed in between) is looked for by its tag, recorded by pid if
    /// it runs, and no longer expected.
    ///
    /// # Errors
    /// When the directory cannot be made.
    pub fn open(dir: &Path) -> io::Result<Self> {
        Self::open_in_run(dir, Some(&run_prefix()))
    }

    /// [`Self::open`] for a run whose tags start with `this_run` (`None`: as a new process,
    /// for which every expected file is an earlier run's).
    fn open_in_run(dir: &Path, this_run: Option<&str>) -> io::Result<Self> {
        make_private_dir(dir)?;
        let ledger = Self {
            dir: dir.to_path_buf(),
        };
        ledger.find_expected(this_run);
        Ok(ledger)
    }

    fn path(&self, pid: u32) -> PathBuf {
        self.dir.join(format!("{pid}.json"))
    }

    /// Records a started process.
    ///
    /// # Errors
    /// When the entry cannot be written.
    pub fn record(&self, entry: &Entry) -> io::Result<()> {
        self.write(&entry.pid.to_string(), entry)
    }

    /// Writes `value` as `<name>.json`, whole or not at all (through `.<name>.tmp`).
    fn write(&self, name: &str, value: &impl Serialize) -> io::Result<()> {
        let text = serde_json::to_vec(value).map_err(io::Error::other)?;
        let tmp = self.dir.join(format!(".{name}.tmp"));
        std::fs::write(&tmp, text)?;
        std::fs::rename(&tmp, self.dir.join(format!("{name}.json")))
    }

    /// The `.json` files of the ledger whose names `keep` takes.
    fn files(&self, keep: impl Fn(&str) -> bool) -> Vec<PathBuf> {
        let Ok(dir) = std::fs::read_dir(&self.dir) else {
            return Vec::new();
        };
        dir.filter_map(Result::ok)
            .filter(|e| {
                let name = e.file_name();
                let name = name.to_string_lossy();
                name.ends_with(".json") && keep(&name)
            })
            .map(|e| e.path())
            .collect()
    }

    /// Writes what a process about to start will be (`entry`; its `pid` and `started` are not
    /// known yet and are ignored) before it starts. Give the process [`Expected::env`]; once it started,
    /// [`Expected::started`] records it by pid. Dropped unrecorded (the start failed), it is no
    /// longer expected.
    ///
    /// # Errors
    /// When it cannot be written: the process must not start then.
    pub fn expect(&self, entry: &Entry) -> io::Result<Expected<'_>> {
        let tag = next_tag();
        let name = format!("{EXPECTED_PREFIX}{tag}");
        let written = ExpectedFile {
            tag: tag.clone(),
            entry: entry.clone(),
        };
        self.write(&name, &written)?;
        let file = self.dir.join(format!("{name}.json"));
        Ok(Expected {
            ledger: self,
            file: Some(file),
            tag,
            entry: entry.clone(),
        })
    }

    /// Forgets a process that ended.
    pub fn forget(&self, pid: u32) {
        let _ = std::fs::remove_file(self.path(pid));
    }

    /// Every recorded process.
    pub fn entries(&self) -> Vec<Entry> {
        let mut entries: Vec<Entry> = self
            .files(|name| !name.starts_with(EXPECTED_PREFIX))
            .into_iter()
            .filter_map(|path| std::fs::read(path).ok())
            .filter_map(|bytes| serde_json::from_slice(&bytes).ok())
            .collect();
        entries.sort_by_key(|e| e.pid);
        entries
    }

    /// Records, by pid, every process an earlier run expected and did not record: each group
    /// leader whose environment carries the expected tag (a process the expected one started
    /// in its own group goes with that group). An expected file is then removed, found or not.
    fn find_expected(&self, this_run: Option<&str>) {
        let mut earlier = Vec::new();
        for file in self.files(|name| name.starts_with(EXPECTED_PREFIX)) {
            let expected = std::fs::read(&file)
                .ok()
                .and_then(|bytes| serde_json::from_slice::<ExpectedFile>(&bytes).ok());
            match expected {
                None => {
                    let _ = std::fs::remove_file(&file);
                }
                // One of this run's, still starting: not an earlier run's to take.
                Some(expected)
                    if this_run.is_some_and(|prefix| expected.tag.starts_with(prefix)) => {}
                Some(expected) => earlier.push((file, expected)),
            }
        }
        // The scan of every process's environment only when an earlier run left one.
        if earlier.is_empty() {
            return;
        }
        let running = tagged_group_leaders();
        for (file, expected) in earlier {
            let mut found: Vec<(u32, Option<Started>)> = running
                .iter()
                .filter(|(_, tag)| *tag == expected.tag)
                .map(|&(pid, _)| (pid, started_of(pid)))
                .collect();
            // The expected process is the one that started first; another leader with its tag
            // is a descendant that left its group (a daemon it forked): a tool, to be stopped,
            // never a device to adopt.
            // One whose start cannot be read (gone since the scan) sorts last, never first.
            found.sort_by_key(|(pid, started)| {
                (started.is_none(), started.as_ref().map(|s| s.ticks), *pid)
            });
            for (index, (pid, started)) in found.into_iter().enumerate() {
                let entry = if index == 0 {
                    Entry {
                        pid,
                        started,
                        ..expected.entry.clone()
                    }
                } else {
                    Entry {
                        pid,
                        program: program_of(pid).unwrap_or_default(),
                        args: Vec::new(),
                        role: Role::Tool,
                        device: None,
                        port: None,
                        started,
                    }
                };
                tracing::info!(pid, program = %entry.program, role = ?entry.role, "found a process an earlier run started and did not record");
                if let Err(e) = self.record(&entry) {
                    tracing::warn!(pid, error = %e, "could not record a process found again");
                }
            }
            let _ = std::fs::remove_file(&file);
        }
    }
}

/// A process written to its ledger before it starts ([`Ledger::expect`]).
#[derive(Debug)]
pub struct Expected<'a> {
    ledger: &'a Ledger,
    /// Removed when this is dropped, unless taken out first.
    file: Option<PathBuf>,
    tag: String,
    entry: Entry,
}

impl Expected<'_> {
    /// The environment variable to give the process: what finds it again.
    pub fn env(&self) -> (&'static str, &str) {
        (PROCESS_TAG_ENV, &self.tag)
    }

    /// Records the started process by its pid (and its start time), and answers the entry.
    ///
    /// # Errors
    /// When the entry cannot be written: the caller stops the process then. The expected file
    /// stays, so that a worker killed before it could finds the process again.
    pub fn started(mut self, pid: u32) -> io::Result<Entry> {
        let entry = Entry {
            pid,
            started: started_of(pid),
            ..self.entry.clone()
        };
        if let Err(e) = self.ledger.record(&entry) {
            self.file = None;
            return Err(e);
        }
        Ok(entry)
    }
}

impl Drop for Expected<'_> {
    fn drop(&mut self) {
        if let Some(file) = self.file.take() {
            let _ = std::fs::remove_file(file);
        }
    }
}

/// What an expected file holds.
#[derive(Debug, Serialize, Deserialize)]
struct ExpectedFile {
    tag: String,
    entry: Entry,
}

/// What every tag of this run starts with: 64 random bits, drawn once per process (a tool
/// that reads its own tag cannot guess an earlier run's, nor forge one of this run's that a
/// later open would take).
fn run_prefix() -> String {
    static RUN: OnceLock<String> = OnceLock::new();
    RUN.get_or_init(|| format!("{:016x}-", rand::random::<u64>()))
        .clone()
}

/// A tag no other process of this machine carries: this run's prefix, 64 more random bits, and
/// a count.
fn next_tag() -> String {
    static COUNT: AtomicU64 = AtomicU64::new(0);
    format!(
        "{}{:016x}-{}",
        run_prefix(),
        rand::random::<u64>(),
        COUNT.fetch_add(1, Ordering::Relaxed)
    )
}

/// Every process group leader that carries a tag, with its tag: from `/proc` (Linux), else
/// from `ps` (macOS prints the environment of the user's own processes with `-E`).
fn tagged_group_leaders() -> Vec<(u32, String)> {
    let needle = format!("{PROCESS_TAG_ENV}=");
    if let Ok(dir) = std::fs::read_dir("/proc") {
        return dir
            .filter_map(Result::ok)
            .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
            .filter(|&pid| group_of(pid) == Some(pid))
            .filter_map(|pid| {
                let environ = std::fs::read(format!("/proc/{pid}/environ")).ok()?;
                let tag = environ
                    .split(|b| *b == 0)
                    .find_map(|var| var.strip_prefix(needle.as_bytes()))?;
                Some((pid, String::from_utf8_lossy(tag).into_owned()))
            })
            .collect();
    }
    let mut ps = std::process::Command::new("ps");
    ps.args(["-axwwE", "-o", "pid=,pgid=,command="]);
    let Some(out) = bounded_output(ps) else {
        return Vec::new();
    };
    String::from_utf8_lossy(&out)
        .lines()
        .filter_map(|line| {
            let mut fields = line.split_whitespace();
            let pid: u32 = fields.next()?.parse().ok()?;
            let pgid: u32 = fields.next()?.parse().ok()?;
            let tag = fields.find_map(|f| f.strip_prefix(needle.as_str()))?;
            (pid == pgid).then(|| (pid, tag.to_owned()))
        })
        .collect()
}

/// The process group of `pid`, from `/proc/<pid>/stat` (its fifth field).
fn group_of(pid: u32) -> Option<u32> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    stat.rsplit_once(')')?
        .1
        .split_whitespace()
        .nth(5 - 3)?
        .parse()
        .ok()
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
    let mut ps = std::process::Command::new("ps");
    ps.args(["-o", "command=", "-p", &pid.to_string()]);
    let out = bounded_output(ps)?;
    let text = String::from_utf8_lossy(&out).trim().to_owned();
    (!text.is_empty()).then_some(text)
}

/// How long a `ps` may take before it is given up on (and killed).
const PS_BOUND: Duration = Duration::from_secs(5);

/// What `command` printed, or `None` when it could not run or took longer than [`PS_BOUND`]
/// (it is killed then): every wait on another process is bounded.
fn bounded_output(command: std::process::Command) -> Option<Vec<u8>> {
    output_within(command, PS_BOUND)
}

/// What `command` printed, or `None` when it could not run or took longer than `bound`.
fn output_within(mut command: std::process::Command, bound: Duration) -> Option<Vec<u8>> {
    let child = command
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .ok()?;
    let pid = child.id();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(child.wait_with_output());
    });
    match rx.recv_timeout(bound) {
        Ok(Ok(out)) => Some(out.stdout),
        Ok(Err(_)) => None,
        Err(_) => {
            if let Some(p) = to_pid(pid) {
                let _ = rustix::process::kill_process(p, rustix::process::Signal::KILL);
            }
            None
        }
    }
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
    use std::os::unix::process::CommandExt as _;

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

    fn expected_files(dir: &Path) -> Vec<String> {
        std::fs::read_dir(dir)
            .unwrap()
            .filter_map(Result::ok)
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .filter(|n| n.contains(EXPECTED_PREFIX))
            .collect()
    }

    /// A worker killed after starting a process and before recording its pid (here: the
    /// `Expected` never dropped nor recorded) leaves it expected; the next open finds it by its
    /// tag, records it by pid with what was expected, and a reap stops its whole group.
    #[tokio::test]
    async fn a_process_started_and_never_recorded_is_found_again_by_its_tag() {
        let dir = tempfile::tempdir().unwrap();
        let ledger = Ledger::open(dir.path()).unwrap();
        let expected = ledger
            .expect(&Entry {
                device: Some("avd".into()),
                port: Some(5554),
                ..entry(0, "sh", None)
            })
            .unwrap();
        let (key, tag) = expected.env();
        // A leader and a child of its group, both carrying the tag.
        let mut leader = std::process::Command::new("sh")
            .args(["-c", "sleep 30 & wait"])
            .env(key, tag)
            .process_group(0)
            .spawn()
            .unwrap();
        let pid = leader.id();
        // What SIGKILL leaves: no drop, no record.
        std::mem::forget(expected);
        assert!(ledger.entries().is_empty());
        assert_eq!(expected_files(dir.path()).len(), 1);

        let again = Ledger::open_in_run(dir.path(), None).unwrap();
        let entries = again.entries();
        assert_eq!(entries.len(), 1, "the leader alone: {entries:?}");
        assert_eq!(entries[0].pid, pid);
        assert_eq!(entries[0].role, Role::Exec);
        assert_eq!(entries[0].device.as_deref(), Some("avd"));
        assert_eq!(entries[0].port, Some(5554));
        assert_eq!(entries[0].started, started_of(pid));
        assert!(expected_files(dir.path()).is_empty(), "no longer expected");
        assert!(still_runs(&entries[0]));

        let stopped = reap(&again, |_| false).await;
        assert_eq!(stopped.len(), 1);
        let _ = leader.wait();
        assert!(again.entries().is_empty());
    }

    /// An expected process that never started (or ended before the next open) is only no
    /// longer expected; one that started is recorded by pid and no longer expected; one whose
    /// start failed (dropped) too.
    #[test]
    fn an_expected_process_is_recorded_once_started_and_dropped_otherwise() {
        let dir = tempfile::tempdir().unwrap();
        let ledger = Ledger::open(dir.path()).unwrap();
        std::mem::forget(ledger.expect(&entry(0, "never-ran", None)).unwrap());
        let again = Ledger::open_in_run(dir.path(), None).unwrap();
        assert!(again.entries().is_empty());
        assert!(expected_files(dir.path()).is_empty());

        drop(again.expect(&entry(0, "failed-to-start", None)).unwrap());
        assert!(expected_files(dir.path()).is_empty());

        let expected = again.expect(&entry(0, "tool", None)).unwrap();
        let recorded = expected.started(std::process::id()).unwrap();
        assert_eq!(recorded.pid, std::process::id());
        assert_eq!(recorded.started, started_of(std::process::id()));
        assert_eq!(again.entries(), vec![recorded]);
        assert!(expected_files(dir.path()).is_empty());
    }

    /// An open in the same run leaves this run's expected files alone (their processes are
    /// still starting); two leaders carrying one tag: the first started is the expected
    /// process, the other (a descendant that left its group) only a tool to stop.
    #[tokio::test]
    async fn an_expected_file_is_an_earlier_runs_only_and_goes_to_the_first_leader() {
        let dir = tempfile::tempdir().unwrap();
        let ledger = Ledger::open(dir.path()).unwrap();
        let expected = ledger
            .expect(&Entry {
                device: Some("avd".into()),
                role: Role::Emulator,
                ..entry(0, "sleep", None)
            })
            .unwrap();
        let (key, tag) = expected.env();
        let spawn = || {
            std::process::Command::new("sleep")
                .arg("30")
                .env(key, tag)
                .process_group(0)
                .spawn()
                .unwrap()
        };
        let mut first = spawn();
        // The second starts at least one clock tick later.
        let started = started_of(first.id());
        // Bounded: a clock tick is 10 ms, and each try spawns a process.
        let mut second = (0..10_000)
            .find_map(|_| {
                let mut candidate = spawn();
                if started.is_none() || started_of(candidate.id()) != started {
                    return Some(candidate);
                }
                let _ = candidate.kill();
                let _ = candidate.wait();
                None
            })
            .expect("a process started a clock tick after the first");
        let same_run = Ledger::open(dir.path()).unwrap();
        assert!(same_run.entries().is_empty());
        assert_eq!(expected_files(dir.path()).len(), 1, "left to this run");
        std::mem::forget(expected);

        let next_run = Ledger::open_in_run(dir.path(), None).unwrap();
        let entries = next_run.entries();
        let of = |pid: u32| entries.iter().find(|e| e.pid == pid).unwrap();
        assert_eq!(entries.len(), 2, "{entries:?}");
        assert_eq!(of(first.id()).role, Role::Emulator);
        assert_eq!(of(first.id()).device.as_deref(), Some("avd"));
        assert_eq!(of(second.id()).role, Role::Tool);
        assert_eq!(of(second.id()).device, None);
        assert_eq!(reap(&next_run, |_| false).await.len(), 2);
        let _ = first.wait();
        let _ = second.wait();
    }

    /// A pid that cannot be recorded is an error, and the process stays expected: a worker
    /// killed before it stopped that process finds it again.
    #[test]
    fn a_start_that_cannot_be_recorded_stays_expected() {
        let dir = tempfile::tempdir().unwrap();
        let ledger = Ledger::open(dir.path()).unwrap();
        // A directory where the entry's file would go: the rename onto it fails.
        std::fs::create_dir(dir.path().join("4000000.json")).unwrap();
        let expected = ledger.expect(&entry(0, "tool", None)).unwrap();
        assert!(expected.started(4_000_000).is_err());
        assert_eq!(expected_files(dir.path()).len(), 1);
    }

    /// `ps` (where there is no `/proc`) is waited for within a bound, and killed past it.
    #[test]
    fn a_helper_command_is_read_within_its_bound_and_given_up_on_past_it() {
        let mut echo = std::process::Command::new("sh");
        echo.args(["-c", "echo hi"]);
        assert_eq!(
            output_within(echo, Duration::from_secs(30)).as_deref(),
            Some(&b"hi\n"[..])
        );
        let missing = std::process::Command::new("/nonexistent/ps");
        assert_eq!(output_within(missing, Duration::from_secs(30)), None);
        let mut slow = std::process::Command::new("sleep");
        slow.arg("30");
        assert_eq!(output_within(slow, Duration::from_millis(50)), None);
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
