//! The worker's uplink: it dials `<gateway.url>/v1/uplink` with its join token, wraps the
//! WebSocket in a link (worker end), and serves the gateway as an admin session over the link's
//! text lane, for as long as the uplink lives. It reconnects forever with jittered exponential
//! backoff; the daemon never waits for it.

use std::sync::Arc;
use std::time::Duration;

use futures::SinkExt;
use parking_lot::Mutex;
use simlock_contract::bounds::MAX_CALL_LINE;
use simlock_contract::model::{UplinkConnection, UplinkStatus};
use simlock_link::{
    End, LinkConfig, LinkHandle, ReceiveBuffer, spawn_tuned, tune_tcp, websocket_config,
};
use simlock_wire::{Origin, Transport, serve_attached};
use tokio::net::TcpStream;
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tokio_tungstenite::tungstenite::client::IntoClientRequest;
use tokio_tungstenite::tungstenite::http::HeaderValue;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use crate::clock::SharedClock;
use crate::http::parse::percent_encode;
use crate::pipeline::Pipeline;

/// The first retry waits at most this long.
pub const BACKOFF_START: Duration = Duration::from_millis(500);
/// Retries never wait longer than this.
pub const BACKOFF_CAP: Duration = Duration::from_secs(30);
/// An uplink up this long resets the backoff.
pub const STABLE_AFTER: Duration = Duration::from_secs(30);
/// Dialling (TCP connect and WebSocket handshake) gives up after this long.
pub const DIAL_TIMEOUT: Duration = Duration::from_secs(10);

/// Where and how the worker dials its gateway.
#[derive(Debug, Clone)]
pub struct UplinkConfig {
    /// The gateway's base URL (`ws://host:port`, or `wss://host:port` for TLS).
    pub url: String,
    /// The join token.
    pub token: String,
    /// This worker's instance id.
    pub worker_id: String,
    /// A label for people.
    pub label: Option<String>,
    /// What a `wss://` gateway's certificate is checked against ([`uplink_tls`]); `None` for
    /// `ws://` (a `wss://` URL without it trusts the platform's roots only).
    pub tls: Option<Arc<simlock_tls::TlsClientConfig>>,
}

/// The TLS trust for the gateway at `url`: none for `ws://`; for `wss://` the platform's roots
/// plus the certificates in `ca_file` (`gateway.caFile`, already resolved). Read once, at
/// start-up.
///
/// # Errors
/// The CA file cannot be read or holds no certificate (the message names `gateway.caFile`).
pub fn uplink_tls(
    url: &str,
    ca_file: Option<&std::path::Path>,
) -> Result<Option<Arc<simlock_tls::TlsClientConfig>>, simlock_tls::TlsError> {
    if !url.starts_with("wss://") {
        return Ok(None);
    }
    let ca_file = ca_file.map(|path| simlock_tls::PemFile::new(path, "gateway.caFile"));
    simlock_tls::client_config(ca_file.as_ref()).map(Some)
}

/// How the uplink stands.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum UplinkState {
    /// Dialling, or waiting to dial again; `last_error` says why the last attempt failed.
    Connecting {
        /// Why the previous attempt ended.
        last_error: Option<String>,
    },
    /// Up.
    Connected,
}

impl UplinkState {
    /// What `status.get` says of this state (the one translation to the contract's
    /// [`UplinkStatus`]): the gateway as `gateway` names it, and `since` when the uplink entered
    /// it.
    pub fn status(&self, gateway: &str, since: i64) -> UplinkStatus {
        let (state, last_error) = match self {
            Self::Connecting { last_error } => (UplinkConnection::Connecting, last_error.clone()),
            Self::Connected => (UplinkConnection::Connected, None),
        };
        UplinkStatus {
            gateway: gateway.to_owned(),
            state,
            last_error,
            since,
        }
    }
}

/// What `status.get` says of the uplink: [`run`] writes it as the uplink's state changes, the
/// worker reads it at each `status.get`. Made before either (the worker is built before the
/// uplink dials), connecting since then.
#[derive(Debug, Clone)]
pub struct UplinkReport {
    status: Arc<Mutex<UplinkStatus>>,
    clock: SharedClock,
}

