//! Who a lease is for when the command line names no requester: the agent's own session, read
//! from the session-id variable its agent CLI exports, else the process that started us. Two
//! agents of one user then hold a lease each instead of the second one hearing
//! `REQUESTER_ALREADY_LEASED` (the socket's default requester is the OS user).
//!
//! [`AGENT_SESSIONS`] is the one list of the variables read (`docs/MCP.md` shows it, and a test
//! keeps the two in step); the resolution is plain data ([`resolve`]) so it is tested without
//! touching the environment.

use simlock_contract::{ContractError, ErrorCode};

/// A session-id variable an agent CLI exports to the processes it starts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct AgentSession {
    /// The variable.
    pub(crate) variable: &'static str,
    /// The agent, as it appears in the requester id (`<agent>:<session id>`).
    pub(crate) agent: &'static str,
}

/// The session-id variables read, in order: the first one set names the requester.
///
/// What each agent CLI really exports (checked against each project's sources and issue
/// trackers): Claude Code exports `CLAUDE_CODE_SESSION_ID` to its Bash tool (2.1.132) and to the
/// stdio MCP servers it starts (2.1.154); Codex exports `CODEX_THREAD_ID` to the commands its
/// shell tool runs, but not to MCP servers; Cursor's agent sets `CURSOR_CONVERSATION_ID` in its
/// shell commands (undocumented; not in MCP servers); Gemini CLI documents `GEMINI_SESSION_ID` for
/// hooks only. Where an agent exports none to a process, the parent process stands in (for an MCP
/// server, that is the agent itself).
pub(crate) const AGENT_SESSIONS: &[AgentSession] = &[
    AgentSession {
        variable: "CLAUDE_CODE_SESSION_ID",
        agent: "claude-code",
    },
    AgentSession {
        variable: "CODEX_THREAD_ID",
        agent: "codex",
    },
    AgentSession {
        variable: "CURSOR_CONVERSATION_ID",
        agent: "cursor",
    },
    AgentSession {
        variable: "GEMINI_SESSION_ID",
        agent: "gemini",
    },
];

/// The longest session id taken from a variable. Longer values (no agent CLI exports one; they are
/// UUIDs) are passed over, so the requester stays inside the contract's bound with room for a
/// gateway's prefix (ADR 0009).
pub(crate) const MAX_SESSION_ID: usize = 128;

/// Where a requester id came from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Requester {
    /// `--requester` or `SIMLOCK_AGENT_ID`.
    Explicit(String),
    /// An agent CLI's session variable.
    AgentSession {
        /// The variable's entry.
        session: AgentSession,
        /// Its value.
        id: String,
    },
    /// The process that started us, on this host.
    ParentProcess {
        /// Its pid.
        pid: u32,
        /// This host's name.
        host: String,
    },
}

impl Requester {
    /// The requester id sent with `lease.request`.
    pub(crate) fn id(&self) -> String {
        match self {
            Self::Explicit(id) => id.clone(),
            Self::AgentSession { session, id } => format!("{}:{id}", session.agent),
            Self::ParentProcess { pid, host } => format!("pid:{pid}@{host}"),
        }
    }

    /// `err` with what to do when it is `REQUESTER_ALREADY_LEASED` and this requester was not
    /// named: two leases from one shell script or one agent session share a requester unless
    /// each names its own.
    pub(crate) fn explain(&self, mut err: ContractError) -> ContractError {
        if err.code == ErrorCode::RequesterAlreadyLeased && !matches!(self, Self::Explicit(_)) {
            err.message = format!(
                "{}; this requester came {}: give each lease its own with --requester ID (or \
                 SIMLOCK_AGENT_ID)",
                err.message,
                self.source()
            );
        }
        err
    }

    /// Where it came from, for people.
    pub(crate) fn source(&self) -> String {
        match self {
            Self::Explicit(_) => "named explicitly".to_owned(),
            Self::AgentSession { session, .. } => format!("from ${}", session.variable),
            Self::ParentProcess { pid, .. } => format!("from the parent process ({pid})"),
        }
    }
}

