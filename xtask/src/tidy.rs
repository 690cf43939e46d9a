//! Tidy checks, run as ordinary tests so that `cargo test` and `cargo xtask ci` enforce them: every
//! Rust file opens with a `//!` doc line, every package manifest inherits the workspace lints and
//! takes every dependency from `[workspace.dependencies]`, and `Cargo.lock` is tracked.

use std::{
    fs,
    path::{Path, PathBuf},
    process::Command,
};

use crate::cmd::workspace_root;

/// The directories holding the workspace's own code.
const CODE_DIRS: &[&str] = &["crates", "bins", "xtask", "fuzz"];

/// Every file under `CODE_DIRS` whose name satisfies `keep`, skipping build output (`target/`,
/// including `fuzz/target/`), `node_modules/` and hidden directories. Sorted, relative to the root.
fn files(keep: impl Fn(&Path) -> bool) -> Vec<PathBuf> {
    let root = workspace_root();
    let mut found = Vec::new();
    let mut pending: Vec<PathBuf> = CODE_DIRS.iter().map(|dir| root.join(dir)).collect();
    while let Some(dir) = pending.pop() {
        let Ok(entries) = fs::read_dir(&dir) else {
            continue;
        };
        for entry in entries {
            let entry = entry.unwrap();
            let path = entry.path();
            let name = entry.file_name();
            let name = name.to_string_lossy();
            let file_type = entry.file_type().unwrap();
            if file_type.is_dir() {
                if name != "target" && name != "node_modules" && !name.starts_with('.') {
                    pending.push(path);
                }
            } else if keep(&path) {
                found.push(path.strip_prefix(&root).unwrap().to_path_buf());
            }
        }
    }
    found.sort();
    found
}

fn read(relative: &Path) -> String {
    fs::read_to_string(workspace_root().join(relative))
        .unwrap_or_else(|error| panic!("{}: cannot read: {error}", relative.display()))
}

#[track_caller]
fn assert_no_problems(what: &str, problems: &[String]) {
    assert!(problems.is_empty(), "{what}:\n  {}", problems.join("\n  "));
}

#[test]
fn rust_files_start_with_a_doc_line() {
    let rust_files = files(|path| path.extension().is_some_and(|ext| ext == "rs"));
    assert!(
        rust_files
            .iter()
            .any(|path| path.ends_with("xtask/src/tidy.rs")),
        "the walk found no Rust files"
    );
    let problems: Vec<String> = rust_files
        .iter()
        .filter(|path| !read(path).starts_with("//!"))
        .map(|path| {
            format!(
                "{}:1: does not start with a `//!` line saying what the file is for",
                path.display()
            )
        })
        .collect();
    assert_no_problems("Rust files without a module doc line", &problems);
}

/// The sans-IO cores: the link's state machine and the fleet's, each a crate and the module
/// directory holding it. They take time and IO from their shells: no runtime, no clock.
const SANS_IO_CORES: &[(&str, &str)] = &[("simlock-link", "proto"), ("simlock-fleet", "state")];

/// Every sans-IO core imports no runtime and reads no clock.
#[test]
fn the_sans_io_cores_import_no_runtime_and_read_no_clock() {
    let forbidden = [
        "tokio",
        "futures",
        "Instant::now",
        "SystemTime::now",
        "std::thread",
        "parking_lot",
    ];
    for &(krate, dir) in SANS_IO_CORES {
        let core = files(|path| {
            path.extension().is_some_and(|ext| ext == "rs")
                && path.components().any(|c| c.as_os_str() == krate)
                && path.components().any(|c| c.as_os_str() == dir)
        });
        assert!(!core.is_empty(), "found the {krate} core in `{dir}`");
        let problems: Vec<String> = core
            .iter()
            .flat_map(|path| {
                let text = read(path);
                forbidden
                    .iter()
                    .filter(|word| {
                        text.lines().any(|line| {
                            !line.trim_start().starts_with("//") && line.contains(*word)
                        })
                    })
                    .map(|word| {
                        format!(
                            "{}: uses `{word}`; the {krate} core takes time and IO from its shell",
                            path.display()
                        )
                    })
                    .collect::<Vec<_>>()
            })
            .collect();
        assert_no_problems("a sans-IO core reaches outside itself", &problems);
    }
}

/// Crates whose top-level modules must not import each other in a cycle.
const ACYCLIC_CRATES: &[&str] = &["simlock-fleet"];

/// The top-level modules of `crate::` paths in `text` (outside comments).
fn crate_modules(text: &str) -> std::collections::BTreeSet<String> {
    let mut found = std::collections::BTreeSet::new();
    for line in text.lines().filter(|l| !l.trim_start().starts_with("//")) {
        let mut rest = line;
        while let Some(at) = rest.find("crate::") {
            rest = &rest[at + "crate::".len()..];
            let name: String = rest
                .chars()
                .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                .collect();
            if !name.is_empty() {
                found.insert(name);
            }
        }
    }
    found
}

