//! Bringing a daemon up and down: the parts every daemon has (home, store, clock, events,
//! tokens, presence, start-up gate, shutdown), then its hosts (socket, HTTP), then a graceful
//! stop. The worker and the gateway compose their domain on top; the binaries only parse
//! configuration and wait for a signal.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use simlock_contract::event::{Event, EventModule};
use simlock_contract::model::Mode;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use crate::auth::DaemonGreeter;
use crate::clock::{SharedClock, TokioClock};
use crate::config::DaemonConfig;
use crate::events::{self, EventBus};
use crate::home::{AdminSecret, Home};
use crate::http::requests::RequestBook;
use crate::http::responses::HttpResponses;
use crate::http::{HttpApp, Mount, bind, serve_http};
use crate::metrics::Metrics;
use crate::pipeline::{Pipeline, Router, Shutdown, StartupGate, register_daemon_ops};
use crate::presence::Presence;
use crate::socket::{claim, serve_socket};
use crate::store::Database;
use crate::tokens::{self, TokenStore};

/// How long a stopping daemon waits for its hosts.
const STOP_GRACE: Duration = Duration::from_secs(5);

/// Why a daemon could not start.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    /// The home directory.
    #[error("cannot use home {path}: {source}")]
    Home {
        /// The directory.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// The state store.
    #[error(transparent)]
    Store(#[from] crate::store::StoreError),
    /// The state store could not be opened or read at start-up (a full disk, a file that is
    /// no database).
    #[error("cannot use the state store {path}: {source}")]
    Database {
        /// The file.
        path: PathBuf,
        /// Why.
        source: crate::store::StoreError,
    },
    /// The socket.
    #[error(transparent)]
    Socket(#[from] crate::socket::SocketError),
    /// The HTTP listener.
    #[error("cannot listen for HTTP on {address}: {source}")]
    Http {
        /// The address.
        address: String,
        /// Why.
        source: std::io::Error,
    },
    /// The HTTP listener's certificate or key (`http.tls.*`), or the uplink's CA file.
    #[error(transparent)]
    Tls(#[from] simlock_tls::TlsError),
    /// The home is another kind of daemon's: a worker's state is no gateway's, nor the other
    /// way round, and their instance ids would be one.
    #[error(
        "home {path} belongs to a {owner} (its state.db holds a {owner}'s state); a {mode} needs a home of its own: pass --home with another directory"
    )]
    HomeOfAnother {
        /// The directory.
        path: PathBuf,
        /// Whose it is.
        owner: String,
        /// The daemon that tried to start there.
        mode: &'static str,
    },
    /// The domain refused to start.
    #[error("{0}")]
    Domain(String),
}

/// Where a daemon listens besides its unix socket.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Listen {
    /// The unix socket alone.
    SocketOnly,
    /// The unix socket and HTTP (`http.*`).
    SocketAndHttp,
}

impl Listen {
    /// HTTP as `http.enabled` says, off when it is unset (a worker's choice; a gateway always
    /// serves HTTP).
    pub fn as_configured(config: &DaemonConfig) -> Self {
        if config.http.turned_on() {
            Self::SocketAndHttp
        } else {
            Self::SocketOnly
        }
    }
}

/// The parts every daemon has.
pub struct Base {
    /// Its home.
    pub home: Home,
    /// Its configuration.
    pub config: DaemonConfig,
    /// Worker or gateway.
    pub mode: Mode,
    /// Its version.
    pub version: String,
    /// Its instance id (minted on first start).
    pub instance_id: String,
    /// State.
    pub db: Database,
    /// Time.
    pub clock: SharedClock,
    /// Events.
    pub bus: Arc<EventBus>,
    /// Tokens.
    pub tokens: Arc<TokenStore>,
    /// Connections by principal.
    pub presence: Presence,
    /// The start-up gate.
    pub gate: StartupGate,
    /// The shutdown handle.
    pub shutdown: Shutdown,
    /// Metrics.
    pub metrics: Metrics,
}

impl std::fmt::Debug for Base {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Base")
            .field("home", &self.home)
            .field("instance_id", &self.instance_id)
            .finish_non_exhaustive()
    }
}

/// The `meta` key that says which kind of daemon a home is (`worker` or `gateway`).
const HOME_MODE: &str = "mode";

