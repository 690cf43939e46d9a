//! `docs/HTTP-API.md` and `docs/CONFIGURATION.md` cannot drift from the code.
//!
//! - HTTP: every route the host matches (`http/mod.rs`, plus `/v1/healthz` and the gateway's
//!   `/v1/uplink`) is documented, and every route the doc names exists; every JSON example parses
//!   as what its fence says (an operation's output, a lease-request view, an error with its
//!   status, a request body); the status table is the contract's error table; the lease-request
//!   body keys are the host's; every SSE event named is one the host sends.
//! - Configuration: every key is in the key table and every row is a key; each documented
//!   default is `Config::default()`'s; the example files load without warnings; the environment
//!   examples set the keys they claim; the flags are the binaries' flags.

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    reason = "test helpers fail the test by panicking"
)]

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde_json::{Map, Value};
use simlock_contract::error::ERROR_TABLE;
use simlock_contract::ids::DeviceId;
use simlock_contract::model::{LeaseEndReason, LeaseGrant, Mode};
use simlock_contract::ops::{
    CatalogGet, ConfigGet, DaemonStop, DeviceExec, EventsReplay, LeaseCancel, LeaseList,
    LeaseRelease, LeaseReleaseAll, LeaseRenew, LeaseRequest, ListGet, StatusGet, TokenCreate,
    TokenList, TokenRevoke, WorkerDrain, WorkerList, WorkerRemove, WorkerUndrain, decode_named,
};
use simlock_contract::push::UnhealthyReason;
use simlock_contract::{ErrorBody, ErrorCode, OPERATIONS, Operation, Push};
use simlock_daemon::config::{self, Config, VirtualConfig};
use simlock_daemon::http::DRAIN_GRACE;
use simlock_daemon::http::body::{KEEPALIVE, MAX_JSON_BODY};
use simlock_daemon::http::parse;
use simlock_daemon::http::requests::{MAX_WAIT, RequestState};
use simlock_daemon::uplink::{BACKOFF_CAP, BACKOFF_START, DIAL_TIMEOUT, STABLE_AFTER};

// === Reading ===

fn read(relative: &str) -> String {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join(relative);
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

fn http_doc() -> String {
    read("../../docs/HTTP-API.md")
}

fn config_doc() -> String {
    read("../../docs/CONFIGURATION.md")
}

/// Every fenced block: (info string, body).
fn blocks(doc: &str) -> Vec<(String, String)> {
    let mut out = Vec::new();
    let mut lines = doc.lines();
    while let Some(line) = lines.next() {
        if let Some(info) = line.strip_prefix("```") {
            let body: Vec<&str> = lines
                .by_ref()
                .take_while(|l| !l.starts_with("```"))
                .collect();
            out.push((info.trim().to_owned(), body.join("\n")));
        }
    }
    out
}

/// The cells of a table row, trimmed (`None` for a line that is not a row).
fn cells(line: &str) -> Option<Vec<&str>> {
    let inner = line.trim().strip_prefix('|')?.strip_suffix('|')?;
    Some(inner.split('|').map(str::trim).collect())
}

/// The rows of the table whose header line is `header`, without the separator.
fn table<'a>(doc: &'a str, header: &str) -> Vec<Vec<&'a str>> {
    let mut lines = doc.lines().skip_while(|l| l.trim() != header);
    assert!(lines.next().is_some(), "no table headed {header:?}");
    lines.skip(1).map_while(cells).collect()
}

/// The first `` `literal` `` in `text`.
fn first_code(text: &str) -> Option<&str> {
    let start = text.find('`')? + 1;
    let len = text[start..].find('`')?;
    Some(&text[start..start + len])
}

/// Every `` `literal` `` in `text`.
fn codes(text: &str) -> Vec<&str> {
    text.split('`').skip(1).step_by(2).collect()
}

/// The value at a dotted key.
fn at<'a>(value: &'a Value, key: &str) -> Option<&'a Value> {
    key.split('.').try_fold(value, |v, part| v.get(part))
}

// === Configuration ===

/// The leaf keys of a configuration value (empty tables and arrays are leaves).
fn leaf_keys(value: &Value, prefix: &str, out: &mut BTreeSet<String>) {
    match value {
        Value::Object(map) if !map.is_empty() => {
            for (key, child) in map {
                let path = if prefix.is_empty() {
                    key.clone()
                } else {
                    format!("{prefix}.{key}")
                };
                leaf_keys(child, &path, out);
            }
        }
        _ => {
            out.insert(prefix.to_owned());
        }
    }
}

fn defaults() -> Value {
    serde_json::to_value(Config::default()).unwrap()
}

