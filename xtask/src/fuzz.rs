//! `cargo xtask fuzz [target] [--seconds N | --runs N]`: builds the fuzz targets in `fuzz/` with
//! cargo-fuzz and runs each (or the one named) for a time or a number of runs, from its seeds in
//! `fuzz/seeds/<target>/`. libFuzzer writes the inputs it finds to `fuzz/corpus/<target>/` and a
//! crash to `fuzz/artifacts/<target>/` (both ignored by git); a crash fails the command, naming
//! the file. The closing line counts the runs per target.
//!
//! cargo-fuzz passes unstable `-Z`/`-C` flags to rustc for libFuzzer's coverage instrumentation.
//! On a stable toolchain (this machine's 1.95) they are allowed by `RUSTC_BOOTSTRAP=1`, which
//! this command sets for the fuzz build only; a nightly toolchain needs nothing. The targets are
//! built without a sanitizer (`-s none`: the workspace forbids `unsafe`, so what there is to find
//! is a panic, an overflow or a hang) and with debug assertions (`-a`, so that overflow checks
//! and the link's invariants panic).

use std::path::Path;
use std::process::{Command, ExitCode};

use anyhow::Result;

use crate::cmd::{self, Stopwatch};

/// A fuzz target: the `[[bin]]` in `fuzz/Cargo.toml` and what it covers. `ready: false` names a
/// target whose code does not exist yet.
struct Target {
    name: &'static str,
    covers: &'static str,
    ready: bool,
}

const TARGETS: &[Target] = &[
    Target {
        name: "link_frame",
        covers: "simlock-link's frame decoder (decode then encode is the identity)",
        ready: true,
    },
    Target {
        name: "link_input",
        covers: "a whole link fed hostile frames and text, time moving",
        ready: true,
    },
    Target {
        name: "wire_lines",
        covers: "simlock-wire's NDJSON line codec against a model, any cap and read size",
        ready: true,
    },
    Target {
        name: "contract_input",
        covers: "every operation's input decoded from arbitrary JSON",
        ready: true,
    },
    Target {
        name: "relay_headers",
        covers: "the relay's header filter and bounds",
        ready: true,
    },
    Target {
        name: "agent_device_request",
        covers: "the agent-device front's request parsing: /rpc bodies, answers, lease ids, tenants",
        ready: true,
    },
];

/// How long each target runs.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Budget {
    /// Seconds of fuzzing per target (`-max_total_time`).
    Seconds(u64),
    /// Inputs per target (`-runs`), for CI: the same work whatever the machine's speed.
    Runs(u64),
}

pub(crate) fn run(only: Option<&str>, budget: Budget) -> Result<ExitCode> {
    if let Some(name) = only
        && !TARGETS.iter().any(|t| t.name == name)
    {
        let names: Vec<&str> = TARGETS.iter().map(|t| t.name).collect();
        eprintln!(
            "fuzz: no target `{name}`; the targets are {}",
            names.join(", ")
        );
        return Ok(ExitCode::FAILURE);
    }
    if !cmd::succeeds(cmd::cargo(["fuzz", "--version"])) {
        eprintln!(
            "fuzz: cargo-fuzz is not installed: `cargo install --locked cargo-fuzz` (`.ci/run` installs it)"
        );
        return Ok(ExitCode::FAILURE);
    }
    let selected: Vec<&Target> = TARGETS
        .iter()
        .filter(|t| only.is_none_or(|name| t.name == name))
        .collect();
    for target in selected.iter().filter(|t| !t.ready) {
        println!(
            "fuzz {}: not yet available ({} does not exist yet)",
            target.name, target.covers
        );
    }
    let ready: Vec<&Target> = selected.into_iter().filter(|t| t.ready).collect();
    if ready.is_empty() {
        return Ok(if only.is_some() {
            ExitCode::FAILURE
        } else {
            ExitCode::SUCCESS
        });
    }

    let watch = Stopwatch::start();
    let mut build = fuzz_command(["build"]);
    if let [one] = ready.as_slice() {
        build.arg(one.name);
    }
    println!("== fuzz build: {}", cmd::display(&build));
    if !cmd::status(build)?.success() {
        eprintln!("fuzz: the build failed");
        return Ok(ExitCode::FAILURE);
    }
    println!(
        "== fuzz build: ok in {}",
        cmd::format_duration(watch.elapsed())
    );

    let root = cmd::workspace_root();
    let mut results = Vec::new();
    let mut crashed = Vec::new();
    for target in ready {
        let corpus = root.join("fuzz/corpus").join(target.name);
        let seeds = root.join("fuzz/seeds").join(target.name);
        std::fs::create_dir_all(&corpus)?;
        let mut command = fuzz_command(["run"]);
        command.arg(target.name).arg(&corpus);
        if seeds.is_dir() {
            command.arg(&seeds);
        }
        command.arg("--");
        match budget {
            Budget::Seconds(seconds) => command.arg(format!("-max_total_time={seconds}")),
            Budget::Runs(runs) => command.arg(format!("-runs={runs}")),
        };
        // One input may take at most 10 s (a hang is a finding), and 2 GiB.
        command.args(["-timeout=10", "-rss_limit_mb=2048", "-print_final_stats=1"]);
        println!(
            "== fuzz {} ({}): {}",
            target.name,
            target.covers,
            cmd::display(&command)
        );
        let watch = Stopwatch::start();
        let (status, lines) = cmd::status_with_lines(command)?;
        let took = watch.elapsed();
        let runs = done_runs(&lines);
        if status.success() {
            println!(
                "== fuzz {}: ok, {} runs in {}",
                target.name,
                runs.map_or_else(|| "?".to_owned(), |n| n.to_string()),
                cmd::format_duration(took)
            );
            results.push((target.name, runs));
        } else {
            let artifact = crash_artifact(&lines);
            eprintln!(
                "== fuzz {}: FAILED ({status}){}",
                target.name,
                artifact.map_or_else(String::new, |a| format!(
                    ": the input is {a}; keep it in fuzz/seeds/{}/ and add a regression test beside the code",
                    target.name
                ))
            );
            crashed.push(target.name);
        }
    }
    let summary: Vec<String> = results
        .iter()
        .map(|(name, runs)| {
            format!(
                "{name}={}",
                runs.map_or_else(|| "?".to_owned(), |n| n.to_string())
            )
        })
        .collect();
    println!("fuzz runs: {}", summary.join(" "));
    if crashed.is_empty() {
        println!("fuzz: {} targets, no crash", results.len());
        Ok(ExitCode::SUCCESS)
    } else {
        eprintln!("fuzz: crashes in {}", crashed.join(", "));
        Ok(ExitCode::FAILURE)
    }
}

