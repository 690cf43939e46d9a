//! Relay test helpers: workers with relay targets in a [`TestFleet`], calls through its gateway's
//! relay, request and response bodies of known bytes, fake targets sharing a [`Probe`], a raw
//! gateway end for a real worker ([`RawUplink`]), a fake worker that speaks raw relay frames to
//! the real gateway ([`ScriptedWorker`]), and a log capture.

use std::pin::Pin;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use futures::FutureExt;
use futures::future::BoxFuture;
use http_body::{Body, Frame};
use http_body_util::BodyExt;
use parking_lot::Mutex;
use serde_json::{Value, json};
use simlock_contract::model::Connection as ViewConnection;
use simlock_contract::{ContractError, Hello, PROTOCOL_RANGE, PushFrame, Role};
use simlock_daemon::home::Home;
use simlock_daemon::uplink::{client_text_transport, text_transport};
use simlock_link::{Channel, End, LinkConfig, LinkHandle, TextReceiver};
use simlock_relay_gateway::{RelayBody, RelayCall};
use simlock_relay_worker::{BoxError, RelayRequest, RelayTarget, RelayTargets, ResponseBody};
use simlock_wire::{CallContext, CallEvent, CallHandle, Identity, Origin, Service, WireClient};
use simlock_worker::WorkerConfig;
use simlock_worker::{RunningWorker, WorkerOptions};
use tempfile::TempDir;
use tokio::net::TcpListener;
use tokio::sync::Notify;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use simlock_test_support::fake_worker::bookkeeping_or_refuse;

use crate::{PATIENCE, TestFleet, greet_gateway, worker_config};

