//! Configuration: built-in defaults ← `$SIMLOCK_HOME/config.toml` ← `SIMLOCK_*` environment ←
//! command-line flags. Keys keep the original's names (`lease.maxTtlMs`, `gateway.url`, …).
//! Unknown keys are warned about; a bad value fails start-up naming the key.
//!
//! The daemon owns the loader, the layering, the one list of known keys and its own section
//! ([`DaemonConfig`]); every other section is a [`Section`] of the crate that reads it, which the
//! binaries register ([`Sections`], ADR 0026).
//!
//! An environment variable names a key in upper snake case with `__` between sections:
//! `SIMLOCK_LEASE__MAX_TTL_MS=60000` sets `lease.maxTtlMs`. Figment's own [`Env`] provider reads
//! them; a text key's value is taken as it is.

mod section;

use std::any::TypeId;
use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

use figment::Figment;
use figment::providers::{Env, Format, Serialized, Toml};
use serde::{Deserialize, Serialize};
use serde_json::Value;
use simlock_contract::model::Mode;

pub use section::{
    BOTH, EntryShape, GATEWAY, Section, SectionError, SectionValue, Sections, WORKER, above_zero,
    section_value,
};
use section::{Entry, Held, merge_into};

/// The prefix of every configuration variable.
const ENV_PREFIX: &str = "SIMLOCK_";

/// Environment variables that are not config keys.
const NOT_CONFIG_ENV: &[&str] = &[
    "SIMLOCK_HOME",
    "SIMLOCK_AGENT_ID",
    "SIMLOCK_URL",
    "SIMLOCK_TOKEN",
    "SIMLOCK_CA_FILE",
    "SIMLOCK_LOG",
];

/// The daemon's own section: the keys the daemon runtime reads itself (its listener, logging,
/// event buffer, lease limits and request book, a worker's capabilities and uplink). Every other
/// section is a [`Section`] of the crate that reads it.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", default)]
pub struct DaemonConfig {
    /// Lease limits.
    pub lease: LeaseConfig,
    /// The HTTP listener.
    pub http: HttpConfig,
    /// The uplink (worker: where to dial).
    pub gateway: GatewayUplinkConfig,
    /// The event ring buffer.
    pub event_buffer: EventBufferConfig,
    /// Logging.
    pub log: LogConfig,
    /// Capabilities this worker offers, besides those its modules report (worker).
    pub capabilities: Vec<String>,
}

/// `lease.*`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", default)]
pub struct LeaseConfig {
    /// The width of a lease whose request names none: 15 min.
    pub default_ttl_ms: u64,
    /// The most a request or renewal may ask: 4 h.
    pub max_ttl_ms: u64,
    /// How long a settled request is remembered (idempotency, HTTP polls): 10 min.
    pub request_retention_ms: u64,
    /// At most this many request records are kept.
    pub max_request_records: u32,
    /// At most this many lease requests wait in the queue; one more is refused `NO_CAPACITY`
    /// (the queue is full) instead of queued: 1000.
    pub max_waiting: u32,
}

impl Default for LeaseConfig {
    fn default() -> Self {
        Self {
            default_ttl_ms: 900_000,
            max_ttl_ms: 14_400_000,
            request_retention_ms: 600_000,
            max_request_records: 10_000,
            max_waiting: 1_000,
        }
    }
}

/// `http.*`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", default)]
pub struct HttpConfig {
    /// Serve `/v1` over HTTP. Default: off on a worker, always on a gateway.
    pub enabled: Option<bool>,
    /// The address to listen on.
    pub host: String,
    /// The port (0 picks a free one).
    pub port: u16,
    /// HTTPS (and WSS for uplinks) instead of plain HTTP.
    pub tls: HttpTlsConfig,
}

impl HttpConfig {
    /// Whether `enabled` turns HTTP on: unset is off (a worker's default; a gateway is composed
    /// to serve HTTP whatever it says, and refuses `false`).
    pub fn turned_on(&self) -> bool {
        self.enabled.unwrap_or(false)
    }
}

impl Default for HttpConfig {
    fn default() -> Self {
        Self {
            enabled: None,
            host: "127.0.0.1".into(),
            port: 4700,
            tls: HttpTlsConfig::default(),
        }
    }
}

/// `http.tls.*`: with both files set, the listener speaks TLS only (HTTPS, and WSS for uplinks).
/// Each new connection reads the files again, so a replaced pair is served without a restart.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", default)]
pub struct HttpTlsConfig {
    /// The certificate chain, PEM, leaf first (relative paths from the home directory).
    pub cert_file: Option<String>,
    /// The certificate's private key, PEM (PKCS#8, PKCS#1 or SEC1).
    pub key_file: Option<String>,
}

/// `gateway.*` as a worker reads them: where its uplink dials. (The gateway's own `gateway.*`
/// keys are the fleet's section, `simlock_fleet::FleetConfig`.)
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", default)]
pub struct GatewayUplinkConfig {
    /// The gateway's base URL, `ws://host:port` or `wss://host:port` (TLS, ADR 0024).
    pub url: Option<String>,
    /// The join token (a gateway token of role `worker`).
    pub token: Option<String>,
    /// A label for people.
    pub label: Option<String>,
    /// CA certificates (PEM) trusted for a `wss://` gateway besides the platform's roots.
    pub ca_file: Option<String>,
}

/// `eventBuffer.*`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", default)]
pub struct EventBufferConfig {
    /// Events kept for replay (1000).
    pub capacity: u32,
}

impl Default for EventBufferConfig {
    fn default() -> Self {
        Self { capacity: 1000 }
    }
}

/// `log.*`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", default)]
pub struct LogConfig {
    /// A tracing filter (`info`, `simlock=debug`, …).
    pub level: String,
}

impl Default for LogConfig {
    fn default() -> Self {
        Self {
            level: "info".into(),
        }
    }
}

/// Why configuration could not be loaded; start-up fails with it.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// A value could not be read; the message names the key.
    #[error("configuration: {0}")]
    Invalid(String),
    /// The file could not be read.
    #[error("configuration file {path}: {source}")]
    File {
        /// The file.
        path: String,
        /// Why.
        source: std::io::Error,
    },
}

/// A loaded configuration and what was noticed while loading it.
#[derive(Clone)]
pub struct Loaded {
    /// The daemon's own section.
    pub config: DaemonConfig,
    /// Unknown keys, and keys this daemon mode ignores.
    pub warnings: Vec<String>,
    /// Every registered section, as loaded.
    sections: Vec<(Entry, Held)>,
}

impl std::fmt::Debug for Loaded {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Loaded")
            .field("config", &self.config)
            .field("warnings", &self.warnings)
            .finish_non_exhaustive()
    }
}

impl Loaded {
    /// The whole configuration as loaded: the daemon's own section and every registered one,
    /// by table (the join token in clear: not for views).
    pub fn value(&self) -> Value {
        let mut all = match serde_json::to_value(&self.config) {
            Ok(Value::Object(map)) => map,
            _ => serde_json::Map::new(),
        };
        for (entry, held) in &self.sections {
            merge_into(&mut all, entry.key, (entry.value)(held));
        }
        Value::Object(all)
    }

    /// The registered section `S`, as loaded (and checked, when this daemon reads it).
    ///
    /// # Errors
    /// `S` was not registered with the [`Sections`] the configuration was loaded with.
    pub fn section<S: Section>(&self) -> Result<S, ConfigError> {
        self.sections
            .iter()
            .find(|(entry, _)| entry.type_id == TypeId::of::<S>())
            .and_then(|(_, held)| held.downcast_ref::<S>())
            .cloned()
            .ok_or_else(|| {
                ConfigError::Invalid(format!(
                    "the section {} ({}) is not registered",
                    S::KEY,
                    std::any::type_name::<S>()
                ))
            })
    }
}

/// The tables of the daemon's own section a gateway reads (less [`WORKER_ONLY_KEYS`]); its
/// other keys are a worker's.
const GATEWAY_SECTIONS: &[&str] = &["lease", "http", "gateway", "eventBuffer", "log"];
/// Keys of the daemon's own section only a worker reads.
const WORKER_ONLY_KEYS: &[&str] = &[
    "gateway.url",
    "gateway.token",
    "gateway.label",
    "gateway.caFile",
];

/// Loads the configuration of a daemon of `mode` from `home`, the process's `SIMLOCK_*`
/// environment (through figment's [`Env`]) and the flags `overrides` (dotted keys, e.g. `http.port`),
/// with the `sections` its binary registers.
///
/// # Errors
/// A file that cannot be read or parsed, a value of the wrong type (naming the key), or a
/// combination that cannot work (naming the keys).
pub fn load(
    home: &Path,
    mode: Mode,
    overrides: &[(String, Value)],
    sections: &Sections,
) -> Result<Loaded, ConfigError> {
    let path = home.join("config.toml");
    let text = match std::fs::read_to_string(&path) {
        Ok(text) => Some(text),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => None,
        Err(source) => {
            return Err(ConfigError::File {
                path: path.display().to_string(),
                source,
            });
        }
    };
    let file = text
        .as_deref()
        .map(|text| (path.display().to_string(), text));
    load_layers(file, environment_layer(sections), overrides, mode, sections)
}

/// As [`load`], from the file text `toml` alone (no environment, no flags): for the tests of a
/// crate's section.
///
/// # Errors
/// As [`load`].
pub fn load_text(toml: &str, mode: Mode, sections: &Sections) -> Result<Loaded, ConfigError> {
    load_layers(
        Some(("config.toml".to_owned(), toml)),
        Figment::new(),
        &[],
        mode,
        sections,
    )
}

