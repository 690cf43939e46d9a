//! The unix socket host: one wire session per connection.

use std::os::fd::AsFd as _;
use std::os::unix::fs::PermissionsExt as _;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use simlock_wire::{Origin, Transport, serve};
use tokio::net::{UnixListener, UnixStream};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use tracing::info;

use crate::home::MAX_SOCKET_PATH;
use crate::pipeline::Pipeline;

/// Why the socket could not be claimed.
#[derive(Debug, thiserror::Error)]
pub enum SocketError {
    /// Another daemon answers on it.
    #[error("another simlock daemon is already running on {0}")]
    InUse(PathBuf),
    /// The path does not fit a unix socket address.
    #[error("socket path {0} is longer than {MAX_SOCKET_PATH} bytes; use a shorter SIMLOCK_HOME")]
    TooLong(PathBuf),
    /// Binding failed.
    #[error("cannot listen on {path}: {source}")]
    Bind {
        /// The path.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
}

/// Claims the socket at `path`: refuses when a live daemon answers there, removes a stale file
/// otherwise, and listens (mode 0600).
///
/// # Errors
/// [`SocketError`].
pub async fn claim(path: &Path) -> Result<UnixListener, SocketError> {
    if path.as_os_str().len() > MAX_SOCKET_PATH {
        return Err(SocketError::TooLong(path.to_owned()));
    }
    if path.exists() {
        if UnixStream::connect(path).await.is_ok() {
            return Err(SocketError::InUse(path.to_owned()));
        }
        let _ = std::fs::remove_file(path);
    }
    let listener = UnixListener::bind(path).map_err(|source| SocketError::Bind {
        path: path.to_owned(),
        source,
    })?;
    let _ = std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600));
    Ok(listener)
}

/// Serves wire sessions on `listener` until `shutdown` fires, then closes the sessions still
/// open, as the process's exit would: their clients see the connection end (a lease hold then
/// connects again to the next daemon on this home) instead of a stopped daemon answering
/// `DAEMON_STOPPING` for as long as they stay.
pub fn serve_socket(
    listener: UnixListener,
    pipeline: Arc<Pipeline>,
    shutdown: CancellationToken,
) -> JoinHandle<()> {
    tokio::spawn(async move {
        info!("listening on the unix socket");
        let mut sessions = tokio::task::JoinSet::new();
        let mut failures = crate::accept::AcceptFailures::default();
        loop {
            let accepted = tokio::select! {
                () = shutdown.cancelled() => break,
                Some(_) = sessions.join_next() => continue,
                accepted = listener.accept() => accepted,
            };
            match accepted {
                Ok((stream, _)) => {
                    // A second handle on the socket, to shut it down at the stop. Out of
                    // descriptors, it fails as an accept does: the connection is closed, and the
                    // listener backs off and sums it up as for a failed accept.
                    let shutter = match stream.as_fd().try_clone_to_owned() {
                        Ok(fd) => std::os::unix::net::UnixStream::from(fd),
                        Err(e) => {
                            drop(stream);
                            tokio::select! {
                                () = shutdown.cancelled() => break,
                                () = crate::accept::after_failure(&mut failures, "socket", &e) => {}
                            }
                            continue;
                        }
                    };
                    crate::accept::after_success(&mut failures, "socket");
                    let (r, w) = stream.into_split();
                    let pipeline = pipeline.clone();
                    let config = pipeline.session_config();
                    let stop = shutdown.clone();
                    sessions.spawn(async move {
                        let session =
                            serve(Transport::server_io(r, w), Origin::Socket, pipeline, config);
                        tokio::pin!(session);
                        tokio::select! {
                            () = &mut session => return,
                            () = stop.cancelled() => {}
                        }
                        close_at_stop(session, &shutter, SESSION_CLOSE).await;
                    });
                }
                Err(e) => {
                    tokio::select! {
                        () = shutdown.cancelled() => break,
                        () = crate::accept::after_failure(&mut failures, "socket", &e) => {}
                    }
                }
            }
        }
        // Each session closes its connection itself within SESSION_CLOSE; this bound is longer,
        // so none is aborted before it has (the abort would leave its socket to the writer).
        let _ = tokio::time::timeout(2 * SESSION_CLOSE, async {
            while sessions.join_next().await.is_some() {}
        })
        .await;
        sessions.shutdown().await;
    })
}

/// How long a session whose socket the stop shut down may take to answer its calls in flight.
const SESSION_CLOSE: std::time::Duration = std::time::Duration::from_secs(1);

/// Ends a socket session at the stop: nothing more its client sends is read (the session reads
/// the end and ends), the calls in flight still answer (`daemon.stop`'s own reply among them: a
/// connection shut both ways at once lost it whenever the stop won the race), and the connection
/// closes once they have, or at `bound`. `shutter` is a second handle on the session's socket.
/// The writing is shut on its own at the end (shutting both ways a socket whose reading is shut
/// fails on macOS, and would leave the connection open).
async fn close_at_stop(
    session: impl Future<Output = ()>,
    shutter: &std::os::unix::net::UnixStream,
    bound: std::time::Duration,
) {
    let _ = shutter.shutdown(std::net::Shutdown::Read);
    let _ = tokio::time::timeout(bound, session).await;
    let _ = shutter.shutdown(std::net::Shutdown::Write);
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, reason = "tests")]

    use std::time::Duration;

    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};

    use super::*;

    /// A connected pair: the daemon's end, a second handle on it, the client's end.
    fn connection() -> (UnixStream, std::os::unix::net::UnixStream, UnixStream) {
        let (daemon, client) = UnixStream::pair().unwrap();
        let shutter =
            std::os::unix::net::UnixStream::from(daemon.as_fd().try_clone_to_owned().unwrap());
        (daemon, shutter, client)
    }

    #[tokio::test]
    async fn a_call_in_flight_at_the_stop_still_answers_then_the_connection_ends() {
        let (daemon, shutter, mut client) = connection();
        let (mut reading, mut writing) = daemon.into_split();
        let (answer, answered) = tokio::sync::oneshot::channel::<()>();
        let session = async move {
            let mut buf = [0u8; 16];
            assert_eq!(reading.read(&mut buf).await.unwrap(), 0, "the end is read");
            answered.await.unwrap();
            writing.write_all(b"the reply\n").await.unwrap();
        };
        let closing = close_at_stop(session, &shutter, Duration::from_secs(3600));
        tokio::pin!(closing);
        assert!(futures::poll!(&mut closing).is_pending());
        // Nothing more the client sends is read (Linux refuses the write; macOS drops it).
        #[cfg(target_os = "linux")]
        assert!(client.write_all(b"another call\n").await.is_err());
        // The call in flight answers after the stop began, and its reply arrives, then the end.
        answer.send(()).unwrap();
        closing.await;
        let mut got = String::new();
        client.read_to_string(&mut got).await.unwrap();
        assert_eq!(got, "the reply\n");
    }

    #[tokio::test(start_paused = true)]
    async fn a_session_that_does_not_end_is_closed_at_the_bound() {
        let (_daemon, shutter, mut client) = connection();
        let started = tokio::time::Instant::now();
        close_at_stop(std::future::pending::<()>(), &shutter, SESSION_CLOSE).await;
        assert_eq!(started.elapsed(), SESSION_CLOSE);
        let mut got = Vec::new();
        client.read_to_end(&mut got).await.unwrap();
        assert!(got.is_empty(), "the client reads the end");
    }
}
