//! The gateway half of the relay: [`GatewayRelay`] hands one HTTP exchange to a relay target on a
//! worker over the worker's uplink and returns the response with a streaming body.
//!
//! One exchange: open a link channel to the worker (waiting, first come first served, while 64
//! are open), send `relay.request` naming it, pipe the caller's request body into the channel's
//! request direction, wait for the `relay-head` push, and hand back an [`http::Response`] whose
//! [`RelayBody`] reads the channel's response direction until its END (never until the `{}`
//! answer). One deadline (330 000 ms by default) covers the channel wait and both bodies.
//! Dropping the future or the body is the caller's abort: `relay.cancel` goes to the worker and
//! the channel is aborted.
//!
//! Failures, as the caller sees them (design §6):
//!
//! | what | before the head | after the head (the body errors) |
//! |---|---|---|
//! | no live uplink | `WORKER_UNREACHABLE`, nothing sent | — |
//! | channel `closed` / uplink lost | `WORKER_UNREACHABLE` | `WORKER_UNREACHABLE` |
//! | channel `stalled` | `INTERNAL` naming the worker and the stall timeout | the same |
//! | channel `aborted` by the worker | the worker's `relay.request` error, else `INTERNAL` | the same |
//! | channel `refused` | `INTERNAL` naming the worker | — |
//! | request direction `stopped` | not an error: the caller's body is no longer read | — |
//! | deadline | `WORKER_UNREACHABLE`: `worker <id> did not finish the relayed request within <n> ms` | the same |
//! | invalid `relay-head` | `INTERNAL` naming the worker; `relay.cancel` | — |
//! | `{}` before a head, or `{cancelled: true}` unasked | `INTERNAL`: `worker <id> ended the relay without a response` | — |
//! | the caller cancels or its body fails | `CANCELLED` | `CANCELLED` |
//!
//! Every exchange ends with one `relay ended` log line naming its outcome (`ok`, `cancelled`,
//! `deadline`, `uplink lost`, …; a warning for a stall, a refused channel, a worker's abort or a
//! broken protocol). The worker cannot tell them apart: it answers `{cancelled: true}` to every
//! relay the gateway cancelled.
#![warn(missing_docs)]

use std::collections::VecDeque;
use std::fmt;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::task::{Context, Poll, Waker};
use std::time::Duration;

use bytes::{Buf, Bytes};
use http_body::{Body, Frame, SizeHint};
use http_body_util::BodyExt;
use parking_lot::Mutex;
use serde_json::json;
use simlock_contract::bounds::{self, RELAY_GATEWAY_CREDENTIAL_HEADERS};
use simlock_contract::ops::{RelayMethod, RelayRequest, RelayRequestInput, RelayRequestOutput};
use simlock_contract::{ContractError, ErrorCode, Push};
use simlock_fleet::error::{from_worker, is_uplink_lost, unreachable};
use simlock_fleet::{Fleet, WorkerConn};
use simlock_link::{ChannelError, ChannelReader, ChannelWriter, FailureReason};
use simlock_wire::CallEvent;
use tokio::sync::{mpsc, oneshot};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};

/// The default deadline of one exchange: agent-device's proxy allows 300 s, plus a margin.
pub const DEFAULT_DEADLINE: Duration = Duration::from_millis(330_000);

/// How long the gateway waits for a `relay.cancel` to be answered (it is sent and forgotten).
const CANCEL_TIMEOUT: Duration = Duration::from_secs(10);

/// Response bytes read ahead before the head arrives (a worker's body may overtake its head, and
/// a failing channel is seen even before the head). Under half the initial window, so reading
/// ahead never grants credit: a caller that never reads still holds at most one window.
const READ_AHEAD: usize = 64 * 1024;

/// An error a caller's request body may carry: the daemon's one error box.
pub use simlock_daemon::http::body::BoxError;

/// How a [`GatewayRelay`] works.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RelayOptions {
    /// The deadline of one exchange, from the call to the response body's END.
    pub deadline: Duration,
    /// The link's stall timeout on the gateway's uplinks, for the stall message.
    pub stall_timeout: Duration,
}

impl Default for RelayOptions {
    fn default() -> Self {
        Self {
            deadline: DEFAULT_DEADLINE,
            stall_timeout: simlock_link::config::STALL_TIMEOUT,
        }
    }
}

/// One exchange to relay: the target's capability name, the request (absolute URL, streaming
/// body), and whose it is on the worker.
#[derive(Debug)]
pub struct RelayCall<B> {
    /// The relay target on the worker (a capability name).
    pub target: String,
    /// The request. Its URI must be an absolute `http:` or `https:` URL.
    pub request: http::Request<B>,
    /// Whose the exchange is, on the worker (1–300 characters).
    pub tenant: String,
    /// The lease the exchange is for (32 lower-case hex), if any.
    pub lease_id: Option<String>,
    /// The caller's abort signal, besides dropping the future or the body: firing it fails the
    /// relay with `CANCELLED` (or errors the body), sends `relay.cancel` and aborts the channel.
    pub cancel: Option<CancellationToken>,
}

impl<B> RelayCall<B> {
    /// An exchange for `target` as `tenant`, with no lease and no abort signal.
    pub fn new(
        target: impl Into<String>,
        request: http::Request<B>,
        tenant: impl Into<String>,
    ) -> Self {
        Self {
            target: target.into(),
            request,
            tenant: tenant.into(),
            lease_id: None,
            cancel: None,
        }
    }
}

