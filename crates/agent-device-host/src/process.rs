//! The agent-device daemon as a process: start it (HTTP mode, state under simlock's home), read
//! its port from its stdout line and its token from `daemon.json`, and stop it by pid.
//!
//! The daemon does not stop with its parent, so it is started under a watch ([`WATCH`], a few
//! lines of `sh`) that holds the read end of a pipe whose write end only the worker holds: when
//! the worker goes, however it goes (`kill -9` included), the pipe closes and the watch sends
//! the daemon SIGTERM; when the daemon exits, so does the watch, with its status. Every process
//! the host starts is also written to `simlock-host.json` in the state directory with its start
//! time (which tells a live process from a reused pid) before anything else happens, and the
//! next start stops whatever that file names (a daemon that ignored the watch's SIGTERM). The
//! watch leads a process group of its own, the daemon in it, and the host stops the group:
//! SIGTERM, then SIGKILL after a grace.

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use rustix::process::{Pid, PidfdFlags, Signal};
use serde::{Deserialize, Serialize};
use tokio::io::{AsyncBufReadExt, AsyncRead, BufReader};
use tokio::process::{Child, Command};
use tracing::{debug, info, warn};

/// The stdout line that names the daemon's HTTP port.
pub const PORT_LINE: &str = "AGENT_DEVICE_DAEMON_HTTP_PORT=";
/// The file simlock keeps the daemon's processes in.
pub const PID_FILE: &str = "simlock-host.json";

/// The watch the daemon runs under (`sh -c WATCH agent-device-watch <command>…`): it starts the
/// command with its stdin closed, then waits for either end. The host's pipe on the watch's
/// stdin (fd 3 here, since an asynchronous list's stdin is `/dev/null`) reads end-of-file only
/// once every holder of its write end is gone: the worker, stopped or killed; the watch then
/// sends the daemon SIGTERM. When the daemon exits first, the watch stops its reader and exits
/// with the daemon's status.
pub const WATCH: &str = r#"exec 3<&0
"$@" <&- 3<&- &
daemon=$!
{ read -r _ <&3; kill -TERM "$daemon"; } 2>/dev/null &
reader=$!
exec 3<&-
wait "$daemon"
status=$?
kill "$reader" 2>/dev/null
exit "$status""#;

/// How to start a daemon.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DaemonSpec {
    /// The argv (`agentDevice.command`).
    pub command: Vec<String>,
    /// Its state directory (`$SIMLOCK_HOME/agent-device`).
    pub state_dir: PathBuf,
    /// More environment for it (tests give the fake's knobs, an isolated `HOME`).
    pub env: Vec<(String, String)>,
}

/// Where a running daemon answers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Endpoint {
    /// Its HTTP port on 127.0.0.1.
    pub port: u16,
    /// Its token (fresh on every start).
    pub token: String,
}

/// A daemon this host started.
#[derive(Debug)]
pub struct Daemon {
    /// The process the host spawned: the daemon's [`WATCH`].
    pub child: Child,
    /// The write end of the watch's pipe, held while the daemon should run: dropped (or the
    /// worker gone), the watch stops the daemon.
    pub lifeline: Option<tokio::process::ChildStdin>,
    /// Where it answers.
    pub endpoint: Endpoint,
    /// Its processes as recorded in the pid file.
    pub recorded: Vec<Recorded>,
}

/// Why a daemon could not be started.
#[derive(Debug, thiserror::Error)]
pub enum ProcessError {
    /// The state directory.
    #[error("cannot use the agent-device state directory {path}: {source}")]
    StateDir {
        /// The directory.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// The program could not be started.
    #[error("cannot start agentDevice.command {program:?}: {source}")]
    Spawn {
        /// The program.
        program: String,
        /// Why.
        source: std::io::Error,
    },
    /// It exited before it served.
    #[error("the agent-device daemon exited before it served ({0})")]
    Exited(String),
    /// It did not say where it serves in time.
    #[error("the agent-device daemon did not report its port within {0:?}")]
    Timeout(Duration),
    /// Its `daemon.json` could not be read.
    #[error("the agent-device daemon's daemon.json: {0}")]
    Metadata(String),
}

/// One process in the pid file: a pid and its start time, in clock ticks since boot.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Recorded {
    /// The pid.
    pub pid: i32,
    /// Its start time (`/proc/<pid>/stat` field 22).
    pub start: u64,
}