/// Waits (bounded by [`PATIENCE`]) until `done` holds, checking every few milliseconds. For
/// states that have no event to wait on (a link's counters).
pub async fn wait_until(what: &str, done: impl Fn() -> bool) {
    let waited = tokio::time::timeout(PATIENCE, async {
        while !done() {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    })
    .await;
    assert!(waited.is_ok(), "timed out waiting until {what}");
}

/// Awaits `future`, failing the test if it takes longer than [`PATIENCE`] (a hang guard).
pub async fn patient<F: Future>(what: &str, future: F) -> F::Output {
    match tokio::time::timeout(PATIENCE, future).await {
        Ok(output) => output,
        Err(_) => panic!("timed out waiting for {what}"),
    }
}

/// Adds worker number `fleet.workers.len()` with `targets` (and a held start-up when `hold` is
/// given). Waits until the gateway has its uplink; with no hold, also its catalog.
pub async fn add_relay_worker(
    fleet: &mut TestFleet,
    config: WorkerConfig,
    targets: RelayTargets,
    hold: Option<CancellationToken>,
) -> usize {
    let n = fleet.workers.len();
    let catalog = hold.is_none();
    fleet
        .join_worker(
            n,
            config,
            |options| {
                options.relay_targets = targets;
                options.startup_hold = hold;
            },
            catalog,
        )
        .await;
    n
}

/// A gateway and one worker (`worker_config(2)`) serving `targets`; returns the fleet and the
/// worker's id.
pub async fn fleet_with(targets: RelayTargets) -> (TestFleet, String) {
    let mut fleet = TestFleet::start(crate::gateway_config()).await;
    add_relay_worker(&mut fleet, worker_config(2), targets, None).await;
    let id = fleet.worker_id(0);
    (fleet, id)
}

/// [`fleet_with`] over TLS: the gateway serves HTTPS and WSS, the worker dials `wss://`.
pub async fn fleet_with_tls(targets: RelayTargets) -> (TestFleet, String) {
    let mut fleet = TestFleet::start_tls(crate::gateway_config()).await;
    add_relay_worker(&mut fleet, worker_config(2), targets, None).await;
    let id = fleet.worker_id(0);
    (fleet, id)
}

// === Calls through the gateway's relay ===

/// Relays `call` to `worker` through the fleet's gateway, bounded by [`PATIENCE`].
///
/// # Errors
/// The relay's error.
pub async fn relay<B>(
    fleet: &TestFleet,
    worker: &str,
    call: RelayCall<B>,
) -> Result<http::Response<RelayBody>, ContractError>
where
    B: Body + Send + 'static,
    B::Data: Send,
    B::Error: Into<BoxError>,
{
    patient("the relay", fleet.gateway().relay.relay(worker, call)).await
}

/// Starts relaying `call` to `worker` in a task (for callers that abort it, or that wait for
/// something else meanwhile).
pub fn spawn_relay<B>(
    fleet: &TestFleet,
    worker: &str,
    call: RelayCall<B>,
) -> JoinHandle<Result<http::Response<RelayBody>, ContractError>>
where
    B: Body + Send + 'static,
    B::Data: Send,
    B::Error: Into<BoxError>,
{
    let relay = fleet.gateway().relay.clone();
    let worker = worker.to_owned();
    tokio::spawn(async move { relay.relay(&worker, call).await })
}

/// A GET of `http://t.test/` for `target` as tenant `t`.
pub fn get_call(target: &str) -> RelayCall<http_body_util::Empty<Bytes>> {
    RelayCall::new(target, get("http://t.test/"), "t")
}

/// A PUT of `body` to `http://t.test/` for `target` as tenant `t`.
pub fn put_call<B>(target: &str, body: B) -> RelayCall<B> {
    RelayCall::new(
        target,
        request(http::Method::PUT, "http://t.test/", body),
        "t",
    )
}

/// The counters of the gateway's link to `worker` (its uplink must be up).
pub fn gateway_link_stats(fleet: &TestFleet, worker: &str) -> simlock_link::LinkStats {
    fleet
        .gateway()
        .fleet
        .conn(worker)
        .expect("the worker's uplink is up")
        .link
        .stats()
}

/// Waits until the gateway holds no open channel to `worker` (or has no uplink to it).
pub async fn no_channel_open(fleet: &TestFleet, worker: &str) {
    wait_until("every channel to the worker is closed", || {
        fleet
            .gateway()
            .fleet
            .conn(worker)
            .is_none_or(|c| c.link.stats().open_channels == 0)
    })
    .await;
}

/// Collects a call's pushes up to its reply (each event bounded by [`PATIENCE`]).
pub async fn pushes_and_reply(
    mut call: CallHandle,
) -> (Vec<PushFrame>, Result<Value, ContractError>) {
    let mut pushes = Vec::new();
    loop {
        match patient("the call's next event", call.next()).await {
            CallEvent::Push(push) => pushes.push(push),
            CallEvent::Reply(reply) => {
                return (
                    pushes,
                    reply.and_then(|raw| simlock_wire::decode_value(&raw)),
                );
            }
        }
    }
}

/// A GET of `url` with no body.
pub fn get(url: &str) -> http::Request<http_body_util::Empty<Bytes>> {
    request(http::Method::GET, url, http_body_util::Empty::new())
}

/// A request of `method` to `url` with `body`.
pub fn request<B>(method: http::Method, url: &str, body: B) -> http::Request<B> {
    let mut request = http::Request::new(body);
    *request.method_mut() = method;
    *request.uri_mut() = url.parse().expect("a valid test URL");
    request
}

/// Reads a body to its end (bounded by [`PATIENCE`]).
///
/// # Errors
/// The body's error.
pub async fn read_body<B>(body: B) -> Result<Vec<u8>, B::Error>
where
    B: Body,
    B::Data: bytes::Buf,
{
    use bytes::Buf;
    let mut out = Vec::new();
    let mut body = std::pin::pin!(body);
    loop {
        let frame = patient("a body frame", body.frame()).await;
        match frame {
            None => return Ok(out),
            Some(Err(e)) => return Err(e),
            Some(Ok(frame)) => {
                if let Ok(mut data) = frame.into_data() {
                    while data.has_remaining() {
                        let chunk = data.chunk();
                        out.extend_from_slice(chunk);
                        let n = chunk.len();
                        data.advance(n);
                    }
                }
            }
        }
    }
}

// === Known bytes ===

/// The chunk size of the pattern bodies.
const CHUNK: usize = 64 * 1024;

/// Word `index` (bytes `8 * index..8 * index + 8`) of the pattern `seed`: every word encodes its
/// index, so a lost, repeated or reordered piece shows.
fn pattern_word(seed: u64, index: u64) -> [u8; 8] {
    index
        .wrapping_mul(0x9E37_79B9_7F4A_7C15)
        .wrapping_add(seed)
        .rotate_left(17)
        .to_le_bytes()
}

/// The byte at `offset` of the pattern `seed`.
pub fn pattern_byte(seed: u64, offset: u64) -> u8 {
    pattern_word(seed, offset / 8)[usize::try_from(offset % 8).unwrap_or(0)]
}

/// Fills `buf` with the pattern `seed` from `offset`.
pub fn fill_pattern(seed: u64, offset: u64, buf: &mut [u8]) {
    let mut at = offset;
    let mut rest = &mut buf[..];
    // Byte by byte up to a word boundary, then whole words.
    while !rest.is_empty() && !at.is_multiple_of(8) {
        rest[0] = pattern_byte(seed, at);
        rest = &mut rest[1..];
        at += 1;
    }
    let mut words = rest.chunks_exact_mut(8);
    for word in &mut words {
        word.copy_from_slice(&pattern_word(seed, at / 8));
        at += 8;
    }
    for byte in words.into_remainder() {
        *byte = pattern_byte(seed, at);
        at += 1;
    }
}

/// `len` bytes of the pattern `seed`.
pub fn pattern(seed: u64, len: usize) -> Vec<u8> {
    let mut out = vec![0; len];
    fill_pattern(seed, 0, &mut out);
    out
}

/// Checks a stream of bytes against the pattern `seed`, chunk by chunk, in constant memory.
#[derive(Debug, Clone)]
pub struct PatternCheck {
    seed: u64,
    /// Bytes checked so far.
    pub offset: u64,
    /// Whether every byte so far matched.
    pub ok: bool,
    scratch: Vec<u8>,
}

impl PatternCheck {
    /// A check of the pattern `seed` from its start.
    pub fn new(seed: u64) -> Self {
        Self {
            seed,
            offset: 0,
            ok: true,
            scratch: Vec::new(),
        }
    }

    /// Checks the next `chunk`.
    pub fn feed(&mut self, chunk: &[u8]) {
        self.scratch.resize(chunk.len(), 0);
        fill_pattern(self.seed, self.offset, &mut self.scratch);
        self.ok &= self.scratch == chunk;
        self.offset += chunk.len() as u64;
    }
}

/// A caller's request body of `len` pattern bytes in 64 KiB chunks, counting what was pulled;
/// it can fail after `fail_after` bytes, and it tells when it is dropped.
#[derive(Debug)]
pub struct PatternBody {
    seed: u64,
    len: u64,
    sent: u64,
    fail_after: Option<u64>,
    /// Bytes pulled so far.
    pub pulled: Arc<AtomicU64>,
    /// Fires when the body is dropped.
    pub dropped: CancellationToken,
}

impl PatternBody {
    /// `len` bytes of the pattern `seed`.
    pub fn new(seed: u64, len: u64) -> Self {
        Self {
            seed,
            len,
            sent: 0,
            fail_after: None,
            pulled: Arc::new(AtomicU64::new(0)),
            dropped: CancellationToken::new(),
        }
    }

    /// The same body, failing once `after` bytes were pulled.
    #[must_use]
    pub fn failing_after(mut self, after: u64) -> Self {
        self.fail_after = Some(after);
        self
    }
}

impl Drop for PatternBody {
    fn drop(&mut self) {
        self.dropped.cancel();
    }
}

impl Body for PatternBody {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        _cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        if self.fail_after.is_some_and(|after| self.sent >= after) {
            return Poll::Ready(Some(Err("the caller's upload broke".into())));
        }
        if self.sent >= self.len {
            return Poll::Ready(None);
        }
        let take = (self.len - self.sent).min(CHUNK as u64);
        let mut buf = vec![0; usize::try_from(take).unwrap_or(0)];
        fill_pattern(self.seed, self.sent, &mut buf);
        self.sent += take;
        self.pulled.fetch_add(take, Ordering::SeqCst);
        Poll::Ready(Some(Ok(Frame::data(Bytes::from(buf)))))
    }

    fn is_end_stream(&self) -> bool {
        self.sent >= self.len && self.fail_after.is_none()
    }
}

