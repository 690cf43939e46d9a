//! Frames: a call, its result or error, and a push. One JSON object per line or text message.
//!
//! ```text
//! call    {"id": 1, "type": "lease.request", "payload": {...}}
//! result  {"id": 1, "ok": true, "payload": {...}}
//! error   {"id": 1, "ok": false, "error": {"code": "...", "message": "...", "details": {...}}}
//! push    {"push": "progress", "payload": {"requestId": 1, ...}}
//! ```
//!
//! An error answering a line that is not a frame carries `"id": null`.

use std::fmt;

use serde::{Deserialize, Serialize, Serializer};
use serde_json::value::RawValue;
use serde_json::{Number, Value};

use crate::error::{ContractError, ErrorBody, ErrorCode};

/// A call's id: a string or a number, chosen by the caller and echoed in the answer.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(untagged)]
pub enum FrameId {
    /// A numeric id (the simlock client counts from 1).
    Num(Number),
    /// A string id.
    Str(String),
}

impl FrameId {
    /// The id as an unsigned integer, when it is one.
    pub fn as_u64(&self) -> Option<u64> {
        match self {
            Self::Num(n) => n.as_u64(),
            Self::Str(_) => None,
        }
    }
}

impl From<u64> for FrameId {
    fn from(n: u64) -> Self {
        Self::Num(n.into())
    }
}

impl From<&str> for FrameId {
    fn from(s: &str) -> Self {
        Self::Str(s.to_owned())
    }
}

impl fmt::Display for FrameId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Num(n) => write!(f, "{n}"),
            Self::Str(s) => write!(f, "{s:?}"),
        }
    }
}

impl From<FrameId> for Value {
    fn from(id: FrameId) -> Self {
        match id {
            FrameId::Num(n) => Self::Number(n),
            FrameId::Str(s) => Self::String(s),
        }
    }
}

/// A call: the client asks the daemon to run an operation.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Call {
    /// The caller's id for this call.
    pub id: FrameId,
    /// The operation's name.
    #[serde(rename = "type")]
    pub op: String,
    /// The operation's input; absent means `{}`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub payload: Option<Value>,
}

/// A call frame as a client writes it: the same line as [`Call`], its payload serialised straight
/// from its type.
#[derive(Debug, Serialize)]
pub struct CallOut<'a, P: ?Sized> {
    /// The caller's id for this call.
    pub id: FrameId,
    /// The operation's name.
    #[serde(rename = "type")]
    pub op: &'a str,
    /// The operation's input.
    pub payload: &'a P,
}

/// Why a line is not a call frame; answered `BAD_FRAME` with `id: null`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum BadFrame {
    /// The line is not JSON, or an object in it names a key twice
    /// ([`crate::decode::json_value`]).
    #[error("Invalid JSON frame")]
    InvalidJson,
    /// The line is JSON, but not an object with a string or number id and a string type.
    #[error("Request frame requires string or number id and string type")]
    NotACall,
    /// The line is longer than the reader accepts.
    #[error("Frame exceeds the maximum line length of {0} bytes")]
    TooLong(usize),
}

impl From<BadFrame> for ContractError {
    fn from(bad: BadFrame) -> Self {
        Self::new(ErrorCode::BadFrame, bad.to_string())
    }
}

impl Call {
    /// Parses one line as a call frame.
    ///
    /// # Errors
    /// [`BadFrame`] when the line is not JSON, or not an object with a string or number `id`
    /// and a string `type`.
    pub fn parse(line: &[u8]) -> Result<Self, BadFrame> {
        let value = crate::decode::json_value(line).map_err(|_| BadFrame::InvalidJson)?;
        let Value::Object(mut object) = value else {
            return Err(BadFrame::NotACall);
        };
        let id = match object.remove("id") {
            Some(Value::Number(n)) => FrameId::Num(n),
            Some(Value::String(s)) => FrameId::Str(s),
            _ => return Err(BadFrame::NotACall),
        };
        let Some(Value::String(op)) = object.remove("type") else {
            return Err(BadFrame::NotACall);
        };
        let payload = object.remove("payload").filter(|p| !p.is_null());
        Ok(Self { id, op, payload })
    }
}

/// A result or an error answering one call.
#[derive(Debug, Clone, PartialEq)]
pub struct Reply {
    /// The id of the call answered; `None` only for `BAD_FRAME`.
    pub id: Option<FrameId>,
    /// The result's payload, or the error.
    pub outcome: Result<Value, ErrorBody>,
}

impl Reply {
    /// A result.
    pub fn ok(id: FrameId, payload: Value) -> Self {
        Self {
            id: Some(id),
            outcome: Ok(payload),
        }
    }

