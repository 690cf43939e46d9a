//! Handshakes over in-memory pipes with certificates made here.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::path::Path;

use tokio::io::{AsyncReadExt, AsyncWriteExt};

use super::testing::{LeafFiles, TestCa, TestLeaf};
use super::*;
use crate::served::EXPIRY_NOTICE_SECS;
use parking_lot::Mutex;
use rustls::CertificateError;

fn server(files: &LeafFiles) -> ServerTls {
    ServerTls::load(
        PemFile::new(&files.cert, "http.tls.certFile"),
        PemFile::new(&files.key, "http.tls.keyFile"),
    )
    .unwrap()
}

fn ca_file(ca: &TestCa, dir: &Path) -> PemFile {
    PemFile::new(ca.write(&dir.join("ca.pem")), "gateway.caFile")
}

/// One handshake over a pipe: the client dials `host`; answers the leaf the server presented.
/// The client resumes no earlier session (a resumed session shows the certificate it was first
/// shown, not the one in service now).
async fn handshake(
    server: &ServerTls,
    client: Arc<ClientConfig>,
    host: &str,
) -> Result<Vec<u8>, TlsFailure> {
    let mut client = (*client).clone();
    client.resumption = Resumption::disabled();
    let client = Arc::new(client);
    let (client_io, server_io) = tokio::io::duplex(64 * 1024);
    let acceptor = server.acceptor();
    let served = tokio::spawn(async move {
        if let Ok(mut stream) = acceptor.accept(server_io).await {
            let mut byte = [0u8; 1];
            let _ = stream.read_exact(&mut byte).await;
            let _ = stream.write_all(&byte).await;
            let _ = stream.flush().await;
        }
    });
    let connector = TlsConnector::from(client);
    let dialled = connector
        .connect(server_name(host).unwrap(), client_io)
        .await;
    let result = match dialled {
        Ok(mut stream) => {
            stream.write_all(b"x").await.unwrap();
            let mut echo = [0u8; 1];
            stream.read_exact(&mut echo).await.unwrap();
            assert_eq!(&echo, b"x");
            let (_, connection) = stream.get_ref();
            Ok(connection.peer_certificates().unwrap()[0].to_vec())
        }
        Err(error) => Err(classify(&error, host)),
    };
    served.abort();
    result
}

#[tokio::test]
async fn a_client_trusting_the_ca_gets_the_servers_leaf() {
    let dir = tempfile::tempdir().unwrap();
    let ca = TestCa::new("simlock test CA");
    let leaf = ca.leaf(&["localhost", "127.0.0.1"]);
    let server = server(&leaf.write(dir.path()));
    let client = client_config(Some(&ca_file(&ca, dir.path()))).unwrap();
    for host in ["localhost", "127.0.0.1"] {
        assert_eq!(
            handshake(&server, client.clone(), host).await,
            Ok(leaf.leaf_der())
        );
    }
}

#[tokio::test]
async fn an_unknown_ca_and_a_wrong_name_are_named() {
    let dir = tempfile::tempdir().unwrap();
    let ca = TestCa::new("simlock test CA");
    let server = server(&ca.leaf(&["gateway.test", "192.0.2.7"]).write(dir.path()));
    // The platform's roots alone do not know a CA made here.
    let platform_only = client_config(None).unwrap();
    assert_eq!(
        handshake(&server, platform_only, "gateway.test").await,
        Err(TlsFailure::Untrusted)
    );
    let trusting = client_config(Some(&ca_file(&ca, dir.path()))).unwrap();
    let Err(TlsFailure::NameMismatch { host, presented }) =
        handshake(&server, trusting, "localhost").await
    else {
        panic!("a name mismatch");
    };
    assert_eq!(host, "localhost");
    // The names as the certificate spells them, not webpki's `DnsName("gateway.test")`.
    assert_eq!(presented, ["gateway.test", "192.0.2.7"]);
    let failure = TlsFailure::NameMismatch { host, presented };
    assert_eq!(
        failure.to_string(),
        "the certificate is not valid for localhost (it names gateway.test, 192.0.2.7)"
    );
}

