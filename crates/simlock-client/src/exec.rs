//! `device.exec` as a stream: output chunks as the tool writes them, then its exit code.

use serde_json::Value;
use simlock_contract::ops::{DeviceExec, ExecInput};
use simlock_contract::push::OutputStream;
use simlock_contract::{ContractError, ErrorBody, ErrorCode, Push};
use simlock_wire::{CallEvent, CallHandle, decode_output, decode_raw};
use tracing::debug;

use crate::client::{Backend, Client, payload, timed_out};
use crate::http::segment;
use crate::sse::SseStream;

/// Output chunks a caller may leave unread before the daemon waits (backpressure).
const OUTPUT_QUEUE: usize = 64;

/// What an exec yields.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ExecEvent {
    /// A chunk of output, as the tool wrote it.
    Output {
        /// Which stream.
        stream: OutputStream,
        /// The text.
        chunk: String,
    },
    /// The tool exited; nothing follows.
    Exit {
        /// Its exit code.
        exit_code: i32,
    },
}

/// A running exec. Dropping it stops reading; the tool runs on until the daemon's time limit.
#[derive(Debug)]
pub struct ExecStream {
    inner: Inner,
    done: bool,
}

#[derive(Debug)]
enum Inner {
    Wire(Box<CallHandle>),
    Http(SseStream),
}

impl ExecStream {
    pub(crate) async fn start(client: &Client, input: ExecInput) -> Result<Self, ContractError> {
        let inner = match &client.backend {
            Backend::Wire(wire) => Inner::Wire(Box::new(
                wire.client()
                    .begin_call::<DeviceExec>(&input, OUTPUT_QUEUE)
                    .await?,
            )),
            Backend::Http(http) => {
                // The route names the lease; the body carries the rest of the input.
                let mut body = payload(&input)?;
                if let Some(fields) = body.as_object_mut() {
                    fields.remove("leaseId");
                }
                let path = format!("/v1/leases/{}/exec", segment(&input.lease_id));
                let bound = client.options.call_timeout;
                let stream = tokio::time::timeout(
                    bound,
                    http.open_stream(http::Method::POST, &path, Some(&body)),
                )
                .await
                .unwrap_or_else(|_| Err(timed_out("POST exec", bound)))?;
                Inner::Http(stream)
            }
        };
        Ok(Self { inner, done: false })
    }

    /// The next chunk or the exit; `None` after the exit or an error.
    pub async fn next(&mut self) -> Option<Result<ExecEvent, ContractError>> {
        if self.done {
            return None;
        }
        let item = match &mut self.inner {
            Inner::Wire(handle) => next_wire(handle).await,
            Inner::Http(stream) => next_http(stream).await,
        };
        if !matches!(item, Ok(ExecEvent::Output { .. })) {
            self.done = true;
        }
        Some(item)
    }

    /// Reads to the end, handing each chunk to `on_output`, and answers the exit code.
    ///
    /// # Errors
    /// The exec's error (`EXEC_TIMEOUT`, `UNKNOWN_LEASE`, …) or `DAEMON_CONNECTION_LOST`.
    pub async fn finish(
        mut self,
        mut on_output: impl FnMut(OutputStream, &str),
    ) -> Result<i32, ContractError> {
        while let Some(item) = self.next().await {
            match item? {
                ExecEvent::Output { stream, chunk } => on_output(stream, &chunk),
                ExecEvent::Exit { exit_code } => return Ok(exit_code),
            }
        }
        Err(ContractError::internal("the exec already ended"))
    }
}

async fn next_wire(handle: &mut CallHandle) -> Result<ExecEvent, ContractError> {
    loop {
        match handle.next().await {
            CallEvent::Push(frame) => match Push::from_frame(frame) {
                Ok(Push::Output { stream, chunk, .. }) => {
                    return Ok(ExecEvent::Output { stream, chunk });
                }
                Ok(other) => debug!(push = other.kind(), "exec push"),
                Err(e) => debug!(error = %e, "ignoring a push the client cannot read"),
            },
            CallEvent::Reply(outcome) => {
                let output = decode_raw::<DeviceExec>(&outcome?)?;
                return Ok(ExecEvent::Exit {
                    exit_code: output.exit_code,
                });
            }
        }
    }
}

async fn next_http(stream: &mut SseStream) -> Result<ExecEvent, ContractError> {
    loop {
        let Some(event) = stream.next().await else {
            return Err(ContractError::new(
                ErrorCode::DaemonConnectionLost,
                "the exec stream ended before the tool's exit",
            ));
        };
        let event = event?;
        match event.event.as_str() {
            "output" => {
                let data = event.json()?;
                let field = |name: &str| {
                    data.get(name).cloned().ok_or_else(|| {
                        ContractError::internal(format!("an exec output event without {name}"))
                    })
                };
                let stream = serde_json::from_value::<OutputStream>(field("stream")?)
                    .map_err(|e| ContractError::internal(format!("exec output stream: {e}")))?;
                let Value::String(chunk) = field("chunk")? else {
                    return Err(ContractError::internal(
                        "an exec output chunk that is not text",
                    ));
                };
                return Ok(ExecEvent::Output { stream, chunk });
            }
            "exit" => {
                let output = decode_output::<DeviceExec>(event.json()?)?;
                return Ok(ExecEvent::Exit {
                    exit_code: output.exit_code,
                });
            }
            "error" => {
                let body = event
                    .json()?
                    .get("error")
                    .and_then(ErrorBody::from_inline)
                    .ok_or_else(|| {
                        ContractError::internal("an exec error event without an error")
                    })?;
                return Err(ContractError::from_body(body));
            }
            other => debug!(event = other, "ignoring an exec event"),
        }
    }
}
