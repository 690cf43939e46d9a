//! Holds: a test names a command (`open`, `snapshot`, `lease_allocate`, …) and every call of it
//! that passes its checks waits there until the test releases the hold, so the test can keep a
//! command running while (virtual) time passes. A call whose client hangs up stops waiting.

use std::collections::BTreeMap;
use std::sync::Arc;

use parking_lot::Mutex;
use serde::Serialize;
use tokio::sync::watch;

/// Where a hold stands.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct HoldStatus {
    /// The hold's id.
    pub id: u64,
    /// The command it holds.
    pub command: String,
    /// How many calls wait on it now.
    pub waiting: usize,
    /// How many calls have reached it in all.
    pub entered: u64,
    /// Whether it was released.
    pub released: bool,
}

#[derive(Debug, Default)]
struct Book {
    next: u64,
    holds: BTreeMap<u64, HoldStatus>,
}

/// Every hold of one fake.
#[derive(Debug)]
pub(crate) struct Holds {
    book: Mutex<Book>,
    changed: watch::Sender<u64>,
}

impl Holds {
    pub(crate) fn new() -> Self {
        Self {
            book: Mutex::new(Book::default()),
            changed: watch::Sender::new(0),
        }
    }

    fn bump(&self) {
        self.changed.send_modify(|n| *n = n.wrapping_add(1));
    }

    /// A new hold on `command`.
    pub(crate) fn add(&self, command: &str) -> u64 {
        let mut book = self.book.lock();
        let id = book.next;
        book.next += 1;
        book.holds.insert(
            id,
            HoldStatus {
                id,
                command: command.to_owned(),
                waiting: 0,
                entered: 0,
                released: false,
            },
        );
        id
    }

    /// Releases a hold; whether it exists.
    pub(crate) fn release(&self, id: u64) -> bool {
        let found = self
            .book
            .lock()
            .holds
            .get_mut(&id)
            .map(|hold| hold.released = true)
            .is_some();
        self.bump();
        found
    }

    pub(crate) fn status(&self, id: u64) -> Option<HoldStatus> {
        self.book.lock().holds.get(&id).cloned()
    }

    pub(crate) fn list(&self) -> Vec<HoldStatus> {
        self.book.lock().holds.values().cloned().collect()
    }

    /// Waits while an unreleased hold names `command`.
    pub(crate) async fn pass(self: &Arc<Self>, command: &str) {
        let mut changes = self.changed.subscribe();
        let id = {
            let mut book = self.book.lock();
            let Some(hold) = book
                .holds
                .values_mut()
                .find(|h| !h.released && h.command == command)
            else {
                return;
            };
            hold.entered += 1;
            hold.waiting += 1;
            hold.id
        };
        self.bump();
        // Counts the call out again however it ends (released, or its client hung up).
        let _waiting = Waiting {
            holds: self.clone(),
            id,
        };
        loop {
            if self.status(id).is_none_or(|h| h.released) {
                return;
            }
            if changes.changed().await.is_err() {
                return;
            }
        }
    }

    /// Waits until no call waits on hold `id` (or it is gone).
    pub(crate) async fn wait_none_waiting(&self, id: u64) {
        let mut changes = self.changed.subscribe();
        loop {
            if self.status(id).is_none_or(|h| h.waiting == 0) {
                return;
            }
            if changes.changed().await.is_err() {
                return;
            }
        }
    }

    /// Waits until `n` calls have reached hold `id` (or it is gone).
    pub(crate) async fn wait_entered(&self, id: u64, n: u64) {
        let mut changes = self.changed.subscribe();
        loop {
            if self.status(id).is_none_or(|h| h.entered >= n) {
                return;
            }
            if changes.changed().await.is_err() {
                return;
            }
        }
    }
}

struct Waiting {
    holds: Arc<Holds>,
    id: u64,
}

impl Drop for Waiting {
    fn drop(&mut self) {
        if let Some(hold) = self.holds.book.lock().holds.get_mut(&self.id) {
            hold.waiting = hold.waiting.saturating_sub(1);
        }
        self.holds.bump();
    }
}

/// A hold on a command, made by [`crate::FakeAgentDevice::hold_commands`]. Calls of the command
/// wait until [`CommandHold::release`] or until the hold is dropped.
#[derive(Debug)]
pub struct CommandHold {
    holds: Arc<Holds>,
    id: u64,
}

impl CommandHold {
    pub(crate) fn new(holds: Arc<Holds>, command: &str) -> Self {
        let id = holds.add(command);
        Self { holds, id }
    }

    /// The hold's id (the same as in the control API).
    pub fn id(&self) -> u64 {
        self.id
    }

    /// How many calls wait on it now.
    pub fn waiting(&self) -> usize {
        self.holds.status(self.id).map_or(0, |h| h.waiting)
    }

    /// How many calls have reached it in all.
    pub fn entered(&self) -> u64 {
        self.holds.status(self.id).map_or(0, |h| h.entered)
    }

    /// Waits until `n` calls have reached it in all.
    pub async fn wait_entered(&self, n: u64) {
        self.holds.wait_entered(self.id, n).await;
    }

    /// Waits until no call waits on it (each was let through, or its client hung up).
    pub async fn wait_none_waiting(&self) {
        self.holds.wait_none_waiting(self.id).await;
    }

    /// Lets every waiting and later call through.
    pub fn release(self) {
        drop(self);
    }
}

impl Drop for CommandHold {
    fn drop(&mut self) {
        self.holds.release(self.id);
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    #[tokio::test(start_paused = true)]
    async fn a_held_command_waits_until_release() {
        let holds = Arc::new(Holds::new());
        let hold = CommandHold::new(holds.clone(), "open");
        let passing = {
            let holds = holds.clone();
            tokio::spawn(async move { holds.pass("open").await })
        };
        hold.wait_entered(1).await;
        assert_eq!(hold.waiting(), 1);
        // Another command is not held.
        holds.pass("close").await;
        tokio::time::sleep(Duration::from_secs(3600)).await;
        assert!(!passing.is_finished(), "still held an hour later");
        hold.release();
        passing.await.unwrap();
        assert_eq!(holds.list()[0].waiting, 0);
        assert!(holds.list()[0].released);
        // A released hold no longer holds.
        holds.pass("open").await;
    }

    #[tokio::test(start_paused = true)]
    async fn a_caller_that_leaves_is_counted_out() {
        let holds = Arc::new(Holds::new());
        let hold = CommandHold::new(holds.clone(), "snapshot");
        let passing = {
            let holds = holds.clone();
            tokio::spawn(async move { holds.pass("snapshot").await })
        };
        hold.wait_entered(1).await;
        passing.abort();
        let _ = passing.await;
        assert_eq!(hold.waiting(), 0);
        assert_eq!(hold.entered(), 1);
    }

    #[test]
    fn releasing_an_unknown_hold_says_so() {
        let holds = Holds::new();
        assert!(!holds.release(7));
        let id = holds.add("x");
        assert!(holds.release(id));
        assert!(holds.status(id).is_some_and(|h| h.released));
    }
}
