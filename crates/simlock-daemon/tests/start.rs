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
use simlock_daemon::runtime::{Base, Listen, Running, StartError};

/// Starts a daemon with no operations of its own on `home`, HTTP (when `listen` has it) on
/// `port`.
async fn start(home: &Home, port: u16, listen: Listen) -> Result<Running, StartError> {
    let mut config = DaemonConfig::default();
    config.http.port = port;
    let base = Base::open(home.clone(), config, Mode::Worker, "test".into(), None).unwrap();
    let router = base.router();
    base.serve(router, listen, Vec::new()).await
}

#[tokio::test]
async fn a_start_whose_http_port_is_taken_leaves_no_socket_and_no_admin_secret() {
    let dir = tempfile::tempdir().unwrap();
    let home = Home::at(dir.path().join("home"));
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = taken.local_addr().unwrap().port();
    let err = start(&home, port, Listen::SocketAndHttp).await.unwrap_err();
    assert!(matches!(err, StartError::Http { .. }), "{err}");
    assert!(!home.socket().exists(), "the socket is removed");
    assert!(!home.admin_token().exists(), "the admin secret is removed");
}

#[tokio::test]
async fn a_second_start_on_a_served_home_keeps_the_first_daemons_socket_and_admin_secret() {
    let dir = tempfile::tempdir().unwrap();
    let home = Home::at(dir.path().join("home"));
    let running = start(&home, 0, Listen::SocketOnly).await.unwrap();
    let secret = std::fs::read_to_string(home.admin_token()).unwrap();
    let err = start(&home, 0, Listen::SocketOnly).await.unwrap_err();
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

#[tokio::test]
async fn a_home_is_one_kind_of_daemons_and_the_other_kind_is_refused_there() {
    let dir = tempfile::tempdir().unwrap();
    let home = Home::at(dir.path().join("home"));
    let open = |mode| {
        Base::open(
            home.clone(),
            DaemonConfig::default(),
            mode,
            "test".into(),
            None,
        )
    };
    let worker = open(Mode::Worker).unwrap();
    let id = worker.instance_id.clone();
    drop(worker);
    let Err(err) = open(Mode::Gateway) else {
        panic!("a gateway started on a worker's home");
    };
    assert!(matches!(err, StartError::HomeOfAnother { .. }), "{err}");
    assert_eq!(
        err.to_string(),
        format!(
            "home {} belongs to a worker (its state.db holds a worker's state); a gateway needs a home of its own: pass --home with another directory",
            home.root().display()
        )
    );
    // The worker starts there again, as itself.
    assert_eq!(open(Mode::Worker).unwrap().instance_id, id);
    // And the other way round.
    let other = Home::at(dir.path().join("gateway"));
    Base::open(
        other.clone(),
        DaemonConfig::default(),
        Mode::Gateway,
        "t".into(),
        None,
    )
    .unwrap();
    let Err(err) = Base::open(
        other,
        DaemonConfig::default(),
        Mode::Worker,
        "t".into(),
        None,
    ) else {
        panic!("a worker started on a gateway's home");
    };
    assert!(err.to_string().contains("belongs to a gateway"), "{err}");
}

/// Trial 19: a state store the daemon cannot use (here a file that is no database; a full disk
/// answers the same way) refuses the start naming the file.
#[test]
fn a_state_store_that_cannot_be_used_refuses_the_start_naming_its_file() {
    let dir = tempfile::tempdir().unwrap();
    let home = Home::at(dir.path().join("home"));
    std::fs::create_dir_all(home.root()).unwrap();
    std::fs::write(home.database(), vec![0x5a_u8; 8192]).unwrap();
    let Err(err) = Base::open(
        home.clone(),
        DaemonConfig::default(),
        Mode::Worker,
        "test".into(),
        None,
    ) else {
        panic!("a daemon started on a file that is no database");
    };
    assert!(matches!(err, StartError::Database { .. }), "{err}");
    let said = err.to_string();
    assert!(
        said.starts_with(&format!(
            "cannot use the state store {}: state store: ",
            home.database().display()
        )),
        "{said}"
    );
}