#[derive(Debug, Default, Serialize, Deserialize)]
struct PidFile {
    processes: Vec<Recorded>,
}

#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
struct DaemonJson {
    token: String,
    #[serde(default)]
    pid: Option<i32>,
    #[serde(default)]
    http_port: Option<u16>,
}

/// Starts the daemon and waits (at most `timeout`) until it said where it serves.
///
/// # Errors
/// [`ProcessError`]; a process that was started is stopped again before the error returns.
pub async fn spawn(
    spec: &DaemonSpec,
    timeout: Duration,
    grace: Duration,
) -> Result<Daemon, ProcessError> {
    let state = &spec.state_dir;
    ensure_dir(state).map_err(|source| ProcessError::StateDir {
        path: state.clone(),
        source,
    })?;
    // A stale file from a daemon that died would hand out its token.
    let _ = std::fs::remove_file(state.join("daemon.json"));
    // The daemon's temporary files (uploads in progress and finalized ones, hundreds of MiB
    // each) live under simlock's home, and whatever an earlier daemon left there goes now.
    let tmp = temp_dir(state);
    clear_temp(state);
    ensure_dir(&tmp).map_err(|source| ProcessError::StateDir {
        path: tmp.clone(),
        source,
    })?;
    let Some((program, args)) = spec.command.split_first() else {
        return Err(ProcessError::Spawn {
            program: String::new(),
            source: std::io::Error::new(std::io::ErrorKind::InvalidInput, "empty command"),
        });
    };
    // The watch would start a missing program as happily as any: it is found here first, so
    // that the error names it as a failed start would.
    let found = which::which(program).map_err(|e| ProcessError::Spawn {
        program: program.clone(),
        source: std::io::Error::new(std::io::ErrorKind::NotFound, e),
    })?;
    let mut command = Command::new("/bin/sh");
    command
        .arg("-c")
        .arg(WATCH)
        .arg("agent-device-watch")
        .arg(found)
        .args(args)
        .env("AGENT_DEVICE_STATE_DIR", state)
        .env("AGENT_DEVICE_DAEMON_SERVER_MODE", "http")
        // The daemon otherwise exits after five idle minutes; simlock decides when it stops.
        .env("AGENT_DEVICE_DAEMON_IDLE_TIMEOUT_MS", "0")
        .env("AGENT_DEVICE_NO_UPDATE_NOTIFIER", "1")
        // Device claims are host-global by default; this daemon's devices are simlock's.
        .env("AGENT_DEVICE_CLAIMS_DIR", state.join("device-claims"))
        .env("TMPDIR", &tmp)
        .envs(spec.env.iter().map(|(k, v)| (k, v)))
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .process_group(0)
        .kill_on_drop(false);
    let mut child = command.spawn().map_err(|source| ProcessError::Spawn {
        program: program.clone(),
        source,
    })?;
    let lifeline = child.stdin.take();
    let mut recorded = Vec::new();
    if let Some(pid) = child.id().and_then(|p| i32::try_from(p).ok()) {
        if let Some(start) = start_time(pid) {
            recorded.push(Recorded { pid, start });
        }
        write_pid_file(state, &recorded);
    }
    let outcome = tokio::time::timeout(timeout, async {
        let port = read_port(&mut child).await?;
        let meta = read_daemon_json(state, &mut child).await?;
        Ok::<_, ProcessError>((port, meta))
    })
    .await;
    let (port, meta) = match outcome {
        Ok(Ok(found)) => found,
        Ok(Err(e)) => {
            stop(&recorded, Some(&mut child), grace).await;
            clear_pid_file(state);
            return Err(e);
        }
        Err(_) => {
            stop(&recorded, Some(&mut child), grace).await;
            clear_pid_file(state);
            return Err(ProcessError::Timeout(timeout));
        }
    };
    // A wrapper (a shell, npx) may have started the daemon as another process.
    if let Some(pid) = meta.pid
        && !recorded.iter().any(|r| r.pid == pid)
        && let Some(start) = start_time(pid)
    {
        recorded.push(Recorded { pid, start });
        write_pid_file(state, &recorded);
    }
    if let Some(stderr) = child.stderr.take() {
        tokio::spawn(drain(stderr, "stderr"));
    }
    let port = meta.http_port.unwrap_or(port);
    info!(port, pids = ?recorded.iter().map(|r| r.pid).collect::<Vec<_>>(), "agent-device daemon serving");
    Ok(Daemon {
        child,
        lifeline,
        endpoint: Endpoint {
            port,
            token: meta.token,
        },
        recorded,
    })
}

