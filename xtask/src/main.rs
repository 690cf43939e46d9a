//! Project automation for the simlock workspace, run as `cargo xtask <command>`.
//!
//! One module per subcommand. Each exposes `run(...) -> anyhow::Result<ExitCode>`; an `Err` is an
//! unexpected failure (a tool that could not be started, unreadable output), while a step that ran and
//! failed is reported by the module itself and returned as a non-zero exit code.

// xtask is a command-line tool: printing to the terminal is its job, not a leftover debug statement.
#![allow(clippy::print_stdout, clippy::print_stderr)]

mod bench;
mod ci;
mod cmd;
mod deps;
mod e2e;
mod fleet;
mod fuzz;
mod layering;
mod metadata;
mod peers;
#[cfg(test)]
mod tidy;

use std::process::ExitCode;

use clap::{Parser, Subcommand};

/// simlock project automation: the CI gate, layering check, benchmarks, e2e and the demo fleet.
#[derive(Debug, Parser)]
#[command(name = "xtask", bin_name = "cargo xtask", version)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// The CI gate, in order: fmt, deps, clippy, tests, doc tests, docs, the binaries' e2e and
    /// driver scenarios, cargo-deny and the fuzz targets (the last two when installed).
    Ci,
    /// Check the crate layering rules and print the edges between workspace crates.
    Layering,
    /// Run benchmarks and print their final `key=value` result lines.
    Bench {
        /// Which benchmark to run.
        #[arg(value_enum, default_value_t = bench::Which::All)]
        which: bench::Which,
        /// The relay over TLS: the uplink is `wss://`, the baseline direct HTTPS.
        #[arg(long)]
        tls: bool,
    },
    /// Run the end-to-end fleet scenarios against the real binaries.
    E2e {
        /// Instead: the manual check against this machine's real Xcode and/or Android SDK.
        #[arg(long)]
        real_devices: bool,
    },
    /// Fetch the real test peers (the published agent-device) into `.cache/`.
    FetchPeers,
    /// Run the fuzz targets (cargo-fuzz) from their seeds: each for `--seconds` (default 60) or
    /// `--runs`; the closing line counts the runs per target.
    Fuzz {
        /// Only this target (default: every target).
        target: Option<String>,
        /// Seconds per target.
        #[arg(long, conflicts_with = "runs")]
        seconds: Option<u64>,
        /// Inputs per target (CI uses a fixed count).
        #[arg(long)]
        runs: Option<u64>,
    },
    /// Check that every dependency a manifest names is used.
    Deps,
    /// Start a local demo fleet (gateway, workers, agents) on loopback.
    Fleet {
        /// Start the fleet, check it is healthy, tear it down and exit.
        #[arg(long)]
        once: bool,
    },
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Ci => ci::run(),
        Command::Layering => layering::run(),
        Command::Bench { which, tls } => bench::run(which, tls),
        Command::E2e { real_devices } => e2e::run(real_devices),
        Command::FetchPeers => peers::run(),
        Command::Fleet { once } => fleet::run(once),
        Command::Fuzz {
            target,
            seconds,
            runs,
        } => {
            let budget = match (seconds, runs) {
                (_, Some(runs)) => fuzz::Budget::Runs(runs),
                (seconds, None) => fuzz::Budget::Seconds(seconds.unwrap_or(60)),
            };
            fuzz::run(target.as_deref(), budget)
        }
        Command::Deps => deps::run(),
    };
    match result {
        Ok(code) => code,
        Err(error) => {
            eprintln!("xtask: error: {error:#}");
            ExitCode::FAILURE
        }
    }
}
