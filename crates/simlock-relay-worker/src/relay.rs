//! `relay.request` and `relay.cancel` on the worker.
//!
//! A `relay.request` claims its channel when its line is read ([`Relays::prepare`]), before
//! startup parking and before any later line: the relay id is registered (so a `relay.cancel`
//! behind it finds it) and the channel is accepted from the uplink's link. What is claimed
//! reaches the handler, or is dropped with the call, which aborts the channel. The handler runs
//! the target, stops the unread rest of the request, pushes `relay-head`, pipes the response body
//! into the channel, sends END, and only then answers `{}`.

use std::collections::HashMap;
use std::sync::Arc;

use futures::SinkExt;
use http_body::Body as _;
use http_body_util::BodyExt;
use parking_lot::Mutex;
use serde_json::{Value, json};
use simlock_contract::bounds;
use simlock_contract::ops::{
    RelayCancel, RelayCancelInput, RelayMethod, RelayRequest as RelayRequestOp, RelayRequestInput,
    RelayRequestOutput,
};
use simlock_contract::{ContractError, ErrorCode, Push};
use simlock_daemon::context::{CallCtx, Prepared};
use simlock_daemon::pipeline::Router;
use simlock_link::{Channel, ChannelWriter, FailureReason, LinkHandle};
use simlock_wire::Connection;
use tokio_util::sync::CancellationToken;
use tracing::{debug, warn};

use crate::target::{
    BoxError, RelayRequest, RelayTarget, RelayTargets, RequestBody, RequestSlot, ResponseBody,
};

/// The response body the worker queues ahead of the link, per relay: enough to keep the link's
/// write batches full, small enough that 64 relays whose callers stopped reading hold little
/// here (each holds less than this plus one part of its target's body).
pub const RESPONSE_QUEUE: usize = 64 * 1024;

/// Registers `relay.request` (with its read-time hook) and `relay.cancel` on `router`, serving
/// `targets`. Both answer `FORBIDDEN` on any session that is not the gateway's uplink.
pub fn register(router: &mut Router, targets: RelayTargets) {
    let relays = Arc::new(Relays {
        targets,
        active: Mutex::new(HashMap::new()),
    });
    let serving = relays.clone();
    router
        .handle_authorized::<RelayRequestOp, _, _, _>(uplink_only, move |ctx, input| {
            serving.clone().serve(ctx, input)
        })
        .prepare::<RelayRequestOp, _>({
            let relays = relays.clone();
            move |ctx, payload| relays.prepare(ctx, payload)
        });
    router
        .handle_authorized::<RelayCancel, _, _, _>(uplink_only, |_, _: RelayCancelInput| async {
            // The cancel took effect when its line was read (the hook below).
            Ok(simlock_contract::ops::Empty {})
        })
        .prepare::<RelayCancel, _>(move |ctx, payload| {
            relays.cancel(ctx, payload);
            None
        });
}

fn uplink_only<I>(ctx: &CallCtx, _: &I) -> Result<(), ContractError> {
    if ctx.is_gateway_uplink() {
        Ok(())
    } else {
        Err(ContractError::forbidden(
            "Relay operations are only accepted from the gateway on the worker's uplink",
        ))
    }
}

/// The relays of one worker: its targets, and the cancellation of each active relay by
/// connection and relay id.
struct Relays {
    targets: RelayTargets,
    active: Mutex<HashMap<(u64, String), CancellationToken>>,
}

/// What a `relay.request` line claimed when it was read.
struct PreparedRelay {
    claim: Result<Claim, Ending>,
}

/// A relay's hold on its id and channel. Dropping it without [`Claim::completed`] aborts the
/// channel and fires the target's cancellation; it always frees the relay id.
struct Claim {
    relays: Arc<Relays>,
    /// The relay id, registered in [`Relays::active`] (only one claim holds a key at a time), or
    /// `None` when the line carried no valid id or a duplicate one.
    key: Option<(u64, String)>,
    cancel: CancellationToken,
    writer: ChannelWriter,
    request: Arc<Mutex<RequestSlot>>,
    completed: bool,
}

