//! TLS for simlock's hops, on rustls with the ring provider (ADR 0024).
//!
//! - [`ServerTls`]: what a daemon's HTTP host serves with. Its certificate and key are PEM files;
//!   every new connection's handshake reads them again, and a changed pair that parses and
//!   matches is served from then on (rotation needs no restart). A pair that does not load keeps
//!   the previous certificate in service and is logged once. A certificate clients will refuse
//!   is warned about, not refused: a CA certificate (basicConstraints CA:TRUE) when it is
//!   loaded, and one expired, not valid yet, or expiring within 7 days when it is loaded and
//!   whenever that changes while it is served.
//! - [`client_config`]: what the worker's uplink and the HTTP client trust: the platform's roots
//!   (read once per process, `rustls-native-certs`) plus the certificates of an optional CA file.
//! - [`classify`]: a failed handshake read as a [`TlsFailure`] that names its cause in words
//!   (dates in UTC, names as the certificate spells them), so that each caller can say which
//!   setting to change.
//!
//! Nothing here knows the configuration: callers name their files with a [`PemFile`], which
//! carries the key (or flag) that named the file, for the messages.

use std::io;
use std::path::PathBuf;
use std::sync::{Arc, OnceLock};
use std::time::SystemTime;

use parking_lot::Mutex;
use rustls::RootCertStore;
use rustls::client::ClientConfig;
use rustls::crypto::CryptoProvider;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::server::{ClientHello, ResolvesServerCert, ServerConfig};
use rustls::sign::CertifiedKey;
use time::format_description::well_known::Rfc3339;
use tracing::{info, warn};

pub use rustls::client::{ClientConfig as TlsClientConfig, Resumption};
pub use rustls::pki_types::ServerName;
pub use tokio_rustls::{TlsAcceptor, TlsConnector};

/// A TLS stream a server accepted over TCP.
pub type ServerStream = tokio_rustls::server::TlsStream<tokio::net::TcpStream>;
/// A TLS stream a client opened over TCP.
pub type ClientStream = tokio_rustls::client::TlsStream<tokio::net::TcpStream>;

/// The first byte of every TLS record that opens a connection (a handshake record). A server
/// that peeks anything else was sent plain text (`http://` or `ws://` to a TLS port).
pub const HANDSHAKE_RECORD: u8 = 0x16;

/// A PEM file and the setting that named it (`http.tls.certFile`, `--ca-file`, …).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PemFile {
    /// The file.
    pub path: PathBuf,
    /// The configuration key or flag that named it, for messages.
    pub key: &'static str,
}

impl PemFile {
    /// `path`, named by `key`.
    pub fn new(path: impl Into<PathBuf>, key: &'static str) -> Self {
        Self {
            path: path.into(),
            key,
        }
    }

    fn read(&self) -> Result<Vec<u8>, TlsError> {
        std::fs::read(&self.path).map_err(|source| TlsError::Read {
            key: self.key,
            path: self.path.clone(),
            source,
        })
    }

    fn invalid(&self, why: impl std::fmt::Display) -> TlsError {
        TlsError::Invalid {
            key: self.key,
            path: self.path.clone(),
            why: why.to_string(),
        }
    }
}

/// Why TLS material could not be loaded. Every message names the setting and the file.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    /// The file could not be read.
    #[error("{key}: cannot read {}: {source}", path.display())]
    Read {
        /// The setting.
        key: &'static str,
        /// The file.
        path: PathBuf,
        /// Why.
        source: io::Error,
    },
    /// The file does not hold what the setting needs.
    #[error("{key}: {}: {why}", path.display())]
    Invalid {
        /// The setting.
        key: &'static str,
        /// The file.
        path: PathBuf,
        /// What is wrong.
        why: String,
    },
    /// The key is not the certificate's.
    #[error("{key_key} ({}) is not the key of the certificate in {cert_key} ({})", key_path.display(), cert_path.display())]
    Mismatch {
        /// The certificate's setting.
        cert_key: &'static str,
        /// The certificate file.
        cert_path: PathBuf,
        /// The key's setting.
        key_key: &'static str,
        /// The key file.
        key_path: PathBuf,
    },
    /// rustls refused the configuration (no protocol version in common with the provider).
    #[error("TLS configuration: {0}")]
    Config(String),
}

