//! The uplink's TCP socket: what the link asks of the kernel so that a priority frame waits
//! behind little bulk data.
//!
//! The link schedules text and control frames ahead of DATA, but only among the frames it still
//! holds. Bytes already handed to the kernel are in order, ahead of any later frame, in two
//! places:
//! - the sender's unsent queue, kept to 16 KiB by `TCP_NOTSENT_LOWAT` ([`tune_tcp`]);
//! - the receiver's queue of bytes that arrived and that its driver has not read yet. On a fast
//!   path the kernel grows that queue far past what the path needs (megabytes on loopback, where
//!   the round trip is tens of microseconds), and it fills whenever the receiving driver waits
//!   for a thread. [`ReceiveBuffer`] sizes it once to the bandwidth-delay product of a 10 Gbit/s
//!   path at the link's first measured round trip, so on a short path the backlog stays in the
//!   sender's link queue, where a text frame overtakes it. On a long path (the product past
//!   4 MiB, or past the kernel's `rmem_max`) the kernel's own tuning is left alone.

use std::{io, time::Duration};

use tokio::net::TcpStream;

/// Unsent bytes the kernel may hold per socket: 16 KiB, so a priority frame waits behind little
/// bulk data (Cloudflare's value for HTTP/2 prioritisation; halved small-call p99 under bulk).
pub const NOTSENT_LOWAT: u32 = 16 * 1024;

/// The line rate an uplink's receive buffer is sized for: 10 Gbit/s, in bytes per second.
pub const RECEIVE_RATE: u64 = 1_250_000_000;

/// The smallest receive buffer an uplink is given, as passed to `SO_RCVBUF` (Linux doubles the
/// value for its bookkeeping, and caps it at `net.core.rmem_max`). Covers a 10 Gbit/s path up to
/// a 200 µs round trip; on loopback the relay moved about 10 % more per second, at 5 % less CPU
/// per byte, with it than with 128 KiB, and larger floors gained nothing more.
pub const MIN_RECEIVE_BUFFER: usize = 256 * 1024;

/// The largest receive buffer the link sets; a path that needs more keeps the kernel's tuning.
pub const MAX_RECEIVE_BUFFER: usize = 4 * 1024 * 1024;

/// Tunes an uplink's TCP socket before the WebSocket handshake: no Nagle delay (the driver
/// batches by flushing), and `TCP_NOTSENT_LOWAT` of 16 KiB where the OS has it (Linux and
/// Android through socket2; elsewhere the call only sets `TCP_NODELAY`).
///
/// # Errors
/// The socket option call's error.
pub fn tune_tcp(stream: &TcpStream) -> io::Result<()> {
    stream.set_nodelay(true)?;
    #[cfg(any(target_os = "linux", target_os = "android"))]
    socket2::SockRef::from(stream).set_tcp_notsent_lowat(NOTSENT_LOWAT)?;
    Ok(())
}

/// The receive buffer (`SO_RCVBUF`) for a path whose smallest round trip is `min_rtt`, when the
/// kernel lets a socket ask for at most `ceiling` bytes: the 10 Gbit/s bandwidth-delay product,
/// at least [`MIN_RECEIVE_BUFFER`] (or the ceiling, when that is lower); `None` when the product
/// passes the ceiling (leave the kernel's tuning alone, which is not bound by it).
pub fn receive_buffer_for(min_rtt: Duration, ceiling: usize) -> Option<usize> {
    let product = min_rtt.as_nanos().saturating_mul(u128::from(RECEIVE_RATE)) / 1_000_000_000;
    let size = usize::try_from(product).unwrap_or(usize::MAX);
    (size <= ceiling).then_some(size.max(MIN_RECEIVE_BUFFER).min(ceiling))
}

/// What the kernel reports for a receive buffer set to `size`: Linux keeps twice the value set
/// (its bookkeeping share); other systems report the value itself.
#[cfg(unix)]
fn kernel_share(size: usize) -> usize {
    if cfg!(any(target_os = "linux", target_os = "android")) {
        size.saturating_mul(2)
    } else {
        size
    }
}