impl Drop for Claim {
    fn drop(&mut self) {
        if let Some(key) = &self.key {
            self.relays.active.lock().remove(key);
        }
        if !self.completed {
            self.cancel.cancel();
            self.writer.abort();
        }
        RequestSlot::stop(&self.request);
    }
}

impl Claim {
    fn new(relays: Arc<Relays>, channel: Channel, key: Option<(u64, String)>) -> Self {
        let (reader, writer) = channel.into_split();
        Self {
            relays,
            key,
            cancel: CancellationToken::new(),
            writer,
            request: RequestSlot::new(reader),
            completed: false,
        }
    }

    /// The channel's state without touching its bytes: `Err` once it failed.
    async fn probe(&mut self) -> Result<(), Ending> {
        SinkExt::flush(&mut self.writer)
            .await
            .map_err(|e| Ending::from_reason(e.reason()))
    }
}

/// How a relay ended, short of success.
#[derive(Debug)]
enum Ending {
    /// A cancel took effect (or the gateway went away): `{cancelled: true}`.
    Cancelled,
    /// The relay failed.
    Failed(Failure),
}

impl Ending {
    fn from_reason(reason: FailureReason) -> Self {
        match reason {
            // The gateway stopped the response, aborted the channel or is gone: the target is
            // cancelled and whatever it answered goes nowhere.
            FailureReason::Stopped | FailureReason::Aborted | FailureReason::Closed => {
                Self::Cancelled
            }
            reason @ (FailureReason::Stalled | FailureReason::Refused) => {
                Self::Failed(Failure::Channel(reason))
            }
        }
    }
}

/// Why a relay failed.
#[derive(Debug)]
enum Failure {
    /// The relay's channel failed.
    Channel(FailureReason),
    /// The call was refused before its channel was claimed.
    Refused(ContractError),
    /// The request could not be built for the target.
    Request(String),
    /// The target failed before answering.
    Target(String, BoxError),
    /// The target's answer breaks the relay's bounds.
    Head(String, String),
    /// The target's response body failed after the head.
    Body(String, BoxError),
}

/// The one translation of a relay failure into the contract's error.
fn to_contract(failure: Failure) -> ContractError {
    match failure {
        Failure::Channel(FailureReason::Stalled) => ContractError::internal(
            "The relay's channel stalled: the gateway took no bytes for the link's stall timeout",
        ),
        Failure::Channel(FailureReason::Refused) => ContractError::bad_request(
            "channel: the gateway never opened this channel, or it was already accepted",
        ),
        Failure::Channel(reason) => {
            ContractError::internal(format!("The relay's channel failed {reason}"))
        }
        Failure::Refused(error) => error,
        Failure::Request(why) => ContractError::bad_request(why),
        Failure::Target(target, error) => {
            warn!(target_name = %target, error = %error, "a relay target failed");
            ContractError::internal(format!("The relay target {target} failed: {error}"))
        }
        Failure::Head(target, bound) => {
            warn!(target_name = %target, bound = %bound, "a relay target answered out of bounds");
            ContractError::internal(format!(
                "The relay target {target} answered out of bounds: {bound}"
            ))
        }
        Failure::Body(target, error) => {
            warn!(target_name = %target, error = %error, "a relay target's response body failed");
            ContractError::internal(format!(
                "The relay target {target}'s response body failed after the head: {error}"
            ))
        }
    }
}

impl Relays {
    /// The read-time hook of `relay.request`: on the gateway's uplink only, claim its channel
    /// and relay id.
    fn prepare(self: &Arc<Self>, ctx: &CallCtx, payload: Option<&Value>) -> Option<Prepared> {
        if !ctx.is_gateway_uplink() {
            return None;
        }
        let claim = self.claim(ctx.connection()?, payload);
        Some(Box::new(PreparedRelay { claim }))
    }

