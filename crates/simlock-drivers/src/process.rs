//! Running the device tools, each recorded in the driver's process ledger
//! ([`simlock_daemon::processes`], under `$SIMLOCK_HOME/drivers/<platform>/processes/`) while it
//! runs: at the next start after a crash, the driver stops what it does not adopt (a tool call
//! that was under way, an adb server, an emulator of a device it no longer has).
//!
//! Every process runs in a process group of its own, so stopping it stops its children too.

use std::path::Path;
use std::process::{ExitStatus, Stdio};
use std::sync::Arc;
use std::time::Duration;

use tokio::io::AsyncWriteExt;
use tokio::process::{Child, Command};
use tokio::sync::watch;
use tracing::warn;

use crate::error::ToolError;

pub use simlock_daemon::processes::{
    Entry, Expected, Ledger, Role, pid_alive, reap, signal, started_of, still_runs, stop_foreign,
};

/// Makes `dir` (and its parents), owner-only.
///
/// # Errors
/// When it cannot be made.
pub fn make_private_dir(dir: &Path) -> Result<(), ToolError> {
    simlock_daemon::processes::make_private_dir(dir)
        .map_err(|e| ToolError::io("making a private directory", e))
}

/// Opens the ledger in `dir` (created, mode 0700).
///
/// # Errors
/// When the directory cannot be made.
pub fn open_ledger(dir: &Path) -> Result<Ledger, ToolError> {
    Ledger::open(dir).map_err(|e| ToolError::io("opening the process ledger", e))
}

/// What a process about to start will be, beside its command line.
struct Expecting {
    role: Role,
    device: Option<String>,
    port: Option<u16>,
}

/// How long a killed tool call may take to be reaped (SIGKILL cannot be caught; only a process
/// stuck in the kernel takes longer).
const REAP_BOUND: Duration = Duration::from_secs(5);

/// Everything `pipe` yields until its end (nothing for no pipe, or once it fails).
async fn read_all(pipe: Option<&mut (impl tokio::io::AsyncRead + Unpin)>) -> Vec<u8> {
    let mut out = Vec::new();
    if let Some(pipe) = pipe {
        let _ = tokio::io::AsyncReadExt::read_to_end(pipe, &mut out).await;
    }
    out
}

/// What a tool call printed.
#[derive(Debug, Clone)]
pub struct Output {
    /// Standard output.
    pub stdout: String,
    /// Standard error.
    pub stderr: String,
}

/// Runs one platform's tools: with the driver's scoping environment, bounded, recorded in its
/// ledger while they run.
#[derive(Debug, Clone)]
pub struct Runner {
    ledger: Arc<Ledger>,
    env: Vec<(String, String)>,
}

impl Runner {
    /// A runner that records in `ledger` and sets `env` on every process.
    pub fn new(ledger: Arc<Ledger>, env: Vec<(String, String)>) -> Self {
        Self { ledger, env }
    }

    /// The ledger.
    pub fn ledger(&self) -> &Arc<Ledger> {
        &self.ledger
    }

    fn command(&self, program: &Path, args: &[String]) -> Command {
        let mut command = Command::new(program);
        command.args(args).envs(self.env.iter().cloned());
        command.process_group(0);
        command
    }

    /// Starts `program args` as `configure` sets it up, expected in the ledger before it
    /// starts and recorded by pid once it did; one that cannot be recorded is killed.
    fn start(
        &self,
        program: &Path,
        args: &[String],
        what: Expecting,
        configure: impl FnOnce(&mut Command),
    ) -> Result<(Child, Entry), ToolError> {
        let ledger_failed = |e| ToolError::io("writing the process ledger", e);
        let expected = self
            .ledger
            .expect(&Entry {
                pid: 0,
                program: program.display().to_string(),
                args: args.to_vec(),
                role: what.role,
                device: what.device,
                port: what.port,
                started: None,
            })
            .map_err(ledger_failed)?;
        let mut command = self.command(program, args);
        let (key, tag) = expected.env();
        command.env(key, tag);
        configure(&mut command);
        let child = command.spawn().map_err(|source| ToolError::Spawn {
            program: program.display().to_string(),
            source,
        })?;
        let pid = child.id().unwrap_or_default();
        match expected.started(pid) {
            Ok(entry) => Ok((child, entry)),
            Err(e) => {
                // The whole group, not the tool alone.
                signal(pid, rustix::process::Signal::KILL);
                Err(ledger_failed(e))
            }
        }
    }

