//! `cargo xtask deps`: every dependency a manifest names is used, and every version the
//! workspace states is depended on.
//!
//! A member's dependency is used when the member's Rust files (every target's, `build.rs` and
//! `tests/` included; nested packages such as `fuzz/` excluded) name it as a path (`name::`),
//! in a `use` or in an `extern crate`, by its library name or its rename. That is the same text
//! search cargo-machete makes, done here so that CI needs no extra tool built for it (a build of
//! cargo-machete took 8 minutes on a loaded 2-core machine, of CI's 25). A dependency needed for
//! another reason (a feature it turns on in a shared crate, say) is listed with that reason in
//! `[package.metadata.xtask-deps] used = ["name"]`.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use anyhow::{Context, Result, bail};
use serde_json::Value;

use crate::cmd;

/// One declared dependency of a member: the name code uses, and the manifest line's kind.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Declared {
    /// The package name.
    package: String,
    /// The name code refers to it by (its rename, or its library name), `-` as `_`.
    ident: String,
    kind: &'static str,
}

#[derive(Debug)]
struct Member {
    name: String,
    dir: PathBuf,
    declared: Vec<Declared>,
    /// `[package.metadata.xtask-deps] used`.
    allowed: BTreeSet<String>,
}

pub(crate) fn run() -> Result<ExitCode> {
    let members = load()?;
    let mut unused = Vec::new();
    let mut checked = 0usize;
    for member in &members {
        let source = sources(&member.dir)?;
        for dependency in &member.declared {
            checked += 1;
            if member.allowed.contains(&dependency.package) {
                continue;
            }
            if !names(&source, &dependency.ident) {
                unused.push(format!(
                    "{}: {} dependency `{}` is not used ({})",
                    member.name,
                    dependency.kind,
                    dependency.package,
                    member.dir.join("Cargo.toml").display()
                ));
            }
        }
    }
    let stated = workspace_dependencies()?;
    let depended: BTreeSet<&str> = members
        .iter()
        .flat_map(|m| m.declared.iter().map(|d| d.package.as_str()))
        .collect();
    for name in &stated {
        if !depended.contains(name.as_str()) {
            unused.push(format!(
                "workspace: `{name}` is in [workspace.dependencies] but no member depends on it"
            ));
        }
    }
    if unused.is_empty() {
        println!(
            "unused dependencies: none ({} members, {checked} dependencies, {} workspace versions checked)",
            members.len(),
            stated.len()
        );
        Ok(ExitCode::SUCCESS)
    } else {
        for line in &unused {
            eprintln!("unused dependency: {line}");
        }
        eprintln!(
            "unused dependencies: {} found; remove them (or list one in [package.metadata.xtask-deps] used, saying why)",
            unused.len()
        );
        Ok(ExitCode::FAILURE)
    }
}

fn load() -> Result<Vec<Member>> {
    let mut command = cmd::cargo(["metadata", "--format-version", "1", "--no-deps", "--locked"]);
    let output = command.output().context("cargo metadata")?;
    if !output.status.success() {
        bail!(
            "cargo metadata failed: {}",
            String::from_utf8_lossy(&output.stderr)
        );
    }
    let json: Value = serde_json::from_slice(&output.stdout)?;
    members_from(&json)
}

fn members_from(json: &Value) -> Result<Vec<Member>> {
    let ids: BTreeSet<&str> = json["workspace_members"]
        .as_array()
        .context("workspace_members")?
        .iter()
        .filter_map(Value::as_str)
        .collect();
    let mut members = Vec::new();
    for package in json["packages"].as_array().context("packages")? {
        if !package["id"].as_str().is_some_and(|id| ids.contains(id)) {
            continue;
        }
        let manifest = PathBuf::from(package["manifest_path"].as_str().context("manifest_path")?);
        let dir = manifest
            .parent()
            .context("a manifest's directory")?
            .to_owned();
        let mut declared = Vec::new();
        for dependency in package["dependencies"].as_array().context("dependencies")? {
            let name = dependency["name"].as_str().context("a dependency name")?;
            let ident = dependency["rename"]
                .as_str()
                .unwrap_or(name)
                .replace('-', "_");
            let kind = match dependency["kind"].as_str() {
                Some("dev") => "dev",
                Some("build") => "build",
                _ => "normal",
            };
            let entry = Declared {
                package: name.to_owned(),
                ident,
                kind,
            };
            // A crate listed as both normal and dev counts once.
            if !declared
                .iter()
                .any(|d: &Declared| d.package == entry.package)
            {
                declared.push(entry);
            }
        }
        let allowed = package["metadata"]["xtask-deps"]["used"]
            .as_array()
            .map(|list| {
                list.iter()
                    .filter_map(Value::as_str)
                    .map(str::to_owned)
                    .collect()
            })
            .unwrap_or_default();
        members.push(Member {
            name: package["name"].as_str().unwrap_or_default().to_owned(),
            dir,
            declared,
            allowed,
        });
    }
    Ok(members)
}

