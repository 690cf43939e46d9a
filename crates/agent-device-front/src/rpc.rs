//! agent-device's JSON-RPC as the front reads it: the envelope, the method, where a request
//! names its lease, and the few rewrites the front makes (the pinned device, the allocate's
//! device key and TTL). Unknown fields are kept as they are.

use bytes::Bytes;
use serde_json::{Map, Value};
use simlock_contract::model::Platform;

use crate::lease_id::LeaseId;
use crate::reply::Refusal;

/// agent-device's own cap on an `/rpc` body: 1 MiB.
pub const AGENT_DEVICE_MAX_RPC_BODY: usize = 1024 * 1024;
/// The largest `/rpc` body the front takes: agent-device's 1 MiB less 4 KiB, the room simlock's
/// own rewrites (tenant, lease ids, the pinned device, the device key) may take, so that a
/// request the front accepted is never refused by the daemon for its size.
pub const MAX_RPC_BODY: usize = AGENT_DEVICE_MAX_RPC_BODY - 4 * 1024;

/// A method the front treats on its own; anything else is [`Method::Other`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Method {
    /// `agent_device.command`.
    Command,
    /// `agent_device.lease.allocate`.
    Allocate,
    /// `agent_device.lease.heartbeat`.
    Heartbeat,
    /// `agent_device.lease.release`.
    Release,
    /// `agent_device.install_from_source`.
    InstallFromSource,
    /// `agent_device.release_materialized_paths`.
    ReleaseMaterializedPaths,
    /// Any other name (agent-device answers "Method not found").
    Other(String),
}

impl Method {
    fn parse(name: &str) -> Self {
        // agent-device accepts both spellings of its namespace.
        let rest = name
            .strip_prefix("agent_device.")
            .or_else(|| name.strip_prefix("agent-device."));
        match rest {
            Some("command") => Self::Command,
            Some("lease.allocate") => Self::Allocate,
            Some("lease.heartbeat") => Self::Heartbeat,
            Some("lease.release") => Self::Release,
            Some("install_from_source") => Self::InstallFromSource,
            Some("release_materialized_paths") => Self::ReleaseMaterializedPaths,
            _ => Self::Other(name.to_owned()),
        }
    }

    /// Whether the method is one of the three lease methods.
    pub const fn is_lease_method(&self) -> bool {
        matches!(self, Self::Allocate | Self::Heartbeat | Self::Release)
    }
}

/// One JSON-RPC request.
#[derive(Debug, Clone, PartialEq)]
pub struct RpcCall {
    /// The request's `id`, echoed in every answer.
    pub id: Value,
    /// The method.
    pub method: Method,
    /// The envelope without its params, kept for forwarding.
    envelope: Map<String, Value>,
    /// The params object.
    params: Map<String, Value>,
}

impl RpcCall {
    /// Reads a request body.
    ///
    /// # Errors
    /// agent-device's envelope errors, with the request's `id` once it could be read: parse
    /// error (-32700), not an object or no method (-32600), no params object for a method the
    /// front serves (-32602; a method it does not know is answered "Method not found" whatever
    /// its params).
    pub fn parse(bytes: &[u8]) -> Result<Self, (Refusal, Value)> {
        let value: Value = serde_json::from_slice(bytes).map_err(|_| {
            let refusal = Refusal::Invalid {
                rpc_code: -32700,
                message: "Parse error".into(),
            };
            (refusal, Value::Null)
        })?;
        let Value::Object(mut envelope) = value else {
            return Err((invalid_request(), Value::Null));
        };
        let id = envelope.get("id").cloned().unwrap_or(Value::Null);
        let Some(name) = envelope.get("method").and_then(Value::as_str) else {
            return Err((invalid_request(), id));
        };
        let method = Method::parse(name);
        let params = match envelope.remove("params") {
            Some(Value::Object(params)) => params,
            None if matches!(method, Method::Other(_)) => Map::new(),
            _ => {
                let refusal = Refusal::Invalid {
                    rpc_code: -32602,
                    message: "Invalid params".into(),
                };
                return Err((refusal, id));
            }
        };
        Ok(Self {
            id,
            method,
            envelope,
            params,
        })
    }