/// A response body of `len` pattern bytes for a target, in 64 KiB chunks, counting what the
/// worker pulled.
pub fn pattern_response(seed: u64, len: u64, pulled: Arc<AtomicU64>) -> ResponseBody {
    let stream = futures::stream::unfold(0u64, move |sent| {
        let pulled = pulled.clone();
        async move {
            if sent >= len {
                return None;
            }
            let take = (len - sent).min(CHUNK as u64);
            let mut buf = vec![0; usize::try_from(take).unwrap_or(0)];
            fill_pattern(seed, sent, &mut buf);
            pulled.fetch_add(take, Ordering::SeqCst);
            Some((Ok::<_, BoxError>(Bytes::from(buf)), sent + take))
        }
    });
    simlock_relay_worker::stream_body(stream)
}

// === What a target saw ===

/// One request a recording target received.
#[derive(Debug, Clone)]
pub struct Seen {
    /// The method.
    pub method: http::Method,
    /// The URL.
    pub uri: http::Uri,
    /// The headers.
    pub headers: http::HeaderMap,
    /// The tenant.
    pub tenant: String,
    /// The lease id.
    pub lease_id: Option<String>,
}

/// Counters and signals a test shares with its fake targets.
#[derive(Debug)]
pub struct Probe {
    /// Requests received, in order.
    pub seen: Mutex<Vec<Seen>>,
    /// Calls received.
    pub calls: AtomicUsize,
    /// Targets whose cancellation fired.
    pub cancelled: AtomicUsize,
    /// Wakes whoever waits on a change of the counters above.
    pub changed: Notify,
    /// Set while a target wants to be released.
    pub release: CancellationToken,
    /// Request bytes targets read.
    pub read: AtomicU64,
    /// Permits for targets that answer one at a time (none at first).
    pub permits: tokio::sync::Semaphore,
}

