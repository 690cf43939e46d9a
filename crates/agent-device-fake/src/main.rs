//! `agent-device-fake`: the fake daemon as a process that starts like agent-device 0.21.5's own
//! (`AGENT_DEVICE_STATE_DIR`, `AGENT_DEVICE_DAEMON_SERVER_MODE=http`, the port line on stdout,
//! `daemon.json`), so a supervisor can run it in the real daemon's place. See the crate docs.

use std::ffi::OsString;
use std::io::{self, Write};
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::{SystemTime, UNIX_EPOCH};

use agent_device_fake::daemon_files::{DaemonFiles, DaemonInfo, live_holder, process_start_time};
use agent_device_fake::{Device, FakeAgentDevice, FakeOptions, TtlPolicy, VERSION};
use tokio::signal::unix::{SignalKind, signal};

/// Why the fake would not start.
#[derive(Debug, thiserror::Error)]
enum StartError {
    #[error("AGENT_DEVICE_DAEMON_SERVER_MODE={0}: agent-device-fake serves HTTP only")]
    Mode(String),
    #[error("{name}={value}: not a number of milliseconds")]
    Ttl { name: &'static str, value: String },
    #[error("AGENT_DEVICE_FAKE_DEVICES is not a JSON array of devices: {0}")]
    Devices(serde_json::Error),
    #[error("AGENT_DEVICE_FAKE_TOKEN is empty")]
    EmptyToken,
    #[error("neither AGENT_DEVICE_STATE_DIR nor HOME is set")]
    NoStateDir,
    #[error("{0}")]
    Io(#[from] io::Error),
}

impl StartError {
    fn exit_code(&self) -> u8 {
        match self {
            Self::Io(_) => 1,
            _ => 2,
        }
    }
}

fn env(name: &str) -> Option<String> {
    std::env::var(name).ok().filter(|v| !v.is_empty())
}

fn ttl_env(name: &'static str, default: u64) -> Result<u64, StartError> {
    env(name).map_or(Ok(default), |value| {
        value.parse().map_err(|_| StartError::Ttl { name, value })
    })
}

/// Reads the environment into options and the state directory.
fn configure() -> Result<(FakeOptions, PathBuf), StartError> {
    if let Some(mode) = env("AGENT_DEVICE_DAEMON_SERVER_MODE")
        && mode != "http"
    {
        return Err(StartError::Mode(mode));
    }
    let state_dir = match env("AGENT_DEVICE_STATE_DIR") {
        Some(dir) => PathBuf::from(dir),
        None => PathBuf::from(env("HOME").ok_or(StartError::NoStateDir)?).join(".agent-device"),
    };
    let defaults = TtlPolicy::default();
    let ttl = TtlPolicy {
        default_ms: ttl_env("AGENT_DEVICE_LEASE_TTL_MS", defaults.default_ms)?,
        min_ms: ttl_env("AGENT_DEVICE_LEASE_MIN_TTL_MS", defaults.min_ms)?,
        max_ms: ttl_env("AGENT_DEVICE_LEASE_MAX_TTL_MS", defaults.max_ms)?,
    };
    let mut options = FakeOptions::default()
        .with_state_dir(state_dir.clone())
        .with_ttl(ttl);
    if let Ok(token) = std::env::var("AGENT_DEVICE_FAKE_TOKEN") {
        if token.is_empty() {
            return Err(StartError::EmptyToken);
        }
        options = options.with_token(token);
    }
    if let Some(devices) = env("AGENT_DEVICE_FAKE_DEVICES") {
        let devices: Vec<Device> = serde_json::from_str(&devices).map_err(StartError::Devices)?;
        options = options.with_devices(devices);
    }
    Ok((options, state_dir))
}

async fn run() -> Result<(), StartError> {
    let (options, state_dir) = configure()?;
    // As 0.21.5: a directory another live daemon holds is left alone, and that is not a failure.
    if live_holder(&state_dir).is_some() {
        let mut stdout = io::stdout().lock();
        writeln!(stdout, "Daemon lock is held by another process; exiting.")?;
        return Ok(());
    }
    // Signals are set up before anything is announced, so a TERM right after the port line is
    // never lost.
    let mut term = signal(SignalKind::terminate())?;
    let mut int = signal(SignalKind::interrupt())?;
    let mut hup = signal(SignalKind::hangup())?;
    let fake = FakeAgentDevice::start(options)?;
    let pid = std::process::id();
    let info = DaemonInfo {
        http_port: fake.port(),
        transport: "http",
        token: fake.token().to_owned(),
        pid,
        version: VERSION,
        code_origin: "installed",
        process_start_time: process_start_time(pid),
        state_dir: state_dir.display().to_string(),
    };
    let started_at = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX));
    let mut stdout = io::stdout().lock();
    writeln!(stdout, "AGENT_DEVICE_DAEMON_HTTP_PORT={}", fake.port())?;
    stdout.flush()?;
    drop(stdout);
    let files = DaemonFiles::write(&state_dir, &info, started_at)?;
    tokio::select! {
        _ = term.recv() => {}
        _ = int.recv() => {}
        _ = hup.recv() => {}
    }
    files.remove();
    fake.stop().await;
    Ok(())
}

/// What `--help` prints.
const USAGE: &str = "\
agent-device-fake: a fake of agent-device 0.21.5's daemon, for simlock's tests