    /// The request's `params`.
    pub const fn params(&self) -> &Map<String, Value> {
        &self.params
    }

    /// The command of an `agent_device.command`.
    pub fn command(&self) -> Option<&str> {
        self.params().get("command").and_then(Value::as_str)
    }

    /// The lease the request names: `params.leaseId` for the lease methods; for a command or
    /// `install_from_source`, `flags.leaseId` or `meta.leaseId` (which must agree).
    ///
    /// # Errors
    /// `-32602` when a lease id is not an agent-device lease id, or two disagree.
    pub fn lease(&self) -> Result<Option<LeaseId>, Refusal> {
        let params = self.params();
        let mut found: Option<LeaseId> = None;
        let mut places: Vec<Option<&Value>> = vec![params.get("leaseId")];
        if !self.method.is_lease_method() {
            places.push(params.get("flags").and_then(|f| f.get("leaseId")));
            places.push(params.get("meta").and_then(|m| m.get("leaseId")));
        }
        for value in places.into_iter().flatten() {
            if value.is_null() {
                continue;
            }
            let lease = value
                .as_str()
                .and_then(LeaseId::parse)
                .ok_or_else(bad_lease_id)?;
            match &found {
                Some(seen) if *seen != lease => {
                    return Err(Refusal::Invalid {
                        rpc_code: -32602,
                        message: "Invalid params: the request names two different lease ids".into(),
                    });
                }
                _ => found = Some(lease),
            }
        }
        Ok(found)
    }

    /// Whether the caller picked a device itself (`--udid`, `--serial`).
    pub fn names_a_device(&self) -> bool {
        let flags = self.params().get("flags");
        ["udid", "serial"].iter().any(|key| {
            flags
                .and_then(|f| f.get(*key))
                .is_some_and(|v| !v.is_null())
        })
    }

    /// Checks the types of the allocate's params the front reads or replaces (`backend`,
    /// `platform`, `device`: text; `ttlMs`: a whole number), which it would otherwise read as
    /// absent: a `backend` of `5` leased the default platform's device.
    ///
    /// # Errors
    /// `-32602` naming the param.
    pub fn check_allocate_params(&self) -> Result<(), Refusal> {
        let params = self.params();
        let present = |key: &str| params.get(key).filter(|v| !v.is_null());
        let invalid = |message: String| Refusal::Invalid {
            rpc_code: -32602,
            message,
        };
        for key in ["backend", "platform", "device"] {
            if present(key).is_some_and(|v| !v.is_string()) {
                return Err(invalid(format!("Invalid params: {key} must be a string")));
            }
        }
        let ttl = present("ttlMs");
        if ttl.is_some_and(|v| v.as_u64().is_none()) {
            return Err(invalid(
                "Invalid params: ttlMs must be a whole number of milliseconds".into(),
            ));
        }
        // agent-device's own bounds: a lease it would refuse is refused here too, though the
        // lease simlock makes takes its ceiling whatever the caller asks.
        let (min, max) = (
            crate::config::AGENT_DEVICE_MIN_TTL_MS,
            crate::front::AGENT_DEVICE_MAX_TTL_MS,
        );
        if ttl
            .and_then(Value::as_u64)
            .is_some_and(|ms| !(min..=max).contains(&ms))
        {
            return Err(invalid(format!(
                "Invalid params: ttlMs must be between {min} and {max}"
            )));
        }
        Ok(())
    }