impl UplinkReport {
    /// A report on the uplink to `gateway` (`gateway.url` as configured), read on `clock`.
    pub fn new(gateway: &str, clock: SharedClock) -> Self {
        let since = clock.now_ms();
        let connecting = UplinkState::Connecting { last_error: None };
        Self {
            status: Arc::new(Mutex::new(connecting.status(gateway, since))),
            clock,
        }
    }

    /// How the uplink stands now.
    pub fn status(&self) -> UplinkStatus {
        self.status.lock().clone()
    }

    /// The uplink is in `state`; `since` moves when it entered another state (a failed attempt
    /// after another keeps the time it began connecting), or when `restart`.
    fn record(&self, state: &UplinkState, restart: bool) {
        let now = self.clock.now_ms();
        let mut status = self.status.lock();
        let mut next = state.status(&status.gateway, now);
        if !restart && next.state == status.state {
            next.since = status.since;
        }
        *status = next;
    }
}

/// Why one attempt failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DialError {
    /// The gateway did not answer.
    #[error("unreachable: {0}")]
    Unreachable(String),
    /// The gateway refused the join token or the worker (HTTP status).
    #[error(
        "rejected with HTTP {0}: the gateway refused the join token (unknown or revoked): check gateway.token"
    )]
    Rejected(u16),
    /// The TLS handshake with a `wss://` gateway failed.
    #[error("{}", tls_message(.0))]
    Tls(simlock_tls::TlsFailure),
    /// A `ws://` URL reached a port that speaks TLS.
    #[error("the gateway speaks TLS on this port: gateway.url must start with wss://")]
    TlsRequired,
    /// Anything else.
    #[error("{0}")]
    Other(String),
}

/// A TLS failure, and the setting to change.
fn tls_message(failure: &simlock_tls::TlsFailure) -> String {
    use simlock_tls::TlsFailure;
    let fix: std::borrow::Cow<'_, str> = match failure {
        TlsFailure::Untrusted => "add the CA that signed it to gateway.caFile".into(),
        TlsFailure::CaAsLeaf => format!(
            "in the gateway's http.tls.certFile, {}",
            simlock_tls::LEAF_REMEDY
        )
        .into(),
        TlsFailure::NameMismatch { .. } => {
            "gateway.url must name a host the gateway's certificate covers".into()
        }
        TlsFailure::Expired(_) => {
            "the gateway's certificate (its http.tls.certFile) must be renewed".into()
        }
        TlsFailure::NotTls => "use a ws:// gateway.url, or serve TLS on the gateway \
                               (http.tls.certFile and http.tls.keyFile)"
            .into(),
        TlsFailure::Other(_) => "check gateway.url and gateway.caFile".into(),
    };
    format!("TLS with the gateway: {failure}: {fix}")
}

/// The delay before retry number `attempt` (1-based): `BACKOFF_START · 2^(attempt−1)`, capped at
/// [`BACKOFF_CAP`], then drawn uniformly from its upper half (`jitter` in `[0, 1)`).
pub fn backoff(attempt: u32, jitter: f64) -> Duration {
    let exp = attempt.saturating_sub(1).min(16);
    let base = BACKOFF_START.saturating_mul(1u32 << exp).min(BACKOFF_CAP);
    base.mul_f64(0.5 + 0.5 * jitter.clamp(0.0, 1.0))
}

/// The uplink URL for a gateway base URL: `<base>/v1/uplink`. A base that already ends in
/// `/v1/uplink` or `/v1` (a pasted uplink or API URL), with or without a trailing slash, is not
/// given the path twice; a path before it (a proxy's prefix) is kept.
pub fn uplink_url(base: &str) -> String {
    let base = base.trim_end_matches('/');
    // Only the path may lose a suffix, never the host (`ws://v1`).
    let authority = base.find("://").map_or(0, |scheme| scheme + 3);
    let path_start = base[authority..]
        .find('/')
        .map_or(base.len(), |slash| authority + slash);
    let (origin, path) = base.split_at(path_start);
    let path = path
        .strip_suffix("/v1/uplink")
        .or_else(|| path.strip_suffix("/v1"))
        .unwrap_or(path);
    format!("{origin}{path}/v1/uplink")
}

