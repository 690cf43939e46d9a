//! `GET /v1/uplink`: where workers dial in. Refusals, in order: the gateway stopping → 503; no
//! `x-simlock-worker-id` (or an invalid one) or a label past its bound → 400; a missing or unknown join token → 401; a valid
//! token of another role → 403 (both logged as `worker.rejected`); not a WebSocket upgrade →
//! 400; a `Sec-WebSocket-Version` other than 13 → 426 naming 13 (RFC 6455 §4.2.2). A refusal
//! records no worker. Otherwise the WebSocket upgrade is answered, the socket is wrapped in a
//! link (gateway end), and the fleet drives the worker over it.

use std::sync::Arc;

use futures::FutureExt;
use futures::future::BoxFuture;
use http::{HeaderName, HeaderValue, Request, Response, StatusCode, header};
use hyper::body::Incoming;
use hyper_util::rt::TokioIo;
use simlock_contract::event::{Event, EventModule, UplinkRejection};
use simlock_contract::model::TokenRole;
use simlock_contract::{ContractError, ErrorCode, bounds};
use simlock_daemon::auth::verify_bearer;
use simlock_daemon::http::Mount;
use simlock_daemon::http::body::{Body, empty, error, error_with_status};
use simlock_daemon::http::parse::percent_decode;
use simlock_daemon::tokens::TokenStore;
use simlock_link::{End, LinkConfig, websocket_config};
use tokio::io::AsyncReadExt as _;
use tokio::net::TcpStream;
use tokio_tungstenite::WebSocketStream;
use tokio_tungstenite::tungstenite::handshake::derive_accept_key;
use tokio_tungstenite::tungstenite::protocol::Role;
use tracing::{info, warn};

use crate::fleet::Fleet;

/// The uplink route.
pub struct UplinkMount {
    fleet: Arc<Fleet>,
    tokens: Arc<TokenStore>,
}

impl UplinkMount {
    /// The route, serving `fleet` and checking join tokens in `tokens`. Revoking a token closes
    /// the uplinks opened with it.
    pub fn new(fleet: Arc<Fleet>, tokens: Arc<TokenStore>) -> Arc<Self> {
        let mut revocations = tokens.revocations();
        let weak = Arc::downgrade(&fleet);
        let stopping = fleet.stopping.clone();
        tokio::spawn(async move {
            loop {
                let revoked = tokio::select! {
                    () = stopping.cancelled() => return,
                    revoked = revocations.recv() => revoked,
                };
                match revoked {
                    Ok(id) => {
                        let Some(fleet) = weak.upgrade() else { return };
                        fleet.close_uplinks_of(id.as_str());
                    }
                    Err(tokio::sync::broadcast::error::RecvError::Lagged(_)) => {}
                    Err(tokio::sync::broadcast::error::RecvError::Closed) => return,
                }
            }
        });
        Arc::new(Self { fleet, tokens })
    }

    fn rejected(&self, reason: UplinkRejection, worker_id: Option<&str>, label: Option<&str>) {
        self.fleet.bus.emit(
            EventModule::Fleet,
            &Event::WorkerRejected {
                reason,
                worker_id: worker_id.map(str::to_owned),
                label: label.map(str::to_owned),
            },
        );
    }

