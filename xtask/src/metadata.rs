//! The slice of `cargo metadata --format-version 1 --no-deps` that xtask needs: workspace members,
//! their targets and their declared dependencies.

use std::{collections::BTreeSet, fmt, path::PathBuf};

use anyhow::{Context, Result, bail};
use serde_json::Value;

use crate::cmd;

/// The workspace members, in the order cargo lists them.
#[derive(Debug, Clone)]
pub(crate) struct Workspace {
    pub(crate) packages: Vec<Package>,
}

#[derive(Debug, Clone)]
pub(crate) struct Package {
    pub(crate) name: String,
    #[cfg_attr(
        not(test),
        allow(dead_code, reason = "only the tidy and layering tests read it")
    )]
    pub(crate) manifest_path: PathBuf,
    pub(crate) targets: Vec<Target>,
    pub(crate) dependencies: Vec<Dependency>,
}

#[derive(Debug, Clone)]
pub(crate) struct Target {
    pub(crate) name: String,
    /// `lib`, `bin`, `test`, `bench`, `example`, `custom-build`, ...
    pub(crate) kinds: Vec<String>,
}

/// One declared dependency. `name` is the package name, even when the dependency is renamed.
#[derive(Debug, Clone)]
pub(crate) struct Dependency {
    pub(crate) name: String,
    pub(crate) kind: DepKind,
    /// Declared with a `path` (directly or through `workspace = true`): how workspace crates depend
    /// on each other.
    pub(crate) is_path: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) enum DepKind {
    Normal,
    Build,
    Dev,
}

impl fmt::Display for DepKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Normal => "normal",
            Self::Build => "build",
            Self::Dev => "dev",
        })
    }
}

impl Workspace {
    /// Runs `cargo metadata --format-version 1 --no-deps` in the workspace root and parses it.
    pub(crate) fn load() -> Result<Self> {
        let mut command = cmd::cargo(["metadata", "--format-version", "1", "--no-deps"]);
        let shown = cmd::display(&command);
        let output = command
            .output()
            .with_context(|| format!("could not start `{shown}`"))?;
        if !output.status.success() {
            bail!(
                "`{shown}` failed ({}):\n{}",
                output.status,
                String::from_utf8_lossy(&output.stderr)
            );
        }
        let json: Value = serde_json::from_slice(&output.stdout)
            .with_context(|| format!("`{shown}` printed invalid JSON"))?;
        Self::from_json(&json).with_context(|| format!("unexpected output from `{shown}`"))
    }

    /// Parses the JSON printed by `cargo metadata --format-version 1` (with or without `--no-deps`),
    /// keeping the workspace members only.
    pub(crate) fn from_json(json: &Value) -> Result<Self> {
        let members: BTreeSet<&str> = array(json, "workspace_members")?
            .iter()
            .filter_map(Value::as_str)
            .collect();
        let mut packages = Vec::new();
        for package in array(json, "packages")? {
            if !members.contains(string(package, "id")?) {
                continue;
            }
            let name = string(package, "name")?.to_owned();
            let parse = || -> Result<Package> {
                let targets = array(package, "targets")?
                    .iter()
                    .map(|target| {
                        Ok(Target {
                            name: string(target, "name")?.to_owned(),
                            kinds: array(target, "kind")?
                                .iter()
                                .filter_map(Value::as_str)
                                .map(str::to_owned)
                                .collect(),
                        })
                    })
                    .collect::<Result<_>>()?;
                let dependencies = array(package, "dependencies")?
                    .iter()
                    .map(|dependency| {
                        let kind = match dependency.get("kind").and_then(Value::as_str) {
                            None | Some("normal") => DepKind::Normal,
                            Some("build") => DepKind::Build,
                            Some("dev") => DepKind::Dev,
                            Some(other) => bail!("unknown dependency kind `{other}`"),
                        };
                        Ok(Dependency {
                            name: string(dependency, "name")?.to_owned(),
                            kind,
                            is_path: dependency.get("path").is_some_and(Value::is_string),
                        })
                    })
                    .collect::<Result<_>>()?;
                Ok(Package {
                    name: name.clone(),
                    manifest_path: PathBuf::from(string(package, "manifest_path")?),
                    targets,
                    dependencies,
                })
            };
            packages.push(parse().with_context(|| format!("in package `{name}`"))?);
        }
        Ok(Self { packages })
    }

    pub(crate) fn package(&self, name: &str) -> Option<&Package> {
        self.packages.iter().find(|package| package.name == name)
    }
}

impl Package {
    /// Whether the package has a target called `name` of kind `kind` (`bench`, `bin`, `test`, ...).
    pub(crate) fn has_target(&self, kind: &str, name: &str) -> bool {
        self.targets
            .iter()
            .any(|target| target.name == name && target.kinds.iter().any(|k| k == kind))
    }
}

fn array<'a>(value: &'a Value, key: &str) -> Result<&'a Vec<Value>> {
    value
        .get(key)
        .and_then(Value::as_array)
        .with_context(|| format!("missing array `{key}`"))
}

fn string<'a>(value: &'a Value, key: &str) -> Result<&'a str> {
    value
        .get(key)
        .and_then(Value::as_str)
        .with_context(|| format!("missing string `{key}`"))
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::{DepKind, Workspace};

    #[test]
    fn parses_members_targets_and_dependency_kinds() {
        let json = json!({
            "workspace_members": ["a 0.1.0 (path+file:///w/a)"],
            "packages": [
                {
                    "id": "a 0.1.0 (path+file:///w/a)",
                    "name": "a",
                    "manifest_path": "/w/a/Cargo.toml",
                    "targets": [{ "name": "a", "kind": ["lib"] }, { "name": "speed", "kind": ["bench"] }],
                    "dependencies": [
                        { "name": "b", "kind": null, "path": "/w/b" },
                        { "name": "c", "kind": "dev", "path": "/w/c" },
                        { "name": "serde", "kind": "build" }
                    ]
                },
                { "id": "not-a-member", "name": "z", "manifest_path": "/z", "targets": [], "dependencies": [] }
            ]
        });
        let workspace = Workspace::from_json(&json).unwrap();
        assert_eq!(workspace.packages.len(), 1);
        let a = workspace.package("a").unwrap();
        assert!(a.has_target("bench", "speed"));
        assert!(!a.has_target("bench", "a"));
        let deps: Vec<_> = a
            .dependencies
            .iter()
            .map(|d| (d.name.as_str(), d.kind, d.is_path))
            .collect();
        assert_eq!(
            deps,
            [
                ("b", DepKind::Normal, true),
                ("c", DepKind::Dev, true),
                ("serde", DepKind::Build, false)
            ]
        );
    }
}
