//! What a listener does when `accept` fails (most often the process is out of file
//! descriptors, `EMFILE`): back off, and say so without flooding the log. The decisions are
//! plain data taking `now`; the listeners apply them.
//!
//! A failed accept leaves the connection in the backlog, so trying again at once fails again:
//! the listener waits 50 ms, doubling up to 1 s while the failures go on, and back to 50 ms
//! after an accept succeeds. The first failure of a run is logged as a warning; later ones are
//! counted and summed up at most every 10 s; the first success 10 s after the last failure ends
//! the run and says how many there were. A daemon held at its descriptor limit costs a line
//! every 10 s, not 20 a second (outside trial 21), also while freed descriptors let accepts
//! through between failures.

use std::time::Duration;

use tokio::time::Instant;

/// The first wait after a failed accept.
pub const FIRST_WAIT: Duration = Duration::from_millis(50);
/// The longest wait between tries while accepts keep failing.
pub const MAX_WAIT: Duration = Duration::from_secs(1);
/// How often a run of failures is summed up in the log.
pub const SUMMARY_EVERY: Duration = Duration::from_secs(10);

/// Failed accepts on one listener, and what was said of them.
///
/// A run of failures ends at the first accept that follows [`SUMMARY_EVERY`] without a
/// failure: at its descriptor limit a busy daemon alternates (each freed descriptor lets one
/// accept through), and that is one run, not one per freed descriptor.
#[derive(Debug, Default)]
pub struct AcceptFailures {
    run: Option<Run>,
}

#[derive(Debug)]
struct Run {
    started: Instant,
    failures: u64,
    last_failure: Instant,
    logged_at: Instant,
    logged_failures: u64,
    wait: Duration,
    /// An accept went through since the last failure: the next wait starts over.
    accepted_since: bool,
}

/// What to log about a failed accept.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Say {
    /// Nothing: the run is summed up later.
    Nothing,
    /// The first failure of a run.
    First,
    /// A summary: `failures` more since the last line, over a run of `for_ms` so far.
    Still {
        /// Failures since the last line.
        failures: u64,
        /// How long the run has gone on.
        for_ms: u64,
    },
}

/// What a failed accept asks for: a line, and a wait before the next try.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Failed {
    /// What to log.
    pub say: Say,
    /// How long to wait before accepting again.
    pub wait: Duration,
}

/// A run of failures that ended with an accept.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Recovered {
    /// How many accepts failed.
    pub failures: u64,
    /// How long the run lasted, to its last failure.
    pub for_ms: u64,
}

impl AcceptFailures {
    /// An accept failed at `now`. A failure [`SUMMARY_EVERY`] or more after the last one
    /// starts a run of its own (the earlier one ended quietly, though no accept said so).
    pub fn failed(&mut self, now: Instant) -> Failed {
        if self
            .run
            .as_ref()
            .is_some_and(|run| now.saturating_duration_since(run.last_failure) >= SUMMARY_EVERY)
        {
            self.run = None;
        }
        let Some(run) = &mut self.run else {
            self.run = Some(Run {
                started: now,
                failures: 1,
                last_failure: now,
                logged_at: now,
                logged_failures: 1,
                wait: FIRST_WAIT,
                accepted_since: false,
            });
            return Failed {
                say: Say::First,
                wait: FIRST_WAIT,
            };
        };
        run.failures += 1;
        run.last_failure = now;
        run.wait = if std::mem::take(&mut run.accepted_since) {
            FIRST_WAIT
        } else {
            (run.wait * 2).min(MAX_WAIT)
        };
        let say = if now.saturating_duration_since(run.logged_at) >= SUMMARY_EVERY {
            let failures = run.failures - run.logged_failures;
            run.logged_at = now;
            run.logged_failures = run.failures;
            Say::Still {
                failures,
                for_ms: millis(now.saturating_duration_since(run.started)),
            }
        } else {
            Say::Nothing
        };
        Failed {
            say,
            wait: run.wait,
        }
    }

    /// An accept succeeded at `now`: the next failure waits [`FIRST_WAIT`] again, and a run
    /// with no failure for [`SUMMARY_EVERY`] ended.
    pub fn accepted(&mut self, now: Instant) -> Option<Recovered> {
        let run = self.run.as_mut()?;
        run.accepted_since = true;
        if now.saturating_duration_since(run.last_failure) < SUMMARY_EVERY {
            return None;
        }
        self.run.take().map(|run| Recovered {
            failures: run.failures,
            for_ms: millis(run.last_failure.saturating_duration_since(run.started)),
        })
    }
}

fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

/// Applies a failed accept of `listener` (`"HTTP"`, `"socket"`): logs what [`Failed::say`]
/// says, then waits.
pub async fn after_failure(failures: &mut AcceptFailures, listener: &str, error: &std::io::Error) {
    let failed = failures.failed(Instant::now());
    match failed.say {
        Say::Nothing => {}
        Say::First => tracing::warn!(
            listener,
            %error,
            "accepting a connection failed; trying again with a growing pause (at most 1 s), further failures summed up every 10 s"
        ),
        Say::Still { failures, for_ms } => tracing::warn!(
            listener,
            %error,
            failures,
            for_ms,
            "accepting connections still fails"
        ),
    }
    tokio::time::sleep(failed.wait).await;
}

/// Applies a successful accept of `listener`: logs the end of a run of failures.
pub fn after_success(failures: &mut AcceptFailures, listener: &str) {
    if let Some(Recovered { failures, for_ms }) = failures.accepted(Instant::now()) {
        tracing::info!(listener, failures, for_ms, "accepting connections again");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A run of failures: one line at once, waits doubling to the cap, a summary once
    /// [`SUMMARY_EVERY`] passed (counting what it did not say); accepts between failures keep
    /// the run (only the wait starts over); the first accept 10 s after the last failure ends
    /// it, saying how many failed; the next run starts afresh.
    #[test]
    fn a_run_of_failures_backs_off_says_little_and_ends_with_a_quiet_success() {
        let t0 = Instant::now();
        let mut failures = AcceptFailures::default();
        assert_eq!(failures.accepted(t0), None, "no run, nothing to say");
        assert_eq!(
            failures.failed(t0),
            Failed {
                say: Say::First,
                wait: FIRST_WAIT
            }
        );
        let mut waits = Vec::new();
        let mut at = t0;
        for _ in 0..6 {
            at += Duration::from_millis(100);
            let failed = failures.failed(at);
            assert_eq!(failed.say, Say::Nothing);
            waits.push(failed.wait.as_millis());
        }
        assert_eq!(waits, [100, 200, 400, 800, 1000, 1000]);
        // A freed descriptor lets one through: the run goes on, its wait starts over.
        assert_eq!(failures.accepted(at + Duration::from_millis(1)), None);
        let failed = failures.failed(at + Duration::from_millis(2));
        assert_eq!(
            failed,
            Failed {
                say: Say::Nothing,
                wait: FIRST_WAIT
            }
        );
        let later = t0 + SUMMARY_EVERY;
        assert_eq!(
            failures.failed(later).say,
            Say::Still {
                failures: 8,
                for_ms: 10_000
            },
            "the seven unsaid and this one"
        );
        assert_eq!(
            failures.failed(later + Duration::from_millis(1)).say,
            Say::Nothing,
            "not again before another 10 s"
        );
        assert_eq!(
            failures.accepted(later + Duration::from_secs(1)),
            None,
            "not quiet for long enough"
        );
        assert_eq!(
            failures.accepted(later + Duration::from_millis(1) + SUMMARY_EVERY),
            Some(Recovered {
                failures: 10,
                for_ms: 10_001
            })
        );
        let next = failures.failed(later + SUMMARY_EVERY * 2);
        assert_eq!(next.say, Say::First);
        assert_eq!(next.wait, FIRST_WAIT);
    }

    /// A failure long after the last one, with no accept since that said the run had ended
    /// (accepts came only right after it), starts a run of its own: it is not "still failing"
    /// for an hour. Just under the quiet span it still belongs to the run.
    #[test]
    fn a_failure_after_a_quiet_span_starts_a_new_run_even_without_an_accept_that_ended_the_last() {
        let t0 = Instant::now();
        let mut failures = AcceptFailures::default();
        assert_eq!(failures.failed(t0).say, Say::First);
        let just_under = t0 + SUMMARY_EVERY - Duration::from_millis(1);
        assert_eq!(failures.failed(just_under).say, Say::Nothing);
        assert_eq!(
            failures.accepted(just_under + Duration::from_millis(1)),
            None
        );
        let hour_later = just_under + Duration::from_secs(3600);
        assert_eq!(
            failures.failed(hour_later),
            Failed {
                say: Say::First,
                wait: FIRST_WAIT
            }
        );
        assert_eq!(
            failures
                .failed(hour_later + SUMMARY_EVERY - Duration::from_millis(1))
                .say,
            Say::Nothing,
            "just under the span: the same run"
        );
    }
}