fn load_layers(
    file: Option<(String, &str)>,
    environment: Figment,
    overrides: &[(String, Value)],
    mode: Mode,
    sections: &Sections,
) -> Result<Loaded, ConfigError> {
    let keys = sections.key_table();
    let mut figment = Figment::from(Serialized::defaults(DaemonConfig::default()));
    for (table, value) in &keys.defaults {
        figment = figment.merge(Serialized::default(table, value));
    }
    let mut provided: Vec<Value> = Vec::new();
    if let Some((path, text)) = file {
        let table: Value = Figment::from(Toml::string(text))
            .extract()
            .map_err(|e| ConfigError::Invalid(format!("{path}: {}", describe(&e))))?;
        provided.push(table);
        figment = figment.merge(Toml::string(text));
    }
    let flags = overrides
        .iter()
        .fold(Figment::new(), |layer, (key, value)| {
            layer.merge(Serialized::default(key, value))
        });
    for layer in [environment, flags] {
        let table: Value = layer
            .extract()
            .map_err(|e| ConfigError::Invalid(describe(&e)))?;
        if table.as_object().is_some_and(|o| !o.is_empty()) {
            figment = figment.merge(layer);
            provided.push(table);
        }
    }
    let config: DaemonConfig = figment
        .extract()
        .map_err(|e| ConfigError::Invalid(describe(&e)))?;
    let mut held = Vec::new();
    for entry in &sections.entries {
        let section = (entry.extract)(&figment)
            .map_err(|e| ConfigError::Invalid(describe_at(entry.key, &e)))?;
        held.push((entry, section));
    }

    let mut warnings = Vec::new();
    let mut seen = BTreeSet::new();
    for table in &provided {
        let mut found = Vec::new();
        leaf_keys(table, "", &keys.open_maps, &mut found);
        for key in found {
            // Inside a list of tables or a map of tables, each entry's keys against its shape.
            let in_entries = keys.unknown_entry_keys(&key, table);
            if seen.insert(key.clone()) {
                match keys.modes(&key) {
                    None => warnings.push(format!("unknown configuration key {key} is ignored")),
                    Some(modes) if !modes.contains(&mode) => warnings.push(match mode {
                        Mode::Gateway => {
                            format!("{key} is a worker setting; a gateway ignores it")
                        }
                        Mode::Worker => {
                            format!("{key} is a gateway setting; a worker ignores it")
                        }
                    }),
                    Some(_) => {}
                }
            }
            for key in in_entries {
                if seen.insert(key.clone()) {
                    warnings.push(format!("unknown configuration key {key} is ignored"));
                }
            }
        }
    }
    validate(&config, mode)?;
    for (entry, section) in &held {
        if entry.modes.contains(&mode) {
            (entry.check)(section, &config, mode).map_err(|e| ConfigError::Invalid(e.message))?;
            warnings.extend((entry.warnings)(section, &config, mode));
        }
    }
    if mode == Mode::Worker
        && config.gateway.ca_file.is_some()
        && config
            .gateway
            .url
            .as_deref()
            .is_some_and(|url| url.starts_with("ws://"))
    {
        warnings.push(
            "gateway.caFile is set but gateway.url is ws:// (no TLS): the CA file is not used"
                .into(),
        );
    }
    Ok(Loaded {
        config,
        warnings,
        sections: held
            .into_iter()
            .map(|(entry, section)| (*entry, section))
            .collect(),
    })
}

/// Which daemons read a key the daemon's own section holds.
fn daemon_modes(key: &str) -> &'static [Mode] {
    if WORKER_ONLY_KEYS.contains(&key)
        || !GATEWAY_SECTIONS
            .iter()
            .any(|s| key == *s || key.starts_with(&format!("{s}.")))
    {
        WORKER
    } else {
        BOTH
    }
}

/// The one list of known keys: the daemon's own and those of every registered section, with
/// the daemons that read each, which of them hold text, and the registered sections' defaults.
/// A [`Sections`] builds it once, at its first use, and keeps it.
#[derive(Debug, Clone)]
struct Keys {
    known: BTreeMap<String, Known>,
    open_maps: Vec<String>,
    /// The keys whose entries have one shape ([`Section::entry_shapes`]), with that shape.
    shapes: BTreeMap<String, Shape>,
    /// The top-level keys; an environment variable names one of them first.
    tables: BTreeSet<String>,
    /// The keys whose values are text ([`text_keys`]).
    text: BTreeSet<String>,
    /// Every registered section's defaults, merged by table.
    defaults: serde_json::Map<String, Value>,
}

/// What the key tables know of one key.
#[derive(Debug, Clone)]
struct Known {
    /// The daemons that read it.
    modes: Vec<Mode>,
    /// The section that holds it, as [`std::any::type_name`] names its type.
    owner: &'static str,
}

/// The entries of a key of [`Keys::shapes`].
#[derive(Debug, Clone)]
struct Shape {
    /// Whether they are a list's (`virtual.models`) or a map's (`exec.tools`, an open map).
    map: bool,
    /// The keys an entry may have, below the entry (`aliases`, or `sub.key` in a table).
    keys: BTreeSet<String>,
}

#[cfg(test)]
thread_local! {
    /// How many key tables [`Keys::of`] built on this thread: the tests count them.
    static KEY_TABLES_BUILT: std::cell::Cell<usize> = const { std::cell::Cell::new(0) };
}

impl Keys {
    fn of(entries: &[Entry]) -> Self {
        #[cfg(test)]
        KEY_TABLES_BUILT.with(|built| built.set(built.get() + 1));
        let mut open_maps: Vec<String> = Vec::new();
        for entry in entries {
            open_maps.extend(entry.open_maps.iter().map(|m| format!("{}.{m}", entry.key)));
        }
        let daemon = serde_json::to_value(DaemonConfig::default()).unwrap_or(Value::Null);
        let mut known = BTreeMap::new();
        let mut leaves = Vec::new();
        leaf_keys(&daemon, "", &open_maps, &mut leaves);
        for key in leaves {
            let modes = daemon_modes(&key).to_vec();
            let owner = std::any::type_name::<DaemonConfig>();
            known.insert(key, Known { modes, owner });
        }
        let mut defaults = serde_json::Map::new();
        for entry in entries {
            let value = (entry.defaults)();
            let mut leaves = Vec::new();
            leaf_keys(&value, entry.key, &open_maps, &mut leaves);
            for key in leaves {
                let relative = key.strip_prefix(&format!("{}.", entry.key)).unwrap_or("");
                let modes = entry.modes_of(relative);
                known.insert(
                    key.clone(),
                    Known {
                        modes,
                        owner: entry.type_name,
                    },
                );
            }
            merge_into(&mut defaults, entry.key, value);
        }
        let tables = known
            .keys()
            .filter_map(|key| key.split('.').next().map(str::to_owned))
            .collect();
        let text = text_keys(&daemon, &defaults, entries, &open_maps);
        let mut shapes = BTreeMap::new();
        for entry in entries {
            for shape in (entry.entry_shapes)() {
                let key = format!("{}.{}", entry.key, shape.key);
                let mut leaves = Vec::new();
                leaf_keys(&shape.sample, "", &[], &mut leaves);
                let shape = Shape {
                    map: open_maps.contains(&key),
                    keys: leaves.into_iter().filter(|k| !k.is_empty()).collect(),
                };
                shapes.insert(key, shape);
            }
        }
        Self {
            known,
            open_maps,
            shapes,
            tables,
            text,
            defaults,
        }
    }

    /// The daemons that read `key`, `None` when it is no key.
    fn modes(&self, key: &str) -> Option<Vec<Mode>> {
        self.get(key).map(|known| known.modes.clone())
    }

    /// What is known of `key` (a key, or an entry of an open map), `None` when it is no key.
    fn get(&self, key: &str) -> Option<&Known> {
        self.known.get(key).or_else(|| {
            self.open_maps
                .iter()
                .find(|m| key.starts_with(&format!("{m}.")))
                .and_then(|m| self.known.get(m))
        })
    }

    /// The keys that entries of `key` in `table` (a layer's) have and their shape does not,
    /// each named with its entry's place: `virtual.models[2].alias` (a list's entries counted
    /// from 0), `exec.tools.x.arg`. Empty when `key` holds no entries of one shape. An entry
    /// that is no table is left to the extraction, which refuses it.
    fn unknown_entry_keys(&self, key: &str, table: &Value) -> Vec<String> {
        let Some(shape) = self.shapes.get(key) else {
            return Vec::new();
        };
        // The shaped keys hold no user's names, so their parts are the path.
        let entries: Vec<(String, &Value)> = match key.split('.').try_fold(table, |v, k| v.get(k)) {
            Some(Value::Array(items)) if !shape.map => items
                .iter()
                .enumerate()
                .map(|(i, entry)| (format!("{key}[{i}]"), entry))
                .collect(),
            Some(Value::Object(map)) if shape.map => map
                .iter()
                .map(|(name, entry)| (format!("{key}.{name}"), entry))
                .collect(),
            _ => Vec::new(),
        };
        let mut unknown = Vec::new();
        for (place, entry) in entries {
            if !entry.is_object() {
                continue;
            }
            let mut found = Vec::new();
            leaf_keys(entry, "", &[], &mut found);
            unknown.extend(
                found
                    .into_iter()
                    .filter(|k| !k.is_empty() && !shape.keys.contains(k))
                    .map(|k| format!("{place}.{k}")),
            );
        }
        unknown
    }

    /// The tables a daemon of `mode` reads some key of.
    fn tables_read_by(&self, mode: Mode) -> BTreeSet<String> {
        self.known
            .iter()
            .filter(|(_, known)| known.modes.contains(&mode))
            .filter_map(|(key, _)| key.split('.').next().map(str::to_owned))
            .collect()
    }
}