    /// Runs `program args` to its end, feeding `stdin`, and answers what it printed; a
    /// failure exit is [`ToolError::Failed`]. Past `timeout` the process group is killed.
    ///
    /// # Errors
    /// [`ToolError::Spawn`], [`ToolError::Timeout`] or [`ToolError::Failed`].
    pub async fn run(
        &self,
        program: &Path,
        args: &[String],
        stdin: Option<&str>,
        timeout: Duration,
    ) -> Result<Output, ToolError> {
        let line = command_line(program, args);
        let what = Expecting {
            role: Role::Tool,
            device: None,
            port: None,
        };
        let (mut child, Entry { pid, .. }) = self.start(program, args, what, |command| {
            command
                .stdin(if stdin.is_some() {
                    Stdio::piped()
                } else {
                    Stdio::null()
                })
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .kill_on_drop(true);
        })?;
        if let (Some(text), Some(mut pipe)) = (stdin, child.stdin.take()) {
            let text = text.to_owned();
            tokio::spawn(async move {
                let _ = pipe.write_all(text.as_bytes()).await;
            });
        }
        let mut stdout = child.stdout.take();
        let mut stderr = child.stderr.take();
        let finished = async {
            let (status, out, err) = tokio::join!(
                child.wait(),
                read_all(stdout.as_mut()),
                read_all(stderr.as_mut())
            );
            status.map(|status| (status, out, err))
        };
        let waited = tokio::time::timeout(timeout, finished).await;
        let mut ended = true;
        let outcome = match waited {
            Ok(Ok((status, out, err))) => {
                let stdout = String::from_utf8_lossy(&out).into_owned();
                let stderr = String::from_utf8_lossy(&err).into_owned();
                if status.success() {
                    Ok(Output { stdout, stderr })
                } else {
                    Err(ToolError::Failed {
                        command: line,
                        status: status.to_string(),
                        code: status.code(),
                        stderr,
                        stdout,
                    })
                }
            }
            Ok(Err(e)) => Err(ToolError::io(format!("waiting for `{line}`"), e)),
            Err(_) => {
                // Its group goes too. It was killed once it is reaped: until then it may still
                // run (a signal takes effect when the process is next scheduled), and the
                // ledger keeps it.
                signal(pid, rustix::process::Signal::KILL);
                let _ = child.start_kill();
                if tokio::time::timeout(REAP_BOUND, child.wait())
                    .await
                    .is_err()
                {
                    warn!(pid, command = %line, "a killed tool call was not reaped in time; the ledger keeps it");
                    ended = false;
                }
                Err(ToolError::Timeout {
                    command: line,
                    ms: u64::try_from(timeout.as_millis()).unwrap_or(u64::MAX),
                })
            }
        };
        if ended {
            self.ledger.forget(pid);
        }
        outcome
    }

    /// Starts a long-running process with its output going to its log, and keeps reaping it
    /// in the background; it is not killed when the handle goes (a device may outlive the
    /// worker).
    ///
    /// # Errors
    /// When it cannot be started or recorded.
    pub fn spawn(&self, start: &Start<'_>) -> Result<Spawned, ToolError> {
        let Start {
            program,
            args,
            env: extra_env,
            log,
            role,
            device,
            port,
        } = start;
        let (role, port, device) = (*role, *port, device.clone());
        let log_file = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(log)
            .map_err(|e| ToolError::io(format!("opening {}", log.display()), e))?;
        let err_file = log_file
            .try_clone()
            .map_err(|e| ToolError::io(format!("opening {}", log.display()), e))?;
        let what = Expecting { role, device, port };
        let (mut child, entry) = self.start(program, args, what, |command| {
            command
                .envs(extra_env.iter().cloned())
                .stdin(Stdio::null())
                .stdout(log_file)
                .stderr(err_file)
                .kill_on_drop(false);
        })?;
        let pid = entry.pid;
        let (tx, rx) = watch::channel(None);
        let ledger = self.ledger.clone();
        tokio::spawn(async move {
            let status = child.wait().await.ok();
            ledger.forget(pid);
            let _ = tx.send(Some(status));
        });
        Ok(Spawned { entry, exited: rx })
    }
}