impl Base {
    /// Opens the home and the store of a daemon of `mode`; a home another kind of daemon has
    /// used is refused.
    ///
    /// # Errors
    /// [`StartError`].
    pub fn open(
        home: Home,
        config: DaemonConfig,
        mode: Mode,
        version: String,
        clock: Option<SharedClock>,
    ) -> Result<Self, StartError> {
        home.ensure().map_err(|source| StartError::Home {
            path: home.root().to_owned(),
            source,
        })?;
        let path = home.database();
        let unusable = |source| StartError::Database {
            path: path.clone(),
            source,
        };
        let db = Database::open(&path).map_err(unusable)?;
        // A home is one daemon's: the first to start on it says which kind, for good.
        match db.meta(HOME_MODE).map_err(unusable)? {
            Some(owner) if owner != mode.as_str() => {
                return Err(StartError::HomeOfAnother {
                    path: home.root().to_owned(),
                    owner,
                    mode: mode.as_str(),
                });
            }
            Some(_) => {}
            None => db.set_meta(HOME_MODE, mode.as_str()).map_err(unusable)?,
        }
        let clock = clock.unwrap_or_else(|| TokioClock::system().shared());
        let instance_id = db.instance_id(uuid_like).map_err(unusable)?;
        let bus = EventBus::new(
            usize::try_from(config.event_buffer.capacity).unwrap_or(1000),
            clock.clone(),
        );
        let tokens = TokenStore::open(db.clone(), clock.clone()).map_err(unusable)?;
        let metrics = Metrics::new();
        bus.register_metrics(&metrics);
        Ok(Self {
            home,
            config,
            mode,
            version,
            instance_id,
            db,
            clock,
            bus,
            tokens,
            presence: Presence::new(),
            gate: StartupGate::new(),
            shutdown: Shutdown::new(),
            metrics,
        })
    }

    /// A router holding the operations every daemon answers itself: `daemon.stop`, events and
    /// tokens.
    pub fn router(&self) -> Router {
        let mut router = Router::new();
        register_daemon_ops(&mut router, &self.shutdown);
        events::register(&mut router, &self.bus);
        tokens::register(&mut router, &self.tokens, self.mode);
        router
    }

    /// Starts the hosts: the unix socket always, HTTP as `listen` says (with `mounts`).
    ///
    /// # Errors
    /// [`StartError`] when the socket or the HTTP address cannot be claimed.
    pub async fn serve(
        self,
        router: Router,
        listen: Listen,
        mounts: Vec<Arc<dyn Mount>>,
    ) -> Result<Running, StartError> {
        self.serve_with(router, listen, move |_| mounts).await
    }

    /// As [`Self::serve`], with mounts built from the daemon's pipeline (a mount that calls the
    /// daemon's own operations, such as the agent-device front).
    ///
    /// # Errors
    /// [`StartError`] when the socket or the HTTP address cannot be claimed.
    pub async fn serve_with(
        self,
        router: Router,
        listen: Listen,
        mounts: impl FnOnce(&Arc<Pipeline>) -> Vec<Arc<dyn Mount>>,
    ) -> Result<Running, StartError> {
        // The socket first: a daemon already serving this home keeps its socket and its admin
        // secret. Past this point a failed start removes both again ([`Claimed`]).
        let listener = claim(&self.home.socket()).await?;
        let stop = CancellationToken::new();
        let mut claimed = Claimed {
            home: self.home.clone(),
            stop: stop.clone(),
            kept: false,
        };
        let admin = AdminSecret::create(&self.home).map_err(|source| StartError::Home {
            path: self.home.admin_token(),
            source,
        })?;
        let pipeline = Arc::new(Pipeline::new(
            router,
            self.gate.clone(),
            self.shutdown.clone(),
            self.version.clone(),
            Arc::new(DaemonGreeter::new(self.tokens.clone(), Some(admin))),
            self.presence.clone(),
        ));
        let mounts = mounts(&pipeline);
        let mut tasks = vec![serve_socket(listener, pipeline.clone(), stop.clone())];
        let mut http_addr = None;
        let mut http_tls = false;
        if listen == Listen::SocketAndHttp {
            let tls = match (
                &self.config.http.tls.cert_file,
                &self.config.http.tls.key_file,
            ) {
                (Some(cert), Some(key)) => Some(simlock_tls::ServerTls::load(
                    simlock_tls::PemFile::new(self.home.resolve(cert), "http.tls.certFile"),
                    simlock_tls::PemFile::new(self.home.resolve(key), "http.tls.keyFile"),
                )?),
                _ => None,
            };
            http_tls = tls.is_some();
            let address = format!("{}:{}", self.config.http.host, self.config.http.port);
            let listener = bind(&self.config.http.host, self.config.http.port)
                .await
                .map_err(|source| StartError::Http {
                    address: address.clone(),
                    source,
                })?;
            http_addr = listener.local_addr().ok();
            let app = Arc::new(HttpApp {
                pipeline: pipeline.clone(),
                tokens: self.tokens.clone(),
                bus: self.bus.clone(),
                clock: self.clock.clone(),
                requests: RequestBook::new(
                    self.clock.clone(),
                    self.config.lease.request_retention_ms,
                    usize::try_from(self.config.lease.max_request_records).unwrap_or(10_000),
                ),
                metrics: self.metrics.clone(),
                responses: HttpResponses::new(&self.metrics),
                mounts,
            });
            tasks.push(serve_http(listener, app, tls, stop.clone()));
        }
        info!(mode = ?self.mode, instance = %self.instance_id, socket = %self.home.socket().display(), http = ?http_addr, tls = http_tls, "daemon serving");
        claimed.kept = true;
        Ok(Running {
            base: self,
            pipeline,
            claimed,
            tasks,
            http_addr,
            http_tls,
        })
    }
}