/// Every key: the defaults' leaves and the optional keys the defaults may leave out.
fn known_keys() -> BTreeSet<String> {
    let mut keys = BTreeSet::new();
    leaf_keys(&defaults(), "", &mut keys);
    for key in [
        "http.enabled",
        "gateway.url",
        "gateway.token",
        "gateway.label",
        "capacity.ios.maxRunning",
        "capacity.android.maxRunning",
    ] {
        keys.insert(key.to_owned());
    }
    keys
}

const KEY_TABLE: &str = "| key | default | type | read by | meaning |";

/// The key table: (key, default cell).
fn key_rows(doc: &str) -> Vec<(String, String)> {
    table(doc, KEY_TABLE)
        .into_iter()
        .map(|row| {
            assert_eq!(row.len(), 5, "a key row has five cells: {row:?}");
            let key = row[0]
                .strip_prefix('`')
                .and_then(|k| k.strip_suffix('`'))
                .unwrap_or_else(|| panic!("the key cell is one `key`: {row:?}"));
            (key.to_owned(), row[1].to_owned())
        })
        .collect()
}

#[test]
fn every_configuration_key_has_a_row_and_every_row_is_a_key() {
    let doc = config_doc();
    let rows = key_rows(&doc);
    let documented: BTreeSet<String> = rows.iter().map(|(k, _)| k.clone()).collect();
    assert_eq!(documented.len(), rows.len(), "a key is listed twice");
    let known = known_keys();
    let missing: Vec<_> = known.difference(&documented).collect();
    assert!(
        missing.is_empty(),
        "keys missing from the table: {missing:?}"
    );
    let unknown: Vec<_> = documented.difference(&known).collect();
    assert!(unknown.is_empty(), "rows that are not keys: {unknown:?}");
}

#[test]
fn documented_defaults_are_the_real_defaults() {
    let doc = config_doc();
    let defaults = defaults();
    for (key, cell) in key_rows(&doc) {
        let real = at(&defaults, &key).cloned().unwrap_or(Value::Null);
        if let Some(literal) = first_code(&cell) {
            let documented: Value = serde_json::from_str(literal)
                .unwrap_or_else(|e| panic!("{key}: default `{literal}` is not a value: {e}"));
            assert_eq!(documented, real, "{key}: the documented default is wrong");
        } else if key == "virtual.models" {
            assert!(cell.contains("five models"), "{key}: {cell}");
            assert_eq!(VirtualConfig::default().models.len(), 5);
        } else {
            assert!(
                real.is_null() && cell.starts_with("unset"),
                "{key}: the default cell {cell:?} names no value, but the default is {real}"
            );
        }
    }
}

#[test]
fn the_default_catalog_table_is_the_default_models() {
    let doc = config_doc();
    let rows = table(&doc, "| platform | name | aliases | runtimes |");
    let split = |cell: &str| -> Vec<String> {
        cell.split(',')
            .map(str::trim)
            .filter(|s| !s.is_empty())
            .map(String::from)
            .collect()
    };
    let documented: Vec<(String, String, Vec<String>, Vec<String>)> = rows
        .iter()
        .map(|row| {
            (
                row[0].to_owned(),
                row[1].to_owned(),
                split(row[2]),
                split(row[3]),
            )
        })
        .collect();
    let real: Vec<(String, String, Vec<String>, Vec<String>)> = VirtualConfig::default()
        .models
        .into_iter()
        .map(|m| {
            (
                m.platform.as_str().to_owned(),
                m.name,
                m.aliases,
                m.runtimes,
            )
        })
        .collect();
    assert_eq!(documented, real);
}

