//! The command line, as clap reads it.

use clap::{Args, Parser, Subcommand, ValueEnum};
use simlock_contract::model::{Platform, TokenRole};

use crate::duration::{parse_ms, timeout_ms, ttl_ms};

/// Lease iOS simulators and Android emulators from a simlock daemon.
///
/// Reaches the local daemon's socket, daemon.sock in its home (--home, else $SIMLOCK_HOME, else
/// ~/.simlock), unless --url names a daemon's HTTP API. Exit codes: 0 ok; 1 failure; 2 usage or bad request;
/// 10 timeout; 11 no capacity; 12 cannot be served; 13 requester already leased; 14 a held lease
/// was ended by the daemon; 130 a lease interrupted before it held one.
#[derive(Debug, Parser)]
#[command(name = "simlock", version)]
pub(crate) struct Cli {
    /// The local daemon's home, as given to it (`simlock-worker --home DIR`): the CLI reaches
    /// its socket there; default ~/.simlock. Not used with --url.
    #[arg(
        long,
        global = true,
        env = "SIMLOCK_HOME",
        value_name = "DIR",
        help_heading = "Connection"
    )]
    pub(crate) home: Option<std::path::PathBuf>,
    /// A daemon's HTTP base URL (http://host:port or https://host:port); default: the local
    /// socket.
    #[arg(
        long,
        global = true,
        env = "SIMLOCK_URL",
        value_name = "URL",
        help_heading = "Connection"
    )]
    pub(crate) url: Option<String>,
    /// The bearer token for --url; on the socket, an operator token: every command then sees
    /// and acts on every lease (without it, admin commands use the home's admin.token).
    #[arg(
        long,
        global = true,
        env = "SIMLOCK_TOKEN",
        hide_env_values = true,
        value_name = "TOKEN",
        help_heading = "Connection"
    )]
    pub(crate) token: Option<String>,
    /// CA certificates (PEM) an https:// daemon's certificate may chain to, besides the
    /// platform's roots.
    #[arg(
        long,
        global = true,
        env = "SIMLOCK_CA_FILE",
        value_name = "FILE",
        help_heading = "Connection"
    )]
    pub(crate) ca_file: Option<std::path::PathBuf>,
    /// Print one JSON document on stdout (the operation's output) instead of a human view.
    #[arg(long, global = true, help_heading = "Output")]
    pub(crate) json: bool,
    #[command(subcommand)]
    pub(crate) command: Command,
}

/// The commands.
#[derive(Debug, Subcommand)]
pub(crate) enum Command {
    /// Lease a device and hold it: renew until Ctrl-C or SIGTERM, then release.
    Lease(LeaseArgs),
    /// Renew a lease.
    Renew {
        /// The lease.
        lease_id: String,
        /// A new TTL: 15m, 1h30m, 90s, or milliseconds (default: the lease's own).
        #[arg(long, value_name = "DUR", value_parser = ttl_ms)]
        ttl: Option<u64>,
    },
    /// Release a lease, or every lease (--all, operators).
    Release {
        /// The lease.
        #[arg(required_unless_present = "all", conflicts_with = "all")]
        lease_id: Option<String>,
        /// Release every lease.
        #[arg(long)]
        all: bool,
    },
    /// Withdraw a waiting lease request (one whose `simlock lease` was killed, for example).
    Cancel {
        /// Whose request (default: the requester `simlock lease` would use here:
        /// $SIMLOCK_AGENT_ID when not blank, else the agent's session id, else the parent
        /// process). Operators may withdraw anyone's.
        #[arg(long, value_name = "ID", value_parser = requester_arg)]
        requester: Option<String>,
    },
    /// The daemon's status.
    Status,
    /// What devices can be had.
    Catalog {
        /// Only this platform.
        #[arg(long, value_enum)]
        platform: Option<PlatformArg>,
    },
    /// Devices (operators).
    Devices,
    /// Leases: yours (on the socket, your user's), or every lease with --all (operators).
    Leases {
        /// Every lease the daemon has, whoever made it (operators; on the socket the home's
        /// admin.token is sent).
        #[arg(long)]
        all: bool,
    },
    /// Tokens for HTTP and for workers joining a gateway (operators).
    #[command(subcommand)]
    Token(TokenCommand),
    /// Events: buffered ones, then new ones with --follow (operators).
    Events {
        /// Keep printing events as they happen.
        #[arg(long)]
        follow: bool,
        /// Only events this recent: 30s, 5m, 2h, 1d, 1h30m, 500ms.
        #[arg(long, value_name = "DUR", value_parser = parse_ms)]
        since: Option<u64>,
    },
    /// Print the shell exports that point tools at a leased device (eval "$(simlock env LEASE)").
    Env {
        /// The lease.
        lease_id: String,
    },
    /// Run a tool against a leased device; its output streams, and its exit code is ours.
    ///
    /// Everything after the tool is its own, passed on as given (`--json` or `--help` included);
    /// simlock's flags go before the lease id.
    Exec {
        /// The lease.
        lease_id: String,
        /// The tool (one the daemon allows), then its arguments.
        #[arg(
            required = true,
            num_args = 1..,
            trailing_var_arg = true,
            allow_hyphen_values = true,
            value_name = "TOOL [ARGS]"
        )]
        command: Vec<String>,
    },
    /// Workers a gateway knows (operators); default: list.
    Workers {
        #[command(subcommand)]
        command: Option<WorkersCommand>,
    },
    /// Stop the daemon (operators).
    Stop,
    /// Serve MCP over stdio for a coding agent: lease, hold and release devices for its session.
    ///
    /// Register it with the agent CLI as a stdio server (docs/MCP.md). Its leases are renewed
    /// while the session lasts and released when it ends: stdin closes, SIGTERM or SIGINT, or the
    /// agent that started it exits.
    Mcp(McpArgs),
}

