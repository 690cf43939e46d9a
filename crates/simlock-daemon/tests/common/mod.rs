//! What the HTTP and launch tests share: an HTTP host over a real loopback listener, a greeter
//! that grants no admin, and a log writer to read what a subscriber wrote.

#![allow(
    dead_code,
    unreachable_pub,
    clippy::unwrap_used,
    reason = "shared by several test binaries, each using part; tests fail by panicking"
)]

use std::io::Write;
use std::sync::Arc;

use parking_lot::Mutex;
use simlock_contract::model::Mode;
use simlock_daemon::clock::TokioClock;
use simlock_daemon::events::EventBus;
use simlock_daemon::http::requests::RequestBook;
use simlock_daemon::http::{HttpApp, bind, serve_http};
use simlock_daemon::metrics::Metrics;
use simlock_daemon::pipeline::{Greeter, Pipeline, Router, Shutdown, StartupGate};
use simlock_daemon::presence::Presence;
use simlock_daemon::store::Database;
use simlock_daemon::tokens::{self, TokenStore};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

/// The socket's greeter of a daemon with no admin secret.
pub struct NoAdmin;

impl Greeter for NoAdmin {
    fn is_admin_secret(&self, _: &str) -> bool {
        false
    }

    fn default_principal(&self) -> String {
        "local".into()
    }
}

/// A daemon's HTTP host with the token and event operations, serving on loopback.
pub struct Host {
    /// Where it listens.
    pub addr: String,
    /// Its tokens.
    pub tokens: Arc<TokenStore>,
    /// Stops it.
    pub stop: CancellationToken,
    /// Ends once it stopped serving.
    pub served: JoinHandle<()>,
}

/// A host as a daemon in `mode` serves it.
pub async fn host_in(mode: Mode) -> Host {
    let clock = TokioClock::system().shared();
    let store = TokenStore::open(Database::open_in_memory().unwrap(), clock.clone()).unwrap();
    let bus = EventBus::new(10, clock.clone());
    let mut router = Router::new();
    tokens::register(&mut router, &store, mode);
    simlock_daemon::events::register(&mut router, &bus);
    // A daemon that holds no lease.
    router.handle::<simlock_contract::ops::LeaseGet, _, _>(|_, input| async move {
        Err(simlock_contract::ContractError::unknown_lease(
            &input.lease_id,
        ))
    });
    let pipeline = Arc::new(Pipeline::new(
        router,
        StartupGate::ready(),
        Shutdown::new(),
        "test".into(),
        Arc::new(NoAdmin),
        Presence::new(),
    ));
    let app = Arc::new(HttpApp {
        pipeline,
        tokens: store.clone(),
        bus,
        clock: clock.clone(),
        requests: RequestBook::new(clock, 1000, 10),
        metrics: Metrics::new(),
        responses: simlock_daemon::http::responses::HttpResponses::default(),
        mounts: Vec::new(),
    });
    let listener = bind("127.0.0.1", 0).await.unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    let stop = CancellationToken::new();
    let served = serve_http(listener, app, None, stop.clone());
    Host {
        addr,
        tokens: store,
        stop,
        served,
    }
}

/// Collects what a subscriber writes.
#[derive(Clone, Default)]
pub struct Captured(pub Arc<Mutex<Vec<u8>>>);

impl Write for Captured {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().extend_from_slice(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}
