//! The simlock command-line interface, for agents and operators: composition of clap, the
//! typed client and the views. Results go to stdout (one JSON document with `--json`), messages
//! and progress to stderr; the exit code comes from the contract's error table.

mod cli;
mod duration;
mod identity;
mod lease;
mod mcp;
mod pidwatch;
mod stderr;
mod view;

use std::collections::HashSet;
use std::io::Write as _;
use std::process::ExitCode;

use clap::Parser as _;
use serde::Serialize;
use serde_json::{Value, json};
use simlock_client::client::{admin_secret_in, home_from_env};
use simlock_client::{Client, ConnectOptions, ExecEvent, FollowItem};
use simlock_contract::ops::{CancelResult, ExecInput, LeaseIdInput, ListKind, ListOutput};
use simlock_contract::push::OutputStream;
use simlock_contract::{ContractError, ErrorCode};

use crate::cli::{Cli, Command, TokenCommand, WorkersCommand};

fn main() -> ExitCode {
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        Err(e) => {
            // `--help` and `--version` are not errors; anything else is bad usage.
            let _ = e.print();
            if !e.use_stderr() {
                return ExitCode::SUCCESS;
            }
            if asks_for_json(std::env::args_os().skip(1)) {
                // The command line did not parse, but it asked for JSON: the error document
                // goes to stdout as every other error's does.
                let err = ContractError::new(ErrorCode::Usage, usage_message(&e));
                let _ = out_line(&json!({ "error": err.to_body() }).to_string());
            }
            return ExitCode::from(ErrorCode::Usage.exit_code());
        }
    };
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
    {
        Ok(runtime) => runtime,
        Err(e) => {
            say_err(&format!("simlock: cannot start: {e}"));
            return ExitCode::from(1);
        }
    };
    let json = cli.json;
    let code = runtime.block_on(async move {
        match execute(&cli).await {
            Ok(code) => code,
            Err(err) => fail(json, &err),
        }
    });
    // Background work (a hold's event stream) must not keep the process alive.
    runtime.shutdown_background();
    // A command whose result could not be written did not do its job for its caller.
    if code == 0 && OUTPUT_LOST.load(std::sync::atomic::Ordering::SeqCst) {
        return ExitCode::from(1);
    }
    ExitCode::from(code)
}

/// What `exec` exits with when its output's reader went away before the tool ended: what a
/// program killed by SIGPIPE exits with in a shell (128 + 13).
const EXIT_BROKEN_PIPE: u8 = 141;

/// Set once a result could not be written to stdout (a full disk; not a reader that went away,
/// which nobody is owed a status for): the command then exits 1, not 0.
static OUTPUT_LOST: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Whether a command line that did not parse asked for `--json` (before any `--`).
fn asks_for_json(args: impl IntoIterator<Item = std::ffi::OsString>) -> bool {
    args.into_iter()
        .take_while(|arg| arg != "--")
        .any(|arg| arg == "--json")
}

/// clap's error as one line: what it says before its usage and tips, without the `error: ` it
/// begins with.
fn usage_message(e: &clap::Error) -> String {
    let rendered = e.render().to_string();
    let said: Vec<&str> = rendered
        .lines()
        .map(str::trim)
        .take_while(|line| !line.is_empty() && !line.starts_with("Usage:"))
        .collect();
    let said = said.join(" ");
    said.strip_prefix("error: ").unwrap_or(&said).to_owned()
}

/// Reports an error: one line on stderr, and with `--json` the error document on stdout
/// (`{"error": {code, message, details?}}`, the contract's error body); answers the exit code
/// from the error table.
pub(crate) fn fail(json: bool, err: &ContractError) -> u8 {
    say_err(&format!("simlock: {} ({})", err.message, err.code));
    if json {
        let _ = out_line(&json!({ "error": err.to_body() }).to_string());
    }
    err.code.exit_code()
}

/// Writes one line to stdout. A closed stdout (the reader went away) is not a crash: the error
/// is answered so a loop can stop.
pub(crate) fn out_line(text: &str) -> std::io::Result<()> {
    let mut out = std::io::stdout().lock();
    // One write: a result that fits a pipe's atomic write (4 KiB) reaches its reader whole or
    // not at all, so a grant is never half told (then given back as unreported).
    out.write_all(format!("{text}\n").as_bytes())?;
    out.flush()
}