impl Probe {
    /// A new probe.
    pub fn new() -> Arc<Self> {
        Arc::new(Self {
            seen: Mutex::new(Vec::new()),
            calls: AtomicUsize::new(0),
            cancelled: AtomicUsize::new(0),
            changed: Notify::new(),
            release: CancellationToken::new(),
            read: AtomicU64::new(0),
            permits: tokio::sync::Semaphore::new(0),
        })
    }

    /// Records a call.
    pub fn record(&self, request: &RelayRequest) {
        self.seen.lock().push(Seen {
            method: request.request.method().clone(),
            uri: request.request.uri().clone(),
            headers: request.request.headers().clone(),
            tenant: request.tenant.clone(),
            lease_id: request.lease_id.clone(),
        });
        self.calls.fetch_add(1, Ordering::SeqCst);
        self.changed.notify_waiters();
    }

    /// Counts a cancellation once `cancel` fires (spawned).
    pub fn watch_cancel(self: &Arc<Self>, cancel: CancellationToken) {
        let probe = self.clone();
        tokio::spawn(async move {
            cancel.cancelled().await;
            probe.cancelled.fetch_add(1, Ordering::SeqCst);
            probe.changed.notify_waiters();
        });
    }

    /// Waits until `done` holds for this probe.
    pub async fn wait(&self, what: &str, done: impl Fn(&Self) -> bool) {
        patient(what, async {
            loop {
                let changed = self.changed.notified();
                if done(self) {
                    return;
                }
                changed.await;
            }
        })
        .await;
    }

    /// Waits until the targets got `n` calls in all, and fails at once if they got more.
    pub async fn wait_calls(&self, n: usize) {
        self.wait_calls_at_least(n).await;
        assert_eq!(self.calls.load(Ordering::SeqCst), n, "target calls");
    }

    /// Waits until the targets got at least `n` calls in all.
    pub async fn wait_calls_at_least(&self, n: usize) {
        self.wait(&format!("{n} target calls"), |p| {
            p.calls.load(Ordering::SeqCst) >= n
        })
        .await;
    }

    /// Waits until `n` targets saw their cancellation fire, and fails at once if more did.
    pub async fn wait_cancelled(&self, n: usize) {
        self.wait(&format!("{n} cancelled targets"), |p| {
            p.cancelled.load(Ordering::SeqCst) >= n
        })
        .await;
        assert_eq!(
            self.cancelled.load(Ordering::SeqCst),
            n,
            "cancelled targets"
        );
    }

    /// Reads a target's request body to its end, counting the bytes in [`Self::read`].
    ///
    /// # Errors
    /// The body's error (the relay's channel failed).
    pub async fn drain(
        &self,
        body: simlock_relay_worker::RequestBody,
    ) -> Result<Vec<u8>, BoxError> {
        let mut out = Vec::new();
        let mut body = std::pin::pin!(body);
        while let Some(frame) = body.frame().await {
            let data = frame?.into_data().unwrap_or_default();
            self.read.fetch_add(data.len() as u64, Ordering::SeqCst);
            out.extend_from_slice(&data);
        }
        Ok(out)
    }

