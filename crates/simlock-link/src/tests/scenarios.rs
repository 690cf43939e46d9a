//! Protocol scenarios over the [`Pair`] harness with virtual time: credit, the channel limit,
//! STOP, END, ABORT, link loss, stalls, accept timeouts, liveness, window growth, scheduling,
//! the closing handshake, and the seeded simulation.

use std::time::Duration;

use bytes::Bytes;

use super::{pair::Pair, sim};
use crate::proto::{
    ChannelKey, CloseReason, End, Event, FailureReason, Link, LinkConfig, Read, SendTextError,
    Transmit,
    frame::{ChannelId, EncodedData, Frame},
};

const KIB: usize = 1024;
const MIB: usize = 1024 * 1024;

fn pair() -> Pair {
    Pair::new(LinkConfig::new(End::Gateway))
}

/// Opens a channel at the gateway and accepts it at the worker.
fn open_accepted(pair: &mut Pair) -> (ChannelKey, ChannelKey) {
    let ticket = pair.gateway.open(pair.now);
    let g = pair.gateway.take_opened(ticket).unwrap().unwrap();
    pair.drive().unwrap();
    let id = pair.gateway.channel_id(g).unwrap();
    let w = pair.worker.accept(pair.now, id.as_str()).unwrap();
    (g, w)
}

/// Reads everything available: the bytes, and how the stream ended if it did.
fn read_available(
    link: &mut Link,
    now: std::time::Instant,
    key: ChannelKey,
) -> (Vec<u8>, Option<Result<(), FailureReason>>) {
    let mut out = Vec::new();
    loop {
        match link.read(now, key, usize::MAX) {
            Ok(Read::Data(bytes)) => out.extend_from_slice(&bytes),
            Ok(Read::End) => return (out, Some(Ok(()))),
            Ok(Read::Blocked) => return (out, None),
            Err(error) => return (out, Some(Err(error.reason()))),
        }
    }
}

fn data(len: usize, seed: u8) -> Bytes {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
        .collect::<Vec<u8>>()
        .into()
}

fn assert_no_violation(pair: &Pair) {
    for link in [&pair.gateway, &pair.worker] {
        if let Some(CloseReason::Violation(what)) = link.close_reason() {
            panic!("violation: {what}");
        }
    }
    assert!(pair.monitor.errors.is_empty(), "{:?}", pair.monitor.errors);
}

fn assert_freed(pair: &Pair) {
    for link in [&pair.gateway, &pair.worker] {
        let stats = link.stats();
        assert_eq!(stats.channel_entries, 0, "{:?}: {stats:?}", link.end());
        assert_eq!(stats.channel_states, 0, "{:?}: {stats:?}", link.end());
        assert_eq!(stats.open_channels, 0, "{:?}: {stats:?}", link.end());
    }
}

/// Aborts channel `key` and lets go of both its halves, as an application that gives up does.
fn abort_and_let_go(link: &mut Link, now: std::time::Instant, key: ChannelKey) {
    link.abort(now, key);
    link.detach_reader(now, key);
    link.detach_writer(now, key);
}

fn detach_all(pair: &mut Pair, keys: &[(ChannelKey, ChannelKey)]) {
    let now = pair.now;
    for &(g, w) in keys {
        pair.gateway.detach_reader(now, g);
        pair.gateway.detach_writer(now, g);
        pair.worker.detach_reader(now, w);
        pair.worker.detach_writer(now, w);
    }
    pair.drive().unwrap();
}

#[test]
fn credit_is_never_exceeded() {
    let mut pair = pair();
    pair.latency = Duration::from_millis(1);
    let channels: Vec<_> = (0..3).map(|_| open_accepted(&mut pair)).collect();
    let payload = data(2 * MIB, 7);
    let mut written = [0usize; 3];
    let mut received = [Vec::new(), Vec::new(), Vec::new()];
    let mut round = 0usize;
    while received.iter().map(Vec::len).sum::<usize>() < 3 * payload.len() {
        round += 1;
        assert!(round < 100_000, "no progress");
        for (i, &(g, w)) in channels.iter().enumerate() {
            if written[i] < payload.len() {
                written[i] += pair
                    .gateway
                    .write(pair.now, g, payload.slice(written[i]..))
                    .unwrap();
                if written[i] == payload.len() {
                    pair.gateway.finish(pair.now, g).unwrap();
                }
            }
            // A slow reader: a few KiB every now and then.
            if round.is_multiple_of(i + 2) {
                let now = pair.now;
                if let Ok(Read::Data(bytes)) = pair.worker.read(now, w, 3000 + i * 5000) {
                    received[i].extend_from_slice(&bytes);
                }
            }
            let (buffered, _) = pair.worker.channel_buffered(w).unwrap();
            assert!(buffered as u64 <= pair.worker.channel_window(w).unwrap());
        }
        pair.advance(Duration::from_micros(300)).unwrap();
    }
    for bytes in &received {
        assert!(bytes[..] == payload[..], "bytes differ");
    }
    assert!(pair.monitor.data_frames >= 3 * 2 * 64);
    assert!(pair.monitor.max_payload <= 16 * KIB);
    assert_no_violation(&pair);
}

