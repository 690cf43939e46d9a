//! Forwarding to the daemon as agent-device's own proxy does: a header allow-list each way,
//! the daemon's token in place of the caller's, `x-agent-device-network-access: public-only`
//! on `/rpc`, `path` install sources refused, and the upload ticket pointed at the caller's
//! origin and prefix. Unlike that proxy it also passes back `range`, `x-upload-offset` and
//! `content-length` (a resumed upload needs them) and a PUT's `content-length`.
//!
//! The host also makes the caller's tenant the one agent-device sees (every session isolated
//! by tenant) and maps the front's lease ids to the daemon's own, both ways.

use bytes::Bytes;
use http::header::{CONTENT_LENGTH, CONTENT_TYPE, HeaderName, HeaderValue};
use http::{HeaderMap, Request, Response};
use serde_json::{Map, Value};

use agent_device_front::LeaseId;
use agent_device_front::rpc::with_object;
use simlock_daemon::http::parse::percent_decode;

/// Request headers passed to the daemon (agent-device's proxy list, plus `content-length`).
pub const REQUEST_HEADERS: &[&str] = &[
    "content-type",
    "content-range",
    "content-length",
    "x-artifact-type",
    "x-artifact-filename",
    "x-artifact-hash",
    "x-artifact-hash-algorithm",
];

/// Response headers passed back (agent-device's proxy list, plus the resume headers).
pub const RESPONSE_HEADERS: &[&str] = &[
    "content-type",
    "content-disposition",
    "x-request-id",
    "range",
    "x-upload-offset",
    "content-length",
];

/// The tenant header of the auxiliary routes.
pub const TENANT_HEADER: &str = "x-agent-device-tenant";
/// The longest `x-request-id` passed on.
const MAX_REQUEST_ID: usize = 128;

/// Which of the daemon's routes a request goes to, for the headers it needs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DaemonRoute {
    /// `/rpc`: the network-access header, and a JSON content type when the caller gave none.
    Rpc,
    /// Every other route (uploads, artifacts, diagnostics, health).
    Other,
}

/// The headers for the daemon: the allow-listed ones of `incoming`, the daemon's token, and
/// the tenant; and those of `to`.
pub fn upstream_headers(
    incoming: &HeaderMap,
    token: &str,
    tenant: &str,
    to: DaemonRoute,
) -> HeaderMap {
    let mut out = HeaderMap::new();
    for name in REQUEST_HEADERS {
        for value in incoming.get_all(*name) {
            out.append(HeaderName::from_static(name), value.clone());
        }
    }
    if let Ok(bearer) = HeaderValue::from_str(&format!("Bearer {token}")) {
        out.insert(http::header::AUTHORIZATION, bearer);
    }
    if let Ok(token) = HeaderValue::from_str(token) {
        out.insert("x-agent-device-token", token);
    }
    if let Ok(tenant) = HeaderValue::from_str(tenant) {
        out.insert(TENANT_HEADER, tenant);
    }
    if to == DaemonRoute::Rpc {
        out.insert(
            "x-agent-device-network-access",
            HeaderValue::from_static("public-only"),
        );
        out.entry(CONTENT_TYPE)
            .or_insert(HeaderValue::from_static("application/json"));
    }
    out
}

/// The daemon's response headers for the caller: the allow-list, and an `x-request-id` (the
/// caller's, cut to 128 characters, or a fresh one) when the daemon gave none.
pub fn downstream<B>(
    response: Response<B>,
    caller_request_id: Option<&HeaderValue>,
) -> Response<B> {
    let (mut parts, body) = response.into_parts();
    let mut headers = HeaderMap::new();
    for name in RESPONSE_HEADERS {
        for value in parts.headers.get_all(*name) {
            headers.append(HeaderName::from_static(name), value.clone());
        }
    }
    if !headers.contains_key("x-request-id") {
        let id = caller_request_id
            .and_then(|v| v.to_str().ok())
            .map(|v| v.chars().take(MAX_REQUEST_ID).collect::<String>())
            .unwrap_or_else(|| LeaseId::mint().to_string());
        if let Ok(id) = HeaderValue::from_str(&id) {
            headers.insert("x-request-id", id);
        }
    }
    parts.headers = headers;
    Response::from_parts(parts, body)
}