/// A self-signed certificate made with openssl's defaults says basicConstraints CA:TRUE, which
/// webpki refuses as a server's own before it looks at trust: the failure says so, trusted or
/// not, and one made with CA:FALSE is served to a client that trusts it.
#[tokio::test]
async fn a_self_signed_ca_certificate_is_named_and_one_with_ca_false_works() {
    let dir = tempfile::tempdir().unwrap();
    let ca_true = TestLeaf::self_signed(&["localhost", "127.0.0.1"], true);
    let server = server(&ca_true.write(dir.path()));
    let trusting = dir.path().join("trusted.pem");
    std::fs::write(&trusting, &ca_true.cert_pem).unwrap();
    let trusting = client_config(Some(&PemFile::new(&trusting, "gateway.caFile"))).unwrap();
    for client in [trusting, client_config(None).unwrap()] {
        let failure = handshake(&server, client, "localhost").await.unwrap_err();
        assert_eq!(failure, TlsFailure::CaAsLeaf);
        let text = failure.to_string();
        assert!(text.contains("basicConstraints CA:TRUE"), "{text}");
        assert_readable(&text);
    }
    assert!(LEAF_REMEDY.contains("basicConstraints=critical,CA:FALSE"));

    let other = tempfile::tempdir().unwrap();
    let ca_false = TestLeaf::self_signed(&["localhost", "127.0.0.1"], false);
    let server = self::server(&ca_false.write(other.path()));
    let trusted = other.path().join("trusted.pem");
    std::fs::write(&trusted, &ca_false.cert_pem).unwrap();
    let client = client_config(Some(&PemFile::new(&trusted, "gateway.caFile"))).unwrap();
    for host in ["localhost", "127.0.0.1"] {
        assert_eq!(
            handshake(&server, client.clone(), host).await,
            Ok(ca_false.leaf_der())
        );
    }
    assert_eq!(
        handshake(&server, client_config(None).unwrap(), "localhost").await,
        Err(TlsFailure::Untrusted)
    );
}

/// An expired certificate, and one not valid yet, say their dates in UTC.
#[tokio::test]
async fn validity_failures_say_their_dates_in_utc() {
    let ca = TestCa::new("simlock test CA");
    let cases = [
        // 2019-01-01 to 2020-02-01.
        (
            1_546_300_800,
            1_580_515_200,
            "expired at 2020-02-01T00:00:00Z",
        ),
        // 2090-01-01 to 2091-01-01.
        (
            3_786_912_000,
            3_818_448_000,
            "is not valid before 2090-01-01T00:00:00Z",
        ),
    ];
    for (not_before, not_after, said) in cases {
        let dir = tempfile::tempdir().unwrap();
        let leaf = ca.leaf_valid(&["localhost"], not_before, not_after);
        let server = server(&leaf.write(dir.path()));
        let client = client_config(Some(&ca_file(&ca, dir.path()))).unwrap();
        let failure = handshake(&server, client, "localhost").await.unwrap_err();
        let TlsFailure::Expired(why) = &failure else {
            panic!("a validity failure, not {failure:?}");
        };
        assert!(why.starts_with(said), "{why}");
        let text = failure.to_string();
        assert!(text.starts_with("the certificate "), "{text}");
        assert!(text.contains("(the time here is 20"), "{text}");
        assert!(!text.contains("UNIX"), "{text}");
        assert_readable(&text);
    }
}

/// A word spelled like a Rust type (`OtherError`, `DnsName`, `CaUsedAsEndEntity`): debug text.
fn assert_readable(text: &str) {
    for word in text.split(|c: char| !c.is_ascii_alphanumeric()) {
        let mut chars = word.chars();
        let camel = chars.next().is_some_and(|c| c.is_ascii_uppercase())
            && word.chars().any(|c| c.is_ascii_lowercase())
            && word.chars().skip(1).any(|c| c.is_ascii_uppercase());
        assert!(!camel, "{word:?} is debug text in {text:?}");
    }
    assert!(!text.contains(['{', '}']), "{text:?}");
}