/// The external crates under `[workspace.dependencies]` in the root manifest (workspace crates,
/// declared by `path`, may wait there for their first user).
fn workspace_dependencies() -> Result<BTreeSet<String>> {
    let text = std::fs::read_to_string(cmd::workspace_root().join("Cargo.toml"))?;
    let mut names = BTreeSet::new();
    let mut inside = false;
    for line in text.lines() {
        let line = line.trim();
        if line.starts_with('[') {
            inside = line == "[workspace.dependencies]";
            continue;
        }
        if inside
            && let Some((name, _)) = line.split_once('=')
            && !line.starts_with('#')
            && !line.contains("path =")
        {
            names.insert(name.trim().to_owned());
        }
    }
    Ok(names)
}

/// The Rust files of the package in `dir`, concatenated; a directory with its own manifest is
/// another package and is skipped, as is build output.
fn sources(dir: &Path) -> Result<String> {
    let mut text = String::new();
    let mut pending = vec![dir.to_owned()];
    while let Some(current) = pending.pop() {
        for entry in std::fs::read_dir(&current)? {
            let entry = entry?;
            let path = entry.path();
            let name = entry.file_name();
            let name = name.to_string_lossy();
            if entry.file_type()?.is_dir() {
                if name != "target" && !name.starts_with('.') && !path.join("Cargo.toml").exists() {
                    pending.push(path);
                }
            } else if path.extension().is_some_and(|ext| ext == "rs") {
                text.push_str(&std::fs::read_to_string(&path)?);
                text.push('\n');
            }
        }
    }
    Ok(text)
}

/// Whether `source` refers to the crate `ident`: `ident::`, `use ident`, `extern crate ident`,
/// each starting at a word boundary.
fn names(source: &str, ident: &str) -> bool {
    let word = |at: usize| {
        source[..at]
            .chars()
            .next_back()
            .is_none_or(|c| !(c.is_alphanumeric() || c == '_'))
    };
    let ends = |rest: &str| {
        rest.chars()
            .next()
            .is_none_or(|c| !(c.is_alphanumeric() || c == '_'))
    };
    source.match_indices(ident).any(|(at, _)| {
        if !word(at) {
            return false;
        }
        let rest = &source[at + ident.len()..];
        if rest.starts_with("::") {
            return true;
        }
        let before = source[..at].trim_end();
        (before.ends_with("use") || before.ends_with("extern crate")) && ends(rest)
    })
}

#[cfg(test)]
mod tests {
    use super::names;

    #[test]
    fn a_crate_is_named_by_a_path_a_use_or_an_extern_crate() {
        assert!(names("let x = serde_json::json!({});", "serde_json"));
        assert!(names("use tokio;\n", "tokio"));
        assert!(names("pub use rustls::ClientConfig;", "rustls"));
        assert!(names("extern crate libc;", "libc"));
        assert!(names("#[tokio::test]", "tokio"));
        assert!(!names("use serde_json::Value;", "serde"));
        assert!(!names("let my_tokio::x = 1; // mytokio::", "tokio"));
        assert!(!names("the tokio runtime", "tokio"));
        assert!(!names("use tokio_util::codec;", "tokio"));
    }

    #[test]
    fn the_workspace_uses_every_dependency_it_declares() {
        let members = super::load().unwrap();
        assert!(members.len() > 5);
        for member in &members {
            let source = super::sources(&member.dir).unwrap();
            for dependency in &member.declared {
                assert!(
                    member.allowed.contains(&dependency.package)
                        || names(&source, &dependency.ident),
                    "{}: `{}` is not used",
                    member.name,
                    dependency.package
                );
            }
        }
    }
}