    /// An error.
    pub fn err(id: Option<FrameId>, error: &ContractError) -> Self {
        Self {
            id,
            outcome: Err(error.to_body()),
        }
    }
}

impl Serialize for Reply {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        #[derive(Serialize)]
        struct Wire<'a> {
            id: &'a Option<FrameId>,
            ok: bool,
            #[serde(skip_serializing_if = "Option::is_none")]
            payload: Option<&'a Value>,
            #[serde(skip_serializing_if = "Option::is_none")]
            error: Option<&'a ErrorBody>,
        }
        let wire = match &self.outcome {
            Ok(payload) => Wire {
                id: &self.id,
                ok: true,
                payload: Some(payload),
                error: None,
            },
            Err(error) => Wire {
                id: &self.id,
                ok: false,
                payload: None,
                error: Some(error),
            },
        };
        wire.serialize(serializer)
    }
}

/// A push: the daemon tells the client something outside a reply.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PushFrame {
    /// The push kind.
    pub push: String,
    /// Its payload; request-scoped kinds carry `requestId`, the frame id of their call.
    pub payload: Value,
}

impl PushFrame {
    /// The frame id of the call this push belongs to, for request-scoped kinds.
    pub fn request_id(&self) -> Option<FrameId> {
        self.payload
            .get("requestId")
            .cloned()
            .and_then(|v| serde_json::from_value(v).ok())
    }
}

/// What a client reads, read in one pass: a push (its payload as a value), or a reply whose
/// payload stays raw JSON, for its caller to decode straight into its type. This is the one
/// reader of a line a daemon sent.
#[derive(Debug, Clone)]
pub enum RawInbound {
    /// A result or error for a call.
    Reply {
        /// The id of the call answered; `None` only for `BAD_FRAME`.
        id: Option<FrameId>,
        /// The result's payload (`{}` when absent), or the error.
        outcome: Result<Box<RawValue>, ErrorBody>,
    },
    /// A push.
    Push(PushFrame),
}

impl RawInbound {
    /// Parses one line a daemon sent: a push when it names one, else a reply when it says `ok`
    /// (a result's absent or null payload reads as `{}`; an error needs its `error`). The
    /// reply's payload is kept as raw JSON, never built as a value.
    ///
    /// # Errors
    /// A message when the line is neither a reply nor a push.
    pub fn parse(line: &[u8]) -> Result<Self, String> {
        #[derive(Deserialize)]
        struct Wire<'a> {
            #[serde(default)]
            push: Option<String>,
            #[serde(default)]
            ok: Option<bool>,
            #[serde(default)]
            id: Option<FrameId>,
            #[serde(default, borrow)]
            payload: Option<&'a RawValue>,
            #[serde(default)]
            error: Option<ErrorBody>,
        }
        let wire: Wire<'_> =
            serde_json::from_slice(line).map_err(|e| format!("invalid JSON: {e}"))?;
        if let Some(push) = wire.push {
            let payload = wire
                .payload
                .ok_or_else(|| "invalid push: missing field `payload`".to_owned())?;
            let payload =
                serde_json::from_str(payload.get()).map_err(|e| format!("invalid push: {e}"))?;
            return Ok(Self::Push(PushFrame { push, payload }));
        }
        match wire.ok {
            Some(true) => {
                let payload = match wire.payload {
                    Some(raw) => raw.to_owned(),
                    None => RawValue::from_string("{}".to_owned())
                        .map_err(|e| format!("invalid reply: {e}"))?,
                };
                Ok(Self::Reply {
                    id: wire.id,
                    outcome: Ok(payload),
                })
            }
            Some(false) => Ok(Self::Reply {
                id: wire.id,
                outcome: Err(wire
                    .error
                    .ok_or_else(|| "invalid reply: missing field `error`".to_owned())?),
            }),
            None => Err("neither a reply nor a push".to_owned()),
        }
    }
}

