//! [`Client`]: one handle on a daemon whatever the transport, with a typed method per operation.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use serde_json::{Value, json};
use simlock_contract::model::{LeaseGrant, LeaseRecord, Platform, TokenRole};
use simlock_contract::ops::{
    CatalogGet, CatalogInput, CatalogOutput, ConfigGet, ConfigView, DaemonStop, DaemonStopOutput,
    Empty, EventsReplay, ExecInput, LeaseCancel, LeaseCancelInput, LeaseCancelOutput, LeaseGet,
    LeaseGetInput, LeaseIdInput, LeaseList, LeaseListOutput, LeaseRelease, LeaseReleaseAll,
    LeaseReleaseOutput, LeaseRenew, LeaseRenewInput, LeaseRequestInput, ListGet, ListInput,
    ListKind, ListOutput, ReleaseAllOutput, ReplayInput, ReplayOutput, StatusGet, StatusOutput,
    TokenCreate, TokenCreateInput, TokenCreateOutput, TokenList, TokenListOutput, TokenRevoke,
    TokenRevokeInput, TokenRevokeOutput, WorkerDrain, WorkerDrainOutput, WorkerIdInput, WorkerList,
    WorkerListOutput, WorkerRemove, WorkerRemoveOutput, WorkerUndrain,
};
use simlock_contract::{ContractError, ErrorCode, HelloReply, Operation, Role};
use simlock_wire::{Transport, decode_output};

use crate::events::EventFollow;
use crate::exec::ExecStream;
use crate::hold::LeaseHold;
use crate::http::HttpBackend;
use crate::notices::LeaseNotices;
use crate::request::PendingLease;
use crate::wire::WireBackend;

/// How a client connects and how long it waits.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConnectOptions {
    /// Who the client says it is in `hello` (socket and transport only; over HTTP the token is
    /// the principal). Absent: the daemon's default (its user's name).
    pub principal: Option<String>,
    /// A secret asking for the admin role in `hello`: the daemon's per-start admin secret
    /// (`$SIMLOCK_HOME/admin.token`) or an operator token's secret.
    pub credential: Option<String>,
    /// The client's version, for the daemon's logs.
    pub client_version: Option<String>,
    /// The longest a plain call (and connecting) may take before it fails
    /// `DAEMON_CONNECTION_LOST`. Lease requests and streams are not bound by it.
    pub call_timeout: Duration,
    /// How long an aborted lease request that can no longer be cancelled may take to settle
    /// before the abort gives up waiting (its grant, if one comes later, then expires on its TTL).
    pub settle_timeout: Duration,
    /// The longest an HTTP stream may stay silent (the daemon sends a keepalive every 15 s)
    /// before it fails `DAEMON_CONNECTION_LOST`.
    pub stream_idle_timeout: Duration,
    /// CA certificates (PEM) an `https://` daemon's certificate may chain to, besides the
    /// platform's roots.
    pub ca_file: Option<PathBuf>,
}

impl Default for ConnectOptions {
    fn default() -> Self {
        Self {
            principal: None,
            credential: None,
            client_version: Some(env!("CARGO_PKG_VERSION").to_owned()),
            call_timeout: Duration::from_secs(60),
            settle_timeout: Duration::from_secs(600),
            stream_idle_timeout: Duration::from_secs(45),
            ca_file: None,
        }
    }
}

impl ConnectOptions {
    /// The options with `principal` set.
    #[must_use]
    pub fn principal(mut self, principal: impl Into<String>) -> Self {
        self.principal = Some(principal.into());
        self
    }

    /// The options with `credential` set.
    #[must_use]
    pub fn credential(mut self, credential: impl Into<String>) -> Self {
        self.credential = Some(credential.into());
        self
    }

    /// The options with a CA file for `https://` daemons.
    #[must_use]
    pub fn ca_file(mut self, path: impl Into<PathBuf>) -> Self {
        self.ca_file = Some(path.into());
        self
    }

    /// The options with the plain-call bound set.
    #[must_use]
    pub const fn call_timeout(mut self, timeout: Duration) -> Self {
        self.call_timeout = timeout;
        self
    }
}

/// The daemon's home: `$SIMLOCK_HOME`, else `~/.simlock`.
pub fn home_from_env() -> PathBuf {
    std::env::var_os("SIMLOCK_HOME")
        .filter(|h| !h.is_empty())
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            std::env::var_os("HOME").map_or_else(
                || PathBuf::from(".simlock"),
                |h| PathBuf::from(h).join(".simlock"),
            )
        })
}