/// The gateway's relay. Cheap to clone.
#[derive(Clone)]
pub struct GatewayRelay {
    fleet: Arc<Fleet>,
    options: RelayOptions,
}

impl fmt::Debug for GatewayRelay {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("GatewayRelay")
            .field("options", &self.options)
            .finish_non_exhaustive()
    }
}

/// Relay ids, unique in the process (a worker requires them unique among a connection's
/// active relays).
static NEXT_RELAY: AtomicU64 = AtomicU64::new(1);

impl GatewayRelay {
    /// A relay over `fleet`'s uplinks.
    pub fn new(fleet: Arc<Fleet>, options: RelayOptions) -> Self {
        Self { fleet, options }
    }

    /// Its options.
    pub const fn options(&self) -> &RelayOptions {
        &self.options
    }

    /// The same relay with another deadline (for callers, and tests, that need a shorter one).
    #[must_use]
    pub fn with_deadline(&self, deadline: Duration) -> Self {
        Self {
            fleet: self.fleet.clone(),
            options: RelayOptions {
                deadline,
                ..self.options
            },
        }
    }

    /// Relays `call` to `worker_id`'s relay target and returns its response once the head came;
    /// the body streams from the worker until its END.
    ///
    /// # Errors
    /// `BAD_REQUEST` for a request the relay cannot carry (before anything is sent);
    /// `WORKER_UNREACHABLE` when the worker has no live uplink, the uplink is lost, or the
    /// deadline passes; the worker's error (`RELAY_TARGET_MISSING`, `INTERNAL`, …); `INTERNAL`
    /// when the worker breaks the relay protocol; `CANCELLED` when the caller's signal fires or
    /// its body fails.
    pub async fn relay<B>(
        &self,
        worker_id: &str,
        call: RelayCall<B>,
    ) -> Result<http::Response<RelayBody>, ContractError>
    where
        B: Body + Send + 'static,
        B::Data: Send,
        B::Error: Into<BoxError>,
    {
        // A deadline past what the clock can hold is no deadline (a year stands in for it).
        let now = Instant::now();
        let deadline = now
            .checked_add(self.options.deadline)
            .unwrap_or_else(|| now + Duration::from_secs(365 * 24 * 3600));
        let RelayCall {
            target,
            request,
            tenant,
            lease_id,
            cancel,
        } = call;
        let (parts, body) = request.into_parts();
        let mut input = request_input(&parts, &body, target, tenant, lease_id)?;
        let conn = self
            .fleet
            .conn(worker_id)
            .ok_or_else(|| unreachable(worker_id))?;
        let signal = cancel.unwrap_or_default();
        let verdicts = Verdicts {
            worker_id: worker_id.to_owned(),
            deadline: self.options.deadline,
            stall: self.options.stall_timeout,
        };
        // The channel wait counts against the deadline; the caller may give up during it
        // (dropping the wait gives its place up, so the link needs no cancellation of its own:
        // the signal is read here, and only here, to fail `CANCELLED`).
        let never = CancellationToken::new();
        let channel = tokio::select! {
            biased;
            () = signal.cancelled() => return Err(verdicts.error(Fail::CallerCancelled)),
            () = tokio::time::sleep_until(deadline) => return Err(verdicts.error(Fail::Deadline)),
            opened = conn.link.open_channel(&never) => {
                opened.map_err(|e| verdicts.error(Fail::Channel(e.reason())))?
            }
        };
        input.channel = channel.id().to_string();
        let method_head = input.method == RelayMethod::Head;
        let (reader, writer) = channel.into_split();
        let (events_tx, events) = mpsc::unbounded_channel();
        let (head_tx, head_rx) = oneshot::channel();
        let exchange = Arc::new(Exchange {
            state: Mutex::new(BodyState::default()),
            events: events_tx.clone(),
        });
        let driver = Driver {
            verdicts,
            conn,
            relay_id: input.relay_id.clone(),
            started: now,
            deadline,
            signal,
            events,
            exchange,
            reader: Some(reader),
            read_ahead: 0,
            head_only: method_head,
            answered: false,
            cancel_sent: false,
            peer_aborted: false,
            worker_error: None,
        };
        tokio::spawn(driver.run(input, body, writer, head_tx));
        let mut guard = CallerGuard {
            events: Some(events_tx),
        };
        let outcome = head_rx.await.unwrap_or_else(|_| {
            Err(ContractError::internal(
                "the relay ended without an outcome",
            ))
        });
        guard.events = None;
        outcome
    }
}

