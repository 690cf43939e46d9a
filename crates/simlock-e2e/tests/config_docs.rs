//! `docs/CONFIGURATION.md` (and `docs/HTTP-API.md`'s `config.get` example) cannot drift from
//! the configuration the binaries register, nor the registered sections from each other: both
//! binaries register the same keys, in sections that do not overlap; every key of those sections
//! is in one row of the owner table, which names the crate and file of its section, and in the
//! key table, and every row is a key; each documented default is the registered
//! sections' default; the example files load without warnings; the environment examples set the
//! keys they claim; the flags are the binaries' flags; the gateway's `config.get` example is
//! what a gateway answers.

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    reason = "test helpers fail the test by panicking"
)]

use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;

use serde_json::Value;
use simlock_contract::model::Mode;
use simlock_core::config::VirtualConfig;
use simlock_daemon::config::{self, Sections};
use simlock_gateway::GatewayConfig;
use simlock_test_support::markdown::{blocks, codes, doc, first_code, table, workspace_file};
use simlock_worker::WorkerConfig;

/// The sections a daemon of `mode` registers.
fn sections(mode: Mode) -> &'static Sections {
    match mode {
        Mode::Worker => simlock_worker::sections(),
        Mode::Gateway => simlock_gateway::sections(),
    }
}

#[test]
fn both_binaries_register_the_same_keys() {
    let worker = sections(Mode::Worker).keys();
    assert!(worker.len() > 50, "{worker:?}");
    assert_eq!(worker, sections(Mode::Gateway).keys());
}

/// Sections sharing a table (the daemon's uplink keys and the fleet's under `gateway`) hold
/// disjoint keys, and every key a section lists (`ONLY`, `TEXT_KEYS`, `OPEN_MAPS`, and the
/// daemon's own lists) is one of its keys.
#[test]
fn both_binaries_register_disjoint_sections_that_list_only_their_own_keys() {
    for mode in [Mode::Worker, Mode::Gateway] {
        assert_eq!(
            sections(mode).layout_problems(),
            Vec::<String>::new(),
            "{mode:?}"
        );
    }
}

// === Reading ===

fn http_doc() -> String {
    doc("HTTP-API.md")
}

fn config_doc() -> String {
    doc("CONFIGURATION.md")
}

/// The value at a dotted key.
fn at<'a>(value: &'a Value, key: &str) -> Option<&'a Value> {
    key.split('.').try_fold(value, |v, part| v.get(part))
}

// === Configuration ===

fn defaults() -> Value {
    sections(Mode::Worker).default_values()
}

/// Every key, as the loader knows them: the registered sections' (both binaries register the
/// same, `both_binaries_register_the_same_keys`).
fn known_keys() -> BTreeSet<String> {
    sections(Mode::Worker).keys().into_iter().collect()
}

const OWNER_TABLE: &str = "| section | owner |";

/// The crate a section's type is defined in: `simlock_core::config::IdleConfig` is in
/// `simlock-core`.
fn crate_of(type_name: &str) -> String {
    type_name
        .split("::")
        .next()
        .unwrap_or(type_name)
        .replace('_', "-")
}