/// The socket of the daemon whose home is `home`.
pub fn socket_in(home: &Path) -> PathBuf {
    home.join("daemon.sock")
}

/// The per-start admin secret the daemon whose home is `home` wrote, when it exists and can be
/// read (it is readable by the daemon's owner only).
pub fn admin_secret_in(home: &Path) -> Option<String> {
    std::fs::read_to_string(home.join("admin.token"))
        .ok()
        .map(|s| s.trim().to_owned())
        .filter(|s| !s.is_empty())
}

/// The transport under a client.
#[derive(Debug, Clone)]
pub(crate) enum Backend {
    /// Wire frames over the socket or an already-open transport.
    Wire(Arc<WireBackend>),
    /// HTTP `/v1` with a bearer token.
    Http(Arc<HttpBackend>),
}

/// A connection to a simlock daemon. Cheap to clone; clones share the connection.
#[derive(Debug, Clone)]
pub struct Client {
    pub(crate) backend: Backend,
    pub(crate) options: Arc<ConnectOptions>,
}

impl Client {
    /// Connects to the daemon listening on the unix socket at `path` and says `hello`.
    ///
    /// # Errors
    /// `DAEMON_CONNECTION_LOST` naming the path when no daemon answers there; the daemon's
    /// refusal of `hello` (`ADMIN_AUTHENTICATION_FAILED`, `PROTOCOL_VERSION_UNSUPPORTED`).
    pub async fn connect_socket(
        path: impl AsRef<Path>,
        options: ConnectOptions,
    ) -> Result<Self, ContractError> {
        let path = path.as_ref();
        let stream =
            tokio::time::timeout(options.call_timeout, tokio::net::UnixStream::connect(path))
                .await
                .map_err(|_| {
                    ContractError::new(
                        ErrorCode::DaemonConnectionLost,
                        format!(
                            "the simlock daemon at {} did not accept a connection within {} ms",
                            path.display(),
                            options.call_timeout.as_millis()
                        ),
                    )
                })?
                .map_err(|e| not_reachable(path, &e))?;
        let (reader, writer) = stream.into_split();
        Self::over_transport(Transport::client_io(reader, writer), options).await
    }

    /// Connects to the daemon whose home is `home` (its socket is `home/daemon.sock`).
    ///
    /// # Errors
    /// As [`Self::connect_socket`].
    pub async fn connect_home(
        home: impl AsRef<Path>,
        options: ConnectOptions,
    ) -> Result<Self, ContractError> {
        Self::connect_socket(socket_in(home.as_ref()), options).await
    }

    /// Says `hello` over an already-open wire transport (a gateway's uplink to a worker, an
    /// in-memory pipe in tests) and wraps it.
    ///
    /// # Errors
    /// The daemon's refusal of `hello`, or `DAEMON_CONNECTION_LOST`.
    pub async fn over_transport(
        transport: Transport,
        options: ConnectOptions,
    ) -> Result<Self, ContractError> {
        let backend = WireBackend::start(transport, &options).await?;
        Ok(Self {
            backend: Backend::Wire(backend),
            options: Arc::new(options),
        })
    }

    /// A client for the daemon serving HTTP at `base_url` (`http://host:port` or
    /// `https://host:port`, optionally with a path prefix), authenticating with the bearer
    /// `token`. Nothing is sent until the first call. Over `https://` the daemon's certificate
    /// must chain to the platform's roots or to [`ConnectOptions::ca_file`].
    ///
    /// # Errors
    /// `BAD_REQUEST` when the URL is not an `http://` or `https://` URL, or the CA file cannot
    /// be read.
    pub fn over_http(
        base_url: &str,
        token: &str,
        options: ConnectOptions,
    ) -> Result<Self, ContractError> {
        let backend = HttpBackend::new(
            base_url,
            token,
            options.stream_idle_timeout,
            options.ca_file.as_deref(),
        )?;
        Ok(Self {
            backend: Backend::Http(Arc::new(backend)),
            options: Arc::new(options),
        })
    }

    /// The options the client was made with.
    pub fn options(&self) -> &ConnectOptions {
        &self.options
    }

    /// What the daemon answered to `hello` (wire transports only).
    pub fn hello(&self) -> Option<&HelloReply> {
        match &self.backend {
            Backend::Wire(wire) => Some(wire.hello()),
            Backend::Http(_) => None,
        }
    }