/// Whether a session variable's value can name a requester.
fn usable(value: &str) -> bool {
    !value.is_empty()
        && value.chars().count() <= MAX_SESSION_ID
        && value.chars().all(|c| c.is_ascii_graphic())
}

/// The variable that names the requester when `--requester` does not.
pub(crate) const AGENT_ID: &str = "SIMLOCK_AGENT_ID";

/// The requester: `explicit` (`--requester`) when given and not blank, else [`AGENT_ID`] when
/// `var` answers it not blank, else the first usable agent session variable, else the parent
/// process `parent` on `host`.
pub(crate) fn resolve(
    explicit: Option<&str>,
    var: impl Fn(&str) -> Option<String>,
    parent: u32,
    host: &str,
) -> Requester {
    let named = explicit
        .map(str::to_owned)
        .or_else(|| var(AGENT_ID))
        .map(|id| id.trim().to_owned())
        .filter(|id| !id.is_empty());
    if let Some(id) = named {
        return Requester::Explicit(id);
    }
    for session in AGENT_SESSIONS {
        if let Some(id) = var(session.variable).map(|v| v.trim().to_owned())
            && usable(&id)
        {
            return Requester::AgentSession {
                session: *session,
                id,
            };
        }
    }
    Requester::ParentProcess {
        pid: parent,
        host: host.to_owned(),
    }
}