/// Prints a result: its JSON with `--json`, else the human view. Answers whether it was
/// written; one that could not be is said on stderr, and the command exits 1.
pub(crate) fn emit<T: Serialize>(json: bool, value: &T, human: impl FnOnce(&T) -> String) -> bool {
    let text = if json {
        match serde_json::to_value(value) {
            Ok(value) => value.to_string(),
            Err(e) => {
                say_err(&format!("simlock: the result could not be encoded: {e}"));
                return false;
            }
        }
    } else {
        human(value)
    };
    match out_line(&text) {
        Ok(()) => true,
        Err(e) => {
            output_failed(&e, "the result");
            false
        }
    }
}

/// `what` could not be written to stdout: its reader went away (`| head`: nobody is owed it,
/// so no failure), or it failed (a full disk: said on stderr, and the command exits 1).
fn output_failed(e: &std::io::Error, what: &str) {
    if e.kind() != std::io::ErrorKind::BrokenPipe {
        OUTPUT_LOST.store(true, std::sync::atomic::Ordering::SeqCst);
        say_err(&format!(
            "simlock: {what} could not be written to standard output: {e}"
        ));
    }
}

/// Writes `line` to stderr; one that cannot be written (a full disk) is lost, never a panic.
pub(crate) fn say_err(line: &str) {
    let _ = writeln!(std::io::stderr(), "{line}");
}

/// Where a command connects: a daemon's HTTP API (`--url`), else the local socket.
#[derive(Debug, Clone)]
pub(crate) struct Target {
    home: std::path::PathBuf,
    url: Option<String>,
    token: Option<String>,
    ca_file: Option<std::path::PathBuf>,
    admin: bool,
}

impl Target {
    /// The target the command line names.
    pub(crate) fn of(cli: &Cli) -> Self {
        let nonempty = |s: &Option<String>| s.clone().filter(|s| !s.trim().is_empty());
        Self {
            home: cli
                .home
                .clone()
                .filter(|path| !path.as_os_str().is_empty())
                .unwrap_or_else(home_from_env),
            url: nonempty(&cli.url),
            token: nonempty(&cli.token),
            ca_file: cli
                .ca_file
                .clone()
                .filter(|path| !path.as_os_str().is_empty()),
            admin: cli.command.needs_admin(),
        }
    }

    /// Checks what can be checked before connecting: over HTTP, the token is given and the CA
    /// file reads (an HTTP client connects when it first calls).
    ///
    /// # Errors
    /// `USAGE` or `BAD_REQUEST` naming the flag.
    pub(crate) fn check(&self) -> Result<(), ContractError> {
        if self.url.is_some() {
            self.http()?;
        }
        Ok(())
    }

    /// The HTTP client of `--url`.
    fn http(&self) -> Result<Client, ContractError> {
        let (Some(url), Some(token)) = (&self.url, &self.token) else {
            return Err(ContractError::new(
                ErrorCode::Usage,
                "--url needs a token: pass --token or set SIMLOCK_TOKEN",
            ));
        };
        let options = ConnectOptions {
            ca_file: self.ca_file.clone(),
            ..ConnectOptions::default()
        };
        Client::over_http(url, token, options)
    }

    /// Connects: over HTTP with `--url`, else to the local socket. There, a `--token` given is
    /// always sent as the credential (an operator's token sees and acts on every lease, as over
    /// HTTP); without one, commands that need admin send the daemon's admin secret.
    pub(crate) async fn connect(&self) -> Result<Client, ContractError> {
        if self.url.is_some() {
            return self.http();
        }
        let home = &self.home;
        let options = ConnectOptions {
            credential: self
                .token
                .clone()
                .or_else(|| self.admin.then(|| admin_secret_in(home)).flatten()),
            ..ConnectOptions::default()
        };
        Client::connect_home(home, options).await.map_err(|mut e| {
            if e.code == ErrorCode::AdminAuthenticationFailed && self.token.is_some() {
                e.message = format!(
                    "{}: on the socket, --token must be an operator token (an agent's token works with --url)",
                    e.message
                );
            }
            e
        })
    }
}