    /// Parses `channel` with the contract's bound, accepts it from the connection's link, and
    /// registers the relay id. A channel accepted and then refused (a duplicate relay id) is
    /// aborted at once. A channel the gateway aborted before this read answers by the failure
    /// table, as if it failed while the relay ran.
    fn claim(
        self: &Arc<Self>,
        conn: &Connection,
        payload: Option<&Value>,
    ) -> Result<Claim, Ending> {
        let refused = |error| Ending::Failed(Failure::Refused(error));
        let field = |name: &str| payload.and_then(|p| p.get(name)).and_then(Value::as_str);
        let channel_id = field("channel")
            .filter(|id| bounds::is_channel_id(id))
            .ok_or_else(|| {
                refused(ContractError::bad_request(
                    "channel: required, 1-32 of [A-Za-z0-9-]",
                ))
            })?;
        let link = conn.attachment::<LinkHandle>().ok_or_else(|| {
            refused(ContractError::internal(
                "This connection carries no link for relay channels",
            ))
        })?;
        let channel = link
            .accept_channel(channel_id)
            .map_err(|e| Ending::from_reason(e.reason()))?;
        let Some(relay_id) = field("relayId").filter(|id| bounds::RELAY_ID_RE.is_match(id)) else {
            // The input fails its schema later; the channel is aborted with the claim.
            return Ok(Claim::new(self.clone(), channel, None));
        };
        let key = (conn.id(), relay_id.to_owned());
        let mut active = self.active.lock();
        if active.contains_key(&key) {
            drop(active);
            drop(Claim::new(self.clone(), channel, None));
            return Err(refused(ContractError::bad_request(format!(
                "relayId: {relay_id} is already active on this connection"
            ))));
        }
        let claim = Claim::new(self.clone(), channel, Some(key.clone()));
        active.insert(key, claim.cancel.clone());
        Ok(claim)
    }

    /// The read-time hook of `relay.cancel`: fires the relay's cancellation at once, in line
    /// order, even while the relay is parked behind start-up.
    fn cancel(&self, ctx: &CallCtx, payload: Option<&Value>) {
        if !ctx.is_gateway_uplink() {
            return;
        }
        let (Some(conn), Some(relay_id)) = (
            ctx.connection(),
            payload
                .and_then(|p| p.get("relayId"))
                .and_then(Value::as_str),
        ) else {
            return;
        };
        let cancel = self
            .active
            .lock()
            .get(&(conn.id(), relay_id.to_owned()))
            .cloned();
        if let Some(cancel) = cancel {
            debug!(relay = relay_id, "relay cancelled");
            cancel.cancel();
        }
    }

    async fn serve(
        self: Arc<Self>,
        ctx: CallCtx,
        input: RelayRequestInput,
    ) -> Result<RelayRequestOutput, ContractError> {
        let prepared = ctx
            .take_prepared::<PreparedRelay>()
            .ok_or_else(|| ContractError::bad_request("channel: the channel was not accepted"))?;
        let mut claim = match prepared.claim {
            Ok(claim) => claim,
            Err(Ending::Cancelled) => {
                debug!(relay = %input.relay_id, "relay's channel aborted before it was claimed");
                return Ok(RelayRequestOutput {
                    cancelled: Some(true),
                });
            }
            Err(Ending::Failed(failure)) => return Err(to_contract(failure)),
        };
        if claim.writer.id().as_str() != input.channel
            || claim
                .key
                .as_ref()
                .is_none_or(|(_, id)| *id != input.relay_id)
        {
            return Err(ContractError::bad_request(
                "channel: the call does not match what was claimed when it was read",
            ));
        }
        let target = self.targets.get(&input.target).ok_or_else(|| {
            ContractError::new(
                ErrorCode::RelayTargetMissing,
                format!(
                    "No module on this worker serves the relay target {}",
                    input.target
                ),
            )
            .with_details(json!({ "target": input.target }))
        })?;
        let closed = ctx
            .connection()
            .map(|conn| conn.closed())
            .unwrap_or_default();
        let cancel = claim.cancel.clone();
        let relay_id = input.relay_id.clone();
        let run = run(&mut claim, target.as_ref(), &ctx, input);
        let ending = tokio::select! {
            biased;
            () = cancel.cancelled() => Err(Ending::Cancelled),
            () = closed.cancelled() => Err(Ending::Cancelled),
            ending = run => ending,
        };
        // The target's cancellation is a child of the relay's: a target can see it and fail in
        // the same poll that found the relay's own token not yet cancelled. A failure once the
        // relay was cancelled is the cancel's outcome (a stalled channel still wins below).
        let ending = match ending {
            Err(Ending::Failed(_)) if cancel.is_cancelled() => Err(Ending::Cancelled),
            ending => ending,
        };
        match ending {
            Ok(()) => {
                claim.completed = true;
                Ok(RelayRequestOutput::default())
            }
            Err(Ending::Cancelled) => {
                // A channel that stalled is the relay's failure, even when a cancel followed.
                if let Err(Ending::Failed(failure)) = claim.probe().await {
                    return Err(to_contract(failure));
                }
                debug!(relay = %relay_id, "relay ended cancelled");
                Ok(RelayRequestOutput {
                    cancelled: Some(true),
                })
            }
            Err(Ending::Failed(failure)) => Err(to_contract(failure)),
        }
    }
}