#[test]
fn a_65th_open_waits_for_a_slot_and_its_cancel_takes_effect_at_once() {
    let mut pair = pair();
    let channels: Vec<_> = (0..64).map(|_| open_accepted(&mut pair)).collect();
    assert_eq!(pair.gateway.stats().open_channels, 64);
    let t65 = pair.gateway.open(pair.now);
    let t66 = pair.gateway.open(pair.now);
    let t67 = pair.gateway.open(pair.now);
    pair.drive().unwrap();
    assert_eq!(pair.gateway.take_opened(t65), None);
    assert_eq!(pair.gateway.take_opened(t66), None);
    // The 65th caller cancels: it leaves the queue at once and never gets a channel.
    pair.gateway.cancel_open(pair.now, t65);
    assert!(matches!(pair.gateway.take_opened(t65), Some(Err(_))));
    assert_eq!(pair.gateway.take_opened(t66), None);
    // One channel ends in both directions: the next in line (66) gets the slot, not 67.
    let (g, w) = channels[10];
    pair.gateway.finish(pair.now, g).unwrap();
    pair.worker.finish(pair.now, w).unwrap();
    pair.drive().unwrap();
    let events = pair.take_events(End::Gateway);
    assert!(events.contains(&Event::OpenReady(t66)), "{events:?}");
    assert!(matches!(pair.gateway.take_opened(t66), Some(Ok(_))));
    assert_eq!(pair.gateway.take_opened(t67), None);
    assert_eq!(pair.gateway.stats().open_channels, 64);
}

#[test]
fn stop_fails_the_peer_writer_and_at_most_one_window_follows() {
    let mut pair = pair();
    pair.latency = Duration::from_millis(10);
    let (g, w) = open_accepted(&mut pair);
    let payload = data(64 * KIB, 1);
    let mut read = 0;
    // Stream until the worker has read 1 MiB, then stop.
    while read < MIB {
        let _ = pair.gateway.write(pair.now, g, payload.clone()).unwrap();
        let (bytes, end) = read_available(&mut pair.worker, pair.now, w);
        assert!(end.is_none());
        read += bytes.len();
        pair.advance(Duration::from_millis(1)).unwrap();
    }
    pair.worker.stop(pair.now, w);
    let mut writer_error = None;
    for _ in 0..200 {
        match pair.gateway.write(pair.now, g, payload.clone()) {
            Ok(_) => {}
            Err(error) => {
                writer_error = Some(error.reason());
                break;
            }
        }
        pair.advance(Duration::from_millis(1)).unwrap();
    }
    assert_eq!(writer_error, Some(FailureReason::Stopped));
    pair.drive().unwrap();
    let (_, after_stop) = pair.worker.channel_buffered(w).unwrap();
    assert!(
        after_stop > 0,
        "latency should leave bytes in flight after STOP"
    );
    let window = pair.worker.channel_window(w).unwrap();
    assert!(
        after_stop <= window,
        "{after_stop} bytes arrived after STOP, window {window}"
    );
    // The response direction is unaffected.
    pair.worker
        .write(pair.now, w, Bytes::from_static(b"still here"))
        .unwrap();
    pair.worker.finish(pair.now, w).unwrap();
    pair.drive().unwrap();
    let (bytes, end) = read_available(&mut pair.gateway, pair.now, g);
    assert_eq!(&bytes[..], b"still here");
    assert_eq!(end, Some(Ok(())));
    detach_all(&mut pair, &[(g, w)]);
    assert_no_violation(&pair);
    assert_freed(&pair);
}

#[test]
fn end_gives_a_clean_end_of_stream_both_ways() {
    let mut pair = pair();
    let (g, w) = open_accepted(&mut pair);
    pair.gateway
        .write(pair.now, g, Bytes::from_static(b"hello"))
        .unwrap();
    pair.gateway.finish(pair.now, g).unwrap();
    pair.drive().unwrap();
    assert!(pair.gateway.poll_finished(g).unwrap());
    let (bytes, end) = read_available(&mut pair.worker, pair.now, w);
    assert_eq!((&bytes[..], end), (&b"hello"[..], Some(Ok(()))));
    // End of stream repeats.
    assert_eq!(pair.worker.read(pair.now, w, 10).unwrap(), Read::End);
    pair.worker
        .write(pair.now, w, Bytes::from_static(b"world"))
        .unwrap();
    pair.worker.finish(pair.now, w).unwrap();
    pair.drive().unwrap();
    let (bytes, end) = read_available(&mut pair.gateway, pair.now, g);
    assert_eq!((&bytes[..], end), (&b"world"[..], Some(Ok(()))));
    // Both ends released the id; the state goes with the handles.
    assert_eq!(pair.gateway.stats().channel_entries, 0);
    assert_eq!(pair.worker.stats().channel_entries, 0);
    detach_all(&mut pair, &[(g, w)]);
    assert_no_violation(&pair);
    assert_freed(&pair);
}

