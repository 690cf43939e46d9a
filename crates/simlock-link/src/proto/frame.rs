//! Link frames: their binary encoding, their decoder, and channel ids.
//!
//! One link frame is one binary WebSocket message. The first byte is the frame kind; a channel id
//! follows as one length byte (1–32) and that many bytes of `[A-Za-z0-9-]`; then the kind's body.
//! Integers are big-endian. A frame has exactly the length its kind implies (DATA: its payload is
//! the rest of the message, 1 to 16 KiB), so trailing bytes are malformed. The full table is in
//! `docs/LINK.md`.
//!
//! ```text
//! 0x01 OPEN     id
//! 0x02 DATA     id payload(1..=16384)
//! 0x03 CREDIT   id u32 (> 0)
//! 0x04 END      id
//! 0x05 STOP     id
//! 0x06 ABORT    id u8 reason
//! 0x07 PING     u64 nonce
//! 0x08 PONG     u64 nonce
//! 0x09 RELEASE  id
//! ```
//!
//! The decoder never panics and never allocates: a DATA payload is a slice of the message.

use std::fmt;

use bytes::{BufMut, Bytes, BytesMut};

use crate::error::FailureReason;

/// Longest channel id, in bytes (the design's bound, shared with the relay's `channel` field).
pub const MAX_ID_LEN: usize = 32;

/// Largest DATA payload: 16 KiB bounds how long one channel can hold the socket before another
/// channel's frame or a priority frame goes (the HTTP/2 default frame size; yamux splits at 16 KiB).
pub const MAX_DATA_LEN: usize = 16 * 1024;

/// Largest encoded frame: a DATA frame with the longest id and the largest payload.
pub const MAX_FRAME_LEN: usize = 2 + MAX_ID_LEN + MAX_DATA_LEN;

/// The kind byte of every frame.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
#[repr(u8)]
pub enum FrameKind {
    /// `OPEN id`: the gateway opens a channel.
    Open = 0x01,
    /// `DATA id bytes`: bytes of the sender's direction.
    Data = 0x02,
    /// `CREDIT id n`: the receiver of a direction allows `n` more bytes.
    Credit = 0x03,
    /// `END id`: the sender finished its direction.
    End = 0x04,
    /// `STOP id`: the receiver wants no more of the peer's direction.
    Stop = 0x05,
    /// `ABORT id reason`: both directions fail; the sender's last frame for the channel.
    Abort = 0x06,
    /// `PING n`: liveness probe and RTT sample.
    Ping = 0x07,
    /// `PONG n`: answer to `PING n`.
    Pong = 0x08,
    /// `RELEASE id`: the sender will send no more frames for the channel.
    Release = 0x09,
}

impl FrameKind {
    /// The kind for a kind byte, if it is one.
    pub fn from_byte(byte: u8) -> Option<Self> {
        Some(match byte {
            0x01 => Self::Open,
            0x02 => Self::Data,
            0x03 => Self::Credit,
            0x04 => Self::End,
            0x05 => Self::Stop,
            0x06 => Self::Abort,
            0x07 => Self::Ping,
            0x08 => Self::Pong,
            0x09 => Self::Release,
            _ => return None,
        })
    }

    /// The upper-case name used in the docs and in logs.
    pub fn name(self) -> &'static str {
        match self {
            Self::Open => "OPEN",
            Self::Data => "DATA",
            Self::Credit => "CREDIT",
            Self::End => "END",
            Self::Stop => "STOP",
            Self::Abort => "ABORT",
            Self::Ping => "PING",
            Self::Pong => "PONG",
            Self::Release => "RELEASE",
        }
    }
}

impl fmt::Display for FrameKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// A channel id: 1–32 bytes of `[A-Za-z0-9-]`, stored inline (it is `Copy`).
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct ChannelId {
    len: u8,
    bytes: [u8; MAX_ID_LEN],
}

/// A string that is not a valid channel id.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("invalid channel id: must be 1 to 32 bytes of [A-Za-z0-9-]")]
pub struct InvalidChannelId;