Usage: agent-device-fake [-h | --help]

Serves agent-device's HTTP routes on 127.0.0.1 (a free port), prints
AGENT_DEVICE_DAEMON_HTTP_PORT=<port> on stdout, writes daemon.json and daemon.lock
in its state directory, and runs until SIGTERM, SIGINT or SIGHUP, as the real
daemon does. It takes no arguments: it reads the environment.

Environment:
  AGENT_DEVICE_STATE_DIR           the state directory (default $HOME/.agent-device)
  AGENT_DEVICE_DAEMON_SERVER_MODE  http, or unset (socket and dual are refused)
  AGENT_DEVICE_LEASE_TTL_MS        a lease's TTL when none is asked (default 60000)
  AGENT_DEVICE_LEASE_MIN_TTL_MS    the shortest TTL granted (default 5000)
  AGENT_DEVICE_LEASE_MAX_TTL_MS    the longest TTL granted (default 600000)
  AGENT_DEVICE_FAKE_TOKEN          a fixed token (default: a fresh one per start)
  AGENT_DEVICE_FAKE_DEVICES        a JSON array of the devices it lists

Exit status: 0 when stopped by a signal, or when another live daemon holds the
state directory; 2 for a bad argument or setting; 1 for an I/O failure.
";

/// Reads the command line: the daemon takes no arguments, as the real one does, so only
/// `--help` (`-h`) is read. `Some(status)` when the process ends here: after the usage text on
/// `out`, or after naming the argument it does not take on `err` (status 2, as a bad setting).
fn command_line(
    args: impl IntoIterator<Item = OsString>,
    out: &mut impl Write,
    err: &mut impl Write,
) -> Option<ExitCode> {
    let mut help = false;
    for arg in args {
        match arg.to_str() {
            Some("-h" | "--help") => help = true,
            _ => {
                let _ = writeln!(
                    err,
                    "agent-device-fake: unexpected argument '{}': it takes none (it reads its \
                     settings from the environment; see --help)",
                    arg.to_string_lossy()
                );
                return Some(ExitCode::from(2));
            }
        }
    }
    help.then(|| {
        let _ = out.write_all(USAGE.as_bytes());
        ExitCode::SUCCESS
    })
}

fn main() -> ExitCode {
    if let Some(status) = command_line(
        std::env::args_os().skip(1),
        &mut io::stdout(),
        &mut io::stderr(),
    ) {
        return status;
    }
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
    {
        Ok(runtime) => runtime,
        Err(error) => {
            let _ = writeln!(io::stderr(), "agent-device-fake: {error}");
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(run()) {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            let _ = writeln!(io::stderr(), "agent-device-fake: {error}");
            ExitCode::from(error.exit_code())
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What `command_line` decides for `args`, with what it wrote on stdout and stderr.
    fn run(args: &[&str]) -> (Option<ExitCode>, String, String) {
        let (mut out, mut err) = (Vec::new(), Vec::new());
        let status = command_line(args.iter().map(OsString::from), &mut out, &mut err);
        (
            status,
            String::from_utf8_lossy(&out).into_owned(),
            String::from_utf8_lossy(&err).into_owned(),
        )
    }

    #[test]
    fn help_prints_the_usage_and_exits_0() {
        for flag in ["--help", "-h"] {
            let (status, out, err) = run(&[flag]);
            assert_eq!(status, Some(ExitCode::SUCCESS), "{flag}");
            assert!(out.starts_with("agent-device-fake: "), "{flag}: {out}");
            assert!(
                out.contains("Usage: agent-device-fake [-h | --help]"),
                "{out}"
            );
            for name in ["AGENT_DEVICE_STATE_DIR", "AGENT_DEVICE_FAKE_TOKEN"] {
                assert!(out.contains(name), "the usage names {name}: {out}");
            }
            let ttl = TtlPolicy::default();
            for (name, default) in [
                ("AGENT_DEVICE_LEASE_TTL_MS", ttl.default_ms),
                ("AGENT_DEVICE_LEASE_MIN_TTL_MS", ttl.min_ms),
                ("AGENT_DEVICE_LEASE_MAX_TTL_MS", ttl.max_ms),
            ] {
                let line = out.lines().find(|l| l.trim_start().starts_with(name));
                assert!(
                    line.is_some_and(|l| l.ends_with(&format!("(default {default})"))),
                    "{name}'s default is the fake's: {line:?}"
                );
            }
            assert!(err.is_empty(), "{err}");
        }
    }

    #[test]
    fn an_unknown_argument_is_refused_naming_it_with_status_2() {
        for args in [
            &["--bogus"][..],
            &["serve"],
            &["--help", "--bogus"],
            &["-x"],
        ] {
            let (status, out, err) = run(args);
            assert_eq!(status, Some(ExitCode::from(2)), "{args:?}");
            assert!(out.is_empty(), "{args:?}: no usage on stdout: {out}");
            let named = args.last().unwrap_or(&"");
            assert!(
                err.starts_with(&format!(
                    "agent-device-fake: unexpected argument '{named}': "
                )),
                "{args:?}: {err}"
            );
        }
    }

    #[test]
    fn no_argument_serves() {
        assert_eq!(run(&[]), (None, String::new(), String::new()));
    }
}
