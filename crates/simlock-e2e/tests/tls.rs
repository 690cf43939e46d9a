//! TLS on every hop, with certificates made at test time: a worker joins its gateway over
//! `wss://` and relayed bodies cross byte for byte; an untrusted CA, a wrong host name, a
//! self-signed CA certificate and plain `ws://` to the TLS port each fail with their named error
//! and open no uplink (and a worker keeps retrying); a missing CA file or certificate fails
//! start-up; a rotated certificate is served to new connections without a restart; HTTPS clients
//! reach the gateway's API.

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    reason = "tests fail by panicking"
)]

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use http::{Method, StatusCode};
use http_body_util::BodyExt;
use simlock_client::{Client, ConnectOptions};
use simlock_daemon::home::Home;
use simlock_daemon::uplink::{DialError, UplinkConfig, UplinkState, dial, uplink_tls};
use simlock_e2e::relay::{
    PatternBody, PatternCheck, Probe, fleet_with_tls, patient, pattern, pattern_response, relay,
    relay_targets, request, respond,
};
use simlock_e2e::{PATIENCE, TestFleet, gateway_config, worker_config};
use simlock_relay_gateway::RelayCall;
use simlock_tls::TlsFailure;
use simlock_tls::testing::{TestCa, TestLeaf};
use tokio::io::AsyncWriteExt;

const MIB: u64 = 1024 * 1024;

/// A gateway serving TLS (a fresh CA, a leaf for `localhost` and `127.0.0.1`); returns the
/// fleet and the gateway's port.
async fn tls_gateway() -> (TestFleet, u16) {
    let fleet = TestFleet::start_tls(gateway_config()).await;
    let port = fleet.gateway().running.http_addr().unwrap().port();
    assert!(fleet.gateway().running.http_tls());
    (fleet, port)
}

fn uplink(url: String, token: &str, ca_file: Option<&std::path::Path>) -> UplinkConfig {
    UplinkConfig {
        tls: uplink_tls(&url, ca_file).unwrap(),
        url,
        token: token.to_owned(),
        worker_id: "tls-probe".to_owned(),
        label: None,
    }
}

/// What a fresh TLS client (no resumed session) is shown by the gateway at `port`.
async fn served_certificate(port: u16, ca_file: &std::path::Path) -> Vec<u8> {
    let ca = simlock_tls::PemFile::new(ca_file, "test");
    let mut config = (*simlock_tls::client_config(Some(&ca)).unwrap()).clone();
    config.resumption = rustls_resumption_disabled();
    let stream = tokio::net::TcpStream::connect(("127.0.0.1", port))
        .await
        .unwrap();
    let mut tls = simlock_tls::TlsConnector::from(Arc::new(config))
        .connect(simlock_tls::server_name("localhost").unwrap(), stream)
        .await
        .unwrap();
    let certificate = tls.get_ref().1.peer_certificates().unwrap()[0].to_vec();
    let _ = tls.shutdown().await;
    certificate
}

fn rustls_resumption_disabled() -> simlock_tls::Resumption {
    simlock_tls::Resumption::disabled()
}

/// A worker joins over `wss://`; a 20 MiB upload reaches its target and a 20 MiB answer comes
/// back, each byte for byte.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_joins_over_wss_and_20_mib_cross_byte_for_byte() {
    let probe = Probe::new();
    let upload_ok = Arc::new(AtomicBool::new(false));
    let target = probe.target({
        let upload_ok = upload_ok.clone();
        move |probe, request| {
            let upload_ok = upload_ok.clone();
            async move {
                let body = probe.drain(request.request.into_body()).await?;
                upload_ok.store(body == pattern(1, 20 * MIB as usize), Ordering::SeqCst);
                Ok(respond(200, pattern_response(2, 20 * MIB, Arc::default())))
            }
        }
    });
    let (fleet, worker) = fleet_with_tls(relay_targets(vec![("fake", target)])).await;
    assert!(fleet.gateway_url().starts_with("wss://localhost:"));
    let call = RelayCall::new(
        "fake",
        request(
            Method::PUT,
            "http://device.test/upload",
            PatternBody::new(1, 20 * MIB),
        ),
        "tenant",
    );
    let response = relay(&fleet, &worker, call).await.unwrap();
    assert_eq!(response.status(), StatusCode::OK);
    let mut check = PatternCheck::new(2);
    let mut body = std::pin::pin!(response.into_body());
    while let Some(frame) = patient("a frame", body.frame()).await {
        check.feed(&frame.unwrap().into_data().unwrap());
    }
    assert!(check.ok, "the download arrived byte for byte");
    assert_eq!(check.offset, 20 * MIB);
    assert!(
        upload_ok.load(Ordering::SeqCst),
        "the upload arrived byte for byte"
    );
    assert_eq!(probe.read.load(Ordering::SeqCst), 20 * MIB);
    fleet.stop().await;
}