#[test]
fn every_failure_reads_as_words() {
    use rustls::pki_types::UnixTime;
    use std::time::Duration;

    let webpki = |error: webpki::Error| {
        rustls::Error::InvalidCertificate(CertificateError::Other(rustls::OtherError(Arc::new(
            error,
        ))))
    };
    let at = |secs| UnixTime::since_unix_epoch(Duration::from_secs(secs));
    // Each error, and what its own message says.
    let cases: Vec<(rustls::Error, &str)> = vec![
        (
            webpki(webpki::Error::CaUsedAsEndEntity),
            "the certificate is a CA certificate (basicConstraints CA:TRUE), which a server \
             cannot present as its own",
        ),
        (
            webpki(webpki::Error::EndEntityUsedAsCa),
            "is not a CA certificate",
        ),
        (
            webpki(webpki::Error::PathLenConstraintViolated),
            "pathLenConstraint",
        ),
        (
            webpki(webpki::Error::UnsupportedCriticalExtension),
            "critical extension this client does not support",
        ),
        (
            webpki(webpki::Error::UnsupportedCrlVersion),
            "the certificate is refused: unsupported crl version",
        ),
        (CertificateError::BadEncoding.into(), "DER encoding is bad"),
        (CertificateError::Revoked.into(), "has been revoked"),
        (
            CertificateError::UnhandledCriticalExtension.into(),
            "critical extension this client does not support",
        ),
        (CertificateError::InvalidPurpose.into(), "lacks serverAuth"),
        (
            CertificateError::ApplicationVerificationFailure.into(),
            "the certificate was refused",
        ),
        (
            CertificateError::Expired.into(),
            "the certificate has expired",
        ),
        (CertificateError::NotValidYet.into(), "is not valid yet"),
        (
            CertificateError::ExpiredContext {
                time: at(1_796_377_117),
                not_after: at(1_580_515_200),
            }
            .into(),
            "expired at 2020-02-01T00:00:00Z (the time here is 2026-12-04T",
        ),
        (
            CertificateError::NotValidYetContext {
                time: at(1_580_515_200),
                not_before: at(1_796_377_117),
            }
            .into(),
            "is not valid before 2026-12-04T",
        ),
        (
            CertificateError::NotValidForNameContext {
                expected: server_name("other.example").unwrap(),
                presented: vec![
                    "DnsName(\"gateway.test\")".to_owned(),
                    "IpAddress(192.0.2.7)".to_owned(),
                    "DirectoryName".to_owned(),
                ],
            }
            .into(),
            "not valid for localhost (it names gateway.test, 192.0.2.7)",
        ),
        (
            rustls::Error::AlertReceived(rustls::AlertDescription::HandshakeFailure),
            "no TLS version or cipher suite in common",
        ),
        (
            rustls::Error::AlertReceived(rustls::AlertDescription::DecodeError),
            "the TLS alert \"decode error\"",
        ),
        (
            rustls::Error::PeerIncompatible(rustls::PeerIncompatible::NoCipherSuitesInCommon),
            "not compatible with this client: no cipher suites in common",
        ),
        (
            rustls::Error::PeerMisbehaved(
                rustls::PeerMisbehaved::IllegalHelloRetryRequestWithNoChanges,
            ),
            "illegal hello retry request with no changes",
        ),
        (
            rustls::Error::InvalidMessage(rustls::InvalidMessage::MissingData("ServerHello")),
            "malformed TLS message: missing data",
        ),
        (
            rustls::Error::NoCertificatesPresented,
            "presented no certificate",
        ),
        (rustls::Error::DecryptError, "could not be decrypted"),
        (rustls::Error::HandshakeNotComplete, "TLS: "),
        (
            rustls::Error::Other(rustls::OtherError(Arc::new(io::Error::other("boom")))),
            "boom",
        ),
    ];
    for (error, said) in &cases {
        let text = failure::classify_rustls(error, "localhost").to_string();
        assert_readable(&text);
        assert!(text.contains(said), "{error:?}: {said:?} in {text:?}");
    }
    assert_eq!(
        failure::classify_rustls(&webpki(webpki::Error::CaUsedAsEndEntity), "h"),
        TlsFailure::CaAsLeaf
    );
    #[derive(Debug)]
    enum Named {
        TLSAlertX,
    }
    assert_eq!(failure::words(&Named::TLSAlertX), "tls alert x");
    // A name no host has, from the peer, is not repeated into logs and status lines.
    let hostile = CertificateError::NotValidForNameContext {
        expected: server_name("other.example").unwrap(),
        presented: vec![
            "DnsName(\"gateway.test\\n\u{1b}[31mowned\")".to_owned(),
            format!("DnsName(\"{}\")", "a".repeat(254)),
            format!("DnsName(\"{}\")", "a".repeat(253)),
        ],
    };
    assert_eq!(
        failure::classify_rustls(&hostile.into(), "h"),
        TlsFailure::NameMismatch {
            host: "h".into(),
            presented: vec!["a".repeat(253)],
        }
    );
    assert_eq!(utc(0), "1970-01-01T00:00:00Z");
    assert_eq!(
        utc(i64::MAX),
        format!("{} s after 1970-01-01T00:00:00Z", i64::MAX)
    );
}