/// Serialises a frame as one line, newline included.
///
/// # Errors
/// Only when a payload cannot be serialised (a map with non-string keys), which our types never build.
pub fn to_line<T: Serialize>(frame: &T) -> Result<String, serde_json::Error> {
    let mut line = serde_json::to_string(frame)?;
    line.push('\n');
    Ok(line)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn a_call_written_from_its_type_reads_back_as_the_call() {
        let payload = serde_json::json!({"leaseId": "lse_1", "ttlMs": 5});
        let line = to_line(&CallOut {
            id: FrameId::from(9),
            op: "lease.renew",
            payload: &payload,
        })
        .unwrap();
        let call = Call::parse(line.trim_end().as_bytes()).unwrap();
        assert_eq!(
            (call.id, call.op.as_str(), call.payload),
            (FrameId::from(9), "lease.renew", Some(payload))
        );
    }

    /// The reply a line reads as, its payload as a value.
    fn reply(line: &[u8]) -> (Option<FrameId>, Result<Value, ErrorBody>) {
        match RawInbound::parse(line) {
            Ok(RawInbound::Reply { id, outcome }) => (
                id,
                outcome.map(|raw| serde_json::from_str(raw.get()).unwrap()),
            ),
            other => panic!("not a reply: {other:?}"),
        }
    }

    #[test]
    fn a_reply_reads_its_id_and_payload_and_an_absent_or_null_payload_is_empty() {
        assert_eq!(
            reply(br#"{"id":3,"ok":true,"payload":{"leaseId":"lse_1","n":[1,2]}}"#),
            (
                Some(FrameId::from(3)),
                Ok(json!({"leaseId": "lse_1", "n": [1, 2]}))
            )
        );
        assert_eq!(
            reply(br#"{"id":"x","ok":true}"#),
            (Some(FrameId::from("x")), Ok(json!({})))
        );
        assert_eq!(
            reply(br#"{"id":"x","ok":true,"payload":null}"#),
            (Some(FrameId::from("x")), Ok(json!({})))
        );
        let (id, outcome) =
            reply(br#"{"id":4,"ok":false,"error":{"code":"UNKNOWN_LEASE","message":"gone"}}"#);
        assert_eq!(id, Some(FrameId::from(4)));
        let error = ContractError::from_body(outcome.unwrap_err());
        assert_eq!(
            (error.code, error.message.as_str()),
            (ErrorCode::UnknownLease, "gone")
        );
        assert_eq!(
            reply(br#"{"id":null,"ok":false,"error":{"code":"BAD_FRAME","message":"Invalid JSON frame"}}"#).0,
            None,
            "a bad frame's answer has no id"
        );
    }

    #[test]
    fn a_call_parses_with_either_id_kind() {
        let call = Call::parse(br#"{"id":7,"type":"status.get","payload":{}}"#).unwrap();
        assert_eq!(call.id, FrameId::from(7));
        assert_eq!(call.op, "status.get");
        let call = Call::parse(br#"{"id":"a","type":"status.get"}"#).unwrap();
        assert_eq!(call.id, FrameId::from("a"));
        assert_eq!(call.payload, None);
    }

    #[test]
    fn lines_that_are_not_calls_are_bad_frames() {
        assert_eq!(Call::parse(b"{nope"), Err(BadFrame::InvalidJson));
        assert_eq!(
            Call::parse(br#"{"id":1,"type":"lease.request","type":"lease.release"}"#),
            Err(BadFrame::InvalidJson)
        );
        assert_eq!(Call::parse(b"[1]"), Err(BadFrame::NotACall));
        assert_eq!(Call::parse(br#"{"type":"x"}"#), Err(BadFrame::NotACall));
        assert_eq!(Call::parse(br#"{"id":1}"#), Err(BadFrame::NotACall));
        assert_eq!(
            Call::parse(br#"{"id":true,"type":"x"}"#),
            Err(BadFrame::NotACall)
        );
        assert_eq!(
            Call::parse(br#"{"id":1,"type":2}"#),
            Err(BadFrame::NotACall)
        );
    }

    #[test]
    fn replies_serialise_in_the_original_shape() {
        let ok = Reply::ok(FrameId::from(1), json!({"a": 1}));
        assert_eq!(
            serde_json::to_value(&ok).unwrap(),
            json!({"id": 1, "ok": true, "payload": {"a": 1}})
        );
        let err = Reply::err(
            None,
            &ContractError::new(ErrorCode::BadFrame, "Invalid JSON frame"),
        );
        assert_eq!(
            serde_json::to_value(&err).unwrap(),
            json!({"id": null, "ok": false, "error": {"code": "BAD_FRAME", "message": "Invalid JSON frame"}})
        );
    }

    #[test]
    fn a_push_is_told_from_a_reply_and_a_line_that_is_neither_is_refused() {
        let Ok(RawInbound::Push(push)) =
            RawInbound::parse(br#"{"push":"started","payload":{"requestId":3}}"#)
        else {
            panic!("not a push")
        };
        assert_eq!(push.push, "started");
        assert_eq!(push.request_id(), Some(FrameId::from(3)));
        assert!(matches!(
            RawInbound::parse(br#"{"id":1,"ok":true}"#),
            Ok(RawInbound::Reply { .. })
        ));
        for line in [
            &br#"{"id":1}"#[..],
            br#"{"id":1,"ok":false}"#,
            br#"{"push":"started"}"#,
            b"{nope",
            b"[1]",
        ] {
            assert!(
                RawInbound::parse(line).is_err(),
                "{}",
                String::from_utf8_lossy(line)
            );
        }
    }
}
