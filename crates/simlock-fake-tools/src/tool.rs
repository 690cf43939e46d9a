//! What every fake does around its own work: find its machine, log the call, register the
//! process while it runs, and apply the fault a test injected into the command.

use std::process::ExitCode;
use std::time::Duration;

use crate::machine::{FakeMachine, FaultKind};

/// What the body of a fake answers.
pub type Outcome = Result<(), Exit>;

/// A fake's failure: the message for stderr and the exit code.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Exit {
    /// The exit code.
    pub code: u8,
    /// What goes to stderr (nothing when empty).
    pub stderr: String,
}

impl Exit {
    /// Exit `code` with `stderr`.
    pub fn new(code: u8, stderr: impl Into<String>) -> Self {
        Self {
            code,
            stderr: stderr.into(),
        }
    }
}

/// Runs a fake: `command` names the command for fault matching (from the arguments), `body`
/// does the work.
pub fn run(
    tool: &str,
    command: impl FnOnce(&[String]) -> String,
    body: impl FnOnce(&FakeMachine, &[String]) -> Outcome,
) -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let machine = match FakeMachine::of_invocation() {
        Ok(m) => m,
        Err(e) => {
            eprintln!("{e}");
            return ExitCode::from(70);
        }
    };
    machine.log_call(tool, &args);
    machine.register(tool, &args);
    let command = command(&args);
    let outcome = match machine.take_fault(tool, &command) {
        Some(FaultKind::Exit { code, stderr }) => {
            Err(Exit::new(u8::try_from(code).unwrap_or(1), stderr))
        }
        Some(FaultKind::Garbage) => {
            println!("\u{1b}[31m<<garbled output %%% {{ \"not\": json ]]]\u{0}");
            Ok(())
        }
        Some(FaultKind::Hang) => loop {
            std::thread::sleep(Duration::from_secs(3600));
        },
        Some(FaultKind::Slow { ms }) => {
            std::thread::sleep(Duration::from_millis(ms));
            body(&machine, &args)
        }
        None => body(&machine, &args),
    };
    machine.unregister();
    match outcome {
        Ok(()) => ExitCode::SUCCESS,
        Err(exit) => {
            if !exit.stderr.is_empty() {
                eprintln!("{}", exit.stderr);
            }
            ExitCode::from(exit.code)
        }
    }
}