#[tokio::test]
async fn a_plain_text_answer_is_not_tls() {
    let (client_io, mut server_io) = tokio::io::duplex(64 * 1024);
    tokio::spawn(async move {
        let mut hello = [0u8; 5];
        let _ = server_io.read_exact(&mut hello).await;
        let _ = server_io
            .write_all(b"HTTP/1.1 400 Bad Request\r\ncontent-length: 0\r\n\r\n")
            .await;
    });
    let connector = TlsConnector::from(client_config(None).unwrap());
    let error = connector
        .connect(server_name("localhost").unwrap(), client_io)
        .await
        .unwrap_err();
    assert_eq!(classify(&error, "localhost"), TlsFailure::NotTls);
}

#[test]
fn files_that_do_not_load_are_named_by_their_setting() {
    let dir = tempfile::tempdir().unwrap();
    let ca = TestCa::new("simlock test CA");
    let files = ca.leaf(&["localhost"]).write(dir.path());
    let cert = PemFile::new(&files.cert, "http.tls.certFile");
    let key = PemFile::new(&files.key, "http.tls.keyFile");
    let missing = PemFile::new(dir.path().join("nope.pem"), "http.tls.certFile");

    let error = ServerTls::load(missing.clone(), key.clone()).unwrap_err();
    assert!(
        matches!(
            error,
            TlsError::Read {
                key: "http.tls.certFile",
                ..
            }
        ),
        "{error}"
    );
    assert!(error.to_string().contains("nope.pem"), "{error}");

    let garbage = dir.path().join("garbage.pem");
    std::fs::write(&garbage, "not a certificate").unwrap();
    let error = ServerTls::load(PemFile::new(&garbage, "http.tls.certFile"), key.clone())
        .unwrap_err()
        .to_string();
    assert!(error.starts_with("http.tls.certFile: "), "{error}");
    assert!(error.contains("no PEM certificate"), "{error}");

    // The certificate file holds no key.
    let error = ServerTls::load(cert.clone(), PemFile::new(&files.cert, "http.tls.keyFile"))
        .unwrap_err()
        .to_string();
    assert!(error.starts_with("http.tls.keyFile: "), "{error}");

    // Another leaf's key.
    let other = tempfile::tempdir().unwrap();
    let other = ca.leaf(&["localhost"]).write(other.path());
    let error = ServerTls::load(cert, PemFile::new(&other.key, "http.tls.keyFile")).unwrap_err();
    assert!(matches!(error, TlsError::Mismatch { .. }), "{error}");
    let text = error.to_string();
    assert!(
        text.contains("http.tls.keyFile") && text.contains("http.tls.certFile"),
        "{text}"
    );

    let error = client_config(Some(&PemFile::new(
        dir.path().join("nope.pem"),
        "gateway.caFile",
    )))
    .unwrap_err()
    .to_string();
    assert!(error.starts_with("gateway.caFile: cannot read"), "{error}");
    let error = client_config(Some(&PemFile::new(&garbage, "gateway.caFile")))
        .unwrap_err()
        .to_string();
    assert!(error.starts_with("gateway.caFile: "), "{error}");
}

