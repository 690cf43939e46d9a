//! Fuzzes a whole link with hostile input: arbitrary messages (split from the fuzzer's bytes by
//! a length byte) fed to a worker end and a gateway end, with time moving in between. The link
//! must never panic (its debug invariants included) and must close on a violation.
#![no_main]

use std::time::{Duration, Instant};

use bytes::Bytes;
use libfuzzer_sys::fuzz_target;
use simlock_link::{End, LinkConfig, proto::Link};

fuzz_target!(|data: &[u8]| {
    let start = Instant::now();
    for end in [End::Worker, End::Gateway] {
        let mut link = Link::new(LinkConfig::new(end), start);
        if end == End::Gateway {
            // Give the gateway an open channel for the input to talk about.
            let ticket = link.open(start);
            let _ = link.take_opened(ticket);
        }
        let mut rest = data;
        let mut now = start;
        while let Some((&len, tail)) = rest.split_first() {
            let len = usize::from(len).min(tail.len());
            let (message, tail) = tail.split_at(len);
            rest = tail;
            now += Duration::from_millis(len as u64 * 10);
            if message.first() == Some(&b'T') {
                link.handle_text(now, String::from_utf8_lossy(message).into_owned());
            } else {
                link.handle_frame(now, Bytes::copy_from_slice(message));
            }
            if message.first() == Some(&b'A') {
                let _ = link.accept(now, "c0");
            }
            link.handle_timeout(now);
            while link.poll_transmit(now).is_some() {}
            while link.poll_event().is_some() {}
        }
    }
});