/// The one crypto provider every simlock TLS configuration uses.
pub fn provider() -> Arc<CryptoProvider> {
    static PROVIDER: OnceLock<Arc<CryptoProvider>> = OnceLock::new();
    PROVIDER
        .get_or_init(|| Arc::new(rustls::crypto::ring::default_provider()))
        .clone()
}

/// Reads the certificates of a PEM file (at least one).
///
/// # Errors
/// [`TlsError`] naming the file's setting.
pub fn read_certificates(file: &PemFile) -> Result<Vec<CertificateDer<'static>>, TlsError> {
    parse_certificates(file, &file.read()?)
}

fn parse_certificates(
    file: &PemFile,
    bytes: &[u8],
) -> Result<Vec<CertificateDer<'static>>, TlsError> {
    let certificates = CertificateDer::pem_slice_iter(bytes)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| file.invalid(format!("not PEM certificates: {e}")))?;
    if certificates.is_empty() {
        return Err(file.invalid("holds no PEM certificate (-----BEGIN CERTIFICATE-----)"));
    }
    Ok(certificates)
}

/// A certificate chain and its key, parsed and checked to belong together.
fn certified_key(
    cert: &PemFile,
    cert_bytes: &[u8],
    key: &PemFile,
    key_bytes: &[u8],
) -> Result<Arc<CertifiedKey>, TlsError> {
    let chain = parse_certificates(cert, cert_bytes)?;
    let private = PrivateKeyDer::from_pem_slice(key_bytes)
        .map_err(|e| key.invalid(format!("no PEM private key: {e}")))?;
    let signing = provider()
        .key_provider
        .load_private_key(private)
        .map_err(|e| key.invalid(e))?;
    let certified = CertifiedKey::new(chain, signing);
    certified.keys_match().map_err(|error| match error {
        rustls::Error::InconsistentKeys(_) => TlsError::Mismatch {
            cert_key: cert.key,
            cert_path: cert.path.clone(),
            key_key: key.key,
            key_path: key.path.clone(),
        },
        other => cert.invalid(other),
    })?;
    Ok(Arc::new(certified))
}

/// What a server serves: a certificate and key read from PEM files, read again at every new
/// connection so that a replaced pair is served without a restart.
#[derive(Debug, Clone)]
pub struct ServerTls {
    config: Arc<ServerConfig>,
    resolver: Arc<ReloadingResolver>,
}

impl ServerTls {
    /// Loads `cert` (the chain, leaf first) and `key`; both must load now. A certificate that
    /// loads but that clients will refuse (a CA certificate, or one out of its validity) is
    /// served all the same, and warned about (`served`).
    ///
    /// # Errors
    /// [`TlsError`] naming the setting of the file that does not load.
    pub fn load(cert: PemFile, key: PemFile) -> Result<Self, TlsError> {
        Self::load_with_clock(cert, key, SystemTime::now)
    }

    /// [`ServerTls::load`], checking the certificate's validity against `now` instead of the
    /// system clock (for tests).
    ///
    /// # Errors
    /// [`TlsError`] naming the setting of the file that does not load.
    pub(crate) fn load_with_clock(
        cert: PemFile,
        key: PemFile,
        now: impl Fn() -> SystemTime + Send + Sync + 'static,
    ) -> Result<Self, TlsError> {
        let cert_bytes = cert.read()?;
        let key_bytes = key.read()?;
        let certified = certified_key(&cert, &cert_bytes, &key, &key_bytes)?;
        let clock = Clock::new(now);
        let served = Served::new(&cert, cert_bytes, key_bytes, certified, clock.unix_now());
        let resolver = Arc::new(ReloadingResolver {
            cert,
            key,
            clock,
            state: Mutex::new(served),
        });
        let mut config = ServerConfig::builder_with_provider(provider())
            .with_safe_default_protocol_versions()
            .map_err(|e| TlsError::Config(e.to_string()))?
            .with_no_client_auth()
            .with_cert_resolver(resolver.clone());
        // The hosts speak HTTP/1.1 only (and WebSocket upgrades over it).
        config.alpn_protocols = vec![b"http/1.1".to_vec()];
        Ok(Self {
            config: Arc::new(config),
            resolver,
        })
    }