async fn read_port(child: &mut Child) -> Result<u16, ProcessError> {
    let Some(stdout) = child.stdout.take() else {
        return Err(ProcessError::Exited("no stdout".into()));
    };
    let mut lines = BufReader::new(stdout).lines();
    // What it printed first, for a process that exits without a word on stderr (agent-device's
    // CLI, started in the daemon's place, prints its usage and exits 1).
    let mut first_words: Option<String> = None;
    loop {
        match lines.next_line().await {
            Ok(Some(line)) => {
                if first_words.is_none() && !line.trim().is_empty() {
                    first_words = Some(line.trim().chars().take(MAX_QUOTED).collect());
                }
                if let Some(port) = line.trim().strip_prefix(PORT_LINE) {
                    let port = port
                        .trim()
                        .parse::<u16>()
                        .ok()
                        .filter(|p| *p != 0)
                        .ok_or_else(|| {
                            ProcessError::Exited(format!("it printed a bad port line: {line}"))
                        })?;
                    // The rest of stdout goes to the log, and keeps the pipe from filling.
                    tokio::spawn(async move {
                        while let Ok(Some(line)) = lines.next_line().await {
                            debug!(target: "agent_device_daemon", stream = "stdout", "{line}");
                        }
                    });
                    return Ok(port);
                }
                debug!(target: "agent_device_daemon", stream = "stdout", "{line}");
            }
            Ok(None) | Err(_) => {
                let status = child
                    .wait()
                    .await
                    .map_or_else(|e| e.to_string(), |s| s.to_string());
                return Err(ProcessError::Exited(
                    match (last_words(child).await, first_words) {
                        (Some(said), _) => format!("{status}: {said}"),
                        (None, Some(printed)) if is_cli_usage(&printed) => format!(
                            "{status}; it printed {printed:?} and nothing on stderr: agentDevice.command must start agent-device's daemon (<agent-device>/dist/src/internal/daemon.js), not its CLI"
                        ),
                        (None, Some(printed)) => {
                            format!("{status}; it printed {printed:?} and nothing on stderr")
                        }
                        (None, None) => status,
                    },
                ));
            }
        }
    }
}

/// The most characters of a daemon's output an error quotes.
const MAX_QUOTED: usize = 200;

/// Whether a first line of output is agent-device's CLI usage (`agent-device <command> [args]
/// [--json]`): the CLI started in the daemon's place.
fn is_cli_usage(line: &str) -> bool {
    line.starts_with("agent-device <command>")
}

/// The last line a process that exited wrote on its stderr (`sh: 1: node: not found`), read
/// for at most a second and 64 KiB: what says why it exited.
async fn last_words(child: &mut Child) -> Option<String> {
    use tokio::io::AsyncReadExt as _;
    let stderr = child.stderr.take()?;
    let mut said = Vec::new();
    let mut bounded = stderr.take(64 * 1024);
    let _ = tokio::time::timeout(Duration::from_secs(1), bounded.read_to_end(&mut said)).await;
    String::from_utf8_lossy(&said)
        .lines()
        .map(str::trim)
        .rfind(|line| !line.is_empty())
        .map(str::to_owned)
}