/// What [`Runner::spawn`] starts.
#[derive(Debug, Clone)]
pub struct Start<'a> {
    /// The program.
    pub program: &'a Path,
    /// Its arguments.
    pub args: &'a [String],
    /// Environment beyond the runner's.
    pub env: &'a [(String, String)],
    /// Where its stdout and stderr go.
    pub log: &'a Path,
    /// What it is.
    pub role: Role,
    /// The device it serves.
    pub device: Option<String>,
    /// The port it holds.
    pub port: Option<u16>,
}

/// A long-running process the driver started in this run.
#[derive(Debug, Clone)]
pub struct Spawned {
    /// Its ledger entry.
    pub entry: Entry,
    exited: watch::Receiver<Option<Option<ExitStatus>>>,
}

impl Spawned {
    /// Whether it has ended.
    pub fn has_exited(&self) -> bool {
        self.exited.borrow().is_some()
    }

    /// Waits until it ends, at most `within`; answers whether it did.
    pub async fn wait_exit(&self, within: Duration) -> bool {
        let mut rx = self.exited.clone();
        tokio::time::timeout(within, rx.wait_for(Option::is_some))
            .await
            .is_ok_and(|r| r.is_ok())
    }

    /// Stops it: SIGTERM, then SIGKILL once `grace` passed; waits until it is reaped.
    pub async fn stop(&self, grace: Duration) {
        if self.has_exited() {
            return;
        }
        signal(self.entry.pid, rustix::process::Signal::TERM);
        if !self.wait_exit(grace).await {
            signal(self.entry.pid, rustix::process::Signal::KILL);
            self.wait_exit(Duration::from_secs(5)).await;
        }
    }
}

