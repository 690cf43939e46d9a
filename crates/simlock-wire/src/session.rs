//! The server side of one connection: `hello` first, then calls handled concurrently, their
//! replies and pushes written by one writer with backpressure.
//!
//! The session owns the protocol rules every connection shares: `HANDSHAKE_REQUIRED` before
//! `hello`, range negotiation (after a mismatch the connection stays open and every call but
//! `daemon.stop` answers `PROTOCOL_VERSION_UNSUPPORTED`), and `BAD_FRAME` for lines that are not
//! calls. Everything else is the [`Service`]'s: who the caller is, and what each call does.

use std::any::Any;
use std::fmt;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use bytes::Bytes;
use futures::future::BoxFuture;
use futures::{SinkExt, StreamExt};
use parking_lot::Mutex;
use serde_json::Value;
use simlock_contract::protocol::version_unsupported;
use simlock_contract::{
    BadFrame, Call, ContractError, ErrorCode, FrameId, Hello, HelloReply, ProtocolRange, Push,
    Reply, Role, decode_input,
};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;
use tracing::{debug, warn};

use crate::codec::Line;
use crate::transport::Transport;

/// Frames queued for the writer; a full queue makes replies and pushes wait.
const OUT_QUEUE: usize = 64;
/// Connection-scoped pushes (events, lease notices) queued for a slow reader before the
/// connection is closed as one that does not read.
const DETACHED_QUEUE: usize = 1024;

/// How a connection reached the daemon.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Origin {
    /// The local unix socket.
    Socket,
    /// The worker's uplink to its gateway: the gateway is the client.
    GatewayUplink,
}

/// Who is calling, fixed by `hello` for the connection's life.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Identity {
    /// The session's role.
    pub role: Role,
    /// The session's principal.
    pub principal: String,
}

/// Why a push was not written.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("the connection is closed")]
pub struct Closed;

/// One live connection, shared by the calls running on it.
pub struct Connection {
    id: u64,
    origin: Origin,
    attachment: Option<Arc<dyn Any + Send + Sync>>,
    identity: Mutex<Option<Identity>>,
    out: mpsc::Sender<Bytes>,
    detached: mpsc::Sender<Bytes>,
    closed: CancellationToken,
}

static NEXT_CONNECTION: AtomicU64 = AtomicU64::new(1);

impl fmt::Debug for Connection {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Connection")
            .field("id", &self.id)
            .field("origin", &self.origin)
            .finish_non_exhaustive()
    }
}

impl Connection {
    /// A process-unique id for the connection.
    pub const fn id(&self) -> u64 {
        self.id
    }

    /// How it reached the daemon.
    pub const fn origin(&self) -> Origin {
        self.origin
    }

    /// What the transport attached to the connection (the uplink's link), if it is a `T`.
    pub fn attachment<T: Any + Send + Sync>(&self) -> Option<Arc<T>> {
        self.attachment.clone()?.downcast::<T>().ok()
    }

    /// Whether it is the worker's uplink, the only session allowed to name an `owner` or relay.
    pub fn is_gateway_uplink(&self) -> bool {
        self.origin == Origin::GatewayUplink
    }

    /// Who is calling; present once `hello` succeeded.
    pub fn identity(&self) -> Option<Identity> {
        self.identity.lock().clone()
    }

    /// Fires when the connection ends.
    pub fn closed(&self) -> CancellationToken {
        self.closed.clone()
    }

    /// Whether the connection has ended.
    pub fn is_closed(&self) -> bool {
        self.closed.is_cancelled()
    }

    /// Writes a push, waiting while the writer is busy (backpressure for streamed output).
    ///
    /// # Errors
    /// [`Closed`] once the connection has ended.
    pub async fn push(&self, push: &Push) -> Result<(), Closed> {
        let line = encode_push(push).ok_or(Closed)?;
        if self.closed.is_cancelled() {
            return Err(Closed);
        }
        self.out.send(line).await.map_err(|_| Closed)
    }

    /// Queues a connection-scoped push without waiting (events, lease notices), in order.
    /// A connection that lets 1024 of them pile up is closed: it does not read.
    pub fn push_detached(&self, push: &Push) {
        let Some(line) = encode_push(push) else {
            return;
        };
        if self.closed.is_cancelled() {
            return;
        }
        if let Err(mpsc::error::TrySendError::Full(_)) = self.detached.try_send(line) {
            warn!(
                connection = self.id,
                "closing a connection that does not read its pushes"
            );
            self.closed.cancel();
        }
    }

    async fn reply(&self, reply: &Reply) {
        match simlock_contract::frame::to_line(reply) {
            Ok(line) => {
                let _ = self.out.send(Bytes::from(line)).await;
            }
            Err(e) => warn!(connection = self.id, error = %e, "a reply could not be serialised"),
        }
    }
}

fn encode_push(push: &Push) -> Option<Bytes> {
    // A push serialises as its frame (`{"push": …, "payload": …}`): written straight, no value
    // built in between.
    match simlock_contract::frame::to_line(push) {
        Ok(line) => Some(Bytes::from(line)),
        Err(e) => {
            warn!(push = push.kind(), error = %e, "a push could not be serialised");
            None
        }
    }
}

