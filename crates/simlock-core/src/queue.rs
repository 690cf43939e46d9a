//! The FIFO wait queue of lease requests, as plain data taking `now`.
//!
//! A waiter is `new` while admission walks it, `queued` while it waits, and `processing` once
//! device work started for it; it leaves the queue when granted or failed. Its deadline
//! (`timeoutMs`) is fixed the first time it is queued and never reset when it is queued
//! again; a deadline that passes while it is processing is enforced the next time it is
//! queued or picked.

use simlock_contract::event::GrantSource;
use simlock_contract::ids::RequestId;
use simlock_contract::model::{DeviceSpec, RequestedDevice};
use simlock_contract::push::{Progress, WaitingFor};

/// Where a waiter is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Stage {
    /// Being admitted.
    New,
    /// Waiting for a device.
    Queued,
    /// Device work started for it; not cancellable.
    Processing,
}

/// How a device came to a request (`lease.granted.source`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Source {
    /// A ready device (possibly after its reclaim finished).
    Warm,
    /// A shutdown device, booted.
    Booted,
    /// A new device.
    Provisioned,
}

impl Source {
    /// How `lease.granted` tells it.
    pub(crate) const fn event(self) -> GrantSource {
        match self {
            Self::Warm => GrantSource::Warm,
            Self::Booted => GrantSource::Booted,
            Self::Provisioned => GrantSource::Provisioned,
        }
    }
}

/// The device work under way for a processing waiter.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Pending {
    /// How it will have come.
    pub source: Source,
    /// How long it was expected to take when it started.
    pub eta_ms: u64,
}

/// What a waiter's lease will be.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct LeaseTerms {
    /// Its width.
    pub ttl_ms: u64,
    /// Who may renew and release it.
    pub owner_id: String,
    /// The id it must have.
    pub chosen_id: Option<String>,
}

/// One request without a device yet.
#[derive(Debug, Clone)]
pub(crate) struct Waiter {
    pub id: RequestId,
    pub requester_id: String,
    pub spec: DeviceSpec,
    pub requested: RequestedDevice,
    pub terms: LeaseTerms,
    pub no_wait: bool,
    pub timeout_ms: Option<u64>,
    /// Fixed at first queueing.
    pub deadline: Option<i64>,
    pub stage: Stage,
    pub created_at: i64,
    /// Device work attempts that failed.
    pub failures: u32,
    /// The device work under way (processing only).
    pub pending: Option<Pending>,
    /// The queue position it was last told, while queued.
    pub told_position: Option<u32>,
    /// Why it gets no device, as it was last told, while queued.
    pub told_waiting: Option<WaitingFor>,
    /// The last progress its callers were told: what a caller that joins it later (an
    /// idempotent repeat) is told at once.
    pub told: Option<Progress>,
}

/// The waiter's deadline passed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct TimedOut;

/// The queue, oldest first.
#[derive(Debug, Default)]
pub(crate) struct WaitQueue {
    list: Vec<Waiter>,
    /// Whether a waiter left since [`Self::moved`] last looked (only a removal moves others).
    reordered: bool,
}

impl WaitQueue {
    /// Adds a waiter at the tail.
    pub(crate) fn push(&mut self, waiter: Waiter) {
        self.list.push(waiter);
    }

    pub(crate) fn get(&self, id: &RequestId) -> Option<&Waiter> {
        self.list.iter().find(|w| &w.id == id)
    }

    pub(crate) fn get_mut(&mut self, id: &RequestId) -> Option<&mut Waiter> {
        self.list.iter_mut().find(|w| &w.id == id)
    }

    pub(crate) fn remove(&mut self, id: &RequestId) -> Option<Waiter> {
        let index = self.list.iter().position(|w| &w.id == id)?;
        self.reordered = true;
        Some(self.list.remove(index))
    }