#[tokio::test]
async fn a_rotated_pair_is_served_to_new_connections_and_half_a_rotation_is_not() {
    let dir = tempfile::tempdir().unwrap();
    let ca = TestCa::new("simlock test CA");
    let first = ca.leaf(&["localhost"]);
    let files = first.write(dir.path());
    let server = server(&files);
    let client = client_config(Some(&ca_file(&ca, dir.path()))).unwrap();
    assert_eq!(
        handshake(&server, client.clone(), "localhost").await,
        Ok(first.leaf_der())
    );

    // The new certificate lands before its key: the old pair stays in service.
    let second = ca.leaf(&["localhost"]);
    std::fs::write(&files.cert, &second.cert_pem).unwrap();
    assert_eq!(
        handshake(&server, client.clone(), "localhost").await,
        Ok(first.leaf_der())
    );
    assert_eq!(server.current_certificate().to_vec(), first.leaf_der());

    // Then the key: the next connection gets the new certificate.
    std::fs::write(&files.key, &second.key_pem).unwrap();
    assert_eq!(
        handshake(&server, client.clone(), "localhost").await,
        Ok(second.leaf_der())
    );
    assert_eq!(server.current_certificate().to_vec(), second.leaf_der());

    // A file missing for a moment keeps the pair in service.
    std::fs::remove_file(&files.key).unwrap();
    assert_eq!(
        handshake(&server, client, "localhost").await,
        Ok(second.leaf_der())
    );
}

#[test]
fn host_names_and_addresses_are_server_names() {
    assert!(matches!(
        server_name("localhost"),
        Ok(ServerName::DnsName(_))
    ));
    assert!(matches!(
        server_name("127.0.0.1"),
        Ok(ServerName::IpAddress(_))
    ));
    assert!(matches!(server_name("[::1]"), Ok(ServerName::IpAddress(_))));
    assert!(server_name("not a host").is_err());
}

#[test]
fn a_failure_is_found_inside_the_errors_that_wrap_it() {
    let rustls_error = rustls::Error::InvalidCertificate(CertificateError::UnknownIssuer);
    let handshake = io::Error::new(io::ErrorKind::InvalidData, rustls_error);
    // A connector's error wraps the handshake's I/O error, whose `source` skips what it wraps.
    let connect = io::Error::other(handshake);
    assert_eq!(
        find_failure(&connect, "localhost"),
        Some(TlsFailure::Untrusted)
    );
    let plain = io::Error::new(io::ErrorKind::ConnectionRefused, "refused");
    assert_eq!(find_failure(&plain, "localhost"), None);
    let eof = io::Error::new(io::ErrorKind::UnexpectedEof, "eof");
    assert!(
        matches!(classify(&eof, "h"), TlsFailure::Other(why) if why.contains("may not speak TLS"))
    );
}

/// A `tracing` writer that keeps what is logged.
#[derive(Clone, Default)]
struct Captured(Arc<Mutex<Vec<u8>>>);

