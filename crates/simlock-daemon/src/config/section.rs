//! A configuration section a crate above the daemon owns (ADR 0026): its type, defaults, keys and
//! rules live in that crate; the daemon's loader only layers, extracts and checks it.
//!
//! A binary registers every section of simlock in one [`Sections`] (those its own daemon reads
//! and those the other reads, so keys of the other mode are warned about as such); the loader
//! extracts each registered section from the merged layers, checks those this daemon reads, and
//! hands them out typed through [`Loaded::section`](super::Loaded::section).

use std::any::{Any, TypeId};
use std::sync::{Arc, OnceLock};

use figment::Figment;
use serde::Serialize;
use serde::de::DeserializeOwned;
use serde_json::Value;
use simlock_contract::model::Mode;

use super::{DaemonConfig, Keys};

/// Both daemons read the section.
pub const BOTH: &[Mode] = &[Mode::Worker, Mode::Gateway];
/// Only a worker reads the section.
pub const WORKER: &[Mode] = &[Mode::Worker];
/// Only a gateway reads the section.
pub const GATEWAY: &[Mode] = &[Mode::Gateway];

/// A configuration section owned by the crate that reads it.
///
/// Its defaults are its [`Default`], its known keys the leaves of its serialised default (an
/// unset `Option` is a leaf), its rules its [`Section::check`].
pub trait Section: Serialize + DeserializeOwned + Default + Clone + Send + Sync + 'static {
    /// The top-level table it reads (`drivers`, `agentDevice`). Two sections may share a
    /// table when their keys are disjoint (the daemon's uplink keys and the fleet's under
    /// `gateway`); [`Sections::layout_problems`] names those that are not.
    const KEY: &'static str;
    /// The daemons that read it: [`BOTH`], [`WORKER`] or [`GATEWAY`].
    const MODES: &'static [Mode];
    /// Keys below [`Section::KEY`] that only one of [`Section::MODES`] reads
    /// (`("command", Mode::Worker)` for `agentDevice.command`).
    const ONLY: &'static [(&'static str, Mode)] = &[];
    /// Keys below [`Section::KEY`] that hold text though their default is unset, so a value
    /// given in the environment or a flag is taken as it is.
    const TEXT_KEYS: &'static [&'static str] = &[];
    /// Keys below [`Section::KEY`] that hold maps whose entries are the user's own names.
    const OPEN_MAPS: &'static [&'static str] = &[];

    /// Keys below [`Section::KEY`] whose entries all have one shape: a list of tables
    /// (`virtual.models`) or one of [`Section::OPEN_MAPS`] whose values are tables
    /// (`exec.tools`). Each [`EntryShape`] gives a sample entry: its serialised keys are the
    /// keys an entry may have, and the loader warns about any other key of an entry, naming it
    /// with the entry's place (`virtual.models[2].alias`, `exec.tools.x.arg`).
    fn entry_shapes() -> Vec<EntryShape> {
        Vec::new()
    }

    /// Checks what no single value's type can, on a daemon of `mode` (one of
    /// [`Section::MODES`]); `daemon` is the daemon's own section (`lease`, `http`, …).
    ///
    /// # Errors
    /// A [`SectionError`] naming the keys it refuses.
    fn check(&self, daemon: &DaemonConfig, mode: Mode) -> Result<(), SectionError> {
        let _ = (daemon, mode);
        Ok(())
    }

    /// What is allowed but likely a mistake, on a daemon of `mode` (one of
    /// [`Section::MODES`]), checked after [`Section::check`] passed: each a warning start-up
    /// logs, naming the keys.
    fn warnings(&self, daemon: &DaemonConfig, mode: Mode) -> Vec<String> {
        let _ = (daemon, mode);
        Vec::new()
    }
}

/// A section's refusal: the message names the keys (`drivers.ios.callTimeoutMs must be above
/// 0`); start-up fails with it.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{message}")]
pub struct SectionError {
    /// What is wrong, naming the keys.
    pub message: String,
}

impl SectionError {
    /// A refusal with `message`.
    pub fn new(message: impl Into<String>) -> Self {
        Self {
            message: message.into(),
        }
    }
}

/// Refuses the first of `values` (a key and its value) that is 0, naming its key:
/// `drivers.ios.callTimeoutMs must be above 0`. The one check of every duration, interval,
/// count or multiplier that a zero would stall or disable.
///
/// # Errors
/// A [`SectionError`] naming the first key whose value is 0.
pub fn above_zero(values: &[(&str, u64)]) -> Result<(), SectionError> {
    match values.iter().find(|(_, value)| *value == 0) {
        Some((key, _)) => Err(SectionError::new(format!("{key} must be above 0"))),
        None => Ok(()),
    }
}