    /// The platform an allocate asks for, from its backend (`ios-simulator`, the default, and
    /// `ios-instance` → iOS; `android-instance` → Android); another backend is named as it is.
    pub fn allocate_platform(&self) -> Result<Platform, String> {
        let params = self.params();
        let backend = params.get("backend").and_then(Value::as_str);
        let platform = params.get("platform").and_then(Value::as_str);
        match (backend, platform) {
            (Some("ios-simulator" | "ios-instance"), _) | (None, None | Some("ios" | "apple")) => {
                Ok(Platform::Ios)
            }
            (Some("android-instance"), _) | (None, Some("android")) => Ok(Platform::Android),
            (Some(other), _) => Err(other.strip_suffix("-instance").unwrap_or(other).to_owned()),
            (None, Some(other)) => Err(other.to_owned()),
        }
    }

    /// The device model an allocate names (`--device`), if any.
    pub fn allocate_model(&self) -> Option<String> {
        self.params()
            .get("device")
            .and_then(Value::as_str)
            .filter(|d| !d.is_empty())
            .map(String::from)
    }

    /// Pins a command to the leased device: `flags.udid` (iOS) or `flags.serial` (Android),
    /// and drops a device name the profile carried.
    pub fn pin_device(&mut self, platform: Platform, address: &str) {
        let key = match platform {
            Platform::Ios => "udid",
            Platform::Android => "serial",
        };
        with_object(&mut self.params, "flags", |flags| {
            flags.remove("device");
            flags.insert(key.into(), Value::from(address));
        });
    }

    /// Names the granted device and the lease's TTL on an allocate.
    pub fn set_allocation(&mut self, device_key: &str, ttl_ms: u64) {
        self.params
            .insert("deviceKey".into(), Value::from(device_key));
        self.params.insert("ttlMs".into(), Value::from(ttl_ms));
    }

    /// Sets a heartbeat's TTL.
    pub fn set_ttl(&mut self, ttl_ms: u64) {
        self.params.insert("ttlMs".into(), Value::from(ttl_ms));
    }

    /// Points a command at `lease` in both places the CLI names it (for a `devices` read made
    /// on the caller's behalf).
    pub fn set_lease(&mut self, lease: &LeaseId) {
        for key in ["flags", "meta"] {
            with_object(&mut self.params, key, |section| {
                section.insert("leaseId".into(), Value::from(lease.as_str()));
            });
        }
    }

    /// Makes this a read the front makes itself and reads whole: no progress stream asked
    /// for, and with `part`, a request id of its own (`<the caller's>-<part>`), for one of
    /// several forwards of one request that may reach the same daemon at once (agent-device
    /// refuses a request whose id is one in flight).
    pub fn as_own_read(&mut self, part: Option<usize>) {
        let id = self.id_text();
        with_object(&mut self.params, "meta", |meta| {
            meta.remove("requestProgress");
            if let Some(part) = part {
                let base = meta
                    .get("requestId")
                    .and_then(Value::as_str)
                    .map_or_else(|| id.clone(), str::to_owned);
                meta.insert("requestId".into(), Value::from(format!("{base}-{part}")));
            }
        });
    }

    /// The heartbeat that keeps `lease` after this command: agent-device 0.21.5 renews a
    /// lease on every device command with its default TTL (60 s), whatever TTL the lease was
    /// given, so the front heartbeats it again once the command's answer ended. The session
    /// and run are the command's; the host holding the lease puts in the tenant, and the run
    /// when the command named none. Its id is the command's with `:keep` added, never one in
    /// flight.
    pub fn heartbeat_after(&self, lease: &LeaseId) -> Self {
        let id = format!("{}:keep", self.id_text());
        let mut params = Map::new();
        if let Some(session) = self.params.get("session").filter(|v| v.is_string()) {
            params.insert("session".into(), session.clone());
        }
        let run = ["meta", "flags"].iter().find_map(|section| {
            self.params
                .get(*section)
                .and_then(|fields| fields.get("runId"))
                .filter(|v| v.is_string())
        });
        if let Some(run) = run {
            params.insert("runId".into(), run.clone());
        }
        params.insert("leaseId".into(), Value::from(lease.as_str()));
        let mut envelope = self.envelope.clone();
        envelope.insert("id".into(), Value::from(id.clone()));
        envelope.insert("method".into(), Value::from("agent_device.lease.heartbeat"));
        Self {
            id: Value::from(id),
            method: Method::Heartbeat,
            envelope,
            params,
        }
    }

