//! `docs/HTTP-API.md` and `docs/CONFIGURATION.md` cannot drift from the code.
//!
//! - HTTP: every route the host matches (`http/mod.rs`, plus `/v1/healthz` and the gateway's
//!   `/v1/uplink`) is documented, and every route the doc names exists; every JSON example parses
//!   as what its fence says (an operation's output, a lease-request view, an error with its
//!   status, a request body); the status table is the contract's error table; the lease-request
//!   body keys are the host's; every SSE event named is one the host sends.
//! - Configuration: the uplink's constants are the documented ones. The keys, defaults,
//!   examples and flags are checked against the sections the binaries register, in
//!   `simlock-e2e`'s `tests/config_docs.rs`.

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    reason = "test helpers fail the test by panicking"
)]

use std::collections::BTreeSet;
use std::time::Duration;

use serde_json::{Map, Value};
use simlock_contract::error::ERROR_TABLE;
use simlock_contract::http::{LeaseRequestBody, RequestView};
use simlock_contract::ids::DeviceId;
use simlock_contract::model::{LeaseEndReason, LeaseGrant};
use simlock_contract::ops::{
    CatalogGet, ConfigGet, DaemonStop, DeviceExec, EventsReplay, LeaseCancel, LeaseGet, LeaseList,
    LeaseRelease, LeaseReleaseAll, LeaseRenew, LeaseRequest, ListGet, StatusGet, TokenCreate,
    TokenList, TokenRevoke, WorkerDrain, WorkerList, WorkerRemove, WorkerUndrain, decode_named,
};
use simlock_contract::push::UnhealthyReason;
use simlock_contract::{ErrorCode, OPERATIONS, Operation, Push};
use simlock_daemon::http::DRAIN_GRACE;
use simlock_daemon::http::body::{DISCARD_LIMIT, DISCARD_TIMEOUT, KEEPALIVE, MAX_JSON_BODY};
use simlock_daemon::http::parse;
use simlock_daemon::http::requests::{MAX_WAIT, RequestState};
use simlock_daemon::uplink::{BACKOFF_CAP, BACKOFF_START, DIAL_TIMEOUT, STABLE_AFTER};
use simlock_test_support::markdown::{blocks, codes, doc, first_code, table, workspace_file};

// === Reading ===

/// A file of this crate's (or, through `..`, a neighbour's) sources.
fn read(relative: &str) -> String {
    workspace_file(&format!("crates/simlock-daemon/{relative}"))
}

fn http_doc() -> String {
    doc("HTTP-API.md")
}

fn config_doc() -> String {
    doc("CONFIGURATION.md")
}

#[test]
fn the_uplink_constants_are_documented() {
    for doc in [config_doc(), http_doc()] {
        for expected in [
            format!("{} s × 2^(n−1)", BACKOFF_START.as_secs_f64()),
            format!("capped at {} s", BACKOFF_CAP.as_secs()),
            format!("stayed up {} s", STABLE_AFTER.as_secs()),
            format!("gives up after {} s", DIAL_TIMEOUT.as_secs()),
        ] {
            assert!(doc.contains(&expected), "missing {expected:?}");
        }
    }
}

// === HTTP ===

