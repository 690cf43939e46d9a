//! The pieces of a fake worker: a [`Service`] served on a gateway's uplink, the way a worker
//! serves its pipeline there. A test writes only the calls it cares about and answers the rest
//! with [`bookkeeping`].

use std::sync::Arc;

use serde_json::Value;
use simlock_contract::model::{DaemonInfo, Health, HostFacts, LeaseLimits, Mode};
use simlock_contract::ops::{CatalogOutput, ConfigView, ListOutput, StatusOutput, SubscribeOutput};
use simlock_contract::{ContractError, Hello, ProtocolRange, Role};
use simlock_link::LinkHandle;
use simlock_wire::{Identity, Origin, Service, SessionConfig};

/// The subscription id a fake worker answers `events.subscribe` with, and pushes its events
/// under.
pub const SUBSCRIPTION: &str = "sub_1";

/// How a fake worker greets its gateway: the gateway is its admin, under the principal it
/// names (what `Service::greet` answers in every fake).
///
/// # Errors
/// None; the signature is `greet`'s.
pub fn greet_gateway(hello: &Hello) -> Result<Identity, ContractError> {
    Ok(Identity {
        role: Role::Admin,
        principal: hello.principal.clone().unwrap_or_default(),
    })
}

/// What a fake worker named `name` answers to the calls a gateway makes of every worker:
/// `status.get` (a running daemon with nothing else), `list.get` (no devices), `catalog.get` (no
/// platforms), `config.get` (lease limits of 1 s and 2 s) and `events.subscribe`. `None` for any
/// other operation.
pub fn bookkeeping(op: &str, name: &str) -> Option<Result<Value, ContractError>> {
    let value = match op {
        "status.get" => serde_json::to_value(StatusOutput::bare(
            DaemonInfo {
                health: Health::Running,
                mode: Mode::Worker,
                version: name.to_owned(),
                instance_id: name.to_owned(),
            },
            HostFacts {
                os: "linux".to_owned(),
                os_version: String::new(),
                arch: "x86_64".to_owned(),
                tools: Vec::new(),
            },
        )),
        "list.get" => serde_json::to_value(ListOutput::Devices(Vec::new())),
        "catalog.get" => serde_json::to_value(CatalogOutput {
            platforms: Vec::new(),
        }),
        "config.get" => serde_json::to_value(ConfigView {
            mode: Mode::Worker,
            lease: LeaseLimits {
                default_ttl_ms: 1000,
                max_ttl_ms: 2000,
            },
            settings: Default::default(),
        }),
        "events.subscribe" => serde_json::to_value(SubscribeOutput {
            subscribed: true,
            subscription_id: Some(simlock_contract::ids::SubscriptionId::from_raw(
                SUBSCRIPTION,
            )),
        }),
        _ => return None,
    };
    Some(value.map_err(|e| ContractError::internal(e.to_string())))
}

/// [`bookkeeping`], or `INTERNAL` ("not faked") for an operation it does not answer.
///
/// # Errors
/// `INTERNAL` for an operation a fake does not answer.
pub fn bookkeeping_or_refuse(op: &str, name: &str) -> Result<Value, ContractError> {
    bookkeeping(op, name).unwrap_or_else(|| Err(ContractError::internal("not faked")))
}

/// A fake worker: dials the gateway's uplink like a worker and serves `service` with the given
/// protocol range. Returns the link so the test can drop it.
///
/// # Panics
/// When the uplink cannot be dialled (the test fails).
#[allow(
    clippy::expect_used,
    reason = "a test helper fails the test by panicking"
)]
pub async fn fake_worker(
    gateway_url: &str,
    join_token: &str,
    worker_id: &str,
    service: Arc<dyn Service>,
    range: ProtocolRange,
) -> LinkHandle {
    let config = simlock_daemon::uplink::UplinkConfig {
        url: gateway_url.to_owned(),
        token: join_token.to_owned(),
        worker_id: worker_id.to_owned(),
        label: Some("fake".into()),
        tls: None,
    };
    let (link, text) = simlock_daemon::uplink::dial(&config)
        .await
        .expect("the fake worker dials");
    let transport = simlock_daemon::uplink::text_transport(&link, text);
    let session = SessionConfig {
        range,
        version: "fake".into(),
    };
    tokio::spawn(simlock_wire::serve_attached(
        transport,
        Origin::GatewayUplink,
        None,
        service,
        session,
    ));
    link
}

/// What a [`ProxyWorker`] does with a call once the real worker answered it, before the
/// gateway gets the answer: `op` and the answer, or the error. Tests hold answers back with it
/// (a view read that outlives a release, a worker that stalls).
pub type AnswerHook = Arc<
    dyn Fn(&str, &Result<Value, ContractError>) -> futures::future::BoxFuture<'static, ()>
        + Send
        + Sync,
>;

/// A worker in front of a real one: every call goes to the real worker over an admin session
/// (the gateway's `owner` left out: only an uplink may name one), every event of the real
/// worker goes up to the gateway, and each answer passes [`AnswerHook`] first.
pub struct ProxyWorker {
    real: simlock_wire::WireClient,
    hook: AnswerHook,
    gateway: parking_lot::Mutex<Option<Arc<simlock_wire::Connection>>>,
}

impl ProxyWorker {
    /// A proxy for the real worker behind `real`, whose unsolicited pushes are `pushes` (the
    /// session subscribes to the real worker's events when the gateway subscribes).
    pub fn new(
        real: simlock_wire::WireClient,
        mut pushes: simlock_wire::Unsolicited,
        hook: AnswerHook,
    ) -> Arc<Self> {
        let proxy = Arc::new(Self {
            real,
            hook,
            gateway: parking_lot::Mutex::new(None),
        });
        let weak = Arc::downgrade(&proxy);
        tokio::spawn(async move {
            while let Some(frame) = pushes.recv().await {
                let Some(proxy) = weak.upgrade() else { return };
                if let Ok(simlock_contract::Push::Event { event, .. }) =
                    simlock_contract::Push::from_frame(frame)
                    && let Some(conn) = proxy.gateway.lock().clone()
                {
                    conn.push_detached(&simlock_contract::Push::Event {
                        subscription_id: simlock_contract::ids::SubscriptionId::from_raw(
                            SUBSCRIPTION,
                        ),
                        event,
                    });
                }
            }
        });
        proxy
    }

    /// A hook that lets every answer through.
    pub fn no_hook() -> AnswerHook {
        Arc::new(|_, _| Box::pin(async {}))
    }
}

impl Service for ProxyWorker {
    fn greet(&self, _origin: Origin, hello: &Hello) -> Result<Identity, ContractError> {
        greet_gateway(hello)
    }

    fn dispatch(
        &self,
        ctx: simlock_wire::CallContext,
        op: String,
        payload: Option<Value>,
    ) -> futures::future::BoxFuture<'static, Result<Value, ContractError>> {
        let (real, hook) = (self.real.clone(), self.hook.clone());
        if op == "events.subscribe" {
            *self.gateway.lock() = Some(ctx.conn.clone());
        }
        Box::pin(async move {
            let mut payload = payload.unwrap_or_else(|| Value::Object(Default::default()));
            if let Some(fields) = payload.as_object_mut() {
                fields.remove("owner");
            }
            let answer = real.call_value(&op, payload).await;
            hook(&op, &answer).await;
            if op == "events.subscribe" {
                return bookkeeping_or_refuse(&op, "proxy");
            }
            answer
        })
    }
}