    /// Marks a waiter queued, fixing its deadline the first time. Answers its position.
    pub(crate) fn enqueue(&mut self, id: &RequestId, now: i64) -> Option<Result<u32, TimedOut>> {
        let waiter = self.get_mut(id)?;
        let deadline = match (waiter.deadline, waiter.timeout_ms) {
            (Some(d), _) => Some(d),
            (None, Some(t)) => Some(now.saturating_add(i64::try_from(t).unwrap_or(i64::MAX))),
            (None, None) => None,
        };
        waiter.deadline = deadline;
        if deadline.is_some_and(|d| d <= now) {
            return Some(Err(TimedOut));
        }
        waiter.stage = Stage::Queued;
        let index = self.list.iter().position(|w| &w.id == id)?;
        let position = u32::try_from(index + 1).ok()?;
        self.list[index].told_position = Some(position);
        Some(Ok(position))
    }

    /// The queued waiters whose place changed since they were last told (one ahead of them was
    /// granted, cancelled or timed out), each with its place now, which it is now told.
    pub(crate) fn moved(&mut self) -> Vec<(RequestId, u32)> {
        let mut moved = Vec::new();
        if !std::mem::take(&mut self.reordered) {
            return moved;
        }
        for (index, waiter) in self.list.iter_mut().enumerate() {
            let position = u32::try_from(index + 1).unwrap_or(u32::MAX);
            if waiter.stage == Stage::Queued && waiter.told_position != Some(position) {
                waiter.told_position = Some(position);
                moved.push((waiter.id.clone(), position));
            }
        }
        moved
    }

    /// Marks a waiter processing (device work starts), unless its deadline passed.
    pub(crate) fn mark_processing(
        &mut self,
        id: &RequestId,
        now: i64,
    ) -> Option<Result<(), TimedOut>> {
        let waiter = self.get_mut(id)?;
        if waiter.deadline.is_some_and(|d| d <= now) {
            return Some(Err(TimedOut));
        }
        waiter.stage = Stage::Processing;
        Some(Ok(()))
    }

    /// 1-based place in the FIFO, counting waiters ahead that are already processing.
    pub(crate) fn position(&self, id: &RequestId) -> Option<u32> {
        let index = self.list.iter().position(|w| &w.id == id)?;
        u32::try_from(index + 1).ok()
    }

    /// Waiters that are queued (the queue depth).
    pub(crate) fn depth(&self) -> u32 {
        let n = self
            .list
            .iter()
            .filter(|w| w.stage == Stage::Queued)
            .count();
        u32::try_from(n).unwrap_or(u32::MAX)
    }

    /// The waiter of `requester`, whatever its stage.
    pub(crate) fn of_requester(&self, requester: &str) -> Option<&Waiter> {
        self.list.iter().find(|w| w.requester_id == requester)
    }

    /// Whether a waiter will take `lease_id`.
    pub(crate) fn holds_chosen_id(&self, lease_id: &str) -> bool {
        self.list
            .iter()
            .any(|w| w.terms.chosen_id.as_deref() == Some(lease_id))
    }

    /// Ids of waiters that may be picked (new or queued), oldest first.
    pub(crate) fn pickable(&self) -> Vec<RequestId> {
        self.list
            .iter()
            .filter(|w| matches!(w.stage, Stage::New | Stage::Queued))
            .map(|w| w.id.clone())
            .collect()
    }

    /// Queued waiters whose deadline passed.
    pub(crate) fn due(&self, now: i64) -> Vec<RequestId> {
        self.list
            .iter()
            .filter(|w| w.stage == Stage::Queued && w.deadline.is_some_and(|d| d <= now))
            .map(|w| w.id.clone())
            .collect()
    }

    /// The earliest deadline of a queued waiter.
    pub(crate) fn next_deadline(&self) -> Option<i64> {
        self.list
            .iter()
            .filter(|w| w.stage == Stage::Queued)
            .filter_map(|w| w.deadline)
            .min()
    }

    /// Every waiter, oldest first.
    pub(crate) fn iter(&self) -> impl Iterator<Item = &Waiter> {
        self.list.iter()
    }
}

#[cfg(test)]
mod tests {
    use simlock_contract::model::Platform;