/// Builds and checks `relay.request`'s input (its channel named later) with the contract's
/// bounds, after filtering the caller's headers.
fn request_input<B: Body>(
    parts: &http::request::Parts,
    body: &B,
    target: String,
    tenant: String,
    lease_id: Option<String>,
) -> Result<RelayRequestInput, ContractError> {
    let method = RelayMethod::from_name(parts.method.as_str()).ok_or_else(|| {
        ContractError::bad_request(format!(
            "method: {} is not relayed (GET, HEAD, POST, PUT, PATCH, DELETE, OPTIONS)",
            parts.method
        ))
    })?;
    let headers: Vec<(String, String)> = parts
        .headers
        .iter()
        .map(|(name, value)| {
            (
                name.as_str().to_owned(),
                String::from_utf8_lossy(value.as_bytes()).into_owned(),
            )
        })
        .collect();
    let input = RelayRequestInput {
        relay_id: format!("r{}", NEXT_RELAY.fetch_add(1, Ordering::Relaxed)),
        target,
        method,
        url: parts.uri.to_string(),
        headers: bounds::filter_relay_headers(headers, RELAY_GATEWAY_CREDENTIAL_HEADERS),
        tenant,
        lease_id,
        has_body: !body.is_end_stream(),
        channel: "c0".to_owned(),
    };
    let payload = serde_json::to_value(&input)
        .map_err(|e| ContractError::internal(format!("relay.request could not be encoded: {e}")))?;
    simlock_contract::decode_input::<RelayRequestInput>(Some(payload))
}

/// Tells the driver that the caller dropped `relay()` before the head.
struct CallerGuard {
    events: Option<mpsc::UnboundedSender<Event>>,
}

impl Drop for CallerGuard {
    fn drop(&mut self) {
        if let Some(events) = self.events.take() {
            let _ = events.send(Event::CallerGone);
        }
    }
}

/// What the pump and the body tell the driver.
#[derive(Debug)]
enum Event {
    /// The caller dropped `relay()` before the head.
    CallerGone,
    /// The request direction ended (END sent, or the worker stopped it).
    PumpDone,
    /// The request direction failed.
    PumpChannel(FailureReason),
    /// The caller's request body failed.
    CallerBody(String),
    /// The response body reached END.
    BodyEnd,
    /// The response direction failed under the body.
    BodyChannel(FailureReason),
    /// The caller dropped the response body before its END.
    BodyDropped,
}

/// Why an exchange failed, before it becomes a contract error in [`Verdicts::error`].
#[derive(Debug)]
enum Fail {
    /// The channel failed (`closed`: the uplink is lost).
    Channel(FailureReason),
    PeerAborted,
    Deadline,
    CallerCancelled,
    CallerBody(String),
    InvalidHead(String),
    NoResponse,
    Worker(ContractError),
}

impl Fail {
    /// Whether the worker may still be running the relay, so `relay.cancel` should go.
    const fn worker_may_run(&self) -> bool {
        !matches!(
            self,
            Self::Channel(FailureReason::Closed) | Self::Worker(_) | Self::NoResponse
        )
    }

    /// How the exchange ended, for the log.
    fn outcome(&self) -> Outcome {
        match self {
            Self::Channel(FailureReason::Closed) => Outcome::UplinkLost,
            Self::Channel(FailureReason::Stalled) => Outcome::Stalled,
            Self::Channel(FailureReason::Refused) => Outcome::Refused,
            Self::Channel(FailureReason::Aborted | FailureReason::Stopped) | Self::PeerAborted => {
                Outcome::WorkerAborted
            }
            Self::Deadline => Outcome::Deadline,
            Self::CallerCancelled => Outcome::Cancelled,
            Self::CallerBody(_) => Outcome::CallerBodyFailed,
            Self::InvalidHead(_) | Self::NoResponse => Outcome::ProtocolError,
            Self::Worker(error) if is_uplink_lost(error) => Outcome::UplinkLost,
            Self::Worker(_) => Outcome::WorkerError,
        }
    }
}

/// How an exchange ended, as the gateway logs it (one line per exchange, `relay ended`). The
/// worker's own `relay.request` answer is `{cancelled: true}` for every exchange the gateway
/// cancelled (caller gone, deadline), so only this side can tell them apart.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Outcome {
    /// The response reached its END.
    Ok,
    /// The caller went: it dropped the call or the response body before its END, or fired
    /// its cancellation.
    Cancelled,
    /// The caller's request body failed.
    CallerBodyFailed,
    /// The deadline passed.
    Deadline,
    /// The worker's uplink was lost.
    UplinkLost,
    /// The channel stalled.
    Stalled,
    /// The worker refused the channel.
    Refused,
    /// The worker aborted the channel without an error to say why.
    WorkerAborted,
    /// The worker answered an error.
    WorkerError,
    /// The worker broke the relay protocol.
    ProtocolError,
}

impl Outcome {
    const fn as_str(self) -> &'static str {
        match self {
            Self::Ok => "ok",
            Self::Cancelled => "cancelled",
            Self::CallerBodyFailed => "caller body failed",
            Self::Deadline => "deadline",
            Self::UplinkLost => "uplink lost",
            Self::Stalled => "stalled",
            Self::Refused => "refused",
            Self::WorkerAborted => "worker aborted",
            Self::WorkerError => "worker error",
            Self::ProtocolError => "protocol error",
        }
    }

    /// Whether it is the gateway's or the worker's fault rather than the caller's or the
    /// network's: logged as a warning.
    const fn is_fault(self) -> bool {
        matches!(
            self,
            Self::Stalled | Self::Refused | Self::WorkerAborted | Self::ProtocolError
        )
    }
}

/// The one translation of an exchange's failure into the caller's error.
#[derive(Debug, Clone)]
struct Verdicts {
    worker_id: String,
    deadline: Duration,
    stall: Duration,
}

