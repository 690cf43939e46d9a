//! Running cargo and other tools: the workspace root, echoing a command, and capturing output lines
//! while still showing them.

use std::{
    ffi::OsString,
    io::{self, BufRead, BufReader, Read, Write},
    path::{Path, PathBuf},
    process::{Command, ExitStatus, Stdio},
    thread,
    time::Duration,
};

use anyhow::{Context, Result, anyhow};

/// The workspace root: xtask always runs from a checkout, so its own manifest directory locates it.
pub(crate) fn workspace_root() -> PathBuf {
    let xtask_dir = Path::new(env!("CARGO_MANIFEST_DIR"));
    xtask_dir.parent().unwrap_or(xtask_dir).to_path_buf()
}

/// A `cargo` command run from the workspace root. Uses the `CARGO` variable that cargo sets for
/// `cargo xtask`, so the same toolchain runs every step.
pub(crate) fn cargo<I, S>(args: I) -> Command
where
    I: IntoIterator<Item = S>,
    S: Into<OsString>,
{
    let program = std::env::var_os("CARGO").unwrap_or_else(|| OsString::from("cargo"));
    let mut command = Command::new(program);
    command
        .args(args.into_iter().map(Into::into))
        .current_dir(workspace_root());
    command
}

/// The command line as a user would type it, for logs: `cargo` rather than the full `CARGO` path.
pub(crate) fn display(command: &Command) -> String {
    let mut words = Vec::new();
    for (key, value) in command.get_envs() {
        if let Some(value) = value {
            words.push(format!(
                "{}={}",
                key.to_string_lossy(),
                quote(&value.to_string_lossy())
            ));
        }
    }
    let program = Path::new(command.get_program());
    let is_cargo = std::env::var_os("CARGO").is_some_and(|cargo| cargo == command.get_program());
    words.push(if is_cargo {
        "cargo".to_owned()
    } else {
        program.to_string_lossy().into_owned()
    });
    words.extend(command.get_args().map(|arg| quote(&arg.to_string_lossy())));
    words.join(" ")
}

fn quote(word: &str) -> String {
    if word.is_empty() || word.contains(char::is_whitespace) {
        format!("'{word}'")
    } else {
        word.to_owned()
    }
}

/// Whether `command` can be started and exits successfully, with its output discarded. Used to probe
/// for optional tools such as `cargo nextest` and `cargo deny`.
pub(crate) fn succeeds(mut command: Command) -> bool {
    command
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|status| status.success())
}

/// Runs `command` with inherited stdio and returns its exit status.
pub(crate) fn status(mut command: Command) -> Result<ExitStatus> {
    command
        .stdin(Stdio::null())
        .status()
        .with_context(|| format!("could not start `{}`", display(&command)))
}

/// Runs `command`, copying its stdout and stderr through unchanged while collecting every line of
/// both (stdout lines first, each stream in order). Returns the exit status and the lines.
pub(crate) fn status_with_lines(mut command: Command) -> Result<(ExitStatus, Vec<String>)> {
    let shown = display(&command);
    let mut child = command
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .with_context(|| format!("could not start `{shown}`"))?;
    let stdout = child
        .stdout
        .take()
        .ok_or_else(|| anyhow!("no stdout pipe for `{shown}`"))?;
    let stderr = child
        .stderr
        .take()
        .ok_or_else(|| anyhow!("no stderr pipe for `{shown}`"))?;
    // Both pipes are drained at once so that a child blocked on a full stderr pipe cannot deadlock
    // against us waiting on stdout.
    let stderr_lines = thread::spawn(move || tee(stderr, io::stderr()));
    let mut lines = tee(stdout, io::stdout()).with_context(|| format!("reading `{shown}`"))?;
    let more = stderr_lines
        .join()
        .map_err(|_| anyhow!("the stderr reader of `{shown}` panicked"))?
        .with_context(|| format!("reading `{shown}`"))?;
    lines.extend(more);
    let status = child
        .wait()
        .with_context(|| format!("waiting for `{shown}`"))?;
    Ok((status, lines))
}

fn tee(source: impl Read, mut sink: impl Write) -> io::Result<Vec<String>> {
    let mut reader = BufReader::new(source);
    let mut lines = Vec::new();
    let mut line = Vec::new();
    loop {
        line.clear();
        if reader.read_until(b'\n', &mut line)? == 0 {
            return Ok(lines);
        }
        sink.write_all(&line)?;
        sink.flush()?;
        lines.push(String::from_utf8_lossy(&line).trim_end().to_owned());
    }
}

/// Wall time as `1m02.3s` or `4.5s`.
pub(crate) fn format_duration(duration: Duration) -> String {
    // Rounded to tenths first, so 119.97 s reads `2m00.0s` rather than `1m60.0s`.
    let tenths = (duration.as_millis() + 50) / 100;
    let (minutes, tenths) = (tenths / 600, tenths % 600);
    let (secs, tenth) = (tenths / 10, tenths % 10);
    if minutes > 0 {
        format!("{minutes}m{secs:02}.{tenth}s")
    } else {
        format!("{secs}.{tenth}s")
    }
}

/// Measures wall time of a step.
pub(crate) struct Stopwatch(std::time::Instant);

impl Stopwatch {
    #[allow(
        clippy::disallowed_methods,
        reason = "xtask reports the wall time of real commands; there is no state machine to feed `now`"
    )]
    pub(crate) fn start() -> Self {
        Self(std::time::Instant::now())
    }

    pub(crate) fn elapsed(&self) -> Duration {
        self.0.elapsed()
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::format_duration;

    #[test]
    fn durations_read_well() {
        assert_eq!(format_duration(Duration::from_millis(4_530)), "4.5s");
        assert_eq!(format_duration(Duration::from_millis(62_300)), "1m02.3s");
        assert_eq!(format_duration(Duration::from_secs(600)), "10m00.0s");
        assert_eq!(format_duration(Duration::from_millis(119_970)), "2m00.0s");
    }
}