/// What is wrong with how `sections` lay out their keys (see [`Sections::layout_problems`]).
fn layout_problems(sections: &Sections) -> Vec<String> {
    let open_maps = &sections.key_table().open_maps;
    let mut problems = Vec::new();
    // Every section's keys with its defaults, the daemon's own first.
    let daemon = serde_json::to_value(DaemonConfig::default()).unwrap_or(Value::Null);
    let mut held: Vec<(&str, Vec<String>, Value)> = Vec::new();
    let mut leaves = Vec::new();
    leaf_keys(&daemon, "", open_maps, &mut leaves);
    held.push((
        std::any::type_name::<DaemonConfig>(),
        leaves,
        daemon.clone(),
    ));
    for entry in &sections.entries {
        let mut leaves = Vec::new();
        let defaults = (entry.defaults)();
        leaf_keys(&defaults, entry.key, open_maps, &mut leaves);
        let mut table = serde_json::Map::new();
        table.insert(entry.key.to_owned(), defaults);
        held.push((entry.type_name, leaves, Value::Object(table)));
    }
    // Sections sharing a table hold disjoint keys, and none holds a key inside another's.
    for (i, (a_type, a_keys, _)) in held.iter().enumerate() {
        for (b_type, b_keys, _) in &held[i + 1..] {
            for a in a_keys {
                for b in b_keys {
                    if a == b {
                        problems.push(format!("{a} is a key of both {a_type} and {b_type}"));
                    } else if b.starts_with(&format!("{a}.")) || a.starts_with(&format!("{b}.")) {
                        problems.push(format!(
                            "{a} ({a_type}) and {b} ({b_type}) overlap: one holds the other"
                        ));
                    }
                }
            }
        }
    }
    // A key a section lists is one of its own keys: a text key is unset by default, and a key
    // one mode alone reads belongs to a section that mode reads.
    let listed = |owner: &str, keys: &[String], defaults: &Value, list: &str, key: String| {
        let unset = key
            .split('.')
            .try_fold(defaults, |v, k| v.get(k))
            .is_some_and(Value::is_null);
        if !keys.contains(&key) {
            Some(format!(
                "{owner}: {list} names {key}, no key of its section"
            ))
        } else if list.ends_with("TEXT_KEYS") && !unset {
            Some(format!(
                "{owner}: {list} names {key}, whose default is not unset"
            ))
        } else {
            None
        }
    };
    for (entry, (owner, keys, defaults)) in sections.entries.iter().zip(&held[1..]) {
        let full = |k: &str| format!("{}.{k}", entry.key);
        for (key, mode) in entry.only {
            problems.extend(listed(owner, keys, defaults, "ONLY", full(key)));
            if !entry.modes.contains(mode) {
                problems.push(format!(
                    "{owner}: ONLY gives {} to {mode:?}, which does not read the section",
                    full(key)
                ));
            }
        }
        for key in entry.text_keys {
            problems.extend(listed(owner, keys, defaults, "TEXT_KEYS", full(key)));
        }
        for key in entry.open_maps {
            problems.extend(listed(owner, keys, defaults, "OPEN_MAPS", full(key)));
        }
        // A shaped key holds a list, or is an open map; its sample entry is a table.
        for shape in (entry.entry_shapes)() {
            let key = full(shape.key);
            let list = key
                .split('.')
                .try_fold(defaults, |v, k| v.get(k))
                .is_some_and(Value::is_array);
            if !keys.contains(&key) {
                problems.push(format!(
                    "{owner}: entry_shapes names {key}, no key of its section"
                ));
            } else if !list && !entry.open_maps.contains(&shape.key) {
                problems.push(format!(
                    "{owner}: entry_shapes names {key}, neither a list nor one of its OPEN_MAPS"
                ));
            }
            if shape
                .sample
                .as_object()
                .is_none_or(serde_json::Map::is_empty)
            {
                problems.push(format!(
                    "{owner}: entry_shapes gives {key} a sample entry that is no table"
                ));
            }
        }
    }
    let (owner, keys, defaults) = &held[0];
    for key in WORKER_ONLY_KEYS {
        problems.extend(listed(
            owner,
            keys,
            defaults,
            "WORKER_ONLY_KEYS",
            (*key).to_owned(),
        ));
    }
    for key in OPTIONAL_TEXT_KEYS {
        problems.extend(listed(
            owner,
            keys,
            defaults,
            "OPTIONAL_TEXT_KEYS",
            (*key).to_owned(),
        ));
    }
    for table in GATEWAY_SECTIONS {
        if daemon.get(table).is_none() {
            problems.push(format!(
                "{owner}: GATEWAY_SECTIONS names {table}, no table of its section"
            ));
        }
    }
    problems
}

/// The configuration as `config.get` answers it: the lease limits, and every table this daemon
/// reads a key of (a gateway's: lease, http, gateway, eventBuffer, log, agentDevice), the join
/// token redacted. `values` are the registered sections this daemon was started with (see
/// [`section_value`]); a registered section left out shows its defaults.
pub fn view(
    config: &DaemonConfig,
    sections: &Sections,
    values: &[SectionValue],
    mode: Mode,
) -> simlock_contract::ops::ConfigView {
    let read = sections.key_table().tables_read_by(mode);
    let mut all = match serde_json::to_value(config) {
        Ok(Value::Object(map)) => map,
        _ => serde_json::Map::new(),
    };
    for entry in &sections.entries {
        let value = values
            .iter()
            .find(|v| v.type_id == entry.type_id)
            .map_or_else(|| (entry.defaults)(), |v| v.value.clone());
        merge_into(&mut all, entry.key, value);
    }
    let mut settings = BTreeMap::new();
    for (key, mut value) in all {
        if !read.contains(&key) {
            continue;
        }
        if key == "gateway"
            && let Some(token) = value.get_mut("token").filter(|t| !t.is_null())
        {
            *token = Value::String("[redacted]".into());
        }
        settings.insert(key, value);
    }
    simlock_contract::ops::ConfigView {
        mode,
        lease: simlock_contract::model::LeaseLimits {
            default_ttl_ms: config.lease.default_ttl_ms,
            max_ttl_ms: config.lease.max_ttl_ms,
        },
        settings,
    }
}

/// Checks combinations no single value's type can.
///
/// # Errors
/// A message naming the keys.
pub fn validate(config: &DaemonConfig, mode: Mode) -> Result<(), ConfigError> {
    let bad = |msg: String| Err(ConfigError::Invalid(msg));
    above_zero(&[
        ("lease.defaultTtlMs", config.lease.default_ttl_ms),
        ("lease.maxTtlMs", config.lease.max_ttl_ms),
        ("lease.maxWaiting", u64::from(config.lease.max_waiting)),
        (
            "eventBuffer.capacity",
            u64::from(config.event_buffer.capacity),
        ),
    ])
    .map_err(|e| ConfigError::Invalid(e.message))?;
    if config.lease.default_ttl_ms > config.lease.max_ttl_ms {
        return bad(format!(
            "lease.defaultTtlMs ({}) is above lease.maxTtlMs ({})",
            config.lease.default_ttl_ms, config.lease.max_ttl_ms
        ));
    }
    if let Err(e) = crate::logging::filter(&config.log.level) {
        return bad(format!("log.level: {e}"));
    }
    if config.http.host.trim().is_empty() {
        return bad(
            "http.host is empty: an address to listen on, e.g. 127.0.0.1 or 0.0.0.0".into(),
        );
    }
    if config.lease.max_ttl_ms > simlock_contract::bounds::MAX_TTL_MS {
        return bad(format!(
            "lease.maxTtlMs is above {} (31 days)",
            simlock_contract::bounds::MAX_TTL_MS
        ));
    }
    match (&config.http.tls.cert_file, &config.http.tls.key_file) {
        (Some(_), None) | (None, Some(_)) => {
            return bad("http.tls.certFile and http.tls.keyFile must be set together".into());
        }
        (Some(cert), Some(key)) if cert.is_empty() || key.is_empty() => {
            return bad("http.tls.certFile and http.tls.keyFile must name files".into());
        }
        _ => {}
    }
    match mode {
        Mode::Gateway => {
            if config.http.enabled == Some(false) {
                return bad("http.enabled cannot be false on a gateway: workers and agents reach it over HTTP".into());
            }
        }
        Mode::Worker => {
            match (&config.gateway.url, &config.gateway.token) {
                (Some(url), Some(_)) if !url.starts_with("ws://") && !url.starts_with("wss://") => {
                    return bad(format!(
                        "gateway.url must start with ws:// or wss://, got {url}"
                    ));
                }
                (Some(_), None) | (None, Some(_)) => {
                    return bad("gateway.url and gateway.token must be set together".into());
                }
                _ => {}
            }
            if config.gateway.ca_file.as_deref() == Some("") {
                return bad("gateway.caFile must name a file".into());
            }
            if let Some(label) = &config.gateway.label
                && let Err(e) = simlock_contract::bounds::label(label)
            {
                return bad(format!("gateway.label: {e}"));
            }
            for cap in &config.capabilities {
                if !simlock_contract::bounds::is_capability_name(cap) {
                    return bad(format!(
                        "capabilities: {cap:?} is not a capability name (^[a-z][a-z0-9-]{{0,63}}$)"
                    ));
                }
            }
        }
    }
    Ok(())
}

fn describe(error: &figment::Error) -> String {
    describe_at("", error)
}

