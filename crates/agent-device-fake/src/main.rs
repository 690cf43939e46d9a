//! `agent-device-fake`: the fake daemon as a process that starts like agent-device 0.21.5's own
//! (`AGENT_DEVICE_STATE_DIR`, `AGENT_DEVICE_DAEMON_SERVER_MODE=http`, the port line on stdout,
//! `daemon.json`), so a supervisor can run it in the real daemon's place. See the crate docs.

use std::io::{self, Write as _};
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

fn main() -> ExitCode {
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