    /// The acceptor for new connections.
    pub fn acceptor(&self) -> TlsAcceptor {
        TlsAcceptor::from(self.config.clone())
    }

    /// The rustls configuration.
    pub fn config(&self) -> Arc<ServerConfig> {
        self.config.clone()
    }

    /// The leaf certificate new connections are served now (after reading the files again).
    pub fn current_certificate(&self) -> CertificateDer<'static> {
        let certified = self.resolver.refresh();
        certified
            .cert
            .first()
            .cloned()
            .unwrap_or_else(|| CertificateDer::from(Vec::new()))
    }
}

/// The pair in service, and the bytes of a replacement that did not load (logged once).
#[derive(Debug)]
struct Served {
    cert_bytes: Vec<u8>,
    key_bytes: Vec<u8>,
    certified: Arc<CertifiedKey>,
    refused: Option<(Vec<u8>, Vec<u8>)>,
    /// Why the files could not be read last time, so it is logged once, not per handshake.
    unreadable: Option<String>,
    /// The leaf's validity, when it could be read.
    validity: Option<Validity>,
    /// How the leaf stood against the clock when last looked at, so that each change is logged
    /// once.
    standing: Standing,
}

impl Served {
    /// A pair that loaded, now in service at `now`: a CA certificate, or one that stands out of
    /// its validity at `now`, is warned about here; [`ReloadingResolver::watch`] warns of each
    /// change after.
    fn new(
        cert: &PemFile,
        cert_bytes: Vec<u8>,
        key_bytes: Vec<u8>,
        certified: Arc<CertifiedKey>,
        now: i64,
    ) -> Self {
        let inspected = match certified.cert.first().map(|leaf| served::inspect(leaf)) {
            Some(Ok(inspected)) => Some(inspected),
            Some(Err(why)) => {
                info!(cert = %cert.path.display(), %why, "the TLS certificate's validity cannot be read; it is not watched");
                None
            }
            None => None,
        };
        if inspected.is_some_and(|i| i.ca) {
            warn!("{}", served::ca_warning(cert));
        }
        let validity = inspected.map(|i| i.validity);
        if let Some(warning) = validity.and_then(|v| v.warning(cert, now)) {
            warn!("{warning}");
        }
        Self {
            cert_bytes,
            key_bytes,
            certified,
            refused: None,
            unreadable: None,
            validity,
            standing: validity.map_or(Standing::Valid, |v| v.standing(now)),
        }
    }
}

#[derive(Debug)]
struct ReloadingResolver {
    cert: PemFile,
    key: PemFile,
    clock: Clock,
    state: Mutex<Served>,
}

impl ReloadingResolver {
    /// Reads both files; a changed pair that loads replaces the one in service. Then the one in
    /// service is checked against the clock.
    fn refresh(&self) -> Arc<CertifiedKey> {
        let read = self.cert.read().and_then(|c| Ok((c, self.key.read()?)));
        let mut state = self.state.lock();
        self.reload(&mut state, read);
        self.watch(&mut state);
        state.certified.clone()
    }

    fn reload(&self, state: &mut Served, read: Result<(Vec<u8>, Vec<u8>), TlsError>) {
        let (cert_bytes, key_bytes) = match read {
            Ok(pair) => pair,
            Err(error) => {
                // A file being replaced can be missing for a moment: keep serving.
                let why = error.to_string();
                if state.unreadable.as_deref() != Some(why.as_str()) {
                    warn!(%error, "TLS certificate not re-read; the one in service stays");
                    state.unreadable = Some(why);
                }
                return;
            }
        };
        state.unreadable = None;
        if cert_bytes == state.cert_bytes && key_bytes == state.key_bytes {
            return;
        }
        let seen = state
            .refused
            .as_ref()
            .is_some_and(|(c, k)| *c == cert_bytes && *k == key_bytes);
        if seen {
            return;
        }
        match certified_key(&self.cert, &cert_bytes, &self.key, &key_bytes) {
            Ok(certified) => {
                info!(cert = %self.cert.path.display(), "TLS certificate reloaded");
                let now = self.clock.unix_now();
                *state = Served::new(&self.cert, cert_bytes, key_bytes, certified, now);
            }
            Err(error) => {
                // Half of a rotation (a new certificate before its key) lands here too.
                warn!(%error, "TLS certificate changed but does not load; the one in service stays");
                state.refused = Some((cert_bytes, key_bytes));
            }
        }
    }