/// The most a socket may ask for here: [`MAX_RECEIVE_BUFFER`], or less when Linux's
/// `net.core.rmem_max` is lower (it caps `SO_RCVBUF`; 208 KiB on many distributions). Read once.
pub fn receive_buffer_ceiling() -> usize {
    static CEILING: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *CEILING.get_or_init(|| {
        let kernel = std::fs::read_to_string("/proc/sys/net/core/rmem_max")
            .ok()
            .and_then(|text| text.trim().parse::<usize>().ok());
        kernel.map_or(MAX_RECEIVE_BUFFER, |max| max.min(MAX_RECEIVE_BUFFER))
    })
}

/// The handle a link's driver sizes its socket's receive buffer through, once, when the link
/// has measured a round trip within the ceiling ([`receive_buffer_for`]). Give it to
/// [`spawn_tuned`].
///
/// It holds a duplicate of the socket's descriptor until then (or until the link closes), and
/// lets go of it once it decided. It never makes the buffer smaller than the kernel already has
/// it, and never changes it again: shrinking a buffer under an advertised window makes the
/// kernel prune data it accepted.
///
/// [`spawn_tuned`]: crate::spawn_tuned
#[derive(Debug, Default)]
pub struct ReceiveBuffer {
    #[cfg(unix)]
    socket: Option<std::os::fd::OwnedFd>,
    /// The round trip last found too long: only a shorter one is worth another look.
    #[cfg(unix)]
    too_long: Option<Duration>,
}

impl ReceiveBuffer {
    /// A handle on `stream`'s receive buffer. If the descriptor cannot be duplicated (or off
    /// Unix) the handle does nothing and the kernel keeps tuning the buffer.
    pub fn of(stream: &TcpStream) -> Self {
        #[cfg(unix)]
        {
            use std::os::fd::AsFd;
            match stream.as_fd().try_clone_to_owned() {
                Ok(fd) => Self::on(fd),
                Err(error) => {
                    tracing::debug!(%error, "uplink receive buffer left to the kernel");
                    Self::default()
                }
            }
        }
        #[cfg(not(unix))]
        {
            let _ = stream;
            Self::default()
        }
    }

    #[cfg(unix)]
    fn on(socket: std::os::fd::OwnedFd) -> Self {
        Self {
            socket: Some(socket),
            too_long: None,
        }
    }

    /// A handle that does nothing (a socket that is not TCP, or a test's in-memory pipe).
    pub fn untuned() -> Self {
        Self::default()
    }

    /// Whether the handle still waits for its round trip.
    pub(crate) fn pending(&self) -> bool {
        #[cfg(unix)]
        {
            self.socket.is_some()
        }
        #[cfg(not(unix))]
        false
    }

    /// Sizes the buffer for the link's smallest round trip so far. A round trip past the
    /// ceiling decides nothing (the first samples of a busy machine run long): the handle keeps
    /// the socket for a shorter one. Otherwise it decides once and lets go of the socket: it sets
    /// the size unless the kernel's buffer already grew past it (setting it then would shrink
    /// the buffer under its window). Returns the size set, if one was.
    pub(crate) fn fit(&mut self, min_rtt: Duration) -> Option<usize> {
        #[cfg(unix)]
        {
            self.socket.as_ref()?;
            if self.too_long.is_some_and(|too_long| min_rtt >= too_long) {
                return None;
            }
            let Some(size) = receive_buffer_for(min_rtt, receive_buffer_ceiling()) else {
                tracing::debug!(
                    ?min_rtt,
                    "uplink receive buffer: the path looks long so far; waiting for a shorter round trip"
                );
                self.too_long = Some(min_rtt);
                return None;
            };
            let socket = self.socket.take()?;
            let socket = socket2::SockRef::from(&socket);
            match socket.recv_buffer_size() {
                Ok(now) if now > kernel_share(size) => {
                    tracing::debug!(
                        size,
                        kernel = now,
                        "uplink receive buffer left to the kernel: it already grew past the size"
                    );
                    return None;
                }
                Ok(_) => {}
                Err(error) => {
                    tracing::debug!(%error, "uplink receive buffer not read; left to the kernel");
                    return None;
                }
            }
            if let Err(error) = socket.set_recv_buffer_size(size) {
                tracing::debug!(%error, size, "uplink receive buffer not set");
                return None;
            }
            tracing::debug!(
                ?min_rtt,
                size,
                "uplink receive buffer sized to the link's round trip"
            );
            Some(size)
        }
        #[cfg(not(unix))]
        {
            let _ = min_rtt;
            None
        }
    }