/// Dials once and returns the link, or why not.
///
/// # Errors
/// [`DialError`].
pub async fn dial(
    config: &UplinkConfig,
) -> Result<(LinkHandle, simlock_link::TextReceiver), DialError> {
    dial_with(config, LinkConfig::new(End::Worker)).await
}

/// Dials once with `link` as the link's settings (tests shorten its timeouts).
///
/// # Errors
/// [`DialError`].
pub async fn dial_with(
    config: &UplinkConfig,
    link: LinkConfig,
) -> Result<(LinkHandle, simlock_link::TextReceiver), DialError> {
    let url = uplink_url(&config.url);
    let tls = url.starts_with("wss://");
    let mut request = url
        .as_str()
        .into_client_request()
        .map_err(|e| DialError::Other(format!("{url}: {e}")))?;
    let headers = request.headers_mut();
    let bearer = HeaderValue::from_str(&format!("Bearer {}", config.token))
        .map_err(|_| DialError::Other("gateway.token is not a valid header value".into()))?;
    headers.insert("authorization", bearer);
    let id = HeaderValue::from_str(&config.worker_id)
        .map_err(|_| DialError::Other("the worker id is not a valid header value".into()))?;
    headers.insert("x-simlock-worker-id", id);
    if let Some(label) = &config.label
        && let Ok(value) = HeaderValue::from_str(&percent_encode(label))
    {
        headers.insert("x-simlock-worker-label", value);
    }
    let host = request.uri().host().unwrap_or_default().to_owned();
    let port = request
        .uri()
        .port_u16()
        .unwrap_or(if tls { 443 } else { 80 });
    let connect = async {
        let stream = TcpStream::connect((host.as_str(), port))
            .await
            .map_err(|e| DialError::Unreachable(format!("{host}:{port}: {e}")))?;
        // Little unsent data in the kernel, and little unread data at the gateway, keep small
        // calls quick behind bulk data.
        let _ = tune_tcp(&stream);
        let receive_buffer = ReceiveBuffer::of(&stream);
        if !tls {
            return handshake(request, stream, link, receive_buffer).await;
        }
        let trust = match &config.tls {
            Some(trust) => trust.clone(),
            None => {
                simlock_tls::client_config(None).map_err(|e| DialError::Other(e.to_string()))?
            }
        };
        let name = simlock_tls::server_name(&host)
            .map_err(|e| DialError::Other(format!("gateway.url: {e}")))?;
        let stream = simlock_tls::TlsConnector::from(trust)
            .connect(name, stream)
            .await
            .map_err(|e| DialError::Tls(simlock_tls::classify(&e, &host)))?;
        handshake(request, stream, link, receive_buffer).await
    };
    tokio::time::timeout(DIAL_TIMEOUT, connect)
        .await
        .map_err(|_| {
            DialError::Unreachable(format!("no answer within {} s", DIAL_TIMEOUT.as_secs()))
        })?
}

/// The WebSocket handshake over `stream` (plain TCP or TLS), then the link over it.
async fn handshake<S>(
    request: tokio_tungstenite::tungstenite::handshake::client::Request,
    stream: S,
    link: LinkConfig,
    receive_buffer: ReceiveBuffer,
) -> Result<(LinkHandle, simlock_link::TextReceiver), DialError>
where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
{
    let (ws, _) =
        tokio_tungstenite::client_async_with_config(request, stream, Some(websocket_config()))
            .await
            .map_err(|e| match e {
                tokio_tungstenite::tungstenite::Error::Http(response) => {
                    if response
                        .headers()
                        .contains_key(crate::http::TLS_REQUIRED_HEADER)
                    {
                        return DialError::TlsRequired;
                    }
                    match response.status().as_u16() {
                        status @ (401 | 403) => DialError::Rejected(status),
                        status => DialError::Other(format!("the gateway answered HTTP {status}")),
                    }
                }
                other => DialError::Unreachable(other.to_string()),
            })?;
    Ok(spawn_tuned(ws, link, receive_buffer))
}

/// A wire transport over a link's text lane, reading lines of at most `max_line` bytes.
pub fn text_lane(
    link: &LinkHandle,
    text: simlock_link::TextReceiver,
    max_line: usize,
) -> Transport {
    let sink = futures::sink::unfold(link.clone(), |link, line: String| async move {
        link.send_text(line).await.map(|()| link)
    });
    Transport::from_text_messages(
        text,
        sink.sink_map_err(|e| std::io::Error::other(e.to_string())),
        max_line,
    )
}