/// Sets a body's `content-length` for bytes the host rewrote.
pub fn set_length(headers: &mut HeaderMap, len: usize) {
    headers.remove(http::header::TRANSFER_ENCODING);
    if let Ok(value) = HeaderValue::from_str(&len.to_string()) {
        headers.insert(CONTENT_LENGTH, value);
    }
}

/// A JSON-RPC request on its way to the daemon.
#[derive(Debug, Clone, PartialEq)]
pub struct RpcRewrite {
    /// The request.
    pub envelope: Map<String, Value>,
}

/// What the host knows of a lease the caller names.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LeaseMapping<'a> {
    /// The daemon's own id for it.
    pub daemon_id: &'a str,
    /// Its run id.
    pub run_id: &'a str,
    /// The device key the daemon recorded.
    pub device_key: Option<&'a str>,
    /// The lease's backend (`android-instance`, …), which the daemon checks a command's
    /// `leaseBackend` against.
    pub backend: Option<&'a str>,
}

/// What the host needs from an allocate's request to record its lease.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AllocateScope {
    /// The session it was made for.
    pub session: Option<String>,
    /// Its run id.
    pub run_id: String,
    /// The tenant the caller declared (restored in answers).
    pub caller_tenant: Option<String>,
}

impl RpcRewrite {
    /// Reads a request the front already checked.
    pub fn parse(bytes: &[u8]) -> Option<Self> {
        match serde_json::from_slice(bytes).ok()? {
            Value::Object(envelope) => Some(Self { envelope }),
            _ => None,
        }
    }

    /// The request's id.
    pub fn id(&self) -> Value {
        self.envelope.get("id").cloned().unwrap_or(Value::Null)
    }

    /// The method without its namespace (`command`, `lease.allocate`, …).
    pub fn method(&self) -> &str {
        let name = self
            .envelope
            .get("method")
            .and_then(Value::as_str)
            .unwrap_or_default();
        name.strip_prefix("agent_device.")
            .or_else(|| name.strip_prefix("agent-device."))
            .unwrap_or(name)
    }

    fn params(&self) -> Option<&Map<String, Value>> {
        self.envelope.get("params").and_then(Value::as_object)
    }

    fn with_params(&mut self, change: impl FnOnce(&mut Map<String, Value>)) {
        with_object(&mut self.envelope, "params", change);
    }

    /// Whether the request installs from a file on the daemon's host (a `path` source
    /// without an uploaded artifact), which a proxy never passes.
    pub fn installs_from_a_path(&self) -> bool {
        let Some(params) = self.params() else {
            return false;
        };
        let meta = params.get("meta");
        let uploaded = meta
            .and_then(|m| m.get("uploadedArtifactId"))
            .is_some_and(|v| !v.is_null());
        let kind_of = |source: Option<&Value>| {
            source
                .and_then(|s| s.get("kind"))
                .and_then(Value::as_str)
                .map(String::from)
        };
        let kind = match self.method() {
            "install_from_source" => kind_of(params.get("source")),
            "command"
                if params.get("command").and_then(Value::as_str) == Some("install_source") =>
            {
                kind_of(meta.and_then(|m| m.get("installSource")))
            }
            _ => None,
        };
        kind.as_deref() == Some("path") && !uploaded
    }

    /// Asks the daemon for one JSON answer instead of a progress stream (`meta.requestProgress`
    /// dropped): the CLI reads either, and only a whole answer can be given a hint.
    pub fn without_progress(&mut self) {
        self.with_params(|params| {
            with_object(params, "meta", |meta| {
                meta.remove("requestProgress");
            });
        });
    }

    /// The allocate's scope, before the tenant is rewritten.
    pub fn allocate_scope(&self, lease: &LeaseId) -> AllocateScope {
        let params = self.params();
        let text = |key: &str| {
            params
                .and_then(|p| p.get(key))
                .and_then(Value::as_str)
                .map(String::from)
        };
        AllocateScope {
            session: text("session"),
            run_id: text("runId").unwrap_or_else(|| lease.to_string()),
            caller_tenant: text("tenantId").or_else(|| text("tenant")),
        }
    }

    /// The tenant the caller declared.
    pub fn caller_tenant(&self) -> Option<String> {
        let params = self.params()?;
        let meta = params.get("meta");
        let flags = params.get("flags");
        [
            params.get("tenantId"),
            params.get("tenant"),
            meta.and_then(|m| m.get("tenantId")),
            flags.and_then(|f| f.get("tenant")),
        ]
        .into_iter()
        .flatten()
        .find_map(|v| v.as_str().map(String::from))
    }

