//! [`UplinkIo`]: the socket under an uplink's WebSocket, read so that tungstenite keeps its
//! frames where they landed.
//!
//! tungstenite reads into the free end of a buffer and, before each frame, reserves room for the
//! whole frame; the buffer is shared with the frames already handed out, so when a read filled it
//! to the brim, that reserve copies every byte still unparsed into a new buffer. Under a bulk
//! transfer that copied about as many bytes as it received. `UplinkIo` leaves room for one frame
//! at the end of every read that can afford it, so the reserve mostly finds its room in place;
//! only a read into a nearly full buffer (at most two frames of room) still fills it, and a text
//! frame longer than a DATA frame still moves. Writes pass through.

use std::{
    io,
    pin::Pin,
    task::{Context, Poll},
};

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

/// Room left free after a read: a full DATA frame (16 KiB) with its link and WebSocket headers.
pub(crate) const FRAME_ROOM: usize = 16 * 1024 + 64;

/// A socket (or any byte stream) under an uplink: see the module documentation.
#[derive(Debug)]
pub struct UplinkIo<S> {
    inner: S,
}

impl<S> UplinkIo<S> {
    /// Wraps `inner`.
    pub fn new(inner: S) -> Self {
        Self { inner }
    }

    /// The wrapped stream.
    pub fn get_ref(&self) -> &S {
        &self.inner
    }

    /// Unwraps the stream.
    pub fn into_inner(self) -> S {
        self.inner
    }
}

impl<S: AsyncRead + Unpin> AsyncRead for UplinkIo<S> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        let room = buf.remaining();
        if room <= 2 * FRAME_ROOM {
            return Pin::new(&mut this.inner).poll_read(cx, buf);
        }
        // Read into all but the last frame's worth of the caller's room.
        let dst = buf.initialize_unfilled_to(room - FRAME_ROOM);
        let mut part = ReadBuf::new(dst);
        let polled = Pin::new(&mut this.inner).poll_read(cx, &mut part);
        let read = part.filled().len();
        buf.advance(read);
        polled
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for UplinkIo<S> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().inner).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().inner).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    use super::*;

    #[tokio::test]
    async fn a_large_read_leaves_one_frame_of_room_and_bytes_arrive_in_order() {
        let (mut near, far) = tokio::io::duplex(1 << 20);
        let mut io = UplinkIo::new(far);
        let data: Vec<u8> = (0..200_000u32).map(|n| (n % 251) as u8).collect();
        near.write_all(&data).await.unwrap();
        drop(near);
        let mut buf = vec![0u8; 64 * 1024];
        let n = io.read(&mut buf).await.unwrap();
        assert_eq!(n, 64 * 1024 - FRAME_ROOM, "one frame of room left");
        let mut got = buf[..n].to_vec();
        io.read_to_end(&mut got).await.unwrap();
        assert!(got == data);
    }

    #[tokio::test]
    async fn a_small_read_is_not_cut() {
        let (mut near, far) = tokio::io::duplex(1 << 20);
        let mut io = UplinkIo::new(far);
        near.write_all(&[7u8; 40_000]).await.unwrap();
        let mut buf = vec![0u8; 2 * FRAME_ROOM];
        let n = io.read(&mut buf).await.unwrap();
        assert_eq!(n, 2 * FRAME_ROOM);
        io.write_all(b"through").await.unwrap();
        let mut back = [0u8; 7];
        near.read_exact(&mut back).await.unwrap();
        assert_eq!(&back, b"through");
    }
}