impl Verdicts {
    fn error(&self, fail: Fail) -> ContractError {
        let worker = &self.worker_id;
        match fail {
            Fail::Channel(FailureReason::Stalled) => ContractError::internal(format!(
                "The relay's channel to worker {worker} stalled: no credit for {}",
                span(self.stall)
            )),
            Fail::Channel(FailureReason::Refused) => {
                ContractError::internal(format!("worker {worker} refused the relay's channel"))
            }
            Fail::Channel(FailureReason::Closed) => unreachable(worker),
            Fail::Channel(reason @ (FailureReason::Aborted | FailureReason::Stopped)) => {
                ContractError::internal(format!(
                    "The relay's channel to worker {worker} failed {reason}"
                ))
            }
            Fail::PeerAborted => {
                ContractError::internal(format!("worker {worker} aborted the relay"))
            }
            Fail::Deadline => ContractError::worker_unreachable(
                worker,
                format!(
                    "worker {worker} did not finish the relayed request within {} ms",
                    self.deadline.as_millis()
                ),
            ),
            Fail::CallerCancelled => {
                ContractError::new(ErrorCode::Cancelled, "The caller cancelled the relay")
            }
            Fail::CallerBody(why) => ContractError::new(
                ErrorCode::Cancelled,
                format!("The caller's request body failed: {why}"),
            ),
            Fail::InvalidHead(why) => ContractError::internal(format!(
                "worker {worker} sent an invalid relay response: {why}"
            ))
            .with_details(json!({ "workerId": worker })),
            Fail::NoResponse => ContractError::internal(format!(
                "worker {worker} ended the relay without a response"
            ))
            .with_details(json!({ "workerId": worker })),
            Fail::Worker(error) => from_worker(worker, error),
        }
    }
}

/// A duration for a message: whole seconds as `60 s`, otherwise milliseconds.
fn span(duration: Duration) -> String {
    if duration.subsec_millis() == 0 && duration.as_secs() > 0 {
        format!("{} s", duration.as_secs())
    } else {
        format!("{} ms", duration.as_millis())
    }
}

/// What the response body and the driver share.
struct Exchange {
    state: Mutex<BodyState>,
    events: mpsc::UnboundedSender<Event>,
}

#[derive(Default)]
struct BodyState {
    /// The response direction, once the head came.
    reader: Option<ChannelReader>,
    /// Bytes read ahead of the head.
    ahead: VecDeque<Bytes>,
    /// END was read ahead of the head.
    ended: bool,
    /// The exchange's failure, once decided: the body errors with it.
    failure: Option<ContractError>,
    /// The body saw its channel fail and waits for the driver's verdict.
    awaiting_verdict: bool,
    waker: Option<Waker>,
}

impl Exchange {
    /// Records the failure (the first one wins), aborts the channel and wakes the body.
    fn fail(&self, error: ContractError) {
        let waker = {
            let mut state = self.state.lock();
            if state.failure.is_none() {
                state.failure = Some(error);
            }
            if let Some(reader) = &state.reader {
                reader.abort();
            }
            state.waker.take()
        };
        if let Some(waker) = waker {
            waker.wake();
        }
    }
}

/// The body of a relayed response: the channel's response direction, read as the caller polls.
/// It ends at the channel's END; it errors with the exchange's failure (a [`ContractError`]).
/// Dropping it before its end is the caller's abort.
pub struct RelayBody {
    exchange: Option<Arc<Exchange>>,
    done: bool,
}

impl fmt::Debug for RelayBody {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RelayBody")
            .field("done", &self.done)
            .finish_non_exhaustive()
    }
}

impl RelayBody {
    /// A body with nothing in it (HEAD, 204, 205 and 304 answers).
    pub const fn empty() -> Self {
        Self {
            exchange: None,
            done: true,
        }
    }

    fn streaming(exchange: Arc<Exchange>) -> Self {
        Self {
            exchange: Some(exchange),
            done: false,
        }
    }
}

impl Body for RelayBody {
    type Data = Bytes;
    type Error = ContractError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, ContractError>>> {
        let this = self.get_mut();
        if this.done {
            return Poll::Ready(None);
        }
        let Some(exchange) = this.exchange.as_deref() else {
            return Poll::Ready(None);
        };
        // The channel reader takes part in the task's tokio budget; bytes read ahead are few.
        let mut state = exchange.state.lock();
        if let Some(failure) = &state.failure {
            let failure = failure.clone();
            drop(state);
            this.done = true;
            return Poll::Ready(Some(Err(failure)));
        }
        if let Some(bytes) = state.ahead.pop_front() {
            return Poll::Ready(Some(Ok(Frame::data(bytes))));
        }
        if state.awaiting_verdict {
            state.waker = Some(cx.waker().clone());
            return Poll::Pending;
        }
        let polled = if state.ended {
            Poll::Ready(None)
        } else if let Some(reader) = state.reader.as_mut() {
            futures::Stream::poll_next(Pin::new(reader), cx)
        } else {
            Poll::Ready(None)
        };
        match polled {
            Poll::Ready(Some(Ok(bytes))) => Poll::Ready(Some(Ok(Frame::data(bytes)))),
            Poll::Ready(None) => {
                let reader = state.reader.take();
                drop(state);
                drop(reader);
                this.done = true;
                let _ = exchange.events.send(Event::BodyEnd);
                Poll::Ready(None)
            }
            Poll::Ready(Some(Err(error))) => {
                state.awaiting_verdict = true;
                state.waker = Some(cx.waker().clone());
                drop(state);
                let _ = exchange.events.send(Event::BodyChannel(error.reason()));
                Poll::Pending
            }
            Poll::Pending => Poll::Pending,
        }
    }

