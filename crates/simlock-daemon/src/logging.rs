//! Logging for the daemons: `tracing` to stderr, filtered by `log.level` or `SIMLOCK_LOG`.

use std::io::IsTerminal as _;

use tracing_subscriber::EnvFilter;

/// Installs the subscriber once; later calls do nothing.
pub fn init(level: &str) {
    let filter = std::env::var("SIMLOCK_LOG")
        .ok()
        .and_then(|f| EnvFilter::try_new(f).ok())
        .or_else(|| EnvFilter::try_new(level).ok());
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter.unwrap_or_else(|| EnvFilter::new("info")))
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal())
        .try_init();
}