/// `cargo fuzz <sub> --fuzz-dir fuzz -s none -a`, with `RUSTC_BOOTSTRAP=1` unless the
/// toolchain is a nightly.
fn fuzz_command<const N: usize>(sub: [&str; N]) -> Command {
    let mut command = cmd::cargo(["fuzz"]);
    command.args(sub).args([
        "--fuzz-dir",
        "fuzz",
        "--sanitizer",
        "none",
        "--debug-assertions",
    ]);
    if !is_nightly() {
        command.env("RUSTC_BOOTSTRAP", "1");
    }
    command
}

fn is_nightly() -> bool {
    Command::new(std::env::var_os("RUSTC").unwrap_or_else(|| "rustc".into()))
        .arg("--version")
        .current_dir(cmd::workspace_root())
        .output()
        .is_ok_and(|out| String::from_utf8_lossy(&out.stdout).contains("nightly"))
}

/// The runs libFuzzer reports at its end: `Done 12345 runs in 60 second(s)`.
fn done_runs(lines: &[String]) -> Option<u64> {
    lines.iter().rev().find_map(|line| {
        let rest = line.trim().strip_prefix("Done ")?;
        rest.split_whitespace().next()?.parse().ok()
    })
}

/// The file libFuzzer saved the crashing input to.
fn crash_artifact(lines: &[String]) -> Option<String> {
    lines.iter().find_map(|line| {
        let (_, rest) = line.split_once("Test unit written to ")?;
        let path = rest.trim();
        Path::new(path).is_file().then(|| path.to_owned())
    })
}

#[cfg(test)]
mod tests {
    use super::{TARGETS, done_runs};

    #[test]
    fn the_run_count_is_read_from_libfuzzers_last_line() {
        let lines: Vec<String> = [
            "#1024\tpulse  cov: 10 ft: 12 corp: 3/9b exec/s: 512 rss: 40Mb",
            "Done 20000 runs in 3 second(s)",
            "stat::number_of_executed_units: 20000",
        ]
        .map(str::to_owned)
        .to_vec();
        assert_eq!(done_runs(&lines), Some(20_000));
        assert_eq!(done_runs(&["Done soon".to_owned()]), None);
    }

    #[test]
    fn every_ready_target_is_a_bin_of_the_fuzz_crate_with_seeds() {
        let root = crate::cmd::workspace_root();
        let manifest = std::fs::read_to_string(root.join("fuzz/Cargo.toml")).unwrap();
        for target in TARGETS {
            let declared = manifest.contains(&format!("name = \"{}\"", target.name));
            assert_eq!(declared, target.ready, "{}", target.name);
            if target.ready {
                let seeds = root.join("fuzz/seeds").join(target.name);
                let count = std::fs::read_dir(&seeds).map_or(0, Iterator::count);
                assert!(
                    count > 0,
                    "{} has no seeds in {}",
                    target.name,
                    seeds.display()
                );
            }
        }
    }
}