    /// Warns once each time the certificate in service comes to stand differently against the
    /// clock: expired, not valid yet, or expiring within [`served::EXPIRY_NOTICE_SECS`].
    fn watch(&self, state: &mut Served) {
        let Some(validity) = state.validity else {
            return;
        };
        let now = self.clock.unix_now();
        let standing = validity.standing(now);
        if standing == state.standing {
            return;
        }
        state.standing = standing;
        if let Some(warning) = validity.warning(&self.cert, now) {
            warn!("{warning}");
        }
    }
}

impl ResolvesServerCert for ReloadingResolver {
    fn resolve(&self, _hello: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        Some(self.refresh())
    }
}

/// The platform's trusted roots, read once per process. Certificates the platform store holds
/// but rustls cannot read are skipped (and logged once).
fn platform_roots() -> Arc<Vec<CertificateDer<'static>>> {
    static ROOTS: OnceLock<Arc<Vec<CertificateDer<'static>>>> = OnceLock::new();
    ROOTS
        .get_or_init(|| {
            let found = rustls_native_certs::load_native_certs();
            for error in &found.errors {
                warn!(%error, "a platform root certificate could not be read");
            }
            Arc::new(found.certs)
        })
        .clone()
}

/// A client configuration trusting the platform's roots plus every certificate in `ca_file`.
///
/// # Errors
/// [`TlsError`] when the CA file cannot be read or holds no certificate rustls accepts as a
/// root.
pub fn client_config(ca_file: Option<&PemFile>) -> Result<Arc<ClientConfig>, TlsError> {
    let mut roots = RootCertStore::empty();
    let (_, _) = roots.add_parsable_certificates(platform_roots().iter().cloned());
    if let Some(file) = ca_file {
        for certificate in read_certificates(file)? {
            roots
                .add(certificate)
                .map_err(|e| file.invalid(format!("not a CA certificate rustls accepts: {e}")))?;
        }
    }
    let config = ClientConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .map_err(|e| TlsError::Config(e.to_string()))?
        .with_root_certificates(roots)
        .with_no_client_auth();
    Ok(Arc::new(config))
}

/// The name a client checks the server's certificate against: the URL's host (an IP address
/// checks against the certificate's IP addresses).
///
/// # Errors
/// A description when `host` is neither a DNS name nor an IP address.
pub fn server_name(host: &str) -> Result<ServerName<'static>, String> {
    // A URL writes an IPv6 address in brackets.
    let bare = host
        .strip_prefix('[')
        .and_then(|h| h.strip_suffix(']'))
        .unwrap_or(host);
    ServerName::try_from(bare.to_owned()).map_err(|e| format!("{host:?} is not a host name: {e}"))
}

/// `secs` after the UNIX epoch as an RFC 3339 date in UTC (`2020-02-01T00:00:00Z`), the form
/// every message here writes a date in.
pub(crate) fn utc(secs: i64) -> String {
    time::OffsetDateTime::from_unix_timestamp(secs)
        .ok()
        .and_then(|date| date.format(&Rfc3339).ok())
        .unwrap_or_else(|| format!("{secs} s after 1970-01-01T00:00:00Z"))
}

#[cfg(any(test, feature = "test-util"))]
pub mod testing;

mod failure;
pub use failure::{LEAF_REMEDY, TlsFailure, classify, find_failure};

mod served;
use served::{Clock, Standing, Validity};

#[cfg(test)]
mod tests;