/// No two top-level modules of these crates depend on each other, directly or through others:
/// each crate is layered inside too.
#[test]
fn the_layered_crates_have_no_module_import_cycle() {
    for &krate in ACYCLIC_CRATES {
        let src = Path::new("crates").join(krate).join("src");
        let sources: Vec<PathBuf> = files(|path| path.extension().is_some_and(|ext| ext == "rs"))
            .into_iter()
            .filter(|path| path.starts_with(&src))
            .collect();
        let mut edges: std::collections::BTreeMap<String, std::collections::BTreeSet<String>> =
            std::collections::BTreeMap::new();
        for path in &sources {
            let Some(module) = path
                .strip_prefix(&src)
                .ok()
                .and_then(|rel| rel.components().next())
                .map(|c| {
                    c.as_os_str()
                        .to_string_lossy()
                        .trim_end_matches(".rs")
                        .to_owned()
                })
            else {
                continue;
            };
            if module == "lib" {
                continue;
            }
            let uses = crate_modules(&read(path));
            edges
                .entry(module.clone())
                .or_default()
                .extend(uses.into_iter().filter(|m| *m != module));
        }
        assert!(edges.len() > 1, "found the modules of {krate}");
        // Depth-first search for a back edge.
        fn visit(
            node: &str,
            edges: &std::collections::BTreeMap<String, std::collections::BTreeSet<String>>,
            path: &mut Vec<String>,
            done: &mut std::collections::BTreeSet<String>,
        ) -> Option<Vec<String>> {
            if let Some(at) = path.iter().position(|n| n == node) {
                let mut cycle = path[at..].to_vec();
                cycle.push(node.to_owned());
                return Some(cycle);
            }
            if done.contains(node) {
                return None;
            }
            path.push(node.to_owned());
            for next in edges.get(node).into_iter().flatten() {
                if let Some(cycle) = visit(next, edges, path, done) {
                    return Some(cycle);
                }
            }
            path.pop();
            done.insert(node.to_owned());
            None
        }
        let mut done = std::collections::BTreeSet::new();
        for node in edges.keys() {
            if let Some(cycle) = visit(node, &edges, &mut Vec::new(), &mut done) {
                panic!(
                    "{krate}: the modules import each other: {}",
                    cycle.join(" -> ")
                );
            }
        }
    }
}

#[test]
fn a_module_cycle_is_found_in_crate_paths() {
    let text =
        "use crate::fleet::Fleet;\n// use crate::ignored\nlet x = crate::state::Core::new();";
    let found: Vec<String> = crate_modules(text).into_iter().collect();
    assert_eq!(found, ["fleet", "state"]);
}

#[test]
fn manifests_inherit_lints_and_dependency_versions() {
    // The fuzz crates sit outside the workspace and depend on their crate by path.
    let manifests = files(|path| {
        path.file_name().is_some_and(|name| name == "Cargo.toml")
            && path
                .parent()
                .and_then(Path::file_name)
                .is_none_or(|dir| dir != "fuzz")
    });
    assert!(
        manifests
            .iter()
            .any(|path| path.ends_with("xtask/Cargo.toml")),
        "the walk found no manifests"
    );
    let problems: Vec<String> = manifests
        .iter()
        .flat_map(|path| manifest_problems(&path.display().to_string(), &read(path)))
        .collect();
    assert_no_problems(
        "package manifests that do not follow the workspace",
        &problems,
    );
}

#[test]
fn cargo_lock_is_tracked() {
    let root = workspace_root();
    assert!(
        root.join("Cargo.lock").is_file(),
        "Cargo.lock: missing; it is committed so CI builds with --locked"
    );
    // In a git checkout, the file must also be tracked rather than ignored.
    if root.join(".git").exists() {
        let tracked = Command::new("git")
            .args(["ls-files", "--error-unmatch", "Cargo.lock"])
            .current_dir(&root)
            .output();
        if let Ok(output) = tracked {
            assert!(
                output.status.success(),
                "Cargo.lock: not tracked by git; commit it so CI builds with --locked"
            );
        }
    }
}

// === Manifest scanning ===
//
// A line-oriented reading of the TOML that Cargo manifests use, enough to find tables, dependency
// entries and `workspace = true`. xtask stays free of a TOML parser to keep its build small.

const DEPENDENCY_TABLES: &[&str] = &[
    "dependencies",
    "dev-dependencies",
    "build-dependencies",
    "dev_dependencies",
    "build_dependencies",
];