    /// The request's id as text, the base of the ids the front derives from it.
    fn id_text(&self) -> String {
        match &self.id {
            Value::String(id) => id.clone(),
            other => other.to_string(),
        }
    }

    /// The request as a body.
    pub fn to_bytes(&self) -> Bytes {
        let mut envelope = self.envelope.clone();
        envelope.insert("params".into(), Value::Object(self.params.clone()));
        Bytes::from(Value::Object(envelope).to_string())
    }
}

/// The device key agent-device records for a local device: `local:<family>:<os>:<id>`.
pub fn device_key(platform: Platform, address: &str) -> String {
    match platform {
        Platform::Ios => format!("local:apple:ios:{address}"),
        Platform::Android => format!("local:android:none:{address}"),
    }
}

fn invalid_request() -> Refusal {
    Refusal::Invalid {
        rpc_code: -32600,
        message: "Invalid Request".into(),
    }
}

fn bad_lease_id() -> Refusal {
    Refusal::Invalid {
        rpc_code: -32602,
        message:
            "Invalid params: leaseId is not an agent-device lease id (32 lower-case hex characters)"
                .into(),
    }
}

/// Runs `change` on the object under `key` in `map`, making it an object first when it is
/// missing or something else.
pub fn with_object(
    map: &mut Map<String, Value>,
    key: &str,
    change: impl FnOnce(&mut Map<String, Value>),
) {
    let mut object = match map.remove(key) {
        Some(Value::Object(object)) => object,
        _ => Map::new(),
    };
    change(&mut object);
    map.insert(key.to_owned(), Value::Object(object));
}

/// A `data.lease` / error reading of an answer from agent-device.
#[derive(Debug, Clone, PartialEq)]
pub enum Answer {
    /// `result.ok` was true; the `result.data`.
    Ok(Value),
    /// An error: `error.data.code` and `error.data.details.reason` when present.
    Error {
        /// agent-device's code.
        code: Option<String>,
        /// Its `details.reason`.
        reason: Option<String>,
    },
    /// Not JSON-RPC the front can read.
    Unreadable,
}

impl Answer {
    /// Reads a JSON-RPC answer body (plain JSON, or the final line of an NDJSON stream).
    pub fn read(bytes: &[u8]) -> Self {
        let value = serde_json::from_slice::<Value>(bytes)
            .ok()
            .filter(|v| v.get("type").is_none())
            .or_else(|| {
                // A progress stream: the last line holding a response (a stream of that one
                // line alone parses whole, as the line).
                bytes
                    .split(|b| *b == b'\n')
                    .rev()
                    .filter_map(|line| serde_json::from_slice::<Value>(line).ok())
                    .find_map(|v| v.get("response").cloned())
            });
        let Some(value) = value else {
            return Self::Unreadable;
        };
        if let Some(error) = value.get("error") {
            let data = error.get("data");
            return Self::Error {
                code: data
                    .and_then(|d| d.get("code"))
                    .and_then(Value::as_str)
                    .map(String::from),
                reason: data
                    .and_then(|d| d.get("details"))
                    .and_then(|d| d.get("reason"))
                    .and_then(Value::as_str)
                    .map(String::from),
            };
        }
        match value.get("result") {
            Some(result) if result.get("ok").and_then(Value::as_bool) == Some(true) => {
                Self::Ok(result.get("data").cloned().unwrap_or(Value::Null))
            }
            Some(result) if result.get("ok").and_then(Value::as_bool) == Some(false) => {
                let error = result.get("error");
                Self::Error {
                    code: error
                        .and_then(|e| e.get("code"))
                        .and_then(Value::as_str)
                        .map(String::from),
                    reason: error
                        .and_then(|e| e.get("details"))
                        .and_then(|d| d.get("reason"))
                        .and_then(Value::as_str)
                        .map(String::from),
                }
            }
            _ => Self::Unreadable,
        }
    }