async fn execute(cli: &Cli) -> Result<u8, ContractError> {
    let json = cli.json;
    let target = Target::of(cli);
    if let Command::Mcp(args) = &cli.command {
        // The MCP server connects when a tool first needs the daemon, and again after a loss.
        return mcp::run(target, args).await;
    }
    let client = target.connect().await?;
    match &cli.command {
        Command::Lease(args) => lease::run(json, &target, client, args).await,
        Command::Renew { lease_id, ttl } => {
            let record = client.renew(lease_id, *ttl).await?;
            emit(json, &record, |r| {
                format!(
                    "renewed lease {}; expires {} (ttl {})",
                    r.id,
                    view::relative(r.ttl_deadline),
                    view::duration(r.ttl_ms)
                )
            });
            Ok(0)
        }
        Command::Cancel { requester } => {
            let requester = identity::from_environment(requester.as_deref()).id();
            let out = client.cancel(Some(requester.clone())).await?;
            emit(json, &out, |o| match o.result {
                CancelResult::Cancelled => {
                    format!("withdrew the waiting lease request of {requester}")
                }
                CancelResult::NotFound => format!("{requester} has no waiting lease request"),
                CancelResult::NotCancellable => format!(
                    "the request of {requester} is being served already (a device is being \
                     made ready for it): release its lease once it is granted"
                ),
            });
            Ok(0)
        }
        Command::Release { lease_id, all } => {
            if *all {
                let out = client.release_all().await?;
                emit(json, &out, |o| {
                    if o.lease_ids.is_empty() {
                        "no leases to release".to_owned()
                    } else {
                        format!(
                            "released {} lease(s): {}",
                            o.lease_ids.len(),
                            o.lease_ids.join(", ")
                        )
                    }
                });
            } else {
                let id = lease_id.as_deref().unwrap_or_default();
                let out = client.release(id).await?;
                emit(json, &out, |o| format!("released lease {}", o.lease_id));
            }
            Ok(0)
        }
        Command::Status => {
            let status = client.status().await?;
            let scope = lease_scope(&client);
            emit(json, &status, |s| view::status(s, scope));
            Ok(0)
        }
        Command::Catalog { platform } => {
            let catalog = client.catalog(platform.map(Into::into)).await?;
            emit(json, &catalog, view::catalog);
            Ok(0)
        }
        Command::Devices => {
            let list = client.list(ListKind::Devices).await?;
            emit(json, &list, |list| match list {
                ListOutput::Devices(devices) => view::devices(devices),
                other => serde_json::to_string(other).unwrap_or_default(),
            });
            Ok(0)
        }
        Command::Leases { all: true } => {
            // A gateway lists the leases of the workers it has read and names the others in
            // `lease.list`'s `unreadWorkers`; a worker, an older gateway, or one whose answer
            // fails, adds no note. The list and the note asked at once.
            let (list, unread) = tokio::join!(client.list(ListKind::Leases), async {
                if json {
                    return None;
                }
                let own = client.leases().await.ok()?;
                view::unread_workers(&own.unread_workers)
            });
            let list = list?;
            emit(json, &list, |list| match list {
                ListOutput::Leases(leases) => {
                    let mut out = view::leases(leases, view::LeaseScope::Every);
                    if let Some(note) = &unread {
                        out.push('\n');
                        out.push_str(note);
                    }
                    out
                }
                other => serde_json::to_string(other).unwrap_or_default(),
            });
            Ok(0)
        }
        Command::Leases { all: false } => {
            let list = client.leases().await?;
            let scope = lease_scope(&client);
            emit(json, &list, |l| {
                let mut out = view::leases(&l.leases, scope);
                if let Some(note) = view::unread_workers(&l.unread_workers) {
                    out.push('\n');
                    out.push_str(&note);
                }
                out
            });
            Ok(0)
        }
        Command::Token(command) => token(json, &client, command).await,
        Command::Events { follow, since } => events(json, &client, *follow, *since).await,
        Command::Env { lease_id } => env(json, &client, lease_id).await,
        Command::Exec { lease_id, command } => match command.split_first() {
            Some((tool, args)) => exec(json, &client, lease_id, tool, args).await,
            None => Err(ContractError::bad_request("exec: name the tool to run")),
        },
        Command::Workers { command } => workers(json, &client, command.as_ref()).await,
        Command::Stop => {
            let out = client.stop_daemon().await?;
            emit(json, &out, |_| "the daemon is stopping".to_owned());
            Ok(0)
        }
        Command::Mcp(_) => Err(ContractError::internal(
            "simlock mcp runs before connecting",
        )),
    }
}

/// Whose leases the session's `lease.list` answers: every one for an admin, the caller's own
/// for an agent on the socket; over HTTP the CLI does not know the token's role.
fn lease_scope(client: &Client) -> view::LeaseScope<'_> {
    view::LeaseScope::of(client.role().zip(client.principal()))
}