/// Problems in one package manifest, each naming `file`.
fn manifest_problems(file: &str, text: &str) -> Vec<String> {
    let mut problems = Vec::new();
    let mut table: Vec<String> = Vec::new();
    let mut lints_inherited = false;
    // (table, dependency name, uses workspace = true), one entry per dependency.
    let mut dependencies: Vec<(String, String, bool)> = Vec::new();

    for (header, key, value) in entries(text) {
        if let Some(header) = header {
            table = header;
            // `[dependencies.foo]` declares `foo` even before any of its keys.
            if let Some((deps_table, name)) = dependency_subtable(&table) {
                note_dependency(&mut dependencies, deps_table, name, false);
            }
            continue;
        }
        let path: Vec<String> = table.iter().cloned().chain(key).collect();
        let value = value.split_whitespace().collect::<String>();
        let is_true = value == "true";
        let path: Vec<&str> = path.iter().map(String::as_str).collect();
        match path.as_slice() {
            ["lints", "workspace"] => lints_inherited |= is_true,
            ["lints"] => lints_inherited |= inline_workspace_true(&value),
            _ => {}
        }
        if let Some((deps_table, name, rest)) = dependency_entry(&path) {
            let workspace = match rest {
                [] => inline_workspace_true(&value),
                ["workspace"] => is_true,
                _ => false,
            };
            note_dependency(&mut dependencies, deps_table, name, workspace);
        }
    }

    if !lints_inherited {
        problems.push(format!(
            "{file}: missing `[lints]` with `workspace = true` (lints are set once, in the root Cargo.toml)"
        ));
    }
    for (deps_table, name, workspace) in dependencies {
        if !workspace {
            problems.push(format!(
                "{file}: `{name}` in [{deps_table}] does not use `{{ workspace = true }}`: state its version or path once, in the root [workspace.dependencies]"
            ));
        }
    }
    problems
}

fn note_dependency(
    dependencies: &mut Vec<(String, String, bool)>,
    table: String,
    name: String,
    workspace: bool,
) {
    match dependencies
        .iter_mut()
        .find(|(t, n, _)| *t == table && *n == name)
    {
        Some(entry) => entry.2 |= workspace,
        None => dependencies.push((table, name, workspace)),
    }
}