    /// Lets go of the socket without sizing (the link is closing).
    pub(crate) fn release(&mut self) {
        #[cfg(unix)]
        {
            self.socket = None;
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, reason = "tests")]

    use super::*;

    const MIB: usize = 1024 * 1024;

    #[test]
    fn a_short_path_gets_the_floor() {
        for rtt in [
            Duration::ZERO,
            Duration::from_micros(40),
            Duration::from_micros(200),
        ] {
            assert_eq!(
                receive_buffer_for(rtt, MAX_RECEIVE_BUFFER),
                Some(MIN_RECEIVE_BUFFER)
            );
        }
    }

    #[test]
    fn a_longer_path_gets_the_10_gbit_product() {
        // 1 ms at 1.25 GB/s.
        assert_eq!(
            receive_buffer_for(Duration::from_millis(1), MAX_RECEIVE_BUFFER),
            Some(1_250_000)
        );
        assert_eq!(
            receive_buffer_for(Duration::from_micros(500), MAX_RECEIVE_BUFFER),
            Some(625_000)
        );
        // Just past the floor's round trip (256 KiB at 1.25 GB/s is about 210 µs).
        assert_eq!(
            receive_buffer_for(Duration::from_micros(220), MAX_RECEIVE_BUFFER),
            Some(275_000)
        );
    }

    #[test]
    fn the_ceiling_holds_and_one_past_it_leaves_the_kernel_alone() {
        let at_ceiling =
            Duration::from_nanos(MAX_RECEIVE_BUFFER as u64 * 1_000_000_000 / RECEIVE_RATE);
        assert!(
            receive_buffer_for(at_ceiling, MAX_RECEIVE_BUFFER)
                .is_some_and(|size| size <= MAX_RECEIVE_BUFFER)
        );
        let past = at_ceiling + Duration::from_micros(1);
        assert_eq!(receive_buffer_for(past, MAX_RECEIVE_BUFFER), None);
        assert_eq!(
            receive_buffer_for(Duration::from_secs(3600), MAX_RECEIVE_BUFFER),
            None
        );
        assert_eq!(receive_buffer_for(Duration::MAX, MAX_RECEIVE_BUFFER), None);
    }

    #[test]
    fn a_low_kernel_limit_lowers_the_ceiling_and_the_floor() {
        // Linux's usual net.core.rmem_max.
        let rmem_max = 212_992;
        assert_eq!(
            receive_buffer_for(Duration::from_micros(50), rmem_max),
            Some(rmem_max),
            "the floor is cut to what the kernel grants"
        );
        // 170 µs is 212 500 bytes at 10 Gbit/s: still within; 171 µs is past.
        assert_eq!(
            receive_buffer_for(Duration::from_micros(170), rmem_max),
            Some(rmem_max)
        );
        assert_eq!(
            receive_buffer_for(Duration::from_micros(171), rmem_max),
            None,
            "a longer path keeps the kernel's tuning instead of a capped buffer"
        );
        assert_eq!(receive_buffer_for(Duration::from_millis(1), rmem_max), None);
    }

    #[test]
    fn the_ceiling_is_the_kernels_limit_at_most_4_mib() {
        let ceiling = receive_buffer_ceiling();
        assert!(ceiling <= MAX_RECEIVE_BUFFER);
        #[cfg(target_os = "linux")]
        {
            let rmem_max: usize = std::fs::read_to_string("/proc/sys/net/core/rmem_max")
                .unwrap()
                .trim()
                .parse()
                .unwrap();
            assert_eq!(ceiling, rmem_max.min(4 * MIB));
        }
    }

    async fn tcp_pair() -> (TcpStream, TcpStream) {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (client, accepted) = tokio::join!(TcpStream::connect(addr), listener.accept());
        (client.unwrap(), accepted.unwrap().0)
    }