/// Runs one relay to its END. Every early return leaves the channel to the claim, which aborts
/// it.
async fn run(
    claim: &mut Claim,
    target: &dyn RelayTarget,
    ctx: &CallCtx,
    mut input: RelayRequestInput,
) -> Result<(), Ending> {
    // A relay parked behind start-up whose channel failed meanwhile answers without its target.
    claim.probe().await?;
    let target_name = input.target.clone();
    let head_only = input.method == RelayMethod::Head;
    let request = build_request(&mut input, claim)?;
    let answer = target
        .call(RelayRequest {
            request,
            tenant: input.tenant,
            lease_id: input.lease_id,
            cancel: claim.cancel.child_token(),
        })
        .await;
    // The target answered: the unread rest of its request is stopped.
    RequestSlot::stop(&claim.request);
    let response = match answer {
        Ok(response) => response,
        Err(error) => {
            // A target that failed because its channel did is the channel's failure.
            claim.probe().await?;
            return Err(Ending::Failed(Failure::Target(target_name, error)));
        }
    };
    let (parts, body) = response.into_parts();
    let head = response_head(&parts)
        .map_err(|bound| Ending::Failed(Failure::Head(target_name.clone(), bound)))?;
    claim.probe().await?;
    if claim.cancel.is_cancelled() {
        return Err(Ending::Cancelled);
    }
    let status = parts.status.as_u16();
    let delivered = ctx
        .push(Push::RelayHead {
            request_id: ctx.request_id().clone(),
            status,
            headers: head,
        })
        .await;
    if !delivered {
        return Err(Ending::Cancelled);
    }
    if !head_only && !matches!(status, 204 | 205 | 304) {
        pipe(body, &mut claim.writer, &target_name).await?;
    }
    claim
        .writer
        .finish()
        .await
        .map_err(|e| Ending::from_reason(e.reason()))
}

/// The request the target receives: method, absolute URL, headers (taken from `input`) filtered
/// again, and the body (the channel's request direction, or nothing with `hasBody: false`,
/// stopped at once).
fn build_request(
    input: &mut RelayRequestInput,
    claim: &Claim,
) -> Result<http::Request<RequestBody>, Ending> {
    let bad = |why: String| Ending::Failed(Failure::Request(why));
    let body = if input.has_body {
        RequestBody::channel(claim.request.clone())
    } else {
        RequestSlot::stop(&claim.request);
        RequestBody::empty()
    };
    let mut request = http::Request::new(body);
    *request.method_mut() = http::Method::from_bytes(input.method.as_str().as_bytes())
        .map_err(|e| bad(format!("method: {e}")))?;
    *request.uri_mut() = input.url.parse().map_err(|e| bad(format!("url: {e}")))?;
    let headers = bounds::filter_relay_headers(std::mem::take(&mut input.headers), &[]);
    for (index, (name, value)) in headers.into_iter().enumerate() {
        let name = http::HeaderName::from_bytes(name.as_bytes())
            .map_err(|e| bad(format!("headers[{index}]: {e}")))?;
        let value = http::HeaderValue::from_str(&value)
            .map_err(|e| bad(format!("headers[{index}]: {e}")))?;
        request.headers_mut().append(name, value);
    }
    Ok(request)
}

