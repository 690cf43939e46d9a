//! `simlock mcp`: an MCP server over stdio (the official SDK, `rmcp`) for one coding agent's
//! session. Its tools lease, hold, describe and release devices (`tools`); the session holds its
//! leases (`session`, over the plain-data `book`) and releases them when it ends: stdin closes,
//! SIGTERM or SIGINT, or the agent that started it exits (`pidwatch`). `docs/MCP.md` is the
//! guide; ADR 0019 records the choices.

mod book;
mod notify;
mod session;
mod tools;

use std::sync::Arc;

use book::Standing;
use rmcp::model::{
    CallToolRequestParams, CallToolResponse, Implementation, ListToolsResult,
    PaginatedRequestParams, ServerCapabilities, ServerConfig,
};
use rmcp::service::RequestContext;
use rmcp::{ErrorData as McpError, RoleServer, ServerHandler, ServiceExt as _};
use serde_json::Value;
use simlock_contract::ContractError;

use self::session::Session;
use crate::Target;
use crate::cli::McpArgs;
use crate::identity;
use crate::lease::Signals;
use crate::pidwatch::{Bound, CHECK_EVERY};

/// What the server tells the agent about itself at `initialize`.
const INSTRUCTIONS: &str = "simlock leases iOS simulators and Android emulators so parallel \
agents never share one. Call list_devices to see what can be leased, lease_simulator to get a \
device (it is held for this session and renewed for you), device_access for how to reach it, \
lease_status after a notification or a context compaction, and release_simulator when done; \
ending the session releases what it still holds.";

/// The MCP server of one session.
#[derive(Debug, Clone)]
pub(crate) struct SimlockMcp {
    session: Arc<Session>,
}

impl ServerHandler for SimlockMcp {
    fn get_info(&self) -> ServerConfig {
        #[expect(
            deprecated,
            reason = "logging carries the lease notifications the agent CLIs of today receive (ADR 0019)"
        )]
        let capabilities = ServerCapabilities::builder()
            .enable_tools()
            .enable_logging()
            .build();
        ServerConfig::new(capabilities)
            .with_server_info(
                Implementation::new("simlock", env!("CARGO_PKG_VERSION"))
                    .with_title("simlock device leases"),
            )
            .with_instructions(INSTRUCTIONS)
    }

    async fn list_tools(
        &self,
        _request: Option<PaginatedRequestParams>,
        _context: RequestContext<RoleServer>,
    ) -> Result<ListToolsResult, McpError> {
        let tools = tools::definitions().map_err(|e| McpError::internal_error(e.message, None))?;
        Ok(ListToolsResult::with_all_items(tools))
    }

    async fn call_tool(
        &self,
        request: CallToolRequestParams,
        context: RequestContext<RoleServer>,
    ) -> Result<CallToolResponse, McpError> {
        let arguments = Value::Object(request.arguments.unwrap_or_default());
        let Some(outcome) = tools::call(&self.session, &request.name, arguments, &context).await
        else {
            return Err(McpError::invalid_params(
                format!("simlock has no tool named {}", request.name),
                None,
            ));
        };
        let result = match outcome {
            Ok(value) => rmcp::model::CallToolResult::structured(value),
            Err(err) => tools::tool_error(&err),
        };
        Ok(result.into())
    }

    #[expect(
        deprecated,
        reason = "logging/setLevel sets the level of the lease notifications"
    )]
    async fn set_level(
        &self,
        request: rmcp::model::SetLevelRequestParams,
        _context: RequestContext<RoleServer>,
    ) -> Result<(), McpError> {
        self.session.notifier().set_level(request.level);
        Ok(())
    }
}

/// Why a session ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum End {
    /// The client closed stdin (or the transport failed).
    Closed,
    /// SIGTERM or SIGINT.
    Signalled,
    /// The process that started us exited.
    Orphaned,
}