    fn accept(&self, mut request: Request<Incoming>) -> Response<Body> {
        if self.fleet.stopping.is_cancelled() {
            // A worker that redials while the gateway stops is told so, and retries later.
            return error(&simlock_daemon::http::body::stopping_error());
        }
        let headers = request.headers();
        // Who dials is checked first: a caller without a worker token learns nothing of what
        // an uplink needs. The worker's headers only name it in the refusal's event.
        let worker_id = worker_id(headers);
        let label = worker_label(headers);
        let (named_id, named) = (
            worker_id.as_ref().ok().map(String::as_str),
            label.as_ref().ok().and_then(Option::as_deref),
        );
        let token = match simlock_daemon::auth::authorization(headers)
            .and_then(|authorization| verify_bearer(&self.tokens, authorization))
        {
            Ok(token) => token,
            Err(err) => {
                // A refusal of who dials is recorded; a malformed head (a header sent twice)
                // is only answered.
                if err.code == ErrorCode::Unauthenticated {
                    self.rejected(UplinkRejection::Unauthenticated, named_id, named);
                }
                return error(&err);
            }
        };
        if token.role != TokenRole::Worker {
            self.rejected(UplinkRejection::Forbidden, named_id, named);
            return error(&ContractError::forbidden(
                "Only a worker (join) token may open an uplink",
            ));
        }
        let (worker_id, label) = match (worker_id, label) {
            (Ok(worker_id), Ok(label)) => (worker_id, label),
            (Err(err), _) | (_, Err(err)) => return error(&err),
        };
        let is_upgrade = headers
            .get(header::UPGRADE)
            .and_then(|v| v.to_str().ok())
            .is_some_and(|v| v.eq_ignore_ascii_case("websocket"));
        let key = headers
            .get("sec-websocket-key")
            .and_then(|v| v.to_str().ok())
            .map(|k| derive_accept_key(k.as_bytes()));
        let (true, Some(accept)) = (is_upgrade, key) else {
            return error_with_status(
                &ContractError::bad_request("/v1/uplink takes a WebSocket upgrade"),
                StatusCode::BAD_REQUEST,
            );
        };
        if let Some(refused) = refuse_websocket_version(headers) {
            return refused;
        }
        let upgrade = hyper::upgrade::on(&mut request);
        let fleet = self.fleet.clone();
        let token_id = token.id.to_string();
        tokio::spawn(async move {
            let upgraded = match upgrade.await {
                Ok(upgraded) => upgraded,
                Err(e) => {
                    warn!(worker = %worker_id, error = %e, "the uplink upgrade failed");
                    return;
                }
            };
            let (link, text) = match upgraded.downcast::<TokioIo<TcpStream>>() {
                Ok(parts) => {
                    // Tune the socket itself: little unsent data in the kernel, and little
                    // unread data here, keep small calls quick behind bulk data. Bytes hyper
                    // already read come first.
                    let stream = parts.io.into_inner();
                    let _ = simlock_link::tune_tcp(&stream);
                    let receive_buffer = simlock_link::ReceiveBuffer::of(&stream);
                    let (read, write) = stream.into_split();
                    let read = std::io::Cursor::new(parts.read_buf).chain(read);
                    let io = tokio::io::join(read, write);
                    let ws = WebSocketStream::from_raw_socket(
                        io,
                        Role::Server,
                        Some(websocket_config()),
                    )
                    .await;
                    simlock_link::spawn_tuned(ws, link_config(&fleet), receive_buffer)
                }
                Err(upgraded) => match upgraded.downcast::<TokioIo<simlock_tls::ServerStream>>() {
                    Ok(parts) => {
                        // The same over TLS: the socket under the TLS stream is tuned, and the
                        // (decrypted) bytes hyper already read come first.
                        let stream = parts.io.into_inner();
                        let _ = simlock_link::tune_tcp(stream.get_ref().0);
                        let receive_buffer = simlock_link::ReceiveBuffer::of(stream.get_ref().0);
                        let (read, write) = tokio::io::split(stream);
                        let read = std::io::Cursor::new(parts.read_buf).chain(read);
                        let io = tokio::io::join(read, write);
                        let ws = WebSocketStream::from_raw_socket(
                            io,
                            Role::Server,
                            Some(websocket_config()),
                        )
                        .await;
                        simlock_link::spawn_tuned(ws, link_config(&fleet), receive_buffer)
                    }
                    Err(upgraded) => {
                        let ws = WebSocketStream::from_raw_socket(
                            TokioIo::new(upgraded),
                            Role::Server,
                            Some(websocket_config()),
                        )
                        .await;
                        simlock_link::spawn(ws, link_config(&fleet))
                    }
                },
            };
            info!(worker = %worker_id, "uplink accepted");
            fleet.accept_uplink(worker_id, label, token_id, link, text);
        });
        let mut response = Response::new(empty());
        *response.status_mut() = StatusCode::SWITCHING_PROTOCOLS;
        let headers = response.headers_mut();
        headers.insert(header::UPGRADE, HeaderValue::from_static("websocket"));
        headers.insert(header::CONNECTION, HeaderValue::from_static("Upgrade"));
        if let Ok(accept) = HeaderValue::from_str(&accept) {
            headers.insert("sec-websocket-accept", accept);
        }
        response
    }
}

/// The WebSocket version this gateway speaks (RFC 6455).
const WEBSOCKET_VERSION: &str = "13";