/// The server side of the text lane (the worker serving its gateway): call lines of at most 1 MiB.
pub fn text_transport(link: &LinkHandle, text: simlock_link::TextReceiver) -> Transport {
    text_lane(link, text, MAX_CALL_LINE)
}

/// The client side of the text lane (the gateway driving a worker): replies of at most 64 MiB.
pub fn client_text_transport(link: &LinkHandle, text: simlock_link::TextReceiver) -> Transport {
    text_lane(link, text, simlock_contract::bounds::MAX_CLIENT_LINE)
}

/// Keeps the uplink up until `shutdown`; `state` follows it, and so does `report` (updated
/// before `state`, so whoever wakes on `state` reads the same in `report`).
pub fn run(
    config: UplinkConfig,
    report: UplinkReport,
    pipeline: Arc<Pipeline>,
    shutdown: CancellationToken,
) -> (JoinHandle<()>, watch::Receiver<UplinkState>) {
    let initial = UplinkState::Connecting { last_error: None };
    // Connecting since now: the worker may have been made well before its first dial.
    report.record(&initial, true);
    let (state_tx, state_rx) = watch::channel(initial);
    let set = move |state: UplinkState| {
        report.record(&state, false);
        state_tx.send_replace(state);
    };
    let task = tokio::spawn(async move {
        let mut attempt: u32 = 0;
        loop {
            let dialled = tokio::select! {
                () = shutdown.cancelled() => return,
                dialled = dial(&config) => dialled,
            };
            let error = match dialled {
                Ok((link, text)) => {
                    info!(gateway = %config.url, "uplink connected");
                    set(UplinkState::Connected);
                    let up_since = tokio::time::Instant::now();
                    let transport = text_transport(&link, text);
                    let session = serve_attached(
                        transport,
                        Origin::GatewayUplink,
                        Some(Arc::new(link.clone())),
                        pipeline.clone(),
                        pipeline.session_config(),
                    );
                    tokio::select! {
                        () = shutdown.cancelled() => {
                            link.close();
                            return;
                        }
                        () = session => {}
                    }
                    link.close();
                    let reason = link.closed().await;
                    if up_since.elapsed() >= STABLE_AFTER {
                        attempt = 0;
                    }
                    format!("uplink lost: {reason}")
                }
                Err(e) => e.to_string(),
            };
            attempt = attempt.saturating_add(1);
            let delay = backoff(attempt, rand::random::<f64>());
            warn!(gateway = %config.url, error = %error, retry_in_ms = delay.as_millis(), "uplink down");
            set(UplinkState::Connecting {
                last_error: Some(error),
            });
            tokio::select! {
                () = shutdown.cancelled() => return,
                () = tokio::time::sleep(delay) => {}
            }
        }
    });
    (task, state_rx)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::http::parse::percent_decode;

    #[test]
    fn backoff_doubles_from_half_a_second_to_a_30_second_cap_with_jitter_in_the_upper_half() {
        assert_eq!(backoff(1, 1.0), Duration::from_millis(500).mul_f64(1.0));
        assert_eq!(backoff(1, 0.0), Duration::from_millis(250));
        assert_eq!(backoff(2, 0.999_999).as_millis(), 999);
        assert_eq!(backoff(7, 0.0), Duration::from_secs(15));
        assert_eq!(backoff(8, 0.0), Duration::from_secs(15));
        assert_eq!(backoff(40, 0.0), Duration::from_secs(15));
        for attempt in 1..50 {
            assert!(backoff(attempt, 0.9) <= BACKOFF_CAP);
        }
    }

    #[test]
    fn labels_survive_encoding() {
        for label in ["mac studio 2", "ünï/cødé:%", ""] {
            assert_eq!(percent_decode(&percent_encode(label)), label);
        }
        assert_eq!(percent_encode("a b"), "a%20b");
        assert_eq!(percent_decode("bad%zz"), "bad%zz");
    }

    #[test]
    fn the_uplink_path_is_derived_from_the_base_url() {
        assert_eq!(uplink_url("ws://gw:4700"), "ws://gw:4700/v1/uplink");
        assert_eq!(uplink_url("ws://gw:4700/"), "ws://gw:4700/v1/uplink");
        assert_eq!(uplink_url("wss://gw"), "wss://gw/v1/uplink");
    }

    #[test]
    fn a_pasted_uplink_or_api_path_is_not_doubled() {
        for pasted in [
            "ws://gw:4700/v1/uplink",
            "ws://gw:4700/v1/uplink/",
            "ws://gw:4700/v1",
            "ws://gw:4700/v1/",
            "ws://gw:4700/v1//",
        ] {
            assert_eq!(uplink_url(pasted), "ws://gw:4700/v1/uplink", "{pasted}");
        }
        assert_eq!(uplink_url("wss://gw/v1/uplink"), "wss://gw/v1/uplink");
    }

    #[test]
    fn a_prefix_path_is_kept_and_only_the_path_loses_a_suffix() {
        // A proxy's prefix, with or without the pasted path after it.
        assert_eq!(uplink_url("wss://gw/simlock"), "wss://gw/simlock/v1/uplink");
        assert_eq!(
            uplink_url("wss://gw/simlock/v1/uplink"),
            "wss://gw/simlock/v1/uplink"
        );
        assert_eq!(
            uplink_url("wss://gw/simlock/v1/"),
            "wss://gw/simlock/v1/uplink"
        );
        // A host named like the path, or a path that only looks like it, is left alone.
        assert_eq!(uplink_url("ws://v1"), "ws://v1/v1/uplink");
        assert_eq!(uplink_url("ws://uplink"), "ws://uplink/v1/uplink");
        assert_eq!(uplink_url("ws://gw/v10"), "ws://gw/v10/v1/uplink");
        assert_eq!(
            uplink_url("ws://gw/api/uplink"),
            "ws://gw/api/uplink/v1/uplink"
        );
    }

    #[test]
    fn the_state_is_translated_with_the_gateway_as_configured() {
        let connecting = UplinkState::Connecting {
            last_error: Some(DialError::Rejected(401).to_string()),
        };
        assert_eq!(
            connecting.status("ws://gw:4700/v1", 5),
            UplinkStatus {
                gateway: "ws://gw:4700/v1".into(),
                state: UplinkConnection::Connecting,
                last_error: Some("rejected with HTTP 401: the gateway refused the join token (unknown or revoked): check gateway.token".into()),
                since: 5,
            }
        );
        let connected = UplinkState::Connected.status("ws://gw:4700", 7);
        assert_eq!(connected.state, UplinkConnection::Connected);
        assert_eq!((connected.last_error, connected.since), (None, 7));
    }

    #[tokio::test(start_paused = true)]
    async fn since_moves_when_the_state_changes_and_not_at_each_failed_attempt() {
        let clock = crate::clock::TokioClock::starting_at(1_000).shared();
        let report = UplinkReport::new("ws://gw:4700", clock);
        assert_eq!(report.status().state, UplinkConnection::Connecting);
        assert_eq!(
            (report.status().since, report.status().last_error),
            (1_000, None)
        );

        tokio::time::advance(Duration::from_millis(100)).await;
        let rejected = |status: u16| UplinkState::Connecting {
            last_error: Some(DialError::Rejected(status).to_string()),
        };
        report.record(&rejected(401), false);
        let status = report.status();
        assert_eq!(status.since, 1_000, "still connecting since it began");
        assert_eq!(
            status.last_error.as_deref(),
            Some(
                "rejected with HTTP 401: the gateway refused the join token (unknown or revoked): check gateway.token"
            )
        );

        tokio::time::advance(Duration::from_millis(100)).await;
        report.record(&UplinkState::Connected, false);
        let status = report.status();
        assert_eq!(
            (status.state, status.since),
            (UplinkConnection::Connected, 1_200)
        );
        assert_eq!(status.last_error, None);

        tokio::time::advance(Duration::from_millis(100)).await;
        report.record(&rejected(403), false);
        let status = report.status();
        assert_eq!(
            (status.state, status.since),
            (UplinkConnection::Connecting, 1_300)
        );
        assert_eq!(status.gateway, "ws://gw:4700");

        tokio::time::advance(Duration::from_millis(100)).await;
        report.record(&UplinkState::Connecting { last_error: None }, true);
        assert_eq!(report.status().since, 1_400, "a restart starts anew");
    }
}
