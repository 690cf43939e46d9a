//! The client against the in-test daemon, over a real unix socket, real HTTP and an in-memory pipe.

mod abort;
mod connection;
mod hold;
mod http;
mod socket;

use std::time::Duration;

use crate::{Client, ConnectOptions};
use simlock_test_support::fake_daemon::{Cut, FakeDaemon};

/// A hang guard: a test that waits longer than this has failed.
const GUARD: Duration = Duration::from_secs(20);

/// Fails the test if `future` hangs.
async fn guard<F: Future>(future: F) -> F::Output {
    tokio::time::timeout(GUARD, future)
        .await
        .expect("the test hung")
}

/// A hang guard for paused-time tests, whose waits are virtual and may be long.
async fn guard_paused<F: Future>(future: F) -> F::Output {
    tokio::time::timeout(Duration::from_secs(24 * 3600), future)
        .await
        .expect("the test hung")
}

/// A fake serving its socket.
async fn socket_fake() -> FakeDaemon {
    FakeDaemon::new().unwrap().with_socket().await.unwrap()
}

/// A fake serving HTTP.
async fn http_fake() -> FakeDaemon {
    FakeDaemon::new().unwrap().with_http().await.unwrap()
}

/// A client on the fake's socket as `agent-1`, admin when asked.
async fn socket_client(fake: &FakeDaemon, admin: bool) -> Client {
    let mut options = ConnectOptions::default().principal("agent-1");
    if admin {
        options.credential = Some(fake.admin_secret().to_owned());
    }
    guard(Client::connect_socket(fake.socket_path().unwrap(), options))
        .await
        .unwrap()
}

/// A client over an in-memory pipe as `agent-1`, and the pipe's cut.
async fn pipe_client(fake: &FakeDaemon) -> (Client, Cut) {
    let (transport, cut) = fake.pipe();
    let client = Client::over_transport(transport, ConnectOptions::default().principal("agent-1"))
        .await
        .unwrap();
    (client, cut)
}

/// An HTTP client with `token`.
fn http_client(fake: &FakeDaemon, token: &str) -> Client {
    Client::over_http(&fake.url().unwrap(), token, ConnectOptions::default()).unwrap()
}
