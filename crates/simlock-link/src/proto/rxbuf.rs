//! What a channel received and its reader has not read yet.
//!
//! DATA payloads are kept as they arrived: zero-copy slices of the transport's read buffers. Such
//! a slice keeps its whole read buffer alive (64–128 KiB, holding frames of several channels), so
//! a reader that stops reading would pin far more memory than its window. When the peer has used
//! up its credit — it can send nothing more until this reader reads — and more than
//! `LinkConfig::compact_after` bytes (64 KiB) wait, the waiting payloads are therefore copied into allocations of
//! their exact size (at most [`MAX_PIECE`] each): a stalled reader holds its own bytes only. A
//! reader that keeps ahead of its window is never copied; one caught at the end of a credit burst
//! is copied once, and the payloads after the next grant are kept as they arrive again.

use std::collections::VecDeque;

use bytes::{Bytes, BytesMut};

/// The largest allocation compaction makes (a grown window is copied into several).
pub(crate) const MAX_PIECE: usize = 1024 * 1024;

/// A channel's unread bytes, in order: `kept` first, then `frames`.
#[derive(Debug, Default)]
pub(crate) struct RxBuf {
    /// Compacted pieces: copies the size of their bytes.
    kept: VecDeque<Bytes>,
    /// Payloads as they arrived, after every one of `kept`.
    frames: VecDeque<Bytes>,
    /// Bytes in `frames`.
    in_frames: usize,
    len: usize,
}

impl RxBuf {
    /// Unread bytes.
    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// Appends `payload`; `room` is how many more bytes the peer may send after it (its
    /// remaining credit); waiting payloads are compacted when there is none and more than
    /// `compact_after` bytes wait.
    pub(crate) fn push(&mut self, payload: Bytes, room: usize, compact_after: usize) {
        if payload.is_empty() {
            return;
        }
        self.len += payload.len();
        self.in_frames += payload.len();
        self.frames.push_back(payload);
        if room == 0 && self.in_frames > compact_after {
            self.compact();
        }
    }

    /// Copies the payloads as they arrived into pieces of at most [`MAX_PIECE`] bytes.
    fn compact(&mut self) {
        let mut piece = BytesMut::with_capacity(self.in_frames.min(MAX_PIECE));
        let mut left = self.in_frames;
        for frame in self.frames.drain(..) {
            let mut rest = &frame[..];
            while !rest.is_empty() {
                let take = rest.len().min(MAX_PIECE - piece.len());
                piece.extend_from_slice(&rest[..take]);
                rest = &rest[take..];
                left -= take;
                if piece.len() == MAX_PIECE {
                    let full =
                        std::mem::replace(&mut piece, BytesMut::with_capacity(left.min(MAX_PIECE)));
                    self.kept.push_back(full.freeze());
                }
            }
        }
        if !piece.is_empty() {
            self.kept.push_back(piece.freeze());
        }
        self.in_frames = 0;
    }

    /// Takes up to `max` bytes from the front; `None` when nothing is buffered.
    pub(crate) fn take(&mut self, max: usize) -> Option<Bytes> {
        let (queue, from_frames) = if self.kept.is_empty() {
            (&mut self.frames, true)
        } else {
            (&mut self.kept, false)
        };
        let front = queue.front_mut()?;
        let chunk = if front.len() <= max {
            queue.pop_front()?
        } else {
            front.split_to(max)
        };
        if from_frames {
            self.in_frames -= chunk.len();
        }
        self.len -= chunk.len();
        Some(chunk)
    }

    /// Drops everything.
    pub(crate) fn clear(&mut self) {
        self.kept.clear();
        self.frames.clear();
        self.in_frames = 0;
        self.len = 0;
    }

    /// The bytes actually held, for the core's consistency check.
    pub(crate) fn counted(&self) -> usize {
        let frames: usize = self.frames.iter().map(Bytes::len).sum();
        debug_assert_eq!(frames, self.in_frames);
        self.kept.iter().map(Bytes::len).sum::<usize>() + frames
    }

