//! The crate layering check: forbidden dependency edges between workspace crates, written down as data
//! (`RULES`) and checked against `cargo metadata`.
//!
//! Every dependency kind counts for the crate a rule is about (normal, build and dev). Past the first
//! hop, dev-dependencies are not followed: a dependency's own dev-dependencies are never built for its
//! dependents.

use std::{
    collections::{BTreeMap, BTreeSet, VecDeque},
    fmt,
    process::ExitCode,
};

use anyhow::Result;

use crate::metadata::{DepKind, Workspace};

/// The binary packages (`bins/*`). A test checks this list against the `bins/` directory.
pub(crate) const BINARIES: &[&str] = &["simlock", "simlock-gateway", "simlock-worker"];

/// The forbidden edges. Adding a rule is adding one entry.
pub(crate) const RULES: &[Rule] = &[
    Rule {
        name: "edge-crates-see-ports",
        from: Scope::Only(&["agent-device-front", "agent-device-host"]),
        to: &["simlock-fleet", "simlock-relay-gateway", "simlock-core"],
        reach: Reach::Transitive,
        reason: "edge crates see the worker and the fleet only through ports (traits they own) that the binaries implement",
    },
    Rule {
        name: "link-knows-no-contract",
        from: Scope::Only(&["simlock-link"]),
        to: &["simlock-contract"],
        reach: Reach::Transitive,
        reason: "simlock-link knows bytes and channel ids, nothing of the contract",
    },
    Rule {
        name: "binaries-are-leaves",
        from: Scope::AllExcept(&[
            "simlock",
            "simlock-gateway",
            "simlock-worker",
            "xtask",
            "simlock-e2e",
            "simlock-fake-tools",
        ]),
        to: BINARIES,
        reach: Reach::Direct,
        reason: "binaries are composition only; only binaries, xtask and the e2e and driver scenario tests may depend on one",
    },
    Rule {
        name: "nothing-depends-on-xtask",
        from: Scope::AllExcept(&[]),
        to: &["xtask"],
        reach: Reach::Direct,
        reason: "xtask is project automation, not a library",
    },
];

/// One forbidden-edge rule: no package in `from` may depend on a package in `to`.
#[derive(Debug)]
pub(crate) struct Rule {
    /// A short stable name, printed with every violation.
    pub(crate) name: &'static str,
    pub(crate) from: Scope,
    pub(crate) to: &'static [&'static str],
    pub(crate) reach: Reach,
    pub(crate) reason: &'static str,
}

/// Which packages a rule constrains.
#[derive(Debug)]
pub(crate) enum Scope {
    /// Exactly these packages.
    Only(&'static [&'static str]),
    /// Every workspace package except these (and except the rule's own targets).
    AllExcept(&'static [&'static str]),
}

/// How far a rule looks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Reach {
    /// Only the package's own dependency declarations.
    Direct,
    /// Any path through workspace crates.
    Transitive,
}

impl Scope {
    fn contains(&self, package: &str) -> bool {
        match self {
            Self::Only(names) => names.contains(&package),
            Self::AllExcept(names) => !names.contains(&package),
        }
    }
}

/// A dependency path that breaks a rule: `path[0]` is the constrained package, the last hop the
/// forbidden one.
#[derive(Debug)]
pub(crate) struct Violation {
    pub(crate) rule: &'static Rule,
    pub(crate) path: Vec<Hop>,
}

/// One step of a dependency path: the package reached and the kind of the edge that reached it
/// (`None` for the first package).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Hop {
    pub(crate) package: String,
    pub(crate) via: Option<DepKind>,
}

impl fmt::Display for Violation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{}: breaks `{}`: {}",
            render_path(&self.path),
            self.rule.name,
            self.rule.reason
        )
    }
}

fn render_path(path: &[Hop]) -> String {
    let mut out = String::new();
    for hop in path {
        match hop.via {
            None => {}
            Some(DepKind::Normal) => out.push_str(" -> "),
            Some(kind) => out.push_str(&format!(" -[{kind}]-> ")),
        }
        out.push_str(&hop.package);
    }
    out
}

/// The edges between workspace crates: package name to its (dependency, kind) pairs.
pub(crate) type Graph = BTreeMap<String, BTreeSet<(String, DepKind)>>;

/// The dependency edges among workspace members (path dependencies on other members only).
pub(crate) fn graph(workspace: &Workspace) -> Graph {
    let members: BTreeSet<&str> = workspace.packages.iter().map(|p| p.name.as_str()).collect();
    workspace
        .packages
        .iter()
        .map(|package| {
            let edges = package
                .dependencies
                .iter()
                .filter(|dep| dep.is_path && members.contains(dep.name.as_str()))
                .map(|dep| (dep.name.clone(), dep.kind))
                .collect();
            (package.name.clone(), edges)
        })
        .collect()
}