/// [`describe`] for an error of the table `table` (its paths start below it).
fn describe_at(table: &str, error: &figment::Error) -> String {
    let mut parts = Vec::new();
    for e in error.clone() {
        let key = std::iter::once(table)
            .filter(|t| !t.is_empty())
            .chain(e.path.iter().map(String::as_str))
            .collect::<Vec<_>>()
            .join(".");
        let what = match &e.kind {
            // figment quotes its list of spellings once more (``a` or `b``).
            figment::error::Kind::UnknownVariant(found, expected) => {
                format!("unknown value `{found}`, expected {}", one_of(expected))
            }
            // A number is a number whichever layer gave it (TOML's are signed, `--set`'s
            // unsigned): its sign is not named.
            figment::error::Kind::InvalidValue(figment::error::Actual::Signed(n), expected) => {
                invalid_number(n, expected)
            }
            figment::error::Kind::InvalidValue(figment::error::Actual::Unsigned(n), expected) => {
                invalid_number(n, expected)
            }
            kind => in_config_terms(&simlock_contract::in_json_terms(&kind.to_string())),
        };
        if key.is_empty() {
            parts.push(what)
        } else {
            parts.push(format!("{key}: {what}"))
        }
    }
    parts.join("; ")
}

/// The spellings a key takes, each quoted: `` `a` ``, `` `a` or `b` ``, `` `a`, `b` or `c` ``.
fn one_of(spellings: &[&str]) -> String {
    let quoted: Vec<String> = spellings.iter().map(|s| format!("`{s}`")).collect();
    match quoted.split_last() {
        None => "nothing".to_owned(),
        Some((last, [])) => last.clone(),
        Some((last, rest)) => format!("{} or {last}", rest.join(", ")),
    }
}

/// `invalid value `<n>`, expected <what>`, in the reader's terms.
fn invalid_number(n: &impl std::fmt::Display, expected: &str) -> String {
    simlock_contract::in_json_terms(&format!("invalid value `{n}`, expected {expected}"))
}

/// `message` with serde's name of a Rust type a table is read into (`expected struct
/// PlatformLimit`) said as a table: the reader knows keys and tables, not our types.
fn in_config_terms(message: &str) -> String {
    const STRUCT: &str = "expected struct ";
    match message.find(STRUCT) {
        Some(at) => {
            let name_end = message[at + STRUCT.len()..]
                .find(|c: char| !c.is_ascii_alphanumeric() && c != '_')
                .map_or(message.len(), |end| at + STRUCT.len() + end);
            format!("{}expected a table{}", &message[..at], &message[name_end..])
        }
        None => message.to_owned(),
    }
}

/// The `SIMLOCK_*` variables that are configuration, as figment's [`Env`] reads them from the
/// process: `SIMLOCK_LEASE__MAX_TTL_MS` is `lease.maxTtlMs` (`__` splits the key, each part is
/// turned from upper snake case into camelCase). Left out: the names in [`NOT_CONFIG_ENV`], and
/// names whose first part is no section (they belong to other tools: tests, the CLI, a leased
/// device's environment).
///
/// A filter or map added to the returned `Env` turns figment's lower-casing of keys back on;
/// call `.lowercase(false)` after it.
fn environment(sections: &Sections) -> Env {
    let tables = sections.key_table().tables.clone();
    let not_config: Vec<&str> = NOT_CONFIG_ENV
        .iter()
        .filter_map(|name| name.strip_prefix(ENV_PREFIX))
        .collect();
    // `Env::prefixed` would match the prefix in any case; environment names are case-sensitive,
    // and `simlock_…` is not ours.
    Env::raw()
        .filter_map(|name| name.as_str().strip_prefix(ENV_PREFIX).map(Into::into))
        .ignore(&not_config)
        .split("__")
        .map(|name| key_of_parts(name.as_str().split('.')).into())
        .filter(move |key| {
            key.as_str()
                .split('.')
                .next()
                .is_some_and(|section| tables.contains(section))
        })
        .lowercase(false)
}

/// The environment layer: [`environment`] with its values parsed by figment (numbers, booleans,
/// `[…]` arrays, `{k = v}` tables, `"…"` strings, else text), except text keys
/// ([`text_keys`]), whose values are taken as they are (`SIMLOCK_GATEWAY__LABEL=42` is the
/// label "42").
fn environment_layer(sections: &Sections) -> Figment {
    let text: Vec<&str> = sections
        .key_table()
        .text
        .iter()
        .map(String::as_str)
        .collect();
    // Each filter or map of figment's `Env` turns lower-casing back on: keep the camelCase keys.
    let mut layer = Figment::from(environment(sections).ignore(&text).lowercase(false));
    for (key, raw) in environment(sections).only(&text).lowercase(false).iter() {
        layer = layer.merge(Serialized::default(key.as_str(), raw));
    }
    layer
}

/// Keys whose value is text though their default is absent.
const OPTIONAL_TEXT_KEYS: &[&str] = &[
    "gateway.url",
    "gateway.token",
    "gateway.label",
    "gateway.caFile",
    "http.tls.certFile",
    "http.tls.keyFile",
];

/// The text keys: those whose default is a string (in `daemon`, the daemon's own defaults, or
/// `sections`, the registered sections' merged by table), [`OPTIONAL_TEXT_KEYS`] and the
/// registered sections' [`Section::TEXT_KEYS`].
fn text_keys(
    daemon: &Value,
    sections: &serde_json::Map<String, Value>,
    entries: &[Entry],
    open_maps: &[String],
) -> BTreeSet<String> {
    let mut defaults = match daemon {
        Value::Object(map) => map.clone(),
        _ => serde_json::Map::new(),
    };
    for (table, value) in sections {
        merge_into(&mut defaults, table, value.clone());
    }
    let defaults = Value::Object(defaults);
    let mut leaves = Vec::new();
    leaf_keys(&defaults, "", open_maps, &mut leaves);
    let mut keys: BTreeSet<String> = leaves
        .into_iter()
        .filter(|key| {
            key.split('.')
                .try_fold(&defaults, |v, k| v.get(k))
                .is_some_and(Value::is_string)
        })
        .collect();
    keys.extend(OPTIONAL_TEXT_KEYS.iter().map(|k| (*k).to_owned()));
    for entry in entries {
        keys.extend(entry.text_keys.iter().map(|k| format!("{}.{k}", entry.key)));
    }
    keys
}

/// Reads a `--set KEY=VALUE` value for `key` as an environment variable's is read: text keys
/// keep it as it is (`gateway.label=42` is the label "42"); other keys as figment reads a value
/// (numbers, booleans, arrays, else text), so a bad value fails naming the key.
pub fn coerce(key: &str, raw: &str, sections: &Sections) -> Value {
    if sections.key_table().text.contains(key) {
        return Value::String(raw.to_owned());
    }
    let parsed: figment::value::Value = raw
        .parse()
        .unwrap_or_else(|never: std::convert::Infallible| match never {});
    serde_json::to_value(parsed).unwrap_or_else(|_| Value::String(raw.to_owned()))
}

/// The key a `SIMLOCK_*` variable names (`SIMLOCK_CAPACITY__IOS__MAX_RUNNING` is
/// `capacity.ios.maxRunning`): `__` splits the key, each part goes from upper snake case to
/// camelCase. `None` for a name without the prefix. Whether the key exists is the sections' word.
pub fn key_of_variable(name: &str) -> Option<String> {
    name.strip_prefix(ENV_PREFIX)
        .map(|rest| key_of_parts(rest.split("__")))
}

/// The parts of a variable's name (after the prefix, split) as a dotted key.
fn key_of_parts<'a>(parts: impl Iterator<Item = &'a str>) -> String {
    parts
        .map(camel_from_upper_snake)
        .collect::<Vec<_>>()
        .join(".")
}

/// `MAX_TTL_MS` → `maxTtlMs`: one part of an environment variable's name as a key.
fn camel_from_upper_snake(part: &str) -> String {
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
}

