//! The client side of a connection: calls matched to replies by id, each call's pushes routed
//! to it, and every pending call failed `DAEMON_CONNECTION_LOST` when the connection goes.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use bytes::Bytes;
use futures::{SinkExt, StreamExt};
use parking_lot::Mutex;
use serde_json::Value;
use serde_json::value::RawValue;
use simlock_contract::{
    CallOut, ContractError, FrameId, Hello, HelloReply, Operation, PushFrame, RawInbound,
    frame::to_line,
};
use tokio::sync::{mpsc, oneshot};
use tokio_util::sync::CancellationToken;
use tracing::{debug, warn};

use crate::codec::Line;
use crate::transport::Transport;

/// Calls queued for the writer.
const OUT_QUEUE: usize = 64;
/// Pushes not tied to a call (lease notices, events) waiting for the holder of the receiver.
const UNSOLICITED_QUEUE: usize = 1024;

/// A reply as it came: its payload still raw JSON, decoded once, straight into what the caller
/// wants (an operation's output with [`decode_raw`], or a value with [`decode_value`]).
pub type RawReply = Result<Box<RawValue>, ContractError>;

struct Pending {
    reply: oneshot::Sender<RawReply>,
    pushes: Option<mpsc::Sender<PushFrame>>,
}

struct Inner {
    next_id: AtomicU64,
    pending: Mutex<HashMap<u64, Pending>>,
    out: mpsc::Sender<Bytes>,
    closed: CancellationToken,
}

impl Inner {
    fn fail_all(&self) {
        let pending: Vec<_> = self.pending.lock().drain().collect();
        for (_, call) in pending {
            let _ = call.reply.send(Err(ContractError::connection_lost()));
        }
    }
}

/// A client connection to a daemon (or, on a gateway, to a worker over its uplink).
#[derive(Clone)]
pub struct WireClient {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for WireClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WireClient")
            .field("closed", &self.inner.closed.is_cancelled())
            .finish_non_exhaustive()
    }
}

/// Pushes that belong to no call: `lease-lost`, `device-unhealthy`, `device-recovered`, `event`.
/// Read it, or drop it to discard them; a held receiver that is never read stalls the connection.
pub type Unsolicited = mpsc::Receiver<PushFrame>;

/// What a call in flight yields.
#[derive(Debug)]
pub enum CallEvent {
    /// A push for this call (every push that preceded the reply comes before it).
    Push(PushFrame),
    /// The reply, its payload raw (decode it once, with [`decode_raw`] or [`decode_value`]);
    /// nothing follows it.
    Reply(RawReply),
}

/// A call in flight with its own pushes. Dropping it abandons the call: its reply and pushes
/// are discarded.
pub struct CallHandle {
    id: u64,
    pushes: mpsc::Receiver<PushFrame>,
    reply: Option<oneshot::Receiver<RawReply>>,
    inner: Arc<Inner>,
}

impl std::fmt::Debug for CallHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CallHandle")
            .field("id", &self.id)
            .finish_non_exhaustive()
    }
}

impl CallHandle {
    /// The call's frame id.
    pub const fn id(&self) -> u64 {
        self.id
    }

    /// The next push or the reply, its payload raw. After the reply, answers
    /// `DAEMON_CONNECTION_LOST` if called again.
    pub async fn next(&mut self) -> CallEvent {
        let Some(reply) = self.reply.as_mut() else {
            return CallEvent::Reply(Err(ContractError::connection_lost()));
        };
        tokio::select! {
            biased;
            Some(push) = self.pushes.recv() => CallEvent::Push(push),
            outcome = reply => {
                // Pushes the reader routed before the reply are still queued: hand them out first.
                if let Ok(push) = self.pushes.try_recv() {
                    let outcome = outcome.unwrap_or_else(|_| Err(ContractError::connection_lost()));
                    let (tx, rx) = oneshot::channel();
                    let _ = tx.send(outcome);
                    self.reply = Some(rx);
                    return CallEvent::Push(push);
                }
                self.reply = None;
                CallEvent::Reply(outcome.unwrap_or_else(|_| Err(ContractError::connection_lost())))
            }
        }
    }

    /// Waits for the reply, discarding pushes; its payload raw.
    ///
    /// # Errors
    /// The call's error, or `DAEMON_CONNECTION_LOST`.
    pub async fn finish(mut self) -> RawReply {
        loop {
            if let CallEvent::Reply(outcome) = self.next().await {
                return outcome;
            }
        }
    }
}

impl Drop for CallHandle {
    fn drop(&mut self) {
        self.inner.pending.lock().remove(&self.id);
    }
}