#[test]
fn an_empty_stream_ends_cleanly() {
    let mut pair = pair();
    let (g, w) = open_accepted(&mut pair);
    pair.gateway.finish(pair.now, g).unwrap();
    pair.drive().unwrap();
    assert_eq!(pair.worker.read(pair.now, w, 10).unwrap(), Read::End);
}

#[test]
fn abort_fails_both_directions_at_both_ends() {
    for aborter in [End::Gateway, End::Worker] {
        let mut pair = pair();
        pair.latency = Duration::from_millis(3);
        let (g, w) = open_accepted(&mut pair);
        pair.gateway.write(pair.now, g, data(100 * KIB, 3)).unwrap();
        pair.worker.write(pair.now, w, data(100 * KIB, 4)).unwrap();
        pair.advance(Duration::from_millis(4)).unwrap();
        let key = if aborter == End::Gateway { g } else { w };
        let now = pair.now;
        pair.link(aborter).abort(now, key);
        pair.drive().unwrap();
        for (end, key) in [(End::Gateway, g), (End::Worker, w)] {
            let now = pair.now;
            let link = pair.link(end);
            assert_eq!(
                link.read(now, key, 10).unwrap_err().reason(),
                FailureReason::Aborted,
                "{end:?} reader"
            );
            assert_eq!(
                link.write(now, key, Bytes::from_static(b"x"))
                    .unwrap_err()
                    .reason(),
                FailureReason::Aborted,
                "{end:?} writer"
            );
            assert_eq!(
                link.finish(now, key).unwrap_err().reason(),
                FailureReason::Aborted
            );
        }
        detach_all(&mut pair, &[(g, w)]);
        assert_no_violation(&pair);
        assert_freed(&pair);
    }
}

#[test]
fn losing_the_websocket_fails_every_channel_closed() {
    let mut config = LinkConfig::new(End::Gateway);
    config.max_open_channels = 5;
    let mut pair = Pair::new(config);
    let channels: Vec<_> = (0..5).map(|_| open_accepted(&mut pair)).collect();
    for &(g, w) in &channels {
        pair.gateway.write(pair.now, g, data(50 * KIB, 1)).unwrap();
        pair.worker.write(pair.now, w, data(50 * KIB, 2)).unwrap();
    }
    pair.advance(Duration::from_millis(1)).unwrap();
    let waiting = pair.gateway.open(pair.now);
    assert_eq!(pair.gateway.take_opened(waiting), None);
    pair.disconnect();
    for &(g, w) in &channels {
        for (end, key) in [(End::Gateway, g), (End::Worker, w)] {
            let now = pair.now;
            let link = pair.link(end);
            assert_eq!(
                link.read(now, key, 10).unwrap_err().reason(),
                FailureReason::Closed
            );
            assert_eq!(
                link.write(now, key, Bytes::from_static(b"x"))
                    .unwrap_err()
                    .reason(),
                FailureReason::Closed
            );
        }
    }
    assert_eq!(
        pair.gateway
            .take_opened(waiting)
            .unwrap()
            .unwrap_err()
            .reason(),
        FailureReason::Closed
    );
    let late = pair.gateway.open(pair.now);
    assert_eq!(
        pair.gateway
            .take_opened(late)
            .unwrap()
            .unwrap_err()
            .reason(),
        FailureReason::Closed
    );
    assert!(matches!(
        pair.gateway.send_text("x".into()),
        Err(SendTextError::Closed(_))
    ));
    assert_eq!(
        pair.worker.accept(pair.now, "c0").unwrap_err().reason(),
        FailureReason::Closed
    );
    assert!(matches!(
        pair.take_events(End::Worker).last(),
        Some(Event::Closed(CloseReason::Transport(_)))
    ));
    detach_all(&mut pair, &channels);
    assert_freed(&pair);
}