async fn read_daemon_json(state: &Path, child: &mut Child) -> Result<DaemonJson, ProcessError> {
    let path = state.join("daemon.json");
    // The daemon writes the file around the time it prints its port; look again until it is
    // whole (the caller bounds the wait).
    loop {
        let last;
        match std::fs::read_to_string(&path) {
            Ok(text) => match serde_json::from_str::<DaemonJson>(&text) {
                Ok(meta) if !meta.token.is_empty() => return Ok(meta),
                Ok(_) => last = "it holds no token".into(),
                Err(e) => last = e.to_string(),
            },
            Err(e) => last = e.to_string(),
        }
        if let Ok(Some(status)) = child.try_wait() {
            return Err(ProcessError::Metadata(format!(
                "{last}; the daemon exited ({status})"
            )));
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

async fn drain(stream: impl AsyncRead + Unpin, name: &'static str) {
    let mut lines = BufReader::new(stream).lines();
    while let Ok(Some(line)) = lines.next_line().await {
        debug!(target: "agent_device_daemon", stream = name, "{line}");
    }
}

/// Stops the recorded processes: SIGTERM to each one's process group, then SIGKILL to what is
/// left after `grace`. `child`, when given, is reaped.
pub async fn stop(recorded: &[Recorded], child: Option<&mut Child>, grace: Duration) {
    let live: Vec<Recorded> = recorded.iter().copied().filter(is_alive).collect();
    for r in &live {
        signal_group(r.pid, Signal::TERM);
    }
    let waited = tokio::time::timeout(grace, wait_all(&live)).await;
    if waited.is_err() {
        for r in live.iter().filter(|r| is_alive(r)) {
            warn!(
                pid = r.pid,
                "the agent-device daemon did not stop on SIGTERM; killing it"
            );
            signal_group(r.pid, Signal::KILL);
        }
        let _ = tokio::time::timeout(grace, wait_all(&live)).await;
    }
    if let Some(child) = child {
        let _ = tokio::time::timeout(grace, child.wait()).await;
    }
}

/// Stops whatever an earlier run of the host left behind in `state` (after a `kill -9` of the
/// worker), then forgets it.
pub async fn stop_leftovers(state: &Path, grace: Duration) {
    let Some(file) = read_pid_file(state) else {
        return;
    };
    let live: Vec<Recorded> = file.processes.into_iter().filter(is_alive).collect();
    if !live.is_empty() {
        info!(pids = ?live.iter().map(|r| r.pid).collect::<Vec<_>>(), "stopping the agent-device daemon an earlier run left behind");
        stop(&live, None, grace).await;
    }
    clear_pid_file(state);
}

/// Forgets the processes recorded in `state`, and removes what they left in their temporary
/// directory.
pub fn clear_pid_file(state: &Path) {
    let _ = std::fs::remove_file(state.join(PID_FILE));
    clear_temp(state);
}

/// The daemon's temporary directory (its `TMPDIR`).
pub fn temp_dir(state: &Path) -> PathBuf {
    state.join("tmp")
}

fn clear_temp(state: &Path) {
    let tmp = temp_dir(state);
    if let Err(e) = std::fs::remove_dir_all(&tmp)
        && e.kind() != std::io::ErrorKind::NotFound
    {
        warn!(path = %tmp.display(), error = %e, "cannot remove the agent-device daemon's temporary files");
    }
}

fn write_pid_file(state: &Path, recorded: &[Recorded]) {
    let file = PidFile {
        processes: recorded.to_vec(),
    };
    let path = state.join(PID_FILE);
    let tmp = state.join(format!("{PID_FILE}.tmp"));
    let written = serde_json::to_vec(&file)
        .map_err(std::io::Error::other)
        .and_then(|bytes| std::fs::write(&tmp, bytes))
        .and_then(|()| std::fs::rename(&tmp, &path));
    if let Err(e) = written {
        warn!(path = %path.display(), error = %e, "cannot record the agent-device daemon's pid");
    }
}

fn read_pid_file(state: &Path) -> Option<PidFile> {
    let text = std::fs::read_to_string(state.join(PID_FILE)).ok()?;
    serde_json::from_str(&text).ok()
}

fn ensure_dir(dir: &Path) -> std::io::Result<()> {
    use std::os::unix::fs::PermissionsExt as _;
    std::fs::create_dir_all(dir)?;
    std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o700))
}

/// A process's start time in clock ticks since boot, `None` when there is no such process.
pub fn start_time(pid: i32) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name (field 2) is in parentheses and may hold anything; the fields after
    // its closing parenthesis start at field 3, so the start time (22) is the 20th of them.
    let rest = &stat[stat.rfind(')')? + 1..];
    rest.split_whitespace().nth(19)?.parse().ok()
}