    /// The session's principal (wire transports only; over HTTP it is the token's id).
    pub fn principal(&self) -> Option<&str> {
        self.hello().map(|h| h.principal.as_str())
    }

    /// The session's role (wire transports only).
    pub fn role(&self) -> Option<Role> {
        self.hello().map(|h| h.role)
    }

    /// The wire client under a socket or transport connection, for calls this crate does not
    /// type (a gateway's `relay.request` with its `relay-head` push). Its unsolicited pushes stay
    /// with this client: lease notices and events are read here.
    pub fn wire(&self) -> Option<&simlock_wire::WireClient> {
        match &self.backend {
            Backend::Wire(wire) => Some(wire.client()),
            Backend::Http(_) => None,
        }
    }

    /// Whether the connection has ended for good (wire transports; an HTTP client never ends).
    pub fn is_closed(&self) -> bool {
        match &self.backend {
            Backend::Wire(wire) => wire.is_closed(),
            Backend::Http(_) => false,
        }
    }

    /// Ends the connection; pending calls fail `DAEMON_CONNECTION_LOST`.
    pub fn close(&self) {
        if let Backend::Wire(wire) = &self.backend {
            wire.close();
        }
    }

    // === Plain calls ===

    /// Runs any operation with its typed input, bounded by [`ConnectOptions::call_timeout`].
    /// Over HTTP this is `POST /v1/ops/{operation}`.
    ///
    /// # Errors
    /// The daemon's error; `DAEMON_CONNECTION_LOST` when the connection is lost or the call
    /// outlives its bound; `INTERNAL` when the output does not match the operation.
    pub async fn call<O: Operation>(&self, input: &O::Input) -> Result<O::Output, ContractError> {
        let bound = self.options.call_timeout;
        let call = async {
            match &self.backend {
                // The reply is decoded once, straight from its raw payload.
                Backend::Wire(wire) => wire.client().call::<O>(input).await,
                Backend::Http(http) => decode_output::<O>(http.op(O::NAME, payload(input)?).await?),
            }
        };
        tokio::time::timeout(bound, call)
            .await
            .unwrap_or_else(|_| Err(timed_out(O::NAME, bound)))
    }

    /// `status.get`.
    ///
    /// # Errors
    /// As [`Self::call`].
    pub async fn status(&self) -> Result<StatusOutput, ContractError> {
        self.call::<StatusGet>(&Empty {}).await
    }

    /// `catalog.get`, for one platform or all.
    ///
    /// # Errors
    /// As [`Self::call`].
    pub async fn catalog(
        &self,
        platform: Option<Platform>,
    ) -> Result<CatalogOutput, ContractError> {
        self.call::<CatalogGet>(&CatalogInput { platform }).await
    }

    /// `config.get` (admin).
    ///
    /// # Errors
    /// As [`Self::call`].
    pub async fn config(&self) -> Result<ConfigView, ContractError> {
        self.call::<ConfigGet>(&Empty {}).await
    }

    /// `list.get` (admin): devices, leases, rules or waiting requests.
    ///
    /// # Errors
    /// As [`Self::call`].
    pub async fn list(&self, kind: ListKind) -> Result<ListOutput, ContractError> {
        self.call::<ListGet>(&ListInput { kind }).await
    }

    /// `lease.list`: every lease for an admin, the caller's own for an agent.
    ///
    /// # Errors
    /// As [`Self::call`].
    pub async fn leases(&self) -> Result<LeaseListOutput, ContractError> {
        self.call::<LeaseList>(&Empty {}).await
    }

    /// `lease.get`: one lease, as [`Self::leases`] shows it. Through a gateway that restarted, a
    /// lease whose worker has not reported again answers `WORKER_UNREACHABLE`, not
    /// `UNKNOWN_LEASE`.
    ///
    /// # Errors
    /// `UNKNOWN_LEASE` when this caller sees no such lease, or as [`Self::call`].
    pub async fn lease(&self, lease_id: &str) -> Result<LeaseRecord, ContractError> {
        let input = LeaseGetInput {
            lease_id: lease_id.to_owned(),
        };
        Ok(self.call::<LeaseGet>(&input).await?.lease)
    }

