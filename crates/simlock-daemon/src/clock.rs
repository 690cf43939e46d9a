//! Time as an input. State machines take `now`; this is where `now` comes from.
//!
//! [`TokioClock`] reads wall time as the wall time at start plus the tokio clock's progress
//! since, so a test that pauses tokio time moves lease deadlines, timers and timestamps together.

use std::sync::Arc;
use std::time::Duration;

/// A source of wall time in milliseconds since the epoch.
pub trait Clock: Send + Sync + std::fmt::Debug + 'static {
    /// Now, in ms since the epoch.
    fn now_ms(&self) -> i64;
}

/// A shared clock.
pub type SharedClock = Arc<dyn Clock>;

/// Wall time that advances with tokio's clock.
#[derive(Debug, Clone, Copy)]
pub struct TokioClock {
    anchor_wall_ms: i64,
    anchor: tokio::time::Instant,
}

impl TokioClock {
    /// A clock reading the system's wall time now.
    pub fn system() -> Self {
        let wall = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX));
        Self::starting_at(wall)
    }

    /// A clock that reads `wall_ms` now.
    pub fn starting_at(wall_ms: i64) -> Self {
        Self {
            anchor_wall_ms: wall_ms,
            anchor: tokio::time::Instant::now(),
        }
    }

    /// The clock, shared.
    pub fn shared(self) -> SharedClock {
        Arc::new(self)
    }
}

impl Clock for TokioClock {
    fn now_ms(&self) -> i64 {
        let elapsed = tokio::time::Instant::now().saturating_duration_since(self.anchor);
        self.anchor_wall_ms
            .saturating_add(i64::try_from(elapsed.as_millis()).unwrap_or(i64::MAX))
    }
}

/// The tokio instant at which wall time `deadline_ms` arrives (now, if it has passed).
pub fn instant_at(clock: &dyn Clock, deadline_ms: i64) -> tokio::time::Instant {
    let wait = deadline_ms.saturating_sub(clock.now_ms()).max(0);
    tokio::time::Instant::now() + Duration::from_millis(u64::try_from(wait).unwrap_or(0))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn wall_time_follows_paused_tokio_time() {
        let clock = TokioClock::starting_at(1_000);
        assert_eq!(clock.now_ms(), 1_000);
        tokio::time::advance(Duration::from_millis(250)).await;
        assert_eq!(clock.now_ms(), 1_250);
        let at = instant_at(&clock, 2_000);
        tokio::time::sleep_until(at).await;
        assert_eq!(clock.now_ms(), 2_000);
    }
}