impl ChannelId {
    /// Parses a channel id.
    ///
    /// # Errors
    /// [`InvalidChannelId`] when `id` is empty, longer than 32 bytes, or has a byte outside
    /// `[A-Za-z0-9-]`.
    pub fn new(id: &str) -> Result<Self, InvalidChannelId> {
        Self::from_bytes(id.as_bytes()).ok_or(InvalidChannelId)
    }

    fn from_bytes(raw: &[u8]) -> Option<Self> {
        if raw.is_empty() || raw.len() > MAX_ID_LEN || !raw.iter().copied().all(is_id_byte) {
            return None;
        }
        let mut bytes = [0u8; MAX_ID_LEN];
        bytes[..raw.len()].copy_from_slice(raw);
        Some(Self {
            len: u8::try_from(raw.len()).ok()?,
            bytes,
        })
    }

    /// The id as a string.
    pub fn as_str(&self) -> &str {
        // Only ASCII bytes are ever stored, so this conversion cannot fail.
        std::str::from_utf8(self.as_bytes()).unwrap_or_default()
    }

    /// The id's bytes.
    pub fn as_bytes(&self) -> &[u8] {
        &self.bytes[..usize::from(self.len)]
    }

    /// The id for a link-assigned number (the gateway end numbers its channels): `c` and lower-case hex.
    pub(crate) fn numbered(n: u64) -> Self {
        let mut bytes = [0u8; MAX_ID_LEN];
        bytes[0] = b'c';
        let digits = format!("{n:x}");
        let len = 1 + digits.len();
        bytes[1..len].copy_from_slice(digits.as_bytes());
        Self {
            // At most 1 + 16 bytes: always fits.
            len: u8::try_from(len).unwrap_or(1),
            bytes,
        }
    }
}

fn is_id_byte(byte: u8) -> bool {
    byte.is_ascii_alphanumeric() || byte == b'-'
}

impl fmt::Display for ChannelId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl fmt::Debug for ChannelId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "ChannelId({:?})", self.as_str())
    }
}

impl std::str::FromStr for ChannelId {
    type Err = InvalidChannelId;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Self::new(s)
    }
}

/// One decoded link frame.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Frame {
    /// The gateway opens channel `id`.
    Open {
        /// The channel.
        id: ChannelId,
    },
    /// Bytes of the sender's direction of channel `id`.
    Data {
        /// The channel.
        id: ChannelId,
        /// 1 to 16 KiB of payload.
        payload: Bytes,
    },
    /// The sender, as a reader, allows `amount` more bytes of the peer's direction.
    Credit {
        /// The channel.
        id: ChannelId,
        /// How many more bytes may be sent (never zero).
        amount: u32,
    },
    /// The sender finished its direction of channel `id`.
    End {
        /// The channel.
        id: ChannelId,
    },
    /// The sender wants no more of the peer's direction of channel `id`.
    Stop {
        /// The channel.
        id: ChannelId,
    },
    /// Both directions of channel `id` fail with `reason`; no more frames follow from the sender.
    Abort {
        /// The channel.
        id: ChannelId,
        /// The reason the peer's end of the channel fails with.
        reason: FailureReason,
    },
    /// Liveness probe; answered with `Pong` of the same nonce.
    Ping {
        /// Echoed in the answer.
        nonce: u64,
    },
    /// Answer to `Ping`.
    Pong {
        /// The nonce of the ping answered.
        nonce: u64,
    },
    /// The sender will send no more frames for channel `id` (the closing handshake).
    Release {
        /// The channel.
        id: ChannelId,
    },
}