#[test]
fn a_writer_can_bound_its_own_send_queue() {
    let mut pair = pair();
    let (g, w) = open_accepted(&mut pair);
    pair.gateway.set_send_buffer(pair.now, g, 64 * KIB).unwrap();
    assert_eq!(pair.gateway.write_space(g).unwrap(), 64 * KIB);
    assert_eq!(
        pair.gateway.write(pair.now, g, data(100 * KIB, 1)).unwrap(),
        64 * KIB
    );
    assert_eq!(pair.gateway.write_space(g).unwrap(), 0, "the writer waits");
    // The queue goes out (the peer's window has room) and the writer is woken.
    pair.drive().unwrap();
    assert!(pair.take_events(End::Gateway).contains(&Event::Writable(g)));
    assert_eq!(pair.gateway.write_space(g).unwrap(), 64 * KIB);

    // The worker never reads: once its window is full, the gateway holds at most its own bound.
    let payload = data(16 * KIB, 2);
    while pair.gateway.write(pair.now, g, payload.clone()).unwrap() > 0 {
        pair.drive().unwrap();
    }
    pair.drive().unwrap();
    assert_eq!(pair.worker.stats().recv_buffered, 256 * KIB as u64);
    assert_eq!(pair.gateway.stats().send_buffered, 64 * KIB as u64);
    // The worker reads a little: credit comes back, half the queue goes, the writer is woken.
    let _ = pair.take_events(End::Gateway);
    let (read, _) = read_available(&mut pair.worker, pair.now, w);
    assert_eq!(read.len(), 256 * KIB);
    pair.drive().unwrap();
    assert!(pair.take_events(End::Gateway).contains(&Event::Writable(g)));

    // A bound of zero is one byte; a failed writer cannot set one.
    pair.gateway.set_send_buffer(pair.now, g, 0).unwrap();
    pair.drive().unwrap();
    assert_eq!(pair.gateway.write_space(g).unwrap(), 1);
    pair.gateway.abort(pair.now, g);
    assert_eq!(
        pair.gateway
            .set_send_buffer(pair.now, g, KIB)
            .unwrap_err()
            .reason(),
        FailureReason::Aborted
    );
}

#[test]
fn raising_a_writers_bound_wakes_it() {
    let mut pair = pair();
    let (g, _w) = open_accepted(&mut pair);
    pair.gateway.set_send_buffer(pair.now, g, 16 * KIB).unwrap();
    // The worker never reads: once its window is full, what follows stays queued.
    let payload = data(16 * KIB, 3);
    while pair.gateway.write(pair.now, g, payload.clone()).unwrap() > 0 {
        pair.drive().unwrap();
    }
    pair.drive().unwrap();
    assert_eq!(pair.worker.stats().recv_buffered, 256 * KIB as u64);
    assert_eq!(pair.gateway.stats().send_buffered, 16 * KIB as u64);
    assert_eq!(pair.gateway.write_space(g).unwrap(), 0, "the writer waits");
    let _ = pair.take_events(End::Gateway);
    pair.gateway.set_send_buffer(pair.now, g, 64 * KIB).unwrap();
    assert!(pair.take_events(End::Gateway).contains(&Event::Writable(g)));
    assert_eq!(pair.gateway.write_space(g).unwrap(), 48 * KIB);
}

#[test]
fn a_writer_without_credit_for_60s_fails_stalled_and_the_peer_learns_why() {
    let mut pair = pair();
    let (g, w) = open_accepted(&mut pair);
    // The worker never reads: the gateway fills the window and its send buffer.
    let payload = data(64 * KIB, 5);
    while pair.gateway.write(pair.now, g, payload.clone()).unwrap() > 0 {
        pair.drive().unwrap();
    }
    pair.drive().unwrap();
    assert_eq!(pair.worker.stats().recv_buffered, 256 * KIB as u64);
    assert!(pair.gateway.stats().credit_stalls >= 1);
    pair.advance(Duration::from_secs(59)).unwrap();
    assert_eq!(
        pair.gateway.write_space(g).unwrap(),
        0,
        "not stalled yet at 59 s"
    );
    pair.advance(Duration::from_secs(2)).unwrap();
    assert_eq!(
        pair.gateway.write_space(g).unwrap_err().reason(),
        FailureReason::Stalled
    );
    assert_eq!(
        pair.gateway.read(pair.now, g, 1).unwrap_err().reason(),
        FailureReason::Stalled
    );
    assert_eq!(
        pair.worker.read(pair.now, w, 1).unwrap_err().reason(),
        FailureReason::Stalled
    );
    assert_eq!(
        pair.worker
            .write(pair.now, w, Bytes::from_static(b"x"))
            .unwrap_err()
            .reason(),
        FailureReason::Stalled
    );
    detach_all(&mut pair, &[(g, w)]);
    assert_no_violation(&pair);
    assert_freed(&pair);
}