/// An untrusted CA, a wrong host name and plain `ws://` to the TLS port each fail with their
/// named error, naming the setting to change, and none opens an uplink.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_untrusted_ca_a_wrong_name_and_plain_ws_are_named_and_open_no_uplink() {
    let (fleet, port) = tls_gateway().await;
    let tls = fleet.tls.as_ref().unwrap();
    let token = fleet.join_token.clone();

    // The platform's roots do not know the test CA.
    let untrusted = dial(&uplink(format!("wss://localhost:{port}"), &token, None))
        .await
        .map(drop)
        .expect_err("an untrusted certificate fails");
    assert_eq!(untrusted, DialError::Tls(TlsFailure::Untrusted));
    assert!(
        untrusted.to_string().contains("gateway.caFile"),
        "{untrusted}"
    );

    // Another CA's file does not help either.
    let stranger = TestCa::new("another CA");
    let dir = tempfile::tempdir().unwrap();
    let stranger_file = stranger.write(&dir.path().join("other.pem"));
    let other = dial(&uplink(
        format!("wss://localhost:{port}"),
        &token,
        Some(&stranger_file),
    ))
    .await
    .map(drop)
    .expect_err("a certificate of another CA fails");
    assert_eq!(other, DialError::Tls(TlsFailure::Untrusted));

    // The gateway now serves a certificate of the right CA for another name (it reads its
    // files at every new connection).
    tls.ca
        .leaf(&["gateway.test"])
        .write(tls.files.cert.parent().unwrap());
    let mismatch = dial(&uplink(
        format!("wss://localhost:{port}"),
        &token,
        Some(&tls.ca_file),
    ))
    .await
    .map(drop)
    .expect_err("a wrong host name fails");
    let DialError::Tls(TlsFailure::NameMismatch { host, .. }) = &mismatch else {
        panic!("a name mismatch, not {mismatch:?}");
    };
    assert_eq!(host, "localhost");
    assert!(mismatch.to_string().contains("gateway.url"), "{mismatch}");

    // Plain ws:// to the TLS port.
    let plain = dial(&uplink(format!("ws://localhost:{port}"), &token, None))
        .await
        .map(drop)
        .expect_err("plain text to the TLS port fails");
    assert_eq!(plain, DialError::TlsRequired);
    let text = plain.to_string();
    assert!(
        text.contains("gateway.url") && text.contains("wss://"),
        "{text}"
    );

    assert!(
        fleet.gateway().fleet.views().is_empty(),
        "no attempt opened an uplink"
    );
    fleet.stop().await;
}

/// A gateway serving a self-signed CA certificate (as `openssl req -x509` makes one by
/// default) fails the uplink with a message that says so and names the fix, whether or not the
/// worker trusts that certificate; one made with CA:FALSE and trusted joins.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_self_signed_ca_certificate_is_named_with_its_fix() {
    let (fleet, port) = tls_gateway().await;
    let tls = fleet.tls.as_ref().unwrap();
    let token = fleet.join_token.clone();
    let dir = tls.files.cert.parent().unwrap();
    let url = format!("wss://localhost:{port}");

    let ca_true = TestLeaf::self_signed(&["localhost", "127.0.0.1"], true);
    ca_true.write(dir);
    let trusted = dir.join("self-signed.pem");
    std::fs::write(&trusted, &ca_true.cert_pem).unwrap();
    for ca_file in [Some(trusted.as_path()), None] {
        let error = dial(&uplink(url.clone(), &token, ca_file))
            .await
            .map(drop)
            .expect_err("a CA certificate served as the gateway's own fails");
        assert_eq!(error, DialError::Tls(TlsFailure::CaAsLeaf));
        let text = error.to_string();
        assert!(
            text.starts_with("TLS with the gateway: the certificate is a CA certificate (basicConstraints CA:TRUE)"),
            "{text}"
        );
        assert!(
            text.contains("http.tls.certFile")
                && text.contains("basicConstraints=critical,CA:FALSE"),
            "{text}"
        );
        assert!(!text.contains("Other("), "{text}");
    }

    let ca_false = TestLeaf::self_signed(&["localhost", "127.0.0.1"], false);
    ca_false.write(dir);
    std::fs::write(&trusted, &ca_false.cert_pem).unwrap();
    let joined = dial(&uplink(url, &token, Some(&trusted))).await;
    assert!(joined.is_ok(), "{:?}", joined.map(drop));
    fleet.stop().await;
}