    /// A target that records each call and counts its cancellation with this probe, then
    /// answers with `answer`.
    pub fn target<F, Fut>(self: &Arc<Self>, answer: F) -> Arc<dyn RelayTarget>
    where
        F: Fn(Arc<Self>, RelayRequest) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Result<http::Response<ResponseBody>, BoxError>> + Send + 'static,
    {
        let probe = self.clone();
        Arc::new(move |request: RelayRequest| {
            probe.record(&request);
            probe.watch_cancel(request.cancel.clone());
            answer(probe.clone(), request)
        })
    }
}

/// A registry of `targets` by name.
pub fn relay_targets(targets: Vec<(&str, Arc<dyn RelayTarget>)>) -> RelayTargets {
    let mut registry = RelayTargets::new();
    for (name, target) in targets {
        registry.insert(name, target).expect("a capability name");
    }
    registry
}

/// A target's response with `status` and `body`.
pub fn respond(status: u16, body: ResponseBody) -> http::Response<ResponseBody> {
    let mut response = http::Response::new(body);
    *response.status_mut() = http::StatusCode::from_u16(status).expect("a valid status");
    response
}

// === Log capture ===

/// Warnings and errors logged in this test process, for tests that check what was logged.
#[derive(Debug, Clone, Default)]
pub struct Logs {
    text: Arc<Mutex<String>>,
}

impl Logs {
    /// Whether some line logged so far contains every one of `parts`.
    pub fn has_line(&self, parts: &[&str]) -> bool {
        self.text
            .lock()
            .lines()
            .any(|line| parts.iter().all(|part| line.contains(part)))
    }
}

struct LogWriter(Arc<Mutex<String>>);

impl std::io::Write for LogWriter {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().push_str(&String::from_utf8_lossy(buf));
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// Installs (once per process) a subscriber that keeps every warning and error, and returns it.
pub fn logs() -> Logs {
    static LOGS: OnceLock<Logs> = OnceLock::new();
    LOGS.get_or_init(|| {
        let logs = Logs::default();
        let text = logs.text.clone();
        let _ = tracing_subscriber::fmt()
            .with_max_level(tracing::Level::WARN)
            .with_ansi(false)
            .with_writer(move || LogWriter(text.clone()))
            .try_init();
        logs
    })
    .clone()
}

// === A raw gateway end for a real worker ===

/// The gateway's end of a real worker's uplink, held by the test: the link (to open channels)
/// and a wire client (to call the worker as the gateway does).
pub struct RawUplink {
    /// The link, gateway end.
    pub link: LinkHandle,
    /// The wire client on its text lane, greeted as the gateway.
    pub client: WireClient,
}

/// A real worker whose uplink dials a [`RawUplink`] the test holds.
pub struct RawWorker {
    /// The worker.
    pub worker: Option<RunningWorker>,
    /// Its uplink.
    pub uplink: RawUplink,
    /// Opens the worker's start-up when it was started held.
    pub hold: CancellationToken,
    _dir: TempDir,
}

impl RawWorker {
    /// Starts a worker with `targets` whose uplink reaches a raw gateway end built with
    /// `link_config` (gateway end). With `held`, its start-up waits for [`Self::hold`].
    pub async fn start(targets: RelayTargets, held: bool, link_config: LinkConfig) -> Self {
        Self::start_with(worker_config(2), targets, held, link_config).await
    }

    /// [`Self::start`] with a worker configuration of the test's.
    pub async fn start_with(
        mut config: WorkerConfig,
        targets: RelayTargets,
        held: bool,
        link_config: LinkConfig,
    ) -> Self {
        let dir = tempfile::tempdir().expect("a temporary directory");
        let listener = TcpListener::bind("127.0.0.1:0")
            .await
            .expect("a loopback listener");
        let addr = listener.local_addr().expect("an address");
        config.daemon.gateway.url = Some(format!("ws://{addr}"));
        config.daemon.gateway.token = Some("slk_test".into());
        config.daemon.gateway.label = Some("raw".into());
        let mut options = WorkerOptions::new(Home::at(dir.path().join("worker")), config);
        options.relay_targets = targets;
        let hold = CancellationToken::new();
        if held {
            options.startup_hold = Some(hold.clone());
        } else {
            hold.cancel();
        }
        let worker = simlock_worker::start(options)
            .await
            .expect("the worker starts");
        let uplink = accept_uplink(&listener, link_config).await;
        Self {
            worker: Some(worker),
            uplink,
            hold,
            _dir: dir,
        }
    }