/// One call, as the service sees it.
#[derive(Debug, Clone)]
pub struct CallContext {
    /// The connection it came on.
    pub conn: Arc<Connection>,
    /// Its frame id, which request-scoped pushes carry as `requestId`.
    pub id: FrameId,
}

impl CallContext {
    /// Writes a request-scoped push for this call, waiting while the writer is busy.
    ///
    /// # Errors
    /// [`Closed`] once the connection has ended; the call may go on.
    pub async fn push(&self, push: &Push) -> Result<(), Closed> {
        self.conn.push(push).await
    }
}

/// What a daemon supplies to serve connections.
pub trait Service: Send + Sync + 'static {
    /// Decides who a `hello` makes the caller: role and principal.
    ///
    /// # Errors
    /// A contract error (e.g. `ADMIN_AUTHENTICATION_FAILED`); the connection then closes.
    fn greet(&self, origin: Origin, hello: &Hello) -> Result<Identity, ContractError>;

    /// Runs one call. The function runs in read order before the next line is read, so work
    /// done before the returned future first awaits (claiming a channel named in the call)
    /// precedes any later call; the future runs concurrently with other calls.
    fn dispatch(
        &self,
        ctx: CallContext,
        op: String,
        payload: Option<Value>,
    ) -> BoxFuture<'static, Result<Value, ContractError>>;

    /// `hello` succeeded on `conn`: its identity is set and calls follow.
    fn greeted(&self, conn: &Arc<Connection>) {
        let _ = conn;
    }

    /// A call the session answered itself without dispatching it (a protocol mismatch), so the
    /// service can release anything it claims for such a call when its line is read.
    fn refused(&self, ctx: CallContext, op: &str, payload: Option<Value>) {
        let _ = (ctx, op, payload);
    }

    /// The connection ended. Calls still running go on; their pushes are dropped.
    fn closed(&self, conn: &Arc<Connection>) {
        let _ = conn;
    }
}

/// How long a new connection may take to send its `hello` (as HTTP bounds a request's head):
/// one that sends nothing holds a descriptor for no one. After `hello`, a connection may idle
/// for as long as it likes (a held lease's).
pub const HELLO_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(30);

/// How long the answer that closes an ungreeted connection may take to be written.
const HELLO_CLOSE: std::time::Duration = std::time::Duration::from_secs(1);

/// What a session says about the daemon in `hello`.
#[derive(Debug, Clone)]
pub struct SessionConfig {
    /// The protocol range the daemon speaks.
    pub range: ProtocolRange,
    /// The daemon's version.
    pub version: String,
}

enum State {
    Greeting,
    Ready,
    Mismatched(ProtocolRange),
}

/// Serves one connection until it closes.
pub async fn serve(
    transport: Transport,
    origin: Origin,
    service: Arc<dyn Service>,
    config: SessionConfig,
) {
    serve_attached(transport, origin, None, service, config).await;
}