async fn token(json: bool, client: &Client, command: &TokenCommand) -> Result<u8, ContractError> {
    match command {
        TokenCommand::Create { role, label } => {
            let out = client.token_create((*role).into(), label.clone()).await?;
            emit(json, &out, |o| {
                format!(
                    "created {} token {}{}\nsecret (shown once): {}",
                    o.token.role.as_str(),
                    o.token.id,
                    o.token
                        .label
                        .as_deref()
                        .map(|l| format!(" ({l})"))
                        .unwrap_or_default(),
                    o.secret
                )
            });
        }
        TokenCommand::List => {
            let out = client.token_list().await?;
            emit(json, &out, |o| view::tokens(&o.tokens));
        }
        TokenCommand::Revoke { id } => {
            let out = client.token_revoke(id).await?;
            if !out.revoked {
                // Revoking is idempotent over HTTP; on the command line an id that names no
                // token is most often a typo, and the token the operator meant is still live.
                if json {
                    emit(json, &out, |_| String::new());
                } else {
                    say_err(&format!(
                        "simlock: no token {id} is known to this daemon; nothing was revoked"
                    ));
                }
                return Ok(1);
            }
            emit(json, &out, |_| format!("revoked token {id}"));
        }
    }
    Ok(0)
}

async fn workers(
    json: bool,
    client: &Client,
    command: Option<&WorkersCommand>,
) -> Result<u8, ContractError> {
    match command {
        None | Some(WorkersCommand::List) => {
            let out = client.workers().await?;
            emit(json, &out, |o| view::workers(&o.workers));
        }
        Some(WorkersCommand::Drain { id }) => {
            let out = client.worker_drain(id).await?;
            emit(json, &out, |o| {
                let already = if o.changed { "is" } else { "was already" };
                format!(
                    "worker {} {already} drained: it takes no new leases",
                    o.worker_id
                )
            });
        }
        Some(WorkersCommand::Undrain { id }) => {
            let out = client.worker_undrain(id).await?;
            emit(json, &out, |o| {
                if o.changed {
                    format!("worker {} takes new leases again", o.worker_id)
                } else {
                    format!(
                        "worker {} was not drained: it takes new leases",
                        o.worker_id
                    )
                }
            });
        }
        Some(WorkersCommand::Remove { id }) => {
            let out = client.worker_remove(id).await?;
            if !out.removed {
                // Removing is idempotent over HTTP; on the command line a name that matches no
                // worker is most often a typo: an UNKNOWN_WORKER error, in JSON as any error.
                return Err(ContractError::new(
                    ErrorCode::UnknownWorker,
                    format!(
                        "no worker {} is known to this gateway; nothing was removed",
                        out.worker_id
                    ),
                ));
            }
            emit(json, &out, |o| format!("forgot worker {}", o.worker_id));
        }
    }
    Ok(0)
}

async fn events(
    json: bool,
    client: &Client,
    follow: bool,
    since_ms: Option<u64>,
) -> Result<u8, ContractError> {
    let since_ts =
        since_ms.map(|ms| view::now_ms().saturating_sub(i64::try_from(ms).unwrap_or(i64::MAX)));
    if !follow {
        let out = client.events(since_ts).await?;
        emit(json, &out, |o| {
            if o.events.is_empty() {
                "no events".to_owned()
            } else {
                o.events
                    .iter()
                    .map(view::event)
                    .collect::<Vec<_>>()
                    .join("\n")
            }
        });
        return Ok(0);
    }
    // Follow first, then replay, so nothing falls between the two; drop the overlap.
    let signals = lease::Signals::listen()?;
    let mut stream = client.follow_events().await?;
    let replay = client.events(since_ts).await?;
    let mut replayed: HashSet<String> = HashSet::new();
    for event in &replay.events {
        if print_event(json, event).is_err() {
            return Ok(0);
        }
        replayed.insert(event.id.to_string());
    }
    loop {
        let item = tokio::select! {
            item = stream.next() => item,
            () = signals.nth(1) => return Ok(0),
        };
        match item {
            Some(Ok(FollowItem::Event(event))) => {
                if !replayed.remove(event.id.as_str()) && print_event(json, &event).is_err() {
                    return Ok(0);
                }
            }
            Some(Ok(FollowItem::Lagged { missed })) => {
                say_err(&format!(
                    "simlock: fell behind; {missed} event(s) were skipped"
                ));
            }
            Some(Err(e)) => return Err(e),
            None => return Ok(0),
        }
    }
}