    /// `lease.renew`; `ttl_ms` absent keeps the lease's recorded width.
    ///
    /// # Errors
    /// `UNKNOWN_LEASE` when the lease is gone, or as [`Self::call`].
    pub async fn renew(
        &self,
        lease_id: &str,
        ttl_ms: Option<u64>,
    ) -> Result<LeaseRecord, ContractError> {
        self.call::<LeaseRenew>(&LeaseRenewInput {
            lease_id: lease_id.to_owned(),
            ttl_ms,
        })
        .await
    }

    /// `lease.release`.
    ///
    /// # Errors
    /// `UNKNOWN_LEASE` when the lease is gone, or as [`Self::call`].
    pub async fn release(&self, lease_id: &str) -> Result<LeaseReleaseOutput, ContractError> {
        self.call::<LeaseRelease>(&LeaseIdInput {
            reason: None,
            lease_id: lease_id.to_owned(),
        })
        .await
    }

    /// `lease.cancel` for `requester_id` (absent: the session's principal).
    ///
    /// # Errors
    /// As [`Self::call`].
    pub async fn cancel(
        &self,
        requester_id: Option<String>,
    ) -> Result<LeaseCancelOutput, ContractError> {
        self.call::<LeaseCancel>(&LeaseCancelInput { requester_id })
            .await
    }

    /// `lease.release-all` (admin).
    ///
    /// # Errors
    /// As [`Self::call`].
    pub async fn release_all(&self) -> Result<ReleaseAllOutput, ContractError> {
        self.call::<LeaseReleaseAll>(&Empty {}).await
    }

    /// `events.replay` (admin): buffered events at or after `since_ts` (ms since the epoch).
    ///
    /// # Errors
    /// As [`Self::call`].
    pub async fn events(&self, since_ts: Option<i64>) -> Result<ReplayOutput, ContractError> {
        self.call::<EventsReplay>(&ReplayInput { since_ts }).await
    }

    /// `token.create` (admin); the secret is in the answer, this once.
    ///
    /// # Errors
    /// As [`Self::call`].
    pub async fn token_create(
        &self,
        role: TokenRole,
        label: Option<String>,
    ) -> Result<TokenCreateOutput, ContractError> {
        self.call::<TokenCreate>(&TokenCreateInput { role, label })
            .await
    }

    /// `token.list` (admin).
    ///
    /// # Errors
    /// As [`Self::call`].
    pub async fn token_list(&self) -> Result<TokenListOutput, ContractError> {
        self.call::<TokenList>(&Empty {}).await
    }

    /// `token.revoke` (admin).
    ///
    /// # Errors
    /// As [`Self::call`].
    pub async fn token_revoke(&self, id: &str) -> Result<TokenRevokeOutput, ContractError> {
        self.call::<TokenRevoke>(&TokenRevokeInput { id: id.to_owned() })
            .await
    }

    /// `worker.list` (admin).
    ///
    /// # Errors
    /// As [`Self::call`].
    pub async fn workers(&self) -> Result<WorkerListOutput, ContractError> {
        self.call::<WorkerList>(&Empty {}).await
    }

    /// `worker.drain` (admin).
    ///
    /// # Errors
    /// As [`Self::call`].
    pub async fn worker_drain(&self, worker_id: &str) -> Result<WorkerDrainOutput, ContractError> {
        self.call::<WorkerDrain>(&worker(worker_id)).await
    }

    /// `worker.undrain` (admin).
    ///
    /// # Errors
    /// As [`Self::call`].
    pub async fn worker_undrain(
        &self,
        worker_id: &str,
    ) -> Result<WorkerDrainOutput, ContractError> {
        self.call::<WorkerUndrain>(&worker(worker_id)).await
    }

    /// `worker.remove` (admin).
    ///
    /// # Errors
    /// As [`Self::call`].
    pub async fn worker_remove(
        &self,
        worker_id: &str,
    ) -> Result<WorkerRemoveOutput, ContractError> {
        self.call::<WorkerRemove>(&worker(worker_id)).await
    }

    /// `daemon.stop` (admin).
    ///
    /// # Errors
    /// As [`Self::call`].
    pub async fn stop_daemon(&self) -> Result<DaemonStopOutput, ContractError> {
        self.call::<DaemonStop>(&Empty {}).await
    }

    // === Lease requests, holds, exec, events, notices ===

    /// Starts `lease.request`. Over HTTP this is the lease-requests resource
    /// (`POST /v1/lease-requests`, then its event stream), unless the input names an `owner`,
    /// which only `POST /v1/ops/lease.request` carries (without progress).
    ///
    /// # Errors
    /// `DAEMON_CONNECTION_LOST` when the connection has ended.
    pub async fn begin_lease_request(
        &self,
        input: LeaseRequestInput,
    ) -> Result<PendingLease, ContractError> {
        PendingLease::begin(self.clone(), input).await
    }