/// The shape of every entry of a key holding a list of tables or a map of the user's names to
/// tables (see [`Section::entry_shapes`]): the keys of a sample entry, as it serialises.
#[derive(Debug, Clone, PartialEq)]
pub struct EntryShape {
    /// The key below [`Section::KEY`] (`models` for `virtual.models`).
    pub(super) key: &'static str,
    /// The sample entry, serialised.
    pub(super) sample: Value,
}

impl EntryShape {
    /// The entries of `key` (below [`Section::KEY`]) are shaped as `sample` serialises: its
    /// keys, an unset `Option` included, are the keys an entry may have. Build `sample` with
    /// every field named (no `..`), so that a new field is a new key here too.
    pub fn of<T: Serialize>(key: &'static str, sample: &T) -> Self {
        Self {
            key,
            sample: serde_json::to_value(sample).unwrap_or(Value::Null),
        }
    }
}

/// A section as the loader holds it, typed but behind `Any`.
pub(super) type Held = Arc<dyn Any + Send + Sync>;

/// One registered section, its type erased.
#[derive(Clone, Copy)]
pub(super) struct Entry {
    pub(super) key: &'static str,
    pub(super) modes: &'static [Mode],
    pub(super) only: &'static [(&'static str, Mode)],
    pub(super) text_keys: &'static [&'static str],
    pub(super) open_maps: &'static [&'static str],
    pub(super) entry_shapes: fn() -> Vec<EntryShape>,
    pub(super) type_id: TypeId,
    pub(super) type_name: &'static str,
    pub(super) defaults: fn() -> Value,
    pub(super) extract: fn(&Figment) -> Result<Held, Box<figment::Error>>,
    pub(super) check: fn(&Held, &DaemonConfig, Mode) -> Result<(), SectionError>,
    pub(super) warnings: fn(&Held, &DaemonConfig, Mode) -> Vec<String>,
    pub(super) value: fn(&Held) -> Value,
}

impl Entry {
    fn of<S: Section>() -> Self {
        Self {
            key: S::KEY,
            modes: S::MODES,
            only: S::ONLY,
            text_keys: S::TEXT_KEYS,
            open_maps: S::OPEN_MAPS,
            entry_shapes: S::entry_shapes,
            type_id: TypeId::of::<S>(),
            type_name: std::any::type_name::<S>(),
            defaults: || serde_json::to_value(S::default()).unwrap_or(Value::Null),
            extract: |figment| {
                // A focus on a value that is no table would read as the defaults.
                if let Ok(value) = figment.find_value(S::KEY)
                    && value.as_dict().is_none()
                {
                    return Err(Box::new(figment::Error::from(
                        figment::error::Kind::InvalidType(value.to_actual(), "a table".into()),
                    )));
                }
                // Focused, an error's path is below the table; the loader puts the table first.
                let section: S = figment.focus(S::KEY).extract().map_err(Box::new)?;
                Ok(Arc::new(section))
            },
            check: |held, daemon, mode| match held.downcast_ref::<S>() {
                Some(section) => section.check(daemon, mode),
                None => Err(SectionError::new(format!(
                    "{} was not extracted as its own section",
                    S::KEY
                ))),
            },
            warnings: |held, daemon, mode| {
                held.downcast_ref::<S>()
                    .map(|section| section.warnings(daemon, mode))
                    .unwrap_or_default()
            },
            value: |held| {
                held.downcast_ref::<S>()
                    .and_then(|s| serde_json::to_value(s).ok())
                    .unwrap_or(Value::Null)
            },
        }
    }

    /// The modes that read `relative` (a key below [`Entry::key`]).
    pub(super) fn modes_of(&self, relative: &str) -> Vec<Mode> {
        match self.only.iter().find(|(k, _)| *k == relative) {
            Some((_, mode)) => vec![*mode],
            None => self.modes.to_vec(),
        }
    }
}

/// The sections a binary registers: every section of simlock, its own daemon's and the
/// other's (see the module docs).
///
/// The key tables the loader reads (every known key, the daemons reading each, the text keys,
/// the defaults) are built from the registered sections at their first use and kept; a binary
/// builds its `Sections` once and hands the same one to every step.
#[derive(Clone, Default)]
pub struct Sections {
    pub(super) entries: Vec<Entry>,
    /// The key tables of `entries`, built at their first use; a registration starts afresh.
    keys: OnceLock<Keys>,
}

impl std::fmt::Debug for Sections {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_list()
            .entries(self.entries.iter().map(|e| e.type_name))
            .finish()
    }
}

impl Sections {
    /// No sections: the daemon's own only.
    pub fn new() -> Self {
        Self::default()
    }