    /// The worker.
    pub fn worker(&self) -> &RunningWorker {
        self.worker.as_ref().expect("the worker runs")
    }

    /// Opens a channel on the uplink (bounded by [`PATIENCE`]).
    pub async fn open(&self) -> Channel {
        patient(
            "a channel",
            self.uplink.link.open_channel(&CancellationToken::new()),
        )
        .await
        .expect("a channel opens")
    }

    /// Starts `op` on the worker as the gateway does, taking its pushes.
    pub async fn begin(&self, op: &str, payload: Value) -> CallHandle {
        patient(op, self.uplink.client.begin(op, payload, 64))
            .await
            .expect("the call starts")
    }

    /// Calls `op` on the worker as the gateway does (bounded by [`PATIENCE`]).
    ///
    /// # Errors
    /// The worker's error.
    pub async fn call(&self, op: &str, payload: Value) -> Result<Value, ContractError> {
        patient(op, self.uplink.client.call_value(op, payload)).await
    }

    /// Stops the worker.
    pub async fn stop(mut self) {
        self.hold.cancel();
        if let Some(worker) = self.worker.take() {
            worker.stop("test").await;
        }
    }
}

async fn accept_uplink(listener: &TcpListener, link_config: LinkConfig) -> RawUplink {
    let (stream, _) = patient("the worker's uplink", listener.accept())
        .await
        .expect("the worker dials");
    let _ = simlock_link::tune_tcp(&stream);
    let receive_buffer = simlock_link::ReceiveBuffer::of(&stream);
    let ws =
        tokio_tungstenite::accept_async_with_config(stream, Some(simlock_link::websocket_config()))
            .await
            .expect("the WebSocket upgrade");
    let (link, text) = simlock_link::spawn_tuned(ws, link_config, receive_buffer);
    let (client, _unsolicited) = WireClient::new(client_text_transport(&link, text));
    let hello = Hello {
        client_version: Some("raw-gateway".into()),
        protocol_version: None,
        protocol_range: Some(PROTOCOL_RANGE),
        principal: Some("gw:raw".into()),
        credential: None,
    };
    let reply = patient("the worker's hello", client.hello(&hello))
        .await
        .expect("the worker greets the gateway");
    assert_eq!(reply.role, Role::Admin);
    RawUplink { link, client }
}

/// A `relay.request` payload for the raw uplink: a GET of `http://target.test/` to `target`
/// on `channel`.
pub fn raw_request(relay_id: &str, target: &str, channel: &str) -> Value {
    json!({
        "relayId": relay_id,
        "target": target,
        "method": "GET",
        "url": "http://target.test/",
        "headers": [],
        "tenant": "tenant-1",
        "hasBody": false,
        "channel": channel,
    })
}

// === A scripted worker for the real gateway ===

/// One `relay.request` as a scripted worker sees it: its payload, the means to accept its
/// channel (in line order, while the script's closure runs), and to push.
pub struct ScriptedCall {
    /// The call's payload.
    pub payload: Value,
    /// The call's context (for pushes).
    pub ctx: CallContext,
}

impl ScriptedCall {
    /// Accepts the channel the call names. Call it in the script's closure, not in its future,
    /// to accept in line order as a worker does.
    pub fn accept(&self) -> Option<Channel> {
        let id = self.payload["channel"].as_str()?;
        self.ctx
            .conn
            .attachment::<LinkHandle>()
            .and_then(|link| link.accept_channel(id).ok())
    }

    /// The link of the call's connection (the worker's end of the uplink).
    pub fn link(&self) -> Arc<LinkHandle> {
        self.ctx
            .conn
            .attachment::<LinkHandle>()
            .expect("a scripted worker's connection carries its link")
    }

    /// The relay id.
    pub fn relay_id(&self) -> String {
        self.payload["relayId"]
            .as_str()
            .unwrap_or_default()
            .to_owned()
    }