#[test]
fn an_unaccepted_channel_is_refused_after_30s() {
    let mut pair = pair();
    let ticket = pair.gateway.open(pair.now);
    let g = pair.gateway.take_opened(ticket).unwrap().unwrap();
    let id = pair.gateway.channel_id(g).unwrap();
    pair.gateway.write(pair.now, g, data(10 * KIB, 9)).unwrap();
    pair.drive().unwrap();
    assert!(pair.take_events(End::Worker).contains(&Event::Incoming(id)));
    pair.advance(Duration::from_secs(29)).unwrap();
    assert_eq!(pair.gateway.read(pair.now, g, 1).unwrap(), Read::Blocked);
    pair.advance(Duration::from_secs(2)).unwrap();
    assert_eq!(
        pair.gateway.read(pair.now, g, 1).unwrap_err().reason(),
        FailureReason::Refused
    );
    assert_eq!(
        pair.gateway
            .write(pair.now, g, Bytes::from_static(b"x"))
            .unwrap_err()
            .reason(),
        FailureReason::Refused
    );
    assert_eq!(
        pair.worker
            .accept(pair.now, id.as_str())
            .unwrap_err()
            .reason(),
        FailureReason::Refused
    );
    let now = pair.now;
    pair.gateway.detach_reader(now, g);
    pair.gateway.detach_writer(now, g);
    pair.drive().unwrap();
    assert_no_violation(&pair);
    assert_freed(&pair);
}

/// The text naming a channel may be read after the link handled that channel's ABORT: the
/// accept then learns the abort (once, within the accept timeout), not "never opened", and the
/// id is freed at both ends all the same.
#[test]
fn a_channel_aborted_before_its_accept_answers_the_accept_with_the_abort() {
    let mut pair = pair();
    let mut opened = Vec::new();
    for _ in 0..3 {
        let ticket = pair.gateway.open(pair.now);
        let g = pair.gateway.take_opened(ticket).unwrap().unwrap();
        opened.push((g, pair.gateway.channel_id(g).unwrap()));
    }
    pair.drive().unwrap();
    let now = pair.now;
    for &(g, _) in &opened {
        abort_and_let_go(&mut pair.gateway, now, g);
    }
    pair.drive().unwrap();
    assert_no_violation(&pair);
    assert_freed(&pair);
    assert_eq!(pair.gateway.stats().channels_opened, 3);
    assert_eq!(
        pair.worker.stats().channels_opened,
        3,
        "counted when the OPEN came"
    );
    let reason = |pair: &mut Pair, id: &ChannelId| {
        let now = pair.now;
        pair.worker.accept(now, id.as_str()).unwrap_err().reason()
    };
    assert_eq!(reason(&mut pair, &opened[0].1), FailureReason::Aborted);
    assert_eq!(
        reason(&mut pair, &opened[0].1),
        FailureReason::Refused,
        "answered once"
    );
    pair.advance(Duration::from_secs(29)).unwrap();
    assert_eq!(reason(&mut pair, &opened[1].1), FailureReason::Aborted);
    pair.advance(Duration::from_secs(1)).unwrap();
    assert_eq!(
        reason(&mut pair, &opened[2].1),
        FailureReason::Refused,
        "forgotten after the accept timeout"
    );
    assert_no_violation(&pair);
}

/// The answers kept for early aborts are bounded by the id table's size; the oldest go first.
#[test]
fn early_abort_answers_are_bounded_oldest_first() {
    let mut config = LinkConfig::new(End::Gateway);
    config.max_open_channels = 4;
    config.max_channel_entries = 4;
    let mut pair = Pair::new(config);
    let mut ids = Vec::new();
    for _ in 0..5 {
        let ticket = pair.gateway.open(pair.now);
        let g = pair.gateway.take_opened(ticket).unwrap().unwrap();
        ids.push(pair.gateway.channel_id(g).unwrap());
        pair.drive().unwrap();
        let now = pair.now;
        abort_and_let_go(&mut pair.gateway, now, g);
        pair.drive().unwrap();
    }
    assert_no_violation(&pair);
    assert_freed(&pair);
    let now = pair.now;
    let reasons: Vec<_> = ids
        .iter()
        .map(|id| pair.worker.accept(now, id.as_str()).unwrap_err().reason())
        .collect();
    assert_eq!(
        reasons,
        [
            FailureReason::Refused,
            FailureReason::Aborted,
            FailureReason::Aborted,
            FailureReason::Aborted,
            FailureReason::Aborted,
        ]
    );
}

#[test]
fn accepting_needs_an_open_unaccepted_id() {
    let mut pair = pair();
    let (g, _w) = open_accepted(&mut pair);
    let id = pair.gateway.channel_id(g).unwrap();
    let refused = |result: Result<ChannelKey, crate::proto::ChannelError>| {
        assert_eq!(result.unwrap_err().reason(), FailureReason::Refused);
    };
    refused(pair.worker.accept(pair.now, id.as_str()));
    refused(pair.worker.accept(pair.now, "c999"));
    refused(pair.worker.accept(pair.now, "not valid!"));
    refused(pair.worker.accept(pair.now, ""));
    refused(pair.gateway.accept(pair.now, id.as_str()));
    let ticket = pair.worker.open(pair.now);
    assert_eq!(
        pair.worker
            .take_opened(ticket)
            .unwrap()
            .unwrap_err()
            .reason(),
        FailureReason::Refused
    );
}

