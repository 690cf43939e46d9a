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
mod e2e;
mod fleet;
mod layering;
mod metadata;
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
    /// The CI gate: fmt, clippy, tests, doc tests, docs and cargo-deny (when installed), in order.
    Ci,
    /// Check the crate layering rules and print the edges between workspace crates.
    Layering,
    /// Run benchmarks and print their final `key=value` result lines.
    Bench {
        /// Which benchmark to run.
        #[arg(value_enum, default_value_t = bench::Which::All)]
        which: bench::Which,
    },
    /// Run the end-to-end fleet scenarios against the real binaries.
    E2e {
        /// Instead: the manual check against this machine's real Xcode and/or Android SDK.
        #[arg(long)]
        real_devices: bool,
    },
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
        Command::Bench { which } => bench::run(which),
        Command::E2e { real_devices } => e2e::run(real_devices),
        Command::Fleet { once } => fleet::run(once),
    };
    match result {
        Ok(code) => code,
        Err(error) => {
            eprintln!("xtask: error: {error:#}");
            ExitCode::FAILURE
        }
    }
}
