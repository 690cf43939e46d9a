//! Newline-delimited framing over bytes: one frame per line, with a length cap.
//!
//! A line longer than the cap is never buffered: its bytes are dropped as they arrive and,
//! once its newline comes, the decoder yields [`Line::TooLong`] so the session can answer
//! `BAD_FRAME` and go on reading. Blank lines are skipped.

use bytes::{Buf, Bytes, BytesMut};
use tokio_util::codec::{Decoder, Encoder};

/// One item read from a line-delimited stream.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Line {
    /// A complete line, without its newline.
    Frame(Bytes),
    /// A line longer than the cap; its bytes were dropped.
    TooLong,
}

/// Splits bytes into lines of at most `max` bytes (newline excluded).
#[derive(Debug, Clone)]
pub struct LineCodec {
    max: usize,
    /// How much of the buffer is known to hold no newline, so each byte is scanned once.
    scanned: usize,
    /// Inside a line that went over the cap: drop bytes up to its newline.
    discarding: bool,
}

impl LineCodec {
    /// A codec accepting lines of at most `max` bytes.
    pub const fn new(max: usize) -> Self {
        Self {
            max,
            scanned: 0,
            discarding: false,
        }
    }

    /// The cap.
    pub const fn max(&self) -> usize {
        self.max
    }
}

impl Decoder for LineCodec {
    type Item = Line;
    type Error = std::io::Error;

    fn decode(&mut self, buf: &mut BytesMut) -> Result<Option<Line>, Self::Error> {
        loop {
            let start = self.scanned.min(buf.len());
            let Some(offset) = buf[start..].iter().position(|b| *b == b'\n') else {
                if self.discarding {
                    buf.clear();
                    self.scanned = 0;
                } else if buf.len() > self.max + usize::from(buf.last() == Some(&b'\r')) {
                    // A line at the cap may wait for its newline behind its `\r`.
                    self.discarding = true;
                    buf.clear();
                    self.scanned = 0;
                } else {
                    self.scanned = buf.len();
                }
                return Ok(None);
            };
            let end = start + offset;
            self.scanned = 0;
            if self.discarding {
                buf.advance(end + 1);
                self.discarding = false;
                return Ok(Some(Line::TooLong));
            }
            let mut line = buf.split_to(end + 1);
            line.truncate(end);
            if line.last() == Some(&b'\r') {
                line.truncate(end - 1);
            }
            if line.len() > self.max {
                return Ok(Some(Line::TooLong));
            }
            if line.iter().all(u8::is_ascii_whitespace) {
                continue;
            }
            return Ok(Some(Line::Frame(line.freeze())));
        }
    }

    fn decode_eof(&mut self, buf: &mut BytesMut) -> Result<Option<Line>, Self::Error> {
        if let Some(line) = self.decode(buf)? {
            return Ok(Some(line));
        }
        // A last line without its newline still counts.
        if self.discarding {
            self.discarding = false;
            buf.clear();
            return Ok(Some(Line::TooLong));
        }
        if buf.is_empty() || buf.iter().all(u8::is_ascii_whitespace) {
            buf.clear();
            return Ok(None);
        }
        self.scanned = 0;
        Ok(Some(Line::Frame(buf.split().freeze())))
    }
}

impl Encoder<Bytes> for LineCodec {
    type Error = std::io::Error;

    fn encode(&mut self, item: Bytes, dst: &mut BytesMut) -> Result<(), Self::Error> {
        dst.extend_from_slice(&item);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn decode_all(codec: &mut LineCodec, chunks: &[&[u8]]) -> Vec<Line> {
        let mut buf = BytesMut::new();
        let mut out = Vec::new();
        for chunk in chunks {
            buf.extend_from_slice(chunk);
            while let Some(line) = codec.decode(&mut buf).unwrap() {
                out.push(line);
            }
        }
        while let Some(line) = codec.decode_eof(&mut buf).unwrap() {
            out.push(line);
        }
        out
    }

    fn frame(s: &str) -> Line {
        Line::Frame(Bytes::copy_from_slice(s.as_bytes()))
    }

    #[test]
    fn splits_lines_and_skips_blank_ones() {
        let lines = decode_all(&mut LineCodec::new(100), &[b"a\n\n  \nb\r\nc"]);
        assert_eq!(lines, [frame("a"), frame("b"), frame("c")]);
    }

    #[test]
    fn a_line_at_the_cap_passes_and_one_past_it_is_too_long() {
        let at = "x".repeat(8);
        let past = "y".repeat(9);
        let input = format!("{at}\n{past}\nz\n");
        let lines = decode_all(&mut LineCodec::new(8), &[input.as_bytes()]);
        assert_eq!(lines, [frame(&at), Line::TooLong, frame("z")]);
    }

    #[test]
    fn an_oversized_line_is_dropped_as_it_arrives() {
        let mut codec = LineCodec::new(4);
        let mut buf = BytesMut::new();
        buf.extend_from_slice(b"0123456789");
        assert_eq!(codec.decode(&mut buf).unwrap(), None);
        assert!(buf.is_empty(), "the oversized prefix must not be kept");
        buf.extend_from_slice(b"more bytes of the same line");
        assert_eq!(codec.decode(&mut buf).unwrap(), None);
        assert!(buf.is_empty());
        buf.extend_from_slice(b"end\nok\n");
        assert_eq!(codec.decode(&mut buf).unwrap(), Some(Line::TooLong));
        assert_eq!(codec.decode(&mut buf).unwrap(), Some(frame("ok")));
    }

    /// Found by the `wire_lines` fuzz target: a line at the cap whose `\r` arrived in one read
    /// and its `\n` in the next was dropped as too long (whole, it passed).
    #[test]
    fn a_line_at_the_cap_passes_when_its_crlf_is_split_across_reads() {
        let lines = decode_all(&mut LineCodec::new(5), &[b"abab\xeb\r", b"\n"]);
        assert_eq!(lines, [Line::Frame(Bytes::from_static(b"abab\xeb"))]);
        let lines = decode_all(&mut LineCodec::new(5), &[b"ababa\r", b"\r\n"]);
        assert_eq!(lines, [Line::TooLong], "a `\\r` inside the line counts");
        let lines = decode_all(&mut LineCodec::new(5), &[b"ababab\r", b"\n"]);
        assert_eq!(lines, [Line::TooLong]);
    }

    proptest! {
        #[test]
        fn arbitrary_bytes_never_panic(bytes in prop::collection::vec(any::<u8>(), 0..512), cap in 0usize..64) {
            let _ = decode_all(&mut LineCodec::new(cap), &[&bytes]);
        }

        #[test]
        fn chunking_never_changes_the_lines(
            lines in prop::collection::vec("[a-z{}\":,0-9]{0,20}", 0..10),
            cuts in prop::collection::vec(any::<usize>(), 0..6),
        ) {
            let text: String = lines.iter().map(|l| format!("{l}\n")).collect();
            let whole = decode_all(&mut LineCodec::new(16), &[text.as_bytes()]);
            let bytes = text.as_bytes();
            let mut points: Vec<usize> = cuts.iter().map(|c| c % (bytes.len() + 1)).collect();
            points.sort_unstable();
            let mut chunks = Vec::new();
            let mut last = 0;
            for p in points {
                chunks.push(&bytes[last..p]);
                last = p;
            }
            chunks.push(&bytes[last..]);
            prop_assert_eq!(decode_all(&mut LineCodec::new(16), &chunks), whole);
        }
    }
}