/// Why a binary message is not a valid frame.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum DecodeError {
    /// The message was empty.
    #[error("empty frame")]
    Empty,
    /// The kind byte is not a known frame kind.
    #[error("unknown frame kind 0x{0:02x}")]
    UnknownKind(u8),
    /// The message is longer than any frame can be.
    #[error("oversized frame: {0} bytes")]
    Oversized(usize),
    /// The message ends before the frame does.
    #[error("truncated {0} frame")]
    Truncated(FrameKind),
    /// The message has bytes after the frame.
    #[error("{0} frame has trailing bytes")]
    TrailingBytes(FrameKind),
    /// The channel id is empty, too long, or has a byte outside `[A-Za-z0-9-]`.
    #[error("malformed channel id in {0} frame")]
    MalformedId(FrameKind),
    /// A DATA frame without payload.
    #[error("empty DATA frame")]
    EmptyData,
    /// A DATA payload over 16 KiB.
    #[error("DATA payload of {0} bytes exceeds 16 KiB")]
    OversizedData(usize),
    /// A CREDIT frame granting nothing.
    #[error("CREDIT of zero")]
    ZeroCredit,
    /// An ABORT frame with an unknown reason code.
    #[error("unknown ABORT reason 0x{0:02x}")]
    UnknownReason(u8),
}

fn reason_code(reason: FailureReason) -> u8 {
    match reason {
        FailureReason::Stopped => 1,
        FailureReason::Aborted => 2,
        FailureReason::Closed => 3,
        FailureReason::Stalled => 4,
        FailureReason::Refused => 5,
    }
}

fn reason_from_code(code: u8) -> Option<FailureReason> {
    Some(match code {
        1 => FailureReason::Stopped,
        2 => FailureReason::Aborted,
        3 => FailureReason::Closed,
        4 => FailureReason::Stalled,
        5 => FailureReason::Refused,
        _ => return None,
    })
}

impl Frame {
    /// The frame's kind.
    pub fn kind(&self) -> FrameKind {
        match self {
            Self::Open { .. } => FrameKind::Open,
            Self::Data { .. } => FrameKind::Data,
            Self::Credit { .. } => FrameKind::Credit,
            Self::End { .. } => FrameKind::End,
            Self::Stop { .. } => FrameKind::Stop,
            Self::Abort { .. } => FrameKind::Abort,
            Self::Ping { .. } => FrameKind::Ping,
            Self::Pong { .. } => FrameKind::Pong,
            Self::Release { .. } => FrameKind::Release,
        }
    }

    /// The channel the frame is about (none for PING and PONG).
    pub fn channel(&self) -> Option<ChannelId> {
        match self {
            Self::Open { id }
            | Self::Data { id, .. }
            | Self::Credit { id, .. }
            | Self::End { id }
            | Self::Stop { id }
            | Self::Abort { id, .. }
            | Self::Release { id } => Some(*id),
            Self::Ping { .. } | Self::Pong { .. } => None,
        }
    }

    /// The encoded length in bytes.
    pub fn encoded_len(&self) -> usize {
        let id = |id: &ChannelId| 1 + id.as_bytes().len();
        1 + match self {
            Self::Open { id: c }
            | Self::End { id: c }
            | Self::Stop { id: c }
            | Self::Release { id: c } => id(c),
            Self::Data { id: c, payload } => id(c) + payload.len(),
            Self::Credit { id: c, .. } => id(c) + 4,
            Self::Abort { id: c, .. } => id(c) + 1,
            Self::Ping { .. } | Self::Pong { .. } => 8,
        }
    }

    /// Appends the frame's encoding to `out`.
    ///
    /// A DATA frame's payload is written as is; the caller keeps it within 1..=16 KiB (the
    /// decoder rejects anything else).
    pub fn encode(&self, out: &mut BytesMut) {
        out.reserve(self.encoded_len());
        out.put_u8(self.kind() as u8);
        match self {
            Self::Open { id } | Self::End { id } | Self::Stop { id } | Self::Release { id } => {
                put_id(out, id);
            }
            Self::Data { id, payload } => {
                put_id(out, id);
                out.put_slice(payload);
            }
            Self::Credit { id, amount } => {
                put_id(out, id);
                out.put_u32(*amount);
            }
            Self::Abort { id, reason } => {
                put_id(out, id);
                out.put_u8(reason_code(*reason));
            }
            Self::Ping { nonce } | Self::Pong { nonce } => out.put_u64(*nonce),
        }
    }

