//! `cargo xtask bench [link|relay|fleet|agent-device|all] [--tls]`: runs the benchmarks and collects the final
//! `<name> key=value ...` line each one prints.

use std::process::ExitCode;

use anyhow::Result;
use clap::ValueEnum;

use crate::{cmd, metadata::Workspace};

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub(crate) enum Which {
    /// simlock-link's channel throughput and latency over an in-memory pair.
    Link,
    /// The relay path through a gateway and a worker over loopback sockets.
    Relay,
    /// A 256 MiB agent-device upload through a worker's `/v1/agent-device`, against straight to
    /// the daemon.
    AgentDevice,
    /// The fleet core's simulation (10 000 seeds) and lease cycles over HTTP through a gateway
    /// and two workers, against one worker directly.
    Fleet,
    /// Every benchmark that exists.
    All,
}

/// A benchmark: the package and `[[bench]]` target that run it. Its result line starts with `name`.
struct Bench {
    name: &'static str,
    package: &'static str,
    target: &'static str,
    /// Whether it has a `--tls` variant.
    tls: bool,
}

const BENCHES: &[Bench] = &[
    Bench {
        name: "link",
        package: "simlock-link",
        target: "link",
        tls: false,
    },
    Bench {
        name: "relay",
        package: "simlock-e2e",
        target: "relay",
        tls: true,
    },
    Bench {
        name: "fleet",
        package: "simlock-e2e",
        target: "fleet",
        tls: false,
    },
    Bench {
        name: "agent-device",
        package: "simlock-e2e",
        target: "agent_device",
        tls: false,
    },
];

pub(crate) fn run(which: Which, tls: bool) -> Result<ExitCode> {
    let workspace = Workspace::load()?;
    let no_tls_variant = match which {
        Which::Link => Some(("link", "the link bench has no sockets")),
        Which::Fleet => Some(("fleet", "only the relay bench has one")),
        Which::AgentDevice => Some(("agent-device", "only the relay bench has one")),
        Which::Relay | Which::All => None,
    };
    if let (true, Some((name, why))) = (tls, no_tls_variant) {
        eprintln!("bench {name}: there is no --tls variant ({why})");
        return Ok(ExitCode::FAILURE);
    }
    if matches!(which, Which::AgentDevice | Which::All) && !tls {
        crate::peers::fetch_agent_device()?;
    }
    let selected = BENCHES.iter().filter(|bench| match which {
        Which::Link => bench.name == "link",
        Which::Relay => bench.name == "relay",
        Which::AgentDevice => bench.name == "agent-device",
        Which::Fleet => bench.name == "fleet",
        // With --tls, only the benches that have a TLS variant.
        Which::All => !tls || bench.tls,
    });
    let mut results = Vec::new();
    let mut failed = Vec::new();
    let mut unavailable = Vec::new();
    for bench in selected {
        let missing = match workspace.package(bench.package) {
            None => Some(format!("package `{}` does not exist yet", bench.package)),
            Some(package) if !package.has_target("bench", bench.target) => Some(format!(
                "package `{}` has no bench target `{}` yet",
                bench.package, bench.target
            )),
            Some(_) => None,
        };
        if let Some(why) = missing {
            println!("bench {}: not yet available: {why}", bench.name);
            unavailable.push(bench.name);
            continue;
        }
        let mut command = cmd::cargo([
            "bench",
            "--locked",
            "-p",
            bench.package,
            "--bench",
            bench.target,
        ]);
        if tls {
            command.args(["--", "--tls"]);
        }
        println!("== bench {}: {}", bench.name, cmd::display(&command));
        let (status, lines) = cmd::status_with_lines(command)?;
        if !status.success() {
            eprintln!("bench {}: failed ({status})", bench.name);
            failed.push(bench.name);
            continue;
        }
        match result_line(bench.name, &lines) {
            Some(line) => results.push(line.to_owned()),
            None => {
                eprintln!(
                    "bench {}: finished without a final `{} key=value ...` line",
                    bench.name, bench.name
                );
                failed.push(bench.name);
            }
        }
    }

    if which == Which::All {
        println!();
        println!("== bench results");
        for line in &results {
            println!("{line}");
        }
        for name in &unavailable {
            println!("{name} (not yet available)");
        }
        for name in &failed {
            println!("{name} (FAILED)");
        }
    }
    let ok = failed.is_empty() && (which == Which::All || unavailable.is_empty());
    Ok(if ok {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    })
}

/// The last line of the form `<name> key=value ...` (at least one `key=value`, nothing else).
fn result_line<'a>(name: &str, lines: &'a [String]) -> Option<&'a str> {
    lines.iter().rev().map(String::as_str).find(|line| {
        let mut words = line.split_whitespace();
        words.next() == Some(name) && {
            let mut pairs = words.peekable();
            pairs.peek().is_some()
                && pairs.all(|pair| pair.split_once('=').is_some_and(|(key, _)| !key.is_empty()))
        }
    })
}

#[cfg(test)]
mod tests {
    use super::result_line;

    #[test]
    fn the_last_result_line_is_collected() {
        let lines: Vec<String> = [
            "     Running benches/link.rs",
            "link warmup=1",
            "link channels=64 mib_per_s=812.5 p99_us=41",
            "some trailing note",
        ]
        .map(str::to_owned)
        .to_vec();
        assert_eq!(
            result_line("link", &lines),
            Some("link channels=64 mib_per_s=812.5 p99_us=41")
        );
        assert_eq!(result_line("relay", &lines), None);
    }

    #[test]
    fn lines_that_are_not_key_value_pairs_are_skipped() {
        let lines: Vec<String> = ["link ok", "link", "linked a=1", "link =1"]
            .map(str::to_owned)
            .to_vec();
        assert_eq!(result_line("link", &lines), None);
    }
}
