//! What a channel received and its reader has not read yet.
//!
//! While the reader keeps up, DATA payloads are kept as they arrived: zero-copy slices of the
//! transport's read buffers. Such a slice keeps its whole read buffer alive, and a read buffer
//! holds frames of several channels, so a reader that stops reading would pin far more memory
//! than its window. Once the peer has used up its credit (the reader is half a window or more
//! behind: one that keeps up is granted more before that) and more than [`COMPACT_AFTER`] bytes
//! wait, the buffered bytes are therefore copied into one allocation, and later payloads are
//! appended to allocations sized for what the peer may still send: a stalled reader holds its own
//! bytes, and only while it is behind; a reader that keeps up costs no copy.

use std::collections::VecDeque;

use bytes::{Bytes, BytesMut};

/// The least a reader must be behind for its buffer to be compacted: four full DATA frames.
pub(crate) const COMPACT_AFTER: usize = 64 * 1024;

/// The largest allocation one compacted stretch takes at once (a grown window fills several).
const MAX_STRETCH: usize = 1024 * 1024;

/// A channel's unread bytes, in order: `frames` first, then `tail`.
#[derive(Debug, Default)]
pub(crate) struct RxBuf {
    /// Payloads as they arrived, and earlier compacted stretches.
    frames: VecDeque<Bytes>,
    /// The compacted stretch being filled: bytes after every one of `frames`. Empty (and holding
    /// no allocation) while the reader keeps up.
    tail: BytesMut,
    len: usize,
}

impl RxBuf {
    /// Unread bytes.
    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// Appends `payload`; `room` is how many more bytes the peer may send after it (its
    /// remaining credit), which sizes a compacted stretch.
    pub(crate) fn push(&mut self, payload: Bytes, room: usize) {
        if payload.is_empty() {
            return;
        }
        self.len += payload.len();
        if self.tail.is_empty() && (room > 0 || self.len <= COMPACT_AFTER) {
            self.frames.push_back(payload);
            return;
        }
        let spare = self.tail.capacity() - self.tail.len();
        if spare < payload.len() {
            let stretch = |at_least: usize| at_least.max((at_least + room).min(MAX_STRETCH));
            let fresh = if self.tail.is_empty() {
                // The reader fell behind: copy what waits out of the transport's buffers.
                let waiting = self.len - payload.len();
                let mut fresh = BytesMut::with_capacity(stretch(self.len));
                for frame in self.frames.drain(..) {
                    fresh.extend_from_slice(&frame);
                }
                debug_assert_eq!(fresh.len(), waiting);
                fresh
            } else {
                // The stretch is full: it joins the frames, in order, and a new one starts.
                let full = std::mem::take(&mut self.tail).freeze();
                self.frames.push_back(full);
                BytesMut::with_capacity(stretch(payload.len()))
            };
            self.tail = fresh;
        }
        self.tail.extend_from_slice(&payload);
    }

    /// Takes up to `max` bytes from the front; `None` when nothing is buffered.
    pub(crate) fn take(&mut self, max: usize) -> Option<Bytes> {
        let chunk = if let Some(front) = self.frames.front_mut() {
            if front.len() <= max {
                self.frames.pop_front()?
            } else {
                front.split_to(max)
            }
        } else if self.tail.is_empty() {
            return None;
        } else {
            let chunk = self.tail.split_to(max.min(self.tail.len())).freeze();
            if self.tail.is_empty() {
                // Caught up: let go of the stretch (the reader's slices keep what they use).
                self.tail = BytesMut::new();
            }
            chunk
        };
        self.len -= chunk.len();
        Some(chunk)
    }

    /// Drops everything.
    pub(crate) fn clear(&mut self) {
        self.frames.clear();
        self.tail = BytesMut::new();
        self.len = 0;
    }

    /// The bytes actually held, for the core's consistency check.
    pub(crate) fn counted(&self) -> usize {
        self.frames.iter().map(Bytes::len).sum::<usize>() + self.tail.len()
    }