    /// The daemon's token in `params.token` (only when the caller put one there), the tenant
    /// in every place agent-device reads it, the daemon's lease id for the front's, and the
    /// lease's run id and device key where the caller left them out. Commands are always
    /// isolated by tenant.
    pub fn rewrite(&mut self, token: &str, tenant: &str, lease: Option<LeaseMapping<'_>>) {
        let is_lease_method = self.method().starts_with("lease.");
        self.with_params(|params| {
            if params.contains_key("token") {
                params.insert("token".into(), Value::from(token));
            }
            if is_lease_method {
                params.insert("tenantId".into(), Value::from(tenant));
                if params.contains_key("tenant") {
                    params.insert("tenant".into(), Value::from(tenant));
                }
                if let Some(lease) = lease {
                    if params.contains_key("leaseId") {
                        params.insert("leaseId".into(), Value::from(lease.daemon_id));
                    }
                    params
                        .entry("runId")
                        .or_insert_with(|| Value::from(lease.run_id));
                    if let Some(key) = lease.device_key {
                        params
                            .entry("deviceKey")
                            .or_insert_with(|| Value::from(key));
                    }
                }
                return;
            }
            for (section, tenant_key) in [("meta", "tenantId"), ("flags", "tenant")] {
                with_object(params, section, |fields| {
                    fields.insert(tenant_key.into(), Value::from(tenant));
                    fields.insert("sessionIsolation".into(), Value::from("tenant"));
                    if let Some(lease) = lease {
                        fields.insert("leaseId".into(), Value::from(lease.daemon_id));
                        fields
                            .entry("runId")
                            .or_insert_with(|| Value::from(lease.run_id));
                        if let Some(backend) = lease.backend {
                            fields
                                .entry("leaseBackend")
                                .or_insert_with(|| Value::from(backend));
                        }
                    }
                });
            }
        });
    }

    /// The request as a body.
    pub fn to_bytes(&self) -> Bytes {
        Bytes::from(Value::Object(self.envelope.clone()).to_string())
    }
}

/// The daemon's lease id in a lease answer (`result.data.lease.leaseId`).
pub fn answered_lease_id(answer: &Value) -> Option<String> {
    answer
        .pointer("/result/data/lease/leaseId")
        .and_then(Value::as_str)
        .map(String::from)
}

/// A lease answer as the caller sees it: the front's lease id and the tenant it declared.
pub fn rewrite_lease_answer(answer: &mut Value, lease: &LeaseId, caller_tenant: Option<&str>) {
    if let Some(record) = answer
        .pointer_mut("/result/data/lease")
        .and_then(Value::as_object_mut)
    {
        record.insert("leaseId".into(), Value::from(lease.as_str()));
        if let Some(tenant) = caller_tenant {
            record.insert("tenantId".into(), Value::from(tenant));
        }
    }
}

/// Points an upload ticket at `public_prefix` (the caller's origin and the front's prefix),
/// keeping `/upload/direct/<id>`, and takes the daemon's token out of its headers: the front
/// puts the caller's own credentials there.
pub fn rewrite_ticket(ticket: &mut Value, public_prefix: &str) {
    let Some(upload) = ticket.get_mut("upload").and_then(Value::as_object_mut) else {
        return;
    };
    if let Some(url) = upload.get("url").and_then(Value::as_str)
        && let Some(at) = url.find("/upload/direct/")
    {
        let rewritten = format!("{public_prefix}{}", &url[at..]);
        upload.insert("url".into(), Value::from(rewritten));
    }
    if let Some(headers) = upload.get_mut("headers").and_then(Value::as_object_mut) {
        headers.remove("authorization");
        headers.remove("x-agent-device-token");
    }
}

/// Whether the session a diagnostics path names (`segment`, percent-encoded) is one of
/// `tenant`'s (`<tenant>:<session>`, the daemon's own scoping). A segment the daemon could not
/// decode (a malformed escape, bytes that are not UTF-8) decodes here to text it refuses too.
pub fn session_inside(segment: &str, tenant: &str) -> bool {
    percent_decode(segment)
        .strip_prefix(tenant)
        .is_some_and(|rest| rest.starts_with(':'))
}