/// Whether the recorded process still runs (and is the same process, not a reused pid). A
/// zombie counts as gone.
pub fn is_alive(r: &Recorded) -> bool {
    let Ok(stat) = std::fs::read_to_string(format!("/proc/{}/stat", r.pid)) else {
        return false;
    };
    let Some(close) = stat.rfind(')') else {
        return false;
    };
    let mut fields = stat[close + 1..].split_whitespace();
    let state = fields.next();
    let start = fields.nth(18).and_then(|s| s.parse::<u64>().ok());
    state != Some("Z") && start == Some(r.start)
}

fn signal_group(pid: i32, signal: Signal) {
    let Some(pid) = Pid::from_raw(pid) else {
        return;
    };
    // The daemon leads its own group; a process that is not a group leader gets the signal
    // itself.
    if rustix::process::kill_process_group(pid, signal).is_err() {
        let _ = rustix::process::kill_process(pid, signal);
    }
}

/// Waits until every process in `live` has exited: on a pidfd each, so the wait is an event,
/// not a poll.
async fn wait_all(live: &[Recorded]) {
    for r in live {
        wait_exit(r).await;
    }
}

#[allow(
    deprecated,
    reason = "the safe constructor is deprecated for descriptors that may change under it; an OwnedFd pidfd stays open and the same for the AsyncFd's whole life, and this crate has no unsafe code"
)]
async fn wait_exit(r: &Recorded) {
    let Some(pid) = Pid::from_raw(r.pid) else {
        return;
    };
    match rustix::process::pidfd_open(pid, PidfdFlags::NONBLOCK) {
        Ok(fd) => {
            match tokio::io::unix::AsyncFd::with_interest(fd, tokio::io::Interest::READABLE) {
                Ok(fd) => {
                    // A pidfd turns readable when its process exits. A zombie child of ours
                    // (already exited, not yet reaped) is readable at once.
                    let _ = fd.readable().await;
                }
                Err(_) => poll_exit(r).await,
            }
        }
        // Already gone (ESRCH), or pidfds are not available.
        Err(e) if e == rustix::io::Errno::SRCH => {}
        Err(_) => poll_exit(r).await,
    }
}

