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
//!   for a thread. [`ReceiveBuffer`] sizes it to the bandwidth-delay product of a 10 Gbit/s path
//!   at the link's smallest measured round trip, so on a short path the backlog stays in the
//!   sender's link queue, where a text frame overtakes it. On a long path (the product past
//!   4 MiB) the kernel's own tuning is left alone.

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

/// The receive buffer (`SO_RCVBUF`) for a path whose smallest round trip is `min_rtt`: the
/// 10 Gbit/s bandwidth-delay product, at least [`MIN_RECEIVE_BUFFER`]; `None` past
/// [`MAX_RECEIVE_BUFFER`] (leave the kernel's tuning alone).
pub fn receive_buffer_for(min_rtt: Duration) -> Option<usize> {
    let product = min_rtt.as_nanos().saturating_mul(u128::from(RECEIVE_RATE)) / 1_000_000_000;
    let size = usize::try_from(product).unwrap_or(usize::MAX);
    (size <= MAX_RECEIVE_BUFFER).then_some(size.max(MIN_RECEIVE_BUFFER))
}

/// The handle a link's driver sizes its socket's receive buffer through, once the link has
/// measured its round trip ([`receive_buffer_for`]). Give it to [`spawn_tuned`].
///
/// It holds a duplicate of the socket's descriptor; the driver drops it when the link closes.
///
/// [`spawn_tuned`]: crate::spawn_tuned
#[derive(Debug, Default)]
pub struct ReceiveBuffer {
    #[cfg(unix)]
    socket: Option<std::os::fd::OwnedFd>,
    /// The size set last.
    applied: Option<usize>,
}

impl ReceiveBuffer {
    /// A handle on `stream`'s receive buffer. If the descriptor cannot be duplicated (or off
    /// Unix) the handle does nothing and the kernel keeps tuning the buffer.
    pub fn of(stream: &TcpStream) -> Self {
        #[cfg(unix)]
        {
            use std::os::fd::AsFd;
            let socket = match stream.as_fd().try_clone_to_owned() {
                Ok(fd) => Some(fd),
                Err(error) => {
                    tracing::debug!(%error, "uplink receive buffer left to the kernel");
                    None
                }
            };
            Self {
                socket,
                applied: None,
            }
        }
        #[cfg(not(unix))]
        {
            let _ = stream;
            Self::default()
        }
    }

    /// A handle that does nothing (a socket that is not TCP, or a test's in-memory pipe).
    pub fn untuned() -> Self {
        Self::default()
    }

    /// The size set last, if any.
    pub fn applied(&self) -> Option<usize> {
        self.applied
    }

    /// Sizes the buffer for `min_rtt`. Returns the size set, if it changed.
    pub(crate) fn fit(&mut self, min_rtt: Duration) -> Option<usize> {
        let size = receive_buffer_for(min_rtt)?;
        if self.applied == Some(size) {
            return None;
        }
        #[cfg(unix)]
        {
            let socket = self.socket.as_ref()?;
            if let Err(error) = socket2::SockRef::from(socket).set_recv_buffer_size(size) {
                tracing::debug!(%error, size, "uplink receive buffer not set");
                return None;
            }
            tracing::debug!(
                ?min_rtt,
                size,
                "uplink receive buffer sized to the link's round trip"
            );
            self.applied = Some(size);
            Some(size)
        }
        #[cfg(not(unix))]
        None
    }

    /// Lets go of the socket (the link is closing).
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

    #[test]
    fn a_short_path_gets_the_floor() {
        assert_eq!(
            receive_buffer_for(Duration::from_micros(40)),
            Some(MIN_RECEIVE_BUFFER)
        );
        assert_eq!(receive_buffer_for(Duration::ZERO), Some(MIN_RECEIVE_BUFFER));
    }

    #[test]
    fn a_longer_path_gets_the_10_gbit_product() {
        // 1 ms at 1.25 GB/s.
        assert_eq!(
            receive_buffer_for(Duration::from_millis(1)),
            Some(1_250_000)
        );
        assert_eq!(
            receive_buffer_for(Duration::from_micros(500)),
            Some(625_000)
        );
        // Just past the floor's round trip (256 KiB at 1.25 GB/s is about 210 µs).
        assert_eq!(
            receive_buffer_for(Duration::from_micros(220)),
            Some(275_000)
        );
        assert_eq!(
            receive_buffer_for(Duration::from_micros(200)),
            Some(MIN_RECEIVE_BUFFER)
        );
    }

    #[test]
    fn the_ceiling_holds_and_one_past_it_leaves_the_kernel_alone() {
        let at_ceiling =
            Duration::from_nanos(MAX_RECEIVE_BUFFER as u64 * 1_000_000_000 / RECEIVE_RATE);
        assert!(receive_buffer_for(at_ceiling).is_some_and(|size| size <= MAX_RECEIVE_BUFFER));
        let past = at_ceiling + Duration::from_micros(1);
        assert_eq!(receive_buffer_for(past), None);
        assert_eq!(receive_buffer_for(Duration::from_secs(3600)), None);
        assert_eq!(receive_buffer_for(Duration::MAX), None);
    }

    #[tokio::test]
    async fn fitting_sets_the_socket_once_per_size() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (client, accepted) = tokio::join!(TcpStream::connect(addr), listener.accept());
        let (client, (_server, _)) = (client.unwrap(), accepted.unwrap());
        let mut buffer = ReceiveBuffer::of(&client);
        assert_eq!(buffer.applied(), None);

        assert_eq!(
            buffer.fit(Duration::from_micros(50)),
            Some(MIN_RECEIVE_BUFFER)
        );
        assert_eq!(buffer.applied(), Some(MIN_RECEIVE_BUFFER));
        let set = socket2::SockRef::from(&client).recv_buffer_size().unwrap();
        // Linux reports twice the value set (its bookkeeping share).
        assert!(
            (MIN_RECEIVE_BUFFER..=2 * MIN_RECEIVE_BUFFER).contains(&set),
            "{set}"
        );
        assert_eq!(
            buffer.fit(Duration::from_micros(60)),
            None,
            "same size, no call"
        );
        // A long path leaves the last size in place.
        assert_eq!(buffer.fit(Duration::from_millis(100)), None);
        assert_eq!(buffer.applied(), Some(MIN_RECEIVE_BUFFER));

        buffer.release();
        assert_eq!(
            buffer.fit(Duration::from_millis(1)),
            None,
            "released: nothing to set"
        );
    }

    #[tokio::test]
    async fn an_untuned_handle_sets_nothing() {
        let mut buffer = ReceiveBuffer::untuned();
        assert_eq!(buffer.fit(Duration::from_micros(50)), None);
        assert_eq!(buffer.applied(), None);
    }
}