/// A fresh, empty home directory.
fn scratch_home(n: usize) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("simlock-docs-{}-{n}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

#[test]
fn the_example_files_load_without_warnings() {
    let doc = config_doc();
    let mut seen = 0;
    for (n, (info, body)) in blocks(&doc).into_iter().enumerate() {
        let Some(mode) = info.strip_prefix("toml mode=") else {
            continue;
        };
        let mode = match mode {
            "worker" => Mode::Worker,
            "gateway" => Mode::Gateway,
            other => panic!("unknown mode {other:?}"),
        };
        let home = scratch_home(n);
        std::fs::write(home.join("config.toml"), &body).unwrap();
        let loaded = config::load(&home, mode, &[], &config::Sections::new());
        let _ = std::fs::remove_dir_all(&home);
        let loaded = loaded.unwrap_or_else(|e| panic!("{e}\n{body}"));
        assert!(loaded.warnings.is_empty(), "{:?}\n{body}", loaded.warnings);
        seen += 1;
    }
    assert!(seen >= 2, "a worker and a gateway example");
}

/// `SIMLOCK_` variables that are not configuration keys.
const NOT_CONFIG: &[&str] = &[
    "SIMLOCK_HOME",
    "SIMLOCK_LOG",
    "SIMLOCK_JOIN_TOKEN",
    "SIMLOCK_URL",
    "SIMLOCK_TOKEN",
    "SIMLOCK_CA_FILE",
    "SIMLOCK_AGENT_ID",
    // The environment of a leased device.
    "SIMLOCK_LEASE_ID",
    "SIMLOCK_DEVICE_ID",
    "SIMLOCK_DEVICE_UDID",
    "SIMLOCK_PLATFORM",
    "SIMLOCK_IOS_DEVICE_SET",
    "SIMLOCK_ADB_SERVER_PORT",
    "SIMLOCK_ANDROID_SERIAL",
];

/// `SIMLOCK_CAPACITY__IOS__MAX_RUNNING` → `capacity.ios.maxRunning`, by the documented rule.
fn key_of_variable(name: &str) -> String {
    let rest = name.strip_prefix("SIMLOCK_").unwrap();
    rest.split("__")
        .map(|part| {
            let mut out = String::new();
            let mut upper = false;
            for c in part.chars() {
                if c == '_' {
                    upper = true;
                } else if upper {
                    out.extend(c.to_uppercase());
                    upper = false;
                } else {
                    out.extend(c.to_lowercase());
                }
            }
            out
        })
        .collect::<Vec<_>>()
        .join(".")
}

/// Every `SIMLOCK_…` name in `doc`.
fn variables(doc: &str) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    for (at, _) in doc.match_indices("SIMLOCK_") {
        let name: String = doc[at..]
            .chars()
            .take_while(|c| c.is_ascii_uppercase() || c.is_ascii_digit() || *c == '_')
            .collect();
        if name.len() > "SIMLOCK_".len() {
            out.insert(name);
        }
    }
    out
}

#[test]
fn every_configuration_variable_names_a_key() {
    let doc = config_doc();
    let known = known_keys();
    for name in variables(&doc) {
        if NOT_CONFIG.contains(&name.as_str()) {
            continue;
        }
        let key = key_of_variable(&name);
        assert!(known.contains(&key), "{name} names no key ({key})");
    }
    for row in table(&doc, "| variable | key |") {
        let (name, key) = (first_code(row[0]).unwrap(), first_code(row[1]).unwrap());
        assert_eq!(key_of_variable(name), key, "{row:?}");
    }
}

#[test]
#[allow(
    clippy::result_large_err,
    reason = "figment's Jail takes a closure returning figment's own Result"
)]
fn the_environment_examples_set_their_keys() {
    let doc = config_doc();
    let home = std::env::temp_dir().join(format!("simlock-docs-no-home-{}", std::process::id()));
    assert!(!home.exists());
    let mut seen = 0;
    for (info, body) in blocks(&doc) {
        if info != "sh" {
            continue;
        }
        for line in body.lines() {
            let Some((name, value)) = line.split_once('=') else {
                continue;
            };
            if !name.starts_with("SIMLOCK_") || NOT_CONFIG.contains(&name) {
                continue;
            }
            let value = value
                .strip_prefix('\'')
                .and_then(|v| v.strip_suffix('\''))
                .unwrap_or(value);
            let mut loaded = None;
            figment::Jail::expect_with(|jail| {
                jail.set_env(name, value);
                loaded = Some(config::load(
                    &home,
                    Mode::Worker,
                    &[],
                    &config::Sections::new(),
                ));
                Ok(())
            });
            let loaded = loaded.unwrap().unwrap_or_else(|e| panic!("{line}: {e}"));
            let key = key_of_variable(name);
            let expected = config::coerce(&key, value, &config::Sections::new());
            let config = serde_json::to_value(&loaded.config).unwrap();
            assert_eq!(at(&config, &key), Some(&expected), "{line} sets {key}");
            seen += 1;
        }
    }
    assert!(seen >= 10, "the environment examples were not found");
}

/// The long flags a binary's `Args` declares.
fn declared_flags(main_rs: &str) -> BTreeSet<String> {
    let mut flags = BTreeSet::new();
    let mut pending = false;
    for line in main_rs.lines().map(str::trim) {
        if let Some(attr) = line.strip_prefix("#[arg(") {
            if let Some(named) = attr.split("long = \"").nth(1) {
                flags.insert(format!("--{}", named.split('"').next().unwrap()));
            } else if attr.starts_with("long") {
                pending = true;
            }
        } else if pending && let Some((field, _)) = line.split_once(':') {
            flags.insert(format!("--{}", field.trim().replace('_', "-")));
            pending = false;
        }
    }
    flags
}

