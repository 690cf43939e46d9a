//! Fuzzes the link frame decoder: any bytes decode to a frame or a named error, never a panic,
//! and whatever decodes re-encodes to exactly the same bytes (the encoding is canonical).
#![no_main]

use bytes::Bytes;
use libfuzzer_sys::fuzz_target;
use simlock_link::proto::frame::Frame;

fuzz_target!(|data: &[u8]| {
    let message = Bytes::copy_from_slice(data);
    if let Ok(frame) = Frame::decode(&message) {
        assert_eq!(
            frame.to_bytes(),
            message,
            "decode then encode must give the input back"
        );
        assert_eq!(frame.encoded_len(), message.len());
    }
});