    /// Whether some bytes were compacted (for tests).
    #[cfg(test)]
    pub(crate) fn is_compacted(&self) -> bool {
        !self.kept.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const COMPACT_AFTER: usize = crate::config::COMPACT_AFTER;

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

    /// Pushes `count` 16 KiB frames of a `window` the peer starts with `credit` of.
    fn fill(buf: &mut RxBuf, expected: &mut Vec<u8>, count: usize, credit: usize) -> usize {
        let mut room = credit;
        for n in 0..count {
            let payload = frame(n as u8, 16 * 1024);
            room -= payload.len();
            expected.extend_from_slice(&payload);
            buf.push(payload, room, COMPACT_AFTER);
            assert_eq!(buf.len(), buf.counted());
        }
        room
    }

    #[test]
    fn a_reader_that_keeps_up_gets_the_frames_as_they_came() {
        let mut buf = RxBuf::default();
        let first = frame(1, 16 * 1024);
        buf.push(first.clone(), 1 << 20, COMPACT_AFTER);
        let taken = buf.take(usize::MAX).unwrap();
        assert_eq!(taken.as_ptr(), first.as_ptr(), "zero-copy");
        assert!(buf.take(1).is_none());
        assert_eq!(buf.len(), 0);
    }

    #[test]
    fn a_full_window_is_copied_into_one_allocation_of_its_size() {
        let mut buf = RxBuf::default();
        let mut expected = Vec::new();
        let window = 256 * 1024;
        for n in 0..16usize {
            fill(&mut buf, &mut expected, 1, window - n * 16 * 1024);
            // Credit left: the reader may still catch up, nothing is copied.
            assert_eq!(buf.is_compacted(), n == 15, "after frame {n}");
        }
        assert_eq!(buf.frames.len(), 0, "the arrived frames were copied out");
        assert_eq!(buf.kept.len(), 1);
        assert_eq!(buf.kept[0].len(), window, "exactly the window");
        assert_eq!(buf.counted(), window);
        assert_eq!(drain(&mut buf, 10_000), expected);
        assert!(!buf.is_compacted());
    }

    #[test]
    fn after_a_grant_new_frames_are_kept_as_they_come_behind_the_copy() {
        let mut buf = RxBuf::default();
        let mut expected = Vec::new();
        fill(&mut buf, &mut expected, 16, 256 * 1024);
        assert!(buf.is_compacted());
        // The reader reads half; the grant of 128 KiB arrives as it is, behind the copy.
        let mut got = Vec::new();
        while got.len() < 128 * 1024 {
            got.extend_from_slice(&buf.take(128 * 1024 - got.len()).unwrap());
        }
        let fresh = frame(200, 16 * 1024);
        expected.extend_from_slice(&fresh);
        buf.push(fresh.clone(), 112 * 1024, COMPACT_AFTER);
        assert_eq!(
            buf.frames.back().unwrap().as_ptr(),
            fresh.as_ptr(),
            "not copied"
        );
        // Used up again: only the frames since the last copy are copied.
        fill(&mut buf, &mut expected, 7, 112 * 1024);
        assert_eq!(buf.kept.len(), 2);
        assert_eq!(buf.kept[1].len(), 128 * 1024);
        assert_eq!(buf.len(), 256 * 1024);
        got.extend(drain(&mut buf, 5000));
        assert!(got == expected, "every byte, in order");
    }

    #[test]
    fn a_grown_window_is_copied_in_pieces_of_at_most_a_mebibyte() {
        let mut buf = RxBuf::default();
        let mut expected = Vec::new();
        let window = 3 * MAX_PIECE + 96 * 1024;
        fill(&mut buf, &mut expected, window / (16 * 1024), window);
        let sizes: Vec<usize> = buf.kept.iter().map(Bytes::len).collect();
        assert_eq!(sizes, [MAX_PIECE, MAX_PIECE, MAX_PIECE, 96 * 1024]);
        assert_eq!(drain(&mut buf, usize::MAX), expected);
    }

    #[test]
    fn compaction_starts_one_byte_past_the_threshold() {
        let mut buf = RxBuf::default();
        buf.push(frame(1, COMPACT_AFTER - 100), 100, COMPACT_AFTER);
        buf.push(frame(2, 100), 0, COMPACT_AFTER);
        assert!(
            !buf.is_compacted(),
            "exactly the threshold waits: kept as it came"
        );
        let mut buf = RxBuf::default();
        buf.push(frame(1, COMPACT_AFTER - 100), 101, COMPACT_AFTER);
        buf.push(frame(2, 101), 0, COMPACT_AFTER);
        assert!(buf.is_compacted(), "one byte past it is copied");
        assert_eq!(buf.kept[0].len(), COMPACT_AFTER + 1);
    }

    #[test]
    fn a_small_buffer_is_never_copied_even_without_credit() {
        let mut buf = RxBuf::default();
        let payload = frame(1, 1000);
        buf.push(payload.clone(), 0, COMPACT_AFTER);
        assert!(!buf.is_compacted());
        assert_eq!(buf.take(usize::MAX).unwrap().as_ptr(), payload.as_ptr());
    }

    #[test]
    fn order_holds_across_copies_and_partial_reads_and_clear_empties() {
        let mut buf = RxBuf::default();
        let mut expected = Vec::new();
        let mut got = Vec::new();
        for n in 0..60u8 {
            let payload = frame(n, 5000 + usize::from(n) * 7);
            expected.extend_from_slice(&payload);
            // Every third payload uses up the credit.
            buf.push(payload, if n % 3 == 2 { 0 } else { 1 << 20 }, COMPACT_AFTER);
            if n % 4 == 0 {
                got.extend_from_slice(&buf.take(3000).unwrap());
            }
            assert_eq!(buf.len(), buf.counted());
        }
        got.extend(drain(&mut buf, 7777));
        assert!(got == expected);
        buf.push(Bytes::new(), 0, COMPACT_AFTER);
        buf.push(frame(1, 100_000), 0, COMPACT_AFTER);
        buf.clear();
        assert_eq!(buf.len(), 0);
        assert!(buf.take(1).is_none());
    }
}