/// The routes the host matches: `METHOD /v1/…` with `{}` for a path parameter.
fn routes() -> BTreeSet<String> {
    let mut routes = routes_in(&read("src/http/mod.rs"), "/v1/");
    routes.extend(routes_in(
        &read("../agent-device-front/src/front.rs"),
        "/v1/agent-device/",
    ));
    assert!(
        routes.contains("POST /v1/agent-device/rpc"),
        "the agent-device routes moved"
    );
    let host = read("src/http/mod.rs");
    assert!(
        host.contains(r#"if path == "/v1/healthz" {"#)
            && host.contains("return if method == Method::GET {"),
        "the health route moved"
    );
    routes.insert("GET /v1/healthz".to_owned());
    assert!(
        read("../simlock-fleet/src/uplink.rs")
            .contains(r#"const UPLINK_PATH: &str = "/v1/uplink";"#),
        "the uplink route moved"
    );
    routes.insert("GET /v1/uplink".to_owned());
    routes
}

/// The routes a `match (method, segments)` in `source` serves, under `prefix`.
fn routes_in(source: &str, prefix: &str) -> BTreeSet<String> {
    let mut routes = BTreeSet::new();
    for (at, _) in source.match_indices("(&Method::") {
        let arm = &source[at + "(&Method::".len()..];
        let method = arm.split(',').next().unwrap();
        let list = arm.split_once('[').unwrap().1.split_once(']').unwrap().0;
        let path: Vec<String> = list
            .split(',')
            .map(str::trim)
            .map(|segment| {
                segment
                    .strip_prefix('"')
                    .and_then(|s| s.strip_suffix('"'))
                    .map_or_else(|| "{}".to_owned(), String::from)
            })
            .collect();
        routes.insert(format!("{method} {prefix}{}", path.join("/")));
    }
    routes
}

/// The host's `ROUTES` table (for `405`'s `Allow`), as `METHOD /v1/…`.
fn allow_table() -> BTreeSet<String> {
    let host = read("src/http/mod.rs");
    let table = host
        .split_once("const ROUTES: &[(&str, &str)] = &[")
        .expect("the ROUTES table moved")
        .1
        .split_once("];")
        .unwrap()
        .0;
    table
        .lines()
        .filter_map(|line| {
            let line = line.trim().strip_prefix("(\"")?.strip_suffix("\"),")?;
            let (method, path) = line.split_once("\", \"")?;
            Some(format!("{method} /v1/{path}"))
        })
        .collect()
}

#[test]
fn the_allow_table_is_the_routes_the_host_matches() {
    let mut served = routes_in(&read("src/http/mod.rs"), "/v1/");
    served.insert("GET /v1/healthz".to_owned());
    assert_eq!(allow_table(), served);
}

/// Every `METHOD /v1/…` the doc mentions, path parameters written `{}`.
fn mentioned_routes(doc: &str) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    for method in ["GET", "POST", "PUT", "PATCH", "DELETE", "HEAD", "OPTIONS"] {
        for (at, _) in doc.match_indices(&format!("{method} /v1/")) {
            let preceded_by_word = doc[..at]
                .chars()
                .next_back()
                .is_some_and(|c| c.is_ascii_alphanumeric());
            if preceded_by_word {
                continue;
            }
            let path: String = doc[at + method.len() + 1..]
                .chars()
                .take_while(|c| !c.is_whitespace() && !"`?:,)".contains(*c))
                .collect();
            let path: Vec<&str> = path
                .split('/')
                .map(|s| if s.starts_with('{') { "{}" } else { s })
                .collect();
            out.insert(format!("{method} {}", path.join("/")));
        }
    }
    out
}

fn matches_route(mention: &str, route: &str) -> bool {
    let (m1, p1) = mention.split_once(' ').unwrap();
    let (m2, p2) = route.split_once(' ').unwrap();
    let (s1, s2): (Vec<&str>, Vec<&str>) = (p1.split('/').collect(), p2.split('/').collect());
    m1 == m2
        && s1.len() == s2.len()
        && s1
            .iter()
            .zip(&s2)
            .all(|(a, b)| a == b || (*b == "{}" && !a.is_empty()))
}

#[test]
fn every_route_is_documented_and_every_documented_route_exists() {
    let routes = routes();
    assert!(routes.len() >= 30, "the route parser found {routes:?}");
    let mentioned = mentioned_routes(&http_doc());
    let undocumented: Vec<_> = routes.difference(&mentioned).collect();
    assert!(undocumented.is_empty(), "undocumented: {undocumented:?}");
    let invented: Vec<_> = mentioned
        .iter()
        .filter(|m| !routes.iter().any(|r| matches_route(m, r)))
        .collect();
    assert!(invented.is_empty(), "no such route: {invented:?}");
}

#[test]
fn the_status_table_is_the_contracts_error_table() {
    let doc = http_doc();
    let mut listed = Vec::new();
    for row in table(&doc, "| status | codes |") {
        let status: u16 = row[0].parse().unwrap();
        for code in codes(row[1]) {
            let parsed = ErrorCode::from_wire(code).unwrap_or_else(|| panic!("no code {code}"));
            assert_eq!(parsed.http_status(), status, "{code}");
            listed.push(parsed);
        }
    }
    let mut all: Vec<ErrorCode> = ERROR_TABLE.iter().map(|r| r.code).collect();
    all.sort_unstable();
    listed.sort_unstable();
    assert_eq!(listed, all, "every code once");
}

/// The lease-request body keys: (HTTP key, operation field), from the host's source.
/// The lease-request body's keys and the `lease.request` field each becomes, read off the types:
/// a body with a distinct value in every key, and the input it turns into.
fn request_keys() -> Vec<(String, String)> {
    let every = serde_json::json!({
        "platform": "ios", "device": "d", "os": "o", "ttlMs": 11, "timeoutMs": 12,
        "noWait": true, "requires": ["r"], "leaseId": "l", "requesterId": "q"
    });
    let body: LeaseRequestBody = serde_json::from_value(every).unwrap();
    let keys = serde_json::to_value(&body).unwrap();
    let fields = serde_json::to_value(body.into_input(None)).unwrap();
    let fields = fields.as_object().unwrap();
    let mut pairs: Vec<(String, String)> = keys
        .as_object()
        .unwrap()
        .iter()
        .map(|(key, value)| {
            let (field, _) = fields.iter().find(|(_, v)| *v == value).unwrap();
            (key.clone(), field.clone())
        })
        .collect();
    pairs.sort();
    pairs
}

#[test]
fn the_lease_request_body_keys_are_the_hosts() {
    let real = request_keys();
    assert!(real.len() >= 9, "{real:?}");
    let doc = http_doc();
    let documented: Vec<(String, String)> =
        table(&doc, "| body key | `lease.request` field | meaning |")
            .iter()
            .map(|row| {
                (
                    first_code(row[0]).unwrap().to_owned(),
                    first_code(row[1]).unwrap().to_owned(),
                )
            })
            .collect();
    let mut documented = documented;
    documented.sort();
    assert_eq!(documented, real);
}

/// Every request state. A new state fails to compile here until the docs are updated.
fn states() -> [RequestState; 8] {
    let all = [
        RequestState::Pending,
        RequestState::Queued,
        RequestState::Provisioning,
        RequestState::Booting,
        RequestState::Reclaiming,
        RequestState::Granted,
        RequestState::Failed,
        RequestState::Cancelled,
    ];
    for state in all {
        match state {
            RequestState::Pending
            | RequestState::Queued
            | RequestState::Provisioning
            | RequestState::Booting
            | RequestState::Reclaiming
            | RequestState::Granted
            | RequestState::Failed
            | RequestState::Cancelled => {}
            // A reader's name for states it does not know; the host never sends it.
            RequestState::Unknown => {}
        }
    }
    all
}

/// Every SSE event name the host sends.
fn event_names() -> BTreeSet<String> {
    let lease = "lse_1".to_owned();
    let device = DeviceId::from_raw("dev_1");
    let mut names: BTreeSet<String> = states().iter().map(|s| s.as_str().to_owned()).collect();
    for push in [
        Push::LeaseLost {
            lease_id: lease.clone(),
            device_id: device.clone(),
            reason: LeaseEndReason::Expired,
        },
        Push::DeviceUnhealthy {
            lease_id: lease.clone(),
            device_id: device.clone(),
            reason: UnhealthyReason::Crashed,
        },
        Push::DeviceRecovered {
            lease_id: lease,
            device_id: device,
            attempts: 1,
        },
    ] {
        names.insert(push.kind().to_owned());
    }
    let source = read("src/http/mod.rs");
    for name in ["output", "exit", "error", "event", "lagged", "stopping"] {
        assert!(
            source.contains(&format!("sse_event(\"{name}\"")),
            "the host sends no {name:?} event"
        );
        names.insert(name.to_owned());
    }
    names
}

#[test]
fn event_streams_are_documented_as_sent() {
    let doc = http_doc();
    for state in states() {
        assert!(
            doc.contains(&format!("| `{}` |", state.as_str())),
            "state {} is not in the states table",
            state.as_str()
        );
    }
    let names = event_names();
    for line in doc.lines() {
        if let Some(name) = line.strip_prefix("event: ") {
            assert!(names.contains(name), "the host sends no {name:?} event");
        }
        if let Some(data) = line.strip_prefix("data: ") {
            let parsed: Result<Value, _> = serde_json::from_str(data);
            assert!(parsed.is_ok(), "not JSON: {data}");
        }
    }
    for name in &names {
        assert!(
            doc.contains(&format!("`{name}`")),
            "event {name} is not named"
        );
    }
}

#[test]
fn the_hosts_limits_are_documented() {
    let doc = http_doc();
    for expected in [
        format!("({MAX_JSON_BODY} bytes)"),
        format!("clamped to 0–{}", MAX_WAIT.as_secs()),
        format!("When no event was sent for {} s", KEEPALIVE.as_secs()),
        format!(
            "up to {} MiB more within {} s",
            DISCARD_LIMIT / (1024 * 1024),
            DISCARD_TIMEOUT.as_secs()
        ),
        format!(
            "other open\n  connections get {} s to finish",
            DRAIN_GRACE.as_secs()
        ),
        "`: keepalive`".to_owned(),
        "`Retry-After: 5`".to_owned(),
    ] {
        assert!(doc.contains(&expected), "missing {expected:?}");
    }
    assert_eq!(KEEPALIVE, Duration::from_secs(15));
    let body = read("src/http/body.rs");
    assert!(body.contains(r#"b": keepalive\n\n""#));
    assert!(body.contains(r#"HeaderValue::from_static("5")"#));
}

fn round_trip<O: Operation>(value: &Value) -> Value {
    let typed: O::Output = serde_json::from_value(value.clone())
        .unwrap_or_else(|e| panic!("not a {} output: {e}: {value}", O::NAME));
    serde_json::to_value(typed).unwrap()
}

/// `value` read as `op`'s output and written back.
fn output_round_trip(op: &str, value: &Value) -> Value {
    match op {
        "status.get" => round_trip::<StatusGet>(value),
        "catalog.get" => round_trip::<CatalogGet>(value),
        "config.get" => round_trip::<ConfigGet>(value),
        "list.get" => round_trip::<ListGet>(value),
        "lease.request" => round_trip::<LeaseRequest>(value),
        "lease.renew" => round_trip::<LeaseRenew>(value),
        "lease.release" => round_trip::<LeaseRelease>(value),
        "lease.cancel" => round_trip::<LeaseCancel>(value),
        "lease.list" => round_trip::<LeaseList>(value),
        "lease.get" => round_trip::<LeaseGet>(value),
        "lease.release-all" => round_trip::<LeaseReleaseAll>(value),
        "device.exec" => round_trip::<DeviceExec>(value),
        "events.replay" => round_trip::<EventsReplay>(value),
        "token.create" => round_trip::<TokenCreate>(value),
        "token.list" => round_trip::<TokenList>(value),
        "token.revoke" => round_trip::<TokenRevoke>(value),
        "daemon.stop" => round_trip::<DaemonStop>(value),
        "worker.list" => round_trip::<WorkerList>(value),
        "worker.drain" => round_trip::<WorkerDrain>(value),
        "worker.undrain" => round_trip::<WorkerUndrain>(value),
        "worker.remove" => round_trip::<WorkerRemove>(value),
        other => panic!("no output check for {other}"),
    }
}

/// A `{"request": view}` body: known fields, each where its state allows it.
fn check_request_view(value: &Value) {
    let view = value
        .get("request")
        .and_then(Value::as_object)
        .unwrap_or_else(|| panic!("no request object: {value}"));
    let allowed = [
        "id",
        "state",
        "queuePosition",
        "etaSeconds",
        "createdAt",
        "lease",
        "error",
    ];
    for key in view.keys() {
        assert!(allowed.contains(&key.as_str()), "unknown field {key}");
    }
    assert!(view["id"].as_str().unwrap().starts_with("req_"));
    assert!(view["createdAt"].is_i64());
    let state = view["state"].as_str().unwrap();
    assert!(
        states().iter().any(|s| s.as_str() == state),
        "unknown state {state}"
    );
    assert_eq!(view.contains_key("queuePosition"), state == "queued");
    assert_eq!(
        view.contains_key("etaSeconds"),
        matches!(state, "provisioning" | "booting" | "reclaiming")
    );
    assert_eq!(view.contains_key("lease"), state == "granted");
    if let Some(lease) = view.get("lease") {
        let grant: LeaseGrant = serde_json::from_value(lease.clone()).unwrap();
        assert_eq!(&serde_json::to_value(grant).unwrap(), lease);
    }
    if let Some(error) = view.get("error") {
        assert!(matches!(state, "failed" | "cancelled"));
        assert!(
            !error.as_object().unwrap().contains_key("details"),
            "details are inlined: {error}"
        );
    }
    // The whole view as the daemon writes it.
    let typed: RequestView = serde_json::from_value(value["request"].clone()).unwrap();
    assert_eq!(&serde_json::to_value(typed).unwrap(), &value["request"]);
}

/// An error body answered with `status`.
fn check_error(value: &Value, status: u16) {
    let error = value
        .get("error")
        .and_then(Value::as_object)
        .unwrap_or_else(|| panic!("no error object: {value}"));
    assert_eq!(value.as_object().unwrap().len(), 1, "only `error`: {value}");
    let code = error["code"].as_str().unwrap();
    assert!(error["message"].is_string());
    assert!(
        !error.contains_key("details"),
        "details are inlined: {value}"
    );
    let code = ErrorCode::from_wire(code).unwrap_or_else(|| panic!("no code {code}"));
    let unknown_route = code == ErrorCode::UnknownRequest && status == 404;
    assert!(
        code.http_status() == status || unknown_route,
        "{code} answers {}, not {status}",
        code.http_status()
    );
}

/// A request body for the route that runs `op` (the route adds `leaseId` from its path).
fn check_body(op: &str, value: &Value) {
    let mut body: Map<String, Value> = value.as_object().unwrap().clone();
    if op == "lease-requests" {
        let decoded = LeaseRequestBody::decode(Value::Object(body), None);
        assert!(
            decoded.is_ok(),
            "the lease-request body refuses {value}: {decoded:?}"
        );
        return;
    }
    if matches!(op, "lease.renew" | "device.exec") {
        body.insert(
            "leaseId".into(),
            Value::String("lse_cc3ccb5a740945c599e7bcdcdb6aa7cc".into()),
        );
    }
    let decoded =
        decode_named(op, Some(Value::Object(body))).unwrap_or_else(|| panic!("no operation {op}"));
    assert!(decoded.is_ok(), "{op} refuses {value}: {decoded:?}");
}

#[test]
fn every_json_example_is_what_its_fence_says() {
    let doc = http_doc();
    let mut checked = BTreeSet::new();
    for (info, body) in blocks(&doc) {
        let Some(kind) = info.strip_prefix("json") else {
            continue;
        };
        let value: Value =
            serde_json::from_str(&body).unwrap_or_else(|e| panic!("not JSON: {e}\n{body}"));
        let kind = kind.trim();
        if let Some(op) = kind.strip_prefix("op=") {
            assert!(OPERATIONS.iter().any(|o| o.name == op), "no operation {op}");
            assert_eq!(output_round_trip(op, &value), value, "fields of {op}");
        } else if let Some(status) = kind.strip_prefix("error=") {
            check_error(&value, status.parse().unwrap());
        } else if let Some(op) = kind.strip_prefix("body=") {
            check_body(op, &value);
        } else if kind == "request" {
            check_request_view(&value);
        } else {
            assert_eq!(kind, "", "unknown fence json {kind}");
        }
        checked.insert(kind.split('=').next().unwrap_or_default().to_owned());
    }
    for kind in ["op", "error", "body", "request"] {
        assert!(checked.contains(kind), "no ```json {kind} example");
    }
}

/// The values the docs say count as 0 for `?wait=` do.
#[test]
fn the_wait_values_documented_as_unreadable_count_as_zero() {
    let doc = http_doc();
    let sentence = doc
        .split("a value that is not a finite\nnumber (")
        .nth(1)
        .and_then(|rest| rest.split(')').next())
        .expect("the unreadable waits are listed");
    let listed = codes(sentence);
    assert!(listed.len() >= 3, "{sentence}");
    for value in listed {
        assert_eq!(
            parse::wait(Some(value), MAX_WAIT),
            Duration::ZERO,
            "{value}"
        );
    }
    assert_eq!(
        parse::wait(Some("1.5"), MAX_WAIT),
        Duration::from_millis(1500)
    );
}