#[test]
fn three_missed_pings_close_the_link_within_15s() {
    let mut pair = pair();
    let (g, _w) = open_accepted(&mut pair);
    pair.advance(Duration::from_secs(1)).unwrap();
    let silent_since = pair.now;
    pair.blackhole = true;
    let pings_before = pair.pings_sent[0];
    pair.advance(Duration::from_secs(13)).unwrap();
    assert!(pair.gateway.close_reason().is_none(), "closed too early");
    let closed = pair
        .run_until(Duration::from_secs(10), |pair| {
            pair.gateway.close_reason().is_some()
        })
        .unwrap();
    assert!(closed);
    pair.drive().unwrap();
    assert_eq!(
        pair.gateway.close_reason(),
        Some(&CloseReason::Unresponsive)
    );
    assert!(pair.now.duration_since(silent_since) <= Duration::from_secs(15));
    // The peer was last heard before the silence, not when the link gave up on it.
    let heard = pair.gateway.last_heard();
    assert!(heard <= silent_since, "heard after the silence began");
    assert!(
        pair.now.duration_since(heard) >= Duration::from_secs(13),
        "the close does not count as hearing the peer"
    );
    assert_eq!(
        pair.pings_sent[0] - pings_before,
        3,
        "three unanswered pings"
    );
    assert_eq!(
        pair.gateway.read(pair.now, g, 1).unwrap_err().reason(),
        FailureReason::Closed
    );
    // The close frame is the last thing the link sends.
    assert!(matches!(
        pair.gateway.poll_transmit(pair.now),
        None | Some(Transmit::Close(_))
    ));
}

#[test]
fn the_peer_is_heard_by_its_frames_and_texts_only() {
    let mut pair = pair();
    let start = pair.now;
    assert_eq!(
        pair.gateway.last_heard(),
        start,
        "the link's start, before anything"
    );
    let _ = open_accepted(&mut pair);
    let heard = pair.gateway.last_heard();
    assert!(heard >= start);
    pair.advance(Duration::from_secs(1)).unwrap();
    let quiet_from = pair.now;
    pair.blackhole = true;
    pair.advance(Duration::from_secs(2)).unwrap();
    let before = pair.gateway.last_heard();
    assert!(before <= quiet_from);
    // Reading resumed after a pause restarts the PING timer's count, not what was heard.
    pair.gateway.set_reading_paused(pair.now, true);
    pair.gateway.set_reading_paused(pair.now, false);
    assert_eq!(pair.gateway.last_heard(), before);
    // A text heard is heard.
    let later = pair.now + Duration::from_millis(5);
    pair.gateway.handle_text(later, "hello".into());
    assert_eq!(pair.gateway.last_heard(), later);
}

#[test]
fn a_quiet_link_stays_up() {
    let mut pair = pair();
    pair.latency = Duration::from_millis(30);
    let _ = open_accepted(&mut pair);
    pair.advance(Duration::from_secs(600)).unwrap();
    assert!(pair.gateway.close_reason().is_none());
    assert!(pair.worker.close_reason().is_none());
    assert!(pair.pongs_sent[1] >= 100);
    let rtt = pair.gateway.stats().rtt.unwrap();
    assert_eq!(rtt, Duration::from_millis(60));
}

#[test]
fn the_min_rtt_is_the_smallest_round_trip_and_ignores_later_queueing() {
    let mut pair = pair();
    assert_eq!(pair.gateway.min_rtt(), None, "no PONG yet");
    pair.latency = Duration::from_millis(30);
    pair.advance(Duration::from_secs(11)).unwrap();
    assert_eq!(pair.gateway.min_rtt(), Some(Duration::from_millis(60)));
    pair.latency = Duration::from_millis(5);
    pair.advance(Duration::from_secs(11)).unwrap();
    assert_eq!(pair.gateway.min_rtt(), Some(Duration::from_millis(10)));
    // Queueing behind bulk data inflates later samples: the smoothed RTT follows, the minimum
    // does not.
    pair.latency = Duration::from_millis(200);
    pair.advance(Duration::from_secs(30)).unwrap();
    let stats = pair.gateway.stats();
    assert_eq!(stats.min_rtt, Some(Duration::from_millis(10)));
    assert!(stats.rtt.unwrap() > Duration::from_millis(100));
    assert_eq!(pair.worker.min_rtt(), Some(Duration::from_millis(10)));
}