    /// Pushes a `relay-head` with `status` and `headers`.
    pub async fn head(&self, status: u16, headers: Vec<(String, String)>) {
        let push = simlock_contract::Push::RelayHead {
            request_id: self.ctx.id.clone(),
            status,
            headers,
        };
        self.ctx.push(&push).await.expect("the head is pushed");
    }
}

type Script =
    Arc<dyn Fn(ScriptedCall) -> BoxFuture<'static, Result<Value, ContractError>> + Send + Sync>;

/// A fake worker that greets the gateway like a worker and answers `relay.request` with a
/// script; it records the `relay.cancel`s it receives.
pub struct ScriptedWorker {
    script: Script,
    /// Relay ids of the `relay.cancel`s received.
    pub cancels: Mutex<Vec<String>>,
    /// Wakes on every `relay.cancel`.
    pub cancelled: Notify,
}

impl ScriptedWorker {
    /// Dials `fleet`'s gateway as worker `worker_id` with `link_config` (worker end) and serves
    /// `script`; waits until the gateway lists it connected. Returns the worker and its link.
    pub async fn start(
        fleet: &TestFleet,
        worker_id: &str,
        link_config: LinkConfig,
        script: impl Fn(ScriptedCall) -> BoxFuture<'static, Result<Value, ContractError>>
        + Send
        + Sync
        + 'static,
    ) -> (Arc<Self>, LinkHandle) {
        let worker = Arc::new(Self {
            script: Arc::new(script),
            cancels: Mutex::new(Vec::new()),
            cancelled: Notify::new(),
        });
        let (link, text) = dial(
            &fleet.gateway_url(),
            &fleet.join_token,
            worker_id,
            link_config,
        )
        .await;
        let transport = text_transport(&link, text);
        tokio::spawn(simlock_wire::serve_attached(
            transport,
            Origin::GatewayUplink,
            Some(Arc::new(link.clone())),
            worker.clone(),
            simlock_wire::SessionConfig {
                range: PROTOCOL_RANGE,
                version: "scripted".into(),
            },
        ));
        let id = worker_id.to_owned();
        fleet
            .wait_for(|views| {
                views
                    .iter()
                    .any(|v| v.id == id && v.connection == ViewConnection::Connected)
            })
            .await;
        (worker, link)
    }

    /// Waits until `count` `relay.cancel`s arrived.
    pub async fn wait_cancels(&self, count: usize) {
        self.wait_cancels_until("relay.cancels", |ids| ids.len() >= count)
            .await;
    }

    /// Waits for a `relay.cancel` of `relay_id`.
    pub async fn wait_cancel(&self, relay_id: &str) {
        self.wait_cancels_until("a relay.cancel", |ids| ids.iter().any(|id| id == relay_id))
            .await;
    }

    async fn wait_cancels_until(&self, what: &str, done: impl Fn(&[String]) -> bool) {
        patient(what, async {
            loop {
                let notified = self.cancelled.notified();
                if done(&self.cancels.lock()) {
                    return;
                }
                notified.await;
            }
        })
        .await;
    }
}

impl Service for ScriptedWorker {
    fn greet(&self, _origin: Origin, hello: &Hello) -> Result<Identity, ContractError> {
        greet_gateway(hello)
    }

    fn dispatch(
        &self,
        ctx: CallContext,
        op: String,
        payload: Option<Value>,
    ) -> BoxFuture<'static, Result<Value, ContractError>> {
        match op.as_str() {
            "relay.request" => (self.script)(ScriptedCall {
                payload: payload.unwrap_or(Value::Null),
                ctx,
            }),
            "relay.cancel" => {
                let id = payload
                    .as_ref()
                    .and_then(|p| p["relayId"].as_str())
                    .unwrap_or_default()
                    .to_owned();
                self.cancels.lock().push(id);
                self.cancelled.notify_waiters();
                async { Ok(json!({})) }.boxed()
            }
            other => {
                let answer = bookkeeping_or_refuse(other, "scripted");
                async move { answer }.boxed()
            }
        }
    }
}

/// Dials a gateway's uplink as `worker_id` with `link_config` (worker end).
pub async fn dial(
    gateway_url: &str,
    join_token: &str,
    worker_id: &str,
    link_config: LinkConfig,
) -> (LinkHandle, TextReceiver) {
    let config = simlock_daemon::uplink::UplinkConfig {
        url: gateway_url.to_owned(),
        token: join_token.to_owned(),
        worker_id: worker_id.to_owned(),
        label: None,
        tls: None,
    };
    simlock_daemon::uplink::dial_with(&config, link_config)
        .await
        .expect("the uplink dials")
}

/// A link configuration for `end` with `stall` as its stall timeout and `accept` as its
/// accept timeout.
pub fn link_config(end: End, stall: Duration, accept: Duration) -> LinkConfig {
    let mut config = LinkConfig::new(end);
    config.stall_timeout = stall;
    config.accept_timeout = accept;
    config
}