/// The command as one line, for messages.
pub fn command_line(program: &Path, args: &[String]) -> String {
    let name = program.file_name().map_or_else(
        || program.display().to_string(),
        |n| n.to_string_lossy().into_owned(),
    );
    std::iter::once(name)
        .chain(args.iter().cloned())
        .collect::<Vec<_>>()
        .join(" ")
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `sh -c script` run to its end (within 10 s).
    async fn sh(runner: &Runner, script: &str) -> Result<Output, ToolError> {
        runner
            .run(
                Path::new("sh"),
                &["-c".into(), script.into()],
                None,
                Duration::from_secs(10),
            )
            .await
    }

    #[tokio::test]
    async fn a_call_past_its_bound_is_killed_and_forgotten() {
        let dir = tempfile::tempdir().unwrap();
        let ledger = Arc::new(Ledger::open(&dir.path().join("l")).unwrap());
        let runner = Runner::new(ledger.clone(), Vec::new());
        let err = runner
            .run(
                Path::new("sleep"),
                &["30".to_owned()],
                None,
                Duration::from_millis(50),
            )
            .await
            .unwrap_err();
        assert!(matches!(err, ToolError::Timeout { .. }), "{err}");
        assert!(ledger.entries().is_empty());
        let err = sh(&runner, "echo no >&2; exit 3").await.unwrap_err();
        assert!(
            matches!(err, ToolError::Failed { code: Some(3), .. }),
            "{err}"
        );
        assert!(err.says("NO"));
        let err = runner
            .run(
                Path::new("/nonexistent/tool"),
                &[],
                None,
                Duration::from_secs(1),
            )
            .await
            .unwrap_err();
        assert!(matches!(err, ToolError::Spawn { .. }), "{err}");
    }

    /// Every process carries the tag that finds it again after a crash, and nothing stays
    /// expected once it was recorded.
    #[tokio::test]
    async fn a_tool_carries_its_tag_and_leaves_nothing_expected() {
        let dir = tempfile::tempdir().unwrap();
        let ledger = Arc::new(Ledger::open(&dir.path().join("l")).unwrap());
        let runner = Runner::new(ledger.clone(), Vec::new());
        let out = sh(&runner, "echo \"$SIMLOCK_PROCESS_TAG\"").await.unwrap();
        assert!(!out.stdout.trim().is_empty(), "{out:?}");
        let log = dir.path().join("log");
        let spawned = runner
            .spawn(&Start {
                program: Path::new("sh"),
                args: &["-c".into(), "echo \"tag=$SIMLOCK_PROCESS_TAG\"".into()],
                env: &[],
                log: &log,
                role: Role::Emulator,
                device: None,
                port: None,
            })
            .unwrap();
        assert!(spawned.wait_exit(Duration::from_secs(30)).await);
        let logged = std::fs::read_to_string(&log).unwrap();
        assert!(logged.trim().len() > "tag=".len(), "{logged}");
        let left = std::fs::read_dir(dir.path().join("l")).unwrap().count();
        assert_eq!(left, 0, "nothing recorded, nothing expected");
    }

    #[tokio::test]
    async fn a_call_past_its_bound_has_ended_when_its_timeout_is_answered() {
        let dir = tempfile::tempdir().unwrap();
        let ledger = Arc::new(Ledger::open(&dir.path().join("l")).unwrap());
        let runner = Runner::new(ledger.clone(), Vec::new());
        let pid_file = dir.path().join("pid");
        let script = format!("echo $$ > '{}'; exec sleep 30", pid_file.display());
        // The shell must have written its pid before the bound passes: the bound doubles
        // until it has (the check is of what follows, never of how long anything took).
        let mut bound = Duration::from_millis(50);
        let pid = loop {
            let err = runner
                .run(Path::new("sh"), &["-c".into(), script.clone()], None, bound)
                .await
                .unwrap_err();
            assert!(matches!(err, ToolError::Timeout { .. }), "{err}");
            if let Some(pid) = std::fs::read_to_string(&pid_file)
                .ok()
                .and_then(|p| p.trim().parse::<u32>().ok())
            {
                break pid;
            }
            assert!(bound < Duration::from_secs(60), "the shell never ran");
            bound *= 2;
        };
        assert!(
            !pid_alive(pid),
            "the killed call is gone, not only signalled"
        );
        assert!(ledger.entries().is_empty(), "and then forgotten");
    }

    #[tokio::test]
    async fn a_process_left_by_an_earlier_run_is_found_and_stopped_by_pid() {
        let dir = tempfile::tempdir().unwrap();
        let ledger = Arc::new(Ledger::open(&dir.path().join("l")).unwrap());
        let runner = Runner::new(ledger.clone(), Vec::new());
        let log = dir.path().join("log");
        let spawned = runner
            .spawn(&Start {
                program: Path::new("sleep"),
                args: &["30".to_owned()],
                env: &[],
                log: &log,
                role: Role::Emulator,
                device: Some("avd".into()),
                port: None,
            })
            .unwrap();
        let pid = spawned.entry.pid;
        assert!(still_runs(&ledger.entries()[0]));
        // A second ledger on the same directory: what a restarted worker reads.
        let again = Ledger::open(&dir.path().join("l")).unwrap();
        let kept = reap(&again, |e| e.role == Role::Emulator).await;
        assert!(kept.is_empty() && pid_alive(pid), "a kept process runs on");
        let stopped = reap(&again, |_| false).await;
        assert_eq!(stopped.len(), 1);
        assert!(spawned.wait_exit(Duration::from_secs(10)).await);
        assert!(again.entries().is_empty());
        // A recorded pid that now runs another program is not ours: only forgotten.
        let stranger = Entry {
            pid: std::process::id(),
            program: "/not/what/runs".into(),
            args: vec![],
            role: Role::Tool,
            device: None,
            port: None,
            started: None,
        };
        again.record(&stranger).unwrap();
        assert!(reap(&again, |_| false).await.is_empty());
        assert!(again.entries().is_empty());
    }
}