/// The refusal of a `Sec-WebSocket-Version` other than 13, or none: `426 Upgrade Required`
/// naming the version this gateway speaks (RFC 6455 §4.2.2).
fn refuse_websocket_version(headers: &http::HeaderMap) -> Option<Response<Body>> {
    let version = headers
        .get(header::SEC_WEBSOCKET_VERSION)
        .and_then(|v| v.to_str().ok())
        .map(str::trim);
    if version == Some(WEBSOCKET_VERSION) {
        return None;
    }
    let message = match version {
        None => format!(
            "Sec-WebSocket-Version: required; this gateway speaks WebSocket version {WEBSOCKET_VERSION}"
        ),
        Some(other) => format!(
            "Sec-WebSocket-Version: {other:?} is not spoken here; this gateway speaks WebSocket version {WEBSOCKET_VERSION}"
        ),
    };
    let mut response = error_with_status(
        &ContractError::bad_request(message),
        StatusCode::UPGRADE_REQUIRED,
    );
    response.headers_mut().insert(
        header::SEC_WEBSOCKET_VERSION,
        HeaderValue::from_static(WEBSOCKET_VERSION),
    );
    Some(response)
}

/// The worker's id (`x-simlock-worker-id`): sent once, and an id.
fn worker_id(headers: &http::HeaderMap) -> Result<String, ContractError> {
    let name = HeaderName::from_static("x-simlock-worker-id");
    simlock_daemon::auth::single_header(headers, &name, "x-simlock-worker-id")?
        .and_then(|v| v.to_str().ok())
        .filter(|id| bounds::is_worker_id(id))
        .map(str::to_owned)
        .ok_or_else(|| {
            ContractError::bad_request(
                "x-simlock-worker-id: required, 1-128 characters of letters, digits, '_' or '-'",
            )
        })
}

/// The worker's label (`x-simlock-worker-label`, optional): sent at most once, percent-decoded,
/// at most the contract's label bound and printable (a peer's text that ends up in views and
/// events).
fn worker_label(headers: &http::HeaderMap) -> Result<Option<String>, ContractError> {
    let name = HeaderName::from_static("x-simlock-worker-label");
    let Some(raw) = simlock_daemon::auth::single_header(headers, &name, "x-simlock-worker-label")?
    else {
        return Ok(None);
    };
    let label = raw.to_str().map(percent_decode).map_err(|_| {
        ContractError::bad_request("x-simlock-worker-label: must be percent-encoded text")
    })?;
    bounds::label(&label)
        .map_err(|e| ContractError::bad_request(format!("x-simlock-worker-label: {e}")))?;
    Ok(Some(label).filter(|l| !l.is_empty()))
}

/// Where workers dial in.
const UPLINK_PATH: &str = "/v1/uplink";

impl Mount for UplinkMount {
    fn route(&self) -> &'static str {
        UPLINK_PATH
    }

    fn matches(&self, path: &str) -> bool {
        path == UPLINK_PATH
    }

    fn takes_websocket(&self) -> bool {
        true
    }

    fn serve(&self, request: Request<Incoming>) -> BoxFuture<'static, Response<Body>> {
        let response = self.accept(request);
        async move { response }.boxed()
    }
}

/// The gateway end's link configuration, with the fleet's stall timeout.
fn link_config(fleet: &Fleet) -> LinkConfig {
    let mut config = LinkConfig::new(End::Gateway);
    config.stall_timeout = fleet.timing.link_stall_timeout;
    config
}

#[cfg(test)]
mod tests {
    use simlock_daemon::http::parse::percent_encode;

    use super::*;

    fn label(text: &str) -> Result<Option<String>, ContractError> {
        labels(&[text])
    }

    fn labels(texts: &[&str]) -> Result<Option<String>, ContractError> {
        let mut headers = http::HeaderMap::new();
        for text in texts {
            headers.append(
                "x-simlock-worker-label",
                HeaderValue::from_str(&percent_encode(text)).unwrap(),
            );
        }
        worker_label(&headers)
    }

    #[test]
    fn a_label_at_its_bound_passes_and_one_past_it_is_refused() {
        let at = "é".repeat(bounds::MAX_LABEL);
        assert_eq!(label(&at).unwrap(), Some(at.clone()));
        let err = label(&format!("{at}x")).unwrap_err();
        assert_eq!(err.code, ErrorCode::BadRequest);
        assert!(
            err.message.starts_with("x-simlock-worker-label"),
            "{}",
            err.message
        );
        assert_eq!(labels(&[]).unwrap(), None);
        // Sent twice, as the worker id: which one counts would be a guess.
        let err = labels(&["a", "b"]).unwrap_err();
        assert_eq!(err.code, ErrorCode::BadRequest);
        assert!(err.message.contains("sent 2 times"), "{}", err.message);
        assert_eq!(label("").unwrap(), None);
        // Outside trial 22: a label shows in every listing and event; no control characters.
        let err = label("mini\n3").unwrap_err();
        assert_eq!(err.code, ErrorCode::BadRequest);
        assert!(
            err.message.contains("control characters"),
            "{}",
            err.message
        );
    }
}