    fn is_end_stream(&self) -> bool {
        self.done
    }

    fn size_hint(&self) -> SizeHint {
        if self.done {
            SizeHint::with_exact(0)
        } else {
            SizeHint::default()
        }
    }
}

impl Drop for RelayBody {
    fn drop(&mut self) {
        if self.done {
            return;
        }
        if let Some(exchange) = self.exchange.take() {
            let reader = exchange.state.lock().reader.take();
            if let Some(reader) = reader {
                reader.abort();
            }
            let _ = exchange.events.send(Event::BodyDropped);
        }
    }
}

/// Where an exchange is.
enum Phase {
    /// Waiting for the head; the outcome goes to `relay()`.
    Head(oneshot::Sender<Result<http::Response<RelayBody>, ContractError>>),
    /// The caller holds a streaming body.
    Body,
    /// The caller got an empty body; the response direction is read to its END and dropped.
    Drain,
}

/// One exchange's task: it owns the `relay.request` call and the deadline, and decides every
/// failure.
struct Driver {
    verdicts: Verdicts,
    conn: Arc<WorkerConn>,
    relay_id: String,
    started: Instant,
    deadline: Instant,
    signal: CancellationToken,
    events: mpsc::UnboundedReceiver<Event>,
    exchange: Arc<Exchange>,
    /// The response direction while the driver reads it (before the head, or draining).
    reader: Option<ChannelReader>,
    read_ahead: usize,
    head_only: bool,
    answered: bool,
    cancel_sent: bool,
    peer_aborted: bool,
    /// The worker's error after the head: the body's channel failure decides between it and
    /// the channel's own reason (a stall or a lost uplink wins).
    worker_error: Option<ContractError>,
}

impl Driver {
    async fn run<B>(
        mut self,
        input: RelayRequestInput,
        body: B,
        writer: ChannelWriter,
        head_tx: oneshot::Sender<Result<http::Response<RelayBody>, ContractError>>,
    ) where
        B: Body + Send + 'static,
        B::Data: Send,
        B::Error: Into<BoxError>,
    {
        let mut phase = Phase::Head(head_tx);
        let finished = CancellationToken::new();
        let _finish_pump = finished.clone().drop_guard();
        let mut deadline = std::pin::pin!(tokio::time::sleep_until(self.deadline));
        // Sending the call waits while the uplink's text lane is full: the deadline and the
        // caller's signal bound that wait too.
        let begun = tokio::select! {
            biased;
            Some(Event::CallerGone) = self.events.recv() => None,
            () = self.signal.cancelled() => Some(Err(Fail::CallerCancelled)),
            () = &mut deadline => Some(Err(Fail::Deadline)),
            begun = self.conn.client.begin_call::<RelayRequest>(&input, 4) => {
                Some(begun.map_err(Fail::Worker))
            }
        };
        // Written into the call line: not kept for the exchange's life.
        drop(input);
        let mut call = match begun {
            None => {
                self.abort();
                self.ended(Outcome::Cancelled, None);
                return;
            }
            Some(Ok(call)) => call,
            Some(Err(fail)) => {
                self.conclude(&mut phase, fail);
                return;
            }
        };
        tokio::spawn(pump(body, writer, self.exchange.events.clone(), finished));
        loop {
            if matches!(phase, Phase::Drain) && self.reader.is_none() {
                // An empty answer whose END was read ahead: nothing is left to wait for.
                self.ended(Outcome::Ok, None);
                return;
            }
            let read_max = self.read_max(&phase);
            let fail = tokio::select! {
                biased;
                () = self.signal.cancelled() => Some(Fail::CallerCancelled),
                () = &mut deadline => Some(Fail::Deadline),
                event = self.events.recv() => match event {
                    None => return,
                    Some(event) => match self.on_event(event) {
                        Step::Continue => None,
                        Step::Fail(fail) => Some(fail),
                        Step::Quiet => {
                            self.send_cancel();
                            self.abort();
                            self.ended(Outcome::Cancelled, None);
                            return;
                        }
                        Step::Done => {
                            self.ended(Outcome::Ok, None);
                            return;
                        }
                    },
                },
                event = call.next(), if !self.answered => self.on_call(&mut phase, event),
                chunk = read_chunk(self.reader.as_mut(), read_max), if self.reads(&phase) => {
                    match self.on_chunk(&phase, chunk) {
                        Step::Continue => None,
                        Step::Fail(fail) => Some(fail),
                        Step::Quiet => {
                            self.ended(Outcome::Cancelled, None);
                            return;
                        }
                        Step::Done => {
                            self.ended(Outcome::Ok, None);
                            return;
                        }
                    }
                }
            };
            if let Some(fail) = fail {
                self.conclude(&mut phase, fail);
                return;
            }
            if self.peer_aborted && self.answered {
                self.conclude(&mut phase, Fail::PeerAborted);
                return;
            }
        }
    }

