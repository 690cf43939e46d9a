//! A failed client handshake read by cause ([`TlsFailure`]), in words for people: dates in UTC
//! (RFC 3339), names as the certificate spells them, and no Rust debug text.

use std::io;

use rustls::{AlertDescription, CertificateError};

use crate::utc;

/// What a server whose certificate is a CA certificate must do instead (the remedy every
/// message about one names).
pub const LEAF_REMEDY: &str = "serve a leaf certificate signed by that CA, or make the \
    self-signed one with basicConstraints=critical,CA:FALSE (docs/CONFIGURATION.md, TLS)";

/// What a CA certificate served as a server's own is, in every message about one.
pub(crate) const CA_CERTIFICATE: &str =
    "the certificate is a CA certificate (basicConstraints CA:TRUE)";

/// The longest certificate name a message repeats (a DNS name is at most 253 bytes).
const MAX_NAME: usize = 253;

/// Why a TLS handshake failed, by cause.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TlsFailure {
    /// The peer's certificate chains to no root the client trusts.
    Untrusted,
    /// The certificate does not cover the host the client dialled.
    NameMismatch {
        /// The host dialled.
        host: String,
        /// The names the certificate covers (DNS names and IP addresses as text), when rustls
        /// reports them.
        presented: Vec<String>,
    },
    /// The certificate has expired or is not valid yet: what the certificate did, with its
    /// dates and the client's time in UTC ("expired at 2020-02-01T00:00:00Z (the time here is
    /// …)").
    Expired(String),
    /// The server presents a CA certificate (basicConstraints CA:TRUE) as its own, as a
    /// self-signed certificate made with openssl's defaults is. It fails whether or not the
    /// client trusts it: a CA certificate is never accepted as a server's own.
    CaAsLeaf,
    /// The peer answered something that is not TLS (a plain HTTP server on that port).
    NotTls,
    /// Anything else, described in words (the rustls error, or the I/O error in the
    /// handshake).
    Other(String),
}

impl std::fmt::Display for TlsFailure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Untrusted => write!(f, "the certificate is not signed by a trusted CA"),
            Self::NameMismatch { host, presented } if presented.is_empty() => {
                write!(f, "the certificate is not valid for {host}")
            }
            Self::NameMismatch { host, presented } => write!(
                f,
                "the certificate is not valid for {host} (it names {})",
                presented.join(", ")
            ),
            Self::Expired(why) => write!(f, "the certificate {why}"),
            Self::CaAsLeaf => write!(
                f,
                "{CA_CERTIFICATE}, which a server cannot present as its own"
            ),
            Self::NotTls => write!(f, "the server does not speak TLS on this port"),
            Self::Other(why) => write!(f, "{why}"),
        }
    }
}

/// Reads a failed client handshake (`TlsConnector::connect`'s error) against `host` by cause.
pub fn classify(error: &io::Error, host: &str) -> TlsFailure {
    let Some(rustls_error) = error
        .get_ref()
        .and_then(|inner| inner.downcast_ref::<rustls::Error>())
    else {
        return match error.kind() {
            // A plain server that does not answer a ClientHello closes or resets.
            io::ErrorKind::UnexpectedEof => TlsFailure::Other(format!(
                "the server closed the connection during the TLS handshake ({error}); it may not speak TLS on this port"
            )),
            _ => TlsFailure::Other(error.to_string()),
        };
    };
    classify_rustls(rustls_error, host)
}

