//! Logging for the daemons: `tracing` to stderr, filtered by `log.level` or `SIMLOCK_LOG`.

use std::io::IsTerminal as _;

use tracing_subscriber::EnvFilter;

/// The levels a directive without `=` may name.
const LEVELS: &[&str] = &["error", "warn", "info", "debug", "trace", "off"];

/// The filter `text` names (`info`, `simlock=debug`, …). A directive without `=` must be a
/// level: `tracing` would read any other word (`debgu`) as a target to show at every level,
/// which silences every other log line.
///
/// # Errors
/// Why it is not a filter.
pub fn filter(text: &str) -> Result<EnvFilter, String> {
    if let Some(word) = text
        .split(',')
        .map(str::trim)
        .find(|d| !d.is_empty() && !d.contains('=') && !d.contains('[') && !is_level(d))
    {
        return Err(format!(
            "{text:?} is not a log filter: {word:?} is neither a level ({}) nor target=level",
            LEVELS.join(", ")
        ));
    }
    EnvFilter::try_new(text).map_err(|e| format!("{text:?} is not a log filter: {e}"))
}

fn is_level(word: &str) -> bool {
    LEVELS.iter().any(|level| level.eq_ignore_ascii_case(word))
}

/// Log lines waiting for standard error; past them, new lines are dropped.
const BUFFERED_LINES: usize = 10_000;

/// Installs the subscriber once; later calls do nothing. `level` is `log.level`, which the
/// configuration checked; `SIMLOCK_LOG` wins over it when it is a filter, and is warned about
/// (once the subscriber is in place) when it is not.
///
/// Lines go to standard error from a thread of their own, through a bounded queue that drops
/// what does not fit: a standard error nobody reads (a stalled pipe, a stuck journal) or that
/// cannot be written (a full disk) never holds up the daemon (trials 19, 20). Keep the answer
/// until the process ends: dropping it writes out what is queued (for at most a second).
#[must_use]
pub fn init(level: &str) -> Option<tracing_appender::non_blocking::WorkerGuard> {
    let from_env = std::env::var("SIMLOCK_LOG").ok().map(|f| filter(&f));
    let refused = from_env.as_ref().and_then(|f| f.as_ref().err().cloned());
    let chosen = from_env
        .and_then(Result::ok)
        .or_else(|| filter(level).ok())
        .unwrap_or_else(|| EnvFilter::new("info"));
    let (writer, guard) = tracing_appender::non_blocking::NonBlockingBuilder::default()
        .buffered_lines_limit(BUFFERED_LINES)
        .lossy(true)
        .thread_name("simlock-log")
        .finish(std::io::stderr());
    // A line that cannot be written (a full disk, a closed pipe) is dropped: the subscriber
    // would otherwise report it with `eprintln!`, which panics the thread that logged.
    let installed = tracing_subscriber::fmt()
        .with_env_filter(chosen)
        .log_internal_errors(false)
        .with_writer(writer)
        .with_ansi(std::io::stderr().is_terminal())
        .try_init()
        .is_ok();
    if let Some(why) = refused {
        tracing::warn!("SIMLOCK_LOG: {why}; log.level ({level}) is used instead");
    }
    installed.then_some(guard)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_filter_is_read_and_one_that_is_not_says_why() {
        for text in [
            "info",
            "WARN",
            "simlock=debug,info",
            "off",
            "warn,simlock_core=debug",
        ] {
            assert!(filter(text).is_ok(), "{text}");
        }
        // A word that is not a level would be read as a target and silence everything else.
        for (text, word) in [
            ("debgu", "debgu"),
            ("loud", "loud"),
            ("info,verbose", "verbose"),
            ("9", "9"),
        ] {
            assert_eq!(
                filter(text).unwrap_err(),
                format!(
                    "{text:?} is not a log filter: {word:?} is neither a level (error, warn, \
                     info, debug, trace, off) nor target=level"
                )
            );
        }
        for text in ["garbage=[[[", "notalevel==="] {
            let why = filter(text).unwrap_err();
            assert!(
                why.starts_with(&format!("{text:?} is not a log filter")),
                "{why}"
            );
        }
    }
}