impl io::Write for Captured {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.0.lock().extend_from_slice(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

/// What `run` logs.
fn logged<T>(run: impl FnOnce() -> T) -> (T, String) {
    let captured = Captured::default();
    let writer = captured.clone();
    let subscriber = tracing_subscriber::fmt()
        .with_writer(move || writer.clone())
        .with_ansi(false)
        .finish();
    let value = tracing::subscriber::with_default(subscriber, run);
    let log = String::from_utf8(captured.0.lock().clone()).unwrap();
    (value, log)
}

fn pem_files(files: &LeafFiles) -> (PemFile, PemFile) {
    (
        PemFile::new(&files.cert, "http.tls.certFile"),
        PemFile::new(&files.key, "http.tls.keyFile"),
    )
}

/// A server starts with a certificate out of its validity (it can be renewed in place), and
/// warns naming the file and the dates in UTC.
#[test]
fn a_certificate_out_of_its_validity_is_served_and_warned_about() {
    let ca = TestCa::new("simlock test CA");
    let cases = [
        // 2019-01-01 to 2020-02-01.
        (
            1_546_300_800,
            1_580_515_200,
            "the certificate expired at 2020-02-01T00:00:00Z (valid from 2019-01-01T00:00:00Z; the time here is 20",
        ),
        // 2090-01-01 to 2091-01-01.
        (
            3_786_912_000,
            3_818_448_000,
            "the certificate is not valid before 2090-01-01T00:00:00Z (the time here is 20",
        ),
    ];
    for (not_before, not_after, said) in cases {
        let dir = tempfile::tempdir().unwrap();
        let leaf = ca.leaf_valid(&["localhost"], not_before, not_after);
        let files = leaf.write(dir.path());
        let (cert, key) = pem_files(&files);
        let (server, log) = logged(|| ServerTls::load(cert, key));
        let server = server.expect("a certificate out of its validity still loads");
        assert_eq!(server.current_certificate().to_vec(), leaf.leaf_der());
        assert!(log.contains("WARN"), "{log}");
        assert!(
            log.contains(&format!("http.tls.certFile ({})", files.cert.display())),
            "{log}"
        );
        assert!(log.contains(said), "{log}");
        assert_eq!(log.matches("WARN").count(), 1, "{log}");
    }
}

/// The certificate in service is looked at against the clock at each handshake: each change
/// (expiring within 7 days, expired) is warned about once, and a renewed pair ends it.
#[test]
fn the_certificate_in_service_is_watched_and_each_change_warned_once() {
    use std::sync::atomic::{AtomicI64, Ordering};
    use std::time::{Duration, UNIX_EPOCH};

    const DAY: i64 = 86_400;
    let start: i64 = 1_800_000_000; // 2027-01-15T08:00:00Z
    let now = Arc::new(AtomicI64::new(start));
    let clock = {
        let now = now.clone();
        move || UNIX_EPOCH + Duration::from_secs(now.load(Ordering::SeqCst).unsigned_abs())
    };
    let dir = tempfile::tempdir().unwrap();
    let ca = TestCa::new("simlock test CA");
    let files = ca
        .leaf_valid(&["localhost"], start - DAY, start + 30 * DAY)
        .write(dir.path());
    let (cert, key) = pem_files(&files);
    let (server, log) = logged(|| ServerTls::load_with_clock(cert, key, clock).unwrap());
    assert!(!log.contains("WARN"), "valid for 30 days: {log}");

    now.store(start + 25 * DAY, Ordering::SeqCst);
    let (_, log) = logged(|| {
        server.current_certificate();
        server.current_certificate();
    });
    assert_eq!(log.matches("WARN").count(), 1, "{log}");
    assert!(
        log.contains(&format!(
            "the certificate expires at {}, in 5 days (the time here is {})",
            utc(start + 30 * DAY),
            utc(start + 25 * DAY)
        )),
        "{log}"
    );
    assert!(log.contains("without a restart"), "{log}");

    now.store(start + 31 * DAY, Ordering::SeqCst);
    let (_, log) = logged(|| {
        server.current_certificate();
        server.current_certificate();
    });
    assert_eq!(log.matches("WARN").count(), 1, "{log}");
    assert!(
        log.contains(&format!(
            "the certificate expired at {}",
            utc(start + 30 * DAY)
        )),
        "{log}"
    );

    // A renewed pair written over the files: served, and nothing to warn about.
    let renewed = ca.leaf_valid(&["localhost"], start + 30 * DAY, start + 120 * DAY);
    renewed.write(dir.path());
    let (served, log) = logged(|| server.current_certificate());
    assert_eq!(served.to_vec(), renewed.leaf_der());
    assert!(log.contains("TLS certificate reloaded"), "{log}");
    assert!(!log.contains("WARN"), "{log}");
}

/// A CA certificate served as the server's own is served, and warned about with the fix, at
/// start-up and when a rotation brings one in.
#[test]
fn a_ca_certificate_is_warned_about_with_its_fix() {
    let dir = tempfile::tempdir().unwrap();
    let files = TestLeaf::self_signed(&["localhost"], true).write(dir.path());
    let (cert, key) = pem_files(&files);
    let (server, log) = logged(|| ServerTls::load(cert, key));
    let server = server.expect("a CA certificate still loads");
    assert_eq!(log.matches("WARN").count(), 1, "{log}");
    assert!(
        log.contains(&format!(
            "http.tls.certFile ({}): the certificate is a CA certificate (basicConstraints CA:TRUE)",
            files.cert.display()
        )),
        "{log}"
    );
    assert!(log.contains(LEAF_REMEDY), "{log}");

    // A leaf, then a self-signed one with CA:FALSE, replace it: neither is warned about.
    let ca = TestCa::new("simlock test CA");
    for leaf in [
        ca.leaf(&["localhost"]),
        TestLeaf::self_signed(&["localhost"], false),
    ] {
        leaf.write(dir.path());
        let (served, log) = logged(|| server.current_certificate());
        assert_eq!(served.to_vec(), leaf.leaf_der());
        assert!(!log.contains("WARN"), "{log}");
    }

    // And a CA certificate rotated in is warned about again.
    TestLeaf::self_signed(&["localhost"], true).write(dir.path());
    let (_, log) = logged(|| server.current_certificate());
    assert!(log.contains("basicConstraints CA:TRUE"), "{log}");
}

#[test]
fn a_certificate_stands_against_the_clock() {
    use served::{Standing, Validity};
    let validity = Validity {
        not_before: 1_000,
        not_after: 1_000 + 30 * 86_400,
    };
    let end = validity.not_after;
    assert_eq!(validity.standing(999), Standing::NotValidYet);
    assert_eq!(validity.standing(1_000), Standing::Valid);
    assert_eq!(
        validity.standing(end - EXPIRY_NOTICE_SECS - 1),
        Standing::Valid
    );
    assert_eq!(
        validity.standing(end - EXPIRY_NOTICE_SECS),
        Standing::ExpiresSoon
    );
    assert_eq!(validity.standing(end), Standing::ExpiresSoon);
    assert_eq!(validity.standing(end + 1), Standing::Expired);
    let file = PemFile::new("/etc/simlock/cert.pem", "http.tls.certFile");
    assert_eq!(validity.warning(&file, 5_000), None);
    for (before_end, said) in [
        (5 * 86_400 + 7, "in 5 days"),
        (2 * 86_400, "in 2 days"),
        (2 * 86_400 - 1, "in 47 hours"),
        (30 * 3_600, "in 30 hours"),
        (2 * 3_600, "in 2 hours"),
        (2 * 3_600 - 1, "in 119 minutes"),
        (5 * 60, "in 5 minutes"),
        (120, "in 2 minutes"),
        (119, "in 119 seconds"),
        (42, "in 42 seconds"),
    ] {
        let text = validity.warning(&file, end - before_end).unwrap();
        assert!(
            text.starts_with("http.tls.certFile (/etc/simlock/cert.pem): the certificate expires at 1970-01-31T00:16:40Z, "),
            "{text}"
        );
        assert!(text.contains(said), "{text}");
        assert_readable(&text);
    }
}