fn print_event(json: bool, event: &simlock_contract::model::EventEnvelope) -> std::io::Result<()> {
    if json {
        out_line(
            &serde_json::to_value(event)
                .unwrap_or(Value::Null)
                .to_string(),
        )
    } else {
        out_line(&view::event(event))
    }
}

/// `simlock env`: the lease's environment (the same the grant and `simlock exec` carry), as
/// `export` lines, or with `--json` as `{"environment": {…}}`.
async fn env(json: bool, client: &Client, lease_id: &str) -> Result<u8, ContractError> {
    // A malformed id is refused as renew and release refuse it, not looked for.
    simlock_contract::decode_input::<LeaseIdInput>(Some(json!({ "leaseId": lease_id })))?;
    let lease = client.lease(lease_id).await?;
    let Some(access) = &lease.access else {
        return Err(ContractError::new(
            ErrorCode::Internal,
            format!("the daemon did not say how to reach the device of lease {lease_id}"),
        ));
    };
    let environment = access.environment(lease_id, &lease.device_id);
    emit(json, &json!({ "environment": environment }), |_| {
        environment
            .iter()
            .map(|(key, value)| format!("export {key}={}", view::shell_quote(value)))
            .collect::<Vec<_>>()
            .join("\n")
    });
    Ok(0)
}

async fn exec(
    json: bool,
    client: &Client,
    lease_id: &str,
    tool: &str,
    args: &[String],
) -> Result<u8, ContractError> {
    let mut stream = client
        .exec(ExecInput {
            lease_id: lease_id.to_owned(),
            tool: tool.to_owned(),
            args: args.to_vec(),
            stdin: None,
            requester_id: None,
        })
        .await?;
    loop {
        match stream.next().await {
            Some(Ok(ExecEvent::Output { stream, chunk })) => {
                let written = if json {
                    out_line(&json!({ "output": { "stream": stream, "chunk": chunk } }).to_string())
                } else if stream == OutputStream::Stderr {
                    // What stderr cannot take is lost, as every line the CLI says there.
                    let mut err = std::io::stderr().lock();
                    let _ = err.write_all(chunk.as_bytes()).and_then(|()| err.flush());
                    Ok(())
                } else {
                    let mut out = std::io::stdout().lock();
                    out.write_all(chunk.as_bytes()).and_then(|()| out.flush())
                };
                if let Err(e) = written {
                    // Nobody reads the tool's output any more: the CLI stops following it (the
                    // tool runs on to its end or its time limit, as for any caller that leaves).
                    // Its exit code is not known: a reader that went away gets what a program
                    // killed by SIGPIPE exits with (a pipeline with pipefail does not pass),
                    // another failure 1, said.
                    if e.kind() == std::io::ErrorKind::BrokenPipe {
                        return Ok(EXIT_BROKEN_PIPE);
                    }
                    output_failed(&e, "the tool's output");
                    return Ok(0);
                }
            }
            Some(Ok(ExecEvent::Exit { exit_code })) => {
                if json && let Err(e) = out_line(&json!({ "exitCode": exit_code }).to_string()) {
                    output_failed(&e, "the tool's exit code");
                }
                return Ok(u8::try_from(exit_code).unwrap_or(1));
            }
            Some(Err(e)) => return Err(e),
            None => {
                return Err(ContractError::new(
                    ErrorCode::DaemonConnectionLost,
                    "the exec ended without the tool's exit code",
                ));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use clap::Parser as _;

    use super::*;

    #[test]
    fn a_command_line_that_does_not_parse_says_why_in_one_line_and_whether_json_was_asked() {
        let e = Cli::try_parse_from(["simlock", "--json", "lease"]).unwrap_err();
        assert!(e.use_stderr());
        assert_eq!(
            usage_message(&e),
            "the following required arguments were not provided: --platform <PLATFORM>"
        );
        let e = Cli::try_parse_from(["simlock", "--json", "bogus"]).unwrap_err();
        assert_eq!(usage_message(&e), "unrecognized subcommand 'bogus'");
        let args = |list: &[&str]| {
            list.iter()
                .map(std::ffi::OsString::from)
                .collect::<Vec<_>>()
        };
        assert!(asks_for_json(args(&["--json", "lease"])));
        assert!(asks_for_json(args(&["renew", "L", "--ttl", "x", "--json"])));
        assert!(!asks_for_json(args(&["lease"])));
        assert!(
            !asks_for_json(args(&["exec", "L", "tool", "--", "--json"])),
            "a tool's own argument"
        );
    }
}
