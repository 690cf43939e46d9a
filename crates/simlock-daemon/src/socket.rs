//! The unix socket host: one wire session per connection.

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

/// Serves wire sessions on `listener` until `shutdown` fires.
pub fn serve_socket(
    listener: UnixListener,
    pipeline: Arc<Pipeline>,
    shutdown: CancellationToken,
) -> JoinHandle<()> {
    tokio::spawn(async move {
        info!("listening on the unix socket");
        loop {
            let accepted = tokio::select! {
                () = shutdown.cancelled() => break,
                accepted = listener.accept() => accepted,
            };
            match accepted {
                Ok((stream, _)) => {
                    let (r, w) = stream.into_split();
                    let pipeline = pipeline.clone();
                    let config = pipeline.session_config();
                    tokio::spawn(async move {
                        serve(Transport::server_io(r, w), Origin::Socket, pipeline, config).await;
                    });
                }
                Err(e) => {
                    warn!(error = %e, "socket accept failed");
                    debug!("backing off accept for 50 ms");
                    tokio::time::sleep(std::time::Duration::from_millis(50)).await;
                }
            }
        }
    })
}
