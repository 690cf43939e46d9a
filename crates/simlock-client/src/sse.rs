//! Server-sent events: a small parser for `event:`/`data:` blocks, and a stream of them over an
//! HTTP response body that fails when the daemon goes silent past an idle bound.

use std::time::Duration;

use http_body_util::BodyExt as _;
use hyper::body::Incoming;
use simlock_contract::{ContractError, ErrorCode};

/// The most bytes an event may take before the stream is given up.
const MAX_EVENT: usize = simlock_contract::bounds::MAX_CLIENT_LINE;

/// One event.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct SseEvent {
    /// Its name (`message` when the block names none).
    pub(crate) event: String,
    /// Its data lines, joined by `\n`.
    pub(crate) data: String,
}

impl SseEvent {
    /// The data as JSON (every simlock event carries a JSON document).
    pub(crate) fn json(&self) -> Result<serde_json::Value, ContractError> {
        serde_json::from_str(&self.data).map_err(|e| {
            ContractError::internal(format!("invalid {} event from the daemon: {e}", self.event))
        })
    }
}

/// Turns bytes into events.
#[derive(Debug, Default)]
pub(crate) struct SseParser {
    buf: Vec<u8>,
}

impl SseParser {
    /// Adds bytes as they arrived.
    pub(crate) fn push(&mut self, bytes: &[u8]) {
        self.buf
            .extend(bytes.iter().copied().filter(|b| *b != b'\r'));
    }

    /// Whether more bytes are held than an event may take.
    pub(crate) fn overflowed(&self) -> bool {
        self.buf.len() > MAX_EVENT
    }

    /// The next complete event, skipping comment-only blocks (keepalives).
    pub(crate) fn next_event(&mut self) -> Option<SseEvent> {
        loop {
            let end = self.buf.windows(2).position(|w| w == b"\n\n")?;
            let block: Vec<u8> = self.buf.drain(..end + 2).collect();
            let text = String::from_utf8_lossy(&block[..end]);
            let mut event = None;
            let mut data: Option<String> = None;
            for line in text.split('\n') {
                if line.is_empty() || line.starts_with(':') {
                    continue;
                }
                let (field, value) = line.split_once(':').unwrap_or((line, ""));
                let value = value.strip_prefix(' ').unwrap_or(value);
                match field {
                    "event" => event = Some(value.to_owned()),
                    "data" => match &mut data {
                        Some(data) => {
                            data.push('\n');
                            data.push_str(value);
                        }
                        None => data = Some(value.to_owned()),
                    },
                    _ => {}
                }
            }
            if event.is_none() && data.is_none() {
                continue;
            }
            return Some(SseEvent {
                event: event.unwrap_or_else(|| "message".to_owned()),
                data: data.unwrap_or_default(),
            });
        }
    }
}

/// Events read from a response body.
#[derive(Debug)]
pub(crate) struct SseStream {
    body: Incoming,
    parser: SseParser,
    idle: Duration,
    ended: bool,
}

impl SseStream {
    pub(crate) fn new(body: Incoming, idle: Duration) -> Self {
        Self {
            body,
            parser: SseParser::default(),
            idle,
            ended: false,
        }
    }

    /// The next event; `None` when the body ended. Fails `DAEMON_CONNECTION_LOST` when the body
    /// breaks or nothing (not even a keepalive) arrives within the idle bound.
    pub(crate) async fn next(&mut self) -> Option<Result<SseEvent, ContractError>> {
        loop {
            if let Some(event) = self.parser.next_event() {
                return Some(Ok(event));
            }
            if self.ended {
                return None;
            }
            if self.parser.overflowed() {
                self.ended = true;
                return Some(Err(ContractError::new(
                    ErrorCode::DaemonConnectionLost,
                    format!("the daemon sent an event larger than {MAX_EVENT} bytes"),
                )));
            }
            let frame = match tokio::time::timeout(self.idle, self.body.frame()).await {
                Err(_) => {
                    self.ended = true;
                    return Some(Err(ContractError::new(
                        ErrorCode::DaemonConnectionLost,
                        format!(
                            "the daemon's event stream was silent for {} s",
                            self.idle.as_secs()
                        ),
                    )));
                }
                Ok(None) => {
                    self.ended = true;
                    continue;
                }
                Ok(Some(Err(e))) => {
                    self.ended = true;
                    return Some(Err(ContractError::new(
                        ErrorCode::DaemonConnectionLost,
                        format!("the daemon's event stream broke: {e}"),
                    )));
                }
                Ok(Some(Ok(frame))) => frame,
            };
            if let Ok(data) = frame.into_data() {
                self.parser.push(&data);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn blocks_become_events_and_keepalives_are_skipped() {
        let mut parser = SseParser::default();
        parser.push(b": keepalive\n\nevent: output\ndata: {\"a\":");
        assert_eq!(parser.next_event(), None);
        parser.push(b"1}\n\ndata: x\r\ndata: y\r\n\r\n");
        assert_eq!(
            parser.next_event(),
            Some(SseEvent {
                event: "output".into(),
                data: "{\"a\":1}".into()
            })
        );
        assert_eq!(
            parser.next_event(),
            Some(SseEvent {
                event: "message".into(),
                data: "x\ny".into()
            })
        );
        assert_eq!(parser.next_event(), None);
    }
}
