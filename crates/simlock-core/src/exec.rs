//! `device.exec`: runs a configured tool as a host process against a leased device, streaming
//! its output as `output` pushes.
//!
//! The run happens in a task of its own, so a caller that goes away only silences the pushes:
//! the process runs to its end or its timeout. Each chunk is pushed as it is read and the push
//! is awaited before reading on, so a slow reader slows the tool rather than filling memory.
//! Past `exec.timeoutMs` the process gets SIGTERM, then SIGKILL 10 s later.
//!
//! The tool runs in a process group of its own, and every signal goes to the whole group: what
//! the tool started in the background is stopped with it (at its timeout, and when the worker
//! stops and drops the run), not left behind.

use std::process::{ExitStatus, Stdio};
use std::sync::Arc;
use std::time::Duration;

use simlock_daemon::processes::{Entry, Expected, Ledger, Role};

use crate::config::ToolConfig;
use simlock_contract::push::{OutputStream, Push};
use simlock_daemon::CallCtx;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWriteExt};
use tokio::process::{Child, Command};
use tracing::{debug, warn};

use crate::error::CoreError;
use crate::state::ExecTarget;

/// How long a tool gets between SIGTERM and SIGKILL.
const KILL_GRACE: Duration = Duration::from_secs(10);
/// The most read at once from one stream.
const CHUNK: usize = 16 * 1024;

/// One run, checked and ready to spawn.
#[derive(Debug, Clone)]
pub(crate) struct Run {
    pub tool_name: String,
    pub tool: ToolConfig,
    pub args: Vec<String>,
    pub stdin: Option<String>,
    pub target: ExecTarget,
    pub timeout_ms: u64,
    /// Where the tool is recorded while it runs (found again after a crash).
    pub ledger: Option<Arc<Ledger>>,
}

/// Runs the tool in its own task and answers its exit code.
pub(crate) async fn run(ctx: CallCtx, run: Run) -> Result<i32, CoreError> {
    let task = tokio::spawn(run_to_end(ctx, run));
    task.await
        .map_err(|e| CoreError::Internal(format!("the exec task failed: {e}")))?
}

async fn run_to_end(ctx: CallCtx, run: Run) -> Result<i32, CoreError> {
    let env = run.target.environment();
    let not_recorded = |e: std::io::Error| {
        CoreError::Internal(format!(
            "{} could not be recorded in the exec process ledger: {e}",
            run.tool_name
        ))
    };
    // Written before the tool starts, so that a worker killed before it knew the pid finds the
    // tool again by the tag in its environment.
    let expected = match &run.ledger {
        Some(ledger) => Some(
            ledger
                .expect(&Entry {
                    pid: 0,
                    program: run.tool.command.clone(),
                    args: run.tool.args.iter().chain(&run.args).cloned().collect(),
                    role: Role::Exec,
                    device: Some(run.target.device_id.to_string()),
                    port: None,
                    started: None,
                })
                .map_err(not_recorded)?,
        ),
        None => None,
    };
    let mut command = Command::new(&run.tool.command);
    command
        .args(&run.tool.args)
        .args(&run.args)
        .envs(&env)
        .envs(expected.as_ref().map(Expected::env))
        .stdin(if run.stdin.is_some() {
            Stdio::piped()
        } else {
            Stdio::null()
        })
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .process_group(0)
        .kill_on_drop(true);
    let mut child = command.spawn().map_err(|source| CoreError::ExecSpawn {
        tool: run.tool_name.clone(),
        command: run.tool.command.clone(),
        source,
    })?;
    // Dropped with the run (the worker stopping): the whole group is killed, not the tool alone,
    // and forgotten by the ledger.
    let group = Group {
        leader: group_of(&child),
        ledger: run.ledger.clone(),
    };
    if let (Some(expected), Some(pid)) = (expected, child.id())
        && let Err(e) = expected.started(pid)
    {
        drop(group);
        return Err(not_recorded(e));
    }
    // Every pre-spawn failure is ruled out: the process exists.
    ctx.push(Push::Started {
        request_id: ctx.request_id().clone(),
    })
    .await;

    if let (Some(text), Some(mut stdin)) = (run.stdin, child.stdin.take()) {
        tokio::spawn(async move {
            if let Err(e) = stdin.write_all(text.as_bytes()).await {
                debug!(error = %e, "exec stdin was not read to its end");
            }
            // Dropping the pipe closes it: the tool sees end of input.
        });
    }
    let stdout = child.stdout.take();
    let stderr = child.stderr.take();
    let timeout = Duration::from_millis(run.timeout_ms);
    let finished = tokio::time::timeout(timeout, async {
        pump(&ctx, stdout, stderr).await;
        child.wait().await
    })
    .await;
    match finished {
        Ok(Ok(status)) => Ok(exit_code(status)),
        Ok(Err(e)) => Err(CoreError::Internal(format!(
            "waiting for {} failed: {e}",
            run.tool_name
        ))),
        Err(_elapsed) => {
            stop(&mut child).await;
            Err(CoreError::ExecTimeout {
                tool: run.tool_name,
                timeout_ms: run.timeout_ms,
            })
        }
    }
}