#[test]
fn windows_grow_toward_the_bdp_within_the_budget() {
    let mut config = LinkConfig::new(End::Gateway);
    config.receive_budget = 24 * MIB as u64;
    let mut pair = Pair::new(config);
    pair.latency = Duration::from_millis(20);
    let channels: Vec<_> = (0..3).map(|_| open_accepted(&mut pair)).collect();
    let payload = data(256 * KIB, 1);
    let mut total = 0usize;
    let start = pair.now;
    while total < 3 * 48 * MIB {
        for &(g, w) in &channels {
            let _ = pair.gateway.write(pair.now, g, payload.clone()).unwrap();
            total += read_available(&mut pair.worker, pair.now, w).0.len();
        }
        let windows = pair.worker.stats().receive_windows;
        assert!(
            windows <= 24 * MIB as u64,
            "windows {windows} beyond the budget"
        );
        pair.advance(Duration::from_millis(2)).unwrap();
    }
    let elapsed = pair.now.duration_since(start);
    for &(_, w) in &channels {
        let window = pair.worker.channel_window(w).unwrap();
        assert!(window > 256 * KIB as u64, "window did not grow: {window}");
        assert!(window <= 16 * MIB as u64);
    }
    // With 256 KiB per 40 ms RTT the transfer would take over 2 minutes of virtual time.
    assert!(elapsed < Duration::from_secs(60), "took {elapsed:?}");
    assert_no_violation(&pair);
}

#[test]
fn text_and_control_frames_go_before_data_and_data_goes_round_robin() {
    let mut pair = pair();
    let a = open_accepted(&mut pair);
    let b = open_accepted(&mut pair);
    pair.drive().unwrap();
    let now = pair.now;
    pair.gateway.write(now, a.0, data(64 * KIB, 1)).unwrap();
    pair.gateway.write(now, b.0, data(64 * KIB, 2)).unwrap();
    pair.gateway.stop(now, a.0);
    pair.gateway.send_text("call".into()).unwrap();
    let mut order = Vec::new();
    while let Some(transmit) = pair.gateway.poll_transmit(now) {
        order.push(match transmit {
            Transmit::Text(text) => text,
            Transmit::Frame(bytes) => match Frame::decode(&bytes).unwrap() {
                Frame::Data { id, .. } => format!("DATA {id}"),
                frame => frame.kind().to_string(),
            },
            Transmit::Close(_) => "CLOSE".into(),
        });
    }
    let a_id = pair.gateway.channel_id(a.0).unwrap();
    let b_id = pair.gateway.channel_id(b.0).unwrap();
    assert_eq!(&order[..2], ["STOP", "call"]);
    let data_order: Vec<&str> = order[2..].iter().map(String::as_str).collect();
    assert_eq!(data_order.len(), 8);
    for pair_of in data_order.chunks(2) {
        assert_eq!(pair_of, [format!("DATA {a_id}"), format!("DATA {b_id}")]);
    }
}

#[test]
fn the_text_lane_is_bounded() {
    let mut config = LinkConfig::new(End::Gateway);
    config.text_send_buffer = 10;
    let mut pair = Pair::new(config);
    pair.gateway.send_text("0123456789ab".into()).unwrap();
    assert_eq!(
        pair.gateway.send_text("next".into()),
        Err(SendTextError::Full("next".into()))
    );
    pair.drive().unwrap();
    assert!(
        pair.take_events(End::Gateway)
            .contains(&Event::TextWritable)
    );
    pair.gateway.send_text("next".into()).unwrap();
    pair.drive().unwrap();
    let texts: Vec<_> = pair
        .take_events(End::Worker)
        .into_iter()
        .filter_map(|event| match event {
            Event::Text(text) => Some(text),
            _ => None,
        })
        .collect();
    assert_eq!(texts, ["0123456789ab", "next"]);
}

/// Runs `race` on a fresh accepted channel with 5 ms of latency each way, drives the pair to
/// rest, drops every handle, and checks that no late frame counted as a violation and that both
/// ends freed everything.
fn race_ends_clean(race: impl FnOnce(&mut Pair, ChannelKey, ChannelKey)) {
    let mut pair = pair();
    pair.latency = Duration::from_millis(5);
    let (g, w) = open_accepted(&mut pair);
    race(&mut pair, g, w);
    pair.drive().unwrap();
    detach_all(&mut pair, &[(g, w)]);
    assert_no_violation(&pair);
    assert_freed(&pair);
}