/// Builds the request for the daemon.
pub fn upstream_request<B>(
    method: http::Method,
    port: u16,
    path_and_query: &str,
    headers: HeaderMap,
    body: B,
) -> Option<Request<B>> {
    let mut request = Request::builder()
        .method(method)
        .uri(format!("http://127.0.0.1:{port}{path_and_query}"))
        .body(body)
        .ok()?;
    *request.headers_mut() = headers;
    Some(request)
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    const L: &str = "0123456789abcdef0123456789abcdef";

    fn lease() -> LeaseId {
        LeaseId::parse(L).unwrap()
    }

    #[test]
    fn only_allow_listed_headers_go_upstream_and_the_token_is_the_daemons() {
        let mut incoming = HeaderMap::new();
        incoming.insert(
            "authorization",
            HeaderValue::from_static("Bearer slk_agent"),
        );
        incoming.insert(
            "x-agent-device-token",
            HeaderValue::from_static("slk_agent"),
        );
        incoming.insert(
            "x-agent-device-tenant",
            HeaderValue::from_static("someone-else"),
        );
        incoming.insert("cookie", HeaderValue::from_static("a=b"));
        incoming.insert("content-range", HeaderValue::from_static("bytes 0-1/2"));
        incoming.insert("content-length", HeaderValue::from_static("2"));
        let out = upstream_headers(&incoming, "daemon-token", "tok_5f_a", DaemonRoute::Other);
        assert_eq!(out["authorization"], "Bearer daemon-token");
        assert_eq!(out["x-agent-device-token"], "daemon-token");
        assert_eq!(out[TENANT_HEADER], "tok_5f_a");
        assert_eq!(out["content-range"], "bytes 0-1/2");
        assert_eq!(out["content-length"], "2");
        assert!(!out.contains_key("cookie"));
        assert!(!out.contains_key("x-agent-device-network-access"));
        let rpc = upstream_headers(&HeaderMap::new(), "t", "x", DaemonRoute::Rpc);
        assert_eq!(rpc["x-agent-device-network-access"], "public-only");
        assert_eq!(rpc["content-type"], "application/json");
    }

    #[test]
    fn resume_headers_come_back_and_others_do_not() {
        let response = Response::builder()
            .status(308)
            .header("range", "bytes=0-4")
            .header("x-upload-offset", "5")
            .header("content-length", "0")
            .header("set-cookie", "x")
            .header("server", "node")
            .body(())
            .unwrap();
        let out = downstream(response, Some(&HeaderValue::from_static("req-1")));
        assert_eq!(out.headers()["range"], "bytes=0-4");
        assert_eq!(out.headers()["x-upload-offset"], "5");
        assert_eq!(out.headers()["content-length"], "0");
        assert_eq!(out.headers()["x-request-id"], "req-1");
        assert!(!out.headers().contains_key("set-cookie"));
        assert!(!out.headers().contains_key("server"));
        let long = HeaderValue::from_str(&"r".repeat(200)).unwrap();
        let out = downstream(Response::new(()), Some(&long));
        assert_eq!(out.headers()["x-request-id"].len(), MAX_REQUEST_ID);
    }

    #[test]
    fn a_command_gets_the_tenant_isolation_and_the_daemons_lease_id() {
        let mut call = RpcRewrite::parse(
            json!({"jsonrpc": "2.0", "id": "1", "method": "agent_device.command",
                "params": {"command": "open", "token": "slk_agent",
                    "flags": {"tenant": "acme", "leaseId": L},
                    "meta": {"tenantId": "acme", "leaseId": L, "runId": "run9"}}})
            .to_string()
            .as_bytes(),
        )
        .unwrap();
        assert_eq!(call.caller_tenant().as_deref(), Some("acme"));
        let daemon_id = "d".repeat(32);
        call.rewrite(
            "dtok",
            "tok_5f_a",
            Some(LeaseMapping {
                daemon_id: &daemon_id,
                run_id: "runL",
                device_key: None,
                backend: Some("android-instance"),
            }),
        );
        let body: Value = serde_json::from_slice(&call.to_bytes()).unwrap();
        let params = &body["params"];
        assert_eq!(params["token"], json!("dtok"));
        assert_eq!(params["meta"]["tenantId"], json!("tok_5f_a"));
        assert_eq!(params["flags"]["tenant"], json!("tok_5f_a"));
        assert_eq!(params["meta"]["sessionIsolation"], json!("tenant"));
        assert_eq!(params["flags"]["leaseId"], json!("d".repeat(32)));
        assert_eq!(
            params["meta"]["runId"],
            json!("run9"),
            "the caller's run id stays"
        );
        assert_eq!(
            params["flags"]["runId"],
            json!("runL"),
            "a missing one is filled"
        );
    }

    #[test]
    fn a_lease_method_gets_the_tenant_and_no_token_it_did_not_carry() {
        let mut call = RpcRewrite::parse(
            json!({"jsonrpc": "2.0", "id": "1", "method": "agent_device.lease.heartbeat",
                "params": {"session": "s", "tenantId": "acme", "runId": "r", "leaseId": L}})
            .to_string()
            .as_bytes(),
        )
        .unwrap();
        call.rewrite(
            "dtok",
            "tok_5f_a",
            Some(LeaseMapping {
                daemon_id: "dd",
                run_id: "r",
                device_key: Some("local:x"),
                backend: None,
            }),
        );
        let body: Value = serde_json::from_slice(&call.to_bytes()).unwrap();
        assert_eq!(body["params"]["tenantId"], json!("tok_5f_a"));
        assert_eq!(body["params"]["leaseId"], json!("dd"));
        assert_eq!(body["params"]["deviceKey"], json!("local:x"), "filled in");
        assert!(body["params"].get("token").is_none());
    }

    #[test]
    fn a_path_install_is_refused_unless_an_upload_backs_it() {
        let parse = |v: Value| RpcRewrite::parse(v.to_string().as_bytes()).unwrap();
        let raw = parse(json!({"method": "agent_device.install_from_source",
            "params": {"platform": "ios", "source": {"kind": "path", "path": "/etc/passwd"}}}));
        assert!(raw.installs_from_a_path());
        let url = parse(json!({"method": "agent_device.install_from_source",
            "params": {"platform": "ios", "source": {"kind": "url", "url": "https://x"}}}));
        assert!(!url.installs_from_a_path());
        let command = parse(json!({"method": "agent_device.command",
            "params": {"command": "install_source", "meta": {"installSource": {"kind": "path"}}}}));
        assert!(command.installs_from_a_path());
        let uploaded = parse(json!({"method": "agent_device.command",
            "params": {"command": "install_source",
                "meta": {"installSource": {"kind": "path"}, "uploadedArtifactId": "u1"}}}));
        assert!(!uploaded.installs_from_a_path());
    }

    #[test]
    fn a_lease_answer_shows_the_front_lease_id_and_the_callers_tenant() {
        let mut answer = json!({"jsonrpc": "2.0", "id": "1", "result": {"ok": true,
            "data": {"lease": {"leaseId": "d".repeat(32), "tenantId": "tok_5f_a", "runId": "r"}}}});
        assert_eq!(answered_lease_id(&answer), Some("d".repeat(32)));
        rewrite_lease_answer(&mut answer, &lease(), Some("acme"));
        assert_eq!(answer["result"]["data"]["lease"]["leaseId"], json!(L));
        assert_eq!(answer["result"]["data"]["lease"]["tenantId"], json!("acme"));
    }

    #[test]
    fn a_ticket_points_at_the_callers_origin_and_carries_no_daemon_token() {
        let mut ticket = json!({"ok": true, "uploadId": "u1", "upload": {
            "url": "http://127.0.0.1:4321/upload/direct/u1",
            "headers": {"authorization": "Bearer dtok", "x-agent-device-token": "dtok",
                "content-type": "application/octet-stream"}}});
        rewrite_ticket(&mut ticket, "https://gw.example:4700/v1/agent-device");
        assert_eq!(
            ticket["upload"]["url"],
            json!("https://gw.example:4700/v1/agent-device/upload/direct/u1")
        );
        assert_eq!(
            ticket["upload"]["headers"],
            json!({"content-type": "application/octet-stream"})
        );
    }

    #[test]
    fn a_session_is_inside_its_tenant_once_url_decoded() {
        assert!(session_inside("acme%3Aadc-1", "acme"));
        assert!(session_inside("acme:adc-1", "acme"));
        assert!(
            !session_inside("acme", "acme"),
            "no session after the tenant"
        );
        assert!(!session_inside("acmeX%3Aadc-1", "acme"));
        assert!(!session_inside("other%3Aadc-1", "acme"));
        assert!(!session_inside("bad%zz", "acme"));
        assert!(
            !session_inside("acme%3", "acme"),
            "a cut escape is no colon"
        );
        assert!(!session_inside("%ff", "acme"), "not UTF-8");
        assert!(
            session_inside("acme%3A%ff", "acme"),
            "inside; the daemon refuses the rest itself"
        );
    }
}