/// The head of the target's answer as `relay-head` carries it, filtered, or the bound it breaks
/// (the contract's own rule for relayed headers).
fn response_head(parts: &http::response::Parts) -> Result<Vec<(String, String)>, String> {
    let status = parts.status.as_u16();
    if !(100..=599).contains(&status) || status == 101 {
        return Err(format!("status {status} (100-599, never 101)"));
    }
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
    let headers = bounds::filter_relay_headers(headers, &[]);
    bounds::relay_headers(&headers, &()).map_err(|e| format!("headers: {e}"))?;
    Ok(headers)
}

/// Pipes the target's response body into the channel's response direction. The next part is
/// pulled only while the queue ahead of the link is under [`RESPONSE_QUEUE`]: a reader that
/// stops reading holds back the target, not a queue of its bytes on the worker.
async fn pipe(
    mut body: ResponseBody,
    writer: &mut ChannelWriter,
    target: &str,
) -> Result<(), Ending> {
    writer
        .set_send_buffer(RESPONSE_QUEUE)
        .map_err(|e| Ending::from_reason(e.reason()))?;
    loop {
        // Room first, then the next part: nothing is pulled to wait in this task.
        futures::future::poll_fn(|cx| writer.poll_ready_unpin(cx))
            .await
            .map_err(|e| Ending::from_reason(e.reason()))?;
        let Some(frame) = body.frame().await else {
            break;
        };
        let frame = frame.map_err(|e| Ending::Failed(Failure::Body(target.to_owned(), e)))?;
        let Ok(data) = frame.into_data() else {
            // Trailers are not relayed.
            continue;
        };
        if data.is_empty() {
            continue;
        }
        writer
            .write_bytes(data)
            .await
            .map_err(|e| Ending::from_reason(e.reason()))?;
        if body.is_end_stream() {
            break;
        }
    }
    Ok(())
}

impl std::fmt::Debug for Relays {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Relays")
            .field("targets", &self.targets)
            .finish_non_exhaustive()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parts(status: u16, headers: &[(&str, String)]) -> http::response::Parts {
        let mut response = http::Response::new(());
        *response.status_mut() = http::StatusCode::from_u16(status).unwrap_or_default();
        for (name, value) in headers {
            if let (Ok(name), Ok(value)) = (
                http::HeaderName::from_bytes(name.as_bytes()),
                http::HeaderValue::from_str(value),
            ) {
                response.headers_mut().append(name, value);
            }
        }
        response.into_parts().0
    }

    #[test]
    fn a_head_is_filtered_then_bounded() {
        let head = response_head(&parts(
            200,
            &[
                ("content-length", "3".into()),
                ("connection", "x-hop".into()),
                ("x-hop", "1".into()),
                ("x-kept", "2".into()),
            ],
        ));
        assert_eq!(head, Ok(vec![("x-kept".into(), "2".into())]));
        assert!(response_head(&parts(101, &[])).is_err());
        let many: Vec<(String, String)> =
            (0..101).map(|n| (format!("x-{n}"), "v".into())).collect();
        let many: Vec<(&str, String)> = many.iter().map(|(n, v)| (n.as_str(), v.clone())).collect();
        let err = response_head(&parts(200, &many));
        assert_eq!(err, Err("headers: at most 100 headers, got 101".into()));
        assert!(response_head(&parts(200, &many[..100])).is_ok());
        let long = response_head(&parts(200, &[("x-long", "v".repeat(8193))]));
        assert_eq!(
            long,
            Err("headers: [0] value is longer than 8192 bytes".into())
        );
        assert!(response_head(&parts(200, &[("x-long", "v".repeat(8192))])).is_ok());
    }

    #[test]
    fn channel_failures_end_relays_by_the_table() {
        for reason in [
            FailureReason::Stopped,
            FailureReason::Aborted,
            FailureReason::Closed,
        ] {
            assert!(matches!(Ending::from_reason(reason), Ending::Cancelled));
        }
        let Ending::Failed(stalled) = Ending::from_reason(FailureReason::Stalled) else {
            unreachable!("stalled fails the relay");
        };
        assert_eq!(to_contract(stalled).code, ErrorCode::Internal);
        let Ending::Failed(refused) = Ending::from_reason(FailureReason::Refused) else {
            unreachable!("refused fails the relay");
        };
        assert_eq!(to_contract(refused).code, ErrorCode::BadRequest);
    }