    /// The most the driver reads at once: ahead of the head, what is left of [`READ_AHEAD`].
    fn read_max(&self, phase: &Phase) -> usize {
        match phase {
            Phase::Head(_) => READ_AHEAD.saturating_sub(self.read_ahead),
            Phase::Drain | Phase::Body => usize::MAX,
        }
    }

    /// Whether the driver reads the response direction now.
    fn reads(&self, phase: &Phase) -> bool {
        self.reader.is_some()
            && match phase {
                Phase::Head(_) => self.read_ahead < READ_AHEAD && !self.peer_aborted,
                Phase::Drain => true,
                Phase::Body => false,
            }
    }

    fn on_event(&mut self, event: Event) -> Step {
        match event {
            Event::CallerGone | Event::BodyDropped => Step::Quiet,
            Event::BodyEnd => Step::Done,
            Event::PumpDone | Event::PumpChannel(FailureReason::Stopped) => Step::Continue,
            Event::PumpChannel(reason) | Event::BodyChannel(reason) => self.channel_failed(reason),
            Event::CallerBody(why) => Step::Fail(Fail::CallerBody(why)),
        }
    }

    fn channel_failed(&mut self, reason: FailureReason) -> Step {
        match reason {
            FailureReason::Aborted => match self.worker_error.take() {
                Some(error) => Step::Fail(Fail::Worker(error)),
                None => {
                    // The worker aborted: its relay.request answer says why (the deadline
                    // bounds the wait).
                    self.peer_aborted = true;
                    Step::Continue
                }
            },
            FailureReason::Stopped => Step::Continue,
            reason @ (FailureReason::Closed | FailureReason::Stalled | FailureReason::Refused) => {
                Step::Fail(Fail::Channel(reason))
            }
        }
    }

    fn on_chunk(&mut self, phase: &Phase, chunk: Result<Option<Bytes>, ChannelError>) -> Step {
        match (phase, chunk) {
            (Phase::Head(_), Ok(Some(bytes))) => {
                self.read_ahead += bytes.len();
                // A copy: the link's slice may pin a whole transport read buffer, and a caller
                // that never reads would keep it for the life of the exchange.
                let bytes = Bytes::copy_from_slice(&bytes);
                self.exchange.state.lock().ahead.push_back(bytes);
                Step::Continue
            }
            (Phase::Head(_), Ok(None)) => {
                self.exchange.state.lock().ended = true;
                self.reader = None;
                Step::Continue
            }
            (Phase::Drain, Ok(Some(_))) => Step::Continue,
            (Phase::Drain, Ok(None)) => Step::Done,
            (Phase::Head(_) | Phase::Drain, Err(error)) => self.channel_failed(error.reason()),
            (Phase::Body, _) => Step::Continue,
        }
    }

    fn on_call(&mut self, phase: &mut Phase, event: CallEvent) -> Option<Fail> {
        match event {
            CallEvent::Push(frame) if frame.push == "relay-head" => {
                if !matches!(phase, Phase::Head(_)) {
                    return Some(Fail::InvalidHead("a second relay-head".into()));
                }
                match Push::from_frame(frame) {
                    Ok(Push::RelayHead {
                        status, headers, ..
                    }) => match self.response(status, headers) {
                        Ok((response, next)) => {
                            if let Phase::Head(head_tx) = std::mem::replace(phase, next) {
                                // A caller that went meanwhile drops the body: its abort.
                                let _ = head_tx.send(Ok(response));
                            }
                            None
                        }
                        Err(why) => Some(Fail::InvalidHead(why)),
                    },
                    Ok(_) => None,
                    Err(why) => Some(Fail::InvalidHead(why)),
                }
            }
            CallEvent::Push(frame) => {
                debug!(worker = %self.verdicts.worker_id, push = %frame.push, "ignoring a push on a relay");
                None
            }
            CallEvent::Reply(Err(error)) if matches!(phase, Phase::Body) => {
                // The body learns the failure from its channel, which the worker aborted (or
                // which stalled or closed first): make sure it fails, then decide.
                self.answered = true;
                self.worker_error = Some(error);
                if self.peer_aborted {
                    return self.worker_error.take().map(Fail::Worker);
                }
                if let Some(reader) = &self.exchange.state.lock().reader {
                    reader.abort();
                }
                None
            }
            CallEvent::Reply(Err(error)) => {
                self.answered = true;
                Some(Fail::Worker(error))
            }
            CallEvent::Reply(Ok(raw)) => {
                self.answered = true;
                let cancelled = serde_json::from_str::<RelayRequestOutput>(raw.get())
                    .map(|output| output.cancelled == Some(true));
                match (cancelled, &phase) {
                    (Err(e), _) => Some(Fail::InvalidHead(format!(
                        "an invalid relay.request answer: {e}"
                    ))),
                    (Ok(_), Phase::Head(_)) => Some(Fail::NoResponse),
                    (Ok(true), _) if !self.cancel_sent => Some(Fail::NoResponse),
                    // `{}`: the body still ends only at the channel's END.
                    (Ok(_), _) => None,
                }
            }
        }
    }