    /// Whether the buffer holds a compacted stretch (for tests).
    #[cfg(test)]
    pub(crate) fn is_compacted(&self) -> bool {
        !self.tail.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn frame(byte: u8, len: usize) -> Bytes {
        Bytes::from(vec![byte; len])
    }

    fn drain(buf: &mut RxBuf, max: usize) -> Vec<u8> {
        let mut out = Vec::new();
        while let Some(chunk) = buf.take(max) {
            assert!(!chunk.is_empty() && chunk.len() <= max);
            out.extend_from_slice(&chunk);
        }
        out
    }

    #[test]
    fn a_reader_that_keeps_up_gets_the_frames_as_they_came() {
        let mut buf = RxBuf::default();
        let first = frame(1, 16 * 1024);
        buf.push(first.clone(), 1 << 20);
        let taken = buf.take(usize::MAX).unwrap();
        assert_eq!(taken.as_ptr(), first.as_ptr(), "zero-copy");
        assert!(buf.take(1).is_none());
        assert_eq!(buf.len(), 0);
    }

    #[test]
    fn a_full_window_is_compacted_into_one_allocation_of_its_size() {
        let mut buf = RxBuf::default();
        let mut expected = Vec::new();
        let window = 256 * 1024;
        let mut received = 0;
        for n in 0..16u8 {
            let payload = frame(n, 16 * 1024);
            received += payload.len();
            expected.extend_from_slice(&payload);
            buf.push(payload, window - received);
            // Credit left: the reader may still catch up, nothing is copied.
            assert_eq!(
                buf.is_compacted(),
                received == window,
                "after {received} bytes"
            );
        }
        assert_eq!(buf.frames.len(), 0, "the arrived frames were copied out");
        assert_eq!(buf.tail.capacity(), window, "exactly the window");
        assert_eq!(buf.len(), window);
        assert_eq!(buf.counted(), window);
        assert_eq!(drain(&mut buf, 10_000), expected);
        assert!(!buf.is_compacted());
        assert_eq!(buf.tail.capacity(), 0, "the stretch is let go once read");
    }

    #[test]
    fn after_a_grant_a_behind_reader_gets_stretches_sized_by_the_new_credit() {
        let mut buf = RxBuf::default();
        for n in 0..16u8 {
            buf.push(frame(n, 16 * 1024), (15 - usize::from(n)) * 16 * 1024);
        }
        assert!(buf.is_compacted());
        // The reader reads half; the grant gives 128 KiB more, which arrives.
        let half = drain_up_to(&mut buf, 128 * 1024);
        assert_eq!(half, 128 * 1024);
        for n in 0..8u8 {
            buf.push(frame(n, 16 * 1024), (7 - usize::from(n)) * 16 * 1024);
        }
        assert_eq!(buf.len(), 256 * 1024);
        assert_eq!(buf.counted(), 256 * 1024);
        assert!(
            buf.tail.capacity() <= 128 * 1024,
            "a stretch for the new credit only"
        );
    }

    #[test]
    fn a_small_buffer_is_never_copied_even_without_credit() {
        let mut buf = RxBuf::default();
        let payload = frame(1, 1000);
        buf.push(payload.clone(), 0);
        assert!(!buf.is_compacted());
        assert_eq!(buf.take(usize::MAX).unwrap().as_ptr(), payload.as_ptr());
    }

    fn drain_up_to(buf: &mut RxBuf, max: usize) -> usize {
        let mut read = 0;
        while read < max {
            match buf.take(max - read) {
                Some(chunk) => read += chunk.len(),
                None => break,
            }
        }
        read
    }

    #[test]
    fn order_holds_across_full_stretches_and_partial_reads() {
        let mut buf = RxBuf::default();
        let mut expected = Vec::new();
        let mut got = Vec::new();
        // No room beyond each payload: every stretch fills at once.
        for n in 0..40u8 {
            let payload = frame(n, 5000 + usize::from(n) * 7);
            expected.extend_from_slice(&payload);
            buf.push(payload, 0);
            if n % 3 == 0 {
                got.extend_from_slice(&buf.take(3000).unwrap());
            }
            assert_eq!(buf.len(), buf.counted());
        }
        got.extend(drain(&mut buf, 7777));
        assert_eq!(got, expected);
    }

    #[test]
    fn a_stretch_never_exceeds_its_cap_and_empty_payloads_are_ignored() {
        let mut buf = RxBuf::default();
        buf.push(Bytes::new(), 0);
        assert!(buf.take(1).is_none());
        for n in 0..5u8 {
            buf.push(frame(n, 16 * 1024), 0);
        }
        assert!(buf.is_compacted());
        // A huge grant: the next stretch is capped.
        buf.push(frame(9, 16 * 1024), 64 << 20);
        assert_eq!(buf.tail.capacity(), MAX_STRETCH);
        assert_eq!(buf.len(), 6 * 16 * 1024);
        buf.clear();
        assert_eq!(buf.len(), 0);
        assert!(buf.take(1).is_none());
    }
}