/// The process group a tool leads (its pid: it was started as the leader of a new group).
fn group_of(child: &Child) -> Option<rustix::process::Pid> {
    child
        .id()
        .and_then(|id| i32::try_from(id).ok())
        .and_then(rustix::process::Pid::from_raw)
}

/// A tool's process group, killed when dropped (the tool and all it started; a group already
/// gone answers an error, which is ignored), and then forgotten by the ledger.
struct Group {
    leader: Option<rustix::process::Pid>,
    ledger: Option<Arc<Ledger>>,
}

impl Drop for Group {
    fn drop(&mut self) {
        if let Some(group) = self.leader {
            let _ = rustix::process::kill_process_group(group, rustix::process::Signal::KILL);
            if let Some(ledger) = &self.ledger {
                ledger.forget(group.as_raw_nonzero().get().unsigned_abs());
            }
        }
    }
}

/// SIGTERM to the tool's group, then SIGKILL to it after the grace period.
async fn stop(child: &mut Child) {
    if let Some(group) = group_of(child) {
        if let Err(e) = rustix::process::kill_process_group(group, rustix::process::Signal::TERM) {
            debug!(error = %e, "SIGTERM to a timed-out tool failed");
        }
        if tokio::time::timeout(KILL_GRACE, child.wait()).await.is_ok() {
            return;
        }
        if let Err(e) = rustix::process::kill_process_group(group, rustix::process::Signal::KILL) {
            warn!(error = %e, "SIGKILL to a timed-out tool failed");
        }
    } else if let Err(e) = child.start_kill() {
        warn!(error = %e, "SIGKILL to a timed-out tool failed");
    }
    let _ = child.wait().await;
}

fn exit_code(status: ExitStatus) -> i32 {
    use std::os::unix::process::ExitStatusExt;
    status
        .code()
        .or_else(|| status.signal().map(|s| 128 + s))
        .unwrap_or(-1)
}

/// Reads both streams until both end, pushing each chunk as it comes.
async fn pump(
    ctx: &CallCtx,
    stdout: Option<impl AsyncRead + Unpin>,
    stderr: Option<impl AsyncRead + Unpin>,
) {
    let mut out = Stream::new(stdout, OutputStream::Stdout);
    let mut err = Stream::new(stderr, OutputStream::Stderr);
    while out.open() || err.open() {
        let chunk = tokio::select! {
            chunk = out.read(), if out.open() => chunk,
            chunk = err.read(), if err.open() => chunk,
        };
        if let Some((stream, text)) = chunk
            && !text.is_empty()
        {
            ctx.push(Push::Output {
                request_id: ctx.request_id().clone(),
                stream,
                chunk: text,
            })
            .await;
        }
    }
}

struct Stream<R> {
    reader: Option<R>,
    which: OutputStream,
    buf: Vec<u8>,
    carry: Vec<u8>,
}

impl<R: AsyncRead + Unpin> Stream<R> {
    fn new(reader: Option<R>, which: OutputStream) -> Self {
        Self {
            reader,
            which,
            buf: vec![0; CHUNK],
            carry: Vec::new(),
        }
    }

    const fn open(&self) -> bool {
        self.reader.is_some()
    }

    /// The next chunk as text; at the end, whatever incomplete bytes were held back.
    async fn read(&mut self) -> Option<(OutputStream, String)> {
        let reader = self.reader.as_mut()?;
        match reader.read(&mut self.buf).await {
            Ok(n) if n > 0 => {
                self.carry.extend_from_slice(&self.buf[..n]);
                let cut = complete_prefix(&self.carry);
                let rest = self.carry.split_off(cut);
                let text = String::from_utf8_lossy(&self.carry).into_owned();
                self.carry = rest;
                Some((self.which, text))
            }
            _ => {
                self.reader = None;
                let text = String::from_utf8_lossy(&std::mem::take(&mut self.carry)).into_owned();
                Some((self.which, text))
            }
        }
    }
}

/// The length of `bytes` without a trailing, incomplete UTF-8 sequence (held for the next
/// chunk so a character split across reads is not mangled).
fn complete_prefix(bytes: &[u8]) -> usize {
    let len = bytes.len();
    for back in 1..=len.min(3) {
        let byte = bytes[len - back];
        if byte & 0xC0 == 0x80 {
            continue;
        }
        let needed = match byte {
            b if b & 0xE0 == 0xC0 => 2,
            b if b & 0xF0 == 0xE0 => 3,
            b if b & 0xF8 == 0xF0 => 4,
            _ => 1,
        };
        return if needed > back { len - back } else { len };
    }
    len
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_split_character_is_held_back() {
        let euro = "€".as_bytes(); // three bytes
        assert_eq!(complete_prefix(b"abc"), 3);
        assert_eq!(complete_prefix(&[b'a', euro[0]]), 1);
        assert_eq!(complete_prefix(&[b'a', euro[0], euro[1]]), 1);
        assert_eq!(complete_prefix(&[b'a', euro[0], euro[1], euro[2]]), 4);
        assert_eq!(complete_prefix(&[]), 0);
        // Not UTF-8 at all: nothing is held back, the lossy decoding marks it.
        assert_eq!(complete_prefix(&[0xFF, 0xFF]), 2);
    }
}