async fn poll_exit(r: &Recorded) {
    while is_alive(r) {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[cfg(test)]
mod tests {
    use std::os::unix::process::CommandExt as _;

    use super::*;

    #[test]
    fn a_process_is_known_by_pid_and_start_time() {
        let me = i32::try_from(std::process::id()).unwrap();
        let start = start_time(me).unwrap();
        assert!(is_alive(&Recorded { pid: me, start }));
        assert!(
            !is_alive(&Recorded {
                pid: me,
                start: start + 1
            }),
            "a reused pid"
        );
        assert!(!is_alive(&Recorded {
            pid: i32::MAX,
            start
        }));
    }

    #[tokio::test]
    async fn stop_ends_a_process_group_that_ignores_nothing() {
        let mut child = Command::new("sleep")
            .arg("600")
            .process_group(0)
            .spawn()
            .unwrap();
        let pid = i32::try_from(child.id().unwrap()).unwrap();
        let recorded = [Recorded {
            pid,
            start: start_time(pid).unwrap(),
        }];
        stop(&recorded, Some(&mut child), Duration::from_secs(5)).await;
        assert!(!is_alive(&recorded[0]));
    }

    #[tokio::test]
    async fn a_process_that_ignores_sigterm_is_killed_after_the_grace() {
        let mut child = Command::new("sh")
            .args(["-c", "trap '' TERM; echo ready; while :; do sleep 1; done"])
            .stdout(Stdio::piped())
            .process_group(0)
            .spawn()
            .unwrap();
        // Wait until the trap is set.
        let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
        assert_eq!(lines.next_line().await.unwrap().as_deref(), Some("ready"));
        let pid = i32::try_from(child.id().unwrap()).unwrap();
        let recorded = [Recorded {
            pid,
            start: start_time(pid).unwrap(),
        }];
        stop(&recorded, Some(&mut child), Duration::from_millis(200)).await;
        assert!(!is_alive(&recorded[0]));
    }

    #[tokio::test]
    async fn leftovers_recorded_by_an_earlier_run_are_stopped_and_forgotten() {
        let dir = tempfile::tempdir().unwrap();
        let child = std::process::Command::new("sleep")
            .arg("600")
            .process_group(0)
            .spawn()
            .unwrap();
        let pid = i32::try_from(child.id()).unwrap();
        let recorded = [Recorded {
            pid,
            start: start_time(pid).unwrap(),
        }];
        write_pid_file(dir.path(), &recorded);
        // As after a kill -9 of the worker: the process is nobody's child here but the test's,
        // and a reaper keeps it from lingering as a zombie.
        let reaper = std::thread::spawn(move || {
            let mut child = child;
            let _ = child.wait();
        });
        stop_leftovers(dir.path(), Duration::from_secs(5)).await;
        reaper.join().unwrap();
        assert!(!is_alive(&recorded[0]));
        assert!(!dir.path().join(PID_FILE).exists());
    }

    #[tokio::test]
    async fn a_program_that_exits_before_its_port_line_is_an_error_naming_it() {
        let dir = tempfile::tempdir().unwrap();
        let spec = DaemonSpec {
            command: vec![
                "sh".into(),
                "-c".into(),
                "echo hello; echo 'first' >&2; echo 'cannot read its config' >&2; exit 3".into(),
            ],
            state_dir: dir.path().join("state"),
            env: Vec::new(),
        };
        let err = spawn(&spec, Duration::from_secs(30), Duration::from_secs(1))
            .await
            .unwrap_err();
        assert!(
            matches!(err, ProcessError::Exited(ref s) if s == "exit status: 3: cannot read its config"),
            "its status and its last words: {err}"
        );
        // Nothing on stderr: what it printed first, and the cause only for agent-device's CLI
        // in the daemon's place; another program's words are quoted with no guess.
        for (script, said) in [
            (
                "echo; echo 'agent-device <command> [args]'; echo more; exit 1",
                "exit status: 1; it printed \"agent-device <command> [args]\" and nothing on stderr: agentDevice.command must start agent-device's daemon (<agent-device>/dist/src/internal/daemon.js), not its CLI",
            ),
            (
                "echo 'starting the daemon'; exit 2",
                "exit status: 2; it printed \"starting the daemon\" and nothing on stderr",
            ),
            // At the bound the line is quoted whole; one past it, cut to the bound.
            (
                &format!("echo {}; exit 4", "a".repeat(MAX_QUOTED)),
                &format!(
                    "exit status: 4; it printed \"{}\" and nothing on stderr",
                    "a".repeat(MAX_QUOTED)
                ),
            ),
            (
                &format!("echo {}b; exit 4", "a".repeat(MAX_QUOTED)),
                &format!(
                    "exit status: 4; it printed \"{}\" and nothing on stderr",
                    "a".repeat(MAX_QUOTED)
                ),
            ),
        ] {
            let quiet = DaemonSpec {
                command: vec!["sh".into(), "-c".into(), script.to_owned()],
                ..spec.clone()
            };
            let err = spawn(&quiet, Duration::from_secs(30), Duration::from_secs(1))
                .await
                .unwrap_err();
            assert_eq!(
                err.to_string(),
                format!("the agent-device daemon exited before it served ({said})")
            );
        }
        let missing = DaemonSpec {
            command: vec!["/nonexistent/agent-device".into()],
            ..spec
        };
        let err = spawn(&missing, Duration::from_secs(30), Duration::from_secs(1))
            .await
            .unwrap_err();
        assert!(err.to_string().contains("agentDevice.command"), "{err}");
    }

    #[tokio::test]
    async fn the_port_comes_from_stdout_and_the_token_from_daemon_json() {
        let dir = tempfile::tempdir().unwrap();
        let script = r#"test "$TMPDIR" = "$AGENT_DEVICE_STATE_DIR/tmp" && test -d "$TMPDIR" || exit 9; printf '{"httpPort":4321,"token":"t0k","pid":%s}' $$ > "$AGENT_DEVICE_STATE_DIR/daemon.json"; echo noise; echo AGENT_DEVICE_DAEMON_HTTP_PORT=4321; exec sleep 600"#;
        let spec = DaemonSpec {
            command: vec!["sh".into(), "-c".into(), script.into()],
            state_dir: dir.path().join("state"),
            env: Vec::new(),
        };
        let mut daemon = spawn(&spec, Duration::from_secs(30), Duration::from_secs(1))
            .await
            .unwrap();
        assert_eq!(
            daemon.endpoint,
            Endpoint {
                port: 4321,
                token: "t0k".into()
            }
        );
        assert!(spec.state_dir.join(PID_FILE).exists());
        let recorded = daemon.recorded.clone();
        stop(&recorded, Some(&mut daemon.child), Duration::from_secs(5)).await;
        assert!(recorded.iter().all(|r| !is_alive(r)));
        clear_pid_file(&spec.state_dir);
        assert!(
            !temp_dir(&spec.state_dir).exists(),
            "its temporary files go with it"
        );
    }

    /// A daemon of `sh` that reports port 4321 and its pid, then runs `rest`.
    fn scripted(dir: &Path, rest: &str) -> DaemonSpec {
        let script = format!(
            r#"printf '{{"httpPort":4321,"token":"t0k","pid":%s}}' $$ > "$AGENT_DEVICE_STATE_DIR/daemon.json"; echo AGENT_DEVICE_DAEMON_HTTP_PORT=4321; {rest}"#
        );
        DaemonSpec {
            command: vec!["sh".into(), "-c".into(), script],
            state_dir: dir.join("state"),
            env: Vec::new(),
        }
    }

    #[tokio::test]
    async fn a_daemon_stops_once_its_worker_is_gone_and_its_watch_ends_with_it() {
        let dir = tempfile::tempdir().unwrap();
        let spec = scripted(dir.path(), "exec sleep 600");
        let mut daemon = spawn(&spec, Duration::from_secs(30), Duration::from_secs(1))
            .await
            .unwrap();
        let [watch, itself] = daemon.recorded[..] else {
            panic!(
                "the watch and the daemon are recorded: {:?}",
                daemon.recorded
            );
        };
        assert!(is_alive(&watch) && is_alive(&itself));
        // The worker goes (here: drops its end of the pipe, as a kill -9 would close it).
        drop(daemon.lifeline.take());
        tokio::time::timeout(Duration::from_secs(30), wait_exit(&itself))
            .await
            .expect("the daemon stops when its worker is gone");
        let status = tokio::time::timeout(Duration::from_secs(30), daemon.child.wait())
            .await
            .expect("the watch ends with the daemon")
            .unwrap();
        assert!(!status.success(), "the daemon's SIGTERM shows: {status}");
    }

    #[tokio::test]
    async fn the_watch_exits_with_the_daemons_status_and_the_daemon_reads_no_pipe() {
        let dir = tempfile::tempdir().unwrap();
        // The daemon's stdin is closed: `read` fails at once, and it exits 7.
        let spec = scripted(dir.path(), "read -r line; exit 7");
        let mut daemon = spawn(&spec, Duration::from_secs(30), Duration::from_secs(1))
            .await
            .unwrap();
        let status = tokio::time::timeout(Duration::from_secs(30), daemon.child.wait())
            .await
            .expect("the watch ends with the daemon")
            .unwrap();
        assert_eq!(status.code(), Some(7));
        assert!(
            daemon.recorded.iter().all(|r| !is_alive(r)),
            "nothing of it runs on: {:?}",
            daemon.recorded
        );
    }

    #[tokio::test]
    async fn a_daemon_that_never_reports_its_port_times_out_and_is_stopped() {
        let dir = tempfile::tempdir().unwrap();
        let spec = DaemonSpec {
            command: vec!["sleep".into(), "600".into()],
            state_dir: dir.path().join("state"),
            env: Vec::new(),
        };
        let err = spawn(&spec, Duration::from_millis(300), Duration::from_secs(5))
            .await
            .unwrap_err();
        assert!(matches!(err, ProcessError::Timeout(_)), "{err}");
        assert!(
            !spec.state_dir.join(PID_FILE).exists(),
            "nothing left recorded"
        );
    }
}
