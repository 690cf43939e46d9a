//! `cargo xtask ci`: the CI gate, also run locally. Steps run in order and the first failure stops the
//! run, naming the step. Each step's wall time and a summary are printed at the end, followed by one
//! `tests: N passed, N failed, N skipped` line totalling the test steps.

use std::{
    ffi::OsString,
    process::{Command, ExitCode},
    time::Duration,
};

use anyhow::Result;

use crate::cmd::{self, Stopwatch};

struct Step {
    name: &'static str,
    plan: Plan,
    /// Printed before the step runs.
    note: Option<&'static str>,
}

/// Inputs each fuzz target gets in CI: the same work on any machine, a few seconds a target.
pub(crate) const CI_FUZZ_RUNS: u64 = 100_000;

enum Plan {
    Run {
        command: Command,
        /// The test runner whose result lines feed the final tally, if the step runs tests.
        tests: Option<Runner>,
    },
    Skip {
        why: &'static str,
    },
}

enum Outcome {
    Passed(Duration),
    Failed(Duration),
    Skipped(&'static str),
    NotRun,
}

fn steps() -> Vec<Step> {
    let run = |command: Command, tests: Option<Runner>| Plan::Run { command, tests };
    let nextest = cmd::succeeds(cmd::cargo(["nextest", "--version"]));
    let deny = cmd::succeeds(cmd::cargo(["deny", "--version"]));
    let fuzz = cmd::succeeds(cmd::cargo(["fuzz", "--version"]));

    let (tests, runner) = if nextest {
        let command = cmd::cargo([
            "nextest",
            "run",
            "--workspace",
            "--locked",
            "--profile",
            "ci",
        ]);
        (command, Runner::Nextest)
    } else {
        // `--tests` leaves out the doc tests (their own step) and the benches (harness-less benches
        // would run in full).
        println!("cargo-nextest is not installed: the tests run with `cargo test`");
        let command = cmd::cargo(["test", "--workspace", "--locked", "--tests"]);
        (command, Runner::Libtest)
    };
    let mut doc = cmd::cargo(["doc", "--workspace", "--no-deps", "--locked"]);
    doc.env(
        "RUSTDOCFLAGS",
        deny_warnings(std::env::var_os("RUSTDOCFLAGS")),
    );

    let mut fmt = cmd::cargo(["fmt", "--all", "--", "--check"]);
    // rustfmt colours its diff unless told otherwise, whatever cargo's colour setting says.
    if let Ok(color) = std::env::var("CARGO_TERM_COLOR")
        && ["always", "never", "auto"].contains(&color.as_str())
    {
        fmt.args(["--color", &color]);
    }

    vec![
        Step {
            name: "fmt",
            plan: run(fmt, None),
            note: None,
        },
        Step {
            name: "deps",
            plan: run(xtask(["deps"]), None),
            note: Some("every dependency a manifest names is used (`cargo xtask deps`)"),
        },
        Step {
            name: "clippy",
            plan: run(
                cmd::cargo([
                    "clippy",
                    "--workspace",
                    "--all-targets",
                    "--locked",
                    "--",
                    "-D",
                    "warnings",
                ]),
                None,
            ),
            note: None,
        },
        Step {
            name: "test",
            plan: run(tests, Some(runner)),
            note: None,
        },
        Step {
            name: "doctest",
            plan: run(
                cmd::cargo(["test", "--workspace", "--doc", "--locked"]),
                Some(Runner::Libtest),
            ),
            note: None,
        },
        Step {
            name: "doc",
            plan: run(doc, None),
            note: None,
        },
        Step {
            name: "binaries",
            plan: run(crate::e2e::build_command(), None),
            note: None,
        },
        Step {
            name: "e2e",
            plan: run(crate::e2e::scenario_command(), Some(Runner::Libtest)),
            note: None,
        },
        Step {
            name: "e2e-drivers",
            plan: run(crate::e2e::crash_command(), Some(Runner::Libtest)),
            note: None,
        },
        Step {
            name: "deny",
            plan: if deny {
                run(
                    cmd::cargo([
                        "deny",
                        "--locked",
                        "check",
                        "--hide-inclusion-graph",
                        "bans",
                        "licenses",
                        "sources",
                    ]),
                    None,
                )
            } else {
                Plan::Skip {
                    why: "cargo-deny is not installed (`.ci/run` installs it)",
                }
            },
            note: Some(
                "bans, licenses and sources; advisories are NOT checked: the RustSec advisory database cannot be fetched from this machine (run `cargo deny check advisories` where it can be)",
            ),
        },
        Step {
            name: "fuzz",
            plan: if fuzz {
                run(
                    xtask([
                        "fuzz".to_owned(),
                        "--runs".to_owned(),
                        CI_FUZZ_RUNS.to_string(),
                    ]),
                    None,
                )
            } else {
                Plan::Skip {
                    why: "cargo-fuzz is not installed (`.ci/run` installs it)",
                }
            },
            note: None,
        },
    ]
}

/// `cargo xtask <args>`: this same binary, run again (no second build).
fn xtask<I, S>(args: I) -> Command
where
    I: IntoIterator<Item = S>,
    S: Into<OsString>,
{
    let mut command = match std::env::current_exe() {
        Ok(exe) => Command::new(exe),
        Err(_) => cmd::cargo(["xtask"]),
    };
    command
        .args(args.into_iter().map(Into::into))
        .current_dir(cmd::workspace_root());
    command
}

/// `RUSTDOCFLAGS` with `-D warnings` appended to whatever the caller already set.
fn deny_warnings(existing: Option<OsString>) -> OsString {
    match existing {
        Some(mut flags) if !flags.is_empty() => {
            flags.push(" -D warnings");
            flags
        }
        _ => OsString::from("-D warnings"),
    }
}

pub(crate) fn run() -> Result<ExitCode> {
    let total = Stopwatch::start();
    // The agent-device tests run the published CLI and daemon; they fail, never skip, without.
    let package = crate::peers::fetch_agent_device()?;
    println!(
        "== peers: agent-device {} at {}",
        crate::peers::AGENT_DEVICE_VERSION,
        package.display()
    );
    let steps = steps();
    let count = steps.len();
    let mut outcomes: Vec<(&'static str, Outcome)> = steps
        .iter()
        .map(|step| (step.name, Outcome::NotRun))
        .collect();
    let mut tally = Tally::default();
    let mut failure = None;

    for (index, step) in steps.into_iter().enumerate() {
        let (command, tests) = match step.plan {
            Plan::Skip { why } => {
                println!("== [{}/{count}] {}: skipped ({why})", index + 1, step.name);
                outcomes[index].1 = Outcome::Skipped(why);
                continue;
            }
            Plan::Run { command, tests } => (command, tests),
        };
        let shown = cmd::display(&command);
        println!("== [{}/{count}] {}: {shown}", index + 1, step.name);
        if let Some(note) = step.note {
            println!("== [{}/{count}] {}: {note}", index + 1, step.name);
        }
        let watch = Stopwatch::start();
        let status = match tests {
            Some(runner) => {
                let (status, lines) = cmd::status_with_lines(command)?;
                tally.add_lines(runner, &lines);
                status
            }
            None => cmd::status(command)?,
        };
        let took = watch.elapsed();
        println!(
            "== [{}/{count}] {}: {} in {}",
            index + 1,
            step.name,
            if status.success() { "ok" } else { "FAILED" },
            cmd::format_duration(took)
        );
        if status.success() {
            outcomes[index].1 = Outcome::Passed(took);
        } else {
            outcomes[index].1 = Outcome::Failed(took);
            failure = Some((step.name, shown, status));
            break;
        }
    }

    print_summary(&outcomes, total.elapsed());
    let code = match failure {
        None => {
            println!("xtask ci: all steps passed");
            ExitCode::SUCCESS
        }
        Some((name, shown, status)) => {
            eprintln!("xtask ci: step `{name}` failed: `{shown}` exited with {status}");
            ExitCode::FAILURE
        }
    };
    // Last, so that log readers looking for the closing test line find the total.
    if tally.seen {
        println!(
            "tests: {} passed, {} failed, {} skipped",
            tally.passed, tally.failed, tally.skipped
        );
    }
    Ok(code)
}

fn print_summary(outcomes: &[(&str, Outcome)], total: Duration) {
    println!();
    println!("== ci summary");
    let width = outcomes
        .iter()
        .map(|(name, _)| name.len())
        .chain(["total".len()])
        .max()
        .unwrap_or_default();
    for (name, outcome) in outcomes {
        let (state, time) = match outcome {
            Outcome::Passed(took) => ("ok".to_owned(), cmd::format_duration(*took)),
            Outcome::Failed(took) => ("FAILED".to_owned(), cmd::format_duration(*took)),
            Outcome::Skipped(why) => (format!("skipped ({why})"), String::new()),
            Outcome::NotRun => ("not run".to_owned(), String::new()),
        };
        println!("  {name:<width$} {time:>9}  {state}");
    }
    println!("  {:<width$} {:>9}", "total", cmd::format_duration(total));
}

/// Which result lines a test step prints.
#[derive(Debug, Clone, Copy)]
enum Runner {
    /// One `Summary [...] N tests run: ...` line. The captured output of failing tests, which nextest
    /// replays indented, holds libtest lines that must not be counted again.
    Nextest,
    /// One unindented `test result: ...` line per test binary (`cargo test`).
    Libtest,
}

/// Test counts gathered from the result lines of the test steps.
#[derive(Debug, Default, PartialEq, Eq)]
struct Tally {
    passed: u64,
    failed: u64,
    skipped: u64,
    /// Whether any result line was found.
    seen: bool,
}

impl Tally {
    fn add_lines(&mut self, runner: Runner, lines: &[String]) {
        for line in lines {
            self.add_line(runner, line);
        }
    }

    fn add_line(&mut self, runner: Runner, line: &str) {
        match runner {
            // `     Summary [   1.234s] 40 tests run: 38 passed (1 slow), 2 failed, 3 skipped`.
            Runner::Nextest => {
                if line.trim_start().starts_with("Summary [")
                    && let Some((_, counts)) = line.split_once(" run: ")
                {
                    self.add_counts(counts.split(", "));
                }
            }
            // `test result: ok. 5 passed; 0 failed; 1 ignored; 0 measured; 0 filtered out; ...`.
            Runner::Libtest => {
                if let Some(rest) = line.strip_prefix("test result: ")
                    && let Some((_, counts)) = rest.split_once(". ")
                {
                    self.add_counts(counts.split("; "));
                }
            }
        }
    }

    fn add_counts<'a>(&mut self, items: impl Iterator<Item = &'a str>) {
        self.seen = true;
        for item in items {
            let mut words = item.split_whitespace();
            let (Some(number), Some(what)) = (words.next(), words.next()) else {
                continue;
            };
            let Ok(number) = number.parse::<u64>() else {
                continue;
            };
            match what {
                "passed" => self.passed += number,
                "failed" | "timed" => self.failed += number,
                "skipped" | "ignored" => self.skipped += number,
                _ => {}
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::ffi::OsString;

    use super::{Runner, Tally, deny_warnings};

    #[track_caller]
    fn check(runner: Runner, lines: &[&str], expected: (u64, u64, u64)) {
        let mut tally = Tally::default();
        tally.add_lines(
            runner,
            &lines.iter().map(|l| (*l).to_owned()).collect::<Vec<_>>(),
        );
        assert!(tally.seen);
        assert_eq!((tally.passed, tally.failed, tally.skipped), expected);
    }

    #[test]
    fn nextest_summaries_are_counted() {
        check(
            Runner::Nextest,
            &["     Summary [   1.234s] 40 tests run: 40 passed, 0 skipped"],
            (40, 0, 0),
        );
        check(
            Runner::Nextest,
            &[
                "     Summary [  61.0s] 12 tests run: 9 passed (2 slow), 2 failed, 1 timed out, 4 skipped",
            ],
            (9, 3, 4),
        );
        check(
            Runner::Nextest,
            &["Summary [0.1s] 1 test run: 1 passed"],
            (1, 0, 0),
        );
    }

    #[test]
    fn nextest_replays_of_failed_tests_are_not_counted_twice() {
        check(
            Runner::Nextest,
            &[
                "        FAIL [   0.090s] xtask tidy::manifests",
                "    test result: FAILED. 0 passed; 1 failed; 0 ignored; 0 measured; 23 filtered out",
                "     Summary [   0.298s] 45 tests run: 44 passed, 1 failed, 0 skipped",
                "    test result: FAILED. 0 passed; 1 failed; 0 ignored; 0 measured; 23 filtered out",
            ],
            (44, 1, 0),
        );
    }

    #[test]
    fn libtest_results_are_summed() {
        check(
            Runner::Libtest,
            &[
                "running 3 tests",
                "test result: ok. 3 passed; 0 failed; 1 ignored; 0 measured; 0 filtered out; finished in 0.01s",
                "test result: FAILED. 1 passed; 2 failed; 0 ignored; 0 measured; 0 filtered out; finished in 0.00s",
                "     Summary [   0.298s] 45 tests run: 44 passed, 1 failed, 0 skipped",
            ],
            (4, 2, 1),
        );
    }

    #[test]
    fn other_lines_are_ignored() {
        let mut tally = Tally::default();
        for runner in [Runner::Nextest, Runner::Libtest] {
            tally.add_line(runner, "   Compiling xtask v0.1.0");
            tally.add_line(runner, "test tidy::files_start_with_docs ... ok");
        }
        assert_eq!(tally, Tally::default());
    }

    #[test]
    fn rustdocflags_keep_what_the_caller_set() {
        assert_eq!(deny_warnings(None), "-D warnings");
        assert_eq!(deny_warnings(Some(OsString::new())), "-D warnings");
        assert_eq!(
            deny_warnings(Some(OsString::from("--cfg docsrs"))),
            "--cfg docsrs -D warnings"
        );
    }
}