fn leaf_keys(value: &Value, prefix: &str, open_maps: &[String], out: &mut Vec<String>) {
    match value {
        Value::Object(map) if !map.is_empty() => {
            for (key, child) in map {
                let path = if prefix.is_empty() {
                    key.clone()
                } else {
                    format!("{prefix}.{key}")
                };
                if open_maps.contains(&path) {
                    out.push(path);
                    continue;
                }
                leaf_keys(child, &path, open_maps, out);
            }
        }
        _ => out.push(prefix.to_owned()),
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    #[test]
    fn a_number_out_of_range_reads_alike_from_every_layer() {
        use figment::error::{Actual, Kind};
        for (layer, actual) in [
            ("TOML", Actual::Signed(70_000)),
            ("--set", Actual::Unsigned(70_000)),
        ] {
            let error = figment::Error::from(Kind::InvalidValue(actual, "u16".into()));
            assert_eq!(
                describe(&error),
                "invalid value `70000`, expected a whole number from 0 to 65535",
                "{layer}"
            );
        }
    }

    #[test]
    fn the_spellings_a_key_takes_are_quoted_once_each() {
        assert_eq!(one_of(&[]), "nothing");
        assert_eq!(one_of(&["fixed"]), "`fixed`");
        assert_eq!(one_of(&["resource", "fixed"]), "`resource` or `fixed`");
        assert_eq!(
            one_of(&["auto", "simctl", "virtual"]),
            "`auto`, `simctl` or `virtual`"
        );
    }

    #[test]
    fn a_variable_names_its_key_by_the_documented_rule() {
        assert_eq!(
            key_of_variable("SIMLOCK_CAPACITY__IOS__MAX_RUNNING").as_deref(),
            Some("capacity.ios.maxRunning")
        );
        assert_eq!(
            key_of_variable("SIMLOCK_LEASE__MAX_TTL_MS").as_deref(),
            Some("lease.maxTtlMs")
        );
        assert_eq!(
            key_of_variable("SIMLOCK_HTTP__LISTEN").as_deref(),
            Some("http.listen")
        );
        assert_eq!(
            key_of_variable("simlock_http__listen"),
            None,
            "the prefix is upper case"
        );
        assert_eq!(key_of_variable("HOME"), None);
    }

    /// Runs `f` with `env` set in the process environment: figment's `Jail` lets one test at a
    /// time set variables, and restores them afterwards.
    #[allow(
        clippy::result_large_err,
        reason = "figment's Jail takes a closure returning figment's own Result"
    )]
    pub(super) fn with_env<T>(env: &[(&str, &str)], f: impl FnOnce() -> T) -> T {
        let mut out = None;
        figment::Jail::expect_with(|jail| {
            for (name, value) in env {
                jail.set_env(name, value);
            }
            out = Some(f());
            Ok(())
        });
        out.unwrap()
    }

    fn load_with(toml: &str, env: &[(&str, &str)], mode: Mode) -> Result<Loaded, ConfigError> {
        let dir = tempfile::tempdir().unwrap();
        if !toml.is_empty() {
            std::fs::write(dir.path().join("config.toml"), toml).unwrap();
        }
        with_env(env, || load(dir.path(), mode, &[], &Sections::new()))
    }

    #[test]
    fn defaults_load_without_a_file() {
        let loaded = load_with("", &[], Mode::Worker).unwrap();
        assert_eq!(loaded.config, DaemonConfig::default());
        assert!(loaded.warnings.is_empty());
        assert_eq!(loaded.config.lease.max_ttl_ms, 14_400_000);
    }

    #[test]
    fn a_log_level_that_is_no_filter_fails_naming_the_key() {
        let err = load_with("[log]\nlevel = \"garbage=[[[\"", &[], Mode::Worker).unwrap_err();
        let text = err.to_string();
        assert!(
            text.contains("log.level") && text.contains("garbage"),
            "{text}"
        );
        let loaded = load_with(
            "[log]\nlevel = \"warn,simlock_core=debug\"",
            &[],
            Mode::Gateway,
        );
        assert!(loaded.is_ok());
    }

    #[test]
    fn layers_override_in_order() {
        let loaded = load_with(
            "[lease]\nmaxTtlMs = 7200000\ndefaultTtlMs = 60000\n[http]\nport = 1",
            &[("SIMLOCK_HTTP__PORT", "2"), ("SIMLOCK_HOME", "/x")],
            Mode::Worker,
        )
        .unwrap();
        assert_eq!(loaded.config.lease.max_ttl_ms, 7_200_000);
        assert_eq!(loaded.config.http.port, 2);
        let dir = tempfile::tempdir().unwrap();
        let flags = [("http.port".to_owned(), json!(3))];
        let loaded = with_env(&[("SIMLOCK_HTTP__PORT", "2")], || {
            load(dir.path(), Mode::Worker, &flags, &Sections::new())
        })
        .unwrap();
        assert_eq!(loaded.config.http.port, 3);
    }

    #[test]
    fn unknown_keys_warn_and_mode_foreign_keys_warn() {
        let loaded = load_with(
            "[lease]\nmaxTtlMS = 5\n[gateway]\nlabel = \"mac\"",
            &[],
            Mode::Gateway,
        )
        .unwrap();
        assert!(
            loaded.warnings.iter().any(|w| w.contains("lease.maxTtlMS")),
            "{:?}",
            loaded.warnings
        );
        assert!(
            loaded
                .warnings
                .iter()
                .any(|w| w.contains("gateway.label is a worker setting")),
            "{:?}",
            loaded.warnings
        );
    }

    #[test]
    fn a_bad_value_fails_naming_the_key() {
        let err = load_with("[lease]\nmaxTtlMs = \"soon\"", &[], Mode::Worker)
            .unwrap_err()
            .to_string();
        assert_eq!(
            err,
            "configuration: lease.maxTtlMs: invalid type: found string \"soon\", expected a whole number, 0 or more"
        );
        for host in ["", "  "] {
            let err = load_with("", &[("SIMLOCK_HTTP__HOST", host)], Mode::Gateway)
                .unwrap_err()
                .to_string();
            assert_eq!(
                err,
                "configuration: http.host is empty: an address to listen on, e.g. 127.0.0.1 or 0.0.0.0"
            );
        }
        let err = load_with("", &[("SIMLOCK_HTTP__PORT", "many")], Mode::Worker)
            .unwrap_err()
            .to_string();
        assert_eq!(
            err,
            "configuration: http.port: invalid type: found string \"many\", expected a whole number from 0 to 65535"
        );
        // A table given a plain value is said as a table, not as the type it is read into.
        let err = load_with(
            "[lease]\nmaxTtlMs = 1",
            &[("SIMLOCK_HTTP", "3")],
            Mode::Worker,
        )
        .unwrap_err()
        .to_string();
        assert!(err.contains("expected a table"), "{err}");
        assert!(!err.contains("struct"), "{err}");
        let err = load_with(
            "[lease]\ndefaultTtlMs = 5000000\nmaxTtlMs = 60000",
            &[],
            Mode::Worker,
        )
        .unwrap_err()
        .to_string();
        assert!(
            err.contains("lease.defaultTtlMs") && err.contains("lease.maxTtlMs"),
            "{err}"
        );
        let err = load_with(
            "[gateway]\nurl = \"http://gw\"\ntoken = \"slk_x\"",
            &[],
            Mode::Worker,
        )
        .unwrap_err()
        .to_string();
        assert!(err.contains("gateway.url"), "{err}");
        let err = load_with("[gateway]\nurl = \"ws://gw\"", &[], Mode::Worker)
            .unwrap_err()
            .to_string();
        assert!(err.contains("gateway.token"), "{err}");
        let err = load_with("[http]\nenabled = false", &[], Mode::Gateway)
            .unwrap_err()
            .to_string();
        assert!(err.contains("http.enabled"), "{err}");
        let err = load_with("capabilities = [\"Bad\"]", &[], Mode::Worker)
            .unwrap_err()
            .to_string();
        assert!(err.contains("capabilities"), "{err}");
    }

    #[test]
    fn the_view_redacts_the_join_token_and_keeps_a_gateways_own_sections() {
        let mut config = DaemonConfig::default();
        config.gateway.token = Some("slk_secret".into());
        let worker = view(&config, &Sections::new(), &[], Mode::Worker);
        assert_eq!(worker.settings["gateway"]["token"], json!("[redacted]"));
        assert!(worker.settings.contains_key("capabilities"));
        let gateway = view(&config, &Sections::new(), &[], Mode::Gateway);
        assert!(
            !gateway.settings.contains_key("capabilities"),
            "a gateway does not read worker keys"
        );
        assert!(
            !gateway.settings.contains_key("gateway"),
            "without the fleet's section a gateway reads none of gateway.*"
        );
        assert_eq!(gateway.lease.max_ttl_ms, config.lease.max_ttl_ms);
        assert!(
            !serde_json::to_string(&worker)
                .unwrap()
                .contains("slk_secret")
        );
    }

    #[test]
    fn text_keys_keep_numeric_looking_text_and_other_keys_read_json() {
        assert_eq!(coerce("gateway.label", "42", &Sections::new()), json!("42"));
        assert_eq!(
            coerce("http.host", "127.0.0.1", &Sections::new()),
            json!("127.0.0.1")
        );
        assert_eq!(coerce("http.port", "4701", &Sections::new()), json!(4701));
        assert_eq!(
            coerce("http.enabled", "true", &Sections::new()),
            json!(true)
        );
        assert_eq!(
            coerce("capabilities", r#"["gpu"]"#, &Sections::new()),
            json!(["gpu"])
        );
        let env = [
            ("SIMLOCK_GATEWAY__LABEL", "42"),
            ("SIMLOCK_GATEWAY__URL", "ws://g"),
            ("SIMLOCK_GATEWAY__TOKEN", "123"),
        ];
        let loaded = load_with("", &env, Mode::Worker).unwrap();
        assert_eq!(loaded.config.gateway.label.as_deref(), Some("42"));
        assert_eq!(loaded.config.gateway.token.as_deref(), Some("123"));
    }

    #[test]
    fn a_zero_where_a_zero_cannot_work_fails_naming_the_key_and_one_passes() {
        for mode in [Mode::Worker, Mode::Gateway] {
            for (toml, key) in [
                ("[lease]\ndefaultTtlMs = 0", "lease.defaultTtlMs"),
                ("[lease]\ndefaultTtlMs = 1\nmaxTtlMs = 0", "lease.maxTtlMs"),
                ("[eventBuffer]\ncapacity = 0", "eventBuffer.capacity"),
                ("[lease]\nmaxWaiting = 0", "lease.maxWaiting"),
            ] {
                let err = load_with(toml, &[], mode).unwrap_err().to_string();
                assert_eq!(err, format!("configuration: {key} must be above 0"));
            }
            for toml in [
                "[lease]\ndefaultTtlMs = 1\nmaxTtlMs = 1",
                "[eventBuffer]\ncapacity = 1",
                "[lease]\nmaxWaiting = 1",
            ] {
                assert!(load_with(toml, &[], mode).is_ok(), "{toml}");
            }
        }
    }

    #[test]
    fn limits_at_their_bound_pass_and_one_past_fail_naming_the_key() {
        let max = simlock_contract::bounds::MAX_TTL_MS;
        let toml = |ttl: u64| format!("[lease]\nmaxTtlMs = {ttl}");
        assert!(load_with(&toml(max), &[], Mode::Worker).is_ok());
        let err = load_with(&toml(max + 1), &[], Mode::Worker)
            .unwrap_err()
            .to_string();
        assert!(err.contains("lease.maxTtlMs"), "{err}");
        let label = |n: usize| format!("[gateway]\nlabel = \"{}\"", "l".repeat(n));
        let bound = simlock_contract::bounds::MAX_LABEL;
        assert!(load_with(&label(bound), &[], Mode::Worker).is_ok());
        let err = load_with(&label(bound + 1), &[], Mode::Worker)
            .unwrap_err()
            .to_string();
        assert!(err.contains("gateway.label"), "{err}");
        // Outside trial 22: a label shows in every listing; a control character in it is
        // refused at start-up, as the gateway refuses it on the uplink.
        let err = load_with("[gateway]\nlabel = \"mini\\n3\"", &[], Mode::Worker)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("gateway.label") && err.contains("control characters"),
            "{err}"
        );
    }

    #[test]
    fn a_wss_gateway_and_tls_files_load() {
        let toml = "[gateway]\nurl = \"wss://gw\"\ntoken = \"slk_x\"\ncaFile = \"ca.pem\"";
        let loaded = load_with(toml, &[], Mode::Worker).unwrap();
        assert_eq!(loaded.config.gateway.url.as_deref(), Some("wss://gw"));
        assert_eq!(loaded.config.gateway.ca_file.as_deref(), Some("ca.pem"));
        assert!(loaded.warnings.is_empty(), "{:?}", loaded.warnings);
        let toml = "[http.tls]\ncertFile = \"/etc/simlock/cert.pem\"\nkeyFile = \"key.pem\"";
        let loaded = load_with(toml, &[], Mode::Gateway).unwrap();
        assert_eq!(
            loaded.config.http.tls.cert_file.as_deref(),
            Some("/etc/simlock/cert.pem")
        );
        assert!(loaded.warnings.is_empty(), "{:?}", loaded.warnings);
        let env = [
            ("SIMLOCK_HTTP__TLS__CERT_FILE", "1"),
            ("SIMLOCK_HTTP__TLS__KEY_FILE", "2"),
        ];
        let loaded = load_with("", &env, Mode::Worker).unwrap();
        assert_eq!(loaded.config.http.tls.key_file.as_deref(), Some("2"));
    }

    #[test]
    fn tls_settings_that_cannot_work_fail_naming_the_keys() {
        let err = load_with("[http.tls]\ncertFile = \"c.pem\"", &[], Mode::Gateway)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("http.tls.certFile") && err.contains("http.tls.keyFile"),
            "{err}"
        );
        let err = load_with("[http.tls]\nkeyFile = \"k.pem\"", &[], Mode::Worker)
            .unwrap_err()
            .to_string();
        assert!(err.contains("http.tls.keyFile"), "{err}");
        let err = load_with(
            "[gateway]\nurl = \"https://gw\"\ntoken = \"slk_x\"",
            &[],
            Mode::Worker,
        )
        .unwrap_err()
        .to_string();
        assert!(
            err.contains("gateway.url") && err.contains("wss://"),
            "{err}"
        );
        let err = load_with("[gateway]\ncaFile = \"\"", &[], Mode::Worker)
            .unwrap_err()
            .to_string();
        assert!(err.contains("gateway.caFile"), "{err}");
        let toml = "[gateway]\nurl = \"ws://gw\"\ntoken = \"slk_x\"\ncaFile = \"ca.pem\"";
        let loaded = load_with(toml, &[], Mode::Worker).unwrap();
        assert!(
            loaded.warnings.iter().any(|w| w.contains("gateway.caFile")),
            "{:?}",
            loaded.warnings
        );
        let loaded = load_with("[gateway]\ncaFile = \"ca.pem\"", &[], Mode::Gateway).unwrap();
        assert!(
            loaded
                .warnings
                .iter()
                .any(|w| w.contains("gateway.caFile is a worker setting")),
            "{:?}",
            loaded.warnings
        );
    }

    #[test]
    fn environment_names_map_to_camel_case_keys() {
        let env = [
            ("SIMLOCK_LEASE__MAX_TTL_MS", "60000"),
            ("SIMLOCK_GATEWAY__URL", "ws://x"),
            ("OTHER", "1"),
            ("SIMLOCK_E2E", "1"),
        ];
        let table: Value = with_env(&env, || {
            environment_layer(&Sections::new()).extract().unwrap()
        });
        assert_eq!(
            table,
            json!({"lease": {"maxTtlMs": 60000}, "gateway": {"url": "ws://x"}})
        );
    }

    #[test]
    fn environment_values_are_typed_and_text_keys_keep_their_text() {
        let env = [
            ("SIMLOCK_LEASE__MAX_TTL_MS", "5000"),
            ("SIMLOCK_LEASE__DEFAULT_TTL_MS", "5000"),
            ("SIMLOCK_HTTP__ENABLED", "true"),
            ("SIMLOCK_EVENT_BUFFER__CAPACITY", "7"),
            ("SIMLOCK_CAPABILITIES", r#"["gpu", "agent-device"]"#),
            // Text keys given digits, a float, a quoted word and spaces stay text as given.
            ("SIMLOCK_GATEWAY__LABEL", "007"),
            ("SIMLOCK_HTTP__HOST", "1.5"),
            ("SIMLOCK_LOG__LEVEL", "warn"),
        ];
        let loaded = load_with("", &env, Mode::Worker).unwrap();
        assert!(loaded.warnings.is_empty(), "{:?}", loaded.warnings);
        let c = loaded.config;
        assert_eq!((c.lease.max_ttl_ms, c.lease.default_ttl_ms), (5000, 5000));
        assert_eq!(c.http.enabled, Some(true));
        assert_eq!(c.event_buffer.capacity, 7);
        assert_eq!(c.capabilities, ["gpu", "agent-device"]);
        assert_eq!(c.gateway.label.as_deref(), Some("007"));
        assert_eq!(c.http.host, "1.5");
        assert_eq!(c.log.level, "warn");
    }

    #[test]
    fn a_bad_environment_value_fails_naming_its_key() {
        for (name, value, key) in [
            ("SIMLOCK_LEASE__MAX_TTL_MS", "soon", "lease.maxTtlMs"),
            ("SIMLOCK_LEASE__MAX_TTL_MS", "-1", "lease.maxTtlMs"),
            ("SIMLOCK_LEASE__MAX_TTL_MS", "1.5", "lease.maxTtlMs"),
            ("SIMLOCK_HTTP__PORT", "65536", "http.port"),
            ("SIMLOCK_HTTP__ENABLED", "yes", "http.enabled"),
            ("SIMLOCK_CAPABILITIES", "gpu", "capabilities"),
        ] {
            let err = load_with("", &[(name, value)], Mode::Worker)
                .unwrap_err()
                .to_string();
            assert!(err.contains(key), "{name}={value}: {err}");
        }
        // One below the limit passes.
        let loaded = load_with("", &[("SIMLOCK_HTTP__PORT", "65535")], Mode::Worker).unwrap();
        assert_eq!(loaded.config.http.port, 65535);
    }

    #[test]
    fn simlock_names_that_are_not_configuration_are_ignored() {
        let env = [
            // Named a section, but not configuration.
            ("SIMLOCK_LOG", "not a filter"),
            ("SIMLOCK_HOME", "/nowhere"),
            ("SIMLOCK_TOKEN", "123"),
            ("SIMLOCK_CA_FILE", ""),
            // Their first part names no section.
            ("SIMLOCK_LEASE_ID", "abc"),
            ("SIMLOCK_E2E", "1"),
            ("SIMLOCK_NOT_A_SECTION__PORT", "x"),
            ("SIMLOCK_", "1"),
            // Not ours at all.
            ("OTHER_LEASE__MAX_TTL_MS", "1"),
            ("simlock_http__port", "1"),
            ("Simlock_HTTP__PORT", "1"),
        ];
        let loaded = load_with("", &env, Mode::Worker).unwrap();
        assert_eq!(loaded.config, DaemonConfig::default());
        assert!(loaded.warnings.is_empty(), "{:?}", loaded.warnings);
        // A name inside a section that is no key is warned about, as a file's would be.
        let loaded = load_with("", &[("SIMLOCK_LEASE__MAX_TTL_MX", "5")], Mode::Worker).unwrap();
        assert_eq!(
            loaded.warnings,
            vec!["unknown configuration key lease.maxTtlMx is ignored".to_owned()]
        );
    }

    #[test]
    fn the_environment_sits_between_the_file_and_the_flags() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(
            dir.path().join("config.toml"),
            "[gateway]\nlabel = \"file\"\n[log]\nlevel = \"warn\"",
        )
        .unwrap();
        let env = [
            ("SIMLOCK_GATEWAY__LABEL", "42"),
            ("SIMLOCK_LOG__LEVEL", "debug"),
        ];
        let loaded = with_env(&env, || {
            load(dir.path(), Mode::Worker, &[], &Sections::new())
        })
        .unwrap();
        assert_eq!(loaded.config.gateway.label.as_deref(), Some("42"));
        assert_eq!(loaded.config.log.level, "debug");
        let flags = [(
            "gateway.label".to_owned(),
            coerce("gateway.label", "43", &Sections::new()),
        )];
        let loaded = with_env(&env, || {
            load(dir.path(), Mode::Worker, &flags, &Sections::new())
        })
        .unwrap();
        assert_eq!(loaded.config.gateway.label.as_deref(), Some("43"));
        assert_eq!(loaded.config.log.level, "debug");
    }
}