    /// A body of endless 64 KiB parts that records, at every pull, how much the channel's
    /// writer had queued ahead of the link.
    struct Recording {
        link: LinkHandle,
        pulled: Arc<Mutex<Vec<u64>>>,
    }

    impl http_body::Body for Recording {
        type Data = bytes::Bytes;
        type Error = BoxError;

        fn poll_frame(
            self: std::pin::Pin<&mut Self>,
            _cx: &mut std::task::Context<'_>,
        ) -> std::task::Poll<Option<Result<http_body::Frame<bytes::Bytes>, BoxError>>> {
            self.pulled.lock().push(self.link.stats().send_buffered);
            std::task::Poll::Ready(Some(Ok(http_body::Frame::data(bytes::Bytes::from(vec![
                7u8;
                PART
            ])))))
        }
    }

    const PART: usize = 64 * 1024;

    #[tokio::test(start_paused = true)]
    async fn the_pipe_pulls_a_part_only_while_its_queue_is_under_the_bound() {
        use tokio_tungstenite::{WebSocketStream, tungstenite::protocol::Role};
        let (a, b) = tokio::io::duplex(64 * 1024);
        let gateway_ws = WebSocketStream::from_raw_socket(a, Role::Server, None).await;
        let worker_ws = WebSocketStream::from_raw_socket(b, Role::Client, None).await;
        let config = simlock_link::LinkConfig::new(simlock_link::End::Gateway);
        let (gateway, _gateway_text) = simlock_link::spawn(gateway_ws, config.clone());
        let (worker, mut worker_text) = simlock_link::spawn(worker_ws, config.for_peer());
        // Every wait is bounded (virtual time: the clock is paused).
        let patience = std::time::Duration::from_secs(60);
        let opened =
            tokio::time::timeout(patience, gateway.open_channel(&CancellationToken::new()))
                .await
                .unwrap_or_else(|_| panic!("open: timed out"))
                .unwrap_or_else(|e| panic!("open: {e}"));
        // The channel is named on the text lane after its OPEN, as relay.request does.
        tokio::time::timeout(patience, gateway.send_text("relay".into()))
            .await
            .unwrap_or_else(|_| panic!("text: timed out"))
            .unwrap_or_else(|e| panic!("text: {e}"));
        let line = tokio::time::timeout(patience, futures::StreamExt::next(&mut worker_text)).await;
        assert_eq!(line.ok().flatten().as_deref(), Some("relay"));
        let accepted = worker
            .accept_channel(opened.id().as_str())
            .unwrap_or_else(|e| panic!("accept: {e}"));
        // The gateway never reads its response direction.
        let (_response, _request) = opened.into_split();
        let (_body, mut writer) = accepted.into_split();
        let pulled = Arc::new(Mutex::new(Vec::new()));
        let body = BodyExt::boxed_unsync(Recording {
            link: worker.clone(),
            pulled: pulled.clone(),
        });
        let piping = tokio::spawn(async move { pipe(body, &mut writer, "endless").await.is_ok() });
        // With the clock paused, this returns once every task is idle: the pipe waits for room.
        tokio::time::sleep(std::time::Duration::from_secs(1)).await;
        assert!(!piping.is_finished(), "the pipe waits, it does not fail");
        let pulled = pulled.lock().clone();
        assert!(
            pulled.iter().all(|&queued| queued < RESPONSE_QUEUE as u64),
            "a part was pulled with the queue full: {pulled:?}"
        );
        // The gateway's window (256 KiB) went out, the queue holds the last part.
        let window = 256 * 1024;
        assert_eq!(pulled.len(), (window + RESPONSE_QUEUE) / PART, "{pulled:?}");
        assert_eq!(worker.stats().send_buffered, RESPONSE_QUEUE as u64);
        piping.abort();
    }
}
