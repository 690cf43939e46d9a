//! Logging for the daemons: `tracing` to stderr, filtered by `log.level` or `SIMLOCK_LOG`.

use std::io::IsTerminal as _;
use std::time::Duration;

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
/// until the process ends: dropping it writes out what is queued ([`LogFlush`]).
#[must_use]
pub fn init(level: &str) -> Option<LogFlush> {
    let from_env = std::env::var("SIMLOCK_LOG").ok().map(|f| filter(&f));
    let refused = from_env.as_ref().and_then(|f| f.as_ref().err().cloned());
    let chosen = from_env
        .and_then(Result::ok)
        .or_else(|| filter(level).ok())
        .unwrap_or_else(|| EnvFilter::new("info"));
    let (writer, flush) = queued(std::io::stderr(), BUFFERED_LINES);
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
    installed.then_some(flush)
}

/// How long a stop waits for the queued log lines to be written.
const FLUSH_BOUND: Duration = Duration::from_millis(1500);

/// `out` behind a queue of `lines` lines written by a thread of its own; a line that does not
/// fit is dropped.
fn queued<W: std::io::Write + Send + 'static>(
    out: W,
    lines: usize,
) -> (tracing_appender::non_blocking::NonBlocking, LogFlush) {
    let (writer, guard) = tracing_appender::non_blocking::NonBlockingBuilder::default()
        .buffered_lines_limit(lines)
        .lossy(true)
        .thread_name("simlock-log")
        .finish(out);
    (writer, LogFlush(Some(Box::new(guard))))
}

/// Writes out the log lines still queued when dropped, waiting at most 1.5 s: a log
/// nobody reads holds up no stop. (The queue's own guard, past a queue full for 100 ms, says so
/// with `println!`, which blocks on a stalled stdout and panics on a closed one: it is dropped
/// on a thread of its own.)
pub struct LogFlush(Option<Box<dyn Send>>);

impl std::fmt::Debug for LogFlush {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LogFlush").finish_non_exhaustive()
    }
}

impl Drop for LogFlush {
    fn drop(&mut self) {
        let Some(guard) = self.0.take() else {
            return;
        };
        let (done, flushed) = std::sync::mpsc::channel();
        let flushing = std::thread::Builder::new()
            .name("simlock-log-flush".into())
            .spawn(move || {
                drop(guard);
                let _ = done.send(());
            });
        if flushing.is_ok() {
            let _ = flushed.recv_timeout(FLUSH_BOUND);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A writer that never returns: a pipe nobody reads.
    struct Stalled(std::sync::mpsc::Receiver<()>);

    impl std::io::Write for Stalled {
        fn write(&mut self, _: &[u8]) -> std::io::Result<usize> {
            let _ = self.0.recv();
            Err(std::io::ErrorKind::BrokenPipe.into())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    #[test]
    fn a_stop_behind_a_log_nobody_reads_ends_and_lines_past_the_queue_are_dropped() {
        use tracing_subscriber::fmt::MakeWriter as _;
        // Kept, never sent: the writer waits for ever.
        let (_never, stalled) = std::sync::mpsc::channel();
        let (writer, flush) = queued(Stalled(stalled), 2);
        for _ in 0..10 {
            let mut line = writer.make_writer();
            std::io::Write::write_all(&mut line, b"a line\n").unwrap();
        }
        assert!(writer.error_counter().dropped_lines() > 0, "past the queue");
        // The queue is full and its writer stuck: dropping the flush returns all the same.
        drop(flush);
    }

    /// A guard whose drop never returns, as the queue's own does on a stdout nobody reads.
    struct BlocksOnDrop(std::sync::mpsc::Receiver<()>);

    impl Drop for BlocksOnDrop {
        fn drop(&mut self) {
            let _ = self.0.recv();
        }
    }

    #[test]
    fn a_flush_whose_guard_never_returns_holds_up_no_stop() {
        let (_never, blocked) = std::sync::mpsc::channel();
        drop(LogFlush(Some(Box::new(BlocksOnDrop(blocked)))));
    }

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