/// [`resolve`] against this process's environment, parent and host.
pub(crate) fn from_environment(explicit: Option<&str>) -> Requester {
    let parent =
        rustix::process::getppid().map_or(0, |pid| pid.as_raw_nonzero().get().unsigned_abs());
    let uname = rustix::system::uname();
    let host = uname.nodename().to_string_lossy();
    let host = host
        .split('.')
        .next()
        .filter(|h| !h.is_empty())
        .unwrap_or("localhost");
    resolve(explicit, |name| std::env::var(name).ok(), parent, host)
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use super::*;

    fn env(vars: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
        let vars: HashMap<String, String> = vars
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect();
        move |name| vars.get(name).cloned()
    }

    #[test]
    fn a_requester_already_leased_says_how_to_name_another_unless_it_was_named() {
        let taken = || {
            ContractError::new(
                ErrorCode::RequesterAlreadyLeased,
                "Requester pid:42@vm already holds lease lse_1",
            )
        };
        let parent = Requester::ParentProcess {
            pid: 42,
            host: "vm".into(),
        };
        assert_eq!(
            parent.explain(taken()).message,
            "Requester pid:42@vm already holds lease lse_1; this requester came from the parent \
             process (42): give each lease its own with --requester ID (or SIMLOCK_AGENT_ID)"
        );
        let named = Requester::Explicit("pid:42@vm".into());
        assert_eq!(named.explain(taken()), taken(), "it was named: as it is");
        let other = ContractError::new(ErrorCode::NoCapacity, "none");
        assert_eq!(
            parent.explain(other.clone()),
            other,
            "other errors: as they are"
        );
    }

    #[test]
    fn an_explicit_requester_wins() {
        let r = resolve(
            Some("agent-7"),
            env(&[("CLAUDE_CODE_SESSION_ID", "s1")]),
            42,
            "mac",
        );
        assert_eq!(r, Requester::Explicit("agent-7".into()));
        assert_eq!(r.id(), "agent-7");
    }

    #[test]
    fn a_blank_explicit_requester_is_none() {
        let r = resolve(Some("  "), env(&[("CODEX_THREAD_ID", "t1")]), 42, "mac");
        assert_eq!(r.id(), "codex:t1");
    }

    #[test]
    fn the_agent_id_variable_names_the_requester_unless_blank() {
        let r = resolve(
            None,
            env(&[(AGENT_ID, " agent-9 "), ("CODEX_THREAD_ID", "t1")]),
            42,
            "mac",
        );
        assert_eq!(r, Requester::Explicit("agent-9".into()));
        let r = resolve(Some("agent-7"), env(&[(AGENT_ID, "agent-9")]), 42, "mac");
        assert_eq!(r.id(), "agent-7", "--requester wins over the variable");
        // An agent's configuration that leaves the variable empty means "unset".
        let r = resolve(
            None,
            env(&[(AGENT_ID, ""), ("CODEX_THREAD_ID", "t1")]),
            42,
            "mac",
        );
        assert_eq!(r.id(), "codex:t1");
    }

    #[test]
    fn each_agent_session_variable_names_its_agent() {
        for (variable, expected) in [
            ("CLAUDE_CODE_SESSION_ID", "claude-code:abc"),
            ("CODEX_THREAD_ID", "codex:abc"),
            ("CURSOR_CONVERSATION_ID", "cursor:abc"),
            ("GEMINI_SESSION_ID", "gemini:abc"),
        ] {
            let r = resolve(None, env(&[(variable, "abc")]), 42, "mac");
            assert_eq!(r.id(), expected);
            assert_eq!(r.source(), format!("from ${variable}"));
        }
    }

    #[test]
    fn the_list_order_decides_between_two_variables() {
        let r = resolve(
            None,
            env(&[("CODEX_THREAD_ID", "t1"), ("CLAUDE_CODE_SESSION_ID", "s1")]),
            42,
            "mac",
        );
        assert_eq!(r.id(), "claude-code:s1");
    }

    #[test]
    fn without_a_session_the_parent_process_stands_in() {
        let r = resolve(None, env(&[]), 4242, "mac");
        assert_eq!(r.id(), "pid:4242@mac");
        assert_eq!(r.source(), "from the parent process (4242)");
    }

    #[test]
    fn unusable_session_values_are_passed_over() {
        let long = "x".repeat(MAX_SESSION_ID + 1);
        for bad in ["", "   ", "has space", "tab\there", long.as_str()] {
            let r = resolve(
                None,
                env(&[("CLAUDE_CODE_SESSION_ID", bad), ("CODEX_THREAD_ID", "t1")]),
                42,
                "mac",
            );
            assert_eq!(r.id(), "codex:t1", "{bad:?}");
        }
        let at_limit = "x".repeat(MAX_SESSION_ID);
        let r = resolve(None, env(&[("GEMINI_SESSION_ID", &at_limit)]), 42, "mac");
        assert_eq!(r.id(), format!("gemini:{at_limit}"));
    }

    #[test]
    fn docs_mcp_lists_every_session_variable_in_order() {
        let doc = include_str!("../../../docs/MCP.md");
        let rows: Vec<&str> = doc
            .lines()
            .filter(|l| l.starts_with("| `") && l.contains("` | "))
            .filter(|l| {
                AGENT_SESSIONS
                    .iter()
                    .any(|s| l.starts_with(&format!("| `{}`", s.variable)))
            })
            .collect();
        assert_eq!(
            rows.len(),
            AGENT_SESSIONS.len(),
            "docs/MCP.md's table of session variables"
        );
        for (row, session) in rows.iter().zip(AGENT_SESSIONS) {
            assert!(
                row.starts_with(&format!("| `{}`", session.variable)),
                "{row}"
            );
            assert!(row.contains(&format!("`{}:<id>`", session.agent)), "{row}");
        }
    }

    #[test]
    fn every_id_fits_the_requester_bound_through_a_gateway() {
        // 256 characters, less `gw:<uuid>:` (ADR 0009).
        let room = 256 - "gw:00000000-0000-0000-0000-000000000000:".len();
        let longest_agent = AGENT_SESSIONS
            .iter()
            .map(|s| s.agent.len())
            .max()
            .unwrap_or(0);
        assert!(longest_agent + 1 + MAX_SESSION_ID <= room);
    }
}
