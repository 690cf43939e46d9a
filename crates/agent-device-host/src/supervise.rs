//! When to start the daemon again: the supervision's decisions as plain data taking `now`.
//!
//! The shell ([`crate::process`]) spawns and watches the daemon and tells this machine what
//! happened; the machine answers what the host's status is and when the next start is due.
//! Time is the shell's: a [`Duration`] since it began supervising.
//! A start that fails, or a daemon that exits, waits a backoff that doubles from 500 ms to at
//! most 30 s; a daemon that ran a minute or more starts the count again.

use std::time::Duration;

/// The first wait after a failure.
pub const INITIAL_BACKOFF: Duration = Duration::from_millis(500);
/// The longest wait.
pub const MAX_BACKOFF: Duration = Duration::from_secs(30);
/// A daemon that ran this long resets the backoff.
pub const STABLE_AFTER: Duration = Duration::from_secs(60);

/// Where the daemon stands.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Phase {
    /// A start is under way.
    Starting,
    /// It runs, since `since`.
    Running {
        /// When it came up.
        since: Duration,
    },
    /// It is down; the next start is due at `retry_at`.
    Down {
        /// Why it is down.
        reason: String,
        /// When to start it again.
        retry_at: Duration,
    },
    /// Stopped for good (the worker is stopping).
    Stopped,
}

/// The supervision of one daemon.
#[derive(Debug, Clone)]
pub struct Supervision {
    phase: Phase,
    /// Failures in a row since the daemon last ran stably.
    failures: u32,
}

impl Default for Supervision {
    fn default() -> Self {
        Self::new()
    }
}

impl Supervision {
    /// A supervision about to make its first start.
    pub const fn new() -> Self {
        Self {
            phase: Phase::Starting,
            failures: 0,
        }
    }

    /// Where the daemon stands.
    pub const fn phase(&self) -> &Phase {
        &self.phase
    }

    /// The daemon came up at `now`.
    pub fn handle_started(&mut self, now: Duration) {
        if self.phase != Phase::Stopped {
            self.phase = Phase::Running { since: now };
        }
    }

    /// A start failed, or the running daemon went away, at `now`, because of `reason`.
    /// Answers when the next start is due.
    pub fn handle_down(&mut self, now: Duration, reason: impl Into<String>) -> Option<Duration> {
        if self.phase == Phase::Stopped {
            return None;
        }
        if let Phase::Running { since } = self.phase
            && now.saturating_sub(since) >= STABLE_AFTER
        {
            self.failures = 0;
        }
        let delay = backoff(self.failures);
        self.failures = self.failures.saturating_add(1);
        let retry_at = now + delay;
        self.phase = Phase::Down {
            reason: reason.into(),
            retry_at,
        };
        Some(retry_at)
    }

    /// Time passed to `now`: whether a start is due (the phase becomes `Starting`).
    pub fn handle_timeout(&mut self, now: Duration) -> bool {
        match self.phase {
            Phase::Down { retry_at, .. } if now >= retry_at => {
                self.phase = Phase::Starting;
                true
            }
            _ => false,
        }
    }

    /// When the machine next wants [`Self::handle_timeout`].
    pub fn poll_timeout(&self) -> Option<Duration> {
        match self.phase {
            Phase::Down { retry_at, .. } => Some(retry_at),
            _ => None,
        }
    }

    /// The worker is stopping: nothing starts again.
    pub fn handle_stop(&mut self) {
        self.phase = Phase::Stopped;
    }
}

/// The wait after `failures` failures in a row: 500 ms, 1 s, 2 s, … 30 s.
pub fn backoff(failures: u32) -> Duration {
    INITIAL_BACKOFF
        .checked_mul(1u32.checked_shl(failures.min(16)).unwrap_or(u32::MAX))
        .map_or(MAX_BACKOFF, |d| d.min(MAX_BACKOFF))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_backoff_doubles_up_to_its_cap() {
        assert_eq!(backoff(0), Duration::from_millis(500));
        assert_eq!(backoff(1), Duration::from_secs(1));
        assert_eq!(backoff(5), Duration::from_secs(16));
        assert_eq!(backoff(6), MAX_BACKOFF, "32 s is past the cap");
        assert_eq!(backoff(u32::MAX), MAX_BACKOFF);
    }

    #[test]
    fn failures_wait_longer_each_time_and_a_start_is_due_at_its_time_not_before() {
        let t0 = Duration::from_secs(100);
        let mut s = Supervision::new();
        let first = s.handle_down(t0, "exited").unwrap();
        assert_eq!(first, t0 + Duration::from_millis(500));
        assert!(!s.handle_timeout(first - Duration::from_millis(1)));
        assert!(s.handle_timeout(first));
        assert_eq!(s.phase(), &Phase::Starting);
        let second = s.handle_down(first, "exited").unwrap();
        assert_eq!(second, first + Duration::from_secs(1));
    }

    #[test]
    fn a_daemon_that_ran_stably_resets_the_backoff() {
        let t0 = Duration::from_secs(100);
        let mut s = Supervision::new();
        for _ in 0..4 {
            let at = s.handle_down(t0, "x").unwrap();
            assert!(s.handle_timeout(at));
        }
        s.handle_started(t0);
        let briefly = s.handle_down(t0 + Duration::from_secs(59), "x").unwrap();
        assert_eq!(
            briefly,
            t0 + Duration::from_secs(59) + Duration::from_secs(8),
            "the fifth wait"
        );
        assert!(s.handle_timeout(briefly));
        s.handle_started(briefly);
        let later = briefly + STABLE_AFTER;
        assert_eq!(s.handle_down(later, "x"), Some(later + INITIAL_BACKOFF));
    }

    #[test]
    fn a_stopped_supervision_never_starts_again() {
        let t0 = Duration::from_secs(100);
        let mut s = Supervision::new();
        s.handle_stop();
        assert_eq!(s.handle_down(t0, "x"), None);
        s.handle_started(t0);
        assert_eq!(s.phase(), &Phase::Stopped);
        assert!(!s.handle_timeout(t0 + MAX_BACKOFF));
        assert_eq!(s.poll_timeout(), None);
    }
}