    /// The caller's response for a head, and where the exchange goes next.
    fn response(
        &mut self,
        status: u16,
        headers: Vec<(String, String)>,
    ) -> Result<(http::Response<RelayBody>, Phase), String> {
        let status = http::StatusCode::from_u16(status).map_err(|e| format!("status: {e}"))?;
        let headers = bounds::filter_relay_headers(headers, &[]);
        bounds::relay_headers(&headers, &()).map_err(|e| format!("headers: {e}"))?;
        let mut builder = http::Response::builder().status(status);
        for (index, (name, value)) in headers.into_iter().enumerate() {
            let name = http::HeaderName::from_bytes(name.as_bytes())
                .map_err(|e| format!("headers[{index}]: {e}"))?;
            let value = http::HeaderValue::from_str(&value)
                .map_err(|e| format!("headers[{index}]: {e}"))?;
            builder = builder.header(name, value);
        }
        let empty = self.head_only || matches!(status.as_u16(), 204 | 205 | 304);
        let (body, next) = if empty {
            (RelayBody::empty(), Phase::Drain)
        } else {
            let mut state = self.exchange.state.lock();
            state.reader = self.reader.take();
            drop(state);
            (RelayBody::streaming(self.exchange.clone()), Phase::Body)
        };
        let response = builder.body(body).map_err(|e| e.to_string())?;
        Ok((response, next))
    }

    /// Ends the exchange with `fail`: the caller (or its body) gets the error, the worker gets
    /// `relay.cancel` when it may still run the relay, and the channel is aborted.
    fn conclude(&mut self, phase: &mut Phase, fail: Fail) {
        if fail.worker_may_run() && !self.answered {
            self.send_cancel();
        }
        let outcome = fail.outcome();
        let error = self.verdicts.error(fail);
        self.ended(outcome, Some(&error));
        if let Phase::Head(head_tx) = std::mem::replace(phase, Phase::Drain) {
            let _ = head_tx.send(Err(error.clone()));
        }
        self.exchange.fail(error);
        self.abort();
    }

    /// Logs the exchange's end: one line, its outcome named as [`Outcome`] tells them apart
    /// (a caller that went, the deadline, a lost uplink), with the caller's error when it got one.
    fn ended(&self, outcome: Outcome, error: Option<&ContractError>) {
        let worker = &self.verdicts.worker_id;
        let relay = &self.relay_id;
        let elapsed_ms = self.started.elapsed().as_millis();
        let fault = outcome.is_fault();
        let outcome = outcome.as_str();
        match error {
            Some(error) if fault => {
                warn!(%worker, %relay, outcome, elapsed_ms, code = %error.code, message = %error.message, "relay ended");
            }
            Some(error) => {
                info!(%worker, %relay, outcome, elapsed_ms, code = %error.code, "relay ended");
            }
            None => info!(%worker, %relay, outcome, elapsed_ms, "relay ended"),
        }
    }

    fn abort(&mut self) {
        if let Some(reader) = self.reader.take() {
            reader.abort();
        }
        if let Some(reader) = self.exchange.state.lock().reader.take() {
            reader.abort();
        }
    }

    fn send_cancel(&mut self) {
        if self.cancel_sent || self.answered {
            return;
        }
        self.cancel_sent = true;
        let client = self.conn.client.clone();
        let relay_id = self.relay_id.clone();
        tokio::spawn(async move {
            let input = simlock_contract::ops::RelayCancelInput {
                relay_id: relay_id.clone(),
            };
            let cancel = client.call::<simlock_contract::ops::RelayCancel>(&input);
            if let Ok(Err(error)) = tokio::time::timeout(CANCEL_TIMEOUT, cancel).await {
                debug!(relay = %relay_id, error = %error, "relay.cancel failed");
            }
        });
    }
}

/// What the driver does after an event.
enum Step {
    Continue,
    Fail(Fail),
    /// The caller went: cancel and abort, quietly.
    Quiet,
    /// The exchange is over.
    Done,
}

async fn read_chunk(
    reader: Option<&mut ChannelReader>,
    max: usize,
) -> Result<Option<Bytes>, ChannelError> {
    match reader {
        Some(reader) => reader.read_up_to(max).await,
        None => futures::future::pending().await,
    }
}

/// Pipes the caller's request body into the channel's request direction: END once it ends (at
/// once when there is none); it stops reading the caller's body when the worker stops the
/// direction, the channel fails, or the exchange is over.
async fn pump<B>(
    body: B,
    mut writer: ChannelWriter,
    events: mpsc::UnboundedSender<Event>,
    finished: CancellationToken,
) where
    B: Body + Send + 'static,
    B::Data: Send,
    B::Error: Into<BoxError>,
{
    let mut body = std::pin::pin!(body);
    let piping = async {
        loop {
            let next = match body.frame().await {
                None => None,
                Some(Err(error)) => {
                    let error: BoxError = error.into();
                    return Event::CallerBody(error.to_string());
                }
                Some(Ok(frame)) => Some(
                    frame
                        .into_data()
                        .map(|mut data| data.copy_to_bytes(data.remaining()))
                        .unwrap_or_default(),
                ),
            };
            let Some(bytes) = next else {
                return match writer.finish().await {
                    Ok(()) => Event::PumpDone,
                    Err(e) => Event::PumpChannel(e.reason()),
                };
            };
            if bytes.is_empty() {
                continue;
            }
            if let Err(e) = writer.write_bytes(bytes).await {
                return Event::PumpChannel(e.reason());
            }
        }
    };
    let event = tokio::select! {
        biased;
        () = finished.cancelled() => return,
        event = piping => event,
    };
    let _ = events.send(event);
}

