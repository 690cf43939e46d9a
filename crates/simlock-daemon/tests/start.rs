//! A start that fails leaves its home as it found it: no socket and no admin secret of its own,
//! and a daemon already serving the home keeps both.

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    reason = "tests fail by panicking"
)]

use simlock_contract::model::Mode;
use simlock_daemon::config::DaemonConfig;
use simlock_daemon::home::Home;
use simlock_daemon::runtime::{Base, Listen, StartError};

fn base(home: &Home, port: u16) -> Base {
    let mut config = DaemonConfig::default();
    config.http.port = port;
    Base::open(home.clone(), config, Mode::Worker, "test".into(), None).unwrap()
}

#[tokio::test]
async fn a_start_whose_http_port_is_taken_leaves_no_socket_and_no_admin_secret() {
    let dir = tempfile::tempdir().unwrap();
    let home = Home::at(dir.path().join("home"));
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = taken.local_addr().unwrap().port();
    let base = base(&home, port);
    let router = base.router();
    let err = base
        .serve(router, Listen::SocketAndHttp, Vec::new())
        .await
        .unwrap_err();
    assert!(matches!(err, StartError::Http { .. }), "{err}");
    assert!(!home.socket().exists(), "the socket is removed");
    assert!(!home.admin_token().exists(), "the admin secret is removed");
}

#[tokio::test]
async fn a_second_start_on_a_served_home_keeps_the_first_daemons_socket_and_admin_secret() {
    let dir = tempfile::tempdir().unwrap();
    let home = Home::at(dir.path().join("home"));
    let first = base(&home, 0);
    let router = first.router();
    let running = first
        .serve(router, Listen::SocketOnly, Vec::new())
        .await
        .unwrap();
    let secret = std::fs::read_to_string(home.admin_token()).unwrap();
    let second = base(&home, 0);
    let router = second.router();
    let err = second
        .serve(router, Listen::SocketOnly, Vec::new())
        .await
        .unwrap_err();
    assert!(matches!(err, StartError::Socket(_)), "{err}");
    assert!(home.socket().exists(), "the first daemon's socket");
    assert_eq!(
        std::fs::read_to_string(home.admin_token()).unwrap(),
        secret,
        "the first daemon's admin secret, unchanged"
    );
    running.stop("test").await;
    assert!(!home.socket().exists() && !home.admin_token().exists());
}
