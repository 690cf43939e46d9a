//! The HTTP backend: `/v1` routes with a bearer token over hyper's pooled HTTP/1 client.
//! Plain calls go to `POST /v1/ops/{operation}`; streams are server-sent events.
//!
//! Errors arrive as `{"error": {"code", "message", ...details}}`; [`error_from_body`] is the one
//! place an HTTP answer becomes a [`ContractError`].

use std::time::Duration;

use bytes::Bytes;
use http::{HeaderValue, Method, Request, Response, StatusCode, header};
use http_body_util::{BodyExt as _, Full, Limited};
use hyper::body::Incoming;
use hyper_rustls::HttpsConnector;
use hyper_util::client::legacy::Client as HyperClient;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use serde_json::{Map, Value};
use simlock_contract::{ContractError, ErrorBody, ErrorCode};

use crate::sse::SseStream;

/// The largest JSON answer read.
const MAX_ANSWER: usize = simlock_contract::bounds::MAX_CLIENT_LINE;

/// The pooled client: plain for `http://`, TLS for `https://`.
enum Pool {
    Plain(HyperClient<HttpConnector, Full<Bytes>>),
    Tls(HyperClient<HttpsConnector<HttpConnector>, Full<Bytes>>),
}

impl Pool {
    async fn request(
        &self,
        request: Request<Full<Bytes>>,
    ) -> Result<Response<Incoming>, hyper_util::client::legacy::Error> {
        match self {
            Self::Plain(client) => client.request(request).await,
            Self::Tls(client) => client.request(request).await,
        }
    }
}

/// A daemon's HTTP API.
pub(crate) struct HttpBackend {
    client: Pool,
    base: String,
    /// The host a TLS certificate must name.
    host: String,
    /// The CA file trusted beside the platform's roots, named when a certificate is not trusted.
    ca_file: Option<std::path::PathBuf>,
    authorization: HeaderValue,
    idle: Duration,
}

impl std::fmt::Debug for HttpBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HttpBackend")
            .field("base", &self.base)
            .finish_non_exhaustive()
    }
}

impl HttpBackend {
    /// A backend for `base_url` with the bearer `token`; an `https://` URL trusts the platform's
    /// roots plus the certificates in `ca_file`.
    pub(crate) fn new(
        base_url: &str,
        token: &str,
        idle: Duration,
        ca_file: Option<&std::path::Path>,
    ) -> Result<Self, ContractError> {
        let uri: http::Uri = base_url.parse().map_err(|e| {
            ContractError::bad_request(format!("url: {base_url:?} is not a URL: {e}"))
        })?;
        let tls = match uri.scheme_str() {
            Some("http") => false,
            Some("https") => true,
            _ => {
                return Err(ContractError::bad_request(format!(
                    "url: {base_url:?} must start with http:// or https://"
                )));
            }
        };
        if uri.authority().is_none() {
            return Err(ContractError::bad_request(format!(
                "url: {base_url:?} names no host"
            )));
        }
        if uri.query().is_some() {
            return Err(ContractError::bad_request(format!(
                "url: {base_url:?} must not carry a query"
            )));
        }
        let authorization = HeaderValue::from_str(&format!("Bearer {}", token.trim()))
            .map_err(|_| ContractError::bad_request("token: not a valid header value"))?;
        let builder = HyperClient::builder(TokioExecutor::new());
        let client = if tls {
            let ca_file = ca_file.map(|path| simlock_tls::PemFile::new(path, CA_FILE_SETTING));
            let config = simlock_tls::client_config(ca_file.as_ref())
                .map_err(|e| ContractError::bad_request(e.to_string()))?;
            let connector = hyper_rustls::HttpsConnectorBuilder::new()
                .with_tls_config((*config).clone())
                .https_only()
                .enable_http1()
                .build();
            Pool::Tls(builder.build(connector))
        } else {
            Pool::Plain(builder.build_http())
        };
        Ok(Self {
            client,
            host: uri.host().unwrap_or_default().to_owned(),
            ca_file: ca_file.filter(|_| tls).map(std::path::Path::to_path_buf),
            base: base_of(base_url),
            authorization,
            idle,
        })
    }

