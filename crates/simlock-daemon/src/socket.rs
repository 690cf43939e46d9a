//! The unix socket host: one wire session per connection.

use std::os::fd::AsFd as _;
use std::os::unix::fs::PermissionsExt as _;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use simlock_wire::{Origin, Transport, serve};
use tokio::net::{UnixListener, UnixStream};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};

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
        loop {
            let accepted = tokio::select! {
                () = shutdown.cancelled() => break,
                Some(_) = sessions.join_next() => continue,
                accepted = listener.accept() => accepted,
            };
            match accepted {
                Ok((stream, _)) => {
                    // A second handle on the socket, to shut it down at the stop.
                    let shutter = match stream.as_fd().try_clone_to_owned() {
                        Ok(fd) => std::os::unix::net::UnixStream::from(fd),
                        Err(e) => {
                            warn!(error = %e, "a socket connection could not be kept; closed");
                            continue;
                        }
                    };
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
                        // The client reads the end of the connection; the session ends as its
                        // calls in flight answer, within the bound.
                        let _ = shutter.shutdown(std::net::Shutdown::Both);
                        let _ = tokio::time::timeout(SESSION_CLOSE, session).await;
                    });
                }
                Err(e) => {
                    warn!(error = %e, "socket accept failed");
                    debug!("backing off accept for 50 ms");
                    tokio::time::sleep(std::time::Duration::from_millis(50)).await;
                }
            }
        }
        let _ = tokio::time::timeout(SESSION_CLOSE, async {
            while sessions.join_next().await.is_some() {}
        })
        .await;
        sessions.shutdown().await;
    })
}

/// How long a session whose socket the stop shut down may take to answer its calls in flight.
const SESSION_CLOSE: std::time::Duration = std::time::Duration::from_secs(1);