    /// Whether agent-device says the lease is gone (the answers on which the CLI allocates
    /// again).
    pub fn lease_gone(&self) -> bool {
        matches!(self, Self::Error { code: Some(code), reason: Some(reason) }
            if code == "UNAUTHORIZED"
                && matches!(reason.as_str(), "LEASE_NOT_FOUND" | "LEASE_EXPIRED" | "LEASE_REVOKED"))
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    const L: &str = "0123456789abcdef0123456789abcdef";

    fn call(value: Value) -> RpcCall {
        RpcCall::parse(value.to_string().as_bytes()).unwrap()
    }

    #[test]
    fn a_call_forwarded_again_keeps_every_number_it_carried() {
        // Found by the agent_device_request fuzz target: the default float parser read
        // 4444444444444444444444444445444440 as a float one digit off its shortest form.
        let body = br#"{"id":"c1","method":"agent_device.command","params":{"x":[4444444444444444444444444445444440,55.956297025341211,1e-7,0.1]}}"#;
        let parsed = RpcCall::parse(body).unwrap();
        let again = RpcCall::parse(&parsed.to_bytes()).unwrap();
        assert_eq!(again, parsed);
        assert_eq!(again.to_bytes(), parsed.to_bytes());
    }

    fn rpc_code(err: Refusal) -> i64 {
        match err {
            Refusal::Invalid { rpc_code, .. } => rpc_code,
            other => panic!("not an envelope error: {other:?}"),
        }
    }

    /// The JSON-RPC code of a call that could not be read, and the id it echoes.
    fn envelope((err, id): (Refusal, Value)) -> (i64, Value) {
        (rpc_code(err), id)
    }

    #[test]
    fn envelope_errors_carry_json_rpcs_codes_and_the_id_once_it_is_read() {
        assert_eq!(
            envelope(RpcCall::parse(b"{nope").unwrap_err()),
            (-32700, Value::Null)
        );
        assert_eq!(
            envelope(RpcCall::parse(b"[1]").unwrap_err()),
            (-32600, Value::Null)
        );
        assert_eq!(
            envelope(RpcCall::parse(br#"{"id":"1"}"#).unwrap_err()),
            (-32600, json!("1"))
        );
        let no_params = br#"{"jsonrpc":"2.0","id":"1","method":"agent_device.command"}"#;
        assert_eq!(
            envelope(RpcCall::parse(no_params).unwrap_err()),
            (-32602, json!("1"))
        );
        let not_an_object =
            br#"{"jsonrpc":"2.0","id":7,"method":"agent_device.command","params":[]}"#;
        assert_eq!(
            envelope(RpcCall::parse(not_an_object).unwrap_err()),
            (-32602, json!(7))
        );
        // A method the front does not know needs no params: it is answered "Method not found".
        let unknown = call(json!({"jsonrpc": "2.0", "id": 1, "method": "nope"}));
        assert_eq!(unknown.method, Method::Other("nope".into()));
    }

    #[test]
    fn an_allocates_params_of_the_wrong_type_are_refused_naming_them() {
        let alloc = |params: Value| {
            call(json!({"id": 1, "method": "agent_device.lease.allocate", "params": params}))
                .check_allocate_params()
        };
        let refused = |params: Value| match alloc(params) {
            Err(Refusal::Invalid {
                rpc_code: -32602,
                message,
            }) => message,
            other => panic!("not refused: {other:?}"),
        };
        assert_eq!(
            refused(json!({"backend": 5})),
            "Invalid params: backend must be a string"
        );
        assert_eq!(
            refused(json!({"platform": ["ios"]})),
            "Invalid params: platform must be a string"
        );
        assert_eq!(
            refused(json!({"device": {}})),
            "Invalid params: device must be a string"
        );
        for ttl in [json!("huge"), json!(-1), json!(1.5)] {
            assert!(refused(json!({"ttlMs": ttl})).starts_with("Invalid params: ttlMs"));
        }
        // agent-device's bounds, at each edge and one past.
        for ttl in [4_999, 600_001, 0] {
            assert_eq!(
                refused(json!({"ttlMs": ttl})),
                "Invalid params: ttlMs must be between 5000 and 600000"
            );
        }
        for ttl in [5_000, 600_000] {
            assert_eq!(alloc(json!({"ttlMs": ttl})), Ok(()));
        }
        assert_eq!(
            alloc(
                json!({"backend": "android-instance", "device": "Pixel", "ttlMs": 60000, "platform": null})
            ),
            Ok(())
        );
        assert_eq!(alloc(json!({})), Ok(()));
    }

    #[test]
    fn both_spellings_name_a_method() {
        for name in ["agent_device.lease.allocate", "agent-device.lease.allocate"] {
            let c = call(json!({"id": "a", "method": name, "params": {}}));
            assert_eq!(c.method, Method::Allocate);
        }
        let c = call(json!({"id": "a", "method": "agent_device.nope", "params": {}}));
        assert_eq!(c.method, Method::Other("agent_device.nope".into()));
    }

    #[test]
    fn a_command_names_its_lease_in_flags_or_meta_and_they_must_agree() {
        let c = call(json!({"id": 1, "method": "agent_device.command",
            "params": {"command": "open", "flags": {"leaseId": L}, "meta": {"leaseId": L}}}));
        assert_eq!(c.lease().unwrap().unwrap().as_str(), L);
        let other = "f".repeat(32);
        let c = call(json!({"id": 1, "method": "agent_device.command",
            "params": {"command": "open", "flags": {"leaseId": L}, "meta": {"leaseId": other}}}));
        assert_eq!(rpc_code(c.lease().unwrap_err()), -32602);
        let c = call(json!({"id": 1, "method": "agent_device.command",
            "params": {"command": "open", "meta": {"leaseId": "NOTHEX"}}}));
        assert_eq!(rpc_code(c.lease().unwrap_err()), -32602);
        let c = call(
            json!({"id": 1, "method": "agent_device.command", "params": {"command": "devices"}}),
        );
        assert_eq!(c.lease().unwrap(), None);
    }

    #[test]
    fn the_backend_decides_the_platform() {
        let alloc = |params: Value| {
            call(json!({"id": 1, "method": "agent_device.lease.allocate", "params": params}))
                .allocate_platform()
        };
        assert_eq!(alloc(json!({})), Ok(Platform::Ios));
        assert_eq!(alloc(json!({"backend": "ios-instance"})), Ok(Platform::Ios));
        assert_eq!(
            alloc(json!({"backend": "android-instance"})),
            Ok(Platform::Android)
        );
        assert_eq!(
            alloc(json!({"backend": "harmonyos-instance"})),
            Err("harmonyos".into())
        );
    }

    #[test]
    fn pinning_replaces_a_device_name_with_the_leased_device() {
        let mut c = call(json!({"id": 1, "method": "agent_device.command",
            "params": {"command": "open", "flags": {"device": "Pixel 8"}}}));
        assert!(!c.names_a_device());
        c.pin_device(Platform::Android, "emulator-5554");
        let body: Value = serde_json::from_slice(&c.to_bytes()).unwrap();
        assert_eq!(body["params"]["flags"], json!({"serial": "emulator-5554"}));
        let c = call(json!({"id": 1, "method": "agent_device.command",
            "params": {"command": "open", "flags": {"udid": "X"}}}));
        assert!(c.names_a_device());
    }

    #[test]
    fn answers_are_read_from_plain_json_and_progress_streams() {
        let ok = br#"{"jsonrpc":"2.0","id":"1","result":{"ok":true,"data":{"devices":[]}}}"#;
        assert_eq!(Answer::read(ok), Answer::Ok(json!({"devices": []})));
        let gone = br#"{"jsonrpc":"2.0","id":"1","error":{"code":-32000,"message":"Lease is not active","data":{"code":"UNAUTHORIZED","details":{"reason":"LEASE_NOT_FOUND"}}}}"#;
        assert!(Answer::read(gone).lease_gone());
        let stream = b"{\"type\":\"progress\",\"event\":{}}\n{\"type\":\"response\",\"response\":{\"jsonrpc\":\"2.0\",\"id\":\"1\",\"result\":{\"ok\":true,\"data\":{}}}}\n";
        assert_eq!(Answer::read(stream), Answer::Ok(json!({})));
        // A stream of its response line alone parses whole, as that line.
        let one = b"{\"type\":\"response\",\"response\":{\"jsonrpc\":\"2.0\",\"id\":\"1\",\"result\":{\"ok\":true,\"data\":{\"devices\":[]}}}}\n";
        assert_eq!(Answer::read(one), Answer::Ok(json!({"devices": []})));
        assert_eq!(Answer::read(b"nope"), Answer::Unreadable);
    }

    #[test]
    fn the_heartbeat_after_a_command_names_its_session_run_and_lease_under_an_id_of_its_own() {
        let lease = LeaseId::parse(&"a".repeat(32)).unwrap();
        let command = call(
            json!({"jsonrpc": "2.0", "id": "c1", "method": "agent_device.command",
            "params": {"session": "adc-1", "command": "snapshot",
                "flags": {"runId": "from-flags"}, "meta": {"runId": "run9", "tenantId": "acme"}}}),
        );
        let beat = command.heartbeat_after(&lease);
        assert_eq!(beat.method, Method::Heartbeat);
        let sent: Value = serde_json::from_slice(&beat.to_bytes()).unwrap();
        assert_eq!(
            sent,
            json!({"jsonrpc": "2.0", "id": "c1:keep", "method": "agent_device.lease.heartbeat",
                "params": {"session": "adc-1", "runId": "run9", "leaseId": "a".repeat(32)}})
        );
        // A numeric id, and a command naming its run in its flags only.
        let command = call(
            json!({"jsonrpc": "2.0", "id": 7, "method": "agent_device.command",
            "params": {"session": "s", "flags": {"runId": "r"}}}),
        );
        let sent: Value =
            serde_json::from_slice(&command.heartbeat_after(&lease).to_bytes()).unwrap();
        assert_eq!(sent["id"], json!("7:keep"));
        assert_eq!(sent["params"]["runId"], json!("r"));
    }

    #[test]
    fn an_own_read_asks_for_no_progress_and_a_part_gets_a_request_id_of_its_own() {
        let body = br#"{"jsonrpc":"2.0","id":"ab","method":"agent_device.command","params":{"command":"devices","meta":{"requestId":"ab","requestProgress":"command"}}}"#;
        let mut whole = RpcCall::parse(body).unwrap();
        whole.as_own_read(None);
        assert_eq!(whole.params()["meta"], json!({"requestId": "ab"}));
        let mut part = RpcCall::parse(body).unwrap();
        part.as_own_read(Some(1));
        assert_eq!(part.params()["meta"], json!({"requestId": "ab-1"}));
        assert_eq!(
            part.id,
            json!("ab"),
            "the caller's id is still the one answered"
        );
        // No request id of the caller's: the part's is made from the JSON-RPC id.
        let bare = br#"{"jsonrpc":"2.0","id":7,"method":"agent_device.command","params":{"command":"devices"}}"#;
        let mut bare = RpcCall::parse(bare).unwrap();
        bare.as_own_read(Some(0));
        assert_eq!(bare.params()["meta"]["requestId"], "7-0");
    }
}