/// Checks `rules` against the workspace and returns every violation, in rule order, then package
/// name order.
pub(crate) fn check(workspace: &Workspace, rules: &'static [Rule]) -> Vec<Violation> {
    let graph = graph(workspace);
    let mut violations = Vec::new();
    for rule in rules {
        for from in graph.keys() {
            if !rule.from.contains(from) || rule.to.contains(&from.as_str()) {
                continue;
            }
            let paths = shortest_paths(&graph, from, rule.reach);
            for to in rule.to {
                if let Some(path) = paths.get(*to) {
                    violations.push(Violation {
                        rule,
                        path: path.clone(),
                    });
                }
            }
        }
    }
    violations
}

/// Breadth-first search from `from`: the shortest path to every package it depends on.
fn shortest_paths(graph: &Graph, from: &str, reach: Reach) -> BTreeMap<String, Vec<Hop>> {
    let mut parent: BTreeMap<&str, (&str, DepKind)> = BTreeMap::new();
    let mut seen = BTreeSet::from([from]);
    let mut queue = VecDeque::from([(from, 0_usize)]);
    while let Some((node, depth)) = queue.pop_front() {
        if reach == Reach::Direct && depth == 1 {
            continue;
        }
        for (next, kind) in graph.get(node).into_iter().flatten() {
            // Dev-dependencies of a dependency are never built for its dependents.
            if depth > 0 && *kind == DepKind::Dev {
                continue;
            }
            if seen.insert(next) {
                parent.insert(next, (node, *kind));
                queue.push_back((next, depth + 1));
            }
        }
    }
    parent
        .keys()
        .map(|&to| {
            let mut path = vec![];
            let mut at = to;
            while let Some(&(previous, kind)) = parent.get(at) {
                path.push(Hop {
                    package: at.to_owned(),
                    via: Some(kind),
                });
                at = previous;
            }
            path.push(Hop {
                package: at.to_owned(),
                via: None,
            });
            path.reverse();
            (to.to_owned(), path)
        })
        .collect()
}

/// `cargo xtask layering`: prints the workspace crate graph, then checks the rules.
pub(crate) fn run() -> Result<ExitCode> {
    let workspace = Workspace::load()?;
    let graph = graph(&workspace);
    let edge_count: usize = graph.values().map(BTreeSet::len).sum();
    println!(
        "workspace crate graph ({} crates, {edge_count} edges):",
        graph.len()
    );
    for (from, edges) in &graph {
        if edges.is_empty() {
            println!("  {from}");
        }
        for (to, kind) in edges {
            let hops = [
                Hop {
                    package: from.clone(),
                    via: None,
                },
                Hop {
                    package: to.clone(),
                    via: Some(*kind),
                },
            ];
            println!("  {}", render_path(&hops));
        }
    }
    println!();
    let violations = check(&workspace, RULES);
    if violations.is_empty() {
        println!("layering: {} rules hold", RULES.len());
        return Ok(ExitCode::SUCCESS);
    }
    eprintln!("layering: {} violation(s):", violations.len());
    for violation in &violations {
        eprintln!("  {violation}");
    }
    Ok(ExitCode::FAILURE)
}

#[cfg(test)]
mod tests {
    use std::path::PathBuf;

    use super::{BINARIES, RULES, Scope, Violation, check, render_path};
    use crate::{
        cmd,
        metadata::{DepKind, Dependency, Package, Workspace},
    };

    fn real_workspace() -> Workspace {
        Workspace::load().unwrap()
    }

    fn with_edge(mut workspace: Workspace, from: &str, to: &str, kind: DepKind) -> Workspace {
        let package = workspace
            .packages
            .iter_mut()
            .find(|p| p.name == from)
            .unwrap_or_else(|| panic!("no package `{from}` in the workspace"));
        package.dependencies.push(Dependency {
            name: to.to_owned(),
            kind,
            is_path: true,
        });
        workspace
    }

    fn rendered(violations: &[Violation]) -> Vec<String> {
        violations.iter().map(ToString::to_string).collect()
    }

    #[track_caller]
    fn assert_breaks(workspace: &Workspace, rule: &str, path: &str) {
        let violations = check(workspace, RULES);
        assert!(
            violations
                .iter()
                .any(|v| v.rule.name == rule && render_path(&v.path) == path),
            "expected `{path}` to break `{rule}`, got {:#?}",
            rendered(&violations)
        );
        let message = violations
            .iter()
            .find(|v| v.rule.name == rule)
            .map(ToString::to_string)
            .unwrap();
        assert!(
            message.contains(rule) && message.contains(path),
            "{message}"
        );
    }

    #[test]
    fn the_workspace_follows_the_layering_rules() {
        let violations = check(&real_workspace(), RULES);
        assert!(
            violations.is_empty(),
            "layering violations:\n{}",
            rendered(&violations).join("\n")
        );
    }

    #[test]
    fn an_edge_crate_depending_on_core_is_caught() {
        let workspace = with_edge(
            real_workspace(),
            "agent-device-front",
            "simlock-core",
            DepKind::Normal,
        );
        assert_breaks(
            &workspace,
            "edge-crates-see-ports",
            "agent-device-front -> simlock-core",
        );
    }

