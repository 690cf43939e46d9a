//! Fuzzes the NDJSON line codec against a model: whatever the cap and however the bytes are cut
//! into reads, the codec yields exactly the lines a plain split gives (each without its newline
//! and one trailing `\r`, blank lines skipped, lines over the cap as `TooLong`), never a panic
//! and never a buffered line longer than the cap.
#![no_main]

use bytes::BytesMut;
use libfuzzer_sys::fuzz_target;
use simlock_wire::codec::{Line, LineCodec};
use tokio_util::codec::Decoder;

/// What the codec must yield for `input`: every complete line, in order.
fn model(input: &[u8], max: usize) -> Vec<Line> {
    let mut out = Vec::new();
    let mut rest = input;
    while let Some(end) = rest.iter().position(|b| *b == b'\n') {
        let mut line = &rest[..end];
        rest = &rest[end + 1..];
        if line.last() == Some(&b'\r') {
            line = &line[..line.len() - 1];
        }
        if line.len() > max {
            out.push(Line::TooLong);
        } else if !line.iter().all(u8::is_ascii_whitespace) {
            out.push(Line::Frame(bytes::Bytes::copy_from_slice(line)));
        }
    }
    out
}

fuzz_target!(|data: &[u8]| {
    // Byte 0: the cap (1..=64, small so that long lines are common); byte 1: the read size.
    let (Some(&cap), Some(&step)) = (data.first(), data.get(1)) else {
        return;
    };
    let max = usize::from(cap % 64) + 1;
    let step = usize::from(step % 16) + 1;
    let input = &data[2..];
    let mut codec = LineCodec::new(max);
    let mut buf = BytesMut::new();
    let mut got = Vec::new();
    for chunk in input.chunks(step) {
        buf.extend_from_slice(chunk);
        while let Some(line) = codec.decode(&mut buf).expect("the codec never fails") {
            if let Line::Frame(frame) = &line {
                assert!(frame.len() <= max, "a frame over the cap");
                assert!(!frame.contains(&b'\n'), "a frame holding a newline");
            }
            got.push(line);
        }
        // What is held back is at most one line under the cap (plus its `\r`).
        assert!(
            buf.len() <= max + 1,
            "the codec buffered {} bytes",
            buf.len()
        );
    }
    assert_eq!(got, model(input, max), "max {max}, reads of {step}");
});