/// The registry: sections of crates above the daemon, as test sections here.
#[cfg(test)]
mod section_tests {
    use serde::{Deserialize, Serialize};
    use serde_json::json;

    use super::*;

    /// A worker's section with one rule and one unset text key.
    #[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
    #[serde(rename_all = "camelCase", default)]
    struct Probe {
        limit: u32,
        path: Option<String>,
    }

    impl Default for Probe {
        fn default() -> Self {
            Self {
                limit: 3,
                path: None,
            }
        }
    }

    impl Section for Probe {
        const KEY: &'static str = "probe";
        const MODES: &'static [Mode] = WORKER;
        const TEXT_KEYS: &'static [&'static str] = &["path"];

        fn check(&self, daemon: &DaemonConfig, _mode: Mode) -> Result<(), SectionError> {
            above_zero(&[("probe.limit", u64::from(self.limit))])?;
            if u64::from(self.limit) > daemon.lease.max_ttl_ms {
                return Err(SectionError::new("probe.limit is above lease.maxTtlMs"));
            }
            Ok(())
        }
    }

    /// A section both daemons read, sharing the `gateway` table, with a worker-only key.
    #[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
    #[serde(rename_all = "camelCase", default)]
    struct Shared {
        mirror: bool,
        local: Option<u32>,
    }

    impl Section for Shared {
        const KEY: &'static str = "gateway";
        const MODES: &'static [Mode] = BOTH;
        const ONLY: &'static [(&'static str, Mode)] = &[("local", Mode::Worker)];
    }

    /// A gateway's section in the same table.
    #[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
    #[serde(rename_all = "camelCase", default)]
    struct Policy {
        policy: String,
    }

    impl Default for Policy {
        fn default() -> Self {
            Self {
                policy: "first".into(),
            }
        }
    }

    impl Section for Policy {
        const KEY: &'static str = "gateway";
        const MODES: &'static [Mode] = GATEWAY;
    }

    fn registered() -> Sections {
        Sections::new()
            .with::<Probe>()
            .with::<Shared>()
            .with::<Policy>()
    }

    /// A section in the `gateway` table holding a key of the daemon's and one of [`Policy`]'s.
    #[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
    #[serde(rename_all = "camelCase", default)]
    struct Clash {
        url: Option<String>,
        policy: Option<String>,
        own: bool,
    }

    impl Section for Clash {
        const KEY: &'static str = "gateway";
        const MODES: &'static [Mode] = GATEWAY;
    }

    /// A section in the `probe` table whose `path` holds a key inside [`Probe`]'s `path`.
    #[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
    #[serde(rename_all = "camelCase", default)]
    struct Nested {
        path: NestedPath,
    }

    #[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
    #[serde(rename_all = "camelCase", default)]
    struct NestedPath {
        deep: u32,
    }

    impl Section for Nested {
        const KEY: &'static str = "probe";
        const MODES: &'static [Mode] = WORKER;
    }

    /// A section whose lists name keys it does not have, or has but cannot list there.
    #[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
    #[serde(rename_all = "camelCase", default)]
    struct Listed {
        limit: u32,
        name: Option<String>,
        tools: BTreeMap<String, String>,
    }

    impl Default for Listed {
        fn default() -> Self {
            Self {
                limit: 1,
                name: None,
                tools: BTreeMap::new(),
            }
        }
    }

    impl Section for Listed {
        const KEY: &'static str = "listed";
        const MODES: &'static [Mode] = WORKER;
        const ONLY: &'static [(&'static str, Mode)] =
            &[("limitt", Mode::Worker), ("limit", Mode::Gateway)];
        const TEXT_KEYS: &'static [&'static str] = &["name", "nam", "limit"];
        const OPEN_MAPS: &'static [&'static str] = &["tools", "tool"];
    }

    /// A section with a list of tables and a map of the user's names to tables, each entry of
    /// one shape (an unset key and a table of its own among its keys).
    #[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
    #[serde(rename_all = "camelCase", default)]
    struct Catalog {
        items: Vec<Item>,
        named: BTreeMap<String, Item>,
    }

    #[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
    #[serde(rename_all = "camelCase")]
    struct Item {
        id: String,
        #[serde(default)]
        note: Option<String>,
        #[serde(default)]
        size: Size,
    }

    #[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
    #[serde(rename_all = "camelCase", default)]
    struct Size {
        wide: u32,
        high: u32,
    }

    impl Section for Catalog {
        const KEY: &'static str = "catalog";
        const MODES: &'static [Mode] = WORKER;
        const OPEN_MAPS: &'static [&'static str] = &["named"];

        fn entry_shapes() -> Vec<EntryShape> {
            let item = Item {
                id: String::new(),
                note: None,
                size: Size::default(),
            };
            vec![
                EntryShape::of("items", &item),
                EntryShape::of("named", &item),
            ]
        }
    }

    /// A section whose entry shapes name keys it does not have, or that hold no entries.
    #[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
    #[serde(rename_all = "camelCase", default)]
    struct Misshapen {
        limit: u32,
        words: Vec<String>,
    }

    impl Section for Misshapen {
        const KEY: &'static str = "misshapen";
        const MODES: &'static [Mode] = WORKER;

        fn entry_shapes() -> Vec<EntryShape> {
            vec![
                EntryShape::of("limit", &Size::default()),
                EntryShape::of("wordz", &Size::default()),
                EntryShape::of("words", &"a word"),
            ]
        }
    }

    #[test]
    fn keys_inside_entries_are_checked_against_their_shape_naming_the_entry() {
        let sections = Sections::new().with::<Catalog>();
        let valid = "[[catalog.items]]\nid = \"a\"\n[catalog.items.size]\nwide = 1\n\
                     [[catalog.items]]\nid = \"b\"\nnote = \"n\"\n\
                     [catalog.named.first]\nid = \"c\"\nsize = { wide = 2, high = 3 }";
        let loaded = load_text(valid, Mode::Worker, &sections).unwrap();
        assert!(loaded.warnings.is_empty(), "{:?}", loaded.warnings);
        assert_eq!(
            loaded.section::<Catalog>().unwrap().named["first"]
                .size
                .high,
            3
        );
        let typos = "[[catalog.items]]\nid = \"a\"\n[catalog.items.size]\ndeep = 1\n\
                     [[catalog.items]]\nid = \"b\"\nidd = \"b\"\nnotes = \"n\"\n\
                     [catalog.named.\"a.b\"]\nid = \"c\"\nnte = \"n\"";
        let loaded = load_text(typos, Mode::Worker, &sections).unwrap();
        assert_eq!(
            loaded.warnings,
            [
                "unknown configuration key catalog.items[0].size.deep is ignored",
                "unknown configuration key catalog.items[1].idd is ignored",
                "unknown configuration key catalog.items[1].notes is ignored",
                "unknown configuration key catalog.named.a.b.nte is ignored",
            ]
        );
        // The other daemon warns about the key as the other's, and about its entries' typos.
        let loaded = load_text(typos, Mode::Gateway, &sections).unwrap();
        assert_eq!(
            loaded.warnings[..2],
            [
                "catalog.items is a worker setting; a gateway ignores it",
                "unknown configuration key catalog.items[0].size.deep is ignored",
            ]
        );
        // Every layer is checked, and a key set in two layers is warned about once.
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(
            dir.path().join("config.toml"),
            "[catalog.named.x]\nid = \"x\"\nnte = \"file\"",
        )
        .unwrap();
        let env = [
            ("SIMLOCK_CATALOG__NAMED__X__NTE", "environment"),
            ("SIMLOCK_CATALOG__NAMED__Y__ID", "y"),
            ("SIMLOCK_CATALOG__NAMED__Y__SIZE__DEEP", "1"),
        ];
        let flags = [(
            "catalog.items".to_owned(),
            json!([{"id": "f", "size": {"wide": 1}}, {"id": "g", "colour": "red"}]),
        )];
        let loaded =
            tests::with_env(&env, || load(dir.path(), Mode::Worker, &flags, &sections)).unwrap();
        assert_eq!(
            loaded.warnings,
            [
                "unknown configuration key catalog.named.x.nte is ignored",
                "unknown configuration key catalog.named.y.size.deep is ignored",
                "unknown configuration key catalog.items[1].colour is ignored",
            ]
        );
        // An entry that is no table is refused by its type, naming the key.
        let err = load_text("[catalog]\nitems = [1]", Mode::Worker, &sections)
            .unwrap_err()
            .to_string();
        assert!(err.contains("catalog.items"), "{err}");
        // The shapes, from the entries' types.
        assert_eq!(
            sections.entry_keys("catalog.items").unwrap(),
            ["id", "note", "size.high", "size.wide"]
        );
        assert_eq!(
            sections.entry_keys("catalog.named"),
            sections.entry_keys("catalog.items")
        );
        assert_eq!(sections.entry_keys("catalog"), None);
        assert_eq!(sections.layout_problems(), Vec::<String>::new());
    }

    #[test]
    fn an_entry_shape_names_a_list_or_an_open_map_of_its_section_with_a_table() {
        let misshapen = std::any::type_name::<Misshapen>();
        assert_eq!(
            Sections::new().with::<Misshapen>().layout_problems(),
            [
                format!(
                    "{misshapen}: entry_shapes names misshapen.limit, neither a list nor one of its OPEN_MAPS"
                ),
                format!("{misshapen}: entry_shapes names misshapen.wordz, no key of its section"),
                format!(
                    "{misshapen}: entry_shapes gives misshapen.words a sample entry that is no table"
                ),
            ]
        );
    }

    #[test]
    fn every_key_names_the_section_that_holds_it() {
        let sections = registered().with::<Listed>();
        let owner = |key: &str| sections.owner_of(key);
        assert_eq!(owner("probe.limit"), Some(std::any::type_name::<Probe>()));
        assert_eq!(
            owner("gateway.policy"),
            Some(std::any::type_name::<Policy>())
        );
        assert_eq!(
            owner("gateway.mirror"),
            Some(std::any::type_name::<Shared>())
        );
        let daemon = Some(std::any::type_name::<DaemonConfig>());
        assert_eq!(owner("gateway.url"), daemon);
        assert_eq!(owner("lease.maxTtlMs"), daemon);
        assert_eq!(owner("capabilities"), daemon);
        // An open map's entries are its section's.
        assert_eq!(
            owner("listed.tools.echo"),
            Some(std::any::type_name::<Listed>())
        );
        assert_eq!(owner("gateway.urll"), None);
        assert_eq!(owner("gateway"), None, "a table is no key");
    }

    #[test]
    fn sections_sharing_a_table_must_hold_disjoint_keys_and_list_only_their_own() {
        assert_eq!(registered().layout_problems(), Vec::<String>::new());
        assert_eq!(Sections::new().layout_problems(), Vec::<String>::new());
        let daemon = std::any::type_name::<DaemonConfig>();
        let (clash, policy) = (
            std::any::type_name::<Clash>(),
            std::any::type_name::<Policy>(),
        );
        assert_eq!(
            registered().with::<Clash>().layout_problems(),
            [
                format!("gateway.url is a key of both {daemon} and {clash}"),
                format!("gateway.policy is a key of both {policy} and {clash}"),
            ]
        );
        let (probe, nested) = (
            std::any::type_name::<Probe>(),
            std::any::type_name::<Nested>(),
        );
        assert_eq!(
            registered().with::<Nested>().layout_problems(),
            [format!(
                "probe.path ({probe}) and probe.path.deep ({nested}) overlap: one holds the other"
            )]
        );
        let listed = std::any::type_name::<Listed>();
        assert_eq!(
            Sections::new().with::<Listed>().layout_problems(),
            [
                format!("{listed}: ONLY names listed.limitt, no key of its section"),
                format!(
                    "{listed}: ONLY gives listed.limit to Gateway, which does not read the section"
                ),
                format!("{listed}: TEXT_KEYS names listed.nam, no key of its section"),
                format!("{listed}: TEXT_KEYS names listed.limit, whose default is not unset"),
                format!("{listed}: OPEN_MAPS names listed.tool, no key of its section"),
            ]
        );
    }

    #[test]
    fn unknown_keys_are_checked_against_the_union_of_the_registered_sections() {
        let toml = "[probe]\nlimit = 5\n[gateway]\nmirror = true";
        let loaded = load_text(toml, Mode::Worker, &registered()).unwrap();
        assert!(loaded.warnings.is_empty(), "{:?}", loaded.warnings);
        assert_eq!(loaded.section::<Probe>().unwrap().limit, 5);
        assert!(loaded.section::<Shared>().unwrap().mirror);
        // The daemon's own keys are known beside them.
        assert_eq!(loaded.config, DaemonConfig::default());
        let loaded = load_text("[probe]\nlimitt = 5", Mode::Worker, &registered()).unwrap();
        assert_eq!(
            loaded.warnings,
            ["unknown configuration key probe.limitt is ignored"]
        );
        // Not registered: not a key.
        let loaded = load_text(toml, Mode::Worker, &Sections::new()).unwrap();
        assert_eq!(
            loaded.warnings,
            [
                "unknown configuration key gateway.mirror is ignored",
                "unknown configuration key probe.limit is ignored"
            ]
        );
        let err = loaded.section::<Probe>().unwrap_err().to_string();
        assert!(
            err.contains("probe") && err.contains("not registered"),
            "{err}"
        );
        // Registered twice is registered once.
        assert_eq!(registered().with::<Probe>().tables(), ["probe", "gateway"]);
        let defaults = load_text("", Mode::Gateway, &registered()).unwrap();
        assert_eq!(defaults.section::<Policy>().unwrap(), Policy::default());
    }

    #[test]
    fn the_key_tables_are_built_once_and_a_registration_rebuilds_them() {
        let built = || KEY_TABLES_BUILT.with(std::cell::Cell::get);
        let before = built();
        let sections = Sections::new().with::<Probe>();
        assert!(sections.keys().contains(&"probe.limit".to_owned()));
        assert_eq!(coerce("probe.path", "42", &sections), json!("42"));
        // A start-up's steps: each --set, the environment layer, the load, then a view.
        let sets = ["probe.path=42".to_owned(), "probe.limit=2".to_owned()];
        let flags = crate::launch::parse_sets(&sets, &sections).unwrap();
        let dir = tempfile::tempdir().unwrap();
        let env = [
            ("SIMLOCK_PROBE__PATH", "7"),
            ("SIMLOCK_LEASE__MAX_TTL_MS", "7200000"),
        ];
        let loaded =
            tests::with_env(&env, || load(dir.path(), Mode::Worker, &flags, &sections)).unwrap();
        assert_eq!(
            loaded.section::<Probe>().unwrap().path.as_deref(),
            Some("42")
        );
        assert_eq!(loaded.config.lease.max_ttl_ms, 7_200_000);
        let _ = load_text("[probe]\nlimit = 2", Mode::Worker, &sections).unwrap();
        let _ = view(&DaemonConfig::default(), &sections, &[], Mode::Worker);
        let _ = (
            sections.modes_of("probe.limit"),
            sections.owner_of("probe.limit"),
        );
        let _ = (sections.default_values(), sections.layout_problems());
        assert_eq!(built() - before, 1, "every step reads the one table");
        // A section registered after a first use is known: the tables start afresh.
        let more = sections.clone().with::<Policy>();
        assert!(more.keys().contains(&"gateway.policy".to_owned()));
        assert_eq!(more.modes_of("gateway.policy"), Some(vec![Mode::Gateway]));
        assert_eq!(more.defaults()["gateway"], json!({"policy": "first"}));
        let loaded = load_text("[gateway]\npolicy = \"last\"", Mode::Gateway, &more).unwrap();
        assert!(loaded.warnings.is_empty(), "{:?}", loaded.warnings);
        // The sections it was cloned from keep their own.
        assert!(!sections.keys().contains(&"gateway.policy".to_owned()));
    }

    #[test]
    fn a_sections_bad_value_and_its_check_fail_naming_the_key() {
        let err = load_text("[probe]\nlimit = \"many\"", Mode::Worker, &registered())
            .unwrap_err()
            .to_string();
        assert!(err.contains("probe.limit"), "{err}");
        let err = load_text("[probe]\nlimit = 0", Mode::Worker, &registered())
            .unwrap_err()
            .to_string();
        assert_eq!(err, "configuration: probe.limit must be above 0");
        // A section's table given as something else fails naming it, on either daemon.
        for mode in [Mode::Worker, Mode::Gateway] {
            let err = load_text("probe = 5", mode, &registered())
                .unwrap_err()
                .to_string();
            assert!(err.contains("probe: invalid type"), "{err}");
        }
        assert!(
            load_text("[probe]\nlimit = 1", Mode::Worker, &registered()).is_ok(),
            "one past the bound"
        );
        // The check reads the daemon's own section.
        let toml = "[lease]\ndefaultTtlMs = 1\nmaxTtlMs = 2\n[probe]\nlimit = 3";
        let err = load_text(toml, Mode::Worker, &registered())
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("probe.limit") && err.contains("lease.maxTtlMs"),
            "{err}"
        );
        // A gateway does not read the section: not checked, warned.
        let loaded = load_text("[probe]\nlimit = 0", Mode::Gateway, &registered()).unwrap();
        assert_eq!(
            loaded.warnings,
            ["probe.limit is a worker setting; a gateway ignores it"]
        );
    }

    #[test]
    fn a_key_of_the_other_mode_is_warned() {
        let toml = "[gateway]\nmirror = true\nlocal = 4\npolicy = \"last\"";
        let gateway = load_text(toml, Mode::Gateway, &registered()).unwrap();
        assert_eq!(
            gateway.warnings,
            ["gateway.local is a worker setting; a gateway ignores it"]
        );
        let worker = load_text(toml, Mode::Worker, &registered()).unwrap();
        assert_eq!(
            worker.warnings,
            ["gateway.policy is a gateway setting; a worker ignores it"]
        );
    }

    #[test]
    fn a_sections_text_key_and_variables_come_from_the_environment() {
        assert_eq!(coerce("probe.path", "42", &registered()), json!("42"));
        assert_eq!(coerce("probe.limit", "42", &registered()), json!(42));
        let env = [
            ("SIMLOCK_PROBE__PATH", "007"),
            ("SIMLOCK_PROBE__LIMIT", "9"),
        ];
        let table: Value =
            tests::with_env(&env, || environment_layer(&registered()).extract().unwrap());
        assert_eq!(table, json!({"probe": {"path": "007", "limit": 9}}));
        // Without the section, its variables are no configuration.
        let table: Value = tests::with_env(&env, || {
            environment_layer(&Sections::new()).extract().unwrap()
        });
        assert_eq!(table, json!({}));
    }

    #[test]
    fn the_view_shows_the_sections_of_the_tables_a_daemon_reads() {
        let probe = Probe {
            limit: 7,
            path: None,
        };
        let values = [section_value(&probe)];
        let worker = view(
            &DaemonConfig::default(),
            &registered(),
            &values,
            Mode::Worker,
        );
        assert_eq!(worker.settings["probe"], json!({"limit": 7, "path": null}));
        // Sections sharing a table are merged; one left out shows its defaults.
        assert_eq!(worker.settings["gateway"]["mirror"], json!(false));
        assert_eq!(worker.settings["gateway"]["policy"], json!("first"));
        let mut config = DaemonConfig::default();
        config.gateway.token = Some("slk_secret".into());
        let gateway = view(&config, &registered(), &values, Mode::Gateway);
        assert!(!gateway.settings.contains_key("probe"));
        assert_eq!(gateway.settings["gateway"]["local"], json!(null));
        assert_eq!(gateway.settings["gateway"]["token"], json!("[redacted]"));
    }
}