#[test]
fn the_owner_table_names_the_crate_and_file_of_every_keys_section() {
    let doc = config_doc();
    let sections = sections(Mode::Worker);
    let known = known_keys();
    let rows = table(&doc, OWNER_TABLE);
    assert!(rows.len() >= 5, "{rows:?}");
    // Each key, with the row entry (`lease`, `gateway.url`) that lists it.
    let mut listed: BTreeMap<String, String> = BTreeMap::new();
    for row in rows {
        assert_eq!(row.len(), 2, "an owner row has two cells: {row:?}");
        let owner = codes(row[1]);
        let Some((krate, named)) = owner.split_first() else {
            panic!("the owner cell names the crate first: {row:?}");
        };
        // The types of the sections holding this row's keys.
        let mut types = BTreeSet::new();
        let entries = codes(row[0]);
        assert!(!entries.is_empty(), "{row:?}");
        for entry in entries {
            let keys: Vec<&String> = known
                .iter()
                .filter(|k| *k == entry || k.starts_with(&format!("{entry}.")))
                .collect();
            assert!(!keys.is_empty(), "{entry} is no key and no table of keys");
            for key in keys {
                let section = sections.owner_of(key).unwrap();
                assert_eq!(&crate_of(section), krate, "{key} is held by {section}");
                types.insert(section.rsplit("::").next().unwrap_or(section));
                if let Some(before) = listed.insert(key.clone(), entry.to_owned()) {
                    panic!("{key} is listed as both {before} and {entry}");
                }
            }
        }
        // The file a row names defines its sections; a type it names is one of them.
        let mut files = 0;
        for name in named {
            if name.ends_with(".rs") {
                let source = workspace_file(&format!("crates/{krate}/src/{name}"));
                for ty in &types {
                    assert!(
                        source.contains(&format!("pub struct {ty} ")),
                        "{krate}/src/{name} does not define {ty}"
                    );
                }
                files += 1;
            } else {
                assert!(
                    types.contains(name),
                    "{name} is not a section of {row:?}: {types:?}"
                );
            }
        }
        assert_eq!(files, 1, "a row names the file of its sections: {row:?}");
    }
    let missing: Vec<&String> = known.iter().filter(|k| !listed.contains_key(*k)).collect();
    assert!(
        missing.is_empty(),
        "keys in no row of the owner table: {missing:?}"
    );
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
fn the_read_by_column_is_the_daemons_that_read_each_key() {
    let doc = config_doc();
    let sections = sections(Mode::Worker);
    let rows = table(&doc, KEY_TABLE);
    assert!(!rows.is_empty());
    for row in rows {
        let key = first_code(row[0]).unwrap();
        let expected = match sections.modes_of(key).unwrap_or_default().as_slice() {
            [Mode::Worker, Mode::Gateway] => "both",
            [Mode::Worker] => "worker",
            [Mode::Gateway] => "gateway",
            other => panic!("{key} is read by {other:?}"),
        };
        assert_eq!(row[3], expected, "{key}: read by");
    }
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

/// The keys an entry of `virtual.models` or `exec.tools` may have are documented in the table
/// under its heading, each once, and none else: the loader warns about any other.
#[test]
fn the_entry_tables_are_the_keys_an_entry_has() {
    let doc = config_doc();
    for (heading, key) in [
        ("### Exec tools", "exec.tools"),
        ("### The virtual catalog", "virtual.models"),
    ] {
        let from = doc.find(heading).unwrap_or_else(|| panic!("no {heading}"));
        let documented: Vec<&str> = table(&doc[from..], "| key | type | meaning |")
            .iter()
            .map(|row| first_code(row[0]).unwrap_or_else(|| panic!("{key}: {row:?}")))
            .collect();
        let mut sorted = documented.clone();
        sorted.sort_unstable();
        sorted.dedup();
        assert_eq!(sorted.len(), documented.len(), "{key}: a key twice");
        let real = sections(Mode::Worker)
            .entry_keys(key)
            .unwrap_or_else(|| panic!("{key} has no entry shape"));
        assert_eq!(sorted, real, "{key}: the entry table under {heading}");
    }
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
        let loaded = config::load(&home, mode, &[], sections(mode));
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

/// The key `name` (a `SIMLOCK_*` variable) names, by the daemon's rule.
fn key_of_variable(name: &str) -> String {
    config::key_of_variable(name).unwrap_or_else(|| panic!("{name} is no SIMLOCK_ variable"))
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
                    sections(Mode::Worker),
                ));
                Ok(())
            });
            let loaded = loaded.unwrap().unwrap_or_else(|e| panic!("{line}: {e}"));
            let key = key_of_variable(name);
            let expected = config::coerce(&key, value, sections(Mode::Worker));
            let config = loaded.value();
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
        let declared = declared_flags(&workspace_file(&format!("bins/{binary}/src/main.rs")));
        assert!(declared.contains("--home") && declared.contains("--set"));
        assert_eq!(documented_flags(&doc, binary), declared, "{binary}");
    }
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
    let mut config = GatewayConfig::default();
    config.daemon.lease.max_ttl_ms = 7_200_000;
    let real = serde_json::to_value(config.view()).unwrap();
    let documented: Value = serde_json::from_str(&example).unwrap();
    assert_eq!(documented, real, "the example is not a gateway's answer");
    // The sections the prose lists are the example's.
    let tables: Vec<&str> = real["settings"]
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
    assert_eq!(listed, tables);
    // A set join token is redacted with the marker the docs name.
    let mut worker = WorkerConfig::default();
    worker.daemon.gateway.token = Some("slk_secret".into());
    let mut gateway = GatewayConfig::default();
    gateway.daemon.gateway.token = Some("slk_secret".into());
    for view in [worker.view(), gateway.view()] {
        let view = serde_json::to_value(view).unwrap();
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
