//! agent-device through a gateway (seed 003): a real gateway and real workers over real
//! uplinks, HTTP into the gateway's `/v1/agent-device`, an in-process fake agent-device per
//! worker.

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    reason = "tests"
)]

use std::sync::Arc;
use std::sync::atomic::{AtomicI64, Ordering};
use std::time::Duration;

use agent_device_fake::{
    DaemonError, Device, DevicesAnswer, ErrorCode, FakeAgentDevice, FakeOptions,
};
use http::Method;
use serde_json::{Value, json};
use simlock_contract::model::Platform;
use simlock_daemon::clock::{Clock, SharedClock, TokioClock};
use simlock_e2e::agent_device::{
    Http, callers_heartbeats, callers_requests, received, rpc_call, stopping_message,
    ticket_headers,
};
use simlock_e2e::{PATIENCE, TestFleet, gateway_config, worker_config};
use simlock_gateway::GatewayConfig;
use simlock_worker::WorkerConfig;

/// A clock the test moves by hand on top of tokio's.
#[derive(Debug)]
struct Shifted {
    base: TokioClock,
    offset_ms: AtomicI64,
}

impl Clock for Shifted {
    fn now_ms(&self) -> i64 {
        self.base.now_ms() + self.offset_ms.load(Ordering::SeqCst)
    }
}

struct Gw {
    fleet: TestFleet,
    fakes: Vec<FakeAgentDevice>,
    clock: Arc<Shifted>,
}

fn enabled_gateway() -> GatewayConfig {
    let mut config = gateway_config();
    config.agent_device.enabled = true;
    config
}

/// A worker configuration: agent-device on (served by an attached fake) or off; only the
/// platforms named in its virtual catalog.
fn worker(agent_device: bool, platforms: &[Platform]) -> WorkerConfig {
    let mut config = worker_config(4);
    config.agent_device.enabled = agent_device;
    config.agent_device.command = Some(vec!["agent-device-attached".into()]);
    config
        .core
        .virtual_devices
        .models
        .retain(|m| platforms.contains(&m.platform));
    config
}

impl Gw {
    async fn start(config: GatewayConfig) -> Self {
        Self::start_tuned(config, |_| {}).await
    }

    /// Adds a capable worker with Android devices whose uplink runs through a cable the test
    /// can cut, and answers the cable.
    async fn add_android_worker_via_cable(&mut self) -> Cable {
        let cable = Cable::to(self.fleet.gateway().running.http_addr().unwrap()).await;
        let n = self
            .add_via(worker(true, &[Platform::Android]), Some(&cable))
            .await;
        self.wait_capable(n, true).await;
        cable
    }

    /// A gateway with agent-device on and one capable worker with Android devices.
    async fn one_android_worker() -> Self {
        let mut gw = Self::start(enabled_gateway()).await;
        gw.add(worker(true, &[Platform::Android])).await;
        gw.wait_capable(0, true).await;
        gw
    }

    async fn start_tuned(
        config: GatewayConfig,
        tune: impl FnOnce(&mut simlock_fleet::FleetTiming),
    ) -> Self {
        Self::start_customized(config, tune, |_| {}).await
    }

    async fn start_customized(
        config: GatewayConfig,
        tune: impl FnOnce(&mut simlock_fleet::FleetTiming),
        customize: impl FnOnce(&mut simlock_gateway::GatewayOptions),
    ) -> Self {
        let clock = Arc::new(Shifted {
            base: TokioClock::system(),
            offset_ms: AtomicI64::new(0),
        });
        let shared: SharedClock = clock.clone();
        let fleet = TestFleet::start_customized(config, tune, |options| {
            options.agent_device_clock = Some(shared);
            customize(options);
        })
        .await;
        Self {
            fleet,
            fakes: Vec::new(),
            clock,
        }
    }

    /// Adds worker `n` with `config`, its agent-device an in-process fake (when enabled).
    async fn add(&mut self, config: WorkerConfig) -> usize {
        self.add_via(config, None).await
    }

    /// As [`Self::add`], the worker's uplink dialled through `cable` when given.
    async fn add_via(&mut self, config: WorkerConfig, cable: Option<&Cable>) -> usize {
        let n = self.fleet.workers.len();
        let fake = FakeAgentDevice::start(FakeOptions::default()).unwrap();
        let endpoint = agent_device_host::process::Endpoint {
            port: fake.port(),
            token: fake.token().to_owned(),
        };
        let url = cable.map(|c| format!("ws://{}", c.addr));
        self.fleet
            .join_worker(
                n,
                config,
                |options| {
                    options.agent_device_attach = Some(endpoint);
                    if let Some(url) = url {
                        options.config.daemon.gateway.url = Some(url);
                    }
                },
                true,
            )
            .await;
        self.fakes.push(fake);
        n
    }

    /// Waits until the gateway lists worker `n` as `connection`.
    async fn wait_connection(&self, n: usize, connection: simlock_contract::model::Connection) {
        let id = self.fleet.worker_id(n);
        self.fleet
            .wait_for(|views| {
                views
                    .iter()
                    .any(|v| v.id == id && v.connection == connection)
            })
            .await;
    }

    fn base(&self) -> String {
        format!(
            "http://{}/v1/agent-device",
            self.fleet.gateway().running.http_addr().unwrap()
        )
    }

    async fn token(&self) -> (String, String) {
        let created = self
            .fleet
            .operator()
            .await
            .call("token.create", json!({"role": "agent", "label": "e2e"}))
            .await
            .unwrap();
        (
            created["token"]["id"].as_str().unwrap().to_owned(),
            created["secret"].as_str().unwrap().to_owned(),
        )
    }

    async fn leases(&self) -> Vec<Value> {
        let listed = self
            .fleet
            .operator()
            .await
            .call("lease.list", json!({}))
            .await
            .unwrap();
        listed["leases"].as_array().cloned().unwrap_or_default()
    }

    /// Waits until the gateway sees worker `n` capable of agent-device, or not.
    async fn wait_capable(&self, n: usize, capable: bool) {
        let id = self.fleet.worker_id(n);
        self.fleet
            .wait_until(|fleet| {
                fleet
                    .capable_workers(agent_device_front::CAPABILITY)
                    .iter()
                    .any(|w| w.id == id)
                    == capable
            })
            .await;
    }

    async fn stop(self) {
        self.fleet.stop().await;
        for fake in self.fakes {
            fake.stop().await;
        }
    }
}

fn allocate_call(id: &str, backend: &str, device: Option<&str>) -> Value {
    let mut params =
        json!({"session": "s1", "tenantId": "acme", "runId": "run1", "backend": backend});
    if let Some(device) = device {
        params["device"] = json!(device);
    }
    rpc_call(id, "lease.allocate", params)
}

fn command_call(id: &str, lease: &str, command: &str, flags: Value) -> Value {
    let mut all = json!({"leaseId": lease, "runId": "run1", "tenant": "acme"});
    if let (Some(into), Some(extra)) = (all.as_object_mut(), flags.as_object()) {
        into.extend(extra.clone());
    }
    rpc_call(
        id,
        "command",
        json!({"session": "s1", "command": command, "positionals": [], "flags": all,
            "meta": {"leaseId": lease, "runId": "run1", "tenantId": "acme", "requestId": id}}),
    )
}

fn lease_call(id: &str, method: &str, lease: &str) -> Value {
    rpc_call(
        id,
        method,
        json!({"session": "s1", "tenantId": "acme", "runId": "run1", "leaseId": lease}),
    )
}

fn message(answer: &simlock_e2e::agent_device::Answer) -> String {
    let body = answer.json();
    body["error"]["data"]["message"]
        .as_str()
        .or_else(|| body["error"].as_str())
        .unwrap_or_default()
        .to_owned()
}

async fn allocate(http: &Http, gw: &Gw, token: &str) -> String {
    let answer = http
        .rpc(
            &gw.base(),
            token,
            &allocate_call("a1", "android-instance", None),
        )
        .await;
    assert_eq!(answer.status, 200, "{answer:?}");
    answer.json()["result"]["data"]["lease"]["leaseId"]
        .as_str()
        .unwrap()
        .to_owned()
}