/// `simlock mcp`.
#[derive(Debug, Args)]
pub(crate) struct McpArgs {
    /// Who the session's leases are for (default: $SIMLOCK_AGENT_ID when not blank, else the
    /// agent's session id, else the parent process; see docs/MCP.md).
    #[arg(long, value_name = "ID", value_parser = requester_arg)]
    pub(crate) requester: Option<String>,
}

/// `simlock lease`.
#[derive(Debug, Args)]
pub(crate) struct LeaseArgs {
    /// The platform.
    #[arg(long, value_enum)]
    pub(crate) platform: PlatformArg,
    /// A model name or alias (e.g. "iPhone 16").
    #[arg(long, value_name = "MODEL")]
    pub(crate) device: Option<String>,
    /// An OS version.
    #[arg(long, value_name = "VERSION")]
    pub(crate) os: Option<String>,
    /// The lease's TTL: 15m, 1h30m, 90s, or milliseconds (default: the daemon's).
    #[arg(long, value_name = "DUR", value_parser = ttl_ms)]
    pub(crate) ttl: Option<u64>,
    /// Fail with exit 11 instead of waiting when no device is free. (Through a gateway, a
    /// request also fails with exit 11 at once, without this flag, when no connected worker
    /// takes requests: none is connected, as right after the gateway restarts, or every one is
    /// drained.)
    #[arg(long)]
    pub(crate) no_wait: bool,
    /// The longest to wait in the queue: 90s, 5m, or milliseconds (then exit 10).
    #[arg(long, value_name = "DUR", value_parser = timeout_ms)]
    pub(crate) timeout: Option<u64>,
    /// Who the lease is for (default: $SIMLOCK_AGENT_ID when not blank, else the agent's session
    /// id, else the parent process; see docs/MCP.md).
    #[arg(long, value_name = "ID", value_parser = requester_arg)]
    pub(crate) requester: Option<String>,
    /// A capability the serving worker must have (repeatable).
    #[arg(long = "requires", value_name = "CAP")]
    pub(crate) requires: Vec<String>,
    /// Print the grant and exit without holding the lease (it lives until its TTL unless renewed).
    #[arg(long, conflicts_with = "bind_pid")]
    pub(crate) detach: bool,
    /// Release the lease once this process exits (checked at least every second), as when the
    /// hold itself is stopped.
    #[arg(long, value_name = "PID")]
    pub(crate) bind_pid: Option<u32>,
}

/// `simlock token …`.
#[derive(Debug, Subcommand)]
pub(crate) enum TokenCommand {
    /// Mint a token; its secret is shown once.
    Create {
        /// What it may do.
        #[arg(long, value_enum)]
        role: RoleArg,
        /// A label for people.
        #[arg(long)]
        label: Option<String>,
    },
    /// List tokens (never their secrets).
    List,
    /// Revoke a token.
    Revoke {
        /// The token's id (tok_…).
        id: String,
    },
}

