//! The daemon's home directory (`$SIMLOCK_HOME`, default `~/.simlock`) and what lives in it:
//! `daemon.sock`, `state.db`, `config.toml`, `admin.token`.

use std::io::Write as _;
use std::os::unix::fs::{OpenOptionsExt as _, PermissionsExt as _};
use std::path::{Path, PathBuf};

use crate::tokens::{hash_secret, mint_secret};

/// The longest unix socket path (Linux `sun_path` is 108 bytes with its NUL).
pub const MAX_SOCKET_PATH: usize = 107;

/// A daemon's home.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Home {
    root: PathBuf,
}

impl Home {
    /// `$SIMLOCK_HOME` if set, else `~/.simlock`.
    pub fn from_env() -> Self {
        let root = std::env::var_os("SIMLOCK_HOME")
            .map(PathBuf::from)
            .unwrap_or_else(|| {
                std::env::var_os("HOME").map_or_else(
                    || PathBuf::from(".simlock"),
                    |h| PathBuf::from(h).join(".simlock"),
                )
            });
        Self::at(root)
    }

    /// A home at `root`, made absolute from the current directory: what a daemon prints and
    /// logs (its socket in the ready line, say) names the same place wherever it is read.
    pub fn at(root: impl Into<PathBuf>) -> Self {
        let root = root.into();
        let root = std::path::absolute(&root).unwrap_or(root);
        Self { root }
    }

    /// Creates the directory, readable by its owner only.
    ///
    /// # Errors
    /// When it cannot be created.
    pub fn ensure(&self) -> std::io::Result<()> {
        std::fs::create_dir_all(&self.root)?;
        std::fs::set_permissions(&self.root, std::fs::Permissions::from_mode(0o700))
    }

    /// The directory.
    pub fn root(&self) -> &Path {
        &self.root
    }

    /// A file a setting names: an absolute path as it is, a relative one from the home.
    pub fn resolve(&self, path: &str) -> PathBuf {
        self.root.join(path)
    }

    /// The unix socket.
    pub fn socket(&self) -> PathBuf {
        self.root.join("daemon.sock")
    }

    /// The state database.
    pub fn database(&self) -> PathBuf {
        self.root.join("state.db")
    }

    /// The per-start admin secret.
    pub fn admin_token(&self) -> PathBuf {
        self.root.join("admin.token")
    }
}

/// The per-start admin secret: written to `admin.token` (mode 0600) so the owner's CLI can act
/// as admin on the socket; only its hash is kept in memory; removed on a graceful stop (by the
/// daemon's claim on its home).
#[derive(Debug)]
pub struct AdminSecret {
    hash: String,
}

impl AdminSecret {
    /// Mints the secret and writes it.
    ///
    /// # Errors
    /// When the file cannot be written.
    pub fn create(home: &Home) -> std::io::Result<Self> {
        let secret = mint_secret();
        let path = home.admin_token();
        let _ = std::fs::remove_file(&path);
        let mut file = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(&path)?;
        file.write_all(secret.as_bytes())?;
        file.sync_all()?;
        Ok(Self {
            hash: hash_secret(&secret),
        })
    }

    /// Whether `secret` is this secret.
    pub fn matches(&self, secret: &str) -> bool {
        hash_secret(secret) == self.hash
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_relative_home_is_made_absolute_from_the_current_directory() {
        let home = Home::at("some/home");
        let here = std::env::current_dir().unwrap();
        assert_eq!(home.root(), here.join("some/home"));
        assert_eq!(home.socket(), here.join("some/home/daemon.sock"));
        assert_eq!(Home::at("/abs/home").root(), Path::new("/abs/home"));
    }
}