    use super::*;

    fn waiter(n: u32, timeout_ms: Option<u64>) -> Waiter {
        Waiter {
            id: RequestId::from_raw(format!("req_{n}")),
            requester_id: format!("agent-{n}"),
            spec: DeviceSpec {
                platform: Platform::Ios,
                model: "iPhone 16".into(),
                os_version: "18.2".into(),
            },
            requested: RequestedDevice {
                platform: Platform::Ios,
                model: None,
                os_version: None,
                requires: vec![],
            },
            terms: LeaseTerms {
                ttl_ms: 1000,
                owner_id: format!("agent-{n}"),
                chosen_id: None,
            },
            no_wait: false,
            timeout_ms,
            deadline: None,
            stage: Stage::New,
            created_at: 0,
            failures: 0,
            pending: None,
            told_position: None,
            told_waiting: None,
            told: None,
        }
    }

    #[test]
    fn positions_are_fifo_and_count_processing_waiters_ahead() {
        let mut q = WaitQueue::default();
        for n in 1..=3 {
            q.push(waiter(n, None));
        }
        let id = |n: u32| RequestId::from_raw(format!("req_{n}"));
        assert_eq!(q.mark_processing(&id(1), 0), Some(Ok(())));
        assert_eq!(q.enqueue(&id(2), 0), Some(Ok(2)));
        assert_eq!(q.enqueue(&id(3), 0), Some(Ok(3)));
        assert_eq!(q.depth(), 2);
        assert_eq!(q.pickable(), vec![id(2), id(3)]);
        q.remove(&id(1));
        assert_eq!(q.position(&id(3)), Some(2));
    }

    #[test]
    fn a_queued_waiter_is_told_its_new_place_once_when_one_ahead_leaves() {
        let mut q = WaitQueue::default();
        for n in 1..=3 {
            q.push(waiter(n, None));
        }
        let id = |n: u32| RequestId::from_raw(format!("req_{n}"));
        for n in 1..=3 {
            assert_eq!(q.enqueue(&id(n), 0), Some(Ok(n)));
        }
        assert!(q.moved().is_empty(), "each was told its place on queueing");
        q.remove(&id(2));
        assert_eq!(q.moved(), vec![(id(3), 2)]);
        assert!(q.moved().is_empty(), "told once");
        // A waiter ahead that starts processing keeps its place: nothing moves.
        assert_eq!(q.mark_processing(&id(1), 0), Some(Ok(())));
        assert!(q.moved().is_empty());
        q.remove(&id(1));
        assert_eq!(q.moved(), vec![(id(3), 1)]);
    }

    #[test]
    fn the_deadline_is_fixed_at_first_queueing() {
        let mut q = WaitQueue::default();
        q.push(waiter(1, Some(10_000)));
        let id = RequestId::from_raw("req_1");
        assert_eq!(q.enqueue(&id, 1_000), Some(Ok(1)));
        assert_eq!(q.next_deadline(), Some(11_000));
        // Picked at 6 s, work fails, queued again at 8 s: the deadline stays at 11 s.
        assert_eq!(q.mark_processing(&id, 6_000), Some(Ok(())));
        assert_eq!(
            q.next_deadline(),
            None,
            "a processing waiter has no live timer"
        );
        assert!(q.due(20_000).is_empty(), "a processing waiter is never due");
        assert_eq!(q.enqueue(&id, 8_000), Some(Ok(1)));
        assert_eq!(q.get(&id).unwrap().deadline, Some(11_000));
        assert_eq!(q.due(10_999), Vec::<RequestId>::new());
        assert_eq!(q.due(11_000), vec![id.clone()]);
        // Picked again at 10 s, failed again at 12 s: queueing now times out.
        assert_eq!(q.mark_processing(&id, 10_000), Some(Ok(())));
        assert_eq!(q.enqueue(&id, 12_000), Some(Err(TimedOut)));
        assert_eq!(q.mark_processing(&id, 12_000), Some(Err(TimedOut)));
    }
}