    /// Sends one request; `path` starts with `/v1/`.
    pub(crate) async fn send(
        &self,
        method: Method,
        path: &str,
        body: Option<&Value>,
        headers: &[(&'static str, String)],
    ) -> Result<Response<Incoming>, ContractError> {
        let uri = format!("{}{path}", self.base);
        let mut builder = Request::builder()
            .method(method.clone())
            .uri(&uri)
            .header(header::AUTHORIZATION, self.authorization.clone())
            .header(header::ACCEPT, "application/json, text/event-stream");
        for (name, value) in headers {
            builder = builder.header(*name, value);
        }
        let bytes = match body {
            Some(body) => {
                builder = builder.header(header::CONTENT_TYPE, "application/json");
                Bytes::from(
                    serde_json::to_vec(body).map_err(|e| ContractError::internal(e.to_string()))?,
                )
            }
            None => Bytes::new(),
        };
        let request = builder
            .body(Full::new(bytes))
            .map_err(|e| ContractError::bad_request(format!("{method} {uri}: {e}")))?;
        self.client.request(request).await.map_err(|e| {
            let why = match simlock_tls::find_failure(&e, &self.host) {
                Some(failure) => tls_hint(&failure, self.ca_file.as_deref()),
                None => simlock_contract::error::error_chain(&e),
            };
            ContractError::new(
                ErrorCode::DaemonConnectionLost,
                format!("cannot reach the simlock daemon at {}: {why}", self.base),
            )
            .with_details(serde_json::json!({ "url": self.base }))
        })
    }

    /// Sends one request and reads its JSON answer; an empty answer (204) reads as `{}`.
    pub(crate) async fn json(
        &self,
        method: Method,
        path: &str,
        body: Option<&Value>,
        headers: &[(&'static str, String)],
    ) -> Result<Value, ContractError> {
        let response = self.send(method, path, body, headers).await?;
        let status = response.status();
        let bytes = read_body(response.into_body()).await?;
        if !status.is_success() {
            return Err(error_from_body(status, &bytes));
        }
        if bytes.iter().all(u8::is_ascii_whitespace) {
            return Ok(Value::Object(Map::new()));
        }
        serde_json::from_slice(&bytes).map_err(|e| {
            ContractError::internal(format!("the daemon answered {path} with invalid JSON: {e}"))
        })
    }

    /// Runs an operation: `POST /v1/ops/{op}`.
    pub(crate) async fn op(&self, op: &str, payload: Value) -> Result<Value, ContractError> {
        let path = format!("/v1/ops/{}", segment(op));
        self.json(Method::POST, &path, Some(&payload), &[]).await
    }

    /// Opens an event stream; an answer that is not `text/event-stream` is read as an error.
    pub(crate) async fn open_stream(
        &self,
        method: Method,
        path: &str,
        body: Option<&Value>,
    ) -> Result<SseStream, ContractError> {
        let response = self.send(method, path, body, &[]).await?;
        let status = response.status();
        let is_stream = response
            .headers()
            .get(header::CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
            .is_some_and(|v| v.starts_with("text/event-stream"));
        if status.is_success() && is_stream {
            return Ok(SseStream::new(response.into_body(), self.idle));
        }
        let bytes = read_body(response.into_body()).await?;
        if status.is_success() {
            return Err(ContractError::internal(format!(
                "the daemon answered {path} without an event stream"
            )));
        }
        Err(error_from_body(status, &bytes))
    }
}

/// Reads a whole body of at most [`MAX_ANSWER`] bytes.
async fn read_body(body: Incoming) -> Result<Bytes, ContractError> {
    Limited::new(body, MAX_ANSWER)
        .collect()
        .await
        .map(http_body_util::Collected::to_bytes)
        .map_err(|e| {
            ContractError::new(
                ErrorCode::DaemonConnectionLost,
                format!("the daemon's answer could not be read: {e}"),
            )
        })
}

/// The error an HTTP error answer describes: `{"error": {code, message, ...details}}`, the
/// details inlined beside the code. Anything else becomes `UNKNOWN_DAEMON_ERROR` naming the status.
pub(crate) fn error_from_body(status: StatusCode, bytes: &[u8]) -> ContractError {
    let parsed = serde_json::from_slice::<Value>(bytes).ok();
    if let Some(body) = parsed
        .as_ref()
        .and_then(|v| v.get("error"))
        .and_then(ErrorBody::from_inline)
    {
        return ContractError::from_body(body);
    }
    let text = String::from_utf8_lossy(bytes);
    let snippet: String = text.chars().take(200).collect();
    ContractError::from_body(ErrorBody {
        code: format!("HTTP_{}", status.as_u16()),
        message: if snippet.trim().is_empty() {
            status.to_string()
        } else {
            snippet
        },
        details: None,
    })
}

/// Every byte but the unreserved ones (`A–Z a–z 0–9 - . _ ~`): what a path segment escapes.
const ESCAPED: &percent_encoding::AsciiSet = &percent_encoding::NON_ALPHANUMERIC
    .remove(b'-')
    .remove(b'.')
    .remove(b'_')
    .remove(b'~');

/// A path segment, percent-encoded beyond the unreserved characters.
pub(crate) fn segment(text: &str) -> String {
    percent_encoding::utf8_percent_encode(text, ESCAPED).to_string()
}

/// How the CA file is named to people: the CLI's flag and variable
/// ([`crate::ConnectOptions::ca_file`] in code).
const CA_FILE_SETTING: &str = "--ca-file (SIMLOCK_CA_FILE)";

/// A TLS failure, and what to change; `ca_file` is the CA file trusted beside the platform's roots.
fn tls_hint(failure: &simlock_tls::TlsFailure, ca_file: Option<&std::path::Path>) -> String {
    use simlock_tls::TlsFailure;
    let fix = match (failure, ca_file) {
        (TlsFailure::Untrusted, Some(path)) => format!(
            "the CA in {} did not sign it: trust the CA that signed it with {CA_FILE_SETTING}",
            path.display()
        ),
        (TlsFailure::Untrusted, None) => {
            format!("trust the CA that signed it with {CA_FILE_SETTING}")
        }
        (TlsFailure::CaAsLeaf, _) => format!("on the daemon, {}", simlock_tls::LEAF_REMEDY),
        (TlsFailure::NameMismatch { .. }, _) => {
            "the URL must name a host the certificate covers".to_owned()
        }
        (TlsFailure::Expired(_), _) => "the daemon's certificate must be renewed".to_owned(),
        (TlsFailure::NotTls, _) => "use an http:// URL for it".to_owned(),
        (TlsFailure::Other(_), _) => format!("check the URL and {CA_FILE_SETTING}"),
    };
    format!("TLS: {failure}; {fix}")
}

/// The base the API's `/v1/...` paths go under: `base_url` without its trailing slashes, and
/// without a trailing `/v1` (a URL copied from the API's own paths would double it).
fn base_of(base_url: &str) -> String {
    let base = base_url.trim_end_matches('/');
    base.strip_suffix("/v1")
        .unwrap_or(base)
        .trim_end_matches('/')
        .to_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_base_drops_trailing_slashes_and_a_trailing_v1_and_keeps_a_prefix() {
        for (given, base) in [
            ("http://h:4700", "http://h:4700"),
            ("http://h:4700/", "http://h:4700"),
            ("http://h:4700/v1", "http://h:4700"),
            ("http://h:4700/v1/", "http://h:4700"),
            ("https://h/simlock/v1", "https://h/simlock"),
            ("https://h/simlock", "https://h/simlock"),
            ("https://h/v1x", "https://h/v1x"),
        ] {
            assert_eq!(base_of(given), base, "{given}");
        }
    }

    #[test]
    fn error_bodies_carry_inline_details() {
        let err = error_from_body(
            StatusCode::NOT_FOUND,
            br#"{"error":{"code":"UNKNOWN_LEASE","message":"Unknown lease x","leaseId":"x"}}"#,
        );
        assert_eq!(err.code, ErrorCode::UnknownLease);
        assert_eq!(err.details, Some(serde_json::json!({"leaseId": "x"})));
        let err = error_from_body(StatusCode::BAD_GATEWAY, b"<html>bad gateway</html>");
        assert_eq!(err.code, ErrorCode::UnknownDaemonError);
        assert!(err.message.contains("HTTP_502"), "{}", err.message);
        let err = error_from_body(
            StatusCode::CONFLICT,
            br#"{"error":{"code":"BRAND_NEW","message":"hm"}}"#,
        );
        assert_eq!(err.code, ErrorCode::UnknownDaemonError);
    }

    #[test]
    fn segments_are_encoded() {
        assert_eq!(segment("lse_a.b-c"), "lse_a.b-c");
        assert_eq!(segment("a b/c"), "a%20b%2Fc");
    }

    #[test]
    fn http_and_https_urls_are_taken() {
        let idle = Duration::from_secs(1);
        assert!(HttpBackend::new("http://127.0.0.1:4700/", "t", idle, None).is_ok());
        assert!(HttpBackend::new("https://localhost:4700/", "t", idle, None).is_ok());
        assert_eq!(
            HttpBackend::new("ftp://x", "t", idle, None)
                .unwrap_err()
                .code,
            ErrorCode::BadRequest
        );
        let missing = std::path::Path::new("/nonexistent/ca.pem");
        let err = HttpBackend::new("https://x", "t", idle, Some(missing)).unwrap_err();
        assert_eq!(err.code, ErrorCode::BadRequest);
        assert!(err.message.contains("--ca-file"), "{}", err.message);
        // A plain URL never reads the CA file.
        assert!(HttpBackend::new("http://x", "t", idle, Some(missing)).is_ok());
    }

    /// Outside trial 11: with a CA file given that did not sign the daemon's certificate, the
    /// hint names the file tried.
    #[test]
    fn an_untrusted_certificate_names_the_ca_file_tried() {
        let untrusted = simlock_tls::TlsFailure::Untrusted;
        assert_eq!(
            tls_hint(&untrusted, None),
            "TLS: the certificate is not signed by a trusted CA; trust the CA that signed it \
             with --ca-file (SIMLOCK_CA_FILE)"
        );
        assert_eq!(
            tls_hint(&untrusted, Some(std::path::Path::new("/etc/other-ca.pem"))),
            "TLS: the certificate is not signed by a trusted CA; the CA in /etc/other-ca.pem did \
             not sign it: trust the CA that signed it with --ca-file (SIMLOCK_CA_FILE)"
        );
    }

    #[test]
    fn a_ca_certificate_served_as_the_daemons_own_is_named_with_its_fix() {
        let text = tls_hint(&simlock_tls::TlsFailure::CaAsLeaf, None);
        assert!(
            text.starts_with(
                "TLS: the certificate is a CA certificate (basicConstraints CA:TRUE), which a \
                 server cannot present as its own; on the daemon, serve a leaf certificate"
            ),
            "{text}"
        );
        assert!(
            text.contains("basicConstraints=critical,CA:FALSE"),
            "{text}"
        );
    }
}
