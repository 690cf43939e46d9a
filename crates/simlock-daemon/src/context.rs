//! What a handler knows about the call it serves: who, from where, and where its pushes go.

use std::any::Any;
use std::sync::Arc;

use parking_lot::Mutex;
use simlock_contract::{FrameId, Push, Role};
use simlock_wire::Connection;
use tokio::sync::mpsc;

/// Where a call came from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CallOrigin {
    /// The local unix socket.
    Socket,
    /// The worker's uplink: the gateway calls.
    GatewayUplink,
    /// HTTP with a bearer token; the principal is the token's id.
    Http,
    /// A component of this daemon calling in-process (the agent-device front).
    Internal,
}

/// Where a call's request-scoped pushes go.
#[derive(Debug, Clone)]
enum PushSink {
    Connection(Arc<Connection>),
    Channel(mpsc::Sender<Push>),
    Discard,
}

/// Something claimed when a call's line was read, handed to its handler (e.g. a relay's
/// channel). Dropping it unclaimed releases what it holds.
pub type Prepared = Box<dyn Any + Send>;

/// Who is looking, for what they may see and act on: an admin everything, anyone else only what
/// it owns. This is the one rule behind every list, every nested view and every action on owned
/// things (leases, lease requests, their notices), on a worker and on a gateway alike.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Viewer<'a> {
    /// The principal looking.
    pub principal: &'a str,
    /// Whether it is an admin.
    pub admin: bool,
}

impl Viewer<'static> {
    /// An admin that is no principal: for the daemon's own views (metrics, a worker's view of
    /// itself for an operator) and tests.
    pub const ADMIN: Self = Self {
        principal: "",
        admin: true,
    };
}

impl<'a> Viewer<'a> {
    /// The viewer of `principal` in `role`.
    pub fn new(principal: &'a str, role: Role) -> Self {
        Self {
            principal,
            admin: role == Role::Admin,
        }
    }

    /// Whether the viewer may see, and act on, what `owner` owns.
    pub fn may_see(self, owner: &str) -> bool {
        self.admin || owner == self.principal
    }
}

/// One call, as a handler sees it.
#[derive(Debug, Clone)]
pub struct CallCtx {
    /// The caller's principal.
    pub principal: String,
    /// The caller's role.
    pub role: Role,
    /// Where the call came from.
    pub origin: CallOrigin,
    request_id: FrameId,
    pushes: PushSink,
    prepared: Arc<Mutex<Option<Prepared>>>,
}

impl CallCtx {
    /// A call that arrived on a wire connection.
    pub fn on_connection(
        conn: Arc<Connection>,
        request_id: FrameId,
        principal: String,
        role: Role,
    ) -> Self {
        let origin = if conn.is_gateway_uplink() {
            CallOrigin::GatewayUplink
        } else {
            CallOrigin::Socket
        };
        Self {
            principal,
            role,
            origin,
            request_id,
            pushes: PushSink::Connection(conn),
            prepared: Arc::new(Mutex::new(None)),
        }
    }

    /// A call over HTTP by the holder of a token; its pushes go to `pushes` when given.
    pub fn http(principal: String, role: Role, pushes: Option<mpsc::Sender<Push>>) -> Self {
        Self::detached(principal, role, CallOrigin::Http, pushes)
    }

    /// A call made in-process by a component of the daemon.
    pub fn internal(principal: String, role: Role, pushes: Option<mpsc::Sender<Push>>) -> Self {
        Self::detached(principal, role, CallOrigin::Internal, pushes)
    }

    fn detached(
        principal: String,
        role: Role,
        origin: CallOrigin,
        pushes: Option<mpsc::Sender<Push>>,
    ) -> Self {
        Self {
            principal,
            role,
            origin,
            request_id: FrameId::from(0),
            pushes: pushes.map_or(PushSink::Discard, PushSink::Channel),
            prepared: Arc::new(Mutex::new(None)),
        }
    }

    /// Who is calling, for what it may see: [`Viewer`].
    pub fn viewer(&self) -> Viewer<'_> {
        Viewer::new(&self.principal, self.role)
    }

    /// Whether the call came on the worker's uplink from its gateway.
    pub fn is_gateway_uplink(&self) -> bool {
        self.origin == CallOrigin::GatewayUplink
    }

    /// The frame id request-scoped pushes must carry.
    pub const fn request_id(&self) -> &FrameId {
        &self.request_id
    }

    /// The connection the call came on, if any.
    pub fn connection(&self) -> Option<&Arc<Connection>> {
        match &self.pushes {
            PushSink::Connection(conn) => Some(conn),
            PushSink::Channel(_) | PushSink::Discard => None,
        }
    }

    /// The connection's id, if any.
    pub fn connection_id(&self) -> Option<u64> {
        self.connection().map(|c| c.id())
    }

    /// Writes a request-scoped push, waiting while the reader is behind. Returns whether the
    /// push was delivered; a caller that went away does not stop the call.
    pub async fn push(&self, push: Push) -> bool {
        match &self.pushes {
            PushSink::Connection(conn) => conn.push(&push).await.is_ok(),
            PushSink::Channel(tx) => tx.send(push).await.is_ok(),
            PushSink::Discard => false,
        }
    }

    /// Stores what the call's read-time hook claimed.
    pub fn set_prepared(&self, prepared: Prepared) {
        *self.prepared.lock() = Some(prepared);
    }

    /// Takes what the call's read-time hook claimed, if it is a `T`.
    pub fn take_prepared<T: 'static>(&self) -> Option<T> {
        let boxed = self.prepared.lock().take()?;
        boxed.downcast::<T>().ok().map(|b| *b)
    }
}