/// The TLS failure somewhere in `error`'s source chain (a client library's connect error wraps
/// the handshake's), read by cause; `None` when the chain holds none.
pub fn find_failure(error: &(dyn std::error::Error + 'static), host: &str) -> Option<TlsFailure> {
    let mut next = Some(error);
    while let Some(current) = next {
        if let Some(rustls_error) = current.downcast_ref::<rustls::Error>() {
            return Some(classify_rustls(rustls_error, host));
        }
        // An I/O error's `source` skips the error it wraps: look inside it first.
        next = match current
            .downcast_ref::<io::Error>()
            .and_then(io::Error::get_ref)
        {
            Some(inner) => Some(inner as &(dyn std::error::Error + 'static)),
            None => current.source(),
        };
    }
    None
}

pub(crate) fn classify_rustls(error: &rustls::Error, host: &str) -> TlsFailure {
    match error {
        rustls::Error::InvalidCertificate(certificate) => classify_certificate(certificate, host),
        rustls::Error::InvalidMessage(
            rustls::InvalidMessage::InvalidContentType
            | rustls::InvalidMessage::UnknownProtocolVersion
            | rustls::InvalidMessage::MessageTooLarge,
        ) => TlsFailure::NotTls,
        other => TlsFailure::Other(tls_problem(other)),
    }
}

fn classify_certificate(error: &CertificateError, host: &str) -> TlsFailure {
    match error {
        CertificateError::UnknownIssuer | CertificateError::BadSignature => TlsFailure::Untrusted,
        CertificateError::NotValidForName => TlsFailure::NameMismatch {
            host: host.to_owned(),
            presented: Vec::new(),
        },
        CertificateError::NotValidForNameContext { presented, .. } => TlsFailure::NameMismatch {
            host: host.to_owned(),
            presented: presented
                .iter()
                .filter_map(|name| plain_name(name))
                .collect(),
        },
        CertificateError::ExpiredContext { time, not_after } => TlsFailure::Expired(format!(
            "expired at {} (the time here is {})",
            utc(unix(not_after)),
            utc(unix(time))
        )),
        CertificateError::Expired => TlsFailure::Expired("has expired".to_owned()),
        CertificateError::NotValidYetContext { time, not_before } => TlsFailure::Expired(format!(
            "is not valid before {} (the time here is {}; check the clocks of both machines)",
            utc(unix(not_before)),
            utc(unix(time))
        )),
        CertificateError::NotValidYet => {
            TlsFailure::Expired("is not valid yet (check the clocks of both machines)".to_owned())
        }
        CertificateError::Other(other) => match other.0.downcast_ref::<webpki::Error>() {
            Some(webpki::Error::CaUsedAsEndEntity) => TlsFailure::CaAsLeaf,
            Some(webpki) => TlsFailure::Other(webpki_problem(webpki)),
            None => TlsFailure::Other(format!("the certificate is refused: {other}")),
        },
        other => TlsFailure::Other(certificate_problem(other)),
    }
}

fn unix(time: &rustls::pki_types::UnixTime) -> i64 {
    i64::try_from(time.as_secs()).unwrap_or(i64::MAX)
}

/// A name rustls reports a certificate presents, as the certificate spells it: webpki writes
/// them as `DnsName("host")` and `IpAddress(127.0.0.1)`. Names of other kinds (a directory name,
/// an unsupported kind) say nothing about hosts and are left out, and so is a name no host has
/// (control characters, or longer than a DNS name): it comes from the peer, and would reach
/// logs and status lines as it is.
fn plain_name(presented: &str) -> Option<String> {
    spelled(presented).filter(|name| name.len() <= MAX_NAME && !name.chars().any(char::is_control))
}

fn spelled(presented: &str) -> Option<String> {
    let inner = |prefix: &str| {
        presented
            .strip_prefix(prefix)
            .and_then(|rest| rest.strip_suffix(')'))
    };
    if let Some(quoted) = inner("DnsName(").or_else(|| inner("UniformResourceIdentifier(")) {
        return Some(quoted.trim_matches('"').to_owned());
    }
    if let Some(address) = inner("IpAddress(") {
        return Some(address.to_owned());
    }
    // Plain text (another webpki version's spelling) is kept; other debug text is not.
    (!presented.contains(['(', ')', '"', '{']) && presented != "DirectoryName")
        .then(|| presented.to_owned())
}

/// A certificate error rustls types, in words.
fn certificate_problem(error: &CertificateError) -> String {
    let what = match error {
        CertificateError::BadEncoding => "the certificate is malformed (its DER encoding is bad)",
        CertificateError::Revoked => "the certificate has been revoked",
        CertificateError::UnhandledCriticalExtension => {
            "the certificate has a critical extension this client does not support"
        }
        CertificateError::UnknownRevocationStatus => {
            "the certificate's revocation status is unknown"
        }
        CertificateError::ExpiredRevocationList
        | CertificateError::ExpiredRevocationListContext { .. } => {
            "the certificate revocation list has expired"
        }
        CertificateError::UnsupportedSignatureAlgorithmContext { .. }
        | CertificateError::UnsupportedSignatureAlgorithmForPublicKeyContext { .. } => {
            "the certificate is signed with an algorithm this client does not support"
        }
        CertificateError::InvalidPurpose | CertificateError::InvalidPurposeContext { .. } => {
            "the certificate is not for TLS servers (its extended key usage lacks serverAuth)"
        }
        CertificateError::InvalidOcspResponse => "the certificate's OCSP response is invalid",
        CertificateError::ApplicationVerificationFailure => "the certificate was refused",
        other => return format!("the certificate is refused: {}", words(other)),
    };
    what.to_owned()
}

/// An error of rustls's certificate verifier that rustls passes on untyped, in words.
fn webpki_problem(error: &webpki::Error) -> String {
    use webpki::Error as E;
    let what = match error {
        E::EndEntityUsedAsCa => {
            "a certificate in the chain signs another but is not a CA certificate \
             (basicConstraints CA:TRUE)"
        }
        E::PathLenConstraintViolated => {
            "the chain is longer than a CA certificate's pathLenConstraint allows"
        }
        E::NameConstraintViolation => {
            "the certificate names a host that its CA's name constraints exclude"
        }
        E::UnsupportedCriticalExtension => {
            "the certificate has a critical extension this client does not support"
        }
        // rustls reads bad DER itself (`CertificateError::BadEncoding`).
        E::MalformedExtensions
        | E::ExtensionValueInvalid
        | E::InvalidSerialNumber
        | E::MalformedDnsIdentifier
        | E::MalformedNameConstraint => "the certificate is malformed",
        E::UnsupportedCertVersion => "the certificate is not an X.509 version 3 certificate",
        E::CertDistrusted => "the certificate is distrusted",
        E::EmptyEkuExtension => "the certificate's extended key usage extension is empty",
        E::MaximumPathDepthExceeded
        | E::MaximumPathBuildCallsExceeded
        | E::MaximumSignatureChecksExceeded
        | E::MaximumNameConstraintComparisonsExceeded => {
            "the certificate chain is too long or too complex to verify"
        }
        other => return format!("the certificate is refused: {}", words(other)),
    };
    what.to_owned()
}

/// A rustls error that is not about the certificate's contents (those are read by
/// [`classify_certificate`]), in words.
fn tls_problem(error: &rustls::Error) -> String {
    use rustls::Error as E;
    match error {
        E::AlertReceived(alert) => alert_problem(*alert),
        E::PeerIncompatible(why) => {
            format!(
                "the server is not compatible with this client: {}",
                words(why)
            )
        }
        E::PeerMisbehaved(why) => format!("the server broke the TLS protocol: {}", words(why)),
        E::InvalidMessage(why) => {
            format!("the server sent a malformed TLS message: {}", words(why))
        }
        E::InappropriateMessage { .. } | E::InappropriateHandshakeMessage { .. } => {
            "the server sent a TLS message out of order".to_owned()
        }
        E::NoCertificatesPresented => "the server presented no certificate".to_owned(),
        E::DecryptError => "a TLS record from the server could not be decrypted".to_owned(),
        E::NoApplicationProtocol => {
            "the server accepts no application protocol this client offers (ALPN)".to_owned()
        }
        E::InvalidCertRevocationList(why) => {
            format!("the certificate revocation list is invalid: {}", words(why))
        }
        E::General(why) => why.clone(),
        // rustls passes its verifier's errors in `CertificateError::Other`, read above.
        E::Other(other) => format!("TLS: {other}"),
        // These read well as rustls words them.
        E::UnsupportedNameType
        | E::EncryptError
        | E::PeerSentOversizedRecord
        | E::HandshakeNotComplete
        | E::FailedToGetCurrentTime
        | E::FailedToGetRandomBytes
        | E::BadMaxFragmentSize => format!("TLS: {error}"),
        other => format!("TLS: {}", words(other)),
    }
}

/// A TLS alert the server ended the handshake with, in words.
fn alert_problem(alert: AlertDescription) -> String {
    match alert {
        AlertDescription::HandshakeFailure => {
            "the server refused the handshake: it has no TLS version or cipher suite in common \
             with this client"
                .to_owned()
        }
        AlertDescription::ProtocolVersion => {
            "the server refused the handshake: it speaks neither TLS 1.2 nor TLS 1.3".to_owned()
        }
        AlertDescription::UnrecognisedName => {
            "the server has no certificate for the host name this client asked for".to_owned()
        }
        AlertDescription::CertificateRequired => {
            "the server asks for a client certificate, which simlock does not send".to_owned()
        }
        other => format!(
            "the server ended the handshake with the TLS alert \"{}\"",
            words(&other)
        ),
    }
}

/// A unit-like value's debug name in lower-case words: `NoCipherSuitesInCommon` reads "no
/// cipher suites in common". What the name carries (anything after it) is left out.
pub(crate) fn words(value: &dyn std::fmt::Debug) -> String {
    let debug = format!("{value:?}");
    let name: String = debug
        .chars()
        .take_while(char::is_ascii_alphanumeric)
        .collect();
    let mut text = String::with_capacity(name.len() + 8);
    let mut previous: Option<char> = None;
    let chars: Vec<char> = name.chars().collect();
    for (index, &c) in chars.iter().enumerate() {
        let next_lower = chars.get(index + 1).is_some_and(char::is_ascii_lowercase);
        // A capital starts a word after a lower-case letter or a digit, and ends an acronym
        // when a lower-case letter follows it (`TLSAlert` reads "tls alert").
        let starts_word = c.is_ascii_uppercase()
            && previous.is_some_and(|p| {
                p.is_ascii_lowercase()
                    || p.is_ascii_digit()
                    || (p.is_ascii_uppercase() && next_lower)
            });
        if starts_word {
            text.push(' ');
        }
        text.push(c.to_ascii_lowercase());
        previous = Some(c);
    }
    if text.is_empty() {
        "an error rustls does not name".to_owned()
    } else {
        text
    }
}