    /// Encodes the frame into a fresh buffer.
    pub fn to_bytes(&self) -> Bytes {
        let mut out = BytesMut::with_capacity(self.encoded_len());
        self.encode(&mut out);
        out.freeze()
    }

    /// Decodes one binary message. A DATA payload is a zero-copy slice of `message`.
    ///
    /// # Errors
    /// A [`DecodeError`] naming what is wrong; never panics, whatever the input.
    pub fn decode(message: &Bytes) -> Result<Self, DecodeError> {
        let (&kind_byte, rest) = message.split_first().ok_or(DecodeError::Empty)?;
        let kind = FrameKind::from_byte(kind_byte).ok_or(DecodeError::UnknownKind(kind_byte))?;
        if message.len() > MAX_FRAME_LEN {
            return Err(DecodeError::Oversized(message.len()));
        }
        if matches!(kind, FrameKind::Ping | FrameKind::Pong) {
            let nonce: [u8; 8] = rest.try_into().map_err(|_| {
                if rest.len() < 8 {
                    DecodeError::Truncated(kind)
                } else {
                    DecodeError::TrailingBytes(kind)
                }
            })?;
            let nonce = u64::from_be_bytes(nonce);
            return Ok(if kind == FrameKind::Ping {
                Self::Ping { nonce }
            } else {
                Self::Pong { nonce }
            });
        }
        let (&id_len, rest) = rest.split_first().ok_or(DecodeError::Truncated(kind))?;
        let id_len = usize::from(id_len);
        if id_len == 0 || id_len > MAX_ID_LEN {
            return Err(DecodeError::MalformedId(kind));
        }
        if rest.len() < id_len {
            return Err(DecodeError::Truncated(kind));
        }
        let (raw_id, body) = rest.split_at(id_len);
        let id = ChannelId::from_bytes(raw_id).ok_or(DecodeError::MalformedId(kind))?;
        let exact = |len: usize| match body.len() {
            n if n < len => Err(DecodeError::Truncated(kind)),
            n if n > len => Err(DecodeError::TrailingBytes(kind)),
            _ => Ok(()),
        };
        match kind {
            FrameKind::Open => exact(0).map(|()| Self::Open { id }),
            FrameKind::End => exact(0).map(|()| Self::End { id }),
            FrameKind::Stop => exact(0).map(|()| Self::Stop { id }),
            FrameKind::Release => exact(0).map(|()| Self::Release { id }),
            FrameKind::Data => {
                if body.is_empty() {
                    return Err(DecodeError::EmptyData);
                }
                if body.len() > MAX_DATA_LEN {
                    return Err(DecodeError::OversizedData(body.len()));
                }
                let start = 2 + id_len;
                Ok(Self::Data {
                    id,
                    payload: message.slice(start..),
                })
            }
            FrameKind::Credit => {
                exact(4)?;
                let amount: [u8; 4] = body.try_into().map_err(|_| DecodeError::Truncated(kind))?;
                match u32::from_be_bytes(amount) {
                    0 => Err(DecodeError::ZeroCredit),
                    amount => Ok(Self::Credit { id, amount }),
                }
            }
            FrameKind::Abort => {
                exact(1)?;
                let code = body.first().copied().ok_or(DecodeError::Truncated(kind))?;
                let reason = reason_from_code(code).ok_or(DecodeError::UnknownReason(code))?;
                Ok(Self::Abort { id, reason })
            }
            // Handled above; kept exhaustive so a new kind cannot be forgotten here.
            FrameKind::Ping | FrameKind::Pong => Err(DecodeError::UnknownKind(kind_byte)),
        }
    }
}

fn put_id(out: &mut BytesMut, id: &ChannelId) {
    out.put_u8(id.len);
    out.put_slice(id.as_bytes());
}

/// Appends a DATA frame's header (kind and id) to `out`; the payload follows it.
pub(crate) fn put_data_header(out: &mut BytesMut, id: &ChannelId) {
    out.put_u8(FrameKind::Data as u8);
    put_id(out, id);
}