/// Serves one connection until it closes, with `attachment` reachable from its calls
/// through [`Connection::attachment`].
pub async fn serve_attached(
    transport: Transport,
    origin: Origin,
    attachment: Option<Arc<dyn Any + Send + Sync>>,
    service: Arc<dyn Service>,
    config: SessionConfig,
) {
    let Transport {
        mut lines,
        mut sink,
    } = transport;
    let (out_tx, mut out_rx) = mpsc::channel::<Bytes>(OUT_QUEUE);
    let (detached_tx, mut detached_rx) = mpsc::channel::<Bytes>(DETACHED_QUEUE);
    let closed = CancellationToken::new();
    let conn = Arc::new(Connection {
        id: NEXT_CONNECTION.fetch_add(1, Ordering::Relaxed),
        origin,
        attachment,
        identity: Mutex::new(None),
        out: out_tx.clone(),
        detached: detached_tx,
        closed: closed.clone(),
    });

    // Detached pushes reach the writer in order, each waiting its turn.
    let forward_closed = closed.clone();
    let forward_out = out_tx;
    tokio::spawn(async move {
        loop {
            tokio::select! {
                () = forward_closed.cancelled() => break,
                line = detached_rx.recv() => match line {
                    Some(line) => if forward_out.send(line).await.is_err() { break },
                    None => break,
                },
            }
        }
    });

    let writer_closed = closed.clone();
    let writer = tokio::spawn(async move {
        while let Some(line) = out_rx.recv().await {
            if let Err(e) = sink.send(line).await {
                debug!(error = %e, "connection write failed");
                writer_closed.cancel();
                return;
            }
        }
        let _ = sink.close().await;
    });

    let mut state = State::Greeting;
    let greeting_by = tokio::time::Instant::now() + HELLO_TIMEOUT;
    // A client that was never greeted and stopped reading: nothing of it is waited for.
    let mut stalled = false;
    loop {
        let greeting = matches!(state, State::Greeting);
        let line = tokio::select! {
            () = closed.cancelled() => break,
            line = lines.next() => line,
            () = tokio::time::sleep_until(greeting_by), if greeting => {
                let err = ContractError::new(
                    ErrorCode::HandshakeRequired,
                    format!("No hello within {} s: closing", HELLO_TIMEOUT.as_secs()),
                );
                let bound = tokio::time::Instant::now() + HELLO_CLOSE;
                stalled = !reply_within(&conn, &Reply::err(None, &err), Some(bound)).await;
                debug!(connection = conn.id, "no hello within the bound; closed");
                break;
            }
        };
        let bytes = match line {
            None => break,
            Some(Err(e)) => {
                debug!(connection = conn.id, error = %e, "connection read failed");
                break;
            }
            Some(Ok(Line::TooLong)) => {
                let err: ContractError =
                    BadFrame::TooLong(simlock_contract::bounds::MAX_CALL_LINE).into();
                if !reply_within(
                    &conn,
                    &Reply::err(None, &err),
                    greeting.then_some(greeting_by),
                )
                .await
                {
                    stalled = true;
                    break;
                }
                continue;
            }
            Some(Ok(Line::Frame(bytes))) => bytes,
        };
        let call = match Call::parse(&bytes) {
            Ok(call) => call,
            Err(bad) => {
                let reply = Reply::err(None, &ContractError::from(bad));
                if !reply_within(&conn, &reply, greeting.then_some(greeting_by)).await {
                    stalled = true;
                    break;
                }
                continue;
            }
        };
        match state {
            State::Greeting => match greet(&conn, &*service, &config, call).await {
                Some(next) => state = next,
                None => break,
            },
            State::Ready if call.op == "hello" => {
                let err =
                    ContractError::bad_request("hello was already received on this connection");
                conn.reply(&Reply::err(Some(call.id), &err)).await;
            }
            State::Ready => spawn_call(&conn, &*service, call),
            State::Mismatched(_) if call.op == "daemon.stop" => spawn_call(&conn, &*service, call),
            State::Mismatched(client) => {
                let err = version_unsupported(client, config.range, &config.version);
                let ctx = CallContext {
                    conn: conn.clone(),
                    id: call.id.clone(),
                };
                service.refused(ctx, &call.op, call.payload);
                conn.reply(&Reply::err(Some(call.id), &err)).await;
            }
        }
    }
    closed.cancel();
    service.closed(&conn);
    drop(conn);
    if stalled {
        // Never greeted, so no call runs: what is left to write has no reader.
        writer.abort();
        return;
    }
    // The writer ends once every call still running has written its reply.
    let _ = writer.await;
}

/// Writes `reply`; before `hello`, only until the greeting's deadline (`by`): a client that
/// sends bad lines without reading the answers is not waited for past it. Answers whether it
/// was written in time.
async fn reply_within(
    conn: &Arc<Connection>,
    reply: &Reply,
    by: Option<tokio::time::Instant>,
) -> bool {
    match by {
        None => {
            conn.reply(reply).await;
            true
        }
        Some(by) => tokio::time::timeout_at(by, conn.reply(reply)).await.is_ok(),
    }
}

/// Handles the first call. `None` closes the connection.
async fn greet(
    conn: &Arc<Connection>,
    service: &dyn Service,
    config: &SessionConfig,
    call: Call,
) -> Option<State> {
    if call.op != "hello" {
        let err = ContractError::new(ErrorCode::HandshakeRequired, "First message must be hello");
        conn.reply(&Reply::err(Some(call.id), &err)).await;
        return None;
    }
    let outcome = decode_input::<Hello>(call.payload).and_then(|hello| {
        let client = hello.client_range()?;
        let identity = service.greet(conn.origin, &hello)?;
        Ok((client, identity))
    });
    let (client, identity) = match outcome {
        Ok(found) => found,
        Err(err) => {
            conn.reply(&Reply::err(Some(call.id), &err)).await;
            return None;
        }
    };
    *conn.identity.lock() = Some(identity.clone());
    service.greeted(conn);
    match client.negotiate(config.range) {
        Some(version) => {
            let reply = HelloReply {
                protocol_version: version,
                daemon_protocol_range: config.range,
                version: config.version.clone(),
                role: identity.role,
                principal: identity.principal,
            };
            match serde_json::to_value(&reply) {
                Ok(payload) => conn.reply(&Reply::ok(call.id, payload)).await,
                Err(e) => {
                    conn.reply(&Reply::err(
                        Some(call.id),
                        &ContractError::internal(e.to_string()),
                    ))
                    .await
                }
            }
            Some(State::Ready)
        }
        None => {
            let err = version_unsupported(client, config.range, &config.version);
            conn.reply(&Reply::err(Some(call.id), &err)).await;
            Some(State::Mismatched(client))
        }
    }
}

fn spawn_call(conn: &Arc<Connection>, service: &dyn Service, call: Call) {
    let ctx = CallContext {
        conn: conn.clone(),
        id: call.id.clone(),
    };
    let future = service.dispatch(ctx, call.op, call.payload);
    let conn = conn.clone();
    let id = call.id;
    tokio::spawn(async move {
        let reply = match future.await {
            Ok(payload) => Reply::ok(id, payload),
            Err(err) => Reply::err(Some(id), &err),
        };
        conn.reply(&reply).await;
    });
}