    #[cfg(target_os = "linux")]
    #[tokio::test]
    async fn a_round_trip_within_the_ceiling_sizes_the_socket_once() {
        let (client, _server) = tcp_pair().await;
        let mut buffer = ReceiveBuffer::of(&client);
        assert!(buffer.pending());

        let expected = MIN_RECEIVE_BUFFER.min(receive_buffer_ceiling());
        assert_eq!(buffer.fit(Duration::from_micros(50)), Some(expected));
        assert!(!buffer.pending(), "the descriptor is let go");
        // Linux keeps twice the value set (its bookkeeping share).
        let set = socket2::SockRef::from(&client).recv_buffer_size().unwrap();
        assert_eq!(set, 2 * expected);

        // Later round trips change nothing: a buffer never shrinks under its window.
        assert_eq!(buffer.fit(Duration::from_micros(10)), None);
        assert_eq!(buffer.fit(Duration::from_millis(1)), None);
        assert_eq!(
            socket2::SockRef::from(&client).recv_buffer_size().unwrap(),
            set
        );
    }

    #[cfg(target_os = "linux")]
    #[tokio::test]
    async fn a_long_round_trip_waits_for_a_shorter_one() {
        let (client, _server) = tcp_pair().await;
        let before = socket2::SockRef::from(&client).recv_buffer_size().unwrap();
        let mut buffer = ReceiveBuffer::of(&client);
        assert_eq!(buffer.fit(Duration::from_millis(50)), None);
        assert!(buffer.pending(), "a long sample decides nothing");
        assert_eq!(buffer.fit(Duration::from_millis(50)), None);
        assert_eq!(buffer.fit(Duration::from_millis(60)), None);
        assert!(buffer.pending());
        assert_eq!(
            socket2::SockRef::from(&client).recv_buffer_size().unwrap(),
            before,
            "the kernel keeps tuning meanwhile"
        );
        // A busy machine's first samples ran long; the path is short.
        let expected = MIN_RECEIVE_BUFFER.min(receive_buffer_ceiling());
        assert_eq!(buffer.fit(Duration::from_micros(50)), Some(expected));
        assert!(!buffer.pending());
        assert_eq!(
            socket2::SockRef::from(&client).recv_buffer_size().unwrap(),
            2 * expected
        );
    }

    #[cfg(target_os = "linux")]
    #[tokio::test]
    async fn a_buffer_the_kernel_already_grew_past_the_size_is_never_shrunk() {
        let size = MIN_RECEIVE_BUFFER.min(receive_buffer_ceiling());
        // As auto-tuning would have grown it under traffic. (Under an rmem_max at or below the
        // floor nothing set here can pass the size; the check after this one still runs.)
        if receive_buffer_ceiling() > size {
            let (client, _server) = tcp_pair().await;
            let socket = socket2::SockRef::from(&client);
            socket
                .set_recv_buffer_size(receive_buffer_ceiling())
                .unwrap();
            let grown = socket.recv_buffer_size().unwrap();
            assert!(grown > 2 * size);
            let mut buffer = ReceiveBuffer::of(&client);
            assert_eq!(buffer.fit(Duration::from_micros(50)), None);
            assert!(!buffer.pending(), "decided: left to the kernel");
            assert_eq!(socket.recv_buffer_size().unwrap(), grown);
        }
        // Just at the size is not a shrink.
        let (client, _server) = tcp_pair().await;
        let socket = socket2::SockRef::from(&client);
        socket.set_recv_buffer_size(size).unwrap();
        let mut buffer = ReceiveBuffer::of(&client);
        assert_eq!(buffer.fit(Duration::from_micros(50)), Some(size));
    }

    #[cfg(unix)]
    #[test]
    fn a_descriptor_that_is_not_a_socket_sets_nothing_and_is_let_go() {
        let file = std::fs::File::open("/dev/null").unwrap();
        let mut buffer = ReceiveBuffer::on(std::os::fd::OwnedFd::from(file));
        assert!(buffer.pending());
        assert_eq!(buffer.fit(Duration::from_micros(50)), None);
        assert!(!buffer.pending(), "no retry on every read round");
    }

    #[cfg(unix)]
    #[tokio::test]
    async fn a_released_handle_sets_nothing() {
        let (client, _server) = tcp_pair().await;
        let mut buffer = ReceiveBuffer::of(&client);
        buffer.release();
        assert!(!buffer.pending());
        assert_eq!(buffer.fit(Duration::from_micros(50)), None);
    }

    #[test]
    fn an_untuned_handle_sets_nothing() {
        let mut buffer = ReceiveBuffer::untuned();
        assert!(!buffer.pending());
        assert_eq!(buffer.fit(Duration::from_micros(50)), None);
    }
}
