//! Protocol violations: each closes the link with a logged, named reason, and none panics.

use std::{
    io,
    sync::Arc,
    time::{Duration, Instant},
};

use bytes::{BufMut, Bytes, BytesMut};
use parking_lot::Mutex;

use super::pair::epoch;
use crate::proto::{
    CloseReason, End, Event, FailureReason, Link, LinkConfig, Transmit,
    frame::{ChannelId, Frame, MAX_DATA_LEN},
};

fn id(s: &str) -> ChannelId {
    ChannelId::new(s).unwrap()
}

fn link(end: End) -> (Link, Instant) {
    let now = epoch();
    (Link::new(LinkConfig::new(end), now), now)
}

/// A worker link with channel `c0` opened by the peer.
fn worker_with_channel() -> (Link, Instant) {
    let (mut worker, now) = link(End::Worker);
    worker.handle_frame(now, Frame::Open { id: id("c0") }.to_bytes());
    assert!(worker.close_reason().is_none());
    (worker, now)
}

/// A gateway link with channel `c0` open and accepted by nobody yet.
fn gateway_with_channel() -> (Link, Instant) {
    let (mut gateway, now) = link(End::Gateway);
    let ticket = gateway.open(now);
    gateway.take_opened(ticket).unwrap().unwrap();
    while gateway.poll_transmit(now).is_some() {}
    (gateway, now)
}

#[track_caller]
fn assert_violation(link: &mut Link, now: Instant, contains: &str) {
    let Some(CloseReason::Violation(what)) = link.close_reason().cloned() else {
        panic!("expected a violation, got {:?}", link.close_reason());
    };
    assert!(
        what.contains(contains),
        "{what:?} does not name {contains:?}"
    );
    // Only the WebSocket close goes out, carrying the reason.
    let mut transmits = Vec::new();
    while let Some(transmit) = link.poll_transmit(now) {
        transmits.push(transmit);
    }
    assert_eq!(
        transmits,
        [Transmit::Close(CloseReason::Violation(what.clone()))]
    );
    let mut events = Vec::new();
    while let Some(event) = link.poll_event() {
        events.push(event);
    }
    assert!(events.contains(&Event::Closed(CloseReason::Violation(what))));
    // Anything after is ignored, without panicking.
    link.handle_frame(now, Bytes::from_static(&[0xff, 0xff]));
    link.handle_timeout(now + Duration::from_secs(100));
    assert!(link.poll_transmit(now).is_none());
}

fn data_frame(channel: &str, len: usize) -> Bytes {
    Frame::Data {
        id: id(channel),
        payload: vec![7u8; len].into(),
    }
    .to_bytes()
}

#[test]
fn data_beyond_credit_closes_the_link() {
    let (mut worker, now) = worker_with_channel();
    for _ in 0..16 {
        worker.handle_frame(now, data_frame("c0", MAX_DATA_LEN));
    }
    assert!(
        worker.close_reason().is_none(),
        "256 KiB is within the initial window"
    );
    worker.handle_frame(now, data_frame("c0", 1));
    assert_violation(&mut worker, now, "beyond credit");
}

#[test]
fn credit_overflowing_the_window_closes_the_link() {
    let (mut gateway, now) = gateway_with_channel();
    // 256 KiB initial + 16 MiB: more outstanding than any window may be.
    gateway.handle_frame(
        now,
        Frame::Credit {
            id: id("c0"),
            amount: 16 * 1024 * 1024,
        }
        .to_bytes(),
    );
    assert_violation(&mut gateway, now, "overflows the window");
}

#[test]
fn an_unknown_frame_kind_closes_the_link() {
    let (mut worker, now) = worker_with_channel();
    worker.handle_frame(now, Bytes::from_static(&[0x42, 2, b'c', b'0']));
    assert_violation(&mut worker, now, "unknown frame kind 0x42");
}

#[test]
fn an_oversized_frame_closes_the_link() {
    let (mut worker, now) = worker_with_channel();
    worker.handle_frame(now, data_frame("c0", MAX_DATA_LEN + 1));
    assert_violation(&mut worker, now, "exceeds 16 KiB");
    let (mut worker, now) = worker_with_channel();
    worker.handle_frame(now, data_frame("c0", 1024 * 1024));
    assert_violation(&mut worker, now, "oversized frame");
}

#[test]
fn data_for_a_channel_never_opened_closes_the_link() {
    let (mut worker, now) = worker_with_channel();
    worker.handle_frame(now, data_frame("c1", 10));
    assert_violation(&mut worker, now, "never opened");
}