    /// Registers `S`.
    #[must_use]
    pub fn with<S: Section>(mut self) -> Self {
        if !self.entries.iter().any(|e| e.type_id == TypeId::of::<S>()) {
            self.entries.push(Entry::of::<S>());
            self.keys = OnceLock::new();
        }
        self
    }

    /// The key tables of the registered sections, built at the first call and kept.
    pub(super) fn key_table(&self) -> &Keys {
        self.keys.get_or_init(|| Keys::of(&self.entries))
    }

    /// The registered sections' tables, in registration order, each once.
    #[cfg(test)]
    pub(crate) fn tables(&self) -> Vec<&'static str> {
        let mut seen = std::collections::BTreeSet::new();
        self.entries
            .iter()
            .map(|e| e.key)
            .filter(|k| seen.insert(*k))
            .collect()
    }

    /// The one list of known keys: the daemon's own and every registered section's (a key
    /// holding a map of the user's names, such as `exec.tools`, is one key).
    pub fn keys(&self) -> Vec<String> {
        self.key_table().known.keys().cloned().collect()
    }

    /// The section that holds `key` (one of [`Sections::keys`], or an entry of an open map), as
    /// [`std::any::type_name`] names its type (`simlock_daemon::config::DaemonConfig` for the
    /// daemon's own keys), `None` when it is no key. The configuration docs' owner table is
    /// checked against it.
    pub fn owner_of(&self, key: &str) -> Option<&'static str> {
        self.key_table().get(key).map(|known| known.owner)
    }

    /// What is wrong with how the registered sections lay out their keys, empty when nothing
    /// is: two sections holding one key (sections may share a table, such as `gateway`, only
    /// with disjoint keys; the daemon's own section counts), a key inside another section's
    /// key, or a key a section lists in [`Section::ONLY`], [`Section::TEXT_KEYS`] or
    /// [`Section::OPEN_MAPS`] that is not one of its keys (a text key must also be unset by
    /// default, and a mode alone reads a key only of a section it reads), or a key of
    /// [`Section::entry_shapes`] that is not one of its lists or open maps, or whose sample
    /// entry is no table. The daemon's own
    /// lists of worker-only and text keys are checked the same way. A binary's tests assert
    /// it is empty for the sections it registers.
    pub fn layout_problems(&self) -> Vec<String> {
        super::layout_problems(self)
    }

    /// The keys an entry of `key` may have (a key of [`Section::entry_shapes`], such as
    /// `virtual.models` or `exec.tools`), below the entry; `None` when its entries have no
    /// one shape. The configuration docs' entry tables are checked against it.
    pub fn entry_keys(&self, key: &str) -> Option<Vec<String>> {
        self.key_table()
            .shapes
            .get(key)
            .map(|shape| shape.keys.iter().cloned().collect())
    }

    /// The daemons that read `key` (one of [`Sections::keys`], or an entry of an open map),
    /// `None` when it is no key.
    pub fn modes_of(&self, key: &str) -> Option<Vec<Mode>> {
        self.key_table().modes(key)
    }

    /// The whole default configuration: the daemon's own section and every registered
    /// section's defaults.
    pub fn default_values(&self) -> Value {
        let mut all = match serde_json::to_value(DaemonConfig::default()) {
            Ok(Value::Object(map)) => map,
            _ => serde_json::Map::new(),
        };
        for (table, value) in self.defaults() {
            merge_into(&mut all, &table, value);
        }
        Value::Object(all)
    }

    /// Every registered section's defaults, merged by table (the tables of sections sharing
    /// one, such as `gateway`, hold both sections' keys).
    pub fn defaults(&self) -> serde_json::Map<String, Value> {
        self.key_table().defaults.clone()
    }
}

/// Puts `value` at `table` in `out`, merging objects key by key.
pub(super) fn merge_into(out: &mut serde_json::Map<String, Value>, table: &str, value: Value) {
    match (out.get_mut(table), value) {
        (Some(Value::Object(have)), Value::Object(more)) => {
            for (k, v) in more {
                have.insert(k, v);
            }
        }
        (_, value) => {
            out.insert(table.to_owned(), value);
        }
    }
}

/// A section's value as a daemon was started with it, for [`super::view`].
#[derive(Debug, Clone)]
pub struct SectionValue {
    pub(super) type_id: TypeId,
    pub(super) value: Value,
}

/// `section` as [`super::view`] shows it.
pub fn section_value<S: Section>(section: &S) -> SectionValue {
    SectionValue {
        type_id: TypeId::of::<S>(),
        value: serde_json::to_value(section).unwrap_or(Value::Null),
    }
}