#[cfg(test)]
mod tests {
    use super::*;

    fn verdicts() -> Verdicts {
        Verdicts {
            worker_id: "w1".into(),
            deadline: Duration::from_millis(200),
            stall: Duration::from_secs(60),
        }
    }

    #[test]
    fn every_failure_has_its_code_and_message() {
        let v = verdicts();
        let closed = v.error(Fail::Channel(FailureReason::Closed));
        assert_eq!(closed.code, ErrorCode::WorkerUnreachable);
        assert_eq!(closed.details, Some(json!({"workerId": "w1"})));
        assert_eq!(closed.message, unreachable("w1").message);
        let stalled = v.error(Fail::Channel(FailureReason::Stalled));
        assert_eq!(stalled.code, ErrorCode::Internal);
        assert_eq!(
            stalled.message,
            "The relay's channel to worker w1 stalled: no credit for 60 s"
        );
        let refused = v.error(Fail::Channel(FailureReason::Refused));
        assert_eq!(refused.code, ErrorCode::Internal);
        assert_eq!(refused.message, "worker w1 refused the relay's channel");
        let deadline = v.error(Fail::Deadline);
        assert_eq!(deadline.code, ErrorCode::WorkerUnreachable);
        assert_eq!(
            deadline.message,
            "worker w1 did not finish the relayed request within 200 ms"
        );
        let none = v.error(Fail::NoResponse);
        assert_eq!(none.code, ErrorCode::Internal);
        assert_eq!(none.message, "worker w1 ended the relay without a response");
        assert_eq!(v.error(Fail::PeerAborted).code, ErrorCode::Internal);
        assert_eq!(v.error(Fail::CallerCancelled).code, ErrorCode::Cancelled);
        assert_eq!(
            v.error(Fail::CallerBody("boom".into())).code,
            ErrorCode::Cancelled
        );
        assert!(
            v.error(Fail::InvalidHead("status 101".into()))
                .message
                .contains("worker w1")
        );
        // A worker's transport error reads as a lost uplink; other errors pass through.
        let stopping = v.error(Fail::Worker(ContractError::stopping()));
        assert_eq!(stopping.code, ErrorCode::WorkerUnreachable);
        let missing = v.error(Fail::Worker(ContractError::new(
            ErrorCode::RelayTargetMissing,
            "no",
        )));
        assert_eq!(missing.code, ErrorCode::RelayTargetMissing);
    }

    #[test]
    fn spans_read_as_seconds_or_milliseconds() {
        assert_eq!(span(Duration::from_secs(60)), "60 s");
        assert_eq!(span(Duration::from_millis(300)), "300 ms");
        assert_eq!(span(Duration::from_millis(1500)), "1500 ms");
    }

    #[test]
    fn only_a_relay_the_worker_may_still_run_is_cancelled() {
        assert!(Fail::Deadline.worker_may_run());
        assert!(Fail::Channel(FailureReason::Stalled).worker_may_run());
        assert!(!Fail::Channel(FailureReason::Closed).worker_may_run());
        assert!(!Fail::NoResponse.worker_may_run());
        assert!(!Fail::Worker(ContractError::internal("x")).worker_may_run());
    }

    #[test]
    fn every_ending_is_logged_as_what_it_was() {
        let cases = [
            (Fail::CallerCancelled, "cancelled"),
            (Fail::CallerBody("boom".into()), "caller body failed"),
            (Fail::Deadline, "deadline"),
            (Fail::Channel(FailureReason::Closed), "uplink lost"),
            // The call itself failing as a transport error is the uplink lost too.
            (Fail::Worker(ContractError::stopping()), "uplink lost"),
            (
                Fail::Worker(ContractError::new(ErrorCode::DaemonConnectionLost, "gone")),
                "uplink lost",
            ),
            (Fail::Channel(FailureReason::Stalled), "stalled"),
            (Fail::Channel(FailureReason::Refused), "refused"),
            (Fail::PeerAborted, "worker aborted"),
            (
                Fail::Worker(ContractError::new(ErrorCode::RelayTargetMissing, "no")),
                "worker error",
            ),
            (Fail::NoResponse, "protocol error"),
            (Fail::InvalidHead("status 101".into()), "protocol error"),
        ];
        for (fail, expected) in cases {
            let outcome = fail.outcome();
            assert_eq!(outcome.as_str(), expected, "{fail:?}");
            // Only what is the worker's or the gateway's fault is a warning; a caller that
            // went, a deadline or a lost uplink is not.
            assert_eq!(
                outcome.is_fault(),
                matches!(
                    expected,
                    "stalled" | "refused" | "worker aborted" | "protocol error"
                ),
                "{fail:?}"
            );
        }
        assert_eq!(Outcome::Ok.as_str(), "ok");
        assert!(!Outcome::Ok.is_fault());
    }

    #[test]
    fn an_empty_body_is_at_its_end() {
        let body = RelayBody::empty();
        assert!(body.is_end_stream());
        assert_eq!(body.size_hint().exact(), Some(0));
    }
}