/// `simlock workers …`.
#[derive(Debug, Subcommand)]
pub(crate) enum WorkersCommand {
    /// List workers.
    List,
    /// Take no new leases on a worker (through the gateway).
    Drain {
        /// The worker: its id, or its label when no other worker has it.
        id: String,
    },
    /// Take new leases on a worker again.
    Undrain {
        /// The worker: its id, or its label when no other worker has it.
        id: String,
    },
    /// Forget a disconnected worker; exits 12 (UNKNOWN_WORKER) when the gateway knows no such
    /// worker.
    Remove {
        /// The worker: its id, or its label when no other worker has it.
        id: String,
    },
}

/// A platform on the command line.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub(crate) enum PlatformArg {
    /// iOS simulators.
    Ios,
    /// Android emulators.
    Android,
}

impl From<PlatformArg> for Platform {
    fn from(arg: PlatformArg) -> Self {
        match arg {
            PlatformArg::Ios => Self::Ios,
            PlatformArg::Android => Self::Android,
        }
    }
}

/// A token role on the command line.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub(crate) enum RoleArg {
    /// Leases for itself.
    Agent,
    /// Operates the daemon.
    Operator,
    /// Joins a worker to a gateway.
    Worker,
}

impl From<RoleArg> for TokenRole {
    fn from(arg: RoleArg) -> Self {
        match arg {
            RoleArg::Agent => Self::Agent,
            RoleArg::Operator => Self::Operator,
            RoleArg::Worker => Self::Worker,
        }
    }
}

impl Command {
    /// Whether the command needs the admin role (on the socket, the admin secret is then sent).
    pub(crate) const fn needs_admin(&self) -> bool {
        match self {
            Self::Release { all, .. } | Self::Leases { all } => *all,
            Self::Devices
            | Self::Token(_)
            | Self::Events { .. }
            | Self::Workers { .. }
            | Self::Stop => true,
            Self::Lease(_)
            | Self::Renew { .. }
            | Self::Cancel { .. }
            | Self::Status
            | Self::Catalog { .. }
            | Self::Env { .. }
            | Self::Exec { .. }
            | Self::Mcp(_) => false,
        }
    }
}

/// `--requester`: named on the command line, a requester is never blank (a blank
/// `SIMLOCK_AGENT_ID`, which an agent's configuration may leave empty, is read as unset instead).
fn requester_arg(text: &str) -> Result<String, String> {
    let id = text.trim();
    if id.is_empty() {
        return Err(
            "a requester cannot be blank: name one, or leave --requester out for the default \
             (docs/MCP.md)"
                .to_owned(),
        );
    }
    Ok(id.to_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_command_line_is_consistent() {
        use clap::CommandFactory as _;
        Cli::command().debug_assert();
    }

    /// What `simlock <args>` runs as `exec`: the lease, the tool and its arguments, and whether
    /// simlock's own `--json` was given.
    fn exec_of(args: &[&str]) -> (String, Vec<String>, bool) {
        let cli = Cli::try_parse_from(std::iter::once("simlock").chain(args.iter().copied()))
            .unwrap_or_else(|e| panic!("{args:?}: {e}"));
        match cli.command {
            Command::Exec { lease_id, command } => (lease_id, command, cli.json),
            other => panic!("not exec: {other:?}"),
        }
    }

    #[test]
    fn everything_after_the_tool_is_the_tools_own_even_simlocks_flags() {
        for tail in [
            &["--json"][..],
            &["--token", "abc"],
            &["--help"],
            &["--url", "http://x"],
            &["-n", "hi"],
            &["--", "--json"],
        ] {
            let args: Vec<&str> = ["exec", "lse_1", "echo"]
                .iter()
                .chain(tail)
                .copied()
                .collect();
            let (lease, command, json) = exec_of(&args);
            assert_eq!(lease, "lse_1");
            let mut expected = vec!["echo".to_owned()];
            expected.extend(tail.iter().map(|s| (*s).to_owned()));
            assert_eq!(command, expected, "{args:?}");
            assert!(!json, "{args:?}: --json was the tool's");
        }
        // simlock's own flags before the lease id, or before the tool, are simlock's.
        let (_, command, json) = exec_of(&["--json", "exec", "lse_1", "echo", "x"]);
        assert_eq!(
            (command, json),
            (vec!["echo".to_owned(), "x".to_owned()], true)
        );
        let (_, command, json) = exec_of(&["exec", "lse_1", "--json", "echo"]);
        assert_eq!((command, json), (vec!["echo".to_owned()], true));
    }

    #[test]
    fn exec_without_a_tool_is_a_usage_error() {
        let error = Cli::try_parse_from(["simlock", "exec", "lse_1"]).unwrap_err();
        assert_eq!(
            error.kind(),
            clap::error::ErrorKind::MissingRequiredArgument
        );
    }
}