/// The flags the doc's table for `binary` lists.
fn documented_flags(doc: &str, binary: &str) -> BTreeSet<String> {
    let section: String = doc
        .lines()
        .skip_while(|l| *l != format!("### {binary}"))
        .skip(1)
        .take_while(|l| !l.starts_with('#'))
        .collect::<Vec<_>>()
        .join("\n");
    table(&section, "| flag | same as | meaning |")
        .iter()
        .map(|row| {
            first_code(row[0])
                .and_then(|c| c.split_whitespace().next())
                .unwrap()
                .to_owned()
        })
        .collect()
}

#[test]
fn the_flags_are_the_binaries_flags() {
    let doc = config_doc();
    for binary in ["simlock-worker", "simlock-gateway"] {
        let declared = declared_flags(&read(&format!("../../bins/{binary}/src/main.rs")));
        assert!(declared.contains("--home") && declared.contains("--set"));
        assert_eq!(documented_flags(&doc, binary), declared, "{binary}");
    }
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
        read("../simlock-fleet/src/uplink.rs").contains(r#"path == "/v1/uplink""#),
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
fn request_keys() -> Vec<(String, String)> {
    let source = read("src/http/mod.rs");
    let block = source
        .split("const REQUEST_KEYS")
        .nth(1)
        .unwrap()
        .split("];")
        .next()
        .unwrap();
    block
        .lines()
        .filter_map(|l| l.trim().strip_prefix("(\""))
        .map(|l| {
            let parts: Vec<&str> = l.split('"').collect();
            (parts[0].to_owned(), parts[2].to_owned())
        })
        .collect()
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
        let body: ErrorBody = serde_json::from_value(error.clone()).unwrap();
        assert_eq!(&serde_json::to_value(body).unwrap(), error);
    }
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
    let op = if op == "lease-requests" {
        let keys = request_keys();
        let mut payload = Map::new();
        for (key, v) in body {
            let (_, field) = keys
                .iter()
                .find(|(k, _)| *k == key)
                .unwrap_or_else(|| panic!("{key} is not a lease-request key"));
            payload.insert(field.clone(), v);
        }
        body = payload;
        "lease.request"
    } else {
        if matches!(op, "lease.renew" | "device.exec") {
            body.insert(
                "leaseId".into(),
                Value::String("lse_cc3ccb5a740945c599e7bcdcdb6aa7cc".into()),
            );
        }
        op
    };
    let decoded =
        decode_named(op, Some(Value::Object(body))).unwrap_or_else(|| panic!("no operation {op}"));
    assert!(decoded.is_ok(), "{op} refuses {value}: {decoded:?}");
}

#[test]
fn the_configuration_json_examples_parse() {
    for (info, body) in blocks(&config_doc()) {
        if info.starts_with("json") {
            let parsed: Result<Value, _> = serde_json::from_str(&body);
            assert!(parsed.is_ok(), "not JSON: {body}");
        }
    }
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

/// The `config.get` example: a gateway's answer, exactly as the code builds it from the defaults
/// and the one setting the example says it was started with.
#[test]
fn the_gateways_config_example_is_what_a_gateway_answers() {
    let doc = http_doc();
    let (_, example) = blocks(&doc)
        .into_iter()
        .find(|(info, _)| info == "json op=config.get")
        .expect("a config.get example");
    assert!(
        doc.contains("started with\n`--set lease.maxTtlMs=7200000`"),
        "the example names how its gateway was started"
    );
    let mut config = Config::default();
    config.lease.max_ttl_ms = 7_200_000;
    let real = serde_json::to_value(config::view(
        &config,
        &config::Sections::new(),
        &[],
        Mode::Gateway,
    ))
    .unwrap();
    let documented: Value = serde_json::from_str(&example).unwrap();
    assert_eq!(documented, real, "the example is not a gateway's answer");
    // The sections the prose lists are the example's.
    let sections: Vec<&str> = real["settings"]
        .as_object()
        .unwrap()
        .keys()
        .map(String::as_str)
        .collect();
    let prose = doc
        .split("A gateway answers the sections it reads, ")
        .nth(1)
        .and_then(|rest| rest.split("\nwith").next())
        .expect("the gateway's sections are listed");
    let mut listed = codes(prose);
    listed.sort_unstable();
    assert_eq!(listed, sections);
    // A set join token is redacted with the marker the docs name.
    let mut config = Config::default();
    config.gateway.token = Some("slk_secret".into());
    for mode in [Mode::Worker, Mode::Gateway] {
        let view = serde_json::to_value(config::view(&config, &config::Sections::new(), &[], mode))
            .unwrap();
        let marker = view["settings"]["gateway"]["token"]
            .as_str()
            .unwrap()
            .to_owned();
        assert!(
            doc.contains(&format!("`\"{marker}\"`")),
            "{marker} is not named"
        );
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