/// Bytes of application data already encoded as consecutive DATA frames of one channel, so the
/// link can send them without copying again. Build it outside any lock with
/// [`EncodedData::new`] and queue it with [`Link::write_encoded`](super::Link::write_encoded).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EncodedData {
    pub(crate) id: ChannelId,
    /// The frames, back to back.
    pub(crate) frames: Bytes,
    /// Payload bytes in all the frames.
    pub(crate) payload: usize,
    /// Payload bytes per frame (the last may have fewer).
    pub(crate) frame_payload: usize,
}

impl EncodedData {
    /// Encodes `data` for channel `id` as DATA frames of `frame_payload` bytes (clamped to 1..=16 KiB).
    pub fn new(id: ChannelId, data: &[u8], frame_payload: usize) -> Self {
        let frame_payload = frame_payload.clamp(1, MAX_DATA_LEN);
        let header = data_header_len(&id);
        let count = data.len().div_ceil(frame_payload);
        let mut frames = BytesMut::with_capacity(data.len() + count * header);
        for chunk in data.chunks(frame_payload) {
            put_data_header(&mut frames, &id);
            frames.put_slice(chunk);
        }
        Self {
            id,
            frames: frames.freeze(),
            payload: data.len(),
            frame_payload,
        }
    }

    /// Payload bytes.
    pub fn len(&self) -> usize {
        self.payload
    }

    /// No payload at all.
    pub fn is_empty(&self) -> bool {
        self.payload == 0
    }
}