impl WireClient {
    /// Starts a client over `transport`; returns it and the receiver of unsolicited pushes.
    pub fn new(transport: Transport) -> (Self, Unsolicited) {
        let Transport {
            mut lines,
            mut sink,
        } = transport;
        let (out_tx, mut out_rx) = mpsc::channel::<Bytes>(OUT_QUEUE);
        let (unsolicited_tx, unsolicited_rx) = mpsc::channel(UNSOLICITED_QUEUE);
        let inner = Arc::new(Inner {
            next_id: AtomicU64::new(1),
            pending: Mutex::new(HashMap::new()),
            out: out_tx,
            closed: CancellationToken::new(),
        });

        let writer_closed = inner.closed.clone();
        tokio::spawn(async move {
            loop {
                let line = tokio::select! {
                    () = writer_closed.cancelled() => break,
                    line = out_rx.recv() => line,
                };
                let Some(line) = line else { break };
                if let Err(e) = sink.send(line).await {
                    debug!(error = %e, "client write failed");
                    break;
                }
            }
            writer_closed.cancel();
            let _ = sink.close().await;
        });

        let reader = inner.clone();
        tokio::spawn(async move {
            loop {
                let line = tokio::select! {
                    () = reader.closed.cancelled() => break,
                    line = lines.next() => line,
                };
                match line {
                    Some(Ok(Line::Frame(bytes))) => route(&reader, &unsolicited_tx, &bytes).await,
                    Some(Ok(Line::TooLong)) => {
                        warn!("the daemon sent a line over the client's limit; closing");
                        break;
                    }
                    Some(Err(e)) => {
                        debug!(error = %e, "client read failed");
                        break;
                    }
                    None => break,
                }
            }
            reader.closed.cancel();
            reader.fail_all();
        });

        (Self { inner }, unsolicited_rx)
    }

    /// Whether the connection has ended.
    pub fn is_closed(&self) -> bool {
        self.inner.closed.is_cancelled()
    }

    /// Resolves when the connection ends.
    pub async fn closed(&self) {
        self.inner.closed.cancelled().await;
    }

    /// Ends the connection; pending calls fail `DAEMON_CONNECTION_LOST`.
    pub fn close(&self) {
        self.inner.closed.cancel();
        self.inner.fail_all();
    }

    /// Starts a call whose pushes the caller wants, holding at most `push_capacity` unread
    /// pushes before the connection's reader waits (backpressure); read its reply with
    /// [`decode_value`], or with [`decode_raw`] for a known operation.
    ///
    /// # Errors
    /// `DAEMON_CONNECTION_LOST` when the connection has ended.
    pub async fn begin(
        &self,
        op: &str,
        payload: Value,
        push_capacity: usize,
    ) -> Result<CallHandle, ContractError> {
        let (push_tx, push_rx) = mpsc::channel(push_capacity.max(1));
        self.start(op, &payload, Some(push_tx), push_rx).await
    }

    /// Starts a typed call whose pushes the caller wants (see [`Self::begin`]); read its reply
    /// with [`decode_raw`].
    ///
    /// # Errors
    /// `DAEMON_CONNECTION_LOST` when the connection has ended; `INTERNAL` when the input does
    /// not serialize.
    pub async fn begin_call<O: Operation>(
        &self,
        input: &O::Input,
        push_capacity: usize,
    ) -> Result<CallHandle, ContractError> {
        let (push_tx, push_rx) = mpsc::channel(push_capacity.max(1));
        self.start(O::NAME, input, Some(push_tx), push_rx).await
    }

    /// Writes the call line with `payload` serialised straight into it (no value built).
    async fn start<P: serde::Serialize + ?Sized>(
        &self,
        op: &str,
        payload: &P,
        pushes: Option<mpsc::Sender<PushFrame>>,
        push_rx: mpsc::Receiver<PushFrame>,
    ) -> Result<CallHandle, ContractError> {
        if self.is_closed() {
            return Err(ContractError::connection_lost());
        }
        let id = self.inner.next_id.fetch_add(1, Ordering::Relaxed);
        let call = CallOut {
            id: FrameId::from(id),
            op,
            payload,
        };
        let line = to_line(&call).map_err(|e| ContractError::internal(e.to_string()))?;
        // A daemon answers an oversized line `BAD_FRAME` with no id, which no call could match:
        // refuse it here instead of waiting for an answer that cannot be routed.
        if line.len() - 1 > simlock_contract::bounds::MAX_CALL_LINE {
            return Err(ContractError::bad_request(format!(
                "payload: the {op} call is {} bytes, over the {} byte limit of a call line",
                line.len() - 1,
                simlock_contract::bounds::MAX_CALL_LINE
            )));
        }
        let (reply_tx, reply_rx) = oneshot::channel();
        self.inner.pending.lock().insert(
            id,
            Pending {
                reply: reply_tx,
                pushes,
            },
        );
        let handle = CallHandle {
            id,
            pushes: push_rx,
            reply: Some(reply_rx),
            inner: self.inner.clone(),
        };
        // Every close cancels `closed` and then fails every pending call. A call registered
        // before the cancel is answered by that, or by its reply when the daemon answered it
        // before it hung up (as it does a refused `hello`), whether or not its line was still
        // queued; one registered after the cancel must not wait.
        if self.is_closed() {
            return Err(ContractError::connection_lost());
        }
        // A closed queue means the connection closed after the check: the reply says how.
        let _ = self.inner.out.send(Bytes::from(line)).await;
        Ok(handle)
    }