/// A real worker that does not trust the gateway keeps retrying with backoff, each attempt
/// failing with the named cause, and never joins.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_that_does_not_trust_the_gateway_keeps_retrying() {
    let (fleet, port) = tls_gateway().await;
    let mut config = worker_config(1);
    config.daemon.gateway.url = Some(format!("wss://localhost:{port}"));
    config.daemon.gateway.token = Some(fleet.join_token.clone());
    let home = fleet.worker_home(0);
    let worker = simlock_worker::start(simlock_worker::WorkerOptions::new(home, config))
        .await
        .expect("a TLS failure is retried, not a start-up error");
    let mut state = worker.uplink.clone().unwrap();
    let mut failures = 0;
    patient("two failed attempts", async {
        while failures < 2 {
            state.changed().await.unwrap();
            if let UplinkState::Connecting {
                last_error: Some(error),
            } = &*state.borrow_and_update()
            {
                assert!(
                    error.contains("not signed by a trusted CA")
                        && error.contains("gateway.caFile"),
                    "{error}"
                );
                failures += 1;
            }
        }
    })
    .await;
    assert!(fleet.gateway().fleet.views().is_empty());
    worker.stop("test").await;
    fleet.stop().await;
}

/// A CA file that cannot be read fails a worker's start-up, and a certificate that cannot be
/// read fails a gateway's, each naming its key.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_missing_ca_file_or_certificate_fails_start_up_naming_the_key() {
    let dir = tempfile::tempdir().unwrap();
    let mut config = worker_config(1);
    config.daemon.gateway.url = Some("wss://localhost:1".into());
    config.daemon.gateway.token = Some("slk_x".into());
    config.daemon.gateway.ca_file = Some("missing-ca.pem".into());
    let options = simlock_worker::WorkerOptions::new(Home::at(dir.path().join("w")), config);
    let error = simlock_worker::start(options)
        .await
        .err()
        .unwrap()
        .to_string();
    assert!(
        error.contains("gateway.caFile") && error.contains("missing-ca.pem"),
        "{error}"
    );

    let mut config = gateway_config();
    config.daemon.http.tls.cert_file = Some("missing-cert.pem".into());
    config.daemon.http.tls.key_file = Some("missing-key.pem".into());
    let options = simlock_gateway::GatewayOptions::new(Home::at(dir.path().join("g")), config);
    let error = simlock_gateway::start(options)
        .await
        .err()
        .unwrap()
        .to_string();
    assert!(
        error.contains("http.tls.certFile") && error.contains("missing-cert.pem"),
        "{error}"
    );
}

/// A replaced certificate and key are served to the next connection, with no restart; the
/// worker that joined before goes on working.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rotated_certificate_is_served_to_new_connections() {
    let (mut fleet, port) = tls_gateway().await;
    fleet.add_worker(worker_config(1)).await;
    let (first_leaf, ca_file, files) = {
        let tls = fleet.tls.as_ref().unwrap();
        (
            std::fs::read(&tls.files.cert).unwrap(),
            tls.ca_file.clone(),
            tls.files.clone(),
        )
    };
    let first = served_certificate(port, &ca_file).await;
    assert_eq!(
        first,
        TestLeaf {
            cert_pem: String::from_utf8(first_leaf).unwrap(),
            key_pem: String::new(),
        }
        .leaf_der()
    );

    let second = fleet
        .tls
        .as_ref()
        .unwrap()
        .ca
        .leaf(&["localhost", "127.0.0.1"]);
    second.write(files.cert.parent().unwrap());
    assert_eq!(served_certificate(port, &ca_file).await, second.leaf_der());
    assert_ne!(first, second.leaf_der());

    // The uplink opened before the rotation is still up, and a new HTTPS client gets in.
    let worker_id = fleet.worker_id(0);
    assert!(fleet.gateway().fleet.conn(&worker_id).is_some());
    let operator = fleet.operator().await;
    let token = operator
        .call(
            "token.create",
            serde_json::json!({"role": "agent", "label": "https"}),
        )
        .await
        .unwrap();
    let client = Client::over_http(
        &format!("https://localhost:{port}"),
        token["secret"].as_str().unwrap(),
        ConnectOptions::default().ca_file(&ca_file),
    )
    .unwrap();
    let status = tokio::time::timeout(PATIENCE, client.status())
        .await
        .unwrap();
    assert!(status.is_ok(), "{status:?}");
    fleet.stop().await;
}

/// `wss://` to a gateway that serves plain HTTP is named too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wss_to_a_plain_gateway_is_named() {
    let fleet = TestFleet::start(gateway_config()).await;
    let port = fleet.gateway().running.http_addr().unwrap().port();
    let error = dial(&uplink(
        format!("wss://localhost:{port}"),
        &fleet.join_token,
        None,
    ))
    .await
    .map(drop)
    .expect_err("TLS to a plain port fails");
    assert_eq!(error, DialError::Tls(TlsFailure::NotTls));
    assert!(error.to_string().contains("ws://"), "{error}");
    assert!(fleet.gateway().fleet.views().is_empty());
    fleet.stop().await;
}