/// Serves one MCP session on stdio until it ends, then releases what it holds.
pub(crate) async fn run(target: Target, args: &McpArgs) -> Result<u8, ContractError> {
    // A wrong --url, token or CA file is the server's configuration, not a tool's argument the
    // model could mend: it stops the server at start.
    target.check()?;
    let requester = identity::from_environment(args.requester.as_deref());
    // So is a requester no daemon takes: every lease would be refused.
    check_requester(&requester.id()).map_err(|why| {
        ContractError::bad_request(format!("the requester ({}) {why}", requester.source()))
    })?;
    let parent = Bound::parent();
    let signals = Signals::listen()?;
    crate::say_err(&format!(
        "simlock mcp: serving on stdio; leases are for {} ({}) and end with this session",
        requester.id(),
        requester.source()
    ));
    let session = Session::new(target, requester);
    let server = SimlockMcp {
        session: Arc::clone(&session),
    };
    let started = tokio::select! {
        started = server.serve(rmcp::transport::stdio()) => Some(started),
        () = signals.nth(1) => None,
        () = parent.gone(CHECK_EVERY) => None,
    };
    let end = match started {
        // The client left before the handshake finished: nothing was leased.
        Some(Err(e)) => {
            crate::say_err(&format!("simlock mcp: the session did not start: {e}"));
            return Ok(0);
        }
        None => return Ok(0),
        Some(Ok(service)) => {
            session.notifier().attach(service.peer().clone());
            let cancel = service.cancellation_token();
            let end = tokio::select! {
                _ = service.waiting() => End::Closed,
                () = signals.nth(1) => End::Signalled,
                () = parent.gone(CHECK_EVERY) => End::Orphaned,
            };
            cancel.cancel();
            end
        }
    };
    let held = session.close().await;
    crate::say_err(&format!(
        "simlock mcp: the session ended ({}); {}",
        match end {
            End::Closed => "stdin closed",
            End::Signalled => "signalled",
            End::Orphaned => "the agent exited",
        },
        closing_words(&held)
    ));
    Ok(0)
}

/// Why no daemon would take `id` as a lease's requester, if none would: a gateway adds its
/// prefix (ADR 0009), so a requester may be as long as the contract's bound less that.
fn check_requester(id: &str) -> Result<(), String> {
    let longest = simlock_contract::bounds::MAX_REQUESTER
        - simlock_contract::bounds::GATEWAY_REQUESTER_PREFIX;
    if id.chars().count() > longest {
        return Err(format!(
            "is longer than {longest} characters, the longest a daemon takes (through a gateway)"
        ));
    }
    simlock_contract::bounds::printable(id, &()).map_err(|e| e.to_string())
}

/// What the end of a session did with the leases it held: released, ended by the daemon
/// already, or left held (the daemon did not answer within the close bound, or refused).
fn closing_words(held: &[(String, Standing)]) -> String {
    if held.is_empty() {
        return "it held no lease".to_owned();
    }
    let ids = |pick: fn(&Standing) -> bool| {
        held.iter()
            .filter(|(_, standing)| pick(standing))
            .map(|(id, _)| id.as_str())
            .collect::<Vec<_>>()
            .join(", ")
    };
    let released = ids(|s| *s == Standing::Released);
    let ended = ids(|s| matches!(s, Standing::Lost(_)));
    let kept = ids(|s| matches!(s, Standing::Held | Standing::Failed(_)));
    let mut parts = Vec::new();
    if !released.is_empty() {
        parts.push(format!("released {released}"));
    }
    if !ended.is_empty() {
        parts.push(format!("{ended} had ended already"));
    }
    if !kept.is_empty() {
        parts.push(format!(
            "could not release {kept}: it ends on its TTL, or `simlock release <id>` ends it"
        ));
    }
    parts.join("; ")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_requester_no_daemon_takes_is_refused_at_start() {
        assert_eq!(check_requester("claude-code:6f1c"), Ok(()));
        assert_eq!(check_requester(&"a".repeat(216)), Ok(()));
        let long = check_requester(&"a".repeat(217)).unwrap_err();
        assert!(long.contains("216"), "{long}");
        let control = check_requester("a\u{1b}b").unwrap_err();
        assert!(control.contains("control"), "{control}");
    }

    #[test]
    fn the_closing_line_says_what_became_of_each_lease() {
        let lost = ContractError::connection_lost();
        assert_eq!(closing_words(&[]), "it held no lease");
        assert_eq!(
            closing_words(&[("lse_a".into(), Standing::Released)]),
            "released lse_a"
        );
        assert_eq!(
            closing_words(&[
                ("lse_a".into(), Standing::Released),
                ("lse_b".into(), Standing::Lost(None)),
                ("lse_c".into(), Standing::Failed(lost)),
                ("lse_d".into(), Standing::Held),
            ]),
            "released lse_a; lse_b had ended already; could not release lse_c, lse_d: it ends on its TTL, or `simlock release <id>` ends it"
        );
    }
}