    /// Requests a lease and waits for the outcome, handing every `progress` to `on_progress`.
    /// When `abort` resolves first the request is withdrawn as `lease.cancel` allows
    /// (see [`PendingLease::abort`]).
    ///
    /// # Errors
    /// The daemon's refusal (`NO_CAPACITY`, `QUEUE_TIMEOUT`, …), `CANCELLED` after an abort, or
    /// `DAEMON_CONNECTION_LOST`.
    pub async fn request_lease<F, A>(
        &self,
        input: LeaseRequestInput,
        on_progress: F,
        abort: A,
    ) -> Result<LeaseGrant, ContractError>
    where
        F: FnMut(&simlock_contract::push::Progress),
        A: Future<Output = ()>,
    {
        let pending = self.begin_lease_request(input).await?;
        pending.run(on_progress, abort).await
    }

    /// Holds `grant`: renews it at a third of its TTL until [`LeaseHold::release`], and reports
    /// when the daemon ends it. Must be called inside a tokio runtime.
    pub fn hold(&self, grant: LeaseGrant) -> LeaseHold {
        LeaseHold::start(self.clone(), grant)
    }

    /// Runs `device.exec`; its output arrives on the returned stream, then the exit code.
    ///
    /// # Errors
    /// A refusal before the tool starts (`UNKNOWN_LEASE`, `FORBIDDEN`, …) over HTTP; over the
    /// socket such refusals arrive on the stream.
    pub async fn exec(&self, input: ExecInput) -> Result<ExecStream, ContractError> {
        ExecStream::start(self, input).await
    }

    /// Follows the daemon's events as they happen (admin): `events.subscribe` on the socket,
    /// `GET /v1/events/stream` over HTTP. Drop the stream to stop.
    ///
    /// # Errors
    /// `FORBIDDEN` without the admin role, or as [`Self::call`].
    pub async fn follow_events(&self) -> Result<EventFollow, ContractError> {
        EventFollow::start(self).await
    }

    /// The lease-scoped pushes for `lease_id`: the socket's unsolicited pushes filtered to the
    /// lease, or `GET /v1/leases/{id}/events` over HTTP.
    ///
    /// # Errors
    /// Over HTTP, `UNKNOWN_LEASE` when the lease is not the caller's or is gone.
    pub async fn lease_notices(&self, lease_id: &str) -> Result<LeaseNotices, ContractError> {
        LeaseNotices::open(self, lease_id).await
    }
}

fn worker(worker_id: &str) -> WorkerIdInput {
    WorkerIdInput {
        worker_id: worker_id.to_owned(),
    }
}

/// `DAEMON_CONNECTION_LOST` for a socket nobody answers on.
fn not_reachable(path: &Path, e: &std::io::Error) -> ContractError {
    let message = match e.kind() {
        std::io::ErrorKind::NotFound | std::io::ErrorKind::ConnectionRefused => {
            let home = path.parent().unwrap_or(path).display();
            format!(
                "no simlock daemon is running at {}; start one with simlock-worker --home {home} \
                 (or simlock-gateway --home {home})",
                path.display()
            )
        }
        _ => format!(
            "cannot connect to the simlock daemon at {}: {e}",
            path.display()
        ),
    };
    ContractError::new(ErrorCode::DaemonConnectionLost, message)
        .with_details(json!({ "socket": path.display().to_string() }))
}

/// An operation's input as the JSON payload of its call.
pub(crate) fn payload<T: serde::Serialize>(input: &T) -> Result<Value, ContractError> {
    serde_json::to_value(input)
        .map_err(|e| ContractError::internal(format!("the input could not be encoded: {e}")))
}

/// `DAEMON_CONNECTION_LOST` for a call that outlived its bound.
pub(crate) fn timed_out(op: &str, bound: Duration) -> ContractError {
    ContractError::new(
        ErrorCode::DaemonConnectionLost,
        format!(
            "the daemon did not answer {op} within {} ms",
            bound.as_millis()
        ),
    )
}

/// `CANCELLED`, the outcome of an aborted lease request.
pub(crate) fn cancelled() -> ContractError {
    ContractError::new(ErrorCode::Cancelled, "The lease request was cancelled")
}
