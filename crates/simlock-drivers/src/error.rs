//! The one error type of the real drivers, and its one conversion into the port's
//! [`DriverError`].

use simlock_contract::model::Platform;
use simlock_core::DriverError;

/// What went wrong running a device tool.
#[derive(Debug, thiserror::Error)]
pub enum ToolError {
    /// The program could not be started.
    #[error("{program} could not be started: {source}")]
    Spawn {
        /// The program.
        program: String,
        /// Why.
        source: std::io::Error,
    },
    /// The call ran past its bound and was killed.
    #[error("`{command}` took longer than {ms} ms and was killed")]
    Timeout {
        /// The command line.
        command: String,
        /// The bound.
        ms: u64,
    },
    /// A device did not finish booting within its bound (`boot.*TimeoutMs`).
    #[error("{device} did not finish booting within {} s", ms / 1000)]
    BootTimeout {
        /// The device, as people know it ("the emulator of `<avd>`").
        device: String,
        /// The bound.
        ms: u64,
    },
    /// The tool exited with a failure.
    #[error("`{command}` failed ({status}): {}", first_line(stderr, stdout))]
    Failed {
        /// The command line.
        command: String,
        /// Its exit status, as text.
        status: String,
        /// Its exit code, when it exited.
        code: Option<i32>,
        /// What it wrote to stderr.
        stderr: String,
        /// What it wrote to stdout.
        stdout: String,
    },
    /// The tool answered what the driver cannot read.
    #[error("`{command}` printed what simlock cannot read ({what}): {detail}")]
    Garbled {
        /// The command line.
        command: String,
        /// What was expected.
        what: &'static str,
        /// What was wrong.
        detail: String,
    },
    /// A file or socket the driver keeps could not be used.
    #[error("{what}: {source}")]
    Io {
        /// What the driver was doing.
        what: String,
        /// Why it failed.
        source: std::io::Error,
    },
    /// The device or its tools are not in a state the operation can work from.
    #[error("{0}")]
    State(String),
}

fn first_line<'a>(stderr: &'a str, stdout: &'a str) -> &'a str {
    let text = if stderr.trim().is_empty() {
        stdout
    } else {
        stderr
    };
    text.lines()
        .map(str::trim)
        .find(|l| !l.is_empty())
        .unwrap_or("no output")
}

impl ToolError {
    /// An I/O failure while `what`.
    pub fn io(what: impl Into<String>, source: std::io::Error) -> Self {
        Self::Io {
            what: what.into(),
            source,
        }
    }

    /// Whether the tool failed and said `needle` (case-insensitive) on stderr or stdout.
    pub fn says(&self, needle: &str) -> bool {
        match self {
            Self::Failed { stderr, stdout, .. } => {
                let needle = needle.to_ascii_lowercase();
                stderr.to_ascii_lowercase().contains(&needle)
                    || stdout.to_ascii_lowercase().contains(&needle)
            }
            _ => false,
        }
    }

    /// The port's error for `platform`.
    pub fn into_driver(self, platform: Platform) -> DriverError {
        DriverError {
            platform,
            message: self.to_string(),
        }
    }
}

#[cfg(test)]
mod boot_timeout_tests {
    use super::*;

    /// Outside trial 12: a boot past its bound said "`the boot of <avd>` took longer than 5000 ms
    /// and was killed" (no command ran, and nothing was killed).
    #[test]
    fn a_boot_past_its_bound_says_so_and_nothing_more() {
        let e = ToolError::BootTimeout {
            device: "the emulator of simlock_dev_1".into(),
            ms: 5_000,
        };
        assert_eq!(
            e.to_string(),
            "the emulator of simlock_dev_1 did not finish booting within 5 s"
        );
    }
}