    /// Calls `op` and waits for its reply, discarding its pushes; the reply is read once, as
    /// a value.
    ///
    /// # Errors
    /// The daemon's error, or `DAEMON_CONNECTION_LOST`.
    pub async fn call_value(&self, op: &str, payload: Value) -> Result<Value, ContractError> {
        decode_value(&self.reply_to(op, &payload).await?)
    }

    /// Calls a typed operation.
    ///
    /// # Errors
    /// The daemon's error, `DAEMON_CONNECTION_LOST`, or `INTERNAL` when the output does not
    /// match the operation's output type.
    pub async fn call<O: Operation>(&self, input: &O::Input) -> Result<O::Output, ContractError> {
        decode_raw::<O>(&self.reply_to(O::NAME, input).await?)
    }

    /// Sends `hello`.
    ///
    /// # Errors
    /// The daemon's refusal (`PROTOCOL_VERSION_UNSUPPORTED`, `ADMIN_AUTHENTICATION_FAILED`, …).
    pub async fn hello(&self, hello: &Hello) -> Result<HelloReply, ContractError> {
        let raw = self.reply_to("hello", hello).await?;
        serde_json::from_str(raw.get())
            .map_err(|e| ContractError::internal(format!("invalid hello reply: {e}")))
    }

    /// Calls `op` and waits for its reply, its pushes discarded; the reply raw, for the caller
    /// to decode once.
    async fn reply_to<P: serde::Serialize + ?Sized>(&self, op: &str, payload: &P) -> RawReply {
        let (_, push_rx) = mpsc::channel(1);
        self.start(op, payload, None, push_rx).await?.finish().await
    }
}

/// Reads an operation's output from a value (an answer that came as one, over HTTP or from a
/// router), `INTERNAL` when it does not match. A wire reply is read with [`decode_raw`].
///
/// # Errors
/// `INTERNAL` naming the operation.
pub fn decode_output<O: Operation>(value: Value) -> Result<O::Output, ContractError> {
    serde_json::from_value(value)
        .map_err(|e| ContractError::internal(format!("invalid {} output: {e}", O::NAME)))
}

/// Reads an operation's output straight from its raw reply, `INTERNAL` when it does not match.
///
/// # Errors
/// `INTERNAL` naming the operation.
pub fn decode_raw<O: Operation>(raw: &RawValue) -> Result<O::Output, ContractError> {
    serde_json::from_str(raw.get())
        .map_err(|e| ContractError::internal(format!("invalid {} output: {e}", O::NAME)))
}

/// Reads a raw reply as a value, for callers that want one (an untyped call).
///
/// # Errors
/// `INTERNAL` when it is not JSON, which a reply the client read never is.
pub fn decode_value(raw: &RawValue) -> Result<Value, ContractError> {
    serde_json::from_str(raw.get())
        .map_err(|e| ContractError::internal(format!("invalid reply payload: {e}")))
}

async fn route(inner: &Inner, unsolicited: &mpsc::Sender<PushFrame>, bytes: &[u8]) {
    match RawInbound::parse(bytes) {
        Ok(RawInbound::Reply { id, outcome }) => deliver_reply(inner, id, outcome),
        Ok(RawInbound::Push(push)) => {
            let scoped = push.payload.get("requestId").is_some();
            if scoped {
                let target = push
                    .request_id()
                    .and_then(|id| id.as_u64())
                    .and_then(|id| inner.pending.lock().get(&id).and_then(|p| p.pushes.clone()));
                if let Some(target) = target {
                    // Waits while the caller is behind: backpressure reaches the daemon.
                    let _ = target.send(push).await;
                }
            } else if !unsolicited.is_closed() {
                let _ = unsolicited.send(push).await;
            }
        }
        Err(e) => {
            warn!(error = %e, "dropping a line from the daemon that is neither a reply nor a push")
        }
    }
}

fn deliver_reply(
    inner: &Inner,
    id: Option<FrameId>,
    outcome: Result<Box<RawValue>, simlock_contract::ErrorBody>,
) {
    let Some(id) = id.as_ref().and_then(FrameId::as_u64) else {
        if let Err(body) = &outcome {
            warn!(code = %body.code, message = %body.message, "the daemon refused a line");
        }
        return;
    };
    let Some(pending) = inner.pending.lock().remove(&id) else {
        return;
    };
    let _ = pending
        .reply
        .send(outcome.map_err(ContractError::from_body));
}