/// A daemon's claim on its home: the socket, the admin secret, and the token its hosts stop on.
/// A stop releases it; so does dropping it unless kept (the daemon serves), so a start that
/// failed after the claim (an HTTP port in use, a certificate that does not load) leaves
/// neither file.
struct Claimed {
    home: Home,
    stop: CancellationToken,
    kept: bool,
}

impl Claimed {
    /// Stops the hosts and removes the socket and the admin secret.
    fn release(&self) {
        self.stop.cancel();
        let _ = std::fs::remove_file(self.home.admin_token());
        let _ = std::fs::remove_file(self.home.socket());
    }
}

impl Drop for Claimed {
    fn drop(&mut self) {
        if !self.kept {
            self.release();
        }
    }
}

/// An id for a fresh instance (a UUID v4 in text).
fn uuid_like() -> String {
    simlock_contract::ids::WorkerId::mint().to_string()
}

/// A daemon that serves.
pub struct Running {
    /// Its parts.
    pub base: Base,
    /// Its pipeline.
    pub pipeline: Arc<Pipeline>,
    claimed: Claimed,
    tasks: Vec<JoinHandle<()>>,
    http_addr: Option<SocketAddr>,
    http_tls: bool,
}

impl std::fmt::Debug for Running {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Running")
            .field("base", &self.base)
            .field("http", &self.http_addr)
            .finish_non_exhaustive()
    }
}

impl Running {
    /// The HTTP address, when HTTP is served.
    pub const fn http_addr(&self) -> Option<SocketAddr> {
        self.http_addr
    }

    /// Whether the HTTP listener speaks TLS (`http.tls.*`).
    pub const fn http_tls(&self) -> bool {
        self.http_tls
    }

    /// The unix socket.
    pub fn socket_path(&self) -> PathBuf {
        self.base.home.socket()
    }

    /// Fires when the hosts stop.
    pub fn stop_token(&self) -> CancellationToken {
        self.claimed.stop.clone()
    }

    /// Records `daemon.started` and opens the start-up gate.
    pub fn started(&self) {
        self.base.gate.open();
        self.base.bus.emit(
            EventModule::Daemon,
            &Event::DaemonStarted {
                version: self.base.version.clone(),
                mode: self.base.mode,
            },
        );
    }

    /// Resolves when a stop was requested (`daemon.stop`).
    pub async fn stop_requested(&self) {
        self.base.shutdown.requested().await;
    }

    /// Stops: new calls answer `DAEMON_STOPPING`, the hosts close, the admin secret goes.
    pub async fn stop(self, reason: &str) {
        info!(reason, "daemon stopping");
        self.base.bus.emit(
            EventModule::Daemon,
            &Event::DaemonStopping {
                reason: reason.to_owned(),
            },
        );
        self.pipeline.begin_stopping();
        self.claimed.stop.cancel();
        for task in self.tasks {
            if tokio::time::timeout(STOP_GRACE, task).await.is_err() {
                warn!("a host did not stop within the grace period");
            }
        }
        self.claimed.release();
    }
}