#[test]
fn a_malformed_id_closes_the_link() {
    let (mut worker, now) = worker_with_channel();
    let mut bytes = BytesMut::new();
    bytes.put_u8(0x04);
    bytes.put_u8(2);
    bytes.put_slice(b"c_");
    worker.handle_frame(now, bytes.freeze());
    assert_violation(&mut worker, now, "malformed channel id");
}

#[test]
fn an_open_from_the_worker_end_closes_the_link() {
    let (mut gateway, now) = link(End::Gateway);
    gateway.handle_frame(now, Frame::Open { id: id("w1") }.to_bytes());
    assert_violation(&mut gateway, now, "from the worker end");
}

#[test]
fn a_duplicate_open_closes_the_link() {
    let (mut worker, now) = worker_with_channel();
    worker.handle_frame(now, Frame::Open { id: id("c0") }.to_bytes());
    assert_violation(&mut worker, now, "already open");
}

#[test]
fn too_many_channels_close_the_link() {
    let (mut worker, now) = link(End::Worker);
    for n in 0..128 {
        worker.handle_frame(
            now,
            Frame::Open {
                id: id(&format!("c{n}")),
            }
            .to_bytes(),
        );
    }
    assert!(worker.close_reason().is_none());
    worker.handle_frame(now, Frame::Open { id: id("c128") }.to_bytes());
    assert_violation(&mut worker, now, "more than 128 channels");
}

#[test]
fn a_premature_release_closes_the_link() {
    let (mut worker, now) = worker_with_channel();
    worker.handle_frame(now, Frame::Release { id: id("c0") }.to_bytes());
    assert_violation(&mut worker, now, "still open");
}

#[test]
fn frames_after_the_peer_released_close_the_link() {
    let (mut worker, now) = worker_with_channel();
    worker.handle_frame(
        now,
        Frame::Abort {
            id: id("c0"),
            reason: FailureReason::Aborted,
        }
        .to_bytes(),
    );
    worker.handle_frame(now, Frame::End { id: id("c0") }.to_bytes());
    assert_violation(&mut worker, now, "after the peer released it");
}

#[test]
fn data_after_end_and_duplicate_stop_close_the_link() {
    let (mut worker, now) = worker_with_channel();
    worker.handle_frame(now, Frame::End { id: id("c0") }.to_bytes());
    worker.handle_frame(now, data_frame("c0", 1));
    assert_violation(&mut worker, now, "after END");

    let (mut worker, now) = worker_with_channel();
    worker.handle_frame(now, Frame::Stop { id: id("c0") }.to_bytes());
    worker.handle_frame(now, Frame::Stop { id: id("c0") }.to_bytes());
    assert_violation(&mut worker, now, "second STOP");
}

/// A `tracing` writer that keeps what is logged.
#[derive(Clone, Default)]
struct Captured(Arc<Mutex<Vec<u8>>>);

impl io::Write for Captured {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.0.lock().extend_from_slice(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

#[test]
fn a_violation_is_logged_with_its_reason() {
    let captured = Captured::default();
    let writer = captured.clone();
    let subscriber = tracing_subscriber::fmt()
        .with_writer(move || writer.clone())
        .with_ansi(false)
        .finish();
    tracing::subscriber::with_default(subscriber, || {
        let (mut worker, now) = worker_with_channel();
        worker.handle_frame(now, data_frame("zz", 3));
    });
    let log = String::from_utf8(captured.0.lock().clone()).unwrap();
    assert!(log.contains("WARN"), "{log}");
    assert!(log.contains("link protocol violation"), "{log}");
    assert!(log.contains("DATA for channel zz, never opened"), "{log}");
}

#[test]
fn garbage_never_panics() {
    // A quick deterministic sweep; the proptest and the fuzz target go further.
    let (mut worker, now) = worker_with_channel();
    let mut state = 0x1234_5678_u64;
    for len in 0..400usize {
        let bytes: Vec<u8> = (0..len % 40)
            .map(|_| {
                state ^= state << 13;
                state ^= state >> 7;
                state ^= state << 17;
                (state >> 24) as u8 % 12
            })
            .collect();
        worker.handle_frame(now, bytes.into());
        worker.handle_timeout(now);
        while worker.poll_transmit(now).is_some() {}
        while worker.poll_event().is_some() {}
    }
}