/// The length of a DATA frame's header for channel `id`.
pub(crate) fn data_header_len(id: &ChannelId) -> usize {
    2 + usize::from(id.len)
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    fn id(s: &str) -> ChannelId {
        ChannelId::new(s).unwrap()
    }

    #[test]
    fn ids_are_checked() {
        assert!(ChannelId::new("").is_err());
        assert!(ChannelId::new(&"a".repeat(33)).is_err());
        assert!(ChannelId::new("a_b").is_err());
        assert!(ChannelId::new("é").is_err());
        assert_eq!(id(&"Z".repeat(32)).as_str(), "Z".repeat(32));
        assert_eq!(id("abc-09").to_string(), "abc-09");
        assert_eq!(ChannelId::numbered(0).as_str(), "c0");
        assert_eq!(ChannelId::numbered(u64::MAX).as_str(), "cffffffffffffffff");
    }

    #[test]
    fn encoding_is_as_documented() {
        let frame = Frame::Credit {
            id: id("ab"),
            amount: 0x0102_0304,
        };
        assert_eq!(&frame.to_bytes()[..], &[0x03, 2, b'a', b'b', 1, 2, 3, 4]);
        let frame = Frame::Abort {
            id: id("x"),
            reason: FailureReason::Refused,
        };
        assert_eq!(&frame.to_bytes()[..], &[0x06, 1, b'x', 5]);
        let frame = Frame::Ping { nonce: 7 };
        assert_eq!(&frame.to_bytes()[..], &[0x07, 0, 0, 0, 0, 0, 0, 0, 7]);
    }

    #[track_caller]
    fn check_err(bytes: &[u8], expected: DecodeError) {
        assert_eq!(Frame::decode(&Bytes::copy_from_slice(bytes)), Err(expected));
    }

    #[test]
    fn malformed_frames_are_named() {
        check_err(&[], DecodeError::Empty);
        check_err(&[0x00], DecodeError::UnknownKind(0));
        check_err(&[0x7f, 1, b'a'], DecodeError::UnknownKind(0x7f));
        check_err(&[0x01], DecodeError::Truncated(FrameKind::Open));
        check_err(&[0x01, 0], DecodeError::MalformedId(FrameKind::Open));
        check_err(&[0x01, 33], DecodeError::MalformedId(FrameKind::Open));
        check_err(&[0x01, 2, b'a'], DecodeError::Truncated(FrameKind::Open));
        check_err(&[0x01, 1, b'_'], DecodeError::MalformedId(FrameKind::Open));
        check_err(
            &[0x01, 1, b'a', 0],
            DecodeError::TrailingBytes(FrameKind::Open),
        );
        check_err(&[0x02, 1, b'a'], DecodeError::EmptyData);
        check_err(&[0x03, 1, b'a', 0, 0, 0, 0], DecodeError::ZeroCredit);
        check_err(
            &[0x03, 1, b'a', 0, 0, 1],
            DecodeError::Truncated(FrameKind::Credit),
        );
        check_err(&[0x06, 1, b'a', 9], DecodeError::UnknownReason(9));
        check_err(&[0x07, 0, 0], DecodeError::Truncated(FrameKind::Ping));
        check_err(&[0x08; 10], DecodeError::TrailingBytes(FrameKind::Pong));
        let mut data = vec![0x02, 1, b'a'];
        data.resize(3 + MAX_DATA_LEN + 1, 0);
        check_err(&data, DecodeError::OversizedData(MAX_DATA_LEN + 1));
        let mut huge = vec![0x02, 1, b'a'];
        huge.resize(MAX_FRAME_LEN + 1, 0);
        check_err(&huge, DecodeError::Oversized(MAX_FRAME_LEN + 1));
    }

    #[test]
    fn data_payload_is_a_slice_of_the_message() {
        let message = Frame::Data {
            id: id("c1"),
            payload: Bytes::from_static(b"hello"),
        }
        .to_bytes();
        let Ok(Frame::Data { payload, .. }) = Frame::decode(&message) else {
            panic!("not a DATA frame");
        };
        assert_eq!(&payload[..], b"hello");
        assert_eq!(payload.as_ptr(), message[4..].as_ptr());
    }

    fn arb_id() -> impl Strategy<Value = ChannelId> {
        "[A-Za-z0-9-]{1,32}".prop_map(|s| ChannelId::new(&s).unwrap())
    }

    fn arb_reason() -> impl Strategy<Value = FailureReason> {
        prop::sample::select(FailureReason::ALL.to_vec())
    }

    fn arb_frame() -> impl Strategy<Value = Frame> {
        prop_oneof![
            arb_id().prop_map(|id| Frame::Open { id }),
            (
                arb_id(),
                prop::collection::vec(any::<u8>(), 1..=MAX_DATA_LEN)
            )
                .prop_map(|(id, payload)| Frame::Data {
                    id,
                    payload: payload.into()
                }),
            (arb_id(), 1..=u32::MAX).prop_map(|(id, amount)| Frame::Credit { id, amount }),
            arb_id().prop_map(|id| Frame::End { id }),
            arb_id().prop_map(|id| Frame::Stop { id }),
            (arb_id(), arb_reason()).prop_map(|(id, reason)| Frame::Abort { id, reason }),
            any::<u64>().prop_map(|nonce| Frame::Ping { nonce }),
            any::<u64>().prop_map(|nonce| Frame::Pong { nonce }),
            arb_id().prop_map(|id| Frame::Release { id }),
        ]
    }

    proptest! {
        #[test]
        fn every_frame_round_trips(frame in arb_frame()) {
            let bytes = frame.to_bytes();
            prop_assert_eq!(bytes.len(), frame.encoded_len());
            prop_assert!(bytes.len() <= MAX_FRAME_LEN);
            prop_assert_eq!(Frame::decode(&bytes), Ok(frame));
        }

        #[test]
        fn arbitrary_bytes_never_panic(bytes in prop::collection::vec(any::<u8>(), 0..64)) {
            let message = Bytes::from(bytes);
            if let Ok(frame) = Frame::decode(&message) {
                // Whatever decodes re-encodes to the same bytes: the encoding is canonical.
                prop_assert_eq!(frame.to_bytes(), message);
            }
        }

        #[test]
        fn arbitrary_kinded_bytes_never_panic(
            kind in 0u8..12,
            len in 0u8..40,
            rest in prop::collection::vec(any::<u8>(), 0..80),
        ) {
            let mut bytes = vec![kind, len];
            bytes.extend(rest);
            let message = Bytes::from(bytes);
            if let Ok(frame) = Frame::decode(&message) {
                prop_assert_eq!(frame.to_bytes(), message);
            }
        }
    }
}
