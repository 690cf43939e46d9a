//! Transports: a stream of lines in and a sink of lines out, over any byte stream or over
//! text messages (the uplink's priority lane).

use std::io;
use std::pin::Pin;

use bytes::Bytes;
use futures::{Sink, SinkExt, Stream, StreamExt};
use tokio::io::{AsyncRead, AsyncWrite};
use tokio_util::codec::{FramedRead, FramedWrite};
use tokio_util::io::StreamReader;

use crate::codec::{Line, LineCodec};

/// The reading half: one item per line.
pub type LineStream = Pin<Box<dyn Stream<Item = io::Result<Line>> + Send>>;
/// The writing half: each item is one serialised frame, newline included.
pub type LineSink = Pin<Box<dyn Sink<Bytes, Error = io::Error> + Send>>;

/// A connection's two halves, ready for a [`crate::serve`] session or a [`crate::WireClient`].
pub struct Transport {
    /// Lines in.
    pub lines: LineStream,
    /// Lines out.
    pub sink: LineSink,
}

impl Transport {
    /// A transport over a byte stream's halves (a unix socket, a TCP stream), reading lines of
    /// at most `max_line` bytes.
    pub fn from_io<R, W>(reader: R, writer: W, max_line: usize) -> Self
    where
        R: AsyncRead + Send + 'static,
        W: AsyncWrite + Send + 'static,
    {
        Self {
            lines: Box::pin(FramedRead::new(reader, LineCodec::new(max_line))),
            sink: Box::pin(FramedWrite::new(writer, LineCodec::new(max_line))),
        }
    }

    /// A server transport over a byte stream: call lines of at most 1 MiB.
    pub fn server_io<R, W>(reader: R, writer: W) -> Self
    where
        R: AsyncRead + Send + 'static,
        W: AsyncWrite + Send + 'static,
    {
        Self::from_io(reader, writer, simlock_contract::bounds::MAX_CALL_LINE)
    }

    /// A client transport over a byte stream: reply and push lines of at most 64 MiB, since a
    /// worker's catalog or device list can be large.
    pub fn client_io<R, W>(reader: R, writer: W) -> Self
    where
        R: AsyncRead + Send + 'static,
        W: AsyncWrite + Send + 'static,
    {
        Self::from_io(reader, writer, simlock_contract::bounds::MAX_CLIENT_LINE)
    }

    /// A transport over text messages: each message carries one or more whole lines, or parts
    /// of one (lines are re-assembled across messages). Each outgoing frame is one message.
    pub fn from_text_messages<S, K>(messages: S, sink: K, max_line: usize) -> Self
    where
        S: Stream<Item = String> + Send + 'static,
        K: Sink<String> + Send + 'static,
        K::Error: std::error::Error + Send + Sync + 'static,
    {
        let bytes = messages.map(|text| Ok::<_, io::Error>(Bytes::from(text)));
        let reader = StreamReader::new(bytes);
        let sink = sink
            .sink_map_err(io::Error::other)
            .with(|bytes: Bytes| async move {
                String::from_utf8(bytes.to_vec())
                    .map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e))
            });
        Self {
            lines: Box::pin(FramedRead::new(reader, LineCodec::new(max_line))),
            sink: Box::pin(sink),
        }
    }
}

impl std::fmt::Debug for Transport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Transport").finish_non_exhaustive()
    }
}
