//! A worker's live capabilities reach its gateway as they change (`capability.changed`), not at
//! the gateway's next periodic read: a real gateway whose periodic read is an hour away, and a
//! real worker whose agent-device daemon starts late or goes down.

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    reason = "tests fail by panicking"
)]

use std::path::Path;
use std::time::Duration;

use agent_device_fake::{FakeAgentDevice, FakeOptions};
use agent_device_host::process::Endpoint;
use serde_json::json;
use simlock_contract::Push;
use simlock_contract::model::{CapabilityStatus, EventEnvelope};
use simlock_e2e::{PATIENCE, Session, TestFleet, gateway_config, worker_config};
use simlock_worker::WorkerConfig;

/// Long enough that no periodic read happens during a test: only an event explains a change.
const NO_PERIODIC_READ: Duration = Duration::from_secs(3600);

async fn gateway() -> TestFleet {
    let mut config = gateway_config();
    config.agent_device.enabled = true;
    TestFleet::start_with(config, |timing| timing.refresh_interval = NO_PERIODIC_READ).await
}

/// A worker serving agent-device with `command` (ignored when a daemon is attached).
fn worker(command: Vec<String>) -> WorkerConfig {
    let mut config = worker_config(2);
    config.agent_device.enabled = true;
    config.agent_device.command = Some(command);
    config
}

/// An operator session on the gateway subscribed to its events (its workers' included).
async fn subscriber(fleet: &TestFleet) -> Session {
    let operator = fleet.operator().await;
    let answer = operator.call("events.subscribe", json!({})).await.unwrap();
    assert_eq!(answer["subscribed"], true);
    operator
}

/// The next `capability.changed` the gateway relays from worker `worker_id`.
async fn capability_changed(subscriber: &mut Session, worker_id: &str) -> EventEnvelope {
    loop {
        let frame = tokio::time::timeout(PATIENCE, subscriber.pushes.recv())
            .await
            .expect("capability.changed was relayed in time")
            .expect("the session is open");
        if let Ok(Push::Event {
            event: envelope, ..
        }) = Push::from_frame(frame)
            && envelope.event == "capability.changed"
            && envelope.payload["workerId"] == worker_id
        {
            return envelope;
        }
    }
}

/// Waits until the gateway counts worker `n` among those that can take an agent-device lease,
/// or not.
async fn wait_capable(fleet: &TestFleet, n: usize, capable: bool) {
    let id = fleet.worker_id(n);
    fleet
        .wait_until(|fleet| {
            fleet
                .capable_workers(agent_device_front::CAPABILITY)
                .iter()
                .any(|w| w.id == id)
                == capable
        })
        .await;
}

/// What the gateway's view of worker `n` says of its agent-device capability.
fn listed(fleet: &TestFleet, n: usize) -> Option<CapabilityStatus> {
    let id = fleet.worker_id(n);
    fleet
        .gateway()
        .fleet
        .views()
        .into_iter()
        .find(|v| v.id == id)?
        .capabilities?
        .into_iter()
        .find(|c| c.name == agent_device_front::CAPABILITY)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_workers_agent_device_going_down_takes_it_out_of_the_capable_workers_at_once() {
    let mut fleet = gateway().await;
    let fake = FakeAgentDevice::start(FakeOptions::default()).unwrap();
    let endpoint = Endpoint {
        port: fake.port(),
        token: fake.token().to_owned(),
    };
    let command = vec!["agent-device-attached".to_owned()];
    fleet
        .join_worker(
            0,
            worker(command),
            |options| options.agent_device_attach = Some(endpoint),
            true,
        )
        .await;
    let worker_id = fleet.worker_id(0);
    wait_capable(&fleet, 0, true).await;
    let mut events = subscriber(&fleet).await;

    // Its daemon goes down.
    fleet
        .worker(0)
        .agent_device
        .as_ref()
        .unwrap()
        .host
        .stop()
        .await;
    let changed = capability_changed(&mut events, &worker_id).await;
    assert_eq!(changed.module, "capabilities");
    assert_eq!(
        changed.payload,
        json!({"name": "agent-device", "available": false,
            "reason": "the agent-device daemon is stopped", "workerId": worker_id})
    );
    wait_capable(&fleet, 0, false).await;
    assert_eq!(
        listed(&fleet, 0),
        Some(CapabilityStatus {
            name: "agent-device".into(),
            available: false,
            reason: Some("the agent-device daemon is stopped".into()),
        }),
        "the view says why"
    );

    fleet.stop().await;
    fake.stop().await;
}

/// A daemon command that starts only once something is written to the FIFO `$SIMLOCK_GATE`,
/// then says it serves at `$FAKE_PORT` with `$FAKE_TOKEN` (an in-process fake's), and idles
/// until it is stopped.
fn gated_daemon() -> Vec<String> {
    let script = r#"read line < "$SIMLOCK_GATE"
printf '{"token":"%s","httpPort":%s}' "$FAKE_TOKEN" "$FAKE_PORT" > "$AGENT_DEVICE_STATE_DIR/daemon.json"
echo "AGENT_DEVICE_DAEMON_HTTP_PORT=$FAKE_PORT"
exec tail -f /dev/null"#;
    vec!["sh".into(), "-c".into(), script.into()]
}

fn mkfifo(path: &Path) {
    let made = std::process::Command::new("mkfifo")
        .arg(path)
        .status()
        .expect("mkfifo runs");
    assert!(made.success(), "mkfifo {}", path.display());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_that_joins_while_its_agent_device_starts_is_capable_once_it_started() {
    let mut fleet = gateway().await;
    let fake = FakeAgentDevice::start(FakeOptions::default()).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let gate = dir.path().join("gate");
    mkfifo(&gate);
    let env = vec![
        ("SIMLOCK_GATE".to_owned(), gate.display().to_string()),
        ("FAKE_PORT".to_owned(), fake.port().to_string()),
        ("FAKE_TOKEN".to_owned(), fake.token().to_owned()),
    ];
    fleet
        .join_worker(
            0,
            worker(gated_daemon()),
            |options| options.agent_device_env = env,
            true,
        )
        .await;
    let worker_id = fleet.worker_id(0);
    // The gateway read the worker in full while its daemon was starting.
    assert_eq!(
        listed(&fleet, 0).map(|c| c.available),
        Some(false),
        "{:?}",
        listed(&fleet, 0)
    );
    wait_capable(&fleet, 0, false).await;
    let mut events = subscriber(&fleet).await;

    // The daemon starts.
    tokio::time::timeout(PATIENCE, tokio::fs::write(&gate, b"go\n"))
        .await
        .expect("the daemon read its gate in time")
        .unwrap();
    let changed = capability_changed(&mut events, &worker_id).await;
    assert_eq!(
        changed.payload,
        json!({"name": "agent-device", "available": true, "workerId": worker_id})
    );
    wait_capable(&fleet, 0, true).await;
    assert_eq!(
        listed(&fleet, 0),
        Some(CapabilityStatus {
            name: "agent-device".into(),
            available: true,
            reason: None,
        })
    );

    fleet.stop().await;
    fake.stop().await;
}