/// For a key path inside a dependency table (`dependencies.foo.workspace` or
/// `target.'cfg(unix)'.dependencies.foo`): the table as written, the dependency name, and the rest of
/// the path.
fn dependency_entry<'a>(path: &'a [&'a str]) -> Option<(String, String, &'a [&'a str])> {
    let at = match path {
        [first, ..] if DEPENDENCY_TABLES.contains(first) => 0,
        ["target", _, third, ..] if DEPENDENCY_TABLES.contains(third) => 2,
        _ => return None,
    };
    let name = path.get(at + 1)?;
    Some((path[..=at].join("."), (*name).to_owned(), &path[at + 2..]))
}

/// For a table header such as `[dependencies.foo]`: the dependency table and the name.
fn dependency_subtable(table: &[String]) -> Option<(String, String)> {
    let path: Vec<&str> = table.iter().map(String::as_str).collect();
    let (deps_table, name, rest) = dependency_entry(&path)?;
    rest.is_empty().then_some((deps_table, name))
}

/// Whether an inline table (whitespace removed) sets `workspace = true` at its top level.
fn inline_workspace_true(value: &str) -> bool {
    value.starts_with('{')
        && (value.contains("{workspace=true") || value.contains(",workspace=true"))
}

/// The manifest as a sequence of table headers (`Some(path)`, with empty key and value) and
/// `key = value` entries (`None`, the dotted key split into parts, the raw value). Comments are
/// dropped and values spanning several lines (arrays, inline tables) are joined.
fn entries(text: &str) -> Vec<(Option<Vec<String>>, Vec<String>, String)> {
    let mut out = Vec::new();
    let mut lines = text.lines().map(strip_comment);
    while let Some(line) = lines.next() {
        let line = line.trim();
        if line.is_empty() {
            continue;
        }
        if line.starts_with('[') {
            let inner = line.trim_start_matches('[').trim_end_matches(']');
            out.push((Some(split_key(inner)), Vec::new(), String::new()));
            continue;
        }
        let Some((key, value)) = split_assignment(line) else {
            continue;
        };
        let mut value = value.trim().to_owned();
        while depth(&value) > 0 {
            let Some(more) = lines.next() else { break };
            value.push(' ');
            value.push_str(more.trim());
        }
        out.push((None, split_key(key), value));
    }
    out
}

/// The line without a trailing `# comment` (a `#` inside a string is kept).
fn strip_comment(line: &str) -> String {
    let mut quote = None;
    let mut escaped = false;
    for (index, c) in line.char_indices() {
        match (quote, c) {
            (Some('"'), '\\') if !escaped => {
                escaped = true;
                continue;
            }
            (Some(q), c) if c == q && !escaped => quote = None,
            (None, '"' | '\'') => quote = Some(c),
            (None, '#') => return line[..index].to_owned(),
            _ => {}
        }
        escaped = false;
    }
    line.to_owned()
}

/// `key = value` split at the first `=` outside quotes.
fn split_assignment(line: &str) -> Option<(&str, &str)> {
    let mut quote = None;
    for (index, c) in line.char_indices() {
        match (quote, c) {
            (Some(q), c) if c == q => quote = None,
            (None, '"' | '\'') => quote = Some(c),
            (None, '=') => return Some((&line[..index], &line[index + 1..])),
            _ => {}
        }
    }
    None
}

/// A dotted key split into its parts, with quotes removed: `target.'cfg(unix)'.dependencies`.
fn split_key(key: &str) -> Vec<String> {
    let mut parts = Vec::new();
    let mut part = String::new();
    let mut quote = None;
    for c in key.chars() {
        match (quote, c) {
            (Some(q), c) if c == q => quote = None,
            (Some(_), c) => part.push(c),
            (None, '"' | '\'') => quote = Some(c),
            (None, '.') => parts.push(std::mem::take(&mut part)),
            (None, c) if c.is_whitespace() => {}
            (None, c) => part.push(c),
        }
    }
    parts.push(part);
    parts
}

/// How many `{`/`[` are left open in `value`, outside strings.
fn depth(value: &str) -> i32 {
    let mut open = 0;
    let mut quote = None;
    for c in value.chars() {
        match (quote, c) {
            (Some(q), c) if c == q => quote = None,
            (Some(_), _) => {}
            (None, '"' | '\'') => quote = Some(c),
            (None, '{' | '[') => open += 1,
            (None, '}' | ']') => open -= 1,
            _ => {}
        }
    }
    open
}

#[track_caller]
fn check_manifest(text: &str, expected: &[&str]) {
    let problems = manifest_problems("m/Cargo.toml", text);
    let expected: Vec<String> = expected.iter().map(|s| (*s).to_owned()).collect();
    assert_eq!(problems, expected);
}

const LINTS: &str = "[lints]\nworkspace = true\n";

#[test]
fn a_manifest_following_the_workspace_passes() {
    check_manifest(
        &format!(
            r#"
[package]
name = "x" # a comment with = and "quotes"
version.workspace = true

{LINTS}
[dependencies]
serde = {{ workspace = true, features = ["derive"] }}
tokio.workspace = true
tokio.features = ["rt"]
multi = {{
    workspace = true,
}}

[dev-dependencies.proptest]
workspace = true

[target.'cfg(unix)'.dependencies]
libc = {{ workspace = true }}
"#
        ),
        &[],
    );
}

#[test]
fn a_version_stated_in_a_member_is_named() {
    check_manifest(
        &format!(
            r#"{LINTS}
[dependencies]
serde = "1.0"
local = {{ path = "../local" }}
tricky = {{ version = "1", package = "workspace=true" }}

[build-dependencies.cc]
version = "1"

[target."cfg(windows)".dev-dependencies]
winapi = {{ version = "0.3" }}
"#
        ),
        &[
            "m/Cargo.toml: `serde` in [dependencies] does not use `{ workspace = true }`: state its version or path once, in the root [workspace.dependencies]",
            "m/Cargo.toml: `local` in [dependencies] does not use `{ workspace = true }`: state its version or path once, in the root [workspace.dependencies]",
            "m/Cargo.toml: `tricky` in [dependencies] does not use `{ workspace = true }`: state its version or path once, in the root [workspace.dependencies]",
            "m/Cargo.toml: `cc` in [build-dependencies] does not use `{ workspace = true }`: state its version or path once, in the root [workspace.dependencies]",
            "m/Cargo.toml: `winapi` in [target.cfg(windows).dev-dependencies] does not use `{ workspace = true }`: state its version or path once, in the root [workspace.dependencies]",
        ],
    );
}

#[test]
fn missing_or_local_lints_are_named() {
    let missing = "m/Cargo.toml: missing `[lints]` with `workspace = true` (lints are set once, in the root Cargo.toml)";
    check_manifest("[package]\nname = \"x\"\n", &[missing]);
    check_manifest("[lints.clippy]\nunwrap_used = \"allow\"\n", &[missing]);
    check_manifest("[lints]\nworkspace = false\n", &[missing]);
    check_manifest("lints = { workspace = true }\n", &[]);
    check_manifest("lints.workspace = true\n", &[]);
}