#[test]
fn late_frames_after_races_are_not_violations() {
    // Both ends abort at once.
    race_ends_clean(|pair, g, w| {
        pair.gateway.write(pair.now, g, data(100 * KIB, 1)).unwrap();
        pair.worker.write(pair.now, w, data(100 * KIB, 2)).unwrap();
        pair.advance(Duration::from_millis(2)).unwrap();
        pair.gateway.abort(pair.now, g);
        pair.worker.abort(pair.now, w);
    });

    // STOP crosses END, and CREDIT crosses END.
    race_ends_clean(|pair, g, w| {
        pair.gateway.write(pair.now, g, data(200 * KIB, 1)).unwrap();
        pair.advance(Duration::from_millis(6)).unwrap();
        let _ = read_available(&mut pair.worker, pair.now, w);
        pair.gateway.finish(pair.now, g).unwrap();
        pair.worker.stop(pair.now, w);
        pair.worker.finish(pair.now, w).unwrap();
        pair.gateway.stop(pair.now, g);
    });

    // Abort while the peer's DATA, END and RELEASE are in flight.
    race_ends_clean(|pair, g, w| {
        pair.worker.write(pair.now, w, data(30 * KIB, 1)).unwrap();
        pair.worker.finish(pair.now, w).unwrap();
        pair.gateway.finish(pair.now, g).unwrap();
        pair.advance(Duration::from_millis(1)).unwrap();
        pair.gateway.abort(pair.now, g);
    });
}

#[test]
fn a_reader_that_never_reads_holds_at_most_its_window() {
    let mut pair = pair();
    let (g, w) = open_accepted(&mut pair);
    let (g2, w2) = open_accepted(&mut pair);
    let payload = data(MIB, 3);
    let mut fast = 0usize;
    for _ in 0..200 {
        let _ = pair.gateway.write(pair.now, g, payload.clone());
        let _ = pair.gateway.write(pair.now, g2, payload.clone());
        fast += read_available(&mut pair.worker, pair.now, w2).0.len();
        pair.drive().unwrap();
    }
    let stats = pair.worker.stats();
    assert_eq!(pair.worker.channel_buffered(w).unwrap().0, 256 * KIB);
    assert_eq!(stats.max_channel_recv_buffered, 256 * KIB as u64);
    // The stalled reader does not slow its neighbour.
    assert!(fast > 40 * MIB, "neighbour moved only {fast} bytes");
}

#[test]
fn encoded_data_goes_as_is_and_splits_when_credit_is_short() {
    let mut config = LinkConfig::new(End::Gateway);
    config.initial_window = 40_000;
    let mut pair = Pair::new(config);
    let (g, w) = open_accepted(&mut pair);
    let id = pair.gateway.channel_id(g).unwrap();
    let payload = data(100_000, 9);
    let encoded = EncodedData::new(id, &payload, 16 * KIB);
    assert_eq!(encoded.len(), payload.len());
    pair.gateway.write_encoded(pair.now, g, encoded).unwrap();
    // Encoded for another channel: the link re-frames the payload instead of sending it wrong.
    let other = EncodedData::new(ChannelId::new("zz").unwrap(), &payload[..5000], 1000);
    pair.gateway.write_encoded(pair.now, g, other).unwrap();
    pair.gateway.finish(pair.now, g).unwrap();
    let mut got = Vec::new();
    loop {
        pair.drive().unwrap();
        let (bytes, end) = read_available(&mut pair.worker, pair.now, w);
        got.extend_from_slice(&bytes);
        if end.is_some() {
            assert_eq!(end, Some(Ok(())));
            break;
        }
    }
    let mut expected = payload.to_vec();
    expected.extend_from_slice(&payload[..5000]);
    assert!(got == expected);
    assert!(pair.monitor.max_payload <= 16 * KIB);
    assert_no_violation(&pair);
}

#[test]
fn seeded_simulation() {
    let seeds = sim::seeds_from_env(500);
    let report = match sim::run_seeds(0, seeds) {
        Ok(report) => report,
        Err(error) => panic!("{error}"),
    };
    assert_eq!(report.seeds, seeds);
    if seeds >= 500 {
        // The schedules reach every failure reason, clean ends and link losses.
        for reason in FailureReason::ALL {
            assert!(
                report.failures.contains_key(reason.as_str()),
                "no {reason} in {report:?}"
            );
        }
        assert!(
            report.clean_ends > 100 && report.links_lost > 5,
            "{report:?}"
        );
    }
}

/// Replays one seed of the simulation with trace logging: `SIMLOCK_LINK_SIM_SEED=n cargo test
/// -p simlock-link --lib replay_one_seed -- --ignored --nocapture`.
#[test]
#[ignore = "a debugging aid"]
fn replay_one_seed() {
    let seed = std::env::var("SIMLOCK_LINK_SIM_SEED").map_or(0, |s| s.parse().unwrap());
    let subscriber = tracing_subscriber::fmt()
        .with_max_level(tracing::Level::TRACE)
        .with_test_writer()
        .finish();
    tracing::subscriber::with_default(subscriber, || {
        if let Err(error) = sim::run_seeds(seed, 1) {
            panic!("{error}");
        }
    });
}