    #[test]
    fn link_depending_on_the_contract_is_caught() {
        let workspace = with_edge(
            real_workspace(),
            "simlock-link",
            "simlock-contract",
            DepKind::Dev,
        );
        assert_breaks(
            &workspace,
            "link-knows-no-contract",
            "simlock-link -[dev]-> simlock-contract",
        );
    }

    #[test]
    fn a_transitive_path_to_the_fleet_is_caught_and_shown() {
        let workspace = with_edge(
            real_workspace(),
            "agent-device-host",
            "simlock-client",
            DepKind::Normal,
        );
        let workspace = with_edge(
            workspace,
            "simlock-client",
            "simlock-fleet",
            DepKind::Normal,
        );
        assert_breaks(
            &workspace,
            "edge-crates-see-ports",
            "agent-device-host -> simlock-client -> simlock-fleet",
        );
    }

    #[test]
    fn a_library_depending_on_a_binary_or_on_xtask_is_caught() {
        let workspace = with_edge(
            real_workspace(),
            "simlock-daemon",
            "simlock-worker",
            DepKind::Dev,
        );
        let workspace = with_edge(workspace, "simlock-wire", "xtask", DepKind::Build);
        assert_breaks(
            &workspace,
            "binaries-are-leaves",
            "simlock-daemon -[dev]-> simlock-worker",
        );
        assert_breaks(
            &workspace,
            "nothing-depends-on-xtask",
            "simlock-wire -[build]-> xtask",
        );
    }

    fn package(name: &str, deps: &[(&str, DepKind)]) -> Package {
        Package {
            name: name.to_owned(),
            manifest_path: PathBuf::from(format!("/w/{name}/Cargo.toml")),
            targets: vec![],
            dependencies: deps
                .iter()
                .map(|&(dep, kind)| Dependency {
                    name: dep.to_owned(),
                    kind,
                    is_path: true,
                })
                .collect(),
        }
    }

    #[test]
    fn dev_dependencies_of_dependencies_are_not_followed() {
        // simlock-link -> helper, and helper's tests use the contract: simlock-link never builds them.
        let workspace = Workspace {
            packages: vec![
                package("simlock-link", &[("helper", DepKind::Normal)]),
                package("helper", &[("simlock-contract", DepKind::Dev)]),
                package("simlock-contract", &[]),
            ],
        };
        assert!(rendered(&check(&workspace, RULES)).is_empty());
    }

    #[test]
    fn direct_rules_report_only_the_direct_edge() {
        // simlock-core -> simlock-daemon -> simlock-worker: only simlock-daemon's own edge is reported.
        let workspace = Workspace {
            packages: vec![
                package("simlock-core", &[("simlock-daemon", DepKind::Normal)]),
                package("simlock-daemon", &[("simlock-worker", DepKind::Normal)]),
                package("simlock-worker", &[]),
            ],
        };
        assert_eq!(
            rendered(&check(&workspace, RULES)),
            [
                "simlock-daemon -> simlock-worker: breaks `binaries-are-leaves`: binaries are composition only; only binaries, xtask and the e2e and driver scenario tests may depend on one"
            ]
        );
    }

    #[test]
    fn external_dependencies_with_a_member_name_are_ignored() {
        let mut workspace = Workspace {
            packages: vec![
                package("simlock-link", &[]),
                package("simlock-contract", &[]),
            ],
        };
        workspace.packages[0].dependencies.push(Dependency {
            name: "simlock-contract".to_owned(),
            kind: DepKind::Normal,
            is_path: false,
        });
        assert!(rendered(&check(&workspace, RULES)).is_empty());
    }

    #[test]
    fn every_crate_named_by_a_constrained_scope_or_target_exists() {
        // A renamed crate would otherwise silently drop out of its rule. `AllExcept` lists may name
        // crates that do not exist yet (simlock-e2e).
        let workspace = real_workspace();
        for rule in RULES {
            let scoped = match rule.from {
                Scope::Only(names) => names,
                Scope::AllExcept(_) => &[],
            };
            for name in scoped.iter().chain(rule.to) {
                assert!(
                    workspace.package(name).is_some(),
                    "rule `{}` names `{name}`, which is not a workspace package",
                    rule.name
                );
            }
        }
    }

    #[test]
    fn binaries_lists_every_package_under_bins() {
        let bins_dir = cmd::workspace_root().join("bins");
        let mut under_bins: Vec<String> = real_workspace()
            .packages
            .into_iter()
            .filter(|p| p.manifest_path.starts_with(&bins_dir))
            .map(|p| p.name)
            .collect();
        under_bins.sort();
        let mut listed: Vec<&str> = BINARIES.to_vec();
        listed.sort_unstable();
        assert_eq!(
            under_bins, listed,
            "layering::BINARIES must list exactly the packages under bins/"
        );
    }
}