fn rpcs(fake: &FakeAgentDevice) -> usize {
    fake.requests().iter().filter(|r| r.path == "/rpc").count()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_agent_device_off_on_the_gateway_every_route_answers_404() {
    let mut gw = Gw::start(gateway_config()).await;
    gw.add(worker(true, &[Platform::Android])).await;
    let (_, secret) = gw.token().await;
    let bearer = format!("Bearer {secret}");
    for (method, route) in [
        (Method::GET, "health"),
        (Method::POST, "rpc"),
        (Method::POST, "upload/preflight"),
        (Method::GET, "artifacts/a1"),
        (Method::GET, "sessions/s/requests/r/diagnostics"),
    ] {
        let answer = Http::new()
            .send(
                method,
                &format!("{}/{route}", gw.base()),
                &[("authorization", &bearer)],
                "",
            )
            .await;
        assert_eq!(answer.status, 404, "{route}");
    }
    gw.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn health_is_the_proxys_when_a_worker_is_capable_and_a_200_not_available_when_none_is() {
    let mut gw = Gw::start(enabled_gateway()).await;
    let http = Http::new();
    let health = || async {
        http.send(Method::GET, &format!("{}/health", gw.base()), &[], "")
            .await
    };
    let none = health().await;
    assert_eq!(none.status, 200);
    assert_eq!(
        none.json()["error"],
        json!(
            "agent-device is not available on this simlock: no worker connected to this gateway can serve agent-device"
        )
    );
    gw.add(worker(true, &[Platform::Android])).await;
    gw.wait_capable(0, true).await;
    let up = http
        .send(Method::GET, &format!("{}/health", gw.base()), &[], "")
        .await;
    assert_eq!(up.status, 200);
    assert_eq!(
        up.json()["upstream"]["service"],
        json!("agent-device-daemon"),
        "{up:?}"
    );
    // The worker's agent-device goes away while the gateway still counts it capable: the
    // relayed health fails, and the front answers why, with 200.
    gw.fleet
        .worker(0)
        .agent_device
        .as_ref()
        .unwrap()
        .host
        .stop()
        .await;
    let failed = http
        .send(Method::GET, &format!("{}/health", gw.base()), &[], "")
        .await;
    assert_eq!(failed.status, 200);
    assert!(
        failed.json()["error"]
            .as_str()
            .unwrap()
            .starts_with("agent-device is not available on this simlock: "),
        "{failed:?}"
    );
    gw.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn allocates_land_on_the_capable_worker_for_the_token_with_the_clis_lease_id() {
    let mut gw = Gw::start(enabled_gateway()).await;
    gw.add(worker(false, &[Platform::Android])).await;
    gw.add(worker(true, &[Platform::Android])).await;
    gw.wait_capable(1, true).await;
    let (principal, secret) = gw.token().await;
    let http = Http::new();
    let capable = gw.fleet.worker_id(1);
    let gateway_id = gw.fleet.gateway().fleet.gateway_id().to_owned();
    for round in 0..5 {
        let lease = allocate(&http, &gw, &secret).await;
        let leases = gw.leases().await;
        let record = leases.iter().find(|l| l["id"] == lease).expect("indexed");
        assert_eq!(record["workerId"], json!(capable), "round {round}");
        assert_eq!(record["ownerId"], json!(principal));
        assert_eq!(record["requesterId"], json!(lease));
        // On the worker: the same id, the gateway's requester, and agent-device's allocate
        // named the device with the worker's ceiling under the gateway's tenant.
        let on_worker = gw
            .fleet
            .worker(1)
            .worker
            .lease(&lease)
            .expect("on the worker");
        assert_eq!(on_worker.requester_id, format!("gw:{gateway_id}:{lease}"));
        let allocated = received(&gw.fakes[1], "agent_device.lease.allocate");
        let last = allocated.last().unwrap();
        assert_eq!(last["params"]["ttlMs"], json!(600_000));
        assert_eq!(
            last["params"]["tenantId"],
            json!(agent_device_front::Tenant::through_gateway(&gateway_id, &principal).as_str())
        );
        let device = on_worker.device_id;
        let driver = gw
            .fleet
            .worker(1)
            .worker
            .devices()
            .into_iter()
            .find(|d| d.id == device)
            .unwrap()
            .driver_device_id;
        assert_eq!(
            last["params"]["deviceKey"],
            json!(format!("local:android:none:{driver}"))
        );
        let release = lease_call("r1", "lease.release", &lease);
        let released = http.rpc(&gw.base(), &secret, &release).await;
        assert_eq!(released.json()["result"]["ok"], json!(true), "{released:?}");
    }
    assert_eq!(rpcs(&gw.fakes[0]), 0, "the incapable worker got nothing");
    gw.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_allocate_that_cannot_be_served_is_refused_with_the_seeds_reasons_and_leases_nothing() {
    let mut gw = Gw::start(enabled_gateway()).await;
    let (_, secret) = gw.token().await;
    let http = Http::new();
    let none = http
        .rpc(
            &gw.base(),
            &secret,
            &allocate_call("a0", "android-instance", None),
        )
        .await;
    assert_eq!(
        message(&none),
        "agent-device is not available on this simlock: no worker connected to this gateway can serve agent-device"
    );
    // An incapable worker that knows "Pixel 9"; a capable one with Android but no Pixel 9.
    let mut knows = worker(false, &[Platform::Android]);
    knows
        .core
        .virtual_devices
        .models
        .retain(|m| m.name == "Pixel 9");
    gw.add(knows).await;
    let mut capable = worker(true, &[Platform::Android]);
    capable
        .core
        .virtual_devices
        .models
        .retain(|m| m.name == "Pixel 8");
    gw.add(capable).await;
    gw.wait_capable(1, true).await;
    let ios = http
        .rpc(
            &gw.base(),
            &secret,
            &allocate_call("a1", "ios-simulator", None),
        )
        .await;
    assert_eq!(
        message(&ios),
        "refused: ios is not available on this simlock"
    );
    let model = http
        .rpc(
            &gw.base(),
            &secret,
            &allocate_call("a2", "android-instance", Some("Pixel 9")),
        )
        .await;
    assert_eq!(
        message(&model),
        "refused by simlock: No worker connected to this gateway can serve agent-device for this request"
    );
    assert!(gw.leases().await.is_empty(), "nothing was leased");
    assert!(received(&gw.fakes[1], "agent_device.lease.allocate").is_empty());
    gw.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn commands_heartbeats_and_releases_go_to_the_leases_worker_in_the_seeds_order() {
    let gw = Gw::one_android_worker().await;
    let (principal, secret) = gw.token().await;
    let http = Http::new();
    let lease = allocate(&http, &gw, &secret).await;
    let gateway_id = gw.fleet.gateway().fleet.gateway_id().to_owned();
    let tenant = agent_device_front::Tenant::through_gateway(&gateway_id, &principal);
    // A command: the prefixed tenant, and agent-device's reply unchanged.
    let driver = gw.fleet.worker(0).worker.devices()[0]
        .driver_device_id
        .clone();
    gw.fakes[0].set_devices(DevicesAnswer::List(vec![Device {
        platform: agent_device_fake::Platform::Android,
        id: driver.clone(),
        name: "emulator".into(),
        kind: agent_device_fake::DeviceKind::Emulator,
        target: agent_device_fake::DeviceTarget::Mobile,
        booted: true,
    }]));
    let opened = http
        .rpc(
            &gw.base(),
            &secret,
            &command_call("c1", &lease, "open", json!({})),
        )
        .await;
    assert_eq!(opened.json()["result"]["ok"], json!(true), "{opened:?}");
    let sent = received(&gw.fakes[0], "agent_device.command");
    assert_eq!(
        sent[0]["params"]["meta"]["tenantId"],
        json!(tenant.as_str())
    );
    assert_eq!(sent[0]["params"]["flags"]["serial"], json!(driver));
    // A heartbeat: agent-device first, then the simlock lease renewed to now plus the TTL.
    let before = gw.leases().await[0]["ttlDeadline"].as_i64().unwrap();
    tokio::time::sleep(Duration::from_millis(5)).await;
    let beat = http
        .rpc(
            &gw.base(),
            &secret,
            &lease_call("h1", "lease.heartbeat", &lease),
        )
        .await;
    assert_eq!(beat.json()["result"]["ok"], json!(true), "{beat:?}");
    assert_eq!(callers_heartbeats(&gw.fakes[0]), 1);
    let renewed = gw.fleet.worker(0).worker.lease(&lease).unwrap();
    assert!(renewed.ttl_deadline > before);
    assert_eq!(renewed.ttl_deadline, renewed.last_renewed_at + 600_000);
    // A release agent-device fails keeps the simlock lease; one that works ends both, and the
    // device is reclaimed.
    gw.fakes[0].fail_next_releases(1, DaemonError::new(ErrorCode::CommandFailed, "not now"));
    let failed = http
        .rpc(
            &gw.base(),
            &secret,
            &lease_call("r1", "lease.release", &lease),
        )
        .await;
    assert_eq!(message(&failed), "not now");
    assert_eq!(gw.leases().await.len(), 1);
    let mut events = gw.fleet.worker(0).running.base.bus.follow();
    let released = http
        .rpc(
            &gw.base(),
            &secret,
            &lease_call("r2", "lease.release", &lease),
        )
        .await;
    assert_eq!(released.json()["result"]["ok"], json!(true), "{released:?}");
    assert!(gw.leases().await.is_empty());
    loop {
        let event = tokio::time::timeout(PATIENCE, events.recv())
            .await
            .unwrap()
            .unwrap();
        if event.event == "device.reclaimed" {
            break;
        }
    }
    gw.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn another_tokens_lease_or_an_unknown_one_is_not_yours_and_no_worker_receives_it() {
    let gw = Gw::one_android_worker().await;
    let (_, alice) = gw.token().await;
    let (_, bob) = gw.token().await;
    let http = Http::new();
    let lease = allocate(&http, &gw, &alice).await;
    let seen = rpcs(&gw.fakes[0]);
    let unknown = "f".repeat(32);
    for (token, named) in [(&bob, lease.as_str()), (&alice, unknown.as_str())] {
        let refused = http
            .rpc(
                &gw.base(),
                token,
                &command_call("c1", named, "snapshot", json!({})),
            )
            .await;
        assert_eq!(refused.status, 403);
        assert_eq!(
            message(&refused),
            format!("refused: lease {named} is not one of yours on this gateway")
        );
    }
    let udid = http
        .rpc(
            &gw.base(),
            &bob,
            &command_call("c2", &lease, "snapshot", json!({"udid": "X"})),
        )
        .await;
    assert_eq!(message(&udid), "refused: simlock picks the device");
    assert_eq!(rpcs(&gw.fakes[0]), seen, "no worker received any of them");
    // A request that names no lease (other than /health) is refused as too old.
    let bare = rpc_call(
        "c3",
        "command",
        json!({"session": "s", "command": "snapshot"}),
    );
    let old = http.rpc(&gw.base(), &alice, &bare).await;
    assert_eq!(
        message(&old),
        "refused: this agent-device is too old to use through a gateway; update it"
    );
    gw.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn after_release_all_agent_device_ends_first_and_the_memory_routes_until_max_ttl_past_the_removal()
 {
    let mut config = enabled_gateway();
    config.daemon.lease.default_ttl_ms = 60_000;
    config.daemon.lease.max_ttl_ms = 600_000;
    let mut gw = Gw::start(config).await;
    gw.add(worker(true, &[Platform::Android])).await;
    gw.wait_capable(0, true).await;
    let (_, secret) = gw.token().await;
    let http = Http::new();
    let lease = allocate(&http, &gw, &secret).await;
    let hold = gw.fakes[0].hold_commands("lease_release");
    gw.fleet
        .operator()
        .await
        .call("lease.release-all", json!({}))
        .await
        .unwrap();
    tokio::time::timeout(PATIENCE, hold.wait_entered(1))
        .await
        .unwrap();
    let devices = gw.fleet.worker(0).worker.devices();
    assert_eq!(
        devices[0].state,
        simlock_contract::model::DeviceState::Reclaiming,
        "agent-device's release comes before the wipe"
    );
    hold.release();
    gw.fleet
        .wait_until(|fleet| fleet.lease(&lease).is_none())
        .await;
    // The next heartbeat reaches the worker, whose agent-device says the lease is gone.
    let beat = http
        .rpc(
            &gw.base(),
            &secret,
            &lease_call("h1", "lease.heartbeat", &lease),
        )
        .await;
    assert_eq!(
        beat.json()["error"]["data"]["details"]["reason"],
        json!("LEASE_ENDED_BY_HOST"),
        "{beat:?}"
    );
    // The link still routes it until the gateway's lease.maxTtlMs has passed since the
    // removal; a second before, a heartbeat is relayed; a second after, it is not one of yours.
    let relayed = rpcs(&gw.fakes[0]);
    gw.clock.offset_ms.store(600_000 - 1_000, Ordering::SeqCst);
    let again = http
        .rpc(
            &gw.base(),
            &secret,
            &lease_call("h2", "lease.heartbeat", &lease),
        )
        .await;
    assert_ne!(again.status, 403, "still routed: {again:?}");
    assert_eq!(rpcs(&gw.fakes[0]), relayed + 1, "relayed to the worker");
    gw.clock.offset_ms.store(600_000 + 1_000, Ordering::SeqCst);
    let gone = http
        .rpc(
            &gw.base(),
            &secret,
            &lease_call("h3", "lease.heartbeat", &lease),
        )
        .await;
    assert_eq!(gone.status, 403);
    assert_eq!(
        message(&gone),
        format!("refused: lease {lease} is not one of yours on this gateway")
    );
    gw.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_drained_only_capable_worker_takes_no_allocate_but_serves_the_lease_it_holds() {
    let gw = Gw::one_android_worker().await;
    let (_, secret) = gw.token().await;
    let http = Http::new();
    let lease = allocate(&http, &gw, &secret).await;
    let id = gw.fleet.worker_id(0);
    gw.fleet
        .operator()
        .await
        .call("worker.drain", json!({"workerId": id}))
        .await
        .unwrap();
    gw.wait_capable(0, false).await;
    let refused = http
        .rpc(
            &gw.base(),
            &secret,
            &allocate_call("a2", "android-instance", None),
        )
        .await;
    assert!(
        message(&refused).starts_with("agent-device is not available on this simlock"),
        "{refused:?}"
    );
    let beat = http
        .rpc(
            &gw.base(),
            &secret,
            &lease_call("h1", "lease.heartbeat", &lease),
        )
        .await;
    assert_eq!(beat.json()["result"]["ok"], json!(true), "{beat:?}");
    gw.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_whose_agent_device_went_down_unseen_answers_its_reason_and_the_lease_is_released()
{
    let mut gw = Gw::one_android_worker().await;
    let (_, secret) = gw.token().await;
    // The daemon itself goes away; its worker still reports agent-device available.
    let fake = gw.fakes.remove(0);
    fake.stop().await;
    let answer = Http::new()
        .rpc(
            &gw.base(),
            &secret,
            &allocate_call("a1", "android-instance", None),
        )
        .await;
    assert!(
        message(&answer).starts_with(
            "agent-device is not available on this simlock: the agent-device daemon did not answer"
        ),
        "the worker's own reason: {answer:?}"
    );
    gw.fleet.wait_until(|fleet| fleet.lease_count() == 0).await;
    gw.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_heartbeat_for_a_lease_whose_worker_stopped_being_capable_answers_not_available() {
    let mut gw = Gw::start_tuned(enabled_gateway(), |t| {
        t.refresh_interval = Duration::from_millis(100);
    })
    .await;
    gw.add(worker(true, &[Platform::Android])).await;
    gw.wait_capable(0, true).await;
    let (_, secret) = gw.token().await;
    let http = Http::new();
    let lease = allocate(&http, &gw, &secret).await;
    gw.fleet
        .worker(0)
        .agent_device
        .as_ref()
        .unwrap()
        .host
        .stop()
        .await;
    let id = gw.fleet.worker_id(0);
    gw.fleet
        .wait_for(|views| {
            views.iter().any(|v| {
                v.id == id
                    && v.capabilities.as_ref().is_some_and(|caps| {
                        caps.iter()
                            .any(|c| c.name == "agent-device" && !c.available)
                    })
            })
        })
        .await;
    let beat = http
        .rpc(
            &gw.base(),
            &secret,
            &lease_call("h1", "lease.heartbeat", &lease),
        )
        .await;
    assert_eq!(
        message(&beat),
        "agent-device is not available on this simlock: the worker holding this lease cannot serve agent-device"
    );
    assert_eq!(gw.leases().await.len(), 1, "the lease stays");
    gw.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_relay_to_a_worker_without_the_target_answers_not_available_with_its_message() {
    let mut gw = Gw::start(enabled_gateway()).await;
    // The worker claims the capability but runs no agent-device host (its config loader refuses
    // that now; a worker of another build, or one composed by hand, may still).
    let mut config = worker(false, &[Platform::Android]);
    config.daemon.capabilities = vec!["agent-device".into()];
    gw.add(config).await;
    gw.wait_capable(0, true).await;
    let (_, secret) = gw.token().await;
    let answer = Http::new()
        .rpc(
            &gw.base(),
            &secret,
            &allocate_call("a1", "android-instance", None),
        )
        .await;
    let text = message(&answer);
    assert!(
        text.starts_with("agent-device is not available on this simlock: ")
            && text.contains("agent-device"),
        "{answer:?}"
    );
    gw.fleet.wait_until(|fleet| fleet.lease_count() == 0).await;
    gw.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_gateways_lease_ttl_cap_caps_the_ttl_of_its_leases() {
    let mut config = enabled_gateway();
    config.agent_device.lease_ttl_cap_ms = Some(120_000);
    let mut gw = Gw::start(config).await;
    gw.add(worker(true, &[Platform::Android])).await;
    gw.wait_capable(0, true).await;
    let (_, secret) = gw.token().await;
    let lease = allocate(&Http::new(), &gw, &secret).await;
    assert_eq!(
        gw.fleet.worker(0).worker.lease(&lease).unwrap().ttl_ms,
        120_000
    );
    let allocated = received(&gw.fakes[0], "agent_device.lease.allocate");
    assert_eq!(allocated[0]["params"]["ttlMs"], json!(120_000));
    gw.stop().await;
}

/// The requests waiting anywhere in the fleet, each once: a request the gateway forwarded is
/// both the gateway's waiter and, once the worker's view is read again, the worker's own
/// (requester `gw:<gateway>:<L>`).
fn waiting_requests(fleet: &simlock_fleet::Fleet) -> std::collections::BTreeSet<String> {
    fleet
        .all_waiting(simlock_daemon::Viewer::ADMIN)
        .into_iter()
        .map(|w| {
            w.requester_id
                .rsplit(':')
                .next()
                .unwrap_or_default()
                .to_owned()
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_allocate_waits_for_a_device_a_hung_up_one_leaves_the_queue_and_a_stop_cancels_it() {
    let mut gw = Gw::start(enabled_gateway()).await;
    let mut config = worker(true, &[Platform::Android]);
    config.core.capacity.max_running = 1;
    gw.add(config).await;
    gw.wait_capable(0, true).await;
    let (_, alice) = gw.token().await;
    let (_, bob) = gw.token().await;
    let (_, carol) = gw.token().await;
    let http = Http::new();
    let first = allocate(&http, &gw, &alice).await;
    // The gateway sees the worker full before the others ask, so their requests wait in the
    // gateway's queue, where a hang-up withdraws them. (One the gateway forwarded on a view
    // read before the grant would wait in the worker's queue instead, past the gateway's
    // cancel: it is granted and released at once when its device frees.)
    let id = gw.fleet.worker_id(0);
    gw.fleet
        .wait_for(|views| {
            views.iter().any(|v| {
                v.id == id
                    && v.capacity.as_ref().is_some_and(|c| {
                        let android = c.platform(Platform::Android);
                        android.running >= android.max_running
                    })
            })
        })
        .await;
    let base = gw.base();
    let (b, token) = (base.clone(), bob.clone());
    let bob_waits = tokio::spawn(async move {
        Http::new()
            .rpc(&b, &token, &allocate_call("b1", "android-instance", None))
            .await
    });
    let (b, token) = (base.clone(), carol.clone());
    let carol_waits = tokio::spawn(async move {
        Http::new()
            .rpc(&b, &token, &allocate_call("c1", "android-instance", None))
            .await
    });
    gw.fleet
        .wait_until(|fleet| waiting_requests(fleet).len() == 2)
        .await;
    carol_waits.abort();
    gw.fleet
        .wait_until(|fleet| waiting_requests(fleet).len() == 1)
        .await;
    http.rpc(&base, &alice, &lease_call("r1", "lease.release", &first))
        .await;
    let granted = bob_waits.await.unwrap();
    assert_eq!(granted.json()["result"]["ok"], json!(true), "{granted:?}");
    assert_eq!(gw.leases().await.len(), 1, "Bob's; nothing for Carol");
    // Stopping the gateway while an allocate waits ends its request cancelled.
    let (b, token) = (base.clone(), carol.clone());
    let waits = tokio::spawn(async move {
        Http::new()
            .rpc(&b, &token, &allocate_call("c2", "android-instance", None))
            .await
    });
    gw.fleet
        .wait_until(|fleet| waiting_requests(fleet).len() == 1)
        .await;
    // The gateway stops first (its workers stay up): the front withdraws the waiting request.
    let Gw {
        mut fleet, fakes, ..
    } = gw;
    let gateway = fleet.gateway.take().unwrap();
    let stopping = tokio::spawn(async move { gateway.stop("test").await });
    let answer = waits.await.unwrap();
    assert_eq!(
        answer.json()["error"]["data"]["message"],
        json!(stopping_message()),
        "ended cancelled, not DAEMON_STOPPING: {answer:?}"
    );
    stopping.await.unwrap();
    fleet.stop().await;
    for fake in fakes {
        fake.stop().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_allocate_whose_worker_stopped_being_capable_before_the_forward_releases_its_lease() {
    let mut gw = Gw::start_tuned(enabled_gateway(), |t| {
        t.refresh_interval = Duration::from_millis(100);
    })
    .await;
    let mut config = worker(true, &[Platform::Android]);
    // Long enough a device creation for the gateway to see the worker's agent-device go.
    config.core.virtual_devices.provision_ms = 5_000;
    gw.add(config).await;
    gw.wait_capable(0, true).await;
    let (_, secret) = gw.token().await;
    let (base, token) = (gw.base(), secret.clone());
    let allocating = tokio::spawn(async move {
        Http::new()
            .rpc(
                &base,
                &token,
                &allocate_call("a1", "android-instance", None),
            )
            .await
    });
    let id = gw.fleet.worker_id(0);
    gw.fleet
        .wait_until(|fleet| {
            fleet.view(&id).is_some_and(|v| {
                v.devices.as_ref().is_some_and(|d| {
                    d.iter()
                        .any(|d| d.state == simlock_contract::model::DeviceState::Provisioning)
                })
            })
        })
        .await;
    gw.fleet
        .worker(0)
        .agent_device
        .as_ref()
        .unwrap()
        .host
        .stop()
        .await;
    gw.wait_capable(0, false).await;
    assert!(
        !allocating.is_finished(),
        "the grant came before the view changed"
    );
    let answer = allocating.await.unwrap();
    assert_eq!(
        message(&answer),
        "agent-device is not available on this simlock: the worker holding this lease cannot serve agent-device"
    );
    gw.fleet.wait_until(|fleet| fleet.lease_count() == 0).await;
    assert!(received(&gw.fakes[0], "agent_device.lease.allocate").is_empty());
    gw.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_command_longer_than_the_ttl_renews_through_the_gateway_until_its_front_stops() {
    let mut config = enabled_gateway();
    config.agent_device.lease_ttl_cap_ms = Some(6_000);
    let mut gw = Gw::start(config).await;
    gw.add(worker(true, &[Platform::Android])).await;
    gw.wait_capable(0, true).await;
    let (_, secret) = gw.token().await;
    let lease = allocate(&Http::new(), &gw, &secret).await;
    let hold = gw.fakes[0].hold_commands("snapshot");
    let mut events = gw.fleet.worker(0).running.base.bus.follow();
    let (base, token) = (gw.base(), secret.clone());
    let call = command_call("c1", &lease, "snapshot", json!({}));
    let running = tokio::spawn(async move { Http::new().rpc(&base, &token, &call).await });
    tokio::time::timeout(PATIENCE, hold.wait_entered(1))
        .await
        .unwrap();
    // Two and a half TTLs of the command running: renewals every TTL/3, no expiry.
    let mut renewals = 0;
    let until = tokio::time::Instant::now() + Duration::from_millis(15_000);
    while let Ok(event) = tokio::time::timeout_at(until, events.recv()).await {
        let event = event.unwrap();
        assert_ne!(event.event, "lease.expired", "the lease expired");
        if event.event == "lease.renewed" {
            renewals += 1;
        }
    }
    assert!(
        renewals >= 5,
        "renewed every TTL/3 through the gateway: {renewals}"
    );
    assert!(gw.fleet.worker(0).worker.lease(&lease).is_some());
    // The gateway's front stops (as the gateway's stop does first), the command still held in
    // the daemon and the uplink up: the caller is answered that the gateway is stopping, no
    // renewal follows, and the next word of the lease is its expiry.
    // Followed from before the stop: the worker's keep may land before the stop returns.
    let mut after_stop = gw.fleet.worker(0).running.base.bus.follow();
    gw.fleet
        .gateway()
        .agent_device
        .as_ref()
        .unwrap()
        .stop()
        .await;
    let mut renewed = 0;
    loop {
        let event = tokio::time::timeout(PATIENCE, after_stop.recv())
            .await
            .unwrap()
            .unwrap();
        if event.event == "lease.renewed" {
            renewed += 1;
        }
        if event.event == "lease.expired" {
            break;
        }
    }
    // The worker's keep after the cut exchange (`KeepAsk`), not a renewal every TTL/3 (those
    // would have kept the lease from expiring): once, or twice when a renewal already under
    // way as the stop began landed too.
    assert!(
        (1..=2).contains(&renewed),
        "renewed {renewed} times after the front stopped"
    );
    hold.release();
    let answer = running.await.unwrap();
    assert_eq!(answer.status, 503, "{answer:?}");
    assert_eq!(
        answer.json()["error"]["data"]["message"],
        stopping_message(),
        "{answer:?}"
    );
    gw.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agent_on_the_workers_own_token_never_meets_the_gateway_agents_session() {
    let mut gw = Gw::start(enabled_gateway()).await;
    let mut config = worker(true, &[Platform::Android]);
    config.daemon.http.enabled = Some(true);
    config.daemon.http.port = 0;
    gw.add(config).await;
    gw.wait_capable(0, true).await;
    let (gateway_principal, gateway_agent) = gw.token().await;
    let http = Http::new();
    let lease = allocate(&http, &gw, &gateway_agent).await;
    let driver = gw.fleet.worker(0).worker.devices()[0]
        .driver_device_id
        .clone();
    gw.fakes[0].set_devices(DevicesAnswer::List(vec![Device {
        platform: agent_device_fake::Platform::Android,
        id: driver,
        name: "emulator".into(),
        kind: agent_device_fake::DeviceKind::Emulator,
        target: agent_device_fake::DeviceTarget::Mobile,
        booted: true,
    }]));
    let opened = http
        .rpc(
            &gw.base(),
            &gateway_agent,
            &command_call("c1", &lease, "open", json!({})),
        )
        .await;
    assert_eq!(opened.json()["result"]["ok"], json!(true), "{opened:?}");
    // An agent of the worker's own tokens, straight at the worker.
    let worker_base = format!(
        "http://{}/v1/agent-device",
        gw.fleet.worker(0).running.http_addr().unwrap()
    );
    let created = simlock_e2e::session(
        &gw.fleet.worker(0).running.socket_path(),
        "operator",
        Some(&gw.fleet.worker_home(0)),
    )
    .await
    .call("token.create", json!({"role": "agent", "label": "direct"}))
    .await
    .unwrap();
    let direct = created["secret"].as_str().unwrap().to_owned();
    let gateway_id = gw.fleet.gateway().fleet.gateway_id().to_owned();
    let relayed_tenant =
        agent_device_front::Tenant::through_gateway(&gateway_id, &gateway_principal);
    let path = format!(
        "{worker_base}/sessions/{}%3As1/requests/c1/diagnostics",
        relayed_tenant.as_str()
    );
    let bearer = format!("Bearer {direct}");
    let peek = http
        .send(Method::GET, &path, &[("authorization", &bearer)], "")
        .await;
    assert_eq!(peek.status, 404, "another tenant's session: {peek:?}");
    let sessions: Vec<String> = gw.fakes[0].sessions().into_iter().map(|s| s.name).collect();
    assert!(
        sessions
            .iter()
            .all(|s| s.starts_with(&format!("{}:", relayed_tenant.as_str()))),
        "{sessions:?}"
    );
    // And the gateway agent's commands still work.
    let again = http
        .rpc(
            &gw.base(),
            &gateway_agent,
            &lease_call("h1", "lease.heartbeat", &lease),
        )
        .await;
    assert_eq!(again.json()["result"]["ok"], json!(true), "{again:?}");
    gw.stop().await;
}

// === Seed 001: devices, uploads, artifacts and diagnostics by lease ===

/// A gateway with two capable workers of one Android device each, and a token holding one
/// lease on each: `(gateway, secret, leases by worker index)`.
async fn two_workers_two_leases() -> (Gw, String, [String; 2], String) {
    let mut gw = Gw::start(enabled_gateway()).await;
    for _ in 0..2 {
        let mut config = worker(true, &[Platform::Android]);
        config.core.capacity.max_running = 1;
        gw.add(config).await;
    }
    gw.wait_capable(0, true).await;
    gw.wait_capable(1, true).await;
    let (_, secret) = gw.token().await;
    let http = Http::new();
    let first = allocate(&http, &gw, &secret).await;
    let second = allocate(&http, &gw, &secret).await;
    let on = |lease: &str, leases: &[Value]| {
        leases
            .iter()
            .find(|l| l["id"] == lease)
            .map(|l| l["workerId"].as_str().unwrap().to_owned())
            .unwrap()
    };
    let leases = gw.leases().await;
    let w0 = gw.fleet.worker_id(0);
    let by_worker = if on(&first, &leases) == w0 {
        [first.clone(), second]
    } else {
        [second, first.clone()]
    };
    assert_ne!(
        on(&by_worker[0], &leases),
        on(&by_worker[1], &leases),
        "one lease on each"
    );
    (gw, secret, by_worker, first)
}

async fn aux(
    gw: &Gw,
    method: Method,
    route: &str,
    token: &str,
    lease_header: Option<&str>,
    body: impl Into<bytes::Bytes>,
) -> simlock_e2e::agent_device::Answer {
    let bearer = format!("Bearer {token}");
    let mut headers = vec![
        ("authorization", bearer.as_str()),
        ("x-agent-device-token", token),
        ("content-type", "application/json"),
    ];
    if let Some(value) = lease_header {
        headers.push(("x-agent-device-lease-id", value));
    }
    Http::new()
        .send(method, &format!("{}/{route}", gw.base()), &headers, body)
        .await
}

fn sha256_hex(data: &[u8]) -> String {
    use sha2::Digest as _;
    sha2::Sha256::digest(data)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

fn preflight_body(data: &[u8]) -> String {
    let sha = sha256_hex(data);
    json!({"uploadAttemptId": "u1", "sha256": sha, "fileName": "app.apk", "sizeBytes": data.len(),
        "artifactType": "file", "platform": "android", "contentType": "application/octet-stream"})
    .to_string()
}

/// The CLI's PUT to an upload `ticket` (its URL, its headers and the lease header), then the
/// finalize naming `lease`: each answers ok.
async fn put_and_finalize(gw: &Gw, secret: &str, lease: &str, ticket: &Value, data: &[u8]) {
    let url = ticket["upload"]["url"].as_str().unwrap();
    let mut headers = ticket_headers(ticket);
    headers.push(("x-agent-device-lease-id".into(), lease.to_owned()));
    let refs: Vec<(&str, &str)> = headers
        .iter()
        .map(|(k, v)| (k.as_str(), v.as_str()))
        .collect();
    let put = Http::new()
        .send(Method::PUT, url, &refs, data.to_vec())
        .await;
    assert_eq!(put.status, 200, "{put:?}");
    let finalize = aux(
        gw,
        Method::POST,
        "upload/finalize",
        secret,
        Some(lease),
        json!({"uploadId": ticket["uploadId"]}).to_string(),
    )
    .await;
    assert_eq!(finalize.json()["ok"], json!(true), "{finalize:?}");
}

fn paths(fake: &FakeAgentDevice) -> Vec<String> {
    fake.requests().into_iter().map(|r| r.path).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_upload_with_the_lease_header_reaches_the_leases_worker_with_the_callers_ticket() {
    let (gw, secret, [_, on_w2], _) = two_workers_two_leases().await;
    let data = vec![5u8; 4096];
    let ticket = aux(
        &gw,
        Method::POST,
        "upload/preflight",
        &secret,
        Some(&on_w2),
        preflight_body(&data),
    )
    .await;
    assert_eq!(ticket.status, 200, "{ticket:?}");
    assert!(
        paths(&gw.fakes[1]).iter().any(|p| p == "/upload/preflight"),
        "W2 got it"
    );
    assert!(
        !paths(&gw.fakes[0]).iter().any(|p| p.starts_with("/upload")),
        "W1 did not"
    );
    let ticket = ticket.json();
    let url = ticket["upload"]["url"].as_str().unwrap().to_owned();
    assert!(url.starts_with(&gw.base()), "the gateway's origin: {url}");
    let headers = ticket["upload"]["headers"].as_object().unwrap().clone();
    assert_eq!(headers["authorization"], json!(format!("Bearer {secret}")));
    // W2's daemon saw its own token, never the caller's.
    let preflight = gw.fakes[1]
        .requests()
        .into_iter()
        .find(|r| r.path == "/upload/preflight")
        .unwrap();
    let auth = preflight
        .headers
        .iter()
        .find(|(k, _)| k == "authorization")
        .map(|(_, v)| v.clone());
    assert_eq!(auth, Some(format!("Bearer {}", gw.fakes[1].token())));
    assert!(!preflight.headers.iter().any(|(_, v)| v.contains(&secret)));
    // The PUT to the ticket, with the lease header and the ticket's headers, reaches W2.
    put_and_finalize(&gw, &secret, &on_w2, &ticket, &data).await;
    let uploads = gw.fakes[1].uploads();
    assert_eq!(uploads.len(), 1);
    assert_eq!(uploads[0].size, 4096);
    gw.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn artifacts_diagnostics_and_legacy_uploads_follow_the_header_and_without_one_are_too_old() {
    let (gw, secret, [on_w1, _], _) = two_workers_two_leases().await;
    let before = paths(&gw.fakes[0]).len();
    // Sessions live under the caller's tenant on the worker (gw.<gateway>.<principal>).
    let tenant = gw.fakes[0].leases()[0].tenant_id.to_string();
    let diagnostics = format!("sessions/{tenant}%3As1/requests/r1/diagnostics");
    for (method, route) in [
        (Method::POST, "upload"),
        (Method::GET, "artifacts/a1"),
        (Method::GET, diagnostics.as_str()),
    ] {
        let _ = aux(&gw, method, route, &secret, Some(&on_w1), "").await;
    }
    let seen = paths(&gw.fakes[0]);
    assert_eq!(seen.len(), before + 3, "all three reached W1: {seen:?}");
    assert!(seen.iter().any(|p| p == "/artifacts/a1"));
    let w2 = paths(&gw.fakes[1]).len();
    for header in [None, Some("")] {
        for (method, route) in [
            (Method::POST, "upload/preflight"),
            (Method::POST, "upload/finalize"),
            (Method::POST, "upload"),
            (Method::GET, "artifacts/a1"),
            (Method::GET, "artifacts"),
            (Method::GET, "sessions/s1/requests/r1/diagnostics"),
        ] {
            let refused = aux(&gw, method, route, &secret, header, "{}").await;
            assert_eq!(
                refused.json()["error"],
                json!("refused: this agent-device is too old to use through a gateway; update it"),
                "{route} {header:?}"
            );
        }
    }
    assert_eq!(paths(&gw.fakes[0]).len(), before + 3);
    assert_eq!(
        paths(&gw.fakes[1]).len(),
        w2,
        "nothing more reached either worker"
    );
    gw.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_header_naming_another_tokens_lease_or_no_lease_id_is_refused_and_never_echoed() {
    let (gw, secret, [on_w1, _], _) = two_workers_two_leases().await;
    let (_, other) = gw.token().await;
    let seen = (paths(&gw.fakes[0]).len(), paths(&gw.fakes[1]).len());
    let refused = aux(
        &gw,
        Method::POST,
        "upload/preflight",
        &other,
        Some(&on_w1),
        "{}",
    )
    .await;
    assert_eq!(refused.status, 403);
    assert_eq!(
        refused.json()["error"],
        json!(format!(
            "refused: lease {on_w1} is not one of yours on this gateway"
        ))
    );
    for bad in ["a".repeat(40), on_w1.to_uppercase()] {
        let refused = aux(&gw, Method::GET, "artifacts/a1", &secret, Some(&bad), "").await;
        assert_eq!(refused.status, 400);
        assert_eq!(
            refused.json()["error"],
            json!("refused: the x-agent-device-lease-id header is not a lease id")
        );
        assert!(
            !String::from_utf8_lossy(&refused.body).contains(&bad),
            "never echoed"
        );
    }
    // On /rpc the call names its own lease; a lease header beside it must still be one
    // (trial 13: it was ignored there), and a header sent twice is refused on every route.
    let beat = lease_call("b1", "lease.heartbeat", &on_w1).to_string();
    let refused = aux(
        &gw,
        Method::POST,
        "rpc",
        &secret,
        Some("nope"),
        beat.clone(),
    )
    .await;
    assert_eq!(
        refused.json()["error"]["data"]["message"],
        json!("refused: the x-agent-device-lease-id header is not a lease id"),
        "{refused:?}"
    );
    assert_eq!(refused.json()["id"], json!("b1"));
    let bearer = format!("Bearer {secret}");
    for (method, route, body) in [
        (Method::POST, "rpc", beat.clone()),
        (Method::GET, "artifacts/a1", String::new()),
    ] {
        let twice = Http::new()
            .send(
                method,
                &format!("{}/{route}", gw.base()),
                &[
                    ("authorization", bearer.as_str()),
                    ("content-type", "application/json"),
                    ("x-agent-device-lease-id", on_w1.as_str()),
                    ("x-agent-device-lease-id", on_w1.as_str()),
                ],
                body,
            )
            .await;
        let said = twice.json();
        let message = said["error"]["data"]["message"]
            .as_str()
            .or(said["error"].as_str())
            .unwrap_or_default()
            .to_owned();
        assert_eq!(
            message, "refused: the x-agent-device-lease-id header is not a lease id",
            "{route}: {twice:?}"
        );
    }
    assert_eq!((paths(&gw.fakes[0]).len(), paths(&gw.fakes[1]).len()), seen);
    // A well-formed header beside the call is the call's business: the heartbeat goes on.
    let beaten = aux(&gw, Method::POST, "rpc", &secret, Some(&on_w1), beat).await;
    assert_eq!(beaten.status, 200, "{beaten:?}");
    // /health with another token's lease in the header is the proxy's health all the same.
    let health = aux(&gw, Method::GET, "health", &other, Some(&on_w1), "").await;
    assert_eq!(
        health.json()["upstream"]["service"],
        json!("agent-device-daemon")
    );
    gw.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_upload_naming_a_lease_after_release_all_still_reaches_its_worker() {
    let (gw, secret, [on_w1, _], _) = two_workers_two_leases().await;
    gw.fleet
        .operator()
        .await
        .call("lease.release-all", json!({}))
        .await
        .unwrap();
    gw.fleet.wait_until(|fleet| fleet.lease_count() == 0).await;
    let data = vec![1u8; 16];
    let answer = aux(
        &gw,
        Method::POST,
        "upload/preflight",
        &secret,
        Some(&on_w1),
        preflight_body(&data),
    )
    .await;
    assert_eq!(answer.status, 200, "{answer:?}");
    assert!(paths(&gw.fakes[0]).iter().any(|p| p == "/upload/preflight"));
    gw.stop().await;
}

/// The names in a `devices` answer's `data`, sorted.
fn sorted_names(data: &Value) -> Vec<String> {
    let mut names: Vec<String> = data["devices"]
        .as_array()
        .unwrap_or_else(|| panic!("a device list: {data}"))
        .iter()
        .map(|d| d["name"].as_str().unwrap().to_owned())
        .collect();
    names.sort();
    names
}

fn listed(fake_devices: &[(&str, &str)]) -> DevicesAnswer {
    DevicesAnswer::List(
        fake_devices
            .iter()
            .map(|(id, name)| Device {
                platform: agent_device_fake::Platform::Android,
                id: (*id).into(),
                name: (*name).into(),
                kind: agent_device_fake::DeviceKind::Emulator,
                target: agent_device_fake::DeviceTarget::Mobile,
                booted: true,
            })
            .collect(),
    )
}

fn devices_call(id: &str) -> Value {
    rpc_call(
        id,
        "command",
        json!({"session": "default", "command": "devices", "positionals": [], "flags": {}, "meta": {}}),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn devices_through_the_gateway_joins_each_workers_answer_cut_to_its_lease() {
    let (gw, secret, [on_w1, on_w2], first) = two_workers_two_leases().await;
    let address = |n: usize| {
        gw.fleet.worker(n).worker.devices()[0]
            .driver_device_id
            .clone()
    };
    let (a1, a2) = (address(0), address(1));
    gw.fakes[0].set_devices(listed(&[(&a1, "w1 device"), ("emulator-9", "w1 stranger")]));
    gw.fakes[1].set_devices(listed(&[(&a2, "w2 device"), ("emulator-8", "w2 stranger")]));
    let http = Http::new();
    let answer = http.rpc(&gw.base(), &secret, &devices_call("d1")).await;
    let names: Vec<Value> = answer.json()["result"]["data"]["devices"]
        .as_array()
        .unwrap()
        .iter()
        .map(|d| d["name"].clone())
        .collect();
    // In lease order: the order they were allocated.
    let expected = if first == on_w1 {
        [json!("w1 device"), json!("w2 device")]
    } else {
        [json!("w2 device"), json!("w1 device")]
    };
    assert_eq!(names, expected, "each once, in lease order: {answer:?}");
    // Another token holding nothing gets the empty list, and no daemon is asked.
    let (_, other) = gw.token().await;
    let asked = (rpcs(&gw.fakes[0]), rpcs(&gw.fakes[1]));
    let none = http.rpc(&gw.base(), &other, &devices_call("d2")).await;
    assert_eq!(none.json()["result"]["data"]["devices"], json!([]));
    assert_eq!((rpcs(&gw.fakes[0]), rpcs(&gw.fakes[1])), asked);
    // W2 failing passes its error on; W2 answering no list is the seed's 502.
    gw.fakes[1].set_devices(DevicesAnswer::Error(DaemonError::new(
        ErrorCode::CommandFailed,
        "w2 broke",
    )));
    let failed = http.rpc(&gw.base(), &secret, &devices_call("d3")).await;
    assert_eq!(message(&failed), "w2 broke");
    gw.fakes[1].set_devices(DevicesAnswer::NoList);
    let unreadable = http.rpc(&gw.base(), &secret, &devices_call("d4")).await;
    assert_eq!(unreadable.status, 502);
    assert_eq!(
        message(&unreadable),
        format!("could not read the device list from the worker holding lease {on_w2}")
    );
    gw.stop().await;
}

/// Two leases on one worker: `devices` lists both devices once, asked as `--json` asks and as
/// the CLI's human mode asks (a progress stream, its own request id); then each of the two
/// forwards carries a request id of its own (agent-device refuses a second request with the
/// id of one in flight).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn devices_with_two_leases_on_one_worker_lists_both_once() {
    let mut gw = Gw::start(enabled_gateway()).await;
    let mut config = worker(true, &[Platform::Android]);
    config.core.capacity.max_running = 2;
    gw.add(config).await;
    gw.wait_capable(0, true).await;
    let (_, secret) = gw.token().await;
    let http = Http::new();
    allocate(&http, &gw, &secret).await;
    allocate(&http, &gw, &secret).await;
    let devices = gw.fleet.worker(0).worker.devices();
    let ids: Vec<String> = devices.iter().map(|d| d.driver_device_id.clone()).collect();
    assert_eq!(ids.len(), 2);
    gw.fakes[0].set_devices(listed(&[
        (&ids[0], "one"),
        (&ids[1], "two"),
        ("emulator-9", "other"),
    ]));
    let names =
        |answer: &simlock_e2e::agent_device::Answer| sorted_names(&answer.json()["result"]["data"]);
    let answer = http.rpc(&gw.base(), &secret, &devices_call("d1")).await;
    assert_eq!(names(&answer), ["one", "two"], "each once");
    gw.fakes[0].clear_requests();
    let human = rpc_call(
        "fd92114f2a36a3df",
        "command",
        json!({"session": "default", "command": "devices", "positionals": [], "flags": {},
            "meta": {"requestId": "fd92114f2a36a3df", "requestProgress": "command"}}),
    );
    let answer = http.rpc(&gw.base(), &secret, &human).await;
    assert_eq!(answer.status, 200, "{answer:?}");
    assert_eq!(names(&answer), ["one", "two"], "each once, in human mode");
    assert_eq!(answer.json()["id"], "fd92114f2a36a3df");
    let mut sent: Vec<Value> = received(&gw.fakes[0], "agent_device.command")
        .iter()
        .map(|r| r["params"]["meta"]["requestId"].clone())
        .collect();
    sent.sort_by_key(Value::to_string);
    sent.dedup();
    assert_eq!(
        sent.len(),
        2,
        "a request id of its own per forward: {sent:?}"
    );
    gw.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cli_that_hangs_up_during_devices_aborts_every_forward() {
    let (gw, secret, _, _) = two_workers_two_leases().await;
    let holds = [
        gw.fakes[0].hold_commands("devices"),
        gw.fakes[1].hold_commands("devices"),
    ];
    let (base, token) = (gw.base(), secret.clone());
    let asking =
        tokio::spawn(async move { Http::new().rpc(&base, &token, &devices_call("d1")).await });
    for hold in &holds {
        tokio::time::timeout(PATIENCE, hold.wait_entered(1))
            .await
            .unwrap();
    }
    asking.abort();
    // Both held commands stop waiting: their callers (the relays) went away.
    tokio::time::timeout(PATIENCE, async {
        for hold in &holds {
            hold.wait_none_waiting().await;
        }
    })
    .await
    .expect("every forward was aborted");
    gw.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn release_materialized_paths_is_refused_and_install_from_source_goes_by_its_lease() {
    let (gw, secret, [on_w1, _], _) = two_workers_two_leases().await;
    let http = Http::new();
    let release = rpc_call(
        "m1",
        "release_materialized_paths",
        json!({"materializationId": "m-1"}),
    );
    let refused = http.rpc(&gw.base(), &secret, &release).await;
    assert_eq!(
        message(&refused),
        "refused: this agent-device is too old to use through a gateway; update it"
    );
    let install = rpc_call(
        "i1",
        "install_from_source",
        json!({"platform": "android", "source": {"kind": "url", "url": "https://example.invalid/app.apk"},
            "leaseId": on_w1, "session": "s1"}),
    );
    let _ = http.rpc(&gw.base(), &secret, &install).await;
    assert_eq!(
        received(&gw.fakes[0], "agent_device.install_from_source").len(),
        1
    );
    assert!(received(&gw.fakes[1], "agent_device.install_from_source").is_empty());
    gw.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_header_naming_a_lease_whose_worker_cannot_serve_answers_not_available() {
    let mut gw = Gw::start_tuned(enabled_gateway(), |t| {
        t.refresh_interval = Duration::from_millis(100);
    })
    .await;
    gw.add(worker(true, &[Platform::Android])).await;
    gw.wait_capable(0, true).await;
    let (_, secret) = gw.token().await;
    let lease = allocate(&Http::new(), &gw, &secret).await;
    gw.fleet
        .worker(0)
        .agent_device
        .as_ref()
        .unwrap()
        .host
        .stop()
        .await;
    gw.wait_capable(0, false).await;
    let answer = aux(&gw, Method::GET, "artifacts/a1", &secret, Some(&lease), "").await;
    assert_eq!(
        answer.json()["error"],
        json!(
            "agent-device is not available on this simlock: the worker holding this lease cannot serve agent-device"
        )
    );
    gw.stop().await;
}

// === With the published 0.21.5 CLI through the gateway (it sends no lease header) ===

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_published_cli_lists_its_devices_on_two_workers_and_shows_the_too_old_refusals() {
    use simlock_e2e::agent_device::{Cli, Output, real_package};
    let pkg = real_package();
    let mut gw = Gw::start(enabled_gateway()).await;
    for _ in 0..2 {
        let mut config = worker(true, &[Platform::Android]);
        config.core.capacity.max_running = 1;
        gw.add(config).await;
    }
    gw.wait_capable(0, true).await;
    gw.wait_capable(1, true).await;
    let (_, secret) = gw.token().await;
    // Two CLI sessions of one token: one lease on each worker.
    let clis = [
        Cli::new(&pkg, &gw.base(), &secret),
        Cli::new(&pkg, &gw.base(), &secret),
    ];
    // Before `connect` a command names no lease: the refusal, and the hint that says what to do.
    let unconnected = clis[0].run_as(Output::Human, &["snapshot"]).await;
    assert!(!unconnected.status.success(), "{unconnected:?}");
    assert!(
        unconnected
            .stderr
            .contains("too old to use through a gateway")
            && unconnected
                .stderr
                .contains("agent-device connect --remote-config"),
        "the CLI shows the refusal and its hint: {unconnected:?}"
    );
    for cli in &clis {
        cli.connect("android").await;
        let _ = cli.run(&["devices"]).await;
    }
    assert_eq!(gw.leases().await.len(), 2);
    for n in 0..2 {
        let address = gw.fleet.worker(n).worker.devices()[0]
            .driver_device_id
            .clone();
        gw.fakes[n].set_devices(listed(&[(&address, &format!("device on w{n}"))]));
    }
    let listed_now = clis[0].run(&["devices"]).await;
    assert_eq!(
        sorted_names(&listed_now.json["data"]),
        ["device on w0", "device on w1"],
        "both, once each: {listed_now:?}"
    );
    // An install: the CLI's upload names no lease, so the gateway refuses it as too old, and
    // the CLI says so (no hang, no crash).
    let apk = clis[0].dir().join("app.apk");
    std::fs::write(&apk, vec![3u8; 1024]).unwrap();
    let install = clis[0]
        .run(&[
            "install",
            "com.example",
            apk.to_str().unwrap(),
            "--platform",
            "android",
        ])
        .await;
    assert_eq!(install.json["success"], json!(false), "{install:?}");
    let shown = format!("{}{}", install.stdout, install.stderr);
    assert!(
        shown.contains("too old to use through a gateway"),
        "the CLI shows the refusal: {install:?}"
    );
    assert!(
        shown.contains("need the x-agent-device-lease-id header"),
        "and the hint, which names the header: {install:?}"
    );
    // A failing command: its own error reaches the agent; the diagnostics fetch that follows
    // is refused the same way.
    for fake in &gw.fakes {
        fake.fail_commands(
            agent_device_fake::CommandFailure::new(DaemonError::new(
                ErrorCode::CommandFailed,
                "the app crashed",
            ))
            .for_command("snapshot"),
        );
    }
    let failed = clis[0].run(&["snapshot"]).await;
    assert_eq!(
        failed.json["error"]["message"],
        json!("the app crashed"),
        "{failed:?}"
    );
    let diagnostics: Vec<u16> = gw
        .fakes
        .iter()
        .flat_map(|f| f.requests())
        .filter(|r| r.path.contains("/diagnostics"))
        .filter_map(|r| r.status)
        .collect();
    assert!(
        diagnostics.is_empty(),
        "no diagnostics fetch reached a worker: {diagnostics:?}"
    );
    for cli in &clis {
        let _ = cli.run(&["disconnect"]).await;
    }
    gw.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_64_mib_upload_with_the_header_lands_on_the_leases_worker_with_its_sha256_intact() {
    let (gw, secret, [_, on_w2], _) = two_workers_two_leases().await;
    let data: Vec<u8> = (0..64 * 1024 * 1024)
        .map(|i| u8::try_from(i % 253).unwrap())
        .collect();
    let ticket = aux(
        &gw,
        Method::POST,
        "upload/preflight",
        &secret,
        Some(&on_w2),
        preflight_body(&data),
    )
    .await;
    assert_eq!(ticket.status, 200, "{ticket:?}");
    put_and_finalize(&gw, &secret, &on_w2, &ticket.json(), &data).await;
    let expected = sha256_hex(&data);
    let uploads = gw.fakes[1].uploads();
    assert_eq!(uploads.len(), 1, "on W2 only");
    assert_eq!(uploads[0].size, 64 * 1024 * 1024);
    assert_eq!(uploads[0].sha256, expected, "every byte intact");
    assert!(gw.fakes[0].uploads().is_empty());
    gw.stop().await;
}

// === A disconnected worker and a gateway restart (issue 16) ===

/// A TCP cable between a worker and the gateway that a test cuts and mends: cut, it closes every
/// connection through it and refuses new ones (the worker sees its uplink drop and keeps
/// redialling); mended, it carries them again.
struct Cable {
    addr: std::net::SocketAddr,
    up: Arc<tokio::sync::watch::Sender<bool>>,
    /// While set, no byte moves either way, and no connection closes: a stalled network.
    stalled: Arc<tokio::sync::watch::Sender<bool>>,
    /// Every byte the gateway sent down the cable, in order.
    down: Arc<parking_lot::Mutex<Vec<u8>>>,
    task: tokio::task::JoinHandle<()>,
}

/// Carries bytes from `from` to `to` until either ends, holding them while `stalled` says so,
/// and copying each into `tap` when there is one.
async fn carry(
    mut from: tokio::net::tcp::OwnedReadHalf,
    mut to: tokio::net::tcp::OwnedWriteHalf,
    stalled: &mut tokio::sync::watch::Receiver<bool>,
    tap: Option<&parking_lot::Mutex<Vec<u8>>>,
) -> std::io::Result<()> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        let n = from.read(&mut buf).await?;
        if n == 0 {
            return Ok(());
        }
        let _ = stalled.wait_for(|stalled| !*stalled).await;
        if let Some(tap) = tap {
            tap.lock().extend_from_slice(&buf[..n]);
        }
        to.write_all(&buf[..n]).await?;
    }
}

impl Cable {
    async fn to(target: std::net::SocketAddr) -> Self {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let up = Arc::new(tokio::sync::watch::channel(true).0);
        let stalled = Arc::new(tokio::sync::watch::channel(false).0);
        let down = Arc::new(parking_lot::Mutex::new(Vec::new()));
        let (watched, tapped, stall) = (up.clone(), down.clone(), stalled.clone());
        let task = tokio::spawn(async move {
            while let Ok((inbound, _)) = listener.accept().await {
                if !*watched.borrow() {
                    continue;
                }
                let mut state = watched.subscribe();
                let tap = tapped.clone();
                let (mut flow_up, mut flow_down) = (stall.subscribe(), stall.subscribe());
                tokio::spawn(async move {
                    let Ok(outbound) = tokio::net::TcpStream::connect(target).await else {
                        return;
                    };
                    let (in_read, in_write) = inbound.into_split();
                    let (out_read, out_write) = outbound.into_split();
                    tokio::select! {
                        _ = carry(in_read, out_write, &mut flow_up, None) => {}
                        _ = carry(out_read, in_write, &mut flow_down, Some(&tap)) => {}
                        _ = state.wait_for(|up| !*up) => {}
                    }
                });
            }
        });
        Self {
            addr,
            up,
            stalled,
            down,
            task,
        }
    }

    /// Holds every byte where it is, both ways, closing nothing: the uplink stalls, and the
    /// gateway does not know yet.
    fn stall(&self) {
        self.stalled.send_replace(true);
    }

    /// Lets the held bytes flow again.
    fn unstall(&self) {
        self.stalled.send_replace(false);
    }

    /// Whether the gateway sent `needle` down the cable since the last [`Self::clear`].
    fn sent_down(&self, needle: &str) -> bool {
        self.down
            .lock()
            .windows(needle.len())
            .any(|w| w == needle.as_bytes())
    }

    fn clear(&self) {
        self.down.lock().clear();
    }

    fn cut(&self) {
        self.up.send_replace(false);
    }

    fn mend(&self) {
        self.stalled.send_replace(false);
        self.up.send_replace(true);
    }
}

impl Drop for Cable {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// The device the fake of worker `n` lists: the one the worker leases.
fn list_the_leased_device(gw: &Gw, n: usize) -> String {
    let driver = gw.fleet.worker(n).worker.devices()[0]
        .driver_device_id
        .clone();
    gw.fakes[n].set_devices(listed(&[(driver.as_str(), "emulator")]));
    driver
}

/// Every call for `lease` while its worker is away: a command, a heartbeat, `devices`, an upload
/// preflight, an artifact and diagnostics with the lease header. Each answers at once with the
/// retriable disconnected reply (never an `UNAUTHORIZED` the CLI would allocate again on), and
/// `devices` lists what it could read and names the lease it could not.
async fn every_call_answers_retry(gw: &Gw, secret: &str, lease: &str) {
    let http = Http::new();
    let reason = agent_device_front::relay_link::HOLDER_DISCONNECTED;
    let unavailable = format!("agent-device is not available on this simlock: {reason}");
    for call in [
        command_call("c", lease, "snapshot", json!({})),
        lease_call("h", "lease.heartbeat", lease),
    ] {
        let answer = http.rpc(&gw.base(), secret, &call).await;
        assert_eq!(answer.status, 503, "{answer:?}");
        let data = &answer.json()["error"]["data"];
        assert_eq!(data["code"], "UNAVAILABLE", "{answer:?}");
        assert_eq!(data["message"], json!(unavailable));
        assert_eq!(data["retriable"], json!(true));
    }
    let devices = http.rpc(&gw.base(), secret, &devices_call("d")).await;
    assert_eq!(
        devices.json()["result"]["data"],
        json!({"devices": [], "unreadLeases": [
            {"leaseId": lease, "reason": reason, "retriable": true}
        ]}),
        "{devices:?}"
    );
    for (method, route, body) in [
        (Method::POST, "upload/preflight", preflight_body(b"app")),
        (Method::GET, "artifacts/a1", String::new()),
        (
            Method::GET,
            "sessions/s1/requests/r1/diagnostics",
            String::new(),
        ),
    ] {
        let answer = aux(gw, method, route, secret, Some(lease), body).await;
        assert_eq!(answer.status, 503, "{route}: {answer:?}");
        assert_eq!(answer.json()["error"], json!(unavailable), "{route}");
        assert_eq!(answer.json()["retriable"], json!(true), "{route}");
    }
}

/// While no worker is connected, a lease the caller does not hold (another token's, or one
/// never issued) is still refused as not its own, on `/rpc` and by the lease header alike: a
/// "not available; retry" would send it retrying forever. The owner hears "retry".
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_no_worker_connected_a_lease_not_the_callers_is_still_not_yours() {
    use simlock_contract::model::Connection;
    let mut gw = Gw::start(enabled_gateway()).await;
    let cable = gw.add_android_worker_via_cable().await;
    let (_, alice) = gw.token().await;
    let (_, bob) = gw.token().await;
    let http = Http::new();
    let lease = allocate(&http, &gw, &alice).await;
    cable.cut();
    gw.wait_connection(0, Connection::Disconnected).await;

    let unknown = "f".repeat(32);
    for (token, named) in [(&bob, lease.as_str()), (&alice, unknown.as_str())] {
        let not_yours = format!("refused: lease {named} is not one of yours on this gateway");
        for call in [
            command_call("c", named, "snapshot", json!({})),
            lease_call("h", "lease.heartbeat", named),
            lease_call("r", "lease.release", named),
        ] {
            let refused = http.rpc(&gw.base(), token, &call).await;
            assert_eq!(refused.status, 403, "{refused:?}");
            assert_eq!(message(&refused), not_yours);
        }
        let refused = aux(&gw, Method::GET, "artifacts/a1", token, Some(named), "").await;
        assert_eq!(refused.status, 403, "{refused:?}");
        assert_eq!(refused.json()["error"], json!(not_yours));
    }
    every_call_answers_retry(&gw, &alice, &lease).await;
    gw.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn while_the_uplink_is_down_the_lease_answers_retry_at_once_and_afterwards_its_device_serves()
{
    use simlock_contract::model::Connection;
    // A relay deadline no test outlives: that every call answers shows none was waited out.
    let mut gw = Gw::start_customized(
        enabled_gateway(),
        |_| {},
        |options| options.relay_deadline = Some(Duration::from_secs(3600)),
    )
    .await;
    let cable = gw.add_android_worker_via_cable().await;
    let (_, secret) = gw.token().await;
    let http = Http::new();
    let lease = allocate(&http, &gw, &secret).await;
    let driver = list_the_leased_device(&gw, 0);
    let opened = http
        .rpc(
            &gw.base(),
            &secret,
            &command_call("c1", &lease, "open", json!({})),
        )
        .await;
    assert_eq!(opened.json()["result"]["ok"], json!(true), "{opened:?}");

    cable.cut();
    gw.wait_connection(0, Connection::Disconnected).await;
    let seen = callers_requests(&gw.fakes[0]).len();
    every_call_answers_retry(&gw, &secret, &lease).await;
    assert_eq!(
        callers_requests(&gw.fakes[0]).len(),
        seen,
        "nothing was relayed to the away worker"
    );
    assert_eq!(gw.leases().await.len(), 1, "the lease is not released");
    assert!(gw.fleet.worker(0).worker.lease(&lease).is_some());

    cable.mend();
    gw.wait_connection(0, Connection::Connected).await;
    let beat = http
        .rpc(
            &gw.base(),
            &secret,
            &lease_call("h2", "lease.heartbeat", &lease),
        )
        .await;
    assert_eq!(beat.json()["result"]["ok"], json!(true), "{beat:?}");
    assert_eq!(
        callers_heartbeats(&gw.fakes[0]),
        1,
        "the heartbeat sent while away was answered, not held back and delivered late"
    );
    let snapshot = http
        .rpc(
            &gw.base(),
            &secret,
            &command_call("c3", &lease, "snapshot", json!({})),
        )
        .await;
    assert_eq!(snapshot.json()["result"]["ok"], json!(true), "{snapshot:?}");
    let commands = received(&gw.fakes[0], "agent_device.command");
    assert_eq!(
        commands.last().unwrap()["params"]["flags"]["serial"],
        json!(driver)
    );
    let devices = http.rpc(&gw.base(), &secret, &devices_call("d2")).await;
    let data = &devices.json()["result"]["data"];
    assert_eq!(data["devices"][0]["id"], json!(driver), "{devices:?}");
    assert_eq!(data.get("unreadLeases"), None, "every lease was read");
    assert_eq!(gw.leases().await.len(), 1, "no other lease replaced it");
    gw.stop().await;
}

/// A gateway whose one worker (on a cable) holds a lease of a new token's, the cable then cut:
/// the gateway, the cable, the token's secret and the lease.
async fn a_lease_whose_worker_is_away() -> (Gw, Cable, String, String) {
    let mut gw = Gw::start(enabled_gateway()).await;
    let cable = gw.add_android_worker_via_cable().await;
    let (_, secret) = gw.token().await;
    let lease = allocate(&Http::new(), &gw, &secret).await;
    cable.cut();
    gw.wait_connection(0, simlock_contract::model::Connection::Disconnected)
        .await;
    (gw, cable, secret, lease)
}

/// Trial 7: the published CLI's `disconnect` reports success whatever its release is answered,
/// so a release while the lease's worker is away is answered `released: true` and carried out
/// once the worker is back: agent-device's lease first, then the simlock lease; the device is
/// free then, not at the TTL. A second release meanwhile starts nothing more.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_release_while_the_worker_is_away_is_answered_and_carried_out_once_it_is_back() {
    let (gw, cable, secret, lease) = a_lease_whose_worker_is_away().await;
    let http = Http::new();
    for id in ["r1", "r2"] {
        let released = http
            .rpc(
                &gw.base(),
                &secret,
                &lease_call(id, "lease.release", &lease),
            )
            .await;
        assert_eq!(released.status, 200, "{released:?}");
        assert_eq!(
            released.json()["result"],
            json!({"ok": true, "data": {"released": true}}),
            "{released:?}"
        );
    }
    assert!(
        received(&gw.fakes[0], "agent_device.lease.release").is_empty(),
        "nothing reached the away worker"
    );
    assert!(
        gw.fleet.worker(0).worker.lease(&lease).is_some(),
        "held until it is back"
    );

    assert!(gw.leases().await.is_empty(), "ended at the gateway at once");

    cable.mend();
    released_on_the_worker(&gw, &lease).await;
    assert!(gw.leases().await.is_empty());
    // The device serves the next allocate.
    gw.wait_capable(0, true).await;
    let again = allocate(&http, &gw, &secret).await;
    assert_ne!(again, lease);
    gw.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_away_past_the_ttl_ends_the_lease_by_host_when_it_returns_and_reclaims_the_device()
{
    use simlock_contract::model::Connection;
    let mut config = enabled_gateway();
    config.agent_device.lease_ttl_cap_ms = Some(5_000);
    let mut gw = Gw::start(config).await;
    let cable = gw.add_android_worker_via_cable().await;
    let (_, secret) = gw.token().await;
    let http = Http::new();
    let lease = allocate(&http, &gw, &secret).await;
    let mut events = gw.fleet.worker(0).running.base.bus.follow();
    cable.cut();
    gw.wait_connection(0, Connection::Disconnected).await;
    // The worker's own clock ends the lease while it is away, and takes its device back.
    loop {
        let event = tokio::time::timeout(PATIENCE, events.recv())
            .await
            .unwrap()
            .unwrap();
        if event.event == "device.reclaimed" {
            break;
        }
    }
    assert!(gw.fleet.worker(0).worker.lease(&lease).is_none());
    cable.mend();
    gw.wait_connection(0, Connection::Connected).await;
    gw.fleet
        .wait_until(|fleet| fleet.lease(&lease).is_none())
        .await;
    let beat = http
        .rpc(
            &gw.base(),
            &secret,
            &lease_call("h1", "lease.heartbeat", &lease),
        )
        .await;
    assert_eq!(beat.status, 401, "{beat:?}");
    assert_eq!(
        beat.json()["error"]["data"]["details"]["reason"],
        "LEASE_ENDED_BY_HOST",
        "{beat:?}"
    );
    gw.stop().await;
}

/// Waits until worker 0 no longer holds `lease`, the gateway has read its view since, and its
/// host has released agent-device's lease (as the simlock lease ends there), once.
async fn released_on_the_worker(gw: &Gw, lease: &str) {
    gw.fleet
        .wait_until(|_| gw.fleet.worker(0).worker.lease(lease).is_none())
        .await;
    gw.fleet.wait_connected_holding_none(0).await;
    simlock_e2e::relay::wait_until("agent-device's lease is released", || {
        !received(&gw.fakes[0], "agent_device.lease.release").is_empty()
    })
    .await;
    let released = received(&gw.fakes[0], "agent_device.lease.release");
    assert_eq!(released.len(), 1, "released once: {released:?}");
}

/// The gateway's store refuses `what` (`INSERT ON <table>`, …), as a full disk does, and the
/// holder releases `lease`: the answer.
async fn release_on_a_full_disk(
    gw: &Gw,
    secret: &str,
    lease: &str,
    what: &str,
) -> simlock_e2e::agent_device::Answer {
    let db = simlock_daemon::store::Database::open(&gw.fleet.gateway_home().database()).unwrap();
    db.with(|c| {
        c.execute_batch(&format!(
            "CREATE TRIGGER full_disk BEFORE {what}
             BEGIN SELECT RAISE(FAIL, 'database or disk is full'); END;"
        ))
    })
    .unwrap();
    Http::new()
        .rpc(
            &gw.base(),
            secret,
            &lease_call("r1", "lease.release", lease),
        )
        .await
}

/// Trial 19: the same release when the gateway cannot store it (its disk full) is not answered
/// `released: true`: the caller hears why. The gateway still carries it out once the worker is
/// back (it holds it in memory).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_release_the_gateway_cannot_store_is_refused_saying_so_and_still_carried_out() {
    let (gw, cable, secret, lease) = a_lease_whose_worker_is_away().await;
    let refused = release_on_a_full_disk(&gw, &secret, &lease, "INSERT ON orphan_leases").await;
    let message = refused.json()["error"]["data"]["message"]
        .as_str()
        .unwrap_or_default()
        .to_owned();
    assert!(
        message.starts_with("refused by simlock: the release is carried out once its worker is back, but could not be stored yet (")
            && message.contains("database or disk is full"),
        "{refused:?}"
    );
    cable.mend();
    released_on_the_worker(&gw, &lease).await;
    gw.stop().await;
}

/// The same after a gateway restart, before the worker reported (the front carries the release
/// out itself): one it cannot keep for its next run is refused saying so, and carried out all
/// the same once the worker is back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_release_after_a_restart_the_front_cannot_keep_is_refused_saying_so_and_carried_out() {
    let (mut gw, cable, secret, lease) = a_lease_whose_worker_is_away().await;
    gw.fleet.restart_gateway(enabled_gateway()).await;
    let refused = release_on_a_full_disk(
        &gw,
        &secret,
        &lease,
        "UPDATE OF release_until ON agent_device_placements",
    )
    .await;
    assert_eq!(
        refused.json()["error"]["data"]["message"],
        "refused by simlock: the release is carried out once the lease's worker is back, but could not be stored: should this gateway restart first, the lease is held until its TTL",
        "{refused:?}"
    );
    cable.mend();
    released_on_the_worker(&gw, &lease).await;
    gw.stop().await;
}

/// `/health` through a stalled uplink: the worker's last healthy answer, within the front's
/// bound; with none kept yet, the not-available answer naming the bound (never a hang).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn health_through_a_stalled_uplink_is_the_last_healthy_answer_or_says_it_waited() {
    let mut gw = Gw::start(enabled_gateway()).await;
    let cable = gw.add_android_worker_via_cable().await;
    let http = Http::new();
    let url = format!("{}/health", gw.base());
    cable.stall();
    let unkept = http.send(Method::GET, &url, &[], "").await;
    assert_eq!(unkept.status, 200, "{unkept:?}");
    assert_eq!(
        unkept.json()["error"],
        json!(
            "agent-device is not available on this simlock: the agent-device daemon did not \
             answer its health within 1000 ms"
        ),
        "{unkept:?}"
    );
    cable.unstall();
    let healthy = http.send(Method::GET, &url, &[], "").await;
    assert_eq!(healthy.json()["ok"], json!(true), "{healthy:?}");
    cable.stall();
    let kept = http.send(Method::GET, &url, &[], "").await;
    assert_eq!(kept.status, 200);
    assert_eq!(kept.json(), healthy.json(), "the last healthy answer");
    cable.mend();
    gw.stop().await;
}

/// A gateway whose one worker (on a cable) holds a lease, the cable stalled, and the lease's
/// release sent and given up on by its caller after 300 ms: the gateway, the cable, the lease.
async fn a_release_given_up_on_a_stalled_uplink() -> (Gw, Cable, String) {
    let mut gw = Gw::start(enabled_gateway()).await;
    let cable = gw.add_android_worker_via_cable().await;
    let (_, secret) = gw.token().await;
    let http = Http::new();
    let lease = allocate(&http, &gw, &secret).await;
    cable.stall();
    let call = lease_call("r1", "lease.release", &lease);
    let gave_up = tokio::time::timeout(
        Duration::from_millis(300),
        http.rpc(&gw.base(), &secret, &call),
    )
    .await;
    assert!(gave_up.is_err(), "the release waits on the stalled uplink");
    (gw, cable, lease)
}

/// Trial 8: a `disconnect` sent while the uplink is stalled and not yet declared dead, whose
/// caller gives up and hangs up, still ends the lease: the release goes on without its caller,
/// its relay fails once the uplink is gone, and the lease is released on the worker once it is
/// back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_release_held_up_by_a_stalled_uplink_goes_on_after_its_caller_hangs_up() {
    let (gw, cable, lease) = a_release_given_up_on_a_stalled_uplink().await;
    // The uplink then drops: the relay fails, and the release is taken over.
    cable.cut();
    gw.fleet
        .wait_until(|fleet| fleet.lease(&lease).is_none())
        .await;
    assert!(
        gw.fleet.worker(0).worker.lease(&lease).is_some(),
        "nothing reached the worker yet"
    );
    cable.mend();
    released_on_the_worker(&gw, &lease).await;
    gw.stop().await;
}

/// The same, the uplink flowing again before it is declared dead: the release whose caller hung
/// up reaches the worker then.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_release_held_up_by_a_stalled_uplink_reaches_the_worker_when_it_flows_again() {
    let (gw, cable, lease) = a_release_given_up_on_a_stalled_uplink().await;
    cable.unstall();
    gw.fleet
        .wait_until(|fleet| fleet.lease(&lease).is_none())
        .await;
    assert!(gw.fleet.worker(0).worker.lease(&lease).is_none());
    assert_eq!(
        received(&gw.fakes[0], "agent_device.lease.release").len(),
        1
    );
    gw.stop().await;
}

/// Trial 9: the published CLI's `disconnect` while the uplink is stalled (its calls give up
/// after 3 s each) still ends the lease once the uplink drops and the worker is back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_published_clis_disconnect_on_a_stalled_uplink_ends_the_lease_once_the_worker_is_back()
{
    use simlock_e2e::agent_device::{Cli, real_package};
    let pkg = real_package();
    let mut gw = Gw::start(enabled_gateway()).await;
    let cable = gw.add_android_worker_via_cable().await;
    let (_, secret) = gw.token().await;
    let cli = Cli::new(&pkg, &gw.base(), &secret);
    cli.connect("android").await;
    let _ = cli.run(&["devices"]).await;
    let lease = gw.leases().await[0]["id"].as_str().unwrap().to_owned();
    cable.stall();
    let disconnect = cli.run(&["disconnect"]).await;
    assert!(disconnect.status.success(), "{disconnect:?}");
    cable.cut();
    gw.fleet
        .wait_until(|fleet| fleet.lease(&lease).is_none())
        .await;
    cable.mend();
    gw.fleet.wait_connected_holding_none(0).await;
    gw.fleet
        .wait_until(|_| gw.fleet.worker(0).worker.lease(&lease).is_none())
        .await;
    gw.stop().await;
}

/// The gateway restarts while `lease`'s worker is away, and its holder releases it: answered
/// `released: true` at once.
async fn restart_then_release(gw: &mut Gw, secret: &str, lease: &str) {
    gw.fleet.restart_gateway(enabled_gateway()).await;
    let released = Http::new()
        .rpc(
            &gw.base(),
            secret,
            &lease_call("r1", "lease.release", lease),
        )
        .await;
    assert_eq!(
        released.json()["result"],
        json!({"ok": true, "data": {"released": true}}),
        "{released:?}"
    );
}

/// After a gateway restart, before the lease's worker is back, the gateway does not know the
/// simlock lease's owner yet: a release is still answered `released: true`, and carried out by
/// the front once the worker is back (agent-device's lease, then the simlock lease).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_release_after_a_gateway_restart_before_the_worker_is_back_is_carried_out_once_it_is() {
    let (mut gw, cable, secret, lease) = a_lease_whose_worker_is_away().await;
    restart_then_release(&mut gw, &secret, &lease).await;
    assert!(gw.fleet.worker(0).worker.lease(&lease).is_some());

    cable.mend();
    released_on_the_worker(&gw, &lease).await;
    assert!(gw.leases().await.is_empty());
    gw.stop().await;
}

/// The same release, and the gateway restarts once more before the worker is back: the release
/// it answered is kept in its database and carried out by the next run once the worker is back
/// (the simlock lease released as its owner; the worker's host releases agent-device's first).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_release_answered_before_a_second_gateway_restart_is_carried_out_by_the_next_run() {
    let (mut gw, cable, secret, lease) = a_lease_whose_worker_is_away().await;
    restart_then_release(&mut gw, &secret, &lease).await;
    gw.fleet.restart_gateway(enabled_gateway()).await;
    assert!(gw.fleet.worker(0).worker.lease(&lease).is_some());

    cable.mend();
    released_on_the_worker(&gw, &lease).await;
    assert!(gw.leases().await.is_empty());
    // Settled: a third run has nothing left to carry out.
    gw.fleet.restart_gateway(enabled_gateway()).await;
    gw.fleet.wait_connected_holding_none(0).await;
    let again = received(&gw.fakes[0], "agent_device.lease.release");
    assert_eq!(again.len(), 1, "released once: {again:?}");
    gw.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn after_a_gateway_restart_its_leases_answer_retry_until_their_worker_is_back_then_serve_their_owners_only()
 {
    use simlock_contract::model::Connection;
    let mut gw = Gw::start(enabled_gateway()).await;
    let cable = gw.add_android_worker_via_cable().await;
    let (_, alice) = gw.token().await;
    let (_, bob) = gw.token().await;
    let http = Http::new();
    let lease = allocate(&http, &gw, &alice).await;
    let driver = list_the_leased_device(&gw, 0);

    // The worker stays away while the gateway restarts on the same home.
    cable.cut();
    gw.wait_connection(0, Connection::Disconnected).await;
    gw.fleet.restart_gateway(enabled_gateway()).await;
    every_call_answers_retry(&gw, &alice, &lease).await;
    let not_yours = format!("refused: lease {lease} is not one of yours on this gateway");
    let refused = http
        .rpc(
            &gw.base(),
            &bob,
            &command_call("b1", &lease, "snapshot", json!({})),
        )
        .await;
    assert_eq!(refused.status, 403, "{refused:?}");
    assert_eq!(message(&refused), not_yours);
    let bobs = http.rpc(&gw.base(), &bob, &devices_call("bd")).await;
    assert_eq!(bobs.json()["result"]["data"], json!({"devices": []}));

    // Back within one view refresh of its reconnection: placed, owner-checked and relayed.
    cable.mend();
    gw.fleet
        .wait_until(|fleet| fleet.lease(&lease).is_some())
        .await;
    let beat = http
        .rpc(
            &gw.base(),
            &alice,
            &lease_call("h1", "lease.heartbeat", &lease),
        )
        .await;
    assert_eq!(beat.json()["result"]["ok"], json!(true), "{beat:?}");
    let snapshot = http
        .rpc(
            &gw.base(),
            &alice,
            &command_call("c1", &lease, "snapshot", json!({})),
        )
        .await;
    assert_eq!(snapshot.json()["result"]["ok"], json!(true), "{snapshot:?}");
    let commands = received(&gw.fakes[0], "agent_device.command");
    assert_eq!(
        commands.last().unwrap()["params"]["flags"]["serial"],
        json!(driver)
    );
    let devices = http.rpc(&gw.base(), &alice, &devices_call("d1")).await;
    assert_eq!(
        devices.json()["result"]["data"]["devices"][0]["id"],
        json!(driver),
        "{devices:?}"
    );
    let refused = http
        .rpc(
            &gw.base(),
            &bob,
            &command_call("b2", &lease, "snapshot", json!({})),
        )
        .await;
    assert_eq!(message(&refused), not_yours);
    let released = http
        .rpc(
            &gw.base(),
            &alice,
            &lease_call("r1", "lease.release", &lease),
        )
        .await;
    assert_eq!(released.json()["result"]["ok"], json!(true), "{released:?}");
    gw.fleet.wait_until(|fleet| fleet.lease_count() == 0).await;
    gw.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_published_cli_session_survives_its_workers_uplink_drop_without_allocating_again() {
    use simlock_contract::model::Connection;
    use simlock_e2e::agent_device::{Cli, real_package};
    let pkg = real_package();
    let mut gw = Gw::start(enabled_gateway()).await;
    let cable = gw.add_android_worker_via_cable().await;
    let (_, secret) = gw.token().await;
    let cli = Cli::new(&pkg, &gw.base(), &secret);
    cli.connect("android").await;
    // The first command allocates.
    let _ = cli.run(&["devices"]).await;
    list_the_leased_device(&gw, 0);
    let before = cli.run(&["snapshot"]).await;
    assert_eq!(before.json["success"], json!(true), "{before:?}");
    let simlock_lease = gw.leases().await[0]["id"].clone();
    // The lease as the worker's agent-device knows it.
    let lease = received(&gw.fakes[0], "agent_device.command")[0]["params"]["meta"]["leaseId"]
        .as_str()
        .unwrap()
        .to_owned();

    cable.cut();
    gw.wait_connection(0, Connection::Disconnected).await;
    let away = cli.run(&["snapshot"]).await;
    assert_eq!(away.json["success"], json!(false), "{away:?}");
    let shown = format!("{}{}", away.stdout, away.stderr);
    assert!(
        shown.contains(agent_device_front::relay_link::HOLDER_DISCONNECTED),
        "the CLI shows why: {away:?}"
    );

    cable.mend();
    gw.wait_connection(0, Connection::Connected).await;
    let after = cli.run(&["snapshot"]).await;
    assert_eq!(after.json["success"], json!(true), "{after:?}");
    let leases = gw.leases().await;
    assert_eq!(leases.len(), 1, "{leases:?}");
    assert_eq!(
        leases[0]["id"], simlock_lease,
        "the same lease after the drop"
    );
    assert_eq!(
        received(&gw.fakes[0], "agent_device.lease.allocate").len(),
        1,
        "the CLI never allocated again"
    );
    let sent = received(&gw.fakes[0], "agent_device.command");
    assert!(sent.len() >= 3, "{sent:?}");
    for sent in sent {
        assert_eq!(sent["params"]["meta"]["leaseId"], json!(lease), "{sent}");
    }
    let _ = cli.run(&["disconnect"]).await;
    gw.stop().await;
}

/// Either daemon's `lease.maxTtlMs` may be the lower: a lease through the gateway gets the lower
/// one (before, a gateway below its worker refused every allocate: the lease was renewed up to
/// the worker's bound, past its own), and its heartbeats renew it to that.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lease_gets_the_lower_of_the_gateways_and_its_workers_max_ttl_and_heartbeats_keep_it() {
    for (gateway_max, worker_max) in [(300_000, 600_000), (600_000, 300_000)] {
        let mut config = enabled_gateway();
        config.daemon.lease.max_ttl_ms = gateway_max;
        let mut gw = Gw::start(config).await;
        let mut config = worker(true, &[Platform::Android]);
        config.daemon.lease.max_ttl_ms = worker_max;
        gw.add(config).await;
        gw.wait_capable(0, true).await;
        let (_, secret) = gw.token().await;
        let http = Http::new();
        let lease = allocate(&http, &gw, &secret).await;
        let held = gw.fleet.worker(0).worker.lease(&lease).unwrap();
        assert_eq!(held.ttl_ms, 300_000, "{gateway_max} / {worker_max}");
        let allocated = received(&gw.fakes[0], "agent_device.lease.allocate");
        assert_eq!(allocated[0]["params"]["ttlMs"], json!(300_000));
        let beat = http
            .rpc(
                &gw.base(),
                &secret,
                &lease_call("h1", "lease.heartbeat", &lease),
            )
            .await;
        assert_eq!(beat.json()["result"]["ok"], json!(true), "{beat:?}");
        let renewed = gw.fleet.worker(0).worker.lease(&lease).unwrap();
        assert!(renewed.last_renewed_at >= held.last_renewed_at);
        assert_eq!(renewed.ttl_deadline, renewed.last_renewed_at + 300_000);
        gw.stop().await;
    }
}

/// simlock's own renewal headers between the gateway's front and the worker's host: the
/// heartbeat's renewal is the worker's, in the relay's round trip (no `lease.renew` goes down the
/// uplink), and never reaches the caller; what a caller sends under
/// those names is dropped, so a command cannot renew its lease to a TTL of its choosing (the
/// heartbeat the front sends after a command renews it to the front's).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_heartbeats_renewal_stays_between_gateway_and_worker_and_a_callers_is_dropped() {
    let mut gw = Gw::start(enabled_gateway()).await;
    let cable = gw.add_android_worker_via_cable().await;
    let (_, secret) = gw.token().await;
    let http = Http::new();
    let lease = allocate(&http, &gw, &secret).await;
    let held = gw.fleet.worker(0).worker.lease(&lease).unwrap();
    let bearer = format!("Bearer {secret}");
    let url = format!("{}/rpc", gw.base());
    let headers = [
        ("content-type", "application/json"),
        ("authorization", bearer.as_str()),
        (agent_device_front::renewal::RENEW_TTL_HEADER, "5000"),
        (agent_device_front::renewal::RENEWAL_HEADER, "lease-ended"),
    ];
    let forged = |call: Value| http.send(Method::POST, &url, &headers, call.to_string());
    list_the_leased_device(&gw, 0);
    // The renewal below is told by its time: one millisecond at least after the grant's.
    tokio::time::sleep(Duration::from_millis(5)).await;
    let opened = forged(command_call("c1", &lease, "open", json!({}))).await;
    assert_eq!(opened.json()["result"]["ok"], json!(true), "{opened:?}");
    // After the command the front heartbeats both leases back to its TTL (agent-device renewed
    // its own for 60 s on the command), whatever the command carried.
    tokio::time::timeout(PATIENCE, async {
        while gw
            .fleet
            .worker(0)
            .worker
            .lease(&lease)
            .unwrap()
            .last_renewed_at
            == held.last_renewed_at
        {
            tokio::task::yield_now().await;
        }
    })
    .await
    .expect("the lease was renewed after its command");
    let after = gw.fleet.worker(0).worker.lease(&lease).unwrap();
    assert_eq!(after.ttl_ms, 600_000, "the front's TTL, not the caller's");
    assert_eq!(after.ttl_deadline, after.last_renewed_at + 600_000);
    let kept = received(&gw.fakes[0], "agent_device.lease.heartbeat");
    assert_eq!(kept.len(), 1, "the heartbeat after the command");
    assert_eq!(kept[0]["params"]["ttlMs"], json!(600_000));
    cable.clear();
    let beat = forged(lease_call("h1", "lease.heartbeat", &lease)).await;
    assert_eq!(beat.json()["result"]["ok"], json!(true), "{beat:?}");
    assert!(
        cable.sent_down("\"relay.request\""),
        "the heartbeat's relay"
    );
    assert!(
        !cable.sent_down("\"lease.renew\""),
        "one round trip: the worker renewed, the gateway sent no renew of its own"
    );
    for name in [
        agent_device_front::renewal::RENEW_TTL_HEADER,
        agent_device_front::renewal::RENEWAL_HEADER,
    ] {
        assert!(!beat.headers.contains_key(name), "{name}: {beat:?}");
    }
    let renewed = gw.fleet.worker(0).worker.lease(&lease).unwrap();
    assert_eq!(renewed.ttl_ms, 600_000, "the front's TTL, not the caller's");
    assert_eq!(renewed.ttl_deadline, renewed.last_renewed_at + 600_000);
    assert_eq!(callers_heartbeats(&gw.fakes[0]), 1);
    gw.stop().await;
}

/// A gateway that stops while a relayed command waits on its worker answers it, naming the
/// stop (retriable), not the worker's absence.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_command_in_flight_when_the_gateway_stops_is_answered_naming_the_stop() {
    let mut gw = Gw::one_android_worker().await;
    let (_, secret) = gw.token().await;
    let lease = allocate(&Http::new(), &gw, &secret).await;
    let hold = gw.fakes[0].hold_commands("snapshot");
    let (base, token) = (gw.base(), secret.clone());
    let call = command_call("c1", &lease, "snapshot", json!({}));
    let running = tokio::spawn(async move { Http::new().rpc(&base, &token, &call).await });
    tokio::time::timeout(PATIENCE, hold.wait_entered(1))
        .await
        .unwrap();
    let mut events = gw.fleet.worker(0).running.base.bus.follow();
    gw.fleet.stop_gateway().await;
    let answer = running.await.unwrap();
    assert_eq!(answer.status, 503, "{answer:?}");
    let data = &answer.json()["error"]["data"];
    assert_eq!(data["code"], "UNAVAILABLE");
    assert_eq!(data["message"], stopping_message());
    assert_eq!(data["retriable"], json!(true));
    assert_eq!(answer.json()["id"], json!("c1"));
    // agent-device put its lease back to its 60 s default when the command came, and the
    // gateway is gone: the worker, which saw the exchange cut, keeps both leases to the
    // lease's TTL (agent-device's first), so the agent still has its device once a gateway is
    // back.
    tokio::time::timeout(PATIENCE, async {
        while events.recv().await.unwrap().event != "lease.renewed" {}
    })
    .await
    .expect("the worker kept the simlock lease after the cut exchange");
    let renewed = gw.fleet.worker(0).worker.lease(&lease).unwrap();
    assert_eq!(renewed.ttl_deadline, renewed.last_renewed_at + 600_000);
    let beats: Vec<Value> = received(&gw.fakes[0], "agent_device.lease.heartbeat")
        .into_iter()
        .filter(|b| b["id"].as_str().is_some_and(|id| id.ends_with(":keep")))
        .collect();
    assert_eq!(beats.len(), 1, "{beats:?}");
    let commanded = received(&gw.fakes[0], "agent_device.command");
    assert_eq!(
        beats[0]["params"]["leaseId"], commanded[0]["params"]["meta"]["leaseId"],
        "the command's lease, by the daemon's own id"
    );
    assert_eq!(beats[0]["params"]["ttlMs"], json!(600_000));
    hold.release();
    gw.stop().await;
}

/// An `/rpc` body past its bound through the gateway, chunked and sent whole before the caller
/// reads (as the CLI's `fetch` sends): the caller reads the 413 in agent-device's envelope, not
/// a reset, the connection serves its next request, and no worker was asked anything.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_rpc_body_past_its_bound_sent_whole_is_refused_and_the_connection_serves_on() {
    use simlock_test_support::raw_http::{chunked_request, read_response, send};
    let gw = Gw::one_android_worker().await;
    let (_, secret) = gw.token().await;
    let addr = gw.fleet.gateway().running.http_addr().unwrap();
    let mut stream = tokio::net::TcpStream::connect(addr).await.unwrap();
    let request = chunked_request(
        &format!(
            "POST /v1/agent-device/rpc HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n\
             Authorization: Bearer {secret}\r\n"
        ),
        2 * 1024 * 1024,
        b' ',
    );
    send(&mut stream, &request).await;
    let (status, body) = read_response(&mut stream).await;
    assert_eq!(status, 413, "{body}");
    let answer: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(
        answer["error"]["data"]["code"],
        json!("INVALID_ARGS"),
        "{body}"
    );
    send(
        &mut stream,
        b"GET /v1/agent-device/health HTTP/1.1\r\nHost: x\r\n\r\n",
    )
    .await;
    assert_eq!(read_response(&mut stream).await.0, 200);
    assert_eq!(rpcs(&gw.fakes[0]), 0, "no worker was asked anything");
    gw.stop().await;
}
